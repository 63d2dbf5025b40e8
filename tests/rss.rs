//! Memory stays flat while serving: 20,000 requests over several connections, sessions, both
//! dialects and both endpoints, after a warm-up, grow the resident set by less than 1 MiB.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Barrier;

use futures_util::{SinkExt, StreamExt};
use policyd::config::Config;
use policyd::dtype::ElemType;
use policyd::engine::{IoSpec, TensorSpec};
use policyd::protocol::Encoder;
use policyd::testing::synthetic::{Behaviour, SyntheticEngine};
use tokio_tungstenite::tungstenite::Message;

const CONFIG: &str = r#"
[server]
host = "127.0.0.1"
port = 0
max_sessions = 4
[engine]
model = "synthetic"
slots = 4
warmup_runs = 1
[pacing]
latency_budget_ms = 0.5
[[inputs]]
key = "observation/state"
tensor = "state"
dtypes = ["float64", "float32"]
shape = [8]
[[inputs]]
key = "observation/image"
tensor = "image"
dtypes = ["uint8"]
shape = [32, 32, 3]
layout = "hwc_to_chw"
scale = 0.00784313725490196
offset = -1.0
[[outputs]]
tensor = "actions"
"#;

fn io() -> IoSpec {
    let t = |name: &str, shape: &[usize]| TensorSpec {
        name: name.into(),
        dtype: ElemType::F32,
        shape: shape.to_vec(),
    };
    IoSpec {
        inputs: vec![t("state", &[1, 8]), t("image", &[1, 3, 32, 32])],
        outputs: vec![t("actions", &[1, 10, 7])],
    }
}

fn request(i: u64, session: &str, observe: bool) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut e = Encoder { buf: &mut buf };
    e.map(if observe { 7 } else { 4 });
    e.str("observation/state");
    e.ndarray(ElemType::F64, &[8], 64, |d| {
        d[..8].copy_from_slice(&(i as f64).to_le_bytes());
    });
    e.str("observation/image");
    e.ndarray(ElemType::U8, &[32, 32, 3], 3072, |d| {
        d.iter_mut()
            .enumerate()
            .for_each(|(k, b)| *b = (k as u64 + i) as u8)
    });
    e.str("session_id");
    e.str(session);
    e.str("prompt");
    e.str("stack the blocks");
    if observe {
        e.str("endpoint");
        e.str("observe");
        e.str("timestep");
        e.int(i as i64);
        e.str("timestamp");
        e.f64(i as f64 / 30.0);
    }
    buf
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("resident pages");
    pages * 4096
}

/// One client: alternates infer and observe over five sessions (more than `max_sessions`, so
/// sessions are evicted and recreated); `warm` requests, then the barrier twice (while the
/// resident set is read), then `n` more, and the barrier twice again.
async fn client(url: String, warm: u64, n: u64, seed: u64, barrier: Arc<Barrier>) {
    let (mut ws, _) = tokio_tungstenite::connect_async(url)
        .await
        .expect("connect");
    ws.next().await.expect("metadata").expect("metadata");
    requests(&mut ws, 0, warm, seed).await;
    barrier.wait().await;
    barrier.wait().await;
    requests(&mut ws, warm, warm + n, seed).await;
    // Still connected while the resident set is read again.
    barrier.wait().await;
    barrier.wait().await;
}

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn requests(ws: &mut Ws, from: u64, to: u64, seed: u64) {
    for i in from..to {
        let session = ["a", "b", "c", "d", "e"][((i + seed) % 5) as usize];
        let observe = i % 2 == 1;
        ws.send(Message::Binary(
            request(seed * 1_000_000 + i, session, observe).into(),
        ))
        .await
        .expect("send");
        loop {
            match tokio::time::timeout(Duration::from_secs(10), ws.next()).await {
                Ok(Some(Ok(Message::Binary(b)))) => {
                    assert!(b.len() > 200, "a real reply");
                    break;
                }
                Ok(Some(Ok(Message::Ping(_)))) => continue,
                other => panic!("request {i}: {other:?}"),
            }
        }
    }
}

fn clients(
    addr: std::net::SocketAddr,
    warm: u64,
    n: u64,
    barrier: &Arc<Barrier>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..4u64)
        .map(|c| {
            let path = if c % 2 == 0 {
                "/"
            } else {
                "/v1/realtime/robot/openpi"
            };
            tokio::spawn(client(
                format!("ws://{addr}{path}"),
                warm,
                n,
                c,
                barrier.clone(),
            ))
        })
        .collect()
}

#[test]
fn resident_memory_stays_flat_over_20000_requests() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let cfg = Config::parse(CONFIG, "test", None).unwrap();
        let engine = Box::new(SyntheticEngine::new(io(), Behaviour::default()));
        let loaded =
            policyd::policy::build::load_engine(&cfg, cfg.default_policy(), engine).unwrap();
        let listener = policyd::net::server::bind(&cfg).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = policyd::net::server::serve(cfg, loaded, listener, async {
                let _ = rx.await;
            })
            .await;
        });
        // Connections stay open: what they allocate when they connect is the budget's
        // per-connection part. Warm-up lets sessions, allocator arenas and socket buffers
        // reach their working size; then the resident set must stay put.
        let barrier = Arc::new(Barrier::new(5));
        let tasks = clients(addr, 1_000, 5_000, &barrier);
        barrier.wait().await;
        let before = rss_bytes();
        barrier.wait().await;
        barrier.wait().await;
        let after = rss_bytes();
        barrier.wait().await;
        for t in tasks {
            t.await.expect("client");
        }
        let growth = after as i64 - before as i64;
        println!(
            "RSS {:.1} MiB before, {:.1} MiB after 20,000 requests: growth {} KiB",
            before as f64 / 1048576.0,
            after as f64 / 1048576.0,
            growth / 1024
        );
        assert!(growth < 1 << 20, "RSS grew by {growth} bytes");
        let _ = tx.send(());
    });
}
