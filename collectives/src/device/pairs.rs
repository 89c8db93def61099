//! Point-to-point on device buffers: [`DeviceComm::send`], [`DeviceComm::recv`],
//! [`DeviceComm::send_recv`].
//!
//! The ring's edges reach the neighbours only, and one way round; a pipeline sends activations
//! to the next stage and gradients back to the one before. So two ranks that meet in a
//! point-to-point call get device links of their own, one FIFO each way, chosen and built as a
//! ring edge is ([`topology::choose_device`]: `cuda_ipc` slots where peer copies work, host
//! staging in `/dev/shm` where they are off or were found broken at set-up, tcp between nodes)
//! when the pair's first call meets: the two trade their connect infos over the host
//! communicator's own point-to-point links, so no other rank takes part. Later calls need no
//! rendezvous. Each direction numbers its messages (a frame's sequence number), so a message is
//! matched by the peer's next receive whatever else either rank does meanwhile; a receive
//! expecting another count or element type fails with both calls named.
//!
//! Not done: the pair's links get no start-up probe of their own (the ring's probe decides, for
//! every pair, whether peer copies are trusted), and there is no batch of messages to several
//! peers at once; one call moves at most one message each way.

use bytemuck::Zeroable;
use ringzero_kernels::{DType, ReduceOp};

use super::comm::{text, untext, ConnectInfo, Core, DeviceComm, FINDING_BYTES};
use super::stream::Stream;
use super::DeviceMemory;
use crate::error::{Error, Result};
use crate::ring::device_engine::{self, DevBufs, DevLinks};
use crate::ring::engine::Call;
use crate::ring::{plan_p2p, Collective};
use crate::topology::{self, Edge};
use crate::transport::device::Addr;
use crate::transport::TransportKind;
use crate::wire::Fingerprint;

/// This rank's device links with one peer, and how many messages each direction has carried.
pub(crate) struct DevPair {
    links: DevLinks,
    sent: u64,
    received: u64,
    /// From the peer to this rank, then from this rank to the peer.
    edges: [Edge; 2],
}

impl<S: Stream> DeviceComm<S> {
    /// Send `buf` to rank `peer`, which receives it with [`DeviceComm::recv`] (or
    /// [`DeviceComm::send_recv`]) of the same element type and count: the host
    /// [`crate::Communicator::send`]'s rules, on device buffers (see the module docs for how the
    /// pair connects). A send returns once its last slice is in the peer's slots, which may be
    /// before the peer receives it (while the message fits `RINGZERO_SLOTS` slices); two ranks
    /// that each send the other more than that before receiving wait until the deadline, so
    /// exchange with [`DeviceComm::send_recv`].
    pub fn send<B: DeviceMemory<S> + ?Sized>(&mut self, buf: &B, peer: usize) -> Result<()> {
        check(self, &[(true, peer)])?;
        let s = (buf.addr(self.stream()), buf.elems());
        self.wait_async();
        // SAFETY: `buf` is borrowed for the whole call and is memory of this stream by the
        // DeviceMemory impl; the call only reads it.
        unsafe { self.core().p2p(peer, buf.dtype(), Some(s), None) }
    }

    /// Receive into `buf` what rank `peer` sends with [`DeviceComm::send`] (or
    /// [`DeviceComm::send_recv`]); its count and element type must be `buf`'s.
    pub fn recv<B: DeviceMemory<S> + ?Sized>(&mut self, buf: &mut B, peer: usize) -> Result<()> {
        check(self, &[(false, peer)])?;
        let (dtype, elems) = (buf.dtype(), buf.elems());
        let r = (buf.addr_mut(self.stream()), elems);
        self.wait_async();
        // SAFETY: `buf` is borrowed exclusively for the whole call and is memory of this stream
        // by the DeviceMemory impl.
        unsafe { self.core().p2p(peer, dtype, None, Some(r)) }
    }

    /// Send `send` to rank `peer` and receive `recv` from it at once (a pipeline's stages trading
    /// activations for gradients): the two directions interleave slice by slice, so two ranks
    /// exchanging messages of any size never wait on each other. The counts may differ; each
    /// must match what the peer sends or expects.
    pub fn send_recv<B: DeviceMemory<S> + ?Sized>(
        &mut self,
        send: &B,
        recv: &mut B,
        peer: usize,
    ) -> Result<()> {
        check(self, &[(true, peer), (false, peer)])?;
        super::same_dtype(Collective::SendRecv, send.dtype(), recv.dtype())?;
        let s = (send.addr(self.stream()), send.elems());
        let r = (recv.addr_mut(self.stream()), recv.elems());
        self.wait_async();
        // SAFETY: `send` and `recv` are borrowed (shared and exclusive, so distinct) for the
        // whole call and are memory of this stream by the DeviceMemory impl.
        unsafe { self.core().p2p(peer, send.dtype(), Some(s), Some(r)) }
    }

    /// The device edges with `peer` (from it, then to it) once a point-to-point call has
    /// connected them, with the transport and why; `None` before.
    pub fn pair_edges(&self, peer: usize) -> Option<[Edge; 2]> {
        let pairs = self.core().pairs.lock().unwrap_or_else(|p| p.into_inner());
        pairs.get(&peer).map(|p| p.edges.clone())
    }
}

/// Refuse a peer that is not another rank, as the host communicator does.
fn check<S: Stream>(dc: &DeviceComm<S>, msgs: &[(bool, usize)]) -> Result<()> {
    crate::comm::pairs::check_peers(dc.size(), dc.rank(), msgs.iter().copied())
}

impl<S: Stream> Core<S> {
    /// One point-to-point call with `peer`: send `send` (address, elements) to it, receive
    /// `recv` from it, or both; connects the pair first if it has never met.
    ///
    /// # Safety
    /// The addresses are memory of this stream's device holding the elements given (of
    /// `dtype`), not used by anything else until this returns.
    pub(super) unsafe fn p2p(
        &self,
        peer: usize,
        dtype: DType,
        send: Option<(Addr, usize)>,
        recv: Option<(Addr, usize)>,
    ) -> Result<()> {
        let es = dtype.size();
        let fp_of = |c| Fingerprint::new(Collective::SendRecv, Some(dtype), None, c);
        let first = send.or(recv).map_or(0, |m| m.1);
        let mut st = self.lock();
        crate::ring::engine::refuse(st.failed.as_ref(), &self.abort, &fp_of(first), 0)?;
        let mut pairs = self.pairs.lock().unwrap_or_else(|p| p.into_inner());
        let r = (|| -> Result<()> {
            let pair = match pairs.entry(peer) {
                std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
                std::collections::btree_map::Entry::Vacant(v) => {
                    let pair = self.connect_pair(peer)?;
                    for e in &pair.edges {
                        tracing::info!(target: "ringzero::topology", rank = self.rank,
                            "device point-to-point edge {e}");
                    }
                    v.insert(pair)
                }
            };
            let plan = plan_p2p(
                send.map(|m| m.1),
                recv.map(|m| m.1),
                (self.slot_bytes() / es).max(1),
            );
            let incoming = recv.map(|m| (pair.received, fp_of(m.1)));
            let (seq, fp) = match send {
                Some(m) => (pair.sent, fp_of(m.1)),
                None => incoming.expect("a send or a receive"),
            };
            let call = Call {
                plan: &plan,
                fp,
                seq,
                dtype,
                op: ReduceOp::Sum,
                n: 2,
                rank: self.rank,
                timeout: self.cfg.timeout,
                stream_stores: false,
                abort: &self.abort,
                incoming,
            };
            let bufs = DevBufs::Split {
                input: send.map_or(0, |m| m.0),
                input_bytes: send.map_or(0, |m| m.1 * es),
                output: recv.map_or(0, |m| m.0),
                output_bytes: recv.map_or(0, |m| m.1 * es),
            };
            // SAFETY: forwarded from the caller; `check_sizes` in `run` holds the plan to the
            // lengths given.
            unsafe { device_engine::run(&self.stream, &mut pair.links, &call, bufs) }?;
            pair.sent += u64::from(send.is_some());
            pair.received += u64::from(recv.is_some());
            Ok(())
        })();
        if let Err(e) = &r {
            if !matches!(e, Error::InvalidArgument { .. }) {
                tracing::error!(target: "ringzero::device", rank = self.rank, "{e}");
                crate::ring::engine::fail(&mut st, self.rank, e, &self.flight);
                let why = format!("rank {}: {e}", self.rank);
                pairs.values_mut().for_each(|p| p.links.abort(&why));
            }
        }
        r
    }

    /// Tell every connected peer that this rank aborts.
    pub(super) fn tell_pairs(&self, why: &str) {
        let mut pairs = self.pairs.lock().unwrap_or_else(|p| p.into_inner());
        pairs.values_mut().for_each(|p| p.links.abort(why));
    }

    /// Build this rank's device links with `peer`, which is doing the same: its receive FIFO from
    /// the peer, chosen as a ring edge's, then the connect infos traded over the host's
    /// point-to-point links, then the attach to the peer's FIFO.
    fn connect_pair(&self, peer: usize) -> Result<DevPair> {
        let host = self.host.as_ref().ok_or_else(|| Error::Protocol {
            peer: format!("rank {peer}"),
            detail: "a one-rank device communicator has no peers".into(),
        })?;
        let me = &self.infos[self.rank];
        let dp = self.device_peer(me, &self.infos[peer], host.edge_from(peer)?);
        let mut recv_edge = topology::choose_device(&self.cfg, &dp)?;
        if self.staged_fallback && recv_edge.kind == TransportKind::CudaIpc {
            // The ring's start-up probe found peer copies broken somewhere: not trusted here.
            let why = "the ring's start-up probe found peer copies broken";
            recv_edge = topology::after_probe(&self.cfg, recv_edge, Some(why))?;
        }
        let name = crate::connect::segment_name(&self.cfg, peer, self.rank, "devp2p");
        let (rx, info) = self.open_rx(host.data_ip(), &recv_edge, peer, &name)?;
        let mut theirs = ConnectInfo::zeroed();
        host.exchange(
            bytemuck::bytes_of(&info),
            bytemuck::bytes_of_mut(&mut theirs),
            peer,
        )?;
        let mut their_reason = [0u8; FINDING_BYTES];
        host.exchange(
            &text::<FINDING_BYTES>(&recv_edge.reason),
            &mut their_reason,
            peer,
        )?;
        let (links, (kind, sockets)) = self.join(rx, &recv_edge, peer, (&theirs, peer))?;
        let send_edge = Edge {
            from: self.rank,
            to: peer,
            kind,
            reason: untext(&their_reason),
            sockets,
        };
        Ok(DevPair {
            links,
            sent: 0,
            received: 0,
            edges: [recv_edge, send_edge],
        })
    }
}
