//! How does a policyd process run? Listen (the socket systemd passed, or the configured
//! address), build the policies while answering 503, tell systemd it is ready, serve until
//! shutdown, drain. The watchdog is fed only while every engine makes progress.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use sd_notify::NotifyState;
use tokio::net::TcpListener;

use crate::config::{Config, PolicySpec};
use crate::engine::Engine;
use crate::metrics::Stats;
use crate::net::server::{self, ServeError};
use crate::policy::build::PolicyError;
use crate::policy::reload::Reloader;
use crate::policy::{OpenFn, PolicySet};
use crate::protocol::VLLM_PATH;
use crate::service::{notify, watchdog_interval};

/// Pings the watchdog every `every` while every policy's engine worker beats and is healthy;
/// skips a ping otherwise, so that a stuck or broken engine lets the watchdog fire.
pub async fn heartbeat(policies: Arc<ArcSwap<PolicySet>>, every: Duration) {
    // Each worker's beat counter at the last tick, by worker.
    let mut last: Vec<(usize, u64)> = Vec::new();
    let mut stuck_since: Option<Instant> = None;
    let mut tick = tokio::time::interval(every.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let set = policies.load();
        let now: Vec<(usize, u64)> = set
            .policies
            .iter()
            .map(|p| {
                let st = &p.worker.state;
                (Arc::as_ptr(st) as usize, st.beats.load(Ordering::Relaxed))
            })
            .collect();
        // A worker new since the last tick (a reload) counts as moving.
        let moved = now.iter().all(|(w, b)| {
            last.iter()
                .find(|(v, _)| v == w)
                .is_none_or(|(_, old)| old != b)
        });
        last = now;
        if !set.healthy() {
            // A broken engine (see worker::FATAL_AFTER): let the watchdog restart us.
            continue;
        }
        if moved {
            if let Some(t) = stuck_since.take() {
                log::warn!(
                    "engine worker moving again after {:.1} s",
                    t.elapsed().as_secs_f64()
                );
            }
            notify(&[NotifyState::Watchdog]);
        } else if stuck_since.is_none() {
            log::error!("engine worker made no progress; withholding the watchdog ping");
            stuck_since = Some(Instant::now());
        }
    }
}

/// Running the service failed; the message says what to fix.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Serve(#[from] ServeError),
    #[error(transparent)]
    Policy(#[from] PolicyError),
    #[error("engine loading stopped: {0}")]
    Loading(tokio::task::JoinError),
    #[error("cannot read the listening address: {0}")]
    Addr(std::io::Error),
}

/// Raises the open-file limit to what the connection caps need (see
/// [`crate::policy::budget::FdBudget`]), or says why it cannot.
fn open_files(cfg: &Config) {
    let need = crate::policy::budget::FdBudget::compute(cfg).total;
    match crate::service::raise_open_files(need) {
        Ok((soft, _)) if soft >= need => {
            log::debug!("open files: the caps need {need}, the limit is {soft}");
        }
        Ok((soft, hard)) => log::warn!(
            "open files: the connection caps need {need} file descriptors but the hard limit \
             is {hard} (soft {soft}); a connection flood may stop accept on every port: set \
             LimitNOFILE={need} in the unit or lower server.max_connections / \
             lerobot.max_connections"
        ),
        Err(e) => log::warn!("open files: cannot raise RLIMIT_NOFILE to {need}: {e}"),
    }
}

/// The listener: the first socket systemd passed (`policyd.socket`), else the configured
/// address.
pub async fn listen(cfg: &Config) -> Result<TcpListener, ServeError> {
    match crate::service::inherited_listener() {
        Some(l) => Ok(l),
        None => server::bind(cfg).await,
    }
}

/// Serves `cfg` as a service: listen, load (answering 503 meanwhile), notify, serve until
/// `shutdown`, then stop gracefully. `open` opens an engine (on a blocking thread).
pub async fn run<F>(
    cfg: Config,
    open: F,
    shutdown: impl Future<Output = ()>,
) -> Result<(), AppError>
where
    F: Fn(&PolicySpec) -> Result<Box<dyn Engine>, crate::engine::EngineError>
        + Send
        + Sync
        + 'static,
{
    run_with_reload(cfg, open, shutdown, None).await
}

/// [`run`], re-reading the config on each reload request.
pub async fn run_with_reload<F>(
    cfg: Config,
    open: F,
    shutdown: impl Future<Output = ()>,
    reload: Option<Reloader>,
) -> Result<(), AppError>
where
    F: Fn(&PolicySpec) -> Result<Box<dyn Engine>, crate::engine::EngineError>
        + Send
        + Sync
        + 'static,
{
    let open: Arc<OpenFn> = Arc::new(open);
    let origin = cfg
        .policies
        .iter()
        .map(|c| {
            let model = c.model.describe();
            if cfg.named {
                format!("{} ({model})", c.name)
            } else {
                model
            }
        })
        .collect::<Vec<_>>()
        .join(", ");
    // Key files and the TLS certificate are read before the socket is taken, so that a
    // missing file fails the start with its key's name.
    let access = crate::net::Access::load(&cfg).map_err(ServeError::from)?;
    open_files(&cfg);
    let listener = listen(&cfg).await?;
    let addr = listener.local_addr().map_err(AppError::Addr)?;
    notify(&[NotifyState::Status("loading the engine")]);
    let t0 = Instant::now();
    let load_cfg = cfg.clone();
    let opener = open.clone();
    let loading = tokio::task::spawn_blocking(move || {
        crate::policy::build::build(&load_cfg, None, opener.as_ref()).map(|b| b.set)
    });
    let timeout = Duration::from_secs_f64(cfg.server.handshake_timeout_s);
    let set = match crate::net::http::while_loading(&listener, timeout, access.tls.clone(), loading)
        .await
    {
        Ok(Ok(l)) => l,
        Ok(Err(e)) => {
            notify(&[NotifyState::Status(&format!("failed: {e}"))]);
            return Err(e.into());
        }
        Err(e) => return Err(AppError::Loading(e)),
    };
    let backends = set
        .policies
        .iter()
        .map(|p| p.backend)
        .collect::<Vec<_>>()
        .join(", ");
    let warmup = set
        .policies
        .iter()
        .map(|p| p.warmup)
        .max()
        .unwrap_or_default();
    let status = format!(
        "serving {} on {}://{addr} ({backends} backend, loaded in {:.0} ms)",
        origin,
        if access.tls.is_some() { "wss" } else { "ws" },
        t0.elapsed().as_secs_f64() * 1e3
    );
    log::info!(
        "{status}; warm-up {:.1} ms; vllm-omni on {}, health on /healthz",
        warmup.as_secs_f64() * 1e3,
        VLLM_PATH
    );
    if set.policies.len() > 1 {
        log::info!(
            "policies: {} (default \"{}\"), chosen with /policies/<name> or a `policy` field",
            set.names(),
            set.default_policy().name
        );
    }
    let policies = Arc::new(ArcSwap::from_pointee(set));
    let beat = match watchdog_interval() {
        Some(every) => {
            log::info!("systemd watchdog: pinging every {every:?} while the engine progresses");
            Some(tokio::spawn(heartbeat(policies.clone(), every)))
        }
        None => None,
    };
    notify(&[NotifyState::Ready, NotifyState::Status(&status)]);
    let stats = Arc::new(Stats::new());
    let reloader = reload.map(|r| (r, open.clone()));
    let result = server::serve_set(
        cfg,
        access,
        policies,
        stats,
        listener,
        async {
            shutdown.await;
            notify(&[
                NotifyState::Stopping,
                NotifyState::Status("stopping: finishing in-flight requests"),
            ]);
        },
        reloader,
    )
    .await
    .map_err(AppError::from);
    if let Some(b) = beat {
        b.abort();
    }
    result
}
