//! How does LeRobot's own `robot_client` reach a policy? Its `AsyncInference` gRPC service
//! (`[lerobot]`), on its own port, through the same request core as the WebSocket.
//!
//! The client's payloads are pickles. policyd reads them with its strict reader
//! ([`crate::protocol::pickle`]), which executes nothing, and writes its replies byte by byte
//! ([`crate::protocol::lerobot`]). The client never names a model policyd would load: its
//! `pretrained_name_or_path` must be a served policy's name or a `[[lerobot.serve]]` entry.
//!
//! Like LeRobot's server there is one session: `Ready` resets it, `SendPolicyInstructions`
//! binds it to a policy, and a second client's calls act on the same session. A session task
//! owns the [`Core`]; the RPC handlers talk to it over a bounded channel:
//! - `SendObservations` reassembles the chunks, the session task decodes the pickle straight
//!   into a slot's engine buffers (state vector in the client's motor order, camera frames
//!   resized to the policy's inputs if `lerobot.resize` allows) and answers at once;
//! - `GetActions` waits up to `lerobot.long_poll_ms` for the next chunk released by the pacing
//!   scheduler; "none" is the zero-length reply, never a pickled empty list (the client
//!   divides by the list's length).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tonic::{Request, Response, Status, Streaming};

use crate::bind::lerobot::Adapter;
use crate::config::LerobotConfig;
use crate::net::core::{Core, Finished, Started, sleep_until_opt};
use crate::net::http::Shared;
use crate::policy::Policy;
use crate::protocol::Route;
use crate::protocol::dialect::{Precision, ResetScope};
use crate::protocol::lerobot::{self, Codec, PolicySetup};
use crate::protocol::pickle::{PickleLimits, PickleReader};
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
/// Streams one connection may have open (LeRobot's client has two at most: an observation and
/// a long poll).
const STREAMS_PER_CONNECTION: u32 = 8;

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
        reassembling: tokio::sync::Semaphore::new(REASSEMBLIES),
    };
    let server = AsyncInferenceServer::new(service)
        .max_decoding_message_size(CHUNK_BYTES + 1024)
        .max_encoding_message_size(CLIENT_MAX_MESSAGE);
    // Peers are checked as they connect; a refused one is logged, counted and closed.
    let (conns, incoming) = mpsc::channel::<std::io::Result<tokio::net::TcpStream>>(16);
    let mut stop = shared.shutdown.clone();
    let accept_shared = shared.clone();
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
                        if !allowed(&cfg, peer) {
                            log::warn!("lerobot: {peer} is not in lerobot.allow; connection refused");
                            accept_shared.stats.metrics.lerobot_refused("peer");
                            continue;
                        }
                        let _ = stream.set_nodelay(true);
                        if conns.send(Ok(stream)).await.is_err() {
                            break;
                        }
                    }
                    Err(e) => {
                        log::warn!("lerobot: accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
            }
        }
    });
    let mut stop = shared.shutdown.clone();
    let result = tonic::transport::Server::builder()
        // ~1.8 MB observations at 30 Hz: HTTP/2's 64 KiB default windows would throttle them.
        .initial_stream_window_size(Some(8 << 20))
        .initial_connection_window_size(Some(16 << 20))
        .tcp_nodelay(true)
        .max_concurrent_streams(Some(STREAMS_PER_CONNECTION))
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

fn allowed(cfg: &LerobotConfig, peer: SocketAddr) -> bool {
    let ip = match peer.ip() {
        std::net::IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map_or(std::net::IpAddr::V6(v6), std::net::IpAddr::V4),
        v4 => v4,
    };
    cfg.allow.is_empty() || cfg.allow.iter().any(|n| n.contains(&ip))
}

/// What the RPC handlers ask of the session task.
enum Command {
    /// `Ready`: forget the session's state.
    Ready,
    /// `SendPolicyInstructions`, checked: serve `policy` with this adapter.
    Setup {
        policy: Arc<Policy>,
        adapter: Box<Adapter>,
        setup: Box<PolicySetup>,
    },
    /// `SendObservations`, reassembled; the reply carries the buffer back for reuse.
    Observe {
        payload: Vec<u8>,
        received: Instant,
        reply: oneshot::Sender<(Result<(), Status>, Vec<u8>)>,
    },
    /// `GetActions`: the next chunk's pickle.
    Poll(oneshot::Sender<Vec<u8>>),
}

struct Service {
    shared: Arc<Shared>,
    cfg: LerobotConfig,
    tx: mpsc::Sender<Command>,
    /// Reassembly buffers handed back by the session task: one or two, reused.
    buffers: Mutex<Vec<Vec<u8>>>,
    /// Observations being reassembled at once: at most [`REASSEMBLIES`] buffers of
    /// `max_payload_bytes`, however many streams clients open.
    reassembling: tokio::sync::Semaphore,
}

impl Service {
    fn refuse(&self, reason: &'static str, status: Status) -> Status {
        self.shared.stats.metrics.lerobot_refused(reason);
        log::info!("lerobot: refused ({reason}): {}", status.message());
        status
    }

    fn gone() -> Status {
        Status::unavailable("policyd is shutting down")
    }
}

#[tonic::async_trait]
impl AsyncInference for Service {
    async fn ready(&self, _: Request<Empty>) -> Result<Response<Empty>, Status> {
        self.shared.stats.metrics.lerobot_rpc("Ready");
        self.tx
            .send(Command::Ready)
            .await
            .map_err(|_| Self::gone())?;
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
        let data = request.into_inner().data;
        let (setup, codec) = read_setup(&data)
            .map_err(|e| self.refuse("pickle", Status::invalid_argument(e.to_string())))?;
        let set = self.shared.policies.load();
        let (policy, mut adapter) = for_setup(&self.cfg, &set, &setup)
            .map_err(|e| self.refuse("setup", Status::failed_precondition(e)))?;
        adapter.set_codec(codec);
        log::info!(
            "lerobot: client asks for {} \"{}\" ({} actions per chunk, {} payloads): serving \
             policy \"{}\"",
            setup.policy_type,
            setup.pretrained_name_or_path,
            setup.actions_per_chunk,
            codec.name(),
            policy.name
        );
        self.tx
            .send(Command::Setup {
                policy,
                adapter: Box::new(adapter),
                setup: Box::new(setup),
            })
            .await
            .map_err(|_| Self::gone())?;
        Ok(Response::new(Empty {}))
    }

    async fn send_observations(
        &self,
        request: Request<Streaming<Observation>>,
    ) -> Result<Response<Empty>, Status> {
        self.shared.stats.metrics.lerobot_rpc("SendObservations");
        let received = Instant::now();
        let Ok(_reassembling) = self.reassembling.try_acquire() else {
            return Err(self.refuse(
                "busy",
                Status::resource_exhausted(format!(
                    "{REASSEMBLIES} observations are being received already; send one at a time"
                )),
            ));
        };
        let mut stream = request.into_inner();
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
        while let Some(msg) = stream.message().await? {
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
            buf.extend_from_slice(&msg.data);
            if state == TransferState::TransferEnd {
                ended = true;
                break;
            }
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
                payload: buf,
                received,
                reply,
            })
            .await
            .map_err(|_| Self::gone())?;
        let (result, buf) = back.await.map_err(|_| Self::gone())?;
        if buf.capacity() > 0
            && let Ok(mut pool) = self.buffers.lock()
            && pool.len() < 2
        {
            pool.push(buf);
        }
        match result {
            Ok(()) => Ok(Response::new(Empty {})),
            Err(status) => Err(self.refuse(
                if status.code() == tonic::Code::FailedPrecondition {
                    "setup"
                } else if status.message().starts_with("pickle: ") {
                    "pickle"
                } else {
                    "observation"
                },
                status,
            )),
        }
    }

    async fn get_actions(&self, _: Request<Empty>) -> Result<Response<Actions>, Status> {
        self.shared.stats.metrics.lerobot_rpc("GetActions");
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Command::Poll(tx))
            .await
            .map_err(|_| Self::gone())?;
        match tokio::time::timeout(self.cfg.long_poll, rx).await {
            Ok(Ok(data)) => Ok(Response::new(Actions { data })),
            _ => {
                self.shared.stats.metrics.lerobot_long_poll_timeouts.inc();
                Ok(Response::new(Actions { data: Vec::new() }))
            }
        }
    }
}

/// Reads the client's `RemotePolicyConfig` in whichever format it sent, and says which.
fn read_setup(data: &[u8]) -> Result<(PolicySetup, Codec), lerobot::LerobotError> {
    let codec = lerobot::codec(data)?;
    let setup = match codec {
        Codec::Pickle => {
            let mut reader = PickleReader::new(PickleLimits::default());
            let tree = reader.read(data)?;
            lerobot::policy_setup(&tree)?
        }
        Codec::Json => crate::protocol::lerobot_json::policy_setup(data)?,
    };
    Ok((setup, codec))
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
            setup.policy_type, policy.name
        ));
    }
    let adapter = Adapter::new(cfg.resize, &policy.plan, &policy.name, setup)?;
    Ok((policy.clone(), adapter))
}

/// The session's state while a policy is set up.
struct Active<'s> {
    core: Core<'s>,
    adapter: Box<Adapter>,
    setup: Box<PolicySetup>,
    /// The policy's engine-stall flag, watched while requests are in flight.
    stalled: tokio::sync::watch::Receiver<bool>,
}

impl<'s> Active<'s> {
    fn new(
        shared: &'s Shared,
        policy: Arc<Policy>,
        adapter: Box<Adapter>,
        setup: Box<PolicySetup>,
    ) -> Self {
        Active {
            stalled: policy.worker.state.stalled.subscribe(),
            core: new_core(shared, policy),
            adapter,
            setup,
        }
    }
}

/// The session task: owns the request core, answers the handlers' commands, releases chunks.
async fn session(shared: Arc<Shared>, mut rx: mpsc::Receiver<Command>) {
    let shared = &*shared;
    let mut reader = PickleReader::new(PickleLimits::default());
    let mut active: Option<Active<'_>> = None;
    // A released chunk no poll has taken yet (the newest wins), and the poll waiting for one.
    let mut ready: Option<Vec<u8>> = None;
    let mut waiter: Option<oneshot::Sender<Vec<u8>>> = None;
    let mut generation = shared.generation.subscribe();
    let mut replaced = false;
    loop {
        if replaced && let Some(a) = active.as_ref().filter(|a| a.core.idle()) {
            replaced = false;
            let set = shared.policies.load();
            // A reload that kept this policy's engine (same fingerprint) changes nothing here.
            let kept = set
                .get(&a.core.policy().name)
                .is_some_and(|p| Arc::ptr_eq(p, a.core.policy()));
            if kept {
                continue;
            }
            let next = set.get(&a.core.policy().name).cloned().and_then(|p| {
                Adapter::new(
                    shared.cfg.lerobot.as_ref()?.resize,
                    &p.plan,
                    &p.name,
                    &a.setup,
                )
                .map_err(|e| log::warn!("lerobot: after the reload: {e}"))
                .ok()
                .map(|ad| (p, ad))
            });
            if let Some(old) = active.take() {
                let setup = old.setup;
                old.core.close();
                if let Some((p, adapter)) = next {
                    log::info!(
                        "lerobot: policy \"{}\" reloaded; the session starts afresh",
                        p.name
                    );
                    active = Some(Active::new(shared, p, Box::new(adapter), setup));
                } else {
                    log::warn!(
                        "lerobot: the session's policy is gone after a reload; the client must set up again"
                    );
                }
            }
        }
        let Some(a) = active.as_mut() else {
            tokio::select! {
                cmd = rx.recv() => match cmd {
                    None => return,
                    Some(cmd) => {
                        if let Some(next) = command(shared, &mut reader, None, cmd, &mut ready, &mut waiter) {
                            active = Some(next);
                        }
                    }
                },
                changed = generation.changed() => if changed.is_err() { return },
            }
            continue;
        };
        let backstop = a.core.next_release().map(|t| t + Duration::from_millis(2));
        let wake = a.core.wake().clone();
        tokio::select! {
            cmd = rx.recv() => match cmd {
                None => return,
                Some(cmd) => {
                    if let Some(next) = command(shared, &mut reader, Some(a), cmd, &mut ready, &mut waiter) {
                        if let Some(old) = active.take() {
                            old.core.close();
                        }
                        active = Some(next);
                    }
                }
            },
            lease = a.core.port().recv(), if a.core.awaiting() => {
                if let Some(lease) = a.core.returned(lease) {
                    match a.core.finished(lease) {
                        Finished::Failed(f) => {
                            a.core.count_error(&f);
                            log::warn!("lerobot: {}", f.message());
                        }
                        Finished::Held => {}
                        Finished::Now(lease) => deliver(a, lease, false, &mut ready, &mut waiter),
                    }
                }
            }
            _ = wake.notified(), if a.core.holding() => {
                while let Some(lease) = a.core.due() {
                    deliver(a, lease, true, &mut ready, &mut waiter);
                }
            }
            _ = sleep_until_opt(backstop), if backstop.is_some() => {
                while let Some(lease) = a.core.due() {
                    deliver(a, lease, true, &mut ready, &mut waiter);
                }
            }
            changed = a.stalled.changed(), if a.core.outstanding() > 0 => {
                if changed.is_ok() && *a.stalled.borrow_and_update() {
                    let f = a.core.stalled();
                    a.core.count_error(&f);
                    log::warn!("lerobot: {}", f.message());
                }
            }
            changed = generation.changed() => {
                if changed.is_err() {
                    return;
                }
                replaced = true;
            }
        }
    }
}

fn new_core(shared: &Shared, policy: Arc<Policy>) -> Core<'_> {
    Core::new(
        shared,
        policy,
        crate::net::connection::next_id(),
        Route::Lerobot,
        Precision::Float32,
    )
}

/// Handles one command; returns a new session when a setup replaces the current one.
fn command<'s>(
    shared: &'s Shared,
    reader: &mut PickleReader,
    active: Option<&mut Active<'s>>,
    cmd: Command,
    ready: &mut Option<Vec<u8>>,
    waiter: &mut Option<oneshot::Sender<Vec<u8>>>,
) -> Option<Active<'s>> {
    match cmd {
        Command::Ready => {
            *ready = None;
            if let Some(a) = active {
                a.core.reset_all();
            }
            None
        }
        Command::Setup {
            policy,
            adapter,
            setup,
        } => {
            *ready = None;
            match active {
                Some(a) if Arc::ptr_eq(a.core.policy(), &policy) => {
                    a.core.reset_all();
                    a.adapter = adapter;
                    a.setup = setup;
                    None
                }
                _ => Some(Active::new(shared, policy, adapter, setup)),
            }
        }
        Command::Poll(tx) => {
            match ready.take() {
                Some(data) => {
                    if let Err(data) = tx.send(data) {
                        *ready = Some(data);
                    }
                }
                // A newer poll replaces an older one (whose handler then answers "none").
                None => *waiter = Some(tx),
            }
            None
        }
        Command::Observe {
            payload,
            received,
            reply,
        } => {
            let result = match active {
                None => Err(Status::failed_precondition(
                    "no policy is set up: the client must call SendPolicyInstructions first",
                )),
                Some(a) => observe(a, reader, &payload, received),
            };
            let _ = reply.send((result, payload));
            None
        }
    }
}

/// Starts one observation through the core.
fn observe(
    a: &mut Active<'_>,
    reader: &mut PickleReader,
    payload: &[u8],
    received: Instant,
) -> Result<(), Status> {
    let policy = a.core.policy().clone();
    // One slot is the most a session holds waiting (latest wins); with none free the newest
    // observation is dropped, as the one it would replace is about to run.
    let Some(lease) = policy.worker.pool.try_acquire() else {
        return Ok(());
    };
    let adapter = &mut a.adapter;
    let started = a.core.start(
        received,
        lease,
        ResetScope::Connection,
        |plan, inputs, seen, _planner| adapter.decode(reader, payload, plan, inputs, seen),
    );
    match started {
        Started::Queued | Started::Reset | Started::Skipped { .. } => Ok(()),
        Started::Failed(f) => {
            a.core.count_error(&f);
            Err(Status::invalid_argument(f.message().to_string()))
        }
        Started::OtherPolicy(_) => Ok(()),
    }
}

/// Encodes a released chunk as the client's `list[TimedAction]` and hands it to the waiting
/// poll, or keeps it for the next one.
fn deliver(
    a: &mut Active<'_>,
    lease: Lease,
    paced: bool,
    ready: &mut Option<Vec<u8>>,
    waiter: &mut Option<oneshot::Sender<Vec<u8>>>,
) {
    let (output, apc, codec) = (
        a.adapter.action_output(),
        a.adapter.actions_per_chunk(),
        a.adapter.codec(),
    );
    let mut ok = true;
    let lease = a.core.release(lease, paced, |r| {
        let first = r.reply.first_row();
        let dt = 1.0 / r.fps;
        let (timestep, timestamp) = (r.ticket.timestep, r.ticket.timestamp);
        match r.reply.rows_f32(output, apc.max(first + 1)) {
            Some((rows, row)) if row > 0 => match codec {
                Codec::Pickle => lerobot::encode_actions(
                    rows.chunks_exact(row),
                    (timestep, timestamp),
                    first,
                    dt,
                    r.buf,
                ),
                Codec::Json => crate::protocol::lerobot_json::encode_actions(
                    rows.chunks_exact(row),
                    (timestep, timestamp),
                    first,
                    dt,
                    r.buf,
                ),
            },
            _ => ok = false,
        }
    });
    if !ok {
        log::warn!("lerobot: the action output cannot be sent as float32 rows");
        return;
    }
    let data = lease.peek().reply().to_vec();
    drop(lease);
    match waiter.take() {
        Some(tx) => {
            if let Err(data) = tx.send(data) {
                *ready = Some(data);
            }
        }
        None => *ready = Some(data),
    }
}
