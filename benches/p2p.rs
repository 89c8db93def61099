//! A two-rank exchange (each rank sends the other `S` bytes and receives as many) over shm, as
//! thread ranks of this process: blocking `send_recv` against the posted pair `send_async` +
//! `recv_async` (each its own call, moving at once: `comm/posted.rs`). The same bytes move; the
//! difference is what posting costs (the worker thread, a session per exchange).

use std::sync::mpsc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ringzero::{Communicator, Config, TransportPref};

/// How an exchange is made.
#[derive(Clone, Copy, Debug)]
enum Form {
    Blocking,
    Posted,
}

/// One exchange of `send` for `recv` with `peer` in `form`; the buffers come back.
fn exchange(
    comm: &Communicator,
    form: Form,
    (send, mut recv): (Vec<f32>, Vec<f32>),
    peer: usize,
) -> (Vec<f32>, Vec<f32>) {
    match form {
        Form::Blocking => {
            comm.send_recv(&send, &mut recv, peer).unwrap();
            (send, recv)
        }
        Form::Posted => {
            let s = comm.send_async(send, peer);
            let r = comm.recv_async(recv, peer);
            (s.wait().unwrap(), r.wait().unwrap())
        }
    }
}

fn forms(c: &mut Criterion) {
    let mut g = c.benchmark_group("exchange_2_threads_shm");
    g.measurement_time(Duration::from_secs(3));
    g.sample_size(10);
    for bytes in [4usize << 10, 1 << 20, 16 << 20] {
        let elems = bytes / 4;
        g.throughput(Throughput::Bytes(2 * bytes as u64));
        for form in [Form::Blocking, Form::Posted] {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let cfg = |rank| {
                let mut c = Config::new(rank, 2, "127.0.0.1", port);
                c.transport = TransportPref::Shm;
                c
            };
            let (go, orders) = mpsc::channel::<u64>();
            let c1 = cfg(1);
            let peer = std::thread::spawn(move || {
                let comm = Communicator::init(c1).unwrap();
                let mut bufs = (vec![1.0f32; elems], vec![0.0f32; elems]);
                for k in orders {
                    for _ in 0..k {
                        bufs = exchange(&comm, form, bufs, 0);
                    }
                }
            });
            let comm = Communicator::init(cfg(0)).unwrap();
            let mut bufs = (vec![2.0f32; elems], vec![0.0f32; elems]);
            let label = format!("{form:?}").to_lowercase();
            g.bench_with_input(BenchmarkId::new(label, bytes), &bytes, |b, _| {
                b.iter_custom(|k| {
                    go.send(k).unwrap();
                    let t = Instant::now();
                    for _ in 0..k {
                        bufs = exchange(&comm, form, std::mem::take(&mut bufs), 1);
                    }
                    t.elapsed()
                })
            });
            assert!(bufs.1.iter().all(|&v| v == 1.0));
            drop(go);
            peer.join().unwrap();
        }
    }
    g.finish();
}

criterion_group!(benches, forms);
criterion_main!(benches);
