//! Who may act on LeRobot's one session? The rule as pure code: what the session knows of its
//! owner and of the caller in, a verdict out ([`Rule::decide`]); and [`Owner`], which applies it
//! to the connection a call came by and records who owns the session after it.
//!
//! - The owner's own connection may always act.
//! - From the owner's address, a poll or observation from a new connection carries the session
//!   on (a reconnect) once the owner has closed or fallen silent; and a new `Ready` or setup
//!   wins over any connection that only adopted the session that way: a poller on the robot's
//!   host cannot keep the robot that comes back from its session. While the connection that
//!   set the session up is active, even its own address waits (two clients on one host).
//! - From any other address, nothing while the owner is connected and active; after it has
//!   closed or fallen silent (`lerobot.takeover_after_s`), only a `Ready` or setup, and only
//!   once `lerobot.owner_grace_s` has passed since the owner's last call: the robot that comes
//!   back within the grace gets its session back, whoever called in between.

use std::sync::Arc;
use std::time::Duration;

use tonic::Status;

use crate::net::grpc_conn::ConnInfo;
use crate::net::peers::canonical;

/// What the session knows of its owner, seen from one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seen {
    /// The call came by the owner's own connection.
    pub same_connection: bool,
    /// The call came from the owner's address.
    pub same_address: bool,
    /// The owner's connection has closed.
    pub owner_closed: bool,
    /// The owner's connection adopted the session by a poll or observation (a reconnect);
    /// it did not set it up.
    pub owner_adopted: bool,
    /// Since the owner's last call ended; `None` while one is in progress.
    pub owner_quiet: Option<Duration>,
}

/// The rule's two durations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rule {
    /// `lerobot.takeover_after_s`: an owner silent this long counts as gone.
    pub takeover_after: Duration,
    /// `lerobot.owner_grace_s`: after the owner's last call, only its address may claim.
    pub grace: Duration,
}

/// How a permitted call stands to the session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// The owner's own connection (or no session yet, for a call that sets none up).
    Owner,
    /// A new connection from the owner's address carries the session on.
    Reconnect,
    /// `Ready` or a setup: the caller becomes the owner of a new session.
    Takeover,
}

/// Why a call was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Denied {
    /// The owner is connected and has made a call within `takeover_after`.
    OwnerActive,
    /// The owner is gone, but its address may still claim for this long.
    Reserved(Duration),
    /// A poll or observation from another address: it has no session here.
    NotYours,
}

impl Rule {
    /// The verdict for a call (`sets_up`: `Ready` or a setup) on a session whose owner is
    /// `owner` (`None`: no session yet).
    pub fn decide(&self, owner: Option<Seen>, sets_up: bool) -> Result<Claim, Denied> {
        let Some(o) = owner else {
            return Ok(if sets_up {
                Claim::Takeover
            } else {
                Claim::Owner
            });
        };
        if o.same_connection {
            return Ok(Claim::Owner);
        }
        let silent = o.owner_quiet.is_some_and(|q| q >= self.takeover_after);
        let gone = o.owner_closed || silent;
        if o.same_address {
            return match (sets_up, gone || o.owner_adopted) {
                (true, true) => Ok(Claim::Takeover),
                (false, _) if gone => Ok(Claim::Reconnect),
                _ => Err(Denied::OwnerActive),
            };
        }
        if !gone {
            return Err(Denied::OwnerActive);
        }
        if !sets_up {
            return Err(Denied::NotYours);
        }
        match o.owner_quiet {
            Some(q) if q >= self.grace => Ok(Claim::Takeover),
            Some(q) => Err(Denied::Reserved(self.grace - q)),
            None => Err(Denied::OwnerActive),
        }
    }
}

impl Denied {
    /// The refusal's message for the client, naming the keys that decide it.
    pub fn message(&self, rule: &Rule) -> String {
        match self {
            Denied::OwnerActive => format!(
                "the session belongs to another client, which is connected and active; another \
                 address can take it over once that client has disconnected or been silent for \
                 lerobot.takeover_after_s = {} s and lerobot.owner_grace_s = {} s have passed",
                rule.takeover_after.as_secs_f64(),
                rule.grace.as_secs_f64()
            ),
            Denied::Reserved(left) => format!(
                "the session's owner left {:.1} s ago; its address may claim it back for \
                 {:.1} s more (lerobot.owner_grace_s = {} s)",
                (rule.grace - *left).as_secs_f64(),
                left.as_secs_f64(),
                rule.grace.as_secs_f64()
            ),
            Denied::NotYours => "the session belongs to another client; call Ready and \
                                 SendPolicyInstructions to start a session of your own"
                .to_string(),
        }
    }
}

/// The session's owner: the connection that set it up (or adopted it), and the rule.
pub struct Owner {
    conn: Option<ConnInfo>,
    /// The owner adopted the session by a poll or observation ([`Claim::Reconnect`]).
    adopted: bool,
    rule: Rule,
}

/// What [`Owner::own`] changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// The caller was the owner already, or now carries its own session on.
    Kept,
    /// Another connection's session was taken over: its waiting poll and chunk go.
    TookOver,
}

impl Owner {
    pub fn new(rule: Rule) -> Owner {
        Owner {
            conn: None,
            adopted: false,
            rule,
        }
    }

    /// Whether a call from `from` may act on the session, and how: [`Rule::decide`] applied
    /// to what is known of the owner. While the owner's connection is open and has made a
    /// call within `takeover_after`, no other connection may: the safety rule that keeps one
    /// peer from steering another's robot; and the owner's address may claim its session back
    /// first.
    pub fn claim(&self, from: &ConnInfo, sets_up: bool) -> Result<Claim, Status> {
        let seen = self.conn.as_ref().map(|o| Seen {
            same_connection: Arc::ptr_eq(&o.activity, &from.activity),
            same_address: canonical(o.peer.ip()) == canonical(from.peer.ip()),
            owner_closed: o.activity.closed(),
            owner_adopted: self.adopted,
            owner_quiet: o.activity.idle_for(),
        });
        self.rule
            .decide(seen, sets_up)
            .map_err(|d| Status::permission_denied(d.message(&self.rule)))
    }

    /// Records `from` as the session's owner after a successful [`Owner::claim`].
    pub fn own(&mut self, from: &ConnInfo, claim: &Claim) -> Change {
        match claim {
            Claim::Owner => Change::Kept,
            Claim::Reconnect => {
                crate::log_limited!(
                    log::Level::Info,
                    "lerobot: {} reconnected; its session carries on",
                    from.peer
                );
                self.conn = Some(from.clone());
                self.adopted = true;
                Change::Kept
            }
            Claim::Takeover => {
                if let Some(old) = &self.conn {
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
                self.conn = Some(from.clone());
                self.adopted = false;
                Change::TookOver
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULE: Rule = Rule {
        takeover_after: Duration::from_secs(10),
        grace: Duration::from_secs(60),
    };

    fn seen(same_connection: bool, same_address: bool, closed: bool, quiet: Option<u64>) -> Seen {
        Seen {
            same_connection,
            same_address,
            owner_closed: closed,
            owner_adopted: false,
            owner_quiet: quiet.map(Duration::from_secs),
        }
    }

    fn adopted(s: Seen) -> Seen {
        Seen {
            owner_adopted: true,
            ..s
        }
    }

    #[test]
    fn with_no_session_a_setup_takes_it_and_a_poll_is_nobodys() {
        assert_eq!(RULE.decide(None, true), Ok(Claim::Takeover));
        assert_eq!(RULE.decide(None, false), Ok(Claim::Owner));
    }

    #[test]
    fn the_owners_own_connection_always_acts() {
        for sets_up in [true, false] {
            let o = seen(true, true, false, None);
            assert_eq!(RULE.decide(Some(o), sets_up), Ok(Claim::Owner));
        }
    }

    #[test]
    fn another_address_waits_for_the_owner_to_go_and_for_the_grace() {
        // Connected and active (a call in progress, or one 5 s ago).
        for quiet in [None, Some(5)] {
            let o = seen(false, false, false, quiet);
            assert_eq!(RULE.decide(Some(o), true), Err(Denied::OwnerActive));
        }
        // Closed 5 s ago: reserved for 55 s more; polls are never another address's.
        let left = seen(false, false, true, Some(5));
        assert_eq!(
            RULE.decide(Some(left), true),
            Err(Denied::Reserved(Duration::from_secs(55)))
        );
        assert_eq!(RULE.decide(Some(left), false), Err(Denied::NotYours));
        // Silent 30 s while connected: gone, still within the grace.
        let silent = seen(false, false, false, Some(30));
        assert!(matches!(
            RULE.decide(Some(silent), true),
            Err(Denied::Reserved(_))
        ));
        // Past the grace: a Ready or setup takes over; a poll still does not.
        let long_gone = seen(false, false, true, Some(60));
        assert_eq!(RULE.decide(Some(long_gone), true), Ok(Claim::Takeover));
        assert_eq!(RULE.decide(Some(long_gone), false), Err(Denied::NotYours));
    }

    #[test]
    fn a_ready_from_the_owners_address_wins_over_a_poller_and_a_gone_owner() {
        // Over an active poller of the same address (a squat by adoption), over a closed or a
        // silent connection: the robot gets its session back at once.
        for o in [
            adopted(seen(false, true, false, None)),
            adopted(seen(false, true, false, Some(1))),
            seen(false, true, true, Some(0)),
            seen(false, true, false, Some(10)),
        ] {
            assert_eq!(RULE.decide(Some(o), true), Ok(Claim::Takeover), "{o:?}");
        }
        // Not over the connection that set the session up while it is active.
        let active = seen(false, true, false, Some(1));
        assert_eq!(RULE.decide(Some(active), true), Err(Denied::OwnerActive));
    }

    #[test]
    fn a_poll_from_the_owners_address_reconnects_only_once_the_owner_is_gone() {
        let active = seen(false, true, false, Some(1));
        assert_eq!(RULE.decide(Some(active), false), Err(Denied::OwnerActive));
        let closed = seen(false, true, true, Some(0));
        assert_eq!(RULE.decide(Some(closed), false), Ok(Claim::Reconnect));
        let silent = seen(false, true, false, Some(10));
        assert_eq!(RULE.decide(Some(silent), false), Ok(Claim::Reconnect));
    }

    #[test]
    fn the_messages_name_the_keys() {
        assert!(
            Denied::OwnerActive
                .message(&RULE)
                .contains("lerobot.takeover_after_s")
        );
        assert!(
            Denied::Reserved(Duration::from_secs(5))
                .message(&RULE)
                .contains("lerobot.owner_grace_s")
        );
    }
}
