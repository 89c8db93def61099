//! The CUDA device without (and, on a GPU machine, with) a GPU: absence is a typed error, never a
//! panic; the embedded kernel source compiles with NVRTC wherever NVRTC can be loaded. Checks that
//! need a GPU or NVRTC print that they were skipped and why.

#![cfg(feature = "cuda")]

use ringzero_kernels::device::cuda::{self, Gpu};
use ringzero_kernels::device::{cuda_devices, DeviceError};

#[test]
fn no_cuda_driver_is_a_typed_error_not_a_panic() {
    if cuda::driver_present() {
        eprintln!(
            "SKIPPED no_cuda_driver_is_a_typed_error_not_a_panic: a CUDA driver is present here"
        );
        return;
    }
    let e = cuda_devices().unwrap_err();
    assert!(
        matches!(&e, DeviceError::NoCuda(m) if m.contains("no CUDA driver was found")),
        "{e}"
    );
    let e = Gpu::open(0).err().expect("no device without a driver");
    assert_eq!(
        e.to_string(),
        "no CUDA: no CUDA driver was found (libcuda.so could not be loaded)"
    );
}

#[test]
fn nvrtc_compiles_every_kernel_for_hopper_and_ampere() {
    if !cuda::nvrtc_present() {
        eprintln!(
            "SKIPPED nvrtc_compiles_every_kernel_for_hopper_and_ampere: libnvrtc.so.13 not found \
             (.ci/run fetches it from PyPI; or put a CUDA toolkit's lib64 on LD_LIBRARY_PATH)"
        );
        let e = cuda::compile("compute_90").unwrap_err();
        assert!(matches!(e, DeviceError::NoCuda(_)), "{e}");
        return;
    }
    for arch in ["compute_90", "compute_80"] {
        let ptx = cuda::compile(arch).unwrap_or_else(|e| panic!("{e}"));
        let text = ptx.to_src();
        for name in cuda::kernel_names() {
            assert!(
                text.contains(&format!(".entry {name}(")),
                "{arch}: kernel {name} missing from the PTX"
            );
        }
        // fmad=false: no fused multiply-add may appear in the optimizer kernels (bit parity
        // with the CPU).
        for t in ["float", "f16", "bf16"] {
            let entry = format!(".entry optim_step_{t}(");
            let k = &text[text.find(&entry).unwrap()..];
            let k = &k[..k.find("\n}").unwrap()];
            assert!(
                !k.contains("fma.rn.f32"),
                "{arch}: optim_step_{t} fuses multiply-adds"
            );
        }
    }
}

#[test]
fn a_broken_kernel_source_is_reported_with_the_compiler_log() {
    if !cuda::nvrtc_present() {
        eprintln!("SKIPPED a_broken_kernel_source_is_reported_with_the_compiler_log: libnvrtc.so.13 not found");
        return;
    }
    let e = cuda::compile("compute_12").unwrap_err();
    assert!(
        matches!(&e, DeviceError::Compile { arch, .. } if arch == "compute_12"),
        "{e}"
    );
}

#[test]
fn device_buffers_are_counted_while_they_live_and_at_their_peak() {
    let gpu = match cuda::device_count() {
        Ok(n) if n > 0 => Gpu::open(0).unwrap_or_else(|e| panic!("{e}")),
        other => {
            eprintln!(
                "SKIPPED device_buffers_are_counted_while_they_live_and_at_their_peak: no GPU \
                 here ({other:?})"
            );
            return;
        }
    };
    cuda::reset_allocated_peak();
    let before = cuda::allocated();
    let a = gpu.alloc(ringzero_kernels::DType::F32, 1 << 20).unwrap();
    let b = gpu.alloc(ringzero_kernels::DType::U8, 0).unwrap(); // one byte held
    assert_eq!(cuda::allocated().live, before.live + (4 << 20) + 1);
    drop(a);
    let after = cuda::allocated();
    assert_eq!(after.live, before.live + 1);
    assert_eq!(after.peak, before.live + (4 << 20) + 1);
    drop(b);
    assert_eq!(cuda::allocated().live, before.live);
    // The streams' scratch (what a ZeRO engine's buffers and a communicator's slots come from)
    // is IPC-exportable memory from its own cuMemAlloc: counted the same way.
    let (_, owner) = ringzero_kernels::device::TrainStream::alloc(&gpu, 3 << 20).unwrap();
    assert_eq!(cuda::allocated().live, before.live + (3 << 20));
    drop(owner);
    assert_eq!(cuda::allocated().live, before.live);
}
