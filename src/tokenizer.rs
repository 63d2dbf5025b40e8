//! What token ids does a prompt become? openpi's `PaligemmaTokenizer.tokenize`, in Rust: the
//! prompt cleaned as openpi cleans it, laid out in the policy's format (`pi0`, `pi05` with the
//! discretised state, or `plain`), encoded by a SentencePiece `.model` or a Hugging Face
//! `tokenizer.json` through kitoken (pure Rust, so the aarch64 build needs no C++ SentencePiece),
//! then cut to the engine's length. The bindings (`bind`) cache the result per session; this
//! module is the pure function they call when a prompt changes.

use kitoken::{Definition, Kitoken, SpecialTokenKind};

/// Bins of the pi0.5 state: openpi's `np.linspace(-1, 1, 256 + 1)[:-1]`.
pub const STATE_BINS: usize = 256;

/// openpi's example prompts (LIBERO, DROID, ALOHA), which `check-config` tokenizes to show
/// how much of `max_tokens` a typical prompt takes.
pub const SAMPLE_PROMPTS: &[&str] = &[
    "put both the alphabet soup and the tomato sauce in the basket",
    "put the black bowl in the bottom drawer of the cabinet and close it",
    "pick up the book and place it in the back compartment of the caddy",
    "turn on the stove and put the moka pot on it",
    "Put the marker in the cup",
    "fold the towel",
];

/// How the prompt is laid out before encoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// openpi pi0: `encode(cleaned, add_bos=True) + encode("\n")`.
    Pi0,
    /// openpi pi0.5: `encode(f"Task: {cleaned}, State: {bins};\nAction: ", add_bos=True)`.
    Pi05,
    /// BOS (if the tokenizer has one) + `encode(prompt)`, the prompt as sent.
    Plain,
    /// LeRobot's pi0 and SmolVLA preprocessors: their newline step ends the task with a newline
    /// (unless it has one), then the tokenizer encodes it whole, uncleaned, with BOS if the
    /// tokenizer adds one: `encode(prompt + "\n")`.
    Lerobot,
    /// GR00T N1.7 (`formalize_language`): the task lowercased and cut to alphanumerics,
    /// whitespace and `_` ([`groot_task`]), encoded between the chat template's fixed ids
    /// ([`Around`], the image block included).
    Groot,
    /// GR00T N1.7 without `formalize_language`: the task as sent, between the template's ids.
    GrootRaw,
}

impl Format {
    pub fn from_name(s: &str) -> Option<Format> {
        match s {
            "pi0" => Some(Format::Pi0),
            "pi05" => Some(Format::Pi05),
            "plain" => Some(Format::Plain),
            "lerobot" => Some(Format::Lerobot),
            "groot" => Some(Format::Groot),
            "groot_raw" => Some(Format::GrootRaw),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Format::Pi0 => "pi0",
            Format::Pi05 => "pi05",
            Format::Plain => "plain",
            Format::Lerobot => "lerobot",
            Format::Groot => "groot",
            Format::GrootRaw => "groot_raw",
        }
    }

    /// GR00T's formats put the prompt between fixed ids (`prefix_ids`, `suffix_ids`).
    pub fn is_groot(self) -> bool {
        matches!(self, Format::Groot | Format::GrootRaw)
    }
}

/// Fixed token ids around the encoded prompt: a chat template's, rendered once by the
/// exporter (GR00T: `<|im_start|>user\n`, one image block per camera, then after the task
/// `<|im_end|>\n`). Empty for the other formats.
#[derive(Clone, Copy, Debug, Default)]
pub struct Around<'a> {
    pub before: &'a [u32],
    pub after: &'a [u32],
}

impl Around<'_> {
    pub const NONE: Around<'static> = Around {
        before: &[],
        after: &[],
    };
}

/// Why a tokenizer file could not be used, or a prompt not encoded.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(
        "is neither a SentencePiece model nor a Hugging Face tokenizer.json ({sentencepiece}; {json})"
    )]
    Unreadable { sentencepiece: String, json: String },
    #[error("is a tokenizer.json, which has no BOS of its own: {0}")]
    Bos(String),
    #[error("cannot encode the prompt: {0}")]
    Encode(String),
}

/// A loaded tokenizer.
#[derive(Debug)]
pub struct Tokenizer {
    inner: Kitoken,
    /// The id put first (openpi's `add_bos=True`), if any.
    bos: Option<u32>,
    /// `encode("\n")`, pi0's "start of answer".
    newline: Vec<u32>,
    /// The `▁` piece, when the model adds a dummy prefix (see [`Tokenizer::encode`]).
    space: Option<u32>,
    /// One past the largest id it can produce.
    vocab: usize,
    /// Bytes of the longest piece (a token never covers more prompt bytes than this).
    longest_piece: usize,
    /// `"sentencepiece"` or `"tokenizer.json"`.
    kind: &'static str,
    /// The special tokens matched in prompt text.
    matched: &'static [SpecialTokenKind],
}

/// The special tokens matched in prompt text. SentencePiece: its user-defined symbols, none of
/// its control or unknown ones (`<s>` typed in a prompt is text, as in `sentencepiece`).
const SENTENCEPIECE_MATCHED: &[SpecialTokenKind] = &[SpecialTokenKind::Priority];
/// tokenizer.json: every added token, as `tokenizers` matches them even without
/// `add_special_tokens`.
const JSON_MATCHED: &[SpecialTokenKind] = &[
    SpecialTokenKind::Control,
    SpecialTokenKind::Priority,
    SpecialTokenKind::Unknown,
];

impl Tokenizer {
    /// Loads a SentencePiece `.model` (protobuf) or a Hugging Face `tokenizer.json` (JSON, by
    /// its first byte). `bos` names the BOS token of a tokenizer.json (SentencePiece models
    /// carry theirs).
    pub fn load(bytes: &[u8], bos: Option<&str>) -> Result<Tokenizer, TokenizerError> {
        // kitoken's converters are not hardened against every malformed file (an empty
        // vocabulary panicked): a file that makes them panic is refused, not fatal.
        std::panic::catch_unwind(|| Self::load_unguarded(bytes, bos)).unwrap_or_else(|_| {
            Err(TokenizerError::Unreadable {
                sentencepiece: "the parser failed on it".into(),
                json: "the parser failed on it".into(),
            })
        })
    }

    fn load_unguarded(bytes: &[u8], bos: Option<&str>) -> Result<Tokenizer, TokenizerError> {
        let is_json = bytes
            .iter()
            .find(|b| !b.is_ascii_whitespace())
            .is_some_and(|&b| b == b'{');
        let mut dummy_prefix = false;
        // The trainer's bos_id (`encode(add_bos=True)` adds it unless it is -1).
        let mut sentencepiece_bos = None;
        let (def, kind) = if is_json {
            let def = Definition::from_tokenizers_slice(bytes).map_err(|e| {
                TokenizerError::Unreadable {
                    sentencepiece: "it is JSON".into(),
                    json: e.to_string(),
                }
            })?;
            (def, "tokenizer.json")
        } else {
            let unreadable = |e: String| TokenizerError::Unreadable {
                sentencepiece: e,
                json: "it is not JSON".into(),
            };
            let mut proto = sentencepiece_model::SentencePieceModel::from_slice(bytes)
                .map_err(|e| unreadable(e.to_string()))?
                .model()
                .clone();
            // SentencePiece normalises with the model's precompiled character map whatever
            // the normaliser's name; kitoken re-implements the named ones (its `nmt_nfkc`
            // leaves tabs alone), so hand it the map itself.
            if let Some(n) = proto.normalizer_spec.as_mut()
                && !n.precompiled_charsmap().is_empty()
            {
                n.name = Some("user_defined".into());
            }
            sentencepiece_bos = proto
                .trainer_spec
                .as_ref()
                .and_then(|t| u32::try_from(t.bos_id()).ok());
            dummy_prefix = proto
                .normalizer_spec
                .as_ref()
                .is_some_and(|n| n.add_dummy_prefix());
            let def =
                Definition::from_sentencepiece_slice(&prost013::Message::encode_to_vec(&proto))
                    .map_err(|e| unreadable(e.to_string()))?;
            (def, "sentencepiece")
        };
        // SentencePiece encodes text that normalises to nothing (whitespace, with whitespace
        // folded) as no tokens; kitoken adds the dummy prefix anyway.
        let space = def
            .model
            .vocab()
            .iter()
            .find(|t| t.bytes == "\u{2581}".as_bytes())
            .map(|t| t.id)
            .filter(|_| dummy_prefix);
        if def.model.vocab().is_empty() {
            return Err(TokenizerError::Unreadable {
                sentencepiece: "it has no pieces".into(),
                json: "it has no vocabulary".into(),
            });
        }
        let vocab = def
            .model
            .vocab()
            .iter()
            .map(|t| t.id)
            .chain(def.specials.iter().map(|s| s.id))
            // kitoken's placeholder for "no id".
            .filter(|&id| id != u32::MAX)
            .map(|id| id as usize + 1)
            .max()
            .unwrap_or(0);
        let longest_piece = def
            .model
            .vocab()
            .iter()
            .map(|t| t.bytes.len())
            .max()
            .unwrap_or(1)
            .max(1);
        let bos =
            match (kind, bos) {
                ("sentencepiece", None) => sentencepiece_bos,
                (_, None) => None,
                (_, Some(name)) => {
                    let found = def
                        .specials
                        .iter()
                        .find(|s| s.bytes == name.as_bytes())
                        .map(|s| s.id)
                        .or_else(|| {
                            def.model
                                .vocab()
                                .iter()
                                .find(|t| t.bytes == name.as_bytes())
                                .map(|t| t.id)
                        });
                    Some(found.ok_or_else(|| {
                        TokenizerError::Bos(format!("it has no token \"{name}\""))
                    })?)
                }
            };
        let inner = Kitoken::from_definition(def).map_err(|e| TokenizerError::Unreadable {
            sentencepiece: e.to_string(),
            json: e.to_string(),
        })?;
        let mut tokenizer = Tokenizer {
            inner,
            bos,
            newline: Vec::new(),
            space,
            vocab,
            longest_piece,
            kind,
            matched: if is_json {
                JSON_MATCHED
            } else {
                SENTENCEPIECE_MATCHED
            },
        };
        tokenizer.newline = tokenizer.encode("\n")?;
        Ok(tokenizer)
    }

    /// `encode(text)` as SentencePiece (or `tokenizers`) gives it, without BOS.
    fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = self
            .inner
            .encode(text, self.matched)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        if ids.len() == 1 && Some(ids[0]) == self.space {
            let mut normalized = std::borrow::Cow::Borrowed(text);
            self.inner
                .config()
                .normalize(&mut normalized, 0..usize::MAX);
            if normalized == "\u{2581}" {
                ids.clear();
            }
        }
        Ok(ids)
    }

    /// One past the largest token id.
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// Bytes of the longest piece in the vocabulary.
    pub fn longest_piece(&self) -> usize {
        self.longest_piece
    }

    /// `"sentencepiece"` or `"tokenizer.json"`.
    pub fn kind(&self) -> &'static str {
        self.kind
    }

    /// The BOS id, if the tokenizer adds one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// Encodes `prompt` in `format` into `out` (cleared first), untruncated. `bins` is the
    /// discretised state, for `pi05`.
    pub fn tokenize(
        &self,
        format: Format,
        prompt: &str,
        bins: &[i16],
        around: Around<'_>,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        out.clear();
        out.extend(self.bos);
        out.extend_from_slice(around.before);
        let encode = |text: &str, out: &mut Vec<u32>| {
            out.extend_from_slice(&self.encode(text)?);
            Ok::<(), TokenizerError>(())
        };
        match format {
            Format::Pi0 => {
                encode(&clean(prompt), out)?;
                out.extend_from_slice(&self.newline);
            }
            Format::Pi05 => {
                use std::fmt::Write;
                let mut text = String::with_capacity(prompt.len() + 32 + 4 * bins.len());
                let _ = write!(text, "Task: {}, State: ", clean(prompt));
                for (i, b) in bins.iter().enumerate() {
                    let sep = if i == 0 { "" } else { " " };
                    let _ = write!(text, "{sep}{b}");
                }
                text.push_str(";\nAction: ");
                encode(&text, out)?;
            }
            Format::Plain => encode(prompt, out)?,
            Format::Lerobot if prompt.ends_with('\n') => encode(prompt, out)?,
            Format::Lerobot => encode(&format!("{prompt}\n"), out)?,
            Format::Groot => encode(&groot_task(prompt, true), out)?,
            Format::GrootRaw => encode(&groot_task(prompt, false), out)?,
        }
        out.extend_from_slice(around.after);
        Ok(())
    }
}

/// GR00T N1.7's task text (`prepare_n1_7_language_batch`, run twice by LeRobot: formalised by
/// the pack step, as is by the encode step). An empty task is "Perform the task." (formalised:
/// "perform the task"); a task that cleans to nothing is "Perform the task.", unformalised.
/// Formalising is Python's `str.lower()` and a filter on `isalnum() or isspace() or == "_"`;
/// Rust's `char::is_alphanumeric` also takes the few combining marks Unicode calls alphabetic
/// (some Indic vowel signs), which Python's `isalpha` does not.
pub fn groot_task(prompt: &str, formalize: bool) -> String {
    const DEFAULT: &str = "Perform the task.";
    let text = if prompt.is_empty() { DEFAULT } else { prompt };
    if !formalize {
        return text.to_string();
    }
    let space = |c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c);
    let cleaned: String = text
        .to_lowercase()
        .chars()
        .filter(|&c| c.is_alphanumeric() || space(c) || c == '_')
        .collect();
    if cleaned.is_empty() {
        DEFAULT.to_string()
    } else {
        cleaned
    }
}

/// openpi's `prompt.strip().replace("_", " ").replace("\n", " ")`. Python's `strip()` removes
/// what `str.isspace` calls whitespace: Unicode's White_Space plus the separators U+001C..U+001F.
pub fn clean(prompt: &str) -> String {
    let space = |c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c);
    prompt
        .trim_matches(space)
        .chars()
        .map(|c| if c == '_' || c == '\n' { ' ' } else { c })
        .collect()
}

/// The pi0.5 bin of one normalised state value, openpi's
/// `np.digitize(x, np.linspace(-1, 1, 257)[:-1]) - 1`: -1 below -1, 255 from 1 - 1/128 up.
/// The edges -1 + i/128 are exact in binary, so counting them is exact too.
pub fn state_bin(x: f64) -> i16 {
    if x.is_nan() {
        // numpy: NaN compares false with every edge and sorts past them all.
        return STATE_BINS as i16 - 1;
    }
    // The last edge at or below x: a guess from (x + 1)·128, which can round across an edge,
    // then corrected against the exact edges.
    let edge = |k: i32| -1.0 + f64::from(k) / 128.0;
    let last = STATE_BINS as i32 - 1;
    let mut k = ((x + 1.0) * 128.0).floor().clamp(-1.0, f64::from(last)) as i32;
    while k >= 0 && edge(k) > x {
        k -= 1;
    }
    while k < last && edge(k + 1) <= x {
        k += 1;
    }
    k as i16
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Python's `prepare_n1_7_language_batch` on these (formalised, then as is), printed by
    /// python3: `str.lower()` and the `isalnum/isspace/_` filter, Unicode included.
    #[test]
    fn groot_tasks_are_cleaned_as_python_cleans_them() {
        for (task, want) in [
            ("Pick up the RED cube!", "pick up the red cube"),
            ("put_it\tthere, then stop.", "put_it\tthere then stop"),
            ("ÖFFNE die Tür (bitte)", "öffne die tür bitte"),
            ("ΟΔΟΣ", "οδος"),
            ("x\u{1c}y", "x\u{1c}y"),
            ("", "perform the task"),
            ("...", "Perform the task."),
        ] {
            assert_eq!(groot_task(task, true), want, "{task:?}");
        }
        assert_eq!(groot_task("Pick!", false), "Pick!");
        assert_eq!(groot_task("", false), "Perform the task.");
    }

    #[test]
    fn state_bins_follow_numpy_digitize() {
        assert_eq!(state_bin(-1.5), -1);
        assert_eq!(state_bin(-1.0), 0);
        assert_eq!(state_bin(-1.0 + 1.0 / 128.0 - 1e-12), 0);
        assert_eq!(state_bin(-1.0 + 1.0 / 128.0), 1);
        assert_eq!(state_bin(0.0), 128);
        assert_eq!(state_bin(1.0 - 1.0 / 128.0), 255);
        assert_eq!(state_bin(1.0), 255);
        assert_eq!(state_bin(7.0), 255);
        assert_eq!(state_bin(f64::NAN), 255);
        assert_eq!(state_bin(f64::NEG_INFINITY), -1);
        assert_eq!(state_bin(f64::INFINITY), 255);
        // (x + 1)·128 rounds up to the edge 192 here; x is below it.
        assert_eq!(state_bin(0.5f64.next_down()), 191);
        assert_eq!(state_bin(0.5), 192);
        // Every edge, and the doubles either side of it, against a plain count of edges.
        for i in 0..STATE_BINS {
            let e = -1.0 + i as f64 / 128.0;
            for x in [e.next_down(), e, e.next_up()] {
                let count = (0..STATE_BINS)
                    .filter(|&j| -1.0 + j as f64 / 128.0 <= x)
                    .count();
                assert_eq!(state_bin(x), count as i16 - 1, "x = {x:e}");
            }
        }
    }

    #[test]
    fn prompts_are_cleaned_as_python_strips_them() {
        assert_eq!(clean("  pick_up\nthe block \t"), "pick up the block");
        assert_eq!(clean("\u{1c}\u{85}\u{a0}x\u{3000}"), "x");
        assert_eq!(
            clean("a\u{200b}"),
            "a\u{200b}",
            "U+200B is not whitespace to Python"
        );
        assert_eq!(clean(""), "");
    }

    #[test]
    fn garbage_is_not_a_tokenizer() {
        for bad in [&b"not a model"[..], b"{\"model\": 3}", b""] {
            let e = Tokenizer::load(bad, None).unwrap_err().to_string();
            assert!(
                e.contains("SentencePiece") && e.contains("tokenizer.json"),
                "{e}"
            );
        }
    }
}
