//! What is served? Policies: the named, loaded engines a server serves, and the reload that swaps
//! them safely.
//!
//! The operator declares the policies (`[[policies]]`); clients only choose among them, by
//! path (`/policies/<name>`) or a `policy` field. A set is built once at start-up and again on
//! each reload. The new set is built beside the old one, which keeps serving, and then swapped
//! in as a whole. A policy whose config and model file did not change keeps its engine and
//! buffers, like LeRobot's cache of loaded policies, but without letting a client load
//! arbitrary paths.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_tungstenite::tungstenite::Bytes;

use crate::bind::Plan;
use crate::config::{Config, PolicySpec};
use crate::engine::{Engine, EngineError};
pub mod budget;
pub mod build;
pub mod reload;

use crate::runtime::worker::WorkerHandle;
use build::{Loaded, fingerprint};

/// Opens the engine a policy names (the server's: [`crate::engine::open`]; tests pass a
/// synthetic one).
pub type OpenFn = dyn Fn(&PolicySpec) -> Result<Box<dyn Engine>, EngineError> + Send + Sync;

/// One served policy: its config, compiled plan, engine worker and metadata frame.
pub struct Policy {
    pub name: String,
    /// What the config says of this policy.
    pub spec: PolicySpec,
    pub plan: Plan,
    /// What it allocates, for the set's memory check and `/metrics`.
    pub budget: budget::Budget,
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
    /// Wraps a loaded engine as the policy `spec` of `cfg` describes.
    pub fn new(cfg: &Config, spec: PolicySpec, loaded: Loaded) -> Policy {
        Policy {
            name: spec.name.clone(),
            fingerprint: fingerprint(cfg, &spec),
            metadata: Bytes::from(loaded.plan.metadata.clone()),
            plan: loaded.plan,
            budget: loaded.budget,
            worker: loaded.worker,
            backend: loaded.backend,
            warmup: loaded.warmup,
            spec,
            monitor: Mutex::new(None),
        }
    }

    /// Starts the stall monitor (`engine.timeout_ms`), once; it stops with the policy.
    pub fn watch(&self) {
        let timeout = self.spec.engine.timeout_ms;
        let mut m = self.monitor.lock().unwrap_or_else(|p| p.into_inner());
        if timeout == 0 || m.is_some() {
            return;
        }
        let task = tokio::spawn(crate::runtime::worker::stall_monitor(
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
        let budget = policy.budget.total;
        PolicySet {
            policies: vec![Arc::new(policy)],
            default: 0,
            generation: 0,
            budget,
        }
    }
}
