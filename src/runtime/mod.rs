//! How does a decoded request get run and released on time? The engine worker and its slot
//! pool ([`worker`]), the queue with latest-wins and the observation filters ([`scheduler`]),
//! the release clock ([`pacing`]) and each connection's sessions ([`session`]).

pub mod pacing;
pub mod scheduler;
pub mod session;
pub mod worker;
