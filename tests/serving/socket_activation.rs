//! Socket activation, as `policyd.socket` does it: `systemd-socket-activate` holds the port
//! and passes it (`LISTEN_FDS`) to policyd, which serves on it instead of binding its own
//! (`--port 1` here, which it could not bind unprivileged anyway).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common;

#[test]
fn policyd_serves_on_the_socket_systemd_passes() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    // Under emulation (cross/test-aarch64) the binary needs its runner.
    let mut child = Command::new("systemd-socket-activate")
        .args(["-l", &format!("127.0.0.1:{port}")])
        .args(common::policyd_command())
        .args(["--port", "1"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("systemd-socket-activate (Debian package: systemd)");
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut last = String::new();
    let healthy = loop {
        if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
            let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
            let _ = s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
            last.clear();
            let _ = s.read_to_string(&mut last);
            if last.starts_with("HTTP/1.1 200") {
                break true;
            }
        }
        if Instant::now() > deadline {
            break false;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        healthy,
        "no 200 from /healthz on the passed socket; last answer: {last:?}"
    );
}
