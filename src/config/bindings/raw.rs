//! `[[inputs]]` and `[[outputs]]` as written: their TOML shape, deserialized with
//! `deny_unknown_fields` (so one flat struct per table: serde's `flatten` would drop that),
//! read by the facets beside this file.

use std::path::PathBuf;

use serde::Deserialize;

/// `[[inputs]]`: one observation key bound to one engine input.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(in crate::config) struct RawInput {
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
    pub(super) fn values(&self) -> Vec<T> {
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
pub(in crate::config) struct RawOutput {
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

/// Whether a binding takes a string on the wire (`dtypes = ["text"]`).
pub(super) fn is_text(b: &RawInput) -> bool {
    b.dtypes.iter().any(|d| d == "text")
}
