//! What does `policyd` with no arguments serve? The embedded default: the ALOHA demo policy and its
//! config, built into the binary, so that `policyd` with no arguments serves something real on the
//! CPU engine; or, in a firmware image, the integrator's config and every model it names, baked in
//! at build time (`POLICYD_EMBED_CONFIG`, read by build.rs).

use crate::config::{Config, ConfigError, ModelSource, invalid};

/// A config baked into the binary at build time, with its models.
#[derive(Clone, Copy, Debug)]
pub struct Baked {
    /// `POLICYD_EMBED_CONFIG` as given to the build.
    pub source: &'static str,
    pub config: &'static str,
    pub models: &'static [BakedModel],
}

/// One `engine.model` of a baked config: the path as the config writes it, and its bytes.
#[derive(Clone, Copy, Debug)]
pub struct BakedModel {
    pub path: &'static str,
    pub name: &'static str,
    pub bytes: &'static [u8],
}

include!(concat!(env!("OUT_DIR"), "/baked.rs"));

/// The embedded config (the same text as `configs/aloha.toml`).
pub const CONFIG: &str = include_str!("../configs/aloha.toml");
/// The embedded model (`models/aloha.onnx`).
pub const MODEL: &[u8] = include_bytes!("../models/aloha.onnx");

/// The config text `policyd` serves with no arguments (`print-default-config`).
pub fn config_text() -> &'static str {
    BAKED.map_or(CONFIG, |b| b.config)
}

/// What `policyd` serves with no arguments: the baked config if this binary has one, else the
/// demo; with every model built in.
pub fn config() -> Result<Config, ConfigError> {
    match BAKED {
        Some(b) => baked(&b),
        None => demo(),
    }
}

fn baked(b: &Baked) -> Result<Config, ConfigError> {
    let mut cfg = Config::parse(b.config, &format!("<built-in {}>", b.source), None)?;
    for p in &mut cfg.policies {
        let ModelSource::File(path) = &p.model else {
            continue;
        };
        let Some(m) = b.models.iter().find(|m| path.as_os_str() == m.path) else {
            return Err(invalid(
                "engine.model",
                format!("{} was not built into this binary", path.display()),
            ));
        };
        p.model = ModelSource::Embedded {
            name: m.name,
            bytes: m.bytes,
        };
    }
    Ok(cfg)
}

fn demo() -> Result<Config, ConfigError> {
    let mut cfg = Config::parse(CONFIG, "<embedded configs/aloha.toml>", None)?;
    for p in &mut cfg.policies {
        p.model = ModelSource::Embedded {
            name: "aloha.onnx",
            bytes: MODEL,
        };
    }
    Ok(cfg)
}
