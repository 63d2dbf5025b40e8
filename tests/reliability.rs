//! Faults and hostile clients, through the real listener with a synthetic engine (set compute
//! time, scripted failures): clients that vanish mid-inference, resets while the engine runs,
//! handshake floods, slow-loris heads, a frame one byte over the limit, and thousands of
//! random frames. Each must leave the server serving, with every slot back in its pool.
//! Loopback only; every loop is bounded in count and time.

use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use policyd::dtype::ElemType;
use policyd::protocol::Encoder;
use policyd::testing::synthetic::Behaviour;
use rmpv::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::{Bytes, Message};

const SLOTS: usize = 2;
const VLLM: &str = "/v1/realtime/robot/openpi";

mod common;
use common::{Running, Ws};

async fn start(server_keys: &str, behaviour: Behaviour) -> Running {
    start_with(server_keys, "", behaviour).await
}

async fn start_with(server_keys: &str, engine_keys: &str, behaviour: Behaviour) -> Running {
    let engine = format!("slots = {SLOTS}\n{engine_keys}");
    common::start(
        common::synthetic_config(server_keys, &engine, ""),
        behaviour,
    )
    .await
}

async fn connect(srv: &Running, path: &str) -> Ws {
    common::connect(srv.addr, path).await
}

fn request(x0: f64, endpoint: Option<&str>) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut e = Encoder { buf: &mut buf };
    e.map(1 + u32::from(endpoint.is_some()));
    e.str("state");
    e.ndarray(ElemType::F64, &[8], 64, |d| {
        d[..8].copy_from_slice(&x0.to_le_bytes());
        d[8..].fill(0);
    });
    if let Some(ep) = endpoint {
        e.str("endpoint");
        e.str(ep);
    }
    buf
}

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

fn is_error_map(v: &Value) -> bool {
    v.as_map().is_some_and(|m| {
        m.iter()
            .any(|(k, v)| k.as_str() == Some("type") && v.as_str() == Some("error"))
    })
}

/// vllm-omni's reply to an inference: a bare float32 array, 10×7 here.
fn is_actions(v: &Value) -> bool {
    !is_error_map(v) && v.to_string().contains("[10, 7]")
}

/// Waits until every slot is back in the pool.
async fn all_slots_back(srv: &Running) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while srv.pool.available() != SLOTS {
        assert!(
            Instant::now() < deadline,
            "slots not returned: {} of {SLOTS} free",
            srv.pool.available()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_vanishing_mid_inference_leave_every_slot_free() {
    let srv = start(
        "",
        Behaviour {
            compute: Duration::from_millis(150),
            ..Default::default()
        },
    )
    .await;
    // More vanished requests than slots, on both dialects.
    for path in ["/", VLLM, "/", VLLM] {
        let mut ws = connect(&srv, path).await;
        ws.send(Message::Binary(request(1.0, None).into()))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(ws);
    }
    all_slots_back(&srv).await;
    let mut ws = connect(&srv, VLLM).await;
    ws.send(Message::Binary(request(2.0, None).into()))
        .await
        .unwrap();
    assert!(is_actions(&recv(&mut ws).await));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_while_the_engine_runs_is_answered_after_the_inference() {
    let srv = start(
        "",
        Behaviour {
            compute: Duration::from_millis(150),
            ..Default::default()
        },
    )
    .await;
    let mut ws = connect(&srv, VLLM).await;
    ws.send(Message::Binary(request(1.0, None).into()))
        .await
        .unwrap();
    ws.send(Message::Binary(request(0.0, Some("reset")).into()))
        .await
        .unwrap();
    assert!(
        is_actions(&recv(&mut ws).await),
        "the running inference is answered"
    );
    let reset = recv(&mut ws).await;
    assert_eq!(reset.to_string(), "{\"status\": \"reset successful\"}");
    // Streaming: a reset drops the session's waiting observation, never the socket.
    for t in 0..3i64 {
        let mut buf = Vec::new();
        let mut e = Encoder { buf: &mut buf };
        e.map(4);
        e.str("state");
        e.ndarray(ElemType::F64, &[8], 64, |d| d.fill(0));
        e.str("endpoint");
        e.str("observe");
        e.str("timestep");
        e.int(t);
        e.str("timestamp");
        e.f64(t as f64 * 0.1);
        ws.send(Message::Binary(buf.into())).await.unwrap();
    }
    ws.send(Message::Binary(request(0.0, Some("reset")).into()))
        .await
        .unwrap();
    let mut saw_reset = false;
    while !saw_reset {
        let v = recv(&mut ws).await;
        saw_reset = v.to_string().contains("reset successful");
    }
    all_slots_back(&srv).await;
    ws.send(Message::Binary(request(3.0, None).into()))
        .await
        .unwrap();
    assert!(is_actions(&recv(&mut ws).await));
}

fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let l = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    l.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_times_max_connections_at_once_get_503_beyond_the_limit() {
    let srv = start(
        "max_connections = 4\nmax_connections_per_peer = 4",
        Behaviour::default(),
    )
    .await;
    let before = rss_kib();
    let mut tasks = Vec::new();
    for _ in 0..40 {
        let addr = srv.addr;
        tasks.push(tokio::spawn(async move {
            let mut tcp = TcpStream::connect(addr).await.unwrap();
            tcp.write_all(common::UPGRADE).await.unwrap();
            let mut head = [0u8; 12];
            tcp.read_exact(&mut head).await.unwrap();
            (String::from_utf8_lossy(&head).into_owned(), tcp)
        }));
    }
    let mut ok = 0;
    let mut busy = 0;
    let mut open = Vec::new();
    for t in tasks {
        let (status, tcp) = t.await.unwrap();
        match &status[9..12] {
            "101" => ok += 1,
            "503" => busy += 1,
            other => panic!("unexpected status {other}"),
        }
        open.push(tcp);
    }
    assert_eq!((ok, busy), (4, 36));
    let grown = rss_kib().saturating_sub(before);
    assert!(grown < 32 * 1024, "RSS grew {grown} KiB for 40 handshakes");
    drop(open);
    // The limit frees up again.
    let deadline = Instant::now() + Duration::from_secs(5);
    while tokio_tungstenite::connect_async(format!("ws://{}/", srv.addr))
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "connections never freed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_loris_heads_are_closed_at_the_handshake_timeout() {
    let srv = start("handshake_timeout_s = 0.3", Behaviour::default()).await;
    let mut lorises = Vec::new();
    for _ in 0..20 {
        let mut tcp = TcpStream::connect(srv.addr).await.unwrap();
        tcp.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        lorises.push(tcp);
    }
    let t0 = Instant::now();
    for mut tcp in lorises {
        let mut buf = [0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(5), tcp.read(&mut buf))
            .await
            .expect("closed by the server")
            .unwrap_or(0);
        assert_eq!(n, 0, "closed without an answer");
    }
    assert!(t0.elapsed() < Duration::from_secs(3));
    // Meanwhile and after, real clients are served.
    let mut ws = connect(&srv, VLLM).await;
    ws.send(Message::Binary(request(1.0, None).into()))
        .await
        .unwrap();
    assert!(is_actions(&recv(&mut ws).await));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_sent_frames_are_closed_at_the_frame_timeout_while_others_are_served() {
    let srv = start(
        "frame_timeout_s = 0.3\nmax_connections = 16\nmax_connections_per_peer = 16",
        Behaviour::default(),
    )
    .await;
    // A masked binary frame header announcing 4000 bytes, and only 1000 of them.
    let mut half = vec![0x82, 0x80 | 126, 0x0f, 0xa0, 1, 2, 3, 4];
    half.extend(std::iter::repeat_n(0x55u8, 1000));
    let mut stalled = Vec::new();
    for _ in 0..10 {
        let mut tcp = TcpStream::connect(srv.addr).await.unwrap();
        tcp.write_all(common::UPGRADE).await.unwrap();
        tcp.write_all(&half).await.unwrap();
        stalled.push(tcp);
    }
    // A real client keeps being served while they hang.
    let mut ws = connect(&srv, VLLM).await;
    let t0 = Instant::now();
    for i in 0..5 {
        ws.send(Message::Binary(request(f64::from(i), None).into()))
            .await
            .unwrap();
        assert!(is_actions(&recv(&mut ws).await));
    }
    for mut tcp in stalled {
        // The 101 and the metadata frame, then the end of the stream.
        let mut all = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut all))
            .await
            .expect("closed by the server")
            .ok();
        assert!(all.starts_with(b"HTTP/1.1 101"), "upgraded first");
    }
    let took = t0.elapsed();
    assert!(
        took < Duration::from_secs(3),
        "closed at the timeout, not later: {took:?}"
    );
    // Their connection permits are back: 15 more connections fit under max_connections = 16.
    let mut more = Vec::new();
    for _ in 0..15 {
        more.push(connect(&srv, "/").await);
    }
    ws.send(Message::Binary(request(9.0, None).into()))
        .await
        .unwrap();
    assert!(is_actions(&recv(&mut ws).await));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_one_byte_over_the_limit_is_refused_and_the_socket_kept() {
    let srv = start("max_message_bytes = 1024", Behaviour::default()).await;
    let mut ws = connect(&srv, VLLM).await;
    ws.send(Message::Binary(vec![0x90u8; 1025].into()))
        .await
        .unwrap();
    let err = recv(&mut ws).await;
    assert!(is_error_map(&err), "{err}");
    assert!(err.to_string().contains("1024"), "{err}");
    // Exactly at the limit it is read (and is not a valid request).
    let mut at_limit = vec![0x90u8; 1024];
    at_limit[0] = 0xc1;
    ws.send(Message::Binary(at_limit.into())).await.unwrap();
    assert!(is_error_map(&recv(&mut ws).await));
    ws.send(Message::Binary(request(1.0, None).into()))
        .await
        .unwrap();
    assert!(is_actions(&recv(&mut ws).await));
}

/// `POLICYD_RANDOM_FRAMES` random frames (100,000 by default) over 4 connections, pipelined in
/// batches of 64: every one is answered with an error map (or, by chance, actions), in order;
/// then each connection still serves a real request and every slot is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_thousand_random_frames_each_get_an_error_and_serving_goes_on() {
    let total: u64 = std::env::var("POLICYD_RANDOM_FRAMES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let srv = start("", Behaviour::default()).await;
    let t0 = Instant::now();
    let mut clients = Vec::new();
    for c in 0..4u64 {
        let mut ws = connect(&srv, VLLM).await;
        clients.push(tokio::spawn(async move {
            // xorshift64: deterministic, no dependency; a different stream per connection.
            let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (c + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
            let mut next = move || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            let n = total / 4;
            let mut sent = 0u64;
            while sent < n {
                let batch = (n - sent).min(64);
                for i in 0..batch {
                    let len = (next() % 300) as usize + 1;
                    let mut frame: Vec<u8> = (0..len).map(|_| next() as u8).collect();
                    if (sent + i).is_multiple_of(3) {
                        // A map header now and then, so the decoder goes past the first byte.
                        frame[0] = 0x80 | (next() % 16) as u8;
                    }
                    ws.feed(Message::Binary(Bytes::from(frame))).await.unwrap();
                }
                ws.flush().await.unwrap();
                for i in 0..batch {
                    let v = recv(&mut ws).await;
                    assert!(
                        is_error_map(&v) || is_actions(&v),
                        "connection {c}, frame {}: {v}",
                        sent + i
                    );
                }
                sent += batch;
                assert!(t0.elapsed() < Duration::from_secs(300), "bounded in time");
            }
            ws.send(Message::Binary(request(5.0, None).into()))
                .await
                .unwrap();
            assert!(is_actions(&recv(&mut ws).await));
            n
        }));
    }
    let mut answered = 0;
    for c in clients {
        answered += c.await.expect("a client task failed");
    }
    assert_eq!(answered, total / 4 * 4);
    all_slots_back(&srv).await;
}

async fn http_status(srv: &Running, path: &str) -> String {
    common::http_get(srv.addr, path, "").await[9..12].to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_engine_times_requests_out_and_recovers() {
    // Run 2 (the first served) hangs for 1.5 s; the timeout is 200 ms.
    let srv = start_with(
        "",
        "timeout_ms = 200",
        Behaviour {
            stall_on_run: 2,
            stall: Duration::from_millis(1500),
            ..Default::default()
        },
    )
    .await;
    let mut ws = connect(&srv, VLLM).await;
    let t0 = Instant::now();
    ws.send(Message::Binary(request(1.0, None).into()))
        .await
        .unwrap();
    let err = recv(&mut ws).await;
    assert!(
        is_error_map(&err) && err.to_string().contains("engine.timeout_ms"),
        "{err}"
    );
    assert!(
        t0.elapsed() < Duration::from_millis(1000),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(http_status(&srv, "/healthz").await, "503");
    // While it is stalled, a new request is refused at once, and the socket stays.
    ws.send(Message::Binary(request(2.0, None).into()))
        .await
        .unwrap();
    assert!(is_error_map(&recv(&mut ws).await));
    // The run finishes: healthy again, the stale result is dropped, and serving goes on.
    let deadline = Instant::now() + Duration::from_secs(10);
    while http_status(&srv, "/healthz").await != "200" {
        assert!(Instant::now() < deadline, "never recovered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    ws.send(Message::Binary(request(3.0, None).into()))
        .await
        .unwrap();
    let v = recv(&mut ws).await;
    assert!(is_actions(&v), "{v}");
    let data = v
        .as_map()
        .and_then(|m| m.iter().find(|(k, _)| k.as_slice() == Some(b"data")))
        .and_then(|(_, d)| d.as_slice())
        .expect("ndarray data");
    let first = f32::from_le_bytes(data[..4].try_into().unwrap());
    assert_eq!(first, 3.0, "the new request's result, not the stale one");
    all_slots_back(&srv).await;
}

/// One soak client's latencies, in fixed memory (allocated before the run): the first and
/// the last window, and the whole run.
struct SoakLatencies {
    first: hdrhistogram::Histogram<u64>,
    last: hdrhistogram::Histogram<u64>,
    all: hdrhistogram::Histogram<u64>,
}

impl SoakLatencies {
    fn new() -> Self {
        let h = || hdrhistogram::Histogram::new_with_bounds(1, 60_000_000, 3).unwrap();
        Self {
            first: h(),
            last: h(),
            all: h(),
        }
    }

    fn add(&mut self, other: &Self) {
        self.first.add(&other.first).unwrap();
        self.last.add(&other.last).unwrap();
        self.all.add(&other.all).unwrap();
    }
}

fn p99_ms(h: &hdrhistogram::Histogram<u64>) -> f64 {
    h.value_at_quantile(0.99) as f64 / 1000.0
}

/// A bounded soak: 4 clients (both dialects) at a 50 Hz control-loop rate for
/// `POLICYD_SOAK_SECS` (20 s by default; CI runs 300 s, and longer is a real soak). Zero
/// errors, every request answered, RSS flat after warm-up (sampled every second), and the p99
/// of the last minute no worse than three times the first minute's plus 20 ms (thirds of a run
/// shorter than 3 minutes): loose enough for a noisy machine, tight enough to catch latency
/// that grows with time (a queue or a leak). Latencies go into histograms allocated before the
/// run, so the test's own memory stays flat too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_four_clients_at_50_hz() {
    let secs: u64 = std::env::var("POLICYD_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let srv = start(
        "max_connections = 4\nmax_connections_per_peer = 4",
        Behaviour {
            compute: Duration::from_millis(2),
            ..Default::default()
        },
    )
    .await;
    let run = Duration::from_secs(secs);
    let window = (run / 3).min(Duration::from_secs(60));
    let mut clients = Vec::new();
    for c in 0..4 {
        let mut ws = connect(&srv, if c % 2 == 0 { "/" } else { VLLM }).await;
        let mut lat = SoakLatencies::new();
        clients.push(tokio::spawn(async move {
            let t0 = Instant::now();
            let mut tick = tokio::time::interval(Duration::from_millis(20));
            let mut i = 0u64;
            while t0.elapsed() < run {
                tick.tick().await;
                let sent = Instant::now();
                ws.send(Message::Binary(request(i as f64, None).into()))
                    .await
                    .unwrap();
                let v = recv(&mut ws).await;
                assert!(!is_error_map(&v), "client {c} request {i}: {v}");
                let us = sent.elapsed().as_micros() as u64;
                let at = sent - t0;
                lat.all.saturating_record(us);
                if at < window {
                    lat.first.saturating_record(us);
                } else if at >= run - window {
                    lat.last.saturating_record(us);
                }
                i += 1;
            }
            lat
        }));
    }
    // RSS after warm-up (the first window), then its peak over the rest of the run.
    tokio::time::sleep(window).await;
    let rss_warm = rss_kib();
    let mut rss_peak = rss_warm;
    while clients.iter().any(|c| !c.is_finished()) {
        tokio::time::sleep(Duration::from_secs(1)).await;
        rss_peak = rss_peak.max(rss_kib());
    }
    let mut lat = SoakLatencies::new();
    for c in clients {
        lat.add(&c.await.unwrap());
    }
    let (first, last) = (p99_ms(&lat.first), p99_ms(&lat.last));
    eprintln!(
        "soak: {secs} s, {} requests, p50 {:.2} ms, p99 {:.2} ms; p99 of the first {} s {first:.2} ms, of the last {last:.2} ms; RSS {rss_warm} KiB after warm-up, peak {rss_peak} KiB",
        lat.all.len(),
        lat.all.value_at_quantile(0.5) as f64 / 1000.0,
        p99_ms(&lat.all),
        window.as_secs(),
    );
    let grown = rss_peak - rss_warm;
    assert!(grown < 1024, "RSS grew {grown} KiB after warm-up");
    assert!(
        last <= first * 3.0 + 20.0,
        "p99 drifted: first window {first:.2} ms, last window {last:.2} ms"
    );
    let expected = 4 * secs * 50;
    assert!(
        lat.all.len() >= expected * 9 / 10,
        "{} of {expected} requests answered",
        lat.all.len()
    );
    all_slots_back(&srv).await;
}
