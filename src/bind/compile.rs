//! Does a policy's config fit its engine? Compiling its bindings: every `[[inputs]]`/`[[outputs]]`
//! entry checked against the engine's I/O (names, dtypes, shapes, layouts, normalisation) and
//! turned into transforms.

use super::{InputBinding, OutputBinding, Plan, PlannerTap, squeeze_to};
use crate::config::{Config, ConfigError, PolicySpec, invalid};
use crate::dtype::ElemType;
use crate::engine::{IoSpec, TensorSpec};
use crate::protocol::{self, Encoder, Limits};
use crate::transform::{Affine, Transform};

/// Checks `[planner]`'s bindings against the compiled inputs.
fn planner_tap(cfg: &Config, inputs: &[InputBinding]) -> Result<Option<PlannerTap>, ConfigError> {
    let p = &cfg.planner;
    if !p.enabled {
        return Ok(None);
    }
    let keys = || {
        inputs
            .iter()
            .map(|b| format!("\"{}\"", b.key))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let prompt = inputs
        .iter()
        .position(|b| b.key == p.prompt_key)
        .ok_or_else(|| {
            invalid(
                "planner.prompt_key",
                format!(
                    "no input binding has key \"{}\" (the inputs are {})",
                    p.prompt_key,
                    keys()
                ),
            )
        })?;
    if !inputs[prompt].text {
        return Err(invalid(
            "planner.prompt_key",
            format!(
                "\"{}\" is not a text binding (dtypes = [\"text\"]): the subtask is a string",
                p.prompt_key
            ),
        ));
    }
    // The text binding's bytes (for a tokenized prompt, its host buffer's).
    let max_subtask = inputs[prompt].shape.iter().product();
    let (camera, geometry) = match &p.camera {
        None => (None, None),
        Some(key) => {
            let i = inputs.iter().position(|b| &b.key == key).ok_or_else(|| {
                invalid(
                    "planner.camera",
                    format!(
                        "no input binding has key \"{key}\" (the inputs are {})",
                        keys()
                    ),
                )
            })?;
            let b = &inputs[i];
            let g = crate::planner::Geometry::of(&b.shape);
            let u8_ok = b.accepted.iter().any(|(t, _)| *t == ElemType::U8);
            match g {
                Some(g) if u8_ok && !b.text => (Some(i), Some(g)),
                _ => {
                    return Err(invalid(
                        "planner.camera",
                        format!(
                            "\"{key}\" must be an image binding that accepts uint8, shaped \
                             [H, W, C] or [C, H, W] with 1, 3 or 4 channels (got shape {:?})",
                            b.shape
                        ),
                    ));
                }
            }
        }
    };
    Ok(Some(PlannerTap {
        prompt,
        camera,
        geometry,
        max_subtask,
    }))
}

impl Plan {
    /// Checks `policy`'s bindings against the engine's I/O and compiles them; `cfg` gives the
    /// request limits and, for the default policy, the planner's bindings.
    pub fn compile(cfg: &Config, policy: &PolicySpec, io: &IoSpec) -> Result<Plan, ConfigError> {
        let names = crate::engine::describe;
        io.check_sizes().map_err(|m| invalid("engine.model", m))?;
        let mut inputs = Vec::new();
        let mut host_buffers = Vec::new();
        let mut tokens = None;
        // Slot buffers past the engine's inputs, each with the spec the binding checks against.
        let mut host_spec = |bytes: usize, spec: TensorSpec| {
            host_buffers.push(bytes);
            (io.inputs.len() + host_buffers.len() - 1, spec)
        };
        for (i, b) in policy.inputs.iter().enumerate() {
            let k = |f: &str| format!("inputs[{i}].{f}");
            let tensor_index = |name: &str| {
                io.inputs
                    .iter()
                    .position(|s| s.name == name)
                    .ok_or_else(|| {
                        invalid(
                            k("tensor"),
                            format!(
                                "the model has no input '{name}'; its inputs are: {}",
                                names(&io.inputs)
                            ),
                        )
                    })
            };
            let mut token_binding = None;
            let (index, spec) = match (&b.tensor, b.tokenizer()) {
                (Some(name), Some(t)) => {
                    let ids = tensor_index(name)?;
                    let states = t
                        .state_keys
                        .iter()
                        .filter_map(|key| policy.inputs.iter().position(|s| &s.key == key))
                        .collect();
                    let tb = super::tokens::compile(i, t, &io.inputs, ids, states)?;
                    let bytes = tb.prompt_bytes;
                    token_binding = Some(tb);
                    tokens = Some(i);
                    host_spec(
                        bytes,
                        TensorSpec {
                            name: format!("{} (prompt text)", b.key),
                            dtype: ElemType::U8,
                            shape: vec![bytes],
                        },
                    )
                }
                (Some(name), None) => {
                    let index = tensor_index(name)?;
                    (index, io.inputs[index].clone())
                }
                // A pi0.5 state only the prompt reads: normalised into float32, as openpi
                // discretises it.
                (None, _) => host_spec(
                    b.shape.iter().product::<usize>() * 4,
                    TensorSpec {
                        name: format!("{} (prompt state)", b.key),
                        dtype: ElemType::F32,
                        shape: b.shape.clone(),
                    },
                ),
            };
            let spec = &spec;
            let rank = b.shape.len();
            let mut perm: Vec<usize> = (0..rank).collect();
            if let Some(p) = b.layout.perm() {
                for (j, &pj) in p.iter().enumerate() {
                    perm[rank - 3 + j] = rank - 3 + pj;
                }
            }
            let mut seen_by_engine: Vec<usize> = perm.iter().map(|&p| b.shape[p]).collect();
            if b.history > 1 {
                seen_by_engine.insert(0, b.history);
            }
            let engine_rank = seen_by_engine.len();
            if token_binding.is_none()
                && squeeze_to(&spec.shape, engine_rank) != seen_by_engine.as_slice()
            {
                return Err(invalid(
                    k("shape"),
                    format!(
                        "wire shape {:?}{} does not match model input '{}' of shape {:?}",
                        b.shape,
                        if b.history > 1 {
                            format!(" (with history = {}: {seen_by_engine:?})", b.history)
                        } else if b.layout.perm().is_some() {
                            format!(" (after layout: {seen_by_engine:?})")
                        } else {
                            String::new()
                        },
                        spec.name,
                        spec.shape
                    ),
                ));
            }
            if b.is_text() && matches!(spec.dtype, ElemType::Bool | ElemType::F16) {
                return Err(invalid(
                    k("tensor"),
                    format!(
                        "text goes into an integer or float input; '{}' is {}",
                        spec.name, spec.dtype
                    ),
                ));
            }
            // One scale and offset with at most one statistic, or per-element statistics (the
            // config allows neither with a list of scales or a map): the scalar form, which
            // vectorises. Otherwise, coefficients per feature.
            let features = *b.shape.last().unwrap_or(&1);
            let affine = match (&b.scale[..], &b.offset[..], &b.map) {
                (&[scale], &[offset], None) if b.mean.len() <= 1 || b.mean.len() > features => {
                    Affine::normalize(scale, offset, &b.mean, &b.std, b.eps)
                }
                (scale, offset, map) => Affine::per_feature(
                    features,
                    scale,
                    offset,
                    &b.mean,
                    &b.std,
                    b.eps,
                    map.as_ref().map(|(g, c)| (*g, &c[..])),
                ),
            };
            let inputs_affine = affine.clone();
            let frame_elements = spec.elements() / b.history;
            let accepted = b
                .dtypes()
                .iter()
                .map(|&t| {
                    let tr = if perm.iter().enumerate().all(|(j, &p)| j == p) {
                        Transform::elementwise(t, spec.dtype, frame_elements, affine.clone())
                    } else {
                        Transform::permuted(t, spec.dtype, &b.shape, &perm, affine.clone())
                    };
                    (t, tr)
                })
                .collect();
            let present = match &b.present_tensor {
                None => None,
                Some(name) => {
                    let at = io
                        .inputs
                        .iter()
                        .position(|s| &s.name == name)
                        .ok_or_else(|| {
                            invalid(
                                k("present_tensor"),
                                format!(
                                    "the model has no input '{name}'; its inputs are: {}",
                                    names(&io.inputs)
                                ),
                            )
                        })?;
                    let taken = policy.inputs.iter().any(|o| {
                        o.tensor.as_deref() == Some(name.as_str())
                            || o.tokenizer().is_some_and(|t| &t.mask_tensor == name)
                    }) || policy.inputs[..i]
                        .iter()
                        .any(|o| o.present_tensor.as_ref() == Some(name));
                    if taken {
                        return Err(invalid(
                            k("present_tensor"),
                            format!("model input '{name}' is already fed by another binding"),
                        ));
                    }
                    let p = &io.inputs[at];
                    if p.elements() != 1 {
                        return Err(invalid(
                            k("present_tensor"),
                            format!(
                                "model input '{name}' has shape {:?}; a presence flag is one \
                                 element",
                                p.shape
                            ),
                        ));
                    }
                    Some((at, p.dtype))
                }
            };
            inputs.push(InputBinding {
                key: b.key.clone(),
                index,
                accepted,
                shape: if token_binding.is_some() {
                    spec.shape.clone()
                } else {
                    b.shape.clone()
                },
                engine_type: spec.dtype,
                affine,
                optional: b.optional,
                fill: if token_binding.is_some() { 0.0 } else { b.fill },
                present,
                text: b.is_text(),
                tokens: token_binding,
                check_finite: !b.allow_non_finite && !b.is_text(),
                scalar: if spec.elements() == 1 && !b.is_text() {
                    let affine = &inputs_affine;
                    crate::dtype::ALL_ELEM_TYPES
                        .iter()
                        .map(|&t| Transform::elementwise(t, spec.dtype, 1, affine.clone()))
                        .collect()
                } else {
                    Vec::new()
                },
                history: b.history,
                frame_bytes: frame_elements * spec.dtype.size(),
                raw: None,
                clip: match (b.clip, spec.dtype) {
                    (None, _) => None,
                    (Some(c), ElemType::F32 | ElemType::F64) => Some(c),
                    (Some(_), t) => {
                        return Err(invalid(
                            k("clip"),
                            format!(
                                "model input '{}' is {t}; clip applies to float32 or float64 \
                                 inputs",
                                spec.name
                            ),
                        ));
                    }
                },
            });
        }
        for spec in &io.inputs {
            let bound = policy.inputs.iter().any(|b| {
                b.tensor.as_deref() == Some(spec.name.as_str())
                    || b.tokenizer().is_some_and(|t| t.mask_tensor == spec.name)
                    || b.present_tensor.as_deref() == Some(spec.name.as_str())
            });
            if !bound {
                return Err(invalid(
                    "inputs",
                    format!(
                        "model input '{}' {} {:?} has no [[inputs]] binding; every model input needs one",
                        spec.name, spec.dtype, spec.shape
                    ),
                ));
            }
        }

        let mut outputs = Vec::new();
        // Relative actions: one input, kept as sent (float64) in a slot buffer of its own.
        let mut relative_source: Option<(usize, usize)> = None;
        for (i, o) in policy.outputs.iter().enumerate() {
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
                            names(&io.outputs)
                        ),
                    )
                })?;
            let spec = &io.outputs[index];
            let src_shape: Vec<usize> = squeeze_to(&spec.shape, 2).to_vec();
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
            let mut src_shape = src_shape;
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
                        "has {} values; give 1, one per action dimension ({cols}), or one per element ({total})",
                        o.mean.len()
                    ),
                ));
            }
            let relative = match &o.relative {
                None => None,
                Some(r) => {
                    let Some(bi) = inputs.iter().position(|b| b.key == r.key) else {
                        let keys: Vec<&str> = inputs.iter().map(|b| b.key.as_str()).collect();
                        return Err(invalid(
                            k("relative_to"),
                            format!(
                                "no [[inputs]] binding has key \"{}\"; the keys are: {}",
                                r.key,
                                keys.join(", ")
                            ),
                        ));
                    };
                    let b = &inputs[bi];
                    if b.text || b.optional || b.shape.len() != 1 {
                        return Err(invalid(
                            k("relative_to"),
                            format!(
                                "input \"{}\" must be a required numeric vector (shape [n]), \
                                 the state the actions are relative to",
                                r.key
                            ),
                        ));
                    }
                    let n = b.shape[0];
                    let mask = match &r.mask {
                        Some(m) => m.clone(),
                        None if n >= cols => vec![true; cols],
                        None => {
                            return Err(invalid(
                                k("relative_to"),
                                format!(
                                    "input \"{}\" has {n} values for {cols} action columns: \
                                     give relative_mask for the first {n} or fewer",
                                    r.key
                                ),
                            ));
                        }
                    };
                    if mask.len() > cols.min(n) {
                        return Err(invalid(
                            k("relative_mask"),
                            format!(
                                "has {} entries; at most one per action column ({cols}) and per \
                                 value of input \"{}\" ({n})",
                                mask.len(),
                                r.key
                            ),
                        ));
                    }
                    match relative_source {
                        Some((source, _)) if source != bi => {
                            return Err(invalid(
                                k("relative_to"),
                                format!(
                                    "\"{}\": every relative output must be relative to the same \
                                     input (\"{}\")",
                                    r.key, inputs[source].key
                                ),
                            ));
                        }
                        Some(_) => {}
                        None => {
                            let index = io.inputs.len() + host_buffers.len();
                            host_buffers.push(n * 8);
                            inputs[bi].raw = Some(index);
                            relative_source = Some((bi, index));
                        }
                    }
                    Some(super::Relative { mask })
                }
            };
            let affine = Affine::unnormalize(&o.mean, &o.std, o.eps);
            let clamp = o.clip.map(|(lo, hi)| {
                let (a, b) = match &affine {
                    Affine::Scalar { a, b } => (vec![*a], vec![*b]),
                    // An output's un-normalisation has no feature maps.
                    Affine::Indexed { a, b } | Affine::Mapped { a, b, .. } => {
                        (a.clone(), b.clone())
                    }
                };
                a.iter()
                    .zip(&b)
                    .map(|(a, b)| {
                        let (x, y) = (a * lo + b, a * hi + b);
                        (x.min(y), x.max(y))
                    })
                    .collect()
            });
            let src_shape = if src_shape.is_empty() {
                vec![1]
            } else {
                src_shape
            };
            let shape = if shape.is_empty() { vec![1] } else { shape };
            outputs.push(OutputBinding {
                key: o.key.clone(),
                index,
                openpi: Transform::first_columns(
                    spec.dtype,
                    o.dtype,
                    &src_shape,
                    cols,
                    affine.clone(),
                ),
                vllm: Transform::first_columns(spec.dtype, ElemType::F32, &src_shape, cols, affine),
                shape,
                offset,
                relative,
                clamp,
            });
        }
        check_vllm_metadata(policy, &outputs)?;

        let mut metadata = Vec::new();
        protocol::encode_toml(
            &mut Encoder { buf: &mut metadata },
            &toml::Value::Table(policy.metadata.clone()),
        );
        let horizon = outputs
            .iter()
            .find(|o| o.shape.len() >= 2)
            .map_or(1, |o| o.shape[0]);
        let scratch_bytes = outputs
            .iter()
            .map(|o| o.openpi.dst_bytes().max(o.vllm.dst_bytes()))
            .max()
            .unwrap_or(0);
        // Map header, timing, `delay_steps`, and an `observe` push's extra keys with its two
        // [H] arrays of timesteps and timestamps.
        let push_extras = 64 + 2 * Encoder::ndarray_size(&[horizon], 8 * horizon);
        let reply_capacity = 16
            + protocol::TIMING_SIZE
            + push_extras
            + outputs
                .iter()
                .map(|o| {
                    5 + o.key.len()
                        + Encoder::ndarray_size(
                            &o.shape,
                            o.openpi.dst_bytes().max(o.vllm.dst_bytes()),
                        )
                })
                .sum::<usize>();
        let planner = if policy.is_default {
            planner_tap(cfg, &inputs)?
        } else {
            None
        };
        let history_bytes = inputs.iter().map(|b| (b.history - 1) * b.frame_bytes).sum();
        Ok(Plan {
            inputs,
            outputs,
            io: io.clone(),
            limits: Limits {
                max_depth: cfg.server.max_depth,
                max_entries: cfg.server.max_map_entries,
            },
            metadata,
            reply_capacity,
            scratch_bytes,
            horizon,
            similarity_input: (policy.pacing.similarity_atol > 0.0)
                .then(|| {
                    policy
                        .inputs
                        .iter()
                        .position(|b| b.key == policy.pacing.similarity_key)
                })
                .flatten(),
            planner,
            host_buffers,
            tokens,
            id: NEXT_PLAN.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            sampling: policy
                .pipeline
                .as_ref()
                .map(|p| (p.steps as u32, p.max_steps as u32)),
            history_bytes,
            relative_source: relative_source.map(|(_, index)| index),
            rtc: rtc_plan(policy, io),
        })
    }
}

/// `[rtc]`'s layout: the pipeline's sample is its one output (`[.., rows, width]`, checked
/// when the pipeline was wired), its action columns those the output binding keeps.
fn rtc_plan(policy: &PolicySpec, io: &IoSpec) -> Option<super::RtcPlan> {
    let settings = policy.pipeline.as_ref()?.rtc?;
    let x = io.outputs.first()?;
    let (rows, width) = match x.shape.as_slice() {
        [.., rows, width] => (*rows, *width),
        _ => return None,
    };
    let cols = policy
        .outputs
        .iter()
        .find(|o| o.tensor == x.name)
        .and_then(|o| o.columns)
        .unwrap_or(width)
        .min(width);
    Some(super::RtcPlan {
        settings,
        output: 0,
        rows,
        width,
        cols,
    })
}

/// The next [`Plan::id`] (0 is never one: an empty token cache holds it).
static NEXT_PLAN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// vllm-omni clients build their loop from `action_horizon`, `action_dim` and `action_keys`:
/// where the metadata gives them, they must match the outputs.
fn check_vllm_metadata(policy: &PolicySpec, outputs: &[OutputBinding]) -> Result<(), ConfigError> {
    let m = &policy.metadata;
    if let Some(h) = m.get("action_horizon") {
        let h = h
            .as_integer()
            .ok_or_else(|| invalid("metadata.action_horizon", "must be an integer"))?;
        for o in outputs {
            let got = o
                .shape
                .get(o.shape.len().saturating_sub(2))
                .copied()
                .unwrap_or(1);
            if o.shape.len() < 2 || got as i64 != h {
                return Err(invalid(
                    "metadata.action_horizon",
                    format!("is {h} but output '{}' has shape {:?}", o.key, o.shape),
                ));
            }
        }
    }
    if let Some(d) = m.get("action_dim") {
        let d = d
            .as_integer()
            .ok_or_else(|| invalid("metadata.action_dim", "must be an integer"))?;
        for o in outputs {
            if o.shape.last().copied().unwrap_or(0) as i64 != d {
                return Err(invalid(
                    "metadata.action_dim",
                    format!("is {d} but output '{}' has shape {:?}", o.key, o.shape),
                ));
            }
        }
    }
    if let Some(keys) = m.get("action_keys") {
        let mut want: Vec<&str> = keys
            .as_array()
            .map(|a| a.iter().filter_map(|k| k.as_str()).collect())
            .unwrap_or_default();
        let mut have: Vec<&str> = outputs.iter().map(|o| o.key.as_str()).collect();
        want.sort_unstable();
        have.sort_unstable();
        if want != have {
            return Err(invalid(
                "metadata.action_keys",
                format!("is {want:?} but the outputs' keys are {have:?}"),
            ));
        }
    }
    Ok(())
}
