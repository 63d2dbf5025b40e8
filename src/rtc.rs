//! How does a new action chunk continue the one the robot is executing? Real-time chunking
//! (RTC; Black, Galliker, Levine 2025), as LeRobot 0.6.1 computes it, as pure functions over
//! caller-owned buffers: the prefix weights over the chunk, the guidance weight at a flow time,
//! the guided velocity of one denoising step, the previous chunk's leftover aligned with the
//! new chunk, and GR00T N1.7's native inpainting (the leftover as the first rows of the noise,
//! each row's velocity scaled by a ramp). Nothing here allocates: the sampler loop calls it
//! once per step with the slot's buffers.
//!
//! LeRobot computes the velocity before `x_t` requires grad, so its autograd "correction" is
//! the weighted error itself: `v − g(τ)·W ⊙ (prev − (x_t − time·v))`. No backward pass is
//! needed, only this per-step update beside the Euler step.

/// `prefix_attention_schedule`: how the leftover's weight falls from the rows the robot will
/// execute during inference (`inference_delay`, weight 1) to `execution_horizon` (weight 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// 1 on the delayed rows, 0 after them.
    Zeros,
    /// 1 up to the execution horizon.
    Ones,
    /// 1 on the delayed rows, then linearly down to the horizon (LeRobot's default).
    Linear,
    /// As `Linear`, bent by `w·expm1(w)/(e − 1)`.
    Exp,
}

impl Schedule {
    /// The config's names (LeRobot's `RTCAttentionSchedule` values, lower case).
    pub const NAMES: [(&'static str, Schedule); 4] = [
        ("zeros", Schedule::Zeros),
        ("ones", Schedule::Ones),
        ("linear", Schedule::Linear),
        ("exp", Schedule::Exp),
    ];

    pub fn parse(name: &str) -> Option<Schedule> {
        Self::NAMES
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|&(_, s)| s)
    }
}

/// LeRobot's `get_prefix_weights(start, end, total)` into `out` (`total = out.len()` rows):
/// `start` is the inference delay in rows, `end` the execution horizon.
pub fn prefix_weights(schedule: Schedule, start: usize, end: usize, out: &mut [f32]) {
    let total = out.len();
    let start = start.min(end);
    match schedule {
        Schedule::Zeros => {
            for (i, w) in out.iter_mut().enumerate() {
                *w = if i < start { 1.0 } else { 0.0 };
            }
        }
        Schedule::Ones => {
            for (i, w) in out.iter_mut().enumerate() {
                *w = if i < end { 1.0 } else { 0.0 };
            }
        }
        Schedule::Linear | Schedule::Exp => {
            // Leading ones over the delay, then `linspace(1, 0, n + 2)[1:-1]` over the rows up
            // to the horizon, then zeros (LeRobot builds the three parts and concatenates them).
            let n = total.min(end).saturating_sub(start);
            let ones = start.min(total);
            for (i, w) in out.iter_mut().enumerate() {
                *w = if i < ones {
                    1.0
                } else if i < ones + n {
                    let k = (i - ones + 1) as f64;
                    let lin = (1.0 - k / (n + 1) as f64) as f32;
                    match schedule {
                        Schedule::Exp => lin * lin.exp_m1() / (std::f32::consts::E - 1.0),
                        _ => lin,
                    }
                } else {
                    0.0
                };
            }
        }
    }
}

/// The guidance weight at flow time `time` (LeRobot's time: 1 is pure noise, 0 the action):
/// `min(c·((1−τ)² + τ²)/(1−τ)², max)` with `τ = 1 − time`, `c = (1−τ)/τ`, where +∞ becomes
/// `max` and NaN 0, as `torch.nan_to_num` maps them.
pub fn guidance_weight(time: f32, max: f32) -> f32 {
    let tau = 1.0 - time;
    let one_minus = 1.0 - tau;
    let inv_r2 = (one_minus * one_minus + tau * tau) / (one_minus * one_minus);
    let c = nan_to_num(one_minus / tau, max);
    nan_to_num(c * inv_r2, max).min(max)
}

/// `torch.nan_to_num(x, posinf=max)`: NaN → 0, +∞ → `max`, −∞ → the lowest finite value.
fn nan_to_num(x: f32, max: f32) -> f32 {
    if x.is_nan() {
        0.0
    } else if x == f32::INFINITY {
        max
    } else if x == f32::NEG_INFINITY {
        f32::MIN
    } else {
        x
    }
}

/// One guided velocity, in place: `v ← v − g·w_r·(prev − (x − time·v))` on each row `r` of
/// `width` values. `weights` has one value per row; `prev` is the leftover padded to the chunk.
pub fn guide(
    v: &mut [f32],
    x: &[f32],
    prev: &[f32],
    weights: &[f32],
    width: usize,
    time: f32,
    g: f32,
) {
    for (r, &w) in weights.iter().enumerate() {
        if w == 0.0 {
            continue;
        }
        let row = r * width..(r + 1) * width;
        let term = StepTerm::Guide { g, time };
        for ((v, &x), &p) in v[row.clone()]
            .iter_mut()
            .zip(&x[row.clone()])
            .zip(&prev[row])
        {
            *v = term.apply(*v, x, p, w);
        }
    }
}

/// The previous chunk's leftover, aligned with the new chunk, into `out` (the new chunk's rows
/// × `width`, zero-padded): the rows of `prev` (`prev.len() / width` rows, its first action at
/// the timestep the chunk started) from `offset` on (the new chunk's first timestep less the
/// previous chunk's), at most `horizon` of them (LeRobot's rollout cuts the leftover to the
/// execution horizon and pads it with zero rows). Returns how many rows came from `prev`: 0
/// when the robot is past the previous chunk's end (then no RTC).
pub fn leftover(
    prev: &[f32],
    width: usize,
    offset: usize,
    horizon: usize,
    out: &mut [f32],
) -> usize {
    out.fill(0.0);
    let rows = prev.len() / width.max(1);
    let out_rows = out.len() / width.max(1);
    let n = rows.saturating_sub(offset).min(horizon).min(out_rows);
    if n > 0 {
        out[..n * width].copy_from_slice(&prev[offset * width..(offset + n) * width]);
    }
    n
}

/// GR00T N1.7's native RTC, as LeRobot maps a leftover onto it: how many of the noise's first
/// rows the leftover replaces (`overlap`), and how many of those keep their value (`frozen`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Inpaint {
    pub overlap: usize,
    pub frozen: usize,
}

impl Inpaint {
    /// From a leftover (the rows [`leftover`] wrote, `width` values each, into `prev`): its
    /// trailing all-zero rows are padding and are dropped, `overlap = min(rows,
    /// execution_horizon)`, `frozen = min(inference_delay, overlap)`. `None`: no RTC (nothing
    /// left, or all zeros).
    pub fn new(prev: &[f32], width: usize, horizon: usize, delay: usize) -> Option<Inpaint> {
        let rows = prev
            .chunks_exact(width.max(1))
            .rposition(|r| r.iter().any(|&v| v != 0.0))?
            + 1;
        let overlap = rows.min(horizon);
        (overlap > 0).then_some(Inpaint {
            overlap,
            frozen: delay.min(overlap),
        })
    }

    /// The noise's first `overlap` rows become the leftover's last `overlap` valid rows (the
    /// first ones, once the leftover has been cut to the execution horizon).
    pub fn apply_to_noise(&self, prev: &[f32], width: usize, rows: usize, noise: &mut [f32]) {
        let from = rows.saturating_sub(self.overlap) * width;
        noise[..self.overlap * width].copy_from_slice(&prev[from..from + self.overlap * width]);
    }

    /// Each row's velocity strength into `out` (one per chunk row): 0 on the frozen rows, an
    /// exponential ramp `1 − e^(−k·t)` normalised to end at 1 on the rows after them up to the
    /// overlap (`t` evenly spaced in (0, 1), ends excluded), 1 after.
    pub fn strengths(&self, ramp_rate: f32, out: &mut [f32]) {
        let between = self.overlap - self.frozen;
        let last = 1.0 - (-ramp_rate).exp();
        let last = last.max(1e-8);
        for (i, s) in out.iter_mut().enumerate() {
            *s = if i < self.frozen {
                0.0
            } else if i < self.overlap {
                let t = (i - self.frozen + 1) as f32 / (between + 1) as f32;
                (1.0 - (-ramp_rate * t).exp()) / last
            } else {
                1.0
            };
        }
    }
}

/// One step's correction of the model's velocity, in the form the device loop's update
/// kernel reads after the step's sampler coefficients (`update.ptx`, 12 bytes: the kind as a
/// u32 — 0 plain, 1 guide, 2 scale — then `g` and `time` as float32s) and computes per
/// element: what [`guide`] and the strengths compute on the host, in the same order.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum StepTerm {
    Plain,
    /// Guidance towards the leftover with weight `g` at flow time `time`.
    Guide {
        g: f32,
        time: f32,
    },
    /// Each row's velocity times its strength (GR00T).
    Scale,
}

impl StepTerm {
    pub const BYTES: usize = 12;

    pub fn write(&self, out: &mut [u8]) {
        let (kind, g, time) = match *self {
            StepTerm::Plain => (0u32, 0.0f32, 0.0f32),
            StepTerm::Guide { g, time } => (1, g, time),
            StepTerm::Scale => (2, 0.0, 0.0),
        };
        out[..4].copy_from_slice(&kind.to_le_bytes());
        out[4..8].copy_from_slice(&g.to_le_bytes());
        out[8..12].copy_from_slice(&time.to_le_bytes());
    }

    /// Reads what [`StepTerm::write`] wrote; an unknown kind reads as plain (as the kernel
    /// treats it).
    pub fn read(b: &[u8]) -> StepTerm {
        let word = |at: usize| [b[at], b[at + 1], b[at + 2], b[at + 3]];
        match u32::from_le_bytes(word(0)) {
            1 => StepTerm::Guide {
                g: f32::from_le_bytes(word(4)),
                time: f32::from_le_bytes(word(8)),
            },
            2 => StepTerm::Scale,
            _ => StepTerm::Plain,
        }
    }

    /// One element's velocity `v`, with the sample `x`, the leftover `p` and its row's weight
    /// or strength `w`: the kernel's arithmetic, each product and difference rounded apart.
    pub fn apply(&self, v: f32, x: f32, p: f32, w: f32) -> f32 {
        match *self {
            StepTerm::Guide { g, time } if w != 0.0 => v - g * ((p - (x - time * v)) * w),
            StepTerm::Scale if w != 1.0 => v * w,
            _ => v,
        }
    }
}

/// `[rtc]`, resolved: how a policy's sampler continues the previous chunk.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Settings {
    /// Rows of the leftover a new chunk follows (LeRobot's `execution_horizon`).
    pub execution_horizon: usize,
    /// A fixed delay in control steps; `None`: the session's measured one.
    pub inference_delay: Option<usize>,
    pub method: Method,
}

/// Which RTC a family has.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Method {
    /// LeRobot's guidance of the flow families (pi0, pi0.5, SmolVLA; openpi's pi0.5).
    Guidance {
        schedule: Schedule,
        max_guidance_weight: f32,
    },
    /// GR00T N1.7's native inpainting (`rtc_ramp_rate`).
    Inpaint { ramp_rate: f32 },
}

/// One request's RTC: how many leftover rows the slot's buffer holds (at least one) and the
/// inference delay in control steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub rows: usize,
    pub delay: usize,
}

/// A session's previous chunk in model space (rows × width, the padded columns zero, as
/// LeRobot's leftover is padded), and the timestep of its first row. Its buffer is sized once
/// (at the session's first capture) and reused.
#[derive(Clone, Debug, Default)]
pub struct Previous {
    chunk: Vec<f32>,
    rows: usize,
    first: i64,
}

impl Previous {
    /// A buffer for chunks of `len` floats.
    pub fn with_capacity(len: usize) -> Previous {
        Previous {
            chunk: vec![0.0; len],
            rows: 0,
            first: 0,
        }
    }

    /// Forgets the chunk (a reset, `Ready`, a new setup).
    pub fn clear(&mut self) {
        self.rows = 0;
    }

    /// Keeps the first `rows` rows of `x` (the engine's sample, float32 little-endian bytes,
    /// `width` values a row), with the columns from `cols` on zeroed: what the client was
    /// sent, its first row at `first`.
    pub fn capture(&mut self, x: &[u8], width: usize, cols: usize, rows: usize, first: i64) {
        let width = width.max(1);
        let rows = rows.min(x.len() / 4 / width);
        if self.chunk.len() < rows * width {
            self.chunk.resize(x.len() / 4, 0.0);
        }
        for (r, row) in self.chunk[..rows * width]
            .chunks_exact_mut(width)
            .enumerate()
        {
            for (c, v) in row.iter_mut().enumerate() {
                let at = 4 * (r * width + c);
                *v = if c < cols {
                    f32::from_le_bytes([x[at], x[at + 1], x[at + 2], x[at + 3]])
                } else {
                    0.0
                };
            }
        }
        self.rows = rows;
        self.first = first;
    }

    /// The leftover for a new chunk whose first row is at `timestep`, into `out` (see
    /// [`leftover`]): how many rows came from the previous chunk; 0 when there is none, the
    /// robot is past its end, or the timestep is before its start.
    pub fn leftover(&self, timestep: i64, width: usize, horizon: usize, out: &mut [f32]) -> usize {
        let Some(offset) = timestep
            .checked_sub(self.first)
            .and_then(|o| usize::try_from(o).ok())
            .filter(|_| self.rows > 0)
        else {
            out.fill(0.0);
            return 0;
        };
        leftover(
            &self.chunk[..self.rows * width],
            width,
            offset,
            horizon,
            out,
        )
    }
}

/// The sampler loop's side of RTC, owned by a pipeline: the per-row weights (guidance) or
/// velocity strengths (GR00T), sized at start-up, set at each run's start.
#[derive(Debug)]
pub struct Loop {
    pub settings: Settings,
    /// Rows and values per row of the sample.
    pub rows: usize,
    pub width: usize,
    per_row: Vec<f32>,
    /// Whether the current run is guided (its request had a leftover).
    active: bool,
}

impl Loop {
    pub fn new(settings: Settings, rows: usize, width: usize) -> Loop {
        Loop {
            settings,
            rows,
            width,
            per_row: vec![0.0; rows],
            active: false,
        }
    }

    /// A run's start, after the noise is drawn: the weights (guidance) or the strengths, with
    /// the leftover written into the noise's first rows (GR00T). `prev` is the slot's leftover
    /// buffer (the sample's size); `None` or an all-zero leftover: a plain run.
    pub fn start(&mut self, request: Option<Request>, prev: &[f32], x: &mut [f32]) {
        self.active = false;
        let Some(r) = request.filter(|r| r.rows > 0) else {
            return;
        };
        let horizon = self.settings.execution_horizon.min(self.rows);
        match self.settings.method {
            Method::Guidance { schedule, .. } => {
                prefix_weights(schedule, r.delay, horizon, &mut self.per_row);
                self.active = true;
            }
            Method::Inpaint { ramp_rate } => {
                let w = self.width;
                let Some(inpaint) = Inpaint::new(&prev[..horizon * w], w, horizon, r.delay) else {
                    return;
                };
                let valid = inpaint.overlap;
                inpaint.apply_to_noise(&prev[..valid * w], w, valid, x);
                inpaint.strengths(ramp_rate, &mut self.per_row);
                self.active = true;
            }
        }
    }

    /// Each row's guidance weight or velocity strength for the current run.
    pub fn per_row(&self) -> &[f32] {
        &self.per_row
    }

    /// The current run's correction at flow time `time`, as the device loop's update kernel
    /// applies it (with [`Loop::per_row`] and the leftover): [`StepTerm::Plain`] when the run
    /// is not guided.
    pub fn step_term(&self, time: f32) -> StepTerm {
        match (self.active, self.settings.method) {
            (false, _) => StepTerm::Plain,
            (
                true,
                Method::Guidance {
                    max_guidance_weight,
                    ..
                },
            ) => StepTerm::Guide {
                g: guidance_weight(time, max_guidance_weight),
                time,
            },
            (true, Method::Inpaint { .. }) => StepTerm::Scale,
        }
    }

    /// One step's velocity `v` at flow time `time` (LeRobot's: 1 is noise), in place: guided
    /// towards the leftover, or scaled by each row's strength (GR00T).
    pub fn velocity(&self, time: f32, x: &[f32], prev: &[f32], v: &mut [f32]) {
        match self.step_term(time) {
            StepTerm::Plain => {}
            StepTerm::Guide { g, time } => guide(v, x, prev, &self.per_row, self.width, time, g),
            term @ StepTerm::Scale => {
                for (row, &s) in v.chunks_exact_mut(self.width).zip(&self.per_row) {
                    row.iter_mut()
                        .for_each(|v| *v = term.apply(*v, 0.0, 0.0, s));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weights(s: Schedule, start: usize, end: usize, total: usize) -> Vec<f32> {
        let mut out = vec![f32::NAN; total];
        prefix_weights(s, start, end, &mut out);
        out
    }

    fn close(a: &[f32], b: &[f32], tol: f32) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= tol, "[{i}]: {x} vs {y}\n{a:?}\n{b:?}");
        }
    }

    /// Values printed by LeRobot 0.6.1's `RTCProcessor.get_prefix_weights`.
    #[test]
    fn prefix_weights_are_lerobots() {
        use Schedule::*;
        let cases: [(Schedule, usize, usize, usize, &[f32]); 12] = [
            (Zeros, 2, 6, 8, &[1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]),
            (Zeros, 6, 4, 8, &[1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]),
            (Ones, 2, 6, 8, &[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]),
            (Ones, 3, 10, 8, &[1.0; 8]),
            (Ones, 0, 0, 4, &[0.0; 4]),
            (Linear, 2, 6, 8, &[1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.0, 0.0]),
            (
                Linear,
                0,
                5,
                8,
                &[
                    0.8333333, 0.6666666, 0.5, 0.33333334, 0.16666667, 0.0, 0.0, 0.0,
                ],
            ),
            (Linear, 6, 4, 8, &[1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]),
            (
                Linear,
                3,
                10,
                8,
                &[
                    1.0, 1.0, 1.0, 0.8333333, 0.6666666, 0.5, 0.33333334, 0.16666667,
                ],
            ),
            (
                Exp,
                2,
                6,
                8,
                &[
                    1.0, 1.0, 0.570589, 0.28707242, 0.11449222, 0.02577025, 0.0, 0.0,
                ],
            ),
            (
                Exp,
                0,
                5,
                8,
                &[
                    0.630948,
                    0.36770603,
                    0.18877034,
                    0.07674575,
                    0.017591257,
                    0.0,
                    0.0,
                    0.0,
                ],
            ),
            (Exp, 0, 0, 4, &[0.0; 4]),
        ];
        for (s, start, end, total, want) in cases {
            close(&weights(s, start, end, total), want, 1e-6);
        }
    }

    #[test]
    fn the_guidance_weight_is_lerobots_at_both_ends_and_between() {
        // τ = 0 (pure noise): c = +∞ → max; τ = 1 (the action): 0·∞ = NaN → 0.
        assert_eq!(guidance_weight(1.0, 10.0), 10.0);
        assert_eq!(guidance_weight(0.0, 10.0), 0.0);
        // time 0.7: τ = 0.3, c = 0.7/0.3, ((0.7² + 0.3²)/0.7²) → 2.9762, under the cap.
        let g = guidance_weight(0.7, 10.0);
        assert!(
            (g - (0.7 / 0.3) * ((0.49 + 0.09) / 0.49)).abs() < 1e-4,
            "{g}"
        );
        assert_eq!(guidance_weight(0.95, 5.0), 5.0, "capped");
    }

    /// LeRobot's `RTCProcessor.denoise_step` (LINEAR, max 10, execution horizon 5, delay 1) on
    /// a 6×3 chunk with a 4-row leftover, printed at four flow times: the same velocities.
    #[test]
    #[allow(clippy::excessive_precision)] // the values as printed
    fn a_guided_velocity_is_lerobots() {
        let x = [
            -1.1258398, -1.1523602, 0.5666506, 0.7935084, 0.5988395, -1.5550951, -0.3413604,
            1.8530061, 0.4680964, -0.1577124, -0.1733968, 0.1834779, 1.3893661, 1.5863342,
            0.9462984, -0.8436767, 0.9318266, 1.2590092,
        ];
        let v0 = [
            -0.492677, 0.2484148, -0.2303355, -0.3917544, 0.5432947, -0.3951575, 0.2055257,
            -0.4503298, -0.5730771, -0.5553584, -1.5311843, -1.234135, 1.8197253, -0.5515287,
            -1.325326, 0.1885536, -0.0690727, -0.4949253,
        ];
        let prev4 = [
            -2.2187793, 0.2589845, -1.0297022, -0.5007584, 0.2733677, -0.9181, -0.0404211,
            0.2881168, -0.0075373, -0.9144955, -1.0885837, -0.2665963,
        ];
        let want: [(f32, [f32; 18]); 3] = [
            (
                1.0,
                [
                    15.363488, -16.34918, 18.036549, 12.253405, -1.0903778, -2.2089388, -2.3267994,
                    9.625766, 4.670477, 2.724995, 4.584744, 2.9763885, 1.8197253, -0.5515287,
                    -1.325326, 0.1885536, -0.0690727, -0.4949253,
                ],
            ),
            (
                0.7,
                [
                    3.4784267, -4.1298532, 4.6239538, 2.8572705, 0.4297088, -1.1416689, -0.408732,
                    2.1460266, 0.6377249, 0.2356055, -0.1591971, -0.3268709, 1.8197253, -0.5515287,
                    -1.325326, 0.1885536, -0.0690727, -0.4949253,
                ],
            ),
            (
                0.3,
                [
                    2.9341362, -3.8554146, 4.3694887, 2.5326743, 0.8798673, -1.4690851, -0.2952035,
                    1.8972733, 0.3211681, 0.0822209, -0.5820956, -0.6677272, 1.8197253, -0.5515287,
                    -1.325326, 0.1885536, -0.0690727, -0.4949253,
                ],
            ),
        ];
        // LeRobot cuts the horizon to the leftover's rows (4) and pads the leftover to 6.
        let mut prev = [0.0f32; 18];
        let rows = leftover(&prev4, 3, 0, 5, &mut prev);
        assert_eq!(rows, 4);
        let mut w = [0.0f32; 6];
        prefix_weights(Schedule::Linear, 1, rows.min(5), &mut w);
        for (time, want) in want {
            let mut v = v0;
            guide(&mut v, &x, &prev, &w, 3, time, guidance_weight(time, 10.0));
            close(&v, &want, 2e-5);
        }
        // At the action end the guidance weight is 0: the velocity is the model's.
        let mut v = v0;
        guide(&mut v, &x, &prev, &w, 3, 0.0, guidance_weight(0.0, 10.0));
        assert_eq!(v, v0);
    }

    #[test]
    fn the_leftover_starts_at_the_new_chunks_first_timestep() {
        // A 5-row chunk of width 2 started at timestep 10; the new one starts at 12.
        let prev: Vec<f32> = (0..10).map(|v| v as f32).collect();
        let mut out = [f32::NAN; 8];
        assert_eq!(leftover(&prev, 2, 2, 10, &mut out), 3);
        assert_eq!(out, [4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 0.0, 0.0]);
        // Cut to the execution horizon, zero-padded after it.
        assert_eq!(leftover(&prev, 2, 1, 2, &mut out), 2);
        assert_eq!(out, [2.0, 3.0, 4.0, 5.0, 0.0, 0.0, 0.0, 0.0]);
        // Past the previous chunk's end: nothing left.
        assert_eq!(leftover(&prev, 2, 5, 4, &mut out), 0);
        assert_eq!(leftover(&prev, 2, 9, 4, &mut out), 0);
        assert!(out.iter().all(|&v| v == 0.0));
    }

    fn bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// A session keeps the rows it was sent, the model's padded columns zeroed (LeRobot cuts
    /// its chunk to the action dimension, then pads the leftover with zeros), and hands out
    /// the rows from a new observation's timestep on.
    #[test]
    fn a_session_keeps_what_it_was_sent_in_model_space() {
        // A 4-row sample of width 3 whose last column is padding; 3 rows were sent from
        // timestep 20.
        let x: Vec<f32> = (1..=12).map(|v| v as f32).collect();
        let mut p = Previous::with_capacity(12);
        p.capture(&bytes(&x), 3, 2, 3, 20);
        let mut out = [f32::NAN; 12];
        assert_eq!(p.leftover(21, 3, 10, &mut out), 2);
        assert_eq!(
            out,
            [4.0, 5.0, 0.0, 7.0, 8.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
        );
        // The row the robot had not been sent (row 3) is not part of the leftover.
        assert_eq!(p.leftover(23, 3, 10, &mut out), 0);
        // An observation older than the chunk, and a cleared session: no leftover.
        assert_eq!(p.leftover(19, 3, 10, &mut out), 0);
        assert_eq!(p.leftover(20, 3, 1, &mut out), 1);
        p.clear();
        assert_eq!(p.leftover(21, 3, 10, &mut out), 0);
        assert!(out.iter().all(|&v| v == 0.0));
    }

    /// The loop's guidance is [`guide`] with the request's prefix weights, and nothing without
    /// a leftover.
    #[test]
    fn the_loop_guides_only_a_request_with_a_leftover() {
        let settings = Settings {
            execution_horizon: 3,
            inference_delay: None,
            method: Method::Guidance {
                schedule: Schedule::Linear,
                max_guidance_weight: 5.0,
            },
        };
        let mut l = Loop::new(settings, 4, 2);
        let prev = [1.0, 1.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.0];
        let mut x = [0.5f32; 8];
        let v0 = [0.25f32; 8];
        l.start(None, &prev, &mut x);
        let mut v = v0;
        l.velocity(0.6, &x, &prev, &mut v);
        assert_eq!(v, v0, "no leftover: no guidance");
        l.start(Some(Request { rows: 2, delay: 1 }), &prev, &mut x);
        assert_eq!(x, [0.5; 8], "guidance leaves the noise as drawn");
        l.velocity(0.6, &x, &prev, &mut v);
        let mut want = v0;
        let mut w = [0.0; 4];
        prefix_weights(Schedule::Linear, 1, 3, &mut w);
        guide(&mut want, &x, &prev, &w, 2, 0.6, guidance_weight(0.6, 5.0));
        assert_eq!(v, want);
        assert_ne!(v, v0);
        assert_eq!(
            &v[6..],
            &v0[6..],
            "past the horizon the velocity is the model's"
        );
    }

    /// GR00T's loop writes the leftover into the noise's first rows and scales each row's
    /// velocity by its strength.
    #[test]
    fn the_groot_loop_inpaints_the_noise_and_ramps_the_velocity() {
        let settings = Settings {
            execution_horizon: 3,
            inference_delay: Some(1),
            method: Method::Inpaint { ramp_rate: 6.0 },
        };
        let mut l = Loop::new(settings, 4, 2);
        // Two real rows of a horizon of 3 (the third is padding).
        let prev = [1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 0.0];
        let mut x = [9.0f32; 8];
        l.start(Some(Request { rows: 2, delay: 1 }), &prev, &mut x);
        assert_eq!(x, [1.0, 2.0, 3.0, 4.0, 9.0, 9.0, 9.0, 9.0]);
        let mut v = [1.0f32; 8];
        l.velocity(0.0, &x, &prev, &mut v);
        let mut s = [0.0; 4];
        Inpaint {
            overlap: 2,
            frozen: 1,
        }
        .strengths(6.0, &mut s);
        assert_eq!(v, [s[0], s[0], s[1], s[1], 1.0, 1.0, 1.0, 1.0]);
        assert_eq!(s[0], 0.0, "the delayed row is frozen");
    }

    /// The device kernel's form of a step (its record bytes, then per element with the row's
    /// weight) gives the host loop's velocity to the bit, for guidance at several times (the
    /// guidance weight capped at both ends) and for GR00T's strengths; an unguided run is plain.
    #[test]
    fn the_kernels_step_term_is_the_host_loops_velocity() {
        let guided = Method::Guidance {
            schedule: Schedule::Exp,
            max_guidance_weight: 7.0,
        };
        let (rows, width) = (6, 3);
        let prev: Vec<f32> = (0..rows * width)
            .map(|k| {
                if k < 4 * width {
                    k as f32 * 0.37 - 2.0
                } else {
                    0.0
                }
            })
            .collect();
        for method in [guided, Method::Inpaint { ramp_rate: 6.0 }] {
            let settings = Settings {
                execution_horizon: 5,
                inference_delay: None,
                method,
            };
            let mut l = Loop::new(settings, rows, width);
            let mut x: Vec<f32> = (0..rows * width)
                .map(|k| (k % 7) as f32 * 0.3 - 1.0)
                .collect();
            l.start(None, &prev, &mut x);
            assert_eq!(l.step_term(0.5), StepTerm::Plain);
            l.start(Some(Request { rows: 4, delay: 2 }), &prev, &mut x);
            for time in [1.0f32, 0.9, 0.5, 0.1, 0.0] {
                let term = l.step_term(time);
                let mut b = [0u8; StepTerm::BYTES];
                term.write(&mut b);
                let term = StepTerm::read(&b);
                assert_ne!(term, StepTerm::Plain);
                let v0: Vec<f32> = (0..rows * width)
                    .map(|k| (k % 5) as f32 * 0.21 - 0.4)
                    .collect();
                let mut want = v0.clone();
                l.velocity(time, &x, &prev, &mut want);
                let got: Vec<f32> = (0..rows * width)
                    .map(|k| term.apply(v0[k], x[k], prev[k], l.per_row()[k / width]))
                    .collect();
                assert_eq!(got, want, "{method:?} at {time}");
                if time > 0.0 || matches!(method, Method::Inpaint { .. }) {
                    // (Guidance's weight is 0 at time 0: LeRobot's NaN mapped to 0.)
                    assert_ne!(got, v0, "{method:?} at {time}: the step is corrected");
                }
            }
        }
    }

    /// GR00T's mapping (LeRobot's `_prepare_n1_7_rtc_inputs` and `get_action_with_features`):
    /// zero padding rows stripped, the overlap and frozen rows, and the velocity ramp.
    #[test]
    fn groot_inpaints_the_leftover_with_lerobots_ramp() {
        // Three real rows, then two rows of padding.
        let prev = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.0, 0.0, 0.0, 0.0];
        assert_eq!(
            Inpaint::new(&prev, 2, 8, 1),
            Some(Inpaint {
                overlap: 3,
                frozen: 1
            })
        );
        assert_eq!(
            Inpaint::new(&prev, 2, 2, 5),
            Some(Inpaint {
                overlap: 2,
                frozen: 2
            })
        );
        assert_eq!(Inpaint::new(&[0.0; 6], 2, 8, 1), None);
        let ip = Inpaint {
            overlap: 4,
            frozen: 1,
        };
        let mut s = [f32::NAN; 6];
        ip.strengths(6.0, &mut s);
        // `t = linspace(0, 1, 3 + 2)`: 0.25, 0.5, 0.75 between the ends.
        let ramp = |t: f32| (1.0 - (-6.0 * t).exp()) / (1.0 - (-6.0f32).exp());
        close(
            &s,
            &[0.0, ramp(0.25), ramp(0.5), ramp(0.75), 1.0, 1.0],
            1e-6,
        );
        // The noise's first rows become the leftover's.
        let mut noise = [9.0f32; 10];
        Inpaint {
            overlap: 2,
            frozen: 0,
        }
        .apply_to_noise(&prev, 2, 3, &mut noise);
        assert_eq!(noise[..4], [3.0, 4.0, 5.0, 6.0]);
        assert_eq!(noise[4..], [9.0; 6]);
    }

    #[test]
    fn schedules_parse_by_lerobots_names() {
        assert_eq!(Schedule::parse("LINEAR"), Some(Schedule::Linear));
        assert_eq!(Schedule::parse("exp"), Some(Schedule::Exp));
        assert_eq!(Schedule::parse("cosine"), None);
    }
}
