//! The transport floor: a WebSocket endpoint that answers every frame with one fixed,
//! pre-encoded reply of a real reply's size, without decoding anything.
//!
//! It runs on the same WebSocket stack and runtime shape as policyd, so the gap between the two
//! is what policyd's serving (decode, transforms, scheduling, encode) costs on top of receiving
//! and unmasking the frames. It is its own process (`policyd-bench floor`), so its CPU time can
//! be read like any server's.

use std::io::Write;
use std::net::SocketAddr;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use tokio::net::TcpListener;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;

use policyd::dtype::ElemType;
use policyd::protocol::{Encoder, Timing, encode_timing};

/// The line the floor prints on stdout once it listens (the address follows).
pub const READY: &str = "policyd-bench floor listening on ";

/// An openpi reply with a float32 `actions` array of `shape` and zero timings.
pub fn reply(shape: &[usize]) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut e = Encoder { buf: &mut buf };
    e.map(3);
    e.str("actions");
    let n: usize = shape.iter().product();
    e.ndarray(ElemType::F32, shape, n * 4, |d| {
        for (i, c) in d.chunks_exact_mut(4).enumerate() {
            c.copy_from_slice(&((i % 100) as f32 / 100.0).to_le_bytes());
        }
    });
    encode_timing(&mut e, &Timing::default());
    buf
}

/// The metadata frame sent on connect (openpi-client waits for one).
fn metadata() -> Vec<u8> {
    let mut buf = Vec::new();
    let mut e = Encoder { buf: &mut buf };
    e.map(1);
    e.str("server");
    e.str("policyd bench-floor");
    buf
}

/// Accepts connections until the process ends, each answered with `reply`.
pub async fn serve(listener: TcpListener, reply: Bytes) {
    let meta = Bytes::from(metadata());
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let (reply, meta) = (reply.clone(), meta.clone());
        tokio::spawn(async move {
            let cfg = WebSocketConfig::default()
                .max_message_size(Some(256 << 20))
                .max_frame_size(Some(256 << 20));
            let Ok(mut ws) = tokio_tungstenite::accept_async_with_config(tcp, Some(cfg)).await
            else {
                return;
            };
            if ws.send(Message::Binary(meta)).await.is_err() {
                return;
            }
            while let Some(Ok(m)) = ws.next().await {
                match m {
                    Message::Binary(_)
                        if ws.send(Message::Binary(reply.clone())).await.is_err() =>
                    {
                        return;
                    }
                    Message::Close(_) => return,
                    _ => {}
                }
            }
        });
    }
}

/// `policyd-bench floor`: listens on `addr`, prints [`READY`] and the bound address, serves.
pub fn run(addr: SocketAddr, actions: &[usize]) -> Result<(), String> {
    // Two worker threads, as policyd's runtime has.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    rt.block_on(async {
        let l = TcpListener::bind(addr)
            .await
            .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        let bound = l.local_addr().map_err(|e| e.to_string())?;
        let mut out = std::io::stdout();
        let _ = writeln!(out, "{READY}{bound}");
        let _ = out.flush();
        serve(l, Bytes::from(reply(actions))).await;
        Ok(())
    })
}
