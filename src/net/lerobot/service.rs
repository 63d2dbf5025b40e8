//! LeRobot's `AsyncInference` RPCs: each call checked, counted and, where it asks something of
//! the session, sent to the session task ([`super::session`]) as a [`Command`]. Observations
//! are reassembled here from their chunks, within their deadlines and buffers.

use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::{mpsc, oneshot};
use tonic::{Request, Response, Status, Streaming};

use super::session::{Command, for_setup};
use super::transport::async_inference_server::AsyncInference;
use super::transport::{self, Actions, Empty, Observation, TransferState};
use super::{Reason, record_refusal};
use crate::config::LerobotConfig;
use crate::net::grpc_conn::ConnInfo;
use crate::net::shared::Shared;
use crate::protocol::clip;
use crate::protocol::lerobot::ClientFormat;

/// Observations reassembled at once (one client sends one at a time; more is abuse).
const REASSEMBLIES: usize = 2;
/// A reassembly buffer larger than this (three 640x480 cameras are 2.8 MB) is freed after use
/// rather than kept, so one hostile observation does not hold its size for the process's life.
const KEEP_BUFFER: usize = 8 << 20;

pub(super) struct Service {
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
    pub(super) fn new(shared: Arc<Shared>, cfg: LerobotConfig, tx: mpsc::Sender<Command>) -> Self {
        Service {
            shared,
            cfg,
            tx,
            buffers: Mutex::new(Vec::new()),
            reassembling: Mutex::new(heapless::Vec::new()),
        }
    }

    fn refuse(&self, reason: Reason, status: Status) -> Status {
        let message = record_refusal(&self.shared, reason, status.message().to_string());
        Status::new(status.code(), message)
    }

    /// Sends the session task a command that takes the session (`Ready`, a setup) and waits
    /// for its answer: refused (`owner`) if another connection owns the session.
    async fn ask(
        &self,
        command: impl FnOnce(oneshot::Sender<Result<(), Status>>) -> Command,
    ) -> Result<(), Status> {
        let (reply, back) = oneshot::channel();
        self.tx
            .send(command(reply))
            .await
            .map_err(|_| Self::gone())?;
        back.await
            .map_err(|_| Self::gone())?
            .map_err(|s| self.refuse(Reason::Owner, s))
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
                Reason::Busy,
                Status::resource_exhausted(
                    "an observation from this address is being received already; send one at \
                     a time",
                ),
            ));
        }
        if held.push(ip).is_err() {
            return Err(self.refuse(
                Reason::Busy,
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
                Reason::Oversize,
                Status::resource_exhausted(status.message().to_string()),
            )),
            Ok(Err(status)) => Err(self.refuse(Reason::Chunking, status)),
            Err(_) => Err(self.refuse(
                Reason::Slow,
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
        self.shared.stats().metrics.lerobot_rpc("Ready");
        let from = caller(&request)?;
        let _call = from.activity.call();
        self.ask(|reply| Command::Ready { from, reply }).await?;
        Ok(Response::new(Empty {}))
    }

    async fn send_policy_instructions(
        &self,
        request: Request<transport::PolicySetup>,
    ) -> Result<Response<Empty>, Status> {
        self.shared
            .stats()
            .metrics
            .lerobot_rpc("SendPolicyInstructions");
        let from = caller(&request)?;
        let _call = from.activity.call();
        let data = request.into_inner().data;
        let (setup, format) = ClientFormat::read_setup(&data).map_err(|e| {
            self.refuse(Reason::Unreadable, Status::invalid_argument(e.to_string()))
        })?;
        let set = self.shared.policies().load();
        let (policy, adapter) = for_setup(&self.cfg, &set, &setup)
            .map_err(|e| self.refuse(Reason::Setup, Status::failed_precondition(e)))?;
        crate::log_limited!(
            log::Level::Info,
            "lerobot: {} asks for {} \"{}\" ({} actions per chunk, {} payloads): serving \
             policy \"{}\"",
            from.peer,
            clip(&setup.policy_type),
            clip(&setup.pretrained_name_or_path),
            setup.actions_per_chunk,
            format.name(),
            policy.name
        );
        self.ask(|reply| Command::Setup {
            from,
            policy,
            adapter: Box::new(adapter),
            setup: Box::new(setup),
            format: Box::new(format),
            reply,
        })
        .await?;
        Ok(Response::new(Empty {}))
    }

    async fn send_observations(
        &self,
        request: Request<Streaming<Observation>>,
    ) -> Result<Response<Empty>, Status> {
        self.shared.stats().metrics.lerobot_rpc("SendObservations");
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
                    Reason::Chunking,
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
                        Reason::Chunking,
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
                    Reason::Oversize,
                    Status::resource_exhausted(format!(
                        "the observation exceeds lerobot.max_payload_bytes = {max}"
                    )),
                ));
            }
            if buf.try_reserve(msg.data.len()).is_err() {
                return Err(self.refuse(
                    Reason::Oversize,
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
                Reason::Chunking,
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
        self.shared.stats().metrics.lerobot_rpc("GetActions");
        let from = caller(&request)?;
        let _call = from.activity.call();
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::Poll { from, reply })
            .await
            .map_err(|_| Self::gone())?;
        match tokio::time::timeout(self.cfg.long_poll, rx).await {
            Ok(Ok(Ok(data))) => Ok(Response::new(Actions { data })),
            Ok(Ok(Err(status))) => Err(self.refuse(Reason::Owner, status)),
            _ => {
                self.shared.stats().metrics.lerobot_long_poll_timeouts.inc();
                Ok(Response::new(Actions { data: Vec::new() }))
            }
        }
    }
}
