//! Relative actions (`[[outputs]] relative_to`/`relative_mask`): the input whose values, as
//! the request sent them, the masked columns get; one such input for every relative output,
//! kept as float64 in a slot buffer of its own.

use super::slot::HostBuffers;
use crate::bind::{InputBinding, Relative};
use crate::config::{ConfigError, RelativeConfig, invalid};

/// The input the relative outputs read: its binding and its slot buffer.
#[derive(Default)]
pub(super) struct Source(Option<(usize, usize)>);

impl Source {
    /// The slot buffer holding the input as sent.
    pub(super) fn index(&self) -> Option<usize> {
        self.0.map(|(_, index)| index)
    }
}

/// What an output's relative actions read and may add to: the compiled inputs, the source
/// chosen so far, the slot's host buffers.
pub(super) struct Inputs<'a> {
    pub(super) bindings: &'a mut [InputBinding],
    pub(super) source: &'a mut Source,
    pub(super) host: &'a mut HostBuffers,
}

/// `outputs[i]`'s relative actions over its `cols` kept columns.
pub(super) fn compile(
    i: usize,
    r: &RelativeConfig,
    cols: usize,
    inputs: &mut Inputs<'_>,
) -> Result<Relative, ConfigError> {
    let k = |f: &str| format!("outputs[{i}].{f}");
    let bindings = &mut *inputs.bindings;
    let Some(bi) = bindings.iter().position(|b| b.key == r.key) else {
        let keys: Vec<&str> = bindings.iter().map(|b| b.key.as_str()).collect();
        return Err(invalid(
            k("relative_to"),
            format!(
                "no [[inputs]] binding has key \"{}\"; the keys are: {}",
                r.key,
                keys.join(", ")
            ),
        ));
    };
    let b = &bindings[bi];
    if b.text || b.optional || b.shape.len() != 1 {
        return Err(invalid(
            k("relative_to"),
            format!(
                "input \"{}\" must be a required numeric vector (shape [n]), the state the \
                 actions are relative to",
                r.key
            ),
        ));
    }
    let n = b.shape[0];
    let mask = match &r.mask {
        Some(m) => m.clone(),
        None if n >= cols => vec![true; cols],
        None => {
            return Err(invalid(
                k("relative_to"),
                format!(
                    "input \"{}\" has {n} values for {cols} action columns: give relative_mask \
                     for the first {n} or fewer",
                    r.key
                ),
            ));
        }
    };
    if mask.len() > cols.min(n) {
        return Err(invalid(
            k("relative_mask"),
            format!(
                "has {} entries; at most one per action column ({cols}) and per value of input \
                 \"{}\" ({n})",
                mask.len(),
                r.key
            ),
        ));
    }
    match inputs.source.0 {
        Some((source, _)) if source != bi => {
            return Err(invalid(
                k("relative_to"),
                format!(
                    "\"{}\": every relative output must be relative to the same input (\"{}\")",
                    r.key, bindings[source].key
                ),
            ));
        }
        Some(_) => {}
        None => {
            let index = inputs.host.add(n * 8);
            bindings[bi].raw = Some(index);
            inputs.source.0 = Some((bi, index));
        }
    }
    Ok(Relative { mask })
}
