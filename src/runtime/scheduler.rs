//! What does the engine run next, and which observations does it never need to see?
//!
//! Two parts, both plain logic with time passed in (so they are unit-tested with made-up
//! instants):
//!
//! - [`Queue`]: the work waiting for the engine, shared by all connections. Each session holds
//!   at most one waiting entry. An `observe` entry is a **latest-wins slot**: a newer
//!   observation of the same session takes its place (and its place in line) before it starts.
//!   Dispatch is first-come-first-served *by session*: the session whose entry has waited
//!   longest runs next. Since a session cannot queue a second entry and a replacement keeps the
//!   older position, a client that streams fast cannot push others back, and a slow one is
//!   never starved. With one latency budget for everyone, waiting longest is also
//!   earliest-deadline-first, which is what keeps paced replies on time.
//! - [`SessionPacing`]: one session's filters (already-predicted timesteps, optional state
//!   similarity; `must_go` bypasses both) and its window of end-to-end latencies, from which
//!   `delay_steps = ceil(p95 / dt)` is computed.
//!
//! [`Scheduler`] wraps the queue in a mutex and condvar for the engine worker thread to pull
//! from. Everything here is fixed-capacity; nothing allocates after start-up.

use std::sync::{Condvar, Mutex};

use crate::limits::{MAX_LATENCY_WINDOW, MAX_SIMILARITY_STATE, MAX_SLOTS, PREDICTED_MEMORY};
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

/// The filters, as configured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Filters {
    pub skip_predicted_timesteps: bool,
    /// 0 = off.
    pub similarity_atol: f64,
}

/// A session's filter memory and latency window.
#[derive(Clone, Debug)]
pub struct SessionPacing {
    /// Timesteps of observations accepted recently (queued, running or done), oldest first.
    predicted: heapless::Deque<i64, PREDICTED_MEMORY>,
    /// Raw state of the last accepted observation, for the similarity filter.
    last_state: heapless::Vec<f64, MAX_SIMILARITY_STATE>,
    latencies: LatencyWindow,
    /// When the last `observe` arrived (for the observation-rate metric).
    last_observed: Option<std::time::Instant>,
}

impl SessionPacing {
    pub fn new(window: usize) -> Self {
        SessionPacing {
            predicted: heapless::Deque::new(),
            last_state: heapless::Vec::new(),
            latencies: LatencyWindow::new(window),
            last_observed: None,
        }
    }

    /// A new session, or `endpoint: reset`: forget everything.
    pub fn clear(&mut self) {
        self.predicted.clear();
        self.last_state.clear();
        self.latencies.clear();
        self.last_observed = None;
    }

    /// Notes an `observe` arriving at `at`; the time since the previous one, if any.
    pub fn observed(&mut self, at: std::time::Instant) -> Option<std::time::Duration> {
        let gap = self.last_observed.map(|t| at.saturating_duration_since(t));
        self.last_observed = Some(at);
        gap
    }

    /// Decides whether an `observe` observation goes to the engine, and if so remembers it.
    /// `state` is its raw state vector (for the similarity filter), if one is configured.
    pub fn admit(
        &mut self,
        filters: &Filters,
        timestep: i64,
        must_go: bool,
        state: Option<&[f64]>,
    ) -> Result<(), SkipReason> {
        if !must_go {
            if filters.skip_predicted_timesteps && self.predicted.iter().any(|&t| t == timestep) {
                return Err(SkipReason::AlreadyPredicted);
            }
            if filters.similarity_atol > 0.0
                && let Some(s) = state
                && self.last_state.len() == s.len()
            {
                let d2: f64 = s
                    .iter()
                    .zip(&self.last_state)
                    .map(|(a, b)| (a - b) * (a - b))
                    .sum();
                if d2.sqrt() < filters.similarity_atol {
                    return Err(SkipReason::Similar);
                }
            }
        }
        if self.predicted.is_full() {
            self.predicted.pop_front();
        }
        let _ = self.predicted.push_back(timestep);
        if let Some(s) = state {
            self.last_state.clear();
            let _ = self
                .last_state
                .extend_from_slice(&s[..s.len().min(MAX_SIMILARITY_STATE)]);
        }
        Ok(())
    }

    /// An accepted observation was replaced before it ran: its timestep is free again.
    pub fn forget(&mut self, timestep: i64) {
        let n = self.predicted.len();
        for _ in 0..n {
            if let Some(t) = self.predicted.pop_front()
                && t != timestep
            {
                let _ = self.predicted.push_back(t);
            }
        }
    }

    /// Records one end-to-end latency (receipt to release), in seconds.
    pub fn record_latency(&mut self, seconds: f64) {
        self.latencies.push(seconds);
    }

    /// `ceil(p95 / dt)` over the window; 0 before any sample.
    pub fn delay_steps(&self, fps: f64) -> u32 {
        self.latencies.p95().map_or(0, |p| delay_steps(p, fps))
    }
}

#[cfg(test)]
use crate::protocol::timed_step;

/// `ceil(latency / dt)` with `dt = 1 / fps`, as LeRobot's RTC computes it.
pub fn delay_steps(latency_s: f64, fps: f64) -> u32 {
    let steps = latency_s * fps;
    // Tolerance (latencies are kept as f32) so that exactly one step is one step, not two.
    (steps - 1e-4).ceil().clamp(0.0, f64::from(u32::MAX)) as u32
}

/// The last `n` latencies (seconds), in a fixed ring.
#[derive(Clone, Debug)]
pub struct LatencyWindow {
    ring: [f32; MAX_LATENCY_WINDOW],
    cap: usize,
    len: usize,
    next: usize,
}

impl LatencyWindow {
    pub fn new(cap: usize) -> Self {
        LatencyWindow {
            ring: [0.0; MAX_LATENCY_WINDOW],
            cap: cap.clamp(1, MAX_LATENCY_WINDOW),
            len: 0,
            next: 0,
        }
    }

    pub fn clear(&mut self) {
        self.len = 0;
        self.next = 0;
    }

    /// Adds a sample; negative and non-finite samples are ignored (as LeRobot does).
    pub fn push(&mut self, seconds: f64) {
        if !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        self.ring[self.next] = seconds as f32;
        self.next = (self.next + 1) % self.cap;
        self.len = (self.len + 1).min(self.cap);
    }

    /// The 95th percentile (nearest rank), if there are samples.
    pub fn p95(&self) -> Option<f64> {
        if self.len == 0 {
            return None;
        }
        let mut v = [0f32; MAX_LATENCY_WINDOW];
        v[..self.len].copy_from_slice(&self.ring[..self.len]);
        let rank = ((0.95 * self.len as f64).ceil() as usize).clamp(1, self.len) - 1;
        let (_, p, _) = v[..self.len].select_nth_unstable_by(rank, f32::total_cmp);
        Some(f64::from(*p))
    }
}

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

    const ON: Filters = Filters {
        skip_predicted_timesteps: true,
        similarity_atol: 0.0,
    };

    #[test]
    fn already_predicted_timesteps_are_skipped_unless_must_go() {
        let mut s = SessionPacing::new(100);
        assert_eq!(s.admit(&ON, 5, false, None), Ok(()));
        assert_eq!(
            s.admit(&ON, 5, false, None),
            Err(SkipReason::AlreadyPredicted)
        );
        assert_eq!(s.admit(&ON, 5, true, None), Ok(()));
        assert_eq!(s.admit(&ON, 6, false, None), Ok(()));
        let off = Filters {
            skip_predicted_timesteps: false,
            ..ON
        };
        assert_eq!(s.admit(&off, 6, false, None), Ok(()));
        // A superseded observation's timestep may come again.
        s.forget(6);
        assert_eq!(s.admit(&ON, 6, false, None), Ok(()));
        s.clear();
        assert_eq!(s.admit(&ON, 5, false, None), Ok(()));
    }

    #[test]
    fn the_predicted_set_is_bounded() {
        let mut s = SessionPacing::new(100);
        for t in 0..1000 {
            s.admit(&ON, t, false, None).unwrap();
        }
        assert_eq!(s.predicted.len(), PREDICTED_MEMORY);
        assert_eq!(
            s.admit(&ON, 999, false, None),
            Err(SkipReason::AlreadyPredicted)
        );
        assert_eq!(s.admit(&ON, 0, false, None), Ok(()), "forgotten long ago");
    }

    #[test]
    fn similarity_filter_compares_raw_state_by_l2() {
        let f = Filters {
            skip_predicted_timesteps: true,
            similarity_atol: 1.0,
        };
        let mut s = SessionPacing::new(100);
        assert_eq!(s.admit(&f, 0, false, Some(&[0.0, 0.0])), Ok(()));
        assert_eq!(
            s.admit(&f, 1, false, Some(&[0.6, 0.6])),
            Err(SkipReason::Similar)
        );
        assert_eq!(s.admit(&f, 2, true, Some(&[0.6, 0.6])), Ok(()), "must_go");
        assert_eq!(s.admit(&f, 3, false, Some(&[1.7, 0.6])), Ok(()));
        assert_eq!(
            s.admit(&f, 4, false, Some(&[1.7, 1.5])),
            Err(SkipReason::Similar)
        );
        assert_eq!(s.admit(&f, 5, false, Some(&[1.7, 1.7])), Ok(()));
    }

    #[test]
    fn delay_steps_is_the_ceiling_of_p95_over_dt() {
        let mut s = SessionPacing::new(100);
        assert_eq!(s.delay_steps(30.0), 0);
        for i in 0..100 {
            // 95 samples of 20 ms, 5 of 200 ms: p95 is 20 ms (rank 95).
            s.record_latency(if i % 20 == 0 { 0.2 } else { 0.02 });
        }
        assert_eq!(s.delay_steps(30.0), 1); // 20 ms at 30 Hz (33 ms steps)
        assert_eq!(s.delay_steps(100.0), 2); // 10 ms steps
        s.record_latency(-1.0);
        s.record_latency(f64::NAN);
        for _ in 0..10 {
            s.record_latency(0.2);
        }
        // Now 15 of the last 100 are 200 ms: p95 is 200 ms.
        assert_eq!(s.delay_steps(30.0), 6);
        assert_eq!(delay_steps(1.0 / 30.0, 30.0), 1);
        assert_eq!(delay_steps(0.0, 30.0), 0);
    }

    #[test]
    fn timed_actions_advance_by_one_step_and_dt() {
        assert_eq!(timed_step(5, 100.0, 0.1, 0), (5, 100.0));
        let (step, t) = timed_step(5, 100.0, 0.1, 9);
        assert_eq!(step, 14);
        assert!((t - 100.9).abs() < 1e-9);
        assert_eq!(timed_step(i64::MAX, 0.0, 0.1, 3).0, i64::MAX, "saturates");
    }

    #[test]
    fn latency_window_slides() {
        let mut w = LatencyWindow::new(3);
        for v in [5.0, 1.0, 1.0, 1.0] {
            w.push(v);
        }
        assert_eq!(w.p95(), Some(1.0), "5.0 slid out");
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
