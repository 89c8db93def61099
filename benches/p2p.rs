//! A two-rank exchange (each rank sends the other `S` bytes and receives as many) over shm, as
//! thread ranks of this process: blocking `send_recv` against the posted pair `send_async` +
//! `recv_async` (each its own call, moving at once: `comm/posted.rs`), on host buffers and on
//! device buffers of the host stream (`DeviceComm<HostStream>`: the device engine, its pairs'
//! staging links and `device/posted.rs`). The same bytes move; the difference is what posting
//! costs (the worker or proxy thread, a session per exchange).

use std::sync::mpsc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ringzero::{
    Collectives, Communicator, Config, DeviceComm, HostStream, NonBlocking, TransportPref,
};

/// How an exchange is made.
#[derive(Clone, Copy, Debug)]
enum Form {
    Blocking,
    Posted,
    DeviceBlocking,
    DevicePosted,
}

/// One rank: its communicator, and the device one on it for the device forms.
struct Rank {
    comm: Communicator,
    dev: Option<DeviceComm<HostStream>>,
}

impl Rank {
    fn new(cfg: Config, form: Form) -> Rank {
        let comm = Communicator::init(cfg).unwrap();
        let dev = matches!(form, Form::DeviceBlocking | Form::DevicePosted)
            .then(|| DeviceComm::new(&comm, HostStream::new()).unwrap());
        Rank { comm, dev }
    }

    /// One exchange of `send` for `recv` with `peer` in `form`; the buffers come back.
    fn exchange(
        &mut self,
        form: Form,
        (send, mut recv): (Vec<f32>, Vec<f32>),
        peer: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let (comm, dev) = (&self.comm, self.dev.as_mut());
        match (form, dev) {
            (Form::Blocking, _) => comm.send_recv(&send, &mut recv, peer).unwrap(),
            (Form::Posted, _) => {
                let s = comm.send_async(send, peer);
                let r = comm.recv_async(recv, peer);
                return (s.wait().unwrap(), r.wait().unwrap());
            }
            (Form::DeviceBlocking, Some(dc)) => {
                dc.send_recv(&send[..], &mut recv[..], peer).unwrap()
            }
            (Form::DevicePosted, Some(dc)) => {
                let s = dc.send_async(send, peer);
                let r = dc.recv_async(recv, peer);
                return (s.wait().unwrap(), r.wait().unwrap());
            }
            (_, None) => unreachable!("device forms make a device communicator"),
        }
        (send, recv)
    }
}

fn forms(c: &mut Criterion) {
    let mut g = c.benchmark_group("exchange_2_threads_shm");
    g.measurement_time(Duration::from_secs(3));
    g.sample_size(10);
    for bytes in [4usize << 10, 1 << 20, 16 << 20] {
        let elems = bytes / 4;
        g.throughput(Throughput::Bytes(2 * bytes as u64));
        for form in [
            Form::Blocking,
            Form::Posted,
            Form::DeviceBlocking,
            Form::DevicePosted,
        ] {
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
                let mut me = Rank::new(c1, form);
                let mut bufs = (vec![1.0f32; elems], vec![0.0f32; elems]);
                for k in orders {
                    for _ in 0..k {
                        bufs = me.exchange(form, bufs, 0);
                    }
                }
            });
            let mut me = Rank::new(cfg(0), form);
            let mut bufs = (vec![2.0f32; elems], vec![0.0f32; elems]);
            let label = format!("{form:?}").to_lowercase();
            let mut ran = false;
            g.bench_with_input(BenchmarkId::new(label, bytes), &bytes, |b, _| {
                b.iter_custom(|k| {
                    ran = true;
                    go.send(k).unwrap();
                    let t = Instant::now();
                    for _ in 0..k {
                        bufs = me.exchange(form, std::mem::take(&mut bufs), 1);
                    }
                    t.elapsed()
                })
            });
            // A filter (`cargo bench --bench p2p -- device`) may skip a form: nothing moved.
            assert!(!ran || bufs.1.iter().all(|&v| v == 1.0));
            drop(go);
            peer.join().unwrap();
        }
    }
    g.finish();
}

criterion_group!(benches, forms);
criterion_main!(benches);
