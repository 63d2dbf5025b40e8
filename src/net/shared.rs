//! What every client of the server shares: the config it started with, the policies served
//! now, the counters, the clock that releases paced replies, and the client ids. Built once by
//! the [server](crate::net::server), read by both front ends.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwap;
use tokio::sync::{Semaphore, watch};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;

use crate::config::Config;
use crate::metrics::Stats;
use crate::net::requests::Context;
use crate::policy::PolicySet;

/// Everything a connection needs, shared by all of them.
pub struct Shared {
    /// What the request core uses of the server (counters, pacing clock, planner, caps, the
    /// served policies): held here once, read through [`Shared::stats`] and
    /// [`Shared::policies`] by the rest of the server.
    pub requests: Context,
    /// The config the server started with (its `[server]`, `[auth]` and `[tls]` hold until a
    /// restart; each policy's own config is in its [`crate::policy::Policy`]).
    pub cfg: Config,
    /// The secrets opened from it at start-up (API keys, TLS acceptor, planner key).
    pub access: crate::net::Access,
    /// The set's generation, for connections to notice a reload.
    pub generation: watch::Sender<u64>,
    pub ws_config: WebSocketConfig,
    /// One permit per connection that may be served.
    pub connections: Arc<Semaphore>,
    /// Each peer address's share of `connections` (`server.max_connections_per_peer`).
    pub peers: Arc<crate::net::peers::PeerShare>,
    pub shutdown: watch::Receiver<bool>,
    /// What `/metrics` encodes.
    pub registry: prometheus_client::registry::Registry,
}

impl Shared {
    /// The server's counters.
    pub fn stats(&self) -> &Arc<Stats> {
        &self.requests.stats
    }

    /// The policies served now; a reload swaps the whole set.
    pub fn policies(&self) -> &Arc<ArcSwap<PolicySet>> {
        &self.requests.policies
    }
}

/// Client ids, for the scheduler's session keys (WebSocket connections and LeRobot clients).
static NEXT_CLIENT: AtomicU64 = AtomicU64::new(1);

/// A new client id, unique for the process's life.
pub fn next_client_id() -> u64 {
    NEXT_CLIENT.fetch_add(1, Ordering::Relaxed)
}
