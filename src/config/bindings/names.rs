//! A binding's names: its request key (well formed, not reserved, bound once) and the engine
//! inputs it feeds (each fed by one binding).

use super::key;
use super::raw::{RawInput, is_text};
use crate::config::{ConfigError, Keys};
use crate::limits::MAX_PATH;
use crate::protocol::RESERVED_KEYS;

/// Binding `i`'s key, and its engine inputs against the bindings before it.
pub(super) fn check(cx: &Keys, i: usize, inputs: &[RawInput]) -> Result<(), ConfigError> {
    let b = &inputs[i];
    let k = |f: &str| key(i, f);
    if b.key.is_empty() || b.key.len() > MAX_PATH {
        return Err(cx.invalid(k("key"), format!("must be 1 to {MAX_PATH} bytes long")));
    }
    if b.key.starts_with('/') || b.key.ends_with('/') || b.key.contains("//") {
        return Err(cx.invalid(k("key"), format!("\"{}\" has an empty path segment", b.key)));
    }
    if RESERVED_KEYS.contains(&b.key.as_str()) {
        return Err(cx.invalid(
            k("key"),
            format!(
                "\"{}\" is reserved by the protocol and cannot be bound",
                b.key
            ),
        ));
    }
    if let Some(j) = inputs[..i].iter().position(|o| o.key == b.key) {
        return Err(cx.invalid(
            k("key"),
            format!("\"{}\" is already bound by inputs[{j}]", b.key),
        ));
    }
    let engine_inputs = |o: &RawInput| {
        let mask = o.tokenizer.as_ref().map(|t| t.mask_tensor.clone());
        o.tensor.clone().into_iter().chain(mask)
    };
    if let (Some(t), Some(m)) = (&b.tensor, &b.tokenizer)
        && m.mask_tensor == *t
    {
        return Err(cx.invalid(
            k("tokenizer.mask_tensor"),
            format!("\"{t}\" is the ids' tensor too; the mask needs its own input"),
        ));
    }
    for t in engine_inputs(b) {
        if let Some(j) = inputs[..i]
            .iter()
            .position(|o| engine_inputs(o).any(|n| n == t))
        {
            return Err(cx.invalid(
                k("tensor"),
                format!("engine input \"{t}\" is already bound by inputs[{j}]"),
            ));
        }
    }
    Ok(())
}

/// A binding without `tensor` must be a numeric state that a pi0.5 tokenizer reads
/// (`state_key`): the prompt is its only consumer.
pub(super) fn check_tensor(
    cx: &Keys,
    i: usize,
    inputs: &[RawInput],
    tokenized: bool,
) -> Result<(), ConfigError> {
    let b = &inputs[i];
    if b.tensor.is_some() {
        return Ok(());
    }
    let is_state = inputs.iter().any(|o| {
        o.tokenizer.as_ref().is_some_and(|t| {
            t.state_key
                .as_ref()
                .is_some_and(|s| s.values().contains(&b.key))
        })
    });
    if !is_state || tokenized || is_text(b) {
        return Err(cx.invalid(
            key(i, "tensor"),
            "name the engine input this key feeds (only a pi05 tokenizer's state_key may have \
             none)",
        ));
    }
    Ok(())
}
