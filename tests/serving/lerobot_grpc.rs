//! LeRobot's gRPC service driven from Rust with the client generated from proto/services.proto
//! (issue 37): what a hostile peer on the robot's network can do to it, and what the robot
//! still gets. A synthetic engine stands in for the model; its actions start with the first
//! motor's value, so the motor order a session uses is visible in the actions.
//!
//! The crash bugs (a declared camera size, a setup amplified through the pickle memo) run in a
//! child process under `RLIMIT_AS`, standing in for the unit's `MemoryMax=`: before the fix
//! the child aborted, after it the server answers with an error and keeps serving.

use crate::common;

use common::MOTORS;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use policyd::dtype::ElemType;
use policyd::engine::{IoSpec, TensorSpec};
use policyd::net::lerobot::transport::async_inference_client::AsyncInferenceClient;
use policyd::net::lerobot::transport::{Empty, Observation, PolicySetup, TransferState};
use policyd::testing::synthetic::Behaviour;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;
use tonic::transport::Channel;

/// A pickle written opcode by opcode (protocol 4, the opcodes LeRobot's client emits).
#[derive(Default)]
struct Pickle(Vec<u8>);

impl Pickle {
    fn new() -> Pickle {
        Pickle(vec![0x80, 4])
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.0.push(b'X');
        self.0.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.0.extend_from_slice(s.as_bytes());
        self
    }
    fn global(&mut self, module: &str, name: &str) -> &mut Self {
        self.str(module).str(name).op(0x93)
    }
    fn op(&mut self, op: u8) -> &mut Self {
        self.0.push(op);
        self
    }
    fn int(&mut self, v: i32) -> &mut Self {
        self.0.push(b'J');
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// LONG1 with 8 bytes: an int past 32 bits.
    fn long(&mut self, v: i64) -> &mut Self {
        self.0.extend_from_slice(&[0x8a, 8]);
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn float(&mut self, v: f64) -> &mut Self {
        self.0.push(b'G');
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.push(b'B');
        self.0.extend_from_slice(&(b.len() as u32).to_le_bytes());
        self.0.extend_from_slice(b);
        self
    }
    /// MEMOIZE: the top of the stack gets the next memo index.
    fn memo(&mut self) -> &mut Self {
        self.op(0x94)
    }
    /// LONG_BINGET.
    fn get(&mut self, i: u32) -> &mut Self {
        self.0.push(b'j');
        self.0.extend_from_slice(&i.to_le_bytes());
        self
    }
    /// `(ints...)` as a tuple.
    fn shape(&mut self, dims: &[i32]) -> &mut Self {
        self.op(b'(');
        for &d in dims {
            self.int(d);
        }
        self.op(b't')
    }
    /// NEWOBJ of `class` (no arguments), then BUILD with the dict `fields` writes (between
    /// `}(` and `u`).
    fn object(&mut self, class: &str, fields: impl FnOnce(&mut Self)) -> &mut Self {
        self.global("lerobot.async_inference.helpers", class)
            .op(b')')
            .op(0x81)
            .op(b'}')
            .op(b'(');
        fields(self);
        self.op(b'u').op(b'b')
    }
    fn done(&mut self) -> Vec<u8> {
        self.op(b'.');
        std::mem::take(&mut self.0)
    }
}

/// A `RemotePolicyConfig` whose `lerobot_features` dict is written by `features` (between
/// `}(` and `u`).
fn setup_with(pretrained: &str, policy_type: &str, features: impl FnOnce(&mut Pickle)) -> Vec<u8> {
    let mut p = Pickle::new();
    p.object("RemotePolicyConfig", |p| {
        p.str("policy_type").str(policy_type);
        p.str("pretrained_name_or_path").str(pretrained);
        p.str("actions_per_chunk").int(10);
        p.str("device").str("cpu");
        p.str("lerobot_features").op(b'}').op(b'(');
        features(p);
        p.op(b'u');
    });
    p.done()
}

/// One feature: `{dtype, shape, names}`.
fn feature(p: &mut Pickle, key: &str, dtype: &str, shape: &[i32], names: &[&str]) {
    p.str(key).op(b'}').op(b'(');
    p.str("dtype").str(dtype).str("shape").shape(shape);
    if !names.is_empty() {
        p.str("names").op(b']').op(b'(');
        for n in names {
            p.str(n);
        }
        p.op(b'e');
    }
    p.op(b'u');
}

/// What LeRobot's client sends for the test policy: six motors in `motors`' order and a 4x6
/// camera `front` declared at `camera`.
fn setup(motors: &[&str], camera: &[i32]) -> Vec<u8> {
    setup_with("default", "act", |p| {
        feature(
            p,
            "observation.state",
            "float32",
            &[motors.len() as i32],
            motors,
        );
        feature(p, "observation.images.front", "image", camera, &[]);
    })
}

/// A `TimedObservation`: motor `i` reads `10·(i + 1)`, a `h`x`w` camera, `extra` entries.
fn observation(step: i32, (h, w): (usize, usize), extra: impl FnOnce(&mut Pickle)) -> Vec<u8> {
    let mut p = Pickle::new();
    p.object("TimedObservation", |p| {
        p.str("timestamp").float(1.0e9 + f64::from(step));
        p.str("timestep").int(step);
        p.str("must_go").op(0x88);
        p.str("observation").op(b'}').op(b'(');
        for (i, m) in MOTORS.iter().enumerate() {
            p.str(m).float(10.0 * (i + 1) as f64);
        }
        // numpy's _frombuffer(data, dtype("u1"), shape, "C"), as protocol 5 writes arrays.
        p.str("front")
            .global("numpy._core.numeric", "_frombuffer")
            .op(b'(')
            .bytes(&vec![7u8; h * w * 3])
            .global("numpy", "dtype")
            .str("u1")
            .op(0x89)
            .op(0x88)
            .op(0x87)
            .op(b'R')
            .shape(&[h as i32, w as i32, 3])
            .str("C")
            .op(b't')
            .op(b'R');
        extra(p);
        p.op(b'u');
    });
    p.done()
}

fn config(lerobot: &str, grpc: SocketAddr) -> policyd::config::Config {
    let text = format!(
        "[server]\nhost = \"127.0.0.1\"\nport = 0\n\
         [engine]\nmodel = \"synthetic\"\nwarmup_runs = 1\n\
         [pacing]\nfps = 30\n\
         [[inputs]]\nkey = \"observation.state\"\ntensor = \"state\"\ndtypes = [\"float32\"]\nshape = [6]\n\
         [[inputs]]\nkey = \"observation.images.front\"\ntensor = \"front\"\ndtypes = [\"uint8\"]\nshape = [4, 6, 3]\n\
         [[outputs]]\ntensor = \"actions\"\n\
         [lerobot]\nlisten = \"{grpc}\"\nmax_payload_bytes = 2097152\n{lerobot}\n"
    );
    policyd::config::Config::parse(&text, "test", None).expect("test config")
}

fn io() -> IoSpec {
    let spec = |name: &str, dtype, shape: &[usize]| TensorSpec {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
    };
    IoSpec {
        inputs: vec![
            spec("state", ElemType::F32, &[1, 6]),
            spec("front", ElemType::U8, &[1, 4, 6, 3]),
        ],
        outputs: vec![spec("actions", ElemType::F32, &[1, 10, 7])],
    }
}

fn free_port() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    l.local_addr().expect("its address")
}

/// A server with the LeRobot service on its own port; `extra` adds `[lerobot]` keys.
async fn serve(extra: &str) -> (common::Running, SocketAddr) {
    let grpc = free_port();
    let running = common::start_io(config(extra, grpc), io(), Behaviour::default()).await;
    // The service binds after the WebSocket listener: wait for its port (generously: under
    // qemu, beside the other server tests of this binary, start-up takes seconds).
    let deadline = Instant::now() + Duration::from_secs(60);
    while tokio::net::TcpStream::connect(grpc).await.is_err() {
        assert!(Instant::now() < deadline, "the gRPC port never opened");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (running, grpc)
}

async fn client(addr: SocketAddr) -> AsyncInferenceClient<Channel> {
    client_bound(addr, None).await
}

/// A client whose connection comes from `local` (another loopback address: another host to
/// the service's per-address rules), or the default address.
async fn client_bound(
    addr: SocketAddr,
    local: Option<std::net::IpAddr>,
) -> AsyncInferenceClient<Channel> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .expect("a URI")
        .local_address(local)
        .connect()
        .await
        .expect("connects");
    AsyncInferenceClient::new(channel)
        .max_decoding_message_size(8 << 20)
        .max_encoding_message_size(8 << 20)
}

/// LeRobot's chunking: BEGIN, MIDDLE..., END, at most 2 MiB each.
fn chunks(payload: &[u8]) -> Vec<Observation> {
    let parts: Vec<&[u8]> = payload.chunks(2 << 20).collect();
    let n = parts.len();
    parts
        .into_iter()
        .enumerate()
        .map(|(i, data)| Observation {
            transfer_state: if i == 0 && n > 1 {
                TransferState::TransferBegin
            } else if i + 1 == n {
                TransferState::TransferEnd
            } else {
                TransferState::TransferMiddle
            } as i32,
            data: data.to_vec(),
        })
        .collect()
}

async fn set_up(
    c: &mut AsyncInferenceClient<Channel>,
    payload: Vec<u8>,
) -> Result<(), tonic::Status> {
    c.ready(Empty {}).await?;
    c.send_policy_instructions(PolicySetup { data: payload })
        .await
        .map(|_| ())
}

async fn observe(
    c: &mut AsyncInferenceClient<Channel>,
    payload: &[u8],
) -> Result<(), tonic::Status> {
    c.send_observations(tokio_stream::iter(chunks(payload)))
        .await
        .map(|_| ())
}

/// The next chunk's reply, polling until one comes (an empty reply is "none yet").
async fn next_chunk(c: &mut AsyncInferenceClient<Channel>) -> Vec<u8> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let data = c
            .get_actions(Empty {})
            .await
            .expect("GetActions")
            .into_inner()
            .data;
        if !data.is_empty() {
            return data;
        }
        assert!(Instant::now() < deadline, "no actions within 10 s");
    }
}

/// The first action's first value (the synthetic engine's first input value) of the next chunk.
async fn first_action(c: &mut AsyncInferenceClient<Channel>) -> f64 {
    let data = next_chunk(c).await;
    // The reply's first float is `G` + 8 big-endian bytes after the first `torch.tensor([`
    // (the action's values; the timestamp precedes it).
    let at = data
        .windows(4)
        .position(|w| w == b"(](G")
        .expect("an action tensor");
    let v: [u8; 8] = data[at + 4..at + 12].try_into().expect("8 bytes");
    f64::from_be_bytes(v)
}

/// Sets up with `motors` (a 4x6 camera) and sends observation `step`: the first action's first
/// value.
async fn set_up_and_act(c: &mut AsyncInferenceClient<Channel>, motors: &[&str], step: i32) -> f64 {
    set_up(c, setup(motors, &[4, 6, 3])).await.expect("setup");
    observe(c, &observation(step, (4, 6), |_| {}))
        .await
        .expect("observation");
    first_action(c).await
}

#[tokio::test]
async fn a_robot_sets_up_observes_and_gets_its_actions() {
    let (_server, grpc) = serve("").await;
    let mut robot = client(grpc).await;
    assert_eq!(
        set_up_and_act(&mut robot, &MOTORS, 0).await,
        10.0,
        "the first motor's value"
    );
}

/// This file's module in the test binary (`lerobot_grpc`), for a test that re-runs itself.
fn this_module() -> &'static str {
    module_path!().split_once("::").map_or("", |(_, m)| m)
}

/// Bug 1 and 2 (the crashes): run in a child under an address-space limit.
#[test]
fn hostile_setups_are_refused_under_a_memory_limit() {
    let exe = std::env::current_exe().expect("the test binary");
    let cmd = common::command(&exe.to_string_lossy());
    let out = std::process::Command::new(&cmd[0])
        .args(&cmd[1..])
        // Its name in this binary: the module path without the crate's name.
        .args([
            "--exact",
            &format!("{}::child_hostile_setups", this_module()),
        ])
        .args(["--include-ignored", "--nocapture"])
        .env("POLICYD_GRPC_CHILD", "1")
        .output()
        .expect("runs the child");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "the child failed or aborted:\n{text}");
    assert!(text.contains("1 passed"), "the child ran no test:\n{text}");
}

#[test]
#[ignore = "run by hostile_setups_are_refused_under_a_memory_limit in a child process"]
fn child_hostile_setups() {
    if std::env::var_os("POLICYD_GRPC_CHILD").is_none() {
        return;
    }
    // 3 GiB of address space: what a 2 GiB MemoryMax= leaves room for, as in the report.
    let cap = libc::rlimit {
        rlim_cur: 3 << 30,
        rlim_max: 3 << 30,
    };
    // SAFETY: setrlimit reads the struct; it limits this child process only.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &cap) }, 0);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    rt.block_on(async {
        let (_server, grpc) = serve("").await;
        let mut attacker = client(grpc).await;
        // Bug 1: a declared camera of 10^9 rows made a 384 GB resize buffer; 2^57 rows
        // wrapped to a 0-byte one; 0x0 was accepted.
        for (shape, says) in [
            (vec![1_000_000_000, 1, 3], "lerobot.max_payload_bytes"),
            (vec![1 << 30, 1 << 30, 3], "lerobot.max_payload_bytes"),
            (vec![0, 0, 3], "needs a height and a width"),
        ] {
            let e = set_up(&mut attacker, setup(&MOTORS, &shape))
                .await
                .expect_err("refused");
            assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
            assert!(e.message().contains(says), "{}", e.message());
        }
        // 2^57 x 64 x 3 overflows a usize (it wrapped to a 0-byte buffer in release builds).
        let wraps = setup_with("default", "act", |p| {
            feature(p, "observation.state", "float32", &[6], &MOTORS);
            p.str("observation.images.front").op(b'}').op(b'(');
            p.str("dtype").str("image").str("shape").op(b'(');
            p.long(1 << 57).int(64).int(3).op(b't').op(b'u');
        });
        let e = set_up(&mut attacker, wraps).await.expect_err("refused");
        assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
        assert!(
            e.message().contains("lerobot.max_payload_bytes"),
            "{}",
            e.message()
        );
        // Bug 2: the pickle memo. 2000 keys naming one feature of 1024 names (each a memo
        // reference), then 64 features of 1024 references to one 1.5 MB name.
        let many_keys = setup_with("default", "act", |p| {
            p.str("k0").op(b'}').memo().op(b'(');
            p.str("dtype").str("float32").str("shape").shape(&[1024]);
            p.str("names")
                .op(b']')
                .op(b'(')
                .str("shoulder_pan.pos")
                .memo();
            for _ in 1..1024 {
                p.get(1);
            }
            p.op(b'e').op(b'u');
            for i in 1..2000 {
                p.str(&format!("k{i}")).get(0);
            }
        });
        let e = set_up(&mut attacker, many_keys).await.expect_err("refused");
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(e.message().contains("at most 64"), "{}", e.message());
        let long = "n".repeat(1_500_000);
        let one_long_name = setup_with("default", "act", |p| {
            for f in 0..64 {
                p.str(&format!("f{f}")).op(b'}').op(b'(');
                p.str("dtype").str("float32").str("shape").shape(&[1024]);
                p.str("names").op(b']').op(b'(');
                if f == 0 {
                    p.str(&long).memo();
                } else {
                    p.get(0);
                }
                for _ in 1..1024 {
                    p.get(0);
                }
                p.op(b'e').op(b'u');
            }
        });
        let e = set_up(&mut attacker, one_long_name)
            .await
            .expect_err("refused");
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(
            e.message().contains("expands to far more"),
            "{}",
            e.message()
        );
        // More names than the state has elements, and a motor named twice.
        let mut seven = MOTORS.to_vec();
        seven.push("extra.pos");
        let e = set_up(
            &mut attacker,
            setup_with("default", "act", |p| {
                feature(p, "observation.state", "float32", &[6], &seven);
            }),
        )
        .await
        .expect_err("refused");
        assert!(
            e.message().contains("7 names for shape [6]"),
            "{}",
            e.message()
        );
        let mut twice = MOTORS.to_vec();
        twice[5] = twice[0];
        let e = set_up(&mut attacker, setup(&twice, &[4, 6, 3]))
            .await
            .expect_err("refused");
        assert!(
            e.message().contains("names 'shoulder_pan.pos' twice"),
            "{}",
            e.message()
        );
        // The server still serves: the same connection sets up properly and gets actions.
        set_up(&mut attacker, setup(&MOTORS, &[8, 12, 3]))
            .await
            .expect("a proper setup");
        observe(&mut attacker, &observation(0, (8, 12), |_| {}))
            .await
            .expect("observation");
        assert_eq!(first_action(&mut attacker).await, 10.0);
    });
}

/// Bug 3: streams that only open (HEADERS, no chunk) held both reassembly permits forever, and
/// every robot's observation was refused as busy.
#[tokio::test]
async fn idle_observation_streams_do_not_lock_robots_out() {
    let (_server, grpc) = serve("chunk_timeout_s = 0.5\nobservation_timeout_s = 1").await;
    let mut idle = Vec::new();
    for _ in 0..4 {
        let mut c = client(grpc).await;
        idle.push(tokio::spawn(async move {
            c.send_observations(futures_util::stream::pending::<Observation>())
                .await
                .map(|_| ())
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut robot = client(grpc).await;
    set_up(&mut robot, setup(&MOTORS, &[4, 6, 3]))
        .await
        .expect("setup");
    observe(&mut robot, &observation(0, (4, 6), |_| {}))
        .await
        .expect("the robot's observation is taken while idle streams are open");
    // The idle streams are cut at the chunk deadline, not held.
    for h in idle {
        let e = tokio::time::timeout(Duration::from_secs(5), h)
            .await
            .expect("cut within the deadline")
            .expect("the task")
            .expect_err("an idle stream is refused");
        assert_eq!(e.code(), Code::DeadlineExceeded, "{e:?}");
    }
    // A stream that sends its first chunk and stalls holds its peer's place until the
    // deadline: meanwhile this address's next observation is busy, then it goes through.
    let payload = observation(1, (4, 6), |_| {});
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(Observation {
        transfer_state: TransferState::TransferBegin as i32,
        data: payload[..100].to_vec(),
    })
    .await
    .expect("queued");
    let mut staller = client(grpc).await;
    let stalled = tokio::spawn(async move {
        staller
            .send_observations(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let e = observe(&mut robot, &payload).await.expect_err("busy");
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert!(e.message().contains("one at a time"), "{}", e.message());
    let e = stalled.await.expect("the task").expect_err("cut");
    assert_eq!(e.code(), Code::DeadlineExceeded);
    drop(tx);
    observe(&mut robot, &payload)
        .await
        .expect("taken once the staller is cut");
}

/// Bug 4: connections are capped, handshakes and idle connections time out.
#[tokio::test]
async fn connections_are_capped_and_time_out() {
    let (server, grpc) = serve(
        "max_connections = 4\nmax_connections_per_peer = 4\nhandshake_timeout_s = 2\n\
         idle_timeout_s = 3\nlong_poll_ms = 200",
    )
    .await;
    // 40 connections that send nothing: 4 are held, the rest closed at once.
    let opened = Instant::now();
    let mut socks = Vec::new();
    for _ in 0..40 {
        socks.push(
            tokio::net::TcpStream::connect(grpc)
                .await
                .expect("connects"),
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut closed_at_once = 0;
    for s in &mut socks {
        let mut b = [0u8; 256];
        // A held connection has the server's SETTINGS and then nothing; a refused one, its end.
        let read = tokio::time::timeout(Duration::from_millis(50), async {
            loop {
                match s.read(&mut b).await {
                    Ok(0) | Err(_) => return true,
                    Ok(_) => {}
                }
            }
        })
        .await;
        if read.is_ok() {
            closed_at_once += 1;
        }
    }
    assert!(
        opened.elapsed() < Duration::from_secs(2),
        "checked before the handshake deadline"
    );
    assert_eq!(
        closed_at_once, 36,
        "all but lerobot.max_connections are closed"
    );
    // The held ones are closed at the handshake deadline (2 s after accept).
    tokio::time::sleep(Duration::from_millis(2300).saturating_sub(opened.elapsed())).await;
    for s in &mut socks {
        // The server's SETTINGS first (tonic speaks HTTP/2 only), then the end.
        let mut b = [0u8; 256];
        let closed = tokio::time::timeout(Duration::from_secs(3), async {
            while let Ok(n) = s.read(&mut b).await {
                if n == 0 {
                    break;
                }
            }
        })
        .await;
        assert!(closed.is_ok(), "closed after the handshake timeout");
    }
    drop(socks);
    // A connection that completed its handshake but starts no call is closed as long again
    // after its preface (issue 49: it used to hold its slot for the idle timeout).
    let mut h2 = tokio::net::TcpStream::connect(grpc)
        .await
        .expect("connects");
    h2.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .expect("the preface and an empty SETTINGS");
    let opened = Instant::now();
    let mut buf = vec![0u8; 4096];
    let closed = loop {
        match tokio::time::timeout(Duration::from_secs(10), h2.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) | Err(_) => break opened.elapsed(),
            Ok(Ok(_)) => {}
        }
    };
    assert!(
        closed >= Duration::from_millis(1800) && closed < Duration::from_millis(2900),
        "closed after {closed:?}, expected lerobot.handshake_timeout_s = 2 after the preface"
    );
    // A robot's connection is not idle while it polls, and the WebSocket port never noticed.
    let mut robot = client(grpc).await;
    set_up(&mut robot, setup(&MOTORS, &[4, 6, 3]))
        .await
        .expect("setup");
    assert!(
        common::http_get(server.addr, "/healthz", "")
            .await
            .contains("OK")
    );
}

/// Bug 5: client strings in errors and logs are cut.
#[tokio::test]
async fn echoed_client_strings_are_cut() {
    let (_server, grpc) = serve("").await;
    let mut c = client(grpc).await;
    let long = "p".repeat(1_500_000);
    let e = set_up(&mut c, setup_with(&long, "act", |_| {}))
        .await
        .expect_err("not served");
    assert!(
        e.message().contains("is not served here"),
        "{}",
        e.message()
    );
    assert!(e.message().len() <= 1100, "{} bytes", e.message().len());
    assert!(e.message().contains("1500000 bytes in all"));
    let e = set_up(&mut c, setup_with("default", &long, |_| {}))
        .await
        .map(|_| ());
    // No `[[lerobot.serve]]` policy_type to check against: the setup only fails on features.
    let e = e.expect_err("no features");
    assert!(e.message().len() <= 1100, "{} bytes", e.message().len());
    set_up(&mut c, setup(&MOTORS, &[4, 6, 3]))
        .await
        .expect("setup");
    let key = "k".repeat(1_500_000);
    let e = observe(
        &mut c,
        &observation(0, (4, 6), |p| {
            p.str(&key).op(b']');
        }),
    )
    .await
    .expect_err("a list is not an observation value");
    assert!(e.message().len() <= 1100, "{} bytes", e.message().len());
    assert!(e.message().contains("kkk"), "{}", e.message());
}

/// Messages over tonic's limit are refused before a handler runs (a setup) or as the stream
/// is read (an observation chunk): both are counted and answered, and the robot goes on.
#[tokio::test]
async fn messages_over_the_grpc_limit_are_counted() {
    let (server, grpc) = serve("").await;
    let metrics = &server.stats.metrics;
    let mut c = client(grpc).await;
    let e = set_up(&mut c, vec![0x80; 3 << 20])
        .await
        .expect_err("over 2 MiB");
    assert_eq!(e.code(), tonic::Code::OutOfRange, "{}", e.message());
    assert_eq!(metrics.lerobot_refusals("oversize"), 1);
    let e = c
        .send_observations(tokio_stream::iter([Observation {
            transfer_state: TransferState::TransferEnd as i32,
            data: vec![0x80; 3 << 20],
        }]))
        .await
        .expect_err("one chunk over 2 MiB");
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{}", e.message());
    assert!(e.message().contains("too large"), "{}", e.message());
    assert_eq!(metrics.lerobot_refusals("oversize"), 2);
    // The same connection still serves the robot.
    assert_eq!(set_up_and_act(&mut c, &MOTORS, 0).await, 10.0);
    assert_eq!(metrics.lerobot_refusals("oversize"), 2);
}

/// The session belongs to the connection that set it up (the safety concern).
#[tokio::test]
async fn another_peer_cannot_steer_or_rob_the_robots_session() {
    let (_server, grpc) = serve("takeover_after_s = 1").await;
    let mut robot = client(grpc).await;
    set_up(&mut robot, setup(&MOTORS, &[4, 6, 3]))
        .await
        .expect("setup");
    let mut other = client(grpc).await;
    // Motors reversed, Ready, and a poll for the robot's actions: each refused while the robot
    // is connected and active.
    let reversed: Vec<&str> = MOTORS.iter().rev().copied().collect();
    let e = set_up(&mut other, setup(&reversed, &[4, 6, 3]))
        .await
        .expect_err("refused");
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let e = other
        .send_policy_instructions(PolicySetup {
            data: setup(&reversed, &[4, 6, 3]),
        })
        .await
        .expect_err("refused");
    assert_eq!(e.code(), Code::PermissionDenied);
    let e = observe(&mut other, &observation(0, (4, 6), |_| {}))
        .await
        .expect_err("refused");
    assert_eq!(e.code(), Code::PermissionDenied);
    observe(&mut robot, &observation(0, (4, 6), |_| {}))
        .await
        .expect("observation");
    let polled = other.get_actions(Empty {}).await.expect_err("refused");
    assert_eq!(polled.code(), Code::PermissionDenied);
    assert_eq!(
        first_action(&mut robot).await,
        10.0,
        "the robot's own motor order, its own chunk"
    );
    // The robot reconnects (a new connection from its address): its session carries on.
    drop(robot);
    let mut again = client(grpc).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match observe(&mut again, &observation(1, (4, 6), |_| {})).await {
            Ok(()) => break,
            Err(e) => {
                assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
                assert!(
                    Instant::now() < deadline,
                    "the old connection never counted as gone"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    assert_eq!(first_action(&mut again).await, 10.0);
    // Silent past lerobot.takeover_after_s: another client may take the session over, with
    // its own setup, and the old owner is refused from then on.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(
        set_up_and_act(&mut other, &reversed, 2).await,
        60.0,
        "a takeover, with the new owner's motor order"
    );
    let e = observe(&mut again, &observation(3, (4, 6), |_| {}))
        .await
        .expect_err("the old owner is refused");
    assert_eq!(e.code(), Code::PermissionDenied);
}

/// [`client_bound`] from `ip`.
async fn client_from(ip: &str, addr: SocketAddr) -> AsyncInferenceClient<Channel> {
    client_bound(addr, Some(ip.parse().expect("an address"))).await
}

/// A raw TCP connection from `ip`.
async fn tcp_from(ip: &str, addr: SocketAddr) -> tokio::net::TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
    socket
        .bind(format!("{ip}:0").parse().expect("an address"))
        .expect("binds");
    socket.connect(addr).await.expect("connects")
}

/// Whether the server closed `s` within `within` (reading and dropping what it sends).
async fn closed_within(s: &mut tokio::net::TcpStream, within: Duration) -> bool {
    let mut b = [0u8; 1024];
    tokio::time::timeout(within, async {
        loop {
            match s.read(&mut b).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok()
}

/// Issue 49, item 3: sixteen connections from one host that send only the HTTP/2 preface and
/// an empty SETTINGS (33 bytes each) used to fill lerobot.max_connections for 120 s. Now one
/// address holds at most its share (8 of 16 by default), the rest are refused and counted,
/// and the held ones are closed when no call starts within the handshake timeout.
#[tokio::test]
async fn preface_only_connections_from_one_host_leave_the_robot_a_slot() {
    let (server, grpc) = serve("handshake_timeout_s = 2").await;
    let mut socks = Vec::new();
    for _ in 0..16 {
        let mut s = tcp_from("127.0.0.2", grpc).await;
        s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
            .await
            .expect("the preface and an empty SETTINGS");
        socks.push(s);
    }
    let opened = Instant::now();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut refused = 0;
    for s in &mut socks {
        if closed_within(s, Duration::from_millis(50)).await {
            refused += 1;
        }
    }
    assert_eq!(
        refused, 8,
        "one address holds lerobot.max_connections_per_peer = 8"
    );
    assert_eq!(server.stats.metrics.lerobot_refusals("peer_share"), 8);
    // Held: the robot connects, sets up and acts.
    let mut robot = client(grpc).await;
    assert_eq!(set_up_and_act(&mut robot, &MOTORS, 0).await, 10.0);
    // No call within the handshake timeout of the preface: closed (not after idle's 120 s).
    for s in &mut socks {
        assert!(
            closed_within(s, Duration::from_secs(6)).await,
            "a preface-only connection outlived the handshake timeout"
        );
    }
    assert!(opened.elapsed() < Duration::from_secs(10));
    // The robot loses its channel and reconnects while the host opens sixteen more.
    let mut more = Vec::new();
    for _ in 0..16 {
        let mut s = tcp_from("127.0.0.2", grpc).await;
        let _ = s
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
            .await;
        more.push(s);
    }
    drop(robot);
    let mut again = client(grpc).await;
    assert_eq!(set_up_and_act(&mut again, &MOTORS, 1).await, 10.0);
}

/// Issue 49, item 3: fifteen connections from one host, each making one refused `Ready` every
/// few seconds (never idle), used to keep a robot that lost its channel from reconnecting.
#[tokio::test]
async fn refused_calls_from_one_host_do_not_keep_the_robot_from_reconnecting() {
    let (server, grpc) = serve("takeover_after_s = 30").await;
    let mut robot = client(grpc).await;
    assert_eq!(set_up_and_act(&mut robot, &MOTORS, 0).await, 10.0);
    // Each keeps its connection (and its refused calls) going, as the reported pattern did.
    let mut squatters = Vec::new();
    for _ in 0..15 {
        let mut c = client_from("127.0.0.2", grpc).await;
        match tokio::time::timeout(Duration::from_secs(2), c.ready(Empty {})).await {
            Ok(Err(e)) if e.code() == Code::PermissionDenied => {}
            // Closed at accept (its address's share is taken): the call fails otherwise.
            Ok(Err(e)) => assert_ne!(e.code(), Code::Ok, "{e:?}"),
            Ok(Ok(_)) => panic!("a squatter's Ready was accepted"),
            Err(_) => {}
        }
        squatters.push(c);
    }
    assert!(server.stats.metrics.lerobot_refusals("peer_share") >= 7);
    // The robot's channel breaks; a new one from its address gets a slot and its session.
    drop(robot);
    let mut again = client(grpc).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match set_up(&mut again, setup(&MOTORS, &[4, 6, 3])).await {
            Ok(()) => break,
            Err(e) => {
                assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
                assert!(Instant::now() < deadline, "the robot never got back in");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    observe(&mut again, &observation(1, (4, 6), |_| {}))
        .await
        .expect("observation");
    assert_eq!(first_action(&mut again).await, 10.0);
}

/// Issue 49, item 5, the first squat: the robot's connection closes and a peer from another
/// address calls `Ready`: refused for lerobot.owner_grace_s, so the robot that comes back gets
/// its session; after the grace the other address may start a session of its own.
#[tokio::test]
async fn another_address_cannot_squat_the_session_its_owner_just_left() {
    let (_server, grpc) = serve("takeover_after_s = 1\nowner_grace_s = 3").await;
    let mut robot = client(grpc).await;
    assert_eq!(set_up_and_act(&mut robot, &MOTORS, 0).await, 10.0);
    drop(robot);
    let mut squatter = client_from("127.0.0.2", grpc).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let reversed: Vec<&str> = MOTORS.iter().rev().copied().collect();
    for _ in 0..5 {
        let e = set_up(&mut squatter, setup(&reversed, &[4, 6, 3]))
            .await
            .expect_err("the owner's address may still claim it");
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
        assert!(e.message().contains("lerobot.owner_grace_s"), "{e:?}");
        let e = squatter
            .get_actions(Empty {})
            .await
            .expect_err("not its session");
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The robot comes back within the grace: its session, its motor order.
    let mut back = client(grpc).await;
    assert_eq!(set_up_and_act(&mut back, &MOTORS, 1).await, 10.0);
    let e = squatter
        .ready(Empty {})
        .await
        .expect_err("the robot is active");
    assert_eq!(e.code(), Code::PermissionDenied);
    // Once the robot has gone for longer than the grace, the other address may take over.
    drop(back);
    tokio::time::sleep(Duration::from_millis(3300)).await;
    assert_eq!(set_up_and_act(&mut squatter, &reversed, 2).await, 60.0);
}

/// Issue 49, item 5, the second squat: from the robot's own address, a `GetActions` loop
/// adopts the session once the robot's connection is gone (a reconnect); the robot's new
/// `Ready` wins over it, and the poller is refused from then on.
#[tokio::test]
async fn a_poller_on_the_robots_host_cannot_keep_the_robot_out() {
    let (_server, grpc) = serve("takeover_after_s = 1").await;
    let mut robot = client(grpc).await;
    assert_eq!(set_up_and_act(&mut robot, &MOTORS, 0).await, 10.0);
    drop(robot);
    let mut poller = client(grpc).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while poller.get_actions(Empty {}).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "the poll never adopted the session"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let polling = tokio::spawn(async move {
        let end = Instant::now() + Duration::from_secs(3);
        let mut refused = 0;
        while Instant::now() < end {
            if poller.get_actions(Empty {}).await.is_err() {
                refused += 1;
            }
        }
        refused
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The robot comes back while the poller keeps polling: its Ready wins at once.
    let mut back = client(grpc).await;
    assert_eq!(set_up_and_act(&mut back, &MOTORS, 1).await, 10.0);
    observe(&mut back, &observation(2, (4, 6), |_| {}))
        .await
        .expect("the robot's observation");
    assert_eq!(first_action(&mut back).await, 10.0);
    assert!(
        polling.await.expect("the poller") > 0,
        "the poller was never refused"
    );
}

/// A PR #3048 payload: the JSON's length (big-endian u32), the JSON, then a safetensors file.
fn json_payload(meta: serde_json::Value, tensors: &[(&str, &[usize], &[u8])]) -> Vec<u8> {
    let json = meta.to_string().into_bytes();
    let mut out = (json.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(&json);
    if !tensors.is_empty() {
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .map(|(name, shape, data)| {
                let view = safetensors::tensor::TensorView::new(
                    safetensors::Dtype::U8,
                    shape.to_vec(),
                    data,
                )
                .expect("a tensor view");
                (name.to_string(), view)
            })
            .collect();
        out.extend_from_slice(&safetensors::serialize(views, None).expect("safetensors"));
    }
    out
}

/// [`setup`] as a PR #3048 client sends it.
fn json_setup() -> Vec<u8> {
    json_payload(
        serde_json::json!({
            "type": "RemotePolicyConfig",
            "policy_type": "act",
            "pretrained_name_or_path": "default",
            "actions_per_chunk": 10,
            "device": "cpu",
            "lerobot_features": {
                "observation.state": {"dtype": "float32", "shape": [6], "names": MOTORS},
                "observation.images.front": {"dtype": "image", "shape": [4, 6, 3]},
            },
        }),
        &[],
    )
}

/// [`observation`] as a PR #3048 client sends it: motor `i` reads `10·(i + 1)`.
fn json_observation(step: i64) -> Vec<u8> {
    let scalars: serde_json::Map<String, serde_json::Value> = MOTORS
        .iter()
        .enumerate()
        .map(|(i, m)| (m.to_string(), serde_json::json!(10.0 * (i + 1) as f64)))
        .collect();
    json_payload(
        serde_json::json!({
            "type": "TimedObservation",
            "timestamp": 1.0e9 + step as f64,
            "timestep": step,
            "must_go": true,
            "scalar_data": scalars,
        }),
        &[("front", &[4, 6, 3], &[7u8; 4 * 6 * 3])],
    )
}

/// The first action's first value of the next chunk, a PR #3048 reply (`action_0`, float32).
async fn first_json_action(c: &mut AsyncInferenceClient<Channel>) -> f32 {
    let data = next_chunk(c).await;
    assert_ne!(data[0], 0x80, "a JSON client got a pickle");
    let n = u32::from_be_bytes(data[..4].try_into().expect("4 bytes")) as usize;
    let tensors = safetensors::SafeTensors::deserialize(&data[4 + n..]).expect("safetensors");
    let a0 = tensors.tensor("action_0").expect("action_0");
    f32::from_le_bytes(a0.data()[..4].try_into().expect("4 bytes"))
}

/// A server whose config a test can change and reload (as SIGHUP does), with the LeRobot
/// service on `grpc`.
struct Reloadable {
    text: std::sync::Arc<std::sync::Mutex<String>>,
    reload: tokio::sync::mpsc::Sender<()>,
    /// The WebSocket listener (its `/metrics`).
    addr: SocketAddr,
    _stop: tokio::sync::oneshot::Sender<()>,
}

fn config_text(grpc: SocketAddr, warmup_runs: u32) -> String {
    format!(
        "[server]\nhost = \"127.0.0.1\"\nport = 0\n\
         [engine]\nmodel = \"synthetic\"\nwarmup_runs = {warmup_runs}\n\
         [pacing]\nfps = 30\n\
         [[inputs]]\nkey = \"observation.state\"\ntensor = \"state\"\ndtypes = [\"float32\"]\nshape = [6]\n\
         [[inputs]]\nkey = \"observation.images.front\"\ntensor = \"front\"\ndtypes = [\"uint8\"]\nshape = [4, 6, 3]\n\
         [[outputs]]\ntensor = \"actions\"\n\
         [lerobot]\nlisten = \"{grpc}\"\nmax_payload_bytes = 2097152\n"
    )
}

async fn serve_reloadable(grpc: SocketAddr) -> Reloadable {
    use policyd::config::{Config, PolicySpec};
    use policyd::engine::{Engine, EngineError};
    use policyd::policy::OpenFn;
    use std::sync::{Arc, Mutex};
    let text = config_text(grpc, 1);
    let cfg = Config::parse(&text, "test", None).expect("config");
    let open: Arc<OpenFn> = Arc::new(|_: &PolicySpec| -> Result<Box<dyn Engine>, EngineError> {
        Ok(Box::new(policyd::testing::synthetic::SyntheticEngine::new(
            io(),
            Behaviour::default(),
        )))
    });
    let set =
        tokio::task::block_in_place(|| policyd::policy::build::build(&cfg, None, open.as_ref()))
            .expect("builds")
            .set;
    let listener = policyd::net::server::bind(&cfg).await.expect("bind");
    let addr = listener.local_addr().expect("bound address");
    let text = Arc::new(Mutex::new(text));
    let source = text.clone();
    let (reload, requests) = tokio::sync::mpsc::channel(4);
    let reloader = policyd::policy::reload::Reloader {
        load: Arc::new(move || Config::parse(&source.lock().expect("lock"), "test", None)),
        requests,
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let access = policyd::net::Access::load(&cfg).expect("access");
    tokio::spawn(policyd::net::server::serve_set(
        cfg,
        access,
        Arc::new(arc_swap::ArcSwap::from_pointee(set)),
        Arc::new(policyd::metrics::Stats::new()),
        listener,
        async {
            let _ = stopped.await;
        },
        Some((reloader, open)),
    ));
    let deadline = Instant::now() + Duration::from_secs(60);
    while tokio::net::TcpStream::connect(grpc).await.is_err() {
        assert!(Instant::now() < deadline, "the gRPC port never opened");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Reloadable {
        text,
        reload,
        addr,
        _stop: stop,
    }
}

/// Issue 51's bug: a reload that replaced the policy's engine rebuilt the session's adapter
/// without the client's payload format, so a JSON + safetensors client had every observation
/// refused ("set up with pickle payloads") until it set up again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_client_keeps_its_format_across_a_reload() {
    let grpc = free_port();
    let server = serve_reloadable(grpc).await;
    let mut robot = client(grpc).await;
    set_up(&mut robot, json_setup())
        .await
        .expect("a JSON setup");
    observe(&mut robot, &json_observation(0))
        .await
        .expect("a JSON observation");
    assert_eq!(first_json_action(&mut robot).await, 10.0);
    // Another warm-up count: the policy's engine is rebuilt, and the session follows it.
    let reloaded = "policyd_config_reloads_total{result=\"ok\"} 1";
    assert!(
        !common::http_get(server.addr, "/metrics", "")
            .await
            .contains(reloaded)
    );
    *server.text.lock().expect("lock") = config_text(grpc, 2);
    server.reload.send(()).await.expect("reload request");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !common::http_get(server.addr, "/metrics", "")
        .await
        .contains(reloaded)
    {
        assert!(Instant::now() < deadline, "no reload");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The session moves to the new engine once nothing is in flight (the observation's start
    // waits for that); each observation after it must still be read as JSON.
    for step in 1..4 {
        if let Err(e) = observe(&mut robot, &json_observation(step)).await {
            panic!("observation {step} after the reload refused: {e}");
        }
        assert_eq!(first_json_action(&mut robot).await, 10.0);
    }
}
