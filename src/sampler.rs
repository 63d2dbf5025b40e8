//! How does noise become an action chunk? The samplers of the policies people deploy, as
//! plain arithmetic over fixed buffers: openpi's flow matching (Euler steps from t = 1 to 0),
//! and diffusers' DDPM and DDIM schedulers as LeRobot's Diffusion Policy uses them. The
//! pipeline (`engine::pipeline`) runs the networks; this module says which time each step
//! feeds them and how the sample moves. Noise comes from ChaCha8 (rand's `ChaCha8Rng`, from
//! the `chacha20` crate) through rand_distr's `StandardNormal`: a seed fixes every draw.

use rand::SeedableRng;
use rand::rngs::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

/// Which update the loop applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// openpi `sample_actions`: `x += dt·v`, `t += dt`, from `t = 1`, `dt = -1/steps`.
    Flow,
    /// diffusers `DDPMScheduler` (ancestral: fresh noise each step but the last).
    Ddpm,
    /// diffusers `DDIMScheduler` (`eta` = 0: deterministic).
    Ddim,
}

/// diffusers' `beta_schedule`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Betas {
    Linear,
    ScaledLinear,
    /// `betas_for_alpha_bar` with the cosine `alpha_bar` (Nichol & Dhariwal), capped at 0.999.
    SquaredCosCapV2,
}

/// diffusers' `prediction_type`: what the denoiser outputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prediction {
    Epsilon,
    Sample,
    VPrediction,
}

/// A diffusion scheduler's settings (diffusers' names and defaults).
#[derive(Clone, Debug, PartialEq)]
pub struct Diffusion {
    pub train_timesteps: usize,
    pub betas: Betas,
    pub beta_start: f64,
    pub beta_end: f64,
    pub prediction: Prediction,
    /// `clip_sample_range` when `clip_sample` is on.
    pub clip: Option<f32>,
    /// DDIM's `eta` (0: deterministic).
    pub eta: f32,
}

/// A sampler: its kind and, for DDPM/DDIM, the cumulative alphas over the training
/// timesteps (computed once; every step reads two of them).
#[derive(Clone, Debug)]
pub struct Sampler {
    pub kind: Kind,
    pub diffusion: Option<Diffusion>,
    alphas_cumprod: Vec<f32>,
    /// Flow only.
    pub flow_time: FlowTime,
}

/// How flow's step times are computed: both start at 1 and step by `dt = -1/steps`, and
/// differ in rounding (by an ulp or so of float32), which the denoiser's output carries on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FlowTime {
    /// openpi's loop: `t += dt` accumulated in float32.
    #[default]
    Openpi,
    /// LeRobot's `euler_integrate`: `1.0 + i·dt` in float64 (Python floats), then float32.
    Lerobot,
    /// GR00T N1.7's loop: time runs upward from noise (0) to data, the denoiser is fed the
    /// integer bucket `int(i/N · 1000)` computed in float64 as Python does (from float32 time
    /// it is off by one for 15 step counts up to 32, 5 and 10 among them), and the update is
    /// `x += (1/N)·v`.
    Groot,
}

/// The time fed to the denoiser for one step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Time {
    /// Flow: continuous time in (0, 1].
    Continuous(f32),
    /// DDPM/DDIM: an integer training timestep.
    Discrete(i64),
}

impl Time {
    /// As a number, for writing into the time tensor's own type.
    pub fn value(self) -> f64 {
        match self {
            Time::Continuous(t) => f64::from(t),
            Time::Discrete(t) => t as f64,
        }
    }
}

impl Sampler {
    pub fn flow() -> Sampler {
        Sampler {
            kind: Kind::Flow,
            diffusion: None,
            alphas_cumprod: Vec::new(),
            flow_time: FlowTime::Openpi,
        }
    }

    /// A DDPM or DDIM sampler, its alphas computed as diffusers does (in float32, as torch).
    pub fn diffusion(kind: Kind, d: Diffusion) -> Sampler {
        let t = d.train_timesteps;
        let betas: Vec<f32> = match d.betas {
            Betas::Linear => linspace(d.beta_start, d.beta_end, t)
                .map(|b| b as f32)
                .collect(),
            Betas::ScaledLinear => linspace(d.beta_start.sqrt(), d.beta_end.sqrt(), t)
                .map(|b| (b as f32) * (b as f32))
                .collect(),
            Betas::SquaredCosCapV2 => {
                let alpha_bar = |x: f64| {
                    ((x + 0.008) / 1.008 * std::f64::consts::FRAC_PI_2)
                        .cos()
                        .powi(2)
                };
                (0..t)
                    .map(|i| {
                        let (t1, t2) = (i as f64 / t as f64, (i + 1) as f64 / t as f64);
                        (1.0 - alpha_bar(t2) / alpha_bar(t1)).min(0.999) as f32
                    })
                    .collect()
            }
        };
        let mut acc = 1.0f32;
        let alphas_cumprod = betas
            .iter()
            .map(|b| {
                acc *= 1.0 - b;
                acc
            })
            .collect();
        Sampler {
            kind,
            diffusion: Some(d),
            alphas_cumprod,
            flow_time: FlowTime::Openpi,
        }
    }

    /// The cumulative alphas (for the reference tests and `check-config`).
    pub fn alphas_cumprod(&self) -> &[f32] {
        &self.alphas_cumprod
    }

    /// The time step `i` of `steps` feeds the denoiser.
    pub fn time(&self, i: usize, steps: usize) -> Time {
        match self.kind {
            // openpi accumulates t += dt in float32; LeRobot computes 1 + i·dt in float64.
            Kind::Flow => Time::Continuous(match self.flow_time {
                FlowTime::Openpi => {
                    let dt = -1.0f32 / steps as f32;
                    (0..i).fold(1.0f32, |t, _| t + dt)
                }
                FlowTime::Lerobot => (1.0 + i as f64 * (-1.0 / steps as f64)) as f32,
                FlowTime::Groot => return Time::Discrete(groot_bucket(i, steps)),
            }),
            Kind::Ddpm | Kind::Ddim => Time::Discrete(self.timestep(i, steps) as i64),
        }
    }

    /// The times of every step of `steps`, in order: [`Sampler::time`] of 0, 1, …, with flow's
    /// float32 accumulation carried from step to step rather than redone for each.
    pub fn times(&self, steps: usize) -> impl Iterator<Item = Time> + '_ {
        let dt = -1.0f32 / steps as f32;
        let mut t = 1.0f32;
        (0..steps).map(move |i| match self.kind {
            Kind::Flow if self.flow_time != FlowTime::Openpi => self.time(i, steps),
            Kind::Flow => {
                let now = t;
                t += dt;
                Time::Continuous(now)
            }
            Kind::Ddpm | Kind::Ddim => Time::Discrete(self.timestep(i, steps) as i64),
        })
    }

    /// Flow's Euler step: downward from noise at t = 1 (openpi, LeRobot); upward from 0 for
    /// GR00T, whose `1.0 / N` is a Python float that torch applies in float32.
    fn flow_dt(&self, steps: usize) -> f32 {
        match self.flow_time {
            FlowTime::Groot => (1.0 / steps as f64) as f32,
            FlowTime::Openpi | FlowTime::Lerobot => -1.0f32 / steps as f32,
        }
    }

    /// `update = "model"`'s `dt` input: openpi's `-1/steps`.
    ///
    /// GR00T's time is upward, but its step graph never takes `dt` (policyd integrates).
    pub fn dt(&self, steps: usize) -> f64 {
        f64::from(-1.0f32 / steps as f32)
    }

    /// diffusers' `set_timesteps` with `timestep_spacing = "leading"`: step `i` of `steps`
    /// is `(steps - 1 - i) · (T / steps)`.
    fn timestep(&self, i: usize, steps: usize) -> usize {
        let ratio = self.alphas_cumprod.len() / steps.max(1);
        (steps - 1 - i) * ratio
    }

    /// Moves `x` one step, given the denoiser's output for it. `noise` draws the fresh
    /// Gaussian noise DDPM (and DDIM with `eta` > 0) adds.
    pub fn step(
        &self,
        i: usize,
        steps: usize,
        x: &mut [f32],
        out: &[f32],
        mut noise: impl FnMut() -> f32,
    ) {
        match self.kind {
            Kind::Flow => {
                let dt = self.flow_dt(steps);
                for (x, v) in x.iter_mut().zip(out) {
                    *x += dt * v;
                }
            }
            Kind::Ddpm | Kind::Ddim => {
                let Some(d) = &self.diffusion else { return };
                let (t, a_t, a_prev) = self.alphas(i, steps);
                let b_t = 1.0 - a_t;
                let (sa, sb) = (a_t.sqrt(), b_t.sqrt());
                if self.kind == Kind::Ddpm {
                    let cur_alpha = a_t / a_prev;
                    let cur_beta = 1.0 - cur_alpha;
                    let c0 = a_prev.sqrt() * cur_beta / b_t;
                    let cs = cur_alpha.sqrt() * (1.0 - a_prev) / b_t;
                    // `fixed_small` variance, clamped at 1e-20; none at t = 0.
                    let std = (t > 0).then(|| ((1.0 - a_prev) / b_t * cur_beta).max(1e-20).sqrt());
                    for (x, &m) in x.iter_mut().zip(out) {
                        let x0 = clip(d, predict(d.prediction, *x, m, sa, sb).0);
                        let mut next = c0 * x0 + cs * *x;
                        if let Some(s) = std {
                            next += s * noise();
                        }
                        *x = next;
                    }
                } else {
                    let b_prev = 1.0 - a_prev;
                    let variance = b_prev / b_t * (1.0 - a_t / a_prev);
                    let std = d.eta * variance.sqrt();
                    let dir = (1.0 - a_prev - std * std).max(0.0).sqrt();
                    for (x, &m) in x.iter_mut().zip(out) {
                        let (x0, eps) = predict(d.prediction, *x, m, sa, sb);
                        let x0 = clip(d, x0);
                        let mut next = a_prev.sqrt() * x0 + dir * eps;
                        if d.eta > 0.0 {
                            next += std * noise();
                        }
                        *x = next;
                    }
                }
            }
        }
    }

    /// Step `i` of `steps`: its training timestep t, ᾱ_t and ᾱ_prev (1 before the first
    /// timestep: DDPM's `one`; DDIM's `final_alpha_cumprod` with `set_alpha_to_one`).
    fn alphas(&self, i: usize, steps: usize) -> (usize, f32, f32) {
        let t = self.timestep(i, steps);
        let prev = t as i64 - (self.alphas_cumprod.len() / steps.max(1)) as i64;
        let a_prev = if prev >= 0 {
            self.alphas_cumprod[prev as usize]
        } else {
            1.0
        };
        (t, self.alphas_cumprod[t], a_prev)
    }

    /// Step `i` of `steps` as the device kernel applies it ([`Update`]): the same update as
    /// [`Sampler::step`], its per-step constants folded into ten coefficients.
    pub fn update(&self, i: usize, steps: usize) -> Update {
        let mut u = Update {
            p1: 0.0,
            p2: 0.0,
            e1: 0.0,
            e2: 1.0,
            a: 0.0,
            b: 1.0,
            c: 0.0,
            s: 0.0,
            lo: f32::MIN,
            hi: f32::MAX,
        };
        let Some(d) = self.diffusion.as_ref().filter(|_| self.kind != Kind::Flow) else {
            u.c = self.flow_dt(steps);
            return u;
        };
        let (t, a_t, a_prev) = self.alphas(i, steps);
        let b_t = 1.0 - a_t;
        let (sa, sb) = (a_t.sqrt(), b_t.sqrt());
        (u.p1, u.p2, u.e1, u.e2) = match d.prediction {
            Prediction::Epsilon => (1.0 / sa, -sb / sa, 0.0, 1.0),
            Prediction::Sample => (0.0, 1.0, 1.0 / sb, -sa / sb),
            Prediction::VPrediction => (sa, -sb, sb, sa),
        };
        if let Some(r) = d.clip {
            (u.lo, u.hi) = (-r, r);
        }
        if self.kind == Kind::Ddpm {
            let cur_alpha = a_t / a_prev;
            let cur_beta = 1.0 - cur_alpha;
            u.a = a_prev.sqrt() * cur_beta / b_t;
            u.b = cur_alpha.sqrt() * (1.0 - a_prev) / b_t;
            u.c = 0.0;
            if t > 0 {
                u.s = ((1.0 - a_prev) / b_t * cur_beta).max(1e-20).sqrt();
            }
        } else {
            let variance = (1.0 - a_prev) / b_t * (1.0 - a_t / a_prev);
            let std = d.eta * variance.sqrt();
            u.a = a_prev.sqrt();
            u.b = 0.0;
            u.c = (1.0 - a_prev - std * std).max(0.0).sqrt();
            if d.eta > 0.0 {
                u.s = std;
            }
        }
        u
    }

    /// Whether step `i` of `steps` draws fresh noise (one value per element, in order), as
    /// [`Sampler::step`] does: DDPM on every step but t = 0, DDIM when `eta` > 0.
    pub fn draws_noise(&self, i: usize, steps: usize) -> bool {
        match (self.kind, &self.diffusion) {
            (Kind::Ddpm, Some(_)) => self.timestep(i, steps) > 0,
            (Kind::Ddim, Some(d)) => d.eta > 0.0,
            _ => false,
        }
    }
}

/// One step's update as ten coefficients: the form policyd's device kernel applies
/// (`src/engine/tensorrt/update.ptx`), so that a TensorRT pipeline keeps its sample on the
/// GPU. With the sample x, the model's output m and the step's fresh noise z:
///
/// ```text
/// x0 = min(max(p1·x + p2·m, lo), hi)   (diffusers' predicted sample, clipped)
/// e  = e1·x + e2·m                      (its predicted noise)
/// x' = a·x0 + b·x + c·e + s·z
/// ```
///
/// Flow is `b = 1, c = dt, e2 = 1`; DDPM and DDIM fold diffusers' per-step constants into
/// `p`, `e`, `a`, `b`, `c` and the standard deviation `s`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Update {
    pub p1: f32,
    pub p2: f32,
    pub e1: f32,
    pub e2: f32,
    pub a: f32,
    pub b: f32,
    pub c: f32,
    pub s: f32,
    pub lo: f32,
    pub hi: f32,
}

impl Update {
    /// Its size in device memory: ten float32s, in field order.
    pub const BYTES: usize = 40;

    /// `update = "model"`: the step graph's output is the next sample (`x' = m`, exactly).
    pub fn take_output() -> Update {
        Update {
            p1: 0.0,
            p2: 0.0,
            e1: 0.0,
            e2: 1.0,
            a: 0.0,
            b: 0.0,
            c: 1.0,
            s: 0.0,
            lo: f32::MIN,
            hi: f32::MAX,
        }
    }

    /// The update of one element, rounded exactly as the kernel rounds it (every product and
    /// sum separately, in this order; `max`/`min` pass a NaN's other operand, as PTX's do).
    pub fn apply(&self, x: f32, m: f32, z: f32) -> f32 {
        let x0 = (self.p1 * x + self.p2 * m).max(self.lo).min(self.hi);
        let e = self.e1 * x + self.e2 * m;
        let next = self.a * x0 + self.b * x + self.c * e;
        if self.s != 0.0 {
            next + self.s * z
        } else {
            next
        }
    }

    /// Writes the ten coefficients, little-endian (the kernel's layout), into `out[..40]`.
    pub fn write(&self, out: &mut [u8]) {
        let v = [
            self.p1, self.p2, self.e1, self.e2, self.a, self.b, self.c, self.s, self.lo, self.hi,
        ];
        for (c, v) in out.chunks_exact_mut(4).zip(v) {
            c.copy_from_slice(&v.to_le_bytes());
        }
    }

    /// Reads what [`Update::write`] wrote.
    pub fn read(b: &[u8]) -> Update {
        let f = |i: usize| f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]);
        Update {
            p1: f(0),
            p2: f(1),
            e1: f(2),
            e2: f(3),
            a: f(4),
            b: f(5),
            c: f(6),
            s: f(7),
            lo: f(8),
            hi: f(9),
        }
    }
}

/// diffusers' predicted original sample and noise from the model's output `m`, with
/// `sa` = √ᾱ_t and `sb` = √(1 − ᾱ_t).
fn predict(p: Prediction, x: f32, m: f32, sa: f32, sb: f32) -> (f32, f32) {
    match p {
        Prediction::Epsilon => ((x - sb * m) / sa, m),
        Prediction::Sample => (m, (x - sa * m) / sb),
        Prediction::VPrediction => (sa * x - sb * m, sa * m + sb * x),
    }
}

fn clip(d: &Diffusion, x0: f32) -> f32 {
    d.clip.map_or(x0, |r| x0.clamp(-r, r))
}

/// numpy's / torch's `linspace` over `n` points.
fn linspace(a: f64, b: f64, n: usize) -> impl Iterator<Item = f64> {
    let step = if n > 1 { (b - a) / (n - 1) as f64 } else { 0.0 };
    (0..n).map(move |i| {
        if i + 1 == n && n > 1 {
            b
        } else {
            a + step * i as f64
        }
    })
}

/// Gaussian noise from a seed: the initial sample and every fresh draw of a request.
pub struct Noise(ChaCha8Rng);

impl Noise {
    pub fn new(seed: u64) -> Noise {
        Noise(ChaCha8Rng::seed_from_u64(seed))
    }

    pub fn draw(&mut self) -> f32 {
        StandardNormal.sample(&mut self.0)
    }

    pub fn fill(&mut self, out: &mut [f32]) {
        for v in out {
            *v = self.draw();
        }
    }
}

/// A seed for a request that gave none, from a session's own stream (itself seeded from the
/// OS when the session starts).
pub struct SeedStream(ChaCha8Rng);

impl SeedStream {
    pub fn from_os() -> SeedStream {
        let rng = ChaCha8Rng::try_from_rng(&mut rand::rngs::SysRng).unwrap_or_else(|_| {
            // No OS entropy (never seen on Linux): still a stream of the session's own.
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            ChaCha8Rng::seed_from_u64(t)
        });
        SeedStream(rng)
    }

    pub fn next_seed(&mut self) -> u64 {
        rand::Rng::next_u64(&mut self.0)
    }
}

impl std::fmt::Debug for SeedStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SeedStream")
    }
}

/// GR00T's time bucket for step `i` of `steps`: `int(i / steps * 1000)`, the division and the
/// product in float64 and truncated, exactly as Python computes it.
pub fn groot_bucket(i: usize, steps: usize) -> i64 {
    (i as f64 / steps.max(1) as f64 * 1000.0) as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lerobot(kind: Kind) -> Sampler {
        Sampler::diffusion(
            kind,
            Diffusion {
                train_timesteps: 100,
                betas: Betas::SquaredCosCapV2,
                beta_start: 0.0001,
                beta_end: 0.02,
                prediction: Prediction::Epsilon,
                clip: Some(1.0),
                eta: 0.0,
            },
        )
    }

    #[test]
    fn flow_times_run_from_one_towards_zero() {
        let s = Sampler::flow();
        assert_eq!(s.time(0, 10), Time::Continuous(1.0));
        let Time::Continuous(last) = s.time(9, 10) else {
            panic!()
        };
        assert!((last - 0.1).abs() < 1e-6, "{last}");
        let mut x = [1.0f32, 2.0];
        s.step(0, 10, &mut x, &[10.0, -10.0], || 0.0);
        assert_eq!(x, [0.0, 3.0]);
    }

    #[test]
    fn lerobot_flow_times_are_computed_not_accumulated() {
        let mut s = Sampler::flow();
        s.flow_time = FlowTime::Lerobot;
        for steps in [3, 7, 10] {
            let times: Vec<Time> = s.times(steps).collect();
            for (i, t) in times.iter().enumerate() {
                // LeRobot: torch.tensor(1.0 + i * (-1.0 / steps), dtype=torch.float32).
                let want = (1.0f64 + i as f64 * (-1.0 / steps as f64)) as f32;
                assert_eq!(*t, Time::Continuous(want), "{steps} steps, step {i}");
            }
        }
        // openpi's accumulation rounds differently somewhere in 10 steps.
        let openpi: Vec<Time> = Sampler::flow().times(10).collect();
        let lerobot: Vec<Time> = s.times(10).collect();
        assert_ne!(openpi, lerobot);
    }

    #[test]
    fn groot_buckets_are_pythons_and_time_runs_upward() {
        let mut s = Sampler::flow();
        s.flow_time = FlowTime::Groot;
        // Python (GR00T N1.7's loop): [int(i / N * 1000) for i in range(N)].
        for (n, want) in [
            (4, vec![0, 250, 500, 750]),
            (5, vec![0, 200, 400, 600, 800]),
            (10, vec![0, 100, 200, 300, 400, 500, 600, 700, 800, 900]),
        ] {
            let got: Vec<Time> = s.times(n).collect();
            let want: Vec<Time> = want.into_iter().map(Time::Discrete).collect();
            assert_eq!(got, want, "{n} steps");
        }
        // The bucket taken from LeRobot's float32 flow time instead, floor((1 − t)·1000), is
        // off by one for N = 5 and 10: why GR00T has a time mode of its own.
        let from_f32 = |i: usize, n: usize| {
            let t = (1.0 + i as f64 * (-1.0 / n as f64)) as f32;
            ((1.0f32 - t) * 1000.0).floor() as i64
        };
        assert_eq!((from_f32(1, 5), groot_bucket(1, 5)), (199, 200));
        assert_eq!((from_f32(2, 10), groot_bucket(2, 10)), (199, 200));
        // Upward Euler: x += (1/N)·v, the step in float32 as torch applies a Python float.
        let mut x = [0.0f32, 1.0];
        let mut want = [0.0f32, 1.0];
        for i in 0..5 {
            s.step(i, 5, &mut x, &[1.0, -3.0], || 0.0);
            want[0] += 0.2f32 * 1.0;
            want[1] += 0.2f32 * -3.0;
        }
        assert_eq!(x, want);
        assert!(x[0] > 0.99 && x[1] < -1.99, "{x:?}");
    }

    #[test]
    fn times_are_every_steps_time() {
        for s in [Sampler::flow(), lerobot(Kind::Ddim)] {
            for steps in [1, 3, 10, 100] {
                let each: Vec<Time> = (0..steps).map(|i| s.time(i, steps)).collect();
                assert_eq!(s.times(steps).collect::<Vec<_>>(), each);
            }
        }
    }

    #[test]
    fn diffusion_timesteps_are_diffusers_leading_spacing() {
        let s = lerobot(Kind::Ddim);
        let ts: Vec<Time> = (0..10).map(|i| s.time(i, 10)).collect();
        let want: Vec<Time> = [90, 80, 70, 60, 50, 40, 30, 20, 10, 0]
            .map(Time::Discrete)
            .to_vec();
        assert_eq!(ts, want);
        assert_eq!(s.time(0, 100), Time::Discrete(99));
        assert_eq!(s.time(0, 3), Time::Discrete(66));
    }

    fn close(a: f32, b: f64) -> bool {
        (f64::from(a) - b).abs() <= 1e-5 * b.abs().max(1e-3)
    }

    /// Values computed independently with numpy from diffusers' definitions (float32, as
    /// torch): `betas_for_alpha_bar` with the cosine, `linspace`, `linspace` of square roots
    /// squared, then `cumprod(1 - betas)`.
    #[test]
    fn alphas_match_diffusers_definitions() {
        let d = |betas, t, start, end| {
            Sampler::diffusion(
                Kind::Ddim,
                Diffusion {
                    train_timesteps: t,
                    betas,
                    beta_start: start,
                    beta_end: end,
                    prediction: Prediction::Epsilon,
                    clip: None,
                    eta: 0.0,
                },
            )
        };
        let cases: [(Sampler, &[(usize, f64)]); 3] = [
            (
                d(Betas::SquaredCosCapV2, 100, 0.0001, 0.02),
                &[
                    (0, 0.9993687272071838),
                    (9, 0.9720926284790039),
                    (50, 0.4782644212245941),
                    (98, 0.00024285716062877327),
                    (99, 2.428540426535619e-07),
                ],
            ),
            (
                d(Betas::Linear, 1000, 0.0001, 0.02),
                &[
                    (0, 0.9998999834060669),
                    (1, 0.9997800588607788),
                    (499, 0.07858724147081375),
                    (999, 4.035832535009831e-05),
                ],
            ),
            (
                d(Betas::ScaledLinear, 1000, 0.00085, 0.012),
                &[
                    (0, 0.9991499781608582),
                    (1, 0.9982960224151611),
                    (499, 0.2776695191860199),
                    (999, 0.004660089500248432),
                ],
            ),
        ];
        for (s, want) in cases {
            for &(i, v) in want {
                let got = s.alphas_cumprod()[i];
                assert!(
                    close(got, v),
                    "{:?} alphas_cumprod[{i}] = {got}, want {v}",
                    s.diffusion
                );
            }
        }
    }

    /// One step from x = 0.5 with the prediction 0.2 (and x = 3 with -0.1, clipped), no fresh
    /// noise, against numpy's diffusers formulas (DDPM's posterior mean; DDIM with eta 0).
    #[test]
    fn steps_match_diffusers_formulas() {
        for (kind, want, clipped) in [
            (
                Kind::Ddpm,
                [0.45282354950904846, 0.4863877296447754, 0.495131254196167],
                1.570438027381897,
            ),
            (
                Kind::Ddim,
                [0.48309415578842163, 0.5140636563301086, 0.495131254196167],
                0.19615018367767334,
            ),
        ] {
            let s = lerobot(kind);
            for (i, w) in [0, 5, 9].into_iter().zip(want) {
                let mut x = [0.5f32];
                s.step(i, 10, &mut x, &[0.2], || 0.0);
                assert!(close(x[0], w), "{kind:?} step {i}: {} vs {w}", x[0]);
            }
            let mut x = [3.0f32];
            s.step(0, 10, &mut x, &[-0.1], || 0.0);
            assert!(
                close(x[0], clipped),
                "{kind:?} clipped: {} vs {clipped}",
                x[0]
            );
        }
        // DDPM adds noise on every step but the last (t = 0).
        let s = lerobot(Kind::Ddpm);
        let (mut a, mut b) = ([0.5f32], [0.5f32]);
        s.step(0, 10, &mut a, &[0.2], || 0.0);
        s.step(0, 10, &mut b, &[0.2], || 1.0);
        assert!(b[0] > a[0]);
        let (mut a, mut b) = ([0.5f32], [0.5f32]);
        s.step(9, 10, &mut a, &[0.2], || 0.0);
        s.step(9, 10, &mut b, &[0.2], || 1.0);
        assert_eq!(a, b);
    }

    /// The kernel's form of every sampler gives what `step` gives: flow to the bit, DDPM and
    /// DDIM (every prediction type, clipped or not, with and without noise) to float rounding.
    #[test]
    fn the_kernel_form_is_the_same_update() {
        let mut groot = Sampler::flow();
        groot.flow_time = FlowTime::Groot;
        let mut samplers = vec![Sampler::flow(), groot];
        for kind in [Kind::Ddpm, Kind::Ddim] {
            for prediction in [
                Prediction::Epsilon,
                Prediction::Sample,
                Prediction::VPrediction,
            ] {
                for (clip, eta) in [(Some(1.0), 0.0), (None, 0.0), (Some(1.5), 0.7)] {
                    samplers.push(Sampler::diffusion(
                        kind,
                        Diffusion {
                            train_timesteps: 100,
                            betas: Betas::SquaredCosCapV2,
                            beta_start: 0.0001,
                            beta_end: 0.02,
                            prediction,
                            clip,
                            eta,
                        },
                    ));
                }
            }
        }
        let xs = [-3.0f32, -0.7, 0.0, 0.25, 0.5, 1.2, 2.9];
        let ms = [-1.1f32, -0.1, 0.2, 0.6, 0.05, 1.7, -2.2];
        for s in &samplers {
            for steps in [1, 3, 10, 100] {
                for i in 0..steps {
                    let u = s.update(i, steps);
                    let mut bytes = [0u8; Update::BYTES];
                    u.write(&mut bytes);
                    assert_eq!(Update::read(&bytes), u);
                    let mut x = xs;
                    let mut z = 0.3f32;
                    s.step(i, steps, &mut x, &ms, || {
                        z += 0.1;
                        z
                    });
                    // Noise is read only on steps that draw it.
                    assert!(u.s == 0.0 || s.draws_noise(i, steps));
                    let mut z = 0.3f32;
                    for k in 0..xs.len() {
                        let noise = if s.draws_noise(i, steps) {
                            z += 0.1;
                            z
                        } else {
                            0.0
                        };
                        let got = u.apply(xs[k], ms[k], noise);
                        if s.kind == Kind::Flow {
                            assert_eq!(got, x[k], "flow step {i} of {steps}");
                        } else {
                            assert!(
                                (got - x[k]).abs() <= 2e-5 * x[k].abs().max(1.0),
                                "{:?} {:?} step {i} of {steps} [{k}]: {got} vs {}",
                                s.kind,
                                s.diffusion,
                                x[k]
                            );
                        }
                    }
                }
            }
        }
        // Noise is drawn where `step` draws it: DDPM all but the last step, DDIM with eta.
        let ddpm = lerobot(Kind::Ddpm);
        assert!(ddpm.draws_noise(0, 10) && !ddpm.draws_noise(9, 10));
        assert!(!lerobot(Kind::Ddim).draws_noise(0, 10));
        assert!(!Sampler::flow().draws_noise(0, 10));
    }

    #[test]
    fn the_same_seed_draws_the_same_noise() {
        let (mut a, mut b, mut c) = (Noise::new(7), Noise::new(7), Noise::new(8));
        let (mut x, mut y, mut z) = ([0f32; 64], [0f32; 64], [0f32; 64]);
        a.fill(&mut x);
        b.fill(&mut y);
        c.fill(&mut z);
        assert_eq!(x, y);
        assert_ne!(x, z);
        let mean = x.iter().sum::<f32>() / 64.0;
        assert!(mean.abs() < 0.5, "{mean}");
    }
}
