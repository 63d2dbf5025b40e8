//! How does a prompt reach a pi0-class engine? As token ids and a mask: the decode leaves the
//! prompt's text in a host buffer, then [`Plan::tokenize`] writes the ids and the mask into the
//! two engine inputs, from the session's [`PromptCache`] while the prompt (and, for pi0.5, the
//! state's bins) is unchanged, so a steady episode tokenizes once and allocates nothing.

use std::sync::Arc;

use super::{InputBinding, Plan};
use crate::config::{ConfigError, TokenizerConfig, invalid};
use crate::dtype::ElemType;
use crate::engine::{InputBuffer, TensorSpec};
use crate::limits::{MAX_PROMPT_BYTES, MAX_PROMPT_STATE};
use crate::protocol::WireError;
use crate::tokenizer::{Around, Format, Tokenizer, state_bin};
use crate::transform::{fill_bytes, load_f64};

/// A tokenized prompt's engine side.
#[derive(Debug)]
pub struct TokenBinding {
    pub tokenizer: Arc<Tokenizer>,
    pub format: Format,
    /// Engine input indices of the ids and the mask.
    pub ids: usize,
    pub mask: usize,
    pub ids_type: ElemType,
    pub mask_type: ElemType,
    pub max_tokens: usize,
    pub pad_id: i64,
    pub refuse_overflow: bool,
    /// `pi05`: the bindings whose normalised values are discretised, in order (their values
    /// concatenated); empty for the other formats.
    pub states: Vec<usize>,
    /// Bytes of prompt text read (the host buffer's size).
    pub prompt_bytes: usize,
    /// The tokenizer file's size (for the memory budget).
    pub file_size: u64,
    /// The prompt of a request that sends none (`tokenizer.default_prompt`).
    pub default_prompt: Option<String>,
    /// GR00T: the chat template's ids before and after the prompt.
    pub prefix_ids: Vec<u32>,
    pub suffix_ids: Vec<u32>,
}

impl TokenBinding {
    /// The fixed ids around the prompt (none outside GR00T's formats).
    pub fn around(&self) -> Around<'_> {
        Around {
            before: &self.prefix_ids,
            after: &self.suffix_ids,
        }
    }

    /// How many state values (pi0.5's bins) the prompt holds: the state bindings' together.
    pub fn state_values(&self, inputs: &[InputBinding]) -> usize {
        self.states
            .iter()
            .map(|&s| inputs[s].shape.iter().product::<usize>())
            .sum()
    }
}

/// One session's last tokenized prompt.
#[derive(Debug, Default)]
pub struct PromptCache {
    /// The plan it was made for (0: empty).
    plan: u64,
    text: Vec<u8>,
    bins: Vec<i16>,
    /// Every id, before truncation.
    ids: Vec<u32>,
    /// The session was told its prompt is truncated.
    warned: bool,
}

/// What [`Plan::tokenize`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tokenized {
    /// The prompt's token count, when it exceeded `max_tokens` and was truncated.
    pub truncated: Option<usize>,
    /// First truncation in this session (log it).
    pub first_truncation: bool,
    /// Tokenized now (not from the cache).
    pub encoded: bool,
}

/// The largest id `t` holds exactly (floats: every integer up to their mantissa).
fn max_id(t: ElemType) -> Option<i64> {
    Some(match t {
        ElemType::Bool => return None,
        ElemType::U8 => u8::MAX.into(),
        ElemType::I8 => i8::MAX.into(),
        ElemType::U16 => u16::MAX.into(),
        ElemType::I16 => i16::MAX.into(),
        ElemType::U32 => u32::MAX.into(),
        ElemType::I32 => i32::MAX.into(),
        ElemType::U64 | ElemType::I64 => i64::MAX,
        ElemType::F16 => 1 << 11,
        ElemType::F32 => 1 << 24,
        ElemType::F64 => 1 << 53,
    })
}

/// Where a tokenized prompt's ids and mask go, checked against the engine: binding `i`,
/// whose ids are the engine input `ids`; `states` are the pi0.5 state's bindings.
pub(super) fn compile(
    i: usize,
    t: &TokenizerConfig,
    inputs: &[TensorSpec],
    ids: usize,
    states: Vec<usize>,
) -> Result<TokenBinding, ConfigError> {
    let k = |f: &str| format!("inputs[{i}].{f}");
    let mask = inputs
        .iter()
        .position(|s| s.name == t.mask_tensor)
        .ok_or_else(|| {
            invalid(
                k("tokenizer.mask_tensor"),
                format!("the model has no input '{}'", t.mask_tensor),
            )
        })?;
    for (key, spec) in [
        ("tensor", &inputs[ids]),
        ("tokenizer.mask_tensor", &inputs[mask]),
    ] {
        if super::squeeze_to(&spec.shape, 1) != [t.max_tokens] {
            return Err(invalid(
                k(key),
                format!(
                    "model input '{}' has shape {:?}; tokenizer.max_tokens = {} needs [{}] \
                     (or [1, {}])",
                    spec.name, spec.shape, t.max_tokens, t.max_tokens, t.max_tokens
                ),
            ));
        }
    }
    let bytes = crate::engine::model_bytes(&t.file)
        .map_err(|e| invalid(k("tokenizer.file"), e.to_string()))?;
    let tokenizer = Tokenizer::load(&bytes, t.bos.as_deref())
        .map_err(|e| invalid(k("tokenizer.file"), format!("{}: {e}", t.file.describe())))?;
    if t.bos.is_some() && tokenizer.kind() == "sentencepiece" {
        return Err(invalid(
            k("tokenizer.bos"),
            "a SentencePiece model names its own BOS; bos is for a tokenizer.json",
        ));
    }
    let ids_type = inputs[ids].dtype;
    let largest = (tokenizer.vocab_size() as i64 - 1).max(t.pad_id);
    match max_id(ids_type) {
        Some(max)
            if largest <= max
                && (t.pad_id >= 0
                    || !matches!(
                        ids_type,
                        ElemType::U8 | ElemType::U16 | ElemType::U32 | ElemType::U64
                    )) => {}
        _ => {
            return Err(invalid(
                k("tensor"),
                format!(
                    "model input '{}' is {ids_type}, which cannot hold every id of {} \
                     ({} tokens, pad_id {}): export the ids as int32 or int64",
                    inputs[ids].name,
                    t.file.describe(),
                    tokenizer.vocab_size(),
                    t.pad_id
                ),
            ));
        }
    }
    let prompt_bytes = t
        .max_prompt_bytes
        .unwrap_or_else(|| (t.max_tokens * tokenizer.longest_piece()).saturating_add(256))
        .min(MAX_PROMPT_BYTES);
    if let Some(d) = &t.default_prompt
        && d.len() > prompt_bytes
    {
        return Err(invalid(
            k("tokenizer.default_prompt"),
            format!(
                "is {} bytes; at most max_prompt_bytes ({prompt_bytes}) are read",
                d.len()
            ),
        ));
    }
    for (key, ids) in [
        ("tokenizer.prefix_ids", &t.prefix_ids),
        ("tokenizer.suffix_ids", &t.suffix_ids),
    ] {
        if let Some((j, &id)) = ids
            .iter()
            .enumerate()
            .find(|(_, id)| **id as usize >= tokenizer.vocab_size())
        {
            return Err(invalid(
                k(key),
                format!(
                    "entry {j} is id {id}; {} has {} tokens",
                    t.file.describe(),
                    tokenizer.vocab_size()
                ),
            ));
        }
    }
    Ok(TokenBinding {
        tokenizer: Arc::new(tokenizer),
        format: t.format,
        ids,
        mask,
        ids_type,
        mask_type: inputs[mask].dtype,
        max_tokens: t.max_tokens,
        pad_id: t.pad_id,
        refuse_overflow: t.refuse_overflow,
        states,
        prompt_bytes,
        file_size: bytes.len() as u64,
        default_prompt: t.default_prompt.clone(),
        prefix_ids: t.prefix_ids.clone(),
        suffix_ids: t.suffix_ids.clone(),
    })
}

impl Plan {
    /// Writes the tokenized prompt's ids and mask into a decoded slot's engine inputs, from
    /// `cache` when the session's prompt (and pi0.5 state bins) are unchanged, else by
    /// tokenizing it. Nothing to do for a plan without one.
    pub fn tokenize(
        &self,
        bufs: &mut [Box<dyn InputBuffer>],
        cache: &mut PromptCache,
    ) -> Result<Tokenized, WireError> {
        let Some(b) = self.tokens.map(|i| &self.inputs[i]) else {
            return Ok(Tokenized::default());
        };
        let Some(t) = &b.tokens else {
            return Ok(Tokenized::default());
        };
        let mut bins = [0i16; MAX_PROMPT_STATE];
        let mut n = 0;
        for &s in &t.states {
            let s: &InputBinding = &self.inputs[s];
            let data = bufs[s.index].bytes_mut();
            let count = (data.len() / s.engine_type.size()).min(MAX_PROMPT_STATE - n);
            for (k, bin) in bins[n..n + count].iter_mut().enumerate() {
                *bin = state_bin(load_f64(s.engine_type, data, k));
            }
            n += count;
        }
        let bins = &bins[..n];
        let staged = bufs[b.index].bytes_mut();
        let text = &staged[..staged.iter().position(|&c| c == 0).unwrap_or(staged.len())];
        let mut out = Tokenized::default();
        if cache.plan != self.id || cache.text != text || cache.bins != bins {
            let prompt = std::str::from_utf8(text).map_err(|_| WireError::BadText {
                key: b.key.clone(),
                encoding: "UTF-8",
            })?;
            cache.plan = 0;
            t.tokenizer
                .tokenize(t.format, prompt, bins, t.around(), &mut cache.ids)
                .map_err(|e| WireError::Tokenize {
                    key: b.key.clone(),
                    reason: e.to_string(),
                })?;
            cache.text.clear();
            cache.text.extend_from_slice(text);
            cache.bins.clear();
            cache.bins.extend_from_slice(bins);
            cache.plan = self.id;
            out.encoded = true;
        }
        let n = cache.ids.len();
        if n > t.max_tokens {
            if t.refuse_overflow {
                return Err(WireError::TooManyTokens {
                    key: b.key.clone(),
                    max: t.max_tokens,
                    got: n,
                });
            }
            out.truncated = Some(n);
            out.first_truncation = !std::mem::replace(&mut cache.warned, true);
        }
        let ids = bufs[t.ids].bytes_mut();
        let size = t.ids_type.size();
        for (k, dst) in ids.chunks_exact_mut(size).take(t.max_tokens).enumerate() {
            let id = cache.ids.get(k).map_or(t.pad_id, |&id| i64::from(id));
            fill_bytes(t.ids_type, id as f64, dst);
        }
        let mask = bufs[t.mask].bytes_mut();
        let size = t.mask_type.size();
        let kept = n.min(t.max_tokens);
        let (on, off) = mask.split_at_mut((kept * size).min(mask.len()));
        fill_bytes(t.mask_type, 1.0, on);
        fill_bytes(t.mask_type, 0.0, off);
        Ok(out)
    }
}
