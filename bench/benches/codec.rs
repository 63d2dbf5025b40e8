//! Codec throughput per demo profile: decoding an observation frame straight into the engine
//! input buffers (with the configured transforms), and encoding the reply. Each benchmark names
//! the bytes it moves, so throughput can be read against memory bandwidth.

use std::path::Path;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use policyd::bind::{Plan, ReplyParts};
use policyd::config::Config;
use policyd::engine::open as open_engine;
use policyd::protocol::{Dialect, Timing};
use policyd_bench::profile::Profile;

fn bench(c: &mut Criterion) {
    for profile in ["aloha", "droid", "libero", "tiny"] {
        let file = format!("{}/../configs/{profile}.toml", env!("CARGO_MANIFEST_DIR"));
        let cfg = Config::load(Path::new(&file)).unwrap();
        let engine = open_engine(cfg.default_policy()).unwrap();
        let plan = Plan::compile(&cfg, cfg.default_policy(), engine.io()).unwrap();
        let mut inputs = engine.alloc_inputs().unwrap();
        let mut seen = vec![false; plan.inputs.len()];
        // The observation as openpi's examples send it (policyd-bench's built-in profile).
        let f = Profile::built_in(profile).unwrap().encode(1).0;
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
            stages: None,
        };
        let mut scratch = vec![0u8; plan.scratch_bytes];
        let chunk = plan.chunk(&cfg.default_policy().pacing, 0);
        let mut parts = ReplyParts {
            outputs: &outputs,
            scratch: &mut scratch,
            chunk,
            raw: &[],
        };
        Dialect::Openpi.encode_infer(&mut plan.reply(&mut parts), &timing, Some(1), &mut out);
        g.throughput(Throughput::Bytes(out.len() as u64));
        g.bench_function(format!("encode {} B reply", out.len()), |b| {
            b.iter(|| {
                Dialect::Openpi.encode_infer(
                    &mut plan.reply(&mut parts),
                    &timing,
                    Some(1),
                    &mut out,
                )
            })
        });
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
