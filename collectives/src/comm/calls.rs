//! The host communicator's collectives: [`Collectives`] on host slices, checked, then run on the
//! ring, a doubling schedule or the pairwise links ([`super::inner`]).

use ringzero_kernels::{Element, ReduceOp};

use crate::calls::Collectives;
use crate::error::Result;
use crate::input::Input;
use crate::ring::engine::Bufs;
use crate::ring::{Collective, Count};

use super::pairs::P2p;
use super::*;

impl<T: Element> Collectives<[T]> for Communicator {
    /// Sum (or other `op`) of every rank's `send` into every rank's `recv`.
    ///
    /// On three ranks or more, small buffers (up to `RINGZERO_DOUBLING_MAX`, 64 KiB by default)
    /// go by recursive doubling (`log2 n` exchanges, each of the whole buffer, with one partner
    /// at a time), middle ones (up to `RINGZERO_HALVING_MAX`, 256 KiB) by halving-doubling (the
    /// same partners, halves of the buffer down and back up: `2 log2 n` exchanges moving the
    /// ring's bytes), larger ones round the ring (`2(n − 1)` hops of `1/n` of it): see [`Algo`](crate::Algo)
    /// (`RINGZERO_ALGO`). Each leaves every rank bit-identical, in an order fixed by the world
    /// size and the count; the two doubling schedules share one order and the ring has another,
    /// so a sum may round differently on either side of `RINGZERO_HALVING_MAX`.
    ///
    /// With [`InPlace`](crate::InPlace) as `send`, `recv` holds the input and gets the result.
    /// [`Communicator::with_algo`] picks the algorithm for one call.
    fn all_reduce<'a>(
        &self,
        send: impl Into<Input<'a, [T]>>,
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()>
    where
        [T]: 'a,
    {
        self.by_config().all_reduce(send, recv, op)
    }

    /// Reduce every rank's `send` and leave chunk [`chunk_range`](Self::chunk_range)`(send.len())`
    /// of the result in `recv`, which must have exactly that length.
    ///
    /// With [`InPlace`](crate::InPlace) as `send`, `recv` is the whole input; the reduced chunk
    /// [`chunk_range`](Self::chunk_range)`(recv.len())` is written over that part of it and the
    /// rest is left as it was.
    fn reduce_scatter<'a>(
        &self,
        send: impl Into<Input<'a, [T]>>,
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()>
    where
        [T]: 'a,
    {
        let c = Collective::ReduceScatter;
        let Input::Buf(send) = send.into() else {
            return self.run_one(c, Some(op), recv.len(), recv);
        };
        let want = self.chunk_range(send.len()).len();
        same_len(c, want, recv.len(), "this rank's chunk of send", "recv")?;
        self.run_split(c, Some(op), send.len(), send, recv)
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
    ///
    /// With [`InPlace`](crate::InPlace) as `send`, `recv` is the whole input; this rank's part of
    /// it (`counts[rank]` elements after the parts of the ranks before it) is overwritten with
    /// the reduction and the rest is left as it was.
    fn reduce_scatter_v<'a>(
        &self,
        send: impl Into<Input<'a, [T]>>,
        recv: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()>
    where
        [T]: 'a,
    {
        let c = Collective::ReduceScatterV;
        let (bufs, in_place, at) = match send.into() {
            Input::Buf(send) => {
                let at = offsets(c, ("counts", counts), self.size(), ("send", send.len()))?;
                own_part(c, ("recv", recv.len()), counts, self.rank())?;
                let bufs = Bufs::Split {
                    input: bytemuck::cast_slice(send),
                    output: bytemuck::cast_slice_mut(recv),
                };
                (bufs, false, at)
            }
            Input::InPlace => {
                let at = offsets(c, ("counts", counts), self.size(), ("recv", recv.len()))?;
                (Bufs::One(bytemuck::cast_slice_mut(recv)), true, at)
            }
        };
        self.wait_async_idle();
        let count = Count::parts(at[counts.len()], counts);
        self.inner
            .execute(c, Some(T::DTYPE), op, count, in_place, bufs)
    }

    /// Gather every rank's `send` (chunk [`chunk_range`](Self::chunk_range)`(recv.len())` of the
    /// result, so its length must match) into every rank's `recv`.
    ///
    /// With [`InPlace`](crate::InPlace) as `send`, this rank's chunk of `recv` is sent and every
    /// other chunk is overwritten.
    ///
    /// Where every ring edge is shared memory, a result from
    /// [`Config::single_copy_from`](crate::Config::single_copy_from) bytes (64 KiB by default)
    /// to below [`Config::single_copy_below`](crate::Config::single_copy_below) (no bound by
    /// default) is gathered in one copy: each rank reads the others' chunks straight out of
    /// their processes (`process_vm_readv`) instead of passing them round the ring's slots
    /// ([`Communicator::single_copy_sizes`] says which sizes do).
    fn all_gather<'a>(&self, send: impl Into<Input<'a, [T]>>, recv: &mut [T]) -> Result<()>
    where
        [T]: 'a,
    {
        let c = Collective::AllGather;
        let Input::Buf(send) = send.into() else {
            return self.run_one(c, None, recv.len(), recv);
        };
        let want = self.chunk_range(recv.len()).len();
        same_len(c, send.len(), want, "send", "this rank's chunk of recv")?;
        self.run_split(c, None, recv.len(), send, recv)
    }

    /// All-gather of parts of different sizes (`MPI_Allgatherv`; gathering per-rank results of
    /// varying length, or shards that do not split evenly): rank `i` contributes `counts[i]`
    /// elements (`send` holds this rank's), and `recv` (the sum of `counts`) ends with every
    /// rank's part in rank order, on every rank. Parts may be empty.
    ///
    /// Two algorithms, chosen alike on every rank from the result's size (`counts` are the same
    /// everywhere) and the number of nodes by
    /// [`Algo::gathers_v_pairwise`](crate::Algo::gathers_v_pairwise):
    /// - *pairwise* on one node (three ranks or more), and for results up to
    ///   `RINGZERO_PAIRWISE_MAX` (512 KiB by default) across nodes: every rank sends its part to
    ///   every other rank at once over the point-to-point links (see
    ///   [`Communicator::all_to_all_v`](crate::Collectives::all_to_all_v)), one step;
    /// - *the ring* otherwise: the all-gather's ring over the given parts, `n − 1` pipelined
    ///   hops over the links every collective uses (as [`Communicator::reduce_scatter_v`](crate::Collectives::reduce_scatter_v) runs
    ///   the reduce-scatter's), crossing each node's boundary once where the pairs cross it
    ///   for every pair of ranks on two nodes; ranks that pass different counts fail at the
    ///   first frame (the counts' digest is in the call's fingerprint).
    ///
    /// [`Communicator::all_gather`](crate::Collectives::all_gather) is the form for balanced chunks.
    ///
    /// With [`InPlace`](crate::InPlace) as `send`, this rank's part of `recv` (`counts[rank]`
    /// elements after the parts of the ranks before it) is sent and every other part is
    /// overwritten. [`Communicator::with_algo`] picks the algorithm for one call.
    fn all_gather_v<'a>(
        &self,
        send: impl Into<Input<'a, [T]>>,
        recv: &mut [T],
        counts: &[usize],
    ) -> Result<()>
    where
        [T]: 'a,
    {
        self.by_config().all_gather_v(send, recv, counts)
    }

    /// Copy the root's `send` into every rank's `recv`. On other ranks `send` is not read (and may
    /// be empty); on the root it must be as long as `recv`.
    ///
    /// It goes down the ring's pipelined chain (`n − 1` hops, slice after slice), or with
    /// [`Algo::Doubling`](crate::Algo::Doubling) (`RINGZERO_ALGO=doubling`) down a binomial tree: `⌈log2 n⌉` rounds, the
    /// holders doubling each round, which shortens one call but sends `log2 n` copies from the
    /// root, so back-to-back calls no longer pipeline.
    ///
    /// With [`InPlace`](crate::InPlace) as `send`, the root's `recv` is what every rank gets.
    fn broadcast<'a>(
        &self,
        send: impl Into<Input<'a, [T]>>,
        recv: &mut [T],
        root: usize,
    ) -> Result<()>
    where
        [T]: 'a,
    {
        self.by_config().broadcast(send, recv, root)
    }

    /// Reduce every rank's `send` into the root's `recv` (as long as `send`). On other ranks
    /// `recv` is not written (and may be empty).
    ///
    /// It goes up the ring's chain, or with [`Algo::Doubling`](crate::Algo::Doubling) up a binomial tree, as
    /// [`Communicator::broadcast`](crate::Collectives::broadcast) goes down them; the two reduce in different (fixed) orders,
    /// so a sum may round differently between them.
    ///
    /// With [`InPlace`](crate::InPlace) as `send`, every rank's `recv` is its input and the root's
    /// gets the result; other ranks' buffers are unchanged.
    fn reduce<'a>(
        &self,
        send: impl Into<Input<'a, [T]>>,
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()>
    where
        [T]: 'a,
    {
        self.by_config().reduce(send, recv, op, root)
    }

    /// Send `send` to the next rank and receive the previous rank's buffer into `recv` (same
    /// length on every rank). Every link carries data at once: this is the ring's raw streaming
    /// rate, and the exchange step of ring attention.
    ///
    /// With [`InPlace`](crate::InPlace) as `send`, `recv` is sent and then overwritten.
    fn ring_shift<'a>(&self, send: impl Into<Input<'a, [T]>>, recv: &mut [T]) -> Result<()>
    where
        [T]: 'a,
    {
        let c = Collective::RingShift;
        let Input::Buf(send) = send.into() else {
            return self.run_one(c, None, recv.len(), recv);
        };
        same_len(c, send.len(), recv.len(), "send", "recv")?;
        self.run_split(c, None, send.len(), send, recv)
    }

    /// All-to-all: block `j` of `send` goes to rank `j`, and block `i` of `recv` comes from rank
    /// `i` (`send` and `recv` hold the same number of elements, a multiple of the world size; a
    /// block is that number over the world size). A rank's own block is copied locally.
    ///
    /// A ring has no all-to-all schedule, so every rank exchanges a block with every other rank
    /// at once, as NCCL's grouped sends and receives do: the next rank's block goes out and the
    /// previous rank's comes in over the ring's own links (so a rank that calls a ring collective
    /// instead fails at once, both calls named), every other block over links each pair keeps
    /// for the pairwise collectives (see [`Communicator::all_to_all_v`](crate::Collectives::all_to_all_v)), which the first
    /// all-to-all connects, after its ring exchange. Each rank sends (n−1)/n of its buffer.
    ///
    /// With [`InPlace`](crate::InPlace) as `send`, `recv`'s blocks are sent from a copy of it this
    /// call makes, then replaced by the blocks received. The communicator keeps that copy's
    /// memory for the next in-place all-to-all (as many bytes as the largest one so far), so
    /// repeated calls do not fault in a fresh buffer each time.
    fn all_to_all<'a>(&self, send: impl Into<Input<'a, [T]>>, recv: &mut [T]) -> Result<()>
    where
        [T]: 'a,
    {
        let c = Collective::AllToAll;
        let count = recv.len();
        let send = send.into();
        if let Input::Buf(send) = &send {
            same_len(c, send.len(), count, "send", "recv")?;
        }
        self.whole_blocks(count)?;
        self.wait_async_idle();
        let recv = bytemuck::cast_slice_mut::<T, u8>(recv);
        match send {
            Input::Buf(send) => {
                self.inner
                    .all_to_all(T::DTYPE, count, bytemuck::cast_slice(send), recv)
            }
            Input::InPlace => {
                let mut kept = self
                    .inner
                    .a2a_copy
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                if kept.len() < recv.len() {
                    kept.resize(recv.len(), 0);
                }
                let copy = &mut kept[..recv.len()];
                copy.copy_from_slice(recv);
                self.inner.all_to_all(T::DTYPE, count, copy, recv)
            }
        }
    }

    /// All-to-all with a count per pair of ranks (`MPI_Alltoallv`; torch's `all_to_all_single`
    /// with split sizes; the token exchange of a mixture-of-experts layer). `send` holds, in rank
    /// order, `send_counts[j]` elements for each rank `j`; `recv` receives, in rank order,
    /// `recv_counts[i]` elements from each rank `i`. Counts may be zero. `recv_counts[i]` must
    /// be what rank `i` sends this rank (else both fail with an [`Error::Mismatch`](crate::Error::Mismatch) naming the
    /// two counts); this rank's own block is copied locally, so `send_counts[rank]` must equal
    /// `recv_counts[rank]`.
    ///
    /// Every pair of ranks exchanges at once over its point-to-point links (connected by the
    /// first call that needs them; see the module `pairs`), where [`Communicator::all_to_all`](crate::Collectives::all_to_all)
    /// runs `n − 1` ring exchanges one after the other. A rank that calls a ring collective
    /// instead fails at once, both calls named (see `Inner::pairwise`).
    fn all_to_all_v(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        let at = self.all_to_all_v_layout((send_counts, send.len()), (recv_counts, recv.len()))?;
        self.wait_async_idle();
        let (send, recv) = (bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv));
        self.inner
            .all_to_all_v(T::DTYPE, (send, &at.0), (recv, &at.1))
    }

    /// Gather (`MPI_Gather`): the root's `recv` (`size()` times `send.len()` elements) ends with
    /// every rank's `send` in rank order. Every rank's `send` has the same length (a rank that
    /// disagrees fails with an [`Error::Mismatch`](crate::Error::Mismatch)); `recv` is read only on the root (pass an
    /// empty slice elsewhere). The ranks send to the root at once, over their point-to-point
    /// links with it.
    fn gather(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        let c = Collective::Gather { root };
        self.blocks_check(c, ("send", send.len()), ("recv", recv.len()))?;
        self.wait_async_idle();
        let (send, recv) = (bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv));
        self.inner.gather(T::DTYPE, send, recv, root)
    }

    /// Scatter (`MPI_Scatter`): rank `i`'s `recv` ends with block `i` of the root's `send`
    /// (`size()` blocks of `recv.len()` elements). Every rank's `recv` has the same length (a
    /// rank that disagrees fails with an [`Error::Mismatch`](crate::Error::Mismatch)); `send` is read only on the root
    /// (pass an empty slice elsewhere). The root sends to every rank at once.
    fn scatter(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        let c = Collective::Scatter { root };
        self.blocks_check(c, ("recv", recv.len()), ("send", send.len()))?;
        self.wait_async_idle();
        let (send, recv) = (bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv));
        self.inner.scatter(T::DTYPE, send, recv, root)
    }

    /// Send `buf` to rank `peer`, which receives it with [`Communicator::recv`](crate::Collectives::recv) (or
    /// [`Communicator::send_recv`](crate::Collectives::send_recv)) of the same element type and count.
    ///
    /// Point-to-point calls are not collectives: only the two ranks take part, over links of
    /// their own, so they mix freely with collectives. The pair's first call (whichever of the
    /// three each rank makes) connects those links straight between the two ranks (same
    /// handshake and shm/tcp choice as the ring; rank 0's store is not needed), and both ranks
    /// must reach it before either goes on (a rank waiting there connects the ranks that call it
    /// meanwhile too, so first calls that form a cycle — every rank sending to the one before
    /// it — meet); later calls need no rendezvous. Messages from one
    /// rank to another arrive in the order they were sent. Like `MPI_Send`, a send may return
    /// before the receiver has called `recv` (while the message fits the link's `RINGZERO_SLOTS`
    /// × `RINGZERO_SLICE_BYTES`), or wait for it: two ranks that each send the other a large
    /// message before receiving wait until the deadline, so exchange with
    /// [`Communicator::send_recv`](crate::Collectives::send_recv).
    ///
    /// A receiver expecting another count or element type fails with an [`Error::Mismatch`]
    /// naming both calls; a peer that never makes its call fails this one at the deadline; any
    /// error aborts the communicator, as a collective's does. Point-to-point calls are not
    /// entries of the flight record (its sequence numbers are the collectives'); its `p2p`
    /// keeps each peer's traffic instead: messages finished each way, and those pending.
    fn send(&self, buf: &[T], peer: usize) -> Result<()> {
        self.send_recv_batch(&mut [P2p::Send(buf, peer)])
    }

    /// Receive into `buf` what rank `peer` sends with [`Communicator::send`](crate::Collectives::send) (or
    /// [`Communicator::send_recv`](crate::Collectives::send_recv)); its count and element type must be `buf`'s. Returns once
    /// the whole message is in `buf`. See [`Communicator::send`](crate::Collectives::send).
    fn recv(&self, buf: &mut [T], peer: usize) -> Result<()> {
        self.send_recv_batch(&mut [P2p::Recv(buf, peer)])
    }

    /// Send `send` to rank `peer` and receive `recv` from it at once (`MPI_Sendrecv` with one
    /// peer; pipeline stages trading activations for gradients). The two directions interleave
    /// slice by slice, so two ranks exchanging messages of any size never wait on each other.
    /// The counts may differ; each must match what the peer sends or expects. To send to one
    /// neighbour while receiving from the other, use [`Communicator::ring_shift`](crate::Collectives::ring_shift).
    fn send_recv(&self, send: &[T], recv: &mut [T], peer: usize) -> Result<()> {
        self.send_recv_batch(&mut [P2p::Send(send, peer), P2p::Recv(recv, peer)])
    }
}
