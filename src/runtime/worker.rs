//! Where does the engine run, and into what? The engine worker and the slot pool.
//!
//! A slot is one full set of engine input and output buffers plus a reply buffer, allocated at
//! start-up. A connection takes a free slot, decodes into it, hands it to the worker thread
//! (which owns the engine, so no async task ever blocks on inference), and gets it back with
//! outputs. The number of slots bounds the work in flight; waiting for one is back-pressure,
//! not allocation. Slots are never lost: a connection that goes away mid-inference has its
//! slot returned to the pool by the worker or by the reply port's drop.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, Semaphore};

use crate::bind::Plan;
use crate::engine::{Engine, EngineError, InputBuffer, RunStats};
use crate::limits::MAX_SLOTS;
use crate::protocol::SessionId;
use crate::runtime::scheduler::{Kind, Pushed, Scheduler, SessionKey};

/// What a request is, carried with its slot from decode to release.
#[derive(Clone, Debug)]
pub struct Ticket {
    pub kind: Kind,
    /// The connection's stall epoch when submitted: a slot from an earlier epoch was already
    /// answered with a timeout error and is dropped when it comes back.
    pub epoch: u64,
    pub session: SessionId,
    /// When the frame was read (the start of the end-to-end latency).
    pub received: Instant,
    /// Not before this instant, if a latency budget is set.
    pub release_at: Option<Instant>,
    /// `observe`: the observation's timestep and timestamp.
    pub timestep: i64,
    pub timestamp: f64,
}

impl Ticket {
    /// The observation's step and time (zero for `infer`).
    pub fn at(&self) -> crate::protocol::TimedStep {
        crate::protocol::TimedStep {
            timestep: self.timestep,
            timestamp: self.timestamp,
        }
    }
}

impl Default for Ticket {
    fn default() -> Self {
        Ticket {
            kind: Kind::Infer,
            epoch: 0,
            session: SessionId::new(),
            received: Instant::now(),
            release_at: None,
            timestep: 0,
            timestamp: 0.0,
        }
    }
}

/// One request's buffers.
pub struct Slot {
    inputs: Vec<Box<dyn InputBuffer>>,
    outputs: Vec<Vec<u8>>,
    /// Which bindings the current request supplied.
    seen: Vec<bool>,
    /// The encoded reply.
    reply: Vec<u8>,
    /// Outputs converted to their reply dtype, when a chunk is cut (see `pacing`).
    scratch: Vec<u8>,
    ticket: Ticket,
    /// Tell the engine to drop its history before this run.
    reset: bool,
    /// The request's noise seed and step count (a pipeline's sampler reads them).
    sampling: crate::engine::Sampling,
    /// `[rtc]`: the previous chunk's leftover in the sample's layout (sized at start-up), and
    /// this request's rows of it and delay (`None`: a plain run).
    leftover: Vec<f32>,
    continues: Option<crate::rtc::Request>,
    /// The worker's result for the last run.
    result: Option<Result<RunStats, EngineError>>,
}

/// A slot's fields are reached through methods: what a front end may change before the engine
/// runs (inputs, sampling, the ticket) and read after (outputs, result), never the worker's.
impl Slot {
    /// Readies a decoded request for the engine: what it is, whether the engine drops its
    /// history first, and no result yet.
    pub fn prepare(&mut self, ticket: Ticket, reset: bool) {
        self.ticket = ticket;
        self.reset = reset;
        self.result = None;
    }

    /// The engine inputs a decoder writes, and which bindings it has written.
    pub fn inputs_mut(&mut self) -> (&mut [Box<dyn InputBuffer>], &mut [bool]) {
        (&mut self.inputs, &mut self.seen)
    }

    /// The request's noise seed and step count, for a pipeline's sampler.
    pub fn set_sampling(&mut self, sampling: crate::engine::Sampling) {
        self.sampling = sampling;
    }

    /// `[rtc]`: the leftover buffer a request fills, and whether (and how) the run continues
    /// it. Cleared by [`prepare`](Self::prepare)'s caller for a request that does not.
    pub fn continuation_mut(&mut self) -> (&mut [f32], &mut Option<crate::rtc::Request>) {
        (&mut self.leftover, &mut self.continues)
    }

    pub fn ticket(&self) -> &Ticket {
        &self.ticket
    }

    /// The worker's result for the last run (`None` until it ran).
    pub fn result(&self) -> Option<&Result<RunStats, EngineError>> {
        self.result.as_ref()
    }

    /// What an encoder needs (see [`SlotParts`]); `raw` is the slot buffer holding the
    /// request's values as sent of the relative actions' input (`Plan::relative_source`).
    pub fn reply_parts(&mut self, raw: Option<usize>) -> SlotParts<'_> {
        let raw = match raw.and_then(|i| self.inputs.get_mut(i)) {
            Some(b) => &*b.bytes_mut(),
            None => &[],
        };
        SlotParts {
            outputs: &self.outputs,
            scratch: &mut self.scratch,
            reply: &mut self.reply,
            raw,
        }
    }

    /// The encoded reply.
    pub fn reply(&self) -> &[u8] {
        &self.reply
    }
}

/// A finished slot as an encoder sees it: the engine's outputs, the scratch buffer a reply
/// converts them in, the reply buffer, and the relative actions' input as sent (empty without).
pub struct SlotParts<'a> {
    pub outputs: &'a [Vec<u8>],
    pub scratch: &'a mut [u8],
    pub reply: &'a mut Vec<u8>,
    pub raw: &'a [u8],
}

/// A fixed set of slots.
pub struct SlotPool {
    /// Boxed so that handing a slot between threads moves a pointer, not the slot.
    #[allow(clippy::vec_box)]
    free: Mutex<Vec<Box<Slot>>>,
    permits: Semaphore,
}

impl SlotPool {
    /// Allocates `n` slots for `plan`, with buffers from `engine`.
    pub fn new(n: usize, engine: &dyn Engine, plan: &Plan) -> Result<Arc<SlotPool>, EngineError> {
        let mut free = Vec::with_capacity(n);
        for _ in 0..n {
            free.push(Box::new(Slot {
                inputs: {
                    let mut bufs = engine.alloc_inputs()?;
                    for &bytes in &plan.host_buffers {
                        bufs.push(Box::new(crate::engine::HostBuffer(vec![0; bytes])));
                    }
                    bufs
                },
                outputs: plan
                    .io
                    .outputs
                    .iter()
                    .map(|s| vec![0u8; s.bytes()])
                    .collect(),
                seen: vec![false; plan.inputs.len()],
                reply: Vec::with_capacity(plan.reply_capacity),
                scratch: vec![0u8; plan.scratch_bytes],
                ticket: Ticket::default(),
                reset: false,
                sampling: crate::engine::Sampling::default(),
                leftover: vec![0.0; plan.rtc.map_or(0, |r| r.rows * r.width)],
                continues: None,
                result: None,
            }));
        }
        Ok(Arc::new(SlotPool {
            free: Mutex::new(free),
            permits: Semaphore::new(n),
        }))
    }

    /// Waits for a free slot.
    pub async fn acquire(self: &Arc<Self>) -> Lease {
        // The semaphore is never closed, so acquire cannot fail.
        if let Ok(p) = self.permits.acquire().await {
            p.forget();
        }
        let slot = self.free.lock().unwrap_or_else(|e| e.into_inner()).pop();
        Lease {
            slot,
            pool: self.clone(),
        }
    }

    /// Takes a free slot without waiting, if there is one.
    pub fn try_acquire(self: &Arc<Self>) -> Option<Lease> {
        self.permits.try_acquire().ok()?.forget();
        let slot = self.free.lock().unwrap_or_else(|e| e.into_inner()).pop();
        Some(Lease {
            slot,
            pool: self.clone(),
        })
    }

    fn put(&self, slot: Box<Slot>) {
        self.free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(slot);
        self.permits.add_permits(1);
    }

    /// Free slots now.
    pub fn available(&self) -> usize {
        self.permits.available_permits()
    }
}

/// A slot taken from the pool; returned when dropped.
pub struct Lease {
    slot: Option<Box<Slot>>,
    pool: Arc<SlotPool>,
}

impl Lease {
    pub fn peek(&self) -> &Slot {
        self.slot.as_deref().expect("lease without a slot")
    }

    pub fn slot(&mut self) -> &mut Slot {
        // A lease holds its slot from creation until `submit` consumes the lease.
        self.slot.as_deref_mut().expect("lease without a slot")
    }

    /// Queues the slot for the engine; it comes back on `port`. An `observe` slot may take
    /// the place of its session's waiting one, which is handed back.
    pub fn submit(
        mut self,
        worker: &WorkerHandle,
        port: &ReplyPort,
        key: SessionKey,
    ) -> Result<Option<Lease>, Lease> {
        let Some(slot) = self.slot.take() else {
            return Err(self);
        };
        let kind = slot.ticket.kind;
        let job = Job {
            slot,
            reply_to: port.mailbox.clone(),
        };
        match worker.scheduler.push(key, kind, job) {
            Ok(Pushed::Queued) => Ok(None),
            Ok(Pushed::Replaced(old)) => Ok(Some(Lease {
                slot: Some(old.slot),
                pool: self.pool.clone(),
            })),
            Err(job) => {
                self.slot = Some(job.slot);
                Err(self)
            }
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(s) = self.slot.take() {
            self.pool.put(s);
        }
    }
}

/// Where the worker leaves a connection's finished slots: a fixed deque and a [`Notify`], so
/// delivering a reply allocates nothing.
pub struct Mailbox {
    /// Finished slots, and whether the connection is gone.
    inbox: Mutex<(heapless::Deque<Box<Slot>, MAX_SLOTS>, bool)>,
    ready: Notify,
    pool: Arc<SlotPool>,
}

impl Mailbox {
    fn deliver(&self, slot: Box<Slot>) {
        let mut inbox = self.inbox.lock().unwrap_or_else(|e| e.into_inner());
        if inbox.1 {
            drop(inbox);
            self.pool.put(slot);
            return;
        }
        // There are at most MAX_SLOTS slots, so the deque cannot be full.
        if let Err(slot) = inbox.0.push_back(slot) {
            drop(inbox);
            self.pool.put(slot);
            return;
        }
        drop(inbox);
        self.ready.notify_one();
    }
}

/// A connection's side of its [`Mailbox`]. Dropping it returns every slot delivered later,
/// or not yet read, to the pool.
pub struct ReplyPort {
    mailbox: Arc<Mailbox>,
}

impl ReplyPort {
    pub fn new(pool: &Arc<SlotPool>) -> Self {
        ReplyPort {
            mailbox: Arc::new(Mailbox {
                inbox: Mutex::new((heapless::Deque::new(), false)),
                ready: Notify::new(),
                pool: pool.clone(),
            }),
        }
    }

    /// Waits for a slot to come back from the worker.
    pub async fn recv(&self) -> Lease {
        loop {
            let slot = self
                .mailbox
                .inbox
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .0
                .pop_front();
            if let Some(slot) = slot {
                return Lease {
                    slot: Some(slot),
                    pool: self.mailbox.pool.clone(),
                };
            }
            self.mailbox.ready.notified().await;
        }
    }
}

impl Drop for ReplyPort {
    fn drop(&mut self) {
        let mut inbox = self.mailbox.inbox.lock().unwrap_or_else(|e| e.into_inner());
        inbox.1 = true;
        while let Some(slot) = inbox.0.pop_front() {
            self.mailbox.pool.put(slot);
        }
    }
}

pub struct Job {
    slot: Box<Slot>,
    reply_to: Arc<Mailbox>,
}

impl Job {
    /// A job taken back before it ran: its slot returns to the pool.
    pub fn recycle(self) {
        self.reply_to.pool.put(self.slot);
    }
}

/// How often an idle engine worker shows it is alive.
pub const BEAT: Duration = Duration::from_millis(100);

/// Failed runs in a row after which the engine counts as broken (a GPU in a sticky error
/// state fails every run): health answers 503 and the systemd watchdog is no longer fed, so
/// the service is restarted. One good run makes it healthy again.
pub const FATAL_AFTER: u32 = 5;

/// Progress and health of the worker, shared with the server.
pub struct WorkerState {
    /// When the run in progress started (`None` between runs).
    pub running_since: Mutex<Option<Instant>>,
    /// True while a run has taken longer than `engine.timeout_ms`; connections watch it.
    pub stalled: tokio::sync::watch::Sender<bool>,
    /// Runs completed (warm-up included).
    pub runs: AtomicU64,
    /// Bumped after every run and every idle [`BEAT`]: it stops moving only when the engine
    /// is stuck inside a run, which is what the systemd watchdog must catch.
    pub beats: AtomicU64,
    /// False after [`FATAL_AFTER`] failed runs in a row: the engine needs a restart.
    pub healthy: AtomicBool,
}

/// The engine worker thread.
pub struct WorkerHandle {
    /// Work waiting for the engine; the worker thread pulls from it.
    pub scheduler: Arc<Scheduler<Job>>,
    pub state: Arc<WorkerState>,
    pub pool: Arc<SlotPool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl WorkerHandle {
    /// Warms the engine up (`warmup` runs on fill values), then starts the worker thread.
    /// Returns once the engine is warm, so the server binds only a ready engine.
    pub fn start(
        mut engine: Box<dyn Engine>,
        plan: &Plan,
        slots: usize,
        warmup: usize,
    ) -> Result<(WorkerHandle, Duration), EngineError> {
        let pool = SlotPool::new(slots, engine.as_ref(), plan)?;
        // A slot's buffers past these are the request path's own (`Plan::host_buffers`).
        let engine_inputs = plan.io.inputs.len();
        let t0 = std::time::Instant::now();
        {
            let mut lease = pool
                .try_acquire()
                .ok_or_else(|| EngineError::Run("no slot for warm-up".into()))?;
            let slot = lease.slot();
            plan.fill_all(&mut slot.inputs);
            for _ in 0..warmup {
                engine.run(&mut slot.inputs[..engine_inputs], &mut slot.outputs, true)?;
            }
        }
        let warm = t0.elapsed();
        let state = Arc::new(WorkerState {
            running_since: Mutex::new(None),
            stalled: tokio::sync::watch::Sender::new(false),
            runs: AtomicU64::new(warmup as u64),
            beats: AtomicU64::new(0),
            healthy: AtomicBool::new(true),
        });
        let scheduler: Arc<Scheduler<Job>> = Arc::new(Scheduler::default());
        let st = state.clone();
        let sched = scheduler.clone();
        let thread = std::thread::Builder::new()
            .name("policyd-engine".into())
            .spawn(move || {
                let mut failed_in_a_row = 0u32;
                while let Ok(next) = sched.pop_timeout(BEAT) {
                    if let Some(mut job) = next {
                        let slot = &mut *job.slot;
                        *st.running_since.lock().unwrap_or_else(|e| e.into_inner()) =
                            Some(Instant::now());
                        let continues = slot.continues.map(|request| crate::engine::Continuation {
                            leftover: &slot.leftover,
                            request,
                        });
                        let result = engine.run_sampled(
                            &mut slot.inputs[..engine_inputs],
                            &mut slot.outputs,
                            slot.reset,
                            slot.sampling,
                            continues,
                        );
                        let took = st
                            .running_since
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .take()
                            .map(|t| t.elapsed());
                        if st.stalled.send_if_modified(|s| std::mem::replace(s, false)) {
                            log::warn!(
                                "engine run finished after {:.0} ms; serving again",
                                took.unwrap_or_default().as_secs_f64() * 1e3
                            );
                        }
                        failed_in_a_row = if result.is_ok() {
                            0
                        } else {
                            failed_in_a_row.saturating_add(1)
                        };
                        let healthy = failed_in_a_row < FATAL_AFTER;
                        if st.healthy.swap(healthy, Ordering::Relaxed) != healthy {
                            if healthy {
                                log::warn!("engine runs succeed again; reporting healthy");
                            } else {
                                log::error!(
                                    "engine failed {FATAL_AFTER} runs in a row; reporting \
                                     unhealthy (health 503, watchdog no longer fed)"
                                );
                            }
                        }
                        slot.result = Some(result);
                        st.runs.fetch_add(1, Ordering::Relaxed);
                        job.reply_to.deliver(job.slot);
                    }
                    st.beats.fetch_add(1, Ordering::Relaxed);
                }
            })
            .map_err(|e| EngineError::Run(format!("cannot start the engine thread: {e}")))?;
        Ok((
            WorkerHandle {
                scheduler,
                state,
                pool,
                thread: Some(thread),
            },
            warm,
        ))
    }
}

impl WorkerState {
    /// How long the run in progress has taken, if one is in progress.
    pub fn running_for(&self) -> Option<Duration> {
        self.running_since
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .map(|t| t.elapsed())
    }
}

/// Watches the engine worker: a run longer than `timeout` marks the engine stalled (requests
/// get a timeout error, health answers 503) until it finishes. Runs until aborted.
pub async fn stall_monitor(state: Arc<WorkerState>, timeout: Duration) {
    let mut tick = tokio::time::interval((timeout / 4).clamp(Duration::from_millis(5), BEAT));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(took) = state.running_for() else {
            continue;
        };
        if took > timeout && !*state.stalled.borrow() {
            state.healthy.store(false, Ordering::Relaxed);
            state.stalled.send_replace(true);
            log::error!(
                "engine run has taken {:.0} ms, over engine.timeout_ms = {}: waiting requests \
                 get a timeout error and health answers 503 until it finishes",
                took.as_secs_f64() * 1e3,
                timeout.as_millis()
            );
        }
    }
}

impl Drop for WorkerHandle {
    fn drop(&mut self) {
        // The thread finishes what is queued, then ends.
        self.scheduler.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
