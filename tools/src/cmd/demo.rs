//! `ringzero demo`: train an MLP with the ZeRO engine on N local ranks.

use std::process::ExitCode;

use anyhow::Context;

use ringzero_collectives::Communicator;
use ringzero_tools::demo::{self, DemoArgs, Mlp};
use ringzero_zero::config::Auto;
use ringzero_zero::{Precision, StepOutcome, ZeroConfig};

use super::{join, spawn_self, under_launcher};

#[derive(clap::Args)]
pub(crate) struct DemoCli {
    /// Local ranks to spawn (ignored under a launcher, which decides).
    #[arg(short = 'n', long = "ranks")]
    pub(crate) ranks: Option<usize>,
    /// ZeRO stage 0-3 [default: 2].
    #[arg(long)]
    pub(crate) stage: Option<u8>,
    /// Parameter precision: fp32, bf16 or fp16 [default: bf16].
    #[arg(long)]
    pub(crate) precision: Option<ringzero_zero::Precision>,
    /// Learning rate [default: 0.003].
    #[arg(long)]
    pub(crate) lr: Option<f32>,
    /// A DeepSpeed-style JSON config (instead of --stage and --shard-size): its `"auto"` values
    /// become this command's flags' — --precision and --lr where given, their defaults
    /// otherwise; a flag whose value the config sets itself is refused.
    #[arg(long)]
    pub(crate) config: Option<std::path::PathBuf>,
    /// Optimizer steps.
    #[arg(long, default_value_t = 100)]
    pub(crate) steps: usize,
    /// Samples per rank and micro-step (with `--config`, its `train_micro_batch_size_per_gpu`
    /// when set; `"auto"` there becomes this).
    #[arg(long, default_value_t = 32)]
    pub(crate) batch: usize,
    /// Input features.
    #[arg(long, default_value_t = 16)]
    pub(crate) input: usize,
    /// Hidden width.
    #[arg(long, default_value_t = 64)]
    pub(crate) hidden: usize,
    /// Outputs.
    #[arg(long, default_value_t = 4)]
    pub(crate) output: usize,
    /// Linear layers.
    #[arg(long, default_value_t = 4)]
    pub(crate) layers: usize,
    /// Stage 3: turn prefetching off.
    #[arg(long)]
    pub(crate) no_prefetch: bool,
    /// Stages 2-3: reduce-scatter gradient buckets in the background.
    #[arg(long)]
    pub(crate) overlap_comm: bool,
    /// Transport: auto, shm or tcp.
    #[arg(long)]
    pub(crate) transport: Option<String>,
    /// Print every k-th step (always the first and last).
    #[arg(long, default_value_t = 10)]
    pub(crate) log_every: usize,
    /// Step-time benchmark: stages 0-3, and stage 3 with prefetch on and off, --steps each.
    #[arg(long)]
    pub(crate) bench: bool,
    /// Start from the checkpoint in DIR (saved by --save, at any world size, stage or
    /// precision); --steps more steps follow.
    #[arg(long, value_name = "DIR", conflicts_with = "bench")]
    pub(crate) resume: Option<std::path::PathBuf>,
    /// Save a checkpoint into DIR after the last step (DIR must not hold one).
    #[arg(long, value_name = "DIR", conflicts_with = "bench")]
    pub(crate) save: Option<std::path::PathBuf>,
    /// Hybrid sharding: shard over groups of S consecutive ranks (a node's), replicate across
    /// the groups; S must divide the world size.
    #[arg(long, value_name = "S")]
    pub(crate) shard_size: Option<usize>,
}

/// Train (or, with `--bench`, time every stage) and report.
pub(crate) fn run(d: DemoCli) -> anyhow::Result<ExitCode> {
    let (mlp, zero) = setup(&d)?;
    if !under_launcher() {
        return spawn_self(d.ranks.unwrap_or(4), d.transport.as_deref(), None);
    }
    let comm = join("demo", d.ranks, d.transport.as_deref(), None)?;
    if d.bench {
        bench(&comm, &d, mlp, &zero)?;
        return Ok(ExitCode::SUCCESS);
    }
    train(&comm, &d, mlp, zero)
}

/// The arguments checked, the model and the engine's configuration (from `--config`, or from
/// the flags).
fn setup(d: &DemoCli) -> anyhow::Result<(Mlp, ZeroConfig)> {
    super::check_transport(d.transport.as_deref())?;
    anyhow::ensure!(d.steps >= 1, "--steps must be at least 1");
    anyhow::ensure!(d.log_every >= 1, "--log-every must be at least 1");
    let mlp = Mlp {
        input: d.input,
        hidden: d.hidden,
        output: d.output,
        layers: d.layers,
    };
    anyhow::ensure!(d.layers >= 2, "--layers must be at least 2");
    anyhow::ensure!(
        d.input > 0 && d.hidden > 0 && d.output > 0 && d.batch > 0,
        "--input, --hidden, --output and --batch must be at least 1"
    );
    // One layer's weights and bias per bucket, so stage 3 gathers layer by layer.
    let layer_elems = (0..d.layers)
        .map(|l| {
            let (i, o) = mlp.dims(l);
            i * o + o
        })
        .max()
        .unwrap_or(1);
    let mut zero = match &d.config {
        Some(path) => {
            for (flag, key, given) in [
                ("--stage", "zero_optimization.stage", d.stage.is_some()),
                (
                    "--shard-size",
                    "zero_optimization.mics_shard_size",
                    d.shard_size.is_some(),
                ),
            ] {
                anyhow::ensure!(
                    !given,
                    "{flag} and --config both given: set it in one place (the config's {key})"
                );
            }
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            super::flags_fill_auto(&text, d.precision.is_some(), d.lr.is_some())?;
            // "auto" becomes the flags' values (or the demo's defaults), as Hugging Face's
            // Trainer fills it from its own arguments.
            let auto = Auto {
                lr: d.lr.unwrap_or(3e-3),
                micro_batch: d.batch,
                precision: d.precision.unwrap_or(Precision::Bf16),
                warmup_steps: (d.steps / 10) as u64,
                total_steps: Some(d.steps as u64),
                hidden: Some(d.hidden),
                ..Auto::default()
            };
            ZeroConfig::from_json_auto(&text, &auto)
                .with_context(|| format!("{}", path.display()))?
        }
        None => {
            let mut c = ZeroConfig::builder()
                .stage(d.stage.unwrap_or(2))
                .precision(d.precision.unwrap_or(Precision::Bf16))
                .bucket_elems(layer_elems)
                .prefetch_elems(2 * layer_elems)
                .overlap_comm(d.overlap_comm)
                .shard_size(d.shard_size)
                .optimizer(ringzero_kernels::cpu::Optimizer {
                    lr: d.lr.unwrap_or(3e-3),
                    weight_decay: 0.0,
                    ..Default::default()
                })
                .build()?;
            c.loss_scaling.hysteresis = 1;
            c
        }
    };
    if d.no_prefetch {
        zero.prefetch_elems = 0;
    }
    if d.overlap_comm {
        zero.overlap_comm = true;
    }
    Ok((mlp, zero))
}

/// `--bench`: every stage (stage 3 with and without prefetch) timed on the same model; rank 0
/// prints a row each and what prefetch hid.
fn bench(comm: &Communicator, d: &DemoCli, mlp: Mlp, zero: &ZeroConfig) -> anyhow::Result<()> {
    let root = comm.rank() == 0;
    let batch = zero.micro_batch.unwrap_or(d.batch);
    let mut rows = Vec::new();
    for (stage, prefetch) in [(0u8, true), (1, true), (2, true), (3, true), (3, false)] {
        let mut z = zero.clone();
        z.stage = stage;
        if !prefetch {
            z.prefetch_elems = 0;
        }
        let args = DemoArgs {
            mlp,
            batch,
            steps: d.steps,
            zero: z,
            resume: None,
            save: None,
        };
        let r = demo::run(comm, &args, &mut |_| {})?;
        rows.push((stage, prefetch, r));
    }
    if root {
        println!(
            "ringzero demo --bench: {} ranks, {}, {} layers × {} hidden, batch {}, {} steps (first excluded from the mean)",
            comm.size(), zero.precision, d.layers, d.hidden, batch, d.steps
        );
        println!(
            "{:>6} {:>9} {:>13} {:>18} {:>18} {:>11}",
            "stage", "prefetch", "step (ms)", "gather wait (ms)", "reduce wait (ms)", "final loss"
        );
        for (stage, prefetch, r) in &rows {
            println!(
                "{:>6} {:>9} {:>13.3} {:>18.3} {:>18.3} {:>11.5}",
                stage,
                if *stage == 3 {
                    if *prefetch {
                        "on"
                    } else {
                        "off"
                    }
                } else {
                    "-"
                },
                r.mean_step.as_secs_f64() * 1e3,
                r.gather_wait.as_secs_f64() * 1e3,
                r.reduce_wait.as_secs_f64() * 1e3,
                r.steps.last().map_or(f64::NAN, |l| l.loss)
            );
        }
        let on = &rows[3].2;
        let off = &rows[4].2;
        let (won, woff) = (on.gather_wait.as_secs_f64(), off.gather_wait.as_secs_f64());
        if woff > 0.0 {
            println!(
                "stage 3: prefetch hides {:.0}% of the parameter-gather wait (rank 0: {:.3} → {:.3} ms per step); step time {:.3} → {:.3} ms",
                100.0 * (1.0 - won / woff),
                woff * 1e3,
                won * 1e3,
                off.mean_step.as_secs_f64() * 1e3,
                on.mean_step.as_secs_f64() * 1e3
            );
        }
    }
    Ok(())
}

/// Train, print the loss as it goes, memory against the formula and the checkpoint's timings;
/// fails unless the loss went down.
fn train(comm: &Communicator, d: &DemoCli, mlp: Mlp, zero: ZeroConfig) -> anyhow::Result<ExitCode> {
    let root = comm.rank() == 0;
    // A config's `train_micro_batch_size_per_gpu` is the batch ("auto" became `--batch`).
    let batch = zero.micro_batch.unwrap_or(d.batch);
    if root {
        println!(
            "ringzero demo: {} ranks, ZeRO stage {}{}, {}, MLP {}→{}×{}→{} ({} layers), batch {} per rank, {} steps; teacher y = A·x (best loss 0)",
            comm.size(), zero.stage,
            zero.shard_size.map_or(String::new(), |s| format!(
                " hybrid (sharded over groups of {s}, {} replicas)",
                comm.size() / s.max(1)
            )),
            zero.precision, d.input, d.hidden, d.layers - 1, d.output, d.layers,
            batch, d.steps
        );
        for e in comm.edges().iter().filter(|e| e.to == 0) {
            println!("edge {e}");
        }
        for n in &zero.notes {
            println!("config: {n}");
        }
        println!(
            "{:>6} {:>12} {:>10} {:>10} {:>10} {:>10}",
            "step", "loss", "scale", "lr", "step ms", ""
        );
    }
    let steps = d.steps;
    let every = d.log_every;
    let args = DemoArgs {
        mlp,
        batch,
        steps,
        zero: zero.clone(),
        resume: d.resume.clone(),
        save: d.save.clone(),
    };
    if let (true, Some(dir)) = (root, &d.resume) {
        println!("resuming from the checkpoint in {}", dir.display());
    }
    let mut seen = 0usize;
    let r = demo::run(comm, &args, &mut |l| {
        seen += 1;
        if root
            && (l.step % every == 0
                || seen == steps
                || matches!(l.outcome, StepOutcome::Skipped { .. }))
        {
            let what = match l.outcome {
                StepOutcome::Skipped { .. } => "skipped (overflow)",
                _ => "",
            };
            println!(
                "{:>6} {:>12.6} {:>10} {:>10.3e} {:>10.3} {:>10}",
                l.step,
                l.loss,
                l.loss_scale,
                l.lr,
                l.time.as_secs_f64() * 1e3,
                what
            );
            // DeepSpeed's `wall_clock_breakdown`: where rank 0's step went.
            if let (true, Some(b)) = (zero.wall_clock_breakdown, &l.breakdown) {
                println!("       {b}");
            }
        }
    })?;
    // The mean loss of the first and of the last quarter of the steps: a small micro batch
    // makes one step's loss noise (a published config trains on 1 sample per rank).
    let w = (r.steps.len() / 4).max(1);
    let mean = |s: &[demo::StepLog]| s.iter().map(|l| l.loss).sum::<f64>() / s.len() as f64;
    let first = mean(&r.steps[..w.min(r.steps.len())]);
    let last = mean(&r.steps[r.steps.len().saturating_sub(w)..]);
    let down = last < first;
    if root {
        print!("{}", demo::memory_text(&r, zero.stage, zero.precision));
        println!(
            "loss {first:.6} → {last:.6} ({:.1}× lower; means of the first and last {w} steps); mean step {:.3} ms; waits per step on rank 0: gather {:.3} ms, reduce {:.3} ms; {} skipped steps",
            first / last,
            r.mean_step.as_secs_f64() * 1e3,
            r.gather_wait.as_secs_f64() * 1e3,
            r.reduce_wait.as_secs_f64() * 1e3,
            r.steps.iter().filter(|l| matches!(l.outcome, StepOutcome::Skipped { .. })).count()
        );
        println!(
            "{}",
            if down {
                "loss went down"
            } else {
                "LOSS DID NOT GO DOWN"
            }
        );
        let shard = |dir: &std::path::Path| {
            let f = ringzero_zero::checkpoint::shard_file(0, comm.size());
            std::fs::metadata(dir.join(f)).map_or(0, |m| m.len()) as f64 / (1u64 << 20) as f64
        };
        if let Some(t) = r.load_time {
            println!(
                "loaded the checkpoint in {:.1} ms on rank 0",
                t.as_secs_f64() * 1e3
            );
        }
        if let (Some(dir), Some(t)) = (&d.save, r.save_time) {
            println!(
                "saved a checkpoint in {} ({:.1} ms; rank 0's shard {:.2} MiB, {:.0} MiB/s)",
                dir.display(),
                t.as_secs_f64() * 1e3,
                shard(dir),
                shard(dir) / t.as_secs_f64()
            );
        }
    }
    Ok(if down {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
