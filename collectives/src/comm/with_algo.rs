//! The collectives whose algorithm a caller may choose per call: [`Communicator::with_algo`].

use ringzero_kernels::{Element, ReduceOp};

use crate::config::Algo;
use crate::error::Result;
use crate::input::Input;
use crate::ring::engine::Bufs;
use crate::ring::Collective;

use super::*;

/// A communicator and the algorithm its next calls run by, whatever `RINGZERO_ALGO` says:
/// [`Communicator::with_algo`]. Every rank must make the same choice: a rank whose call runs
/// another algorithm fails at the first frame, both calls named.
///
/// ```
/// use ringzero_collectives::{Algo, Communicator, InPlace, ReduceOp};
/// # fn main() -> Result<(), ringzero_collectives::Error> {
/// # std::env::set_var("RINGZERO_RANK", "0");
/// # std::env::set_var("RINGZERO_WORLD_SIZE", "1");
/// let comm = Communicator::from_env()?;
/// let mut grads = vec![1.0f32; 1000];
/// // Round as the ring's reduce-scatter does, whatever the size.
/// comm.with_algo(Algo::Ring).all_reduce(InPlace, &mut grads, ReduceOp::Sum)?;
/// # Ok(()) }
/// ```
#[derive(Clone, Copy)]
pub struct WithAlgo<'c> {
    comm: &'c Communicator,
    algo: Algo,
}

impl Communicator {
    /// The collectives that have several algorithms ([`Communicator::all_reduce`](crate::Collectives::all_reduce),
    /// [`Communicator::broadcast`](crate::Collectives::broadcast), [`Communicator::reduce`](crate::Collectives::reduce), [`Communicator::all_gather_v`](crate::Collectives::all_gather_v),
    /// [`Communicator::barrier`]) run by `algo` for the calls made through the value returned:
    /// for a caller whose results must round as another collective's do (the ring's
    /// all-reduce reduces in the order of its reduce-scatter, [`Algo::Ring`]), or a one-off
    /// large broadcast down the tree ([`Algo::Doubling`]).
    pub fn with_algo(&self, algo: Algo) -> WithAlgo<'_> {
        WithAlgo { comm: self, algo }
    }

    /// The calls of [`Communicator::with_algo`] by the configured algorithm (`RINGZERO_ALGO`).
    pub(super) fn by_config(&self) -> WithAlgo<'_> {
        self.with_algo(self.inner.cfg.algo)
    }
}

impl WithAlgo<'_> {
    /// [`Communicator::all_reduce`](crate::Collectives::all_reduce) by this algorithm.
    pub fn all_reduce<'a, T: Element>(
        &self,
        send: impl Into<Input<'a, [T]>>,
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let (c, count) = (Collective::AllReduce, recv.len());
        let (bufs, in_place) = match send.into() {
            Input::Buf(send) => {
                same_len(c, send.len(), recv.len(), "send", "recv")?;
                let bufs = Bufs::Split {
                    input: bytemuck::cast_slice(send),
                    output: bytemuck::cast_slice_mut(recv),
                };
                (bufs, false)
            }
            Input::InPlace => (Bufs::One(bytemuck::cast_slice_mut(recv)), true),
        };
        self.comm.wait_async_idle();
        let call = (Some(T::DTYPE), op);
        self.comm
            .inner
            .execute_by(self.algo, c, call, count.into(), in_place, bufs)
    }

    /// [`Communicator::broadcast`](crate::Collectives::broadcast) by this algorithm.
    pub fn broadcast<'a, T: Element>(
        &self,
        send: impl Into<Input<'a, [T]>>,
        recv: &mut [T],
        root: usize,
    ) -> Result<()> {
        let comm = self.comm;
        let c = comm.rooted(Collective::Broadcast { root }, root)?;
        match send.into() {
            Input::Buf(send) => {
                if root == comm.rank() {
                    same_len(c, send.len(), recv.len(), "send", "recv")?;
                }
                comm.run_split_by(self.algo, c, None, recv.len(), send, recv)
            }
            Input::InPlace => comm.run_one_by(self.algo, c, None, recv.len(), recv),
        }
    }

    /// [`Communicator::reduce`](crate::Collectives::reduce) by this algorithm.
    pub fn reduce<'a, T: Element>(
        &self,
        send: impl Into<Input<'a, [T]>>,
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        let comm = self.comm;
        let c = comm.rooted(Collective::Reduce { root }, root)?;
        match send.into() {
            Input::Buf(send) => {
                if root == comm.rank() {
                    same_len(c, send.len(), recv.len(), "send", "recv")?;
                }
                comm.run_split_by(self.algo, c, Some(op), send.len(), send, recv)
            }
            Input::InPlace => comm.run_one_by(self.algo, c, Some(op), recv.len(), recv),
        }
    }

    /// [`Communicator::all_gather_v`](crate::Collectives::all_gather_v) by this algorithm ([`Algo::Ring`]: the ring;
    /// [`Algo::Doubling`]: the pairs).
    pub fn all_gather_v<'a, T: Element>(
        &self,
        send: impl Into<Input<'a, [T]>>,
        recv: &mut [T],
        counts: &[usize],
    ) -> Result<()> {
        let comm = self.comm;
        let (send, at) = match send.into() {
            Input::Buf(send) => {
                let at = comm.all_gather_v_layout(send.len(), (counts, recv.len()))?;
                (Some(bytemuck::cast_slice(send)), at)
            }
            Input::InPlace => {
                let c = Collective::AllGatherV;
                let at = offsets(c, ("counts", counts), comm.size(), ("recv", recv.len()))?;
                (None, at)
            }
        };
        comm.wait_async_idle();
        let recv = bytemuck::cast_slice_mut(recv);
        comm.inner
            .all_gather_v(self.algo, T::DTYPE, send, recv, &at)
    }

    /// [`Communicator::barrier`] by this algorithm (the ring's barrier is `n − 1` hops, what
    /// `ringzero bench` times as α).
    pub fn barrier(&self) -> Result<()> {
        self.comm.wait_async_idle();
        let (c, bufs) = (Collective::Barrier, Bufs::One(&mut []));
        self.comm
            .inner
            .execute_by(self.algo, c, (None, ReduceOp::Sum), 0.into(), false, bufs)
    }
}
