//! [`DeviceComm`]: collectives on device buffers, set up through a host [`Communicator`].
//!
//! Set-up, all of it over the host communicator's own collectives (every rank takes part):
//! 1. every rank all-gathers a [`DeviceInfo`] record (its device's UUID, name, pid, and the free
//!    space of its shm directory);
//! 2. each rank chooses the transport of the edge it *receives* on ([`topology::choose_device`]),
//!    creates that FIFO (an shm staging segment mapped into its device, or device slots from
//!    `cuMemAlloc` with an shm control block) and all-gathers a [`ConnectInfo`] record;
//! 3. each rank attaches to the FIFO of the rank it sends to;
//! 4. every edge is probed: the sender writes a pattern (never zeros) into the receiver's slot and
//!    posts it; the receiver checks every byte within a deadline. Findings are all-gathered; a
//!    failed cuda_ipc edge is rebuilt as host staging ([`topology::after_probe`]), and the probe
//!    runs again on the rebuilt edge.
//!
//! The chosen transport of both edges, with its reason, is logged once and returned by
//! [`DeviceComm::edges`].

use std::any::Any;
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytemuck::{Pod, Zeroable};
use ringzero_kernels::{DType, ReduceOp};

use super::stream::Stream;
use crate::comm::{AbortHandle, Communicator, HostPeers, HostPoster};
use crate::config::{Config, StagingMode};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::flight::{FlightRecord, Recorder};
use crate::ring::device_engine::{self, DevBufs, DevLinks};
use crate::ring::engine::{AbortFlag, Call, Counters};
use crate::ring::{chunk, plan, Collective, Count, PlanArgs};
use crate::topology::{self, DevicePeer, Edge};
use crate::transport::device::{
    DevPtr, DevRecvLink, DevSendLink, FifoRecv, FifoSend, TcpDevRecv, TcpDevSend,
};
use crate::transport::shm::{ShmRecv, ShmSend};
use crate::transport::wait::Waiter;
use crate::transport::{tcp, TransportKind};
use crate::wire::{Expect, Fingerprint, FrameHeader};
use crate::work::{Work, Worker};

/// What every rank tells the others about its device (fixed size, all-gathered).
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct DeviceInfo {
    /// Device UUID (zero when it has none).
    pub uuid: [u8; 16],
    /// 1 when `uuid` is meaningful.
    pub has_uuid: u32,
    /// Process id.
    pub pid: u32,
    /// Device name (`cuda:0`, `host`), NUL-padded.
    pub name: [u8; 24],
    /// Bytes free in the rank's shm directory (host staging sizes its slots by the least).
    pub shm_free: u64,
}
const _: () = assert!(std::mem::size_of::<DeviceInfo>() == 56);

/// How to attach to a rank's receive FIFO (fixed size, all-gathered).
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct ConnectInfo {
    /// Slot bytes.
    pub slot_bytes: u64,
    /// Slots.
    pub slots: u32,
    /// 1 shm staging, 3 cuda_ipc.
    pub kind: u32,
    /// CUDA IPC handle of the device slots (cuda_ipc).
    pub ipc: [u8; 64],
    /// Path of the shm file (data or control block), NUL-padded.
    pub path: [u8; 128],
    /// TCP connections to open (tcp).
    pub sockets: u32,
    /// Zero.
    pub _reserved: [u32; 11],
}
const _: () = assert!(std::mem::size_of::<ConnectInfo>() == 256);

fn kind_code(k: TransportKind) -> u32 {
    match k {
        TransportKind::Shm => 1,
        TransportKind::Tcp => 2,
        TransportKind::CudaIpc => 3,
    }
}

pub(super) fn text<const N: usize>(s: &str) -> [u8; N] {
    let mut b = [0u8; N];
    let n = s.len().min(N);
    b[..n].copy_from_slice(&s.as_bytes()[..n]);
    b
}

fn path_text(p: &std::path::Path) -> Result<[u8; 128]> {
    let s = p.to_string_lossy();
    if s.len() >= 128 {
        return Err(Error::config(
            "RINGZERO_SHM_DIR",
            format!("the shm path `{s}` is longer than 127 bytes; use a shorter directory"),
        ));
    }
    Ok(text(&s))
}

pub(super) fn untext(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// How long a probe waits for its frame.
const PROBE_DEADLINE: Duration = Duration::from_secs(5);
/// Bytes a probe moves (or the slot size, if smaller).
const PROBE_BYTES: usize = 64 * 1024;
/// Bytes of a probe finding in the all-gathered record.
pub(super) const FINDING_BYTES: usize = 320;

/// The byte at offset `i` of a probe from rank `from`: never zero, differs between neighbours.
pub fn probe_pattern(from: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            let x = (i as u64).wrapping_mul(0x9e37_79b9) ^ (from as u64).wrapping_mul(0x85eb_ca6b);
            ((x >> 7) as u8 % 251) + 1
        })
        .collect()
}

/// Compare what arrived with what was sent: `None` if equal, else the first difference.
pub fn judge_probe(expected: &[u8], seen: &[u8]) -> Option<String> {
    if seen.len() != expected.len() {
        return Some(format!(
            "{} bytes arrived, {} were sent",
            seen.len(),
            expected.len()
        ));
    }
    let bad = expected.iter().zip(seen).filter(|(a, b)| a != b).count();
    let first = expected.iter().zip(seen).position(|(a, b)| a != b)?;
    let show = |b: &[u8]| {
        b[first..(first + 8).min(b.len())]
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    Some(format!(
        "wrong data: {bad} of {} bytes differ, first at byte {first}: expected {} saw {}",
        expected.len(),
        show(expected),
        show(seen)
    ))
}

/// Collectives on buffers of one device per rank (see the module docs).
///
/// Blocking calls (`all_reduce(&send, &mut recv, op)`) drive the ring on the calling thread.
/// Asynchronous calls on owned buffers (`all_reduce_async(buf, op)`) return a [`Work`] at once
/// and are driven by the communicator's proxy thread, in the order submitted, while the caller
/// goes on (queueing its own kernels, for example); a blocking call waits for the asynchronous
/// ones submitted before it, so every rank sees the same order. Point-to-point calls queued one
/// after another are the exception: they are posted, each message moving as its link allows
/// ([`DeviceComm::send_async`]).
pub struct DeviceComm<S: Stream> {
    core: Arc<Core<S>>,
    worker: Worker<super::posted::DevPosted>,
}

/// What the calling thread and the proxy thread share.
pub(super) struct Core<S: Stream> {
    pub(super) stream: S,
    pub(super) cfg: Config,
    pub(super) rank: usize,
    pub(super) size: usize,
    edges: Vec<Edge>,
    /// Why all-reduces, reduce-scatters, all-gathers, broadcasts and reduces run directly, where they do.
    direct_why: Option<String>,
    /// Some rank's start-up probe failed, so some edge is rebuilt as host staging: every rank
    /// slices as `RINGZERO_P2P_DISABLE=1` does, so that edge's slots in `/dev/shm` stay small.
    pub(super) staged_fallback: bool,
    /// The least free space in any rank's shm directory at set-up (sizes host staging's slots).
    shm_room: u64,
    /// Every rank's buffers are in one device's memory ([`DeviceComm::one_device`]).
    one_device: bool,
    /// How this rank's host-staging links move bytes, and why ([`DeviceComm::staging`]).
    staging: (StagingMode, String),
    state: Mutex<DevState>,
    /// Device memory an in-place all-to-all sends from (a copy of the caller's buffer), kept
    /// for the next one: address, bytes, owner. Used only under `state`'s lock.
    send_copy: Mutex<Option<Kept>>,
    /// The last calls, dumped when the communicator fails or closes.
    pub(super) flight: Recorder,
    /// Raised by [`DeviceComm::abort`] from any thread; the running call sees it.
    pub(super) abort: AbortFlag,
    /// The host communicator's point-to-point links, to connect device pairs (None: one rank).
    pub(super) host: Option<HostPeers>,
    /// Every rank's device, as all-gathered at set-up.
    pub(super) infos: Vec<DeviceInfo>,
    /// Device links of this rank with each peer it has met in a point-to-point call.
    pub(super) pairs: Mutex<BTreeMap<usize, super::pairs::DevPair>>,
    /// Posted host calls, for posted device calls to connect pairs (None: one rank).
    pub(super) poster: Option<HostPoster>,
}

pub(super) type DevState = crate::ring::failure::RingState<DevLinks>;

/// Device memory a communicator keeps: its address, its bytes, its owner (which frees it).
type Kept = (DevPtr, usize, Box<dyn Any + Send>);

impl<S: Stream> DeviceComm<S> {
    /// Connect the ring for `stream`'s buffers. Every rank of `comm` must call this together.
    pub fn new(comm: &Communicator, stream: S) -> Result<DeviceComm<S>> {
        let (rank, size) = (comm.rank(), comm.size());
        let gpu = stream.identity().is_some();
        let mut core = Core {
            stream,
            flight: Recorder::new(comm.config(), comm.next_device_name(), &[]),
            abort: AbortFlag::default(),
            cfg: comm.config().clone(),
            rank,
            size,
            edges: Vec::new(),
            direct_why: None,
            staged_fallback: false,
            shm_room: 0,
            one_device: true,
            staging: comm.config().staging.resolve(1, gpu),
            state: Mutex::new(DevState::new(None)),
            send_copy: Mutex::new(None),
            host: (size > 1).then(|| comm.host_peers()),
            infos: Vec::new(),
            pairs: Mutex::new(BTreeMap::new()),
            poster: (size > 1).then(|| {
                comm.host_peers()
                    .poster(format!("ringzero-device-connect-{rank}"))
            }),
        };
        if size > 1 {
            core.connect(comm)?;
            core.flight.set_edges(&core.edges);
        }
        Ok(DeviceComm {
            core: Arc::new(core),
            worker: Worker::new(format!("ringzero-device-proxy-{rank}")),
        })
    }

    /// This rank's two device edges (receive edge first), with the transport and why.
    pub fn edges(&self) -> &[Edge] {
        &self.core.edges
    }

    /// Why this communicator's all-reduces, reduce-scatters, all-gathers, broadcasts and reduces
    /// run directly (every rank reads and writes the others' buffers; `RINGZERO_DEVICE_ALGO`),
    /// or `None` where they go round the ring like every other collective.
    pub fn direct(&self) -> Option<&str> {
        self.core.direct_why.as_deref()
    }

    /// Whether every rank's buffers are in one device's memory — one GPU all ranks share, or a
    /// host stream whose ranks are threads of one process — so that every byte any rank reads
    /// or writes shares that memory's bandwidth (what a benchmark's bound must assume). A
    /// one-rank communicator is on one device.
    pub fn one_device(&self) -> bool {
        self.core.one_device
    }

    /// How this rank's host-staging links move bytes between its device and their pinned slots
    /// ([`StagingMode::Mapped`] or [`StagingMode::Copy`], never `Auto`), and why: `auto` picks
    /// by how many ranks use this rank's GPU ([`StagingMode::resolve`]). Each rank picks for
    /// itself; the slots are the same either way. It matters only where an edge is staged.
    pub fn staging(&self) -> (StagingMode, &str) {
        (self.core.staging.0, &self.core.staging.1)
    }

    /// Bytes of one slice on the device ring's edges (and of each of their slots): every rank's
    /// figure is the same ([`Config::device_slice_bytes`](crate::Config::device_slice_bytes), or
    /// the stream's choice).
    pub fn slice_bytes(&self) -> usize {
        self.core.slot_bytes()
    }

    /// Payload bytes this rank's device links have moved, the ring's and every point-to-point
    /// pair's (read between calls: waits for an asynchronous call in progress).
    pub fn counters(&self) -> Counters {
        let st = self.core.lock();
        let ring = st.links.as_ref().map(|l| l.counters).unwrap_or_default();
        self.core.pair_counters() + ring
    }

    /// The flight recorder's record of this communicator's last calls: see
    /// [`Communicator::flight_record`]. Its `comm` is `device` for the first device communicator
    /// created on a communicator, then `device1`, `device2`, ...
    pub fn flight_record(&self) -> FlightRecord {
        self.core.flight.snapshot()
    }

    /// Abort from any thread, as [`Communicator::abort`] does: the call in progress (blocking, or
    /// on the proxy thread) fails within a few tens of milliseconds once its queued device work
    /// has drained, both neighbours are told, and every later call fails. Returns once the
    /// neighbours have been told.
    pub fn abort(&self, reason: &str) {
        self.core.abort(reason);
    }

    /// A handle that aborts this communicator as [`DeviceComm::abort`] does, from a thread that
    /// cannot borrow it: the blocking calls hold `&mut self` while they run, so a watchdog takes
    /// a handle first.
    pub fn abort_handle(&self) -> AbortHandle
    where
        S: 'static,
    {
        let core = Arc::downgrade(&self.core);
        AbortHandle::new(move |reason| {
            if let Some(c) = core.upgrade() {
                c.abort(reason)
            }
        })
    }

    /// The deadline every wait of this communicator has (`RINGZERO_TIMEOUT`).
    pub fn timeout(&self) -> std::time::Duration {
        self.core.cfg.timeout
    }

    /// The stream (device) the buffers live on.
    pub fn stream(&self) -> &S {
        &self.core.stream
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.core.rank
    }

    /// Ranks.
    pub fn size(&self) -> usize {
        self.core.size
    }

    /// The range of elements rank `rank()` owns in a reduce-scatter of `count`.
    pub fn chunk_range(&self, count: usize) -> Range<usize> {
        chunk(count, self.core.size, self.core.rank)
    }

    /// Run `coll` on raw device buffers, after the asynchronous calls submitted before it.
    ///
    /// # Safety
    /// The addresses in `bufs` must be memory of this communicator's device, of the lengths
    /// given, not used by anything else until this returns.
    pub unsafe fn run_raw(
        &mut self,
        coll: Collective,
        dtype: DType,
        op: ReduceOp,
        count: usize,
        bufs: DevBufs,
    ) -> Result<()> {
        if matches!(coll, Collective::ReduceScatterV | Collective::AllGatherV) {
            return Err(super::v_needs_counts(coll));
        }
        // SAFETY: forwarded from the caller.
        unsafe { self.run_counted(coll, dtype, op, count.into(), bufs) }
    }

    /// [`DeviceComm::run_raw`] with a count that may give each rank's part.
    ///
    /// # Safety
    /// As for [`DeviceComm::run_raw`].
    pub(super) unsafe fn run_counted(
        &mut self,
        coll: Collective,
        dtype: DType,
        op: ReduceOp,
        count: Count,
        bufs: DevBufs,
    ) -> Result<()> {
        self.worker.wait_idle();
        // SAFETY: forwarded from the caller.
        unsafe { self.core.execute(coll, dtype, op, count, bufs) }
    }

    /// The state the calling thread and the proxy thread share.
    pub(super) fn core(&self) -> &Core<S> {
        &self.core
    }

    /// The same, to move to the proxy thread.
    pub(super) fn core_arc(&self) -> Arc<Core<S>> {
        self.core.clone()
    }

    /// The proxy thread's queue.
    pub(super) fn worker(&self) -> &Worker<super::posted::DevPosted> {
        &self.worker
    }

    /// Wait until the asynchronous calls submitted so far have run.
    pub(super) fn wait_async(&self) {
        self.worker.wait_idle();
    }

    /// Queue `f` for the proxy thread.
    pub(super) fn submit<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Core<S>) -> Result<R> + Send + 'static,
    ) -> Work<R>
    where
        S: 'static,
    {
        let core = self.core.clone();
        self.worker.submit(move || f(&core))
    }
}

impl<S: Stream> Drop for DeviceComm<S> {
    fn drop(&mut self) {
        // The queued asynchronous calls finish first (each within the engine's deadlines).
        self.worker.stop();
        self.core.flight.closed();
    }
}

impl<S: Stream> Core<S> {
    pub(super) fn abort(&self, reason: &str) {
        crate::ring::failure::abort(&self.state, &self.abort, self.rank, reason, &self.flight);
        self.tell_pairs(&format!("rank {}: {reason}", self.rank));
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, DevState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn connect(&mut self, comm: &Communicator) -> Result<()> {
        let (rank, size) = (self.rank, self.size);
        let prev = (rank + size - 1) % size;
        let next = (rank + 1) % size;
        // 1. Who is on which device.
        let me = DeviceInfo {
            uuid: self.stream.identity().unwrap_or([0; 16]),
            has_uuid: self.stream.identity().is_some() as u32,
            pid: std::process::id(),
            name: text(&self.stream.name()),
            shm_free: rustix::fs::statvfs(&self.cfg.shm_dir)
                .map(|s| s.f_bavail.saturating_mul(s.f_frsize))
                .unwrap_or(0),
        };
        let infos: Vec<DeviceInfo> = comm.all_gather_records(&me)?;
        self.shm_room = infos.iter().map(|i| i.shm_free).min().unwrap_or(0);
        // On my device: the same GPU, or for the host stream the same process.
        let mine = |i: &&DeviceInfo| {
            i.has_uuid == me.has_uuid
                && if me.has_uuid == 1 {
                    i.uuid == me.uuid
                } else {
                    i.pid == me.pid
                }
        };
        let sharers = infos.iter().filter(mine).count();
        self.one_device = sharers == infos.len();
        self.staging = self.cfg.staging.resolve(sharers, me.has_uuid == 1);
        let host_edges = comm.edges();
        let host_recv = host_edges
            .iter()
            .find(|e| e.to == rank && e.from == prev)
            .cloned()
            .ok_or_else(|| Error::Protocol {
                peer: format!("rank {prev}"),
                detail: "the host communicator has no edge from it".into(),
            })?;
        let peer = self.device_peer(&me, &infos[prev], host_recv);
        self.infos = infos.clone();
        let mut recv_edge = topology::choose_device(&self.cfg, &peer)?;
        // 2–4, at most twice: a failed cuda_ipc probe rebuilds that edge as host staging.
        const ROUNDS: u64 = 2;
        for round in 0..ROUNDS {
            let (links, (send_kind, send_sockets)) = self.build(comm, &recv_edge, prev, next)?;
            let mut links = links;
            let finding = self.probe(&mut links, round)?;
            let all = comm.all_gather_bytes(&finding.record())?;
            let code = |r: usize| all[r * FINDING_BYTES];
            let finding_of =
                |r: usize| untext(&all[r * FINDING_BYTES + 1..(r + 1) * FINDING_BYTES]);
            if let Some(r) = (0..size).find(|&r| code(r) == 2) {
                if matches!(finding, Probe::Stuck(_)) {
                    // The stuck copy may still write into the next rank's slots through these
                    // mappings: they stay open.
                    std::mem::forget(links);
                }
                return Err(Error::Protocol {
                    peer: format!("rank {r}"),
                    detail: format!(
                        "device set-up failed, no transport can be rebuilt: {}",
                        finding_of(r)
                    ),
                });
            }
            let failed = |r: usize| code(r) == 1;
            let send_edge = Edge {
                from: rank,
                to: next,
                kind: send_kind,
                reason: String::new(),
                sockets: send_sockets,
            };
            if (0..size).all(|r| !failed(r)) {
                if recv_edge.kind == TransportKind::Shm {
                    recv_edge.reason += &format!(
                        "; {} ({})",
                        match self.staging.0 {
                            StagingMode::Copy => "explicit copies through device scratch",
                            _ => "kernels read and write the mapped slots",
                        },
                        self.staging.1
                    );
                }
                // Learn the reason the next rank gave for our send edge.
                let reasons = comm.all_gather_bytes(&text::<FINDING_BYTES>(&recv_edge.reason))?;
                let their_reason =
                    untext(&reasons[next * FINDING_BYTES..(next + 1) * FINDING_BYTES]);
                let send_edge = Edge {
                    reason: their_reason,
                    ..send_edge
                };
                for e in [&recv_edge, &send_edge] {
                    tracing::info!(target: "ringzero::topology", rank, "device edge {e}");
                }
                self.edges = vec![recv_edge, send_edge];
                links.direct = self.direct_setup(comm, &infos)?;
                self.state
                    .get_mut()
                    .unwrap_or_else(|p| p.into_inner())
                    .links = Some(links);
                return Ok(());
            }
            drop(links);
            // Every rank saw the same findings: all slice alike on the rebuilt links.
            self.staged_fallback = true;
            let finding_text = finding_of(rank);
            recv_edge = topology::after_probe(
                &self.cfg,
                recv_edge,
                failed(rank).then_some(finding_text.as_str()),
            )?;
            if let Some(r) = (0..size).find(|&r| failed(r) && round + 1 == ROUNDS) {
                return Err(Error::Protocol {
                    peer: format!("rank {r}"),
                    detail: "device edges failed their start-up probe twice".into(),
                });
            }
        }
        Err(Error::Protocol {
            peer: format!("rank {prev}"),
            detail: "device edges failed their start-up probe twice".into(),
        })
    }

    /// What this rank (`me`) knows of the rank `p` whose device frames reach it, with the host
    /// communicator's edge between the two.
    pub(super) fn device_peer(
        &self,
        me: &DeviceInfo,
        p: &DeviceInfo,
        host_edge: Edge,
    ) -> DevicePeer {
        let same_gpu = me.has_uuid == 1 && p.has_uuid == 1 && me.uuid == p.uuid;
        let peer_access = if me.has_uuid == 0 || p.has_uuid == 0 {
            Err(format!(
                "{} and {} are not both GPUs",
                untext(&me.name),
                untext(&p.name)
            ))
        } else if same_gpu {
            Ok(true)
        } else {
            self.stream.can_access_peer(&p.uuid)
        };
        DevicePeer {
            host_edge,
            mine: untext(&me.name),
            theirs: untext(&p.name),
            same_gpu,
            peer_access,
            mps: same_gpu.then(topology::mps_control).flatten(),
        }
    }

    /// Decide whether this communicator's all-reduces, reduce-scatters, all-gathers, broadcasts and reduces run
    /// directly ([`super::direct`]) and, if so, set up the node board: rank 0 creates it, every
    /// rank maps it, rank 0 unlinks it. Every rank comes to the same answer from the same
    /// all-gathered records.
    fn direct_setup(
        &mut self,
        comm: &Communicator,
        infos: &[DeviceInfo],
    ) -> Result<Option<super::direct::Direct>> {
        use crate::config::DeviceAlgo;
        use crate::transport::board::Board;
        let (rank, size) = (self.rank, self.size);
        let algo = self.cfg.device_algo;
        if algo == DeviceAlgo::Ring {
            return Ok(None);
        }
        // Whom this rank can map: a rank of another process on the same GPU or on a GPU it has
        // peer access to (CUDA IPC opens no handle of its own process), or (host stream) a rank
        // of this process.
        let me = &infos[rank];
        let mut reach = [0u8; 64];
        for (q, o) in infos.iter().enumerate().take(64) {
            let ok = match (me.has_uuid, o.has_uuid) {
                (1, 1) => {
                    q == rank
                        || (me.pid != o.pid
                            && (me.uuid == o.uuid
                                || self.stream.can_access_peer(&o.uuid) == Ok(true)))
                }
                (0, 0) => me.pid == o.pid,
                _ => false,
            };
            reach[q] = ok as u8;
        }
        let node = {
            use sha2::Digest;
            let h = sha2::Sha256::digest(self.cfg.node_id.as_bytes());
            let mut b = [0u8; 32];
            b.copy_from_slice(&h);
            b
        };
        // A GPU's receive edge must have stayed cuda_ipc: one the start-up probe rebuilt as host
        // staging found peer copies broken, and the direct step is peer copies too.
        let ipc_ok = me.has_uuid == 0 || self.edges[0].kind == TransportKind::CudaIpc;
        let mut rec = [0u8; 97];
        rec[..32].copy_from_slice(&node);
        rec[32..96].copy_from_slice(&reach);
        rec[96] = ipc_ok as u8;
        let all = comm.all_gather_bytes(&rec)?;
        let of = |r: usize| &all[r * 97..(r + 1) * 97];
        let why_not = if size > super::stream::GATHER_MAX {
            Some(format!(
                "{size} ranks; the direct step takes at most {}",
                super::stream::GATHER_MAX
            ))
        } else if self.cfg.p2p_disable {
            Some("RINGZERO_P2P_DISABLE=1 forbids peer access".into())
        } else if let Some(r) = (0..size).find(|&r| of(r)[..32] != node[..]) {
            Some(format!("rank {r} is on another node"))
        } else if let Some(r) = (0..size).find(|&r| of(r)[96] == 0) {
            Some(format!(
                "rank {r}'s edge from rank {} is not cuda_ipc (peer copies failed its start-up \
                 probe or are not possible)",
                (r + size - 1) % size
            ))
        } else {
            (0..size)
                .flat_map(|r| (0..size).map(move |q| (r, q)))
                .find(|&(r, q)| of(r)[32 + q] == 0)
                .map(|(r, q)| {
                    format!(
                        "rank {r} ({}) cannot map rank {q}'s ({}) memory",
                        untext(&infos[r].name),
                        untext(&infos[q].name)
                    )
                })
        };
        let one_gpu = infos
            .iter()
            .all(|i| i.has_uuid == 1 && i.uuid == infos[0].uuid);
        let why = match (algo, why_not) {
            (DeviceAlgo::Direct, Some(w)) => {
                return Err(Error::config(
                    "RINGZERO_DEVICE_ALGO",
                    format!("`direct` needs every rank to map every other rank's buffers: {w}"),
                ))
            }
            (_, Some(_)) => return Ok(None),
            (DeviceAlgo::Auto, None) if !one_gpu => return Ok(None),
            (DeviceAlgo::Auto, None) => format!(
                "direct: all {size} ranks share {}, so each reduces its chunk of every rank's \
                 input and writes it into every output in one pass (RINGZERO_DEVICE_ALGO=ring \
                 for the slot ring)",
                untext(&me.name)
            ),
            (_, None) => format!(
                "direct (RINGZERO_DEVICE_ALGO=direct): every rank maps every other rank's \
                 buffers ({})",
                untext(&me.name)
            ),
        };
        let mut board = if rank == 0 {
            let name = crate::connect::segment_name(&self.cfg, 0, 0, "board");
            let b = Board::create(&self.cfg.shm_dir, &name, size, rank)?;
            comm.all_gather_bytes(&path_text(b.path())?)?;
            b
        } else {
            let paths = comm.all_gather_bytes(&[0u8; 128])?;
            let path = untext(&paths[..128]);
            Board::attach(std::path::Path::new(&path), size, rank)?
        };
        // Every rank has mapped it.
        comm.all_gather_bytes(&[1u8])?;
        board.unlink();
        tracing::info!(target: "ringzero::topology", rank, "device collectives: {why}");
        self.direct_why = Some(why);
        Ok(Some(super::direct::Direct::new(board, rank, size)))
    }

    /// Bytes of one slot of this rank's device edges: the configured device slice, else the
    /// stream's choice (capped as for host staging when P2P is disabled or some edge fell back
    /// to it: [`crate::config::staged_slice_bytes`]), else the host slice; rounded up to 64 bytes.
    /// Every rank must come to the same figure (their plans slice alike), so it depends on the
    /// configuration, the kind of device and what was all-gathered (probe findings, the least
    /// free shm space) only, never on one edge's transport.
    pub(super) fn slot_bytes(&self) -> usize {
        let staged = crate::config::staged_slice_bytes(self.shm_room, self.size, self.cfg.slots);
        self.cfg
            .device_slice_bytes
            .or_else(|| {
                let b = self.stream.slice_bytes()?;
                Some(if self.cfg.p2p_disable || self.staged_fallback {
                    b.min(staged)
                } else {
                    b
                })
            })
            .unwrap_or(self.cfg.slice_bytes)
            .next_multiple_of(64)
    }

    /// Create this rank's receive FIFO for `recv_edge`, exchange connect infos, attach to the next
    /// rank's FIFO. Returns the links and the send edge's kind and tcp connections.
    fn build(
        &self,
        comm: &Communicator,
        recv_edge: &Edge,
        prev: usize,
        next: usize,
    ) -> Result<(DevLinks, (TransportKind, usize))> {
        let name = crate::connect::segment_name(&self.cfg, prev, self.rank, "dev");
        let (rx, info) = self.open_rx(comm.data_ip(), recv_edge, prev, &name)?;
        let all: Vec<ConnectInfo> = comm.all_gather_records(&info)?;
        self.join(rx, prev, (&all[next], next))
    }

    /// This rank's receive FIFO from `from` for `recv_edge` (shm segment `name`), or for a tcp
    /// edge a listener on `ip`; and how the sender attaches to it.
    pub(super) fn open_rx(
        &self,
        ip: Option<std::net::IpAddr>,
        recv_edge: &Edge,
        from: usize,
        name: &str,
    ) -> Result<(Rx, ConnectInfo)> {
        let cfg = &self.cfg;
        let (slots, slot_bytes) = (cfg.slots, self.slot_bytes());
        let mut info = ConnectInfo::zeroed();
        info.slots = slots as u32;
        info.slot_bytes = slot_bytes as u64;
        info.kind = kind_code(recv_edge.kind);
        info.sockets = recv_edge.sockets as u32;
        let rx = match recv_edge.kind {
            TransportKind::Shm => {
                let ctl = ShmRecv::create(&cfg.shm_dir, name, slots, slot_bytes, from)?;
                let (map, len) = ctl.mapping();
                let slot0 = ctl.slot_addr(0).expect("data segment");
                // SAFETY: the mapping lives in `ctl`; the FifoRecv drops `keep` (the registration)
                // before `ctl`.
                let (dev, keep) = unsafe { self.stream.map_host(map, len.next_multiple_of(4096)) }
                    .map_err(dev_err("mapping the shm staging slots into the device"))?;
                info.path = path_text(ctl.path())?;
                let base = dev + (slot0 as usize - map as usize) as u64;
                Rx::Ready(Box::new(
                    FifoRecv::new(ctl, TransportKind::Shm, base, keep)
                        .with_scratch(self.staging_scratch(slots * slot_bytes)?),
                ))
            }
            TransportKind::CudaIpc => {
                let (base, handle, keep) = self
                    .stream
                    .export(slots * slot_bytes)
                    .map_err(dev_err("allocating the device slots"))?;
                let ctl = ShmRecv::create_control(&cfg.shm_dir, name, slots, slot_bytes, from)?;
                info.ipc = handle;
                info.path = path_text(ctl.path())?;
                Rx::Ready(Box::new(FifoRecv::new(
                    ctl,
                    TransportKind::CudaIpc,
                    base,
                    keep,
                )))
            }
            TransportKind::Tcp => {
                // A connection of its own (the host communicator's carries host frames), on the
                // address the host data connections use.
                let ip = ip.ok_or_else(|| Error::Protocol {
                    peer: format!("rank {from}"),
                    detail: "a tcp device edge without a host data address".into(),
                })?;
                let l = std::net::TcpListener::bind((ip, 0))
                    .map_err(|e| Error::io(format!("binding a device data listener on {ip}"), e))?;
                let addr = l
                    .local_addr()
                    .map_err(|e| Error::io("device data listener address", e))?;
                info.path = text(&addr.to_string());
                // Accepting starts now, on a thread of its own, so that the sender's connect
                // completes whenever it comes, whatever this rank is doing meanwhile (a posted
                // session connecting several pairs never waits on a peer's turn). The sender
                // comes once the connect infos are traded, which may take most of a deadline of
                // its own (a set-up all-gather waits on the slowest rank's progress), so the
                // thread gives up after two deadlines; whoever waits for it ([`Core::finish_rx`])
                // keeps its own.
                let (secret, job_id, rank) = (cfg.secret.clone(), cfg.job_id.clone(), self.rank);
                let (sockets, timeout) = (recv_edge.sockets, cfg.timeout.saturating_mul(2));
                let accept = std::thread::Builder::new()
                    .name(format!("ringzero-accept-{rank}-{from}"))
                    .spawn(move || -> Result<tcp::TcpRecv> {
                        let me = crate::bootstrap::Identity {
                            secret: &secret,
                            job_id: &job_id,
                            rank: rank as u32,
                        };
                        let wires = tcp::accept_wires(&l, &me, from, sockets, timeout)?;
                        tcp::TcpRecv::over(wires, from, slots, slot_bytes)
                    })
                    .map_err(|e| Error::io("starting a device data accept thread", e))?;
                Rx::Accepting(accept)
            }
        };
        Ok((rx, info))
    }

    /// Attach to the receive FIFO of `to` that `theirs` describes, then finish `rx` (a tcp
    /// edge's accept, running since [`Core::open_rx`]): the links, and the send edge's kind and
    /// tcp connections. Neither step waits on the peer's turn: its FIFO exists (or its accept
    /// runs) since it sent `theirs`.
    pub(super) fn join(
        &self,
        rx: Rx,
        from: usize,
        (theirs, to): (&ConnectInfo, usize),
    ) -> Result<(DevLinks, (TransportKind, usize))> {
        let (tx, kind) = self.attach_to(theirs, to)?;
        let rx = self.finish_rx(rx, from)?;
        Ok((
            self.links(tx, rx, from, to),
            (kind, sent_sockets(theirs, kind)),
        ))
    }

    /// Attach to the receive FIFO of `to` that `theirs` describes (for tcp, connect to its
    /// accepting listener): the send link and its transport.
    pub(super) fn attach_to(&self, theirs: &ConnectInfo, to: usize) -> Result<SendSide> {
        let path = std::path::PathBuf::from(untext(&theirs.path));
        let (t_slots, t_bytes) = (theirs.slots as usize, theirs.slot_bytes as usize);
        let me = crate::bootstrap::Identity {
            secret: &self.cfg.secret,
            job_id: &self.cfg.job_id,
            rank: self.rank as u32,
        };
        self.attach(theirs, &path, t_slots, t_bytes, to, &me)
    }

    /// The receive link of `rx`, waiting for a tcp edge's accept to end (within the deadline
    /// its thread keeps).
    pub(super) fn finish_rx(&self, rx: Rx, from: usize) -> Result<Box<dyn DevRecvLink>> {
        let h = match rx {
            Rx::Ready(r) => return Ok(r),
            Rx::Accepting(h) => h,
        };
        let (until, mut waiter) = (
            Deadline::after(Instant::now(), self.cfg.timeout),
            Waiter::backoff(),
        );
        while !h.is_finished() {
            if until.passed(Instant::now()) {
                return Err(Error::Timeout {
                    op: "device set-up".into(),
                    seq: 0,
                    peer: from,
                    waiting: format!("rank {from} to connect its device tcp link to this rank"),
                    after: self.cfg.timeout,
                });
            }
            waiter.idle(self.cfg.timeout);
        }
        let mut t = h.join().map_err(|_| Error::Io {
            context: "accepting a device data connection".into(),
            detail: "accept thread panicked".into(),
        })??;
        let (ptr, len, stride) = t.staging();
        // SAFETY: the staging is an anonymous mapping owned by `t`, which the TcpDevRecv keeps
        // (and drops after `keep`); moving `t` does not move it.
        let (dev, keep) = unsafe { self.stream.map_host(ptr, len) }
            .map_err(dev_err("mapping the tcp receive slots into the device"))?;
        Ok(Box::new(TcpDevRecv::new(t, dev, stride, keep)))
    }

    /// The links of a pair of FIFO ends: `tx` to `to`, `rx` from `from`.
    pub(super) fn links(
        &self,
        tx: Box<dyn DevSendLink>,
        rx: Box<dyn DevRecvLink>,
        from: usize,
        to: usize,
    ) -> DevLinks {
        DevLinks {
            tx,
            rx,
            next: to,
            prev: from,
            counters: Counters::default(),
            direct: None,
            pair_copies: self.cfg.device_copy_pairs,
        }
    }

    /// Device scratch of `bytes` for a host-staging link where this rank stages by explicit
    /// copies ([`DeviceComm::staging`]).
    fn staging_scratch(&self, bytes: usize) -> Result<Option<(DevPtr, Box<dyn Any + Send>)>> {
        if self.staging.0 != StagingMode::Copy {
            return Ok(None);
        }
        self.stream.scratch(bytes).map(Some).map_err(dev_err(
            "allocating device scratch for explicit-copy staging",
        ))
    }

    /// Attach to the next rank's receive FIFO (or connect to it) as `theirs` describes.
    fn attach(
        &self,
        theirs: &ConnectInfo,
        path: &std::path::Path,
        t_slots: usize,
        t_bytes: usize,
        next: usize,
        me: &crate::bootstrap::Identity<'_>,
    ) -> Result<SendSide> {
        Ok(match theirs.kind {
            1 => {
                let ctl = ShmSend::attach(path, t_slots, t_bytes, next)?;
                let (map, len) = ctl.mapping();
                let slot0 = ctl.slot_addr(0).expect("data segment");
                // SAFETY: as for the receiver: the FifoSend drops `keep` before `ctl`.
                let (dev, keep) = unsafe { self.stream.map_host(map, len.next_multiple_of(4096)) }
                    .map_err(dev_err(
                        "mapping the peer's shm staging slots into the device",
                    ))?;
                let base = dev + (slot0 as usize - map as usize) as u64;
                let fifo = FifoSend::new(ctl, TransportKind::Shm, base, keep)
                    .with_scratch(self.staging_scratch(t_slots * t_bytes)?);
                (Box::new(fifo), TransportKind::Shm)
            }
            3 => {
                let ctl = ShmSend::attach_control(path, t_slots, t_bytes, next)?;
                let (base, keep) = self
                    .stream
                    .open_exported(&theirs.ipc, t_slots * t_bytes)
                    .map_err(dev_err(&format!("opening rank {next}'s device slots")))?;
                (
                    Box::new(FifoSend::new(ctl, TransportKind::CudaIpc, base, keep)),
                    TransportKind::CudaIpc,
                )
            }
            2 => {
                let addr: std::net::SocketAddr =
                    path.to_string_lossy()
                        .parse()
                        .map_err(|_| Error::Protocol {
                            peer: format!("rank {next}"),
                            detail: format!("bad device data address `{}`", path.display()),
                        })?;
                let k = theirs.sockets as usize;
                if !(1..=crate::config::MAX_TCP_SOCKETS).contains(&k) {
                    return Err(Error::Protocol {
                        peer: format!("rank {next}"),
                        detail: format!("{k} tcp connections asked for its device edge"),
                    });
                }
                let wires = tcp::connect_wires(addr, me, next, k, self.cfg.timeout)?;
                let mut t = tcp::TcpSend::over(wires, next, t_slots, t_bytes)?;
                let (ptr, len, stride) = t.staging();
                // SAFETY: the staging is an anonymous mapping owned by `t`, which the TcpDevSend
                // keeps (and drops after `keep`); moving `t` does not move it.
                let (dev, keep) = unsafe { self.stream.map_host(ptr, len) }
                    .map_err(dev_err("mapping the tcp send staging into the device"))?;
                (
                    Box::new(TcpDevSend::new(t, dev, stride, keep)),
                    TransportKind::Tcp,
                )
            }
            k => {
                return Err(Error::Protocol {
                    peer: format!("rank {next}"),
                    detail: format!("unknown device transport code {k}"),
                })
            }
        })
    }

    /// Send a pattern to the next rank, check the one from the previous rank.
    fn probe(&self, links: &mut DevLinks, round: u64) -> Result<Probe> {
        let len = PROBE_BYTES.min(links.tx.slot_bytes());
        let fp = Fingerprint::new(Collective::Barrier, None, None, len);
        let seq = u64::MAX - round;
        let what = "device probe";
        let deadline = PROBE_DEADLINE.min(self.cfg.timeout);
        let until = Deadline::after(Instant::now(), deadline);
        let slot = loop {
            if let Some(a) = links.tx.reserve().map_err(|e| {
                crate::ring::engine::link_err(e, what, seq, links.next, self.rank, None)
            })? {
                break a;
            }
            if until.passed(Instant::now()) {
                return Err(Error::Timeout {
                    op: what.into(),
                    seq,
                    peer: links.next,
                    waiting: "a free slot for the probe".into(),
                    after: deadline,
                });
            }
            std::thread::yield_now();
        };
        // The pattern goes through the device queue like any slice (a copy from page-locked host
        // memory into the slot), so a peer write that never completes is seen here within the
        // deadline instead of hanging set-up in a synchronous copy.
        let mut src = memmap2::MmapMut::map_anon(len)
            .map_err(|e| Error::io("allocating the probe pattern", e))?;
        src.copy_from_slice(&probe_pattern(self.rank, len));
        let to = format!("copying the probe into rank {}'s slot", links.next);
        // SAFETY: an anonymous mapping is whole pages, so rounding `len` up to a page stays
        // inside it; `src` outlives the registration `keep` (both dropped below, or leaked
        // together if the copy never completes).
        let (src_dev, keep) = unsafe {
            self.stream
                .map_host(src.as_mut_ptr(), len.next_multiple_of(4096))
        }
        .map_err(dev_err(&to))?;
        // SAFETY: `slot` is a reserved slot of `slot_bytes ≥ len` bytes at the next rank, and
        // `src_dev` the `len` registered bytes of `src`, both live until the copy completes.
        unsafe { self.stream.copy(slot, src_dev, len) }.map_err(dev_err(&to))?;
        let copied = self.stream.mark().map_err(dev_err(&to))?;
        let (copy_until, mut wait) = (Deadline::after(Instant::now(), deadline), Waiter::backoff());
        while !self.stream.done(&copied).map_err(dev_err(&to))? {
            if copy_until.passed(Instant::now()) {
                // The copy may still write (and read `src`) whenever the device gets to it:
                // keep everything it touches.
                std::mem::forget((keep, src));
                return Ok(Probe::Stuck(format!(
                    "rank {}'s copy of its probe into rank {}'s slot did not complete within \
                     {:.1}s (a peer path that hangs: run `ringzero diag`; RINGZERO_P2P_DISABLE=1 \
                     avoids it)",
                    self.rank,
                    links.next,
                    deadline.as_secs_f64()
                )));
            }
            wait.idle(deadline);
        }
        drop((keep, src));
        links
            .tx
            .post(&FrameHeader::data(seq, 0, 0, fp, len))
            .map_err(|e| {
                crate::ring::engine::link_err(e, what, seq, links.next, self.rank, None)
            })?;
        let expect = Expect {
            seq,
            step: 0,
            slice: 0,
            fp,
            len,
        };
        let until = Deadline::after(Instant::now(), deadline);
        let tx_err = |e, next| crate::ring::engine::link_err(e, what, seq, next, self.rank, None);
        let incoming = loop {
            links.tx.progress().map_err(|e| tx_err(e, links.next))?;
            if let Some(a) = links.rx.peek(&expect).map_err(|e| {
                crate::ring::engine::link_err(e, what, seq, links.prev, self.rank, None)
            })? {
                break a;
            }
            if until.passed(Instant::now()) {
                return Ok(Probe::Failed(format!(
                    "no probe frame from rank {} within {:.1}s",
                    links.prev,
                    deadline.as_secs_f64()
                )));
            }
            std::thread::yield_now();
        };
        let mut seen = vec![0u8; len];
        // SAFETY: `incoming` is the held slot of a frame of `len` bytes.
        unsafe { self.stream.read(&mut seen, incoming) }.map_err(|e| Error::Device {
            context: format!("reading rank {}'s probe", links.prev),
            source: e,
        })?;
        links.rx.consume();
        links.rx.release().map_err(|e| {
            crate::ring::engine::link_err(e, what, seq, links.prev, self.rank, None)
        })?;
        // Our own probe must have left (tcp) before the finding is all-gathered.
        while !links.tx.flushed() {
            links.tx.progress().map_err(|e| tx_err(e, links.next))?;
            if until.passed(Instant::now()) {
                return Err(Error::Timeout {
                    op: what.into(),
                    seq,
                    peer: links.next,
                    waiting: format!("rank {} to read the probe", links.next),
                    after: deadline,
                });
            }
            std::thread::yield_now();
        }
        Ok(match judge_probe(&probe_pattern(links.prev, len), &seen) {
            Some(f) => Probe::Failed(f),
            None => Probe::Passed,
        })
    }

    /// Run `coll` on raw device buffers (the body of [`DeviceComm::run_raw`], on whichever thread
    /// drives it).
    ///
    /// # Safety
    /// As for [`DeviceComm::run_raw`].
    pub(super) unsafe fn execute(
        &self,
        coll: Collective,
        dtype: DType,
        op: ReduceOp,
        count: Count,
        bufs: DevBufs,
    ) -> Result<()> {
        super::device_form(coll, count.total, self.size)?;
        if coll == Collective::AllToAll
            && self.size > 2
            && self.host.as_ref().is_some_and(|h| h.nodes() > 1)
        {
            // SAFETY: forwarded from the caller.
            return unsafe { self.all_to_all_by_pairs(dtype, count.total, bufs) };
        }
        // SAFETY: forwarded from the caller.
        unsafe { self.execute_any(coll, dtype, op, count, bufs) }
    }

    /// [`Core::execute`] once the call's form is checked: the direct step or the ring.
    ///
    /// # Safety
    /// As for [`DeviceComm::run_raw`].
    unsafe fn execute_any(
        &self,
        coll: Collective,
        dtype: DType,
        op: ReduceOp,
        count: Count,
        bufs: DevBufs,
    ) -> Result<()> {
        let fp = Fingerprint::new(coll, Some(dtype), Some(op), count.total);
        let fp = count.parts.map_or(fp, |c| fp.with_counts(c));
        // SAFETY: forwarded from the caller.
        unsafe { self.execute_as((fp, None), coll, dtype, op, count, bufs) }
    }

    /// The announcement of a collective over the pairs (all-to-all-v, gather, scatter, an
    /// all-to-all across nodes), fingerprinted `fp`: one empty frame to the next rank and one
    /// from the previous (the pairwise plan for no elements), which takes the call's sequence
    /// number, so a rank in another call meets it at once. It opens the call's flight entry
    /// (`bytes` its size), which stays open, counting the pairs' bytes too, until
    /// [`Core::end_announced`] closes it after the pairs have moved the data (closed at once if
    /// the announcement fails).
    pub(super) fn announce(&self, fp: Fingerprint, dtype: DType, bytes: u64) -> Result<()> {
        let none = DevBufs::One { buf: 0, bytes: 0 };
        let c = Collective::AllToAllV;
        // SAFETY: no buffer: an empty frame each way.
        unsafe { self.execute_as((fp, Some(bytes)), c, dtype, ReduceOp::Sum, 0.into(), none) }
    }

    /// Close the flight entry that [`Core::announce`] opened, with the call's result `r`.
    pub(super) fn end_announced(&self, r: &Result<()>) {
        let st = self.lock();
        let ring = st.links.as_ref().map(|l| l.counters).unwrap_or_default();
        self.flight.end(r, ring + self.pair_counters());
    }

    /// [`Core::execute_any`] with the frames and the flight entry fingerprinted `fp`; with
    /// `announced` (the call's size in bytes), the announcement of a call over the pairs, whose
    /// entry stays open on success ([`Core::announce`]).
    ///
    /// # Safety
    /// As for [`DeviceComm::run_raw`].
    unsafe fn execute_as(
        &self,
        (fp, announced): (Fingerprint, Option<u64>),
        coll: Collective,
        dtype: DType,
        op: ReduceOp,
        count: Count,
        bufs: DevBufs,
    ) -> Result<()> {
        let mut st = self.lock();
        let st = &mut *st;
        let seq = st.seq;
        crate::ring::failure::refuse(st.failed.as_ref(), &self.abort, &fp, seq)?;
        let slot_bytes = self.slot_bytes();
        let caller_in_place = matches!(bufs, DevBufs::One { .. });
        // An in-place all-to-all overwrites blocks before it has sent them (the ring and the
        // direct pulls alike): it sends from a copy.
        let (bufs, copied) = match bufs {
            DevBufs::One { buf, bytes } if coll == Collective::AllToAll && self.size > 1 => {
                // SAFETY: forwarded from the caller (`buf` holds `bytes`).
                match unsafe { self.copy_to_send(buf, bytes) } {
                    Ok(input) => {
                        let split = DevBufs::Split {
                            input,
                            input_bytes: bytes,
                            output: buf,
                            output_bytes: bytes,
                        };
                        (split, Ok(()))
                    }
                    Err(e) => (bufs, Err(e)),
                }
            }
            b => (b, Ok(())),
        };
        let in_place = matches!(bufs, DevBufs::One { .. });
        let p = plan(PlanArgs {
            coll,
            n: self.size,
            rank: self.rank,
            count: count.total,
            slice_elems: (slot_bytes / dtype.size()).max(1),
            in_place,
            counts: count.parts,
        });
        let call = Call {
            plan: &p,
            fp,
            seq,
            dtype,
            op,
            n: self.size,
            rank: self.rank,
            timeout: self.cfg.timeout,
            // The device engine's stores are device copies and kernels.
            stream_stores: false,
            abort: &self.abort,
            incoming: None,
        };
        device_engine::check_sizes(&call, &bufs)?;
        st.seq += 1;
        // An announced call's entry counts the pairs' bytes too (they move them).
        let counters = |st: &DevState| {
            let ring = st.links.as_ref().map(|l| l.counters).unwrap_or_default();
            match announced {
                Some(_) => ring + self.pair_counters(),
                None => ring,
            }
        };
        let bytes = announced.unwrap_or((count.total * dtype.size()) as u64);
        self.flight
            .begin(seq, &fp, caller_in_place, bytes, counters(st));
        let r = copied.and_then(|()| match st.links.as_mut() {
            Some(links) => {
                let direct = match links.direct.as_mut() {
                    // SAFETY: forwarded from the caller; the sizes were checked above.
                    Some(d) => unsafe { d.run(&self.stream, &call, coll, count.total, bufs) },
                    None => Ok(None),
                };
                match direct {
                    Ok(Some(bytes)) => {
                        links.counters.bytes_direct += bytes;
                        Ok(())
                    }
                    // SAFETY: forwarded from the caller.
                    Ok(None) => unsafe { device_engine::run(&self.stream, links, &call, bufs) },
                    Err(e) => Err(e),
                }
            }
            None => {
                // One rank: only the local copy of an out-of-place call.
                self.local_copy(&call, bufs)
            }
        });
        if announced.is_none() || r.is_err() {
            self.flight.end(&r, counters(st));
        }
        if let Err(e) = &r {
            self.fail(st, e);
        }
        r
    }

    /// Queue a copy of the `bytes` at `buf` into the kept send copy (grown when too small);
    /// its address. Called under the state lock, which keeps it this call's alone: every call
    /// that used it has completed its device work.
    ///
    /// # Safety
    /// `buf` holds `bytes` of memory of this communicator's device.
    pub(super) unsafe fn copy_to_send(&self, buf: DevPtr, bytes: usize) -> Result<DevPtr> {
        let mut kept = self.send_copy.lock().unwrap_or_else(|p| p.into_inner());
        if kept.as_ref().is_none_or(|k| k.1 < bytes) {
            // The old copy goes first: no queued work uses it (see above).
            *kept = None;
            let (addr, owner) = self.stream.scratch(bytes).map_err(dev_err(
                "allocating device memory for an in-place all-to-all's send copy",
            ))?;
            *kept = Some((addr, bytes, owner));
        }
        let addr = kept.as_ref().expect("kept above").0;
        // SAFETY: `addr` holds at least `bytes` of this device's memory that nothing else uses
        // (above); `buf` holds `bytes` by the caller's contract; they are distinct allocations.
        unsafe { self.stream.copy(addr, buf, bytes) }.map_err(dev_err(
            "copying an in-place all-to-all's buffer to send from",
        ))?;
        Ok(addr)
    }

    pub(super) fn local_copy(&self, call: &Call, bufs: DevBufs) -> Result<()> {
        let es = call.dtype.size();
        if let DevBufs::Split { input, output, .. } = bufs {
            for op in &call.plan.ops {
                if let (Some(l), Some(s)) = (&op.local, &op.store) {
                    let src = input
                        + ((l.range.start - crate::ring::engine::base(call.plan, l.buf)) * es)
                            as u64;
                    let dst = output
                        + ((s.range.start - crate::ring::engine::base(call.plan, s.buf)) * es)
                            as u64;
                    // SAFETY: both ranges lie inside the caller's buffers (checked sizes).
                    unsafe { self.stream.copy(dst, src, op.elems * es) }.map_err(|e| {
                        Error::Device {
                            context: call.fp.to_string(),
                            source: e,
                        }
                    })?;
                }
            }
            let m = self.stream.mark().map_err(|e| Error::Device {
                context: call.fp.to_string(),
                source: e,
            })?;
            // The copy writes the caller's output: at the deadline it ends first where that
            // memory would not outlive it.
            let at = (call.fp.to_string(), call.seq, self.rank);
            super::stream::wait_local(
                &self.stream,
                &m,
                call.timeout,
                (&at.0, at.1, at.2),
                "the local copy",
            )?;
        }
        Ok(())
    }
}

/// What a rank's start-up probe found.
enum Probe {
    /// Both directions passed.
    Passed,
    /// The receive edge delivered wrong data or nothing (the edge may be rebuilt).
    Failed(String),
    /// This rank's own probe copy never completed: its device queue is stuck behind it, so no
    /// edge can be rebuilt on it.
    Stuck(String),
}

impl Probe {
    /// Code and text, as all-gathered.
    fn record(&self) -> [u8; FINDING_BYTES] {
        let mut rec = [0u8; FINDING_BYTES];
        let (code, t) = match self {
            Probe::Passed => return rec,
            Probe::Failed(t) => (1, t),
            Probe::Stuck(t) => (2, t),
        };
        rec[0] = code;
        let t: [u8; FINDING_BYTES - 1] = text(t);
        rec[1..].copy_from_slice(&t);
        rec
    }
}

/// A send link and its transport.
type SendSide = (Box<dyn DevSendLink>, TransportKind);

/// A receive FIFO being set up: ready, or (tcp) waiting for the sender's connections.
pub(super) enum Rx {
    Ready(Box<dyn DevRecvLink>),
    /// The thread accepting the sender's tcp connections.
    Accepting(std::thread::JoinHandle<Result<tcp::TcpRecv>>),
}

impl Rx {
    /// Whether [`Core::finish_rx`] would return without waiting.
    pub(super) fn is_ready(&self) -> bool {
        match self {
            Rx::Ready(_) => true,
            Rx::Accepting(h) => h.is_finished(),
        }
    }
}

/// How many tcp connections a send edge of `kind` to the FIFO `theirs` describes has.
pub(super) fn sent_sockets(theirs: &ConnectInfo, kind: TransportKind) -> usize {
    match kind {
        TransportKind::Tcp => theirs.sockets as usize,
        _ => 0,
    }
}

fn dev_err(what: &str) -> impl Fn(ringzero_kernels::device::DeviceError) -> Error + '_ {
    move |e| Error::Device {
        context: what.to_string(),
        source: e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_patterns_have_no_zero_and_differ_between_ranks() {
        let a = probe_pattern(0, 4096);
        let b = probe_pattern(1, 4096);
        assert!(a.iter().all(|&x| x != 0) && b.iter().all(|&x| x != 0));
        assert_ne!(a, b);
        assert_eq!(judge_probe(&a, &a), None);
    }

    #[test]
    fn a_wrong_probe_names_the_first_bad_byte_and_what_was_seen() {
        let a = probe_pattern(3, 64);
        let mut seen = a.clone();
        seen[10..14].fill(0);
        let f = judge_probe(&a, &seen).unwrap();
        assert!(f.starts_with("wrong data: "), "{f}");
        assert!(f.contains("first at byte 10"), "{f}");
        assert!(f.contains("saw 00 00 00 00"), "{f}");
        let zeros = vec![0u8; 64];
        assert!(judge_probe(&a, &zeros)
            .unwrap()
            .contains("64 of 64 bytes differ"));
        assert!(judge_probe(&a, &a[..10])
            .unwrap()
            .contains("10 bytes arrived"));
    }
}
