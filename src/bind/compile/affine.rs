//! An input's affine chain compiled: one [`Affine`], a transform per accepted wire dtype
//! (elementwise, or permuted by the layout), a transform per storage type for one-element
//! inputs, and the clip, which needs a float engine input.

use super::shape::Frame;
use crate::config::{ConfigError, InputConfig, invalid};
use crate::dtype::{ALL_ELEM_TYPES, ElemType};
use crate::engine::TensorSpec;
use crate::transform::{Affine, Transform};

/// One scale and offset with at most one statistic, or per-element statistics (the config
/// allows neither with a list of scales or a map): the scalar form, which vectorises.
/// Otherwise, coefficients per feature.
pub(super) fn chain(b: &InputConfig) -> Affine {
    let n = &b.norm;
    let features = *b.shape.last().unwrap_or(&1);
    match (&n.scale[..], &n.offset[..], &n.map) {
        (&[scale], &[offset], None) if n.mean.len() <= 1 || n.mean.len() > features => {
            Affine::normalize(scale, offset, &n.mean, &n.std, n.eps)
        }
        (scale, offset, map) => Affine::per_feature(
            features,
            scale,
            offset,
            &n.mean,
            &n.std,
            n.eps,
            map.as_ref().map(|(g, c)| (*g, &c[..])),
        ),
    }
}

/// Each accepted wire dtype with its transform into the engine's.
pub(super) fn accepted(
    b: &InputConfig,
    spec: &TensorSpec,
    frame: &Frame,
    affine: &Affine,
) -> Vec<(ElemType, Transform)> {
    b.dtypes()
        .iter()
        .map(|&t| {
            let tr = if frame.is_identity() {
                Transform::elementwise(t, spec.dtype, frame.elements, affine.clone())
            } else {
                Transform::permuted(t, spec.dtype, &b.shape, &frame.perm, affine.clone())
            };
            (t, tr)
        })
        .collect()
}

/// For a one-element numeric input, a transform from every storage type (scalars travel as
/// native msgpack numbers of any type); empty otherwise.
pub(super) fn scalar(b: &InputConfig, spec: &TensorSpec, affine: &Affine) -> Vec<Transform> {
    if spec.elements() != 1 || b.is_text() {
        return Vec::new();
    }
    ALL_ELEM_TYPES
        .iter()
        .map(|&t| Transform::elementwise(t, spec.dtype, 1, affine.clone()))
        .collect()
}

/// `inputs[i].clip`, on a float32 or float64 engine input.
pub(super) fn clip(
    i: usize,
    b: &InputConfig,
    spec: &TensorSpec,
) -> Result<Option<(f64, f64)>, ConfigError> {
    match (b.norm.clip, spec.dtype) {
        (None, _) => Ok(None),
        (Some(c), ElemType::F32 | ElemType::F64) => Ok(Some(c)),
        (Some(_), t) => Err(invalid(
            format!("inputs[{i}].clip"),
            format!(
                "model input '{}' is {t}; clip applies to float32 or float64 inputs",
                spec.name
            ),
        )),
    }
}
