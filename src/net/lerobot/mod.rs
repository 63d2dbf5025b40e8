//! How does LeRobot's own `robot_client` reach a policy? Its `AsyncInference` gRPC service
//! (`[lerobot]`), on its own port, through the same request core as the WebSocket.
//!
//! The client's payloads are pickles. policyd reads them with its strict reader
//! ([`crate::protocol::lerobot::pickle`]), which executes nothing, and writes its replies byte by byte
//! ([`crate::protocol::lerobot`]). The client never names a model policyd would load: its
//! `pretrained_name_or_path` must be a served policy's name or a `[[lerobot.serve]]` entry.
//!
//! Like LeRobot's server there is one session: `Ready` resets it and `SendPolicyInstructions`
//! binds it to a policy. Unlike LeRobot's, the session belongs to the connection that set it
//! up: another connection's `Ready`, setup, observations and polls are refused while the owner
//! is connected and has made a call within `lerobot.takeover_after_s`, so no other peer can
//! permute the robot's motors, shrink its chunks or take its actions. The owner's address gets
//! its session back (a reconnect carries it on; its new `Ready` wins over a connection that only
//! adopted the session); another address may take it over only once the owner has gone or
//! fallen silent and `lerobot.owner_grace_s` has passed ([`owner`]). A session task
//! owns the request core; the RPC handlers talk to it over a bounded channel:
//! - `SendObservations` reassembles the chunks, the session task decodes the pickle straight
//!   into a slot's engine buffers (state vector in the client's motor order, camera frames
//!   resized to the policy's inputs if `lerobot.resize` allows) and answers at once; a stream
//!   takes one of two reassembly permits only once its first chunk has arrived, a peer holds
//!   at most one, and each chunk and each whole observation has a deadline;
//! - `GetActions` waits up to `lerobot.long_poll_ms` for the next chunk released by the pacing
//!   scheduler; "none" is the zero-length reply, never a pickled empty list (the client
//!   divides by the list's length).
//!
//! Here: the service's listener and its refusals' reasons; [`service`]: the RPCs and the
//! reassembly of observations; [`session`]: the session task; [`owner`]: who may act on the
//! session.

mod owner;
mod service;
mod session;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::config::LerobotConfig;
use crate::net::grpc_conn::GrpcConn;
use crate::net::peers::canonical;
use crate::net::shared::Shared;
use crate::protocol::cap_message;

/// The service's messages and server, generated from proto/services.proto by build.rs.
#[allow(clippy::all, missing_docs)]
pub mod transport {
    tonic::include_proto!("transport");
}

use transport::async_inference_server::AsyncInferenceServer;

/// LeRobot's chunk size: no single message is larger (plus protobuf framing).
const CHUNK_BYTES: usize = 2 << 20;
/// What the client accepts in one reply (gRPC's and LeRobot's cap).
const CLIENT_MAX_MESSAGE: usize = 4 << 20;

/// Streams one connection may have open (LeRobot's client has two at most: an observation and
/// a long poll).
const STREAMS_PER_CONNECTION: u32 = 8;

/// The longest message a refusal carries (gRPC status and log line); client strings in it are
/// clipped already, this is the backstop.
const MAX_STATUS_MESSAGE: usize = 1024;

/// Serves the service on `listener` until the server shuts down.
pub async fn serve(shared: Arc<Shared>, listener: TcpListener) {
    let Some(cfg) = shared.cfg.lerobot.clone() else {
        return;
    };
    let (tx, rx) = mpsc::channel(8);
    let session = tokio::spawn(session::run(shared.clone(), rx));
    let service = service::Service::new(shared.clone(), cfg.clone(), tx);
    let server = AsyncInferenceServer::new(service)
        .max_decoding_message_size(CHUNK_BYTES + 1024)
        .max_encoding_message_size(CLIENT_MAX_MESSAGE);
    // Peers are checked as they connect: off the allow-list, or over lerobot.max_connections,
    // a connection is closed at once, counted, and logged at most once a second.
    let (conns, incoming) = mpsc::channel::<std::io::Result<GrpcConn>>(16);
    let accept = tokio::spawn(accept(shared.clone(), cfg, listener, conns));
    let mut stop = shared.shutdown.clone();
    let refusals = shared.clone();
    let result = tonic::transport::Server::builder()
        // ~1.8 MB observations at 30 Hz: HTTP/2's 64 KiB default windows would throttle them.
        .initial_stream_window_size(Some(8 << 20))
        .initial_connection_window_size(Some(16 << 20))
        .tcp_nodelay(true)
        .max_concurrent_streams(Some(STREAMS_PER_CONNECTION))
        .layer(tower::util::MapResponseLayer::new(
            move |r: tonic::codegen::http::Response<tonic::body::Body>| {
                count_early_refusal(&refusals, r)
            },
        ))
        .add_service(server)
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::ReceiverStream::new(incoming),
            async move {
                while !*stop.borrow() {
                    if stop.changed().await.is_err() {
                        break;
                    }
                }
            },
        )
        .await;
    if let Err(e) = result {
        log::error!("lerobot: the gRPC service stopped: {e}");
    }
    accept.abort();
    session.abort();
}

/// Accepts the service's connections until the server shuts down, handing tonic those that
/// pass the allow-list, the per-address share and `lerobot.max_connections`.
async fn accept(
    shared: Arc<Shared>,
    cfg: LerobotConfig,
    listener: TcpListener,
    conns: mpsc::Sender<std::io::Result<GrpcConn>>,
) {
    let mut stop = shared.shutdown.clone();
    let open = Arc::new(tokio::sync::Semaphore::new(cfg.max_connections));
    let peers =
        crate::net::peers::PeerShare::new(cfg.max_connections_per_peer, cfg.max_connections);
    loop {
        tokio::select! {
            changed = stop.changed() => {
                if changed.is_err() || *stop.borrow() {
                    break;
                }
            }
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let metrics = &shared.stats().metrics;
                    if !allowed(&cfg, peer) {
                        crate::warn_limited!(
                            "lerobot: {peer} is not in lerobot.allow; connection refused"
                        );
                        metrics.lerobot_refused(Reason::Peer.label());
                        continue;
                    }
                    let Some(peer_permit) = peers.try_acquire(peer.ip()) else {
                        crate::warn_limited!(
                            "lerobot: {peer} refused: this address holds its share of the \
                             connections (lerobot.max_connections_per_peer = {})",
                            cfg.max_connections_per_peer
                        );
                        metrics.lerobot_refused(Reason::PeerShare.label());
                        continue;
                    };
                    let Ok(permit) = open.clone().try_acquire_owned() else {
                        crate::warn_limited!(
                            "lerobot: {peer} refused: {} connections are open \
                             (lerobot.max_connections)",
                            cfg.max_connections
                        );
                        metrics.lerobot_refused(Reason::Connections.label());
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    let conn = GrpcConn::new(
                        stream,
                        peer,
                        (permit, peer_permit),
                        cfg.handshake_timeout,
                        cfg.idle_timeout,
                    );
                    if conns.send(Ok(conn)).await.is_err() {
                        break;
                    }
                }
                Err(e) => {
                    crate::warn_limited!("lerobot: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
}

/// Why the service refused a connection or a call: the `reason` label of
/// `policyd_lerobot_refused_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reason {
    /// The peer is not in `lerobot.allow`.
    Peer,
    /// The peer's address holds its share of the connections.
    PeerShare,
    /// `lerobot.max_connections` are open.
    Connections,
    /// A payload the reader refused, in either format (labelled `pickle`, as before the JSON
    /// format existed: the label is what dashboards count).
    Unreadable,
    /// A setup that does not fit a served policy, or an observation before any setup.
    Setup,
    /// Another connection owns the session.
    Owner,
    /// Observations are being reassembled already.
    Busy,
    /// Past a size limit.
    Oversize,
    /// The observation's chunks are out of order or incomplete.
    Chunking,
    /// The observation's chunks stopped arriving.
    Slow,
    /// A readable observation that does not fit the policy's inputs.
    Observation,
}

impl Reason {
    fn label(self) -> &'static str {
        match self {
            Reason::Peer => "peer",
            Reason::PeerShare => "peer_share",
            Reason::Connections => "connections",
            Reason::Unreadable => "pickle",
            Reason::Setup => "setup",
            Reason::Owner => "owner",
            Reason::Busy => "busy",
            Reason::Oversize => "oversize",
            Reason::Chunking => "chunking",
            Reason::Slow => "slow",
            Reason::Observation => "observation",
        }
    }
}

/// Counts a refusal under `reason` and logs it (at most once a second): its message, cut to
/// [`MAX_STATUS_MESSAGE`], which is returned for the client's status.
fn record_refusal(shared: &Shared, reason: Reason, message: String) -> String {
    let reason = reason.label();
    shared.stats().metrics.lerobot_refused(reason);
    let message = cap_message(message, MAX_STATUS_MESSAGE);
    crate::log_limited!(log::Level::Info, "lerobot: refused ({reason}): {message}");
    message
}

/// tonic refuses a message over its size limit before any handler runs (the setup, a unary
/// call, over [`CHUNK_BYTES`]): its reply is a trailers-only response with `grpc-status`
/// `OUT_OF_RANGE` in the headers. Counted (`oversize`) and logged here like the handlers'
/// refusals; the handlers never answer `OUT_OF_RANGE` themselves, so nothing counts twice.
fn count_early_refusal<B>(
    shared: &Shared,
    r: tonic::codegen::http::Response<B>,
) -> tonic::codegen::http::Response<B> {
    let out_of_range = r
        .headers()
        .get("grpc-status")
        .is_some_and(|v| v.as_bytes() == b"11");
    if out_of_range {
        let message = r
            .headers()
            .get("grpc-message")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        record_refusal(
            shared,
            Reason::Oversize,
            format!(
                "{message} (a gRPC message is at most {CHUNK_BYTES} bytes and a setup is one \
                 message)"
            ),
        );
    }
    r
}

fn allowed(cfg: &LerobotConfig, peer: SocketAddr) -> bool {
    let ip = canonical(peer.ip());
    cfg.allow.is_empty() || cfg.allow.iter().any(|n| n.contains(&ip))
}
