//! A binding's wire tensor: its shape (a tokenized prompt's is `[max_tokens]`), the dtypes it
//! accepts, a fixed engine shape for symbolic dimensions, and the layout change on the way in.

use super::key;
use super::raw::{RawInput, is_text};
use super::text::TokenizerConfig;
use crate::config::{ConfigError, Keys, elements};
use crate::dtype::ElemType;

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

/// Binding `i`'s wire tensor, resolved.
pub(super) struct Wire {
    pub(super) shape: Vec<usize>,
    /// Empty for text.
    pub(super) dtypes: Vec<ElemType>,
    pub(super) layout: Layout,
    pub(super) engine_shape: Option<Vec<usize>>,
    /// Elements of the wire shape, and of its last axis (the features).
    pub(super) count: usize,
    pub(super) features: usize,
}

/// The wire shape (a tokenized prompt's: `[max_tokens]`), and that some dtype is given.
pub(super) fn shape(
    cx: &Keys,
    i: usize,
    b: &RawInput,
    tokens: Option<&TokenizerConfig>,
) -> Result<Vec<usize>, ConfigError> {
    let shape = match (&b.shape, tokens) {
        (Some(s), _) => s.clone(),
        (None, Some(t)) => vec![t.max_tokens],
        (None, None) => {
            return Err(cx.invalid(key(i, "shape"), "missing: give the expected wire shape"));
        }
    };
    if b.dtypes.is_empty() {
        return Err(cx.invalid(
            key(i, "dtypes"),
            "list at least one accepted wire dtype, e.g. [\"float32\", \"float64\"]",
        ));
    }
    Ok(shape)
}

/// The dtypes, the shape's rank and size, the engine shape and the layout.
pub(super) fn resolve(
    cx: &Keys,
    i: usize,
    b: &RawInput,
    shape: Vec<usize>,
) -> Result<Wire, ConfigError> {
    let k = |f: &str| key(i, f);
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
    Ok(Wire {
        features: *shape.last().unwrap_or(&1),
        shape,
        dtypes,
        layout,
        engine_shape: b.engine_shape.clone(),
        count,
    })
}
