//! Running as a system service: systemd's notify protocol, the watchdog and socket activation.
//!
//! The order is what a supervisor can trust: the socket is bound (or inherited through
//! `LISTEN_FDS`) first, so clients get 503 rather than a refused connection while the model
//! loads; `READY=1` is sent only once the engine is loaded and warmed; `WATCHDOG=1` is sent only
//! while the engine worker keeps making progress (it beats after every run and every idle
//! [`BEAT`](crate::worker::BEAT)), so a hung engine stops the pings and systemd restarts the
//! service; `STOPPING=1` starts the graceful shutdown. Without `NOTIFY_SOCKET` every
//! notification is a no-op, so the same binary runs by hand.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use sd_notify::NotifyState;
use tokio::net::TcpListener;

use arc_swap::ArcSwap;

use crate::config::Config;
use crate::engine::Engine;
use crate::policy::{OpenFn, PolicySet};
use crate::server::{self, ServerError};

/// Sends notifications to systemd, if it is listening.
pub fn notify(states: &[NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(false, states) {
        log::debug!("sd_notify: {e}");
    }
}

/// How often to send `WATCHDOG=1`: half of `WATCHDOG_USEC`, if systemd set a watchdog.
pub fn watchdog_interval() -> Option<Duration> {
    let mut usec = 0u64;
    sd_notify::watchdog_enabled(false, &mut usec).then(|| Duration::from_micros(usec / 2))
}

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

/// The listener: the first socket systemd passed (`policyd.socket`), else the configured
/// address.
pub async fn listener(cfg: &Config) -> Result<TcpListener, ServerError> {
    if let Ok(mut fds) = sd_notify::listen_fds()
        && let Some(fd) = fds.next()
    {
        use std::os::fd::FromRawFd;
        // SAFETY: systemd hands this process the descriptor (LISTEN_FDS/LISTEN_PID checked by
        // `listen_fds`), and nothing else in it takes ownership.
        let std_listener = unsafe { std::net::TcpListener::from_raw_fd(fd) };
        let inherited = std_listener
            .set_nonblocking(true)
            .and_then(|()| TcpListener::from_std(std_listener));
        match inherited {
            Ok(l) => {
                log::info!("using the socket passed by systemd (LISTEN_FDS)");
                return Ok(l);
            }
            Err(e) => log::warn!("cannot use the socket passed by systemd: {e}; binding"),
        }
    }
    server::bind(cfg).await
}

/// Serves `cfg` as a service: listen, load (answering 503 meanwhile), notify, serve until
/// `shutdown`, then stop gracefully. `open` opens an engine (on a blocking thread).
pub async fn run<F>(cfg: Config, open: F, shutdown: impl Future<Output = ()>) -> Result<(), String>
where
    F: Fn(&Config) -> Result<Box<dyn Engine>, ServerError> + Send + Sync + 'static,
{
    run_with_reload(cfg, open, shutdown, None).await
}

/// Where a reload re-reads the config, and the reload requests (`SIGHUP`).
pub struct ReloadSource {
    pub load: Arc<dyn Fn() -> Result<Config, String> + Send + Sync>,
    pub requests: tokio::sync::mpsc::Receiver<()>,
}

/// [`run`], re-reading the config on each reload request.
pub async fn run_with_reload<F>(
    cfg: Config,
    open: F,
    shutdown: impl Future<Output = ()>,
    reload: Option<ReloadSource>,
) -> Result<(), String>
where
    F: Fn(&Config) -> Result<Box<dyn Engine>, ServerError> + Send + Sync + 'static,
{
    let open: Arc<OpenFn> = Arc::new(open);
    let origin = cfg
        .policy_configs()
        .iter()
        .map(|c| {
            let model = c.model.as_ref().map(|m| m.describe()).unwrap_or_default();
            if cfg.policies.is_empty() {
                model
            } else {
                format!("{} ({model})", c.policy.name)
            }
        })
        .collect::<Vec<_>>()
        .join(", ");
    let listener = listener(&cfg).await.map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    notify(&[NotifyState::Status("loading the engine")]);
    let t0 = Instant::now();
    let load_cfg = cfg.clone();
    let opener = open.clone();
    let loading = tokio::task::spawn_blocking(move || {
        crate::policy::build(&load_cfg, None, opener.as_ref()).map(|b| b.set)
    });
    let timeout = Duration::from_secs_f64(cfg.server.handshake_timeout_s);
    let set =
        match server::while_loading(&listener, timeout, cfg.tls.acceptor.clone(), loading).await {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => {
                notify(&[NotifyState::Status(&format!("failed: {e}"))]);
                return Err(e.to_string());
            }
            Err(e) => return Err(format!("engine loading stopped: {e}")),
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
        if cfg.tls.acceptor.is_some() {
            "wss"
        } else {
            "ws"
        },
        t0.elapsed().as_secs_f64() * 1e3
    );
    log::info!(
        "{status}; warm-up {:.1} ms; vllm-omni on {}, health on /healthz",
        warmup.as_secs_f64() * 1e3,
        server::VLLM_PATH
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
    let stats = Arc::new(server::Stats::new());
    let reloader = reload.map(|r| server::Reloader {
        load: r.load,
        open: open.clone(),
        requests: r.requests,
    });
    let result = server::serve_set(
        cfg,
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
    .map_err(|e| e.to_string());
    if let Some(b) = beat {
        b.abort();
    }
    result
}
