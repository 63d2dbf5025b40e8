//! CUDA on a real GPU, without TensorRT: what the TensorRT backend asks of CUDA
//! (`engine::tensorrt::device::CudaDevice`, cudarc with the `cuda-11040` symbol set, loaded at
//! run time), checked on whatever driver the machine has (12.x and 13.x included). Ignored by
//! default: there is no GPU where CI runs. `cross/gpu-check` runs them with `--ignored`:
//!
//!     cargo test --release --features tensorrt --test gpu -- --ignored --test-threads 1
//!
//! Each test drops everything it made; a failure to free shows as an error from the driver in
//! the next test, or as a crash at exit.
#![cfg(feature = "tensorrt")]

use policyd::engine::tensorrt::device::{CudaDevice, Device, HostAlloc, driver_present};

const MIB: usize = 1 << 20;

fn device() -> CudaDevice {
    assert!(
        driver_present(),
        "no CUDA driver (libcuda.so.1) on this machine"
    );
    CudaDevice::open(0).expect("CUDA device 0 opens")
}

fn fill(h: &HostAlloc, seed: u8) {
    // SAFETY: `h` is a live page-locked allocation of `h.len` bytes.
    let s = unsafe { std::slice::from_raw_parts_mut(h.ptr, h.len) };
    for (i, b) in s.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(7).wrapping_add(seed);
    }
}

fn bytes(h: &HostAlloc) -> &[u8] {
    // SAFETY: as above, read after the stream's work is done.
    unsafe { std::slice::from_raw_parts(h.ptr, h.len) }
}

#[test]
#[ignore = "needs an NVIDIA GPU: cross/gpu-check"]
fn device_and_page_locked_memory_round_trip() {
    let dev = device();
    eprintln!("{}", dev.describe());
    let n = 4 * MIB;
    let d = dev.alloc_device(n).expect("cuMemAlloc");
    let src = dev.alloc_host(n, false).expect("cuMemHostAlloc");
    let dst = dev.alloc_host(n, false).expect("cuMemHostAlloc");
    fill(&src, 3);
    dev.mark(false).unwrap();
    // SAFETY: page-locked buffers of `n` bytes that outlive the copies (synchronised below).
    unsafe {
        dev.copy_htod(d, src.ptr, n).unwrap();
        dev.copy_dtoh(dst.ptr, d, n).unwrap();
    }
    dev.mark(true).unwrap();
    let t = dev.finish().expect("event sync");
    assert_eq!(bytes(&dst), bytes(&src));
    assert!(t.as_nanos() > 0, "events time the copies: {t:?}");
    // SAFETY: allocated above, freed once, not used again.
    unsafe {
        dev.free_device(d);
        dev.free_host(src.ptr);
        dev.free_host(dst.ptr);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: cross/gpu-check"]
fn mapped_host_memory_has_a_device_pointer_the_gpu_reads() {
    let dev = device();
    let n = MIB;
    let mapped = dev.alloc_host(n, true).expect("cuMemHostAlloc(DEVICEMAP)");
    assert_ne!(
        mapped.device, 0,
        "cuMemHostGetDevicePointer resolved an address"
    );
    let out = dev.alloc_host(n, false).unwrap();
    fill(&mapped, 11);
    // The GPU copies from the mapped buffer through its device address (what TensorRT does
    // with zero-copy inputs).
    dev.mark(false).unwrap();
    // SAFETY: live buffers of `n` bytes, synchronised below.
    unsafe { dev.copy_dtoh(out.ptr, mapped.device, n).unwrap() };
    dev.mark(true).unwrap();
    dev.finish().unwrap();
    assert_eq!(bytes(&out), bytes(&mapped));
    // SAFETY: allocated above, freed once.
    unsafe {
        dev.free_host(mapped.ptr);
        dev.free_host(out.ptr);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: cross/gpu-check"]
fn copies_captured_into_a_graph_replay_with_fresh_data() {
    let dev = device();
    let n = MIB;
    let d = dev.alloc_device(n).unwrap();
    let src = dev.alloc_host(n, false).unwrap();
    let dst = dev.alloc_host(n, false).unwrap();
    dev.begin_capture().expect("cuStreamBeginCapture");
    // SAFETY: recorded, not run; the buffers live until the graph is destroyed.
    unsafe {
        dev.copy_htod(d, src.ptr, n).unwrap();
        dev.copy_dtoh(dst.ptr, d, n).unwrap();
    }
    let graph = dev.end_capture().expect("capture, instantiate and upload");
    // Launched 3 times, with the source changed in between: each replay reads it anew.
    for seed in 1..=3u8 {
        fill(&src, seed);
        dev.mark(false).unwrap();
        dev.launch(graph).expect("cuGraphLaunch");
        dev.mark(true).unwrap();
        let t = dev.finish().unwrap();
        assert_eq!(bytes(&dst), bytes(&src), "replay {seed}");
        assert!(t.as_nanos() > 0, "replay {seed}: {t:?}");
    }
    // An aborted capture leaves the stream usable and nothing behind.
    dev.begin_capture().unwrap();
    dev.abort_capture();
    dev.synchronize()
        .expect("the stream works after an aborted capture");
    // SAFETY: captured above, destroyed once; buffers freed once.
    unsafe {
        dev.destroy_graph(graph);
        dev.free_device(d);
        dev.free_host(src.ptr);
        dev.free_host(dst.ptr);
    }
}
