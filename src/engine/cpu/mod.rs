//! How does policyd run a model without a GPU? The CPU backend: tract-onnx, pure Rust, the embedded
//! default.
//!
//! The model is parsed, typed, optimised and made runnable once at start-up; `run` then makes
//! no decisions. Input buffers are tract tensors allocated at start-up and handed to tract by
//! reference count, so inputs are never copied; outputs are copied into the slot's buffers
//! (they are small: an action chunk).

pub mod patterns;

use std::any::Any;
use std::sync::Arc;
use std::time::Instant;

use tract_onnx::prelude::*;
use tract_onnx::tract_hir::infer::Factoid;

use super::{Engine, EngineError, InputBuffer, IoSpec, RunStats, TensorSpec};
use crate::config::ModelSource;
use crate::dtype::ElemType;

/// The tract backend.
pub struct CpuEngine {
    plan: Arc<TypedRunnableModel>,
    /// Kept across runs so tract reuses its buffers (and any op state, which `reset` drops).
    state: TypedSimpleState,
    io: IoSpec,
    /// One value per input, reused for every run (no per-run TVec growth beyond tract's own).
    datum: Vec<DatumType>,
    /// The rewrite a failing run should name (a pattern tract 0.23 cannot run).
    hint: Option<String>,
    /// `engine.threads` > 1: the pool tract's matrix products run on, set for each run on
    /// the engine's thread only (each policy has its own).
    executor: Option<tract_linalg::multithread::Executor>,
    /// [`intermediate_peak`] of the plan: (bytes, steps).
    intermediates: (u64, usize),
}

/// An input tensor owned by the slot and shared with tract only while it runs.
struct TractInput(Arc<Tensor>);

impl InputBuffer for TractInput {
    fn bytes_mut(&mut self) -> &mut [u8] {
        // Unique outside a run, so this does not copy; if tract ever kept a reference it
        // would copy once rather than write into a tensor tract still reads.
        Arc::make_mut(&mut self.0).as_bytes_mut()
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

fn elem_type(dt: DatumType) -> Option<ElemType> {
    Some(match dt {
        DatumType::Bool => ElemType::Bool,
        DatumType::U8 => ElemType::U8,
        DatumType::I8 => ElemType::I8,
        DatumType::U16 => ElemType::U16,
        DatumType::I16 => ElemType::I16,
        DatumType::U32 => ElemType::U32,
        DatumType::I32 => ElemType::I32,
        DatumType::U64 => ElemType::U64,
        DatumType::I64 => ElemType::I64,
        DatumType::F16 => ElemType::F16,
        DatumType::F32 => ElemType::F32,
        DatumType::F64 => ElemType::F64,
        _ => return None,
    })
}

/// For a graph that failed to load beside an external data file (`<graph>.onnx.data`, as the
/// exporter writes past protobuf's 2 GB): that file's name and size, so that a truncated or
/// stale weights file is named (tract's message gives only the byte range it wanted).
fn external_data_note(model: &ModelSource) -> String {
    let ModelSource::File(path) = model else {
        return String::new();
    };
    let data = crate::config::external_data_path(path);
    match std::fs::metadata(&data) {
        Ok(m) => format!(
            "; its external data file {} holds {} bytes (re-copy or re-export it if it is \
             truncated)",
            data.display(),
            m.len()
        ),
        Err(_) => String::new(),
    }
}

impl CpuEngine {
    /// Loads and optimises a model. `shape_hints` fixes the shapes of inputs whose dims the
    /// model leaves symbolic (from the bindings' `engine_shape`).
    pub fn load(
        model: &ModelSource,
        shape_hints: &[(String, Vec<usize>)],
    ) -> Result<Self, EngineError> {
        // The graph's patterns that tract 0.23 fails on (or runs slowly): their rewrite is
        // named in any failure, at load or at run (warm-up runs it before serving).
        let findings = patterns::scan_model(model);
        if let Some(note) = findings.as_ref().and_then(|f| f.slow()) {
            log::warn!("{}: {note}", model.describe());
        }
        let hint = findings.and_then(|f| f.failing());
        let mut engine = Self::load_graph(model, shape_hints).map_err(|e| match (e, &hint) {
            (EngineError::Load { model, reason }, Some(h)) => EngineError::Load {
                model,
                reason: format!("{reason}\n{h}"),
            },
            (
                EngineError::Load {
                    model: name,
                    reason,
                },
                None,
            ) => EngineError::Load {
                reason: format!("{reason}{}", external_data_note(model)),
                model: name,
            },
            (e, _) => e,
        })?;
        engine.hint = hint;
        Ok(engine)
    }

    fn load_graph(
        model: &ModelSource,
        shape_hints: &[(String, Vec<usize>)],
    ) -> Result<Self, EngineError> {
        // A file is loaded by its path, so that weights kept beside it as ONNX external data
        // (`<graph>.onnx.data`, needed past protobuf's 2 GB) are found in its directory.
        let mut inf = match model {
            ModelSource::File(path) => {
                std::fs::metadata(path).map_err(|source| EngineError::ReadModel {
                    path: path.display().to_string(),
                    source,
                })?;
                tract_onnx::onnx().model_for_path(path)
            }
            ModelSource::Embedded { bytes, data, .. } if !data.is_empty() => {
                embedded_with_data(bytes, data)
            }
            ModelSource::Embedded { .. } => {
                let bytes = super::model_bytes(model)?;
                let mut reader: &[u8] = &bytes;
                tract_onnx::onnx().model_for_read(&mut reader)
            }
        }
        .map_err(|e| super::load_error(model, e))?;
        let input_names: Vec<String> = inf
            .input_outlets()
            .map_err(|e| super::load_error(model, e))?
            .iter()
            .map(|o| inf.node(o.node).name.clone())
            .collect();
        let output_names: Vec<String> = inf
            .output_outlets()
            .map_err(|e| super::load_error(model, e))?
            .iter()
            .map(|o| {
                inf.outlet_label(*o)
                    .map(str::to_string)
                    .unwrap_or_else(|| inf.node(o.node).name.clone())
            })
            .collect();
        for (i, name) in input_names.iter().enumerate() {
            if let Some((_, shape)) = shape_hints.iter().find(|(n, _)| n == name) {
                let fact = inf
                    .input_fact(i)
                    .map_err(|e| super::load_error(model, e))?
                    .clone();
                let dt = fact.datum_type.concretize().unwrap_or(DatumType::F32);
                inf.set_input_fact(i, InferenceFact::dt_shape(dt, shape.clone()))
                    .map_err(|e| super::load_error(model, e))?;
            }
        }
        let typed = inf.into_typed().map_err(|e| super::load_error(model, e))?;
        let mut io = IoSpec::default();
        let mut datum = Vec::new();
        for (i, name) in input_names.iter().enumerate() {
            let fact = typed
                .input_fact(i)
                .map_err(|e| super::load_error(model, e))?;
            let shape = fact
                .shape
                .as_concrete()
                .ok_or_else(|| EngineError::DynamicShape {
                    name: name.clone(),
                    shape: format!("{:?}", fact.shape),
                })?
                .to_vec();
            let dtype = elem_type(fact.datum_type).ok_or_else(|| EngineError::UnsupportedType {
                side: "input",
                name: name.clone(),
                dtype: format!("{:?}", fact.datum_type),
            })?;
            datum.push(fact.datum_type);
            io.inputs.push(TensorSpec {
                name: name.clone(),
                dtype,
                shape,
            });
        }
        for (i, name) in output_names.iter().enumerate() {
            let fact = typed
                .output_fact(i)
                .map_err(|e| super::load_error(model, e))?;
            let shape = fact
                .shape
                .as_concrete()
                .ok_or_else(|| EngineError::Load {
                    model: model.describe(),
                    reason: format!("output '{name}' has a dynamic shape {:?}", fact.shape),
                })?
                .to_vec();
            let dtype = elem_type(fact.datum_type).ok_or_else(|| EngineError::UnsupportedType {
                side: "output",
                name: name.clone(),
                dtype: format!("{:?}", fact.datum_type),
            })?;
            io.outputs.push(TensorSpec {
                name: name.clone(),
                dtype,
                shape,
            });
        }
        let plan = typed
            .into_optimized()
            .and_then(|m| m.into_runnable())
            .map_err(|e| super::load_error(model, e))?;
        let state = plan.spawn().map_err(|e| super::load_error(model, e))?;
        let intermediates = intermediate_peak(&plan);
        if let ModelSource::Embedded { bytes, .. } = model {
            // tract has its own copy of the graph and its weights (the data went as read).
            super::release_built_in(bytes);
        }
        Ok(CpuEngine {
            plan,
            state,
            io,
            datum,
            hint: None,
            executor: None,
            intermediates,
        })
    }

    /// Runs tract's matrix products (its convolutions lowered to them, and the transformers')
    /// on `threads` threads; 1 keeps everything on the engine's own thread.
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.executor = (threads > 1).then(|| {
            tract_linalg::multithread::Executor::multithread_with_name(threads, "policyd-tract")
        });
        self
    }
}

/// tract's intermediate tensors at their peak during one run, and the plan's step count. tract
/// frees each value after the last step that reads it (its flush lists), so a non-constant
/// node's outputs live from the step that computes them to their last reader (the model's
/// outputs to the end); the peak is the largest total over the steps, counted with
/// `TypedFact::mem_size` (an exotic fact's buffers included: im2col's, packed operands). The
/// model's inputs are the slots' buffers, which the budget counts with them; constants are the
/// weights. A shape tract cannot size (symbolic) counts as nothing.
fn intermediate_peak(plan: &TypedRunnableModel) -> (u64, usize) {
    use tract_onnx::tract_core::ops::source::TypedSource;
    let model = plan.model();
    let order = plan.order_without_consts();
    let end = order.len();
    // The last step reading each node's outputs.
    let mut last = vec![0usize; model.nodes.len()];
    for (step, &n) in order.iter().enumerate() {
        for input in &model.nodes[n].inputs {
            last[input.node] = last[input.node].max(step);
        }
    }
    for o in &model.outputs {
        last[o.node] = end;
    }
    // Sizes enter at their step and leave after their last reader: a difference array.
    let mut delta = vec![0i128; end + 2];
    for (step, &n) in order.iter().enumerate() {
        let node = &model.nodes[n];
        if node.op_is::<TypedSource>() {
            continue;
        }
        let bytes: u64 = node
            .outputs
            .iter()
            .filter_map(|o| o.fact.mem_size().to_i64().ok())
            .map(|b| b.max(0) as u64)
            .sum();
        delta[step] += i128::from(bytes);
        delta[last[n].max(step) + 1] -= i128::from(bytes);
    }
    let (mut live, mut peak) = (0i128, 0i128);
    for d in &delta {
        live += d;
        peak = peak.max(live);
    }
    (peak as u64, end)
}

/// `vzeroupper` where the CPU has AVX (what compilers emit at the end of AVX code); nothing
/// elsewhere. Public for `benches/tract_profile.rs --vzeroupper`.
#[inline]
pub fn clear_upper_vector_state() {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        #[target_feature(enable = "avx")]
        unsafe fn clear() {
            std::arch::x86_64::_mm256_zeroupper();
        }
        // SAFETY: the CPU has AVX (checked above; the check is a cached load).
        unsafe { clear() }
    }
}

/// A firmware image's graph whose weights are built-in external data: tract reads each tensor
/// through a resolver, one at a time, and the binary's pages of it are released as they are
/// copied (the weights are held once, in tract's tensors, not also as a protobuf copy and as
/// resident pages of the binary).
fn embedded_with_data(
    bytes: &'static [u8],
    data: &'static [u8],
) -> TractResult<tract_onnx::prelude::InferenceModel> {
    use tract_onnx::pb::tensor_proto::DataLocation;
    let mut onnx = tract_onnx::onnx();
    onnx.provider = Arc::new(BuiltInData(data));
    let mut reader: &[u8] = bytes;
    let mut proto = onnx.proto_model_for_read(&mut reader)?;
    let graph = proto
        .graph
        .as_mut()
        .ok_or_else(|| TractError::msg("the model has no graph"))?;
    // tract resolves a tensor's location inside the model's directory before it asks the
    // resolver, which reads the binary instead: "." inside "/" always resolves.
    for t in &mut graph.initializer {
        if t.data_location != Some(DataLocation::External as i32) {
            continue;
        }
        for e in &mut t.external_data {
            if e.key == "location" {
                e.value = ".".into();
            }
        }
    }
    let parsed = onnx.parse(&proto, Some("/"))?;
    if !parsed.unresolved_inputs.is_empty() {
        return Err(TractError::msg(format!(
            "could not resolve inputs: {:?}",
            parsed.unresolved_inputs
        )));
    }
    // The resolver released whole pages inside each tensor; this takes the pages two tensors
    // shared.
    super::release_built_in(data);
    Ok(parsed.model)
}

/// The resolver of [`embedded_with_data`]: a tensor's bytes from the built-in data file.
struct BuiltInData(&'static [u8]);

impl tract_onnx::data_resolver::ModelDataResolver for BuiltInData {
    fn read_bytes_from_path(
        &self,
        buf: &mut Vec<u8>,
        _path: &std::path::Path,
        offset: usize,
        length: Option<usize>,
    ) -> TractResult<()> {
        let end = length.map_or(Some(self.0.len()), |l| offset.checked_add(l));
        let slice = end.and_then(|end| self.0.get(offset..end)).ok_or_else(|| {
            TractError::msg(format!(
                "external data [{offset}, +{length:?}) past the built-in data file ({} bytes)",
                self.0.len()
            ))
        })?;
        buf.extend_from_slice(slice);
        super::release_built_in(slice);
        Ok(())
    }
}

impl Engine for CpuEngine {
    fn backend(&self) -> &'static str {
        "cpu"
    }

    /// A graph with a pattern tract fails on at run time (the scan at load found it).
    fn needs_trial_run(&self) -> bool {
        self.hint.is_some()
    }

    fn io(&self) -> &IoSpec {
        &self.io
    }

    fn working_memory(&self) -> Vec<(String, u64)> {
        let (bytes, steps) = self.intermediates;
        vec![(
            format!("cpu          tract's intermediate tensors at their peak ({steps} steps)"),
            bytes,
        )]
    }

    fn alloc_inputs(&self) -> Result<Vec<Box<dyn InputBuffer>>, EngineError> {
        self.io
            .inputs
            .iter()
            .zip(&self.datum)
            .map(|(spec, dt)| {
                let t = Tensor::zero_dt(*dt, &spec.shape).map_err(|e| EngineError::Load {
                    model: spec.name.clone(),
                    reason: format!("cannot allocate input: {e}"),
                })?;
                Ok(Box::new(TractInput(Arc::new(t))) as Box<dyn InputBuffer>)
            })
            .collect()
    }

    fn run(
        &mut self,
        inputs: &mut [Box<dyn InputBuffer>],
        outputs: &mut [Vec<u8>],
        reset: bool,
    ) -> Result<RunStats, EngineError> {
        let start = Instant::now();
        if reset {
            self.state = self
                .plan
                .spawn()
                .map_err(|e| EngineError::Run(format!("{e:#}")))?;
        }
        let mut values: TVec<TValue> = TVec::new();
        for b in inputs.iter_mut() {
            let t = b
                .as_any_mut()
                .downcast_mut::<TractInput>()
                .ok_or_else(|| EngineError::Run("input buffer from another backend".into()))?;
            values.push(TValue::from_const(t.0.clone()));
        }
        let (state, executor) = (&mut self.state, &self.executor);
        // Each node starts with clean upper vector state: tract-linalg's AVX matrix kernels
        // return without `vzeroupper`, and the SSE code of the next element-wise op (libm's
        // sin, pow; tract's own scalar loops) then runs 3-20x slower (docs/tract-report.md).
        let run = move || {
            state.run_plan_with_eval(values, |ctx, op_state, node, input| {
                clear_upper_vector_state();
                tract_onnx::tract_core::plan::eval(ctx, op_state, node, input)
            })
        };
        let result = match executor {
            Some(pool) => tract_linalg::multithread::multithread_tract_scope(pool.clone(), run),
            None => run(),
        };
        let result = result.map_err(|e| match &self.hint {
            Some(h) => EngineError::Run(format!("{e:#}\n{h}")),
            None => EngineError::Run(format!("{e:#}")),
        })?;
        let compute = start.elapsed();
        for ((spec, out), value) in self
            .io
            .outputs
            .iter()
            .zip(outputs.iter_mut())
            .zip(result.iter())
        {
            super::copy_output(value.as_bytes(), out, || spec.name.clone())?;
        }
        Ok(RunStats {
            compute,
            stages: None,
        })
    }
}
