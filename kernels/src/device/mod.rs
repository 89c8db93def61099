//! Where buffers live: the host, or a CUDA device (behind the `cuda` cargo feature, on by default;
//! the driver and NVRTC are loaded at run time, so a machine without them builds, tests and runs
//! everything host-side and gets [`DeviceError::NoCuda`] when it asks for a GPU).

#[cfg(feature = "cuda")]
pub mod cuda;
mod held;
mod host_stream;
mod stream;
mod train;

pub use held::{Allocated, Held};
pub use host_stream::{host_scratch, reset_host_scratch_peak, HostStream};
pub use stream::{Exported, ShareRecord, Stream};
pub use train::{StepAt, TrainStream};

/// The largest frame payload a GPU's ring edges use when the configuration names none
/// (`RINGZERO_DEVICE_SLICE_BYTES`; [`Stream::slice_bytes`]). Every slice costs a kernel launch,
/// an event and a host round trip through the control block, and with several processes on one
/// GPU a context switch, so large slices pay.
pub const GPU_SLICE_BYTES: usize = 16 << 20;

/// An address the device's kernels and copies use: a device pointer (valid in the process and
/// context that produced it), or on the host stream a plain host address.
pub type DevPtr = u64;

/// A copy lane: an order of copies beside a device's compute order, so host staging's copies in
/// (host→device) and out (device→host) run at once with each other and with kernels. Work on a
/// lane waits for the compute order only where it is joined to it, and the other way round.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CopyLane {
    /// Copies into the device (received slots into scratch or the caller's buffer).
    In,
    /// Copies out of it (results into the next rank's slot).
    Out,
}

impl CopyLane {
    /// Both lanes.
    pub const BOTH: [CopyLane; 2] = [CopyLane::In, CopyLane::Out];

    /// Its index (0, 1).
    pub fn index(self) -> usize {
        match self {
            CopyLane::In => 0,
            CopyLane::Out => 1,
        }
    }
}

/// Errors of devices: absence, driver calls, kernel compilation, misuse.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum DeviceError {
    /// No usable CUDA installation (library missing, no device, or the feature is off).
    #[error("no CUDA: {0}")]
    NoCuda(String),
    /// A driver call failed.
    #[error("CUDA {op}: {msg}")]
    Driver {
        /// What was being done.
        op: String,
        /// The driver's error.
        msg: String,
    },
    /// NVRTC could not compile the kernels.
    #[error("compiling the CUDA kernels for {arch} failed: {log}")]
    Compile {
        /// Target architecture.
        arch: String,
        /// Compiler log.
        log: String,
    },
    /// Bad arguments (lengths, dtypes, devices); nothing was launched.
    #[error("{0}")]
    Invalid(String),
}

/// Whether a CUDA device can be used here: `Ok(count)` or the reason it cannot.
pub fn cuda_devices() -> Result<usize, DeviceError> {
    #[cfg(feature = "cuda")]
    {
        cuda::device_count()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(DeviceError::NoCuda(
            "this build has the `cuda` feature off".into(),
        ))
    }
}

/// Most inputs or outputs of one gather (the direct collectives' one-pass kernel: one per rank).
pub const GATHER_MAX: usize = 8;

/// Refuse a gather whose input or output count is not 1 to [`GATHER_MAX`] (every device's gather
/// checks this before it queues anything).
pub fn check_gather(ins: usize, outs: usize) -> Result<(), DeviceError> {
    let fits = |k: usize| (1..=GATHER_MAX).contains(&k);
    if fits(ins) && fits(outs) {
        Ok(())
    } else {
        Err(DeviceError::Invalid(format!(
            "gather: {ins} inputs and {outs} outputs; each must be 1 to {GATHER_MAX}"
        )))
    }
}
