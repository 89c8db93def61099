//! `ringzero demo`: a real trainer embedding the ZeRO engine. A multi-layer perceptron with
//! hand-written forward and backward learns a linear teacher `y = A·x` (the known answer: a ReLU
//! network represents a linear map exactly, since `z = relu(z) − relu(−z)`, so the loss can go to
//! zero). Every rank draws its own batch; the engine owns parameters, gradients, optimizer state and
//! all communication.
//!
//! The trainer's side of the contract, per step: for each layer in forward order `gather` it,
//! `prefetch` the next one, compute, `release`; then backward in reverse order the same way,
//! pushing each layer's gradients (times the loss scale) as soon as they exist; then `step`.

use std::time::{Duration, Instant};

use crate::mix;
use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use ringzero_collectives::{Collectives, Communicator, InPlace, ReduceOp};
use ringzero_kernels::cpu::Float;
use ringzero_zero::mem::{k_for, model_states_with};
use ringzero_zero::{
    hybrid_groups, Engine, Memory, ParamSpec, Phase, Precision, StepOutcome, StepReport,
    ZeroConfig, ZeroError,
};

/// The network: `layers` linear layers, ReLU between them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Mlp {
    /// Input features.
    pub input: usize,
    /// Width of the hidden layers.
    pub hidden: usize,
    /// Outputs.
    pub output: usize,
    /// Linear layers (at least 2).
    pub layers: usize,
}

impl Mlp {
    /// (inputs, outputs) of layer `l`.
    pub fn dims(&self, l: usize) -> (usize, usize) {
        let i = if l == 0 { self.input } else { self.hidden };
        let o = if l + 1 == self.layers {
            self.output
        } else {
            self.hidden
        };
        (i, o)
    }

    /// Parameters in order: `w{l}` (out × in), `b{l}` (out) for each layer.
    pub fn specs(&self) -> Vec<ParamSpec> {
        (0..self.layers)
            .flat_map(|l| {
                let (i, o) = self.dims(l);
                [
                    ParamSpec::new(format!("w{l}"), &[o, i]),
                    ParamSpec::new(format!("b{l}"), &[o]),
                ]
            })
            .collect()
    }

    /// He-uniform weights, zero biases; a pure function of (parameter, element) so every rank
    /// builds the same model without a broadcast.
    pub fn init(&self, p: usize, i: usize) -> f32 {
        if p % 2 == 1 {
            return 0.0;
        }
        let (fan_in, _) = self.dims(p / 2);
        let u = unit(mix(0x5eed ^ ((p as u64) << 40) ^ i as u64));
        (2.0 * u - 1.0) * (6.0 / fan_in as f32).sqrt()
    }

    /// The teacher `A` (output × input): the answer the network should learn.
    pub fn teacher(&self) -> Vec<f32> {
        let mut r = rand::rngs::StdRng::seed_from_u64(42);
        (0..self.output * self.input)
            .map(|_| r.gen_range(-1.0f32..1.0))
            .collect()
    }

    /// Rank `rank`'s batch for step `step`: inputs uniform in [−1, 1], targets `A·x`.
    pub fn batch(&self, a: &[f32], rank: usize, step: usize, size: usize) -> (Vec<f32>, Vec<f32>) {
        let mut r = rand::rngs::StdRng::seed_from_u64(((rank as u64) << 32) ^ step as u64 ^ 0xda7a);
        let x: Vec<f32> = (0..size * self.input)
            .map(|_| r.gen_range(-1.0f32..1.0))
            .collect();
        let mut y = vec![0f32; size * self.output];
        for b in 0..size {
            for o in 0..self.output {
                y[b * self.output + o] = dot(
                    &a[o * self.input..(o + 1) * self.input],
                    &x[b * self.input..(b + 1) * self.input],
                );
            }
        }
        (x, y)
    }
}

fn unit(z: u64) -> f32 {
    (z >> 40) as f32 / (1u64 << 24) as f32
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `z = a·Wᵀ + b` for a batch (`a`: batch × in, `w`: out × in).
pub fn linear(a: &[f32], w: &[f32], bias: &[f32], inp: usize, out: usize) -> Vec<f32> {
    let rows = a.len() / inp;
    let mut z = vec![0f32; rows * out];
    for r in 0..rows {
        let ar = &a[r * inp..(r + 1) * inp];
        for o in 0..out {
            z[r * out + o] = dot(&w[o * inp..(o + 1) * inp], ar) + bias[o];
        }
    }
    z
}

/// Backward of [`linear`]: (dW, db, dA) from dZ.
pub fn linear_back(
    a: &[f32],
    w: &[f32],
    dz: &[f32],
    inp: usize,
    out: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let rows = a.len() / inp;
    let (mut dw, mut db, mut da) = (vec![0f32; out * inp], vec![0f32; out], vec![0f32; a.len()]);
    for r in 0..rows {
        let ar = &a[r * inp..(r + 1) * inp];
        let dar = &mut da[r * inp..(r + 1) * inp];
        for o in 0..out {
            let g = dz[r * out + o];
            db[o] += g;
            let wo = &w[o * inp..(o + 1) * inp];
            for ((dwi, &ai), (dai, &wi)) in dw[o * inp..(o + 1) * inp]
                .iter_mut()
                .zip(ar)
                .zip(dar.iter_mut().zip(wo))
            {
                *dwi += g * ai;
                *dai += g * wi;
            }
        }
    }
    (dw, db, da)
}

/// What to run.
#[derive(Clone, Debug)]
pub struct DemoArgs {
    /// The network.
    pub mlp: Mlp,
    /// Samples per rank and micro-step.
    pub batch: usize,
    /// Optimizer steps.
    pub steps: usize,
    /// Engine settings (precision picks the parameter type).
    pub zero: ZeroConfig,
    /// Start from this checkpoint (its step count and data position included).
    pub resume: Option<std::path::PathBuf>,
    /// Save a checkpoint here after the last step.
    pub save: Option<std::path::PathBuf>,
}

/// One step as seen by every rank.
#[derive(Clone, Copy, Debug)]
pub struct StepLog {
    /// Optimizer step index (from 0).
    pub step: usize,
    /// Loss averaged over ranks (and micro-steps).
    pub loss: f64,
    /// The engine's verdict for the step.
    pub outcome: StepOutcome,
    /// Loss scale after the step.
    pub loss_scale: f32,
    /// The learning rate the step ran at.
    pub lr: f32,
    /// Wall time of the step on the slowest rank.
    pub time: Duration,
    /// Where this rank's step time went (forward, backward, communication waits, update).
    pub breakdown: Option<StepReport>,
}

/// What a run measured (identical on every rank, except `memory`, which is this rank's).
#[derive(Clone, Debug)]
pub struct DemoReport {
    /// Per step.
    pub steps: Vec<StepLog>,
    /// Mean step time over all steps but the first (the slowest rank's time per step).
    pub mean_step: Duration,
    /// Mean time per step this rank waited inside `gather` (stage 3) / on gradient reduction.
    pub gather_wait: Duration,
    /// As above, on gradient reduction.
    pub reduce_wait: Duration,
    /// Every rank's memory by category at the end of the last step (index = rank).
    pub memory: Vec<Memory>,
    /// The paper's per-rank model states for this run's padded Ψ: params, grads, optimizer.
    pub formula: (f64, f64, f64),
    /// Parameters (unpadded) and padded Ψ.
    pub numel: (usize, usize),
    /// The most this rank's communication buffers held at once (the engine's count, as they
    /// are made and dropped).
    pub peak_comm_buffers: usize,
    /// Wall time of `load_checkpoint` on this rank (with `resume`).
    pub load_time: Option<Duration>,
    /// Wall time of `save_checkpoint` on this rank (with `save`).
    pub save_time: Option<Duration>,
}

/// Train on every rank of `comm` with the parameter type `args.zero.precision` names.
pub fn run(
    comm: &Communicator,
    args: &DemoArgs,
    on_step: &mut dyn FnMut(&StepLog),
) -> Result<DemoReport, ZeroError> {
    match args.zero.precision {
        Precision::Fp32 => train::<f32>(comm, args, on_step),
        Precision::Bf16 => train::<bf16>(comm, args, on_step),
        Precision::Fp16 => train::<f16>(comm, args, on_step),
    }
}

/// The trainer, generic over the parameter type.
pub fn train<T: Float>(
    comm: &Communicator,
    args: &DemoArgs,
    on_step: &mut dyn FnMut(&StepLog),
) -> Result<DemoReport, ZeroError> {
    let mlp = args.mlp;
    if mlp.layers < 2 || mlp.input == 0 || mlp.hidden == 0 || mlp.output == 0 || args.batch == 0 {
        return Err(ZeroError::Config(
            "demo: need at least 2 layers and non-zero sizes and batch".into(),
        ));
    }
    let specs = mlp.specs();
    let init = |p: usize, i: usize| mlp.init(p, i);
    let groups = match args.zero.shard_size {
        Some(s) => Some(hybrid_groups(comm, s)?),
        None => None,
    };
    let mut e = match &groups {
        Some((shard, replicas)) => {
            Engine::<T>::new_hybrid(shard, replicas, &specs, &init, args.zero.clone())?
        }
        None => Engine::<T>::new(comm, &specs, &init, args.zero.clone())?,
    };
    // The data position: the step index numbers the logs, `micro` picks each micro-batch.
    let (mut start, mut micro) = (0usize, 0usize);
    let mut load_time = None;
    if let Some(dir) = &args.resume {
        let t0 = Instant::now();
        let meta = e.load_checkpoint(dir)?;
        load_time = Some(t0.elapsed());
        let pos = |k: &str| meta.client_state[k].as_u64().map(|v| v as usize);
        match (pos("step"), pos("micro")) {
            (Some(s), Some(m)) => (start, micro) = (s, m),
            _ => {
                return Err(ZeroError::Checkpoint {
                    path: dir.clone(),
                    msg: "its client_state has no demo data position (`step`, `micro`)".into(),
                })
            }
        }
    }
    let teacher = mlp.teacher();
    let names: Vec<[String; 2]> = (0..mlp.layers)
        .map(|l| [format!("w{l}"), format!("b{l}")])
        .collect();
    let mut logs = Vec::new();
    // The engine's: a config may derive it from its batch sizes and the world size.
    let accum = e.config().accumulation_steps;
    for step in start..start + args.steps {
        let t0 = Instant::now();
        let mut loss_sum = 0f64;
        let mut outcome = StepOutcome::Accumulated;
        let lr = e.lr();
        for _ in 0..accum {
            let (x, y) = mlp.batch(&teacher, comm.rank(), micro, args.batch);
            micro += 1;
            loss_sum += micro_step(&mut e, mlp, args.batch, (x, y), &names)?;
            outcome = e.step()?;
        }
        let mut stats = [loss_sum / accum as f64, t0.elapsed().as_secs_f64()];
        comm.all_reduce(InPlace, &mut stats[..1], ReduceOp::Avg)?;
        comm.all_reduce(InPlace, &mut stats[1..], ReduceOp::Max)?;
        let log = StepLog {
            step,
            loss: stats[0],
            outcome,
            loss_scale: e.loss_scale(),
            lr,
            time: Duration::from_secs_f64(stats[1]),
            breakdown: e.report(),
        };
        on_step(&log);
        logs.push(log);
    }
    let mut save_time = None;
    if let Some(dir) = &args.save {
        let position = serde_json::json!({ "step": start + args.steps, "micro": micro });
        let t0 = Instant::now();
        e.save_checkpoint(dir, position)?;
        save_time = Some(t0.elapsed());
    }
    let timed: Vec<&StepLog> = logs.iter().skip(1).collect();
    let mean_step = if timed.is_empty() {
        logs.first().map_or(Duration::ZERO, |l| l.time)
    } else {
        timed.iter().map(|l| l.time).sum::<Duration>() / timed.len() as u32
    };
    let w = e.comm_wait();
    let per = args.steps.max(1) as u32;
    let (memory, formula, numel) = memory_report(comm, &e, args)?;
    Ok(DemoReport {
        steps: logs,
        mean_step,
        gather_wait: w.gather / per,
        reduce_wait: w.reduce / per,
        memory,
        formula,
        numel,
        peak_comm_buffers: e.memory().comm_buffers_peak,
        load_time,
        save_time,
    })
}

/// One micro-step's forward and backward through the engine on the batch `(x, y)`: each layer
/// gathered in turn (the next one in forward-then-backward order prefetched), read, released,
/// and its gradients pushed as backward reaches it. The loss, and the most communication-buffer
/// bytes the engine held meanwhile.
fn micro_step<T: Float>(
    e: &mut Engine<T>,
    mlp: Mlp,
    batch: usize,
    (x, y): (Vec<f32>, Vec<f32>),
    names: &[[String; 2]],
) -> Result<f64, ZeroError> {
    let layer = |l: usize| [names[l][0].as_str(), names[l][1].as_str()];
    // Gather order: forward 0..L, backward L..0.
    let order: Vec<usize> = (0..mlp.layers).chain((0..mlp.layers).rev()).collect();
    // Forward, keeping each layer's input and pre-activation.
    let mut acts = vec![x];
    let mut pre = Vec::new();
    let mut k = 0;
    e.phase(Phase::Forward);
    for l in 0..mlp.layers {
        e.gather(&layer(l))?;
        if let Some(&next) = order.get(k + 1) {
            e.prefetch(&layer(next))?;
        }
        k += 1;
        let (i, o) = mlp.dims(l);
        let z = linear(
            &acts[l],
            &e.param_f32(&names[l][0])?,
            &e.param_f32(&names[l][1])?,
            i,
            o,
        );
        e.release(&layer(l))?;
        let a = if l + 1 == mlp.layers {
            z.clone()
        } else {
            z.iter().map(|v| v.max(0.0)).collect()
        };
        pre.push(z);
        acts.push(a);
    }
    let out = &acts[mlp.layers];
    let denom = (batch * mlp.output) as f32;
    let scale = e.loss_scale();
    let mut dz: Vec<f32> = out
        .iter()
        .zip(&y)
        .map(|(p, t)| (p - t) * scale / denom)
        .collect();
    let loss = out
        .iter()
        .zip(&y)
        .map(|(p, t)| 0.5 * ((p - t) as f64).powi(2))
        .sum::<f64>()
        / denom as f64;
    // Backward.
    e.phase(Phase::Backward);
    for l in (0..mlp.layers).rev() {
        e.gather(&layer(l))?;
        if let Some(&next) = order.get(k + 1) {
            e.prefetch(&layer(next))?;
        }
        k += 1;
        let (i, o) = mlp.dims(l);
        let w = e.param_f32(&names[l][0])?;
        e.release(&layer(l))?;
        let (dw, db, da) = linear_back(&acts[l], &w, &dz, i, o);
        e.push_grad_f32(&names[l][0], &dw)?;
        e.push_grad_f32(&names[l][1], &db)?;
        if l > 0 {
            dz = da
                .iter()
                .zip(&pre[l - 1])
                .map(|(g, z)| if *z > 0.0 { *g } else { 0.0 })
                .collect();
        }
    }
    Ok(loss)
}

/// Every rank's memory by category, and the paper's formula and element counts to set it
/// against.
type MemoryReport = (Vec<Memory>, (f64, f64, f64), (usize, usize));

/// [`MemoryReport`] of `e` (a collective: every rank's memory is all-gathered).
fn memory_report<T: Float>(
    comm: &Communicator,
    e: &Engine<T>,
    args: &DemoArgs,
) -> Result<MemoryReport, ZeroError> {
    let mine = e.memory();
    let mut all = vec![0i64; 4 * comm.size()];
    let own = [mine.params, mine.grads, mine.optimizer, mine.comm_buffers].map(|x| x as i64);
    let mut chunk = vec![0i64; 4];
    chunk.copy_from_slice(&own);
    comm.all_gather(&chunk, &mut all)?;
    let memory = all
        .chunks(4)
        .map(|c| Memory {
            params: c[0] as usize,
            grads: c[1] as usize,
            optimizer: c[2] as usize,
            comm_buffers: c[3] as usize,
            ..Memory::default()
        })
        .collect();
    let padded = e.partition().padded_numel();
    let sixteen = std::mem::size_of::<T>() == 2;
    let f = model_states_with(
        padded as f64,
        e.partition().world,
        args.zero.stage,
        std::mem::size_of::<T>() as f64,
        // The master (16-bit parameters only) and the optimizer's states, 4 bytes each.
        k_for(&args.zero.optimizer) - if sixteen { 0.0 } else { 4.0 },
    )
    .map_err(ZeroError::Config)?;
    Ok((
        memory,
        (f.params, f.grads, f.optimizer),
        (e.partition().numel(), padded),
    ))
}

/// Rank 0's closing text: memory per rank by category against the formula.
pub fn memory_text(r: &DemoReport, stage: u8, precision: Precision) -> String {
    let (p, g, o) = r.formula;
    let (unit, div) = if p + g + o < (1 << 20) as f64 {
        ("KiB", 1024.0)
    } else {
        ("MiB", (1 << 20) as f64)
    };
    let mib = |b: f64| b / div;
    let mut s = format!(
        "memory per rank ({unit}), stage {stage}, {precision}: Ψ = {} parameters ({} with padding)\n",
        r.numel.0, r.numel.1
    );
    s += &format!(
        "{:>6} {:>10} {:>10} {:>11} {:>13} {:>14}\n",
        "rank", "params", "grads", "optimizer", "model states", "comm buffers"
    );
    for (rank, m) in r.memory.iter().enumerate() {
        s += &format!(
            "{:>6} {:>10.3} {:>10.3} {:>11.3} {:>13.3} {:>14.3}\n",
            rank,
            mib(m.params as f64),
            mib(m.grads as f64),
            mib(m.optimizer as f64),
            mib(m.model_states() as f64),
            mib(m.comm_buffers as f64)
        );
    }
    s += &format!(
        "{:>6} {:>10.3} {:>10.3} {:>11.3} {:>13.3}\n",
        "paper",
        mib(p),
        mib(g),
        mib(o),
        mib(p + g + o)
    );
    let exact = r
        .memory
        .iter()
        .all(|m| (m.params as f64, m.grads as f64, m.optimizer as f64) == (p, g, o));
    s += &format!(
        "peak communication buffers on rank 0: {:.3} {unit} (staging, gathered and in-flight buckets)\n",
        mib(r.peak_comm_buffers as f64)
    );
    s += if exact {
        "every rank's model states equal the formula exactly (Ψ padded to a multiple of N per bucket)\n"
    } else {
        "MODEL STATES DIFFER FROM THE FORMULA\n"
    };
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Finite differences agree with the hand-written backward (in f64-ish accuracy of f32).
    #[test]
    fn backward_matches_finite_differences() {
        let (inp, out, rows) = (3, 2, 4);
        let a: Vec<f32> = (0..rows * inp).map(|i| (i as f32 * 0.37).sin()).collect();
        let w: Vec<f32> = (0..out * inp).map(|i| (i as f32 * 0.91).cos()).collect();
        let b = vec![0.1f32, -0.2];
        let loss = |w: &[f32], b: &[f32], a: &[f32]| -> f32 {
            linear(a, w, b, inp, out).iter().map(|z| 0.5 * z * z).sum()
        };
        let z = linear(&a, &w, &b, inp, out);
        let (dw, db, da) = linear_back(&a, &w, &z, inp, out);
        let h = 1e-3;
        for k in 0..w.len() {
            let (mut p, mut m) = (w.clone(), w.clone());
            p[k] += h;
            m[k] -= h;
            let fd = (loss(&p, &b, &a) - loss(&m, &b, &a)) / (2.0 * h);
            assert!((fd - dw[k]).abs() < 2e-2, "dw[{k}]: {fd} vs {}", dw[k]);
        }
        for k in 0..b.len() {
            let (mut p, mut m) = (b.clone(), b.clone());
            p[k] += h;
            m[k] -= h;
            let fd = (loss(&w, &p, &a) - loss(&w, &m, &a)) / (2.0 * h);
            assert!((fd - db[k]).abs() < 2e-2, "db[{k}]");
        }
        for k in 0..a.len() {
            let (mut p, mut m) = (a.clone(), a.clone());
            p[k] += h;
            m[k] -= h;
            let fd = (loss(&w, &b, &p) - loss(&w, &b, &m)) / (2.0 * h);
            assert!((fd - da[k]).abs() < 2e-2, "da[{k}]");
        }
    }

    #[test]
    fn specs_and_init_are_deterministic() {
        let m = Mlp {
            input: 4,
            hidden: 8,
            output: 2,
            layers: 3,
        };
        let s = m.specs();
        assert_eq!(s.len(), 6);
        assert_eq!(s[0].shape, vec![8, 4]);
        assert_eq!(s[4].shape, vec![2, 8]);
        assert_eq!(m.init(0, 5), m.init(0, 5));
        assert_ne!(m.init(0, 5), m.init(0, 6));
        assert_eq!(m.init(1, 3), 0.0);
        let bound = (6.0f32 / 4.0).sqrt();
        assert!((0..32).all(|i| m.init(0, i).abs() <= bound));
    }
}
