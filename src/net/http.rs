//! What does an incoming HTTP request get? Health, metrics, 401/404/426/503, or the upgrade to
//! a WebSocket of the dialect and policy its path names.
//!
//! policyd reads the HTTP request itself (bounded in size and time) so that `/healthz`,
//! `/health`, the connection limit (HTTP 503) and plain GETs (426) are answered before any
//! WebSocket machinery runs, then hands the socket to tungstenite without a second handshake.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::Role;

use crate::limits::MAX_HEAD;
use crate::net::auth::Verdict;
use crate::net::connection;
use crate::net::frame_guard::FrameGuard;
use crate::net::shared::Shared;
use crate::policy::{Policy, PolicySet};
use crate::protocol::Dialect;

/// Answers every connection with 503 until `load` completes, then returns its output; the
/// listener is then handed to [`serve_set`](crate::net::server::serve_set). So a supervisor
/// probing `/healthz` while a large model loads sees "not ready yet", not a refused connection.
pub async fn while_loading<T>(
    listener: &TcpListener,
    handshake_timeout: Duration,
    tls: Option<crate::net::tls::Tls>,
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
    /// `HTTP/1.<minor>`.
    minor: u8,
    upgrade: bool,
    /// Whether a `Connection` header lists the `upgrade` token.
    connection_upgrade: bool,
    version: Option<String>,
    /// Every `Sec-WebSocket-Key` value (a valid handshake has exactly one).
    keys: Vec<String>,
    /// Every `Authorization` header (API keys; more than one is refused); never logged.
    authorizations: Vec<String>,
    /// The request says it has a body (`Content-Length` other than 0, or
    /// `Transfer-Encoding`): a WebSocket handshake has none.
    body: bool,
    /// Bytes read past the head (a client's first frame, if it did not wait).
    rest: Vec<u8>,
}

/// A client's byte stream: plain TCP, or TLS over it.
pub trait Transport: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Transport for T {}

/// Why no request head was read.
#[derive(Debug, thiserror::Error)]
enum HeadError {
    /// The client went away: there is nobody to answer.
    #[error("read error: {0}")]
    Read(std::io::Error),
    #[error("closed before the request was complete")]
    Closed,
    /// The client is there and gets a 400 saying why.
    #[error("request head too large")]
    TooLarge,
    #[error("malformed HTTP request")]
    Malformed,
}

impl HeadError {
    /// Whether a 400 can reach the client.
    fn answerable(&self) -> bool {
        matches!(self, HeadError::TooLarge | HeadError::Malformed)
    }
}

async fn read_head<S: Transport>(stream: &mut S) -> Result<Head, HeadError> {
    let mut buf = vec![0u8; MAX_HEAD];
    let mut len = 0;
    loop {
        let n = stream
            .read(&mut buf[len..])
            .await
            .map_err(HeadError::Read)?;
        if n == 0 {
            return Err(HeadError::Closed);
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
                let all = |name: &str| {
                    req.headers
                        .iter()
                        .filter(|h| h.name.eq_ignore_ascii_case(name))
                        .map(|h| String::from_utf8_lossy(h.value).trim().to_string())
                        .collect::<Vec<_>>()
                };
                // Token lists (`Connection: keep-alive, Upgrade`), over every such header.
                let has_token = |name: &str, token: &str| {
                    all(name)
                        .iter()
                        .any(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
                };
                return Ok(Head {
                    method: req.method.unwrap_or("").to_string(),
                    minor: req.version.unwrap_or(0),
                    path: req
                        .path
                        .unwrap_or("/")
                        .split('?')
                        .next()
                        .unwrap_or("/")
                        .to_string(),
                    upgrade: has_token("upgrade", "websocket"),
                    connection_upgrade: has_token("connection", "upgrade"),
                    version: find("sec-websocket-version"),
                    keys: all("sec-websocket-key"),
                    authorizations: all("authorization"),
                    body: all("content-length").iter().any(|v| v != "0")
                        || !all("transfer-encoding").is_empty(),
                    rest: buf[end..len].to_vec(),
                });
            }
            Ok(httparse::Status::Partial) if len < MAX_HEAD => continue,
            Ok(httparse::Status::Partial) => return Err(HeadError::TooLarge),
            Err(_) => return Err(HeadError::Malformed),
        }
    }
}

/// RFC 6455 §4.2.1: what a server must find in a client's opening handshake (beyond
/// `Upgrade: websocket`, which routed it here, and the version, answered with 426). A request
/// that lacks any of it is not a WebSocket handshake and gets 400, not 101. The key, if
/// it is one.
fn upgrade_request(head: &Head) -> Result<&str, String> {
    if head.method != "GET" {
        return Err(format!(
            "a WebSocket handshake must be a GET request, got {}",
            head.method
        ));
    }
    if head.minor < 1 {
        return Err("a WebSocket handshake needs HTTP/1.1 or later, got HTTP/1.0".into());
    }
    if !head.connection_upgrade {
        return Err(
            "a WebSocket handshake needs a Connection header with the Upgrade token".into(),
        );
    }
    if head.body {
        // Its bytes would be read as WebSocket frames (RFC 6455 §4.1: the handshake is a GET
        // with no body).
        return Err(
            "a WebSocket handshake has no body (Content-Length or Transfer-Encoding)".into(),
        );
    }
    match head.keys.as_slice() {
        [] => Err("missing Sec-WebSocket-Key".into()),
        [key] if is_websocket_key(key) => Ok(key),
        [_] => Err(
            "Sec-WebSocket-Key must be 16 random bytes in base64 (24 characters ending in ==)"
                .into(),
        ),
        _ => Err("more than one Sec-WebSocket-Key header".into()),
    }
}

/// Whether `key` is the base64 of exactly 16 bytes: 22 characters of the standard alphabet
/// (the last carrying no bits past the 128th) and `==`.
fn is_websocket_key(key: &str) -> bool {
    let b = key.as_bytes();
    let value = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    b.len() == 24
        && b.ends_with(b"==")
        && b[..22].iter().all(|&c| value(c).is_some())
        && value(b[21]).is_some_and(|v| v & 0x0f == 0)
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

/// HTTP 400 saying why.
async fn bad_request<S: Transport>(stream: &mut S, why: &(dyn std::fmt::Display + Sync)) {
    respond(
        stream,
        "400 Bad Request",
        "text/plain; charset=utf-8",
        &format!("{why}\n"),
        "",
    )
    .await;
}

/// Completes the TLS handshake, if TLS is configured, within the handshake timeout. Boxed,
/// so one connection path serves plain and TLS clients.
async fn secure(
    stream: TcpStream,
    peer: SocketAddr,
    tls: Option<&crate::net::tls::Tls>,
    timeout: Duration,
) -> Option<Box<dyn Transport>> {
    let _ = stream.set_nodelay(true);
    let Some(tls) = tls else {
        return Some(Box::new(stream));
    };
    match tokio::time::timeout(timeout, tls.0.accept(stream)).await {
        Ok(Ok(s)) => Some(Box::new(s)),
        Ok(Err(e)) => {
            crate::log_limited!(log::Level::Info, "{peer}: TLS handshake failed: {e}");
            None
        }
        Err(_) => {
            crate::log_limited!(
                log::Level::Info,
                "{peer}: TLS handshake timed out after {timeout:?}"
            );
            None
        }
    }
}

/// What a request head gets: a response, or the WebSocket upgrade on a dialect and policy.
enum Answer {
    /// `/healthz` (text) or `/health` (JSON).
    Health {
        json: bool,
        healthy: bool,
    },
    Metrics,
    /// A missing or wrong API key.
    Unauthorized(Verdict),
    /// A request that is not a WebSocket upgrade: 426 to a GET, 405 otherwise.
    NotWebSocket {
        get: bool,
    },
    /// An upgrade request without what a handshake needs.
    BadUpgrade(String),
    WrongVersion,
    /// Shutting down, or the engine is unhealthy.
    Unavailable,
    NoSuchPolicy {
        name: String,
        serves: String,
    },
    Upgrade {
        key: String,
        dialect: Dialect,
        policy: Arc<Policy>,
    },
}

/// What an answer depends on beyond the head.
struct Now<'a> {
    healthy: bool,
    shutting_down: bool,
    access: &'a crate::net::Access,
    set: &'a PolicySet,
}

/// The answer to `head`: health and metrics before any key check but the metrics' own,
/// then the key, then the handshake, then the route. `/policies/<name>` (openpi) or
/// `/policies/<name>/v1/realtime/robot/openpi` (vllm-omni) chooses a policy; other paths get
/// the default one.
fn answer(head: &Head, now: &Now<'_>) -> Answer {
    let plain_get = head.method == "GET" && !head.upgrade;
    if plain_get && (head.path == "/healthz" || head.path == "/health") {
        return Answer::Health {
            json: head.path == "/health",
            healthy: now.healthy,
        };
    }
    let is_metrics = plain_get && head.path == "/metrics";
    let keys = &now.access.keys;
    if keys.enabled() && (head.upgrade || (is_metrics && now.access.protect_metrics)) {
        let verdict = keys.check_all(&head.authorizations);
        if verdict != Verdict::Accepted {
            return Answer::Unauthorized(verdict);
        }
    }
    if is_metrics {
        return Answer::Metrics;
    }
    if !head.upgrade {
        return Answer::NotWebSocket {
            get: head.method == "GET",
        };
    }
    let key = match upgrade_request(head) {
        Ok(key) => key.to_string(),
        Err(why) => return Answer::BadUpgrade(why),
    };
    if head.version.as_deref() != Some("13") {
        return Answer::WrongVersion;
    }
    if now.shutting_down || !now.healthy {
        return Answer::Unavailable;
    }
    let (named, rest) = match head.path.strip_prefix("/policies/") {
        Some(r) => {
            let end = r.find('/').unwrap_or(r.len());
            (Some(&r[..end]), &r[end..])
        }
        None => (None, head.path.as_str()),
    };
    let policy = match named {
        None => now.set.default_policy(),
        Some(name) => match now.set.get(name) {
            Some(p) => p,
            None => {
                return Answer::NoSuchPolicy {
                    name: name.to_string(),
                    serves: now.set.names(),
                };
            }
        },
    };
    Answer::Upgrade {
        key,
        dialect: Dialect::for_path(rest),
        policy: policy.clone(),
    }
}

impl Answer {
    /// Logs and counts a refusal (peer-provoked: rate-limited, the client's text clipped).
    fn note(&self, peer: SocketAddr, head: &Head, shared: &Shared) {
        match self {
            Answer::Unauthorized(verdict) => {
                shared.stats.metrics.auth_failures.inc();
                crate::warn_limited!(
                    "{peer}: refused {}: {}",
                    crate::protocol::clip(&head.path),
                    verdict.describe()
                );
            }
            Answer::BadUpgrade(why) => crate::log_limited!(
                log::Level::Info,
                "{peer}: refused the WebSocket handshake: {}",
                crate::protocol::clip(why)
            ),
            Answer::NoSuchPolicy { name, .. } => crate::log_limited!(
                log::Level::Info,
                "{peer}: refused: no policy named \"{}\"",
                crate::protocol::clip(name)
            ),
            _ => {}
        }
    }

    /// The HTTP response of every answer but the upgrade: status, content type, body and
    /// extra headers.
    fn response(&self, shared: &Shared) -> (&'static str, &'static str, String, &'static str) {
        const TEXT: &str = "text/plain; charset=utf-8";
        const JSON: &str = "application/json";
        const OK: &str = "200 OK";
        const UNAVAILABLE: &str = "503 Service Unavailable";
        let text = |s: &str| s.to_string();
        match self {
            Answer::Health {
                json: false,
                healthy: true,
            } => (OK, TEXT, text("OK\n"), ""),
            Answer::Health {
                json: false,
                healthy: false,
            } => (UNAVAILABLE, TEXT, text("engine unavailable\n"), ""),
            Answer::Health {
                json: true,
                healthy: true,
            } => (OK, JSON, text("{\"status\":\"healthy\"}"), ""),
            Answer::Health {
                json: true,
                healthy: false,
            } => (UNAVAILABLE, JSON, text("{\"status\":\"unhealthy\"}"), ""),
            Answer::Metrics => (
                OK,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                crate::net::scrape::render(&shared.registry),
                "",
            ),
            Answer::Unauthorized(verdict) => (
                "401 Unauthorized",
                TEXT,
                format!(
                    "policyd: {}; pass the key with WebsocketClientPolicy(api_key=...)\n",
                    verdict.describe()
                ),
                "WWW-Authenticate: Api-Key\r\n",
            ),
            Answer::NotWebSocket { get: true } => (
                "426 Upgrade Required",
                TEXT,
                text(
                    "Failed to open a WebSocket connection: this is a policyd WebSocket endpoint.\n",
                ),
                "Upgrade: websocket\r\n",
            ),
            Answer::NotWebSocket { get: false } => (
                "405 Method Not Allowed",
                TEXT,
                text("only GET\n"),
                "Allow: GET\r\n",
            ),
            Answer::BadUpgrade(why) => ("400 Bad Request", TEXT, format!("{why}\n"), ""),
            Answer::WrongVersion => (
                "426 Upgrade Required",
                TEXT,
                text("unsupported WebSocket version; use 13\n"),
                "Sec-WebSocket-Version: 13\r\n",
            ),
            // (`handle` upgrades rather than answers an upgrade.)
            Answer::Unavailable | Answer::Upgrade { .. } => {
                (UNAVAILABLE, TEXT, text("server unavailable\n"), "")
            }
            Answer::NoSuchPolicy { name, serves } => (
                "404 Not Found",
                TEXT,
                format!("policyd serves no policy named \"{name}\"; it serves: {serves}\n"),
                "",
            ),
        }
    }
}

/// One accepted connection: TLS, the request head within the handshake timeout, then its
/// [`answer`]: a response, or the WebSocket connection.
pub(crate) async fn handle(
    stream: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    handshake: tokio::sync::OwnedSemaphorePermit,
) {
    let timeout = Duration::from_secs_f64(shared.cfg.server.handshake_timeout_s);
    let Some(mut stream) = secure(stream, peer, shared.access.tls.as_ref(), timeout).await else {
        return;
    };
    let head = match tokio::time::timeout(timeout, read_head(&mut stream)).await {
        Ok(Ok(h)) => h,
        Ok(Err(why)) => {
            log::debug!("{peer}: {why}");
            if why.answerable() {
                bad_request(&mut stream, &why).await;
            }
            return;
        }
        Err(_) => {
            crate::log_limited!(
                log::Level::Info,
                "{peer}: handshake timed out after {timeout:?}"
            );
            return;
        }
    };
    let answer = {
        let set = shared.policies.load();
        let now = Now {
            healthy: set.healthy(),
            shutting_down: *shared.shutdown.borrow(),
            access: &shared.access,
            set: &set,
        };
        answer(&head, &now)
    };
    match answer {
        Answer::Upgrade {
            key,
            dialect,
            policy,
        } => {
            upgrade(
                stream,
                peer,
                &shared,
                &head,
                &key,
                (dialect, policy),
                handshake,
            )
            .await
        }
        refused => {
            refused.note(peer, &head, &shared);
            let (status, ctype, body, extra) = refused.response(&shared);
            respond(&mut stream, status, ctype, &body, extra).await;
        }
    }
}

/// The WebSocket upgrade: the connection's permits (or its 503), the 101, the frame guard
/// under tungstenite, and the connection's loop until it closes.
async fn upgrade(
    mut stream: Box<dyn Transport>,
    peer: SocketAddr,
    shared: &Arc<Shared>,
    head: &Head,
    key: &str,
    (dialect, policy): (Dialect, Arc<Policy>),
    handshake: tokio::sync::OwnedSemaphorePermit,
) {
    let Some((permit, peer_permit)) = admit(&mut stream, peer, shared).await else {
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
    // Peer-provoked (any client can open and close connections in a loop): rate-limited, and
    // the path is the client's text.
    crate::log_limited!(
        log::Level::Info,
        "{peer}: connected on {} ({}, policy \"{}\")",
        crate::protocol::clip(&head.path),
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
        Ok(s) => s.with_write_timeout(Some(Duration::from_secs_f64(server.write_timeout_s))),
        Err(e) => {
            crate::log_limited!(log::Level::Info, "{peer}: {e}");
            return;
        }
    };
    // tungstenite's write buffer holds one frame and the control frames queued behind it:
    // bounded by the largest frame any served policy sends, so a peer that never reads cannot
    // grow it (a ping flood queues one pong, not one per ping).
    let ws_config = shared
        .ws_config
        .max_write_buffer_size(write_buffer_bound(&shared.policies.load()));
    let ws = WebSocketStream::from_raw_socket(stream, Role::Server, Some(ws_config)).await;
    let why = connection::serve(ws, shared, dialect, policy).await;
    crate::log_limited!(
        log::Level::Info,
        "{peer}: closed ({})",
        crate::log_limit::Escaped(&why.to_string())
    );
    drop(permit);
    drop(peer_permit);
}

/// A connection's two permits: its address's share of the cap (a few sockets from one host
/// cannot hold every slot and lock the robots out), then a slot under
/// `server.max_connections`. `None` once the client has had its 503 (counted and logged).
async fn admit<S: Transport>(
    stream: &mut S,
    peer: SocketAddr,
    shared: &Shared,
) -> Option<(OwnedSemaphorePermit, crate::net::peers::PeerPermit)> {
    let server = &shared.cfg.server;
    let (reason, body) = match shared.peers.try_acquire(peer.ip()) {
        None => {
            crate::warn_limited!(
                "{peer}: refused: this address holds its share of the connections \
                 (server.max_connections_per_peer = {})",
                server.max_connections_per_peer
            );
            (
                "peer_share",
                format!(
                    "policyd serves at most {} connections from one address\n",
                    server.max_connections_per_peer
                ),
            )
        }
        Some(peer_permit) => match shared.connections.clone().try_acquire_owned() {
            Ok(permit) => return Some((permit, peer_permit)),
            Err(_) => {
                crate::warn_limited!(
                    "{peer}: refused: at the connection limit (server.max_connections = {})",
                    server.max_connections
                );
                (
                    "limit",
                    format!(
                        "policyd is serving its maximum of {} connections\n",
                        server.max_connections
                    ),
                )
            }
        },
    };
    shared.stats.metrics.connection_refused(reason);
    respond(
        stream,
        "503 Service Unavailable",
        "text/plain; charset=utf-8",
        &body,
        "Retry-After: 1\r\n",
    )
    .await;
    None
}

/// The most a connection's write buffer may hold for `set`: [`crate::bind::Plan::write_buffer`]
/// of its largest policy (a connection may move between them).
fn write_buffer_bound(set: &crate::policy::PolicySet) -> usize {
    set.policies
        .iter()
        .map(|p| p.plan.write_buffer())
        .max()
        .unwrap_or(0)
}
