//! What is policyd told to serve, and how? The configuration, resolved: every value checked,
//! every closed set an enum, every path absolute against the file's folder, one
//! [`PolicySpec`] per policy. `raw.rs` is the file's shape, `check.rs` turns it into this; the
//! two are never confused. Parsing reads the config file and nothing else: key files,
//! certificates and models are opened by the layers that use them ([`crate::net`],
//! [`crate::planner`], [`crate::policy`]). Checks against the engine's real inputs and
//! outputs are [`crate::bind`]'s.

mod check;
mod raw;

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::dtype::ElemType;
use crate::protocol::dialect::ResetReply;

pub use check::check_url;

/// A configuration error. The message names the config key and what to fix.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("config {path}: {message}")]
    Parse { path: String, message: String },
    #[error("config key `{key}`: {message}")]
    Invalid { key: String, message: String },
}

/// An error naming `key` (the layers that open what the config names use it too).
pub fn invalid(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        message: message.into(),
    }
}

/// The whole configuration, resolved.
#[derive(Clone, Debug)]
pub struct Config {
    /// `[server]`: listener and per-connection limits (shared by every policy).
    pub server: ServerConfig,
    /// `[auth]`: where the API keys are; [`crate::net::auth`] reads them.
    pub auth: AuthConfig,
    /// `[tls]`, when both certificate and key are given; [`crate::net::tls`] loads them.
    pub tls: Option<TlsConfig>,
    /// `[planner]`: it serves the default policy only.
    pub planner: PlannerConfig,
    /// `[lerobot]`: LeRobot's gRPC service, when configured.
    pub lerobot: Option<LerobotConfig>,
    /// One entry per policy served: the top-level sections of a single-policy file (named
    /// `default`), or each `[[policies]]` entry, in file order. Never empty.
    pub policies: Vec<PolicySpec>,
    /// Index into `policies` of the one served to clients that name none.
    pub default: usize,
    /// Whether the file used `[[policies]]` (errors and reports then name each policy).
    pub named: bool,
}

/// One policy, as a single-policy file would describe it: its engine, bindings, metadata and
/// pacing, with the top-level `[pacing]` filled in where it gives none.
#[derive(Clone, Debug)]
pub struct PolicySpec {
    /// `default` for a single-policy config; clients choose others by name.
    pub name: String,
    /// Served to clients that name no policy.
    pub is_default: bool,
    pub engine: EngineConfig,
    /// Where the model comes from (a file, or bytes built into the binary for the demo).
    pub model: ModelSource,
    /// Observation key → engine input.
    pub inputs: Vec<InputConfig>,
    /// Engine output → reply key.
    pub outputs: Vec<OutputConfig>,
    /// Sent verbatim (as msgpack) in the metadata frame on connect.
    pub metadata: toml::Table,
    /// When replies are released and how action chunks are cut.
    pub pacing: PacingConfig,
    /// A session whose prompt changes is reset (a new instruction starts fresh).
    pub reset_on_prompt_change: bool,
    /// A multi-step policy: `[engine]` is the prefix, then `[denoise]` under `[sampler]`.
    pub pipeline: Option<PipelineConfig>,
}

/// `[denoise]` and `[sampler]`.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelineConfig {
    pub denoise: ModelSource,
    /// (step-graph input, prefix output).
    pub wire: Vec<(String, String)>,
    pub kind: crate::sampler::Kind,
    /// DDPM/DDIM settings.
    pub diffusion: Option<crate::sampler::Diffusion>,
    pub steps: usize,
    pub max_steps: usize,
    pub x: String,
    pub time: String,
    pub output: String,
    /// The step graph returns the next sample itself (`update = "model"`), fed `dt` here.
    pub model_update: Option<String>,
    pub inject_noise: bool,
    /// Flow: how step i's time is computed.
    pub flow_time: crate::sampler::FlowTime,
}

/// `[server]`: the listener and per-connection limits.
#[derive(Clone, Debug, PartialEq)]
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    /// WebSocket connections served at once; one more gets HTTP 503 in the handshake.
    pub max_connections: usize,
    /// Largest inbound message; a larger frame is rejected before it is buffered.
    pub max_message_bytes: usize,
    /// Server ping interval (0 = no pings).
    pub ping_interval_s: f64,
    /// Close a connection whose pong is this late.
    pub ping_timeout_s: f64,
    /// Close a connection idle this long (0 = off: openpi-client never reconnects).
    pub idle_timeout_s: f64,
    /// Time a client gets to complete the HTTP upgrade.
    pub handshake_timeout_s: f64,
    /// Time one WebSocket frame may take to arrive, first byte to last (0 = no limit).
    pub frame_timeout_s: f64,
    /// Sessions (`session_id`) tracked per connection; the least recently used is evicted.
    pub max_sessions: usize,
    /// How `endpoint: reset` is answered (older vllm-omni and RoboArena clients want text).
    pub reset_reply: ResetReply,
    /// Deepest map/list nesting accepted in a request.
    pub max_depth: usize,
    /// Most entries accepted in any map or list of a request.
    pub max_map_entries: usize,
    /// Memory the policies may allocate at start-up, in MiB (0 = unchecked).
    pub memory_budget_mb: u64,
}

/// `[auth]`: who may open a WebSocket. With no key configured, anyone on the network can.
#[derive(Clone, PartialEq)]
pub struct AuthConfig {
    /// Keys written into the config.
    pub api_keys: Vec<String>,
    /// A file of keys, one a line (resolved against the config's folder; read by
    /// [`crate::net::auth::ApiKeys::load`]).
    pub key_file: Option<PathBuf>,
    /// Whether `/metrics` needs a key too (when keys are configured).
    pub protect_metrics: bool,
}

impl std::fmt::Debug for AuthConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthConfig")
            .field(
                "api_keys",
                &format_args!("[{} redacted]", self.api_keys.len()),
            )
            .field("key_file", &self.key_file)
            .field("protect_metrics", &self.protect_metrics)
            .finish()
    }
}

/// `[lerobot]`: LeRobot's `AsyncInference` gRPC service (docs/lerobot.md).
#[derive(Clone, Debug, PartialEq)]
pub struct LerobotConfig {
    /// `listen`: its own address (LeRobot's clients default to port 8080).
    pub listen: std::net::SocketAddr,
    /// `allow`: peers that may connect (addresses or CIDR networks); empty allows all.
    pub allow: Vec<ipnet::IpNet>,
    /// `long_poll_ms`: how long `GetActions` waits for a chunk before answering "none yet"
    /// (LeRobot's server: 2000).
    pub long_poll: std::time::Duration,
    /// `max_payload_bytes`: the largest reassembled observation or config accepted.
    pub max_payload_bytes: usize,
    /// `resize`: what a camera frame of another size than the policy's input gets.
    pub resize: LerobotResize,
    /// `max_connections`: gRPC connections open at once; more are closed as they arrive.
    pub max_connections: usize,
    /// `handshake_timeout_s`: time from accept to the HTTP/2 connection preface.
    pub handshake_timeout: std::time::Duration,
    /// `idle_timeout_s`: a connection with no call in progress for this long is closed.
    pub idle_timeout: std::time::Duration,
    /// `chunk_timeout_s`: the longest wait for an observation's next chunk (the first included).
    pub chunk_timeout: std::time::Duration,
    /// `observation_timeout_s`: the longest one observation may take to arrive whole.
    pub observation_timeout: std::time::Duration,
    /// `takeover_after_s`: how long the session's owner must be silent before another
    /// connection may take the session over.
    pub takeover_after: std::time::Duration,
    /// `[[lerobot.serve]]`: the names a client may ask for, and the policy each means.
    pub serve: Vec<LerobotServe>,
}

/// How camera frames whose size differs from the policy's input are handled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LerobotResize {
    /// Bilinear, half-pixel centres, no antialiasing, on uint8: what LeRobot 0.6.1's server
    /// does (`F.interpolate(mode="bilinear", align_corners=False)`).
    Bilinear,
    /// Refuse the policy setup: the client must send frames at the policy's resolution
    /// (the upstream resize is disputed: lerobot#2475, #2980).
    Refuse,
}

/// One `[[lerobot.serve]]` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LerobotServe {
    /// The client's `pretrained_name_or_path`.
    pub pretrained: String,
    /// The served policy's name.
    pub policy: String,
    /// The client's `policy_type` must equal it, if given.
    pub policy_type: Option<String>,
}

/// `[tls]`: serve `wss://` (and `https://` health) with this certificate and key (PEM).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsConfig {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// `[planner]`: a vision-language model behind an OpenAI-compatible chat-completions API that
/// names the policy's next subtask (see docs/planner.md). Its values are checked only when
/// `enabled`.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannerConfig {
    pub enabled: bool,
    /// Base URLs (`http://host:port`), used round-robin.
    pub endpoints: Vec<String>,
    /// The `model` field of each request.
    pub model: String,
    /// Sent as `Authorization: Bearer …`, when written into the config.
    pub api_key: Option<Secret>,
    /// A file holding the API key (resolved; read by [`crate::planner::api_key`]).
    pub api_key_file: Option<PathBuf>,
    /// The system message; `{instruction}` and `{subtask}` are replaced.
    pub system_prompt: String,
    /// The high-level instruction.
    pub instruction: String,
    /// Planner calls per second (at most).
    pub rate_hz: f64,
    /// The image input binding (its `key`) whose latest frame is sent, or none for text only.
    pub camera: Option<String>,
    /// The text input binding the subtask fills.
    pub prompt_key: String,
    /// Whose prompt wins when both the client and the planner give one.
    pub precedence: Precedence,
    pub max_tokens: u32,
    pub temperature: f64,
    /// Ask for JSON output (`response_format: {"type": "json_object"}`).
    pub json_mode: bool,
    /// Longest a planner call may take, connection included.
    pub request_timeout_s: f64,
    /// Longest wait between readiness probes of a failing endpoint.
    pub max_backoff_s: f64,
    /// A local model server to start and supervise (argv; empty: none).
    pub serve_command: Vec<String>,
    /// A line of the server's output that says it is ready (else: the readiness probe).
    pub ready_marker: Option<String>,
    /// Longest wait for `serve_command` to become ready.
    pub ready_timeout_s: f64,
    /// On shutdown the server gets SIGINT, then SIGKILL after this many seconds.
    pub stop_grace_s: f64,
}

impl Default for PlannerConfig {
    /// The planner of a file without `[planner]`: off, with the documented defaults.
    fn default() -> Self {
        check::planner(&raw::RawPlanner::default(), None).expect("the default planner is valid")
    }
}

/// `planner.precedence`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precedence {
    /// A prompt the client sends wins; the subtask fills in when it sends none.
    Client,
    /// The subtask wins once there is one; the client's prompt becomes the instruction.
    Planner,
}

impl std::fmt::Display for Precedence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precedence::Client => "client",
            Precedence::Planner => "planner",
        })
    }
}

/// A secret from the config: kept out of `Debug` output and logs.
#[derive(Clone, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("\"[redacted]\"")
    }
}

/// The planner's default system message.
pub const DEFAULT_PLANNER_PROMPT: &str = "You plan the next step of a robot arm. The overall \
instruction is: {instruction}. Look at the camera image and name the single next subtask the \
robot should do now, as a short imperative phrase. The current subtask is: {subtask}. Answer with \
only a JSON object: {\"subtask\": \"<next subtask>\", \"done\": <true when the instruction is \
complete>}.";

/// `[pacing]`: the latency budget, timed actions and the `observe` filters.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PacingConfig {
    /// Control rate of the robot: action step i is `timestamp + i / fps`, and `delay_steps`
    /// counts steps of `1 / fps`.
    pub fps: f64,
    /// Release every reply at `receive time + budget`, never earlier (0 = as soon as ready).
    pub latency_budget_ms: f64,
    /// Keep at most this many actions of each chunk (0 = all).
    pub actions_per_chunk: usize,
    /// Drop the first `delay_steps` actions of each chunk: they are stale on arrival.
    pub skip_stale_actions: bool,
    /// Add `delay_steps` to every dict reply (openpi replies and `observe` pushes).
    pub reply_delay_steps: bool,
    /// End-to-end latencies kept per session for `delay_steps` (its p95).
    pub latency_window: usize,
    /// Answer a skipped `observe` observation with `{"type": "skipped", …}`.
    pub report_skipped: bool,
    /// `observe`: skip an observation whose timestep was already predicted (or is running).
    pub skip_predicted_timesteps: bool,
    /// `observe`: skip an observation whose state is within this L2 distance (raw units) of
    /// the last accepted one (0 = off, the default: LeRobot's filter starves clients).
    pub similarity_atol: f64,
    /// The observation key whose value the similarity filter compares (an input binding).
    pub similarity_key: String,
    /// How long before a release time the pacing clock stops sleeping and busy-waits, in µs.
    /// More costs CPU and absorbs a noisier scheduler's wake-up delays.
    pub spin_us: u64,
}

impl Default for PacingConfig {
    fn default() -> Self {
        PacingConfig {
            fps: 30.0,
            latency_budget_ms: 0.0,
            actions_per_chunk: 0,
            skip_stale_actions: false,
            reply_delay_steps: true,
            latency_window: 100,
            report_skipped: false,
            skip_predicted_timesteps: true,
            similarity_atol: 0.0,
            similarity_key: String::new(),
            spin_us: 500,
        }
    }
}

/// `[engine]`: which backend runs the model, resolved (TensorRT options have their defaults).
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    pub backend: Backend,
    /// `tensorrt`, or `ort` with a GPU provider: the CUDA device ordinal.
    pub device: u32,
    /// `tensorrt`: run on this DLA core instead of the GPU.
    pub dla_core: Option<u32>,
    /// `tensorrt`: replay copy-in → enqueue → copy-out as one CUDA graph after warm-up.
    pub cuda_graph: bool,
    /// `tensorrt`: whether engine inputs and outputs live in mapped host memory.
    pub zero_copy: ZeroCopy,
    /// `tensorrt`: libnvinfer to open (default: the sonames of TensorRT 11, 10, 8).
    pub tensorrt_library: Option<PathBuf>,
    /// Requests in flight at once (each has its own input and output buffers).
    pub slots: usize,
    /// Runs before the server reports ready.
    pub warmup_runs: usize,
    /// A run taking longer than this counts as a stalled engine (0 = never).
    pub timeout_ms: u64,
    /// `cpu` and `ort`: threads one run may use; 1 runs on the engine's own thread only.
    pub threads: usize,
    /// `ort`: the onnxruntime library named by the config (resolved against its folder);
    /// `None`: `ORT_DYLIB_PATH`, then the system's library path.
    pub ort_library: Option<PathBuf>,
    /// `ort`: execution providers in order of preference; CPU is always the last resort.
    pub providers: Vec<Provider>,
}

/// `engine.providers`: an onnxruntime execution provider policyd knows how to enable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Provider {
    Cpu,
    Cuda,
    Tensorrt,
}

impl Provider {
    pub const ALL: [Provider; 3] = [Provider::Cpu, Provider::Cuda, Provider::Tensorrt];
    /// The config's name.
    pub fn name(self) -> &'static str {
        match self {
            Provider::Cpu => "cpu",
            Provider::Cuda => "cuda",
            Provider::Tensorrt => "tensorrt",
        }
    }
    /// onnxruntime's own name (what `GetAvailableProviders` lists).
    pub fn ort_name(self) -> &'static str {
        match self {
            Provider::Cpu => "CPUExecutionProvider",
            Provider::Cuda => "CUDAExecutionProvider",
            Provider::Tensorrt => "TensorrtExecutionProvider",
        }
    }
}

/// `engine.backend`: the backends this build can have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// tract-onnx, pure Rust.
    Cpu,
    /// TensorRT through policyd's C ABI (the `tensorrt` feature).
    Tensorrt,
    /// onnxruntime through the `ort` crate, its library loaded at run time (the `ort` feature).
    Ort,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Tensorrt => "tensorrt",
            Backend::Ort => "ort",
        }
    }
}

/// `engine.zero_copy`: whether a GPU backend keeps engine inputs and outputs in mapped host
/// memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ZeroCopy {
    /// On for integrated GPUs (Jetson: CPU and GPU share DRAM), off for discrete ones.
    Auto,
    On,
    Off,
}

/// Where a model comes from.
#[derive(Clone, PartialEq)]
pub enum ModelSource {
    /// A file on disk (`[engine] model`, resolved against the config's folder).
    File(PathBuf),
    /// Bytes built into the binary (the embedded demo policy, a firmware image), with the
    /// graph's external data (`<graph>.data`: weights past ONNX's 2 GB protobuf limit), empty
    /// when it has none.
    Embedded {
        name: &'static str,
        bytes: &'static [u8],
        data: &'static [u8],
    },
}

/// The path, or the built-in file's name and size (not its bytes).
impl std::fmt::Debug for ModelSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModelSource::File(p) => f.debug_tuple("File").field(p).finish(),
            ModelSource::Embedded { name, bytes, data } => {
                write!(
                    f,
                    "Embedded({name}, {} + {} bytes)",
                    bytes.len(),
                    data.len()
                )
            }
        }
    }
}

impl ModelSource {
    pub fn describe(&self) -> String {
        match self {
            ModelSource::File(p) => p.display().to_string(),
            ModelSource::Embedded { name, .. } => format!("<embedded {name}>"),
        }
    }

    /// Size of the model's weights as stored, for the memory budget: with the external data
    /// `policyd-export` writes beside a large graph (`<graph>.data`).
    pub fn size(&self) -> u64 {
        let len = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
        match self {
            ModelSource::File(p) => len(p) + len(&external_data_path(p)),
            ModelSource::Embedded { bytes, data, .. } => (bytes.len() + data.len()) as u64,
        }
    }
}

/// Where `policyd-export` puts a graph's external data: `<graph>.data` beside it (ONNX names
/// the file inside the graph; a firmware image bakes this one).
pub fn external_data_path(model: &Path) -> PathBuf {
    let mut name = model.as_os_str().to_owned();
    name.push(".data");
    PathBuf::from(name)
}

impl ModelSource {
    /// The embedded model's external data (empty for a file or a graph without any).
    pub fn embedded_data(&self) -> &'static [u8] {
        match self {
            ModelSource::Embedded { data, .. } => data,
            ModelSource::File(_) => &[],
        }
    }
}

/// `[[inputs]]`: one observation key bound to one engine input.
#[derive(Clone, Debug, PartialEq)]
pub struct InputConfig {
    /// Observation key; nested maps are joined with `/` (`images/cam_high`).
    pub key: String,
    /// Engine input name; `None` only for a pi0.5 state the engine does not take (its
    /// normalised values then live in a host buffer, for the prompt alone).
    pub tensor: Option<String>,
    /// Numbers in the accepted wire dtypes, text, or a tokenized prompt.
    pub kind: InputKind,
    /// Expected wire shape.
    pub shape: Vec<usize>,
    pub layout: Layout,
    /// `y = ((x·scale + offset) − mean) / (std + eps)`.
    pub scale: f64,
    pub offset: f64,
    /// Per-feature (length of the wire shape's last axis), per-element, or one value. A
    /// LeRobot `min`/`max` binding is resolved into these (`mean` the midpoint, `std` half
    /// the range, `eps` 0): the same map, written once.
    pub mean: Vec<f64>,
    pub std: Vec<f64>,
    pub eps: f64,
    /// Frames the engine input holds: this one and the session's `history − 1` before it.
    pub history: usize,
    /// May be absent from a request; the engine input is then filled with `fill`.
    pub optional: bool,
    pub fill: f64,
    /// Fixed engine shape, for models whose input has symbolic dimensions.
    pub engine_shape: Option<Vec<usize>>,
    /// Serve NaN and infinity instead of refusing the request (`inputs[i].allow_non_finite`).
    pub allow_non_finite: bool,
}

/// What an input binding accepts.
#[derive(Clone, Debug, PartialEq)]
pub enum InputKind {
    /// Arrays in these wire dtypes, converted to the engine's.
    Numeric(Vec<ElemType>),
    /// A string (`dtypes = ["text"]`) whose UTF-8 bytes fill a `[max_bytes]` input.
    Text,
    /// A string tokenized into ids (`tensor`) and a mask (`[inputs.tokenizer]`).
    Tokens(Box<TokenizerConfig>),
}

/// `[inputs.tokenizer]`: a prompt tokenized as openpi's `PaligemmaTokenizer` does.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenizerConfig {
    /// The SentencePiece `.model` or `tokenizer.json`.
    pub file: ModelSource,
    pub format: crate::tokenizer::Format,
    /// Length of the ids and the mask.
    pub max_tokens: usize,
    pub mask_tensor: String,
    pub pad_id: i64,
    /// Refuse a prompt past `max_tokens` instead of truncating it.
    pub refuse_overflow: bool,
    /// `pi05`: the binding whose normalised values are discretised.
    pub state_key: Option<String>,
    /// A tokenizer.json's BOS token.
    pub bos: Option<String>,
    /// The most prompt bytes read (`None`: sized from the tokenizer when it is loaded).
    pub max_prompt_bytes: Option<usize>,
}

impl InputConfig {
    /// A binding that takes a string on the wire: text or a tokenized prompt.
    pub fn is_text(&self) -> bool {
        matches!(self.kind, InputKind::Text | InputKind::Tokens(_))
    }

    /// The tokenizer of a tokenized prompt.
    pub fn tokenizer(&self) -> Option<&TokenizerConfig> {
        match &self.kind {
            InputKind::Tokens(t) => Some(t),
            _ => None,
        }
    }

    /// The accepted wire dtypes (none for text).
    pub fn dtypes(&self) -> &[ElemType] {
        match &self.kind {
            InputKind::Numeric(d) => d,
            InputKind::Text | InputKind::Tokens(_) => &[],
        }
    }
}

/// `[[outputs]]`: one engine output sent under one reply key.
#[derive(Clone, Debug, PartialEq)]
pub struct OutputConfig {
    /// Engine output name.
    pub tensor: String,
    /// Reply key.
    pub key: String,
    /// Wire dtype of the reply array (`float32` or `float64`).
    pub dtype: ElemType,
    /// Keep only the first N entries of the last axis (openpi's `actions[:, :14]`).
    pub columns: Option<usize>,
    /// Un-normalisation `x·(std + eps) + mean`, per action dimension (or one value); LeRobot's
    /// `min`/`max` resolved as for inputs.
    pub mean: Vec<f64>,
    pub std: Vec<f64>,
    pub eps: f64,
    /// Rows `[start, end)` of the first axis kept (the whole axis when `None`).
    pub rows: Option<(usize, usize)>,
    /// Relative actions: absolute = un-normalised output + the input's values as sent.
    pub relative: Option<RelativeConfig>,
}

/// `[[outputs]] relative_to`/`relative_mask`: the model predicts actions relative to the state,
/// and the reply carries absolute ones. Column `j` of every kept row gets the input's value
/// `j` as the request sent it, for each `j` with `mask[j]`; the mask is checked against both
/// lengths once the bindings are compiled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RelativeConfig {
    /// The input binding's key (`observation.state`).
    pub key: String,
    /// `None`: every kept column.
    pub mask: Option<Vec<bool>>,
}

/// How an input's axes are rearranged on the way to the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    None,
    HwcToChw,
    ChwToHwc,
}

impl Layout {
    /// Destination axis k is source axis `perm[k]` (over the last three axes).
    pub fn perm(self) -> Option<[usize; 3]> {
        match self {
            Layout::None => None,
            Layout::HwcToChw => Some([2, 0, 1]),
            Layout::ChwToHwc => Some([1, 2, 0]),
        }
    }
}

impl Config {
    /// Reads and checks a config file; paths in it are resolved against its folder.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        Config::parse(&text, &path.display().to_string(), Some(base))
    }

    /// Parses and checks config text (no I/O). `base` resolves the relative paths in it;
    /// without it they stay as written (the embedded default replaces its model).
    pub fn parse(text: &str, origin: &str, base: Option<&Path>) -> Result<Config, ConfigError> {
        let raw: raw::RawConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: origin.to_string(),
            message: e.to_string(),
        })?;
        check::resolve(raw, base)
    }

    /// The policy served to clients that name none.
    pub fn default_policy(&self) -> &PolicySpec {
        &self.policies[self.default]
    }

    /// Applies the command line's `--host`/`--port` and checks the result again.
    pub fn override_listen(
        &mut self,
        host: Option<&str>,
        port: Option<u16>,
    ) -> Result<(), ConfigError> {
        if let Some(h) = host {
            if h.trim().is_empty() {
                return Err(invalid("server.host", "must not be empty"));
            }
            self.server.host = h.to_string();
        }
        if let Some(p) = port {
            self.server.port = p;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: &str = r#"
[engine]
model = "m.onnx"
[[inputs]]
key = "state"
tensor = "state"
dtypes = ["float32", "float64"]
shape = [8]
[[outputs]]
tensor = "actions"
"#;

    fn err(extra: &str) -> String {
        let text = format!("{MIN}\n{extra}");
        match Config::parse(&text, "test.toml", Some(Path::new("/tmp"))) {
            Ok(_) => panic!("accepted: {extra}"),
            Err(e) => e.to_string(),
        }
    }

    fn replace(from: &str, to: &str) -> String {
        match Config::parse(&MIN.replace(from, to), "test.toml", Some(Path::new("/tmp"))) {
            Ok(_) => panic!("accepted: {to}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn minimal_config_has_documented_defaults() {
        let c = Config::parse(MIN, "t", Some(Path::new("/etc/policyd"))).unwrap();
        assert_eq!(c.server.host, "127.0.0.1");
        assert_eq!(c.server.port, 8000);
        assert_eq!(c.server.idle_timeout_s, 0.0);
        assert_eq!(c.server.ping_interval_s, 20.0);
        let p = c.default_policy();
        assert_eq!(p.outputs[0].key, "actions");
        assert_eq!(p.outputs[0].dtype, ElemType::F32);
        assert_eq!(
            p.model,
            ModelSource::File(PathBuf::from("/etc/policyd/m.onnx"))
        );
        assert_eq!(p.engine.backend, Backend::Cpu);
        assert_eq!(p.engine.zero_copy, ZeroCopy::Auto);
        assert_eq!(c.planner.precedence, Precedence::Client);
        assert_eq!(c.server.reset_reply, ResetReply::Msgpack);
    }

    #[test]
    fn planner_errors_name_the_key() {
        let on = |extra: &str| {
            err(&format!(
                "[planner]\nenabled = true\nendpoints = [\"http://127.0.0.1:8080\"]\n\
                 model = \"m\"\n{extra}"
            ))
        };
        assert!(err("[planner]\nenabled = true\nmodel = \"m\"").contains("planner.endpoints"));
        assert!(
            err("[planner]\nenabled = true\nendpoints = [\"http://h\"]").contains("planner.model")
        );
        let https = err(
            "[planner]\nenabled = true\nmodel = \"m\"\nendpoints = [\"http://a\", \"https://b\"]",
        );
        assert!(
            https.contains("planner.endpoints[1]") && https.contains("https"),
            "{https}"
        );
        assert!(on("rate_hz = 0.0").contains("planner.rate_hz"));
        assert!(on("precedence = \"robot\"").contains("planner.precedence"));
        assert!(on("max_tokens = 0").contains("planner.max_tokens"));
        assert!(on("temperature = 3.0").contains("planner.temperature"));
        assert!(on("request_timeout_s = 0.0").contains("planner.request_timeout_s"));
        assert!(on("ready_marker = \"up\"").contains("planner.ready_marker"));
        assert!(on("serve_command = [\"\"]").contains("planner.serve_command"));
        assert!(on("tempo = 1").contains("tempo"));
        // Off (the default), nothing is required.
        let ok = format!("{MIN}\n[planner]\nrate_hz = 2.0");
        assert!(Config::parse(&ok, "t", None).is_ok());
    }

    #[test]
    fn the_api_key_is_never_printed() {
        let text = format!(
            "{MIN}\n[planner]\nenabled = true\nendpoints = [\"http://h\"]\nmodel = \"m\"\n\
             api_key = \"sk-secret-123\""
        );
        let cfg = Config::parse(&text, "t", None).expect("parses");
        assert!(!format!("{cfg:?}").contains("sk-secret-123"));
    }

    #[test]
    fn lerobot_section_is_checked_key_by_key() {
        let ok = |extra: &str| {
            Config::parse(&format!("{MIN}\n{extra}"), "test.toml", None)
                .unwrap_or_else(|e| panic!("{extra}: {e}"))
        };
        assert_eq!(ok("").lerobot, None, "off without the section");
        let c = ok(
            "[lerobot]\nlisten = \"0.0.0.0:8080\"\nallow = [\"10.0.0.0/8\", \"192.168.1.7\"]\n\
                    [[lerobot.serve]]\npretrained = \"user/act\"\npolicy_type = \"act\"",
        )
        .lerobot
        .expect("on");
        assert_eq!(c.listen.port(), 8080);
        assert_eq!(c.allow.len(), 2);
        assert_eq!(c.long_poll, std::time::Duration::from_millis(2000));
        assert_eq!(c.resize, LerobotResize::Bilinear);
        assert_eq!(c.max_connections, 16);
        assert_eq!(c.idle_timeout, std::time::Duration::from_secs(120));
        assert_eq!(c.takeover_after, std::time::Duration::from_secs(10));
        assert_eq!(
            c.serve[0].policy, "default",
            "the default policy when none is named"
        );
        for (extra, key) in [
            ("[lerobot]", "lerobot.listen"),
            ("[lerobot]\nlisten = \"8080\"", "lerobot.listen"),
            (
                "[lerobot]\nlisten = \"0.0.0.0:1\"\nallow = [\"10.0.0/8\"]",
                "lerobot.allow",
            ),
            (
                "[lerobot]\nlisten = \"0.0.0.0:1\"\nlong_poll_ms = 0",
                "lerobot.long_poll_ms",
            ),
            (
                "[lerobot]\nlisten = \"0.0.0.0:1\"\nmax_payload_bytes = 10",
                "lerobot.max_payload_bytes",
            ),
            (
                "[lerobot]\nlisten = \"0.0.0.0:1\"\nresize = \"nearest\"",
                "lerobot.resize",
            ),
            ("[lerobot]\nlisten = \"0.0.0.0:1\"\nport = 1", "port"),
            (
                "[lerobot]\nlisten = \"0.0.0.0:1\"\n[[lerobot.serve]]\npretrained = \"a\"\npolicy = \"b\"",
                "lerobot.serve[0].policy",
            ),
            (
                "[lerobot]\nlisten = \"0.0.0.0:1\"\n[[lerobot.serve]]\npretrained = \" \"",
                "lerobot.serve[0].pretrained",
            ),
            (
                "[lerobot]\nlisten = \"0.0.0.0:1\"\nmax_connections = 0",
                "lerobot.max_connections",
            ),
            (
                "[lerobot]\nlisten = \"0.0.0.0:1\"\nhandshake_timeout_s = 0",
                "lerobot.handshake_timeout_s",
            ),
            (
                "[lerobot]\nlisten = \"0.0.0.0:1\"\nidle_timeout_s = 1",
                "lerobot.idle_timeout_s",
            ),
            (
                "[lerobot]\nlisten = \"0.0.0.0:1\"\nchunk_timeout_s = nan",
                "lerobot.chunk_timeout_s",
            ),
            (
                "[lerobot]\nlisten = \"0.0.0.0:1\"\nchunk_timeout_s = 20",
                "lerobot.observation_timeout_s",
            ),
            (
                "[lerobot]\nlisten = \"0.0.0.0:1\"\ntakeover_after_s = -1",
                "lerobot.takeover_after_s",
            ),
        ] {
            let e = err(extra);
            assert!(e.contains(key), "{extra}: {e}");
        }
    }

    #[test]
    fn errors_name_the_key() {
        assert!(err("[server]\nmax_connections = 0").contains("server.max_connections"));
        assert!(err("[server]\nmax_message_bytes = 10").contains("server.max_message_bytes"));
        assert!(err("[server]\nping_timeout_s = -1.0").contains("server.ping_timeout_s"));
        assert!(err("[server]\nreset_reply = \"json\"").contains("server.reset_reply"));
        assert!(
            err("[server]\nportt = 1").contains("portt"),
            "unknown keys are refused"
        );
        assert!(
            replace(
                "dtypes = [\"float32\", \"float64\"]",
                "dtypes = [\"float33\"]"
            )
            .contains("inputs[0].dtypes")
        );
        assert!(
            replace("dtypes = [\"float32\", \"float64\"]", "dtypes = []")
                .contains("inputs[0].dtypes")
        );
        assert!(
            replace("shape = [8]", "shape = [8]\nlayout = \"hwc_to_chw\"")
                .contains("inputs[0].layout")
        );
        assert!(
            replace(
                "shape = [8]",
                "shape = [8]\nmean = [0.0, 1.0]\nstd = [1.0, 1.0]"
            )
            .contains("inputs[0].mean")
        );
        assert!(replace("shape = [8]", "shape = [8]\nmean = [0.0]").contains("inputs[0].mean"));
        // Shapes whose element count overflows (found by the config fuzzer) or is beyond any
        // buffer; an engine_shape likewise.
        for shape in ["[4444444444444444443, 224, 224]", "[65536, 65536]"] {
            let e = replace("shape = [8]", &format!("shape = {shape}"));
            assert!(
                e.contains("inputs[0].shape") && e.contains("elements"),
                "{e}"
            );
        }
        assert!(
            replace(
                "shape = [8]",
                "shape = [8]\nengine_shape = [1, 4294967296, 4294967296]"
            )
            .contains("inputs[0].engine_shape")
        );
        assert!(
            replace("shape = [8]", "shape = [8]\nengine_shape = [1, 0]")
                .contains("inputs[0].engine_shape")
        );
        assert!(replace("key = \"state\"", "key = \"endpoint\"").contains("inputs[0].key"));
        assert!(
            replace(
                "tensor = \"actions\"",
                "tensor = \"actions\"\ndtype = \"int8\""
            )
            .contains("outputs[0].dtype")
        );
        assert!(
            replace(
                "model = \"m.onnx\"",
                "model = \"m.onnx\"\nbackend = \"gpu\""
            )
            .contains("engine.backend")
        );
        // Un-normalisation coefficients past float32 (every vllm-omni reply is float32).
        let wide = |mean: &str, std: &str| {
            replace(
                "tensor = \"actions\"",
                &format!(
                    "tensor = \"actions\"\ndtype = \"float64\"\nmean = [{mean}]\nstd = [{std}]"
                ),
            )
        };
        let e = wide("1e39", "1.0");
        assert!(
            e.contains("outputs[0].mean") && e.contains("float32"),
            "{e}"
        );
        let e = wide("0.0", "3.5e38");
        assert!(e.contains("outputs[0].std") && e.contains("float32"), "{e}");
        // allow_non_finite is for numeric inputs.
        let text = format!(
            "{MIN}\n[[inputs]]\nkey = \"prompt\"\ntensor = \"p\"\ndtypes = [\"text\"]\nshape = [8]\nallow_non_finite = true\n"
        );
        let e = Config::parse(&text, "t", Some(Path::new(".")))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("inputs[1].dtypes") && e.contains("allow_non_finite"),
            "{e}"
        );
        assert!(err("[metadata]\nwhen = 1979-05-27").contains("metadata.when"));
        let dup = format!(
            "{MIN}\n[[inputs]]\nkey = \"state\"\ntensor = \"x\"\ndtypes = [\"float32\"]\nshape = [1]\n"
        );
        let e = Config::parse(&dup, "t", Some(Path::new(".")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("inputs[1].key"), "{e}");
    }

    #[test]
    fn parse_errors_say_where() {
        let e = Config::parse("[server\nport = 1", "bad.toml", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("bad.toml"), "{e}");
        let e = Config::parse(
            "[server]\nport = \"x\"\n[engine]\nmodel=\"m\"",
            "bad.toml",
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("port"), "{e}");
    }

    #[test]
    fn the_packaged_default_config_serves_the_demo_bindings() {
        let packaged = Config::parse(
            include_str!("../../systemd/policyd.toml"),
            "systemd/policyd.toml",
            None,
        )
        .unwrap();
        let demo = Config::parse(include_str!("../../configs/aloha.toml"), "aloha", None).unwrap();
        let (p, d) = (packaged.default_policy(), demo.default_policy());
        assert_eq!(p.inputs, d.inputs);
        assert_eq!(p.outputs, d.outputs);
        assert_eq!(p.metadata, d.metadata);
        assert_eq!(packaged.server.host, "0.0.0.0");
        assert_eq!(
            p.model,
            ModelSource::File(PathBuf::from("/usr/share/policyd/models/aloha.onnx"))
        );
    }
}
