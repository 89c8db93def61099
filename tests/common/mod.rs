//! Helpers shared by the integration tests: ranks as threads, inputs that reduce exactly, and a
//! serial reference computed independently of the library (in f64 / i128).

#![allow(dead_code)]

mod queued;
mod scratch;
pub use queued::Queued;
pub use scratch::{fresh_dir, Scratch};

use std::time::Duration;

use ringzero::{
    chunk, Algo, Collective, Collectives, Communicator, Config, DType, DeviceAlgo, DeviceComm,
    Element, HostStream, InPlace, Input, ReduceOp, Result, StagingMode, TransportPref,
};

/// A port for one test's rendezvous store, free now. Taken from a counter below Linux's
/// ephemeral range (32768 and up) rather than from the kernel's pick: a port the kernel hands
/// out and this test lets go of can be handed to another test's outgoing connection before the
/// store binds it ("Address already in use"), while ports below the range are only ever bound
/// here, each once per process. A port something listens on (another process's) is skipped: a
/// connection to it is accepted. The probe connects rather than binds: a listener of the probe's
/// own could be inherited by a child another test forks at that moment (`mount`, a launched
/// rank) and outlive the probe until the child's exec closes it, refusing the store's bind.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    // Each test process starts at its own place in 20000..32000.
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let _ = NEXT.compare_exchange(
        u32::MAX,
        std::process::id() % 6000 * 2,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    loop {
        let p = 20000 + (NEXT.fetch_add(1, Ordering::Relaxed) % 12000) as u16;
        let at = std::net::SocketAddr::from(([127, 0, 0, 1], p));
        let timeout = std::time::Duration::from_millis(200);
        if std::net::TcpStream::connect_timeout(&at, timeout).is_err() {
            return p;
        }
    }
}

/// Per-test knobs.
#[derive(Clone, Debug)]
pub struct Opts {
    pub transport: TransportPref,
    pub slice_bytes: usize,
    pub timeout: Duration,
    pub secret: &'static str,
    /// `Config::stream_stores_from` (None: the default).
    pub stream_stores_from: Option<usize>,
    /// `Config::staging`.
    pub staging: StagingMode,
    /// `Config::dump_dir`: where flight records go.
    pub dump_dir: Option<std::path::PathBuf>,
    /// `Config::tcp_sockets`: connections per tcp ring edge.
    pub tcp_sockets: usize,
    /// `Config::algo` (None: the default).
    pub algo: Option<Algo>,
    /// `Config::device_slice_bytes` (None: the stream's choice, else `slice_bytes`).
    pub device_slice_bytes: Option<usize>,
    /// `Config::device_algo`.
    pub device_algo: DeviceAlgo,
    /// `Config::device_copy_pairs`.
    pub device_copy_pairs: bool,
    /// Fake nodes the ranks are spread over in rank order (`Config::node_id`; 1: the host's
    /// own). Ranks on different nodes talk over tcp with `TransportPref::Auto`.
    pub nodes: usize,
    /// `Config::single_copy_from`, with no upper bound (None: the defaults).
    pub single_copy_from: Option<usize>,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            transport: TransportPref::Shm,
            slice_bytes: 4096,
            timeout: Duration::from_secs(20),
            secret: "test-secret",
            stream_stores_from: None,
            staging: StagingMode::Mapped,
            dump_dir: None,
            tcp_sockets: 1,
            algo: None,
            device_slice_bytes: None,
            device_algo: DeviceAlgo::Auto,
            device_copy_pairs: true,
            nodes: 1,
            single_copy_from: None,
        }
    }
}

pub fn config(rank: usize, n: usize, port: u16, o: &Opts) -> Config {
    let mut c = Config::new(rank, n, "127.0.0.1", port);
    c.transport = o.transport;
    c.slice_bytes = o.slice_bytes;
    c.device_slice_bytes = o.device_slice_bytes;
    c.timeout = o.timeout;
    c.secret = o.secret.as_bytes().to_vec();
    c.staging = o.staging;
    c.dump_dir = o.dump_dir.clone();
    c.tcp_sockets = o.tcp_sockets;
    c.device_algo = o.device_algo;
    c.device_copy_pairs = o.device_copy_pairs;
    if let Some(b) = o.stream_stores_from {
        c.stream_stores_from = b;
    }
    if let Some(a) = o.algo {
        c.algo = a;
    }
    if let Some(b) = o.single_copy_from {
        // Every size from there on.
        c.single_copy_from = b;
        c.single_copy_below = usize::MAX;
    }
    if o.nodes > 1 {
        c.node_id = format!("test-node-{}", rank * o.nodes / n);
    }
    c
}

/// Run `n` ranks as threads; each gets its rank and the result of `Communicator::init`.
pub fn threads<R: Send>(
    n: usize,
    o: &Opts,
    body: impl Fn(usize, Result<Communicator>) -> R + Sync,
) -> Vec<R> {
    let port = free_port();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let body = &body;
                let cfg = config(rank, n, port, o);
                s.spawn(move || body(rank, Communicator::init(cfg)))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

/// Every element type converts to and from f64 (`Element::from_f64`/`to_f64`).
pub use ringzero::Element as TestElem;

use half::{bf16, f16};
pub use ringzero_tools::bench::exact::{reference, value};

/// Marker written into buffers whose contents must be overwritten (or must stay).
pub const GARBAGE: f64 = 99.0;

/// One collective call to make on every rank.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub coll: Collective,
    pub count: usize,
    pub dtype: DType,
    pub op: ReduceOp,
    pub in_place: bool,
    pub seed: usize,
}

/// The collectives on host slices that both communicators offer — the host [`Communicator`] and
/// [`DeviceComm`] on the host stream — so one driver checks both against one reference.
pub trait Colls {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    fn all_reduce<'a, T: Element>(
        &mut self,
        s: impl Into<Input<'a, [T]>>,
        r: &mut [T],
        op: ReduceOp,
    ) -> Result<()>;
    fn reduce_scatter<'a, T: Element>(
        &mut self,
        s: impl Into<Input<'a, [T]>>,
        r: &mut [T],
        op: ReduceOp,
    ) -> Result<()>;
    fn reduce_scatter_v<'a, T: Element>(
        &mut self,
        s: impl Into<Input<'a, [T]>>,
        r: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()>;
    fn all_gather<'a, T: Element>(
        &mut self,
        s: impl Into<Input<'a, [T]>>,
        r: &mut [T],
    ) -> Result<()>;
    fn broadcast<'a, T: Element>(
        &mut self,
        s: impl Into<Input<'a, [T]>>,
        r: &mut [T],
        root: usize,
    ) -> Result<()>;
    fn reduce<'a, T: Element>(
        &mut self,
        s: impl Into<Input<'a, [T]>>,
        r: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()>;
    fn ring_shift<'a, T: Element>(
        &mut self,
        s: impl Into<Input<'a, [T]>>,
        r: &mut [T],
    ) -> Result<()>;
    fn barrier(&mut self) -> Result<()>;
    fn all_to_all<'a, T: Element>(
        &mut self,
        s: impl Into<Input<'a, [T]>>,
        r: &mut [T],
    ) -> Result<()>;
    /// Host communicators only, as all-to-all.
    fn send_recv<T: Element>(&mut self, _s: &[T], _r: &mut [T], _peer: usize) -> Result<()> {
        Err(ringzero::Error::InvalidArgument {
            op: "send_recv".into(),
            msg: "this communicator has no send/recv (host communicators only)".into(),
        })
    }
    /// The host communicator, for the collectives only it has (the pairwise ones).
    fn host(&self) -> Result<&Communicator> {
        Err(ringzero::Error::InvalidArgument {
            op: "pairwise collectives".into(),
            msg: "host communicators only".into(),
        })
    }
    /// The pairwise collectives: the host communicator's (through [`Colls::host`]) unless a
    /// driver runs them another way.
    fn all_to_all_v<T: Element>(
        &mut self,
        s: &[T],
        sc: &[usize],
        r: &mut [T],
        rc: &[usize],
    ) -> Result<()> {
        self.host()?.all_to_all_v(s, sc, r, rc)
    }
    fn all_gather_v<'a, T: Element>(
        &mut self,
        s: impl Into<Input<'a, [T]>>,
        r: &mut [T],
        counts: &[usize],
    ) -> Result<()> {
        self.host()?.all_gather_v(s, r, counts)
    }
    fn gather<T: Element>(&mut self, s: &[T], r: &mut [T], root: usize) -> Result<()> {
        self.host()?.gather(s, r, root)
    }
    fn scatter<T: Element>(&mut self, s: &[T], r: &mut [T], root: usize) -> Result<()> {
        self.host()?.scatter(s, r, root)
    }
}

/// Elements rank `from` sends rank `to` in the all-to-all-v cases: 0, ⅓, ⅔ or all of `count`.
pub fn pair_count(count: usize, from: usize, to: usize) -> usize {
    count * ((from + 2 * to) % 4) / 3
}

/// Rank `r`'s part in the all-gather-v cases: ⅓, ⅔, all or none of `count`.
pub fn part_count(count: usize, r: usize) -> usize {
    count * ((r + 1) % 4) / 3
}

/// Where rank `from`'s block for rank `to` starts in its all-to-all-v send buffer.
fn pair_offset(count: usize, from: usize, to: usize) -> usize {
    (0..to).map(|j| pair_count(count, from, j)).sum()
}

/// Forward every [`Colls`] method to the inherent method of the same name on `$ty` (by path, so
/// the trait method never calls itself).
macro_rules! forward_colls {
    ($impl_for:ty, $ty:ty $(; $($extra:tt)*)?) => {
        impl Colls for $impl_for {
            $($($extra)*)?
            fn rank(&self) -> usize {
                <$ty>::rank(self)
            }
            fn size(&self) -> usize {
                <$ty>::size(self)
            }
            fn all_reduce<'a, T: Element>(&mut self, s: impl Into<Input<'a, [T]>>, r: &mut [T], op: ReduceOp) -> Result<()> {
                <$ty as Collectives<[T]>>::all_reduce(self, s, r, op)
            }
            fn reduce_scatter<'a, T: Element>(&mut self, s: impl Into<Input<'a, [T]>>,
                r: &mut [T],
                op: ReduceOp,
            ) -> Result<()> {
                <$ty as Collectives<[T]>>::reduce_scatter(self, s, r, op)
            }
            fn reduce_scatter_v<'a, T: Element>(&mut self, s: impl Into<Input<'a, [T]>>,
                r: &mut [T],
                counts: &[usize],
                op: ReduceOp,
            ) -> Result<()> {
                <$ty as Collectives<[T]>>::reduce_scatter_v(self, s, r, counts, op)
            }
            fn all_gather<'a, T: Element>(&mut self, s: impl Into<Input<'a, [T]>>, r: &mut [T]) -> Result<()> {
                <$ty as Collectives<[T]>>::all_gather(self, s, r)
            }
            fn broadcast<'a, T: Element>(&mut self, s: impl Into<Input<'a, [T]>>, r: &mut [T], root: usize) -> Result<()> {
                <$ty as Collectives<[T]>>::broadcast(self, s, r, root)
            }
            fn reduce<'a, T: Element>(&mut self, s: impl Into<Input<'a, [T]>>,
                r: &mut [T],
                op: ReduceOp,
                root: usize,
            ) -> Result<()> {
                <$ty as Collectives<[T]>>::reduce(self, s, r, op, root)
            }
            fn ring_shift<'a, T: Element>(&mut self, s: impl Into<Input<'a, [T]>>, r: &mut [T]) -> Result<()> {
                <$ty as Collectives<[T]>>::ring_shift(self, s, r)
            }
            fn barrier(&mut self) -> Result<()> {
                <$ty>::barrier(self)
            }
            fn all_to_all<'a, T: Element>(&mut self, s: impl Into<Input<'a, [T]>>, r: &mut [T]) -> Result<()> {
                <$ty as Collectives<[T]>>::all_to_all(self, s, r)
            }
        }
    };
}

forward_colls!(&Communicator, Communicator;
    fn send_recv<T: Element>(&mut self, s: &[T], r: &mut [T], peer: usize) -> Result<()> {
        <Communicator as Collectives<[T]>>::send_recv(self, s, r, peer)
    }
    fn host(&self) -> Result<&Communicator> {
        Ok(self)
    }
);
forward_colls!(DeviceComm<HostStream>, DeviceComm<HostStream>;
    fn gather<T: Element>(&mut self, s: &[T], r: &mut [T], root: usize) -> Result<()> {
        <DeviceComm<HostStream> as Collectives<[T]>>::gather(self, s, r, root)
    }
    fn scatter<T: Element>(&mut self, s: &[T], r: &mut [T], root: usize) -> Result<()> {
        <DeviceComm<HostStream> as Collectives<[T]>>::scatter(self, s, r, root)
    }
    fn all_to_all_v<T: Element>(
        &mut self,
        s: &[T],
        sc: &[usize],
        r: &mut [T],
        rc: &[usize],
    ) -> Result<()> {
        <DeviceComm<HostStream> as Collectives<[T]>>::all_to_all_v(self, s, sc, r, rc)
    }
    fn all_gather_v<'a, T: Element>(&mut self, s: impl Into<Input<'a, [T]>>, r: &mut [T], counts: &[usize]) -> Result<()> {
        <DeviceComm<HostStream> as Collectives<[T]>>::all_gather_v(self, s, r, counts)
    }
);

/// Run `case` on `comm` with the right element type; returns what this rank ends with.
pub fn run_case<C: Colls>(comm: &mut C, c: &Case) -> Result<Vec<f64>> {
    match c.dtype {
        DType::F32 => run_typed::<f32, C>(comm, c),
        DType::F64 => run_typed::<f64, C>(comm, c),
        DType::F16 => run_typed::<f16, C>(comm, c),
        DType::BF16 => run_typed::<bf16, C>(comm, c),
        DType::I32 => run_typed::<i32, C>(comm, c),
        DType::I64 => run_typed::<i64, C>(comm, c),
        DType::U8 => run_typed::<u8, C>(comm, c),
    }
}

fn run_typed<T: TestElem, C: Colls>(comm: &mut C, c: &Case) -> Result<Vec<f64>> {
    let (r, n) = (comm.rank(), comm.size());
    let count = round_count(c.coll, n, c.count);
    let mine = |i: usize| T::from_f64(value(c.dtype, c.op, r, i, c.seed));
    let input: Vec<T> = (0..count).map(mine).collect();
    let garbage = |len: usize| vec![T::from_f64(GARBAGE); len];
    let own = chunk(count, n, r);
    let out: Vec<T> = match (c.coll, c.in_place) {
        (Collective::AllReduce, false) => {
            let mut out = garbage(count);
            comm.all_reduce(&input, &mut out, c.op)?;
            out
        }
        (Collective::AllReduce, true) => {
            let mut b = input;
            comm.all_reduce(InPlace, &mut b, c.op)?;
            b
        }
        (Collective::ReduceScatter, false) => {
            let mut out = garbage(own.len());
            comm.reduce_scatter(&input, &mut out, c.op)?;
            out
        }
        (Collective::ReduceScatter, true) => {
            let mut b = input;
            comm.reduce_scatter(InPlace, &mut b, c.op)?;
            b
        }
        // Parts of ⅓, ⅔, all or none of `count` (the all-gather-v cases' parts).
        (Collective::ReduceScatterV, in_place) => {
            let counts: Vec<usize> = (0..n).map(|q| part_count(count, q)).collect();
            let input: Vec<T> = (0..counts.iter().sum()).map(mine).collect();
            if in_place {
                let mut b = input;
                comm.reduce_scatter_v(InPlace, &mut b, &counts, c.op)?;
                b
            } else {
                let mut out = garbage(counts[r]);
                comm.reduce_scatter_v(&input, &mut out, &counts, c.op)?;
                out
            }
        }
        (Collective::AllGather, false) => {
            let mut out = garbage(count);
            comm.all_gather(&input[own], &mut out)?;
            out
        }
        (Collective::AllGather, true) => {
            let mut b = garbage(count);
            b[own.clone()].copy_from_slice(&input[own]);
            comm.all_gather(InPlace, &mut b)?;
            b
        }
        (Collective::Broadcast { root }, false) => {
            let send = if r == root { input } else { Vec::new() };
            let mut out = garbage(count);
            comm.broadcast(&send, &mut out, root)?;
            out
        }
        (Collective::Broadcast { root }, true) => {
            let mut b = if r == root { input } else { garbage(count) };
            comm.broadcast(InPlace, &mut b, root)?;
            b
        }
        (Collective::Reduce { root }, false) => {
            let mut out = if r == root {
                garbage(count)
            } else {
                Vec::new()
            };
            comm.reduce(&input, &mut out, c.op, root)?;
            out
        }
        (Collective::Reduce { root }, true) => {
            let mut b = input;
            comm.reduce(InPlace, &mut b, c.op, root)?;
            b
        }
        (Collective::Barrier, _) => {
            comm.barrier()?;
            Vec::new()
        }
        (Collective::RingShift, false) => {
            let mut out = garbage(count);
            comm.ring_shift(&input, &mut out)?;
            out
        }
        (Collective::RingShift, true) => {
            let mut b = input;
            comm.ring_shift(InPlace, &mut b)?;
            b
        }
        (Collective::AllToAll, false) => {
            let mut out = garbage(count);
            comm.all_to_all(&input, &mut out)?;
            out
        }
        (Collective::AllToAll, true) => {
            let mut b = input;
            comm.all_to_all(InPlace, &mut b)?;
            b
        }
        // Ranks pair up 0↔1, 2↔3, ...; an odd world's last rank sits out. "In place" receives
        // into the buffer it sent from (a copy of it).
        (Collective::SendRecv, in_place) => match Some(r ^ 1).filter(|&p| p < n) {
            None => Vec::new(),
            Some(peer) if in_place => {
                let mut b = input.clone();
                comm.send_recv(&input, &mut b, peer)?;
                b
            }
            Some(peer) => {
                let mut out = garbage(count);
                comm.send_recv(&input, &mut out, peer)?;
                out
            }
        },
        // All-to-all-v, gather and scatter have no in-place form: `in_place` runs them the same.
        (Collective::AllToAllV, _) => {
            let sends: Vec<usize> = (0..n).map(|j| pair_count(count, r, j)).collect();
            let recvs: Vec<usize> = (0..n).map(|q| pair_count(count, q, r)).collect();
            let send: Vec<T> = (0..sends.iter().sum()).map(mine).collect();
            let mut out = garbage(recvs.iter().sum());
            comm.all_to_all_v(&send, &sends, &mut out, &recvs)?;
            out
        }
        (Collective::AllGatherV, in_place) => {
            let counts: Vec<usize> = (0..n).map(|q| part_count(count, q)).collect();
            let send: Vec<T> = (0..counts[r]).map(mine).collect();
            let mut out = garbage(counts.iter().sum());
            if in_place {
                let at: usize = counts[..r].iter().sum();
                out[at..at + counts[r]].copy_from_slice(&send);
                comm.all_gather_v(InPlace, &mut out, &counts)?;
            } else {
                comm.all_gather_v(&send, &mut out, &counts)?;
            }
            out
        }
        (Collective::Gather { root }, _) => {
            let mut out = garbage(if r == root { n * count } else { 0 });
            comm.gather(&input, &mut out, root)?;
            out
        }
        (Collective::Scatter { root }, _) => {
            let send: Vec<T> = if r == root {
                (0..n * count).map(mine).collect()
            } else {
                Vec::new()
            };
            let mut out = garbage(count);
            comm.scatter(&send, &mut out, root)?;
            out
        }
    };
    Ok(out.into_iter().map(T::to_f64).collect())
}

/// What rank `r` of `n` must end with after `case`.
pub fn expected(c: &Case, n: usize, r: usize) -> Vec<f64> {
    let count = round_count(c.coll, n, c.count);
    let red = |i| reference(c.dtype, c.op, n, i, c.seed);
    let input = |rank, i| value(c.dtype, c.op, rank, i, c.seed);
    let own = chunk(count, n, r);
    match (c.coll, c.in_place) {
        (Collective::AllReduce, _) => (0..count).map(red).collect(),
        (Collective::ReduceScatter, false) => own.map(red).collect(),
        (Collective::ReduceScatter, true) => (0..count)
            .map(|i| {
                if own.contains(&i) {
                    red(i)
                } else {
                    input(r, i)
                }
            })
            .collect(),
        (Collective::ReduceScatterV, in_place) => {
            let at = |q: usize| (0..q).map(|p| part_count(count, p)).sum::<usize>();
            let (own, total) = (at(r)..at(r + 1), at(n));
            if in_place {
                (0..total)
                    .map(|i| {
                        if own.contains(&i) {
                            red(i)
                        } else {
                            input(r, i)
                        }
                    })
                    .collect()
            } else {
                own.map(red).collect()
            }
        }
        (Collective::AllGather, _) => (0..count)
            .map(|i| {
                input(
                    (0..n).find(|q| chunk(count, n, *q).contains(&i)).unwrap(),
                    i,
                )
            })
            .collect(),
        (Collective::Broadcast { root }, _) => (0..count).map(|i| input(root, i)).collect(),
        (Collective::Reduce { root }, false) => {
            if r == root {
                (0..count).map(red).collect()
            } else {
                Vec::new()
            }
        }
        (Collective::Reduce { root }, true) => (0..count)
            .map(|i| if r == root { red(i) } else { input(r, i) })
            .collect(),
        (Collective::Barrier, _) => Vec::new(),
        (Collective::RingShift, _) => (0..count).map(|i| input((r + n - 1) % n, i)).collect(),
        // Written independently of the bench's `landing`: element j of block q comes from rank
        // q's block r.
        (Collective::AllToAll, _) => {
            let b = count / n;
            (0..n)
                .flat_map(|q| (0..b).map(move |j| (q, r * b + j)))
                .map(|(q, i)| input(q, i))
                .collect()
        }
        (Collective::SendRecv, _) if r ^ 1 < n => (0..count).map(|i| input(r ^ 1, i)).collect(),
        (Collective::SendRecv, _) => Vec::new(),
        // Rank q's block for this rank, for every q in order.
        (Collective::AllToAllV, _) => (0..n)
            .flat_map(|q| {
                let at = pair_offset(count, q, r);
                (at..at + pair_count(count, q, r)).map(move |i| input(q, i))
            })
            .collect(),
        (Collective::AllGatherV, _) => (0..n)
            .flat_map(|q| (0..part_count(count, q)).map(move |i| input(q, i)))
            .collect(),
        (Collective::Gather { root }, _) if r == root => (0..n)
            .flat_map(|q| (0..count).map(move |i| input(q, i)))
            .collect(),
        (Collective::Gather { .. }, _) => Vec::new(),
        (Collective::Scatter { root }, _) => (r * count..(r + 1) * count)
            .map(|i| input(root, i))
            .collect(),
    }
}

/// Run `case` on every rank of `comm` and compare with the reference; panics with the first
/// difference.
pub fn check_case(comm: &Communicator, c: &Case) {
    check_with(&mut { comm }, c)
}

/// [`check_case`] on either communicator.
pub fn check_with<C: Colls>(comm: &mut C, c: &Case) {
    let got = run_case(comm, c).unwrap_or_else(|e| panic!("rank {}: {c:?}: {e}", comm.rank()));
    let want = expected(c, comm.size(), comm.rank());
    assert_eq!(got.len(), want.len(), "rank {}: {c:?} length", comm.rank());
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "rank {} of {}: {c:?}: element {i} is {} but should be {}",
            comm.rank(),
            comm.size(),
            got[i],
            want[i]
        );
    }
}

/// The element count `coll` runs on for a case of `count`: all-to-all needs a multiple of `n`.
pub fn round_count(coll: Collective, n: usize, count: usize) -> usize {
    match coll {
        Collective::AllToAll => count - count % n,
        _ => count,
    }
}

/// [`all_collectives`] and send/recv, which the shared driver runs on host communicators only
/// (device point-to-point has tests of its own).
pub fn host_collectives(root: usize) -> [Collective; 14] {
    let a = all_collectives(root);
    let host = [Collective::SendRecv];
    std::array::from_fn(|i| a.get(i).copied().unwrap_or_else(|| host[i - a.len()]))
}

/// The collectives both communicators run: on device buffers, every one they have.
pub fn all_collectives(root: usize) -> [Collective; 13] {
    [
        Collective::AllReduce,
        Collective::ReduceScatter,
        Collective::ReduceScatterV,
        Collective::AllGather,
        Collective::Broadcast { root },
        Collective::Reduce { root },
        Collective::Barrier,
        Collective::RingShift,
        Collective::AllToAll,
        Collective::AllGatherV,
        Collective::AllToAllV,
        Collective::Gather { root },
        Collective::Scatter { root },
    ]
}

/// A deterministic draw in `0..k` per call, from an LCG seeded by `seed` and `rank`.
pub fn drawer(seed: u64, rank: usize) -> impl FnMut(usize) -> usize {
    let mut rng = seed * 1_000_003 + rank as u64 * 7919;
    move |k: usize| {
        rng = rng
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((rng >> 33) as usize) % k
    }
}

/// The posted calls of the drawn-interleaving tests, for rank `r` of `n`: three messages to and
/// three from every other rank, as (peer, a send, message index), each peer's sends in order and
/// its receives in order but the peers and directions shuffled together by `draw`, in batches of
/// one to three.
pub fn drawn_posts(
    n: usize,
    r: usize,
    draw: &mut impl FnMut(usize) -> usize,
) -> Vec<Vec<(usize, bool, usize)>> {
    // What is left to post: (peer, is a send, next message index).
    let mut left: Vec<(usize, bool, usize)> = (0..n)
        .filter(|&q| q != r)
        .flat_map(|q| [(q, true, 0), (q, false, 0)])
        .collect();
    let mut batches = Vec::new();
    while !left.is_empty() {
        let mut batch = Vec::new();
        for _ in 0..1 + draw(3) {
            if left.is_empty() {
                break;
            }
            let i = draw(left.len());
            batch.push(left[i]);
            if left[i].2 == 2 {
                left.swap_remove(i);
            } else {
                left[i].2 += 1;
            }
        }
        batches.push(batch);
    }
    batches
}
