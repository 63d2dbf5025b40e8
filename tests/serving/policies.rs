//! Several policies on one server: chosen by path and by a `policy` field, reloaded on request
//! (as SIGHUP does) while clients keep sending, checked against the memory budget, and
//! sessions reset when their prompt changes. Synthetic engines: each policy's action chunk has
//! its own shape, so a reply tells which policy served it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use futures_util::{SinkExt, StreamExt};
use policyd::config::{Config, PolicySpec};
use policyd::dtype::ElemType;
use policyd::engine::{Engine, EngineError, IoSpec, TensorSpec};
use policyd::metrics::Stats;
use policyd::policy::reload::Reloader;
use policyd::policy::{self, OpenFn};
use policyd::protocol::Encoder;
use policyd::testing::synthetic::{Behaviour, SyntheticEngine};
use rmpv::Value;
use tokio::sync::{mpsc, oneshot};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

use crate::common;
use common::Ws;

const VLLM: &str = "/v1/realtime/robot/openpi";

/// The action chunk each model file name gives: `a` 10×7, `b` 5×3, `c` 4×2.
fn chunk(c: &PolicySpec) -> [usize; 2] {
    match c.model.describe().as_str() {
        "b.onnx" => [5, 3],
        "c.onnx" => [4, 2],
        _ => [10, 7],
    }
}

fn io(c: &PolicySpec) -> IoSpec {
    let t = |name: &str, dtype, shape: &[usize]| TensorSpec {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
    };
    let [h, d] = chunk(c);
    let mut inputs = vec![t("state", ElemType::F32, &[1, 8])];
    if c.inputs.iter().any(|b| b.key == "prompt") {
        inputs.push(t("prompt", ElemType::I64, &[1, 16]));
    }
    IoSpec {
        inputs,
        outputs: vec![t("actions", ElemType::F32, &[1, h, d])],
    }
}

/// A policy table: `name`, model file, extra keys.
fn policy(name: &str, model: &str, extra: &str) -> String {
    format!(
        "[[policies]]\nname = \"{name}\"\n{extra}\n[policies.engine]\nmodel = \"{model}\"\n\
         warmup_runs = 1\n\
         [[policies.inputs]]\nkey = \"state\"\ntensor = \"state\"\ndtypes = [\"float64\"]\nshape = [8]\n\
         [[policies.outputs]]\ntensor = \"actions\"\n\
         [policies.metadata]\nrobot = \"{name}\"\n"
    )
}

fn config(policies: &[String]) -> String {
    format!(
        "[server]\nhost = \"127.0.0.1\"\nport = 0\n{}",
        policies.concat()
    )
}

struct Server {
    addr: std::net::SocketAddr,
    /// The config text a reload reads.
    text: Arc<Mutex<String>>,
    /// Policies whose engine was opened, in order.
    opens: Arc<Mutex<Vec<String>>>,
    reload: mpsc::Sender<()>,
    _stop: oneshot::Sender<()>,
}

fn opener(opens: Arc<Mutex<Vec<String>>>) -> Arc<OpenFn> {
    Arc::new(
        move |c: &PolicySpec| -> Result<Box<dyn Engine>, EngineError> {
            opens.lock().expect("lock").push(c.name.clone());
            let b = Behaviour {
                compute: Duration::from_millis(2),
                ..Default::default()
            };
            Ok(Box::new(SyntheticEngine::new(io(c), b)))
        },
    )
}

async fn start(text: &str) -> Server {
    let cfg = Config::parse(text, "test", None).expect("config");
    let opens = Arc::new(Mutex::new(Vec::new()));
    let open = opener(opens.clone());
    let set = tokio::task::block_in_place(|| policy::build::build(&cfg, None, open.as_ref()))
        .expect("builds")
        .set;
    let listener = policyd::net::server::bind(&cfg).await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let text = Arc::new(Mutex::new(text.to_string()));
    let source = text.clone();
    let (reload, requests) = mpsc::channel(4);
    let reloader = Reloader {
        load: Arc::new(move || Config::parse(&source.lock().expect("lock"), "test", None)),
        requests,
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let access = policyd::net::Access::load(&cfg).expect("access");
    tokio::spawn(policyd::net::server::serve_set(
        cfg,
        access,
        Arc::new(ArcSwap::from_pointee(set)),
        Arc::new(Stats::new()),
        listener,
        async {
            let _ = stopped.await;
        },
        Some((reloader, open)),
    ));
    Server {
        addr,
        text,
        opens,
        reload,
        _stop: stop,
    }
}

impl Server {
    fn opened(&self) -> Vec<String> {
        self.opens.lock().expect("lock").clone()
    }

    async fn metrics(&self) -> String {
        common::http_get(self.addr, "/metrics", "").await
    }

    /// Writes a new config and reloads; waits until the reload counter `result` moved.
    async fn reload_with(&self, text: &str, result: &str) {
        let line = |n: usize| format!("policyd_config_reloads_total{{result=\"{result}\"}} {n}");
        let before = (0..100)
            .find(|n| self.metrics_now().contains(&line(*n)))
            .expect("a reload counter");
        *self.text.lock().expect("lock") = text.to_string();
        self.reload.send(()).await.expect("reload request");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.metrics().await.contains(&line(before + 1)) {
            assert!(Instant::now() < deadline, "no {result} reload");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn metrics_now(&self) -> String {
        tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(self.metrics()))
    }
}

fn request(policy: Option<&str>, prompt: Option<&str>, observe: Option<i64>) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut e = Encoder { buf: &mut buf };
    let n = 1
        + u32::from(policy.is_some())
        + u32::from(prompt.is_some())
        + 3 * u32::from(observe.is_some());
    e.map(n);
    e.str("state");
    e.ndarray(ElemType::F64, &[8], 64, |d| d.fill(0));
    if let Some(p) = policy {
        e.str("policy");
        e.str(p);
    }
    if let Some(p) = prompt {
        e.str("prompt");
        e.str(p);
    }
    if let Some(t) = observe {
        e.str("endpoint");
        e.str("observe");
        e.str("timestep");
        e.int(t);
        e.str("timestamp");
        e.f64(t as f64 / 30.0);
    }
    buf
}

/// What came back: a decoded reply, an error text (openpi closes after it) or a close.
#[derive(Debug)]
enum Got {
    Reply(Value),
    Error(String),
    Closed(Option<CloseCode>),
}

async fn next(ws: &mut Ws) -> Got {
    loop {
        match tokio::time::timeout(Duration::from_secs(10), ws.next()).await {
            Ok(Some(Ok(Message::Binary(b)))) => {
                return Got::Reply(rmpv::decode::read_value(&mut &b[..]).expect("msgpack"));
            }
            Ok(Some(Ok(Message::Text(t)))) => return Got::Error(t.to_string()),
            Ok(Some(Ok(Message::Close(f)))) => return Got::Closed(f.map(|f| f.code)),
            Ok(Some(Ok(_))) => continue,
            Ok(None) | Ok(Some(Err(_))) => return Got::Closed(None),
            Err(_) => panic!("no answer within 10 s"),
        }
    }
}

/// The action chunk's shape in a reply, as msgpack prints it (`[5, 3]`).
fn shape(v: &Value) -> String {
    let s = v.to_string();
    ["[10, 7]", "[5, 3]", "[4, 2]", "[2, 3]"]
        .into_iter()
        .find(|p| s.contains(p))
        .unwrap_or("?")
        .to_string()
}

async fn ask(ws: &mut Ws, frame: Vec<u8>) -> Got {
    ws.send(Message::binary(frame)).await.expect("sends");
    next(ws).await
}

async fn connect(addr: std::net::SocketAddr, path: &str) -> (Ws, Value) {
    let (mut ws, _) = tokio_tungstenite::connect_async(format!("ws://{addr}{path}"))
        .await
        .expect("connects");
    let Got::Reply(meta) = next(&mut ws).await else {
        panic!("no metadata frame")
    };
    (ws, meta)
}

fn reply_shape(g: &Got) -> String {
    match g {
        Got::Reply(v) => shape(v),
        other => panic!("expected a reply, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_policies_chosen_by_path_and_by_field() {
    let text = config(&[
        policy("arm", "a.onnx", ""),
        policy("gripper", "b.onnx", "default = true"),
    ]);
    let srv = start(&text).await;
    // The default policy, and its metadata.
    let (mut ws, meta) = connect(srv.addr, "/").await;
    assert!(meta.to_string().contains("\"gripper\""), "{meta}");
    assert_eq!(
        reply_shape(&ask(&mut ws, request(None, None, None)).await),
        "[5, 3]"
    );
    // By path: that policy's metadata and engine.
    let (mut arm, meta) = connect(srv.addr, "/policies/arm").await;
    assert!(meta.to_string().contains("\"arm\""), "{meta}");
    assert_eq!(
        reply_shape(&ask(&mut arm, request(None, None, None)).await),
        "[10, 7]"
    );
    // vllm-omni under the policy's path: a bare array.
    let (mut v, _) = connect(srv.addr, &format!("/policies/arm{VLLM}")).await;
    let Got::Reply(bare) = ask(&mut v, request(None, None, None)).await else {
        panic!("no reply")
    };
    // vllm-omni's reply is the bare array (no `actions` key, no timing).
    let text = bare.to_string();
    assert!(
        !text.contains("timing") && shape(&bare) == "[10, 7]",
        "{text}"
    );
    // By field: the connection moves to the named policy and stays there.
    assert_eq!(
        reply_shape(&ask(&mut ws, request(Some("arm"), None, None)).await),
        "[10, 7]"
    );
    assert_eq!(
        reply_shape(&ask(&mut ws, request(None, None, None)).await),
        "[10, 7]"
    );
    assert_eq!(
        reply_shape(&ask(&mut ws, request(Some("gripper"), None, None)).await),
        "[5, 3]"
    );
    // Unknown names: 404 at the handshake, an error listing the names in a frame.
    let refused = common::http_get(
        srv.addr,
        "/policies/nope",
        "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n",
    )
    .await;
    assert!(refused.starts_with("HTTP/1.1 404"), "{refused}");
    assert!(refused.contains("arm, gripper"), "{refused}");
    let Got::Error(e) = ask(&mut ws, request(Some("nope"), None, None)).await else {
        panic!("no error")
    };
    assert!(
        e.contains("no policy named \"nope\"") && e.contains("arm, gripper"),
        "{e}"
    );
    assert_eq!(srv.opened(), ["arm", "gripper"]);
}

/// A client that sends requests back to back until told to stop, counting replies and
/// anything else.
fn client(
    addr: std::net::SocketAddr,
    path: &'static str,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<(usize, Vec<String>, Option<CloseCode>)> {
    tokio::spawn(async move {
        let (mut ws, _) = connect(addr, path).await;
        let (mut ok, mut shapes) = (0, Vec::new());
        while !stop.load(Ordering::SeqCst) {
            match ask(&mut ws, request(None, None, None)).await {
                Got::Reply(v) if v.is_map() => {
                    ok += 1;
                    let s = shape(&v);
                    if shapes.last() != Some(&s) {
                        shapes.push(s);
                    }
                }
                Got::Closed(code) => return (ok, shapes, code),
                other => panic!("{path}: a request failed: {other:?}"),
            }
        }
        (ok, shapes, None)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reloads_keep_unchanged_policies_swap_changed_ones_and_refuse_broken_configs() {
    let a = policy("arm", "a.onnx", "");
    let b = policy("gripper", "b.onnx", "");
    let srv = start(&config(&[a.clone(), b.clone()])).await;
    let stop = Arc::new(AtomicBool::new(false));
    let on_a = client(srv.addr, "/", stop.clone());
    let on_b = client(srv.addr, "/policies/gripper", stop.clone());
    tokio::time::sleep(Duration::from_millis(100)).await;

    // Unchanged: nothing is reloaded.
    srv.reload_with(&config(&[a.clone(), b.clone()]), "ok")
        .await;
    assert_eq!(srv.opened(), ["arm", "gripper"]);

    // gripper changed (2 actions per chunk): only its engine is loaded again, and its
    // clients move to it between requests.
    let b2 = policy("gripper", "b.onnx", "actions_per_chunk = 2");
    srv.reload_with(&config(&[a.clone(), b2.clone()]), "ok")
        .await;
    assert_eq!(srv.opened(), ["arm", "gripper", "gripper"]);
    tokio::time::sleep(Duration::from_millis(100)).await;

    // Broken: refused, reported, and the running set keeps serving.
    let broken = config(&[
        a.clone(),
        b2.replace("dtypes = [\"float64\"]", "dtypes = [\"float99\"]"),
    ]);
    srv.reload_with(&broken, "refused").await;
    let m = srv.metrics().await;
    assert!(m.contains("policyd_config_reload_error{error="), "{m}");
    assert!(m.contains("float99"), "{m}");
    let unloadable = config(&[
        a.clone(),
        policy("gripper", "c.onnx", "")
            .replace("tensor = \"actions\"", "tensor = \"no_such_output\""),
    ]);
    srv.reload_with(&unloadable, "refused").await;
    assert!(srv.metrics().await.contains("no_such_output"));
    assert_eq!(srv.opened(), ["arm", "gripper", "gripper", "gripper"]);
    tokio::time::sleep(Duration::from_millis(100)).await;

    // gripper removed: its connection is closed with 1001 after its request is answered;
    // a good reload clears the error.
    srv.reload_with(&config(std::slice::from_ref(&a)), "ok")
        .await;
    let (ok_b, shapes_b, code) = tokio::time::timeout(Duration::from_secs(10), on_b)
        .await
        .expect("the removed policy's client is closed")
        .expect("client task");
    assert_eq!(code, Some(CloseCode::Away));
    assert!(ok_b > 10);
    assert_eq!(
        shapes_b,
        ["[5, 3]", "[2, 3]"],
        "the change reached the gripper client"
    );
    assert!(!srv.metrics().await.contains("policyd_config_reload_error"));
    let m = srv.metrics().await;
    assert!(m.contains("policyd_policy{policy=\"arm\""), "{m}");
    assert!(!m.contains("policy=\"gripper\""), "{m}");

    stop.store(true, Ordering::SeqCst);
    let (ok_a, shapes_a, code) = on_a.await.expect("client task");
    assert_eq!(code, None, "the kept policy's client was never closed");
    assert!(ok_a > 10);
    assert_eq!(shapes_a, ["[10, 7]"]);
    assert_eq!(srv.opened(), ["arm", "gripper", "gripper", "gripper"]);
}

#[test]
fn a_set_over_the_memory_budget_is_refused_naming_the_policies() {
    let text = |budget: u64| {
        config(&[
            policy("arm", "a.onnx", ""),
            policy("gripper", "b.onnx", ""),
            policy("wrist", "c.onnx", ""),
        ])
        .replace(
            "port = 0",
            &format!("port = 0\nmemory_budget_mb = {budget}"),
        )
    };
    let opens = Arc::new(Mutex::new(Vec::new()));
    let open = opener(opens);
    // Each policy's connection buffers are about 4 MiB; counted once, the set needs ~40 MiB.
    let cfg = Config::parse(&text(16), "test", None).expect("config");
    let err = match policy::build::build(&cfg, None, open.as_ref()) {
        Ok(_) => panic!("a set over budget was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("server.memory_budget_mb"), "{err}");
    for name in ["arm", "gripper", "wrist"] {
        assert!(err.contains(name), "{err}");
    }
    let cfg = Config::parse(&text(1024), "test", None).expect("config");
    let built = policy::build::build(&cfg, None, open.as_ref()).expect("fits");
    let one = built.set.policies[0].budget.clone();
    assert!(
        built.set.budget < 3 * one.total,
        "connection buffers counted once: {} vs {}",
        built.set.budget,
        one.total
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_prompt_resets_the_session_when_configured() {
    let with_prompt = |name: &str, reset: bool| {
        policy(name, "a.onnx", &format!("reset_on_prompt_change = {reset}")).replace(
            "[[policies.outputs]]",
            "[[policies.inputs]]\nkey = \"prompt\"\ntensor = \"prompt\"\ndtypes = [\"text\"]\n\
             shape = [16]\n[[policies.outputs]]",
        )
    };
    let text = config(&[with_prompt("resets", true), with_prompt("keeps", false)])
        + "[pacing]\nreport_skipped = true\n";
    let srv = start(&text).await;
    for (path, resets) in [("/policies/resets", true), ("/policies/keeps", false)] {
        let (mut ws, _) = connect(srv.addr, path).await;
        let observe = |prompt: &str| request(None, Some(prompt), Some(5));
        let kind = |g: &Got| match g {
            Got::Reply(v) => {
                if v.to_string().contains("\"skipped\"") {
                    "skipped"
                } else {
                    "actions"
                }
            }
            other => panic!("{other:?}"),
        };
        assert_eq!(kind(&ask(&mut ws, observe("pick")).await), "actions");
        // Timestep 5 was predicted already: skipped, unless a new prompt reset the session.
        assert_eq!(kind(&ask(&mut ws, observe("pick")).await), "skipped");
        let after = kind(&ask(&mut ws, observe("place")).await);
        assert_eq!(after == "actions", resets, "{path}");
    }
}

#[test]
fn policy_lists_are_checked() {
    let err = |t: String| Config::parse(&t, "test", None).unwrap_err().to_string();
    let a = policy("arm", "a.onnx", "");
    assert!(err(config(&[a.clone(), a.clone()])).contains("policies[1].name"));
    let two_defaults = config(&[
        policy("x", "a.onnx", "default = true"),
        policy("y", "b.onnx", "default = true"),
    ]);
    assert!(err(two_defaults).contains("x, y"));
    assert!(err(config(&[policy("a b", "a.onnx", "")])).contains("policies[0].name"));
    let bad_binding = config(&[
        a.clone(),
        policy("g", "b.onnx", "").replace("float64", "float99"),
    ]);
    let e = err(bad_binding);
    assert!(
        e.contains("policies[1].inputs[0].dtypes") && e.contains("\"g\""),
        "{e}"
    );
    let top = format!(
        "[engine]\nmodel = \"m.onnx\"\n{}",
        config(std::slice::from_ref(&a))
    );
    assert!(err(top).contains("with [[policies]]"));
    // One config per policy, the marked default first in line for clients.
    let cfg = Config::parse(
        &config(&[
            a.clone(),
            policy("g", "b.onnx", "default = true\nactions_per_chunk = 3"),
        ]),
        "test",
        None,
    )
    .expect("parses");
    let per = &cfg.policies;
    assert_eq!(per.len(), 2);
    assert_eq!(cfg.default, 1);
    assert_eq!(cfg.default_policy().name, "g");
    assert!(per[1].is_default && !per[0].is_default);
    assert_eq!(per[1].pacing.actions_per_chunk, 3);
    assert_eq!(per[0].pacing.actions_per_chunk, 0);
}

/// The running binary: SIGHUP re-reads its config file (what `systemctl reload` does).
#[test]
fn sighup_reloads_the_config_file_of_the_running_binary() {
    let dir = std::env::temp_dir().join(format!("policyd-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("policyd.toml");
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/models/tiny.onnx");
    let tiny = |name: &str| {
        format!(
            "[[policies]]\nname = \"{name}\"\n[policies.engine]\nmodel = \"{model}\"\n\
             warmup_runs = 1\n\
             [[policies.inputs]]\nkey = \"observation/state\"\ntensor = \"state\"\n\
             dtypes = [\"float32\", \"float64\"]\nshape = [8]\n\
             [[policies.outputs]]\ntensor = \"actions\"\n"
        )
    };
    let head = format!("[server]\nhost = \"127.0.0.1\"\nport = {port}\n");
    std::fs::write(&file, format!("{head}{}", tiny("one"))).expect("config");
    let mut cmd = common::policyd_command();
    let mut child = std::process::Command::new(cmd.remove(0))
        .args(cmd)
        .arg("--config")
        .arg(&file)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("policyd runs");
    let get = |path: &str| common::http_get_blocking(port, path);
    let wait = |what: &str, cond: &dyn Fn(&str) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let m = get("/metrics");
            if cond(&m) {
                return m;
            }
            assert!(Instant::now() < deadline, "{what}; last /metrics:\n{m}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let hup = |pid: u32| {
        // SAFETY: kill(2) on our own child's pid (still running: it serves /metrics).
        assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGHUP) }, 0);
    };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        wait("serving", &|m| m.contains("policyd_policy{policy=\"one\""));
        std::fs::write(&file, format!("{head}{}{}", tiny("one"), tiny("two"))).expect("config");
        hup(child.id());
        wait("the second policy after SIGHUP", &|m| {
            m.contains("policyd_policy{policy=\"two\"")
                && m.contains("policyd_config_reloads_total{result=\"ok\"} 1")
        });
        std::fs::write(
            &file,
            format!("{head}{}", tiny("one").replace("[8]", "[9]")),
        )
        .expect("config");
        hup(child.id());
        let m = wait("the broken config refused", &|m| {
            m.contains("policyd_config_reloads_total{result=\"refused\"} 1")
        });
        assert!(m.contains("policyd_config_reload_error{error="), "{m}");
        assert!(
            m.contains("policyd_policy{policy=\"two\""),
            "still serving both:\n{m}"
        );
        assert!(get("/healthz").starts_with("HTTP/1.1 200"));
    }));
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}
