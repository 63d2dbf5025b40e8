//! One `[[outputs]]` entry against its engine output: the rows and columns kept, the
//! statistics' length, relative actions, the clip as bounds in reply units, and the two
//! transforms (the configured dtype for openpi's routes, float32 for vllm-omni's).

use super::relative;
use crate::bind::{OutputBinding, squeeze_to};
use crate::config::{ConfigError, OutputConfig, invalid};
use crate::dtype::ElemType;
use crate::engine::{IoSpec, describe};
use crate::transform::{Affine, Transform};

pub(super) fn compile(
    i: usize,
    o: &OutputConfig,
    io: &IoSpec,
    inputs: &mut relative::Inputs<'_>,
) -> Result<OutputBinding, ConfigError> {
    let k = |f: &str| format!("outputs[{i}].{f}");
    let index = io
        .outputs
        .iter()
        .position(|s| s.name == o.tensor)
        .ok_or_else(|| {
            invalid(
                k("tensor"),
                format!(
                    "the model has no output '{}'; its outputs are: {}",
                    o.tensor,
                    describe(&io.outputs)
                ),
            )
        })?;
    let spec = &io.outputs[index];
    let mut src_shape: Vec<usize> = squeeze_to(&spec.shape, 2).to_vec();
    let last = *src_shape.last().unwrap_or(&1);
    let cols = o.columns.unwrap_or(last);
    if cols > last {
        return Err(invalid(
            k("columns"),
            format!(
                "{cols} exceeds the last axis of output '{}' {:?}",
                spec.name, spec.shape
            ),
        ));
    }
    let mut offset = 0;
    if let Some((start, end)) = o.rows {
        let have = if src_shape.len() >= 2 {
            src_shape[0]
        } else {
            0
        };
        if end > have {
            return Err(invalid(
                k("rows"),
                format!(
                    "[{start}, {end}] exceeds the first axis of output '{}' {:?}",
                    spec.name, spec.shape
                ),
            ));
        }
        offset = start * src_shape[1..].iter().product::<usize>() * spec.dtype.size();
        src_shape[0] = end - start;
    }
    let mut shape = src_shape.clone();
    if let Some(l) = shape.last_mut() {
        *l = cols;
    }
    let total: usize = shape.iter().product();
    if !o.mean.is_empty() && ![1, cols, total].contains(&o.mean.len()) {
        return Err(invalid(
            k("mean"),
            format!(
                "has {} values; give 1, one per action dimension ({cols}), or one per element \
                 ({total})",
                o.mean.len()
            ),
        ));
    }
    let relative = match &o.relative {
        None => None,
        Some(r) => Some(relative::compile(i, r, cols, inputs)?),
    };
    let affine = Affine::unnormalize(&o.mean, &o.std, o.eps);
    let src_shape = if src_shape.is_empty() {
        vec![1]
    } else {
        src_shape
    };
    Ok(OutputBinding {
        key: o.key.clone(),
        index,
        configured: Transform::first_columns(spec.dtype, o.dtype, &src_shape, cols, affine.clone()),
        float32: Transform::first_columns(
            spec.dtype,
            ElemType::F32,
            &src_shape,
            cols,
            affine.clone(),
        ),
        shape: if shape.is_empty() { vec![1] } else { shape },
        offset,
        relative,
        clamp: o.clip.map(|c| clamp(&affine, c)),
    })
}

/// The engine's values clamped to `[lo, hi]` before un-normalising are the un-normalised
/// values clamped to the mapped bounds, per column (the map is monotone in each).
fn clamp(affine: &Affine, (lo, hi): (f64, f64)) -> Vec<(f64, f64)> {
    let (a, b) = match affine {
        Affine::Scalar { a, b } => (vec![*a], vec![*b]),
        // An output's un-normalisation has no feature maps.
        Affine::Indexed { a, b } | Affine::Mapped { a, b, .. } => (a.clone(), b.clone()),
    };
    a.iter()
        .zip(&b)
        .map(|(a, b)| {
            let (x, y) = (a * lo + b, a * hi + b);
            (x.min(y), x.max(y))
        })
        .collect()
}
