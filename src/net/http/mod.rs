//! What does an incoming HTTP request get? Health, metrics, 401/404/426/503, or the upgrade to
//! a WebSocket of the dialect and policy its path names.
//!
//! policyd reads the HTTP request itself (bounded in size and time) so that `/healthz`,
//! `/health`, the connection limit (HTTP 503) and plain GETs (426) are answered before any
//! WebSocket machinery runs, then hands the socket to tungstenite without a second handshake.

mod answer;
mod head;

pub use head::Transport;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::Role;

use answer::{Now, Upgrade, answer};
use head::{Head, read_head};

use crate::net::connection;
use crate::net::frame_guard::FrameGuard;
use crate::net::shared::Shared;

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
        let set = shared.policies().load();
        let now = Now {
            healthy: set.healthy(),
            shutting_down: *shared.shutdown.borrow(),
            access: &shared.access,
            set: &set,
        };
        answer(&head, &now)
    };
    match answer {
        Ok(u) => upgrade(stream, peer, &shared, &head, u, handshake).await,
        Err(refused) => {
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
    Upgrade {
        key,
        dialect,
        policy,
    }: Upgrade,
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
        .max_write_buffer_size(write_buffer_bound(&shared.policies().load()));
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
    shared.stats().metrics.connection_refused(reason);
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
