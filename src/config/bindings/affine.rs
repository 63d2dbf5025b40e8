//! The affine chain: how a binding's numbers become engine units,
//! `clip(((g(x·scale + offset)) − mean) / (std + eps))`, with openpi's mean/std or LeRobot's
//! min/max (resolved into the same map), a named function `g` on some features, and whether
//! non-finite values are served. The outputs' un-normalisation shares the statistics' checks.

use super::key;
use super::raw::{OneOrMany, RawInput, RawMap, is_text};
use super::tensor::Wire;
use crate::config::{ConfigError, Keys};
use crate::transform::FeatureMap;

/// An input's affine chain, resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct Normalization {
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
    /// Clamp the normalised values to `[lo, hi]` (engine units).
    pub clip: Option<(f64, f64)>,
    /// Serve NaN and infinity instead of refusing the request (`inputs[i].allow_non_finite`).
    pub allow_non_finite: bool,
}

/// Binding `i`'s chain, its lengths against the wire tensor's features and elements.
pub(super) fn resolve(
    cx: &Keys,
    i: usize,
    b: &RawInput,
    wire: &Wire,
) -> Result<Normalization, ConfigError> {
    let k = |f: &str| key(i, f);
    let (features, count) = (wire.features, wire.count);
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
    if b.clip.is_some() && is_text(b) {
        return Err(cx.invalid(k("clip"), "applies to numeric inputs, not text"));
    }
    Ok(Normalization {
        scale,
        offset,
        map,
        mean,
        std,
        eps,
        clip: check_clip(cx, &k("clip"), b.clip.as_deref())?,
        allow_non_finite: b.allow_non_finite,
    })
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
pub(super) fn check_clip(
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

/// A binding's normalisation keys as written: openpi's mean/std or LeRobot's min/max, and eps.
pub(super) struct RawNorm<'a> {
    pub(super) mean: &'a [f64],
    pub(super) std: &'a [f64],
    pub(super) min: &'a [f64],
    pub(super) max: &'a [f64],
    pub(super) eps: Option<f64>,
}

impl RawNorm<'_> {
    /// Checks the keys of `{side}[{i}]` and resolves them into `(mean, std, eps)` for
    /// `(x − mean)/(std + eps)` (inputs) and `x·(std + eps) + mean` (outputs). LeRobot's
    /// MIN_MAX, `2(x − min)/d − 1` and `(x + 1)/2·d + min` with `d = max − min` (`eps` where
    /// that is 0), is the same map with `mean = min + d/2`, `std = d/2` and no epsilon.
    pub(super) fn resolve(
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
