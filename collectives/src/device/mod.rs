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

pub mod comm;
#[cfg(feature = "cuda")]
mod cuda;
pub mod stream;

pub use comm::DeviceComm;
pub use ringzero_kernels::device::DeviceError;
pub use stream::{HostStream, Stream};

use ringzero_kernels::{DType, Element, ReduceOp};

use crate::error::{Error, Result};
use crate::ring::device_engine::DevBufs;
use crate::ring::Collective;
use crate::transport::device::Addr;

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
    fn addr(&self, s: &S) -> Addr;
    /// Address for writing.
    fn addr_mut(&mut self, s: &S) -> Addr;
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
    fn addr(&self, _: &HostStream) -> Addr {
        self.as_ptr() as usize as Addr
    }
    fn addr_mut(&mut self, _: &HostStream) -> Addr {
        self.as_mut_ptr() as usize as Addr
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
    fn addr(&self, s: &std::sync::Arc<ringzero_kernels::device::cuda::Gpu>) -> Addr {
        s.ptr_of(self)
    }
    fn addr_mut(&mut self, s: &std::sync::Arc<ringzero_kernels::device::cuda::Gpu>) -> Addr {
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

impl<S: Stream> DeviceComm<S> {
    fn split<B: DeviceMemory<S> + ?Sized>(&self, send: &B, recv: &mut B) -> DevBufs {
        let s = self.stream();
        DevBufs::Split {
            input: send.addr(s),
            input_bytes: send.elems() * send.dtype().size(),
            output: recv.addr_mut(s),
            output_bytes: recv.elems() * recv.dtype().size(),
        }
    }

    /// Every rank ends with `op` over every rank's `send`, in `recv`.
    pub fn all_reduce<B: DeviceMemory<S> + ?Sized>(
        &mut self,
        send: &B,
        recv: &mut B,
        op: ReduceOp,
    ) -> Result<()> {
        let c = Collective::AllReduce;
        same_dtype(c, send.dtype(), recv.dtype())?;
        need(c, "recv", recv.elems(), send.elems())?;
        let bufs = self.split(send, recv);
        // SAFETY: `send` and `recv` are borrowed (shared and exclusive, so distinct) for the
        // whole call, and are memory of this stream by the DeviceMemory impl.
        unsafe { self.run_raw(c, send.dtype(), op, send.elems(), bufs) }
    }

    /// In-place all-reduce.
    pub fn all_reduce_in_place<B: DeviceMemory<S> + ?Sized>(
        &mut self,
        buf: &mut B,
        op: ReduceOp,
    ) -> Result<()> {
        let (dtype, n) = (buf.dtype(), buf.elems());
        let bufs = DevBufs::One {
            buf: buf.addr_mut(self.stream()),
            bytes: n * dtype.size(),
        };
        // SAFETY: `buf` is borrowed exclusively for the whole call.
        unsafe { self.run_raw(Collective::AllReduce, dtype, op, n, bufs) }
    }

    /// Rank `r` ends with chunk `r` (see [`DeviceComm::chunk_range`]) of `op` over every rank's
    /// `send`.
    pub fn reduce_scatter<B: DeviceMemory<S> + ?Sized>(
        &mut self,
        send: &B,
        recv: &mut B,
        op: ReduceOp,
    ) -> Result<()> {
        let c = Collective::ReduceScatter;
        same_dtype(c, send.dtype(), recv.dtype())?;
        let want = self.chunk_range(send.elems()).len();
        need(c, "recv (this rank's chunk)", recv.elems(), want)?;
        let bufs = self.split(send, recv);
        // SAFETY: as for all_reduce.
        unsafe { self.run_raw(c, send.dtype(), op, send.elems(), bufs) }
    }

    /// Every rank ends with every rank's chunk of `recv` (this rank contributes `send`).
    pub fn all_gather<B: DeviceMemory<S> + ?Sized>(
        &mut self,
        send: &B,
        recv: &mut B,
    ) -> Result<()> {
        let c = Collective::AllGather;
        same_dtype(c, send.dtype(), recv.dtype())?;
        let want = self.chunk_range(recv.elems()).len();
        need(c, "send (this rank's chunk of recv)", send.elems(), want)?;
        let bufs = self.split(send, recv);
        // SAFETY: as for all_reduce.
        unsafe { self.run_raw(c, send.dtype(), ReduceOp::Sum, recv.elems(), bufs) }
    }

    /// Every rank ends with `root`'s `buf`.
    pub fn broadcast_in_place<B: DeviceMemory<S> + ?Sized>(
        &mut self,
        buf: &mut B,
        root: usize,
    ) -> Result<()> {
        let c = Collective::Broadcast { root };
        if root >= self.size() {
            return Err(bad(
                c,
                format!(
                    "root {root} is not a rank of this {}-rank communicator",
                    self.size()
                ),
            ));
        }
        let (dtype, n) = (buf.dtype(), buf.elems());
        let bufs = DevBufs::One {
            buf: buf.addr_mut(self.stream()),
            bytes: n * dtype.size(),
        };
        // SAFETY: `buf` is borrowed exclusively for the whole call.
        unsafe { self.run_raw(c, dtype, ReduceOp::Sum, n, bufs) }
    }
}
