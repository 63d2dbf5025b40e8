//! The reply side of a plan: its sizes (the largest reply, the scratch a conversion needs,
//! the chunk's rows), the metadata frame encoded once, and the metadata's vllm-omni keys
//! checked against the outputs.

use crate::bind::OutputBinding;
use crate::config::{ConfigError, PolicySpec, invalid};
use crate::protocol::{self, Encoder};

/// Sizes fixed by the outputs.
pub(super) struct Sizes {
    /// Rows of the action chunk (the first axis of the first output of rank 2 or more).
    pub(super) horizon: usize,
    /// The largest output converted to a reply dtype.
    pub(super) scratch_bytes: usize,
    /// The largest reply.
    pub(super) reply_capacity: usize,
}

impl Sizes {
    pub(super) fn of(outputs: &[OutputBinding]) -> Sizes {
        let horizon = outputs
            .iter()
            .find(|o| o.shape.len() >= 2)
            .map_or(1, |o| o.shape[0]);
        let converted = |o: &OutputBinding| o.configured.dst_bytes().max(o.float32.dst_bytes());
        // Map header, timing, `delay_steps`, and an `observe` push's extra keys with its two
        // [H] arrays of timesteps and timestamps.
        let push_extras = 64 + 2 * Encoder::ndarray_size(&[horizon], 8 * horizon);
        Sizes {
            horizon,
            scratch_bytes: outputs.iter().map(converted).max().unwrap_or(0),
            reply_capacity: 16
                + protocol::TIMING_SIZE
                + push_extras
                + outputs
                    .iter()
                    .map(|o| 5 + o.key.len() + Encoder::ndarray_size(&o.shape, converted(o)))
                    .sum::<usize>(),
        }
    }
}

/// The policy's metadata frame.
pub(super) fn metadata(policy: &PolicySpec) -> Vec<u8> {
    let mut metadata = Vec::new();
    protocol::encode_toml(
        &mut Encoder { buf: &mut metadata },
        &toml::Value::Table(policy.metadata.clone()),
    );
    metadata
}

/// vllm-omni clients build their loop from `action_horizon`, `action_dim` and `action_keys`:
/// where the metadata gives them, they must match the outputs.
pub(super) fn check_vllm_metadata(
    policy: &PolicySpec,
    outputs: &[OutputBinding],
) -> Result<(), ConfigError> {
    let m = &policy.metadata;
    if let Some(h) = m.get("action_horizon") {
        let h = h
            .as_integer()
            .ok_or_else(|| invalid("metadata.action_horizon", "must be an integer"))?;
        for o in outputs {
            let got = o
                .shape
                .get(o.shape.len().saturating_sub(2))
                .copied()
                .unwrap_or(1);
            if o.shape.len() < 2 || got as i64 != h {
                return Err(invalid(
                    "metadata.action_horizon",
                    format!("is {h} but output '{}' has shape {:?}", o.key, o.shape),
                ));
            }
        }
    }
    if let Some(d) = m.get("action_dim") {
        let d = d
            .as_integer()
            .ok_or_else(|| invalid("metadata.action_dim", "must be an integer"))?;
        for o in outputs {
            if o.shape.last().copied().unwrap_or(0) as i64 != d {
                return Err(invalid(
                    "metadata.action_dim",
                    format!("is {d} but output '{}' has shape {:?}", o.key, o.shape),
                ));
            }
        }
    }
    if let Some(keys) = m.get("action_keys") {
        let mut want: Vec<&str> = keys
            .as_array()
            .map(|a| a.iter().filter_map(|k| k.as_str()).collect())
            .unwrap_or_default();
        let mut have: Vec<&str> = outputs.iter().map(|o| o.key.as_str()).collect();
        want.sort_unstable();
        have.sort_unstable();
        if want != have {
            return Err(invalid(
                "metadata.action_keys",
                format!("is {want:?} but the outputs' keys are {have:?}"),
            ));
        }
    }
    Ok(())
}
