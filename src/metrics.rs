//! What does the request path count? Prometheus handles updated in place (requests, errors,
//! latency, engine time), labelled by the protocol's own enums; `GET /metrics` encodes them
//! with the scrape-time figures in [`crate::net::scrape`].
//!
//! Request-path metrics are handles updated in place: every label combination is created at
//! start-up, so counting a request takes a read lock and allocates nothing. Figures that
//! already live elsewhere (connections, skip and release counters, worker health, RSS) are read
//! at scrape time by a collector instead of being kept twice. Labels are closed sets (route,
//! endpoint, error kind, skip reason): never a label per session or peer.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

use crate::protocol::{Endpoint, ErrorKind, Route};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    route: &'static str,
    endpoint: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    route: &'static str,
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    route: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RpcLabels {
    rpc: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusedLabels {
    reason: &'static str,
}

/// Why the WebSocket port refused a connection, for `reason` labels: at
/// `server.max_connections`, the peer address at its `server.max_connections_per_peer`, too
/// many handshakes in progress.
pub const CONNECTION_REFUSALS: [&str; 3] = ["limit", "peer_share", "handshakes"];

/// LeRobot's gRPC calls, for `rpc` labels.
pub const LEROBOT_RPCS: [&str; 4] = [
    "Ready",
    "SendPolicyInstructions",
    "SendObservations",
    "GetActions",
];

/// Why the LeRobot service refused something, for `reason` labels: a peer off the allow-list,
/// a payload over the cap, too many observations arriving at once, a broken chunk stream, a pickle the strict reader refused, a
/// payload that read but does not fit the policy, a policy setup it cannot serve.
pub const LEROBOT_REFUSALS: [&str; 11] = [
    "peer",
    "connections",
    "peer_share",
    "oversize",
    "busy",
    "slow",
    "chunking",
    "pickle",
    "observation",
    "setup",
    "owner",
];

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// Seconds, 100 µs to ~3.3 s.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0001, 2.0, 16))
}

/// The request-path metrics.
#[derive(Clone)]
pub struct Metrics {
    pub requests: Family<RequestLabels, Counter>,
    pub errors: Family<ErrorLabels, Counter>,
    /// From a frame's arrival to its reply's send (includes any latency-budget wait).
    pub latency: HistogramFamily<RouteLabels>,
    /// Engine time per run (device time for a GPU backend).
    pub engine: Histogram,
    /// Time between a session's consecutive `observe` requests (its observation rate).
    pub observe_interval: Histogram,
    /// Sessions tracked now, over all connections.
    pub sessions: Gauge,
    /// Handshakes refused for a missing or wrong API key.
    pub auth_failures: Counter,
    /// Requests refused for NaN or infinity in an input (see `allow_non_finite`).
    pub non_finite_inputs: Counter,
    /// Prompts tokenized (a session's prompt, or its pi0.5 state bins, changed).
    pub prompts_tokenized: Counter,
    /// Requests whose prompt was past `tokenizer.max_tokens` and truncated.
    pub prompts_truncated: Counter,
    /// Denoising steps a pipeline ran per request.
    pub sampler_steps: Histogram,
    /// LeRobot's gRPC calls, by RPC.
    pub lerobot_rpcs: Family<RpcLabels, Counter>,
    /// What the LeRobot service refused, by reason.
    pub lerobot_refused: Family<RefusedLabels, Counter>,
    /// `GetActions` long polls that ended with no chunk.
    pub lerobot_long_poll_timeouts: Counter,
    /// WebSocket connections refused, by reason ([`CONNECTION_REFUSALS`]).
    pub connections_refused: Family<RefusedLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        let m = Metrics {
            requests: Family::default(),
            errors: Family::default(),
            latency: Family::new_with_constructor(latency_histogram),
            engine: latency_histogram(),
            observe_interval: Histogram::new(exponential_buckets(0.001, 2.0, 14)),
            sessions: Gauge::default(),
            auth_failures: Counter::default(),
            non_finite_inputs: Counter::default(),
            prompts_tokenized: Counter::default(),
            prompts_truncated: Counter::default(),
            sampler_steps: Histogram::new([
                1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0,
            ]),
            lerobot_rpcs: Family::default(),
            lerobot_refused: Family::default(),
            lerobot_long_poll_timeouts: Counter::default(),
            connections_refused: Family::default(),
        };
        for reason in CONNECTION_REFUSALS {
            let _ = m
                .connections_refused
                .get_or_create(&RefusedLabels { reason });
        }
        for rpc in LEROBOT_RPCS {
            let _ = m.lerobot_rpcs.get_or_create(&RpcLabels { rpc });
        }
        for reason in LEROBOT_REFUSALS {
            let _ = m.lerobot_refused.get_or_create(&RefusedLabels { reason });
        }
        // Every label combination now, so the request path never inserts.
        for route in Route::ALL {
            for endpoint in Endpoint::ALL {
                let _ = m
                    .requests
                    .get_or_create(&RequestLabels::new(route, endpoint));
            }
            for kind in ErrorKind::ALL {
                let _ = m.errors.get_or_create(&ErrorLabels::new(route, kind));
            }
            let _ = m.latency.get_or_create(&RouteLabels {
                route: route.label(),
            });
        }
        m
    }
}

impl RequestLabels {
    fn new(route: Route, endpoint: Endpoint) -> Self {
        RequestLabels {
            route: route.label(),
            endpoint: endpoint.label(),
        }
    }
}

impl ErrorLabels {
    fn new(route: Route, kind: ErrorKind) -> Self {
        ErrorLabels {
            route: route.label(),
            kind: kind.label(),
        }
    }
}

impl Metrics {
    pub fn request(&self, route: Route, endpoint: Endpoint) {
        self.requests
            .get_or_create(&RequestLabels::new(route, endpoint))
            .inc();
    }

    pub fn error(&self, route: Route, kind: ErrorKind) {
        self.errors
            .get_or_create(&ErrorLabels::new(route, kind))
            .inc();
    }

    /// Counts a LeRobot RPC (one of [`LEROBOT_RPCS`]).
    pub fn lerobot_rpc(&self, rpc: &'static str) {
        self.lerobot_rpcs.get_or_create(&RpcLabels { rpc }).inc();
    }

    /// Counts a WebSocket connection refused (one of [`CONNECTION_REFUSALS`]).
    pub fn connection_refused(&self, reason: &'static str) {
        self.connections_refused
            .get_or_create(&RefusedLabels { reason })
            .inc();
    }

    /// Counts a LeRobot refusal (one of [`LEROBOT_REFUSALS`]).
    pub fn lerobot_refused(&self, reason: &'static str) {
        self.lerobot_refused
            .get_or_create(&RefusedLabels { reason })
            .inc();
    }

    /// How many times the LeRobot service refused for `reason` (tests and `policyd bench`).
    pub fn lerobot_refusals(&self, reason: &'static str) -> u64 {
        self.lerobot_refused
            .get_or_create(&RefusedLabels { reason })
            .get()
    }

    pub fn replied(&self, route: Route, latency: std::time::Duration) {
        self.latency
            .get_or_create(&RouteLabels {
                route: route.label(),
            })
            .observe(latency.as_secs_f64());
    }
}

/// Counters shared by every connection (read by tests and, later, metrics).
pub struct Stats {
    pub release: crate::runtime::pacing::ReleaseStats,
    pub skips: crate::runtime::scheduler::SkipStats,
    /// The request-path metrics (`/metrics`).
    pub metrics: Metrics,
}

impl Stats {
    pub fn new() -> Stats {
        Stats {
            release: crate::runtime::pacing::ReleaseStats::new(),
            skips: Default::default(),
            metrics: Default::default(),
        }
    }
}

impl Default for Stats {
    fn default() -> Self {
        Stats::new()
    }
}
