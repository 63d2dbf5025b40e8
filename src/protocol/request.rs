//! What does a request frame say? The OpenPI wire format: msgpack with numpy array markers,
//! decoded in one pass.
//!
//! Decoding walks the frame once and hands each value whose key path a binding names to a
//! [`Visitor`], as a view into the frame (no copy, no allocation); the visitor converts it
//! straight into an engine input buffer. Everything else is skipped by length. Both array
//! dialects are understood (openpi's `__ndarray__`/`__npgeneric__` and lebedov's `nd`, keys as
//! msgpack str or bin); structured, object (pickle) and complex arrays are refused before their
//! data is looked at. Depth, map sizes and ranks are capped, so a hostile frame costs at most a
//! linear scan of its bytes. [`peek_policy`] reads only a frame's `policy` (a server of
//! several policies routes by it before the named one decodes the frame); the reserved keys
//! ([`RESERVED_KEYS`]: `endpoint`, `policy`, `session_id`, `timestep`, …) become the
//! request's [`RequestMeta`]. Replies are [`super::encode`]'s.

use super::msgpack::{Cursor, Head, MsgpackError};
use crate::dtype::{ByteOrder, DTypeError, ElemType, WireDType, parse_numpy_dtype};
use crate::limits::{MAX_PATH, MAX_RANK, MAX_SESSION_ID};

/// A session id, held inline (no allocation per request).
pub type SessionId = heapless::String<MAX_SESSION_ID>;
/// An array shape, held inline.
pub type Shape = heapless::Vec<usize, MAX_RANK>;

/// Structural caps applied while decoding (the msgpack reader's walk).
pub use super::msgpack::Limits;

/// A decoding failure. Messages name the key and say what was expected and what arrived.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum WireError {
    #[error("the frame is empty; send one msgpack map")]
    Empty,
    /// Another front end's payload (LeRobot's) was read but does not fit the policy.
    #[error("{0}")]
    Payload(String),
    /// A LeRobot payload its reader refused: counted apart from payloads that read but do not
    /// fit (the JSON + safetensors reader's refusals are all of that kind, `Payload`; what is
    /// left is the strict pickle reader's, or an empty payload).
    #[error("pickle: {0}")]
    Lerobot(super::lerobot::LerobotError),
    #[error("not msgpack: byte 0x{byte:02x} at offset {offset} is not a valid msgpack marker")]
    NotMsgpack { byte: u8, offset: usize },
    #[error("truncated msgpack: the frame ends at byte {len} but a value needs {need} more")]
    Truncated { len: usize, need: usize },
    #[error("{extra} trailing bytes after the msgpack value; send exactly one map per frame")]
    TrailingBytes { extra: usize },
    #[error("the request must be a msgpack map of observation keys, got {got}")]
    TopLevelNotMap { got: &'static str },
    #[error("nesting deeper than {max} levels")]
    TooDeep { max: usize },
    #[error("{what} with {entries} entries exceeds the limit of {max}")]
    TooManyEntries {
        what: &'static str,
        entries: u64,
        max: usize,
    },
    #[error("key '{key}': {reason}")]
    BadArray { key: String, reason: String },
    #[error("key '{key}': {dtype}")]
    RejectedDType { key: String, dtype: DTypeError },
    #[error(
        "key '{key}': shape {shape:?} with itemsize {itemsize} needs {expected} data bytes, got {got}"
    )]
    LengthMismatch {
        key: String,
        shape: Vec<usize>,
        itemsize: usize,
        expected: u128,
        got: usize,
    },
    #[error("key '{key}': expected {expected}, got {got}")]
    WrongType {
        key: String,
        expected: String,
        got: String,
    },
    #[error("key '{key}': expected dtype {expected}, got {got}")]
    WrongDType {
        key: String,
        expected: String,
        got: String,
    },
    #[error("key '{key}': expected shape {expected:?}, got {got:?}")]
    WrongShape {
        key: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    #[error(
        "key '{key}': the text is {got} bytes of UTF-8; the binding holds at most {max} (its shape; for a tokenized prompt, tokenizer.max_prompt_bytes)"
    )]
    TextTooLong { key: String, max: usize, got: usize },
    #[error(
        "key '{key}': the prompt is {got} tokens; the policy takes at most {max} \
         (tokenizer.max_tokens, overflow = \"refuse\"): shorten it"
    )]
    TooManyTokens { key: String, max: usize, got: usize },
    #[error("key '{key}': {reason}")]
    Tokenize { key: String, reason: String },
    #[error("key '{key}': expected text (a str), got an array of {got}")]
    ExpectedText { key: String, got: String },
    #[error("key '{key}': the text is not valid {encoding}")]
    BadText { key: String, encoding: &'static str },
    #[error("endpoint 'observe' {problem}")]
    Observe { problem: &'static str },
    #[error(
        "key '{key}' holds NaN or infinity; policyd refuses non-finite inputs (check the \
         sensor, or set allow_non_finite = true on this [[inputs]] binding)"
    )]
    NonFinite { key: String },
    #[error(
        "key '{key}' holds a value that overflows the engine input ({engine}) once converted \
         and normalised; policyd refuses non-finite inputs (check the sensor, or set \
         allow_non_finite = true on this [[inputs]] binding)"
    )]
    Overflows { key: String, engine: &'static str },
    #[error("missing required key '{key}'")]
    MissingKey { key: String },
    #[error(
        "missing required key '{key}', and the task planner has not named a subtask yet: send \
         a prompt, or wait for the planner (see /metrics, policyd_planner_up)"
    )]
    NoSubtaskYet { key: String },
    #[error("key '{key}' appears twice")]
    DuplicateKey { key: String },
    #[error("unknown endpoint '{got}'; expected one of: infer, observe, reset")]
    UnknownEndpoint { got: String },
    #[error("'{key}' must be {expected}, got {got}")]
    BadReserved {
        key: &'static str,
        expected: &'static str,
        got: String,
    },
}

impl From<MsgpackError> for WireError {
    fn from(e: MsgpackError) -> Self {
        match e {
            MsgpackError::Empty => WireError::Empty,
            MsgpackError::NotMsgpack { byte, offset } => WireError::NotMsgpack { byte, offset },
            MsgpackError::Truncated { len, need } => WireError::Truncated { len, need },
            MsgpackError::TooDeep { max } => WireError::TooDeep { max },
        }
    }
}

impl WireError {
    /// A refusal of NaN or infinity in an input (counted apart in `/metrics`).
    pub fn is_non_finite(&self) -> bool {
        matches!(
            self,
            WireError::NonFinite { .. } | WireError::Overflows { .. }
        )
    }
}

impl RequestMeta {
    /// An `observe` request's timestep and timestamp, checked.
    pub fn observed_at(&self) -> Result<super::TimedStep, WireError> {
        let timestep = self.timestep.ok_or(WireError::Observe {
            problem: "needs 'timestep' (an integer: the control step the observation was taken at)",
        })?;
        if timestep < 0 {
            return Err(WireError::Observe {
                problem: "needs a 'timestep' of 0 or more",
            });
        }
        let timestamp = self.timestamp.ok_or(WireError::Observe {
            problem: "needs 'timestamp' (a number: seconds on the robot's clock)",
        })?;
        if !timestamp.is_finite() || timestamp < 0.0 {
            return Err(WireError::Observe {
                problem: "needs a finite 'timestamp' of 0 or more",
            });
        }
        Ok(super::TimedStep {
            timestep,
            timestamp,
        })
    }
}

/// What the client asked for (the `endpoint` key; absent means infer).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Endpoint {
    #[default]
    Infer,
    Reset,
    Observe,
}

impl Endpoint {
    pub const ALL: [Endpoint; 3] = [Endpoint::Infer, Endpoint::Observe, Endpoint::Reset];

    /// Label `endpoint` in `/metrics`.
    pub const fn label(self) -> &'static str {
        match self {
            Endpoint::Infer => "infer",
            Endpoint::Observe => "observe",
            Endpoint::Reset => "reset",
        }
    }
}

/// The reserved keys of a request, removed before inputs are bound.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RequestMeta {
    pub endpoint: Endpoint,
    pub session_id: Option<SessionId>,
    pub seed: Option<i64>,
    /// `sampling_params.num_inference_steps`, for engines that sample.
    pub num_inference_steps: Option<i64>,
    pub timestep: Option<i64>,
    pub timestamp: Option<f64>,
    pub must_go: Option<bool>,
    /// The policy the client names (servers with several policies).
    pub policy: Option<PolicyName>,
}

/// A policy's name as a request carries it.
pub type PolicyName = heapless::String<{ crate::limits::MAX_POLICY_NAME }>;

/// Top-level keys policyd interprets itself; bindings may not name them.
pub const RESERVED_KEYS: [&str; 8] = [
    "endpoint",
    "policy",
    "session_id",
    "seed",
    "sampling_params",
    "timestep",
    "timestamp",
    "must_go",
];

/// A numeric array (or scalar) inside a frame, not copied.
#[derive(Clone, Debug, PartialEq)]
pub struct ArrayView<'a> {
    /// The dtype the client declared.
    pub declared: WireDType,
    /// How `data` is stored. Differs from `declared` only for openpi scalars, whose value is a
    /// native msgpack number (a float32 scalar travels as a msgpack float64), and for plain
    /// msgpack numbers.
    pub storage: ElemType,
    pub order: ByteOrder,
    pub shape: Shape,
    pub data: &'a [u8],
    /// A plain msgpack number: the client declared no dtype, so any numeric binding takes it.
    pub native: bool,
}

/// A value handed to a visitor.
#[derive(Clone, Debug, PartialEq)]
pub enum Value<'a> {
    /// A numeric ndarray or scalar.
    Array(ArrayView<'a>),
    /// Text: a msgpack str or bin, or a numpy string array (declared dtype, raw data).
    Text {
        dtype: Option<WireDType>,
        data: &'a [u8],
    },
}

/// Receives the values whose key paths a binding names.
pub trait Visitor {
    /// The binding that a key path (`images/cam_high`) names, if any.
    fn binding(&self, path: &[u8]) -> Option<usize>;
    /// A value for binding `index`, found at `path`.
    fn value(&mut self, index: usize, path: &[u8], value: Value<'_>) -> Result<(), WireError>;
}

/// The `policy` a frame names, read without binding anything: a server of several policies
/// routes a frame by it before the policy it names decodes it.
pub fn peek_policy(frame: &[u8], limits: &Limits) -> Option<PolicyName> {
    struct Nothing;
    impl Visitor for Nothing {
        fn binding(&self, _: &[u8]) -> Option<usize> {
            None
        }
        fn value(&mut self, _: usize, _: &[u8], _: Value<'_>) -> Result<(), WireError> {
            Ok(())
        }
    }
    decode_request(frame, limits, &mut Nothing).ok()?.policy
}

/// Decodes one request frame: reserved keys into the returned [`RequestMeta`], bound values
/// into the visitor, the rest skipped.
pub fn decode_request<V: Visitor>(
    frame: &[u8],
    limits: &Limits,
    visitor: &mut V,
) -> Result<RequestMeta, WireError> {
    if frame.is_empty() {
        return Err(WireError::Empty);
    }
    let mut cur = Cursor::new(frame);
    let n = match cur.head()? {
        Head::Map(n) => n,
        other => {
            return Err(WireError::TopLevelNotMap {
                got: other.describe(),
            });
        }
    };
    check_entries("the top-level map", n, limits)?;
    let mut meta = RequestMeta::default();
    let mut path: heapless::Vec<u8, MAX_PATH> = heapless::Vec::new();
    for _ in 0..n {
        let Some(key) = cur.key()? else {
            cur.skip(limits, 1)?;
            continue;
        };
        if read_reserved(&mut cur, key, &mut meta, limits)? {
            continue;
        }
        path.clear();
        if path.extend_from_slice(key).is_err() {
            cur.skip(limits, 1)?;
            continue;
        }
        walk(&mut cur, &mut path, 1, limits, visitor)?;
    }
    if cur.pos != frame.len() {
        return Err(WireError::TrailingBytes {
            extra: frame.len() - cur.pos,
        });
    }
    Ok(meta)
}

fn check_entries(what: &'static str, n: u32, limits: &Limits) -> Result<(), WireError> {
    if n as usize > limits.max_entries {
        return Err(WireError::TooManyEntries {
            what,
            entries: u64::from(n),
            max: limits.max_entries,
        });
    }
    Ok(())
}

fn lossy(b: &[u8]) -> String {
    let s = String::from_utf8_lossy(b);
    let mut t = String::new();
    for (n, c) in s.chars().enumerate() {
        if n == 64 {
            t.push('…');
            break;
        }
        // Escaped: the message reaches logs, where a newline would start a forged line.
        if c.is_control() {
            t.extend(c.escape_default());
        } else {
            t.push(c);
        }
    }
    t
}

/// Handles a reserved top-level key; returns false if `key` is not reserved.
fn read_reserved(
    cur: &mut Cursor<'_>,
    key: &[u8],
    meta: &mut RequestMeta,
    limits: &Limits,
) -> Result<bool, WireError> {
    let bad = |key: &'static str, expected: &'static str, got: String| WireError::BadReserved {
        key,
        expected,
        got,
    };
    match key {
        b"endpoint" => match cur.head()? {
            Head::Str(s) | Head::Bin(s) => {
                meta.endpoint = match s {
                    b"infer" => Endpoint::Infer,
                    b"reset" => Endpoint::Reset,
                    b"observe" => Endpoint::Observe,
                    other => return Err(WireError::UnknownEndpoint { got: lossy(other) }),
                }
            }
            other => return Err(bad("endpoint", "a string", other.describe().into())),
        },
        b"session_id" => {
            let mut id = SessionId::new();
            match cur.head()? {
                Head::Str(s) | Head::Bin(s) => {
                    let s = std::str::from_utf8(s)
                        .map_err(|_| bad("session_id", "UTF-8 text", "invalid UTF-8".into()))?;
                    id.push_str(s).map_err(|_| {
                        bad(
                            "session_id",
                            "at most 64 bytes",
                            format!("{} bytes", s.len()),
                        )
                    })?;
                }
                Head::Int { ty, data } => {
                    use std::fmt::Write;
                    let v = int_value(ty, data);
                    let _ = write!(id, "{v}");
                }
                other => {
                    return Err(bad(
                        "session_id",
                        "a string or an integer",
                        other.describe().into(),
                    ));
                }
            }
            meta.session_id = Some(id);
        }
        b"seed" => match cur.head()? {
            Head::Int { ty, data } => meta.seed = Some(int_value(ty, data) as i64),
            Head::Nil => {}
            other => return Err(bad("seed", "an integer", other.describe().into())),
        },
        b"sampling_params" => match cur.head()? {
            Head::Map(n) => {
                check_entries("sampling_params", n, limits)?;
                for _ in 0..n {
                    let key = cur.key()?;
                    if key == Some(b"num_inference_steps".as_slice()) {
                        match cur.head()? {
                            Head::Int { ty, data } => {
                                meta.num_inference_steps = Some(int_value(ty, data) as i64)
                            }
                            other => {
                                return Err(bad(
                                    "sampling_params.num_inference_steps",
                                    "an integer",
                                    other.describe().into(),
                                ));
                            }
                        }
                    } else {
                        cur.skip(limits, 1)?;
                    }
                }
            }
            Head::Nil => {}
            other => return Err(bad("sampling_params", "a map", other.describe().into())),
        },
        b"timestep" => match cur.head()? {
            Head::Int { ty, data } => {
                let v = int_value(ty, data);
                meta.timestep = Some(
                    i64::try_from(v)
                        .map_err(|_| bad("timestep", "a 64-bit integer", v.to_string()))?,
                );
            }
            other => return Err(bad("timestep", "an integer", other.describe().into())),
        },
        b"timestamp" => {
            let v = match cur.head()? {
                Head::Float { ty, data } => float_value(ty, data),
                Head::Int { ty, data } => int_value(ty, data) as f64,
                other => return Err(bad("timestamp", "a number", other.describe().into())),
            };
            meta.timestamp = Some(v);
        }
        b"must_go" => match cur.head()? {
            Head::Bool(b) => meta.must_go = Some(b),
            other => return Err(bad("must_go", "a bool", other.describe().into())),
        },
        b"policy" => match cur.head()? {
            Head::Str(s) | Head::Bin(s) => {
                let s = std::str::from_utf8(s)
                    .map_err(|_| bad("policy", "UTF-8 text", "invalid UTF-8".into()))?;
                let mut name = PolicyName::new();
                name.push_str(s).map_err(|_| {
                    bad(
                        "policy",
                        "a policy name of at most 64 bytes",
                        format!("{} bytes", s.len()),
                    )
                })?;
                meta.policy = Some(name);
            }
            other => return Err(bad("policy", "a string", other.describe().into())),
        },
        _ => return Ok(false),
    }
    Ok(true)
}

/// Walks the value at the cursor whose key path is `path`.
fn walk<V: Visitor>(
    cur: &mut Cursor<'_>,
    path: &mut heapless::Vec<u8, MAX_PATH>,
    depth: usize,
    limits: &Limits,
    visitor: &mut V,
) -> Result<(), WireError> {
    let bound = visitor.binding(path);
    let head = cur.head()?;
    let n = match head {
        Head::Map(n) => n,
        Head::Array(n) => {
            if bound.is_some() {
                return Err(WireError::WrongType {
                    key: lossy(path),
                    expected: "a numpy array".into(),
                    got: format!("a msgpack list of {n} items (send a numpy array)"),
                });
            }
            cur.skip_items(u64::from(n), depth + 1, limits)?;
            return Ok(());
        }
        other => {
            if let Some(i) = bound {
                let value = scalar_value(&other).ok_or_else(|| WireError::WrongType {
                    key: lossy(path),
                    expected: "a numpy array".into(),
                    got: other.describe().into(),
                })?;
                visitor.value(i, path, value)?;
            }
            return Ok(());
        }
    };
    if depth + 1 > limits.max_depth {
        return Err(WireError::TooDeep {
            max: limits.max_depth,
        });
    }
    check_entries("a map", n, limits)?;
    let kind = classify(cur, n, depth, limits)?;
    if kind == MapKind::Plain {
        if let Some(_i) = bound {
            return Err(WireError::WrongType {
                key: lossy(path),
                expected: "a numpy array".into(),
                got: "a map".into(),
            });
        }
        let base = path.len();
        for _ in 0..n {
            let Some(key) = cur.key()? else {
                cur.skip(limits, 1)?;
                continue;
            };
            path.truncate(base);
            if path.push(b'/').is_err() || path.extend_from_slice(key).is_err() {
                // Longer than any binding can be: nothing below it is wanted.
                path.truncate(base);
                cur.skip_items(1, depth + 1, limits)?;
                continue;
            }
            walk(cur, path, depth + 1, limits, visitor)?;
        }
        path.truncate(base);
        return Ok(());
    }
    let Some(i) = bound else {
        cur.skip_entries(n, depth + 1, limits)?;
        return Ok(());
    };
    let value = read_marker(cur, n, kind, path, depth, limits)?;
    visitor.value(i, path, value)
}

/// A scalar msgpack value as a 0-D array (or text), pointing into the frame.
fn scalar_value<'a>(head: &Head<'a>) -> Option<Value<'a>> {
    const FALSE: &[u8] = &[0];
    const TRUE: &[u8] = &[1];
    let (ty, data) = match *head {
        Head::Int { ty, data } => (ty, data),
        Head::Float { ty, data } => (ty, data),
        Head::Bool(b) => (ElemType::Bool, if b { TRUE } else { FALSE }),
        Head::Str(s) | Head::Bin(s) => {
            return Some(Value::Text {
                dtype: None,
                data: s,
            });
        }
        _ => return None,
    };
    Some(Value::Array(ArrayView {
        declared: WireDType::Num(ty, ByteOrder::Big),
        storage: ty,
        order: ByteOrder::Big,
        shape: Shape::new(),
        data,
        native: true,
    }))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MapKind {
    Plain,
    OpenpiArray,
    OpenpiScalar,
    NdArray,
    NdScalar,
}

/// Looks at a map's keys (without consuming it) to tell an array marker from a user map.
fn classify(cur: &Cursor<'_>, n: u32, depth: usize, limits: &Limits) -> Result<MapKind, WireError> {
    let mut c = cur.clone();
    let (mut ndarray, mut npgeneric, mut kind) = (false, false, false);
    let mut nd: Option<bool> = None;
    for _ in 0..n {
        match c.key()? {
            Some(b"__ndarray__") => ndarray = true,
            Some(b"__npgeneric__") => npgeneric = true,
            Some(b"kind") => kind = true,
            Some(b"nd") => {
                let h = c.head()?;
                nd = Some(match h {
                    Head::Bool(b) => b,
                    Head::Int { ty, data } => int_value(ty, data) != 0,
                    _ => {
                        if let Head::Array(m) | Head::Map(m) = h {
                            let per = if matches!(h, Head::Map(_)) { 2 } else { 1 };
                            c.skip_items(u64::from(m) * per, depth + 2, limits)?;
                        }
                        false
                    }
                });
                continue;
            }
            Some(_) => {}
            None => {
                c.skip_items(1, depth + 1, limits)?;
            }
        }
        c.skip_items(1, depth + 1, limits)?;
    }
    Ok(if ndarray {
        MapKind::OpenpiArray
    } else if npgeneric {
        MapKind::OpenpiScalar
    } else if kind && nd == Some(true) {
        MapKind::NdArray
    } else if kind && nd == Some(false) {
        MapKind::NdScalar
    } else {
        MapKind::Plain
    })
}

/// Reads an array or scalar marker map of `n` entries.
fn read_marker<'a>(
    cur: &mut Cursor<'a>,
    n: u32,
    kind: MapKind,
    path: &[u8],
    depth: usize,
    limits: &Limits,
) -> Result<Value<'a>, WireError> {
    let key = || lossy(path);
    let bad = |reason: &str| WireError::BadArray {
        key: lossy(path),
        reason: reason.to_string(),
    };
    let mut data: Option<Head<'a>> = None;
    let mut dtype: Option<Head<'a>> = None;
    let mut kind_val: Option<&'a [u8]> = None;
    let mut shape: Option<Shape> = None;
    let dtype_key: &[u8] = match kind {
        MapKind::NdArray | MapKind::NdScalar => b"type",
        _ => b"dtype",
    };
    for _ in 0..n {
        let k = cur.key()?;
        match k {
            Some(b"data") => data = Some(cur.head_skipping(depth + 1, limits)?),
            Some(k) if k == dtype_key => dtype = Some(cur.head_skipping(depth + 1, limits)?),
            Some(b"kind") if matches!(kind, MapKind::NdArray | MapKind::NdScalar) => {
                match cur.head_skipping(depth + 1, limits)? {
                    Head::Str(s) | Head::Bin(s) => kind_val = Some(s),
                    _ => return Err(bad("'kind' must be a string")),
                }
            }
            Some(b"shape") if matches!(kind, MapKind::OpenpiArray | MapKind::NdArray) => {
                let m = match cur.head()? {
                    Head::Array(m) => m,
                    _ => return Err(bad("'shape' must be a list of integers")),
                };
                if m as usize > MAX_RANK {
                    return Err(bad(&format!("rank {m} exceeds the limit of {MAX_RANK}")));
                }
                let mut s = Shape::new();
                for _ in 0..m {
                    match cur.head()? {
                        Head::Int { ty, data } => {
                            let v = int_value(ty, data);
                            let v = usize::try_from(v).map_err(|_| {
                                bad(&format!("shape entry {v} is not a non-negative integer"))
                            })?;
                            let _ = s.push(v);
                        }
                        _ => return Err(bad("'shape' must be a list of integers")),
                    }
                }
                shape = Some(s);
            }
            Some(_) => cur.skip_items(1, depth + 1, limits)?,
            None => cur.skip_items(1, depth + 1, limits)?,
        }
    }
    // nd: kinds V and O are refused before `type` is even looked at (object data is a pickle).
    if let Some(kv) = kind_val {
        match kv {
            b"V" => {
                return Err(WireError::RejectedDType {
                    key: key(),
                    dtype: DTypeError::Structured,
                });
            }
            b"O" => {
                return Err(WireError::RejectedDType {
                    key: key(),
                    dtype: DTypeError::Object,
                });
            }
            _ => {}
        }
    }
    let dtype_name = match kind {
        MapKind::NdArray | MapKind::NdScalar => "'type'",
        _ => "'dtype'",
    };
    let dtype_bytes = match dtype {
        Some(Head::Str(s)) | Some(Head::Bin(s)) => s,
        Some(_) => return Err(bad(&format!("{dtype_name} must be a numpy dtype string"))),
        None => return Err(bad(&format!("array marker without {dtype_name}"))),
    };
    let declared = parse_numpy_dtype(dtype_bytes).map_err(|e| match e {
        DTypeError::Malformed => bad(&format!(
            "{dtype_name} '{}' is not a numpy dtype string",
            lossy(dtype_bytes)
        )),
        e => WireError::RejectedDType {
            key: key(),
            dtype: e,
        },
    })?;
    if let Some(kv) = kind_val
        && !kv.is_empty()
        && kv != [declared.kind()]
    {
        return Err(bad(&format!(
            "'kind' '{}' does not match type '{}'",
            lossy(kv),
            lossy(dtype_bytes)
        )));
    }
    let data = data.ok_or_else(|| bad("array marker without 'data'"))?;
    if kind == MapKind::OpenpiScalar {
        // openpi sends a scalar's value as a native msgpack value.
        return match (declared, data) {
            (WireDType::Num(..), Head::Int { ty, data })
            | (WireDType::Num(..), Head::Float { ty, data }) => Ok(Value::Array(ArrayView {
                declared,
                storage: ty,
                order: ByteOrder::Big,
                shape: Shape::new(),
                data,
                native: false,
            })),
            (WireDType::Num(..), Head::Bool(b)) => Ok(Value::Array(ArrayView {
                declared,
                storage: ElemType::Bool,
                order: ByteOrder::Little,
                shape: Shape::new(),
                data: if b { &[1] } else { &[0] },
                native: false,
            })),
            (WireDType::Unicode(..) | WireDType::Bytes(_), Head::Str(s) | Head::Bin(s)) => {
                Ok(Value::Text {
                    dtype: None,
                    data: s,
                })
            }
            (_, other) => Err(bad(&format!(
                "scalar 'data' is {}, which does not fit dtype '{}'",
                other.describe(),
                lossy(dtype_bytes)
            ))),
        };
    }
    // Only bin: openpi (`np.ndarray(buffer=…)`) and vllm-omni (`np.frombuffer`) both fail on a
    // str, and a str's bytes would have to be valid UTF-8, which array data is not.
    let data = match data {
        Head::Bin(b) => b,
        Head::Str(_) => {
            return Err(bad(
                "'data' is a msgpack str; array data must be bin (bytes): pack with \
                 msgpack >= 1.0 or use_bin_type=True",
            ));
        }
        other => {
            return Err(bad(&format!(
                "'data' must be bytes, got {}",
                other.describe()
            )));
        }
    };
    let shape = match kind {
        MapKind::NdScalar => Shape::new(),
        _ => shape.ok_or_else(|| bad("array marker without 'shape'"))?,
    };
    let itemsize = declared.itemsize();
    let expected = shape
        .iter()
        .try_fold(itemsize as u128, |acc, &d| acc.checked_mul(d as u128))
        .ok_or_else(|| bad(&format!("shape {:?} is absurdly large", shape.as_slice())))?;
    if expected != data.len() as u128 {
        return Err(WireError::LengthMismatch {
            key: key(),
            shape: shape.to_vec(),
            itemsize,
            expected,
            got: data.len(),
        });
    }
    match declared {
        WireDType::Num(ty, order) => Ok(Value::Array(ArrayView {
            declared,
            storage: ty,
            order,
            shape,
            data,
            native: false,
        })),
        _ => Ok(Value::Text {
            dtype: Some(declared),
            data,
        }),
    }
}

fn int_value(ty: ElemType, data: &[u8]) -> i128 {
    let mut be = [0u8; 8];
    let n = data.len().min(8);
    be[8 - n..].copy_from_slice(&data[..n]);
    let u = u64::from_be_bytes(be);
    match ty {
        ElemType::I8 => i128::from(data.first().copied().unwrap_or(0) as i8),
        ElemType::I16 => i128::from(u as u16 as i16),
        ElemType::I32 => i128::from(u as u32 as i32),
        ElemType::I64 => i128::from(u as i64),
        _ => i128::from(u),
    }
}

fn float_value(ty: ElemType, data: &[u8]) -> f64 {
    match (ty, data.len()) {
        (ElemType::F32, 4) => f64::from(f32::from_be_bytes([data[0], data[1], data[2], data[3]])),
        (_, 8) => {
            let mut a = [0u8; 8];
            a.copy_from_slice(data);
            f64::from_be_bytes(a)
        }
        _ => f64::NAN,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::encode::{Encoder, TIMING_SIZE, Timing, encode_timing, encode_toml};

    /// Collects every bound value, for tests.
    #[derive(Default)]
    struct Collect {
        keys: Vec<&'static str>,
        got: Vec<(usize, String, OwnedValue)>,
    }

    #[derive(Debug, Clone, PartialEq)]
    enum OwnedValue {
        Array {
            declared: WireDType,
            storage: ElemType,
            order: ByteOrder,
            shape: Vec<usize>,
            data: Vec<u8>,
        },
        Text(Vec<u8>),
    }

    impl Visitor for Collect {
        fn binding(&self, path: &[u8]) -> Option<usize> {
            self.keys.iter().position(|k| k.as_bytes() == path)
        }
        fn value(&mut self, i: usize, path: &[u8], v: Value<'_>) -> Result<(), WireError> {
            let o = match v {
                Value::Array(a) => OwnedValue::Array {
                    declared: a.declared,
                    storage: a.storage,
                    order: a.order,
                    shape: a.shape.to_vec(),
                    data: a.data.to_vec(),
                },
                Value::Text { data, .. } => OwnedValue::Text(data.to_vec()),
            };
            self.got.push((i, String::from_utf8_lossy(path).into(), o));
            Ok(())
        }
    }

    fn fixture(name: &str) -> Vec<u8> {
        let p = format!(
            "{}/tests/fixtures/msgpack/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        std::fs::read(&p).unwrap_or_else(|e| panic!("{p}: {e}"))
    }

    fn collect(
        frame: &[u8],
        keys: &[&'static str],
    ) -> Result<Vec<(usize, String, OwnedValue)>, WireError> {
        let mut c = Collect {
            keys: keys.to_vec(),
            ..Default::default()
        };
        decode_request(frame, &Limits::default(), &mut c)?;
        Ok(c.got)
    }

    fn img(n: usize, k: usize) -> Vec<u8> {
        (0..n).map(|i| ((i + 50 * k) % 256) as u8).collect()
    }

    fn f64s(v: impl IntoIterator<Item = f64>) -> Vec<u8> {
        v.into_iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn libero_observation_openpi_and_nd() {
        for name in ["obs_libero.msgpack", "nd_obs_libero.msgpack"] {
            let got = collect(
                &fixture(name),
                &[
                    "observation/image",
                    "observation/wrist_image",
                    "observation/state",
                    "prompt",
                ],
            )
            .unwrap();
            assert_eq!(got.len(), 4, "{name}");
            for (i, path, v) in &got {
                match (i, v) {
                    (
                        0 | 1,
                        OwnedValue::Array {
                            declared,
                            shape,
                            data,
                            ..
                        },
                    ) => {
                        assert_eq!(*declared, WireDType::Num(ElemType::U8, ByteOrder::Little));
                        assert_eq!(shape, &vec![8, 8, 3]);
                        assert_eq!(data, &img(192, *i), "{name} {path}");
                    }
                    (
                        2,
                        OwnedValue::Array {
                            declared,
                            shape,
                            data,
                            ..
                        },
                    ) => {
                        assert_eq!(*declared, WireDType::Num(ElemType::F64, ByteOrder::Little));
                        assert_eq!(shape, &vec![8]);
                        assert_eq!(data, &f64s((0..8).map(|i| i as f64 / 8.0)));
                    }
                    (3, OwnedValue::Text(t)) => assert_eq!(t, b"pick up the black bowl"),
                    other => panic!("{name}: unexpected {other:?}"),
                }
            }
        }
    }

    #[test]
    fn aloha_nested_images() {
        let keys = [
            "state",
            "images/cam_high",
            "images/cam_low",
            "images/cam_left_wrist",
            "images/cam_right_wrist",
        ];
        let got = collect(&fixture("obs_aloha.msgpack"), &keys).unwrap();
        assert_eq!(got.len(), 5);
        for (i, _, v) in got {
            let OwnedValue::Array { shape, data, .. } = v else {
                panic!()
            };
            if i == 0 {
                assert_eq!(data, f64s((0..14).map(|i| i as f64 / 4.0 - 1.0)));
            } else {
                assert_eq!(shape, vec![3, 8, 8]);
                assert_eq!(data, img(192, i - 1));
            }
        }
    }

    #[test]
    fn scalars_and_zero_d() {
        let got = collect(
            &fixture("scalars.msgpack"),
            &["float32", "int64", "bool", "float64"],
        )
        .unwrap();
        let by: std::collections::HashMap<usize, OwnedValue> =
            got.into_iter().map(|(i, _, v)| (i, v)).collect();
        let conv = |v: &OwnedValue| -> f64 {
            let OwnedValue::Array {
                storage,
                order,
                data,
                ..
            } = v
            else {
                panic!()
            };
            let t = crate::transform::Transform::elementwise(
                *storage,
                ElemType::F64,
                1,
                crate::transform::Affine::IDENTITY,
            );
            let mut out = [0u8; 8];
            assert!(t.apply(data, *order, &mut out));
            f64::from_le_bytes(out)
        };
        assert_eq!(conv(&by[&0]), 1.5);
        assert!(matches!(
            &by[&0],
            OwnedValue::Array {
                declared: WireDType::Num(ElemType::F32, _),
                ..
            }
        ));
        assert_eq!(conv(&by[&1]), -7.0);
        assert_eq!(conv(&by[&2]), 1.0);
        assert_eq!(conv(&by[&3]), 0.25);
    }

    /// Wraps a fixture value under a key, so value-level fixtures can be decoded as requests.
    fn wrap(key: &str, value: &[u8]) -> Vec<u8> {
        let mut buf = Vec::new();
        let mut e = Encoder { buf: &mut buf };
        e.map(1);
        e.str(key);
        buf.extend_from_slice(value);
        buf
    }

    #[test]
    fn value_fixtures() {
        let got = collect(&wrap("x", &fixture("array0d_f64.msgpack")), &["x"]).unwrap();
        assert!(
            matches!(&got[0].2, OwnedValue::Array { shape, data, .. } if shape.is_empty() && data == &1.0f64.to_le_bytes())
        );

        let got = collect(&wrap("x", &fixture("image_u8_4x4x3.msgpack")), &["x"]).unwrap();
        assert!(
            matches!(&got[0].2, OwnedValue::Array { shape, data, .. } if shape == &vec![4, 4, 3] && data == &img(48, 0))
        );

        let got = collect(&wrap("x", &fixture("array_be_f32_2x3.msgpack")), &["x"]).unwrap();
        let OwnedValue::Array {
            storage,
            order,
            data,
            ..
        } = &got[0].2
        else {
            panic!()
        };
        assert_eq!((*storage, *order), (ElemType::F32, ByteOrder::Big));
        let t = crate::transform::Transform::elementwise(
            ElemType::F32,
            ElemType::F32,
            6,
            crate::transform::Affine::IDENTITY,
        );
        let mut out = [0u8; 24];
        assert!(t.apply(data, *order, &mut out));
        let v: Vec<f32> = out
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(v, vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);

        let got = collect(&wrap("x", &fixture("array_str_u5.msgpack")), &["x"]).unwrap();
        assert!(matches!(&got[0].2, OwnedValue::Text(t) if t.len() == 60));
    }

    #[test]
    fn rejected_kinds() {
        for (name, want) in [
            ("nd_structured.msgpack", DTypeError::Structured),
            ("nd_object.msgpack", DTypeError::Object),
        ] {
            let err = collect(&wrap("x", &fixture(name)), &["x"]).unwrap_err();
            assert_eq!(
                err,
                WireError::RejectedDType {
                    key: "x".into(),
                    dtype: want
                },
                "{name}"
            );
        }
        let err = collect(&fixture("nd_complex_dict.msgpack"), &["z"]).unwrap_err();
        assert_eq!(
            err,
            WireError::RejectedDType {
                key: "z".into(),
                dtype: DTypeError::Complex
            }
        );
    }

    #[test]
    fn nd_scalars_without_kind_stay_maps() {
        // lebedov scalars have no 'kind': they are plain maps, so a binding on them is refused.
        let err = collect(&fixture("nd_scalars.msgpack"), &["float32"]).unwrap_err();
        assert!(
            matches!(err, WireError::WrongType { ref got, .. } if got == "a map"),
            "{err}"
        );
        // and a binding below them is found as a nested key
        let got = collect(&fixture("nd_scalars.msgpack"), &["int64/type"]).unwrap();
        assert!(matches!(&got[0].2, OwnedValue::Text(t) if t == b"<i8"));
    }

    #[test]
    fn array_data_must_be_bin_not_str() {
        // Both markers: openpi's and vllm-omni's `nd`, data as a msgpack str (old msgpack
        // packs bytes so without use_bin_type).
        for nd in [false, true] {
            let mut buf = Vec::new();
            let mut e = Encoder { buf: &mut buf };
            e.map(1);
            e.str("a");
            if nd {
                e.map(5);
                e.str("nd");
                e.bool(true);
                e.str("type");
                e.str("|u1");
                e.str("kind");
                e.str("u");
            } else {
                e.map(4);
                e.str("__ndarray__");
                e.bool(true);
                e.str("dtype");
                e.str("|u1");
            }
            e.str("shape");
            e.array(1);
            e.int(2);
            e.str("data");
            e.str("ab");
            let err = collect(&buf, &["a"]).unwrap_err();
            assert!(
                matches!(&err, WireError::BadArray { key, reason } if key == "a" && reason.contains("must be bin")),
                "{err}"
            );
        }
    }

    #[test]
    fn str_marker_keys_and_vllm_kind_char() {
        // openpi marker with str keys (policyd accepts them) and an nd marker whose kind is the
        // dtype's kind character (vllm-omni's variant).
        let mut buf = Vec::new();
        let mut e = Encoder { buf: &mut buf };
        e.map(2);
        e.str("a");
        e.map(4);
        e.str("__ndarray__");
        e.bool(true);
        e.str("data");
        e.bin(&[1, 2]);
        e.str("dtype");
        e.bin(b"|u1");
        e.str("shape");
        e.array(1);
        e.int(2);
        e.str("b");
        e.map(5);
        e.str("nd");
        e.int(1);
        e.str("type");
        e.str("<i2");
        e.str("kind");
        e.str("i");
        e.str("shape");
        e.array(0);
        e.str("data");
        e.bin(&[7, 0]);
        let got = collect(&buf, &["a", "b"]).unwrap();
        assert!(matches!(&got[0].2, OwnedValue::Array { data, .. } if data == &vec![1, 2]));
        assert!(
            matches!(&got[1].2, OwnedValue::Array { storage: ElemType::I16, data, .. } if data == &vec![7, 0])
        );

        // kind character that contradicts the type
        let mut buf = Vec::new();
        let mut e = Encoder { buf: &mut buf };
        e.map(1);
        e.str("b");
        e.map(5);
        e.str("nd");
        e.bool(true);
        e.str("type");
        e.str("<i2");
        e.str("kind");
        e.str("f");
        e.str("shape");
        e.array(1);
        e.int(1);
        e.str("data");
        e.bin(&[7, 0]);
        assert!(matches!(
            collect(&buf, &["b"]),
            Err(WireError::BadArray { .. })
        ));
    }

    #[test]
    fn length_mismatch_and_absurd_shapes() {
        let mk = |shape: &[i64], data: &[u8]| {
            let mut buf = Vec::new();
            let mut e = Encoder { buf: &mut buf };
            e.map(1);
            e.str("x");
            e.map(4);
            e.bin(b"__ndarray__");
            e.bool(true);
            e.bin(b"data");
            e.bin(data);
            e.bin(b"dtype");
            e.str("<f4");
            e.bin(b"shape");
            e.array(shape.len() as u32);
            for &d in shape {
                e.int(d);
            }
            buf
        };
        assert!(matches!(
            collect(&mk(&[2, 3], &[0; 20]), &["x"]),
            Err(WireError::LengthMismatch {
                expected: 24,
                got: 20,
                ..
            })
        ));
        assert!(matches!(
            collect(&mk(&[i64::MAX, i64::MAX, i64::MAX], &[0; 4]), &["x"]),
            Err(WireError::BadArray { .. }) | Err(WireError::LengthMismatch { .. })
        ));
        assert!(matches!(
            collect(&mk(&[-1], &[0; 4]), &["x"]),
            Err(WireError::BadArray { .. })
        ));
        assert!(matches!(
            collect(&mk(&[1; 9], &[0; 4]), &["x"]),
            Err(WireError::BadArray { .. })
        ));
        assert!(collect(&mk(&[1, 1], &[0; 4]), &["x"]).is_ok());
    }

    #[test]
    fn malformed_frames() {
        let none: &[&'static str] = &[];
        assert_eq!(collect(b"", none).unwrap_err(), WireError::Empty);
        assert!(matches!(
            collect(&[0xc1], none),
            Err(WireError::NotMsgpack {
                byte: 0xc1,
                offset: 0
            })
        ));
        assert!(matches!(
            collect(&[0x91, 0x01], none),
            Err(WireError::TopLevelNotMap { got: "a list" })
        ));
        assert!(matches!(
            collect(b"\xa3abc", none),
            Err(WireError::TopLevelNotMap { got: "a string" })
        ));
        let full = fixture("obs_libero.msgpack");
        for cut in [1, 10, 100, full.len() - 1] {
            assert!(
                matches!(
                    collect(&full[..cut], &["observation/state"]),
                    Err(WireError::Truncated { .. })
                ),
                "cut {cut}"
            );
        }
        let mut extra = full.clone();
        extra.push(0);
        assert!(matches!(
            collect(&extra, none),
            Err(WireError::TrailingBytes { extra: 1 })
        ));
        // a map that claims 2^32-1 entries but has none
        assert!(matches!(
            collect(&[0xdf, 0xff, 0xff, 0xff, 0xff], none),
            Err(WireError::TooManyEntries { .. })
        ));
    }

    #[test]
    fn deep_nesting_is_refused_without_recursion() {
        // {"x": [[[[...]]]]} 100000 levels deep, and the same with maps.
        let mut buf = vec![0x81, 0xa1, b'x'];
        buf.extend(std::iter::repeat_n(0x91, 100_000));
        buf.push(0x00);
        assert!(matches!(collect(&buf, &[]), Err(WireError::TooDeep { .. })));
        let mut buf = vec![0x81, 0xa1, b'x'];
        for _ in 0..100_000 {
            buf.extend_from_slice(&[0x81, 0xa1, b'y']);
        }
        buf.push(0x00);
        assert!(matches!(
            collect(&buf, &["x/y/y"]),
            Err(WireError::TooDeep { .. })
        ));
    }

    #[test]
    fn reserved_keys() {
        let mut buf = Vec::new();
        let mut e = Encoder { buf: &mut buf };
        e.map(6);
        e.str("endpoint");
        e.str("reset");
        e.str("session_id");
        e.int(42);
        e.str("seed");
        e.int(-3);
        e.str("sampling_params");
        e.map(2);
        e.str("num_inference_steps");
        e.int(10);
        e.str("other");
        e.map(0);
        e.str("timestamp");
        e.f64(1.5);
        e.str("must_go");
        e.bool(true);
        let mut c = Collect::default();
        let meta = decode_request(&buf, &Limits::default(), &mut c).unwrap();
        assert_eq!(meta.endpoint, Endpoint::Reset);
        assert_eq!(meta.session_id.as_deref(), Some("42"));
        assert_eq!(meta.seed, Some(-3));
        assert_eq!(meta.num_inference_steps, Some(10));
        assert_eq!(meta.timestamp, Some(1.5));
        assert_eq!(meta.must_go, Some(true));

        let one = |k: &str, f: &dyn Fn(&mut Encoder<'_>)| {
            let mut buf = Vec::new();
            let mut e = Encoder { buf: &mut buf };
            e.map(1);
            e.str(k);
            f(&mut e);
            decode_request(&buf, &Limits::default(), &mut Collect::default())
        };
        assert!(matches!(
            one("endpoint", &|e| e.str("fly")),
            Err(WireError::UnknownEndpoint { .. })
        ));
        assert!(matches!(
            one("endpoint", &|e| e.int(1)),
            Err(WireError::BadReserved { .. })
        ));
        assert!(matches!(
            one("session_id", &|e| e.str(&"x".repeat(65))),
            Err(WireError::BadReserved { .. })
        ));
        assert!(matches!(
            one("session_id", &|e| e.f64(1.0)),
            Err(WireError::BadReserved { .. })
        ));
        assert!(matches!(
            one("timestep", &|e| e.str("1")),
            Err(WireError::BadReserved { .. })
        ));
    }

    #[test]
    fn encodes_reference_reply_byte_for_byte() {
        let mut buf = Vec::new();
        let mut e = Encoder { buf: &mut buf };
        e.map(3);
        e.str("actions");
        e.ndarray(ElemType::F32, &[2, 3], 24, |d| d.fill(0));
        encode_timing(
            &mut e,
            &Timing {
                policy_infer_ms: 1.0,
                server_infer_ms: 2.0,
                prev_total_ms: Some(3.0),
                stages: None,
            },
        );
        assert_eq!(buf, fixture("reply_f32_2x3.msgpack"));

        let mut buf = Vec::new();
        let mut e = Encoder { buf: &mut buf };
        e.map(3);
        e.str("actions");
        let vals: Vec<u8> = (0..70)
            .flat_map(|i| (i as f64 / 64.0).to_le_bytes())
            .collect();
        e.ndarray(ElemType::F64, &[10, 7], 560, |d| d.copy_from_slice(&vals));
        encode_timing(
            &mut e,
            &Timing {
                policy_infer_ms: 12.5,
                server_infer_ms: 14.25,
                prev_total_ms: None,
                stages: None,
            },
        );
        assert_eq!(buf, fixture("reply_libero_f64_10x7.msgpack"));
        assert!(buf.len() <= 1 + 8 + Encoder::ndarray_size(&[10, 7], 560) + TIMING_SIZE);
        // The largest timing a pipeline writes fits TIMING_SIZE.
        let mut t = Vec::new();
        encode_timing(
            &mut Encoder { buf: &mut t },
            &Timing {
                policy_infer_ms: 1e300,
                server_infer_ms: 1e300,
                prev_total_ms: Some(1e300),
                stages: Some(crate::protocol::StageTimes {
                    prefix_ms: 1e300,
                    denoise_ms: 1e300,
                    steps: u32::MAX,
                }),
            },
        );
        assert!(t.len() <= TIMING_SIZE, "{} > {TIMING_SIZE}", t.len());
    }

    #[test]
    fn encodes_metadata_like_msgpack_python() {
        let t: toml::Table = toml::from_str("reset_pose = [0, -1.5, 1.5, 0, 0, 0]").unwrap();
        let mut buf = Vec::new();
        encode_toml(&mut Encoder { buf: &mut buf }, &toml::Value::Table(t));
        assert_eq!(buf, fixture("metadata_aloha.msgpack"));
        let mut buf = Vec::new();
        encode_toml(
            &mut Encoder { buf: &mut buf },
            &toml::Value::Table(toml::Table::new()),
        );
        assert_eq!(buf, fixture("metadata_empty.msgpack"));
    }
}
