//! Policies: the named, loaded engines a server serves, and the reload that swaps them safely.
//!
//! The operator declares the policies (`[[policies]]`); clients only choose among them, by
//! path (`/policies/<name>`) or a `policy` field. A set is built once at start-up and again on
//! each reload. The new set is built beside the old one, which keeps serving, and then swapped
//! in as a whole. A policy whose config and model file did not change keeps its engine and
//! buffers, like LeRobot's cache of loaded policies, but without letting a client load
//! arbitrary paths.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio_tungstenite::tungstenite::Bytes;

use crate::config::{Config, ConfigError, invalid};
use crate::engine::{Engine, ModelSource};
use crate::plan::Plan;
use crate::server::{Loaded, ServerError};
use crate::worker::WorkerHandle;

/// Opens the engine a per-policy config names (the server's: [`crate::server::open_engine`];
/// tests pass a synthetic one).
pub type OpenFn = dyn Fn(&Config) -> Result<Box<dyn Engine>, ServerError> + Send + Sync;

/// One served policy: its config, compiled plan, engine worker and metadata frame.
pub struct Policy {
    pub name: String,
    /// The whole config as this policy sees it (see [`Config::policy_configs`]).
    pub cfg: Config,
    pub plan: Plan,
    pub worker: WorkerHandle,
    /// The metadata frame sent on connect, encoded once.
    pub metadata: Bytes,
    pub backend: &'static str,
    pub warmup: Duration,
    /// What a reload compares (see [`fingerprint`]).
    fingerprint: String,
    /// The stall monitor watching this policy's worker, stopped with the policy.
    monitor: Mutex<Option<tokio::task::AbortHandle>>,
}

impl Policy {
    /// Wraps a loaded engine as the policy `cfg` describes.
    pub fn new(cfg: Config, loaded: Loaded) -> Policy {
        Policy {
            name: cfg.policy.name.clone(),
            fingerprint: fingerprint(&cfg),
            metadata: Bytes::from(loaded.plan.metadata.clone()),
            plan: loaded.plan,
            worker: loaded.worker,
            backend: loaded.backend,
            warmup: loaded.warmup,
            cfg,
            monitor: Mutex::new(None),
        }
    }

    /// Starts the stall monitor (`engine.timeout_ms`), once; it stops with the policy.
    pub fn watch(&self) {
        let timeout = self.cfg.engine.timeout_ms;
        let mut m = self.monitor.lock().unwrap_or_else(|p| p.into_inner());
        if timeout == 0 || m.is_some() {
            return;
        }
        let task = tokio::spawn(crate::worker::stall_monitor(
            self.worker.state.clone(),
            Duration::from_millis(timeout),
        ));
        *m = Some(task.abort_handle());
    }

    pub fn healthy(&self) -> bool {
        self.worker
            .state
            .healthy
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for Policy {
    fn drop(&mut self) {
        if let Some(m) = self
            .monitor
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            m.abort();
        }
        log::info!("policy \"{}\": engine released", self.name);
    }
}

/// The policies served at one time. Swapped as a whole on reload.
pub struct PolicySet {
    pub policies: Vec<Arc<Policy>>,
    /// Index of the policy clients get when they name none.
    pub default: usize,
    /// Bumped by every reload that changed the set.
    pub generation: u64,
    /// Memory the set allocates (connection buffers counted once), in bytes.
    pub budget: u64,
}

impl PolicySet {
    pub fn get(&self, name: &str) -> Option<&Arc<Policy>> {
        self.policies.iter().find(|p| p.name == name)
    }

    pub fn default_policy(&self) -> &Arc<Policy> {
        &self.policies[self.default]
    }

    /// The names, for messages: `aloha, droid`.
    pub fn names(&self) -> String {
        self.policies
            .iter()
            .map(|p| p.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Every policy's engine is healthy.
    pub fn healthy(&self) -> bool {
        self.policies.iter().all(|p| p.healthy())
    }

    /// A set of one policy (a single-policy config, tests).
    pub fn single(policy: Policy) -> PolicySet {
        let budget = policy.plan.budget.total;
        PolicySet {
            policies: vec![Arc::new(policy)],
            default: 0,
            generation: 0,
            budget,
        }
    }
}

/// What decides whether a reload keeps a policy's engine: its engine, bindings, metadata,
/// pacing and session options, the planner it feeds, and its model file's size and
/// modification time (a model replaced in place is reloaded).
pub fn fingerprint(cfg: &Config) -> String {
    let model = match &cfg.model {
        Some(ModelSource::File(p)) => {
            let stamp = std::fs::metadata(p).ok().map(|m| {
                let t = m
                    .modified()
                    .ok()
                    .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok());
                (m.len(), t)
            });
            format!("{} {stamp:?}", p.display())
        }
        Some(m) => m.describe(),
        None => String::new(),
    };
    format!(
        "{:?}|{:?}|{:?}|{:?}|{:?}|{}|{:?}|{model}",
        cfg.engine,
        cfg.inputs,
        cfg.outputs,
        cfg.metadata,
        cfg.pacing,
        cfg.policy.reset_on_prompt_change,
        cfg.planner.enabled.then_some(&cfg.planner),
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
) -> Result<Built, ServerError> {
    let cfgs = cfg.policy_configs();
    let mut policies = Vec::with_capacity(cfgs.len());
    let (mut loaded, mut kept) = (Vec::new(), Vec::new());
    for c in cfgs {
        let name = c.policy.name.clone();
        if let Some(old) = current.and_then(|s| s.get(&name))
            && old.fingerprint == fingerprint(&c)
        {
            kept.push(name);
            policies.push(old.clone());
            continue;
        }
        let context = |e: ServerError| -> ServerError {
            if cfg.policies.is_empty() {
                e
            } else {
                ServerError::Policy {
                    name: name.clone(),
                    source: Box::new(e),
                }
            }
        };
        let engine = open(&c).map_err(context)?;
        let mut l = crate::server::load_engine(&c, engine).map_err(context)?;
        // The planner thread feeds one link for the server's life: a reloaded default policy
        // takes over the running link if its prompt and camera are the same.
        if let (Some(tap), Some(old)) = (
            l.plan.planner.as_mut(),
            current.and_then(|s| s.default_policy().plan.planner.as_ref()),
        ) {
            if tap.link.camera == old.link.camera && tap.link.max_subtask == old.link.max_subtask {
                tap.link = old.link.clone();
            } else {
                log::warn!(
                    "policy \"{name}\": its planner prompt or camera changed; the planner feeds \
                     it after a restart"
                );
            }
        }
        loaded.push(name);
        policies.push(Arc::new(Policy::new(c, l)));
    }
    let budget = check_budget(cfg, &policies)?;
    Ok(Built {
        set: PolicySet {
            policies,
            default: cfg.default_policy(),
            generation: current.map_or(0, |s| s.generation + 1),
            budget,
        },
        loaded,
        kept,
    })
}

/// The set's memory: every policy's slots, model and engine memory, plus the connection
/// buffers once (connections are shared; each is sized for the largest policy). Checked
/// against `server.memory_budget_mb` when set.
pub fn check_budget(cfg: &Config, policies: &[Arc<Policy>]) -> Result<u64, ConfigError> {
    let items: Vec<(&str, &crate::plan::Budget)> = policies
        .iter()
        .map(|p| (p.name.as_str(), &p.plan.budget))
        .collect();
    budget_of(cfg, &items)
}

/// [`check_budget`] over named budgets (what `check-config` has before any engine runs).
pub fn budget_of(cfg: &Config, items: &[(&str, &crate::plan::Budget)]) -> Result<u64, ConfigError> {
    let conns = items.iter().map(|(_, b)| b.connections).max().unwrap_or(0);
    let own = |b: &crate::plan::Budget| b.total - b.connections;
    let total = conns + items.iter().map(|(_, b)| own(b)).sum::<u64>();
    let limit = cfg.server.memory_budget_mb * 1024 * 1024;
    if limit > 0 && total > limit {
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        let each = items
            .iter()
            .map(|(name, b)| format!("{name} {:.1} MiB", mib(own(b))))
            .collect::<Vec<_>>()
            .join(", ");
        return Err(invalid(
            "server.memory_budget_mb",
            format!(
                "the policies need {:.1} MiB ({each}; connection buffers {:.1} MiB) but the \
                 budget is {} MiB: serve fewer or smaller policies, fewer slots or connections, \
                 or raise the budget",
                mib(total),
                mib(conns),
                cfg.server.memory_budget_mb
            ),
        ));
    }
    Ok(total)
}

/// Reloads done and refused, and why the last one was refused (for `/metrics`).
#[derive(Default)]
pub struct ReloadStatus {
    pub ok: std::sync::atomic::AtomicU64,
    pub failed: std::sync::atomic::AtomicU64,
    /// The last refusal's message, cleared by a reload that succeeds.
    pub last_error: Mutex<Option<String>>,
}

impl ReloadStatus {
    pub fn succeeded(&self) {
        self.ok.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    pub fn failed(&self, why: &str) {
        self.failed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(why.to_string());
    }
}
