//! An input's shape against its engine input: the wire shape, rearranged by the layout and
//! stacked `history` frames deep, must be the engine's (leading 1s aside); text needs an
//! integer or float input.

use super::slot::Slot;
use crate::bind::squeeze_to;
use crate::config::{ConfigError, InputConfig, invalid};
use crate::dtype::ElemType;

/// How one frame of the wire tensor maps onto the engine input.
pub(super) struct Frame {
    /// Destination axis `k` is wire axis `perm[k]` (the identity without a layout).
    pub(super) perm: Vec<usize>,
    /// Engine elements of one frame.
    pub(super) elements: usize,
}

impl Frame {
    pub(super) fn is_identity(&self) -> bool {
        self.perm.iter().enumerate().all(|(j, &p)| j == p)
    }
}

pub(super) fn check(i: usize, b: &InputConfig, slot: &Slot) -> Result<Frame, ConfigError> {
    let k = |f: &str| format!("inputs[{i}].{f}");
    let spec = &slot.spec;
    let rank = b.shape.len();
    let mut perm: Vec<usize> = (0..rank).collect();
    if let Some(p) = b.layout.perm() {
        for (j, &pj) in p.iter().enumerate() {
            perm[rank - 3 + j] = rank - 3 + pj;
        }
    }
    let mut seen_by_engine: Vec<usize> = perm.iter().map(|&p| b.shape[p]).collect();
    if b.history > 1 {
        seen_by_engine.insert(0, b.history);
    }
    let engine_rank = seen_by_engine.len();
    if slot.tokens.is_none() && squeeze_to(&spec.shape, engine_rank) != seen_by_engine.as_slice() {
        return Err(invalid(
            k("shape"),
            format!(
                "wire shape {:?}{} does not match model input '{}' of shape {:?}",
                b.shape,
                if b.history > 1 {
                    format!(" (with history = {}: {seen_by_engine:?})", b.history)
                } else if b.layout.perm().is_some() {
                    format!(" (after layout: {seen_by_engine:?})")
                } else {
                    String::new()
                },
                spec.name,
                spec.shape
            ),
        ));
    }
    if b.is_text() && matches!(spec.dtype, ElemType::Bool | ElemType::F16) {
        return Err(invalid(
            k("tensor"),
            format!(
                "text goes into an integer or float input; '{}' is {}",
                spec.name, spec.dtype
            ),
        ));
    }
    Ok(Frame {
        perm,
        elements: spec.elements() / b.history,
    })
}
