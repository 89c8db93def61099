//! The core of a [`DeviceComm`]: what the calling thread and the proxy thread share, and how a
//! call runs on it (announce, execute on the ring or the direct step, record, fail).

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use ringzero_kernels::{DType, ReduceOp};

use super::records::DeviceInfo;
use crate::comm::{HostPeers, HostPoster};
use crate::config::{Config, StagingMode};
use crate::error::{Error, Result};
use crate::flight::Recorder;
use crate::ring::call::Call;
use crate::ring::device_engine::{self, DevBufs, DevLinks};
use crate::ring::failure::AbortFlag;
use crate::ring::{plan, Collective, Count, PlanArgs};
use crate::topology::Edge;
use crate::transport::device::{DevPtr, DevRecvLink, DevSendLink};
use crate::transport::{tcp, TransportKind};
use crate::wire::Fingerprint;
use ringzero_kernels::device::Stream;

/// What the calling thread and the proxy thread share.
pub(super) struct Core<S: Stream> {
    pub(super) stream: S,
    pub(super) cfg: Config,
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) edges: Vec<Edge>,
    /// Why all-reduces, reduce-scatters, all-gathers, broadcasts and reduces run directly, where they do.
    pub(super) direct_why: Option<String>,
    /// Some rank's start-up probe failed, so some edge is rebuilt as host staging: every rank
    /// slices as `RINGZERO_P2P_DISABLE=1` does, so that edge's slots in `/dev/shm` stay small.
    pub(super) staged_fallback: bool,
    /// The least free space in any rank's shm directory at set-up (sizes host staging's slots).
    pub(super) shm_room: u64,
    /// Every rank's buffers are in one device's memory ([`DeviceComm::one_device`]).
    pub(super) one_device: bool,
    /// How this rank's host-staging links move bytes, and why ([`DeviceComm::staging`]).
    pub(super) staging: (StagingMode, String),
    pub(super) state: Mutex<DevState>,
    /// Device memory an in-place all-to-all sends from (a copy of the caller's buffer), kept
    /// for the next one: address, bytes, owner. Used only under `state`'s lock.
    pub(super) send_copy: Mutex<Option<Kept>>,
    /// Bytes of device memory this rank's links (their slots or staging scratch) and the kept
    /// send copy hold ([`DeviceComm::device_bytes`]).
    pub(super) held: AtomicUsize,
    /// The last calls, dumped when the communicator fails or closes.
    pub(super) flight: Recorder,
    /// Raised by [`DeviceComm::abort`] from any thread; the running call sees it.
    pub(super) abort: AbortFlag,
    /// The host communicator's point-to-point links, to connect device pairs (None: one rank).
    pub(super) host: Option<HostPeers>,
    /// Every rank's device, as all-gathered at set-up.
    pub(super) infos: Vec<DeviceInfo>,
    /// Device links of this rank with each peer it has met in a point-to-point call.
    pub(super) pairs: Mutex<BTreeMap<usize, DevPair>>,
    /// Posted host calls, for posted device calls to connect pairs (None: one rank).
    pub(super) poster: Option<HostPoster>,
}

pub(super) type DevState = crate::ring::failure::RingState<DevLinks>;

/// Device memory a communicator keeps: its address, its bytes, its owner (which frees it).
pub(super) type Kept = (DevPtr, usize, Box<dyn Any + Send>);

/// This rank's device links with one peer, and how many messages each direction has carried.
pub(crate) struct DevPair {
    pub(super) links: DevLinks,
    pub(super) sent: u64,
    pub(super) received: u64,
    /// From the peer to this rank, then from this rank to the peer.
    pub(super) edges: [Edge; 2],
}

/// One posted device call.
pub(crate) type DevPosted = crate::posted::Posted<DevPtr>;

impl<S: Stream> Core<S> {
    pub(super) fn abort(&self, reason: &str) {
        crate::ring::failure::abort(&self.state, &self.abort, self.rank, reason, &self.flight);
        self.tell_pairs(&format!("rank {}: {reason}", self.rank));
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, DevState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
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
        // The device engine's stores are device copies and kernels (no streaming stores).
        let (world, wait) = ((self.size, self.rank), (self.cfg.timeout, &self.abort));
        let call = Call::on(&p, (seq, fp), (dtype, op), world, wait);
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
                let direct = match links.side.direct.as_mut() {
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
            if let Some((_, old, _)) = kept.take() {
                self.held.fetch_sub(old, Ordering::Relaxed);
            }
            let (addr, owner) = self.stream.scratch(bytes).map_err(dev_err(
                "allocating device memory for an in-place all-to-all's send copy",
            ))?;
            self.held.fetch_add(bytes, Ordering::Relaxed);
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
            let at = (&call.fp, call.seq, self.rank);
            super::settle::wait_local(&self.stream, &m, call.timeout, at, "the local copy")?;
        }
        Ok(())
    }
}

/// A send link and its transport.
pub(super) type SendSide = (Box<dyn DevSendLink>, TransportKind);

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

pub(super) fn dev_err(what: &str) -> impl Fn(ringzero_kernels::device::DeviceError) -> Error + '_ {
    move |e| Error::Device {
        context: what.to_string(),
        source: e,
    }
}
