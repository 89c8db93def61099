//! The CPU optimizer step (what a ZeRO-Offload engine runs on its host shard) against a memcpy
//! of the same bytes on the same threads, and on one thread (criterion). Throughput is the bytes
//! the step touches: AdamW reads the master, the gradient and both moments and writes the
//! master and both moments (28 bytes per element); the memcpy baseline moves as many (14 bytes
//! read, 14 written, per element), split the same way over the same threads. The offload
//! engine's own step, `step_mixed_threads` on bf16 gradients (fp32 master and moments, bf16
//! parameters written), touches 28 bytes per element too: 4 + 2 + 8 read, 4 + 8 + 2 written.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::{bf16, f16};
use ringzero::kernels::cpu::{optim_step, optim_step_threads, step_mixed_threads, Optimizer};

/// `dst = src` on `threads` threads, each its own run.
fn copy_threads(dst: &mut [u8], src: &[u8], threads: usize) {
    let run = dst.len().div_ceil(threads).div_ceil(64) * 64;
    std::thread::scope(|s| {
        for (d, c) in dst.chunks_mut(run).zip(src.chunks(run)) {
            s.spawn(move || d.copy_from_slice(c));
        }
    });
}

fn step(c: &mut Criterion) {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let mut g = c.benchmark_group("cpu_optim_step");
    g.sample_size(20);
    let n = 8 << 20; // 8M parameters: 224 MiB touched per AdamW step
    let h = Optimizer::adamw(1e-3);
    let grads: Vec<f32> = (0..n).map(|i| (i as f32 * 1e-3).sin() * 1e-2).collect();
    let mut p: Vec<f32> = (0..n).map(|i| (i as f32 * 7e-4).cos()).collect();
    let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
    let bytes = 28 * n as u64;
    g.throughput(Throughput::Bytes(bytes));
    let mut t = 0;
    g.bench_function(BenchmarkId::new("adamw", "1 thread"), |b| {
        b.iter(|| {
            t += 1;
            optim_step(&h, t, &mut p, &grads, &mut m, &mut v, 1.0)
        })
    });
    g.bench_function(
        BenchmarkId::new("adamw", format!("{threads} threads")),
        |b| {
            b.iter(|| {
                t += 1;
                optim_step_threads(&h, t, &mut p, &grads, &mut m, &mut v, 1.0, threads)
            })
        },
    );
    let g16: Vec<bf16> = grads.iter().map(|&x| bf16::from_f32(x)).collect();
    let mut p16 = vec![bf16::ZERO; n];
    // One thread, each precision: what the 16-bit conversions cost beside the rule's arithmetic.
    g.bench_function(BenchmarkId::new("offload step bf16", "1 thread"), |b| {
        b.iter(|| {
            t += 1;
            step_mixed_threads(&h, t, &mut p, Some(&mut p16), &g16, &mut m, &mut v, 1.0, 1)
        })
    });
    let gh: Vec<f16> = grads.iter().map(|&x| f16::from_f32(x)).collect();
    let mut ph = vec![f16::ZERO; n];
    g.bench_function(BenchmarkId::new("offload step fp16", "1 thread"), |b| {
        b.iter(|| {
            t += 1;
            step_mixed_threads(&h, t, &mut p, Some(&mut ph), &gh, &mut m, &mut v, 1.0, 1)
        })
    });
    g.bench_function(
        BenchmarkId::new("offload step bf16", format!("{threads} threads")),
        |b| {
            b.iter(|| {
                t += 1;
                step_mixed_threads(
                    &h,
                    t,
                    &mut p,
                    Some(&mut p16),
                    &g16,
                    &mut m,
                    &mut v,
                    1.0,
                    threads,
                )
            })
        },
    );
    let src = vec![1u8; 14 * n];
    let mut dst = vec![0u8; 14 * n];
    g.bench_function(
        BenchmarkId::new("memcpy", format!("{threads} threads")),
        |b| b.iter(|| copy_threads(&mut dst, &src, threads)),
    );
    g.finish();
}

criterion_group!(benches, step);
criterion_main!(benches);
