//! policyd: a robot-policy inference appliance speaking the OpenPI WebSocket protocol.
//!
//! Data flows one way: a frame is decoded ([`wire`]) straight into an engine input buffer of a
//! slot ([`worker`]) through the bindings compiled in [`plan`] from the [`config`]; the engine
//! worker runs the model ([`engine`]); the reply is encoded into a reused buffer and sent
//! ([`connection`]). [`server`] owns the listener, the handshake and shutdown.

pub mod appliance;
pub mod auth;
pub mod bench;
pub mod config;
pub mod connection;
pub mod demo;
pub mod dtype;
pub mod engine;
pub mod frame_guard;
#[doc(hidden)]
pub mod fuzzing;
pub mod metrics;
pub mod pacing;
pub mod plan;
pub mod planner;
pub mod policy;
pub mod scheduler;
pub mod server;
pub mod session;
pub mod tls;
pub mod transform;
pub mod wire;
pub mod worker;
