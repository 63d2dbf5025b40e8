//! How a connection ends: why (logged when it closes), the close code for a stream error the
//! client caused, and the close handshake itself.

use std::time::Duration;

use futures_util::StreamExt;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

/// Why a connection ended (logged when it closes).
#[derive(Debug, PartialEq)]
pub enum Closed {
    /// The client left before the metadata frame was sent.
    BeforeMetadata,
    /// The client closed the connection (a close frame, or the socket's end).
    ByClient,
    /// A send failed: the client is gone.
    Gone,
    /// The WebSocket stream failed (tungstenite's error).
    Protocol(String),
    /// The server is shutting down (1001).
    Shutdown,
    /// A reload removed the connection's policy (1001).
    PolicyRemoved,
    /// No pong within `server.ping_timeout_s`.
    PingTimeout,
    /// Nothing for `server.idle_timeout_s`.
    Idle,
    /// The client left the server's frames unread for `server.write_timeout_s`.
    NotReading,
    /// A reload made the policy's frames larger than this connection's write buffer (1001;
    /// the client's next connection gets the new bound).
    Outgrown,
    /// The dialect closes after an error (openpi: a text frame, then 1011); the error.
    AfterError(String),
}

impl std::fmt::Display for Closed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Closed::BeforeMetadata => f.write_str("client left before the metadata frame"),
            Closed::ByClient => f.write_str("client closed the connection"),
            Closed::Gone => f.write_str("client went away"),
            Closed::Protocol(e) => write!(f, "protocol error: {e}"),
            Closed::Shutdown => f.write_str("server shutdown (1001)"),
            Closed::PolicyRemoved => f.write_str("policy removed by a reload (1001)"),
            Closed::PingTimeout => f.write_str("keepalive ping timeout"),
            Closed::Idle => f.write_str("idle timeout"),
            Closed::NotReading => f.write_str(
                "the client did not read the server's frames within server.write_timeout_s",
            ),
            Closed::Outgrown => f.write_str(
                "the reloaded policy's frames outgrow this connection's write buffer (1001)",
            ),
            Closed::AfterError(e) => f.write_str(e),
        }
    }
}

/// The close code for a stream error the client caused: 1007 for text that is not UTF-8,
/// 1009 for a message over tungstenite's own limits, 1002 for any other protocol violation
/// (unmasked, reserved bits or opcodes, oversized or fragmented control frames, stray
/// continuations, a 1-byte close payload). `None` when the client is gone (nobody to tell).
pub(super) fn violation_code(e: &tokio_tungstenite::tungstenite::Error) -> Option<CloseCode> {
    use tokio_tungstenite::tungstenite::Error;
    use tokio_tungstenite::tungstenite::error::ProtocolError;
    match e {
        Error::Utf8(_) => Some(CloseCode::Invalid),
        Error::Capacity(_) => Some(CloseCode::Size),
        Error::Protocol(
            ProtocolError::ResetWithoutClosingHandshake
            | ProtocolError::ReceivedAfterClosing
            | ProtocolError::SendAfterClosing,
        ) => None,
        Error::Protocol(_) => Some(CloseCode::Protocol),
        _ => None,
    }
}

/// Closes with `code` and `reason`, bounded in time (a client that does not read may never
/// take the close frame), and waits briefly for the client's reply.
pub(super) async fn close<S>(ws: &mut WebSocketStream<S>, code: CloseCode, reason: &str)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let frame = CloseFrame {
        code,
        reason: reason.to_string().into(),
    };
    // A client that does not read may never take the close frame: bounded too.
    let sent = tokio::time::timeout(Duration::from_secs(2), ws.close(Some(frame))).await;
    if matches!(sent, Ok(Ok(()))) {
        // Wait briefly for the client's close reply so the close handshake completes.
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            while let Some(Ok(_)) = ws.next().await {}
        })
        .await;
    }
}
