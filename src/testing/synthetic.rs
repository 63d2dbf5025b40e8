//! What stands in for a model in tests? A synthetic engine: any I/O, a set compute time, scripted
//! failures, no model.
//!
//! For tests and benchmarks that measure serving rather than a network: it is deterministic,
//! allocation-free and tells which observation it ran, because every output element is the
//! first input's first value plus a small ramp (`x0 + k / 1000`).

use std::time::{Duration, Instant};

use crate::engine::{Engine, EngineError, InputBuffer, IoSpec, RunStats};
use crate::transform::{fill_bytes, load_f64};

/// How a [`SyntheticEngine`] behaves on each run.
#[derive(Clone, Copy, Debug, Default)]
pub struct Behaviour {
    /// Time each run takes (slept, then spun for the last 200 µs to be exact).
    pub compute: Duration,
    /// Fail every n-th run (0 = never).
    pub fail_every: u64,
    /// Fail every run from this one on (0 = never), as a broken accelerator would.
    pub fail_from: u64,
    /// Hang for `stall` on this run (0 = never), as a stuck accelerator would.
    pub stall_on_run: u64,
    pub stall: Duration,
}

pub struct SyntheticEngine {
    io: IoSpec,
    behaviour: Behaviour,
    runs: u64,
}

/// A plain host buffer (also what tests decode into).
pub use crate::engine::HostBuffer;

impl SyntheticEngine {
    pub fn new(io: IoSpec, behaviour: Behaviour) -> Self {
        SyntheticEngine {
            io,
            behaviour,
            runs: 0,
        }
    }
}

impl Engine for SyntheticEngine {
    fn backend(&self) -> &'static str {
        "synthetic"
    }

    fn io(&self) -> &IoSpec {
        &self.io
    }

    fn alloc_inputs(&self) -> Result<Vec<Box<dyn InputBuffer>>, EngineError> {
        Ok(self
            .io
            .inputs
            .iter()
            .map(|s| Box::new(HostBuffer(vec![0u8; s.bytes()])) as Box<dyn InputBuffer>)
            .collect())
    }

    fn run(
        &mut self,
        inputs: &mut [Box<dyn InputBuffer>],
        outputs: &mut [Vec<u8>],
        _reset: bool,
    ) -> Result<RunStats, EngineError> {
        let t0 = Instant::now();
        self.runs += 1;
        let c = self.behaviour.compute;
        if c > Duration::from_micros(200) {
            std::thread::sleep(c - Duration::from_micros(200));
        }
        while t0.elapsed() < c {
            std::hint::spin_loop();
        }
        if self.runs == self.behaviour.stall_on_run {
            std::thread::sleep(self.behaviour.stall);
        }
        let broken = self.behaviour.fail_from > 0 && self.runs >= self.behaviour.fail_from;
        if broken
            || self.behaviour.fail_every > 0 && self.runs.is_multiple_of(self.behaviour.fail_every)
        {
            return Err(EngineError::Run(format!(
                "synthetic failure on run {}",
                self.runs
            )));
        }
        let x0 = match (self.io.inputs.first(), inputs.first_mut()) {
            (Some(spec), Some(buf)) if spec.elements() > 0 => {
                load_f64(spec.dtype, buf.bytes_mut(), 0)
            }
            _ => 0.0,
        };
        for (spec, out) in self.io.outputs.iter().zip(outputs.iter_mut()) {
            let size = spec.dtype.size();
            for (k, e) in out.chunks_exact_mut(size).enumerate() {
                fill_bytes(spec.dtype, x0 + k as f64 / 1000.0, e);
            }
        }
        Ok(RunStats {
            compute: t0.elapsed(),
            stages: None,
        })
    }
}
