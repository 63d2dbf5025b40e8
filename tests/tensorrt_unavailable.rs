//! The `tensorrt` backend where there is no GPU, no CUDA driver and no TensorRT (CI): policyd
//! must say what is missing and exit non-zero, never panic. (cudarc panics on its first call
//! when libcuda is absent; policyd probes first.) Runs with `--features tensorrt`.
#![cfg(feature = "tensorrt")]

use std::process::Command;

mod common;

fn config_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("policyd-trt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("policy.plan"), b"not a real plan").unwrap();
    std::fs::write(
        dir.join("policyd.toml"),
        r#"
[server]
port = 0
[engine]
backend = "tensorrt"
model = "policy.plan"
zero_copy = "auto"
[[inputs]]
key = "state"
tensor = "state"
dtypes = ["float32"]
shape = [14]
[[outputs]]
tensor = "actions"
"#,
    )
    .unwrap();
    dir
}

#[test]
fn tensorrt_without_cuda_or_tensorrt_fails_with_a_clear_message() {
    let dir = config_dir();
    let cfg = dir.join("policyd.toml");
    let policyd = common::policyd_command();
    for args in [
        vec!["check-config".to_string(), cfg.display().to_string()],
        vec!["--config".to_string(), cfg.display().to_string()],
    ] {
        let out = Command::new(&policyd[0])
            .args(&policyd[1..])
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(
            err.contains("backend 'tensorrt' is not available"),
            "{args:?}: {err}"
        );
        // No registry carries TensorRT, so no test machine has it.
        assert!(err.contains("libnvinfer"), "{args:?}: {err}");
        if !std::path::Path::new("/dev/nvidiactl").exists() {
            assert!(err.contains("libcuda.so.1"), "{args:?}: {err}");
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}
