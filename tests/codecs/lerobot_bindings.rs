//! Bindings for LeRobot policies (issue 29): LeRobot's normalisation modes (`eps`, `min`/`max`),
//! an output's kept `rows` (Diffusion's action slice) and per-session input `history`
//! (`n_obs_steps`), through `Config::parse`, `Plan::compile`, `Plan::decode`,
//! `Plan::stack_history` and the session table, against values written from LeRobot's formulas.
//! The exporter's tests (exporter/tests) check the same against LeRobot itself, end to end.

use policyd::bind::{History, Plan};
use policyd::config::Config;
use policyd::dtype::{ByteOrder, ElemType};
use policyd::engine::{HostBuffer, InputBuffer, IoSpec, TensorSpec};
use policyd::protocol::{Encoder, SessionId};
use policyd::runtime::session::Sessions;

fn spec(name: &str, dtype: ElemType, shape: &[usize]) -> TensorSpec {
    TensorSpec {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
    }
}

fn compile(cfg: &str, io: &IoSpec) -> Result<Plan, String> {
    let cfg = Config::parse(cfg, "test", None).map_err(|e| e.to_string())?;
    Plan::compile(&cfg, cfg.default_policy(), io).map_err(|e| e.to_string())
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// A request `{key: float64 array}` for each pair.
fn frame(values: &[(&str, &[f64])]) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut e = Encoder { buf: &mut buf };
    e.map(values.len() as u32);
    for (k, v) in values {
        e.str(k);
        e.ndarray(ElemType::F64, &[v.len()], 8 * v.len(), |d| {
            for (c, x) in d.chunks_exact_mut(8).zip(v.iter()) {
                c.copy_from_slice(&x.to_le_bytes());
            }
        });
    }
    buf
}

fn buffers(io: &IoSpec) -> Vec<Box<dyn InputBuffer>> {
    io.inputs
        .iter()
        .map(|s| Box::new(HostBuffer(vec![0; s.bytes()])) as Box<dyn InputBuffer>)
        .collect()
}

const STATE_IO: &str = r#"
[engine]
model = "m.onnx"
[[inputs]]
key = "observation.state"
tensor = "state"
dtypes = ["float64"]
shape = [3]
NORM
[[outputs]]
tensor = "action"
"#;

fn state_io() -> IoSpec {
    IoSpec {
        inputs: vec![spec("state", ElemType::F32, &[1, 3])],
        outputs: vec![spec("action", ElemType::F32, &[1, 4, 3])],
    }
}

/// The float32 actions a reply carries for the 4×3 engine output `engine`, after decoding the
/// state `x` (which relative actions read).
fn reply_actions(plan: &Plan, io: &IoSpec, x: [f64; 3], engine: &[f32]) -> Vec<f32> {
    use policyd::bind::{Chunk, ReplyParts};
    let mut bufs = buffers(io);
    for &bytes in &plan.host_buffers {
        bufs.push(Box::new(HostBuffer(vec![0; bytes])));
    }
    let mut seen = vec![false; 1];
    plan.decode(&frame(&[("observation.state", &x)]), &mut bufs, &mut seen)
        .unwrap();
    let outputs = vec![
        engine
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>(),
    ];
    let mut scratch = vec![0u8; plan.scratch_bytes];
    let mut none: [u8; 0] = [];
    let raw = match plan.relative_source {
        Some(source) => bufs[source].bytes_mut(),
        None => &mut none,
    };
    let mut parts = ReplyParts {
        outputs: &outputs,
        scratch: &mut scratch,
        chunk: Chunk { start: 0, end: 4 },
        raw,
    };
    f32s(plan.reply(&mut parts).rows_f32(0, 4).unwrap().0)
}

fn normalised(norm: &str, x: [f64; 3]) -> Vec<f32> {
    let io = state_io();
    let plan = compile(&STATE_IO.replace("NORM", norm), &io).unwrap();
    let mut bufs = buffers(&io);
    let mut seen = vec![false; 1];
    plan.decode(&frame(&[("observation.state", &x)]), &mut bufs, &mut seen)
        .unwrap();
    f32s(bufs[0].bytes_mut())
}

#[test]
fn min_max_inputs_are_lerobots_min_max() {
    // LeRobot: 2(x − min)/(max − min) − 1, with eps as the denominator where max == min.
    let (min, max, eps) = ([-2.0, 10.0, 5.0], [6.0, 30.0, 5.0], 1e-8);
    let x = [0.5, 29.0, 5.0 + 1e-9];
    let got = normalised("min = [-2.0, 10.0, 5.0]\nmax = [6.0, 30.0, 5.0]", x);
    for i in 0..3 {
        let d = if max[i] == min[i] {
            eps
        } else {
            max[i] - min[i]
        };
        let want = (2.0 * (x[i] - min[i]) / d - 1.0) as f32;
        assert!(
            (got[i] - want).abs() <= 1e-6 * want.abs().max(1.0),
            "{i}: {got:?}"
        );
    }
}

#[test]
fn mean_std_inputs_take_lerobots_epsilon() {
    let x = [1.0, 2.0, 3.0];
    let got = normalised(
        "mean = [0.5, 0.0, 3.0]\nstd = [2.0, 0.0, 1.0]\neps = 1e-8",
        x,
    );
    assert_eq!(got[0], 0.25);
    // A zero std divides by eps alone: LeRobot's (x − mean)/(std + eps).
    assert_eq!(got[1], (2.0 / 1e-8) as f32);
    assert_eq!(got[2], 0.0);
    // openpi's epsilon stays the default.
    let got = normalised("mean = [0.0, 0.0, 0.0]\nstd = [1.0, 1.0, 1.0]", x);
    assert_eq!(got[0], (1.0 / (1.0 + 1e-6)) as f32);
}

#[test]
fn outputs_unnormalise_as_lerobot_and_keep_their_rows() {
    let io = state_io();
    let out = |norm: &str| {
        let cfg = STATE_IO.replace("NORM", "").replace(
            "tensor = \"action\"",
            &format!("tensor = \"action\"\n{norm}"),
        );
        let plan = compile(&cfg, &io).unwrap();
        let o = &plan.outputs[0];
        // Engine output: 4 rows of 3, value 0.1·k.
        let raw: Vec<u8> = (0..12)
            .flat_map(|k| (0.1 * k as f32).to_le_bytes())
            .collect();
        let src = &raw[o.offset..o.offset + o.configured.src_len * 4];
        let mut dst = vec![0u8; o.configured.dst_bytes()];
        assert!(o.configured.apply(src, ByteOrder::Little, &mut dst));
        (o.shape.clone(), f32s(&dst))
    };
    // MEAN_STD out: x·std + mean, no epsilon.
    let (shape, v) = out("mean = [1.0, 2.0, 3.0]\nstd = [10.0, 20.0, 30.0]\neps = 0.0");
    assert_eq!(shape, vec![4, 3]);
    assert_eq!(v[4], 0.4f32 * 20.0 + 2.0);
    // MIN_MAX out: (x + 1)/2 · (max − min) + min; rows [1, 3) of 4.
    let (shape, v) = out("min = [-1.0, 0.0, 4.0]\nmax = [3.0, 10.0, 4.0]\nrows = [1, 3]");
    assert_eq!(shape, vec![2, 3]);
    let want = |x: f32, lo: f64, hi: f64, eps: f64| {
        let d = if hi == lo { eps } else { hi - lo };
        ((x as f64 + 1.0) / 2.0 * d + lo) as f32
    };
    for (i, got) in v.iter().enumerate() {
        let (row, col) = (1 + i / 3, i % 3);
        let x = 0.1 * (row * 3 + col) as f32;
        let (lo, hi) = [(-1.0, 3.0), (0.0, 10.0), (4.0, 4.0)][col];
        let w = want(x, lo, hi, 1e-8);
        assert!(
            (got - w).abs() <= 1e-6 * w.abs().max(1.0),
            "{i}: {got} vs {w}"
        );
    }
}

#[test]
fn normalisation_keys_are_checked_naming_the_key() {
    let io = state_io();
    let err = |norm: &str| compile(&STATE_IO.replace("NORM", norm), &io).unwrap_err();
    let e = err("mean = [0.0]\nstd = [1.0]\nmin = [0.0]\nmax = [1.0]");
    assert!(e.contains("inputs[0].min") && e.contains("one pair"), "{e}");
    let e = err("min = [0.0, 0.0, 2.0]\nmax = [1.0, 1.0, 1.0]");
    assert!(e.contains("inputs[0].max") && e.contains("below"), "{e}");
    let e = err("min = [0.0, 0.0]\nmax = [1.0, 1.0]");
    assert!(e.contains("inputs[0].min") && e.contains("2 values"), "{e}");
    let e = err("min = [0.0]\nmax = [1.0, 2.0]");
    assert!(e.contains("inputs[0].min"), "{e}");
    let e = err("mean = [0.0]\nstd = [1.0]\neps = -1.0");
    assert!(
        e.contains("inputs[0].eps") && e.contains("non-negative"),
        "{e}"
    );
    let e = err("mean = [0.0]\nstd = [0.0]\neps = 0.0");
    assert!(e.contains("inputs[0].std") && e.contains("positive"), "{e}");
    let e = err("min = [1.0]\nmax = [1.0]\neps = 0.0");
    assert!(e.contains("inputs[0].eps"), "{e}");
    let e = err("history = 0");
    assert!(e.contains("inputs[0].history"), "{e}");
    let e = err("history = 17");
    assert!(e.contains("inputs[0].history"), "{e}");
    // With history the engine input must hold that many frames, and the error says so.
    let e = err("history = 2");
    assert!(
        e.contains("inputs[0].shape") && e.contains("history = 2"),
        "{e}"
    );
    let out = |o: &str| {
        compile(
            &STATE_IO
                .replace("NORM", "")
                .replace("tensor = \"action\"", &format!("tensor = \"action\"\n{o}")),
            &io,
        )
        .unwrap_err()
    };
    let e = out("rows = [2, 2]");
    assert!(
        e.contains("outputs[0].rows") && e.contains("start < end"),
        "{e}"
    );
    let e = out("rows = [1, 5]");
    assert!(
        e.contains("outputs[0].rows") && e.contains("exceeds"),
        "{e}"
    );
    let e = out("min = [0.0]\nmax = [1.0]\nmean = [0.0]\nstd = [1.0]");
    assert!(e.contains("outputs[0].min"), "{e}");
}

const HISTORY: &str = r#"
[engine]
model = "m.onnx"
[[inputs]]
key = "observation.state"
tensor = "state"
dtypes = ["float64"]
shape = [2]
history = 3
[[inputs]]
key = "other"
tensor = "other"
dtypes = ["float64"]
shape = [1]
[[outputs]]
tensor = "action"
"#;

#[test]
fn history_stacks_a_sessions_frames_as_lerobots_queues() {
    let io = IoSpec {
        inputs: vec![
            spec("state", ElemType::F32, &[1, 3, 2]),
            spec("other", ElemType::F32, &[1, 1]),
        ],
        outputs: vec![spec("action", ElemType::F32, &[1, 4, 2])],
    };
    let plan = compile(HISTORY, &io).unwrap();
    assert_eq!(plan.history_bytes, 2 * 2 * 4);
    let mut sessions = Sessions::new(4, 8);
    let mut bufs = buffers(&io);
    let mut seen = vec![false; 2];
    let a = SessionId::try_from("a").unwrap();
    let b = SessionId::try_from("b").unwrap();
    let mut run = |sessions: &mut Sessions, id: &SessionId, x: f64| {
        plan.decode(
            &frame(&[("observation.state", &[x, -x]), ("other", &[7.0])]),
            &mut bufs,
            &mut seen,
        )
        .unwrap();
        let (fresh, _) = sessions.begin(Some(id));
        plan.stack_history(&mut bufs, sessions.history(Some(id)), fresh);
        let other = f32s(bufs[1].bytes_mut());
        assert_eq!(
            other,
            vec![7.0],
            "an input without history is left as decoded"
        );
        f32s(bufs[0].bytes_mut())
    };
    // A session's first frame fills every position (populate_queues), then each request
    // shifts in one frame, oldest first.
    assert_eq!(run(&mut sessions, &a, 1.0), [1., -1., 1., -1., 1., -1.]);
    assert_eq!(run(&mut sessions, &a, 2.0), [1., -1., 1., -1., 2., -2.]);
    // Another session on the same connection has its own frames.
    assert_eq!(run(&mut sessions, &b, 9.0), [9., -9., 9., -9., 9., -9.]);
    assert_eq!(run(&mut sessions, &a, 3.0), [1., -1., 2., -2., 3., -3.]);
    assert_eq!(run(&mut sessions, &a, 4.0), [2., -2., 3., -3., 4., -4.]);
    // A reset starts the queue afresh.
    sessions.reset(Some(&a));
    assert_eq!(run(&mut sessions, &a, 5.0), [5., -5., 5., -5., 5., -5.]);
    assert_eq!(run(&mut sessions, &b, 8.0), [9., -9., 9., -9., 8., -8.]);
}

#[test]
fn a_history_taken_for_another_plan_starts_afresh() {
    let io = IoSpec {
        inputs: vec![
            spec("state", ElemType::F32, &[1, 3, 2]),
            spec("other", ElemType::F32, &[1, 1]),
        ],
        outputs: vec![spec("action", ElemType::F32, &[1, 4, 2])],
    };
    let first = compile(HISTORY, &io).unwrap();
    let second = compile(HISTORY, &io).unwrap();
    let mut history = History::default();
    let mut bufs = buffers(&io);
    let mut seen = vec![false; 2];
    let mut run = |plan: &Plan, history: &mut History, x: f64| {
        plan.decode(
            &frame(&[("observation.state", &[x, x]), ("other", &[0.0])]),
            &mut bufs,
            &mut seen,
        )
        .unwrap();
        plan.stack_history(&mut bufs, history, false);
        f32s(bufs[0].bytes_mut())
    };
    assert_eq!(run(&first, &mut history, 1.0), [1.0; 6]);
    assert_eq!(run(&first, &mut history, 2.0), [1., 1., 1., 1., 2., 2.]);
    // A reload compiles a new plan: its frames are not the old plan's.
    assert_eq!(run(&second, &mut history, 3.0), [3.0; 6]);
}

/// Relative actions (LeRobot's `use_relative_actions`, openpi's `DeltaActions`): the reply's
/// masked columns are the un-normalised output plus the state as the request sent it.
#[test]
fn relative_actions_add_the_state_as_sent_to_the_masked_columns() {
    use policyd::bind::{Chunk, ReplyParts};
    let io = state_io();
    let cfg = STATE_IO
        .replace(
            "NORM",
            "mean = [1.0, 2.0, 3.0]\nstd = [2.0, 2.0, 2.0]\neps = 1e-8",
        )
        .replace(
            "tensor = \"action\"",
            "tensor = \"action\"\nmean = [10.0, 20.0, 30.0]\nstd = [0.5, 0.5, 0.5]\neps = 0.0\n\
             relative_to = \"observation.state\"\nrelative_mask = [true, false, true]",
        );
    let plan = compile(&cfg, &io).unwrap();
    let source = plan
        .relative_source
        .expect("a slot buffer for the state as sent");
    let mut bufs = buffers(&io);
    for &bytes in &plan.host_buffers {
        bufs.push(Box::new(HostBuffer(vec![0; bytes])));
    }
    let mut seen = vec![false; 1];
    let x = [1.5, -2.25, 7.125];
    plan.decode(&frame(&[("observation.state", &x)]), &mut bufs, &mut seen)
        .unwrap();
    // The engine saw the normalised state; the slot kept the raw one.
    assert_eq!(f32s(bufs[0].bytes_mut())[0], 0.25);
    let engine: Vec<u8> = (0..12)
        .flat_map(|k| (0.1 * k as f32).to_le_bytes())
        .collect();
    let outputs = vec![engine];
    let mut scratch = vec![0u8; plan.scratch_bytes];
    let raw = bufs[source].bytes_mut();
    let mut parts = ReplyParts {
        outputs: &outputs,
        scratch: &mut scratch,
        chunk: Chunk { start: 0, end: 4 },
        raw,
    };
    let mut reply = plan.reply(&mut parts);
    let (rows, row) = reply.rows_f32(0, 4).unwrap();
    assert_eq!(row, 12);
    let got = f32s(rows);
    for r in 0..4 {
        for j in 0..3 {
            let k = r * 3 + j;
            let mut want = (0.1 * k as f32) as f64 * 0.5 + [10.0, 20.0, 30.0][j];
            let mut want32 = want as f32;
            if j != 1 {
                want32 += x[j] as f32;
                want += x[j];
            }
            assert_eq!(got[k], want32, "row {r} column {j}");
            assert!((f64::from(got[k]) - want).abs() < 1e-5);
        }
    }
    // The openpi route's encoded reply carries the same values.
    let mut out = Vec::new();
    let mut scratch = vec![0u8; plan.scratch_bytes];
    let mut parts = ReplyParts {
        outputs: &outputs,
        scratch: &mut scratch,
        chunk: Chunk { start: 0, end: 4 },
        raw: bufs[source].bytes_mut(),
    };
    policyd::protocol::Dialect::Openpi.encode_infer(
        &mut plan.reply(&mut parts),
        &policyd::protocol::Timing {
            policy_infer_ms: 1.0,
            server_infer_ms: 1.0,
            prev_total_ms: None,
            stages: None,
        },
        None,
        &mut out,
    );
    let first = (0.0f32 as f64 * 0.5 + 10.0) as f32 + 1.5f32;
    assert!(
        out.windows(4).any(|w| w == first.to_le_bytes()),
        "the first action {first} is in the reply"
    );
}

/// `[[outputs]] scale`/`offset` after un-normalising, before the relative offset: openpi
/// ALOHA's joint sign flips (a negative scale) and its affine gripper map back.
#[test]
fn outputs_scale_and_offset_after_unnormalising() {
    let io = state_io();
    let cfg = STATE_IO.replace("NORM", "").replace(
        "tensor = \"action\"",
        "tensor = \"action\"\nmean = [10.0, 20.0, 30.0]\nstd = [0.5, 0.5, 0.5]\neps = 1e-6\n\
         scale = [-1.0, 1.0, 0.5]\noffset = [0.0, 0.0, 3.0]\n\
         relative_to = \"observation.state\"\nrelative_mask = [true]",
    );
    let plan = compile(&cfg, &io).unwrap();
    let x = [1.5, -2.25, 7.125];
    let engine: Vec<f32> = (0..12).map(|k| 0.1 * k as f32).collect();
    let got = reply_actions(&plan, &io, x, &engine);
    for r in 0..4 {
        for j in 0..3 {
            let v = f64::from(0.1 * (r * 3 + j) as f32);
            let y = v * (0.5 + 1e-6) + [10.0, 20.0, 30.0][j];
            let want =
                y * [-1.0, 1.0, 0.5][j] + [0.0, 0.0, 3.0][j] + if j == 0 { x[0] } else { 0.0 };
            assert!(
                (f64::from(got[r * 3 + j]) - want).abs() < 1e-5,
                "row {r} column {j}"
            );
        }
    }
    // Lengths that do not agree are refused, naming the key.
    let bad = cfg.replace("scale = [-1.0, 1.0, 0.5]", "scale = [-1.0, 1.0]");
    let e = compile(&bad, &io).unwrap_err();
    assert!(
        e.contains("outputs[0].scale") && e.contains("has 2 values"),
        "{e}"
    );
}

/// `clip`: GR00T's state is clipped to [−1, 1] after its q01/q99 min-max, and its actions
/// before the min-max back. Inputs clamp the normalised values; outputs clamp the engine's
/// values before un-normalising (done on the reply with the bounds mapped through the affine
/// map, which is the same for a monotone map per column).
#[test]
fn clip_clamps_normalised_inputs_and_engine_outputs() {
    // min/max [0, 2]: x ↦ x − 1; then clamped to [−1, 1].
    let got = normalised(
        "min = [0.0, 0.0, 0.0]\nmax = [2.0, 2.0, 2.0]\nclip = [-1.0, 1.0]",
        [-3.0, 1.5, 7.0],
    );
    assert_eq!(got, [-1.0, 0.5, 1.0]);
    let io = state_io();
    let cfg = STATE_IO.replace("NORM", "").replace(
        "tensor = \"action\"",
        "tensor = \"action\"\nmin = [0.0, 10.0, -4.0]\nmax = [2.0, 20.0, 4.0]\nclip = [-1.0, 1.0]",
    );
    let plan = compile(&cfg, &io).unwrap();
    let engine: Vec<f32> = [-2.0f32, 0.5, 3.0]
        .iter()
        .cycle()
        .take(12)
        .copied()
        .collect();
    let got = reply_actions(&plan, &io, [0.0; 3], &engine);
    // (clip(x) + 1)/2·(max − min) + min: −2 → −1 → min, 0.5 → 17.5, 3 → 1 → max.
    assert_eq!(&got[..3], [0.0, 17.5, 4.0]);
    assert_eq!(got[..3], got[9..]);
    // Refused, naming the key: an empty range, text, an integer engine input.
    let e = compile(
        &cfg.replace("clip = [-1.0, 1.0]", "clip = [1.0, -1.0]"),
        &io,
    )
    .unwrap_err();
    assert!(
        e.contains("outputs[0].clip") && e.contains("lo < hi"),
        "{e}"
    );
    let int_io = IoSpec {
        inputs: vec![spec("state", ElemType::I32, &[1, 3])],
        outputs: state_io().outputs,
    };
    let e = compile(&STATE_IO.replace("NORM", "clip = [-1.0, 1.0]"), &int_io).unwrap_err();
    assert!(
        e.contains("inputs[0].clip") && e.contains("float32 or float64"),
        "{e}"
    );
}

#[test]
fn relative_actions_are_checked_against_the_bindings() {
    let io = state_io();
    let with = |lines: &str| {
        compile(
            &STATE_IO.replace("NORM", "").replace(
                "tensor = \"action\"",
                &format!("tensor = \"action\"\n{lines}"),
            ),
            &io,
        )
        .map(|_| ())
    };
    assert!(
        with("relative_to = \"observation.state\"").is_ok(),
        "every column"
    );
    for (lines, says) in [
        (
            "relative_to = \"state\"",
            "no [[inputs]] binding has key \"state\"",
        ),
        (
            "relative_to = \"observation.state\"\nrelative_mask = [true, true, true, true]",
            "outputs[0].relative_mask",
        ),
        ("relative_mask = [true]", "needs relative_to"),
        (
            "relative_to = \"observation.state\"\nrelative_mask = []",
            "must not be empty",
        ),
    ] {
        let e = with(lines).unwrap_err();
        assert!(e.contains(says), "{lines}: {e}");
    }
}

/// A LeRobot observation's frames are held in a table of `MAX_LEROBOT_CAMERAS`: a policy that
/// reads more cameras is refused when its LeRobot fit is taken (at start-up), not served with
/// frames dropped.
#[test]
fn more_cameras_than_the_lerobot_table_holds_are_refused() {
    use policyd::limits::MAX_LEROBOT_CAMERAS;
    let fit = |n: usize| {
        let mut cfg = String::from("[engine]\nmodel = \"synthetic\"\n");
        let mut inputs = Vec::new();
        for i in 0..n {
            cfg += &format!(
                "[[inputs]]\nkey = \"observation.images.c{i}\"\ntensor = \"c{i}\"\n\
                 dtypes = [\"uint8\"]\nshape = [2, 2, 3]\n"
            );
            inputs.push(spec(&format!("c{i}"), ElemType::U8, &[2, 2, 3]));
        }
        cfg += "[[outputs]]\ntensor = \"actions\"\n";
        let io = IoSpec {
            inputs,
            outputs: vec![spec("actions", ElemType::F32, &[1, 4, 2])],
        };
        compile(&cfg, &io).expect("compiles").lerobot_fit()
    };
    assert_eq!(
        fit(MAX_LEROBOT_CAMERAS).expect("fits").cameras.len(),
        MAX_LEROBOT_CAMERAS
    );
    let e = fit(MAX_LEROBOT_CAMERAS + 1).expect_err("one camera too many");
    assert!(e.contains("at most 16"), "{e}");
}

/// `present_tensor`: openpi's ALOHA masks a wrist camera the robot leaves out. The flag input
/// is 1 when the request sent the key, 0 when it was filled, on every request (a slot's
/// buffers are reused); misuse is refused naming the key.
#[test]
fn present_tensor_says_whether_an_optional_input_was_sent() {
    let io = IoSpec {
        inputs: vec![
            spec("state", ElemType::F32, &[1, 3]),
            spec("wrist", ElemType::F32, &[1, 2]),
            spec("wrist_present", ElemType::Bool, &[1]),
        ],
        outputs: state_io().outputs,
    };
    let wrist = "[[inputs]]\nkey = \"wrist\"\ntensor = \"wrist\"\ndtypes = [\"float64\"]\n\
                 shape = [2]\noptional = true\nfill = -1.0\nWRIST\n";
    let cfg = |extra: &str| {
        STATE_IO.replace("NORM", "").replace(
            "[[outputs]]",
            &format!("{}[[outputs]]", wrist.replace("WRIST", extra)),
        )
    };
    let plan = compile(&cfg("present_tensor = \"wrist_present\""), &io).unwrap();
    let mut bufs = buffers(&io);
    let mut seen = vec![false; 2];
    let mut run = |values: &[(&str, &[f64])]| {
        plan.decode(&frame(values), &mut bufs, &mut seen).unwrap();
        (f32s(bufs[1].bytes_mut()), bufs[2].bytes_mut()[0])
    };
    let state: &[f64] = &[1.0, 2.0, 3.0];
    assert_eq!(
        run(&[("observation.state", state), ("wrist", &[0.5, 0.25])]),
        (vec![0.5, 0.25], 1)
    );
    assert_eq!(run(&[("observation.state", state)]), (vec![-1.0, -1.0], 0));
    assert_eq!(
        run(&[("observation.state", state), ("wrist", &[2.0, 3.0])]),
        (vec![2.0, 3.0], 1)
    );
    // Without the binding's flag the model input is unbound.
    let e = compile(&cfg(""), &io).unwrap_err();
    assert!(
        e.contains("'wrist_present'") && e.contains("no [[inputs]] binding"),
        "{e}"
    );
    for (extra, want) in [
        ("present_tensor = \"nope\"", "the model has no input 'nope'"),
        (
            "present_tensor = \"state\"",
            "already fed by another binding",
        ),
        (
            "present_tensor = \"wrist\"",
            "another model input than this binding's tensor",
        ),
    ] {
        let e = compile(&cfg(extra), &io).unwrap_err();
        assert!(
            e.contains("inputs[1].present_tensor") && e.contains(want),
            "{extra}: {e}"
        );
    }
    let required = cfg("present_tensor = \"wrist_present\"").replace("optional = true\n", "");
    let e = compile(&required, &io).unwrap_err();
    assert!(
        e.contains("inputs[1].present_tensor") && e.contains("optional = true"),
        "{e}"
    );
    let wide = IoSpec {
        inputs: vec![
            io.inputs[0].clone(),
            io.inputs[1].clone(),
            spec("wrist_present", ElemType::Bool, &[2]),
        ],
        outputs: io.outputs.clone(),
    };
    let e = compile(&cfg("present_tensor = \"wrist_present\""), &wide).unwrap_err();
    assert!(e.contains("a presence flag is one element"), "{e}");
}

/// openpi's ALOHA state decode before its normalisation, as pi0.5 puts the state in the prompt:
/// joint sign flips (`scale` per feature) and the gripper's arcsin map (`map`), then the
/// statistics, `(g(x·scale + offset) − mean)/(std + eps)`; misuse refused naming the key.
#[test]
fn feature_maps_run_between_the_scale_and_the_statistics() {
    use policyd::transform::FeatureMap;
    let g = FeatureMap::AlohaGripperToAngular;
    // openpi's `_gripper_to_angular` on float64, printed by numpy 2.3: past the linear
    // position's zero (x < −0.466) its arcsin is clipped the other way, as openpi's is.
    for (x, numpy) in [
        (0.0, -1.0798655475132917),
        (0.25, -0.5130776068814178),
        (0.7, 0.14593607285524643),
        (1.0, 0.945652797407483),
        (-0.47, 0.945652797407483),
        (-2.0, -1.9578524277217162),
    ] {
        assert_eq!(g.apply(x), numpy, "x = {x}");
    }
    let norm = "scale = [1.0, -1.0, 1.0]\noffset = 0.5\nmean = [0.1, 0.2, 0.3]\n\
                std = [1.0, 2.0, 0.5]\nmap = { function = \"aloha_gripper_to_angular\", \
                columns = [2] }";
    let got = normalised(norm, [0.25, 0.75, 0.2]);
    let want = [
        ((0.25 + 0.5 - 0.1) / (1.0 + 1e-6)) as f32,
        ((-0.75 + 0.5 - 0.2) / (2.0 + 1e-6)) as f32,
        ((g.apply(0.7) - 0.3) / (0.5 + 1e-6)) as f32,
    ];
    assert_eq!(got, want);
    // Without the map the third feature is affine.
    let plain = normalised(&norm.replace("map = {", "# map = {"), [0.25, 0.75, 0.2]);
    assert_eq!(plain[2], ((0.7 - 0.3) / (0.5 + 1e-6)) as f32);
    let io = state_io();
    for (bad, key, want) in [
        (
            norm.replace("aloha_gripper_to_angular", "nope"),
            "inputs[0].map.function",
            "known: aloha_gripper_to_angular",
        ),
        (
            norm.replace("columns = [2]", "columns = [3]"),
            "inputs[0].map.columns",
            "0 to 2",
        ),
        (
            norm.replace("scale = [1.0, -1.0, 1.0]", "scale = [1.0, -1.0]"),
            "inputs[0].scale",
            "has 2 values",
        ),
        (
            norm.replace("offset = 0.5", "offset = nan"),
            "inputs[0].offset",
            "finite",
        ),
        (
            norm.replace("offset = 0.5", "offset = \"half\""),
            "offset = \"half\"",
            "a number, or numbers, for scale and offset",
        ),
        (
            norm.replace("mean = [0.1, 0.2, 0.3]", "mean = [0.1]")
                .replace("std = [1.0, 2.0, 0.5]", "std = [1.0]"),
            "",
            "",
        ),
    ] {
        let r = compile(&STATE_IO.replace("NORM", &bad), &io);
        if key.is_empty() {
            // One mean and std for every feature, mapped or not, is fine.
            assert!(r.is_ok(), "{bad}: {:?}", r.err());
            continue;
        }
        let e = r.unwrap_err();
        assert!(e.contains(key) && e.contains(want), "{bad}: {e}");
    }
}

/// Issue 49, item 6: the config gaps a hostile or mistaken config found, each refused naming
/// its key: a third `clip` value (serde's fixed arrays dropped it), a `map.columns` longer
/// than the features (2,000,000 indices were accepted), 200,000 `state_key` names (26 s to
/// refuse, quadratic), and one bare `scale` on an output (serde's "expected a sequence", though
/// the key takes one value or a list).
#[test]
fn config_gaps_are_refused_naming_the_key_or_accepted_as_documented() {
    let io = state_io();
    let out = |lines: &str| {
        STATE_IO.replace("NORM", "").replace(
            "tensor = \"action\"",
            &format!("tensor = \"action\"\n{lines}"),
        )
    };
    let e = compile(&out("clip = [1.0, 2.0, 3.0]"), &io).unwrap_err();
    assert!(
        e.contains("outputs[0].clip") && e.contains("3 values"),
        "{e}"
    );
    let e = compile(&STATE_IO.replace("NORM", "clip = [-1.0, 0.0, 1.0]"), &io).unwrap_err();
    assert!(
        e.contains("inputs[0].clip") && e.contains("3 values"),
        "{e}"
    );
    let e = compile(&out("rows = [0, 2, 4]"), &io).unwrap_err();
    assert!(
        e.contains("outputs[0].rows") && e.contains("3 values"),
        "{e}"
    );
    let columns = vec!["0"; 2_000_000].join(", ");
    let map = format!("map = {{ function = \"aloha_gripper_to_angular\", columns = [{columns}] }}");
    let e = compile(&STATE_IO.replace("NORM", &map), &io).unwrap_err();
    assert!(e.contains("inputs[0].map.columns"), "{e}");
    let twice = "map = { function = \"aloha_gripper_to_angular\", columns = [1, 1] }";
    let e = compile(&STATE_IO.replace("NORM", twice), &io).unwrap_err();
    assert!(
        e.contains("inputs[0].map.columns") && e.contains("twice"),
        "{e}"
    );
    // One bare value on an output's scale and offset: one for every column.
    let plan = compile(&out("scale = 2.0\noffset = 0.5"), &io).unwrap();
    let got = reply_actions(&plan, &io, [0.0; 3], &[1.0; 12]);
    assert!(got.iter().all(|&v| v == 2.5), "{got:?}");
    let e = compile(&out("scale = inf"), &io).unwrap_err();
    assert!(e.contains("scale"), "{e}");
}

#[test]
fn many_state_keys_are_refused_at_once() {
    let keys = (0..200_000)
        .map(|i| format!("\"k{i}\""))
        .collect::<Vec<_>>()
        .join(", ");
    let cfg = format!(
        "[engine]\nmodel = \"m.onnx\"\n\
         [[inputs]]\nkey = \"prompt\"\ntensor = \"ids\"\ndtypes = [\"text\"]\n\
         [inputs.tokenizer]\nfile = \"t.model\"\nformat = \"pi05\"\nmax_tokens = 8\n\
         mask_tensor = \"mask\"\nstate_key = [{keys}]\n\
         [[outputs]]\ntensor = \"actions\"\n"
    );
    let start = std::time::Instant::now();
    let e = Config::parse(&cfg, "test", None)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("state_key") && e.contains("200000"), "{e}");
    assert!(
        start.elapsed() < std::time::Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
}
