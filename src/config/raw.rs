//! What does the file say, exactly? The TOML's shape, deserialized with `deny_unknown_fields`
//! and the documented defaults, before any value is checked. Private to `config`: closed sets
//! are still strings here, so that [`super::check`] can name the key of a bad value; paths are
//! still relative to the file. Nothing outside `config` sees these types.

use std::path::PathBuf;

use serde::Deserialize;

use super::{PacingConfig, Secret};

/// The whole configuration file.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    #[serde(default)]
    pub(super) server: RawServer,
    /// The engine of a single-policy config (with `[[policies]]`, each has its own).
    #[serde(default)]
    pub(super) engine: RawEngine,
    /// Observation key → engine input.
    #[serde(default)]
    pub(super) inputs: Vec<RawInput>,
    /// Engine output → reply key.
    #[serde(default)]
    pub(super) outputs: Vec<RawOutput>,
    /// When replies are released and how action chunks are cut (see the README's pacing part).
    #[serde(default)]
    pub(super) pacing: PacingConfig,
    /// Sent verbatim (as msgpack) in the metadata frame on connect.
    #[serde(default)]
    pub(super) metadata: toml::Table,
    /// API keys for the WebSocket (and `/metrics`).
    #[serde(default)]
    pub(super) auth: RawAuth,
    /// TLS (`wss://`).
    #[serde(default)]
    pub(super) tls: RawTls,
    /// The optional task planner (a vision-language model that names the next subtask).
    #[serde(default)]
    pub(super) planner: RawPlanner,
    /// LeRobot's async-inference gRPC service, on its own port (off without the section).
    #[serde(default)]
    pub(super) lerobot: Option<RawLerobot>,
    /// Reset a session when its prompt changes (single-policy configs; with `[[policies]]`,
    /// each policy has its own).
    #[serde(default)]
    pub(super) reset_on_prompt_change: bool,
    /// Several policies served at once, each with its own engine, bindings and metadata;
    /// clients choose one by name (see docs/policies.md). Without it, the top-level
    /// `[engine]`, `[[inputs]]`, `[[outputs]]` and `[metadata]` are the one policy.
    #[serde(default)]
    pub(super) policies: Vec<RawPolicy>,
    /// A multi-step policy: the step graph `[denoise]` run by `[sampler]` after `[engine]`.
    #[serde(default)]
    pub(super) denoise: Option<RawDenoise>,
    #[serde(default)]
    pub(super) sampler: Option<RawSampler>,
}

/// `[[policies]]`: one named policy.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPolicy {
    /// Chosen by clients with the path `/policies/<name>` or a `policy` field.
    pub(super) name: String,
    /// Served to clients that name no policy (exactly one policy has it, or the first).
    #[serde(default)]
    pub(super) default: bool,
    pub(super) engine: RawEngine,
    #[serde(default)]
    pub(super) inputs: Vec<RawInput>,
    #[serde(default)]
    pub(super) outputs: Vec<RawOutput>,
    #[serde(default)]
    pub(super) metadata: toml::Table,
    /// This policy's `[pacing]` (replaces the top-level table when given).
    #[serde(default)]
    pub(super) pacing: Option<PacingConfig>,
    /// Shorthand for `pacing.actions_per_chunk` of this policy.
    #[serde(default)]
    pub(super) actions_per_chunk: Option<usize>,
    /// Reset a session when its prompt changes, as if the client had sent `reset`.
    #[serde(default)]
    pub(super) reset_on_prompt_change: bool,
    #[serde(default)]
    pub(super) denoise: Option<RawDenoise>,
    #[serde(default)]
    pub(super) sampler: Option<RawSampler>,
}

/// `[denoise]`: the step graph of a pipeline (an action expert, a denoising U-Net), on
/// `[engine]`'s backend.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDenoise {
    /// Model file, relative to the config file.
    pub(super) model: PathBuf,
    /// Step-graph input = prefix (`[engine]`) output, by name.
    #[serde(default)]
    pub(super) wire: std::collections::BTreeMap<String, String>,
}

/// `[sampler]`: how `[denoise]` is iterated from noise to actions.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSampler {
    /// `flow`, `ddpm` or `ddim`.
    pub(super) kind: String,
    /// Steps when the request names none (`sampling_params.num_inference_steps`).
    pub(super) steps: usize,
    /// The most steps a request may ask for (default: `steps`).
    #[serde(default)]
    pub(super) max_steps: Option<usize>,
    /// Step-graph input taking the sample (its shape is the action chunk's).
    pub(super) x: String,
    /// Step-graph input taking the time (flow) or timestep (ddpm, ddim).
    pub(super) time: String,
    /// Step-graph output: the velocity (flow) or the prediction (ddpm, ddim).
    pub(super) output: String,
    #[serde(default)]
    pub(super) num_train_timesteps: Option<usize>,
    #[serde(default)]
    pub(super) beta_schedule: Option<String>,
    #[serde(default)]
    pub(super) beta_start: Option<f64>,
    #[serde(default)]
    pub(super) beta_end: Option<f64>,
    #[serde(default)]
    pub(super) prediction_type: Option<String>,
    #[serde(default)]
    pub(super) clip_sample: Option<bool>,
    #[serde(default)]
    pub(super) clip_sample_range: Option<f64>,
    #[serde(default)]
    pub(super) eta: Option<f64>,
    /// `sampler` (the loop applies the update) or `model` (flow: the step graph returns the
    /// next sample itself, given `dt`).
    #[serde(default)]
    pub(super) update: Option<String>,
    /// `update = "model"`: the step-graph input taking `dt`.
    #[serde(default)]
    pub(super) dt: Option<String>,
    /// Tests: the noise comes from the request (inputs named as `x` and `<x>_step_noise`).
    #[serde(default)]
    pub(super) inject_noise: bool,
    /// Flow: `openpi` (time accumulated in float32, `t += dt`) or `lerobot` (`1 + i·dt` in
    /// float64, rounded to float32, as LeRobot's `euler_integrate`).
    #[serde(default)]
    pub(super) flow_time: Option<String>,
}

/// `[lerobot]`: LeRobot's `AsyncInference` gRPC service for its unmodified `robot_client`
/// (see docs/lerobot.md). Plaintext and unauthenticated like LeRobot's own server, so it is off
/// unless the section is there, and `allow` can restrict who may connect.
#[derive(Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawLerobot {
    pub(super) listen: Option<String>,
    pub(super) allow: Vec<String>,
    pub(super) long_poll_ms: Option<u64>,
    pub(super) max_payload_bytes: Option<usize>,
    pub(super) resize: Option<String>,
    pub(super) max_connections: Option<usize>,
    pub(super) handshake_timeout_s: Option<f64>,
    pub(super) idle_timeout_s: Option<f64>,
    pub(super) chunk_timeout_s: Option<f64>,
    pub(super) observation_timeout_s: Option<f64>,
    pub(super) takeover_after_s: Option<f64>,
    pub(super) serve: Vec<RawLerobotServe>,
}

/// `[[lerobot.serve]]`: a name the client may send as `pretrained_name_or_path`, and the
/// served policy it means.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLerobotServe {
    pub(super) pretrained: String,
    pub(super) policy: Option<String>,
    pub(super) policy_type: Option<String>,
}

/// `[tls]`: serve `wss://` (and `https://` health) with this certificate and key (PEM),
/// relative to the config file. Both or neither.
#[derive(Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawTls {
    pub(super) cert: Option<PathBuf>,
    pub(super) key: Option<PathBuf>,
}

/// `[planner]`: a vision-language model behind an OpenAI-compatible chat-completions API that
/// names the policy's next subtask from the instruction and the current camera view. Off by
/// default; when on, it runs on its own thread at its own rate and the request path only reads
/// its latest answer (see docs/planner.md).
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawPlanner {
    pub(super) enabled: bool,
    /// Base URLs (`http://host:port`), used round-robin; `/v1/chat/completions` and
    /// `/v1/models` (the readiness probe) are appended.
    pub(super) endpoints: Vec<String>,
    /// The `model` field of each request.
    pub(super) model: String,
    /// Sent as `Authorization: Bearer …` (prefer `api_key_file`).
    pub(super) api_key: Option<Secret>,
    /// A file holding the API key, relative to the config file.
    pub(super) api_key_file: Option<PathBuf>,
    /// The system message; `{instruction}` and `{subtask}` are replaced.
    pub(super) system_prompt: String,
    /// The high-level instruction (a client's prompt replaces it when `precedence = "planner"`).
    pub(super) instruction: String,
    /// Planner calls per second (at most; a slow endpoint makes it slower).
    pub(super) rate_hz: f64,
    /// The image input binding (its `key`) whose latest frame is sent, or none for text only.
    /// It must accept `uint8` in HWC or CHW layout with 1, 3 or 4 channels.
    pub(super) camera: Option<String>,
    /// The text input binding the subtask fills.
    pub(super) prompt_key: String,
    /// `client`: a prompt the client sends wins, the subtask fills in when it sends none.
    /// `planner`: the subtask wins once there is one, and the client's prompt becomes the
    /// planner's instruction.
    pub(super) precedence: String,
    pub(super) max_tokens: u32,
    pub(super) temperature: f64,
    /// Ask for JSON output (`response_format: {"type": "json_object"}`); turn off for a server
    /// that rejects the field.
    pub(super) json_mode: bool,
    /// Longest a planner call may take, connection included.
    pub(super) request_timeout_s: f64,
    /// Longest wait between readiness probes of a failing endpoint (the backoff doubles from
    /// 0.5 s up to this).
    pub(super) max_backoff_s: f64,
    /// A local model server to start and supervise (argv; empty: none).
    pub(super) serve_command: Vec<String>,
    /// A line of the server's output that says it is ready (else: the readiness probe).
    pub(super) ready_marker: Option<String>,
    /// Longest wait for `serve_command` to become ready before the planner goes on without it.
    pub(super) ready_timeout_s: f64,
    /// On shutdown the server gets SIGINT, then SIGKILL after this many seconds.
    pub(super) stop_grace_s: f64,
}

impl Default for RawPlanner {
    fn default() -> Self {
        RawPlanner {
            enabled: false,
            endpoints: Vec::new(),
            model: String::new(),
            api_key: None,
            api_key_file: None,
            system_prompt: super::DEFAULT_PLANNER_PROMPT.into(),
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
pub(super) struct RawAuth {
    /// Keys written into the config (prefer `key_file`, so keys stay out of the main config).
    pub(super) api_keys: Vec<String>,
    /// A file of keys, one a line (`#` comments), relative to the config file.
    pub(super) key_file: Option<PathBuf>,
    /// Whether `/metrics` needs a key too (when keys are configured).
    pub(super) protect_metrics: bool,
}

impl Default for RawAuth {
    fn default() -> Self {
        RawAuth {
            api_keys: Vec::new(),
            key_file: None,
            protect_metrics: true,
        }
    }
}

/// `[server]`: the listener and per-connection limits.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawServer {
    pub(super) host: String,
    pub(super) port: u16,
    /// WebSocket connections served at once; one more gets HTTP 503 in the handshake.
    pub(super) max_connections: usize,
    /// Largest inbound message; a larger frame is rejected before it is buffered.
    pub(super) max_message_bytes: usize,
    /// Server ping interval (0 = no pings).
    pub(super) ping_interval_s: f64,
    /// Close a connection whose pong is this late.
    pub(super) ping_timeout_s: f64,
    /// Close a connection idle this long (0 = off: openpi-client never reconnects).
    pub(super) idle_timeout_s: f64,
    /// Time a client gets to complete the HTTP upgrade.
    pub(super) handshake_timeout_s: f64,
    /// Time one WebSocket frame may take to arrive, first byte to last (0 = no limit): a
    /// half-sent frame closes the connection after this.
    pub(super) frame_timeout_s: f64,
    /// Sessions (`session_id`) tracked per connection; the least recently used is evicted.
    pub(super) max_sessions: usize,
    /// Reply to `endpoint: reset` as a msgpack map (`msgpack`) or the text frame
    /// `reset successful` (`text`, older vllm-omni and RoboArena clients).
    pub(super) reset_reply: String,
    /// Deepest map/list nesting accepted in a request.
    pub(super) max_depth: usize,
    /// Most entries accepted in any map or list of a request.
    pub(super) max_map_entries: usize,
    /// Memory the policies may allocate at start-up, in MiB (0 = unchecked): a config whose
    /// policies need more is refused, naming each policy's share.
    pub(super) memory_budget_mb: u64,
}

impl Default for RawServer {
    fn default() -> Self {
        RawServer {
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

/// `[engine]`: which backend runs which model.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEngine {
    /// `cpu` (tract-onnx), `ort` (onnxruntime, loaded at run time) or `tensorrt` (builds with
    /// the `tensorrt` feature).
    #[serde(default = "default_backend")]
    pub(super) backend: String,
    /// Model file, relative to the config file's folder: ONNX for `cpu`, a TensorRT plan
    /// (built on the device with `trtexec`) for `tensorrt`.
    pub(super) model: Option<PathBuf>,
    /// `tensorrt`, or `ort` with a GPU provider: the CUDA device ordinal.
    #[serde(default)]
    pub(super) device: Option<u32>,
    /// `ort`: the onnxruntime library (`libonnxruntime.so*`, or the folder holding it).
    #[serde(default)]
    pub(super) ort_library: Option<PathBuf>,
    /// `ort`: execution providers in order of preference (`cpu`, `cuda`, `tensorrt`).
    #[serde(default)]
    pub(super) providers: Option<Vec<String>>,
    /// `tensorrt`: run on this DLA core (Jetson AGX/NX) instead of the GPU.
    #[serde(default)]
    pub(super) dla_core: Option<u32>,
    /// `tensorrt`: replay copy-in → enqueue → copy-out as one CUDA graph after warm-up.
    #[serde(default)]
    pub(super) cuda_graph: Option<bool>,
    /// `tensorrt`: `auto` (on for integrated GPUs such as Jetson's), `on` or `off`: engine
    /// inputs and outputs live in mapped page-locked host memory, so no copy is made.
    #[serde(default)]
    pub(super) zero_copy: Option<String>,
    /// `tensorrt`: libnvinfer to open (default: the sonames of TensorRT 11, 10, 8).
    #[serde(default)]
    pub(super) tensorrt_library: Option<PathBuf>,
    /// Requests in flight at once (each has its own input and output buffers).
    #[serde(default = "default_slots")]
    pub(super) slots: usize,
    /// Runs before the server reports ready.
    #[serde(default = "default_warmup")]
    pub(super) warmup_runs: usize,
    /// A run taking longer than this counts as a stalled engine (0 = never): waiting requests
    /// get a timeout error, new ones are refused, health answers 503 until it finishes.
    #[serde(default = "default_engine_timeout")]
    pub(super) timeout_ms: u64,
    /// `cpu` and `ort`: threads one run may use (intra-op parallelism).
    #[serde(default = "default_threads")]
    pub(super) threads: usize,
}

impl Default for RawEngine {
    fn default() -> Self {
        RawEngine {
            backend: default_backend(),
            model: None,
            device: None,
            dla_core: None,
            cuda_graph: None,
            zero_copy: None,
            tensorrt_library: None,
            ort_library: None,
            providers: None,
            slots: default_slots(),
            warmup_runs: default_warmup(),
            timeout_ms: default_engine_timeout(),
            threads: default_threads(),
        }
    }
}

fn default_threads() -> usize {
    1
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
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawInput {
    /// Observation key; nested maps are joined with `/` (`images/cam_high`).
    pub(super) key: String,
    /// Engine input name (the token ids, for a tokenized prompt). Only a pi0.5 state that the
    /// engine does not take may leave it out.
    #[serde(default)]
    pub(super) tensor: Option<String>,
    /// Accepted wire dtypes (`uint8`, `float32`, `float64`, …), converted to the engine's; or
    /// `["text"]` for a string such as `prompt`, whose UTF-8 bytes fill a `[max_bytes]` input.
    pub(super) dtypes: Vec<String>,
    /// Expected wire shape (a tokenized prompt has none: its length is `max_tokens`).
    #[serde(default)]
    pub(super) shape: Option<Vec<usize>>,
    /// `hwc_to_chw`, `chw_to_hwc` or `none`.
    #[serde(default)]
    pub(super) layout: Option<String>,
    /// `y = ((x·scale + offset) − mean) / (std + eps)`.
    #[serde(default = "one")]
    pub(super) scale: f64,
    #[serde(default)]
    pub(super) offset: f64,
    /// Per-feature (length of the wire shape's last axis), per-element, or one value.
    #[serde(default)]
    pub(super) mean: Vec<f64>,
    #[serde(default)]
    pub(super) std: Vec<f64>,
    /// LeRobot's MIN_MAX instead of mean/std: `2·(x·scale + offset − min)/(max − min) − 1`.
    #[serde(default)]
    pub(super) min: Vec<f64>,
    #[serde(default)]
    pub(super) max: Vec<f64>,
    /// mean/std: the epsilon added to `std` (default 1e-6, openpi's; LeRobot's is 1e-8).
    /// min/max: the denominator used where `max == min` (default 1e-8, LeRobot's).
    #[serde(default)]
    pub(super) eps: Option<f64>,
    /// Frames of this key the engine input holds (LeRobot's `n_obs_steps`): the request sends
    /// one, policyd keeps the session's previous ones.
    #[serde(default)]
    pub(super) history: Option<usize>,
    /// May be absent from a request; the engine input is then filled with `fill`.
    #[serde(default)]
    pub(super) optional: bool,
    #[serde(default)]
    pub(super) fill: f64,
    /// Fixed engine shape, for models whose input has symbolic dimensions.
    #[serde(default)]
    pub(super) engine_shape: Option<Vec<usize>>,
    /// Serve NaN and infinity (and values that overflow the engine's dtype once normalised)
    /// instead of refusing the request.
    #[serde(default)]
    pub(super) allow_non_finite: bool,
    /// A prompt tokenized into token ids (`tensor`) and a mask.
    #[serde(default)]
    pub(super) tokenizer: Option<RawTokenizer>,
}

/// `[inputs.tokenizer]`: how a prompt becomes token ids and a mask (openpi's formats).
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTokenizer {
    /// A SentencePiece `.model` or a Hugging Face `tokenizer.json`, relative to the config file.
    pub(super) file: PathBuf,
    /// `pi0`, `pi05` or `plain`.
    pub(super) format: String,
    /// Length of the ids and mask inputs (openpi's `max_token_len`: 48 for pi0, 200 for pi0.5).
    pub(super) max_tokens: usize,
    /// Engine input for the mask (true for a token, false for padding).
    pub(super) mask_tensor: String,
    /// Id written after the last token.
    #[serde(default)]
    pub(super) pad_id: i64,
    /// `truncate` (openpi's behaviour) or `refuse`.
    #[serde(default)]
    pub(super) overflow: Option<String>,
    /// `pi05`: the input binding whose normalised values are discretised into the prompt.
    #[serde(default)]
    pub(super) state_key: Option<String>,
    /// A tokenizer.json's BOS token, by its text (SentencePiece models name their own).
    #[serde(default)]
    pub(super) bos: Option<String>,
    /// The most prompt bytes read before tokenizing (default: enough for `max_tokens` of the
    /// tokenizer's longest piece).
    #[serde(default)]
    pub(super) max_prompt_bytes: Option<usize>,
}

fn one() -> f64 {
    1.0
}

/// `[[outputs]]`: one engine output sent under one reply key.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOutput {
    /// Engine output name.
    pub(super) tensor: String,
    /// Reply key.
    #[serde(default = "actions")]
    pub(super) key: String,
    /// Wire dtype of the reply array (`float32` or `float64`).
    #[serde(default = "f32_name")]
    pub(super) dtype: String,
    /// Keep only the first N entries of the last axis (openpi's `actions[:, :14]`).
    #[serde(default)]
    pub(super) columns: Option<usize>,
    /// Un-normalisation `x·(std + eps) + mean`, per action dimension (or one value).
    #[serde(default)]
    pub(super) mean: Vec<f64>,
    #[serde(default)]
    pub(super) std: Vec<f64>,
    /// LeRobot's MIN_MAX un-normalisation instead: `(x + 1)/2·(max − min) + min`.
    #[serde(default)]
    pub(super) min: Vec<f64>,
    #[serde(default)]
    pub(super) max: Vec<f64>,
    /// As for inputs (mean/std default 1e-6; LeRobot un-normalises with 0).
    #[serde(default)]
    pub(super) eps: Option<f64>,
    /// Keep rows `[start, end)` of the output's first axis (LeRobot Diffusion's action slice).
    #[serde(default)]
    pub(super) rows: Option<[usize; 2]>,
    /// Relative actions: the input (a 1-D numeric binding) whose values, as the request sent
    /// them, are added to the masked columns after un-normalising (LeRobot's
    /// `AbsoluteActionsProcessorStep`, openpi's `AbsoluteActions`).
    #[serde(default)]
    pub(super) relative_to: Option<String>,
    /// Which columns get the offset (the first `len` columns; all kept columns when absent).
    #[serde(default)]
    pub(super) relative_mask: Option<Vec<bool>>,
}

fn actions() -> String {
    "actions".into()
}
fn f32_name() -> String {
    "float32".into()
}
