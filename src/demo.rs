//! What does `policyd` with no arguments serve? The embedded default: the ALOHA demo policy and its
//! config, built into the binary, so that `policyd` with no arguments serves something real on the
//! CPU engine.

use crate::config::{Config, ConfigError, ModelSource};

/// The embedded config (the same text as `configs/aloha.toml`).
pub const CONFIG: &str = include_str!("../configs/aloha.toml");
/// The embedded model (`models/aloha.onnx`).
pub const MODEL: &[u8] = include_bytes!("../models/aloha.onnx");

/// The embedded default config, with its model built in.
pub fn config() -> Result<Config, ConfigError> {
    let mut cfg = Config::parse(CONFIG, "<embedded configs/aloha.toml>", None)?;
    for p in &mut cfg.policies {
        p.model = ModelSource::Embedded {
            name: "aloha.onnx",
            bytes: MODEL,
        };
    }
    Ok(cfg)
}
