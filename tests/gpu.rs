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

use policyd::engine::tensorrt::device::{
    CudaDevice, Device, HostAlloc, Mark, UpdateArgs, driver_present,
};
use policyd::rtc::StepTerm;
use policyd::sampler::{Betas, Diffusion, Kind, Prediction, Sampler, Update};

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
    dev.mark(Mark::Start).unwrap();
    // SAFETY: page-locked buffers of `n` bytes that outlive the copies (synchronised below).
    unsafe {
        dev.copy_htod(d, src.ptr, n).unwrap();
        dev.copy_dtoh(dst.ptr, d, n).unwrap();
    }
    dev.mark(Mark::End).unwrap();
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
    dev.mark(Mark::Start).unwrap();
    // SAFETY: live buffers of `n` bytes, synchronised below.
    unsafe { dev.copy_dtoh(out.ptr, mapped.device, n).unwrap() };
    dev.mark(Mark::End).unwrap();
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
        dev.mark(Mark::Start).unwrap();
        dev.launch(graph).expect("cuGraphLaunch");
        dev.mark(Mark::End).unwrap();
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

/// The samplers whose updates the kernel is checked with: flow, DDPM (epsilon, clipped) and
/// DDIM (v-prediction, eta 0.5, unclipped; sample prediction, clipped).
fn samplers() -> Vec<Sampler> {
    let d = |kind, prediction, clip, eta| {
        Sampler::diffusion(
            kind,
            Diffusion {
                train_timesteps: 100,
                betas: Betas::SquaredCosCapV2,
                beta_start: 0.0001,
                beta_end: 0.02,
                prediction,
                clip,
                eta,
            },
        )
    };
    vec![
        Sampler::flow(),
        d(Kind::Ddpm, Prediction::Epsilon, Some(1.0), 0.0),
        d(Kind::Ddim, Prediction::VPrediction, None, 0.5),
        d(Kind::Ddim, Prediction::Sample, Some(1.0), 0.0),
    ]
}

/// The sampler's update kernel (`update.ptx`), JIT-compiled by this driver: for every
/// sampler's coefficients it computes what `sampler::Update::apply` computes on the host,
/// exactly, and with real-time chunking's terms (guidance, GR00T's strengths) what
/// `rtc::StepTerm::apply` computes before it; a non-finite model output lowers the flag to
/// the step; and it runs from a graph.
#[test]
#[ignore = "needs an NVIDIA GPU: cross/gpu-check"]
fn the_update_kernel_computes_the_hosts_update_exactly() {
    let dev = device();
    let kernel = dev
        .load_update()
        .expect("update.ptx loads (JIT-compiled by this driver)");
    // More than one block of 256 threads, and not a multiple of it.
    let n = 1000usize;
    let (x_at, m_at, z_at, coef_at, flag_at) = (0, 4 * n, 8 * n, 12 * n, 12 * n + 64);
    // RTC: the leftover, and rows of 7 values (the last one partial).
    let width = 7usize;
    let (prev_at, rows_at) = (flag_at + 64, flag_at + 64 + 4 * n);
    let total = rows_at + 4 * n.div_ceil(width);
    let host = dev.alloc_host(total, false).unwrap();
    let d = dev.alloc_device(total).unwrap();
    // SAFETY: `host` is a live page-locked allocation of `total` bytes, used only between
    // synchronisations.
    let h = unsafe { std::slice::from_raw_parts_mut(host.ptr, total) };
    let f = |h: &[u8], at: usize| f32::from_le_bytes(h[at..at + 4].try_into().unwrap());
    let put = |h: &mut [u8], at: usize, v: f32| h[at..at + 4].copy_from_slice(&v.to_le_bytes());
    let args = |step| UpdateArgs {
        x: d,
        m: d + m_at as u64,
        noise: d + z_at as u64,
        coef: d + coef_at as u64,
        flag: d + flag_at as u64,
        n: n as u32,
        step,
        prev: d + prev_at as u64,
        rows: d + rows_at as u64,
        width: width as u32,
    };
    let fill_rtc = |h: &mut [u8], u: &Update, term: StepTerm, salt: usize| {
        for k in 0..n {
            let v = |a: usize, b: usize| ((k * a + salt) % b) as f32 / b as f32 * 6.0 - 3.0;
            put(h, x_at + 4 * k, v(37, 101));
            put(h, m_at + 4 * k, v(53, 97));
            put(h, z_at + 4 * k, v(29, 89));
            put(h, prev_at + 4 * k, v(31, 83));
        }
        // Weights in [0, 1] with exact zeros and ones among them.
        for r in 0..n.div_ceil(width) {
            put(h, rows_at + 4 * r, ((r * 5 + salt) % 9) as f32 / 8.0);
        }
        u.write(&mut h[coef_at..coef_at + Update::BYTES]);
        term.write(&mut h[coef_at + Update::BYTES..coef_at + Update::BYTES + StepTerm::BYTES]);
        h[flag_at..flag_at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    };
    let fill = |h: &mut [u8], u: &Update, salt: usize| fill_rtc(h, u, StepTerm::Plain, salt);
    let run = |step: u32| {
        // SAFETY: the buffers are live and `total` bytes; synchronised before the host reads.
        unsafe {
            dev.copy_htod(d, host.ptr, total).unwrap();
            dev.launch_update(kernel, &args(step))
                .expect("cuLaunchKernel");
            dev.copy_dtoh(host.ptr, d, total).unwrap();
        }
        dev.synchronize().expect("the update kernel ran");
    };
    let check_rtc = |h: &[u8], before: &[f32], u: &Update, term: StepTerm, what: &str| {
        for (k, &x) in before.iter().enumerate() {
            let w = f(h, rows_at + 4 * (k / width));
            let m = term.apply(f(h, m_at + 4 * k), x, f(h, prev_at + 4 * k), w);
            let want = u.apply(x, m, f(h, z_at + 4 * k));
            let got = f(h, x_at + 4 * k);
            assert!(
                got == want || (got.is_nan() && want.is_nan()),
                "{what} [{k}]: GPU {got:e} ({:#x}), host {want:e} ({:#x})",
                got.to_bits(),
                want.to_bits()
            );
        }
    };
    let check = |h: &[u8], before: &[f32], u: &Update, what: &str| {
        check_rtc(h, before, u, StepTerm::Plain, what)
    };
    for (si, s) in samplers().iter().enumerate() {
        for steps in [1, 10] {
            for i in 0..steps {
                let u = s.update(i, steps);
                fill(h, &u, si * 7 + i);
                let before: Vec<f32> = (0..n).map(|k| f(h, x_at + 4 * k)).collect();
                run(i as u32);
                check(h, &before, &u, &format!("{:?} step {i} of {steps}", s.kind));
                assert_eq!(
                    f(h, flag_at).to_bits(),
                    u32::MAX,
                    "no flag for finite outputs"
                );
            }
        }
    }
    // Real-time chunking: guidance (the weight at both caps and between) and GR00T's strengths,
    // on flow's update.
    let flow = samplers()[0].clone();
    let terms = [
        StepTerm::Guide { g: 10.0, time: 1.0 },
        StepTerm::Guide { g: 2.75, time: 0.4 },
        StepTerm::Guide { g: 0.0, time: 0.0 },
        StepTerm::Scale,
    ];
    for (ti, term) in terms.into_iter().enumerate() {
        let u = flow.update(2, 10);
        fill_rtc(h, &u, term, 50 + ti);
        let before: Vec<f32> = (0..n).map(|k| f(h, x_at + 4 * k)).collect();
        run(2);
        check_rtc(h, &before, &u, term, &format!("{term:?}"));
    }
    // A NaN and an infinity in the model's output: the flag holds the lowest step.
    let u = samplers()[1].update(3, 10);
    fill(h, &u, 1);
    put(h, m_at + 4 * 7, f32::NAN);
    put(h, m_at + 4 * 900, f32::INFINITY);
    run(3);
    assert_eq!(
        u32::from_le_bytes(h[flag_at..flag_at + 4].try_into().unwrap()),
        3
    );
    // From a graph: captured once, replayed with new coefficients and data each time.
    dev.begin_capture().expect("cuStreamBeginCapture");
    // SAFETY: recorded, not run; the buffers live until the graph is destroyed.
    unsafe {
        dev.copy_htod(d, host.ptr, total).unwrap();
        dev.launch_update(kernel, &args(0)).unwrap();
        dev.copy_dtoh(host.ptr, d, total).unwrap();
    }
    let graph = dev
        .end_capture()
        .expect("a kernel launch captured into a graph");
    for (si, s) in samplers().iter().enumerate() {
        let u = s.update(0, 10);
        fill(h, &u, 100 + si);
        let before: Vec<f32> = (0..n).map(|k| f(h, x_at + 4 * k)).collect();
        dev.launch(graph).expect("cuGraphLaunch");
        dev.synchronize().unwrap();
        check(h, &before, &u, &format!("{:?} from a graph", s.kind));
    }
    // SAFETY: made above, released once, the stream idle.
    unsafe {
        dev.destroy_graph(graph);
        dev.unload(kernel);
        dev.free_device(d);
        dev.free_host(host.ptr);
    }
}
