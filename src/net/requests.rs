//! The request core both front ends share: one client's way from a decoded request to a released
//! reply, without the socket.
//!
//! A front end (the WebSocket [connection](crate::net::connection), LeRobot's gRPC
//! [service](crate::net::lerobot)) reads bytes and writes replies in its own framing; everything
//! between is here, once: the decode into a slot (through the front end's own decoder), the
//! request's sampling seed and prompt tokens, the session table (latest-wins, `must_go`, the
//! predicted-timestep and similarity filters, history, `[rtc]`'s previous chunk and the
//! leftover a new observation continues), the scheduler and engine worker, the engine-stall
//! watchdog, and the pacing that holds a finished result until its release time.
//! The core never sends: each step says what happened, and the front end answers in its format.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::{Notify, watch};

use crate::bind::{Plan, Reply, ReplyParts};
use crate::engine::InputBuffer;
use crate::metrics::Stats;
use crate::planner::Link;
use crate::policy::Policy;
use crate::protocol::dialect::{Precision, ResetScope};
use crate::protocol::{
    self, Endpoint, Failure, PolicyName, RequestMeta, Route, TimedStep, WireError,
};
use crate::runtime::pacing::{Pacer, Release, ReleaseQueue};
use crate::runtime::scheduler::{Kind, SessionKey, SkipReason};
use crate::runtime::session::{Filters, Sessions};
use crate::runtime::worker::{Lease, ReplyPort, Ticket};

/// What [`Core::start`] did with a request.
pub enum Started {
    /// Queued for the engine; its result comes back through [`Core::next`].
    Queued,
    /// A reset was done; the front end acknowledges it.
    Reset,
    /// Not run: the front end reports the failure.
    Failed(Failure),
    /// Not run: the request did not decode (counted as a request error when reported, as
    /// [`Started::Failed`]); the front end may tell the causes apart.
    Undecodable(WireError),
    /// An observation was filtered out, or replaced one still waiting (counted already);
    /// `report` is the policy's `pacing.report_skipped`.
    Skipped {
        timestep: i64,
        why: SkipReason,
        report: bool,
    },
    /// The request names another policy; nothing was done (the WebSocket front end switches).
    OtherPolicy(PolicyName),
}

/// What [`Core::next`] waited for.
pub enum Event {
    /// A result to send now; `paced` if it was held for its release time (for
    /// [`Core::release`]).
    Release { lease: Lease, paced: bool },
    /// A request failed (the engine's error, or the engine stalled): the front end reports it.
    Failed(Failure),
    /// The served policies changed (a reload): what that means is the front end's call.
    Reloaded,
}

/// What [`Core::finished`] made of a slot back from the engine.
enum Finished {
    /// The run failed: the front end reports it.
    Failed(Failure),
    /// Held until its release time; [`Core::due`] hands it out when the wake fires.
    Held,
    /// Release it now ([`Core::release`]).
    Now(Lease),
}

/// What a front end's encoder gets at release: the cut, converted outputs and the request's
/// facts, to write its reply into `buf` (the slot's reply buffer).
pub struct Released<'r, 'p, 'a> {
    pub kind: Kind,
    pub reply: &'r mut Reply<'p, 'a>,
    pub ticket: &'r Ticket,
    /// Steps the reply is late by, from the session's latency window.
    pub delay_steps: u32,
    /// The policy's `pacing.fps`.
    pub fps: f64,
    pub compute: Duration,
    pub latency: Duration,
    /// A pipeline's stages, as the reply reports them.
    pub stages: Option<protocol::StageTimes>,
    /// The previous `infer`'s total time as the client saw it (openpi's `prev_total_ms`).
    pub prev_total_ms: Option<f64>,
    pub buf: &'r mut Vec<u8>,
}

/// What the core uses of the server, shared by every client's core.
#[derive(Clone)]
pub struct Context {
    pub stats: Arc<Stats>,
    /// Wakes a client when a held reply's release time comes.
    pub pacer: Arc<Pacer>,
    /// What the task planner feeds, when `[planner]` is on: passed to the decode of the
    /// default policy whose bindings it fits.
    pub planner: Option<Arc<Link>>,
    /// `server.max_sessions`: a client's session table.
    pub max_sessions: usize,
    /// The served set's generation: a reload bumps it ([`Event::Reloaded`]).
    pub generation: watch::Receiver<u64>,
}

/// One client's requests to one policy: its sessions, its slots in flight and held for release.
pub struct Core {
    stats: Arc<Stats>,
    pacer: Arc<Pacer>,
    policy: Arc<Policy>,
    /// The planner's link, if it feeds this policy (see [`Context::planner`]).
    planner: Option<Arc<Link>>,
    /// The scheduler's connection id.
    id: u64,
    /// The front end, for the metrics' `route` label.
    route: Route,
    /// How the front end sends floats, for the non-finite check of what it will send.
    precision: Precision,
    sessions: Box<Sessions>,
    port: ReplyPort,
    /// Slots submitted and not yet back.
    outstanding: usize,
    /// An `infer` is queued, running or waiting for release: the next request waits.
    infer_busy: bool,
    /// Finished slots waiting for their release time, earliest first.
    releasing: ReleaseQueue<Lease>,
    wake: Arc<Notify>,
    prev_total_ms: Option<f64>,
    filters: Filters,
    /// This client's share of the `policyd_sessions` gauge.
    counted_sessions: i64,
    /// Bumped when the engine stalls and this client's waiting requests are answered with a
    /// timeout error; slots of an older epoch are dropped when they come back.
    epoch: u64,
    /// Slots submitted before the last stall, not yet back.
    abandoned: usize,
    /// The engine worker's stall flag (`engine.timeout_ms`).
    stalled: watch::Receiver<bool>,
    generation: watch::Receiver<u64>,
    /// The generation's or the stall flag's sender is gone (the server is stopping): those
    /// watches are off, so that a closed channel cannot spin the loop.
    server_gone: bool,
}

impl Core {
    pub fn new(
        cx: &Context,
        policy: Arc<Policy>,
        id: u64,
        route: Route,
        precision: Precision,
    ) -> Self {
        let pacing = &policy.spec.pacing;
        Core {
            stats: cx.stats.clone(),
            pacer: cx.pacer.clone(),
            planner: planner_for(cx, &policy),
            id,
            route,
            precision,
            sessions: Box::new(Sessions::keeping_chunks(
                cx.max_sessions,
                pacing.latency_window,
                policy.plan.rtc.map_or(0, |r| r.rows * r.width),
            )),
            port: ReplyPort::new(&policy.worker.pool),
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
            stalled: policy.worker.state.stalled.subscribe(),
            generation: {
                let mut g = cx.generation.clone();
                g.mark_unchanged();
                g
            },
            server_gone: false,
            policy,
        }
    }

    pub fn policy(&self) -> &Arc<Policy> {
        &self.policy
    }

    /// An `infer` is ahead: the next request must wait for its reply.
    pub fn infer_busy(&self) -> bool {
        self.infer_busy
    }

    /// Slots submitted and not yet back.
    fn outstanding(&self) -> usize {
        self.outstanding
    }

    /// Nothing in flight or held: what shutdown and a policy switch wait for.
    pub fn idle(&self) -> bool {
        self.outstanding == 0 && self.releasing.is_empty()
    }

    /// Whether slots (current or abandoned) are still to come back through [`port`](Self::port).
    fn awaiting(&self) -> bool {
        self.outstanding + self.abandoned > 0
    }

    /// The earliest release time held.
    fn next_release(&self) -> Option<Instant> {
        self.releasing.next_at()
    }

    /// Whether results are held for release.
    fn holding(&self) -> bool {
        !self.releasing.is_empty()
    }

    /// Runs one request in `lease`'s slot: `decode` writes it into the slot's inputs (the front
    /// end's wire format), then the request is reset, queued or filtered.
    pub fn start<D>(
        &mut self,
        received: Instant,
        mut lease: Lease,
        reset_scope: ResetScope,
        decode: D,
    ) -> Started
    where
        D: FnOnce(
            &Plan,
            &mut [Box<dyn InputBuffer>],
            &mut [bool],
            Option<&Link>,
        ) -> Result<RequestMeta, WireError>,
    {
        let slot = lease.slot();
        // A run continues no chunk unless `observe` says which (`start_observe`).
        *slot.continuation_mut().1 = None;
        let (inputs, seen) = slot.inputs_mut();
        let decoded = decode(&self.policy.plan, inputs, seen, self.planner.as_deref());
        let meta = match self.decoded(decoded) {
            Ok(meta) => meta,
            Err(not) => return not,
        };
        if meta.endpoint == Endpoint::Reset {
            self.stats.metrics.request(self.route, meta.endpoint);
            drop(lease);
            return self.reset(&meta, reset_scope);
        }
        if let Err(failed) = self.prepare_run(&meta, &mut lease) {
            return failed;
        }
        self.stats.metrics.request(self.route, meta.endpoint);
        let pacing = &self.policy.spec.pacing;
        let release_at = crate::runtime::pacing::release_target(received, pacing.latency_budget_ms);
        match meta.endpoint {
            Endpoint::Observe => self.start_observe(&meta, lease, received, release_at),
            _ => self.start_infer(&meta, lease, received, release_at),
        }
    }

    /// The decoded request, if this core runs it; else what [`Core::start`] answers instead (it
    /// did not decode, or it names another policy).
    fn decoded(&self, decoded: Result<RequestMeta, WireError>) -> Result<RequestMeta, Started> {
        let meta = decoded.map_err(|e| {
            if e.is_non_finite() {
                self.stats.metrics.non_finite_inputs.inc();
            }
            Started::Undecodable(e)
        })?;
        match &meta.policy {
            Some(name) if name.as_str() != self.policy.name => {
                Err(Started::OtherPolicy(name.clone()))
            }
            _ => Ok(meta),
        }
    }

    /// What a run needs beside its inputs: the sampler's steps and seed, the prompt's tokens;
    /// refused while the engine is stalled.
    fn prepare_run(&mut self, meta: &RequestMeta, lease: &mut Lease) -> Result<(), Started> {
        let policy = self.policy.clone();
        let plan = &policy.plan;
        let slot = lease.slot();
        if let Some((default, max)) = plan.sampling {
            let steps = match meta.num_inference_steps {
                None => default,
                Some(n) if n >= 1 && n <= i64::from(max) => n as u32,
                Some(n) => {
                    return Err(Started::Failed(Failure::Request(format!(
                        "sampling_params.num_inference_steps must be within 1..={max} \
                         (this policy's sampler.max_steps), got {n}"
                    ))));
                }
            };
            // A request's own seed makes its noise a pure function of it; without one the
            // session's stream gives each request fresh noise.
            let seed = match meta.seed {
                Some(s) => s as u64,
                None => self.sessions.next_seed(meta.session_id.as_ref()),
            };
            slot.set_sampling(crate::engine::Sampling { seed, steps });
        }
        if plan.tokens.is_some() {
            let cache = self.sessions.prompt_cache(meta.session_id.as_ref());
            match plan.tokenize(slot.inputs_mut().0, cache) {
                Ok(t) => self.tokenized(&policy, t),
                Err(e) => return Err(Started::Failed(Failure::Request(e.to_string()))),
            }
        }
        if *policy.worker.state.stalled.borrow() {
            return Err(Started::Failed(self.stall_failure()));
        }
        Ok(())
    }

    /// `endpoint: reset`: the session's state (or the connection's, as the front end scopes
    /// it) forgotten.
    fn reset(&mut self, meta: &RequestMeta, scope: ResetScope) -> Started {
        match scope {
            ResetScope::Session => {
                self.sessions.reset(meta.session_id.as_ref());
                self.drop_waiting();
            }
            ResetScope::Connection => self.reset_all(),
        }
        self.count_sessions();
        Started::Reset
    }

    /// `infer`: run now, whatever the session did before.
    fn start_infer(
        &mut self,
        meta: &RequestMeta,
        mut lease: Lease,
        received: Instant,
        release_at: Option<Instant>,
    ) -> Started {
        let policy = self.policy.clone();
        let slot = lease.slot();
        self.check_prompt(meta.session_id.as_ref(), slot.inputs_mut().0);
        let (reset, _) = self.sessions.begin(meta.session_id.as_ref());
        self.count_sessions();
        policy.plan.stack_history(
            slot.inputs_mut().0,
            self.sessions.history(meta.session_id.as_ref()),
            reset,
        );
        slot.prepare(
            self.ticket(Kind::Infer, received, release_at, TimedStep::default()),
            reset,
        );
        match self.queue(lease) {
            Ok(_) => {
                self.infer_busy = true;
                Started::Queued
            }
            Err(failed) => failed,
        }
    }

    /// `observe`: the session's filters admit it (or skip it), it continues the chunk the
    /// robot is executing (`[rtc]`), and it replaces the session's observation still waiting.
    fn start_observe(
        &mut self,
        meta: &RequestMeta,
        mut lease: Lease,
        received: Instant,
        release_at: Option<Instant>,
    ) -> Started {
        let policy = self.policy.clone();
        let plan = &policy.plan;
        let at = match meta.observed_at() {
            Ok(t) => t,
            Err(e) => return Started::Failed(Failure::Request(e.to_string())),
        };
        self.stats.skips.observed.fetch_add(1, Ordering::Relaxed);
        let slot = lease.slot();
        self.check_prompt(meta.session_id.as_ref(), slot.inputs_mut().0);
        let mut state = [0f64; crate::limits::MAX_SIMILARITY_STATE];
        let state = plan.similarity_state(slot.inputs_mut().0, &mut state);
        let (reset, session) = self.sessions.begin(meta.session_id.as_ref());
        if let Some(gap) = session.observed(received) {
            self.stats
                .metrics
                .observe_interval
                .observe(gap.as_secs_f64());
        }
        let must_go = meta.must_go.unwrap_or(false);
        let admitted = session.admit(&self.filters, at.timestep, must_go, state);
        self.count_sessions();
        if let Err(why) = admitted {
            drop(lease);
            return self.skipped(at.timestep, why);
        }
        plan.stack_history(
            slot.inputs_mut().0,
            self.sessions.history(meta.session_id.as_ref()),
            reset,
        );
        if let Some(r) = plan.rtc {
            self.continuation(r, policy.spec.pacing.fps, at.timestep, slot);
        }
        let ticket = self.ticket(Kind::Observe, received, release_at, at);
        slot.prepare(ticket, reset);
        match self.queue(lease) {
            Ok(None) => Started::Queued,
            Ok(Some(mut old)) => {
                // The session's waiting observation was replaced before it ran.
                let old_step = old.slot().ticket().timestep;
                let sid = old.slot().ticket().session.clone();
                drop(old);
                if let Some(p) = self.sessions.pacing(&sid) {
                    p.forget(old_step);
                }
                self.skipped(old_step, SkipReason::Superseded)
            }
            Err(failed) => failed,
        }
    }

    /// Hands a prepared slot to the policy's worker; the lease of the session's observation it
    /// replaced, if any (only an observation replaces one: then nothing more is outstanding).
    fn queue(&mut self, lease: Lease) -> Result<Option<Lease>, Started> {
        let key = self.key(lease.peek().ticket().session.clone());
        let replaced = lease
            .submit(&self.policy.worker, &self.port, key)
            .map_err(|_| Started::Failed(not_running()))?;
        if replaced.is_none() {
            self.outstanding += 1;
        }
        Ok(replaced)
    }

    /// `[rtc]`: the current session's previous chunk from `timestep` on into the slot's
    /// leftover buffer, with the inference delay (fixed, or the session's measured one). No
    /// leftover (a session's first chunk, the robot past the previous chunk's end): a plain run.
    fn continuation(
        &mut self,
        r: crate::bind::RtcPlan,
        fps: f64,
        timestep: i64,
        slot: &mut crate::runtime::worker::Slot,
    ) {
        let Some(p) = self.sessions.current_pacing() else {
            return;
        };
        let (buf, continues) = slot.continuation_mut();
        let horizon = r.settings.execution_horizon;
        let rows = p.previous.leftover(timestep, r.width, horizon, buf);
        let delay = r
            .settings
            .inference_delay
            .unwrap_or_else(|| p.max_delay_steps(fps) as usize);
        *continues = (rows > 0).then_some(crate::rtc::Request { rows, delay });
    }

    /// Forgets every session and drops this client's observations still waiting for the
    /// engine (vllm-omni's reset, LeRobot's `Ready`).
    pub fn reset_all(&mut self) {
        self.sessions.reset_all();
        let mut dropped = 0;
        self.policy.worker.scheduler.remove_conn(self.id, |job| {
            dropped += 1;
            job.recycle();
        });
        self.outstanding -= dropped;
        self.count_sessions();
    }

    /// A slot came back through the port: `None` if it belongs to requests already answered
    /// by a stall error (dropped), else the slot to hand to [`finished`](Self::finished).
    fn returned(&mut self, lease: Lease) -> Option<Lease> {
        if lease.peek().ticket().epoch != self.epoch {
            self.abandoned = self.abandoned.saturating_sub(1);
            return None;
        }
        self.outstanding -= 1;
        Some(lease)
    }

    /// The engine has run past `engine.timeout_ms`: every request in flight is answered with
    /// the returned failure now, and their slots are dropped when they come back.
    fn stall(&mut self) -> Failure {
        self.epoch += 1;
        self.abandoned += self.outstanding;
        self.outstanding = 0;
        self.infer_busy = false;
        self.stall_failure()
    }

    /// A finished slot: a failure to report, or its result to release now or at its time.
    fn finished(&mut self, mut lease: Lease) -> Finished {
        let policy = self.policy.clone();
        let plan = &policy.plan;
        let slot = lease.slot();
        let failure = match slot.result() {
            Some(Ok(_)) => None,
            Some(Err(e)) => Some(Failure::Inference(e.to_string())),
            None => Some(Failure::Inference("the engine returned no result".into())),
        };
        let failure = failure.or_else(|| {
            let parts = slot.reply_parts(plan.relative_source);
            plan.non_finite_reply(parts.outputs, parts.scratch, parts.raw, self.precision)
                .map(|name| {
                    Failure::Inference(format!(
                        "the engine's output '{name}' holds NaN or infinity as it would be \
                         sent (after un-normalisation and the cast to the reply dtype)"
                    ))
                })
        });
        if let Some(f) = failure {
            if slot.ticket().kind == Kind::Infer {
                self.infer_busy = false;
            }
            drop(lease);
            crate::warn_limited!(
                "inference failed: {}",
                crate::log_limit::Escaped(f.message())
            );
            return Finished::Failed(f);
        }
        match crate::runtime::pacing::release(Instant::now(), slot.ticket().release_at) {
            Release::At(at) => match self.releasing.hold(at, lease) {
                // One entry per slot: cannot be full; if it were, out now.
                Err(lease) => Finished::Now(lease),
                Ok(()) => {
                    self.pacer
                        .wake_at(at - crate::runtime::pacing::WAKE_LEAD, &self.wake);
                    Finished::Held
                }
            },
            Release::Late => {
                self.stats.release.missed();
                Finished::Now(lease)
            }
            Release::Now => Finished::Now(lease),
        }
    }

    /// The next held result whose release time has come, with `paced` for [`release`].
    ///
    /// [`release`]: Self::release
    fn due(&mut self) -> Option<Lease> {
        self.releasing.pop_due()
    }

    /// Waits for the next thing this client must act on: a slot back from the engine (a
    /// result to send, or its failure), a held result's release time, the engine stalling, a
    /// reload. Each wait is cancel-safe, so a front end selects on `next()` beside its socket
    /// and loses nothing when the socket wins.
    pub async fn next(&mut self) -> Event {
        loop {
            if let Some(lease) = self.due() {
                return Event::Release { lease, paced: true };
            }
            // A wake that fires a little early (or not at all) is caught by this backstop.
            let backstop = self.next_release().map(|t| t + Duration::from_millis(2));
            let wake = self.wake.clone();
            tokio::select! {
                lease = self.port.recv(), if self.awaiting() => {
                    // None: already answered with a stall error.
                    let Some(lease) = self.returned(lease) else { continue };
                    match self.finished(lease) {
                        Finished::Failed(f) => return Event::Failed(f),
                        Finished::Held => {}
                        Finished::Now(lease) => return Event::Release { lease, paced: false },
                    }
                }
                _ = wake.notified(), if self.holding() => {}
                _ = sleep_until_opt(backstop), if backstop.is_some() => {}
                changed = self.stalled.changed(), if self.outstanding() > 0 && !self.server_gone => {
                    match changed {
                        Ok(()) if *self.stalled.borrow_and_update() => {
                            return Event::Failed(self.stall());
                        }
                        Ok(()) => {}
                        // The worker is gone (the server is stopping): nothing more to watch.
                        Err(_) => self.server_gone = true,
                    }
                }
                changed = self.generation.changed(), if !self.server_gone => {
                    if changed.is_ok() {
                        return Event::Reloaded;
                    }
                    // The server is gone: no reload will come.
                    self.server_gone = true;
                }
                // Nothing in flight, held or to watch: the front end's other branches decide.
                else => std::future::pending::<()>().await,
            }
        }
    }

    /// Releases a result: records its latency, cuts the chunk and has `encode` write the reply
    /// into the slot's reply buffer, which the returned lease holds until the front end has
    /// sent it. `paced`: it was held for its release time (counted as on time or not).
    pub fn release<E>(&mut self, mut lease: Lease, paced: bool, encode: E) -> Lease
    where
        E: FnOnce(Released<'_, '_, '_>),
    {
        let stats = &self.stats;
        let policy = self.policy.clone();
        let plan = &policy.plan;
        let pacing = &policy.spec.pacing;
        let now = Instant::now();
        let slot = lease.slot();
        let t = slot.ticket().clone();
        if paced && let Some(at) = t.release_at {
            stats.release.on_time(at, now);
        }
        let latency = now.saturating_duration_since(t.received);
        let delay_steps = match self.sessions.pacing(&t.session) {
            Some(p) => {
                p.record_latency(latency.as_secs_f64());
                p.delay_steps(pacing.fps)
            }
            None => crate::runtime::session::delay_steps(latency.as_secs_f64(), pacing.fps),
        };
        let (compute, stages) = match slot.result() {
            Some(Ok(s)) => (s.compute, s.stages),
            _ => (Duration::ZERO, None),
        };
        let metrics = &stats.metrics;
        metrics.replied(self.route, latency);
        metrics.engine.observe(compute.as_secs_f64());
        if let Some(s) = stages {
            metrics.sampler_steps.observe(f64::from(s.steps));
        }
        let crate::runtime::worker::SlotParts {
            outputs,
            scratch,
            reply: buf,
            raw,
        } = slot.reply_parts(plan.relative_source);
        let mut parts = ReplyParts {
            outputs,
            scratch,
            chunk: plan.chunk(pacing, delay_steps),
            raw,
        };
        let mut reply = plan.reply(&mut parts);
        encode(Released {
            kind: t.kind,
            reply: &mut reply,
            ticket: &t,
            delay_steps,
            fps: pacing.fps,
            compute,
            latency,
            stages: stages.map(|s| protocol::StageTimes {
                prefix_ms: s.prefix.as_secs_f64() * 1e3,
                denoise_ms: s.denoise.as_secs_f64() * 1e3,
                steps: s.steps,
            }),
            prev_total_ms: self.prev_total_ms,
            buf,
        });
        // `[rtc]`: the session keeps what it was sent of this chunk, in model space.
        let sent = reply.sent_rows();
        if t.kind == Kind::Observe
            && let Some(r) = plan.rtc
            && let Some(p) = self.sessions.pacing(&t.session)
        {
            p.previous
                .capture(&parts.outputs[r.output], r.width, r.cols, sent, t.timestep);
        }
        if t.kind == Kind::Infer {
            self.infer_busy = false;
            self.prev_total_ms = Some(t.received.elapsed().as_secs_f64() * 1e3);
        }
        lease
    }

    /// Gives back what this client held: its share of the sessions gauge and its entries
    /// waiting in the scheduler (running ones come back to the port, whose drop returns them).
    pub fn close(self) {
        self.stats.metrics.sessions.dec_by(self.counted_sessions);
        self.policy
            .worker
            .scheduler
            .remove_conn(self.id, |job| job.recycle());
    }

    /// The ticket of a request of the current session.
    fn ticket(
        &self,
        kind: Kind,
        received: Instant,
        release_at: Option<Instant>,
        at: TimedStep,
    ) -> Ticket {
        Ticket {
            kind,
            epoch: self.epoch,
            session: self.sessions.current().clone(),
            received,
            release_at,
            timestep: at.timestep,
            timestamp: at.timestamp,
        }
    }

    /// Counts a failure the front end reports.
    pub fn count_error(&self, f: &Failure) {
        self.stats.metrics.error(self.route, f.kind());
    }

    /// The failure every request gets while the engine is stalled.
    fn stall_failure(&self) -> Failure {
        Failure::Inference(format!(
            "the engine has been running one inference for over {} ms (engine.timeout_ms); \
             it may be stuck, so this request was not run",
            self.policy.spec.engine.timeout_ms
        ))
    }

    /// `reset_on_prompt_change`: a session whose prompt differs from its last one starts
    /// afresh, as after `endpoint: reset` (its waiting observations are dropped too).
    fn check_prompt(
        &mut self,
        id: Option<&protocol::SessionId>,
        inputs: &mut [Box<dyn InputBuffer>],
    ) {
        if !self.policy.spec.reset_on_prompt_change {
            return;
        }
        let hash = self.policy.plan.prompt_hash(inputs);
        if self.sessions.prompt_changed(id, hash) {
            self.drop_waiting();
            log::debug!(
                "session {}: new prompt, session reset",
                self.sessions.current()
            );
        }
    }

    /// Counts a truncated prompt, and says so once per session (openpi logs every one).
    fn tokenized(&self, policy: &Policy, t: crate::bind::Tokenized) {
        let metrics = &self.stats.metrics;
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
            crate::warn_limited!(
                "session {}: the prompt is {n} tokens, truncated to {} (tokenizer.max_tokens; \
                 said once per session)",
                self.sessions.current(),
                max.map_or(0, |t| t.max_tokens)
            );
        }
    }

    /// Drops the current session's observations still waiting for the engine (a reset).
    fn drop_waiting(&mut self) {
        let key = self.key(self.sessions.current().clone());
        let mut dropped = 0;
        self.policy.worker.scheduler.remove_session(&key, |job| {
            dropped += 1;
            job.recycle();
        });
        self.outstanding -= dropped;
    }

    /// Brings the sessions gauge in line with this client's table.
    fn count_sessions(&mut self) {
        let now = self.sessions.len() as i64;
        if now != self.counted_sessions {
            self.stats
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

    /// Counts a skipped observation; the front end tells the client if `report`.
    fn skipped(&self, timestep: i64, why: SkipReason) -> Started {
        self.stats.skips.count(why);
        Started::Skipped {
            timestep,
            why,
            report: self.policy.spec.pacing.report_skipped,
        }
    }
}

fn not_running() -> Failure {
    Failure::Inference("the engine worker is not running".into())
}

/// The planner's link, for a policy whose bindings it fits (only the default policy's plan
/// has a planner tap).
fn planner_for(cx: &Context, policy: &Policy) -> Option<Arc<Link>> {
    let link = cx.planner.as_ref()?;
    let tap = policy.plan.planner.as_ref()?;
    tap.fits(link).then(|| link.clone())
}

/// Sleeps until `deadline`, or forever without one (a `select!` branch that is off).
pub async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d.into()).await,
        None => std::future::pending().await,
    }
}

/// The core without a socket: a request decoded by a made-up front end, through the synthetic
/// engine, to its released reply.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::dtype::ElemType;
    use crate::engine::{IoSpec, TensorSpec};
    use crate::testing::synthetic::{Behaviour, SyntheticEngine};

    fn served(pacing: &str) -> (Context, Arc<Policy>) {
        served_with(pacing, watch::channel(0).1)
    }

    fn served_with(pacing: &str, generation: watch::Receiver<u64>) -> (Context, Arc<Policy>) {
        let text = format!(
            "[server]\nhost = \"127.0.0.1\"\nport = 0\n\
             [engine]\nmodel = \"synthetic\"\nwarmup_runs = 0\nslots = 4\n\
             [pacing]\n{pacing}\n\
             [[inputs]]\nkey = \"state\"\ntensor = \"state\"\ndtypes = [\"float32\"]\nshape = [2]\n\
             [[outputs]]\ntensor = \"actions\"\n"
        );
        let cfg = Config::parse(&text, "test", None).expect("config");
        let io = IoSpec {
            inputs: vec![TensorSpec {
                name: "state".into(),
                dtype: ElemType::F32,
                shape: vec![1, 2],
            }],
            outputs: vec![TensorSpec {
                name: "actions".into(),
                dtype: ElemType::F32,
                shape: vec![1, 4, 2],
            }],
        };
        let engine = Box::new(SyntheticEngine::new(io, Behaviour::default()));
        let spec = cfg.default_policy().clone();
        let loaded = crate::policy::build::load_engine(&cfg, &spec, engine).expect("loads");
        let cx = Context {
            stats: loaded.stats.clone(),
            pacer: Arc::new(Pacer::start(Duration::ZERO).expect("pacer")),
            planner: None,
            max_sessions: 4,
            generation,
        };
        (cx, Arc::new(Policy::new(&cfg, spec, loaded)))
    }

    /// Starts a request whose state is `[x, 0]`, as a front end's decoder would write it.
    fn start(core: &mut Core, endpoint: Endpoint, x: f32, timestep: i64) -> Started {
        let lease = core
            .policy()
            .worker
            .pool
            .try_acquire()
            .expect("a free slot");
        core.start(
            Instant::now(),
            lease,
            ResetScope::Session,
            |_, inputs, seen, _| {
                let b = inputs[0].bytes_mut();
                b[..4].copy_from_slice(&x.to_le_bytes());
                b[4..8].fill(0);
                seen[0] = true;
                Ok(RequestMeta {
                    endpoint,
                    timestep: Some(timestep),
                    timestamp: Some(timestep as f64 / 10.0),
                    ..RequestMeta::default()
                })
            },
        )
    }

    /// Waits for the core's next event, releases its result, and returns the reply's first
    /// action value.
    async fn reply(core: &mut Core) -> (Kind, f32) {
        let event = tokio::time::timeout(Duration::from_secs(10), core.next())
            .await
            .expect("the engine's reply within 10 s");
        let Event::Release { lease, .. } = event else {
            panic!("a result to release");
        };
        let mut got = None;
        drop(core.release(lease, false, |r| {
            let (rows, _) = r.reply.rows_f32(0, usize::MAX).expect("f32 rows");
            let first = f32::from_le_bytes(rows[..4].try_into().expect("4 bytes"));
            got = Some((r.kind, first));
        }));
        got.expect("encoded")
    }

    #[tokio::test]
    async fn an_infer_request_runs_and_is_released() {
        let (cx, policy) = served("");
        let mut core = Core::new(&cx, policy, 1, Route::Openpi, Precision::Float32);
        assert!(matches!(
            start(&mut core, Endpoint::Infer, 3.0, 0),
            Started::Queued
        ));
        assert!(core.infer_busy() && !core.idle());
        assert_eq!(reply(&mut core).await, (Kind::Infer, 3.0));
        assert!(core.idle() && !core.infer_busy());
        core.close();
    }

    #[tokio::test]
    async fn observations_run_once_per_timestep() {
        let (cx, policy) = served("");
        let mut core = Core::new(&cx, policy, 1, Route::Openpi, Precision::Float32);
        assert!(matches!(
            start(&mut core, Endpoint::Observe, 1.0, 0),
            Started::Queued
        ));
        assert_eq!(reply(&mut core).await, (Kind::Observe, 1.0));
        // The same timestep again: predicted already, never queued.
        assert!(matches!(
            start(&mut core, Endpoint::Observe, 9.0, 0),
            Started::Skipped {
                why: SkipReason::AlreadyPredicted,
                ..
            }
        ));
        assert!(core.idle());
        assert!(matches!(
            start(&mut core, Endpoint::Observe, 5.0, 10),
            Started::Queued
        ));
        assert_eq!(reply(&mut core).await, (Kind::Observe, 5.0));
        assert_eq!(cx.stats.skips.observed.load(Ordering::Relaxed), 3);
        assert_eq!(cx.stats.skips.already_predicted.load(Ordering::Relaxed), 1);
        core.close();
    }

    #[tokio::test]
    async fn a_reload_is_an_event_and_the_server_going_is_not() {
        let (tx, rx) = watch::channel(0);
        let (cx, policy) = served_with("", rx);
        let mut core = Core::new(&cx, policy, 1, Route::Openpi, Precision::Float32);
        tx.send_replace(1);
        let event = tokio::time::timeout(Duration::from_secs(5), core.next()).await;
        assert!(matches!(event, Ok(Event::Reloaded)));
        // The generation's sender gone: next() waits (for requests), it does not spin.
        drop(tx);
        let waited = tokio::time::timeout(Duration::from_millis(50), core.next()).await;
        assert!(waited.is_err(), "nothing to wait for");
        assert!(matches!(
            start(&mut core, Endpoint::Infer, 2.0, 0),
            Started::Queued
        ));
        assert_eq!(reply(&mut core).await, (Kind::Infer, 2.0));
        core.close();
    }
}
