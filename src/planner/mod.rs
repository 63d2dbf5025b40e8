//! What is the policy's next subtask? The task planner asks a vision-language model.
//!
//! Hierarchical setups put a VLM above the policy: from the high-level instruction and the
//! current camera view it names the next subtask ("pick up the red cup"), and the policy is
//! prompted with that. The planner runs on its own thread at its own rate; the request path
//! never waits for it. The two meet in a [`Link`]: the planner publishes its latest subtask
//! there (an atomic pointer swap) and asks for a camera frame (a flag); the request path reads
//! the subtask and, when asked, copies one frame into a preallocated buffer if nobody holds it
//! (`try_lock`, never a wait). A slow, failing or absent planner therefore costs a reply
//! nothing: the policy keeps the last subtask.

pub mod endpoint;
pub mod reply;
pub mod supervise;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::{ArcSwap, ArcSwapOption};

use crate::config::{ConfigError, PlannerConfig, Precedence, Secret, invalid};
use endpoint::{CallError, Endpoints};
use reply::Answer;

/// A camera frame's layout: what the PNG sent to the model is built from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub height: usize,
    pub width: usize,
    pub channels: usize,
    /// Channels first (`[C, H, W]`), else last (`[H, W, C]`).
    pub chw: bool,
}

impl Geometry {
    /// The layout of a wire shape (leading size-1 axes dropped), if it is an image.
    pub fn of(shape: &[usize]) -> Option<Geometry> {
        let mut s = shape;
        while s.len() > 3 && s[0] == 1 {
            s = &s[1..];
        }
        let &[a, b, c] = s else { return None };
        let image = |ch: usize| matches!(ch, 1 | 3 | 4);
        if image(c) && a > 0 && b > 0 {
            Some(Geometry {
                height: a,
                width: b,
                channels: c,
                chw: false,
            })
        } else if image(a) && b > 0 && c > 0 {
            Some(Geometry {
                height: b,
                width: c,
                channels: a,
                chw: true,
            })
        } else {
            None
        }
    }

    pub fn bytes(&self) -> usize {
        self.height * self.width * self.channels
    }
}

/// The latest camera frame the request path handed over.
struct Snapshot {
    data: Vec<u8>,
    fresh: bool,
}

/// Counters and state for `/metrics` (written by the planner thread, read at scrape time).
#[derive(Default)]
pub struct Health {
    /// Calls that produced a subtask.
    pub ok: AtomicU64,
    /// Answers that could not be parsed, before the corrective retry.
    pub retries: AtomicU64,
    /// Calls whose answer was unusable even after the retry.
    pub parse_failures: AtomicU64,
    /// Calls that failed at the HTTP level (no endpoint, timeout, error status).
    pub call_failures: AtomicU64,
    /// Of those, calls that ran past `planner.request_timeout_s`.
    pub timeouts: AtomicU64,
    /// Ticks skipped because no observation carried the camera image.
    pub no_observation: AtomicU64,
    /// Endpoints that answered their last call or probe.
    pub endpoints_ready: AtomicU64,
    /// The model said the instruction is complete.
    pub done: AtomicBool,
    /// When the subtask was last set, in ms since the link was made (0: never).
    pub updated_ms: AtomicU64,
    /// Whether the last call produced a subtask.
    pub up: AtomicBool,
}

/// Where the request path and the planner thread meet.
pub struct Link {
    subtask: ArcSwapOption<String>,
    instruction: ArcSwap<String>,
    want_image: AtomicBool,
    image: Mutex<Snapshot>,
    pub camera: Option<Geometry>,
    /// The most bytes a subtask may have (the prompt input's length).
    pub max_subtask: usize,
    /// The subtask overrides a client's prompt (`precedence = "planner"`).
    pub planner_first: bool,
    pub health: Health,
    born: Instant,
}

impl Link {
    /// A link with its frame buffer allocated (`camera`'s size) and the configured
    /// instruction.
    pub fn new(cfg: &PlannerConfig, camera: Option<Geometry>, max_subtask: usize) -> Link {
        Link {
            subtask: ArcSwapOption::empty(),
            instruction: ArcSwap::from_pointee(cfg.instruction.clone()),
            want_image: AtomicBool::new(false),
            image: Mutex::new(Snapshot {
                data: Vec::with_capacity(camera.map_or(0, |g| g.bytes())),
                fresh: false,
            }),
            camera,
            max_subtask,
            planner_first: cfg.precedence == Precedence::Planner,
            health: Health::default(),
            born: Instant::now(),
        }
    }

    /// The latest subtask, if the planner has named one. Lock-free; allocates nothing.
    pub fn subtask(&self) -> arc_swap::Guard<Option<Arc<String>>> {
        self.subtask.load()
    }

    /// Publishes a subtask (the planner thread; tests).
    pub fn publish(&self, a: &Answer) {
        let changed = self.subtask.load().as_deref().map(String::as_str) != Some(&a.subtask);
        if changed {
            log::info!("planner: subtask \"{}\"", a.subtask);
            self.subtask.store(Some(Arc::new(a.subtask.clone())));
        }
        if a.done && !self.health.done.swap(true, Ordering::Relaxed) {
            log::info!("planner: the model reports the instruction complete");
        } else if !a.done {
            self.health.done.store(false, Ordering::Relaxed);
        }
        let ms = self.born.elapsed().as_millis() as u64;
        self.health.updated_ms.store(ms.max(1), Ordering::Relaxed);
    }

    /// Seconds since the subtask was last set, if ever.
    pub fn subtask_age(&self) -> Option<f64> {
        match self.health.updated_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(self.born.elapsed().as_secs_f64() - ms as f64 / 1e3),
        }
    }

    /// The high-level instruction the planner works on.
    pub fn instruction(&self) -> Arc<String> {
        self.instruction.load_full()
    }

    /// A client's prompt (UTF-8) with `precedence = "planner"`: it becomes the instruction.
    /// Allocates only when the instruction changes.
    pub fn client_instruction(&self, text: &[u8]) {
        if self.instruction.load().as_bytes() == text {
            return;
        }
        let s = String::from_utf8_lossy(text).into_owned();
        log::info!("planner: instruction from the client: \"{s}\"");
        self.instruction.store(Arc::new(s));
    }

    /// Called by the request path with a camera frame's raw uint8 bytes: copied only when
    /// the planner asked for a frame and the buffer is free. Never waits.
    pub fn offer_image(&self, data: &[u8]) {
        if !self.want_image.load(Ordering::Acquire) {
            return;
        }
        let Ok(mut s) = self.image.try_lock() else {
            return;
        };
        if data.len() != s.data.capacity() {
            return;
        }
        s.data.clear();
        s.data.extend_from_slice(data);
        s.fresh = true;
        self.want_image.store(false, Ordering::Release);
    }

    /// Asks the request path for its next camera frame.
    pub fn want_frame(&self) {
        self.want_image.store(true, Ordering::Release);
    }

    /// Asks the request path for a frame and waits up to `wait` for one; the frame is
    /// handed to `f`.
    fn take_image<R>(
        &self,
        wait: Duration,
        stop: &Receiver<()>,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<Option<R>, Stopped> {
        self.want_frame();
        let deadline = Instant::now() + wait;
        loop {
            {
                let mut s = self.image.lock().unwrap_or_else(|p| p.into_inner());
                if s.fresh {
                    s.fresh = false;
                    return Ok(Some(f(&s.data)));
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            pause(stop, (deadline - now).min(Duration::from_millis(10)))?;
        }
    }
}

/// The planner was told to stop.
#[derive(Debug)]
struct Stopped;

/// Sleeps up to `d`, or returns early when the planner is stopped.
fn pause(stop: &Receiver<()>, d: Duration) -> Result<(), Stopped> {
    match stop.recv_timeout(d) {
        Err(RecvTimeoutError::Timeout) => Ok(()),
        _ => Err(Stopped),
    }
}

/// The API key the planner sends: `planner.api_key`, else the contents of
/// `planner.api_key_file` (read here, at start-up, not when the config is parsed).
pub fn api_key(cfg: &PlannerConfig) -> Result<Option<Secret>, ConfigError> {
    let (key, name) = match &cfg.api_key_file {
        None => (cfg.api_key.clone(), "planner.api_key"),
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| {
                invalid(
                    "planner.api_key_file",
                    format!("cannot read {}: {e}", path.display()),
                )
            })?;
            (
                Some(Secret(text.trim().to_string())),
                "planner.api_key_file",
            )
        }
    };
    if let Some(k) = &key
        && (k.0.is_empty() || k.0.chars().any(|c| c.is_control()))
    {
        return Err(invalid(name, "must be non-empty and on one line"));
    }
    Ok(key)
}

/// The running planner: its thread and, if configured, its model server.
pub struct Planner {
    stop: Option<Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    server: Option<Arc<supervise::Supervisor>>,
    grace: Duration,
}

impl Planner {
    /// Starts the planner thread (and `serve_command`, if set), calling with `key` (see
    /// [`api_key`]).
    pub fn start(
        cfg: &PlannerConfig,
        key: Option<Secret>,
        link: Arc<Link>,
    ) -> std::io::Result<Planner> {
        let server = if cfg.serve_command.is_empty() {
            None
        } else {
            Some(Arc::new(supervise::Supervisor::start(
                &cfg.serve_command,
                cfg.ready_marker.clone(),
            )?))
        };
        let (tx, rx) = channel();
        let grace = Duration::from_secs_f64(cfg.stop_grace_s);
        let cfg = cfg.clone();
        let srv = server.clone();
        let thread = std::thread::Builder::new()
            .name("planner".into())
            .spawn(move || {
                let _ = run(&cfg, key.as_ref(), &link, srv.as_deref(), &rx);
                log::debug!("planner: stopped");
            })?;
        Ok(Planner {
            stop: Some(tx),
            thread: Some(thread),
            server,
            grace,
        })
    }

    /// The model server's pid while it runs (`serve_command`).
    pub fn server_pid(&self) -> Option<u32> {
        self.server.as_ref().and_then(|s| s.pid())
    }

    /// Stops the thread (a call in progress is abandoned: the thread ends when it returns)
    /// and the model server (SIGINT, then SIGKILL after `planner.stop_grace_s`).
    pub fn stop(&mut self) {
        self.stop.take();
        if let Some(s) = &self.server {
            s.stop(self.grace);
        }
        if let Some(t) = self.thread.take() {
            // Between calls the thread wakes at once; mid-call it is left to finish alone,
            // so a hung endpoint cannot hold up shutdown.
            let deadline = Instant::now() + Duration::from_millis(200);
            while !t.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

impl Drop for Planner {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The planner loop: wait for the model server, then at `rate_hz` take a frame, ask, publish.
fn run(
    cfg: &PlannerConfig,
    key: Option<&Secret>,
    link: &Link,
    server: Option<&supervise::Supervisor>,
    stop: &Receiver<()>,
) -> Result<(), Stopped> {
    let mut endpoints = Endpoints::new(
        &cfg.endpoints,
        key.map(|k| k.0.as_str()),
        Duration::from_secs_f64(cfg.request_timeout_s),
        Duration::from_secs_f64(cfg.max_backoff_s),
    );
    let max_backoff = Duration::from_secs_f64(cfg.max_backoff_s);
    if let Some(s) = server {
        let ready = s.wait_ready(Duration::from_secs_f64(cfg.ready_timeout_s), || {
            endpoints.probe_all()
        });
        if ready {
            log::info!("planner: the model server is ready");
        }
        pause(stop, Duration::ZERO)?;
    }
    let period = Duration::from_secs_f64(1.0 / cfg.rate_hz);
    // A frame is awaited at most one period (and at most a second): with no robot talking,
    // there is nothing to plan.
    let frame_wait = period.min(Duration::from_secs(1));
    let mut restart_backoff = Duration::from_secs(1);
    let mut restart_at: Option<Instant> = None;
    loop {
        let tick = Instant::now();
        if let Some(s) = server
            && let Some(status) = s.exited()
        {
            let at = *restart_at.get_or_insert_with(|| {
                log::error!(
                    "planner: the model server exited ({status}); restarting it in \
                     {restart_backoff:?}"
                );
                tick + restart_backoff
            });
            if tick >= at {
                restart_at = None;
                restart_backoff = (restart_backoff * 2).min(max_backoff);
                if let Err(e) = s.spawn() {
                    log::error!("planner: {e}");
                }
            }
        }
        let image = match link.camera {
            None => None,
            Some(g) => match link.take_image(frame_wait, stop, |data| encode_png(g, data))? {
                Some(Ok(url)) => Some(url),
                Some(Err(e)) => {
                    log::warn!("planner: cannot encode the camera frame: {e}");
                    None
                }
                None => {
                    link.health.no_observation.fetch_add(1, Ordering::Relaxed);
                    pause(stop, period.saturating_sub(tick.elapsed()))?;
                    continue;
                }
            },
        };
        let outcome = ask(cfg, link, &mut endpoints, image.as_deref());
        let h = &link.health;
        h.endpoints_ready
            .store(endpoints.ready() as u64, Ordering::Relaxed);
        match outcome {
            Ok(a) => {
                h.ok.fetch_add(1, Ordering::Relaxed);
                h.up.store(true, Ordering::Relaxed);
                link.publish(&a);
            }
            Err(e) => {
                h.up.store(false, Ordering::Relaxed);
                match &e {
                    AskError::Parse(_) => h.parse_failures.fetch_add(1, Ordering::Relaxed),
                    AskError::Call(c) => {
                        if matches!(c, CallError::Timeout { .. }) {
                            h.timeouts.fetch_add(1, Ordering::Relaxed);
                        }
                        h.call_failures.fetch_add(1, Ordering::Relaxed)
                    }
                };
                log::warn!("planner: {e}; keeping the previous subtask");
            }
        }
        pause(stop, period.saturating_sub(tick.elapsed()))?;
    }
}

/// Why a planner call produced no subtask.
#[derive(Debug, thiserror::Error)]
enum AskError {
    #[error(transparent)]
    Call(#[from] CallError),
    #[error("unusable answer after a corrective retry: {0}")]
    Parse(reply::ParseError),
}

/// Most characters of a bad answer echoed back in the corrective retry.
const MAX_ECHO: usize = 2000;

/// One planner call: the request, and one corrective retry if the answer is unusable.
fn ask(
    cfg: &PlannerConfig,
    link: &Link,
    endpoints: &mut Endpoints,
    image: Option<&str>,
) -> Result<Answer, AskError> {
    let instruction = link.instruction();
    let current = link.subtask();
    let current = current.as_deref().map_or("none yet", String::as_str);
    let system = cfg
        .system_prompt
        .replace("{instruction}", &instruction)
        .replace("{subtask}", current);
    let mut user = vec![serde_json::json!({
        "type": "text",
        "text": format!(
            "Instruction: {instruction}\nCurrent subtask: {current}\n\
             Answer with JSON: {{\"subtask\": \"...\", \"done\": false}}"
        ),
    })];
    if let Some(url) = image {
        user.push(serde_json::json!({"type": "image_url", "image_url": {"url": url}}));
    }
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": system}),
        serde_json::json!({"role": "user", "content": user}),
    ];
    let body = |messages: &[serde_json::Value]| {
        let mut b = serde_json::json!({
            "model": cfg.model,
            "messages": messages,
            "max_tokens": cfg.max_tokens,
            "temperature": cfg.temperature,
            "stream": false,
        });
        if cfg.json_mode {
            b["response_format"] = serde_json::json!({"type": "json_object"});
        }
        b
    };
    let content = endpoints.chat(&body(&messages))?;
    let first = match reply::parse(&content, link.max_subtask) {
        Ok(a) => return Ok(a),
        Err(e) => e,
    };
    link.health.retries.fetch_add(1, Ordering::Relaxed);
    log::debug!("planner: unusable answer ({first}); asking again");
    let echo: String = content.chars().take(MAX_ECHO).collect();
    messages.push(serde_json::json!({"role": "assistant", "content": echo}));
    messages.push(serde_json::json!({
        "role": "user",
        "content": format!(
            "That answer could not be used: {first}. Reply with only one JSON object, \
             nothing else, like {{\"subtask\": \"pick up the red cup\", \"done\": false}}, \
             with a subtask of at most {} bytes.",
            link.max_subtask
        ),
    }));
    let content = endpoints.chat(&body(&messages))?;
    reply::parse(&content, link.max_subtask).map_err(AskError::Parse)
}

/// The frame as a PNG `data:` URL (what OpenAI-style vision endpoints take).
pub fn encode_png(g: Geometry, data: &[u8]) -> Result<String, png::EncodingError> {
    use base64::Engine as _;
    let hwc: std::borrow::Cow<'_, [u8]> = if g.chw && g.channels > 1 {
        let plane = g.height * g.width;
        let mut out = vec![0u8; data.len()];
        for (p, px) in out.chunks_exact_mut(g.channels).enumerate() {
            for (c, v) in px.iter_mut().enumerate() {
                *v = data[c * plane + p];
            }
        }
        out.into()
    } else {
        data.into()
    };
    let mut png = Vec::with_capacity(hwc.len() / 2 + 1024);
    {
        let mut enc = png::Encoder::new(&mut png, g.width as u32, g.height as u32);
        enc.set_color(match g.channels {
            1 => png::ColorType::Grayscale,
            4 => png::ColorType::Rgba,
            _ => png::ColorType::Rgb,
        });
        enc.set_depth(png::BitDepth::Eight);
        enc.set_compression(png::Compression::Fast);
        let mut w = enc.write_header()?;
        w.write_image_data(&hwc)?;
    }
    let b64 = base64::engine::general_purpose::STANDARD.encode(&png);
    Ok(format!("data:image/png;base64,{b64}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_layouts_are_recognised() {
        let hwc = Geometry::of(&[224, 224, 3]).expect("hwc");
        assert!(!hwc.chw && hwc.channels == 3 && hwc.bytes() == 224 * 224 * 3);
        let chw = Geometry::of(&[1, 3, 96, 128]).expect("batched chw");
        assert!(chw.chw && chw.height == 96 && chw.width == 128);
        assert_eq!(Geometry::of(&[8]), None);
        assert_eq!(Geometry::of(&[5, 6, 7]), None);
    }

    #[test]
    fn a_chw_frame_becomes_a_png_of_the_same_pixels() {
        use base64::Engine as _;
        let g = Geometry::of(&[3, 2, 2]).expect("chw");
        // R plane, G plane, B plane.
        let data = [1, 2, 3, 4, 10, 20, 30, 40, 100, 101, 102, 103];
        let url = encode_png(g, &data).expect("encodes");
        let b64 = url
            .strip_prefix("data:image/png;base64,")
            .expect("data url");
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .expect("base64");
        let mut r = png::Decoder::new(std::io::Cursor::new(bytes))
            .read_info()
            .expect("png");
        let mut px = vec![0; r.output_buffer_size().expect("size")];
        r.next_frame(&mut px).expect("frame");
        assert_eq!(&px[..6], &[1, 10, 100, 2, 20, 101]);
    }

    #[test]
    fn the_api_key_file_is_read_at_start_up_naming_the_key() {
        let mut cfg = PlannerConfig {
            api_key: Some(Secret("inline".into())),
            ..PlannerConfig::default()
        };
        assert_eq!(api_key(&cfg).unwrap(), Some(Secret("inline".into())));
        cfg.api_key_file = Some(std::path::PathBuf::from("/nonexistent/missing-key"));
        let e = api_key(&cfg).unwrap_err().to_string();
        assert!(
            e.contains("planner.api_key_file") && e.contains("missing-key"),
            "{e}"
        );
        let f = std::env::temp_dir().join(format!("policyd-planner-key-{}", std::process::id()));
        std::fs::write(&f, "sk-from-file\n").unwrap();
        cfg.api_key_file = Some(f.clone());
        assert_eq!(api_key(&cfg).unwrap(), Some(Secret("sk-from-file".into())));
        std::fs::write(&f, "\n").unwrap();
        assert!(
            api_key(&cfg)
                .unwrap_err()
                .to_string()
                .contains("planner.api_key_file")
        );
        let _ = std::fs::remove_file(f);
    }

    #[test]
    fn the_request_path_hands_over_a_frame_only_when_asked() {
        let cfg = PlannerConfig::default();
        let link = Link::new(&cfg, Geometry::of(&[2, 2, 1]), 16);
        link.offer_image(&[1, 2, 3, 4]);
        let (_tx, rx) = channel();
        assert!(matches!(
            link.take_image(Duration::ZERO, &rx, |d| d.to_vec()),
            Ok(None)
        ));
        // Now asked: the next offer is taken, one of the wrong size is not.
        link.offer_image(&[9; 5]);
        link.offer_image(&[5, 6, 7, 8]);
        let got = link.take_image(Duration::from_millis(50), &rx, |d| d.to_vec());
        assert!(
            matches!(got, Ok(Some(ref d)) if d == &[5, 6, 7, 8]),
            "{got:?}"
        );
    }
}
