//! One request end to end, in-process: policyd serving a demo config on loopback (CPU engine)
//! and a client sending a pre-encoded observation and waiting for the action chunk. This is
//! WebSocket framing and masking both ways, decode with transforms, scheduling, the engine,
//! and encode. The bytes named are the request plus the reply.
//!
//! `policyd-bench` measures the same thing across processes, with percentiles, CPU per
//! request, and the transport floor beside it.

use std::path::Path;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use policyd::config::Config;
use policyd_bench::load::{self, Reply};
use policyd_bench::profile::Profile;

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    for profile in ["tiny", "libero", "aloha"] {
        let file = format!("{}/../configs/{profile}.toml", env!("CARGO_MANIFEST_DIR"));
        let mut cfg = Config::load(Path::new(&file)).unwrap();
        cfg.server.port = 0;
        let loaded = policyd::policy::build::load(&cfg, cfg.default_policy()).unwrap();
        let listener = rt.block_on(policyd::net::server::bind(&cfg)).unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        rt.spawn(policyd::net::server::serve(cfg, loaded, listener, async {
            let _ = stopped.await;
        }));
        let mut ws = load::connect(&format!("ws://{addr}"), None).unwrap();
        let frame = bytes::Bytes::from(Profile::built_in(profile).unwrap().encode(1).0);
        let (reply, bytes) = load::request(&mut ws, frame.clone()).unwrap();
        assert!(matches!(reply, Reply::Actions { .. }), "the demo answers");
        let mut g = c.benchmark_group("request");
        g.throughput(Throughput::Bytes((frame.len() + bytes.len()) as u64));
        g.bench_function(
            format!(
                "{profile} round trip ({} B + {} B)",
                frame.len(),
                bytes.len()
            ),
            |b| b.iter(|| load::request(&mut ws, frame.clone()).unwrap()),
        );
        g.finish();
        let _ = stop.send(());
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
