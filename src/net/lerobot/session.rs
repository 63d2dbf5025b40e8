//! LeRobot's one session, owned by the session task: the policy a client set up, its request
//! core, the chunk waiting for a poll, and who owns it ([`super::owner`]). The RPC handlers
//! ([`super::service`]) send it [`Command`]s over a bounded channel; it answers each and
//! releases chunks as the pacing scheduler lets them go.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};
use tonic::Status;

use super::Reason;
use super::owner::{self, Change, Owner};
use crate::bind::lerobot::Adapter;
use crate::config::LerobotConfig;
use crate::net::grpc_conn::ConnInfo;
use crate::net::requests::{Core, Event, Reload, Started};
use crate::net::shared::Shared;
use crate::policy::{Policy, PolicySet};
use crate::protocol::dialect::{Precision, ResetScope};
use crate::protocol::lerobot::{ClientFormat, PolicySetup};
use crate::protocol::{Failure, Route, WireError, clip};
use crate::runtime::worker::Lease;

/// An observation the session refused, and why.
pub(super) struct Refusal {
    pub reason: Reason,
    pub status: Status,
}

impl Refusal {
    fn new(reason: Reason, status: Status) -> Refusal {
        Refusal { reason, status }
    }
}

/// What the RPC handlers ask of the session task; each names the connection it came by.
pub(super) enum Command {
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
        format: Box<ClientFormat>,
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

/// Checks a client's setup against the served policies: the one it names (by
/// `[[lerobot.serve]]` or by name), its features against the bindings, its chunk length.
pub(super) fn for_setup(
    cfg: &LerobotConfig,
    set: &PolicySet,
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
    Ok((policy.clone(), adapter(cfg, policy, setup)?))
}

/// The adapter between a client's setup and a policy's bindings: the one constructor for a new
/// setup and for the same setup after a reload.
fn adapter(cfg: &LerobotConfig, policy: &Policy, setup: &PolicySetup) -> Result<Adapter, String> {
    Adapter::new(
        cfg.resize,
        cfg.max_payload_bytes,
        &policy.plan,
        &policy.name,
        setup,
    )
}

/// The session's state while a policy is set up: the client's setup and payload format
/// outlive the adapter that binds them to the policy (a reload rebuilds the adapter only).
struct Active {
    core: Core,
    adapter: Box<Adapter>,
    setup: Box<PolicySetup>,
    format: Box<ClientFormat>,
}

impl Active {
    fn new(
        shared: &Shared,
        policy: Arc<Policy>,
        adapter: Box<Adapter>,
        (setup, format): (Box<PolicySetup>, Box<ClientFormat>),
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
            format,
        }
    }
}

/// The service's one session, owned by the session task: the policy set up (if any) and the
/// desk where chunks wait for polls.
struct Session {
    shared: Arc<Shared>,
    active: Option<Active>,
    desk: Desk,
    /// A reload came: the session moves to the new policy once nothing is in flight.
    replaced: bool,
}

/// The session task: answers the handlers' commands and releases chunks.
pub(super) async fn run(shared: Arc<Shared>, mut rx: mpsc::Receiver<Command>) {
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
        active: None,
        desk: Desk {
            ready: None,
            waiter: None,
            owner: Owner::new(rule),
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
        // Asked again now that the session is idle: a later reload may have undone the first.
        let current = match a.core.reload() {
            None => return,
            Some(Reload::Replaced(p)) => Some(p),
            Some(Reload::Removed) => None,
        };
        let next = current.and_then(|p| {
            let l = self.shared.cfg.lerobot.as_ref()?;
            adapter(l, &p, &a.setup)
                .map_err(|e| log::warn!("lerobot: after the reload: {e}"))
                .ok()
                .map(|ad| (p, ad))
        });
        let Some(old) = self.active.take() else {
            return;
        };
        let client = (old.setup, old.format);
        old.core.close();
        match next {
            Some((p, adapter)) => {
                log::info!(
                    "lerobot: policy \"{}\" reloaded; the session starts afresh",
                    p.name
                );
                self.active = Some(Active::new(&self.shared, p, Box::new(adapter), client));
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
            Event::Reloaded(_) => self.replaced = true,
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
                format,
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
                        a.format = format;
                    }
                    _ => {
                        if let Some(old) = self.active.take() {
                            old.core.close();
                        }
                        self.active =
                            Some(Active::new(&self.shared, policy, adapter, (setup, format)));
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
                    Err(status) => Err(Refusal::new(Reason::Owner, status)),
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
                Reason::Setup,
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
        let (adapter, format) = (&mut a.adapter, &mut a.format);
        let started = a.core.start(
            received,
            lease,
            ResetScope::Connection,
            |plan, inputs, seen, _| adapter.decode(format, payload, plan, inputs, seen),
        );
        let (reason, failure) = match started {
            Started::Undecodable(e @ WireError::Lerobot(_)) => {
                (Reason::Unreadable, Failure::Request(e.to_string()))
            }
            Started::Undecodable(e) => (Reason::Observation, Failure::Request(e.to_string())),
            Started::Failed(f) => (Reason::Observation, f),
            Started::Queued
            | Started::Reset
            | Started::Skipped { .. }
            | Started::OtherPolicy(_) => return Ok(()),
        };
        a.core.count_error(&failure);
        Err(Refusal::new(
            reason,
            Status::invalid_argument(failure.message().to_string()),
        ))
    }
    /// Encodes a released chunk as the client's `list[TimedAction]` and hands it to the
    /// waiting poll, or keeps it for the next one.
    fn deliver(&mut self, lease: Lease, paced: bool) {
        let Some(a) = &mut self.active else {
            return;
        };
        let (output, apc, format) = (
            a.adapter.action_output(),
            a.adapter.actions_per_chunk(),
            &a.format,
        );
        let mut ok = true;
        let lease = a.core.release(lease, paced, |r| {
            let first = r.reply.first_row();
            let dt = 1.0 / r.fps;
            let at = r.ticket.at();
            match r.reply.rows_f32(output, apc.max(first + 1)) {
                Some((rows, row)) if row > 0 => {
                    format.encode_actions(rows.chunks_exact(row), at, first, dt, r.buf)
                }
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
/// wins), the poll waiting for one, and who owns the session.
struct Desk {
    ready: Option<Vec<u8>>,
    waiter: Option<oneshot::Sender<Result<Vec<u8>, Status>>>,
    owner: Owner,
}

/// Whether a call from `from` may act on the session ([`Owner::claim`]).
fn claim(desk: &Desk, from: &ConnInfo, sets_up: bool) -> Result<owner::Claim, Status> {
    desk.owner.claim(from, sets_up)
}

/// Records `from` as the session's owner after a successful [`claim`]; a takeover ends the
/// previous owner's waiting poll with "none" and does not hand on its chunk.
fn own(desk: &mut Desk, from: &ConnInfo, claim: &owner::Claim) {
    if desk.owner.own(from, claim) == Change::TookOver {
        desk.waiter = None;
        desk.ready = None;
    }
}
