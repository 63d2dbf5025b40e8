//! The `ort` backend through policyd's engine interface: a firmware image's built-in model
//! (bytes, with external data) runs as its file does, `engine.threads` keeps the actions, and
//! every way of getting the library wrong is a start-up error that says what to do.
#![cfg(feature = "ort")]

use std::path::{Path, PathBuf};
use std::process::Command;

use policyd::config::{Config, ModelSource};

mod common;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

use common::ort_config;

/// One run of `spec`'s engine (on ort) on patterned inputs; the outputs' bytes.
fn run(spec: &policyd::config::PolicySpec) -> Vec<Vec<u8>> {
    let (backend, outputs) = common::patterned_run(spec);
    assert_eq!(backend, "ort");
    assert!(outputs.iter().any(|o| o.iter().any(|&b| b != 0)), "ran");
    outputs
}

#[test]
fn a_built_in_model_runs_as_its_file_does_and_threads_keep_the_actions() {
    let Some(lib) = common::ort_library() else {
        return;
    };
    let cfg = Config::parse(&ort_config("aloha", &lib, ""), "test", None).unwrap();
    let spec = cfg.default_policy().clone();
    let from_file = run(&spec);
    let ModelSource::File(path) = &spec.model else {
        panic!("a file");
    };
    let bytes: &'static [u8] = Vec::leak(std::fs::read(path).unwrap());
    let mut embedded = spec.clone();
    embedded.model = ModelSource::Embedded {
        name: "aloha.onnx",
        bytes,
        data: &[],
    };
    assert_eq!(run(&embedded), from_file);
    let mut two = spec.clone();
    two.engine.threads = 2;
    let a = run(&two);
    let close = a[0]
        .chunks(4)
        .zip(from_file[0].chunks(4))
        .map(|(x, y)| {
            let f = |b: &[u8]| f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            (f(x) - f(y)).abs()
        })
        .fold(0f32, f32::max);
    assert!(close < 1e-4, "2 threads differ by {close}");
}

/// A pipeline (prefix + step graph, the flow sampler) on ort.
#[test]
fn a_pipeline_runs_on_ort() {
    let Some(lib) = common::ort_library() else {
        return;
    };
    let cfg = Config::parse(&ort_config("flow", &lib, ""), "test", None).unwrap();
    let mut engine = policyd::engine::open(cfg.default_policy()).unwrap();
    let mut inputs = engine.alloc_inputs().unwrap();
    let mut outputs = common::output_buffers(engine.as_ref());
    let sampling = policyd::engine::Sampling { seed: 3, steps: 10 };
    let stats = engine
        .run_sampled(&mut inputs, &mut outputs, false, sampling, None)
        .unwrap();
    assert_eq!(stats.stages.map(|s| s.steps), Some(10));
    assert!(outputs[0].iter().any(|&b| b != 0));
}

fn check_config(text: &str) -> std::process::Output {
    let dir = std::env::temp_dir().join(format!("policyd-ort-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("c{}.toml", text.len()));
    std::fs::write(&path, text).unwrap();
    let cmd = common::policyd_command();
    Command::new(&cmd[0])
        .args(&cmd[1..])
        .arg("check-config")
        .arg(&path)
        .env_remove("ORT_DYLIB_PATH")
        .output()
        .unwrap()
}

fn stderr(o: &std::process::Output) -> String {
    assert!(!o.status.success(), "check-config passed");
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A library that says it is onnxruntime 1.9.0 (too old) exports only `OrtGetApiBase`.
fn old_library() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("policyd-ort-old-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("old.c");
    std::fs::write(
        &src,
        "typedef struct { const void *(*get_api)(unsigned); const char *(*version)(void); } base_t;\n\
         static const void *get_api(unsigned v) { (void)v; return 0; }\n\
         static const char *version(void) { return \"1.9.0\"; }\n\
         static const base_t base = { get_api, version };\n\
         const base_t *OrtGetApiBase(void) { return &base; }\n",
    )
    .unwrap();
    let lib = dir.join("libonnxruntime.so.1.9.0");
    // The target's C compiler: the cross one when the tests run under emulation.
    let cc = std::env::var("CC_aarch64_unknown_linux_gnu")
        .ok()
        .filter(|_| cfg!(target_arch = "aarch64"))
        .unwrap_or_else(|| "cc".into());
    let ok = Command::new(cc)
        .args(["-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(&src)
        .status()
        .expect("cc runs");
    assert!(ok.success());
    lib
}

#[test]
fn library_and_provider_mistakes_are_start_up_errors_that_say_what_to_do() {
    // Needs no real onnxruntime: each is refused before a session exists.
    let nowhere = Path::new("/nonexistent/libonnxruntime.so");
    let e = stderr(&check_config(&ort_config("tiny", nowhere, "")));
    assert!(
        e.contains("engine.ort_library") && e.contains("pip install onnxruntime"),
        "{e}"
    );

    let old = old_library();
    let e = stderr(&check_config(&ort_config("tiny", &old, "")));
    assert!(
        e.contains("onnxruntime 1.9.0") && e.contains("too old") && e.contains("1.18 or newer"),
        "{e}"
    );
    // The folder stands for the newest libonnxruntime.so.<version> in it.
    let e = stderr(&check_config(&ort_config(
        "tiny",
        old.parent().unwrap(),
        "",
    )));
    assert!(e.contains("1.9.0") && e.contains("too old"), "{e}");

    // A real shared library of this target's architecture that is not onnxruntime.
    let libm: &[&str] = if cfg!(target_arch = "aarch64") {
        &[
            "/lib/aarch64-linux-gnu/libm.so.6",
            "/usr/aarch64-linux-gnu/lib/libm.so.6",
        ]
    } else {
        &["/lib/x86_64-linux-gnu/libm.so.6"]
    };
    let libm = libm.iter().map(Path::new).find(|p| p.exists());
    if let Some(libm) = libm {
        let e = stderr(&check_config(&ort_config("tiny", libm, "")));
        assert!(e.contains("is not onnxruntime"), "{e}");
    }

    for (extra, want) in [
        ("\nproviders = [\"npu\"]", "unknown provider \"npu\""),
        ("\nproviders = []", "engine.providers"),
        ("\nproviders = [\"cpu\", \"cpu\"]", "listed twice"),
        ("\nthreads = 0", "engine.threads"),
        ("\nthreads = 100000", "engine.threads"),
        ("\ndevice = 1", "engine.device"),
    ] {
        // A library that exists (so the key named is the one at fault).
        let e = stderr(&check_config(&ort_config("tiny", &old, extra)));
        assert!(e.contains(want), "{extra}: {e}");
    }
    let e = stderr(&check_config(&ort_config("tiny", Path::new(""), "")));
    assert!(
        e.contains("engine.ort_library") && e.contains("is empty"),
        "{e}"
    );
    // providers on another backend.
    let cpu = common::demo_config_text("tiny").replacen(
        "backend = \"cpu\"",
        "backend = \"cpu\"\nproviders = [\"cuda\"]",
        1,
    );
    let e = stderr(&check_config(&cpu));
    assert!(e.contains("applies to the ort backend only"), "{e}");
    // spinning too, naming its key; a bool, named when it is not one.
    let cpu = common::demo_config_text("tiny").replacen(
        "backend = \"cpu\"",
        "backend = \"cpu\"\nspinning = false",
        1,
    );
    let e = stderr(&check_config(&cpu));
    assert!(
        e.contains("engine.spinning") && e.contains("applies to the ort backend only"),
        "{e}"
    );
    let e = stderr(&check_config(&ort_config(
        "tiny",
        &old,
        "\nspinning = \"no\"",
    )));
    assert!(e.contains("spinning"), "{e}");
}

#[test]
fn a_provider_the_library_lacks_is_named_with_what_it_has() {
    let Some(lib) = common::ort_library() else {
        return;
    };
    let e = stderr(&check_config(&ort_config(
        "tiny",
        &lib,
        "\nproviders = [\"cuda\", \"cpu\"]",
    )));
    assert!(
        e.contains("engine.providers names \"cuda\"") && e.contains("CPUExecutionProvider"),
        "{e}"
    );
    assert!(e.contains("onnxruntime-gpu"), "{e}");
}

#[test]
fn no_library_anywhere_says_where_it_looked() {
    // No engine.ort_library and no ORT_DYLIB_PATH: the system's path, where CI has none.
    let text = ort_config("tiny", Path::new("/x"), "").replace("ort_library = \"/x\"\n", "");
    let out = check_config(&text);
    let e = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        // This machine has one installed: the log says where it came from.
        assert!(e.contains("(the system's library path)"), "{e}");
    } else {
        assert!(
            e.contains("no onnxruntime library")
                && e.contains("the system's library path")
                && e.contains("pip install onnxruntime"),
            "{e}"
        );
    }
}

/// Counts every C heap allocation in the process (malloc and friends, which C++'s `new` calls)
/// when preloaded: what onnxruntime allocates inside a run, which Rust's allocator cannot see.
const COUNTING_MALLOC: &str = r#"
#include <stddef.h>
#include <stdatomic.h>
extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
static _Atomic unsigned long count;
#define COUNT atomic_fetch_add_explicit(&count, 1, memory_order_relaxed)
void *malloc(size_t s) { COUNT; return __libc_malloc(s); }
void *calloc(size_t a, size_t b) { COUNT; return __libc_calloc(a, b); }
void *realloc(void *p, size_t s) { COUNT; return __libc_realloc(p, s); }
void *memalign(size_t a, size_t s) { COUNT; return __libc_memalign(a, s); }
void *aligned_alloc(size_t a, size_t s) { COUNT; return __libc_memalign(a, s); }
int posix_memalign(void **p, size_t a, size_t s) {
    COUNT; *p = __libc_memalign(a, s); return *p ? 0 : 12;
}
unsigned long policyd_c_mallocs(void) { return count; }
"#;

fn c_mallocs() -> Option<u64> {
    // SAFETY: looks up the preloaded counter, if any; it takes no arguments.
    unsafe {
        let sym = libc::dlsym(libc::RTLD_DEFAULT, c"policyd_c_mallocs".as_ptr());
        (!sym.is_null()).then(|| {
            let f: extern "C" fn() -> libc::c_ulong = std::mem::transmute(sym);
            f() as u64
        })
    }
}

/// onnxruntime's own C/C++ heap allocations per run, measured in a child process with a
/// counting malloc preloaded, and printed (they are ORT's, outside policyd's path, which
/// tests/alloc.rs holds at zero).
#[test]
fn onnxruntimes_own_allocations_per_run_are_measured() {
    let Some(lib) = common::ort_library() else {
        return;
    };
    if std::env::var_os("POLICYD_CROSS_RUNNER").is_some() {
        // Under emulation the child cannot be started (and counts would be the emulator's).
        eprintln!("skipped under an emulator: the native run measures this");
        return;
    }
    if std::env::var_os("POLICYD_ORT_CHILD").is_some() {
        for config in ["aloha", "flow"] {
            let cfg = Config::parse(&ort_config(config, &lib, ""), "test", None).unwrap();
            let mut engine = policyd::engine::open(cfg.default_policy()).unwrap();
            let mut inputs = engine.alloc_inputs().unwrap();
            let mut outputs = common::output_buffers(engine.as_ref());
            let sampling = policyd::engine::Sampling { seed: 1, steps: 10 };
            for _ in 0..5 {
                engine
                    .run_sampled(&mut inputs, &mut outputs, false, sampling, None)
                    .unwrap();
            }
            let before = c_mallocs().expect("the counting malloc is preloaded");
            let n = 100;
            for _ in 0..n {
                engine
                    .run_sampled(&mut inputs, &mut outputs, false, sampling, None)
                    .unwrap();
            }
            let per_run = (c_mallocs().unwrap() - before) as f64 / n as f64;
            println!("C-ALLOCS {config} {per_run:.1}");
        }
        return;
    }
    let dir = std::env::temp_dir().join(format!("policyd-ort-malloc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("count.c"), COUNTING_MALLOC).unwrap();
    let shim = dir.join("libcount.so");
    let built = Command::new("cc")
        .args(["-O2", "-shared", "-fPIC", "-o"])
        .arg(&shim)
        .arg(dir.join("count.c"))
        .status()
        .expect("cc runs");
    assert!(built.success());
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "onnxruntimes_own_allocations_per_run_are_measured",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("POLICYD_ORT_CHILD", "1")
        .env("LD_PRELOAD", &shim)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split_once("C-ALLOCS ").map(|(_, m)| m))
        .collect();
    assert_eq!(lines.len(), 2, "{text}");
    for l in lines {
        println!("onnxruntime's own heap allocations per run (config, count): {l}");
    }
}

/// A graph with its weights as ONNX external data (as policyd-export writes graphs past 2 GB):
/// from files beside each other, and built into the binary as a firmware image holds it (both
/// in memory), each gives the outputs of the graph with its weights inline. (The graph is
/// rewritten with tract-onnx's protobuf types, so this needs the `cpu` feature too.)
#[cfg(feature = "cpu")]
#[test]
fn external_data_from_files_and_from_memory_runs_as_inline_weights_do() {
    use prost::Message;
    use tract_onnx::pb::tensor_proto::DataLocation;
    use tract_onnx::pb::{ModelProto, StringStringEntryProto};
    let Some(lib) = common::ort_library() else {
        return;
    };
    let inline = Config::parse(&ort_config("aloha", &lib, ""), "test", None).unwrap();
    let spec = inline.default_policy().clone();
    let want = run(&spec);
    let bytes = std::fs::read(root().join("models/aloha.onnx")).unwrap();
    let mut model = ModelProto::decode(bytes.as_slice()).unwrap();
    let mut data = Vec::new();
    let graph = model.graph.as_mut().unwrap();
    for t in &mut graph.initializer {
        if t.raw_data.len() < 1024 {
            continue;
        }
        let entry = |key: &str, value: String| StringStringEntryProto {
            key: key.into(),
            value,
        };
        t.external_data = vec![
            entry("location", "aloha.onnx.data".into()),
            entry("offset", data.len().to_string()),
            entry("length", t.raw_data.len().to_string()),
        ];
        data.append(&mut t.raw_data);
        t.data_location = Some(DataLocation::External as i32);
    }
    assert!(
        data.len() > 100_000,
        "weights moved out: {} bytes",
        data.len()
    );
    let graph_bytes = model.encode_to_vec();
    let dir = std::env::temp_dir().join(format!("policyd-ort-ext-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("aloha.onnx"), &graph_bytes).unwrap();
    std::fs::write(dir.join("aloha.onnx.data"), &data).unwrap();
    let mut from_files = spec.clone();
    from_files.model = ModelSource::File(dir.join("aloha.onnx"));
    assert_eq!(run(&from_files), want);
    let mut built_in = spec.clone();
    built_in.model = ModelSource::Embedded {
        name: "aloha.onnx",
        bytes: Vec::leak(graph_bytes),
        data: Vec::leak(data),
    };
    assert_eq!(run(&built_in), want);
}
