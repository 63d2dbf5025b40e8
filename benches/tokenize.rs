//! A prompt to token ids, as a `[inputs.tokenizer]` binding does it: cold (a session's prompt
//! changed: clean, lay out, encode with the SentencePiece model) and cached (the prompt is the
//! session's last one: compare, then write the cached ids and mask into the engine inputs).
//! benches/tokenize_python.py times openpi's `PaligemmaTokenizer.tokenize` on the same prompts
//! and tokenizer, for comparison.

use criterion::{Criterion, criterion_group, criterion_main};
use policyd::bind::{Plan, PromptCache};
use policyd::config::Config;
use policyd::dtype::ElemType;
use policyd::engine::{HostBuffer, InputBuffer, IoSpec, TensorSpec};
use policyd::protocol::Encoder;
use policyd::tokenizer::{Around, Format, Tokenizer};

/// A typical LIBERO task (pi0) and the pi0.5 layout of it with a 32-value state.
const PROMPT: &str = "put both the alphabet soup and the tomato sauce in the basket";

fn plan(format: &str, max_tokens: usize) -> Plan {
    let text = format!(
        r#"
[engine]
model = "synthetic"
[[inputs]]
key = "state"
tensor = "state"
dtypes = ["float32"]
shape = [32]
[[inputs]]
key = "prompt"
tensor = "ids"
dtypes = ["text"]
[inputs.tokenizer]
file = "models/tokenizer/bpe.model"
format = "{format}"
max_tokens = {max_tokens}
mask_tensor = "mask"
{}
[[outputs]]
tensor = "actions"
"#,
        if format == "pi05" {
            "state_key = \"state\""
        } else {
            ""
        }
    );
    let cfg = Config::parse(&text, "bench", None).expect("config");
    let t = |name: &str, dtype, shape: &[usize]| TensorSpec {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
    };
    let io = IoSpec {
        inputs: vec![
            t("ids", ElemType::I32, &[1, max_tokens]),
            t("mask", ElemType::Bool, &[1, max_tokens]),
            t("state", ElemType::F32, &[1, 32]),
        ],
        outputs: vec![t("actions", ElemType::F32, &[1, 50, 32])],
    };
    Plan::compile(&cfg, cfg.default_policy(), &io).expect("plan")
}

fn frame() -> Vec<u8> {
    let mut buf = Vec::new();
    let mut e = Encoder { buf: &mut buf };
    e.map(2);
    e.str("state");
    e.ndarray(ElemType::F32, &[32], 128, |d| {
        for (k, c) in d.chunks_exact_mut(4).enumerate() {
            c.copy_from_slice(&(k as f32 / 40.0 - 0.4).to_le_bytes());
        }
    });
    e.str("prompt");
    e.str(PROMPT);
    buf
}

fn bench(c: &mut Criterion) {
    let tok = Tokenizer::load(
        &std::fs::read("models/tokenizer/bpe.model").expect("tokenizer"),
        None,
    )
    .expect("load");
    let mut ids = Vec::new();
    let bins: Vec<i16> = (0..32).map(|k| 100 + k).collect();
    let mut g = c.benchmark_group("tokenize");
    g.bench_function("cold: pi0 prompt, encode (no cache)", |b| {
        b.iter(|| {
            tok.tokenize(Format::Pi0, PROMPT, &[], Around::NONE, &mut ids)
                .expect("encode")
        })
    });
    g.bench_function("cold: pi05 prompt + 32-value state, encode", |b| {
        b.iter(|| {
            tok.tokenize(Format::Pi05, PROMPT, &bins, Around::NONE, &mut ids)
                .expect("encode")
        })
    });
    for (format, max) in [("pi0", 48), ("pi05", 200)] {
        let plan = plan(format, max);
        let mut bufs: Vec<Box<dyn InputBuffer>> = plan
            .io
            .inputs
            .iter()
            .map(|s| s.bytes())
            .chain(plan.host_buffers.iter().copied())
            .map(|n| Box::new(HostBuffer(vec![0; n])) as Box<dyn InputBuffer>)
            .collect();
        let mut seen = vec![false; plan.inputs.len()];
        let frame = frame();
        plan.decode(&frame, &mut bufs, &mut seen).expect("decode");
        let mut cache = PromptCache::default();
        plan.tokenize(&mut bufs, &mut cache).expect("tokenize");
        g.bench_function(
            format!("cached: {format} prompt unchanged, ids + mask written"),
            |b| {
                b.iter(|| {
                    let t = plan.tokenize(&mut bufs, &mut cache).expect("tokenize");
                    assert!(!t.encoded);
                })
            },
        );
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
