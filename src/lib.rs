//! policyd: a robot-policy inference appliance speaking the OpenPI WebSocket protocol.
//!
//! Layers, lowest first; a module uses only modules of its own or a lower layer, never one
//! above it, no two modules use each other, and inside a module no files use each other in a
//! circle (`scripts/check-layers` checks all three in CI):
//!
//! ```text
//! limits, dtype, service,  caps and element types; systemd (notify, watchdog, sockets);
//!   log_limit              log lines a peer can provoke, at most one a second each
//! transform, protocol,     element conversion; the wire format and its two dialects;
//!   tokenizer, sampler,    prompts to token ids (openpi's formats); flow/DDPM/DDIM steps;
//!   rtc                    real-time chunking: a session's previous chunk, its leftover, the
//!                          per-step guidance (LeRobot's) or inpainting (GR00T's)
//! config                   the file's raw form, its checks, the resolved Config
//! engine, planner, demo    backends; the task planner; the embedded default
//! bind                     bindings compiled against an engine: frame → inputs, outputs → reply
//! runtime                  slots and the engine worker, scheduler, pacing, sessions
//! metrics                  request-path counters
//! policy                   the served policies: build (open, compile, warm), budget, reload
//! net                      the server; HTTP, auth, TLS, the frame guard; the request core;
//!                          both front ends (WebSocket, LeRobot's gRPC service)
//! app                      listen → build (503 meanwhile) → notify → serve → drain
//! testing                  (feature `testing`) the synthetic engine, fuzz entry points
//! ```
//!
//! One observation flows one way. A front end reads it: [`net::connection`] (a WebSocket
//! frame, routed to its policy by [`net::http`]'s path and its `policy` field) or
//! [`net::lerobot`] (a gRPC observation, in the client's [`protocol::lerobot::ClientFormat`]).
//! The request core, [`net::requests`], decodes it into a slot's engine inputs
//! ([`protocol::request`]'s reader with [`bind`]'s visitor, or [`bind::lerobot`]'s adapter),
//! keeps the client's sessions and hands the slot to [`runtime`] (scheduler, worker) →
//! [`engine`] → [`bind`] (cut and convert the outputs); [`runtime::pacing`] releases it on
//! time and the front end frames the reply ([`protocol::encode`] and [`protocol::dialect`], or
//! the client's format).

pub mod app;
pub mod bind;
pub mod config;
pub mod demo;
pub mod dtype;
pub mod engine;
pub mod limits;
pub mod log_limit;
pub mod metrics;
pub mod net;
pub mod planner;
pub mod policy;
pub mod protocol;
pub mod rtc;
pub mod runtime;
pub mod sampler;
pub mod service;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod tokenizer;
pub mod transform;
