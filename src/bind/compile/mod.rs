//! Does a policy's config fit its engine? Compiling its bindings: every `[[inputs]]`/`[[outputs]]`
//! entry checked against the engine's I/O and turned into transforms. An input compiles facet
//! by facet, as `config::bindings` resolves it: where its values land (`slot.rs`: an engine
//! input, or a host buffer for a prompt's text and a state only the prompt reads), its shape
//! and layout against the engine's (`shape.rs`, history included), its transforms (`affine.rs`:
//! the affine chain per accepted dtype, scalars, the clip) and its presence flag
//! (`presence.rs`). Outputs (`output.rs`, relative actions in `relative.rs`), the reply's sizes
//! and the vllm-omni metadata (`reply.rs`) and the planner's bindings (`planner.rs`) follow.

mod affine;
mod output;
mod planner;
mod presence;
mod relative;
mod reply;
mod shape;
mod slot;

use super::{InputBinding, Plan};
use crate::config::{Config, ConfigError, InputConfig, PolicySpec, invalid};
use crate::engine::IoSpec;
use crate::protocol::Limits;

impl Plan {
    /// Checks `policy`'s bindings against the engine's I/O and compiles them; `cfg` gives the
    /// request limits and, for the default policy, the planner's bindings.
    pub fn compile(cfg: &Config, policy: &PolicySpec, io: &IoSpec) -> Result<Plan, ConfigError> {
        io.check_sizes().map_err(|m| invalid("engine.model", m))?;
        let mut host = slot::HostBuffers::new(io);
        let mut inputs = Vec::with_capacity(policy.inputs.len());
        for (i, b) in policy.inputs.iter().enumerate() {
            inputs.push(input(i, b, policy, io, &mut host)?);
        }
        slot::check_every_input_bound(policy, io)?;
        let mut relative = relative::Source::default();
        let mut outputs = Vec::with_capacity(policy.outputs.len());
        for (i, o) in policy.outputs.iter().enumerate() {
            let mut inputs = relative::Inputs {
                bindings: &mut inputs,
                source: &mut relative,
                host: &mut host,
            };
            outputs.push(output::compile(i, o, io, &mut inputs)?);
        }
        reply::check_vllm_metadata(policy, &outputs)?;
        let sizes = reply::Sizes::of(&outputs);
        let planner = if policy.is_default {
            planner::tap(cfg, &inputs)?
        } else {
            None
        };
        let history_bytes = inputs.iter().map(|b| (b.history - 1) * b.frame_bytes).sum();
        Ok(Plan {
            tokens: inputs.iter().position(|b| b.tokens.is_some()),
            outputs,
            io: io.clone(),
            limits: Limits {
                max_depth: cfg.server.max_depth,
                max_entries: cfg.server.max_map_entries,
            },
            metadata: reply::metadata(policy),
            reply_capacity: sizes.reply_capacity,
            scratch_bytes: sizes.scratch_bytes,
            horizon: sizes.horizon,
            similarity_input: (policy.pacing.similarity_atol > 0.0)
                .then(|| {
                    policy
                        .inputs
                        .iter()
                        .position(|b| b.key == policy.pacing.similarity_key)
                })
                .flatten(),
            planner,
            host_buffers: host.into_sizes(),
            id: NEXT_PLAN.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            sampling: policy
                .pipeline
                .as_ref()
                .map(|p| (p.steps as u32, p.max_steps as u32)),
            history_bytes,
            relative_source: relative.index(),
            rtc: rtc_plan(policy, io),
            inputs,
        })
    }
}

/// Input binding `i`, facet by facet.
fn input(
    i: usize,
    b: &InputConfig,
    policy: &PolicySpec,
    io: &IoSpec,
    host: &mut slot::HostBuffers,
) -> Result<InputBinding, ConfigError> {
    let slot = slot::resolve(i, b, policy, io, host)?;
    let frame = shape::check(i, b, &slot)?;
    let spec = &slot.spec;
    let affine = affine::chain(b);
    let tokenized = slot.tokens.is_some();
    Ok(InputBinding {
        key: b.key.clone(),
        index: slot.index,
        accepted: affine::accepted(b, spec, &frame, &affine),
        shape: if tokenized {
            spec.shape.clone()
        } else {
            b.shape.clone()
        },
        engine_type: spec.dtype,
        scalar: affine::scalar(b, spec, &affine),
        affine,
        optional: b.presence.optional,
        fill: if tokenized { 0.0 } else { b.presence.fill },
        present: presence::compile(i, b, policy, io)?,
        text: b.is_text(),
        tokens: slot.tokens,
        check_finite: !b.norm.allow_non_finite && !b.is_text(),
        history: b.history,
        frame_bytes: frame.elements * spec.dtype.size(),
        raw: None,
        clip: affine::clip(i, b, spec)?,
    })
}

/// `[rtc]`'s layout: the pipeline's sample is its one output (`[.., rows, width]`, checked
/// when the pipeline was wired), its action columns those the output binding keeps.
fn rtc_plan(policy: &PolicySpec, io: &IoSpec) -> Option<super::RtcPlan> {
    let settings = policy.pipeline.as_ref()?.rtc?;
    let x = io.outputs.first()?;
    let (rows, width) = match x.shape.as_slice() {
        [.., rows, width] => (*rows, *width),
        _ => return None,
    };
    let cols = policy
        .outputs
        .iter()
        .find(|o| o.tensor == x.name)
        .and_then(|o| o.columns)
        .unwrap_or(width)
        .min(width);
    Some(super::RtcPlan {
        settings,
        output: 0,
        rows,
        width,
        cols,
    })
}

/// The next [`Plan::id`] (0 is never one: an empty token cache holds it).
static NEXT_PLAN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
