//! The sweep on device buffers (`ringzero bench --device cuda`, or `host-stream`: the device engine
//! with the host as its device). Same rows, same `#wrong` check on exact inputs, same timing rule
//! (mean over ranks of each rank's mean), through [`DeviceComm`] instead of the host
//! communicator. Device collectives return once their work has completed, so host wall time is
//! the call's time.
//!
//! Device buffers support all-reduce (out of place and in place), reduce-scatter and all-gather
//! (out of place) and broadcast (in place); other variants are left out of the sweep and said so.
//! The α–β columns stay empty: the model is measured on the host links, not on device copies.

use std::sync::Arc;

use ringzero_collectives::{
    chunk, Collective, Communicator, DType, DeviceComm, DeviceMemory, HostStream, ReduceOp, Result,
    Stream,
};
use ringzero_kernels::device::cuda::{DeviceBuffer, Gpu};

use super::exact::{decode, encode, reference, value};
use super::sweep::{row, timed, Row, SweepArgs};

/// A stream the bench can make and read buffers on.
pub trait BenchDev: Stream + Sized {
    /// An owned buffer of it.
    type Buf: DeviceMemory<Self>;
    /// A buffer holding `vals` as `dtype`.
    fn make(&self, dtype: DType, vals: &[f64]) -> std::result::Result<Self::Buf, String>;
    /// Its contents.
    fn contents(&self, b: &Self::Buf) -> std::result::Result<Vec<f64>, String>;
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

/// Whether device buffers support `op` in this variant.
pub fn supports(op: Collective, inplace: bool) -> bool {
    matches!(
        (op, inplace),
        (Collective::AllReduce, _)
            | (Collective::ReduceScatter, false)
            | (Collective::AllGather, false)
            | (Collective::Broadcast { .. }, true)
    )
}

fn dev_err(what: &str, e: String) -> ringzero_collectives::Error {
    ringzero_collectives::Error::Io {
        context: format!("bench on device buffers: {what}"),
        detail: e,
    }
}

/// One call; `send` holds the input (and the result in place), `recv` the output.
fn call<D: BenchDev>(
    dc: &mut DeviceComm<D>,
    op: Collective,
    redop: ReduceOp,
    inplace: bool,
    send: &mut D::Buf,
    recv: &mut D::Buf,
) -> Result<()> {
    match (op, inplace) {
        (Collective::AllReduce, false) => dc.all_reduce(send, recv, redop),
        (Collective::AllReduce, true) => dc.all_reduce_in_place(send, redop),
        (Collective::ReduceScatter, false) => dc.reduce_scatter(send, recv, redop),
        (Collective::AllGather, false) => dc.all_gather(send, recv),
        (Collective::Broadcast { root }, true) => dc.broadcast_in_place(send, root),
        (op, inplace) => Err(ringzero_collectives::Error::InvalidArgument {
            op: op.name().into(),
            msg: format!(
                "{} on device buffers is not supported",
                if inplace { "in place" } else { "out of place" }
            ),
        }),
    }
}

/// Input and output lengths of `op` with `count` elements on this rank.
fn lens(op: Collective, n: usize, rank: usize, count: usize) -> (usize, usize) {
    let own = chunk(count, n, rank).len();
    match op {
        Collective::ReduceScatter => (count, own),
        Collective::AllGather => (own, count),
        _ => (count, count),
    }
}

/// One untimed call on exact inputs: how many elements of this rank's result are wrong.
fn check<D: BenchDev>(
    dc: &mut DeviceComm<D>,
    op: Collective,
    a: &SweepArgs,
    count: usize,
    inplace: bool,
) -> Result<u64> {
    let (r, n) = (dc.rank(), dc.size());
    let (dt, redop, seed) = (a.dtype, a.redop, count % 97);
    let input = |rank: usize, i: usize| value(dt, redop, rank, i, seed);
    let own = chunk(count, n, r);
    let mine: Vec<f64> = (0..count).map(|i| input(r, i)).collect();
    let (_, out_len) = lens(op, n, r, count);
    let send_vals = if op == Collective::AllGather {
        mine[own.clone()].to_vec()
    } else {
        mine
    };
    let mut send = dc
        .stream()
        .make(dt, &send_vals)
        .map_err(|e| dev_err("input", e))?;
    let mut recv = dc
        .stream()
        .make(dt, &vec![99.0; out_len])
        .map_err(|e| dev_err("output", e))?;
    call(dc, op, redop, inplace, &mut send, &mut recv)?;
    let s = dc.stream();
    let red = |i: usize| reference(dt, redop, n, i, seed);
    let (got, want): (Vec<f64>, Vec<f64>) = match op {
        Collective::AllReduce => (
            s.contents(if inplace { &send } else { &recv })
                .map_err(|e| dev_err("result", e))?,
            (0..count).map(red).collect(),
        ),
        Collective::ReduceScatter => (
            s.contents(&recv).map_err(|e| dev_err("result", e))?,
            own.map(red).collect(),
        ),
        Collective::AllGather => {
            let owner = |i: usize| {
                (0..n)
                    .find(|q| chunk(count, n, *q).contains(&i))
                    .unwrap_or(0)
            };
            (
                s.contents(&recv).map_err(|e| dev_err("result", e))?,
                (0..count).map(|i| input(owner(i), i)).collect(),
            )
        }
        Collective::Broadcast { root } => (
            s.contents(&send).map_err(|e| dev_err("result", e))?,
            (0..count).map(|i| input(root, i)).collect(),
        ),
        _ => (Vec::new(), Vec::new()),
    };
    let mut got = got;
    if a.corrupt_rank == Some(r) {
        if let Some(x) = got.first_mut() {
            *x += 1.0;
        }
    }
    Ok(got
        .iter()
        .zip(&want)
        .filter(|(g, w)| **g != **w && !(g.is_nan() && w.is_nan()))
        .count() as u64)
}

/// Sweep `op` over `a.sizes` on device buffers; every rank returns the same rows.
pub fn sweep<D: BenchDev>(
    comm: &Communicator,
    dc: &mut DeviceComm<D>,
    op: Collective,
    a: &SweepArgs,
    transport: &str,
    tick: &mut dyn FnMut(),
) -> Result<Vec<Row>> {
    let n = comm.size();
    let es = a.dtype.size();
    let mut rows = Vec::new();
    for &size in &a.sizes {
        let count = size / es;
        let bytes = count * es;
        for inplace in [false, true] {
            if !supports(op, inplace) {
                continue;
            }
            let wrong = check(dc, op, a, count, inplace)?;
            let (in_len, out_len) = lens(op, n, comm.rank(), count);
            let mut send = dc
                .stream()
                .make(a.dtype, &vec![1.0; in_len])
                .map_err(|e| dev_err("input", e))?;
            let mut recv = dc
                .stream()
                .make(a.dtype, &vec![0.0; out_len])
                .map_err(|e| dev_err("output", e))?;
            let (time_us, wrong) = timed(comm, a, wrong, || {
                call(dc, op, a.redop, inplace, &mut send, &mut recv)
            })?;
            rows.push(row(
                op, a, n, bytes, count, transport, time_us, wrong, inplace, None,
            ));
        }
        tick();
    }
    Ok(rows)
}
