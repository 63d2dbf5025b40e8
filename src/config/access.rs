//! `[auth]` and `[tls]`: the API keys a client must present and the certificate it is served with.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::{ConfigError, invalid, path};

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

/// `[tls]`: serve `wss://` (and `https://` health) with this certificate and key (PEM),
/// relative to the config file. Both or neither.
#[derive(Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawTls {
    pub(super) cert: Option<PathBuf>,
    pub(super) key: Option<PathBuf>,
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

/// `[tls]`: serve `wss://` (and `https://` health) with this certificate and key (PEM).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsConfig {
    pub cert: PathBuf,
    pub key: PathBuf,
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

pub(super) fn auth(a: &RawAuth, base: Option<&Path>) -> AuthConfig {
    AuthConfig {
        api_keys: a.api_keys.clone(),
        key_file: a.key_file.as_deref().map(|f| path(base, f)),
        protect_metrics: a.protect_metrics,
    }
}

pub(super) fn tls(t: &RawTls, base: Option<&Path>) -> Result<Option<TlsConfig>, ConfigError> {
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
