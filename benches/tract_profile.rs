//! Where does tract spend a graph's time? Each node of the optimised plan timed over several
//! runs, summed by op, largest first: what "tract is slower than torch on X" comes down to.
//!
//!     cargo bench --bench tract_profile -- MODEL.onnx [RUNS]
//!
//! Inputs are zeros of the graph's own shapes (floats 0.5, so no op takes a shortcut on zero);
//! the first run warms up and is not counted. Single-threaded, as policyd's CPU engine runs.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tract_onnx::prelude::*;
use tract_onnx::tract_core::plan::eval;

fn main() -> TractResult<()> {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let Some(path) = args.first() else {
        eprintln!("usage: cargo bench --bench tract_profile -- MODEL.onnx [RUNS]");
        std::process::exit(2);
    };
    let runs: usize = args.get(1).and_then(|r| r.parse().ok()).unwrap_or(10);
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
            let t = if fact.datum_type.is_float() {
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
