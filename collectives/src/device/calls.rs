//! The device communicator's collectives: [`Collectives`] on any memory of its stream.

use ringzero_kernels::ReduceOp;

use super::pairs::*;
use super::*;
use crate::calls::{Collectives, NonBlocking};
use crate::error::Result;
use crate::input::Input;
use crate::ring::Collective;
use crate::work::Work;

impl<S: Stream, B: DeviceMemory<S> + ?Sized> Collectives<B> for DeviceComm<S> {
    /// Every rank ends with `op` over every rank's `send`, in `recv`.
    ///
    /// With [`InPlace`](crate::InPlace) as `send`, `recv` holds the input and gets the result.
    fn all_reduce<'a>(
        &self,
        send: impl Into<Input<'a, B>>,
        recv: &mut B,
        op: ReduceOp,
    ) -> Result<()>
    where
        B: 'a,
    {
        self.out_of_place(Collective::AllReduce, op, send.into(), recv)
    }

    /// Rank `r` ends with chunk `r` (see [`DeviceComm::chunk_range`]) of `op` over every rank's
    /// `send`.
    ///
    /// With [`InPlace`](crate::InPlace) as `send`, `recv` is the whole input; the reduced chunk
    /// [`DeviceComm::chunk_range`]`(recv.elems())` is written over that part of it and the rest is
    /// left as it was.
    fn reduce_scatter<'a>(
        &self,
        send: impl Into<Input<'a, B>>,
        recv: &mut B,
        op: ReduceOp,
    ) -> Result<()>
    where
        B: 'a,
    {
        self.out_of_place(Collective::ReduceScatter, op, send.into(), recv)
    }

    /// Reduce-scatter with a part per rank: rank `i` ends with the `counts[i]` elements of the
    /// reduction that follow the parts of the ranks before it, so `counts` (one per rank, the
    /// same on every rank) add up to `send`'s length and `recv` holds `counts[rank]`. The rules
    /// are [`Communicator::reduce_scatter_v`](crate::Collectives::reduce_scatter_v)'s.
    ///
    /// With [`InPlace`](crate::InPlace) as `send`, `recv` is the whole input; this rank's part of
    /// it is overwritten with the reduction and the rest is left as it was.
    fn reduce_scatter_v<'a>(
        &self,
        send: impl Into<Input<'a, B>>,
        recv: &mut B,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()>
    where
        B: 'a,
    {
        self.split_v(Collective::ReduceScatterV, op, send.into(), recv, counts)
    }

    /// Every rank ends with every rank's chunk of `recv` (this rank contributes `send`).
    ///
    /// With [`InPlace`](crate::InPlace) as `send`, this rank's chunk of `recv` is sent and every
    /// other chunk is overwritten.
    fn all_gather<'a>(&self, send: impl Into<Input<'a, B>>, recv: &mut B) -> Result<()>
    where
        B: 'a,
    {
        self.out_of_place(Collective::AllGather, ReduceOp::Sum, send.into(), recv)
    }

    /// All-gather with a part per rank: every rank ends with every rank's part in `recv`, rank
    /// `i`'s `counts[i]` elements after the parts of the ranks before it (`counts`, one per rank
    /// and the same on every rank, add up to `recv`'s length; `send` holds `counts[rank]`). The
    /// rules are [`Communicator::all_gather_v`](crate::Collectives::all_gather_v)'s. The all-gather's ring over those parts
    /// (the host communicator sends to every rank directly instead): each step moves one part a
    /// hop, so a step takes as long as the largest part's slice, and parts of very different
    /// sizes leave links idle.
    ///
    /// With [`InPlace`](crate::InPlace) as `send`, `recv`'s own part (where `counts` put it) is
    /// sent and every other part is overwritten.
    fn all_gather_v<'a>(
        &self,
        send: impl Into<Input<'a, B>>,
        recv: &mut B,
        counts: &[usize],
    ) -> Result<()>
    where
        B: 'a,
    {
        self.split_v(
            Collective::AllGatherV,
            ReduceOp::Sum,
            send.into(),
            recv,
            counts,
        )
    }

    /// Every rank's `recv` ends with `root`'s `send`. On other ranks `send` is not read (and may
    /// be empty); on the root it must be as long as `recv`.
    ///
    /// With [`InPlace`](crate::InPlace) as `send`, the root's `recv` is what every rank gets.
    fn broadcast<'a>(&self, send: impl Into<Input<'a, B>>, recv: &mut B, root: usize) -> Result<()>
    where
        B: 'a,
    {
        self.out_of_place(
            Collective::Broadcast { root },
            ReduceOp::Sum,
            send.into(),
            recv,
        )
    }

    /// `op` over every rank's `send` into `root`'s `recv` (as long as `send`). On other ranks
    /// `recv` is not written (and may be empty).
    ///
    /// With [`InPlace`](crate::InPlace) as `send`, every rank's `recv` is its input and the root's
    /// gets the result; other ranks' buffers are unchanged.
    fn reduce<'a>(
        &self,
        send: impl Into<Input<'a, B>>,
        recv: &mut B,
        op: ReduceOp,
        root: usize,
    ) -> Result<()>
    where
        B: 'a,
    {
        self.out_of_place(Collective::Reduce { root }, op, send.into(), recv)
    }

    /// Send `send` to the next rank and receive the previous rank's buffer into `recv` (same
    /// length on every rank): the ring's raw streaming rate, and ring attention's exchange.
    ///
    /// With [`InPlace`](crate::InPlace) as `send`, `recv` is sent and then overwritten.
    fn ring_shift<'a>(&self, send: impl Into<Input<'a, B>>, recv: &mut B) -> Result<()>
    where
        B: 'a,
    {
        self.out_of_place(Collective::RingShift, ReduceOp::Sum, send.into(), recv)
    }

    /// All-to-all: block `j` of `send` goes to rank `j`, and block `i` of `recv` comes from
    /// rank `i` (`send` and `recv` hold the same number of elements, a multiple of the world
    /// size; a block is that number over the world size). A rank's own block is copied locally.
    ///
    /// Ranks that map each other's buffers (see [`DeviceComm::direct`]) pull: each copies block
    /// `rank` of every rank's `send` into its `recv`, reading and writing each byte once. Over
    /// the ring's edges (cuda_ipc slots, host staging, tcp) each block travels its distance hop
    /// by hop, as NCCL's rings cannot and its peer-to-peer sends do: every link carries (n−1)/2
    /// of the buffer, n/2 times what direct pairs would move, and all links are busy at once.
    /// Ranks on several nodes exchange over device links of each pair's own instead (as
    /// [`DeviceComm::all_to_all_v`](crate::Collectives::all_to_all_v) does, connected by the first such call), where the ring
    /// would carry every block that crosses between nodes, and every one that wraps round
    /// within a node, through the one ring edge out of each node.
    ///
    /// With [`InPlace`](crate::InPlace) as `send`, `recv`'s blocks are sent from a copy (device
    /// memory the communicator keeps for the next in-place call, as large as the largest `recv`),
    /// then replaced by the blocks received.
    fn all_to_all<'a>(&self, send: impl Into<Input<'a, B>>, recv: &mut B) -> Result<()>
    where
        B: 'a,
    {
        self.out_of_place(Collective::AllToAll, ReduceOp::Sum, send.into(), recv)
    }

    /// All-to-all with a count per pair of ranks (`MPI_Alltoallv`; a mixture of experts'
    /// dispatch): block `j` of `send` (`send_counts[j]` elements, after the blocks before it)
    /// goes to rank `j`, and block `i` of `recv` (`recv_counts[i]`) comes from rank `i`. The rules
    /// are [`Communicator::all_to_all_v`](crate::Collectives::all_to_all_v)'s (this rank's own block is copied, so
    /// `send_counts[rank] == recv_counts[rank]`). The ranks meet pair by pair, in the rounds of a
    /// round-robin tournament, over the pairs' own device links (connected by the first call,
    /// all at once), each pair trading its two blocks at once: each rank sends and receives its
    /// blocks once, none forwarded, one peer at a time.
    fn all_to_all_v(
        &self,
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
    /// [`Communicator::gather`](crate::Collectives::gather)'s. Each rank sends its block to the root over their pair's
    /// own device links; the root takes them in rank order.
    fn gather(&self, send: &B, recv: &mut B, root: usize) -> Result<()> {
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
    /// root (pass an empty buffer elsewhere). The rules are [`Communicator::scatter`](crate::Collectives::scatter)'s.
    /// The root sends each rank its block over their pair's own device links, in rank order.
    fn scatter(&self, send: &B, recv: &mut B, root: usize) -> Result<()> {
        let c = Collective::Scatter { root };
        rooted_check(self, c, (&*recv, "recv"), (send, "send"))?;
        let (s, r) = (send.addr(self.stream()), recv.addr_mut(self.stream()));
        self.wait_async();
        // SAFETY: as for `gather`, the root's `send` holding `size()` blocks (checked).
        unsafe { self.core().rooted(c, recv.dtype(), recv.elems(), (s, r)) }
    }

    /// Send `buf` to rank `peer`, which receives it with [`DeviceComm::recv`](crate::Collectives::recv) (or
    /// [`DeviceComm::send_recv`](crate::Collectives::send_recv)) of the same element type and count: the host
    /// [`Communicator::send`](crate::Collectives::send)'s rules, on device buffers (see the module docs for how the
    /// pair connects). The pair's first call is a rendezvous: both ranks must reach a call with
    /// each other before either goes on (ranks whose first calls form a cycle — each sending to
    /// the rank before it — wait on each other until the deadline: connect them first with
    /// [`DeviceComm::connect_peers`]). A send returns once its last slice is in the peer's
    /// slots, which may be before the peer receives it (while the message fits `RINGZERO_SLOTS`
    /// slices); two ranks that each send the other more than that before receiving wait until
    /// the deadline, so exchange with [`DeviceComm::send_recv`](crate::Collectives::send_recv) — or post the calls
    /// ([`DeviceComm::send_async`](crate::NonBlocking::send_async)), which neither waits in program order nor on a first call.
    fn send(&self, buf: &B, peer: usize) -> Result<()> {
        check(self, &[(true, peer)])?;
        let s = (buf.addr(self.stream()), buf.elems());
        self.wait_async();
        // SAFETY: `buf` is borrowed for the whole call and is memory of this stream by the
        // DeviceMemory impl; the call only reads it.
        unsafe { self.core().p2p(peer, buf.dtype(), Some(s), None) }
    }

    /// Receive into `buf` what rank `peer` sends with [`DeviceComm::send`](crate::Collectives::send) (or
    /// [`DeviceComm::send_recv`](crate::Collectives::send_recv)); its count and element type must be `buf`'s.
    fn recv(&self, buf: &mut B, peer: usize) -> Result<()> {
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
    fn send_recv(&self, send: &B, recv: &mut B, peer: usize) -> Result<()> {
        check(self, &[(true, peer), (false, peer)])?;
        super::same_dtype(Collective::SendRecv, send.dtype(), recv.dtype())?;
        let s = (send.addr(self.stream()), send.elems());
        let r = (recv.addr_mut(self.stream()), recv.elems());
        self.wait_async();
        // SAFETY: `send` and `recv` are borrowed (shared and exclusive, so distinct) for the
        // whole call and are memory of this stream by the DeviceMemory impl.
        unsafe { self.core().p2p(peer, send.dtype(), Some(s), Some(r)) }
    }
}

impl<S: Stream + 'static, B: DeviceMemory<S> + Send + 'static> NonBlocking<B> for DeviceComm<S> {
    /// In-place all-reduce of an owned buffer.
    fn all_reduce_async(&self, buf: B, op: ReduceOp) -> Work<B> {
        self.submit_one(Collective::AllReduce, op, buf)
    }

    /// Reduce-scatter of `send` into `recv` (this rank's chunk); returns both.
    fn reduce_scatter_async(&self, send: B, recv: B, op: ReduceOp) -> Work<(B, B)> {
        self.submit_split(Collective::ReduceScatter, op, send, recv)
    }

    /// Reduce-scatter of `send` into `recv` (this rank's part, `counts[rank]` elements) with a
    /// part per rank, as [`DeviceComm::reduce_scatter_v`](crate::Collectives::reduce_scatter_v); returns both.
    fn reduce_scatter_v_async(
        &self,
        send: B,
        recv: B,
        counts: &[usize],
        op: ReduceOp,
    ) -> Work<(B, B)> {
        self.submit_v(Collective::ReduceScatterV, op, send, recv, counts)
    }

    /// All-gather of every rank's `send` (this rank's chunk of `recv`) into `recv`; returns both.
    fn all_gather_async(&self, send: B, recv: B) -> Work<(B, B)> {
        self.submit_split(Collective::AllGather, ReduceOp::Sum, send, recv)
    }

    /// All-gather of every rank's part (`send`, `counts[rank]` elements) into `recv`, as
    /// [`DeviceComm::all_gather_v`](crate::Collectives::all_gather_v); returns both.
    fn all_gather_v_async(&self, send: B, recv: B, counts: &[usize]) -> Work<(B, B)> {
        self.submit_v(Collective::AllGatherV, ReduceOp::Sum, send, recv, counts)
    }

    /// In-place broadcast of `root`'s buffer.
    fn broadcast_async(&self, buf: B, root: usize) -> Work<B> {
        let c = Collective::Broadcast { root };
        match self.check_root(c) {
            Ok(()) => self.submit_one(c, ReduceOp::Sum, buf),
            Err(e) => Work::failed(e),
        }
    }

    /// In-place reduce: `root`'s buffer comes back holding the result; other ranks' come back
    /// unchanged.
    fn reduce_async(&self, buf: B, op: ReduceOp, root: usize) -> Work<B> {
        let c = Collective::Reduce { root };
        match self.check_root(c) {
            Ok(()) => self.submit_one(c, op, buf),
            Err(e) => Work::failed(e),
        }
    }

    /// Send `send` to the next rank and receive the previous rank's into `recv`; returns both.
    fn ring_shift_async(&self, send: B, recv: B) -> Work<(B, B)> {
        self.submit_split(Collective::RingShift, ReduceOp::Sum, send, recv)
    }

    /// All-to-all of `send` into `recv` ([`DeviceComm::all_to_all`](crate::Collectives::all_to_all)); returns both.
    fn all_to_all_async(&self, send: B, recv: B) -> Work<(B, B)> {
        self.submit_split(Collective::AllToAll, ReduceOp::Sum, send, recv)
    }

    /// [`DeviceComm::all_to_all_v`](crate::Collectives::all_to_all_v) on owned buffers; returns both.
    fn all_to_all_v_async(
        &self,
        send: B,
        send_counts: &[usize],
        mut recv: B,
        recv_counts: &[usize],
    ) -> Work<(B, B)> {
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

    /// [`DeviceComm::send`](crate::Collectives::send) of an owned buffer (`MPI_Isend`); returns it once sent (its device
    /// work complete, the message in the peer's slots or read). Point-to-point calls queued
    /// one after another are *posted*: each message moves as soon as its link allows, even
    /// while one queued before it waits, so `recv_async` from one neighbour before `send_async`
    /// to the other, or two ranks that each `send_async` the other more than its slots hold
    /// before `recv_async`, complete — first calls included (the pairs connect within the
    /// session). Messages to one peer keep their order; a collective queued after them waits
    /// for them.
    fn send_async(&self, buf: B, peer: usize) -> Work<B> {
        if let Err(e) = check(self, &[(true, peer)]) {
            return Work::failed(e);
        }
        self.post_p2p(vec![(true, peer, buf)], super::pairs::one)
    }

    /// [`DeviceComm::recv`](crate::Collectives::recv) into an owned buffer (its length the count expected;
    /// `MPI_Irecv`), posted as [`DeviceComm::send_async`](crate::NonBlocking::send_async) is; returns it filled.
    fn recv_async(&self, buf: B, peer: usize) -> Work<B> {
        if let Err(e) = check(self, &[(false, peer)]) {
            return Work::failed(e);
        }
        self.post_p2p(vec![(false, peer, buf)], super::pairs::one)
    }

    /// [`DeviceComm::send_recv`](crate::Collectives::send_recv) on owned buffers, posted as [`DeviceComm::send_async`](crate::NonBlocking::send_async) is;
    /// returns both.
    fn send_recv_async(&self, send: B, recv: B, peer: usize) -> Work<(B, B)> {
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
