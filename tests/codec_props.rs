//! Property tests of the wire codec: random arrays of every supported dtype and shape,
//! encoded as openpi ndarrays, decode through a binding into the engine input exactly (to
//! float64, and byte for byte into an input of the same dtype).

use policyd::config::Config;
use policyd::dtype::{ALL_ELEM_TYPES, ElemType};
use policyd::engine::synthetic::HostBuffer;
use policyd::engine::{InputBuffer, IoSpec, TensorSpec};
use policyd::plan::Plan;
use policyd::transform::{fill_bytes, load_f64};
use policyd::wire::Encoder;
use proptest::prelude::*;

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
    Plan::compile(&cfg, &io).expect("plan")
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
