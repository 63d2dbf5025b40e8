//! policyd: a robot-policy inference appliance speaking the OpenPI WebSocket protocol.
//!
//! Layers, lowest first; a module uses only modules of its own or a lower layer, never one to
//! its right (`scripts/check-layers` checks it in CI):
//!
//! ```text
//! limits, dtype      caps and element types
//! transform, protocol  element conversion; the wire format and its two dialects
//! config, engine, planner  the resolved config; backends; the task planner
//! bind               bindings compiled against an engine: frame → inputs, outputs → reply
//! runtime            slots and the engine worker, scheduler, pacing, sessions
//! metrics            request-path counters
//! policy             the served policies: build (open, compile, warm), reload
//! service, net       systemd; HTTP, auth, TLS, the connection loop
//! app                listen → build (503 meanwhile) → notify → serve → drain
//! ```
//!
//! One observation flows one way: [`net::connection`] → [`protocol::request`] (decode) →
//! [`bind`] (into a slot's engine inputs) → [`runtime`] → [`engine`] → [`bind`] (cut and
//! convert outputs) → [`protocol::dialect`] (frame the reply) → [`net::connection`].

pub mod app;
pub mod bind;
pub mod config;
pub mod demo;
pub mod dtype;
pub mod engine;
pub mod limits;
pub mod metrics;
pub mod net;
pub mod planner;
pub mod policy;
pub mod protocol;
pub mod runtime;
pub mod service;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod transform;
