//! The listener: HTTP handshake, health routes, connection limit, dialect by path, shutdown.
//!
//! policyd reads the HTTP request itself (bounded in size and time) so that `/healthz`,
//! `/health`, the connection limit (HTTP 503) and plain GETs (426) are answered before any
//! WebSocket machinery runs, then hands the socket to tungstenite without a second handshake.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};

use crate::config::{Config, ConfigError};
use crate::connection::{self, Dialect};
use crate::engine::{Engine, EngineError};
use crate::frame_guard::{FrameGuard, MARKER_LEN};
use crate::plan::Plan;
use crate::policy::{OpenFn, Policy, PolicySet, ReloadStatus};
use crate::worker::WorkerHandle;
use arc_swap::ArcSwap;
use sd_notify::NotifyState;

/// The path that selects the vllm-omni dialect.
pub const VLLM_PATH: &str = "/v1/realtime/robot/openpi";
/// Most handshakes in progress at once, whatever `server.max_connections` is.
const MAX_HANDSHAKES: usize = 8192;
/// Largest HTTP request head accepted.
const MAX_HEAD: usize = 8192;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("policy \"{name}\": {source}")]
    Policy {
        name: String,
        source: Box<ServerError>,
    },
    #[error("cannot start the task planner: {0}")]
    Planner(std::io::Error),
    #[error(
        "cannot listen on {addr}: {source} (is another server using the port? set server.port or --port)"
    )]
    Bind {
        addr: String,
        source: std::io::Error,
    },
}

/// Counters shared by every connection (read by tests and, later, metrics).
pub struct Stats {
    pub release: crate::pacing::ReleaseStats,
    pub skips: crate::scheduler::SkipStats,
    /// The request-path metrics (`/metrics`).
    pub metrics: crate::metrics::Metrics,
}

impl Stats {
    pub fn new() -> Stats {
        Stats {
            release: crate::pacing::ReleaseStats::new(),
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

/// Everything a connection needs, shared by all of them.
pub struct Shared {
    /// Wakes connections at their replies' release times.
    pub pacer: crate::pacing::Pacer,
    pub stats: Arc<Stats>,
    /// The config the server started with (its `[server]`, `[auth]` and `[tls]` hold until a
    /// restart; each policy's own config is in its [`Policy`]).
    pub cfg: Config,
    /// The policies served now; a reload swaps the whole set.
    pub policies: Arc<ArcSwap<PolicySet>>,
    /// The set's generation, for connections to notice a reload.
    pub generation: watch::Sender<u64>,
    pub ws_config: WebSocketConfig,
    /// One permit per connection that may be served.
    pub connections: Arc<Semaphore>,
    pub shutdown: watch::Receiver<bool>,
    /// What `/metrics` encodes.
    pub registry: prometheus_client::registry::Registry,
}

/// Re-reading the config on `SIGHUP`: where the config comes from, how engines are opened,
/// and the signals.
pub struct Reloader {
    /// Reads and checks the config again (`Config::load` of the file the server started
    /// with).
    pub load: Arc<dyn Fn() -> Result<Config, String> + Send + Sync>,
    pub open: Arc<OpenFn>,
    /// One message per reload request.
    pub requests: tokio::sync::mpsc::Receiver<()>,
}

/// A loaded, checked and warmed engine with its plan: what the server serves.
pub struct Loaded {
    pub plan: Plan,
    pub stats: Arc<Stats>,
    pub worker: WorkerHandle,
    pub backend: &'static str,
    pub warmup: Duration,
}

/// Opens the engine a config names.
pub fn open_engine(cfg: &Config) -> Result<Box<dyn Engine>, ServerError> {
    let model = cfg.model.clone().ok_or_else(|| {
        crate::config::invalid("engine.model", "missing: give the path of the ONNX model")
    })?;
    let hints: Vec<(String, Vec<usize>)> = cfg
        .inputs
        .iter()
        .filter_map(|b| b.engine_shape.clone().map(|s| (b.tensor.clone(), s)))
        .collect();
    match cfg.engine.backend.as_str() {
        #[cfg(feature = "cpu")]
        "cpu" => Ok(Box::new(crate::engine::cpu::CpuEngine::load(
            &model, &hints,
        )?)),
        #[cfg(feature = "tensorrt")]
        "tensorrt" => {
            let crate::engine::ModelSource::File(path) = &model else {
                return Err(crate::config::invalid(
                    "engine.model",
                    "the tensorrt backend needs a plan file (built with trtexec on the device)",
                )
                .into());
            };
            let e = &cfg.engine;
            let opts = crate::engine::tensorrt::Options {
                model: model.describe(),
                dla_core: e.dla_core,
                cuda_graph: e.cuda_graph.unwrap_or(true),
                zero_copy: e
                    .zero_copy
                    .as_deref()
                    .and_then(crate::engine::ZeroCopy::parse)
                    .unwrap_or(crate::engine::ZeroCopy::Auto),
                shapes: hints,
            };
            Ok(Box::new(crate::engine::tensorrt::open(
                path,
                e.device.unwrap_or(0),
                e.tensorrt_library.as_deref(),
                &opts,
            )?))
        }
        other => Err(crate::config::invalid(
            "engine.backend",
            format!("unknown backend \"{other}\""),
        )
        .into()),
    }
}

/// Loads the model, checks the config against it, allocates every buffer and warms up.
pub fn load(cfg: &Config) -> Result<Loaded, ServerError> {
    load_engine(cfg, open_engine(cfg)?)
}

/// [`load`] with an engine the caller opened (tests and benchmarks use a synthetic one).
pub fn load_engine(cfg: &Config, engine: Box<dyn Engine>) -> Result<Loaded, ServerError> {
    let mut plan = Plan::compile(cfg, engine.io())?;
    plan.budget.add(engine.working_memory());
    let backend = engine.backend();
    let (worker, warmup) =
        WorkerHandle::start(engine, &plan, cfg.engine.slots, cfg.engine.warmup_runs)?;
    Ok(Loaded {
        plan,
        stats: Arc::new(Stats::new()),
        worker,
        backend,
        warmup,
    })
}

/// Binds the configured address.
pub async fn bind(cfg: &Config) -> Result<TcpListener, ServerError> {
    let addr = format!("{}:{}", cfg.server.host, cfg.server.port);
    TcpListener::bind(&addr)
        .await
        .map_err(|source| ServerError::Bind { addr, source })
}

/// Serves one loaded policy until `shutdown` resolves (see [`serve_set`]).
pub async fn serve(
    cfg: Config,
    loaded: Loaded,
    listener: TcpListener,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), ServerError> {
    let stats = loaded.stats.clone();
    let own = cfg.policy_configs().swap_remove(0);
    let set = PolicySet::single(Policy::new(own, loaded));
    serve_set(
        cfg,
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
    policies: Arc<ArcSwap<PolicySet>>,
    stats: Arc<Stats>,
    listener: TcpListener,
    shutdown: impl std::future::Future<Output = ()>,
    reloader: Option<Reloader>,
) -> Result<(), ServerError> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let s = &cfg.server;
    let ws_config = WebSocketConfig::default()
        // The frame guard enforces the configured limit; tungstenite's is a backstop that
        // leaves room for the guard's marker.
        .max_message_size(Some(s.max_message_bytes + MARKER_LEN))
        .max_frame_size(Some(s.max_message_bytes + MARKER_LEN))
        .write_buffer_size(0);
    let max = s.max_connections;
    let spin = Duration::from_micros(cfg.pacing.spin_us);
    let pacer = crate::pacing::Pacer::start(spin).map_err(|e| {
        ServerError::Engine(EngineError::Run(format!(
            "cannot start the pacing clock: {e}"
        )))
    })?;
    let connections = Arc::new(Semaphore::new(max));
    let set = policies.load_full();
    for p in &set.policies {
        p.watch();
    }
    let planner_link = set
        .default_policy()
        .plan
        .planner
        .as_ref()
        .map(|t| t.link.clone());
    let generation = watch::Sender::new(set.generation);
    drop(set);
    let reloads = Arc::new(ReloadStatus::default());
    let live = crate::metrics::Live {
        stats: stats.clone(),
        policies: policies.clone(),
        reloads: reloads.clone(),
        connections: connections.clone(),
        max_connections: max,
        max_sessions: s.max_sessions,
        planner: planner_link.clone(),
    };
    let registry = crate::metrics::registry(&stats.metrics, live);
    let shared = Arc::new(Shared {
        pacer,
        registry,
        stats,
        policies,
        generation,
        ws_config,
        connections,
        shutdown: stop_rx,
        cfg,
    });
    let reloading = reloader.map(|r| tokio::spawn(reload_loop(shared.clone(), r, reloads)));
    // The planner runs beside the request path for as long as the server does.
    let planner = match planner_link {
        Some(link) => Some(
            crate::planner::Planner::start(&shared.cfg.planner, link)
                .map_err(ServerError::Planner)?,
        ),
        None => None,
    };
    // Handshakes in progress are bounded too, so a flood of idle TCP connections cannot pile
    // up tasks and buffers (each holds at most an 8 KiB head buffer until its handshake
    // timeout). Room for 16 times the connection limit, so a burst of clients gets its 503.
    let handshakes = Arc::new(Semaphore::new((max * 16 + 64).min(MAX_HANDSHAKES)));
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(x) => x,
                    Err(e) => {
                        log::warn!("accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let Ok(permit) = handshakes.clone().try_acquire_owned() else {
                    log::warn!("{peer}: too many handshakes in progress; dropping the connection");
                    continue;
                };
                let shared = shared.clone();
                tokio::spawn(async move {
                    handle(stream, peer, shared, permit).await;
                });
            }
        }
    }
    log::info!("shutting down: no new connections; finishing in-flight requests");
    drop(listener);
    let _ = stop_tx.send(true);
    // Every connection holds a permit until it has closed.
    let all = shared.connections.clone();
    let drained = tokio::time::timeout(Duration::from_secs(10), all.acquire_many(max as u32)).await;
    if drained.is_err() {
        log::warn!("some connections did not close within 10 s");
    }
    if let Some(r) = reloading {
        r.abort();
    }
    if let Some(p) = planner {
        // Stopping waits for the model server's grace period: off the async threads.
        let _ = tokio::task::spawn_blocking(move || drop(p)).await;
    }
    let r = shared.stats.release.summary();
    if r.paced > 0 {
        log::info!(
            "paced replies: {}, deadline misses: {}, release error p50 {} µs, p99 {} µs, max {} µs",
            r.paced,
            r.misses,
            r.p50_us,
            r.p99_us,
            r.max_us
        );
    }
    Ok(())
}

/// Serves reload requests one at a time: re-read the config, build the new set beside the
/// old one (which keeps serving), swap it in. A config that fails is logged and reported in
/// `/metrics`, and nothing changes.
async fn reload_loop(shared: Arc<Shared>, mut r: Reloader, status: Arc<ReloadStatus>) {
    while r.requests.recv().await.is_some() {
        // Requests that came in meanwhile are served by this one reload.
        while r.requests.try_recv().is_ok() {}
        // systemd (Type=notify-reload or ExecReload=) sees the reload start and end.
        let mut start = vec![
            NotifyState::Reloading,
            NotifyState::Status("reloading the config"),
        ];
        if let Ok(now) = NotifyState::monotonic_usec_now() {
            start.push(now);
        }
        crate::appliance::notify(&start);
        log::info!("reloading the config");
        let current = shared.policies.load_full();
        let (load, open) = (r.load.clone(), r.open.clone());
        let started = shared.cfg.clone();
        let built = tokio::task::spawn_blocking(move || {
            let cfg = load()?;
            warn_fixed_sections(&started, &cfg);
            crate::policy::build(&cfg, Some(&current), open.as_ref()).map_err(|e| e.to_string())
        })
        .await
        .map_err(|e| format!("the reload task failed: {e}"))
        .and_then(|r| r);
        let message = match built {
            Ok(b) => {
                for p in &b.set.policies {
                    p.watch();
                }
                let generation = b.set.generation;
                let summary = format!(
                    "config reloaded: serving {} (loaded: {}; kept: {})",
                    b.set.names(),
                    list_or_none(&b.loaded),
                    list_or_none(&b.kept)
                );
                shared.policies.store(Arc::new(b.set));
                shared.generation.send_replace(generation);
                status.succeeded();
                log::info!("{summary}");
                summary
            }
            Err(e) => {
                log::error!("config reload refused, still serving the previous config: {e}");
                status.failed(&e);
                format!("reload refused: {e}")
            }
        };
        crate::appliance::notify(&[NotifyState::Ready, NotifyState::Status(&message)]);
    }
}

fn list_or_none(names: &[String]) -> String {
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

/// A reload changes policies only; the listener, limits, keys, TLS and planner hold until a
/// restart. Says so when the file changed them.
fn warn_fixed_sections(old: &Config, new: &Config) {
    let changed = [
        (
            "[server]",
            format!("{:?}", old.server) != format!("{:?}", new.server),
        ),
        (
            "[auth]",
            format!("{:?}", old.auth) != format!("{:?}", new.auth),
        ),
        (
            "[tls]",
            (&old.tls.cert, &old.tls.key) != (&new.tls.cert, &new.tls.key),
        ),
        (
            "[planner]",
            format!("{:?}", old.planner) != format!("{:?}", new.planner),
        ),
    ];
    for (section, differs) in changed {
        if differs {
            log::warn!("{section} changed: it takes effect when policyd restarts, not on reload");
        }
    }
}

/// Answers every connection with 503 until `load` completes, then returns its output; the
/// listener is then handed to [`serve`]. So a supervisor probing `/healthz` while a large
/// model loads sees "not ready yet", not a refused connection.
pub async fn while_loading<T>(
    listener: &TcpListener,
    handshake_timeout: Duration,
    tls: Option<crate::tls::Tls>,
    load: impl std::future::Future<Output = T>,
) -> T {
    tokio::pin!(load);
    let busy = Arc::new(Semaphore::new(64));
    loop {
        tokio::select! {
            out = &mut load => return out,
            accepted = listener.accept() => {
                let Ok((stream, peer)) = accepted else { continue };
                let Ok(permit) = busy.clone().try_acquire_owned() else { continue };
                let tls = tls.clone();
                tokio::spawn(async move {
                    let Some(mut stream) =
                        secure(stream, peer, tls.as_ref(), handshake_timeout).await
                    else {
                        return;
                    };
                    if let Ok(Ok(head)) =
                        tokio::time::timeout(handshake_timeout, read_head(&mut stream)).await
                    {
                        log::debug!("{peer}: {} {} while loading", head.method, head.path);
                        let (ctype, body) = if head.path == "/health" {
                            ("application/json", "{\"status\":\"loading\"}")
                        } else {
                            ("text/plain; charset=utf-8", "policyd is loading its engine\n")
                        };
                        respond(&mut stream, "503 Service Unavailable", ctype, body, "Retry-After: 1\r\n")
                            .await;
                    }
                    drop(permit);
                });
            }
        }
    }
}

/// A parsed HTTP request head.
struct Head {
    method: String,
    path: String,
    upgrade: bool,
    version: Option<String>,
    key: Option<String>,
    /// The `Authorization` header (API keys); never logged.
    authorization: Option<String>,
    /// Bytes read past the head (a client's first frame, if it did not wait).
    rest: Vec<u8>,
}

/// A client's byte stream: plain TCP, or TLS over it.
pub trait Transport: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Transport for T {}

async fn read_head<S: Transport>(stream: &mut S) -> Result<Head, &'static str> {
    let mut buf = vec![0u8; MAX_HEAD];
    let mut len = 0;
    loop {
        let n = stream
            .read(&mut buf[len..])
            .await
            .map_err(|_| "read error")?;
        if n == 0 {
            return Err("closed before the request was complete");
        }
        len += n;
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(&buf[..len]) {
            Ok(httparse::Status::Complete(end)) => {
                let find = |name: &str| {
                    req.headers
                        .iter()
                        .find(|h| h.name.eq_ignore_ascii_case(name))
                        .and_then(|h| std::str::from_utf8(h.value).ok())
                        .map(|v| v.trim().to_string())
                };
                let upgrade =
                    find("upgrade").is_some_and(|v| v.to_ascii_lowercase().contains("websocket"));
                return Ok(Head {
                    method: req.method.unwrap_or("").to_string(),
                    path: req
                        .path
                        .unwrap_or("/")
                        .split('?')
                        .next()
                        .unwrap_or("/")
                        .to_string(),
                    upgrade,
                    version: find("sec-websocket-version"),
                    key: find("sec-websocket-key"),
                    authorization: find("authorization"),
                    rest: buf[end..len].to_vec(),
                });
            }
            Ok(httparse::Status::Partial) if len < MAX_HEAD => continue,
            Ok(httparse::Status::Partial) => return Err("request head too large"),
            Err(_) => return Err("malformed HTTP request"),
        }
    }
}

async fn respond<S: Transport>(
    stream: &mut S,
    status: &str,
    content_type: &str,
    body: &str,
    extra: &str,
) {
    let msg = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n{extra}\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(msg.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// Completes the TLS handshake, if TLS is configured, within the handshake timeout. Boxed,
/// so one connection path serves plain and TLS clients.
async fn secure(
    stream: TcpStream,
    peer: SocketAddr,
    tls: Option<&crate::tls::Tls>,
    timeout: Duration,
) -> Option<Box<dyn Transport>> {
    let _ = stream.set_nodelay(true);
    let Some(tls) = tls else {
        return Some(Box::new(stream));
    };
    match tokio::time::timeout(timeout, tls.0.accept(stream)).await {
        Ok(Ok(s)) => Some(Box::new(s)),
        Ok(Err(e)) => {
            log::info!("{peer}: TLS handshake failed: {e}");
            None
        }
        Err(_) => {
            log::info!("{peer}: TLS handshake timed out after {timeout:?}");
            None
        }
    }
}

async fn handle(
    stream: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    handshake: tokio::sync::OwnedSemaphorePermit,
) {
    let timeout = Duration::from_secs_f64(shared.cfg.server.handshake_timeout_s);
    let Some(mut stream) = secure(stream, peer, shared.cfg.tls.acceptor.as_ref(), timeout).await
    else {
        return;
    };
    let head = match tokio::time::timeout(timeout, read_head(&mut stream)).await {
        Ok(Ok(h)) => h,
        Ok(Err(why)) => {
            log::debug!("{peer}: {why}");
            if why != "closed before the request was complete" && why != "read error" {
                respond(
                    &mut stream,
                    "400 Bad Request",
                    "text/plain; charset=utf-8",
                    &format!("{why}\n"),
                    "",
                )
                .await;
            }
            return;
        }
        Err(_) => {
            log::info!("{peer}: handshake timed out after {timeout:?}");
            return;
        }
    };
    let healthy = shared.policies.load().healthy();
    if head.method == "GET" && head.path == "/healthz" && !head.upgrade {
        if healthy {
            respond(
                &mut stream,
                "200 OK",
                "text/plain; charset=utf-8",
                "OK\n",
                "",
            )
            .await;
        } else {
            respond(
                &mut stream,
                "503 Service Unavailable",
                "text/plain; charset=utf-8",
                "engine unavailable\n",
                "",
            )
            .await;
        }
        return;
    }
    if head.method == "GET" && head.path == "/health" && !head.upgrade {
        if healthy {
            respond(
                &mut stream,
                "200 OK",
                "application/json",
                "{\"status\":\"healthy\"}",
                "",
            )
            .await;
        } else {
            respond(
                &mut stream,
                "503 Service Unavailable",
                "application/json",
                "{\"status\":\"unhealthy\"}",
                "",
            )
            .await;
        }
        return;
    }
    let auth = &shared.cfg.auth;
    let is_metrics = head.method == "GET" && head.path == "/metrics" && !head.upgrade;
    if auth.keys.enabled() && (head.upgrade || (is_metrics && auth.protect_metrics)) {
        let verdict = auth.keys.check(head.authorization.as_deref());
        if verdict != crate::auth::Verdict::Accepted {
            shared.stats.metrics.auth_failures.inc();
            log::warn!("{peer}: refused {}: {}", head.path, verdict.describe());
            respond(
                &mut stream,
                "401 Unauthorized",
                "text/plain; charset=utf-8",
                &format!(
                    "policyd: {}; pass the key with WebsocketClientPolicy(api_key=...)\n",
                    verdict.describe()
                ),
                "WWW-Authenticate: Api-Key\r\n",
            )
            .await;
            return;
        }
    }
    if is_metrics {
        let body = crate::metrics::render(&shared.registry);
        respond(
            &mut stream,
            "200 OK",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            &body,
            "",
        )
        .await;
        return;
    }
    if !head.upgrade {
        if head.method == "GET" {
            respond(
                &mut stream,
                "426 Upgrade Required",
                "text/plain; charset=utf-8",
                "Failed to open a WebSocket connection: this is a policyd WebSocket endpoint.\n",
                "Upgrade: websocket\r\n",
            )
            .await;
        } else {
            respond(
                &mut stream,
                "405 Method Not Allowed",
                "text/plain; charset=utf-8",
                "only GET\n",
                "Allow: GET\r\n",
            )
            .await;
        }
        return;
    }
    if head.version.as_deref() != Some("13") {
        respond(
            &mut stream,
            "426 Upgrade Required",
            "text/plain; charset=utf-8",
            "unsupported WebSocket version; use 13\n",
            "Sec-WebSocket-Version: 13\r\n",
        )
        .await;
        return;
    }
    let Some(key) = head.key else {
        respond(
            &mut stream,
            "400 Bad Request",
            "text/plain; charset=utf-8",
            "missing Sec-WebSocket-Key\n",
            "",
        )
        .await;
        return;
    };
    if *shared.shutdown.borrow() || !healthy {
        respond(
            &mut stream,
            "503 Service Unavailable",
            "text/plain; charset=utf-8",
            "server unavailable\n",
            "",
        )
        .await;
        return;
    }
    // `/policies/<name>` (openpi) or `/policies/<name>/v1/realtime/robot/openpi`
    // (vllm-omni) chooses a policy; other paths get the default one.
    let route = {
        let set = shared.policies.load();
        let (named, rest) = match head.path.strip_prefix("/policies/") {
            Some(r) => {
                let end = r.find('/').unwrap_or(r.len());
                (Some(&r[..end]), &r[end..])
            }
            None => (None, head.path.as_str()),
        };
        let dialect = if rest == VLLM_PATH {
            Dialect::Vllm
        } else {
            Dialect::Openpi
        };
        match named {
            None => (dialect, set.default_policy().clone()),
            Some(name) => match set.get(name) {
                Some(p) => (dialect, p.clone()),
                None => {
                    log::info!("{peer}: refused: no policy named \"{name}\"");
                    respond(
                        &mut stream,
                        "404 Not Found",
                        "text/plain; charset=utf-8",
                        &format!(
                            "policyd serves no policy named \"{name}\"; it serves: {}\n",
                            set.names()
                        ),
                        "",
                    )
                    .await;
                    return;
                }
            },
        }
    };
    let Ok(permit) = shared.connections.clone().try_acquire_owned() else {
        log::warn!(
            "{peer}: refused: at the connection limit (server.max_connections = {})",
            shared.cfg.server.max_connections
        );
        respond(
            &mut stream,
            "503 Service Unavailable",
            "text/plain; charset=utf-8",
            &format!(
                "policyd is serving its maximum of {} connections\n",
                shared.cfg.server.max_connections
            ),
            "Retry-After: 1\r\n",
        )
        .await;
        return;
    };
    let accept = derive_accept_key(key.as_bytes());
    let response = format!(
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\n\r\n"
    );
    if stream.write_all(response.as_bytes()).await.is_err() {
        return;
    }
    drop(handshake);
    let (dialect, policy) = route;
    log::info!(
        "{peer}: connected on {} ({}, policy \"{}\")",
        head.path,
        dialect.name(),
        policy.name
    );
    let server = &shared.cfg.server;
    let frame_timeout =
        (server.frame_timeout_s > 0.0).then(|| Duration::from_secs_f64(server.frame_timeout_s));
    let stream = match FrameGuard::with_frame_timeout(
        stream,
        &head.rest,
        server.max_message_bytes,
        frame_timeout,
    ) {
        Ok(s) => s,
        Err(e) => {
            log::info!("{peer}: {e}");
            return;
        }
    };
    let ws = WebSocketStream::from_raw_socket(stream, Role::Server, Some(shared.ws_config)).await;
    let why = connection::serve(ws, &shared, dialect, policy).await;
    log::info!("{peer}: closed ({why})");
    drop(permit);
}
