//! Which backend runs a policy: [`open`] reads `[engine]` (and `[denoise]` for a pipeline) and
//! returns the engine, so that nothing above this module knows which backend it is.

use crate::config::{Backend, ModelSource, PolicySpec};

use super::{Engine, EngineError};

/// The backends compiled into this build, for messages.
pub const BACKENDS: &str = match (
    cfg!(feature = "cpu"),
    cfg!(feature = "ort"),
    cfg!(feature = "tensorrt"),
) {
    (true, true, true) => "cpu, ort, tensorrt",
    (true, true, false) => "cpu, ort",
    (true, false, true) => "cpu, tensorrt",
    (true, false, false) => "cpu",
    (false, true, true) => "ort, tensorrt",
    (false, true, false) => "ort",
    (false, false, true) => "tensorrt",
    (false, false, false) => "none",
};

/// Fixed shapes (`engine_shape`) for the inputs whose dims the model leaves symbolic.
#[cfg_attr(
    not(any(feature = "cpu", feature = "ort", feature = "tensorrt")),
    allow(dead_code)
)]
fn shape_hints(spec: &PolicySpec) -> Vec<(String, Vec<usize>)> {
    spec.inputs
        .iter()
        .filter_map(|b| Some((b.tensor.clone()?, b.engine_shape.clone()?)))
        .collect()
}

/// Opens the engine a policy names, with the backend its config chose: its model, or for a
/// pipeline the prefix and the step graph wired together.
pub fn open(spec: &PolicySpec) -> Result<Box<dyn Engine>, EngineError> {
    #[cfg(feature = "tensorrt")]
    if spec.engine.backend == Backend::Tensorrt
        && let Some(p) = &spec.pipeline
    {
        return open_tensorrt_pipeline(spec, p);
    }
    let prefix = open_model(spec, &spec.model)?;
    crate::engine::release_freed_heap();
    let Some(p) = &spec.pipeline else {
        return Ok(prefix);
    };
    let denoise = open_model(spec, &p.denoise).map_err(in_denoise)?;
    crate::engine::release_freed_heap();
    let pipeline = crate::engine::pipeline::Pipeline::new(prefix, denoise, p)
        .map_err(|e| crate::config::invalid("denoise", e.to_string()))?;
    Ok(Box::new(pipeline))
}

/// A step graph that failed to open, said of `denoise.model`.
fn in_denoise(e: EngineError) -> EngineError {
    match e {
        EngineError::Config(e) => EngineError::Config(e),
        e => crate::config::invalid("denoise.model", e.to_string()).into(),
    }
}

/// A TensorRT pipeline: both plans on one device (one stream), the sampler's loop on it.
#[cfg(feature = "tensorrt")]
fn open_tensorrt_pipeline(
    spec: &PolicySpec,
    p: &crate::config::PipelineConfig,
) -> Result<Box<dyn Engine>, EngineError> {
    use crate::engine::tensorrt;
    let e = &spec.engine;
    let (api, device) = tensorrt::open_device(e.device, e.tensorrt_library.as_deref())?;
    let prefix = tensorrt::load(api, &device, &spec.model, &trt_options(spec, &spec.model))?;
    let denoise = tensorrt::load(api, &device, &p.denoise, &trt_options(spec, &p.denoise))
        .map_err(in_denoise)?;
    tensorrt::device_loop::build(prefix, denoise, p)
        .map_err(|e| crate::config::invalid("denoise", e.to_string()).into())
}

/// `[engine]`'s TensorRT settings for one plan.
#[cfg(feature = "tensorrt")]
fn trt_options(spec: &PolicySpec, model: &ModelSource) -> crate::engine::tensorrt::Options {
    let e = &spec.engine;
    crate::engine::tensorrt::Options {
        model: model.describe(),
        dla_core: e.dla_core,
        cuda_graph: e.cuda_graph,
        zero_copy: e.zero_copy,
        shapes: shape_hints(spec),
    }
}

/// Opens one model file on the policy's backend.
#[cfg_attr(
    not(any(feature = "cpu", feature = "ort", feature = "tensorrt")),
    allow(unused_variables)
)]
fn open_model(spec: &PolicySpec, model: &ModelSource) -> Result<Box<dyn Engine>, EngineError> {
    let backend_missing = |b: Backend| -> EngineError {
        let how = match b {
            Backend::Cpu => "build policyd with its default features",
            Backend::Ort => "build policyd with its default features (or `--features ort`)",
            Backend::Tensorrt => "build policyd with `--features tensorrt` (see docs/tensorrt.md)",
        };
        crate::config::invalid(
            "engine.backend",
            format!(
                "\"{}\" is not in this build, which has: {}; {how}",
                b.name(),
                BACKENDS
            ),
        )
        .into()
    };
    match spec.engine.backend {
        #[cfg(feature = "cpu")]
        Backend::Cpu => Ok(Box::new(
            crate::engine::cpu::CpuEngine::load(model, &shape_hints(spec))?
                .with_threads(spec.engine.threads),
        )),
        #[cfg(feature = "ort")]
        Backend::Ort => {
            let e = &spec.engine;
            let hints = shape_hints(spec);
            let opts = crate::engine::ort::Options {
                library: e.ort_library.as_deref(),
                threads: e.threads,
                providers: &e.providers,
                device: e.device,
                shapes: &hints,
                spinning: e.spinning,
            };
            Ok(Box::new(crate::engine::ort::OrtEngine::load(model, &opts)?))
        }
        #[cfg(feature = "tensorrt")]
        Backend::Tensorrt => {
            let e = &spec.engine;
            Ok(Box::new(crate::engine::tensorrt::open(
                model,
                e.device,
                e.tensorrt_library.as_deref(),
                &trt_options(spec, model),
            )?))
        }
        #[allow(unreachable_patterns)]
        other => Err(backend_missing(other)),
    }
}
