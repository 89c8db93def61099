//! What a single-copy all-gather's read of another rank's part costs per byte (criterion): one
//! `process_vm_readv` of a plain buffer (the default path; the kernel pins every page and copies
//! page by page), a `memcpy` out of a kept mapping of a `SharedBuf`'s memfd (the path an input in
//! a `SharedBuf` takes), and a plain `memcpy` between two buffers of this process as the
//! baseline. The reader is this process reading itself: the same system call and the same
//! mapping a peer process makes, without a second process's noise.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ringzero_collectives::internals::transport::cma;
use ringzero_collectives::internals::transport::memfd::{PeerSegment, Segment};

fn peer_read(c: &mut Criterion) {
    let mut g = c.benchmark_group("peer_read");
    g.sample_size(30);
    let pid = std::process::id();
    for bytes in [64usize << 10, 512 << 10, 4 << 20, 32 << 20] {
        g.throughput(Throughput::Bytes(bytes as u64));
        let src = vec![1u8; bytes];
        let mut dst = vec![0u8; bytes];
        g.bench_with_input(
            BenchmarkId::new("process_vm_readv", bytes),
            &bytes,
            |b, _| b.iter(|| cma::read(pid, src.as_ptr() as u64, &mut dst).unwrap()),
        );
        let mut seg = Segment::create("ringzero-bench", bytes).unwrap();
        seg.bytes_mut().fill(1);
        let (fd, ino) = seg.locator().unwrap();
        let peer = PeerSegment::open(pid, fd, ino, bytes).unwrap();
        // Nothing writes it while the bench reads.
        let mapped = &peer.bytes()[..bytes];
        g.bench_with_input(BenchmarkId::new("mapped memcpy", bytes), &bytes, |b, _| {
            b.iter(|| dst.copy_from_slice(std::hint::black_box(mapped)))
        });
        g.bench_with_input(BenchmarkId::new("memcpy", bytes), &bytes, |b, _| {
            b.iter(|| dst.copy_from_slice(std::hint::black_box(&src)))
        });
    }
    g.finish();
}

criterion_group!(benches, peer_read);
criterion_main!(benches);
