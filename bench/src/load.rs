//! The load generator: N connections that send observations and time the replies.
//!
//! Closed loop sends the next request as soon as the reply is in. Open loop sends on a fixed
//! schedule, like a robot's control loop, and measures each request from the time it *should*
//! have been sent: a server that falls behind delays the next send, and that queueing shows up
//! in the latency instead of being hidden (coordinated omission).

use std::time::Duration;

use std::io::ErrorKind;
use std::net::TcpStream;
use std::time::Instant;

use hdrhistogram::Histogram;
use tokio_tungstenite::tungstenite::{self, Message, WebSocket};
use tungstenite::client::IntoClientRequest;
use tungstenite::http::HeaderValue;
use tungstenite::protocol::WebSocketConfig;

use super::BenchError;
use super::profile::{FramePool, Profile};

/// How one phase runs.
#[derive(Clone, Debug)]
pub struct LoadSpec {
    pub connections: usize,
    /// Requests per second per connection; `None` = closed loop.
    pub rate_hz: Option<f64>,
    pub warmup: Duration,
    pub measure: Duration,
    /// Replies slower than this count as misses.
    pub budget: Option<Duration>,
    /// Open loop: all connections send at the same instants instead of spread over the period.
    pub burst: bool,
    pub api_key: Option<String>,
}

/// One timed request, for the plot.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    /// Seconds from the start of the measured window to the intended send.
    pub at_s: f64,
    pub latency_ms: f64,
}

/// What one phase measured (all connections together), warm-up excluded.
pub struct Outcome {
    /// Latency in microseconds.
    pub hist: Histogram<u64>,
    pub samples: Vec<Sample>,
    pub errors: u64,
    pub misses: u64,
    /// Open loop: requests of the measured window still unsent when it ended, because the
    /// server was too slow for the rate.
    pub unsent: u64,
    /// Sum of the replies' `policy_timing.infer_ms` (engine time), and how many had one.
    pub engine_ms: f64,
    pub engine_replies: u64,
    pub first_error: Option<String>,
    /// The measured window: from its start to the last reply.
    pub window: Duration,
}

impl Outcome {
    pub fn new() -> Outcome {
        Outcome {
            hist: new_histogram(),
            samples: Vec::new(),
            errors: 0,
            misses: 0,
            unsent: 0,
            engine_ms: 0.0,
            engine_replies: 0,
            first_error: None,
            window: Duration::ZERO,
        }
    }

    /// Adds another outcome: of a concurrent connection (the windows overlap) or of a later
    /// phase (the windows add up).
    pub fn merge(&mut self, o: Outcome, concurrent: bool) {
        let _ = self.hist.add(&o.hist);
        // A later phase's samples continue the time axis where this one's window ended.
        let shift = if concurrent {
            0.0
        } else {
            self.window.as_secs_f64()
        };
        self.samples.extend(o.samples.into_iter().map(|s| Sample {
            at_s: s.at_s + shift,
            ..s
        }));
        self.errors += o.errors;
        self.misses += o.misses;
        self.unsent += o.unsent;
        self.engine_ms += o.engine_ms;
        self.engine_replies += o.engine_replies;
        if self.first_error.is_none() {
            self.first_error = o.first_error;
        }
        self.window = if concurrent {
            self.window.max(o.window)
        } else {
            self.window + o.window
        };
    }
}

impl Default for Outcome {
    fn default() -> Self {
        Outcome::new()
    }
}

/// 1 µs to 5 min at 3 significant figures.
fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 300_000_000, 3).expect("constant histogram bounds are valid")
}

/// A client connection (blocking: each connection has its own thread, see [`drive`]).
pub type Ws = WebSocket<TcpStream>;

/// How long a connection waits for any one reply before the run fails.
const REPLY_TIMEOUT: Duration = Duration::from_secs(60);

/// Opens a connection and reads the metadata frame an OpenPI server sends first.
pub fn connect(url: &str, api_key: Option<&str>) -> Result<Ws, BenchError> {
    let bad = |e: String| BenchError::Url(url.to_string(), e);
    let mut req = url.into_client_request().map_err(|e| bad(e.to_string()))?;
    if req.uri().scheme_str() != Some("ws") {
        return Err(bad(
            "only ws:// is supported (serve the benchmark without [tls])".into(),
        ));
    }
    if let Some(k) = api_key {
        let v = HeaderValue::from_str(&format!("Api-Key {k}")).map_err(|_| {
            BenchError::Usage("--api-key has characters a header cannot carry".into())
        })?;
        req.headers_mut().insert("Authorization", v);
    }
    let host = req
        .uri()
        .host()
        .unwrap_or("")
        .trim_matches(['[', ']'])
        .to_string();
    let port = req.uri().port_u16().unwrap_or(80);
    let failed = |e: String| BenchError::Connect(url.to_string(), e);
    let tcp = TcpStream::connect((host.as_str(), port)).map_err(|e| failed(e.to_string()))?;
    let _ = tcp.set_nodelay(true);
    tcp.set_read_timeout(Some(REPLY_TIMEOUT))
        .map_err(|e| failed(e.to_string()))?;
    let cfg = WebSocketConfig::default()
        .max_message_size(Some(256 << 20))
        .max_frame_size(Some(256 << 20));
    let (mut ws, _) = tungstenite::client::client_with_config(req, tcp, Some(cfg))
        .map_err(|e| failed(e.to_string()))?;
    match next_frame(&mut ws).map_err(failed)? {
        Frame::Binary(_) => Ok(ws),
        Frame::Text(t) => Err(BenchError::Connect(url.to_string(), t)),
    }
}

/// What a server sent back.
enum Frame {
    Binary(bytes::Bytes),
    /// openpi's servers answer a failed request with a text frame (a traceback, or policyd's
    /// message).
    Text(String),
}

/// The next data message; an error for close, a failed connection, and a reply that does not
/// come within [`REPLY_TIMEOUT`].
fn next_frame(ws: &mut Ws) -> Result<Frame, String> {
    loop {
        match ws.read() {
            Ok(Message::Binary(b)) => return Ok(Frame::Binary(b)),
            Ok(Message::Text(t)) => return Ok(Frame::Text(last_line(&t))),
            Ok(Message::Close(c)) => {
                return Err(match c {
                    Some(c) => format!("closed by the server: {} {}", c.code, c.reason),
                    None => "closed by the server".into(),
                });
            }
            Ok(_) => continue,
            Err(tungstenite::Error::Io(e))
                if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) =>
            {
                return Err(format!("no reply within {} s", REPLY_TIMEOUT.as_secs()));
            }
            Err(e) => return Err(format!("connection failed: {e}")),
        }
    }
}

/// Reads the next frame as a reply: actions, or the error the server sent.
fn next_reply(ws: &mut Ws) -> Result<(Reply, bytes::Bytes), String> {
    Ok(match next_frame(ws)? {
        Frame::Binary(b) => (read_reply(&b), b),
        Frame::Text(t) => (Reply::Error(t), bytes::Bytes::new()),
    })
}

/// The last line of a message (a Python traceback ends with the exception), at most 200
/// characters.
fn last_line(s: &str) -> String {
    let l = s.trim().lines().last().unwrap_or("");
    l.chars().take(200).collect()
}

/// What a reply said, read after its time was taken.
pub enum Reply {
    /// An action chunk; the engine time when the reply had `policy_timing.infer_ms`.
    Actions {
        engine_ms: Option<f64>,
    },
    Error(String),
}

fn key_is(v: &rmpv::Value, k: &str) -> bool {
    match v {
        rmpv::Value::String(s) => s.as_str() == Some(k),
        rmpv::Value::Binary(b) => b.as_slice() == k.as_bytes(),
        _ => false,
    }
}

fn get<'v>(map: &'v rmpv::Value, k: &str) -> Option<&'v rmpv::Value> {
    map.as_map()?
        .iter()
        .find(|(mk, _)| key_is(mk, k))
        .map(|(_, v)| v)
}

/// Classifies a reply: `{"actions": …}` is a success; vllm-omni's `{"type": "error"}` map or
/// anything else is an error.
pub fn read_reply(b: &[u8]) -> Reply {
    let v = match rmpv::decode::read_value(&mut &b[..]) {
        Ok(v) => v,
        Err(e) => return Reply::Error(format!("reply is not msgpack: {e}")),
    };
    if get(&v, "actions").is_some() {
        let engine_ms = get(&v, "policy_timing")
            .and_then(|t| get(t, "infer_ms"))
            .and_then(rmpv::Value::as_f64);
        return Reply::Actions { engine_ms };
    }
    if let Some(m) = get(&v, "message").and_then(rmpv::Value::as_str) {
        return Reply::Error(m.to_string());
    }
    Reply::Error(format!(
        "reply has no 'actions': {}",
        last_line(&v.to_string())
    ))
}

/// The `actions` array's shape and dtype in a reply, for the transport floor's fixed reply.
pub fn actions_shape(b: &[u8]) -> Option<Vec<usize>> {
    let v = rmpv::decode::read_value(&mut &b[..]).ok()?;
    let shape = get(get(&v, "actions")?, "shape")?.as_array()?;
    shape
        .iter()
        .map(|d| d.as_u64().map(|d| d as usize))
        .collect()
}

/// Sends `frame` and waits for the reply; the reply's bytes (empty for a text frame).
pub fn request(ws: &mut Ws, frame: bytes::Bytes) -> Result<(Reply, bytes::Bytes), String> {
    ws.send(Message::Binary(frame))
        .map_err(|e| format!("send failed: {e}"))?;
    next_reply(ws)
}

/// Sends one request on a fresh connection and returns the reply (a probe before the run).
pub fn probe(url: &str, spec: &LoadSpec, profile: &Profile) -> Result<Vec<u8>, BenchError> {
    let mut ws = connect(url, spec.api_key.as_deref())?;
    let mut pool = FramePool::new(profile, 0, 1);
    let failed = |e: String| BenchError::Connect(url.to_string(), e);
    let (reply, bytes) = request(&mut ws, pool.request(0)).map_err(failed)?;
    let _ = ws.close(None);
    match reply {
        Reply::Actions { .. } => Ok(bytes.to_vec()),
        Reply::Error(e) => Err(BenchError::Rejected {
            url: url.to_string(),
            profile: profile.name.clone(),
            error: e,
        }),
    }
}

/// Sleeps until `t` (the thread's timer slack is set to 1 µs in [`drive`], so the wake-up is
/// within a few microseconds rather than the default 50 µs, and far from an async runtime's
/// 1 ms timer tick).
fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}

/// One connection's run: warm-up until `t0 + warmup`, then the measured window. In open loop,
/// connection `index` of N is offset by `index / N` of a period (unless `spec.burst`), so N
/// clients arrive spread out as independent robots would. The pool comes back for the next
/// round.
pub fn drive(
    mut ws: Ws,
    mut pool: FramePool,
    spec: LoadSpec,
    t0: Instant,
    index: usize,
) -> Result<(Outcome, FramePool), BenchError> {
    // SAFETY: prctl(PR_SET_TIMERSLACK) only changes this thread's timer slack.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
    }
    let start = t0 + spec.warmup;
    let end = start + spec.measure;
    let mut out = Outcome::new();
    let period = spec.rate_hz.map(|r| Duration::from_secs_f64(1.0 / r));
    let phase = match period {
        Some(p) if !spec.burst => p.mul_f64(index as f64 / spec.connections.max(1) as f64),
        _ => Duration::ZERO,
    };
    // Request k is due at t0 + phase + k·period.
    let due = |k: u64, p: Duration| t0 + phase + p.mul_f64(k as f64);
    let first_due_at = |t: Instant, p: Duration| {
        (t.saturating_duration_since(t0 + phase).as_secs_f64() / p.as_secs_f64()).ceil() as u64
    };
    if let Some(p) = period {
        out.samples
            .reserve((spec.measure.as_secs_f64() / p.as_secs_f64()) as usize + 1);
    }
    sleep_until(t0);
    let mut last_reply = start;
    let mut frame = pool.request(0);
    let mut k = 0u64;
    loop {
        let intended = match period {
            Some(p) => due(k, p),
            None => Instant::now(),
        };
        if intended >= end {
            break;
        }
        if Instant::now() >= end {
            // Behind schedule when the window closed: count what was never sent.
            if let Some(p) = period {
                let first = k.max(first_due_at(start, p));
                out.unsent += first_due_at(end, p).saturating_sub(first);
            }
            break;
        }
        if period.is_some() {
            sleep_until(intended);
        }
        let sent = Instant::now();
        if let Err(e) = ws.send(Message::Binary(frame)) {
            return Err(BenchError::Lost(format!("send failed: {e}")));
        }
        let reply = next_reply(&mut ws);
        let done = Instant::now();
        let from = if period.is_some() { intended } else { sent };
        if intended >= start {
            let us = (done - from).as_micros().max(1) as u64;
            match &reply {
                Ok((Reply::Actions { engine_ms }, _)) => {
                    let _ = out.hist.record(us);
                    out.samples.push(Sample {
                        at_s: (intended - start).as_secs_f64(),
                        latency_ms: us as f64 / 1000.0,
                    });
                    if spec.budget.is_some_and(|b| done - from > b) {
                        out.misses += 1;
                    }
                    if let Some(ms) = engine_ms {
                        out.engine_ms += ms;
                        out.engine_replies += 1;
                    }
                }
                Ok((Reply::Error(e), _)) | Err(e) => {
                    out.errors += 1;
                    out.first_error.get_or_insert_with(|| e.clone());
                }
            }
            last_reply = done;
        }
        if let Err(e) = reply {
            return Err(BenchError::Lost(e));
        }
        k += 1;
        frame = pool.request(k);
    }
    out.window = last_reply.saturating_duration_since(start);
    let _ = ws.close(None);
    let _ = ws.flush();
    Ok((out, pool))
}
