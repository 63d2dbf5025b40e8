//! Steady-state heap allocations, counted by a global allocator.
//!
//! - policyd's own request path (decode → session and filters → scheduler → engine worker →
//!   mailbox → encode), with an allocation-free synthetic engine: must be zero.
//! - The CPU engine (tract) and the whole server over a real socket (tungstenite and tokio
//!   included) are measured and printed per request, for the notes; they are not policyd's
//!   own code. Run with `--nocapture` to see the numbers.
//!
//! One test function, so that nothing else runs in this process while it counts; each count
//! is the fewest of three runs (see `fewest`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use policyd::bind::ReplyParts;
use policyd::config::Config;
use policyd::demo;
use policyd::dtype::ElemType;
use policyd::engine::{IoSpec, TensorSpec};
use policyd::protocol::lerobot;

mod common;
use policyd::protocol::{Dialect, Encoder, SessionId, Timing};
use policyd::runtime::pacing::Pacer;
use policyd::runtime::scheduler::{Kind, SessionKey};
use policyd::runtime::session::Filters;
use policyd::runtime::session::Sessions;
use policyd::runtime::worker::{ReplyPort, Ticket};
use policyd::testing::synthetic::{Behaviour, SyntheticEngine};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.realloc(p, l, n) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.load(Ordering::Relaxed)
}

const CONFIG: &str = r#"
[server]
host = "127.0.0.1"
port = 0
[engine]
model = "synthetic"
slots = 2
warmup_runs = 1
[pacing]
similarity_atol = 0.001
similarity_key = "state"
[[inputs]]
key = "state"
tensor = "state"
dtypes = ["float64", "float32"]
shape = [8]
[[inputs]]
key = "gripper"
tensor = "gripper"
dtypes = ["float64", "float32"]
shape = []
optional = true
[[outputs]]
tensor = "actions"
mean = [0.5]
std = [2.0]
"#;

fn io() -> IoSpec {
    let t = |name: &str, shape: &[usize]| TensorSpec {
        name: name.into(),
        dtype: ElemType::F32,
        shape: shape.to_vec(),
    };
    IoSpec {
        inputs: vec![t("state", &[1, 8]), t("gripper", &[1])],
        outputs: vec![t("actions", &[1, 10, 7])],
    }
}

/// An observation: `state` as an f64 array, `gripper` as a native msgpack float, a prompt,
/// and, for `observe`, its timing keys.
fn frame(i: usize, observe: bool) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut e = Encoder { buf: &mut buf };
    e.map(if observe { 6 } else { 3 });
    e.str("state");
    e.ndarray(ElemType::F64, &[8], 64, |d| {
        for (k, c) in d.chunks_exact_mut(8).enumerate() {
            c.copy_from_slice(&((i * 8 + k) as f64).to_le_bytes());
        }
    });
    e.str("gripper");
    e.f64(0.25);
    e.str("prompt");
    e.str("pick up the cube");
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

/// policyd's own path, driven the way a connection drives it.
async fn own_path(n: usize) -> u64 {
    let cfg = Config::parse(CONFIG, "test", None).unwrap();
    let engine = Box::new(SyntheticEngine::new(io(), Behaviour::default()));
    let loaded = policyd::policy::build::load_engine(&cfg, cfg.default_policy(), engine).unwrap();
    let (plan, worker) = (&loaded.plan, &loaded.worker);
    let port = ReplyPort::new(&worker.pool);
    let pacer = Pacer::start(policyd::runtime::pacing::DEFAULT_SPIN).unwrap();
    let wake = std::sync::Arc::new(tokio::sync::Notify::new());
    let mut sessions = Box::new(Sessions::new(16, 100));
    let filters = Filters {
        skip_predicted_timesteps: true,
        similarity_atol: cfg.default_policy().pacing.similarity_atol,
    };
    let frames: Vec<(Vec<u8>, bool)> = (0..64)
        .map(|i| (frame(i, i % 2 == 1), i % 2 == 1))
        .collect();
    let mut sids = Vec::new();
    for name in ["left", "right", "default"] {
        let mut s = SessionId::new();
        s.push_str(name).unwrap();
        sids.push(s);
    }
    let mut run = async |count: usize, timestep_base: usize| {
        for i in 0..count {
            let (bytes, observe) = &frames[i % frames.len()];
            let mut lease = worker.pool.acquire().await;
            let (pacer, wake, port) = (&pacer, &wake, &port);
            let slot = lease.slot();
            let (inputs, seen) = slot.inputs_mut();
            let meta = plan.decode(bytes, inputs, seen).unwrap();
            let sid = &sids[i % sids.len()];
            let (reset, pacing) = sessions.begin(Some(sid));
            if *observe {
                let mut state = [0f64; policyd::limits::MAX_SIMILARITY_STATE];
                let state = plan.similarity_state(slot.inputs_mut().0, &mut state);
                let ts = (timestep_base + i) as i64;
                let _ = pacing.admit(&filters, ts, false, state);
                meta.observed_at().unwrap();
            }
            let ticket = Ticket {
                kind: if *observe { Kind::Observe } else { Kind::Infer },
                epoch: 0,
                session: sessions.current().clone(),
                received: Instant::now(),
                release_at: None,
                timestep: i as i64,
                timestamp: 0.0,
            };
            slot.prepare(ticket, reset);
            let key = SessionKey {
                conn: 1,
                session: slot.ticket().session.clone(),
            };
            assert!(lease.submit(worker, port, key).is_ok());
            let mut back = port.recv().await;
            pacer.wake_at(Instant::now(), wake);
            let slot = back.slot();
            let t = slot.ticket().clone();
            let pacing = sessions.pacing(&t.session).unwrap();
            pacing.record_latency(t.received.elapsed().as_secs_f64());
            let d = pacing.delay_steps(30.0);
            let policyd::runtime::worker::SlotParts {
                outputs,
                scratch,
                reply,
                raw,
            } = slot.reply_parts(plan.relative_source);
            let mut parts = ReplyParts {
                outputs,
                scratch,
                chunk: plan.chunk(&cfg.default_policy().pacing, d),
                raw,
            };
            if *observe {
                Dialect::Openpi.encode_observe(
                    &mut plan.reply(&mut parts),
                    policyd::protocol::TimedStep {
                        timestep: t.timestep,
                        timestamp: 0.5,
                    },
                    1.0 / 30.0,
                    d,
                    reply,
                );
            } else {
                let timing = Timing {
                    policy_infer_ms: 1.0,
                    server_infer_ms: 2.0,
                    prev_total_ms: Some(3.0),
                    stages: None,
                };
                Dialect::Openpi.encode_infer(&mut plan.reply(&mut parts), &timing, Some(d), reply);
            }
            assert!(slot.reply().len() > 100);
        }
    };
    run(200, 0).await;
    let before = allocs();
    run(n, 1_000_000).await;
    allocs() - before
}

/// Allocations of one tract run of the ALOHA demo, after warm-up.
fn cpu_engine_per_run(n: u64) -> f64 {
    let cfg = demo::config().unwrap();
    let mut engine = policyd::engine::open(cfg.default_policy()).unwrap();
    let mut inputs = engine.alloc_inputs().unwrap();
    let mut outputs = common::output_buffers(engine.as_ref());
    for _ in 0..3 {
        engine.run(&mut inputs, &mut outputs, false).unwrap();
    }
    let before = allocs();
    for _ in 0..n {
        engine.run(&mut inputs, &mut outputs, false).unwrap();
    }
    (allocs() - before) as f64 / n as f64
}

/// Rust-side allocations of one run on the `ort` backend (onnxruntime's own C++ allocations
/// are not seen by this allocator; docs/onnxruntime.md has them), after warm-up: `config`
/// (configs/NAME.toml) moved to ort. `None` where no library is given (see common).
#[cfg(feature = "ort")]
fn ort_engine_per_run(config: &str, n: u64) -> Option<f64> {
    let lib = common::ort_library()?;
    let text = common::ort_config(config, &lib, "");
    let cfg = policyd::config::Config::parse(&text, "test", None).unwrap();
    let mut engine = policyd::engine::open(cfg.default_policy()).unwrap();
    // Two slots' buffers, alternated as the worker does: rebinding is part of the path.
    let mut slots = [
        engine.alloc_inputs().unwrap(),
        engine.alloc_inputs().unwrap(),
    ];
    let mut outputs = common::output_buffers(engine.as_ref());
    let sampling = |i: u64| policyd::engine::Sampling {
        seed: i,
        steps: 1 + (i % 10) as u32,
    };
    for i in 0..4 {
        engine
            .run_sampled(
                &mut slots[i % 2],
                &mut outputs,
                false,
                sampling(i as u64),
                None,
            )
            .unwrap();
    }
    let before = allocs();
    for i in 0..n {
        engine
            .run_sampled(
                &mut slots[(i % 2) as usize],
                &mut outputs,
                false,
                sampling(i),
                None,
            )
            .unwrap();
    }
    Some((allocs() - before) as f64 / n as f64)
}

/// A masked client frame.
fn client_frame(payload: &[u8]) -> Vec<u8> {
    let mask = [1u8, 2, 3, 4];
    let mut f = vec![0x82];
    if payload.len() < 126 {
        f.push(0x80 | payload.len() as u8);
    } else {
        f.push(0x80 | 126);
        f.extend_from_slice(&(payload.len() as u16).to_be_bytes());
    }
    f.extend_from_slice(&mask);
    f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    f
}

/// Reads one server frame into `buf` (preallocated; allocation-free); returns its length.
async fn read_frame(tcp: &mut tokio::net::TcpStream, buf: &mut [u8]) -> usize {
    let mut h = [0u8; 2];
    tcp.read_exact(&mut h).await.unwrap();
    let len = match h[1] & 0x7f {
        126 => {
            let mut e = [0u8; 2];
            tcp.read_exact(&mut e).await.unwrap();
            u16::from_be_bytes(e) as usize
        }
        127 => {
            let mut e = [0u8; 8];
            tcp.read_exact(&mut e).await.unwrap();
            u64::from_be_bytes(e) as usize
        }
        n => n as usize,
    };
    tcp.read_exact(&mut buf[..len]).await.unwrap();
    len
}

/// Allocations per request of the whole server (policyd, tungstenite, tokio) over loopback,
/// with an allocation-free raw client.
async fn server_per_request(n: u64) -> f64 {
    let cfg = Config::parse(CONFIG, "test", None).unwrap();
    let engine = Box::new(SyntheticEngine::new(io(), Behaviour::default()));
    let loaded = policyd::policy::build::load_engine(&cfg, cfg.default_policy(), engine).unwrap();
    let listener = policyd::net::server::bind(&cfg).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let srv = tokio::spawn(async move {
        let _ = policyd::net::server::serve(cfg, loaded, listener, async {
            let _ = rx.await;
        })
        .await;
    });
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    tcp.write_all(
        b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
          Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
    )
    .await
    .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        tcp.read_exact(&mut byte).await.unwrap();
        head.push(byte[0]);
    }
    let mut buf = vec![0u8; 1 << 16];
    read_frame(&mut tcp, &mut buf).await; // metadata
    let requests: Vec<Vec<u8>> = (0..8).map(|i| client_frame(&frame(i, false))).collect();
    let mut go = async |count: u64| {
        for i in 0..count {
            tcp.write_all(&requests[i as usize % requests.len()])
                .await
                .unwrap();
            let len = read_frame(&mut tcp, &mut buf).await;
            assert!(len > 100);
        }
    };
    go(200).await;
    let before = allocs();
    go(n).await;
    let per = (allocs() - before) as f64 / n as f64;
    let _ = tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(5), srv).await;
    per
}

/// The engine thread's first loop allocates its thread-locals: lets it pass first.
fn wait_for_engine_thread(loaded: &policyd::policy::build::Loaded) {
    let t0 = Instant::now();
    while loaded
        .worker
        .state
        .beats
        .load(std::sync::atomic::Ordering::Relaxed)
        < 2
        && t0.elapsed() < Duration::from_secs(5)
    {
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Decoding with the task planner on: the subtask fills the prompt (a pointer load) and a
/// camera frame is copied into the planner's preallocated buffer whenever it asks.
fn planner_path(n: usize) -> u64 {
    let text = r#"
[engine]
model = "synthetic"
[[inputs]]
key = "prompt"
tensor = "prompt"
dtypes = ["text"]
shape = [32]
[[inputs]]
key = "cam"
tensor = "cam"
dtypes = ["uint8"]
shape = [8, 8, 3]
[[outputs]]
tensor = "actions"
[planner]
enabled = true
endpoints = ["http://127.0.0.1:9"]
model = "m"
camera = "cam"
"#;
    let cfg = Config::parse(text, "test", None).unwrap();
    let t = |name: &str, dtype, shape: &[usize]| TensorSpec {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
    };
    let io = IoSpec {
        inputs: vec![
            t("prompt", ElemType::I64, &[1, 32]),
            t("cam", ElemType::F32, &[1, 8, 8, 3]),
        ],
        outputs: vec![t("actions", ElemType::F32, &[1, 10, 7])],
    };
    let engine = Box::new(SyntheticEngine::new(io, Behaviour::default()));
    let loaded = policyd::policy::build::load_engine(&cfg, cfg.default_policy(), engine).unwrap();
    let plan = &loaded.plan;
    wait_for_engine_thread(&loaded);
    let link = plan.planner.as_ref().unwrap().link(&cfg.planner);
    link.publish(&policyd::planner::reply::Answer {
        subtask: "pick up the red cup".into(),
        done: false,
    });
    let mut frame = Vec::new();
    let mut e = Encoder { buf: &mut frame };
    e.map(1);
    e.str("cam");
    e.ndarray(ElemType::U8, &[8, 8, 3], 192, |d| d.fill(9));
    let mut lease = loaded.worker.pool.try_acquire().unwrap();
    let slot = lease.slot();
    // Warm-up: arc-swap gives each thread its debt list on its first load.
    let (inputs, seen) = slot.inputs_mut();
    plan.decode_with(&frame, inputs, seen, Some(&link)).unwrap();

    let before = allocs();
    for _ in 0..n {
        link.want_frame();
        let (inputs, seen) = slot.inputs_mut();
        plan.decode_with(&frame, inputs, seen, Some(&link)).unwrap();
    }
    allocs() - before
}

/// Decoding and tokenizing a prompt that stays the same (the session's token cache answers):
/// pi0, and pi0.5 with a state that moves within its bins and has no engine input of its own.
/// Returns the allocations and how many times the prompt was really tokenized.
fn prompt_path(n: usize, pi05: bool) -> (u64, usize) {
    let format = if pi05 {
        "format = \"pi05\"\nstate_key = \"state\""
    } else {
        "format = \"pi0\""
    };
    let state_tensor = if pi05 { "" } else { "tensor = \"state\"" };
    let text = format!(
        r#"
[engine]
model = "synthetic"
[[inputs]]
key = "state"
{state_tensor}
dtypes = ["float64"]
shape = [8]
[[inputs]]
key = "prompt"
tensor = "ids"
dtypes = ["text"]
[inputs.tokenizer]
file = "models/tokenizer/bpe.model"
max_tokens = 48
mask_tensor = "mask"
{format}
[[outputs]]
tensor = "actions"
"#
    );
    let cfg = Config::parse(&text, "test", None).unwrap();
    let t = |name: &str, dtype, shape: &[usize]| TensorSpec {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
    };
    let mut inputs = vec![
        t("ids", ElemType::I32, &[1, 48]),
        t("mask", ElemType::Bool, &[1, 48]),
    ];
    if !pi05 {
        inputs.push(t("state", ElemType::F32, &[1, 8]));
    }
    let io = IoSpec {
        inputs,
        outputs: vec![t("actions", ElemType::F32, &[1, 10, 7])],
    };
    let engine = Box::new(SyntheticEngine::new(io, Behaviour::default()));
    let loaded = policyd::policy::build::load_engine(&cfg, cfg.default_policy(), engine).unwrap();
    let plan = &loaded.plan;
    wait_for_engine_thread(&loaded);
    // State values that stay in their pi0.5 bins (width 1/128) as they move.
    let frames: Vec<Vec<u8>> = (0..4)
        .map(|i| {
            let mut buf = Vec::new();
            let mut e = Encoder { buf: &mut buf };
            e.map(2);
            e.str("state");
            e.ndarray(ElemType::F64, &[8], 64, |d| {
                for (k, c) in d.chunks_exact_mut(8).enumerate() {
                    // Bin 16k + 0, 0.4 to 0.6 of the way across it.
                    let v = -1.0 + (16.0 * k as f64 + 0.4) / 128.0 + i as f64 * 0.0005;
                    c.copy_from_slice(&v.to_le_bytes());
                }
            });
            e.str("prompt");
            e.str("put the black bowl in the bottom drawer of the cabinet and close it");
            buf
        })
        .collect();
    let mut cache = policyd::bind::PromptCache::default();
    let mut lease = loaded.worker.pool.try_acquire().unwrap();
    let slot = lease.slot();
    let mut encoded = 0;
    let mut step = |i: usize| {
        let (inputs, seen) = slot.inputs_mut();
        plan.decode(&frames[i % frames.len()], inputs, seen)
            .unwrap();
        let t = plan.tokenize(inputs, &mut cache).unwrap();
        encoded += usize::from(t.encoded);
    };
    step(0);
    let before = allocs();
    for i in 0..n {
        step(i);
    }
    (allocs() - before, encoded)
}

/// A pipeline of synthetic engines for `text`'s `[sampler]`: a prefix from an 8-float state to
/// 4 features, and a step graph over a `[1, 16, 2]` sample whose time input is `time` and
/// whose output is named `out`.
fn synthetic_pipeline(
    text: &str,
    time: ElemType,
    out: &str,
) -> policyd::engine::pipeline::Pipeline {
    let cfg = Config::parse(text, "test", None).unwrap();
    let t = |name: &str, dtype, shape: &[usize]| TensorSpec {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
    };
    let engine = |inputs, outputs| {
        Box::new(SyntheticEngine::new(
            IoSpec { inputs, outputs },
            Behaviour::default(),
        ))
    };
    let prefix = engine(
        vec![t("state", ElemType::F32, &[1, 8])],
        vec![t("features", ElemType::F32, &[1, 4])],
    );
    let step = engine(
        vec![
            t("feat", ElemType::F32, &[1, 4]),
            t("x", ElemType::F32, &[1, 16, 2]),
            t("t", time, &[1]),
        ],
        vec![t(out, ElemType::F32, &[1, 16, 2])],
    );
    let spec = cfg.default_policy().pipeline.clone().unwrap();
    policyd::engine::pipeline::Pipeline::new(prefix, step, &spec).unwrap()
}

/// A pipeline's request (the prefix once, then the sampler's loop over the step graph, with
/// seeded noise), synthetic engines on both sides, seeds and step counts changing.
fn pipeline_path(n: usize) -> u64 {
    use policyd::engine::{Engine, Sampling};
    let text = r#"
[engine]
model = "prefix.onnx"
[denoise]
model = "step.onnx"
wire = { feat = "features" }
[sampler]
kind = "ddpm"
num_train_timesteps = 100
beta_schedule = "squaredcos_cap_v2"
steps = 10
max_steps = 100
x = "x"
time = "t"
output = "eps"
[[inputs]]
key = "state"
tensor = "state"
dtypes = ["float32"]
shape = [8]
[[outputs]]
tensor = "x"
"#;
    let mut p = synthetic_pipeline(text, ElemType::I64, "eps");
    let mut inputs = p.alloc_inputs().unwrap();
    let mut outputs = vec![vec![0u8; 128]];
    let mut go = |i: usize| {
        let sampling = Sampling {
            seed: i as u64,
            steps: 1 + (i % 20) as u32,
        };
        p.run_sampled(&mut inputs, &mut outputs, false, sampling, None)
            .unwrap();
    };
    go(0);
    let before = allocs();
    for i in 0..n {
        go(i);
    }
    allocs() - before
}

/// `[rtc]`: a flow pipeline continuing a leftover (LeRobot's guidance, or GR00T's
/// inpainting), its rows and delay changing, and a session's chunk kept and cut each request.
fn rtc_path(n: usize, groot: bool) -> u64 {
    use policyd::engine::{Continuation, Engine, Sampling};
    use policyd::rtc::{Previous, Request};
    let text = format!(
        r#"
[engine]
model = "prefix.onnx"
[denoise]
model = "step.onnx"
wire = {{ feat = "features" }}
[sampler]
kind = "flow"
steps = 10
max_steps = 20
x = "x"
time = "t"
output = "v"
flow_time = "{}"
[rtc]
execution_horizon = 8
[[inputs]]
key = "state"
tensor = "state"
dtypes = ["float32"]
shape = [8]
[[outputs]]
tensor = "x"
"#,
        if groot { "groot" } else { "lerobot" }
    );
    let time = if groot { ElemType::I64 } else { ElemType::F32 };
    let mut p = synthetic_pipeline(&text, time, "v");
    let mut inputs = p.alloc_inputs().unwrap();
    let mut outputs = vec![vec![0u8; 128]];
    let mut previous = Previous::with_capacity(32);
    let mut leftover = vec![0f32; 32];
    let mut go = |i: usize| {
        previous.capture(&outputs[0], 2, 1, 16, i as i64);
        let rows = previous.leftover(i as i64 + 1 + (i % 7) as i64, 2, 8, &mut leftover);
        let continues = Continuation {
            leftover: &leftover,
            request: Request { rows, delay: i % 5 },
        };
        let sampling = Sampling {
            seed: i as u64,
            steps: 1 + (i % 10) as u32,
        };
        p.run_sampled(&mut inputs, &mut outputs, false, sampling, Some(continues))
            .unwrap();
    };
    go(0);
    let before = allocs();
    for i in 0..n {
        go(i);
    }
    allocs() - before
}

/// Decoding with per-session `history` (a Diffusion Policy's `n_obs_steps`), four sessions
/// interleaved on one connection: each session's frame buffer is allocated at its first
/// request, then only copied into.
fn history_path(n: usize) -> u64 {
    let text = r#"
[engine]
model = "m.onnx"
[[inputs]]
key = "observation.state"
tensor = "state"
dtypes = ["float32"]
shape = [8]
history = 2
min = [-1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0]
max = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
[[outputs]]
tensor = "action"
rows = [1, 9]
"#;
    let cfg = Config::parse(text, "test", None).unwrap();
    let io = IoSpec {
        inputs: vec![TensorSpec {
            name: "state".into(),
            dtype: ElemType::F32,
            shape: vec![1, 2, 8],
        }],
        outputs: vec![TensorSpec {
            name: "action".into(),
            dtype: ElemType::F32,
            shape: vec![1, 16, 2],
        }],
    };
    let plan = policyd::bind::Plan::compile(&cfg, cfg.default_policy(), &io).unwrap();
    let mut bufs: Vec<Box<dyn policyd::engine::InputBuffer>> =
        vec![Box::new(policyd::engine::HostBuffer(vec![0; 64]))];
    let mut seen = vec![false];
    let ids: Vec<SessionId> = (0..4)
        .map(|i| SessionId::try_from(format!("s{i}").as_str()).unwrap())
        .collect();
    let frames: Vec<Vec<u8>> = (0..4)
        .map(|i| {
            let mut buf = Vec::new();
            let mut e = Encoder { buf: &mut buf };
            e.map(1);
            e.str("observation.state");
            e.ndarray(ElemType::F32, &[8], 32, |d| d.fill(i as u8));
            buf
        })
        .collect();
    let mut sessions = Sessions::new(8, 8);
    let mut go = |i: usize| {
        plan.decode(&frames[i % 4], &mut bufs, &mut seen).unwrap();
        let id = Some(&ids[i % 4]);
        let (fresh, _) = sessions.begin(id);
        plan.stack_history(&mut bufs, sessions.history(id), fresh);
    };
    for i in 0..4 {
        go(i);
    }
    let before = allocs();
    for i in 0..n {
        go(i);
    }
    allocs() - before
}

/// LeRobot's gRPC route below tonic: a real client's pickled observation (6 motors, a 4×6
/// camera resized to the policy's 2×3, the task) read by the strict reader and bound into a
/// slot's inputs by the adapter made at setup.
fn lerobot_path(n: usize) -> u64 {
    let text = r#"
[engine]
model = "m.onnx"
[[inputs]]
key = "observation.state"
tensor = "state"
dtypes = ["float32"]
shape = [6]
[[inputs]]
key = "observation.images.front"
tensor = "front"
dtypes = ["uint8"]
shape = [2, 3, 3]
[[inputs]]
key = "task"
tensor = "task"
dtypes = ["text"]
shape = [32]
[[outputs]]
tensor = "action"
"#;
    let cfg = Config::parse(text, "test", None).unwrap();
    let spec = |name: &str, dtype, shape: Vec<usize>| TensorSpec {
        name: name.into(),
        dtype,
        shape,
    };
    let io = IoSpec {
        inputs: vec![
            spec("state", ElemType::F32, vec![1, 6]),
            spec("front", ElemType::U8, vec![1, 2, 3, 3]),
            spec("task", ElemType::U8, vec![1, 32]),
        ],
        outputs: vec![spec("action", ElemType::F32, vec![1, 10, 6])],
    };
    let plan = policyd::bind::Plan::compile(&cfg, cfg.default_policy(), &io).unwrap();
    let fixture = |name: &str| {
        std::fs::read(format!(
            "{}/tests/fixtures/lerobot/{name}.pkl",
            env!("CARGO_MANIFEST_DIR")
        ))
        .unwrap()
    };
    let config = fixture("config");
    let (setup, mut format) = lerobot::ClientFormat::read_setup(&config).unwrap();
    let mut adapter = policyd::bind::lerobot::Adapter::new(
        policyd::config::LerobotResize::Bilinear,
        32 << 20,
        &plan,
        "default",
        &setup,
    )
    .unwrap();
    let mut bufs: Vec<Box<dyn policyd::engine::InputBuffer>> = [24, 18, 32]
        .into_iter()
        .map(|n| Box::new(policyd::engine::HostBuffer(vec![0; n])) as _)
        .collect();
    let mut seen = vec![false; 3];
    let payload = fixture("observation_p4");
    let mut go = || {
        let meta = adapter
            .decode(&mut format, &payload, &plan, &mut bufs, &mut seen)
            .unwrap();
        assert_eq!(meta.timestep, Some(7));
    };
    go();
    let before = allocs();
    for _ in 0..n {
        go();
    }
    allocs() - before
}

/// The fewest allocations of three runs. The counter sees every thread of the process, so a
/// one-off allocation elsewhere (a runtime thread's first park, a thread-local) can land in
/// one window; a path that allocates per request, or every few hundred, shows in all three.
fn fewest(runs: [u64; 3]) -> u64 {
    runs.into_iter().min().unwrap_or(u64::MAX)
}

#[test]
fn steady_state_allocations() {
    // First, while no other thread runs in this process.
    let planner = [planner_path(1000), planner_path(1000), planner_path(1000)];
    println!("decoding with the planner on: {planner:?} allocations over 1000 requests (3 runs)");
    let pipeline = [0; 3].map(|_| pipeline_path(1000));
    println!(
        "pipeline (DDPM, 1-20 steps, new seed each): {pipeline:?} allocations over 1000 requests (3 runs)"
    );
    assert_eq!(
        fewest(pipeline),
        0,
        "a pipeline's request allocated: {pipeline:?}"
    );
    for groot in [false, true] {
        let rtc = [0; 3].map(|_| rtc_path(1000, groot));
        println!(
            "RTC (groot: {groot}; a leftover kept, cut and continued): {rtc:?} allocations over 1000 requests (3 runs)"
        );
        assert_eq!(fewest(rtc), 0, "a continued chunk allocated: {rtc:?}");
    }
    let lerobot = [0; 3].map(|_| lerobot_path(1000));
    println!(
        "LeRobot observation (pickle read, 6 motors, a resized camera, task): {lerobot:?} allocations over 1000 requests (3 runs)"
    );
    assert_eq!(
        fewest(lerobot),
        0,
        "reading and binding a LeRobot observation allocated: {lerobot:?}"
    );
    let history = [0; 3].map(|_| history_path(1000));
    println!(
        "history (n_obs_steps 2, 4 sessions): {history:?} allocations over 1000 requests (3 runs)"
    );
    assert_eq!(
        fewest(history),
        0,
        "stacking a session's frames allocated: {history:?}"
    );
    for pi05 in [false, true] {
        let runs = [0; 3].map(|_| prompt_path(1000, pi05));
        println!(
            "tokenized prompt (pi05: {pi05}), unchanged: {runs:?} (allocations, tokenizations) over 1000 requests (3 runs)"
        );
        assert!(
            runs.iter().all(|&(_, encoded)| encoded == 1),
            "an unchanged prompt was tokenized again: {runs:?}"
        );
        assert_eq!(
            fewest(runs.map(|(a, _)| a)),
            0,
            "decoding an unchanged tokenized prompt allocated: {runs:?}"
        );
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let own = [
        rt.block_on(own_path(1000)),
        rt.block_on(own_path(1000)),
        rt.block_on(own_path(1000)),
    ];
    println!("policyd's own path: {own:?} allocations over 1000 requests (3 runs)");
    let tract = cpu_engine_per_run(50);
    println!("CPU engine (tract, ALOHA demo): {tract:.1} allocations per run");
    #[cfg(feature = "ort")]
    for config in ["aloha", "flow", "diffusion"] {
        if let Some(per_run) = ort_engine_per_run(config, 200) {
            println!("ort engine (configs/{config}.toml): {per_run:.2} allocations per run");
            assert_eq!(
                per_run, 0.0,
                "a run on ort allocated (configs/{config}.toml)"
            );
        }
    }
    let whole = rt.block_on(server_per_request(1000));
    println!("whole server over a socket (synthetic engine): {whole:.2} allocations per request");
    assert_eq!(
        fewest(own),
        0,
        "policyd's own request path allocated: {own:?}"
    );
    assert_eq!(
        fewest(planner),
        0,
        "the planner's side of the request path allocated: {planner:?}"
    );
}
