//! How is a pickle read without running it? A strict reader for the subset LeRobot's
//! `robot_client` writes: every opcode and every `(module, name)` global is checked against an
//! allow-list, and the stream is lowered into an inert tree of typed nodes. Nothing is imported,
//! called or resolved: a global is one of [`Global`]'s variants or an error naming it, and
//! `REDUCE`, `NEWOBJ` and `BUILD` only record what the stream asked for, for
//! [`pickled`](super::pickled) to check against the shapes it expects.
//!
//! No pickle crate is used on purpose: the ones tried resolve or drop globals, copy memo entries
//! (CPython keeps references, and a second camera reuses the dtype built for the first), or read
//! floats in the wrong byte order. The reader keeps its arena between messages, so a client's
//! steady stream of observations allocates nothing here once the first has been read.

use thiserror::Error;

/// Caps on what one pickle may make the reader hold.
#[derive(Clone, Copy, Debug)]
pub struct PickleLimits {
    /// Nodes in the tree (values, containers, objects).
    pub max_nodes: usize,
    /// Memo entries (`BINPUT`/`MEMOIZE` indices).
    pub max_memo: usize,
    /// Values on the stack plus open `MARK`s.
    pub max_stack: usize,
    /// Items in one container.
    pub max_items: usize,
    /// Items in all containers together: what the entry pool, which the reader keeps between
    /// messages, may grow to (a 30 MB pickle of memo references grew it by 200 MB before).
    pub max_entries: usize,
}

impl Default for PickleLimits {
    fn default() -> Self {
        PickleLimits {
            max_nodes: 65_536,
            max_memo: 65_536,
            max_stack: 4096,
            max_items: 65_536,
            max_entries: 262_144,
        }
    }
}

/// Why a pickle was refused. Each names the opcode, global or limit at fault and its offset.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum PickleError {
    #[error("the pickle ends early (at byte {0}); it is truncated")]
    Truncated(usize),
    #[error(
        "pickle opcode {name} (0x{op:02x}) at byte {at} is not accepted: policyd reads only the \
         data LeRobot's robot_client sends and never executes code"
    )]
    Opcode {
        op: u8,
        name: &'static str,
        at: usize,
    },
    #[error(
        "pickle global {module}.{name} at byte {at} is not on policyd's allow-list; nothing was \
         imported or called"
    )]
    Global {
        module: String,
        name: String,
        at: usize,
    },
    #[error("pickle protocol {0} is not supported (2 to 5 are)")]
    Protocol(u8),
    #[error("malformed pickle at byte {at}: {what}")]
    Malformed { at: usize, what: &'static str },
    #[error("the pickle exceeds policyd's limit on {what} ({limit})")]
    Limit { what: &'static str, limit: usize },
    #[error("the pickle has bytes after its STOP opcode (at byte {0})")]
    Trailing(usize),
}

/// The globals policyd accepts: the client's dataclasses and numpy's array and dtype
/// reconstruction (numpy 1 and 2 spell the module differently; both map to one variant).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Global {
    TimedObservation,
    RemotePolicyConfig,
    /// `lerobot.configs.types.PolicyFeature` (third-party clients' features).
    PolicyFeature,
    /// `lerobot.configs.types.FeatureType` (an enum, reduced from its value).
    FeatureType,
    /// `numpy.core.multiarray._reconstruct` (protocol 4 arrays).
    Reconstruct,
    /// `numpy.core.numeric._frombuffer` (protocol 5 arrays).
    FromBuffer,
    /// `numpy.core.multiarray.scalar` (numpy scalars).
    Scalar,
    /// `numpy.ndarray` (an argument of `_reconstruct`).
    NdArray,
    /// `numpy.dtype`.
    Dtype,
}

impl Global {
    /// The allow-list: exact `(module, name)` pairs.
    fn lookup(module: &[u8], name: &[u8]) -> Option<Global> {
        Some(match (module, name) {
            (b"lerobot.async_inference.helpers", b"TimedObservation") => Global::TimedObservation,
            (b"lerobot.async_inference.helpers", b"RemotePolicyConfig") => {
                Global::RemotePolicyConfig
            }
            (b"lerobot.configs.types", b"PolicyFeature") => Global::PolicyFeature,
            (b"lerobot.configs.types", b"FeatureType") => Global::FeatureType,
            (b"numpy._core.multiarray" | b"numpy.core.multiarray", b"_reconstruct") => {
                Global::Reconstruct
            }
            (b"numpy._core.numeric" | b"numpy.core.numeric", b"_frombuffer") => Global::FromBuffer,
            (b"numpy._core.multiarray" | b"numpy.core.multiarray", b"scalar") => Global::Scalar,
            (b"numpy", b"ndarray") => Global::NdArray,
            (b"numpy", b"dtype") => Global::Dtype,
            _ => return None,
        })
    }

    /// Classes instantiated by `NEWOBJ` (then given their `__dict__` by `BUILD`).
    fn is_class(self) -> bool {
        matches!(
            self,
            Global::TimedObservation | Global::RemotePolicyConfig | Global::PolicyFeature
        )
    }
}

/// A node's index in the reader's arena.
pub type NodeId = u32;
const NIL: u32 = u32::MAX;

/// One value of the tree. Text and bytes are ranges of the payload (not copied).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Node {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    /// UTF-8 text, checked.
    Str {
        start: u32,
        len: u32,
    },
    Bytes {
        start: u32,
        len: u32,
    },
    Tuple(Seq),
    List(Seq),
    Dict(Seq),
    Global(Global),
    /// `NEWOBJ cls ()`, then `BUILD state`.
    Object {
        class: Global,
        state: NodeId,
    },
    /// `REDUCE func args`, then maybe `BUILD state` (numpy's arrays and dtypes).
    Reduce {
        func: Global,
        args: NodeId,
        state: NodeId,
    },
}

/// A container's items: a chain through the reader's entry pool (appends may come long after
/// the container was made, so items are linked, not contiguous).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Seq {
    head: u32,
    tail: u32,
    len: u32,
}

impl Seq {
    const EMPTY: Seq = Seq {
        head: NIL,
        tail: NIL,
        len: 0,
    };

    pub fn len(&self) -> usize {
        self.len as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    /// `NIL` for tuple and list items.
    key: NodeId,
    value: NodeId,
    next: u32,
}

/// The reader; reuse one per client so its buffers are allocated once.
#[derive(Default)]
pub struct PickleReader {
    limits: PickleLimits,
    nodes: Vec<Node>,
    entries: Vec<Entry>,
    stack: Vec<NodeId>,
    marks: Vec<usize>,
    memo: Vec<NodeId>,
}

/// A read pickle: its payload and the tree over it.
pub struct Tree<'r, 'p> {
    reader: &'r PickleReader,
    payload: &'p [u8],
    pub root: NodeId,
}

impl PickleReader {
    pub fn new(limits: PickleLimits) -> Self {
        PickleReader {
            limits,
            ..Default::default()
        }
    }

    /// Reads `payload` (one whole pickle, `PROTO` to `STOP`) into a tree.
    pub fn read<'r, 'p>(&'r mut self, payload: &'p [u8]) -> Result<Tree<'r, 'p>, PickleError> {
        self.nodes.clear();
        self.entries.clear();
        self.stack.clear();
        self.marks.clear();
        self.memo.clear();
        if payload.len() >= u32::MAX as usize {
            return Err(PickleError::Limit {
                what: "payload bytes",
                limit: u32::MAX as usize - 1,
            });
        }
        let root = Machine {
            r: self,
            p: payload,
            at: 0,
        }
        .run()?;
        Ok(Tree {
            reader: self,
            payload,
            root,
        })
    }
}

/// The opcodes' names, for errors (pickletools' names).
fn opcode_name(op: u8) -> &'static str {
    match op {
        b'(' => "MARK",
        b'.' => "STOP",
        b'0' => "POP",
        b'1' => "POP_MARK",
        b'2' => "DUP",
        b'F' => "FLOAT",
        b'I' => "INT",
        b'J' => "BININT",
        b'K' => "BININT1",
        b'L' => "LONG",
        b'M' => "BININT2",
        b'N' => "NONE",
        b'P' => "PERSID",
        b'Q' => "BINPERSID",
        b'R' => "REDUCE",
        b'S' => "STRING",
        b'T' => "BINSTRING",
        b'U' => "SHORT_BINSTRING",
        b'V' => "UNICODE",
        b'X' => "BINUNICODE",
        b'a' => "APPEND",
        b'b' => "BUILD",
        b'c' => "GLOBAL",
        b'd' => "DICT",
        b'}' => "EMPTY_DICT",
        b'e' => "APPENDS",
        b'g' => "GET",
        b'h' => "BINGET",
        b'i' => "INST",
        b'j' => "LONG_BINGET",
        b'l' => "LIST",
        b']' => "EMPTY_LIST",
        b'o' => "OBJ",
        b'p' => "PUT",
        b'q' => "BINPUT",
        b'r' => "LONG_BINPUT",
        b's' => "SETITEM",
        b't' => "TUPLE",
        b')' => "EMPTY_TUPLE",
        b'u' => "SETITEMS",
        b'G' => "BINFLOAT",
        0x80 => "PROTO",
        0x81 => "NEWOBJ",
        0x82 => "EXT1",
        0x83 => "EXT2",
        0x84 => "EXT4",
        0x85 => "TUPLE1",
        0x86 => "TUPLE2",
        0x87 => "TUPLE3",
        0x88 => "NEWTRUE",
        0x89 => "NEWFALSE",
        0x8a => "LONG1",
        0x8b => "LONG4",
        b'B' => "BINBYTES",
        b'C' => "SHORT_BINBYTES",
        0x8c => "SHORT_BINUNICODE",
        0x8d => "BINUNICODE8",
        0x8e => "BINBYTES8",
        0x8f => "EMPTY_SET",
        0x90 => "ADDITEMS",
        0x91 => "FROZENSET",
        0x92 => "NEWOBJ_EX",
        0x93 => "STACK_GLOBAL",
        0x94 => "MEMOIZE",
        0x95 => "FRAME",
        0x96 => "BYTEARRAY8",
        0x97 => "NEXT_BUFFER",
        0x98 => "READONLY_BUFFER",
        _ => "an unknown opcode",
    }
}

struct Machine<'r, 'p> {
    r: &'r mut PickleReader,
    p: &'p [u8],
    at: usize,
}

impl Machine<'_, '_> {
    fn take(&mut self, n: usize) -> Result<&[u8], PickleError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.p.len())
            .ok_or(PickleError::Truncated(self.p.len()))?;
        let s = &self.p[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, PickleError> {
        Ok(self.take(1)?[0])
    }

    fn le<const N: usize>(&mut self) -> Result<[u8; N], PickleError> {
        let mut b = [0u8; N];
        b.copy_from_slice(self.take(N)?);
        Ok(b)
    }

    fn malformed(&self, at: usize, what: &'static str) -> PickleError {
        PickleError::Malformed { at, what }
    }

    fn node(&mut self, n: Node) -> Result<NodeId, PickleError> {
        if self.r.nodes.len() >= self.r.limits.max_nodes {
            return Err(PickleError::Limit {
                what: "nodes",
                limit: self.r.limits.max_nodes,
            });
        }
        self.r.nodes.push(n);
        Ok((self.r.nodes.len() - 1) as NodeId)
    }

    fn push(&mut self, n: Node) -> Result<(), PickleError> {
        let id = self.node(n)?;
        self.push_id(id)
    }

    fn push_id(&mut self, id: NodeId) -> Result<(), PickleError> {
        if self.r.stack.len() + self.r.marks.len() >= self.r.limits.max_stack {
            return Err(PickleError::Limit {
                what: "stack depth",
                limit: self.r.limits.max_stack,
            });
        }
        self.r.stack.push(id);
        Ok(())
    }

    fn pop(&mut self, at: usize) -> Result<NodeId, PickleError> {
        let floor = self.r.marks.last().copied().unwrap_or(0);
        if self.r.stack.len() <= floor {
            return Err(self.malformed(at, "stack underflow"));
        }
        self.r
            .stack
            .pop()
            .ok_or(self.malformed(at, "stack underflow"))
    }

    fn top(&self, at: usize) -> Result<NodeId, PickleError> {
        let floor = self.r.marks.last().copied().unwrap_or(0);
        if self.r.stack.len() <= floor {
            return Err(self.malformed(at, "stack underflow"));
        }
        Ok(self.r.stack[self.r.stack.len() - 1])
    }

    /// The value just below a popped `MARK` at `start` (the list or dict that `APPENDS` and
    /// `SETITEMS` extend).
    fn below(&self, start: usize, at: usize) -> Result<NodeId, PickleError> {
        let floor = self.r.marks.last().copied().unwrap_or(0);
        if start == 0 || start <= floor {
            return Err(self.malformed(at, "stack underflow"));
        }
        Ok(self.r.stack[start - 1])
    }

    /// Pops back to the last `MARK`; the items are `stack[start..]`, removed by the caller.
    fn pop_mark(&mut self, at: usize) -> Result<usize, PickleError> {
        self.r
            .marks
            .pop()
            .ok_or(self.malformed(at, "no MARK to pop to"))
    }

    /// Appends `(key, value)` to the container `c`'s chain.
    fn append(&mut self, seq: &mut Seq, key: NodeId, value: NodeId) -> Result<(), PickleError> {
        if seq.len as usize >= self.r.limits.max_items || self.r.entries.len() >= u32::MAX as usize
        {
            return Err(PickleError::Limit {
                what: "items in one container",
                limit: self.r.limits.max_items,
            });
        }
        if self.r.entries.len() >= self.r.limits.max_entries {
            return Err(PickleError::Limit {
                what: "items in all containers",
                limit: self.r.limits.max_entries,
            });
        }
        let i = self.r.entries.len() as u32;
        self.r.entries.push(Entry {
            key,
            value,
            next: NIL,
        });
        if seq.tail == NIL {
            seq.head = i;
        } else {
            self.r.entries[seq.tail as usize].next = i;
        }
        seq.tail = i;
        seq.len += 1;
        Ok(())
    }

    /// A tuple of `stack[start..]`, which is removed.
    fn tuple_from(&mut self, start: usize) -> Result<NodeId, PickleError> {
        let mut seq = Seq::EMPTY;
        for k in start..self.r.stack.len() {
            let v = self.r.stack[k];
            self.append(&mut seq, NIL, v)?;
        }
        self.r.stack.truncate(start);
        self.node(Node::Tuple(seq))
    }

    fn text(&mut self, n: usize, at: usize) -> Result<(), PickleError> {
        let start = self.at;
        let s = self.take(n)?;
        if std::str::from_utf8(s).is_err() {
            return Err(self.malformed(at, "text that is not UTF-8"));
        }
        self.push(Node::Str {
            start: start as u32,
            len: n as u32,
        })
    }

    fn bytes(&mut self, n: usize) -> Result<(), PickleError> {
        let start = self.at;
        self.take(n)?;
        self.push(Node::Bytes {
            start: start as u32,
            len: n as u32,
        })
    }

    fn len64(&mut self) -> Result<usize, PickleError> {
        let n = u64::from_le_bytes(self.le::<8>()?);
        usize::try_from(n).map_err(|_| PickleError::Truncated(self.p.len()))
    }

    fn memo_put(&mut self, index: usize, at: usize) -> Result<(), PickleError> {
        let id = self.top(at)?;
        if index >= self.r.limits.max_memo {
            return Err(PickleError::Limit {
                what: "memo entries",
                limit: self.r.limits.max_memo,
            });
        }
        if index >= self.r.memo.len() {
            self.r.memo.resize(index + 1, NIL);
        }
        self.r.memo[index] = id;
        Ok(())
    }

    fn memo_get(&mut self, index: usize, at: usize) -> Result<(), PickleError> {
        match self.r.memo.get(index) {
            Some(&id) if id != NIL => self.push_id(id),
            _ => Err(self.malformed(at, "memo index never stored")),
        }
    }

    fn str_at(&self, id: NodeId) -> Option<&[u8]> {
        match self.r.nodes[id as usize] {
            Node::Str { start, len } => Some(&self.p[start as usize..(start + len) as usize]),
            _ => None,
        }
    }

    fn run(&mut self) -> Result<NodeId, PickleError> {
        loop {
            let at = self.at;
            let op = self.u8()?;
            match op {
                0x80 => {
                    let v = self.u8()?;
                    if !(2..=5).contains(&v) {
                        return Err(PickleError::Protocol(v));
                    }
                }
                0x95 => {
                    // FRAME: a length hint for buffered readers; the payload is all here.
                    self.take(8)?;
                }
                b'.' => {
                    let root = self.pop(at)?;
                    if !self.r.stack.is_empty() || !self.r.marks.is_empty() {
                        return Err(self.malformed(at, "values left on the stack at STOP"));
                    }
                    if self.at != self.p.len() {
                        return Err(PickleError::Trailing(self.at));
                    }
                    return Ok(root);
                }
                0x94 => {
                    let n = self.r.memo.len();
                    self.memo_put(n, at)?;
                }
                b'q' => {
                    let i = self.u8()? as usize;
                    self.memo_put(i, at)?;
                }
                b'r' => {
                    let i = u32::from_le_bytes(self.le::<4>()?) as usize;
                    self.memo_put(i, at)?;
                }
                b'h' => {
                    let i = self.u8()? as usize;
                    self.memo_get(i, at)?;
                }
                b'j' => {
                    let i = u32::from_le_bytes(self.le::<4>()?) as usize;
                    self.memo_get(i, at)?;
                }
                b'(' => {
                    if self.r.stack.len() + self.r.marks.len() >= self.r.limits.max_stack {
                        return Err(PickleError::Limit {
                            what: "stack depth",
                            limit: self.r.limits.max_stack,
                        });
                    }
                    self.r.marks.push(self.r.stack.len());
                }
                b'N' => self.push(Node::None)?,
                0x88 => self.push(Node::Bool(true))?,
                0x89 => self.push(Node::Bool(false))?,
                b'K' => {
                    let v = self.u8()?;
                    self.push(Node::Int(i64::from(v)))?
                }
                b'M' => {
                    let v = u16::from_le_bytes(self.le::<2>()?);
                    self.push(Node::Int(i64::from(v)))?
                }
                b'J' => {
                    let v = i32::from_le_bytes(self.le::<4>()?);
                    self.push(Node::Int(i64::from(v)))?
                }
                0x8a => {
                    // LONG1: little-endian two's complement; policyd takes what fits an i64.
                    let n = self.u8()? as usize;
                    let b = self.take(n)?;
                    if n > 8 {
                        return Err(self.malformed(at, "LONG1 integer wider than 64 bits"));
                    }
                    let mut v: i64 = 0;
                    for (k, &byte) in b.iter().enumerate() {
                        v |= i64::from(byte) << (8 * k);
                    }
                    if n > 0 && n < 8 && b[n - 1] & 0x80 != 0 {
                        v -= 1i64 << (8 * n);
                    }
                    self.push(Node::Int(v))?
                }
                b'G' => {
                    let v = f64::from_be_bytes(self.le::<8>()?);
                    self.push(Node::Float(v))?
                }
                0x8c => {
                    let n = self.u8()? as usize;
                    self.text(n, at)?
                }
                b'X' => {
                    let n = u32::from_le_bytes(self.le::<4>()?) as usize;
                    self.text(n, at)?
                }
                0x8d => {
                    let n = self.len64()?;
                    self.text(n, at)?
                }
                b'C' => {
                    let n = self.u8()? as usize;
                    self.bytes(n)?
                }
                b'B' => {
                    let n = u32::from_le_bytes(self.le::<4>()?) as usize;
                    self.bytes(n)?
                }
                0x8e | 0x96 => {
                    let n = self.len64()?;
                    self.bytes(n)?
                }
                b')' => self.push(Node::Tuple(Seq::EMPTY))?,
                b']' => self.push(Node::List(Seq::EMPTY))?,
                b'}' => self.push(Node::Dict(Seq::EMPTY))?,
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    let floor = self.r.marks.last().copied().unwrap_or(0);
                    if self.r.stack.len() < floor + n {
                        return Err(self.malformed(at, "stack underflow"));
                    }
                    let start = self.r.stack.len() - n;
                    let t = self.tuple_from(start)?;
                    self.push_id(t)?
                }
                b't' => {
                    let start = self.pop_mark(at)?;
                    let t = self.tuple_from(start)?;
                    self.push_id(t)?
                }
                b'a' => {
                    let v = self.pop(at)?;
                    let l = self.top(at)?;
                    self.extend_list(l, &[v], at)?;
                }
                b'e' => {
                    let start = self.pop_mark(at)?;
                    let l = self.below(start, at)?;
                    let items = std::mem::take(&mut self.r.stack);
                    let r = self.extend_list(l, &items[start..], at);
                    self.r.stack = items;
                    self.r.stack.truncate(start);
                    r?;
                }
                b's' => {
                    let v = self.pop(at)?;
                    let k = self.pop(at)?;
                    let d = self.top(at)?;
                    self.set_items(d, &[k, v], at)?;
                }
                b'u' => {
                    let start = self.pop_mark(at)?;
                    let d = self.below(start, at)?;
                    if !(self.r.stack.len() - start).is_multiple_of(2) {
                        return Err(self.malformed(at, "SETITEMS with an odd number of items"));
                    }
                    let items = std::mem::take(&mut self.r.stack);
                    let r = self.set_items(d, &items[start..], at);
                    self.r.stack = items;
                    self.r.stack.truncate(start);
                    r?;
                }
                0x93 => {
                    let name = self.pop(at)?;
                    let module = self.pop(at)?;
                    let (Some(m), Some(n)) = (self.str_at(module), self.str_at(name)) else {
                        return Err(self.malformed(at, "STACK_GLOBAL needs two strings"));
                    };
                    let Some(g) = Global::lookup(m, n) else {
                        return Err(PickleError::Global {
                            module: printable(m),
                            name: printable(n),
                            at,
                        });
                    };
                    self.push(Node::Global(g))?
                }
                0x81 => {
                    let args = self.pop(at)?;
                    let cls = self.pop(at)?;
                    let class = match self.r.nodes[cls as usize] {
                        Node::Global(g) if g.is_class() => g,
                        _ => return Err(self.malformed(at, "NEWOBJ of something not a class")),
                    };
                    if !matches!(self.r.nodes[args as usize], Node::Tuple(s) if s.is_empty()) {
                        return Err(self.malformed(at, "NEWOBJ with constructor arguments"));
                    }
                    self.push(Node::Object { class, state: NIL })?
                }
                b'R' => {
                    let args = self.pop(at)?;
                    let f = self.pop(at)?;
                    let func = match self.r.nodes[f as usize] {
                        Node::Global(g) if !g.is_class() && g != Global::NdArray => g,
                        Node::Global(Global::PolicyFeature) => {
                            return Err(self.malformed(at, "REDUCE of a dataclass"));
                        }
                        _ => return Err(self.malformed(at, "REDUCE of something not callable")),
                    };
                    if !matches!(self.r.nodes[args as usize], Node::Tuple(_)) {
                        return Err(self.malformed(at, "REDUCE arguments are not a tuple"));
                    }
                    self.push(Node::Reduce {
                        func,
                        args,
                        state: NIL,
                    })?
                }
                b'b' => {
                    let s = self.pop(at)?;
                    let target = self.top(at)?;
                    match &mut self.r.nodes[target as usize] {
                        Node::Object { state, .. } | Node::Reduce { state, .. }
                            if *state == NIL =>
                        {
                            *state = s
                        }
                        _ => return Err(self.malformed(at, "BUILD on something it cannot set")),
                    }
                }
                other => {
                    return Err(PickleError::Opcode {
                        op: other,
                        name: opcode_name(other),
                        at,
                    });
                }
            }
        }
    }

    fn extend_list(&mut self, l: NodeId, items: &[NodeId], at: usize) -> Result<(), PickleError> {
        let Node::List(mut seq) = self.r.nodes[l as usize] else {
            return Err(self.malformed(at, "APPEND to something not a list"));
        };
        for &v in items {
            self.append(&mut seq, NIL, v)?;
        }
        self.r.nodes[l as usize] = Node::List(seq);
        Ok(())
    }

    fn set_items(&mut self, d: NodeId, kv: &[NodeId], at: usize) -> Result<(), PickleError> {
        let Node::Dict(mut seq) = self.r.nodes[d as usize] else {
            return Err(self.malformed(at, "SETITEM on something not a dict"));
        };
        for pair in kv.chunks_exact(2) {
            self.append(&mut seq, pair[0], pair[1])?;
        }
        self.r.nodes[d as usize] = Node::Dict(seq);
        Ok(())
    }
}

/// A name from the stream, for an error message: lossy, and cut to 80 bytes.
fn printable(b: &[u8]) -> String {
    let s = String::from_utf8_lossy(&b[..b.len().min(80)]);
    s.chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect()
}

impl<'p> Tree<'_, 'p> {
    /// The pickle's length in bytes (what a lowering's budget is proportional to).
    pub fn payload_len(&self) -> usize {
        self.payload.len()
    }

    pub fn node(&self, id: NodeId) -> Option<Node> {
        self.reader.nodes.get(id as usize).copied()
    }

    /// The text of a `Str` node.
    pub fn str(&self, id: NodeId) -> Option<&'p str> {
        match self.node(id)? {
            Node::Str { start, len } => {
                std::str::from_utf8(&self.payload[start as usize..(start + len) as usize]).ok()
            }
            _ => None,
        }
    }

    /// The bytes of a `Bytes` node.
    pub fn bytes(&self, id: NodeId) -> Option<&'p [u8]> {
        match self.node(id)? {
            Node::Bytes { start, len } => {
                Some(&self.payload[start as usize..(start + len) as usize])
            }
            _ => None,
        }
    }

    /// A tuple's or list's items.
    pub fn items(&self, seq: Seq) -> impl Iterator<Item = NodeId> + '_ {
        self.entries(seq).map(|(_, v)| v)
    }

    /// A dict's `(key, value)` pairs (keys `NIL` for tuples and lists).
    pub fn entries(&self, seq: Seq) -> impl Iterator<Item = (NodeId, NodeId)> + '_ {
        let mut i = seq.head;
        let mut left = seq.len;
        std::iter::from_fn(move || {
            if left == 0 || i == NIL {
                return None;
            }
            let e = self.reader.entries.get(i as usize)?;
            i = e.next;
            left -= 1;
            Some((e.key, e.value))
        })
    }

    /// The value of a dict's string key `key`.
    pub fn get(&self, dict: Seq, key: &str) -> Option<NodeId> {
        self.entries(dict)
            .find(|&(k, _)| self.str(k) == Some(key))
            .map(|(_, v)| v)
    }

    /// What a node is, for error messages.
    pub fn describe(&self, id: NodeId) -> &'static str {
        match self.node(id) {
            None => "nothing",
            Some(Node::None) => "None",
            Some(Node::Bool(_)) => "a bool",
            Some(Node::Int(_)) => "an int",
            Some(Node::Float(_)) => "a float",
            Some(Node::Str { .. }) => "a str",
            Some(Node::Bytes { .. }) => "bytes",
            Some(Node::Tuple(_)) => "a tuple",
            Some(Node::List(_)) => "a list",
            Some(Node::Dict(_)) => "a dict",
            Some(Node::Global(_)) => "a global",
            Some(Node::Object { .. }) => "an object",
            Some(Node::Reduce { .. }) => "a reduced object",
        }
    }
}

pub const NO_NODE: NodeId = NIL;
