//! How is one policy made servable? Open its engine, compile its bindings against the engine's
//! real inputs and outputs, allocate every slot and warm up; and how is a whole set built,
//! keeping the policies a reload did not change.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::bind::Plan;
use crate::config::{Config, ConfigError, ModelSource, PolicySpec};
use crate::engine::{Engine, EngineError};
use crate::metrics::Stats;
use crate::runtime::worker::WorkerHandle;

use super::budget::{Budget, check_budget};
use super::{OpenFn, Policy, PolicySet};

/// Building a policy failed: its config against the model, or its engine.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("policy \"{name}\": {source}")]
    Policy {
        name: String,
        source: Box<PolicyError>,
    },
}

/// A loaded, checked and warmed engine with its plan: what the server serves.
pub struct Loaded {
    pub plan: Plan,
    /// What it allocates (see [`Budget`]).
    pub budget: Budget,
    pub stats: Arc<Stats>,
    pub worker: WorkerHandle,
    pub backend: &'static str,
    pub warmup: Duration,
}

/// `e`, said of the policy `name` when the config names its policies.
fn in_policy(cfg: &Config, name: &str, e: PolicyError) -> PolicyError {
    if !cfg.named {
        return e;
    }
    PolicyError::Policy {
        name: name.to_string(),
        source: Box::new(e),
    }
}

/// Loads the model, checks the policy against it, allocates every buffer and warms up.
pub fn load(cfg: &Config, spec: &PolicySpec) -> Result<Loaded, PolicyError> {
    load_engine(cfg, spec, crate::engine::open(spec)?)
}

/// [`load`] with an engine the caller opened (tests and benchmarks use a synthetic one).
pub fn load_engine(
    cfg: &Config,
    spec: &PolicySpec,
    engine: Box<dyn Engine>,
) -> Result<Loaded, PolicyError> {
    let plan = Plan::compile(cfg, spec, engine.io())?;
    lerobot_fit(cfg, spec, &plan)?;
    let mut budget = Budget::compute(cfg, spec, &plan);
    budget.add(engine.working_memory());
    let backend = engine.backend();
    let (worker, warmup) =
        WorkerHandle::start(engine, &plan, spec.engine.slots, spec.engine.warmup_runs)?;
    Ok(Loaded {
        plan,
        budget,
        stats: Arc::new(Stats::new()),
        worker,
        backend,
        warmup,
    })
}

/// For a policy that `[[lerobot.serve]]` entries name: checks that LeRobot's clients can drive
/// its bindings (an error naming the entry), and says what they send for `check-config`.
fn lerobot_fit(
    cfg: &Config,
    spec: &PolicySpec,
    plan: &Plan,
) -> Result<Option<String>, ConfigError> {
    let Some(l) = &cfg.lerobot else {
        return Ok(None);
    };
    let entries: Vec<(usize, &crate::config::LerobotServe)> = l
        .serve
        .iter()
        .enumerate()
        .filter(|(_, s)| s.policy == spec.name)
        .collect();
    let Some(&(first, _)) = entries.first() else {
        return Ok(None);
    };
    let fit = plan.lerobot_fit().map_err(|e| {
        crate::config::invalid(
            format!("lerobot.serve[{first}].policy"),
            format!(
                "policy \"{}\" cannot be driven by LeRobot's robot_client: {e}",
                spec.name
            ),
        )
    })?;
    let names: Vec<String> = entries
        .iter()
        .map(|(_, s)| match &s.policy_type {
            Some(t) => format!("\"{}\" ({t})", s.pretrained),
            None => format!("\"{}\"", s.pretrained),
        })
        .collect();
    let cameras: Vec<String> = fit
        .cameras
        .iter()
        .map(|c| format!("{} {}x{}", c.name, c.width, c.height))
        .collect();
    Ok(Some(format!(
        "  lerobot: robot_client on {} asking for {}: state of {} motors, cameras: {}{}",
        l.listen,
        names.join(", "),
        fit.state.map_or("no".to_string(), |s| s.len.to_string()),
        if cameras.is_empty() {
            "none".into()
        } else {
            cameras.join(", ")
        },
        if fit.task { ", task as the prompt" } else { "" }
    )))
}

/// What decides whether a reload keeps a policy's engine: its engine, bindings, metadata,
/// pacing and session options, the planner it feeds, and its model file's size and
/// modification time (a model replaced in place is reloaded).
pub fn fingerprint(cfg: &Config, spec: &PolicySpec) -> String {
    let stamp = |m: &ModelSource| match m {
        ModelSource::File(p) => {
            let stamp = std::fs::metadata(p).ok().map(|m| {
                let t = m
                    .modified()
                    .ok()
                    .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok());
                (m.len(), t)
            });
            format!("{} {stamp:?}", p.display())
        }
        m => m.describe(),
    };
    // The step graph and tokenizer files count as the model does.
    let mut model = stamp(&spec.model);
    if let Some(p) = &spec.pipeline {
        model += &format!("|{}", stamp(&p.denoise));
    }
    for t in spec.inputs.iter().filter_map(|b| b.tokenizer()) {
        model += &format!("|{}", stamp(&t.file));
    }
    let planner = (spec.is_default && cfg.planner.enabled).then_some(&cfg.planner);
    format!(
        "{:?}|{:?}|{:?}|{:?}|{:?}|{}|{:?}|{:?}|{model}",
        spec.engine,
        spec.inputs,
        spec.outputs,
        spec.metadata,
        spec.pacing,
        spec.reset_on_prompt_change,
        spec.pipeline,
        planner,
    )
}

/// What building a set did.
pub struct Built {
    pub set: PolicySet,
    /// Names of the policies whose engines were loaded (the rest were kept).
    pub loaded: Vec<String>,
    pub kept: Vec<String>,
}

/// Builds the set `cfg` declares: policies of `current` whose [`fingerprint`] is unchanged are
/// kept, the others are opened, checked and warmed. Fails, leaving `current` untouched, if
/// any policy fails or the set does not fit `server.memory_budget_mb`. Blocking.
pub fn build(
    cfg: &Config,
    current: Option<&PolicySet>,
    open: &OpenFn,
) -> Result<Built, PolicyError> {
    let mut policies = Vec::with_capacity(cfg.policies.len());
    let (mut loaded, mut kept) = (Vec::new(), Vec::new());
    // Which policies a reload keeps as they are (same fingerprint), decided once.
    let reuse: Vec<Option<Arc<Policy>>> = cfg
        .policies
        .iter()
        .map(|c| {
            current
                .and_then(|s| s.get(&c.name))
                .filter(|old| old.fingerprint == fingerprint(cfg, c))
                .cloned()
        })
        .collect();
    // Before any weights are read: those about to be loaded must fit in what the service may
    // still allocate (its MemoryMax= less what it holds, and the machine's available memory).
    let weights: Vec<(&str, u64)> = cfg
        .policies
        .iter()
        .zip(&reuse)
        .filter(|(_, kept)| kept.is_none())
        .map(|(c, _)| {
            let size = c.model.size() + c.pipeline.as_ref().map_or(0, |p| p.denoise.size());
            (c.name.as_str(), size)
        })
        .collect();
    let need: u64 = weights.iter().map(|(_, b)| b).sum();
    super::budget::MemoryRoom::read()
        .check(
            &format!(
                "the weights to load ({})",
                weights
                    .iter()
                    .map(|(n, b)| format!("{n} {:.1} MiB", *b as f64 / (1024.0 * 1024.0)))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            need,
        )
        .map_err(|m| crate::config::invalid("engine.model", m))?;
    for (c, old) in cfg.policies.iter().zip(reuse) {
        let name = c.name.clone();
        if let Some(old) = old {
            kept.push(name);
            policies.push(old);
            continue;
        }
        let context = |e| in_policy(cfg, &name, e);
        let engine = open(c).map_err(|e| context(e.into()))?;
        let l = load_engine(cfg, c, engine).map_err(context)?;
        loaded.push(name);
        policies.push(Arc::new(Policy::new(cfg, c.clone(), l)));
    }
    let budget = check_budget(cfg, &policies)?;
    Ok(Built {
        set: PolicySet {
            policies,
            default: cfg.default,
            generation: current.map_or(0, |s| s.generation + 1),
            budget,
        },
        loaded,
        kept,
    })
}

/// `policyd check-config`: opens each policy's engine and compiles its bindings (no slots, no
/// warm-up), and reports what it found and the memory budget; fails as serving would.
/// `check-config`'s lines on a tokenized prompt: the tokenizer, and the longest of openpi's
/// example prompts in tokens (pi0.5 with a zero state), against `max_tokens`.
fn tokenizer_report(plan: &Plan) -> Option<String> {
    let b = &plan.inputs[plan.tokens?];
    let t = b.tokens.as_ref()?;
    let bins = vec![crate::tokenizer::state_bin(0.0); t.state_values(&plan.inputs)];
    let mut ids = Vec::new();
    let (longest, prompt) = crate::tokenizer::SAMPLE_PROMPTS
        .iter()
        .filter_map(|p| {
            t.tokenizer
                .tokenize(t.format, p, &bins, t.around(), &mut ids)
                .ok()?;
            Some((ids.len(), *p))
        })
        .max()?;
    let io = &plan.io.inputs;
    Some(format!(
        "  prompt '{}': {} tokenizer, {} tokens{}, format {}; ids '{}' {} and mask '{}' {} of {}; \
         overflow {}; reads at most {} prompt bytes\n  prompt '{}': longest sample prompt is {} \
         tokens of {} (\"{}\")\n",
        b.key,
        t.tokenizer.kind(),
        t.tokenizer.vocab_size(),
        t.tokenizer
            .bos()
            .map(|id| format!(", BOS {id}"))
            .unwrap_or_default(),
        t.format.name(),
        io[t.ids].name,
        t.ids_type,
        io[t.mask].name,
        t.mask_type,
        t.max_tokens,
        if t.refuse_overflow {
            "refused"
        } else {
            "truncated"
        },
        t.prompt_bytes,
        b.key,
        longest,
        t.max_tokens,
        prompt
    ))
}

/// `check-config` does not run the model, but a graph the backend knows may fail only at run
/// time ([`Engine::needs_trial_run`]: tract 0.23's CumSum over an int64 Cast) would pass it
/// and then fail at warm-up: such a graph gets one run here, with fill values, so that its
/// failure (naming the rewrite) is the check's.
fn trial_run(engine: &mut dyn Engine, plan: &Plan) -> Result<(), PolicyError> {
    if !engine.needs_trial_run() {
        return Ok(());
    }
    // A slot's buffers: the engine's inputs, then the request path's own (prompt text).
    let mut inputs = engine.alloc_inputs()?;
    let n = inputs.len();
    for &bytes in &plan.host_buffers {
        inputs.push(Box::new(crate::engine::HostBuffer(vec![0; bytes])));
    }
    plan.fill_all(&mut inputs);
    let mut outputs: Vec<Vec<u8>> = engine
        .io()
        .outputs
        .iter()
        .map(|s| vec![0; s.bytes()])
        .collect();
    engine.run(&mut inputs[..n], &mut outputs, true)?;
    Ok(())
}

pub fn check(cfg: &Config, origin: &str) -> Result<String, PolicyError> {
    use std::fmt::Write;
    let mut out = String::new();
    let several = cfg.named;
    let mut budgets = Vec::new();
    for c in &cfg.policies {
        let name = c.name.clone();
        let context = |e| in_policy(cfg, &name, e);
        let mut engine = crate::engine::open(c).map_err(|e| context(e.into()))?;
        let plan = Plan::compile(cfg, c, engine.io()).map_err(|e| context(e.into()))?;
        trial_run(engine.as_mut(), &plan).map_err(context)?;
        let lerobot = lerobot_fit(cfg, c, &plan).map_err(|e| context(e.into()))?;
        let mut budget = Budget::compute(cfg, c, &plan);
        budget.add(engine.working_memory());
        let title = if several {
            format!(
                "policy \"{name}\"{}: ",
                if c.is_default { " (default)" } else { "" }
            )
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "{title}{origin}: OK ({} backend, {} inputs, {} outputs)",
            engine.backend(),
            plan.inputs.len(),
            plan.outputs.len()
        );
        for s in &engine.io().inputs {
            let _ = writeln!(out, "  input  '{}' {} {:?}", s.name, s.dtype, s.shape);
        }
        for s in &engine.io().outputs {
            let _ = writeln!(out, "  output '{}' {} {:?}", s.name, s.dtype, s.shape);
        }
        if let Some(line) = lerobot {
            let _ = writeln!(out, "{line}");
        }
        if let Some(tap) = &plan.planner {
            let p = &cfg.planner;
            let _ = writeln!(
                out,
                "  planner: {} at {} Hz via {}; subtask fills '{}' (at most {} bytes, {} \
                 first); camera: {}",
                p.model,
                p.rate_hz,
                p.endpoints.join(", "),
                p.prompt_key,
                tap.max_subtask,
                p.precedence,
                p.camera.as_deref().unwrap_or("none (text only)")
            );
        }
        if let Some(line) = tokenizer_report(&plan) {
            out.push_str(&line);
        }
        if let Some(p) = &c.pipeline {
            let _ = writeln!(
                out,
                "  pipeline: {} sampler, {} steps by default, at most {} (sampling_params.\
                 num_inference_steps); step graph {}: sample '{}', time '{}', output '{}', wired {}{}",
                match (p.kind, p.flow_time) {
                    (crate::sampler::Kind::Flow, crate::sampler::FlowTime::Openpi) => {
                        "flow (openpi Euler)"
                    }
                    (crate::sampler::Kind::Flow, crate::sampler::FlowTime::Lerobot) => {
                        "flow (LeRobot's euler_integrate times)"
                    }
                    (crate::sampler::Kind::Flow, crate::sampler::FlowTime::Groot) => {
                        "flow (GR00T: upward time, integer buckets)"
                    }
                    (crate::sampler::Kind::Ddpm, _) => "DDPM (diffusers)",
                    (crate::sampler::Kind::Ddim, _) => "DDIM (diffusers)",
                },
                p.steps,
                p.max_steps,
                p.denoise.describe(),
                p.x,
                p.time,
                p.output,
                if p.wire.is_empty() {
                    "nothing".to_string()
                } else {
                    p.wire
                        .iter()
                        .map(|(to, from)| format!("'{from}' → '{to}'"))
                        .collect::<Vec<_>>()
                        .join(", ")
                },
                if p.inject_noise {
                    "; the noise comes from the request (inject_noise, for tests)"
                } else {
                    ""
                }
            );
            if let Some(r) = &p.rtc {
                let delay = r.inference_delay.map_or_else(
                    || "the session's measured delay".to_string(),
                    |d| format!("a fixed delay of {d} steps"),
                );
                let how = match r.method {
                    crate::rtc::Method::Guidance {
                        schedule,
                        max_guidance_weight,
                    } => format!(
                        "LeRobot's guidance ({schedule:?} prefix weights, at most \
                         {max_guidance_weight})"
                    ),
                    crate::rtc::Method::Inpaint { ramp_rate } => {
                        format!("GR00T's inpainting (ramp rate {ramp_rate})")
                    }
                };
                let _ = writeln!(
                    out,
                    "  rtc: a new chunk continues the last one sent, over {} rows: {how}, {delay} \
                     (observe and LeRobot's gRPC; docs/pacing.md)",
                    r.execution_horizon
                );
            }
        }
        out.push_str(&budget.render());
        budgets.push((name, budget));
    }
    let items: Vec<(&str, &Budget)> = budgets.iter().map(|(n, b)| (n.as_str(), b)).collect();
    let total = super::budget::budget_of(cfg, &items)?;
    // The whole budget against what this machine (and this process's cgroup) could give it.
    match super::budget::MemoryRoom::read().check("the policies' budget", total) {
        Ok(()) => {
            let _ = writeln!(
                out,
                "memory: the budget fits this machine's available memory"
            );
        }
        Err(m) => {
            let _ = writeln!(out, "memory: {m}");
        }
    }
    let fds = super::budget::FdBudget::compute(cfg);
    // What the limits would be at start-up: this process's, raised as serving raises them.
    if let Ok((soft, hard)) = crate::service::raise_open_files(fds.total) {
        out.push_str(&fds.render(soft, hard));
    }
    if budgets.len() > 1 {
        let _ = writeln!(
            out,
            "all {} policies: {total} bytes ({:.1} MiB; connection buffers counted once)",
            budgets.len(),
            total as f64 / (1024.0 * 1024.0)
        );
    }
    Ok(out)
}
