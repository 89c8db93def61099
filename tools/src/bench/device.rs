//! The sweep on device buffers (`ringzero bench --device cuda`, or `host-stream`: the device engine
//! with the host as its device). Same rows, same `#wrong` check on exact inputs, same timing rule
//! (mean over ranks of each rank's mean), through [`DeviceComm`] instead of the host
//! communicator. Device collectives return once their work has completed, so host wall time is
//! the call's time.
//!
//! Every collective runs on device buffers, out of place and in place, as on the host.
//! The α–β columns stay empty: the model is measured on the host links, not on device copies.

use std::sync::Arc;

use ringzero_collectives::{
    Collective, Collectives, Communicator, DType, DeviceComm, DeviceMemory, HostStream, InPlace,
    ReduceOp, Result, Stream,
};
use ringzero_kernels::device::cuda::raw::HostRegistration;
use ringzero_kernels::device::cuda::{DeviceBuffer, Gpu};
use serde::{Deserialize, Serialize};

use super::exact::{self, decode, encode, value};
use super::sweep::{row, timed, wrong, Row, SweepArgs};
use super::theory::Algo;

/// A stream the bench can make and read buffers on.
pub trait BenchDev: Stream + Sized {
    /// An owned buffer of it.
    type Buf: DeviceMemory<Self>;
    /// A buffer holding `vals` as `dtype`.
    fn make(&self, dtype: DType, vals: &[f64]) -> std::result::Result<Self::Buf, String>;
    /// A buffer of `elems` elements of `dtype`, to be written before it is read (zeros unless
    /// the device allocates faster without).
    fn zeros(&self, dtype: DType, elems: usize) -> std::result::Result<Self::Buf, String> {
        self.make(dtype, &vec![0.0; elems])
    }
    /// Its contents.
    fn contents(&self, b: &Self::Buf) -> std::result::Result<Vec<f64>, String>;
    /// Copy rates measured now on `bytes` (see [`Baseline`]); the pinned host↔device ones too
    /// when `staged`, where the device has such copies.
    fn baseline(&self, bytes: usize, staged: bool) -> std::result::Result<Baseline, String>;
}

/// What the device's memory and its link to the host move, measured by one rank alone: the
/// yardsticks device collectives are set against (`ringzero bench --device`, `gpu-check`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Baseline {
    /// Bytes per copy.
    pub bytes: usize,
    /// A copy within the device's memory, GB/s counted as bytes read plus bytes written.
    pub copy_gbs: f64,
    /// A pinned host→device copy alone, GB/s (GPUs, when asked for).
    pub pinned_gbs: Option<f64>,
    /// Each direction's rate while a pinned host→device and a device→host copy run at once,
    /// GB/s (GPUs, when asked for): what host staging gets, every rank sending and receiving.
    pub both_ways_gbs: Option<f64>,
    /// The same two as one kernel on the mapped host memory (`copy_pair`, each direction's
    /// rate), GB/s: what mapped staging's kernels can get, beside the copy engines' figure
    /// above (GPUs, when asked for).
    #[serde(default)]
    pub kernel_both_ways_gbs: Option<f64>,
}

/// Copies timed for a baseline (after one untimed).
const BASELINE_REPS: usize = 5;

/// Timings of `BASELINE_REPS` copies each, of which a baseline keeps the fastest.
const BASELINE_ROUNDS: usize = 3;

/// The fastest of [`BASELINE_ROUNDS`] timings (milliseconds). A yardstick is what the hardware
/// can do, and noise only slows it: single timings of one link vary by several percent within a
/// session, and every row's share of the yardstick would move with them.
fn fastest<E>(mut time: impl FnMut() -> Result<f64, E>) -> Result<f64, E> {
    let mut best = f64::INFINITY;
    for _ in 0..BASELINE_ROUNDS {
        best = best.min(time()?);
    }
    Ok(best)
}

/// Host memory for the host stream: 8-byte aligned, typed by `dtype`.
pub struct HostBuf {
    words: Vec<u64>,
    dtype: DType,
    elems: usize,
}

// SAFETY: `words` holds at least `elems × dtype.size()` bytes (see `make`), owned by the HostBuf
// and not reallocated while it is borrowed; the host stream addresses host memory directly.
unsafe impl DeviceMemory<HostStream> for HostBuf {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn elems(&self) -> usize {
        self.elems
    }
    fn addr(&self, _: &HostStream) -> u64 {
        self.words.as_ptr() as usize as u64
    }
    fn addr_mut(&mut self, _: &HostStream) -> u64 {
        self.words.as_mut_ptr() as usize as u64
    }
}

impl BenchDev for HostStream {
    type Buf = HostBuf;
    fn baseline(&self, bytes: usize, _staged: bool) -> std::result::Result<Baseline, String> {
        let (src, mut dst) = (vec![1u8; bytes], vec![0u8; bytes]);
        dst.copy_from_slice(&src);
        let ms = fastest(|| {
            let t = std::time::Instant::now();
            for _ in 0..BASELINE_REPS {
                dst.copy_from_slice(std::hint::black_box(&src));
            }
            std::hint::black_box(&dst);
            Ok::<_, String>(t.elapsed().as_secs_f64() * 1e3 / BASELINE_REPS as f64)
        })?;
        Ok(Baseline {
            bytes,
            copy_gbs: 2.0 * bytes as f64 / (ms * 1e-3) / 1e9,
            pinned_gbs: None,
            both_ways_gbs: None,
            kernel_both_ways_gbs: None,
        })
    }
    fn make(&self, dtype: DType, vals: &[f64]) -> std::result::Result<HostBuf, String> {
        let bytes = encode(dtype, vals);
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes.len()].copy_from_slice(&bytes);
        Ok(HostBuf {
            words,
            dtype,
            elems: vals.len(),
        })
    }
    fn contents(&self, b: &HostBuf) -> std::result::Result<Vec<f64>, String> {
        let n = b.elems * b.dtype.size();
        Ok(decode(
            b.dtype,
            &bytemuck::cast_slice::<u64, u8>(&b.words)[..n],
        ))
    }
}

impl BenchDev for Arc<Gpu> {
    type Buf = DeviceBuffer;
    fn baseline(&self, bytes: usize, staged: bool) -> std::result::Result<Baseline, String> {
        // The CUDA device's own methods (the `Stream` trait has a `copy` of its own).
        let gpu: &Arc<Gpu> = self;
        let e = |x: ringzero_kernels::device::DeviceError| x.to_string();
        let gbs = |b: usize, ms: f64| b as f64 / (ms * 1e-3) / 1e9;
        let elems = bytes / 4;
        let bytes = elems * 4;
        let src = gpu.alloc(DType::F32, elems).map_err(e)?;
        let mut dst = gpu.alloc(DType::F32, elems).map_err(e)?;
        let ms =
            fastest(|| gpu.time(BASELINE_REPS, || Gpu::copy(gpu, &mut dst, &src))).map_err(e)?;
        let mut b = Baseline {
            bytes,
            copy_gbs: gbs(2 * bytes, ms),
            pinned_gbs: None,
            both_ways_gbs: None,
            kernel_both_ways_gbs: None,
        };
        if staged {
            let (mut host, mut back) = (vec![0u8; bytes], vec![0u8; bytes]);
            // SAFETY: `host` and `back` outlive their registrations (dropped at the end of this
            // block, before them).
            let reg =
                unsafe { HostRegistration::new(self, host.as_mut_ptr(), bytes) }.map_err(e)?;
            let reg2 =
                unsafe { HostRegistration::new(self, back.as_mut_ptr(), bytes) }.map_err(e)?;
            let hp = reg.device_ptr(host.as_ptr()).map_err(e)?;
            let hp2 = reg2.device_ptr(back.as_ptr()).map_err(e)?;
            let (dp, dp2) = (gpu.ptr_of(&dst), gpu.ptr_of(&src));
            // SAFETY: both ranges are live for `bytes` bytes until the timing's final sync.
            let ms = fastest(|| {
                gpu.time(BASELINE_REPS, || unsafe {
                    Stream::copy(gpu, dp, hp, bytes)
                })
            })
            .map_err(e)?;
            // SAFETY: four distinct live ranges of `bytes`; the call drains both streams.
            let ms2 =
                fastest(|| unsafe { gpu.time_both_ways(dp, hp, hp2, dp2, bytes, BASELINE_REPS) })
                    .map_err(e)?;
            // SAFETY: as above; the two copies' ranges are distinct, and the timing syncs.
            let ms3 = fastest(|| {
                gpu.time(BASELINE_REPS, || unsafe {
                    Stream::copy_pair(gpu, dp, hp, bytes, hp2, None, dp2, bytes)
                })
            })
            .map_err(e)?;
            drop((reg, reg2));
            b.pinned_gbs = Some(gbs(bytes, ms));
            b.both_ways_gbs = Some(gbs(bytes, ms2));
            b.kernel_both_ways_gbs = Some(gbs(bytes, ms3));
        }
        Ok(b)
    }
    fn zeros(&self, dtype: DType, elems: usize) -> std::result::Result<DeviceBuffer, String> {
        self.alloc(dtype, elems).map_err(|e| e.to_string())
    }
    fn make(&self, dtype: DType, vals: &[f64]) -> std::result::Result<DeviceBuffer, String> {
        self.upload(dtype, &encode(dtype, vals))
            .map_err(|e| e.to_string())
    }
    fn contents(&self, b: &DeviceBuffer) -> std::result::Result<Vec<f64>, String> {
        let mut bytes = vec![0u8; b.bytes()];
        self.download(b, &mut bytes).map_err(|e| e.to_string())?;
        Ok(decode(b.dtype(), &bytes))
    }
}

fn dev_err(what: &str, e: String) -> ringzero_collectives::Error {
    ringzero_collectives::Error::Io {
        context: format!("bench on device buffers: {what}"),
        detail: e,
    }
}

/// One call; in place it works on `send` (all-gather: on `recv`), as the host sweep does.
fn call<D: BenchDev>(
    dc: &DeviceComm<D>,
    op: Collective,
    redop: ReduceOp,
    inplace: bool,
    send: &mut D::Buf,
    recv: &mut D::Buf,
) -> Result<()> {
    match (op, inplace) {
        (Collective::AllReduce, false) => dc.all_reduce(send, recv, redop),
        (Collective::AllReduce, true) => dc.all_reduce(InPlace, send, redop),
        (Collective::ReduceScatter, false) => dc.reduce_scatter(send, recv, redop),
        (Collective::ReduceScatter, true) => dc.reduce_scatter(InPlace, send, redop),
        (Collective::AllGather, false) => dc.all_gather(send, recv),
        (Collective::AllGather, true) => dc.all_gather(InPlace, recv),
        (Collective::Broadcast { root }, false) => dc.broadcast(send, recv, root),
        (Collective::Broadcast { root }, true) => dc.broadcast(InPlace, send, root),
        (Collective::Reduce { root }, false) => dc.reduce(send, recv, redop, root),
        (Collective::Reduce { root }, true) => dc.reduce(InPlace, send, redop, root),
        (Collective::Barrier, _) => dc.barrier(),
        (Collective::RingShift, false) => dc.ring_shift(send, recv),
        (Collective::RingShift, true) => dc.ring_shift(InPlace, send),
        (Collective::ReduceScatterV, false) => {
            let counts = super::sweep::balanced(dc.size(), send.elems());
            dc.reduce_scatter_v(send, recv, &counts, redop)
        }
        (Collective::ReduceScatterV, true) => {
            let counts = super::sweep::balanced(dc.size(), send.elems());
            dc.reduce_scatter_v(InPlace, send, &counts, redop)
        }
        (Collective::AllGatherV, false) => {
            let counts = super::sweep::balanced(dc.size(), recv.elems());
            dc.all_gather_v(send, recv, &counts)
        }
        (Collective::AllGatherV, true) => {
            let counts = super::sweep::balanced(dc.size(), recv.elems());
            dc.all_gather_v(InPlace, recv, &counts)
        }
        (Collective::AllToAll, false) => dc.all_to_all(send, recv),
        (Collective::AllToAllV, false) => {
            let counts = vec![send.elems() / dc.size(); dc.size()];
            dc.all_to_all_v(send, &counts, recv, &counts)
        }
        (Collective::SendRecv, false) => match exact::partner(dc.rank(), dc.size()) {
            None => Ok(()),
            Some(peer) => dc.send_recv(send, recv, peer),
        },
        (Collective::AllToAll, true) => dc.all_to_all(InPlace, send),
        (Collective::Gather { root }, false) => dc.gather(send, recv, root),
        (Collective::Scatter { root }, false) => dc.scatter(send, recv, root),
        (
            Collective::SendRecv
            | Collective::AllToAllV
            | Collective::Gather { .. }
            | Collective::Scatter { .. },
            true,
        ) => Err(ringzero_collectives::Error::InvalidArgument {
            op: op.name().into(),
            msg: format!("{} has no in-place form", op.name()),
        }),
    }
}

/// The ring's slowest edge, GB/s: every rank shifts `count` elements of `dtype` to the next
/// rank through `dc` at once (in place or not, so the working set matches the rows it is set
/// against), timed as the rows are (`warmup` untimed calls, then `iters` after a barrier), the
/// slowest rank's mean time counting. What bounds ring collectives whose ranks do not share one device
/// (or whose edges include tcp): [`super::theory::DeviceLimit::Links`].
pub fn ring_links<D: BenchDev>(
    comm: &Communicator,
    dc: &DeviceComm<D>,
    (dtype, count): (DType, usize),
    inplace: bool,
    (warmup, iters): (usize, usize),
) -> Result<f64> {
    let (count, iters) = (count.max(1), iters.max(1));
    let recv_len = if inplace { 0 } else { count };
    let (mut send, mut recv) = buffers(dc, dtype, (vec![1.0; count], vec![0.0; recv_len]))?;
    let shift = |send: &mut D::Buf, recv: &mut D::Buf| {
        if inplace {
            dc.ring_shift(InPlace, send)
        } else {
            dc.ring_shift(send, recv)
        }
    };
    for _ in 0..warmup {
        shift(&mut send, &mut recv)?;
    }
    comm.barrier()?;
    let t = std::time::Instant::now();
    for _ in 0..iters {
        shift(&mut send, &mut recv)?;
    }
    let mut slowest = [t.elapsed().as_secs_f64() / iters as f64];
    comm.all_reduce(InPlace, &mut slowest, ReduceOp::Max)?;
    Ok((count * dtype.size()) as f64 / slowest[0] / 1e9)
}

/// Buffers holding `send` and `recv` as `dtype`.
fn buffers<D: BenchDev>(
    dc: &DeviceComm<D>,
    dtype: DType,
    (send, recv): (Vec<f64>, Vec<f64>),
) -> Result<(D::Buf, D::Buf)> {
    let s = dc.stream();
    Ok((
        s.make(dtype, &send).map_err(|e| dev_err("input", e))?,
        s.make(dtype, &recv).map_err(|e| dev_err("output", e))?,
    ))
}

/// One call of `op` on exact inputs ([`exact::inputs`]): what this rank's result holds and what
/// it must hold, or `None` where it holds nothing to check (barrier, reduce off the root).
pub fn exact_result<D: BenchDev>(
    dc: &DeviceComm<D>,
    op: Collective,
    inplace: bool,
    count: usize,
    (dt, redop, seed): (DType, ReduceOp, usize),
) -> Result<Option<(Vec<f64>, Vec<f64>)>> {
    let (r, n) = (dc.rank(), dc.size());
    let count = exact::round_count(op, n, count);
    let mine = |i: usize| value(dt, redop, r, i, seed);
    let vals = exact::inputs(op, inplace, n, r, count, mine);
    let (mut send, mut recv) = buffers(dc, dt, vals)?;
    call(dc, op, redop, inplace, &mut send, &mut recv)?;
    let Some((lands, range, want)) = exact::landing(op, inplace, n, r, count, (dt, redop, seed))
    else {
        return Ok(None);
    };
    let buf = match lands {
        exact::Lands::Send => &send,
        exact::Lands::Recv => &recv,
    };
    let all = dc
        .stream()
        .contents(buf)
        .map_err(|e| dev_err("result", e))?;
    Ok(Some((all[range].to_vec(), want)))
}

/// One untimed call on exact inputs: how many elements of this rank's result are wrong.
fn check<D: BenchDev>(
    dc: &DeviceComm<D>,
    op: Collective,
    a: &SweepArgs,
    count: usize,
    inplace: bool,
) -> Result<u64> {
    let r = dc.rank();
    Ok(
        match exact_result(dc, op, inplace, count, (a.dtype, a.redop, count % 97))? {
            Some((mut got, want)) => wrong(a, r, &mut got, &want),
            None => 0,
        },
    )
}

/// Sweep `op` over `a.sizes` on device buffers; every rank returns the same rows.
pub fn sweep<D: BenchDev>(
    comm: &Communicator,
    dc: &DeviceComm<D>,
    op: Collective,
    a: &SweepArgs,
    transport: &str,
    tick: &mut dyn FnMut(),
) -> Result<Vec<Row>> {
    let n = comm.size();
    let es = a.dtype.size();
    let mut rows = Vec::new();
    for &size in &a.sizes {
        let count = exact::round_count(op, n, size / es);
        let bytes = count * es;
        // Send-recv, all-to-all-v, gather and scatter have no in-place form (their in-place
        // lines read n/a, as on host buffers).
        let ways: &[bool] = if matches!(
            op,
            Collective::SendRecv
                | Collective::AllToAllV
                | Collective::Gather { .. }
                | Collective::Scatter { .. }
        ) {
            &[false]
        } else {
            &[false, true]
        };
        for &inplace in ways {
            let wrong = check(dc, op, a, count, inplace)?;
            let (in_len, out_len) = exact::lens(op, n, comm.rank(), count);
            let (mut send, mut recv) =
                buffers(dc, a.dtype, (vec![1.0; in_len], vec![0.0; out_len]))?;
            let (time_us, wrong) = timed(comm, a, wrong, || {
                call(dc, op, a.redop, inplace, &mut send, &mut recv)
            })?;
            // Device buffers take the ring (or the direct step, which the row does not tell
            // apart), but for the collectives that always run pairwise.
            let algo = if op.is_pairwise() {
                Algo::Pairwise
            } else {
                Algo::Ring
            };
            rows.push(row(
                (op, algo),
                a,
                &[n],
                bytes,
                count,
                transport,
                time_us,
                wrong,
                inplace,
                None,
            ));
        }
        tick();
    }
    Ok(rows)
}
