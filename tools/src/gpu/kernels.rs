//! `ringzero gpu-check`: every CUDA kernel against the CPU kernels (themselves tested against
//! f64/i128 references) on fresh pseudo-random inputs — never zeros — at odd sizes, outputs
//! poisoned first; then bandwidth micro-benchmarks next to a plain device-to-device copy measured in
//! the same run. Run by `scripts/gpu-check.sh` on a machine with a GPU.

use std::sync::Arc;

use ringzero_kernels::cpu::{self, Float, Optimizer, Rule};
use ringzero_kernels::device::cuda::{DeviceBuffer, Gpu, StepState};
use ringzero_kernels::device::{DeviceError, Stream};
use ringzero_kernels::{DType, ReduceOp};

use crate::mix;

/// One line of the final table.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Row {
    /// What was checked or measured.
    pub check: String,
    /// Whether it passed.
    pub pass: bool,
    /// Evidence: mismatches, or the figure.
    pub detail: String,
}

/// `n` non-zero values of `d` from `seed`: floats in ±[0.25, 2), integers in 1..=100.
fn random(d: DType, n: usize, seed: u64) -> Vec<u8> {
    let mut out = vec![0u8; n * d.size()];
    for i in 0..n {
        let r = mix(seed ^ (i as u64).wrapping_mul(0x1000_0000_01b3));
        let f = 0.25 + (r >> 11) as f64 / (1u64 << 53) as f64 * 1.75;
        let f = if r & 1 == 0 { f } else { -f };
        let k = (1 + (r >> 20) % 100) as f64;
        let at = &mut out[i * d.size()..(i + 1) * d.size()];
        match d {
            DType::F32 => at.copy_from_slice(&(f as f32).to_le_bytes()),
            DType::F64 => at.copy_from_slice(&f.to_le_bytes()),
            DType::F16 => at.copy_from_slice(&half::f16::from_f64(f).to_le_bytes()),
            DType::BF16 => at.copy_from_slice(&half::bf16::from_f64(f).to_le_bytes()),
            DType::I32 => at.copy_from_slice(&(k as i32).to_le_bytes()),
            DType::I64 => at.copy_from_slice(&(k as i64).to_le_bytes()),
            DType::U8 => at[0] = k as u8,
        }
    }
    out
}

/// Little-endian bytes to typed values (a copy, so alignment does not matter).
fn pods<T: bytemuck::Pod>(b: &[u8]) -> Vec<T> {
    let mut v = vec![T::zeroed(); b.len() / std::mem::size_of::<T>()];
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(b);
    v
}

fn first_diff(a: &[u8], b: &[u8], size: usize) -> Option<usize> {
    a.chunks(size).zip(b.chunks(size)).position(|(x, y)| x != y)
}

fn poisoned(gpu: &Arc<Gpu>, d: DType, n: usize) -> Result<DeviceBuffer, DeviceError> {
    gpu.upload(d, &vec![0xA5u8; n * d.size()])
}

fn download(gpu: &Arc<Gpu>, b: &DeviceBuffer) -> Result<Vec<u8>, DeviceError> {
    let mut v = vec![0u8; b.bytes()];
    gpu.download(b, &mut v)?;
    Ok(v)
}

const SIZES: [usize; 4] = [1, 3, 1023, (1 << 20) + 7];

fn row(check: String, r: Result<Option<String>, DeviceError>) -> Row {
    match r {
        Ok(None) => Row {
            check,
            pass: true,
            detail: "exact".into(),
        },
        Ok(Some(d)) => Row {
            check,
            pass: false,
            detail: d,
        },
        Err(e) => Row {
            check,
            pass: false,
            detail: e.to_string(),
        },
    }
}

/// Every correctness check.
pub fn checks(gpu: &Arc<Gpu>) -> Vec<Row> {
    let mut rows = Vec::new();
    let dtypes = DType::ALL;
    let ops = ReduceOp::ALL;
    for d in dtypes {
        for op in ops {
            let r = (|| {
                for (k, &n) in SIZES.iter().enumerate() {
                    let a = random(d, n, 1 + k as u64);
                    let b = random(d, n, 100 + k as u64);
                    let mut da = gpu.upload(d, &a)?;
                    let db = gpu.upload(d, &b)?;
                    gpu.reduce_into(op, &mut da, &db)?;
                    let mut want = a.clone();
                    cpu::reduce_into(d, op.pairwise(), &mut want, &b).expect("same lengths");
                    if op == ReduceOp::Avg {
                        Gpu::divide(gpu, &mut da, 2)?;
                        cpu::divide(d, &mut want, 2).expect("layout");
                    }
                    let got = download(gpu, &da)?;
                    if let Some(i) = first_diff(&got, &want, d.size()) {
                        return Ok(Some(format!(
                            "n={n}: element {i} differs from the CPU kernel"
                        )));
                    }
                }
                Ok(None)
            })();
            rows.push(row(format!("reduce {op} {d}"), r));
        }
    }
    for d in dtypes {
        rows.push(row(
            format!("combine2/copy2/copy_pair {d}"),
            two_destinations(gpu, d),
        ));
        rows.push(row(format!("gather {d}"), gather_check(gpu, d)));
    }
    rows.push(row(
        "share (IPC export of buffers)".into(),
        share_check(gpu),
    ));
    for (from, to) in [
        (DType::F32, DType::F16),
        (DType::F32, DType::BF16),
        (DType::F16, DType::F32),
        (DType::BF16, DType::F32),
    ] {
        let r = (|| {
            for &n in &SIZES {
                let src = random(from, n, 7);
                let ds = gpu.upload(from, &src)?;
                let mut dd = poisoned(gpu, to, n)?;
                gpu.cast(&ds, &mut dd)?;
                let got = download(gpu, &dd)?;
                let want = host_cast(from, to, &src);
                if let Some(i) = first_diff(&got, &want, to.size()) {
                    return Ok(Some(format!("n={n}: element {i} differs")));
                }
            }
            Ok(None)
        })();
        rows.push(row(format!("cast {from}→{to}"), r));
    }
    for d in [DType::F32, DType::F16, DType::BF16] {
        rows.push(row(format!("scale/norm/finite {d}"), float_checks(gpu, d)));
        for h in rules() {
            rows.push(row(
                format!("optim_step {} {d}", rule_name(&h)),
                optim_check(gpu, &h, d),
            ));
        }
    }
    rows
}

/// The ring's one-pass kernels: `combine2` (`dst = also = a op b`, every op), `copy2`
/// (`dst = also = src`) and `copy_pair` (two unrelated copies, the second to one or two places),
/// every destination poisoned first, on 16-byte-aligned ranges (the vector path) and on ranges
/// one element in (the element-by-element path).
fn two_destinations(gpu: &Arc<Gpu>, d: DType) -> Result<Option<String>, DeviceError> {
    let es = d.size();
    for (k, &n) in SIZES.iter().enumerate() {
        let a = random(d, n, 300 + k as u64);
        let b = random(d, n, 400 + k as u64);
        let (da, db) = (gpu.upload(d, &a)?, gpu.upload(d, &b)?);
        for skip in [0, 1.min(n - 1)] {
            let m = n - skip;
            let at = |buf: &DeviceBuffer| gpu.ptr_of(buf) + (skip * es) as u64;
            for op in ReduceOp::ALL {
                let (dst, also) = (poisoned(gpu, d, n)?, poisoned(gpu, d, n)?);
                // SAFETY: four distinct live buffers of `n` elements, each range `m` elements
                // from element `skip`; `download` below waits for the kernel.
                unsafe { Stream::combine2(gpu, d, op, at(&dst), at(&also), at(&da), at(&db), m)? };
                let mut want = a[skip * es..].to_vec();
                cpu::reduce_into(d, op.pairwise(), &mut want, &b[skip * es..]).expect("lengths");
                for (name, buf) in [("dst", &dst), ("also", &also)] {
                    let got = download(gpu, buf)?;
                    if got[..skip * es].iter().any(|&x| x != 0xA5) {
                        return Ok(Some(format!(
                            "combine2 {op} n={m}: {name} written before element {skip}"
                        )));
                    }
                    if let Some(i) = first_diff(&got[skip * es..], &want, es) {
                        return Ok(Some(format!(
                            "combine2 {op} n={m} from element {skip}: {name}[{i}] differs"
                        )));
                    }
                }
            }
            let (dst, also) = (poisoned(gpu, d, n)?, poisoned(gpu, d, n)?);
            // SAFETY: as above, three buffers, `m · es` bytes each from element `skip`.
            unsafe { Stream::copy2(gpu, at(&dst), at(&also), at(&da), m * es)? };
            for (name, buf) in [("dst", &dst), ("also", &also)] {
                let got = download(gpu, buf)?;
                if let Some(i) = first_diff(&got[skip * es..], &a[skip * es..], es) {
                    return Ok(Some(format!(
                        "copy2 n={m} from element {skip}: {name}[{i}] differs"
                    )));
                }
            }
            // copy_pair: `a` into one buffer and `b` into two (then into one), in one launch;
            // the second copy one element shorter so the two ranges differ in length.
            let mb = m.saturating_sub(1);
            for with_also in [true, false] {
                let (x, y, z) = (
                    poisoned(gpu, d, n)?,
                    poisoned(gpu, d, n)?,
                    poisoned(gpu, d, n)?,
                );
                // SAFETY: five distinct live buffers of `n` elements; every range starts at
                // element `skip` and ends inside them; `download` waits for the kernel.
                unsafe {
                    Stream::copy_pair(
                        gpu,
                        at(&x),
                        at(&da),
                        m * es,
                        at(&y),
                        with_also.then(|| at(&z)),
                        at(&db),
                        mb * es,
                    )?
                };
                let checks = [
                    ("a", &x, &a, m),
                    ("b", &y, &b, mb),
                    ("b_also", &z, &b, if with_also { mb } else { 0 }),
                ];
                for (name, buf, want, len) in checks {
                    let got = download(gpu, buf)?;
                    let end = (skip + len) * es;
                    if got[..skip * es]
                        .iter()
                        .chain(&got[end..])
                        .any(|&v| v != 0xA5)
                    {
                        return Ok(Some(format!(
                            "copy_pair n={m}: {name} written outside its range from element {skip}"
                        )));
                    }
                    if let Some(i) = first_diff(&got[skip * es..end], &want[skip * es..end], es) {
                        return Ok(Some(format!(
                            "copy_pair n={m} from element {skip}: {name}[{i}] differs"
                        )));
                    }
                }
            }
        }
    }
    Ok(None)
}

/// The direct collectives' kernel: three inputs combined in order (every op; `Avg` divided by 3)
/// into two poisoned outputs and, in place, into the first input; one input copied to two
/// outputs. Aligned ranges and ranges one element in, bit-exact against the CPU kernels.
fn gather_check(gpu: &Arc<Gpu>, d: DType) -> Result<Option<String>, DeviceError> {
    let es = d.size();
    for (k, &n) in SIZES.iter().enumerate() {
        let ins: Vec<Vec<u8>> = (0..3)
            .map(|j| random(d, n, 500 + 10 * k as u64 + j))
            .collect();
        let dins = ins
            .iter()
            .map(|x| gpu.upload(d, x))
            .collect::<Result<Vec<_>, _>>()?;
        for skip in [0, 1.min(n - 1)] {
            let m = n - skip;
            let at = |buf: &DeviceBuffer| gpu.ptr_of(buf) + (skip * es) as u64;
            for op in ReduceOp::ALL {
                let outs = [poisoned(gpu, d, n)?, poisoned(gpu, d, n)?];
                // The in-place output: a fresh copy of input 0, read and written.
                let first = gpu.upload(d, &ins[0])?;
                let ranks = (op == ReduceOp::Avg).then_some(3);
                let i_addr = [at(&first), at(&dins[1]), at(&dins[2])];
                let o_addr = [at(&outs[0]), at(&outs[1]), at(&first)];
                // SAFETY: six live buffers of `n` elements, each range `m` elements from element
                // `skip`; the one output that equals an input is the same range exactly;
                // `download` below waits for the kernel.
                unsafe { Stream::gather(gpu, d, op, &o_addr, &i_addr, m, ranks)? };
                let mut want = ins[0][skip * es..].to_vec();
                for x in &ins[1..] {
                    cpu::reduce_into(d, op.pairwise(), &mut want, &x[skip * es..])
                        .expect("lengths");
                }
                if let Some(r) = ranks {
                    cpu::divide(d, &mut want, r).expect("layout");
                }
                for (name, buf) in [("out0", &outs[0]), ("out1", &outs[1]), ("in place", &first)] {
                    let got = download(gpu, buf)?;
                    if name != "in place" && got[..skip * es].iter().any(|&x| x != 0xA5) {
                        return Ok(Some(format!(
                            "gather {op} n={m}: {name} written before element {skip}"
                        )));
                    }
                    if let Some(i) = first_diff(&got[skip * es..], &want, es) {
                        return Ok(Some(format!(
                            "gather {op} n={m} from element {skip}: {name}[{i}] differs"
                        )));
                    }
                }
            }
            let outs = [poisoned(gpu, d, n)?, poisoned(gpu, d, n)?];
            // SAFETY: as above, one input and two outputs.
            unsafe {
                Stream::gather(
                    gpu,
                    d,
                    ReduceOp::Sum,
                    &[at(&outs[0]), at(&outs[1])],
                    &[at(&dins[0])],
                    m,
                    None,
                )?
            };
            for buf in &outs {
                let got = download(gpu, buf)?;
                if let Some(i) = first_diff(&got[skip * es..], &ins[0][skip * es..], es) {
                    return Ok(Some(format!(
                        "gather (copy) n={m} from element {skip}: element {i} differs"
                    )));
                }
            }
        }
    }
    Ok(None)
}

/// Buffers from [`Gpu::alloc`] can be exported over CUDA IPC (the direct collectives open each
/// other's buffers): the handle, the offset inside the allocation, its size, and a buffer id
/// that differs between allocations.
fn share_check(gpu: &Arc<Gpu>) -> Result<Option<String>, DeviceError> {
    let a = gpu.alloc(DType::F32, 1 << 20)?;
    let b = gpu.upload(DType::F32, &[0u8; 4096])?;
    let sa = gpu.share_of(gpu.ptr_of(&a) + 4096)?;
    let sb = gpu.share_of(gpu.ptr_of(&b))?;
    Ok(if sa.offset != 4096 || sa.bytes < a.bytes() {
        Some(format!(
            "offset {} and allocation of {} bytes for 4096 into a {}-byte buffer",
            sa.offset,
            sa.bytes,
            a.bytes()
        ))
    } else if sa.id == sb.id || sa.handle == sb.handle {
        Some("two buffers share an id or an IPC handle".into())
    } else {
        None
    })
}

fn host_cast(from: DType, to: DType, src: &[u8]) -> Vec<u8> {
    use half::{bf16, f16};
    let n = src.len() / from.size();
    let mut wide = vec![0f32; n];
    match from {
        DType::F32 => cpu::cast::<f32, f32>(bytemuck::cast_slice(src), &mut wide),
        DType::F16 => cpu::cast::<f16, f32>(&pods::<f16>(src), &mut wide),
        _ => cpu::cast::<bf16, f32>(&pods::<bf16>(src), &mut wide),
    }
    match to {
        DType::F32 => bytemuck::cast_slice(&wide).to_vec(),
        DType::F16 => {
            let mut o = vec![f16::ZERO; n];
            cpu::cast(&wide, &mut o);
            bytemuck::cast_slice(&o).to_vec()
        }
        _ => {
            let mut o = vec![bf16::ZERO; n];
            cpu::cast(&wide, &mut o);
            bytemuck::cast_slice(&o).to_vec()
        }
    }
}

fn widened(d: DType, bytes: &[u8]) -> Vec<f32> {
    pods::<f32>(&host_cast(d, DType::F32, bytes))
}

fn float_checks(gpu: &Arc<Gpu>, d: DType) -> Result<Option<String>, DeviceError> {
    for &n in &SIZES {
        let x = random(d, n, 11);
        let mut dx = gpu.upload(d, &x)?;
        let want: f64 = widened(d, &x)
            .iter()
            .map(|v| ((v * 0.5) as f64).powi(2))
            .sum();
        let got = gpu.sq_norm(&dx, 0.5)?;
        if (got - want).abs() > 1e-9 * want.abs().max(1e-30) {
            return Ok(Some(format!("n={n}: squared norm {got} vs {want}")));
        }
        if !gpu.all_finite(&dx)? {
            return Ok(Some(format!("n={n}: finite data reported non-finite")));
        }
        gpu.scale(&mut dx, 3.0)?;
        let mut want = widened(d, &x);
        want.iter_mut().for_each(|v| *v *= 3.0);
        let want = host_cast(DType::F32, d, bytemuck::cast_slice(&want));
        let got = download(gpu, &dx)?;
        if let Some(i) = first_diff(&got, &want, d.size()) {
            return Ok(Some(format!("n={n}: scale element {i} differs")));
        }
        let mut bad = x.clone();
        let at = (n / 2) * d.size();
        let inf = host_cast(DType::F32, d, &f32::INFINITY.to_le_bytes());
        bad[at..at + d.size()].copy_from_slice(&inf);
        if gpu.all_finite(&gpu.upload(d, &bad)?)? {
            return Ok(Some(format!("n={n}: an inf at {} was not found", n / 2)));
        }
    }
    Ok(None)
}

/// Every optimizer rule the engine steps with (weight decay on, SGD with and without momentum
/// and with Nesterov), as `gpu-check` compares them.
fn rules() -> [Optimizer; 6] {
    Optimizer::each_rule()
}

/// The row name of rule `h` (SGD's variants told apart).
fn rule_name(h: &Optimizer) -> String {
    match h.rule {
        Rule::Sgd { nesterov: true } => "SGD-nesterov".into(),
        Rule::Sgd { .. } if h.beta1 != 0.0 => "SGD-momentum".into(),
        _ => h.name().into(),
    }
}

/// One step of `h` on the CPU with `T` gradients (`g`'s bytes): the 16-bit parameters written,
/// as bytes (none for f32).
fn cpu_step<T: Float + bytemuck::Pod>(
    h: &Optimizer,
    t: u64,
    master: &mut [f32],
    g: &[u8],
    s: &mut [Vec<f32>; 2],
) -> Vec<u8> {
    let mut p = vec![T::zeroed(); master.len()];
    let [s1, s2] = s;
    cpu::step_mixed::<T>(
        h,
        t,
        master,
        (!T::IS_F32).then_some(&mut p[..]),
        &pods::<T>(g),
        s1,
        s2,
        0.5,
    );
    if T::IS_F32 {
        Vec::new()
    } else {
        bytemuck::cast_slice(&p).to_vec()
    }
}

/// Three steps of rule `h` on the GPU and the CPU, with `d` gradients: every master, state and
/// 16-bit parameter bit for bit.
fn optim_check(gpu: &Arc<Gpu>, h: &Optimizer, d: DType) -> Result<Option<String>, DeviceError> {
    use half::{bf16, f16};
    let keeps = h.states().len();
    for &n in &SIZES {
        let master0 = pods::<f32>(&random(DType::F32, n, 21));
        let mut dm = gpu.upload(DType::F32, bytemuck::cast_slice(&master0))?;
        let mut ds = (0..keeps)
            .map(|_| gpu.alloc(DType::F32, n))
            .collect::<Result<Vec<_>, _>>()?;
        let mut p_d = if d == DType::F32 {
            None
        } else {
            Some(poisoned(gpu, d, n)?)
        };
        let mut master = master0.clone();
        let mut s: [Vec<f32>; 2] =
            std::array::from_fn(|k| vec![0f32; if keeps > k { n } else { 0 }]);
        let mut p16 = Vec::new();
        for t in 1..=3u64 {
            let g = random(d, n, 30 + t);
            let dg = gpu.upload(d, &g)?;
            gpu.optim_step(
                h,
                t,
                StepState {
                    master: &mut dm,
                    params: p_d.as_mut(),
                    grads: &dg,
                    states: ds.iter_mut().collect(),
                },
                0.5,
            )?;
            p16 = match d {
                DType::F32 => cpu_step::<f32>(h, t, &mut master, &g, &mut s),
                DType::F16 => cpu_step::<f16>(h, t, &mut master, &g, &mut s),
                _ => cpu_step::<bf16>(h, t, &mut master, &g, &mut s),
            };
        }
        let mut pairs = vec![("master", &dm, &master)];
        for (k, name) in h.states().iter().enumerate() {
            pairs.push((name, &ds[k], &s[k]));
        }
        for (what, buf, want) in pairs {
            let got = pods::<f32>(&download(gpu, buf)?);
            if let Some((i, (a, b))) = got
                .iter()
                .zip(want.iter())
                .enumerate()
                .find(|(_, (a, b))| a.to_bits() != b.to_bits())
            {
                return Ok(Some(format!("n={n}: {what}[{i}] {a} vs CPU {b}")));
            }
        }
        if let Some(p) = &p_d {
            if let Some(i) = first_diff(&download(gpu, p)?, &p16, d.size()) {
                return Ok(Some(format!("n={n}: 16-bit param {i} differs")));
            }
        }
    }
    Ok(None)
}

/// Bandwidth of each kernel (bytes read + written) next to a device-to-device copy.
pub fn bench(gpu: &Arc<Gpu>) -> Result<Vec<Row>, DeviceError> {
    let n = 64 << 20; // elements
    let reps = 20;
    let gbs = |bytes: f64, ms: f64| bytes / (ms * 1e-3) / 1e9;
    let src = gpu.alloc(DType::F32, n)?;
    let mut dst = gpu.alloc(DType::F32, n)?;
    let copy_ms = gpu.time(reps, || Gpu::copy(gpu, &mut dst, &src))?;
    let copy = gbs(2.0 * 4.0 * n as f64, copy_ms);
    let mut rows = vec![Row {
        check: "bench d2d copy 256 MiB".into(),
        pass: true,
        detail: format!("{copy:.0} GB/s"),
    }];
    let mut add = |name: String, bytes: f64, ms: f64, target: f64| {
        let bw = gbs(bytes, ms);
        rows.push(Row {
            check: name,
            pass: bw >= target * copy,
            detail: format!(
                "{bw:.0} GB/s = {:.0}% of copy (target {:.0}%)",
                100.0 * bw / copy,
                100.0 * target
            ),
        });
    };
    for d in [DType::F32, DType::BF16] {
        let a = gpu.upload(d, &random(d, n, 3))?;
        let mut b = gpu.upload(d, &random(d, n, 4))?;
        let ms = gpu.time(reps, || gpu.reduce_into(ReduceOp::Sum, &mut b, &a))?;
        add(
            format!("bench reduce sum {d} {} MiB", (n * d.size()) >> 20),
            3.0 * (n * d.size()) as f64,
            ms,
            0.9,
        );
    }
    // The direct step's kernel as one rank of 2 and of 4 on one GPU runs it in a 256 MiB f32
    // all-reduce: chunk r of every input combined and written to every output.
    for ranks in [2usize, 4] {
        let m = n / ranks;
        let mut bufs = Vec::with_capacity(2 * ranks);
        for k in 0..2 * ranks {
            bufs.push(gpu.upload(DType::F32, &random(DType::F32, m, 10 + k as u64))?);
        }
        let addrs: Vec<_> = bufs.iter().map(|b| gpu.ptr_of(b)).collect();
        let (ins, outs) = addrs.split_at(ranks);
        let ms = gpu.time(reps, || {
            // SAFETY: `2·ranks` distinct live buffers of `m` f32 each, kept until `time`
            // returns, which waits for the kernels.
            unsafe { Stream::gather(gpu, DType::F32, ReduceOp::Sum, outs, ins, m, None) }
        })?;
        add(
            format!("bench gather sum f32 {ranks}→{ranks}"),
            (2 * ranks * m * 4) as f64,
            ms,
            0.9,
        );
    }
    // The optimizer step of each rule with state (plain SGD's only differs in reading none),
    // bf16 parameters and gradients: per element the master read and written (8 bytes), each
    // state read and written (8), the gradient read and the parameter written (2 + 2).
    let d = DType::BF16;
    let g = gpu.upload(d, &random(d, n, 6))?;
    for (row, h) in [
        ("adamw", Optimizer::default()),
        ("lion", Optimizer::lion(1e-4)),
        ("sgd-momentum", Optimizer::sgd(0.1, 0.9)),
    ] {
        let mut master = gpu.upload(DType::F32, &random(DType::F32, n, 5))?;
        let mut p = gpu.alloc(d, n)?;
        let mut states = (0..h.states().len())
            .map(|_| gpu.alloc(DType::F32, n))
            .collect::<Result<Vec<_>, _>>()?;
        let mut t = 0;
        let ms = gpu.time(reps, || {
            t += 1;
            gpu.optim_step(
                &h,
                t,
                StepState {
                    master: &mut master,
                    params: Some(&mut p),
                    grads: &g,
                    states: states.iter_mut().collect(),
                },
                1.0,
            )
        })?;
        let per = 12 + 8 * h.states().len();
        add(
            format!("bench {row} bf16 {}M params", n >> 20),
            (per * n) as f64,
            ms,
            0.85,
        );
    }
    Ok(rows)
}

/// The closing table.
pub fn table(gpu_name: &str, rows: &[Row]) -> String {
    let mut s = format!(
        "ringzero gpu-check on {gpu_name}\n{:<34} {:<5} {}\n",
        "check", "pass", "detail"
    );
    for r in rows {
        s += &format!(
            "{:<34} {:<5} {}\n",
            r.check,
            if r.pass { "PASS" } else { "FAIL" },
            r.detail
        );
    }
    let failed = rows.iter().filter(|r| !r.pass).count();
    s += &format!("{} passed, {} failed\n", rows.len() - failed, failed);
    s
}
