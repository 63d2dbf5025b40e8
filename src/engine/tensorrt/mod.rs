//! How does policyd run a model on the Jetson's GPU? The TensorRT backend: a TensorRT plan run
//! through policyd's C++ shim, with CUDA owned by cudarc.
//!
//! Everything is allocated at load: one device buffer per engine tensor, page-locked host
//! buffers that the wire decoder writes into directly (one set per slot), and page-locked
//! output staging. On an integrated GPU (Jetson: CPU and GPU share DRAM) the host buffers are
//! mapped into the GPU's address space and TensorRT reads and writes them in place, so no copy
//! is made at all. After the first run, copy-in → enqueue → copy-out is captured as one CUDA
//! graph per slot (each slot's buffers have fixed addresses), and later runs replay it; an
//! engine that cannot be captured falls back to plain enqueues, with one log line.
//! `RunStats.compute` is device time between two CUDA events, not dispatch time.
//!
//! The engine code depends only on the [`ShimApi`] table and the [`Device`] trait, so the tests
//! run it against stand-ins of both (`standin.rs`); the real ones need the `tensorrt` feature.

pub mod device;
pub mod device_loop;
pub mod shim;
#[cfg(test)]
mod standin;

use std::any::Any;
use std::ffi::CString;
use std::sync::{Arc, Mutex};

use device::{Device, DevicePtr, Graph, HostAlloc, Mark};
use shim::{Handle, ShimApi};

use super::{Engine, EngineError, InputBuffer, IoSpec, RunStats, TensorSpec};
use crate::config::ZeroCopy;
use crate::dtype::ElemType;

/// How the engine is set up (from `[engine]`).
#[derive(Clone, Debug)]
pub struct Options {
    /// For messages: the plan file.
    pub model: String,
    pub dla_core: Option<u32>,
    pub cuda_graph: bool,
    pub zero_copy: ZeroCopy,
    /// Fixed shapes for inputs with dynamic dimensions (`[[inputs]] engine_shape`).
    pub shapes: Vec<(String, Vec<usize>)>,
}

fn elem_type(code: i32) -> Option<ElemType> {
    Some(match code {
        shim::TRT_FLOAT => ElemType::F32,
        shim::TRT_HALF => ElemType::F16,
        shim::TRT_INT8 => ElemType::I8,
        shim::TRT_INT32 => ElemType::I32,
        shim::TRT_BOOL => ElemType::Bool,
        shim::TRT_UINT8 => ElemType::U8,
        shim::TRT_INT64 => ElemType::I64,
        _ => return None,
    })
}

/// Page-locked host memory, freed through the device that allocated it.
struct Pinned {
    alloc: HostAlloc,
    device: Arc<dyn Device>,
}

// SAFETY: the allocation is owned by this value alone; CUDA host memory may be used from any
// thread.
unsafe impl Send for Pinned {}

impl Pinned {
    fn new(device: &Arc<dyn Device>, bytes: usize, mapped: bool) -> Result<Pinned, EngineError> {
        let alloc = device
            .alloc_host(bytes, mapped)
            .map_err(|e| EngineError::Run(format!("cannot allocate page-locked memory: {e}")))?;
        Ok(Pinned {
            alloc,
            device: device.clone(),
        })
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `alloc.ptr` is valid for `alloc.len` bytes while `self` lives.
        unsafe { std::slice::from_raw_parts(self.alloc.ptr, self.alloc.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.alloc.ptr, self.alloc.len) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by `device`, freed once.
        unsafe { self.device.free_host(self.alloc.ptr) }
    }
}

/// One slot's input tensor: page-locked, so the decoder's bytes go to the GPU without a
/// staging copy (or, mapped, are read by the GPU in place).
struct SlotInput {
    mem: Pinned,
    /// Which slot's set this is: its CUDA graph is the one that reads these addresses.
    slot: usize,
}

impl InputBuffer for SlotInput {
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.mem.bytes_mut()
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// Addresses of one slot's input buffers: (host, device view when mapped). Plain numbers:
/// the buffers themselves belong to the slot.
type SlotAddrs = Vec<(usize, DevicePtr)>;

struct Tensor {
    name: CString,
    bytes: usize,
    /// The engine's own device buffer (copy mode), 0 in zero-copy mode.
    device: DevicePtr,
}

struct Output {
    t: Tensor,
    /// Where results land on the host (mapped in zero-copy mode).
    staging: Pinned,
}

/// The TensorRT backend.
pub struct TensorRtEngine {
    /// `None` only while dropping, so the context goes before the memory it points at.
    handle: Option<Handle>,
    device: Arc<dyn Device>,
    io: IoSpec,
    inputs: Vec<Tensor>,
    outputs: Vec<Output>,
    zero_copy: bool,
    use_graphs: bool,
    /// Set when a capture failed: plain enqueues from then on.
    graphs_failed: bool,
    /// Input addresses of every slot handed out by `alloc_inputs`, by slot number.
    slots: Arc<Mutex<Vec<SlotAddrs>>>,
    /// One graph per slot, once captured.
    graphs: Vec<Option<Graph>>,
    /// Zero-copy: the slot whose input addresses TensorRT holds now.
    bound_slot: Option<usize>,
    /// A pipeline's prefix: outputs stay on the device (no copy out).
    keep_outputs: bool,
    runs: u64,
    scratch: u64,
    device_bytes: u64,
    /// Plain runs and graph launches, for tests and the log.
    pub(crate) counts: Counts,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    pub plain: u64,
    pub graph: u64,
    pub captured: u64,
    /// Throwaway runs after a failed capture.
    pub settled: u64,
}

fn load_err(model: &str, reason: impl std::fmt::Display) -> EngineError {
    EngineError::Load {
        model: model.to_string(),
        reason: reason.to_string(),
    }
}

fn run_err(what: &str, e: impl std::fmt::Display) -> EngineError {
    EngineError::Run(format!("{what}: {e}"))
}

impl TensorRtEngine {
    /// Deserializes `plan`, fixes dynamic input shapes, checks every tensor's type and shape,
    /// and allocates the engine's device buffers and output staging.
    pub fn new(
        api: &'static ShimApi,
        device: Arc<dyn Device>,
        plan: &[u8],
        opts: &Options,
    ) -> Result<TensorRtEngine, EngineError> {
        let model = opts.model.as_str();
        device.bind().map_err(|e| load_err(model, e))?;
        let mut handle = Handle::load(api, plan, opts.dla_core).map_err(|e| load_err(model, e))?;
        let raw = handle.tensors().map_err(|e| load_err(model, e))?;
        let zero_copy = match opts.zero_copy {
            ZeroCopy::On => true,
            ZeroCopy::Off => false,
            ZeroCopy::Auto => device.integrated(),
        };

        // policyd sizes and feeds every tensor as a dense, linear buffer in device memory.
        for t in &raw {
            check_layout(t).map_err(|m| load_err(model, m))?;
        }
        // Inputs first: their shapes decide the outputs' (dynamic-shape engines).
        let mut io = IoSpec::default();
        for t in raw.iter().filter(|t| t.is_input) {
            let name = t.name.to_string_lossy().into_owned();
            let dtype = elem_type(t.dtype).ok_or_else(|| EngineError::UnsupportedType {
                side: "input",
                name: name.clone(),
                dtype: shim::dtype_name(t.dtype),
            })?;
            let hint = opts.shapes.iter().find(|(n, _)| *n == name).map(|(_, s)| s);
            let profile = if t.dims.iter().any(|&d| d < 0) {
                handle.profile_range(&t.name)
            } else {
                None
            };
            let shape = fix_shape(&name, &t.dims, hint, profile.as_ref(), model)?;
            if t.dims.iter().any(|&d| d < 0) {
                let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
                handle
                    .set_input_shape(&t.name, &dims)
                    .map_err(|e| load_err(model, format!("input '{name}' shape {shape:?}: {e}")))?;
            }
            io.inputs.push(TensorSpec { name, dtype, shape });
        }
        for t in raw.iter().filter(|t| !t.is_input) {
            let name = t.name.to_string_lossy().into_owned();
            let dtype = elem_type(t.dtype).ok_or_else(|| EngineError::UnsupportedType {
                side: "output",
                name: name.clone(),
                dtype: shim::dtype_name(t.dtype),
            })?;
            let dims = if t.dims.iter().any(|&d| d < 0) {
                handle
                    .context_shape(&t.name)
                    .map_err(|e| load_err(model, format!("output '{name}': {e}")))?
            } else {
                t.dims.clone()
            };
            if dims.iter().any(|&d| d < 0) {
                return Err(load_err(
                    model,
                    format!(
                        "output '{name}' has a dynamic shape {dims:?} even with every input \
                         shape fixed; policyd needs fixed output sizes"
                    ),
                ));
            }
            let shape = dims.iter().map(|&d| d as usize).collect();
            io.outputs.push(TensorSpec { name, dtype, shape });
        }
        if io.inputs.is_empty() || io.outputs.is_empty() {
            return Err(load_err(model, "the engine has no inputs or no outputs"));
        }
        io.check_sizes().map_err(|m| load_err(model, m))?;

        let mut engine = TensorRtEngine {
            handle: None,
            device: device.clone(),
            io,
            inputs: Vec::new(),
            outputs: Vec::new(),
            zero_copy,
            use_graphs: opts.cuda_graph,
            graphs_failed: false,
            slots: Arc::new(Mutex::new(Vec::new())),
            graphs: Vec::new(),
            bound_slot: None,
            keep_outputs: false,
            runs: 0,
            scratch: handle.scratch_size(),
            device_bytes: 0,
            counts: Counts::default(),
        };
        let alloc_err = |e| load_err(model, format!("cannot allocate device memory: {e}"));
        for (spec, t) in engine
            .io
            .inputs
            .iter()
            .zip(raw.iter().filter(|t| t.is_input))
        {
            let bytes = spec.bytes();
            let mut dev = 0;
            if !zero_copy {
                dev = device.alloc_device(bytes).map_err(alloc_err)?;
                engine.device_bytes += bytes as u64;
                handle
                    .set_tensor_address(&t.name, dev)
                    .map_err(|e| load_err(model, format!("input '{}': {e}", spec.name)))?;
            }
            engine.inputs.push(Tensor {
                name: t.name.clone(),
                bytes,
                device: dev,
            });
        }
        for (spec, t) in engine
            .io
            .outputs
            .iter()
            .zip(raw.iter().filter(|t| !t.is_input))
        {
            let bytes = spec.bytes();
            let staging = Pinned::new(&device, bytes, zero_copy)?;
            let dev = if zero_copy {
                staging.alloc.device
            } else {
                let d = device.alloc_device(bytes).map_err(alloc_err)?;
                engine.device_bytes += bytes as u64;
                d
            };
            handle
                .set_tensor_address(&t.name, dev)
                .map_err(|e| load_err(model, format!("output '{}': {e}", spec.name)))?;
            engine.outputs.push(Output {
                t: Tensor {
                    name: t.name.clone(),
                    bytes,
                    device: if zero_copy { 0 } else { dev },
                },
                staging,
            });
        }
        engine.handle = Some(handle);
        log::info!(
            "tensorrt: {} on {}; {} in device buffers, {} TensorRT scratch; {}; CUDA graphs {}",
            model,
            device.describe(),
            engine.device_bytes,
            engine.scratch,
            if zero_copy {
                "zero-copy (mapped host memory)"
            } else {
                "copies through page-locked staging"
            },
            if opts.cuda_graph { "on" } else { "off" }
        );
        Ok(engine)
    }

    /// Whether inputs and outputs live in mapped host memory.
    pub fn zero_copy(&self) -> bool {
        self.zero_copy
    }

    /// Queues one run for `slot` on the stream: copy in, enqueue, copy out (or, zero-copy,
    /// point TensorRT at the slot's mapped buffers and enqueue).
    fn enqueue_slot(&mut self, slot: usize, addrs: &SlotAddrs) -> Result<(), EngineError> {
        let handle = self
            .handle
            .as_mut()
            .ok_or_else(|| EngineError::Run("the TensorRT engine is closed".into()))?;
        let stream = self.device.stream();
        if self.zero_copy {
            if self.bound_slot != Some(slot) {
                self.bound_slot = None;
                for (t, (_, dev)) in self.inputs.iter().zip(addrs) {
                    handle
                        .set_tensor_address(&t.name, *dev)
                        .map_err(|e| run_err("setTensorAddress", e))?;
                }
                self.bound_slot = Some(slot);
            }
        } else {
            for (t, (host, _)) in self.inputs.iter().zip(addrs) {
                // SAFETY: `host` is a live page-locked slot buffer of `t.bytes` bytes: slot
                // buffers outlive the engine's use of them (the pool drops after the worker).
                unsafe { self.device.copy_htod(t.device, *host as *const u8, t.bytes) }
                    .map_err(|e| run_err("copy in", e))?;
            }
        }
        // SAFETY: the device's own stream, in the context the engine was loaded in.
        unsafe { handle.enqueue(stream) }.map_err(|e| run_err("enqueueV3", e))?;
        if !self.zero_copy && !self.keep_outputs {
            for o in &self.outputs {
                // SAFETY: the staging buffer is page-locked, `bytes` long, owned by the engine.
                unsafe {
                    self.device
                        .copy_dtoh(o.staging.alloc.ptr, o.t.device, o.t.bytes)
                }
                .map_err(|e| run_err("copy out", e))?;
            }
        }
        Ok(())
    }

    /// Captures one graph per known slot. A failure ends capture for good and logs why.
    fn capture_all(&mut self) {
        let slots: Vec<SlotAddrs> = self.slots.lock().unwrap_or_else(|e| e.into_inner()).clone();
        self.graphs.resize(slots.len(), None);
        for (s, addrs) in slots.iter().enumerate() {
            if self.graphs[s].is_some() {
                continue;
            }
            match self.capture(s, addrs) {
                Ok(g) => {
                    self.graphs[s] = Some(g);
                    self.counts.captured += 1;
                }
                Err(e) => {
                    log::warn!("tensorrt: CUDA graph capture failed, running without graphs: {e}");
                    self.graphs_failed = true;
                    self.drop_graphs();
                    self.settle_after_capture(s, addrs);
                    return;
                }
            }
        }
    }

    fn capture(&mut self, slot: usize, addrs: &SlotAddrs) -> Result<Graph, EngineError> {
        if self.zero_copy && self.bound_slot != Some(slot) {
            // New tensor addresses: TensorRT finishes its deferred setup in an ordinary
            // enqueue, so run one before capturing with them.
            self.device
                .mark(Mark::Start)
                .map_err(|e| run_err("event", e))?;
            self.enqueue_slot(slot, addrs)?;
            self.device
                .mark(Mark::End)
                .map_err(|e| run_err("event", e))?;
            self.device.finish().map_err(|e| run_err("sync", e))?;
        }
        self.device
            .begin_capture()
            .map_err(|e| run_err("capture", e))?;
        if let Err(e) = self.enqueue_slot(slot, addrs) {
            // The stream leaves capture mode; the partial graph is never instantiated.
            self.device.abort_capture();
            return Err(e);
        }
        self.device.end_capture().map_err(|e| run_err("capture", e))
    }

    /// After a failed capture: one ordinary enqueue of `slot` and a sync, whose outcome is only
    /// logged, so that an error the capture left behind surfaces here rather than in a request
    /// (trtexec clears it the same way).
    fn settle_after_capture(&mut self, slot: usize, addrs: &SlotAddrs) {
        let settled = self
            .device
            .mark(Mark::Start)
            .map_err(|e| run_err("event", e))
            .and_then(|_| self.enqueue_slot(slot, addrs))
            .and_then(|_| self.device.mark(Mark::End).map_err(|e| run_err("event", e)))
            .and_then(|_| self.device.synchronize().map_err(|e| run_err("sync", e)));
        self.counts.settled += 1;
        if let Err(e) = settled {
            log::debug!("tensorrt: the run after a failed capture failed too: {e}");
        }
    }

    fn drop_graphs(&mut self) {
        for g in self.graphs.iter_mut().filter_map(Option::take) {
            // SAFETY: captured by this device, dropped once, never launched again.
            unsafe { self.device.destroy_graph(g) };
        }
    }
}

/// What a pipeline on the device ([`device_loop::DeviceLoop`]) asks of its two engines.
impl TensorRtEngine {
    /// Binds the context to this thread, finds the slot `inputs` belong to and, the first
    /// time a slot is seen after a run, captures its graph: everything a run does before it
    /// queues work.
    pub(crate) fn prepare(
        &mut self,
        inputs: &mut [Box<dyn InputBuffer>],
    ) -> Result<usize, EngineError> {
        self.device.bind().map_err(|e| run_err("bind", e))?;
        let mut slot = None;
        for b in inputs.iter_mut() {
            let s = b
                .as_any_mut()
                .downcast_mut::<SlotInput>()
                .ok_or_else(|| EngineError::Run("input buffer from another backend".into()))?
                .slot;
            if slot.is_some_and(|x| x != s) {
                return Err(EngineError::Run(
                    "input buffers from different slots".into(),
                ));
            }
            slot = Some(s);
        }
        let slot = slot.ok_or_else(|| EngineError::Run("no input buffers".into()))?;
        if inputs.len() != self.inputs.len() {
            return Err(EngineError::Run(format!(
                "expected {} inputs, got {}",
                self.inputs.len(),
                inputs.len()
            )));
        }
        // TensorRT wants one ordinary enqueue before a capture (it sets up lazily there).
        if self.use_graphs && !self.graphs_failed && self.runs > 0 {
            let known = self.slots.lock().unwrap_or_else(|e| e.into_inner()).len();
            if self.graphs.get(slot).is_none_or(Option::is_none) && slot < known {
                self.capture_all();
            }
        }
        Ok(slot)
    }

    /// Queues `slot`'s run on the stream: its graph, or plain copies and an enqueue.
    pub(crate) fn queue(&mut self, slot: usize) -> Result<(), EngineError> {
        match self.graphs.get(slot).copied().flatten() {
            Some(g) => {
                self.device
                    .launch(g)
                    .map_err(|e| run_err("graph launch", e))?;
                self.counts.graph += 1;
            }
            None => {
                let slots = self.slots.clone();
                let slots = slots.lock().unwrap_or_else(|e| e.into_inner());
                let addrs = slots
                    .get(slot)
                    .ok_or_else(|| EngineError::Run("unknown slot".into()))?;
                self.enqueue_slot(slot, addrs)?;
                self.counts.plain += 1;
            }
        }
        self.runs += 1;
        Ok(())
    }

    /// Stops copying outputs back to the host: a prefix's outputs are read on the device by
    /// the step graph. Called before the first run, so no graph holds the copies.
    pub(crate) fn keep_outputs_on_device(&mut self) {
        self.keep_outputs = true;
    }

    /// Where output `i` lives in the device's address space.
    pub(crate) fn output_address(&self, i: usize) -> DevicePtr {
        let o = &self.outputs[i];
        if self.zero_copy {
            o.staging.alloc.device
        } else {
            o.t.device
        }
    }

    /// Points input `i` at memory the caller owns (a step graph reads the prefix's outputs
    /// and the sampler's buffers), freeing the engine's own buffer for it.
    pub(crate) fn feed_input(&mut self, i: usize, address: DevicePtr) -> Result<(), EngineError> {
        let handle = self
            .handle
            .as_mut()
            .ok_or_else(|| EngineError::Run("the TensorRT engine is closed".into()))?;
        let t = &mut self.inputs[i];
        handle
            .set_tensor_address(&t.name, address)
            .map_err(|e| run_err("setTensorAddress", e))?;
        if t.device != 0 {
            // SAFETY: the engine's own buffer, no longer bound and never queued (no run yet).
            unsafe { self.device.free_device(t.device) };
            self.device_bytes -= t.bytes as u64;
            t.device = 0;
        }
        Ok(())
    }

    /// Queues one enqueue with the addresses as they are: no copies (a step graph whose
    /// inputs were all given with [`TensorRtEngine::feed_input`]).
    pub(crate) fn enqueue_fed(&mut self) -> Result<(), EngineError> {
        let handle = self
            .handle
            .as_mut()
            .ok_or_else(|| EngineError::Run("the TensorRT engine is closed".into()))?;
        // SAFETY: the device's own stream, in the context the engine was loaded in.
        unsafe { handle.enqueue(self.device.stream()) }.map_err(|e| run_err("enqueueV3", e))
    }

    pub(crate) fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    pub(crate) fn graphs_enabled(&self) -> bool {
        self.use_graphs
    }
}

/// Why policyd cannot feed a tensor, if it cannot: a shape tensor (TensorRT reads it from host
/// memory), or a vectorised format (e.g. `--inputIOFormats=fp16:chw16` for DLA), whose padded
/// size differs from the dense buffer policyd would allocate.
fn check_layout(t: &shim::RawTensor) -> Result<(), String> {
    let name = t.name.to_string_lossy();
    let side = if t.is_input { "input" } else { "output" };
    if t.location != shim::LOCATION_DEVICE {
        return Err(format!(
            "{side} '{name}' is a shape tensor that TensorRT reads from host memory (kHOST); \
             policyd feeds device tensors only: export the model with that shape fixed"
        ));
    }
    if t.format != shim::FORMAT_LINEAR || t.components != 1 {
        return Err(format!(
            "{side} '{name}' has the vectorised format {} ({} components per element); policyd \
             needs dense linear tensors: rebuild the plan with --inputIOFormats/--outputIOFormats \
             naming a linear format (e.g. fp16:chw or fp32:chw), or none",
            shim::format_name(t.format),
            t.components
        ));
    }
    Ok(())
}

/// The shape an input runs with: the engine's, with dynamic dims taken from `engine_shape`, or
/// from optimisation profile 0 where its minimum and maximum agree.
fn fix_shape(
    name: &str,
    dims: &[i64],
    hint: Option<&Vec<usize>>,
    profile: Option<&(Vec<i64>, Vec<i64>)>,
    model: &str,
) -> Result<Vec<usize>, EngineError> {
    let dynamic = dims.iter().any(|&d| d < 0);
    let from_profile = profile.and_then(|(min, max)| {
        let fixed = min.len() == dims.len()
            && min == max
            && min
                .iter()
                .zip(dims)
                .all(|(&m, &d)| m > 0 && (d < 0 || d == m));
        fixed.then(|| min.iter().map(|&m| m as usize).collect::<Vec<usize>>())
    });
    match hint {
        None if dynamic => from_profile.ok_or_else(|| EngineError::DynamicShape {
            name: name.to_string(),
            shape: match profile {
                Some((min, max)) => format!("{dims:?} (its profile allows {min:?} to {max:?})"),
                None => format!("{dims:?}"),
            },
        }),
        None => Ok(dims.iter().map(|&d| d as usize).collect()),
        Some(h) => {
            let fits =
                h.len() == dims.len() && h.iter().zip(dims).all(|(&h, &d)| d < 0 || h as i64 == d);
            if !fits || h.contains(&0) {
                return Err(load_err(
                    model,
                    format!(
                        "engine_shape {h:?} for input '{name}' does not fit the engine's shape \
                         {dims:?} (-1 marks a dimension you may choose)"
                    ),
                ));
            }
            Ok(h.clone())
        }
    }
}

impl Engine for TensorRtEngine {
    fn backend(&self) -> &'static str {
        "tensorrt"
    }

    fn io(&self) -> &IoSpec {
        &self.io
    }

    fn alloc_inputs(&self) -> Result<Vec<Box<dyn InputBuffer>>, EngineError> {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let slot = slots.len();
        let mut bufs: Vec<Box<dyn InputBuffer>> = Vec::with_capacity(self.inputs.len());
        let mut addrs = Vec::with_capacity(self.inputs.len());
        for t in &self.inputs {
            let mem = Pinned::new(&self.device, t.bytes, self.zero_copy)?;
            addrs.push((mem.alloc.ptr as usize, mem.alloc.device));
            bufs.push(Box::new(SlotInput { mem, slot }));
        }
        slots.push(addrs);
        Ok(bufs)
    }

    fn run(
        &mut self,
        inputs: &mut [Box<dyn InputBuffer>],
        outputs: &mut [Vec<u8>],
        _reset: bool,
    ) -> Result<RunStats, EngineError> {
        // A TensorRT plan keeps no state between runs, so `reset` has nothing to drop.
        if outputs.len() != self.outputs.len() {
            return Err(EngineError::Run(format!(
                "expected {} outputs, got {}",
                self.outputs.len(),
                outputs.len()
            )));
        }
        let slot = self.prepare(inputs)?;
        self.device
            .mark(Mark::Start)
            .map_err(|e| run_err("event", e))?;
        self.queue(slot)?;
        self.device
            .mark(Mark::End)
            .map_err(|e| run_err("event", e))?;
        let compute = self.device.finish().map_err(|e| run_err("sync", e))?;
        for (o, out) in self.outputs.iter().zip(outputs.iter_mut()) {
            super::copy_output(o.staging.bytes(), out, || {
                o.t.name.to_string_lossy().into_owned()
            })?;
        }
        Ok(RunStats {
            compute,
            stages: None,
        })
    }

    fn working_memory(&self) -> Vec<(String, u64)> {
        let staging: u64 = self.outputs.iter().map(|o| o.t.bytes as u64).sum();
        vec![
            (
                "tensorrt     device buffers (one per engine tensor)".to_string(),
                self.device_bytes,
            ),
            (
                "tensorrt     page-locked output staging".to_string(),
                staging,
            ),
            (
                "tensorrt     execution context scratch (device)".to_string(),
                self.scratch,
            ),
        ]
    }
}

impl Drop for TensorRtEngine {
    fn drop(&mut self) {
        let _ = self.device.bind();
        // A failed run may have left work queued that still uses the graphs, the context
        // and the buffers: let it finish first.
        let _ = self.device.synchronize();
        self.drop_graphs();
        // The context may still reference the buffers: it goes first.
        self.handle = None;
        for d in self
            .inputs
            .iter()
            .map(|t| t.device)
            .chain(self.outputs.iter().map(|o| o.t.device))
            .filter(|&d| d != 0)
        {
            // SAFETY: allocated by this engine, freed once.
            unsafe { self.device.free_device(d) };
        }
    }
}

/// Opens the real backend: probes for the CUDA driver and libnvinfer first (cudarc panics
/// without libcuda), then loads the plan on the device.
#[cfg(feature = "tensorrt")]
pub fn open(
    model: &crate::config::ModelSource,
    ordinal: u32,
    library: Option<&std::path::Path>,
    opts: &Options,
) -> Result<TensorRtEngine, EngineError> {
    let (api, dev) = open_device(ordinal, library)?;
    load(api, &dev, model, opts)
}

/// Loads `model` on a device [`open_device`] opened (a pipeline's two plans share one device,
/// so that their work goes on one stream).
#[cfg(feature = "tensorrt")]
pub fn load(
    api: &'static ShimApi,
    device: &Arc<dyn Device>,
    model: &crate::config::ModelSource,
    opts: &Options,
) -> Result<TensorRtEngine, EngineError> {
    let plan = crate::engine::model_bytes(model)?;
    let engine = TensorRtEngine::new(api, device.clone(), &plan, opts)?;
    if let crate::config::ModelSource::Embedded { bytes, .. } = model {
        // The plan is deserialized onto the GPU: its pages of the binary can go.
        crate::engine::release_built_in(bytes);
    }
    Ok(engine)
}

/// Probes for the CUDA driver and libnvinfer (cudarc panics without libcuda), checks that
/// libnvinfer is the TensorRT policyd was compiled against, and opens CUDA device `ordinal`.
#[cfg(feature = "tensorrt")]
pub fn open_device(
    ordinal: u32,
    library: Option<&std::path::Path>,
) -> Result<(&'static ShimApi, Arc<dyn Device>), EngineError> {
    let api = &shim::linked::API;
    let mut missing = Vec::new();
    if !device::driver_present() {
        missing.push(
            "no CUDA driver: libcuda.so.1 cannot be opened (on a Jetson it comes with JetPack's \
             L4T driver, in /usr/lib/aarch64-linux-gnu/nvidia on JetPack 6 and \
             /usr/lib/aarch64-linux-gnu/tegra on JetPack 5; elsewhere with the NVIDIA driver)"
                .to_string(),
        );
    }
    let lib_version = match shim::open_library(api, library) {
        Ok(v) => Some(v),
        Err(e) => {
            missing.push(format!(
                "no TensorRT runtime: libnvinfer cannot be opened ({e}); install JetPack's \
                 `tensorrt` package or set engine.tensorrt_library"
            ));
            None
        }
    };
    if !missing.is_empty() {
        return Err(EngineError::Unavailable {
            backend: "tensorrt",
            reason: missing.join("; "),
        });
    }
    // SAFETY: no arguments.
    let header = unsafe { (api.header_version)() };
    if let Some(v) = lib_version
        && shim::version_string(v).split('.').next()
            != shim::version_string(header).split('.').next()
    {
        return Err(EngineError::Unavailable {
            backend: "tensorrt",
            reason: format!(
                "libnvinfer is TensorRT {} but policyd was compiled against TensorRT {}'s \
                 headers; build policyd on the board (docs/tensorrt.md)",
                shim::version_string(v),
                shim::version_string(header)
            ),
        });
    }
    let dev = device::CudaDevice::open(ordinal as usize).map_err(|e| EngineError::Unavailable {
        backend: "tensorrt",
        reason: format!("CUDA device {ordinal} cannot be used: {e}"),
    })?;
    log::info!(
        "tensorrt: TensorRT {} (compiled against {})",
        shim::version_string(lib_version.unwrap_or(-1)),
        shim::version_string(header)
    );
    Ok((api, Arc::new(dev)))
}

#[cfg(test)]
mod tests {
    use super::standin::{self, HostDevice};
    use super::*;

    const PLAN: &str = "
        input state 0 1,14
        input image 5 1,3,4,4
        output actions 0 1,5,14
    ";

    fn opts(graphs: bool, zero_copy: ZeroCopy) -> Options {
        Options {
            model: "test.plan".into(),
            dla_core: None,
            cuda_graph: graphs,
            zero_copy,
            shapes: Vec::new(),
        }
    }

    fn open(plan: &str, dev: &Arc<HostDevice>, o: &Options) -> Result<TensorRtEngine, EngineError> {
        TensorRtEngine::new(&standin::API, dev.clone(), plan.as_bytes(), o)
    }

    fn set_state(bufs: &mut [Box<dyn InputBuffer>], x: f32) {
        bufs[0].bytes_mut()[..4].copy_from_slice(&x.to_ne_bytes());
    }

    fn outputs(e: &TensorRtEngine) -> Vec<Vec<u8>> {
        e.io()
            .outputs
            .iter()
            .map(|s| vec![0u8; s.bytes()])
            .collect()
    }

    /// Every output element is x0 + k/1000 for the observation that ran.
    fn assert_ran(out: &[u8], x0: f32) {
        let v: Vec<f32> = out
            .chunks_exact(4)
            .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(v.len(), 70);
        for (k, y) in v.iter().enumerate() {
            assert!(
                (y - (x0 + k as f32 / 1000.0)).abs() < 1e-6,
                "element {k}: {y} for {x0}"
            );
        }
    }

    /// Two slots, alternating, with fresh values each run: every run reads its own slot's
    /// buffers, whether it was a plain enqueue or a replayed graph.
    fn run_two_slots(e: &mut TensorRtEngine) {
        let mut a = e.alloc_inputs().unwrap();
        let mut b = e.alloc_inputs().unwrap();
        let mut out = outputs(e);
        for i in 0..6 {
            let x = i as f32 + 0.5;
            let bufs = if i % 2 == 0 { &mut a } else { &mut b };
            set_state(bufs, x);
            let stats = e.run(bufs, &mut out, i == 0).unwrap();
            assert_eq!(
                stats.compute,
                Duration::from_micros(250),
                "device time from events"
            );
            assert_ran(&out[0], x);
        }
    }

    use std::time::Duration;

    #[test]
    fn reports_io_and_sizes_from_the_plan() {
        let dev = Arc::new(HostDevice::new(false));
        let e = open(PLAN, &dev, &opts(true, ZeroCopy::Auto)).unwrap();
        let io = e.io();
        assert_eq!(io.inputs[0].name, "state");
        assert_eq!(io.inputs[0].dtype, ElemType::F32);
        assert_eq!(io.inputs[1].shape, vec![1, 3, 4, 4]);
        assert_eq!(io.inputs[1].dtype, ElemType::U8);
        assert_eq!(io.outputs[0].shape, vec![1, 5, 14]);
        assert!(!e.zero_copy(), "auto is off on a discrete GPU");
        let bufs = e.alloc_inputs().unwrap();
        assert_eq!(bufs.len(), 2);
        let mut bufs = bufs;
        assert_eq!(bufs[0].bytes_mut().len(), 14 * 4);
        assert_eq!(bufs[1].bytes_mut().len(), 48);
        let mem = e.working_memory();
        assert_eq!(
            mem[0].1,
            (56 + 48 + 280) as u64,
            "one device buffer per tensor"
        );
        assert_eq!(mem[1].1, 280, "output staging");
        assert_eq!(mem[2].1, 4096, "the context's scratch");
    }

    #[test]
    fn copy_mode_captures_one_graph_per_slot_after_the_first_run() {
        let dev = Arc::new(HostDevice::new(false));
        let mut e = open(PLAN, &dev, &opts(true, ZeroCopy::Auto)).unwrap();
        run_two_slots(&mut e);
        assert!(*dev.copies.lock().unwrap() >= 18, "3 copies a run");
        assert_eq!(e.counts.plain, 1, "one plain enqueue before capture");
        assert_eq!(e.counts.captured, 2);
        assert_eq!(e.counts.graph, 5);
    }

    #[test]
    fn graphs_off_runs_plain_enqueues() {
        let dev = Arc::new(HostDevice::new(false));
        let mut e = open(PLAN, &dev, &opts(false, ZeroCopy::Off)).unwrap();
        run_two_slots(&mut e);
        assert_eq!(
            e.counts,
            Counts {
                plain: 6,
                graph: 0,
                captured: 0,
                settled: 0
            }
        );
    }

    #[test]
    fn zero_copy_on_an_integrated_gpu_makes_no_copies() {
        for graphs in [false, true] {
            let dev = Arc::new(HostDevice::new(true));
            let mut e = open(PLAN, &dev, &opts(graphs, ZeroCopy::Auto)).unwrap();
            assert!(e.zero_copy());
            assert_eq!(e.working_memory()[0].1, 0, "no device buffers");
            run_two_slots(&mut e);
            assert_eq!(*dev.copies.lock().unwrap(), 0, "graphs {graphs}");
            assert!(*dev.executed.lock().unwrap() >= 6, "graphs {graphs}");
        }
    }

    /// A pipeline of two TensorRT engines (the host loop): the prefix's output wired into the
    /// step graph, the step run under a replayed CUDA graph with fresh data every step. The
    /// stand-in step returns v = feat[0] + k/1000 whatever x and t are, so the flow from the
    /// seeded noise ends at noise − v.
    #[test]
    fn a_pipeline_of_two_plans_runs_its_steps_through_graphs() {
        use crate::engine::pipeline::Pipeline;
        use crate::engine::{Engine, Sampling};
        let prefix_plan = "input state 0 1,8\noutput features 0 1,4";
        let step_plan = "input feat 0 1,4\ninput x 0 1,10,7\ninput t 0 1\noutput v 0 1,10,7";
        let cfg = crate::config::Config::parse(
            r#"
[engine]
model = "prefix.plan"
[denoise]
model = "step.plan"
wire = { feat = "features" }
[sampler]
kind = "flow"
steps = 5
x = "x"
time = "t"
output = "v"
[[inputs]]
key = "state"
tensor = "state"
dtypes = ["float32"]
shape = [8]
[[outputs]]
tensor = "x"
"#,
            "test",
            None,
        )
        .unwrap();
        let p = cfg.default_policy().pipeline.clone().unwrap();
        for zero_copy in [ZeroCopy::Off, ZeroCopy::On] {
            let dev = Arc::new(HostDevice::new(true));
            let prefix = open(prefix_plan, &dev, &opts(true, zero_copy)).unwrap();
            let step = open(step_plan, &dev, &opts(true, zero_copy)).unwrap();
            let mut pipe = Pipeline::new(Box::new(prefix), Box::new(step), &p).unwrap();
            let mut inputs = pipe.alloc_inputs().unwrap();
            let mut out = vec![vec![0u8; 280]];
            for (run, x0) in [0.25f32, 1.5, -2.0].into_iter().enumerate() {
                set_state(&mut inputs, x0);
                let seed = 7 + run as u64;
                let stats = pipe
                    .run_sampled(
                        &mut inputs,
                        &mut out,
                        run == 0,
                        Sampling { seed, steps: 5 },
                        None,
                    )
                    .unwrap();
                assert_eq!(stats.stages.unwrap().steps, 5);
                let mut noise = crate::sampler::Noise::new(seed);
                for (k, c) in out[0].chunks_exact(4).enumerate() {
                    let got = f32::from_ne_bytes(c.try_into().unwrap());
                    // feat[0] is the prefix's output element 0, x0: v = x0 + k/1000.
                    let want = noise.draw() - (x0 + k as f32 / 1000.0);
                    assert!(
                        (got - want).abs() < 1e-4,
                        "{zero_copy:?} run {run} [{k}]: {got} vs {want}"
                    );
                }
            }
            assert!(
                *dev.instantiated.lock().unwrap() >= 2,
                "{zero_copy:?}: both plans replay graphs"
            );
        }
    }

    #[test]
    fn a_failed_capture_falls_back_to_plain_enqueues() {
        let dev = Arc::new(HostDevice::new(false));
        let plan = format!("{PLAN}\nno_capture");
        let mut e = open(&plan, &dev, &opts(true, ZeroCopy::Off)).unwrap();
        run_two_slots(&mut e);
        // One capture tried (enqueue refused while capturing), aborted without instantiating,
        // then one throwaway run, never counted as a request.
        assert_eq!(
            e.counts,
            Counts {
                plain: 6,
                graph: 0,
                captured: 0,
                settled: 1
            }
        );
        assert_eq!(*dev.aborted.lock().unwrap(), 1);
        assert_eq!(*dev.instantiated.lock().unwrap(), 0);
        assert_eq!(dev.live_graphs(), 0, "no partial graph left behind");

        let mut dev = HostDevice::new(false);
        dev.fail_instantiate = true;
        let dev = Arc::new(dev);
        let mut e = open(PLAN, &dev, &opts(true, ZeroCopy::Off)).unwrap();
        run_two_slots(&mut e);
        assert_eq!(e.counts.settled, 1);
        assert_eq!(dev.live_graphs(), 0);
        assert_eq!(e.counts.graph, 0);
        assert_eq!(e.counts.plain, 6);
    }

    #[test]
    fn an_engine_error_fails_one_run_and_the_next_succeeds() {
        let dev = Arc::new(HostDevice::new(false));
        let plan = format!("{PLAN}\nfail_enqueue 2");
        let mut e = open(&plan, &dev, &opts(false, ZeroCopy::Off)).unwrap();
        let mut a = e.alloc_inputs().unwrap();
        let mut out = outputs(&e);
        e.run(&mut a, &mut out, false).unwrap();
        let err = e.run(&mut a, &mut out, false).unwrap_err().to_string();
        assert!(
            err.contains("enqueueV3") && err.contains("stand-in failure"),
            "{err}"
        );
        set_state(&mut a, 7.0);
        e.run(&mut a, &mut out, false).unwrap();
        assert_ran(&out[0], 7.0);
    }

    #[test]
    fn dynamic_input_shapes_come_from_engine_shape() {
        let plan = "
            input state 0 -1,14
            output actions 0 -1,5,14
        ";
        let dev = Arc::new(HostDevice::new(false));
        let err = open(plan, &dev, &opts(true, ZeroCopy::Off))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("'state'") && err.contains("engine_shape"),
            "{err}"
        );

        let mut o = opts(true, ZeroCopy::Off);
        o.shapes = vec![("state".into(), vec![2, 14])];
        let e = open(plan, &dev, &o).unwrap();
        assert_eq!(e.io().inputs[0].shape, vec![2, 14]);
        assert_eq!(
            e.io().outputs[0].shape,
            vec![2, 5, 14],
            "resolved by the context"
        );

        o.shapes = vec![("state".into(), vec![2, 15])];
        let err = open(plan, &dev, &o).err().unwrap().to_string();
        assert!(
            err.contains("does not fit") && err.contains("[2, 15]"),
            "{err}"
        );

        o.shapes = vec![("state".into(), vec![100, 14])];
        let err = open(plan, &dev, &o).err().unwrap().to_string();
        assert!(err.contains("setInputShape refused"), "{err}");
    }

    #[test]
    fn a_dynamic_dim_fixed_by_the_profile_needs_no_engine_shape() {
        let dev = Arc::new(HostDevice::new(false));
        let o = opts(true, ZeroCopy::Off);
        let plan = "
            input state 0 -1,14
            profile state 3,14 3,14
            output actions 0 -1,5,14
        ";
        let e = open(plan, &dev, &o).unwrap();
        assert_eq!(e.io().inputs[0].shape, vec![3, 14]);
        assert_eq!(e.io().outputs[0].shape, vec![3, 5, 14]);
        // A range still needs engine_shape, and the error shows the range.
        let ranged = plan.replace("profile state 3,14 3,14", "profile state 1,14 8,14");
        let err = open(&ranged, &dev, &o).err().unwrap().to_string();
        assert!(
            err.contains("engine_shape") && err.contains("[1, 14] to [8, 14]"),
            "{err}"
        );
        let mut hinted = o.clone();
        hinted.shapes = vec![("state".into(), vec![8, 14])];
        assert_eq!(
            open(&ranged, &dev, &hinted).unwrap().io().inputs[0].shape,
            vec![8, 14]
        );
    }

    #[test]
    fn tensors_policyd_cannot_feed_are_refused_by_name() {
        let dev = Arc::new(HostDevice::new(false));
        let o = opts(true, ZeroCopy::Off);
        for (plan, want) in [
            (
                "input dims 8 2 host
input x 0 1,4
output y 0 1,4",
                ["input 'dims'", "kHOST"],
            ),
            (
                "input x 1 1,16,8,8 format=4 components=16
output y 0 1,4",
                ["input 'x'", "kCHW16"],
            ),
            (
                "input x 0 1,3,8,8 format=8
output y 0 1,4",
                ["input 'x'", "kHWC"],
            ),
            (
                "input x 0 1,4
output y 1 1,4 format=2 components=8",
                ["output 'y'", "kHWC8"],
            ),
        ] {
            let err = open(plan, &dev, &o).err().unwrap().to_string();
            assert!(want.iter().all(|w| err.contains(w)), "{plan}: {err}");
        }
        assert_eq!(dev.live(), 0, "refused before any buffer is allocated");
    }

    #[test]
    fn one_logger_serves_every_engine_of_the_process() {
        // Loads, a drop, and reloads: the stand-in refuses a load before the process logger
        // is set, and counts how often it is set (once per process, as TensorRT requires).
        let dev = Arc::new(HostDevice::new(false));
        let o = opts(true, ZeroCopy::Off);
        let a = open(PLAN, &dev, &o).unwrap();
        let b = open(PLAN, &dev, &o).unwrap();
        drop(a);
        let c = open(PLAN, &dev, &o).unwrap();
        drop((b, c));
        assert_eq!(*standin::LOGGER_SETS.lock().unwrap(), 1);
    }

    #[test]
    fn load_errors_name_what_is_wrong() {
        let dev = Arc::new(HostDevice::new(false));
        let o = opts(true, ZeroCopy::Off);
        let err = open("not a plan", &dev, &o).err().unwrap().to_string();
        assert!(
            err.contains("test.plan") && err.contains("deserializeCudaEngine"),
            "{err}"
        );
        let bf16 = "input x 7 1,4\noutput y 0 1,4";
        let err = open(bf16, &dev, &o).err().unwrap().to_string();
        assert!(err.contains("input 'x'") && err.contains("kBF16"), "{err}");
        // Sized before any buffer is allocated from it: no overflow, a clear refusal.
        let huge = "input x 0 1,4\noutput y 0 1099511627776,1099511627776";
        let err = open(huge, &dev, &o).err().unwrap().to_string();
        assert!(
            err.contains("output 'y'") && err.contains("elements"),
            "{err}"
        );
        let mut dla = o.clone();
        dla.dla_core = Some(3);
        let err = open(PLAN, &dev, &dla).err().unwrap().to_string();
        assert!(err.contains("DLA core 3"), "{err}");
    }

    #[test]
    fn every_allocation_is_freed() {
        let dev = Arc::new(HostDevice::new(false));
        {
            let mut e = open(PLAN, &dev, &opts(true, ZeroCopy::Off)).unwrap();
            run_two_slots(&mut e);
            assert!(dev.live() > 0);
            assert_eq!(*dev.synced.lock().unwrap(), 0);
        }
        assert_eq!(dev.live(), 0);
        assert_eq!(dev.live_graphs(), 0);
        assert_eq!(
            *dev.synced.lock().unwrap(),
            1,
            "the stream drained before teardown"
        );
        let _ = open(
            "input x 7 1,4\noutput y 0 1,4",
            &dev,
            &opts(true, ZeroCopy::Off),
        );
        assert_eq!(dev.live(), 0, "nothing leaks on a failed load");
    }

    #[test]
    fn serves_through_the_plan_and_worker_with_a_config() {
        let text = r#"
[engine]
model = "test.plan"
slots = 3
warmup_runs = 2
[[inputs]]
key = "state"
tensor = "state"
dtypes = ["float32", "float64"]
shape = [14]
[[inputs]]
key = "images/cam"
tensor = "image"
dtypes = ["uint8"]
shape = [4, 4, 3]
layout = "hwc_to_chw"
[[outputs]]
tensor = "actions"
"#;
        let cfg = crate::config::Config::parse(text, "t", Some(std::path::Path::new("."))).unwrap();
        let dev = Arc::new(HostDevice::new(true));
        let e = open(PLAN, &dev, &opts(true, ZeroCopy::Auto)).unwrap();
        let loaded =
            crate::policy::build::load_engine(&cfg, cfg.default_policy(), Box::new(e)).unwrap();
        assert_eq!(loaded.backend, "tensorrt");
        let budget = loaded.budget.render();
        assert!(budget.contains("tensorrt"), "{budget}");
        drop(loaded);
        assert_eq!(
            dev.live(),
            0,
            "slots and engine freed their page-locked memory"
        );

        let wrong = text.replace("tensor = \"image\"", "tensor = \"images\"");
        let cfg =
            crate::config::Config::parse(&wrong, "t", Some(std::path::Path::new("."))).unwrap();
        let e = open(PLAN, &dev, &opts(true, ZeroCopy::Auto)).unwrap();
        let err = crate::policy::build::load_engine(&cfg, cfg.default_policy(), Box::new(e))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("inputs[1].tensor") && err.contains("'image'"),
            "{err}"
        );
    }

    #[test]
    fn library_versions_read_as_releases() {
        assert_eq!(shim::version_string(100300), "10.3.0");
        assert_eq!(shim::version_string(8602), "8.6.2");
        assert_eq!(shim::version_string(110400), "11.4.0");
        let err = shim::open_library(&standin::API, None).unwrap_err();
        assert!(err.contains("libnvinfer"), "{err}");
        let v = shim::open_library(&standin::API, Some(std::path::Path::new("/x.so"))).unwrap();
        assert_eq!(v, 100300);
    }
}
