//! `[[outputs]]`: one engine output sent under one reply key: its dtype, the columns and rows
//! kept, the un-normalisation (mean/std or min/max, then a robot's own scale and offset),
//! a clip, and relative actions. Lengths against the action dimension are checked once the
//! engine is known (`crate::bind::compile`).

use super::affine::{RawNorm, check_clip};
use super::raw::{OneOrMany, RawOutput};
use crate::config::{ConfigError, Keys};
use crate::dtype::ElemType;

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

/// `[[outputs]]`: each on its own (lengths against the action dimension are checked once the
/// engine is known).
pub(in crate::config) fn outputs(
    cx: &Keys,
    outputs: &[RawOutput],
) -> Result<Vec<OutputConfig>, ConfigError> {
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
        let rows = rows(cx, i, o)?;
        check_f32_range(cx, i, o, &mean, &std, eps)?;
        let relative = relative(cx, i, o)?;
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
/// `outputs[i].rows = [start, end]`, keeping at least one row.
fn rows(cx: &Keys, i: usize, o: &RawOutput) -> Result<Option<(usize, usize)>, ConfigError> {
    let k = |f: &str| format!("outputs[{i}].{f}");
    Ok(match o.rows.as_deref() {
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
    })
}

/// The un-normalisation's coefficients within float32's range.
fn check_f32_range(
    cx: &Keys,
    i: usize,
    o: &RawOutput,
    mean: &[f64],
    std: &[f64],
    eps: f64,
) -> Result<(), ConfigError> {
    let k = |f: &str| format!("outputs[{i}].{f}");
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
    Ok(())
}

/// `outputs[i].relative_to` and `relative_mask`, as written (checked against the input once
/// the bindings are compiled).
fn relative(cx: &Keys, i: usize, o: &RawOutput) -> Result<Option<RelativeConfig>, ConfigError> {
    let k = |f: &str| format!("outputs[{i}].{f}");
    Ok(match (&o.relative_to, &o.relative_mask) {
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
    })
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
