//! The engine worker and the slot pool.
//!
//! A slot is one full set of engine input and output buffers plus a reply buffer, allocated at
//! start-up. A connection takes a free slot, decodes into it, hands it to the worker thread
//! (which owns the engine, so no async task ever blocks on inference), and gets it back with
//! outputs. The number of slots bounds the work in flight; waiting for one is back-pressure,
//! not allocation. Slots are never lost: a connection that goes away mid-inference has its
//! slot returned to the pool by the worker or by the reply port's drop.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Semaphore, mpsc};

use crate::engine::{Engine, EngineError, InputBuffer, RunStats};
use crate::plan::Plan;

/// One request's buffers.
pub struct Slot {
    pub inputs: Vec<Box<dyn InputBuffer>>,
    pub outputs: Vec<Vec<u8>>,
    /// Which bindings the current request supplied.
    pub seen: Vec<bool>,
    /// The encoded reply.
    pub reply: Vec<u8>,
    /// Tell the engine to drop its history before this run.
    pub reset: bool,
    /// The worker's result for the last run.
    pub result: Option<Result<RunStats, EngineError>>,
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
                inputs: engine.alloc_inputs()?,
                outputs: plan
                    .io
                    .outputs
                    .iter()
                    .map(|s| vec![0u8; s.bytes()])
                    .collect(),
                seen: vec![false; plan.inputs.len()],
                reply: Vec::with_capacity(plan.reply_capacity),
                reset: false,
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
    pub fn slot(&mut self) -> &mut Slot {
        // A lease holds its slot from creation until `submit` consumes the lease.
        self.slot.as_deref_mut().expect("lease without a slot")
    }

    /// Hands the slot to the worker; it comes back on `port`.
    pub fn submit(mut self, worker: &WorkerHandle, port: &ReplyPort) -> Result<(), Lease> {
        let Some(slot) = self.slot.take() else {
            return Err(self);
        };
        match worker.tx.try_send(Job {
            slot,
            reply_to: port.tx.clone(),
        }) {
            Ok(()) => Ok(()),
            Err(
                std::sync::mpsc::TrySendError::Full(job)
                | std::sync::mpsc::TrySendError::Disconnected(job),
            ) => {
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

/// Where the worker returns a connection's slot. Dropping it returns any slot still in
/// flight or unread to the pool.
pub struct ReplyPort {
    tx: mpsc::Sender<Box<Slot>>,
    rx: mpsc::Receiver<Box<Slot>>,
    pool: Arc<SlotPool>,
}

impl ReplyPort {
    pub fn new(pool: &Arc<SlotPool>) -> Self {
        // A connection has at most one request in flight.
        let (tx, rx) = mpsc::channel(1);
        ReplyPort {
            tx,
            rx,
            pool: pool.clone(),
        }
    }

    /// Waits for the slot to come back from the worker.
    pub async fn recv(&mut self) -> Option<Lease> {
        let slot = self.rx.recv().await?;
        Some(Lease {
            slot: Some(slot),
            pool: self.pool.clone(),
        })
    }
}

impl Drop for ReplyPort {
    fn drop(&mut self) {
        self.rx.close();
        while let Ok(slot) = self.rx.try_recv() {
            self.pool.put(slot);
        }
    }
}

struct Job {
    slot: Box<Slot>,
    reply_to: mpsc::Sender<Box<Slot>>,
}

/// Progress and health of the worker, shared with the server.
#[derive(Default)]
pub struct WorkerState {
    /// Runs completed (warm-up included): a heartbeat proves this moves.
    pub runs: AtomicU64,
    /// False after the engine failed in a way that needs a restart.
    pub healthy: AtomicBool,
}

/// The engine worker thread.
pub struct WorkerHandle {
    tx: std::sync::mpsc::SyncSender<Job>,
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
        let t0 = std::time::Instant::now();
        {
            let mut lease = pool
                .try_acquire()
                .ok_or_else(|| EngineError::Run("no slot for warm-up".into()))?;
            let slot = lease.slot();
            plan.fill_all(&mut slot.inputs);
            for _ in 0..warmup {
                engine.run(&mut slot.inputs, &mut slot.outputs, true)?;
            }
        }
        let warm = t0.elapsed();
        let state = Arc::new(WorkerState {
            runs: AtomicU64::new(warmup as u64),
            healthy: AtomicBool::new(true),
        });
        let (tx, rx) = std::sync::mpsc::sync_channel::<Job>(slots);
        let st = state.clone();
        let p = pool.clone();
        let thread = std::thread::Builder::new()
            .name("policyd-engine".into())
            .spawn(move || {
                while let Ok(mut job) = rx.recv() {
                    let slot = &mut *job.slot;
                    slot.result = Some(engine.run(&mut slot.inputs, &mut slot.outputs, slot.reset));
                    st.runs.fetch_add(1, Ordering::Relaxed);
                    if let Err(
                        mpsc::error::TrySendError::Closed(s) | mpsc::error::TrySendError::Full(s),
                    ) = job.reply_to.try_send(job.slot)
                    {
                        // The connection is gone: the slot goes back to the pool.
                        p.put(s);
                    }
                }
            })
            .map_err(|e| EngineError::Run(format!("cannot start the engine thread: {e}")))?;
        Ok((
            WorkerHandle {
                tx,
                state,
                pool,
                thread: Some(thread),
            },
            warm,
        ))
    }
}

impl Drop for WorkerHandle {
    fn drop(&mut self) {
        // Closing the job channel ends the thread once in-flight jobs are done.
        let (dead, _) = std::sync::mpsc::sync_channel(0);
        drop(std::mem::replace(&mut self.tx, dead));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
