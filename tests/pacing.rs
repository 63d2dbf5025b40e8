//! Pacing and streaming over real WebSockets, with a synthetic engine whose outputs say which
//! observation it ran (every action element is `state[0] + k / 1000`).

use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use policyd::dtype::ElemType;
use policyd::protocol::Encoder;
use policyd::testing::synthetic::Behaviour;
use rmpv::Value;
use tokio_tungstenite::tungstenite::Message;

mod common;
use common::{D, H, Running, Ws};

async fn start(pacing: &str, behaviour: Behaviour) -> Running {
    common::start(common::synthetic_config("", "slots = 4", pacing), behaviour).await
}

async fn connect(srv: &Running, path: &str) -> Ws {
    common::connect(srv.addr, path).await
}

/// A request: `state` = [x0, 0, …], plus extra `(key, writer)` entries.
/// An extra request entry: its key and how to write its value.
type Extra<'a> = (&'a str, &'a dyn Fn(&mut Encoder<'_>));

fn request(x0: f64, extra: &[Extra<'_>]) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut e = Encoder { buf: &mut buf };
    e.map(1 + extra.len() as u32);
    e.str("state");
    e.ndarray(ElemType::F64, &[8], 64, |d| {
        d[..8].copy_from_slice(&x0.to_le_bytes());
        d[8..].fill(0);
    });
    for (k, w) in extra {
        e.str(k);
        w(&mut e);
    }
    buf
}

fn observe(x0: f64, timestep: i64, timestamp: f64, must_go: bool) -> Vec<u8> {
    request(
        x0,
        &[
            ("endpoint", &|e| e.str("observe")),
            ("timestep", &move |e| e.int(timestep)),
            ("timestamp", &move |e| e.f64(timestamp)),
            ("must_go", &move |e| e.bool(must_go)),
        ],
    )
}

async fn send(ws: &mut Ws, frame: Vec<u8>) {
    ws.send(Message::Binary(frame.into())).await.unwrap();
}

/// The next data message, decoded.
async fn recv(ws: &mut Ws) -> Value {
    loop {
        match tokio::time::timeout(Duration::from_secs(10), ws.next()).await {
            Ok(Some(Ok(Message::Binary(b)))) => {
                return rmpv::decode::read_value(&mut &b[..]).expect("msgpack");
            }
            Ok(Some(Ok(Message::Ping(_)))) => continue,
            other => panic!("expected a binary message, got {other:?}"),
        }
    }
}

/// `recv`, but `None` if nothing comes within `wait`.
async fn recv_within(ws: &mut Ws, wait: Duration) -> Option<Value> {
    tokio::time::timeout(wait, recv(ws)).await.ok()
}

fn get<'a>(v: &'a Value, key: &str) -> &'a Value {
    v.as_map()
        .and_then(|m| {
            m.iter()
                .find(|(k, _)| k.as_str() == Some(key) || k.as_slice() == Some(key.as_bytes()))
        })
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no key {key} in {v}"))
}

/// An openpi ndarray marker: (dtype, shape, data).
fn ndarray(v: &Value) -> (String, Vec<usize>, Vec<u8>) {
    let dtype = get(v, "dtype").as_str().unwrap().to_string();
    let shape = get(v, "shape")
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_u64().unwrap() as usize)
        .collect();
    let data = get(v, "data").as_slice().unwrap().to_vec();
    (dtype, shape, data)
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_pushes_timed_actions() {
    let srv = start("fps = 10.0", Behaviour::default()).await;
    let mut ws = connect(&srv, "/").await;
    send(&mut ws, observe(2.5, 5, 100.0, false)).await;
    let push = recv(&mut ws).await;
    assert_eq!(get(&push, "type").as_str(), Some("actions"));
    let (dtype, shape, data) = ndarray(get(&push, "actions"));
    assert_eq!((dtype.as_str(), shape), ("<f4", vec![H, D]));
    let a = f32s(&data);
    assert!(
        (a[0] - 2.5).abs() < 1e-6 && (a[8] - 2.508).abs() < 1e-6,
        "{a:?}"
    );
    let (dtype, shape, data) = ndarray(get(&push, "timesteps"));
    assert_eq!((dtype.as_str(), shape), ("<i8", vec![H]));
    let steps: Vec<i64> = data
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(steps, (5..15).collect::<Vec<i64>>());
    let (dtype, _, data) = ndarray(get(&push, "timestamps"));
    assert_eq!(dtype, "<f8");
    for (i, c) in data.chunks_exact(8).enumerate() {
        let t = f64::from_le_bytes(c.try_into().unwrap());
        assert!((t - (100.0 + i as f64 * 0.1)).abs() < 1e-9, "{t}");
    }
    assert_eq!(get(&push, "obs_timestep").as_i64(), Some(5));
    assert!(get(&push, "delay_steps").as_u64().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_newest_observation_wins_and_skips_are_reported() {
    let srv = start(
        "report_skipped = true",
        Behaviour {
            compute: Duration::from_millis(150),
            ..Default::default()
        },
    )
    .await;
    let mut ws = connect(&srv, "/").await;
    // 1 starts at once; 2 waits and is replaced by 3, which is replaced by 4.
    send(&mut ws, observe(1.0, 1, 0.0, false)).await;
    tokio::time::sleep(Duration::from_millis(30)).await;
    for t in 2..=4 {
        send(&mut ws, observe(t as f64, t, t as f64 * 0.1, false)).await;
    }
    let mut skipped = Vec::new();
    let mut ran = Vec::new();
    while ran.len() < 2 {
        let m = recv(&mut ws).await;
        match get(&m, "type").as_str() {
            Some("skipped") => {
                assert_eq!(get(&m, "reason").as_str(), Some("superseded"));
                skipped.push(get(&m, "timestep").as_i64().unwrap());
            }
            Some("actions") => {
                let step = get(&m, "obs_timestep").as_i64().unwrap();
                let x0 = f32s(&ndarray(get(&m, "actions")).2)[0];
                assert_eq!(
                    x0, step as f32,
                    "the push carries its own observation's result"
                );
                ran.push(step);
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(ran, [1, 4]);
    assert_eq!(skipped, [2, 3]);
    assert!(
        recv_within(&mut ws, Duration::from_millis(300))
            .await
            .is_none()
    );
    let s = &srv.stats.skips;
    use std::sync::atomic::Ordering::Relaxed;
    assert_eq!(
        (s.observed.load(Relaxed), s.superseded.load(Relaxed)),
        (4, 2)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn predicted_timesteps_are_filtered_must_go_bypasses_and_reset_clears() {
    let srv = start("report_skipped = true", Behaviour::default()).await;
    let mut ws = connect(&srv, "/v1/realtime/robot/openpi").await;
    send(&mut ws, observe(1.0, 7, 0.7, false)).await;
    assert_eq!(get(&recv(&mut ws).await, "type").as_str(), Some("actions"));
    send(&mut ws, observe(1.0, 7, 0.7, false)).await;
    let m = recv(&mut ws).await;
    assert_eq!(get(&m, "type").as_str(), Some("skipped"));
    assert_eq!(get(&m, "reason").as_str(), Some("already_predicted"));
    send(&mut ws, observe(1.0, 7, 0.7, true)).await;
    assert_eq!(get(&recv(&mut ws).await, "type").as_str(), Some("actions"));
    // A reset forgets the session's predicted timesteps.
    let mut reset = Vec::new();
    let mut e = Encoder { buf: &mut reset };
    e.map(1);
    e.str("endpoint");
    e.str("reset");
    send(&mut ws, reset).await;
    assert_eq!(
        get(&recv(&mut ws).await, "status").as_str(),
        Some("reset successful")
    );
    send(&mut ws, observe(1.0, 7, 0.7, false)).await;
    assert_eq!(get(&recv(&mut ws).await, "type").as_str(), Some("actions"));
    // Sessions are separate: "b" has predicted nothing yet.
    send(
        &mut ws,
        request(
            1.0,
            &[
                ("endpoint", &|e| e.str("observe")),
                ("timestep", &|e| e.int(7)),
                ("timestamp", &|e| e.f64(0.7)),
                ("session_id", &|e| e.str("b")),
            ],
        ),
    )
    .await;
    assert_eq!(get(&recv(&mut ws).await, "type").as_str(), Some("actions"));
}

/// An `observe` of timestep `t` in session `sid` (the current one when `None`).
fn observe_in(t: i64, sid: Option<&str>) -> Vec<u8> {
    let ts = t as f64 / 10.0;
    match sid {
        Some(s) => request(
            1.0,
            &[
                ("endpoint", &|e| e.str("observe")),
                ("timestep", &move |e| e.int(t)),
                ("timestamp", &move |e| e.f64(ts)),
                ("session_id", &move |e| e.str(s)),
            ],
        ),
        None => observe(1.0, t, ts, false),
    }
}

/// Whether the server ran the observation (`actions`) or skipped it as already predicted.
async fn ran(ws: &mut Ws, frame: Vec<u8>) -> bool {
    send(ws, frame).await;
    match get(&recv(ws).await, "type").as_str() {
        Some("actions") => true,
        Some("skipped") => false,
        other => panic!("unexpected reply type {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_reset_clears_every_session_of_the_socket_and_unsets_the_current_one() {
    let srv = start("report_skipped = true", Behaviour::default()).await;
    let mut ws = connect(&srv, "/v1/realtime/robot/openpi").await;
    let reset = || request(0.0, &[("endpoint", &|e| e.str("reset"))]);
    for with_id in [false, true] {
        assert!(ran(&mut ws, observe_in(1, Some("a"))).await);
        assert!(ran(&mut ws, observe_in(1, Some("b"))).await);
        assert!(
            !ran(&mut ws, observe_in(1, Some("a"))).await,
            "a predicted 1"
        );
        // vllm-omni: a reset (even one naming a session) forgets every session it has seen.
        let frame = if with_id {
            request(
                0.0,
                &[
                    ("endpoint", &|e| e.str("reset")),
                    ("session_id", &|e| e.str("b")),
                ],
            )
        } else {
            reset()
        };
        send(&mut ws, frame).await;
        assert_eq!(
            get(&recv(&mut ws).await, "status").as_str(),
            Some("reset successful")
        );
        // The current session is "default" again, not "b".
        assert!(ran(&mut ws, observe_in(2, None)).await);
        assert!(
            ran(&mut ws, observe_in(1, Some("b"))).await,
            "b starts afresh"
        );
        assert!(
            !ran(&mut ws, observe_in(2, Some("default"))).await,
            "went to default"
        );
        assert!(
            ran(&mut ws, observe_in(1, Some("a"))).await,
            "a starts afresh"
        );
        send(&mut ws, reset()).await;
        let _ = recv(&mut ws).await;
    }
    // The openpi route resets only the session it names.
    let mut ws = connect(&srv, "/").await;
    assert!(ran(&mut ws, observe_in(1, Some("a"))).await);
    assert!(ran(&mut ws, observe_in(1, Some("b"))).await);
    send(
        &mut ws,
        request(
            0.0,
            &[
                ("endpoint", &|e| e.str("reset")),
                ("session_id", &|e| e.str("b")),
            ],
        ),
    )
    .await;
    let _ = recv(&mut ws).await;
    assert!(ran(&mut ws, observe_in(1, Some("b"))).await, "b was reset");
    assert!(!ran(&mut ws, observe_in(1, Some("a"))).await, "a was not");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_observe_requests_get_clear_errors_and_the_socket_stays() {
    let srv = start("", Behaviour::default()).await;
    let mut ws = connect(&srv, "/v1/realtime/robot/openpi").await;
    let long = "x".repeat(1000);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "timestep",
            request(0.0, &[("endpoint", &|e| e.str("observe"))]),
        ),
        ("timestep", {
            request(
                0.0,
                &[
                    ("endpoint", &|e| e.str("observe")),
                    ("timestep", &|e| e.int(-3)),
                    ("timestamp", &|e| e.f64(1.0)),
                ],
            )
        }),
        ("timestamp", {
            request(
                0.0,
                &[
                    ("endpoint", &|e| e.str("observe")),
                    ("timestep", &|e| e.int(3)),
                ],
            )
        }),
        ("timestamp", observe(0.0, 1, -1.0, false)),
        ("timestamp", observe(0.0, 1, f64::NAN, false)),
        ("timestamp", observe(0.0, 1, f64::INFINITY, false)),
        (
            "unknown endpoint",
            request(0.0, &[("endpoint", &|e| e.str("teleport"))]),
        ),
        (
            "session_id",
            // Integers are accepted (vllm-omni takes str(session_id)); a map is not.
            request(0.0, &[("session_id", &|e| e.map(0))]),
        ),
        (
            "session_id",
            request(0.0, &[("session_id", &|e| e.str(&long))]),
        ),
        (
            "timestep",
            request(0.0, &[("timestep", &|e| e.str("soon"))]),
        ),
    ];
    for (needle, frame) in cases {
        send(&mut ws, frame).await;
        let err = recv(&mut ws).await;
        assert!(
            matches!(&err, Value::Map(m) if m.iter().any(|(k, _)| k.as_str() == Some("type"))),
            "{needle}: accepted: {}",
            err.to_string().len()
        );
        assert_eq!(get(&err, "type").as_str(), Some("error"));
        let detail = get(&err, "detail").as_str().unwrap().to_string();
        assert!(detail.contains(needle), "{needle}: {detail}");
    }
    // Nothing was lost: the socket still serves.
    send(&mut ws, request(3.0, &[])).await;
    let (dtype, shape, data) = match recv(&mut ws).await {
        v @ Value::Map(_) => ndarray(&v),
        other => panic!("{other}"),
    };
    assert_eq!((dtype.as_str(), shape), ("<f4", vec![H, D]));
    assert_eq!(f32s(&data)[0], 3.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_latency_budget_releases_replies_on_schedule_never_early() {
    let budget = Duration::from_millis(25);
    let srv = start(
        "latency_budget_ms = 25.0",
        Behaviour {
            compute: Duration::from_millis(3),
            ..Default::default()
        },
    )
    .await;
    let mut ws = connect(&srv, "/").await;
    // POLICYD_PACING_SAMPLES raises the sample count for a jitter report.
    let n: u64 = std::env::var("POLICYD_PACING_SAMPLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(80);
    for i in 0..n {
        let t0 = Instant::now();
        send(&mut ws, request(i as f64, &[])).await;
        let reply = recv(&mut ws).await;
        let rtt = t0.elapsed();
        assert!(rtt >= budget, "released early: {rtt:?}");
        let server_ms = get(get(&reply, "server_timing"), "infer_ms")
            .as_f64()
            .unwrap();
        assert!(server_ms >= 25.0, "{server_ms}");
        // 25 ms at 30 Hz is one step (more only if the machine stalled).
        assert!(get(&reply, "delay_steps").as_u64().unwrap() >= 1);
    }
    let s = srv.stats.release.summary();
    println!(
        "release error over {} paced replies: p50 {} µs, p99 {} µs, max {} µs, misses {}",
        s.paced, s.p50_us, s.p99_us, s.max_us, s.misses
    );
    assert_eq!(s.paced, n);
    // Misses need the 3 ms engine to take 25 ms: only a badly stalled machine does that.
    assert!(s.misses <= n / 10, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_ready_after_its_deadline_goes_out_at_once_and_counts_as_a_miss() {
    let srv = start(
        "latency_budget_ms = 2.0",
        Behaviour {
            compute: Duration::from_millis(20),
            ..Default::default()
        },
    )
    .await;
    let mut ws = connect(&srv, "/").await;
    for i in 0..5 {
        send(&mut ws, request(i as f64, &[])).await;
        recv(&mut ws).await;
    }
    let s = srv.stats.release.summary();
    assert_eq!((s.paced, s.misses), (5, 5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_are_capped_and_stale_steps_dropped() {
    // 100 ms budget at 30 Hz: delay_steps = ceil(0.1 · 30) = 3 (4 when the release is late).
    let srv = start(
        "latency_budget_ms = 100.0\nactions_per_chunk = 6\nskip_stale_actions = true",
        Behaviour::default(),
    )
    .await;
    let mut ws = connect(&srv, "/").await;
    send(&mut ws, request(1.0, &[])).await;
    let reply = recv(&mut ws).await;
    let d = get(&reply, "delay_steps").as_u64().unwrap() as usize;
    assert!((3..=4).contains(&d), "{d}");
    let (_, shape, data) = ndarray(get(&reply, "actions"));
    assert_eq!(shape, [6 - d, D]);
    // The first row kept is row d of the chunk.
    let first = f32s(&data)[0];
    assert!(
        (first - (1.0 + (d * D) as f32 / 1000.0)).abs() < 1e-6,
        "{first}"
    );

    // Observe pushes are cut the same way, and their timesteps follow the kept rows.
    send(&mut ws, observe(1.0, 40, 4.0, false)).await;
    let push = recv(&mut ws).await;
    let d = get(&push, "delay_steps").as_u64().unwrap() as usize;
    let steps: Vec<i64> = ndarray(get(&push, "timesteps"))
        .2
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(steps, (40 + d as i64..46).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_failures_are_reported_and_serving_goes_on() {
    let srv = start(
        "",
        Behaviour {
            fail_every: 2,
            ..Default::default()
        },
    )
    .await;
    let mut ws = connect(&srv, "/v1/realtime/robot/openpi").await;
    // Run 1 was the warm-up; run 2 fails, run 3 succeeds, …
    send(&mut ws, request(1.0, &[])).await;
    let err = recv(&mut ws).await;
    assert_eq!(
        get(&err, "message").as_str(),
        Some("Internal inference error")
    );
    send(&mut ws, request(1.0, &[])).await;
    assert!(matches!(recv(&mut ws).await, Value::Map(_)));
}

/// A plain HTTP GET; the whole response.
async fn http_get(srv: &Running, path: &str) -> String {
    common::http_get(srv.addr, path, "").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_keeps_failing_turns_health_to_503() {
    // Warm-up (run 1) succeeds; every run after it fails, as a GPU in a sticky error would.
    let srv = start(
        "",
        Behaviour {
            fail_from: 2,
            ..Default::default()
        },
    )
    .await;
    let mut ws = connect(&srv, "/v1/realtime/robot/openpi").await;
    for i in 0..policyd::runtime::worker::FATAL_AFTER {
        assert!(
            http_get(&srv, "/healthz").await.starts_with("HTTP/1.1 200"),
            "run {i}"
        );
        send(&mut ws, request(1.0, &[])).await;
        let err = recv(&mut ws).await;
        assert_eq!(
            get(&err, "message").as_str(),
            Some("Internal inference error")
        );
    }
    let healthz = http_get(&srv, "/healthz").await;
    assert!(healthz.starts_with("HTTP/1.1 503"), "{healthz}");
    let health = http_get(&srv, "/health").await;
    assert!(health.ends_with("{\"status\":\"unhealthy\"}"), "{health}");
    let metrics = http_get(&srv, "/metrics").await;
    assert!(metrics.contains("\npolicyd_healthy 0"), "{metrics}");
    match tokio_tungstenite::connect_async(format!("ws://{}/", srv.addr)).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(r)) => assert_eq!(r.status(), 503),
        other => panic!("expected 503, got {:?}", other.map(|_| ())),
    }
}
