//! Strings on the wire: a text binding (its UTF-8 bytes fill a `[max_bytes]` input) and a
//! prompt tokenized into ids and a mask (`[inputs.tokenizer]`, openpi's and GR00T's formats),
//! with the checks across bindings that a prompt needs (one per policy; its state keys).

use std::path::Path;

use super::raw::{OneOrMany, RawInput, RawTokenizer, is_text};
use super::{InputConfig, key};
use crate::config::{ConfigError, Keys, ModelSource, path};
use crate::limits::element_count;
/// `[inputs.tokenizer]`: a prompt tokenized as openpi's `PaligemmaTokenizer` does.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenizerConfig {
    /// The SentencePiece `.model` or `tokenizer.json`.
    pub file: ModelSource,
    pub format: crate::tokenizer::Format,
    /// Length of the ids and the mask.
    pub max_tokens: usize,
    pub mask_tensor: String,
    pub pad_id: i64,
    /// Refuse a prompt past `max_tokens` instead of truncating it.
    pub refuse_overflow: bool,
    /// `pi05`: the bindings whose normalised values are discretised, concatenated in order
    /// (empty for the other formats).
    pub state_keys: Vec<String>,
    /// A tokenizer.json's BOS token.
    pub bos: Option<String>,
    /// The most prompt bytes read (`None`: sized from the tokenizer when it is loaded).
    pub max_prompt_bytes: Option<usize>,
    /// The prompt of a request that sends none.
    pub default_prompt: Option<String>,
    /// GR00T's formats: fixed ids before and after the encoded prompt.
    pub prefix_ids: Vec<u32>,
    pub suffix_ids: Vec<u32>,
}

/// Binding `i`'s tokenizer, if it has one: the binding must be text without a shape.
pub(super) fn tokenized(
    cx: &Keys,
    i: usize,
    b: &RawInput,
    base: Option<&Path>,
) -> Result<Option<TokenizerConfig>, ConfigError> {
    let Some(t) = &b.tokenizer else {
        return Ok(None);
    };
    if !is_text(b) || b.dtypes.len() != 1 {
        return Err(cx.invalid(
            key(i, "dtypes"),
            "a tokenized prompt is text on the wire: dtypes = [\"text\"]",
        ));
    }
    if b.shape.is_some() {
        return Err(cx.invalid(
            key(i, "shape"),
            "a tokenized prompt's length is tokenizer.max_tokens; leave shape out",
        ));
    }
    tokenizer(cx, i, t, base).map(Some)
}

/// A text binding: `["text"]` alone, shaped `[max_bytes]`, and none of the numeric keys.
pub(super) fn check(cx: &Keys, i: usize, b: &RawInput, shape: &[usize]) -> Result<(), ConfigError> {
    if !is_text(b) {
        return Ok(());
    }
    let k = |f: &str| key(i, f);
    if b.dtypes.len() != 1 {
        return Err(cx.invalid(k("dtypes"), "\"text\" cannot be mixed with numeric dtypes"));
    }
    if shape.len() != 1 {
        return Err(cx.invalid(
            k("shape"),
            "a text binding's shape is [max_bytes]: the UTF-8 bytes, one per element",
        ));
    }
    if matches!(b.layout.as_deref(), Some("hwc_to_chw" | "chw_to_hwc"))
        || !b.mean.is_empty()
        || !b.min.is_empty()
        || b.scale.is_some()
        || b.offset.is_some()
        || b.map.is_some()
        || b.allow_non_finite
    {
        return Err(cx.invalid(
            k("dtypes"),
            "a text binding takes no layout, scale, offset, map, mean, std or allow_non_finite",
        ));
    }
    Ok(())
}

/// `[inputs.tokenizer]` of binding `i` (the file is read when the plan is compiled).
fn tokenizer(
    cx: &Keys,
    i: usize,
    t: &RawTokenizer,
    base: Option<&Path>,
) -> Result<TokenizerConfig, ConfigError> {
    let k = |f: &str| format!("inputs[{i}].tokenizer.{f}");
    let format = crate::tokenizer::Format::from_name(&t.format).ok_or_else(|| {
        cx.invalid(
            k("format"),
            format!(
                "must be \"pi0\", \"pi05\", \"plain\", \"lerobot\", \"groot\" or \"groot_raw\", \
                 got \"{}\"",
                t.format
            ),
        )
    })?;
    cx.between(&k("max_tokens"), t.max_tokens, 1, crate::limits::MAX_TOKENS)?;
    let refuse_overflow = cx.one_of(
        &k("overflow"),
        t.overflow.as_deref(),
        Some(false),
        &[("truncate", false), ("refuse", true)],
    )?;
    let state_keys = state_keys(cx, i, t, format)?;
    if let Some(n) = t.max_prompt_bytes {
        cx.between(
            &k("max_prompt_bytes"),
            n,
            1,
            crate::limits::MAX_PROMPT_BYTES,
        )?;
    }
    if t.file.as_os_str().is_empty() {
        return Err(cx.invalid(k("file"), "name the tokenizer's .model or tokenizer.json"));
    }
    if t.mask_tensor.is_empty() {
        return Err(cx.invalid(k("mask_tensor"), "name the engine input of the mask"));
    }
    let (prefix_ids, suffix_ids) = (
        t.prefix_ids.clone().unwrap_or_default(),
        t.suffix_ids.clone().unwrap_or_default(),
    );
    for (key, ids) in [("prefix_ids", &t.prefix_ids), ("suffix_ids", &t.suffix_ids)] {
        if ids.is_some() && !format.is_groot() {
            return Err(cx.invalid(
                k(key),
                "only formats \"groot\" and \"groot_raw\" put fixed ids around the prompt",
            ));
        }
    }
    if prefix_ids.len() + suffix_ids.len() >= t.max_tokens {
        return Err(cx.invalid(
            k("max_tokens"),
            format!(
                "is {}; prefix_ids and suffix_ids alone take {}, leaving no room for a prompt",
                t.max_tokens,
                prefix_ids.len() + suffix_ids.len()
            ),
        ));
    }
    Ok(TokenizerConfig {
        file: ModelSource::File(path(base, &t.file)),
        format,
        max_tokens: t.max_tokens,
        mask_tensor: t.mask_tensor.clone(),
        pad_id: t.pad_id,
        refuse_overflow,
        state_keys,
        bos: t.bos.clone(),
        max_prompt_bytes: t.max_prompt_bytes,
        default_prompt: t.default_prompt.clone(),
        prefix_ids,
        suffix_ids,
    })
}

/// `tokenizer.state_key`: for format `pi05` only (and required there), at most
/// `MAX_STATE_KEYS` keys, each once. Whether they name numeric inputs is checked across the
/// bindings ([`check_prompt`]).
fn state_keys(
    cx: &Keys,
    i: usize,
    t: &RawTokenizer,
    format: crate::tokenizer::Format,
) -> Result<Vec<String>, ConfigError> {
    let k = |f: &str| format!("inputs[{i}].tokenizer.{f}");
    let state_keys: Vec<String> = t
        .state_key
        .as_ref()
        .map(OneOrMany::values)
        .unwrap_or_default();
    match (format, state_keys.is_empty()) {
        (crate::tokenizer::Format::Pi05, true) => {
            return Err(cx.invalid(
                k("state_key"),
                "format \"pi05\" puts the discretised state in the prompt: name the state's input \
                 key (or keys, concatenated in order)",
            ));
        }
        (
            crate::tokenizer::Format::Pi0
            | crate::tokenizer::Format::Plain
            | crate::tokenizer::Format::Lerobot
            | crate::tokenizer::Format::Groot
            | crate::tokenizer::Format::GrootRaw,
            false,
        ) => {
            return Err(cx.invalid(
                k("state_key"),
                "only format \"pi05\" puts the state in the prompt",
            ));
        }
        _ => {}
    }
    if state_keys.len() > crate::limits::MAX_STATE_KEYS {
        return Err(cx.invalid(
            k("state_key"),
            format!(
                "names {} inputs; at most {} state parts go into one prompt",
                state_keys.len(),
                crate::limits::MAX_STATE_KEYS
            ),
        ));
    }
    if let Some((j, dup)) = state_keys
        .iter()
        .enumerate()
        .find(|(j, key)| state_keys[..*j].contains(key))
    {
        return Err(cx.invalid(
            k("state_key"),
            format!("names \"{dup}\" twice (entry {j}); each state input once"),
        ));
    }
    Ok(state_keys)
}

/// Across the bindings: one tokenized prompt per policy, and its `state_key`s name numeric
/// inputs of at most `MAX_PROMPT_STATE` values in all.
pub(super) fn check_prompt(cx: &Keys, out: &[InputConfig]) -> Result<(), ConfigError> {
    let mut tokenized = out
        .iter()
        .enumerate()
        .filter(|(_, b)| b.tokenizer().is_some());
    if let (Some(_), Some((j, _))) = (tokenized.next(), tokenized.next()) {
        return Err(cx.invalid(
            format!("inputs[{j}].tokenizer"),
            "one tokenized prompt per policy: bind the other strings as text",
        ));
    }
    for (i, b) in out.iter().enumerate() {
        let Some(t) = b.tokenizer() else {
            continue;
        };
        let k = format!("inputs[{i}].tokenizer.state_key");
        let mut total = 0usize;
        for key in &t.state_keys {
            let Some(state) = out.iter().find(|s| &s.key == key) else {
                return Err(cx.invalid(k, format!("names no [[inputs]] key (got \"{key}\")")));
            };
            let n = element_count(&state.shape).unwrap_or(usize::MAX);
            total = total.saturating_add(n);
            if state.is_text() || total > crate::limits::MAX_PROMPT_STATE {
                return Err(cx.invalid(
                    k,
                    format!(
                        "must name numeric inputs of at most {} values in all; '{key}' has {n} \
                         ({total} so far)",
                        crate::limits::MAX_PROMPT_STATE
                    ),
                ));
            }
        }
    }
    Ok(())
}
