use super::*;
use futures_util::StreamExt;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::Role;

/// A client frame, masked as clients must.
fn frame(fin: bool, opcode: u8, payload: &[u8]) -> Vec<u8> {
    let mask = [0x37, 0xfa, 0x21, 0x3d];
    let mut f = vec![if fin { 0x80 } else { 0 } | opcode];
    let n = payload.len();
    if n < 126 {
        f.push(0x80 | n as u8);
    } else if n < 65536 {
        f.push(0x80 | 126);
        f.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        f.push(0x80 | 127);
        f.extend_from_slice(&(n as u64).to_be_bytes());
    }
    f.extend_from_slice(&mask);
    f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    f
}

/// Serves `bytes` at most `chunk` bytes per read.
struct Trickle {
    data: Vec<u8>,
    pos: usize,
    chunk: usize,
}

impl AsyncRead for Trickle {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let n = self
            .chunk
            .min(self.data.len() - self.pos)
            .min(buf.remaining());
        let pos = self.pos;
        buf.put_slice(&self.data[pos..pos + n]);
        self.pos += n;
        Poll::Ready(Ok(()))
    }
}

/// Reads every message tungstenite assembles from `wire` through a guard.
async fn messages(wire: Vec<u8>, prefix: usize, chunk: usize, limit: usize) -> Vec<Message> {
    let (head, rest) = wire.split_at(prefix);
    let reader = Trickle {
        data: rest.to_vec(),
        pos: 0,
        chunk,
    };
    let guard = FrameGuard::new(tokio::io::join(reader, tokio::io::sink()), head, limit)
        .expect("prefix fits");
    let cfg = tokio_tungstenite::tungstenite::protocol::WebSocketConfig::default()
        .max_message_size(Some(limit + MARKER_LEN))
        .max_frame_size(Some(limit + MARKER_LEN));
    let mut ws = WebSocketStream::from_raw_socket(guard, Role::Server, Some(cfg)).await;
    let mut got = Vec::new();
    while let Some(Ok(m)) = ws.next().await {
        got.push(m);
    }
    got
}

fn binary(m: &Message) -> &[u8] {
    match m {
        Message::Binary(b) => b,
        other => panic!("expected a binary message, got {other:?}"),
    }
}

const CHUNKS: [usize; 4] = [1, 7, 4096, 1 << 20];

#[tokio::test]
async fn messages_within_the_limit_pass_unchanged() {
    let small: Vec<u8> = (0..200u8).collect();
    let exact = vec![9u8; 1000];
    let mut wire = frame(true, 2, &small);
    wire.extend(frame(true, 2, &exact));
    wire.extend(frame(true, 2, b""));
    for chunk in CHUNKS {
        for prefix in [0, 3, 20] {
            let got = messages(wire.clone(), prefix, chunk, 1000).await;
            assert_eq!(got.len(), 3, "chunk {chunk}");
            assert_eq!(binary(&got[0]), &small[..]);
            assert_eq!(binary(&got[1]), &exact[..]);
            assert_eq!(binary(&got[2]), b"");
            assert!(got.iter().all(|m| oversize_marker(binary(m)).is_none()));
        }
    }
}

#[tokio::test]
async fn an_oversized_message_becomes_a_marker_and_the_next_one_is_intact() {
    let big = vec![0xabu8; 70_000];
    let after = b"after".to_vec();
    let mut wire = frame(true, 2, &big);
    wire.extend(frame(true, 9, b"hi")); // a ping
    wire.extend(frame(true, 2, &after));
    for chunk in CHUNKS {
        let got = messages(wire.clone(), 0, chunk, 1000).await;
        assert_eq!(got.len(), 3, "chunk {chunk}");
        assert_eq!(oversize_marker(binary(&got[0])), Some(70_000));
        assert_eq!(binary(&got[0]).len(), MARKER_LEN);
        assert!(matches!(&got[1], Message::Ping(p) if &p[..] == b"hi"));
        assert_eq!(binary(&got[2]), &after[..]);
    }
}

#[tokio::test]
async fn an_oversized_text_message_becomes_a_binary_marker() {
    let text = "x".repeat(5000);
    let mut wire = frame(true, 1, text.as_bytes());
    wire.extend(frame(true, 2, b"ok"));
    let got = messages(wire, 0, 512, 100).await;
    assert_eq!(oversize_marker(binary(&got[0])), Some(5000));
    assert_eq!(binary(&got[1]), b"ok");
}

#[tokio::test]
async fn a_fragmented_message_crossing_the_limit_ends_in_a_marker() {
    let mut wire = frame(false, 2, &[1u8; 600]);
    wire.extend(frame(true, 9, b"")); // a ping between fragments
    wire.extend(frame(false, 0, &[2u8; 600]));
    wire.extend(frame(false, 0, &[3u8; 600]));
    wire.extend(frame(true, 0, &[4u8; 10]));
    wire.extend(frame(true, 2, b"next"));
    for chunk in CHUNKS {
        let got = messages(wire.clone(), 0, chunk, 1000).await;
        assert_eq!(got.len(), 3, "chunk {chunk}");
        assert!(matches!(&got[0], Message::Ping(_)));
        let m = binary(&got[1]);
        assert_eq!(&m[..600], &[1u8; 600][..]);
        assert_eq!(m.len(), 600 + MARKER_LEN);
        assert_eq!(oversize_marker(m), Some(1810));
        assert_eq!(binary(&got[2]), b"next");
    }
}

#[tokio::test]
async fn a_truncated_stream_ends_without_a_message() {
    let mut wire = frame(true, 2, b"whole");
    let partial = frame(true, 2, &[5u8; 300]);
    wire.extend(&partial[..3]);
    let got = messages(wire, 0, 2, 1000).await;
    assert_eq!(got.len(), 1);
    assert_eq!(binary(&got[0]), b"whole");
}

/// A guard with a 150 ms frame timeout over a pipe; the test writes the client's side.
async fn timed(
    head: &[u8],
) -> (
    tokio::io::DuplexStream,
    WebSocketStream<FrameGuard<tokio::io::DuplexStream>>,
) {
    let (client, server) = tokio::io::duplex(1 << 20);
    let guard =
        FrameGuard::with_frame_timeout(server, head, 1 << 20, Some(Duration::from_millis(150)))
            .expect("guard");
    (
        client,
        WebSocketStream::from_raw_socket(guard, Role::Server, None).await,
    )
}

fn is_timeout(r: Option<Result<Message, tokio_tungstenite::tungstenite::Error>>) -> bool {
    matches!(r, Some(Err(tokio_tungstenite::tungstenite::Error::Io(e))) if e.kind() == io::ErrorKind::TimedOut)
}

#[tokio::test]
async fn a_peer_that_stops_reading_fails_the_read_after_the_write_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // A 1 KiB pipe: the server's writes block as soon as the peer stops reading.
    let (mut peer, server) = tokio::io::duplex(1024);
    let mut guard = FrameGuard::new(server, b"", 1 << 20)
        .unwrap()
        .with_write_timeout(Some(Duration::from_millis(200)));
    // Writes that go through: no stall, however long it has been.
    guard.write_all(&[1u8; 512]).await.unwrap();
    let mut got = [0u8; 512];
    peer.read_exact(&mut got).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut buf = [0u8; 16];
    let quiet = tokio::time::timeout(Duration::from_millis(50), guard.read(&mut buf)).await;
    assert!(quiet.is_err(), "no stall, no error: {quiet:?}");
    // The peer stops reading: a write blocks, and the next read fails once it has been
    // blocked for the timeout.
    let blocked =
        tokio::time::timeout(Duration::from_millis(50), guard.write_all(&[2u8; 4096])).await;
    assert!(blocked.is_err(), "the write should block");
    // A write still blocked when the stall reaches the timeout fails too.
    let e = guard.write_all(&[3u8; 4096]).await.unwrap_err();
    assert_eq!(e.to_string(), NOT_READING);
    let t = std::time::Instant::now();
    let e = guard.read(&mut buf).await.unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::TimedOut);
    assert_eq!(e.to_string(), NOT_READING);
    assert!(e.get_ref().is_some_and(|inner| inner.is::<NotReading>()));
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}

#[tokio::test]
async fn a_half_sent_frame_times_out_and_a_quiet_connection_does_not() {
    use tokio::io::AsyncWriteExt;
    let (mut client, mut ws) = timed(b"").await;
    let f = frame(true, 2, &[7u8; 1000]);
    client.write_all(&f).await.unwrap();
    assert_eq!(binary(&ws.next().await.unwrap().unwrap()), &[7u8; 1000][..]);
    // Quiet between frames for longer than the timeout: nothing happens.
    let quiet = tokio::time::timeout(Duration::from_millis(400), ws.next()).await;
    assert!(
        quiet.is_err(),
        "no frame in progress, no timeout: {quiet:?}"
    );
    // Half a frame, then silence.
    client.write_all(&f[..500]).await.unwrap();
    let t = std::time::Instant::now();
    assert!(is_timeout(ws.next().await));
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(140) && took < Duration::from_secs(2),
        "{took:?}"
    );
}

#[tokio::test]
async fn a_frame_trickling_in_past_the_timeout_fails_though_bytes_keep_coming() {
    use tokio::io::AsyncWriteExt;
    let (mut client, mut ws) = timed(b"").await;
    let f = frame(true, 2, &[1u8; 600]);
    let writer = tokio::spawn(async move {
        for c in f.chunks(100) {
            if client.write_all(c).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = client.shutdown().await;
    });
    assert!(
        is_timeout(ws.next().await),
        "7 chunks 50 ms apart exceed 150 ms"
    );
    writer.abort();
}

#[tokio::test]
async fn prompt_frames_back_to_back_never_time_out() {
    use tokio::io::AsyncWriteExt;
    // A header byte already read with the HTTP head starts the first frame.
    let f = frame(true, 2, b"steady");
    let (mut client, mut ws) = timed(&f[..1]).await;
    let rest = f[1..].to_vec();
    let writer = tokio::spawn(async move {
        client.write_all(&rest).await.unwrap();
        // 12 frames 40 ms apart: 480 ms of traffic, each frame whole at once.
        for _ in 0..12 {
            tokio::time::sleep(Duration::from_millis(40)).await;
            client.write_all(&frame(true, 2, b"steady")).await.unwrap();
        }
        client
    });
    for _ in 0..13 {
        assert_eq!(binary(&ws.next().await.unwrap().unwrap()), b"steady");
    }
    drop(writer.await.unwrap());
}

#[test]
fn markers_are_recognised_only_whole() {
    let mut m = MARKER_PREFIX.to_vec();
    m.extend(format_digits(1234));
    m.push(0);
    assert_eq!(oversize_marker(&m), Some(1234));
    assert_eq!(oversize_marker(&m[1..]), None);
    let mut with_data = b"payload".to_vec();
    with_data.extend(&m);
    assert_eq!(oversize_marker(&with_data), Some(1234));
    m[MARKER_LEN - 1] = 1;
    assert_eq!(oversize_marker(&m), None);
    assert_eq!(oversize_marker(b""), None);
}
