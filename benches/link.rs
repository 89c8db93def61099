//! One link, one direction: slices of a given size copied into the shm and tcp transports by one
//! thread and copied out by another (criterion), as the engine does per slice. What the ring's β is
//! made of, without the ring.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ringzero::{Collective, DType};
use ringzero_collectives::internals::bootstrap::Identity;
use ringzero_collectives::internals::transport::shm::{ShmRecv, ShmSend};
use ringzero_collectives::internals::transport::tcp::{self, TcpRecv, TcpSend};
use ringzero_collectives::internals::transport::{RecvLink, SendLink};
use ringzero_collectives::internals::wire::{Expect, Fingerprint, FrameHeader};

const SLOTS: usize = 4;

fn fp() -> Fingerprint {
    Fingerprint::new(Collective::RingShift, Some(DType::U8), None, 0)
}

/// Send `frames` frames of `len` bytes from `tx` (on its own thread) to `rx`; time until the last
/// one is received.
fn stream(
    mut tx: Box<dyn SendLink>,
    mut rx: Box<dyn RecvLink>,
    len: usize,
    frames: u64,
) -> (Duration, Box<dyn SendLink>, Box<dyn RecvLink>) {
    let t = Instant::now();
    let sender = std::thread::spawn(move || {
        let src = vec![7u8; len];
        for k in 0..frames {
            loop {
                tx.progress().unwrap();
                if let Some(slot) = tx.reserve(len).unwrap() {
                    slot.copy_from_slice(&src);
                    break;
                }
                std::hint::spin_loop();
            }
            tx.post(&FrameHeader::data(0, 0, k as u32, fp(), len))
                .unwrap();
        }
        while !tx.flushed() {
            tx.progress().unwrap();
        }
        tx
    });
    let mut dst = vec![0u8; len];
    for k in 0..frames {
        let e = Expect {
            seq: 0,
            step: 0,
            slice: k as u32,
            fp: fp(),
            len,
        };
        loop {
            if let Some(payload) = rx.peek(&e).unwrap() {
                dst.copy_from_slice(payload);
                break;
            }
            std::hint::spin_loop();
        }
        rx.release().unwrap();
    }
    std::hint::black_box(&dst);
    let tx = sender.join().unwrap();
    (t.elapsed(), tx, rx)
}

fn shm_pair(len: usize) -> (Box<dyn SendLink>, Box<dyn RecvLink>) {
    let name = format!("ringzero-bench-{}-{len}", std::process::id());
    let rx = ShmRecv::create(&std::env::temp_dir(), &name, SLOTS, len, 0).unwrap();
    let tx = ShmSend::attach(rx.path(), SLOTS, len, 1).unwrap();
    (Box::new(tx), Box::new(rx))
}

/// A tcp link of `wires` connections, each frame striped over them.
fn tcp_link(len: usize, wires: usize) -> (Box<dyn SendLink>, Box<dyn RecvLink>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let me = Identity {
        secret: b"bench",
        job_id: "bench",
        rank: 1,
    };
    let t = std::thread::spawn(move || {
        let me = Identity {
            secret: b"bench",
            job_id: "bench",
            rank: 0,
        };
        tcp::connect_wires(addr, &me, 1, wires, Duration::from_secs(10)).unwrap()
    });
    let accepted = tcp::accept_wires(&l, &me, 0, wires, Duration::from_secs(10)).unwrap();
    let tx = TcpSend::over(t.join().unwrap(), 1, SLOTS, len).unwrap();
    let rx = TcpRecv::over(accepted, 0, 1, len).unwrap();
    (Box::new(tx), Box::new(rx))
}

fn tcp_pair(len: usize) -> (Box<dyn SendLink>, Box<dyn RecvLink>) {
    tcp_link(len, 1)
}

fn tcp_pair_x4(len: usize) -> (Box<dyn SendLink>, Box<dyn RecvLink>) {
    tcp_link(len, 4)
}

fn links(c: &mut Criterion) {
    let mut g = c.benchmark_group("link");
    g.measurement_time(Duration::from_secs(3));
    for len in [4 << 10, 512 << 10] {
        g.throughput(Throughput::Bytes(len as u64));
        for (name, make) in [
            ("shm", shm_pair as fn(usize) -> _),
            ("tcp", tcp_pair as fn(usize) -> _),
            ("tcp-x4", tcp_pair_x4 as fn(usize) -> _),
        ] {
            let mut pair = Some(make(len));
            g.bench_with_input(BenchmarkId::new(name, len), &len, |b, &len| {
                b.iter_custom(|frames| {
                    let (tx, rx) = pair.take().unwrap();
                    let (d, tx, rx) = stream(tx, rx, len, frames);
                    pair = Some((tx, rx));
                    d
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, links);
criterion_main!(benches);
