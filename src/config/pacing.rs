//! `[pacing]`: the latency budget, timed actions and the `observe` filters.

use serde::Deserialize;

use super::{ConfigError, InputConfig, Keys};
use crate::limits::{MAX_LATENCY_WINDOW, MAX_SIMILARITY_STATE, element_count};

/// `[pacing]`: the latency budget, timed actions and the `observe` filters.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PacingConfig {
    /// Control rate of the robot: action step i is `timestamp + i / fps`, and `delay_steps`
    /// counts steps of `1 / fps`.
    pub fps: f64,
    /// Release every reply at `receive time + budget`, never earlier (0 = as soon as ready).
    pub latency_budget_ms: f64,
    /// Keep at most this many actions of each chunk (0 = all).
    pub actions_per_chunk: usize,
    /// Drop the first `delay_steps` actions of each chunk: they are stale on arrival.
    pub skip_stale_actions: bool,
    /// Add `delay_steps` to every dict reply (openpi replies and `observe` pushes).
    pub reply_delay_steps: bool,
    /// End-to-end latencies kept per session for `delay_steps` (its p95).
    pub latency_window: usize,
    /// Answer a skipped `observe` observation with `{"type": "skipped", …}`.
    pub report_skipped: bool,
    /// `observe`: skip an observation whose timestep was already predicted (or is running).
    pub skip_predicted_timesteps: bool,
    /// `observe`: skip an observation whose state is within this L2 distance (raw units) of
    /// the last accepted one (0 = off, the default: LeRobot's filter starves clients).
    pub similarity_atol: f64,
    /// The observation key whose value the similarity filter compares (an input binding).
    pub similarity_key: String,
    /// How long before a release time the pacing clock stops sleeping and busy-waits, in µs.
    /// More costs CPU and absorbs a noisier scheduler's wake-up delays.
    pub spin_us: u64,
}

impl Default for PacingConfig {
    fn default() -> Self {
        PacingConfig {
            fps: 30.0,
            latency_budget_ms: 0.0,
            actions_per_chunk: 0,
            skip_stale_actions: false,
            reply_delay_steps: true,
            latency_window: 100,
            report_skipped: false,
            skip_predicted_timesteps: true,
            similarity_atol: 0.0,
            similarity_key: String::new(),
            spin_us: 500,
        }
    }
}

/// `[pacing]`, with the similarity filter's input among `inputs`.
pub(super) fn pacing(
    cx: &Keys,
    p: &PacingConfig,
    inputs: &[InputConfig],
) -> Result<(), ConfigError> {
    if !p.fps.is_finite() || p.fps <= 0.0 || p.fps > 10_000.0 {
        return Err(cx.invalid(
            "pacing.fps",
            format!("must be a control rate in (0, 10000] Hz, got {}", p.fps),
        ));
    }
    if !p.latency_budget_ms.is_finite()
        || p.latency_budget_ms < 0.0
        || p.latency_budget_ms > 60_000.0
    {
        return Err(cx.invalid(
            "pacing.latency_budget_ms",
            format!(
                "must be between 0 (off) and 60000 ms, got {}",
                p.latency_budget_ms
            ),
        ));
    }
    cx.between(
        "pacing.latency_window",
        p.latency_window,
        1,
        MAX_LATENCY_WINDOW,
    )?;
    if p.spin_us > 20_000 {
        return Err(cx.invalid(
            "pacing.spin_us",
            format!("must be at most 20000 µs, got {}", p.spin_us),
        ));
    }
    if !p.similarity_atol.is_finite() || p.similarity_atol < 0.0 {
        return Err(cx.invalid(
            "pacing.similarity_atol",
            format!(
                "must be 0 (off) or a positive distance, got {}",
                p.similarity_atol
            ),
        ));
    }
    if p.similarity_atol > 0.0 {
        let Some(b) = inputs.iter().find(|b| b.key == p.similarity_key) else {
            return Err(cx.invalid(
                "pacing.similarity_key",
                format!(
                    "names no [[inputs]] key (got \"{}\"); the similarity filter needs the state's key, e.g. \"observation/state\"",
                    p.similarity_key
                ),
            ));
        };
        let n = element_count(&b.shape).unwrap_or(usize::MAX);
        if b.is_text() || n > MAX_SIMILARITY_STATE {
            return Err(cx.invalid(
                "pacing.similarity_key",
                format!(
                    "must name a numeric input of at most {MAX_SIMILARITY_STATE} elements; '{}' has {n}",
                    b.key
                ),
            ));
        }
    }
    Ok(())
}
