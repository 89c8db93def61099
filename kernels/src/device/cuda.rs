//! The CUDA device: a context and its streams, byte buffers tagged with a dtype, copies, and the
//! NVRTC kernels of `kernels/src/cuda/kernels.cu` (compiled once per context, at first use, for the
//! device's own architecture).
//!
//! cudarc panics when libcuda or libnvrtc is missing; every entry point here first asks
//! [`driver_present`] / [`nvrtc_present`] and returns [`DeviceError::NoCuda`] instead. Buffers,
//! streams, events and modules are cudarc owners released on Drop; an error a Drop meets is
//! recorded by cudarc on the context and returned by the next call here (`check_err`).

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{
    result, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DriverError,
    LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{CompileOptions, Ptx};

use super::{DeviceError, StepAt, TrainStream};
use crate::{DType, ReduceOp};

mod optim;
pub mod raw;

/// The kernels' source, embedded in the binary.
pub const KERNELS_CU: &str = include_str!("../cuda/kernels.cu");

/// Threads per block of every kernel (the norm's shared-memory tree assumes 256).
const BLOCK: u32 = 256;

/// Events that [`Gpu::time`] reads elapsed time between. cudarc's default flag
/// (`CU_EVENT_DISABLE_TIMING`) makes `cuEventElapsedTime` fail with `CUDA_ERROR_INVALID_HANDLE`.
const TIMED: cudarc::driver::sys::CUevent_flags =
    cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;

fn driver(op: &str) -> impl Fn(DriverError) -> DeviceError + '_ {
    move |e| DeviceError::Driver {
        op: op.to_string(),
        msg: e.to_string(),
    }
}

/// Whether libcuda can be loaded.
pub fn driver_present() -> bool {
    static P: OnceLock<bool> = OnceLock::new();
    // SAFETY: is_culib_present only tries to dlopen the driver library by its known names and
    // drops the handle; it calls no CUDA function.
    *P.get_or_init(|| unsafe { cudarc::driver::sys::is_culib_present() })
}

/// Whether libnvrtc can be loaded.
pub fn nvrtc_present() -> bool {
    static P: OnceLock<bool> = OnceLock::new();
    // SAFETY: as for the driver: a dlopen probe, no NVRTC call.
    *P.get_or_init(|| unsafe { cudarc::nvrtc::sys::is_culib_present() })
}

/// Number of CUDA devices, or why there are none.
pub fn device_count() -> Result<usize, DeviceError> {
    if !driver_present() {
        return Err(DeviceError::NoCuda(
            "no CUDA driver was found (libcuda.so could not be loaded)".into(),
        ));
    }
    let n = CudaContext::device_count().map_err(driver("counting devices"))?;
    if n <= 0 {
        return Err(DeviceError::NoCuda(
            "the CUDA driver is present but reports no device".into(),
        ));
    }
    Ok(n as usize)
}

/// Compile the kernels for `arch` (e.g. `compute_90`) with NVRTC. `fmad=false` keeps every
/// multiply-add rounded as on the CPU path, so host and device compute the same bits.
pub fn compile(arch: &'static str) -> Result<Ptx, DeviceError> {
    if !nvrtc_present() {
        return Err(DeviceError::NoCuda(
            "NVRTC was not found (libnvrtc.so.13 could not be loaded; put the CUDA toolkit's lib64 on LD_LIBRARY_PATH)".into(),
        ));
    }
    let opts = CompileOptions {
        arch: Some(arch),
        fmad: Some(false),
        name: Some("ringzero_kernels.cu".into()),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(KERNELS_CU, opts).map_err(|e| DeviceError::Compile {
        arch: arch.to_string(),
        log: e.to_string(),
    })
}

/// The names of the kernels the source must define (for checks and for loading).
pub fn kernel_names() -> Vec<String> {
    let all = ["float", "double", "f16", "bf16", "int", "i64", "u8"];
    let floats = ["float", "f16", "bf16"];
    let mut v = Vec::new();
    for t in all {
        for op in ["sum", "prod", "min", "max"] {
            v.push(format!("reduce_{op}_{t}"));
            v.push(format!("combine_{op}_{t}"));
            v.push(format!("combine2_{op}_{t}"));
            v.push(format!("gather_{op}_{t}"));
        }
        v.push(format!("divide_{t}"));
    }
    for (a, b) in [
        ("float", "f16"),
        ("float", "bf16"),
        ("f16", "float"),
        ("bf16", "float"),
    ] {
        v.push(format!("cast_{a}_{b}"));
    }
    v.push("copy2".to_string());
    v.push("copy_pair".to_string());
    for t in floats {
        for k in ["scale", "sq_norm", "nonfinite", "optim_step"] {
            v.push(format!("{k}_{t}"));
        }
    }
    v
}

/// The kernels' name for a dtype.
pub fn cu_type(d: DType) -> &'static str {
    match d {
        DType::F32 => "float",
        DType::F64 => "double",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::I32 => "int",
        DType::I64 => "i64",
        DType::U8 => "u8",
    }
}

pub use super::held::Allocated;
use super::held::Held;

/// ringzero's own `cuMemAlloc`s, and the peers' memory it maps ([`mapped`]).
static OWN: Held = Held::new();
static MAPPED: Held = Held::new();

/// What this process's [`DeviceBuffer`]s and streams' scratch (every `cuMemAlloc` ringzero
/// makes: the engine's model states and buffers, its communicators' slots and scratch) hold now
/// and at most since [`reset_allocated_peak`] ([`Allocated`]).
pub fn allocated() -> Allocated {
    OWN.read()
}

/// Other processes' device memory this process has mapped (CUDA IPC: a direct collective's
/// peers' buffers and slots), now and at most since [`reset_allocated_peak`]. It is the peers'
/// memory, not this process's; the driver may still list it under this process too.
pub fn mapped() -> Allocated {
    MAPPED.read()
}

/// Start [`Allocated::peak`] of both [`allocated`] and [`mapped`] again from what is held now.
pub fn reset_allocated_peak() {
    OWN.restart();
    MAPPED.restart();
}

/// `bytes` more held ([`allocated`]).
pub(crate) fn count_alloc(bytes: usize) {
    OWN.add(bytes);
}

/// `bytes` given back ([`allocated`]).
pub(crate) fn count_free(bytes: usize) {
    OWN.sub(bytes);
}

/// `bytes` of a peer's memory mapped here, or (`open` false) unmapped ([`mapped`]).
pub(crate) fn count_mapped(bytes: usize, open: bool) {
    if open {
        MAPPED.add(bytes);
    } else {
        MAPPED.sub(bytes);
    }
}

/// One CUDA device: its primary context, a compute stream and a copy stream, the two copy
/// lanes ([`CopyLane`](super::CopyLane)), and the kernels.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    /// The copy lanes' streams, by [`CopyLane::index`](super::CopyLane::index).
    lanes: [Arc<CudaStream>; 2],
    /// Whether a lane has work the compute stream has not been joined to since ([`Stream::mark`](crate::device::Stream::mark)
    /// joins those first, so a marker covers everything queued on the device).
    lane_dirty: [std::sync::atomic::AtomicBool; 2],
    arch: &'static str,
    module: OnceLock<Result<Arc<CudaModule>, DeviceError>>,
    funcs: Mutex<HashMap<String, CudaFunction>>,
}

/// A device buffer of `len` elements of `dtype`.
///
/// The memory comes from a plain `cuMemAlloc`, not cudarc's stream-ordered pool: CUDA IPC can
/// export only such memory, and the direct collectives of ranks that share a node
/// ([`Gpu::share_of`]) write straight into each other's buffers. It is freed with `cuMemFree` on
/// Drop, after the context's queued work has completed.
pub struct DeviceBuffer {
    buf: ManuallyDrop<CudaSlice<u8>>,
    dtype: DType,
    len: usize,
}

impl DeviceBuffer {
    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Bytes.
    pub fn bytes(&self) -> usize {
        self.len * self.dtype.size()
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: the slice is taken exactly once, here, and the field is not used afterwards.
        let slice = unsafe { ManuallyDrop::take(&mut self.buf) };
        let ctx = slice.stream().context().clone();
        let bytes = slice.len();
        // `leak` waits for the work cudarc tracked on the slice and gives up its ownership.
        let ptr = slice.leak();
        // Kernels and copies queued on raw addresses (the collectives) are not tracked by the
        // slice: the whole context finishes before the memory goes.
        ctx.record_err(ctx.synchronize());
        // SAFETY: `ptr` came from cuMemAlloc in `ctx` (Gpu::alloc), is freed exactly once, and no
        // queued work uses it any more.
        ctx.record_err(unsafe { result::free_sync(ptr) });
        count_free(bytes);
    }
}

impl Gpu {
    /// Open device `ordinal`.
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>, DeviceError> {
        let n = device_count()?;
        if ordinal >= n {
            return Err(DeviceError::Invalid(format!(
                "cuda:{ordinal} does not exist ({n} device{} here)",
                if n == 1 { "" } else { "s" }
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver("creating the context"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver("reading the compute capability"))?;
        let arch: &'static str = Box::leak(format!("compute_{major}{minor}").into_boxed_str());
        let stream = ctx.new_stream().map_err(driver("creating a stream"))?;
        let copy = ctx.new_stream().map_err(driver("creating a copy stream"))?;
        let lane = || ctx.new_stream().map_err(driver("creating a copy lane"));
        let lanes = [lane()?, lane()?];
        Ok(Arc::new(Gpu {
            ctx,
            stream,
            copy,
            lanes,
            lane_dirty: Default::default(),
            arch,
            module: OnceLock::new(),
            funcs: Mutex::new(HashMap::new()),
        }))
    }

    /// The architecture kernels are compiled for (`compute_XY`).
    pub fn arch(&self) -> &'static str {
        self.arch
    }

    /// The device's name.
    pub fn name(&self) -> Result<String, DeviceError> {
        self.ctx.name().map_err(driver("reading the device name"))
    }

    /// An error a Drop (or an earlier asynchronous call) left on the context.
    fn check(&self) -> Result<(), DeviceError> {
        self.ctx.check_err().map_err(driver("an earlier operation"))
    }

    fn func(&self, name: &str) -> Result<CudaFunction, DeviceError> {
        if let Some(f) = self.funcs.lock().unwrap().get(name) {
            return Ok(f.clone());
        }
        let module = self
            .module
            .get_or_init(|| {
                let ptx = compile(self.arch)?;
                self.ctx
                    .load_module(ptx)
                    .map_err(driver("loading the compiled kernels"))
            })
            .clone()?;
        let f = module
            .load_function(name)
            .map_err(driver("finding a kernel"))?;
        self.funcs
            .lock()
            .unwrap()
            .insert(name.to_string(), f.clone());
        Ok(f)
    }

    /// A zeroed buffer. An empty one still owns one element of memory: CUDA refuses to
    /// allocate zero bytes, and a rank's part of a collective may be empty.
    pub fn alloc(&self, dtype: DType, len: usize) -> Result<DeviceBuffer, DeviceError> {
        self.check()?;
        let bytes = len.max(1) * dtype.size();
        self.ctx
            .bind_to_thread()
            .map_err(driver("binding the context"))?;
        // SAFETY: the context is current on this thread and `bytes` is not zero.
        let ptr = unsafe { result::malloc_sync(bytes) }
            .map_err(driver("allocating device memory (cuMemAlloc)"))?;
        count_alloc(bytes);
        // SAFETY: `ptr` is a live allocation of `bytes` bytes of this context that nothing else
        // owns; the slice takes it over, and DeviceBuffer's Drop frees it (never cudarc's).
        let slice = unsafe { self.stream.upgrade_device_ptr::<u8>(ptr, bytes) };
        let mut buf = DeviceBuffer {
            buf: ManuallyDrop::new(slice),
            dtype,
            len,
        };
        self.stream
            .memset_zeros(&mut *buf.buf)
            .map_err(driver("zeroing device memory"))?;
        Ok(buf)
    }

    /// Host → device, into a new buffer.
    pub fn upload(&self, dtype: DType, bytes: &[u8]) -> Result<DeviceBuffer, DeviceError> {
        self.check()?;
        if !bytes.len().is_multiple_of(dtype.size()) {
            return Err(DeviceError::Invalid(format!(
                "upload: {} bytes are not a whole number of {dtype} elements",
                bytes.len()
            )));
        }
        if bytes.is_empty() {
            return self.alloc(dtype, 0);
        }
        let mut buf = self.alloc(dtype, bytes.len() / dtype.size())?;
        // The zeroing was queued on the compute stream: the copy stream waits for it.
        self.stream
            .synchronize()
            .map_err(driver("zeroing device memory"))?;
        self.copy
            .memcpy_htod(bytes, &mut *buf.buf)
            .map_err(driver("copying host to device"))?;
        self.copy
            .synchronize()
            .map_err(driver("copying host to device"))?;
        Ok(buf)
    }

    /// Device → host (waits for the kernels queued before it).
    pub fn download(&self, src: &DeviceBuffer, out: &mut [u8]) -> Result<(), DeviceError> {
        self.check()?;
        if out.len() != src.bytes() {
            return Err(DeviceError::Invalid(format!(
                "download: {} bytes into a {}-byte host buffer",
                src.bytes(),
                out.len()
            )));
        }
        if out.is_empty() {
            return Ok(()); // (an empty buffer's one element of memory is not its content)
        }
        self.stream
            .memcpy_dtoh(&*src.buf, out)
            .map_err(driver("copying device to host"))?;
        self.stream
            .synchronize()
            .map_err(driver("copying device to host"))
    }

    /// Device → device copy of a whole buffer (same dtype and length), queued on the compute
    /// stream.
    pub fn copy(&self, dst: &mut DeviceBuffer, src: &DeviceBuffer) -> Result<(), DeviceError> {
        self.check()?;
        same(dst, src, "copy")?;
        self.stream
            .memcpy_dtod(&*src.buf, &mut *dst.buf)
            .map_err(driver("copying device to device"))
    }

    /// Milliseconds per call of `f` (queued `reps` times between two events on the compute
    /// stream, after one warm-up call).
    pub fn time(
        &self,
        reps: usize,
        mut f: impl FnMut() -> Result<(), DeviceError>,
    ) -> Result<f64, DeviceError> {
        f()?;
        let start = self
            .stream
            .record_event(Some(TIMED))
            .map_err(driver("recording an event"))?;
        for _ in 0..reps.max(1) {
            f()?;
        }
        let end = self
            .stream
            .record_event(Some(TIMED))
            .map_err(driver("recording an event"))?;
        end.synchronize().map_err(driver("waiting for an event"))?;
        let ms = start.elapsed_ms(&end).map_err(driver("timing"))?;
        Ok(ms as f64 / reps.max(1) as f64)
    }

    /// Wait for everything queued, on the compute stream and the copy lanes.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        self.stream.synchronize().map_err(driver("synchronizing"))?;
        for lane in &self.lanes {
            lane.synchronize()
                .map_err(driver("synchronizing a copy lane"))?;
        }
        self.check()
    }

    fn cfg(n: usize) -> LaunchConfig {
        let blocks = n.div_ceil(BLOCK as usize).clamp(1, 132 * 32) as u32;
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// `dst = op(dst, src)` element-wise (`Avg` = `Sum` here; finish with [`Gpu::divide`]).
    pub fn reduce_into(
        &self,
        op: ReduceOp,
        dst: &mut DeviceBuffer,
        src: &DeviceBuffer,
    ) -> Result<(), DeviceError> {
        self.check()?;
        same(dst, src, "reduce")?;
        let name = match op.pairwise() {
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            _ => "sum",
        };
        let f = self.func(&format!("reduce_{name}_{}", cu_type(dst.dtype)))?;
        let n = dst.len as u64;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&mut *dst.buf).arg(&*src.buf).arg(&n);
        // SAFETY: the kernel reads `n` elements of `src` and writes `n` of `dst`; both buffers
        // hold exactly `n` elements of the kernel's dtype (checked by `same`), and the grid-stride
        // loop stays below `n`.
        unsafe { b.launch(Self::cfg(dst.len)) }.map_err(driver("launching reduce"))?;
        Ok(())
    }

    /// `buf /= ranks` element-wise (the end of an average).
    pub fn divide(&self, buf: &mut DeviceBuffer, ranks: usize) -> Result<(), DeviceError> {
        self.check()?;
        if ranks == 0 || ranks > i32::MAX as usize {
            return Err(DeviceError::Invalid(format!("divide by {ranks} ranks")));
        }
        let f = self.func(&format!("divide_{}", cu_type(buf.dtype)))?;
        let (n, r) = (buf.len as u64, ranks as i32);
        let mut b = self.stream.launch_builder(&f);
        b.arg(&mut *buf.buf).arg(&n).arg(&r);
        // SAFETY: `n` elements of the kernel's dtype, grid-stride bounded by `n`.
        unsafe { b.launch(Self::cfg(buf.len)) }.map_err(driver("launching divide"))?;
        Ok(())
    }

    /// Cast `src` into `dst` (f32 ↔ f16/bf16), rounding to nearest even.
    pub fn cast(
        self: &Arc<Self>,
        src: &DeviceBuffer,
        dst: &mut DeviceBuffer,
    ) -> Result<(), DeviceError> {
        if src.len != dst.len {
            return Err(DeviceError::Invalid(format!(
                "cast: {} elements into {}",
                src.len, dst.len
            )));
        }
        let (s, d) = (self.ptr_of(src), self.ptr_of(dst));
        // SAFETY: both buffers hold `len` elements of their dtypes, are distinct (one is borrowed
        // mutably) and are freed only after the context's work (DeviceBuffer's Drop).
        unsafe { TrainStream::cast(self, src.dtype, s, dst.dtype, d, src.len) }
    }

    fn float_kernel(&self, k: &str, d: DType) -> Result<CudaFunction, DeviceError> {
        if !matches!(d, DType::F32 | DType::F16 | DType::BF16) {
            return Err(DeviceError::Invalid(format!(
                "{k}: {d} is not a training float type (f32, f16, bf16)"
            )));
        }
        self.func(&format!("{k}_{}", cu_type(d)))
    }

    /// `buf *= s`.
    pub fn scale(&self, buf: &mut DeviceBuffer, s: f32) -> Result<(), DeviceError> {
        self.check()?;
        let f = self.float_kernel("scale", buf.dtype)?;
        let n = buf.len as u64;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&mut *buf.buf).arg(&s).arg(&n);
        // SAFETY: `n` elements of the kernel's dtype, grid-stride bounded by `n`.
        unsafe { b.launch(Self::cfg(buf.len)) }.map_err(driver("launching scale"))?;
        Ok(())
    }

    /// Σ (x·s)² in f64 (waits for the result).
    pub fn sq_norm(self: &Arc<Self>, x: &DeviceBuffer, s: f32) -> Result<f64, DeviceError> {
        // SAFETY: the buffer holds `len` elements of its dtype.
        unsafe { TrainStream::sq_norm(self, x.dtype, self.ptr_of(x), x.len, s) }
    }

    /// Whether every element is finite (waits for the result).
    pub fn all_finite(self: &Arc<Self>, x: &DeviceBuffer) -> Result<bool, DeviceError> {
        // SAFETY: the buffer holds `len` elements of its dtype.
        unsafe { TrainStream::all_finite(self, x.dtype, self.ptr_of(x), x.len) }
    }

    /// One fused optimizer step: fp32 `master` and the states `h`'s rule keeps
    /// ([`crate::cpu::Optimizer::states`], in order); gradients in `grads`' dtype; `params` (same
    /// dtype as the gradients) written from the master when given.
    pub fn optim_step(
        self: &Arc<Self>,
        h: &crate::cpu::Optimizer,
        t: u64,
        state: StepState<'_>,
        grad_scale: f32,
    ) -> Result<(), DeviceError> {
        self.check()?;
        let StepState {
            master,
            params,
            grads,
            states,
        } = state;
        let n = master.len;
        let names = h.states();
        if states.len() != names.len() {
            return Err(DeviceError::Invalid(format!(
                "optim_step: {} keeps {} state{} ({}), {} given",
                h.name(),
                names.len(),
                if names.len() == 1 { "" } else { "s" },
                names.join(", "),
                states.len()
            )));
        }
        for (what, b) in names.iter().zip(states.iter()) {
            if b.dtype != DType::F32 || b.len != n {
                return Err(DeviceError::Invalid(format!(
                    "optim_step: {what} must be {n} f32 elements, is {} {}",
                    b.len, b.dtype
                )));
            }
        }
        if master.dtype != DType::F32 || grads.len != n {
            return Err(DeviceError::Invalid(format!(
                "optim_step: master ({} {}) and gradients ({} {}) must be {n} elements, master f32",
                master.len, master.dtype, grads.len, grads.dtype
            )));
        }
        if let Some(p) = &params {
            if p.dtype != grads.dtype || p.len != n {
                return Err(DeviceError::Invalid(format!(
                    "optim_step: params ({} {}) must match the gradients ({n} {})",
                    p.len, p.dtype, grads.dtype
                )));
            }
        }
        let state_at = |k: usize| states.get(k).map_or(0, |b| self.ptr_of(b));
        let at = StepAt {
            master: self.ptr_of(master),
            params: params.map(|p| self.ptr_of(p)),
            grads: self.ptr_of(grads),
            s1: state_at(0),
            s2: state_at(1),
        };
        // SAFETY: every buffer holds `n` elements of the type the kernel expects (checked above)
        // and they are distinct (all but `grads` are borrowed mutably); the rule reads only the
        // states it keeps, which are given.
        unsafe { TrainStream::optim_step(self, h, t, grads.dtype, at, n, grad_scale) }
    }
}

/// The buffers of one optimizer step.
pub struct StepState<'a> {
    /// fp32 master weights.
    pub master: &'a mut DeviceBuffer,
    /// 16-bit parameters written from the master, if any.
    pub params: Option<&'a mut DeviceBuffer>,
    /// Gradients (f32, f16 or bf16).
    pub grads: &'a DeviceBuffer,
    /// The fp32 states the rule keeps, in [`crate::cpu::Optimizer::states`]' order.
    pub states: Vec<&'a mut DeviceBuffer>,
}

fn same(a: &DeviceBuffer, b: &DeviceBuffer, what: &str) -> Result<(), DeviceError> {
    if a.dtype != b.dtype || a.len != b.len {
        return Err(DeviceError::Invalid(format!(
            "{what}: {} {} and {} {} differ",
            a.len, a.dtype, b.len, b.dtype
        )));
    }
    Ok(())
}
