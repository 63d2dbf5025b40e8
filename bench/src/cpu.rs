//! Server CPU time from /proc, so a benchmark can report what each request costs the CPU the
//! robot stack shares (on a Jetson, every core the server burns is taken from it).

use std::time::Duration;

/// User + system CPU time of a process so far, all its threads (living and exited) included.
pub fn process_cpu(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may contain spaces.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of proc(5); `rest` starts at field 3.
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = if hz > 0 { hz as u64 } else { 100 };
    Some(Duration::from_nanos(
        ticks.saturating_mul(1_000_000_000) / hz,
    ))
}

/// The process listening on a local TCP port (found through /proc/net/tcp{,6} and the socket
/// inodes in /proc/*/fd), when this user may see it.
pub fn listener_pid(port: u16) -> Option<u32> {
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // local_address is "ADDR:PORT" in hex; state 0A is LISTEN; field 9 is the inode.
            let (Some(local), Some(state), Some(inode)) = (f.get(1), f.get(3), f.get(9)) else {
                continue;
            };
            let p = local
                .rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            if p == Some(port) && *state == "0A" {
                inodes.push(format!("socket:[{inode}]"));
            }
        }
    }
    if inodes.is_empty() {
        return None;
    }
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if let Ok(target) = std::fs::read_link(fd.path())
                && inodes.iter().any(|i| target.as_os_str() == i.as_str())
            {
                return Some(pid);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Another process's CPU time, as the bench reads a server's (a process's own stat is
    /// faked by qemu-user, which the aarch64 tests run under; other processes' are real).
    #[test]
    fn a_busy_process_cpu_time_grows() {
        let mut busy = std::process::Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .expect("sh runs");
        let pid = busy.id();
        std::thread::sleep(Duration::from_millis(100));
        let a = process_cpu(pid).expect("its /proc/<pid>/stat is readable");
        std::thread::sleep(Duration::from_millis(600));
        let b = process_cpu(pid).expect("readable");
        let _ = busy.kill();
        let _ = busy.wait();
        assert!(b >= a + Duration::from_millis(50), "{a:?} -> {b:?}");
        assert!(process_cpu(u32::MAX).is_none(), "no such process");
    }

    #[test]
    fn finds_the_process_listening_on_a_port() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        assert_eq!(listener_pid(port), Some(std::process::id()));
        drop(l);
        assert_eq!(listener_pid(port), None);
    }
}
