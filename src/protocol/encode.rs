//! How is a reply written? Reply encoding: msgpack written into a reused buffer exactly as openpi's
//! `msgpack_numpy.packb` writes it (bin marker keys in openpi order, `dtype.str`, float64 timing
//! fields), byte for byte.

use crate::dtype::ElemType;

/// Appends msgpack to a reused `Vec<u8>`. Writing to a Vec cannot fail, so results are dropped.
pub struct Encoder<'a> {
    pub buf: &'a mut Vec<u8>,
}

impl Encoder<'_> {
    pub fn map(&mut self, n: u32) {
        let _ = rmp::encode::write_map_len(self.buf, n);
    }
    pub fn array(&mut self, n: u32) {
        let _ = rmp::encode::write_array_len(self.buf, n);
    }
    pub fn str(&mut self, s: &str) {
        let _ = rmp::encode::write_str(self.buf, s);
    }
    pub fn bin(&mut self, b: &[u8]) {
        let _ = rmp::encode::write_bin(self.buf, b);
    }
    pub fn bool(&mut self, b: bool) {
        let _ = rmp::encode::write_bool(self.buf, b);
    }
    pub fn int(&mut self, v: i64) {
        let _ = rmp::encode::write_sint(self.buf, v);
    }
    pub fn f64(&mut self, v: f64) {
        let _ = rmp::encode::write_f64(self.buf, v);
    }
    pub fn nil(&mut self) {
        let _ = rmp::encode::write_nil(self.buf);
    }

    /// Writes an openpi ndarray marker whose `len` data bytes `fill` writes in place:
    /// `{__ndarray__: true, data: <bin>, dtype: <str>, shape: [..]}` with bin keys.
    pub fn ndarray(
        &mut self,
        dtype: ElemType,
        shape: &[usize],
        len: usize,
        fill: impl FnOnce(&mut [u8]),
    ) {
        self.map(4);
        self.bin(b"__ndarray__");
        self.bool(true);
        self.bin(b"data");
        let _ = rmp::encode::write_bin_len(self.buf, len as u32);
        let start = self.buf.len();
        self.buf.resize(start + len, 0);
        fill(&mut self.buf[start..]);
        self.bin(b"dtype");
        self.str(dtype.numpy_str());
        self.bin(b"shape");
        self.array(shape.len() as u32);
        for &d in shape {
            self.int(d as i64);
        }
    }

    /// Bytes an [`Encoder::ndarray`] call writes, at most (for sizing buffers at start-up).
    pub fn ndarray_size(shape: &[usize], len: usize) -> usize {
        1 + 12 + 1 + 5 + 5 + len + 6 + 4 + 6 + 1 + 9 * shape.len()
    }
}

/// The two timing maps of an openpi reply (protocol §3.5), in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timing {
    /// Engine execution time.
    pub policy_infer_ms: f64,
    /// From the request frame being read to the reply being encoded.
    pub server_infer_ms: f64,
    /// The previous request on this connection, frame read to reply written; absent on the
    /// first request.
    pub prev_total_ms: Option<f64>,
    /// A pipeline's stages: prefix ms, denoising ms (all steps), steps run.
    pub stages: Option<super::StageTimes>,
}

/// Writes the two timing entries (`policy_timing`, `server_timing`) of an openpi reply.
pub fn encode_timing(enc: &mut Encoder<'_>, t: &Timing) {
    enc.str("policy_timing");
    enc.map(if t.stages.is_some() { 4 } else { 1 });
    enc.str("infer_ms");
    enc.f64(t.policy_infer_ms);
    if let Some(s) = t.stages {
        enc.str("prefix_ms");
        enc.f64(s.prefix_ms);
        enc.str("denoise_ms");
        enc.f64(s.denoise_ms);
        enc.str("steps");
        enc.int(i64::from(s.steps));
    }
    enc.str("server_timing");
    enc.map(if t.prev_total_ms.is_some() { 2 } else { 1 });
    enc.str("infer_ms");
    enc.f64(t.server_infer_ms);
    if let Some(p) = t.prev_total_ms {
        enc.str("prev_total_ms");
        enc.f64(p);
    }
}

/// Bytes the timing entries take, at most.
pub const TIMING_SIZE: usize =
    14 + 1 + 9 + 9 + 14 + 1 + 9 + 9 + 14 + 9 + (10 + 9) + (11 + 9) + (6 + 5);

/// Encodes a TOML value the way msgpack-python packs the equivalent Python value (ints in
/// their smallest form, floats as float64, tables as maps in file order).
pub fn encode_toml(enc: &mut Encoder<'_>, v: &toml::Value) {
    match v {
        toml::Value::String(s) => enc.str(s),
        toml::Value::Integer(i) => enc.int(*i),
        toml::Value::Float(f) => enc.f64(*f),
        toml::Value::Boolean(b) => enc.bool(*b),
        toml::Value::Datetime(d) => enc.str(&d.to_string()),
        toml::Value::Array(a) => {
            enc.array(a.len() as u32);
            for x in a {
                encode_toml(enc, x);
            }
        }
        toml::Value::Table(t) => {
            enc.map(t.len() as u32);
            for (k, x) in t {
                enc.str(k);
                encode_toml(enc, x);
            }
        }
    }
}
