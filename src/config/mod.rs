//! What is policyd told to serve, and how? The configuration, resolved: every value checked,
//! every closed set an enum, every path absolute against the file's folder, one
//! [`PolicySpec`] per policy. One file per section holds that section's raw form (its TOML
//! shape, deserialized with `deny_unknown_fields` and the documented defaults), its checks and
//! its resolved type: `server.rs`, `access.rs` (`[auth]`, `[tls]`), `engine.rs`, `bindings/`
//! (`[[inputs]]`, one file per facet of a binding, and `[[outputs]]`), `pacing.rs`,
//! `pipeline.rs` (`[denoise]`, `[sampler]`), `rtc.rs` (`[rtc]`), `planner.rs`, `lerobot.rs`;
//! `policies.rs` assembles them (the `[[policies]]` list) and `raw.rs` is the file's top
//! level. A new key touches its section's file (for a binding, its facet's) and `raw.rs`'s
//! table if the key is new to the file; each file names what it uses from the others.
//! Parsing reads the config file and nothing else: key files, certificates and models are
//! opened by the layers that use them ([`crate::net`], [`crate::planner`], [`crate::policy`]).
//! Checks against the engine's real inputs and outputs are [`crate::bind`]'s.

mod access;
mod bindings;
mod engine;
mod lerobot;
mod pacing;
mod pipeline;
mod planner;
mod policies;
mod raw;
mod rtc;
mod server;

use std::path::{Path, PathBuf};

use crate::limits::{MAX_ELEMENTS, element_count};

pub use access::{AuthConfig, Secret, TlsConfig};
pub use bindings::{InputConfig, InputKind, Layout, OutputConfig, RelativeConfig, TokenizerConfig};
pub use engine::{Backend, EngineConfig, ModelSource, Provider, ZeroCopy, external_data_path};
pub use lerobot::{LerobotConfig, LerobotResize, LerobotServe};
pub use pacing::PacingConfig;
pub use pipeline::PipelineConfig;
pub use planner::{DEFAULT_PLANNER_PROMPT, PlannerConfig, Precedence, check_url};
pub use server::ServerConfig;

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
        policies::resolve(raw, base)
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

/// How a section's errors name their keys: a policy's under `policies[i].`, with its name.
struct Keys {
    prefix: String,
    suffix: String,
}

impl Keys {
    /// Top-level keys, as written.
    fn top() -> Keys {
        Keys {
            prefix: String::new(),
            suffix: String::new(),
        }
    }

    /// The keys of `policies[i]`, named `name`.
    fn policy(i: usize, name: &str) -> Keys {
        Keys {
            prefix: format!("policies[{i}]."),
            suffix: format!(" (policy \"{name}\")"),
        }
    }

    /// An integer setting within `lo..=hi`, or an error naming `key`.
    /// A closed set's value, by name: a key left out (`None`) takes `default` if it has one;
    /// anything not among `choices` is an error listing them. The one place every
    /// string-valued option is read.
    fn one_of<T: Copy>(
        &self,
        key: &str,
        value: Option<&str>,
        default: Option<T>,
        choices: &[(&str, T)],
    ) -> Result<T, ConfigError> {
        match (value, default) {
            (None, Some(d)) => return Ok(d),
            (Some(v), _) => {
                if let Some(&(_, t)) = choices.iter().find(|(name, _)| *name == v) {
                    return Ok(t);
                }
            }
            (None, None) => {}
        }
        let names: Vec<String> = choices.iter().map(|(n, _)| format!("\"{n}\"")).collect();
        let list = match names.split_last() {
            Some((last, [])) => last.clone(),
            Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
            None => String::new(),
        };
        Err(self.invalid(
            key,
            format!("must be {list}, got \"{}\"", value.unwrap_or_default()),
        ))
    }

    fn between<T>(&self, key: &str, v: T, lo: T, hi: T) -> Result<(), ConfigError>
    where
        T: PartialOrd + std::fmt::Display,
    {
        if v < lo || v > hi {
            return Err(self.invalid(key, format!("must be between {lo} and {hi}, got {v}")));
        }
        Ok(())
    }

    fn invalid(&self, key: impl AsRef<str>, message: impl Into<String>) -> ConfigError {
        invalid(
            format!("{}{}", self.prefix, key.as_ref()),
            format!("{}{}", message.into(), self.suffix),
        )
    }
}

/// A path the file names, resolved against its folder.
fn path(base: Option<&Path>, p: &Path) -> PathBuf {
    base.map_or_else(|| p.to_path_buf(), |b| b.join(p))
}

fn check_metadata(cx: &Keys, key: &str, v: &toml::Value) -> Result<(), ConfigError> {
    match v {
        toml::Value::Datetime(_) => {
            Err(cx.invalid(key, "dates cannot be sent as metadata; use a string"))
        }
        toml::Value::Array(a) => a
            .iter()
            .enumerate()
            .try_for_each(|(i, x)| check_metadata(cx, &format!("{key}[{i}]"), x)),
        toml::Value::Table(t) => t
            .iter()
            .try_for_each(|(k, x)| check_metadata(cx, &format!("{key}.{k}"), x)),
        _ => Ok(()),
    }
}

/// [`element_count`], or an error naming `key`.
fn elements(cx: &Keys, key: &str, shape: &[usize]) -> Result<usize, ConfigError> {
    element_count(shape).ok_or_else(|| {
        cx.invalid(
            key,
            format!("{shape:?} holds more than {MAX_ELEMENTS} elements; check the dimensions"),
        )
    })
}

#[cfg(test)]
mod tests;
