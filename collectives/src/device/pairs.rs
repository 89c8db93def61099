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

use ringzero_kernels::{DType, ReduceOp};

use super::comm::{text, untext, ConnectInfo, Core, DeviceComm, FINDING_BYTES};
use super::stream::Stream;
use super::DeviceMemory;
use crate::comm::P2p;
use crate::error::{Error, Result};
use crate::ring::device_engine::{self, DevBufs, DevLinks};
use crate::ring::engine::Call;
use crate::ring::{plan_p2p, Collective};
use crate::topology::{self, Edge};
use crate::transport::device::Addr;
use crate::transport::TransportKind;
use crate::wire::Fingerprint;
use crate::work::Work;

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
    /// pair connects). The pair's first call is a rendezvous: both ranks must reach a call with
    /// each other before either goes on (ranks whose first calls form a cycle — each sending to
    /// the rank before it — wait on each other until the deadline). A send returns once its last slice is in the peer's slots, which may be
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

    /// Connect this rank's device links with each of `peers` it has not met yet, now and all at
    /// once, instead of at each pair's first call: every one of them must call this (or a
    /// point-to-point call with this rank) too. Connecting them together never waits in a
    /// cycle, so ranks whose first calls would form one (each sending to the rank before it)
    /// can call this first with the ranks they will talk to.
    pub fn connect_peers(&mut self, peers: &[usize]) -> Result<()> {
        check(self, &peers.iter().map(|&p| (true, p)).collect::<Vec<_>>())?;
        self.wait_async();
        let core = self.core();
        let fp = Fingerprint::new(Collective::SendRecv, None, None, 0);
        let mut st = core.lock();
        crate::ring::engine::refuse(st.failed.as_ref(), &core.abort, &fp, 0)?;
        let mut pairs = core.pairs.lock().unwrap_or_else(|p| p.into_inner());
        let mut missing: Vec<usize> = peers
            .iter()
            .copied()
            .filter(|p| !pairs.contains_key(p))
            .collect();
        missing.sort_unstable();
        missing.dedup();
        if missing.is_empty() {
            return Ok(());
        }
        match core.connect_pairs(&missing) {
            Ok(made) => {
                pairs.extend(made);
                Ok(())
            }
            Err(e) => {
                drop(pairs);
                core.fail(&mut st, &e);
                Err(e)
            }
        }
    }

    /// The device edges with `peer` (from it, then to it) once a point-to-point call has
    /// connected them, with the transport and why; `None` before.
    pub fn pair_edges(&self, peer: usize) -> Option<[Edge; 2]> {
        let pairs = self.core().pairs.lock().unwrap_or_else(|p| p.into_inner());
        pairs.get(&peer).map(|p| p.edges.clone())
    }
}

/// Asynchronous forms: owned buffers, driven by the proxy thread in submission order with the
/// collectives (see [`DeviceComm`]); bad peers fail the `Work` at once.
impl<S: Stream + 'static> DeviceComm<S> {
    /// [`DeviceComm::send`] of an owned buffer; returns it once sent.
    pub fn send_async<B>(&self, buf: B, peer: usize) -> Work<B>
    where
        B: DeviceMemory<S> + Send + 'static,
    {
        if let Err(e) = check(self, &[(true, peer)]) {
            return Work::failed(e);
        }
        self.submit(move |core| {
            let s = (buf.addr(&core.stream), buf.elems());
            // SAFETY: the job owns `buf` until the call returns, and the engine returns only
            // once the device work reading it has completed.
            unsafe { core.p2p(peer, buf.dtype(), Some(s), None) }?;
            Ok(buf)
        })
    }

    /// [`DeviceComm::recv`] into an owned buffer (its length the count expected); returns it
    /// filled.
    pub fn recv_async<B>(&self, mut buf: B, peer: usize) -> Work<B>
    where
        B: DeviceMemory<S> + Send + 'static,
    {
        if let Err(e) = check(self, &[(false, peer)]) {
            return Work::failed(e);
        }
        self.submit(move |core| {
            let (dtype, elems) = (buf.dtype(), buf.elems());
            let r = (buf.addr_mut(&core.stream), elems);
            // SAFETY: the job owns `buf` until the call returns, and the engine returns only
            // once the device work writing it has completed.
            unsafe { core.p2p(peer, dtype, None, Some(r)) }?;
            Ok(buf)
        })
    }

    /// [`DeviceComm::send_recv`] on owned buffers; returns both.
    pub fn send_recv_async<B>(&self, send: B, mut recv: B, peer: usize) -> Work<(B, B)>
    where
        B: DeviceMemory<S> + Send + 'static,
    {
        let checked = check(self, &[(true, peer), (false, peer)])
            .and_then(|()| super::same_dtype(Collective::SendRecv, send.dtype(), recv.dtype()));
        if let Err(e) = checked {
            return Work::failed(e);
        }
        self.submit(move |core| {
            let s = (send.addr(&core.stream), send.elems());
            let r = (recv.addr_mut(&core.stream), recv.elems());
            // SAFETY: the job owns both buffers (distinct values, so distinct memory) until
            // the call returns, and the engine returns only once the device work touching them
            // has completed.
            unsafe { core.p2p(peer, send.dtype(), Some(s), Some(r)) }?;
            Ok((send, recv))
        })
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
            if !pairs.contains_key(&peer) {
                pairs.extend(self.connect_pairs(&[peer])?);
            }
            let pair = pairs.get_mut(&peer).expect("connected above");
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
        drop(pairs);
        if let Err(e) = &r {
            self.fail(&mut st, e);
        }
        r
    }

    /// Fail the communicator after `e` (a refused argument fails nothing): every later call
    /// refuses, and the ring's neighbours and every connected peer are told.
    fn fail(&self, st: &mut super::comm::DevState, e: &Error) {
        if matches!(e, Error::InvalidArgument { .. }) {
            return;
        }
        tracing::error!(target: "ringzero::device", rank = self.rank, "{e}");
        crate::ring::engine::fail(st, self.rank, e, &self.flight);
        self.tell_pairs(&format!("rank {}: {e}", self.rank));
    }

    /// The byte counters of every pair's links together.
    pub(super) fn pair_counters(&self) -> crate::ring::engine::Counters {
        let pairs = self.pairs.lock().unwrap_or_else(|p| p.into_inner());
        pairs
            .values()
            .fold(Default::default(), |a, p| a + p.links.counters)
    }

    /// Tell every connected peer that this rank aborts.
    pub(super) fn tell_pairs(&self, why: &str) {
        let mut pairs = self.pairs.lock().unwrap_or_else(|p| p.into_inner());
        pairs.values_mut().for_each(|p| p.links.abort(why));
    }

    /// Build this rank's device links with each of `peers` (distinct, none connected yet), each
    /// of which is doing the same with this rank: its receive FIFOs, chosen as ring edges are,
    /// then every connect info traded at once over the host's point-to-point links (a batch,
    /// which connects the host pairs without waiting in a cycle), then the attaches, in
    /// ascending peer order (a tcp pair accepts and connects at once, so two ranks meet there
    /// whatever else they connect: the lowest pair not yet joined can always go on).
    pub(super) fn connect_pairs(&self, peers: &[usize]) -> Result<Vec<(usize, DevPair)>> {
        let host = self.host.as_ref().ok_or_else(|| Error::Protocol {
            peer: format!("rank {}", peers.first().copied().unwrap_or(0)),
            detail: "a one-rank device communicator has no peers".into(),
        })?;
        let mut peers = peers.to_vec();
        peers.sort_unstable();
        let me = &self.infos[self.rank];
        let mut opened = Vec::with_capacity(peers.len());
        for &peer in &peers {
            let dp = self.device_peer(me, &self.infos[peer], host.edge_from(peer)?);
            let mut recv_edge = topology::choose_device(&self.cfg, &dp)?;
            if self.staged_fallback && recv_edge.kind == TransportKind::CudaIpc {
                // The ring's start-up probe found peer copies broken somewhere: not trusted.
                let why = "the ring's start-up probe found peer copies broken";
                recv_edge = topology::after_probe(&self.cfg, recv_edge, Some(why))?;
            }
            let name = crate::connect::segment_name(&self.cfg, peer, self.rank, "devp2p");
            let (rx, info) = self.open_rx(host.data_ip(), &recv_edge, peer, &name)?;
            let mut record = bytemuck::bytes_of(&info).to_vec();
            record.extend_from_slice(&text::<FINDING_BYTES>(&recv_edge.reason));
            opened.push((rx, recv_edge, record));
        }
        let size = std::mem::size_of::<ConnectInfo>() + FINDING_BYTES;
        let mut theirs = vec![vec![0u8; size]; peers.len()];
        let mut msgs: Vec<P2p<'_, u8>> = opened
            .iter()
            .zip(&peers)
            .map(|((_, _, record), &p)| P2p::Send(record.as_slice(), p))
            .collect();
        msgs.extend(
            theirs
                .iter_mut()
                .zip(&peers)
                .map(|(b, &p)| P2p::Recv(b.as_mut_slice(), p)),
        );
        host.exchange_all(&mut msgs)?;
        let mut made = Vec::with_capacity(peers.len());
        for ((rx, recv_edge, _), (peer, record)) in
            opened.into_iter().zip(peers.iter().zip(&theirs))
        {
            let (info, reason) = record.split_at(std::mem::size_of::<ConnectInfo>());
            let info: ConnectInfo = bytemuck::pod_read_unaligned(info);
            let (links, (kind, sockets)) = self.join(rx, &recv_edge, *peer, (&info, *peer))?;
            let send_edge = Edge {
                from: self.rank,
                to: *peer,
                kind,
                reason: untext(reason),
                sockets,
            };
            let pair = DevPair {
                links,
                sent: 0,
                received: 0,
                edges: [recv_edge, send_edge],
            };
            for e in &pair.edges {
                tracing::info!(target: "ringzero::topology", rank = self.rank,
                    "device point-to-point edge {e}");
            }
            made.push((*peer, pair));
        }
        // Each side now holds the other's FIFO: say so, and hear it, so that neither returns (and
        // may close, removing a FIFO's file) before its peer has attached.
        let ok = [1u8];
        let mut heard = vec![[0u8]; peers.len()];
        let mut msgs: Vec<P2p<'_, u8>> = peers.iter().map(|&p| P2p::Send(&ok[..], p)).collect();
        msgs.extend(
            heard
                .iter_mut()
                .zip(&peers)
                .map(|(b, &p)| P2p::Recv(&mut b[..], p)),
        );
        host.exchange_all(&mut msgs)?;
        Ok(made)
    }
}
