//! Who runs the planner's model server? `planner.serve_command`: a local model server that policyd
//! starts, watches and stops.
//!
//! Its output goes to policyd's log line by line with a prefix, so one journal holds both;
//! readiness is a marker line or the endpoint's probe; on shutdown it gets SIGINT (servers
//! such as vLLM and llama.cpp shut down cleanly on it), then SIGKILL after a grace period.

use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Longest line of the server's output that is logged (the rest is cut).
const MAX_LINE: usize = 4096;

/// A running (or exited) model server.
pub struct Supervisor {
    argv: Vec<String>,
    marker: Option<String>,
    child: Arc<Mutex<Option<Child>>>,
    ready_rx: Mutex<Receiver<()>>,
    ready_tx: Sender<()>,
}

impl Supervisor {
    /// Starts `argv`.
    pub fn start(argv: &[String], marker: Option<String>) -> std::io::Result<Supervisor> {
        let (ready_tx, ready_rx) = channel();
        let s = Supervisor {
            argv: argv.to_vec(),
            marker,
            child: Arc::new(Mutex::new(None)),
            ready_rx: Mutex::new(ready_rx),
            ready_tx,
        };
        s.spawn()?;
        Ok(s)
    }

    /// The server process's pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.lock().as_ref().map(Child::id)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Child>> {
        self.child.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// (Re)starts the process, with its output streamed to the log.
    pub fn spawn(&self) -> std::io::Result<()> {
        let mut cmd = Command::new(&self.argv[0]);
        // SAFETY: the closure runs in the child between fork and exec and only calls
        // signal(2) and sigprocmask(2), which are async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                // A shell that started policyd in the background may have left SIGINT ignored,
                // and ignored signals survive exec: the server must get the stop signals.
                for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
                    libc::signal(sig, libc::SIG_DFL);
                }
                let mut none: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut none);
                libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
                Ok(())
            });
        }
        let mut child = cmd
            .args(&self.argv[1..])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!("planner.serve_command: cannot start {}: {e}", self.argv[0]),
                )
            })?;
        log::info!(
            "planner: started {} (pid {})",
            self.argv.join(" "),
            child.id()
        );
        if let Some(out) = child.stdout.take() {
            self.stream(out, "stdout");
        }
        if let Some(err) = child.stderr.take() {
            self.stream(err, "stderr");
        }
        *self.lock() = Some(child);
        Ok(())
    }

    fn stream(&self, pipe: impl Read + Send + 'static, name: &'static str) {
        let marker = self.marker.clone();
        let tx = self.ready_tx.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("planner-{name}"))
            .spawn(move || {
                let mut r = BufReader::new(pipe);
                let mut line = Vec::new();
                loop {
                    line.clear();
                    match r.by_ref().take(MAX_LINE as u64).read_until(b'\n', &mut line) {
                        Ok(0) | Err(_) => break,
                        Ok(_) => {}
                    }
                    // A line longer than MAX_LINE is logged in pieces.
                    let text = String::from_utf8_lossy(&line);
                    let text = text.trim_end();
                    log::info!(target: "policyd::planner::server", "[planner server {name}] {text}");
                    if marker.as_deref().is_some_and(|m| text.contains(m)) {
                        let _ = tx.send(());
                    }
                }
            });
        if let Err(e) = spawned {
            log::warn!("planner: cannot start the {name} reader: {e}");
        }
    }

    /// Waits until the marker line appears (with a marker) or `probe` succeeds (without),
    /// at most `timeout`. False if the process exited or time ran out.
    pub fn wait_ready(&self, timeout: Duration, mut probe: impl FnMut() -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.exited() {
                log::error!("planner: the model server exited before it was ready ({status})");
                return false;
            }
            let now = Instant::now();
            if now >= deadline {
                log::error!(
                    "planner: the model server is not ready after {timeout:?}; going on (the \
                     endpoints are probed with backoff)"
                );
                return false;
            }
            let step = (deadline - now).min(Duration::from_millis(250));
            if self.marker.is_some() {
                let rx = self.ready_rx.lock().unwrap_or_else(|p| p.into_inner());
                if rx.recv_timeout(step).is_ok() {
                    return true;
                }
            } else if probe() {
                return true;
            } else {
                std::thread::sleep(step);
            }
        }
    }

    /// The exit status, once the process has exited.
    pub fn exited(&self) -> Option<ExitStatus> {
        let mut g = self.lock();
        match g.as_mut().map(Child::try_wait) {
            Some(Ok(Some(status))) => Some(status),
            _ => None,
        }
    }

    /// SIGINT, then SIGKILL if it has not exited after `grace`.
    pub fn stop(&self, grace: Duration) {
        let mut g = self.lock();
        let Some(child) = g.as_mut() else { return };
        if let Ok(Some(_)) = child.try_wait() {
            *g = None;
            return;
        }
        let pid = child.id() as libc::pid_t;
        // SAFETY: kill(2) on the pid of a child not yet reaped (try_wait said it runs), so the
        // pid cannot have been reused.
        unsafe {
            libc::kill(pid, libc::SIGINT);
        }
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                log::info!("planner: the model server stopped ({status})");
                *g = None;
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        log::warn!("planner: the model server ignored SIGINT for {grace:?}; killing it");
        let _ = child.kill();
        let _ = child.wait();
        *g = None;
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.stop(Duration::ZERO);
    }
}
