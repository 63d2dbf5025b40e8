//! What a request head gets: [`answer`] decides, from the head and the server's state now,
//! without touching the socket; [`Answer`] says how each refusal is logged and answered.

use std::net::SocketAddr;
use std::sync::Arc;

use super::head::{Head, upgrade_request};
use crate::net::auth::Verdict;
use crate::net::shared::Shared;
use crate::policy::{Policy, PolicySet};
use crate::protocol::Dialect;

/// A request head that gets the WebSocket upgrade: its key, dialect and policy.
pub(super) struct Upgrade {
    pub(super) key: String,
    pub(super) dialect: Dialect,
    pub(super) policy: Arc<Policy>,
}

/// What a request head gets when it is not upgraded: one HTTP response.
pub(super) enum Answer {
    /// `/healthz` (text) or `/health` (JSON).
    Health {
        json: bool,
        healthy: bool,
    },
    Metrics,
    /// A missing or wrong API key.
    Unauthorized(Verdict),
    /// A request that is not a WebSocket upgrade: 426 to a GET, 405 otherwise.
    NotWebSocket {
        get: bool,
    },
    /// An upgrade request without what a handshake needs.
    BadUpgrade(String),
    WrongVersion,
    /// Shutting down, or the engine is unhealthy.
    Unavailable,
    NoSuchPolicy {
        name: String,
        serves: String,
    },
}

/// What an answer depends on beyond the head.
pub(super) struct Now<'a> {
    pub(super) healthy: bool,
    pub(super) shutting_down: bool,
    pub(super) access: &'a crate::net::Access,
    pub(super) set: &'a PolicySet,
}

/// The answer to `head`: health and metrics before any key check but the metrics' own,
/// then the key, then the handshake, then the route. `/policies/<name>` (openpi) or
/// `/policies/<name>/v1/realtime/robot/openpi` (vllm-omni) chooses a policy; other paths get
/// the default one.
pub(super) fn answer(head: &Head, now: &Now<'_>) -> Result<Upgrade, Answer> {
    let plain_get = head.method == "GET" && !head.upgrade;
    if plain_get && (head.path == "/healthz" || head.path == "/health") {
        return Err(Answer::Health {
            json: head.path == "/health",
            healthy: now.healthy,
        });
    }
    let is_metrics = plain_get && head.path == "/metrics";
    let keys = &now.access.keys;
    if keys.enabled() && (head.upgrade || (is_metrics && now.access.protect_metrics)) {
        let verdict = keys.check_all(&head.authorizations);
        if verdict != Verdict::Accepted {
            return Err(Answer::Unauthorized(verdict));
        }
    }
    if is_metrics {
        return Err(Answer::Metrics);
    }
    if !head.upgrade {
        return Err(Answer::NotWebSocket {
            get: head.method == "GET",
        });
    }
    let key = match upgrade_request(head) {
        Ok(key) => key.to_string(),
        Err(why) => return Err(Answer::BadUpgrade(why)),
    };
    if head.version.as_deref() != Some("13") {
        return Err(Answer::WrongVersion);
    }
    if now.shutting_down || !now.healthy {
        return Err(Answer::Unavailable);
    }
    let (named, rest) = match head.path.strip_prefix("/policies/") {
        Some(r) => {
            let end = r.find('/').unwrap_or(r.len());
            (Some(&r[..end]), &r[end..])
        }
        None => (None, head.path.as_str()),
    };
    let policy = match named {
        None => now.set.default_policy(),
        Some(name) => match now.set.get(name) {
            Some(p) => p,
            None => {
                return Err(Answer::NoSuchPolicy {
                    name: name.to_string(),
                    serves: now.set.names(),
                });
            }
        },
    };
    Ok(Upgrade {
        key,
        dialect: Dialect::for_path(rest),
        policy: policy.clone(),
    })
}

impl Answer {
    /// Logs and counts a refusal (peer-provoked: rate-limited, the client's text clipped).
    pub(super) fn note(&self, peer: SocketAddr, head: &Head, shared: &Shared) {
        match self {
            Answer::Unauthorized(verdict) => {
                shared.stats().metrics.auth_failures.inc();
                crate::warn_limited!(
                    "{peer}: refused {}: {}",
                    crate::protocol::clip(&head.path),
                    verdict.describe()
                );
            }
            Answer::BadUpgrade(why) => crate::log_limited!(
                log::Level::Info,
                "{peer}: refused the WebSocket handshake: {}",
                crate::protocol::clip(why)
            ),
            Answer::NoSuchPolicy { name, .. } => crate::log_limited!(
                log::Level::Info,
                "{peer}: refused: no policy named \"{}\"",
                crate::protocol::clip(name)
            ),
            _ => {}
        }
    }

    /// The HTTP response: status, content type, body and
    /// extra headers.
    pub(super) fn response(
        &self,
        shared: &Shared,
    ) -> (&'static str, &'static str, String, &'static str) {
        const TEXT: &str = "text/plain; charset=utf-8";
        const JSON: &str = "application/json";
        const OK: &str = "200 OK";
        const UNAVAILABLE: &str = "503 Service Unavailable";
        let text = |s: &str| s.to_string();
        match self {
            Answer::Health {
                json: false,
                healthy: true,
            } => (OK, TEXT, text("OK\n"), ""),
            Answer::Health {
                json: false,
                healthy: false,
            } => (UNAVAILABLE, TEXT, text("engine unavailable\n"), ""),
            Answer::Health {
                json: true,
                healthy: true,
            } => (OK, JSON, text("{\"status\":\"healthy\"}"), ""),
            Answer::Health {
                json: true,
                healthy: false,
            } => (UNAVAILABLE, JSON, text("{\"status\":\"unhealthy\"}"), ""),
            Answer::Metrics => (
                OK,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                crate::net::scrape::render(&shared.registry),
                "",
            ),
            Answer::Unauthorized(verdict) => (
                "401 Unauthorized",
                TEXT,
                format!(
                    "policyd: {}; pass the key with WebsocketClientPolicy(api_key=...)\n",
                    verdict.describe()
                ),
                "WWW-Authenticate: Api-Key\r\n",
            ),
            Answer::NotWebSocket { get: true } => (
                "426 Upgrade Required",
                TEXT,
                text(
                    "Failed to open a WebSocket connection: this is a policyd WebSocket endpoint.\n",
                ),
                "Upgrade: websocket\r\n",
            ),
            Answer::NotWebSocket { get: false } => (
                "405 Method Not Allowed",
                TEXT,
                text("only GET\n"),
                "Allow: GET\r\n",
            ),
            Answer::BadUpgrade(why) => ("400 Bad Request", TEXT, format!("{why}\n"), ""),
            Answer::WrongVersion => (
                "426 Upgrade Required",
                TEXT,
                text("unsupported WebSocket version; use 13\n"),
                "Sec-WebSocket-Version: 13\r\n",
            ),
            Answer::Unavailable => (UNAVAILABLE, TEXT, text("server unavailable\n"), ""),
            Answer::NoSuchPolicy { name, serves } => (
                "404 Not Found",
                TEXT,
                format!("policyd serves no policy named \"{name}\"; it serves: {serves}\n"),
                "",
            ),
        }
    }
}
