//! How does a LeRobot client's observation land in a slot? The binding of its
//! `TimedObservation` (either payload format) onto a policy's inputs, fixed when the client sets
//! up: the state vector from its per-motor values in the order of its `observation.state`
//! names, each `observation.images.<camera>` from its `<camera>` frame (resized as LeRobot
//! 0.6.1's server resizes it, if the sizes differ and the operator allows it), the task into
//! the prompt. Every buffer is allocated at setup, so an observation allocates nothing here.

use super::Plan;
use crate::config::LerobotResize;
use crate::dtype::{ByteOrder, ElemType, WireDType};
use crate::engine::InputBuffer;
use crate::limits::{MAX_LEROBOT_CAMERAS, MAX_LEROBOT_VALUES};
use crate::protocol::lerobot::{
    self, ClientFormat, IMAGE_PREFIX, ObsValue, PolicySetup, STATE_KEY, TASK_KEY,
};
use crate::protocol::{ArrayView, Endpoint, RequestMeta, Shape, Value, WireError, clip};

/// What a LeRobot `robot_client` can fill of a plan's bindings (see [`Plan::lerobot_fit`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LerobotFit {
    /// The plan's `observation.state` binding, if it has one.
    pub state: Option<FitState>,
    /// Each `observation.images.<camera>` binding.
    pub cameras: Vec<FitCamera>,
    /// The plan reads the task as a prompt.
    pub task: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FitState {
    pub len: usize,
    pub optional: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FitCamera {
    /// The client's camera key (the binding's key after `observation.images.`).
    pub name: String,
    pub height: usize,
    pub width: usize,
    pub optional: bool,
}

impl Plan {
    /// Whether LeRobot's clients can drive this plan: every required binding must be one they
    /// send (the state vector, uint8 `(height, width, 3)` camera frames, the task as text), and
    /// an output must hold the actions. An error names the binding that cannot be filled.
    pub fn lerobot_fit(&self) -> Result<LerobotFit, String> {
        let mut fit = LerobotFit {
            state: None,
            cameras: Vec::new(),
            task: false,
        };
        for b in &self.inputs {
            if b.key == STATE_KEY && !b.text && b.shape.len() == 1 {
                fit.state = Some(FitState {
                    len: b.shape[0],
                    optional: b.optional,
                });
            } else if let Some(cam) = b.key.strip_prefix(IMAGE_PREFIX)
                && !b.text
            {
                let [h, w, 3] = b.shape[..] else {
                    return Err(format!(
                        "input '{}' has shape {:?}; LeRobot clients send camera frames as uint8 \
                         (height, width, 3)",
                        b.key, b.shape
                    ));
                };
                if !b.accepted.iter().any(|(t, _)| *t == ElemType::U8) {
                    return Err(format!(
                        "input '{}' does not accept uint8; LeRobot clients send camera frames as \
                         uint8",
                        b.key
                    ));
                }
                fit.cameras.push(FitCamera {
                    name: cam.to_string(),
                    height: h,
                    width: w,
                    optional: b.optional,
                });
            } else if b.key == TASK_KEY && b.text {
                fit.task = true;
            } else if !b.optional {
                return Err(format!(
                    "input '{}' is not one LeRobot clients send ({STATE_KEY} of shape [n], \
                     {IMAGE_PREFIX}<camera> of shape [height, width, 3], {TASK_KEY} as text)",
                    b.key
                ));
            }
        }
        if self.outputs.is_empty() {
            return Err("the policy has no outputs to send as actions".into());
        }
        if fit.cameras.len() > MAX_LEROBOT_CAMERAS {
            return Err(format!(
                "the policy reads {} cameras; LeRobot clients are served at most {MAX_LEROBOT_CAMERAS}",
                fit.cameras.len()
            ));
        }
        Ok(fit)
    }
}

/// A camera the policy reads: the client's raw key, the binding it feeds, the frame size the
/// client declared and the policy's, and the buffer a resized frame is written to.
struct Camera {
    raw: String,
    binding: String,
    /// The policy's `(height, width, channels)`.
    size: (usize, usize, usize),
    /// Allocated at setup when the client's frames have another size (and resizing is on):
    /// the resize from the client's declared size, and its output.
    resize: Option<crate::transform::Resize>,
    resized: Vec<u8>,
}

/// How one client's observation maps onto one policy's bindings, fixed at
/// `SendPolicyInstructions` (buffers included, so an observation allocates nothing here).
pub struct Adapter {
    /// The client's motor keys in its `observation.state` order, and the vector they fill.
    motors: Vec<String>,
    state: Vec<u8>,
    filled: Vec<bool>,
    cameras: Vec<Camera>,
    /// The policy has a `task` (prompt) binding.
    task: bool,
    actions_per_chunk: usize,
    /// The output sent as the actions.
    action_output: usize,
}

impl Adapter {
    /// Checks a client's setup against a policy's plan (`name` for messages): its features
    /// against the bindings, its chunk length; the buffers are allocated here. A camera's
    /// declared frame must fit in `max_frame_bytes` (`lerobot.max_payload_bytes`: a frame
    /// larger than any observation can carry is a lie, and would size the resize buffer).
    pub fn new(
        on_resize: LerobotResize,
        max_frame_bytes: usize,
        plan: &Plan,
        name: &str,
        setup: &PolicySetup,
    ) -> Result<Adapter, String> {
        let horizon = plan.horizon;
        let apc = setup.actions_per_chunk;
        if apc < 1 || apc as u64 > horizon as u64 {
            return Err(format!(
                "actions_per_chunk = {apc} must be within 1..={horizon} (the chunk policy \"{name}\" \
                 predicts)"
            ));
        }
        let fit = plan
            .lerobot_fit()
            .map_err(|e| format!("policy \"{name}\": {e}"))?;
        let feature = |key: &str| setup.features.iter().find(|f| f.key == key);
        let mut motors = Vec::new();
        if let Some(state) = &fit.state {
            match feature(STATE_KEY) {
                None if state.optional => {}
                None => {
                    return Err(format!(
                        "lerobot_features has no \"{STATE_KEY}\"; policy \"{name}\" needs it \
                         (shape [{}])",
                        state.len
                    ));
                }
                Some(f) if f.names.len() != state.len => {
                    return Err(format!(
                        "lerobot_features[\"{STATE_KEY}\"] names {} motors; policy \"{name}\" \
                         takes a state of shape [{}]",
                        f.names.len(),
                        state.len
                    ));
                }
                Some(f) => motors = f.names.clone(),
            }
        }
        let mut cameras = Vec::new();
        for cam in &fit.cameras {
            let binding = format!("{IMAGE_PREFIX}{}", cam.name);
            let Some(f) = feature(&binding) else {
                if cam.optional {
                    continue;
                }
                let have: Vec<&str> = setup
                    .features
                    .iter()
                    .map(|f| f.key.as_str())
                    .filter(|k| k.starts_with(IMAGE_PREFIX))
                    .collect();
                return Err(format!(
                    "lerobot_features has no \"{binding}\"; policy \"{name}\" needs that camera \
                     (the client's cameras: {}); camera names must match the policy's",
                    if have.is_empty() {
                        "none".into()
                    } else {
                        have.iter()
                            .take(16)
                            .map(|k| clip(k).to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    }
                ));
            };
            let (h, w, c) = (cam.height, cam.width, 3);
            if f.shape.len() != 3 || f.shape[2] != c {
                return Err(format!(
                    "lerobot_features[\"{binding}\"] has shape {:?}; policy \"{name}\" takes \
                     {c} channels",
                    f.shape
                ));
            }
            let declared = f.shape[0]
                .checked_mul(f.shape[1])
                .and_then(|n| n.checked_mul(c))
                .filter(|&n| n <= max_frame_bytes);
            match declared {
                Some(0) => {
                    return Err(format!(
                        "lerobot_features[\"{binding}\"] declares {}x{} frames; a camera frame \
                         needs a height and a width",
                        f.shape[1], f.shape[0]
                    ));
                }
                None => {
                    return Err(format!(
                        "lerobot_features[\"{binding}\"] declares {}x{}x{c} frames, more than an \
                         observation may carry (lerobot.max_payload_bytes = {max_frame_bytes})",
                        f.shape[1], f.shape[0]
                    ));
                }
                Some(_) => {}
            }
            let resize = f.shape[..2] != [h, w];
            if resize && on_resize == LerobotResize::Refuse {
                return Err(format!(
                    "camera \"{}\" sends {}x{} frames; policy \"{name}\" takes {h}x{w} and \
                     lerobot.resize = \"refuse\"; set the camera's resolution to {w}x{h}",
                    cam.name, f.shape[1], f.shape[0]
                ));
            }
            let resizer = if resize {
                Some(
                    crate::transform::Resize::new((f.shape[0], f.shape[1]), (h, w), c)
                        .map_err(|e| format!("lerobot_features[\"{binding}\"]: {e}"))?,
                )
            } else {
                None
            };
            cameras.push(Camera {
                raw: cam.name.clone(),
                binding,
                size: (h, w, c),
                resize: resizer,
                resized: if resize {
                    vec![0; h * w * c]
                } else {
                    Vec::new()
                },
            });
        }
        let action_output = plan
            .outputs
            .iter()
            .position(|o| o.key == "action" || o.key == "actions")
            .unwrap_or(0);
        Ok(Adapter {
            state: vec![0; motors.len() * 4],
            filled: vec![false; motors.len()],
            motors,
            cameras,
            task: fit.task,
            actions_per_chunk: apc as usize,
            action_output,
        })
    }

    /// Reads one `TimedObservation`, in the format the client set up with, into a slot's
    /// inputs; the request's meta for the core.
    pub fn decode(
        &mut self,
        format: &mut ClientFormat,
        payload: &[u8],
        plan: &Plan,
        inputs: &mut [Box<dyn InputBuffer>],
        seen: &mut [bool],
    ) -> Result<RequestMeta, WireError> {
        format
            .observation(payload, |at, entries| {
                self.bind(at, entries, plan, inputs, seen)
            })
            .map_err(wire)?
    }

    /// Binds one observation's entries (either format) into a slot's inputs.
    fn bind<'o>(
        &mut self,
        at: lerobot::Timed,
        entries: &mut dyn Iterator<Item = Result<(&'o str, ObsValue<'o>), lerobot::LerobotError>>,
        plan: &Plan,
        inputs: &mut [Box<dyn InputBuffer>],
        seen: &mut [bool],
    ) -> Result<RequestMeta, WireError> {
        self.filled.iter_mut().for_each(|f| *f = false);
        // The adapter holds at most MAX_LEROBOT_CAMERAS cameras (checked when it was built).
        let mut frames: [Option<lerobot::NdArray<'_>>; MAX_LEROBOT_CAMERAS] =
            std::array::from_fn(|_| None);
        let mut task: Option<&str> = None;
        for entry in entries {
            let (key, value) = entry.map_err(wire)?;
            match value {
                ObsValue::Number(v) => {
                    if let Some(j) = self.motors.iter().position(|m| m == key) {
                        self.state[j * 4..j * 4 + 4].copy_from_slice(&(v as f32).to_le_bytes());
                        self.filled[j] = true;
                    }
                }
                ObsValue::Text(t) if key == "task" => task = Some(t),
                ObsValue::Text(_) => {}
                ObsValue::Array(a) => {
                    if let Some(i) = self.cameras.iter().position(|c| c.raw == key)
                        && let Some(slot) = frames.get_mut(i)
                    {
                        *slot = Some(a);
                    }
                }
            }
        }
        if let Some(j) = self.filled.iter().position(|f| !f) {
            return Err(WireError::Payload(format!(
                "the observation has no '{}' (a motor of the client's {STATE_KEY} feature)",
                clip(&self.motors[j])
            )));
        }
        let mut values: heapless::Vec<(&str, Value<'_>), MAX_LEROBOT_VALUES> = heapless::Vec::new();
        if !self.motors.is_empty() {
            let mut shape = Shape::new();
            let _ = shape.push(self.motors.len());
            let _ = values.push((STATE_KEY, array(ElemType::F32, shape, &self.state)));
        }
        for (cam, frame) in self.cameras.iter_mut().zip(frames) {
            let Some(a) = frame else {
                return Err(WireError::Payload(format!(
                    "the observation has no '{}' (the camera of {})",
                    cam.raw, cam.binding
                )));
            };
            let (h, w, c) = cam.size;
            if a.dtype != ElemType::U8 || a.shape.len() != 3 || a.shape[2] != c {
                return Err(WireError::Payload(format!(
                    "observation['{}'] is {} of shape {:?}; expected uint8 (height, width, {c})",
                    cam.raw,
                    a.dtype.name(),
                    a.shape.as_slice()
                )));
            }
            let data = match &mut cam.resize {
                _ if a.shape[..2] == [h, w] => a.data,
                Some(r) if r.from() == (a.shape[0], a.shape[1]) => {
                    r.run(a.data, &mut cam.resized);
                    &cam.resized
                }
                _ => {
                    return Err(WireError::Payload(format!(
                        "observation['{}'] is {}x{}; the policy takes {h}x{w}{}",
                        cam.raw,
                        a.shape[1],
                        a.shape[0],
                        match &cam.resize {
                            Some(r) => format!(
                                " and the client declared {}x{} (its lerobot_features)",
                                r.from().1,
                                r.from().0
                            ),
                            None => String::new(),
                        }
                    )));
                }
            };
            let mut shape = Shape::new();
            let _ = shape.extend_from_slice(&[h, w, c]);
            let _ = values.push((cam.binding.as_str(), array(ElemType::U8, shape, data)));
        }
        if self.task {
            let t = task.ok_or_else(|| {
                WireError::Payload("the observation has no 'task' (the policy's prompt)".into())
            })?;
            let _ = values.push((
                "task",
                Value::Text {
                    dtype: None,
                    data: t.as_bytes(),
                },
            ));
        }
        plan.decode_values(values.into_iter().map(Ok), inputs, seen, None)?;
        Ok(RequestMeta {
            endpoint: Endpoint::Observe,
            timestep: Some(at.timestep),
            timestamp: Some(at.timestamp),
            must_go: Some(at.must_go),
            ..RequestMeta::default()
        })
    }
}

/// A LeRobot payload error as a request error: what the reader refused is
/// [`WireError::Lerobot`], counted apart from observations that read but do not fit.
fn wire(e: lerobot::LerobotError) -> WireError {
    match e {
        lerobot::LerobotError::Invalid(m) => WireError::Payload(m),
        e => WireError::Lerobot(e),
    }
}

fn array(t: ElemType, shape: Shape, data: &[u8]) -> Value<'_> {
    Value::Array(ArrayView {
        declared: WireDType::Num(t, ByteOrder::Little),
        storage: t,
        order: ByteOrder::Little,
        shape,
        data,
        native: false,
    })
}

impl Adapter {
    /// The rows a reply carries at most (the client's `actions_per_chunk`).
    pub fn actions_per_chunk(&self) -> usize {
        self.actions_per_chunk
    }

    /// The output sent as the actions: `action` (or `actions`), else the first.
    pub fn action_output(&self) -> usize {
        self.action_output
    }
}
