//! What does a finished slot's reply carry? Reading it out: non-finite checks, the rows of the
//! chunk a reply keeps, each output converted to its reply dtype, as [`Outputs`] for the dialect to
//! frame.

use super::{OutputBinding, Plan};
use crate::config::PacingConfig;
use crate::dtype::{ByteOrder, ElemType};
use crate::limits::MAX_RANK;
use crate::protocol::Encoder;
use crate::protocol::dialect::{Outputs, Precision};
use crate::transform::{Transform, all_finite};

/// Relative actions (`[[outputs]] relative_to`): the model predicts the masked columns relative
/// to an input, and the reply carries absolute values, `action[j] += input[j]` for each
/// `mask[j]` in every row, after un-normalising, in the reply's dtype (float32 adds as
/// LeRobot's `to_absolute_actions` does). The input's values are the request's, as sent: the
/// decode keeps them as float64 in a slot buffer ([`Plan::relative_source`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Relative {
    /// At most the output's columns and the input's length.
    pub mask: Vec<bool>,
}

impl Relative {
    /// Offsets the masked columns of every row of `dst` (rows of `cols` values of `t`,
    /// little-endian) by `raw` (float64 values, little-endian). A `raw` too short (no input
    /// captured) leaves `dst` as it is.
    fn apply(&self, t: ElemType, dst: &mut [u8], cols: usize, raw: &[u8]) {
        if raw.len() < self.mask.len() * 8 || cols == 0 {
            return;
        }
        let size = t.size();
        for row in dst.chunks_exact_mut(cols * size) {
            for (j, _) in self.mask.iter().enumerate().filter(|(_, on)| **on) {
                let mut v = [0u8; 8];
                v.copy_from_slice(&raw[j * 8..j * 8 + 8]);
                let v = f64::from_le_bytes(v);
                let e = &mut row[j * size..(j + 1) * size];
                match t {
                    ElemType::F32 => {
                        let x = f32::from_le_bytes([e[0], e[1], e[2], e[3]]);
                        e.copy_from_slice(&(x + v as f32).to_le_bytes());
                    }
                    ElemType::F64 => {
                        let mut b = [0u8; 8];
                        b.copy_from_slice(e);
                        e.copy_from_slice(&(f64::from_le_bytes(b) + v).to_le_bytes());
                    }
                    _ => {}
                }
            }
        }
    }
}

impl OutputBinding {
    /// The bytes of an engine output that `tr` reads: its kept rows (`rows`), or the whole
    /// output. A short buffer gives what there is, which `Transform::apply` then refuses.
    fn source<'b>(&self, output: &'b [u8], tr: &Transform) -> &'b [u8] {
        let len = tr.src_len * tr.src_type.size();
        output.get(self.offset..self.offset + len).unwrap_or(output)
    }

    /// `tr` from the engine output into `dst`, then the relative offset if the output has one.
    fn convert(&self, output: &[u8], tr: &Transform, raw: &[u8], dst: &mut [u8]) -> bool {
        let ok = tr.apply(self.source(output, tr), ByteOrder::Little, dst);
        if ok && let Some(bounds) = &self.clamp {
            crate::transform::clamp(tr.dst_type, dst, bounds);
        }
        if ok && let Some(r) = &self.relative {
            let cols = self.shape.last().copied().unwrap_or(1);
            r.apply(tr.dst_type, dst, cols, raw);
        }
        ok
    }
}

impl Plan {
    /// The most a WebSocket connection's write buffer holds for this plan: its largest frame
    /// (a reply or the metadata) and [`crate::limits::WS_WRITE_SLACK`] for the control and
    /// error frames queued beside it. The HTTP layer bounds tungstenite's buffer by it and the
    /// memory budget counts it.
    pub fn write_buffer(&self) -> usize {
        self.reply_capacity.max(self.metadata.len()) + crate::limits::WS_WRITE_SLACK
    }

    /// Names the first output that would reach the wire holding NaN or infinity, if any.
    /// The values are checked as sent in `precision` (after un-normalisation and the cast to
    /// the reply dtype, in `scratch`), so an overflow there (a large output times a large
    /// `std`, or a float64 value past float32's range on the vllm-omni route) is caught too.
    /// `raw`: the relative actions' input as sent (see [`Relative`]; empty without).
    ///
    /// Each output is converted here and again when the reply is written: twice is cheaper
    /// than keeping them. The check must finish before the reply's first byte (a non-finite
    /// output is answered with an error, not half a reply), the scratch holds one output
    /// (the largest, sized at start-up) rather than all of them, and a conversion is one
    /// pass over a chunk of a few thousand values, microseconds beside the engine's run.
    pub fn non_finite_reply(
        &self,
        outputs: &[Vec<u8>],
        scratch: &mut [u8],
        raw: &[u8],
        precision: Precision,
    ) -> Option<&str> {
        self.outputs.iter().find_map(|o| {
            let tr = o.transform(precision);
            let sent = scratch.get_mut(..tr.dst_bytes())?;
            let finite = o.convert(&outputs[o.index], tr, raw, sent)
                && all_finite(tr.dst_type, sent, ByteOrder::Little);
            (!finite).then_some(self.io.outputs[o.index].name.as_str())
        })
    }

    /// The rows of the action chunk a reply keeps: at most `pacing.actions_per_chunk`, and,
    /// with `pacing.skip_stale_actions`, without the first `delay_steps` (which will have
    /// elapsed on arrival). At least one row is always kept.
    pub fn chunk(&self, pacing: &PacingConfig, delay_steps: u32) -> Chunk {
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

    /// Writes one output as an ndarray, cut to the chunk's rows.
    pub(crate) fn write_output(
        &self,
        e: &mut Encoder<'_>,
        o: &OutputBinding,
        tr: &Transform,
        r: &mut ReplyParts<'_>,
    ) {
        let output: &[u8] = &r.outputs[o.index];
        let bytes = tr.dst_bytes();
        let rows = o.shape.first().copied().unwrap_or(1);
        let Chunk { start, end } = r.chunk;
        let whole = o.shape.len() < 2 || (start == 0 && end >= rows);
        if whole || rows == 0 || bytes > r.scratch.len() {
            e.ndarray(tr.dst_type, &o.shape, bytes, |d| {
                o.convert(output, tr, r.raw, d);
            });
            return;
        }
        let end = end.min(rows);
        let start = start.min(end);
        let row = bytes / rows;
        let scratch = &mut r.scratch[..bytes];
        o.convert(output, tr, r.raw, scratch);
        let mut shape: heapless::Vec<usize, { MAX_RANK }> = heapless::Vec::new();
        let _ = shape.extend_from_slice(&o.shape[..o.shape.len().min(MAX_RANK)]);
        shape[0] = end - start;
        e.ndarray(tr.dst_type, &shape, (end - start) * row, |d| {
            d.copy_from_slice(&scratch[start * row..end * row]);
        });
    }

    /// The outputs of a finished slot, ready for a dialect to frame.
    pub fn reply<'p, 'a>(&'p self, parts: &'p mut ReplyParts<'a>) -> Reply<'p, 'a> {
        let sent = parts.chunk.end;
        Reply {
            plan: self,
            parts,
            sent,
        }
    }
}

/// The rows `start..end` of the action chunk that a reply carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub start: usize,
    pub end: usize,
}

/// What a reply is encoded from: a slot's outputs, its scratch buffer, the chunk to keep, and
/// the relative actions' input as sent (empty without; see [`Relative`]).
pub struct ReplyParts<'a> {
    pub outputs: &'a [Vec<u8>],
    pub scratch: &'a mut [u8],
    pub chunk: Chunk,
    pub raw: &'a [u8],
}

/// A finished slot's outputs as its plan reads them: what a dialect frames.
pub struct Reply<'p, 'a> {
    plan: &'p Plan,
    parts: &'p mut ReplyParts<'a>,
    /// The end of the rows sent: the chunk's, or a front end's own cut ([`Reply::rows_f32`]).
    sent: usize,
}

impl Reply<'_, '_> {
    /// Output `i`'s kept rows (`start..stop`, `stop` at most the chunk's end) as float32,
    /// little-endian, and the bytes of one row: what a front end that frames rows itself
    /// (LeRobot's timed actions) sends. Converted in the slot's scratch buffer.
    pub fn rows_f32(&mut self, i: usize, stop: usize) -> Option<(&[u8], usize)> {
        let o = self.plan.outputs.get(i)?;
        let tr = &o.float32;
        if tr.dst_type != crate::dtype::ElemType::F32 {
            return None;
        }
        let bytes = tr.dst_bytes();
        let rows = if o.shape.len() >= 2 { o.shape[0] } else { 1 };
        let Chunk { start, end } = self.parts.chunk;
        let end = end.min(stop).min(rows);
        let start = start.min(end);
        self.sent = end;
        let output = &self.parts.outputs[o.index];
        let scratch = self.parts.scratch.get_mut(..bytes)?;
        if !o.convert(output, tr, self.parts.raw, scratch) {
            return None;
        }
        let row = bytes / rows.max(1);
        Some((&scratch[start * row..end * row], row))
    }

    /// The end of the chunk's rows this reply sent (rows before it the client had, from the
    /// chunk's first): what `[rtc]` keeps as the previous chunk.
    pub fn sent_rows(&self) -> usize {
        self.sent
    }

    /// The first row a reply keeps.
    pub fn first_row(&self) -> usize {
        self.parts.chunk.start
    }
}

impl Outputs for Reply<'_, '_> {
    fn count(&self) -> usize {
        self.plan.outputs.len()
    }

    fn key(&self, i: usize) -> &str {
        &self.plan.outputs[i].key
    }

    fn write(&mut self, i: usize, precision: Precision, e: &mut Encoder<'_>) {
        let o = &self.plan.outputs[i];
        let tr = o.transform(precision);
        self.plan.write_output(e, o, tr, self.parts);
    }

    fn rows(&self) -> (usize, usize) {
        (self.parts.chunk.start, self.parts.chunk.end)
    }
}
