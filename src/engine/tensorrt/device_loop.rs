//! How does a pipeline run on the GPU without going back to the host between steps? The
//! sampler's loop on the device: the prefix's outputs stay where TensorRT wrote them and the
//! step graph reads them there; the sample lives in device memory, and after each step a small
//! kernel (`update.ptx`, the sampler's update as [`Update`] coefficients) moves it in place. The
//! host does its part before the run: it draws the noise and writes, for every step, the
//! update's coefficients and the time into one page-locked block, which a single copy uploads.
//! Per request that is: the prefix, one upload, `steps` × (time copy, enqueue, update), one
//! copy back of the sample and of the word where the kernel marks a non-finite output.
//!
//! The loop is captured as a CUDA graph per step count (every address in it is fixed at load,
//! so the graph does not depend on the slot), and the prefix keeps its own graph per slot:
//! a request launches two graphs. Up to [`MAX_LOOP_GRAPHS`] step counts are kept; others run
//! as plain stream work, as does everything when capture fails.

use std::sync::Arc;

use super::device::{Device, DevicePtr, Graph, Kernel, Mark, UPDATE_RECORD, UpdateArgs};
use super::{Pinned, TensorRtEngine, load_err, run_err};
use crate::config::PipelineConfig;
use crate::dtype::ElemType;
use crate::engine::pipeline::{Pipeline, Wiring, not_finite};
use crate::engine::{Continuation, Sampling, Stages};
use crate::engine::{Engine, EngineError, InputBuffer, IoSpec, RunStats};
use crate::rtc::StepTerm;
use crate::sampler::{Noise, Update};
use crate::transform::fill_bytes;

/// Step counts whose loop is kept as a CUDA graph (the default `steps` and the first others
/// requests ask for); a graph holds `steps` enqueues, so this bounds their memory.
pub const MAX_LOOP_GRAPHS: usize = 8;

/// TensorRT's alignment for tensor addresses, used for every buffer in the block.
const ALIGN: usize = 256;
/// One step's record in the block: its [`Update`] (40 bytes) and its [`StepTerm`] (12
/// bytes), what the kernel reads; then its time (up to 8 bytes) at [`TIME_AT`].
const RECORD: usize = 64;
const TIME_AT: usize = 56;
const _: () = assert!(UPDATE_RECORD <= TIME_AT && TIME_AT + 8 <= RECORD);

/// Where each buffer sits in the loop's block: device memory, mirrored byte for byte by
/// page-locked host memory that the host fills and the copies read and write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Layout {
    /// The sample (float32), updated in place.
    x: usize,
    /// `update = "model"`'s `dt` input.
    dt: usize,
    /// The time input, copied from the step's record before each step.
    time: usize,
    /// The first step whose output was not finite (`u32::MAX`: none).
    flag: usize,
    /// `[rtc]`: the leftover (the sample's size) and one weight or strength per row; empty
    /// without it.
    prev: usize,
    rows: usize,
    /// `max_steps` step records.
    records: usize,
    /// `max_steps` × n noise values, when the sampler draws noise per step.
    noise: usize,
    bytes: usize,
}

impl Layout {
    /// `rtc_rows`: the sample's rows with `[rtc]`, else 0.
    fn new(n: usize, max_steps: usize, noisy: bool, rtc_rows: usize) -> Layout {
        let up = |v: usize| v.div_ceil(ALIGN) * ALIGN;
        let dt = up(4 * n);
        let time = dt + ALIGN;
        let flag = time + ALIGN;
        let prev = flag + ALIGN;
        let (rows, records) = match rtc_rows {
            0 => (prev, prev),
            r => (prev + up(4 * n), prev + up(4 * n) + up(4 * r)),
        };
        let noise = up(records + RECORD * max_steps);
        let bytes = noise + if noisy { 4 * n * max_steps } else { 0 };
        Layout {
            x: 0,
            dt,
            time,
            flag,
            prev,
            rows,
            records,
            noise,
            bytes,
        }
    }

    /// Step `i`'s record.
    fn record(&self, i: usize) -> usize {
        self.records + RECORD * i
    }
}

/// How the loop ran, for tests and the log.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct LoopCounts {
    pub plain: u64,
    pub graph: u64,
    pub captured: u64,
    /// Throwaway loops after a failed capture.
    pub settled: u64,
}

/// A pipeline of two TensorRT plans with its sampler's loop on the device.
pub struct DeviceLoop {
    // The step graph goes before the prefix: its context reads the prefix's outputs.
    denoise: TensorRtEngine,
    prefix: TensorRtEngine,
    device: Arc<dyn Device>,
    w: Wiring,
    kernel: Kernel,
    layout: Layout,
    /// The block on the device, and its host mirror.
    block: DevicePtr,
    host: Pinned,
    /// The step-graph output the update reads.
    m: DevicePtr,
    /// `[rtc]`'s per-row values, and the initial sample as floats for GR00T's inpainting.
    rtc: Option<(crate::rtc::Loop, Vec<f32>)>,
    use_graphs: bool,
    graphs_failed: bool,
    graphs: heapless::Vec<(usize, Graph), MAX_LOOP_GRAPHS>,
    /// Loops queued as plain stream work: TensorRT sets up lazily in its first enqueue, so a
    /// capture waits for one.
    plain_loops: u64,
    pub(crate) counts: LoopCounts,
}

/// A TensorRT pipeline: the loop on the device where the step graph's output is float32 (what
/// the update kernel reads), else the host loop of [`Pipeline`], with a log line saying why.
pub fn build(
    prefix: TensorRtEngine,
    denoise: TensorRtEngine,
    cfg: &PipelineConfig,
) -> Result<Box<dyn Engine>, EngineError> {
    let w = Wiring::new(prefix.io(), denoise.io(), cfg)?;
    if w.out_type != ElemType::F32 {
        log::warn!(
            "tensorrt: the step graph's output '{}' is {}, and the sampler's update on the \
             device reads float32: the loop runs on the host, copying the sample every step \
             (rebuild the plan with --outputIOFormats=fp32:chw to keep it on the device)",
            cfg.output,
            w.out_type
        );
        return Ok(Box::new(Pipeline::new(
            Box::new(prefix),
            Box::new(denoise),
            cfg,
        )?));
    }
    Ok(Box::new(DeviceLoop::wired(prefix, denoise, w)?))
}

impl DeviceLoop {
    /// Wires the two plans on their shared device: the step graph's inputs pointed at the
    /// prefix's outputs and at the loop's block, the update kernel loaded, the block allocated.
    pub fn new(
        prefix: TensorRtEngine,
        denoise: TensorRtEngine,
        cfg: &PipelineConfig,
    ) -> Result<DeviceLoop, EngineError> {
        let w = Wiring::new(prefix.io(), denoise.io(), cfg)?;
        DeviceLoop::wired(prefix, denoise, w)
    }

    fn wired(
        mut prefix: TensorRtEngine,
        denoise: TensorRtEngine,
        w: Wiring,
    ) -> Result<DeviceLoop, EngineError> {
        let err =
            |what: &str, e: &dyn std::fmt::Display| load_err("[denoise]", format!("{what}: {e}"));
        if w.out_type != ElemType::F32 {
            return Err(err(
                "the sampler's output",
                &"must be float32 on the device",
            ));
        }
        let device = prefix.device().clone();
        if !Arc::ptr_eq(&device, denoise.device()) {
            return Err(err("the step graph", &"is not on the prefix's device"));
        }
        prefix.keep_outputs_on_device();
        let rtc = w.rtc_loop().map(|l| (l, vec![0.0; w.n]));
        let layout = Layout::new(
            w.n,
            w.max_steps,
            w.noisy,
            rtc.as_ref().map_or(0, |r| r.0.rows),
        );
        let kernel = device
            .load_update()
            .map_err(|e| err("the sampler's update kernel (update.ptx)", &e))?;
        let (block, host) = match (
            device.alloc_device(layout.bytes),
            Pinned::new(&device, layout.bytes, false),
        ) {
            (Ok(b), Ok(h)) => (b, h),
            (b, h) => {
                // SAFETY: loaded and allocated just now; nothing was queued with them.
                unsafe {
                    device.unload(kernel);
                    if let Ok(b) = b {
                        device.free_device(b);
                    }
                }
                return Err(match (b, h) {
                    (Err(e), _) => err("cannot allocate device memory for the loop", &e),
                    (_, Err(e)) => e,
                    _ => unreachable!("one of the two failed"),
                });
            }
        };
        let mut this = DeviceLoop {
            m: denoise.output_address(w.out),
            rtc,
            use_graphs: prefix.graphs_enabled(),
            denoise,
            prefix,
            device,
            kernel,
            layout,
            block,
            host,
            graphs_failed: false,
            graphs: heapless::Vec::new(),
            plain_loops: 0,
            counts: LoopCounts::default(),
            w,
        };
        let base = this.block as usize;
        let fed: Vec<(usize, DevicePtr)> = this
            .w
            .wires
            .iter()
            .map(|&(p, d)| (d, this.prefix.output_address(p)))
            .chain([
                (this.w.x_in, (base + layout.x) as DevicePtr),
                (this.w.time_in, (base + layout.time) as DevicePtr),
            ])
            .chain(
                this.w
                    .dt_in
                    .map(|(d, _)| (d, (base + layout.dt) as DevicePtr)),
            )
            .collect();
        for (input, address) in fed {
            this.denoise.feed_input(input, address)?;
        }
        log::info!(
            "tensorrt: the {} sampler's loop runs on the device ({} values per sample, up to \
             {} steps, {} bytes of step records and noise); CUDA graphs for up to {} step \
             counts {}",
            format!("{:?}", this.w.sampler.kind).to_lowercase(),
            this.w.n,
            this.w.max_steps,
            layout.bytes,
            MAX_LOOP_GRAPHS,
            if this.use_graphs { "on" } else { "off" }
        );
        Ok(this)
    }
}

impl DeviceLoop {
    /// Writes a request's part of the block on the host: the initial sample (drawn from
    /// `seed`, or the injected noise), `dt`, the flag, with `[rtc]` the leftover and its rows'
    /// weights, every step's record and noise. The draws come in the host loop's order (the
    /// sample, then each noisy step's values), so a seed gives the same noise on both.
    fn fill(
        &mut self,
        steps: usize,
        seed: u64,
        injected: &mut [Box<dyn InputBuffer>],
        continues: Option<Continuation<'_>>,
    ) {
        let (l, w, n) = (self.layout, &self.w, self.w.n);
        let h = self.host.bytes_mut();
        let mut noise = Noise::new(seed);
        let put = |h: &mut [u8], at: usize, v: f32| h[at..at + 4].copy_from_slice(&v.to_le_bytes());
        let (x0, mut step_noise) = match injected {
            [x0, rest @ ..] if w.inject_noise => (Some(x0), rest.first_mut()),
            _ => (None, None),
        };
        match x0 {
            Some(b) => h[l.x..l.x + 4 * n].copy_from_slice(&b.bytes_mut()[..4 * n]),
            None => {
                for k in 0..n {
                    put(h, l.x + 4 * k, noise.draw());
                }
            }
        }
        if let Some((_, ty)) = w.dt_in {
            fill_bytes(ty, w.sampler.dt(steps), &mut h[l.dt..l.dt + ty.size()]);
        }
        h[l.flag..l.flag + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        if let Some((lp, x)) = self.rtc.as_mut() {
            // As the host loop starts: the weights, or the leftover inpainted into the sample.
            let get =
                |h: &[u8], at: usize| f32::from_le_bytes([h[at], h[at + 1], h[at + 2], h[at + 3]]);
            for (k, v) in x.iter_mut().enumerate() {
                *v = get(h, l.x + 4 * k);
            }
            let leftover = continues.map_or(&[][..], |c| c.leftover);
            lp.start(continues.map(|c| c.request), leftover, x);
            for (k, v) in x.iter().enumerate() {
                put(h, l.x + 4 * k, *v);
            }
            for (k, v) in lp.per_row().iter().enumerate() {
                put(h, l.rows + 4 * k, *v);
            }
            for k in 0..n {
                put(h, l.prev + 4 * k, leftover.get(k).copied().unwrap_or(0.0));
            }
        }
        let time_bytes = w.time_type.size();
        for (i, time) in w.sampler.times(steps).enumerate() {
            let r = l.record(i);
            let u = match w.dt_in {
                Some(_) => Update::take_output(),
                None => w.sampler.update(i, steps),
            };
            u.write(&mut h[r..r + Update::BYTES]);
            let term = match &self.rtc {
                Some((lp, _)) => lp.step_term(time.value() as f32),
                None => StepTerm::Plain,
            };
            term.write(&mut h[r + Update::BYTES..r + UPDATE_RECORD]);
            fill_bytes(
                w.time_type,
                time.value(),
                &mut h[r + TIME_AT..r + TIME_AT + time_bytes],
            );
            if w.noisy && w.sampler.draws_noise(i, steps) {
                let z = l.noise + 4 * n * i;
                match step_noise.as_mut() {
                    Some(b) => {
                        h[z..z + 4 * n].copy_from_slice(&b.bytes_mut()[4 * n * i..4 * n * (i + 1)])
                    }
                    None => {
                        for k in 0..n {
                            put(h, z + 4 * k, noise.draw());
                        }
                    }
                }
            }
        }
    }

    /// Queues the loop of `steps` on the stream: the upload, every step, the copies back.
    fn queue_loop(&mut self, steps: usize) -> Result<(), EngineError> {
        let (l, n) = (self.layout, self.w.n);
        let dev = self.block;
        let at = |off: usize| dev + off as DevicePtr;
        let host = self.host.alloc.ptr;
        let time_bytes = self.w.time_type.size();
        // SAFETY (every copy and launch below): the block and its mirror are this loop's own,
        // sized by `layout` for max_steps ≥ steps, and live until the stream's work is done
        // (Drop synchronises first).
        unsafe {
            self.device
                .copy_htod(dev, host, l.record(steps))
                .map_err(|e| run_err("upload", e))?;
            if self.w.noisy {
                self.device
                    .copy_htod(at(l.noise), host.add(l.noise), 4 * n * steps)
                    .map_err(|e| run_err("upload", e))?;
            }
        }
        for i in 0..steps {
            let r = l.record(i);
            // SAFETY: as above.
            unsafe {
                self.device
                    .copy_dtod(at(l.time), at(r + TIME_AT), time_bytes)
                    .map_err(|e| run_err("time", e))?;
            }
            self.denoise.enqueue_fed()?;
            let args = UpdateArgs {
                x: at(l.x),
                m: self.m,
                noise: if self.w.noisy {
                    at(l.noise + 4 * n * i)
                } else {
                    0
                },
                coef: at(r),
                flag: at(l.flag),
                n: n as u32,
                step: i as u32,
                prev: if self.rtc.is_some() { at(l.prev) } else { 0 },
                rows: if self.rtc.is_some() { at(l.rows) } else { 0 },
                width: self.rtc.as_ref().map_or(1, |r| r.0.width as u32),
            };
            // SAFETY: as above; `m` is the step graph's output, `n` float32s.
            unsafe { self.device.launch_update(self.kernel, &args) }
                .map_err(|e| run_err("update kernel", e))?;
        }
        // SAFETY: as above.
        unsafe {
            self.device
                .copy_dtoh(host.add(l.x), at(l.x), 4 * n)
                .map_err(|e| run_err("copy out", e))?;
            self.device
                .copy_dtoh(host.add(l.flag), at(l.flag), 4)
                .map_err(|e| run_err("copy out", e))?;
        }
        Ok(())
    }

    /// The graph of `steps`' loop: kept, newly captured, or none (plain stream work).
    fn graph(&mut self, steps: usize) -> Option<Graph> {
        if let Some(&(_, g)) = self.graphs.iter().find(|(s, _)| *s == steps) {
            return Some(g);
        }
        if !self.use_graphs || self.graphs_failed || self.plain_loops == 0 || self.graphs.is_full()
        {
            return None;
        }
        let captured = self
            .device
            .begin_capture()
            .map_err(|e| run_err("capture", e))
            .and_then(|_| match self.queue_loop(steps) {
                Ok(()) => self.device.end_capture().map_err(|e| run_err("capture", e)),
                Err(e) => {
                    self.device.abort_capture();
                    Err(e)
                }
            });
        match captured {
            Ok(g) => {
                self.counts.captured += 1;
                // Cannot be full: checked above.
                let _ = self.graphs.push((steps, g));
                Some(g)
            }
            Err(e) => {
                log::warn!(
                    "tensorrt: CUDA graph capture of the sampler's loop failed, running it \
                     without graphs: {e}"
                );
                self.graphs_failed = true;
                self.drop_graphs();
                // One throwaway loop, so an error the capture left behind surfaces here.
                let settled = self
                    .queue_loop(steps)
                    .and_then(|_| self.device.synchronize().map_err(|e| run_err("sync", e)));
                self.counts.settled += 1;
                if let Err(e) = settled {
                    log::debug!("tensorrt: the loop after a failed capture failed too: {e}");
                }
                None
            }
        }
    }

    fn drop_graphs(&mut self) {
        for (_, g) in std::mem::take(&mut self.graphs) {
            // SAFETY: captured by this device, dropped once, never launched again.
            unsafe { self.device.destroy_graph(g) };
        }
    }
}

impl Engine for DeviceLoop {
    fn backend(&self) -> &'static str {
        "tensorrt"
    }

    fn io(&self) -> &IoSpec {
        &self.w.io
    }

    fn alloc_inputs(&self) -> Result<Vec<Box<dyn InputBuffer>>, EngineError> {
        self.w.alloc_inputs(&self.prefix)
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
        _reset: bool,
        sampling: Sampling,
        continues: Option<Continuation<'_>>,
    ) -> Result<RunStats, EngineError> {
        let steps = self.w.steps_for(sampling);
        let n = self.w.n;
        if outputs.len() != 1 || outputs[0].len() != 4 * n {
            return Err(EngineError::Run(format!(
                "expected one output of {} bytes",
                4 * n
            )));
        }
        let n_prefix = self.prefix.io().inputs.len();
        let (prefix_in, extra) = inputs.split_at_mut(n_prefix.min(inputs.len()));
        let slot = self.prefix.prepare(prefix_in)?;
        // Before `fill`: a failed capture runs a throwaway loop through the mirror.
        let graph = self.graph(steps);
        self.fill(steps, sampling.seed, extra, continues);
        let event = |e| run_err("event", e);
        self.device.mark(Mark::Start).map_err(event)?;
        self.prefix.queue(slot)?;
        self.device.mark(Mark::Split).map_err(event)?;
        match graph {
            Some(g) => {
                self.device
                    .launch(g)
                    .map_err(|e| run_err("graph launch", e))?;
                self.counts.graph += 1;
            }
            None => {
                self.queue_loop(steps)?;
                self.plain_loops += 1;
                self.counts.plain += 1;
            }
        }
        self.device.mark(Mark::End).map_err(event)?;
        let compute = self.device.finish().map_err(|e| run_err("sync", e))?;
        let prefix = self.device.split().map_err(|e| run_err("sync", e))?;
        let l = self.layout;
        let h = self.host.bytes();
        let flag = u32::from_le_bytes([h[l.flag], h[l.flag + 1], h[l.flag + 2], h[l.flag + 3]]);
        if flag != u32::MAX {
            let name = &self.denoise.io().outputs[self.w.out].name;
            return Err(not_finite(flag as usize, steps, name));
        }
        outputs[0].copy_from_slice(&h[l.x..l.x + 4 * n]);
        Ok(RunStats {
            compute,
            stages: Some(Stages {
                prefix,
                denoise: compute.saturating_sub(prefix),
                steps: steps as u32,
            }),
        })
    }

    fn working_memory(&self) -> Vec<(String, u64)> {
        let mut lines = self.prefix.working_memory();
        lines.extend(self.denoise.working_memory());
        lines.push((
            format!(
                "tensorrt     sampler loop: sample ({} values), step records ({} steps){}{}; \
                 on the device and page-locked",
                self.w.n,
                self.w.max_steps,
                if self.w.noisy {
                    ", noise for every step"
                } else {
                    ""
                },
                if self.rtc.is_some() {
                    ", the RTC leftover and row weights"
                } else {
                    ""
                }
            ),
            2 * self.layout.bytes as u64,
        ));
        lines
    }
}

impl Drop for DeviceLoop {
    fn drop(&mut self) {
        let _ = self.device.bind();
        // Work still queued reads the block and runs the kernel: let it finish first.
        let _ = self.device.synchronize();
        self.drop_graphs();
        // SAFETY: loaded and allocated by this loop, released once, the stream idle.
        unsafe {
            self.device.unload(self.kernel);
            self.device.free_device(self.block);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::standin::{self, HostDevice};
    use super::super::{Options, TensorRtEngine};
    use super::*;
    use crate::config::ZeroCopy;

    const PREFIX: &str = "input state 0 1,8\noutput features 0 1,4\noutput unused 0 1,3";
    /// `0.5·x + feat[0] + t (+ dt) + k/1000`: depends on the sample, the prefix and the time.
    const STEP: &str = "input x 0 1,10,7\ninput feat 0 1,4\ninput t 0 1\noutput v 0 1,10,7\nstep";
    const STEP_INT_TIME: &str =
        "input x 0 1,10,7\ninput feat 0 1,4\ninput t 8 1\noutput v 0 1,10,7\nstep";
    const STEP_DT: &str =
        "input x 0 1,10,7\ninput feat 0 1,4\ninput t 0 1\ninput dt 0 1\noutput v 0 1,10,7\nstep";

    /// The test pipeline's config: `sampler`'s keys, and `engine`'s lines under `[engine]`.
    fn config(sampler: &str, engine: &str) -> crate::config::Config {
        crate::config::Config::parse(
            &format!(
                r#"
[engine]
model = "prefix.plan"
{engine}
[denoise]
model = "step.plan"
wire = {{ feat = "features" }}
[sampler]
x = "x"
time = "t"
output = "v"
{sampler}
[[inputs]]
key = "state"
tensor = "state"
dtypes = ["float32"]
shape = [8]
[[outputs]]
tensor = "x"
"#
            ),
            "test",
            Some(std::path::Path::new(".")),
        )
        .unwrap()
    }

    fn pipeline(sampler: &str) -> PipelineConfig {
        config(sampler, "")
            .default_policy()
            .pipeline
            .clone()
            .unwrap()
    }

    const FLOW: &str = "kind = \"flow\"\nsteps = 5\nmax_steps = 12";
    const DDIM: &str = "kind = \"ddim\"\nsteps = 10\nmax_steps = 20\nnum_train_timesteps = 100\n\
                        beta_schedule = \"squaredcos_cap_v2\"\nclip_sample = true";
    const DDIM_ETA: &str = "kind = \"ddim\"\nsteps = 4\nmax_steps = 10\nnum_train_timesteps = 100\n\
                            prediction_type = \"v_prediction\"\neta = 0.5";
    const DDPM: &str = "kind = \"ddpm\"\nsteps = 6\nmax_steps = 10\nnum_train_timesteps = 60\n\
                        prediction_type = \"sample\"\nclip_sample = false";
    const MODEL: &str =
        "kind = \"flow\"\nsteps = 4\nmax_steps = 8\nupdate = \"model\"\ndt = \"dt\"";

    fn opts(graphs: bool, zero_copy: ZeroCopy) -> Options {
        Options {
            model: "test.plan".into(),
            dla_core: None,
            cuda_graph: graphs,
            zero_copy,
            shapes: Vec::new(),
        }
    }

    fn engine(plan: &str, dev: &Arc<HostDevice>, o: &Options) -> TensorRtEngine {
        TensorRtEngine::new(&standin::API, dev.clone(), plan.as_bytes(), o).unwrap()
    }

    fn device_loop(step: &str, p: &PipelineConfig, o: &Options) -> (Arc<HostDevice>, DeviceLoop) {
        let dev = Arc::new(HostDevice::new(o.zero_copy == ZeroCopy::On));
        let l = DeviceLoop::new(engine(PREFIX, &dev, o), engine(step, &dev, o), p).unwrap();
        (dev, l)
    }

    fn host_loop(step: &str, p: &PipelineConfig) -> Pipeline {
        let dev = Arc::new(HostDevice::new(false));
        let o = opts(false, ZeroCopy::Off);
        let (a, b) = (engine(PREFIX, &dev, &o), engine(step, &dev, &o));
        Pipeline::new(Box::new(a), Box::new(b), p).unwrap()
    }

    fn run(
        e: &mut dyn Engine,
        inputs: &mut [Box<dyn InputBuffer>],
        state: f32,
        seed: u64,
        steps: u32,
    ) -> Result<(Vec<f32>, RunStats), EngineError> {
        inputs[0].bytes_mut()[..4].copy_from_slice(&state.to_ne_bytes());
        let mut out = vec![vec![0u8; 280]];
        let stats = e.run_sampled(inputs, &mut out, false, Sampling { seed, steps }, None)?;
        let v = out[0]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        Ok((v, stats))
    }

    /// The loop on the device gives the host loop's actions for every sampler, time type and
    /// `update = "model"`, with and without zero-copy, plain and replayed as graphs, at several
    /// step counts and seeds: the same noise in the same order, the same times, the same update.
    #[test]
    fn the_device_loop_gives_the_host_loops_actions() {
        // Flow and `update = "model"` to the bit; DDPM and DDIM to rounding (the kernel's form
        // of the update groups the arithmetic differently).
        let cases = [
            (STEP, FLOW, true),
            (STEP_DT, MODEL, true),
            (STEP_INT_TIME, DDIM, false),
            (STEP_INT_TIME, DDIM_ETA, false),
            (STEP_INT_TIME, DDPM, false),
        ];
        for (step, sampler, exact) in cases {
            let p = pipeline(sampler);
            let mut host = host_loop(step, &p);
            let mut host_in = host.alloc_inputs().unwrap();
            for zero_copy in [ZeroCopy::Off, ZeroCopy::On] {
                let (dev, mut dl) = device_loop(step, &p, &opts(true, zero_copy));
                let mut a = dl.alloc_inputs().unwrap();
                let mut b = dl.alloc_inputs().unwrap();
                let requests = [(0.25f32, 7u64, p.steps as u32), (1.5, 8, 1), (-0.5, 9, 3)];
                let mut varied = false;
                for (r, &(state, seed, steps)) in requests.iter().cycle().take(9).enumerate() {
                    let slot = if r % 2 == 0 { &mut a } else { &mut b };
                    let (got, stats) = run(&mut dl, slot, state, seed, steps).unwrap();
                    let (want, _) = run(&mut host, &mut host_in, state, seed, steps).unwrap();
                    let s = stats.stages.unwrap();
                    assert_eq!(s.steps, steps, "{sampler}");
                    assert_eq!(s.prefix, std::time::Duration::from_micros(100));
                    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                        let ok = if exact {
                            g == w
                        } else {
                            (g - w).abs() <= 1e-4 * w.abs().max(1.0)
                        };
                        assert!(ok, "{sampler} {zero_copy:?} request {r} [{k}]: {g} vs {w}");
                    }
                    // (A DDIM step from t = 0 may clip every element to the same bound.)
                    varied |= got.iter().any(|v| *v != got[0]);
                }
                assert!(varied, "{sampler}: the sample varies");
                // The first loop runs plain (TensorRT sets up in it); then one graph for each
                // of the three step counts, replayed.
                assert_eq!(
                    dl.counts,
                    LoopCounts {
                        plain: 1,
                        graph: 8,
                        captured: 3,
                        settled: 0
                    },
                    "{sampler} {zero_copy:?}"
                );
                assert!(*dev.updates.lock().unwrap() > 0);
                drop((a, b));
                drop(dl);
                assert_eq!(dev.live(), 0, "everything freed");
                assert_eq!(dev.live_graphs(), 0);
                assert_eq!(*dev.modules.lock().unwrap(), 0, "the kernel unloaded");
            }
        }
    }

    /// `[rtc]` on the device: guidance (two schedules) and GR00T's inpainting give the host
    /// loop's actions to the bit, plain and replayed as graphs, for leftovers of several
    /// lengths and delays (the delay past the horizon, 0, a leftover shorter than the
    /// horizon), and a request with no leftover is the unguided chunk; nothing allocates.
    #[test]
    fn real_time_chunking_runs_in_the_device_loop() {
        let guided = |schedule: &str| {
            format!(
                "{FLOW}\n[rtc]\nexecution_horizon = 8\nprefix_attention_schedule = \"{schedule}\"\nmax_guidance_weight = 4.0"
            )
        };
        let groot = format!("{FLOW}\nflow_time = \"groot\"\n[rtc]\nexecution_horizon = 6");
        let n = 70;
        for sampler in [guided("linear"), guided("exp"), groot] {
            let p = pipeline(&sampler);
            assert!(p.rtc.is_some(), "{sampler}");
            let mut host = host_loop(STEP, &p);
            let mut host_in = host.alloc_inputs().unwrap();
            let (dev, mut dl) = device_loop(STEP, &p, &opts(true, ZeroCopy::Off));
            let plain = pipeline(sampler.split("\n[rtc]").next().unwrap());
            let (_, mut unguided) = device_loop(STEP, &plain, &opts(true, ZeroCopy::Off));
            let mut plain_in = unguided.alloc_inputs().unwrap();
            let mut a = dl.alloc_inputs().unwrap();
            let mut leftover = vec![0.0f32; n];
            let chunk = |e: &mut dyn Engine,
                         inputs: &mut [Box<dyn InputBuffer>],
                         leftover: &[f32],
                         request: Option<crate::rtc::Request>| {
                inputs[0].bytes_mut()[..4].copy_from_slice(&0.3f32.to_ne_bytes());
                let mut out = vec![vec![0u8; 4 * n]];
                let continues = request.map(|request| Continuation { leftover, request });
                let sampling = Sampling { seed: 11, steps: 5 };
                e.run_sampled(inputs, &mut out, false, sampling, continues)
                    .unwrap();
                out[0]
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect::<Vec<f32>>()
            };
            let none = chunk(&mut unguided, &mut plain_in, &leftover, None);
            // (valid rows of the leftover, delay)
            for (r, (rows, delay)) in [(8, 2), (8, 0), (3, 1), (8, 9), (0, 0), (5, 3)]
                .into_iter()
                .enumerate()
            {
                leftover.fill(0.0);
                for (k, v) in leftover[..rows * 7].iter_mut().enumerate() {
                    *v = ((k * 13 + r) % 17) as f32 / 8.0 - 1.0;
                }
                let request = Some(crate::rtc::Request { rows, delay });
                let got = chunk(&mut dl, &mut a, &leftover, request);
                let want = chunk(&mut host, &mut host_in, &leftover, request);
                assert_eq!(got, want, "{sampler}: rows {rows}, delay {delay}");
                if rows == 0 {
                    assert_eq!(got, none, "{sampler}: no leftover, no RTC");
                } else {
                    assert_ne!(got, none, "{sampler}: rows {rows}, delay {delay}: guided");
                }
                assert_eq!(chunk(&mut dl, &mut a, &leftover, None), none, "{sampler}");
            }
            assert!(dl.counts.graph > 0, "replayed as a graph");
            let mut out = vec![vec![0u8; 4 * n]];
            let before = standin::allocations();
            for r in 0..50 {
                let request = crate::rtc::Request {
                    rows: 1 + r % 8,
                    delay: r % 3,
                };
                let continues = Some(Continuation {
                    leftover: &leftover,
                    request,
                });
                let sampling = Sampling {
                    seed: r as u64,
                    steps: 5,
                };
                dl.run_sampled(&mut a, &mut out, false, sampling, continues)
                    .unwrap();
            }
            assert_eq!(standin::allocations() - before, 0, "{sampler}: allocations");
            drop(a);
            drop(dl);
            assert_eq!(dev.live(), 0, "everything freed");
        }
    }

    /// Seeds: the same seed gives the same actions from any slot, another seed others; with
    /// fresh noise per step (DDPM) as well as only at the start (flow).
    #[test]
    fn seeds_decide_the_noise() {
        for sampler in [FLOW, DDPM] {
            let step = if sampler == DDPM { STEP_INT_TIME } else { STEP };
            let (_dev, mut dl) = device_loop(step, &pipeline(sampler), &opts(true, ZeroCopy::Off));
            let mut a = dl.alloc_inputs().unwrap();
            let mut b = dl.alloc_inputs().unwrap();
            let x = run(&mut dl, &mut a, 0.5, 42, 4).unwrap().0;
            let y = run(&mut dl, &mut b, 0.5, 42, 4).unwrap().0;
            let z = run(&mut dl, &mut a, 0.5, 43, 4).unwrap().0;
            assert_eq!(x, y, "{sampler}");
            assert_ne!(x, z, "{sampler}");
        }
    }

    /// A step whose output is NaN fails the request with the host loop's message, naming the
    /// first failing step; the next request is unaffected.
    #[test]
    fn a_non_finite_step_output_fails_the_request() {
        for graphs in [false, true] {
            let p = pipeline(FLOW);
            let (_dev, mut dl) = device_loop(STEP, &p, &opts(graphs, ZeroCopy::Off));
            let mut a = dl.alloc_inputs().unwrap();
            run(&mut dl, &mut a, 0.5, 1, 5).unwrap();
            // The prefix passes state[0] on: NaN reaches every step's output.
            let e = run(&mut dl, &mut a, f32::NAN, 1, 5)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("step 1 of 5: the step graph's output 'v' holds NaN or infinity"),
                "{e}"
            );
            let e = run(&mut dl, &mut a, f32::INFINITY, 1, 3)
                .unwrap_err()
                .to_string();
            assert!(e.contains("step 1 of 3"), "{e}");
            let (x, _) = run(&mut dl, &mut a, 0.5, 1, 5).unwrap();
            assert!(x.iter().all(|v| v.is_finite()));
        }
    }

    /// A step graph that cannot be captured: one capture tried and aborted, one throwaway
    /// loop, then plain loops with the right actions; the prefix keeps its own graphs.
    #[test]
    fn a_failed_capture_runs_the_loop_without_graphs() {
        let p = pipeline(FLOW);
        let step = format!("{STEP}\nno_capture");
        let (dev, mut dl) = device_loop(&step, &p, &opts(true, ZeroCopy::Off));
        let mut host = host_loop(STEP, &p);
        let mut host_in = host.alloc_inputs().unwrap();
        let mut a = dl.alloc_inputs().unwrap();
        for r in 0..4 {
            let (got, _) = run(&mut dl, &mut a, r as f32, 5, 5).unwrap();
            let (want, _) = run(&mut host, &mut host_in, r as f32, 5, 5).unwrap();
            assert_eq!(got, want, "request {r}");
        }
        assert_eq!(
            dl.counts,
            LoopCounts {
                plain: 4,
                graph: 0,
                captured: 0,
                settled: 1
            }
        );
        assert_eq!(*dev.aborted.lock().unwrap(), 1);
        assert!(
            dl.prefix.counts.graph > 0,
            "the prefix still replays its graph"
        );
    }

    /// Graphs are kept for at most MAX_LOOP_GRAPHS step counts; the rest run plain, and
    /// correctly.
    #[test]
    fn graphs_are_kept_for_a_bounded_number_of_step_counts() {
        let p = pipeline(FLOW);
        let (dev, mut dl) = device_loop(STEP, &p, &opts(true, ZeroCopy::Off));
        let mut host = host_loop(STEP, &p);
        let mut host_in = host.alloc_inputs().unwrap();
        let mut a = dl.alloc_inputs().unwrap();
        for round in 0..2 {
            for steps in 1..=12u32 {
                let (got, _) = run(&mut dl, &mut a, 0.1, 3, steps).unwrap();
                let (want, _) = run(&mut host, &mut host_in, 0.1, 3, steps).unwrap();
                assert_eq!(got, want, "round {round}, {steps} steps");
            }
        }
        assert_eq!(dl.counts.captured, MAX_LOOP_GRAPHS as u64);
        assert_eq!(dev.live_graphs(), MAX_LOOP_GRAPHS + 1, "+ the prefix's");
        // Steps 2..=9 captured on first sight (step 1's loop ran plain first), replayed in
        // round two; the others ran plain both times.
        assert_eq!(dl.counts.graph, 16);
        assert_eq!(dl.counts.plain, 8);
    }

    /// After warm-up (the first loop plain, each step count's first use captured) a request
    /// allocates nothing on the host: drawing the noise, the step records, the prefix's and
    /// the loop's launches, the NaN check; graphs on and off, steps changing every request.
    #[test]
    fn steady_state_requests_allocate_nothing() {
        for (step, sampler) in [(STEP, FLOW), (STEP_INT_TIME, DDPM), (STEP_DT, MODEL)] {
            for graphs in [true, false] {
                let p = pipeline(sampler);
                let (_dev, mut dl) = device_loop(step, &p, &opts(graphs, ZeroCopy::Off));
                let mut a = dl.alloc_inputs().unwrap();
                let mut out = vec![vec![0u8; 280]];
                let mut request = |dl: &mut DeviceLoop, seed: u64, steps: u32| {
                    dl.run_sampled(&mut a, &mut out, false, Sampling { seed, steps }, None)
                        .unwrap();
                };
                for steps in [1, 4, 1, 4] {
                    request(&mut dl, 1, steps);
                }
                let before = standin::allocations();
                for r in 0..200u64 {
                    request(&mut dl, r, 1 + 3 * (r % 2) as u32);
                }
                let made = standin::allocations() - before;
                assert_eq!(made, 0, "{sampler}, graphs {graphs}: {made} allocations");
                if graphs {
                    // Warm-up: one plain loop, then three from graphs.
                    assert_eq!(dl.counts.graph, 203, "{sampler}");
                }
            }
        }
    }

    /// Injected noise (the test-only `inject_noise`): the initial sample and DDPM's per-step
    /// noise from the request reach both loops, which then agree; other step noise, other
    /// actions.
    #[test]
    fn injected_noise_reaches_both_loops() {
        let p = pipeline(&format!("{DDPM}\ninject_noise = true"));
        let mut host = host_loop(STEP_INT_TIME, &p);
        let (_dev, mut dl) = device_loop(STEP_INT_TIME, &p, &opts(true, ZeroCopy::Off));
        let names: Vec<&str> = dl.io().inputs.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["state", "x", "x_step_noise"]);
        assert_eq!(dl.io().inputs[2].shape, [10, 70]);
        let (mut a, mut b) = (dl.alloc_inputs().unwrap(), host.alloc_inputs().unwrap());
        let mut results = Vec::new();
        for salt in [0.0f32, 0.0, 0.5] {
            for bufs in [&mut a, &mut b] {
                for (j, buf) in bufs[1..].iter_mut().enumerate() {
                    for (k, c) in buf.bytes_mut().chunks_exact_mut(4).enumerate() {
                        let v = ((k * 7 + j * 3) % 11) as f32 / 5.0 - 1.0 + salt * j as f32;
                        c.copy_from_slice(&v.to_le_bytes());
                    }
                }
            }
            let (got, _) = run(&mut dl, &mut a, 0.3, 1, 6).unwrap();
            let (want, _) = run(&mut host, &mut b, 0.3, 99, 6).unwrap();
            for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!((g - w).abs() <= 1e-4 * w.abs().max(1.0), "[{k}] {g} vs {w}");
            }
            results.push(got);
        }
        assert_eq!(
            results[0], results[1],
            "the seed does not matter: the noise is given"
        );
        assert_ne!(results[1], results[2], "other step noise, other actions");
    }

    /// Loaded as a policy (plan compiled against it, slots allocated, warm-up through
    /// `Engine::run`), budgeted, and everything freed when the policy goes.
    #[test]
    fn serves_as_a_policy() {
        let cfg = config("kind = \"flow\"\nsteps = 5", "slots = 3\nwarmup_runs = 2");
        let spec = cfg.default_policy();
        let p = spec.pipeline.clone().unwrap();
        let (dev, dl) = device_loop(STEP, &p, &opts(true, ZeroCopy::On));
        let loaded = crate::policy::build::load_engine(&cfg, spec, Box::new(dl)).unwrap();
        assert_eq!(loaded.backend, "tensorrt");
        let budget = loaded.budget.render();
        assert!(budget.contains("sampler loop"), "{budget}");
        assert!(
            *dev.updates.lock().unwrap() >= 5,
            "warm-up ran the loop: {budget}"
        );
        drop(loaded);
        assert_eq!(
            dev.live(),
            0,
            "slots, engines and the loop freed their memory"
        );
        assert_eq!(*dev.modules.lock().unwrap(), 0);
    }

    /// A step graph whose output is not float32 keeps the host loop; the budget names the
    /// loop's buffers when it is on the device.
    #[test]
    fn build_chooses_the_loop_and_budgets_it() {
        let p = pipeline(FLOW);
        let o = opts(true, ZeroCopy::Off);
        let dev = Arc::new(HostDevice::new(false));
        let half = STEP.replace("output v 0", "output v 1");
        let e = build(engine(PREFIX, &dev, &o), engine(&half, &dev, &o), &p).unwrap();
        let lines = e.working_memory();
        assert!(
            lines.iter().all(|(l, _)| !l.contains("sampler loop")),
            "{lines:?}"
        );
        assert!(
            lines.iter().any(|(l, _)| l.starts_with("pipeline")),
            "{lines:?}"
        );
        let e = build(engine(PREFIX, &dev, &o), engine(STEP, &dev, &o), &p).unwrap();
        let lines = e.working_memory();
        let (_, bytes) = lines
            .iter()
            .find(|(l, _)| l.contains("sampler loop"))
            .unwrap_or_else(|| panic!("{lines:?}"));
        // Sample (70 floats: 512 B aligned), dt, time, flag (256 B each), 12 records of 64 B;
        // twice (device, host).
        assert_eq!(*bytes, 2 * (512 + 3 * 256 + 12 * 64) as u64);
        // Wiring errors are the host loop's.
        let bad = STEP.replace("input feat 0 1,4", "input feat 0 1,5");
        let e = build(engine(PREFIX, &dev, &o), engine(&bad, &dev, &o), &p)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("does not match step-graph input 'feat'"), "{e}");
    }
}
