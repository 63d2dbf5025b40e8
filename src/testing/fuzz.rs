//! What do the fuzzers run? Fuzzing entry points: what the cargo-fuzz targets in `fuzz/` run, and
//! what `tests/codecs/codec_props.rs` replays over the kept corpus and every crash ever found.
//!
//! Each takes arbitrary bytes and must return without panicking; a panic is the bug. They go
//! through the public request path, not a copy of it: [`decode`] decodes a frame against one of
//! several binding sets (nested keys, images with a layout change, text, optional scalars,
//! every numeric dtype, the planner's tap) and encodes both dialects' replies; [`config`]
//! parses a config and compiles each policy's plan against engine I/O shaped like its bindings.

use std::cell::RefCell;

use crate::bind::{Plan, ReplyParts};
use crate::config::{Config, PacingConfig, PolicySpec};
use crate::dtype::ElemType;
use crate::engine::{InputBuffer, IoSpec, TensorSpec};
use crate::policy::budget::Budget;
use crate::protocol::dialect::Precision;
use crate::protocol::{self, Dialect, Timing};
use crate::testing::synthetic::HostBuffer;

/// Binding sets a decoded frame is checked against (the first input byte picks one). Keys
/// match the golden fixtures', so seeds made from them reach the transforms.
const CONFIGS: [&str; 3] = [
    // libero-like: images with a layout change, state, prompt text.
    r#"
[engine]
model = "m"
[[inputs]]
key = "observation/image"
tensor = "image"
dtypes = ["uint8", "float32"]
shape = [8, 8, 3]
layout = "hwc_to_chw"
scale = 0.00392156862745098
[[inputs]]
key = "observation/wrist_image"
tensor = "wrist"
dtypes = ["uint8"]
shape = [8, 8, 3]
optional = true
[[inputs]]
key = "observation/state"
tensor = "state"
dtypes = ["float64", "float32"]
shape = [8]
mean = [0.5]
std = [2.0]
[[inputs]]
key = "prompt"
tensor = "prompt"
dtypes = ["text"]
shape = [32]
optional = true
[[outputs]]
tensor = "actions"
"#,
    // aloha-like: nested image keys, CHW, the planner's tap on the camera and prompt.
    r#"
[engine]
model = "m"
[pacing]
actions_per_chunk = 4
skip_stale_actions = true
similarity_atol = 0.01
similarity_key = "state"
[[inputs]]
key = "state"
tensor = "state"
dtypes = ["float64", "float32"]
shape = [14]
[[inputs]]
key = "images/cam_high"
tensor = "cam_high"
dtypes = ["uint8"]
shape = [3, 8, 8]
[[inputs]]
key = "images/cam_low"
tensor = "cam_low"
dtypes = ["uint8"]
shape = [3, 8, 8]
optional = true
fill = 0.5
[[inputs]]
key = "prompt"
tensor = "prompt"
dtypes = ["text"]
shape = [32]
[[outputs]]
tensor = "actions"
dtype = "float64"
columns = 5
[planner]
enabled = true
endpoints = ["http://127.0.0.1:9"]
model = "m"
camera = "images/cam_high"
"#,
    // Every numeric dtype, a scalar, and short text.
    r#"
[engine]
model = "m"
[[inputs]]
key = "x"
tensor = "x"
dtypes = ["bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16", "float32", "float64"]
shape = [2, 3]
[[inputs]]
key = "s"
tensor = "s"
dtypes = ["float64", "int64", "bool"]
shape = []
optional = true
[[inputs]]
key = "t"
tensor = "t"
dtypes = ["text"]
shape = [4]
optional = true
[[outputs]]
tensor = "actions"
[[outputs]]
tensor = "aux"
key = "aux"
"#,
];

/// Engine I/O shaped like a config's bindings, so that its plan compiles: each binding's
/// wire shape (after its layout change) behind a batch axis, text as int64, and each output
/// a 10-step chunk of its columns (7 unless the config says).
pub fn io_for(policy: &PolicySpec) -> IoSpec {
    let mut inputs: Vec<TensorSpec> = Vec::new();
    for b in &policy.inputs {
        let Some(tensor) = b.tensor.clone() else {
            continue;
        };
        if inputs.iter().any(|t| t.name == tensor) {
            continue;
        }
        if let Some(t) = b.tokenizer() {
            for (name, dtype) in [
                (tensor, ElemType::I64),
                (t.mask_tensor.clone(), ElemType::Bool),
            ] {
                inputs.push(TensorSpec {
                    name,
                    dtype,
                    shape: vec![1, t.max_tokens],
                });
            }
            continue;
        }
        let mut shape = b.engine_shape.clone().unwrap_or_else(|| {
            let mut s = b.shape.clone();
            if let Some(p) = b.layout.perm()
                && s.len() >= 3
            {
                let n = s.len();
                let last: Vec<usize> = p.iter().map(|&i| b.shape[n - 3 + i]).collect();
                s[n - 3..].copy_from_slice(&last);
            }
            s
        });
        if b.engine_shape.is_none() {
            shape.insert(0, 1);
        }
        let dtype = if b.is_text() {
            ElemType::I64
        } else {
            ElemType::F32
        };
        inputs.push(TensorSpec {
            name: tensor,
            dtype,
            shape,
        });
    }
    let mut outputs: Vec<TensorSpec> = Vec::new();
    for o in &policy.outputs {
        if outputs.iter().any(|t| t.name == o.tensor) {
            continue;
        }
        let d = o.columns.unwrap_or(7).max(o.mean.len()).clamp(1, 64);
        outputs.push(TensorSpec {
            name: o.tensor.clone(),
            dtype: ElemType::F32,
            shape: vec![1, 10, d],
        });
    }
    IoSpec { inputs, outputs }
}

/// One binding set with its buffers, allocated once per thread.
struct Case {
    pacing: PacingConfig,
    plan: Plan,
    inputs: Vec<Box<dyn InputBuffer>>,
    seen: Vec<bool>,
    outputs: Vec<Vec<u8>>,
    scratch: Vec<u8>,
    reply: Vec<u8>,
}

fn cases() -> Vec<Case> {
    CONFIGS
        .iter()
        .filter_map(|text| {
            let cfg = Config::parse(text, "fuzz", None).ok()?;
            let spec = cfg.default_policy();
            let io = io_for(spec);
            let plan = Plan::compile(&cfg, spec, &io).ok()?;
            Some(Case {
                inputs: io
                    .inputs
                    .iter()
                    .map(|s| Box::new(HostBuffer(vec![0; s.bytes()])) as Box<dyn InputBuffer>)
                    .collect(),
                seen: vec![false; plan.inputs.len()],
                outputs: io.outputs.iter().map(|s| vec![0; s.bytes()]).collect(),
                scratch: vec![0; plan.scratch_bytes],
                reply: Vec::with_capacity(plan.reply_capacity),
                pacing: spec.pacing.clone(),
                plan,
            })
        })
        .collect()
}

thread_local! {
    static CASES: RefCell<Vec<Case>> = RefCell::new(cases());
}

/// How many binding sets [`decode`] chooses from (a test checks they all compile).
pub fn binding_sets() -> usize {
    CASES.with(|c| c.borrow().len())
}

/// The wire decoder: the first byte picks a binding set, the rest is a request frame. A frame
/// that decodes is then answered in both dialects, from outputs filled with its own bytes
/// (any bit pattern, NaN included), as the connection would.
pub fn decode(data: &[u8]) {
    let Some((&pick, frame)) = data.split_first() else {
        return;
    };
    CASES.with(|cases| {
        let mut cases = cases.borrow_mut();
        let n = cases.len();
        if n == 0 {
            return;
        }
        let c = &mut cases[pick as usize % n];
        let decoded = c.plan.decode(frame, &mut c.inputs, &mut c.seen);
        let _ = protocol::peek_policy(frame, &c.plan.limits);
        let Ok(meta) = decoded else { return };
        let _ = meta.observed_at();
        let _ = c.plan.prompt_hash(&mut c.inputs);
        let mut state = [0f64; crate::limits::MAX_SIMILARITY_STATE];
        let _ = c.plan.similarity_state(&mut c.inputs, &mut state);
        for out in &mut c.outputs {
            for (i, b) in out.iter_mut().enumerate() {
                *b = frame.get(i % frame.len().max(1)).copied().unwrap_or(0);
            }
        }
        for precision in [Precision::Configured, Precision::Float32] {
            let _ = c
                .plan
                .non_finite_reply(&c.outputs, &mut c.scratch, &[], precision);
        }
        let delay = u32::from(pick) % 12;
        let mut parts = ReplyParts {
            outputs: &c.outputs,
            scratch: &mut c.scratch,
            chunk: c.plan.chunk(&c.pacing, delay),
            raw: &[],
        };
        let timing = Timing {
            policy_infer_ms: 1.0,
            server_infer_ms: 2.0,
            prev_total_ms: Some(3.0),
            stages: None,
        };
        let mut reply = c.plan.reply(&mut parts);
        Dialect::Openpi.encode_infer(&mut reply, &timing, Some(delay), &mut c.reply);
        assert!(
            c.reply.len() <= c.plan.reply_capacity,
            "reply over its capacity"
        );
        let mut reply = c.plan.reply(&mut parts);
        Dialect::Vllm.encode_infer(&mut reply, &timing, None, &mut c.reply);
        let dialect = if pick % 2 == 0 {
            Dialect::Vllm
        } else {
            Dialect::Openpi
        };
        dialect.encode_observe(
            &mut reply,
            crate::protocol::TimedStep {
                timestep: 7,
                timestamp: 0.25,
            },
            1.0 / 30.0,
            delay,
            &mut c.reply,
        );
        assert!(
            c.reply.len() <= c.plan.reply_capacity,
            "reply over its capacity"
        );
    });
}

/// The config parser: any UTF-8 text is parsed and checked; a config that passes has each
/// policy's plan compiled against engine I/O shaped like its bindings.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(cfg) = Config::parse(text, "fuzz", None) else {
        return;
    };
    for spec in &cfg.policies {
        let io = io_for(spec);
        if let Ok(plan) = Plan::compile(&cfg, spec, &io) {
            let _ = Budget::compute(&cfg, spec, &plan).render();
        }
    }
}

/// LeRobot's payloads: any bytes through the strict pickle reader, and a tree it accepts through
/// the lowering to a `TimedObservation` (every entry) and a `RemotePolicyConfig`; bytes that
/// are not a pickle through the JSON + safetensors reader (lerobot PR #3048).
pub fn pickle(data: &[u8]) {
    use crate::protocol::lerobot::pickle::{PickleLimits, PickleReader};
    use crate::protocol::lerobot::{LerobotError, ObsValue};
    use crate::protocol::lerobot::{json as lerobot_json, pickled as lerobot};
    // Every array an observation lowers to holds exactly its shape's bytes.
    fn check<'a>(entries: impl Iterator<Item = Result<(&'a str, ObsValue<'a>), LerobotError>>) {
        for entry in entries {
            if let Ok((_, ObsValue::Array(a))) = entry {
                let n: usize = a.shape.iter().product();
                assert_eq!(
                    n * a.dtype.size(),
                    a.data.len(),
                    "array bytes match the shape"
                );
            }
        }
    }
    if data.first() != Some(&0x80) {
        // lerobot PR #3048's JSON + safetensors payloads.
        if let Ok(obs) = lerobot_json::observation(data) {
            check(obs.entries());
        }
        let _ = lerobot_json::policy_setup(data);
        return;
    }
    let mut reader = PickleReader::new(PickleLimits::default());
    let Ok(tree) = reader.read(data) else {
        return;
    };
    if let Ok(obs) = lerobot::observation(&tree) {
        check(obs.entries());
    }
    let _ = lerobot::policy_setup(&tree);
}

/// The setup lowering's total budget: a `RemotePolicyConfig` pickle the reader accepts is
/// lowered with `allocated` counting the bytes allocated meanwhile (a counting allocator in the
/// fuzz target; `None` replays without the oracle), and no input may make the lowering allocate
/// more than [`SETUP_ALLOCATION_FACTOR`] times its length plus [`SETUP_ALLOCATION_BASE`]. A
/// pickle's memo made 983 KB allocate 4.3·10⁹ strings before.
pub fn setup(data: &[u8], allocated: Option<fn() -> usize>) {
    use crate::protocol::lerobot::pickle::{PickleLimits, PickleReader};
    use crate::protocol::lerobot::{json as lerobot_json, pickled as lerobot};
    if data.first() != Some(&0x80) {
        let _ = lerobot_json::policy_setup(data);
        return;
    }
    let mut reader = PickleReader::new(PickleLimits::default());
    let Ok(tree) = reader.read(data) else {
        return;
    };
    let before = allocated.map(|f| f());
    let setup = lerobot::policy_setup(&tree);
    if let (Some(f), Some(before)) = (allocated, before) {
        let used = f() - before;
        let bound = data.len() * SETUP_ALLOCATION_FACTOR + SETUP_ALLOCATION_BASE;
        assert!(
            used <= bound,
            "lowering a {}-byte setup allocated {used} bytes (bound {bound})",
            data.len()
        );
    }
    drop(setup);
}

/// See [`setup`]: the lowering's own budget ([`crate::protocol::lerobot::SetupBudget`]) counts
/// strings and records; vectors grow by doubling, so their capacity may be up to twice what was
/// counted, and the error path formats a message.
pub const SETUP_ALLOCATION_FACTOR: usize = 2 * crate::protocol::lerobot::SetupBudget::PER_BYTE;
pub const SETUP_ALLOCATION_BASE: usize = 2 * crate::protocol::lerobot::SetupBudget::BASE + 4096;
