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

/// Raises this process's open-file limit (`RLIMIT_NOFILE`) to `need`, as far as the hard limit
/// allows: systemd's default is 1024 soft (which the unit keeps) and 524288 hard, and the
/// connection caps may need more than 1024. Returns the limits now in force, `(soft, hard)`.
// `rlim_t` is a u64 on 64-bit Linux, not on every target: the casts are kept.
#[allow(clippy::unnecessary_cast)]
pub fn raise_open_files(need: u64) -> std::io::Result<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given; nothing else is touched.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let (soft, hard) = (lim.rlim_cur as u64, lim.rlim_max as u64);
    if soft >= need {
        return Ok((soft, hard));
    }
    let want = need.min(hard);
    lim.rlim_cur = want as libc::rlim_t;
    // SAFETY: setrlimit reads the struct it is given; the soft limit stays within the hard.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((want, hard))
}
