//! Which element types exist? Element types: numpy `dtype.str` on the wire, and the names used in
//! the config.
//!
//! One enum serves the wire (what a client sent), the engine (what a model takes) and the reply
//! (what policyd casts to), so a conversion is always "element type A to element type B".

use std::fmt;

/// A numeric element type. Strings, structured, object, complex and datetime arrays are not
/// element types: they are rejected by the wire decoder before any data is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElemType {
    Bool,
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    U64,
    I64,
    F16,
    F32,
    F64,
}

/// Every element type, for error messages and tests.
pub const ALL_ELEM_TYPES: [ElemType; 12] = [
    ElemType::Bool,
    ElemType::U8,
    ElemType::I8,
    ElemType::U16,
    ElemType::I16,
    ElemType::U32,
    ElemType::I32,
    ElemType::U64,
    ElemType::I64,
    ElemType::F16,
    ElemType::F32,
    ElemType::F64,
];

impl ElemType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            ElemType::Bool | ElemType::U8 | ElemType::I8 => 1,
            ElemType::U16 | ElemType::I16 | ElemType::F16 => 2,
            ElemType::U32 | ElemType::I32 | ElemType::F32 => 4,
            ElemType::U64 | ElemType::I64 | ElemType::F64 => 8,
        }
    }

    /// The config name (numpy's `dtype.name`).
    pub const fn name(self) -> &'static str {
        match self {
            ElemType::Bool => "bool",
            ElemType::U8 => "uint8",
            ElemType::I8 => "int8",
            ElemType::U16 => "uint16",
            ElemType::I16 => "int16",
            ElemType::U32 => "uint32",
            ElemType::I32 => "int32",
            ElemType::U64 => "uint64",
            ElemType::I64 => "int64",
            ElemType::F16 => "float16",
            ElemType::F32 => "float32",
            ElemType::F64 => "float64",
        }
    }

    /// Parses a config name (`float32`) or a numpy dtype string (`<f4`).
    pub fn from_name(s: &str) -> Option<ElemType> {
        if let Some(t) = ALL_ELEM_TYPES.iter().find(|t| t.name() == s) {
            return Some(*t);
        }
        match parse_numpy_dtype(s.as_bytes()) {
            Ok(WireDType::Num(t, _)) => Some(t),
            _ => None,
        }
    }

    /// numpy's `dtype.kind` character.
    pub const fn kind(self) -> u8 {
        match self {
            ElemType::Bool => b'b',
            ElemType::U8 | ElemType::U16 | ElemType::U32 | ElemType::U64 => b'u',
            ElemType::I8 | ElemType::I16 | ElemType::I32 | ElemType::I64 => b'i',
            ElemType::F16 | ElemType::F32 | ElemType::F64 => b'f',
        }
    }

    /// The little-endian `dtype.str` policyd writes in replies (`<f4`, `|u1`).
    pub const fn numpy_str(self) -> &'static str {
        match self {
            ElemType::Bool => "|b1",
            ElemType::U8 => "|u1",
            ElemType::I8 => "|i1",
            ElemType::U16 => "<u2",
            ElemType::I16 => "<i2",
            ElemType::U32 => "<u4",
            ElemType::I32 => "<i4",
            ElemType::U64 => "<u8",
            ElemType::I64 => "<i8",
            ElemType::F16 => "<f2",
            ElemType::F32 => "<f4",
            ElemType::F64 => "<f8",
        }
    }

    pub const fn is_float(self) -> bool {
        matches!(self, ElemType::F16 | ElemType::F32 | ElemType::F64)
    }
}

impl fmt::Display for ElemType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Byte order of array data on the wire. numpy writes `<` (little), `>` (big) or `|` (single
/// byte, where order does not apply; stored here as little).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ByteOrder {
    Little,
    Big,
}

/// What a numpy `dtype.str` denotes, as far as policyd cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WireDType {
    /// A numeric element type with its byte order.
    Num(ElemType, ByteOrder),
    /// `<Un`: UCS-4 text, `n` characters per element, NUL padded.
    Unicode(usize, ByteOrder),
    /// `|Sn`: bytes, `n` per element, NUL padded.
    Bytes(usize),
}

impl WireDType {
    /// Bytes per element.
    pub fn itemsize(self) -> usize {
        match self {
            WireDType::Num(t, _) => t.size(),
            WireDType::Unicode(n, _) => n * 4,
            WireDType::Bytes(n) => n,
        }
    }

    /// numpy's kind character.
    pub fn kind(self) -> u8 {
        match self {
            WireDType::Num(t, _) => t.kind(),
            WireDType::Unicode(..) => b'U',
            WireDType::Bytes(_) => b'S',
        }
    }
}

/// Why a dtype string was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DTypeError {
    #[error("structured (void) dtypes are not accepted")]
    Structured,
    #[error(
        "object dtypes are not accepted (they carry Python pickles, which policyd never loads)"
    )]
    Object,
    #[error("complex dtypes are not accepted")]
    Complex,
    #[error("datetime/timedelta dtypes are not accepted")]
    DateTime,
    #[error("not a numpy dtype string")]
    Malformed,
}

/// Parses numpy's `dtype.str` (`<f4`, `>i2`, `|u1`, `<U12`, `|S2`, `|b1`).
pub fn parse_numpy_dtype(s: &[u8]) -> Result<WireDType, DTypeError> {
    let (order, rest) = match s.first() {
        Some(b'<') | Some(b'|') | Some(b'=') => (ByteOrder::Little, &s[1..]),
        Some(b'>') => (ByteOrder::Big, &s[1..]),
        _ => (ByteOrder::Little, s),
    };
    let (&kind, digits) = rest.split_first().ok_or(DTypeError::Malformed)?;
    match kind {
        b'V' => return Err(DTypeError::Structured),
        b'O' => return Err(DTypeError::Object),
        b'c' => return Err(DTypeError::Complex),
        b'M' | b'm' => return Err(DTypeError::DateTime),
        _ => {}
    }
    if digits.is_empty() || digits.len() > 6 || !digits.iter().all(u8::is_ascii_digit) {
        return Err(DTypeError::Malformed);
    }
    let n: usize = digits
        .iter()
        .fold(0usize, |acc, d| acc * 10 + usize::from(d - b'0'));
    let t = match (kind, n) {
        (b'b', 1) => ElemType::Bool,
        (b'u', 1) => ElemType::U8,
        (b'i', 1) => ElemType::I8,
        (b'u', 2) => ElemType::U16,
        (b'i', 2) => ElemType::I16,
        (b'u', 4) => ElemType::U32,
        (b'i', 4) => ElemType::I32,
        (b'u', 8) => ElemType::U64,
        (b'i', 8) => ElemType::I64,
        (b'f', 2) => ElemType::F16,
        (b'f', 4) => ElemType::F32,
        (b'f', 8) => ElemType::F64,
        (b'U', n) if n > 0 => return Ok(WireDType::Unicode(n, order)),
        (b'S', n) if n > 0 => return Ok(WireDType::Bytes(n)),
        _ => return Err(DTypeError::Malformed),
    };
    Ok(WireDType::Num(t, order))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_numpy_strings() {
        assert_eq!(
            parse_numpy_dtype(b"<f4"),
            Ok(WireDType::Num(ElemType::F32, ByteOrder::Little))
        );
        assert_eq!(
            parse_numpy_dtype(b">i2"),
            Ok(WireDType::Num(ElemType::I16, ByteOrder::Big))
        );
        assert_eq!(
            parse_numpy_dtype(b"|u1"),
            Ok(WireDType::Num(ElemType::U8, ByteOrder::Little))
        );
        assert_eq!(
            parse_numpy_dtype(b"|b1"),
            Ok(WireDType::Num(ElemType::Bool, ByteOrder::Little))
        );
        assert_eq!(
            parse_numpy_dtype(b"<U12"),
            Ok(WireDType::Unicode(12, ByteOrder::Little))
        );
        assert_eq!(parse_numpy_dtype(b"|S2"), Ok(WireDType::Bytes(2)));
        assert_eq!(parse_numpy_dtype(b"|V8"), Err(DTypeError::Structured));
        assert_eq!(parse_numpy_dtype(b"|O"), Err(DTypeError::Object));
        assert_eq!(parse_numpy_dtype(b"<c8"), Err(DTypeError::Complex));
        assert_eq!(parse_numpy_dtype(b"<M8[ns]"), Err(DTypeError::DateTime));
        assert_eq!(parse_numpy_dtype(b"<f3"), Err(DTypeError::Malformed));
        assert_eq!(parse_numpy_dtype(b""), Err(DTypeError::Malformed));
        assert_eq!(parse_numpy_dtype(b"<"), Err(DTypeError::Malformed));
        assert_eq!(
            parse_numpy_dtype(b"<f99999999999999"),
            Err(DTypeError::Malformed)
        );
    }

    #[test]
    fn names_round_trip() {
        for t in ALL_ELEM_TYPES {
            assert_eq!(ElemType::from_name(t.name()), Some(t));
            assert_eq!(ElemType::from_name(t.numpy_str()), Some(t));
        }
        assert_eq!(ElemType::from_name("float128"), None);
    }
}
