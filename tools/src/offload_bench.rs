//! `ringzero offload-bench`: what offloading the optimizer state costs a step. The same ZeRO
//! engine (bf16 parameters, AdamW) on the ranks' devices takes timed optimizer steps with its
//! state on the device, in host memory and on NVMe, one after the other in one run; each line
//! gives the step time and its ratio to the device's, the time the step waited for gradients
//! to reach the host, the CPU step's time, the bytes each way over PCIe and through the NVMe
//! file, and the engine's bytes by tier. Gradients are device buffers of zeros pushed every step
//! (AdamW does its whole work on zeros), so the step is the engine's alone.

use std::sync::Arc;
use std::time::{Duration, Instant};

use half::bf16;
use ringzero_collectives::{Collectives, Communicator, DeviceComm, InPlace, ReduceOp};
use ringzero_zero::{
    Engine, Memory, OffloadDevice, OffloadOptimizer, OffloadParam, OffloadStats, ParamSpec,
    Precision, ZeroConfig,
};

use crate::gpu::CheckDev;

/// What to run.
#[derive(Clone, Debug)]
pub struct OffloadBenchArgs {
    /// Parameters in the model (split into `pieces` tensors).
    pub params: usize,
    /// Tensors the parameters are split into.
    pub pieces: usize,
    /// ZeRO stage (1–3).
    pub stage: u8,
    /// Timed optimizer steps per mode (after one untimed).
    pub steps: usize,
    /// The modes, in order: where the optimizer state lives (and at stage 3, with `Nvme`, the
    /// parameters too when `infinity`).
    pub modes: Vec<OffloadDevice>,
    /// Directory of the NVMe tier.
    pub nvme_path: std::path::PathBuf,
    /// Stage 3 with `nvme`: the parameter shards on NVMe too (ZeRO-Infinity).
    pub infinity: bool,
}

/// One mode's figures (rank 0's, the step time the slowest rank's).
#[derive(Clone, Copy, Debug)]
pub struct Line {
    /// Where the optimizer state lived.
    pub mode: OffloadDevice,
    /// Mean optimizer step, slowest rank.
    pub step: Duration,
    /// Per step: the offload's traffic and times.
    pub offload: OffloadStats,
    /// The engine's bytes by tier.
    pub memory: Memory,
}

fn config(a: &OffloadBenchArgs, mode: OffloadDevice) -> Result<ZeroConfig, String> {
    let mut c = ZeroConfig {
        stage: a.stage,
        precision: Precision::Bf16,
        bucket_elems: (a.params / a.pieces).max(1),
        ..ZeroConfig::default()
    };
    c.offload.optimizer = match mode {
        OffloadDevice::None => OffloadOptimizer::default(),
        OffloadDevice::Cpu => OffloadOptimizer::cpu(),
        OffloadDevice::Nvme => OffloadOptimizer::nvme(&a.nvme_path),
    };
    if a.infinity && a.stage == 3 && mode == OffloadDevice::Nvme {
        c.offload.param = OffloadParam {
            device: OffloadDevice::Nvme,
            nvme_path: Some(a.nvme_path.clone()),
            ..OffloadParam::default()
        };
    }
    c.validate().map_err(|e| e.to_string())?;
    Ok(c)
}

/// Every mode of `a` on this rank's device communicator, in turn.
pub fn run<D: CheckDev>(
    comm: &Communicator,
    dc: &Arc<DeviceComm<D>>,
    a: &OffloadBenchArgs,
) -> Result<Vec<Line>, String> {
    let e_ = |e: ringzero_zero::ZeroError| e.to_string();
    let per = (a.params / a.pieces).max(1);
    let specs: Vec<ParamSpec> = (0..a.pieces)
        .map(|i| ParamSpec::new(format!("layer{i}.weight"), &[per]))
        .collect();
    let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    let grads = specs
        .iter()
        .map(|s| {
            dc.stream()
                .zeros(ringzero_collectives::DType::BF16, s.numel())
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut lines = Vec::new();
    for &mode in &a.modes {
        let cfg = config(a, mode)?;
        let init = |p: usize, i: usize| ((p * 7919 + i) as f32 * 1e-3).sin() * 0.02;
        let mut e = Engine::<bf16, D>::on(dc.clone(), &specs, &init, cfg).map_err(e_)?;
        let mut step = || -> Result<OffloadStats, String> {
            if a.stage == 3 {
                // A forward's gathers, as a trainer's would.
                e.gather(&names).map_err(e_)?;
                e.release(&names).map_err(e_)?;
            }
            e.push_grads(grads.iter()).map_err(e_)?;
            e.step().map_err(e_)?;
            Ok(e.report().map(|r| r.offload).unwrap_or_default())
        };
        step()?;
        let t0 = Instant::now();
        let mut sum = OffloadStats::default();
        for _ in 0..a.steps.max(1) {
            let o = step()?;
            sum.cpu_step += o.cpu_step;
            sum.device_wait += o.device_wait;
            (sum.to_host, sum.to_device) = (sum.to_host + o.to_host, sum.to_device + o.to_device);
            sum.nvme_read += o.nvme_read;
            sum.nvme_written += o.nvme_written;
        }
        let k = a.steps.max(1) as u32;
        let mut slowest = [t0.elapsed().as_secs_f64() / k as f64];
        comm.all_reduce(InPlace, &mut slowest[..], ReduceOp::Max)
            .map_err(|e| e.to_string())?;
        let k64 = u64::from(k);
        lines.push(Line {
            mode,
            step: Duration::from_secs_f64(slowest[0]),
            offload: OffloadStats {
                cpu_step: sum.cpu_step / k,
                device_wait: sum.device_wait / k,
                to_host: sum.to_host / k64,
                to_device: sum.to_device / k64,
                nvme_read: sum.nvme_read / k64,
                nvme_written: sum.nvme_written / k64,
            },
            memory: e.memory(),
        });
    }
    Ok(lines)
}

/// The table rank 0 prints.
pub fn text(a: &OffloadBenchArgs, device: &str, ranks: usize, lines: &[Line]) -> String {
    let mut out = format!(
        "# offload-bench: {} bf16 parameters in {} tensors, AdamW, ZeRO stage {}, {ranks} ranks on \
         {device}; {} timed steps per mode (after one untimed); rank 0's figures, the step the \
         slowest rank's\n",
        a.params, a.pieces, a.stage, a.steps
    );
    out += &format!(
        "{:>6} {:>10} {:>8} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}\n",
        "state",
        "step ms",
        "× none",
        "wait ms",
        "cpu ms",
        "→host MB",
        "→dev MB",
        "nvme r MB",
        "nvme w MB",
        "dev MB",
        "host MB",
        "nvme MB"
    );
    let base = lines
        .iter()
        .find(|l| l.mode == OffloadDevice::None)
        .map(|l| l.step.as_secs_f64());
    let (ms, mb) = (|d: Duration| d.as_secs_f64() * 1e3, |b: u64| b as f64 / 1e6);
    for l in lines {
        let m = &l.memory;
        let dev = m.model_states() + m.comm_buffers;
        let nvme = m.nvme_optimizer + m.nvme_params;
        out += &format!(
            "{:>6} {:>10.1} {:>8} {:>10.1} {:>10.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1}\n",
            l.mode.to_string(),
            ms(l.step),
            base.map_or("-".into(), |b| format!("{:.2}", l.step.as_secs_f64() / b)),
            ms(l.offload.device_wait),
            ms(l.offload.cpu_step),
            mb(l.offload.to_host),
            mb(l.offload.to_device),
            mb(l.offload.nvme_read),
            mb(l.offload.nvme_written),
            mb(dev as u64),
            mb(m.host() as u64),
            mb(nvme as u64),
        );
    }
    out
}
