//! A [`Gpu`] as a [`Stream`]: the work it queues on raw addresses — copies, kernels (combine,
//! gather, divide), markers, and the copy lanes beside the compute stream.

use std::sync::atomic::Ordering;

use cudarc::driver::{result, sys, CudaEvent, PushKernelArg};

use std::any::Any;

use super::super::{cu_type, device_count, driver, Gpu};
use crate::device::{CopyLane, DevPtr, DeviceError, Exported, ShareRecord, Stream, GATHER_MAX};
use crate::{DType, ReduceOp};

use super::*;

/// Completes once everything queued before it on the device's compute stream has.
pub struct Marker(CudaEvent);

impl Marker {
    /// Whether the work before it has finished.
    pub fn done(&self) -> Result<bool, DeviceError> {
        self.0
            .try_is_complete()
            .map_err(driver("querying an event (a kernel or copy failed?)"))
    }

    /// Wait for it.
    pub fn wait(&self) -> Result<(), DeviceError> {
        self.0.synchronize().map_err(driver("waiting for an event"))
    }
}

impl Gpu {
    /// The device's UUID (identifies it across processes and ordinals).
    pub fn uuid(&self) -> Result<[u8; 16], DeviceError> {
        let u = self.ctx.uuid().map_err(driver("reading the device UUID"))?;
        Ok(u.bytes.map(|c| c as u8))
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The address of a buffer's first byte (valid while the buffer lives).
    pub fn ptr_of(&self, buf: &super::super::DeviceBuffer) -> DevPtr {
        use cudarc::driver::DevicePtr;
        let (p, _sync) = buf.buf.device_ptr(&self.stream);
        p
    }

    /// `combine_<op>_<dtype>(dst, a, b, n)`, or with `also` `combine2_<op>_<dtype>(dst, also, a,
    /// b, n)`.
    ///
    /// # Safety
    /// As for [`Stream::combine2`] (with `also`) or [`Stream::combine`] (without).
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_combine(
        &self,
        dtype: DType,
        op: ReduceOp,
        dst: DevPtr,
        also: Option<DevPtr>,
        a: DevPtr,
        b: DevPtr,
        n: usize,
    ) -> Result<(), DeviceError> {
        self.check()?;
        if n == 0 {
            return Ok(());
        }
        let (kernel, what) = if also.is_some() {
            ("combine2", "launching combine2")
        } else {
            ("combine", "launching combine")
        };
        let f = self.func(&format!(
            "{kernel}_{}_{}",
            pairwise_name(op),
            cu_type(dtype)
        ))?;
        let n64 = n as u64;
        let mut l = self.stream.launch_builder(&f);
        l.arg(&dst);
        if let Some(also) = &also {
            l.arg(also);
        }
        l.arg(&a).arg(&b).arg(&n64);
        // SAFETY: the caller guarantees every range; the grid-stride loop stays below `n`.
        unsafe { l.launch(Self::cfg(n)) }.map_err(driver(what))?;
        Ok(())
    }

    /// How another process reaches the memory at `ptr`: the IPC handle of the allocation holding
    /// it, `ptr`'s offset in that allocation, the allocation's length, and its process-wide
    /// unique buffer id (a freed and reallocated buffer at the same address gets a new id, so a
    /// peer that caches its mapping by id never writes into memory that was freed). Fails for
    /// memory IPC cannot export (from a stream-ordered pool, host memory, managed memory).
    pub fn share_of(&self, ptr: DevPtr) -> Result<SharedMemory, DeviceError> {
        self.check()?;
        self.ctx
            .bind_to_thread()
            .map_err(sys_err("binding the context"))?;
        let (mut base, mut bytes): (DevPtr, usize) = (0, 0);
        // SAFETY: valid out-pointers; the driver checks that `ptr` is a device address.
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut bytes, ptr) }
            .result()
            .map_err(sys_err(
                "finding the allocation of a buffer (cuMemGetAddressRange)",
            ))?;
        let mut id: u64 = 0;
        // SAFETY: BUFFER_ID is a u64 attribute and `id` a valid out-pointer to one.
        unsafe {
            sys::cuPointerGetAttribute(
                (&mut id as *mut u64).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID,
                ptr,
            )
        }
        .result()
        .map_err(sys_err("reading a buffer's id (cuPointerGetAttribute)"))?;
        let mut h = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        // SAFETY: `base` is the base of a live allocation of this context (the driver just said
        // so) and `h` is a valid out-pointer; the driver refuses memory it cannot export.
        unsafe { sys::cuIpcGetMemHandle(&mut h, base) }
            .result()
            .map_err(sys_err(
            "exporting a buffer (cuIpcGetMemHandle: only plain cuMemAlloc memory can be shared)",
        ))?;
        Ok(SharedMemory {
            handle: h.reserved.map(|c| c as u8),
            offset: ptr - base,
            bytes,
            id,
        })
    }

    /// [`Stream::copy`] on the compute stream (`None`) or [`Stream::copy_on`] on a lane.
    ///
    /// # Safety
    /// As for [`Stream::copy`].
    unsafe fn copy_on_stream(
        &self,
        lane: Option<CopyLane>,
        dst: DevPtr,
        src: DevPtr,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        if bytes == 0 {
            return self.check();
        }
        self.for_raw_calls()?;
        let stream = match lane {
            Some(l) => {
                self.lane_dirty[l.index()].store(true, Ordering::Release);
                &self.lanes[l.index()]
            }
            None => &self.stream,
        };
        // SAFETY: the caller guarantees both ranges; the stream belongs to this context.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, stream.cu_stream()) }
            .map_err(driver("copying device to device"))
    }

    /// Before a raw driver call on the compute stream: no earlier error, and this device's
    /// context current on the calling thread (the raw calls do not make it current themselves,
    /// and the thread may be a communicator's proxy thread that has never used this device).
    pub(in crate::device::cuda) fn for_raw_calls(&self) -> Result<(), DeviceError> {
        self.check()?;
        self.ctx
            .bind_to_thread()
            .map_err(driver("binding the context"))
    }

    /// Let this device's context address `peer`'s memory (`cuCtxEnablePeerAccess`); enabling it
    /// twice is fine, and the same device needs nothing.
    pub fn enable_peer_access(&self, peer: &Gpu) -> Result<(), DeviceError> {
        self.check()?;
        if self.ctx.ordinal() == peer.ctx.ordinal() {
            return Ok(());
        }
        self.ctx
            .bind_to_thread()
            .map_err(sys_err("binding the context"))?;
        // SAFETY: `peer`'s context handle is live (its Gpu is borrowed); flags must be 0.
        match unsafe { sys::cuCtxEnablePeerAccess(peer.ctx.cu_ctx(), 0) } {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
                Ok(())
            }
            e => Err(sys_err("cuCtxEnablePeerAccess")(result::DriverError(e))),
        }
    }

    /// Queue a copy of `bytes` from `src` (this device) to `dst` on `dst_gpu`
    /// (`cuMemcpyPeerAsync` on this device's compute stream; a direct peer copy once
    /// [`Gpu::enable_peer_access`] succeeded, staged by the driver otherwise).
    ///
    /// # Safety
    /// `src..src + bytes` must be live memory of this device and `dst..dst + bytes` of
    /// `dst_gpu`'s, both until the work completes.
    pub unsafe fn copy_peer_at(
        &self,
        dst: DevPtr,
        dst_gpu: &Gpu,
        src: DevPtr,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        self.check()?;
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the caller guarantees both ranges; both context handles are live.
        unsafe {
            result::memcpy_peer_async(
                dst_gpu.ctx.cu_ctx(),
                dst,
                self.ctx.cu_ctx(),
                src,
                bytes,
                self.stream.cu_stream(),
            )
        }
        .map_err(driver("copying between devices"))
    }

    /// Milliseconds per pair of copies of `bytes` running at once, one each way across the
    /// host link: `from_host → to_dev` on the compute stream and `from_dev → to_host` on the copy
    /// stream (one untimed pair first, then `reps`, timed on the host clock from idle streams to
    /// both drained). What host staging moves, since its ranks send and receive at once: a PCIe
    /// link gives each direction less while the other runs than either alone.
    ///
    /// # Safety
    /// The four ranges must be live device-addressable memory (device, or mapped pinned host) of
    /// `bytes` bytes until this returns, and must not overlap.
    pub unsafe fn time_both_ways(
        &self,
        to_dev: DevPtr,
        from_host: DevPtr,
        to_host: DevPtr,
        from_dev: DevPtr,
        bytes: usize,
        reps: usize,
    ) -> Result<f64, DeviceError> {
        self.check()?;
        self.ctx
            .bind_to_thread()
            .map_err(driver("binding the context"))?;
        let sync = || -> Result<(), DeviceError> {
            self.stream.synchronize().map_err(driver("synchronizing"))?;
            self.copy.synchronize().map_err(driver("synchronizing"))
        };
        let pair = || -> Result<(), DeviceError> {
            // SAFETY: the caller guarantees the four ranges until this function returns, and
            // it drains both streams before returning; both streams belong to this context.
            unsafe {
                result::memcpy_dtod_async(to_dev, from_host, bytes, self.stream.cu_stream())
                    .map_err(driver("copying host to device"))?;
                result::memcpy_dtod_async(to_host, from_dev, bytes, self.copy.cu_stream())
                    .map_err(driver("copying device to host"))
            }
        };
        sync()?;
        pair()?;
        sync()?;
        let start = std::time::Instant::now();
        for _ in 0..reps.max(1) {
            pair()?;
        }
        sync()?;
        Ok(start.elapsed().as_secs_f64() * 1e3 / reps.max(1) as f64)
    }
}

/// The GPU as the collectives' and the ZeRO engine's device: work goes on the compute stream
/// (copies in and out of host staging on the two copy lanes), markers are events, host staging
/// memory is page-locked and mapped with `cuMemHostRegister`.
impl Stream for Arc<Gpu> {
    type Marker = Marker;

    fn name(&self) -> String {
        format!("cuda:{}", self.ordinal())
    }

    fn slice_bytes(&self) -> Option<usize> {
        Some(crate::device::GPU_SLICE_BYTES)
    }

    fn memory_outlives_work(&self) -> bool {
        // A DeviceBuffer (the only caller memory a GPU collective takes) synchronizes its
        // context before cuMemFree, so a failing call may return at its deadline: a hung peer
        // copy must not hold it longer.
        true
    }

    /// A marker after everything queued so far.
    fn mark(&self) -> Result<Marker, DeviceError> {
        self.check()?;
        for lane in CopyLane::BOTH {
            if self.lane_dirty[lane.index()].load(Ordering::Acquire) {
                self.compute_after_lane(lane)?;
            }
        }
        let e = self
            .stream
            .record_event(None)
            .map_err(driver("recording an event"))?;
        Ok(Marker(e))
    }

    /// Queue `dst[..n] = a[..n] op b[..n]` (`Avg` combines as `Sum`; finish with
    /// [`Stream::divide`]). `dst` may equal `a`.
    ///
    /// # Safety
    /// The three ranges must be live device-addressable memory of `n` elements of `dtype` until
    /// the work completes (see [`Stream::mark`]); `dst` must not partially overlap `a` or `b`.
    unsafe fn combine(
        &self,
        dtype: DType,
        op: ReduceOp,
        dst: DevPtr,
        a: DevPtr,
        b: DevPtr,
        n: usize,
    ) -> Result<(), DeviceError> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.launch_combine(dtype, op, dst, None, a, b, n) }
    }

    /// Queue `dst[..n] = also[..n] = a[..n] op b[..n]` in one pass (`Avg` combines as `Sum`).
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
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.launch_combine(dtype, op, dst, Some(also), a, b, n) }
    }

    /// Queue `outs[j][..n] = ins[0][..n] op ins[1][..n] op … op ins[k-1][..n]` for every `j`, in
    /// one pass: the inputs combined in order (rounded to `dtype` after each operation, as
    /// [`Stream::combine`] rounds), divided by `ranks` when it is given (`Avg` combines as `Sum`),
    /// and the one result written to every output. With one input it copies to every output.
    ///
    /// # Safety
    /// Every range must be live device-addressable memory of `n` elements of `dtype` until the
    /// work completes (see [`Stream::mark`]). An output may equal an input; otherwise no two ranges
    /// that are written overlap any other range.
    unsafe fn gather(
        &self,
        dtype: DType,
        op: ReduceOp,
        outs: &[DevPtr],
        ins: &[DevPtr],
        n: usize,
        ranks: Option<usize>,
    ) -> Result<(), DeviceError> {
        self.check()?;
        crate::device::check_gather(ins.len(), outs.len())?;
        if n == 0 {
            return Ok(());
        }
        let ranks = match ranks {
            None => 0i32,
            Some(r) => i32::try_from(r)
                .map_err(|_| DeviceError::Invalid(format!("gather: cannot divide by {r} ranks")))?,
        };
        let f = self.func(&format!("gather_{}_{}", pairwise_name(op), cu_type(dtype)))?;
        let pack = |v: &[DevPtr]| {
            let mut a = [0u64; GATHER_MAX];
            a[..v.len()].copy_from_slice(v);
            a
        };
        let (ip, op_) = (pack(ins), pack(outs));
        let (nin, nout, n64) = (ins.len() as u32, outs.len() as u32, n as u64);
        let mut l = self.stream.launch_builder(&f);
        l.arg(&ip)
            .arg(&nin)
            .arg(&op_)
            .arg(&nout)
            .arg(&n64)
            .arg(&ranks);
        // SAFETY: the caller guarantees every range; `[u64; 8]` has the layout of the kernel's
        // `Ptrs8` (eight 8-byte words, 8-byte aligned), and the kernel reads only the first
        // `nin`/`nout` of them and stays below `n` elements.
        unsafe { l.launch(Gpu::cfg(n)) }.map_err(driver("launching gather"))?;
        Ok(())
    }

    /// Queue copies of `bytes` from `src` to both `dst` and `also` in one pass (one read).
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
        self.check()?;
        if bytes == 0 {
            return Ok(());
        }
        let f = self.func("copy2")?;
        let b64 = bytes as u64;
        let mut l = self.stream.launch_builder(&f);
        l.arg(&dst).arg(&also).arg(&src).arg(&b64);
        // SAFETY: the caller guarantees the three ranges; the grid-stride loop stays below
        // `bytes`.
        unsafe { l.launch(Gpu::cfg(bytes.div_ceil(16))) }.map_err(driver("launching copy2"))?;
        Ok(())
    }

    /// Queue two unrelated copies in one kernel: `a_bytes` from `a_src` to `a`, and `b_bytes`
    /// from `b_src` to `b` and, when given, to `b_also` (so a host-staged link carries both
    /// directions at once).
    ///
    /// # Safety
    /// Every range must be live device-addressable memory of its length until the work
    /// completes; no written range may overlap any other range.
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
        self.check()?;
        if a_bytes + b_bytes == 0 {
            return Ok(());
        }
        let f = self.func("copy_pair")?;
        let (ab, bb, also) = (a_bytes as u64, b_bytes as u64, b_also.unwrap_or(0));
        let mut l = self.stream.launch_builder(&f);
        l.arg(&a)
            .arg(&a_src)
            .arg(&ab)
            .arg(&b)
            .arg(&also)
            .arg(&b_src)
            .arg(&bb);
        // SAFETY: the caller guarantees the ranges; the grid-stride loops stay below each
        // range's length, and a null `b_also` is never written.
        unsafe { l.launch(Gpu::cfg((a_bytes + b_bytes).div_ceil(16))) }
            .map_err(driver("launching copy_pair"))?;
        Ok(())
    }

    /// Queue `dst[..n] /= ranks` (the end of an average).
    ///
    /// # Safety
    /// As for [`Stream::combine`], for the one range.
    unsafe fn divide(
        &self,
        dtype: DType,
        dst: DevPtr,
        n: usize,
        ranks: usize,
    ) -> Result<(), DeviceError> {
        self.check()?;
        if ranks == 0 || ranks > i32::MAX as usize {
            return Err(DeviceError::Invalid(format!("divide by {ranks} ranks")));
        }
        if n == 0 {
            return Ok(());
        }
        let f = self.func(&format!("divide_{}", cu_type(dtype)))?;
        let (n64, r) = (n as u64, ranks as i32);
        let mut l = self.stream.launch_builder(&f);
        l.arg(&dst).arg(&n64).arg(&r);
        // SAFETY: the caller guarantees the range; grid-stride bounded by `n`.
        unsafe { l.launch(Gpu::cfg(n)) }.map_err(driver("launching divide"))?;
        Ok(())
    }

    /// Queue a copy of `bytes` from `src` to `dst` (device, IPC-mapped or mapped host memory).
    ///
    /// # Safety
    /// Both ranges must be live device-addressable memory until the work completes, and must not
    /// overlap.
    unsafe fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), DeviceError> {
        // SAFETY: forwarded from the caller.
        unsafe { self.copy_on_stream(None, dst, src, bytes) }
    }

    /// Queue a copy of `bytes` from `src` to `dst` on copy lane `lane`: after what that lane
    /// holds and whatever was joined into it ([`Stream::lane_after_compute`]), beside the compute
    /// stream. [`Stream::mark`] covers it.
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
        // SAFETY: forwarded from the caller.
        unsafe { self.copy_on_stream(Some(lane), dst, src, bytes) }
    }

    /// Make work queued on `lane` from now on wait for everything queued on the compute stream
    /// so far.
    fn lane_after_compute(&self, lane: CopyLane) -> Result<(), DeviceError> {
        self.for_raw_calls()?;
        self.lanes[lane.index()]
            .join(&self.stream)
            .map_err(driver("ordering a copy lane after the compute stream"))
    }

    /// Make work queued on the compute stream from now on wait for everything queued on `lane`
    /// so far.
    fn compute_after_lane(&self, lane: CopyLane) -> Result<(), DeviceError> {
        self.for_raw_calls()?;
        // Cleared first: a copy queued meanwhile by another thread sets it again.
        self.lane_dirty[lane.index()].store(false, Ordering::Release);
        self.stream
            .join(&self.lanes[lane.index()])
            .map_err(driver("ordering the compute stream after a copy lane"))
    }

    /// Device memory at `src` into host bytes (waits for the compute stream first).
    ///
    /// # Safety
    /// `src..src + dst.len()` must be live device memory.
    unsafe fn read(&self, dst: &mut [u8], src: DevPtr) -> Result<(), DeviceError> {
        // After everything queued before, the copy lanes' work included (the marker joins
        // them).
        self.mark()?.wait()?;
        self.ctx
            .bind_to_thread()
            .map_err(driver("binding the context"))?;
        // SAFETY: the caller guarantees the source; `dst` is a live host slice.
        unsafe { result::memcpy_dtoh_sync(dst, src) }.map_err(driver("copying device to host"))
    }

    fn done(&self, m: &Marker) -> Result<bool, DeviceError> {
        m.done()
    }

    fn share(&self, addr: DevPtr) -> Result<ShareRecord, DeviceError> {
        let m = self.share_of(addr)?;
        Ok(ShareRecord {
            handle: m.handle,
            offset: m.offset,
            bytes: m.bytes as u64,
            id: m.id,
        })
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
        let n = device_count().map_err(|e| e.to_string())?;
        for o in 0..n {
            if uuid_of(o).map_err(|e| e.to_string())? == *peer {
                return peer_access(self.ordinal(), o)
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
}

/// The kernel-name part of the pairwise op `op` combines with (`Avg` combines as `Sum`).
fn pairwise_name(op: ReduceOp) -> &'static str {
    match op.pairwise() {
        ReduceOp::Prod => "prod",
        ReduceOp::Min => "min",
        ReduceOp::Max => "max",
        _ => "sum",
    }
}
