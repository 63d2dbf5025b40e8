//! What do the bytes on the socket mean? The OpenPI wire format in both dialects: msgpack with
//! numpy array markers, decoded in one pass into the bindings' buffers ([`request`]), replies
//! encoded byte for byte as openpi's `msgpack_numpy.packb` writes them ([`encode`]), and the
//! per-dialect framing of replies, errors and resets ([`dialect`]).
//!
//! This layer knows no config, engine or runtime: it takes the caps it needs ([`Limits`]) and a
//! [`Visitor`] for the values a binding names.

pub mod dialect;
pub mod encode;
pub mod lerobot;
pub mod lerobot_json;
mod msgpack;
pub mod pickle;
pub mod request;

pub use dialect::{Dialect, ErrorKind, Failure, VLLM_PATH};
pub use encode::{Encoder, TIMING_SIZE, Timing, encode_timing, encode_toml};
pub use request::{
    ArrayView, Endpoint, Limits, PolicyName, RESERVED_KEYS, RequestMeta, SessionId, Shape, Value,
    Visitor, WireError, decode_request, peek_policy,
};

/// Which front end and wire format a request came by: label `route` in `/metrics`.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Route {
    Openpi,
    Vllm,
    /// LeRobot's `AsyncInference` gRPC service.
    Lerobot,
}

impl Route {
    pub const ALL: [Route; 3] = [Route::Openpi, Route::Vllm, Route::Lerobot];

    pub const fn label(self) -> &'static str {
        match self {
            Route::Openpi => "openpi",
            Route::Vllm => "vllm",
            Route::Lerobot => "lerobot",
        }
    }
}

impl From<Dialect> for Route {
    fn from(d: Dialect) -> Route {
        match d {
            Dialect::Openpi => Route::Openpi,
            Dialect::Vllm => Route::Vllm,
        }
    }
}

/// Step `i` of a timed action chunk for an observation taken at `timestep`/`timestamp`:
/// `(timestep + i, timestamp + i·dt)` (LeRobot's `TimedAction`s), for the scheduler's filters
/// and the `observe` reply alike.
pub fn timed_step(timestep: i64, timestamp: f64, dt: f64, i: usize) -> (i64, f64) {
    (timestep.saturating_add(i as i64), timestamp + i as f64 * dt)
}
