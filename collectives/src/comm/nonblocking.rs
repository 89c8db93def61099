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

use crate::calls::NonBlocking;

use super::pairs::{check_peers, P2pOwned};
use super::posted::Posted;
use super::{offsets, own_part, same_len, Communicator};
use crate::error::Result;
use crate::ring::engine::Bufs;
use crate::ring::{Collective, Count};
use crate::work::Work;

impl Communicator {
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

    /// Asynchronous [`Communicator::gather`](crate::Collectives::gather): returns `send` and `recv`, which on the root holds
    /// every rank's `send` in rank order (other ranks pass an empty `recv`).
    pub fn gather_async<T: Element>(
        &self,
        send: Vec<T>,
        mut recv: Vec<T>,
        root: usize,
    ) -> Work<(Vec<T>, Vec<T>)> {
        let c = Collective::Gather { root };
        if let Err(e) = self.blocks_check(c, ("send", send.len()), ("recv", recv.len())) {
            return Work::failed(e);
        }
        self.submit(move |inner| {
            let output = bytemuck::cast_slice_mut(&mut recv);
            inner.gather(T::DTYPE, bytemuck::cast_slice(&send), output, root)?;
            Ok((send, recv))
        })
    }

    /// Asynchronous [`Communicator::scatter`](crate::Collectives::scatter): returns `send` and `recv`, which holds this
    /// rank's block of the root's `send` (other ranks pass an empty `send`).
    pub fn scatter_async<T: Element>(
        &self,
        send: Vec<T>,
        mut recv: Vec<T>,
        root: usize,
    ) -> Work<(Vec<T>, Vec<T>)> {
        let c = Collective::Scatter { root };
        if let Err(e) = self.blocks_check(c, ("recv", recv.len()), ("send", send.len())) {
            return Work::failed(e);
        }
        self.submit(move |inner| {
            let output = bytemuck::cast_slice_mut(&mut recv);
            inner.scatter(T::DTYPE, bytemuck::cast_slice(&send), output, root)?;
            Ok((send, recv))
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

    /// Queue ring collective `c` (its buffers `checked` by the caller) from `send` into `recv`
    /// on `total` elements (in `parts` for a v-collective); the `Work` gives both back.
    fn split_async<T: Element>(
        &self,
        checked: Result<()>,
        c: Collective,
        op: Option<ReduceOp>,
        (total, parts): (usize, Option<Vec<usize>>),
        send: Vec<T>,
        mut recv: Vec<T>,
    ) -> Work<(Vec<T>, Vec<T>)> {
        if let Err(e) = checked {
            return Work::failed(e);
        }
        self.submit(move |inner| {
            let count = match &parts {
                Some(parts) => Count::parts(total, parts),
                None => total.into(),
            };
            let bufs = Bufs::Split {
                input: bytemuck::cast_slice(&send),
                output: bytemuck::cast_slice_mut(&mut recv),
            };
            let op = op.unwrap_or(ReduceOp::Sum);
            inner.execute(c, Some(T::DTYPE), op, count, false, bufs)?;
            Ok((send, recv))
        })
    }
}

impl<T: Element> NonBlocking<Vec<T>> for Communicator {
    /// Asynchronous in-place [`Communicator::all_reduce`](crate::Collectives::all_reduce) of an owned buffer.
    fn all_reduce_async(&self, buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        self.in_place_async(Collective::AllReduce, op, buf)
    }

    /// Asynchronous [`Communicator::reduce_scatter`](crate::Collectives::reduce_scatter): returns `send` and `recv`, which holds
    /// this rank's reduced chunk of `send`.
    fn reduce_scatter_async(
        &self,
        send: Vec<T>,
        recv: Vec<T>,
        op: ReduceOp,
    ) -> Work<(Vec<T>, Vec<T>)> {
        let c = Collective::ReduceScatter;
        let want = self.chunk_range(send.len()).len();
        let checked = same_len(c, want, recv.len(), "this rank's chunk of send", "recv");
        let count = (send.len(), None);
        self.split_async(checked, c, Some(op), count, send, recv)
    }

    /// Asynchronous [`Communicator::reduce_scatter_v`](crate::Collectives::reduce_scatter_v): returns `send` and `recv`, which holds
    /// this rank's part (`counts[rank]` elements) of the reduction.
    fn reduce_scatter_v_async(
        &self,
        send: Vec<T>,
        recv: Vec<T>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Work<(Vec<T>, Vec<T>)> {
        let c = Collective::ReduceScatterV;
        let checked =
            offsets(c, ("counts", counts), self.size(), ("send", send.len())).and_then(|at| {
                own_part(c, ("recv", recv.len()), counts, self.rank())?;
                Ok(at)
            });
        let count = match &checked {
            Ok(at) => (at[counts.len()], Some(counts.to_vec())),
            Err(_) => (0, None),
        };
        self.split_async(checked.map(drop), c, Some(op), count, send, recv)
    }

    /// Asynchronous [`Communicator::all_gather`](crate::Collectives::all_gather): returns `send` and `recv`, which holds every
    /// rank's chunk (`send` is this rank's chunk of `recv`).
    fn all_gather_async(&self, send: Vec<T>, recv: Vec<T>) -> Work<(Vec<T>, Vec<T>)> {
        let c = Collective::AllGather;
        let want = self.chunk_range(recv.len()).len();
        let checked = same_len(c, send.len(), want, "send", "this rank's chunk of recv");
        let count = (recv.len(), None);
        self.split_async(checked, c, None, count, send, recv)
    }

    /// Asynchronous [`Communicator::all_gather_v`](crate::Collectives::all_gather_v): returns `send` and `recv`, which holds
    /// every rank's part (`counts`), in rank order.
    fn all_gather_v_async(
        &self,
        send: Vec<T>,
        mut recv: Vec<T>,
        counts: &[usize],
    ) -> Work<(Vec<T>, Vec<T>)> {
        let at = match self.all_gather_v_layout(send.len(), (counts, recv.len())) {
            Ok(at) => at,
            Err(e) => return Work::failed(e),
        };
        self.submit(move |inner| {
            let input = bytemuck::cast_slice(&send);
            let output = bytemuck::cast_slice_mut(&mut recv);
            inner.all_gather_v(inner.cfg.algo, T::DTYPE, Some(input), output, &at)?;
            Ok((send, recv))
        })
    }

    /// Asynchronous in-place [`Communicator::broadcast`](crate::Collectives::broadcast) of the root's buffer.
    fn broadcast_async(&self, buf: Vec<T>, root: usize) -> Work<Vec<T>> {
        match self.rooted(Collective::Broadcast { root }, root) {
            Ok(c) => self.in_place_async(c, ReduceOp::Sum, buf),
            Err(e) => Work::failed(e),
        }
    }

    /// Asynchronous in-place [`Communicator::reduce`](crate::Collectives::reduce): the root's buffer comes back holding the
    /// result; other ranks' come back unchanged.
    fn reduce_async(&self, buf: Vec<T>, op: ReduceOp, root: usize) -> Work<Vec<T>> {
        match self.rooted(Collective::Reduce { root }, root) {
            Ok(c) => self.in_place_async(c, op, buf),
            Err(e) => Work::failed(e),
        }
    }

    /// Asynchronous [`Communicator::ring_shift`](crate::Collectives::ring_shift): returns `send` and `recv`, which holds the
    /// previous rank's `send`.
    fn ring_shift_async(&self, send: Vec<T>, recv: Vec<T>) -> Work<(Vec<T>, Vec<T>)> {
        let c = Collective::RingShift;
        let checked = same_len(c, send.len(), recv.len(), "send", "recv");
        let count = (send.len(), None);
        self.split_async(checked, c, None, count, send, recv)
    }

    /// Asynchronous [`Communicator::all_to_all`](crate::Collectives::all_to_all): returns `send` and `recv`, which holds the
    /// blocks received, in rank order.
    fn all_to_all_async(&self, send: Vec<T>, mut recv: Vec<T>) -> Work<(Vec<T>, Vec<T>)> {
        let c = Collective::AllToAll;
        let checked = same_len(c, send.len(), recv.len(), "send", "recv")
            .and_then(|()| self.whole_blocks(send.len()));
        if let Err(e) = checked {
            return Work::failed(e);
        }
        self.submit(move |inner| {
            let (input, output) = (
                bytemuck::cast_slice(&send),
                bytemuck::cast_slice_mut(&mut recv),
            );
            inner.all_to_all(T::DTYPE, send.len(), input, output)?;
            Ok((send, recv))
        })
    }

    /// Asynchronous [`Communicator::all_to_all_v`](crate::Collectives::all_to_all_v): returns `send` and `recv`, which holds the
    /// blocks received (`recv_counts`), in rank order.
    fn all_to_all_v_async(
        &self,
        send: Vec<T>,
        send_counts: &[usize],
        mut recv: Vec<T>,
        recv_counts: &[usize],
    ) -> Work<(Vec<T>, Vec<T>)> {
        let layout = self.all_to_all_v_layout((send_counts, send.len()), (recv_counts, recv.len()));
        let (sd, rd) = match layout {
            Ok(at) => at,
            Err(e) => return Work::failed(e),
        };
        self.submit(move |inner| {
            let input = bytemuck::cast_slice(&send);
            let output = bytemuck::cast_slice_mut(&mut recv);
            inner.all_to_all_v(T::DTYPE, (input, &sd), (output, &rd))?;
            Ok((send, recv))
        })
    }

    /// Asynchronous [`Communicator::send`](crate::Collectives::send) (`MPI_Isend`): the buffer comes back once the
    /// message has left (or is held by the link: see `send`). Point-to-point calls queued one
    /// after another are independent: each message moves as soon as its link allows, even while
    /// one queued before it waits, so two ranks that each `send_async` the other a large message
    /// before `recv_async`, or that `recv_async` from one neighbour before `send_async` to the
    /// other, complete. Messages to one peer keep their order; a collective queued after them
    /// waits for them; the `Work` completes once this message has moved.
    fn send_async(&self, buf: Vec<T>, peer: usize) -> Work<Vec<T>> {
        self.p2p_async(vec![P2pOwned::Send(buf, peer)], |mut m| match m.pop() {
            Some(P2pOwned::Send(b, _)) => b,
            _ => unreachable!("one send in, one send out"),
        })
    }

    /// Asynchronous [`Communicator::recv`](crate::Collectives::recv) (`MPI_Irecv`) into `buf` (its length the count
    /// expected); independent of the calls queued beside it, as for [`Communicator::send_async`](crate::NonBlocking::send_async).
    fn recv_async(&self, buf: Vec<T>, peer: usize) -> Work<Vec<T>> {
        self.p2p_async(vec![P2pOwned::Recv(buf, peer)], |mut m| match m.pop() {
            Some(P2pOwned::Recv(b, _)) => b,
            _ => unreachable!("one receive in, one receive out"),
        })
    }

    /// Asynchronous [`Communicator::send_recv`](crate::Collectives::send_recv): returns `send` and the filled `recv`.
    fn send_recv_async(&self, send: Vec<T>, recv: Vec<T>, peer: usize) -> Work<(Vec<T>, Vec<T>)> {
        let msgs = vec![P2pOwned::Send(send, peer), P2pOwned::Recv(recv, peer)];
        self.p2p_async(msgs, |m| {
            let mut m = m.into_iter();
            match (m.next(), m.next()) {
                (Some(P2pOwned::Send(s, _)), Some(P2pOwned::Recv(r, _))) => (s, r),
                _ => unreachable!("a send and a receive in, the same out"),
            }
        })
    }
}
