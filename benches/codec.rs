//! Codec throughput per demo profile: decoding an observation frame straight into the engine
//! input buffers (with the configured transforms), and encoding the reply. Each benchmark names
//! the bytes it moves, so throughput can be read against memory bandwidth.

use std::path::Path;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use policyd::config::Config;
use policyd::dtype::ElemType;
use policyd::plan::{Plan, ReplyParts};
use policyd::server::open_engine;
use policyd::wire::{Encoder, Timing};

fn frame(cfg: &Config) -> Vec<u8> {
    // Group keys by their first path segment, so nested keys (images/cam_high) nest.
    let mut buf = Vec::new();
    let mut tops: Vec<(String, Vec<&policyd::config::InputConfig>)> = Vec::new();
    for b in &cfg.inputs {
        let top = if b.key.starts_with("images/") {
            "images".to_string()
        } else {
            b.key.clone()
        };
        match tops.iter_mut().find(|(t, _)| *t == top) {
            Some((_, v)) => v.push(b),
            None => tops.push((top, vec![b])),
        }
    }
    let mut e = Encoder { buf: &mut buf };
    e.map(tops.len() as u32 + 1);
    let mut seed = 1u32;
    let mut array = |e: &mut Encoder<'_>, b: &policyd::config::InputConfig| {
        let t = ElemType::from_name(&b.dtypes[0]).unwrap();
        let n: usize = b.shape.iter().product::<usize>() * t.size();
        e.ndarray(t, &b.shape, n, |d| {
            for x in d.iter_mut() {
                seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
                *x = (seed >> 24) as u8;
            }
            if t == ElemType::F64 {
                for c in d.chunks_exact_mut(8) {
                    c.copy_from_slice(&0.25f64.to_le_bytes());
                }
            }
        });
    };
    for (top, bs) in &tops {
        e.str(top);
        if top == "images" {
            e.map(bs.len() as u32);
            for b in bs {
                e.str(b.key.trim_start_matches("images/"));
                array(&mut e, b);
            }
        } else {
            array(&mut e, bs[0]);
        }
    }
    e.str("prompt");
    e.str("pick up the cup");
    buf
}

fn bench(c: &mut Criterion) {
    for profile in ["aloha", "droid", "libero"] {
        let cfg = Config::load(Path::new(&format!("configs/{profile}.toml"))).unwrap();
        let engine = open_engine(&cfg).unwrap();
        let plan = Plan::compile(&cfg, engine.io()).unwrap();
        let mut inputs = engine.alloc_inputs().unwrap();
        let mut seen = vec![false; plan.inputs.len()];
        let f = frame(&cfg);
        plan.decode(&f, &mut inputs, &mut seen).unwrap();
        let mut g = c.benchmark_group(format!("codec/{profile}"));
        g.throughput(Throughput::Bytes(f.len() as u64));
        g.bench_function(format!("decode {} B frame", f.len()), |b| {
            b.iter(|| plan.decode(&f, &mut inputs, &mut seen).unwrap())
        });
        let outputs: Vec<Vec<u8>> = plan
            .io
            .outputs
            .iter()
            .map(|s| vec![0u8; s.bytes()])
            .collect();
        let mut out = Vec::with_capacity(plan.reply_capacity);
        let timing = Timing {
            policy_infer_ms: 1.0,
            server_infer_ms: 2.0,
            prev_total_ms: Some(3.0),
        };
        let mut scratch = vec![0u8; plan.scratch_bytes];
        let chunk = plan.chunk(&cfg.pacing, 0);
        let mut parts = ReplyParts {
            outputs: &outputs,
            scratch: &mut scratch,
            chunk,
        };
        plan.encode_openpi(&mut parts, &timing, Some(1), &mut out);
        g.throughput(Throughput::Bytes(out.len() as u64));
        g.bench_function(format!("encode {} B reply", out.len()), |b| {
            b.iter(|| plan.encode_openpi(&mut parts, &timing, Some(1), &mut out))
        });
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
