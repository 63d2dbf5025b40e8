//! What do the bytes on the socket mean? The OpenPI wire format in both dialects: msgpack
//! (a bounded cursor, `msgpack.rs`) with numpy array markers, decoded in one pass into the
//! bindings' buffers ([`request`]), replies encoded byte for byte as openpi's
//! `msgpack_numpy.packb` writes them ([`encode`]), and the per-dialect framing of replies,
//! errors and resets ([`dialect`]). LeRobot's async-inference payloads, in either of a
//! client's formats, are [`lerobot`]'s: the strict pickle reader, the JSON + safetensors
//! reader, the typed setup and observations, the `TimedAction` replies. Here too: which front
//! end a request came by ([`Route`]), an observation's step and time ([`TimedStep`]) and a
//! pipeline's stages as a reply reports them ([`StageTimes`]).
//!
//! This layer knows no config, engine or runtime: it takes the caps it needs ([`Limits`]) and a
//! [`Visitor`] for the values a binding names.

pub mod dialect;
pub mod encode;
pub mod lerobot;
mod msgpack;
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

/// A control step and its time on the robot's clock: when an observation was taken, or when
/// an action is due.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TimedStep {
    pub timestep: i64,
    /// Seconds on the robot's clock.
    pub timestamp: f64,
}

/// Step `i` of a timed action chunk for an observation taken `at`: `(timestep + i,
/// timestamp + i·dt)` (LeRobot's `TimedAction`s), for the scheduler's filters and the
/// `observe` reply alike.
pub fn timed_step(at: TimedStep, dt: f64, i: usize) -> TimedStep {
    TimedStep {
        timestep: at.timestep.saturating_add(i as i64),
        timestamp: at.timestamp + i as f64 * dt,
    }
}

/// A pipeline's stages as a reply reports them: prefix and denoising (all steps) in
/// milliseconds, and the steps run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StageTimes {
    pub prefix_ms: f64,
    pub denoise_ms: f64,
    pub steps: u32,
}

/// The most characters of a client's string that an error message or a log line repeats.
pub const ECHO_CHARS: usize = 80;

/// A client's string as errors and logs repeat it: at most [`ECHO_CHARS`] characters, control
/// characters escaped (`\n`), and the full length when it was cut. Every string a peer sends and a
/// message names (keys, names, dtypes, paths) goes through it, so that a 30 MB key makes a
/// short line, not a 30 MB log line and `grpc-message`.
pub fn clip(s: &str) -> Clip<'_> {
    Clip(s)
}

/// See [`clip`].
pub struct Clip<'a>(&'a str);

impl std::fmt::Display for Clip<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use std::fmt::Write;
        for (n, c) in self.0.chars().enumerate() {
            if n == ECHO_CHARS {
                return write!(f, "…({} bytes in all)", self.0.len());
            }
            if c.is_control() {
                // Shown escaped (`\n`, `\u{1b}`): a client cannot start a log line of its own.
                write!(f, "{}", c.escape_default())?;
            } else {
                f.write_char(c)?;
            }
        }
        Ok(())
    }
}

/// Cuts a message that may hold client text to at most `max` bytes (on a character boundary),
/// saying so: the backstop for a message built from several clipped parts.
pub fn cap_message(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push_str("… (cut)");
    }
    s
}

#[cfg(test)]
mod clip_tests {
    use super::*;

    #[test]
    fn a_long_client_string_is_cut_and_its_length_said() {
        let long = "k".repeat(30 << 20);
        let shown = clip(&long).to_string();
        assert!(shown.len() < 120, "{}", shown.len());
        assert!(shown.ends_with(&format!("({} bytes in all)", 30 << 20)));
        assert_eq!(clip("cam\n0").to_string(), "cam\\n0");
        assert_eq!(clip("front").to_string(), "front");
        assert_eq!(cap_message("é".repeat(10), 5), "éé… (cut)");
    }
}
