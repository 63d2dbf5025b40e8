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
mod tests {
    use super::*;
    use crate::dtype::ElemType;
    use crate::protocol::dialect::ResetReply;

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
        assert_eq!(c.server.idle_timeout_s, 3600.0);
        assert_eq!(c.server.write_timeout_s, 10.0);
        assert_eq!(c.server.max_connections_per_peer, 4);
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
    fn closed_sets_name_the_key_and_every_choice() {
        let e = replace(
            "model = \"m.onnx\"",
            "model = \"m.onnx\"\nbackend = \"gpu\"",
        );
        assert!(
            e.contains("engine.backend")
                && e.contains(r#"must be "cpu", "ort" or "tensorrt", got "gpu""#),
            "{e}"
        );
        let e = replace(
            "model = \"m.onnx\"",
            "model = \"m.onnx\"\nbackend = \"tensorrt\"\nzero_copy = \"yes\"",
        );
        assert!(
            e.contains(r#"engine.zero_copy`: must be "auto", "on" or "off", got "yes""#),
            "{e}"
        );
        let e = replace("shape = [8]", "shape = [8]\nlayout = \"hwc\"");
        assert!(
            e.contains("inputs[0].layout") && e.contains(r#"got "hwc""#),
            "{e}"
        );
        let e = err("[server]\nreset_reply = \"json\"");
        assert!(
            e.contains(r#"server.reset_reply`: must be "msgpack" or "text", got "json""#),
            "{e}"
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
