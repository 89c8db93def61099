//! A CUDA device as a [`Stream`]: work goes on the device's compute stream, markers are events,
//! host staging memory is page-locked and mapped with `cuMemHostRegister`.

use std::any::Any;
use std::sync::Arc;

use ringzero_kernels::device::cuda::raw::{
    self, ExportedSlots, HostRegistration, IpcMapping, Marker,
};
use ringzero_kernels::device::cuda::Gpu;
use ringzero_kernels::device::DeviceError;
use ringzero_kernels::{DType, ReduceOp};

use super::stream::{CopyLane, Exported, Share, Stream};
use crate::transport::device::DevPtr;

impl Stream for Arc<Gpu> {
    type Marker = Marker;

    fn name(&self) -> String {
        format!("cuda:{}", self.ordinal())
    }

    fn slice_bytes(&self) -> Option<usize> {
        Some(crate::config::DEFAULT_GPU_SLICE_BYTES)
    }

    fn memory_outlives_work(&self) -> bool {
        // A DeviceBuffer (the only caller memory a GPU collective takes) synchronizes its
        // context before cuMemFree, so a failing call may return at its deadline: a hung peer
        // copy must not hold it longer.
        true
    }

    unsafe fn combine(
        &self,
        dtype: DType,
        op: ReduceOp,
        dst: DevPtr,
        a: DevPtr,
        b: DevPtr,
        n: usize,
    ) -> Result<(), DeviceError> {
        // SAFETY: forwarded from the caller's contract, which is the kernel's.
        unsafe { self.combine_at(dtype, op, dst, a, b, n) }
    }

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
        // SAFETY: forwarded from the caller's contract, which is the kernel's.
        unsafe { self.combine2_at(dtype, op, dst, also, a, b, n) }
    }

    unsafe fn copy2(
        &self,
        dst: DevPtr,
        also: DevPtr,
        src: DevPtr,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        // SAFETY: forwarded from the caller's contract, which is the kernel's.
        unsafe { self.copy2_at(dst, also, src, bytes) }
    }

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
        // SAFETY: forwarded from the caller's contract, which is the kernel's.
        unsafe { self.copy_pair_at(a, a_src, a_bytes, b, b_also, b_src, b_bytes) }
    }

    unsafe fn divide(
        &self,
        dtype: DType,
        dst: DevPtr,
        n: usize,
        ranks: usize,
    ) -> Result<(), DeviceError> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.divide_at(dtype, dst, n, ranks) }
    }

    unsafe fn gather(
        &self,
        dtype: DType,
        op: ReduceOp,
        outs: &[DevPtr],
        ins: &[DevPtr],
        n: usize,
        ranks: Option<usize>,
    ) -> Result<(), DeviceError> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.gather_at(dtype, op, outs, ins, n, ranks) }
    }

    fn share(&self, addr: DevPtr) -> Result<Share, DeviceError> {
        let m = self.share_of(addr)?;
        Ok(Share {
            handle: m.handle,
            offset: m.offset,
            bytes: m.bytes as u64,
            id: m.id,
        })
    }

    unsafe fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), DeviceError> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.copy_at(dst, src, bytes) }
    }

    unsafe fn copy_on(
        &self,
        lane: CopyLane,
        dst: DevPtr,
        src: DevPtr,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        // SAFETY: forwarded from the caller's contract, which is the copy's.
        unsafe { self.copy_on_at(lane, dst, src, bytes) }
    }

    fn lane_after_compute(&self, lane: CopyLane) -> Result<(), DeviceError> {
        Gpu::lane_after_compute(self, lane)
    }

    fn compute_after_lane(&self, lane: CopyLane) -> Result<(), DeviceError> {
        Gpu::compute_after_lane(self, lane)
    }

    fn mark(&self) -> Result<Marker, DeviceError> {
        Gpu::mark(self)
    }

    fn done(&self, m: &Marker) -> Result<bool, DeviceError> {
        m.done()
    }

    unsafe fn map_host(
        &self,
        host: *mut u8,
        bytes: usize,
    ) -> Result<(DevPtr, Box<dyn Any + Send>), DeviceError> {
        // SAFETY: the caller keeps the range mapped until the owner (returned) is dropped.
        let reg = unsafe { HostRegistration::new(self, host, bytes)? };
        let dev = reg.device_ptr(host)?;
        Ok((dev, Box::new(reg)))
    }

    fn identity(&self) -> Option<[u8; 16]> {
        self.uuid().ok()
    }

    fn can_access_peer(&self, peer: &[u8; 16]) -> Result<bool, String> {
        let n = raw::device_count().map_err(|e| e.to_string())?;
        for o in 0..n {
            if raw::uuid_of(o).map_err(|e| e.to_string())? == *peer {
                return raw::peer_access(self.ordinal(), o)
                    .map(|p| p.can_access)
                    .map_err(|e| e.to_string());
            }
        }
        Err("the sender's GPU is not visible to this process (CUDA_VISIBLE_DEVICES?)".into())
    }

    fn export(&self, bytes: usize) -> Result<Exported, DeviceError> {
        let mem = ExportedSlots::new(self, bytes, 0)?;
        let h = mem.handle()?;
        Ok((mem.ptr(), h, Box::new(mem)))
    }

    fn scratch(&self, bytes: usize) -> Result<(DevPtr, Box<dyn Any + Send>), DeviceError> {
        let mem = ExportedSlots::new(self, bytes, 0)?;
        Ok((mem.ptr(), Box::new(mem)))
    }

    fn open_exported(
        &self,
        handle: &[u8; 64],
        bytes: usize,
    ) -> Result<(DevPtr, Box<dyn Any + Send>), DeviceError> {
        let m = IpcMapping::open(self, handle, bytes)?;
        Ok((m.ptr(), Box::new(m)))
    }

    unsafe fn read(&self, dst: &mut [u8], src: DevPtr) -> Result<(), DeviceError> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.read_at(dst, src) }
    }
}
