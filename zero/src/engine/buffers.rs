//! The engine's buffers: allocations of its stream ([`DevVec`]), the spare buffers it
//! keeps for the next micro-step ([`Spares`]), and the one host all-gather it needs at set-up.

use std::any::Any;
use std::sync::Arc;

use ringzero_collectives::{
    Collectives, DType, DeviceComm, DeviceMemory, Error, Stream, TrainStream, Work,
};
use ringzero_kernels::device::Held;
use ringzero_kernels::DeviceError;

use crate::error::ZeroError;

/// An allocation of the engine's stream holding `elems` elements of `dtype`.
pub(crate) struct DevVec {
    pub(super) addr: u64,
    pub(super) elems: usize,
    pub(super) dtype: DType,
    /// Where the host reaches it: host memory the stream maps ([`alloc_host`]), or any
    /// allocation of the host stream; `None` for a GPU's own memory.
    pub(super) host: Option<usize>,
    pub(super) _keep: Box<dyn Any + Send>,
}

// SAFETY: `addr` starts an allocation of at least `elems × dtype.size()` bytes that the engine's
// stream made (`TrainStream::alloc`) and `_keep` owns, so it is live while the DevVec is. DevVecs
// are private to the engine, which hands them only to its own communicator, whose stream made
// them.
unsafe impl<S: Stream> DeviceMemory<S> for DevVec {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn elems(&self) -> usize {
        self.elems
    }
    fn addr(&self, _: &S) -> u64 {
        self.addr
    }
    fn addr_mut(&mut self, _: &S) -> u64 {
        self.addr
    }
}

impl DevVec {
    /// The address of element `i`.
    pub(super) fn at(&self, i: usize) -> u64 {
        debug_assert!(i <= self.elems);
        self.addr + (i * self.dtype.size()) as u64
    }
}

/// Collectives on the proxy thread per bucket, with the elements they hold.
pub(crate) type InFlight = Vec<Option<(Work<(DevVec, DevVec)>, usize)>>;

/// Reduce-scatters on the proxy thread, oldest first: (bucket, the work, elements it holds).
pub(crate) type Reducing = std::collections::VecDeque<(usize, Work<(DevVec, DevVec)>, usize)>;

/// Buffers of one capacity (`cap` elements of `dtype`) kept after use, at most `keep` of them,
/// for temporaries the engine needs again every micro-step (a bucket's gradients while backward
/// fills it, a gathered bucket, a reduced shard): on a GPU an allocation is a driver call, a
/// free waits for the whole device, and under the direct step a new buffer is a new IPC mapping
/// in every peer.
pub(crate) struct Spares {
    pub(super) dtype: DType,
    pub(super) cap: usize,
    pub(super) keep: usize,
    pub(super) free: Vec<DevVec>,
    /// Whether new buffers are host memory the stream maps ([`alloc_host`]).
    pub(super) host: bool,
    /// Where the bytes of the buffers it made and has not dropped are counted (kept or in
    /// use), if anywhere: the engine's peak of communication buffers.
    meter: Option<Arc<Held>>,
}

impl Spares {
    pub(super) fn new(dtype: DType, cap: usize, keep: usize) -> Spares {
        Spares {
            dtype,
            cap,
            keep,
            free: Vec::new(),
            host: false,
            meter: None,
        }
    }

    /// Count the bytes of the buffers it makes, while they live, in `meter`.
    pub(super) fn metered(self, meter: &Arc<Held>) -> Spares {
        Spares {
            meter: Some(meter.clone()),
            ..self
        }
    }

    /// Bytes of one of its buffers.
    fn bytes(&self) -> usize {
        alloc_bytes(self.dtype, self.cap)
    }

    /// As [`Spares::new`], the buffers in host memory the stream maps (the offload tier's).
    pub(super) fn on_host(dtype: DType, cap: usize, keep: usize) -> Spares {
        Spares {
            host: true,
            ..Spares::new(dtype, cap, keep)
        }
    }

    /// A buffer of `elems` (at most `cap`) elements; zeroed where `zeroed` (a new one is).
    pub(super) fn take<S: TrainStream>(
        &mut self,
        s: &S,
        elems: usize,
        zeroed: bool,
    ) -> Result<DevVec, ZeroError> {
        assert!(
            elems <= self.cap,
            "{elems} elements in buffers of {}",
            self.cap
        );
        let mut v = match self.free.pop() {
            Some(v) => {
                if zeroed {
                    // SAFETY: a kept buffer of `cap ≥ elems` elements, no longer used by work
                    // queued before (it was given back once that work had ended).
                    unsafe { s.zero(v.addr, elems * self.dtype.size()) }
                        .map_err(dev("clearing a kept buffer".into()))?;
                }
                v
            }
            None if self.host => alloc_host(s, self.dtype, self.cap)?,
            None => {
                let v = alloc(s, self.dtype, self.cap)?;
                if let Some(m) = &self.meter {
                    m.add(self.bytes());
                }
                v
            }
        };
        v.elems = elems;
        Ok(v)
    }

    /// Keep `v` (taken from here, its work ended) for later, or free it when enough are kept.
    pub(super) fn give(&mut self, mut v: DevVec) {
        if self.free.len() < self.keep {
            v.elems = self.cap;
            self.free.push(v);
        } else if let Some(m) = &self.meter {
            // Dropped here: freed.
            m.sub(self.bytes());
        }
    }

    /// Elements held by the kept buffers.
    pub(super) fn held(&self) -> usize {
        self.free.len() * self.cap
    }
}

pub(crate) fn dev(context: String) -> impl FnOnce(DeviceError) -> ZeroError {
    move |source| ZeroError::Comm(Error::Device { context, source })
}

/// Bytes [`alloc`] and [`alloc_host`] take for `elems` elements of `dtype` (at least 64: no
/// stream allocates nothing).
pub(crate) fn alloc_bytes(dtype: DType, elems: usize) -> usize {
    (elems * dtype.size()).max(64)
}

/// `elems` zeroed elements of `dtype` on `s`.
pub(crate) fn alloc<S: TrainStream>(
    s: &S,
    dtype: DType,
    elems: usize,
) -> Result<DevVec, ZeroError> {
    let bytes = alloc_bytes(dtype, elems);
    let (addr, keep) = s
        .alloc(bytes)
        .map_err(dev(format!("allocating {bytes} bytes")))?;
    Ok(DevVec {
        addr,
        elems,
        dtype,
        host: s.host_addressable().then_some(addr as usize),
        _keep: keep,
    })
}

/// `elems` zeroed elements of `dtype` in host memory that `s` addresses too (the offload tier:
/// page-locked and mapped on a GPU).
pub(crate) fn alloc_host<S: TrainStream>(
    s: &S,
    dtype: DType,
    elems: usize,
) -> Result<DevVec, ZeroError> {
    let bytes = alloc_bytes(dtype, elems);
    let (addr, host, keep) = s
        .alloc_host(bytes)
        .map_err(dev(format!("allocating {bytes} bytes of host memory")))?;
    Ok(DevVec {
        addr,
        elems,
        dtype,
        host: Some(host),
        _keep: keep,
    })
}

/// Every rank's `mine` (the same length on every rank) over `dc`, on the host: staged through
/// device buffers of `dc`'s stream.
pub(crate) fn all_gather_host<S: TrainStream + 'static, E: ringzero_kernels::Element>(
    dc: &DeviceComm<S>,
    mine: &[E],
) -> Result<Vec<E>, ZeroError> {
    let n = dc.size();
    let send = alloc(dc.stream(), E::DTYPE, mine.len())?;
    let mut recv = alloc(dc.stream(), E::DTYPE, mine.len() * n)?;
    // SAFETY: a fresh allocation of `mine.len()` elements of `E`, used by no work.
    unsafe { dc.stream().write(send.addr, bytemuck::cast_slice(mine)) }
        .map_err(dev("uploading a record".into()))?;
    dc.all_gather(&send, &mut recv)?;
    let mut all = vec![E::zeroed(); mine.len() * n];
    // SAFETY: `recv` holds `mine.len() × n` elements of `E`.
    unsafe {
        dc.stream()
            .read(bytemuck::cast_slice_mut(&mut all), recv.addr)
    }
    .map_err(dev("reading the records".into()))?;
    Ok(all)
}
