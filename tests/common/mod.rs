//! What several integration tests share: a server on loopback with a synthetic engine (state
//! [8] in, a [10, 7] action chunk out, compute time and failures set by a `Behaviour`), a
//! client connection that has read the metadata frame, a raw HTTP GET, and the command that
//! runs the policyd binary.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;

use futures_util::StreamExt;
use policyd::config::Config;
use policyd::dtype::ElemType;
use policyd::engine::{IoSpec, TensorSpec};
use policyd::metrics::Stats;
use policyd::runtime::worker::SlotPool;
use policyd::testing::synthetic::{Behaviour, SyntheticEngine};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio_tungstenite::tungstenite::Message;

/// An SO-101's motor keys, as LeRobot's robot_client sends them (the order of its
/// `observation.state` names).
pub const MOTORS: [&str; 6] = [
    "shoulder_pan.pos",
    "shoulder_lift.pos",
    "elbow_flex.pos",
    "wrist_flex.pos",
    "wrist_roll.pos",
    "gripper.pos",
];

/// Action chunk rows and columns of the synthetic engine.
pub const H: usize = 10;
pub const D: usize = 7;

/// A config for the synthetic engine on a free loopback port: `server`, `engine` and
/// `pacing` keys are added to their tables; `state` takes float64 and float32.
pub fn synthetic_config(server: &str, engine: &str, pacing: &str) -> Config {
    let text = format!(
        "[server]\nhost = \"127.0.0.1\"\nport = 0\n{server}\n\
         [engine]\nmodel = \"synthetic\"\nwarmup_runs = 1\n{engine}\n\
         [pacing]\n{pacing}\n\
         [[inputs]]\nkey = \"state\"\ntensor = \"state\"\ndtypes = [\"float64\", \"float32\"]\nshape = [8]\n\
         [[outputs]]\ntensor = \"actions\"\n"
    );
    Config::parse(&text, "test", None).expect("test config")
}

fn io() -> IoSpec {
    IoSpec {
        inputs: vec![TensorSpec {
            name: "state".into(),
            dtype: ElemType::F32,
            shape: vec![1, 8],
        }],
        outputs: vec![TensorSpec {
            name: "actions".into(),
            dtype: ElemType::F32,
            shape: vec![1, H, D],
        }],
    }
}

/// A server serving on its own task until dropped.
pub struct Running {
    pub addr: SocketAddr,
    pub stats: Arc<Stats>,
    pub pool: Arc<SlotPool>,
    stop: Option<oneshot::Sender<()>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

/// Starts `cfg` with a synthetic engine behaving as `behaviour`, on the current runtime.
pub async fn start(cfg: Config, behaviour: Behaviour) -> Running {
    start_io(cfg, io(), behaviour).await
}

/// [`start`] with the synthetic engine's inputs and outputs given.
pub async fn start_io(cfg: Config, io: IoSpec, behaviour: Behaviour) -> Running {
    let engine = Box::new(SyntheticEngine::new(io, behaviour));
    let loaded =
        policyd::policy::build::load_engine(&cfg, cfg.default_policy(), engine).expect("loads");
    let stats = loaded.stats.clone();
    let pool = loaded.worker.pool.clone();
    let listener = policyd::net::server::bind(&cfg).await.expect("bind");
    let addr = listener.local_addr().expect("bound address");
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let _ = policyd::net::server::serve(cfg, loaded, listener, async {
            let _ = rx.await;
        })
        .await;
    });
    Running {
        addr,
        stats,
        pool,
        stop: Some(tx),
    }
}

pub type Ws = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<TcpStream>>;

/// A WebSocket connection to `path` that has read its metadata frame.
pub async fn connect(addr: SocketAddr, path: &str) -> Ws {
    let (mut ws, _) = tokio_tungstenite::connect_async(format!("ws://{addr}{path}"))
        .await
        .expect("connects");
    assert!(matches!(ws.next().await, Some(Ok(Message::Binary(_)))));
    ws
}

/// A plain HTTP GET with extra header lines (each ending in `\r\n`); the whole response.
pub async fn http_get(addr: SocketAddr, path: &str, headers: &str) -> String {
    let mut tcp = TcpStream::connect(addr).await.expect("connects");
    tcp.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n{headers}\r\n").as_bytes())
        .await
        .expect("writes");
    let mut resp = String::new();
    tcp.read_to_string(&mut resp).await.expect("reads");
    resp
}

/// A plain HTTP GET to `127.0.0.1:port` from a blocking test (a policyd binary it started);
/// the whole response, or empty if nothing listens there yet.
pub fn http_get_blocking(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return String::new();
    };
    let _ = s.set_read_timeout(Some(std::time::Duration::from_secs(10)));
    let _ = write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

/// A raw WebSocket opening handshake for `/` (RFC 6455's sample key).
pub const UPGRADE: &[u8] =
    b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
      Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n";

/// The command that runs the policyd binary: the binary itself, after the emulator when the
/// tests run under one (`POLICYD_CROSS_RUNNER`, set by cross/env.sh for qemu-aarch64).
pub fn policyd_command() -> Vec<std::ffi::OsString> {
    // Only policyd's own tests have the policyd binary (policyd-bench's reuse this file).
    let Some(bin) = option_env!("CARGO_BIN_EXE_policyd") else {
        panic!("policyd_command is for the policyd package's tests");
    };
    command(bin)
}

/// `bin`, after the emulator when the tests run under one.
pub fn command(bin: &str) -> Vec<std::ffi::OsString> {
    let runner = std::env::var("POLICYD_CROSS_RUNNER").unwrap_or_default();
    runner
        .split_whitespace()
        .chain([bin])
        .map(Into::into)
        .collect()
}

/// The onnxruntime library the `ort` tests load (`POLICYD_TEST_ORT_LIBRARY`, which
/// scripts/test sets from its venv's PyPI wheel). Unset, the test is skipped with a note, unless
/// `POLICYD_REQUIRE_ORT` is set (as in scripts/test), where that is a failure.
pub fn ort_library() -> Option<std::path::PathBuf> {
    match std::env::var_os("POLICYD_TEST_ORT_LIBRARY") {
        Some(p) if !p.is_empty() => Some(p.into()),
        _ if std::env::var_os("POLICYD_REQUIRE_ORT").is_some() => {
            panic!("POLICYD_REQUIRE_ORT is set but POLICYD_TEST_ORT_LIBRARY is not")
        }
        _ => {
            eprintln!(
                "skipped: set POLICYD_TEST_ORT_LIBRARY to a libonnxruntime.so (pip install onnxruntime)"
            );
            None
        }
    }
}

/// configs/`name`.toml as text, its `../` paths made absolute (so it parses from anywhere).
pub fn demo_config_text(name: &str) -> String {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(root.join(format!("configs/{name}.toml")))
        .expect("a demo config")
        .replace("\"../", &format!("\"{}/", root.display()))
}

/// configs/`name`.toml on the ort backend with the library `lib` and `extra` `[engine]` lines.
pub fn ort_config(name: &str, lib: &std::path::Path, extra: &str) -> String {
    demo_config_text(name).replacen(
        "backend = \"cpu\"",
        &format!(
            "backend = \"ort\"\nort_library = \"{}\"{extra}",
            lib.display()
        ),
        1,
    )
}

/// One zeroed buffer per engine output, sized as the model declares.
pub fn output_buffers(engine: &dyn policyd::engine::Engine) -> Vec<Vec<u8>> {
    engine
        .io()
        .outputs
        .iter()
        .map(|s| vec![0u8; s.bytes()])
        .collect()
}

/// One run of `spec`'s engine on patterned inputs (small float32 values whatever the element
/// type: a pattern, not noise): its backend and the outputs' bytes.
pub fn patterned_run(spec: &policyd::config::PolicySpec) -> (&'static str, Vec<Vec<u8>>) {
    let mut engine = policyd::engine::open(spec).expect("the engine opens");
    let mut inputs = engine.alloc_inputs().expect("inputs");
    for (i, b) in inputs.iter_mut().enumerate() {
        for (j, byte) in b.bytes_mut().iter_mut().enumerate() {
            *byte = if j % 4 == 3 {
                0x3e
            } else {
                ((i * 31 + j * 7) % 251) as u8
            };
        }
    }
    let mut outputs = output_buffers(engine.as_ref());
    engine
        .run(&mut inputs, &mut outputs, false)
        .expect("the run");
    (engine.backend(), outputs)
}
