//! One WebSocket connection: metadata frame, then request → reply, in order.
//!
//! The socket task never runs the model: it decodes into a slot, hands the slot to the engine
//! worker and keeps reading the socket (so pings are answered while the model runs). A request
//! that arrives while one is in flight waits in a one-frame buffer; past that the task stops
//! reading, which is back-pressure on the client, not memory growth.

use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::{Bytes, Message};

use crate::frame_guard::oversize_marker;
use crate::server::Shared;
use crate::session::Sessions;
use crate::wire::{self, Endpoint, Timing};
use crate::worker::ReplyPort;

/// Which protocol dialect a connection speaks (chosen by path).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    /// openpi: `{"actions": …, timing}` replies; errors as a text frame, then close 1011.
    Openpi,
    /// vllm-omni: bare float32 arrays; errors as msgpack maps, the socket stays open.
    Vllm,
}

impl Dialect {
    pub fn name(self) -> &'static str {
        match self {
            Dialect::Openpi => "openpi",
            Dialect::Vllm => "vllm-omni",
        }
    }
}

/// openpi's close reason after an error text frame.
const OPENPI_ERROR_REASON: &str = "Internal server error. Traceback included in previous frame.";

/// What went wrong with a request.
enum Failure {
    /// The request itself (vllm-omni: "Invalid request payload").
    Request(String),
    /// The engine or its output (vllm-omni: "Internal inference error").
    Inference(String),
}

/// A request being run by the engine.
struct InFlight {
    received: Instant,
}

/// Serves a connection until it closes; returns why it ended.
pub async fn serve<S>(mut ws: WebSocketStream<S>, shared: &Shared, dialect: Dialect) -> String
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let cfg = &shared.cfg.server;
    let plan = &shared.plan;
    if ws
        .send(Message::Binary(shared.metadata.clone()))
        .await
        .is_err()
    {
        return "client left before the metadata frame".into();
    }
    let mut sessions = Sessions::new(cfg.max_sessions);
    let mut port = ReplyPort::new(&shared.worker.pool);
    let mut out: Vec<u8> = Vec::with_capacity(plan.reply_capacity.max(1024));
    let mut pending: Option<(Bytes, Instant)> = None;
    let mut in_flight: Option<InFlight> = None;
    let mut prev_total_ms: Option<f64> = None;
    let mut shutdown = shared.shutdown.clone();
    let mut stopping = *shutdown.borrow();

    let ping_every =
        (cfg.ping_interval_s > 0.0).then(|| Duration::from_secs_f64(cfg.ping_interval_s));
    let pong_timeout = Duration::from_secs_f64(cfg.ping_timeout_s.max(0.001));
    let mut ping = tokio::time::interval(ping_every.unwrap_or(Duration::from_secs(3600)));
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ping.reset();
    let mut ping_sent: Option<Instant> = None;
    let idle = (cfg.idle_timeout_s > 0.0).then(|| Duration::from_secs_f64(cfg.idle_timeout_s));
    let mut last_activity = Instant::now();

    loop {
        // On shutdown, a request already read (in flight or waiting) is still answered.
        if stopping && in_flight.is_none() && pending.is_none() {
            close(&mut ws, CloseCode::Away, "server shutting down").await;
            return "server shutdown (1001)".into();
        }
        // Start the next request if the engine is free for this connection.
        if in_flight.is_none()
            && let Some((frame, received)) = pending.take()
        {
            match start(&frame, shared, &mut sessions, &port, &mut out).await {
                Ok(Started::InFlight) => in_flight = Some(InFlight { received }),
                Ok(Started::Replied(msg)) => {
                    if ws.send(msg).await.is_err() {
                        return "client went away".into();
                    }
                }
                Err(f) => {
                    if let Some(why) = fail(&mut ws, dialect, f, &mut out).await {
                        return why;
                    }
                }
            }
            continue;
        }
        let idle_deadline = idle.map(|d| last_activity + d);
        tokio::select! {
            changed = shutdown.changed(), if !stopping => {
                if changed.is_err() || *shutdown.borrow() {
                    stopping = true;
                }
            }
            lease = port.recv(), if in_flight.is_some() => {
                let Some(mut lease) = lease else {
                    return "engine worker stopped".into();
                };
                let received = in_flight.take().map(|f| f.received).unwrap_or_else(Instant::now);
                let slot = lease.slot();
                let result = match slot.result.take() {
                    Some(Ok(stats)) => match plan.non_finite_output(&slot.outputs) {
                        Some(name) => Err(Failure::Inference(format!("the engine produced NaN or infinity in output '{name}'"))),
                        None => Ok(stats),
                    },
                    Some(Err(e)) => Err(Failure::Inference(e.to_string())),
                    None => Err(Failure::Inference("the engine returned no result".into())),
                };
                match result {
                    Ok(stats) => {
                        match dialect {
                            Dialect::Openpi => {
                                let timing = Timing {
                                    policy_infer_ms: stats.compute.as_secs_f64() * 1e3,
                                    server_infer_ms: received.elapsed().as_secs_f64() * 1e3,
                                    prev_total_ms,
                                };
                                plan.encode_openpi(&slot.outputs, &timing, &mut out);
                            }
                            Dialect::Vllm => plan.encode_vllm(&slot.outputs, &mut out),
                        }
                        drop(lease);
                        if ws.send(Message::Binary(Bytes::copy_from_slice(&out))).await.is_err() {
                            return "client went away".into();
                        }
                        prev_total_ms = Some(received.elapsed().as_secs_f64() * 1e3);
                    }
                    Err(f) => {
                        drop(lease);
                        log::warn!("inference failed: {}", match &f { Failure::Request(m) | Failure::Inference(m) => m });
                        if let Some(why) = fail(&mut ws, dialect, f, &mut out).await {
                            return why;
                        }
                    }
                }
                last_activity = Instant::now();
            }
            msg = ws.next(), if pending.is_none() && !stopping => {
                last_activity = Instant::now();
                match msg {
                    None => return "client closed the connection".into(),
                    Some(Ok(Message::Binary(b))) => match oversize_marker(&b) {
                        None => pending = Some((b, Instant::now())),
                        Some(size) => {
                            if let Some(why) = fail(&mut ws, dialect, oversize(size, cfg.max_message_bytes), &mut out).await {
                                return why;
                            }
                        }
                    },
                    Some(Ok(Message::Text(t))) => {
                        let f = match oversize_marker(t.as_bytes()) {
                            Some(size) => oversize(size, cfg.max_message_bytes),
                            None => Failure::Request("text frames are not accepted; send the observation as a binary msgpack frame".into()),
                        };
                        if let Some(why) = fail(&mut ws, dialect, f, &mut out).await {
                            return why;
                        }
                    }
                    Some(Ok(Message::Pong(_))) => ping_sent = None,
                    Some(Ok(Message::Ping(_))) | Some(Ok(Message::Frame(_))) => {}
                    Some(Ok(Message::Close(_))) => {
                        // tungstenite answers the close; drive it to the end.
                        while let Ok(Some(_)) = tokio::time::timeout(Duration::from_secs(1), ws.next()).await {}
                        return "client closed the connection".into();
                    }
                    Some(Err(e)) => return format!("protocol error: {e}"),
                }
            }
            _ = ping.tick(), if ping_every.is_some() => {
                match ping_sent {
                    Some(t) if t.elapsed() >= pong_timeout => {
                        close(&mut ws, CloseCode::Error, "keepalive ping timeout").await;
                        return "keepalive ping timeout".into();
                    }
                    Some(_) => {}
                    None => {
                        if ws.send(Message::Ping(Bytes::new())).await.is_err() {
                            return "client went away".into();
                        }
                        ping_sent = Some(Instant::now());
                    }
                }
            }
            _ = sleep_until_opt(idle_deadline), if idle_deadline.is_some() && in_flight.is_none() && pending.is_none() => {
                close(&mut ws, CloseCode::Normal, "idle timeout").await;
                return "idle timeout".into();
            }
        }
    }
}

/// The error for a message the frame guard dropped for its size.
fn oversize(size: u64, limit: usize) -> Failure {
    Failure::Request(format!(
        "the message ({size} bytes or more) exceeds server.max_message_bytes = {limit}; it was discarded unread"
    ))
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d.into()).await,
        None => std::future::pending().await,
    }
}

enum Started {
    /// Handed to the engine worker.
    InFlight,
    /// Answered without the engine (reset).
    Replied(Message),
}

/// Decodes a request into a slot and hands it to the worker (or answers it directly).
async fn start(
    frame: &[u8],
    shared: &Shared,
    sessions: &mut Sessions,
    port: &ReplyPort,
    out: &mut Vec<u8>,
) -> Result<Started, Failure> {
    let mut lease = shared.worker.pool.acquire().await;
    let slot = lease.slot();
    let meta = shared
        .plan
        .decode(frame, &mut slot.inputs, &mut slot.seen)
        .map_err(|e| Failure::Request(e.to_string()))?;
    match meta.endpoint {
        Endpoint::Reset => {
            sessions.reset(meta.session_id.as_ref());
            if shared.cfg.server.reset_reply == "text" {
                return Ok(Started::Replied(Message::text("reset successful")));
            }
            wire::encode_status(out, "reset successful");
            Ok(Started::Replied(Message::Binary(Bytes::copy_from_slice(
                out,
            ))))
        }
        Endpoint::Observe => Err(Failure::Request(
            "endpoint 'observe' (streaming) is not available in this version; use 'infer'".into(),
        )),
        Endpoint::Infer => {
            slot.reset = sessions.begin_infer(meta.session_id.as_ref());
            slot.result = None;
            lease
                .submit(&shared.worker, port)
                .map(|()| Started::InFlight)
                .map_err(|_| Failure::Inference("the engine worker is not running".into()))
        }
    }
}

/// Reports a failure in the connection's dialect. Returns why the connection ended, if it did.
async fn fail<S>(
    ws: &mut WebSocketStream<S>,
    dialect: Dialect,
    f: Failure,
    out: &mut Vec<u8>,
) -> Option<String>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    match dialect {
        Dialect::Openpi => {
            let text = match &f {
                Failure::Request(m) => format!("policyd: invalid request: {m}"),
                Failure::Inference(m) => format!("policyd: inference failed: {m}"),
            };
            log::info!("closing after error: {text}");
            let _ = ws.send(Message::text(text.clone())).await;
            close(ws, CloseCode::Error, OPENPI_ERROR_REASON).await;
            Some(text)
        }
        Dialect::Vllm => {
            let (message, detail) = match &f {
                Failure::Request(m) => ("Invalid request payload", m),
                Failure::Inference(m) => ("Internal inference error", m),
            };
            log::info!("request error: {detail}");
            wire::encode_error_map(out, message, detail);
            if ws
                .send(Message::Binary(Bytes::copy_from_slice(out)))
                .await
                .is_err()
            {
                return Some("client went away".into());
            }
            None
        }
    }
}

async fn close<S>(ws: &mut WebSocketStream<S>, code: CloseCode, reason: &str)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let frame = CloseFrame {
        code,
        reason: reason.to_string().into(),
    };
    if ws.close(Some(frame)).await.is_ok() {
        // Wait briefly for the client's close reply so the close handshake completes.
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            while let Some(Ok(_)) = ws.next().await {}
        })
        .await;
    }
}
