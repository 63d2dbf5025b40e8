//! How does a multi-step policy run? As one engine made of two: the prefix (`[engine]`: vision,
//! language, state → features) once per request, then the step graph (`[denoise]`: an action
//! expert or a denoising U-Net) `steps` times under the sampler, over buffers allocated at
//! load. To the rest of policyd it is one engine whose inputs are the prefix's and whose one
//! output is the final sample; the request's seed and step count arrive through
//! [`Engine::run_sampled`].
//!
//! The loop runs on the host: each step copies the sample into the step graph's input and
//! reads its output back (a GPU backend pays a round trip per step).

use std::time::Instant;

use super::{Engine, EngineError, InputBuffer, IoSpec, RunStats, Sampling, Stages, TensorSpec};
use crate::config::PipelineConfig;
use crate::dtype::ElemType;
use crate::sampler::{Noise, Sampler, Time};
use crate::transform::{fill_bytes, load_f64};

/// The prefix and the step graph, wired, with the sampler and its buffers.
pub struct Pipeline {
    prefix: Box<dyn Engine>,
    denoise: Box<dyn Engine>,
    sampler: Sampler,
    io: IoSpec,
    prefix_out: Vec<Vec<u8>>,
    denoise_in: Vec<Box<dyn InputBuffer>>,
    denoise_out: Vec<Vec<u8>>,
    /// (prefix output, step-graph input).
    wires: Vec<(usize, usize)>,
    x_in: usize,
    time_in: usize,
    time_type: ElemType,
    /// `update = "model"`: the step graph's `dt` input and its type; the graph's output is the
    /// next sample.
    dt_in: Option<(usize, ElemType)>,
    out: usize,
    out_type: ElemType,
    /// The sample and the step graph's output, as float32.
    x: Vec<f32>,
    model_out: Vec<f32>,
    steps: usize,
    max_steps: usize,
    /// The initial sample comes from the request (the last input), for reference tests.
    inject_noise: bool,
}

/// A pipeline that does not fit together: the message names both ends.
fn wiring(message: String) -> EngineError {
    EngineError::Load {
        model: "[denoise]".into(),
        reason: message,
    }
}

impl Pipeline {
    /// Wires `prefix` to `denoise` as `cfg` says, checking every end: a wired pair must match
    /// exactly in dtype and shape, every step-graph input must be the sample, the time or
    /// wired, and the sample, the time and the output must be shaped as the sampler needs.
    pub fn new(
        prefix: Box<dyn Engine>,
        denoise: Box<dyn Engine>,
        cfg: &PipelineConfig,
    ) -> Result<Pipeline, EngineError> {
        let (pio, dio) = (prefix.io().clone(), denoise.io().clone());
        let input = |name: &str, key: &str| {
            dio.inputs
                .iter()
                .position(|s| s.name == name)
                .ok_or_else(|| {
                    wiring(format!(
                        "{key} = \"{name}\": the step graph has no such input; its inputs are: {}",
                        super::describe(&dio.inputs)
                    ))
                })
        };
        let x_in = input(&cfg.x, "sampler.x")?;
        let time_in = input(&cfg.time, "sampler.time")?;
        let dt_in = match &cfg.model_update {
            None => None,
            Some(dt) => {
                let i = input(dt, "sampler.dt")?;
                let s = &dio.inputs[i];
                if s.elements() != 1 || !s.dtype.is_float() {
                    return Err(wiring(format!(
                        "sampler.dt '{}' {} {:?} must hold one float",
                        s.name, s.dtype, s.shape
                    )));
                }
                Some((i, s.dtype))
            }
        };
        let out = dio
            .outputs
            .iter()
            .position(|s| s.name == cfg.output)
            .ok_or_else(|| {
                wiring(format!(
                    "sampler.output = \"{}\": the step graph has no such output; its outputs are: {}",
                    cfg.output,
                    super::describe(&dio.outputs)
                ))
            })?;
        let (xs, ts, os) = (&dio.inputs[x_in], &dio.inputs[time_in], &dio.outputs[out]);
        if xs.dtype != ElemType::F32 {
            return Err(wiring(format!(
                "sampler.x = \"{}\" is {}; the sample is float32",
                xs.name, xs.dtype
            )));
        }
        if os.elements() != xs.elements() || !os.dtype.is_float() {
            return Err(wiring(format!(
                "sampler.output '{}' {} {:?} must be a float tensor the sample's size (sampler.x \
                 '{}' {:?})",
                os.name, os.dtype, os.shape, xs.name, xs.shape
            )));
        }
        if ts.elements() != 1 || ts.dtype == ElemType::Bool {
            return Err(wiring(format!(
                "sampler.time '{}' {} {:?} must hold one number",
                ts.name, ts.dtype, ts.shape
            )));
        }
        let mut wires = Vec::new();
        for (to, from) in &cfg.wire {
            let d = input(to, &format!("denoise.wire.{to}"))?;
            let p = pio
                .outputs
                .iter()
                .position(|s| &s.name == from)
                .ok_or_else(|| {
                    wiring(format!(
                        "denoise.wire.{to} = \"{from}\": the prefix ([engine]) has no such output; \
                     its outputs are: {}",
                        super::describe(&pio.outputs)
                    ))
                })?;
            let (ps, ds) = (&pio.outputs[p], &dio.inputs[d]);
            if ps.dtype != ds.dtype || ps.shape != ds.shape {
                return Err(wiring(format!(
                    "denoise.wire.{to}: prefix output '{}' {} {:?} does not match step-graph \
                     input '{}' {} {:?}",
                    ps.name, ps.dtype, ps.shape, ds.name, ds.dtype, ds.shape
                )));
            }
            if d == x_in || d == time_in || dt_in.is_some_and(|(i, _)| i == d) {
                return Err(wiring(format!(
                    "denoise.wire.{to}: '{to}' is the sampler's {}",
                    if d == x_in {
                        "sample (x)"
                    } else if d == time_in {
                        "time"
                    } else {
                        "dt"
                    }
                )));
            }
            wires.push((p, d));
        }
        for (i, s) in dio.inputs.iter().enumerate() {
            if i != x_in
                && i != time_in
                && dt_in.is_none_or(|(d, _)| d != i)
                && !wires.iter().any(|&(_, d)| d == i)
            {
                return Err(wiring(format!(
                    "step-graph input '{}' {} {:?} is fed by nothing: wire it to a prefix output \
                     in [denoise] wire, or name it as sampler.x or sampler.time",
                    s.name, s.dtype, s.shape
                )));
            }
        }
        let sample = TensorSpec {
            name: cfg.x.clone(),
            dtype: ElemType::F32,
            shape: xs.shape.clone(),
        };
        let mut inputs = pio.inputs.clone();
        if cfg.inject_noise {
            if inputs.iter().any(|s| s.name == cfg.x) {
                return Err(wiring(format!(
                    "sampler.inject_noise: the prefix already has an input '{}'",
                    cfg.x
                )));
            }
            inputs.push(sample.clone());
        }
        let io = IoSpec {
            inputs,
            outputs: vec![sample],
        };
        let sampler = match &cfg.diffusion {
            None => Sampler::flow(),
            Some(d) => Sampler::diffusion(cfg.kind, d.clone()),
        };
        let n = xs.elements();
        Ok(Pipeline {
            prefix_out: pio.outputs.iter().map(|s| vec![0u8; s.bytes()]).collect(),
            denoise_in: denoise.alloc_inputs()?,
            denoise_out: dio.outputs.iter().map(|s| vec![0u8; s.bytes()]).collect(),
            wires,
            x_in,
            time_in,
            time_type: ts.dtype,
            dt_in,
            out,
            out_type: os.dtype,
            x: vec![0.0; n],
            model_out: vec![0.0; n],
            steps: cfg.steps,
            max_steps: cfg.max_steps,
            inject_noise: cfg.inject_noise,
            prefix,
            denoise,
            sampler,
            io,
        })
    }
}

impl Engine for Pipeline {
    fn backend(&self) -> &'static str {
        self.prefix.backend()
    }

    fn io(&self) -> &IoSpec {
        &self.io
    }

    fn alloc_inputs(&self) -> Result<Vec<Box<dyn InputBuffer>>, EngineError> {
        let mut bufs = self.prefix.alloc_inputs()?;
        if self.inject_noise {
            bufs.push(Box::new(super::HostBuffer(vec![0; self.x.len() * 4])));
        }
        Ok(bufs)
    }

    fn run(
        &mut self,
        inputs: &mut [Box<dyn InputBuffer>],
        outputs: &mut [Vec<u8>],
        reset: bool,
    ) -> Result<RunStats, EngineError> {
        let sampling = Sampling {
            seed: 0,
            steps: self.steps as u32,
        };
        self.run_sampled(inputs, outputs, reset, sampling)
    }

    fn run_sampled(
        &mut self,
        inputs: &mut [Box<dyn InputBuffer>],
        outputs: &mut [Vec<u8>],
        reset: bool,
        sampling: Sampling,
    ) -> Result<RunStats, EngineError> {
        let t0 = Instant::now();
        let steps = (sampling.steps as usize).clamp(1, self.max_steps);
        let n_prefix = self.prefix.io().inputs.len();
        let (prefix_in, noise_in) = inputs.split_at_mut(n_prefix.min(inputs.len()));
        self.prefix.run(prefix_in, &mut self.prefix_out, reset)?;
        for &(p, d) in &self.wires {
            self.denoise_in[d]
                .bytes_mut()
                .copy_from_slice(&self.prefix_out[p]);
        }
        let t1 = Instant::now();
        let mut noise = Noise::new(sampling.seed);
        match noise_in.first_mut().filter(|_| self.inject_noise) {
            Some(given) => {
                for (x, c) in self.x.iter_mut().zip(given.bytes_mut().chunks_exact(4)) {
                    *x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            None => noise.fill(&mut self.x),
        }
        for i in 0..steps {
            for (c, x) in self.denoise_in[self.x_in]
                .bytes_mut()
                .chunks_exact_mut(4)
                .zip(&self.x)
            {
                c.copy_from_slice(&x.to_le_bytes());
            }
            let t = match self.sampler.time(i, steps) {
                Time::Continuous(t) => f64::from(t),
                Time::Discrete(t) => t as f64,
            };
            fill_bytes(self.time_type, t, self.denoise_in[self.time_in].bytes_mut());
            if let Some((d, ty)) = self.dt_in {
                let dt = -1.0f32 / steps as f32;
                fill_bytes(ty, f64::from(dt), self.denoise_in[d].bytes_mut());
            }
            self.denoise
                .run(&mut self.denoise_in, &mut self.denoise_out, false)?;
            let out = &self.denoise_out[self.out];
            if self.out_type == ElemType::F32 {
                for (m, c) in self.model_out.iter_mut().zip(out.chunks_exact(4)) {
                    *m = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            } else {
                for (k, m) in self.model_out.iter_mut().enumerate() {
                    *m = load_f64(self.out_type, out, k) as f32;
                }
            }
            if !self.model_out.iter().all(|v| v.is_finite()) {
                return Err(EngineError::Run(format!(
                    "step {} of {steps}: the step graph's output '{}' holds NaN or infinity",
                    i + 1,
                    self.denoise.io().outputs[self.out].name
                )));
            }
            if self.dt_in.is_some() {
                self.x.copy_from_slice(&self.model_out);
            } else {
                self.sampler
                    .step(i, steps, &mut self.x, &self.model_out, || noise.draw());
            }
        }
        for (c, x) in outputs[0].chunks_exact_mut(4).zip(&self.x) {
            c.copy_from_slice(&x.to_le_bytes());
        }
        let t2 = Instant::now();
        Ok(RunStats {
            compute: t2 - t0,
            stages: Some(Stages {
                prefix: t1 - t0,
                denoise: t2 - t1,
                steps: steps as u32,
            }),
        })
    }

    fn working_memory(&self) -> Vec<(String, u64)> {
        let bytes = |v: &[Vec<u8>]| v.iter().map(|b| b.len() as u64).sum::<u64>();
        let steps_in: u64 = self
            .denoise
            .io()
            .inputs
            .iter()
            .map(|s| s.bytes() as u64)
            .sum();
        let mut lines = self.prefix.working_memory();
        lines.extend(self.denoise.working_memory());
        lines.push((
            format!(
                "pipeline     prefix outputs + step-graph inputs and outputs + sample and \
                 prediction ({} values), alphas ({})",
                self.x.len(),
                self.sampler.alphas_cumprod().len()
            ),
            bytes(&self.prefix_out)
                + steps_in
                + bytes(&self.denoise_out)
                + 8 * self.x.len() as u64
                + 4 * self.sampler.alphas_cumprod().len() as u64,
        ));
        lines
    }
}
