//! Property tests of the wire codec, both ways.
//!
//! Requests: random arrays of every supported dtype and shape, encoded as openpi ndarrays,
//! decode through a binding into the engine input exactly (to float64, and byte for byte into
//! an input of the same dtype).
//!
//! Replies: random action chunks (any horizon and width, float32 or float64 on the wire, with
//! or without unnormalisation, any `actions_per_chunk`) encode to replies that msgpack decodes
//! back to exactly the expected values, in both dialects, within the reply buffer sized at
//! start-up (so encoding never reallocates).
//!
//! Fuzz regressions: every input kept under fuzz/ (the seed corpus and each crash ever found)
//! replays through the fuzz targets' entry points.

use policyd::bind::{Plan, ReplyParts};
use policyd::config::Config;
use policyd::dtype::{ALL_ELEM_TYPES, ElemType};
use policyd::engine::{InputBuffer, IoSpec, TensorSpec};
use policyd::protocol::{Dialect, Encoder, Timing};
use policyd::testing::synthetic::HostBuffer;
use policyd::transform::{fill_bytes, load_f64};
use proptest::prelude::*;
use rmpv::Value;

/// A value every dtype holds exactly (float16 included: quarters up to ±100).
fn exact_value(ty: ElemType) -> BoxedStrategy<f64> {
    match ty {
        ElemType::Bool => prop_oneof![Just(0.0), Just(1.0)].boxed(),
        ElemType::U8 | ElemType::U16 | ElemType::U32 | ElemType::U64 => {
            (0u32..=200).prop_map(f64::from).boxed()
        }
        ElemType::I8 => (-100i32..=100).prop_map(f64::from).boxed(),
        ElemType::I16 | ElemType::I32 | ElemType::I64 => {
            (-30000i32..=30000).prop_map(f64::from).boxed()
        }
        ElemType::F16 | ElemType::F32 | ElemType::F64 => {
            (-400i32..=400).prop_map(|k| f64::from(k) / 4.0).boxed()
        }
    }
}

fn case() -> impl Strategy<Value = (ElemType, Vec<usize>, Vec<f64>)> {
    (
        0..ALL_ELEM_TYPES.len(),
        prop::collection::vec(1usize..=5, 1..=3),
    )
        .prop_flat_map(|(t, shape)| {
            let ty = ALL_ELEM_TYPES[t];
            let n: usize = shape.iter().product();
            (
                Just(ty),
                Just(shape),
                prop::collection::vec(exact_value(ty), n..=n),
            )
        })
}

fn plan(wire: ElemType, engine: ElemType, shape: &[usize]) -> Plan {
    let text = format!(
        "[engine]\nmodel = \"m.onnx\"\n[[inputs]]\nkey = \"x\"\ntensor = \"x\"\n\
         dtypes = [\"{}\"]\nshape = {shape:?}\n[[outputs]]\ntensor = \"y\"\n",
        wire.name()
    );
    let cfg = Config::parse(&text, "prop", None).expect("config");
    let io = IoSpec {
        inputs: vec![TensorSpec {
            name: "x".into(),
            dtype: engine,
            shape: shape.to_vec(),
        }],
        outputs: vec![TensorSpec {
            name: "y".into(),
            dtype: ElemType::F32,
            shape: vec![1, 2],
        }],
    };
    Plan::compile(&cfg, cfg.default_policy(), &io).expect("plan")
}

fn frame(ty: ElemType, shape: &[usize], values: &[f64]) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut e = Encoder { buf: &mut buf };
    e.map(1);
    e.str("x");
    let size = ty.size();
    e.ndarray(ty, shape, values.len() * size, |d| {
        for (c, v) in d.chunks_exact_mut(size).zip(values) {
            fill_bytes(ty, *v, c);
        }
    });
    buf
}

fn decode(p: &Plan, engine: ElemType, n: usize, frame: &[u8]) -> Vec<u8> {
    let mut bufs: Vec<Box<dyn InputBuffer>> =
        vec![Box::new(HostBuffer(vec![0; n * engine.size()]))];
    let mut seen = vec![false];
    p.decode(frame, &mut bufs, &mut seen).expect("decodes");
    assert!(seen[0]);
    bufs[0].bytes_mut().to_vec()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn every_dtype_and_shape_decodes_exactly((ty, shape, values) in case()) {
        let f = frame(ty, &shape, &values);
        let n = values.len();
        // Converted to the engine's float64.
        let got = decode(&plan(ty, ElemType::F64, &shape), ElemType::F64, n, &f);
        for (i, v) in values.iter().enumerate() {
            prop_assert_eq!(load_f64(ElemType::F64, &got, i), *v, "{} element {}", ty, i);
        }
        // Into an input of the same dtype: the bytes as sent.
        let same = decode(&plan(ty, ty, &shape), ty, n, &f);
        let mut want = vec![0u8; n * ty.size()];
        for (c, v) in want.chunks_exact_mut(ty.size()).zip(&values) {
            fill_bytes(ty, *v, c);
        }
        prop_assert_eq!(same, want);
    }
}

// ---------------------------------------------------------------------------------------------
// Replies

/// A reply to encode: the engine's [h, d] chunk and the output binding's settings.
struct Case {
    h: usize,
    d: usize,
    f64_out: bool,
    norm: Option<(Vec<f64>, Vec<f64>)>,
    per_chunk: usize,
    engine: Vec<f32>,
}

impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}x{} f64={} norm={} per_chunk={}",
            self.h,
            self.d,
            self.f64_out,
            self.norm.is_some(),
            self.per_chunk
        )
    }
}

fn reply_case() -> impl Strategy<Value = Case> {
    (1usize..=60, 1usize..=20, any::<bool>(), any::<bool>()).prop_flat_map(
        |(h, d, f64_out, norm)| {
            let stats = prop::collection::vec(-3.0f64..3.0, d..=d);
            let stds = prop::collection::vec(0.01f64..3.0, d..=d);
            (
                Just((h, d, f64_out)),
                if norm {
                    (stats, stds).prop_map(Some).boxed()
                } else {
                    Just(None).boxed()
                },
                0usize..=h + 2,
                prop::collection::vec(-1.0f32..1.0, h * d..=h * d),
            )
                .prop_map(|((h, d, f64_out), norm, per_chunk, engine)| Case {
                    h,
                    d,
                    f64_out,
                    norm,
                    per_chunk,
                    engine,
                })
        },
    )
}

fn reply_plan(c: &Case) -> (Config, Plan) {
    let mut text = format!(
        "[engine]\nmodel = \"m.onnx\"\n[pacing]\nactions_per_chunk = {}\n\
         [[inputs]]\nkey = \"x\"\ntensor = \"x\"\ndtypes = [\"float32\"]\nshape = [1]\n\
         [[outputs]]\ntensor = \"y\"\ndtype = \"{}\"\n",
        c.per_chunk,
        if c.f64_out { "float64" } else { "float32" }
    );
    if let Some((m, s)) = &c.norm {
        text += &format!("mean = {m:?}\nstd = {s:?}\n");
    }
    let cfg = Config::parse(&text, "prop", None).expect("config");
    let io = IoSpec {
        inputs: vec![TensorSpec {
            name: "x".into(),
            dtype: ElemType::F32,
            shape: vec![1],
        }],
        outputs: vec![TensorSpec {
            name: "y".into(),
            dtype: ElemType::F32,
            shape: vec![1, c.h, c.d],
        }],
    };
    let plan = Plan::compile(&cfg, cfg.default_policy(), &io).expect("plan");
    (cfg, plan)
}

fn get<'v>(v: &'v Value, k: &str) -> Option<&'v Value> {
    v.as_map()?
        .iter()
        .find(|(mk, _)| mk.as_str() == Some(k) || mk.as_slice() == Some(k.as_bytes()))
        .map(|(_, v)| v)
}

/// The elements of an openpi ndarray marker, as float64.
fn elements(a: &Value) -> (String, Vec<i64>, Vec<f64>) {
    let dtype = get(a, "dtype")
        .and_then(Value::as_str)
        .expect("dtype")
        .to_string();
    let shape = get(a, "shape")
        .and_then(Value::as_array)
        .expect("shape")
        .iter()
        .map(|d| d.as_i64().expect("int dim"))
        .collect();
    let data = get(a, "data").and_then(Value::as_slice).expect("data");
    let values = match dtype.as_str() {
        "<f4" => data
            .chunks_exact(4)
            .map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap())))
            .collect(),
        "<f8" => data
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        other => panic!("unexpected dtype {other}"),
    };
    (dtype, shape, values)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn replies_decode_to_the_kept_rows_unnormalised_in_both_dialects(c in reply_case()) {
        let (cfg, plan) = reply_plan(&c);
        let outputs = vec![c.engine.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()];
        let mut scratch = vec![0u8; plan.scratch_bytes];
        let chunk = plan.chunk(&cfg.default_policy().pacing, 0);
        let rows = if c.per_chunk == 0 { c.h } else { c.per_chunk.min(c.h) };
        // What the client must get: row-major [rows, d], x·(std + 1e-6) + mean per column.
        let want: Vec<f64> = (0..rows * c.d)
            .map(|i| {
                let x = f64::from(c.engine[i]);
                let v = match &c.norm {
                    Some((m, s)) => x * (s[i % c.d] + 1e-6) + m[i % c.d],
                    None => x,
                };
                if c.f64_out { v } else { f64::from(v as f32) }
            })
            .collect();
        let close = |got: &[f64]| {
            got.len() == want.len()
                && got.iter().zip(&want).all(|(g, w)| (g - w).abs() <= 1e-6 * w.abs().max(1.0))
        };

        let mut buf = Vec::with_capacity(plan.reply_capacity);
        let timing = Timing { policy_infer_ms: 1.5, server_infer_ms: 2.5, prev_total_ms: Some(4.0), stages: None };
        let mut parts = ReplyParts { outputs: &outputs, scratch: &mut scratch, chunk, raw: &[] };
        Dialect::Openpi.encode_infer(&mut plan.reply(&mut parts), &timing, Some(3), &mut buf);
        prop_assert!(buf.len() <= plan.reply_capacity, "{} > {}", buf.len(), plan.reply_capacity);
        let v = rmpv::decode::read_value(&mut &buf[..]).expect("msgpack");
        let (dtype, shape, got) = elements(get(&v, "actions").expect("actions"));
        prop_assert_eq!(dtype, if c.f64_out { "<f8" } else { "<f4" });
        prop_assert_eq!(shape, vec![rows as i64, c.d as i64]);
        prop_assert!(close(&got), "{:?}: values differ", c);
        let infer = get(&v, "policy_timing").and_then(|t| get(t, "infer_ms")).and_then(Value::as_f64);
        prop_assert_eq!(infer, Some(1.5));
        prop_assert_eq!(get(&v, "delay_steps").and_then(Value::as_i64), Some(3));

        let mut parts = ReplyParts { outputs: &outputs, scratch: &mut scratch, chunk, raw: &[] };
        Dialect::Vllm.encode_infer(&mut plan.reply(&mut parts), &timing, None, &mut buf);
        prop_assert!(buf.len() <= plan.reply_capacity);
        let v = rmpv::decode::read_value(&mut &buf[..]).expect("msgpack");
        // vllm-omni: the bare array, always float32.
        let (dtype, shape, got) = elements(&v);
        prop_assert_eq!(dtype, "<f4");
        prop_assert_eq!(shape, vec![rows as i64, c.d as i64]);
        let want32: Vec<f64> = want.iter().map(|w| f64::from(*w as f32)).collect();
        prop_assert!(
            got.len() == want32.len()
                && got.iter().zip(&want32).all(|(g, w)| (g - w).abs() <= 1e-6 * w.abs().max(1.0)),
            "{:?}: vllm values differ", c
        );
    }
}

/// Every input the fuzz targets keep — their seed corpus and each crash ever found
/// (fuzz/regressions) — runs through the same entry points as the fuzzers (scripts/fuzz,
/// `cargo fuzz run`), without panicking.
#[test]
fn fuzz_corpus_and_regressions_replay_cleanly() {
    assert_eq!(
        policyd::testing::fuzz::binding_sets(),
        3,
        "every binding set of the decode target compiles"
    );
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz");
    type Target = fn(&[u8]);
    let targets: [(&str, Target); 4] = [
        ("decode", policyd::testing::fuzz::decode),
        ("config", policyd::testing::fuzz::config),
        ("pickle", policyd::testing::fuzz::pickle),
        ("setup", |d| policyd::testing::fuzz::setup(d, None)),
    ];
    let mut replayed = 0;
    for (target, run) in targets {
        for dir in ["corpus", "regressions"] {
            let path = format!("{root}/{dir}/{target}");
            let entries = std::fs::read_dir(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
            for entry in entries {
                let file = entry.expect("a directory entry").path();
                let data = std::fs::read(&file).expect("readable");
                run(&data);
                replayed += 1;
            }
        }
    }
    assert!(replayed >= 50, "only {replayed} inputs under fuzz/");
    eprintln!("replayed {replayed} inputs from fuzz/corpus and fuzz/regressions");
}
