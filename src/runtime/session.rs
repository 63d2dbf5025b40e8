//! Which robot episode is a request part of? Sessions of one connection: a fixed-capacity table
//! keyed by `session_id`.
//!
//! vllm-omni clients interleave sessions on one socket; a session's first inference (and the
//! first after `endpoint: reset`) must reach the engine with `reset = true`. The table never
//! grows: past its capacity the least recently used session is evicted.
//!
//! Each session keeps its own pacing state ([`SessionPacing`]): the filters that decide which
//! `observe` frames the engine never needs to see (already-predicted timesteps, optional state
//! similarity; `must_go` bypasses both) and its window of end-to-end latencies, from which
//! `delay_steps = ceil(p95 / dt)` is computed. Plain logic, fixed-capacity, tested with
//! made-up numbers.

use crate::limits::{MAX_LATENCY_WINDOW, MAX_SESSIONS, MAX_SIMILARITY_STATE, PREDICTED_MEMORY};
use crate::protocol::SessionId;
use crate::runtime::scheduler::SkipReason;

#[derive(Debug)]
struct Entry {
    id: SessionId,
    /// Tick of the last use, for LRU eviction.
    last_used: u64,
    /// Inferences since the session started or was reset.
    count: u64,
    /// Filters and latency window of the session's `observe` stream.
    pacing: SessionPacing,
    /// A hash of the session's last prompt (`reset_on_prompt_change`).
    prompt: Option<u64>,
    /// The session's last tokenized prompt.
    tokens: crate::bind::PromptCache,
    /// Seeds for its requests that name none (a pipeline's noise), from the OS at its start.
    seeds: Option<crate::sampler::SeedStream>,
    /// Its previous frames of the inputs with `history`.
    history: crate::bind::History,
}

/// Sessions of one connection.
#[derive(Debug)]
pub struct Sessions {
    entries: heapless::Vec<Entry, MAX_SESSIONS>,
    limit: usize,
    tick: u64,
    /// The session a request without `session_id` belongs to (the last one named).
    current: SessionId,
    /// `pacing.latency_window` for new sessions.
    window: usize,
    /// `[rtc]`: floats of the previous chunk each session keeps (0 without).
    previous: usize,
}

impl Sessions {
    pub fn new(limit: usize, window: usize) -> Self {
        Self::keeping_chunks(limit, window, 0)
    }

    /// Sessions that keep their previous chunk, `previous` floats each (`[rtc]`).
    pub fn keeping_chunks(limit: usize, window: usize, previous: usize) -> Self {
        let mut current = SessionId::new();
        let _ = current.push_str("default");
        Sessions {
            entries: heapless::Vec::new(),
            limit: limit.clamp(1, MAX_SESSIONS),
            tick: 0,
            current,
            window,
            previous,
        }
    }

    /// Records an inference for `id` (or the current session) and says whether the engine
    /// must reset: true for a session's first inference.
    pub fn begin_infer(&mut self, id: Option<&SessionId>) -> bool {
        self.begin(id).0
    }

    /// Like [`Sessions::begin_infer`], also handing out the session's pacing state (cleared
    /// when the session starts afresh). The session is then the current one.
    pub fn begin(&mut self, id: Option<&SessionId>) -> (bool, &mut SessionPacing) {
        let (tick, e) = self.touch(id);
        e.last_used = tick;
        e.count += 1;
        let fresh = e.count == 1;
        if fresh {
            e.pacing.clear();
        }
        (fresh, &mut e.pacing)
    }

    /// `endpoint: reset`: the session's next inference starts afresh, and its filters and
    /// latency window are cleared.
    pub fn reset(&mut self, id: Option<&SessionId>) {
        let (_, e) = self.touch(id);
        e.count = 0;
        e.pacing.clear();
    }

    /// `endpoint: reset` on the vllm-omni route: every session is forgotten (each one's next
    /// inference starts afresh) and the current session is `"default"` again.
    pub fn reset_all(&mut self) {
        self.entries.clear();
        self.current.clear();
        let _ = self.current.push_str("default");
    }

    /// `reset_on_prompt_change`: records the session's prompt (a hash) and, when it differs
    /// from the previous one, resets the session as `endpoint: reset` would. True if it did.
    pub fn prompt_changed(&mut self, id: Option<&SessionId>, prompt: u64) -> bool {
        let (_, e) = self.touch(id);
        let changed = e.prompt.is_some_and(|p| p != prompt);
        e.prompt = Some(prompt);
        if changed {
            e.count = 0;
            e.pacing.clear();
        }
        changed
    }

    /// The token cache of `id` (or the current session), which becomes the current session.
    pub fn prompt_cache(&mut self, id: Option<&SessionId>) -> &mut crate::bind::PromptCache {
        &mut self.touch(id).1.tokens
    }

    /// The previous frames of `id` (or the current session), which becomes the current one.
    pub fn history(&mut self, id: Option<&SessionId>) -> &mut crate::bind::History {
        &mut self.touch(id).1.history
    }

    /// The next seed of `id`'s (or the current session's) own stream, for a request that
    /// names none; the stream starts, seeded from the OS, at the session's first draw.
    pub fn next_seed(&mut self, id: Option<&SessionId>) -> u64 {
        self.touch(id)
            .1
            .seeds
            .get_or_insert_with(crate::sampler::SeedStream::from_os)
            .next_seed()
    }

    /// The session requests without `session_id` go to.
    pub fn current(&self) -> &SessionId {
        &self.current
    }

    /// The current session's pacing state (`None` before its first request).
    pub fn current_pacing(&mut self) -> Option<&mut SessionPacing> {
        let current = &self.current;
        self.entries
            .iter_mut()
            .find(|e| e.id == *current)
            .map(|e| &mut e.pacing)
    }

    /// A live session's pacing state (`None` once evicted).
    pub fn pacing(&mut self, id: &SessionId) -> Option<&mut SessionPacing> {
        self.entries
            .iter_mut()
            .find(|e| e.id == *id)
            .map(|e| &mut e.pacing)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Makes `id` (if given) the current session, ticks, and finds or makes its entry.
    fn touch(&mut self, id: Option<&SessionId>) -> (u64, &mut Entry) {
        if let Some(id) = id {
            self.current.clone_from(id);
        }
        self.tick += 1;
        let tick = self.tick;
        (tick, self.entry(tick))
    }

    fn entry(&mut self, tick: u64) -> &mut Entry {
        if let Some(i) = self.entries.iter().position(|e| e.id == self.current) {
            return &mut self.entries[i];
        }
        let mut history = crate::bind::History::default();
        let mut previous = None;
        if self.entries.len() >= self.limit {
            let lru = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i)
                .unwrap_or(0);
            // The evicted session's frame buffer serves the new one (its first request
            // overwrites it, being fresh): eviction allocates nothing.
            let evicted = self.entries.swap_remove(lru);
            history = evicted.history;
            previous = Some(evicted.pacing.previous);
        }
        // The evicted session's chunk buffer too; else one sized now, once per session.
        let mut previous =
            previous.unwrap_or_else(|| crate::rtc::Previous::with_capacity(self.previous));
        previous.clear();
        let _ = self.entries.push(Entry {
            id: self.current.clone(),
            last_used: tick,
            count: 0,
            pacing: SessionPacing::with_previous(self.window, previous),
            prompt: None,
            tokens: crate::bind::PromptCache::default(),
            seeds: None,
            history,
        });
        let last = self.entries.len() - 1;
        &mut self.entries[last]
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
    /// `[rtc]`: the last chunk sent, in model space.
    pub previous: crate::rtc::Previous,
}

impl SessionPacing {
    pub fn new(window: usize) -> Self {
        Self::with_previous(window, crate::rtc::Previous::default())
    }

    /// A session's state keeping its previous chunk in `previous` (sized for `[rtc]`).
    pub fn with_previous(window: usize, previous: crate::rtc::Previous) -> Self {
        SessionPacing {
            predicted: heapless::Deque::new(),
            last_state: heapless::Vec::new(),
            latencies: LatencyWindow::new(window),
            last_observed: None,
            previous,
        }
    }

    /// A new session, or `endpoint: reset`: forget everything.
    pub fn clear(&mut self) {
        self.predicted.clear();
        self.last_state.clear();
        self.latencies.clear();
        self.last_observed = None;
        self.previous.clear();
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

    /// `ceil(max / dt)` over the window, 0 before any sample: `[rtc]`'s inference delay, as
    /// LeRobot's rollout takes it (its latency tracker's max). Not the p95 of `delay_steps`:
    /// a delay too short leaves rows the robot executes during inference only softly tied to
    /// the chunk it is executing (a jump at the switch), one too long only freezes a few more
    /// rows the robot skips as stale anyway.
    pub fn max_delay_steps(&self, fps: f64) -> u32 {
        self.latencies.max().map_or(0, |m| delay_steps(m, fps))
    }
}

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

    /// The largest sample, if there are any.
    pub fn max(&self) -> Option<f64> {
        self.ring[..self.len]
            .iter()
            .copied()
            .reduce(f32::max)
            .map(f64::from)
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

    fn id(s: &str) -> SessionId {
        let mut i = SessionId::new();
        i.push_str(s).unwrap();
        i
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
    fn latency_window_slides() {
        let mut w = LatencyWindow::new(3);
        for v in [5.0, 1.0, 1.0, 1.0] {
            w.push(v);
        }
        assert_eq!(w.p95(), Some(1.0), "5.0 slid out");
    }

    #[test]
    fn first_inference_and_after_reset_resets() {
        let mut s = Sessions::new(4, 100);
        assert!(s.begin_infer(None));
        assert!(!s.begin_infer(None));
        assert!(s.begin_infer(Some(&id("a"))));
        assert!(
            !s.begin_infer(None),
            "requests without an id stay in the last named session"
        );
        assert!(!s.begin_infer(Some(&id("default"))));
        s.reset(Some(&id("a")));
        assert!(s.begin_infer(None));
        assert!(!s.begin_infer(Some(&id("a"))));
    }

    #[test]
    fn bounded_with_lru_eviction() {
        let mut s = Sessions::new(2, 100);
        assert!(s.begin_infer(Some(&id("a"))));
        assert!(s.begin_infer(Some(&id("b"))));
        assert!(!s.begin_infer(Some(&id("a"))));
        assert!(s.begin_infer(Some(&id("c")))); // evicts b, the least recently used
        assert_eq!(s.len(), 2);
        assert!(!s.begin_infer(Some(&id("a"))));
        assert!(
            s.begin_infer(Some(&id("b"))),
            "an evicted session starts afresh"
        );
    }

    /// `[rtc]`: a session's previous chunk is its own, and nothing of it survives a reset, a
    /// prompt change, the connection's reset (LeRobot's `Ready`, a new setup) or eviction.
    #[test]
    fn a_previous_chunk_is_per_session_and_forgotten_on_every_reset() {
        let x: Vec<u8> = (0..8)
            .flat_map(|v| (v as f32 + 1.0).to_le_bytes())
            .collect();
        let mut out = [0f32; 8];
        let mut s = Sessions::keeping_chunks(2, 100, 8);
        let kept = |s: &mut Sessions, name: &str, out: &mut [f32]| {
            s.pacing(&id(name))
                .map_or(0, |p| p.previous.leftover(1, 2, 4, out))
        };
        for reset in 0..4 {
            s.begin(Some(&id("a")));
            s.begin(Some(&id("b")));
            s.pacing(&id("a")).unwrap().previous.capture(&x, 2, 2, 4, 0);
            assert_eq!(kept(&mut s, "a", &mut out), 3);
            assert_eq!(out[..6], [3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
            assert_eq!(kept(&mut s, "b", &mut out), 0, "another session's chunk");
            match reset {
                0 => s.reset(Some(&id("a"))),
                1 => {
                    s.prompt_changed(Some(&id("a")), 1);
                    s.prompt_changed(Some(&id("a")), 2);
                }
                2 => s.reset_all(),
                _ => {
                    s.begin(Some(&id("c")));
                    s.begin(Some(&id("d")));
                }
            }
            assert_eq!(kept(&mut s, "a", &mut out), 0, "after reset {reset}");
        }
    }
}
