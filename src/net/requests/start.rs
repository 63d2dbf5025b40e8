//! A request's way in: decoded into a slot, its run prepared (session, filters, sampling seed,
//! prompt tokens, `[rtc]`'s leftover), started as an `infer` or an `observe`, and queued for
//! the engine.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::{Core, Started, not_running};
use crate::bind::Plan;
use crate::engine::InputBuffer;
use crate::planner::Link;
use crate::policy::Policy;
use crate::protocol::dialect::ResetScope;
use crate::protocol::{self, Endpoint, Failure, RequestMeta, TimedStep, WireError};
use crate::runtime::scheduler::{Kind, SessionKey, SkipReason};
use crate::runtime::worker::{Lease, Ticket};

impl Core {
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
    pub(super) fn decoded(
        &self,
        decoded: Result<RequestMeta, WireError>,
    ) -> Result<RequestMeta, Started> {
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
    pub(super) fn prepare_run(
        &mut self,
        meta: &RequestMeta,
        lease: &mut Lease,
    ) -> Result<(), Started> {
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
    pub(super) fn reset(&mut self, meta: &RequestMeta, scope: ResetScope) -> Started {
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
    pub(super) fn start_infer(
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
    pub(super) fn start_observe(
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
    pub(super) fn queue(&mut self, lease: Lease) -> Result<Option<Lease>, Started> {
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
    pub(super) fn continuation(
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

    /// The ticket of a request of the current session.
    pub(super) fn ticket(
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

    /// `reset_on_prompt_change`: a session whose prompt differs from its last one starts
    /// afresh, as after `endpoint: reset` (its waiting observations are dropped too).
    pub(super) fn check_prompt(
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
    pub(super) fn tokenized(&self, policy: &Policy, t: crate::bind::Tokenized) {
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

    pub(super) fn key(&self, session: protocol::SessionId) -> SessionKey {
        SessionKey {
            conn: self.id,
            session,
        }
    }

    /// Counts a skipped observation; the front end tells the client if `report`.
    pub(super) fn skipped(&self, timestep: i64, why: SkipReason) -> Started {
        self.stats.skips.count(why);
        Started::Skipped {
            timestep,
            why,
            report: self.policy.spec.pacing.report_skipped,
        }
    }
}
