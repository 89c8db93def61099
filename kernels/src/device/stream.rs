//! What a device offers the collectives and the ZeRO engine: a queue of arithmetic and copies on
//! addresses, run in order, and markers that tell when queued work has completed. Two
//! implementations, each beside the device it describes:
//! - a CUDA device (`Arc<Gpu>`, in `cuda`): the compute stream and its two copy
//!   lanes, NVRTC kernels, events;
//! - [`HostStream`](super::HostStream): the host as an asynchronous device — a worker thread that
//!   runs the CPU kernels on host addresses in the order queued. It gives the device engine the
//!   same asynchrony a GPU has (work completes after the call returns), so the engine's rules —
//!   publish a frame only after the work writing it completed, release a slot only after the
//!   work reading it did — are exercised for real on machines without a GPU.

use std::any::Any;

use bytemuck::{Pod, Zeroable};

use super::{CopyLane, DevPtr, DeviceError};
use crate::{DType, ReduceOp};

#[cfg(doc)]
use super::GATHER_MAX;

/// Exported device memory: its address, its 64-byte IPC handle, and its owner.
pub type Exported = (DevPtr, [u8; 64], Box<dyn Any + Send>);

/// How other ranks open a buffer of this rank ([`Stream::share`]): they open `handle` with
/// [`Stream::open_exported`] for `bytes` and add `offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct ShareRecord {
    /// The allocation's handle.
    pub handle: [u8; 64],
    /// The buffer's offset in it.
    pub offset: u64,
    /// The allocation's bytes.
    pub bytes: u64,
    /// The allocation's unique id (a reallocated buffer at the same address has another).
    pub id: u64,
}

/// A device's queue of work on addresses.
pub trait Stream: Send + Sync {
    /// Completes when the work queued before it has.
    type Marker: Send;

    /// The device, for messages (`cuda:0`, `host`).
    fn name(&self) -> String;

    /// The largest frame payload this device's ring edges should use when the configuration
    /// names none (`RINGZERO_DEVICE_SLICE_BYTES`); `None`: the host path's `slice_bytes`.
    fn slice_bytes(&self) -> Option<usize> {
        None
    }

    /// Whether the memory this stream's work touches stays valid until that work has ended,
    /// even once the caller has let go of it: true for CUDA, whose buffers synchronize their
    /// context before they are freed. False (the default) for host memory, which may be freed
    /// and handed out again the moment a call returns: there a call that fails waits for the
    /// work it queued to end before it returns, past its deadline if need be, so
    /// such a stream's work must always end by itself (it only touches memory, it never waits
    /// on another rank).
    fn memory_outlives_work(&self) -> bool {
        false
    }

    /// Queue `dst[..n] = a[..n] op b[..n]` (`Avg` combines as `Sum`). `dst` may equal `a`.
    ///
    /// # Safety
    /// The ranges must be device-addressable memory of `n` elements of `dtype`, live until the
    /// work completes, and `dst` must not partially overlap `a` or `b`.
    unsafe fn combine(
        &self,
        dtype: DType,
        op: ReduceOp,
        dst: DevPtr,
        a: DevPtr,
        b: DevPtr,
        n: usize,
    ) -> Result<(), DeviceError>;

    /// Queue `dst[..n] = also[..n] = a[..n] op b[..n]`: a step whose result is both kept and
    /// sent. By default a combine into `dst` and a copy of it to `also`; a device may do it in one
    /// pass, which saves reading the result back.
    ///
    /// # Safety
    /// As for [`Stream::combine`], and `also` is a fourth such range, overlapping none of the
    /// others.
    #[allow(clippy::too_many_arguments)]
    unsafe fn combine2(
        &self,
        dtype: DType,
        op: ReduceOp,
        dst: DevPtr,
        also: DevPtr,
        a: DevPtr,
        b: DevPtr,
        n: usize,
    ) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract covers both calls' ranges.
        unsafe {
            self.combine(dtype, op, dst, a, b, n)?;
            self.copy(also, dst, n * dtype.size())
        }
    }

    /// Queue copies of `bytes` from `src` to `dst` and to `also`: a step that keeps what it
    /// forwards. By default two copies; a device may do it in one pass (one read of `src`).
    ///
    /// # Safety
    /// As for [`Stream::copy`], for both destinations, which overlap neither `src` nor each other.
    unsafe fn copy2(
        &self,
        dst: DevPtr,
        also: DevPtr,
        src: DevPtr,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract covers both copies.
        unsafe {
            self.copy(dst, src, bytes)?;
            self.copy(also, src, bytes)
        }
    }

    /// Queue two unrelated copies as one piece of work: `a_bytes` from `a_src` to `a`, and
    /// `b_bytes` from `b_src` to `b` and, when given, to `b_also`. The ring queues a slice's last
    /// receive (a slot into the output) and the next slice's first send (a chunk into the next
    /// rank's slot) this way, so a link staged in host memory carries both directions at once
    /// instead of one after the other. By default the copies run one after the other; a device
    /// may do them in one pass.
    ///
    /// # Safety
    /// As for [`Stream::copy`], for every range; no written range overlaps any other.
    #[allow(clippy::too_many_arguments)]
    unsafe fn copy_pair(
        &self,
        a: DevPtr,
        a_src: DevPtr,
        a_bytes: usize,
        b: DevPtr,
        b_also: Option<DevPtr>,
        b_src: DevPtr,
        b_bytes: usize,
    ) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract covers every copy.
        unsafe {
            self.copy(a, a_src, a_bytes)?;
            match b_also {
                Some(also) => self.copy2(b, also, b_src, b_bytes),
                None => self.copy(b, b_src, b_bytes),
            }
        }
    }

    /// Queue `dst[..n] /= ranks`.
    ///
    /// # Safety
    /// As for [`Stream::combine`], one range.
    unsafe fn divide(
        &self,
        dtype: DType,
        dst: DevPtr,
        n: usize,
        ranks: usize,
    ) -> Result<(), DeviceError>;

    /// Queue `outs[j][..n] = ins[0][..n] op ins[1][..n] op … op ins[k-1][..n]` for every `j`:
    /// the inputs combined in order, rounded to `dtype` after each operation as
    /// [`Stream::combine`] rounds (`Avg` combines as `Sum`), divided by `ranks` when it is given,
    /// and the one result written to every output; with one input, a copy to every output. At
    /// most [`GATHER_MAX`] of each.
    ///
    /// # Safety
    /// Every range must be device-addressable memory of `n` elements of `dtype`, live until the
    /// work completes. An output may equal an input; otherwise no range that is written overlaps
    /// another range.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gather(
        &self,
        dtype: DType,
        op: ReduceOp,
        outs: &[DevPtr],
        ins: &[DevPtr],
        n: usize,
        ranks: Option<usize>,
    ) -> Result<(), DeviceError>;

    /// How another rank reaches the buffer at `addr`, or why it cannot (memory the device cannot
    /// export).
    fn share(&self, addr: DevPtr) -> Result<ShareRecord, DeviceError>;

    /// Queue a copy of `bytes` from `src` to `dst`.
    ///
    /// # Safety
    /// Both ranges live until the work completes; no overlap.
    unsafe fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), DeviceError>;

    /// Queue a copy of `bytes` from `src` to `dst` on copy lane `lane`: after what the lane
    /// holds and whatever was joined into it ([`Stream::lane_after_compute`]), beside the
    /// compute order, which does not wait for it unless joined ([`Stream::compute_after_lane`]).
    /// [`Stream::mark`] covers it. By default a lane is the compute order itself.
    ///
    /// # Safety
    /// As for [`Stream::copy`].
    unsafe fn copy_on(
        &self,
        lane: CopyLane,
        dst: DevPtr,
        src: DevPtr,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        let _ = lane;
        // SAFETY: forwarded from the caller.
        unsafe { self.copy(dst, src, bytes) }
    }

    /// Make work queued on `lane` from now on wait for everything queued in the compute order
    /// so far.
    fn lane_after_compute(&self, lane: CopyLane) -> Result<(), DeviceError> {
        let _ = lane;
        Ok(())
    }

    /// Make work queued in the compute order from now on wait for everything queued on `lane`
    /// so far.
    fn compute_after_lane(&self, lane: CopyLane) -> Result<(), DeviceError> {
        let _ = lane;
        Ok(())
    }

    /// A marker after everything queued so far, the copy lanes' work included.
    fn mark(&self) -> Result<Self::Marker, DeviceError>;

    /// Whether the work before `m` has completed (an error if any of it failed).
    fn done(&self, m: &Self::Marker) -> Result<bool, DeviceError>;

    /// Make `bytes` of host memory at `host` addressable by this device: its device address and
    /// an owner that undoes it on Drop.
    ///
    /// # Safety
    /// The range must stay mapped until the owner is dropped.
    unsafe fn map_host(
        &self,
        host: *mut u8,
        bytes: usize,
    ) -> Result<(DevPtr, Box<dyn Any + Send>), DeviceError>;

    /// `bytes` of private device memory (staging scratch): its address and its owner, which frees
    /// it on Drop.
    fn scratch(&self, bytes: usize) -> Result<(DevPtr, Box<dyn Any + Send>), DeviceError>;

    /// This device's identity across processes (a GPU's UUID), if it has one; devices with equal
    /// identities are the same device.
    fn identity(&self) -> Option<[u8; 16]>;

    /// Whether this device may access the device with identity `peer` directly, or why that
    /// cannot be known.
    fn can_access_peer(&self, peer: &[u8; 16]) -> Result<bool, String>;

    /// `bytes` of device memory another process can open ([`Stream::open_exported`]): its
    /// address, its 64-byte handle and its owner.
    fn export(&self, bytes: usize) -> Result<Exported, DeviceError>;

    /// Open memory another process exported: its address here and the mapping's owner.
    fn open_exported(
        &self,
        handle: &[u8; 64],
        bytes: usize,
    ) -> Result<(DevPtr, Box<dyn Any + Send>), DeviceError>;

    /// Wait for queued work, then copy from `src` into host bytes.
    ///
    /// # Safety
    /// `src..src + dst.len()` must be live device-addressable memory.
    unsafe fn read(&self, dst: &mut [u8], src: DevPtr) -> Result<(), DeviceError>;
}
