//! How fast does a server answer a robot? `policyd-bench` (also run as `policyd bench`)
//! measures any OpenPI-protocol server (policyd or another) the way a robot uses it, and
//! compares servers fairly on one machine. A crate of its own: the serving binary links none
//! of it.
//!
//! Requests are pre-encoded ([`profile`]), sent closed- or open-loop over N connections
//! ([`load`]), recorded in HDR histograms, and reported with the server's CPU per request
//! ([`cpu`]) as a table or JSON ([`report`]) and an SVG plot ([`plot`]). Several targets
//! (`--compare`, and `--floor`, the built-in transport floor of [`floor`]) are measured in
//! turn, A B A B …, so drift on a noisy machine hits them alike and their ratios stay fair.

pub mod cpu;
pub mod floor;
pub mod load;
pub mod plot;
pub mod profile;
pub mod report;

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use load::{LoadSpec, Outcome};
use policyd::config::Config;
use profile::{FramePool, Profile};
use report::{Figures, Report, RunInfo};

/// The `bench` subcommand's arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// The server to measure.
    #[arg(default_value = "ws://127.0.0.1:8000")]
    pub url: String,
    /// Observation profile: aloha, droid, libero, tiny, flow or diffusion. With the global --config, the
    /// config's [[inputs]] are sent instead.
    #[arg(long, default_value = "aloha")]
    pub profile: String,
    /// Concurrent connections.
    #[arg(long, short = 'c', default_value_t = 1)]
    pub connections: usize,
    /// Open loop: requests per second per connection (a control loop's rate, e.g. 50).
    /// Latency is measured from the intended send time. 0: closed loop, back to back.
    #[arg(long, default_value_t = 0.0)]
    pub rate: f64,
    /// Seconds measured per target (split over the rounds).
    #[arg(long, default_value_t = 10.0)]
    pub duration: f64,
    /// Seconds of warm-up before measuring (not recorded); later rounds warm up for 1 s at
    /// most.
    #[arg(long, default_value_t = 2.0)]
    pub warmup: f64,
    /// Open loop: every connection sends at the same instants (a burst each period) instead
    /// of spread evenly over the period.
    #[arg(long)]
    pub burst: bool,
    /// Count replies slower than this as misses (default with --rate: one period).
    #[arg(long)]
    pub budget_ms: Option<f64>,
    /// A second server to measure in turn with the first, with the ratio of every figure.
    #[arg(long)]
    pub compare: Option<String>,
    /// Also measure the transport floor: a built-in WebSocket endpoint that answers every frame
    /// with a fixed reply of the first target's reply size, without decoding.
    #[arg(long)]
    pub floor: bool,
    /// Rounds taking the targets in turn (default: 1 for one target, 4 for several).
    #[arg(long)]
    pub rounds: Option<usize>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Write an SVG plot of latency over time and by percentile.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Send `Authorization: Api-Key <key>` (the `[auth]` of a protected server).
    #[arg(long)]
    pub api_key: Option<String>,
    /// The first target's server process, for its CPU time (default: found by port when the
    /// server is on this machine).
    #[arg(long)]
    pub pid: Option<u32>,
    /// The --compare server's process.
    #[arg(long)]
    pub compare_pid: Option<u32>,
    /// The first target's name in the report.
    #[arg(long, default_value = "A")]
    pub name: String,
    /// The --compare target's name in the report.
    #[arg(long, default_value = "B")]
    pub compare_name: String,
}

/// Why a benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{0}")]
    Usage(String),
    #[error("'{0}' is not a WebSocket URL (ws://host:port): {1}")]
    Url(String, String),
    #[error("cannot connect to {0}: {1}")]
    Connect(String, String),
    #[error(
        "{url} did not answer the '{profile}' profile's observation with actions: {error}\n\
         (choose the observation the server expects: --profile aloha|droid|libero|tiny, or \
         --config with the server's policyd config)"
    )]
    Rejected {
        url: String,
        profile: String,
        error: String,
    },
    #[error("a connection was lost during the run: {0}")]
    Lost(String),
    #[error("the transport floor did not start: {0}")]
    Floor(String),
    #[error("{0}")]
    Plot(String),
}

/// One server being measured.
struct Target {
    name: String,
    url: String,
    pid: Option<u32>,
    outcome: Outcome,
    cpu: Option<Duration>,
}

impl Target {
    /// A target whose server process is `pid`, or, when not given, the process listening on
    /// the URL's port on this machine.
    fn new(name: &str, url: &str, pid: Option<u32>) -> Target {
        Target {
            name: name.to_string(),
            url: url.to_string(),
            pid: pid.or_else(|| local_port(url).and_then(cpu::listener_pid)),
            outcome: Outcome::new(),
            cpu: Some(Duration::ZERO),
        }
    }
}

/// The transport floor process, stopped when dropped.
struct FloorProcess(Child);

impl Drop for FloorProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the floor (`policyd-bench floor`) on a free loopback port; returns it and its URL.
fn start_floor(
    bench: &[OsString],
    actions: &[usize],
) -> Result<(FloorProcess, String), BenchError> {
    let shape: Vec<String> = actions.iter().map(|d| d.to_string()).collect();
    let (program, leading) = bench
        .split_first()
        .ok_or_else(|| BenchError::Floor("no command to run policyd-bench".into()))?;
    let child = Command::new(program)
        .args(leading)
        .args([
            "floor",
            "--listen",
            "127.0.0.1:0",
            "--actions",
            &shape.join("x"),
        ])
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .map_err(|e| BenchError::Floor(format!("cannot run {}: {e}", program.to_string_lossy())))?;
    let mut p = FloorProcess(child);
    let out =
        p.0.stdout
            .take()
            .ok_or_else(|| BenchError::Floor("no stdout".into()))?;
    let mut line = String::new();
    BufReader::new(out)
        .read_line(&mut line)
        .map_err(|e| BenchError::Floor(e.to_string()))?;
    let addr = line
        .trim()
        .strip_prefix(floor::READY)
        .ok_or_else(|| BenchError::Floor(format!("it printed '{}'", line.trim())))?;
    Ok((p, format!("ws://{addr}")))
}

/// The port of a `ws://` URL whose host is this machine, for finding the server's pid.
fn local_port(url: &str) -> Option<u16> {
    let rest = url
        .strip_prefix("ws://")
        .or_else(|| url.strip_prefix("wss://"))?;
    let authority = rest.split('/').next()?;
    let (host, port) = authority.rsplit_once(':')?;
    let local = matches!(host, "127.0.0.1" | "localhost" | "[::1]" | "0.0.0.0");
    local.then(|| port.parse().ok()).flatten()
}

impl BenchArgs {
    fn check(&self) -> Result<(), BenchError> {
        let bad = |m: &str| Err(BenchError::Usage(m.to_string()));
        if self.connections == 0 || self.connections > 1024 {
            return bad("--connections must be between 1 and 1024");
        }
        if !self.rate.is_finite() || self.rate < 0.0 || self.rate > 100_000.0 {
            return bad("--rate must be 0 (closed loop) or a rate in Hz up to 100000");
        }
        if !self.duration.is_finite() || self.duration <= 0.0 || self.duration > 86_400.0 {
            return bad("--duration must be more than 0 s and at most a day");
        }
        if !self.warmup.is_finite() || self.warmup < 0.0 || self.warmup > 3600.0 {
            return bad("--warmup must be between 0 and 3600 s");
        }
        if self.budget_ms.is_some_and(|b| !b.is_finite() || b <= 0.0) {
            return bad("--budget-ms must be a positive number of milliseconds");
        }
        if self.rounds.is_some_and(|r| r == 0 || r > 1000) {
            return bad("--rounds must be between 1 and 1000");
        }
        Ok(())
    }
}

/// Runs the benchmark `args` describe. `config` (`--config`) supplies the observation;
/// `bench` is the command that runs policyd-bench (the binary, after an emulator when there
/// is one), started as `floor` for `--floor`.
pub fn run(
    args: &BenchArgs,
    config: Option<&Config>,
    bench: &[OsString],
) -> Result<Report, BenchError> {
    args.check()?;
    let profile = match config {
        // With `[[policies]]`, the default policy's inputs (the one a plain URL reaches).
        Some(cfg) => {
            Profile::from_config("config", cfg.default_policy()).map_err(BenchError::Usage)?
        }
        None => Profile::built_in(&args.profile).ok_or_else(|| {
            BenchError::Usage(format!(
                "unknown --profile '{}': choose one of {}",
                args.profile,
                profile::BUILT_IN.join(", ")
            ))
        })?,
    };
    let rate = (args.rate > 0.0).then_some(args.rate);
    let budget_ms = args.budget_ms.or(rate.map(|r| 1000.0 / r));
    let several = args.compare.is_some() || args.floor;
    let rounds = args.rounds.unwrap_or(if several { 4 } else { 1 });
    let spec = LoadSpec {
        connections: args.connections,
        rate_hz: rate,
        warmup: Duration::from_secs_f64(args.warmup),
        measure: Duration::from_secs_f64(args.duration / rounds as f64),
        budget: budget_ms.map(|b| Duration::from_secs_f64(b / 1000.0)),
        burst: args.burst,
        api_key: args.api_key.clone(),
    };

    // Probe every server once: a wrong profile fails here with the server's own message.
    let mut targets = vec![Target::new(&args.name, &args.url, args.pid)];
    let first_reply = load::probe(&args.url, &spec, &profile)?;
    if let Some(url) = &args.compare {
        load::probe(url, &spec, &profile)?;
        targets.push(Target::new(&args.compare_name, url, args.compare_pid));
    }
    let mut _floor = None;
    if args.floor {
        let shape = load::actions_shape(&first_reply).unwrap_or_else(|| vec![50, 14]);
        let (p, url) = start_floor(bench, &shape)?;
        let pid = p.0.id();
        _floor = Some(p);
        targets.push(Target::new("floor", &url, Some(pid)));
    }

    let frame_bytes = profile.encode(1).0.len();
    let per_conn = ((256usize << 20) / (frame_bytes * args.connections).max(1)).clamp(2, 16);
    let mut pools: Vec<FramePool> = (0..args.connections as u64)
        .map(|c| FramePool::new(&profile, c, per_conn))
        .collect();

    for round in 0..rounds {
        for t in targets.iter_mut() {
            let mut s = spec.clone();
            if round > 0 {
                s.warmup = s.warmup.min(Duration::from_secs(1));
            }
            let (o, cpu, back) = phase(&t.url, t.pid, &s, pools)?;
            pools = back;
            t.outcome.merge(o, false);
            t.cpu = match (t.cpu, cpu) {
                (Some(a), Some(b)) => Some(a + b),
                _ => None,
            };
        }
    }

    let figures: Vec<Figures> = targets
        .iter()
        .map(|t| {
            let mut f = Figures::new(
                &t.name,
                &t.url,
                t.pid,
                &t.outcome,
                t.cpu.filter(|_| t.pid.is_some()).map(|d| d.as_secs_f64()),
            );
            f.misses = budget_ms.map(|_| t.outcome.misses);
            f.unsent = rate.map(|_| t.outcome.unsent);
            f
        })
        .collect();
    let report = Report::new(
        RunInfo {
            profile: profile.name.clone(),
            arrays: profile.describe(),
            frame_bytes,
            connections: args.connections,
            mode: if rate.is_some() { "open" } else { "closed" }.into(),
            rate_hz_per_connection: rate,
            burst: args.burst,
            warmup_s: args.warmup,
            duration_s: args.duration,
            rounds,
            budget_ms,
        },
        figures,
    );
    if let Some(path) = &args.plot {
        let title = format!(
            "policyd bench: {} profile, {} connection(s), {}",
            profile.name,
            args.connections,
            rate.map(|r| format!("{r} Hz open loop"))
                .unwrap_or_else(|| "closed loop".into())
        );
        let named: Vec<(&str, &Outcome)> = targets
            .iter()
            .map(|t| (t.name.as_str(), &t.outcome))
            .collect();
        plot::write(path, &title, &named).map_err(BenchError::Plot)?;
    }
    Ok(report)
}

/// One target's phase: connect every connection (not timed), warm up, measure, and read the
/// server's CPU time over the measured window. Each connection runs on its own thread, so
/// open-loop sends leave on time whatever the others are doing.
fn phase(
    url: &str,
    pid: Option<u32>,
    spec: &LoadSpec,
    pools: Vec<FramePool>,
) -> Result<(Outcome, Option<Duration>, Vec<FramePool>), BenchError> {
    let mut conns = Vec::with_capacity(pools.len());
    for _ in 0..pools.len() {
        conns.push(load::connect(url, spec.api_key.as_deref())?);
    }
    let t0 = Instant::now() + Duration::from_millis(20);
    let threads: Vec<_> = conns
        .into_iter()
        .zip(pools)
        .enumerate()
        .map(|(i, (ws, pool))| {
            let spec = spec.clone();
            std::thread::spawn(move || load::drive(ws, pool, spec, t0, i))
        })
        .collect();
    std::thread::sleep((t0 + spec.warmup).saturating_duration_since(Instant::now()));
    let before = pid.and_then(cpu::process_cpu);
    let mut out = Outcome::new();
    let mut pools = Vec::with_capacity(threads.len());
    let mut failed = None;
    for t in threads {
        match t.join() {
            Ok(Ok((o, pool))) => {
                out.merge(o, true);
                pools.push(pool);
            }
            Ok(Err(e)) => failed = Some(e),
            Err(_) => failed = Some(BenchError::Lost("a connection thread panicked".into())),
        }
    }
    if let Some(e) = failed {
        return Err(e);
    }
    let after = pid.and_then(cpu::process_cpu);
    let cpu = match (before, after) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a)),
        _ => None,
    };
    Ok((out, cpu, pools))
}
