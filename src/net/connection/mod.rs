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

mod closing;

pub use closing::Closed;
use closing::{close, violation_code};

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::{Bytes, Message};

use crate::net::frame_guard::{NotReading, oversize_marker};
use crate::net::requests::{Core, Event, Released, Reload, Started, sleep_until_opt};
use crate::net::shared::{Shared, next_client_id};
use crate::policy::Policy;
use crate::protocol::dialect::{Frame, OPENPI_ERROR_REASON};
use crate::protocol::{self, Dialect, Failure, Timing};
use crate::runtime::scheduler::{Kind, SkipReason};
use crate::runtime::worker::Lease;

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
    /// The requests of this connection (sessions, slots in flight, pacing).
    core: Core,
    /// A policy switch waiting for the requests in flight to finish.
    change: Option<Change>,
    dialect: Dialect,
    /// Immediate replies (errors, reset, skipped notices).
    out: Vec<u8>,
    send: SendBuf,
    /// When the keepalive ping still unanswered was sent.
    ping_sent: Option<Instant>,
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

impl From<Reload> for Change {
    fn from(r: Reload) -> Change {
        match r {
            Reload::Replaced(p) => Change::Replaced(p),
            Reload::Removed => Change::Removed,
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
    let id = next_client_id();
    let mut first = None;
    let mut send_metadata = true;
    loop {
        let capacity = policy.plan.reply_capacity.max(1024);
        let mut c = Conn {
            ws,
            shared,
            dialect,
            core: Core::new(
                &shared.requests,
                policy.clone(),
                id,
                dialect.into(),
                dialect.precision(),
            ),
            out: Vec::with_capacity(capacity),
            send: SendBuf::new(capacity),
            change: None,
            ping_sent: None,
        };
        let end = c.run(send_metadata, first.take()).await;
        let Conn {
            ws: socket, core, ..
        } = c;
        core.close();
        match end {
            End::Closed(why) => return why,
            End::Switch { to, frame } => {
                if to.plan.write_buffer() > socket.get_config().max_write_buffer_size {
                    // Sized when the connection opened; a reload made this policy's frames
                    // larger. A new connection gets the new bound.
                    let mut socket = socket;
                    close(&mut socket, CloseCode::Away, "policy reloaded; reconnect").await;
                    return Closed::Outgrown;
                }
                crate::log_limited!(
                    log::Level::Info,
                    "connection {id}: policy \"{}\" -> \"{}\" (sessions start afresh)",
                    policy.name,
                    to.name
                );
                ws = socket;
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
        let policy = self.core.policy().clone();
        let cfg = &shared.cfg.server;
        if send_metadata
            && let Err(why) = self
                .send_msg(Message::Binary(policy.metadata.clone()))
                .await
        {
            return End::Closed(match why {
                Closed::NotReading => Closed::NotReading,
                _ => Closed::BeforeMetadata,
            });
        }
        let mut pending: Option<(Bytes, Instant)> = first;
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
        let idle = (cfg.idle_timeout_s > 0.0).then(|| Duration::from_secs_f64(cfg.idle_timeout_s));
        let mut last_activity = Instant::now();

        loop {
            // On shutdown, everything already read is still answered.
            if stopping && self.core.idle() && pending.is_none() {
                close(&mut self.ws, CloseCode::Away, "server shutting down").await;
                return End::Closed(Closed::Shutdown);
            }
            // A policy change waits for the requests in flight: they are answered first.
            if self.change.is_some()
                && self.core.idle()
                && let Some(change) = self.change.take()
            {
                return self.leave(change, pending.take()).await;
            }
            // Start the next frame if no `infer` is ahead of it and a slot is free.
            if !self.core.infer_busy() && pending.is_some() && self.change.is_none() {
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
            let quiet = self.core.idle() && pending.is_none();
            let wants_slot = !self.core.infer_busy() && pending.is_some() && self.change.is_none();
            tokio::select! {
                event = self.core.next() => {
                    if let Err(why) = self.on_event(event).await {
                        return End::Closed(why);
                    }
                    last_activity = Instant::now();
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
                msg = self.ws.next(), if pending.is_none() && !stopping && self.change.is_none() => {
                    // A pong answers the server's own ping (any client library does that by
                    // itself): it shows the socket is alive, not that the client is using it.
                    if !matches!(msg, Some(Ok(Message::Pong(_)))) {
                        last_activity = Instant::now();
                    }
                    match self.on_message(msg).await {
                        Ok(Some(frame)) => pending = Some((frame, Instant::now())),
                        Ok(None) => {}
                        Err(end) => return end,
                    }
                }
                _ = ping.tick(), if ping_every.is_some() => {
                    if let Err(why) = self.ping(pong_timeout).await {
                        return End::Closed(why);
                    }
                }
                _ = sleep_until_opt(idle_deadline), if idle_deadline.is_some() && quiet => {
                    close(&mut self.ws, CloseCode::Normal, "idle timeout").await;
                    return End::Closed(Closed::Idle);
                }
            }
        }
    }

    /// What the request core reports: a reply to release, a failure to answer, a reload.
    async fn on_event(&mut self, event: Event) -> Result<(), Closed> {
        match event {
            Event::Release { lease, paced } => self.release(lease, paced).await,
            Event::Failed(f) => self.fail(f).await,
            Event::Reloaded(r) => {
                if self.change.is_none() {
                    self.change = Some(r.into());
                }
                Ok(())
            }
        }
    }

    /// Leaves the current policy once nothing is in flight: closes for a removed one, or
    /// switches (fresh sessions) with the frame that was waiting, if any.
    async fn leave(&mut self, change: Change, pending: Option<(Bytes, Instant)>) -> End {
        match change {
            Change::Removed => {
                close(&mut self.ws, CloseCode::Away, "policy removed by a reload").await;
                End::Closed(Closed::PolicyRemoved)
            }
            Change::Replaced(to) => End::Switch { to, frame: pending },
            Change::Named(to, frame, received) => End::Switch {
                to,
                frame: Some((frame, received)),
            },
        }
    }

    /// One message from the client: a binary frame to start (returned), or what the
    /// connection does about anything else; `Err` when the connection ends.
    async fn on_message(
        &mut self,
        msg: Option<Result<Message, tokio_tungstenite::tungstenite::Error>>,
    ) -> Result<Option<Bytes>, End> {
        let max = self.shared.cfg.server.max_message_bytes;
        let closed = |why| Err(End::Closed(why));
        match msg {
            None => closed(Closed::ByClient),
            Some(Ok(Message::Binary(b))) => match oversize_marker(&b) {
                None => Ok(Some(b)),
                Some(size) => self
                    .fail(oversize(size, max))
                    .await
                    .map(|()| None)
                    .or_else(closed),
            },
            Some(Ok(Message::Text(t))) => {
                let f = match oversize_marker(t.as_bytes()) {
                    Some(size) => oversize(size, max),
                    None => Failure::Request(
                        "text frames are not accepted; send the observation as a binary msgpack \
                         frame"
                            .into(),
                    ),
                };
                self.fail(f).await.map(|()| None).or_else(closed)
            }
            Some(Ok(Message::Pong(_))) => {
                self.ping_sent = None;
                Ok(None)
            }
            Some(Ok(Message::Ping(_))) | Some(Ok(Message::Frame(_))) => Ok(None),
            Some(Ok(Message::Close(_))) => {
                // tungstenite answers the close; drive it to the end.
                while let Ok(Some(_)) =
                    tokio::time::timeout(Duration::from_secs(1), self.ws.next()).await
                {
                }
                closed(Closed::ByClient)
            }
            Some(Err(e)) if NotReading::is(&e) => {
                // Nothing more can be written to it: no close frame either.
                closed(Closed::NotReading)
            }
            Some(Err(e)) => {
                // RFC 6455 §7.1.7: a client that broke the protocol gets a Close frame saying
                // so before the socket goes (if it is still there).
                if let Some(code) = violation_code(&e) {
                    close(&mut self.ws, code, "protocol violation").await;
                }
                closed(Closed::Protocol(e.to_string()))
            }
        }
    }

    /// The keepalive: a ping when none is out, the connection's end when the last one has
    /// gone unanswered for `server.ping_timeout_s`.
    async fn ping(&mut self, timeout: Duration) -> Step {
        match self.ping_sent {
            Some(t) if t.elapsed() >= timeout => {
                close(&mut self.ws, CloseCode::Error, "keepalive ping timeout").await;
                Err(Closed::PingTimeout)
            }
            Some(_) => Ok(()),
            None => {
                self.send_msg(Message::Ping(Bytes::new())).await?;
                self.ping_sent = Some(Instant::now());
                Ok(())
            }
        }
    }

    /// What a reload did to this connection's policy, if anything.
    fn reloaded(&self) -> Option<Change> {
        self.core.reload().map(Change::from)
    }

    /// Decodes a frame into `lease`'s slot through the request core and answers what it
    /// could not queue.
    async fn start(&mut self, frame: &Bytes, received: Instant, lease: Lease) -> Step {
        let policy = self.core.policy().clone();
        // Routed before it is decoded: with several policies, a frame naming another is that
        // policy's to decode (it may not even fit this one's bindings).
        if self.shared.policies().load().policies.len() > 1
            && let Some(name) = protocol::peek_policy(frame, &policy.plan.limits)
            && name.as_str() != policy.name
        {
            drop(lease);
            return self.switch_to(&name, frame, received).await;
        }
        let started = self.core.start(
            received,
            lease,
            self.dialect.reset_scope(),
            |plan, inputs, seen, planner| plan.decode_with(frame, inputs, seen, planner),
        );
        match started {
            Started::Queued => Ok(()),
            Started::Failed(f) => self.fail(f).await,
            Started::Undecodable(e) => self.fail(Failure::Request(e.to_string())).await,
            // One policy served: the name can only be unknown (or added by a reload since).
            Started::OtherPolicy(name) => self.switch_to(&name, frame, received).await,
            Started::Skipped {
                timestep,
                why,
                report,
            } => {
                if report {
                    self.skipped(timestep, why).await
                } else {
                    Ok(())
                }
            }
            Started::Reset => {
                match Dialect::encode_reset(self.shared.cfg.server.reset_reply, &mut self.out) {
                    Frame::Text(t) => self.send_msg(Message::text(t)).await,
                    Frame::Binary => {
                        let msg = self.send.message(&self.out);
                        self.send_msg(msg).await
                    }
                }
            }
        }
    }

    /// Moves the connection to the policy `name` once its requests in flight are answered,
    /// `frame` first; an error if no policy has that name.
    async fn switch_to(&mut self, name: &str, frame: &Bytes, received: Instant) -> Step {
        let set = self.shared.policies().load();
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

    /// Tells the client an observation was skipped (`pacing.report_skipped`).
    async fn skipped(&mut self, timestep: i64, why: SkipReason) -> Step {
        Dialect::encode_skipped(timestep, why.as_str(), &mut self.out);
        let msg = self.send.message(&self.out);
        self.send_msg(msg).await
    }

    /// Encodes a result in the connection's dialect and sends it.
    async fn release(&mut self, lease: Lease, paced: bool) -> Step {
        let dialect = self.dialect;
        let reply_delay_steps = self.core.policy().spec.pacing.reply_delay_steps;
        let lease = self
            .core
            .release(lease, paced, |r: Released<'_, '_, '_>| match r.kind {
                Kind::Infer => {
                    let timing = Timing {
                        policy_infer_ms: r.compute.as_secs_f64() * 1e3,
                        server_infer_ms: r.latency.as_secs_f64() * 1e3,
                        prev_total_ms: r.prev_total_ms,
                        stages: r.stages,
                    };
                    let d = reply_delay_steps.then_some(r.delay_steps);
                    dialect.encode_infer(r.reply, &timing, d, r.buf);
                }
                Kind::Observe => dialect.encode_observe(
                    r.reply,
                    r.ticket.at(),
                    1.0 / r.fps,
                    r.delay_steps,
                    r.buf,
                ),
            });
        let msg = self.send.message(lease.peek().reply());
        drop(lease);
        self.send_msg(msg).await
    }

    /// Sends `msg`. A client that stops reading (its receive window full) fails the send once
    /// no byte has gone out for `server.write_timeout_s` (the frame guard's stall clock): it is
    /// closed, not waited for, while a slow client that keeps reading gets all the time it takes.
    async fn send_msg(&mut self, msg: Message) -> Step {
        self.ws.send(msg).await.map_err(|e| {
            if NotReading::is(&e) {
                Closed::NotReading
            } else {
                Closed::Gone
            }
        })
    }

    /// Reports a failure in the connection's dialect; `Err` when the dialect closes after it.
    async fn fail(&mut self, f: Failure) -> Step {
        self.core.count_error(&f);
        let reply = self.dialect.encode_error(&f, &mut self.out);
        let sent = match reply.frame {
            Frame::Text(text) => {
                crate::log_limited!(
                    log::Level::Info,
                    "closing after error: {}",
                    crate::log_limit::Escaped(&text)
                );
                let _ = self.send_msg(Message::text(text.clone())).await;
                Some(text)
            }
            Frame::Binary => {
                crate::log_limited!(
                    log::Level::Info,
                    "request error: {}",
                    crate::log_limit::Escaped(f.message())
                );
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

/// The error for a message the frame guard dropped for its size.
fn oversize(size: u64, limit: usize) -> Failure {
    Failure::Request(format!(
        "the message ({size} bytes or more) exceeds server.max_message_bytes = {limit}; it was discarded unread"
    ))
}
