//! Raw device addresses: memory shared with other processes, host memory the GPU can address, and
//! the kernels and copies that work on such addresses. This is where the collectives' device data
//! path touches CUDA, and the only place (with its parent) that calls the driver's `sys` layer.
//!
//! Owners, each released on Drop (a failure there is recorded on the context and returned by the
//! device's next call):
//! - [`ExportedSlots`]: device memory from a plain `cuMemAlloc` (IPC cannot export memory from a
//!   stream-ordered pool), with its 64-byte IPC handle;
//! - [`IpcMapping`]: another process's [`ExportedSlots`] opened with `cuIpcOpenMemHandle`; closed,
//!   never freed, on Drop (the exporter owns the memory);
//! - [`HostRegistration`]: host memory (an shm segment) page-locked and mapped into the device's
//!   address space with `cuMemHostRegister` (portable, device-mapped), unregistered on Drop.
//!
//! Addresses are plain `u64` device pointers ([`DevPtr`]). With unified addressing (every 64-bit
//! platform CUDA supports) a kernel or `cuMemcpyAsync` can use an IPC-mapped peer pointer or a
//! mapped host pointer like local device memory; that is what lets one ring engine drive both
//! the peer-copy and the host-staging transports.
//!
//! Work is queued on the device's compute stream in call order; [`Stream::mark`](crate::device::Stream::mark) returns a
//! [`Marker`] that completes when everything queued before it has.

use std::sync::Arc;

use cudarc::driver::{result, sys};

use super::{driver, Gpu};
use crate::device::{DevPtr, DeviceError};

mod queue;

pub use queue::Marker;

/// Size of a CUDA IPC memory handle.
pub const IPC_HANDLE_BYTES: usize = 64;

fn sys_err(op: &str) -> impl Fn(result::DriverError) -> DeviceError + '_ {
    driver(op)
}

/// How another process opens the allocation holding a buffer ([`Gpu::share_of`]; the peer opens
/// `handle` with [`IpcMapping::open`] and adds `offset`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedMemory {
    /// The allocation's IPC handle.
    pub handle: [u8; IPC_HANDLE_BYTES],
    /// The buffer's offset in the allocation.
    pub offset: u64,
    /// The allocation's length.
    pub bytes: usize,
    /// The allocation's process-wide unique id.
    pub id: u64,
}

/// Device memory allocated with `cuMemAlloc`, exportable to other processes.
pub struct ExportedSlots {
    gpu: Arc<Gpu>,
    ptr: DevPtr,
    bytes: usize,
}

impl ExportedSlots {
    /// Allocate `bytes` (at least 1) and fill them with `fill`.
    pub fn new(gpu: &Arc<Gpu>, bytes: usize, fill: u8) -> Result<ExportedSlots, DeviceError> {
        gpu.check()?;
        gpu.ctx
            .bind_to_thread()
            .map_err(sys_err("binding the context"))?;
        let mut ptr: DevPtr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the context is current on this thread.
        unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(1)) }
            .result()
            .map_err(sys_err(
                "allocating IPC-exportable device memory (cuMemAlloc)",
            ))?;
        super::count_alloc(bytes.max(1));
        let s = ExportedSlots {
            gpu: gpu.clone(),
            ptr,
            bytes,
        };
        // SAFETY: `ptr` owns `bytes.max(1)` bytes just allocated in this context.
        unsafe { result::memset_d8_sync(ptr, fill, bytes.max(1)) }
            .map_err(sys_err("filling device memory"))?;
        // The fill runs on the legacy default stream, which the device's non-blocking compute
        // stream and copy lanes do not wait for: a copy or kernel queued on them next could run
        // before it and be overwritten (an in-place all-to-all's send copy read back as zeros,
        // a ZeRO engine's fresh gradient bucket zeroed after its first gradient landed). It
        // has ended before the memory is handed out.
        // SAFETY: the null stream is the context's legacy default stream, current here.
        unsafe { result::stream::synchronize(std::ptr::null_mut()) }
            .map_err(sys_err("waiting for the fill of new device memory"))?;
        Ok(s)
    }

    /// The base address.
    pub fn ptr(&self) -> DevPtr {
        self.ptr
    }

    /// Length in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The IPC handle another process opens with [`IpcMapping::open`].
    pub fn handle(&self) -> Result<[u8; IPC_HANDLE_BYTES], DeviceError> {
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(sys_err("binding the context"))?;
        let mut h = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        // SAFETY: `self.ptr` is the base of a live cuMemAlloc allocation of this context and `h`
        // is a valid out-pointer.
        unsafe { sys::cuIpcGetMemHandle(&mut h, self.ptr) }
            .result()
            .map_err(sys_err("exporting device memory (cuIpcGetMemHandle)"))?;
        Ok(h.reserved.map(|c| c as u8))
    }
}

impl Drop for ExportedSlots {
    fn drop(&mut self) {
        let _ = self.gpu.ctx.bind_to_thread();
        // SAFETY: we own the allocation and nothing in this process uses it after Drop (importers
        // in other processes hold their own mapping, which the driver keeps valid until closed).
        let r = unsafe { sys::cuMemFree_v2(self.ptr) }.result();
        self.gpu.ctx.record_err(r);
        super::count_free(self.bytes.max(1));
    }
}

/// Another process's device memory, opened from its IPC handle.
pub struct IpcMapping {
    gpu: Arc<Gpu>,
    ptr: DevPtr,
    bytes: usize,
}

impl IpcMapping {
    /// Open `handle` (exported by another process) in `gpu`'s context. `bytes` is what the
    /// exporter announced; nothing here can check it, so callers must only trust their peer.
    pub fn open(
        gpu: &Arc<Gpu>,
        handle: &[u8; IPC_HANDLE_BYTES],
        bytes: usize,
    ) -> Result<IpcMapping, DeviceError> {
        gpu.check()?;
        gpu.ctx
            .bind_to_thread()
            .map_err(sys_err("binding the context"))?;
        let h = sys::CUipcMemHandle {
            reserved: handle.map(|b| b as _),
        };
        let mut ptr: DevPtr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the handle is passed by value; the flag asks the
        // driver to enable peer access between the two devices when they differ.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(sys_err(
            "opening a peer's device memory (cuIpcOpenMemHandle; different IPC namespaces or containers?)",
        ))?;
        super::count_mapped(bytes, true);
        Ok(IpcMapping {
            gpu: gpu.clone(),
            ptr,
            bytes,
        })
    }

    /// The mapped base address.
    pub fn ptr(&self) -> DevPtr {
        self.ptr
    }

    /// Length in bytes (as announced by the exporter).
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        let _ = self.gpu.ctx.bind_to_thread();
        // SAFETY: `ptr` came from cuIpcOpenMemHandle in this context and is closed exactly once;
        // the memory itself belongs to the exporter and is not freed here.
        let r = unsafe { sys::cuIpcCloseMemHandle(self.ptr) }.result();
        self.gpu.ctx.record_err(r);
        super::count_mapped(self.bytes, false);
    }
}

/// Host memory page-locked and mapped into the device's address space.
pub struct HostRegistration {
    gpu: Arc<Gpu>,
    host: usize,
    dev: DevPtr,
    bytes: usize,
}

// SAFETY: the registration only records addresses; it never dereferences `host`, and the driver
// calls it makes are thread-safe.
unsafe impl Send for HostRegistration {}
// SAFETY: as above; all methods take `&self` and only read plain integers.
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    /// Register `bytes` at `host`.
    ///
    /// # Safety
    /// `host..host + bytes` must stay mapped (and not be registered again) until the returned
    /// value is dropped.
    pub unsafe fn new(
        gpu: &Arc<Gpu>,
        host: *mut u8,
        bytes: usize,
    ) -> Result<HostRegistration, DeviceError> {
        gpu.check()?;
        gpu.ctx
            .bind_to_thread()
            .map_err(sys_err("binding the context"))?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the caller guarantees the range stays mapped while registered.
        unsafe { sys::cuMemHostRegister_v2(host.cast(), bytes, flags) }
            .result()
            .map_err(sys_err(
                "page-locking the shm staging slots (cuMemHostRegister; raise `ulimit -l`?)",
            ))?;
        let mut dev: DevPtr = 0;
        // SAFETY: `host` was registered just above with DEVICEMAP; `dev` is a valid out-pointer.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host.cast(), 0) }.result();
        let reg = HostRegistration {
            gpu: gpu.clone(),
            host: host as usize,
            dev,
            bytes,
        };
        r.map_err(sys_err("mapping the staging slots into the device"))?;
        Ok(reg)
    }

    /// The device address of host address `host` inside the registered range.
    pub fn device_ptr(&self, host: *const u8) -> Result<DevPtr, DeviceError> {
        let h = host as usize;
        if h < self.host || h > self.host + self.bytes {
            return Err(DeviceError::Invalid(format!(
                "host address {h:#x} is outside the registered range {:#x}+{}",
                self.host, self.bytes
            )));
        }
        Ok(self.dev + (h - self.host) as u64)
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        let _ = self.gpu.ctx.bind_to_thread();
        // SAFETY: the range was registered by `new` and is unregistered exactly once.
        let r = unsafe { sys::cuMemHostUnregister(self.host as *mut _) }.result();
        self.gpu.ctx.record_err(r);
    }
}

/// What the driver says about peer access from device `a` to device `b`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerAccess {
    /// `cuDeviceCanAccessPeer` (always true for a == b).
    pub can_access: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED`.
    pub access_supported: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED`.
    pub native_atomics: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK` (lower is better).
    pub performance_rank: i32,
}

/// Peer capability between device ordinals `a` and `b`.
pub fn peer_access(a: usize, b: usize) -> Result<PeerAccess, DeviceError> {
    super::device_count()?;
    if a == b {
        return Ok(PeerAccess {
            can_access: true,
            access_supported: true,
            native_atomics: true,
            performance_rank: 0,
        });
    }
    let dev = |o: usize| -> Result<sys::CUdevice, DeviceError> {
        result::device::get(o as i32).map_err(sys_err("opening a device"))
    };
    let (da, db) = (dev(a)?, dev(b)?);
    let mut can = 0;
    // SAFETY: valid out-pointer and device handles from cuDeviceGet.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, da, db) }
        .result()
        .map_err(sys_err("cuDeviceCanAccessPeer"))?;
    let attr = |at: sys::CUdevice_P2PAttribute| -> Result<i32, DeviceError> {
        let mut v = 0;
        // SAFETY: valid out-pointer and device handles.
        unsafe { sys::cuDeviceGetP2PAttribute(&mut v, at, da, db) }
            .result()
            .map_err(sys_err("cuDeviceGetP2PAttribute"))?;
        Ok(v)
    };
    use sys::CUdevice_P2PAttribute as A;
    Ok(PeerAccess {
        can_access: can != 0,
        access_supported: attr(A::CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED)? != 0,
        native_atomics: attr(A::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED)? != 0,
        performance_rank: attr(A::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK)?,
    })
}

pub use super::device_count;

/// The UUID of device `ordinal`.
pub fn uuid_of(ordinal: usize) -> Result<[u8; 16], DeviceError> {
    super::device_count()?;
    let d = result::device::get(ordinal as i32).map_err(sys_err("opening a device"))?;
    let u = result::device::get_uuid(d).map_err(sys_err("reading a device UUID"))?;
    Ok(u.bytes.map(|c| c as u8))
}

/// The PCI bus id of device `ordinal` (`0000:3b:00.0`), lower case like sysfs.
pub fn pci_bus_id(ordinal: usize) -> Result<String, DeviceError> {
    super::device_count()?;
    let d = result::device::get(ordinal as i32).map_err(sys_err("opening a device"))?;
    let mut buf = [0 as std::ffi::c_char; 32];
    // SAFETY: the buffer is 32 bytes, as told; the driver NUL-terminates within it.
    unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, d) }
        .result()
        .map_err(sys_err("cuDeviceGetPCIBusId"))?;
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|c| **c != 0)
        .map(|c| *c as u8)
        .collect();
    Ok(String::from_utf8_lossy(&bytes).to_lowercase())
}
