//! Compiles the TensorRT shim (csrc/) when the `tensorrt` feature is on; nothing otherwise.
//!
//! TensorRT's headers are found through `TENSORRT_INCLUDE_DIR`, `TENSORRT_ROOT/include`, or
//! JetPack's and NVIDIA's standard install paths. CUDA's `cuda_runtime_api.h` comes from
//! `CUDA_INCLUDE_DIR`, `/usr/local/cuda/include`, or a two-type stub in csrc/cuda-stub (the shim
//! calls no CUDA function). No TensorRT library is linked: csrc/trt_loader.cpp opens it at run
//! time.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "tensorrt")]
    tensorrt::build();
}

#[cfg(feature = "tensorrt")]
mod tensorrt {
    use std::env;
    use std::path::{Path, PathBuf};

    const HEADER: &str = "NvInferRuntime.h";

    /// Where JetPack and NVIDIA's packages put TensorRT's headers, per target architecture.
    fn standard_dirs(arch: &str) -> Vec<PathBuf> {
        let mut v = vec![PathBuf::from(format!("/usr/include/{arch}-linux-gnu"))];
        for d in [
            "/usr/include",
            "/usr/local/tensorrt/include",
            "/opt/tensorrt/include",
            "/usr/src/tensorrt/include",
        ] {
            v.push(PathBuf::from(d));
        }
        v
    }

    fn find_tensorrt(arch: &str) -> Result<PathBuf, String> {
        let mut tried = Vec::new();
        let mut candidates = Vec::new();
        if let Ok(d) = env::var("TENSORRT_INCLUDE_DIR") {
            candidates.push((PathBuf::from(d), "TENSORRT_INCLUDE_DIR"));
        }
        if let Ok(d) = env::var("TENSORRT_ROOT") {
            candidates.push((Path::new(&d).join("include"), "TENSORRT_ROOT/include"));
        }
        for d in standard_dirs(arch) {
            candidates.push((d, "standard path"));
        }
        for (dir, why) in candidates {
            if dir.join(HEADER).is_file() {
                return Ok(dir);
            }
            tried.push(format!("  {} ({why})", dir.display()));
        }
        Err(format!(
            "the `tensorrt` feature needs TensorRT's headers ({HEADER}) and found none.\n\
             Looked in:\n{}\n\
             On a Jetson: `sudo apt install libnvinfer-dev` (part of JetPack). Elsewhere: set \
             TENSORRT_INCLUDE_DIR to a folder holding {HEADER}; `cross/trt-headers` prints one \
             from the crates.io package trtx-sys (TensorRT 11.4's public headers), for compile \
             checks.",
            tried.join("\n")
        ))
    }

    fn find_cuda(manifest: &Path) -> PathBuf {
        if let Ok(d) = env::var("CUDA_INCLUDE_DIR") {
            return PathBuf::from(d);
        }
        let toolkit = Path::new("/usr/local/cuda/include");
        if toolkit.join("cuda_runtime_api.h").is_file() {
            return toolkit.to_path_buf();
        }
        manifest.join("csrc/cuda-stub")
    }

    pub fn build() {
        for v in ["TENSORRT_INCLUDE_DIR", "TENSORRT_ROOT", "CUDA_INCLUDE_DIR"] {
            println!("cargo:rerun-if-env-changed={v}");
        }
        for f in ["trt_shim.h", "trt_shim.cpp", "trt_loader.cpp"] {
            println!("cargo:rerun-if-changed=csrc/{f}");
        }
        let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
        let arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
        let trt = match find_tensorrt(&arch) {
            Ok(d) => d,
            Err(msg) => {
                eprintln!("error: {msg}");
                std::process::exit(1);
            }
        };
        let cuda = find_cuda(&manifest);
        println!(
            "cargo:warning=tensorrt: headers from {}, cuda_runtime_api.h from {}",
            trt.display(),
            cuda.display()
        );
        cc::Build::new()
            .cpp(true)
            .std("c++17")
            .file(manifest.join("csrc/trt_shim.cpp"))
            .file(manifest.join("csrc/trt_loader.cpp"))
            .include(manifest.join("csrc"))
            .include(&trt)
            .include(&cuda)
            .flag_if_supported("-Wno-deprecated-declarations")
            .flag_if_supported("-Wno-unused-parameter")
            .compile("policyd_trt");
        // dlopen lives in libdl before glibc 2.34 (JetPack 5 is Ubuntu 20.04, glibc 2.31).
        println!("cargo:rustc-link-lib=dl");
    }
}
