//! Bakes a firmware image's config into the binary when `POLICYD_EMBED_CONFIG` names one (see
//! [`bake`]), and compiles the TensorRT shim (csrc/) when the `tensorrt` feature is on.
//!
//! TensorRT's headers are found through `TENSORRT_INCLUDE_DIR`, `TENSORRT_ROOT/include`, or
//! JetPack's and NVIDIA's standard install paths. CUDA's `cuda_runtime_api.h` comes from
//! `CUDA_INCLUDE_DIR`, `/usr/local/cuda/include`, or a two-type stub in csrc/cuda-stub (the shim
//! calls no CUDA function). No TensorRT library is linked: csrc/trt_loader.cpp opens it at run
//! time.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    bake::generate();
    grpc::generate();
    #[cfg(feature = "tensorrt")]
    tensorrt::build();
}

/// LeRobot's `AsyncInference` service (proto/services.proto) as tonic server code, compiled by
/// protox (pure Rust: no `protoc` on the build machine or in the cross build), and its client,
/// which the tests drive the service with (tests/lerobot_grpc.rs; unused code is not linked
/// into the serving binary).
mod grpc {
    pub fn generate() {
        const PROTO: &str = "proto/services.proto";
        println!("cargo:rerun-if-changed={PROTO}");
        let fds = protox::compile([PROTO], ["proto"]).unwrap_or_else(|e| {
            eprintln!("{PROTO}: {e}");
            std::process::exit(1);
        });
        tonic_prost_build::configure()
            .build_client(true)
            .compile_fds(fds)
            .unwrap_or_else(|e| {
                eprintln!("{PROTO}: {e}");
                std::process::exit(1);
            });
    }
}

/// A firmware image: `POLICYD_EMBED_CONFIG=configs/libero.toml cargo build --release` builds
/// that config and every model or plan it names into the binary, so `policyd` with no arguments
/// serves it with no files on the board. Writes `$OUT_DIR/baked.rs` (`BAKED`, `None` without
/// the variable), which src/demo.rs includes.
///
/// Checked here: the file is TOML, every `engine.model` and `denoise.model` (top level and each `[[policies]]`)
/// and `[inputs.tokenizer] file` exists, and key files (`auth.key_file`, `tls.cert`/`tls.key`, `planner.api_key_file`), which
/// stay on the board and are never built in, are absolute paths. The full validation runs when
/// the binary starts (and in `policyd check-config`).
mod bake {
    use std::env;
    use std::path::{Path, PathBuf};

    const VAR: &str = "POLICYD_EMBED_CONFIG";

    pub fn generate() {
        println!("cargo:rerun-if-env-changed={VAR}");
        let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
        let code = match env::var_os(VAR).filter(|v| !v.is_empty()) {
            None => "pub const BAKED: Option<Baked> = None;\n".to_string(),
            Some(p) => match code(Path::new(&p)) {
                Ok(code) => code,
                Err(why) => {
                    eprintln!("{VAR}: {why}");
                    std::process::exit(1);
                }
            },
        };
        std::fs::write(out.join("baked.rs"), code).expect("OUT_DIR is writable");
    }

    fn code(given: &Path) -> Result<String, String> {
        // Relative to the repository root (where cargo runs build scripts).
        let root = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
        let path = root.join(given);
        let abs = path
            .canonicalize()
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        println!("cargo:rerun-if-changed={}", abs.display());
        let text = std::fs::read_to_string(&abs)
            .map_err(|e| format!("cannot read {}: {e}", abs.display()))?;
        let table: toml::Table = text
            .parse()
            .map_err(|e| format!("{} is not valid TOML: {e}", abs.display()))?;
        let dir = abs.parent().unwrap_or(Path::new("/"));
        let get = |t: &toml::Table, keys: &[&str]| -> Option<String> {
            let mut v = t.get(keys[0])?;
            for k in &keys[1..] {
                v = v.get(k)?;
            }
            v.as_str().map(str::to_string)
        };
        let mut models: Vec<(String, String)> = Vec::new();
        let mut tables = vec![("engine.model".to_string(), &table)];
        if let Some(list) = table.get("policies").and_then(|p| p.as_array()) {
            for (i, p) in list.iter().enumerate() {
                if let Some(t) = p.as_table() {
                    tables.push((format!("policies[{i}].engine.model"), t));
                }
            }
        }
        // A pipeline's step graph (`[denoise] model`) is built in like the prefix.
        let mut graphs = Vec::new();
        for (key, t) in &tables {
            graphs.push((key.clone(), *t, ["engine", "model"]));
            let denoise = key.replace("engine.model", "denoise.model");
            graphs.push((denoise, *t, ["denoise", "model"]));
        }
        for (key, t, path) in &graphs {
            let Some(model) = get(t, path) else {
                continue;
            };
            if models.iter().any(|(m, _)| *m == model) {
                continue;
            }
            let file = dir.join(&model);
            let file = file
                .canonicalize()
                .map_err(|e| format!("{key} = \"{model}\": cannot read {}: {e}", file.display()))?;
            println!("cargo:rerun-if-changed={}", file.display());
            // A large graph's external data (`<graph>.data`, as policyd-export writes it) is
            // built in beside it.
            let data = PathBuf::from(format!("{}.data", file.display()));
            if data.is_file() {
                println!("cargo:rerun-if-changed={}", data.display());
                models.push((format!("{model}.data"), data.display().to_string()));
            }
            models.push((model, file.display().to_string()));
        }
        if !tables
            .iter()
            .any(|(_, t)| get(t, &["engine", "model"]).is_some())
        {
            return Err(format!("{} names no engine.model", abs.display()));
        }
        // Tokenizer files (`[inputs.tokenizer] file`) are built in beside the models.
        for (key, t) in &tables {
            let prefix = key.trim_end_matches("engine.model");
            let inputs = t.get("inputs").and_then(|i| i.as_array());
            for (j, input) in inputs.into_iter().flatten().enumerate() {
                let Some(file) = input
                    .as_table()
                    .and_then(|i| get(i, &["tokenizer", "file"]))
                else {
                    continue;
                };
                if models.iter().any(|(m, _)| *m == file) {
                    continue;
                }
                let path = dir.join(&file).canonicalize().map_err(|e| {
                    format!("{prefix}inputs[{j}].tokenizer.file = \"{file}\": cannot read it: {e}")
                })?;
                println!("cargo:rerun-if-changed={}", path.display());
                models.push((file, path.display().to_string()));
            }
        }
        for keys in [
            &["auth", "key_file"][..],
            &["tls", "cert"],
            &["tls", "key"],
            &["planner", "api_key_file"],
        ] {
            if let Some(f) = get(&table, keys)
                && !Path::new(&f).is_absolute()
            {
                return Err(format!(
                    "{} = \"{f}\" must be an absolute path in a baked config: key files stay on \
                     the board and are never built in",
                    keys.join(".")
                ));
            }
        }
        let mut code = format!(
            "pub const BAKED: Option<Baked> = Some(Baked {{\n    source: {:?},\n    config: \
             include_str!({:?}),\n    models: &[\n",
            given.display().to_string(),
            abs.display().to_string()
        );
        for (written, file) in &models {
            let name = Path::new(file)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            code += &format!(
                "        BakedModel {{ path: {written:?}, name: {name:?}, bytes: \
                 include_bytes!({file:?}) }},\n"
            );
        }
        code += "    ],\n});\n";
        Ok(code)
    }
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
