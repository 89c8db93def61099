//! The host communicator's asynchronous forms behind the [`Colls`] driver: every call is queued
//! on the worker, waited on, and its result copied where the blocking form writes, so every
//! reference check can run through the asynchronous forms too.

use ringzero::{chunk, Communicator, Element, Input, NonBlocking, ReduceOp, Result};

use super::Colls;

/// Runs each [`Colls`] call through the `_async` form of the same collective.
pub struct Queued<'a>(pub &'a Communicator);

/// Copy `got` into `to`, which must be as long (the async form returned what the blocking one
/// would have written).
fn put<T: Element>(to: &mut [T], got: Vec<T>) {
    assert_eq!(
        to.len(),
        got.len(),
        "the async form returned another length"
    );
    to.copy_from_slice(&got);
}

impl Colls for Queued<'_> {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn size(&self) -> usize {
        self.0.size()
    }
    fn host(&self) -> Result<&Communicator> {
        Ok(self.0)
    }
    fn all_reduce<'a, T: Element>(
        &mut self,
        s: impl Into<Input<'a, [T]>>,
        r: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        put(r, self.0.all_reduce_async(data(s, r), op).wait()?);
        Ok(())
    }
    fn reduce_scatter<'a, T: Element>(
        &mut self,
        s: impl Into<Input<'a, [T]>>,
        r: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let s = s.into();
        let in_place = matches!(s, Input::InPlace);
        let send = data(s, r);
        let own = self.0.chunk_range(send.len());
        let into = vec![T::zeroed(); own.len()];
        let send_len = send.len();
        let (sent, got) = self.0.reduce_scatter_async(send, into, op).wait()?;
        assert_eq!(sent.len(), send_len, "send comes back");
        put(if in_place { &mut r[own] } else { r }, got);
        Ok(())
    }
    fn reduce_scatter_v<'a, T: Element>(
        &mut self,
        s: impl Into<Input<'a, [T]>>,
        r: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let s = s.into();
        let in_place = matches!(s, Input::InPlace);
        let at: usize = counts[..self.0.rank()].iter().sum();
        let own = at..at + counts[self.0.rank()];
        let into = vec![T::zeroed(); own.len()];
        let work = self.0.reduce_scatter_v_async(data(s, r), into, counts, op);
        let (_, got) = work.wait()?;
        put(if in_place { &mut r[own] } else { r }, got);
        Ok(())
    }
    fn all_gather<'a, T: Element>(
        &mut self,
        s: impl Into<Input<'a, [T]>>,
        r: &mut [T],
    ) -> Result<()> {
        let own = chunk(r.len(), self.0.size(), self.0.rank());
        let send = match s.into() {
            Input::Buf(s) => s.to_vec(),
            Input::InPlace => r[own].to_vec(),
        };
        let (_, got) = self.0.all_gather_async(send, r.to_vec()).wait()?;
        put(r, got);
        Ok(())
    }
    fn broadcast<'a, T: Element>(
        &mut self,
        s: impl Into<Input<'a, [T]>>,
        r: &mut [T],
        root: usize,
    ) -> Result<()> {
        let buf = match s.into() {
            Input::Buf(s) if self.0.rank() == root => s.to_vec(),
            // Not read: what the root sends replaces it.
            Input::Buf(_) => vec![T::zeroed(); r.len()],
            Input::InPlace => r.to_vec(),
        };
        put(r, self.0.broadcast_async(buf, root).wait()?);
        Ok(())
    }
    fn reduce<'a, T: Element>(
        &mut self,
        s: impl Into<Input<'a, [T]>>,
        r: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        let s = s.into();
        let send = data(s, r);
        let got = self.0.reduce_async(send.clone(), op, root).wait()?;
        if self.0.rank() == root || matches!(s, Input::InPlace) {
            put(r, got);
        } else {
            assert_eq!(got, send, "a non-root's buffer comes back unchanged");
        }
        Ok(())
    }
    fn ring_shift<'a, T: Element>(
        &mut self,
        s: impl Into<Input<'a, [T]>>,
        r: &mut [T],
    ) -> Result<()> {
        let into = vec![T::zeroed(); r.len()];
        let (_, got) = self.0.ring_shift_async(data(s, r), into).wait()?;
        put(r, got);
        Ok(())
    }
    fn barrier(&mut self) -> Result<()> {
        self.0.barrier_async().wait()
    }
    fn all_to_all<'a, T: Element>(
        &mut self,
        s: impl Into<Input<'a, [T]>>,
        r: &mut [T],
    ) -> Result<()> {
        let into = vec![T::zeroed(); r.len()];
        let (_, got) = self.0.all_to_all_async(data(s, r), into).wait()?;
        put(r, got);
        Ok(())
    }
    /// The lower rank of a pair sends first and the higher receives first, through `send_async`
    /// and `recv_async` (queued back to back); odd counts go through `send_recv_async`.
    fn send_recv<T: Element>(&mut self, s: &[T], r: &mut [T], peer: usize) -> Result<()> {
        let c = self.0;
        if s.len() % 2 == 1 {
            let (sent, got) = c
                .send_recv_async(s.to_vec(), vec![T::zeroed(); r.len()], peer)
                .wait()?;
            assert_eq!(sent, s, "the send buffer comes back as it went");
            put(r, got);
            return Ok(());
        }
        let into = vec![T::zeroed(); r.len()];
        let (sent, got) = if c.rank() < peer {
            let w = c.send_async(s.to_vec(), peer);
            (w, c.recv_async(into, peer))
        } else {
            let g = c.recv_async(into, peer);
            (c.send_async(s.to_vec(), peer), g)
        };
        assert_eq!(sent.wait()?, s, "the send buffer comes back as it went");
        put(r, got.wait()?);
        Ok(())
    }
    fn all_to_all_v<T: Element>(
        &mut self,
        s: &[T],
        sc: &[usize],
        r: &mut [T],
        rc: &[usize],
    ) -> Result<()> {
        let into = vec![T::zeroed(); r.len()];
        let (_, got) = self.0.all_to_all_v_async(s.to_vec(), sc, into, rc).wait()?;
        put(r, got);
        Ok(())
    }
    fn all_gather_v<'a, T: Element>(
        &mut self,
        s: impl Into<Input<'a, [T]>>,
        r: &mut [T],
        counts: &[usize],
    ) -> Result<()> {
        let at: usize = counts[..self.0.rank()].iter().sum();
        let send = match s.into() {
            Input::Buf(s) => s.to_vec(),
            Input::InPlace => r[at..at + counts[self.0.rank()]].to_vec(),
        };
        let (_, got) = self.0.all_gather_v_async(send, r.to_vec(), counts).wait()?;
        put(r, got);
        Ok(())
    }
    fn gather<T: Element>(&mut self, s: &[T], r: &mut [T], root: usize) -> Result<()> {
        let (sent, got) = self.0.gather_async(s.to_vec(), r.to_vec(), root).wait()?;
        assert_eq!(sent, s, "the send buffer comes back as it went");
        put(r, got);
        Ok(())
    }
    fn scatter<T: Element>(&mut self, s: &[T], r: &mut [T], root: usize) -> Result<()> {
        let into = vec![T::zeroed(); r.len()];
        let (_, got) = self.0.scatter_async(s.to_vec(), into, root).wait()?;
        put(r, got);
        Ok(())
    }
}

/// The data a call sends: its own buffer's, or in place the output buffer's.
fn data<'a, T: Element>(s: impl Into<Input<'a, [T]>>, r: &[T]) -> Vec<T> {
    match s.into() {
        Input::Buf(s) => s.to_vec(),
        Input::InPlace => r.to_vec(),
    }
}
