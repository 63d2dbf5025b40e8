//! `[planner]`: the task planner (a VLM behind an OpenAI-compatible endpoint) that feeds the
//! default policy its subtask.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::{ConfigError, Keys, Secret, path};

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
        planner(&RawPlanner::default(), None).expect("the default planner is valid")
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

/// The planner's default system message.
pub const DEFAULT_PLANNER_PROMPT: &str = "You plan the next step of a robot arm. The overall \
instruction is: {instruction}. Look at the camera image and name the single next subtask the \
robot should do now, as a short imperative phrase. The current subtask is: {subtask}. Answer with \
only a JSON object: {\"subtask\": \"<next subtask>\", \"done\": <true when the instruction is \
complete>}.";

/// `[planner]`'s own values; its bindings are checked against the plan.
pub(super) fn planner(p: &RawPlanner, base: Option<&Path>) -> Result<PlannerConfig, ConfigError> {
    let cx = Keys::top();
    let precedence = cx.one_of(
        "planner.precedence",
        Some(&p.precedence),
        None,
        &[
            ("client", Precedence::Client),
            ("planner", Precedence::Planner),
        ],
    )?;
    let resolved = PlannerConfig {
        enabled: p.enabled,
        endpoints: p.endpoints.clone(),
        model: p.model.clone(),
        api_key: p.api_key.clone(),
        api_key_file: p.api_key_file.as_deref().map(|f| path(base, f)),
        system_prompt: p.system_prompt.clone(),
        instruction: p.instruction.clone(),
        rate_hz: p.rate_hz,
        camera: p.camera.clone(),
        prompt_key: p.prompt_key.clone(),
        precedence,
        max_tokens: p.max_tokens,
        temperature: p.temperature,
        json_mode: p.json_mode,
        request_timeout_s: p.request_timeout_s,
        max_backoff_s: p.max_backoff_s,
        serve_command: p.serve_command.clone(),
        ready_marker: p.ready_marker.clone(),
        ready_timeout_s: p.ready_timeout_s,
        stop_grace_s: p.stop_grace_s,
    };
    if !p.enabled {
        return Ok(resolved);
    }
    if p.endpoints.is_empty() {
        return Err(cx.invalid(
            "planner.endpoints",
            "missing: give at least one base URL, e.g. [\"http://127.0.0.1:8080\"]",
        ));
    }
    for (i, e) in p.endpoints.iter().enumerate() {
        if let Err(why) = check_url(e) {
            return Err(cx.invalid(format!("planner.endpoints[{i}]"), why));
        }
    }
    if p.model.trim().is_empty() {
        return Err(cx.invalid(
            "planner.model",
            "missing: the model name the endpoints serve (as listed by GET /v1/models)",
        ));
    }
    if let Some(k) = &p.api_key
        && (k.0.is_empty() || k.0.chars().any(|c| c.is_control()))
    {
        return Err(cx.invalid("planner.api_key", "must be non-empty and on one line"));
    }
    if p.system_prompt.trim().is_empty() {
        return Err(cx.invalid("planner.system_prompt", "must not be empty"));
    }
    if !(p.rate_hz.is_finite() && p.rate_hz > 0.0 && p.rate_hz <= 50.0) {
        return Err(cx.invalid(
            "planner.rate_hz",
            format!("must be above 0 and at most 50, got {}", p.rate_hz),
        ));
    }
    cx.between("planner.max_tokens", p.max_tokens, 1, 32768)?;
    if !(p.temperature.is_finite() && (0.0..=2.0).contains(&p.temperature)) {
        return Err(cx.invalid(
            "planner.temperature",
            format!("must be between 0 and 2, got {}", p.temperature),
        ));
    }
    check_process(&cx, p)?;
    Ok(resolved)
}

/// The planner's deadlines, and the model server it may start (`serve_command`, whose
/// output `ready_marker` waits for).
fn check_process(cx: &Keys, p: &RawPlanner) -> Result<(), ConfigError> {
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
            return Err(cx.invalid(
                key,
                format!("must be a number of seconds between {min} and {max}, got {v}"),
            ));
        }
    }
    if p.serve_command.first().is_some_and(|c| c.trim().is_empty()) {
        return Err(cx.invalid(
            "planner.serve_command",
            "the first element must be the program to run",
        ));
    }
    if p.serve_command.is_empty() && p.ready_marker.is_some() {
        return Err(cx.invalid(
            "planner.ready_marker",
            "applies to planner.serve_command, which is not set",
        ));
    }
    if p.ready_marker.as_deref().is_some_and(|m| m.is_empty()) {
        return Err(cx.invalid("planner.ready_marker", "must not be empty"));
    }
    Ok(())
}

/// A planner endpoint: a plain-http base URL (the planner appends `/v1/...`).
pub fn check_url(url: &str) -> Result<(), String> {
    if url.starts_with("https://") {
        return Err(format!(
            "\"{url}\": https is not supported; use an http endpoint on the robot or the LAN \
             (or a TLS-terminating proxy on the robot)"
        ));
    }
    let Some(rest) = url.strip_prefix("http://") else {
        return Err(format!("\"{url}\": must start with http://"));
    };
    let host = rest.split('/').next().unwrap_or_default();
    if host.is_empty() || host.contains(char::is_whitespace) {
        return Err(format!("\"{url}\": no host"));
    }
    if url.contains(['?', '#']) {
        return Err(format!(
            "\"{url}\": give the base URL only (`/v1/...` is appended)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked() {
        assert!(check_url("http://127.0.0.1:8080").is_ok());
        assert!(check_url("http://vlm.lan/openai").is_ok());
        assert!(
            check_url("https://api.example.com")
                .unwrap_err()
                .contains("https")
        );
        assert!(check_url("127.0.0.1:8080").unwrap_err().contains("http://"));
        assert!(check_url("http://").unwrap_err().contains("no host"));
        assert!(
            check_url("http://h/v1?x=1")
                .unwrap_err()
                .contains("base URL")
        );
    }
}
