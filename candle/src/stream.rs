//! [`CandleStream`]: the streams the engine's model states can live on that candle's tensors live
//! on too — the host ([`HostStream`], candle's CPU tensors) and, with the `cuda` feature, a GPU
//! (`Arc<Gpu>`, candle's CUDA tensors on the same device) — and how a tensor's memory is
//! addressed there.
//!
//! Gradients cross without a copy: the engine's kernel adds candle's gradient into its bucket
//! reading candle's own memory (on a GPU, device memory of the same primary context). Parameters
//! cross with one copy on the stream (the engine's values into a tensor candle owns) and candle's
//! own `Var::set`: candle's storage is candle's to write.

use candle_core::{DType as CDType, Device, Tensor};
use ringzero_collectives::{DeviceMemory, HostStream, TrainStream};
use ringzero_kernels::device::Stream;
use ringzero_kernels::{DType, DevPtr};

use crate::{Error, Result};

/// A stream whose memory candle's tensors on some [`Device`] live in.
pub trait CandleStream: TrainStream + Sized + 'static {
    /// An error naming both unless candle's tensors on `device` live in this stream's memory.
    fn check_device(&self, device: &Device) -> Result<()>;

    /// Wait for the work candle queued on `device` (so what it wrote is there for the engine to
    /// read, and what it reads may be written).
    fn settle(&self, device: &Device) -> Result<()>;

    /// The address in this stream's memory of contiguous tensor `t`'s first element, handed to
    /// `f` while `t`'s storage is held (call [`CandleStream::settle`] first).
    fn with_addr<R>(t: &Tensor, f: impl FnOnce(DevPtr) -> Result<R>) -> Result<R>;

    /// A new tensor of `shape` and candle dtype `dtype` on `device` holding the values at `src`
    /// of this stream's memory (the stream's queued work completed first).
    fn tensor_from(
        &self,
        src: DevPtr,
        dtype: CDType,
        shape: &[usize],
        device: &Device,
    ) -> Result<Tensor>;

    /// [`CandleStream::tensor_from`] for each `(src, shape)` of `srcs`, all of candle dtype
    /// `dtype` on `device`: on a GPU with one wait for candle's work and one for the copies,
    /// however many tensors.
    fn tensors_from(
        &self,
        srcs: &[(DevPtr, &[usize])],
        dtype: CDType,
        device: &Device,
    ) -> Result<Vec<Tensor>> {
        srcs.iter()
            .map(|&(src, shape)| self.tensor_from(src, dtype, shape, device))
            .collect()
    }
}

impl CandleStream for HostStream {
    fn check_device(&self, device: &Device) -> Result<()> {
        if device.is_cpu() {
            Ok(())
        } else {
            Err(Error::Invalid(format!(
                "a variable lives on {device:?} but the engine runs on the host: wrap CUDA \
                 variables with Zero::on and the GPU's stream (the `cuda` feature)"
            )))
        }
    }

    fn settle(&self, _: &Device) -> Result<()> {
        Ok(())
    }

    fn with_addr<R>(t: &Tensor, f: impl FnOnce(DevPtr) -> Result<R>) -> Result<R> {
        let (storage, layout) = t.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            return Err(Error::Invalid(format!(
                "a tensor on {:?} where the host engine reads host memory",
                t.device()
            )));
        };
        let base = match cpu {
            candle_core::CpuStorage::F32(v) => v.as_ptr() as usize,
            candle_core::CpuStorage::BF16(v) => v.as_ptr() as usize,
            candle_core::CpuStorage::F16(v) => v.as_ptr() as usize,
            _ => return Err(untrainable(t.dtype())),
        };
        f((base + layout.start_offset() * t.dtype().size_in_bytes()) as DevPtr)
    }

    fn tensor_from(
        &self,
        src: DevPtr,
        dtype: CDType,
        shape: &[usize],
        device: &Device,
    ) -> Result<Tensor> {
        /// Read into a vector of `D` that the tensor then takes over (no further copy).
        fn typed<D: candle_core::WithDType + bytemuck::Pod>(
            s: &HostStream,
            src: DevPtr,
            shape: &[usize],
            device: &Device,
        ) -> Result<Tensor> {
            let mut v = vec![D::zero(); shape.iter().product()];
            // SAFETY: the caller's `src` holds as many values of `D` as `shape` has in this
            // stream's memory (an engine parameter's range, Engine::param_addr); `read` waits
            // for the queued work.
            unsafe { s.read(bytemuck::cast_slice_mut(&mut v), src) }
                .map_err(|e| Error::Invalid(e.to_string()))?;
            Ok(Tensor::from_vec(v, shape, device)?)
        }
        match dtype {
            CDType::F32 => typed::<f32>(self, src, shape, device),
            CDType::BF16 => typed::<half::bf16>(self, src, shape, device),
            CDType::F16 => typed::<half::f16>(self, src, shape, device),
            other => Err(untrainable(other)),
        }
    }
}

/// The error for a tensor whose dtype no engine trains.
fn untrainable(dtype: CDType) -> Error {
    Error::Invalid(format!(
        "a {dtype:?} tensor where the engine takes f32, bf16 or f16"
    ))
}

/// `elems` values of `dtype` at `addr` of a stream's memory, lent to the engine's
/// [`push_grad`](ringzero_zero::Engine::push_grad) while the tensor they belong to is held.
pub(crate) struct Lent {
    pub addr: DevPtr,
    pub elems: usize,
    pub dtype: DType,
}

// SAFETY: a `Lent` is built only inside `CandleStream::with_addr`'s closure, from the address of
// a contiguous tensor of `elems` values of `dtype` whose storage that call holds, and dropped
// before the closure returns; the engine only reads it (push_grad's `addr`) and waits for that
// read before returning.
unsafe impl<S: TrainStream> DeviceMemory<S> for Lent {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn elems(&self) -> usize {
        self.elems
    }
    fn addr(&self, _: &S) -> DevPtr {
        self.addr
    }
    fn addr_mut(&mut self, _: &S) -> DevPtr {
        self.addr
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::Arc;

    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    use candle_core::{DType as CDType, Device, Storage, Tensor};
    use ringzero_kernels::device::cuda::Gpu;
    use ringzero_kernels::device::Stream;
    use ringzero_kernels::DevPtr;

    use super::CandleStream;
    use crate::{Error, Result};

    fn gpu_err(what: &str) -> impl FnOnce(ringzero_kernels::device::DeviceError) -> Error + '_ {
        move |e| Error::Invalid(format!("{what}: {e}"))
    }

    impl CandleStream for Arc<Gpu> {
        fn check_device(&self, device: &Device) -> Result<()> {
            match device.location() {
                candle_core::DeviceLocation::Cuda { gpu_id } if gpu_id == self.ordinal() => Ok(()),
                other => Err(Error::Invalid(format!(
                    "a variable lives on {other:?} but the engine runs on cuda:{}: open the \
                     engine's Gpu on the device candle computes on",
                    self.ordinal()
                ))),
            }
        }

        fn settle(&self, device: &Device) -> Result<()> {
            Ok(device.synchronize()?)
        }

        fn with_addr<R>(t: &Tensor, f: impl FnOnce(DevPtr) -> Result<R>) -> Result<R> {
            let Device::Cuda(dev) = t.device() else {
                return Err(Error::Invalid(format!(
                    "a tensor on {:?} where the GPU engine reads device memory",
                    t.device()
                )));
            };
            let stream = dev.cuda_stream();
            let (storage, layout) = t.storage_and_layout();
            let Storage::Cuda(cuda) = &*storage else {
                return Err(Error::Invalid("a CUDA tensor without CUDA storage".into()));
            };
            // The pointer is read on candle's stream's terms (its marker is recorded there when
            // `_read` drops); the caller settled candle's work before.
            let (base, _read) = match t.dtype() {
                CDType::F32 => cuda.as_cuda_slice::<f32>()?.device_ptr(&stream),
                CDType::BF16 => cuda.as_cuda_slice::<half::bf16>()?.device_ptr(&stream),
                CDType::F16 => cuda.as_cuda_slice::<half::f16>()?.device_ptr(&stream),
                other => return Err(super::untrainable(other)),
            };
            f(base + (layout.start_offset() * t.dtype().size_in_bytes()) as DevPtr)
        }

        fn tensor_from(
            &self,
            src: DevPtr,
            dtype: CDType,
            shape: &[usize],
            device: &Device,
        ) -> Result<Tensor> {
            let mut t = self.tensors_from(&[(src, shape)], dtype, device)?;
            Ok(t.pop().expect("one tensor for one source"))
        }

        fn tensors_from(
            &self,
            srcs: &[(DevPtr, &[usize])],
            dtype: CDType,
            device: &Device,
        ) -> Result<Vec<Tensor>> {
            let ts = srcs
                .iter()
                .map(|&(_, shape)| Tensor::zeros(shape, dtype, device))
                .collect::<candle_core::Result<Vec<_>>>()?;
            self.settle(device)?;
            for (t, &(src, _)) in ts.iter().zip(srcs) {
                let bytes = t.elem_count() * dtype.size_in_bytes();
                Self::with_addr(t, |dst| {
                    // SAFETY: `dst` is `bytes` of a new tensor's device memory, which nothing
                    // else uses (the tensors are this function's; candle's memsets finished
                    // above), `src` the caller's `bytes` of engine memory in the same context;
                    // the copies finish before the tensors are handed out (synchronize below).
                    unsafe { self.copy(dst, src, bytes) }.map_err(gpu_err("copying parameters"))
                })?;
            }
            self.synchronize().map_err(gpu_err("copying parameters"))?;
            Ok(ts)
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType as CDType, Device, Tensor};
    use ringzero_collectives::HostStream;

    use super::CandleStream;

    #[test]
    fn a_host_tensor_is_addressed_where_its_values_are_even_past_an_offset() {
        let t = Tensor::arange(0f32, 10.0, &Device::Cpu).unwrap();
        let tail = t.narrow(0, 4, 6).unwrap(); // contiguous, 4 elements into the storage
        let seen = HostStream::with_addr(&tail, |addr| {
            // SAFETY: `addr` is the first of `tail`'s 6 f32 values, its storage held meanwhile.
            Ok(unsafe { std::slice::from_raw_parts(addr as usize as *const f32, 6) }.to_vec())
        })
        .unwrap();
        assert_eq!(seen, [4.0, 5.0, 6.0, 7.0, 8.0, 9.0]);
    }

    #[test]
    fn a_tensor_made_from_stream_memory_holds_its_values_in_the_dtype_asked() {
        let src = [
            half::bf16::from_f32(1.5),
            half::bf16::from_f32(-2.0),
            half::bf16::ONE,
        ];
        let s = HostStream::new();
        let t = s
            .tensor_from(
                src.as_ptr() as usize as u64,
                CDType::BF16,
                &[3, 1],
                &Device::Cpu,
            )
            .unwrap();
        assert_eq!(t.dims(), [3, 1]);
        let back = t.to_dtype(CDType::F32).unwrap().flatten_all().unwrap();
        assert_eq!(back.to_vec1::<f32>().unwrap(), [1.5, -2.0, 1.0]);
    }

    #[test]
    fn tensors_made_together_each_hold_their_own_range_and_shape() {
        let src: Vec<f32> = (0..10).map(|i| i as f32).collect();
        let at = |i: usize| (src.as_ptr() as usize + 4 * i) as u64;
        let s = HostStream::new();
        let ts = s
            .tensors_from(
                &[(at(0), &[2, 2][..]), (at(4), &[6][..])],
                CDType::F32,
                &Device::Cpu,
            )
            .unwrap();
        assert_eq!(ts[0].to_vec2::<f32>().unwrap(), [[0.0, 1.0], [2.0, 3.0]]);
        assert_eq!(
            ts[1].to_vec1::<f32>().unwrap(),
            [4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
        );
    }

    #[test]
    fn the_host_engine_refuses_a_tensor_type_it_cannot_train_naming_it() {
        let t = Tensor::new(&[1u32, 2, 3], &Device::Cpu).unwrap();
        let e = HostStream::with_addr(&t, |_| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("U32") && e.contains("f32, bf16 or f16"), "{e}");
    }
}
