//! Pipelines (`[denoise]` + `[sampler]`) through their public pieces, with synthetic engines:
//! the config's errors and the wiring's, each naming its key or both ends; the loop's seed,
//! steps and stages; a step graph's NaN as an engine failure. The numbers themselves are
//! checked against openpi's and diffusers' formulas in `src/sampler.rs` and, end to end, by
//! tests/interop/test_pipelines.py.

use policyd::config::Config;
use policyd::dtype::ElemType;
use policyd::engine::pipeline::Pipeline;
use policyd::engine::{Engine, InputBuffer, IoSpec, Sampling, TensorSpec};
use policyd::testing::synthetic::{Behaviour, SyntheticEngine};

fn spec(name: &str, dtype: ElemType, shape: &[usize]) -> TensorSpec {
    TensorSpec {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
    }
}

const BASE: &str = r#"
[engine]
model = "prefix.onnx"
[denoise]
model = "step.onnx"
wire = { feat = "features" }
[sampler]
kind = "flow"
steps = 4
max_steps = 8
x = "x"
time = "t"
output = "v"
[[inputs]]
key = "state"
tensor = "state"
dtypes = ["float32"]
shape = [8]
[[outputs]]
tensor = "x"
"#;

fn prefix() -> Box<dyn Engine> {
    Box::new(SyntheticEngine::new(
        IoSpec {
            inputs: vec![spec("state", ElemType::F32, &[1, 8])],
            outputs: vec![spec("features", ElemType::F32, &[1, 4])],
        },
        Behaviour::default(),
    ))
}

/// The step graph: the synthetic engine's outputs are its first input's first value plus
/// k/1000, so the velocity is `feat[0] + k/1000` whatever x and t are.
fn step(inputs: Vec<TensorSpec>, out: TensorSpec) -> Box<dyn Engine> {
    Box::new(SyntheticEngine::new(
        IoSpec {
            inputs,
            outputs: vec![out],
        },
        Behaviour::default(),
    ))
}

fn good_step() -> Box<dyn Engine> {
    step(
        vec![
            spec("feat", ElemType::F32, &[1, 4]),
            spec("x", ElemType::F32, &[1, 10, 7]),
            spec("t", ElemType::F32, &[1]),
        ],
        spec("v", ElemType::F32, &[1, 10, 7]),
    )
}

fn pipeline(text: &str, step: Box<dyn Engine>) -> Result<Pipeline, String> {
    let cfg = Config::parse(text, "test", None).map_err(|e| e.to_string())?;
    let p = cfg.default_policy().pipeline.clone().expect("a pipeline");
    Pipeline::new(prefix(), step, &p).map_err(|e| e.to_string())
}

fn run(
    p: &mut Pipeline,
    sampling: Sampling,
) -> Result<(Vec<f32>, policyd::engine::RunStats), String> {
    let mut inputs = p.alloc_inputs().unwrap();
    for b in inputs.iter_mut() {
        for (k, c) in b.bytes_mut().chunks_exact_mut(4).enumerate() {
            c.copy_from_slice(&(0.5 + k as f32).to_le_bytes());
        }
    }
    let mut outputs = vec![vec![0u8; 280]];
    let stats = p
        .run_sampled(&mut inputs, &mut outputs, false, sampling, None)
        .map_err(|e| e.to_string())?;
    let x = outputs[0]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    Ok((x, stats))
}

#[test]
fn the_loop_is_a_function_of_seed_and_steps() {
    let mut p = pipeline(BASE, good_step()).unwrap();
    assert_eq!(p.io().outputs, vec![spec("x", ElemType::F32, &[1, 10, 7])]);
    assert_eq!(p.io().inputs, vec![spec("state", ElemType::F32, &[1, 8])]);
    let s = |seed, steps| Sampling { seed, steps };
    let (a, stats) = run(&mut p, s(1, 4)).unwrap();
    let stages = stats.stages.expect("stages");
    assert_eq!(stages.steps, 4);
    assert_eq!(run(&mut p, s(1, 4)).unwrap().0, a);
    assert_ne!(run(&mut p, s(2, 4)).unwrap().0, a);
    assert_ne!(run(&mut p, s(1, 2)).unwrap().0, a);
    // The prefix wrote 0.5 (its first input's first value), so v = 0.5 + k/1000 and after
    // the whole flow from t = 1 to 0: x = noise − v.
    let (x1, _) = run(&mut p, s(9, 1)).unwrap();
    let (x8, _) = run(&mut p, s(9, 8)).unwrap();
    for k in 0..70 {
        let v = 0.5 + k as f32 / 1000.0;
        assert!(
            (x1[k] - x8[k]).abs() < 1e-4,
            "Euler steps of a constant velocity agree"
        );
        let mut noise = policyd::sampler::Noise::new(9);
        let n: Vec<f32> = (0..70).map(|_| noise.draw()).collect();
        assert!(
            (x1[k] - (n[k] - v)).abs() < 1e-5,
            "{} vs {}",
            x1[k],
            n[k] - v
        );
    }
    // Steps past max_steps are clamped (the connection refuses them before).
    assert_eq!(run(&mut p, s(3, 99)).unwrap().1.stages.unwrap().steps, 8);
}

#[test]
fn a_step_graph_producing_nan_fails_the_run() {
    let nan_step = Box::new(SyntheticEngine::new(
        IoSpec {
            inputs: vec![
                spec("feat", ElemType::F32, &[1, 4]),
                spec("x", ElemType::F32, &[1, 10, 7]),
                spec("t", ElemType::F32, &[1]),
            ],
            outputs: vec![spec("v", ElemType::F32, &[1, 10, 7])],
        },
        Behaviour::default(),
    ));
    let mut p = pipeline(BASE, nan_step).unwrap();
    let mut inputs = p.alloc_inputs().unwrap();
    inputs[0].bytes_mut()[..4].copy_from_slice(&f32::NAN.to_le_bytes());
    let mut outputs = vec![vec![0u8; 280]];
    let e = p
        .run_sampled(
            &mut inputs,
            &mut outputs,
            false,
            Sampling { seed: 1, steps: 4 },
            None,
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("step 1 of 4") && e.contains("'v'") && e.contains("NaN"),
        "{e}"
    );
}

#[test]
fn injected_noise_is_the_initial_sample() {
    let text = BASE.replace("[sampler]\n", "[sampler]\ninject_noise = true\n");
    let mut p = pipeline(&text, good_step()).unwrap();
    assert_eq!(p.io().inputs.len(), 2);
    assert_eq!(p.io().inputs[1], spec("x", ElemType::F32, &[1, 10, 7]));
    let mut inputs: Vec<Box<dyn InputBuffer>> = p.alloc_inputs().unwrap();
    inputs[0].bytes_mut().fill(0);
    for (k, c) in inputs[1].bytes_mut().chunks_exact_mut(4).enumerate() {
        c.copy_from_slice(&(k as f32).to_le_bytes());
    }
    let mut outputs = vec![vec![0u8; 280]];
    p.run_sampled(
        &mut inputs,
        &mut outputs,
        false,
        Sampling { seed: 5, steps: 4 },
        None,
    )
    .unwrap();
    let x: Vec<f32> = outputs[0]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    for (k, v) in x.iter().enumerate() {
        let want = k as f32 - k as f32 / 1000.0;
        assert!((v - want).abs() < 1e-4, "{k}: {v} vs {want}");
    }
}

/// `[rtc]`: the loop guides each step's velocity towards the leftover with LeRobot's formula
/// (`policyd::rtc`, pinned to LeRobot's values there) at LeRobot's times, then takes the Euler
/// step; without a leftover it is the plain loop; a horizon longer than the chunk is refused.
#[test]
fn a_continued_chunk_is_guided_towards_the_leftover_at_each_step() {
    use policyd::engine::Continuation;
    use policyd::rtc::{Request, Schedule, guidance_weight, guide, prefix_weights};
    let text = BASE
        .replace("[sampler]\n", "[sampler]\nflow_time = \"lerobot\"\n")
        .replace(
            "[[inputs]]",
            "[rtc]\nexecution_horizon = 6\nmax_guidance_weight = 4.0\n[[inputs]]",
        );
    let mut p = pipeline(&text, good_step()).unwrap();
    let plain = run(&mut p, Sampling { seed: 4, steps: 4 }).unwrap().0;
    // A leftover of 3 real rows (the horizon's other 3 zero), in the sample's layout.
    let mut leftover = vec![0f32; 70];
    for (k, v) in leftover[..21].iter_mut().enumerate() {
        *v = 2.0 - k as f32 / 10.0;
    }
    let mut inputs = p.alloc_inputs().unwrap();
    for b in inputs.iter_mut() {
        for (k, c) in b.bytes_mut().chunks_exact_mut(4).enumerate() {
            c.copy_from_slice(&(0.5 + k as f32).to_le_bytes());
        }
    }
    let mut outputs = vec![vec![0u8; 280]];
    let continues = Continuation {
        leftover: &leftover,
        request: Request { rows: 3, delay: 2 },
    };
    p.run_sampled(
        &mut inputs,
        &mut outputs,
        false,
        Sampling { seed: 4, steps: 4 },
        Some(continues),
    )
    .unwrap();
    let got: Vec<f32> = outputs[0]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    // By hand: LeRobot's euler_integrate with RTCProcessor.denoise_step around a velocity of
    // 0.5 + k/1000 (the synthetic step graph's).
    let mut noise = policyd::sampler::Noise::new(4);
    let mut x: Vec<f32> = (0..70).map(|_| noise.draw()).collect();
    let mut w = [0f32; 10];
    prefix_weights(Schedule::Linear, 2, 6, &mut w);
    for i in 0..4 {
        let time = (1.0 + i as f64 * (-1.0 / 4.0)) as f32;
        let mut v: Vec<f32> = (0..70).map(|k| 0.5 + k as f32 / 1000.0).collect();
        guide(
            &mut v,
            &x,
            &leftover,
            &w,
            7,
            time,
            guidance_weight(time, 4.0),
        );
        for (x, v) in x.iter_mut().zip(&v) {
            *x += -0.25 * v;
        }
    }
    for k in 0..70 {
        assert!((got[k] - x[k]).abs() < 1e-5, "{k}: {} vs {}", got[k], x[k]);
    }
    assert_ne!(got[..42], plain[..42], "the horizon's rows are guided");
    assert_eq!(got[42..], plain[42..], "rows past the horizon are not");
    // The guided rows are pulled to the leftover: the first (weight 1) ends nearer it.
    let dist = |a: &[f32]| -> f32 {
        a[..7]
            .iter()
            .zip(&leftover)
            .map(|(a, b)| (a - b).abs())
            .sum()
    };
    assert!(
        dist(&got) < dist(&plain) / 4.0,
        "{} vs {}",
        dist(&got),
        dist(&plain)
    );
    // A horizon past the chunk's 10 rows: LeRobot's flow families fail on it, policyd at load.
    let long = text.replace("execution_horizon = 6", "execution_horizon = 11");
    let e = pipeline(&long, good_step()).err().unwrap();
    assert!(
        e.contains("rtc.execution_horizon = 11") && e.contains("10 rows"),
        "{e}"
    );
}

#[test]
fn a_step_graph_may_apply_the_update_itself() {
    let text = BASE.replace(
        "[sampler]\n",
        "[sampler]\nupdate = \"model\"\ndt = \"dt\"\n",
    );
    let with_dt = step(
        vec![
            spec("feat", ElemType::F32, &[1, 4]),
            spec("x", ElemType::F32, &[1, 10, 7]),
            spec("t", ElemType::F32, &[1]),
            spec("dt", ElemType::F32, &[1]),
        ],
        spec("v", ElemType::F32, &[1, 10, 7]),
    );
    let mut p = pipeline(&text, with_dt).unwrap();
    // The synthetic step graph returns feat[0] + k/1000 = 0.5 + k/1000: that is the sample.
    let (x, _) = run(&mut p, Sampling { seed: 3, steps: 4 }).unwrap();
    for (k, v) in x.iter().enumerate() {
        assert!((v - (0.5 + k as f32 / 1000.0)).abs() < 1e-6, "{k}: {v}");
    }
    // Without its dt input the graph does not fit; dt is only for update = "model".
    let e = pipeline(&text, good_step()).err().unwrap();
    assert!(e.contains("sampler.dt = \"dt\""), "{e}");
    let e = Config::parse(
        &BASE.replace("[sampler]\n", "[sampler]\ndt = \"dt\"\n"),
        "t",
        None,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("`sampler.dt`"), "{e}");
    let e = Config::parse(
        &text.replace("kind = \"flow\"", "kind = \"ddim\""),
        "t",
        None,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("`sampler.update`"), "{e}");
}

#[test]
fn wiring_errors_name_both_ends() {
    let cases: Vec<(Box<dyn Engine>, &str, &str)> = vec![
        (
            step(
                vec![
                    spec("feat", ElemType::F32, &[1, 5]),
                    spec("x", ElemType::F32, &[1, 10, 7]),
                    spec("t", ElemType::F32, &[1]),
                ],
                spec("v", ElemType::F32, &[1, 10, 7]),
            ),
            "denoise.wire.feat",
            "prefix output 'features' float32 [1, 4] does not match step-graph input 'feat' float32 [1, 5]",
        ),
        (
            step(
                vec![
                    spec("feat", ElemType::F32, &[1, 4]),
                    spec("x", ElemType::F32, &[1, 10, 7]),
                    spec("t", ElemType::F32, &[1]),
                    spec("extra", ElemType::F32, &[1, 3]),
                ],
                spec("v", ElemType::F32, &[1, 10, 7]),
            ),
            "'extra'",
            "fed by nothing",
        ),
        (
            step(
                vec![
                    spec("feat", ElemType::F32, &[1, 4]),
                    spec("x", ElemType::F32, &[1, 10, 7]),
                    spec("t", ElemType::F32, &[1]),
                ],
                spec("v", ElemType::F32, &[1, 10, 6]),
            ),
            "sampler.output",
            "the sample's size",
        ),
        (
            step(
                vec![
                    spec("feat", ElemType::F32, &[1, 4]),
                    spec("x", ElemType::F32, &[1, 10, 7]),
                    spec("t", ElemType::F32, &[2]),
                ],
                spec("v", ElemType::F32, &[1, 10, 7]),
            ),
            "sampler.time",
            "one number",
        ),
        (
            step(
                vec![
                    spec("feat", ElemType::F32, &[1, 4]),
                    spec("x", ElemType::F16, &[1, 10, 7]),
                    spec("t", ElemType::F32, &[1]),
                ],
                spec("v", ElemType::F32, &[1, 10, 7]),
            ),
            "sampler.x",
            "float32",
        ),
        (
            step(
                vec![
                    spec("feat", ElemType::F32, &[1, 4]),
                    spec("sample", ElemType::F32, &[1, 10, 7]),
                    spec("t", ElemType::F32, &[1]),
                ],
                spec("v", ElemType::F32, &[1, 10, 7]),
            ),
            "sampler.x = \"x\"",
            "no such input",
        ),
    ];
    for (step, key, says) in cases {
        let e = pipeline(BASE, step).err().expect("refused");
        assert!(
            e.contains(key) && e.contains(says),
            "want {key} / {says}: {e}"
        );
    }
    let e = pipeline(&BASE.replace("\"features\"", "\"feats\""), good_step())
        .err()
        .unwrap();
    assert!(
        e.contains("denoise.wire.feat = \"feats\"") && e.contains("'features'"),
        "{e}"
    );
}

#[test]
fn config_errors_name_the_key() {
    let cases = [
        (
            BASE.replace("kind = \"flow\"", "kind = \"euler\""),
            "sampler.kind",
        ),
        (BASE.replace("steps = 4\n", "steps = 9\n"), "sampler.steps"),
        (
            BASE.replace("max_steps = 8", "max_steps = 0"),
            "sampler.max_steps",
        ),
        (
            BASE.replace("kind = \"flow\"", "kind = \"flow\"\neta = 0.5"),
            "sampler.kind",
        ),
        (
            BASE.replace(
                "kind = \"flow\"",
                "kind = \"ddim\"\nbeta_schedule = \"cosine\"",
            ),
            "sampler.beta_schedule",
        ),
        (
            BASE.replace(
                "kind = \"flow\"",
                "kind = \"ddim\"\nprediction_type = \"noise\"",
            ),
            "sampler.prediction_type",
        ),
        (
            BASE.replace("kind = \"flow\"", "kind = \"ddpm\"\neta = 0.5"),
            "sampler.eta",
        ),
        (
            BASE.replace(
                "kind = \"flow\"",
                "kind = \"ddim\"\nnum_train_timesteps = 4",
            ),
            "sampler.max_steps",
        ),
        (
            BASE.replace(
                "kind = \"flow\"",
                "kind = \"ddim\"\nbeta_start = 0.5\nbeta_end = 0.1",
            ),
            "sampler.beta_start",
        ),
        (BASE.replace("[sampler]", "[sampler_]"), "sampler"),
        (
            BASE.replace(
                "[denoise]\nmodel = \"step.onnx\"\nwire = { feat = \"features\" }\n",
                "",
            ),
            "denoise",
        ),
    ];
    for (text, key) in cases {
        let e = Config::parse(&text, "test", None)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains(&format!("`{key}`")) || (key == "sampler" && e.contains("sampler")),
            "want {key}: {e}"
        );
    }
    let seed_is_int = Config::parse(BASE, "test", None).unwrap();
    assert_eq!(
        seed_is_int
            .default_policy()
            .pipeline
            .as_ref()
            .unwrap()
            .max_steps,
        8
    );
}
