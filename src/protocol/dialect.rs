//! Which dialect does a connection speak, and how does each frame replies, errors and resets?
//! The only place that tells openpi from vllm-omni: the connection asks the [`Dialect`] it was
//! routed to, and the bindings write output arrays without knowing which it is.

use super::encode::{Encoder, Timing, encode_timing};
use crate::dtype::ElemType;

/// The path that selects the vllm-omni dialect (after any `/policies/<name>` prefix).
pub const VLLM_PATH: &str = "/v1/realtime/robot/openpi";

/// openpi's close reason after an error text frame.
pub const OPENPI_ERROR_REASON: &str =
    "Internal server error. Traceback included in previous frame.";

/// Which protocol dialect a connection speaks (chosen by path).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Dialect {
    /// openpi: `{"actions": …, timing}` replies; errors as a text frame, then close 1011.
    Openpi,
    /// vllm-omni: bare float32 arrays; errors as msgpack maps, the socket stays open.
    Vllm,
}

/// How output arrays travel: openpi gets the configured `[[outputs]] dtype`, vllm-omni always
/// float32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    Configured,
    Float32,
}

/// What a request went wrong with. The kind decides the vllm-omni message and the metrics
/// label; the text is the detail.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The request itself (vllm-omni: "Invalid request payload").
    Request(String),
    /// The engine or its output (vllm-omni: "Internal inference error").
    Inference(String),
}

/// Label `kind` of an error in `/metrics`.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum ErrorKind {
    Request,
    Inference,
}

/// `server.reset_reply`: how `endpoint: reset` is acknowledged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ResetReply {
    /// `{"status": "reset successful"}` as msgpack.
    #[default]
    Msgpack,
    /// The text frame `reset successful`.
    Text,
}

/// A frame to send: text, or the binary message just encoded into the caller's buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    Text(String),
    Binary,
}

/// How a failure is reported: the frame, and whether the connection closes after it (openpi
/// closes with 1011 and [`OPENPI_ERROR_REASON`]; vllm-omni keeps the socket).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ErrorReply {
    pub frame: Frame,
    pub close: bool,
}

/// A finished result's outputs as the bindings cut and convert them, for a dialect to frame.
pub trait Outputs {
    /// Outputs in the reply.
    fn count(&self) -> usize;
    /// Reply key of output `i`.
    fn key(&self, i: usize) -> &str;
    /// Writes output `i` as an ndarray.
    fn write(&mut self, i: usize, precision: Precision, e: &mut Encoder<'_>);
    /// The rows `start..end` of the action chunk the reply keeps.
    fn rows(&self) -> (usize, usize);
}

impl Failure {
    pub fn kind(&self) -> ErrorKind {
        match self {
            Failure::Request(_) => ErrorKind::Request,
            Failure::Inference(_) => ErrorKind::Inference,
        }
    }

    /// The detail: what was wrong.
    pub fn message(&self) -> &str {
        let (Failure::Request(m) | Failure::Inference(m)) = self;
        m
    }
}

impl ErrorKind {
    pub const ALL: [ErrorKind; 2] = [ErrorKind::Request, ErrorKind::Inference];

    pub const fn label(self) -> &'static str {
        match self {
            ErrorKind::Request => "request",
            ErrorKind::Inference => "inference",
        }
    }
}

/// What `endpoint: reset` clears (see [`Dialect::reset_scope`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResetScope {
    /// The session the request names (or the current one).
    Session,
    /// Every session of the connection; the current one becomes `"default"`.
    Connection,
}

impl Dialect {
    pub const ALL: [Dialect; 2] = [Dialect::Openpi, Dialect::Vllm];

    /// The dialect a path selects, `rest` being the path after any `/policies/<name>`.
    pub fn for_path(rest: &str) -> Dialect {
        if rest == VLLM_PATH {
            Dialect::Vllm
        } else {
            Dialect::Openpi
        }
    }

    /// Its name in logs.
    pub fn name(self) -> &'static str {
        match self {
            Dialect::Openpi => "openpi",
            Dialect::Vllm => "vllm-omni",
        }
    }

    /// The dtypes a reply on this route is sent in (non-finite checks run on them).
    pub fn precision(self) -> Precision {
        match self {
            Dialect::Openpi => Precision::Configured,
            Dialect::Vllm => Precision::Float32,
        }
    }

    /// What `endpoint: reset` clears. vllm-omni forgets every session the socket has seen
    /// and unsets the current one (the next request without `session_id` is `"default"`);
    /// openpi has no reset message of its own, and policyd's resets the current session.
    pub fn reset_scope(self) -> ResetScope {
        match self {
            Dialect::Openpi => ResetScope::Session,
            Dialect::Vllm => ResetScope::Connection,
        }
    }

    /// An `infer` reply. openpi: `{key: ndarray, …, policy_timing, server_timing}`, plus
    /// `delay_steps` when given. vllm-omni: a bare float32 array, or a map of them for several
    /// outputs (no timing).
    pub fn encode_infer(
        self,
        out: &mut impl Outputs,
        timing: &Timing,
        delay_steps: Option<u32>,
        buf: &mut Vec<u8>,
    ) {
        buf.clear();
        let mut e = Encoder { buf };
        let n = out.count();
        match self {
            Dialect::Openpi => {
                e.map(n as u32 + 2 + u32::from(delay_steps.is_some()));
                for i in 0..n {
                    e.str(out.key(i));
                    out.write(i, Precision::Configured, &mut e);
                }
                encode_timing(&mut e, timing);
                if let Some(d) = delay_steps {
                    e.str("delay_steps");
                    e.int(i64::from(d));
                }
            }
            Dialect::Vllm => {
                let several = n > 1;
                if several {
                    e.map(n as u32);
                }
                for i in 0..n {
                    if several {
                        e.str(out.key(i));
                    }
                    out.write(i, Precision::Float32, &mut e);
                }
            }
        }
    }

    /// An `observe` push: `{"type": "actions", key: ndarray, …, "timesteps": int64[H],
    /// "timestamps": float64[H], "obs_timestep", "delay_steps"}`, where step i of the kept
    /// chunk is [`timed_step`](super::timed_step)`(obs, dt, start + i)`. Both
    /// dialects; vllm-omni's arrays are float32.
    pub fn encode_observe(
        self,
        out: &mut impl Outputs,
        obs: super::TimedStep,
        dt: f64,
        delay_steps: u32,
        buf: &mut Vec<u8>,
    ) {
        buf.clear();
        let mut e = Encoder { buf };
        let n_out = out.count();
        e.map(n_out as u32 + 5);
        e.str("type");
        e.str("actions");
        for i in 0..n_out {
            e.str(out.key(i));
            out.write(i, self.precision(), &mut e);
        }
        let (start, end) = out.rows();
        let n = end - start;
        e.str("timesteps");
        e.ndarray(ElemType::I64, &[n], 8 * n, |d| {
            for (i, c) in d.chunks_exact_mut(8).enumerate() {
                let step = super::timed_step(obs, dt, start + i).timestep;
                c.copy_from_slice(&step.to_le_bytes());
            }
        });
        e.str("timestamps");
        e.ndarray(ElemType::F64, &[n], 8 * n, |d| {
            for (i, c) in d.chunks_exact_mut(8).enumerate() {
                let t = super::timed_step(obs, dt, start + i).timestamp;
                c.copy_from_slice(&t.to_le_bytes());
            }
        });
        e.str("obs_timestep");
        e.int(obs.timestep);
        e.str("delay_steps");
        e.int(i64::from(delay_steps));
    }

    /// A `{"type": "skipped", "timestep", "reason"}` notice (both dialects).
    pub fn encode_skipped(timestep: i64, reason: &str, buf: &mut Vec<u8>) {
        buf.clear();
        let mut e = Encoder { buf };
        e.map(3);
        e.str("type");
        e.str("skipped");
        e.str("timestep");
        e.int(timestep);
        e.str("reason");
        e.str(reason);
    }

    /// The acknowledgement of `endpoint: reset` (encoded into `buf` when binary).
    pub fn encode_reset(style: ResetReply, buf: &mut Vec<u8>) -> Frame {
        match style {
            ResetReply::Text => Frame::Text("reset successful".into()),
            ResetReply::Msgpack => {
                encode_status(buf, "reset successful");
                Frame::Binary
            }
        }
    }

    /// How `f` is reported. openpi: a text frame naming the problem, then close 1011.
    /// vllm-omni: `{"type": "error", "message", "detail"}` (encoded into `buf`), socket open.
    pub fn encode_error(self, f: &Failure, buf: &mut Vec<u8>) -> ErrorReply {
        match self {
            Dialect::Openpi => {
                let text = match f {
                    Failure::Request(m) => format!("policyd: invalid request: {m}"),
                    Failure::Inference(m) => format!("policyd: inference failed: {m}"),
                };
                ErrorReply {
                    frame: Frame::Text(text),
                    close: true,
                }
            }
            Dialect::Vllm => {
                let message = match f {
                    Failure::Request(_) => "Invalid request payload",
                    Failure::Inference(_) => "Internal inference error",
                };
                encode_error_map(buf, message, f.message());
                ErrorReply {
                    frame: Frame::Binary,
                    close: false,
                }
            }
        }
    }
}

/// vllm-omni's error map: `{"type": "error", "message": …, "detail": …}`.
pub fn encode_error_map(buf: &mut Vec<u8>, message: &str, detail: &str) {
    buf.clear();
    let mut e = Encoder { buf };
    e.map(3);
    e.str("type");
    e.str("error");
    e.str("message");
    e.str(message);
    e.str("detail");
    e.str(detail);
}

/// A one-entry status map such as `{"status": "reset successful"}`.
pub fn encode_status(buf: &mut Vec<u8>, status: &str) {
    buf.clear();
    let mut e = Encoder { buf };
    e.map(1);
    e.str("status");
    e.str(status);
}
