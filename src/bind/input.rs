//! How do a request's values land in a slot? Writing them in: the decoder's [`Visitor`] converting
//! each bound value straight into its engine input buffer, text bindings, fill values for what the
//! request left out.

use super::{InputBinding, Plan, PlannerTap};
use crate::dtype::{ByteOrder, ElemType, WireDType};
use crate::engine::InputBuffer;
use crate::planner::Link;
use crate::protocol::{self, ArrayView, Value, Visitor, WireError};
use crate::transform::{all_finite, load_f64, load_f64_ordered};

impl Plan {
    /// Decodes a request frame straight into one slot's input buffers. Inputs the request
    /// leaves out are filled if optional; a missing required input is an error.
    pub fn decode(
        &self,
        frame: &[u8],
        bufs: &mut [Box<dyn InputBuffer>],
        seen: &mut [bool],
    ) -> Result<protocol::RequestMeta, WireError> {
        self.decode_with(frame, bufs, seen, None)
    }

    /// [`decode`](Self::decode) for a policy the task planner feeds through `planner`: its
    /// subtask fills the prompt binding (by `planner.precedence`), a client's prompt becomes
    /// its instruction, and the camera binding's frame is offered to it.
    pub fn decode_with(
        &self,
        frame: &[u8],
        bufs: &mut [Box<dyn InputBuffer>],
        seen: &mut [bool],
        planner: Option<&Link>,
    ) -> Result<protocol::RequestMeta, WireError> {
        seen.iter_mut().for_each(|s| *s = false);
        let tap = self.planner.as_ref().zip(planner);
        let mut w = SlotWriter {
            plan: self,
            tap,
            bufs,
            seen,
        };
        let meta = protocol::decode_request(frame, &self.limits, &mut w)?;
        if meta.endpoint == protocol::Endpoint::Reset {
            return Ok(meta);
        }
        w.finish()?;
        Ok(meta)
    }

    /// Binds values another front end has read (LeRobot's observation: key and value pairs)
    /// into one slot's input buffers, as [`decode_with`](Self::decode_with) binds a frame's:
    /// the same conversions and checks, then fills for what was left out. Keys no binding
    /// names are skipped.
    pub fn decode_values<'v>(
        &self,
        values: impl IntoIterator<Item = Result<(&'v str, Value<'v>), WireError>>,
        bufs: &mut [Box<dyn InputBuffer>],
        seen: &mut [bool],
        planner: Option<&Link>,
    ) -> Result<(), WireError> {
        seen.iter_mut().for_each(|s| *s = false);
        let mut w = SlotWriter {
            plan: self,
            tap: self.planner.as_ref().zip(planner),
            bufs,
            seen,
        };
        for v in values {
            let (key, value) = v?;
            if let Some(i) = w.binding(key.as_bytes()) {
                w.value(i, key.as_bytes(), value)?;
            }
        }
        w.finish()
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

    /// Completes the inputs with `history` for a session's request just decoded: its frame is
    /// the last; `history` holds the session's previous frames, which fill the others, and
    /// then takes the newest ones for its next request. A session's first request (`fresh`:
    /// new, reset, or another policy) repeats its frame in every position, as LeRobot's
    /// `populate_queues` fills its observation queues. Copies only: the session's buffer is
    /// allocated once, on its first request to this plan.
    pub fn stack_history(
        &self,
        bufs: &mut [Box<dyn InputBuffer>],
        history: &mut History,
        fresh: bool,
    ) {
        if self.history_bytes == 0 {
            return;
        }
        let fresh = fresh || history.plan != self.id || history.frames.len() != self.history_bytes;
        if history.frames.len() != self.history_bytes {
            history.frames = vec![0; self.history_bytes];
        }
        history.plan = self.id;
        let mut at = 0;
        for b in self.inputs.iter().filter(|b| b.history > 1) {
            let keep = (b.history - 1) * b.frame_bytes;
            let buf = bufs[b.index].bytes_mut();
            let (older, newest) = buf.split_at_mut(keep);
            let kept = &mut history.frames[at..at + keep];
            if fresh {
                for f in older.chunks_exact_mut(b.frame_bytes) {
                    f.copy_from_slice(newest);
                }
            } else {
                older.copy_from_slice(kept);
            }
            // The next request's previous frames: these, without the oldest.
            kept.copy_from_slice(&buf[b.frame_bytes..]);
            at += keep;
        }
    }

    /// Fills every input with its fill value (for warm-up).
    pub fn fill_all(&self, bufs: &mut [Box<dyn InputBuffer>]) {
        for b in &self.inputs {
            crate::transform::fill_bytes(b.engine_type, b.fill, bufs[b.index].bytes_mut());
        }
    }

    /// The raw (pre-normalisation; after a feature's map, where it has one) values of the
    /// similarity filter's input, from a decoded slot, into `out`. `None` when the filter is
    /// off.
    pub fn similarity_state<'o>(
        &self,
        bufs: &mut [Box<dyn InputBuffer>],
        out: &'o mut [f64; crate::limits::MAX_SIMILARITY_STATE],
    ) -> Option<&'o [f64]> {
        let b = &self.inputs[self.similarity_input?];
        let data = bufs[b.index].bytes_mut();
        let n = (data.len() / b.engine_type.size()).min(out.len());
        for (i, v) in out[..n].iter_mut().enumerate() {
            let x = load_f64(b.engine_type, data, i);
            *v = b.affine.before_normalising(i, x);
        }
        Some(&out[..n])
    }
}

/// Writes bound values into a slot's input buffers.
struct SlotWriter<'a> {
    plan: &'a Plan,
    /// The planner's tap and link, when the planner feeds this decode.
    tap: Option<(&'a PlannerTap, &'a Link)>,
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

impl SlotWriter<'_> {
    /// After the request's values: the planner's subtask into the prompt, fills for optional
    /// inputs left out, an error for a required one.
    fn finish(&mut self) -> Result<(), WireError> {
        if let Some((tap, link)) = self.tap {
            let b = &self.plan.inputs[tap.prompt];
            let sent = self.seen[tap.prompt];
            if !sent || link.planner_first {
                let subtask = link.subtask();
                if let Some(s) = subtask.as_deref() {
                    // The planner checked the length; a failure leaves the client's prompt.
                    if write_text(b, None, s.as_bytes(), self.bufs[b.index].bytes_mut()).is_ok() {
                        self.seen[tap.prompt] = true;
                    }
                }
            }
        }
        for (i, (b, seen)) in self.plan.inputs.iter().zip(self.seen.iter()).enumerate() {
            if let Some((at, ty)) = b.present {
                let flag = if *seen { 1.0 } else { 0.0 };
                crate::transform::fill_bytes(ty, flag, self.bufs[at].bytes_mut());
            }
            if !*seen {
                // openpi's `InjectDefaultPrompt`: only a request without a prompt gets it.
                if let Some(text) = b.tokens.as_ref().and_then(|t| t.default_prompt.as_deref()) {
                    // Its length was checked against the buffer at start-up.
                    write_text(b, None, text.as_bytes(), self.bufs[b.index].bytes_mut())?;
                    continue;
                }
                if !b.optional {
                    if self.plan.planner.as_ref().is_some_and(|t| t.prompt == i) {
                        return Err(WireError::NoSubtaskYet { key: b.key.clone() });
                    }
                    return Err(WireError::MissingKey { key: b.key.clone() });
                }
                crate::transform::fill_bytes(b.engine_type, b.fill, self.bufs[b.index].bytes_mut());
            }
        }
        Ok(())
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
        match value {
            Value::Array(a) if b.text => Err(WireError::ExpectedText {
                key: b.key.clone(),
                got: dtype_name(a.declared),
            }),
            Value::Text { dtype, data } if b.text => self.text(i, dtype, data),
            Value::Array(a) => self.array(i, a),
            Value::Text { dtype, .. } => Err(WireError::WrongDType {
                key: b.key.clone(),
                expected: expected_types(b),
                got: dtype.map(dtype_name).unwrap_or_else(|| "text".into()),
            }),
        }
    }
}

impl SlotWriter<'_> {
    /// A string for text binding `i`; the planner's instruction too when it is the prompt.
    fn text(&mut self, i: usize, dtype: Option<WireDType>, data: &[u8]) -> Result<(), WireError> {
        let b = &self.plan.inputs[i];
        write_text(b, dtype, data, self.bufs[b.index].bytes_mut())?;
        let Some((tap, link)) = self.tap else {
            return Ok(());
        };
        if tap.prompt != i || !link.planner_first {
            return Ok(());
        }
        // The client's prompt is the planner's instruction (valid UTF-8 by now).
        match dtype {
            None | Some(WireDType::Bytes(_)) => {
                let end = data.iter().rposition(|&c| c != 0).map_or(0, |e| e + 1);
                link.client_instruction(&data[..end]);
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
                link.client_instruction(&bytes);
            }
        }
        Ok(())
    }

    /// An array for numeric binding `i`: checked, transformed into the engine's buffer (the
    /// last of its frames), checked again, clipped; kept as sent for relative actions.
    fn array(&mut self, i: usize, a: ArrayView<'_>) -> Result<(), WireError> {
        let b = &self.plan.inputs[i];
        let pos = check_array(b, &a)?;
        if let Some((tap, link)) = self.tap
            && tap.camera == Some(i)
            && a.storage == ElemType::U8
        {
            link.offer_image(a.data);
        }
        // With `history`, the request's frame is the last of the input's frames.
        let buf = self.bufs[b.index].bytes_mut();
        let dst = &mut buf[(b.history - 1) * b.frame_bytes..];
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
        // Integer wire data cannot be NaN, and the config's coefficients are finite.
        if b.check_finite && a.storage.is_float() {
            if !all_finite(a.storage, a.data, a.order) {
                return Err(WireError::NonFinite { key: b.key.clone() });
            }
            if !all_finite(b.engine_type, dst, ByteOrder::Little) {
                return Err(WireError::Overflows {
                    key: b.key.clone(),
                    engine: b.engine_type.name(),
                });
            }
        }
        // `clip`, after the checks: a value that overflowed the engine's type is refused, not
        // clamped.
        if let Some((lo, hi)) = b.clip {
            crate::transform::clamp(b.engine_type, &mut dst[..b.frame_bytes], &[(lo, hi)]);
        }
        // Relative actions' input: its values as sent, as float64.
        if let Some(raw) = b.raw {
            let size = a.storage.size();
            let raw = self.bufs[raw].bytes_mut();
            for (k, out) in raw.chunks_exact_mut(8).enumerate() {
                let v = a
                    .data
                    .get(k * size..(k + 1) * size)
                    .map_or(0.0, |d| load_f64_ordered(a.storage, d, a.order));
                out.copy_from_slice(&v.to_le_bytes());
            }
        }
        Ok(())
    }
}

/// An array's dtype and shape against binding `b`: the accepted dtype's index (`None`: a
/// native scalar, converted from its storage type).
fn check_array(b: &InputBinding, a: &ArrayView<'_>) -> Result<Option<usize>, WireError> {
    let declared = match a.declared {
        WireDType::Num(t, _) => t,
        other => {
            return Err(WireError::WrongDType {
                key: b.key.clone(),
                expected: expected_types(b),
                got: dtype_name(other),
            });
        }
    };
    let pos = b.accepted.iter().position(|(t, _)| *t == declared);
    if pos.is_none() && !a.native {
        return Err(WireError::WrongDType {
            key: b.key.clone(),
            expected: expected_types(b),
            got: declared.name().into(),
        });
    }
    // A one-value vector may also come as a bare number, as openpi's DROID inputs take the
    // gripper position (`ndim == 0` gets an axis).
    let one_value = a.shape.is_empty() && b.shape.as_slice() == [1];
    if a.shape.as_slice() != b.shape.as_slice() && !one_value {
        return Err(WireError::WrongShape {
            key: b.key.clone(),
            expected: b.shape.clone(),
            got: a.shape.to_vec(),
        });
    }
    Ok(pos)
}

/// The binding's accepted dtypes, for an error.
fn expected_types(b: &InputBinding) -> String {
    b.accepted
        .iter()
        .map(|(t, _)| t.name())
        .collect::<Vec<_>>()
        .join(" or ")
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
    // A prompt to tokenize and truncate is cut at a character boundary: what lies past
    // `max_prompt_bytes` cannot reach the first `max_tokens` tokens (see `bind::tokens`).
    let cut = b.tokens.as_ref().is_some_and(|t| !t.refuse_overflow);
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
            let mut written = 0usize;
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
                written += c.len_utf8();
                if cut && written > max {
                    break;
                }
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
            let mut text = &data[..end];
            if std::str::from_utf8(text).is_err() {
                return Err(WireError::BadText {
                    key: b.key.clone(),
                    encoding: "UTF-8",
                });
            }
            if cut && text.len() > max {
                let mut at = max;
                while at > 0 && (text[at] & 0xc0) == 0x80 {
                    at -= 1;
                }
                text = &text[..at];
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

/// A session's previous frames for the inputs with `history` (LeRobot's observation queues),
/// in fixed buffers: sized once for a plan, then only copied into.
#[derive(Debug, Default)]
pub struct History {
    /// The plan the frames were taken for (0: none yet).
    plan: u64,
    frames: Vec<u8>,
}
