//! The serving plan: the config checked against the engine's real I/O, compiled once.
//!
//! Like tract's typed pipeline (parse, check, optimise, run), policyd validates every binding
//! at start-up and compiles it into transforms, so the request path makes no decisions: it
//! looks up a key, applies a precompiled transform into a preallocated buffer, and encodes
//! into a buffer sized here. The memory budget that `check-config` prints is computed here.

use crate::config::{Config, ConfigError, invalid};
use crate::dtype::{ElemType, WireDType};
use crate::engine::{InputBuffer, IoSpec};
use crate::transform::{Affine, Transform, load_f64};
use crate::wire::{self, Encoder, Limits, Timing, Value, Visitor, WireError};

/// One observation key bound to one engine input.
#[derive(Debug)]
pub struct InputBinding {
    pub key: String,
    /// Index into the engine's inputs.
    pub index: usize,
    /// Accepted wire dtypes, each with its compiled transform.
    pub accepted: Vec<(ElemType, Transform)>,
    /// Expected wire shape.
    pub shape: Vec<usize>,
    pub engine_type: ElemType,
    pub affine: Affine,
    pub optional: bool,
    pub fill: f64,
    /// A text binding: the string's UTF-8 bytes, one per element, then `fill`.
    pub text: bool,
    /// For a one-element input: a transform from each storage type (indexed by `ElemType as
    /// usize`), since scalars travel as native msgpack numbers of any type.
    pub scalar: Vec<Transform>,
}

/// One engine output sent under one reply key.
#[derive(Debug)]
pub struct OutputBinding {
    pub key: String,
    pub index: usize,
    /// Shape of the reply array.
    pub shape: Vec<usize>,
    /// Engine output → reply dtype (openpi routes).
    pub openpi: Transform,
    /// Engine output → float32 (the vllm-omni route always sends float32).
    pub vllm: Transform,
}

/// The compiled plan.
#[derive(Debug)]
pub struct Plan {
    pub inputs: Vec<InputBinding>,
    pub outputs: Vec<OutputBinding>,
    pub io: IoSpec,
    pub limits: Limits,
    /// The metadata frame, encoded once.
    pub metadata: Vec<u8>,
    /// Largest reply, in bytes (the reply buffer's capacity).
    pub reply_capacity: usize,
    /// Bytes of a slot's scratch buffer: the largest output converted to a reply dtype.
    pub scratch_bytes: usize,
    /// Rows of the action chunk (the first axis of the first output of rank 2 or more).
    pub horizon: usize,
    /// Index of the binding the similarity filter reads, if it is on.
    pub similarity_input: Option<usize>,
    /// Where the request path meets the task planner, when `[planner]` is on.
    pub planner: Option<PlannerTap>,
    pub budget: Budget,
}

/// The request path's side of the planner: which bindings it reads and fills.
#[derive(Clone)]
pub struct PlannerTap {
    pub link: std::sync::Arc<crate::planner::Link>,
    /// The text binding the subtask fills (`planner.prompt_key`).
    pub prompt: usize,
    /// The image binding whose frames the planner sees (`planner.camera`).
    pub camera: Option<usize>,
}

impl std::fmt::Debug for PlannerTap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlannerTap")
            .field("prompt", &self.prompt)
            .field("camera", &self.camera)
            .finish_non_exhaustive()
    }
}

/// Checks `[planner]`'s bindings against the compiled inputs and makes the link.
fn planner_tap(
    cfg: &Config,
    inputs: &[InputBinding],
    io: &IoSpec,
) -> Result<Option<PlannerTap>, ConfigError> {
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
    let max_subtask = io.inputs[inputs[prompt].index].elements();
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
        link: std::sync::Arc::new(crate::planner::Link::new(p, geometry, max_subtask)),
        prompt,
        camera,
    }))
}

/// Drops leading size-1 axes while more than `min_rank` remain.
fn squeeze_to(shape: &[usize], min_rank: usize) -> &[usize] {
    let mut s = shape;
    while s.len() > min_rank && s.first() == Some(&1) {
        s = &s[1..];
    }
    s
}

impl Plan {
    /// Checks `cfg`'s bindings against the engine's I/O and compiles them.
    pub fn compile(cfg: &Config, io: &IoSpec) -> Result<Plan, ConfigError> {
        let names = |specs: &[crate::engine::TensorSpec]| {
            specs
                .iter()
                .map(|s| format!("'{}' {} {:?}", s.name, s.dtype, s.shape))
                .collect::<Vec<_>>()
                .join(", ")
        };
        io.check_sizes().map_err(|m| invalid("engine.model", m))?;
        let mut inputs = Vec::new();
        for (i, b) in cfg.inputs.iter().enumerate() {
            let k = |f: &str| format!("inputs[{i}].{f}");
            let index = io
                .inputs
                .iter()
                .position(|s| s.name == b.tensor)
                .ok_or_else(|| {
                    invalid(
                        k("tensor"),
                        format!(
                            "the model has no input '{}'; its inputs are: {}",
                            b.tensor,
                            names(&io.inputs)
                        ),
                    )
                })?;
            let spec = &io.inputs[index];
            let rank = b.shape.len();
            let mut perm: Vec<usize> = (0..rank).collect();
            if let Some(p) = b.layout().perm() {
                for (j, &pj) in p.iter().enumerate() {
                    perm[rank - 3 + j] = rank - 3 + pj;
                }
            }
            let seen_by_engine: Vec<usize> = perm.iter().map(|&p| b.shape[p]).collect();
            if squeeze_to(&spec.shape, rank) != seen_by_engine.as_slice() {
                return Err(invalid(
                    k("shape"),
                    format!(
                        "wire shape {:?}{} does not match model input '{}' of shape {:?}",
                        b.shape,
                        if b.layout().perm().is_some() {
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
            let affine = Affine::normalize(b.scale, b.offset, &b.mean, &b.std);
            let inputs_affine = affine.clone();
            let accepted = b
                .dtypes()
                .into_iter()
                .map(|t| {
                    let tr = if perm.iter().enumerate().all(|(j, &p)| j == p) {
                        Transform::elementwise(t, spec.dtype, spec.elements(), affine.clone())
                    } else {
                        Transform::permuted(t, spec.dtype, &b.shape, &perm, affine.clone())
                    };
                    (t, tr)
                })
                .collect();
            inputs.push(InputBinding {
                key: b.key.clone(),
                index,
                accepted,
                shape: b.shape.clone(),
                engine_type: spec.dtype,
                affine,
                optional: b.optional,
                fill: b.fill,
                text: b.is_text(),
                scalar: if spec.elements() == 1 && !b.is_text() {
                    let affine = &inputs_affine;
                    crate::dtype::ALL_ELEM_TYPES
                        .iter()
                        .map(|&t| Transform::elementwise(t, spec.dtype, 1, affine.clone()))
                        .collect()
                } else {
                    Vec::new()
                },
            });
        }
        for spec in &io.inputs {
            if !cfg.inputs.iter().any(|b| b.tensor == spec.name) {
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
        for (i, o) in cfg.outputs.iter().enumerate() {
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
            let affine = Affine::unnormalize(&o.mean, &o.std);
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
                    o.dtype(),
                    &src_shape,
                    cols,
                    affine.clone(),
                ),
                vllm: Transform::first_columns(spec.dtype, ElemType::F32, &src_shape, cols, affine),
                shape,
            });
        }
        check_vllm_metadata(cfg, &outputs)?;

        let mut metadata = Vec::new();
        wire::encode_toml(
            &mut Encoder { buf: &mut metadata },
            &toml::Value::Table(cfg.metadata.clone()),
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
            + wire::TIMING_SIZE
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
        let planner = planner_tap(cfg, &inputs, io)?;
        let mut budget = Budget::compute(cfg, io, reply_capacity, scratch_bytes, metadata.len());
        if let Some(g) = planner.as_ref().and_then(|t| t.link.camera) {
            budget.add(vec![(
                "planner      camera frame handed to the planner".to_string(),
                g.bytes() as u64,
            )]);
        }
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
            similarity_input: (cfg.pacing.similarity_atol > 0.0)
                .then(|| {
                    cfg.inputs
                        .iter()
                        .position(|b| b.key == cfg.pacing.similarity_key)
                })
                .flatten(),
            planner,
            budget,
        })
    }

    /// Decodes a request frame straight into one slot's input buffers. Inputs the request
    /// leaves out are filled if optional; a missing required input is an error.
    pub fn decode(
        &self,
        frame: &[u8],
        bufs: &mut [Box<dyn InputBuffer>],
        seen: &mut [bool],
    ) -> Result<wire::RequestMeta, WireError> {
        seen.iter_mut().for_each(|s| *s = false);
        let mut w = SlotWriter {
            plan: self,
            bufs,
            seen,
        };
        let meta = wire::decode_request(frame, &self.limits, &mut w)?;
        if meta.endpoint == wire::Endpoint::Reset {
            return Ok(meta);
        }
        if let Some(tap) = &self.planner {
            let b = &self.inputs[tap.prompt];
            let sent = w.seen[tap.prompt];
            if !sent || tap.link.planner_first {
                let subtask = tap.link.subtask();
                if let Some(s) = subtask.as_deref() {
                    // The planner checked the length; a failure leaves the client's prompt.
                    if write_text(b, None, s.as_bytes(), w.bufs[b.index].bytes_mut()).is_ok() {
                        w.seen[tap.prompt] = true;
                    }
                }
            }
        }
        for (i, (b, seen)) in self.inputs.iter().zip(w.seen.iter()).enumerate() {
            if !*seen {
                if !b.optional {
                    if self.planner.as_ref().is_some_and(|t| t.prompt == i) {
                        return Err(WireError::NoSubtaskYet { key: b.key.clone() });
                    }
                    return Err(WireError::MissingKey { key: b.key.clone() });
                }
                crate::transform::fill_bytes(b.engine_type, b.fill, w.bufs[b.index].bytes_mut());
            }
        }
        Ok(meta)
    }

    /// A hash of what the text bindings (the prompt) put in the engine inputs, for
    /// `reset_on_prompt_change` (FNV-1a: a few hundred bytes, no allocation).
    pub fn prompt_hash(&self, bufs: &mut [Box<dyn InputBuffer>]) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in self.inputs.iter().filter(|b| b.text) {
            for &byte in bufs[b.index].bytes_mut().iter() {
                h = (h ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
            }
        }
        h
    }

    /// Fills every input with its fill value (for warm-up).
    pub fn fill_all(&self, bufs: &mut [Box<dyn InputBuffer>]) {
        for b in &self.inputs {
            crate::transform::fill_bytes(b.engine_type, b.fill, bufs[b.index].bytes_mut());
        }
    }

    /// Names the first output holding NaN or infinity, if any.
    pub fn non_finite_output(&self, outputs: &[Vec<u8>]) -> Option<&str> {
        self.outputs.iter().find_map(|o| {
            let spec = &self.io.outputs[o.index];
            if !spec.dtype.is_float() {
                return None;
            }
            let buf = &outputs[o.index];
            (0..spec.elements())
                .any(|i| !load_f64(spec.dtype, buf, i).is_finite())
                .then_some(spec.name.as_str())
        })
    }

    /// The rows of the action chunk a reply keeps: at most `pacing.actions_per_chunk`, and,
    /// with `pacing.skip_stale_actions`, without the first `delay_steps` (which will have
    /// elapsed on arrival). At least one row is always kept.
    pub fn chunk(&self, pacing: &crate::config::PacingConfig, delay_steps: u32) -> Chunk {
        let h = self.horizon;
        let end = if pacing.actions_per_chunk > 0 {
            pacing.actions_per_chunk.min(h)
        } else {
            h
        };
        let start = if pacing.skip_stale_actions {
            (delay_steps as usize).min(end.saturating_sub(1))
        } else {
            0
        };
        Chunk { start, end }
    }

    /// Encodes an openpi reply: `{key: ndarray, …, policy_timing, server_timing}`, plus
    /// `delay_steps` when given.
    pub fn encode_openpi(
        &self,
        r: &mut ReplyParts<'_>,
        timing: &Timing,
        delay_steps: Option<u32>,
        buf: &mut Vec<u8>,
    ) {
        buf.clear();
        let mut e = Encoder { buf };
        e.map(self.outputs.len() as u32 + 2 + u32::from(delay_steps.is_some()));
        for o in &self.outputs {
            e.str(&o.key);
            self.write_output(&mut e, o, &o.openpi, r);
        }
        wire::encode_timing(&mut e, timing);
        if let Some(d) = delay_steps {
            e.str("delay_steps");
            e.int(i64::from(d));
        }
    }

    /// Encodes a vllm-omni reply: a bare float32 array, or a map of them for several outputs.
    pub fn encode_vllm(&self, r: &mut ReplyParts<'_>, buf: &mut Vec<u8>) {
        buf.clear();
        let mut e = Encoder { buf };
        let several = self.outputs.len() > 1;
        if several {
            e.map(self.outputs.len() as u32);
        }
        for o in &self.outputs {
            if several {
                e.str(&o.key);
            }
            self.write_output(&mut e, o, &o.vllm, r);
        }
    }

    /// Encodes an `observe` push: `{"type": "actions", key: ndarray, …, "timesteps": int64[H],
    /// "timestamps": float64[H], "obs_timestep", "delay_steps"}`, where step i of the kept
    /// chunk is `timestep + i` at `timestamp + i·dt`.
    pub fn encode_observe(
        &self,
        r: &mut ReplyParts<'_>,
        obs: (i64, f64),
        dt: f64,
        delay_steps: u32,
        vllm: bool,
        buf: &mut Vec<u8>,
    ) {
        buf.clear();
        let mut e = Encoder { buf };
        e.map(self.outputs.len() as u32 + 5);
        e.str("type");
        e.str("actions");
        for o in &self.outputs {
            e.str(&o.key);
            self.write_output(&mut e, o, if vllm { &o.vllm } else { &o.openpi }, r);
        }
        let (timestep, timestamp) = obs;
        let Chunk { start, end } = r.chunk;
        let n = end - start;
        e.str("timesteps");
        e.ndarray(ElemType::I64, &[n], 8 * n, |d| {
            for (i, c) in d.chunks_exact_mut(8).enumerate() {
                let (step, _) = crate::scheduler::timed_step(timestep, timestamp, dt, start + i);
                c.copy_from_slice(&step.to_le_bytes());
            }
        });
        e.str("timestamps");
        e.ndarray(ElemType::F64, &[n], 8 * n, |d| {
            for (i, c) in d.chunks_exact_mut(8).enumerate() {
                let (_, t) = crate::scheduler::timed_step(timestep, timestamp, dt, start + i);
                c.copy_from_slice(&t.to_le_bytes());
            }
        });
        e.str("obs_timestep");
        e.int(timestep);
        e.str("delay_steps");
        e.int(i64::from(delay_steps));
    }

    /// Encodes a `{"type": "skipped", "timestep", "reason"}` notice.
    pub fn encode_skipped(timestep: i64, reason: &str, buf: &mut Vec<u8>) {
        buf.clear();
        let mut e = Encoder { buf };
        e.map(3);
        e.str("type");
        e.str("skipped");
        e.str("timestep");
        e.int(timestep);
        e.str("reason");
        e.str(reason);
    }

    /// Writes one output as an ndarray, cut to the chunk's rows.
    fn write_output(
        &self,
        e: &mut Encoder<'_>,
        o: &OutputBinding,
        tr: &Transform,
        r: &mut ReplyParts<'_>,
    ) {
        let src: &[u8] = &r.outputs[o.index];
        let bytes = tr.dst_bytes();
        let rows = o.shape.first().copied().unwrap_or(1);
        let Chunk { start, end } = r.chunk;
        let whole = o.shape.len() < 2 || (start == 0 && end >= rows);
        if whole || rows == 0 || bytes > r.scratch.len() {
            e.ndarray(tr.dst_type, &o.shape, bytes, |d| {
                tr.apply(src, crate::dtype::ByteOrder::Little, d);
            });
            return;
        }
        let end = end.min(rows);
        let start = start.min(end);
        let row = bytes / rows;
        let scratch = &mut r.scratch[..bytes];
        tr.apply(src, crate::dtype::ByteOrder::Little, scratch);
        let mut shape: heapless::Vec<usize, { wire::MAX_RANK }> = heapless::Vec::new();
        let _ = shape.extend_from_slice(&o.shape[..o.shape.len().min(wire::MAX_RANK)]);
        shape[0] = end - start;
        e.ndarray(tr.dst_type, &shape, (end - start) * row, |d| {
            d.copy_from_slice(&scratch[start * row..end * row]);
        });
    }

    /// The raw (pre-normalisation) values of the similarity filter's input, from a decoded
    /// slot, into `out`. `None` when the filter is off.
    pub fn similarity_state<'o>(
        &self,
        bufs: &mut [Box<dyn InputBuffer>],
        out: &'o mut [f64; crate::config::MAX_SIMILARITY_STATE],
    ) -> Option<&'o [f64]> {
        let b = &self.inputs[self.similarity_input?];
        let data = bufs[b.index].bytes_mut();
        let n = (data.len() / b.engine_type.size()).min(out.len());
        for (i, v) in out[..n].iter_mut().enumerate() {
            let x = load_f64(b.engine_type, data, i);
            *v = match &b.affine {
                Affine::Scalar { a, b } => (x - b) / a,
                Affine::Indexed { a, b } => {
                    let k = i % a.len();
                    (x - b[k]) / a[k]
                }
            };
        }
        Some(&out[..n])
    }
}

/// The rows `start..end` of the action chunk that a reply carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub start: usize,
    pub end: usize,
}

/// What a reply is encoded from: a slot's outputs, its scratch buffer and the chunk to keep.
pub struct ReplyParts<'a> {
    pub outputs: &'a [Vec<u8>],
    pub scratch: &'a mut [u8],
    pub chunk: Chunk,
}

/// vllm-omni clients build their loop from `action_horizon`, `action_dim` and `action_keys`:
/// where the metadata gives them, they must match the outputs.
fn check_vllm_metadata(cfg: &Config, outputs: &[OutputBinding]) -> Result<(), ConfigError> {
    let m = &cfg.metadata;
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

/// Writes bound values into a slot's input buffers.
struct SlotWriter<'a> {
    plan: &'a Plan,
    bufs: &'a mut [Box<dyn InputBuffer>],
    seen: &'a mut [bool],
}

fn dtype_name(d: WireDType) -> String {
    match d {
        WireDType::Num(t, _) => t.name().to_string(),
        WireDType::Unicode(n, _) => format!("str{n} (<U{n})"),
        WireDType::Bytes(n) => format!("bytes{n} (|S{n})"),
    }
}

impl Visitor for SlotWriter<'_> {
    fn binding(&self, path: &[u8]) -> Option<usize> {
        self.plan
            .inputs
            .iter()
            .position(|b| b.key.as_bytes() == path)
    }

    fn value(&mut self, i: usize, _path: &[u8], value: Value<'_>) -> Result<(), WireError> {
        let b = &self.plan.inputs[i];
        if std::mem::replace(&mut self.seen[i], true) {
            return Err(WireError::DuplicateKey { key: b.key.clone() });
        }
        let expected_types = || {
            b.accepted
                .iter()
                .map(|(t, _)| t.name())
                .collect::<Vec<_>>()
                .join(" or ")
        };
        let a = match value {
            Value::Array(a) if b.text => {
                return Err(WireError::ExpectedText {
                    key: b.key.clone(),
                    got: dtype_name(a.declared),
                });
            }
            Value::Text { dtype, data } if b.text => {
                write_text(b, dtype, data, self.bufs[b.index].bytes_mut())?;
                if let Some(tap) = &self.plan.planner
                    && tap.prompt == i
                    && tap.link.planner_first
                {
                    // The client's prompt is the planner's instruction (valid UTF-8 by now).
                    match dtype {
                        None | Some(WireDType::Bytes(_)) => {
                            let end = data.iter().rposition(|&c| c != 0).map_or(0, |e| e + 1);
                            tap.link.client_instruction(&data[..end]);
                        }
                        // UTF-32: re-read as the UTF-8 bytes just written (rare; allocates).
                        Some(_) => {
                            let buf = self.bufs[b.index].bytes_mut();
                            let t = b.engine_type;
                            let bytes: Vec<u8> = (0..buf.len() / t.size())
                                .map(|k| load_f64(t, buf, k))
                                .take_while(|&v| v != b.fill)
                                .map(|v| v as u8)
                                .collect();
                            tap.link.client_instruction(&bytes);
                        }
                    }
                }
                return Ok(());
            }
            Value::Array(a) => a,
            Value::Text { dtype, .. } => {
                return Err(WireError::WrongDType {
                    key: b.key.clone(),
                    expected: expected_types(),
                    got: dtype.map(dtype_name).unwrap_or_else(|| "text".into()),
                });
            }
        };
        let declared = match a.declared {
            WireDType::Num(t, _) => t,
            other => {
                return Err(WireError::WrongDType {
                    key: b.key.clone(),
                    expected: expected_types(),
                    got: dtype_name(other),
                });
            }
        };
        let pos = b.accepted.iter().position(|(t, _)| *t == declared);
        if pos.is_none() && !a.native {
            return Err(WireError::WrongDType {
                key: b.key.clone(),
                expected: expected_types(),
                got: declared.name().into(),
            });
        }
        if a.shape.as_slice() != b.shape.as_slice() {
            return Err(WireError::WrongShape {
                key: b.key.clone(),
                expected: b.shape.clone(),
                got: a.shape.to_vec(),
            });
        }
        if let Some(tap) = &self.plan.planner
            && tap.camera == Some(i)
            && a.storage == ElemType::U8
        {
            tap.link.offer_image(a.data);
        }
        let dst = self.bufs[b.index].bytes_mut();
        let ok = match pos {
            Some(p) if b.accepted[p].0 == a.storage => b.accepted[p].1.apply(a.data, a.order, dst),
            // A scalar whose value travels in another type (openpi sends a float32 scalar as a
            // msgpack float64, and plain msgpack numbers carry no dtype): convert from storage.
            _ => b
                .scalar
                .get(a.storage as usize)
                .is_some_and(|t| t.apply(a.data, a.order, dst)),
        };
        if !ok {
            return Err(WireError::BadArray {
                key: b.key.clone(),
                reason: "data does not fit the engine input".into(),
            });
        }
        Ok(())
    }
}

/// Writes a string into a text binding's buffer: its UTF-8 bytes, one per element, then the
/// binding's fill value. numpy `U` strings (UTF-32) are re-encoded; `S` strings drop numpy's
/// NUL padding.
fn write_text(
    b: &InputBinding,
    dtype: Option<WireDType>,
    data: &[u8],
    dst: &mut [u8],
) -> Result<(), WireError> {
    let size = b.engine_type.size();
    let max = dst.len() / size;
    let too_long = |got| WireError::TextTooLong {
        key: b.key.clone(),
        max,
        got,
    };
    let mut n = 0usize;
    let mut put = |byte: u8, dst: &mut [u8]| -> Result<(), usize> {
        if n == max {
            return Err(n + 1);
        }
        crate::transform::fill_bytes(b.engine_type, f64::from(byte), &mut dst[n * size..][..size]);
        n += 1;
        Ok(())
    };
    match dtype {
        Some(WireDType::Unicode(_, order)) => {
            let mut utf8 = [0u8; 4];
            for unit in data.chunks_exact(4) {
                let raw = [unit[0], unit[1], unit[2], unit[3]];
                let cp = match order {
                    crate::dtype::ByteOrder::Little => u32::from_le_bytes(raw),
                    crate::dtype::ByteOrder::Big => u32::from_be_bytes(raw),
                };
                if cp == 0 {
                    break;
                }
                let c = char::from_u32(cp).ok_or_else(|| WireError::BadText {
                    key: b.key.clone(),
                    encoding: "UTF-32",
                })?;
                for &byte in c.encode_utf8(&mut utf8).as_bytes() {
                    put(byte, dst).map_err(|_| too_long(n_utf8_total(data, order)))?;
                }
            }
        }
        Some(WireDType::Bytes(_)) | None => {
            let end = if matches!(dtype, Some(WireDType::Bytes(_))) {
                data.iter().rposition(|&c| c != 0).map_or(0, |i| i + 1)
            } else {
                data.len()
            };
            let text = &data[..end];
            if std::str::from_utf8(text).is_err() {
                return Err(WireError::BadText {
                    key: b.key.clone(),
                    encoding: "UTF-8",
                });
            }
            if text.len() > max {
                return Err(too_long(text.len()));
            }
            for &byte in text {
                let _ = put(byte, dst);
            }
        }
        Some(other) => {
            return Err(WireError::ExpectedText {
                key: b.key.clone(),
                got: dtype_name(other),
            });
        }
    }
    crate::transform::fill_bytes(b.engine_type, b.fill, &mut dst[n * size..]);
    Ok(())
}

/// The UTF-8 length of a UTF-32 string (for the error message only).
fn n_utf8_total(data: &[u8], order: crate::dtype::ByteOrder) -> usize {
    data.chunks_exact(4)
        .map(|u| {
            let raw = [u[0], u[1], u[2], u[3]];
            match order {
                crate::dtype::ByteOrder::Little => u32::from_le_bytes(raw),
                crate::dtype::ByteOrder::Big => u32::from_be_bytes(raw),
            }
        })
        .take_while(|&cp| cp != 0)
        .filter_map(char::from_u32)
        .map(char::len_utf8)
        .sum()
}

/// The memory policyd allocates for a config, as a formula and a number.
#[derive(Clone, Debug, PartialEq)]
pub struct Budget {
    pub lines: Vec<(String, u64)>,
    pub total: u64,
    /// Of `total`, the connections' buffers (shared by all policies of a server).
    pub connections: u64,
}

/// tungstenite's read buffer, allocated per connection.
const WS_READ_BUFFER: u64 = 128 * 1024;

impl Budget {
    fn compute(cfg: &Config, io: &IoSpec, reply: usize, scratch: usize, metadata: usize) -> Budget {
        let inputs: u64 = io.inputs.iter().map(|s| s.bytes() as u64).sum();
        let outputs: u64 = io.outputs.iter().map(|s| s.bytes() as u64).sum();
        let reply = reply as u64;
        let scratch = scratch as u64;
        let slots = cfg.engine.slots as u64;
        let conns = cfg.server.max_connections as u64;
        let msg = cfg.server.max_message_bytes as u64;
        let model = cfg.model.as_ref().map(|m| m.size()).unwrap_or(0);
        let guard = crate::frame_guard::INBUF as u64;
        let sessions = std::mem::size_of::<crate::session::Sessions>() as u64;
        let per_conn = msg + WS_READ_BUFFER + guard + 2 * reply + metadata as u64 + sessions;
        let lines = vec![
            (
                format!(
                    "slots        {slots} × (inputs {inputs} + outputs {outputs} + reply {reply} + scratch {scratch})"
                ),
                slots * (inputs + outputs + reply + scratch),
            ),
            (
                format!(
                    "connections  {conns} × (max_message_bytes {msg} + read buffer {WS_READ_BUFFER} + frame guard {guard} + 2 × reply {reply} + metadata {metadata} + session table {sessions})"
                ),
                conns * per_conn,
            ),
            ("model        weights as stored".to_string(), model),
        ];
        let total = lines.iter().map(|(_, v)| v).sum();
        Budget {
            lines,
            total,
            connections: conns * per_conn,
        }
    }

    /// Adds the engine's own memory (see [`crate::engine::Engine::working_memory`]).
    pub fn add(&mut self, lines: Vec<(String, u64)>) {
        for (what, v) in lines {
            self.total += v;
            self.lines.push((what, v));
        }
    }

    pub fn render(&self) -> String {
        let mut s = String::from("memory budget (bytes):\n");
        for (what, v) in &self.lines {
            s.push_str(&format!("  {what} = {v}\n"));
        }
        s.push_str(&format!(
            "  total = {} ({:.1} MiB), plus the engine's working memory\n",
            self.total,
            self.total as f64 / (1024.0 * 1024.0)
        ));
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::TensorSpec;
    use crate::engine::synthetic::HostBuffer as Buf;

    const CFG: &str = r#"
[engine]
model = "m.onnx"
[[inputs]]
key = "state"
tensor = "state"
dtypes = ["float64"]
shape = [2]
[[inputs]]
key = "prompt"
tensor = "tokens"
dtypes = ["text"]
shape = [8]
fill = -1
[[outputs]]
tensor = "actions"
"#;

    fn plan(cfg: &str) -> Result<Plan, ConfigError> {
        let cfg = Config::parse(cfg, "test", None)?;
        let io = IoSpec {
            inputs: vec![
                TensorSpec {
                    name: "state".into(),
                    dtype: ElemType::F32,
                    shape: vec![1, 2],
                },
                TensorSpec {
                    name: "tokens".into(),
                    dtype: ElemType::I64,
                    shape: vec![1, 8],
                },
            ],
            outputs: vec![TensorSpec {
                name: "actions".into(),
                dtype: ElemType::F32,
                shape: vec![1, 4, 2],
            }],
        };
        Plan::compile(&cfg, &io)
    }

    #[test]
    fn a_model_declaring_an_absurd_shape_is_refused() {
        let cfg = Config::parse(CFG, "test", None).unwrap();
        let spec = |name: &str, dtype, shape: Vec<usize>| TensorSpec {
            name: name.into(),
            dtype,
            shape,
        };
        let io = IoSpec {
            inputs: vec![
                spec("state", ElemType::F32, vec![1, 2]),
                spec("tokens", ElemType::I64, vec![1, 8]),
            ],
            outputs: vec![spec("actions", ElemType::F32, vec![1 << 40, 1 << 40, 2])],
        };
        let Err(e) = Plan::compile(&cfg, &io) else {
            panic!("a model declaring a 2^81-element output was accepted")
        };
        let e = e.to_string();
        assert!(e.contains("engine.model") && e.contains("'actions'"), "{e}");
    }

    /// `{"state": <f8[2]>, "prompt": prompt}` with `prompt` already msgpack-encoded.
    fn frame(prompt: &[u8]) -> Vec<u8> {
        let mut buf = Vec::new();
        let mut e = Encoder { buf: &mut buf };
        e.map(2);
        e.str("state");
        e.ndarray(ElemType::F64, &[2], 16, |d| d.fill(0));
        e.str("prompt");
        buf.extend_from_slice(prompt);
        buf
    }

    fn tokens(p: &Plan, frame: &[u8]) -> Result<Vec<i64>, WireError> {
        let mut bufs: Vec<Box<dyn InputBuffer>> =
            vec![Box::new(Buf(vec![0; 8])), Box::new(Buf(vec![0; 64]))];
        let mut seen = vec![false; 2];
        p.decode(frame, &mut bufs, &mut seen)?;
        Ok(bufs[1]
            .bytes_mut()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect())
    }

    fn msgpack_str(s: &str) -> Vec<u8> {
        let mut v = Vec::new();
        Encoder { buf: &mut v }.str(s);
        v
    }

    #[test]
    fn a_text_binding_receives_the_prompt_bytes_then_fill() {
        let p = plan(CFG).unwrap();
        assert_eq!(
            tokens(&p, &frame(&msgpack_str("hé"))).unwrap(),
            [104, 195, 169, -1, -1, -1, -1, -1]
        );
        assert_eq!(tokens(&p, &frame(&msgpack_str(""))).unwrap(), [-1; 8]);
        // numpy `<U3` (UTF-32), as openpi-client sends np.array("abc").
        let mut u = Vec::new();
        let mut e = Encoder { buf: &mut u };
        e.map(4);
        e.bin(b"__ndarray__");
        e.bool(true);
        e.bin(b"data");
        e.bin(&[b'a', 0, 0, 0, b'b', 0, 0, 0, 0xe9, 0, 0, 0]);
        e.bin(b"dtype");
        e.str("<U3");
        e.bin(b"shape");
        e.array(0);
        assert_eq!(
            tokens(&p, &frame(&u)).unwrap(),
            [97, 98, 195, 169, -1, -1, -1, -1]
        );
    }

    #[test]
    fn non_finite_outputs_are_named() {
        let p = plan(CFG).unwrap();
        let mut out = vec![0u8; 32];
        assert_eq!(p.non_finite_output(std::slice::from_ref(&out)), None);
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            out[12..16].copy_from_slice(&bad.to_le_bytes());
            assert_eq!(
                p.non_finite_output(std::slice::from_ref(&out)),
                Some("actions")
            );
        }
    }

    #[test]
    fn text_binding_errors_name_the_key() {
        let p = plan(CFG).unwrap();
        let e = tokens(&p, &frame(&msgpack_str("123456789"))).unwrap_err();
        assert!(
            matches!(e, WireError::TextTooLong { max: 8, got: 9, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("'prompt'"));
        let mut arr = Vec::new();
        Encoder { buf: &mut arr }.ndarray(ElemType::F32, &[1], 4, |d| d.fill(0));
        let e = tokens(&p, &frame(&arr)).unwrap_err();
        assert!(matches!(e, WireError::ExpectedText { .. }), "{e}");
        let mut bad = Vec::new();
        Encoder { buf: &mut bad }.bin(&[0xff, 0xfe]);
        let e = tokens(&p, &frame(&bad)).unwrap_err();
        assert!(matches!(e, WireError::BadText { .. }), "{e}");
    }

    #[test]
    fn text_bindings_are_checked_at_start_up() {
        let mixed = CFG.replace(r#"dtypes = ["text"]"#, r#"dtypes = ["text", "uint8"]"#);
        assert!(
            plan(&mixed)
                .unwrap_err()
                .to_string()
                .contains("inputs[1].dtypes")
        );
        let rank2 = CFG.replace("shape = [8]", "shape = [2, 4]");
        assert!(
            plan(&rank2)
                .unwrap_err()
                .to_string()
                .contains("inputs[1].shape")
        );
        let scaled = CFG.replace("fill = -1", "fill = -1\nscale = 2.0");
        assert!(plan(&scaled).is_err());
        let wrong_len = CFG.replace("shape = [8]", "shape = [9]");
        assert!(
            plan(&wrong_len)
                .unwrap_err()
                .to_string()
                .contains("inputs[1].shape")
        );
    }

    #[test]
    fn planner_bindings_are_checked_at_start_up() {
        let on = |extra: &str| {
            format!(
                "{CFG}\n[planner]\nenabled = true\nendpoints = [\"http://127.0.0.1:9\"]\n\
                 model = \"m\"\n{extra}"
            )
        };
        let p = plan(&on("")).expect("the prompt binding is a text binding");
        let tap = p.planner.as_ref().expect("a planner tap");
        assert_eq!((tap.prompt, tap.camera, tap.link.max_subtask), (1, None, 8));
        let err = |extra: &str| plan(&on(extra)).unwrap_err().to_string();
        assert!(err("prompt_key = \"state\"").contains("planner.prompt_key"));
        assert!(err("prompt_key = \"task\"").contains("\"state\", \"prompt\""));
        assert!(err("camera = \"state\"").contains("planner.camera"));
        assert!(err("camera = \"cam\"").contains("no input binding"));
    }

    #[test]
    fn the_subtask_fills_the_prompt_by_precedence() {
        use crate::planner::reply::Answer;
        let on = |precedence: &str| {
            plan(&format!(
                "{CFG}\n[planner]\nenabled = true\nendpoints = [\"http://127.0.0.1:9\"]\n\
                 model = \"m\"\nprecedence = \"{precedence}\"\ninstruction = \"tidy up\""
            ))
            .expect("plan")
        };
        let say = |p: &Plan, s: &str| {
            p.planner.as_ref().expect("tap").link.publish(&Answer {
                subtask: s.into(),
                done: false,
            })
        };
        let no_prompt = {
            let mut buf = Vec::new();
            let mut e = Encoder { buf: &mut buf };
            e.map(1);
            e.str("state");
            e.ndarray(ElemType::F64, &[2], 16, |d| d.fill(0));
            buf
        };
        let client = p_frame("go");
        let p = on("client");
        let e = tokens(&p, &no_prompt).unwrap_err();
        assert!(matches!(e, WireError::NoSubtaskYet { .. }), "{e}");
        say(&p, "ab");
        assert_eq!(tokens(&p, &no_prompt).expect("ok")[..3], [97, 98, -1]);
        assert_eq!(tokens(&p, &client).expect("ok")[..3], [103, 111, -1]);
        let p = on("planner");
        assert_eq!(tokens(&p, &client).expect("ok")[..3], [103, 111, -1]);
        let link = p.planner.as_ref().expect("tap").link.clone();
        assert_eq!(link.instruction().as_str(), "go");
        say(&p, "ab");
        assert_eq!(tokens(&p, &client).expect("ok")[..3], [97, 98, -1]);
    }

    fn p_frame(prompt: &str) -> Vec<u8> {
        frame(&msgpack_str(prompt))
    }
}
