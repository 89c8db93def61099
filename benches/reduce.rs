//! CPU reduction kernels against a memcpy of the same bytes (criterion). The collective sweep
//! lives in `ringzero check` / `ringzero bench`, not here.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ringzero::kernels::{cpu, DType, ReduceOp};

fn kernels(c: &mut Criterion) {
    let mut g = c.benchmark_group("reduce_into");
    for bytes in [64 << 10, 4 << 20] {
        // Bytes touched: memcpy reads and writes once; a reduce reads dst and src and writes dst.
        g.throughput(Throughput::Bytes(2 * bytes as u64));
        let src = vec![1u8; bytes];
        let mut dst = vec![1u8; bytes];
        g.bench_with_input(BenchmarkId::new("memcpy", bytes), &bytes, |b, _| {
            b.iter(|| dst.copy_from_slice(&src))
        });
        for dtype in [DType::F32, DType::BF16, DType::F16, DType::I32] {
            // Keep the values tame so no denormals or infinities skew the timing.
            let mut dst = vec![0u8; bytes];
            let src = vec![0u8; bytes];
            g.throughput(Throughput::Bytes(3 * bytes as u64));
            g.bench_with_input(
                BenchmarkId::new(format!("sum_{dtype}"), bytes),
                &bytes,
                |b, _| b.iter(|| cpu::reduce_into(dtype, ReduceOp::Sum, &mut dst, &src).unwrap()),
            );
        }
    }
    g.finish();

    // Results larger than the caches: plain stores read each line before writing it; streaming
    // stores do not (what `RINGZERO_STREAM_STORES_FROM` switches on for the engine's copies). The
    // plain reduce is the figure a streaming reduce would have to beat (a tiled one did not).
    let mut g = c.benchmark_group("large_results");
    let bytes = 64 << 20;
    g.sample_size(10);
    g.throughput(Throughput::Bytes(2 * bytes as u64));
    let src = vec![1u8; bytes];
    let mut dst = vec![1u8; bytes];
    g.bench_function("memcpy_64M", |b| b.iter(|| dst.copy_from_slice(&src)));
    g.bench_function("copy_streaming_64M", |b| {
        b.iter(|| {
            cpu::copy_streaming(&mut dst, &src).unwrap();
            cpu::stream_fence();
        })
    });
    let other = vec![0u8; bytes];
    g.throughput(Throughput::Bytes(3 * bytes as u64));
    g.bench_function("reduce_to_f32_64M", |b| {
        b.iter(|| cpu::reduce_to(DType::F32, ReduceOp::Sum, &mut dst, &src, &other).unwrap())
    });
    g.finish();
}

criterion_group!(benches, kernels);
criterion_main!(benches);
