//! What a hostile or broken client finds at the door and on the wire (issue 21), through the
//! real listener with a synthetic engine (every action element is `state[0] + k / 1000`):
//! opening handshakes that are not RFC 6455 handshakes, two `Authorization` headers, protocol
//! violations after the upgrade (each answered with a Close frame), handshakes abandoned
//! halfway, and non-finite numbers in inputs or in the actions as they would be sent.
//! Loopback only; every loop is bounded in count and time.

use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use policyd::config::Config;
use policyd::dtype::ElemType;
use policyd::protocol::Encoder;
use policyd::testing::synthetic::Behaviour;
use rmpv::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

use crate::common;
use common::{Running, Ws};

const VLLM: &str = "/v1/realtime/robot/openpi";
const KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";

async fn start(tune: impl FnOnce(&mut Config)) -> Running {
    start_with("", tune).await
}

async fn start_with(server: &str, tune: impl FnOnce(&mut Config)) -> Running {
    let mut cfg = common::synthetic_config(server, "slots = 2", "");
    tune(&mut cfg);
    common::start(cfg, Behaviour::default()).await
}

/// `{"state": <f8[8]> = [x0, 0, …]}`.
fn request(x0: f64) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut e = Encoder { buf: &mut buf };
    e.map(1);
    e.str("state");
    e.ndarray(ElemType::F64, &[8], 64, |d| {
        d[..8].copy_from_slice(&x0.to_le_bytes());
        d[8..].fill(0);
    });
    buf
}

/// Sends `head` on a new connection and returns the status line of the answer.
async fn status_of(srv: &Running, head: &str) -> String {
    let mut tcp = TcpStream::connect(srv.addr).await.unwrap();
    tcp.write_all(head.as_bytes()).await.unwrap();
    let mut resp = Vec::new();
    let mut buf = [0u8; 1024];
    let read = async {
        loop {
            match tcp.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => resp.extend_from_slice(&buf[..n]),
            }
            if resp.windows(4).any(|w| w == b"\r\n\r\n") {
                break;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .expect("answered");
    let text = String::from_utf8_lossy(&resp).into_owned();
    text.lines().next().unwrap_or_default().to_string()
}

fn handshake(method: &str, version: &str, headers: &str) -> String {
    format!("{method} / {version}\r\nHost: x\r\nUpgrade: websocket\r\n{headers}\r\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshakes_that_break_rfc_6455_get_400_not_101() {
    let srv = start(|_| {}).await;
    let ok =
        format!("Connection: Upgrade\r\nSec-WebSocket-Key: {KEY}\r\nSec-WebSocket-Version: 13\r\n");
    let cases = [
        ("valid", handshake("GET", "HTTP/1.1", &ok), "101"),
        (
            "Connection as a token list",
            handshake(
                "GET",
                "HTTP/1.1",
                &ok.replace("Connection: Upgrade", "Connection: keep-alive, upgrade"),
            ),
            "101",
        ),
        (
            "short key",
            handshake("GET", "HTTP/1.1", &ok.replace(KEY, "c2hvcnQ=")),
            "400",
        ),
        (
            "key not base64",
            handshake(
                "GET",
                "HTTP/1.1",
                &ok.replace(KEY, "!!!!!!!!!!!!!!!!!!!!!!=="),
            ),
            "400",
        ),
        (
            "key of 17 bytes' length without padding",
            handshake(
                "GET",
                "HTTP/1.1",
                &ok.replace(KEY, "dGhlIHNhbXBsZSBub25jZQxx"),
            ),
            "400",
        ),
        (
            "two keys",
            handshake(
                "GET",
                "HTTP/1.1",
                &format!("{ok}Sec-WebSocket-Key: {KEY}\r\n"),
            ),
            "400",
        ),
        (
            "no key",
            handshake(
                "GET",
                "HTTP/1.1",
                &ok.replace(&format!("Sec-WebSocket-Key: {KEY}\r\n"), ""),
            ),
            "400",
        ),
        ("POST", handshake("POST", "HTTP/1.1", &ok), "400"),
        (
            "a body",
            handshake("GET", "HTTP/1.1", &format!("{ok}Content-Length: 5\r\n")) + "hello",
            "400",
        ),
        (
            "a chunked body",
            handshake(
                "GET",
                "HTTP/1.1",
                &format!("{ok}Transfer-Encoding: chunked\r\n"),
            ) + "0\r\n\r\n",
            "400",
        ),
        (
            "Content-Length: 0",
            handshake("GET", "HTTP/1.1", &format!("{ok}Content-Length: 0\r\n")),
            "101",
        ),
        ("HTTP/1.0", handshake("GET", "HTTP/1.0", &ok), "400"),
        (
            "no Connection: Upgrade",
            handshake(
                "GET",
                "HTTP/1.1",
                &ok.replace("Connection: Upgrade\r\n", ""),
            ),
            "400",
        ),
        (
            "Connection without the upgrade token",
            handshake(
                "GET",
                "HTTP/1.1",
                &ok.replace("Connection: Upgrade", "Connection: keep-alive"),
            ),
            "400",
        ),
        (
            "version 8",
            handshake("GET", "HTTP/1.1", &ok.replace("Version: 13", "Version: 8")),
            "426",
        ),
    ];
    for (what, head, want) in cases {
        let status = status_of(&srv, &head).await;
        assert_eq!(status.get(9..12), Some(want), "{what}: {status}");
    }
    // And it still serves.
    let mut ws = common::connect(srv.addr, VLLM).await;
    ws.send(Message::Binary(request(1.0).into())).await.unwrap();
    assert!(matches!(ws.next().await, Some(Ok(Message::Binary(_)))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_authorization_headers_are_refused_even_when_both_hold_the_key() {
    const API_KEY: &str = "robot-key-0123456789abcdef";
    let srv = start(|c| c.auth.api_keys = vec![API_KEY.to_string()]).await;
    let base =
        format!("Connection: Upgrade\r\nSec-WebSocket-Key: {KEY}\r\nSec-WebSocket-Version: 13\r\n");
    let one = format!("Authorization: Api-Key {API_KEY}\r\n");
    let status = status_of(&srv, &handshake("GET", "HTTP/1.1", &format!("{base}{one}"))).await;
    assert!(status.contains("101"), "{status}");
    for second in [
        one.clone(),
        "Authorization: Api-Key wrong-key-0123456789\r\n".to_string(),
    ] {
        let head = handshake("GET", "HTTP/1.1", &format!("{base}{one}{second}"));
        let status = status_of(&srv, &head).await;
        assert!(status.contains("401"), "{second:?}: {status}");
    }
    // /metrics (protected by default when keys are set) likewise.
    let metrics = common::http_get(srv.addr, "/metrics", &format!("{one}{one}")).await;
    assert!(metrics.starts_with("HTTP/1.1 401"), "{metrics}");
    let metrics = common::http_get(srv.addr, "/metrics", &one).await;
    assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
}

/// A client frame: `b0` (FIN, RSV and opcode bits), masked unless `unmasked`.
fn frame(b0: u8, payload: &[u8], masked: bool) -> Vec<u8> {
    let mut f = vec![b0];
    let mask_bit = if masked { 0x80 } else { 0 };
    match payload.len() {
        n if n < 126 => f.push(mask_bit | n as u8),
        n => {
            f.push(mask_bit | 126);
            f.extend_from_slice(&(n as u16).to_be_bytes());
        }
    }
    let mask = [0x11, 0x22, 0x33, 0x44];
    if masked {
        f.extend_from_slice(&mask);
        f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    } else {
        f.extend_from_slice(payload);
    }
    f
}

/// Reads server frames (unmasked) until a Close frame; its code, or `None` if the socket
/// closed without one.
async fn close_code(tcp: &mut TcpStream) -> Option<u16> {
    let read = async {
        loop {
            let mut h = [0u8; 2];
            tcp.read_exact(&mut h).await.ok()?;
            let len = match h[1] & 0x7f {
                126 => {
                    let mut b = [0u8; 2];
                    tcp.read_exact(&mut b).await.ok()?;
                    u64::from(u16::from_be_bytes(b))
                }
                127 => {
                    let mut b = [0u8; 8];
                    tcp.read_exact(&mut b).await.ok()?;
                    u64::from_be_bytes(b)
                }
                n => u64::from(n),
            };
            let mut payload = vec![0u8; len as usize];
            tcp.read_exact(&mut payload).await.ok()?;
            if h[0] & 0x0f == 0x8 {
                return payload.get(..2).map(|c| u16::from_be_bytes([c[0], c[1]]));
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .expect("the server answered within 5 s")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_violations_get_a_close_frame_before_the_socket_closes() {
    let srv = start(|_| {}).await;
    let protocol = u16::from(CloseCode::Protocol);
    let invalid = u16::from(CloseCode::Invalid);
    let cases: Vec<(&str, Vec<u8>, u16)> = vec![
        ("oversized ping", frame(0x89, &[7; 126], true), protocol),
        ("fragmented ping", frame(0x09, b"ping", true), protocol),
        (
            "unmasked frame",
            frame(0x82, &request(1.0), false),
            protocol,
        ),
        ("RSV1 bit", frame(0xc2, &request(1.0), true), protocol),
        ("RSV3 bit", frame(0x92, &request(1.0), true), protocol),
        ("reserved data opcode", frame(0x83, b"x", true), protocol),
        ("reserved control opcode", frame(0x8b, b"x", true), protocol),
        ("stray continuation", frame(0x80, b"x", true), protocol),
        ("1-byte close payload", frame(0x88, &[3], true), protocol),
        (
            "invalid UTF-8 text",
            frame(0x81, &[b'a', 0xff, 0xfe], true),
            invalid,
        ),
        // RFC 6455 §5.2: the 64-bit length's top bit clear, the fewest bytes for a length.
        (
            "64-bit length with its top bit set",
            [
                &[0x82, 0x80 | 127, 0x80, 0, 0, 0, 0, 0, 0, 5][..],
                &[1, 2, 3, 4],
                b"hello",
            ]
            .concat(),
            protocol,
        ),
        (
            "5 in a 16-bit length",
            [&[0x82, 0x80 | 126, 0, 5][..], &[1, 2, 3, 4], b"hello"].concat(),
            protocol,
        ),
        (
            "5 in a 64-bit length",
            [
                &[0x82, 0x80 | 127, 0, 0, 0, 0, 0, 0, 0, 5][..],
                &[1, 2, 3, 4],
                b"hello",
            ]
            .concat(),
            protocol,
        ),
    ];
    for path in ["/", VLLM] {
        for (what, bad, want) in &cases {
            let mut tcp = TcpStream::connect(srv.addr).await.unwrap();
            let head = handshake(
                "GET",
                "HTTP/1.1",
                &format!(
                    "Connection: Upgrade\r\nSec-WebSocket-Key: {KEY}\r\nSec-WebSocket-Version: 13\r\n"
                ),
            )
            .replacen("GET / ", &format!("GET {path} "), 1);
            tcp.write_all(head.as_bytes()).await.unwrap();
            // The 101 head, then the metadata frame.
            let mut b = [0u8; 1];
            let mut head_in = Vec::new();
            while !head_in.ends_with(b"\r\n\r\n") {
                tcp.read_exact(&mut b).await.unwrap();
                head_in.push(b[0]);
            }
            assert!(head_in.starts_with(b"HTTP/1.1 101"), "{what}");
            tcp.write_all(bad).await.unwrap();
            let got = close_code(&mut tcp).await;
            assert_eq!(got, Some(*want), "{path} {what}: close code");
        }
    }
    // Served as before.
    let mut ws = common::connect(srv.addr, VLLM).await;
    ws.send(Message::Binary(request(1.0).into())).await.unwrap();
    assert!(matches!(ws.next().await, Some(Ok(Message::Binary(_)))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshakes_abandoned_halfway_leave_nothing_held() {
    let srv = start_with(
        "max_connections = 4\nmax_connections_per_peer = 4\nhandshake_timeout_s = 0.5",
        |_| {},
    )
    .await;
    let full = handshake(
        "GET",
        "HTTP/1.1",
        &format!(
            "Connection: Upgrade\r\nSec-WebSocket-Key: {KEY}\r\nSec-WebSocket-Version: 13\r\n"
        ),
    );
    // Each way of leaving, several times over the connection limit: mid-head, a whole head
    // but gone before the 101 is read, and upgraded but gone before the metadata is read.
    for round in 0..3 {
        let mut open = Vec::new();
        for i in 0..12 {
            let mut tcp = TcpStream::connect(srv.addr).await.unwrap();
            let cut = match (round, i % 3) {
                (_, 0) => full.len() / 2,
                _ => full.len(),
            };
            tcp.write_all(&full.as_bytes()[..cut]).await.unwrap();
            if i % 3 == 2 {
                let mut b = [0u8; 12];
                let _ = tcp.read_exact(&mut b).await;
            }
            open.push(tcp);
        }
        drop(open);
    }
    // Every permit comes back: four clients at once are served.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut clients = Vec::new();
        for _ in 0..4 {
            match tokio_tungstenite::connect_async(format!("ws://{}{VLLM}", srv.addr)).await {
                Ok((ws, _)) => clients.push(ws),
                Err(_) => break,
            }
        }
        if clients.len() == 4 {
            for mut ws in clients {
                let _metadata = ws.next().await;
                ws.send(Message::Binary(request(2.0).into())).await.unwrap();
                assert!(matches!(ws.next().await, Some(Ok(Message::Binary(_)))));
            }
            break;
        }
        assert!(
            Instant::now() < deadline,
            "connection permits were not released"
        );
        drop(clients);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn recv(ws: &mut Ws) -> Message {
    loop {
        match tokio::time::timeout(Duration::from_secs(10), ws.next()).await {
            Ok(Some(Ok(Message::Ping(_)))) => continue,
            Ok(Some(Ok(m))) => return m,
            other => panic!("expected a message, got {other:?}"),
        }
    }
}

fn decode(m: &Message) -> Value {
    let Message::Binary(b) = m else {
        panic!("expected binary, got {m:?}")
    };
    rmpv::decode::read_value(&mut &b[..]).expect("msgpack")
}

fn field<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.as_map()?
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .and_then(|(_, v)| v.as_str())
}

async fn metric(srv: &Running, name: &str) -> f64 {
    let text = common::http_get(srv.addr, "/metrics", "").await;
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} not in /metrics:\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_finite_state_is_refused_in_both_dialects_and_counted() {
    let srv = start(|_| {}).await;
    // openpi: a text frame naming the key, then close 1011.
    for (i, bad) in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 1e308]
        .into_iter()
        .enumerate()
    {
        let mut ws = common::connect(srv.addr, "/").await;
        ws.send(Message::Binary(request(bad).into())).await.unwrap();
        match recv(&mut ws).await {
            Message::Text(t) => assert!(
                t.contains("'state'") && t.contains("allow_non_finite"),
                "{bad}: {t}"
            ),
            other => panic!("{bad}: expected the error text, got {other:?}"),
        }
        match recv(&mut ws).await {
            Message::Close(Some(c)) => assert_eq!(c.code, CloseCode::Error, "{bad}"),
            other => panic!("{bad}: expected close 1011, got {other:?}"),
        }
        assert_eq!(
            metric(&srv, "policyd_non_finite_inputs_total").await,
            (i + 1) as f64
        );
    }
    // vllm-omni: an error map, and the socket serves the next request.
    let mut ws = common::connect(srv.addr, VLLM).await;
    for bad in [f64::NAN, 1e300] {
        ws.send(Message::Binary(request(bad).into())).await.unwrap();
        let err = decode(&recv(&mut ws).await);
        assert_eq!(field(&err, "type"), Some("error"), "{err}");
        assert_eq!(field(&err, "message"), Some("Invalid request payload"));
        assert!(
            field(&err, "detail").is_some_and(|d| d.contains("'state'")),
            "{err}"
        );
    }
    ws.send(Message::Binary(request(0.5).into())).await.unwrap();
    assert!(decode(&recv(&mut ws).await).to_string().contains("[10, 7]"));
    assert_eq!(metric(&srv, "policyd_non_finite_inputs_total").await, 6.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_finite_state_is_served_where_the_binding_allows_it() {
    let srv = start(|c| {
        for p in &mut c.policies {
            p.inputs[0].norm.allow_non_finite = true;
        }
    })
    .await;
    let mut ws = common::connect(srv.addr, VLLM).await;
    ws.send(Message::Binary(request(0.25).into()))
        .await
        .unwrap();
    assert!(decode(&recv(&mut ws).await).to_string().contains("[10, 7]"));
    // The engine echoes NaN into every action: refused as an engine failure on the way out.
    ws.send(Message::Binary(request(f64::NAN).into()))
        .await
        .unwrap();
    let err = decode(&recv(&mut ws).await);
    assert_eq!(
        field(&err, "message"),
        Some("Internal inference error"),
        "{err}"
    );
    assert_eq!(metric(&srv, "policyd_non_finite_inputs_total").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actions_that_overflow_once_unnormalised_never_reach_the_wire() {
    // state[0] = 3e38 is finite in the engine's float32, and so is its echo in the actions;
    // times std 4 it is past float32's range: the float32 reply would carry inf.
    let srv = start(|c| {
        for p in &mut c.policies {
            p.outputs[0].mean = vec![0.0; common::D];
            p.outputs[0].std = vec![4.0; common::D];
        }
    })
    .await;
    for path in ["/", VLLM] {
        let mut ws = common::connect(srv.addr, path).await;
        ws.send(Message::Binary(request(1.0).into())).await.unwrap();
        let ok = recv(&mut ws).await;
        assert!(matches!(ok, Message::Binary(_)), "{path}: {ok:?}");
        ws.send(Message::Binary(request(3e38).into()))
            .await
            .unwrap();
        match recv(&mut ws).await {
            Message::Text(t) => {
                assert_eq!(path, "/");
                assert!(t.contains("NaN or infinity"), "{t}");
            }
            m => {
                let err = decode(&m);
                assert_eq!(path, VLLM, "{err}");
                assert_eq!(field(&err, "message"), Some("Internal inference error"));
                assert!(field(&err, "detail").is_some_and(|d| d.contains("as it would be sent")));
            }
        }
    }
}

/// A WebSocket connection to `path` from another loopback address (another host to the
/// server's per-address share); the handshake's response, or the connection with its
/// metadata frame read.
async fn connect_from(
    ip: &str,
    srv: &Running,
    path: &str,
) -> Result<Ws, tokio_tungstenite::tungstenite::Error> {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{ip}:0").parse().unwrap()).unwrap();
    let tcp = socket.connect(srv.addr).await.unwrap();
    let (mut ws, _) = tokio_tungstenite::client_async(
        format!("ws://{}{path}", srv.addr),
        tokio_tungstenite::MaybeTlsStream::Plain(tcp),
    )
    .await?;
    assert!(matches!(ws.next().await, Some(Ok(Message::Binary(_)))));
    Ok(ws)
}

/// Issue 49, item 3: eight idle upgraded connections from one host (answering the server's
/// pings) used to make every robot's upgrade a 503. One address now holds at most its share
/// (4 of 8 by default); its further upgrades are refused and counted, and the robot connects,
/// runs and reconnects while they are held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_from_one_host_leave_the_robot_a_slot() {
    let srv = start_with("ping_interval_s = 0.2", |_| {}).await;
    let mut held = Vec::new();
    let mut refused = 0;
    for _ in 0..8 {
        match connect_from("127.0.0.2", &srv, "/").await {
            Ok(ws) => held.push(ws),
            Err(tokio_tungstenite::tungstenite::Error::Http(r)) => {
                assert_eq!(r.status(), 503);
                let body = String::from_utf8_lossy(r.body().as_deref().unwrap_or_default());
                assert!(body.contains("from one address"), "{body}");
                refused += 1;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!((held.len(), refused), (4, 4));
    assert_eq!(
        metric(
            &srv,
            "policyd_connections_refused_total{reason=\"peer_share\"}"
        )
        .await,
        4.0
    );
    // The held connections answer pings (their reads), as a live client's would.
    let answering: Vec<_> = held
        .into_iter()
        .map(|mut ws| tokio::spawn(async move { while let Some(Ok(_)) = ws.next().await {} }))
        .collect();
    for round in 0..3 {
        let mut robot = common::connect(srv.addr, "/").await;
        robot
            .send(Message::Binary(request(f64::from(round)).into()))
            .await
            .unwrap();
        assert!(decode(&recv(&mut robot).await).as_map().is_some());
        drop(robot); // and reconnects
    }
    for a in answering {
        a.abort();
    }
}

/// Issue 49, item 3: a connection that only answers the server's pings is idle (a pong says
/// the socket is alive, not that the client uses it) and is closed after
/// `server.idle_timeout_s`; one whose client pings, as openpi's and vllm-omni's clients do
/// every 20 s, is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answering_pings_is_not_activity_but_pinging_is() {
    let srv = start_with("ping_interval_s = 0.2\nidle_timeout_s = 1", |_| {}).await;
    let mut answers = common::connect(srv.addr, "/").await;
    let mut pings = common::connect(srv.addr, "/").await;
    let start = Instant::now();
    let mut pinger = tokio::time::interval(Duration::from_millis(300));
    let (mut answers_closed, mut pings_closed) = (None, None);
    while start.elapsed() < Duration::from_secs(3) {
        tokio::select! {
            m = answers.next(), if answers_closed.is_none() => {
                if !matches!(m, Some(Ok(Message::Ping(_) | Message::Pong(_)))) {
                    answers_closed = Some(start.elapsed());
                }
            }
            m = pings.next(), if pings_closed.is_none() => {
                if !matches!(m, Some(Ok(Message::Ping(_) | Message::Pong(_)))) {
                    pings_closed = Some(start.elapsed());
                }
            }
            _ = pinger.tick() => {
                let _ = pings.send(Message::Ping(b"alive".to_vec().into())).await;
            }
        }
    }
    let closed = answers_closed.expect("the ping-answering connection was not closed");
    assert!(
        closed >= Duration::from_millis(900) && closed < Duration::from_millis(2500),
        "closed after {closed:?}, expected server.idle_timeout_s = 1"
    );
    assert_eq!(pings_closed, None, "a pinging client was closed as idle");
}
