//! Reading a request head: bounded in size and time, parsed into what the answer needs, and
//! RFC 6455's opening handshake checked.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};

use crate::limits::MAX_HEAD;

/// A parsed HTTP request head.
pub(super) struct Head {
    pub(super) method: String,
    pub(super) path: String,
    /// `HTTP/1.<minor>`.
    pub(super) minor: u8,
    pub(super) upgrade: bool,
    /// Whether a `Connection` header lists the `upgrade` token.
    pub(super) connection_upgrade: bool,
    pub(super) version: Option<String>,
    /// Every `Sec-WebSocket-Key` value (a valid handshake has exactly one).
    pub(super) keys: Vec<String>,
    /// Every `Authorization` header (API keys; more than one is refused); never logged.
    pub(super) authorizations: Vec<String>,
    /// The request says it has a body (`Content-Length` other than 0, or
    /// `Transfer-Encoding`): a WebSocket handshake has none.
    pub(super) body: bool,
    /// Bytes read past the head (a client's first frame, if it did not wait).
    pub(super) rest: Vec<u8>,
}

/// A client's byte stream: plain TCP, or TLS over it.
pub trait Transport: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Transport for T {}

/// Why no request head was read.
#[derive(Debug, thiserror::Error)]
pub(super) enum HeadError {
    /// The client went away: there is nobody to answer.
    #[error("read error: {0}")]
    Read(std::io::Error),
    #[error("closed before the request was complete")]
    Closed,
    /// The client is there and gets a 400 saying why.
    #[error("request head too large")]
    TooLarge,
    #[error("malformed HTTP request")]
    Malformed,
}

impl HeadError {
    /// Whether a 400 can reach the client.
    pub(super) fn answerable(&self) -> bool {
        matches!(self, HeadError::TooLarge | HeadError::Malformed)
    }
}

pub(super) async fn read_head<S: Transport>(stream: &mut S) -> Result<Head, HeadError> {
    let mut buf = vec![0u8; MAX_HEAD];
    let mut len = 0;
    loop {
        let n = stream
            .read(&mut buf[len..])
            .await
            .map_err(HeadError::Read)?;
        if n == 0 {
            return Err(HeadError::Closed);
        }
        len += n;
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(&buf[..len]) {
            Ok(httparse::Status::Complete(end)) => {
                let find = |name: &str| {
                    req.headers
                        .iter()
                        .find(|h| h.name.eq_ignore_ascii_case(name))
                        .and_then(|h| std::str::from_utf8(h.value).ok())
                        .map(|v| v.trim().to_string())
                };
                let all = |name: &str| {
                    req.headers
                        .iter()
                        .filter(|h| h.name.eq_ignore_ascii_case(name))
                        .map(|h| String::from_utf8_lossy(h.value).trim().to_string())
                        .collect::<Vec<_>>()
                };
                // Token lists (`Connection: keep-alive, Upgrade`), over every such header.
                let has_token = |name: &str, token: &str| {
                    all(name)
                        .iter()
                        .any(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
                };
                return Ok(Head {
                    method: req.method.unwrap_or("").to_string(),
                    minor: req.version.unwrap_or(0),
                    path: req
                        .path
                        .unwrap_or("/")
                        .split('?')
                        .next()
                        .unwrap_or("/")
                        .to_string(),
                    upgrade: has_token("upgrade", "websocket"),
                    connection_upgrade: has_token("connection", "upgrade"),
                    version: find("sec-websocket-version"),
                    keys: all("sec-websocket-key"),
                    authorizations: all("authorization"),
                    body: all("content-length").iter().any(|v| v != "0")
                        || !all("transfer-encoding").is_empty(),
                    rest: buf[end..len].to_vec(),
                });
            }
            Ok(httparse::Status::Partial) if len < MAX_HEAD => continue,
            Ok(httparse::Status::Partial) => return Err(HeadError::TooLarge),
            Err(_) => return Err(HeadError::Malformed),
        }
    }
}

/// RFC 6455 §4.2.1: what a server must find in a client's opening handshake (beyond
/// `Upgrade: websocket`, which routed it here, and the version, answered with 426). A request
/// that lacks any of it is not a WebSocket handshake and gets 400, not 101. The key, if
/// it is one.
pub(super) fn upgrade_request(head: &Head) -> Result<&str, String> {
    if head.method != "GET" {
        return Err(format!(
            "a WebSocket handshake must be a GET request, got {}",
            head.method
        ));
    }
    if head.minor < 1 {
        return Err("a WebSocket handshake needs HTTP/1.1 or later, got HTTP/1.0".into());
    }
    if !head.connection_upgrade {
        return Err(
            "a WebSocket handshake needs a Connection header with the Upgrade token".into(),
        );
    }
    if head.body {
        // Its bytes would be read as WebSocket frames (RFC 6455 §4.1: the handshake is a GET
        // with no body).
        return Err(
            "a WebSocket handshake has no body (Content-Length or Transfer-Encoding)".into(),
        );
    }
    match head.keys.as_slice() {
        [] => Err("missing Sec-WebSocket-Key".into()),
        [key] if is_websocket_key(key) => Ok(key),
        [_] => Err(
            "Sec-WebSocket-Key must be 16 random bytes in base64 (24 characters ending in ==)"
                .into(),
        ),
        _ => Err("more than one Sec-WebSocket-Key header".into()),
    }
}

/// Whether `key` is the base64 of exactly 16 bytes: 22 characters of the standard alphabet
/// (the last carrying no bits past the 128th) and `==`.
pub(super) fn is_websocket_key(key: &str) -> bool {
    let b = key.as_bytes();
    let value = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    b.len() == 24
        && b.ends_with(b"==")
        && b[..22].iter().all(|&c| value(c).is_some())
        && value(b[21]).is_some_and(|v| v & 0x0f == 0)
}
