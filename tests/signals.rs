//! The policyd binary under signals and a client that never reads (issue 21), each on its own
//! loopback port with a demo model: SIGHUP five times in a row while clients send, SIGTERM
//! under load (what was read is answered, then 1001 and exit 0), SIGINT twice (the second
//! exits at once), and a client that sends LIBERO frames back to back for 20 s
//! (`POLICYD_HOSTILE_SECS`) and never reads (memory stays bounded, others are served, and it
//! is closed after `server.write_timeout_s`); four connections flooding pings without reading
//! the pongs (issue 49) for as long.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use policyd::dtype::ElemType;
use policyd::protocol::Encoder;
use rmpv::Value;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

mod common;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// A running policyd binary, killed and cleaned up when dropped.
struct Server {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

/// Writes `config` (a demo config's text, its model path made absolute) and starts policyd
/// on it, logging to `dir/log`; returns once `/healthz` answers 200.
fn spawn(name: &str, config: &str) -> Server {
    spawn_with(name, config, &[])
}

/// [`spawn`] with more command-line arguments.
fn spawn_with(name: &str, config: &str, args: &[&str]) -> Server {
    let dir = std::env::temp_dir().join(format!("policyd-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    std::fs::write(dir.join("policyd.toml"), config).expect("config");
    let port = free_port();
    let mut cmd = common::policyd_command();
    let log = std::fs::File::create(dir.join("log")).expect("log file");
    let child = Command::new(cmd.remove(0))
        .args(cmd)
        .arg("--config")
        .arg(dir.join("policyd.toml"))
        .arg("--port")
        .arg(port.to_string())
        .args(args)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("policyd runs");
    let srv = Server { child, port, dir };
    let deadline = Instant::now() + Duration::from_secs(120);
    while !get(port, "/healthz").starts_with("HTTP/1.1 200") {
        assert!(
            Instant::now() < deadline,
            "policyd never became ready:\n{}",
            srv.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    srv
}

impl Server {
    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill(2) on our own child, which has not been waited for.
        assert_eq!(
            unsafe { libc::kill(self.child.id() as libc::pid_t, sig) },
            0
        );
    }

    /// Replaces the config file at once (written beside it, then renamed), as an operator's
    /// editor or deploy tool does: a reload still pending from an earlier SIGHUP never reads a
    /// half-written file (which it would refuse, and the test with it).
    fn rewrite(&self, config: &str) {
        let tmp = self.dir.join("policyd.toml.new");
        std::fs::write(&tmp, config).expect("config");
        std::fs::rename(&tmp, self.dir.join("policyd.toml")).expect("config");
    }

    /// Waits for the process to end (at most `within`); its exit code.
    fn exit_code(&mut self, within: Duration) -> Option<i32> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status.code();
            }
            assert!(
                Instant::now() < deadline,
                "policyd still running after {within:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Still healthy; SIGTERM then stops it with exit code 0.
    fn healthy_then_stopped(&mut self) {
        assert!(get(self.port, "/healthz").starts_with("HTTP/1.1 200"));
        self.signal(libc::SIGTERM);
        let code = self.exit_code(Duration::from_secs(30));
        assert_eq!(code, Some(0), "{}", self.log());
    }

    /// Resident memory, KiB.
    fn rss_kib(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        s.lines()
            .find(|l| l.starts_with("VmRSS:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }
}

fn get(port: u16, path: &str) -> String {
    common::http_get_blocking(port, path)
}

/// A demo config with its model path absolute (it is relative to configs/).
fn demo(profile: &str) -> String {
    std::fs::read_to_string(format!("{ROOT}/configs/{profile}.toml"))
        .expect("demo config")
        .replace("\"../models/", &format!("\"{ROOT}/models/"))
}

/// The tiny profile's observation: `{"observation/state": <f4[8]>}`.
fn tiny_observation(x: f32) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut e = Encoder { buf: &mut buf };
    e.map(1);
    e.str("observation/state");
    e.ndarray(ElemType::F32, &[8], 32, |d| {
        for c in d.chunks_exact_mut(4) {
            c.copy_from_slice(&x.to_le_bytes());
        }
    });
    buf
}

/// The LIBERO profile's observation (two 224×224×3 images, state [8], prompt): ~300 KB.
fn libero_observation(seed: u8) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut e = Encoder { buf: &mut buf };
    e.map(4);
    for key in ["observation/image", "observation/wrist_image"] {
        e.str(key);
        e.ndarray(ElemType::U8, &[224, 224, 3], 224 * 224 * 3, |d| {
            for (i, b) in d.iter_mut().enumerate() {
                *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
            }
        });
    }
    e.str("observation/state");
    e.ndarray(ElemType::F32, &[8], 32, |d| d.fill(0));
    e.str("prompt");
    e.str("put the bowl on the plate");
    buf
}

type Ws = common::Ws;

async fn connect(port: u16, path: &str) -> Ws {
    let (mut ws, _) = tokio_tungstenite::connect_async(format!("ws://127.0.0.1:{port}{path}"))
        .await
        .expect("connects");
    assert!(matches!(ws.next().await, Some(Ok(Message::Binary(_)))));
    ws
}

/// The rows of an openpi reply's `actions`, or why it is not one.
fn action_rows(m: &Message) -> Result<u64, String> {
    let Message::Binary(b) = m else {
        return Err(format!("not a reply: {m:?}"));
    };
    let v = rmpv::decode::read_value(&mut &b[..]).map_err(|e| e.to_string())?;
    let find = |v: &Value, key: &str| -> Option<Value> {
        v.as_map()?
            .iter()
            .find(|(k, _)| k.as_str() == Some(key) || k.as_slice() == Some(key.as_bytes()))
            .map(|(_, v)| v.clone())
    };
    find(&v, "actions")
        .and_then(|a| find(&a, "shape"))
        .and_then(|s| s.as_array()?.first()?.as_u64())
        .ok_or_else(|| format!("not an actions reply: {v}"))
}

/// The next message that is not a ping or pong.
async fn next(ws: &mut Ws) -> Option<Result<Message, String>> {
    loop {
        match tokio::time::timeout(Duration::from_secs(20), ws.next()).await {
            Err(_) => return Some(Err("no answer within 20 s".into())),
            Ok(None) => return None,
            Ok(Some(Err(e))) => return Some(Err(e.to_string())),
            Ok(Some(Ok(Message::Ping(_) | Message::Pong(_)))) => continue,
            Ok(Some(Ok(m))) => return Some(Ok(m)),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_five_times_in_a_row_while_clients_send() {
    let base = demo("tiny");
    let chunked = format!("{base}\n[pacing]\nactions_per_chunk = 4\n");
    let mut srv = spawn("hup", &base);
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for c in 0..3 {
        let (port, stop) = (srv.port, stop.clone());
        clients.push(tokio::spawn(async move {
            let mut ws = connect(port, "/").await;
            let mut rows = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                ws.send(Message::Binary(tiny_observation(c as f32 * 0.1).into()))
                    .await
                    .map_err(|e| e.to_string())?;
                match next(&mut ws).await {
                    Some(Ok(m)) => rows.push(action_rows(&m)?),
                    other => return Err(format!("client {c}: {other:?}")),
                }
            }
            Ok::<_, String>(rows)
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    for (round, text) in [&chunked, &base, &chunked].into_iter().enumerate() {
        srv.rewrite(text);
        for _ in 0..5 {
            srv.signal(libc::SIGHUP);
        }
        let want = if round % 2 == 0 { "4" } else { "10" };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let m = get(srv.port, "/metrics");
            let mut ws = connect(srv.port, "/").await;
            ws.send(Message::Binary(tiny_observation(0.0).into()))
                .await
                .unwrap();
            let rows = action_rows(&next(&mut ws).await.unwrap().unwrap()).unwrap();
            if rows.to_string() == want {
                assert!(
                    !m.contains("policyd_config_reloads_total{result=\"refused\"} 1"),
                    "{m}"
                );
                break;
            }
            assert!(
                Instant::now() < deadline,
                "round {round}: the reload never took effect:\n{}",
                srv.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        let rows = c
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("{e}\n{}", srv.log()));
        assert!(!rows.is_empty());
        assert!(rows.iter().all(|&r| r == 4 || r == 10), "{rows:?}");
    }
    srv.healthy_then_stopped();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_load_answers_what_was_read_then_exits_0() {
    let mut srv = spawn("term", &demo("tiny"));
    let mut clients = Vec::new();
    for c in 0..4 {
        let port = srv.port;
        clients.push(tokio::spawn(async move {
            let mut ws = connect(
                port,
                if c % 2 == 0 {
                    "/"
                } else {
                    "/v1/realtime/robot/openpi"
                },
            )
            .await;
            let mut replies = 0u64;
            loop {
                if ws
                    .send(Message::Binary(tiny_observation(0.5).into()))
                    .await
                    .is_err()
                {
                    // The server closed between our reads; its Close is next.
                }
                match next(&mut ws).await {
                    Some(Ok(Message::Binary(_))) => replies += 1,
                    Some(Ok(Message::Close(Some(f)))) => {
                        return if f.code == CloseCode::Away {
                            Ok(replies)
                        } else {
                            Err(format!("client {c}: closed with {f:?}"))
                        };
                    }
                    other => return Err(format!("client {c}: after {replies} replies: {other:?}")),
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    srv.signal(libc::SIGTERM);
    for c in clients {
        let replies = c
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("{e}\n{}", srv.log()));
        assert!(replies > 0);
    }
    assert_eq!(
        srv.exit_code(Duration::from_secs(30)),
        Some(0),
        "{}",
        srv.log()
    );
    let log = srv.log();
    assert!(log.contains("SIGTERM received"), "{log}");
    assert!(!log.contains("panicked"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_twice_exits_at_once_instead_of_draining() {
    let mut srv = spawn("int", &demo("tiny"));
    // A client that never answers the closing handshake keeps the drain waiting (2 s).
    let _silent = {
        let mut tcp = std::net::TcpStream::connect(("127.0.0.1", srv.port)).unwrap();
        tcp.write_all(common::UPGRADE).unwrap();
        let mut head = [0u8; 12];
        tcp.read_exact(&mut head).unwrap();
        assert_eq!(&head[9..12], b"101");
        tcp
    };
    srv.signal(libc::SIGINT);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !srv.log().contains("SIGINT received") {
        assert!(
            Instant::now() < deadline,
            "no SIGINT logged:\n{}",
            srv.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    srv.signal(libc::SIGINT);
    assert_eq!(
        srv.exit_code(Duration::from_secs(30)),
        Some(128 + libc::SIGINT),
        "{}",
        srv.log()
    );
    assert!(
        srv.log().contains("second signal (SIGINT)"),
        "{}",
        srv.log()
    );
}

/// The two floods below each load both cores for their whole run: run one at a time, so that
/// neither's proof (back-pressure, memory) depends on the other's timing.
static FLOODS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// How long the never-reading client sends.
fn hostile_secs() -> u64 {
    std::env::var("POLICYD_HOSTILE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20)
}

/// A masked client binary frame.
fn client_frame(payload: &[u8]) -> Vec<u8> {
    let mut f = vec![0x82, 0x80 | 127];
    f.extend_from_slice(&(payload.len() as u64).to_be_bytes());
    let mask = [0x5a, 0xa5, 0x3c, 0xc3];
    f.extend_from_slice(&mask);
    f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    f
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_sending_libero_frames_without_reading_is_contained() {
    let _one_at_a_time = FLOODS.lock().await;
    let mut srv = spawn("hog", &demo("libero"));
    let mut ws = connect(srv.port, "/").await;
    for i in 0..5 {
        ws.send(Message::Binary(libero_observation(i).into()))
            .await
            .unwrap();
        action_rows(&next(&mut ws).await.unwrap().unwrap()).unwrap();
    }
    let before = srv.rss_kib();
    let secs = hostile_secs();
    let port = srv.port;
    let hog = std::thread::spawn(move || {
        let mut tcp = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        tcp.write_all(common::UPGRADE).unwrap();
        // Never reads again (the 101 and everything after stay in the socket).
        tcp.set_write_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let frame = client_frame(&libero_observation(9));
        let (mut at, mut frames, mut blocked) = (0usize, 0u64, 0u64);
        let start = Instant::now();
        let end = start + Duration::from_secs(secs);
        while Instant::now() < end {
            match tcp.write(&frame[at..]) {
                Ok(n) => {
                    at += n;
                    if at == frame.len() {
                        at = 0;
                        frames += 1;
                    }
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    blocked += 1;
                }
                // The server closes a client that leaves its replies unread for
                // server.write_timeout_s (10 s by default).
                Err(_) => return (frames, blocked, Some(start.elapsed())),
            }
        }
        (frames, blocked, None)
    });
    // Meanwhile another client is served, and the server's memory stays put.
    let (mut served, mut worst, mut peak) = (0u64, Duration::ZERO, before);
    while !hog.is_finished() {
        let t = Instant::now();
        ws.send(Message::Binary(libero_observation(1).into()))
            .await
            .unwrap();
        action_rows(&next(&mut ws).await.unwrap().unwrap()).unwrap();
        worst = worst.max(t.elapsed());
        served += 1;
        peak = peak.max(srv.rss_kib());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (frames, blocked, dropped) = hog.join().unwrap();
    let grown = peak.saturating_sub(before);
    eprintln!(
        "hog: {frames} frames written, {blocked} blocked writes in {secs} s, closed by the \
         server after {dropped:?}; other client: {served} replies, slowest {worst:?}; server \
         RSS {before} KiB, peak +{grown} KiB"
    );
    // Its replies are small (a few MB in all fit the kernel's socket buffers), so it may or
    // may not be closed for not reading within the run; never before server.write_timeout_s.
    if let Some(after) = dropped {
        assert!(
            after >= Duration::from_secs(8),
            "closed after {after:?}, before server.write_timeout_s = 10"
        );
    }
    assert!(
        blocked > 0,
        "the server read everything: no back-pressure was exercised"
    );
    assert!(
        served >= secs,
        "the other client was starved: {served} replies"
    );
    assert!(grown < 32 * 1024, "RSS grew {grown} KiB");
    srv.healthy_then_stopped();
}

/// A masked client ping with a 125-byte payload (the most a control frame carries).
fn client_ping() -> Vec<u8> {
    let mut f = vec![0x89, 0x80 | 125];
    let mask = [0x11, 0x22, 0x33, 0x44];
    f.extend_from_slice(&mask);
    f.extend((0..125u8).map(|i| i ^ mask[usize::from(i) % 4]));
    f
}

/// A WebSocket connection from another loopback address (`127.0.0.2`): another host to the
/// server's per-address share.
async fn connect_from(ip: &str, port: u16) -> Ws {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{ip}:0").parse().unwrap()).unwrap();
    let tcp = socket
        .connect(format!("127.0.0.1:{port}").parse().unwrap())
        .await
        .expect("connects");
    let (mut ws, _) = tokio_tungstenite::client_async(
        format!("ws://127.0.0.1:{port}/"),
        tokio_tungstenite::MaybeTlsStream::Plain(tcp),
    )
    .await
    .expect("upgrades");
    assert!(matches!(ws.next().await, Some(Ok(Message::Binary(_)))));
    ws
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ping_flood_that_never_reads_the_pongs_stays_bounded() {
    let _one_at_a_time = FLOODS.lock().await;
    // Four connections send pings as fast as the socket takes them and never read: each pong
    // the server owes used to pile up in tungstenite's write buffer (~30 MB/s). Now the buffer
    // is bounded (one pong waits, replaced by the next), and a connection whose peer does not
    // read is closed after server.write_timeout_s; the flooders reconnect and go on.
    let mut srv = spawn("pingflood", &demo("libero"));
    let mut robot = connect_from("127.0.0.2", srv.port).await;
    for i in 0..5 {
        robot
            .send(Message::Binary(libero_observation(i).into()))
            .await
            .unwrap();
        action_rows(&next(&mut robot).await.unwrap().unwrap()).unwrap();
    }
    let before = srv.rss_kib();
    let secs = hostile_secs();
    let port = srv.port;
    let stop = Arc::new(AtomicBool::new(false));
    let flooders: Vec<_> = (0..4)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let ping = client_ping();
                let (mut pings, mut reconnects) = (0u64, 0u64);
                while !stop.load(Ordering::Relaxed) {
                    let Ok(mut tcp) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
                        std::thread::sleep(Duration::from_millis(50));
                        continue;
                    };
                    reconnects += 1;
                    tcp.set_write_timeout(Some(Duration::from_millis(100)))
                        .unwrap();
                    if tcp.write_all(common::UPGRADE).is_err() {
                        continue;
                    }
                    let mut at = 0;
                    while !stop.load(Ordering::Relaxed) {
                        match tcp.write(&ping[at..]) {
                            Ok(0) => break,
                            Ok(n) => {
                                at += n;
                                if at == ping.len() {
                                    at = 0;
                                    pings += 1;
                                }
                            }
                            Err(e)
                                if matches!(
                                    e.kind(),
                                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                                ) => {}
                            Err(_) => break, // closed by the server: reconnect
                        }
                    }
                }
                (pings, reconnects)
            })
        })
        .collect();
    let (mut served, mut peak) = (0u64, before);
    let end = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < end {
        robot
            .send(Message::Binary(libero_observation(1).into()))
            .await
            .unwrap();
        action_rows(&next(&mut robot).await.unwrap().unwrap()).unwrap();
        served += 1;
        peak = peak.max(srv.rss_kib());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let (mut pings, mut connections) = (0, 0);
    for f in flooders {
        let (p, c) = f.join().unwrap();
        pings += p;
        connections += c;
    }
    let grown = peak.saturating_sub(before);
    eprintln!(
        "ping flood: {pings} pings over {connections} connections in {secs} s; the robot got \
         {served} replies; server RSS {before} KiB, peak +{grown} KiB"
    );
    assert!(pings > 10_000, "the flood did not flood: {pings} pings");
    assert!(served >= secs, "the robot was starved: {served} replies");
    assert!(grown < 32 * 1024, "RSS grew {grown} KiB under the flood");
    srv.healthy_then_stopped();
}

/// Issue 49, item 4: the lines any peer can provoke are rate-limited (one client opening and
/// closing connections, and one sending refused frames on the vllm-omni route, used to write
/// ~5,000 and ~7,800 lines a second), and a client's string cannot forge a journal line: a
/// dtype of `x\n<0>policyd::app: INJECTED` used to end the line and start an emergency entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_cannot_flood_the_log_or_forge_a_line_in_it() {
    let srv = spawn_with("logflood", &demo("libero"), &["--log-format", "journal"]);
    let before = srv.log().lines().count();
    let secs = 3;
    // Connections opened and closed as fast as the server takes them.
    let port = srv.port;
    let churn = tokio::spawn(async move {
        let end = Instant::now() + Duration::from_secs(secs);
        let mut n = 0u64;
        while Instant::now() < end {
            if let Ok((mut ws, _)) =
                tokio_tungstenite::connect_async(format!("ws://127.0.0.1:{port}/")).await
            {
                let _ = ws.close(None).await;
                n += 1;
            }
        }
        n
    });
    // Refused frames on the vllm-omni route (which keeps the socket open after an error),
    // the first with the forged dtype.
    let mut ws = connect(srv.port, "/v1/realtime/robot/openpi").await;
    let forged = {
        let mut buf = Vec::new();
        let mut e = Encoder { buf: &mut buf };
        e.map(1);
        e.str("observation/state");
        e.map(4);
        e.str("__ndarray__");
        buf.push(0xc3);
        let mut e = Encoder { buf: &mut buf };
        e.str("data");
        e.bin(&[0u8; 32]);
        e.str("dtype");
        e.str("x\n<0>policyd::app: INJECTED");
        e.str("shape");
        e.array(1);
        e.int(8);
        buf
    };
    let end = Instant::now() + Duration::from_secs(secs);
    let mut refused = 0u64;
    while Instant::now() < end {
        ws.send(Message::Binary(forged.clone().into()))
            .await
            .unwrap();
        match next(&mut ws).await {
            Some(Ok(_)) => refused += 1,
            other => panic!("the route closed: {other:?}"),
        }
    }
    let churned = churn.await.unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let log = srv.log();
    let lines: Vec<&str> = log.lines().skip(before).collect();
    eprintln!(
        "{churned} connections opened and closed, {refused} frames refused: {} log lines",
        lines.len()
    );
    assert!(
        churned > 20 && refused > 20,
        "no flood: {churned}, {refused}"
    );
    assert!(
        lines.len() < 100,
        "{} lines:\n{}",
        lines.len(),
        lines.join("\n")
    );
    assert!(
        log.lines().all(|l| !l.starts_with("<0>")),
        "a forged emergency line:\n{log}"
    );
    assert!(
        log.contains("INJECTED"),
        "the refusal was not logged:\n{log}"
    );
    assert!(
        log.contains("x\\n<0>policyd::app"),
        "not shown escaped:\n{log}"
    );
}
