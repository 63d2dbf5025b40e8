//! `[[inputs]]` and `[[outputs]]`: how request keys map to the model's tensors and back.
//! An input binding is a few independent facets, each in its own file that reads its keys
//! from the raw table (`raw.rs`) and checks them, naming the key: its names (`names.rs`: the
//! key and the engine inputs it feeds), its wire tensor (`tensor.rs`: shape, dtypes, engine
//! shape, layout), text and tokenized prompts (`text.rs`), the affine chain (`affine.rs`:
//! scale, offset, map, mean/std or min/max, eps, clip, non-finite values), presence
//! (`presence.rs`: optional, fill, present tensor) and history (`history.rs`). [`inputs`] runs
//! them in order for each binding, then the checks across bindings. `outputs.rs` is the reply
//! side. Checks against the engine's real tensors are `crate::bind::compile`'s.

mod affine;
mod history;
mod names;
mod outputs;
mod presence;
mod raw;
mod tensor;
mod text;

use std::path::Path;

use super::{ConfigError, Keys};

pub use affine::Normalization;
pub(super) use outputs::outputs;
pub use outputs::{OutputConfig, RelativeConfig};
pub use presence::Presence;
pub(super) use raw::{RawInput, RawOutput};
pub use tensor::Layout;
pub use text::TokenizerConfig;

/// `[[inputs]]`: one observation key bound to one engine input.
#[derive(Clone, Debug, PartialEq)]
pub struct InputConfig {
    /// Observation key; nested maps are joined with `/` (`images/cam_high`).
    pub key: String,
    /// Engine input name; `None` only for a pi0.5 state the engine does not take (its
    /// normalised values then live in a host buffer, for the prompt alone).
    pub tensor: Option<String>,
    /// Numbers in the accepted wire dtypes, text, or a tokenized prompt.
    pub kind: InputKind,
    /// Expected wire shape.
    pub shape: Vec<usize>,
    pub layout: Layout,
    /// Fixed engine shape, for models whose input has symbolic dimensions.
    pub engine_shape: Option<Vec<usize>>,
    /// The values' way into engine units.
    pub norm: Normalization,
    /// Whether a request may leave the key out, and what then.
    pub presence: Presence,
    /// Frames the engine input holds: this one and the session's `history − 1` before it.
    pub history: usize,
}

/// What an input binding accepts.
#[derive(Clone, Debug, PartialEq)]
pub enum InputKind {
    /// Arrays in these wire dtypes, converted to the engine's.
    Numeric(Vec<crate::dtype::ElemType>),
    /// A string (`dtypes = ["text"]`) whose UTF-8 bytes fill a `[max_bytes]` input.
    Text,
    /// A string tokenized into ids (`tensor`) and a mask (`[inputs.tokenizer]`).
    Tokens(Box<TokenizerConfig>),
}

impl InputConfig {
    /// A binding that takes a string on the wire: text or a tokenized prompt.
    pub fn is_text(&self) -> bool {
        matches!(self.kind, InputKind::Text | InputKind::Tokens(_))
    }

    /// The tokenizer of a tokenized prompt.
    pub fn tokenizer(&self) -> Option<&TokenizerConfig> {
        match &self.kind {
            InputKind::Tokens(t) => Some(t),
            _ => None,
        }
    }

    /// The accepted wire dtypes (none for text).
    pub fn dtypes(&self) -> &[crate::dtype::ElemType] {
        match &self.kind {
            InputKind::Numeric(d) => d,
            InputKind::Text | InputKind::Tokens(_) => &[],
        }
    }
}

/// Binding `i`'s keys: `inputs[i].{field}`, for error messages.
fn key(i: usize, field: &str) -> String {
    format!("inputs[{i}].{field}")
}

/// `[[inputs]]`: each binding's facets, then the checks across bindings.
pub(super) fn inputs(
    cx: &Keys,
    inputs: &[RawInput],
    base: Option<&Path>,
) -> Result<Vec<InputConfig>, ConfigError> {
    if inputs.is_empty() {
        return Err(cx.invalid("inputs", "at least one [[inputs]] binding is needed"));
    }
    let mut out = Vec::with_capacity(inputs.len());
    for (i, b) in inputs.iter().enumerate() {
        names::check(cx, i, inputs)?;
        let tokens = text::tokenized(cx, i, b, base)?;
        names::check_tensor(cx, i, inputs, tokens.is_some())?;
        let shape = tensor::shape(cx, i, b, tokens.as_ref())?;
        text::check(cx, i, b, &shape)?;
        let wire = tensor::resolve(cx, i, b, shape)?;
        let presence = presence::resolve(cx, i, b)?;
        let norm = affine::resolve(cx, i, b, &wire)?;
        let history = history::resolve(cx, i, b)?;
        out.push(InputConfig {
            key: b.key.clone(),
            tensor: b.tensor.clone(),
            kind: match tokens {
                Some(t) => InputKind::Tokens(Box::new(t)),
                None if raw::is_text(b) => InputKind::Text,
                None => InputKind::Numeric(wire.dtypes),
            },
            shape: wire.shape,
            layout: wire.layout,
            engine_shape: wire.engine_shape,
            norm,
            presence,
            history,
        });
    }
    text::check_prompt(cx, &out)?;
    Ok(out)
}
