//! What stops an oversized message? The read-side size guard under tungstenite: oversized messages
//! are discarded unread.
//!
//! tungstenite can only refuse a frame over its size limit by failing the connection, because
//! the payload is still on the socket. The vllm-omni dialect must answer an oversized message
//! with an error map and keep the socket, so this guard sits between the TCP stream and
//! tungstenite, parses client frame headers as they pass, and when a data message would grow
//! past `server.max_message_bytes` it drops the payload as it arrives (through a fixed scratch
//! buffer, never holding it) and hands tungstenite a short, valid substitute frame whose
//! payload ends in a [marker](oversize_marker). The connection recognises the marker and reports
//! the error in its dialect. Control frames and messages within the limit pass through
//! untouched, mostly without a copy.
//!
//! A fragmented message that crosses the limit keeps the fragments already passed; its marker
//! is appended to them, so the connection still sees one message ending in the marker. The
//! marker is ASCII so a fragmented text message stays valid UTF-8 when cut at a character.
//!
//! The guard also times each frame (`server.frame_timeout_s`): a client that starts a frame and
//! stops sending (a half-sent frame) cannot pong, but it could still hold its connection until
//! the keepalive gives up; a frame not complete within the timeout fails the read instead.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// Starts every marker; followed by [`LEN_DIGITS`] decimal digits (the message's size) and NUL.
const MARKER_PREFIX: &[u8] = b"\0policyd:message-over-size-limit:";
/// Width of the size field in a marker.
const LEN_DIGITS: usize = 20;
/// Length of a complete marker.
pub const MARKER_LEN: usize = MARKER_PREFIX.len() + LEN_DIGITS + 1;
/// Read-ahead buffer for headers (and the bytes a client sent right after its HTTP head).
pub const INBUF: usize = crate::limits::FRAME_GUARD_BUFFER;
/// Largest frame header: 2 bytes, 8 of extended length, 4 of mask.
const MAX_HEADER: usize = 14;

/// If `message` ends in a marker left by [`FrameGuard`], the size the client's message had
/// (or reached before it was dropped, for a message that never finished).
pub fn oversize_marker(message: &[u8]) -> Option<u64> {
    let start = message.len().checked_sub(MARKER_LEN)?;
    let m = &message[start..];
    let (prefix, rest) = m.split_at(MARKER_PREFIX.len());
    if prefix != MARKER_PREFIX || rest[LEN_DIGITS] != 0 {
        return None;
    }
    std::str::from_utf8(&rest[..LEN_DIGITS])
        .ok()?
        .trim_start_matches('0')
        .parse::<u64>()
        .ok()
        .or(Some(0))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Between frames: the next bytes are a frame header.
    Header,
    /// Inside a frame's payload that goes to tungstenite.
    Pass(u64),
    /// Inside a frame's payload that is being dropped.
    Discard(u64),
}

/// The read error of a connection whose peer has not read what the server wrote for
/// `server.write_timeout_s` (see [`FrameGuard::with_write_timeout`]).
pub const NOT_READING: &str =
    "the client has not read the server's frames within server.write_timeout_s";

/// The error inside the [`io::Error`] a stalled connection's read or write fails with.
#[derive(Debug)]
pub struct NotReading;

impl std::fmt::Display for NotReading {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(NOT_READING)
    }
}

impl std::error::Error for NotReading {}

impl NotReading {
    fn error() -> io::Error {
        io::Error::new(io::ErrorKind::TimedOut, NotReading)
    }

    /// Whether tungstenite's error is a stalled connection's.
    pub fn is(e: &tokio_tungstenite::tungstenite::Error) -> bool {
        matches!(e, tokio_tungstenite::tungstenite::Error::Io(e)
            if e.get_ref().is_some_and(|inner| inner.is::<NotReading>()))
    }
}

/// A stream that enforces the message size limit on what it reads (see the module docs).
pub struct FrameGuard<S> {
    inner: S,
    limit: u64,
    state: State,
    /// Read-ahead bytes not yet processed: `inbuf[start..end]`.
    inbuf: Box<[u8]>,
    start: usize,
    end: usize,
    /// Bytes produced for tungstenite (a header, or a substitute frame) not yet handed over.
    out: [u8; MAX_HEADER + MARKER_LEN],
    out_start: usize,
    out_end: usize,
    /// Size of the data message in progress, fragments included.
    message: u64,
    /// The message in progress crossed the limit; its further fragments are dropped.
    dropping: bool,
    /// How long one frame may take to arrive, from its first byte to its last.
    frame_timeout: Option<Duration>,
    /// The timer for the frame in progress (allocated once, reset per frame).
    deadline: Option<Pin<Box<Sleep>>>,
    /// Frame headers consumed so far; the timer is armed for frame number `armed_for`.
    headers: u64,
    armed_for: Option<u64>,
    /// How long the peer may leave what the server writes unread (`server.write_timeout_s`),
    /// and its timer (allocated once, reset when a stall starts).
    write_timeout: Option<(Duration, Pin<Box<Sleep>>)>,
    /// Writes have made no progress since the timer was reset (the send buffer is full).
    write_stalled: bool,
}

impl<S> FrameGuard<S> {
    /// Wraps `inner`; `already_read` are bytes read from it past the HTTP head (at most
    /// 16 KiB; a longer prefix is an error from the caller's head reader, which is smaller).
    pub fn new(inner: S, already_read: &[u8], limit: usize) -> io::Result<Self> {
        Self::with_frame_timeout(inner, already_read, limit, None)
    }

    /// As [`FrameGuard::new`], and a frame whose bytes take longer than `frame_timeout` to
    /// arrive fails the read with [`io::ErrorKind::TimedOut`].
    pub fn with_frame_timeout(
        inner: S,
        already_read: &[u8],
        limit: usize,
        frame_timeout: Option<Duration>,
    ) -> io::Result<Self> {
        if already_read.len() > INBUF {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "too many bytes after the HTTP head",
            ));
        }
        let mut inbuf = vec![0u8; INBUF].into_boxed_slice();
        inbuf[..already_read.len()].copy_from_slice(already_read);
        Ok(Self {
            inner,
            limit: limit as u64,
            state: State::Header,
            inbuf,
            start: 0,
            end: already_read.len(),
            out: [0; MAX_HEADER + MARKER_LEN],
            out_start: 0,
            out_end: 0,
            message: 0,
            dropping: false,
            frame_timeout,
            deadline: frame_timeout.map(|_| Box::pin(tokio::time::sleep(Duration::ZERO))),
            headers: 0,
            armed_for: None,
            write_timeout: None,
            write_stalled: false,
        })
    }

    /// A peer that leaves the server's writes unread for `timeout` (its receive window and
    /// the server's send buffer full) fails the next read with [`io::ErrorKind::TimedOut`]:
    /// tungstenite keeps reading while its writes block (a peer that sends pings and never
    /// reads the pongs), so the read is where the connection learns of it.
    pub fn with_write_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.write_timeout = timeout.map(|t| (t, Box::pin(tokio::time::sleep(t))));
        self
    }

    /// Records whether a write made progress: the stall clock starts at the first write that
    /// could not, and stops at the next that could. A write still blocked when the clock runs
    /// out fails with [`NOT_READING`] (the timer wakes it), so a send to a peer that stopped
    /// reading ends after the stall, however long a slow but reading peer takes.
    fn note_write<T>(
        &mut self,
        cx: &mut Context<'_>,
        r: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        match r {
            Poll::Pending => {
                if !self.write_stalled
                    && let Some((t, timer)) = self.write_timeout.as_mut()
                {
                    timer.as_mut().reset(tokio::time::Instant::now() + *t);
                    self.write_stalled = true;
                }
                if self.write_overdue(cx) {
                    return Poll::Ready(Err(NotReading::error()));
                }
                Poll::Pending
            }
            Poll::Ready(r) => {
                self.write_stalled = false;
                Poll::Ready(r)
            }
        }
    }

    /// `true` once writes have been stalled for the write timeout (registering the waker).
    fn write_overdue(&mut self, cx: &mut Context<'_>) -> bool {
        self.write_stalled
            && self
                .write_timeout
                .as_mut()
                .is_some_and(|(_, timer)| timer.as_mut().poll(cx).is_ready())
    }

    /// While a frame is in progress (its header or payload partly read), the frame's timer;
    /// `true` once it has run out.
    fn frame_overdue(&mut self, cx: &mut Context<'_>) -> bool {
        let (Some(timeout), Some(deadline)) = (self.frame_timeout, self.deadline.as_mut()) else {
            return false;
        };
        let current = match self.state {
            State::Header if self.start == self.end => {
                self.armed_for = None;
                return false;
            }
            // Part of the next header is in: that frame has started.
            State::Header => self.headers + 1,
            State::Pass(_) | State::Discard(_) => self.headers,
        };
        if self.armed_for != Some(current) {
            deadline.as_mut().reset(Instant::now() + timeout);
            self.armed_for = Some(current);
        }
        deadline.as_mut().poll(cx).is_ready()
    }

    /// Handles the complete header at the front of `inbuf` (of `len` bytes).
    /// A header that breaks the length encoding: tungstenite gets an empty frame with RSV1
    /// set (the same FIN, opcode and mask), which it refuses with 1002, and nothing after it
    /// is read.
    fn refuse_header(&mut self, len: usize, b0: u8, mask: Option<[u8; 4]>) {
        crate::log_limited!(
            log::Level::Info,
            "a frame header breaks RFC 6455's length encoding; closing with 1002"
        );
        let o = &mut self.out;
        o[0] = (b0 & 0x8f) | 0x40;
        o[1] = if mask.is_some() { 0x80 } else { 0 };
        let mut n = 2;
        if let Some(mask) = mask {
            o[2..6].copy_from_slice(&mask);
            n = 6;
        }
        self.out_start = 0;
        self.out_end = n;
        self.start += len;
        self.state = State::Discard(u64::MAX);
    }

    fn on_header(&mut self, len: usize) {
        self.headers += 1;
        let h = &self.inbuf[self.start..self.start + len];
        let b0 = h[0];
        let masked = h[1] & 0x80 != 0;
        let payload = payload_len(h);
        let mut mask = [0u8; 4];
        if masked {
            mask.copy_from_slice(&h[len - 4..len]);
        }
        // RFC 6455 §5.2: a 64-bit length has its top bit clear, and every length uses the
        // fewest bytes. A header that breaks either is a protocol error: tungstenite gets a
        // header it refuses as one (RSV1 set, which no extension here allows), so the client
        // gets close 1002, and nothing after it is read.
        let ext = h[1] & 0x7f;
        if (ext == 127 && (payload >> 63 != 0 || payload < 1 << 16))
            || (ext == 126 && payload < 126)
        {
            self.refuse_header(len, b0, masked.then_some(mask));
            return;
        }
        let fin = b0 & 0x80 != 0;
        let opcode = b0 & 0x0f;
        let data = opcode < 8;
        if data && opcode != 0 {
            self.message = 0;
            self.dropping = false;
        }
        let over = data && (self.dropping || self.message.saturating_add(payload) > self.limit);
        if !over {
            if data {
                self.message += payload;
            }
            self.out[..len].copy_from_slice(h);
            self.out_start = 0;
            self.out_end = len;
            self.start += len;
            self.state = if payload == 0 {
                State::Header
            } else {
                State::Pass(payload)
            };
            return;
        }
        // Substitute: same FIN and mask; a text start frame becomes binary so the marker
        // needs no UTF-8 care when the message is not fragmented.
        self.message = self.message.saturating_add(payload);
        let first = !self.dropping;
        self.dropping = !fin;
        if first {
            crate::log_limited!(
                log::Level::Info,
                "dropping a message of more than {} bytes (server.max_message_bytes)",
                self.limit
            );
        }
        let op = if opcode == 1 && fin { 2 } else { opcode };
        let mut marker = [0u8; MARKER_LEN];
        let body: &[u8] = if fin {
            marker[..MARKER_PREFIX.len()].copy_from_slice(MARKER_PREFIX);
            let digits = format_digits(self.message);
            marker[MARKER_PREFIX.len()..MARKER_PREFIX.len() + LEN_DIGITS].copy_from_slice(&digits);
            &marker
        } else {
            &[]
        };
        let o = &mut self.out;
        o[0] = (b0 & 0xf0) | op;
        o[1] = (if masked { 0x80 } else { 0 }) | body.len() as u8;
        let mut n = 2;
        if masked {
            o[2..6].copy_from_slice(&mask);
            n = 6;
        }
        for (i, &b) in body.iter().enumerate() {
            o[n + i] = if masked { b ^ mask[i % 4] } else { b };
        }
        self.out_start = 0;
        self.out_end = n + body.len();
        self.start += len;
        self.state = if payload == 0 {
            State::Header
        } else {
            State::Discard(payload)
        };
    }
}

/// The payload length a complete header declares.
fn payload_len(h: &[u8]) -> u64 {
    match h[1] & 0x7f {
        126 => u64::from(u16::from_be_bytes([h[2], h[3]])),
        127 => {
            let mut b = [0u8; 8];
            b.copy_from_slice(&h[2..10]);
            u64::from_be_bytes(b)
        }
        n => u64::from(n),
    }
}

/// How long the header starting with `h` is, once its first two bytes are known.
fn header_len(h: &[u8]) -> usize {
    let ext = match h[1] & 0x7f {
        126 => 2,
        127 => 8,
        _ => 0,
    };
    2 + ext + if h[1] & 0x80 != 0 { 4 } else { 0 }
}

fn format_digits(mut v: u64) -> [u8; LEN_DIGITS] {
    let mut d = [b'0'; LEN_DIGITS];
    for slot in d.iter_mut().rev() {
        *slot = b'0' + (v % 10) as u8;
        v /= 10;
    }
    d
}

impl<S: AsyncRead + Unpin> FrameGuard<S> {
    /// Reads more bytes into the read-ahead buffer; `Ok(0)` at end of stream.
    fn fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.start > 0 && self.end == self.inbuf.len() {
            self.inbuf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let mut rb = ReadBuf::new(&mut self.inbuf[self.end..]);
        ready!(Pin::new(&mut self.inner).poll_read(cx, &mut rb))?;
        let n = rb.filled().len();
        self.end += n;
        Poll::Ready(Ok(n))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for FrameGuard<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.write_overdue(cx) {
            return Poll::Ready(Err(NotReading::error()));
        }
        let r = this.read_frames(cx, buf);
        if r.is_pending() && this.frame_overdue(cx) {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "a frame did not arrive in full within server.frame_timeout_s",
            )));
        }
        r
    }
}

impl<S: AsyncRead + Unpin> FrameGuard<S> {
    /// The guard's read: headers parsed, oversized payloads dropped (see the module docs).
    fn read_frames(&mut self, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self;
        loop {
            if this.out_start < this.out_end {
                let n = (this.out_end - this.out_start).min(buf.remaining());
                buf.put_slice(&this.out[this.out_start..this.out_start + n]);
                this.out_start += n;
                return Poll::Ready(Ok(()));
            }
            match this.state {
                State::Pass(left) => {
                    let want = usize::try_from(left)
                        .unwrap_or(usize::MAX)
                        .min(buf.remaining());
                    if this.start < this.end {
                        let n = want.min(this.end - this.start);
                        buf.put_slice(&this.inbuf[this.start..this.start + n]);
                        this.start += n;
                        this.advance(n as u64);
                        return Poll::Ready(Ok(()));
                    }
                    // Large payloads go straight from the socket into tungstenite's buffer
                    // (already initialised by tokio-tungstenite, so this costs no memset).
                    let n = {
                        let mut direct = ReadBuf::new(buf.initialize_unfilled_to(want));
                        ready!(Pin::new(&mut this.inner).poll_read(cx, &mut direct))?;
                        direct.filled().len()
                    };
                    buf.advance(n);
                    this.advance(n as u64);
                    return Poll::Ready(Ok(()));
                }
                State::Discard(left) => {
                    if this.start < this.end {
                        let n = usize::try_from(left)
                            .unwrap_or(usize::MAX)
                            .min(this.end - this.start);
                        this.start += n;
                        this.advance(n as u64);
                        continue;
                    }
                    if ready!(this.fill(cx))? == 0 {
                        return Poll::Ready(Ok(()));
                    }
                }
                State::Header => {
                    let have = this.end - this.start;
                    let need = if have >= 2 {
                        header_len(&this.inbuf[this.start..this.end])
                    } else {
                        2
                    };
                    if have >= need {
                        this.on_header(need);
                        continue;
                    }
                    if ready!(this.fill(cx))? == 0 {
                        // End of stream: hand over any partial header so tungstenite sees
                        // the truncation, then end.
                        if this.start < this.end {
                            let n = (this.end - this.start).min(buf.remaining());
                            buf.put_slice(&this.inbuf[this.start..this.start + n]);
                            this.start += n;
                        }
                        return Poll::Ready(Ok(()));
                    }
                }
            }
        }
    }
}

impl<S> FrameGuard<S> {
    fn advance(&mut self, n: u64) {
        self.state = match self.state {
            State::Pass(left) if left > n => State::Pass(left - n),
            State::Discard(left) if left > n => State::Discard(left - n),
            _ => State::Header,
        };
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for FrameGuard<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, data);
        self.note_write(cx, r)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.note_write(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests;
