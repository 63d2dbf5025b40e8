//! The request path's side of `[planner]`: the text binding a subtask fills and the image
//! binding whose frames the planner sees, checked against the compiled inputs.

use crate::bind::{InputBinding, PlannerTap};
use crate::config::{Config, ConfigError, invalid};
use crate::dtype::ElemType;

/// Checks `[planner]`'s bindings against the compiled inputs.
pub(super) fn tap(
    cfg: &Config,
    inputs: &[InputBinding],
) -> Result<Option<PlannerTap>, ConfigError> {
    let p = &cfg.planner;
    if !p.enabled {
        return Ok(None);
    }
    let keys = || {
        inputs
            .iter()
            .map(|b| format!("\"{}\"", b.key))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let prompt = inputs
        .iter()
        .position(|b| b.key == p.prompt_key)
        .ok_or_else(|| {
            invalid(
                "planner.prompt_key",
                format!(
                    "no input binding has key \"{}\" (the inputs are {})",
                    p.prompt_key,
                    keys()
                ),
            )
        })?;
    if !inputs[prompt].text {
        return Err(invalid(
            "planner.prompt_key",
            format!(
                "\"{}\" is not a text binding (dtypes = [\"text\"]): the subtask is a string",
                p.prompt_key
            ),
        ));
    }
    // The text binding's bytes (for a tokenized prompt, its host buffer's).
    let max_subtask = inputs[prompt].shape.iter().product();
    let (camera, geometry) = match &p.camera {
        None => (None, None),
        Some(key) => {
            let i = inputs.iter().position(|b| &b.key == key).ok_or_else(|| {
                invalid(
                    "planner.camera",
                    format!(
                        "no input binding has key \"{key}\" (the inputs are {})",
                        keys()
                    ),
                )
            })?;
            let b = &inputs[i];
            let g = crate::planner::Geometry::of(&b.shape);
            let u8_ok = b.accepted.iter().any(|(t, _)| *t == ElemType::U8);
            match g {
                Some(g) if u8_ok && !b.text => (Some(i), Some(g)),
                _ => {
                    return Err(invalid(
                        "planner.camera",
                        format!(
                            "\"{key}\" must be an image binding that accepts uint8, shaped \
                             [H, W, C] or [C, H, W] with 1, 3 or 4 channels (got shape {:?})",
                            b.shape
                        ),
                    ));
                }
            }
        }
    };
    Ok(Some(PlannerTap {
        prompt,
        camera,
        geometry,
        max_subtask,
    }))
}
