//! What does the file say at its top level? The sections it holds (each section's own raw form
//! is in that section's file) and a policy's table, deserialized with `deny_unknown_fields`
//! before any value is checked. Private to `config`: closed sets are still strings here, so
//! that the checks can name the key of a bad value; paths are still relative to the file.

use serde::Deserialize;

use super::access::{RawAuth, RawTls};
use super::bindings::{RawInput, RawOutput};
use super::engine::RawEngine;
use super::lerobot::RawLerobot;
use super::pacing::PacingConfig;
use super::pipeline::{RawDenoise, RawSampler};
use super::planner::RawPlanner;
use super::rtc::RawRtc;
use super::server::RawServer;

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
    /// Real-time chunking of the flow sampler (see docs/pacing.md).
    #[serde(default)]
    pub(super) rtc: Option<RawRtc>,
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
    #[serde(default)]
    pub(super) rtc: Option<RawRtc>,
}
