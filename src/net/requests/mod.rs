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

mod release;
mod start;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{Notify, watch};

use crate::bind::Reply;
use crate::metrics::Stats;
use crate::planner::Link;
use crate::policy::{Policy, PolicySet};
use crate::protocol::dialect::Precision;
use crate::protocol::{self, Failure, PolicyName, Route, WireError};
use crate::runtime::pacing::{Pacer, ReleaseQueue};
use crate::runtime::scheduler::{Kind, SkipReason};
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
    /// A reload replaced or removed the policy this core serves (decided here, once, for
    /// both front ends: [`Core::reload`]); the front end moves or closes once it is idle.
    Reloaded(Reload),
}

/// What a reload did to the policy a core serves.
#[derive(Clone)]
pub enum Reload {
    /// A new engine or config under the same name: the client moves to it, with fresh sessions.
    Replaced(Arc<Policy>),
    /// No policy by that name is served any more.
    Removed,
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
    /// The policies served now, which a reload swaps.
    pub policies: Arc<arc_swap::ArcSwap<PolicySet>>,
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
    /// The served set, read when the generation moves ([`Core::reload`]).
    policies: Arc<arc_swap::ArcSwap<PolicySet>>,
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
            policies: cx.policies.clone(),
            server_gone: false,
            policy,
        }
    }

    pub fn policy(&self) -> &Arc<Policy> {
        &self.policy
    }

    /// What the served set now does to this core's policy, by the one rule both front ends
    /// follow: the same engine under its name is no change, another is a replacement, none is
    /// a removal.
    pub fn reload(&self) -> Option<Reload> {
        let set = self.policies.load();
        match set.get(&self.policy.name) {
            Some(p) if Arc::ptr_eq(p, &self.policy) => None,
            Some(p) => Some(Reload::Replaced(p.clone())),
            None => Some(Reload::Removed),
        }
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
                        // A reload that kept this policy (same engine) is nothing to this
                        // client.
                        if let Some(r) = self.reload() {
                            return Event::Reloaded(r);
                        }
                        continue;
                    }
                    // The server is gone: no reload will come.
                    self.server_gone = true;
                }
                // Nothing in flight, held or to watch: the front end's other branches decide.
                else => std::future::pending::<()>().await,
            }
        }
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

    /// Counts a failure the front end reports.
    pub fn count_error(&self, f: &Failure) {
        self.stats.metrics.error(self.route, f.kind());
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
mod tests;
