//! What does the TensorRT backend ask of CUDA? Its CUDA side: one context, one stream, memory,
//! copies, events and CUDA graphs, behind a small trait.
//!
//! The engine works on raw device addresses (TensorRT takes `void*` per tensor), so the trait
//! speaks addresses rather than typed slices. [`CudaDevice`] implements it with cudarc (built
//! with dynamic loading, so policyd compiles and starts with no CUDA present); the tests'
//! stand-in implements it on host memory.

use std::ffi::c_void;
use std::time::Duration;

/// A device address (`CUdeviceptr`).
pub type DevicePtr = u64;

#[derive(Debug, thiserror::Error)]
#[error("{op}: {msg}")]
pub struct GpuError {
    pub op: &'static str,
    pub msg: String,
}

impl GpuError {
    pub fn new(op: &'static str, msg: impl std::fmt::Display) -> Self {
        GpuError {
            op,
            msg: msg.to_string(),
        }
    }
}

/// Page-locked host memory; `device` is its address as the GPU sees it when it was mapped
/// (zero-copy), 0 otherwise.
#[derive(Clone, Copy, Debug)]
pub struct HostAlloc {
    pub ptr: *mut u8,
    pub len: usize,
    pub device: DevicePtr,
}

/// An instantiated CUDA graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Graph(pub u64);

/// A loaded kernel: its module and function handles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernel {
    pub module: u64,
    pub function: u64,
}

/// The timing events a run records on the stream: its start, the end of a pipeline's prefix,
/// and its end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mark {
    Start,
    Split,
    End,
}

/// One launch of the sampler's update kernel (`update.ptx`): the sample `x` (updated in place),
/// the step graph's output `m`, the step's noise (0 when it draws none), its ten coefficients
/// (`sampler::Update`, then the step's `rtc::StepTerm`), the word that records the first step
/// whose output was not finite, the element count and the step's index; for real-time
/// chunking, the leftover (`n` values), one weight or strength per row, and the row width
/// (`prev` and `rows` are read only when the step's term asks: 0 without `[rtc]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UpdateArgs {
    pub x: DevicePtr,
    pub m: DevicePtr,
    pub noise: DevicePtr,
    pub coef: DevicePtr,
    pub flag: DevicePtr,
    pub n: u32,
    pub step: u32,
    pub prev: DevicePtr,
    pub rows: DevicePtr,
    pub width: u32,
}

/// Bytes of a step's record the kernel reads: the coefficients, then the RTC term.
pub const UPDATE_RECORD: usize = crate::sampler::Update::BYTES + crate::rtc::StepTerm::BYTES;

/// The PTX of the update kernel and its entry point.
pub const UPDATE_PTX: &str = include_str!("update.ptx");
pub const UPDATE_KERNEL: &str = "policyd_sample_update";
/// Threads per block of an update launch.
pub const UPDATE_BLOCK: u32 = 256;

/// What the TensorRT engine needs from CUDA. Methods take `&self`: the device is shared (by
/// `Arc`) between the engine and the page-locked buffers it hands to the slots, which free
/// themselves through it; stream work happens on the engine worker thread only.
pub trait Device: Send + Sync {
    /// Name and kind, for the log.
    fn describe(&self) -> String;
    /// An integrated GPU (Jetson) shares DRAM with the CPU and can map host memory.
    fn integrated(&self) -> bool;
    /// Makes the context current on the calling thread.
    fn bind(&self) -> Result<(), GpuError>;
    fn alloc_device(&self, bytes: usize) -> Result<DevicePtr, GpuError>;
    /// # Safety
    /// `ptr` came from [`Device::alloc_device`] and is not used afterwards.
    unsafe fn free_device(&self, ptr: DevicePtr);
    /// `mapped`: also map it into the device's address space.
    fn alloc_host(&self, bytes: usize, mapped: bool) -> Result<HostAlloc, GpuError>;
    /// # Safety
    /// `ptr` came from [`Device::alloc_host`] and is not used afterwards.
    unsafe fn free_host(&self, ptr: *mut u8);
    /// The stream every operation goes on (a `CUstream`, which TensorRT takes as its
    /// `cudaStream_t`).
    fn stream(&self) -> *mut c_void;
    /// # Safety
    /// `src` is page-locked host memory of `bytes` bytes that lives until the copy has run.
    unsafe fn copy_htod(
        &self,
        dst: DevicePtr,
        src: *const u8,
        bytes: usize,
    ) -> Result<(), GpuError>;
    /// # Safety
    /// `dst` is page-locked host memory of `bytes` bytes that lives until the copy has run.
    unsafe fn copy_dtoh(&self, dst: *mut u8, src: DevicePtr, bytes: usize) -> Result<(), GpuError>;
    /// # Safety
    /// Both ranges are device memory (or mapped host memory) of `bytes` bytes that lives until
    /// the copy has run.
    unsafe fn copy_dtod(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
    ) -> Result<(), GpuError>;
    /// Records a timing event on the stream.
    fn mark(&self, at: Mark) -> Result<(), GpuError>;
    /// Waits for the end event; the device time between the start and end events.
    fn finish(&self) -> Result<Duration, GpuError>;
    /// After [`Device::finish`]: the device time between the start and split events.
    fn split(&self) -> Result<Duration, GpuError>;
    /// Loads the update kernel ([`UPDATE_PTX`]), JIT-compiling it for this GPU.
    fn load_update(&self) -> Result<Kernel, GpuError>;
    /// # Safety
    /// `kernel` came from [`Device::load_update`], no work queued with it is still to run, and
    /// it is not used afterwards.
    unsafe fn unload(&self, kernel: Kernel);
    /// Queues one update launch on the stream, `UPDATE_BLOCK` threads per block.
    ///
    /// # Safety
    /// Every address in `args` is live device memory of the sizes the kernel reads and writes
    /// until the launch has run.
    unsafe fn launch_update(&self, kernel: Kernel, args: &UpdateArgs) -> Result<(), GpuError>;
    /// Waits for everything queued on the stream (errors ignored by callers that are
    /// tearing down).
    fn synchronize(&self) -> Result<(), GpuError>;
    fn begin_capture(&self) -> Result<(), GpuError>;
    /// Ends a capture and instantiates the graph.
    fn end_capture(&self) -> Result<Graph, GpuError>;
    /// Ends a capture whose work failed to queue: the partial graph is destroyed without
    /// being instantiated, so nothing of it runs or leaks (trtexec's `endCaptureOnError`).
    fn abort_capture(&self);
    fn launch(&self, graph: Graph) -> Result<(), GpuError>;
    /// # Safety
    /// `graph` came from [`Device::end_capture`] and is not launched afterwards.
    unsafe fn destroy_graph(&self, graph: Graph);
}

#[cfg(feature = "tensorrt")]
pub use cuda::CudaDevice;

#[cfg(feature = "tensorrt")]
mod cuda {
    use std::ffi::c_void;
    use std::sync::Arc;
    use std::time::Duration;

    use cudarc::driver::result;
    use cudarc::driver::safe::CudaContext;
    use cudarc::driver::sys;

    use super::{
        Device, DevicePtr, GpuError, Graph, HostAlloc, Kernel, Mark, UPDATE_BLOCK, UPDATE_KERNEL,
        UPDATE_PTX, UpdateArgs,
    };

    /// Whether libcuda can be opened. cudarc panics on any call when it cannot, so this is
    /// asked before anything else.
    pub fn driver_present() -> bool {
        // SAFETY: only tries to open the library.
        unsafe { sys::is_culib_present() }
    }

    /// The CUDA driver through cudarc: the device's primary context (the one TensorRT uses
    /// too), a non-blocking stream and two timing events.
    pub struct CudaDevice {
        ctx: Arc<CudaContext>,
        stream: sys::CUstream,
        start: sys::CUevent,
        split: sys::CUevent,
        end: sys::CUevent,
        name: String,
        integrated: bool,
    }

    // SAFETY: the raw handles belong to `ctx`'s context, and CUDA driver handles may be used
    // from any thread once that context is current (`bind`).
    unsafe impl Send for CudaDevice {}
    unsafe impl Sync for CudaDevice {}

    fn err(op: &'static str) -> impl Fn(result::DriverError) -> GpuError {
        move |e| GpuError::new(op, format!("{e:?}"))
    }

    impl CudaDevice {
        /// Opens device `ordinal`. Call [`driver_present`] first.
        pub fn open(ordinal: usize) -> Result<CudaDevice, GpuError> {
            let ctx = CudaContext::new(ordinal).map_err(err("cuInit/cuDevicePrimaryCtxRetain"))?;
            let name = ctx
                .name()
                .unwrap_or_else(|_| format!("CUDA device {ordinal}"));
            let attr = |a| ctx.attribute(a).unwrap_or(0);
            let integrated = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_INTEGRATED) != 0
                && attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY) != 0;
            let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
                .map_err(err("cuStreamCreate"))?;
            let start = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
                .map_err(err("cuEventCreate"))?;
            let split = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
                .map_err(err("cuEventCreate"))?;
            // The worker sleeps on the end event rather than spinning a core: on a Jetson the
            // CPU is shared with the robot's own stack.
            let end = result::event::create(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC)
                .map_err(err("cuEventCreate"))?;
            Ok(CudaDevice {
                ctx,
                stream,
                start,
                split,
                end,
                name,
                integrated,
            })
        }
    }

    impl Device for CudaDevice {
        fn describe(&self) -> String {
            format!(
                "{} (device {}, {})",
                self.name,
                self.ctx.ordinal(),
                if self.integrated {
                    "integrated: shares DRAM with the CPU"
                } else {
                    "discrete"
                }
            )
        }

        fn integrated(&self) -> bool {
            self.integrated
        }

        fn bind(&self) -> Result<(), GpuError> {
            self.ctx.bind_to_thread().map_err(err("cuCtxSetCurrent"))
        }

        fn alloc_device(&self, bytes: usize) -> Result<DevicePtr, GpuError> {
            self.bind()?;
            // SAFETY: plain allocation; the memory is written before it is read.
            unsafe { result::malloc_sync(bytes.max(1)) }.map_err(err("cuMemAlloc"))
        }

        unsafe fn free_device(&self, ptr: DevicePtr) {
            if self.bind().is_ok() {
                // SAFETY: the caller passes a live allocation once.
                let _ = unsafe { result::free_sync(ptr) };
            }
        }

        fn alloc_host(&self, bytes: usize, mapped: bool) -> Result<HostAlloc, GpuError> {
            self.bind()?;
            let mut flags = sys::CU_MEMHOSTALLOC_PORTABLE;
            if mapped {
                flags |= sys::CU_MEMHOSTALLOC_DEVICEMAP;
            }
            // SAFETY: plain allocation, zeroed below before anyone reads it.
            let ptr = unsafe { result::malloc_host(bytes.max(1), flags) }
                .map_err(err("cuMemHostAlloc"))?
                .cast::<u8>();
            // SAFETY: just allocated, `bytes` long.
            unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
            let mut device: DevicePtr = 0;
            if mapped {
                // SAFETY: `ptr` was allocated with DEVICEMAP in the current context.
                let r = unsafe {
                    sys::cuMemHostGetDevicePointer_v2(&mut device, ptr.cast::<c_void>(), 0)
                };
                if let Err(e) = r.result() {
                    // SAFETY: allocated above and not handed out.
                    let _ = unsafe { result::free_host(ptr.cast()) };
                    return Err(err("cuMemHostGetDevicePointer")(e));
                }
            }
            Ok(HostAlloc {
                ptr,
                len: bytes,
                device,
            })
        }

        unsafe fn free_host(&self, ptr: *mut u8) {
            if self.bind().is_ok() {
                // SAFETY: the caller passes a live allocation once.
                let _ = unsafe { result::free_host(ptr.cast()) };
            }
        }

        fn stream(&self) -> *mut c_void {
            self.stream.cast()
        }

        unsafe fn copy_htod(
            &self,
            dst: DevicePtr,
            src: *const u8,
            bytes: usize,
        ) -> Result<(), GpuError> {
            // SAFETY: the caller guarantees `src` is valid, page-locked and outlives the copy.
            let src = unsafe { std::slice::from_raw_parts(src, bytes) };
            unsafe { result::memcpy_htod_async(dst, src, self.stream) }
                .map_err(err("cuMemcpyHtoDAsync"))
        }

        unsafe fn copy_dtoh(
            &self,
            dst: *mut u8,
            src: DevicePtr,
            bytes: usize,
        ) -> Result<(), GpuError> {
            // SAFETY: the caller guarantees `dst` is valid, page-locked and outlives the copy.
            let dst = unsafe { std::slice::from_raw_parts_mut(dst, bytes) };
            unsafe { result::memcpy_dtoh_async(dst, src, self.stream) }
                .map_err(err("cuMemcpyDtoHAsync"))
        }

        unsafe fn copy_dtod(
            &self,
            dst: DevicePtr,
            src: DevicePtr,
            bytes: usize,
        ) -> Result<(), GpuError> {
            // SAFETY: the caller guarantees both ranges are live for the copy.
            unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream) }
                .map_err(err("cuMemcpyDtoDAsync"))
        }

        fn mark(&self, at: Mark) -> Result<(), GpuError> {
            let ev = match at {
                Mark::Start => self.start,
                Mark::Split => self.split,
                Mark::End => self.end,
            };
            // SAFETY: live event and stream of this context.
            unsafe { result::event::record(ev, self.stream) }.map_err(err("cuEventRecord"))
        }

        fn split(&self) -> Result<Duration, GpuError> {
            // SAFETY: live events, both recorded on the stream and complete (after `finish`).
            let ms = unsafe { result::event::elapsed(self.start, self.split) }
                .map_err(err("cuEventElapsedTime"))?;
            Ok(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1000.0))
        }

        fn load_update(&self) -> Result<Kernel, GpuError> {
            self.bind()?;
            let ptx = std::ffi::CString::new(UPDATE_PTX)
                .map_err(|e| GpuError::new("cuModuleLoadData", e))?;
            let name = std::ffi::CString::new(UPDATE_KERNEL)
                .map_err(|e| GpuError::new("cuModuleGetFunction", e))?;
            // SAFETY: a NUL-terminated PTX image; the module is unloaded if the lookup fails.
            unsafe {
                let module = result::module::load_data(ptx.as_ptr().cast())
                    .map_err(err("cuModuleLoadData (JIT of update.ptx)"))?;
                match result::module::get_function(module, name) {
                    Ok(f) => Ok(Kernel {
                        module: module as u64,
                        function: f as u64,
                    }),
                    Err(e) => {
                        let _ = result::module::unload(module);
                        Err(err("cuModuleGetFunction")(e))
                    }
                }
            }
        }

        unsafe fn unload(&self, kernel: Kernel) {
            if self.bind().is_ok() {
                // SAFETY: the caller passes a loaded module once, its work done.
                let _ = unsafe { result::module::unload(kernel.module as sys::CUmodule) };
            }
        }

        unsafe fn launch_update(&self, kernel: Kernel, a: &UpdateArgs) -> Result<(), GpuError> {
            let mut a = *a;
            let mut params: [*mut c_void; 10] = [
                (&raw mut a.x).cast(),
                (&raw mut a.m).cast(),
                (&raw mut a.noise).cast(),
                (&raw mut a.coef).cast(),
                (&raw mut a.flag).cast(),
                (&raw mut a.n).cast(),
                (&raw mut a.step).cast(),
                (&raw mut a.prev).cast(),
                (&raw mut a.rows).cast(),
                (&raw mut a.width).cast(),
            ];
            let blocks = a.n.div_ceil(UPDATE_BLOCK).max(1);
            // SAFETY: the parameters match the kernel's (.u64 ×5, .u32 ×2, .u64 ×2, .u32), in
            // its order, and are read during the call; the caller guarantees the addresses.
            unsafe {
                result::launch_kernel(
                    kernel.function as sys::CUfunction,
                    (blocks, 1, 1),
                    (UPDATE_BLOCK, 1, 1),
                    0,
                    self.stream,
                    &mut params,
                )
            }
            .map_err(err("cuLaunchKernel"))
        }

        fn finish(&self) -> Result<Duration, GpuError> {
            // SAFETY: live events, both recorded on the stream.
            unsafe { result::event::synchronize(self.end) }.map_err(err("cuEventSynchronize"))?;
            let ms = unsafe { result::event::elapsed(self.start, self.end) }
                .map_err(err("cuEventElapsedTime"))?;
            Ok(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1000.0))
        }

        fn synchronize(&self) -> Result<(), GpuError> {
            // SAFETY: live stream of this context.
            unsafe { result::stream::synchronize(self.stream) }.map_err(err("cuStreamSynchronize"))
        }

        fn begin_capture(&self) -> Result<(), GpuError> {
            // SAFETY: live stream; thread-local mode so other threads' CUDA calls are unaffected.
            unsafe {
                result::stream::begin_capture(
                    self.stream,
                    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                )
            }
            .map_err(err("cuStreamBeginCapture"))
        }

        fn end_capture(&self) -> Result<Graph, GpuError> {
            // SAFETY: live stream in capture mode; the template is destroyed once instantiated.
            unsafe {
                let graph =
                    result::stream::end_capture(self.stream).map_err(err("cuStreamEndCapture"))?;
                if graph.is_null() {
                    return Err(GpuError::new("cuStreamEndCapture", "no graph was captured"));
                }
                let exec = result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0));
                let _ = result::graph::destroy(graph);
                let exec = exec.map_err(err("cuGraphInstantiate"))?;
                if let Err(e) = result::graph::upload(exec, self.stream) {
                    let _ = result::graph::exec_destroy(exec);
                    return Err(err("cuGraphUpload")(e));
                }
                Ok(Graph(exec as u64))
            }
        }

        fn abort_capture(&self) {
            // SAFETY: live stream; a capture invalidated by the failure still ends (with an
            // error, and possibly a graph), and whatever graph comes back is destroyed here.
            unsafe {
                if let Ok(graph) = result::stream::end_capture(self.stream)
                    && !graph.is_null()
                {
                    let _ = result::graph::destroy(graph);
                }
            }
        }

        fn launch(&self, graph: Graph) -> Result<(), GpuError> {
            // SAFETY: `graph` is a live executable graph of this context.
            unsafe { result::graph::launch(graph.0 as sys::CUgraphExec, self.stream) }
                .map_err(err("cuGraphLaunch"))
        }

        unsafe fn destroy_graph(&self, graph: Graph) {
            // SAFETY: the caller passes a live graph once.
            let _ = unsafe { result::graph::exec_destroy(graph.0 as sys::CUgraphExec) };
        }
    }

    impl Drop for CudaDevice {
        fn drop(&mut self) {
            if self.bind().is_ok() {
                // SAFETY: owned handles, destroyed once, after the stream's work is done.
                unsafe {
                    let _ = result::stream::synchronize(self.stream);
                    let _ = result::event::destroy(self.start);
                    let _ = result::event::destroy(self.split);
                    let _ = result::event::destroy(self.end);
                    let _ = result::stream::destroy(self.stream);
                }
            }
        }
    }
}

#[cfg(feature = "tensorrt")]
pub use cuda::driver_present;
