//! `[denoise]` and `[sampler]`: a flow or diffusion policy's step graph and its sampler.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::{ConfigError, Keys, ModelSource, path};

/// `[denoise]`: the step graph of a pipeline (an action expert, a denoising U-Net), on
/// `[engine]`'s backend.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDenoise {
    /// Model file, relative to the config file.
    pub(super) model: PathBuf,
    /// Step-graph input = prefix (`[engine]`) output, by name.
    #[serde(default)]
    pub(super) wire: std::collections::BTreeMap<String, String>,
}

/// `[sampler]`: how `[denoise]` is iterated from noise to actions.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSampler {
    /// `flow`, `ddpm` or `ddim`.
    pub(super) kind: String,
    /// Steps when the request names none (`sampling_params.num_inference_steps`).
    pub(super) steps: usize,
    /// The most steps a request may ask for (default: `steps`).
    #[serde(default)]
    pub(super) max_steps: Option<usize>,
    /// Step-graph input taking the sample (its shape is the action chunk's).
    pub(super) x: String,
    /// Step-graph input taking the time (flow) or timestep (ddpm, ddim).
    pub(super) time: String,
    /// Step-graph output: the velocity (flow) or the prediction (ddpm, ddim).
    pub(super) output: String,
    #[serde(default)]
    pub(super) num_train_timesteps: Option<usize>,
    #[serde(default)]
    pub(super) beta_schedule: Option<String>,
    #[serde(default)]
    pub(super) beta_start: Option<f64>,
    #[serde(default)]
    pub(super) beta_end: Option<f64>,
    #[serde(default)]
    pub(super) prediction_type: Option<String>,
    #[serde(default)]
    pub(super) clip_sample: Option<bool>,
    #[serde(default)]
    pub(super) clip_sample_range: Option<f64>,
    #[serde(default)]
    pub(super) eta: Option<f64>,
    /// `sampler` (the loop applies the update) or `model` (flow: the step graph returns the
    /// next sample itself, given `dt`).
    #[serde(default)]
    pub(super) update: Option<String>,
    /// `update = "model"`: the step-graph input taking `dt`.
    #[serde(default)]
    pub(super) dt: Option<String>,
    /// Tests: the noise comes from the request (inputs named as `x` and `<x>_step_noise`).
    #[serde(default)]
    pub(super) inject_noise: bool,
    /// Flow: `openpi` (time accumulated in float32, `t += dt`) or `lerobot` (`1 + i·dt` in
    /// float64, rounded to float32, as LeRobot's `euler_integrate`).
    #[serde(default)]
    pub(super) flow_time: Option<String>,
}

/// `[denoise]` and `[sampler]`.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelineConfig {
    pub denoise: ModelSource,
    /// (step-graph input, prefix output).
    pub wire: Vec<(String, String)>,
    pub kind: crate::sampler::Kind,
    /// DDPM/DDIM settings.
    pub diffusion: Option<crate::sampler::Diffusion>,
    pub steps: usize,
    pub max_steps: usize,
    pub x: String,
    pub time: String,
    pub output: String,
    /// The step graph returns the next sample itself (`update = "model"`), fed `dt` here.
    pub model_update: Option<String>,
    pub inject_noise: bool,
    /// Flow: how step i's time is computed.
    pub flow_time: crate::sampler::FlowTime,
    /// `[rtc]`: how a new chunk continues the previous one (flow only).
    pub rtc: Option<crate::rtc::Settings>,
}

/// `[denoise]` and `[sampler]`: both or neither; the sampler's own values (its tensors are
/// checked against the step graph when it is loaded).
pub(super) fn pipeline(
    cx: &Keys,
    denoise: Option<&RawDenoise>,
    sampler: Option<&RawSampler>,
    base: Option<&Path>,
) -> Result<Option<PipelineConfig>, ConfigError> {
    use crate::sampler::Kind;
    let (d, s) = match (denoise, sampler) {
        (None, None) => return Ok(None),
        (Some(d), Some(s)) => (d, s),
        (Some(_), None) => {
            return Err(cx.invalid(
                "sampler",
                "[denoise] needs a [sampler] saying how to run it",
            ));
        }
        (None, Some(_)) => {
            return Err(cx.invalid(
                "denoise",
                "[sampler] needs the [denoise] step graph it runs",
            ));
        }
    };
    let kind = cx.one_of(
        "sampler.kind",
        Some(&s.kind),
        None,
        &[
            ("flow", Kind::Flow),
            ("ddpm", Kind::Ddpm),
            ("ddim", Kind::Ddim),
        ],
    )?;
    let max_steps = s.max_steps.unwrap_or(s.steps);
    cx.between(
        "sampler.max_steps",
        max_steps,
        1,
        crate::limits::MAX_SAMPLER_STEPS,
    )?;
    cx.between("sampler.steps", s.steps, 1, max_steps)?;
    for (key, v) in [
        ("sampler.x", &s.x),
        ("sampler.time", &s.time),
        ("sampler.output", &s.output),
    ] {
        if v.is_empty() {
            return Err(cx.invalid(key, "name the step graph's tensor"));
        }
    }
    let diffusion = diffusion(cx, s, kind, max_steps)?;
    let model_update = model_update(cx, s, kind)?;
    use crate::sampler::FlowTime;
    let flow_time = cx.one_of(
        "sampler.flow_time",
        s.flow_time.as_deref(),
        Some(FlowTime::Openpi),
        &[
            ("openpi", FlowTime::Openpi),
            ("lerobot", FlowTime::Lerobot),
            ("groot", FlowTime::Groot),
        ],
    )?;
    if s.flow_time.is_some() && kind != Kind::Flow {
        return Err(cx.invalid("sampler.flow_time", "applies to kind = \"flow\" only"));
    }
    Ok(Some(PipelineConfig {
        denoise: ModelSource::File(path(base, &d.model)),
        wire: d.wire.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        kind,
        diffusion,
        steps: s.steps,
        max_steps,
        x: s.x.clone(),
        time: s.time.clone(),
        output: s.output.clone(),
        model_update,
        inject_noise: s.inject_noise,
        flow_time,
        rtc: None,
    }))
}

/// A DDPM or DDIM sampler's scheduler keys (diffusers' names and defaults); `None` for flow,
/// which takes none of them.
fn diffusion(
    cx: &Keys,
    s: &RawSampler,
    kind: crate::sampler::Kind,
    max_steps: usize,
) -> Result<Option<crate::sampler::Diffusion>, ConfigError> {
    use crate::sampler::{Betas, Diffusion, Kind, Prediction};
    let diffusion_keys = s.num_train_timesteps.is_some()
        || s.beta_schedule.is_some()
        || s.beta_start.is_some()
        || s.beta_end.is_some()
        || s.prediction_type.is_some()
        || s.clip_sample.is_some()
        || s.clip_sample_range.is_some()
        || s.eta.is_some();
    Ok(if kind == Kind::Flow {
        if diffusion_keys {
            return Err(cx.invalid(
                "sampler.kind",
                "\"flow\" takes no scheduler keys (num_train_timesteps, beta_*, prediction_type, \
                 clip_sample*, eta)",
            ));
        }
        None
    } else {
        let t = s.num_train_timesteps.unwrap_or(1000);
        cx.between("sampler.num_train_timesteps", t, 1, 100_000)?;
        if max_steps > t {
            return Err(cx.invalid(
                "sampler.max_steps",
                format!("{max_steps} exceeds num_train_timesteps ({t})"),
            ));
        }
        let betas = match s.beta_schedule.as_deref().unwrap_or("linear") {
            "linear" => Betas::Linear,
            "scaled_linear" => Betas::ScaledLinear,
            "squaredcos_cap_v2" => Betas::SquaredCosCapV2,
            b => {
                return Err(cx.invalid(
                    "sampler.beta_schedule",
                    format!(
                        "must be \"linear\", \"scaled_linear\" or \"squaredcos_cap_v2\", got \"{b}\""
                    ),
                ));
            }
        };
        let prediction = match s.prediction_type.as_deref().unwrap_or("epsilon") {
            "epsilon" => Prediction::Epsilon,
            "sample" => Prediction::Sample,
            "v_prediction" => Prediction::VPrediction,
            p => {
                return Err(cx.invalid(
                    "sampler.prediction_type",
                    format!("must be \"epsilon\", \"sample\" or \"v_prediction\", got \"{p}\""),
                ));
            }
        };
        let (beta_start, beta_end) = (s.beta_start.unwrap_or(0.0001), s.beta_end.unwrap_or(0.02));
        if !(beta_start > 0.0 && beta_start <= beta_end && beta_end < 1.0) {
            return Err(cx.invalid(
                "sampler.beta_start",
                format!("need 0 < beta_start <= beta_end < 1, got {beta_start} and {beta_end}"),
            ));
        }
        let range = s.clip_sample_range.unwrap_or(1.0);
        if !(range.is_finite() && range > 0.0) {
            return Err(cx.invalid("sampler.clip_sample_range", "must be a positive number"));
        }
        let eta = s.eta.unwrap_or(0.0);
        if kind == Kind::Ddpm && s.eta.is_some() {
            return Err(cx.invalid("sampler.eta", "is DDIM's; DDPM always adds its noise"));
        }
        if !(0.0..=1.0).contains(&eta) {
            return Err(cx.invalid("sampler.eta", format!("must be within 0..=1, got {eta}")));
        }
        Some(Diffusion {
            train_timesteps: t,
            betas,
            beta_start,
            beta_end,
            prediction,
            clip: s.clip_sample.unwrap_or(true).then_some(range as f32),
            eta: eta as f32,
        })
    })
}

/// `sampler.update = "model"`: the step-graph input taking `dt` (a flow step graph returning
/// the next sample); `None` when the sampler applies the update.
fn model_update(
    cx: &Keys,
    s: &RawSampler,
    kind: crate::sampler::Kind,
) -> Result<Option<String>, ConfigError> {
    use crate::sampler::Kind;
    Ok(match (s.update.as_deref().unwrap_or("sampler"), &s.dt) {
        ("sampler", None) => None,
        ("sampler", Some(_)) => {
            return Err(cx.invalid("sampler.dt", "is for update = \"model\""));
        }
        ("model", _) if kind != Kind::Flow => {
            return Err(cx.invalid(
                "sampler.update",
                "\"model\" (a step graph returning x + dt·v) is for kind = \"flow\"",
            ));
        }
        ("model", Some(dt)) if !dt.is_empty() => Some(dt.clone()),
        ("model", _) => {
            return Err(cx.invalid(
                "sampler.dt",
                "update = \"model\" needs the step-graph input taking dt",
            ));
        }
        (u, _) => {
            return Err(cx.invalid(
                "sampler.update",
                format!("must be \"sampler\" or \"model\", got \"{u}\""),
            ));
        }
    })
}
