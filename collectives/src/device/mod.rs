//! Collectives on device buffers: [`DeviceComm`].
//!
//! The ring schedule is the host path's ([`crate::ring::schedule`]); what differs is who moves the
//! bytes. The device engine ([`crate::ring::device_engine`]) queues kernels and copies on a
//! [`Stream`] that read and write slot addresses, and publishes frames as that work completes:
//! - `cuda_ipc`: slots in the receiver's GPU memory; the sender's kernel writes its result (or a
//!   copy moves the slice) straight into them through an IPC mapping;
//! - `shm` (host staging, the P2P-disable fallback): slots in a shared-memory file, page-locked and
//!   mapped into both processes' devices; the sender's kernel writes into the staging slot and the
//!   receiver's kernel reduces out of it.
//!
//! Buffers are passed as [`DeviceMemory`]: `DeviceBuffer` on a GPU (`Arc<Gpu>` as the stream), host
//! slices on a [`HostStream`] (the host as an asynchronous device, which is how the device path
//! runs and is tested on machines without a GPU).

mod calls;
pub mod comm;
mod core;
pub mod direct;
mod pair_links;
mod pairs;
mod posted;
mod probe;
mod records;
pub(crate) mod settle;
mod setup;

pub use comm::DeviceComm;
pub use pairs::DeviceP2p;
pub use ringzero_kernels::device::{
    CopyLane, DeviceError, Exported, HostStream, ShareRecord, StepAt, Stream, TrainStream,
};

use ringzero_kernels::{DType, Element, ReduceOp};

use crate::comm::{offsets, own_part};
use crate::error::{Error, Result};
use crate::input::Input;
use crate::ring::device_engine::DevBufs;
use crate::ring::{Collective, Count};
use crate::transport::device::DevPtr;
use crate::work::Work;

/// A buffer a [`Stream`] can address.
///
/// # Safety
/// The collectives hand the addresses to kernels and copies without further checks, so an
/// implementation must guarantee that `addr`/`addr_mut` point at `elems() × dtype().size()` bytes
/// of memory the stream can read (and, for `addr_mut`, write), owned by `self` and valid for as
/// long as `self` is borrowed.
pub unsafe trait DeviceMemory<S: Stream> {
    /// Element type.
    fn dtype(&self) -> DType;
    /// Elements.
    fn elems(&self) -> usize;
    /// Address for reading.
    fn addr(&self, s: &S) -> DevPtr;
    /// Address for writing.
    fn addr_mut(&mut self, s: &S) -> DevPtr;
}

// SAFETY: a slice's pointer and length describe exactly its elements, which the host stream
// (host memory) addresses directly, for as long as the slice is borrowed.
unsafe impl<T: Element> DeviceMemory<HostStream> for [T] {
    fn dtype(&self) -> DType {
        T::DTYPE
    }
    fn elems(&self) -> usize {
        self.len()
    }
    fn addr(&self, _: &HostStream) -> DevPtr {
        self.as_ptr() as usize as DevPtr
    }
    fn addr_mut(&mut self, _: &HostStream) -> DevPtr {
        self.as_mut_ptr() as usize as DevPtr
    }
}

// SAFETY: a DeviceBuffer owns `len × dtype.size()` bytes of device memory in its GPU's context,
// freed only when it drops, so its address is valid while it is borrowed. (A buffer of another
// GPU would be caught by the driver, not by this impl: one device per DeviceComm.)
#[cfg(feature = "cuda")]
unsafe impl DeviceMemory<std::sync::Arc<ringzero_kernels::device::cuda::Gpu>>
    for ringzero_kernels::device::cuda::DeviceBuffer
{
    fn dtype(&self) -> DType {
        ringzero_kernels::device::cuda::DeviceBuffer::dtype(self)
    }
    fn elems(&self) -> usize {
        self.len()
    }
    fn addr(&self, s: &std::sync::Arc<ringzero_kernels::device::cuda::Gpu>) -> DevPtr {
        s.ptr_of(self)
    }
    fn addr_mut(&mut self, s: &std::sync::Arc<ringzero_kernels::device::cuda::Gpu>) -> DevPtr {
        s.ptr_of(self)
    }
}

fn bad(c: Collective, msg: String) -> Error {
    Error::InvalidArgument {
        op: c.name().into(),
        msg,
    }
}

fn same_dtype(c: Collective, a: DType, b: DType) -> Result<()> {
    if a == b {
        Ok(())
    } else {
        Err(bad(
            c,
            format!("send is {a} but recv is {b}; they must match"),
        ))
    }
}

/// Refuse what device buffers cannot run: the calls between pairs of ranks (send/recv and the
/// pairwise collectives), which need links the device ring does not have, and an all-to-all
/// that does not split into one block per rank.
pub(crate) fn device_form(c: Collective, count: usize, n: usize) -> Result<()> {
    match c {
        Collective::AllToAll => whole_blocks(count, n),
        Collective::SendRecv => Err(bad(
            c,
            "send/recv run on host buffers only (Communicator::send, recv, send_recv)".into(),
        )),
        Collective::AllToAllV => Err(bad(
            c,
            "takes counts per pair: call DeviceComm::all_to_all_v".into(),
        )),
        Collective::Gather { .. } | Collective::Scatter { .. } => Err(bad(
            c,
            format!("takes a root's blocks: call DeviceComm::{}", c.name()),
        )),
        _ => Ok(()),
    }
}

/// Refuse an all-to-all of `count` elements that does not split into one block per rank.
fn whole_blocks(count: usize, n: usize) -> Result<()> {
    if count.is_multiple_of(n) {
        return Ok(());
    }
    Err(bad(
        Collective::AllToAll,
        format!(
            "the buffer has {count} elements, not a multiple of the world size {n} (every rank \
             sends each rank one block of equal size)"
        ),
    ))
}

/// What a v-collective (`c`) without its counts gets.
fn v_needs_counts(c: Collective) -> Error {
    bad(
        c,
        format!("takes a count per rank: call DeviceComm::{}", c.name()),
    )
}

fn need(c: Collective, what: &str, have: usize, want: usize) -> Result<()> {
    if have == want {
        Ok(())
    } else {
        Err(bad(
            c,
            format!("{what} has {have} elements, {want} were expected"),
        ))
    }
}

// SAFETY: an array's elements lie in one place for as long as it is borrowed, which the host
// stream (host memory) addresses directly.
unsafe impl<T: Element, const N: usize> DeviceMemory<HostStream> for [T; N] {
    fn dtype(&self) -> DType {
        T::DTYPE
    }
    fn elems(&self) -> usize {
        N
    }
    fn addr(&self, s: &HostStream) -> DevPtr {
        self.as_slice().addr(s)
    }
    fn addr_mut(&mut self, s: &HostStream) -> DevPtr {
        self.as_mut_slice().addr_mut(s)
    }
}

// SAFETY: a Vec's pointer and length describe exactly its elements, which the host stream
// addresses directly; its heap allocation does not move while the Vec is borrowed (or moved).
unsafe impl<T: Element> DeviceMemory<HostStream> for Vec<T> {
    fn dtype(&self) -> DType {
        T::DTYPE
    }
    fn elems(&self) -> usize {
        self.len()
    }
    fn addr(&self, s: &HostStream) -> DevPtr {
        self.as_slice().addr(s)
    }
    fn addr_mut(&mut self, s: &HostStream) -> DevPtr {
        self.as_mut_slice().addr_mut(s)
    }
}

impl<S: Stream> DeviceComm<S> {
    /// Refuse a root that is not a rank.
    fn check_root(&self, c: Collective) -> Result<()> {
        match c {
            Collective::Broadcast { root } | Collective::Reduce { root } if root >= self.size() => {
                Err(bad(
                    c,
                    format!(
                        "root {root} is not a rank of this {}-rank communicator",
                        self.size()
                    ),
                ))
            }
            _ => Ok(()),
        }
    }

    /// Check an out-of-place call's buffers (element type, counts, root); the element count the
    /// collective runs on. The rules are the host [`crate::Communicator`]'s.
    fn check_split(
        &self,
        c: Collective,
        send: (DType, usize),
        recv: (DType, usize),
    ) -> Result<usize> {
        self.check_root(c)?;
        same_dtype(c, send.0, recv.0)?;
        let is_root = |root: usize| root == self.rank();
        match c {
            Collective::AllReduce | Collective::RingShift => {
                need(c, "recv", recv.1, send.1).map(|_| send.1)
            }
            Collective::ReduceScatter => {
                let want = self.chunk_range(send.1).len();
                need(c, "recv (this rank's chunk)", recv.1, want).map(|_| send.1)
            }
            Collective::AllGather => {
                let want = self.chunk_range(recv.1).len();
                need(c, "send (this rank's chunk of recv)", send.1, want).map(|_| recv.1)
            }
            // Only the root's send is read.
            Collective::Broadcast { root } if is_root(root) => {
                need(c, "send", send.1, recv.1).map(|_| recv.1)
            }
            Collective::Broadcast { .. } => Ok(recv.1),
            // Only the root's recv is written.
            Collective::Reduce { root } if is_root(root) => {
                need(c, "recv", recv.1, send.1).map(|_| send.1)
            }
            Collective::Reduce { .. } => Ok(send.1),
            Collective::Barrier => Ok(0),
            Collective::ReduceScatterV | Collective::AllGatherV => Err(v_needs_counts(c)),
            Collective::AllToAll => {
                need(c, "recv", recv.1, send.1)?;
                whole_blocks(send.1, self.size()).map(|_| send.1)
            }
            Collective::SendRecv
            | Collective::AllToAllV
            | Collective::Gather { .. }
            | Collective::Scatter { .. } => device_form(c, send.1, self.size()).map(|_| 0),
        }
    }

    /// Run `c` from `send` into `recv`, or in place in `recv`.
    fn out_of_place<B: DeviceMemory<S> + ?Sized>(
        &self,
        c: Collective,
        op: ReduceOp,
        send: Input<'_, B>,
        recv: &mut B,
    ) -> Result<()> {
        let Input::Buf(send) = send else {
            return self.in_place(c, op, recv);
        };
        let count = self.check_split(c, dims(send), dims(recv))?;
        let bufs = split(self.stream(), send, recv);
        // SAFETY: `send` and `recv` are borrowed (shared and exclusive, so distinct) for the
        // whole call, and are memory of this stream by the DeviceMemory impl.
        unsafe { self.run_raw(c, send.dtype(), op, count, bufs) }
    }

    fn in_place<B: DeviceMemory<S> + ?Sized>(
        &self,
        c: Collective,
        op: ReduceOp,
        buf: &mut B,
    ) -> Result<()> {
        self.check_root(c)?;
        let (dtype, n) = dims(buf);
        device_form(c, n, self.size())?;
        let bufs = one(self.stream(), buf);
        // SAFETY: `buf` is borrowed exclusively for the whole call.
        unsafe { self.run_raw(c, dtype, op, n, bufs) }
    }

    /// A v-collective `c` out of place ([`v_total`] checks the buffers) or in place.
    fn split_v<B: DeviceMemory<S> + ?Sized>(
        &self,
        c: Collective,
        op: ReduceOp,
        send: Input<'_, B>,
        recv: &mut B,
        counts: &[usize],
    ) -> Result<()> {
        let Input::Buf(send) = send else {
            return self.one_v(c, op, recv, counts);
        };
        let total = v_total(
            c,
            (dims(send), dims(recv)),
            counts,
            (self.rank(), self.size()),
        )?;
        let bufs = split(self.stream(), send, recv);
        // SAFETY: `send` and `recv` are borrowed (shared and exclusive, so distinct) for the
        // whole call, and are memory of this stream by the DeviceMemory impl.
        unsafe { self.run_counted(c, send.dtype(), op, Count::parts(total, counts), bufs) }
    }

    /// An in-place v-collective `c`: `counts` add up to `buf`'s length.
    fn one_v<B: DeviceMemory<S> + ?Sized>(
        &self,
        c: Collective,
        op: ReduceOp,
        buf: &mut B,
        counts: &[usize],
    ) -> Result<()> {
        let at = offsets(c, ("counts", counts), self.size(), ("recv", buf.elems()))?;
        let dtype = buf.dtype();
        let bufs = one(self.stream(), buf);
        let count = Count::parts(at[counts.len()], counts);
        // SAFETY: `buf` is borrowed exclusively for the whole call.
        unsafe { self.run_counted(c, dtype, op, count, bufs) }
    }

    /// Return only once every rank has entered the barrier (and the device work queued by
    /// earlier calls has completed).
    pub fn barrier(&self) -> Result<()> {
        let none = DevBufs::One { buf: 0, bytes: 0 };
        // SAFETY: no buffer: the barrier moves empty frames only.
        unsafe { self.run_raw(Collective::Barrier, DType::U8, ReduceOp::Sum, 0, none) }
    }
}

/// Asynchronous forms: owned buffers, driven by the proxy thread (see [`DeviceComm`]). Each
/// returns its buffers through the [`Work`]; bad arguments fail the `Work` at once and use no
/// sequence number.
impl<S: Stream + 'static> DeviceComm<S> {
    /// Completes once every rank has entered the barrier (and the device work queued before it
    /// has completed).
    pub fn barrier_async(&self) -> Work<()> {
        self.submit(|core| {
            let none = DevBufs::One { buf: 0, bytes: 0 };
            // SAFETY: no buffer: the barrier moves empty frames only.
            unsafe {
                core.execute(
                    Collective::Barrier,
                    DType::U8,
                    ReduceOp::Sum,
                    0.into(),
                    none,
                )
            }
        })
    }

    fn submit_one<B>(&self, c: Collective, op: ReduceOp, mut buf: B) -> Work<B>
    where
        B: DeviceMemory<S> + Send + 'static,
    {
        self.submit(move |core| {
            let (dtype, n) = (buf.dtype(), buf.elems());
            let bufs = one(&core.stream, &mut buf);
            // SAFETY: the job owns `buf` until the call returns, and the engine returns only
            // once the device work touching it has completed.
            unsafe { core.execute(c, dtype, op, n.into(), bufs) }?;
            Ok(buf)
        })
    }

    fn submit_split<B>(&self, c: Collective, op: ReduceOp, send: B, mut recv: B) -> Work<(B, B)>
    where
        B: DeviceMemory<S> + Send + 'static,
    {
        let count = match self.check_split(c, dims(&send), dims(&recv)) {
            Ok(n) => n,
            Err(e) => return Work::failed(e),
        };
        self.submit(move |core| {
            let bufs = split(&core.stream, &send, &mut recv);
            // SAFETY: the job owns both buffers (distinct values, so distinct memory) until the
            // call returns, and the engine returns only once the device work touching them has
            // completed.
            unsafe { core.execute(c, send.dtype(), op, count.into(), bufs) }?;
            Ok((send, recv))
        })
    }
}

impl<S: Stream + 'static> DeviceComm<S> {
    /// An out-of-place v-collective `c` on owned buffers ([`v_total`] checks them).
    fn submit_v<B>(
        &self,
        c: Collective,
        op: ReduceOp,
        send: B,
        mut recv: B,
        counts: &[usize],
    ) -> Work<(B, B)>
    where
        B: DeviceMemory<S> + Send + 'static,
    {
        let total = match v_total(
            c,
            (dims(&send), dims(&recv)),
            counts,
            (self.rank(), self.size()),
        ) {
            Ok(total) => total,
            Err(e) => return Work::failed(e),
        };
        let counts = counts.to_vec();
        self.submit(move |core| {
            let bufs = split(&core.stream, &send, &mut recv);
            let count = Count::parts(total, &counts);
            // SAFETY: the job owns both buffers (distinct values, so distinct memory) until the
            // call returns, and the engine returns only once the device work touching them has
            // completed.
            unsafe { core.execute(c, send.dtype(), op, count, bufs) }?;
            Ok((send, recv))
        })
    }
}

/// The elements of an out-of-place v-collective `c` whose buffers are `(send, recv)` (element
/// type, length), or why `counts` do not fit them: a reduce-scatter-v splits `send` into the
/// parts and leaves this rank's in `recv`; an all-gather-v the other way round. The rules are
/// the host communicator's.
fn v_total(
    c: Collective,
    (send, recv): ((DType, usize), (DType, usize)),
    counts: &[usize],
    (rank, n): (usize, usize),
) -> Result<usize> {
    same_dtype(c, send.0, recv.0)?;
    let (whole, part) = match c {
        Collective::ReduceScatterV => (("send", send.1), ("recv", recv.1)),
        _ => (("recv", recv.1), ("send", send.1)),
    };
    let at = offsets(c, ("counts", counts), n, whole)?;
    own_part(c, part, counts, rank)?;
    Ok(at[counts.len()])
}

/// The device address of an in-place call's buffer.
fn one<S: Stream, B: DeviceMemory<S> + ?Sized>(s: &S, buf: &mut B) -> DevBufs {
    DevBufs::One {
        bytes: buf.elems() * buf.dtype().size(),
        buf: buf.addr_mut(s),
    }
}

/// The device addresses of an out-of-place call's buffers.
fn split<S: Stream, B: DeviceMemory<S> + ?Sized>(s: &S, send: &B, recv: &mut B) -> DevBufs {
    DevBufs::Split {
        input: send.addr(s),
        input_bytes: send.elems() * send.dtype().size(),
        output: recv.addr_mut(s),
        output_bytes: recv.elems() * recv.dtype().size(),
    }
}

fn dims<S: Stream, B: DeviceMemory<S> + ?Sized>(b: &B) -> (DType, usize) {
    (b.dtype(), b.elems())
}
