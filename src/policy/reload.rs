//! How does `SIGHUP` change what is served? Re-read the config, build the new set beside the
//! old one (which keeps serving), swap it in whole; a config that fails changes nothing.

use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use sd_notify::NotifyState;
use tokio::sync::watch;

use crate::config::{Config, ConfigError};

use super::{OpenFn, PolicySet};

/// Re-reading the config on `SIGHUP`: where the config comes from, how engines are opened,
/// and the signals.
pub struct Reloader {
    /// Reads and checks the config again (`Config::load` of the file the server started
    /// with, with the same command-line overrides).
    pub load: Arc<dyn Fn() -> Result<Config, ConfigError> + Send + Sync>,
    /// One message per reload request.
    pub requests: tokio::sync::mpsc::Receiver<()>,
}

/// What a reload swaps: the served set, and its generation for connections to notice.
pub struct Served {
    pub policies: Arc<ArcSwap<PolicySet>>,
    pub generation: watch::Sender<u64>,
    /// The config the server started with (its fixed sections are compared, not reloaded).
    pub started: Config,
    /// What the planner feeds for the server's life (see [`crate::bind::PlannerTap`]).
    pub planner: Option<Arc<crate::planner::Link>>,
}

/// Serves reload requests one at a time: re-read the config, build the new set beside the
/// old one (which keeps serving), swap it in. A config that fails is logged and reported in
/// `/metrics`, and nothing changes.
pub async fn run(
    served: Arc<Served>,
    mut r: Reloader,
    open: Arc<OpenFn>,
    status: Arc<ReloadStatus>,
) {
    while r.requests.recv().await.is_some() {
        // Requests that came in meanwhile are served by this one reload.
        while r.requests.try_recv().is_ok() {}
        // systemd (Type=notify-reload or ExecReload=) sees the reload start and end.
        let mut start = vec![
            NotifyState::Reloading,
            NotifyState::Status("reloading the config"),
        ];
        if let Ok(now) = NotifyState::monotonic_usec_now() {
            start.push(now);
        }
        crate::service::notify(&start);
        log::info!("reloading the config");
        let current = served.policies.load_full();
        let (load, open) = (r.load.clone(), open.clone());
        let started = served.started.clone();
        let built = tokio::task::spawn_blocking(move || {
            let cfg = load().map_err(|e| e.to_string())?;
            warn_fixed_sections(&started, &cfg);
            super::build::build(&cfg, Some(&current), open.as_ref()).map_err(|e| e.to_string())
        })
        .await
        .map_err(|e| format!("the reload task failed: {e}"))
        .and_then(|r| r);
        let message = match built {
            Ok(b) => {
                for p in &b.set.policies {
                    p.watch();
                }
                let default = b.set.default_policy();
                if let (Some(link), Some(tap)) = (&served.planner, &default.plan.planner)
                    && !tap.fits(link)
                {
                    log::warn!(
                        "policy \"{}\": its planner prompt or camera changed; the planner feeds \
                         it after a restart",
                        default.name
                    );
                }
                let generation = b.set.generation;
                let summary = format!(
                    "config reloaded: serving {} (loaded: {}; kept: {})",
                    b.set.names(),
                    list_or_none(&b.loaded),
                    list_or_none(&b.kept)
                );
                served.policies.store(Arc::new(b.set));
                served.generation.send_replace(generation);
                status.succeeded();
                log::info!("{summary}");
                summary
            }
            Err(e) => {
                log::error!("config reload refused, still serving the previous config: {e}");
                status.failed(&e);
                format!("reload refused: {e}")
            }
        };
        crate::service::notify(&[NotifyState::Ready, NotifyState::Status(&message)]);
    }
}

fn list_or_none(names: &[String]) -> String {
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

/// A reload changes policies only; the listener, limits, keys, TLS and planner hold until a
/// restart. Says so when the file changed them.
fn warn_fixed_sections(old: &Config, new: &Config) {
    let changed = [
        ("[server]", old.server != new.server),
        ("[auth]", old.auth != new.auth),
        ("[tls]", old.tls != new.tls),
        ("[planner]", old.planner != new.planner),
    ];
    for (section, differs) in changed {
        if differs {
            log::warn!("{section} changed: it takes effect when policyd restarts, not on reload");
        }
    }
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
