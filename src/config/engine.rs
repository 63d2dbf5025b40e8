//! `[engine]`: which backend runs the model, where the model is, and the backend's options.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::{ConfigError, Keys, path};
use crate::limits::MAX_SLOTS;

/// `[engine]`: which backend runs which model.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEngine {
    /// `cpu` (tract-onnx), `ort` (onnxruntime, loaded at run time) or `tensorrt` (builds with
    /// the `tensorrt` feature).
    #[serde(default = "default_backend")]
    pub(super) backend: String,
    /// Model file, relative to the config file's folder: ONNX for `cpu`, a TensorRT plan
    /// (built on the device with `trtexec`) for `tensorrt`.
    pub(super) model: Option<PathBuf>,
    /// `tensorrt`, or `ort` with a GPU provider: the CUDA device ordinal.
    #[serde(default)]
    pub(super) device: Option<u32>,
    /// `ort`: the onnxruntime library (`libonnxruntime.so*`, or the folder holding it).
    #[serde(default)]
    pub(super) ort_library: Option<PathBuf>,
    /// `ort`: execution providers in order of preference (`cpu`, `cuda`, `tensorrt`).
    #[serde(default)]
    pub(super) providers: Option<Vec<String>>,
    /// `ort`: whether the pool's threads spin between ops (`true`) or sleep (`false`).
    #[serde(default)]
    pub(super) spinning: Option<bool>,
    /// `tensorrt`: run on this DLA core (Jetson AGX/NX) instead of the GPU.
    #[serde(default)]
    pub(super) dla_core: Option<u32>,
    /// `tensorrt`: replay copy-in → enqueue → copy-out as one CUDA graph after warm-up.
    #[serde(default)]
    pub(super) cuda_graph: Option<bool>,
    /// `tensorrt`: `auto` (on for integrated GPUs such as Jetson's), `on` or `off`: engine
    /// inputs and outputs live in mapped page-locked host memory, so no copy is made.
    #[serde(default)]
    pub(super) zero_copy: Option<String>,
    /// `tensorrt`: libnvinfer to open (default: the sonames of TensorRT 11, 10, 8).
    #[serde(default)]
    pub(super) tensorrt_library: Option<PathBuf>,
    /// Requests in flight at once (each has its own input and output buffers).
    #[serde(default = "default_slots")]
    pub(super) slots: usize,
    /// Runs before the server reports ready.
    #[serde(default = "default_warmup")]
    pub(super) warmup_runs: usize,
    /// A run taking longer than this counts as a stalled engine (0 = never): waiting requests
    /// get a timeout error, new ones are refused, health answers 503 until it finishes.
    #[serde(default = "default_engine_timeout")]
    pub(super) timeout_ms: u64,
    /// `cpu` and `ort`: threads one run may use (intra-op parallelism).
    #[serde(default = "default_threads")]
    pub(super) threads: usize,
}

impl Default for RawEngine {
    fn default() -> Self {
        RawEngine {
            backend: default_backend(),
            model: None,
            device: None,
            dla_core: None,
            cuda_graph: None,
            zero_copy: None,
            tensorrt_library: None,
            ort_library: None,
            providers: None,
            spinning: None,
            slots: default_slots(),
            warmup_runs: default_warmup(),
            timeout_ms: default_engine_timeout(),
            threads: default_threads(),
        }
    }
}

pub(super) fn default_threads() -> usize {
    1
}

pub(super) fn default_backend() -> String {
    "cpu".into()
}

pub(super) fn default_slots() -> usize {
    2
}

pub(super) fn default_warmup() -> usize {
    3
}

pub(super) fn default_engine_timeout() -> u64 {
    10_000
}

/// `[engine]`: which backend runs the model, resolved (TensorRT options have their defaults).
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    pub backend: Backend,
    /// `tensorrt`, or `ort` with a GPU provider: the CUDA device ordinal.
    pub device: u32,
    /// `tensorrt`: run on this DLA core instead of the GPU.
    pub dla_core: Option<u32>,
    /// `tensorrt`: replay copy-in → enqueue → copy-out as one CUDA graph after warm-up.
    pub cuda_graph: bool,
    /// `tensorrt`: whether engine inputs and outputs live in mapped host memory.
    pub zero_copy: ZeroCopy,
    /// `tensorrt`: libnvinfer to open (default: the sonames of TensorRT 11, 10, 8).
    pub tensorrt_library: Option<PathBuf>,
    /// Requests in flight at once (each has its own input and output buffers).
    pub slots: usize,
    /// Runs before the server reports ready.
    pub warmup_runs: usize,
    /// A run taking longer than this counts as a stalled engine (0 = never).
    pub timeout_ms: u64,
    /// `cpu` and `ort`: threads one run may use; 1 runs on the engine's own thread only.
    pub threads: usize,
    /// `ort`: the onnxruntime library named by the config (resolved against its folder);
    /// `None`: `ORT_DYLIB_PATH`, then the system's library path.
    pub ort_library: Option<PathBuf>,
    /// `ort`: execution providers in order of preference; CPU is always the last resort.
    pub providers: Vec<Provider>,
    /// `ort`: the intra-op pool's threads spin between ops (onnxruntime's default) instead of
    /// sleeping: a run of many small ops does not wait for its threads to wake each time
    /// (SmolVLA at real size, 2 threads: 13 % faster, docs/benchmarks.md), at the cost of
    /// CPU the threads burn while they wait.
    pub spinning: bool,
}

/// `engine.providers`: an onnxruntime execution provider policyd knows how to enable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Provider {
    Cpu,
    Cuda,
    Tensorrt,
}

impl Provider {
    pub const ALL: [Provider; 3] = [Provider::Cpu, Provider::Cuda, Provider::Tensorrt];
    /// The config's name.
    pub fn name(self) -> &'static str {
        match self {
            Provider::Cpu => "cpu",
            Provider::Cuda => "cuda",
            Provider::Tensorrt => "tensorrt",
        }
    }
    /// onnxruntime's own name (what `GetAvailableProviders` lists).
    pub fn ort_name(self) -> &'static str {
        match self {
            Provider::Cpu => "CPUExecutionProvider",
            Provider::Cuda => "CUDAExecutionProvider",
            Provider::Tensorrt => "TensorrtExecutionProvider",
        }
    }
}

/// `engine.backend`: the backends this build can have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// tract-onnx, pure Rust.
    Cpu,
    /// TensorRT through policyd's C ABI (the `tensorrt` feature).
    Tensorrt,
    /// onnxruntime through the `ort` crate, its library loaded at run time (the `ort` feature).
    Ort,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Tensorrt => "tensorrt",
            Backend::Ort => "ort",
        }
    }
}

/// `engine.zero_copy`: whether a GPU backend keeps engine inputs and outputs in mapped host
/// memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ZeroCopy {
    /// On for integrated GPUs (Jetson: CPU and GPU share DRAM), off for discrete ones.
    Auto,
    On,
    Off,
}

/// Where a model comes from.
#[derive(Clone, PartialEq)]
pub enum ModelSource {
    /// A file on disk (`[engine] model`, resolved against the config's folder).
    File(PathBuf),
    /// Bytes built into the binary (the embedded demo policy, a firmware image), with the
    /// graph's external data (`<graph>.data`: weights past ONNX's 2 GB protobuf limit), empty
    /// when it has none.
    Embedded {
        name: &'static str,
        bytes: &'static [u8],
        data: &'static [u8],
    },
}

/// The path, or the built-in file's name and size (not its bytes).
impl std::fmt::Debug for ModelSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModelSource::File(p) => f.debug_tuple("File").field(p).finish(),
            ModelSource::Embedded { name, bytes, data } => {
                write!(
                    f,
                    "Embedded({name}, {} + {} bytes)",
                    bytes.len(),
                    data.len()
                )
            }
        }
    }
}

impl ModelSource {
    pub fn describe(&self) -> String {
        match self {
            ModelSource::File(p) => p.display().to_string(),
            ModelSource::Embedded { name, .. } => format!("<embedded {name}>"),
        }
    }

    /// Size of the model's weights as stored, for the memory budget: with the external data
    /// `policyd-export` writes beside a large graph (`<graph>.data`).
    pub fn size(&self) -> u64 {
        let len = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
        match self {
            ModelSource::File(p) => len(p) + len(&external_data_path(p)),
            ModelSource::Embedded { bytes, data, .. } => (bytes.len() + data.len()) as u64,
        }
    }
}

impl ModelSource {
    /// The embedded model's external data (empty for a file or a graph without any).
    pub fn embedded_data(&self) -> &'static [u8] {
        match self {
            ModelSource::Embedded { data, .. } => data,
            ModelSource::File(_) => &[],
        }
    }
}

/// Where `policyd-export` puts a graph's external data: `<graph>.data` beside it (ONNX names
/// the file inside the graph; a firmware image bakes this one).
pub fn external_data_path(model: &Path) -> PathBuf {
    let mut name = model.as_os_str().to_owned();
    name.push(".data");
    PathBuf::from(name)
}

/// `[engine]`, and the model it names.
pub(super) fn engine(
    cx: &Keys,
    e: &RawEngine,
    base: Option<&Path>,
) -> Result<(EngineConfig, ModelSource), ConfigError> {
    // Whether this build has the backend is the engine layer's question (policy::build):
    // a client such as policyd-bench reads any server's config.
    let backend = cx.one_of(
        "engine.backend",
        Some(&e.backend),
        None,
        &[
            ("cpu", Backend::Cpu),
            ("ort", Backend::Ort),
            ("tensorrt", Backend::Tensorrt),
        ],
    )?;
    backend_keys(cx, e, backend)?;
    let providers = match &e.providers {
        None => vec![Provider::Cpu],
        Some(list) => providers(cx, list)?,
    };
    if backend == Backend::Ort
        && e.device.is_some()
        && !providers.iter().any(|p| *p != Provider::Cpu)
    {
        return Err(cx.invalid(
            "engine.device",
            "applies to the ort backend with a GPU provider only; add \"cuda\" or \"tensorrt\" to engine.providers",
        ));
    }
    let ort_library = ort_library(cx, e, base)?;
    let zero_copy = cx.one_of(
        "engine.zero_copy",
        e.zero_copy.as_deref(),
        Some(ZeroCopy::Auto),
        &[
            ("auto", ZeroCopy::Auto),
            ("on", ZeroCopy::On),
            ("off", ZeroCopy::Off),
        ],
    )?;
    let Some(model) = &e.model else {
        return Err(cx.invalid("engine.model", "missing: give the path of the ONNX model"));
    };
    cx.between("engine.slots", e.slots, 1, MAX_SLOTS)?;
    if e.timeout_ms != 0 && !(10..=3_600_000).contains(&e.timeout_ms) {
        return Err(cx.invalid(
            "engine.timeout_ms",
            format!(
                "must be 0 (never) or between 10 and 3600000, got {}",
                e.timeout_ms
            ),
        ));
    }
    // Validated against the machine that starts: more threads than CPUs only contend (and
    // steal time from the serving threads).
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if !(1..=cpus).contains(&e.threads) {
        return Err(cx.invalid(
            "engine.threads",
            format!(
                "must be within 1..={cpus} (this machine's CPUs), got {}",
                e.threads
            ),
        ));
    }
    if e.warmup_runs > 1000 {
        return Err(cx.invalid(
            "engine.warmup_runs",
            format!("must be at most 1000, got {}", e.warmup_runs),
        ));
    }
    Ok((
        EngineConfig {
            backend,
            device: e.device.unwrap_or(0),
            dla_core: e.dla_core,
            cuda_graph: e.cuda_graph.unwrap_or(true),
            zero_copy,
            tensorrt_library: e.tensorrt_library.clone(),
            slots: e.slots,
            warmup_runs: e.warmup_runs,
            timeout_ms: e.timeout_ms,
            threads: e.threads,
            ort_library,
            providers,
            spinning: e.spinning.unwrap_or(true),
        },
        ModelSource::File(path(base, model)),
    ))
}

/// Keys of one backend set under another: the ort backend's (`ort_library`, `providers`),
/// the tensorrt backend's (`device` also ort's, `dla_core`, `cuda_graph`, `zero_copy`,
/// `tensorrt_library`), and the device and DLA core numbers' ranges.
fn backend_keys(cx: &Keys, e: &RawEngine, backend: Backend) -> Result<(), ConfigError> {
    if backend != Backend::Ort {
        for (key, set) in [
            ("engine.ort_library", e.ort_library.is_some()),
            ("engine.providers", e.providers.is_some()),
            ("engine.spinning", e.spinning.is_some()),
        ] {
            if set {
                return Err(cx.invalid(
                    key,
                    format!(
                        "applies to the ort backend only; engine.backend is \"{}\"",
                        e.backend
                    ),
                ));
            }
        }
    }
    if backend != Backend::Tensorrt {
        for (key, set) in [
            (
                "engine.device",
                e.device.is_some() && backend != Backend::Ort,
            ),
            ("engine.dla_core", e.dla_core.is_some()),
            ("engine.cuda_graph", e.cuda_graph.is_some()),
            ("engine.zero_copy", e.zero_copy.is_some()),
            ("engine.tensorrt_library", e.tensorrt_library.is_some()),
        ] {
            if set {
                return Err(cx.invalid(
                    key,
                    format!(
                        "applies to the tensorrt backend only; engine.backend is \"{}\"",
                        e.backend
                    ),
                ));
            }
        }
    }
    if let Some(d) = e.device
        && d > 63
    {
        return Err(cx.invalid(
            "engine.device",
            format!("must be a CUDA device ordinal (0-63), got {d}"),
        ));
    }
    if let Some(d) = e.dla_core
        && d > 7
    {
        return Err(cx.invalid(
            "engine.dla_core",
            format!("must be a DLA core number (0 or 1 on Jetson AGX Orin), got {d}"),
        ));
    }
    Ok(())
}

/// `engine.ort_library`: a path that exists (relative to the config file), or none.
fn ort_library(
    cx: &Keys,
    e: &RawEngine,
    base: Option<&Path>,
) -> Result<Option<PathBuf>, ConfigError> {
    Ok(match &e.ort_library {
        None => None,
        Some(p) if p.as_os_str().is_empty() => {
            return Err(cx.invalid(
                "engine.ort_library",
                "is empty; give the path of libonnxruntime.so or of the folder holding it, or leave the key out",
            ));
        }
        Some(p) => {
            let p = path(base, p);
            if !p.exists() {
                return Err(cx.invalid(
                    "engine.ort_library",
                    format!(
                        "{} does not exist; give the path of libonnxruntime.so or of the folder holding it (`pip install onnxruntime` puts it in site-packages/onnxruntime/capi/)",
                        p.display()
                    ),
                ));
            }
            Some(p)
        }
    })
}

/// `engine.providers`: known names, no repeats, at least one.
pub(super) fn providers(cx: &Keys, list: &[String]) -> Result<Vec<Provider>, ConfigError> {
    if list.is_empty() {
        return Err(cx.invalid(
            "engine.providers",
            "is empty; leave it out for the CPU, or list providers such as [\"cuda\", \"cpu\"]",
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    for name in list {
        let p = Provider::ALL
            .into_iter()
            .find(|p| p.name() == name)
            .ok_or_else(|| {
                cx.invalid(
                    "engine.providers",
                    format!("unknown provider \"{name}\": choose from cpu, cuda, tensorrt"),
                )
            })?;
        if out.contains(&p) {
            return Err(cx.invalid("engine.providers", format!("\"{name}\" is listed twice")));
        }
        out.push(p);
    }
    Ok(out)
}
