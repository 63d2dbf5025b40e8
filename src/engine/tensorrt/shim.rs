//! How does Rust call TensorRT's C++? The C ABI of csrc/trt_shim.h, as a table of function
//! pointers, and a safe handle over it.
//!
//! A table rather than plain `extern` calls so that the same engine code runs against the real
//! shim (compiled by build.rs with the `tensorrt` feature) and against a stand-in written in
//! Rust (`standin.rs`, tests only), which is how the Rust side is tested without a GPU.

use std::ffi::{CStr, CString, c_char, c_void};

/// TensorRT's engine, execution context and runtime, owned by the shim.
#[repr(C)]
pub struct RawEngine {
    _private: [u8; 0],
}

pub type LogFn = unsafe extern "C" fn(severity: i32, msg: *const c_char, user: *mut c_void);

/// The shim's functions; signatures mirror csrc/trt_shim.h.
pub struct ShimApi {
    pub open_library: unsafe extern "C" fn(*const c_char, *mut c_char, usize) -> i32,
    pub library_version: unsafe extern "C" fn() -> i32,
    pub header_version: unsafe extern "C" fn() -> i32,
    pub set_logger: unsafe extern "C" fn(Option<LogFn>, *mut c_void, i32),
    pub init_plugins: unsafe extern "C" fn(*mut c_char, usize) -> i32,
    #[allow(clippy::type_complexity)]
    pub engine_load: unsafe extern "C" fn(
        *const c_void,
        usize,
        i32,
        *mut *mut RawEngine,
        *mut c_char,
        usize,
    ) -> i32,
    pub engine_free: unsafe extern "C" fn(*mut RawEngine),
    pub num_io: unsafe extern "C" fn(*const RawEngine) -> i32,
    #[allow(clippy::type_complexity)]
    pub io_info: unsafe extern "C" fn(
        *const RawEngine,
        i32,
        *mut *const c_char,
        *mut i32,
        *mut i32,
        *mut i64,
        *mut i32,
        *mut i32,
        *mut i32,
        *mut i32,
        *mut c_char,
        usize,
    ) -> i32,
    #[allow(clippy::type_complexity)]
    pub profile_shape: unsafe extern "C" fn(
        *const RawEngine,
        *const c_char,
        i32,
        *mut i64,
        *mut i32,
        *mut c_char,
        usize,
    ) -> i32,
    pub context_shape: unsafe extern "C" fn(
        *const RawEngine,
        *const c_char,
        *mut i64,
        *mut i32,
        *mut c_char,
        usize,
    ) -> i32,
    pub scratch_size: unsafe extern "C" fn(*const RawEngine) -> i64,
    pub set_input_shape: unsafe extern "C" fn(
        *mut RawEngine,
        *const c_char,
        *const i64,
        i32,
        *mut c_char,
        usize,
    ) -> i32,
    pub set_tensor_address:
        unsafe extern "C" fn(*mut RawEngine, *const c_char, *mut c_void, *mut c_char, usize) -> i32,
    pub enqueue: unsafe extern "C" fn(*mut RawEngine, *mut c_void, *mut c_char, usize) -> i32,
    /// The logger and plugins are set up once per table (see `init_process`).
    pub init: std::sync::Once,
}

pub const OK: i32 = 0;
/// `TRT_MAX_DIMS`.
pub const MAX_DIMS: usize = 8;
/// Room for a message from the shim (errors only: the success path never formats).
const ERR_LEN: usize = 512;

/// nvinfer1::DataType.
pub const TRT_FLOAT: i32 = 0;
pub const TRT_HALF: i32 = 1;
pub const TRT_INT8: i32 = 2;
pub const TRT_INT32: i32 = 3;
pub const TRT_BOOL: i32 = 4;
pub const TRT_UINT8: i32 = 5;
pub const TRT_INT64: i32 = 8;

/// nvinfer1::TensorLocation::kDEVICE (kHOST = 1: shape tensors, read by TensorRT on the CPU).
pub const LOCATION_DEVICE: i32 = 0;
/// nvinfer1::TensorFormat::kLINEAR: dense row-major, the only layout policyd sizes for.
pub const FORMAT_LINEAR: i32 = 0;

/// TensorRT's name for a tensor format, for messages.
pub fn format_name(code: i32) -> String {
    const NAMES: [&str; 13] = [
        "kLINEAR",
        "kCHW2",
        "kHWC8",
        "kCHW4",
        "kCHW16",
        "kCHW32",
        "kDHWC8",
        "kCDHW32",
        "kHWC",
        "kDLA_LINEAR",
        "kDLA_HWC4",
        "kHWC16",
        "kDHWC",
    ];
    usize::try_from(code)
        .ok()
        .and_then(|i| NAMES.get(i))
        .map_or_else(|| format!("TensorFormat({code})"), |n| (*n).to_string())
}

/// TensorRT's name for a data type, for messages.
pub fn dtype_name(code: i32) -> String {
    match code {
        TRT_FLOAT => "kFLOAT".into(),
        TRT_HALF => "kHALF".into(),
        TRT_INT8 => "kINT8".into(),
        TRT_INT32 => "kINT32".into(),
        TRT_BOOL => "kBOOL".into(),
        TRT_UINT8 => "kUINT8".into(),
        6 => "kFP8".into(),
        7 => "kBF16".into(),
        TRT_INT64 => "kINT64".into(),
        9 => "kINT4".into(),
        other => format!("DataType({other})"),
    }
}

/// Runs one shim call with an error buffer; the message on failure.
fn call(f: impl FnOnce(*mut c_char, usize) -> i32) -> Result<(), String> {
    let mut err = [0 as c_char; ERR_LEN];
    if f(err.as_mut_ptr(), ERR_LEN) == OK {
        return Ok(());
    }
    // SAFETY: the shim always NUL-terminates within ERR_LEN; the buffer starts zeroed.
    let msg = unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy();
    Err(if msg.is_empty() {
        "failed without a message".into()
    } else {
        msg.into_owned()
    })
}

/// The most verbose TensorRT severity worth passing on at the current log level (TensorRT's
/// INFO goes to debug, VERBOSE to trace; see [`log_message`]).
fn max_severity() -> i32 {
    match log::max_level() {
        log::LevelFilter::Off => -1,
        log::LevelFilter::Error => 1,
        log::LevelFilter::Warn | log::LevelFilter::Info => 2,
        log::LevelFilter::Debug => 3,
        log::LevelFilter::Trace => 4,
    }
}

/// Sets the shim's process-wide logger and initialises TensorRT's plugin library, once per
/// shim (the first engine load; a reload reuses both).
fn init_process(api: &ShimApi) {
    api.init.call_once(|| {
        // SAFETY: a static function; the shim keeps the pointer for the process's life.
        unsafe { (api.set_logger)(Some(log_message), std::ptr::null_mut(), max_severity()) };
        let mut msg = [0 as c_char; ERR_LEN];
        // SAFETY: the buffer is sized as passed and starts zeroed.
        let r = unsafe { (api.init_plugins)(msg.as_mut_ptr(), ERR_LEN) };
        // SAFETY: the shim NUL-terminates within ERR_LEN.
        let msg = unsafe { CStr::from_ptr(msg.as_ptr()) }.to_string_lossy();
        match r {
            1 => log::info!("tensorrt: {msg}"),
            0 => log::info!("tensorrt: {msg} (plans with plugin layers will not load)"),
            _ => log::warn!("tensorrt: {msg} (plans with plugin layers will not load)"),
        }
    });
}

/// TensorRT's log messages, to `log` under the target `tensorrt`. TensorRT's INFO is
/// start-up chatter, so it goes to debug.
unsafe extern "C" fn log_message(severity: i32, msg: *const c_char, _user: *mut c_void) {
    if msg.is_null() {
        return;
    }
    // SAFETY: TensorRT passes a NUL-terminated message valid for the call.
    let msg = unsafe { CStr::from_ptr(msg) }.to_string_lossy();
    let level = match severity {
        0 | 1 => log::Level::Error,
        2 => log::Level::Warn,
        3 => log::Level::Debug,
        _ => log::Level::Trace,
    };
    log::log!(target: "tensorrt", level, "{msg}");
}

/// Opens libnvinfer (`path`, or TensorRT's sonames); its version (e.g. 100300) on success.
pub fn open_library(api: &ShimApi, path: Option<&std::path::Path>) -> Result<i32, String> {
    let c = path.map(|p| CString::new(p.as_os_str().as_encoded_bytes()));
    let c = match c {
        Some(Ok(c)) => Some(c),
        Some(Err(_)) => return Err("the library path contains a NUL byte".into()),
        None => None,
    };
    let ptr = c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: `ptr` is null or a valid C string; the error buffer is sized as passed.
    call(|e, n| unsafe { (api.open_library)(ptr, e, n) })?;
    // SAFETY: no arguments.
    Ok(unsafe { (api.library_version)() })
}

/// `12.3.4` from `120304`-style numbers (major·10000 + minor·100 + patch, as TensorRT 10 and
/// 11 report; 8.x reports major·1000 + minor·100 + patch).
pub fn version_string(v: i32) -> String {
    if v < 0 {
        return "none".into();
    }
    if v >= 100_000 {
        format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100)
    } else {
        format!("{}.{}.{}", v / 1000, (v / 100) % 10, v % 100)
    }
}

/// One I/O tensor as the engine declares it.
#[derive(Clone, Debug)]
pub struct RawTensor {
    pub name: CString,
    pub is_input: bool,
    pub dtype: i32,
    /// -1 for a dynamic dimension.
    pub dims: Vec<i64>,
    /// nvinfer1::TensorLocation ([`LOCATION_DEVICE`] or host).
    pub location: i32,
    /// nvinfer1::TensorFormat ([`FORMAT_LINEAR`] or a vectorised one).
    pub format: i32,
    /// Components per element (1 unless vectorised).
    pub components: i32,
}

/// A deserialized engine with its execution context.
pub struct Handle {
    api: &'static ShimApi,
    raw: *mut RawEngine,
}

// SAFETY: the handle is used from one thread at a time (the engine worker owns it); TensorRT
// objects may move between threads.
unsafe impl Send for Handle {}

impl Handle {
    pub fn load(api: &'static ShimApi, plan: &[u8], dla_core: Option<u32>) -> Result<Self, String> {
        init_process(api);
        let mut raw: *mut RawEngine = std::ptr::null_mut();
        let dla = dla_core.map_or(-1, |d| d as i32);
        // SAFETY: `plan` is valid for its length; `raw` receives the engine on success.
        call(|e, n| unsafe {
            (api.engine_load)(plan.as_ptr().cast(), plan.len(), dla, &mut raw, e, n)
        })?;
        if raw.is_null() {
            return Err("the shim returned no engine".into());
        }
        Ok(Handle { api, raw })
    }

    pub fn tensors(&self) -> Result<Vec<RawTensor>, String> {
        // SAFETY: `raw` is a live engine.
        let n = unsafe { (self.api.num_io)(self.raw) };
        let mut v = Vec::with_capacity(n.max(0) as usize);
        for i in 0..n {
            let mut name: *const c_char = std::ptr::null();
            let (mut is_input, mut dtype, mut nb) = (0i32, 0i32, 0i32);
            let (mut location, mut format, mut components) = (0i32, 0i32, 1i32);
            let mut dims = [0i64; MAX_DIMS];
            // SAFETY: every out-pointer is valid; `dims` holds MAX_DIMS entries.
            call(|e, len| unsafe {
                (self.api.io_info)(
                    self.raw,
                    i,
                    &mut name,
                    &mut is_input,
                    &mut dtype,
                    dims.as_mut_ptr(),
                    &mut nb,
                    &mut location,
                    &mut format,
                    &mut components,
                    e,
                    len,
                )
            })
            .map_err(|m| format!("I/O tensor {i}: {m}"))?;
            if name.is_null() || !(0..=MAX_DIMS as i32).contains(&nb) {
                return Err(format!(
                    "I/O tensor {i}: the shim returned no name or a bad rank"
                ));
            }
            // SAFETY: the shim returns a NUL-terminated name valid while the engine lives.
            let name = unsafe { CStr::from_ptr(name) }.to_owned();
            v.push(RawTensor {
                name,
                is_input: is_input != 0,
                dtype,
                dims: dims[..nb as usize].to_vec(),
                location,
                format,
                components,
            });
        }
        Ok(v)
    }

    /// An input's minimum and maximum shape in optimisation profile 0, if it has one.
    pub fn profile_range(&self, name: &CStr) -> Option<(Vec<i64>, Vec<i64>)> {
        let shape = |which: i32| {
            let mut dims = [0i64; MAX_DIMS];
            let mut nb = 0i32;
            // SAFETY: valid name and out-pointers; `dims` holds MAX_DIMS entries.
            call(|e, n| unsafe {
                (self.api.profile_shape)(
                    self.raw,
                    name.as_ptr(),
                    which,
                    dims.as_mut_ptr(),
                    &mut nb,
                    e,
                    n,
                )
            })
            .ok()
            .filter(|_| (0..=MAX_DIMS as i32).contains(&nb))
            .map(|_| dims[..nb as usize].to_vec())
        };
        Some((shape(0)?, shape(2)?))
    }

    pub fn context_shape(&self, name: &CStr) -> Result<Vec<i64>, String> {
        let mut dims = [0i64; MAX_DIMS];
        let mut nb = 0i32;
        // SAFETY: valid name and out-pointers.
        call(|e, n| unsafe {
            (self.api.context_shape)(self.raw, name.as_ptr(), dims.as_mut_ptr(), &mut nb, e, n)
        })?;
        if !(0..=MAX_DIMS as i32).contains(&nb) {
            return Err("bad rank".into());
        }
        Ok(dims[..nb as usize].to_vec())
    }

    pub fn scratch_size(&self) -> u64 {
        // SAFETY: `raw` is a live engine.
        unsafe { (self.api.scratch_size)(self.raw) }.max(0) as u64
    }

    pub fn set_input_shape(&mut self, name: &CStr, dims: &[i64]) -> Result<(), String> {
        // SAFETY: valid name; `dims` is valid for its length.
        call(|e, n| unsafe {
            (self.api.set_input_shape)(
                self.raw,
                name.as_ptr(),
                dims.as_ptr(),
                dims.len() as i32,
                e,
                n,
            )
        })
    }

    pub fn set_tensor_address(&mut self, name: &CStr, device_ptr: u64) -> Result<(), String> {
        // SAFETY: valid name; the address is a device allocation that outlives the engine.
        call(|e, n| unsafe {
            (self.api.set_tensor_address)(self.raw, name.as_ptr(), device_ptr as *mut c_void, e, n)
        })
    }

    /// # Safety
    /// `stream` is a live CUDA stream of the context the engine was loaded in.
    pub unsafe fn enqueue(&mut self, stream: *mut c_void) -> Result<(), String> {
        // SAFETY: the caller passes a live stream.
        call(|e, n| unsafe { (self.api.enqueue)(self.raw, stream, e, n) })
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: `raw` came from engine_load and is freed once.
        unsafe { (self.api.engine_free)(self.raw) }
    }
}

/// The real shim, compiled from csrc/ by build.rs.
#[cfg(feature = "tensorrt")]
pub mod linked {
    use super::*;

    unsafe extern "C" {
        fn trt_open_library(path: *const c_char, err: *mut c_char, n: usize) -> i32;
        fn trt_library_version() -> i32;
        fn trt_header_version() -> i32;
        fn trt_set_logger(log: Option<LogFn>, user: *mut c_void, max_severity: i32);
        fn trt_init_plugins(msg: *mut c_char, n: usize) -> i32;
        fn trt_engine_load(
            plan: *const c_void,
            len: usize,
            dla: i32,
            out: *mut *mut RawEngine,
            err: *mut c_char,
            n: usize,
        ) -> i32;
        fn trt_engine_free(e: *mut RawEngine);
        fn trt_num_io(e: *const RawEngine) -> i32;
        fn trt_io_info(
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
        ) -> i32;
        fn trt_profile_shape(
            e: *const RawEngine,
            name: *const c_char,
            which: i32,
            dims: *mut i64,
            nb: *mut i32,
            err: *mut c_char,
            n: usize,
        ) -> i32;
        fn trt_context_shape(
            e: *const RawEngine,
            name: *const c_char,
            dims: *mut i64,
            nb: *mut i32,
            err: *mut c_char,
            n: usize,
        ) -> i32;
        fn trt_scratch_size(e: *const RawEngine) -> i64;
        fn trt_set_input_shape(
            e: *mut RawEngine,
            name: *const c_char,
            dims: *const i64,
            nb: i32,
            err: *mut c_char,
            n: usize,
        ) -> i32;
        fn trt_set_tensor_address(
            e: *mut RawEngine,
            name: *const c_char,
            ptr: *mut c_void,
            err: *mut c_char,
            n: usize,
        ) -> i32;
        fn trt_enqueue(e: *mut RawEngine, stream: *mut c_void, err: *mut c_char, n: usize) -> i32;
    }

    pub static API: ShimApi = ShimApi {
        open_library: trt_open_library,
        library_version: trt_library_version,
        header_version: trt_header_version,
        set_logger: trt_set_logger,
        init_plugins: trt_init_plugins,
        engine_load: trt_engine_load,
        engine_free: trt_engine_free,
        num_io: trt_num_io,
        io_info: trt_io_info,
        profile_shape: trt_profile_shape,
        context_shape: trt_context_shape,
        scratch_size: trt_scratch_size,
        set_input_shape: trt_set_input_shape,
        set_tensor_address: trt_set_tensor_address,
        enqueue: trt_enqueue,
        init: std::sync::Once::new(),
    };
}
