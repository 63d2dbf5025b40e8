//! A pipeline's loop without its networks: the prefix and the step graph are synthetic
//! engines that cost next to nothing, so the time per step is policyd's own work around each
//! step (the sample into the step graph's input, the time, the output read back and checked,
//! the sampler's update). Flow at the pi0 demo's shapes (a 50 × 32 chunk) and DDIM at PushT's
//! (16 × 2). benches/pipeline_python.py times the same loop in numpy.

use criterion::{Criterion, criterion_group, criterion_main};
use policyd::config::Config;
use policyd::dtype::ElemType;
use policyd::engine::pipeline::Pipeline;
use policyd::engine::{Engine, IoSpec, Sampling, TensorSpec};
use policyd::testing::synthetic::{Behaviour, SyntheticEngine};

fn t(name: &str, dtype: ElemType, shape: &[usize]) -> TensorSpec {
    TensorSpec {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
    }
}

fn pipeline(kind: &str, chunk: [usize; 2], time: ElemType) -> Pipeline {
    let schedule = if kind == "flow" {
        ""
    } else {
        "num_train_timesteps = 100\nbeta_schedule = \"squaredcos_cap_v2\""
    };
    let text = format!(
        r#"
[engine]
model = "prefix.onnx"
[denoise]
model = "step.onnx"
wire = {{ feat = "features" }}
[sampler]
kind = "{kind}"
steps = 10
x = "x"
time = "t"
output = "out"
{schedule}
[[inputs]]
key = "state"
tensor = "state"
dtypes = ["float32"]
shape = [8]
[[outputs]]
tensor = "x"
"#
    );
    let cfg = Config::parse(&text, "bench", None).expect("config");
    let engine = |inputs, outputs| {
        Box::new(SyntheticEngine::new(
            IoSpec { inputs, outputs },
            Behaviour::default(),
        ))
    };
    let x = [1, chunk[0], chunk[1]];
    Pipeline::new(
        engine(
            vec![t("state", ElemType::F32, &[1, 8])],
            vec![t("features", ElemType::F32, &[1, 64])],
        ),
        engine(
            vec![
                t("feat", ElemType::F32, &[1, 64]),
                t("x", ElemType::F32, &x),
                t("t", time, &[1]),
            ],
            vec![t("out", ElemType::F32, &x)],
        ),
        cfg.default_policy().pipeline.as_ref().expect("pipeline"),
    )
    .expect("pipeline")
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("pipeline");
    for (name, kind, chunk, time) in [
        ("flow 50x32", "flow", [50, 32], ElemType::F32),
        ("ddim 16x2", "ddim", [16, 2], ElemType::I64),
    ] {
        // The step graph alone, to subtract: what a synthetic run costs at this shape.
        let mut step = SyntheticEngine::new(
            IoSpec {
                inputs: vec![
                    t("feat", ElemType::F32, &[1, 64]),
                    t("x", ElemType::F32, &[1, chunk[0], chunk[1]]),
                    t("t", time, &[1]),
                ],
                outputs: vec![t("out", ElemType::F32, &[1, chunk[0], chunk[1]])],
            },
            Behaviour::default(),
        );
        let mut step_in = step.alloc_inputs().expect("inputs");
        let mut step_out = vec![vec![0u8; chunk[0] * chunk[1] * 4]];
        g.bench_function(format!("{name}, the synthetic step graph alone"), |b| {
            b.iter(|| step.run(&mut step_in, &mut step_out, false).expect("run"))
        });
        let mut p = pipeline(kind, chunk, time);
        let mut inputs = p.alloc_inputs().expect("inputs");
        let mut outputs = vec![vec![0u8; chunk[0] * chunk[1] * 4]];
        for steps in [1u32, 10] {
            g.bench_function(format!("{name}, {steps} steps, synthetic engines"), |b| {
                let mut seed = 0;
                b.iter(|| {
                    seed += 1;
                    p.run_sampled(
                        &mut inputs,
                        &mut outputs,
                        false,
                        Sampling { seed, steps },
                        None,
                    )
                    .expect("run")
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
