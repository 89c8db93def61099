//! The communicator: the public face of the library.

use crate::calls::Collectives;
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::bootstrap::peers::PeerListener;
use crate::bootstrap::{Identity, StoreServer};
use crate::config::Config;
use crate::connect;
use crate::error::{Error, Result};
use crate::flight::{FlightRecord, Recorder};
use crate::ring::chunk;
use crate::ring::engine::{Counters, Links};
use crate::ring::failure;
use crate::ring::failure::AbortFlag;
use crate::topology::Edge;
use crate::work::Worker;

mod calls;
mod collectives;
mod direct;
mod doubling;
mod inner;
mod nonblocking;
pub(crate) mod pairs;
pub(crate) mod pairwise;
mod peers;
mod posted;
mod shared_buf;
mod with_algo;
use inner::same_len;
pub(crate) use inner::{offsets, own_part, refused};
use pairs::Pair;
pub use pairs::{P2p, P2pOwned};
pub(crate) use peers::{HostPeers, HostPoster};
pub use shared_buf::SharedBuf;
pub use with_algo::WithAlgo;

/// A group of ranks that run collectives together.
///
/// Create one per process (or per thread, for tests) with [`Communicator::from_env`] under a
/// launcher, or [`Communicator::init`] with an explicit [`Config`]. Every rank must call the same
/// collectives in the same order with matching arguments; a rank that does not gets an
/// [`Error::Mismatch`] naming both calls instead of a hang.
///
/// The blocking collectives are the [`Collectives`](crate::Collectives) trait's, which
/// [`DeviceComm`](crate::DeviceComm) implements too (bring it into scope:
/// `use ringzero::prelude::*`). Collectives come in two forms: blocking on borrowed buffers, out of place
/// (`all_reduce(&send, &mut recv, op)`) or in place (`all_reduce(InPlace, &mut buf, op)`, as
/// `MPI_IN_PLACE`), and asynchronous on owned buffers (`all_reduce_async(vec, op)`,
/// `reduce_scatter_async(send, recv, op)`) returning a [`Work`](crate::Work) that gives the
/// buffers back; blocking calls made later wait for earlier asynchronous ones, so the order
/// across ranks stays the program order. [`DeviceComm`](crate::DeviceComm) has the same calls
/// on device buffers. [`Communicator::with_algo`] picks the algorithm for one call.
///
/// Any error aborts the communicator: both neighbours are told, every surviving rank fails within
/// the deadline, and every later call returns an [`Error::Aborted`] naming the first cause.
///
/// ```
/// use ringzero_collectives::{Collectives, Communicator, InPlace, ReduceOp};
/// # fn main() -> Result<(), ringzero_collectives::Error> {
/// # std::env::set_var("RINGZERO_RANK", "0");
/// # std::env::set_var("RINGZERO_WORLD_SIZE", "1");
/// // Under `ringzero launch -n 4 -- ./trainer`, torchrun, srun or mpirun:
/// let comm = Communicator::from_env()?;
/// let mut grads = vec![1.0f32; 1000];
/// comm.all_reduce(InPlace, &mut grads, ReduceOp::Avg)?;
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
    /// Whether `pairs` or `mesh` has ever held a link: until then a call's counter snapshots
    /// (two per call) read the ring's links alone, without taking their locks.
    others: std::sync::atomic::AtomicBool,
    /// Every pair of ranks (lower first) that the pairwise collectives have connected so far,
    /// this rank's or not: a function of the calls made, so the same on every rank, which is
    /// what lets every rank agree whether a call connects anywhere. Locked after `mesh`.
    mesh_pairs: Mutex<std::collections::BTreeSet<(usize, usize)>>,
    /// Where every rank can be reached after start-up (learned by the start-up all-gather), and
    /// this rank's listener for them: pairs connect without rank 0's store.
    peers: std::sync::OnceLock<Vec<connect::PeerAddr>>,
    peer_listener: Option<PeerListener>,
    /// The plan of the last ring call without per-rank counts, by (collective, count, slice,
    /// in place): [`Inner::plan_of`].
    last_plan: Mutex<Option<PlanKey>>,
    /// The single-copy all-gather's node board, where every ring edge is shared memory
    /// (set up by the start-up's last all-gathers; see `comm/direct.rs`).
    direct: std::sync::OnceLock<direct::HostDirect>,
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
    /// The copy an in-place all-to-all sends from, kept for the next one (grown when too
    /// small): a fresh buffer each call faulted in every page of it again (an in-place 64 MiB
    /// all-to-all on 2 ranks took 5.6× the out-of-place one). Locked before `state`.
    a2a_copy: Mutex<Vec<u8>>,
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
            a2a_copy: Mutex::new(Vec::new()),
            edges,
            data_ip,
            state: Mutex::new(State::new(links)),
            pairs: Mutex::new(BTreeMap::new()),
            pairs_seen: Mutex::new(Counters::default()),
            mesh: Mutex::new(BTreeMap::new()),
            others: std::sync::atomic::AtomicBool::new(false),
            mesh_pairs: Mutex::new(Default::default()),
            peers: std::sync::OnceLock::new(),
            peer_listener,
            direct: std::sync::OnceLock::new(),
            last_plan: Mutex::new(None),
            _store: store,
        });
        let comm = Communicator {
            inner,
            worker: Worker::new(format!("ringzero-worker-{rank}")),
        };
        if let Some(l) = &comm.inner.peer_listener {
            // Every rank's node and peer listener; the all-gather also proves the ring works.
            // The single-copy all-gather's start-up rides on the same all-gather.
            let single = comm.single_copy_offer();
            let mine = PeerRecord {
                node: fixed(&comm.inner.cfg.node_id),
                addr: fixed(&l.addr().to_string()),
                single_copy: single.record,
            };
            let all: Vec<PeerRecord> = comm.all_gather_records(&mine)?;
            let offers: Vec<[u8; 128]> = all.iter().map(|p| p.single_copy).collect();
            comm.single_copy_setup(single.board, &offers)?;
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

    /// Whether both of this rank's ring edges are shared memory (true for a one-rank world):
    /// the algorithm choice for two ranks depends on it ([`crate::Algo::schedule`]).
    pub fn ring_on_shm(&self) -> bool {
        self.inner.ring_on_shm()
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
    /// `comm/direct.rs`'s offer: rank 0's node board path, or (any rank) why not.
    single_copy: [u8; 128],
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

/// A kept plan and what it was built for (the arguments that vary on one communicator).
type PlanKey = (
    (crate::ring::Collective, usize, usize, bool),
    Arc<crate::ring::Plan>,
);

/// The job id of split `n`'s group `color`: distinct from the parent's and every other group's,
/// so their connections cannot cross.
fn split_job(cfg: &Config, n: usize, color: u32) -> String {
    format!("{}/split{n}.{color}", cfg.job_id)
}
