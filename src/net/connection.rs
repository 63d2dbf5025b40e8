//! What happens on one WebSocket connection? Metadata frame, then requests, replies and pushes.
//!
//! The socket task never runs the model: it decodes a frame into a slot, queues the slot with the
//! [scheduler](crate::runtime::scheduler) and keeps reading the socket (so pings are answered while
//! the model runs). `infer` requests are answered strictly in order: a frame that arrives while an
//! `infer` is in flight waits in a one-frame buffer, and past that the task stops reading, which is
//! back-pressure on the client, not memory growth. `observe` frames go straight to their session's
//! latest-wins slot; results are pushed when ready.
//!
//! A finished slot is released at once, or, with `pacing.latency_budget_ms`, held until
//! `receive time + budget` and released when the [pacing clock](crate::runtime::pacing) wakes the
//! task. The reply is encoded at release, so its timing fields are the real ones.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::Notify;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::{Bytes, Message};

use crate::bind::ReplyParts;
use crate::net::frame_guard::oversize_marker;
use crate::net::http::Shared;
use crate::planner::Link;
use crate::policy::Policy;
use crate::protocol::dialect::{Frame, OPENPI_ERROR_REASON, ResetScope};
use crate::protocol::{self, Dialect, Endpoint, Failure, Timing};
use crate::runtime::pacing::{Release, ReleaseQueue};
use crate::runtime::scheduler::{Kind, SessionKey, SkipReason};
use crate::runtime::session::Filters;
use crate::runtime::session::Sessions;
use crate::runtime::worker::{Lease, ReplyPort, Slot, Ticket};

/// Connection ids, for the scheduler's session keys.
static NEXT_CONN: AtomicU64 = AtomicU64::new(1);

/// A reusable outgoing payload. tungstenite takes messages by value; handing it a clone of a
/// shared buffer and taking the buffer back once the send has completed means steady-state
/// sends allocate nothing.
struct SendBuf {
    spare: Option<BytesMut>,
    sent: Option<Bytes>,
}

impl SendBuf {
    fn new(capacity: usize) -> Self {
        SendBuf {
            spare: Some(BytesMut::with_capacity(capacity)),
            sent: None,
        }
    }

    fn message(&mut self, data: &[u8]) -> Message {
        let mut buf = match self.sent.take().map(Bytes::try_into_mut) {
            Some(Ok(b)) => b,
            _ => self.spare.take().unwrap_or_default(),
        };
        buf.clear();
        buf.extend_from_slice(data);
        let bytes = buf.freeze();
        self.sent = Some(bytes.clone());
        Message::Binary(bytes)
    }
}

/// Per-connection state the loop's helpers share.
struct Conn<'a, S> {
    ws: WebSocketStream<S>,
    shared: &'a Shared,
    /// The policy this connection is served by (until it switches, see [`Change`]).
    policy: Arc<Policy>,
    /// A policy switch waiting for the requests in flight to finish.
    change: Option<Change>,
    /// The planner's link, if it feeds this policy (see [`Shared::planner`]).
    planner: Option<Arc<Link>>,
    dialect: Dialect,
    id: u64,
    sessions: Box<Sessions>,
    port: ReplyPort,
    /// Immediate replies (errors, reset, skipped notices).
    out: Vec<u8>,
    send: SendBuf,
    /// Slots submitted and not yet back.
    outstanding: usize,
    /// An `infer` is queued, running or waiting for release: the next frame waits.
    infer_busy: bool,
    /// Finished slots waiting for their release time, earliest first.
    releasing: ReleaseQueue<Lease>,
    wake: Arc<Notify>,
    prev_total_ms: Option<f64>,
    filters: Filters,
    /// This connection's share of the `policyd_sessions` gauge.
    counted_sessions: i64,
    /// Bumped when the engine stalls and this connection's waiting requests are answered with
    /// a timeout error; slots of an older epoch are dropped when they come back.
    epoch: u64,
    /// Slots submitted before the last stall, not yet back.
    abandoned: usize,
}

/// Why a connection leaves its current policy.
enum Change {
    /// A reload replaced the policy (same name, new engine or config).
    Replaced(Arc<Policy>),
    /// A reload removed the policy: the connection closes with 1001.
    Removed,
    /// The client named another policy (`policy` field); this frame goes to it.
    Named(Arc<Policy>, Bytes, Instant),
}

/// Why a connection ended (logged when it closes).
#[derive(Debug, PartialEq)]
pub enum Closed {
    /// The client left before the metadata frame was sent.
    BeforeMetadata,
    /// The client closed the connection (a close frame, or the socket's end).
    ByClient,
    /// A send failed: the client is gone.
    Gone,
    /// The WebSocket stream failed (tungstenite's error).
    Protocol(String),
    /// The server is shutting down (1001).
    Shutdown,
    /// A reload removed the connection's policy (1001).
    PolicyRemoved,
    /// No pong within `server.ping_timeout_s`.
    PingTimeout,
    /// Nothing for `server.idle_timeout_s`.
    Idle,
    /// The dialect closes after an error (openpi: a text frame, then 1011); the error.
    AfterError(String),
}

impl std::fmt::Display for Closed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Closed::BeforeMetadata => f.write_str("client left before the metadata frame"),
            Closed::ByClient => f.write_str("client closed the connection"),
            Closed::Gone => f.write_str("client went away"),
            Closed::Protocol(e) => write!(f, "protocol error: {e}"),
            Closed::Shutdown => f.write_str("server shutdown (1001)"),
            Closed::PolicyRemoved => f.write_str("policy removed by a reload (1001)"),
            Closed::PingTimeout => f.write_str("keepalive ping timeout"),
            Closed::Idle => f.write_str("idle timeout"),
            Closed::AfterError(e) => f.write_str(e),
        }
    }
}

/// What a helper of the loop returns: `Err` when the connection ended.
type Step = Result<(), Closed>;

/// How a connection's time with one policy ended.
enum End {
    Closed(Closed),
    /// Go on with another policy (fresh sessions), starting with this frame.
    Switch {
        to: Arc<Policy>,
        frame: Option<(Bytes, Instant)>,
    },
}

/// Serves a connection until it closes; returns why it ended. It starts with `policy`; a
/// `policy` field naming another one, or a reload that replaces it, moves the connection to
/// the other policy between requests, with fresh sessions.
pub async fn serve<S>(
    mut ws: WebSocketStream<S>,
    shared: &Shared,
    dialect: Dialect,
    mut policy: Arc<Policy>,
) -> Closed
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let id = NEXT_CONN.fetch_add(1, Ordering::Relaxed);
    let mut first = None;
    let mut send_metadata = true;
    loop {
        let pacing = &policy.spec.pacing;
        let capacity = policy.plan.reply_capacity.max(1024);
        let mut c = Conn {
            ws,
            shared,
            dialect,
            id,
            sessions: Box::new(Sessions::new(
                shared.cfg.server.max_sessions,
                pacing.latency_window,
            )),
            port: ReplyPort::new(&policy.worker.pool),
            out: Vec::with_capacity(capacity),
            send: SendBuf::new(capacity),
            outstanding: 0,
            infer_busy: false,
            releasing: ReleaseQueue::default(),
            wake: Arc::new(Notify::new()),
            prev_total_ms: None,
            filters: Filters {
                skip_predicted_timesteps: pacing.skip_predicted_timesteps,
                similarity_atol: pacing.similarity_atol,
            },
            counted_sessions: 0,
            epoch: 0,
            abandoned: 0,
            planner: planner_for(shared, &policy),
            policy: policy.clone(),
            change: None,
        };
        let end = c.run(send_metadata, first.take()).await;
        shared.stats.metrics.sessions.dec_by(c.counted_sessions);
        // Waiting entries of this connection go back to the pool now; running ones come back
        // to the port, whose drop returns them.
        policy
            .worker
            .scheduler
            .remove_conn(c.id, |job| job.recycle());
        match end {
            End::Closed(why) => return why,
            End::Switch { to, frame } => {
                log::info!(
                    "connection {id}: policy \"{}\" -> \"{}\" (sessions start afresh)",
                    policy.name,
                    to.name
                );
                drop(c.port);
                ws = c.ws;
                policy = to;
                first = frame;
                send_metadata = false;
            }
        }
    }
}

impl<S> Conn<'_, S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    async fn run(&mut self, send_metadata: bool, first: Option<(Bytes, Instant)>) -> End {
        let shared = self.shared;
        let policy = self.policy.clone();
        let cfg = &shared.cfg.server;
        if send_metadata
            && self
                .ws
                .send(Message::Binary(policy.metadata.clone()))
                .await
                .is_err()
        {
            return End::Closed(Closed::BeforeMetadata);
        }
        let mut pending: Option<(Bytes, Instant)> = first;
        let mut generation = shared.generation.subscribe();
        // A reload may have come between the handshake and now.
        self.change = self.reloaded();
        let mut shutdown = shared.shutdown.clone();
        let mut stopping = *shutdown.borrow();

        let ping_every =
            (cfg.ping_interval_s > 0.0).then(|| Duration::from_secs_f64(cfg.ping_interval_s));
        let pong_timeout = Duration::from_secs_f64(cfg.ping_timeout_s.max(0.001));
        let mut ping = tokio::time::interval(ping_every.unwrap_or(Duration::from_secs(3600)));
        ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ping.reset();
        let mut ping_sent: Option<Instant> = None;
        let idle = (cfg.idle_timeout_s > 0.0).then(|| Duration::from_secs_f64(cfg.idle_timeout_s));
        let mut last_activity = Instant::now();
        let mut stalled = policy.worker.state.stalled.subscribe();

        loop {
            // On shutdown, everything already read is still answered.
            if stopping && self.outstanding == 0 && pending.is_none() && self.releasing.is_empty() {
                close(&mut self.ws, CloseCode::Away, "server shutting down").await;
                return End::Closed(Closed::Shutdown);
            }
            // A policy change waits for the requests in flight: they are answered first.
            if self.change.is_some()
                && self.outstanding == 0
                && self.releasing.is_empty()
                && let Some(change) = self.change.take()
            {
                match change {
                    Change::Removed => {
                        close(&mut self.ws, CloseCode::Away, "policy removed by a reload").await;
                        return End::Closed(Closed::PolicyRemoved);
                    }
                    Change::Replaced(to) => {
                        return End::Switch {
                            to,
                            frame: pending.take(),
                        };
                    }
                    Change::Named(to, frame, received) => {
                        return End::Switch {
                            to,
                            frame: Some((frame, received)),
                        };
                    }
                }
            }
            // Start the next frame if no `infer` is ahead of it and a slot is free.
            if !self.infer_busy && pending.is_some() && self.change.is_none() {
                let lease = policy.worker.pool.try_acquire();
                if let Some(lease) = lease
                    && let Some((frame, received)) = pending.take()
                {
                    if let Err(why) = self.start(&frame, received, lease).await {
                        return End::Closed(why);
                    }
                    continue;
                }
            }
            let idle_deadline = idle.map(|d| last_activity + d);
            let release_backstop = self
                .releasing
                .next_at()
                .map(|t| t + Duration::from_millis(2));
            let quiet = self.outstanding == 0 && pending.is_none() && self.releasing.is_empty();
            let wants_slot = !self.infer_busy && pending.is_some() && self.change.is_none();
            tokio::select! {
                changed = generation.changed() => {
                    if changed.is_ok() && self.change.is_none() {
                        self.change = self.reloaded();
                    }
                }
                changed = shutdown.changed(), if !stopping => {
                    if changed.is_err() || *shutdown.borrow() {
                        stopping = true;
                    }
                }
                lease = policy.worker.pool.acquire(), if wants_slot => {
                    if let Some((frame, received)) = pending.take()
                        && let Err(why) = self.start(&frame, received, lease).await
                    {
                        return End::Closed(why);
                    }
                }
                lease = self.port.recv(), if self.outstanding + self.abandoned > 0 => {
                    if lease.peek().ticket.epoch != self.epoch {
                        // Already answered with a timeout error.
                        self.abandoned = self.abandoned.saturating_sub(1);
                        continue;
                    }
                    self.outstanding -= 1;
                    if let Err(why) = self.finished(lease).await {
                        return End::Closed(why);
                    }
                    last_activity = Instant::now();
                }
                changed = stalled.changed(), if self.outstanding > 0 => {
                    if changed.is_ok() && *stalled.borrow_and_update() {
                        self.epoch += 1;
                        self.abandoned += self.outstanding;
                        self.outstanding = 0;
                        self.infer_busy = false;
                        if let Err(why) = self.fail(self.stall_failure()).await {
                        return End::Closed(why);
                    }
                    }
                }
                _ = self.wake.notified(), if !self.releasing.is_empty() => {
                    if let Err(why) = self.release_due().await {
                        return End::Closed(why);
                    }
                }
                _ = sleep_until_opt(release_backstop), if release_backstop.is_some() => {
                    if let Err(why) = self.release_due().await {
                        return End::Closed(why);
                    }
                }
                msg = self.ws.next(), if pending.is_none() && !stopping && self.change.is_none() => {
                    last_activity = Instant::now();
                    match msg {
                        None => return End::Closed(Closed::ByClient),
                        Some(Ok(Message::Binary(b))) => match oversize_marker(&b) {
                            None => pending = Some((b, Instant::now())),
                            Some(size) => {
                                let f = oversize(size, cfg.max_message_bytes);
                                if let Err(why) = self.fail(f).await {
                        return End::Closed(why);
                    }
                            }
                        },
                        Some(Ok(Message::Text(t))) => {
                            let f = match oversize_marker(t.as_bytes()) {
                                Some(size) => oversize(size, cfg.max_message_bytes),
                                None => Failure::Request("text frames are not accepted; send the observation as a binary msgpack frame".into()),
                            };
                            if let Err(why) = self.fail(f).await {
                        return End::Closed(why);
                    }
                        }
                        Some(Ok(Message::Pong(_))) => ping_sent = None,
                        Some(Ok(Message::Ping(_))) | Some(Ok(Message::Frame(_))) => {}
                        Some(Ok(Message::Close(_))) => {
                            // tungstenite answers the close; drive it to the end.
                            while let Ok(Some(_)) = tokio::time::timeout(Duration::from_secs(1), self.ws.next()).await {}
                            return End::Closed(Closed::ByClient);
                        }
                        Some(Err(e)) => {
                            // RFC 6455 §7.1.7: a client that broke the protocol gets a Close
                            // frame saying so before the socket goes (if it is still there).
                            if let Some(code) = violation_code(&e) {
                                close(&mut self.ws, code, "protocol violation").await;
                            }
                            return End::Closed(Closed::Protocol(e.to_string()));
                        }
                    }
                }
                _ = ping.tick(), if ping_every.is_some() => {
                    match ping_sent {
                        Some(t) if t.elapsed() >= pong_timeout => {
                            close(&mut self.ws, CloseCode::Error, "keepalive ping timeout").await;
                            return End::Closed(Closed::PingTimeout);
                        }
                        Some(_) => {}
                        None => {
                            if self.ws.send(Message::Ping(Bytes::new())).await.is_err() {
                                return End::Closed(Closed::Gone);
                            }
                            ping_sent = Some(Instant::now());
                        }
                    }
                }
                _ = sleep_until_opt(idle_deadline), if idle_deadline.is_some() && quiet => {
                    close(&mut self.ws, CloseCode::Normal, "idle timeout").await;
                    return End::Closed(Closed::Idle);
                }
            }
        }
    }

    /// What a reload did to this connection's policy, if anything.
    fn reloaded(&self) -> Option<Change> {
        let set = self.shared.policies.load();
        match set.get(&self.policy.name) {
            Some(p) if Arc::ptr_eq(p, &self.policy) => None,
            Some(p) => Some(Change::Replaced(p.clone())),
            None => Some(Change::Removed),
        }
    }

    /// Decodes a frame into `lease`'s slot and queues it (or answers it directly).
    async fn start(&mut self, frame: &Bytes, received: Instant, mut lease: Lease) -> Step {
        let shared = self.shared;
        let policy = self.policy.clone();
        let plan = &policy.plan;
        let pacing = &policy.spec.pacing;
        // Routed before it is decoded: with several policies, a frame naming another is that
        // policy's to decode (it may not even fit this one's bindings).
        if shared.policies.load().policies.len() > 1
            && let Some(name) = protocol::peek_policy(frame, &plan.limits)
            && name.as_str() != policy.name
        {
            drop(lease);
            return self.switch_to(&name, frame, received).await;
        }
        let slot = lease.slot();
        let planner = self.planner.as_deref();
        let meta = match plan.decode_with(frame, &mut slot.inputs, &mut slot.seen, planner) {
            Ok(m) => m,
            Err(e) => {
                if e.is_non_finite() {
                    shared.stats.metrics.non_finite_inputs.inc();
                }
                return self.fail(Failure::Request(e.to_string())).await;
            }
        };
        if let Some(name) = &meta.policy
            && name.as_str() != policy.name
        {
            // One policy served: the name can only be unknown (or added by a reload since).
            drop(lease);
            return self.switch_to(name, frame, received).await;
        }
        if let Some((default, max)) = plan.sampling
            && meta.endpoint != Endpoint::Reset
        {
            let steps = match meta.num_inference_steps {
                None => default,
                Some(n) if n >= 1 && n <= i64::from(max) => n as u32,
                Some(n) => {
                    let e = format!(
                        "sampling_params.num_inference_steps must be within 1..={max} \
                         (this policy's sampler.max_steps), got {n}"
                    );
                    return self.fail(Failure::Request(e)).await;
                }
            };
            // A request's own seed makes its noise a pure function of it; without one the
            // session's stream gives each request fresh noise.
            let seed = match meta.seed {
                Some(s) => s as u64,
                None => self.sessions.next_seed(meta.session_id.as_ref()),
            };
            slot.sampling = crate::engine::Sampling { seed, steps };
        }
        if plan.tokens.is_some() && meta.endpoint != Endpoint::Reset {
            let cache = self.sessions.prompt_cache(meta.session_id.as_ref());
            match plan.tokenize(&mut slot.inputs, cache) {
                Ok(t) => self.tokenized(&policy, t),
                Err(e) => return self.fail(Failure::Request(e.to_string())).await,
            }
        }
        if meta.endpoint != Endpoint::Reset && *policy.worker.state.stalled.borrow() {
            drop(lease);
            return self.fail(self.stall_failure()).await;
        }
        shared.stats.metrics.request(self.dialect, meta.endpoint);
        let release_at = crate::runtime::pacing::release_target(received, pacing.latency_budget_ms);
        match meta.endpoint {
            Endpoint::Reset => {
                drop(lease);
                match self.dialect.reset_scope() {
                    ResetScope::Session => {
                        self.sessions.reset(meta.session_id.as_ref());
                        self.drop_waiting(&policy);
                    }
                    ResetScope::Connection => {
                        self.sessions.reset_all();
                        self.drop_all_waiting(&policy);
                    }
                }
                self.count_sessions();
                match Dialect::encode_reset(shared.cfg.server.reset_reply, &mut self.out) {
                    Frame::Text(t) => self.send_msg(Message::text(t)).await,
                    Frame::Binary => {
                        let msg = self.send.message(&self.out);
                        self.send_msg(msg).await
                    }
                }
            }
            Endpoint::Infer => {
                self.check_prompt(&policy, meta.session_id.as_ref(), slot);
                let (reset, _) = self.sessions.begin(meta.session_id.as_ref());
                self.count_sessions();
                plan.stack_history(
                    &mut slot.inputs,
                    self.sessions.history(meta.session_id.as_ref()),
                    reset,
                );
                slot.prepare(
                    self.ticket(Kind::Infer, received, release_at, (0, 0.0)),
                    reset,
                );
                let key = self.key(slot.ticket.session.clone());
                match lease.submit(&policy.worker, &self.port, key) {
                    Ok(_) => {
                        self.outstanding += 1;
                        self.infer_busy = true;
                        Ok(())
                    }
                    Err(_) => {
                        self.fail(Failure::Inference(
                            "the engine worker is not running".into(),
                        ))
                        .await
                    }
                }
            }
            Endpoint::Observe => {
                let (timestep, timestamp) = match meta.observed_at() {
                    Ok(t) => t,
                    Err(e) => return self.fail(Failure::Request(e.to_string())).await,
                };
                shared.stats.skips.observed.fetch_add(1, Ordering::Relaxed);
                self.check_prompt(&policy, meta.session_id.as_ref(), slot);
                let mut state = [0f64; crate::limits::MAX_SIMILARITY_STATE];
                let state = plan.similarity_state(&mut slot.inputs, &mut state);
                let (reset, session) = self.sessions.begin(meta.session_id.as_ref());
                if let Some(gap) = session.observed(received) {
                    shared
                        .stats
                        .metrics
                        .observe_interval
                        .observe(gap.as_secs_f64());
                }
                let must_go = meta.must_go.unwrap_or(false);
                let admitted = session.admit(&self.filters, timestep, must_go, state);
                self.count_sessions();
                if let Err(why) = admitted {
                    drop(lease);
                    return self.skipped(timestep, why).await;
                }
                plan.stack_history(
                    &mut slot.inputs,
                    self.sessions.history(meta.session_id.as_ref()),
                    reset,
                );
                let ticket =
                    self.ticket(Kind::Observe, received, release_at, (timestep, timestamp));
                slot.prepare(ticket, reset);
                let key = self.key(slot.ticket.session.clone());
                match lease.submit(&policy.worker, &self.port, key) {
                    Ok(None) => {
                        self.outstanding += 1;
                        Ok(())
                    }
                    Ok(Some(mut old)) => {
                        // The session's waiting observation was replaced before it ran.
                        let old_step = old.slot().ticket.timestep;
                        let sid = old.slot().ticket.session.clone();
                        drop(old);
                        if let Some(p) = self.sessions.pacing(&sid) {
                            p.forget(old_step);
                        }
                        self.skipped(old_step, SkipReason::Superseded).await
                    }
                    Err(_) => {
                        self.fail(Failure::Inference(
                            "the engine worker is not running".into(),
                        ))
                        .await
                    }
                }
            }
        }
    }

    /// Moves the connection to the policy `name` once its requests in flight are answered,
    /// `frame` first; an error if no policy has that name.
    async fn switch_to(&mut self, name: &str, frame: &Bytes, received: Instant) -> Step {
        let set = self.shared.policies.load();
        let Some(to) = set.get(name) else {
            let e = format!(
                "no policy named \"{name}\"; this server serves: {}",
                set.names()
            );
            return self.fail(Failure::Request(e)).await;
        };
        self.change = Some(Change::Named(to.clone(), frame.clone(), received));
        Ok(())
    }

    /// The ticket of a request of the current session.
    fn ticket(
        &self,
        kind: Kind,
        received: Instant,
        release_at: Option<Instant>,
        (timestep, timestamp): (i64, f64),
    ) -> Ticket {
        Ticket {
            kind,
            epoch: self.epoch,
            session: self.sessions.current().clone(),
            received,
            release_at,
            timestep,
            timestamp,
        }
    }

    fn stall_failure(&self) -> Failure {
        Failure::Inference(format!(
            "the engine has been running one inference for over {} ms (engine.timeout_ms); \
             it may be stuck, so this request was not run",
            self.policy.spec.engine.timeout_ms
        ))
    }

    /// `reset_on_prompt_change`: a session whose prompt differs from its last one starts
    /// afresh, as after `endpoint: reset` (its waiting observations are dropped too).
    fn check_prompt(&mut self, policy: &Policy, id: Option<&protocol::SessionId>, slot: &mut Slot) {
        if !policy.spec.reset_on_prompt_change {
            return;
        }
        let hash = policy.plan.prompt_hash(&mut slot.inputs);
        if self.sessions.prompt_changed(id, hash) {
            self.drop_waiting(policy);
            log::debug!(
                "session {}: new prompt, session reset",
                self.sessions.current()
            );
        }
    }

    /// Counts a truncated prompt, and says so once per session (openpi logs every one).
    fn tokenized(&self, policy: &Policy, t: crate::bind::Tokenized) {
        let metrics = &self.shared.stats.metrics;
        if t.encoded {
            metrics.prompts_tokenized.inc();
        }
        let Some(n) = t.truncated else {
            return;
        };
        metrics.prompts_truncated.inc();
        if t.first_truncation {
            let max = policy
                .plan
                .tokens
                .and_then(|i| policy.plan.inputs[i].tokens.as_ref());
            log::warn!(
                "session {}: the prompt is {n} tokens, truncated to {} (tokenizer.max_tokens; \
                 said once per session)",
                self.sessions.current(),
                max.map_or(0, |t| t.max_tokens)
            );
        }
    }

    /// Drops the current session's observations still waiting for the engine (a reset).
    fn drop_waiting(&mut self, policy: &Policy) {
        let key = self.key(self.sessions.current().clone());
        let mut dropped = 0;
        policy.worker.scheduler.remove_session(&key, |job| {
            dropped += 1;
            job.recycle();
        });
        self.outstanding -= dropped;
    }

    /// Drops every observation of this connection still waiting for the engine (a reset of
    /// all its sessions).
    fn drop_all_waiting(&mut self, policy: &Policy) {
        let mut dropped = 0;
        policy.worker.scheduler.remove_conn(self.id, |job| {
            dropped += 1;
            job.recycle();
        });
        self.outstanding -= dropped;
    }

    /// Brings the sessions gauge in line with this connection's table.
    fn count_sessions(&mut self) {
        let now = self.sessions.len() as i64;
        if now != self.counted_sessions {
            self.shared
                .stats
                .metrics
                .sessions
                .inc_by(now - self.counted_sessions);
            self.counted_sessions = now;
        }
    }

    fn key(&self, session: protocol::SessionId) -> SessionKey {
        SessionKey {
            conn: self.id,
            session,
        }
    }

    /// Counts a skipped observation and, if configured, tells the client.
    async fn skipped(&mut self, timestep: i64, why: SkipReason) -> Step {
        self.shared.stats.skips.count(why);
        if !self.policy.spec.pacing.report_skipped {
            return Ok(());
        }
        Dialect::encode_skipped(timestep, why.as_str(), &mut self.out);
        let msg = self.send.message(&self.out);
        self.send_msg(msg).await
    }

    /// A slot came back from the engine: report a failure, or release the result (now, or at
    /// its release time).
    async fn finished(&mut self, mut lease: Lease) -> Step {
        let policy = self.policy.clone();
        let plan = &policy.plan;
        let slot = lease.slot();
        let failure = match slot.result.take() {
            Some(Ok(stats)) => {
                slot.result = Some(Ok(stats));
                let precision = self.dialect.precision();
                plan.non_finite_reply(&slot.outputs, &mut slot.scratch, precision)
                    .map(|name| {
                        Failure::Inference(format!(
                            "the engine's output '{name}' holds NaN or infinity as it would be \
                             sent (after un-normalisation and the cast to the reply dtype)"
                        ))
                    })
            }
            Some(Err(e)) => Some(Failure::Inference(e.to_string())),
            None => Some(Failure::Inference("the engine returned no result".into())),
        };
        if let Some(f) = failure {
            if slot.ticket.kind == Kind::Infer {
                self.infer_busy = false;
            }
            drop(lease);
            log::warn!("inference failed: {}", f.message());
            return self.fail(f).await;
        }
        match crate::runtime::pacing::release(Instant::now(), slot.ticket.release_at) {
            Release::At(at) => {
                if let Err(lease) = self.releasing.hold(at, lease) {
                    // One entry per slot: cannot be full; if it were, out now.
                    return self.release(lease, false).await;
                }
                self.shared
                    .pacer
                    .wake_at(at - crate::runtime::pacing::WAKE_LEAD, &self.wake);
                Ok(())
            }
            Release::Late => {
                self.shared.stats.release.missed();
                self.release(lease, false).await
            }
            Release::Now => self.release(lease, false).await,
        }
    }

    /// Releases every held result whose time has come.
    async fn release_due(&mut self) -> Step {
        while let Some(lease) = self.releasing.pop_due() {
            self.release(lease, true).await?;
        }
        Ok(())
    }

    /// Encodes a result and sends it.
    async fn release(&mut self, mut lease: Lease, paced: bool) -> Step {
        let shared = self.shared;
        let policy = self.policy.clone();
        let plan = &policy.plan;
        let pacing = &policy.spec.pacing;
        let now = Instant::now();
        let slot = lease.slot();
        let t = slot.ticket.clone();
        if paced && let Some(at) = t.release_at {
            shared.stats.release.on_time(at, now);
        }
        let latency = now.saturating_duration_since(t.received);
        let delay_steps = match self.sessions.pacing(&t.session) {
            Some(p) => {
                p.record_latency(latency.as_secs_f64());
                p.delay_steps(pacing.fps)
            }
            None => crate::runtime::session::delay_steps(latency.as_secs_f64(), pacing.fps),
        };
        let (compute, stages) = match &slot.result {
            Some(Ok(s)) => (s.compute, s.stages),
            _ => (Duration::ZERO, None),
        };
        let metrics = &shared.stats.metrics;
        metrics.replied(self.dialect, latency);
        metrics.engine.observe(compute.as_secs_f64());
        if let Some(s) = stages {
            metrics.sampler_steps.observe(f64::from(s.steps));
        }
        let mut parts = ReplyParts {
            outputs: &slot.outputs,
            scratch: &mut slot.scratch,
            chunk: plan.chunk(pacing, delay_steps),
        };
        let mut reply = plan.reply(&mut parts);
        match t.kind {
            Kind::Infer => {
                let timing = Timing {
                    policy_infer_ms: compute.as_secs_f64() * 1e3,
                    server_infer_ms: latency.as_secs_f64() * 1e3,
                    prev_total_ms: self.prev_total_ms,
                    stages: stages.map(|s| {
                        (
                            s.prefix.as_secs_f64() * 1e3,
                            s.denoise.as_secs_f64() * 1e3,
                            s.steps,
                        )
                    }),
                };
                let d = pacing.reply_delay_steps.then_some(delay_steps);
                self.dialect
                    .encode_infer(&mut reply, &timing, d, &mut slot.reply);
            }
            Kind::Observe => self.dialect.encode_observe(
                &mut reply,
                (t.timestep, t.timestamp),
                1.0 / pacing.fps,
                delay_steps,
                &mut slot.reply,
            ),
        }
        let msg = self.send.message(&slot.reply);
        drop(lease);
        if t.kind == Kind::Infer {
            self.infer_busy = false;
            self.prev_total_ms = Some(t.received.elapsed().as_secs_f64() * 1e3);
        }
        self.send_msg(msg).await
    }

    async fn send_msg(&mut self, msg: Message) -> Step {
        self.ws.send(msg).await.map_err(|_| Closed::Gone)
    }

    /// Reports a failure in the connection's dialect; `Err` when the dialect closes after it.
    async fn fail(&mut self, f: Failure) -> Step {
        self.shared.stats.metrics.error(self.dialect, f.kind());
        let reply = self.dialect.encode_error(&f, &mut self.out);
        let sent = match reply.frame {
            Frame::Text(text) => {
                log::info!("closing after error: {text}");
                let _ = self.ws.send(Message::text(text.clone())).await;
                Some(text)
            }
            Frame::Binary => {
                log::info!("request error: {}", f.message());
                let msg = self.send.message(&self.out);
                self.send_msg(msg).await?;
                None
            }
        };
        if reply.close {
            close(&mut self.ws, CloseCode::Error, OPENPI_ERROR_REASON).await;
            return Err(Closed::AfterError(
                sent.unwrap_or_else(|| f.message().to_string()),
            ));
        }
        Ok(())
    }
}

/// The planner's link, for a policy whose bindings it fits (only the default policy's plan
/// has a planner tap).
fn planner_for(shared: &Shared, policy: &Policy) -> Option<Arc<Link>> {
    let link = shared.planner.as_ref()?;
    let tap = policy.plan.planner.as_ref()?;
    tap.fits(link).then(|| link.clone())
}

/// The error for a message the frame guard dropped for its size.
fn oversize(size: u64, limit: usize) -> Failure {
    Failure::Request(format!(
        "the message ({size} bytes or more) exceeds server.max_message_bytes = {limit}; it was discarded unread"
    ))
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d.into()).await,
        None => std::future::pending().await,
    }
}

/// The close code for a stream error the client caused: 1007 for text that is not UTF-8,
/// 1009 for a message over tungstenite's own limits, 1002 for any other protocol violation
/// (unmasked, reserved bits or opcodes, oversized or fragmented control frames, stray
/// continuations, a 1-byte close payload). `None` when the client is gone (nobody to tell).
fn violation_code(e: &tokio_tungstenite::tungstenite::Error) -> Option<CloseCode> {
    use tokio_tungstenite::tungstenite::Error;
    use tokio_tungstenite::tungstenite::error::ProtocolError;
    match e {
        Error::Utf8(_) => Some(CloseCode::Invalid),
        Error::Capacity(_) => Some(CloseCode::Size),
        Error::Protocol(
            ProtocolError::ResetWithoutClosingHandshake
            | ProtocolError::ReceivedAfterClosing
            | ProtocolError::SendAfterClosing,
        ) => None,
        Error::Protocol(_) => Some(CloseCode::Protocol),
        _ => None,
    }
}

async fn close<S>(ws: &mut WebSocketStream<S>, code: CloseCode, reason: &str)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let frame = CloseFrame {
        code,
        reason: reason.to_string().into(),
    };
    if ws.close(Some(frame)).await.is_ok() {
        // Wait briefly for the client's close reply so the close handshake completes.
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            while let Some(Ok(_)) = ws.next().await {}
        })
        .await;
    }
}
