//! `ringzero train`: a GPT (candle) trained data-parallel with the ZeRO engine on N local ranks,
//! on a generated character-level corpus.

use std::process::ExitCode;

use anyhow::Context;

use ringzero_candle::gpt::GptConfig;
use ringzero_candle::train::{self, TrainArgs};
use ringzero_collectives::Communicator;
use ringzero_kernels::cpu::Float;
use ringzero_zero::config::Auto;
use ringzero_zero::{Precision, StepOutcome, ZeroConfig};

use super::{join, spawn_self, under_launcher};

#[derive(clap::Args)]
pub(crate) struct TrainCli {
    /// Local ranks to spawn [default: 2] (ignored under a launcher, which decides).
    #[arg(short = 'n', long = "ranks")]
    pub(crate) ranks: Option<usize>,
    /// ZeRO stage 0-3 [default: 2].
    #[arg(long)]
    pub(crate) stage: Option<u8>,
    /// Parameter precision: fp32, bf16 or fp16 [default: fp32].
    #[arg(long)]
    pub(crate) precision: Option<Precision>,
    /// AdamW's learning rate [default: 0.003].
    #[arg(long)]
    pub(crate) lr: Option<f32>,
    /// A DeepSpeed-style JSON config (instead of --stage): its `"auto"` values become this
    /// command's flags' — --precision and --lr where given, their defaults otherwise; a flag
    /// whose value the config sets itself is refused.
    #[arg(long)]
    pub(crate) config: Option<std::path::PathBuf>,
    /// The ZeRO-Offload paper's delayed parameter update after this many optimizer steps (not
    /// a DeepSpeed key): each later step's CPU update runs beside the next forward and backward,
    /// whose gradients are then computed on parameters one update old. Needs the config's
    /// `offload_optimizer` on `cpu` or `nvme` with `ratio` 1; the update in flight lands at the
    /// end of training.
    #[arg(long)]
    pub(crate) delayed_update_after: Option<u64>,
    /// Optimizer steps.
    #[arg(long, default_value_t = 300)]
    pub(crate) steps: usize,
    /// Sequences per rank and micro-step.
    #[arg(long, default_value_t = 8)]
    pub(crate) batch: usize,
    /// Context length.
    #[arg(long, default_value_t = 32)]
    pub(crate) ctx: usize,
    /// Model width.
    #[arg(long, default_value_t = 64)]
    pub(crate) dim: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    pub(crate) heads: usize,
    /// Transformer blocks.
    #[arg(long, default_value_t = 2)]
    pub(crate) layers: usize,
    /// Exit non-zero unless the mean loss of the last 10 steps falls below this, in nats per
    /// character: an untrained model starts near ln(vocabulary) ≈ 3.7; the default run (300
    /// steps, 2 ranks) ends near 0.75.
    #[arg(long, default_value_t = 1.2)]
    pub(crate) threshold: f32,
    /// Print every k-th step (always the first and last).
    #[arg(long, default_value_t = 25)]
    pub(crate) log_every: usize,
    /// Transport: auto, shm or tcp.
    #[arg(long)]
    pub(crate) transport: Option<String>,
    /// Where candle computes: `cpu`, `cuda` (each rank the GPU of its local rank modulo the
    /// GPUs present) or `cuda:N`. CUDA needs a build with the `cuda` feature
    /// (scripts/build-gpu.sh); the engine then runs on that GPU too (its model states in device
    /// memory unless the config offloads them), gradients pass to it without a copy and
    /// parameters back by one device copy.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// Start from this checkpoint (a directory written by --save, at any rank count, stage or
    /// precision): its weights and optimizer state, going on from the step it stopped at.
    #[arg(long, value_name = "DIR")]
    pub(crate) resume: Option<std::path::PathBuf>,
    /// Save a checkpoint in this directory after the last step (`ringzero ckpt consolidate`
    /// turns it into one safetensors file candle loads).
    #[arg(long, value_name = "DIR")]
    pub(crate) save: Option<std::path::PathBuf>,
}

/// Train and report; the exit code says whether the loss fell below the threshold.
pub(crate) fn run(t: TrainCli) -> anyhow::Result<ExitCode> {
    let cfg = config(&t)?;
    if device_ordinal(&t.device, 0)?.is_some() && !cfg!(feature = "cuda") {
        return Err(no_cuda_backend());
    }
    if !under_launcher() {
        return spawn_self(t.ranks.unwrap_or(2), t.transport.as_deref(), None);
    }
    let comm = join("train", t.ranks, t.transport.as_deref(), None)?;
    match cfg.precision {
        Precision::Fp32 => run_as::<f32>(&comm, &t, cfg),
        Precision::Bf16 => run_as::<half::bf16>(&comm, &t, cfg),
        Precision::Fp16 => run_as::<half::f16>(&comm, &t, cfg),
    }
}

/// The engine's configuration, from `--config` or the flags.
fn config(t: &TrainCli) -> anyhow::Result<ZeroConfig> {
    super::check_transport(t.transport.as_deref())?;
    anyhow::ensure!(
        t.steps >= 1 && t.batch >= 1,
        "--steps and --batch must be at least 1"
    );
    anyhow::ensure!(t.log_every >= 1, "--log-every must be at least 1");
    if let Some(dir) = &t.resume {
        anyhow::ensure!(
            dir.is_dir(),
            "--resume {}: no such directory; name one a run wrote with --save",
            dir.display()
        );
    }
    anyhow::ensure!(
        t.heads >= 1 && t.dim.is_multiple_of(t.heads),
        "--dim {} does not divide into --heads {}",
        t.dim,
        t.heads
    );
    anyhow::ensure!(
        t.ctx >= 2 && t.layers >= 1,
        "--ctx must be at least 2 and --layers at least 1"
    );
    let (lr, precision) = (t.lr.unwrap_or(3e-3), t.precision.unwrap_or(Precision::Fp32));
    let mut cfg = match &t.config {
        Some(path) => {
            anyhow::ensure!(
                t.stage.is_none(),
                "--stage and --config both given: set it in one place (the config's \
                 zero_optimization.stage; DeepSpeed has no \"auto\" stage)"
            );
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            super::flags_fill_auto(&text, t.precision.is_some(), t.lr.is_some())?;
            let auto = Auto {
                lr,
                micro_batch: t.batch,
                precision,
                warmup_steps: (t.steps / 10) as u64,
                total_steps: Some(t.steps as u64),
                hidden: Some(t.dim),
                ..Auto::default()
            };
            ZeroConfig::from_json_auto(&text, &auto)
                .with_context(|| format!("{}", path.display()))?
        }
        None => ZeroConfig::builder()
            .stage(t.stage.unwrap_or(2))
            .precision(precision)
            .optimizer(ringzero_kernels::cpu::Optimizer {
                lr,
                weight_decay: 0.01,
                ..Default::default()
            })
            .build()?,
    };
    if let Some(k) = t.delayed_update_after {
        cfg.offload.optimizer.delayed_update_after = Some(k);
        cfg.validate()
            .context("--delayed-update-after: offload the whole optimizer state in --config")?;
    }
    Ok(cfg)
}

fn run_as<T: Float>(
    comm: &Communicator,
    t: &TrainCli,
    cfg: ZeroConfig,
) -> anyhow::Result<ExitCode> {
    let root = comm.rank() == 0;
    let (stage, precision) = (cfg.stage, cfg.precision);
    let device = match device_ordinal(&t.device, comm.config().launch.local_rank)? {
        None => candle_core::Device::Cpu,
        Some(n) => cuda_device(n)
            .with_context(|| format!("rank {}: --device {}", comm.rank(), t.device))?,
    };
    let args = TrainArgs {
        model: GptConfig {
            vocab: 0,
            ctx: t.ctx,
            dim: t.dim,
            heads: t.heads,
            layers: t.layers,
        },
        steps: t.steps,
        batch: cfg.micro_batch.unwrap_or(t.batch),
        device,
        resume: t.resume.clone(),
        save: t.save.clone(),
        ..TrainArgs::default()
    };
    if root {
        println!(
            "GPT {} blocks × width {} ({} heads, context {}), stage {stage}, {precision:?}, {} ranks × {} sequences, on {}",
            t.layers, t.dim, t.heads, t.ctx, comm.size(), args.batch, t.device
        );
        for n in &cfg.notes {
            println!("config: {n}");
        }
        if let Some(dir) = &t.resume {
            println!("resuming from {}", dir.display());
        }
    }
    let mut logged = 0;
    let r = train::train::<T>(comm, cfg, &args, |s| {
        logged += 1;
        if root && (s.step % t.log_every == 0 || logged == 1 || logged == t.steps) {
            let what = match s.outcome {
                StepOutcome::Stepped { grad_norm } => format!("grad norm {grad_norm:.3}"),
                StepOutcome::Skipped { loss_scale } => format!("skipped, loss scale {loss_scale}"),
                StepOutcome::Accumulated => String::new(),
            };
            println!("step {:>4}  loss {:.4}  {what}", s.step, s.loss);
        }
    })?;
    let tail = &r.losses[r.losses.len().saturating_sub(10)..];
    let end = tail.iter().sum::<f32>() / tail.len() as f32;
    let m = r.memory;
    if root {
        println!(
            "{} parameters; {:.0} tokens/s over all ranks ({} tokens in {:.1} s)",
            r.params,
            r.tokens as f64 / r.seconds,
            r.tokens,
            r.seconds
        );
        println!("rank 0 engine memory: {m}");
        if let Some(dir) = &t.save {
            println!("saved a checkpoint in {}", dir.display());
        }
        if let Some(l) = r.last_step {
            let o = l.offload;
            print!(
                "rank 0 last step: {:.1} ms, {:.1} ms of it in the engine's step",
                l.wall.as_secs_f64() * 1e3,
                l.in_step.as_secs_f64() * 1e3
            );
            if o.to_host + o.to_device > 0 {
                print!(
                    "; offload: CPU step {:.1} ms, device waited {:.1} ms, {} B to the host, {} B \
                     to the device",
                    o.cpu_step.as_secs_f64() * 1e3,
                    o.device_wait.as_secs_f64() * 1e3,
                    o.to_host,
                    o.to_device
                );
            }
            println!();
            println!("rank 0 {l}");
        }
        println!("{}", footprint_text(&r));
        println!(
            "rank 0 communication buffers at their peak: predicted {:.2} MiB (these calls \
             replayed before the model was built, as `ringzero mem --gpt` does), counted by the \
             engine {:.2} MiB",
            mib(r.footprint.comm_buffers),
            mib(r.comm_buffers_counted)
        );
        if let Some(a) = r.host_stream_peak {
            println!(
                "rank 0 engine buffers on the host stream at their peak: allocated {:.2} MiB \
                 (measured as made and dropped), counted by the engine {:.2} MiB (model states \
                 and communication buffers); counted / allocated {:.2}",
                mib(a),
                mib(r.engine_counted_peak),
                r.engine_counted_peak as f64 / a.max(1) as f64
            );
        }
        println!(
            "loss {:.4} → {end:.4} (mean of the last {} steps; threshold {})",
            r.losses[0],
            tail.len(),
            t.threshold
        );
    }
    if end < t.threshold {
        Ok(ExitCode::SUCCESS)
    } else {
        if root {
            eprintln!(
                "ringzero train: the loss did not fall below {}",
                t.threshold
            );
        }
        Ok(ExitCode::FAILURE)
    }
}

/// Bytes in MiB.
fn mib(b: usize) -> f64 {
    b as f64 / (1 << 20) as f64
}

/// Rank 0's predicted footprint by category beside the resident memory training added.
fn footprint_text(r: &train::TrainReport) -> String {
    let f = r.footprint;
    let predicted = format!(
        "predicted {:.2} MiB = model states {:.2} + comm buffers {:.2} + ring slots {:.2}{} + \
         candle vars {:.2} + grads {:.2} + activations {:.2} + backward {:.2}",
        mib(f.total()),
        mib(f.model_states),
        mib(f.comm_buffers),
        mib(f.slots),
        match f.device_slots {
            0 => String::new(),
            d => format!(" + device ring slots {:.2}", mib(d)),
        },
        mib(f.vars),
        mib(f.grads),
        mib(f.activations),
        mib(f.backward)
    );
    let host = || match r.measured_peak {
        Some(m) => format!(
            "rank 0 memory added by training at its peak: measured {:.2} MiB (VmHWM over the \
             resident set before the model), {predicted}; measured / predicted {:.2}",
            mib(m),
            m as f64 / f.total().max(1) as f64
        ),
        None => format!("rank 0 memory while training: {predicted} (no /proc here to measure)"),
    };
    match r.device_measured {
        // On a GPU, candle's part and the engine's model states (unless offloaded) live in
        // device memory; the host's resident memory also holds the CUDA libraries candle loads.
        Some((before, peak)) => format!(
            "rank 0 host memory added by training at its peak: {}; predicted on the host (the \
             offload tier, the host communicator's slots) {:.2} MiB (the rest of the resident \
             growth is CUDA's libraries and candle's host copies)\nrank 0 GPU memory (the \
             driver's figure for the process): {:.2} MiB before the model (CUDA's context and \
             libraries, after a warm-up), {:.2} MiB at its largest after backward, {:.2} MiB added; predicted candle vars + grads + \
             activations + backward {:.2} MiB, the engine's model states and buffers {:.2} MiB \
             and its communicator's slots {:.2} MiB; added / predicted {:.2}\n{}",
            r.measured_peak
                .map_or("not measured".into(), |m| format!("{:.2} MiB", mib(m))),
            mib(f.host()),
            mib(before),
            mib(peak),
            mib(peak - before),
            mib(f.candle()),
            mib(f.engine_on_device),
            mib(f.device_slots),
            (peak - before) as f64 / f.device().max(1) as f64,
            device_by_owner(r, peak - before),
        ),
        None => host(),
    }
}

/// Rank 0's added GPU memory by owner: candle's tensors at their peak and what its memory
/// pool reserved around them, ringzero's own allocations, and the rest (CUDA's libraries).
fn device_by_owner(r: &train::TrainReport, added: usize) -> String {
    let f = &r.footprint;
    let pool = match r.device_pool_peak {
        None => "candle's pool not read".to_string(),
        Some(p) => format!(
            "candle's tensors {:.2} MiB at their peak (the CUDA memory pool's high-water mark; \
             / predicted {:.2}), the pool's reservation {:.2} MiB at its peak (those tensors and \
             the free blocks it kept between them)",
            mib(p.used),
            p.used as f64 / f.candle().max(1) as f64,
            mib(p.reserved),
        ),
    };
    let ours = match r.device_engine_peak {
        None => "ringzero's allocations not counted".to_string(),
        Some((e, _)) => format!(
            "ringzero's allocations {:.2} MiB at their peak (/ predicted engine and its \
             communicator's slots {:.2})",
            mib(e),
            e as f64 / (f.engine_on_device + f.device_slots).max(1) as f64
        ),
    };
    let rest = match (r.device_pool_peak, r.device_engine_peak) {
        (Some(p), Some((e, mapped))) => format!(
            "; the rest of the added memory {:.2} MiB (CUDA's libraries: cuBLAS's workspaces, \
             loaded kernels; and whatever of the other ranks' memory the driver lists here: \
             {:.2} MiB of it mapped at the peak for direct collectives)",
            mib(added) - mib(p.reserved) - mib(e),
            mib(mapped)
        ),
        _ => String::new(),
    };
    format!("rank 0 GPU memory by owner: {pool}; {ours}{rest}")
}

/// `--device`: `None` for the CPU, else the CUDA ordinal (`cuda` takes the local rank's turn
/// among the GPUs present, which is checked when the device opens).
fn device_ordinal(spec: &str, local_rank: usize) -> anyhow::Result<Option<usize>> {
    match spec {
        "cpu" => Ok(None),
        "cuda" => Ok(Some(match ringzero_kernels::device::cuda::device_count() {
            Ok(n) => local_rank % n,
            Err(_) => 0,
        })),
        _ => match spec.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => Ok(Some(n)),
            _ => anyhow::bail!("--device {spec:?}: say cpu, cuda or cuda:N (N a GPU's ordinal)"),
        },
    }
}

#[cfg(feature = "cuda")]
fn cuda_device(ordinal: usize) -> anyhow::Result<candle_core::Device> {
    // The driver probed first: candle's own load of a missing libcuda panics.
    let n = ringzero_kernels::device::cuda::device_count()?;
    anyhow::ensure!(
        ordinal < n,
        "GPU {ordinal} asked for, and the driver reports {n}: use cuda:0 to cuda:{}",
        n - 1
    );
    Ok(candle_core::Device::new_cuda(ordinal)?)
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(_: usize) -> anyhow::Result<candle_core::Device> {
    Err(no_cuda_backend())
}

/// `--device cuda` in a build without candle's CUDA backend.
fn no_cuda_backend() -> anyhow::Error {
    anyhow::anyhow!(
        "this ringzero was built without candle's CUDA backend: build it with \
         `bash scripts/build-gpu.sh` (cargo's `--features cuda`, CUDA's compiler from PyPI), or \
         train with --device cpu"
    )
}

#[cfg(test)]
mod tests {
    use ringzero_candle::memory::{Footprint, PoolPeak};
    use ringzero_candle::train::TrainReport;

    use super::footprint_text;

    const MIB: usize = 1 << 20;

    #[test]
    fn a_gpu_report_splits_the_drivers_figure_by_owner() {
        let footprint = Footprint {
            vars: 100 * MIB,
            grads: 100 * MIB,
            activations: 400 * MIB,
            backward: 20 * MIB,
            model_states: 50 * MIB,
            engine_on_device: 34 * MIB,
            device_slots: 16 * MIB,
            ..Footprint::default()
        };
        let r = TrainReport {
            losses: vec![1.0],
            tokens: 1,
            seconds: 1.0,
            memory: Default::default(),
            params: 1,
            footprint,
            comm_buffers_counted: 0,
            measured_peak: None,
            // 588 MiB of context, 1 482 at the peak: 894 added.
            device_measured: Some((588 * MIB, 1482 * MIB)),
            device_pool_peak: Some(PoolPeak {
                used: 620 * MIB,
                reserved: 700 * MIB,
            }),
            device_engine_peak: Some((100 * MIB, 50 * MIB)),
            host_stream_peak: None,
            engine_counted_peak: 0,
            last_step: None,
        };
        let text = footprint_text(&r);
        for want in [
            "894.00 MiB added",
            "predicted candle vars + grads + activations + backward 620.00 MiB",
            "candle's tensors 620.00 MiB at their peak",
            "/ predicted 1.00)",
            "the pool's reservation 700.00 MiB",
            "its communicator's slots 16.00 MiB; added / predicted 1.33",
            "ringzero's allocations 100.00 MiB at their peak (/ predicted engine and its \
             communicator's slots 2.00)",
            "the rest of the added memory 94.00 MiB",
            "50.00 MiB of it mapped at the peak",
        ] {
            assert!(text.contains(want), "{want:?} missing from:\n{text}");
        }
        // Without the pool's or ringzero's figures, the split says so and computes no rest.
        let r = TrainReport {
            device_pool_peak: None,
            device_engine_peak: None,
            ..r
        };
        let text = footprint_text(&r);
        assert!(text.contains("candle's pool not read"), "{text}");
        assert!(!text.contains("the rest of the added"), "{text}");
    }
}
