//! The server through its public interface: a real listener on loopback, real WebSocket
//! clients. Covers what the Python interop tests cannot steer: the connection limit, graceful
//! shutdown, keepalive and idle timeouts.

use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use policyd::config::Config;
use policyd::demo;
use policyd::dtype::ElemType;
use policyd::protocol::Encoder;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::{Bytes, Error as WsError, Message};

/// A server on an ephemeral port, stopped by `stop`.
struct Running {
    addr: std::net::SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    done: tokio::task::JoinHandle<()>,
}

impl Running {
    fn url(&self, path: &str) -> String {
        format!("ws://{}{path}", self.addr)
    }

    /// Triggers graceful shutdown (what SIGTERM does in the binary).
    fn stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

async fn start(tune: impl FnOnce(&mut Config)) -> Running {
    let mut cfg = demo::config().expect("embedded config");
    cfg.server.host = "127.0.0.1".into();
    cfg.server.port = 0;
    cfg.policies[0].engine.warmup_runs = 1;
    tune(&mut cfg);
    let loaded =
        tokio::task::block_in_place(|| policyd::policy::build::load(&cfg, cfg.default_policy()))
            .expect("engine loads");
    let listener = policyd::net::server::bind(&cfg).await.expect("bind");
    let addr = listener.local_addr().expect("local addr");
    let (tx, rx) = oneshot::channel::<()>();
    let done = tokio::spawn(async move {
        policyd::net::server::serve(cfg, loaded, listener, async {
            let _ = rx.await;
        })
        .await
        .expect("serve");
    });
    Running {
        addr,
        stop: Some(tx),
        done,
    }
}

/// An ALOHA observation (only `cam_high`, as openpi's ALOHA sim sends), openpi-encoded.
fn observation() -> Vec<u8> {
    let mut buf = Vec::new();
    let mut e = Encoder { buf: &mut buf };
    e.map(3);
    e.str("state");
    e.ndarray(ElemType::F64, &[14], 14 * 8, |d| {
        for (i, c) in d.chunks_exact_mut(8).enumerate() {
            c.copy_from_slice(&(i as f64 * 0.1).to_le_bytes());
        }
    });
    e.str("images");
    e.map(1);
    e.str("cam_high");
    e.ndarray(ElemType::U8, &[3, 224, 224], 3 * 224 * 224, |d| {
        for (i, b) in d.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
    });
    e.str("prompt");
    e.str("fold the towel");
    buf
}

type Ws = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<TcpStream>>;

async fn connect(url: &str) -> Ws {
    let (mut ws, _) = tokio_tungstenite::connect_async(url)
        .await
        .expect("connects");
    match ws.next().await {
        Some(Ok(Message::Binary(_))) => {}
        other => panic!("expected the metadata frame, got {other:?}"),
    }
    ws
}

/// Reads until a close frame; returns its code and reason.
async fn closed_with(ws: &mut Ws) -> (CloseCode, String) {
    loop {
        match tokio::time::timeout(Duration::from_secs(10), ws.next()).await {
            Ok(Some(Ok(Message::Close(Some(f))))) => return (f.code, f.reason.to_string()),
            Ok(Some(Ok(_))) => continue,
            other => panic!("expected a close frame, got {other:?}"),
        }
    }
}

fn is_actions_reply(m: &Message) -> bool {
    // `{"actions": {...}}`: fixmap header, then the str key.
    matches!(m, Message::Binary(b) if b.len() > 1000 && b[1..9] == *b"\xa7actions")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_over_the_connection_limit_gets_503_and_the_others_keep_working() {
    let mut srv = start(|c| c.server.max_connections = 2).await;
    let mut a = connect(&srv.url("/")).await;
    let _b = connect(&srv.url("/")).await;
    match tokio_tungstenite::connect_async(srv.url("/")).await {
        Err(WsError::Http(resp)) => {
            assert_eq!(resp.status(), 503);
            let body = String::from_utf8_lossy(resp.body().as_deref().unwrap_or_default());
            assert!(body.contains("maximum of 2 connections"), "{body}");
        }
        other => panic!("expected HTTP 503, got {:?}", other.map(|_| ())),
    }
    a.send(Message::Binary(observation().into())).await.unwrap();
    let reply = a.next().await.unwrap().unwrap();
    assert!(is_actions_reply(&reply), "{reply:?}");
    // A freed permit admits the next client.
    drop(a);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match tokio_tungstenite::connect_async(srv.url("/")).await {
            Ok(_) => break,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(e) => panic!("the freed slot was not reused: {e}"),
        }
    }
    srv.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_the_request_in_flight_then_closes_with_1001() {
    let mut srv = start(|_| {}).await;
    let mut ws = connect(&srv.url("/")).await;
    let mut idle = connect(&srv.url("/v1/realtime/robot/openpi")).await;
    // Two requests back to back: while the first runs, the server reads the second into its
    // one-frame buffer; shutdown starts once the first is answered, and the second, already
    // received, is still answered.
    ws.send(Message::Binary(observation().into()))
        .await
        .unwrap();
    ws.send(Message::Binary(observation().into()))
        .await
        .unwrap();
    assert!(is_actions_reply(&ws.next().await.unwrap().unwrap()));
    srv.stop();
    let reply = tokio::time::timeout(Duration::from_secs(10), ws.next())
        .await
        .expect("a reply before the close")
        .unwrap()
        .unwrap();
    assert!(is_actions_reply(&reply), "{reply:?}");
    assert_eq!(closed_with(&mut ws).await.0, CloseCode::Away);
    assert_eq!(closed_with(&mut idle).await.0, CloseCode::Away);
    tokio::time::timeout(Duration::from_secs(15), &mut srv.done)
        .await
        .expect("serve returns after draining")
        .unwrap();
    assert!(
        TcpStream::connect(srv.addr).await.is_err(),
        "the listener is closed after shutdown"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_answers_pings_is_closed() {
    let mut srv = start(|c| {
        c.server.ping_interval_s = 0.2;
        c.server.ping_timeout_s = 0.3;
    })
    .await;
    // A raw socket: do the handshake, then read without ever answering a ping.
    let mut tcp = TcpStream::connect(srv.addr).await.unwrap();
    tcp.write_all(
        b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
          Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
    )
    .await
    .unwrap();
    let started = Instant::now();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(10), tcp.read(&mut buf))
            .await
            .expect("the server closes a silent client")
            .unwrap();
        if n == 0 {
            break;
        }
        seen.extend_from_slice(&buf[..n]);
        if seen.windows(2).any(|w| w == [0x88, 24]) && seen.ends_with(b"keepalive ping timeout") {
            break;
        }
    }
    let elapsed = started.elapsed();
    assert!(
        seen.windows(2).any(|w| w == [0x89, 0x00]),
        "a ping was sent"
    );
    let close = seen
        .windows(4)
        .position(|w| w[0] == 0x88 && w[2..4] == 1011u16.to_be_bytes())
        .expect("a close frame with code 1011");
    assert!(
        String::from_utf8_lossy(&seen[close..]).contains("keepalive ping timeout"),
        "{seen:?}"
    );
    assert!(elapsed >= Duration::from_millis(400), "{elapsed:?}");
    // A client that answers pings stays.
    let mut ok = connect(&srv.url("/")).await;
    let until = tokio::time::Instant::now() + Duration::from_millis(1500);
    let mut pings = 0;
    while let Ok(m) = tokio::time::timeout_at(until, ok.next()).await {
        match m {
            Some(Ok(Message::Ping(_))) => pings += 1,
            other => panic!("a responsive client was disconnected: {other:?}"),
        }
    }
    assert!(pings >= 3, "pings every 0.2 s, saw {pings}");
    srv.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_timeout_closes_quiet_connections_only_when_enabled() {
    let mut srv = start(|c| c.server.idle_timeout_s = 0.5).await;
    let mut ws = connect(&srv.url("/")).await;
    ws.send(Message::Binary(observation().into()))
        .await
        .unwrap();
    assert!(is_actions_reply(&ws.next().await.unwrap().unwrap()));
    let after_reply = Instant::now();
    let (code, reason) = closed_with(&mut ws).await;
    assert_eq!((code, reason.as_str()), (CloseCode::Normal, "idle timeout"));
    assert!(after_reply.elapsed() >= Duration::from_millis(450));
    srv.stop();

    // The default (an hour) is far past this: a quiet client stays connected.
    let mut srv = start(|_| {}).await;
    let mut ws = connect(&srv.url("/")).await;
    let quiet = tokio::time::timeout(Duration::from_millis(1500), ws.next()).await;
    assert!(quiet.is_err(), "closed without an idle timeout: {quiet:?}");
    ws.send(Message::Ping(Bytes::from_static(b"x")))
        .await
        .unwrap();
    srv.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_answers_once_warm() {
    let mut srv = start(|_| {}).await;
    let mut tcp = TcpStream::connect(srv.addr).await.unwrap();
    tcp.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut resp = String::new();
    tcp.read_to_string(&mut resp).await.unwrap();
    assert!(resp.starts_with("HTTP/1.1 200 OK\r\n"), "{resp}");
    assert!(resp.ends_with("\r\n\r\nOK\n"), "{resp}");
    srv.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_the_engine_loads_every_request_gets_503() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (done_tx, done_rx) = oneshot::channel::<u32>();
    let probe = tokio::spawn(async move {
        let mut answers = Vec::new();
        for req in [
            "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
             Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
        ] {
            let mut tcp = TcpStream::connect(addr).await.unwrap();
            tcp.write_all(req.as_bytes()).await.unwrap();
            let mut resp = String::new();
            tcp.read_to_string(&mut resp).await.unwrap();
            answers.push(resp);
        }
        let _ = done_tx.send(7);
        answers
    });
    // "Loading" finishes when the probe has its answers.
    let out = policyd::net::http::while_loading(&listener, Duration::from_secs(5), None, async {
        done_rx.await.unwrap()
    })
    .await;
    assert_eq!(out, 7);
    for resp in probe.await.unwrap() {
        assert!(resp.starts_with("HTTP/1.1 503 "), "{resp}");
        assert!(resp.contains("loading"), "{resp}");
    }
}

use crate::common;
use common::http_get;

/// The value of one sample line (`name{labels} value`) in an exposition.
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no sample {series} in:\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_move_with_requests_errors_and_connections() {
    let mut srv = start(|_| {}).await;
    let before = http_get(srv.addr, "/metrics", "").await;
    assert!(before.starts_with("HTTP/1.1 200 OK\r\n"), "{before}");
    assert!(before.contains("application/openmetrics-text"), "{before}");
    assert_eq!(sample(&before, "policyd_connections"), 0.0);
    assert_eq!(
        sample(
            &before,
            "policyd_requests_total{route=\"openpi\",endpoint=\"infer\"}"
        ),
        0.0
    );

    let mut a = connect(&srv.url("/")).await;
    for _ in 0..3 {
        a.send(Message::Binary(observation().into())).await.unwrap();
        assert!(is_actions_reply(&a.next().await.unwrap().unwrap()));
    }
    let mut v = connect(&srv.url(policyd::protocol::VLLM_PATH)).await;
    v.send(Message::Binary(Bytes::from_static(b"\xc1 not msgpack")))
        .await
        .unwrap();
    let _error_map = v.next().await.unwrap().unwrap();

    let after = http_get(srv.addr, "/metrics", "").await;
    assert_eq!(sample(&after, "policyd_connections"), 2.0);
    assert_eq!(
        sample(
            &after,
            "policyd_requests_total{route=\"openpi\",endpoint=\"infer\"}"
        ),
        3.0
    );
    assert_eq!(
        sample(
            &after,
            "policyd_request_errors_total{route=\"vllm\",kind=\"request\"}"
        ),
        1.0
    );
    assert_eq!(
        sample(
            &after,
            "policyd_request_duration_seconds_count{route=\"openpi\"}"
        ),
        3.0
    );
    assert_eq!(sample(&after, "policyd_engine_duration_seconds_count"), 3.0);
    assert_eq!(sample(&after, "policyd_sessions"), 1.0);
    assert_eq!(sample(&after, "policyd_healthy"), 1.0);
    assert!(
        sample(&after, "policyd_engine_runs_total") >= 4.0,
        "warm-up + 3"
    );
    assert!(sample(&after, "policyd_resident_memory_bytes") > 0.0);
    assert!(after.contains("policyd_build_info{version=\""), "{after}");
    drop(a);
    drop(v);
    srv.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_gate_websockets_and_metrics_but_not_health() {
    const KEY: &str = "robot-key-0123456789abcdef";
    let mut srv = start(|c| {
        c.auth.api_keys = vec![KEY.to_string()];
    })
    .await;
    let auth = format!("Authorization: Api-Key {KEY}\r\n");
    assert!(
        http_get(srv.addr, "/healthz", "")
            .await
            .starts_with("HTTP/1.1 200")
    );
    let denied = http_get(srv.addr, "/metrics", "").await;
    assert!(
        denied.starts_with("HTTP/1.1 401 Unauthorized\r\n"),
        "{denied}"
    );
    assert!(!denied.contains(KEY));
    let metrics = http_get(srv.addr, "/metrics", &auth).await;
    assert!(metrics.starts_with("HTTP/1.1 200 OK"), "{metrics}");

    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    for header in [
        None,
        Some("Api-Key wrong-key-0123456789abcdef"),
        Some("Api-Key "),
    ] {
        let mut req = srv.url("/").into_client_request().unwrap();
        if let Some(h) = header {
            req.headers_mut()
                .insert("Authorization", h.parse().unwrap());
        }
        match tokio_tungstenite::connect_async(req).await {
            Err(WsError::Http(resp)) => assert_eq!(resp.status(), 401, "{header:?}"),
            other => panic!("{header:?}: expected 401, got {:?}", other.map(|_| ())),
        }
    }
    let mut req = srv.url("/").into_client_request().unwrap();
    req.headers_mut()
        .insert("Authorization", format!("Api-Key {KEY}").parse().unwrap());
    let (mut ws, _) = tokio_tungstenite::connect_async(req)
        .await
        .expect("the key opens it");
    let _metadata = ws.next().await.unwrap().unwrap();
    ws.send(Message::Binary(observation().into()))
        .await
        .unwrap();
    assert!(is_actions_reply(&ws.next().await.unwrap().unwrap()));
    let after = http_get(srv.addr, "/metrics", &auth).await;
    assert_eq!(sample(&after, "policyd_auth_failures_total"), 4.0);
    srv.stop();
}
