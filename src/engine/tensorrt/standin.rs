//! What stands in for TensorRT and CUDA in tests? Stand-ins for the shim's C ABI and for CUDA, so
//! the TensorRT engine's Rust side runs where there is no GPU: binding tensors, buffer sizes, shape
//! checks, error propagation, and the graph and no-graph paths.
//!
//! The stand-in "device" is host memory: device addresses are host addresses, copies are
//! `memcpy`, and the stream runs each operation at once, unless it is capturing, when it
//! records them as a graph to replay (with the addresses of capture time, as CUDA does). The
//! stand-in "TensorRT" reads a plan written as text:
//!
//! ```text
//! input <name> <nvinfer1::DataType> <dims, -1 = dynamic> [host] [format=<TensorFormat>]
//!       [components=<n>]
//! output <name> <DataType> <dims; -1 = the first input's first dim> [format=…] [components=…]
//! profile <name> <min dims> <max dims>   # optimisation profile 0 of a dynamic input
//! fail_enqueue <n>      # the n-th enqueue fails
//! no_capture            # enqueue refuses to run while the stream captures
//! step                  # compute as a step graph (below)
//! ```
//!
//! Like TensorRT, it logs through one process-wide logger (`set_logger`), which must be set
//! before the first engine is loaded.
//!
//! and computes, for every float32 output element k, `x0 + k / 1000`, where x0 is the first
//! input's first element (float32 or uint8): so a test sees which observation ran. A `step`
//! plan computes `0.5·x[k] + Σ first elements of the other inputs + k / 1000` instead, x being
//! its first input (float32), so a sampler's loop depends on the sample, the time and what
//! the prefix wired in.

use std::alloc::Layout;
use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_void};
use std::sync::Mutex;
use std::time::Duration;

use super::device::{Device, DevicePtr, GpuError, Graph, HostAlloc, Kernel, Mark, UpdateArgs};
use super::shim::{LogFn, OK, RawEngine, ShimApi};

const ERR: i32 = -1;

// ---------------------------------------------------------------------------------------------
// Allocations, counted per thread: the unit tests' global allocator (this module is built for
// tests only), so a test can check that a request path allocates nothing.

thread_local! {
    static ALLOCATIONS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

struct Counting;

// SAFETY: forwards to the system allocator; the counter is a const-initialised thread-local
// that never allocates.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: the caller's contract, passed on.
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: as above.
        unsafe { std::alloc::System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// Heap allocations made so far by the calling thread.
pub fn allocations() -> u64 {
    ALLOCATIONS.with(|c| c.get())
}

// ---------------------------------------------------------------------------------------------
// The device.

/// An operation on the stand-in stream.
#[derive(Clone, Copy)]
enum Op {
    Copy {
        dst: usize,
        src: usize,
        bytes: usize,
    },
    /// Run the stand-in engine with the addresses it had when this was queued.
    Compute { engine: usize, addrs: [usize; 8] },
    /// The update kernel, emulated by `sampler::Update::apply` (the arithmetic the PTX does).
    Update(UpdateArgs),
}

#[derive(Default)]
struct Stream {
    capturing: Option<Vec<Op>>,
    graphs: Vec<Option<Vec<Op>>>,
}

/// Host memory posing as a GPU.
pub struct HostDevice {
    pub integrated: bool,
    /// `end_capture` fails, as on a driver that cannot instantiate the graph.
    pub fail_instantiate: bool,
    live: Mutex<HashMap<usize, Layout>>,
    stream: Mutex<Stream>,
    /// Operations run (not recorded), and of those the copies, for tests.
    pub executed: Mutex<u64>,
    pub copies: Mutex<u64>,
    /// Update kernels launched (run, not recorded) and modules loaded and not unloaded.
    pub updates: Mutex<u64>,
    pub modules: Mutex<i64>,
    /// Graphs instantiated, captures aborted, stream synchronisations.
    pub instantiated: Mutex<u64>,
    pub aborted: Mutex<u64>,
    pub synced: Mutex<u64>,
}

impl HostDevice {
    pub fn new(integrated: bool) -> HostDevice {
        HostDevice {
            integrated,
            fail_instantiate: false,
            live: Mutex::new(HashMap::new()),
            stream: Mutex::new(Stream::default()),
            executed: Mutex::new(0),
            copies: Mutex::new(0),
            updates: Mutex::new(0),
            modules: Mutex::new(0),
            instantiated: Mutex::new(0),
            aborted: Mutex::new(0),
            synced: Mutex::new(0),
        }
    }

    /// Graphs instantiated and not destroyed.
    pub fn live_graphs(&self) -> usize {
        let s = self.stream.lock().unwrap();
        s.graphs.iter().filter(|g| g.is_some()).count()
    }

    /// Allocations not yet freed.
    pub fn live(&self) -> usize {
        self.live.lock().unwrap().len()
    }

    fn alloc(&self, bytes: usize) -> *mut u8 {
        let layout = Layout::from_size_align(bytes.max(1), 256).unwrap();
        // SAFETY: non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!p.is_null());
        self.live.lock().unwrap().insert(p as usize, layout);
        p
    }

    fn free(&self, p: usize) {
        let layout = self
            .live
            .lock()
            .unwrap()
            .remove(&p)
            .expect("free of memory this device did not allocate (or a double free)");
        // SAFETY: allocated above with this layout.
        unsafe { std::alloc::dealloc(p as *mut u8, layout) };
    }

    fn submit(&self, op: Op) {
        let mut s = self.stream.lock().unwrap();
        if let Some(ops) = s.capturing.as_mut() {
            ops.push(op);
            return;
        }
        drop(s);
        self.execute(op);
    }

    fn is_capturing(&self) -> bool {
        self.stream.lock().unwrap().capturing.is_some()
    }

    /// Panics unless `p .. p + bytes` lies in one live allocation.
    fn check_live(&self, p: usize, bytes: usize, what: &str) {
        let live = self.live.lock().unwrap();
        assert!(
            live.iter()
                .any(|(&a, l)| p >= a && p + bytes <= a + l.size()),
            "{what} {p:#x} (+{bytes}) is not live device or host memory"
        );
    }

    fn execute(&self, op: Op) {
        *self.executed.lock().unwrap() += 1;
        match op {
            Op::Copy { dst, src, bytes } => {
                *self.copies.lock().unwrap() += 1;
                self.check_live(dst, bytes, "copy destination");
                self.check_live(src, bytes, "copy source");
                // SAFETY: both ranges were just checked to be live allocations.
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
            }
            Op::Compute { engine, addrs } => {
                // SAFETY: the engine pointer was live when the op was queued and the stand-in
                // engine outlives its stream work in these tests.
                let e = unsafe { &*(engine as *const StandinEngine) };
                e.compute(&addrs);
            }
            Op::Update(a) => {
                *self.updates.lock().unwrap() += 1;
                let (n, u) = (a.n as usize, super::device::UPDATE_RECORD);
                self.check_live(a.x as usize, 4 * n, "update x");
                self.check_live(a.m as usize, 4 * n, "update m");
                self.check_live(a.coef as usize, u, "update coefficients");
                self.check_live(a.flag as usize, 4, "update flag");
                // SAFETY: every range was just checked to be a live allocation.
                let (coef, x, m, flag) = unsafe {
                    (
                        std::slice::from_raw_parts(a.coef as *const u8, u),
                        std::slice::from_raw_parts_mut(a.x as *mut f32, n),
                        std::slice::from_raw_parts(a.m as *const f32, n),
                        &mut *(a.flag as *mut u32),
                    )
                };
                let term = crate::rtc::StepTerm::read(&coef[crate::sampler::Update::BYTES..]);
                let coef = crate::sampler::Update::read(coef);
                let noise = (coef.s != 0.0).then(|| {
                    self.check_live(a.noise as usize, 4 * n, "update noise");
                    // SAFETY: checked just above.
                    unsafe { std::slice::from_raw_parts(a.noise as *const f32, n) }
                });
                // The RTC inputs, read as the kernel reads them: only for a guided step.
                let rtc = (term != crate::rtc::StepTerm::Plain).then(|| {
                    let width = a.width as usize;
                    assert!(width > 0, "update width");
                    self.check_live(a.prev as usize, 4 * n, "update leftover");
                    self.check_live(a.rows as usize, 4 * n.div_ceil(width), "update rows");
                    // SAFETY: checked just above.
                    unsafe {
                        (
                            std::slice::from_raw_parts(a.prev as *const f32, n),
                            std::slice::from_raw_parts(a.rows as *const f32, n.div_ceil(width)),
                            width,
                        )
                    }
                });
                for k in 0..n {
                    if !m[k].is_finite() {
                        *flag = (*flag).min(a.step);
                    }
                    let m = match rtc {
                        Some((prev, rows, width)) => {
                            term.apply(m[k], x[k], prev[k], rows[k / width])
                        }
                        None => m[k],
                    };
                    x[k] = coef.apply(x[k], m, noise.map_or(0.0, |z| z[k]));
                }
            }
        }
    }
}

impl Device for HostDevice {
    fn describe(&self) -> String {
        format!(
            "stand-in device ({})",
            if self.integrated {
                "integrated"
            } else {
                "discrete"
            }
        )
    }
    fn integrated(&self) -> bool {
        self.integrated
    }
    fn bind(&self) -> Result<(), GpuError> {
        Ok(())
    }
    fn alloc_device(&self, bytes: usize) -> Result<DevicePtr, GpuError> {
        Ok(self.alloc(bytes) as DevicePtr)
    }
    unsafe fn free_device(&self, ptr: DevicePtr) {
        self.free(ptr as usize);
    }
    fn alloc_host(&self, bytes: usize, mapped: bool) -> Result<HostAlloc, GpuError> {
        let ptr = self.alloc(bytes);
        Ok(HostAlloc {
            ptr,
            len: bytes,
            device: if mapped { ptr as DevicePtr } else { 0 },
        })
    }
    unsafe fn free_host(&self, ptr: *mut u8) {
        self.free(ptr as usize);
    }
    fn stream(&self) -> *mut c_void {
        self as *const HostDevice as *mut c_void
    }
    unsafe fn copy_htod(
        &self,
        dst: DevicePtr,
        src: *const u8,
        bytes: usize,
    ) -> Result<(), GpuError> {
        self.submit(Op::Copy {
            dst: dst as usize,
            src: src as usize,
            bytes,
        });
        Ok(())
    }
    unsafe fn copy_dtoh(&self, dst: *mut u8, src: DevicePtr, bytes: usize) -> Result<(), GpuError> {
        self.submit(Op::Copy {
            dst: dst as usize,
            src: src as usize,
            bytes,
        });
        Ok(())
    }
    unsafe fn copy_dtod(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
    ) -> Result<(), GpuError> {
        self.submit(Op::Copy {
            dst: dst as usize,
            src: src as usize,
            bytes,
        });
        Ok(())
    }
    fn mark(&self, _at: Mark) -> Result<(), GpuError> {
        Ok(())
    }
    fn finish(&self) -> Result<Duration, GpuError> {
        Ok(Duration::from_micros(250))
    }
    fn split(&self) -> Result<Duration, GpuError> {
        Ok(Duration::from_micros(100))
    }
    fn load_update(&self) -> Result<Kernel, GpuError> {
        *self.modules.lock().unwrap() += 1;
        Ok(Kernel {
            module: 1,
            function: 2,
        })
    }
    unsafe fn unload(&self, kernel: Kernel) {
        assert_eq!(kernel.module, 1, "not a module this device loaded");
        *self.modules.lock().unwrap() -= 1;
    }
    unsafe fn launch_update(&self, _kernel: Kernel, args: &UpdateArgs) -> Result<(), GpuError> {
        self.submit(Op::Update(*args));
        Ok(())
    }
    fn synchronize(&self) -> Result<(), GpuError> {
        *self.synced.lock().unwrap() += 1;
        Ok(())
    }
    fn begin_capture(&self) -> Result<(), GpuError> {
        let mut s = self.stream.lock().unwrap();
        if s.capturing.is_some() {
            return Err(GpuError::new("begin_capture", "already capturing"));
        }
        s.capturing = Some(Vec::new());
        Ok(())
    }
    fn end_capture(&self) -> Result<Graph, GpuError> {
        let mut s = self.stream.lock().unwrap();
        let ops = s
            .capturing
            .take()
            .ok_or_else(|| GpuError::new("end_capture", "not capturing"))?;
        if self.fail_instantiate {
            return Err(GpuError::new("cuGraphInstantiate", "stand-in refuses"));
        }
        *self.instantiated.lock().unwrap() += 1;
        s.graphs.push(Some(ops));
        Ok(Graph(s.graphs.len() as u64 - 1))
    }
    fn abort_capture(&self) {
        let mut s = self.stream.lock().unwrap();
        assert!(
            s.capturing.take().is_some(),
            "abort_capture while not capturing"
        );
        *self.aborted.lock().unwrap() += 1;
    }
    fn launch(&self, graph: Graph) -> Result<(), GpuError> {
        // Taken out and put back rather than cloned: a replay allocates nothing, as CUDA's.
        let ops = self.stream.lock().unwrap().graphs[graph.0 as usize]
            .take()
            .ok_or_else(|| GpuError::new("launch", "destroyed graph"))?;
        for &op in &ops {
            self.execute(op);
        }
        self.stream.lock().unwrap().graphs[graph.0 as usize] = Some(ops);
        Ok(())
    }
    unsafe fn destroy_graph(&self, graph: Graph) {
        let g = self.stream.lock().unwrap().graphs[graph.0 as usize].take();
        assert!(g.is_some(), "graph destroyed twice");
    }
}

// ---------------------------------------------------------------------------------------------
// The shim.

struct Tensor {
    name: CString,
    input: bool,
    dtype: i32,
    dims: Vec<i64>,
    shape_set: Option<Vec<i64>>,
    addr: usize,
    /// TensorLocation, TensorFormat, components per element.
    location: i32,
    format: i32,
    components: i32,
    /// Optimisation profile 0: (min, max).
    profile: Option<(Vec<i64>, Vec<i64>)>,
}

/// A stand-in for TensorRT's engine + execution context.
pub struct StandinEngine {
    tensors: Mutex<Vec<Tensor>>,
    fail_enqueue: Option<u64>,
    no_capture: bool,
    step: bool,
    enqueues: Mutex<u64>,
}

/// A tensor's shape as the context resolves it: an input's set shape, or an output whose
/// dynamic dims take the first input's first dim. An iterator, so that compute (in request
/// paths that tests check allocate nothing) can count elements without a vector.
fn resolved<'a>(ts: &'a [Tensor], t: &'a Tensor) -> impl Iterator<Item = i64> + 'a {
    let set = |t: &'a Tensor| t.shape_set.as_ref().unwrap_or(&t.dims);
    let batch = ts.iter().find(|t| t.input).map(|t| set(t)[0]).unwrap_or(1);
    let (dims, input) = if t.input {
        (set(t), true)
    } else {
        (&t.dims, false)
    };
    dims.iter()
        .map(move |&d| if d < 0 && !input { batch } else { d })
}

/// The element count of [`resolved`].
fn elements(ts: &[Tensor], t: &Tensor) -> usize {
    resolved(ts, t).product::<i64>() as usize
}

impl StandinEngine {
    fn parse(plan: &str) -> Result<StandinEngine, String> {
        let mut tensors = Vec::new();
        let mut fail_enqueue = None;
        let mut no_capture = false;
        let mut step = false;
        let dims = |d: &str, line: &str| -> Result<Vec<i64>, String> {
            d.split(',')
                .map(|d| d.parse().map_err(|_| format!("bad dims in {line}")))
                .collect()
        };
        for line in plan.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let w: Vec<&str> = line.split_whitespace().collect();
            match w.as_slice() {
                [io @ ("input" | "output"), name, dtype, d, flags @ ..] => {
                    let mut t = Tensor {
                        name: CString::new(*name).map_err(|e| e.to_string())?,
                        input: *io == "input",
                        dtype: dtype.parse().map_err(|_| format!("bad dtype in {line}"))?,
                        dims: dims(d, line)?,
                        shape_set: None,
                        addr: 0,
                        location: 0,
                        format: 0,
                        components: 1,
                        profile: None,
                    };
                    for f in flags {
                        let num = |v: &str| v.parse().map_err(|_| format!("bad flag in {line}"));
                        match f.split_once('=') {
                            None if *f == "host" => t.location = 1,
                            Some(("format", v)) => t.format = num(v)?,
                            Some(("components", v)) => t.components = num(v)?,
                            _ => return Err(format!("bad flag in {line}")),
                        }
                    }
                    tensors.push(t);
                }
                ["profile", name, min, max] => {
                    let t = tensors
                        .iter_mut()
                        .find(|t: &&mut Tensor| t.name.to_str() == Ok(*name))
                        .ok_or_else(|| format!("profile of an unknown tensor: {line}"))?;
                    t.profile = Some((dims(min, line)?, dims(max, line)?));
                }
                ["fail_enqueue", n] => fail_enqueue = n.parse().ok(),
                ["no_capture"] => no_capture = true,
                ["step"] => step = true,
                _ => return Err(format!("not a plan line: {line}")),
            }
        }
        Ok(StandinEngine {
            tensors: Mutex::new(tensors),
            fail_enqueue,
            no_capture,
            step,
            enqueues: Mutex::new(0),
        })
    }

    fn compute(&self, addrs: &[usize; 8]) {
        if self.step {
            return self.compute_step(addrs);
        }
        let t = self.tensors.lock().unwrap();
        let first = t.iter().position(|t| t.input).unwrap();
        // SAFETY: the address was checked live when it was set, and tests keep it so.
        let x0 = unsafe {
            match t[first].dtype {
                0 => *(addrs[first] as *const f32),
                5 => f32::from(*(addrs[first] as *const u8)),
                _ => 0.0,
            }
        };
        for (i, out) in t.iter().enumerate().filter(|(_, t)| !t.input) {
            let n = elements(&t, out);
            if out.dtype != 0 {
                continue;
            }
            // SAFETY: output buffers are sized by the engine from the same shape.
            let o = unsafe { std::slice::from_raw_parts_mut(addrs[i] as *mut f32, n) };
            for (k, v) in o.iter_mut().enumerate() {
                *v = x0 + k as f32 / 1000.0;
            }
        }
    }
}

impl StandinEngine {
    /// A `step` plan: `0.5·x[k] + Σ first elements of the other inputs + k / 1000`.
    fn compute_step(&self, addrs: &[usize; 8]) {
        let t = self.tensors.lock().unwrap();
        let xi = t
            .iter()
            .position(|t| t.input)
            .expect("a step plan has inputs");
        let nx = elements(&t, &t[xi]);
        // SAFETY: input buffers are sized from the same shapes by the engine or the pipeline.
        let x = unsafe { std::slice::from_raw_parts(addrs[xi] as *const f32, nx) };
        let shift: f32 = (xi + 1..t.len())
            .filter(|&i| t[i].input)
            .map(|i| {
                let a = addrs[i];
                // SAFETY: as above; one element of the input's own type.
                unsafe {
                    match t[i].dtype {
                        0 => *(a as *const f32),
                        3 => *(a as *const i32) as f32,
                        5 => f32::from(*(a as *const u8)),
                        8 => *(a as *const i64) as f32,
                        _ => 0.0,
                    }
                }
            })
            .sum();
        for (i, out) in t.iter().enumerate().filter(|(_, t)| !t.input) {
            let n = elements(&t, out);
            if out.dtype != 0 {
                continue;
            }
            // SAFETY: output buffers are sized by the engine from the same shape.
            let o = unsafe { std::slice::from_raw_parts_mut(addrs[i] as *mut f32, n) };
            for (k, v) in o.iter_mut().enumerate() {
                *v = 0.5 * x[k % x.len()] + shift + k as f32 / 1000.0;
            }
        }
    }
}

fn put(err: *mut c_char, n: usize, msg: &str) -> i32 {
    let bytes = msg.as_bytes();
    let len = bytes.len().min(n.saturating_sub(1));
    // SAFETY: the caller's buffer holds `n` bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), err.cast::<u8>(), len);
        *err.add(len) = 0;
    }
    ERR
}

fn engine<'a>(e: *const RawEngine) -> &'a StandinEngine {
    // SAFETY: stand-in engines are the only RawEngines the stand-in API sees.
    unsafe { &*(e as *const StandinEngine) }
}

/// Fails unless given a path, as a machine without TensorRT would.
unsafe extern "C" fn open_library(p: *const c_char, err: *mut c_char, n: usize) -> i32 {
    if p.is_null() {
        return put(err, n, "libnvinfer.so.10: cannot open shared object file");
    }
    OK
}
unsafe extern "C" fn library_version() -> i32 {
    100300
}
unsafe extern "C" fn header_version() -> i32 {
    100300
}
/// The process-wide logger (function, user pointer as an address, max severity) and how
/// often it was set, as TensorRT holds it.
static LOGGER: Mutex<Option<(LogFn, usize, i32)>> = Mutex::new(None);
pub static LOGGER_SETS: Mutex<u64> = Mutex::new(0);

unsafe extern "C" fn set_logger(log: Option<LogFn>, user: *mut c_void, max: i32) {
    *LOGGER_SETS.lock().unwrap() += 1;
    let mut l = LOGGER.lock().unwrap();
    match (l.as_mut(), log) {
        // Later calls change the severity only, as the shim's do.
        (Some(current), _) => current.2 = max,
        (None, Some(f)) => *l = Some((f, user as usize, max)),
        (None, None) => {}
    }
}

/// Logs through the process logger, if the severity passes.
fn log(severity: i32, msg: &str) {
    let l = *LOGGER.lock().unwrap();
    if let Some((f, user, max)) = l
        && severity <= max
    {
        let msg = CString::new(msg).unwrap();
        // SAFETY: a valid message for the call; `f` is the static the caller registered.
        unsafe { f(severity, msg.as_ptr(), user as *mut c_void) };
    }
}

unsafe extern "C" fn init_plugins(msg: *mut c_char, n: usize) -> i32 {
    put(
        msg,
        n,
        "no plugin library: libnvinfer_plugin.so.10: cannot open shared object file",
    );
    0
}

unsafe extern "C" fn engine_load(
    plan: *const c_void,
    len: usize,
    dla: i32,
    out: *mut *mut RawEngine,
    err: *mut c_char,
    n: usize,
) -> i32 {
    if LOGGER.lock().unwrap().is_none() {
        return put(err, n, "no process logger set before the first runtime");
    }
    // SAFETY: the caller passes a valid plan buffer.
    let plan = unsafe { std::slice::from_raw_parts(plan.cast::<u8>(), len) };
    if dla > 1 {
        return put(
            err,
            n,
            &format!("DLA core {dla} requested, this device has 2"),
        );
    }
    let parsed = std::str::from_utf8(plan)
        .map_err(|e| e.to_string())
        .and_then(StandinEngine::parse);
    match parsed {
        Ok(e) => {
            log(3, "stand-in engine deserialized");
            log(4, "stand-in verbose detail");
            // SAFETY: `out` is valid.
            unsafe { *out = Box::into_raw(Box::new(e)).cast() };
            OK
        }
        Err(why) => put(err, n, &format!("deserializeCudaEngine failed: {why}")),
    }
}
unsafe extern "C" fn engine_free(e: *mut RawEngine) {
    // SAFETY: created by engine_load.
    drop(unsafe { Box::from_raw(e.cast::<StandinEngine>()) });
}
unsafe extern "C" fn num_io(e: *const RawEngine) -> i32 {
    engine(e).tensors.lock().unwrap().len() as i32
}
#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn io_info(
    e: *const RawEngine,
    i: i32,
    name: *mut *const c_char,
    is_input: *mut i32,
    dtype: *mut i32,
    dims: *mut i64,
    nb: *mut i32,
    location: *mut i32,
    format: *mut i32,
    components: *mut i32,
    err: *mut c_char,
    n: usize,
) -> i32 {
    let t = engine(e).tensors.lock().unwrap();
    let Some(t) = t.get(i as usize) else {
        return put(err, n, "index out of range");
    };
    // SAFETY: out-pointers are valid; `dims` holds 8 entries.
    unsafe {
        *name = t.name.as_ptr();
        *is_input = i32::from(t.input);
        *dtype = t.dtype;
        *nb = t.dims.len() as i32;
        std::ptr::copy_nonoverlapping(t.dims.as_ptr(), dims, t.dims.len());
        *location = t.location;
        *format = t.format;
        *components = t.components;
    }
    OK
}
unsafe extern "C" fn profile_shape(
    e: *const RawEngine,
    name: *const c_char,
    which: i32,
    dims: *mut i64,
    nb: *mut i32,
    err: *mut c_char,
    n: usize,
) -> i32 {
    // SAFETY: a valid C string.
    let name = unsafe { CStr::from_ptr(name) };
    let ts = engine(e).tensors.lock().unwrap();
    let Some((min, max)) = ts
        .iter()
        .find(|t| t.name.as_c_str() == name)
        .and_then(|t| t.profile.as_ref())
    else {
        return put(err, n, "the input has no profile shape");
    };
    let d = if which == 0 { min } else { max };
    // SAFETY: out-pointers are valid; `dims` holds 8 entries.
    unsafe {
        *nb = d.len() as i32;
        std::ptr::copy_nonoverlapping(d.as_ptr(), dims, d.len());
    }
    OK
}
unsafe extern "C" fn context_shape(
    e: *const RawEngine,
    name: *const c_char,
    dims: *mut i64,
    nb: *mut i32,
    err: *mut c_char,
    n: usize,
) -> i32 {
    let eng = engine(e);
    // SAFETY: a valid C string.
    let name = unsafe { CStr::from_ptr(name) };
    let ts = eng.tensors.lock().unwrap();
    let Some(t) = ts.iter().find(|t| t.name.as_c_str() == name) else {
        return put(err, n, "unknown tensor");
    };
    let d: Vec<i64> = resolved(&ts, t).collect();
    // SAFETY: out-pointers are valid; `dims` holds 8 entries.
    unsafe {
        *nb = d.len() as i32;
        std::ptr::copy_nonoverlapping(d.as_ptr(), dims, d.len());
    }
    OK
}

unsafe extern "C" fn scratch_size(_e: *const RawEngine) -> i64 {
    4096
}
unsafe extern "C" fn set_input_shape(
    e: *mut RawEngine,
    name: *const c_char,
    dims: *const i64,
    nb: i32,
    err: *mut c_char,
    n: usize,
) -> i32 {
    // SAFETY: valid string and array.
    let (name, dims) = unsafe {
        (
            CStr::from_ptr(name),
            std::slice::from_raw_parts(dims, nb as usize),
        )
    };
    let mut ts = engine(e).tensors.lock().unwrap();
    let Some(t) = ts.iter_mut().find(|t| t.name.as_c_str() == name && t.input) else {
        return put(err, n, "no such input");
    };
    let in_profile = match &t.profile {
        Some((min, max)) => dims
            .iter()
            .zip(min.iter().zip(max))
            .all(|(d, (lo, hi))| (lo..=hi).contains(&d)),
        None => dims.iter().all(|&d| (1..=64).contains(&d)),
    };
    let fits = t.dims.len() == dims.len()
        && t.dims.iter().zip(dims).all(|(&a, &b)| a < 0 || a == b)
        && in_profile;
    if !fits {
        return put(
            err,
            n,
            "setInputShape refused the shape (outside the profile 1..64)",
        );
    }
    t.shape_set = Some(dims.to_vec());
    OK
}
unsafe extern "C" fn set_tensor_address(
    e: *mut RawEngine,
    name: *const c_char,
    ptr: *mut c_void,
    err: *mut c_char,
    n: usize,
) -> i32 {
    // SAFETY: valid string.
    let name = unsafe { CStr::from_ptr(name) };
    let mut ts = engine(e).tensors.lock().unwrap();
    let Some(t) = ts.iter_mut().find(|t| t.name.as_c_str() == name) else {
        return put(err, n, "setTensorAddress: unknown tensor");
    };
    if ptr.is_null() || !(ptr as usize).is_multiple_of(256) {
        return put(err, n, "setTensorAddress: null or misaligned address");
    }
    t.addr = ptr as usize;
    OK
}
unsafe extern "C" fn enqueue(
    e: *mut RawEngine,
    stream: *mut c_void,
    err: *mut c_char,
    n: usize,
) -> i32 {
    let eng = engine(e);
    // SAFETY: the stand-in engine is only ever given a HostDevice's stream.
    let dev = unsafe { &*(stream as *const HostDevice) };
    if eng.no_capture && dev.is_capturing() {
        return put(err, n, "this engine cannot be captured into a CUDA graph");
    }
    let count = {
        let mut c = eng.enqueues.lock().unwrap();
        *c += 1;
        *c
    };
    if eng.fail_enqueue == Some(count) {
        return put(err, n, "stand-in failure");
    }
    let ts = eng.tensors.lock().unwrap();
    let mut addrs = [0usize; 8];
    for (i, t) in ts.iter().enumerate() {
        if t.addr == 0 {
            let msg = format!("tensor '{}' has no address", t.name.to_string_lossy());
            return put(err, n, &msg);
        }
        if t.input && t.dims.iter().any(|&d| d < 0) && t.shape_set.is_none() {
            let msg = format!("input '{}' has no shape set", t.name.to_string_lossy());
            return put(err, n, &msg);
        }
        addrs[i] = t.addr;
    }
    drop(ts);
    dev.submit(Op::Compute {
        engine: e as usize,
        addrs,
    });
    OK
}

pub static API: ShimApi = ShimApi {
    open_library,
    library_version,
    header_version,
    set_logger,
    init_plugins,
    engine_load,
    engine_free,
    num_io,
    io_info,
    profile_shape,
    context_shape,
    scratch_size,
    set_input_shape,
    set_tensor_address,
    enqueue,
    init: std::sync::Once::new(),
};
