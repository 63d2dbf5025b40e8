//! An optional input's presence flag: a one-element engine input no other binding feeds.

use crate::config::{ConfigError, InputConfig, PolicySpec, invalid};
use crate::dtype::ElemType;
use crate::engine::{IoSpec, describe};

/// `inputs[i].present_tensor`: its engine input's index and type.
pub(super) fn compile(
    i: usize,
    b: &InputConfig,
    policy: &PolicySpec,
    io: &IoSpec,
) -> Result<Option<(usize, ElemType)>, ConfigError> {
    let Some(name) = &b.presence.present_tensor else {
        return Ok(None);
    };
    let k = format!("inputs[{i}].present_tensor");
    let at = io
        .inputs
        .iter()
        .position(|s| &s.name == name)
        .ok_or_else(|| {
            invalid(
                &k,
                format!(
                    "the model has no input '{name}'; its inputs are: {}",
                    describe(&io.inputs)
                ),
            )
        })?;
    let taken = policy.inputs.iter().any(|o| {
        o.tensor.as_deref() == Some(name.as_str())
            || o.tokenizer().is_some_and(|t| &t.mask_tensor == name)
    }) || policy.inputs[..i]
        .iter()
        .any(|o| o.presence.present_tensor.as_ref() == Some(name));
    if taken {
        return Err(invalid(
            k,
            format!("model input '{name}' is already fed by another binding"),
        ));
    }
    let p = &io.inputs[at];
    if p.elements() != 1 {
        return Err(invalid(
            k,
            format!(
                "model input '{name}' has shape {:?}; a presence flag is one element",
                p.shape
            ),
        ));
    }
    Ok(Some((at, p.dtype)))
}
