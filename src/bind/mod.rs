//! How do a frame's values reach the engine, and the engine's outputs the reply? The bindings
//! of one policy, checked against its engine's real inputs and outputs and compiled once
//! (`compile/`): the request path then makes no decisions. It looks up a key and applies a
//! precompiled transform into a preallocated slot buffer (`input.rs`), and cuts and converts
//! outputs into the reply (`output.rs`), which the dialect frames.
//!
//! Like tract's typed pipeline (parse, check, optimise, run), a [`Plan`] is immutable once
//! compiled; the run state lives in the runtime's slots.

mod compile;
mod input;
pub mod lerobot;
mod output;
mod tokens;

pub use input::History;
pub use output::{Chunk, Relative, Reply, ReplyParts};
pub use tokens::{PromptCache, TokenBinding, Tokenized};

use crate::dtype::ElemType;
use crate::engine::IoSpec;
use crate::planner::Link;
use crate::protocol::Limits;
use crate::transform::{Affine, Transform};

/// One observation key bound to one engine input.
#[derive(Debug)]
pub struct InputBinding {
    pub key: String,
    /// Index into a slot's input buffers: the engine's inputs, then the host buffers
    /// ([`Plan::host_buffers`]) that only the request path reads.
    pub index: usize,
    /// Accepted wire dtypes, each with its compiled transform.
    pub accepted: Vec<(ElemType, Transform)>,
    /// Expected wire shape.
    pub shape: Vec<usize>,
    pub engine_type: ElemType,
    pub affine: Affine,
    pub optional: bool,
    pub fill: f64,
    /// `inputs[i].present_tensor`: the engine input (its index and type) set to 1 when the
    /// request sent this key and to 0 when it was filled.
    pub present: Option<(usize, ElemType)>,
    /// A text binding: the string's UTF-8 bytes, one per element, then `fill`. A tokenized
    /// prompt is one too: its text lands in a host buffer, tokenized after the decode.
    pub text: bool,
    /// A tokenized prompt: where its ids and mask go.
    pub tokens: Option<TokenBinding>,
    /// Refuse NaN and infinity, on the wire or in the engine buffer after normalisation
    /// (unless `allow_non_finite`): a sensor's NaN must not become plausible commands.
    pub check_finite: bool,
    /// For a one-element input: a transform from each storage type (indexed by `ElemType as
    /// usize`), since scalars travel as native msgpack numbers of any type.
    pub scalar: Vec<Transform>,
    /// Frames the engine input holds (`history`): a request's frame lands in the last, the
    /// session's previous ones fill the rest ([`Plan::stack_history`]).
    pub history: usize,
    /// Engine bytes of one frame.
    pub frame_bytes: usize,
    /// The slot buffer that keeps this input's values as sent, as float64, for relative
    /// actions ([`Plan::relative_source`]).
    pub raw: Option<usize>,
    /// Clamp the normalised values to `[lo, hi]` (`inputs[i].clip`; a float engine input).
    pub clip: Option<(f64, f64)>,
}

/// One engine output sent under one reply key.
#[derive(Debug)]
pub struct OutputBinding {
    pub key: String,
    pub index: usize,
    /// Shape of the reply array.
    pub shape: Vec<usize>,
    /// Engine output → the configured reply dtype (`outputs[i].dtype`).
    pub configured: Transform,
    /// Engine output → float32 (what vllm-omni's route and LeRobot's service always send).
    pub float32: Transform,
    /// Bytes of the engine output before the first kept row (`rows`).
    pub offset: usize,
    /// Relative actions: the masked columns get the input's values as sent.
    pub relative: Option<Relative>,
    /// `outputs[i].clip`, as bounds per column in reply units: the engine's values clamped
    /// before un-normalising are the un-normalised values clamped to the mapped bounds (the
    /// map is monotone per column), so the clamp runs on the reply.
    pub clamp: Option<Vec<(f64, f64)>>,
}

impl OutputBinding {
    /// The transform for a reply sent in `precision`.
    pub fn transform(&self, precision: crate::protocol::dialect::Precision) -> &Transform {
        match precision {
            crate::protocol::dialect::Precision::Configured => &self.configured,
            crate::protocol::dialect::Precision::Float32 => &self.float32,
        }
    }
}

/// The compiled plan.
#[derive(Debug)]
pub struct Plan {
    pub inputs: Vec<InputBinding>,
    pub outputs: Vec<OutputBinding>,
    pub io: IoSpec,
    pub limits: Limits,
    /// The metadata frame, encoded once.
    pub metadata: Vec<u8>,
    /// Largest reply, in bytes (the reply buffer's capacity).
    pub reply_capacity: usize,
    /// Bytes of a slot's scratch buffer: the largest output converted to a reply dtype.
    pub scratch_bytes: usize,
    /// Rows of the action chunk (the first axis of the first output of rank 2 or more).
    pub horizon: usize,
    /// Index of the binding the similarity filter reads, if it is on.
    pub similarity_input: Option<usize>,
    /// Where the request path meets the task planner, when `[planner]` is on.
    pub planner: Option<PlannerTap>,
    /// Bytes of each host buffer a slot has after the engine's inputs: a tokenized prompt's
    /// text, a pi0.5 state the engine does not take.
    pub host_buffers: Vec<usize>,
    /// The binding of the tokenized prompt, if any.
    pub tokens: Option<usize>,
    /// This plan, among every plan compiled (a session's token cache is valid for one).
    pub id: u64,
    /// A pipeline's steps: (default, most a request may ask for).
    pub sampling: Option<(u32, u32)>,
    /// Bytes a session keeps of its previous frames, over every binding with `history` > 1.
    pub history_bytes: usize,
    /// The slot buffer holding the relative actions' input as sent (float64), if an output is
    /// relative ([`Relative`]).
    pub relative_source: Option<usize>,
    /// `[rtc]`: what a session keeps of each chunk it was sent.
    pub rtc: Option<RtcPlan>,
}

/// `[rtc]` as the request path sees it: the sample's layout, from the engine's output.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RtcPlan {
    pub settings: crate::rtc::Settings,
    /// The engine output holding the sample (a pipeline's only one).
    pub output: usize,
    /// Its rows and values per row.
    pub rows: usize,
    pub width: usize,
    /// The action columns (`outputs[i].columns` of the output reading it); the rest is the
    /// model's padding, zero in a leftover as LeRobot pads it.
    pub cols: usize,
}

/// The request path's side of the planner: which bindings it reads and fills. Indices
/// only: the [`Link`] the planner thread feeds lives as long as the server (the listener
/// makes it from the first default policy's tap), so a reload never moves it.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannerTap {
    /// The text binding the subtask fills (`planner.prompt_key`).
    pub prompt: usize,
    /// The image binding whose frames the planner sees (`planner.camera`).
    pub camera: Option<usize>,
    /// That image's geometry (what the link's frame buffer is sized for).
    pub geometry: Option<crate::planner::Geometry>,
    /// The most bytes a subtask may have (the prompt input's length).
    pub max_subtask: usize,
}

impl PlannerTap {
    /// The link for a planner feeding this tap.
    pub fn link(&self, cfg: &crate::config::PlannerConfig) -> Link {
        Link::new(cfg, self.geometry, self.max_subtask)
    }

    /// Whether `link` (made for an earlier plan) fits this tap: same frame geometry, same
    /// subtask length.
    pub fn fits(&self, link: &Link) -> bool {
        link.camera == self.geometry && link.max_subtask == self.max_subtask
    }
}

/// Drops leading size-1 axes while more than `min_rank` remain (the inputs' and the token
/// tensors' shapes are compared this way).
fn squeeze_to(shape: &[usize], min_rank: usize) -> &[usize] {
    let mut s = shape;
    while s.len() > min_rank && s.first() == Some(&1) {
        s = &s[1..];
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, ConfigError};
    use crate::engine::InputBuffer;
    use crate::engine::TensorSpec;
    use crate::protocol::{Encoder, WireError};
    use crate::testing::synthetic::HostBuffer as Buf;

    const CFG: &str = r#"
[engine]
model = "m.onnx"
[[inputs]]
key = "state"
tensor = "state"
dtypes = ["float64"]
shape = [2]
[[inputs]]
key = "prompt"
tensor = "tokens"
dtypes = ["text"]
shape = [8]
fill = -1
[[outputs]]
tensor = "actions"
"#;

    fn plan(cfg: &str) -> Result<Plan, ConfigError> {
        let cfg = Config::parse(cfg, "test", None)?;
        let io = IoSpec {
            inputs: vec![
                TensorSpec {
                    name: "state".into(),
                    dtype: ElemType::F32,
                    shape: vec![1, 2],
                },
                TensorSpec {
                    name: "tokens".into(),
                    dtype: ElemType::I64,
                    shape: vec![1, 8],
                },
            ],
            outputs: vec![TensorSpec {
                name: "actions".into(),
                dtype: ElemType::F32,
                shape: vec![1, 4, 2],
            }],
        };
        Plan::compile(&cfg, cfg.default_policy(), &io)
    }

    #[test]
    fn a_model_declaring_an_absurd_shape_is_refused() {
        let cfg = Config::parse(CFG, "test", None).unwrap();
        let spec = |name: &str, dtype, shape: Vec<usize>| TensorSpec {
            name: name.into(),
            dtype,
            shape,
        };
        let io = IoSpec {
            inputs: vec![
                spec("state", ElemType::F32, vec![1, 2]),
                spec("tokens", ElemType::I64, vec![1, 8]),
            ],
            outputs: vec![spec("actions", ElemType::F32, vec![1 << 40, 1 << 40, 2])],
        };
        let Err(e) = Plan::compile(&cfg, cfg.default_policy(), &io) else {
            panic!("a model declaring a 2^81-element output was accepted")
        };
        let e = e.to_string();
        assert!(e.contains("engine.model") && e.contains("'actions'"), "{e}");
    }

    /// `{"state": <f8[2]>, "prompt": prompt}` with `prompt` already msgpack-encoded.
    fn frame(prompt: &[u8]) -> Vec<u8> {
        let mut buf = Vec::new();
        let mut e = Encoder { buf: &mut buf };
        e.map(2);
        e.str("state");
        e.ndarray(ElemType::F64, &[2], 16, |d| d.fill(0));
        e.str("prompt");
        buf.extend_from_slice(prompt);
        buf
    }

    fn tokens(p: &Plan, frame: &[u8]) -> Result<Vec<i64>, WireError> {
        tokens_with(p, None, frame)
    }

    fn tokens_with(p: &Plan, link: Option<&Link>, frame: &[u8]) -> Result<Vec<i64>, WireError> {
        let mut bufs: Vec<Box<dyn InputBuffer>> =
            vec![Box::new(Buf(vec![0; 8])), Box::new(Buf(vec![0; 64]))];
        let mut seen = vec![false; 2];
        p.decode_with(frame, &mut bufs, &mut seen, link)?;
        Ok(bufs[1]
            .bytes_mut()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect())
    }

    fn msgpack_str(s: &str) -> Vec<u8> {
        let mut v = Vec::new();
        Encoder { buf: &mut v }.str(s);
        v
    }

    /// `{"state": <f8[2]> holding `state`, "prompt": "p"}`.
    fn state_frame(state: [f64; 2]) -> Vec<u8> {
        let mut buf = Vec::new();
        let mut e = Encoder { buf: &mut buf };
        e.map(2);
        e.str("state");
        e.ndarray(ElemType::F64, &[2], 16, |d| {
            d[..8].copy_from_slice(&state[0].to_le_bytes());
            d[8..].copy_from_slice(&state[1].to_le_bytes());
        });
        e.str("prompt");
        e.str("p");
        buf
    }

    #[test]
    fn non_finite_inputs_are_refused_unless_allowed() {
        let p = plan(CFG).unwrap();
        for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let e = tokens(&p, &state_frame([0.5, bad])).unwrap_err();
            assert!(
                matches!(&e, WireError::NonFinite { key } if key == "state"),
                "{e}"
            );
            assert!(e.is_non_finite() && e.to_string().contains("allow_non_finite"));
        }
        // Finite as float64, infinite in the engine's float32: refused as an overflow.
        for big in [1e308, -1e39] {
            let e = tokens(&p, &state_frame([big, 0.0])).unwrap_err();
            assert!(
                matches!(&e, WireError::Overflows { key, engine: "float32" } if key == "state"),
                "{e}"
            );
        }
        assert!(tokens(&p, &state_frame([f64::from(f32::MAX), -1.0])).is_ok());
        // Normalised: float32-max minus the mean, over a std below 1, overflows float32.
        let norm = CFG.replace(
            "shape = [2]\n",
            "shape = [2]\nmean = [0.5, 0.5]\nstd = [0.25, 0.25]\n",
        );
        let p = plan(&norm).unwrap();
        let e = tokens(&p, &state_frame([f64::from(f32::MAX), 0.0])).unwrap_err();
        assert!(matches!(e, WireError::Overflows { .. }), "{e}");
        let allowed = CFG.replace("shape = [2]\n", "shape = [2]\nallow_non_finite = true\n");
        let p = plan(&allowed).unwrap();
        assert!(tokens(&p, &state_frame([f64::NAN, 1e308])).is_ok());
    }

    #[test]
    fn a_text_binding_receives_the_prompt_bytes_then_fill() {
        let p = plan(CFG).unwrap();
        assert_eq!(
            tokens(&p, &frame(&msgpack_str("hé"))).unwrap(),
            [104, 195, 169, -1, -1, -1, -1, -1]
        );
        assert_eq!(tokens(&p, &frame(&msgpack_str(""))).unwrap(), [-1; 8]);
        // numpy `<U3` (UTF-32), as openpi-client sends np.array("abc").
        let mut u = Vec::new();
        let mut e = Encoder { buf: &mut u };
        e.map(4);
        e.bin(b"__ndarray__");
        e.bool(true);
        e.bin(b"data");
        e.bin(&[b'a', 0, 0, 0, b'b', 0, 0, 0, 0xe9, 0, 0, 0]);
        e.bin(b"dtype");
        e.str("<U3");
        e.bin(b"shape");
        e.array(0);
        assert_eq!(
            tokens(&p, &frame(&u)).unwrap(),
            [97, 98, 195, 169, -1, -1, -1, -1]
        );
    }

    #[test]
    fn non_finite_outputs_are_named_as_sent() {
        use crate::protocol::dialect::Precision::{Configured, Float32};
        let p = plan(CFG).unwrap();
        let mut scratch = vec![0u8; p.scratch_bytes];
        let mut out = vec![0u8; 32];
        for precision in [Configured, Float32] {
            let check = |out: &Vec<u8>, scratch: &mut Vec<u8>| {
                p.non_finite_reply(std::slice::from_ref(out), scratch, &[], precision)
                    .map(str::to_string)
            };
            out.fill(0);
            assert_eq!(check(&out, &mut scratch), None);
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                out[12..16].copy_from_slice(&bad.to_le_bytes());
                assert_eq!(check(&out, &mut scratch).as_deref(), Some("actions"));
            }
        }
        // Finite engine output that overflows once un-normalised: 3e38 · (2 + 1e-6) + 0 is
        // past float32's range, so the float32 reply would carry inf; as float64 it is fine.
        let wide = CFG.replace(
            "[[outputs]]\ntensor = \"actions\"\n",
            "[[outputs]]\ntensor = \"actions\"\ndtype = \"float64\"\nmean = [0, 0]\nstd = [2, 2]\n",
        );
        let p = plan(&wide).unwrap();
        let mut scratch = vec![0u8; p.scratch_bytes];
        out.fill(0);
        out[12..16].copy_from_slice(&3e38f32.to_le_bytes());
        let mut sent = |precision| {
            p.non_finite_reply(std::slice::from_ref(&out), &mut scratch, &[], precision)
                .map(str::to_string)
        };
        assert_eq!(sent(Configured), None, "float64 holds 6e38");
        assert_eq!(
            sent(Float32).as_deref(),
            Some("actions"),
            "float32 does not"
        );
    }

    #[test]
    fn text_binding_errors_name_the_key() {
        let p = plan(CFG).unwrap();
        let e = tokens(&p, &frame(&msgpack_str("123456789"))).unwrap_err();
        assert!(
            matches!(e, WireError::TextTooLong { max: 8, got: 9, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("'prompt'"));
        let mut arr = Vec::new();
        Encoder { buf: &mut arr }.ndarray(ElemType::F32, &[1], 4, |d| d.fill(0));
        let e = tokens(&p, &frame(&arr)).unwrap_err();
        assert!(matches!(e, WireError::ExpectedText { .. }), "{e}");
        let mut bad = Vec::new();
        Encoder { buf: &mut bad }.bin(&[0xff, 0xfe]);
        let e = tokens(&p, &frame(&bad)).unwrap_err();
        assert!(matches!(e, WireError::BadText { .. }), "{e}");
    }

    #[test]
    fn text_bindings_are_checked_at_start_up() {
        let mixed = CFG.replace(r#"dtypes = ["text"]"#, r#"dtypes = ["text", "uint8"]"#);
        assert!(
            plan(&mixed)
                .unwrap_err()
                .to_string()
                .contains("inputs[1].dtypes")
        );
        let rank2 = CFG.replace("shape = [8]", "shape = [2, 4]");
        assert!(
            plan(&rank2)
                .unwrap_err()
                .to_string()
                .contains("inputs[1].shape")
        );
        let scaled = CFG.replace("fill = -1", "fill = -1\nscale = 2.0");
        assert!(plan(&scaled).is_err());
        let wrong_len = CFG.replace("shape = [8]", "shape = [9]");
        assert!(
            plan(&wrong_len)
                .unwrap_err()
                .to_string()
                .contains("inputs[1].shape")
        );
    }

    #[test]
    fn planner_bindings_are_checked_at_start_up() {
        let on = |extra: &str| {
            format!(
                "{CFG}\n[planner]\nenabled = true\nendpoints = [\"http://127.0.0.1:9\"]\n\
                 model = \"m\"\n{extra}"
            )
        };
        let p = plan(&on("")).expect("the prompt binding is a text binding");
        let tap = p.planner.as_ref().expect("a planner tap");
        assert_eq!((tap.prompt, tap.camera, tap.max_subtask), (1, None, 8));
        let err = |extra: &str| plan(&on(extra)).unwrap_err().to_string();
        assert!(err("prompt_key = \"state\"").contains("planner.prompt_key"));
        assert!(err("prompt_key = \"task\"").contains("\"state\", \"prompt\""));
        assert!(err("camera = \"state\"").contains("planner.camera"));
        assert!(err("camera = \"cam\"").contains("no input binding"));
    }

    #[test]
    fn the_subtask_fills_the_prompt_by_precedence() {
        use crate::planner::reply::Answer;
        // A plan and the link a planner feeds it through.
        let on = |precedence: &str| {
            let text = format!(
                "{CFG}\n[planner]\nenabled = true\nendpoints = [\"http://127.0.0.1:9\"]\n\
                 model = \"m\"\nprecedence = \"{precedence}\"\ninstruction = \"tidy up\""
            );
            let p = plan(&text).expect("plan");
            let cfg = Config::parse(&text, "test", None).expect("config");
            let link = p.planner.as_ref().expect("tap").link(&cfg.planner);
            (p, link)
        };
        let say = |(_, link): &(Plan, Link), s: &str| {
            link.publish(&Answer {
                subtask: s.into(),
                done: false,
            })
        };
        let tokens = |(p, link): &(Plan, Link), frame: &[u8]| tokens_with(p, Some(link), frame);
        let no_prompt = {
            let mut buf = Vec::new();
            let mut e = Encoder { buf: &mut buf };
            e.map(1);
            e.str("state");
            e.ndarray(ElemType::F64, &[2], 16, |d| d.fill(0));
            buf
        };
        let client = p_frame("go");
        let p = on("client");
        let e = tokens(&p, &no_prompt).unwrap_err();
        assert!(matches!(e, WireError::NoSubtaskYet { .. }), "{e}");
        say(&p, "ab");
        assert_eq!(tokens(&p, &no_prompt).expect("ok")[..3], [97, 98, -1]);
        assert_eq!(tokens(&p, &client).expect("ok")[..3], [103, 111, -1]);
        let p = on("planner");
        assert_eq!(tokens(&p, &client).expect("ok")[..3], [103, 111, -1]);
        let link = &p.1;
        assert_eq!(link.instruction().as_str(), "go");
        say(&p, "ab");
        assert_eq!(tokens(&p, &client).expect("ok")[..3], [97, 98, -1]);
    }

    fn p_frame(prompt: &str) -> Vec<u8> {
        frame(&msgpack_str(prompt))
    }
}
