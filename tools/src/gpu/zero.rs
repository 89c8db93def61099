//! `gpu-check`'s ZeRO row: the [`Engine`] with its model states on the GPU against the same
//! engine on the host, on the same data, every stage in fp32, bf16 and fp16 (static loss scale)
//! with AdamW, and at stage 3 in bf16 with every other optimizer rule (Lion only where the
//! target is bit for bit: its sign turns a last-bit difference into a whole step), three
//! optimizer steps, no clipping (the GPU sums the norm in a tree, so a clipped step may differ in
//! the last bit). Bit for bit where the device collectives reduce in the host ring's order (the
//! slot ring, or 2 ranks, whose sums have one order); where the direct step reduces chunks in
//! rank order on more ranks, within 1e-3 or one unit in the last place of the parameters' type
//! (a gradient sum a last bit apart can round a bf16 parameter to its neighbour: 2⁻⁷ apart
//! near 1).

use std::sync::Arc;

use half::{bf16, f16};
use ringzero_collectives::{Communicator, DeviceComm, DeviceMemory, TrainStream};
use ringzero_kernels::cpu::{cast, Float, Optimizer, Rule};
use ringzero_zero::{Engine, LossScaling, ParamSpec, Precision, ZeroConfig};

use crate::gpu::kernels::Row;
use crate::gpu::CheckDev;

fn specs() -> Vec<ParamSpec> {
    vec![
        ParamSpec::new("w1", &[37]),
        ParamSpec::new("b1", &[5]),
        ParamSpec::new("w2", &[13, 10]),
        ParamSpec::new("b2", &[3]),
    ]
}

fn init(p: usize, i: usize) -> f32 {
    ((p * 131 + i) as f32 * 0.173).sin()
}

fn cfg(p: Precision, stage: u8, h: Optimizer) -> ZeroConfig {
    ZeroConfig {
        stage,
        precision: p,
        bucket_elems: 64,
        loss_scaling: LossScaling {
            loss_scale: 1024.0,
            ..LossScaling::default()
        },
        optimizer: h,
        ..ZeroConfig::default()
    }
}

/// AdamW at the rate the checks train with.
fn adamw() -> Optimizer {
    Optimizer {
        lr: 0.05,
        ..Optimizer::default()
    }
}

/// The other rules (every one but AdamW), with weight decay: each steps on the GPU with its
/// own kernel path.
fn other_rules() -> impl Iterator<Item = Optimizer> {
    Optimizer::each_rule()
        .into_iter()
        .filter(|h| h.rule != Rule::AdamW)
}

/// Gradients of one step from the parameters' values (scaled by `scale`), rounded into `T`.
fn grads<T: Float>(values: &[Vec<f32>], rank: usize, step: usize, scale: f32) -> Vec<Vec<T>> {
    values
        .iter()
        .enumerate()
        .map(|(p, v)| {
            let g: Vec<f32> = v
                .iter()
                .enumerate()
                .map(|(i, &x)| {
                    (x * (rank as f32 + 1.3) + (step * 7 + p * 3 + i) as f32 * 0.11).sin()
                        * 0.37
                        * scale
                })
                .collect();
            let mut out = vec![T::default(); g.len()];
            cast(&g, &mut out);
            out
        })
        .collect()
}

const STEPS: usize = 3;

/// The parameters after [`STEPS`] steps of `e` (data of `rank`), each gradient handed to the
/// engine by `push`.
fn train<T: Float, S: TrainStream + 'static>(
    mut e: Engine<T, S>,
    rank: usize,
    push: impl Fn(&mut Engine<T, S>, &str, Vec<T>) -> Result<(), String>,
) -> Result<Vec<Vec<f32>>, String> {
    let sp = specs();
    let names: Vec<&str> = sp.iter().map(|s| s.name.as_str()).collect();
    let e_ = |e: ringzero_zero::ZeroError| e.to_string();
    let values = |e: &mut Engine<T, S>| -> Result<Vec<Vec<f32>>, String> {
        e.gather(&names).map_err(e_)?;
        let v = names
            .iter()
            .map(|n| e.param_f32(n))
            .collect::<Result<_, _>>();
        e.release(&names).map_err(e_)?;
        v.map_err(e_)
    };
    for t in 0..STEPS {
        let v = values(&mut e)?;
        for (n, g) in names.iter().zip(grads::<T>(&v, rank, t, e.loss_scale())) {
            push(&mut e, n, g)?;
        }
        e.step().map_err(e_)?;
    }
    values(&mut e)
}

/// The host engine's parameters after [`STEPS`] steps.
fn host<T: Float>(comm: &Communicator, c: ZeroConfig) -> Result<Vec<Vec<f32>>, String> {
    let e = Engine::<T>::new(comm, &specs(), &init, c).map_err(|e| e.to_string())?;
    train(e, comm.rank(), |e, n, g| {
        e.push_grad(n, &g).map_err(|e| e.to_string())
    })
}

/// The device engine's parameters after [`STEPS`] steps, its gradients uploaded to the GPU.
fn device<D: CheckDev, T: Float>(
    dc: &Arc<DeviceComm<D>>,
    c: ZeroConfig,
) -> Result<Vec<Vec<f32>>, String> {
    let e = Engine::<T, D>::on(dc.clone(), &specs(), &init, c).map_err(|e| e.to_string())?;
    train(e, dc.rank(), |e, n, g| {
        let mut wide = vec![0f32; g.len()];
        T::widen(&g, &mut wide);
        let vals: Vec<f64> = wide.into_iter().map(f64::from).collect();
        let buf = e.stream().make(T::DTYPE, &vals)?;
        debug_assert_eq!(DeviceMemory::<D>::elems(&buf), g.len());
        e.push_grad(n, &buf).map_err(|e| e.to_string())
    })
}

fn compare<D: CheckDev, T: Float>(
    comm: &Communicator,
    dc: &Arc<DeviceComm<D>>,
    p: Precision,
    h: Optimizer,
    stages: &[u8],
    exact: bool,
) -> Result<(), String> {
    for &stage in stages {
        let want = host::<T>(comm, cfg(p, stage, h))?;
        let got = device::<D, T>(dc, cfg(p, stage, h))?;
        let what = format!("rank {}: {} {p} stage {stage}", comm.rank(), h.name());
        same(&got, &want, (!exact).then_some(p), &what)?;
    }
    Ok(())
}

/// `got` (the device engine's parameters) against `want` (the host engine's): bit for bit, or
/// (`near`: the parameters' precision) within 1e-3 or one unit in the last place of that type.
fn same(
    got: &[Vec<f32>],
    want: &[Vec<f32>],
    near: Option<Precision>,
    what: &str,
) -> Result<(), String> {
    // The spacing of the type's values relative to their magnitude (its machine epsilon).
    let eps = near.map(|p| match p {
        Precision::Fp32 => f32::EPSILON,
        Precision::Bf16 => 2f32.powi(-7),
        Precision::Fp16 => 2f32.powi(-10),
    });
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        for (k, (a, b)) in g.iter().zip(w).enumerate() {
            let bad = match eps {
                None => a.to_bits() != b.to_bits(),
                Some(eps) => (a - b).abs() > (eps * a.abs().max(b.abs())).max(1e-3),
            };
            if bad {
                return Err(format!(
                    "{what}: parameter {i} element {k} is {a} on the device, {b} on the host"
                ));
            }
        }
    }
    Ok(())
}

/// The device engine with its optimizer state offloaded — in page-locked host memory mapped
/// into the device, in the NVMe tier's file (a temporary directory), and at stage 3 with the
/// parameter shards in host memory or on NVMe too — against the host engine without offload,
/// bf16 AdamW.
fn compare_offload<D: CheckDev>(
    comm: &Communicator,
    dc: &Arc<DeviceComm<D>>,
    exact: bool,
) -> Result<(), String> {
    use ringzero_zero::{OffloadDevice, OffloadOptimizer};
    let dir = std::env::temp_dir().join(format!(
        "ringzero-gpu-check-offload-{}-{}",
        std::process::id(),
        comm.rank()
    ));
    let p = Precision::Bf16;
    for stage in [1, 2, 3] {
        let want = host::<bf16>(comm, cfg(p, stage, adamw()))?;
        let mut ways = vec![("cpu", OffloadDevice::None), ("nvme", OffloadDevice::None)];
        if stage == 3 {
            ways.extend([("cpu", OffloadDevice::Cpu), ("nvme", OffloadDevice::Nvme)]);
        }
        for (to, params) in ways {
            let mut c = cfg(p, stage, adamw());
            c.offload.optimizer = match to {
                "cpu" => OffloadOptimizer::cpu(),
                _ => OffloadOptimizer::nvme(&dir),
            };
            c.offload.param.device = params;
            c.offload.param.nvme_path = Some(dir.clone());
            let got = device::<D, bf16>(dc, c)?;
            let what = format!(
                "rank {}: bf16 stage {stage} offloaded to {to}, the parameters to {params}",
                comm.rank(),
            );
            same(&got, &want, (!exact).then_some(p), &what)?;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// The row: every stage and precision on this communicator (`label n=…`).
pub fn check<D: CheckDev>(comm: &Communicator, dc: &Arc<DeviceComm<D>>, label: &str) -> Row {
    let n = comm.size();
    let exact = dc.direct().is_none() || n <= 2;
    let all = [0, 1, 2, 3];
    let r = compare::<D, f32>(comm, dc, Precision::Fp32, adamw(), &all, exact)
        .and_then(|()| compare::<D, bf16>(comm, dc, Precision::Bf16, adamw(), &all, exact))
        .and_then(|()| compare::<D, f16>(comm, dc, Precision::Fp16, adamw(), &all, exact))
        .and_then(|()| {
            // Lion steps by the sign of its momentum: where the reductions' order differs (the
            // direct step on more than 2 ranks), a last-bit difference in a gradient sum near 0
            // flips a sign and moves a weight by 2·lr, so it is compared only where bit for
            // bit is the target. The other rules only at stage 3 (the stages differ in where
            // gradients and parameters live, checked above; the rules in the update).
            other_rules()
                .filter(|h| exact || h.rule != Rule::Lion)
                .try_for_each(|h| compare::<D, bf16>(comm, dc, Precision::Bf16, h, &[3], exact))
        })
        .and_then(|()| compare_offload::<D>(comm, dc, exact));
    Row {
        check: format!("{label} n={n} zero device engine"),
        pass: r.is_ok(),
        detail: r.err().unwrap_or_else(|| {
            format!(
                "stages 0-3 × fp32/bf16/fp16 with AdamW, and stage 3 in bf16 with Adam, SGD with \
                 and without momentum{}; bf16 stages 1-3 with the optimizer state offloaded to \
                 host memory and to NVMe, stage 3 with the parameters too (host, NVMe); {STEPS} steps, \
                 against the host engine: {}",
                if exact { ", Lion" } else { "" },
                if exact {
                    "bit for bit"
                } else {
                    "within 1e-3 or one unit in the last place (the direct step sums in rank order)"
                }
            )
        }),
    }
}
