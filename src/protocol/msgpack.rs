//! The msgpack reader under the request decoder: one value's header at a time, bounds-checked,
//! never allocating (every length is checked against what is left of the frame).

use rmp::Marker;

use crate::dtype::ElemType;

/// How deep and how wide a walk over a message may go.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Deepest nesting of maps and arrays (the top-level map is depth 1).
    pub max_depth: usize,
    /// Most entries in any map or array that is walked.
    pub max_entries: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_depth: 16,
            max_entries: 1024,
        }
    }
}

/// What the reader itself can find wrong: bytes that are not msgpack, or a walk past
/// [`Limits`]. The request decoder turns each into its own `MsgpackError`, which says it in the
/// request's terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MsgpackError {
    Empty,
    NotMsgpack { byte: u8, offset: usize },
    Truncated { len: usize, need: usize },
    TooDeep { max: usize },
}

/// One msgpack value's header. Scalars, strings and bins are complete; maps and arrays carry
/// their entry count and their contents follow.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Head<'a> {
    Nil,
    Bool(bool),
    /// An integer, stored big-endian in `data` (for fixints, `data` is the marker byte itself).
    Int {
        ty: ElemType,
        data: &'a [u8],
    },
    Float {
        ty: ElemType,
        data: &'a [u8],
    },
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(u32),
    Map(u32),
    Ext,
}

impl Head<'_> {
    pub(crate) fn describe(&self) -> &'static str {
        match self {
            Head::Nil => "nil",
            Head::Bool(_) => "a bool",
            Head::Int { .. } => "an integer",
            Head::Float { .. } => "a float",
            Head::Str(_) => "a string",
            Head::Bin(_) => "bytes",
            Head::Array(_) => "a list",
            Head::Map(_) => "a map",
            Head::Ext => "a msgpack extension",
        }
    }
}

/// A bounds-checked reader over a frame.
#[derive(Clone)]
pub(crate) struct Cursor<'a> {
    pub(crate) buf: &'a [u8],
    pub(crate) pos: usize,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Cursor { buf, pos: 0 }
    }

    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], MsgpackError> {
        let rest = self.buf.len() - self.pos;
        if n > rest {
            return Err(MsgpackError::Truncated {
                len: self.buf.len(),
                need: n - rest,
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    pub(crate) fn len_be(&mut self, n: usize) -> Result<usize, MsgpackError> {
        let b = self.take(n)?;
        Ok(b.iter().fold(0usize, |acc, &x| (acc << 8) | usize::from(x)))
    }

    /// A number of type `ty` (its big-endian bytes follow the marker).
    fn number(&mut self, ty: ElemType, float: bool) -> Result<Head<'a>, MsgpackError> {
        let data = self.take(ty.size())?;
        Ok(if float {
            Head::Float { ty, data }
        } else {
            Head::Int { ty, data }
        })
    }

    /// A str or bin body: its length in `width` big-endian bytes, then the bytes.
    fn sized(&mut self, width: usize) -> Result<&'a [u8], MsgpackError> {
        let n = self.len_be(width)?;
        self.take(n)
    }

    pub(crate) fn head(&mut self) -> Result<Head<'a>, MsgpackError> {
        let at = self.pos;
        let byte = *self.take(1)?.first().ok_or(MsgpackError::Empty)?;
        let marker_byte = &self.buf[at..at + 1];
        Ok(match Marker::from_u8(byte) {
            Marker::FixPos(_) => Head::Int {
                ty: ElemType::U8,
                data: marker_byte,
            },
            Marker::FixNeg(_) => Head::Int {
                ty: ElemType::I8,
                data: marker_byte,
            },
            Marker::Null => Head::Nil,
            Marker::True => Head::Bool(true),
            Marker::False => Head::Bool(false),
            Marker::U8 => self.number(ElemType::U8, false)?,
            Marker::U16 => self.number(ElemType::U16, false)?,
            Marker::U32 => self.number(ElemType::U32, false)?,
            Marker::U64 => self.number(ElemType::U64, false)?,
            Marker::I8 => self.number(ElemType::I8, false)?,
            Marker::I16 => self.number(ElemType::I16, false)?,
            Marker::I32 => self.number(ElemType::I32, false)?,
            Marker::I64 => self.number(ElemType::I64, false)?,
            Marker::F32 => self.number(ElemType::F32, true)?,
            Marker::F64 => self.number(ElemType::F64, true)?,
            Marker::FixStr(n) => Head::Str(self.take(usize::from(n))?),
            Marker::Str8 => Head::Str(self.sized(1)?),
            Marker::Str16 => Head::Str(self.sized(2)?),
            Marker::Str32 => Head::Str(self.sized(4)?),
            Marker::Bin8 => Head::Bin(self.sized(1)?),
            Marker::Bin16 => Head::Bin(self.sized(2)?),
            Marker::Bin32 => Head::Bin(self.sized(4)?),
            Marker::FixArray(n) => Head::Array(u32::from(n)),
            Marker::Array16 => Head::Array(self.len_be(2)? as u32),
            Marker::Array32 => Head::Array(self.len_be(4)? as u32),
            Marker::FixMap(n) => Head::Map(u32::from(n)),
            Marker::Map16 => Head::Map(self.len_be(2)? as u32),
            Marker::Map32 => Head::Map(self.len_be(4)? as u32),
            Marker::FixExt1 => self.ext(2)?,
            Marker::FixExt2 => self.ext(3)?,
            Marker::FixExt4 => self.ext(5)?,
            Marker::FixExt8 => self.ext(9)?,
            Marker::FixExt16 => self.ext(17)?,
            Marker::Ext8 => {
                let n = self.len_be(1)?;
                self.ext(n + 1)?
            }
            Marker::Ext16 => {
                let n = self.len_be(2)?;
                self.ext(n + 1)?
            }
            Marker::Ext32 => {
                let n = self.len_be(4)?;
                self.ext(n + 1)?
            }
            Marker::Reserved => return Err(MsgpackError::NotMsgpack { byte, offset: at }),
        })
    }

    pub(crate) fn ext(&mut self, n: usize) -> Result<Head<'a>, MsgpackError> {
        self.take(n)?;
        Ok(Head::Ext)
    }

    /// Reads a map key: its bytes if it is a str or bin; otherwise skips it and returns None.
    pub(crate) fn key(&mut self) -> Result<Option<&'a [u8]>, MsgpackError> {
        let at = self.pos;
        match self.head()? {
            Head::Str(s) | Head::Bin(s) => Ok(Some(s)),
            Head::Array(_) | Head::Map(_) => {
                self.pos = at;
                self.skip_items(1, 1, &Limits::default())?;
                Ok(None)
            }
            _ => Ok(None),
        }
    }

    /// Reads a value's head; a map or list is skipped whole (and reported as its head).
    pub(crate) fn head_skipping(
        &mut self,
        depth: usize,
        limits: &Limits,
    ) -> Result<Head<'a>, MsgpackError> {
        let h = self.head()?;
        match h {
            Head::Array(n) => self.skip_items(u64::from(n), depth + 1, limits)?,
            Head::Map(n) => self.skip_entries(n, depth + 1, limits)?,
            _ => {}
        }
        Ok(h)
    }

    pub(crate) fn skip(&mut self, limits: &Limits, n: u64) -> Result<(), MsgpackError> {
        self.skip_items(n, 2, limits)
    }

    pub(crate) fn skip_entries(
        &mut self,
        n: u32,
        depth: usize,
        limits: &Limits,
    ) -> Result<(), MsgpackError> {
        self.skip_items(u64::from(n) * 2, depth, limits)
    }

    /// Skips `n` values, iteratively (no recursion), refusing nesting past the depth limit.
    /// Each value consumes at least one byte, so this terminates within the frame's length.
    pub(crate) fn skip_items(
        &mut self,
        n: u64,
        depth: usize,
        limits: &Limits,
    ) -> Result<(), MsgpackError> {
        let mut stack: heapless::Vec<u64, 64> = heapless::Vec::new();
        let max_extra = limits.max_depth.saturating_sub(depth).min(63);
        let mut remaining = n;
        loop {
            while remaining == 0 {
                match stack.pop() {
                    Some(r) => remaining = r,
                    None => return Ok(()),
                }
            }
            remaining -= 1;
            let children = match self.head()? {
                Head::Array(m) => u64::from(m),
                Head::Map(m) => u64::from(m) * 2,
                _ => continue,
            };
            if children == 0 {
                continue;
            }
            if stack.len() >= max_extra || depth + stack.len() + 1 > limits.max_depth {
                return Err(MsgpackError::TooDeep {
                    max: limits.max_depth,
                });
            }
            let _ = stack.push(remaining);
            remaining = children;
        }
    }
}
