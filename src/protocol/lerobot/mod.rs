//! What do LeRobot's async-inference payloads hold, and in which format did a client send them?
//! The types both formats lower into, and the one place that tells the formats apart and picks
//! the reader and the writer for each:
//! - [`pickle`]: the strict pickle reader (it executes nothing);
//! - [`pickled`]: lerobot 0.6.1's pickles lowered into those types, and its reply written byte
//!   by byte;
//! - [`json`]: the pickle-free format of lerobot PR #3048 (JSON + safetensors).

pub mod json;
pub mod pickle;
pub mod pickled;

use thiserror::Error;

use super::clip;
use crate::dtype::{ByteOrder, ElemType};
use crate::limits::MAX_RANK;
use pickle::{PickleError, PickleLimits, PickleReader};

/// The binding key of LeRobot's state feature (the client's motors, in its order).
pub const STATE_KEY: &str = "observation.state";
/// The prefix of LeRobot's camera features: `observation.images.<camera>`, filled from the
/// client's `<camera>` frame.
pub const IMAGE_PREFIX: &str = "observation.images.";
/// The key of the task (a VLA's prompt).
pub const TASK_KEY: &str = "task";

/// Why a LeRobot payload was refused.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum LerobotError {
    #[error(transparent)]
    Pickle(#[from] PickleError),
    #[error(
        "the payload is not a pickle (first byte 0x{0:02x}); policyd reads LeRobot's pickled \
         payloads, protocols 2 to 5"
    )]
    NotPickle(u8),
    #[error("the payload is empty")]
    Empty,
    #[error("{0}")]
    Invalid(String),
}

fn invalid(msg: impl Into<String>) -> LerobotError {
    LerobotError::Invalid(msg.into())
}

/// A numpy array inside an observation, its data borrowed from the payload.
#[derive(Clone, Debug, PartialEq)]
pub struct NdArray<'p> {
    pub dtype: ElemType,
    pub order: ByteOrder,
    pub shape: heapless::Vec<usize, MAX_RANK>,
    /// C order, exactly `prod(shape) · itemsize` bytes.
    pub data: &'p [u8],
}

/// One value of an observation's dict.
#[derive(Clone, Debug, PartialEq)]
pub enum ObsValue<'p> {
    /// A Python float, int or bool, or a numpy scalar (a motor reading).
    Number(f64),
    /// A str (the task).
    Text(&'p str),
    /// A numpy array (a camera frame).
    Array(NdArray<'p>),
}

/// One entry of `RemotePolicyConfig.lerobot_features`.
#[derive(Clone, Debug, PartialEq)]
pub struct Feature {
    pub key: String,
    /// `float32`, `image`, ... (for a `PolicyFeature`, from its `FeatureType`).
    pub dtype: String,
    pub shape: Vec<usize>,
    /// Per-element names (`observation.state`'s motors, in the client's order).
    pub names: Vec<String>,
}

/// A `RemotePolicyConfig`: what the client asks the server to run.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicySetup {
    pub policy_type: String,
    pub pretrained_name_or_path: String,
    pub features: Vec<Feature>,
    pub actions_per_chunk: i64,
    pub device: String,
    pub rename_map: Vec<(String, String)>,
}

/// Most `lerobot_features` one setup may declare (LeRobot's robots have a state, an action and
/// a few cameras).
pub const MAX_FEATURES: usize = 64;
/// Most `names` one feature may carry (one per motor of the state vector).
pub const MAX_NAMES: usize = 1024;

/// What lowering one setup may allocate, counted as it goes: strings and feature records
/// against one budget proportional to the payload (see [`SetupBudget::for_payload`]). A
/// pickle's memo lets a 1 MB payload name one string 65,536 times; each reference is a copy
/// here, so each counts, and the budget stops the copying long before it matters.
#[derive(Debug)]
pub struct SetupBudget {
    left: usize,
}

impl SetupBudget {
    /// Bytes a setup's lowering may allocate per payload byte, and on top of any payload.
    pub const PER_BYTE: usize = 4;
    pub const BASE: usize = 64 << 10;

    pub fn for_payload(len: usize) -> SetupBudget {
        SetupBudget {
            left: len
                .saturating_mul(Self::PER_BYTE)
                .saturating_add(Self::BASE),
        }
    }

    fn take(&mut self, n: usize) -> Result<(), LerobotError> {
        self.left = self.left.checked_sub(n).ok_or_else(|| {
            invalid(
                "the RemotePolicyConfig expands to far more than its size (repeated references \
                 to the same strings); send each feature once, with names only for the state",
            )
        })?;
        Ok(())
    }

    /// A copy of a client's string, counted.
    pub fn string(&mut self, s: &str) -> Result<String, LerobotError> {
        self.take(s.len() + std::mem::size_of::<String>())?;
        Ok(s.to_string())
    }

    /// One more item of `size` bytes in a list, counted.
    pub fn item(&mut self, size: usize) -> Result<(), LerobotError> {
        self.take(size)
    }
}

/// Checks what both formats' setups must hold before their features are copied: at most
/// [`MAX_FEATURES`] of them.
pub fn check_feature_count(n: usize) -> Result<(), LerobotError> {
    if n > MAX_FEATURES {
        return Err(invalid(format!(
            "RemotePolicyConfig.lerobot_features has {n} entries; at most {MAX_FEATURES} are accepted"
        )));
    }
    Ok(())
}

/// Checks one feature's `names` against its shape before they are copied: no more than its
/// elements (a state of shape (6,) names 6 motors) and at most [`MAX_NAMES`].
pub fn check_name_count(key: &str, shape: &[usize], n: usize) -> Result<(), LerobotError> {
    let elements = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .unwrap_or(usize::MAX);
    if n > elements.min(MAX_NAMES) {
        return Err(invalid(format!(
            "lerobot_features['{}'] has {n} names for shape {shape:?}; at most one per element \
             (and {MAX_NAMES} in all)",
            clip(key)
        )));
    }
    Ok(())
}

/// Checks a lowered setup (either format): no feature twice, no name twice within a feature.
pub fn check_setup(setup: &PolicySetup) -> Result<(), LerobotError> {
    // Sets, not pairwise scans: 64 features of 1024 names would be 33 million comparisons.
    let mut keys = std::collections::HashSet::with_capacity(setup.features.len());
    for f in &setup.features {
        if !keys.insert(f.key.as_str()) {
            return Err(invalid(format!(
                "lerobot_features has '{}' twice",
                clip(&f.key)
            )));
        }
        let mut names = std::collections::HashSet::with_capacity(f.names.len());
        if let Some(n) = f.names.iter().find(|n| !names.insert(n.as_str())) {
            return Err(invalid(format!(
                "lerobot_features['{}'] names '{}' twice; each motor must have its own name",
                clip(&f.key),
                clip(n)
            )));
        }
    }
    Ok(())
}

/// The two payload formats a LeRobot client may send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Codec {
    /// Pickles (lerobot 0.6.1's client).
    Pickle,
    /// JSON + safetensors (lerobot PR #3048, [`json`]).
    Json,
}

impl Codec {
    fn name(self) -> &'static str {
        match self {
            Codec::Pickle => "pickle",
            Codec::Json => "JSON + safetensors (lerobot PR #3048)",
        }
    }
}

/// Tells the formats apart by the first byte: a pickle starts with `PROTO` (0x80, protocol 2 and
/// up); PR #3048's payloads with their JSON length, big-endian (0x00 below 16 MiB).
fn codec(payload: &[u8]) -> Result<Codec, LerobotError> {
    match payload.first() {
        None => Err(LerobotError::Empty),
        Some(0x80) => Ok(Codec::Pickle),
        Some(_) => Ok(Codec::Json),
    }
}

/// Checks that a payload is a pickle (it starts with `PROTO`, 0x80).
pub fn sniff(payload: &[u8]) -> Result<(), LerobotError> {
    match payload.first() {
        None => Err(LerobotError::Empty),
        Some(0x80) => Ok(()),
        Some(&b) => Err(LerobotError::NotPickle(b)),
    }
}

/// A client's payload format, fixed by its setup: its observations must come in it and its
/// actions go back in it, and it outlives whatever the setup is bound to (a reload's new
/// binding of the same client keeps it). Holds the pickle reader's arenas, reused from one
/// payload to the next.
pub struct ClientFormat {
    codec: Codec,
    pickle: PickleReader,
}

/// An observation's time and flags.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timed {
    pub timestep: i64,
    pub timestamp: f64,
    pub must_go: bool,
}

impl ClientFormat {
    /// Reads a `RemotePolicyConfig` in whichever format it came: what the client asks for, and
    /// its format from now on.
    pub fn read_setup(data: &[u8]) -> Result<(PolicySetup, ClientFormat), LerobotError> {
        let mut format = ClientFormat {
            codec: codec(data)?,
            pickle: PickleReader::new(PickleLimits::default()),
        };
        let setup = match format.codec {
            Codec::Pickle => pickled::policy_setup(&format.pickle.read(data)?)?,
            Codec::Json => json::policy_setup(data)?,
        };
        Ok((setup, format))
    }

    pub fn name(&self) -> &'static str {
        self.codec.name()
    }

    /// Reads a `TimedObservation` in the client's format and hands its time and its entries
    /// to `bind`, which keeps nothing of them past the call.
    pub fn observation<R>(
        &mut self,
        payload: &[u8],
        bind: impl for<'o> FnOnce(
            Timed,
            &mut dyn Iterator<Item = Result<(&'o str, ObsValue<'o>), LerobotError>>,
        ) -> R,
    ) -> Result<R, LerobotError> {
        let sent = codec(payload)?;
        if sent != self.codec {
            return Err(invalid(format!(
                "the client set up with {} payloads and sent an observation as {}",
                self.codec.name(),
                sent.name()
            )));
        }
        Ok(match sent {
            Codec::Pickle => {
                let tree = self.pickle.read(payload)?;
                let obs = pickled::observation(&tree)?;
                bind(obs.timed(), &mut obs.entries())
            }
            Codec::Json => {
                let obs = json::observation(payload)?;
                bind(obs.timed(), &mut obs.entries())
            }
        })
    }

    /// Writes the `list[TimedAction]` reply in the client's format: action `i` is `rows[i]`
    /// (float32, little-endian) at `timestep + first + i`, `timestamp + (first + i)·dt`.
    pub fn encode_actions<'a>(
        &self,
        rows: impl ExactSizeIterator<Item = &'a [u8]> + Clone,
        at: super::TimedStep,
        first: usize,
        dt: f64,
        buf: &mut Vec<u8>,
    ) {
        match self.codec {
            Codec::Pickle => pickled::encode_actions(rows, at, first, dt, buf),
            Codec::Json => json::encode_actions(rows, at, first, dt, buf),
        }
    }
}
