//! [`DeviceComm`]: collectives on device buffers, set up through a host [`Communicator`]
//! (`setup.rs`), run on its core (`core.rs`) by the calling thread or the proxy thread.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};

use ringzero_kernels::{DType, ReduceOp};

use super::core::{Core, DevPosted, DevState};
use crate::comm::{AbortHandle, Communicator};
use crate::config::StagingMode;
use crate::error::Result;
use crate::flight::{FlightRecord, Recorder};
use crate::ring::device_engine::DevBufs;
use crate::ring::engine::Counters;
use crate::ring::failure::AbortFlag;
use crate::ring::{chunk, Collective, Count};
use crate::topology::Edge;
use crate::work::{Work, Worker};
use ringzero_kernels::device::Stream;

/// Collectives on buffers of one device per rank (see the module docs).
///
/// Blocking calls (`all_reduce(&send, &mut recv, op)`) drive the ring on the calling thread.
/// Asynchronous calls on owned buffers (`all_reduce_async(buf, op)`) return a [`Work`] at once
/// and are driven by the communicator's proxy thread, in the order submitted, while the caller
/// goes on (queueing its own kernels, for example); a blocking call waits for the asynchronous
/// ones submitted before it, so every rank sees the same order. Point-to-point calls queued one
/// after another are the exception: they are posted, each message moving as its link allows
/// ([`DeviceComm::send_async`](crate::NonBlocking::send_async)).
pub struct DeviceComm<S: Stream> {
    core: Arc<Core<S>>,
    worker: Worker<DevPosted>,
}

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
            held: AtomicUsize::new(0),
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

    /// Bytes of device memory this communicator holds: its links' slots in this rank's device
    /// memory (cuda_ipc: the receive edge's `slots × slice_bytes`, exported to the sender),
    /// explicit-copy staging's device scratch (one slot's worth per slot of each staged link),
    /// and the copy an in-place all-to-all sends from. Mapped host slots and other ranks'
    /// memory opened here are not this rank's allocations and are not counted.
    pub fn device_bytes(&self) -> usize {
        self.core.held.load(std::sync::atomic::Ordering::Relaxed)
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

    /// A handle that aborts this communicator as [`DeviceComm::abort`] does, for a watchdog
    /// thread that does not own a reference to the communicator.
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

    /// Ranks of this job on this rank's node, as its launcher says (`LOCAL_WORLD_SIZE` and
    /// the like): how many processes share the node's cores and memory.
    pub fn local_size(&self) -> usize {
        self.core.cfg.launch.local_world_size
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
        &self,
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
        &self,
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
    pub(super) fn worker(&self) -> &Worker<DevPosted> {
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
