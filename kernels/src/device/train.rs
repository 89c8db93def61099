//! [`TrainStream`]: the optimizer's work on a [`Stream`]'s memory — casts, the squared norm, the
//! finiteness check, the optimizers' steps and uploads — which a ZeRO engine on device buffers needs beyond the
//! collectives' copies and reductions. The host stream runs the CPU kernels
//! ([`crate::cpu`]), a GPU the NVRTC kernels, which compute the same bits (the norm
//! aside: the GPU sums it in a tree).

use std::any::Any;

use super::{DevPtr, DeviceError, HostStream, Stream};
use crate::cpu::{self, Float, Optimizer};
use crate::DType;
use half::{bf16, f16};

/// The ranges of one optimizer step, `n` elements each: fp32 `master` and states; gradients (and
/// parameters, if any) in the step's dtype.
#[derive(Clone, Copy, Debug)]
pub struct StepAt {
    /// fp32 master weights (updated).
    pub master: DevPtr,
    /// Parameters in the gradients' dtype, written from the master; `None` where the master is
    /// the parameters (f32).
    pub params: Option<DevPtr>,
    /// Gradients.
    pub grads: DevPtr,
    /// The first state (f32, updated): Adam's and Lion's `exp_avg`, SGD's momentum buffer;
    /// ignored where the rule keeps none ([`Optimizer::states`]).
    pub s1: DevPtr,
    /// The second state (f32, updated): Adam's `exp_avg_sq`; ignored by the other rules.
    pub s2: DevPtr,
}

/// The optimizer's work on a stream's memory (see the module docs). Queued work runs in stream
/// order with the collectives'; the calls that return a value wait for the work queued before.
pub trait TrainStream: Stream {
    /// `bytes` of zeroed memory of this device that its work can address, and its owner, which
    /// frees it on Drop (after this stream's work has ended: drop it only then).
    fn alloc(&self, bytes: usize) -> Result<(DevPtr, Box<dyn Any + Send>), DeviceError> {
        self.scratch(bytes)
    }

    /// Whether this stream's addresses are host addresses (the host stream's), so the host may
    /// read and write its allocations directly once its work has ended.
    fn host_addressable(&self) -> bool {
        false
    }

    /// `bytes` of zeroed host memory, page-aligned, that this device's work can address too
    /// (on a GPU: page-locked and mapped into the device's address space, so copies to and from
    /// it run asynchronously and kernels may read it): its device address, its host address,
    /// and its owner, which unmaps and frees it on Drop (after this stream's work has ended:
    /// drop it only then). For state kept off the device (ZeRO-Offload's tier).
    fn alloc_host(
        &self,
        bytes: usize,
    ) -> Result<(DevPtr, usize, Box<dyn Any + Send>), DeviceError> {
        /// One page, so the memory suits direct I/O and every dtype.
        #[derive(Clone, Copy)]
        #[repr(C, align(4096))]
        struct Page([u8; 4096]);
        let mem = vec![Page([0; 4096]); bytes.div_ceil(4096).max(1)].into_boxed_slice();
        let host = mem.as_ptr() as usize;
        // SAFETY: the pages stay mapped while the owner below lives: it holds both, and drops
        // the mapping (first field) before the pages.
        let (dev, mapping) = unsafe { self.map_host(host as *mut u8, mem.len() * 4096) }?;
        Ok((dev, host, Box::new((mapping, mem))))
    }

    /// Copy `src` into the memory at `dst`, after the work queued before; returns once it is
    /// there.
    ///
    /// # Safety
    /// `dst..dst + src.len()` must be live memory of this device, not used by queued work.
    unsafe fn write(&self, dst: DevPtr, src: &[u8]) -> Result<(), DeviceError>;

    /// Queue zeroing `bytes` at `dst`.
    ///
    /// # Safety
    /// The range must be live memory of this device until the work completes.
    unsafe fn zero(&self, dst: DevPtr, bytes: usize) -> Result<(), DeviceError>;

    /// Queue `dst[..n] = src[..n]` converted from `from` to `to` (f32, f16, bf16; to nearest
    /// even).
    ///
    /// # Safety
    /// Both ranges must be live memory of this device of `n` elements of their types until the
    /// work completes, and must not overlap.
    unsafe fn cast(
        &self,
        from: DType,
        src: DevPtr,
        to: DType,
        dst: DevPtr,
        n: usize,
    ) -> Result<(), DeviceError>;

    /// Σ (x·s)² in f64 over `n` elements of `dtype` at `x`, after the work queued before.
    ///
    /// # Safety
    /// `x` must be live memory of this device of `n` elements of `dtype`.
    unsafe fn sq_norm(&self, dtype: DType, x: DevPtr, n: usize, s: f32)
        -> Result<f64, DeviceError>;

    /// Whether the `n` elements of `dtype` at `x` are all finite, after the work queued before.
    ///
    /// # Safety
    /// As for [`TrainStream::sq_norm`].
    unsafe fn all_finite(&self, dtype: DType, x: DevPtr, n: usize) -> Result<bool, DeviceError>;

    /// Queue one optimizer step (`h` at step `t`) on `n` elements, gradients multiplied by
    /// `grad_scale` first ([`crate::cpu::step_mixed`]'s arithmetic).
    ///
    /// # Safety
    /// Every range of `at` must be live memory of this device of `n` elements of its type until
    /// the work completes, none overlapping another.
    unsafe fn optim_step(
        &self,
        h: &Optimizer,
        t: u64,
        dtype: DType,
        at: StepAt,
        n: usize,
        grad_scale: f32,
    ) -> Result<(), DeviceError>;
}

fn not_float(what: &str, d: DType) -> DeviceError {
    DeviceError::Invalid(format!(
        "{what}: {d} is not a training float type (f32, f16, bf16)"
    ))
}

/// `n` elements of `T` at host address `a`.
///
/// # Safety
/// The range must be live host memory of `n` elements of `T`, aligned, not written meanwhile.
unsafe fn at<'a, T>(a: DevPtr, n: usize) -> &'a [T] {
    if n == 0 {
        return &[];
    }
    // SAFETY: guaranteed by the caller.
    unsafe { std::slice::from_raw_parts(a as usize as *const T, n) }
}

/// `n` elements of `T` at host address `a`, writable.
///
/// # Safety
/// The range must be live host memory of `n` elements of `T`, aligned, not otherwise borrowed.
unsafe fn at_mut<'a, T>(a: DevPtr, n: usize) -> &'a mut [T] {
    if n == 0 {
        return &mut [];
    }
    // SAFETY: guaranteed by the caller.
    unsafe { std::slice::from_raw_parts_mut(a as usize as *mut T, n) }
}

fn aligned(a: DevPtr, d: DType, what: &str) -> Result<(), DeviceError> {
    if a.is_multiple_of(d.size() as u64) {
        Ok(())
    } else {
        Err(DeviceError::Invalid(format!(
            "{what}: address {a:#x} is not aligned to {d}"
        )))
    }
}

/// `x` widened from `T`, then `f` on the `f32`s — each float type's form of one operation.
macro_rules! by_float {
    ($d:expr, $what:expr, $T:ident => $body:expr) => {
        match $d {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F16 => {
                type $T = f16;
                $body
            }
            DType::BF16 => {
                type $T = bf16;
                $body
            }
            other => Err(not_float($what, other)),
        }
    };
}

/// `dst = src` as `B` from `A`.
///
/// # Safety
/// As for [`TrainStream::cast`].
unsafe fn cast_typed<A: Float, B: Float>(src: DevPtr, dst: DevPtr, n: usize) {
    // SAFETY: forwarded.
    unsafe { cpu::cast(at::<A>(src, n), at_mut::<B>(dst, n)) }
}

impl TrainStream for HostStream {
    fn host_addressable(&self) -> bool {
        true
    }

    unsafe fn zero(&self, dst: DevPtr, bytes: usize) -> Result<(), DeviceError> {
        self.push_job(move || {
            // SAFETY: the caller keeps the range live until this job has run.
            unsafe { at_mut::<u8>(dst, bytes) }.fill(0);
            Ok(())
        })
    }

    unsafe fn write(&self, dst: DevPtr, src: &[u8]) -> Result<(), DeviceError> {
        self.finish()?;
        // SAFETY: the caller guarantees the destination, which no queued work uses.
        unsafe { at_mut::<u8>(dst, src.len()) }.copy_from_slice(src);
        Ok(())
    }

    unsafe fn cast(
        &self,
        from: DType,
        src: DevPtr,
        to: DType,
        dst: DevPtr,
        n: usize,
    ) -> Result<(), DeviceError> {
        aligned(src, from, "cast")?;
        aligned(dst, to, "cast")?;
        let f: unsafe fn(DevPtr, DevPtr, usize) = by_float!(from, "cast", A => by_float!(to, "cast", B => Ok(cast_typed::<A, B> as unsafe fn(DevPtr, DevPtr, usize))))?;
        self.push_job(move || {
            // SAFETY: the caller keeps both ranges live until this job has run.
            unsafe { f(src, dst, n) };
            Ok(())
        })
    }

    unsafe fn sq_norm(
        &self,
        dtype: DType,
        x: DevPtr,
        n: usize,
        s: f32,
    ) -> Result<f64, DeviceError> {
        aligned(x, dtype, "sq_norm")?;
        self.finish()?;
        // SAFETY: the caller guarantees the range; the queue is empty.
        by_float!(dtype, "sq_norm", T => Ok(cpu::sq_norm(unsafe { at::<T>(x, n) }, s)))
    }

    unsafe fn all_finite(&self, dtype: DType, x: DevPtr, n: usize) -> Result<bool, DeviceError> {
        aligned(x, dtype, "all_finite")?;
        self.finish()?;
        // SAFETY: as for `sq_norm`.
        by_float!(dtype, "all_finite", T => Ok(cpu::all_finite(unsafe { at::<T>(x, n) })))
    }

    unsafe fn optim_step(
        &self,
        h: &Optimizer,
        t: u64,
        dtype: DType,
        a: StepAt,
        n: usize,
        grad_scale: f32,
    ) -> Result<(), DeviceError> {
        let keeps = h.states().len();
        let what = "optim_step";
        for (x, d) in [(a.master, DType::F32), (a.grads, dtype)] {
            aligned(x, d, what)?;
        }
        for s in [a.s1, a.s2].into_iter().take(keeps) {
            aligned(s, DType::F32, what)?;
        }
        if let Some(p) = a.params {
            aligned(p, dtype, what)?;
        }
        let h = *h;
        // A state the rule does not keep is an empty slice (its address is not read).
        let len = move |k: usize| if keeps >= k { n } else { 0 };
        by_float!(dtype, what, T => self.push_job(move || {
            // SAFETY: the caller keeps every range live and apart until this job has run; the
            // states the rule does not keep are empty.
            unsafe {
                cpu::step_mixed::<T>(
                    &h,
                    t,
                    at_mut(a.master, n),
                    a.params.map(|p| at_mut(p, n)),
                    at(a.grads, n),
                    at_mut(a.s1, len(1)),
                    at_mut(a.s2, len(2)),
                    grad_scale,
                )
            };
            Ok(())
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr<T>(x: &[T]) -> DevPtr {
        x.as_ptr() as usize as DevPtr
    }

    /// The address of memory the stream writes (a pointer that may write).
    fn addr_mut<T>(x: &mut [T]) -> DevPtr {
        x.as_mut_ptr() as usize as DevPtr
    }

    #[test]
    fn the_host_streams_optimizer_work_is_the_cpu_kernels_on_its_addresses() {
        let s = HostStream::new();
        let x: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let mut b = vec![bf16::ZERO; x.len()];
        let mut back = vec![0f32; x.len()];
        // SAFETY: every range is a live, aligned vector of the length and type given, untouched
        // until the stream has finished (the norm below waits for it).
        unsafe {
            s.cast(DType::F32, addr(&x), DType::BF16, addr_mut(&mut b), x.len())
                .unwrap();
            s.cast(
                DType::BF16,
                addr(&b),
                DType::F32,
                addr_mut(&mut back),
                x.len(),
            )
            .unwrap();
            let norm = s.sq_norm(DType::F32, addr(&back), back.len(), 0.5).unwrap();
            let mut want_b = vec![bf16::ZERO; x.len()];
            cpu::cast(&x, &mut want_b);
            assert_eq!(b, want_b);
            let mut want = vec![0f32; x.len()];
            cpu::cast(&want_b, &mut want);
            assert_eq!(back, want);
            assert_eq!(norm, cpu::sq_norm(&want, 0.5));
            assert!(s.all_finite(DType::BF16, addr(&b), b.len()).unwrap());
            b[17] = bf16::INFINITY;
            assert!(!s.all_finite(DType::BF16, addr(&b), b.len()).unwrap());
        }
        // Every rule on 16-bit parameters with an fp32 master, against the CPU kernel.
        for h in [
            Optimizer::default(),
            Optimizer::adam(1e-3),
            Optimizer::lion(1e-4),
            Optimizer::sgd(0.1, 0.9),
            Optimizer::sgd(0.1, 0.0),
        ] {
            let n = 333;
            let grads: Vec<f16> = (0..n)
                .map(|i| f16::from_f32(i as f32 * 0.01 - 1.0))
                .collect();
            let (mut master, mut m, mut v) = (vec![0.5f32; n], vec![0.1f32; n], vec![0.2f32; n]);
            let mut params = vec![f16::ZERO; n];
            let (mut w_master, mut w_m, mut w_v) = (master.clone(), m.clone(), v.clone());
            let mut w_params = params.clone();
            let keeps = h.states().len();
            let at = StepAt {
                master: addr_mut(&mut master),
                params: Some(addr_mut(&mut params)),
                grads: addr(&grads),
                s1: addr_mut(&mut m),
                s2: addr_mut(&mut v),
            };
            // SAFETY: as above.
            unsafe { s.optim_step(&h, 3, DType::F16, at, n, 0.25) }.unwrap();
            s.finish().unwrap();
            let (k1, k2) = (
                if keeps >= 1 { n } else { 0 },
                if keeps >= 2 { n } else { 0 },
            );
            cpu::step_mixed(
                &h,
                3,
                &mut w_master,
                Some(&mut w_params),
                &grads,
                &mut w_m[..k1],
                &mut w_v[..k2],
                0.25,
            );
            assert_eq!((&master, &params), (&w_master, &w_params), "{h:?}");
            assert_eq!(
                (&m, &v),
                (&w_m, &w_v),
                "{h:?}: a state it does not keep is untouched"
            );
        }
        // An upload lands after the work queued before it; a zeroing is queued.
        let mut dst = vec![0u8; 8];
        // SAFETY: `dst` is live and used by no queued work.
        unsafe { s.write(addr_mut(&mut dst), &[1, 2, 3, 4, 5, 6, 7, 8]) }.unwrap();
        assert_eq!(dst, [1, 2, 3, 4, 5, 6, 7, 8]);
        // SAFETY: as above; `finish` waits for the job.
        unsafe { s.zero(addr_mut(&mut dst) + 2, 4) }.unwrap();
        s.finish().unwrap();
        assert_eq!(dst, [1, 2, 0, 0, 0, 0, 7, 8]);
        // Bad input is refused before anything is queued.
        // SAFETY: refused before any access.
        unsafe {
            let e = s.sq_norm(DType::I32, addr(&x), 4, 1.0).unwrap_err();
            assert!(e.to_string().contains("not a training float type"), "{e}");
            let e = s
                .cast(DType::F32, addr(&x) + 2, DType::BF16, addr_mut(&mut b), 4)
                .unwrap_err();
            assert!(e.to_string().contains("not aligned to f32"), "{e}");
        }
    }
}
