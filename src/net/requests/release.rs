//! A request's way out: a slot back from the engine (or stalled), held until its release
//! time, then cut and encoded by the front end.

use std::time::{Duration, Instant};

use super::{Core, Finished, Released};
use crate::bind::ReplyParts;
use crate::protocol::{self, Failure};
use crate::runtime::pacing::Release;
use crate::runtime::scheduler::Kind;
use crate::runtime::worker::Lease;

impl Core {
    /// A slot came back through the port: `None` if it belongs to requests already answered
    /// by a stall error (dropped), else the slot to hand to [`finished`](Self::finished).
    pub(super) fn returned(&mut self, lease: Lease) -> Option<Lease> {
        if lease.peek().ticket().epoch != self.epoch {
            self.abandoned = self.abandoned.saturating_sub(1);
            return None;
        }
        self.outstanding -= 1;
        Some(lease)
    }

    /// The engine has run past `engine.timeout_ms`: every request in flight is answered with
    /// the returned failure now, and their slots are dropped when they come back.
    pub(super) fn stall(&mut self) -> Failure {
        self.epoch += 1;
        self.abandoned += self.outstanding;
        self.outstanding = 0;
        self.infer_busy = false;
        self.stall_failure()
    }

    /// A finished slot: a failure to report, or its result to release now or at its time.
    pub(super) fn finished(&mut self, mut lease: Lease) -> Finished {
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
    pub(super) fn due(&mut self) -> Option<Lease> {
        self.releasing.pop_due()
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

    /// The failure every request gets while the engine is stalled.
    pub(super) fn stall_failure(&self) -> Failure {
        Failure::Inference(format!(
            "the engine has been running one inference for over {} ms (engine.timeout_ms); \
             it may be stuck, so this request was not run",
            self.policy.spec.engine.timeout_ms
        ))
    }

    /// Drops the current session's observations still waiting for the engine (a reset).
    pub(super) fn drop_waiting(&mut self) {
        let key = self.key(self.sessions.current().clone());
        let mut dropped = 0;
        self.policy.worker.scheduler.remove_session(&key, |job| {
            dropped += 1;
            job.recycle();
        });
        self.outstanding -= dropped;
    }
}
