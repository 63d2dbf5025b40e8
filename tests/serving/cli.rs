//! `policyd bench` and `policyd bench-floor` run the load generator, the separate
//! `policyd-bench` binary (so that the serving binary links none of it), with their arguments
//! passed through unchanged, `--config` included, and its exit status kept.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use crate::common;

/// A stand-in for policyd-bench that prints its arguments and exits with 3.
fn stand_in() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("policyd-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("policyd-bench");
    std::fs::write(&path, "#!/bin/sh\necho \"args: $*\"\nexit 3\n").expect("write");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    path
}

fn policyd(bench: &std::path::Path, args: &[&str]) -> std::process::Output {
    let cmd = common::policyd_command();
    Command::new(&cmd[0])
        .args(&cmd[1..])
        .args(args)
        .env("POLICYD_BENCH", bench)
        .output()
        .expect("runs policyd")
}

#[test]
fn bench_runs_policyd_bench_with_its_arguments_and_exit_status() {
    let bench = stand_in();
    let out = policyd(
        &bench,
        &[
            "--config",
            "/etc/x.toml",
            "bench",
            "ws://h:1",
            "--rate",
            "50",
            "-c",
            "2",
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stdout.trim(),
        "args: --config /etc/x.toml ws://h:1 --rate 50 -c 2"
    );
    assert_eq!(out.status.code(), Some(3), "its exit status is kept");

    let out = policyd(&bench, &["bench-floor", "--listen", "127.0.0.1:0"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.trim(), "args: floor --listen 127.0.0.1:0");

    let out = policyd(&bench, &["bench", "--help"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "args: --help",
        "its help is policyd-bench's"
    );
}

#[test]
fn bench_without_policyd_bench_says_how_to_get_it() {
    let out = policyd(
        std::path::Path::new("/nonexistent/policyd-bench"),
        &["bench"],
    );
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("/nonexistent/policyd-bench") && err.contains("-p policyd-bench"),
        "{err}"
    );
}
