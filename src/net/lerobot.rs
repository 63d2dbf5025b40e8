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
//! fallen silent and `lerobot.owner_grace_s` has passed ([`crate::net::owner`]). A session task
//! owns the [`Core`]; the RPC handlers talk to it over a bounded channel:
//! - `SendObservations` reassembles the chunks, the session task decodes the pickle straight
//!   into a slot's engine buffers (state vector in the client's motor order, camera frames
//!   resized to the policy's inputs if `lerobot.resize` allows) and answers at once; a stream
//!   takes one of two reassembly permits only once its first chunk has arrived, a peer holds
//!   at most one, and each chunk and each whole observation has a deadline;
//! - `GetActions` waits up to `lerobot.long_poll_ms` for the next chunk released by the pacing
//!   scheduler; "none" is the zero-length reply, never a pickled empty list (the client
//!   divides by the list's length).

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tonic::{Request, Response, Status, Streaming};

use crate::bind::lerobot::Adapter;
use crate::config::LerobotConfig;
use crate::net::grpc_conn::{ConnInfo, GrpcConn};
use crate::net::owner::{self, Claim};
use crate::net::peers::canonical;
use crate::net::requests::{Core, Event, Started};
use crate::net::shared::Shared;
use crate::policy::Policy;
use crate::protocol::dialect::{Precision, ResetScope};
use crate::protocol::lerobot::{self, Payloads, PolicySetup};
use crate::protocol::{Route, WireError, cap_message, clip};
use crate::runtime::worker::Lease;

/// The service's messages and server, generated from proto/services.proto by build.rs.
#[allow(clippy::all, missing_docs)]
pub mod transport {
    tonic::include_proto!("transport");
}

use transport::async_inference_server::{AsyncInference, AsyncInferenceServer};
use transport::{Actions, Empty, Observation, TransferState};

/// LeRobot's chunk size: no single message is larger (plus protobuf framing).
const CHUNK_BYTES: usize = 2 << 20;
/// What the client accepts in one reply (gRPC's and LeRobot's cap).
const CLIENT_MAX_MESSAGE: usize = 4 << 20;

/// Observations reassembled at once (one client sends one at a time; more is abuse).
const REASSEMBLIES: usize = 2;
/// A reassembly buffer larger than this (three 640x480 cameras are 2.8 MB) is freed after use
/// rather than kept, so one hostile observation does not hold its size for the process's life.
const KEEP_BUFFER: usize = 8 << 20;
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
    let session = tokio::spawn(session(shared.clone(), rx));
    let service = Service {
        shared: shared.clone(),
        cfg: cfg.clone(),
        tx,
        buffers: Mutex::new(Vec::new()),
        reassembling: Mutex::new(heapless::Vec::new()),
    };
    let server = AsyncInferenceServer::new(service)
        .max_decoding_message_size(CHUNK_BYTES + 1024)
        .max_encoding_message_size(CLIENT_MAX_MESSAGE);
    // Peers are checked as they connect: off the allow-list, or over lerobot.max_connections,
    // a connection is closed at once, counted, and logged at most once a second.
    let (conns, incoming) = mpsc::channel::<std::io::Result<GrpcConn>>(16);
    let mut stop = shared.shutdown.clone();
    let accept_shared = shared.clone();
    let open = Arc::new(tokio::sync::Semaphore::new(cfg.max_connections));
    let peers =
        crate::net::peers::PeerShare::new(cfg.max_connections_per_peer, cfg.max_connections);
    let accept = tokio::spawn(async move {
        loop {
            tokio::select! {
                changed = stop.changed() => {
                    if changed.is_err() || *stop.borrow() {
                        break;
                    }
                }
                accepted = listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        let metrics = &accept_shared.stats.metrics;
                        if !allowed(&cfg, peer) {
                            crate::warn_limited!(
                                "lerobot: {peer} is not in lerobot.allow; connection refused"
                            );
                            metrics.lerobot_refused("peer");
                            continue;
                        }
                        let Some(peer_permit) = peers.try_acquire(peer.ip()) else {
                            crate::warn_limited!(
                                "lerobot: {peer} refused: this address holds its share of the \
                                 connections (lerobot.max_connections_per_peer = {})",
                                cfg.max_connections_per_peer
                            );
                            metrics.lerobot_refused("peer_share");
                            continue;
                        };
                        let Ok(permit) = open.clone().try_acquire_owned() else {
                            crate::warn_limited!(
                                "lerobot: {peer} refused: {} connections are open \
                                 (lerobot.max_connections)",
                                cfg.max_connections
                            );
                            metrics.lerobot_refused("connections");
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
    });
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

/// Counts a refusal under `reason` and logs it (at most once a second): its message, cut to
/// [`MAX_STATUS_MESSAGE`], which is returned for the client's status.
fn record_refusal(shared: &Shared, reason: &'static str, message: String) -> String {
    shared.stats.metrics.lerobot_refused(reason);
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
            "oversize",
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

/// An observation the session refused, and why (the `reason` label of
/// `policyd_lerobot_refused_total`).
struct Refusal {
    reason: &'static str,
    status: Status,
}

impl Refusal {
    fn new(reason: &'static str, status: Status) -> Refusal {
        Refusal { reason, status }
    }
}

/// What the RPC handlers ask of the session task; each names the connection it came by.
enum Command {
    /// `Ready`: forget the session's state.
    Ready {
        from: ConnInfo,
        reply: oneshot::Sender<Result<(), Status>>,
    },
    /// `SendPolicyInstructions`, checked: serve `policy` with this adapter.
    Setup {
        from: ConnInfo,
        policy: Arc<Policy>,
        adapter: Box<Adapter>,
        setup: Box<PolicySetup>,
        reply: oneshot::Sender<Result<(), Status>>,
    },
    /// `SendObservations`, reassembled; the reply carries the buffer back for reuse.
    Observe {
        from: ConnInfo,
        payload: Vec<u8>,
        received: Instant,
        reply: oneshot::Sender<(Result<(), Refusal>, Vec<u8>)>,
    },
    /// `GetActions`: the next chunk's pickle.
    Poll {
        from: ConnInfo,
        reply: oneshot::Sender<Result<Vec<u8>, Status>>,
    },
}

struct Service {
    shared: Arc<Shared>,
    cfg: LerobotConfig,
    tx: mpsc::Sender<Command>,
    /// Reassembly buffers handed back by the session task: one or two, reused.
    buffers: Mutex<Vec<Vec<u8>>>,
    /// The peers whose observations are being reassembled: at most [`REASSEMBLIES`] buffers of
    /// `max_payload_bytes`, one per peer, however many streams clients open.
    reassembling: Mutex<heapless::Vec<IpAddr, REASSEMBLIES>>,
}

/// One peer's place among the observations being reassembled, given back on drop.
struct Reassembly<'s> {
    service: &'s Service,
    ip: IpAddr,
}

impl Drop for Reassembly<'_> {
    fn drop(&mut self) {
        if let Ok(mut held) = self.service.reassembling.lock()
            && let Some(i) = held.iter().position(|p| *p == self.ip)
        {
            held.swap_remove(i);
        }
    }
}

impl Service {
    fn refuse(&self, reason: &'static str, status: Status) -> Status {
        let message = record_refusal(&self.shared, reason, status.message().to_string());
        Status::new(status.code(), message)
    }

    fn gone() -> Status {
        Status::unavailable("policyd is shutting down")
    }

    /// A place to reassemble `ip`'s observation: refused while that peer has one already, or
    /// [`REASSEMBLIES`] peers have.
    fn reassembly(&self, ip: IpAddr) -> Result<Reassembly<'_>, Status> {
        let mut held = self.reassembling.lock().map_err(|_| Self::gone())?;
        if held.contains(&ip) {
            return Err(self.refuse(
                "busy",
                Status::resource_exhausted(
                    "an observation from this address is being received already; send one at \
                     a time",
                ),
            ));
        }
        if held.push(ip).is_err() {
            return Err(self.refuse(
                "busy",
                Status::resource_exhausted(format!(
                    "{REASSEMBLIES} observations are being received already; send one at a time"
                )),
            ));
        }
        Ok(Reassembly { service: self, ip })
    }

    /// The next chunk of an observation stream, within `lerobot.chunk_timeout_s` and the
    /// whole observation's deadline.
    async fn chunk(
        &self,
        stream: &mut Streaming<Observation>,
        whole: Instant,
    ) -> Result<Option<Observation>, Status> {
        let by = (Instant::now() + self.cfg.chunk_timeout).min(whole);
        match tokio::time::timeout_at(by.into(), stream.message()).await {
            Ok(Ok(r)) => Ok(r),
            // tonic's refusal of a chunk over its limit (OUT_OF_RANGE) is the client sending
            // more than a chunk: RESOURCE_EXHAUSTED, as grpc-go and grpc-core answer it.
            Ok(Err(status)) if status.code() == tonic::Code::OutOfRange => Err(self.refuse(
                "oversize",
                Status::resource_exhausted(status.message().to_string()),
            )),
            Ok(Err(status)) => Err(self.refuse("chunking", status)),
            Err(_) => Err(self.refuse(
                "slow",
                Status::deadline_exceeded(format!(
                    "the observation's chunks stopped arriving (lerobot.chunk_timeout_s = {} s, \
                     lerobot.observation_timeout_s = {} s)",
                    self.cfg.chunk_timeout.as_secs_f64(),
                    self.cfg.observation_timeout.as_secs_f64()
                )),
            )),
        }
    }
}

/// The connection a call came by (tonic hands the [`GrpcConn`]'s info to each call).
fn caller<T>(request: &Request<T>) -> Result<ConnInfo, Status> {
    request
        .extensions()
        .get::<ConnInfo>()
        .cloned()
        .ok_or_else(|| Status::internal("the call's connection is unknown"))
}

#[tonic::async_trait]
impl AsyncInference for Service {
    async fn ready(&self, request: Request<Empty>) -> Result<Response<Empty>, Status> {
        self.shared.stats.metrics.lerobot_rpc("Ready");
        let from = caller(&request)?;
        let _call = from.activity.call();
        let (reply, back) = oneshot::channel();
        self.tx
            .send(Command::Ready { from, reply })
            .await
            .map_err(|_| Self::gone())?;
        back.await
            .map_err(|_| Self::gone())?
            .map_err(|s| self.refuse("owner", s))?;
        Ok(Response::new(Empty {}))
    }

    async fn send_policy_instructions(
        &self,
        request: Request<transport::PolicySetup>,
    ) -> Result<Response<Empty>, Status> {
        self.shared
            .stats
            .metrics
            .lerobot_rpc("SendPolicyInstructions");
        let from = caller(&request)?;
        let _call = from.activity.call();
        let data = request.into_inner().data;
        let setup = Payloads::default()
            .setup(&data)
            .map_err(|e| self.refuse("pickle", Status::invalid_argument(e.to_string())))?;
        let set = self.shared.policies.load();
        let (policy, adapter) = for_setup(&self.cfg, &set, &setup)
            .map_err(|e| self.refuse("setup", Status::failed_precondition(e)))?;
        crate::log_limited!(
            log::Level::Info,
            "lerobot: {} asks for {} \"{}\" ({} actions per chunk, {} payloads): serving \
             policy \"{}\"",
            from.peer,
            clip(&setup.policy_type),
            clip(&setup.pretrained_name_or_path),
            setup.actions_per_chunk,
            setup.codec.name(),
            policy.name
        );
        let (reply, back) = oneshot::channel();
        self.tx
            .send(Command::Setup {
                from,
                policy,
                adapter: Box::new(adapter),
                setup: Box::new(setup),
                reply,
            })
            .await
            .map_err(|_| Self::gone())?;
        back.await
            .map_err(|_| Self::gone())?
            .map_err(|s| self.refuse("owner", s))?;
        Ok(Response::new(Empty {}))
    }

    async fn send_observations(
        &self,
        request: Request<Streaming<Observation>>,
    ) -> Result<Response<Empty>, Status> {
        self.shared.stats.metrics.lerobot_rpc("SendObservations");
        let from = caller(&request)?;
        let _call = from.activity.call();
        let received = Instant::now();
        let whole = received + self.cfg.observation_timeout;
        let mut stream = request.into_inner();
        // A stream holds nothing until its first chunk is here: streams that only open (HTTP/2
        // HEADERS) cannot keep robots from sending.
        let mut next = self.chunk(&mut stream, whole).await?;
        let _reassembly = match next {
            Some(_) => self.reassembly(from.peer.ip())?,
            None => {
                return Err(self.refuse(
                    "chunking",
                    Status::invalid_argument("the observation stream ended without TRANSFER_END"),
                ));
            }
        };
        let mut buf = self
            .buffers
            .lock()
            .ok()
            .and_then(|mut b| b.pop())
            .unwrap_or_default();
        buf.clear();
        let max = self.cfg.max_payload_bytes;
        let mut ended = false;
        // LeRobot's receiver: BEGIN starts over, MIDDLE appends, END appends and completes
        // (anything after it is not read); UNKNOWN is an error.
        while let Some(msg) = next {
            let state = TransferState::try_from(msg.transfer_state).unwrap_or_default();
            match state {
                TransferState::TransferUnknown => {
                    return Err(self.refuse(
                        "chunking",
                        Status::invalid_argument(
                            "an observation chunk has transfer_state TRANSFER_UNKNOWN",
                        ),
                    ));
                }
                TransferState::TransferBegin => buf.clear(),
                TransferState::TransferMiddle | TransferState::TransferEnd => {}
            }
            if buf.len() + msg.data.len() > max {
                return Err(self.refuse(
                    "oversize",
                    Status::resource_exhausted(format!(
                        "the observation exceeds lerobot.max_payload_bytes = {max}"
                    )),
                ));
            }
            if buf.try_reserve(msg.data.len()).is_err() {
                return Err(self.refuse(
                    "oversize",
                    Status::resource_exhausted("no memory to reassemble the observation"),
                ));
            }
            buf.extend_from_slice(&msg.data);
            if state == TransferState::TransferEnd {
                ended = true;
                break;
            }
            next = self.chunk(&mut stream, whole).await?;
        }
        if !ended {
            return Err(self.refuse(
                "chunking",
                Status::invalid_argument("the observation stream ended without TRANSFER_END"),
            ));
        }
        let (reply, back) = oneshot::channel();
        self.tx
            .send(Command::Observe {
                from,
                payload: buf,
                received,
                reply,
            })
            .await
            .map_err(|_| Self::gone())?;
        let (result, mut buf) = back.await.map_err(|_| Self::gone())?;
        // A buffer grown past the usual observation by a hostile one is not kept.
        if buf.capacity() > KEEP_BUFFER {
            buf = Vec::new();
        }
        if buf.capacity() > 0
            && let Ok(mut pool) = self.buffers.lock()
            && pool.len() < 2
        {
            pool.push(buf);
        }
        match result {
            Ok(()) => Ok(Response::new(Empty {})),
            Err(r) => Err(self.refuse(r.reason, r.status)),
        }
    }

    async fn get_actions(&self, request: Request<Empty>) -> Result<Response<Actions>, Status> {
        self.shared.stats.metrics.lerobot_rpc("GetActions");
        let from = caller(&request)?;
        let _call = from.activity.call();
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::Poll { from, reply })
            .await
            .map_err(|_| Self::gone())?;
        match tokio::time::timeout(self.cfg.long_poll, rx).await {
            Ok(Ok(Ok(data))) => Ok(Response::new(Actions { data })),
            Ok(Ok(Err(status))) => Err(self.refuse("owner", status)),
            _ => {
                self.shared.stats.metrics.lerobot_long_poll_timeouts.inc();
                Ok(Response::new(Actions { data: Vec::new() }))
            }
        }
    }
}

/// Checks a client's setup against the served policies: the one it names (by
/// `[[lerobot.serve]]` or by name), its features against the bindings, its chunk length.
fn for_setup(
    cfg: &LerobotConfig,
    set: &crate::policy::PolicySet,
    setup: &PolicySetup,
) -> Result<(Arc<Policy>, Adapter), String> {
    let asked = &setup.pretrained_name_or_path;
    let entry = cfg.serve.iter().find(|s| &s.pretrained == asked);
    let name = match entry {
        Some(s) => s.policy.as_str(),
        None => asked.as_str(),
    };
    let Some(policy) = set.get(name) else {
        let mut offered: Vec<&str> = cfg.serve.iter().map(|s| s.pretrained.as_str()).collect();
        offered.extend(set.policies.iter().map(|p| p.name.as_str()));
        let asked = clip(asked);
        return Err(format!(
            "pretrained_name_or_path \"{asked}\" is not served here (policyd never loads what \
             a client names); ask for one of: {}, or map it onto a served policy with a \
             [[lerobot.serve]] entry whose pretrained = \"{asked}\"",
            offered.join(", ")
        ));
    };
    if let Some(want) = entry.and_then(|e| e.policy_type.as_deref())
        && want != setup.policy_type
    {
        return Err(format!(
            "policy_type \"{}\" does not match the served policy \"{}\", which is a \"{want}\" \
             ([[lerobot.serve]] policy_type)",
            clip(&setup.policy_type),
            policy.name
        ));
    }
    let adapter = Adapter::new(
        cfg.resize,
        cfg.max_payload_bytes,
        &policy.plan,
        &policy.name,
        setup,
    )?;
    Ok((policy.clone(), adapter))
}

/// The session's state while a policy is set up.
struct Active {
    core: Core,
    adapter: Box<Adapter>,
    setup: Box<PolicySetup>,
}

impl Active {
    fn new(
        shared: &Shared,
        policy: Arc<Policy>,
        adapter: Box<Adapter>,
        setup: Box<PolicySetup>,
    ) -> Self {
        let core = Core::new(
            &shared.requests,
            policy,
            crate::net::shared::next_client_id(),
            Route::Lerobot,
            Precision::Float32,
        );
        Active {
            core,
            adapter,
            setup,
        }
    }
}

/// The service's one session, owned by the session task: the policy set up (if any), the
/// payload reader, and the desk where chunks wait for polls.
struct Session {
    shared: Arc<Shared>,
    payloads: Payloads,
    active: Option<Active>,
    desk: Desk,
    /// A reload came: the session moves to the new policy once nothing is in flight.
    replaced: bool,
}

/// The session task: answers the handlers' commands and releases chunks.
async fn session(shared: Arc<Shared>, mut rx: mpsc::Receiver<Command>) {
    let rule = shared.cfg.lerobot.as_ref().map_or(
        owner::Rule {
            takeover_after: Duration::from_secs(10),
            grace: Duration::from_secs(60),
        },
        |l| owner::Rule {
            takeover_after: l.takeover_after,
            grace: l.owner_grace,
        },
    );
    let mut s = Session {
        shared,
        payloads: Payloads::default(),
        active: None,
        desk: Desk {
            ready: None,
            waiter: None,
            owner: None,
            adopted: false,
            rule,
        },
        replaced: false,
    };
    loop {
        s.follow_reload();
        let Some(a) = s.active.as_mut() else {
            match rx.recv().await {
                Some(cmd) => s.command(cmd),
                None => return,
            }
            continue;
        };
        tokio::select! {
            cmd = rx.recv() => match cmd {
                Some(cmd) => s.command(cmd),
                None => return,
            },
            event = a.core.next() => s.event(event),
        }
    }
}

impl Session {
    /// After a reload, once nothing is in flight: the same policy's new engine with the same
    /// setup (a fresh session), or none if the policy is gone or no longer fits the setup.
    fn follow_reload(&mut self) {
        let Some(a) = self
            .active
            .as_ref()
            .filter(|a| self.replaced && a.core.idle())
        else {
            return;
        };
        self.replaced = false;
        let set = self.shared.policies.load();
        // A reload that kept this policy's engine (same fingerprint) changes nothing here.
        let current = set.get(&a.core.policy().name);
        if current.is_some_and(|p| Arc::ptr_eq(p, a.core.policy())) {
            return;
        }
        let next = current.cloned().and_then(|p| {
            let l = self.shared.cfg.lerobot.as_ref()?;
            Adapter::new(l.resize, l.max_payload_bytes, &p.plan, &p.name, &a.setup)
                .map_err(|e| log::warn!("lerobot: after the reload: {e}"))
                .ok()
                .map(|ad| (p, ad))
        });
        let Some(old) = self.active.take() else {
            return;
        };
        let setup = old.setup;
        old.core.close();
        match next {
            Some((p, adapter)) => {
                log::info!(
                    "lerobot: policy \"{}\" reloaded; the session starts afresh",
                    p.name
                );
                self.active = Some(Active::new(&self.shared, p, Box::new(adapter), setup));
            }
            None => log::warn!(
                "lerobot: the session's policy is gone after a reload; the client must set up \
                 again"
            ),
        }
    }

    /// What the request core waited for.
    fn event(&mut self, event: Event) {
        match event {
            Event::Release { lease, paced } => self.deliver(lease, paced),
            Event::Failed(f) => {
                if let Some(a) = &self.active {
                    a.core.count_error(&f);
                }
                crate::warn_limited!("lerobot: {}", crate::log_limit::Escaped(f.message()));
            }
            Event::Reloaded => self.replaced = true,
        }
    }

    /// Handles one command from the RPC handlers.
    fn command(&mut self, cmd: Command) {
        let desk = &mut self.desk;
        match cmd {
            Command::Ready { from, reply } => {
                let claimed = claim(desk, &from, true);
                if let Ok(c) = &claimed {
                    own(desk, &from, c);
                    desk.ready = None;
                    if let Some(a) = &mut self.active {
                        a.core.reset_all();
                    }
                }
                let _ = reply.send(claimed.map(|_| ()));
            }
            Command::Setup {
                from,
                policy,
                adapter,
                setup,
                reply,
            } => {
                let claimed = claim(desk, &from, true);
                let Ok(c) = claimed else {
                    let _ = reply.send(claimed.map(|_| ()));
                    return;
                };
                own(desk, &from, &c);
                desk.ready = None;
                let _ = reply.send(Ok(()));
                match &mut self.active {
                    Some(a) if Arc::ptr_eq(a.core.policy(), &policy) => {
                        a.core.reset_all();
                        a.adapter = adapter;
                        a.setup = setup;
                    }
                    _ => {
                        if let Some(old) = self.active.take() {
                            old.core.close();
                        }
                        self.active = Some(Active::new(&self.shared, policy, adapter, setup));
                    }
                }
            }
            Command::Poll { from, reply } => match claim(desk, &from, false) {
                Err(status) => {
                    let _ = reply.send(Err(status));
                }
                Ok(c) => {
                    own(desk, &from, &c);
                    match desk.ready.take() {
                        Some(data) => {
                            if let Err(Ok(data)) = reply.send(Ok(data)) {
                                desk.ready = Some(data);
                            }
                        }
                        // A newer poll replaces an older one (whose handler then answers "none").
                        None => desk.waiter = Some(reply),
                    }
                }
            },
            Command::Observe {
                from,
                payload,
                received,
                reply,
            } => {
                let result = match claim(desk, &from, false) {
                    Err(status) => Err(Refusal::new("owner", status)),
                    // With no policy set up there is no session to own (observe refuses it).
                    Ok(c) => {
                        if self.active.is_some() {
                            own(desk, &from, &c);
                        }
                        self.observe(&payload, received)
                    }
                };
                let _ = reply.send((result, payload));
            }
        }
    }

    /// Starts one observation through the core.
    fn observe(&mut self, payload: &[u8], received: Instant) -> Result<(), Refusal> {
        let Some(a) = &mut self.active else {
            return Err(Refusal::new(
                "setup",
                Status::failed_precondition(
                    "no policy is set up: the client must call SendPolicyInstructions first",
                ),
            ));
        };
        let policy = a.core.policy().clone();
        // One slot is the most a session holds waiting (latest wins); with none free the newest
        // observation is dropped, as the one it would replace is about to run.
        let Some(lease) = policy.worker.pool.try_acquire() else {
            return Ok(());
        };
        let (adapter, payloads, codec) = (&mut a.adapter, &mut self.payloads, a.setup.codec);
        let mut unreadable = false;
        let started = a.core.start(
            received,
            lease,
            ResetScope::Connection,
            |plan, inputs, seen, _| {
                let meta = adapter.decode(payloads, codec, payload, plan, inputs, seen);
                unreadable = matches!(meta, Err(WireError::Unreadable(_)));
                meta
            },
        );
        match started {
            Started::Failed(f) => {
                a.core.count_error(&f);
                Err(Refusal::new(
                    if unreadable { "pickle" } else { "observation" },
                    Status::invalid_argument(f.message().to_string()),
                ))
            }
            Started::Queued
            | Started::Reset
            | Started::Skipped { .. }
            | Started::OtherPolicy(_) => Ok(()),
        }
    }

    /// Encodes a released chunk as the client's `list[TimedAction]` and hands it to the
    /// waiting poll, or keeps it for the next one.
    fn deliver(&mut self, lease: Lease, paced: bool) {
        let Some(a) = &mut self.active else {
            return;
        };
        let (output, apc, codec) = (
            a.adapter.action_output(),
            a.adapter.actions_per_chunk(),
            a.setup.codec,
        );
        let mut ok = true;
        let lease = a.core.release(lease, paced, |r| {
            let first = r.reply.first_row();
            let dt = 1.0 / r.fps;
            let (timestep, timestamp) = (r.ticket.timestep, r.ticket.timestamp);
            match r.reply.rows_f32(output, apc.max(first + 1)) {
                Some((rows, row)) if row > 0 => lerobot::encode_actions(
                    codec,
                    rows.chunks_exact(row),
                    (timestep, timestamp),
                    first,
                    dt,
                    r.buf,
                ),
                _ => ok = false,
            }
        });
        if !ok {
            log::warn!("lerobot: the action output cannot be sent as float32 rows");
            return;
        }
        let data = lease.peek().reply().to_vec();
        drop(lease);
        let desk = &mut self.desk;
        match desk.waiter.take() {
            Some(tx) => {
                if let Err(Ok(data)) = tx.send(Ok(data)) {
                    desk.ready = Some(data);
                }
            }
            None => desk.ready = Some(data),
        }
    }
}

/// What the session task keeps beside the core: the chunk no poll has taken yet (the newest
/// wins), the poll waiting for one, and the connection that owns the session.
struct Desk {
    ready: Option<Vec<u8>>,
    waiter: Option<oneshot::Sender<Result<Vec<u8>, Status>>>,
    owner: Option<ConnInfo>,
    /// The owner adopted the session by a poll or observation ([`Claim::Reconnect`]).
    adopted: bool,
    rule: owner::Rule,
}

/// Whether a call from `from` may act on the session, and how: [`owner::Rule`] applied to
/// what the desk knows of the owner. While the owner's connection is open and has made a call
/// within `takeover_after`, no other connection may: the safety rule that keeps one peer from
/// steering another's robot; and the owner's address may claim its session back first.
fn claim(desk: &Desk, from: &ConnInfo, sets_up: bool) -> Result<Claim, Status> {
    let seen = desk.owner.as_ref().map(|o| owner::Seen {
        same_connection: Arc::ptr_eq(&o.activity, &from.activity),
        same_address: canonical(o.peer.ip()) == canonical(from.peer.ip()),
        owner_closed: o.activity.closed(),
        owner_adopted: desk.adopted,
        owner_quiet: o.activity.idle_for(),
    });
    desk.rule
        .decide(seen, sets_up)
        .map_err(|d| Status::permission_denied(d.message(&desk.rule)))
}

/// Records `from` as the session's owner after a successful [`claim`].
fn own(desk: &mut Desk, from: &ConnInfo, claim: &Claim) {
    match claim {
        Claim::Owner => {}
        Claim::Reconnect => {
            crate::log_limited!(
                log::Level::Info,
                "lerobot: {} reconnected; its session carries on",
                from.peer
            );
            desk.owner = Some(from.clone());
            desk.adopted = true;
        }
        Claim::Takeover => {
            if let Some(old) = &desk.owner {
                crate::warn_limited!(
                    "lerobot: {} takes the session over from {} ({})",
                    from.peer,
                    old.peer,
                    if old.activity.closed() {
                        "disconnected"
                    } else {
                        "silent"
                    }
                );
            }
            desk.owner = Some(from.clone());
            desk.adopted = false;
            // The previous owner's waiting poll ends with "none"; its chunk is not handed on.
            desk.waiter = None;
            desk.ready = None;
        }
    }
}
