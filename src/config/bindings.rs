//! `[[inputs]]` and `[[outputs]]`: how request keys map to the model's tensors and back
//! (dtypes, shapes, normalisation, tokenized prompts, history, relative actions).

use super::*;
use crate::transform::FeatureMap;

/// `[[inputs]]`: one observation key bound to one engine input.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawInput {
    /// Observation key; nested maps are joined with `/` (`images/cam_high`).
    pub(super) key: String,
    /// Engine input name (the token ids, for a tokenized prompt). Only a pi0.5 state that the
    /// engine does not take may leave it out.
    #[serde(default)]
    pub(super) tensor: Option<String>,
    /// Accepted wire dtypes (`uint8`, `float32`, `float64`, …), converted to the engine's; or
    /// `["text"]` for a string such as `prompt`, whose UTF-8 bytes fill a `[max_bytes]` input.
    pub(super) dtypes: Vec<String>,
    /// Expected wire shape (a tokenized prompt has none: its length is `max_tokens`).
    #[serde(default)]
    pub(super) shape: Option<Vec<usize>>,
    /// `hwc_to_chw`, `chw_to_hwc` or `none`.
    #[serde(default)]
    pub(super) layout: Option<String>,
    /// `y = ((x·scale + offset) − mean) / (std + eps)`: one value, or one per feature (the
    /// wire shape's last axis; openpi's ALOHA joint sign flips).
    #[serde(default)]
    pub(super) scale: Option<OneOrMany<f64>>,
    #[serde(default)]
    pub(super) offset: Option<OneOrMany<f64>>,
    /// A nonlinear function on some features, after `scale`/`offset` and before the
    /// normalisation: `((g(x·scale + offset)) − mean) / (std + eps)` on `map.columns`.
    #[serde(default)]
    pub(super) map: Option<RawMap>,
    /// Per-feature (length of the wire shape's last axis), per-element, or one value.
    #[serde(default)]
    pub(super) mean: Vec<f64>,
    #[serde(default)]
    pub(super) std: Vec<f64>,
    /// LeRobot's MIN_MAX instead of mean/std: `2·(x·scale + offset − min)/(max − min) − 1`.
    #[serde(default)]
    pub(super) min: Vec<f64>,
    #[serde(default)]
    pub(super) max: Vec<f64>,
    /// mean/std: the epsilon added to `std` (default 1e-6, openpi's; LeRobot's is 1e-8).
    /// min/max: the denominator used where `max == min` (default 1e-8, LeRobot's).
    #[serde(default)]
    pub(super) eps: Option<f64>,
    /// Frames of this key the engine input holds (LeRobot's `n_obs_steps`): the request sends
    /// one, policyd keeps the session's previous ones.
    #[serde(default)]
    pub(super) history: Option<usize>,
    /// May be absent from a request; the engine input is then filled with `fill`.
    #[serde(default)]
    pub(super) optional: bool,
    #[serde(default)]
    pub(super) fill: f64,
    /// An optional input's presence, as a one-element engine input: 1 when the request sent
    /// the key, 0 when it was filled (openpi's image mask for a camera a robot may leave out).
    #[serde(default)]
    pub(super) present_tensor: Option<String>,
    /// Fixed engine shape, for models whose input has symbolic dimensions.
    #[serde(default)]
    pub(super) engine_shape: Option<Vec<usize>>,
    /// Serve NaN and infinity (and values that overflow the engine's dtype once normalised)
    /// instead of refusing the request.
    #[serde(default)]
    pub(super) allow_non_finite: bool,
    /// `[lo, hi]`: after normalising, values are clamped to it (GR00T's state, clipped to
    /// [−1, 1] after its q01/q99 min-max). A list, checked for its length by name (serde's
    /// fixed arrays drop a third value silently).
    #[serde(default)]
    pub(super) clip: Option<Vec<f64>>,
    /// A prompt tokenized into token ids (`tensor`) and a mask.
    #[serde(default)]
    pub(super) tokenizer: Option<RawTokenizer>,
}

/// One value (a key, a number) or a list of them.
#[derive(Clone, Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "one value or a list of them (a number, or numbers, for scale and offset; a \
                 key, or keys, for state_key)"
)]
pub(super) enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

impl<T: Clone> OneOrMany<T> {
    fn values(&self) -> Vec<T> {
        match self {
            OneOrMany::One(v) => vec![v.clone()],
            OneOrMany::Many(v) => v.clone(),
        }
    }
}

/// `[inputs.map]`: a named nonlinear function on some features of an input.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMap {
    /// The function (`aloha_gripper_to_angular`).
    pub(super) function: String,
    /// The features (indices into the wire shape's last axis) it applies to.
    pub(super) columns: Vec<usize>,
}

/// `[inputs.tokenizer]`: how a prompt becomes token ids and a mask (openpi's formats).
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTokenizer {
    /// A SentencePiece `.model` or a Hugging Face `tokenizer.json`, relative to the config file.
    pub(super) file: PathBuf,
    /// `pi0`, `pi05` or `plain`.
    pub(super) format: String,
    /// Length of the ids and mask inputs (openpi's `max_token_len`: 48 for pi0, 200 for pi0.5).
    pub(super) max_tokens: usize,
    /// Engine input for the mask (true for a token, false for padding).
    pub(super) mask_tensor: String,
    /// Id written after the last token.
    #[serde(default)]
    pub(super) pad_id: i64,
    /// `truncate` (openpi's behaviour) or `refuse`.
    #[serde(default)]
    pub(super) overflow: Option<String>,
    /// `pi05`: the input binding whose normalised values are discretised into the prompt, or
    /// several, whose values are concatenated in order (openpi's DROID state: joints, gripper).
    #[serde(default)]
    pub(super) state_key: Option<OneOrMany<String>>,
    /// A tokenizer.json's BOS token, by its text (SentencePiece models name their own).
    #[serde(default)]
    pub(super) bos: Option<String>,
    /// The most prompt bytes read before tokenizing (default: enough for `max_tokens` of the
    /// tokenizer's longest piece).
    #[serde(default)]
    pub(super) max_prompt_bytes: Option<usize>,
    /// The prompt when a request has none (openpi's `InjectDefaultPrompt`, e.g. ALOHA sim's
    /// "Transfer cube"); a request's own prompt, even an empty one, wins.
    #[serde(default)]
    pub(super) default_prompt: Option<String>,
    /// GR00T's formats: the chat template's token ids before the prompt (its image blocks
    /// included) and after it, as the exporter rendered them from the checkpoint's processor.
    #[serde(default)]
    pub(super) prefix_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub(super) suffix_ids: Option<Vec<u32>>,
}

/// `[[outputs]]`: one engine output sent under one reply key.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOutput {
    /// Engine output name.
    pub(super) tensor: String,
    /// Reply key.
    #[serde(default = "actions")]
    pub(super) key: String,
    /// Wire dtype of the reply array (`float32` or `float64`).
    #[serde(default = "f32_name")]
    pub(super) dtype: String,
    /// Keep only the first N entries of the last axis (openpi's `actions[:, :14]`).
    #[serde(default)]
    pub(super) columns: Option<usize>,
    /// Un-normalisation `x·(std + eps) + mean`, per action dimension (or one value).
    #[serde(default)]
    pub(super) mean: Vec<f64>,
    #[serde(default)]
    pub(super) std: Vec<f64>,
    /// LeRobot's MIN_MAX un-normalisation instead: `(x + 1)/2·(max − min) + min`.
    #[serde(default)]
    pub(super) min: Vec<f64>,
    #[serde(default)]
    pub(super) max: Vec<f64>,
    /// After un-normalising, `y·scale + offset` per action dimension (or one value): a robot's
    /// own units, such as openpi ALOHA's joint sign flips and its gripper map back.
    #[serde(default)]
    pub(super) scale: Option<OneOrMany<f64>>,
    #[serde(default)]
    pub(super) offset: Option<OneOrMany<f64>>,
    /// `[lo, hi]`: the engine's values are clamped to it before un-normalising (GR00T's
    /// actions, clipped to [−1, 1] before its q01/q99 min-max back).
    #[serde(default)]
    pub(super) clip: Option<Vec<f64>>,
    /// As for inputs (mean/std default 1e-6; LeRobot un-normalises with 0).
    #[serde(default)]
    pub(super) eps: Option<f64>,
    /// Keep rows `[start, end)` of the output's first axis (LeRobot Diffusion's action slice).
    #[serde(default)]
    pub(super) rows: Option<Vec<usize>>,
    /// Relative actions: the input (a 1-D numeric binding) whose values, as the request sent
    /// them, are added to the masked columns after un-normalising (LeRobot's
    /// `AbsoluteActionsProcessorStep`, openpi's `AbsoluteActions`).
    #[serde(default)]
    pub(super) relative_to: Option<String>,
    /// Which columns get the offset (the first `len` columns; all kept columns when absent).
    #[serde(default)]
    pub(super) relative_mask: Option<Vec<bool>>,
}

pub(super) fn actions() -> String {
    "actions".into()
}

pub(super) fn f32_name() -> String {
    "float32".into()
}

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
    /// `y = ((x·scale + offset) − mean) / (std + eps)`: one value or one per feature.
    pub scale: Vec<f64>,
    pub offset: Vec<f64>,
    /// `g` on these features (indices into the wire shape's last axis) between the scale and
    /// the normalisation.
    pub map: Option<(FeatureMap, Vec<usize>)>,
    /// Per-feature (length of the wire shape's last axis), per-element, or one value. A
    /// LeRobot `min`/`max` binding is resolved into these (`mean` the midpoint, `std` half
    /// the range, `eps` 0): the same map, written once.
    pub mean: Vec<f64>,
    pub std: Vec<f64>,
    pub eps: f64,
    /// Frames the engine input holds: this one and the session's `history − 1` before it.
    pub history: usize,
    /// May be absent from a request; the engine input is then filled with `fill`.
    pub optional: bool,
    pub fill: f64,
    /// The engine input told whether the request sent this key (1) or it was filled (0).
    pub present_tensor: Option<String>,
    /// Fixed engine shape, for models whose input has symbolic dimensions.
    pub engine_shape: Option<Vec<usize>>,
    /// Serve NaN and infinity instead of refusing the request (`inputs[i].allow_non_finite`).
    pub allow_non_finite: bool,
    /// Clamp the normalised values to `[lo, hi]` (engine units).
    pub clip: Option<(f64, f64)>,
}

/// What an input binding accepts.
#[derive(Clone, Debug, PartialEq)]
pub enum InputKind {
    /// Arrays in these wire dtypes, converted to the engine's.
    Numeric(Vec<ElemType>),
    /// A string (`dtypes = ["text"]`) whose UTF-8 bytes fill a `[max_bytes]` input.
    Text,
    /// A string tokenized into ids (`tensor`) and a mask (`[inputs.tokenizer]`).
    Tokens(Box<TokenizerConfig>),
}

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
    pub fn dtypes(&self) -> &[ElemType] {
        match &self.kind {
            InputKind::Numeric(d) => d,
            InputKind::Text | InputKind::Tokens(_) => &[],
        }
    }
}

/// `[[outputs]]`: one engine output sent under one reply key.
#[derive(Clone, Debug, PartialEq)]
pub struct OutputConfig {
    /// Engine output name.
    pub tensor: String,
    /// Reply key.
    pub key: String,
    /// Wire dtype of the reply array (`float32` or `float64`).
    pub dtype: ElemType,
    /// Keep only the first N entries of the last axis (openpi's `actions[:, :14]`).
    pub columns: Option<usize>,
    /// Un-normalisation `x·(std + eps) + mean`, per action dimension (or one value); LeRobot's
    /// `min`/`max` resolved as for inputs.
    pub mean: Vec<f64>,
    pub std: Vec<f64>,
    pub eps: f64,
    /// Rows `[start, end)` of the first axis kept (the whole axis when `None`).
    pub rows: Option<(usize, usize)>,
    /// Relative actions: absolute = un-normalised output + the input's values as sent.
    pub relative: Option<RelativeConfig>,
    /// Clamp the engine's values to `[lo, hi]` before un-normalising.
    pub clip: Option<(f64, f64)>,
}

/// `[[outputs]] relative_to`/`relative_mask`: the model predicts actions relative to the state,
/// and the reply carries absolute ones. Column `j` of every kept row gets the input's value
/// `j` as the request sent it, for each `j` with `mask[j]`; the mask is checked against both
/// lengths once the bindings are compiled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RelativeConfig {
    /// The input binding's key (`observation.state`).
    pub key: String,
    /// `None`: every kept column.
    pub mask: Option<Vec<bool>>,
}

/// How an input's axes are rearranged on the way to the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    None,
    HwcToChw,
    ChwToHwc,
}

impl Layout {
    /// Destination axis k is source axis `perm[k]` (over the last three axes).
    pub fn perm(self) -> Option<[usize; 3]> {
        match self {
            Layout::None => None,
            Layout::HwcToChw => Some([2, 0, 1]),
            Layout::ChwToHwc => Some([1, 2, 0]),
        }
    }
}

pub(super) fn is_text(b: &RawInput) -> bool {
    b.dtypes.iter().any(|d| d == "text")
}

/// `[inputs.tokenizer]` of binding `i` (the file is read when the plan is compiled).
pub(super) fn tokenizer(
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
    let state_keys = t
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

/// `[[inputs]]`: each binding on its own and against the others.
pub(super) fn inputs(
    cx: &Keys,
    inputs: &[RawInput],
    base: Option<&Path>,
) -> Result<Vec<InputConfig>, ConfigError> {
    let mut out = Vec::with_capacity(inputs.len());
    if inputs.is_empty() {
        return Err(cx.invalid("inputs", "at least one [[inputs]] binding is needed"));
    }
    for (i, b) in inputs.iter().enumerate() {
        let k = |f: &str| format!("inputs[{i}].{f}");
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
        let tokens = match &b.tokenizer {
            None => None,
            Some(t) => {
                if !is_text(b) || b.dtypes.len() != 1 {
                    return Err(cx.invalid(
                        k("dtypes"),
                        "a tokenized prompt is text on the wire: dtypes = [\"text\"]",
                    ));
                }
                if b.shape.is_some() {
                    return Err(cx.invalid(
                        k("shape"),
                        "a tokenized prompt's length is tokenizer.max_tokens; leave shape out",
                    ));
                }
                Some(tokenizer(cx, i, t, base)?)
            }
        };
        if b.tensor.is_none() {
            let is_state = inputs.iter().any(|o| {
                o.tokenizer.as_ref().is_some_and(|t| {
                    t.state_key
                        .as_ref()
                        .is_some_and(|s| s.values().contains(&b.key))
                })
            });
            if !is_state || tokens.is_some() || is_text(b) {
                return Err(cx.invalid(
                    k("tensor"),
                    "name the engine input this key feeds (only a pi05 tokenizer's state_key may \
                     have none)",
                ));
            }
        }
        let shape = match (&b.shape, &tokens) {
            (Some(s), _) => s.clone(),
            (None, Some(t)) => vec![t.max_tokens],
            (None, None) => {
                return Err(cx.invalid(k("shape"), "missing: give the expected wire shape"));
            }
        };
        if b.dtypes.is_empty() {
            return Err(cx.invalid(
                k("dtypes"),
                "list at least one accepted wire dtype, e.g. [\"float32\", \"float64\"]",
            ));
        }
        if is_text(b) {
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
                    "a text binding takes no layout, scale, offset, map, mean, std or \
                     allow_non_finite",
                ));
            }
        }
        let mut dtypes = Vec::new();
        for d in b.dtypes.iter().filter(|_| !is_text(b)) {
            if let Some(t) = ElemType::from_name(d) {
                dtypes.push(t);
            } else {
                return Err(cx.invalid(
                    k("dtypes"),
                    format!(
                        "unknown dtype \"{d}\"; use a numpy name such as uint8, float32, float64, or \"text\""
                    ),
                ));
            }
        }
        if shape.len() > crate::limits::MAX_RANK {
            return Err(cx.invalid(
                k("shape"),
                format!("rank {} exceeds {}", shape.len(), crate::limits::MAX_RANK),
            ));
        }
        if shape.contains(&0) {
            return Err(cx.invalid(k("shape"), "dimensions must be positive"));
        }
        let count = elements(cx, &k("shape"), &shape)?;
        if let Some(es) = &b.engine_shape {
            if es.is_empty() || es.len() > crate::limits::MAX_RANK || es.contains(&0) {
                return Err(cx.invalid(
                    k("engine_shape"),
                    format!(
                        "needs 1 to {} positive dimensions, got {es:?}",
                        crate::limits::MAX_RANK
                    ),
                ));
            }
            elements(cx, &k("engine_shape"), es)?;
        }
        let layout = cx.one_of(
            &k("layout"),
            b.layout.as_deref(),
            Some(Layout::None),
            &[
                ("hwc_to_chw", Layout::HwcToChw),
                ("chw_to_hwc", Layout::ChwToHwc),
                ("none", Layout::None),
            ],
        )?;
        if layout.perm().is_some() && shape.len() < 3 {
            return Err(cx.invalid(k("layout"), "needs a shape of rank 3 or more"));
        }
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
        let features = *shape.last().unwrap_or(&1);
        let per_feature = |key: &str, v: &Option<OneOrMany<f64>>, default: f64| {
            let v = v.as_ref().map_or_else(|| vec![default], OneOrMany::values);
            if v.iter().any(|x| !x.is_finite()) {
                return Err(cx.invalid(k(key), "values must be finite numbers"));
            }
            if v.len() != 1 && v.len() != features {
                return Err(cx.invalid(
                    k(key),
                    format!(
                        "has {} values; give one, or one per entry of the wire shape's last \
                         axis ({features})",
                        v.len()
                    ),
                ));
            }
            Ok(v)
        };
        let scale = per_feature("scale", &b.scale, 1.0)?;
        let offset = per_feature("offset", &b.offset, 0.0)?;
        if !b.fill.is_finite() {
            return Err(cx.invalid(k("fill"), "must be a finite number"));
        }
        let norm = RawNorm {
            mean: &b.mean,
            std: &b.std,
            min: &b.min,
            max: &b.max,
            eps: b.eps,
        };
        let (mean, std, eps) = norm.resolve(cx, i, "inputs", &[1, features, count])?;
        // Per-element statistics index the whole tensor; a list of scales, or a map, indexes
        // its features.
        if mean.len() == count && count != features && (scale.len() > 1 || offset.len() > 1) {
            return Err(cx.invalid(
                k("scale"),
                "one scale and offset per feature cannot combine with per-element mean and \
                 std: give one value each",
            ));
        }
        let map = match &b.map {
            None => None,
            Some(m) => Some(feature_map(
                cx,
                &k,
                m,
                features,
                mean.len() == count && count != features,
            )?),
        };
        let history = b.history.unwrap_or(1);
        if !(1..=crate::limits::MAX_HISTORY).contains(&history) {
            return Err(cx.invalid(
                k("history"),
                format!(
                    "must be 1 to {} frames, got {history}",
                    crate::limits::MAX_HISTORY
                ),
            ));
        }
        if history > 1 && (is_text(b) || tokens.is_some()) {
            return Err(cx.invalid(k("history"), "applies to numeric inputs, not text"));
        }
        if b.clip.is_some() && (is_text(b) || tokens.is_some()) {
            return Err(cx.invalid(k("clip"), "applies to numeric inputs, not text"));
        }
        let clip = check_clip(cx, &k("clip"), b.clip.as_deref())?;
        out.push(InputConfig {
            key: b.key.clone(),
            tensor: b.tensor.clone(),
            kind: match tokens {
                Some(t) => InputKind::Tokens(Box::new(t)),
                None if is_text(b) => InputKind::Text,
                None => InputKind::Numeric(dtypes),
            },
            shape,
            layout,
            scale,
            offset,
            map,
            mean,
            std,
            eps,
            history,
            optional: b.optional,
            fill: b.fill,
            present_tensor: b.present_tensor.clone(),
            engine_shape: b.engine_shape.clone(),
            allow_non_finite: b.allow_non_finite,
            clip,
        });
    }
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
    Ok(out)
}

/// `[[outputs]]`: each on its own (lengths against the action dimension are checked once the
/// engine is known).
pub(super) fn outputs(cx: &Keys, outputs: &[RawOutput]) -> Result<Vec<OutputConfig>, ConfigError> {
    let mut out = Vec::with_capacity(outputs.len());
    if outputs.is_empty() {
        return Err(cx.invalid("outputs", "at least one [[outputs]] binding is needed"));
    }
    for (i, o) in outputs.iter().enumerate() {
        let k = |f: &str| format!("outputs[{i}].{f}");
        if o.key.is_empty() {
            return Err(cx.invalid(k("key"), "must not be empty"));
        }
        if let Some(j) = outputs[..i].iter().position(|p| p.key == o.key) {
            return Err(cx.invalid(
                k("key"),
                format!("\"{}\" is already used by outputs[{j}]", o.key),
            ));
        }
        let dtype = ElemType::from_name(&o.dtype);
        let Some(dtype @ (ElemType::F32 | ElemType::F64)) = dtype else {
            return Err(cx.invalid(
                k("dtype"),
                format!("must be \"float32\" or \"float64\", got \"{}\"", o.dtype),
            ));
        };
        if o.columns == Some(0) {
            return Err(cx.invalid(k("columns"), "must be positive"));
        }
        // Lengths against the action dimension are checked once the engine is known.
        let norm = RawNorm {
            mean: &o.mean,
            std: &o.std,
            min: &o.min,
            max: &o.max,
            eps: o.eps,
        };
        let (mean, std, eps) = norm.resolve(cx, i, "outputs", &[])?;
        let (mean, std, eps) = then_scale(cx, i, o, mean, std, eps)?;
        let rows = match o.rows.as_deref() {
            None => None,
            Some(&[start, end]) if start < end => Some((start, end)),
            Some(&[start, end]) => {
                return Err(cx.invalid(
                    k("rows"),
                    format!("[{start}, {end}] keeps no row; give [start, end] with start < end"),
                ));
            }
            Some(other) => {
                return Err(cx.invalid(
                    k("rows"),
                    format!("has {} values; give [start, end]", other.len()),
                ));
            }
        };
        // Every reply is float32 on the vllm-omni route (and with dtype = "float32"): a
        // coefficient past its range would put infinity on the wire for any output.
        // (`std` enters as `std + eps`.)
        let f32_max = f64::from(f32::MAX);
        let key_of = |k: &'static str| {
            if o.min.is_empty() {
                k
            } else if k == "mean" {
                "min"
            } else {
                "max"
            }
        };
        for (key, values, pad) in [("mean", &mean, 0.0), ("std", &std, eps)] {
            let key = key_of(key);
            if let Some(v) = values.iter().find(|v| (*v + pad).abs() > f32_max) {
                return Err(cx.invalid(
                    k(key),
                    format!(
                        "{v} cannot be represented in float32, the dtype replies are sent in on \
                         the vllm-omni route; un-normalised actions must stay within \
                         ±{f32_max:e}"
                    ),
                ));
            }
        }
        let relative = match (&o.relative_to, &o.relative_mask) {
            (None, None) => None,
            (None, Some(_)) => {
                return Err(cx.invalid(
                    k("relative_mask"),
                    "needs relative_to: the input whose values the masked columns are relative to",
                ));
            }
            (Some(key), _) if key.is_empty() => {
                return Err(cx.invalid(k("relative_to"), "must name an input binding's key"));
            }
            (Some(key), mask) => {
                if mask.as_ref().is_some_and(|m| m.is_empty()) {
                    return Err(cx.invalid(
                        k("relative_mask"),
                        "must not be empty (leave it out to offset every column)",
                    ));
                }
                Some(crate::config::RelativeConfig {
                    key: key.clone(),
                    mask: mask.clone(),
                })
            }
        };
        out.push(OutputConfig {
            tensor: o.tensor.clone(),
            key: o.key.clone(),
            dtype,
            columns: o.columns,
            mean,
            std,
            eps,
            rows,
            relative,
            clip: check_clip(cx, &k("clip"), o.clip.as_deref())?,
        });
    }
    Ok(out)
}

/// `[inputs.map]`: a known function on columns of the wire shape's last axis (`features` of
/// them), each named once; it needs per-feature statistics (`per_element`: the binding's are
/// per element).
fn feature_map(
    cx: &Keys,
    k: &dyn Fn(&str) -> String,
    m: &RawMap,
    features: usize,
    per_element: bool,
) -> Result<(FeatureMap, Vec<usize>), ConfigError> {
    let Some(g) = FeatureMap::parse(&m.function) else {
        let known: Vec<&str> = FeatureMap::NAMES.iter().map(|(n, _)| *n).collect();
        return Err(cx.invalid(
            k("map.function"),
            format!(
                "unknown function \"{}\"; known: {}",
                m.function,
                known.join(", ")
            ),
        ));
    };
    if m.columns.is_empty()
        || m.columns.len() > features
        || m.columns.iter().any(|&c| c >= features)
    {
        return Err(cx.invalid(
            k("map.columns"),
            format!(
                "give one or more indices into the wire shape's last axis (0 to {}), each once",
                features.saturating_sub(1)
            ),
        ));
    }
    let mut seen = vec![false; features];
    if let Some(&dup) = m
        .columns
        .iter()
        .find(|&&c| std::mem::replace(&mut seen[c], true))
    {
        return Err(cx.invalid(
            k("map.columns"),
            format!("names column {dup} twice; each column once"),
        ));
    }
    if per_element {
        return Err(cx.invalid(
            k("map"),
            "applies to per-feature statistics; this binding's mean/std are per element",
        ));
    }
    Ok((g, m.columns.clone()))
}

/// A `clip = [lo, hi]`: finite, `lo < hi`.
fn check_clip(
    cx: &Keys,
    key: &str,
    clip: Option<&[f64]>,
) -> Result<Option<(f64, f64)>, ConfigError> {
    match clip {
        None => Ok(None),
        Some(&[lo, hi]) if lo.is_finite() && hi.is_finite() && lo < hi => Ok(Some((lo, hi))),
        Some(&[lo, hi]) => Err(cx.invalid(
            key,
            format!("[{lo}, {hi}]: give [lo, hi] with finite lo < hi"),
        )),
        Some(other) => Err(cx.invalid(key, format!("has {} values; give [lo, hi]", other.len()))),
    }
}

/// `[[outputs]] scale`/`offset` folded into the un-normalisation: the map
/// `(x·(std + eps) + mean)·scale + offset` is `x·std' + mean'` with `std' = (std + eps)·scale`
/// (which may be negative: a sign flip) and `mean' = mean·scale + offset`. Each of the four is empty, one value, or one per
/// column; the lengths that are not one must agree.
fn then_scale(
    cx: &Keys,
    i: usize,
    o: &RawOutput,
    mean: Vec<f64>,
    std: Vec<f64>,
    eps: f64,
) -> Result<(Vec<f64>, Vec<f64>, f64), ConfigError> {
    let values = |v: &Option<OneOrMany<f64>>| v.as_ref().map(OneOrMany::values).unwrap_or_default();
    let (scale, offset) = (values(&o.scale), values(&o.offset));
    if scale.is_empty() && offset.is_empty() {
        return Ok((mean, std, eps));
    }
    let k = |f: &str| format!("outputs[{i}].{f}");
    for (key, v) in [("scale", &scale), ("offset", &offset)] {
        if v.iter().any(|x| !x.is_finite()) {
            return Err(cx.invalid(k(key), "values must be finite"));
        }
    }
    let lengths = [mean.len(), scale.len(), offset.len()];
    let n = lengths.iter().copied().max().unwrap_or(0);
    if let Some((key, len)) = ["mean", "scale", "offset"]
        .iter()
        .zip(lengths)
        .find(|(_, l)| *l > 1 && *l != n)
    {
        let key = if *key == "mean" && !o.min.is_empty() {
            "min"
        } else {
            key
        };
        return Err(cx.invalid(
            k(key),
            format!(
                "has {len} values where another of mean/std, scale, offset has {n}; give 1 or {n}"
            ),
        ));
    }
    let at = |v: &[f64], j: usize, none: f64| match v.len() {
        0 => none,
        1 => v[0],
        _ => v[j],
    };
    let mut m = Vec::with_capacity(n);
    let mut s = Vec::with_capacity(n);
    for j in 0..n {
        let scale_j = at(&scale, j, 1.0);
        // No un-normalisation: x·1 + 0 (eps is not added then).
        let (mj, sj) = if mean.is_empty() {
            (0.0, 1.0)
        } else {
            (at(&mean, j, 0.0), at(&std, j, 0.0) + eps)
        };
        m.push(mj * scale_j + at(&offset, j, 0.0));
        s.push(sj * scale_j);
    }
    Ok((m, s, 0.0))
}

/// A binding's normalisation keys as written: openpi's mean/std or LeRobot's min/max, and eps.
pub(super) struct RawNorm<'a> {
    mean: &'a [f64],
    std: &'a [f64],
    min: &'a [f64],
    max: &'a [f64],
    eps: Option<f64>,
}

impl RawNorm<'_> {
    /// Checks the keys of `{side}[{i}]` and resolves them into `(mean, std, eps)` for
    /// `(x − mean)/(std + eps)` (inputs) and `x·(std + eps) + mean` (outputs). LeRobot's
    /// MIN_MAX, `2(x − min)/d − 1` and `(x + 1)/2·d + min` with `d = max − min` (`eps` where
    /// that is 0), is the same map with `mean = min + d/2`, `std = d/2` and no epsilon.
    fn resolve(
        &self,
        cx: &Keys,
        i: usize,
        side: &str,
        allowed: &[usize],
    ) -> Result<(Vec<f64>, Vec<f64>, f64), ConfigError> {
        let k = |f: &str| format!("{side}[{i}].{f}");
        if let Some(e) = self.eps
            && (!e.is_finite() || e < 0.0)
        {
            return Err(cx.invalid(
                k("eps"),
                format!("must be finite and non-negative, got {e}"),
            ));
        }
        if self.min.is_empty() && self.max.is_empty() {
            check_norm(cx, &k("mean"), &k("std"), self.mean, self.std, allowed)?;
            let eps = self.eps.unwrap_or(1e-6);
            if side == "inputs" && self.std.iter().any(|s| s + eps <= 0.0) {
                return Err(cx.invalid(
                    k("std"),
                    "std + eps must be positive (it divides); give a positive eps or std",
                ));
            }
            return Ok((self.mean.to_vec(), self.std.to_vec(), eps));
        }
        if !self.mean.is_empty() || !self.std.is_empty() {
            return Err(cx.invalid(
                k("min"),
                "min/max (LeRobot's MIN_MAX) and mean/std are two normalisations; give one pair",
            ));
        }
        // min takes mean's checks of length and finiteness (its sign is free).
        check_norm(
            cx,
            &k("min"),
            &k("max"),
            self.min,
            &vec![0.0; self.max.len()],
            allowed,
        )?;
        if self.max.iter().any(|v| !v.is_finite()) {
            return Err(cx.invalid(k("max"), "values must be finite"));
        }
        if let Some(j) = self.min.iter().zip(self.max).position(|(lo, hi)| hi < lo) {
            return Err(cx.invalid(
                k("max"),
                format!(
                    "max[{j}] = {} is below min[{j}] = {}",
                    self.max[j], self.min[j]
                ),
            ));
        }
        let eps = self.eps.unwrap_or(1e-8);
        let half: Vec<f64> = self
            .min
            .iter()
            .zip(self.max)
            .map(|(lo, hi)| if hi == lo { eps / 2.0 } else { (hi - lo) / 2.0 })
            .collect();
        if side == "inputs" && half.iter().any(|h| *h <= 0.0) {
            return Err(cx.invalid(k("eps"), "must be positive where max == min (it divides)"));
        }
        let mid = self.min.iter().zip(&half).map(|(lo, h)| lo + h).collect();
        Ok((mid, half, 0.0))
    }
}

/// mean/std must come together, with equal lengths from `allowed` (empty: any length),
/// finite, std non-negative.
pub(super) fn check_norm(
    cx: &Keys,
    mk: &str,
    sk: &str,
    mean: &[f64],
    std: &[f64],
    allowed: &[usize],
) -> Result<(), ConfigError> {
    if mean.len() != std.len() {
        return Err(cx.invalid(
            mk,
            format!(
                "has {} values but {sk} has {}; give both with equal lengths",
                mean.len(),
                std.len()
            ),
        ));
    }
    if mean.is_empty() {
        return Ok(());
    }
    if !allowed.is_empty() && !allowed.contains(&mean.len()) {
        return Err(cx.invalid(
            mk,
            format!(
                "has {} values; give 1, one per entry of the last axis ({}), or one per element ({})",
                mean.len(),
                allowed[1],
                allowed[2]
            ),
        ));
    }
    if mean.iter().any(|v| !v.is_finite()) {
        return Err(cx.invalid(mk, "values must be finite"));
    }
    if std.iter().any(|v| !v.is_finite() || *v < 0.0) {
        return Err(cx.invalid(sk, "values must be finite and non-negative"));
    }
    Ok(())
}
