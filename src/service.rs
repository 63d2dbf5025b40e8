//! How does policyd talk to systemd? The notify protocol, the watchdog interval and socket
//! activation (the policy-aware parts, what is ready and what beats, are in [`crate::app`]).
//!
//! The order is what a supervisor can trust: the socket is bound (or inherited through
//! `LISTEN_FDS`) first, so clients get 503 rather than a refused connection while the model
//! loads; `READY=1` is sent only once the engine is loaded and warmed; `WATCHDOG=1` is sent only
//! while the engine worker keeps making progress (it beats after every run and every idle
//! `BEAT`), so a hung engine stops the pings and systemd restarts the
//! service; `STOPPING=1` starts the graceful shutdown. Without `NOTIFY_SOCKET` every
//! notification is a no-op, so the same binary runs by hand.

use std::time::Duration;

use sd_notify::NotifyState;
use tokio::net::TcpListener;

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

/// The first socket systemd passed (`policyd.socket`, `LISTEN_FDS`), if any and usable.
pub fn inherited_listener() -> Option<TcpListener> {
    let mut fds = sd_notify::listen_fds().ok()?;
    let fd = fds.next()?;
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
            Some(l)
        }
        Err(e) => {
            log::warn!("cannot use the socket passed by systemd: {e}; binding");
            None
        }
    }
}
