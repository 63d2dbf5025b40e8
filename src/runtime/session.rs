//! Which robot episode is a request part of? Sessions of one connection: a fixed-capacity table
//! keyed by `session_id`.
//!
//! vllm-omni clients interleave sessions on one socket; a session's first inference (and the
//! first after `endpoint: reset`) must reach the engine with `reset = true`. The table never
//! grows: past its capacity the least recently used session is evicted.

use crate::limits::MAX_SESSIONS;
use crate::protocol::SessionId;
use crate::runtime::scheduler::SessionPacing;

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
}

impl Sessions {
    pub fn new(limit: usize, window: usize) -> Self {
        let mut current = SessionId::new();
        let _ = current.push_str("default");
        Sessions {
            entries: heapless::Vec::new(),
            limit: limit.clamp(1, MAX_SESSIONS),
            tick: 0,
            current,
            window,
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
        if let Some(id) = id {
            self.current.clone_from(id);
        }
        self.tick += 1;
        let tick = self.tick;
        let e = self.entry(tick);
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
        if let Some(id) = id {
            self.current.clone_from(id);
        }
        self.tick += 1;
        let tick = self.tick;
        let e = self.entry(tick);
        e.count = 0;
        e.pacing.clear();
    }

    /// `reset_on_prompt_change`: records the session's prompt (a hash) and, when it differs
    /// from the previous one, resets the session as `endpoint: reset` would. True if it did.
    pub fn prompt_changed(&mut self, id: Option<&SessionId>, prompt: u64) -> bool {
        if let Some(id) = id {
            self.current.clone_from(id);
        }
        self.tick += 1;
        let tick = self.tick;
        let e = self.entry(tick);
        let changed = e.prompt.is_some_and(|p| p != prompt);
        e.prompt = Some(prompt);
        if changed {
            e.count = 0;
            e.pacing.clear();
        }
        changed
    }

    /// The session requests without `session_id` go to.
    pub fn current(&self) -> &SessionId {
        &self.current
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

    fn entry(&mut self, tick: u64) -> &mut Entry {
        if let Some(i) = self.entries.iter().position(|e| e.id == self.current) {
            return &mut self.entries[i];
        }
        if self.entries.len() >= self.limit {
            let lru = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i)
                .unwrap_or(0);
            self.entries.swap_remove(lru);
        }
        let _ = self.entries.push(Entry {
            id: self.current.clone(),
            last_used: tick,
            count: 0,
            pacing: SessionPacing::new(self.window),
            prompt: None,
        });
        let last = self.entries.len() - 1;
        &mut self.entries[last]
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
}
