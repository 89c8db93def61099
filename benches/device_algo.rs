//! Device all-reduce by the slot ring against the direct step (`RINGZERO_DEVICE_ALGO`), two ranks
//! as threads of this process on the host stream — the one setting where host-stream ranks can
//! map each other's buffers. Like ranks sharing one GPU, the two ranks share one memory, which is
//! what the direct step is for; the GPU figures come from `scripts/gpu-check.sh`.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ringzero::{Collectives, Communicator, Config, DeviceAlgo, DeviceComm, HostStream, ReduceOp};

/// Rank 1 on its own thread, running `k` all-reduces per command; rank 0 returned to the caller.
fn pair(
    algo: DeviceAlgo,
    elems: usize,
) -> (
    Communicator,
    DeviceComm<HostStream>,
    mpsc::Sender<u64>,
    mpsc::Receiver<()>,
    std::thread::JoinHandle<()>,
) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let cfg = |rank| {
        let mut c = Config::new(rank, 2, "127.0.0.1", port);
        c.device_algo = algo;
        c
    };
    let (go, orders) = mpsc::channel::<u64>();
    let (finished, done) = mpsc::channel::<()>();
    let c1 = cfg(1);
    let peer = std::thread::spawn(move || {
        let comm = Communicator::init(c1).unwrap();
        let dc = DeviceComm::new(&comm, HostStream::new()).unwrap();
        let send = vec![1.0f32; elems];
        let mut recv = vec![0.0f32; elems];
        finished.send(()).unwrap();
        for k in orders {
            for _ in 0..k {
                dc.all_reduce(&send[..], &mut recv[..], ReduceOp::Sum)
                    .unwrap();
            }
            finished.send(()).unwrap();
        }
    });
    let comm = Communicator::init(cfg(0)).unwrap();
    let dc = DeviceComm::new(&comm, HostStream::new()).unwrap();
    done.recv().unwrap();
    (comm, dc, go, done, peer)
}

fn algos(c: &mut Criterion) {
    let mut g = c.benchmark_group("device_all_reduce_2_threads");
    g.measurement_time(Duration::from_secs(4));
    g.sample_size(10);
    for mib in [1usize, 16] {
        let elems = (mib << 20) / 4;
        g.throughput(Throughput::Bytes((mib << 20) as u64));
        for algo in [DeviceAlgo::Ring, DeviceAlgo::Direct] {
            let (comm, dc, go, done, peer) = pair(algo, elems);
            assert_eq!(dc.direct().is_some(), algo == DeviceAlgo::Direct);
            let send = vec![1.0f32; elems];
            let mut recv = vec![0.0f32; elems];
            g.bench_with_input(BenchmarkId::new(algo.to_string(), mib), &mib, |b, _| {
                b.iter_custom(|k| {
                    go.send(k).unwrap();
                    let t = Instant::now();
                    for _ in 0..k {
                        dc.all_reduce(&send[..], &mut recv[..], ReduceOp::Sum)
                            .unwrap();
                    }
                    done.recv().unwrap();
                    t.elapsed()
                })
            });
            assert!(recv.iter().all(|&v| v == 2.0));
            drop(go);
            peer.join().unwrap();
            drop(dc);
            drop(comm);
        }
    }
    g.finish();
}

criterion_group!(benches, algos);
criterion_main!(benches);
