//! The server: bind the address, build what every connection shares and start the tasks
//! beside the accept loop, accept under the handshake bound and hand each socket to the HTTP
//! layer, and on shutdown stop accepting, let in-flight requests finish and close.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;

use crate::config::Config;
use crate::metrics::Stats;
use crate::net::frame_guard::MARKER_LEN;
use crate::net::http::handle;
use crate::net::shared::Shared;
use crate::policy::build::Loaded;
use crate::policy::reload::{ReloadStatus, Reloader};
use crate::policy::{Policy, PolicySet};

/// Serving failed before or while it started.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(
        "cannot listen on {addr}: {source} (is another server using the port? set server.port or --port)"
    )]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error(
        "cannot listen on {addr} (lerobot.listen): {source} (is LeRobot's own policy_server still running?)"
    )]
    LerobotBind {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot start the pacing clock: {0}")]
    Pacer(std::io::Error),
    #[error("cannot start the task planner: {0}")]
    Planner(std::io::Error),
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
}

/// Binds the configured address.
pub async fn bind(cfg: &Config) -> Result<TcpListener, ServeError> {
    let addr = format!("{}:{}", cfg.server.host, cfg.server.port);
    TcpListener::bind(&addr)
        .await
        .map_err(|source| ServeError::Bind { addr, source })
}

/// Serves one loaded policy until `shutdown` resolves (see [`serve_set`]).
pub async fn serve(
    cfg: Config,
    loaded: Loaded,
    listener: TcpListener,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), ServeError> {
    let stats = loaded.stats.clone();
    let own = cfg.default_policy().clone();
    let set = PolicySet::single(Policy::new(&cfg, own, loaded));
    let access = crate::net::Access::load(&cfg)?;
    serve_set(
        cfg,
        access,
        Arc::new(ArcSwap::from_pointee(set)),
        stats,
        listener,
        shutdown,
        None,
    )
    .await
}

/// Serves a set of policies until `shutdown` resolves; then stops accepting, lets in-flight
/// requests finish, closes connections with 1001 and returns. With a [`Reloader`], each
/// request re-reads the config and swaps in the new set once it is loaded and warm.
pub async fn serve_set(
    cfg: Config,
    access: crate::net::Access,
    policies: Arc<ArcSwap<PolicySet>>,
    stats: Arc<Stats>,
    listener: TcpListener,
    shutdown: impl std::future::Future<Output = ()>,
    reloader: Option<(Reloader, Arc<crate::policy::OpenFn>)>,
) -> Result<(), ServeError> {
    let server = Server::start(cfg, access, policies, stats, listener, reloader).await?;
    server.run(shutdown).await;
    server.drain().await;
    Ok(())
}

/// The server: the state every connection shares, built once, the tasks that run beside the
/// accept loop (LeRobot's gRPC service, config reloads, the task planner) and the listener
/// (mini-redis's `Listener`). [`Server::start`] builds and spawns, [`Server::run`] accepts
/// until shutdown, [`Server::drain`] lets connections finish and stops the tasks.
pub struct Server {
    shared: Arc<Shared>,
    listener: TcpListener,
    /// Tells every connection that the server is shutting down.
    stop: watch::Sender<bool>,
    /// Handshakes in progress are bounded too, so a flood of idle TCP connections cannot
    /// pile up tasks and buffers (each holds at most an 8 KiB head buffer until its handshake
    /// timeout), nor file descriptors past what start-up reserved (`crate::limits::handshakes`).
    handshakes: Arc<Semaphore>,
    lerobot: Option<tokio::task::JoinHandle<()>>,
    reloading: Option<tokio::task::JoinHandle<()>>,
    planner: Option<crate::planner::Planner>,
}

impl Server {
    /// Builds the shared state and starts the tasks beside the accept loop.
    pub async fn start(
        cfg: Config,
        access: crate::net::Access,
        policies: Arc<ArcSwap<PolicySet>>,
        stats: Arc<Stats>,
        listener: TcpListener,
        reloader: Option<(Reloader, Arc<crate::policy::OpenFn>)>,
    ) -> Result<Server, ServeError> {
        let (stop, stop_rx) = watch::channel(false);
        let reloads = Arc::new(ReloadStatus::default());
        let shared = Arc::new(shared(cfg, access, policies, stats, stop_rx, &reloads)?);
        let lerobot = match &shared.cfg.lerobot {
            Some(l) => Some(start_lerobot(&shared, l).await?),
            None => None,
        };
        let reloading = reloader.map(|(r, open)| {
            let served = Arc::new(crate::policy::reload::Served {
                policies: shared.policies().clone(),
                generation: shared.generation.clone(),
                started: shared.cfg.clone(),
                planner: shared.requests.planner.clone(),
            });
            tokio::spawn(crate::policy::reload::run(served, r, open, reloads))
        });
        // The planner runs beside the request path for as long as the server does.
        let planner = match shared.requests.planner.clone() {
            Some(link) => Some(
                crate::planner::Planner::start(
                    &shared.cfg.planner,
                    shared.access.planner_key.clone(),
                    link,
                )
                .map_err(ServeError::Planner)?,
            ),
            None => None,
        };
        let max = shared.cfg.server.max_connections;
        Ok(Server {
            handshakes: Arc::new(Semaphore::new(crate::limits::handshakes(max))),
            shared,
            listener,
            stop,
            lerobot,
            reloading,
            planner,
        })
    }

    /// Accepts connections until `shutdown` resolves, each handled on its own task.
    pub async fn run(&self, shutdown: impl std::future::Future<Output = ()>) {
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => return,
                accepted = self.listener.accept() => {
                    let (stream, peer) = match accepted {
                        Ok(x) => x,
                        Err(e) => {
                            crate::warn_limited!("accept failed: {e}");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    };
                    let Ok(permit) = self.handshakes.clone().try_acquire_owned() else {
                        self.shared.stats().metrics.connection_refused("handshakes");
                        crate::warn_limited!(
                            "{peer}: too many handshakes in progress; dropping the connection"
                        );
                        continue;
                    };
                    let shared = self.shared.clone();
                    tokio::spawn(async move {
                        handle(stream, peer, shared, permit).await;
                    });
                }
            }
        }
    }

    /// Stops accepting, tells every connection, waits for them (10 s at most) and for the
    /// gRPC service (5 s), stops the reloads and the planner, and logs the pacing summary.
    pub async fn drain(self) {
        log::info!("shutting down: no new connections; finishing in-flight requests");
        drop(self.listener);
        let _ = self.stop.send(true);
        // Every connection holds a permit until it has closed.
        let max = self.shared.cfg.server.max_connections;
        let all = self.shared.connections.clone();
        let drained =
            tokio::time::timeout(Duration::from_secs(10), all.acquire_many(max as u32)).await;
        if drained.is_err() {
            log::warn!("some connections did not close within 10 s");
        }
        if let Some(l) = self.lerobot
            && tokio::time::timeout(Duration::from_secs(5), l)
                .await
                .is_err()
        {
            log::warn!("lerobot: the gRPC service did not stop within 5 s");
        }
        if let Some(r) = self.reloading {
            r.abort();
        }
        if let Some(p) = self.planner {
            // Stopping waits for the model server's grace period: off the async threads.
            let _ = tokio::task::spawn_blocking(move || drop(p)).await;
        }
        let r = self.shared.stats().release.summary();
        if r.paced > 0 {
            log::info!(
                "paced replies: {}, deadline misses: {}, release error p50 {} µs, p99 {} µs, \
                 max {} µs",
                r.paced,
                r.misses,
                r.p50_us,
                r.p99_us,
                r.max_us
            );
        }
    }
}

/// The state every connection shares: the WebSocket limits, the connection caps, the pacing
/// clock (one for every policy: it spins as long as the most demanding one asks), the
/// planner's link (made for the default policy's bindings, for the server's life), the
/// set's generation and the metrics registry over all of it.
fn shared(
    cfg: Config,
    access: crate::net::Access,
    policies: Arc<ArcSwap<PolicySet>>,
    stats: Arc<Stats>,
    shutdown: watch::Receiver<bool>,
    reloads: &Arc<ReloadStatus>,
) -> Result<Shared, ServeError> {
    let s = &cfg.server;
    let ws_config = WebSocketConfig::default()
        // The frame guard enforces the configured limit; tungstenite's is a backstop that
        // leaves room for the guard's marker.
        .max_message_size(Some(s.max_message_bytes + MARKER_LEN))
        .max_frame_size(Some(s.max_message_bytes + MARKER_LEN))
        .write_buffer_size(0);
    let max = s.max_connections;
    let peers = crate::net::peers::PeerShare::new(s.max_connections_per_peer, max);
    let spin_us = cfg.policies.iter().map(|p| p.pacing.spin_us).max();
    let spin = Duration::from_micros(spin_us.unwrap_or_default());
    let pacer = crate::runtime::pacing::Pacer::start(spin).map_err(ServeError::Pacer)?;
    let connections = Arc::new(Semaphore::new(max));
    let set = policies.load_full();
    for p in &set.policies {
        p.watch();
    }
    let planner = set
        .default_policy()
        .plan
        .planner
        .as_ref()
        .map(|t| Arc::new(t.link(&cfg.planner)));
    let generation = watch::Sender::new(set.generation);
    let live = crate::net::scrape::Live {
        stats: stats.clone(),
        policies: policies.clone(),
        reloads: reloads.clone(),
        connections: connections.clone(),
        max_connections: max,
        max_sessions: s.max_sessions,
        planner: planner.clone(),
    };
    let registry = crate::net::scrape::registry(&stats.metrics, live);
    let requests = crate::net::requests::Context {
        stats: stats.clone(),
        pacer: Arc::new(pacer),
        planner,
        max_sessions: s.max_sessions,
        generation: generation.subscribe(),
        policies: policies.clone(),
    };
    Ok(Shared {
        requests,
        registry,
        generation,
        ws_config,
        connections,
        peers,
        shutdown,
        cfg,
        access,
    })
}

/// LeRobot's gRPC service on its own port (`[lerobot]`).
async fn start_lerobot(
    shared: &Arc<Shared>,
    l: &crate::config::LerobotConfig,
) -> Result<tokio::task::JoinHandle<()>, ServeError> {
    let listener = TcpListener::bind(l.listen)
        .await
        .map_err(|source| ServeError::LerobotBind {
            addr: l.listen,
            source,
        })?;
    log::info!(
        "lerobot: LeRobot's AsyncInference gRPC service on {} (plaintext, no authentication{})",
        listener.local_addr().unwrap_or(l.listen),
        if l.allow.is_empty() {
            "; any peer may connect: set lerobot.allow".to_string()
        } else {
            format!("; peers allowed: {}", l.allow.len())
        }
    );
    Ok(tokio::spawn(crate::net::lerobot::serve(
        shared.clone(),
        listener,
    )))
}
