//! What do LeRobot's async-inference payloads hold? Its `robot_client`'s pickled
//! `RemotePolicyConfig` and `TimedObservation`, lowered from the strict [pickle reader]'s tree
//! into typed values, and the `list[TimedAction]` reply, written byte by byte.
//!
//! The reader never executes anything; this module accepts only the shapes the client writes
//! (a dataclass with its `__dict__`, numpy arrays rebuilt by `_reconstruct` or `_frombuffer`,
//! numpy scalars and dtypes of a few numeric kinds) and names the field of anything else.
//! The reply is a pickle the client loads, so policyd writes every byte of it itself: each
//! action is `torch.tensor([floats])`, a public constructor that makes the float32 tensor the
//! client's aggregation expects.
//!
//! [pickle reader]: super::pickle

use super::pickle::{Global, Node, NodeId, Seq, Tree};
use super::{
    Feature, LerobotError, NdArray, ObsValue, PolicySetup, SetupBudget, check_feature_count,
    check_name_count, check_setup, invalid,
};
use crate::dtype::{ByteOrder, ElemType, WireDType, parse_numpy_dtype};
use crate::limits::MAX_RANK;
use crate::protocol::clip;

/// A `TimedObservation`: its scalars, and its `observation` dict to walk.
pub struct Observation<'t, 'r, 'p> {
    pub timestamp: f64,
    pub timestep: i64,
    pub must_go: bool,
    tree: &'t Tree<'r, 'p>,
    dict: Seq,
}

/// The instance dict of a `NEWOBJ` + `BUILD` dataclass of class `want`.
fn instance(
    tree: &Tree<'_, '_>,
    id: NodeId,
    want: Global,
    what: &str,
) -> Result<Seq, LerobotError> {
    match tree.node(id) {
        Some(Node::Object { class, state }) if class == want => match tree.node(state) {
            Some(Node::Dict(d)) => Ok(d),
            _ => Err(invalid(format!("the {what} has no field dict"))),
        },
        Some(Node::Object { class, .. }) => Err(invalid(format!(
            "expected a {what}, got a {class:?} (the client sent the wrong message to this call)"
        ))),
        _ => Err(invalid(format!(
            "expected a pickled {what}, got {}",
            tree.describe(id)
        ))),
    }
}

fn field(tree: &Tree<'_, '_>, d: Seq, name: &str, of: &str) -> Result<NodeId, LerobotError> {
    tree.get(d, name)
        .ok_or_else(|| invalid(format!("{of} has no field '{name}'")))
}

fn number(tree: &Tree<'_, '_>, id: NodeId) -> Option<f64> {
    match tree.node(id)? {
        Node::Float(v) => Some(v),
        Node::Int(v) => Some(v as f64),
        Node::Bool(b) => Some(f64::from(u8::from(b))),
        Node::Reduce {
            func: Global::Scalar,
            args,
            ..
        } => numpy_scalar(tree, args),
        _ => None,
    }
}

fn int(tree: &Tree<'_, '_>, id: NodeId) -> Option<i64> {
    match tree.node(id)? {
        Node::Int(v) => Some(v),
        Node::Bool(b) => Some(i64::from(b)),
        _ => None,
    }
}

/// The items of a tuple node.
fn tuple<'t>(tree: &'t Tree<'_, '_>, id: NodeId) -> Option<impl Iterator<Item = NodeId> + 't> {
    match tree.node(id)? {
        Node::Tuple(s) => Some(tree.items(s)),
        _ => None,
    }
}

fn tuple_n<const N: usize>(tree: &Tree<'_, '_>, id: NodeId) -> Option<[NodeId; N]> {
    let mut out = [0; N];
    let mut it = tuple(tree, id)?;
    for o in &mut out {
        *o = it.next()?;
    }
    it.next().is_none().then_some(out)
}

/// A `numpy.dtype` node: `REDUCE dtype (kind, False, True)`, then `BUILD` with its byte order.
fn dtype(tree: &Tree<'_, '_>, id: NodeId) -> Result<(ElemType, ByteOrder), String> {
    let Some(Node::Reduce {
        func: Global::Dtype,
        args,
        state,
    }) = tree.node(id)
    else {
        return Err("a dtype that is not numpy.dtype(...)".into());
    };
    let [kind, ..] = tuple_n::<3>(tree, args).ok_or("numpy.dtype with unexpected arguments")?;
    let kind = tree
        .str(kind)
        .ok_or("numpy.dtype whose kind is not a str")?;
    // BUILD's state: (version, byteorder, ...); '<' or '|' on the little-endian machines
    // clients run on, '>' for big-endian data.
    let order = match tuple(tree, state)
        .and_then(|mut t| t.nth(1))
        .and_then(|b| tree.str(b))
    {
        Some(">") => ByteOrder::Big,
        Some("<" | "|" | "=") | None => ByteOrder::Little,
        Some(other) => return Err(format!("numpy.dtype byte order '{other}'")),
    };
    match parse_numpy_dtype(kind.as_bytes()) {
        Ok(WireDType::Num(
            t @ (ElemType::U8
            | ElemType::U16
            | ElemType::F32
            | ElemType::F64
            | ElemType::I64
            | ElemType::I32
            | ElemType::Bool),
            _,
        )) => Ok((t, order)),
        _ => Err(format!(
            "numpy dtype '{}' (accepted: u1, u2, i4, i8, f4, f8, b1)",
            clip(kind)
        )),
    }
}

fn shape(tree: &Tree<'_, '_>, id: NodeId) -> Option<heapless::Vec<usize, MAX_RANK>> {
    let mut out = heapless::Vec::new();
    for d in tuple(tree, id)? {
        let d = usize::try_from(int(tree, d)?).ok()?;
        out.push(d).ok()?;
    }
    Some(out)
}

/// Checks an array's byte count against its shape and dtype.
fn array<'p>(
    (dtype, order): (ElemType, ByteOrder),
    shape: heapless::Vec<usize, MAX_RANK>,
    data: &'p [u8],
) -> Result<NdArray<'p>, String> {
    let want = shape
        .iter()
        .try_fold(dtype.size(), |a, &d| a.checked_mul(d))
        .ok_or("an array whose shape overflows")?;
    if want != data.len() {
        return Err(format!(
            "an array of shape {:?} and dtype {} needs {want} bytes, but carries {}",
            shape.as_slice(),
            dtype.name(),
            data.len()
        ));
    }
    Ok(NdArray {
        dtype,
        order,
        shape,
        data,
    })
}

/// A numpy array node: protocol 4's `_reconstruct(ndarray, (0,), b'b')` + `BUILD (1, shape,
/// dtype, is_fortran, data)`, or protocol 5's `_frombuffer(data, dtype, shape, order)`.
fn ndarray<'p>(tree: &Tree<'_, 'p>, id: NodeId) -> Result<NdArray<'p>, String> {
    match tree.node(id) {
        Some(Node::Reduce {
            func: Global::Reconstruct,
            args,
            state,
        }) => {
            let [cls, _, _] =
                tuple_n::<3>(tree, args).ok_or("_reconstruct with unexpected arguments")?;
            if tree.node(cls) != Some(Node::Global(Global::NdArray)) {
                return Err("_reconstruct of something other than numpy.ndarray".into());
            }
            let [_, shp, dt, fortran, data] =
                tuple_n::<5>(tree, state).ok_or("an ndarray whose state is not 5 fields")?;
            if tree.node(fortran) != Some(Node::Bool(false)) {
                return Err("a Fortran-ordered array; send C-contiguous arrays".into());
            }
            let shp = shape(tree, shp)
                .ok_or_else(|| format!("an array with a bad shape or rank over {MAX_RANK}"))?;
            let data = tree
                .bytes(data)
                .ok_or("an array whose data is not bytes (object arrays are refused)")?;
            array(dtype(tree, dt)?, shp, data)
        }
        Some(Node::Reduce {
            func: Global::FromBuffer,
            args,
            ..
        }) => {
            let [data, dt, shp, order] =
                tuple_n::<4>(tree, args).ok_or("_frombuffer with unexpected arguments")?;
            if tree.str(order) != Some("C") {
                return Err("a Fortran-ordered array; send C-contiguous arrays".into());
            }
            let shp = shape(tree, shp)
                .ok_or_else(|| format!("an array with a bad shape or rank over {MAX_RANK}"))?;
            let data = tree
                .bytes(data)
                .ok_or("_frombuffer of something not bytes")?;
            array(dtype(tree, dt)?, shp, data)
        }
        _ => Err(format!("{} where an array was expected", tree.describe(id))),
    }
}

/// `numpy.core.multiarray.scalar(dtype, raw bytes)`.
fn numpy_scalar(tree: &Tree<'_, '_>, args: NodeId) -> Option<f64> {
    let [dt, raw] = tuple_n::<2>(tree, args)?;
    let (t, order) = dtype(tree, dt).ok()?;
    let raw = tree.bytes(raw)?;
    if raw.len() != t.size() {
        return None;
    }
    Some(crate::transform::load_f64_ordered(t, raw, order))
}

/// Reads a `TimedObservation`.
pub fn observation<'t, 'r, 'p>(
    tree: &'t Tree<'r, 'p>,
) -> Result<Observation<'t, 'r, 'p>, LerobotError> {
    const OF: &str = "the TimedObservation";
    let d = instance(
        tree,
        tree.root,
        Global::TimedObservation,
        "TimedObservation",
    )?;
    let timestamp = number(tree, field(tree, d, "timestamp", OF)?)
        .filter(|t| t.is_finite())
        .ok_or_else(|| invalid("TimedObservation.timestamp must be a finite number"))?;
    let timestep = int(tree, field(tree, d, "timestep", OF)?)
        .ok_or_else(|| invalid("TimedObservation.timestep must be an int"))?;
    let must_go = match tree.get(d, "must_go").map(|id| tree.node(id)) {
        None => false,
        Some(Some(Node::Bool(b))) => b,
        Some(_) => return Err(invalid("TimedObservation.must_go must be a bool")),
    };
    let dict = match tree.node(field(tree, d, "observation", OF)?) {
        Some(Node::Dict(s)) => s,
        _ => return Err(invalid("TimedObservation.observation must be a dict")),
    };
    Ok(Observation {
        timestamp,
        timestep,
        must_go,
        tree,
        dict,
    })
}

impl<'p> Observation<'_, '_, 'p> {
    /// Its time and flags.
    pub fn timed(&self) -> super::Timed {
        super::Timed {
            timestep: self.timestep,
            timestamp: self.timestamp,
            must_go: self.must_go,
        }
    }

    /// The observation dict's entries: key and value, or an error naming the key.
    pub fn entries(
        &self,
    ) -> impl Iterator<Item = Result<(&'p str, ObsValue<'p>), LerobotError>> + '_ {
        let tree = self.tree;
        tree.entries(self.dict).map(move |(k, v)| {
            let key = tree.str(k).ok_or_else(|| {
                invalid("TimedObservation.observation has a key that is not a str")
            })?;
            let value = match tree.node(v) {
                Some(Node::Str { .. }) => ObsValue::Text(tree.str(v).unwrap_or_default()),
                Some(Node::Reduce {
                    func: Global::Reconstruct | Global::FromBuffer,
                    ..
                }) => ObsValue::Array(
                    ndarray(tree, v)
                        .map_err(|e| invalid(format!("observation['{}']: {e}", clip(key))))?,
                ),
                _ => ObsValue::Number(number(tree, v).ok_or_else(|| {
                    invalid(format!(
                        "observation['{}'] is {}; expected a number, a str or a numpy array",
                        clip(key),
                        tree.describe(v)
                    ))
                })?),
            };
            Ok((key, value))
        })
    }
}

/// Reads a `RemotePolicyConfig`, within a [`SetupBudget`] for the pickle's size.
pub fn policy_setup(tree: &Tree<'_, '_>) -> Result<PolicySetup, LerobotError> {
    const OF: &str = "RemotePolicyConfig";
    let mut budget = SetupBudget::for_payload(tree.payload_len());
    let d = instance(tree, tree.root, Global::RemotePolicyConfig, OF)?;
    let text = |name: &str, budget: &mut SetupBudget| -> Result<String, LerobotError> {
        let id = field(tree, d, name, OF)?;
        let s = tree
            .str(id)
            .ok_or_else(|| invalid(format!("RemotePolicyConfig.{name} must be a str")))?;
        budget.string(s)
    };
    let policy_type = text("policy_type", &mut budget)?;
    let pretrained_name_or_path = text("pretrained_name_or_path", &mut budget)?;
    let device = match tree.get(d, "device") {
        Some(_) => text("device", &mut budget)?,
        None => "cpu".into(),
    };
    let actions_per_chunk = match tree.node(field(tree, d, "actions_per_chunk", OF)?) {
        // `True` is an int to Python, but never a chunk length.
        Some(Node::Int(v)) => v,
        _ => {
            return Err(invalid(
                "RemotePolicyConfig.actions_per_chunk must be an int",
            ));
        }
    };
    let mut rename_map = Vec::new();
    if let Some(id) = tree.get(d, "rename_map") {
        let Some(Node::Dict(m)) = tree.node(id) else {
            return Err(invalid("RemotePolicyConfig.rename_map must be a dict"));
        };
        for (k, v) in tree.entries(m) {
            match (tree.str(k), tree.str(v)) {
                (Some(k), Some(v)) => {
                    budget.item(std::mem::size_of::<(String, String)>())?;
                    rename_map.push((budget.string(k)?, budget.string(v)?));
                }
                _ => return Err(invalid("RemotePolicyConfig.rename_map must map str to str")),
            }
        }
    }
    let Some(Node::Dict(fs)) = tree.node(field(tree, d, "lerobot_features", OF)?) else {
        return Err(invalid(
            "RemotePolicyConfig.lerobot_features must be a dict",
        ));
    };
    check_feature_count(fs.len())?;
    let mut features = Vec::new();
    for (k, v) in tree.entries(fs) {
        let key = tree
            .str(k)
            .ok_or_else(|| invalid("RemotePolicyConfig.lerobot_features has a non-str key"))?;
        budget.item(std::mem::size_of::<Feature>())?;
        features.push(feature(tree, key, v, &mut budget)?);
    }
    let setup = PolicySetup {
        policy_type,
        pretrained_name_or_path,
        features,
        actions_per_chunk,
        device,
        rename_map,
    };
    check_setup(&setup)?;
    Ok(setup)
}

fn feature(
    tree: &Tree<'_, '_>,
    key: &str,
    id: NodeId,
    budget: &mut SetupBudget,
) -> Result<Feature, LerobotError> {
    let bad = |what: &str| invalid(format!("lerobot_features['{}']: {what}", clip(key)));
    let shape_of = |id: NodeId| -> Result<Vec<usize>, LerobotError> {
        let items: Option<Vec<usize>> = match tree.node(id) {
            Some(Node::Tuple(s) | Node::List(s)) if s.len() <= MAX_RANK => tree
                .items(s)
                .map(|d| int(tree, d).and_then(|d| usize::try_from(d).ok()))
                .collect(),
            _ => None,
        };
        items.ok_or_else(|| bad(&format!("shape must be a tuple of at most {MAX_RANK} ints")))
    };
    match tree.node(id) {
        Some(Node::Dict(d)) => {
            let dtype = tree
                .get(d, "dtype")
                .and_then(|i| tree.str(i))
                .ok_or_else(|| bad("no str 'dtype'"))?;
            let dtype = budget.string(dtype)?;
            let shape = shape_of(tree.get(d, "shape").ok_or_else(|| bad("no 'shape'"))?)?;
            let mut names = Vec::new();
            if let Some(n) = tree.get(d, "names") {
                match tree.node(n) {
                    Some(Node::None) => {}
                    Some(Node::List(s) | Node::Tuple(s)) => {
                        check_name_count(key, &shape, s.len())?;
                        for i in tree.items(s) {
                            let name = tree.str(i).ok_or_else(|| bad("'names' must be strs"))?;
                            names.push(budget.string(name)?);
                        }
                    }
                    _ => return Err(bad("'names' must be a list of str")),
                }
            }
            Ok(Feature {
                key: budget.string(key)?,
                dtype,
                shape,
                names,
            })
        }
        Some(Node::Object {
            class: Global::PolicyFeature,
            state,
        }) => {
            let Some(Node::Dict(d)) = tree.node(state) else {
                return Err(bad("a PolicyFeature without fields"));
            };
            let kind = match tree.get(d, "type").and_then(|t| tree.node(t)) {
                Some(Node::Reduce {
                    func: Global::FeatureType,
                    args,
                    ..
                }) => tuple_n::<1>(tree, args).and_then(|[v]| tree.str(v)),
                _ => None,
            }
            .ok_or_else(|| bad("a PolicyFeature whose type is not a FeatureType"))?;
            let shape = shape_of(tree.get(d, "shape").ok_or_else(|| bad("no 'shape'"))?)?;
            let dtype = if kind == "VISUAL" { "image" } else { "float32" };
            Ok(Feature {
                key: budget.string(key)?,
                dtype: dtype.into(),
                shape,
                names: Vec::new(),
            })
        }
        _ => Err(bad("expected a dict or a PolicyFeature")),
    }
}

/// Writes the `list[TimedAction]` reply: action `i` is `rows[i]` (float32, little-endian) at
/// `timestep + first + i`, `timestamp + (first + i)·dt`, as `torch.tensor([...])`.
pub fn encode_actions<'a>(
    rows: impl Iterator<Item = &'a [u8]>,
    at: crate::protocol::TimedStep,
    first: usize,
    dt: f64,
    buf: &mut Vec<u8>,
) {
    const TIMED_ACTION: &[u8] = b"clerobot.async_inference.helpers\nTimedAction\n";
    const TENSOR: &[u8] = b"ctorch\ntensor\n";
    let text = |buf: &mut Vec<u8>, s: &str| {
        buf.push(b'X');
        buf.extend_from_slice(&(s.len() as u32).to_le_bytes());
        buf.extend_from_slice(s.as_bytes());
    };
    let float = |buf: &mut Vec<u8>, v: f64| {
        buf.push(b'G');
        buf.extend_from_slice(&v.to_be_bytes());
    };
    buf.clear();
    buf.extend_from_slice(&[0x80, 2, b']', b'(']);
    for (i, row) in rows.enumerate() {
        let crate::protocol::TimedStep {
            timestep: step,
            timestamp: t,
        } = crate::protocol::timed_step(at, dt, first + i);
        buf.extend_from_slice(TIMED_ACTION);
        buf.extend_from_slice(&[b')', 0x81, b'}', b'(']);
        text(buf, "timestamp");
        float(buf, t);
        text(buf, "timestep");
        match i32::try_from(step) {
            Ok(v) => {
                buf.push(b'J');
                buf.extend_from_slice(&v.to_le_bytes());
            }
            Err(_) => {
                buf.extend_from_slice(&[0x8a, 8]);
                buf.extend_from_slice(&step.to_le_bytes());
            }
        }
        text(buf, "action");
        buf.extend_from_slice(TENSOR);
        buf.extend_from_slice(b"(](");
        for v in row.chunks_exact(4) {
            let v = f32::from_le_bytes([v[0], v[1], v[2], v[3]]);
            float(buf, f64::from(v));
        }
        buf.extend_from_slice(b"etR");
        buf.extend_from_slice(b"ub");
    }
    buf.extend_from_slice(b"e.");
}
