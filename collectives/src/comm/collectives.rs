//! The host communicator's collectives on borrowed buffers: checked, then run on the ring, a
//! doubling schedule or the pairwise links ([`super::inner`]).

use ringzero_kernels::{Element, ReduceOp};

use crate::config::Algo;
use crate::error::{Error, Result};
use crate::input::Input;
use crate::ring::engine::Bufs;
use crate::ring::{Collective, Count};
use crate::work::Work;

use super::*;

impl Communicator {
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
    ///
    /// With [`InPlace`](crate::InPlace) as `send`, `recv` holds the input and gets the result.
    /// [`Communicator::with_algo`] picks the algorithm for one call.
    pub fn all_reduce<'a, T: Element>(
        &self,
        send: impl Into<Input<'a, [T]>>,
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.by_config().all_reduce(send, recv, op)
    }

    /// Reduce every rank's `send` and leave chunk [`chunk_range`](Self::chunk_range)`(send.len())`
    /// of the result in `recv`, which must have exactly that length.
    ///
    /// With [`InPlace`](crate::InPlace) as `send`, `recv` is the whole input; the reduced chunk
    /// [`chunk_range`](Self::chunk_range)`(recv.len())` is written over that part of it and the
    /// rest is left as it was.
    pub fn reduce_scatter<'a, T: Element>(
        &self,
        send: impl Into<Input<'a, [T]>>,
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
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
    pub fn reduce_scatter_v<'a, T: Element>(
        &self,
        send: impl Into<Input<'a, [T]>>,
        recv: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
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
    pub fn all_gather<'a, T: Element>(
        &self,
        send: impl Into<Input<'a, [T]>>,
        recv: &mut [T],
    ) -> Result<()> {
        let c = Collective::AllGather;
        let Input::Buf(send) = send.into() else {
            return self.run_one(c, None, recv.len(), recv);
        };
        let want = self.chunk_range(recv.len()).len();
        same_len(c, send.len(), want, "send", "this rank's chunk of recv")?;
        self.run_split(c, None, recv.len(), send, recv)
    }

    /// Copy the root's `send` into every rank's `recv`. On other ranks `send` is not read (and may
    /// be empty); on the root it must be as long as `recv`.
    ///
    /// It goes down the ring's pipelined chain (`n − 1` hops, slice after slice), or with
    /// [`Algo::Doubling`] (`RINGZERO_ALGO=doubling`) down a binomial tree: `⌈log2 n⌉` rounds, the
    /// holders doubling each round, which shortens one call but sends `log2 n` copies from the
    /// root, so back-to-back calls no longer pipeline.
    ///
    /// With [`InPlace`](crate::InPlace) as `send`, the root's `recv` is what every rank gets.
    pub fn broadcast<'a, T: Element>(
        &self,
        send: impl Into<Input<'a, [T]>>,
        recv: &mut [T],
        root: usize,
    ) -> Result<()> {
        self.by_config().broadcast(send, recv, root)
    }

    /// Reduce every rank's `send` into the root's `recv` (as long as `send`). On other ranks
    /// `recv` is not written (and may be empty).
    ///
    /// It goes up the ring's chain, or with [`Algo::Doubling`] up a binomial tree, as
    /// [`Communicator::broadcast`] goes down them; the two reduce in different (fixed) orders,
    /// so a sum may round differently between them.
    ///
    /// With [`InPlace`](crate::InPlace) as `send`, every rank's `recv` is its input and the root's
    /// gets the result; other ranks' buffers are unchanged.
    pub fn reduce<'a, T: Element>(
        &self,
        send: impl Into<Input<'a, [T]>>,
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.by_config().reduce(send, recv, op, root)
    }

    /// Send `send` to the next rank and receive the previous rank's buffer into `recv` (same
    /// length on every rank). Every link carries data at once: this is the ring's raw streaming
    /// rate, and the exchange step of ring attention.
    ///
    /// With [`InPlace`](crate::InPlace) as `send`, `recv` is sent and then overwritten.
    pub fn ring_shift<'a, T: Element>(
        &self,
        send: impl Into<Input<'a, [T]>>,
        recv: &mut [T],
    ) -> Result<()> {
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
    /// for the pairwise collectives (see [`Communicator::all_to_all_v`]), which the first
    /// all-to-all connects, after its ring exchange. Each rank sends (n−1)/n of its buffer.
    ///
    /// With [`InPlace`](crate::InPlace) as `send`, `recv`'s blocks are sent from a copy of it this
    /// call makes, then replaced by the blocks received.
    pub fn all_to_all<'a, T: Element>(
        &self,
        send: impl Into<Input<'a, [T]>>,
        recv: &mut [T],
    ) -> Result<()> {
        let copy;
        let send = match send.into() {
            Input::Buf(send) => send,
            Input::InPlace => {
                copy = recv.to_vec();
                &copy[..]
            }
        };
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

    /// Return only once every rank has entered the barrier. On three ranks or more it is a
    /// dissemination barrier (`⌈log2 n⌉` rounds of empty messages), else the ring's (`n − 1`
    /// hops): see [`Algo`] (`RINGZERO_ALGO`).
    pub fn barrier(&self) -> Result<()> {
        self.by_config().barrier()
    }

    /// Refuse an all-to-all buffer of `len` elements that does not split into one block per rank.
    pub(super) fn whole_blocks(&self, len: usize) -> Result<()> {
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

    pub(super) fn rooted(&self, c: Collective, root: usize) -> Result<Collective> {
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

    pub(super) fn run_split<T: Element>(
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
    pub(super) fn run_split_by<T: Element>(
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

    pub(super) fn run_one<T: Element>(
        &self,
        c: Collective,
        op: Option<ReduceOp>,
        count: usize,
        buf: &mut [T],
    ) -> Result<()> {
        self.run_one_by(self.inner.cfg.algo, c, op, count, buf)
    }

    /// [`Communicator::run_one`] by `algo`.
    pub(super) fn run_one_by<T: Element>(
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

    pub(super) fn submit<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Inner) -> Result<R> + Send + 'static,
    ) -> Work<R> {
        let inner = self.inner.clone();
        self.worker.submit(move || f(&inner))
    }

    /// Wait until every asynchronous collective submitted so far has finished.
    pub(super) fn wait_async_idle(&self) {
        self.worker.wait_idle();
    }
}
