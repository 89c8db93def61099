//! The collectives both communicators run, as one trait: [`Collectives`]. The host
//! [`Communicator`](crate::Communicator) runs them on host slices (`Collectives<[T]>`), a
//! [`DeviceComm`](crate::DeviceComm) on any memory of its stream (`Collectives<B>`), with the
//! same names, arguments and rules, so code written against the trait runs on either.
//!
//! Each call's page on the communicators says how it runs there. `send` is an [`Input`]: a
//! buffer of its own (`&send`), or [`InPlace`](crate::InPlace) to read the input from `recv` and
//! write the result over it. Every rank must make the same calls in the same order with
//! matching arguments; a rank that does not gets an [`Error::Mismatch`](crate::Error::Mismatch)
//! naming both calls.

use ringzero_kernels::ReduceOp;

use crate::error::Result;
use crate::input::Input;
use crate::work::Work;

/// The collectives on buffers of type `B` (`[T]` on the host communicator; any
/// [`DeviceMemory`](crate::DeviceMemory) of its stream on a device communicator). Bring it into
/// scope (`use ringzero::Collectives;`, or `ringzero::prelude::*`) to call them.
///
/// ```
/// use ringzero_collectives::{Collectives, Communicator, InPlace, ReduceOp};
/// # fn main() -> Result<(), ringzero_collectives::Error> {
/// # std::env::set_var("RINGZERO_RANK", "0");
/// # std::env::set_var("RINGZERO_WORLD_SIZE", "1");
/// let comm = Communicator::from_env()?;
/// let mut grads = vec![1.0f32; 1000];
/// comm.all_reduce(InPlace, &mut grads, ReduceOp::Avg)?;
/// let mut mine = vec![0.0f32; comm.chunk_range(1000).len()];
/// comm.reduce_scatter(&grads, &mut mine, ReduceOp::Sum)?;
/// # Ok(()) }
/// ```
pub trait Collectives<B: ?Sized> {
    /// `op` over every rank's `send`, in every rank's `recv`.
    fn all_reduce<'a>(
        &self,
        send: impl Into<Input<'a, B>>,
        recv: &mut B,
        op: ReduceOp,
    ) -> Result<()>
    where
        B: 'a;

    /// `op` over every rank's `send`; rank `r` ends with chunk `r` (`chunk_range(len)`) of it.
    fn reduce_scatter<'a>(
        &self,
        send: impl Into<Input<'a, B>>,
        recv: &mut B,
        op: ReduceOp,
    ) -> Result<()>
    where
        B: 'a;

    /// Reduce-scatter with a part per rank (`MPI_Reduce_scatter`): rank `i` ends with the
    /// `counts[i]` elements that follow the parts of the ranks before it.
    fn reduce_scatter_v<'a>(
        &self,
        send: impl Into<Input<'a, B>>,
        recv: &mut B,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()>
    where
        B: 'a;

    /// Every rank's `send` (its chunk of `recv`) gathered into every rank's `recv`.
    fn all_gather<'a>(&self, send: impl Into<Input<'a, B>>, recv: &mut B) -> Result<()>
    where
        B: 'a;

    /// All-gather of parts of any size (`MPI_Allgatherv`): rank `i` contributes `counts[i]`
    /// elements, placed after the parts of the ranks before it.
    fn all_gather_v<'a>(
        &self,
        send: impl Into<Input<'a, B>>,
        recv: &mut B,
        counts: &[usize],
    ) -> Result<()>
    where
        B: 'a;

    /// The root's `send` in every rank's `recv`.
    fn broadcast<'a>(&self, send: impl Into<Input<'a, B>>, recv: &mut B, root: usize) -> Result<()>
    where
        B: 'a;

    /// `op` over every rank's `send`, in the root's `recv`.
    fn reduce<'a>(
        &self,
        send: impl Into<Input<'a, B>>,
        recv: &mut B,
        op: ReduceOp,
        root: usize,
    ) -> Result<()>
    where
        B: 'a;

    /// `send` to the next rank; the previous rank's into `recv`.
    fn ring_shift<'a>(&self, send: impl Into<Input<'a, B>>, recv: &mut B) -> Result<()>
    where
        B: 'a;

    /// Block `j` of `send` to rank `j`; block `i` of `recv` from rank `i`.
    fn all_to_all<'a>(&self, send: impl Into<Input<'a, B>>, recv: &mut B) -> Result<()>
    where
        B: 'a;

    /// All-to-all with a count per pair (`MPI_Alltoallv`).
    fn all_to_all_v(
        &self,
        send: &B,
        send_counts: &[usize],
        recv: &mut B,
        recv_counts: &[usize],
    ) -> Result<()>;

    /// Every rank's `send`, in rank order, in the root's `recv` (`MPI_Gather`).
    fn gather(&self, send: &B, recv: &mut B, root: usize) -> Result<()>;

    /// Block `r` of the root's `send` in rank `r`'s `recv` (`MPI_Scatter`).
    fn scatter(&self, send: &B, recv: &mut B, root: usize) -> Result<()>;

    /// `buf` to rank `peer` (`MPI_Send`).
    fn send(&self, buf: &B, peer: usize) -> Result<()>;

    /// From rank `peer` into `buf` (`MPI_Recv`).
    fn recv(&self, buf: &mut B, peer: usize) -> Result<()>;

    /// `send` to rank `peer` and `recv` from it, both ways at once (`MPI_Sendrecv`).
    fn send_recv(&self, send: &B, recv: &mut B, peer: usize) -> Result<()>;
}

/// The nonblocking collectives (MPI's `MPI_Iallreduce` and kin, torch's `async_op=True`) on owned
/// buffers of type `B` (`Vec<T>` on the host communicator; any owned
/// [`DeviceMemory`](crate::DeviceMemory) of its stream on a device communicator): each returns
/// a [`Work`] at once, whose [`Work::wait`] gives the buffers back. Collectives run one at a
/// time in the order queued and a blocking call waits for the queued ones first, so every
/// rank's order stays its program order; point-to-point calls queued one after another move at
/// once, each as its link allows. Bad arguments fail the `Work` at once and use no sequence
/// number.
///
/// All-reduce, broadcast and reduce run in place on one buffer; the others take a `send` and a
/// `recv` buffer and give both back, `recv` holding the result, with the rules of the blocking
/// call of the same name ([`Collectives`]).
pub trait NonBlocking<B> {
    /// [`Collectives::all_reduce`] in place.
    fn all_reduce_async(&self, buf: B, op: ReduceOp) -> Work<B>;
    /// [`Collectives::reduce_scatter`].
    fn reduce_scatter_async(&self, send: B, recv: B, op: ReduceOp) -> Work<(B, B)>;
    /// [`Collectives::reduce_scatter_v`].
    fn reduce_scatter_v_async(
        &self,
        send: B,
        recv: B,
        counts: &[usize],
        op: ReduceOp,
    ) -> Work<(B, B)>;
    /// [`Collectives::all_gather`].
    fn all_gather_async(&self, send: B, recv: B) -> Work<(B, B)>;
    /// [`Collectives::all_gather_v`].
    fn all_gather_v_async(&self, send: B, recv: B, counts: &[usize]) -> Work<(B, B)>;
    /// [`Collectives::broadcast`] in place: the root's buffer is what every rank gets back.
    fn broadcast_async(&self, buf: B, root: usize) -> Work<B>;
    /// [`Collectives::reduce`] in place: the root's buffer comes back holding the result;
    /// other ranks' come back unchanged.
    fn reduce_async(&self, buf: B, op: ReduceOp, root: usize) -> Work<B>;
    /// [`Collectives::ring_shift`].
    fn ring_shift_async(&self, send: B, recv: B) -> Work<(B, B)>;
    /// [`Collectives::all_to_all`].
    fn all_to_all_async(&self, send: B, recv: B) -> Work<(B, B)>;
    /// [`Collectives::all_to_all_v`].
    fn all_to_all_v_async(
        &self,
        send: B,
        send_counts: &[usize],
        recv: B,
        recv_counts: &[usize],
    ) -> Work<(B, B)>;
    /// [`Collectives::send`] (`MPI_Isend`): the buffer comes back once the message has left.
    fn send_async(&self, buf: B, peer: usize) -> Work<B>;
    /// [`Collectives::recv`] (`MPI_Irecv`) into `buf` (its length the count expected).
    fn recv_async(&self, buf: B, peer: usize) -> Work<B>;
    /// [`Collectives::send_recv`]: returns `send` and the filled `recv`.
    fn send_recv_async(&self, send: B, recv: B, peer: usize) -> Work<(B, B)>;
}
