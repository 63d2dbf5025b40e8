//! Is each value in range, and what does it resolve to? Every section of the raw file checked
//! on its own and turned into its typed, resolved form; each error names its key where the
//! value was read, through the section's [`Keys`] (a policy's keys carry `policies[i].` and
//! its name), so nothing rewrites keys afterwards.

use std::path::{Path, PathBuf};

use super::raw::{
    RawAuth, RawConfig, RawEngine, RawInput, RawLerobot, RawOutput, RawPlanner, RawServer, RawTls,
};
use super::*;
use crate::limits::{
    MAX_ELEMENTS, MAX_LATENCY_WINDOW, MAX_PATH, MAX_POLICIES, MAX_POLICY_NAME,
    MAX_SIMILARITY_STATE, MAX_SLOTS, element_count,
};
use crate::protocol::RESERVED_KEYS;

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

/// Checks and resolves a parsed file; `base` is its folder (paths are relative to it).
pub(super) fn resolve(raw: RawConfig, base: Option<&Path>) -> Result<Config, ConfigError> {
    let top = Keys::top();
    let server = server(&raw.server)?;
    let named = !raw.policies.is_empty();
    let mut policies = Vec::new();
    let default;
    if named {
        policy_list(&raw)?;
        default = raw.policies.iter().position(|p| p.default).unwrap_or(0);
        for (i, p) in raw.policies.iter().enumerate() {
            let cx = Keys::policy(i, &p.name);
            let (mut pacing, pacing_keys) = match &p.pacing {
                Some(own) => (own.clone(), Keys::policy(i, &p.name)),
                None => (raw.pacing.clone(), Keys::top()),
            };
            if let Some(n) = p.actions_per_chunk {
                pacing.actions_per_chunk = n;
            }
            policies.push(policy(
                &cx,
                &pacing_keys,
                PolicyParts {
                    name: p.name.clone(),
                    is_default: i == default,
                    engine: &p.engine,
                    inputs: &p.inputs,
                    outputs: &p.outputs,
                    metadata: &p.metadata,
                    pacing,
                    reset_on_prompt_change: p.reset_on_prompt_change,
                    denoise: p.denoise.as_ref(),
                    sampler: p.sampler.as_ref(),
                },
                base,
            )?);
        }
    } else {
        default = 0;
        policies.push(policy(
            &top,
            &top,
            PolicyParts {
                name: "default".into(),
                is_default: true,
                engine: &raw.engine,
                inputs: &raw.inputs,
                outputs: &raw.outputs,
                metadata: &raw.metadata,
                pacing: raw.pacing.clone(),
                reset_on_prompt_change: raw.reset_on_prompt_change,
                denoise: raw.denoise.as_ref(),
                sampler: raw.sampler.as_ref(),
            },
            base,
        )?);
    }
    let lerobot = raw
        .lerobot
        .as_ref()
        .map(|l| lerobot(l, &policies, default))
        .transpose()?;
    Ok(Config {
        server,
        lerobot,
        planner: planner(&raw.planner, base)?,
        auth: auth(&raw.auth, base),
        tls: tls(&raw.tls, base)?,
        policies,
        default,
        named,
    })
}

/// `[lerobot]`'s values; `serve` entries must name served policies.
fn lerobot(
    l: &RawLerobot,
    policies: &[PolicySpec],
    default: usize,
) -> Result<LerobotConfig, ConfigError> {
    let listen = l.listen.as_deref().ok_or_else(|| {
        invalid(
            "lerobot.listen",
            "missing: the service needs its own address, e.g. \"0.0.0.0:8080\" (LeRobot's \
             clients default to port 8080)",
        )
    })?;
    let listen = listen.parse().map_err(|_| {
        invalid(
            "lerobot.listen",
            format!("\"{listen}\" is not an address with a port, e.g. \"0.0.0.0:8080\""),
        )
    })?;
    let allow = l
        .allow
        .iter()
        .map(|a| {
            a.parse::<ipnet::IpNet>()
                .or_else(|_| a.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
                .map_err(|_| {
                    invalid(
                        "lerobot.allow",
                        format!(
                            "\"{a}\" is not an address or a CIDR network such as 192.168.1.0/24"
                        ),
                    )
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let long_poll_ms = l.long_poll_ms.unwrap_or(2000);
    if !(1..=60_000).contains(&long_poll_ms) {
        return Err(invalid(
            "lerobot.long_poll_ms",
            format!("must be within 1..=60000 (LeRobot's server waits 2000), got {long_poll_ms}"),
        ));
    }
    let max_payload_bytes = l.max_payload_bytes.unwrap_or(32 << 20);
    if !(1024..=(1 << 30)).contains(&max_payload_bytes) {
        return Err(invalid(
            "lerobot.max_payload_bytes",
            format!(
                "must be within 1024..=1073741824 (three 640x480 cameras pickle to 2.8 MB), got \
                 {max_payload_bytes}"
            ),
        ));
    }
    let resize = match l.resize.as_deref() {
        None | Some("bilinear") => LerobotResize::Bilinear,
        Some("refuse") => LerobotResize::Refuse,
        Some(other) => {
            return Err(invalid(
                "lerobot.resize",
                format!(
                    "must be \"bilinear\" (as LeRobot 0.6.1's server) or \"refuse\", got \"{other}\""
                ),
            ));
        }
    };
    let cx = Keys::top();
    let max_connections = l.max_connections.unwrap_or(16);
    cx.between("lerobot.max_connections", max_connections, 1, 1024)?;
    let seconds = |key: &str, v: Option<f64>, default: f64, max: f64| {
        let v = v.unwrap_or(default);
        if v.is_finite() && v > 0.0 && v <= max {
            Ok(std::time::Duration::from_secs_f64(v))
        } else {
            Err(cx.invalid(
                key,
                format!("must be a number of seconds above 0 and at most {max}, got {v}"),
            ))
        }
    };
    let handshake_timeout = seconds(
        "lerobot.handshake_timeout_s",
        l.handshake_timeout_s,
        10.0,
        3600.0,
    )?;
    let idle_timeout = seconds("lerobot.idle_timeout_s", l.idle_timeout_s, 120.0, 86400.0)?;
    let chunk_timeout = seconds("lerobot.chunk_timeout_s", l.chunk_timeout_s, 5.0, 3600.0)?;
    let observation_timeout = seconds(
        "lerobot.observation_timeout_s",
        l.observation_timeout_s,
        10.0,
        3600.0,
    )?;
    let takeover_after = seconds(
        "lerobot.takeover_after_s",
        l.takeover_after_s,
        10.0,
        86400.0,
    )?;
    let long_poll = std::time::Duration::from_millis(long_poll_ms);
    if idle_timeout <= long_poll {
        return Err(cx.invalid(
            "lerobot.idle_timeout_s",
            format!(
                "must be longer than lerobot.long_poll_ms ({long_poll_ms} ms), or a client \
                 waiting for actions is cut off"
            ),
        ));
    }
    if observation_timeout < chunk_timeout {
        return Err(cx.invalid(
            "lerobot.observation_timeout_s",
            "must be at least lerobot.chunk_timeout_s (one chunk is part of an observation)",
        ));
    }
    let mut serve = Vec::new();
    for (i, s) in l.serve.iter().enumerate() {
        let key = format!("lerobot.serve[{i}]");
        if s.pretrained.trim().is_empty() {
            return Err(invalid(format!("{key}.pretrained"), "must not be empty"));
        }
        let policy = match &s.policy {
            Some(p) if policies.iter().any(|q| &q.name == p) => p.clone(),
            Some(p) => {
                let names: Vec<&str> = policies.iter().map(|q| q.name.as_str()).collect();
                return Err(invalid(
                    format!("{key}.policy"),
                    format!("no policy is named \"{p}\"; served: {}", names.join(", ")),
                ));
            }
            None => policies[default].name.clone(),
        };
        if s.policy_type
            .as_deref()
            .is_some_and(|t| t.trim().is_empty())
        {
            return Err(invalid(format!("{key}.policy_type"), "must not be empty"));
        }
        serve.push(LerobotServe {
            pretrained: s.pretrained.clone(),
            policy,
            policy_type: s.policy_type.clone(),
        });
    }
    Ok(LerobotConfig {
        listen,
        allow,
        long_poll,
        max_payload_bytes,
        resize,
        max_connections,
        handshake_timeout,
        idle_timeout,
        chunk_timeout,
        observation_timeout,
        takeover_after,
        serve,
    })
}

/// A path the file names, resolved against its folder.
fn path(base: Option<&Path>, p: &Path) -> PathBuf {
    base.map_or_else(|| p.to_path_buf(), |b| b.join(p))
}

fn auth(a: &RawAuth, base: Option<&Path>) -> AuthConfig {
    AuthConfig {
        api_keys: a.api_keys.clone(),
        key_file: a.key_file.as_deref().map(|f| path(base, f)),
        protect_metrics: a.protect_metrics,
    }
}

fn tls(t: &RawTls, base: Option<&Path>) -> Result<Option<TlsConfig>, ConfigError> {
    match (&t.cert, &t.key) {
        (None, None) => Ok(None),
        (Some(c), Some(k)) => Ok(Some(TlsConfig {
            cert: path(base, c),
            key: path(base, k),
        })),
        (Some(_), None) => Err(invalid("tls.key", "missing: tls.cert needs its key")),
        (None, Some(_)) => Err(invalid(
            "tls.cert",
            "missing: tls.key needs its certificate",
        )),
    }
}

/// `[server]`'s values.
pub(super) fn server(s: &RawServer) -> Result<ServerConfig, ConfigError> {
    let cx = Keys::top();
    if s.host.trim().is_empty() {
        return Err(cx.invalid("server.host", "must not be empty"));
    }
    cx.between("server.max_connections", s.max_connections, 1, 4096)?;
    cx.between(
        "server.max_message_bytes",
        s.max_message_bytes,
        1024,
        1 << 30,
    )?;
    for (key, v, max) in [
        ("server.ping_interval_s", s.ping_interval_s, 86400.0),
        ("server.ping_timeout_s", s.ping_timeout_s, 86400.0),
        ("server.idle_timeout_s", s.idle_timeout_s, 86400.0 * 365.0),
        ("server.handshake_timeout_s", s.handshake_timeout_s, 3600.0),
        ("server.frame_timeout_s", s.frame_timeout_s, 3600.0),
    ] {
        if !(v.is_finite() && (0.0..=max).contains(&v)) {
            return Err(cx.invalid(
                key,
                format!("must be a number of seconds between 0 and {max}, got {v}"),
            ));
        }
    }
    if s.ping_interval_s > 0.0 && s.ping_timeout_s <= 0.0 {
        return Err(cx.invalid(
            "server.ping_timeout_s",
            "must be positive when server.ping_interval_s is set",
        ));
    }
    if s.handshake_timeout_s <= 0.0 {
        return Err(cx.invalid("server.handshake_timeout_s", "must be positive"));
    }
    cx.between(
        "server.max_sessions",
        s.max_sessions,
        1,
        crate::limits::MAX_SESSIONS,
    )?;
    let reset_reply = match s.reset_reply.as_str() {
        "msgpack" => ResetReply::Msgpack,
        "text" => ResetReply::Text,
        other => {
            return Err(cx.invalid(
                "server.reset_reply",
                format!("must be \"msgpack\" or \"text\", got \"{other}\""),
            ));
        }
    };
    cx.between("server.max_depth", s.max_depth, 2, 64)?;
    if s.memory_budget_mb > 1 << 24 {
        return Err(cx.invalid(
            "server.memory_budget_mb",
            format!(
                "must be at most 16777216 (16 TiB), got {}",
                s.memory_budget_mb
            ),
        ));
    }
    cx.between("server.max_map_entries", s.max_map_entries, 8, 1_000_000)?;

    Ok(ServerConfig {
        host: s.host.clone(),
        port: s.port,
        max_connections: s.max_connections,
        max_message_bytes: s.max_message_bytes,
        ping_interval_s: s.ping_interval_s,
        ping_timeout_s: s.ping_timeout_s,
        idle_timeout_s: s.idle_timeout_s,
        handshake_timeout_s: s.handshake_timeout_s,
        frame_timeout_s: s.frame_timeout_s,
        max_sessions: s.max_sessions,
        reset_reply,
        max_depth: s.max_depth,
        max_map_entries: s.max_map_entries,
        memory_budget_mb: s.memory_budget_mb,
    })
}

/// `[[policies]]` as a list: names, the default, and nothing left at the top level.
fn policy_list(raw: &RawConfig) -> Result<(), ConfigError> {
    if raw.policies.len() > MAX_POLICIES {
        return Err(invalid(
            "policies",
            format!(
                "{} policies declared; at most {MAX_POLICIES}",
                raw.policies.len()
            ),
        ));
    }
    for (i, p) in raw.policies.iter().enumerate() {
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
        if let Some(j) = raw.policies[..i].iter().position(|q| q.name == p.name) {
            return Err(invalid(
                format!("policies[{i}].name"),
                format!("\"{}\" is also the name of policies[{j}]", p.name),
            ));
        }
    }
    let defaults: Vec<&str> = raw
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
        ("engine", raw.engine.model.is_some()),
        ("inputs", !raw.inputs.is_empty()),
        ("outputs", !raw.outputs.is_empty()),
        ("metadata", !raw.metadata.is_empty()),
        ("reset_on_prompt_change", raw.reset_on_prompt_change),
        ("denoise", raw.denoise.is_some()),
        ("sampler", raw.sampler.is_some()),
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

/// What one policy is made of, from the top level or a `[[policies]]` entry.
struct PolicyParts<'a> {
    name: String,
    is_default: bool,
    engine: &'a RawEngine,
    inputs: &'a [RawInput],
    outputs: &'a [RawOutput],
    metadata: &'a toml::Table,
    pacing: PacingConfig,
    reset_on_prompt_change: bool,
    denoise: Option<&'a super::raw::RawDenoise>,
    sampler: Option<&'a super::raw::RawSampler>,
}

/// One policy's engine, pacing, bindings and metadata.
fn policy(
    cx: &Keys,
    pacing_keys: &Keys,
    p: PolicyParts<'_>,
    base: Option<&Path>,
) -> Result<PolicySpec, ConfigError> {
    let (engine, model) = engine(cx, p.engine, base)?;
    let inputs = inputs(cx, p.inputs, base)?;
    pacing(pacing_keys, &p.pacing, &inputs)?;
    let outputs = outputs(cx, p.outputs)?;
    for (key, v) in p.metadata {
        check_metadata(cx, &format!("metadata.{key}"), v)?;
    }
    Ok(PolicySpec {
        name: p.name,
        is_default: p.is_default,
        engine,
        model,
        inputs,
        outputs,
        metadata: p.metadata.clone(),
        pacing: p.pacing,
        reset_on_prompt_change: p.reset_on_prompt_change,
        pipeline: pipeline(cx, p.denoise, p.sampler, base)?,
    })
}

/// `[denoise]` and `[sampler]`: both or neither; the sampler's own values (its tensors are
/// checked against the step graph when it is loaded).
fn pipeline(
    cx: &Keys,
    denoise: Option<&super::raw::RawDenoise>,
    sampler: Option<&super::raw::RawSampler>,
    base: Option<&Path>,
) -> Result<Option<PipelineConfig>, ConfigError> {
    use crate::sampler::{Betas, Diffusion, Kind, Prediction};
    let (d, s) = match (denoise, sampler) {
        (None, None) => return Ok(None),
        (Some(d), Some(s)) => (d, s),
        (Some(_), None) => {
            return Err(cx.invalid(
                "sampler",
                "[denoise] needs a [sampler] saying how to run it",
            ));
        }
        (None, Some(_)) => {
            return Err(cx.invalid(
                "denoise",
                "[sampler] needs the [denoise] step graph it runs",
            ));
        }
    };
    let kind = match s.kind.as_str() {
        "flow" => Kind::Flow,
        "ddpm" => Kind::Ddpm,
        "ddim" => Kind::Ddim,
        k => {
            return Err(cx.invalid(
                "sampler.kind",
                format!("must be \"flow\", \"ddpm\" or \"ddim\", got \"{k}\""),
            ));
        }
    };
    let max_steps = s.max_steps.unwrap_or(s.steps);
    cx.between(
        "sampler.max_steps",
        max_steps,
        1,
        crate::limits::MAX_SAMPLER_STEPS,
    )?;
    cx.between("sampler.steps", s.steps, 1, max_steps)?;
    for (key, v) in [
        ("sampler.x", &s.x),
        ("sampler.time", &s.time),
        ("sampler.output", &s.output),
    ] {
        if v.is_empty() {
            return Err(cx.invalid(key, "name the step graph's tensor"));
        }
    }
    let diffusion_keys = s.num_train_timesteps.is_some()
        || s.beta_schedule.is_some()
        || s.beta_start.is_some()
        || s.beta_end.is_some()
        || s.prediction_type.is_some()
        || s.clip_sample.is_some()
        || s.clip_sample_range.is_some()
        || s.eta.is_some();
    let diffusion = if kind == Kind::Flow {
        if diffusion_keys {
            return Err(cx.invalid(
                "sampler.kind",
                "\"flow\" takes no scheduler keys (num_train_timesteps, beta_*, prediction_type, \
                 clip_sample*, eta)",
            ));
        }
        None
    } else {
        let t = s.num_train_timesteps.unwrap_or(1000);
        cx.between("sampler.num_train_timesteps", t, 1, 100_000)?;
        if max_steps > t {
            return Err(cx.invalid(
                "sampler.max_steps",
                format!("{max_steps} exceeds num_train_timesteps ({t})"),
            ));
        }
        let betas = match s.beta_schedule.as_deref().unwrap_or("linear") {
            "linear" => Betas::Linear,
            "scaled_linear" => Betas::ScaledLinear,
            "squaredcos_cap_v2" => Betas::SquaredCosCapV2,
            b => {
                return Err(cx.invalid(
                    "sampler.beta_schedule",
                    format!(
                        "must be \"linear\", \"scaled_linear\" or \"squaredcos_cap_v2\", got \"{b}\""
                    ),
                ));
            }
        };
        let prediction = match s.prediction_type.as_deref().unwrap_or("epsilon") {
            "epsilon" => Prediction::Epsilon,
            "sample" => Prediction::Sample,
            "v_prediction" => Prediction::VPrediction,
            p => {
                return Err(cx.invalid(
                    "sampler.prediction_type",
                    format!("must be \"epsilon\", \"sample\" or \"v_prediction\", got \"{p}\""),
                ));
            }
        };
        let (beta_start, beta_end) = (s.beta_start.unwrap_or(0.0001), s.beta_end.unwrap_or(0.02));
        if !(beta_start > 0.0 && beta_start <= beta_end && beta_end < 1.0) {
            return Err(cx.invalid(
                "sampler.beta_start",
                format!("need 0 < beta_start <= beta_end < 1, got {beta_start} and {beta_end}"),
            ));
        }
        let range = s.clip_sample_range.unwrap_or(1.0);
        if !(range.is_finite() && range > 0.0) {
            return Err(cx.invalid("sampler.clip_sample_range", "must be a positive number"));
        }
        let eta = s.eta.unwrap_or(0.0);
        if kind == Kind::Ddpm && s.eta.is_some() {
            return Err(cx.invalid("sampler.eta", "is DDIM's; DDPM always adds its noise"));
        }
        if !(0.0..=1.0).contains(&eta) {
            return Err(cx.invalid("sampler.eta", format!("must be within 0..=1, got {eta}")));
        }
        Some(Diffusion {
            train_timesteps: t,
            betas,
            beta_start,
            beta_end,
            prediction,
            clip: s.clip_sample.unwrap_or(true).then_some(range as f32),
            eta: eta as f32,
        })
    };
    let model_update = match (s.update.as_deref().unwrap_or("sampler"), &s.dt) {
        ("sampler", None) => None,
        ("sampler", Some(_)) => {
            return Err(cx.invalid("sampler.dt", "is for update = \"model\""));
        }
        ("model", _) if kind != Kind::Flow => {
            return Err(cx.invalid(
                "sampler.update",
                "\"model\" (a step graph returning x + dt·v) is for kind = \"flow\"",
            ));
        }
        ("model", Some(dt)) if !dt.is_empty() => Some(dt.clone()),
        ("model", _) => {
            return Err(cx.invalid(
                "sampler.dt",
                "update = \"model\" needs the step-graph input taking dt",
            ));
        }
        (u, _) => {
            return Err(cx.invalid(
                "sampler.update",
                format!("must be \"sampler\" or \"model\", got \"{u}\""),
            ));
        }
    };
    let flow_time = match s.flow_time.as_deref() {
        None | Some("openpi") => crate::sampler::FlowTime::Openpi,
        Some("lerobot") => crate::sampler::FlowTime::Lerobot,
        Some(t) => {
            return Err(cx.invalid(
                "sampler.flow_time",
                format!("must be \"openpi\" or \"lerobot\", got \"{t}\""),
            ));
        }
    };
    if s.flow_time.is_some() && kind != Kind::Flow {
        return Err(cx.invalid("sampler.flow_time", "applies to kind = \"flow\" only"));
    }
    Ok(Some(PipelineConfig {
        denoise: ModelSource::File(path(base, &d.model)),
        wire: d.wire.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        kind,
        diffusion,
        steps: s.steps,
        max_steps,
        x: s.x.clone(),
        time: s.time.clone(),
        output: s.output.clone(),
        model_update,
        inject_noise: s.inject_noise,
        flow_time,
    }))
}

/// `[engine]`, and the model it names.
fn engine(
    cx: &Keys,
    e: &RawEngine,
    base: Option<&Path>,
) -> Result<(EngineConfig, ModelSource), ConfigError> {
    // Whether this build has the backend is the engine layer's question (policy::build):
    // a client such as policyd-bench reads any server's config.
    let backend = match e.backend.as_str() {
        "cpu" => Backend::Cpu,
        "tensorrt" => Backend::Tensorrt,
        "ort" => Backend::Ort,
        other => {
            return Err(cx.invalid(
                "engine.backend",
                format!("unknown backend \"{other}\": choose cpu, ort or tensorrt"),
            ));
        }
    };
    if backend != Backend::Ort {
        for (key, set) in [
            ("engine.ort_library", e.ort_library.is_some()),
            ("engine.providers", e.providers.is_some()),
        ] {
            if set {
                return Err(cx.invalid(
                    key,
                    format!(
                        "applies to the ort backend only; engine.backend is \"{}\"",
                        e.backend
                    ),
                ));
            }
        }
    }
    let providers = match &e.providers {
        None => vec![Provider::Cpu],
        Some(list) => providers(cx, list)?,
    };
    if backend == Backend::Ort
        && e.device.is_some()
        && !providers.iter().any(|p| *p != Provider::Cpu)
    {
        return Err(cx.invalid(
            "engine.device",
            "applies to the ort backend with a GPU provider only; add \"cuda\" or \"tensorrt\" to engine.providers",
        ));
    }
    let ort_library = match &e.ort_library {
        None => None,
        Some(p) if p.as_os_str().is_empty() => {
            return Err(cx.invalid(
                "engine.ort_library",
                "is empty; give the path of libonnxruntime.so or of the folder holding it, or leave the key out",
            ));
        }
        Some(p) => {
            let p = path(base, p);
            if !p.exists() {
                return Err(cx.invalid(
                    "engine.ort_library",
                    format!(
                        "{} does not exist; give the path of libonnxruntime.so or of the folder holding it (`pip install onnxruntime` puts it in site-packages/onnxruntime/capi/)",
                        p.display()
                    ),
                ));
            }
            Some(p)
        }
    };
    if backend != Backend::Tensorrt {
        for (key, set) in [
            (
                "engine.device",
                e.device.is_some() && backend != Backend::Ort,
            ),
            ("engine.dla_core", e.dla_core.is_some()),
            ("engine.cuda_graph", e.cuda_graph.is_some()),
            ("engine.zero_copy", e.zero_copy.is_some()),
            ("engine.tensorrt_library", e.tensorrt_library.is_some()),
        ] {
            if set {
                return Err(cx.invalid(
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
        return Err(cx.invalid(
            "engine.device",
            format!("must be a CUDA device ordinal (0-63), got {d}"),
        ));
    }
    if let Some(d) = e.dla_core
        && d > 7
    {
        return Err(cx.invalid(
            "engine.dla_core",
            format!("must be a DLA core number (0 or 1 on Jetson AGX Orin), got {d}"),
        ));
    }
    let zero_copy = match e.zero_copy.as_deref() {
        None | Some("auto") => ZeroCopy::Auto,
        Some("on") => ZeroCopy::On,
        Some("off") => ZeroCopy::Off,
        Some(z) => {
            return Err(cx.invalid(
                "engine.zero_copy",
                format!("must be \"auto\", \"on\" or \"off\", got \"{z}\""),
            ));
        }
    };
    let Some(model) = &e.model else {
        return Err(cx.invalid("engine.model", "missing: give the path of the ONNX model"));
    };
    cx.between("engine.slots", e.slots, 1, MAX_SLOTS)?;
    if e.timeout_ms != 0 && !(10..=3_600_000).contains(&e.timeout_ms) {
        return Err(cx.invalid(
            "engine.timeout_ms",
            format!(
                "must be 0 (never) or between 10 and 3600000, got {}",
                e.timeout_ms
            ),
        ));
    }
    // Validated against the machine that starts: more threads than CPUs only contend (and
    // steal time from the serving threads).
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if !(1..=cpus).contains(&e.threads) {
        return Err(cx.invalid(
            "engine.threads",
            format!(
                "must be within 1..={cpus} (this machine's CPUs), got {}",
                e.threads
            ),
        ));
    }
    if e.warmup_runs > 1000 {
        return Err(cx.invalid(
            "engine.warmup_runs",
            format!("must be at most 1000, got {}", e.warmup_runs),
        ));
    }
    Ok((
        EngineConfig {
            backend,
            device: e.device.unwrap_or(0),
            dla_core: e.dla_core,
            cuda_graph: e.cuda_graph.unwrap_or(true),
            zero_copy,
            tensorrt_library: e.tensorrt_library.clone(),
            slots: e.slots,
            warmup_runs: e.warmup_runs,
            timeout_ms: e.timeout_ms,
            threads: e.threads,
            ort_library,
            providers,
        },
        ModelSource::File(path(base, model)),
    ))
}

/// `engine.providers`: known names, no repeats, at least one.
fn providers(cx: &Keys, list: &[String]) -> Result<Vec<Provider>, ConfigError> {
    if list.is_empty() {
        return Err(cx.invalid(
            "engine.providers",
            "is empty; leave it out for the CPU, or list providers such as [\"cuda\", \"cpu\"]",
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    for name in list {
        let p = Provider::ALL
            .into_iter()
            .find(|p| p.name() == name)
            .ok_or_else(|| {
                cx.invalid(
                    "engine.providers",
                    format!("unknown provider \"{name}\": choose from cpu, cuda, tensorrt"),
                )
            })?;
        if out.contains(&p) {
            return Err(cx.invalid("engine.providers", format!("\"{name}\" is listed twice")));
        }
        out.push(p);
    }
    Ok(out)
}

fn is_text(b: &RawInput) -> bool {
    b.dtypes.iter().any(|d| d == "text")
}

/// `[inputs.tokenizer]` of binding `i` (the file is read when the plan is compiled).
fn tokenizer(
    cx: &Keys,
    i: usize,
    t: &super::raw::RawTokenizer,
    base: Option<&Path>,
) -> Result<TokenizerConfig, ConfigError> {
    let k = |f: &str| format!("inputs[{i}].tokenizer.{f}");
    let format = crate::tokenizer::Format::from_name(&t.format).ok_or_else(|| {
        cx.invalid(
            k("format"),
            format!(
                "must be \"pi0\", \"pi05\", \"plain\" or \"lerobot\", got \"{}\"",
                t.format
            ),
        )
    })?;
    cx.between(&k("max_tokens"), t.max_tokens, 1, crate::limits::MAX_TOKENS)?;
    let refuse_overflow = match t.overflow.as_deref() {
        None | Some("truncate") => false,
        Some("refuse") => true,
        Some(o) => {
            return Err(cx.invalid(
                k("overflow"),
                format!("must be \"truncate\" or \"refuse\", got \"{o}\""),
            ));
        }
    };
    match (format, &t.state_key) {
        (crate::tokenizer::Format::Pi05, None) => {
            return Err(cx.invalid(
                k("state_key"),
                "format \"pi05\" puts the discretised state in the prompt: name the state's input key",
            ));
        }
        (
            crate::tokenizer::Format::Pi0
            | crate::tokenizer::Format::Plain
            | crate::tokenizer::Format::Lerobot,
            Some(_),
        ) => {
            return Err(cx.invalid(
                k("state_key"),
                "only format \"pi05\" puts the state in the prompt",
            ));
        }
        _ => {}
    }
    if let Some(n) = t.max_prompt_bytes {
        cx.between(
            &k("max_prompt_bytes"),
            n,
            1,
            crate::limits::MAX_PROMPT_BYTES,
        )?;
    }
    if t.file.as_os_str().is_empty() {
        return Err(cx.invalid(k("file"), "name the tokenizer's .model or tokenizer.json"));
    }
    if t.mask_tensor.is_empty() {
        return Err(cx.invalid(k("mask_tensor"), "name the engine input of the mask"));
    }
    Ok(TokenizerConfig {
        file: ModelSource::File(path(base, &t.file)),
        format,
        max_tokens: t.max_tokens,
        mask_tensor: t.mask_tensor.clone(),
        pad_id: t.pad_id,
        refuse_overflow,
        state_key: t.state_key.clone(),
        bos: t.bos.clone(),
        max_prompt_bytes: t.max_prompt_bytes,
    })
}

/// `[[inputs]]`: each binding on its own and against the others.
fn inputs(
    cx: &Keys,
    inputs: &[RawInput],
    base: Option<&Path>,
) -> Result<Vec<InputConfig>, ConfigError> {
    let mut out = Vec::with_capacity(inputs.len());
    if inputs.is_empty() {
        return Err(cx.invalid("inputs", "at least one [[inputs]] binding is needed"));
    }
    for (i, b) in inputs.iter().enumerate() {
        let k = |f: &str| format!("inputs[{i}].{f}");
        if b.key.is_empty() || b.key.len() > MAX_PATH {
            return Err(cx.invalid(k("key"), format!("must be 1 to {MAX_PATH} bytes long")));
        }
        if b.key.starts_with('/') || b.key.ends_with('/') || b.key.contains("//") {
            return Err(cx.invalid(k("key"), format!("\"{}\" has an empty path segment", b.key)));
        }
        if RESERVED_KEYS.contains(&b.key.as_str()) {
            return Err(cx.invalid(
                k("key"),
                format!(
                    "\"{}\" is reserved by the protocol and cannot be bound",
                    b.key
                ),
            ));
        }
        if let Some(j) = inputs[..i].iter().position(|o| o.key == b.key) {
            return Err(cx.invalid(
                k("key"),
                format!("\"{}\" is already bound by inputs[{j}]", b.key),
            ));
        }
        let engine_inputs = |o: &RawInput| {
            let mask = o.tokenizer.as_ref().map(|t| t.mask_tensor.clone());
            o.tensor.clone().into_iter().chain(mask)
        };
        if let (Some(t), Some(m)) = (&b.tensor, &b.tokenizer)
            && m.mask_tensor == *t
        {
            return Err(cx.invalid(
                k("tokenizer.mask_tensor"),
                format!("\"{t}\" is the ids' tensor too; the mask needs its own input"),
            ));
        }
        for t in engine_inputs(b) {
            if let Some(j) = inputs[..i]
                .iter()
                .position(|o| engine_inputs(o).any(|n| n == t))
            {
                return Err(cx.invalid(
                    k("tensor"),
                    format!("engine input \"{t}\" is already bound by inputs[{j}]"),
                ));
            }
        }
        let tokens = match &b.tokenizer {
            None => None,
            Some(t) => {
                if !is_text(b) || b.dtypes.len() != 1 {
                    return Err(cx.invalid(
                        k("dtypes"),
                        "a tokenized prompt is text on the wire: dtypes = [\"text\"]",
                    ));
                }
                if b.shape.is_some() {
                    return Err(cx.invalid(
                        k("shape"),
                        "a tokenized prompt's length is tokenizer.max_tokens; leave shape out",
                    ));
                }
                Some(tokenizer(cx, i, t, base)?)
            }
        };
        if b.tensor.is_none() {
            let is_state = inputs.iter().any(|o| {
                o.tokenizer
                    .as_ref()
                    .is_some_and(|t| t.state_key.as_deref() == Some(b.key.as_str()))
            });
            if !is_state || tokens.is_some() || is_text(b) {
                return Err(cx.invalid(
                    k("tensor"),
                    "name the engine input this key feeds (only a pi05 tokenizer's state_key may \
                     have none)",
                ));
            }
        }
        let shape = match (&b.shape, &tokens) {
            (Some(s), _) => s.clone(),
            (None, Some(t)) => vec![t.max_tokens],
            (None, None) => {
                return Err(cx.invalid(k("shape"), "missing: give the expected wire shape"));
            }
        };
        if b.dtypes.is_empty() {
            return Err(cx.invalid(
                k("dtypes"),
                "list at least one accepted wire dtype, e.g. [\"float32\", \"float64\"]",
            ));
        }
        if is_text(b) {
            if b.dtypes.len() != 1 {
                return Err(cx.invalid(k("dtypes"), "\"text\" cannot be mixed with numeric dtypes"));
            }
            if shape.len() != 1 {
                return Err(cx.invalid(
                    k("shape"),
                    "a text binding's shape is [max_bytes]: the UTF-8 bytes, one per element",
                ));
            }
            if matches!(b.layout.as_deref(), Some("hwc_to_chw" | "chw_to_hwc"))
                || !b.mean.is_empty()
                || !b.min.is_empty()
                || b.scale != 1.0
                || b.offset != 0.0
                || b.allow_non_finite
            {
                return Err(cx.invalid(
                    k("dtypes"),
                    "a text binding takes no layout, scale, offset, mean, std or allow_non_finite",
                ));
            }
        }
        let mut dtypes = Vec::new();
        for d in b.dtypes.iter().filter(|_| !is_text(b)) {
            if let Some(t) = ElemType::from_name(d) {
                dtypes.push(t);
            } else {
                return Err(cx.invalid(
                    k("dtypes"),
                    format!(
                        "unknown dtype \"{d}\"; use a numpy name such as uint8, float32, float64, or \"text\""
                    ),
                ));
            }
        }
        if shape.len() > crate::limits::MAX_RANK {
            return Err(cx.invalid(
                k("shape"),
                format!("rank {} exceeds {}", shape.len(), crate::limits::MAX_RANK),
            ));
        }
        if shape.contains(&0) {
            return Err(cx.invalid(k("shape"), "dimensions must be positive"));
        }
        let count = elements(cx, &k("shape"), &shape)?;
        if let Some(es) = &b.engine_shape {
            if es.is_empty() || es.len() > crate::limits::MAX_RANK || es.contains(&0) {
                return Err(cx.invalid(
                    k("engine_shape"),
                    format!(
                        "needs 1 to {} positive dimensions, got {es:?}",
                        crate::limits::MAX_RANK
                    ),
                ));
            }
            elements(cx, &k("engine_shape"), es)?;
        }
        let layout_ok = matches!(
            b.layout.as_deref(),
            None | Some("none" | "hwc_to_chw" | "chw_to_hwc")
        );
        if !layout_ok {
            return Err(cx.invalid(
                k("layout"),
                format!(
                    "must be \"hwc_to_chw\", \"chw_to_hwc\" or \"none\", got \"{}\"",
                    b.layout.as_deref().unwrap_or_default()
                ),
            ));
        }
        let layout = match b.layout.as_deref() {
            Some("hwc_to_chw") => Layout::HwcToChw,
            Some("chw_to_hwc") => Layout::ChwToHwc,
            _ => Layout::None,
        };
        if layout.perm().is_some() && shape.len() < 3 {
            return Err(cx.invalid(k("layout"), "needs a shape of rank 3 or more"));
        }
        if !b.scale.is_finite() || !b.offset.is_finite() || !b.fill.is_finite() {
            return Err(cx.invalid(k("scale"), "scale, offset and fill must be finite numbers"));
        }
        let norm = RawNorm {
            mean: &b.mean,
            std: &b.std,
            min: &b.min,
            max: &b.max,
            eps: b.eps,
        };
        let (mean, std, eps) =
            norm.resolve(cx, i, "inputs", &[1, *shape.last().unwrap_or(&1), count])?;
        let history = b.history.unwrap_or(1);
        if !(1..=crate::limits::MAX_HISTORY).contains(&history) {
            return Err(cx.invalid(
                k("history"),
                format!(
                    "must be 1 to {} frames, got {history}",
                    crate::limits::MAX_HISTORY
                ),
            ));
        }
        if history > 1 && (is_text(b) || tokens.is_some()) {
            return Err(cx.invalid(k("history"), "applies to numeric inputs, not text"));
        }
        out.push(InputConfig {
            key: b.key.clone(),
            tensor: b.tensor.clone(),
            kind: match tokens {
                Some(t) => InputKind::Tokens(Box::new(t)),
                None if is_text(b) => InputKind::Text,
                None => InputKind::Numeric(dtypes),
            },
            shape,
            layout,
            scale: b.scale,
            offset: b.offset,
            mean,
            std,
            eps,
            history,
            optional: b.optional,
            fill: b.fill,
            engine_shape: b.engine_shape.clone(),
            allow_non_finite: b.allow_non_finite,
        });
    }
    let mut tokenized = out
        .iter()
        .enumerate()
        .filter(|(_, b)| b.tokenizer().is_some());
    if let (Some(_), Some((j, _))) = (tokenized.next(), tokenized.next()) {
        return Err(cx.invalid(
            format!("inputs[{j}].tokenizer"),
            "one tokenized prompt per policy: bind the other strings as text",
        ));
    }
    for (i, b) in out.iter().enumerate() {
        let Some(key) = b.tokenizer().and_then(|t| t.state_key.as_ref()) else {
            continue;
        };
        let k = format!("inputs[{i}].tokenizer.state_key");
        let Some(state) = out.iter().find(|s| &s.key == key) else {
            return Err(cx.invalid(k, format!("names no [[inputs]] key (got \"{key}\")")));
        };
        let n = element_count(&state.shape).unwrap_or(usize::MAX);
        if state.is_text() || n > crate::limits::MAX_PROMPT_STATE {
            return Err(cx.invalid(
                k,
                format!(
                    "must name a numeric input of at most {} values; '{key}' has {n}",
                    crate::limits::MAX_PROMPT_STATE
                ),
            ));
        }
    }
    Ok(out)
}

/// `[[outputs]]`: each on its own (lengths against the action dimension are checked once the
/// engine is known).
fn outputs(cx: &Keys, outputs: &[RawOutput]) -> Result<Vec<OutputConfig>, ConfigError> {
    let mut out = Vec::with_capacity(outputs.len());
    if outputs.is_empty() {
        return Err(cx.invalid("outputs", "at least one [[outputs]] binding is needed"));
    }
    for (i, o) in outputs.iter().enumerate() {
        let k = |f: &str| format!("outputs[{i}].{f}");
        if o.key.is_empty() {
            return Err(cx.invalid(k("key"), "must not be empty"));
        }
        if let Some(j) = outputs[..i].iter().position(|p| p.key == o.key) {
            return Err(cx.invalid(
                k("key"),
                format!("\"{}\" is already used by outputs[{j}]", o.key),
            ));
        }
        let dtype = ElemType::from_name(&o.dtype);
        let Some(dtype @ (ElemType::F32 | ElemType::F64)) = dtype else {
            return Err(cx.invalid(
                k("dtype"),
                format!("must be \"float32\" or \"float64\", got \"{}\"", o.dtype),
            ));
        };
        if o.columns == Some(0) {
            return Err(cx.invalid(k("columns"), "must be positive"));
        }
        // Lengths against the action dimension are checked once the engine is known.
        let norm = RawNorm {
            mean: &o.mean,
            std: &o.std,
            min: &o.min,
            max: &o.max,
            eps: o.eps,
        };
        let (mean, std, eps) = norm.resolve(cx, i, "outputs", &[])?;
        let rows = match o.rows {
            None => None,
            Some([start, end]) if start < end => Some((start, end)),
            Some([start, end]) => {
                return Err(cx.invalid(
                    k("rows"),
                    format!("[{start}, {end}] keeps no row; give [start, end] with start < end"),
                ));
            }
        };
        // Every reply is float32 on the vllm-omni route (and with dtype = "float32"): a
        // coefficient past its range would put infinity on the wire for any output.
        // (`std` enters as `std + eps`.)
        let f32_max = f64::from(f32::MAX);
        let key_of = |k: &'static str| {
            if o.min.is_empty() {
                k
            } else if k == "mean" {
                "min"
            } else {
                "max"
            }
        };
        for (key, values, pad) in [("mean", &mean, 0.0), ("std", &std, eps)] {
            let key = key_of(key);
            if let Some(v) = values.iter().find(|v| (*v + pad).abs() > f32_max) {
                return Err(cx.invalid(
                    k(key),
                    format!(
                        "{v} cannot be represented in float32, the dtype replies are sent in on \
                         the vllm-omni route; un-normalised actions must stay within \
                         ±{f32_max:e}"
                    ),
                ));
            }
        }
        let relative = match (&o.relative_to, &o.relative_mask) {
            (None, None) => None,
            (None, Some(_)) => {
                return Err(cx.invalid(
                    k("relative_mask"),
                    "needs relative_to: the input whose values the masked columns are relative to",
                ));
            }
            (Some(key), _) if key.is_empty() => {
                return Err(cx.invalid(k("relative_to"), "must name an input binding's key"));
            }
            (Some(key), mask) => {
                if mask.as_ref().is_some_and(|m| m.is_empty()) {
                    return Err(cx.invalid(
                        k("relative_mask"),
                        "must not be empty (leave it out to offset every column)",
                    ));
                }
                Some(crate::config::RelativeConfig {
                    key: key.clone(),
                    mask: mask.clone(),
                })
            }
        };
        out.push(OutputConfig {
            tensor: o.tensor.clone(),
            key: o.key.clone(),
            dtype,
            columns: o.columns,
            mean,
            std,
            eps,
            rows,
            relative,
        });
    }
    Ok(out)
}

/// `[pacing]`, with the similarity filter's input among `inputs`.
fn pacing(cx: &Keys, p: &PacingConfig, inputs: &[InputConfig]) -> Result<(), ConfigError> {
    if !p.fps.is_finite() || p.fps <= 0.0 || p.fps > 10_000.0 {
        return Err(cx.invalid(
            "pacing.fps",
            format!("must be a control rate in (0, 10000] Hz, got {}", p.fps),
        ));
    }
    if !p.latency_budget_ms.is_finite()
        || p.latency_budget_ms < 0.0
        || p.latency_budget_ms > 60_000.0
    {
        return Err(cx.invalid(
            "pacing.latency_budget_ms",
            format!(
                "must be between 0 (off) and 60000 ms, got {}",
                p.latency_budget_ms
            ),
        ));
    }
    cx.between(
        "pacing.latency_window",
        p.latency_window,
        1,
        MAX_LATENCY_WINDOW,
    )?;
    if p.spin_us > 20_000 {
        return Err(cx.invalid(
            "pacing.spin_us",
            format!("must be at most 20000 µs, got {}", p.spin_us),
        ));
    }
    if !p.similarity_atol.is_finite() || p.similarity_atol < 0.0 {
        return Err(cx.invalid(
            "pacing.similarity_atol",
            format!(
                "must be 0 (off) or a positive distance, got {}",
                p.similarity_atol
            ),
        ));
    }
    if p.similarity_atol > 0.0 {
        let Some(b) = inputs.iter().find(|b| b.key == p.similarity_key) else {
            return Err(cx.invalid(
                "pacing.similarity_key",
                format!(
                    "names no [[inputs]] key (got \"{}\"); the similarity filter needs the state's key, e.g. \"observation/state\"",
                    p.similarity_key
                ),
            ));
        };
        let n = element_count(&b.shape).unwrap_or(usize::MAX);
        if b.is_text() || n > MAX_SIMILARITY_STATE {
            return Err(cx.invalid(
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

/// `[planner]`'s own values; its bindings are checked against the plan.
pub(super) fn planner(p: &RawPlanner, base: Option<&Path>) -> Result<PlannerConfig, ConfigError> {
    let cx = Keys::top();
    let precedence = match p.precedence.as_str() {
        "client" => Precedence::Client,
        "planner" => Precedence::Planner,
        other => {
            return Err(cx.invalid(
                "planner.precedence",
                format!("must be \"client\" or \"planner\", got \"{other}\""),
            ));
        }
    };
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
    Ok(resolved)
}

/// A binding's normalisation keys as written: openpi's mean/std or LeRobot's min/max, and eps.
struct RawNorm<'a> {
    mean: &'a [f64],
    std: &'a [f64],
    min: &'a [f64],
    max: &'a [f64],
    eps: Option<f64>,
}

impl RawNorm<'_> {
    /// Checks the keys of `{side}[{i}]` and resolves them into `(mean, std, eps)` for
    /// `(x − mean)/(std + eps)` (inputs) and `x·(std + eps) + mean` (outputs). LeRobot's
    /// MIN_MAX, `2(x − min)/d − 1` and `(x + 1)/2·d + min` with `d = max − min` (`eps` where
    /// that is 0), is the same map with `mean = min + d/2`, `std = d/2` and no epsilon.
    fn resolve(
        &self,
        cx: &Keys,
        i: usize,
        side: &str,
        allowed: &[usize],
    ) -> Result<(Vec<f64>, Vec<f64>, f64), ConfigError> {
        let k = |f: &str| format!("{side}[{i}].{f}");
        if let Some(e) = self.eps
            && (!e.is_finite() || e < 0.0)
        {
            return Err(cx.invalid(
                k("eps"),
                format!("must be finite and non-negative, got {e}"),
            ));
        }
        if self.min.is_empty() && self.max.is_empty() {
            check_norm(cx, &k("mean"), &k("std"), self.mean, self.std, allowed)?;
            let eps = self.eps.unwrap_or(1e-6);
            if side == "inputs" && self.std.iter().any(|s| s + eps <= 0.0) {
                return Err(cx.invalid(
                    k("std"),
                    "std + eps must be positive (it divides); give a positive eps or std",
                ));
            }
            return Ok((self.mean.to_vec(), self.std.to_vec(), eps));
        }
        if !self.mean.is_empty() || !self.std.is_empty() {
            return Err(cx.invalid(
                k("min"),
                "min/max (LeRobot's MIN_MAX) and mean/std are two normalisations; give one pair",
            ));
        }
        // min takes mean's checks of length and finiteness (its sign is free).
        check_norm(
            cx,
            &k("min"),
            &k("max"),
            self.min,
            &vec![0.0; self.max.len()],
            allowed,
        )?;
        if self.max.iter().any(|v| !v.is_finite()) {
            return Err(cx.invalid(k("max"), "values must be finite"));
        }
        if let Some(j) = self.min.iter().zip(self.max).position(|(lo, hi)| hi < lo) {
            return Err(cx.invalid(
                k("max"),
                format!(
                    "max[{j}] = {} is below min[{j}] = {}",
                    self.max[j], self.min[j]
                ),
            ));
        }
        let eps = self.eps.unwrap_or(1e-8);
        let half: Vec<f64> = self
            .min
            .iter()
            .zip(self.max)
            .map(|(lo, hi)| if hi == lo { eps / 2.0 } else { (hi - lo) / 2.0 })
            .collect();
        if side == "inputs" && half.iter().any(|h| *h <= 0.0) {
            return Err(cx.invalid(k("eps"), "must be positive where max == min (it divides)"));
        }
        let mid = self.min.iter().zip(&half).map(|(lo, h)| lo + h).collect();
        Ok((mid, half, 0.0))
    }
}

/// mean/std must come together, with equal lengths from `allowed` (empty: any length),
/// finite, std non-negative.
fn check_norm(
    cx: &Keys,
    mk: &str,
    sk: &str,
    mean: &[f64],
    std: &[f64],
    allowed: &[usize],
) -> Result<(), ConfigError> {
    if mean.len() != std.len() {
        return Err(cx.invalid(
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
        return Err(cx.invalid(
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
        return Err(cx.invalid(mk, "values must be finite"));
    }
    if std.iter().any(|v| !v.is_finite() || *v < 0.0) {
        return Err(cx.invalid(sk, "values must be finite and non-negative"));
    }
    Ok(())
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
