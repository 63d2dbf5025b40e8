//! When does a reply go out? The pacing clock: wakes a connection at a reply's release time, to
//! well under a millisecond.
//!
//! tokio's timer wheel has millisecond granularity, so a budget-paced reply released by
//! `tokio::time::sleep_until` would jitter by up to 1 ms. One dedicated thread instead sleeps
//! on a condvar until shortly before the earliest release time (the kernel's timer slack is
//! ~50 µs), spins the rest (`pacing.spin_us`), and wakes the connection's [`Notify`]
//! [`WAKE_LEAD`] early; the connection spins to the exact instant. At 30 Hz the default spin
//! costs about 2 % of a core.
//!
//! Entries live in a fixed-capacity heap: each belongs to a slot waiting for release, and there
//! are at most [`MAX_SLOTS`] slots. A connection holds its finished results in a
//! [`ReleaseQueue`] (earliest first, as bounded). [`ReleaseStats`] records how far each release
//! landed from its target, and the deadline misses.

use std::cmp::Ordering as CmpOrdering;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::limits::MAX_SLOTS;

/// How long before a release time the clock stops sleeping and spins, by default
/// (`pacing.spin_us`): a sleeping thread's wake-up overshoot is ~60 µs on a quiet Linux box, but
/// reaches milliseconds on a busy or virtualised one.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(500);
/// How much earlier than a release time a connection is woken: about the time an async task
/// takes to be scheduled after a wake-up. The connection spins the rest (see
/// [`spin_until`]), so the release lands on time instead of one wake-up late.
pub const WAKE_LEAD: Duration = Duration::from_micros(300);

/// Busy-waits until `at` (a few tens of microseconds at most on the release path).
pub fn spin_until(at: Instant) {
    while Instant::now() < at {
        std::hint::spin_loop();
    }
}

/// When a finished reply goes out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    /// No budget: as soon as it is ready.
    Now,
    /// Held until its release time.
    At(Instant),
    /// Ready after its release time: out at once, counted as a deadline miss.
    Late,
}

/// The release time of a request received at `received` under a budget (0 = none).
pub fn release_target(received: Instant, budget_ms: f64) -> Option<Instant> {
    (budget_ms > 0.0).then(|| received + Duration::from_secs_f64(budget_ms / 1e3))
}

/// What to do with a reply ready at `ready` whose release time is `target`.
pub fn release(ready: Instant, target: Option<Instant>) -> Release {
    match target {
        None => Release::Now,
        Some(t) if t > ready => Release::At(t),
        Some(_) => Release::Late,
    }
}

/// Finished results held for their release time, earliest first, as one connection keeps
/// them: at most one per slot, so the queue never grows. Sorted latest first, so that the
/// earliest is popped from the end; equal times leave in the order they came.
pub struct ReleaseQueue<T> {
    held: heapless::Vec<(Instant, T), MAX_SLOTS>,
}

impl<T> Default for ReleaseQueue<T> {
    fn default() -> Self {
        ReleaseQueue {
            held: heapless::Vec::new(),
        }
    }
}

impl<T> ReleaseQueue<T> {
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// The earliest release time held.
    pub fn next_at(&self) -> Option<Instant> {
        self.held.last().map(|(at, _)| *at)
    }

    /// Holds `item` until `at`; hands it back if the queue is full (more items than slots).
    pub fn hold(&mut self, at: Instant, item: T) -> Result<(), T> {
        let pos = self
            .held
            .iter()
            .position(|(t, _)| *t <= at)
            .unwrap_or(self.held.len());
        self.held.insert(pos, (at, item)).map_err(|(_, item)| item)
    }

    /// The earliest item if it is due within [`WAKE_LEAD`] of now, at its exact time (spun
    /// to); `None` if nothing is due yet.
    pub fn pop_due(&mut self) -> Option<T> {
        let at = self.next_at()?;
        if at > Instant::now() + WAKE_LEAD {
            return None;
        }
        spin_until(at);
        self.held.pop().map(|(_, item)| item)
    }
}

struct Wake {
    at: Instant,
    seq: u64,
    notify: Arc<Notify>,
}

impl PartialEq for Wake {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Wake {}
impl PartialOrd for Wake {
    fn partial_cmp(&self, o: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(o))
    }
}
impl Ord for Wake {
    fn cmp(&self, o: &Self) -> CmpOrdering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

struct State {
    heap: heapless::BinaryHeap<Wake, heapless::binary_heap::Min, MAX_SLOTS>,
    seq: u64,
    stop: bool,
}

struct Inner {
    state: Mutex<State>,
    changed: Condvar,
    spin: Duration,
}

/// The pacing clock thread; dropping the handle stops it.
pub struct Pacer {
    inner: Arc<Inner>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Pacer {
    /// Starts the clock thread; it spins for the last `spin` before each wake-up.
    pub fn start(spin: Duration) -> std::io::Result<Pacer> {
        let inner = Arc::new(Inner {
            state: Mutex::new(State {
                heap: heapless::BinaryHeap::new(),
                seq: 0,
                stop: false,
            }),
            changed: Condvar::new(),
            spin,
        });
        let i = inner.clone();
        let thread = std::thread::Builder::new()
            .name("policyd-pacer".into())
            .spawn(move || run(&i))?;
        Ok(Pacer {
            inner,
            thread: Some(thread),
        })
    }

    /// Wakes `notify` at `at` (at once if it has passed). Returns false, waking at once, if
    /// the heap is full (which the slot bound rules out). Callers wanting to act *at* a time
    /// pass `time - WAKE_LEAD` and [`spin_until`] the time.
    pub fn wake_at(&self, at: Instant, notify: &Arc<Notify>) -> bool {
        let mut s = self.inner.state.lock().unwrap_or_else(|e| e.into_inner());
        s.seq += 1;
        let seq = s.seq;
        let earliest = s.heap.peek().is_none_or(|w| at < w.at);
        if s.heap
            .push(Wake {
                at,
                seq,
                notify: notify.clone(),
            })
            .is_err()
        {
            drop(s);
            notify.notify_one();
            return false;
        }
        drop(s);
        if earliest {
            self.inner.changed.notify_one();
        }
        true
    }
}

impl Drop for Pacer {
    fn drop(&mut self) {
        self.inner
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .stop = true;
        self.inner.changed.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(inner: &Inner) {
    let mut due: heapless::Vec<Arc<Notify>, MAX_SLOTS> = heapless::Vec::new();
    let mut s = inner.state.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        if s.stop {
            return;
        }
        let Some(at) = s.heap.peek().map(|w| w.at) else {
            s = inner.changed.wait(s).unwrap_or_else(|e| e.into_inner());
            continue;
        };
        let now = Instant::now();
        if at > now + inner.spin {
            // Re-checked on wake: an earlier entry may have arrived.
            s = inner
                .changed
                .wait_timeout(s, at - now - inner.spin)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            continue;
        }
        drop(s);
        while Instant::now() < at {
            std::hint::spin_loop();
        }
        s = inner.state.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        while s.heap.peek().is_some_and(|w| w.at <= now) {
            if let Some(w) = s.heap.pop() {
                let _ = due.push(w.notify);
            }
        }
        drop(s);
        for n in due.drain(..) {
            n.notify_one();
        }
        s = inner.state.lock().unwrap_or_else(|e| e.into_inner());
    }
}

/// How releases landed relative to their targets (all connections).
pub struct ReleaseStats {
    /// |release − target| in microseconds, for replies released on schedule.
    error_us: Mutex<hdrhistogram::Histogram<u64>>,
    /// Replies that were ready only after their release time, and went out at once.
    pub misses: AtomicU64,
    /// Replies released on a budget (on time or missed).
    pub paced: AtomicU64,
}

/// A summary of [`ReleaseStats`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReleaseSummary {
    pub paced: u64,
    pub misses: u64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
}

impl Default for ReleaseStats {
    fn default() -> Self {
        Self::new()
    }
}

impl ReleaseStats {
    pub fn new() -> ReleaseStats {
        ReleaseStats {
            // 1 µs to 60 s at 3 significant digits: allocated once, never resized.
            error_us: Mutex::new(
                hdrhistogram::Histogram::new_with_bounds(1, 60_000_000, 3)
                    .unwrap_or_else(|_| hdrhistogram::Histogram::new(3).expect("3 digits")),
            ),
            misses: AtomicU64::new(0),
            paced: AtomicU64::new(0),
        }
    }

    /// Records a release that was due at `target` and happened at `now`.
    pub fn on_time(&self, target: Instant, now: Instant) {
        let err = if now >= target {
            now - target
        } else {
            target - now
        };
        let us = (err.as_micros() as u64).clamp(1, 60_000_000);
        self.paced.fetch_add(1, Ordering::Relaxed);
        let mut h = self.error_us.lock().unwrap_or_else(|e| e.into_inner());
        let _ = h.record(us);
    }

    /// Records a reply that was ready only after its release time.
    pub fn missed(&self) {
        self.paced.fetch_add(1, Ordering::Relaxed);
        self.misses.fetch_add(1, Ordering::Relaxed);
    }

    pub fn summary(&self) -> ReleaseSummary {
        let h = self.error_us.lock().unwrap_or_else(|e| e.into_inner());
        ReleaseSummary {
            paced: self.paced.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            p50_us: h.value_at_quantile(0.5),
            p99_us: h.value_at_quantile(0.99),
            max_us: h.max(),
        }
    }

    pub fn reset(&self) {
        self.error_us
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .reset();
        self.misses.store(0, Ordering::Relaxed);
        self.paced.store(0, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_release_queue_hands_out_the_earliest_first_and_ties_in_arrival_order() {
        let now = Instant::now();
        let ms = |n: u64| now + Duration::from_millis(n);
        let mut q = ReleaseQueue::default();
        for (at, name) in [(30, "c"), (10, "a"), (20, "b"), (10, "a2"), (40, "d")] {
            q.hold(ms(at), name).expect("room");
        }
        assert_eq!(q.next_at(), Some(ms(10)));
        std::thread::sleep(Duration::from_millis(45));
        let order: Vec<_> = std::iter::from_fn(|| q.pop_due()).collect();
        assert_eq!(order, ["a", "a2", "b", "c", "d"]);
        assert!(q.is_empty());
    }

    #[test]
    fn the_release_queue_pops_only_what_is_due_and_is_bounded() {
        let now = Instant::now();
        let mut q = ReleaseQueue::default();
        q.hold(now + Duration::from_secs(60), 2).expect("room");
        q.hold(now, 1).expect("room");
        assert_eq!(q.pop_due(), Some(1), "due now");
        assert_eq!(q.pop_due(), None, "a minute away");
        assert!(!q.is_empty());
        for i in 1..MAX_SLOTS {
            q.hold(now, 10 + i).expect("room for one per slot");
        }
        assert_eq!(q.hold(now, 99), Err(99), "full: handed back");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn wakes_in_order_and_never_early() {
        let pacer = Pacer::start(DEFAULT_SPIN).unwrap();
        let base = Instant::now() + Duration::from_millis(20);
        let notes: Vec<Arc<Notify>> = (0..4).map(|_| Arc::new(Notify::new())).collect();
        // Registered out of order.
        for (i, ms) in [(2usize, 9u64), (0, 1), (3, 12), (1, 5)] {
            assert!(pacer.wake_at(base + Duration::from_millis(ms), &notes[i]));
        }
        let mut woke = Vec::new();
        for (i, ms) in [(0usize, 1u64), (1, 5), (2, 9), (3, 12)] {
            notes[i].notified().await;
            let now = Instant::now();
            let target = base + Duration::from_millis(ms);
            assert!(now >= target, "woke {:?} early", target - now);
            woke.push(now - target);
        }
        // A time in the past wakes at once.
        let n = Arc::new(Notify::new());
        pacer.wake_at(Instant::now() - Duration::from_millis(5), &n);
        tokio::time::timeout(Duration::from_secs(1), n.notified())
            .await
            .expect("immediate wake");
    }

    #[test]
    fn replies_are_held_until_receipt_plus_budget_and_late_ones_go_at_once() {
        // A made-up clock: instants relative to t0.
        let t0 = Instant::now();
        let ms = |v: u64| t0 + Duration::from_millis(v);
        assert_eq!(release_target(ms(0), 0.0), None);
        let target = release_target(ms(10), 25.0);
        assert_eq!(target, Some(ms(35)));
        assert_eq!(release(ms(12), None), Release::Now);
        assert_eq!(release(ms(12), target), Release::At(ms(35)));
        assert_eq!(release(ms(35), target), Release::Late);
        assert_eq!(release(ms(50), target), Release::Late);
        let sub_ms = release_target(ms(0), 0.25).unwrap();
        assert_eq!(sub_ms - t0, Duration::from_micros(250));
    }

    #[test]
    fn stats_summarise_errors_and_misses() {
        let s = ReleaseStats::new();
        let t = Instant::now();
        for us in [10u64, 20, 30, 40, 1000] {
            s.on_time(t, t + Duration::from_micros(us));
        }
        s.missed();
        let r = s.summary();
        assert_eq!((r.paced, r.misses), (6, 1));
        assert!((29..=31).contains(&r.p50_us), "{r:?}");
        assert!((995..=1005).contains(&r.max_us), "{r:?}");
        s.reset();
        assert_eq!(s.summary().paced, 0);
    }
}
