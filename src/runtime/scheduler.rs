//! What does the engine run next, and which observations does it never need to see?
//!
//! [`Queue`] is the work waiting for the engine, shared by all connections; plain logic with
//! time passed in, so it is unit-tested with made-up instants. Each session holds at most one
//! waiting entry. An `observe` entry is a **latest-wins slot**: a newer observation of the same
//! session takes its place (and its place in line) before it starts. Dispatch is
//! first-come-first-served *by session*: the session whose entry has waited longest runs next.
//! Since a session cannot queue a second entry and a replacement keeps the older position, a
//! client that streams fast cannot push others back, and a slow one is never starved. With one
//! latency budget for everyone, waiting longest is also earliest-deadline-first, which is what
//! keeps paced replies on time. Which observations are never queued at all is each session's
//! call ([`crate::runtime::session::SessionPacing`]); why, is [`SkipReason`].
//!
//! [`Scheduler`] wraps the queue in a mutex and condvar for the engine worker thread to pull
//! from. Everything here is fixed-capacity; nothing allocates after start-up.

use std::sync::{Condvar, Mutex};

use crate::limits::MAX_SLOTS;
use crate::protocol::SessionId;

/// Who an entry belongs to: a connection and one of its sessions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionKey {
    pub conn: u64,
    pub session: SessionId,
}

/// How a queued entry may be treated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `infer`: a request that must be answered; never replaced.
    Infer,
    /// `observe`: replaced by a newer observation of its session until it starts.
    Observe,
}

#[derive(Debug)]
struct Entry<T> {
    key: SessionKey,
    kind: Kind,
    item: T,
}

/// What [`Queue::push`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Pushed<T> {
    /// Queued behind the sessions already waiting.
    Queued,
    /// Took the place of the session's waiting observation, which is handed back.
    Replaced(T),
}

/// The work waiting for the engine (see the module docs for the dispatch policy).
#[derive(Debug)]
pub struct Queue<T> {
    entries: heapless::Deque<Entry<T>, MAX_SLOTS>,
}

impl<T> Default for Queue<T> {
    fn default() -> Self {
        Queue {
            entries: heapless::Deque::new(),
        }
    }
}

impl<T> Queue<T> {
    /// Queues `item` for `key`. An `observe` item replaces the session's waiting `observe`
    /// entry in place. Fails (handing `item` back) only if the queue is full, which cannot
    /// happen when every item owns one of at most [`MAX_SLOTS`] slots.
    pub fn push(&mut self, key: SessionKey, kind: Kind, item: T) -> Result<Pushed<T>, T> {
        if kind == Kind::Observe
            && let Some(e) = self
                .entries
                .iter_mut()
                .find(|e| e.kind == Kind::Observe && e.key == key)
        {
            return Ok(Pushed::Replaced(std::mem::replace(&mut e.item, item)));
        }
        self.entries
            .push_back(Entry { key, kind, item })
            .map(|()| Pushed::Queued)
            .map_err(|e| e.item)
    }

    /// The next entry to run: the one whose session has waited longest.
    pub fn pop(&mut self) -> Option<T> {
        self.entries.pop_front().map(|e| e.item)
    }

    /// Removes every entry of connection `conn` (it closed), handing each to `f`.
    pub fn remove_conn(&mut self, conn: u64, f: impl FnMut(T)) {
        self.remove_where(|k| k.conn == conn, f);
    }

    /// Removes every waiting entry whose key matches, handing each to `f`, in order.
    pub fn remove_where(&mut self, pred: impl Fn(&SessionKey) -> bool, mut f: impl FnMut(T)) {
        for _ in 0..self.entries.len() {
            if let Some(e) = self.entries.pop_front() {
                if pred(&e.key) {
                    f(e.item);
                } else {
                    let _ = self.entries.push_back(e);
                }
            }
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// The scheduler was stopped and has nothing left.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stopped;

/// The queue shared by connections (which push) and the engine worker (which pulls).
pub struct Scheduler<T> {
    state: Mutex<(Queue<T>, bool)>,
    ready: Condvar,
}

impl<T> Default for Scheduler<T> {
    fn default() -> Self {
        Scheduler {
            state: Mutex::new((Queue::default(), false)),
            ready: Condvar::new(),
        }
    }
}

impl<T> Scheduler<T> {
    pub fn push(&self, key: SessionKey, kind: Kind, item: T) -> Result<Pushed<T>, T> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.1 {
            return Err(item);
        }
        let r = s.0.push(key, kind, item);
        drop(s);
        self.ready.notify_one();
        r
    }

    /// Waits up to `timeout` for work: `Ok(None)` on timeout (so an idle worker can prove it
    /// is alive), `Err(Stopped)` once stopped and drained.
    pub fn pop_timeout(&self, timeout: std::time::Duration) -> Result<Option<T>, Stopped> {
        let deadline = std::time::Instant::now() + timeout;
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(item) = s.0.pop() {
                return Ok(Some(item));
            }
            if s.1 {
                return Err(Stopped);
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            s = self
                .ready
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Takes back a closed connection's waiting entries.
    pub fn remove_conn(&self, conn: u64, f: impl FnMut(T)) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.0.remove_conn(conn, f);
    }

    /// Takes back one session's waiting entries (its `reset`).
    pub fn remove_session(&self, key: &SessionKey, f: impl FnMut(T)) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.0.remove_where(|k| k == key, f);
    }

    /// Refuses new work; the worker finishes what is queued, then `pop_timeout` says stopped.
    pub fn stop(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).1 = true;
        self.ready.notify_all();
    }

    pub fn len(&self) -> usize {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Why an observation does not reach the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SkipReason {
    /// Its timestep was already predicted, or is being predicted.
    AlreadyPredicted,
    /// Its state is within `pacing.similarity_atol` of the last accepted one.
    Similar,
    /// A newer observation of the same session took its place before it started.
    Superseded,
}

impl SkipReason {
    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::AlreadyPredicted => "already_predicted",
            SkipReason::Similar => "similar",
            SkipReason::Superseded => "superseded",
        }
    }
}

/// Counts of `observe` observations that did not reach the engine, by reason.
#[derive(Debug, Default)]
pub struct SkipStats {
    pub observed: std::sync::atomic::AtomicU64,
    pub already_predicted: std::sync::atomic::AtomicU64,
    pub similar: std::sync::atomic::AtomicU64,
    pub superseded: std::sync::atomic::AtomicU64,
}

impl SkipStats {
    pub fn count(&self, why: SkipReason) {
        use std::sync::atomic::Ordering::Relaxed;
        match why {
            SkipReason::AlreadyPredicted => self.already_predicted.fetch_add(1, Relaxed),
            SkipReason::Similar => self.similar.fetch_add(1, Relaxed),
            SkipReason::Superseded => self.superseded.fetch_add(1, Relaxed),
        };
    }
}

#[cfg(test)]
use crate::protocol::{TimedStep, timed_step};

#[cfg(test)]
mod tests {
    use super::*;

    fn key(conn: u64, s: &str) -> SessionKey {
        let mut session = SessionId::new();
        session.push_str(s).unwrap();
        SessionKey { conn, session }
    }

    #[test]
    fn latest_observation_wins_and_keeps_its_place() {
        let mut q = Queue::default();
        assert_eq!(q.push(key(1, "a"), Kind::Observe, 10), Ok(Pushed::Queued));
        assert_eq!(q.push(key(2, "a"), Kind::Observe, 20), Ok(Pushed::Queued));
        // Same session, newer observation: replaces 10, stays first in line.
        assert_eq!(
            q.push(key(1, "a"), Kind::Observe, 11),
            Ok(Pushed::Replaced(10))
        );
        assert_eq!(q.push(key(1, "b"), Kind::Observe, 30), Ok(Pushed::Queued));
        assert_eq!(q.pop(), Some(11));
        assert_eq!(q.pop(), Some(20));
        assert_eq!(q.pop(), Some(30));
        assert_eq!(q.pop(), None);
    }

    #[test]
    fn infer_requests_are_never_replaced() {
        let mut q = Queue::default();
        q.push(key(1, "a"), Kind::Infer, 1).unwrap();
        assert_eq!(q.push(key(1, "a"), Kind::Observe, 2), Ok(Pushed::Queued));
        assert_eq!(q.push(key(1, "a"), Kind::Infer, 3), Ok(Pushed::Queued));
        assert_eq!(
            q.push(key(1, "a"), Kind::Observe, 4),
            Ok(Pushed::Replaced(2))
        );
        assert_eq!((q.pop(), q.pop(), q.pop()), (Some(1), Some(4), Some(3)));
    }

    #[test]
    fn a_fast_streaming_session_does_not_starve_the_others() {
        // Session "fast" sends 10 observations for every one of "slow"; the engine takes one
        // entry per round. Each session must run once per round while both are waiting.
        let mut q = Queue::default();
        let mut ran = Vec::new();
        for round in 0..20 {
            q.push(key(1, "slow"), Kind::Observe, (1, round)).unwrap();
            for i in 0..10 {
                q.push(key(2, "fast"), Kind::Observe, (2, round * 10 + i))
                    .unwrap();
            }
            ran.push(q.pop().unwrap());
            ran.push(q.pop().unwrap());
        }
        let slow = ran.iter().filter(|(c, _)| *c == 1).count();
        let fast = ran.iter().filter(|(c, _)| *c == 2).count();
        assert_eq!((slow, fast), (20, 20));
        // And the fast one always ran its newest observation.
        assert!(
            ran.iter()
                .filter(|(c, _)| *c == 2)
                .enumerate()
                .all(|(r, (_, i))| *i == r * 10 + 9)
        );
    }

    #[test]
    fn closing_a_connection_takes_back_its_entries() {
        let mut q = Queue::default();
        q.push(key(1, "a"), Kind::Observe, 1).unwrap();
        q.push(key(2, "a"), Kind::Observe, 2).unwrap();
        q.push(key(1, "b"), Kind::Infer, 3).unwrap();
        let mut back = Vec::new();
        q.remove_conn(1, |i| back.push(i));
        assert_eq!(back, [1, 3]);
        assert_eq!((q.pop(), q.pop()), (Some(2), None));
    }

    #[test]
    fn the_queue_is_bounded() {
        let mut q = Queue::default();
        for i in 0..MAX_SLOTS as u64 {
            q.push(key(i, "a"), Kind::Infer, i).unwrap();
        }
        assert_eq!(q.push(key(999, "a"), Kind::Infer, 999), Err(999));
    }

    #[test]
    fn timed_actions_advance_by_one_step_and_dt() {
        let at = |timestep, timestamp| TimedStep {
            timestep,
            timestamp,
        };
        assert_eq!(timed_step(at(5, 100.0), 0.1, 0), at(5, 100.0));
        let nine = timed_step(at(5, 100.0), 0.1, 9);
        assert_eq!(nine.timestep, 14);
        assert!((nine.timestamp - 100.9).abs() < 1e-9);
        assert_eq!(
            timed_step(at(i64::MAX, 0.0), 0.1, 3).timestep,
            i64::MAX,
            "saturates"
        );
    }

    #[test]
    fn the_scheduler_hands_work_to_a_blocked_worker_and_stops() {
        let s = std::sync::Arc::new(Scheduler::default());
        let s2 = s.clone();
        let worker = std::thread::spawn(move || {
            let mut got = Vec::new();
            while let Ok(next) = s2.pop_timeout(std::time::Duration::from_millis(5)) {
                got.extend(next);
            }
            got
        });
        s.push(key(1, "a"), Kind::Infer, 1).unwrap();
        s.push(key(2, "a"), Kind::Infer, 2).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        s.stop();
        assert_eq!(s.push(key(3, "a"), Kind::Infer, 3), Err(3));
        assert_eq!(worker.join().unwrap(), [1, 2]);
    }
}
