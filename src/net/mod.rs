//! How do clients reach a policy? The listener's HTTP layer (health, metrics, upgrade, routing
//! by path: [`http`]), API keys ([`auth`]), TLS ([`tls`]), the frame-size guard under
//! tungstenite ([`frame_guard`]) and one WebSocket connection's loop ([`connection`]).

pub mod auth;
pub mod connection;
pub mod frame_guard;
pub mod http;
pub mod listener;
pub mod scrape;
pub mod tls;
