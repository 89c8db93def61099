//! What the device ring engine needs from a device: queue arithmetic and copies on addresses, in
//! order, and tell when queued work has completed. Two implementations:
//! - a CUDA device (`ringzero_kernels::device::cuda::Gpu`, in `device::cuda`): the compute
//!   stream, NVRTC kernels, events;
//! - [`HostStream`]: the host as an asynchronous device — a worker thread that runs the CPU
//!   kernels on host addresses in the order queued. It gives the device engine the same
//!   asynchrony a GPU has (work completes after the call returns), so the engine's rules —
//!   publish a frame only after the work writing it completed, release a slot only after the work
//!   reading it did — are exercised for real on machines without a GPU.

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

pub use ringzero_kernels::device::CopyLane;
use ringzero_kernels::device::DeviceError;
use ringzero_kernels::{cpu, DType, ReduceOp};

use crate::transport::device::DevPtr;

/// Exported device memory: its address, its 64-byte IPC handle, and its owner.
pub type Exported = (DevPtr, [u8; 64], Box<dyn Any + Send>);

/// How another rank opens a buffer ([`Stream::share`]): it opens `handle` with
/// [`Stream::open_exported`] for `bytes` and adds `offset`.
pub type Share = crate::transport::board::ShareRecord;

/// Most ranks of one direct step ([`Stream::gather`]'s inputs or outputs).
pub use ringzero_kernels::device::GATHER_MAX;

/// Wait until the work queued on `stream` before `m` has ended (completed or failed). On a
/// stream whose memory outlives its work ([`Stream::memory_outlives_work`]) the wait gives up at
/// `deadline`; on any other the caller's memory is still in use, so it goes on (saying so once)
/// until the work ends, which such a stream's work always does. Whether it ended.
pub(crate) fn settle<S: Stream>(stream: &S, m: &S::Marker, deadline: std::time::Duration) -> bool {
    let until = crate::deadline::Deadline::after(std::time::Instant::now(), deadline);
    let bounded = stream.memory_outlives_work();
    let mut waiter = crate::transport::wait::Waiter::backoff();
    let mut said = false;
    while let Ok(false) = stream.done(m) {
        if until.passed(std::time::Instant::now()) {
            if bounded {
                return false;
            }
            if !said {
                said = true;
                tracing::warn!(target: "ringzero::device",
                    "{}: work queued before a failure is still running after {:.1}s; waiting for \
                     it to end before returning, since it reads and writes the caller's memory",
                    stream.name(), deadline.as_secs_f64());
            }
        }
        waiter.idle(deadline);
    }
    true
}

/// Wait, within `timeout`, for this rank's own work queued on `stream` before `m` (a local copy
/// of the call fingerprinted `fp`, number `seq`, on `rank`). At the deadline the work first ends where the caller's
/// memory would not outlive it ([`settle`]), then the timeout names `what` was waited for.
pub(crate) fn wait_local<S: Stream>(
    stream: &S,
    m: &S::Marker,
    timeout: std::time::Duration,
    (fp, seq, rank): (&crate::wire::Fingerprint, u64, usize),
    what: &str,
) -> crate::error::Result<()> {
    let until = crate::deadline::Deadline::after(std::time::Instant::now(), timeout);
    let mut wait = crate::transport::wait::Waiter::backoff();
    let dev = |e| crate::error::Error::Device {
        context: format!("{fp}: {what}"),
        source: e,
    };
    while !stream.done(m).map_err(dev)? {
        if until.passed(std::time::Instant::now()) {
            settle(stream, m, std::time::Duration::ZERO);
            return Err(crate::error::Error::Timeout {
                op: fp.to_string(),
                seq,
                peer: rank,
                waiting: format!("{what} on {}", stream.name()),
                after: timeout,
            });
        }
        wait.idle(timeout);
    }
    Ok(())
}

/// The host stream's handles start with this, then the pid: its memory is plain addresses.
const HOST_HANDLE: &[u8; 8] = b"RZHOSTMM";

/// A device's queue of work on addresses.
pub trait Stream: Send + Sync {
    /// Completes when the work queued before it has.
    type Marker: Send;

    /// The device, for messages (`cuda:0`, `host`).
    fn name(&self) -> String;

    /// The largest frame payload this device's ring edges should use when the configuration
    /// names none (`RINGZERO_DEVICE_SLICE_BYTES`); `None`: the host path's `slice_bytes`.
    fn slice_bytes(&self) -> Option<usize> {
        None
    }

    /// Whether the memory this stream's work touches stays valid until that work has ended,
    /// even once the caller has let go of it: true for CUDA, whose buffers synchronize their
    /// context before they are freed. False (the default) for host memory, which may be freed
    /// and handed out again the moment a call returns: there a call that fails waits for the
    /// work it queued to end before it returns, past its deadline if need be, so
    /// such a stream's work must always end by itself (it only touches memory, it never waits
    /// on another rank).
    fn memory_outlives_work(&self) -> bool {
        false
    }

    /// Queue `dst[..n] = a[..n] op b[..n]` (`Avg` combines as `Sum`). `dst` may equal `a`.
    ///
    /// # Safety
    /// The ranges must be device-addressable memory of `n` elements of `dtype`, live until the
    /// work completes, and `dst` must not partially overlap `a` or `b`.
    unsafe fn combine(
        &self,
        dtype: DType,
        op: ReduceOp,
        dst: DevPtr,
        a: DevPtr,
        b: DevPtr,
        n: usize,
    ) -> Result<(), DeviceError>;

    /// Queue `dst[..n] = also[..n] = a[..n] op b[..n]`: a step whose result is both kept and
    /// sent. By default a combine into `dst` and a copy of it to `also`; a device may do it in one
    /// pass, which saves reading the result back.
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
        // SAFETY: the caller's contract covers both calls' ranges.
        unsafe {
            self.combine(dtype, op, dst, a, b, n)?;
            self.copy(also, dst, n * dtype.size())
        }
    }

    /// Queue copies of `bytes` from `src` to `dst` and to `also`: a step that keeps what it
    /// forwards. By default two copies; a device may do it in one pass (one read of `src`).
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
        // SAFETY: the caller's contract covers both copies.
        unsafe {
            self.copy(dst, src, bytes)?;
            self.copy(also, src, bytes)
        }
    }

    /// Queue two unrelated copies as one piece of work: `a_bytes` from `a_src` to `a`, and
    /// `b_bytes` from `b_src` to `b` and, when given, to `b_also`. The ring queues a slice's last
    /// receive (a slot into the output) and the next slice's first send (a chunk into the next
    /// rank's slot) this way, so a link staged in host memory carries both directions at once
    /// instead of one after the other. By default the copies run one after the other; a device
    /// may do them in one pass.
    ///
    /// # Safety
    /// As for [`Stream::copy`], for every range; no written range overlaps any other.
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
        // SAFETY: the caller's contract covers every copy.
        unsafe {
            self.copy(a, a_src, a_bytes)?;
            match b_also {
                Some(also) => self.copy2(b, also, b_src, b_bytes),
                None => self.copy(b, b_src, b_bytes),
            }
        }
    }

    /// Queue `dst[..n] /= ranks`.
    ///
    /// # Safety
    /// As for [`Stream::combine`], one range.
    unsafe fn divide(
        &self,
        dtype: DType,
        dst: DevPtr,
        n: usize,
        ranks: usize,
    ) -> Result<(), DeviceError>;

    /// Queue `outs[j][..n] = ins[0][..n] op ins[1][..n] op … op ins[k-1][..n]` for every `j`:
    /// the inputs combined in order, rounded to `dtype` after each operation as
    /// [`Stream::combine`] rounds (`Avg` combines as `Sum`), divided by `ranks` when it is given,
    /// and the one result written to every output; with one input, a copy to every output. At
    /// most [`GATHER_MAX`] of each.
    ///
    /// # Safety
    /// Every range must be device-addressable memory of `n` elements of `dtype`, live until the
    /// work completes. An output may equal an input; otherwise no range that is written overlaps
    /// another range.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gather(
        &self,
        dtype: DType,
        op: ReduceOp,
        outs: &[DevPtr],
        ins: &[DevPtr],
        n: usize,
        ranks: Option<usize>,
    ) -> Result<(), DeviceError>;

    /// How another rank reaches the buffer at `addr`, or why it cannot (memory the device cannot
    /// export).
    fn share(&self, addr: DevPtr) -> Result<Share, DeviceError>;

    /// Queue a copy of `bytes` from `src` to `dst`.
    ///
    /// # Safety
    /// Both ranges live until the work completes; no overlap.
    unsafe fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), DeviceError>;

    /// Queue a copy of `bytes` from `src` to `dst` on copy lane `lane`: after what the lane
    /// holds and whatever was joined into it ([`Stream::lane_after_compute`]), beside the
    /// compute order, which does not wait for it unless joined ([`Stream::compute_after_lane`]).
    /// [`Stream::mark`] covers it. By default a lane is the compute order itself.
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
        let _ = lane;
        // SAFETY: forwarded from the caller.
        unsafe { self.copy(dst, src, bytes) }
    }

    /// Make work queued on `lane` from now on wait for everything queued in the compute order
    /// so far.
    fn lane_after_compute(&self, lane: CopyLane) -> Result<(), DeviceError> {
        let _ = lane;
        Ok(())
    }

    /// Make work queued in the compute order from now on wait for everything queued on `lane`
    /// so far.
    fn compute_after_lane(&self, lane: CopyLane) -> Result<(), DeviceError> {
        let _ = lane;
        Ok(())
    }

    /// A marker after everything queued so far, the copy lanes' work included.
    fn mark(&self) -> Result<Self::Marker, DeviceError>;

    /// Whether the work before `m` has completed (an error if any of it failed).
    fn done(&self, m: &Self::Marker) -> Result<bool, DeviceError>;

    /// Make `bytes` of host memory at `host` addressable by this device: its device address and
    /// an owner that undoes it on Drop.
    ///
    /// # Safety
    /// The range must stay mapped until the owner is dropped.
    unsafe fn map_host(
        &self,
        host: *mut u8,
        bytes: usize,
    ) -> Result<(DevPtr, Box<dyn Any + Send>), DeviceError>;

    /// `bytes` of private device memory (staging scratch): its address and its owner, which frees
    /// it on Drop.
    fn scratch(&self, bytes: usize) -> Result<(DevPtr, Box<dyn Any + Send>), DeviceError>;

    /// This device's identity across processes (a GPU's UUID), if it has one; devices with equal
    /// identities are the same device.
    fn identity(&self) -> Option<[u8; 16]>;

    /// Whether this device may access the device with identity `peer` directly, or why that
    /// cannot be known.
    fn can_access_peer(&self, peer: &[u8; 16]) -> Result<bool, String>;

    /// `bytes` of device memory another process can open ([`Stream::open_exported`]): its
    /// address, its 64-byte handle and its owner.
    fn export(&self, bytes: usize) -> Result<Exported, DeviceError>;

    /// Open memory another process exported: its address here and the mapping's owner.
    fn open_exported(
        &self,
        handle: &[u8; 64],
        bytes: usize,
    ) -> Result<(DevPtr, Box<dyn Any + Send>), DeviceError>;

    /// Wait for queued work, then copy from `src` into host bytes.
    ///
    /// # Safety
    /// `src..src + dst.len()` must be live device-addressable memory.
    unsafe fn read(&self, dst: &mut [u8], src: DevPtr) -> Result<(), DeviceError>;
}

type Job = Box<dyn FnOnce() -> Result<(), String> + Send>;

/// The host as an asynchronous device (see the module docs): a worker thread for the compute
/// order, and one per copy lane once a lane is used, so the engine's joins between them are
/// exercised for real (a missing one lets a lane's copy race the compute order's work).
pub struct HostStream {
    main: Worker,
    lanes: [std::sync::OnceLock<Worker>; 2],
    lane_dirty: [std::sync::atomic::AtomicBool; 2],
    error: Arc<Mutex<Option<String>>>,
}

/// One worker thread running jobs in the order queued.
struct Worker {
    jobs: Mutex<mpsc::Sender<Job>>,
    queued: AtomicU64,
    completed: Arc<AtomicU64>,
}

/// How long a join job waits for the other order's work (which is queued before it and always
/// ends: a panicking job counts as ended) before it fails the stream.
const JOIN_DEADLINE: std::time::Duration = std::time::Duration::from_secs(120);

impl Worker {
    fn spawn(name: &str, error: Arc<Mutex<Option<String>>>) -> Worker {
        let (tx, rx) = mpsc::channel::<Job>();
        let completed = Arc::new(AtomicU64::new(0));
        let done = completed.clone();
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                for job in rx {
                    // A panicking job is an error like any other: the worker goes on, so every
                    // queued job completes and no wait on a marker outlives its work.
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job))
                        .unwrap_or_else(|_| Err("a host stream job panicked".into()));
                    if let Err(e) = r {
                        error
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get_or_insert(e);
                    }
                    done.fetch_add(1, Ordering::Release);
                }
            })
            .expect("spawning a host stream worker thread");
        Worker {
            jobs: Mutex::new(tx),
            queued: AtomicU64::new(0),
            completed,
        }
    }

    fn push(&self, job: Job) -> Result<(), DeviceError> {
        self.queued.fetch_add(1, Ordering::Relaxed);
        self.jobs
            .lock()
            .unwrap()
            .send(job)
            .map_err(|_| DeviceError::Invalid("the host stream's worker has stopped".into()))
    }

    /// Queue on `self` a wait for everything queued on `other` so far.
    fn after(&self, other: &Worker) -> Result<(), DeviceError> {
        let (until, done) = (
            other.queued.load(Ordering::Relaxed),
            other.completed.clone(),
        );
        self.push(Box::new(move || {
            let join = crate::deadline::Deadline::after(std::time::Instant::now(), JOIN_DEADLINE);
            while done.load(Ordering::Acquire) < until {
                if join.passed(std::time::Instant::now()) {
                    return Err(format!(
                        "a join waited over {JOIN_DEADLINE:?} for the other order's work"
                    ));
                }
                std::thread::yield_now();
            }
            Ok(())
        }))
    }
}

impl HostStream {
    /// Start the worker thread.
    pub fn new() -> HostStream {
        let error = Arc::new(Mutex::new(None));
        HostStream {
            main: Worker::spawn("ringzero-host-stream", error.clone()),
            lanes: Default::default(),
            lane_dirty: Default::default(),
            error,
        }
    }

    /// Queue `f` (what the optimizer's work on this stream runs, `super::optim`).
    pub(super) fn push_job(
        &self,
        f: impl FnOnce() -> Result<(), String> + Send + 'static,
    ) -> Result<(), DeviceError> {
        self.push(Box::new(f))
    }

    fn push(&self, job: Job) -> Result<(), DeviceError> {
        self.main.push(job)
    }

    fn lane(&self, lane: CopyLane) -> &Worker {
        self.lanes[lane.index()].get_or_init(|| {
            let name = format!("ringzero-host-lane-{lane:?}").to_lowercase();
            Worker::spawn(&name, self.error.clone())
        })
    }
}

impl Default for HostStream {
    fn default() -> Self {
        HostStream::new()
    }
}

/// # Safety
/// `addr..addr + len` must be live, readable host memory for the returned lifetime.
unsafe fn bytes<'a>(addr: DevPtr, len: usize) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    // SAFETY: guaranteed by the caller.
    unsafe { std::slice::from_raw_parts(addr as usize as *const u8, len) }
}

/// # Safety
/// `addr..addr + len` must be live, writable host memory not otherwise borrowed.
unsafe fn bytes_mut<'a>(addr: DevPtr, len: usize) -> &'a mut [u8] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: guaranteed by the caller.
    unsafe { std::slice::from_raw_parts_mut(addr as usize as *mut u8, len) }
}

impl Stream for HostStream {
    type Marker = u64;

    fn name(&self) -> String {
        "host".into()
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
        let len = n * dtype.size();
        if len == 0 {
            return Ok(());
        }
        self.push(Box::new(move || {
            // SAFETY: the caller of `combine` keeps the ranges live until this job completes.
            // `dst` may equal `a`: then the kernel runs in place on `dst` (reduce_into), so no
            // shared and mutable view of the same bytes coexist.
            unsafe {
                if dst == a {
                    cpu::reduce_into(dtype, op.pairwise(), bytes_mut(dst, len), bytes(b, len))
                } else {
                    cpu::reduce_to(
                        dtype,
                        op.pairwise(),
                        bytes_mut(dst, len),
                        bytes(a, len),
                        bytes(b, len),
                    )
                }
            }
            .map_err(|e| e.to_string())
        }))
    }

    unsafe fn divide(
        &self,
        dtype: DType,
        dst: DevPtr,
        n: usize,
        ranks: usize,
    ) -> Result<(), DeviceError> {
        let len = n * dtype.size();
        if len == 0 {
            return Ok(());
        }
        self.push(Box::new(move || {
            // SAFETY: as for `combine`.
            cpu::divide(dtype, unsafe { bytes_mut(dst, len) }, ranks).map_err(|e| e.to_string())
        }))
    }

    unsafe fn copy(&self, dst: DevPtr, src: DevPtr, len: usize) -> Result<(), DeviceError> {
        if len == 0 {
            return Ok(());
        }
        self.push(Box::new(move || {
            // SAFETY: as for `combine`; the caller guarantees the ranges do not overlap.
            unsafe { bytes_mut(dst, len).copy_from_slice(bytes(src, len)) };
            Ok(())
        }))
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
        ringzero_kernels::device::check_gather(ins.len(), outs.len())?;
        let len = n * dtype.size();
        if len == 0 {
            return Ok(());
        }
        let (outs, ins) = (outs.to_vec(), ins.to_vec());
        self.push(Box::new(move || {
            // The result goes to scratch first: an output may be one of the inputs.
            // SAFETY: the caller of `gather` keeps every range live until this job completes.
            let mut acc = unsafe { bytes(ins[0], len) }.to_vec();
            for &b in &ins[1..] {
                // SAFETY: as above.
                cpu::reduce_into(dtype, op.pairwise(), &mut acc, unsafe { bytes(b, len) })
                    .map_err(|e| e.to_string())?;
            }
            if let Some(r) = ranks {
                cpu::divide(dtype, &mut acc, r).map_err(|e| e.to_string())?;
            }
            for &o in &outs {
                // SAFETY: as above; `acc` is this job's own memory.
                unsafe { bytes_mut(o, len) }.copy_from_slice(&acc);
            }
            Ok(())
        }))
    }

    /// Host memory is shared as its address, with this process's pid: only ranks of this
    /// process (threads) can open it.
    fn share(&self, addr: DevPtr) -> Result<Share, DeviceError> {
        let mut handle = [0u8; 64];
        handle[..8].copy_from_slice(HOST_HANDLE);
        handle[8..12].copy_from_slice(&std::process::id().to_le_bytes());
        Ok(Share {
            handle,
            offset: addr,
            bytes: 0,
            id: 0,
        })
    }

    unsafe fn copy_on(
        &self,
        lane: CopyLane,
        dst: DevPtr,
        src: DevPtr,
        len: usize,
    ) -> Result<(), DeviceError> {
        if len == 0 {
            return Ok(());
        }
        self.lane_dirty[lane.index()].store(true, Ordering::Release);
        self.lane(lane).push(Box::new(move || {
            // SAFETY: as for `copy`.
            unsafe { bytes_mut(dst, len).copy_from_slice(bytes(src, len)) };
            Ok(())
        }))
    }

    fn lane_after_compute(&self, lane: CopyLane) -> Result<(), DeviceError> {
        self.lane(lane).after(&self.main)
    }

    fn compute_after_lane(&self, lane: CopyLane) -> Result<(), DeviceError> {
        self.lane_dirty[lane.index()].store(false, Ordering::Release);
        self.main.after(self.lane(lane))
    }

    fn mark(&self) -> Result<u64, DeviceError> {
        for lane in CopyLane::BOTH {
            if self.lane_dirty[lane.index()].load(Ordering::Acquire) {
                self.compute_after_lane(lane)?;
            }
        }
        Ok(self.main.queued.load(Ordering::Relaxed))
    }

    fn done(&self, m: &u64) -> Result<bool, DeviceError> {
        // Not done while work before the marker still runs, even after a failure: callers wait
        // for completion before they free what that work touches.
        if self.main.completed.load(Ordering::Acquire) < *m {
            return Ok(false);
        }
        if let Some(e) = self.error.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            return Err(DeviceError::Invalid(format!("host stream: {e}")));
        }
        Ok(true)
    }

    unsafe fn map_host(
        &self,
        host: *mut u8,
        _bytes: usize,
    ) -> Result<(DevPtr, Box<dyn Any + Send>), DeviceError> {
        Ok((host as usize as DevPtr, Box::new(())))
    }

    fn scratch(&self, bytes: usize) -> Result<(DevPtr, Box<dyn Any + Send>), DeviceError> {
        /// One cache line, so the scratch is aligned for every dtype.
        #[derive(Clone, Copy)]
        #[repr(C, align(64))]
        struct Line([u8; 64]);
        let mem = vec![Line([0; 64]); bytes.div_ceil(64).max(1)].into_boxed_slice();
        // Moving the box into the owner does not move its heap allocation.
        Ok((mem.as_ptr() as usize as DevPtr, Box::new(mem)))
    }

    fn identity(&self) -> Option<[u8; 16]> {
        None
    }

    fn can_access_peer(&self, _peer: &[u8; 16]) -> Result<bool, String> {
        Err("host buffers have no peer device".into())
    }

    fn export(&self, _bytes: usize) -> Result<Exported, DeviceError> {
        Err(DeviceError::Invalid(
            "host buffers cannot be exported over CUDA IPC".into(),
        ))
    }

    /// Opens what [`Stream::share`] gave in this process (base 0: the offset is the address).
    fn open_exported(
        &self,
        handle: &[u8; 64],
        _bytes: usize,
    ) -> Result<(DevPtr, Box<dyn Any + Send>), DeviceError> {
        if &handle[..8] != HOST_HANDLE {
            return Err(DeviceError::Invalid(
                "host buffers cannot open CUDA IPC memory".into(),
            ));
        }
        let pid = u32::from_le_bytes(handle[8..12].try_into().expect("4 bytes"));
        if pid != std::process::id() {
            return Err(DeviceError::Invalid(format!(
                "host-stream memory of process {pid} cannot be opened in process {}: only ranks \
                 of one process share host buffers",
                std::process::id()
            )));
        }
        Ok((0, Box::new(())))
    }

    unsafe fn read(&self, dst: &mut [u8], src: DevPtr) -> Result<(), DeviceError> {
        let m = self.mark()?;
        // Bounded: the queue holds only copies and reductions of finite size, which never wait
        // on anything (a failed job still counts as completed). Back off as the engine does, so
        // a long queue does not cost a spinning core.
        let mut waiter = crate::transport::wait::Waiter::backoff();
        while !self.done(&m)? {
            waiter.idle(std::time::Duration::from_millis(1));
        }
        // SAFETY: the caller guarantees the source range.
        dst.copy_from_slice(unsafe { bytes(src, dst.len()) });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panicking_job_fails_the_stream_and_later_waits_still_end() {
        let s = HostStream::new();
        s.push(Box::new(|| panic!("on purpose"))).unwrap();
        let src = [7u8; 16];
        let mut dst = [0u8; 16];
        // SAFETY: `src` is live host memory of `dst.len()` bytes.
        let r = unsafe { s.read(&mut dst, src.as_ptr() as usize as DevPtr) };
        let e = r.expect_err("the panic is reported").to_string();
        assert!(e.contains("panicked"), "{e}");
        // The worker survived: later work completes (and the stream stays failed).
        s.push(Box::new(|| Ok(()))).unwrap();
        let m = s.mark().unwrap();
        let start = std::time::Instant::now();
        while s.done(&m).is_ok() {
            assert!(
                start.elapsed() < std::time::Duration::from_secs(10),
                "never completed"
            );
            std::thread::yield_now();
        }
    }

    /// Wait for `m` (at most 10 s).
    fn wait(s: &HostStream, m: &u64) {
        let start = std::time::Instant::now();
        while !s.done(m).unwrap() {
            assert!(
                start.elapsed() < std::time::Duration::from_secs(10),
                "never completed"
            );
            std::thread::yield_now();
        }
    }

    #[test]
    fn copy_lanes_run_apart_and_a_marker_or_a_join_covers_them() {
        let s = HostStream::new();
        let len = 64 << 20;
        let src = vec![5u8; len];
        let mut a = vec![0u8; len];
        let mut b = vec![0u8; len];
        let (src_at, a_at, b_at) = (
            src.as_ptr() as usize as DevPtr,
            a.as_mut_ptr() as usize as DevPtr,
            b.as_mut_ptr() as usize as DevPtr,
        );
        // A long copy on the in lane: the compute order does not wait for it by itself.
        // SAFETY: all three vectors outlive the waits below, which cover the copies.
        unsafe { s.copy_on(CopyLane::In, a_at, src_at, len) }.unwrap();
        // The out lane copies what the in lane wrote only once joined through the compute order.
        s.compute_after_lane(CopyLane::In).unwrap();
        s.lane_after_compute(CopyLane::Out).unwrap();
        // SAFETY: as above.
        unsafe { s.copy_on(CopyLane::Out, b_at, a_at, len) }.unwrap();
        // The marker joins the dirty out lane first: once done, both copies are.
        let m = s.mark().unwrap();
        wait(&s, &m);
        assert!(a.iter().all(|&x| x == 5), "the in lane's copy");
        assert!(
            b.iter().all(|&x| x == 5),
            "the out lane's copy, after the in lane's"
        );
    }
}
