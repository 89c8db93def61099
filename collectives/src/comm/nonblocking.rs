//! The asynchronous forms of the host communicator's calls: each takes owned buffers, queues
//! the call on the communicator's worker thread and returns a [`Work`] that gives the buffers
//! back. Collectives run one at a time in the order submitted, and a blocking call waits for the
//! asynchronous ones before it, so every rank's order stays its program order. Point-to-point
//! calls queued one after another are the exception: they move at once, each as its link allows
//! (see `comm/posted.rs`).
//!
//! Bad arguments fail the `Work` at once, before the call is queued: it takes no sequence
//! number and changes nothing. Errors from the run (a peer's mismatch, a timeout, an abort)
//! arrive through [`Work::wait`] and fail the communicator as the blocking forms' do.

use ringzero_kernels::{Element, ReduceOp};

use super::pairs::{check_peers, P2pOwned};
use super::posted::Posted;
use super::{offsets, refused, same_len, Communicator};
use crate::error::Result;
use crate::ring::engine::Bufs;
use crate::ring::{Collective, Count};
use crate::work::Work;

impl Communicator {
    /// Asynchronous in-place all-reduce of an owned buffer.
    pub fn all_reduce_async<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        self.submit(move |inner| {
            let (c, n) = (Collective::AllReduce, buf.len());
            let bufs = Bufs::One(bytemuck::cast_slice_mut(&mut buf));
            inner.execute(c, Some(T::DTYPE), op, n.into(), true, bufs)?;
            Ok(buf)
        })
    }

    /// Asynchronous reduce-scatter: returns this rank's reduced chunk of `send`.
    pub fn reduce_scatter_async<T: Element>(&self, send: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        let own = self.chunk_range(send.len());
        self.submit(move |inner| {
            let mut out = vec![T::zeroed(); own.len()];
            let n = send.len();
            let bufs = Bufs::Split {
                input: bytemuck::cast_slice(&send),
                output: bytemuck::cast_slice_mut(&mut out),
            };
            inner.execute(
                Collective::ReduceScatter,
                Some(T::DTYPE),
                op,
                n.into(),
                false,
                bufs,
            )?;
            Ok(out)
        })
    }

    /// Asynchronous [`Communicator::reduce_scatter_v`]: returns this rank's part
    /// (`counts[rank]` elements) of the reduction of `send`. Bad counts fail the `Work` at once
    /// and use no sequence number.
    pub fn reduce_scatter_v_async<T: Element>(
        &self,
        send: Vec<T>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Work<Vec<T>> {
        let c = Collective::ReduceScatterV;
        let total = match offsets(c, ("counts", counts), self.size(), ("send", send.len())) {
            Ok(at) => at[counts.len()],
            Err(e) => return Work::failed(e),
        };
        let mine = counts[self.rank()];
        let counts = counts.to_vec();
        self.submit(move |inner| {
            let mut out = vec![T::zeroed(); mine];
            let bufs = Bufs::Split {
                input: bytemuck::cast_slice(&send),
                output: bytemuck::cast_slice_mut(&mut out),
            };
            let count = Count::parts(total, &counts);
            inner.execute(c, Some(T::DTYPE), op, count, false, bufs)?;
            Ok(out)
        })
    }

    /// Asynchronous all-gather of every rank's `send` into a new buffer of `count` elements
    /// (`send` must hold this rank's chunk of `count`).
    pub fn all_gather_async<T: Element>(&self, send: Vec<T>, count: usize) -> Work<Vec<T>> {
        let want = self.chunk_range(count).len();
        if let Err(e) = same_len(
            Collective::AllGather,
            send.len(),
            want,
            "send",
            "this rank's chunk of count",
        ) {
            return Work::failed(e);
        }
        self.submit(move |inner| {
            let mut out = vec![T::zeroed(); count];
            let bufs = Bufs::Split {
                input: bytemuck::cast_slice(&send),
                output: bytemuck::cast_slice_mut(&mut out),
            };
            inner.execute(
                Collective::AllGather,
                Some(T::DTYPE),
                ReduceOp::Sum,
                count.into(),
                false,
                bufs,
            )?;
            Ok(out)
        })
    }

    /// Asynchronous in-place broadcast of the root's buffer.
    pub fn broadcast_async<T: Element>(&self, mut buf: Vec<T>, root: usize) -> Work<Vec<T>> {
        let c = match self.rooted(Collective::Broadcast { root }, root) {
            Ok(c) => c,
            Err(e) => return Work::failed(e),
        };
        self.submit(move |inner| {
            let n = buf.len();
            inner.execute(
                c,
                Some(T::DTYPE),
                ReduceOp::Sum,
                n.into(),
                true,
                Bufs::One(bytemuck::cast_slice_mut(&mut buf)),
            )?;
            Ok(buf)
        })
    }

    /// Asynchronous in-place [`Communicator::reduce`]: the root's buffer comes back holding the
    /// result; other ranks' come back unchanged.
    pub fn reduce_async<T: Element>(&self, buf: Vec<T>, op: ReduceOp, root: usize) -> Work<Vec<T>> {
        match self.rooted(Collective::Reduce { root }, root) {
            Ok(c) => self.in_place_async(c, op, buf),
            Err(e) => Work::failed(e),
        }
    }

    /// Asynchronous in-place [`Communicator::ring_shift`]: the buffer goes to the next rank and
    /// comes back holding the previous rank's.
    pub fn ring_shift_async<T: Element>(&self, buf: Vec<T>) -> Work<Vec<T>> {
        self.in_place_async(Collective::RingShift, ReduceOp::Sum, buf)
    }

    /// Asynchronous [`Communicator::barrier`]: the `Work` completes once every rank has entered
    /// the barrier.
    pub fn barrier_async(&self) -> Work<()> {
        self.submit(|inner| {
            let bufs = Bufs::One(&mut []);
            inner.execute(
                Collective::Barrier,
                None,
                ReduceOp::Sum,
                0.into(),
                false,
                bufs,
            )
        })
    }

    /// Asynchronous [`Communicator::all_to_all`]: returns the blocks received, in rank order.
    pub fn all_to_all_async<T: Element>(&self, send: Vec<T>) -> Work<Vec<T>> {
        if let Err(e) = self.whole_blocks(send.len()) {
            return Work::failed(e);
        }
        self.submit(move |inner| {
            let mut out = vec![T::zeroed(); send.len()];
            let input = bytemuck::cast_slice(&send);
            inner.all_to_all(
                T::DTYPE,
                send.len(),
                input,
                bytemuck::cast_slice_mut(&mut out),
            )?;
            Ok(out)
        })
    }

    /// Asynchronous [`Communicator::all_to_all_v`]: returns the blocks received (the sum of
    /// `recv_counts`), in rank order.
    pub fn all_to_all_v_async<T: Element>(
        &self,
        send: Vec<T>,
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> Work<Vec<T>> {
        let c = Collective::AllToAllV;
        let total = sum(recv_counts);
        let prepared = self
            .all_to_all_v_layout((send_counts, send.len()), (recv_counts, total))
            .and_then(|at| Ok((at, zeroed::<T>(c, "recv", total)?)));
        let ((sd, rd), mut out) = match prepared {
            Ok(p) => p,
            Err(e) => return Work::failed(e),
        };
        self.submit(move |inner| {
            let send = bytemuck::cast_slice(&send);
            inner.all_to_all_v(
                T::DTYPE,
                (send, &sd),
                (bytemuck::cast_slice_mut(&mut out), &rd),
            )?;
            Ok(out)
        })
    }

    /// Asynchronous [`Communicator::all_gather_v`]: returns every rank's part (the sum of
    /// `counts`), in rank order.
    pub fn all_gather_v_async<T: Element>(&self, send: Vec<T>, counts: &[usize]) -> Work<Vec<T>> {
        let c = Collective::AllGatherV;
        let total = sum(counts);
        let prepared = self
            .all_gather_v_layout(send.len(), (counts, total))
            .and_then(|at| Ok((at, zeroed::<T>(c, "recv", total)?)));
        let (at, mut out) = match prepared {
            Ok(p) => p,
            Err(e) => return Work::failed(e),
        };
        self.submit(move |inner| {
            let send = bytemuck::cast_slice(&send);
            let out_bytes = bytemuck::cast_slice_mut(&mut out);
            inner.all_gather_v(inner.cfg.algo, T::DTYPE, Some(send), out_bytes, &at)?;
            Ok(out)
        })
    }

    /// Asynchronous [`Communicator::gather`]: the root gets every rank's `send` in rank order
    /// (`size()` × `send.len()` elements); other ranks get an empty `Vec`.
    pub fn gather_async<T: Element>(&self, send: Vec<T>, root: usize) -> Work<Vec<T>> {
        let c = Collective::Gather { root };
        let len = if self.rank() == root {
            send.len().saturating_mul(self.size())
        } else {
            0
        };
        let prepared = self
            .blocks_check(c, ("send", send.len()), ("recv", len))
            .and_then(|()| zeroed::<T>(c, "recv", len));
        let mut out = match prepared {
            Ok(out) => out,
            Err(e) => return Work::failed(e),
        };
        self.submit(move |inner| {
            let send = bytemuck::cast_slice(&send);
            inner.gather(T::DTYPE, send, bytemuck::cast_slice_mut(&mut out), root)?;
            Ok(out)
        })
    }

    /// Asynchronous [`Communicator::scatter`]: returns this rank's block (`count` elements) of
    /// the root's `send` (`size()` × `count` elements; other ranks pass an empty `Vec`).
    pub fn scatter_async<T: Element>(
        &self,
        send: Vec<T>,
        count: usize,
        root: usize,
    ) -> Work<Vec<T>> {
        let c = Collective::Scatter { root };
        let prepared = self
            .blocks_check(c, ("recv", count), ("send", send.len()))
            .and_then(|()| zeroed::<T>(c, "recv", count));
        let mut out = match prepared {
            Ok(out) => out,
            Err(e) => return Work::failed(e),
        };
        self.submit(move |inner| {
            let recv = bytemuck::cast_slice_mut(&mut out);
            inner.scatter(T::DTYPE, bytemuck::cast_slice(&send), recv, root)?;
            Ok(out)
        })
    }

    /// Asynchronous [`Communicator::send`] (`MPI_Isend`): the buffer comes back once the
    /// message has left (or is held by the link: see `send`). Point-to-point calls queued one
    /// after another are independent: each message moves as soon as its link allows, even while
    /// one queued before it waits, so two ranks that each `send_async` the other a large message
    /// before `recv_async`, or that `recv_async` from one neighbour before `send_async` to the
    /// other, complete. Messages to one peer keep their order; a collective queued after them
    /// waits for them; the `Work` completes once this message has moved.
    pub fn send_async<T: Element>(&self, buf: Vec<T>, peer: usize) -> Work<Vec<T>> {
        self.p2p_async(vec![P2pOwned::Send(buf, peer)], |mut m| match m.pop() {
            Some(P2pOwned::Send(b, _)) => b,
            _ => unreachable!("one send in, one send out"),
        })
    }

    /// Asynchronous [`Communicator::recv`] (`MPI_Irecv`) into `buf` (its length the count
    /// expected); independent of the calls queued beside it, as for [`Communicator::send_async`].
    pub fn recv_async<T: Element>(&self, buf: Vec<T>, peer: usize) -> Work<Vec<T>> {
        self.p2p_async(vec![P2pOwned::Recv(buf, peer)], |mut m| match m.pop() {
            Some(P2pOwned::Recv(b, _)) => b,
            _ => unreachable!("one receive in, one receive out"),
        })
    }

    /// Asynchronous [`Communicator::send_recv`]: returns `send` and the filled `recv`.
    pub fn send_recv_async<T: Element>(
        &self,
        send: Vec<T>,
        recv: Vec<T>,
        peer: usize,
    ) -> Work<(Vec<T>, Vec<T>)> {
        let msgs = vec![P2pOwned::Send(send, peer), P2pOwned::Recv(recv, peer)];
        self.p2p_async(msgs, |m| {
            let mut m = m.into_iter();
            match (m.next(), m.next()) {
                (Some(P2pOwned::Send(s, _)), Some(P2pOwned::Recv(r, _))) => (s, r),
                _ => unreachable!("a send and a receive in, the same out"),
            }
        })
    }

    /// Asynchronous [`Communicator::send_recv_batch`] (torch's `batch_isend_irecv`): returns the
    /// messages in the order given, each receive's buffer filled.
    pub fn send_recv_batch_async<T: Element>(
        &self,
        msgs: Vec<P2pOwned<T>>,
    ) -> Work<Vec<P2pOwned<T>>> {
        self.p2p_async(msgs, |m| m)
    }

    /// Post a point-to-point call on `msgs` (see `comm/posted.rs`: posted calls move at once,
    /// whatever else is posted); the `Work` gives back `finish(msgs)`.
    fn p2p_async<T: Element, R: Send + 'static>(
        &self,
        msgs: Vec<P2pOwned<T>>,
        finish: impl FnOnce(Vec<P2pOwned<T>>) -> R + Send + 'static,
    ) -> Work<R> {
        if let Err(e) = check_peers(self.size(), self.rank(), msgs.iter().map(P2pOwned::peer)) {
            return Work::failed(e);
        }
        let inner = self.inner.clone();
        self.worker.post(
            |fill| Posted::new(msgs, move |r, msgs| fill(r.map(|()| finish(msgs)))),
            move |first, ticket, feed| inner.run_posted(first, ticket, feed),
        )
    }

    /// Queue ring collective `c` in place on `buf`; the `Work` gives `buf` back.
    fn in_place_async<T: Element>(
        &self,
        c: Collective,
        op: ReduceOp,
        mut buf: Vec<T>,
    ) -> Work<Vec<T>> {
        self.submit(move |inner| {
            let n = buf.len();
            let bufs = Bufs::One(bytemuck::cast_slice_mut(&mut buf));
            inner.execute(c, Some(T::DTYPE), op, n.into(), true, bufs)?;
            Ok(buf)
        })
    }
}

/// The sum of `counts`, or `usize::MAX` where it overflows (which [`offsets`] then refuses,
/// naming the counts).
fn sum(counts: &[usize]) -> usize {
    counts
        .iter()
        .try_fold(0usize, |a, &k| a.checked_add(k))
        .unwrap_or(usize::MAX)
}

/// A zeroed buffer of `len` elements for `c`'s output `what`, or an error that says it cannot
/// be allocated (counts that add up to more than memory holds are bad input, not a crash).
fn zeroed<T: Element>(c: Collective, what: &str, len: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    if v.try_reserve_exact(len).is_err() {
        let bytes = len as u128 * std::mem::size_of::<T>() as u128;
        return Err(refused(
            c,
            format!("{what} would need {len} elements ({bytes} bytes), more than can be allocated"),
        ));
    }
    v.resize(len, T::zeroed());
    Ok(v)
}
