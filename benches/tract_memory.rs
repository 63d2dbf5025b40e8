//! Where does tract's memory go while it loads a graph? Each step policyd's CPU engine takes
//! (parse, type, optimise, make runnable, run once) with the process's resident memory after it
//! and its peak during it; then the optimised plan's constants summed by the op that reads them
//! (a packed matrix product's weights, a convolution's kernel, …) against the graph's weights.
//!
//!     cargo bench --bench tract_memory -- MODEL.onnx
//!
//! Linux only (it reads /proc/self/status and resets the peak through /proc/self/clear_refs).
//! Inputs are zeros of the graph's own shapes; one thread, as policyd's engine runs by default.

use std::collections::HashMap;
use std::time::Instant;

use tract_onnx::prelude::*;

/// (resident, anonymous, peak resident) in MB, from /proc/self/status.
fn memory() -> (f64, f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .map_or(f64::NAN, |kb| kb / 1024.0)
    };
    (field("VmRSS:"), field("RssAnon:"), field("VmHWM:"))
}

/// Starts a new peak: the kernel resets VmHWM to the current resident size.
fn reset_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn step<T>(name: &str, f: impl FnOnce() -> TractResult<T>) -> TractResult<T> {
    reset_peak();
    let t = Instant::now();
    let out = f()?;
    let (rss, anon, peak) = memory();
    println!(
        "  {name:<22} {:>7.1} s  {rss:>9.0} {anon:>9.0} {peak:>9.0}",
        t.elapsed().as_secs_f64()
    );
    Ok(out)
}

/// Bytes of the constants each op type reads, in `model`.
fn constants_by_reader(model: &TypedModel) -> TractResult<Vec<(String, usize, f64)>> {
    let mut by: HashMap<String, (usize, f64)> = HashMap::new();
    for node in model.nodes() {
        if node.op().name() != "Const" {
            continue;
        }
        let fact = model.outlet_fact(OutletId::new(node.id, 0))?;
        let bytes = fact.mem_size().as_i64().unwrap_or(0) as f64;
        let mut readers: Vec<String> = node.outputs[0]
            .successors
            .iter()
            .map(|s| model.node(s.node).op().name().to_string())
            .collect();
        readers.sort();
        readers.dedup();
        let key = if readers.is_empty() {
            "(no reader)".to_string()
        } else {
            readers.join("+")
        };
        let e = by.entry(key).or_default();
        e.0 += 1;
        e.1 += bytes;
    }
    let mut v: Vec<_> = by.into_iter().map(|(k, (n, b))| (k, n, b)).collect();
    v.sort_by(|a, b| b.2.total_cmp(&a.2));
    Ok(v)
}

fn main() -> TractResult<()> {
    let Some(path) = std::env::args().nth(1).filter(|a| !a.starts_with("--")) else {
        eprintln!("usage: cargo bench --bench tract_memory -- MODEL.onnx");
        std::process::exit(2);
    };
    let (rss, anon, _) = memory();
    println!("{path}");
    println!("  step                     time      RSS MB   anon MB   peak MB");
    println!("  {:<22} {:>7} {rss:>11.0} {anon:>9.0}", "start", "");
    let onnx = tract_onnx::onnx();
    let parsed = step("parse (weights read)", || onnx.model_for_path(&path))?;
    let typed = step("into_typed", || parsed.into_typed())?;
    let weights: f64 = constants_by_reader(&typed)?.iter().map(|c| c.2).sum();
    let optimised = step("into_optimized", || typed.into_optimized())?;
    let constants = constants_by_reader(&optimised)?;
    let plan = step("into_runnable", || optimised.into_runnable())?;
    let inputs: TVec<TValue> = plan
        .model()
        .input_outlets()?
        .iter()
        .map(|o| {
            let fact = plan.model().outlet_fact(*o)?;
            let shape = fact
                .shape
                .as_concrete()
                .ok_or_else(|| TractError::msg(format!("input {o:?} has a symbolic shape")))?;
            Ok(Tensor::zero_dt(fact.datum_type, shape)?.into_tvalue())
        })
        .collect::<TractResult<_>>()?;
    let mut state = step("spawn", || plan.spawn())?;
    step("first run", || state.run(inputs.clone()))?;
    step("second run", || state.run(inputs))?;
    // What of that is the allocator keeping freed memory (the decoded weights the packing
    // replaced, the parse's buffers) rather than live data.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    step("malloc_trim", || {
        // SAFETY: malloc_trim has no preconditions.
        unsafe { libc::malloc_trim(0) };
        Ok(())
    })?;
    let held: f64 = constants.iter().map(|c| c.2).sum();
    println!(
        "  the graph's constants after typing: {:.0} MB; the optimised plan's: {:.0} MB ({:.2}×)",
        weights / 1e6,
        held / 1e6,
        held / weights.max(1.0)
    );
    println!("  the plan's constants by the op that reads them:");
    for (reader, n, bytes) in constants.iter().take(12) {
        println!("    {reader:<44} {:>9.1} MB  ({n} constants)", bytes / 1e6);
    }
    Ok(())
}
