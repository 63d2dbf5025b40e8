//! What does `GET /metrics` show? The request-path handles of [`crate::metrics`] plus figures
//! read at scrape time from where they already live (connections, skips, releases, worker
//! health, reloads, the planner, RSS), encoded as OpenMetrics text.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use crate::metrics::{Metrics, Stats};
use crate::runtime::scheduler::SkipStats;

/// What the scrape-time collector reads.
pub struct Live {
    pub stats: Arc<Stats>,
    /// The policies served now (engine health, runs and memory are read from them).
    pub policies: Arc<arc_swap::ArcSwap<crate::policy::PolicySet>>,
    pub reloads: Arc<crate::policy::reload::ReloadStatus>,
    pub connections: Arc<tokio::sync::Semaphore>,
    pub max_connections: usize,
    pub max_sessions: usize,
    /// The task planner's link, when `[planner]` is on.
    pub planner: Option<Arc<crate::planner::Link>>,
}

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Live").finish_non_exhaustive()
    }
}

/// Resident set size from /proc/self/status (`VmRSS`), in bytes.
pub fn rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn gauge(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    v: impl Into<f64>,
) -> Result<(), std::fmt::Error> {
    let g = ConstGauge::new(v.into());
    let m = e.encode_descriptor(name, help, None, g.metric_type())?;
    g.encode(m)
}

fn counter(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    v: u64,
) -> Result<(), std::fmt::Error> {
    let c = ConstCounter::new(v);
    let m = e.encode_descriptor(name, help, None, c.metric_type())?;
    c.encode(m)
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SubtaskLabels {
    subtask: String,
}

/// The planner's figures: its health, its calls by outcome, and the current subtask (an info
/// metric whose one label is the subtask, quotes and line breaks replaced).
fn encode_planner(
    e: &mut DescriptorEncoder,
    l: &crate::planner::Link,
) -> Result<(), std::fmt::Error> {
    let h = &l.health;
    let load = |v: &std::sync::atomic::AtomicU64| v.load(Ordering::Relaxed);
    gauge(
        e,
        "policyd_planner_up",
        "1 when the planner's last call produced a subtask",
        if h.up.load(Ordering::Relaxed) {
            1.0
        } else {
            0.0
        },
    )?;
    gauge(
        e,
        "policyd_planner_endpoints_ready",
        "planner endpoints that answered their last call or readiness probe",
        load(&h.endpoints_ready) as f64,
    )?;
    gauge(
        e,
        "policyd_planner_done",
        "1 when the planner reports the instruction complete",
        if h.done.load(Ordering::Relaxed) {
            1.0
        } else {
            0.0
        },
    )?;
    if let Some(age) = l.subtask_age() {
        gauge(
            e,
            "policyd_planner_subtask_age_seconds",
            "time since the planner last named a subtask",
            age,
        )?;
    }
    let c = ConstCounter::new(0u64);
    let mut m = e.encode_descriptor(
        "policyd_planner_calls",
        "planner calls, by outcome",
        None,
        c.metric_type(),
    )?;
    for (result, v) in [
        ("ok", &h.ok),
        ("unparsable", &h.parse_failures),
        ("failed", &h.call_failures),
        ("timeout", &h.timeouts),
        ("no_observation", &h.no_observation),
    ] {
        let labels = ResultLabels { result };
        let fm = m.encode_family(&labels)?;
        ConstCounter::new(load(v)).encode(fm)?;
    }
    counter(
        e,
        "policyd_planner_parse_retries",
        "planner answers that could not be parsed and were asked for again",
        load(&h.retries),
    )?;
    if let Some(s) = l.subtask().as_deref() {
        let g = ConstGauge::new(1i64);
        let mut m = e.encode_descriptor(
            "policyd_planner_subtask",
            "the subtask the policy is prompted with",
            None,
            g.metric_type(),
        )?;
        let subtask = label_text(s);
        let labels = SubtaskLabels { subtask };
        let fm = m.encode_family(&labels)?;
        g.encode(fm)?;
    }
    Ok(())
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PolicyLabels {
    policy: String,
    backend: &'static str,
    default: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
/// The label of `policyd_config_reload_error`: the refused reload's message.
struct ReloadErrorLabels {
    error: String,
}

/// Text made safe for a label value: quotes, backslashes and control characters become `'`.
fn label_text(s: &str) -> String {
    s.chars()
        .map(|c| {
            if matches!(c, '"' | '\\') || c.is_control() {
                '\''
            } else {
                c
            }
        })
        .collect()
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
    backend: &'static str,
}

impl Collector for Live {
    fn encode(&self, mut e: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let in_use = self
            .max_connections
            .saturating_sub(self.connections.available_permits());
        gauge(
            &mut e,
            "policyd_connections",
            "WebSocket connections open",
            in_use as f64,
        )?;
        gauge(
            &mut e,
            "policyd_connections_limit",
            "server.max_connections",
            self.max_connections as f64,
        )?;
        gauge(
            &mut e,
            "policyd_sessions_limit",
            "server.max_sessions per connection times server.max_connections",
            (self.max_sessions * self.max_connections) as f64,
        )?;
        let s: &SkipStats = &self.stats.skips;
        counter(
            &mut e,
            "policyd_observations",
            "observe requests received",
            s.observed.load(Ordering::Relaxed),
        )?;
        let c = ConstCounter::new(0u64);
        let mut m = e.encode_descriptor(
            "policyd_observations_skipped",
            "observations not run, by reason",
            None,
            c.metric_type(),
        )?;
        for (reason, v) in [
            ("superseded", &s.superseded),
            ("already_predicted", &s.already_predicted),
            ("similar", &s.similar),
        ] {
            let labels = ReasonLabels { reason };
            let fm = m.encode_family(&labels)?;
            ConstCounter::new(v.load(Ordering::Relaxed)).encode(fm)?;
        }
        let r = self.stats.release.summary();
        counter(
            &mut e,
            "policyd_deadline_misses",
            "replies ready only after their latency budget",
            r.misses,
        )?;
        counter(
            &mut e,
            "policyd_paced_replies",
            "replies released on a latency budget",
            r.paced,
        )?;
        let set = self.policies.load();
        counter(
            &mut e,
            "policyd_engine_runs",
            "engine runs of the policies served now, warm-up included",
            set.policies
                .iter()
                .map(|p| p.worker.state.runs.load(Ordering::Relaxed))
                .sum(),
        )?;
        gauge(
            &mut e,
            "policyd_healthy",
            "1 while every policy's engine serves; 0 after one failed repeatedly",
            if set.healthy() { 1.0 } else { 0.0 },
        )?;
        gauge(
            &mut e,
            "policyd_memory_budget_bytes",
            "memory the policies allocate at start-up (check-config's budget)",
            set.budget as f64,
        )?;
        if let Some(rss) = rss_bytes() {
            gauge(
                &mut e,
                "policyd_resident_memory_bytes",
                "resident set size of the process",
                rss as f64,
            )?;
        }
        gauge(
            &mut e,
            "policyd_engine_warmup_seconds",
            "the longest warm-up of the policies served now",
            set.policies
                .iter()
                .map(|p| p.warmup.as_secs_f64())
                .fold(0.0, f64::max),
        )?;
        let g = ConstGauge::new(1i64);
        let mut m = e.encode_descriptor(
            "policyd_policy",
            "the policies served now (1 each)",
            None,
            g.metric_type(),
        )?;
        for (i, p) in set.policies.iter().enumerate() {
            let labels = PolicyLabels {
                policy: p.name.clone(),
                backend: p.backend,
                default: if i == set.default { "true" } else { "false" },
            };
            let fm = m.encode_family(&labels)?;
            g.encode(fm)?;
        }
        let c = ConstCounter::new(0u64);
        let mut m = e.encode_descriptor(
            "policyd_config_reloads",
            "config reloads (SIGHUP), by result",
            None,
            c.metric_type(),
        )?;
        for (result, v) in [("ok", &self.reloads.ok), ("refused", &self.reloads.failed)] {
            let labels = ResultLabels { result };
            let fm = m.encode_family(&labels)?;
            ConstCounter::new(v.load(Ordering::Relaxed)).encode(fm)?;
        }
        let last = self
            .reloads
            .last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(error) = last {
            let mut m = e.encode_descriptor(
                "policyd_config_reload_error",
                "why the last reload was refused (until one succeeds)",
                None,
                g.metric_type(),
            )?;
            let labels = ReloadErrorLabels {
                error: label_text(&error),
            };
            let fm = m.encode_family(&labels)?;
            g.encode(fm)?;
        }
        let mut m = e.encode_descriptor(
            "policyd_build_info",
            "the running build",
            None,
            g.metric_type(),
        )?;
        let labels = BuildLabels {
            version: env!("CARGO_PKG_VERSION"),
            backend: set.default_policy().backend,
        };
        let fm = m.encode_family(&labels)?;
        g.encode(fm)?;
        match &self.planner {
            Some(l) => encode_planner(&mut e, l),
            None => Ok(()),
        }
    }
}

/// The registry a server scrapes: the request-path handles plus the live collector.
pub fn registry(m: &Metrics, live: Live) -> Registry {
    let mut r = Registry::default();
    r.register(
        "policyd_requests",
        "requests decoded, by route and endpoint",
        m.requests.clone(),
    );
    r.register(
        "policyd_request_errors",
        "requests answered with an error, by route and kind",
        m.errors.clone(),
    );
    r.register(
        "policyd_request_duration_seconds",
        "from a frame's arrival to its reply being sent",
        m.latency.clone(),
    );
    r.register(
        "policyd_engine_duration_seconds",
        "engine time per run (device time for a GPU backend)",
        m.engine.clone(),
    );
    r.register(
        "policyd_observation_interval_seconds",
        "time between a session's consecutive observe requests",
        m.observe_interval.clone(),
    );
    r.register(
        "policyd_sessions",
        "sessions tracked now",
        m.sessions.clone(),
    );
    r.register(
        "policyd_auth_failures",
        "handshakes refused for a missing or wrong API key",
        m.auth_failures.clone(),
    );
    r.register(
        "policyd_non_finite_inputs",
        "requests refused for NaN or infinity in an input (inputs[i].allow_non_finite)",
        m.non_finite_inputs.clone(),
    );
    r.register(
        "policyd_prompts_tokenized",
        "prompts tokenized: a session's prompt (or its pi0.5 state bins) changed",
        m.prompts_tokenized.clone(),
    );
    r.register(
        "policyd_prompts_truncated",
        "requests whose prompt was past tokenizer.max_tokens and truncated",
        m.prompts_truncated.clone(),
    );
    r.register(
        "policyd_sampler_steps",
        "denoising steps a pipeline ran per request ([sampler], sampling_params.num_inference_steps)",
        m.sampler_steps.clone(),
    );
    r.register(
        "policyd_lerobot_rpcs",
        "LeRobot AsyncInference calls ([lerobot]), by rpc",
        m.lerobot_rpcs.clone(),
    );
    r.register(
        "policyd_lerobot_refused",
        "what the LeRobot service refused, by reason (peer, connections, peer_share, oversize, busy, slow, chunking, pickle, observation, setup, owner)",
        m.lerobot_refused.clone(),
    );
    r.register(
        "policyd_lerobot_long_poll_timeouts",
        "GetActions long polls that ended with no chunk (lerobot.long_poll_ms)",
        m.lerobot_long_poll_timeouts.clone(),
    );
    r.register(
        "policyd_connections_refused",
        "WebSocket connections refused, by reason (limit: server.max_connections, peer_share: server.max_connections_per_peer, handshakes: too many in progress)",
        m.connections_refused.clone(),
    );
    r.register_collector(Box::new(live));
    r
}

/// The exposition text.
pub fn render(r: &Registry) -> String {
    let mut s = String::with_capacity(8192);
    if prometheus_client::encoding::text::encode(&mut s, r).is_err() {
        s.clear();
        s.push_str("# metrics could not be encoded\n");
    }
    s
}
