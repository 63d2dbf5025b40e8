//! The task planner against a real local HTTP server started by the test: an OpenAI-style
//! chat-completions endpoint answering from a script (valid JSON, fenced JSON, think blocks,
//! garbage, slow answers, 500s, going away). Checks each path of the planner loop, the
//! supervised model server, and that action replies keep their latency while the planner's
//! endpoint hangs.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use policyd::config::{PlannerConfig, Secret};
use policyd::planner::reply::Answer;
use policyd::planner::{Geometry, Link, Planner};

use crate::common;

/// What the fake endpoint does with one chat request.
#[derive(Clone, Debug)]
enum Reply {
    /// 200 with this message content.
    Content(String),
    /// This status, with a short error body.
    Status(u16),
    /// Says nothing for this long, then closes.
    Hang(Duration),
    /// Answers with this content after this long.
    Slow(Duration, String),
}

/// A chat request the fake endpoint received.
#[derive(Clone, Debug)]
struct Seen {
    authorization: Option<String>,
    body: serde_json::Value,
}

/// A local OpenAI-compatible endpoint: chat answers come from `script`, then `fallback`;
/// `GET /v1/models` answers 200 while `models_ok`.
#[derive(Clone)]
struct FakeVlm {
    addr: SocketAddr,
    script: Arc<Mutex<VecDeque<Reply>>>,
    fallback: Arc<Mutex<Reply>>,
    models_ok: Arc<AtomicBool>,
    chats: Arc<Mutex<Vec<Seen>>>,
    probes: Arc<AtomicUsize>,
    in_flight: Arc<AtomicUsize>,
    gone: Arc<AtomicBool>,
}

impl FakeVlm {
    fn start(script: Vec<Reply>, fallback: Reply) -> FakeVlm {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let f = FakeVlm {
            addr: listener.local_addr().expect("addr"),
            script: Arc::new(Mutex::new(script.into())),
            fallback: Arc::new(Mutex::new(fallback)),
            models_ok: Arc::new(AtomicBool::new(true)),
            chats: Arc::default(),
            probes: Arc::default(),
            in_flight: Arc::default(),
            gone: Arc::default(),
        };
        let me = f.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if me.gone.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let me = me.clone();
                std::thread::spawn(move || me.handle(conn));
            }
        });
        f
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops listening: later connections are refused.
    fn go_away(&self) {
        self.gone.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
    }

    fn chats(&self) -> Vec<Seen> {
        self.chats.lock().expect("lock").clone()
    }

    fn handle(&self, mut conn: TcpStream) {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        let head_end = loop {
            if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break p + 4;
            }
            match conn.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
        let header = |name: &str| {
            head.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
            })
        };
        let len: usize = header("content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        while buf.len() < head_end + len {
            match conn.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let (status, body) = if head.starts_with("GET /v1/models") {
            self.probes.fetch_add(1, Ordering::SeqCst);
            if self.models_ok.load(Ordering::SeqCst) {
                (
                    200,
                    r#"{"object":"list","data":[{"id":"vlm"}]}"#.to_string(),
                )
            } else {
                (503, r#"{"error":"loading"}"#.to_string())
            }
        } else if head.starts_with("POST /v1/chat/completions") {
            let body = serde_json::from_slice(&buf[head_end..head_end + len])
                .unwrap_or(serde_json::Value::Null);
            self.chats.lock().expect("lock").push(Seen {
                authorization: header("authorization"),
                body,
            });
            let next = self.script.lock().expect("lock").pop_front();
            let mut reply = next.unwrap_or_else(|| self.fallback.lock().expect("lock").clone());
            if let Reply::Slow(d, c) = reply {
                std::thread::sleep(d);
                reply = Reply::Content(c);
            }
            match reply {
                Reply::Content(c) => (
                    200,
                    serde_json::json!({
                        "id": "x", "object": "chat.completion",
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": c}}]
                    })
                    .to_string(),
                ),
                Reply::Status(s) => (s, r#"{"error":"scripted"}"#.to_string()),
                Reply::Slow(..) => unreachable!("answered above"),
                Reply::Hang(d) => {
                    self.in_flight.fetch_add(1, Ordering::SeqCst);
                    std::thread::sleep(d);
                    self.in_flight.fetch_sub(1, Ordering::SeqCst);
                    return;
                }
            }
        } else {
            (404, "{}".to_string())
        };
        let _ = write!(
            conn,
            "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n{body}",
            body.len()
        );
    }
}

fn cfg(endpoints: &[&FakeVlm]) -> PlannerConfig {
    PlannerConfig {
        enabled: true,
        endpoints: endpoints.iter().map(|f| f.url()).collect(),
        model: "vlm".into(),
        instruction: "tidy the table".into(),
        rate_hz: 20.0,
        request_timeout_s: 2.0,
        ..Default::default()
    }
}

fn json(subtask: &str) -> String {
    format!(r#"{{"subtask": "{subtask}", "done": false}}"#)
}

fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn subtask(link: &Link) -> Option<String> {
    link.subtask().as_deref().cloned()
}

fn count(v: &std::sync::atomic::AtomicU64) -> u64 {
    v.load(Ordering::SeqCst)
}

#[test]
fn json_fenced_json_and_think_blocks_each_set_the_subtask() {
    let vlm = FakeVlm::start(
        vec![
            Reply::Content(json("open the drawer")),
            Reply::Content(format!(
                "Here you go:\n```json\n{}\n```",
                json("take the cup")
            )),
            Reply::Content(format!(
                "<think>The {{cup}} is out; \"subtask\" next</think>\n{}",
                json("close the drawer")
            )),
        ],
        Reply::Hang(Duration::from_secs(30)),
    );
    let mut c = cfg(&[&vlm]);
    c.api_key = Some(Secret("sk-test".into()));
    c.max_tokens = 77;
    c.temperature = 0.25;
    let link = Arc::new(Link::new(&c, None, 64));
    let mut seen = Vec::new();
    let _p = Planner::start(&c, c.api_key.clone(), link.clone()).expect("starts");
    wait_for("three subtasks", Duration::from_secs(10), || {
        if let Some(s) = subtask(&link)
            && seen.last() != Some(&s)
        {
            seen.push(s);
        }
        seen.len() == 3
    });
    assert_eq!(
        seen,
        ["open the drawer", "take the cup", "close the drawer"]
    );
    assert_eq!(count(&link.health.ok), 3);
    assert_eq!(count(&link.health.retries), 0);
    let chats = vlm.chats();
    let first = &chats[0];
    assert_eq!(first.authorization.as_deref(), Some("Bearer sk-test"));
    let b = &first.body;
    assert_eq!(b["model"], "vlm");
    assert_eq!(b["max_tokens"], 77);
    assert_eq!(b["temperature"], 0.25);
    assert_eq!(b["response_format"]["type"], "json_object");
    let system = b["messages"][0]["content"].as_str().expect("system text");
    assert!(system.contains("tidy the table"), "{system}");
    // The second call tells the model what the current subtask is.
    let user = chats[1].body["messages"][1]["content"].to_string();
    assert!(user.contains("open the drawer"), "{user}");
}

#[test]
fn garbage_then_valid_on_the_corrective_retry() {
    let vlm = FakeVlm::start(
        vec![
            Reply::Content("I think the robot should grab it.".into()),
            Reply::Content(json("grab the sponge")),
        ],
        Reply::Hang(Duration::from_secs(30)),
    );
    let c = cfg(&[&vlm]);
    let link = Arc::new(Link::new(&c, None, 64));
    let _p = Planner::start(&c, c.api_key.clone(), link.clone()).expect("starts");
    wait_for("the subtask", Duration::from_secs(10), || {
        subtask(&link).is_some()
    });
    assert_eq!(subtask(&link).as_deref(), Some("grab the sponge"));
    assert_eq!(count(&link.health.retries), 1);
    assert_eq!(count(&link.health.parse_failures), 0);
    let retry = &vlm.chats()[1].body["messages"];
    let msgs = retry.as_array().expect("messages");
    assert_eq!(
        msgs.len(),
        4,
        "the bad answer and a correction are appended"
    );
    assert_eq!(msgs[2]["role"], "assistant");
    let correction = msgs[3]["content"].as_str().expect("text");
    assert!(correction.contains("no JSON object"), "{correction}");
}

#[test]
fn garbage_twice_keeps_the_previous_subtask_and_counts_the_failure() {
    let vlm = FakeVlm::start(
        vec![
            Reply::Content("{\"plan\": \"x\"}".into()),
            Reply::Content("```\nnope\n```".into()),
        ],
        Reply::Hang(Duration::from_secs(30)),
    );
    let c = cfg(&[&vlm]);
    let link = Arc::new(Link::new(&c, None, 64));
    link.publish(&Answer {
        subtask: "wipe the table".into(),
        done: false,
    });
    let _p = Planner::start(&c, c.api_key.clone(), link.clone()).expect("starts");
    wait_for("the parse failure", Duration::from_secs(10), || {
        count(&link.health.parse_failures) == 1
    });
    assert_eq!(subtask(&link).as_deref(), Some("wipe the table"));
    assert_eq!(count(&link.health.retries), 1);
    assert!(!link.health.up.load(Ordering::SeqCst));
}

#[test]
fn a_failing_endpoint_is_skipped_and_used_again_once_it_answers() {
    let a = FakeVlm::start(vec![], Reply::Status(500));
    let b = FakeVlm::start(vec![], Reply::Content(json("from b")));
    let mut c = cfg(&[&a, &b]);
    c.rate_hz = 50.0;
    let link = Arc::new(Link::new(&c, None, 64));
    let _p = Planner::start(&c, c.api_key.clone(), link.clone()).expect("starts");
    wait_for("b's subtask", Duration::from_secs(10), || {
        subtask(&link).as_deref() == Some("from b")
    });
    // a failed: it is down and only probed (with backoff), while b serves every call.
    a.models_ok.store(false, Ordering::SeqCst);
    let a_calls = a.chats().len();
    let b_calls = b.chats().len();
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(a.chats().len(), a_calls, "a down endpoint gets no calls");
    assert!(
        b.chats().len() >= b_calls + 5,
        "b takes every call meanwhile"
    );
    assert!(
        count(&link.health.call_failures) == 0,
        "b answered each call"
    );
    // a recovers: its probe answers, and round-robin uses it again.
    *a.fallback.lock().expect("lock") = Reply::Content(json("from a"));
    a.models_ok.store(true, Ordering::SeqCst);
    wait_for("a's subtask", Duration::from_secs(10), || {
        subtask(&link).as_deref() == Some("from a")
    });
    assert!(a.probes.load(Ordering::SeqCst) >= 2);
    wait_for("both endpoints ready", Duration::from_secs(5), || {
        count(&link.health.endpoints_ready) == 2
    });
}

#[test]
fn a_hung_endpoint_times_out_and_the_subtask_stays() {
    let vlm = FakeVlm::start(
        vec![Reply::Content(json("hold the lid"))],
        Reply::Hang(Duration::from_secs(30)),
    );
    let mut c = cfg(&[&vlm]);
    c.request_timeout_s = 0.3;
    let link = Arc::new(Link::new(&c, None, 64));
    let _p = Planner::start(&c, c.api_key.clone(), link.clone()).expect("starts");
    wait_for("a timeout", Duration::from_secs(10), || {
        count(&link.health.timeouts) >= 1
    });
    assert_eq!(subtask(&link).as_deref(), Some("hold the lid"));
    assert!(count(&link.health.call_failures) >= 1);
}

#[test]
fn a_slow_answer_within_the_timeout_is_used() {
    let vlm = FakeVlm::start(
        vec![Reply::Slow(Duration::from_millis(400), json("lift slowly"))],
        Reply::Hang(Duration::from_secs(30)),
    );
    let c = cfg(&[&vlm]);
    let link = Arc::new(Link::new(&c, None, 64));
    let _p = Planner::start(&c, c.api_key.clone(), link.clone()).expect("starts");
    wait_for("the subtask", Duration::from_secs(10), || {
        subtask(&link).is_some()
    });
    assert_eq!(subtask(&link).as_deref(), Some("lift slowly"));
    assert_eq!(count(&link.health.timeouts), 0);
}

#[test]
fn a_server_that_goes_away_leaves_the_last_subtask() {
    let vlm = FakeVlm::start(vec![], Reply::Content(json("stack the blocks")));
    let c = cfg(&[&vlm]);
    let link = Arc::new(Link::new(&c, None, 64));
    let _p = Planner::start(&c, c.api_key.clone(), link.clone()).expect("starts");
    wait_for("the subtask", Duration::from_secs(10), || {
        subtask(&link).is_some()
    });
    vlm.go_away();
    wait_for("failed calls", Duration::from_secs(10), || {
        count(&link.health.call_failures) >= 2
    });
    assert_eq!(subtask(&link).as_deref(), Some("stack the blocks"));
    assert_eq!(count(&link.health.endpoints_ready), 0);
}

#[test]
fn too_long_subtasks_are_refused_with_the_limit_in_the_retry() {
    let vlm = FakeVlm::start(
        vec![
            Reply::Content(json("pick up the red cup and put it on the shelf")),
            Reply::Content(json("pick cup")),
        ],
        Reply::Hang(Duration::from_secs(30)),
    );
    let c = cfg(&[&vlm]);
    let link = Arc::new(Link::new(&c, None, 16));
    let _p = Planner::start(&c, c.api_key.clone(), link.clone()).expect("starts");
    wait_for("the subtask", Duration::from_secs(10), || {
        subtask(&link).is_some()
    });
    assert_eq!(subtask(&link).as_deref(), Some("pick cup"));
    let retry = vlm.chats()[1].body["messages"][3]["content"].to_string();
    assert!(retry.contains("at most 16 bytes"), "{retry}");
}

#[test]
fn the_camera_frame_goes_to_the_model_as_a_png() {
    use base64::Engine as _;
    let vlm = FakeVlm::start(vec![], Reply::Content(json("look left")));
    let mut c = cfg(&[&vlm]);
    c.camera = Some("cam".into());
    let g = Geometry::of(&[4, 6, 3]).expect("image");
    let link = Arc::new(Link::new(&c, Some(g), 64));
    let _p = Planner::start(&c, c.api_key.clone(), link.clone()).expect("starts");
    // No observation yet: nothing to plan, nothing sent.
    wait_for("a skipped tick", Duration::from_secs(5), || {
        count(&link.health.no_observation) >= 1
    });
    assert!(vlm.chats().is_empty());
    // The request path offers every frame; the planner takes one when it wants it.
    let frame: Vec<u8> = (0..g.bytes()).map(|i| i as u8).collect();
    wait_for("a call with the frame", Duration::from_secs(10), || {
        link.offer_image(&frame);
        !vlm.chats().is_empty()
    });
    let seen = &vlm.chats()[0].body["messages"][1]["content"];
    let url = seen[1]["image_url"]["url"].as_str().expect("an image part");
    let b64 = url
        .strip_prefix("data:image/png;base64,")
        .expect("a PNG data URL");
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .expect("base64");
    let mut r = png::Decoder::new(std::io::Cursor::new(bytes))
        .read_info()
        .expect("png");
    assert_eq!((r.info().width, r.info().height), (6, 4));
    let mut px = vec![0; r.output_buffer_size().expect("size")];
    r.next_frame(&mut px).expect("frame");
    assert_eq!(px, frame);
}

/// Log lines of the whole test binary (the planner's model server is logged through `log`).
fn captured() -> &'static Mutex<Vec<String>> {
    static LINES: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    static LOGGER: Capture = Capture;
    struct Capture;
    impl log::Log for Capture {
        fn enabled(&self, m: &log::Metadata<'_>) -> bool {
            m.level() <= log::Level::Info
        }
        fn log(&self, r: &log::Record<'_>) {
            captured()
                .lock()
                .expect("lock")
                .push(format!("{} {}", r.target(), r.args()));
        }
        fn flush(&self) {}
    }
    let lines = LINES.get_or_init(Mutex::default);
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(log::LevelFilter::Info);
    }
    lines
}

fn logged(needle: &str) -> bool {
    captured()
        .lock()
        .expect("lock")
        .iter()
        .any(|l| l.contains(needle))
}

fn alive(pid: u32) -> bool {
    // Signal 0 checks the pid exists (a zombie counts: the supervisor reaps it on stop).
    std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z")
}

#[test]
fn serve_command_is_started_streamed_and_stopped_with_sigint_then_sigkill() {
    captured();
    let vlm = FakeVlm::start(vec![], Reply::Content(json("fold the towel")));
    // A model server that ignores SIGINT: it must be killed after the grace period.
    let mut c = cfg(&[&vlm]);
    c.serve_command = vec![
        "sh".into(),
        "-c".into(),
        "trap '' INT; echo 'stubborn-server: loading'; sleep 0.2; \
         echo 'stubborn-server: listening'; exec sleep 60"
            .into(),
    ];
    c.ready_marker = Some("stubborn-server: listening".into());
    c.stop_grace_s = 0.5;
    let link = Arc::new(Link::new(&c, None, 64));
    let mut p = Planner::start(&c, c.api_key.clone(), link.clone()).expect("starts");
    let pid = p.server_pid().expect("a server pid");
    wait_for("the first call", Duration::from_secs(10), || {
        !vlm.chats().is_empty()
    });
    assert!(logged("[planner server stdout] stubborn-server: loading"));
    assert!(logged("[planner server stdout] stubborn-server: listening"));
    assert!(alive(pid));
    let t0 = Instant::now();
    p.stop();
    let took = t0.elapsed();
    assert!(!alive(pid), "the server is gone after stop");
    assert!(
        took >= Duration::from_millis(500),
        "SIGINT was ignored, so the grace period ran: {took:?}"
    );
    assert!(logged("ignored SIGINT"));

    // One that honours SIGINT stops at once; with no marker, the probe says it is ready.
    let mut c = cfg(&[&vlm]);
    c.serve_command = vec!["sleep".into(), "60".into()];
    c.stop_grace_s = 10.0;
    let mut p = Planner::start(&c, None, Arc::new(Link::new(&c, None, 64))).expect("starts");
    let pid = p.server_pid().expect("a server pid");
    let t0 = Instant::now();
    p.stop();
    assert!(!alive(pid));
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

#[test]
fn a_model_server_that_exits_is_restarted() {
    captured();
    let vlm = FakeVlm::start(vec![], Reply::Content(json("x")));
    let mut c = cfg(&[&vlm]);
    c.serve_command = vec![
        "sh".into(),
        "-c".into(),
        "echo 'short-lived-server: up'; sleep 0.3".into(),
    ];
    c.ready_marker = Some("short-lived-server: up".into());
    let link = Arc::new(Link::new(&c, None, 64));
    let _p = Planner::start(&c, None, link).expect("starts");
    wait_for("a restart", Duration::from_secs(10), || {
        captured()
            .lock()
            .expect("lock")
            .iter()
            .filter(|l| l.contains("[planner server stdout] short-lived-server: up"))
            .count()
            >= 2
    });
    assert!(logged("the model server exited"));
}

mod serving {
    //! The planner beside a serving policyd: the policy is prompted with the subtask, the
    //! camera frame comes from the requests, and replies keep their latency while the
    //! planner's endpoint hangs.

    use super::*;
    use futures_util::{SinkExt, StreamExt};
    use policyd::config::Config;
    use policyd::dtype::ElemType;
    use policyd::engine::{IoSpec, TensorSpec};
    use policyd::protocol::Encoder;
    use policyd::testing::synthetic::Behaviour;
    use tokio_tungstenite::tungstenite::Message;

    fn io() -> IoSpec {
        let t = |name: &str, dtype, shape: &[usize]| TensorSpec {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
        };
        IoSpec {
            // The synthetic engine's actions start at its first input's first value: here
            // the prompt's first byte, so each reply tells which prompt the policy saw.
            inputs: vec![
                t("prompt", ElemType::I64, &[1, 24]),
                t("cam", ElemType::F32, &[1, 4, 6, 3]),
            ],
            outputs: vec![t("actions", ElemType::F32, &[1, 10, 7])],
        }
    }

    fn config(vlm: &FakeVlm, planner: &str) -> Config {
        let text = format!(
            "[server]\nhost = \"127.0.0.1\"\nport = 0\n\
             [engine]\nmodel = \"synthetic\"\nwarmup_runs = 1\n\
             [[inputs]]\nkey = \"prompt\"\ntensor = \"prompt\"\ndtypes = [\"text\"]\nshape = [24]\n\
             [[inputs]]\nkey = \"cam\"\ntensor = \"cam\"\ndtypes = [\"uint8\"]\nshape = [4, 6, 3]\n\
             [[outputs]]\ntensor = \"actions\"\n\
             [planner]\nenabled = true\nendpoints = [\"{}\"]\nmodel = \"vlm\"\ncamera = \"cam\"\n\
             rate_hz = 20.0\n{planner}\n",
            vlm.url()
        );
        Config::parse(&text, "test", None).expect("config")
    }

    fn request(prompt: Option<&str>) -> Vec<u8> {
        let mut buf = Vec::new();
        let mut e = Encoder { buf: &mut buf };
        e.map(1 + u32::from(prompt.is_some()));
        e.str("cam");
        e.ndarray(ElemType::U8, &[4, 6, 3], 72, |d| d.fill(7));
        if let Some(p) = prompt {
            e.str("prompt");
            e.str(p);
        }
        buf
    }

    /// The first action value of a reply (the prompt's first byte), or None for an error.
    async fn first_action(ws: &mut common::Ws) -> Option<f32> {
        let msg = loop {
            match tokio::time::timeout(Duration::from_secs(10), ws.next()).await {
                Ok(Some(Ok(Message::Binary(b)))) => break b,
                Ok(Some(Ok(Message::Ping(_)))) => continue,
                // openpi's dialect sends errors as text.
                Ok(Some(Ok(Message::Text(t)))) => {
                    assert!(t.contains("planner has not named a subtask yet"), "{t}");
                    return None;
                }
                other => panic!("expected a reply, got {other:?}"),
            }
        };
        let v = rmpv::decode::read_value(&mut &msg[..]).expect("msgpack");
        let key = |m: &rmpv::Value, k: &str| {
            m.as_map()?
                .iter()
                .find(|(key, _)| key.as_str() == Some(k) || key.as_slice() == Some(k.as_bytes()))
                .map(|(_, v)| v.clone())
        };
        let data = key(&key(&v, "actions")?, "data")?;
        let bytes = data.as_slice()?;
        Some(f32::from_le_bytes(bytes[..4].try_into().ok()?))
    }

    async fn round_trip(ws: &mut common::Ws, prompt: Option<&str>) -> Option<f32> {
        ws.send(Message::binary(request(prompt)))
            .await
            .expect("sends");
        first_action(ws).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn replies_use_the_subtask_and_keep_their_latency_while_the_planner_hangs() {
        let vlm = FakeVlm::start(
            vec![Reply::Content(json("alpha"))],
            Reply::Hang(Duration::from_secs(30)),
        );
        let cfg = config(&vlm, "request_timeout_s = 5.0");
        let behaviour = Behaviour {
            compute: Duration::from_millis(1),
            ..Default::default()
        };
        let srv = common::start_io(cfg, io(), behaviour).await;
        let mut ws = common::connect(srv.addr, "/").await;
        // Until the planner has answered, a request without a prompt lacks a required input.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match round_trip(&mut ws, None).await {
                Some(x) if x == f32::from(b'a') => break,
                Some(x) => panic!("the policy saw {x}"),
                // openpi's dialect closes the connection after an error.
                None => ws = common::connect(srv.addr, "/").await,
            }
            assert!(
                Instant::now() < deadline,
                "the subtask never reached the policy"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // The planner got the requests' camera frame.
        let first = &vlm.chats()[0].body["messages"][1]["content"][1]["image_url"]["url"];
        assert!(
            first
                .as_str()
                .is_some_and(|u| u.starts_with("data:image/png;base64,"))
        );
        // Its next call hangs (5 s timeout); replies go on at engine speed meanwhile.
        let deadline = Instant::now() + Duration::from_secs(10);
        while vlm.in_flight.load(Ordering::SeqCst) == 0 {
            assert!(
                Instant::now() < deadline,
                "the planner never made its second call"
            );
            round_trip(&mut ws, None).await;
        }
        let mut worst = Duration::ZERO;
        for _ in 0..50 {
            let t0 = Instant::now();
            assert_eq!(round_trip(&mut ws, None).await, Some(f32::from(b'a')));
            worst = worst.max(t0.elapsed());
        }
        assert!(vlm.in_flight.load(Ordering::SeqCst) > 0, "still hung");
        // A reply waiting on the planner would take seconds; engine speed is milliseconds.
        assert!(worst < Duration::from_secs(1), "worst reply {worst:?}");
        // precedence = "client": a prompt the client sends wins.
        assert_eq!(
            round_trip(&mut ws, Some("zulu")).await,
            Some(f32::from(b'z'))
        );
        let metrics = common::http_get(srv.addr, "/metrics", "").await;
        for line in [
            "policyd_planner_subtask{subtask=\"alpha\"} 1",
            "policyd_planner_calls_total{result=\"ok\"} 1",
            "policyd_planner_endpoints_ready 1",
        ] {
            assert!(metrics.contains(line), "{line} missing from:\n{metrics}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn with_planner_precedence_the_clients_prompt_becomes_the_instruction() {
        let vlm = FakeVlm::start(vec![], Reply::Content(json("beta")));
        let cfg = config(
            &vlm,
            "precedence = \"planner\"\ninstruction = \"from the config\"",
        );
        let srv = common::start_io(cfg, io(), Behaviour::default()).await;
        let mut ws = common::connect(srv.addr, "/").await;
        // Before the first subtask the client's prompt reaches the policy.
        let first = round_trip(&mut ws, Some("zulu")).await;
        assert!(matches!(first, Some(x) if x == f32::from(b'z') || x == f32::from(b'b')));
        let deadline = Instant::now() + Duration::from_secs(10);
        while round_trip(&mut ws, Some("zulu")).await != Some(f32::from(b'b')) {
            assert!(
                Instant::now() < deadline,
                "the subtask never overrode the prompt"
            );
        }
        // The planner is now asked about the client's instruction.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let chats = vlm.chats();
            let last = chats
                .last()
                .map(|c| c.body["messages"][0]["content"].to_string());
            if last.is_some_and(|s| s.contains("zulu")) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the instruction never reached the planner"
            );
            round_trip(&mut ws, Some("zulu")).await;
        }
    }
}
