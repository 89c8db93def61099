//! [`HostStream`]: the host as an asynchronous device (see [`super::Stream`]).

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use super::held::{Allocated, Held};
use super::{CopyLane, DevPtr, DeviceError, Exported, ShareRecord, Stream};
use crate::{cpu, DType, ReduceOp};

/// The host stream's handles start with this, then the pid: its memory is plain addresses.
const HOST_HANDLE: &[u8; 8] = b"RZHOSTMM";

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
            let start = std::time::Instant::now();
            while done.load(Ordering::Acquire) < until {
                if start.elapsed() >= JOIN_DEADLINE {
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

    /// Wait for the work queued so far. Bounded: the queue holds only copies and reductions of
    /// finite size, which never wait on anything (a failed job still counts as completed). It
    /// yields at first, then sleeps in doubling steps up to a millisecond, so that a long queue
    /// does not cost a spinning core.
    pub(crate) fn finish(&self) -> Result<(), DeviceError> {
        let m = self.mark()?;
        let mut nap = std::time::Duration::from_micros(2);
        for polls in 0u32.. {
            if self.done(&m)? {
                return Ok(());
            }
            if polls < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(nap);
                nap = (nap * 2).min(std::time::Duration::from_millis(1));
            }
        }
        unreachable!("the loop returns once the work is done")
    }

    /// Queue `f` (what the optimizer's work on this stream runs, [`super::TrainStream`]).
    pub(crate) fn push_job(
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
        super::check_gather(ins.len(), outs.len())?;
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
    fn share(&self, addr: DevPtr) -> Result<ShareRecord, DeviceError> {
        let mut handle = [0u8; 64];
        handle[..8].copy_from_slice(HOST_HANDLE);
        handle[8..12].copy_from_slice(&std::process::id().to_le_bytes());
        Ok(ShareRecord {
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
        let mem = Scratch::new(bytes);
        // Moving the box into the owner does not move its heap allocation.
        Ok((mem.0.as_ptr() as usize as DevPtr, Box::new(mem)))
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
        self.finish()?;
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

/// One cache line, so the scratch is aligned for every dtype.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// The host stream's scratch ([`Stream::scratch`]: its "device" memory), counted while it
/// lives ([`host_scratch`]).
struct Scratch(Box<[Line]>);

impl Scratch {
    /// Zeroed lines for `bytes` (at least one line).
    fn new(bytes: usize) -> Scratch {
        let s = Scratch(vec![Line([0; 64]); bytes.div_ceil(64).max(1)].into_boxed_slice());
        SCRATCH.add(s.bytes());
        s
    }

    fn bytes(&self) -> usize {
        std::mem::size_of_val(&*self.0)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        SCRATCH.sub(self.bytes());
    }
}

static SCRATCH: Held = Held::new();

/// What the host streams' scratch in this process holds now and at most since
/// [`reset_host_scratch_peak`]: on the host stream, the memory a ZeRO engine's device buffers
/// and a device communicator's scratch take (the host stream's counterpart of
/// `cuda::allocated`).
pub fn host_scratch() -> Allocated {
    SCRATCH.read()
}

/// Start [`host_scratch`]'s peak again from what is held now.
pub fn reset_host_scratch_peak() {
    SCRATCH.restart();
}
