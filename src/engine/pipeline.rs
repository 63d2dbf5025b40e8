//! How does a multi-step policy run? As one engine made of two: the prefix (`[engine]`: vision,
//! language, state → features) once per request, then the step graph (`[denoise]`: an action
//! expert or a denoising U-Net) `steps` times under the sampler, over buffers allocated at
//! load. To the rest of policyd it is one engine whose inputs are the prefix's and whose one
//! output is the final sample; the request's seed and step count arrive through
//! [`Engine::run_sampled`].
//!
//! This loop runs on the host: each step copies the sample into the step graph's input and
//! reads its output back. It serves the CPU backend; on TensorRT the same loop runs on the
//! device (`tensorrt::device_loop`), sharing the wiring checked here ([`Wiring`]).

use std::time::Instant;

use super::{
    Continuation, Engine, EngineError, InputBuffer, IoSpec, RunStats, Sampling, Stages, TensorSpec,
};
use crate::config::PipelineConfig;
use crate::dtype::ElemType;
use crate::sampler::{Noise, Sampler};
use crate::transform::{fill_bytes, load_f64};

/// How a prefix feeds a step graph and what the sampler binds: checked once, used by the
/// host loop here and by the TensorRT loop on the device (`tensorrt::device_loop`).
#[derive(Clone, Debug)]
pub struct Wiring {
    /// (prefix output, step-graph input).
    pub wires: Vec<(usize, usize)>,
    /// Step-graph inputs: the sample, the time and its type, and with `update = "model"` the
    /// `dt` input and its type (the graph's output is then the next sample).
    pub x_in: usize,
    pub time_in: usize,
    pub time_type: ElemType,
    pub dt_in: Option<(usize, ElemType)>,
    /// The step-graph output the sampler reads, and its type.
    pub out: usize,
    pub out_type: ElemType,
    /// The pipeline as one engine: the prefix's inputs (and the injected noise), the sample.
    pub io: IoSpec,
    pub sampler: Sampler,
    /// Whether a step can draw fresh noise (DDPM, DDIM with `eta` > 0).
    pub noisy: bool,
    /// Elements of the sample.
    pub n: usize,
    pub steps: usize,
    pub max_steps: usize,
    /// Tests: the noise comes from the request, in inputs after the prefix's: the initial
    /// sample (named as `x`), and for a noisy sampler every step's noise (`<x>_step_noise`,
    /// `[max_steps, elements of x]`).
    pub inject_noise: bool,
    /// `[rtc]` and the sample's rows and row width (its last two axes).
    pub rtc: Option<(crate::rtc::Settings, usize, usize)>,
}

/// The prefix and the step graph, wired, with the sampler and its buffers.
pub struct Pipeline {
    prefix: Box<dyn Engine>,
    denoise: Box<dyn Engine>,
    w: Wiring,
    prefix_out: Vec<Vec<u8>>,
    denoise_in: Vec<Box<dyn InputBuffer>>,
    denoise_out: Vec<Vec<u8>>,
    /// The sample and the step graph's output, as float32.
    x: Vec<f32>,
    model_out: Vec<f32>,
    /// `[rtc]`'s per-row buffers.
    rtc: Option<crate::rtc::Loop>,
}

/// A pipeline that does not fit together: the message names both ends.
fn wiring(message: String) -> EngineError {
    EngineError::Load {
        model: "[denoise]".into(),
        reason: message,
    }
}

impl Wiring {
    /// Wires a prefix with outputs `pio` to a step graph `dio` as `cfg` says, checking every
    /// end: a wired pair must match exactly in dtype and shape, every step-graph input must be
    /// the sample, the time or wired, and the sample, the time and the output must be shaped
    /// as the sampler needs.
    pub fn new(pio: &IoSpec, dio: &IoSpec, cfg: &PipelineConfig) -> Result<Wiring, EngineError> {
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
        let sampler = match &cfg.diffusion {
            None => {
                let mut flow = Sampler::flow();
                flow.flow_time = cfg.flow_time;
                flow
            }
            Some(d) => Sampler::diffusion(cfg.kind, d.clone()),
        };
        // With `max_steps`, every step count's noisy steps are noisy too (DDPM: all but t = 0).
        let noisy =
            dt_in.is_none() && (0..cfg.max_steps).any(|i| sampler.draws_noise(i, cfg.max_steps));
        let mut inputs = pio.inputs.clone();
        if cfg.inject_noise {
            let step_noise = TensorSpec {
                name: format!("{}_step_noise", cfg.x),
                dtype: ElemType::F32,
                shape: vec![cfg.max_steps, xs.elements()],
            };
            for name in [&sample.name, &step_noise.name] {
                if inputs.iter().any(|s| &s.name == name) {
                    return Err(wiring(format!(
                        "sampler.inject_noise: the prefix already has an input '{name}'"
                    )));
                }
            }
            inputs.push(sample.clone());
            if noisy {
                inputs.push(step_noise);
            }
        }
        let io = IoSpec {
            inputs,
            outputs: vec![sample],
        };
        Ok(Wiring {
            wires,
            x_in,
            time_in,
            time_type: ts.dtype,
            dt_in,
            out,
            out_type: os.dtype,
            io,
            sampler,
            noisy,
            n: xs.elements(),
            steps: cfg.steps,
            max_steps: cfg.max_steps,
            inject_noise: cfg.inject_noise,
            rtc: match cfg.rtc {
                Some(r) => Some(rtc_shape(r, xs)?),
                None => None,
            },
        })
    }

    /// The RTC loop's buffers, if `[rtc]` is on.
    pub fn rtc_loop(&self) -> Option<crate::rtc::Loop> {
        self.rtc
            .map(|(s, rows, width)| crate::rtc::Loop::new(s, rows, width))
    }

    /// The step count a request runs: its own, within 1..=max_steps.
    pub fn steps_for(&self, sampling: Sampling) -> usize {
        (sampling.steps as usize).clamp(1, self.max_steps)
    }

    /// The pipeline's input buffers: the prefix's, then the injected noise's if any.
    pub fn alloc_inputs(
        &self,
        prefix: &dyn Engine,
    ) -> Result<Vec<Box<dyn InputBuffer>>, EngineError> {
        let mut bufs = prefix.alloc_inputs()?;
        for s in &self.io.inputs[bufs.len()..] {
            bufs.push(Box::new(super::HostBuffer(vec![0; s.bytes()])));
        }
        Ok(bufs)
    }

    /// The default sampling of a plain [`Engine::run`].
    pub fn default_sampling(&self) -> Sampling {
        Sampling {
            seed: 0,
            steps: self.steps as u32,
        }
    }
}

/// The sample's rows and row width for `[rtc]` (its last two axes: `[1, rows, width]` or
/// `[rows, width]`), and the execution horizon checked against the rows: LeRobot's flow
/// families fail on a horizon longer than the chunk.
fn rtc_shape(
    r: crate::rtc::Settings,
    xs: &TensorSpec,
) -> Result<(crate::rtc::Settings, usize, usize), EngineError> {
    let dims = &xs.shape;
    let (rows, width) = match dims.as_slice() {
        [lead @ .., rows, width] if lead.iter().all(|&d| d == 1) => (*rows, *width),
        _ => {
            return Err(wiring(format!(
                "[rtc] needs a sample of [rows, action width] (sampler.x '{}' is {:?})",
                xs.name, xs.shape
            )));
        }
    };
    if r.execution_horizon > rows {
        return Err(wiring(format!(
            "rtc.execution_horizon = {} is longer than the chunk ({rows} rows of sampler.x '{}' \
             {:?}); at most {rows}",
            r.execution_horizon, xs.name, xs.shape
        )));
    }
    Ok((r, rows, width))
}

impl Pipeline {
    /// Wires `prefix` to `denoise` as `cfg` says ([`Wiring::new`]) and allocates the loop's
    /// buffers.
    pub fn new(
        prefix: Box<dyn Engine>,
        denoise: Box<dyn Engine>,
        cfg: &PipelineConfig,
    ) -> Result<Pipeline, EngineError> {
        let w = Wiring::new(prefix.io(), denoise.io(), cfg)?;
        Ok(Pipeline {
            prefix_out: prefix
                .io()
                .outputs
                .iter()
                .map(|s| vec![0u8; s.bytes()])
                .collect(),
            denoise_in: denoise.alloc_inputs()?,
            denoise_out: denoise
                .io()
                .outputs
                .iter()
                .map(|s| vec![0u8; s.bytes()])
                .collect(),
            x: vec![0.0; w.n],
            model_out: vec![0.0; w.n],
            rtc: w.rtc_loop(),
            prefix,
            denoise,
            w,
        })
    }
}

impl Engine for Pipeline {
    fn backend(&self) -> &'static str {
        self.prefix.backend()
    }

    fn needs_trial_run(&self) -> bool {
        self.prefix.needs_trial_run() || self.denoise.needs_trial_run()
    }

    fn io(&self) -> &IoSpec {
        &self.w.io
    }

    fn alloc_inputs(&self) -> Result<Vec<Box<dyn InputBuffer>>, EngineError> {
        self.w.alloc_inputs(self.prefix.as_ref())
    }

    fn run(
        &mut self,
        inputs: &mut [Box<dyn InputBuffer>],
        outputs: &mut [Vec<u8>],
        reset: bool,
    ) -> Result<RunStats, EngineError> {
        let sampling = self.w.default_sampling();
        self.run_sampled(inputs, outputs, reset, sampling, None)
    }

    fn run_sampled(
        &mut self,
        inputs: &mut [Box<dyn InputBuffer>],
        outputs: &mut [Vec<u8>],
        reset: bool,
        sampling: Sampling,
        continues: Option<Continuation<'_>>,
    ) -> Result<RunStats, EngineError> {
        let t0 = Instant::now();
        let w = &self.w;
        let steps = w.steps_for(sampling);
        let n_prefix = self.prefix.io().inputs.len();
        let (prefix_in, noise_in) = inputs.split_at_mut(n_prefix.min(inputs.len()));
        self.prefix.run(prefix_in, &mut self.prefix_out, reset)?;
        for &(p, d) in &w.wires {
            self.denoise_in[d]
                .bytes_mut()
                .copy_from_slice(&self.prefix_out[p]);
        }
        let t1 = Instant::now();
        let mut noise = Noise::new(sampling.seed);
        let (x0, mut step_noise) = match noise_in {
            [x0, rest @ ..] if w.inject_noise => (Some(x0), rest.first_mut()),
            _ => (None, None),
        };
        match x0 {
            Some(given) => read_f32(given.bytes_mut(), &mut self.x),
            None => noise.fill(&mut self.x),
        }
        let leftover = continues.map_or(&[][..], |c| c.leftover);
        if let Some(l) = self.rtc.as_mut() {
            l.start(continues.map(|c| c.request), leftover, &mut self.x);
        }
        let n = w.n;
        for (i, time) in w.sampler.times(steps).enumerate() {
            for (c, x) in self.denoise_in[w.x_in]
                .bytes_mut()
                .chunks_exact_mut(4)
                .zip(&self.x)
            {
                c.copy_from_slice(&x.to_le_bytes());
            }
            fill_bytes(
                w.time_type,
                time.value(),
                self.denoise_in[w.time_in].bytes_mut(),
            );
            if let Some((d, ty)) = w.dt_in {
                fill_bytes(ty, w.sampler.dt(steps), self.denoise_in[d].bytes_mut());
            }
            self.denoise
                .run(&mut self.denoise_in, &mut self.denoise_out, false)?;
            let out = &self.denoise_out[w.out];
            if w.out_type == ElemType::F32 {
                read_f32(out, &mut self.model_out);
            } else {
                for (k, m) in self.model_out.iter_mut().enumerate() {
                    *m = load_f64(w.out_type, out, k) as f32;
                }
            }
            if !self.model_out.iter().all(|v| v.is_finite()) {
                return Err(not_finite(i, steps, &self.denoise.io().outputs[w.out].name));
            }
            if let Some(l) = &self.rtc {
                l.velocity(time.value() as f32, &self.x, leftover, &mut self.model_out);
            }
            if w.dt_in.is_some() {
                self.x.copy_from_slice(&self.model_out);
            } else if let Some(given) = step_noise.as_mut() {
                let z = &given.bytes_mut()[4 * n * i..4 * n * (i + 1)];
                let mut k = 0;
                let draw = || {
                    let v = f32::from_le_bytes([z[k], z[k + 1], z[k + 2], z[k + 3]]);
                    k += 4;
                    v
                };
                w.sampler.step(i, steps, &mut self.x, &self.model_out, draw);
            } else {
                w.sampler
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
                self.w.n,
                self.w.sampler.alphas_cumprod().len()
            ),
            bytes(&self.prefix_out)
                + steps_in
                + bytes(&self.denoise_out)
                + 8 * self.w.n as u64
                + 4 * self.w.sampler.alphas_cumprod().len() as u64,
        ));
        lines
    }
}

/// Little-endian float32s from `bytes` into `out`.
pub fn read_f32(bytes: &[u8], out: &mut [f32]) {
    for (x, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

/// A step graph's output that held NaN or infinity: the engine failure a request gets.
pub fn not_finite(i: usize, steps: usize, output: &str) -> EngineError {
    EngineError::Run(format!(
        "step {} of {steps}: the step graph's output '{output}' holds NaN or infinity",
        i + 1
    ))
}
