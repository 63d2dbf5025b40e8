//! Input and output transforms on their own: the element maps the decoder applies between the
//! wire and the engine's buffers (camera bytes to float, HWC↔CHW, openpi's normalisation, the
//! output's unnormalisation). Each names the bytes it reads and writes, so throughput can be
//! read against memory bandwidth.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use policyd::dtype::{ByteOrder, ElemType};
use policyd::transform::{Affine, Transform};

fn image(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 % 251) as u8 + 1).collect()
}

fn bench_one(c: &mut Criterion, name: &str, t: &Transform, src: &[u8]) {
    let mut dst = vec![0u8; t.dst_bytes()];
    let moved = src.len() + dst.len();
    let mut g = c.benchmark_group("transform");
    g.throughput(Throughput::Bytes(moved as u64));
    g.bench_function(
        format!("{name} ({} B in, {} B out)", src.len(), dst.len()),
        |b| b.iter(|| assert!(t.apply(src, ByteOrder::Little, &mut dst))),
    );
    g.finish();
}

fn bench(c: &mut Criterion) {
    use ElemType::{F32, F64, U8};
    let hwc = [224, 224, 3];
    let n = 224 * 224 * 3;
    let img = image(n);
    // openpi's image scaling, uint8 → [-1, 1].
    let to_unit = Affine::normalize(2.0 / 255.0, -1.0, &[], &[], 1e-6);

    let t = Transform::elementwise(U8, F32, n, to_unit.clone());
    bench_one(c, "u8->f32 scaled, CHW kept (ALOHA camera)", &t, &img);

    let t = Transform::permuted(U8, F32, &hwc, &[2, 0, 1], to_unit.clone());
    bench_one(
        c,
        "u8->f32 scaled, HWC->CHW (LIBERO/DROID camera)",
        &t,
        &img,
    );

    let imagenet = Affine::normalize(
        1.0 / 255.0,
        0.0,
        &[0.485, 0.456, 0.406],
        &[0.229, 0.224, 0.225],
        1e-6,
    );
    let t = Transform::permuted(U8, F32, &hwc, &[2, 0, 1], imagenet);
    bench_one(c, "u8->f32 per-channel mean/std, HWC->CHW", &t, &img);

    let chw = [3, 224, 224];
    let t = Transform::permuted(U8, U8, &chw, &[1, 2, 0], Affine::IDENTITY);
    bench_one(c, "u8 CHW->HWC, no conversion", &t, &img);

    let t = Transform::elementwise(U8, U8, n, Affine::IDENTITY);
    bench_one(c, "u8 copy (the floor of any input map)", &t, &img);

    let mean: Vec<f64> = (0..14).map(|i| i as f64 * 0.1).collect();
    let std: Vec<f64> = (0..14).map(|i| 1.0 + i as f64 * 0.05).collect();
    let state: Vec<u8> = (0..14)
        .flat_map(|i| (i as f64 * 0.3).to_le_bytes())
        .collect();
    let t = Transform::elementwise(F64, F32, 14, Affine::normalize(1.0, 0.0, &mean, &std, 1e-6));
    bench_one(c, "f64->f32 state [14], per-feature mean/std", &t, &state);

    let actions: Vec<u8> = (0..50 * 14)
        .flat_map(|i| (i as f32 * 1e-3).to_le_bytes())
        .collect();
    let t = Transform::first_columns(
        F32,
        F32,
        &[50, 14],
        14,
        Affine::unnormalize(&mean, &std, 1e-6),
    );
    bench_one(c, "f32 actions [50, 14], unnormalised", &t, &actions);
}

criterion_group!(benches, bench);
criterion_main!(benches);
