//! How much memory does a set of policies take? Every slot's buffers, every connection's, the
//! model as stored and the engine's own, as a formula and a number, checked against
//! `server.memory_budget_mb` (what `check-config` prints).

use std::sync::Arc;

use super::Policy;
use crate::bind::Plan;
use crate::config::{Config, ConfigError, PolicySpec, invalid};
use crate::limits::{FRAME_GUARD_BUFFER, WS_READ_BUFFER};

/// The memory policyd allocates for a config, as a formula and a number.
#[derive(Clone, Debug, PartialEq)]
pub struct Budget {
    pub lines: Vec<(String, u64)>,
    pub total: u64,
    /// Of `total`, the connections' buffers (shared by all policies of a server).
    pub connections: u64,
}

impl Budget {
    /// The memory `policy` allocates for `plan` under `cfg`'s server limits: slots,
    /// connections and the model.
    pub fn compute(cfg: &Config, policy: &PolicySpec, plan: &Plan) -> Budget {
        let (io, reply, scratch, metadata) = (
            &plan.io,
            plan.reply_capacity,
            plan.scratch_bytes,
            plan.metadata.len(),
        );
        // The engine's inputs and the request path's own host buffers (a prompt's text).
        let inputs: u64 = io.inputs.iter().map(|s| s.bytes() as u64).sum::<u64>()
            + plan.host_buffers.iter().map(|&b| b as u64).sum::<u64>();
        let outputs: u64 = io.outputs.iter().map(|s| s.bytes() as u64).sum();
        let reply = reply as u64;
        let scratch = scratch as u64;
        let slots = policy.engine.slots as u64;
        let conns = cfg.server.max_connections as u64;
        let msg = cfg.server.max_message_bytes as u64;
        // A pipeline's step graph counts with the prefix.
        let model = policy.model.size() + policy.pipeline.as_ref().map_or(0, |p| p.denoise.size());
        let guard = FRAME_GUARD_BUFFER as u64;
        let sessions = std::mem::size_of::<crate::runtime::session::Sessions>() as u64;
        // tungstenite's write buffer: its largest frame and the slack beside it (the bound the
        // HTTP layer sets; a peer that never reads cannot grow it past this).
        let write = plan.write_buffer() as u64;
        let per_conn =
            msg + WS_READ_BUFFER as u64 + guard + 2 * reply + metadata as u64 + sessions + write;
        let lines = vec![
            (
                format!(
                    "slots        {slots} × (inputs {inputs} + outputs {outputs} + reply {reply} + scratch {scratch})"
                ),
                slots * (inputs + outputs + reply + scratch),
            ),
            (
                format!(
                    "connections  {conns} × (max_message_bytes {msg} + read buffer {WS_READ_BUFFER} + frame guard {guard} + 2 × reply {reply} + metadata {metadata} + session table {sessions} + write buffer {write})"
                ),
                conns * per_conn,
            ),
            ("model        weights as stored".to_string(), model),
        ];
        let mut lines = lines;
        if let Some(t) = plan.tokens.and_then(|i| plan.inputs[i].tokens.as_ref()) {
            // A session's cache: the prompt's text, its ids before truncation (at most one a
            // byte, plus BOS and the pi0 newline), the state's bins. Allocated at the
            // session's first prompt, never past this.
            let state = t.state_values(&plan.inputs);
            let per_session = (t.prompt_bytes + 4 * (t.prompt_bytes + 16) + 2 * state) as u64;
            let sessions = cfg.server.max_sessions as u64;
            lines.push((
                format!("prompts      {conns} × {sessions} sessions × token cache {per_session}"),
                conns * sessions * per_session,
            ));
            lines.push(("tokenizer    file as stored".to_string(), t.file_size));
        }
        if plan.history_bytes > 0 {
            // Each session's previous frames (`history`), allocated at its first request.
            let sessions = cfg.server.max_sessions as u64;
            let per_session = plan.history_bytes as u64;
            lines.push((
                format!(
                    "history      {conns} × {sessions} sessions × previous frames {per_session}"
                ),
                conns * sessions * per_session,
            ));
        }
        if let Some(r) = plan.rtc {
            // `[rtc]`: each session's previous chunk (sized at the session's start, reused
            // after) and each slot's leftover, both the sample's size in float32.
            let chunk = (4 * r.rows * r.width) as u64;
            let sessions = cfg.server.max_sessions as u64;
            lines.push((
                format!(
                    "rtc          ({conns} × {sessions} sessions + {slots} slots) × chunk {chunk}"
                ),
                (conns * sessions + slots) * chunk,
            ));
        }
        if let Some(g) = plan.planner.as_ref().and_then(|t| t.geometry) {
            lines.push((
                "planner      camera frame handed to the planner".to_string(),
                g.bytes() as u64,
            ));
        }
        let total = lines.iter().map(|(_, v)| v).sum();
        Budget {
            lines,
            total,
            connections: conns * per_conn,
        }
    }

    /// Adds the engine's own memory (see [`crate::engine::Engine::working_memory`]).
    pub fn add(&mut self, lines: Vec<(String, u64)>) {
        for (what, v) in lines {
            self.total += v;
            self.lines.push((what, v));
        }
    }

    pub fn render(&self) -> String {
        let mut s = String::from("memory budget (bytes):\n");
        for (what, v) in &self.lines {
            s.push_str(&format!("  {what} = {v}\n"));
        }
        s.push_str(&format!(
            "  total = {} ({:.1} MiB); not counted: the binary, thread stacks and the \
             allocator's overhead\n",
            self.total,
            self.total as f64 / (1024.0 * 1024.0)
        ));
        s
    }
}

/// The set's memory: every policy's slots, model and engine memory, plus the connection
/// buffers once (connections are shared; each is sized for the largest policy). Checked
/// against `server.memory_budget_mb` when set.
pub fn check_budget(cfg: &Config, policies: &[Arc<Policy>]) -> Result<u64, ConfigError> {
    let items: Vec<(&str, &Budget)> = policies
        .iter()
        .map(|p| (p.name.as_str(), &p.budget))
        .collect();
    budget_of(cfg, &items)
}

/// [`check_budget`] over named budgets (what `check-config` has before any engine runs).
pub fn budget_of(cfg: &Config, items: &[(&str, &Budget)]) -> Result<u64, ConfigError> {
    let conns = items.iter().map(|(_, b)| b.connections).max().unwrap_or(0);
    let own = |b: &Budget| b.total - b.connections;
    let total = conns + items.iter().map(|(_, b)| own(b)).sum::<u64>();
    let limit = cfg.server.memory_budget_mb * 1024 * 1024;
    if limit > 0 && total > limit {
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        let each = items
            .iter()
            .map(|(name, b)| format!("{name} {:.1} MiB", mib(own(b))))
            .collect::<Vec<_>>()
            .join(", ");
        return Err(invalid(
            "server.memory_budget_mb",
            format!(
                "the policies need {:.1} MiB ({each}; connection buffers {:.1} MiB) but the \
                 budget is {} MiB: serve fewer or smaller policies, fewer slots or connections, \
                 or raise the budget",
                mib(total),
                mib(conns),
                cfg.server.memory_budget_mb
            ),
        ));
    }
    Ok(total)
}

/// The file descriptors a config's caps may hold open at once: WebSocket connections and the
/// handshakes in progress beside them, LeRobot's gRPC connections, and a reserve for the rest
/// of the process. Start-up raises `RLIMIT_NOFILE` to the total, and `check-config` prints it,
/// so that a flood of connections is refused by policyd's caps, never by the kernel's limit
/// (which would stop `accept` on every listener, `/healthz` included).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FdBudget {
    pub lines: Vec<(String, u64)>,
    pub total: u64,
}

impl FdBudget {
    pub fn compute(cfg: &Config) -> FdBudget {
        let ws = cfg.server.max_connections;
        let hs = crate::limits::handshakes(ws);
        let mut lines = vec![(
            format!("WebSocket    server.max_connections {ws} + handshakes in progress {hs}"),
            (ws + hs) as u64,
        )];
        if let Some(l) = &cfg.lerobot {
            lines.push((
                format!("gRPC         lerobot.max_connections {}", l.max_connections),
                l.max_connections as u64,
            ));
        }
        lines.push((
            "process      listeners, epoll, timers, logs, libraries".to_string(),
            crate::limits::RESERVED_FDS as u64,
        ));
        let total = lines.iter().map(|(_, v)| v).sum();
        FdBudget { lines, total }
    }

    /// The lines `check-config` prints, with this process's limits (`soft`, `hard`) against
    /// the total.
    pub fn render(&self, soft: u64, hard: u64) -> String {
        let mut s = String::from("file descriptors:\n");
        for (what, v) in &self.lines {
            s.push_str(&format!("  {what} = {v}\n"));
        }
        s.push_str(&format!(
            "  total = {}; RLIMIT_NOFILE here {soft} soft, {hard} hard: {}\n",
            self.total,
            if soft >= self.total {
                "enough".to_string()
            } else if hard >= self.total {
                "policyd raises the soft limit at start-up".to_string()
            } else {
                format!(
                    "too low: set LimitNOFILE={} in the unit (sudo systemctl edit policyd) or lower \
                     server.max_connections / lerobot.max_connections",
                    self.total
                )
            }
        ));
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: &str) -> Config {
        Config::parse(
            &format!(
                "[server]\nmax_connections = 8\n[engine]\nmodel = \"m.onnx\"\n\
                 [[inputs]]\nkey = \"state\"\ntensor = \"state\"\ndtypes = [\"float32\"]\nshape = [8]\n\
                 [[outputs]]\ntensor = \"actions\"\n{extra}"
            ),
            "test",
            None,
        )
        .expect("a config")
    }

    #[test]
    fn file_descriptors_are_counted_from_every_cap() {
        // 8 connections + 16 × 8 + 64 handshakes + 64 reserved.
        let ws = FdBudget::compute(&cfg(""));
        assert_eq!(ws.total, 8 + 192 + 64);
        let both = FdBudget::compute(&cfg(
            "[lerobot]\nlisten = \"127.0.0.1:8080\"\nmax_connections = 100",
        ));
        assert_eq!(both.total, ws.total + 100);
        assert!(both.render(1024, 4096).contains("enough"));
        assert!(
            both.render(100, 4096)
                .contains("policyd raises the soft limit at start-up")
        );
        assert!(both.render(100, 200).contains("LimitNOFILE=364"));
    }

    #[test]
    fn the_open_file_limit_is_raised_as_far_as_the_hard_limit() {
        let (soft, hard) = crate::service::raise_open_files(0).expect("getrlimit");
        assert!(soft <= hard);
        let (raised, _) = crate::service::raise_open_files(soft + 1).expect("setrlimit");
        assert_eq!(raised, (soft + 1).min(hard));
    }
}

/// What the machine lets this process have: its cgroup's memory limit (systemd's `MemoryMax=`)
/// less what the cgroup uses already, and the kernel's `MemAvailable`. `None` where there is
/// no limit or it cannot be read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryRoom {
    /// `(limit, in use)` of the cgroup, in bytes.
    pub cgroup: Option<(u64, u64)>,
    pub available: Option<u64>,
}

impl MemoryRoom {
    /// Reads `/proc/self/cgroup` (cgroup v2's `memory.max`/`memory.current`, or v1's
    /// `memory.limit_in_bytes`/`memory.usage_in_bytes`) and `/proc/meminfo`.
    pub fn read() -> MemoryRoom {
        let read = |p: &str| std::fs::read_to_string(p).ok();
        let cgroup = read("/proc/self/cgroup").and_then(|text| {
            let (dir, v2) = cgroup_memory_dir(&text)?;
            let file = |name: &str| read(&format!("{dir}/{name}"));
            let (limit, usage) = if v2 {
                (file("memory.max")?, file("memory.current")?)
            } else {
                (
                    file("memory.limit_in_bytes")?,
                    file("memory.usage_in_bytes")?,
                )
            };
            let limit: u64 = limit.trim().parse().ok()?;
            // cgroup v1 says "no limit" with a huge number (a page-rounded i64::MAX).
            (limit < 1 << 60).then_some((limit, usage.trim().parse().unwrap_or(0)))
        });
        let available = read("/proc/meminfo").and_then(|m| mem_available(&m));
        MemoryRoom { cgroup, available }
    }

    /// Refuses `need` bytes (`what` they are, for the message) where the cgroup's headroom or
    /// the machine's available memory is smaller, naming both figures and what to change.
    pub fn check(&self, what: &str, need: u64) -> Result<(), String> {
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        if let Some((limit, used)) = self.cgroup {
            let room = limit.saturating_sub(used);
            if need > room {
                return Err(format!(
                    "{what} need {:.1} MiB but the service's memory limit (MemoryMax=) of \
                     {:.1} MiB leaves {:.1} MiB: raise MemoryMax= (sudo systemctl edit policyd) \
                     or serve a smaller policy",
                    mib(need),
                    mib(limit),
                    mib(room)
                ));
            }
        }
        if let Some(available) = self.available
            && need > available
        {
            return Err(format!(
                "{what} need {:.1} MiB but this machine has {:.1} MiB available: free memory or \
                 serve a smaller policy",
                mib(need),
                mib(available)
            ));
        }
        Ok(())
    }
}

/// The directory of this process's memory controller in `/proc/self/cgroup`'s text, and
/// whether it is cgroup v2.
fn cgroup_memory_dir(text: &str) -> Option<(String, bool)> {
    let v1 = text.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
        controllers
            .split(',')
            .any(|c| c == "memory")
            .then(|| format!("/sys/fs/cgroup/memory{path}"))
    });
    if let Some(dir) = v1 {
        return Some((dir, false));
    }
    let path = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    Some((
        format!("/sys/fs/cgroup{}", path.trim_end_matches('/')),
        true,
    ))
}

/// `MemAvailable` from `/proc/meminfo`'s text, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod room_tests {
    use super::*;

    #[test]
    fn the_cgroup_is_found_in_v1_and_v2() {
        assert_eq!(
            cgroup_memory_dir("0::/system.slice/policyd.service\n"),
            Some(("/sys/fs/cgroup/system.slice/policyd.service".into(), true))
        );
        assert_eq!(
            cgroup_memory_dir("5:cpuset:/\n4:memory:/system.slice/policyd.service\n0::/\n"),
            Some((
                "/sys/fs/cgroup/memory/system.slice/policyd.service".into(),
                false
            ))
        );
        assert_eq!(
            mem_available("MemTotal: 100 kB\nMemAvailable:   2048 kB\n"),
            Some(2 << 20)
        );
    }

    #[test]
    fn a_policy_over_the_limit_or_the_memory_is_refused_naming_both_figures() {
        let room = MemoryRoom {
            cgroup: Some((2 << 30, 1 << 30)),
            available: Some(8 << 30),
        };
        assert!(room.check("the weights", 512 << 20).is_ok());
        let e = room.check("the weights", 3 << 30).unwrap_err();
        assert!(e.contains("3072.0 MiB") && e.contains("2048.0 MiB"), "{e}");
        assert!(e.contains("MemoryMax="), "{e}");
        let tight = MemoryRoom {
            cgroup: None,
            available: Some(1 << 30),
        };
        let e = tight.check("the weights", 3 << 30).unwrap_err();
        assert!(e.contains("1024.0 MiB available"), "{e}");
        assert!(MemoryRoom::default().check("anything", u64::MAX).is_ok());
    }
}
