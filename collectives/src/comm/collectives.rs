//! The host communicator's collectives on borrowed buffers: checked, then run on the ring, a
//! doubling schedule or the pairwise links ([`super::inner`]).

use ringzero_kernels::{Element, ReduceOp};

use crate::config::Algo;
use crate::error::{Error, Result};
use crate::ring::engine::Bufs;
use crate::ring::Collective;
use crate::work::Work;

use super::*;

impl Communicator {
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
