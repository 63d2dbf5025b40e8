//! LeRobot's proposed pickle-free payloads (lerobot PR #3048, unmerged): a big-endian u32 JSON
//! length, the JSON, then a safetensors file with the arrays. A client on that branch sends them
//! in the same gRPC messages; policyd tells the formats apart by the first byte (a pickle starts
//! with `PROTO`, 0x80; this format with the JSON length's high byte, 0 below 16 MiB) and answers
//! each client in its own.

use safetensors::{Dtype, SafeTensors};
use serde_json::Value as Json;

use super::{Feature, LerobotError, NdArray, ObsValue, PolicySetup};
use crate::dtype::{ByteOrder, ElemType};
use crate::limits::MAX_RANK;
use crate::protocol::clip;

fn invalid(msg: impl Into<String>) -> LerobotError {
    LerobotError::Invalid(msg.into())
}

/// The most JSON one payload may carry: its scalars, task and feature list (the tensors are in
/// the safetensors part). Parsed, JSON takes up to ~30 times its size; a 30 MB JSON
/// observation took 528 MB before.
pub const MAX_JSON_BYTES: usize = 1 << 20;

/// The JSON and the safetensors bytes of a payload.
fn split(payload: &[u8]) -> Result<(Json, &[u8]), LerobotError> {
    let head: [u8; 4] = payload
        .get(..4)
        .and_then(|h| h.try_into().ok())
        .ok_or_else(|| invalid("the payload is shorter than its 4-byte JSON length"))?;
    let n = u32::from_be_bytes(head) as usize;
    if n > MAX_JSON_BYTES {
        return Err(invalid(format!(
            "the payload's JSON is {n} bytes; at most {MAX_JSON_BYTES} are read (tensors belong \
             in its safetensors part)"
        )));
    }
    let json = payload
        .get(4..4 + n)
        .ok_or_else(|| invalid(format!("the payload's JSON length {n} runs past its end")))?;
    let meta: Json = serde_json::from_slice(json)
        .map_err(|e| invalid(format!("the payload's JSON is not valid: {e}")))?;
    Ok((meta, &payload[4 + n..]))
}

fn typed<'j>(
    meta: &'j Json,
    want: &str,
) -> Result<&'j serde_json::Map<String, Json>, LerobotError> {
    let obj = meta
        .as_object()
        .ok_or_else(|| invalid("the payload's JSON is not an object"))?;
    match obj.get("type").and_then(Json::as_str) {
        Some(t) if t == want => Ok(obj),
        Some(t) => Err(invalid(format!("expected a {want}, got a \"{}\"", clip(t)))),
        None => Err(invalid(format!(
            "expected a {want}: the JSON has no \"type\""
        ))),
    }
}

/// A `TimedObservation`: its scalars, its JSON values and its tensors.
pub struct Observation<'p> {
    pub timestamp: f64,
    pub timestep: i64,
    pub must_go: bool,
    meta: Json,
    tensors: Option<SafeTensors<'p>>,
}

/// Reads a `TimedObservation`.
pub fn observation(payload: &[u8]) -> Result<Observation<'_>, LerobotError> {
    let (meta, rest) = split(payload)?;
    let obj = typed(&meta, "TimedObservation")?;
    let timestamp = obj
        .get("timestamp")
        .and_then(Json::as_f64)
        .filter(|t| t.is_finite())
        .ok_or_else(|| invalid("TimedObservation.timestamp must be a finite number"))?;
    let timestep = obj
        .get("timestep")
        .and_then(Json::as_i64)
        .ok_or_else(|| invalid("TimedObservation.timestep must be an int"))?;
    let must_go = match obj.get("must_go") {
        None => false,
        Some(v) => v
            .as_bool()
            .ok_or_else(|| invalid("TimedObservation.must_go must be a bool"))?,
    };
    if !obj.get("scalar_data").is_some_and(Json::is_object) {
        return Err(invalid("TimedObservation.scalar_data must be an object"));
    }
    let tensors = if rest.is_empty() {
        None
    } else {
        Some(
            SafeTensors::deserialize(rest)
                .map_err(|e| invalid(format!("the payload's safetensors are not valid: {e}")))?,
        )
    };
    Ok(Observation {
        timestamp,
        timestep,
        must_go,
        meta,
        tensors,
    })
}

impl Observation<'_> {
    /// Its time and flags.
    pub fn timed(&self) -> super::Timed {
        super::Timed {
            timestep: self.timestep,
            timestamp: self.timestamp,
            must_go: self.must_go,
        }
    }

    /// The observation's entries: `scalar_data`'s numbers and strings, then the tensors.
    pub fn entries(&self) -> impl Iterator<Item = Result<(&str, ObsValue<'_>), LerobotError>> {
        let scalars = self
            .meta
            .get("scalar_data")
            .and_then(Json::as_object)
            .into_iter()
            .flatten()
            .filter_map(|(k, v)| {
                Some(Ok((
                    k.as_str(),
                    match v {
                        Json::Number(n) => ObsValue::Number(n.as_f64()?),
                        Json::Bool(b) => ObsValue::Number(f64::from(u8::from(*b))),
                        Json::String(s) => ObsValue::Text(s),
                        // Lists, objects and nulls bind nothing (LeRobot's robots send none).
                        _ => return None,
                    },
                )))
            });
        let tensors = self.tensors.iter().flat_map(|t| {
            t.iter().map(|(name, view)| {
                let dtype = match view.dtype() {
                    Dtype::U8 => ElemType::U8,
                    Dtype::U16 => ElemType::U16,
                    Dtype::I32 => ElemType::I32,
                    Dtype::I64 => ElemType::I64,
                    Dtype::F32 => ElemType::F32,
                    Dtype::F64 => ElemType::F64,
                    Dtype::BOOL => ElemType::Bool,
                    other => {
                        return Err(invalid(format!(
                            "tensor '{}' has dtype {other:?} (accepted: U8, U16, I32, I64, \
                             F32, F64, BOOL)",
                            clip(name)
                        )));
                    }
                };
                let mut shape = heapless::Vec::<usize, MAX_RANK>::new();
                for &d in view.shape() {
                    shape.push(d).map_err(|_| {
                        invalid(format!("tensor '{}' has rank over {MAX_RANK}", clip(name)))
                    })?;
                }
                Ok((
                    name,
                    ObsValue::Array(NdArray {
                        dtype,
                        order: ByteOrder::Little,
                        shape,
                        data: view.data(),
                    }),
                ))
            })
        });
        scalars.chain(tensors)
    }
}

/// Reads a `RemotePolicyConfig` (JSON only).
pub fn policy_setup(payload: &[u8]) -> Result<PolicySetup, LerobotError> {
    let (meta, _) = split(payload)?;
    let obj = typed(&meta, "RemotePolicyConfig")?;
    let text = |k: &str| {
        obj.get(k)
            .and_then(Json::as_str)
            .map(str::to_string)
            .ok_or_else(|| invalid(format!("RemotePolicyConfig.{k} must be a str")))
    };
    let mut features = Vec::new();
    let fs = obj
        .get("lerobot_features")
        .and_then(Json::as_object)
        .ok_or_else(|| invalid("RemotePolicyConfig.lerobot_features must be an object"))?;
    super::check_feature_count(fs.len())?;
    for (key, f) in fs {
        let bad = |what: &str| invalid(format!("lerobot_features['{}']: {what}", clip(key)));
        let f = f.as_object().ok_or_else(|| bad("must be an object"))?;
        let shape = f
            .get("shape")
            .and_then(Json::as_array)
            .and_then(|s| {
                s.iter()
                    .map(|d| d.as_u64().map(|d| d as usize))
                    .collect::<Option<Vec<_>>>()
            })
            .filter(|s| s.len() <= MAX_RANK)
            .ok_or_else(|| bad(&format!("shape must be a list of at most {MAX_RANK} ints")))?;
        let dtype = match (f.get("dtype"), f.get("type").and_then(Json::as_str)) {
            (Some(d), _) => d
                .as_str()
                .ok_or_else(|| bad("dtype must be a str"))?
                .to_string(),
            (None, Some("VISUAL")) => "image".into(),
            (None, Some(_)) => "float32".into(),
            (None, None) => return Err(bad("neither a dtype nor a FeatureType")),
        };
        let names = match f.get("names") {
            Some(Json::Array(ns)) => {
                super::check_name_count(key, &shape, ns.len())?;
                ns.iter()
                    .map(|n| n.as_str().map(str::to_string))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| bad("names must be strs"))?
            }
            _ => Vec::new(),
        };
        features.push(Feature {
            key: key.clone(),
            dtype,
            shape,
            names,
        });
    }
    let rename_map = match obj.get("rename_map") {
        None | Some(Json::Null) => Vec::new(),
        Some(Json::Object(m)) => m
            .iter()
            .map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_string())))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| invalid("RemotePolicyConfig.rename_map must map str to str"))?,
        Some(_) => return Err(invalid("RemotePolicyConfig.rename_map must be an object")),
    };
    let setup = PolicySetup {
        policy_type: text("policy_type")?,
        pretrained_name_or_path: text("pretrained_name_or_path")?,
        features,
        actions_per_chunk: obj
            .get("actions_per_chunk")
            .and_then(Json::as_i64)
            .ok_or_else(|| invalid("RemotePolicyConfig.actions_per_chunk must be an int"))?,
        device: obj
            .get("device")
            .and_then(Json::as_str)
            .unwrap_or("cpu")
            .to_string(),
        rename_map,
    };
    super::check_setup(&setup)?;
    Ok(setup)
}

/// Writes the `TimedActions` reply: the JSON of each action's timestep and timestamp, then a
/// safetensors file of `action_<i>` (float32, one row each), as PR #3048's `serialize_actions`.
pub fn encode_actions<'a>(
    rows: impl ExactSizeIterator<Item = &'a [u8]> + Clone,
    at: crate::protocol::TimedStep,
    first: usize,
    dt: f64,
    buf: &mut Vec<u8>,
) {
    use std::io::Write;
    buf.clear();
    buf.extend_from_slice(&[0; 4]);
    let _ = write!(buf, r#"{{"type": "TimedActions", "actions": ["#);
    for i in 0..rows.len() {
        let crate::protocol::TimedStep {
            timestep: step,
            timestamp: t,
        } = crate::protocol::timed_step(at, dt, first + i);
        let sep = if i == 0 { "" } else { ", " };
        let _ = write!(buf, r#"{sep}{{"timestamp": {t:?}, "timestep": {step}}}"#);
    }
    buf.extend_from_slice(b"]}");
    let json_len = (buf.len() - 4) as u32;
    buf[..4].copy_from_slice(&json_len.to_be_bytes());
    // safetensors: u64 little-endian header length, the JSON header, the data.
    let header_at = buf.len();
    buf.extend_from_slice(&[0; 8]);
    buf.push(b'{');
    let mut offset = 0usize;
    for (i, row) in rows.clone().enumerate() {
        let sep = if i == 0 { "" } else { "," };
        let n = row.len() / 4;
        let _ = write!(
            buf,
            r#"{sep}"action_{i}":{{"dtype":"F32","shape":[{n}],"data_offsets":[{offset},{}]}}"#,
            offset + row.len()
        );
        offset += row.len();
    }
    buf.push(b'}');
    // Padded with spaces to 8 bytes, as safetensors writes it.
    while !(buf.len() - header_at - 8).is_multiple_of(8) {
        buf.push(b' ');
    }
    let header_len = (buf.len() - header_at - 8) as u64;
    buf[header_at..header_at + 8].copy_from_slice(&header_len.to_le_bytes());
    for row in rows {
        buf.extend_from_slice(row);
    }
}
