//! Static configuration: the TOML file, parsed and value-checked once at start-up.
//!
//! Every size policyd uses comes from here. This module checks each value on its own (ranges,
//! names, lengths) and names the key in every error; [`crate::bind`] then checks the bindings
//! against the engine's real inputs and outputs and computes the memory budget.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::dtype::ElemType;
use crate::engine::ModelSource;
use crate::limits::{
    MAX_ELEMENTS, MAX_LATENCY_WINDOW, MAX_PATH, MAX_POLICIES, MAX_POLICY_NAME,
    MAX_SIMILARITY_STATE, MAX_SLOTS, element_count,
};
use crate::protocol::RESERVED_KEYS;

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

pub(crate) fn invalid(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        message: message.into(),
    }
}

/// The whole configuration file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub server: ServerConfig,
    /// The engine of a single-policy config (with `[[policies]]`, each has its own).
    #[serde(default)]
    pub engine: EngineConfig,
    /// Observation key → engine input.
    #[serde(default)]
    pub inputs: Vec<InputConfig>,
    /// Engine output → reply key.
    #[serde(default)]
    pub outputs: Vec<OutputConfig>,
    /// When replies are released and how action chunks are cut (see the README's pacing part).
    #[serde(default)]
    pub pacing: PacingConfig,
    /// Sent verbatim (as msgpack) in the metadata frame on connect.
    #[serde(default)]
    pub metadata: toml::Table,
    /// API keys for the WebSocket (and `/metrics`).
    #[serde(default)]
    pub auth: AuthConfig,
    /// TLS (`wss://`).
    #[serde(default)]
    pub tls: TlsConfig,
    /// The optional task planner (a vision-language model that names the next subtask).
    #[serde(default)]
    pub planner: PlannerConfig,
    /// Reset a session when its prompt changes (single-policy configs; with `[[policies]]`,
    /// each policy has its own).
    #[serde(default)]
    pub reset_on_prompt_change: bool,
    /// Several policies served at once, each with its own engine, bindings and metadata;
    /// clients choose one by name (see docs/policies.md). Without it, the top-level
    /// `[engine]`, `[[inputs]]`, `[[outputs]]` and `[metadata]` are the one policy.
    #[serde(default)]
    pub policies: Vec<PolicyConfig>,
    /// Where the model comes from (resolved from `engine.model`, or embedded).
    #[serde(skip)]
    pub model: Option<ModelSource>,
    /// The policy this config describes, once split by [`Config::policy_configs`].
    #[serde(skip)]
    pub policy: PolicyIdentity,
}

/// Which policy a per-policy config is, and its per-policy options.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyIdentity {
    /// `default` for a single-policy config.
    pub name: String,
    pub is_default: bool,
    /// A session whose prompt changes is reset (a new instruction starts fresh).
    pub reset_on_prompt_change: bool,
}

/// `[[policies]]`: one named policy.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyConfig {
    /// Chosen by clients with the path `/policies/<name>` or a `policy` field.
    pub name: String,
    /// Served to clients that name no policy (exactly one policy has it, or the first).
    #[serde(default)]
    pub default: bool,
    pub engine: EngineConfig,
    #[serde(default)]
    pub inputs: Vec<InputConfig>,
    #[serde(default)]
    pub outputs: Vec<OutputConfig>,
    #[serde(default)]
    pub metadata: toml::Table,
    /// This policy's `[pacing]` (replaces the top-level table when given).
    #[serde(default)]
    pub pacing: Option<PacingConfig>,
    /// Shorthand for `pacing.actions_per_chunk` of this policy.
    #[serde(default)]
    pub actions_per_chunk: Option<usize>,
    /// Reset a session when its prompt changes, as if the client had sent `reset`.
    #[serde(default)]
    pub reset_on_prompt_change: bool,
    /// Resolved from `engine.model`.
    #[serde(skip)]
    pub model: Option<ModelSource>,
}

/// `[tls]`: serve `wss://` (and `https://` health) with this certificate and key (PEM),
/// relative to the config file. Both or neither.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// The acceptor, built at start-up.
    #[serde(skip)]
    pub acceptor: Option<crate::net::tls::Tls>,
}

/// `[planner]`: a vision-language model behind an OpenAI-compatible chat-completions API that
/// names the policy's next subtask from the instruction and the current camera view. Off by
/// default; when on, it runs on its own thread at its own rate and the request path only reads
/// its latest answer (see docs/planner.md).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PlannerConfig {
    pub enabled: bool,
    /// Base URLs (`http://host:port`), used round-robin; `/v1/chat/completions` and
    /// `/v1/models` (the readiness probe) are appended.
    pub endpoints: Vec<String>,
    /// The `model` field of each request.
    pub model: String,
    /// Sent as `Authorization: Bearer …` (prefer `api_key_file`).
    pub api_key: Option<Secret>,
    /// A file holding the API key, relative to the config file.
    pub api_key_file: Option<PathBuf>,
    /// The system message; `{instruction}` and `{subtask}` are replaced.
    pub system_prompt: String,
    /// The high-level instruction (a client's prompt replaces it when `precedence = "planner"`).
    pub instruction: String,
    /// Planner calls per second (at most; a slow endpoint makes it slower).
    pub rate_hz: f64,
    /// The image input binding (its `key`) whose latest frame is sent, or none for text only.
    /// It must accept `uint8` in HWC or CHW layout with 1, 3 or 4 channels.
    pub camera: Option<String>,
    /// The text input binding the subtask fills.
    pub prompt_key: String,
    /// `client`: a prompt the client sends wins, the subtask fills in when it sends none.
    /// `planner`: the subtask wins once there is one, and the client's prompt becomes the
    /// planner's instruction.
    pub precedence: String,
    pub max_tokens: u32,
    pub temperature: f64,
    /// Ask for JSON output (`response_format: {"type": "json_object"}`); turn off for a server
    /// that rejects the field.
    pub json_mode: bool,
    /// Longest a planner call may take, connection included.
    pub request_timeout_s: f64,
    /// Longest wait between readiness probes of a failing endpoint (the backoff doubles from
    /// 0.5 s up to this).
    pub max_backoff_s: f64,
    /// A local model server to start and supervise (argv; empty: none).
    pub serve_command: Vec<String>,
    /// A line of the server's output that says it is ready (else: the readiness probe).
    pub ready_marker: Option<String>,
    /// Longest wait for `serve_command` to become ready before the planner goes on without it.
    pub ready_timeout_s: f64,
    /// On shutdown the server gets SIGINT, then SIGKILL after this many seconds.
    pub stop_grace_s: f64,
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

impl Default for PlannerConfig {
    fn default() -> Self {
        PlannerConfig {
            enabled: false,
            endpoints: Vec::new(),
            model: String::new(),
            api_key: None,
            api_key_file: None,
            system_prompt: DEFAULT_PLANNER_PROMPT.into(),
            instruction: String::new(),
            rate_hz: 1.0,
            camera: None,
            prompt_key: "prompt".into(),
            precedence: "client".into(),
            max_tokens: 128,
            temperature: 0.0,
            json_mode: true,
            request_timeout_s: 10.0,
            max_backoff_s: 30.0,
            serve_command: Vec::new(),
            ready_marker: None,
            ready_timeout_s: 300.0,
            stop_grace_s: 5.0,
        }
    }
}

/// `[auth]`: who may open a WebSocket. With no key configured, anyone on the network can.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// Keys written into the config (prefer `key_file`, so keys stay out of the main config).
    pub api_keys: Vec<String>,
    /// A file of keys, one a line (`#` comments), relative to the config file.
    pub key_file: Option<PathBuf>,
    /// Whether `/metrics` needs a key too (when keys are configured).
    pub protect_metrics: bool,
    /// The keys, read and checked at start-up.
    #[serde(skip)]
    pub keys: crate::net::auth::ApiKeys,
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            api_keys: Vec::new(),
            key_file: None,
            protect_metrics: true,
            keys: Default::default(),
        }
    }
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

/// `[server]`: the listener and per-connection limits.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
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
    /// Time one WebSocket frame may take to arrive, first byte to last (0 = no limit): a
    /// half-sent frame closes the connection after this.
    pub frame_timeout_s: f64,
    /// Sessions (`session_id`) tracked per connection; the least recently used is evicted.
    pub max_sessions: usize,
    /// Reply to `endpoint: reset` as a msgpack map (`msgpack`) or the text frame
    /// `reset successful` (`text`, older vllm-omni and RoboArena clients).
    pub reset_reply: String,
    /// Deepest map/list nesting accepted in a request.
    pub max_depth: usize,
    /// Most entries accepted in any map or list of a request.
    pub max_map_entries: usize,
    /// Memory the policies may allocate at start-up, in MiB (0 = unchecked): a config whose
    /// policies need more is refused, naming each policy's share.
    pub memory_budget_mb: u64,
}

impl ServerConfig {
    pub fn reset_reply(&self) -> crate::protocol::dialect::ResetReply {
        if self.reset_reply == "text" {
            crate::protocol::dialect::ResetReply::Text
        } else {
            crate::protocol::dialect::ResetReply::Msgpack
        }
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8000,
            max_connections: 8,
            max_message_bytes: 4 << 20,
            ping_interval_s: 20.0,
            ping_timeout_s: 20.0,
            idle_timeout_s: 0.0,
            handshake_timeout_s: 10.0,
            frame_timeout_s: 30.0,
            max_sessions: 16,
            reset_reply: "msgpack".into(),
            max_depth: 16,
            max_map_entries: 1024,
            memory_budget_mb: 0,
        }
    }
}

/// `[pacing]`: the latency budget, timed actions and the `observe` filters.
#[derive(Clone, Debug, Deserialize)]
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

/// The backends compiled into this build, for messages.
pub const BACKENDS: &str = match (cfg!(feature = "cpu"), cfg!(feature = "tensorrt")) {
    (true, true) => "cpu, tensorrt",
    (true, false) => "cpu",
    (false, true) => "tensorrt",
    (false, false) => "none",
};

/// [`element_count`], or an error naming `key`.
fn elements(key: &str, shape: &[usize]) -> Result<usize, ConfigError> {
    element_count(shape).ok_or_else(|| {
        invalid(
            key,
            format!("{shape:?} holds more than {MAX_ELEMENTS} elements; check the dimensions"),
        )
    })
}

/// `[engine]`: which backend runs which model.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineConfig {
    /// `cpu` (tract-onnx) or `tensorrt` (builds with the `tensorrt` feature).
    #[serde(default = "default_backend")]
    pub backend: String,
    /// Model file, relative to the config file's folder: ONNX for `cpu`, a TensorRT plan
    /// (built on the device with `trtexec`) for `tensorrt`.
    pub model: Option<PathBuf>,
    /// `tensorrt`: the CUDA device ordinal.
    #[serde(default)]
    pub device: Option<u32>,
    /// `tensorrt`: run on this DLA core (Jetson AGX/NX) instead of the GPU.
    #[serde(default)]
    pub dla_core: Option<u32>,
    /// `tensorrt`: replay copy-in → enqueue → copy-out as one CUDA graph after warm-up.
    #[serde(default)]
    pub cuda_graph: Option<bool>,
    /// `tensorrt`: `auto` (on for integrated GPUs such as Jetson's), `on` or `off`: engine
    /// inputs and outputs live in mapped page-locked host memory, so no copy is made.
    #[serde(default)]
    pub zero_copy: Option<String>,
    /// `tensorrt`: libnvinfer to open (default: the sonames of TensorRT 11, 10, 8).
    #[serde(default)]
    pub tensorrt_library: Option<PathBuf>,
    /// Requests in flight at once (each has its own input and output buffers).
    #[serde(default = "default_slots")]
    pub slots: usize,
    /// Runs before the server reports ready.
    #[serde(default = "default_warmup")]
    pub warmup_runs: usize,
    /// A run taking longer than this counts as a stalled engine (0 = never): waiting requests
    /// get a timeout error, new ones are refused, health answers 503 until it finishes.
    #[serde(default = "default_engine_timeout")]
    pub timeout_ms: u64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            backend: default_backend(),
            model: None,
            device: None,
            dla_core: None,
            cuda_graph: None,
            zero_copy: None,
            tensorrt_library: None,
            slots: default_slots(),
            warmup_runs: default_warmup(),
            timeout_ms: default_engine_timeout(),
        }
    }
}

fn default_backend() -> String {
    "cpu".into()
}
fn default_slots() -> usize {
    2
}
fn default_warmup() -> usize {
    3
}
fn default_engine_timeout() -> u64 {
    10_000
}

/// `[[inputs]]`: one observation key bound to one engine input.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputConfig {
    /// Observation key; nested maps are joined with `/` (`images/cam_high`).
    pub key: String,
    /// Engine input name.
    pub tensor: String,
    /// Accepted wire dtypes (`uint8`, `float32`, `float64`, …), converted to the engine's; or
    /// `["text"]` for a string such as `prompt`, whose UTF-8 bytes fill a `[max_bytes]` input.
    pub dtypes: Vec<String>,
    /// Expected wire shape.
    pub shape: Vec<usize>,
    /// `hwc_to_chw`, `chw_to_hwc` or `none`.
    #[serde(default)]
    pub layout: Option<String>,
    /// `y = ((x·scale + offset) − mean) / (std + 1e-6)`.
    #[serde(default = "one")]
    pub scale: f64,
    #[serde(default)]
    pub offset: f64,
    /// Per-feature (length of the wire shape's last axis), per-element, or one value.
    #[serde(default)]
    pub mean: Vec<f64>,
    #[serde(default)]
    pub std: Vec<f64>,
    /// May be absent from a request; the engine input is then filled with `fill`.
    #[serde(default)]
    pub optional: bool,
    #[serde(default)]
    pub fill: f64,
    /// Fixed engine shape, for models whose input has symbolic dimensions.
    #[serde(default)]
    pub engine_shape: Option<Vec<usize>>,
}

fn one() -> f64 {
    1.0
}

/// `[[outputs]]`: one engine output sent under one reply key.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputConfig {
    /// Engine output name.
    pub tensor: String,
    /// Reply key.
    #[serde(default = "actions")]
    pub key: String,
    /// Wire dtype of the reply array (`float32` or `float64`).
    #[serde(default = "f32_name")]
    pub dtype: String,
    /// Keep only the first N entries of the last axis (openpi's `actions[:, :14]`).
    #[serde(default)]
    pub columns: Option<usize>,
    /// Un-normalisation `x·(std + 1e-6) + mean`, per action dimension (or one value).
    #[serde(default)]
    pub mean: Vec<f64>,
    #[serde(default)]
    pub std: Vec<f64>,
}

fn actions() -> String {
    "actions".into()
}
fn f32_name() -> String {
    "float32".into()
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

impl InputConfig {
    pub fn layout(&self) -> Layout {
        match self.layout.as_deref() {
            Some("hwc_to_chw") => Layout::HwcToChw,
            Some("chw_to_hwc") => Layout::ChwToHwc,
            _ => Layout::None,
        }
    }
    /// A text binding (`dtypes = ["text"]`): a string's UTF-8 bytes, one per element.
    pub fn is_text(&self) -> bool {
        self.dtypes.iter().any(|d| d == "text")
    }
    pub fn dtypes(&self) -> Vec<ElemType> {
        self.dtypes
            .iter()
            .filter_map(|d| ElemType::from_name(d))
            .collect()
    }
}

impl OutputConfig {
    pub fn dtype(&self) -> ElemType {
        ElemType::from_name(&self.dtype).unwrap_or(ElemType::F32)
    }
}

impl Config {
    /// Reads and checks a config file; the model path is resolved against its folder.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        Config::parse(&text, &path.display().to_string(), Some(base))
    }

    /// Parses and checks config text. `base` resolves a relative `engine.model`; without it
    /// the model must be supplied by the caller (the embedded default).
    pub fn parse(text: &str, origin: &str, base: Option<&Path>) -> Result<Config, ConfigError> {
        let mut cfg: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: origin.to_string(),
            message: e.to_string(),
        })?;
        if let (Some(model), Some(base)) = (&cfg.engine.model, base) {
            cfg.model = Some(ModelSource::File(base.join(model)));
        }
        for p in &mut cfg.policies {
            p.model = match (&p.engine.model, base) {
                (Some(m), Some(b)) => Some(ModelSource::File(b.join(m))),
                (Some(m), None) => Some(ModelSource::File(m.clone())),
                (None, _) => None,
            };
        }
        // Files named in the config are relative to its folder.
        let resolve = |f: &PathBuf| base.map_or_else(|| f.clone(), |b| b.join(f));
        let key_file = cfg.auth.key_file.as_ref().map(resolve);
        cfg.auth.keys = crate::net::auth::ApiKeys::load(&cfg.auth.api_keys, key_file.as_deref())?;
        cfg.tls.acceptor = match (&cfg.tls.cert, &cfg.tls.key) {
            (None, None) => None,
            (Some(c), Some(k)) => Some(crate::net::tls::Tls::load(&resolve(c), &resolve(k))?),
            (Some(_), None) => return Err(invalid("tls.key", "missing: tls.cert needs its key")),
            (None, Some(_)) => {
                return Err(invalid(
                    "tls.cert",
                    "missing: tls.key needs its certificate",
                ));
            }
        };
        if let Some(f) = cfg.planner.api_key_file.clone() {
            let path = resolve(&f);
            let text = std::fs::read_to_string(&path).map_err(|e| {
                invalid(
                    "planner.api_key_file",
                    format!("cannot read {}: {e}", path.display()),
                )
            })?;
            cfg.planner.api_key = Some(Secret(text.trim().to_string()));
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Applies the command line's `--host`/`--port` and checks the result again.
    pub fn override_listen(
        &mut self,
        host: Option<&str>,
        port: Option<u16>,
    ) -> Result<(), ConfigError> {
        if let Some(h) = host {
            self.server.host = h.to_string();
        }
        if let Some(p) = port {
            self.server.port = p;
        }
        self.validate()
    }

    /// Checks every value on its own, each policy's too; engine-dependent checks are in
    /// [`crate::bind`].
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.policies.is_empty() {
            return self.validate_one();
        }
        self.check_policy_list()?;
        for (i, (c, p)) in self.policy_configs().iter().zip(&self.policies).enumerate() {
            c.validate_one().map_err(|e| match e {
                ConfigError::Invalid { key, message }
                    if !key.starts_with("pacing.") || p.pacing.is_some() =>
                {
                    let own = ["engine", "inputs", "outputs", "metadata", "pacing"]
                        .iter()
                        .any(|k| key.starts_with(k));
                    ConfigError::Invalid {
                        key: if own {
                            format!("policies[{i}].{key}")
                        } else {
                            key
                        },
                        message: format!("{message} (policy \"{}\")", c.policy.name),
                    }
                }
                other => other,
            })?;
        }
        Ok(())
    }

    /// The index of the default policy in `policies`: the one marked, else the first.
    pub fn default_policy(&self) -> usize {
        self.policies.iter().position(|p| p.default).unwrap_or(0)
    }

    /// One config per policy, each a whole config as a single-policy file would give (the
    /// shared sections, the policy's engine, bindings, metadata and pacing). A single-policy
    /// config gives itself, named `default`. The planner serves the default policy only.
    pub fn policy_configs(&self) -> Vec<Config> {
        if self.policies.is_empty() {
            let mut c = self.clone();
            c.policy = PolicyIdentity {
                name: "default".into(),
                is_default: true,
                reset_on_prompt_change: self.reset_on_prompt_change,
            };
            return vec![c];
        }
        let default = self.default_policy();
        self.policies
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let mut c = self.clone();
                c.policies = Vec::new();
                c.engine = p.engine.clone();
                c.inputs = p.inputs.clone();
                c.outputs = p.outputs.clone();
                c.metadata = p.metadata.clone();
                c.model = p.model.clone();
                if let Some(pc) = &p.pacing {
                    c.pacing = pc.clone();
                }
                if let Some(n) = p.actions_per_chunk {
                    c.pacing.actions_per_chunk = n;
                }
                c.planner.enabled &= i == default;
                c.reset_on_prompt_change = p.reset_on_prompt_change;
                c.policy = PolicyIdentity {
                    name: p.name.clone(),
                    is_default: i == default,
                    reset_on_prompt_change: p.reset_on_prompt_change,
                };
                c
            })
            .collect()
    }

    /// `[[policies]]` as a list: names, the default, and nothing left at the top level.
    fn check_policy_list(&self) -> Result<(), ConfigError> {
        if self.policies.len() > MAX_POLICIES {
            return Err(invalid(
                "policies",
                format!(
                    "{} policies declared; at most {MAX_POLICIES}",
                    self.policies.len()
                ),
            ));
        }
        for (i, p) in self.policies.iter().enumerate() {
            let ok = !p.name.is_empty()
                && p.name.len() <= MAX_POLICY_NAME
                && p.name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
            if !ok {
                return Err(invalid(
                    format!("policies[{i}].name"),
                    format!(
                        "\"{}\": use 1-{MAX_POLICY_NAME} letters, digits, '-', '_' or '.' (it \
                         goes in the path /policies/<name>)",
                        p.name
                    ),
                ));
            }
            if let Some(j) = self.policies[..i].iter().position(|q| q.name == p.name) {
                return Err(invalid(
                    format!("policies[{i}].name"),
                    format!("\"{}\" is also the name of policies[{j}]", p.name),
                ));
            }
        }
        let defaults: Vec<&str> = self
            .policies
            .iter()
            .filter(|p| p.default)
            .map(|p| p.name.as_str())
            .collect();
        if defaults.len() > 1 {
            return Err(invalid(
                "policies.default",
                format!(
                    "only one policy may be the default; {} are",
                    defaults.join(", ")
                ),
            ));
        }
        for (key, set) in [
            ("engine", self.engine.model.is_some()),
            ("inputs", !self.inputs.is_empty()),
            ("outputs", !self.outputs.is_empty()),
            ("metadata", !self.metadata.is_empty()),
            ("reset_on_prompt_change", self.reset_on_prompt_change),
        ] {
            if set {
                return Err(invalid(
                    key,
                    "with [[policies]], give it inside each policy ([policies.engine], \
                     [[policies.inputs]], [[policies.outputs]], [policies.metadata], \
                     reset_on_prompt_change)",
                ));
            }
        }
        Ok(())
    }

    fn validate_one(&self) -> Result<(), ConfigError> {
        let s = &self.server;
        if s.host.trim().is_empty() {
            return Err(invalid("server.host", "must not be empty"));
        }
        if s.max_connections == 0 || s.max_connections > 4096 {
            return Err(invalid(
                "server.max_connections",
                format!("must be between 1 and 4096, got {}", s.max_connections),
            ));
        }
        if s.max_message_bytes < 1024 || s.max_message_bytes > (1 << 30) {
            return Err(invalid(
                "server.max_message_bytes",
                format!(
                    "must be between 1024 and 1073741824, got {}",
                    s.max_message_bytes
                ),
            ));
        }
        for (key, v, max) in [
            ("server.ping_interval_s", s.ping_interval_s, 86400.0),
            ("server.ping_timeout_s", s.ping_timeout_s, 86400.0),
            ("server.idle_timeout_s", s.idle_timeout_s, 86400.0 * 365.0),
            ("server.handshake_timeout_s", s.handshake_timeout_s, 3600.0),
            ("server.frame_timeout_s", s.frame_timeout_s, 3600.0),
        ] {
            if !(v.is_finite() && (0.0..=max).contains(&v)) {
                return Err(invalid(
                    key,
                    format!("must be a number of seconds between 0 and {max}, got {v}"),
                ));
            }
        }
        if s.ping_interval_s > 0.0 && s.ping_timeout_s <= 0.0 {
            return Err(invalid(
                "server.ping_timeout_s",
                "must be positive when server.ping_interval_s is set",
            ));
        }
        if s.handshake_timeout_s <= 0.0 {
            return Err(invalid("server.handshake_timeout_s", "must be positive"));
        }
        if s.max_sessions == 0 || s.max_sessions > crate::limits::MAX_SESSIONS {
            return Err(invalid(
                "server.max_sessions",
                format!(
                    "must be between 1 and {}, got {}",
                    crate::limits::MAX_SESSIONS,
                    s.max_sessions
                ),
            ));
        }
        if !matches!(s.reset_reply.as_str(), "msgpack" | "text") {
            return Err(invalid(
                "server.reset_reply",
                format!("must be \"msgpack\" or \"text\", got \"{}\"", s.reset_reply),
            ));
        }
        if !(2..=64).contains(&s.max_depth) {
            return Err(invalid(
                "server.max_depth",
                format!("must be between 2 and 64, got {}", s.max_depth),
            ));
        }
        if s.memory_budget_mb > 1 << 24 {
            return Err(invalid(
                "server.memory_budget_mb",
                format!(
                    "must be at most 16777216 (16 TiB), got {}",
                    s.memory_budget_mb
                ),
            ));
        }
        if !(8..=1_000_000).contains(&s.max_map_entries) {
            return Err(invalid(
                "server.max_map_entries",
                format!("must be between 8 and 1000000, got {}", s.max_map_entries),
            ));
        }

        let e = &self.engine;
        match e.backend.as_str() {
            "cpu" if cfg!(feature = "cpu") => {}
            "cpu" => {
                return Err(invalid(
                    "engine.backend",
                    "\"cpu\" is not in this build (built without the `cpu` feature)",
                ));
            }
            "tensorrt" if cfg!(feature = "tensorrt") => {}
            "tensorrt" => {
                return Err(invalid(
                    "engine.backend",
                    "\"tensorrt\" is not in this build; build policyd with \
                     `--features tensorrt` (see docs/tensorrt.md)",
                ));
            }
            other => {
                return Err(invalid(
                    "engine.backend",
                    format!("unknown backend \"{other}\"; this build has: {BACKENDS}"),
                ));
            }
        }
        if e.backend != "tensorrt" {
            for (key, set) in [
                ("engine.device", e.device.is_some()),
                ("engine.dla_core", e.dla_core.is_some()),
                ("engine.cuda_graph", e.cuda_graph.is_some()),
                ("engine.zero_copy", e.zero_copy.is_some()),
                ("engine.tensorrt_library", e.tensorrt_library.is_some()),
            ] {
                if set {
                    return Err(invalid(
                        key,
                        format!(
                            "applies to the tensorrt backend only; engine.backend is \"{}\"",
                            e.backend
                        ),
                    ));
                }
            }
        }
        if let Some(d) = e.device
            && d > 63
        {
            return Err(invalid(
                "engine.device",
                format!("must be a CUDA device ordinal (0-63), got {d}"),
            ));
        }
        if let Some(d) = e.dla_core
            && d > 7
        {
            return Err(invalid(
                "engine.dla_core",
                format!("must be a DLA core number (0 or 1 on Jetson AGX Orin), got {d}"),
            ));
        }
        if let Some(z) = &e.zero_copy
            && crate::engine::ZeroCopy::parse(z).is_none()
        {
            return Err(invalid(
                "engine.zero_copy",
                format!("must be \"auto\", \"on\" or \"off\", got \"{z}\""),
            ));
        }
        if self.model.is_none() && e.model.is_none() {
            return Err(invalid(
                "engine.model",
                "missing: give the path of the ONNX model",
            ));
        }
        if e.slots == 0 || e.slots > MAX_SLOTS {
            return Err(invalid(
                "engine.slots",
                format!("must be between 1 and {MAX_SLOTS}, got {}", e.slots),
            ));
        }
        if e.timeout_ms != 0 && !(10..=3_600_000).contains(&e.timeout_ms) {
            return Err(invalid(
                "engine.timeout_ms",
                format!(
                    "must be 0 (never) or between 10 and 3600000, got {}",
                    e.timeout_ms
                ),
            ));
        }
        if e.warmup_runs > 1000 {
            return Err(invalid(
                "engine.warmup_runs",
                format!("must be at most 1000, got {}", e.warmup_runs),
            ));
        }

        self.validate_pacing()?;

        if self.inputs.is_empty() {
            return Err(invalid(
                "inputs",
                "at least one [[inputs]] binding is needed",
            ));
        }
        for (i, b) in self.inputs.iter().enumerate() {
            let k = |f: &str| format!("inputs[{i}].{f}");
            if b.key.is_empty() || b.key.len() > MAX_PATH {
                return Err(invalid(
                    k("key"),
                    format!("must be 1 to {MAX_PATH} bytes long"),
                ));
            }
            if b.key.starts_with('/') || b.key.ends_with('/') || b.key.contains("//") {
                return Err(invalid(
                    k("key"),
                    format!("\"{}\" has an empty path segment", b.key),
                ));
            }
            if RESERVED_KEYS.contains(&b.key.as_str()) {
                return Err(invalid(
                    k("key"),
                    format!(
                        "\"{}\" is reserved by the protocol and cannot be bound",
                        b.key
                    ),
                ));
            }
            if let Some(j) = self.inputs[..i].iter().position(|o| o.key == b.key) {
                return Err(invalid(
                    k("key"),
                    format!("\"{}\" is already bound by inputs[{j}]", b.key),
                ));
            }
            if let Some(j) = self.inputs[..i].iter().position(|o| o.tensor == b.tensor) {
                return Err(invalid(
                    k("tensor"),
                    format!(
                        "engine input \"{}\" is already bound by inputs[{j}]",
                        b.tensor
                    ),
                ));
            }
            if b.dtypes.is_empty() {
                return Err(invalid(
                    k("dtypes"),
                    "list at least one accepted wire dtype, e.g. [\"float32\", \"float64\"]",
                ));
            }
            if b.is_text() {
                if b.dtypes.len() != 1 {
                    return Err(invalid(
                        k("dtypes"),
                        "\"text\" cannot be mixed with numeric dtypes",
                    ));
                }
                if b.shape.len() != 1 {
                    return Err(invalid(
                        k("shape"),
                        "a text binding's shape is [max_bytes]: the UTF-8 bytes, one per element",
                    ));
                }
                if b.layout().perm().is_some()
                    || !b.mean.is_empty()
                    || b.scale != 1.0
                    || b.offset != 0.0
                {
                    return Err(invalid(
                        k("dtypes"),
                        "a text binding takes no layout, scale, offset, mean or std",
                    ));
                }
            }
            for d in b.dtypes.iter().filter(|_| !b.is_text()) {
                if ElemType::from_name(d).is_none() {
                    return Err(invalid(
                        k("dtypes"),
                        format!(
                            "unknown dtype \"{d}\"; use a numpy name such as uint8, float32, float64, or \"text\""
                        ),
                    ));
                }
            }
            if b.shape.len() > crate::limits::MAX_RANK {
                return Err(invalid(
                    k("shape"),
                    format!("rank {} exceeds {}", b.shape.len(), crate::limits::MAX_RANK),
                ));
            }
            if b.shape.contains(&0) {
                return Err(invalid(k("shape"), "dimensions must be positive"));
            }
            let count = elements(&k("shape"), &b.shape)?;
            if let Some(es) = &b.engine_shape {
                if es.is_empty() || es.len() > crate::limits::MAX_RANK || es.contains(&0) {
                    return Err(invalid(
                        k("engine_shape"),
                        format!(
                            "needs 1 to {} positive dimensions, got {es:?}",
                            crate::limits::MAX_RANK
                        ),
                    ));
                }
                elements(&k("engine_shape"), es)?;
            }
            let layout_ok = matches!(
                b.layout.as_deref(),
                None | Some("none" | "hwc_to_chw" | "chw_to_hwc")
            );
            if !layout_ok {
                return Err(invalid(
                    k("layout"),
                    format!(
                        "must be \"hwc_to_chw\", \"chw_to_hwc\" or \"none\", got \"{}\"",
                        b.layout.as_deref().unwrap_or_default()
                    ),
                ));
            }
            if b.layout().perm().is_some() && b.shape.len() < 3 {
                return Err(invalid(k("layout"), "needs a shape of rank 3 or more"));
            }
            if !b.scale.is_finite() || !b.offset.is_finite() || !b.fill.is_finite() {
                return Err(invalid(
                    k("scale"),
                    "scale, offset and fill must be finite numbers",
                ));
            }
            check_norm(
                &k("mean"),
                &k("std"),
                &b.mean,
                &b.std,
                &[1, *b.shape.last().unwrap_or(&1), count],
            )?;
        }
        if self.outputs.is_empty() {
            return Err(invalid(
                "outputs",
                "at least one [[outputs]] binding is needed",
            ));
        }
        for (i, o) in self.outputs.iter().enumerate() {
            let k = |f: &str| format!("outputs[{i}].{f}");
            if o.key.is_empty() {
                return Err(invalid(k("key"), "must not be empty"));
            }
            if let Some(j) = self.outputs[..i].iter().position(|p| p.key == o.key) {
                return Err(invalid(
                    k("key"),
                    format!("\"{}\" is already used by outputs[{j}]", o.key),
                ));
            }
            if !matches!(
                ElemType::from_name(&o.dtype),
                Some(ElemType::F32 | ElemType::F64)
            ) {
                return Err(invalid(
                    k("dtype"),
                    format!("must be \"float32\" or \"float64\", got \"{}\"", o.dtype),
                ));
            }
            if o.columns == Some(0) {
                return Err(invalid(k("columns"), "must be positive"));
            }
            // Lengths against the action dimension are checked once the engine is known.
            check_norm(&k("mean"), &k("std"), &o.mean, &o.std, &[])?;
        }
        for (key, v) in &self.metadata {
            check_metadata(&format!("metadata.{key}"), v)?;
        }
        self.validate_planner()
    }

    /// `[planner]`'s own values; its bindings are checked against the plan.
    fn validate_planner(&self) -> Result<(), ConfigError> {
        let p = &self.planner;
        if !p.enabled {
            return Ok(());
        }
        if p.endpoints.is_empty() {
            return Err(invalid(
                "planner.endpoints",
                "missing: give at least one base URL, e.g. [\"http://127.0.0.1:8080\"]",
            ));
        }
        for (i, e) in p.endpoints.iter().enumerate() {
            if let Err(why) = crate::planner::endpoint::check_url(e) {
                return Err(invalid(format!("planner.endpoints[{i}]"), why));
            }
        }
        if p.model.trim().is_empty() {
            return Err(invalid(
                "planner.model",
                "missing: the model name the endpoints serve (as listed by GET /v1/models)",
            ));
        }
        if let Some(k) = &p.api_key
            && (k.0.is_empty() || k.0.chars().any(|c| c.is_control()))
        {
            return Err(invalid(
                "planner.api_key",
                "must be non-empty and on one line",
            ));
        }
        if p.system_prompt.trim().is_empty() {
            return Err(invalid("planner.system_prompt", "must not be empty"));
        }
        if !(p.rate_hz.is_finite() && p.rate_hz > 0.0 && p.rate_hz <= 50.0) {
            return Err(invalid(
                "planner.rate_hz",
                format!("must be above 0 and at most 50, got {}", p.rate_hz),
            ));
        }
        if !matches!(p.precedence.as_str(), "client" | "planner") {
            return Err(invalid(
                "planner.precedence",
                format!(
                    "must be \"client\" or \"planner\", got \"{}\"",
                    p.precedence
                ),
            ));
        }
        if p.max_tokens == 0 || p.max_tokens > 32768 {
            return Err(invalid(
                "planner.max_tokens",
                format!("must be between 1 and 32768, got {}", p.max_tokens),
            ));
        }
        if !(p.temperature.is_finite() && (0.0..=2.0).contains(&p.temperature)) {
            return Err(invalid(
                "planner.temperature",
                format!("must be between 0 and 2, got {}", p.temperature),
            ));
        }
        for (key, v, min, max) in [
            (
                "planner.request_timeout_s",
                p.request_timeout_s,
                0.01,
                600.0,
            ),
            ("planner.max_backoff_s", p.max_backoff_s, 0.5, 3600.0),
            ("planner.ready_timeout_s", p.ready_timeout_s, 0.0, 3600.0),
            ("planner.stop_grace_s", p.stop_grace_s, 0.0, 600.0),
        ] {
            if !(v.is_finite() && (min..=max).contains(&v)) {
                return Err(invalid(
                    key,
                    format!("must be a number of seconds between {min} and {max}, got {v}"),
                ));
            }
        }
        if p.serve_command.first().is_some_and(|c| c.trim().is_empty()) {
            return Err(invalid(
                "planner.serve_command",
                "the first element must be the program to run",
            ));
        }
        if p.serve_command.is_empty() && p.ready_marker.is_some() {
            return Err(invalid(
                "planner.ready_marker",
                "applies to planner.serve_command, which is not set",
            ));
        }
        if p.ready_marker.as_deref().is_some_and(|m| m.is_empty()) {
            return Err(invalid("planner.ready_marker", "must not be empty"));
        }
        Ok(())
    }
}

/// mean/std must come together, with equal lengths from `allowed` (empty: any length),
/// finite, std non-negative.
fn check_norm(
    mk: &str,
    sk: &str,
    mean: &[f64],
    std: &[f64],
    allowed: &[usize],
) -> Result<(), ConfigError> {
    if mean.len() != std.len() {
        return Err(invalid(
            mk,
            format!(
                "has {} values but {sk} has {}; give both with equal lengths",
                mean.len(),
                std.len()
            ),
        ));
    }
    if mean.is_empty() {
        return Ok(());
    }
    if !allowed.is_empty() && !allowed.contains(&mean.len()) {
        return Err(invalid(
            mk,
            format!(
                "has {} values; give 1, one per entry of the last axis ({}), or one per element ({})",
                mean.len(),
                allowed[1],
                allowed[2]
            ),
        ));
    }
    if mean.iter().any(|v| !v.is_finite()) {
        return Err(invalid(mk, "values must be finite"));
    }
    if std.iter().any(|v| !v.is_finite() || *v < 0.0) {
        return Err(invalid(sk, "values must be finite and non-negative"));
    }
    Ok(())
}

impl Config {
    fn validate_pacing(&self) -> Result<(), ConfigError> {
        let p = &self.pacing;
        if !p.fps.is_finite() || p.fps <= 0.0 || p.fps > 10_000.0 {
            return Err(invalid(
                "pacing.fps",
                format!("must be a control rate in (0, 10000] Hz, got {}", p.fps),
            ));
        }
        if !p.latency_budget_ms.is_finite()
            || p.latency_budget_ms < 0.0
            || p.latency_budget_ms > 60_000.0
        {
            return Err(invalid(
                "pacing.latency_budget_ms",
                format!(
                    "must be between 0 (off) and 60000 ms, got {}",
                    p.latency_budget_ms
                ),
            ));
        }
        if p.latency_window == 0 || p.latency_window > MAX_LATENCY_WINDOW {
            return Err(invalid(
                "pacing.latency_window",
                format!(
                    "must be between 1 and {MAX_LATENCY_WINDOW}, got {}",
                    p.latency_window
                ),
            ));
        }
        if p.spin_us > 20_000 {
            return Err(invalid(
                "pacing.spin_us",
                format!("must be at most 20000 µs, got {}", p.spin_us),
            ));
        }
        if !p.similarity_atol.is_finite() || p.similarity_atol < 0.0 {
            return Err(invalid(
                "pacing.similarity_atol",
                format!(
                    "must be 0 (off) or a positive distance, got {}",
                    p.similarity_atol
                ),
            ));
        }
        if p.similarity_atol > 0.0 {
            let Some(b) = self.inputs.iter().find(|b| b.key == p.similarity_key) else {
                return Err(invalid(
                    "pacing.similarity_key",
                    format!(
                        "names no [[inputs]] key (got \"{}\"); the similarity filter needs the state's key, e.g. \"observation/state\"",
                        p.similarity_key
                    ),
                ));
            };
            let n = element_count(&b.shape).unwrap_or(usize::MAX);
            if b.is_text() || n > MAX_SIMILARITY_STATE {
                return Err(invalid(
                    "pacing.similarity_key",
                    format!(
                        "must name a numeric input of at most {MAX_SIMILARITY_STATE} elements; '{}' has {n}",
                        b.key
                    ),
                ));
            }
        }
        Ok(())
    }
}

fn check_metadata(key: &str, v: &toml::Value) -> Result<(), ConfigError> {
    match v {
        toml::Value::Datetime(_) => Err(invalid(
            key,
            "dates cannot be sent as metadata; use a string",
        )),
        toml::Value::Array(a) => a
            .iter()
            .enumerate()
            .try_for_each(|(i, x)| check_metadata(&format!("{key}[{i}]"), x)),
        toml::Value::Table(t) => t
            .iter()
            .try_for_each(|(k, x)| check_metadata(&format!("{key}.{k}"), x)),
        _ => Ok(()),
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
        assert_eq!(c.outputs[0].key, "actions");
        assert!(
            matches!(c.model, Some(ModelSource::File(ref p)) if p == Path::new("/etc/policyd/m.onnx"))
        );
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
        assert!(on("api_key_file = \"missing-key\"").contains("planner.api_key_file"));
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
        assert_eq!(
            format!("{:?}", packaged.inputs),
            format!("{:?}", demo.inputs)
        );
        assert_eq!(
            format!("{:?}", packaged.outputs),
            format!("{:?}", demo.outputs)
        );
        assert_eq!(packaged.metadata, demo.metadata);
        assert_eq!(packaged.server.host, "0.0.0.0");
        assert_eq!(
            packaged.engine.model.as_deref(),
            Some(std::path::Path::new("/usr/share/policyd/models/aloha.onnx"))
        );
    }
}
