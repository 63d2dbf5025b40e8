//! `[server]`: where policyd listens and what one connection, session and message may hold.

use serde::Deserialize;

use super::{ConfigError, Keys};
use crate::protocol::dialect::ResetReply;

/// `[server]`: the listener and per-connection limits.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawServer {
    pub(super) host: String,
    pub(super) port: u16,
    /// WebSocket connections served at once; one more gets HTTP 503 in the handshake.
    pub(super) max_connections: usize,
    /// Of those, how many one peer address may hold (0: half of `max_connections`, rounded up).
    pub(super) max_connections_per_peer: usize,
    /// Largest inbound message; a larger frame is rejected before it is buffered.
    pub(super) max_message_bytes: usize,
    /// Server ping interval (0 = no pings).
    pub(super) ping_interval_s: f64,
    /// Close a connection whose pong is this late.
    pub(super) ping_timeout_s: f64,
    /// Close a connection idle this long (0 = off): no request and no ping from the client.
    pub(super) idle_timeout_s: f64,
    /// Close a connection that leaves the server's frames unread this long.
    pub(super) write_timeout_s: f64,
    /// Time a client gets to complete the HTTP upgrade.
    pub(super) handshake_timeout_s: f64,
    /// Time one WebSocket frame may take to arrive, first byte to last (0 = no limit): a
    /// half-sent frame closes the connection after this.
    pub(super) frame_timeout_s: f64,
    /// Sessions (`session_id`) tracked per connection; the least recently used is evicted.
    pub(super) max_sessions: usize,
    /// Reply to `endpoint: reset` as a msgpack map (`msgpack`) or the text frame
    /// `reset successful` (`text`, older vllm-omni and RoboArena clients).
    pub(super) reset_reply: String,
    /// Deepest map/list nesting accepted in a request.
    pub(super) max_depth: usize,
    /// Most entries accepted in any map or list of a request.
    pub(super) max_map_entries: usize,
    /// Memory the policies may allocate at start-up, in MiB (0 = unchecked): a config whose
    /// policies need more is refused, naming each policy's share.
    pub(super) memory_budget_mb: u64,
}

impl Default for RawServer {
    fn default() -> Self {
        RawServer {
            host: "127.0.0.1".into(),
            port: 8000,
            max_connections: 8,
            max_connections_per_peer: 0,
            max_message_bytes: 4 << 20,
            ping_interval_s: 20.0,
            ping_timeout_s: 20.0,
            // openpi's and vllm-omni's clients on `websockets` 15 or newer ping every 20 s, and a
            // client's ping counts as activity; an older one sends nothing between requests, so
            // the default leaves it an hour (the per-address share is what stops a lock-out).
            idle_timeout_s: 3600.0,
            write_timeout_s: 10.0,
            handshake_timeout_s: 10.0,
            frame_timeout_s: 30.0,
            max_sessions: 16,
            reset_reply: "msgpack".into(),
            max_depth: 16,
            max_map_entries: 1024,
            memory_budget_mb: 0,
        }
    }
}

/// `[server]`: the listener and per-connection limits.
#[derive(Clone, Debug, PartialEq)]
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    /// WebSocket connections served at once; one more gets HTTP 503 in the handshake.
    pub max_connections: usize,
    /// Of those, how many one peer address may hold (one more gets HTTP 503).
    pub max_connections_per_peer: usize,
    /// Largest inbound message; a larger frame is rejected before it is buffered.
    pub max_message_bytes: usize,
    /// Server ping interval (0 = no pings).
    pub ping_interval_s: f64,
    /// Close a connection whose pong is this late.
    pub ping_timeout_s: f64,
    /// Close a connection with no request and no ping from the client this long (0 = off).
    pub idle_timeout_s: f64,
    /// Close a connection that leaves the server's frames unread this long.
    pub write_timeout_s: f64,
    /// Time a client gets to complete the HTTP upgrade.
    pub handshake_timeout_s: f64,
    /// Time one WebSocket frame may take to arrive, first byte to last (0 = no limit).
    pub frame_timeout_s: f64,
    /// Sessions (`session_id`) tracked per connection; the least recently used is evicted.
    pub max_sessions: usize,
    /// How `endpoint: reset` is answered (older vllm-omni and RoboArena clients want text).
    pub reset_reply: ResetReply,
    /// Deepest map/list nesting accepted in a request.
    pub max_depth: usize,
    /// Most entries accepted in any map or list of a request.
    pub max_map_entries: usize,
    /// Memory the policies may allocate at start-up, in MiB (0 = unchecked).
    pub memory_budget_mb: u64,
}

/// `[server]`'s values.
pub(super) fn server(s: &RawServer) -> Result<ServerConfig, ConfigError> {
    let cx = Keys::top();
    if s.host.trim().is_empty() {
        return Err(cx.invalid("server.host", "must not be empty"));
    }
    cx.between("server.max_connections", s.max_connections, 1, 4096)?;
    cx.between(
        "server.max_message_bytes",
        s.max_message_bytes,
        1024,
        1 << 30,
    )?;
    for (key, v, max) in [
        ("server.ping_interval_s", s.ping_interval_s, 86400.0),
        ("server.ping_timeout_s", s.ping_timeout_s, 86400.0),
        ("server.idle_timeout_s", s.idle_timeout_s, 86400.0 * 365.0),
        ("server.handshake_timeout_s", s.handshake_timeout_s, 3600.0),
        ("server.frame_timeout_s", s.frame_timeout_s, 3600.0),
        ("server.write_timeout_s", s.write_timeout_s, 3600.0),
    ] {
        if !(v.is_finite() && (0.0..=max).contains(&v)) {
            return Err(cx.invalid(
                key,
                format!("must be a number of seconds between 0 and {max}, got {v}"),
            ));
        }
    }
    if s.ping_interval_s > 0.0 && s.ping_timeout_s <= 0.0 {
        return Err(cx.invalid(
            "server.ping_timeout_s",
            "must be positive when server.ping_interval_s is set",
        ));
    }
    if s.handshake_timeout_s <= 0.0 {
        return Err(cx.invalid("server.handshake_timeout_s", "must be positive"));
    }
    if s.write_timeout_s <= 0.0 {
        return Err(cx.invalid(
            "server.write_timeout_s",
            "must be positive: a client that never reads would hold its connection forever",
        ));
    }
    let max_connections_per_peer = match s.max_connections_per_peer {
        0 => s.max_connections.div_ceil(2),
        n => n,
    };
    cx.between(
        "server.max_connections_per_peer",
        max_connections_per_peer,
        1,
        s.max_connections,
    )?;
    cx.between(
        "server.max_sessions",
        s.max_sessions,
        1,
        crate::limits::MAX_SESSIONS,
    )?;
    let reset_reply = cx.one_of(
        "server.reset_reply",
        Some(&s.reset_reply),
        None,
        &[("msgpack", ResetReply::Msgpack), ("text", ResetReply::Text)],
    )?;
    cx.between("server.max_depth", s.max_depth, 2, 64)?;
    if s.memory_budget_mb > 1 << 24 {
        return Err(cx.invalid(
            "server.memory_budget_mb",
            format!(
                "must be at most 16777216 (16 TiB), got {}",
                s.memory_budget_mb
            ),
        ));
    }
    cx.between("server.max_map_entries", s.max_map_entries, 8, 1_000_000)?;

    Ok(ServerConfig {
        host: s.host.clone(),
        port: s.port,
        max_connections: s.max_connections,
        max_connections_per_peer,
        max_message_bytes: s.max_message_bytes,
        ping_interval_s: s.ping_interval_s,
        ping_timeout_s: s.ping_timeout_s,
        idle_timeout_s: s.idle_timeout_s,
        write_timeout_s: s.write_timeout_s,
        handshake_timeout_s: s.handshake_timeout_s,
        frame_timeout_s: s.frame_timeout_s,
        max_sessions: s.max_sessions,
        reset_reply,
        max_depth: s.max_depth,
        max_map_entries: s.max_map_entries,
        memory_budget_mb: s.memory_budget_mb,
    })
}
