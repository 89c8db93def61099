//! The communicator: the public face of the library.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use ringzero_kernels::{DType, Element, ReduceOp};

use crate::bootstrap::peers::PeerListener;
use crate::bootstrap::{Identity, StoreServer};
use crate::config::{Algo, Config};
use crate::connect;
use crate::error::{Error, Result};
use crate::flight::{FlightRecord, Recorder};
use crate::ring::engine::{self, Bufs, Call, Counters, Links};
use crate::ring::failure;
use crate::ring::failure::AbortFlag;
use crate::ring::{chunk, plan, Collective, Count, PlanArgs};
use crate::topology::Edge;
use crate::wire::Fingerprint;
use crate::work::{Work, Worker};

mod doubling;
mod nonblocking;
pub(crate) mod pairs;
pub(crate) mod pairwise;
mod posted;
use pairs::Pair;
pub use pairs::{P2p, P2pOwned};

/// A group of ranks that run collectives together.
///
/// Create one per process (or per thread, for tests) with [`Communicator::from_env`] under a
/// launcher, or [`Communicator::init`] with an explicit [`Config`]. Every rank must call the same
/// collectives in the same order with matching arguments; a rank that does not gets an
/// [`Error::Mismatch`] naming both calls instead of a hang.
///
/// Collectives come in three forms: out of place (`all_reduce(&send, &mut recv, op)`), in place
/// (`all_reduce_in_place(&mut buf, op)`), and asynchronous on owned buffers
/// (`all_reduce_async(vec, op)` returns a [`Work`] to wait on; blocking calls made later wait for
/// earlier asynchronous ones, so the order across ranks stays the program order).
///
/// Any error aborts the communicator: both neighbours are told, every surviving rank fails within
/// the deadline, and every later call returns an [`Error::Aborted`] naming the first cause.
///
/// ```
/// use ringzero_collectives::{Communicator, ReduceOp};
/// # fn main() -> Result<(), ringzero_collectives::Error> {
/// # std::env::set_var("RINGZERO_RANK", "0");
/// # std::env::set_var("RINGZERO_WORLD_SIZE", "1");
/// // Under `ringzero launch -n 4 -- ./trainer`, torchrun, srun or mpirun:
/// let comm = Communicator::from_env()?;
/// let mut grads = vec![1.0f32; 1000];
/// comm.all_reduce_in_place(&mut grads, ReduceOp::Avg)?;
/// let mut mine = vec![0.0f32; comm.chunk_range(1000).len()];
/// comm.reduce_scatter(&grads, &mut mine, ReduceOp::Sum)?;
/// # Ok(()) }
/// ```
pub struct Communicator {
    inner: Arc<Inner>,
    worker: Worker<posted::Posted>,
}

struct Inner {
    cfg: Config,
    rank: usize,
    size: usize,
    edges: Vec<Edge>,
    /// The address this rank's data connections use (None for one rank).
    data_ip: Option<std::net::IpAddr>,
    state: Mutex<State>,
    /// Point-to-point links per peer, connected by the pair's first send or receive. Locked after
    /// `state` where both are held; a posted session (`comm/posted.rs`) holds it alone, so that
    /// ring collectives go on meanwhile, which therefore never wait for it (see `pairs_seen`).
    pairs: Mutex<BTreeMap<usize, Pair>>,
    /// The point-to-point links' counters when `pairs` was last free: what [`Inner::counters`]
    /// counts for them while a posted session holds it.
    pairs_seen: Mutex<Counters>,
    /// The pairwise collectives' links per peer (apart from point-to-point's), connected by the
    /// first such collective between the two. Locked only while `state` is held (after `pairs`,
    /// when both are).
    mesh: Mutex<BTreeMap<usize, Links>>,
    /// Every pair of ranks (lower first) that the pairwise collectives have connected so far,
    /// this rank's or not: a function of the calls made, so the same on every rank, which is
    /// what lets every rank agree whether a call connects anywhere. Locked after `mesh`.
    mesh_pairs: Mutex<std::collections::BTreeSet<(usize, usize)>>,
    /// Where every rank can be reached after start-up (learned by the start-up all-gather), and
    /// this rank's listener for them: pairs connect without rank 0's store.
    peers: std::sync::OnceLock<Vec<connect::PeerAddr>>,
    peer_listener: Option<PeerListener>,
    /// The last calls, dumped when the communicator fails or closes.
    flight: Recorder,
    /// Raised by [`Communicator::abort`] from any thread; the running call sees it.
    abort: AbortFlag,
    /// This communicator's name in flight records: `host`, or `split<N>.<color>` (nested:
    /// `split1.0-split2.1`).
    name: String,
    /// Device communicators created on this one so far (their flight records' names).
    device_comms: AtomicUsize,
    /// Splits made from this one so far (the sub-communicators' job ids and names).
    splits: AtomicUsize,
    // Rank 0 serves the store for as long as the communicator lives.
    _store: Option<StoreServer>,
}

type State = failure::RingState<Links>;

impl Communicator {
    /// Join the job described by the launcher's environment (see [`Config::from_env`]).
    pub fn from_env() -> Result<Communicator> {
        Communicator::init(Config::from_env()?)
    }

    /// Join the job described by `cfg`: rendezvous through rank 0's store, choose and connect the
    /// transport of both ring edges, and all-gather over the ring (proving it works) where every
    /// rank can be reached later (point-to-point calls connect straight between two ranks).
    pub fn init(cfg: Config) -> Result<Communicator> {
        Communicator::start(cfg, "host".into(), None)
    }

    /// [`Communicator::init`] with the flight record's name and, for a split's rank 0, the store
    /// it already serves.
    fn start(cfg: Config, name: String, server: Option<StoreServer>) -> Result<Communicator> {
        cfg.validate()?;
        let (rank, size) = (cfg.launch.rank, cfg.launch.world_size);
        let (links, edges, store, data_ip) = if size == 1 {
            (None, Vec::new(), None, None)
        } else {
            connect::connect_ring(&cfg, server)?
        };
        let flight = Recorder::new(&cfg, name.clone(), &edges);
        let peer_listener = match data_ip {
            Some(ip) => Some(PeerListener::start(
                ip,
                &Identity {
                    secret: &cfg.secret,
                    job_id: &cfg.job_id,
                    rank: rank as u32,
                },
                cfg.timeout,
            )?),
            None => None,
        };
        let inner = Arc::new(Inner {
            cfg,
            rank,
            size,
            flight,
            abort: AbortFlag::default(),
            name,
            device_comms: AtomicUsize::new(0),
            splits: AtomicUsize::new(0),
            edges,
            data_ip,
            state: Mutex::new(State::new(links)),
            pairs: Mutex::new(BTreeMap::new()),
            pairs_seen: Mutex::new(Counters::default()),
            mesh: Mutex::new(BTreeMap::new()),
            mesh_pairs: Mutex::new(Default::default()),
            peers: std::sync::OnceLock::new(),
            peer_listener,
            _store: store,
        });
        let comm = Communicator {
            inner,
            worker: Worker::new(format!("ringzero-worker-{rank}")),
        };
        if let Some(l) = &comm.inner.peer_listener {
            // Every rank's node and peer listener; the all-gather also proves the ring works.
            let mine = PeerRecord {
                node: fixed(&comm.inner.cfg.node_id),
                addr: fixed(&l.addr().to_string()),
            };
            let all: Vec<PeerRecord> = comm.all_gather_records(&mine)?;
            let peers = all
                .iter()
                .enumerate()
                .map(|(r, p)| {
                    let addr = unfixed(&p.addr);
                    Ok(connect::PeerAddr {
                        node: unfixed(&p.node),
                        addr: addr.parse().map_err(|_| Error::Protocol {
                            peer: format!("rank {r}"),
                            detail: format!("bad peer listener address `{addr}`"),
                        })?,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let _ = comm.inner.peers.set(peers);
        }
        Ok(comm)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// The configuration this communicator runs with.
    pub fn config(&self) -> &Config {
        &self.inner.cfg
    }

    /// How many nodes its ranks run on (distinct node ids, `RINGZERO_NODE_ID` or the host's
    /// identity; fake nodes of `ringzero launch --nodes` count apart).
    pub fn nodes(&self) -> usize {
        self.inner.nodes()
    }

    /// How many ranks run on each node, nodes in the order of their lowest rank (`[size()]`
    /// on one node).
    pub fn ranks_per_node(&self) -> Vec<usize> {
        let Some(peers) = self.inner.peers.get() else {
            return vec![self.size()];
        };
        let mut seen: Vec<(&str, usize)> = Vec::new();
        for p in peers {
            match seen.iter_mut().find(|(node, _)| *node == p.node) {
                Some((_, k)) => *k += 1,
                None => seen.push((&p.node, 1)),
            }
        }
        seen.into_iter().map(|(_, k)| k).collect()
    }

    /// This rank's two ring edges (receive edge first, then send edge) with the transport each
    /// uses and why. Empty for a one-rank world.
    pub fn edges(&self) -> &[Edge] {
        &self.inner.edges
    }

    /// The local address this rank's data connections use (where a device communicator listens
    /// for its tcp edges).
    pub(crate) fn data_ip(&self) -> Option<std::net::IpAddr> {
        self.inner.data_ip
    }

    /// What a device communicator keeps of this one to connect its point-to-point pairs later.
    pub(crate) fn host_peers(&self) -> HostPeers {
        HostPeers(self.inner.clone())
    }

    /// Byte counters of this rank's links since creation (including the setup barrier's frames,
    /// all-to-all's links and point-to-point links once connected). Waits for point-to-point
    /// calls running on another thread to finish with the links.
    pub fn counters(&self) -> Counters {
        let st = self.inner.lock();
        self.inner.counters(&st)
    }

    /// The flight recorder's record: this communicator's last calls (`RINGZERO_FLIGHT_ENTRIES`,
    /// default 256) with what each moved and how it ended, and the first failure. Readable from
    /// another thread while a call is stuck. When `RINGZERO_DUMP_DIR` is set, the same record is
    /// written there when the communicator fails or is dropped; `ringzero diag --flight DIR` joins
    /// the records of every rank.
    pub fn flight_record(&self) -> FlightRecord {
        self.inner.flight.snapshot()
    }

    /// The name of the next device communicator's flight record: `device`, `device1`, ... (on a
    /// split, prefixed by the split's name).
    pub(crate) fn next_device_name(&self) -> String {
        let d = match self.inner.device_comms.fetch_add(1, Ordering::Relaxed) {
            0 => "device".to_string(),
            i => format!("device{i}"),
        };
        match self.inner.name.as_str() {
            "host" => d,
            n => format!("{n}-{d}"),
        }
    }

    /// Split into sub-communicators: ranks that pass the same `color` form one, ranked by `key`
    /// (ties by rank in this communicator); a rank that passes `None` joins none and gets
    /// `Ok(None)`. Every rank of this communicator must call it, in the same order as its other
    /// collectives (it runs two all-gathers here). Each new communicator has its own store, ring,
    /// transports (chosen per edge as at start-up), sequence numbers and flight record; this one
    /// stays usable, and either may be dropped first.
    ///
    /// Data parallel inside tensor-parallel groups of 2 on 8 ranks:
    /// `comm.split(Some(rank % 2), rank)` gives the two data-parallel groups {0,2,4,6} and
    /// {1,3,5,7}; `comm.split(Some(rank / 2), rank)` the four tensor-parallel pairs.
    pub fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Communicator>> {
        use crate::split::{place, Ask};
        let n = self.inner.splits.fetch_add(1, Ordering::Relaxed) + 1;
        let cfg = &self.inner.cfg;
        let asks: Vec<Ask> =
            self.all_gather_records(&Ask::new(color, key, &cfg.node_id, self.data_ip()))?;
        let me = place(&asks, self.rank());
        // A group's rank 0 serves its store on an ephemeral port; the second all-gather tells the
        // other members which.
        let mut server = None;
        let mut failed = None;
        if let Some(p) = me.as_ref().filter(|p| p.rank == 0 && p.members.len() > 1) {
            let ip = asks[self.rank()]
                .ip()
                .ok_or_else(|| Error::InvalidArgument {
                    op: "split".into(),
                    msg: "this rank has no data address to serve the new store on".into(),
                });
            let started = ip.and_then(|ip| {
                StoreServer::start(
                    std::net::SocketAddr::new(ip, 0),
                    cfg.secret.clone(),
                    split_job(cfg, n, p.color),
                    cfg.timeout,
                )
            });
            // On failure port 0 goes out, so the members fail at once too.
            match started {
                Ok(s) => server = Some(s),
                Err(e) => failed = Some(e),
            }
        }
        let port = server.as_ref().map_or(0u32, |s| s.addr().port() as u32);
        let ports: Vec<u32> = self.all_gather_records(&port)?;
        if let Some(e) = failed {
            return Err(e);
        }
        let Some(p) = me else { return Ok(None) };
        let root = p.members[0];
        if p.members.len() > 1 && ports[root] == 0 {
            return Err(Error::Io {
                context: format!("split {n}, color {}", p.color),
                detail: format!(
                    "rank {root}, the new communicator's rank 0, could not start its store (its \
                     own error says why)"
                ),
            });
        }
        let mut sub = cfg.clone();
        sub.launch = crate::config::LaunchInfo {
            rank: p.rank,
            world_size: p.members.len(),
            local_rank: p.local_rank,
            local_world_size: p.local_size,
            master_addr: asks[root]
                .ip()
                .map_or("127.0.0.1".into(), |ip| ip.to_string()),
            master_port: ports[root] as u16,
            source: "split",
        };
        sub.job_id = split_job(cfg, n, p.color);
        let name = match self.inner.name.as_str() {
            "host" => format!("split{n}.{}", p.color),
            parent => format!("{parent}-split{n}.{}", p.color),
        };
        Communicator::start(sub, name, server).map(Some)
    }

    /// Every rank's `mine`, in rank order (one all-gather of its bytes).
    pub(crate) fn all_gather_records<T: bytemuck::Pod>(&self, mine: &T) -> Result<Vec<T>> {
        let all = self.all_gather_bytes(bytemuck::bytes_of(mine))?;
        Ok(all
            .chunks_exact(std::mem::size_of::<T>())
            .map(bytemuck::pod_read_unaligned)
            .collect())
    }

    /// Every rank's `mine` (all of one length), concatenated in rank order.
    pub(crate) fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<u8>> {
        let mut all = vec![0u8; mine.len() * self.size()];
        self.all_gather(mine, &mut all)?;
        Ok(all)
    }

    /// Elements of a `count`-element buffer that this rank owns in a reduce-scatter or contributes
    /// to an all-gather: chunks are balanced, the first `count % size` ranks hold one more element.
    pub fn chunk_range(&self, count: usize) -> Range<usize> {
        chunk(count, self.size(), self.rank())
    }

    /// Sum (or other `op`) of every rank's `send` into every rank's `recv`.
    ///
    /// On three ranks or more, small buffers (up to `RINGZERO_DOUBLING_MAX`, 64 KiB by default)
    /// go by recursive doubling (`log2 n` exchanges, each of the whole buffer, with one partner
    /// at a time), middle ones (up to `RINGZERO_HALVING_MAX`, 256 KiB) by halving-doubling (the
    /// same partners, halves of the buffer down and back up: `2 log2 n` exchanges moving the
    /// ring's bytes), larger ones round the ring (`2(n − 1)` hops of `1/n` of it): see [`Algo`]
    /// (`RINGZERO_ALGO`). Each leaves every rank bit-identical, in an order fixed by the world
    /// size and the count; the two doubling schedules share one order and the ring has another,
    /// so a sum may round differently on either side of `RINGZERO_HALVING_MAX`.
    /// [`Communicator::all_reduce_with`] picks the algorithm for one call.
    pub fn all_reduce<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_with(send, recv, op, self.inner.cfg.algo)
    }

    /// In-place [`Communicator::all_reduce`].
    pub fn all_reduce_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_in_place_with(buf, op, self.inner.cfg.algo)
    }

    /// [`Communicator::all_reduce`] by the algorithm `algo`, whatever `RINGZERO_ALGO` says: for
    /// a caller whose results must round as another collective's do (the ring's all-reduce
    /// reduces in the order of its reduce-scatter, [`Algo::Ring`]). Every rank must
    /// make the same choice: a rank whose call runs another algorithm fails at the first frame,
    /// both calls named.
    pub fn all_reduce_with<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        algo: Algo,
    ) -> Result<()> {
        let c = Collective::AllReduce;
        same_len(c, send.len(), recv.len(), "send", "recv")?;
        self.wait_async_idle();
        let bufs = Bufs::Split {
            input: bytemuck::cast_slice(send),
            output: bytemuck::cast_slice_mut(recv),
        };
        self.inner.execute_by(
            algo,
            c,
            (Some(T::DTYPE), op),
            send.len().into(),
            false,
            bufs,
        )
    }

    /// In-place [`Communicator::all_reduce_with`].
    pub fn all_reduce_in_place_with<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        algo: Algo,
    ) -> Result<()> {
        self.wait_async_idle();
        let count = buf.len();
        let bufs = Bufs::One(bytemuck::cast_slice_mut(buf));
        let (c, dtype) = (Collective::AllReduce, Some(T::DTYPE));
        self.inner
            .execute_by(algo, c, (dtype, op), count.into(), true, bufs)
    }

    /// Reduce every rank's `send` and leave chunk [`chunk_range`](Self::chunk_range)`(send.len())`
    /// of the result in `recv`, which must have exactly that length.
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let c = Collective::ReduceScatter;
        let want = self.chunk_range(send.len()).len();
        same_len(c, want, recv.len(), "this rank's chunk of send", "recv")?;
        self.run_split(c, Some(op), send.len(), send, recv)
    }

    /// In-place reduce-scatter: the reduced chunk [`chunk_range`](Self::chunk_range)`(buf.len())`
    /// is written over that part of `buf`; the rest of `buf` is left as it was.
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.run_one(Collective::ReduceScatter, Some(op), buf.len(), buf)
    }

    /// Reduce-scatter with a part per rank (`MPI_Reduce_scatter`): `counts[i]` elements of the
    /// reduction go to rank `i`, in rank order, so `counts` (one per rank, the same on every
    /// rank) add up to `send`'s length and `recv` holds `counts[rank]`. Parts may be of any size,
    /// zero included: shards that do not split evenly need no padding.
    ///
    /// The ring's reduce-scatter over parts of the given sizes: each rank sends every part but
    /// its own once, and a link's time follows the largest part (a frame per part per step, each
    /// part cut into as many slices as the largest needs). Ranks that pass different counts fail
    /// at the first frame: the counts' digest is part of the call's fingerprint.
    pub fn reduce_scatter_v<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let c = Collective::ReduceScatterV;
        let at = offsets(c, ("counts", counts), self.size(), ("send", send.len()))?;
        own_part(c, ("recv", recv.len()), counts, self.rank())?;
        self.wait_async_idle();
        let bufs = Bufs::Split {
            input: bytemuck::cast_slice(send),
            output: bytemuck::cast_slice_mut(recv),
        };
        let count = Count::parts(at[counts.len()], counts);
        self.inner
            .execute(c, Some(T::DTYPE), op, count, false, bufs)
    }

    /// In-place [`Communicator::reduce_scatter_v`]: this rank's part of `buf` (`counts[rank]`
    /// elements after the parts of the ranks before it) is overwritten with the reduction; the
    /// rest of `buf` is left as it was.
    pub fn reduce_scatter_v_in_place<T: Element>(
        &self,
        buf: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let c = Collective::ReduceScatterV;
        let at = offsets(c, ("counts", counts), self.size(), ("buf", buf.len()))?;
        self.wait_async_idle();
        let count = Count::parts(at[counts.len()], counts);
        let bufs = Bufs::One(bytemuck::cast_slice_mut(buf));
        self.inner.execute(c, Some(T::DTYPE), op, count, true, bufs)
    }

    /// Gather every rank's `send` (chunk [`chunk_range`](Self::chunk_range)`(recv.len())` of the
    /// result, so its length must match) into every rank's `recv`.
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let c = Collective::AllGather;
        let want = self.chunk_range(recv.len()).len();
        same_len(c, send.len(), want, "send", "this rank's chunk of recv")?;
        self.run_split(c, None, recv.len(), send, recv)
    }

    /// In-place all-gather: this rank's chunk of `buf` is sent, every other chunk is overwritten.
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.run_one(Collective::AllGather, None, buf.len(), buf)
    }

    /// Copy the root's `send` into every rank's `recv`. On other ranks `send` is not read (and may
    /// be empty); on the root it must be as long as `recv`.
    ///
    /// It goes down the ring's pipelined chain (`n − 1` hops, slice after slice), or with
    /// [`Algo::Doubling`] (`RINGZERO_ALGO=doubling`) down a binomial tree: `⌈log2 n⌉` rounds, the
    /// holders doubling each round, which shortens one call but sends `log2 n` copies from the
    /// root, so back-to-back calls no longer pipeline.
    pub fn broadcast<T: Element>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        self.broadcast_with(send, recv, root, self.inner.cfg.algo)
    }

    /// In-place broadcast of the root's `buf`.
    pub fn broadcast_in_place<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.broadcast_in_place_with(buf, root, self.inner.cfg.algo)
    }

    /// [`Communicator::broadcast`] by the algorithm `algo`, whatever `RINGZERO_ALGO` says (the
    /// tree for one large one-off broadcast, say, with [`Algo::Doubling`]). Every rank must make
    /// the same choice: a rank whose call runs another algorithm fails at the first frame, both
    /// calls named.
    pub fn broadcast_with<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        root: usize,
        algo: Algo,
    ) -> Result<()> {
        let c = self.rooted(Collective::Broadcast { root }, root)?;
        if root == self.rank() {
            same_len(c, send.len(), recv.len(), "send", "recv")?;
        }
        self.run_split_by(algo, c, None, recv.len(), send, recv)
    }

    /// In-place [`Communicator::broadcast_with`].
    pub fn broadcast_in_place_with<T: Element>(
        &self,
        buf: &mut [T],
        root: usize,
        algo: Algo,
    ) -> Result<()> {
        let c = self.rooted(Collective::Broadcast { root }, root)?;
        self.run_one_by(algo, c, None, buf.len(), buf)
    }

    /// Reduce every rank's `send` into the root's `recv` (as long as `send`). On other ranks
    /// `recv` is not written (and may be empty).
    ///
    /// It goes up the ring's chain, or with [`Algo::Doubling`] up a binomial tree, as
    /// [`Communicator::broadcast`] goes down them; the two reduce in different (fixed) orders,
    /// so a sum may round differently between them.
    pub fn reduce<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.reduce_with(send, recv, op, root, self.inner.cfg.algo)
    }

    /// In-place reduce: the root's `buf` receives the result; other ranks' buffers are unchanged.
    pub fn reduce_in_place<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.reduce_in_place_with(buf, op, root, self.inner.cfg.algo)
    }

    /// [`Communicator::reduce`] by the algorithm `algo`, whatever `RINGZERO_ALGO` says. Every
    /// rank must make the same choice: a rank whose call runs another algorithm fails at the
    /// first frame, both calls named.
    pub fn reduce_with<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
        algo: Algo,
    ) -> Result<()> {
        let c = self.rooted(Collective::Reduce { root }, root)?;
        if root == self.rank() {
            same_len(c, send.len(), recv.len(), "send", "recv")?;
        }
        self.run_split_by(algo, c, Some(op), send.len(), send, recv)
    }

    /// In-place [`Communicator::reduce_with`].
    pub fn reduce_in_place_with<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        root: usize,
        algo: Algo,
    ) -> Result<()> {
        let c = self.rooted(Collective::Reduce { root }, root)?;
        self.run_one_by(algo, c, Some(op), buf.len(), buf)
    }

    /// Send `send` to the next rank and receive the previous rank's buffer into `recv` (same
    /// length on every rank). Every link carries data at once: this is the ring's raw streaming
    /// rate, and the exchange step of ring attention.
    pub fn ring_shift<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let c = Collective::RingShift;
        same_len(c, send.len(), recv.len(), "send", "recv")?;
        self.run_split(c, None, send.len(), send, recv)
    }

    /// In-place [`Communicator::ring_shift`].
    pub fn ring_shift_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.run_one(Collective::RingShift, None, buf.len(), buf)
    }

    /// All-to-all: block `j` of `send` goes to rank `j`, and block `i` of `recv` comes from rank
    /// `i` (`send` and `recv` hold the same number of elements, a multiple of the world size; a
    /// block is that number over the world size). A rank's own block is copied locally.
    ///
    /// A ring has no all-to-all schedule, so every rank exchanges a block with every other rank
    /// at once, as NCCL's grouped sends and receives do: the next rank's block goes out and the
    /// previous rank's comes in over the ring's own links (so a rank that calls a ring collective
    /// instead fails at once, both calls named), every other block over links each pair keeps
    /// for the pairwise collectives (see [`Communicator::all_to_all_v`]), which the first
    /// all-to-all connects, after its ring exchange. Each rank sends (n−1)/n of its buffer.
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let c = Collective::AllToAll;
        same_len(c, send.len(), recv.len(), "send", "recv")?;
        self.whole_blocks(send.len())?;
        self.wait_async_idle();
        self.inner.all_to_all(
            T::DTYPE,
            send.len(),
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
        )
    }

    /// In-place [`Communicator::all_to_all`]: `buf`'s blocks are sent first (from a copy of
    /// `buf` this call makes), then replaced by the blocks received.
    pub fn all_to_all_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let send = buf.to_vec();
        self.all_to_all(&send, buf)
    }

    /// Return only once every rank has entered the barrier. On three ranks or more it is a
    /// dissemination barrier (`⌈log2 n⌉` rounds of empty messages), else the ring's (`n − 1`
    /// hops): see [`Algo`] (`RINGZERO_ALGO`).
    pub fn barrier(&self) -> Result<()> {
        self.barrier_with(self.inner.cfg.algo)
    }

    /// [`Communicator::barrier`] by the algorithm `algo`, whatever `RINGZERO_ALGO` says (the
    /// ring's barrier is `n − 1` hops, what `ringzero bench` times as α). Every rank must make
    /// the same choice: a rank whose call runs another algorithm fails at once, both calls named.
    pub fn barrier_with(&self, algo: Algo) -> Result<()> {
        self.wait_async_idle();
        let (c, bufs) = (Collective::Barrier, Bufs::One(&mut []));
        self.inner
            .execute_by(algo, c, (None, ReduceOp::Sum), 0.into(), false, bufs)
    }

    /// Abort the communicator from any thread — a watchdog's, say, while a call is stuck: the call
    /// in progress on this rank fails within a few tens of milliseconds with an
    /// [`Error::Aborted`] naming `reason`, both neighbours are told (they and, in turn, every rank
    /// fail their current and later calls), and every later call here fails. Returns once the
    /// neighbours have been told.
    pub fn abort(&self, reason: &str) {
        self.inner.abort(reason);
    }

    /// A handle that aborts this communicator as [`Communicator::abort`] does, for a watchdog
    /// thread that does not own a reference to the communicator.
    pub fn abort_handle(&self) -> AbortHandle {
        let inner = Arc::downgrade(&self.inner);
        AbortHandle::new(move |reason| {
            if let Some(i) = inner.upgrade() {
                i.abort(reason)
            }
        })
    }

    /// Refuse an all-to-all buffer of `len` elements that does not split into one block per rank.
    fn whole_blocks(&self, len: usize) -> Result<()> {
        if len.is_multiple_of(self.size()) {
            return Ok(());
        }
        Err(refused(
            Collective::AllToAll,
            format!(
                "send has {len} elements, not a multiple of the world size {} (every rank sends \
                 each rank one block of equal size)",
                self.size()
            ),
        ))
    }

    fn rooted(&self, c: Collective, root: usize) -> Result<Collective> {
        if root >= self.size() {
            return Err(Error::InvalidArgument {
                op: c.name().into(),
                msg: format!(
                    "root {root} is not a rank of this {}-rank communicator",
                    self.size()
                ),
            });
        }
        Ok(c)
    }

    fn run_split<T: Element>(
        &self,
        c: Collective,
        op: Option<ReduceOp>,
        count: usize,
        send: &[T],
        recv: &mut [T],
    ) -> Result<()> {
        self.run_split_by(self.inner.cfg.algo, c, op, count, send, recv)
    }

    /// [`Communicator::run_split`] by `algo`.
    fn run_split_by<T: Element>(
        &self,
        algo: Algo,
        c: Collective,
        op: Option<ReduceOp>,
        count: usize,
        send: &[T],
        recv: &mut [T],
    ) -> Result<()> {
        self.wait_async_idle();
        let bufs = Bufs::Split {
            input: bytemuck::cast_slice(send),
            output: bytemuck::cast_slice_mut(recv),
        };
        let call = (Some(T::DTYPE), op.unwrap_or(ReduceOp::Sum));
        self.inner
            .execute_by(algo, c, call, count.into(), false, bufs)
    }

    fn run_one<T: Element>(
        &self,
        c: Collective,
        op: Option<ReduceOp>,
        count: usize,
        buf: &mut [T],
    ) -> Result<()> {
        self.run_one_by(self.inner.cfg.algo, c, op, count, buf)
    }

    /// [`Communicator::run_one`] by `algo`.
    fn run_one_by<T: Element>(
        &self,
        algo: Algo,
        c: Collective,
        op: Option<ReduceOp>,
        count: usize,
        buf: &mut [T],
    ) -> Result<()> {
        self.wait_async_idle();
        let call = (Some(T::DTYPE), op.unwrap_or(ReduceOp::Sum));
        let bufs = Bufs::One(bytemuck::cast_slice_mut(buf));
        self.inner
            .execute_by(algo, c, call, count.into(), true, bufs)
    }

    fn submit<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Inner) -> Result<R> + Send + 'static,
    ) -> Work<R> {
        let inner = self.inner.clone();
        self.worker.submit(move || f(&inner))
    }

    /// Wait until every asynchronous collective submitted so far has finished.
    fn wait_async_idle(&self) {
        self.worker.wait_idle();
    }
}

/// A device communicator's hold on its host communicator: the host's point-to-point links, over
/// which two ranks trade how to reach each other's device FIFOs when their first device
/// point-to-point call meets, and where each rank is.
pub(crate) struct HostPeers(Arc<Inner>);

impl HostPeers {
    /// [`Communicator::nodes`].
    pub(crate) fn nodes(&self) -> usize {
        self.0.nodes()
    }

    /// How host frames from `peer` to this rank travel (shm on one node, else tcp) and why: the
    /// ring's choice ([`crate::topology::choose`]) for that pair.
    pub(crate) fn edge_from(&self, peer: usize) -> Result<Edge> {
        let node = self
            .0
            .peers
            .get()
            .and_then(|p| p.get(peer))
            .map(|p| p.node.clone())
            .ok_or_else(|| Error::Protocol {
                peer: format!("rank {peer}"),
                detail: "this communicator does not know where its peers are".into(),
            })?;
        crate::topology::choose(&self.0.cfg, peer, &node, self.0.rank)
    }

    /// [`Communicator::data_ip`].
    pub(crate) fn data_ip(&self) -> Option<std::net::IpAddr> {
        self.0.data_ip
    }

    /// A worker of its own that runs point-to-point calls on these links as the asynchronous
    /// forms do ([`Communicator::send_recv_batch_async`]: posted, so they never wait on each
    /// other in a cycle), for a device communicator's posted session to trade connect infos
    /// without waiting on its peers' turns.
    pub(crate) fn poster(&self, name: String) -> HostPoster {
        HostPoster {
            inner: self.0.clone(),
            worker: Worker::new(name),
        }
    }
}

/// Posted point-to-point calls on a communicator's host links from a thread of their own
/// ([`HostPeers::poster`]).
pub(crate) struct HostPoster {
    inner: Arc<Inner>,
    worker: Worker<posted::Posted>,
}

impl HostPoster {
    /// Post `msgs` as one call ([`Communicator::send_recv_batch_async`]'s rules, peers checked
    /// by the caller): the `Work` gives them back, receives filled.
    pub(crate) fn post(&self, msgs: Vec<P2pOwned<u8>>) -> Work<Vec<P2pOwned<u8>>> {
        let inner = self.inner.clone();
        self.worker.post(
            |fill| posted::Posted::new(msgs, move |r, msgs| fill(r.map(|()| msgs))),
            move |first, ticket, feed| inner.run_posted(first, ticket, feed),
        )
    }

    /// Send `sends[i].1` to rank `sends[i].0` and receive `len` bytes from each of those ranks,
    /// all as one posted call, and wait for it: what each sent, in the same order. (A device
    /// communicator's blocking connect: like the posted one, it holds the host communicator's
    /// point-to-point links only, not its state, so host collectives go on meanwhile.)
    pub(crate) fn exchange(
        &self,
        sends: Vec<(usize, Vec<u8>)>,
        len: usize,
    ) -> Result<Vec<Vec<u8>>> {
        let peers = sends.iter().map(|(p, _)| *p).collect::<Vec<_>>();
        let mut msgs: Vec<P2pOwned<u8>> = sends
            .into_iter()
            .map(|(p, b)| P2pOwned::Send(b, p))
            .collect();
        msgs.extend(peers.iter().map(|&p| P2pOwned::Recv(vec![0u8; len], p)));
        let checked = msgs.iter().map(P2pOwned::peer);
        pairs::check_peers(self.inner.size, self.inner.rank, checked)?;
        let done = self.post(msgs).wait()?;
        Ok(done
            .into_iter()
            .filter_map(|m| match m {
                P2pOwned::Recv(b, _) => Some(b),
                P2pOwned::Send(..) => None,
            })
            .collect())
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // Stop the worker after the jobs already queued, then flush what the last call sent.
        self.worker.stop();
        let mut st = self.inner.lock();
        let seq = st.seq;
        let timeout = self.inner.cfg.timeout;
        if st.failed.is_none() {
            let inner = &self.inner;
            let flush = |l: &mut Links| l.flush("shutdown", seq, timeout, &inner.abort);
            let flushed = st.links.iter_mut().try_for_each(flush).and_then(|()| {
                inner.other_links(|others| {
                    for l in others {
                        flush(l)?;
                    }
                    Ok(())
                })
            });
            if let Err(e) = flushed {
                inner.flight.failed(&e.to_string());
            }
        }
        self.inner.flight.closed();
    }
}

/// Aborts one communicator (host or device) from any thread: cheap to clone, `Send` and `Sync`.
/// It does not keep the communicator alive: once that is dropped, `abort` does nothing.
#[derive(Clone)]
pub struct AbortHandle {
    abort: Arc<dyn Fn(&str) + Send + Sync>,
}

impl AbortHandle {
    pub(crate) fn new(abort: impl Fn(&str) + Send + Sync + 'static) -> AbortHandle {
        AbortHandle {
            abort: Arc::new(abort),
        }
    }

    /// Abort with `reason`: see [`Communicator::abort`].
    pub fn abort(&self, reason: &str) {
        (self.abort)(reason)
    }
}

impl std::fmt::Debug for AbortHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AbortHandle")
    }
}

/// What each rank tells every other at start-up: its node and its peer listener's address.
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
struct PeerRecord {
    node: [u8; 128],
    addr: [u8; 64],
}

/// `s` NUL-padded (`Config::validate` keeps node ids under 128 bytes; an address fits 64).
fn fixed<const N: usize>(s: &str) -> [u8; N] {
    let mut b = [0u8; N];
    let n = s.len().min(N);
    b[..n].copy_from_slice(&s.as_bytes()[..n]);
    b
}

fn unfixed(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// The job id of split `n`'s group `color`: distinct from the parent's and every other group's,
/// so their connections cannot cross.
fn split_job(cfg: &Config, n: usize, color: u32) -> String {
    format!("{}/split{n}.{color}", cfg.job_id)
}

/// A call of `c` refused for `msg` before anything moved.
pub(crate) fn refused(c: Collective, msg: String) -> Error {
    Error::InvalidArgument {
        op: c.to_string(),
        msg,
    }
}

/// Where each rank's block starts in a buffer of `len` elements split by `counts` (`n + 1`
/// offsets, the last `len`), or why `counts` cannot split it.
pub(crate) fn offsets(
    c: Collective,
    (what, counts): (&str, &[usize]),
    n: usize,
    (buf, len): (&str, usize),
) -> Result<Vec<usize>> {
    let bad = |msg: String| refused(c, msg);
    if counts.len() != n {
        return Err(bad(format!(
            "{what} has {} entries but the communicator has {n} ranks (one count per rank)",
            counts.len()
        )));
    }
    let mut at = Vec::with_capacity(n + 1);
    at.push(0usize);
    for &k in counts {
        let next = at[at.len() - 1]
            .checked_add(k)
            .ok_or_else(|| bad(format!("{what} add up to more than usize::MAX elements")))?;
        at.push(next);
    }
    if at[n] != len {
        return Err(bad(format!(
            "{what} add up to {} elements but {buf} has {len}",
            at[n]
        )));
    }
    Ok(at)
}

/// Refuse a buffer (`what`, `len` elements) that should hold this rank's part, `counts[rank]`.
/// `counts` has one entry per rank (checked by [`offsets`] first).
pub(crate) fn own_part(
    c: Collective,
    (what, len): (&str, usize),
    counts: &[usize],
    rank: usize,
) -> Result<()> {
    if len == counts[rank] {
        return Ok(());
    }
    Err(refused(
        c,
        format!(
            "{what} has {len} elements but counts[{rank}] (this rank's part) is {}",
            counts[rank]
        ),
    ))
}

/// The counters of `links` together.
fn links_sum<'a>(links: impl Iterator<Item = &'a Links>) -> Counters {
    links.fold(Counters::default(), |a, l| a + l.counters)
}

fn same_len(c: Collective, a: usize, b: usize, a_name: &str, b_name: &str) -> Result<()> {
    if a == b {
        Ok(())
    } else {
        Err(Error::InvalidArgument {
            op: c.name().into(),
            msg: format!("{a_name} has {a} elements but {b_name} has {b}; they must be equal"),
        })
    }
}

impl Inner {
    fn abort(&self, reason: &str) {
        failure::abort(&self.state, &self.abort, self.rank, reason, &self.flight);
        let _st = self.lock();
        self.tell_other_links(&format!("rank {}: {reason}", self.rank));
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A call of `plan` on this communicator (all ranks; frames numbered `seq`, fingerprinted `fp`,
    /// both ways) writing `out_bytes` of results.
    fn call<'a>(
        &'a self,
        plan: &'a crate::ring::Plan,
        (seq, fp): (u64, Fingerprint),
        dtype: DType,
        op: ReduceOp,
        out_bytes: usize,
    ) -> Call<'a> {
        Call {
            plan,
            fp,
            seq,
            dtype,
            op,
            n: self.size,
            rank: self.rank,
            timeout: self.cfg.timeout,
            stream_stores: out_bytes >= self.cfg.stream_stores_from,
            abort: &self.abort,
            incoming: None,
        }
    }

    /// Bytes and frames over every link: the ring's and [`Inner::other_links`] (waiting for a
    /// posted session on another thread to end).
    fn counters(&self, st: &State) -> Counters {
        let pairs = self.pairs.lock().unwrap_or_else(|p| p.into_inner());
        self.with_ring_and_mesh(st, self.note_pairs(pairs))
    }

    /// [`Inner::counters`] without waiting: while a posted session holds the point-to-point
    /// links, they count as they were when last free (`pairs_seen`; monotone). A ring call's
    /// flight record reads these, so that it never waits for a session (whose messages, on
    /// links of their own, are none of the call's traffic).
    fn counters_now(&self, st: &State) -> Counters {
        let pairs = match self.pairs.try_lock() {
            Ok(pairs) => self.note_pairs(pairs),
            Err(std::sync::TryLockError::Poisoned(p)) => self.note_pairs(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => {
                *self.pairs_seen.lock().unwrap_or_else(|p| p.into_inner())
            }
        };
        self.with_ring_and_mesh(st, pairs)
    }

    /// The point-to-point links' counters (`pairs` held), noted in `pairs_seen`.
    fn note_pairs(&self, pairs: MutexGuard<'_, BTreeMap<usize, Pair>>) -> Counters {
        let seen = links_sum(pairs.values().map(|p| &p.links));
        *self.pairs_seen.lock().unwrap_or_else(|p| p.into_inner()) = seen;
        seen
    }

    /// `pairs` (the point-to-point links' counters) with the ring's and the pairwise links'.
    fn with_ring_and_mesh(&self, st: &State, pairs: Counters) -> Counters {
        let mesh = self.mesh.lock().unwrap_or_else(|p| p.into_inner());
        links_sum(st.links.iter().chain(mesh.values())) + pairs
    }

    /// Run `f` on every link beside the ring's: point-to-point's pairs and the pairwise
    /// collectives' (locked in that order). Call with `state` held.
    fn other_links<R>(&self, f: impl FnOnce(&mut dyn Iterator<Item = &mut Links>) -> R) -> R {
        let mut pairs = self.pairs.lock().unwrap_or_else(|p| p.into_inner());
        let mut mesh = self.mesh.lock().unwrap_or_else(|p| p.into_inner());
        let mut all = pairs
            .values_mut()
            .map(|p| &mut p.links)
            .chain(mesh.values_mut());
        f(&mut all)
    }

    /// Run one call that passed its checks: take its sequence number, record it in the flight
    /// recorder, and fail the communicator if it fails (bad arguments found late excepted).
    fn recorded(
        &self,
        st: &mut State,
        fp: &Fingerprint,
        in_place: bool,
        bytes: u64,
        run: impl FnOnce(&mut State) -> Result<()>,
    ) -> Result<()> {
        let seq = st.seq;
        st.seq += 1;
        self.flight
            .begin(seq, fp, in_place, bytes, self.counters_now(st));
        let r = run(st);
        self.flight.end(&r, self.counters_now(st));
        if let Err(e) = &r {
            self.fail(st, e);
        }
        r
    }

    /// A call failed with `e`: unless it only refused its arguments, fail the communicator and
    /// tell every peer this rank has a link with.
    fn fail(&self, st: &mut State, e: &Error) {
        let who = failure::Failing {
            rank: self.rank,
            flag: &self.abort,
            flight: &self.flight,
            kind: "host",
        };
        failure::fail(st, &who, e, |why| self.tell_other_links(why));
    }

    /// Tell the peers of the links beside the ring's ([`Inner::other_links`]) that this rank
    /// aborts. Call with `state` held.
    fn tell_other_links(&self, why: &str) {
        self.other_links(|others| others.for_each(|l| l.abort(why)));
    }

    /// A ring collective, or its doubling schedule where the configured algorithm picks that
    /// for this size ([`Inner::execute_by`]).
    /// [`Communicator::nodes`]: 1 before the ranks have told each other where they run (or on
    /// one rank).
    pub(crate) fn nodes(&self) -> usize {
        self.peers.get().map_or(1, |peers| {
            let nodes: std::collections::BTreeSet<&str> =
                peers.iter().map(|p| p.node.as_str()).collect();
            nodes.len()
        })
    }

    fn execute(
        &self,
        coll: Collective,
        dtype: Option<DType>,
        op: ReduceOp,
        count: Count,
        in_place: bool,
        bufs: Bufs,
    ) -> Result<()> {
        self.execute_by(self.cfg.algo, coll, (dtype, op), count, in_place, bufs)
    }

    /// [`Inner::execute`] by `algo`: the collectives that have a doubling schedule (all-reduce,
    /// broadcast, reduce, barrier) run the one `algo` picks for this size and world, if any;
    /// every other call runs the ring.
    fn execute_by(
        &self,
        algo: Algo,
        coll: Collective,
        (dtype, op): (Option<DType>, ReduceOp),
        count: Count,
        in_place: bool,
        bufs: Bufs,
    ) -> Result<()> {
        let bytes = count.total.saturating_mul(dtype.map_or(1, DType::size));
        if let Some(sched) = algo.schedule(coll, bytes, self.size) {
            if count.parts.is_none() {
                let call = (sched, coll, dtype, op);
                return self.by_doubling(call, count.total, in_place, bufs);
            }
        }
        let mut st = self.lock();
        let dt = dtype.unwrap_or(DType::U8);
        let fp = Fingerprint::new(coll, dtype, Some(op), count.total);
        let fp = count.parts.map_or(fp, |c| fp.with_counts(c));
        let seq = st.seq;
        failure::refuse(st.failed.as_ref(), &self.abort, &fp, seq)?;
        let slot_bytes = st.links.as_ref().map_or(self.cfg.slice_bytes, |l| {
            l.tx.slot_bytes().min(self.cfg.slice_bytes)
        });
        let p = plan(PlanArgs {
            coll,
            n: self.size,
            rank: self.rank,
            count: count.total,
            slice_elems: (slot_bytes / dt.size()).max(1),
            in_place,
            counts: count.parts,
        });
        let call = self.call(&p, (seq, fp), dt, op, bufs.output_bytes());
        // Refused calls consume no sequence number: the ranks stay in step.
        engine::check_sizes(&call, &bufs, &fp.to_string())?;
        let bytes = (count.total * dt.size()) as u64;
        self.recorded(&mut st, &fp, in_place, bytes, |st| {
            match st.links.as_mut() {
                Some(links) => engine::run(links, &call, bufs),
                None => engine::run_local(&call, bufs),
            }
        })
    }
}
