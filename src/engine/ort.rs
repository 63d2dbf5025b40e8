//! How does policyd run a model on onnxruntime? The `ort` backend: the `ort` crate over a
//! `libonnxruntime.so` loaded at run time (the PyPI wheel's, JetPack's, a system package's), so
//! the build downloads and links nothing and a machine without the library still serves `cpu`.
//!
//! The session, its thread pool and its providers are set up once at load. Every request then
//! runs through one ORT I/O binding whose tensors are views over policyd's own buffers: each
//! slot's inputs (allocated here, 64-byte aligned) and the engine's output buffers. A run is
//! three C calls and a copy of the (small) outputs, and allocates nothing on the Rust side;
//! what onnxruntime allocates inside `RunWithBinding` is its own (see docs/onnxruntime.md).

use std::alloc::Layout;
use std::any::Any;
use std::ffi::{CStr, CString, c_char};
use std::path::{Path, PathBuf};
use std::ptr::{self, NonNull};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use ::ort::AsPointer;
use ::ort::environment::Environment;
use ::ort::session::Session;
use ::ort::session::builder::{GraphOptimizationLevel, SessionBuilder};
use ::ort::sys::{OrtIoBinding, OrtMemoryInfo, OrtStatusPtr, OrtValue};
use ::ort::value::{TensorElementType, ValueType};

use super::{Engine, EngineError, InputBuffer, IoSpec, RunStats, TensorSpec};
use crate::config::{ModelSource, Provider};
use crate::dtype::ElemType;

/// The oldest onnxruntime this build works with (`ort`'s `api-18`: 1.18 added in-memory
/// external data, which firmware images with large graphs need).
pub const MIN_VERSION: &str = "1.18";

/// How to get a library, for every "not found" and "too old" message.
const INSTALL: &str = "install it with `pip install onnxruntime` (x86-64 and aarch64 wheels ship \
     site-packages/onnxruntime/capi/libonnxruntime.so.<version>) and point engine.ort_library \
     (or ORT_DYLIB_PATH) at that file or its folder";

/// What the backend needs from `[engine]`.
pub struct Options<'a> {
    pub library: Option<&'a Path>,
    pub threads: usize,
    pub providers: &'a [Provider],
    /// The CUDA device for the GPU providers.
    pub device: u32,
    /// Fixed shapes (`engine_shape`) for inputs the model leaves symbolic.
    pub shapes: &'a [(String, Vec<usize>)],
    /// `engine.spinning`.
    pub spinning: bool,
}

/// The process's one onnxruntime: the library is loaded once, and its environment (logging,
/// the global state ORT keeps) lives as long as the process.
struct Runtime {
    env: Environment,
    path: PathBuf,
    version: String,
    /// What `GetAvailableProviders` lists.
    providers: Vec<String>,
}

static RUNTIME: OnceLock<Runtime> = OnceLock::new();
static LOADING: Mutex<()> = Mutex::new(());

fn unavailable(reason: String) -> EngineError {
    EngineError::Unavailable {
        backend: "ort",
        reason,
    }
}

/// The candidates, in the order they are tried, each with where it came from.
fn candidates(configured: Option<&Path>) -> Vec<(PathBuf, String)> {
    if let Some(p) = configured {
        return vec![(in_folder(p), "engine.ort_library".into())];
    }
    if let Some(p) = std::env::var_os("ORT_DYLIB_PATH").filter(|p| !p.is_empty()) {
        return vec![(in_folder(Path::new(&p)), "ORT_DYLIB_PATH".into())];
    }
    // dlopen's own search: LD_LIBRARY_PATH, the ld.so cache, /lib and /usr/lib.
    ["libonnxruntime.so", "libonnxruntime.so.1"]
        .into_iter()
        .map(|n| (PathBuf::from(n), "the system's library path".into()))
        .collect()
}

/// A folder stands for the library inside it: `libonnxruntime.so`, else the newest
/// `libonnxruntime.so.<version>` (what the PyPI wheel ships, with no unversioned link).
fn in_folder(p: &Path) -> PathBuf {
    if !p.is_dir() {
        return p.to_path_buf();
    }
    let plain = p.join("libonnxruntime.so");
    if plain.exists() {
        return plain;
    }
    let mut versioned: Vec<(Vec<u32>, PathBuf)> = std::fs::read_dir(p)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let v = name.strip_prefix("libonnxruntime.so.")?;
            let v: Vec<u32> = v
                .split('.')
                .map(|x| x.parse().ok())
                .collect::<Option<_>>()?;
            Some((v, e.path()))
        })
        .collect();
    versioned.sort();
    versioned.pop().map_or(plain, |(_, path)| path)
}

/// Loads onnxruntime once per process (from the first policy's config), with an error that
/// says what was tried and how to install it.
fn runtime(configured: Option<&Path>) -> Result<&'static Runtime, EngineError> {
    let _guard = LOADING.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(rt) = RUNTIME.get() {
        if let Some(want) = configured.map(in_folder)
            && resolved(&want) != rt.path
        {
            return Err(unavailable(format!(
                "engine.ort_library is {}, but this process already runs onnxruntime from {} (one \
                 library per process); restart policyd to switch",
                want.display(),
                rt.path.display()
            )));
        }
        return Ok(rt);
    }
    let mut tried = Vec::new();
    for (path, source) in candidates(configured) {
        match ::ort::init_from(&path) {
            Ok(builder) => {
                let env = builder.with_name("policyd").build().map_err(|e| {
                    unavailable(format!("onnxruntime from {}: {e}", path.display()))
                })?;
                let version = version_of(&path).unwrap_or_else(|| "(unknown version)".into());
                let rt = Runtime {
                    env,
                    path: resolved(&path),
                    version,
                    providers: available_providers(),
                };
                log::info!(
                    "onnxruntime {} from {} ({source}); providers: {}",
                    rt.version,
                    rt.path.display(),
                    rt.providers.join(", ")
                );
                return Ok(RUNTIME.get_or_init(|| rt));
            }
            Err(::ort::LoadDynamicError::BadVersion { version_str, path }) => {
                return Err(unavailable(format!(
                    "onnxruntime {version_str} at {} ({source}) is too old: policyd needs \
                     {MIN_VERSION} or newer; {INSTALL}",
                    path.display()
                )));
            }
            Err(::ort::LoadDynamicError::MissingApi { path }) => {
                return Err(unavailable(format!(
                    "{} ({source}) is not onnxruntime (it has no OrtGetApiBase); {INSTALL}",
                    path.display()
                )));
            }
            Err(e) => tried.push(format!("{} ({source}): {e}", path.display())),
        }
    }
    Err(unavailable(format!(
        "no onnxruntime library ({MIN_VERSION} or newer) was found; tried {}; {INSTALL}",
        tried.join("; ")
    )))
}

/// The loaded library's own version string (`OrtGetApiBase()->GetVersionString()`), asked of
/// the already-loaded library (`RTLD_NOLOAD`: nothing is loaded twice).
fn version_of(path: &Path) -> Option<String> {
    use std::os::unix::ffi::OsStrExt;
    let c = CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: dlopen with NOLOAD only finds a library already loaded; the symbol is ORT's
    // documented entry point, and its string is static.
    unsafe {
        let h = libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        if h.is_null() {
            return None;
        }
        let sym = libc::dlsym(h, c"OrtGetApiBase".as_ptr());
        let version = (!sym.is_null()).then(|| {
            let get: unsafe extern "C" fn() -> *const ::ort::sys::OrtApiBase =
                std::mem::transmute(sym);
            let base = get();
            let v = ((*base).GetVersionString)();
            CStr::from_ptr(v).to_string_lossy().into_owned()
        });
        libc::dlclose(h);
        version
    }
}

/// The library's real path (a bare soname is left as dlopen found it).
fn resolved(p: &Path) -> PathBuf {
    std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf())
}

fn check(status: OrtStatusPtr) -> Result<(), String> {
    if status.0.is_null() {
        return Ok(());
    }
    let api = ::ort::api();
    // SAFETY: a non-null status from ORT, read then released once.
    let msg = unsafe {
        let m = (api.GetErrorMessage)(status.0);
        let msg = if m.is_null() {
            "onnxruntime failed without a message".to_string()
        } else {
            CStr::from_ptr(m).to_string_lossy().into_owned()
        };
        (api.ReleaseStatus)(status.0);
        msg
    };
    Err(msg)
}

fn available_providers() -> Vec<String> {
    let api = ::ort::api();
    let mut names: *mut *mut c_char = ptr::null_mut();
    let mut n = 0;
    // SAFETY: ORT fills `names` with `n` C strings, released below with the same count.
    unsafe {
        if check((api.GetAvailableProviders)(&mut names, &mut n)).is_err() || names.is_null() {
            return Vec::new();
        }
        let list = (0..n.max(0) as usize)
            .map(|i| CStr::from_ptr(*names.add(i)).to_string_lossy().into_owned())
            .collect();
        let _ = check((api.ReleaseAvailableProviders)(names, n));
        list
    }
}

/// A host buffer onnxruntime reads or writes in place: 64-byte aligned (MLAS's vector loads),
/// zeroed, never resized.
struct Aligned {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
}

impl Aligned {
    fn new(len: usize) -> Result<Self, EngineError> {
        let layout = Layout::from_size_align(len.max(1), 64)
            .map_err(|e| EngineError::Run(format!("buffer of {len} bytes: {e}")))?;
        // SAFETY: a non-zero size.
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })
            .ok_or_else(|| EngineError::Run(format!("cannot allocate {len} bytes")))?;
        Ok(Aligned { ptr, len, layout })
    }
    fn bytes(&self) -> &[u8] {
        // SAFETY: `len` initialised bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in `new`.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// An ORT tensor over a buffer policyd owns: the buffer never moves (it is a heap block) and
/// outlives the value (fields drop in order).
struct View {
    value: NonNull<OrtValue>,
    /// Unique in the process: what the binding compares (an address could be reused by a
    /// later value after a slot's buffers were dropped).
    id: u64,
    buf: Aligned,
}

static NEXT_VIEW: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

// SAFETY: the buffer and the OrtValue describing it are used by one thread at a time (the
// engine worker owns the engine and every slot's buffers).
unsafe impl Send for View {}

impl View {
    fn new(spec: &TensorSpec, memory: *const OrtMemoryInfo) -> Result<Self, EngineError> {
        let mut buf = Aligned::new(spec.bytes())?;
        let shape: Vec<i64> = spec.shape.iter().map(|&d| d as i64).collect();
        let mut value: *mut OrtValue = ptr::null_mut();
        // SAFETY: the data pointer covers `spec.bytes()` bytes that live as long as the value.
        let status = unsafe {
            (::ort::api().CreateTensorWithDataAsOrtValue)(
                memory,
                buf.bytes_mut().as_mut_ptr().cast(),
                spec.bytes(),
                shape.as_ptr(),
                shape.len(),
                ort_type(spec.dtype).into(),
                &mut value,
            )
        };
        check(status).map_err(|e| EngineError::Run(format!("tensor '{}': {e}", spec.name)))?;
        let value = NonNull::new(value)
            .ok_or_else(|| EngineError::Run(format!("tensor '{}': null value", spec.name)))?;
        let id = NEXT_VIEW.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(View { value, id, buf })
    }
}

impl Drop for View {
    fn drop(&mut self) {
        // SAFETY: created by CreateTensorWithDataAsOrtValue, released once.
        unsafe { (::ort::api().ReleaseValue)(self.value.as_ptr()) }
    }
}

/// One input tensor of a slot: the wire decoder writes its bytes, ORT reads them in place.
struct OrtInput(View);

impl InputBuffer for OrtInput {
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.0.buf.bytes_mut()
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// The backend.
pub struct OrtEngine {
    io: IoSpec,
    /// Released first (in `Drop`), then the fields in order: the output values, then the
    /// session they belong to.
    binding: NonNull<OrtIoBinding>,
    /// The inputs bound now (a slot's, by [`View`] id); rebound only when another slot runs.
    bound: Vec<u64>,
    input_names: Vec<CString>,
    outputs: Vec<View>,
    memory: ::ort::memory::MemoryInfo<'static>,
    session: Session,
    working: Vec<(String, u64)>,
}

// SAFETY: the session, the binding and the values are used only by the thread that owns the
// engine (the worker); ORT allows a session to move between threads.
unsafe impl Send for OrtEngine {}

impl Drop for OrtEngine {
    fn drop(&mut self) {
        // SAFETY: created by CreateIoBinding for this session, released once, before it.
        unsafe { (::ort::api().ReleaseIoBinding)(self.binding.as_ptr()) }
    }
}

fn ort_type(t: ElemType) -> TensorElementType {
    match t {
        ElemType::Bool => TensorElementType::Bool,
        ElemType::U8 => TensorElementType::Uint8,
        ElemType::I8 => TensorElementType::Int8,
        ElemType::U16 => TensorElementType::Uint16,
        ElemType::I16 => TensorElementType::Int16,
        ElemType::U32 => TensorElementType::Uint32,
        ElemType::I32 => TensorElementType::Int32,
        ElemType::U64 => TensorElementType::Uint64,
        ElemType::I64 => TensorElementType::Int64,
        ElemType::F16 => TensorElementType::Float16,
        ElemType::F32 => TensorElementType::Float32,
        ElemType::F64 => TensorElementType::Float64,
    }
}

fn elem_type(t: TensorElementType) -> Option<ElemType> {
    crate::dtype::ALL_ELEM_TYPES
        .into_iter()
        .find(|&e| ort_type(e) == t)
}

/// Bytes the C heap holds now (glibc): what onnxruntime allocated for a session is the
/// difference around its creation and first run.
fn c_heap() -> Option<u64> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: a plain query of glibc's counters.
        let m = unsafe { libc::mallinfo2() };
        Some((m.uordblks + m.hblkhd) as u64)
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    None
}

impl OrtEngine {
    /// Loads `model` into an onnxruntime session with the config's threads and providers, and
    /// binds it to buffers of its own for outputs.
    pub fn load(model: &ModelSource, opts: &Options) -> Result<Self, EngineError> {
        let rt = runtime(opts.library)?;
        check_providers(rt, opts.providers)?;
        let heap_before = c_heap();
        let mut session = builder(rt, opts)
            .and_then(|b| commit(b, model))
            .map_err(|e| super::load_error(model, e))?;
        let io = io_spec(&session, model, opts.shapes)?;
        io.check_sizes().map_err(|e| super::load_error(model, e))?;
        let memory = ::ort::memory::MemoryInfo::new(
            ::ort::memory::AllocationDevice::CPU,
            0,
            ::ort::memory::AllocatorType::Device,
            ::ort::memory::MemoryType::Default,
        )
        .map_err(|e| super::load_error(model, e))?;
        let outputs = io
            .outputs
            .iter()
            .map(|s| View::new(s, memory.ptr()))
            .collect::<Result<Vec<_>, _>>()?;
        let mut binding: *mut OrtIoBinding = ptr::null_mut();
        // SAFETY: a live session; the binding is released in Drop.
        check(unsafe { (::ort::api().CreateIoBinding)(session.ptr_mut(), &mut binding) })
            .map_err(|e| super::load_error(model, e))?;
        let binding =
            NonNull::new(binding).ok_or_else(|| super::load_error(model, "null I/O binding"))?;
        let cstr = |s: &TensorSpec| {
            CString::new(s.name.as_str())
                .map_err(|_| super::load_error(model, "a tensor name holds NUL"))
        };
        let input_names = io.inputs.iter().map(cstr).collect::<Result<Vec<_>, _>>()?;
        let output_names = io.outputs.iter().map(cstr).collect::<Result<Vec<_>, _>>()?;
        for (name, out) in output_names.iter().zip(&outputs) {
            // SAFETY: the value outlives the binding (both owned by the engine, binding first
            // released).
            check(unsafe {
                (::ort::api().BindOutput)(binding.as_ptr(), name.as_ptr(), out.value.as_ptr())
            })
            .map_err(|e| super::load_error(model, e))?;
        }
        let mut engine = OrtEngine {
            bound: vec![0; io.inputs.len()],
            io,
            binding,
            input_names,
            outputs,
            memory,
            session,
            working: Vec::new(),
        };
        // One run on zeroed inputs at load: a graph that loads but cannot run fails here, and
        // the C heap it takes (weights, prepacked kernels, the arena) is measured for the
        // memory budget.
        let mut probe = engine.alloc_inputs()?;
        let mut out: Vec<Vec<u8>> = engine
            .io
            .outputs
            .iter()
            .map(|s| vec![0; s.bytes()])
            .collect();
        engine
            .run(&mut probe, &mut out, true)
            .map_err(|e| super::load_error(model, e))?;
        drop(probe);
        if let (Some(before), Some(after)) = (heap_before, c_heap()) {
            engine.working.push((
                "onnxruntime  session, weights and arena after one run (measured at load)".into(),
                after.saturating_sub(before),
            ));
        }
        let outputs_bytes: u64 = engine.io.outputs.iter().map(|s| s.bytes() as u64).sum();
        engine
            .working
            .push(("onnxruntime  output tensors".into(), outputs_bytes));
        log::debug!(
            "{}: onnxruntime session on {} ({} threads)",
            model.describe(),
            opts.providers
                .iter()
                .map(|p| p.name())
                .collect::<Vec<_>>()
                .join(", "),
            opts.threads
        );
        Ok(engine)
    }
}

/// Each configured provider is one this onnxruntime has, or the error says what to install.
fn check_providers(rt: &Runtime, providers: &[Provider]) -> Result<(), EngineError> {
    for p in providers {
        if !rt.providers.iter().any(|a| a == p.ort_name()) {
            return Err(unavailable(format!(
                "engine.providers names \"{}\", but onnxruntime {} at {} has only {}; {}",
                p.name(),
                rt.version,
                rt.path.display(),
                rt.providers.join(", "),
                match p {
                    Provider::Cuda =>
                        "install onnxruntime-gpu (with CUDA 12 and cuDNN 9) and point engine.ort_library at its library",
                    Provider::Tensorrt =>
                        "use an onnxruntime built with TensorRT (onnxruntime-gpu with TensorRT's libraries, or JetPack's)",
                    Provider::Cpu => "",
                }
            )));
        }
    }
    Ok(())
}

/// The session's options: threads (intra-op; inter-op stays 1, runs are sequential), all of
/// ORT's graph optimisations, and the providers in the config's order.
fn builder(rt: &Runtime, opts: &Options) -> Result<SessionBuilder, String> {
    let e = |e: ::ort::Error<SessionBuilder>| e.to_string();
    let mut b = Session::builder(&rt.env)
        .map_err(|e| e.to_string())?
        .with_optimization_level(GraphOptimizationLevel::All)
        .map_err(e)?
        .with_intra_threads(opts.threads)
        .map_err(e)?
        .with_inter_threads(1)
        .map_err(e)?
        .with_parallel_execution(false)
        .map_err(e)?;
    if opts.threads > 1 && !opts.spinning {
        // Sleeping between ops leaves the cores to the serving threads and other processes.
        b = b.with_intra_op_spinning(false).map_err(e)?;
    }
    let device = opts.device as i32;
    let eps: Vec<::ort::ep::ExecutionProviderDispatch> = opts
        .providers
        .iter()
        .map(|p| match p {
            Provider::Cpu => ::ort::ep::CPU::default().build().error_on_failure(),
            Provider::Cuda => ::ort::ep::CUDA::default()
                .with_device_id(device)
                .build()
                .error_on_failure(),
            Provider::Tensorrt => ::ort::ep::TensorRT::default()
                .with_device_id(device)
                .build()
                .error_on_failure(),
        })
        .collect();
    b.with_execution_providers(eps).map_err(e)
}

/// The session from a file (external data found beside it) or from the binary's bytes.
fn commit(mut b: SessionBuilder, model: &ModelSource) -> Result<Session, String> {
    match model {
        ModelSource::File(path) => b.commit_from_file(path).map_err(|e| e.to_string()),
        ModelSource::Embedded { bytes, data, name } => {
            if !data.is_empty() {
                // The graph names its external data file relative to itself.
                let file = format!("{}.data", name.rsplit('/').next().unwrap_or(name));
                b = b
                    .with_external_initializer_file_in_memory(file, std::sync::Arc::from(*data))
                    .map_err(|e| e.to_string())?;
            }
            let session = b.commit_from_memory(bytes).map_err(|e| e.to_string());
            // onnxruntime has its copy now: the binary's pages of the graph and its weights
            // can go.
            super::release_built_in(bytes);
            super::release_built_in(data);
            session
        }
    }
}

/// The model's inputs and outputs with fixed shapes: a symbolic input dim from `engine_shape`;
/// a symbolic output dim is refused (policyd sizes every buffer at start-up).
fn io_spec(
    session: &Session,
    model: &ModelSource,
    hints: &[(String, Vec<usize>)],
) -> Result<IoSpec, EngineError> {
    let mut io = IoSpec::default();
    for (side, outlets) in [("input", session.inputs()), ("output", session.outputs())] {
        for o in outlets {
            let name = o.name().to_string();
            let ValueType::Tensor { ty, shape, .. } = o.dtype() else {
                return Err(EngineError::UnsupportedType {
                    side,
                    name,
                    dtype: format!("{:?}", o.dtype()),
                });
            };
            let dtype = elem_type(*ty).ok_or_else(|| EngineError::UnsupportedType {
                side,
                name: name.clone(),
                dtype: format!("{ty:?}"),
            })?;
            let dims: Vec<i64> = shape.iter().copied().collect();
            let fixed = dims.iter().all(|&d| d >= 0);
            let shape = if fixed {
                dims.iter().map(|&d| d as usize).collect()
            } else if side == "input" {
                match hints.iter().find(|(n, _)| *n == name) {
                    Some((_, s)) if s.len() == dims.len() => s.clone(),
                    _ => {
                        return Err(EngineError::DynamicShape {
                            name,
                            shape: format!("{dims:?}"),
                        });
                    }
                }
            } else {
                return Err(super::load_error(
                    model,
                    format!(
                        "output '{name}' has a dynamic shape {dims:?}; export the graph with fixed \
                         output shapes (policyd sizes every buffer at start-up)"
                    ),
                ));
            };
            let spec = TensorSpec { name, dtype, shape };
            if side == "input" {
                io.inputs.push(spec)
            } else {
                io.outputs.push(spec)
            }
        }
    }
    Ok(io)
}

impl Engine for OrtEngine {
    fn backend(&self) -> &'static str {
        "ort"
    }

    fn io(&self) -> &IoSpec {
        &self.io
    }

    fn alloc_inputs(&self) -> Result<Vec<Box<dyn InputBuffer>>, EngineError> {
        self.io
            .inputs
            .iter()
            .map(|s| {
                Ok(Box::new(OrtInput(View::new(s, self.memory.ptr())?)) as Box<dyn InputBuffer>)
            })
            .collect()
    }

    fn run(
        &mut self,
        inputs: &mut [Box<dyn InputBuffer>],
        outputs: &mut [Vec<u8>],
        _reset: bool,
    ) -> Result<RunStats, EngineError> {
        let start = Instant::now();
        if inputs.len() != self.input_names.len() {
            return Err(EngineError::Run(format!(
                "{} input buffers for {} model inputs",
                inputs.len(),
                self.input_names.len()
            )));
        }
        let api = ::ort::api();
        for (i, b) in inputs.iter_mut().enumerate() {
            let input = b
                .as_any_mut()
                .downcast_mut::<OrtInput>()
                .ok_or_else(|| EngineError::Run("input buffer from another backend".into()))?;
            if self.bound[i] != input.0.id {
                let value = input.0.value.as_ptr() as *const OrtValue;
                // SAFETY: the slot's value outlives its binding: a slot's buffers live as long
                // as the engine's worker, and a binding is replaced before any other run.
                check(unsafe {
                    (api.BindInput)(self.binding.as_ptr(), self.input_names[i].as_ptr(), value)
                })
                .map_err(EngineError::Run)?;
                self.bound[i] = input.0.id;
            }
        }
        // SAFETY: a live session and binding, every bound value alive.
        check(unsafe {
            (api.RunWithBinding)(self.session.ptr_mut(), ptr::null(), self.binding.as_ptr())
        })
        .map_err(EngineError::Run)?;
        let compute = start.elapsed();
        for ((spec, out), view) in self
            .io
            .outputs
            .iter()
            .zip(outputs.iter_mut())
            .zip(&self.outputs)
        {
            super::copy_output(view.buf.bytes(), out, || spec.name.clone())?;
        }
        Ok(RunStats {
            compute,
            stages: None,
        })
    }

    fn working_memory(&self) -> Vec<(String, u64)> {
        self.working.clone()
    }
}
