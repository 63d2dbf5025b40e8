//! Presence: whether a request may leave the key out (`optional`), the value the engine
//! input is filled with then (`fill`), and the engine input told which (`present_tensor`).

use super::key;
use super::raw::RawInput;
use crate::config::{ConfigError, Keys};

/// An input's presence facet.
#[derive(Clone, Debug, PartialEq)]
pub struct Presence {
    /// May be absent from a request; the engine input is then filled with `fill`.
    pub optional: bool,
    pub fill: f64,
    /// The engine input told whether the request sent this key (1) or it was filled (0).
    pub present_tensor: Option<String>,
}

pub(super) fn resolve(cx: &Keys, i: usize, b: &RawInput) -> Result<Presence, ConfigError> {
    let k = |f: &str| key(i, f);
    if let Some(t) = &b.present_tensor {
        if !b.optional {
            return Err(cx.invalid(
                k("present_tensor"),
                "only an optional input can be absent: set optional = true, or remove \
                 present_tensor",
            ));
        }
        if b.tensor.as_deref() == Some(t.as_str()) || t.is_empty() {
            return Err(cx.invalid(
                k("present_tensor"),
                format!("'{t}' must name another model input than this binding's tensor"),
            ));
        }
    }
    if !b.fill.is_finite() {
        return Err(cx.invalid(k("fill"), "must be a finite number"));
    }
    Ok(Presence {
        optional: b.optional,
        fill: b.fill,
        present_tensor: b.present_tensor.clone(),
    })
}
