//! The optimizer's kernels on device addresses: casts, the squared norm, the finiteness check and
//! the optimizers' step, queued on the compute stream like the collectives' kernels (`raw`). The buffer forms
//! on [`Gpu`] (`cast`, `sq_norm`, `all_finite`, `optim_step`) check their buffers and call these; a
//! ZeRO engine on device memory calls these on ranges of its buckets.

use std::sync::Arc;

use cudarc::driver::PushKernelArg;

use super::{cu_type, driver, kernel_names, DeviceError, Gpu};
use crate::device::{DevPtr, StepAt, Stream, TrainStream};
use crate::DType;

/// The optimizer's kernels on device addresses, queued on the compute stream like the
/// collectives' kernels.
impl TrainStream for Arc<Gpu> {
    /// Queue zeroing `bytes` at `dst`.
    ///
    /// # Safety
    /// The range must be live device memory of this context until the work completes.
    unsafe fn zero(&self, dst: DevPtr, bytes: usize) -> Result<(), DeviceError> {
        if bytes == 0 {
            return self.check();
        }
        self.for_raw_calls()?;
        // SAFETY: the caller guarantees the range; the stream belongs to this context.
        unsafe { cudarc::driver::result::memset_d8_async(dst, 0, bytes, self.stream.cu_stream()) }
            .map_err(driver("zeroing device memory"))
    }

    /// Queue `dst[..n] = src[..n]` converted from `from` to `to` (f32 ↔ f16/bf16, to nearest
    /// even).
    ///
    /// # Safety
    /// `src` and `dst` must be live device-addressable memory of `n` elements of `from` and `to`
    /// until the work completes, and must not overlap.
    unsafe fn cast(
        &self,
        from: DType,
        src: DevPtr,
        to: DType,
        dst: DevPtr,
        n: usize,
    ) -> Result<(), DeviceError> {
        self.check()?;
        let name = format!("cast_{}_{}", cu_type(from), cu_type(to));
        if !kernel_names().contains(&name) {
            return Err(DeviceError::Invalid(format!(
                "cast {from} → {to} is not supported (f32 ↔ f16/bf16)"
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let f = self.func(&name)?;
        let n64 = n as u64;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&src).arg(&dst).arg(&n64);
        // SAFETY: the caller guarantees both ranges; grid-stride bounded by `n`.
        unsafe { b.launch(Gpu::cfg(n)) }.map_err(driver("launching cast"))?;
        Ok(())
    }

    /// Σ (x·s)² over `n` elements of `dtype` at `x`, in f64, once the work queued before has
    /// completed (waits for the result).
    ///
    /// # Safety
    /// `x` must be live device-addressable memory of `n` elements of `dtype`.
    unsafe fn sq_norm(
        &self,
        dtype: DType,
        x: DevPtr,
        n: usize,
        s: f32,
    ) -> Result<f64, DeviceError> {
        self.check()?;
        let f = self.float_kernel("sq_norm", dtype)?;
        if n == 0 {
            return Ok(0.0);
        }
        let mut out = self
            .stream
            .alloc_zeros::<f64>(1)
            .map_err(driver("allocating the norm"))?;
        let n64 = n as u64;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&x).arg(&s).arg(&n64).arg(&mut out);
        // SAFETY: reads `n` elements at `x` (the caller's range); block size is BLOCK = 256, the
        // size of the kernel's shared tree; writes one f64 to `out`, which holds one.
        unsafe { b.launch(Gpu::cfg(n)) }.map_err(driver("launching sq_norm"))?;
        let v = self
            .stream
            .clone_dtoh(&out)
            .map_err(driver("reading the norm"))?;
        Ok(v[0])
    }

    /// Whether all `n` elements of `dtype` at `x` are finite, once the work queued before has
    /// completed (waits for the result).
    ///
    /// # Safety
    /// `x` must be live device-addressable memory of `n` elements of `dtype`.
    unsafe fn all_finite(&self, dtype: DType, x: DevPtr, n: usize) -> Result<bool, DeviceError> {
        self.check()?;
        let f = self.float_kernel("nonfinite", dtype)?;
        if n == 0 {
            return Ok(true);
        }
        let mut flag = self
            .stream
            .alloc_zeros::<u32>(1)
            .map_err(driver("allocating the flag"))?;
        let n64 = n as u64;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&x).arg(&n64).arg(&mut flag);
        // SAFETY: reads `n` elements at `x`, writes at most one u32 to `flag`, which holds one.
        unsafe { b.launch(Gpu::cfg(n)) }.map_err(driver("launching nonfinite"))?;
        let v = self
            .stream
            .clone_dtoh(&flag)
            .map_err(driver("reading the flag"))?;
        Ok(v[0] == 0)
    }

    /// Queue one fused optimizer step (`h` at step `t`) on `n` elements: gradients (and
    /// parameters) in `dtype`, multiplied by `grad_scale` first.
    ///
    /// # Safety
    /// Every range of `at` the rule uses must be live device-addressable memory of `n` elements
    /// of its type until the work completes, none overlapping another.
    unsafe fn optim_step(
        &self,
        h: &crate::cpu::Optimizer,
        t: u64,
        dtype: DType,
        at: StepAt,
        n: usize,
        grad_scale: f32,
    ) -> Result<(), DeviceError> {
        self.check()?;
        let f = self.float_kernel("optim_step", dtype)?;
        if n == 0 {
            return Ok(());
        }
        let k = h.step_scalars(t);
        // A null pointer: the kernel skips the parameter write (and never reads a state the
        // rule does not keep).
        let params: DevPtr = at.params.unwrap_or(0);
        let n64 = n as u64;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&at.master)
            .arg(&params)
            .arg(&at.grads)
            .arg(&at.s1)
            .arg(&at.s2)
            .arg(&n64)
            .arg(&k.code)
            .arg(&k.lr)
            .arg(&k.b1)
            .arg(&k.b2)
            .arg(&k.eps)
            .arg(&k.decay)
            .arg(&k.l2)
            .arg(&k.bc1)
            .arg(&k.bc2)
            .arg(&grad_scale);
        // SAFETY: the caller guarantees every range the rule uses (`params` is such a range or
        // null, which the kernel tests before writing); grid-stride bounded by `n`.
        unsafe { b.launch(Gpu::cfg(n)) }.map_err(driver("launching optim_step"))?;
        Ok(())
    }

    unsafe fn write(&self, dst: DevPtr, src: &[u8]) -> Result<(), DeviceError> {
        // On the compute stream, after the work queued before it, and waited for: a
        // `cuMemcpyHtoD` (the legacy default stream) may return before its DMA has landed and
        // is not ordered with the non-blocking compute stream, so a kernel queued next could
        // read the memory before the upload.
        self.for_raw_calls()?;
        // SAFETY: the caller guarantees the destination; `src` is a live host slice, kept
        // until the copy has ended (waited for below).
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
            .map_err(driver("copying host to device"))?;
        self.mark()?.wait()
    }
}
