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
//! expecting another count or element type fails with both calls named. The asynchronous forms
//! are posted calls, moved by the proxy thread as their links allow (`device/posted.rs`), their
//! pairs connected there without waiting on a peer's turn.
//!
//! All-to-all-v is built on the pairs: the ranks meet pair by pair in the rounds of a
//! round-robin tournament ([`partner`]), each pair trading its two blocks at once.
//!
//! Not done: the pair's links get no start-up probe of their own (the ring's probe decides, for
//! every pair, whether peer copies are trusted), and a blocking call moves at most one message
//! each way (posted calls to several peers move at once).

use std::collections::BTreeMap;

use ringzero_kernels::{DType, ReduceOp};

use super::comm::DeviceComm;
use super::core::Rx;
use super::core::{Core, DevPair, DevState};
use super::records::{text, untext, ConnectInfo, FINDING_BYTES};
use super::stream::Stream;
use super::DeviceMemory;
use crate::comm::HostPeers;
use crate::error::{Error, Result};
use crate::ring::device_engine::{self, DevBufs, DevLinks};
use crate::ring::engine::Call;
use crate::ring::{plan_p2p, Collective};
use crate::topology::{self, Edge};
use crate::transport::device::DevPtr;
use crate::transport::TransportKind;
use crate::wire::Fingerprint;
use crate::work::Work;

impl<S: Stream> DeviceComm<S> {
    /// Send `buf` to rank `peer`, which receives it with [`DeviceComm::recv`] (or
    /// [`DeviceComm::send_recv`]) of the same element type and count: the host
    /// [`crate::Communicator::send`]'s rules, on device buffers (see the module docs for how the
    /// pair connects). The pair's first call is a rendezvous: both ranks must reach a call with
    /// each other before either goes on (ranks whose first calls form a cycle — each sending to
    /// the rank before it — wait on each other until the deadline: connect them first with
    /// [`DeviceComm::connect_peers`]). A send returns once its last slice is in the peer's
    /// slots, which may be before the peer receives it (while the message fits `RINGZERO_SLOTS`
    /// slices); two ranks that each send the other more than that before receiving wait until
    /// the deadline, so exchange with [`DeviceComm::send_recv`] — or post the calls
    /// ([`DeviceComm::send_async`]), which neither waits in program order nor on a first call.
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

    /// All-to-all with a count per pair of ranks (`MPI_Alltoallv`; a mixture of experts'
    /// dispatch): block `j` of `send` (`send_counts[j]` elements, after the blocks before it)
    /// goes to rank `j`, and block `i` of `recv` (`recv_counts[i]`) comes from rank `i`. The rules
    /// are [`crate::Communicator::all_to_all_v`]'s (this rank's own block is copied, so
    /// `send_counts[rank] == recv_counts[rank]`). The ranks meet pair by pair, in the rounds of a
    /// round-robin tournament, over the pairs' own device links (connected by the first call,
    /// all at once), each pair trading its two blocks at once: each rank sends and receives its
    /// blocks once, none forwarded, one peer at a time.
    pub fn all_to_all_v<B: DeviceMemory<S> + ?Sized>(
        &mut self,
        send: &B,
        send_counts: &[usize],
        recv: &mut B,
        recv_counts: &[usize],
    ) -> Result<()> {
        let (sd, rd) = a2av_layout(self, (send, send_counts), (&*recv, recv_counts))?;
        let (s, r) = (send.addr(self.stream()), recv.addr_mut(self.stream()));
        self.wait_async();
        // SAFETY: `send` and `recv` are borrowed (shared and exclusive, so distinct) for the
        // whole call and are memory of this stream by the DeviceMemory impl; the layout was
        // checked against their lengths.
        unsafe {
            self.core()
                .all_to_all_v(send.dtype(), (s, &sd, send_counts), (r, &rd, recv_counts))
        }
    }

    /// Gather (`MPI_Gather`): the root's `recv` ends with every rank's `send`, in rank order
    /// (`size()` blocks of `send`'s length, which every rank shares); `recv` is written only on
    /// the root (pass an empty buffer elsewhere). The rules are
    /// [`crate::Communicator::gather`]'s. Each rank sends its block to the root over their pair's
    /// own device links; the root takes them in rank order.
    pub fn gather<B: DeviceMemory<S> + ?Sized>(
        &mut self,
        send: &B,
        recv: &mut B,
        root: usize,
    ) -> Result<()> {
        let c = Collective::Gather { root };
        rooted_check(self, c, (send, "send"), (&*recv, "recv"))?;
        let (s, r) = (send.addr(self.stream()), recv.addr_mut(self.stream()));
        self.wait_async();
        // SAFETY: `send` and `recv` are borrowed (shared and exclusive, so distinct) for the
        // whole call and are memory of this stream by the DeviceMemory impl; the root's `recv`
        // holds `size()` blocks (checked).
        unsafe { self.core().rooted(c, send.dtype(), send.elems(), (s, r)) }
    }

    /// Scatter (`MPI_Scatter`): rank `i`'s `recv` ends with block `i` of the root's `send`
    /// (`size()` blocks of `recv`'s length, which every rank shares); `send` is read only on the
    /// root (pass an empty buffer elsewhere). The rules are [`crate::Communicator::scatter`]'s.
    /// The root sends each rank its block over their pair's own device links, in rank order.
    pub fn scatter<B: DeviceMemory<S> + ?Sized>(
        &mut self,
        send: &B,
        recv: &mut B,
        root: usize,
    ) -> Result<()> {
        let c = Collective::Scatter { root };
        rooted_check(self, c, (&*recv, "recv"), (send, "send"))?;
        let (s, r) = (send.addr(self.stream()), recv.addr_mut(self.stream()));
        self.wait_async();
        // SAFETY: as for `gather`, the root's `send` holding `size()` blocks (checked).
        unsafe { self.core().rooted(c, recv.dtype(), recv.elems(), (s, r)) }
    }

    /// Connect this rank's device links with each of `peers` it has not met yet, now and all at
    /// once, instead of at each pair's first call: every one of them must call this (or a
    /// point-to-point call with this rank) too. Connecting them together never waits in a
    /// cycle, so ranks whose first calls would form one (each sending to the rank before it)
    /// can call this first with the ranks they will talk to.
    pub fn connect_peers(&mut self, peers: &[usize]) -> Result<()> {
        check(self, &peers.iter().map(|&p| (true, p)).collect::<Vec<_>>())?;
        self.wait_async();
        let fp = Fingerprint::new(Collective::SendRecv, None, None, 0);
        self.core().on_pairs(&fp, peers, |_| Ok(()))
    }

    /// The device edges with `peer` (from it, then to it) once a point-to-point call has
    /// connected them, with the transport and why; `None` before.
    pub fn pair_edges(&self, peer: usize) -> Option<[Edge; 2]> {
        let pairs = self.core().pairs.lock().unwrap_or_else(|p| p.into_inner());
        pairs.get(&peer).map(|p| p.edges.clone())
    }
}

/// Asynchronous forms: owned buffers, driven by the proxy thread (see [`DeviceComm`]): the
/// point-to-point calls are posted (`device/posted.rs`), all-to-all-v runs in submission order
/// with the collectives; bad peers fail the `Work` at once.
impl<S: Stream + 'static> DeviceComm<S> {
    /// [`DeviceComm::send`] of an owned buffer (`MPI_Isend`); returns it once sent (its device
    /// work complete, the message in the peer's slots or read). Point-to-point calls queued
    /// one after another are *posted*: each message moves as soon as its link allows, even
    /// while one queued before it waits, so `recv_async` from one neighbour before `send_async`
    /// to the other, or two ranks that each `send_async` the other more than its slots hold
    /// before `recv_async`, complete — first calls included (the pairs connect within the
    /// session). Messages to one peer keep their order; a collective queued after them waits
    /// for them.
    pub fn send_async<B>(&self, buf: B, peer: usize) -> Work<B>
    where
        B: DeviceMemory<S> + Send + 'static,
    {
        if let Err(e) = check(self, &[(true, peer)]) {
            return Work::failed(e);
        }
        self.post_p2p(vec![(true, peer, buf)], one)
    }

    /// [`DeviceComm::recv`] into an owned buffer (its length the count expected;
    /// `MPI_Irecv`), posted as [`DeviceComm::send_async`] is; returns it filled.
    pub fn recv_async<B>(&self, buf: B, peer: usize) -> Work<B>
    where
        B: DeviceMemory<S> + Send + 'static,
    {
        if let Err(e) = check(self, &[(false, peer)]) {
            return Work::failed(e);
        }
        self.post_p2p(vec![(false, peer, buf)], one)
    }

    /// [`DeviceComm::all_to_all_v`] on owned buffers; returns both.
    pub fn all_to_all_v_async<B>(
        &self,
        send: B,
        send_counts: &[usize],
        mut recv: B,
        recv_counts: &[usize],
    ) -> Work<(B, B)>
    where
        B: DeviceMemory<S> + Send + 'static,
    {
        let (sd, rd) = match a2av_layout(self, (&send, send_counts), (&recv, recv_counts)) {
            Ok(l) => l,
            Err(e) => return Work::failed(e),
        };
        let (sc, rc) = (send_counts.to_vec(), recv_counts.to_vec());
        self.submit(move |core| {
            let (s, r) = (send.addr(&core.stream), recv.addr_mut(&core.stream));
            // SAFETY: the job owns both buffers (distinct values, so distinct memory) until the
            // call returns, and the engine returns only once the device work touching them has
            // completed; the layout was checked against their lengths.
            unsafe { core.all_to_all_v(send.dtype(), (s, &sd, &sc), (r, &rd, &rc)) }?;
            Ok((send, recv))
        })
    }

    /// [`DeviceComm::send_recv`] on owned buffers, posted as [`DeviceComm::send_async`] is;
    /// returns both.
    pub fn send_recv_async<B>(&self, send: B, recv: B, peer: usize) -> Work<(B, B)>
    where
        B: DeviceMemory<S> + Send + 'static,
    {
        let checked = check(self, &[(true, peer), (false, peer)])
            .and_then(|()| super::same_dtype(Collective::SendRecv, send.dtype(), recv.dtype()));
        if let Err(e) = checked {
            return Work::failed(e);
        }
        self.post_p2p(vec![(true, peer, send), (false, peer, recv)], |b| {
            let mut b = b.into_iter();
            match (b.next(), b.next()) {
                (Some(s), Some(r)) => (s, r),
                _ => unreachable!("two buffers in, two out"),
            }
        })
    }
}

/// One message of [`DeviceComm::send_recv_batch_async`] (torch's `P2POp`), on a buffer it
/// owns: a send's comes back as it went, a receive's (its length the count expected) filled.
#[derive(Debug)]
pub enum DeviceP2p<B> {
    /// Send the buffer to the rank.
    Send(B, usize),
    /// Receive into the buffer from the rank.
    Recv(B, usize),
}

impl<S: Stream + 'static> DeviceComm<S> {
    /// Post `msgs` as one call (torch's `batch_isend_irecv`): each message to or from its own
    /// peer, moving as its link allows, as [`DeviceComm::send_async`]'s do; the `Work` gives
    /// the messages back in the order given, receives filled, once every one has moved.
    /// Messages to one peer (and from one) keep their order. Element types may differ between
    /// messages, each matched with its peer's. A bad peer fails the `Work` at once and moves
    /// nothing.
    pub fn send_recv_batch_async<B>(&self, msgs: Vec<DeviceP2p<B>>) -> Work<Vec<DeviceP2p<B>>>
    where
        B: DeviceMemory<S> + Send + 'static,
    {
        let peers: Vec<(bool, usize)> = msgs
            .iter()
            .map(|m| match m {
                DeviceP2p::Send(_, p) => (true, *p),
                DeviceP2p::Recv(_, p) => (false, *p),
            })
            .collect();
        if let Err(e) = check(self, &peers) {
            return Work::failed(e);
        }
        let raw = msgs
            .into_iter()
            .map(|m| match m {
                DeviceP2p::Send(b, p) => (true, p, b),
                DeviceP2p::Recv(b, p) => (false, p, b),
            })
            .collect();
        self.post_p2p(raw, move |bufs| {
            bufs.into_iter()
                .zip(peers)
                .map(|(b, (send, p))| {
                    if send {
                        DeviceP2p::Send(b, p)
                    } else {
                        DeviceP2p::Recv(b, p)
                    }
                })
                .collect()
        })
    }
}

/// The one buffer of a one-message call.
fn one<B>(mut b: Vec<B>) -> B {
    b.pop().expect("one buffer in, one out")
}

/// Where each rank's block starts in an all-to-all-v's `send` and `recv` (elements), or why the
/// counts or element types do not fit them.
fn a2av_layout<S: Stream, B: DeviceMemory<S> + ?Sized>(
    dc: &DeviceComm<S>,
    (send, sc): (&B, &[usize]),
    (recv, rc): (&B, &[usize]),
) -> Result<(Vec<usize>, Vec<usize>)> {
    super::same_dtype(Collective::AllToAllV, send.dtype(), recv.dtype())?;
    crate::comm::pairwise::all_to_all_v_layout(
        (dc.rank(), dc.size()),
        (sc, send.elems()),
        (rc, recv.elems()),
    )
}

/// Refuse a gather or scatter (`c`) whose root is no rank, whose buffers' element types differ,
/// or whose root's whole buffer (`whole`) is not `size()` times the block (`block`), as the host
/// communicator does.
fn rooted_check<S: Stream, B: DeviceMemory<S> + ?Sized>(
    dc: &DeviceComm<S>,
    c: Collective,
    (block, block_name): (&B, &str),
    (whole, whole_name): (&B, &str),
) -> Result<()> {
    let root = c.root().expect("gather and scatter have a root");
    let n = dc.size();
    if root >= n {
        return Err(Error::InvalidArgument {
            op: c.name().into(),
            msg: format!("root {root} is not a rank of this {n}-rank communicator"),
        });
    }
    if dc.rank() != root {
        return Ok(());
    }
    super::same_dtype(c, block.dtype(), whole.dtype())?;
    if block.elems().checked_mul(n) != Some(whole.elems()) {
        return Err(Error::InvalidArgument {
            op: c.name().into(),
            msg: format!(
                "{whole_name} has {} elements but the root moves {n} × {} (the world size times \
                 {block_name}'s length)",
                whole.elems(),
                block.elems()
            ),
        });
    }
    Ok(())
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
        send: Option<(DevPtr, usize)>,
        recv: Option<(DevPtr, usize)>,
    ) -> Result<()> {
        let fp_of = |c| Fingerprint::new(Collective::SendRecv, Some(dtype), None, c);
        let first = send.or(recv).map_or(0, |m| m.1);
        // The messages are pending in the flight record from before the pair's connect (a
        // first call that never meets is what a hang shows), finished once they have moved.
        let (sent, received) = {
            let pairs = self.pairs.lock().unwrap_or_else(|p| p.into_inner());
            pairs.get(&peer).map_or((0, 0), |p| (p.sent, p.received))
        };
        let msgs: Vec<_> = [
            send.map(|m| (peer, true, sent, fp_of(m.1))),
            recv.map(|m| (peer, false, received, fp_of(m.1))),
        ]
        .into_iter()
        .flatten()
        .collect();
        self.flight.p2p_started(&msgs);
        self.on_pairs(&fp_of(first), &[peer], |pairs| {
            let pair = pairs.get_mut(&peer).expect("connected");
            // SAFETY: forwarded from the caller.
            unsafe { self.run_pair(pair, Collective::SendRecv, dtype, send, recv) }
        })?;
        self.flight
            .p2p_finished(msgs.iter().map(|&(p, send, seq, _)| (p, send, seq)));
        Ok(())
    }

    /// Run `f` on the pairs, with `peers` connected first (those not yet, all at once), the
    /// communicator's state held: refused once it has failed (`fp` names the call), failed by
    /// any error `f` or the connect returns (every connected peer told).
    fn on_pairs(
        &self,
        fp: &Fingerprint,
        peers: &[usize],
        f: impl FnOnce(&mut BTreeMap<usize, DevPair>) -> Result<()>,
    ) -> Result<()> {
        let mut st = self.lock();
        crate::ring::failure::refuse(st.failed.as_ref(), &self.abort, fp, st.seq)?;
        let mut pairs = self.pairs.lock().unwrap_or_else(|p| p.into_inner());
        let mut missing: Vec<usize> = peers
            .iter()
            .copied()
            .filter(|p| !pairs.contains_key(p))
            .collect();
        missing.sort_unstable();
        missing.dedup();
        let connected = if missing.is_empty() {
            Ok(())
        } else {
            self.connect_pairs(&missing).map(|made| pairs.extend(made))
        };
        let r = connected.and_then(|()| f(&mut pairs));
        drop(pairs);
        if let Err(e) = &r {
            self.fail(&mut st, e);
        }
        r
    }

    /// One message each way at most with the peer of `pair`, on its links, as part of `coll`
    /// (send-recv, or a collective built of pairs): the frames carry `coll` and the message's
    /// count, and each direction's own sequence number.
    ///
    /// # Safety
    /// As for [`Core::p2p`].
    unsafe fn run_pair(
        &self,
        pair: &mut DevPair,
        coll: Collective,
        dtype: DType,
        send: Option<(DevPtr, usize)>,
        recv: Option<(DevPtr, usize)>,
    ) -> Result<()> {
        let es = dtype.size();
        let fp_of = |c| Fingerprint::new(coll, Some(dtype), None, c);
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
        let call = self.pair_call(&plan, (fp, seq), dtype, incoming);
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
    }

    /// The call a pair's `plan` runs as: sending as `fp` numbered `seq` in its direction,
    /// receiving the peer's message `incoming` (number, fingerprint), if any.
    pub(super) fn pair_call<'a>(
        &'a self,
        plan: &'a crate::ring::Plan,
        (fp, seq): (Fingerprint, u64),
        dtype: DType,
        incoming: Option<(u64, Fingerprint)>,
    ) -> Call<'a> {
        Call {
            plan,
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
        }
    }

    /// All-to-all-v on device buffers: `send` and `recv` (addresses) with each rank's block at
    /// `sd[q]`/`rd[q]` elements of `sc[q]`/`rc[q]` (checked by the caller). An empty frame to the
    /// next rank announces the call (its sequence number and flight entry; a rank that called
    /// something else fails at once, both calls named); the first call connects every pair at
    /// once; this rank's own block is a local copy; then the ranks meet pair by pair in the
    /// rounds of a round-robin tournament ([`partner`]), trading their blocks both ways at once.
    ///
    /// # Safety
    /// The blocks lie in memory of this stream's device, `send`'s not written, `recv`'s not used
    /// by anything else until this returns.
    pub(super) unsafe fn all_to_all_v(
        &self,
        dtype: DType,
        send: (DevPtr, &[usize], &[usize]),
        recv: (DevPtr, &[usize], &[usize]),
    ) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.exchange_blocks(Collective::AllToAllV, dtype, send, recv) }
    }

    /// An all-to-all (`count` elements of `dtype` in `bufs`, a multiple of the world size:
    /// checked by the caller; in place it sends from the kept copy, as the ring does) as an
    /// all-to-all-v of equal blocks over the pairs:
    /// what ranks on several nodes run, where the ring's store-and-forward would carry every
    /// block that crosses between nodes, and every block that wraps round within one, over the
    /// one ring edge out of each node (on two emulated nodes of 4 ranks, 1.7× the pairs' time).
    ///
    /// # Safety
    /// As for [`Core::all_to_all_v`]: `bufs` holds the input and the output.
    pub(super) unsafe fn all_to_all_by_pairs(
        &self,
        dtype: DType,
        count: usize,
        bufs: DevBufs,
    ) -> Result<()> {
        let c = Collective::AllToAll;
        let (n, es) = (self.size, dtype.size());
        let need = count.saturating_mul(es);
        let (input, input_bytes, output, output_bytes) = match bufs {
            DevBufs::Split {
                input,
                input_bytes,
                output,
                output_bytes,
            } => (input, input_bytes, output, output_bytes),
            DevBufs::One { buf, bytes } if bytes >= need => {
                // Under the state lock, as every call that uses the kept copy; a failure fails
                // the communicator (the peers would otherwise wait for this rank's call).
                let mut st = self.lock();
                // SAFETY: `buf` holds at least `need` bytes (checked) by the caller's contract.
                let copy = unsafe { self.copy_to_send(buf, need) };
                let input = copy.inspect_err(|e| self.fail(&mut st, e))?;
                (input, need, buf, bytes)
            }
            DevBufs::One { bytes, .. } => (0, bytes, 0, bytes),
        };
        if input_bytes < need || output_bytes < need {
            return Err(Error::InvalidArgument {
                op: Fingerprint::new(c, Some(dtype), None, count).to_string(),
                msg: format!("device buffers of {bufs:?}; the call needs {need} bytes of each"),
            });
        }
        let block = count / n;
        let counts = vec![block; n];
        let at: Vec<usize> = (0..n).map(|i| i * block).collect();
        // SAFETY: forwarded from the caller; both buffers hold `count` elements (above).
        unsafe { self.exchange_blocks(c, dtype, (input, &at, &counts), (output, &at, &counts)) }
    }

    /// [`Core::all_to_all_v`] as collective `c` (all-to-all-v, or an all-to-all by pairs),
    /// which names the announcement and the pairs' frames.
    ///
    /// # Safety
    /// As for [`Core::all_to_all_v`].
    unsafe fn exchange_blocks(
        &self,
        c: Collective,
        dtype: DType,
        (send, sd, sc): (DevPtr, &[usize], &[usize]),
        (recv, rd, rc): (DevPtr, &[usize], &[usize]),
    ) -> Result<()> {
        let (n, me, es) = (self.size, self.rank, dtype.size());
        // The announcement, under `c`'s name, so a rank in another call meets it at once.
        // Its flight entry's size is what this rank sends, as the host's all-to-all-v's.
        let bytes = (sc.iter().sum::<usize>() * es) as u64;
        self.announce(Fingerprint::new(c, Some(dtype), None, 0), dtype, bytes)?;
        let fp = Fingerprint::new(c, Some(dtype), None, sc.iter().sum());
        let others: Vec<usize> = (0..n).filter(|&q| q != me).collect();
        let r = self.on_pairs(&fp, &others, |pairs| {
            let at = |base: DevPtr, off: usize| base + (off * es) as u64;
            // SAFETY: both blocks lie in the caller's buffers (the caller's contract).
            unsafe { self.copy_and_wait(at(recv, rd[me]), at(send, sd[me]), sc[me] * es, &fp) }?;
            for k in 0..rounds(n) {
                let Some(q) = partner(n, me, k) else {
                    continue;
                };
                let pair = pairs.get_mut(&q).expect("every pair connected");
                let (s, r) = ((at(send, sd[q]), sc[q]), (at(recv, rd[q]), rc[q]));
                // SAFETY: forwarded from the caller.
                unsafe { self.run_pair(pair, c, dtype, Some(s), Some(r)) }?;
            }
            Ok(())
        });
        self.end_announced(&r);
        r
    }

    /// Gather or scatter (`c`) of blocks of `block` elements: `send` and `recv` (addresses)
    /// as [`DeviceComm::gather`] and [`DeviceComm::scatter`] describe them (checked by the
    /// caller). An empty frame on the ring announces the call; the first call connects the root
    /// with every rank; the root copies its own block and then moves every other rank's over
    /// their pair, in rank order.
    ///
    /// # Safety
    /// The buffers are memory of this stream's device holding what the collective reads and
    /// writes on this rank, the written one used by nothing else until this returns.
    pub(super) unsafe fn rooted(
        &self,
        c: Collective,
        dtype: DType,
        block: usize,
        (send, recv): (DevPtr, DevPtr),
    ) -> Result<()> {
        let (n, me, es) = (self.size, self.rank, dtype.size());
        let root = c.root().expect("gather and scatter have a root");
        let gather = matches!(c, Collective::Gather { .. });
        // The flight entry's size is the root's whole buffer, as the host's.
        let bytes = (n * block * es) as u64;
        self.announce(Fingerprint::new(c, Some(dtype), None, 0), dtype, bytes)?;
        let fp = Fingerprint::new(c, Some(dtype), None, block);
        let peers: Vec<usize> = if me == root {
            (0..n).filter(|&q| q != me).collect()
        } else {
            vec![root]
        };
        let r = self.on_pairs(&fp, &peers, |pairs| {
            let at = |base: DevPtr, q: usize| base + (q * block * es) as u64;
            let msg = |a: DevPtr| Some((a, block));
            if me != root {
                let pair = pairs.get_mut(&root).expect("connected");
                let (s, r) = if gather {
                    (msg(send), None)
                } else {
                    (None, msg(recv))
                };
                // SAFETY: forwarded from the caller.
                return unsafe { self.run_pair(pair, c, dtype, s, r) };
            }
            let (dst, src) = if gather {
                (at(recv, me), send)
            } else {
                (recv, at(send, me))
            };
            // SAFETY: both blocks lie in the caller's buffers (the caller's contract).
            unsafe { self.copy_and_wait(dst, src, block * es, &fp) }?;
            for &q in &peers {
                let pair = pairs.get_mut(&q).expect("connected");
                let (s, r) = if gather {
                    (None, msg(at(recv, q)))
                } else {
                    (msg(at(send, q)), None)
                };
                // SAFETY: forwarded from the caller.
                unsafe { self.run_pair(pair, c, dtype, s, r) }?;
            }
            Ok(())
        });
        self.end_announced(&r);
        r
    }

    /// Copy `bytes` from `src` to `dst` on the stream and wait for it, within the deadline.
    ///
    /// # Safety
    /// Both ranges are memory of this stream's device, `dst`'s used by nothing else meanwhile.
    unsafe fn copy_and_wait(
        &self,
        dst: DevPtr,
        src: DevPtr,
        bytes: usize,
        fp: &Fingerprint,
    ) -> Result<()> {
        let dev = |e| Error::Device {
            context: format!("{fp}: this rank's own block"),
            source: e,
        };
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: forwarded from the caller.
        unsafe { self.stream.copy(dst, src, bytes) }.map_err(dev)?;
        let m = self.stream.mark().map_err(dev)?;
        let op = fp.to_string();
        let at = (op.as_str(), 0, self.rank);
        super::stream::wait_local(&self.stream, &m, self.cfg.timeout, at, "the local copy")
    }

    /// Fail the communicator after `e` (a refused argument fails nothing): every later call
    /// refuses, and the ring's neighbours and every connected peer are told.
    pub(super) fn fail(&self, st: &mut DevState, e: &Error) {
        let who = crate::ring::failure::Failing {
            rank: self.rank,
            flag: &self.abort,
            flight: &self.flight,
            kind: "device",
        };
        crate::ring::failure::fail(st, &who, e, |why| self.tell_pairs(why));
    }

    /// The byte counters of every pair's links together.
    pub(super) fn pair_counters(&self) -> crate::counters::Counters {
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
        let mut opened = Vec::with_capacity(peers.len());
        for &peer in &peers {
            opened.push(self.open_pair(host, peer)?);
        }
        let poster = self.poster.as_ref().expect("a host implies a poster");
        let records = opened.iter().map(|(_, _, record)| record.clone());
        let theirs = poster.exchange(peers.iter().copied().zip(records).collect(), RECORD_BYTES)?;
        let mut made = Vec::with_capacity(peers.len());
        for ((rx, recv_edge, _), (&peer, record)) in
            opened.into_iter().zip(peers.iter().zip(&theirs))
        {
            let (info, reason) = read_record(record);
            let (links, (kind, sockets)) = self.join(rx, peer, (&info, peer))?;
            made.push((peer, self.pair(links, recv_edge, (kind, sockets), reason)));
        }
        // Each side now holds the other's FIFO: say so, and hear it, so that neither returns (and
        // may close, removing a FIFO's file) before its peer has attached.
        poster.exchange(peers.iter().map(|&p| (p, vec![1u8])).collect(), 1)?;
        Ok(made)
    }

    /// Open this rank's receive FIFO from `peer`, its transport chosen as a ring edge's: the
    /// FIFO's end, the edge and why, and the record that tells `peer` how to reach it
    /// ([`RECORD_BYTES`]: the connect info, then the reason).
    pub(super) fn open_pair(&self, host: &HostPeers, peer: usize) -> Result<(Rx, Edge, Vec<u8>)> {
        let me = &self.infos[self.rank];
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
        Ok((rx, recv_edge, record))
    }

    /// The pair with `peer` over `links`: its receive edge, and the send edge's kind, tcp
    /// connections and the reason `peer` gave (logged once).
    pub(super) fn pair(
        &self,
        links: DevLinks,
        recv_edge: Edge,
        (kind, sockets): (TransportKind, usize),
        reason: String,
    ) -> DevPair {
        let send_edge = Edge {
            from: self.rank,
            to: links.next,
            kind,
            reason,
            sockets,
        };
        for e in [&recv_edge, &send_edge] {
            tracing::info!(target: "ringzero::topology", rank = self.rank,
                "device point-to-point edge {e}");
        }
        DevPair {
            links,
            sent: 0,
            received: 0,
            edges: [recv_edge, send_edge],
        }
    }
}

/// Bytes of the record a rank sends a peer it connects a pair with ([`Core::open_pair`]).
pub(super) const RECORD_BYTES: usize = std::mem::size_of::<ConnectInfo>() + FINDING_BYTES;

/// The connect info and the reason in a peer's record ([`RECORD_BYTES`] long).
pub(super) fn read_record(record: &[u8]) -> (ConnectInfo, String) {
    let (info, reason) = record.split_at(std::mem::size_of::<ConnectInfo>());
    (bytemuck::pod_read_unaligned(info), untext(reason))
}

/// Rounds of the round-robin tournament on `n` ranks: `n − 1`, or `n` when `n` is odd (each rank
/// sits one out).
pub fn rounds(n: usize) -> usize {
    if n < 2 {
        0
    } else {
        n + n % 2 - 1
    }
}

/// Whom rank `r` of `n` meets in round `k` of the round-robin tournament (the circle method:
/// with `m` the even number of seats, `n` or `n + 1`, the last seat meets `k`, and every other
/// seat `s` meets `2k − s` modulo `m − 1`), or `None` when it sits the round out (odd `n`). Every
/// round pairs ranks off, and over [`rounds`] rounds every two ranks meet exactly once. Pure.
pub fn partner(n: usize, r: usize, k: usize) -> Option<usize> {
    let m = n + n % 2;
    let p = if r == m - 1 {
        k
    } else if r == k {
        m - 1
    } else {
        (2 * k + (m - 1) - r) % (m - 1)
    };
    (p < n).then_some(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_round_pairs_ranks_off_and_every_two_meet_once() {
        for n in 1..=12 {
            let mut met = std::collections::BTreeSet::new();
            for k in 0..rounds(n) {
                let mut idle = 0;
                for r in 0..n {
                    let Some(p) = partner(n, r, k) else {
                        idle += 1;
                        continue;
                    };
                    assert_ne!(p, r, "n={n} round {k}");
                    assert_eq!(partner(n, p, k), Some(r), "n={n} round {k}: not mutual");
                    assert!(met.insert((r, p)), "n={n}: {r} meets {p} twice");
                }
                // At most one rank sits a round out, and only when n is odd.
                assert_eq!(idle, n % 2, "n={n} round {k}");
            }
            assert_eq!(met.len(), n * (n - 1), "n={n}: every ordered pair once");
        }
    }
}
