//! The server through its public interfaces, in one test binary (one link instead of ten): the
//! WebSocket front end (connections, hostile input, policies and reloads, prompts, the
//! planner, pipelines), LeRobot's gRPC service, the command line and socket activation.
//! Timing- and memory-sensitive suites (pacing, reliability, RSS, allocations, systemd
//! notify, signals) keep binaries of their own, so that no other test shares their process.

#[path = "../common/mod.rs"]
mod common;

mod cli;
mod engine_threads;
mod hostile;
mod lerobot_grpc;
mod pipelines;
mod planner;
mod policies;
mod prompts;
mod server;
mod socket_activation;
