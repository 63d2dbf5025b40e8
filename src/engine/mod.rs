//! What runs the policy network? The engine: one trait for every backend, and the specs the config
//! is checked against.
//!
//! A backend loads a model once, reports its real inputs and outputs, allocates host input
//! buffers in the memory it prefers (tract tensors for the CPU backend; page-locked memory for a
//! GPU backend), and runs. The engine worker thread owns it; nothing async ever waits on it.

#[cfg(feature = "cpu")]
pub mod cpu;
mod open;
#[cfg(feature = "ort")]
pub mod ort;
pub use open::{BACKENDS, open};
pub mod pipeline;
pub mod tensorrt;

use std::any::Any;
use std::borrow::Cow;
use std::time::Duration;

use crate::config::ModelSource;
use crate::dtype::ElemType;

/// One engine input or output, as the model declares it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: ElemType,
    pub shape: Vec<usize>,
}

/// Tensors as error messages list them: `'name' dtype [shape]`, comma-separated.
pub fn describe(specs: &[TensorSpec]) -> String {
    specs
        .iter()
        .map(|s| format!("'{}' {} {:?}", s.name, s.dtype, s.shape))
        .collect::<Vec<_>>()
        .join(", ")
}

impl TensorSpec {
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn bytes(&self) -> usize {
        self.elements() * self.dtype.size()
    }
}

/// The model's real I/O, in the order the backend takes and returns them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IoSpec {
    pub inputs: Vec<TensorSpec>,
    pub outputs: Vec<TensorSpec>,
}

impl IoSpec {
    /// Refuses shapes too large to size (over [`crate::limits::MAX_ELEMENTS`] elements), so
    /// that `elements()` and `bytes()` never overflow afterwards. A backend that sizes buffers
    /// from the model's shapes calls it before it allocates; [`crate::bind::Plan::compile`]
    /// calls it for every engine.
    pub fn check_sizes(&self) -> Result<(), String> {
        for (side, specs) in [("input", &self.inputs), ("output", &self.outputs)] {
            for s in specs {
                if crate::limits::element_count(&s.shape).is_none() {
                    return Err(format!(
                        "model {side} '{}' declares shape {:?}, over {} elements",
                        s.name,
                        s.shape,
                        crate::limits::MAX_ELEMENTS
                    ));
                }
            }
        }
        Ok(())
    }
}

/// A host buffer holding one input tensor, in memory the backend chose. The wire decoder
/// writes into `bytes_mut()`; the backend downcasts to its own type to run.
pub trait InputBuffer: Send {
    fn bytes_mut(&mut self) -> &mut [u8];
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// A plain host buffer: the synthetic engine's inputs, and the request path's own buffers in a
/// slot (a prompt's text before it is tokenized).
#[derive(Debug)]
pub struct HostBuffer(pub Vec<u8>);

impl InputBuffer for HostBuffer {
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// What one run measured.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RunStats {
    /// Engine execution time (for a GPU backend, after a device sync).
    pub compute: Duration,
    /// A pipeline's stages: the prefix once, the step graph `steps` times.
    pub stages: Option<Stages>,
}

/// Where a pipeline's time went.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Stages {
    pub prefix: Duration,
    /// Every step: the step graph and the update.
    pub denoise: Duration,
    pub steps: u32,
}

/// A request's sampling: its noise seed and step count (pipelines only).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sampling {
    pub seed: u64,
    pub steps: u32,
}

/// What a request's sampler continues (real-time chunking, `[rtc]`): the previous chunk's
/// leftover in the sample's layout (zero-padded), how many rows of it are real, the delay.
#[derive(Clone, Copy, Debug)]
pub struct Continuation<'a> {
    pub leftover: &'a [f32],
    pub request: crate::rtc::Request,
}

/// A model's bytes: read from its file, or borrowed from the binary (the embedded demo, a
/// firmware image).
pub fn model_bytes(model: &ModelSource) -> Result<Cow<'static, [u8]>, EngineError> {
    match model {
        ModelSource::File(p) => {
            std::fs::read(p)
                .map(Cow::Owned)
                .map_err(|source| EngineError::ReadModel {
                    path: p.display().to_string(),
                    source,
                })
        }
        ModelSource::Embedded { bytes, .. } => Ok(Cow::Borrowed(bytes)),
    }
}

/// Lets the kernel drop the resident pages of bytes built into the binary (a firmware image's
/// external data) once an engine has copied them out: the process then holds the weights once,
/// in the engine, rather than also as the binary's pages. `MADV_PAGEOUT` reclaims clean file
/// pages, which the kernel reads from the binary again if they are touched (a reload), and never
/// discards data it could not read back; on older kernels or other systems it does nothing.
pub(crate) fn release_built_in(bytes: &'static [u8]) {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        let Ok(page) = usize::try_from(page) else {
            return;
        };
        if page == 0 {
            return;
        }
        let start = bytes.as_ptr() as usize;
        let first = start.div_ceil(page) * page;
        let end = (start + bytes.len()) / page * page;
        if end > first {
            // SAFETY: whole pages inside a 'static slice of the binary, which stays mapped; the
            // advice changes no byte of it (reclaimed pages read back the same).
            unsafe {
                libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_PAGEOUT);
            }
        }
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let _ = bytes;
}

/// Returns the heap's free memory to the system once an engine has loaded. Loading copies
/// every weight more than once (tract decodes a graph's whole protobuf before it builds its
/// tensors; onnxruntime copies into its session), and glibc keeps what the copies leave free:
/// SmolVLA's 1.18 GB prefix sat at 1.99 GB of anonymous memory once tract had loaded it, and at
/// 1.18 GB after this (`cargo bench --bench tract_memory -- prefix.onnx`). Elsewhere than glibc
/// it does nothing.
pub(crate) fn release_freed_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// `[engine]` or `[denoise]` asks for what this build or this model cannot do.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("cannot read model file {path}: {source}")]
    ReadModel {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot load model {model}: {reason}")]
    Load { model: String, reason: String },
    #[error(
        "model input '{name}' has a dynamic shape {shape}; give its fixed shape in the binding's `engine_shape`"
    )]
    DynamicShape { name: String, shape: String },
    #[error("model {side} '{name}' has type {dtype}, which policyd cannot bind")]
    UnsupportedType {
        side: &'static str,
        name: String,
        dtype: String,
    },
    #[error("backend '{backend}' is not available: {reason}")]
    Unavailable {
        backend: &'static str,
        reason: String,
    },
    #[error("inference failed: {0}")]
    Run(String),
    #[error("engine output '{name}' has {got} bytes, expected {expected}")]
    OutputSize {
        name: String,
        got: usize,
        expected: usize,
    },
}

/// A model that failed to load, said of the model (`{e:#}`: with the causes of a chained error).
#[cfg(any(feature = "cpu", feature = "ort"))]
pub(crate) fn load_error(model: &ModelSource, e: impl std::fmt::Display) -> EngineError {
    EngineError::Load {
        model: model.describe(),
        reason: format!("{e:#}"),
    }
}

/// Copies one output the backend produced into the slot's buffer, which the plan sized from
/// the model: a size mismatch is an error naming the output (`name` is built only then).
pub(crate) fn copy_output(
    bytes: &[u8],
    out: &mut [u8],
    name: impl FnOnce() -> String,
) -> Result<(), EngineError> {
    if bytes.len() != out.len() {
        return Err(EngineError::OutputSize {
            name: name(),
            got: bytes.len(),
            expected: out.len(),
        });
    }
    out.copy_from_slice(bytes);
    Ok(())
}

/// A loaded, runnable model.
pub trait Engine: Send {
    /// The backend's config name (`cpu`).
    fn backend(&self) -> &'static str;
    /// The model's inputs and outputs.
    fn io(&self) -> &IoSpec;
    /// Allocates one set of input buffers, one per `io().inputs`, sized exactly.
    fn alloc_inputs(&self) -> Result<Vec<Box<dyn InputBuffer>>, EngineError>;
    /// Runs the model on `inputs`, writing each output into `outputs` (sized exactly, in
    /// `io().outputs` order). `reset` tells a stateful policy to drop its history.
    fn run(
        &mut self,
        inputs: &mut [Box<dyn InputBuffer>],
        outputs: &mut [Vec<u8>],
        reset: bool,
    ) -> Result<RunStats, EngineError>;
    /// [`Engine::run`] with the request's sampling (seed, steps) and the chunk it continues
    /// (`[rtc]`); only a pipeline reads them.
    fn run_sampled(
        &mut self,
        inputs: &mut [Box<dyn InputBuffer>],
        outputs: &mut [Vec<u8>],
        reset: bool,
        sampling: Sampling,
        continues: Option<Continuation<'_>>,
    ) -> Result<RunStats, EngineError> {
        let _ = (sampling, continues);
        self.run(inputs, outputs, reset)
    }
    /// Memory the backend allocates for itself, outside the slots (device buffers, staging,
    /// an accelerator's scratch, the CPU engine's intermediate tensors during a run), for the
    /// memory budget: `(what, bytes)`.
    fn working_memory(&self) -> Vec<(String, u64)> {
        Vec::new()
    }

    /// Whether the graph holds what this backend may fail on only at run time, so that
    /// `check-config` must run it once to be sure (tract 0.23's patterns, found by the CPU
    /// engine's scan at load).
    fn needs_trial_run(&self) -> bool {
        false
    }
}
