//! How is one gRPC connection kept within bounds? LeRobot's service is plaintext HTTP/2 on its
//! own port, and tonic bounds neither how many connections stay open nor for how long. Each
//! accepted socket is wrapped in a [`GrpcConn`] that holds one of `lerobot.max_connections`
//! permits for its life and closes it:
//! - when the HTTP/2 preface has not arrived `lerobot.handshake_timeout_s` after accept (as
//!   nginx's `client_header_timeout`), or no call has started within as long again after it
//!   (a preface and an empty SETTINGS hold no slot for long), and
//! - when no call has been in progress for `lerobot.idle_timeout_s` (Envoy's `idle_timeout`:
//!   idle means no active stream, so HTTP/2 PINGs do not keep a connection alive).
//!
//! Each call sees its connection's [`ConnInfo`] (tonic puts it in the request's extensions):
//! the peer, and the [`Activity`] a call marks while it runs. The LeRobot session uses the
//! same record to know whether its owner's connection is still open.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Sleep;

use crate::net::peers::PeerPermit;

/// The HTTP/2 client connection preface (`PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`), in bytes.
const PREFACE_LEN: usize = 24;

/// What one connection's calls have done: how many run now, when the last one ended, and
/// whether the connection is gone.
#[derive(Debug)]
pub struct Activity {
    calls: AtomicUsize,
    /// Milliseconds after `epoch` of the last call's end (or the connection's start).
    last_ms: AtomicU64,
    epoch: Instant,
    closed: AtomicBool,
    /// A call has started on the connection.
    started: AtomicBool,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            calls: AtomicUsize::new(0),
            last_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            closed: AtomicBool::new(false),
            started: AtomicBool::new(false),
        }
    }

    /// Marks a call in progress until the returned guard drops.
    pub fn call(self: &Arc<Self>) -> Call {
        self.calls.fetch_add(1, Ordering::AcqRel);
        self.started.store(true, Ordering::Release);
        Call(self.clone())
    }

    fn touch(&self) {
        let ms = self.epoch.elapsed().as_millis() as u64;
        self.last_ms.store(ms, Ordering::Release);
    }

    /// How long no call has been in progress; `None` while one is.
    pub fn idle_for(&self) -> Option<Duration> {
        if self.calls.load(Ordering::Acquire) > 0 {
            return None;
        }
        let last = Duration::from_millis(self.last_ms.load(Ordering::Acquire));
        Some(self.epoch.elapsed().saturating_sub(last))
    }

    /// The connection has closed (its socket is dropped).
    pub fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
}

/// A call in progress on its connection (see [`Activity::call`]).
pub struct Call(Arc<Activity>);

impl Drop for Call {
    fn drop(&mut self) {
        self.0.touch();
        self.0.calls.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What a call knows of its connection (tonic's `ConnectInfo`).
#[derive(Clone, Debug)]
pub struct ConnInfo {
    pub peer: SocketAddr,
    pub activity: Arc<Activity>,
}

/// An accepted socket under the service's connection limits (see the module's doc).
pub struct GrpcConn {
    stream: TcpStream,
    info: ConnInfo,
    _permit: OwnedSemaphorePermit,
    _peer: PeerPermit,
    /// Preface bytes read so far (up to [`PREFACE_LEN`]).
    preface: usize,
    /// The preface arrived and the first call's deadline is set.
    awaiting_call: bool,
    handshake: Duration,
    idle: Duration,
    timer: Pin<Box<Sleep>>,
}

impl GrpcConn {
    pub fn new(
        stream: TcpStream,
        peer: SocketAddr,
        permits: (OwnedSemaphorePermit, PeerPermit),
        handshake: Duration,
        idle: Duration,
    ) -> GrpcConn {
        let activity = Arc::new(Activity::new());
        GrpcConn {
            stream,
            info: ConnInfo { peer, activity },
            _permit: permits.0,
            _peer: permits.1,
            preface: 0,
            awaiting_call: false,
            handshake,
            idle,
            timer: Box::pin(tokio::time::sleep(handshake)),
        }
    }

    /// Polls the connection's deadline: an error once it has passed with nothing to excuse it.
    fn check(&mut self, cx: &mut Context<'_>) -> std::io::Result<()> {
        loop {
            if self.timer.as_mut().poll(cx).is_pending() {
                return Ok(());
            }
            if self.preface < PREFACE_LEN {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "no HTTP/2 preface within lerobot.handshake_timeout_s",
                ));
            }
            if self.awaiting_call {
                if !self.info.activity.started.load(Ordering::Acquire) {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "no call within lerobot.handshake_timeout_s of the HTTP/2 preface",
                    ));
                }
                self.awaiting_call = false;
            }
            let next = match self.info.activity.idle_for() {
                None => self.idle,
                Some(d) if d >= self.idle => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "idle for lerobot.idle_timeout_s",
                    ));
                }
                Some(d) => self.idle - d,
            };
            let at = tokio::time::Instant::now() + next;
            self.timer.as_mut().reset(at);
        }
    }
}

impl Drop for GrpcConn {
    fn drop(&mut self) {
        self.info.activity.closed.store(true, Ordering::Release);
    }
}

impl AsyncRead for GrpcConn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if let Err(e) = this.check(cx) {
            return Poll::Ready(Err(e));
        }
        let before = buf.filled().len();
        let r = Pin::new(&mut this.stream).poll_read(cx, buf);
        if this.preface < PREFACE_LEN && matches!(r, Poll::Ready(Ok(()))) {
            this.preface += buf.filled().len() - before;
            if this.preface >= PREFACE_LEN {
                // Handshake done: a call must start within as long again; then the idle clock
                // runs.
                this.info.activity.touch();
                this.awaiting_call = true;
                let at = tokio::time::Instant::now() + this.handshake;
                this.timer.as_mut().reset(at);
            }
        }
        r
    }
}

impl AsyncWrite for GrpcConn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for GrpcConn {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        self.info.clone()
    }
}
