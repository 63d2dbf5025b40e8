//! The systemd notify sequence, against a test `NOTIFY_SOCKET`: STATUS while loading, READY
//! only after warm-up, WATCHDOG pings while the engine progresses and none while it is stuck,
//! STOPPING on shutdown.
//!
//! One test: it sets process environment (`NOTIFY_SOCKET`, `WATCHDOG_USEC`) before any thread
//! starts.

use std::os::unix::net::UnixDatagram;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use policyd::config::Config;
use policyd::dtype::ElemType;
use policyd::engine::{Engine, IoSpec, TensorSpec};
use policyd::protocol::Encoder;
use policyd::testing::synthetic::{Behaviour, SyntheticEngine};
use tokio_tungstenite::tungstenite::Message;

const CONFIG: &str = r#"
[server]
host = "127.0.0.1"
port = 0
[engine]
model = "synthetic"
warmup_runs = 2
[[inputs]]
key = "state"
tensor = "state"
dtypes = ["float64"]
shape = [8]
[[outputs]]
tensor = "actions"
"#;

fn engine() -> Box<dyn Engine> {
    let t = |name: &str, shape: &[usize]| TensorSpec {
        name: name.into(),
        dtype: ElemType::F32,
        shape: shape.to_vec(),
    };
    let io = IoSpec {
        inputs: vec![t("state", &[1, 8])],
        outputs: vec![t("actions", &[1, 10, 7])],
    };
    Box::new(SyntheticEngine::new(
        io,
        Behaviour {
            // Warm-up: 2 × 200 ms. The first real request (run 3) hangs for 1.5 s.
            compute: Duration::from_millis(200),
            stall_on_run: 3,
            stall: Duration::from_millis(1500),
            ..Default::default()
        },
    ))
}

#[test]
fn notify_sequence_and_watchdog() {
    let dir = std::env::temp_dir().join(format!("policyd-notify-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join("notify.sock");
    let _ = std::fs::remove_file(&path);
    let sock = UnixDatagram::bind(&path).expect("bind the test notify socket");
    // SAFETY: no other thread exists yet in this test process's single test.
    unsafe {
        std::env::set_var("NOTIFY_SOCKET", &path);
        std::env::set_var("WATCHDOG_USEC", "400000"); // pings every 200 ms
        std::env::set_var("WATCHDOG_PID", std::process::id().to_string());
    }
    let (tx, rx) = mpsc::channel::<(Instant, String)>();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = sock.recv(&mut buf) {
            let msg = String::from_utf8_lossy(&buf[..n]).to_string();
            if tx.send((Instant::now(), msg)).is_err() {
                return;
            }
        }
    });
    let start = Instant::now();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let cfg = Config::parse(CONFIG, "test", None).unwrap();
    let server = rt.spawn(policyd::app::run(cfg, |_| Ok(engine()), async {
        let _ = stop_rx.await;
    }));

    let next = |what: &str| -> (Instant, String) {
        loop {
            let (t, m) = rx
                .recv_timeout(Duration::from_secs(10))
                .unwrap_or_else(|_| panic!("no {what} notification"));
            if m.contains(what) {
                return (t, m);
            }
        }
    };
    let (_, loading) = next("STATUS=");
    assert!(loading.contains("loading"), "{loading}");
    let (ready_at, ready) = next("READY=1");
    assert!(
        ready_at - start >= Duration::from_millis(400),
        "READY before the 400 ms warm-up: {:?}",
        ready_at - start
    );
    assert!(ready.contains("STATUS=serving"), "{ready}");
    let addr = ready
        .split("ws://")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .expect("address in STATUS")
        .to_string();

    // Idle: the worker beats, so the watchdog is pinged about every 200 ms.
    let t0 = Instant::now();
    let mut pings = 0;
    while t0.elapsed() < Duration::from_millis(1000) {
        if let Ok((_, m)) = rx.recv_timeout(Duration::from_millis(50))
            && m.contains("WATCHDOG=1")
        {
            pings += 1;
        }
    }
    assert!(pings >= 3, "{pings} watchdog pings in 1 s");

    // A request that hangs the engine for 1.5 s: the pings stop, then resume.
    rt.spawn(async move {
        let (mut ws, _) = tokio_tungstenite::connect_async(format!("ws://{addr}/"))
            .await
            .expect("connects");
        ws.next().await;
        let mut buf = Vec::new();
        let mut e = Encoder { buf: &mut buf };
        e.map(1);
        e.str("state");
        e.ndarray(ElemType::F64, &[8], 64, |d| d.fill(0));
        ws.send(Message::Binary(buf.into())).await.unwrap();
        ws.next().await;
    });
    let hang_start = Instant::now();
    // Drain pings sent before the run began (up to one period plus the 200 ms compute).
    let mut last_ping = hang_start;
    let mut longest_gap = Duration::ZERO;
    while hang_start.elapsed() < Duration::from_millis(2600) {
        if let Ok((t, m)) = rx.recv_timeout(Duration::from_millis(50))
            && m.contains("WATCHDOG=1")
        {
            longest_gap = longest_gap.max(t - last_ping);
            last_ping = t;
        }
    }
    assert!(
        longest_gap >= Duration::from_millis(1000),
        "watchdog kept pinging while the engine hung (longest gap {longest_gap:?})"
    );
    assert!(
        last_ping.elapsed() < Duration::from_millis(600),
        "pings did not resume after the hang"
    );

    let _ = stop_tx.send(());
    next("STOPPING=1");
    rt.block_on(server).unwrap().expect("clean shutdown");
    let _ = std::fs::remove_dir_all(&dir);
}
