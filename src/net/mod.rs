//! How do clients reach a policy? The server: its shared state, tasks, accept loop and drain
//! ([`server`]); its HTTP layer (one pure answer per request head: health, metrics, keys,
//! upgrade, routing by path: [`http`]), API keys ([`auth`]), TLS
//! ([`tls`]), the frame-size guard under tungstenite ([`frame_guard`]), each peer address's
//! share of the connection caps ([`peers`]), one WebSocket connection's loop ([`connection`]),
//! the request core both front ends drive ([`requests`]), and LeRobot's gRPC service
//! ([`lerobot`]: its RPCs, its session and who owns it, each in its own file) over its
//! connections ([`grpc_conn`]).

pub mod auth;
pub mod connection;
pub mod frame_guard;
pub mod grpc_conn;
pub mod http;
pub mod lerobot;
pub mod peers;
pub mod requests;
pub mod scrape;
pub mod server;
pub mod shared;
pub mod tls;

use crate::config::{Config, ConfigError};

/// The secrets the server opens at start-up: the API keys (from the config and
/// `auth.key_file`), the TLS acceptor (from the PEM files) and, with `[planner]` on, the
/// planner's API key (`planner.api_key_file`). A wrong path or a bad key fails here, naming
/// the key, before anything is served; each file is read once.
#[derive(Clone, Debug)]
pub struct Access {
    pub keys: auth::ApiKeys,
    /// Whether `/metrics` needs a key too (when keys are configured).
    pub protect_metrics: bool,
    pub tls: Option<tls::Tls>,
    /// `Authorization: Bearer …` for the planner's endpoints.
    pub planner_key: Option<crate::config::Secret>,
}

impl Access {
    pub fn load(cfg: &Config) -> Result<Access, ConfigError> {
        let a = &cfg.auth;
        Ok(Access {
            keys: auth::ApiKeys::load(&a.api_keys, a.key_file.as_deref())?,
            protect_metrics: a.protect_metrics,
            tls: cfg.tls.as_ref().map(tls::Tls::open).transpose()?,
            planner_key: if cfg.planner.enabled {
                crate::planner::api_key(&cfg.planner)?
            } else {
                None
            },
        })
    }
}
