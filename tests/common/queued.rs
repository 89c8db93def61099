//! The host communicator's asynchronous forms behind the [`Colls`] driver: every call is queued
//! on the worker, waited on, and its result copied where the blocking form writes, so every
//! reference check can run through the asynchronous forms too.

use ringzero::{chunk, Communicator, Element, ReduceOp, Result};

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
    fn all_reduce<T: Element>(&mut self, s: &[T], r: &mut [T], op: ReduceOp) -> Result<()> {
        put(r, self.0.all_reduce_async(s.to_vec(), op).wait()?);
        Ok(())
    }
    fn all_reduce_in_place<T: Element>(&mut self, b: &mut [T], op: ReduceOp) -> Result<()> {
        put(b, self.0.all_reduce_async(b.to_vec(), op).wait()?);
        Ok(())
    }
    fn reduce_scatter<T: Element>(&mut self, s: &[T], r: &mut [T], op: ReduceOp) -> Result<()> {
        put(r, self.0.reduce_scatter_async(s.to_vec(), op).wait()?);
        Ok(())
    }
    fn reduce_scatter_in_place<T: Element>(&mut self, b: &mut [T], op: ReduceOp) -> Result<()> {
        let own = self.0.chunk_range(b.len());
        let got = self.0.reduce_scatter_async(b.to_vec(), op).wait()?;
        put(&mut b[own], got);
        Ok(())
    }
    fn reduce_scatter_v<T: Element>(
        &mut self,
        s: &[T],
        r: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        put(
            r,
            self.0
                .reduce_scatter_v_async(s.to_vec(), counts, op)
                .wait()?,
        );
        Ok(())
    }
    fn reduce_scatter_v_in_place<T: Element>(
        &mut self,
        b: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let at: usize = counts[..self.0.rank()].iter().sum();
        let own = at..at + counts[self.0.rank()];
        let got = self
            .0
            .reduce_scatter_v_async(b.to_vec(), counts, op)
            .wait()?;
        put(&mut b[own], got);
        Ok(())
    }
    fn all_gather<T: Element>(&mut self, s: &[T], r: &mut [T]) -> Result<()> {
        put(r, self.0.all_gather_async(s.to_vec(), r.len()).wait()?);
        Ok(())
    }
    fn all_gather_in_place<T: Element>(&mut self, b: &mut [T]) -> Result<()> {
        let own = chunk(b.len(), self.0.size(), self.0.rank());
        put(b, self.0.all_gather_async(b[own].to_vec(), b.len()).wait()?);
        Ok(())
    }
    fn broadcast<T: Element>(&mut self, s: &[T], r: &mut [T], root: usize) -> Result<()> {
        let buf = if self.0.rank() == root {
            s.to_vec()
        } else {
            // Not read: what the root sends replaces it.
            vec![T::zeroed(); r.len()]
        };
        put(r, self.0.broadcast_async(buf, root).wait()?);
        Ok(())
    }
    fn broadcast_in_place<T: Element>(&mut self, b: &mut [T], root: usize) -> Result<()> {
        put(b, self.0.broadcast_async(b.to_vec(), root).wait()?);
        Ok(())
    }
    fn reduce<T: Element>(
        &mut self,
        s: &[T],
        r: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        let got = self.0.reduce_async(s.to_vec(), op, root).wait()?;
        if self.0.rank() == root {
            put(r, got);
        } else {
            assert_eq!(got, s, "a non-root's buffer comes back unchanged");
        }
        Ok(())
    }
    fn reduce_in_place<T: Element>(
        &mut self,
        b: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        put(b, self.0.reduce_async(b.to_vec(), op, root).wait()?);
        Ok(())
    }
    fn ring_shift<T: Element>(&mut self, s: &[T], r: &mut [T]) -> Result<()> {
        put(r, self.0.ring_shift_async(s.to_vec()).wait()?);
        Ok(())
    }
    fn ring_shift_in_place<T: Element>(&mut self, b: &mut [T]) -> Result<()> {
        put(b, self.0.ring_shift_async(b.to_vec()).wait()?);
        Ok(())
    }
    fn barrier(&mut self) -> Result<()> {
        self.0.barrier_async().wait()
    }
    fn all_to_all<T: Element>(&mut self, s: &[T], r: &mut [T]) -> Result<()> {
        put(r, self.0.all_to_all_async(s.to_vec()).wait()?);
        Ok(())
    }
    fn all_to_all_in_place<T: Element>(&mut self, b: &mut [T]) -> Result<()> {
        put(b, self.0.all_to_all_async(b.to_vec()).wait()?);
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
        put(r, self.0.all_to_all_v_async(s.to_vec(), sc, rc).wait()?);
        Ok(())
    }
    fn all_gather_v<T: Element>(&mut self, s: &[T], r: &mut [T], counts: &[usize]) -> Result<()> {
        put(r, self.0.all_gather_v_async(s.to_vec(), counts).wait()?);
        Ok(())
    }
    fn gather<T: Element>(&mut self, s: &[T], r: &mut [T], root: usize) -> Result<()> {
        let got = self.0.gather_async(s.to_vec(), root).wait()?;
        if self.0.rank() == root {
            put(r, got);
        } else {
            assert!(got.is_empty(), "a non-root gets an empty Vec");
        }
        Ok(())
    }
    fn scatter<T: Element>(&mut self, s: &[T], r: &mut [T], root: usize) -> Result<()> {
        put(r, self.0.scatter_async(s.to_vec(), r.len(), root).wait()?);
        Ok(())
    }
}
