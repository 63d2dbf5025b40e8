//! Where does tract spend a graph's time? Each node of the optimised plan timed over several
//! runs, summed by op, largest first: what "tract is slower than torch on X" comes down to.
//!
//!     cargo bench --bench tract_profile -- MODEL.onnx [RUNS] [--scale S] [--vzeroupper]
//!
//! Inputs are zeros of the graph's own shapes (floats 0.5, so no op takes a shortcut on zero;
//! with `--scale S`, floats spread evenly over [-S, S] in a fixed scrambled order instead);
//! the first run warms up and is not counted. Single-threaded, as policyd's CPU engine runs.
//! `--vzeroupper` (x86-64 with AVX) clears the upper halves of the vector registers before each
//! node, as compilers do at the end of AVX code: if an op runs faster with it, the op before it
//! left dirty upper state and the op pays an AVX→SSE transition (docs/tract-report.md).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tract_onnx::prelude::*;
use tract_onnx::tract_core::plan::eval;

fn main() -> TractResult<()> {
    let all: Vec<String> = std::env::args().skip(1).collect();
    let scale: Option<f32> = all
        .iter()
        .position(|a| a == "--scale")
        .and_then(|i| all.get(i + 1))
        .and_then(|s| s.parse().ok());
    let args: Vec<String> = all
        .iter()
        .enumerate()
        .filter(|&(i, a)| {
            let value_of_scale = i > 0 && all[i - 1] == "--scale";
            !a.starts_with("--") && !value_of_scale
        })
        .map(|(_, a)| a.clone())
        .collect();
    let Some(path) = args.first() else {
        eprintln!("usage: cargo bench --bench tract_profile -- MODEL.onnx [RUNS]");
        std::process::exit(2);
    };
    let runs: usize = args.get(1).and_then(|r| r.parse().ok()).unwrap_or(10);
    let zero_upper = all.iter().any(|a| a == "--vzeroupper");
    let start = Instant::now();
    let model = tract_onnx::onnx()
        .model_for_path(path)?
        .into_optimized()?
        .into_runnable()?;
    println!(
        "{path}: load + optimise {:.2} s",
        start.elapsed().as_secs_f64()
    );
    let inputs: TVec<TValue> = model
        .model()
        .input_outlets()?
        .iter()
        .map(|o| {
            let fact = model.model().outlet_fact(*o)?;
            let shape = fact
                .shape
                .as_concrete()
                .ok_or_else(|| TractError::msg(format!("input {o:?} has a symbolic shape")))?;
            let t = Tensor::zero_dt(fact.datum_type, shape)?;
            let t = if let (Some(s), true) = (scale, fact.datum_type.is_float()) {
                let n: usize = shape.iter().product();
                // i * 7919 mod n visits every index once (n not a multiple of 7919).
                let v: Vec<f32> = (0..n)
                    .map(|i| ((i * 7919) % n) as f32 / n.max(2) as f32 * 2.0 * s - s)
                    .collect();
                tract_ndarray::ArrayD::from_shape_vec(shape, v)?
                    .into_tensor()
                    .cast_to_dt(fact.datum_type)?
                    .into_owned()
            } else if fact.datum_type.is_float() {
                tensor0(0.5f32)
                    .cast_to_dt(fact.datum_type)?
                    .broadcast_to_shape(shape)?
            } else {
                t
            };
            Ok(t.into_tvalue())
        })
        .collect::<TractResult<_>>()?;
    let mut state = model.spawn()?;
    let mut by_op: HashMap<String, (Duration, usize)> = HashMap::new();
    let mut total = Duration::ZERO;
    for run in 0..=runs {
        let begin = Instant::now();
        let mut times: Vec<(String, Duration)> = Vec::new();
        state.run_plan_with_eval(inputs.clone(), |ctx, op_state, node, input| {
            if zero_upper {
                policyd::engine::cpu::clear_upper_vector_state();
            }
            let t = Instant::now();
            let out = eval(ctx, op_state, node, input);
            times.push((node.op().name().to_string(), t.elapsed()));
            out
        })?;
        if run > 0 {
            total += begin.elapsed();
            for (op, d) in times {
                let e = by_op.entry(op).or_default();
                e.0 += d;
                e.1 += 1;
            }
        }
    }
    let mut ops: Vec<_> = by_op.into_iter().collect();
    ops.sort_by_key(|(_, (d, _))| std::cmp::Reverse(*d));
    let per_run = total.as_secs_f64() * 1e3 / runs as f64;
    println!("{runs} runs, {per_run:.2} ms per run; by op (ms per run, share):");
    for (op, (d, n)) in ops.iter().take(12) {
        let ms = d.as_secs_f64() * 1e3 / runs as f64;
        println!(
            "  {op:<28} {ms:>9.2}  {:>5.1} %  ({} nodes)",
            100.0 * ms / per_run,
            n / runs
        );
    }
    Ok(())
}
