//! The `ringzero` binary.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use ringzero_collectives::{config::parse_bytes, Communicator};
use ringzero_tools::{check, launch};

#[derive(Parser)]
#[command(
    name = "ringzero",
    version,
    about = "Ring collectives over shared memory and TCP, written from scratch"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run N local ranks of a command with the ringzero launcher environment.
    Launch {
        /// Number of ranks.
        #[arg(short = 'n', long = "ranks", default_value_t = 4)]
        ranks: usize,
        /// Split the ranks into this many fake nodes (TCP between them, shm inside).
        #[arg(long, default_value_t = 1)]
        nodes: usize,
        /// Seconds the other ranks get to stop by themselves after one fails.
        #[arg(long, default_value_t = 5.0)]
        grace: f64,
        /// Where the ranks write their flight records (`RINGZERO_DUMP_DIR`). Default: that
        /// variable if set, else a new directory under the temporary directory, removed when the
        /// job succeeds and named when it fails.
        #[arg(long, value_name = "DIR")]
        dump_dir: Option<std::path::PathBuf>,
        /// The command and its arguments.
        #[arg(last = true, required = true)]
        cmd: Vec<std::ffi::OsString>,
    },
    /// Benchmark collectives against the ring's α–β model (nccl-tests semantics). Spawns its own
    /// local ranks unless run under a launcher.
    Bench(BenchCli),
    /// Diagnose why multi-GPU communication hangs or crawls: host, IOMMU, PCI topology, ACS, probes.
    /// Exit code 0 OK, 1 degraded, 2 broken.
    Diag {
        /// Read sysfs from here (fixtures, captured trees).
        #[arg(long, default_value = "/sys")]
        sysfs_root: std::path::PathBuf,
        /// Read procfs from here.
        #[arg(long, default_value = "/proc")]
        procfs_root: std::path::PathBuf,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        /// Probes to run in child processes (comma-separated: shm, tcp, cuda; `none` for none).
        /// `cuda` lists the devices and peer facts, then probes peer copies, pinned host copies,
        /// CUDA IPC and ringzero's ring on device buffers (skipped, and said so, without a GPU).
        #[arg(long, default_value = "shm,tcp,cuda")]
        probes: String,
        /// Seconds before the watchdog kills a probe and calls it HANG.
        #[arg(long, default_value_t = 20.0)]
        probe_timeout: f64,
        /// Instead of examining this machine, join the flight records a failed job's ranks wrote
        /// to this directory (`RINGZERO_DUMP_DIR`; `ringzero launch` prints it) and name the rank
        /// that was missing, late or calling something else.
        #[arg(long, value_name = "DIR", conflicts_with_all = ["sysfs_root", "procfs_root", "probes", "probe_timeout"])]
        flight: Option<std::path::PathBuf>,
    },
    /// ZeRO memory and communication estimator (the paper's model-state formulas, mixed-precision
    /// Adam).
    Mem {
        /// Parameters: 7.5B, 350M, 1.3e9, ...
        #[arg(long = "params", value_parser = count)]
        params: f64,
        /// Data-parallel ranks.
        #[arg(long = "dp", default_value_t = 1)]
        dp: usize,
        /// One stage (0-3); all stages when omitted.
        #[arg(long)]
        stage: Option<u8>,
        /// Optimizer bytes per parameter (12 for mixed-precision Adam).
        #[arg(long, default_value_t = ringzero_zero::mem::K_ADAM)]
        k: f64,
        /// Hybrid sharding (MiCS's `mics_shard_size`, FSDP's HYBRID_SHARD): shard over groups of
        /// S ranks and replicate across the --dp/S groups; adds the traffic between groups.
        #[arg(long = "shard-size", value_name = "S")]
        shard_size: Option<usize>,
    },
    /// ZeRO checkpoints: check one, or consolidate its shards into one file of full weights.
    Ckpt {
        #[command(subcommand)]
        cmd: CkptCmd,
    },
    /// Train a small MLP with the ZeRO engine on N local ranks (any stage and precision), printing
    /// loss per step and per-rank memory against the paper's formula.
    Demo(DemoCli),
    /// On a machine with an NVIDIA GPU: every CUDA kernel against the CPU kernels, then bandwidth
    /// micro-benchmarks; prints a PASS/FAIL table (what scripts/gpu-check.sh runs).
    GpuCheck {
        /// Device ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
        /// Also write the rows as JSON here.
        #[arg(long)]
        json: Option<std::path::PathBuf>,
        /// Skip the micro-benchmarks.
        #[arg(long)]
        no_bench: bool,
        /// Only the kernels (and their micro-benchmarks): skip the collectives on device buffers.
        #[arg(long, conflicts_with = "host_stream")]
        kernels_only: bool,
        /// A dry run without a GPU: the collective checks on the host stream (the device engine
        /// with the host as its device; host staging, tcp, a killed rank), no kernels, no
        /// bandwidth. It tests the checks themselves.
        #[arg(long)]
        host_stream: bool,
        /// Counts up to 4099 elements in 4 KiB slices instead of up to 2^20+7 in the default
        /// slices (the dry run's sizes).
        #[arg(long)]
        quick: bool,
    },
    /// One rank of gpu-check's collective checks (run by `gpu-check` under the launcher).
    #[command(hide = true)]
    GpuCollectives {
        /// Device ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
        /// Rank 0 writes its rows here as JSON.
        #[arg(long)]
        rows: std::path::PathBuf,
        /// Skip the bandwidth measurement.
        #[arg(long)]
        no_bench: bool,
        /// Instead of the checks: all-reduce in a loop while this rank kills itself.
        #[arg(long)]
        kill_rank: Option<usize>,
        /// On the host stream instead of a GPU.
        #[arg(long)]
        host_stream: bool,
        /// The quick counts.
        #[arg(long)]
        quick: bool,
    },
    /// Run one diag probe (used by `ringzero diag` in a child process).
    #[command(hide = true)]
    DiagProbe {
        /// Probe name.
        name: String,
    },
    /// One rank of diag's ring probe on device buffers (run by `diag-probe cuda-ring…`).
    #[command(hide = true)]
    DiagRingRank {
        /// Rank 0's and rank 1's device ordinals (`0,1`; `0,0` shares one GPU).
        #[arg(long, value_delimiter = ',', required = true)]
        devices: Vec<usize>,
    },
    /// Checked all-reduce sweep (run it under `ringzero launch`): every result is verified exactly.
    Check {
        /// Smallest size (bytes; K/M/G suffixes).
        #[arg(short = 'b', long, default_value = "4K", value_parser = size)]
        min_bytes: usize,
        /// Largest size.
        #[arg(short = 'e', long, default_value = "16M", value_parser = size)]
        max_bytes: usize,
        /// Multiplier between sizes.
        #[arg(short = 'f', long, default_value_t = 4)]
        factor: usize,
        /// Timed iterations per size.
        #[arg(long, default_value_t = 5)]
        iters: usize,
    },
}

#[derive(clap::Args)]
struct DemoCli {
    /// Local ranks to spawn (ignored under a launcher, which decides).
    #[arg(short = 'n', long = "ranks")]
    ranks: Option<usize>,
    /// ZeRO stage 0-3 [default: 2].
    #[arg(long)]
    stage: Option<u8>,
    /// Parameter precision: fp32, bf16 or fp16 [default: bf16].
    #[arg(long)]
    precision: Option<ringzero_zero::Precision>,
    /// Learning rate [default: 0.003].
    #[arg(long)]
    lr: Option<f32>,
    /// A DeepSpeed-style JSON config (instead of --stage/--precision/--lr).
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// Optimizer steps.
    #[arg(long, default_value_t = 100)]
    steps: usize,
    /// Samples per rank and micro-step.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Input features.
    #[arg(long, default_value_t = 16)]
    input: usize,
    /// Hidden width.
    #[arg(long, default_value_t = 64)]
    hidden: usize,
    /// Outputs.
    #[arg(long, default_value_t = 4)]
    output: usize,
    /// Linear layers.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Stage 3: turn prefetching off.
    #[arg(long)]
    no_prefetch: bool,
    /// Stages 2-3: reduce-scatter gradient buckets in the background.
    #[arg(long)]
    overlap_comm: bool,
    /// Transport: auto, shm or tcp.
    #[arg(long)]
    transport: Option<String>,
    /// Print every k-th step (always the first and last).
    #[arg(long, default_value_t = 10)]
    log_every: usize,
    /// Step-time benchmark: stages 0-3, and stage 3 with prefetch on and off, --steps each.
    #[arg(long)]
    bench: bool,
    /// Start from the checkpoint in DIR (saved by --save, at any world size, stage or
    /// precision); --steps more steps follow.
    #[arg(long, value_name = "DIR", conflicts_with = "bench")]
    resume: Option<std::path::PathBuf>,
    /// Save a checkpoint into DIR after the last step (DIR must not hold one).
    #[arg(long, value_name = "DIR", conflicts_with = "bench")]
    save: Option<std::path::PathBuf>,
    /// Hybrid sharding: shard over groups of S consecutive ranks (a node's), replicate across
    /// the groups; S must divide the world size.
    #[arg(long, value_name = "S")]
    shard_size: Option<usize>,
}

#[derive(Subcommand)]
enum CkptCmd {
    /// Print a checkpoint's layout and state, and check every shard's size, SHA-256 and tensors.
    /// Exit code 1 when a shard is bad.
    Inspect {
        /// The checkpoint directory (the one holding meta.json).
        dir: std::path::PathBuf,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Write every parameter as one safetensors file, named and shaped as declared, assembled
    /// shard by shard (one parameter in memory at a time). Every shard is checked first.
    Consolidate {
        /// The checkpoint directory.
        dir: std::path::PathBuf,
        /// The file to write (replaced atomically if it exists).
        #[arg(short = 'o', long)]
        out: std::path::PathBuf,
        /// fp32 (the masters as they are), bf16 or fp16 (their rounding).
        #[arg(long, default_value = "fp32")]
        dtype: ringzero_zero::Precision,
        /// Also write each parameter's Adam moments, as `<name>.exp_avg` and `<name>.exp_avg_sq`.
        #[arg(long)]
        optimizer: bool,
    },
}

#[derive(clap::Args)]
struct BenchCli {
    /// all-reduce, reduce-scatter, all-gather, broadcast, reduce, all-to-all, all-to-all-v,
    /// all-gather-v, reduce-scatter-v, gather, scatter (balanced counts; root 0), send-recv
    /// (ranks 0↔1, 2↔3, ... exchange), or all (every collective: all but send-recv).
    #[arg(default_value = "all")]
    op: String,
    /// Local ranks to spawn (ignored under a launcher, which decides).
    #[arg(short = 'n', long = "ranks")]
    ranks: Option<usize>,
    /// Smallest size in bytes (K/M/G suffixes).
    #[arg(short = 'b', long = "minbytes", default_value = "4K", value_parser = size)]
    min_bytes: usize,
    /// Largest size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "64M", value_parser = size)]
    max_bytes: usize,
    /// Multiplier between sizes.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 4)]
    factor: usize,
    /// Element type: f32 f64 f16 bf16 i32 i64 u8.
    #[arg(short = 'd', long = "datatype", default_value = "f32")]
    dtype: ringzero_collectives::DType,
    /// Reduce operator: sum prod min max avg.
    #[arg(short = 'o', long = "op", default_value = "sum")]
    redop: ringzero_collectives::ReduceOp,
    /// Transport: auto, shm or tcp (sets RINGZERO_TRANSPORT for the ranks).
    #[arg(long)]
    transport: Option<String>,
    /// TCP connections per tcp ring edge, 1 to 32 (sets RINGZERO_TCP_SOCKETS for the ranks):
    /// edges between nodes, or every edge with --transport tcp.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=32))]
    tcp_sockets: Option<u16>,
    /// Timed iterations per size.
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Warm-up iterations per size.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Which α–β model each line is set against: `row` re-measures α (barriers) and β (every rank
    /// streaming what one link carries in that call) interleaved with the line's timed calls;
    /// `start` uses the model measured once at the start (the header's) for every line.
    #[arg(long, default_value = "row", value_parser = ["row", "start"])]
    model: String,
    /// Where the buffers live: host (the host communicator), cuda (device buffers on this node's
    /// GPUs, rank r on GPU local_rank mod count), host-stream (the device engine with the host as
    /// its device: the device path without a GPU), or auto (cuda when a GPU is found, else host).
    #[arg(long, default_value = "auto")]
    device: String,
    /// Algorithms to set side by side (comma-separated: ring, doubling, halving-doubling, auto):
    /// all-reduce, broadcast, reduce and all-gather-v (doubling: pairwise) run each size by each
    /// in turn, a line per schedule, and the report says which was fastest at each size and, for
    /// the all-reduce, where to set RINGZERO_DOUBLING_MAX and RINGZERO_HALVING_MAX on these
    /// links (for the all-gather-v, RINGZERO_PAIRWISE_MAX). Without it every call runs what
    /// RINGZERO_ALGO picks.
    #[arg(long, value_delimiter = ',')]
    algos: Vec<ringzero_collectives::Algo>,
    /// Write the report as JSON to this file.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Write an SVG plot of bus bandwidth against size.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    /// Bytes each rank streams to measure β.
    #[arg(long, default_value = "16M", value_parser = size, hide = true)]
    probe_bytes: usize,
    /// Testing aid: this rank corrupts one element of every checked result.
    #[arg(long, hide = true)]
    corrupt_rank: Option<usize>,
}

fn count(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let (num, mult) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 1e3),
        Some('M' | 'm') => (&t[..t.len() - 1], 1e6),
        Some('B' | 'b' | 'G' | 'g') => (&t[..t.len() - 1], 1e9),
        Some('T' | 't') => (&t[..t.len() - 1], 1e12),
        _ => (t, 1.0),
    };
    num.parse::<f64>()
        .ok()
        .map(|v| v * mult)
        .filter(|v| v.is_finite() && *v > 0.0)
        .ok_or_else(|| format!("`{s}` is not a parameter count (e.g. 7.5B, 350M, 1.3e9)"))
}

fn size(s: &str) -> Result<usize, String> {
    parse_bytes(s).ok_or_else(|| format!("`{s}` is not a size (e.g. 4096, 64K, 16M)"))
}

/// `--dump-dir`, else `RINGZERO_DUMP_DIR`, else a fresh directory for this job.
fn dump_dir_for_launch(flag: Option<std::path::PathBuf>) -> launch::DumpDir {
    let kept = flag.or_else(|| {
        std::env::var_os("RINGZERO_DUMP_DIR")
            .filter(|d| !d.is_empty())
            .map(Into::into)
    });
    match kept {
        Some(path) => launch::DumpDir {
            path,
            remove_on_success: false,
        },
        None => launch::DumpDir {
            path: std::env::temp_dir().join(format!(
                "ringzero-flight-{}-{:08x}",
                std::process::id(),
                rand::random::<u32>()
            )),
            remove_on_success: true,
        },
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("RINGZERO_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ringzero: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.cmd {
        Cmd::Launch {
            ranks,
            nodes,
            grace,
            dump_dir,
            cmd,
        } => {
            anyhow::ensure!(
                grace.is_finite() && grace >= 0.0,
                "--grace must be a non-negative number of seconds"
            );
            let spec = launch::LaunchSpec {
                ranks,
                nodes,
                program: cmd[0].clone(),
                args: cmd[1..].to_vec(),
                env: vec![],
                grace: Duration::from_secs_f64(grace),
                dump_dir: Some(dump_dir_for_launch(dump_dir)),
            };
            let outcome = launch::launch_interruptible(&spec, launch::Output::Inherit)?;
            Ok(ExitCode::from(outcome.exit_code().clamp(0, 255) as u8))
        }
        Cmd::Bench(b) => bench(b),
        Cmd::Diag {
            sysfs_root,
            procfs_root,
            json,
            probes,
            probe_timeout,
            flight,
        } => {
            if let Some(dir) = flight {
                anyhow::ensure!(dir.is_dir(), "--flight {}: not a directory", dir.display());
                let report = ringzero_tools::diag::flight::join(&dir)?;
                if json {
                    println!("{}", serde_json::to_string_pretty(&report)?);
                } else {
                    print!("{}", ringzero_tools::diag::flight::text(&report));
                }
                return Ok(ExitCode::from(report.exit_code as u8));
            }
            anyhow::ensure!(
                probe_timeout.is_finite() && probe_timeout > 0.0,
                "--probe-timeout must be a positive number of seconds"
            );
            for (flag, p) in [
                ("--sysfs-root", &sysfs_root),
                ("--procfs-root", &procfs_root),
            ] {
                anyhow::ensure!(p.is_dir(), "{flag} {}: not a directory", p.display());
            }
            let probes: Vec<String> = probes
                .split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty() && *p != "none")
                .map(str::to_string)
                .collect();
            for p in &probes {
                anyhow::ensure!(
                    matches!(p.as_str(), "shm" | "tcp" | "cuda" | "hang"),
                    "--probes: unknown probe `{p}` (expected shm, tcp, cuda or none)"
                );
            }
            let args = ringzero_tools::diag::DiagArgs {
                sysfs_root,
                procfs_root,
                probes,
                p2p_disabled: ringzero_collectives::config::env_flag("RINGZERO_P2P_DISABLE")?,
                probe_timeout: Duration::from_secs_f64(probe_timeout),
                exe: std::env::current_exe().context("finding this executable")?,
            };
            let report = ringzero_tools::diag::diagnose(&args, &mut |what| {
                eprintln!("ringzero diag: {what}...")
            })?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", ringzero_tools::diag::text(&report));
            }
            Ok(ExitCode::from(report.exit_code as u8))
        }
        Cmd::Mem {
            params,
            dp,
            stage,
            k,
            shard_size,
        } => {
            anyhow::ensure!(dp >= 1, "--dp must be at least 1");
            anyhow::ensure!(
                k.is_finite() && k >= 0.0,
                "--k must be a non-negative number"
            );
            use ringzero_zero::mem;
            let shard = shard_size.unwrap_or(dp);
            let replicas =
                mem::replicas(dp, shard).map_err(|e| anyhow::anyhow!("--shard-size: {e}"))?;
            let stages: Vec<u8> = match stage {
                Some(s) => vec![s],
                None => vec![0, 1, 2, 3],
            };
            for &s in &stages {
                mem::model_states(params, shard, s, k).map_err(anyhow::Error::msg)?;
            }
            let layout = match shard_size {
                Some(_) => format!(
                    "{dp} data-parallel ranks as {replicas} replicas of a shard group of {shard}"
                ),
                None => format!("{dp} data-parallel ranks"),
            };
            println!(
                "ZeRO model states per rank: {params:.3e} parameters, {layout}, K = {k} \
                 (mixed-precision Adam: 2 B params + 2 B grads + K B optimizer per parameter)"
            );
            let comm_head = if shard_size.is_some() {
                "comm in group (GB)"
            } else {
                "comm/step/rank (GB)"
            };
            print!(
                "{:>6} {:>12} {:>12} {:>14} {:>12} {:>22}",
                "stage", "params GB", "grads GB", "optimizer GB", "total GB", comm_head
            );
            if shard_size.is_some() {
                print!(" {:>22}", "between groups (GB)");
            }
            println!();
            for s in stages {
                let m = mem::model_states(params, shard, s, k).map_err(anyhow::Error::msg)?;
                let c = mem::hybrid_comm_elements_per_step(params, shard, replicas, s);
                print!(
                    "{:>6} {:>12.2} {:>12.2} {:>14.2} {:>12.2} {:>22.2}",
                    s,
                    m.params / 1e9,
                    m.grads / 1e9,
                    m.optimizer / 1e9,
                    m.total() / 1e9,
                    c.group * 2.0 / 1e9
                );
                if shard_size.is_some() {
                    print!(" {:>22.2}", c.replicas * 2.0 / 1e9);
                }
                println!();
            }
            println!("comm: 2Ψ (stages 0-2) or 3Ψ (stage 3) 16-bit elements × (N−1)/N per rank and step, ring collectives");
            if shard_size.is_some() {
                println!(
                    "hybrid: N = the shard group ({shard}); between groups, the gradient average over \
                     the {replicas} replicas: 2·(Ψ/{shard})·(R−1)/R elements (all Ψ in stage 0)"
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Demo(d) => demo(d),
        Cmd::Ckpt { cmd } => ckpt(cmd),
        Cmd::GpuCheck {
            device,
            json,
            no_bench,
            kernels_only,
            host_stream,
            quick,
        } => {
            use ringzero_tools::{gpucheck, gpurun};
            let args = gpurun::GpuCheckArgs {
                device,
                no_bench,
                kernels_only,
                host_stream,
                quick,
            };
            let (name, rows) = gpurun::run(&args).map_err(|e| anyhow::anyhow!("gpu-check: {e}"))?;
            if let Some(path) = json {
                std::fs::write(&path, serde_json::to_string_pretty(&rows)?)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            print!("{}", gpucheck::table(&name, &rows));
            Ok(if rows.iter().all(|r| r.pass) {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Cmd::GpuCollectives {
            device,
            rows,
            no_bench,
            kill_rank,
            host_stream,
            quick,
        } => {
            use ringzero_tools::gpucoll;
            let comm = join("gpu-collectives", None, None, None)?;
            let device = (!host_stream).then_some(device);
            let r = match kill_rank {
                Some(k) => gpucoll::killed_rank_main(&comm, device, k),
                None => {
                    let opts = gpucoll::RunOpts {
                        bench: !no_bench,
                        quick,
                    };
                    gpucoll::rank_main(&comm, device, opts)
                }
            };
            if comm.rank() == 0 {
                std::fs::write(&rows, serde_json::to_string(&r)?)
                    .with_context(|| format!("writing {}", rows.display()))?;
            }
            Ok(if r.iter().all(|x| x.pass) {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Cmd::DiagProbe { name } => {
            let r = ringzero_tools::diag::probe::child(&name);
            println!("{}", serde_json::to_string(&r)?);
            Ok(ExitCode::SUCCESS)
        }
        Cmd::DiagRingRank { devices } => {
            anyhow::ensure!(devices.len() == 2, "--devices takes two ordinals (`0,1`)");
            let r = ringzero_tools::diag::cuda::ring_rank([devices[0], devices[1]]);
            println!("{}", serde_json::to_string(&r)?);
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Check {
            min_bytes,
            max_bytes,
            factor,
            iters,
        } => {
            anyhow::ensure!(
                min_bytes <= max_bytes,
                "-b {min_bytes} is larger than -e {max_bytes}"
            );
            let comm = Communicator::from_env().context("joining the job")?;
            if comm.rank() == 0 {
                println!(
                    "ringzero check: {} ranks, f32 sum all-reduce, out of place",
                    comm.size()
                );
            }
            for e in comm.edges() {
                if e.to == comm.rank() {
                    println!("edge {e}");
                }
            }
            let rows = check::run(
                &comm,
                check::CheckArgs {
                    min_bytes,
                    max_bytes,
                    factor,
                    iters,
                },
            )?;
            let wrong: u64 = rows.iter().map(|r| r.wrong).sum();
            if comm.rank() == 0 {
                print!("{}", check::table(comm.size(), &rows));
                println!(
                    "{}",
                    if wrong == 0 {
                        "all results exact"
                    } else {
                        "WRONG RESULTS"
                    }
                );
            }
            Ok(if wrong == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
    }
}

/// Whether a launcher (ours, torchrun, Slurm, Open MPI) started this process as a rank.
fn under_launcher() -> bool {
    [
        "RINGZERO_RANK",
        "RANK",
        "SLURM_PROCID",
        "OMPI_COMM_WORLD_RANK",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some())
}

/// Run this same command line on `ranks` local ranks under the launcher (rank 0 reports).
fn spawn_self(
    ranks: usize,
    transport: Option<&str>,
    tcp_sockets: Option<u16>,
) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(ranks >= 1, "-n must be at least 1");
    let spec = launch::LaunchSpec {
        ranks,
        nodes: 1,
        program: std::env::current_exe()
            .context("finding this executable")?
            .into(),
        args: std::env::args_os().skip(1).collect(),
        env: transport
            .iter()
            .map(|t| ("RINGZERO_TRANSPORT".to_string(), t.to_string()))
            .chain(tcp_sockets.map(|k| ("RINGZERO_TCP_SOCKETS".to_string(), k.to_string())))
            .collect(),
        grace: Duration::from_secs(5),
        dump_dir: None,
    };
    let outcome = launch::launch(&spec, launch::Output::RankZeroPlain)?;
    Ok(ExitCode::from(outcome.exit_code().clamp(0, 255) as u8))
}

/// Join the job the launcher started, with `--transport` and `--tcp-sockets` applied.
fn join(
    tool: &str,
    ranks: Option<usize>,
    transport: Option<&str>,
    tcp_sockets: Option<u16>,
) -> anyhow::Result<Communicator> {
    let mut cfg =
        ringzero_collectives::Config::from_env().context("reading the launcher environment")?;
    if let Some(k) = tcp_sockets {
        cfg.tcp_sockets = k as usize;
    }
    if let Some(t) = transport {
        cfg.transport = match t {
            "shm" => ringzero_collectives::TransportPref::Shm,
            "tcp" => ringzero_collectives::TransportPref::Tcp,
            _ => ringzero_collectives::TransportPref::Auto,
        };
    }
    let comm = Communicator::init(cfg).context("joining the job")?;
    if let Some(n) = ranks {
        if n != comm.size() && comm.rank() == 0 {
            eprintln!(
                "ringzero {tool}: -n {n} ignored: the launcher started {} ranks",
                comm.size()
            );
        }
    }
    Ok(comm)
}

fn demo(d: DemoCli) -> anyhow::Result<ExitCode> {
    use ringzero_tools::demo::{self, DemoArgs, Mlp};
    use ringzero_zero::{Precision, StepOutcome, ZeroConfig};
    if let Some(t) = &d.transport {
        anyhow::ensure!(
            matches!(t.as_str(), "auto" | "shm" | "tcp"),
            "--transport {t}: expected auto, shm or tcp"
        );
    }
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
            for (flag, given) in [
                ("--stage", d.stage.is_some()),
                ("--precision", d.precision.is_some()),
                ("--lr", d.lr.is_some()),
                ("--shard-size", d.shard_size.is_some()),
            ] {
                anyhow::ensure!(
                    !given,
                    "{flag} and --config both given: set it in one place (the config's key wins nowhere)"
                );
            }
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            ZeroConfig::from_json(&text).with_context(|| format!("{}", path.display()))?
        }
        None => {
            let mut c = ZeroConfig::builder()
                .stage(d.stage.unwrap_or(2))
                .precision(d.precision.unwrap_or(Precision::Bf16))
                .bucket_elems(layer_elems)
                .prefetch_elems(2 * layer_elems)
                .overlap_comm(d.overlap_comm)
                .shard_size(d.shard_size)
                .adamw(ringzero_kernels::cpu::AdamW {
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
    if !under_launcher() {
        return spawn_self(d.ranks.unwrap_or(4), d.transport.as_deref(), None);
    }
    let comm = join("demo", d.ranks, d.transport.as_deref(), None)?;
    let root = comm.rank() == 0;
    if d.bench {
        let mut rows = Vec::new();
        for (stage, prefetch) in [(0u8, true), (1, true), (2, true), (3, true), (3, false)] {
            let mut z = zero.clone();
            z.stage = stage;
            if !prefetch {
                z.prefetch_elems = 0;
            }
            let args = DemoArgs {
                mlp,
                batch: d.batch,
                steps: d.steps,
                zero: z,
                resume: None,
                save: None,
            };
            let r = demo::run(&comm, &args, &mut |_| {})?;
            rows.push((stage, prefetch, r));
        }
        if root {
            println!(
                "ringzero demo --bench: {} ranks, {}, {} layers × {} hidden, batch {}, {} steps (first excluded from the mean)",
                comm.size(), zero.precision, d.layers, d.hidden, d.batch, d.steps
            );
            println!(
                "{:>6} {:>9} {:>13} {:>18} {:>18} {:>11}",
                "stage",
                "prefetch",
                "step (ms)",
                "gather wait (ms)",
                "reduce wait (ms)",
                "final loss"
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
        return Ok(ExitCode::SUCCESS);
    }
    if root {
        println!(
            "ringzero demo: {} ranks, ZeRO stage {}{}, {}, MLP {}→{}×{}→{} ({} layers), batch {} per rank, {} steps; teacher y = A·x (best loss 0)",
            comm.size(), zero.stage,
            zero.shard_size.map_or(String::new(), |s| format!(
                " hybrid (sharded over groups of {s}, {} replicas)",
                comm.size() / s.max(1)
            )),
            zero.precision, d.input, d.hidden, d.layers - 1, d.output, d.layers,
            d.batch, d.steps
        );
        for e in comm.edges().iter().filter(|e| e.to == 0) {
            println!("edge {e}");
        }
        println!(
            "{:>6} {:>12} {:>10} {:>10} {:>10}",
            "step", "loss", "scale", "step ms", ""
        );
    }
    let steps = d.steps;
    let every = d.log_every;
    let args = DemoArgs {
        mlp,
        batch: d.batch,
        steps,
        zero: zero.clone(),
        resume: d.resume.clone(),
        save: d.save.clone(),
    };
    if let (true, Some(dir)) = (root, &d.resume) {
        println!("resuming from the checkpoint in {}", dir.display());
    }
    let mut seen = 0usize;
    let r = demo::run(&comm, &args, &mut |l| {
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
                "{:>6} {:>12.6} {:>10} {:>10.3} {:>10}",
                l.step,
                l.loss,
                l.loss_scale,
                l.time.as_secs_f64() * 1e3,
                what
            );
        }
    })?;
    let first = r.steps.first().map_or(f64::NAN, |l| l.loss);
    let last = r.steps.last().map_or(f64::NAN, |l| l.loss);
    let down = last < first;
    if root {
        print!("{}", demo::memory_text(&r, zero.stage, zero.precision));
        println!(
            "loss {first:.6} → {last:.6} ({:.1}× lower); mean step {:.3} ms; waits per step on rank 0: gather {:.3} ms, reduce {:.3} ms; {} skipped steps",
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

fn ckpt(cmd: CkptCmd) -> anyhow::Result<ExitCode> {
    use ringzero_tools::ckpt;
    match cmd {
        CkptCmd::Inspect { dir, json } => {
            let i = ckpt::inspect(&dir)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&i)?);
            } else {
                print!("{}", ckpt::text(&dir, &i));
            }
            Ok(if i.ok() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        CkptCmd::Consolidate {
            dir,
            out,
            dtype,
            optimizer,
        } => {
            let r = ringzero_zero::checkpoint::consolidate(&dir, &out, dtype, optimizer)?;
            println!(
                "wrote {}: {} tensors, {} parameter elements in {dtype}, {} bytes",
                out.display(),
                r.tensors,
                r.elements,
                r.bytes
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn bench(b: BenchCli) -> anyhow::Result<ExitCode> {
    let ops = ringzero_tools::bench::parse_ops(&b.op).map_err(anyhow::Error::msg)?;
    let sizes = ringzero_tools::bench::sizes(b.min_bytes, b.max_bytes, b.factor)
        .map_err(anyhow::Error::msg)?;
    let device = match b.device.as_str() {
        "host" | "host-stream" => b.device.clone(),
        "cuda" => {
            ringzero_kernels::device::cuda_devices()
                .map_err(|e| anyhow::anyhow!("--device cuda: {e}; run with --device host"))?;
            "cuda".to_string()
        }
        "auto" => match ringzero_kernels::device::cuda_devices() {
            Ok(_) => "cuda".to_string(),
            Err(_) => "host".to_string(),
        },
        other => anyhow::bail!("--device {other}: expected host, cuda, host-stream or auto"),
    };
    if let Some(t) = &b.transport {
        anyhow::ensure!(
            matches!(t.as_str(), "auto" | "shm" | "tcp"),
            "--transport {t}: expected auto, shm or tcp"
        );
    }
    anyhow::ensure!(b.iters > 0, "--iters must be at least 1");
    if !under_launcher() {
        let n = b.ranks.unwrap_or(4);
        // Refused before any rank starts (under a launcher, bench::run refuses it on every rank).
        anyhow::ensure!(
            !ops.contains(&ringzero_collectives::Collective::SendRecv) || n.is_multiple_of(2),
            "send-recv pairs ranks 0↔1, 2↔3, ...: run it on an even number of ranks, not -n {n}"
        );
        return spawn_self(n, b.transport.as_deref(), b.tcp_sockets);
    }
    let comm = join("bench", b.ranks, b.transport.as_deref(), b.tcp_sockets)?;
    let args = ringzero_tools::bench::BenchArgs {
        ops,
        sweep: ringzero_tools::bench::sweep::SweepArgs {
            dtype: b.dtype,
            redop: b.redop,
            sizes,
            iters: b.iters,
            warmup: b.warmup,
            corrupt_rank: b.corrupt_rank,
            model_per_row: b.model == "row",
            algos: b.algos.clone(),
        },
        probe_bytes: b.probe_bytes,
    };
    let bar = if comm.rank() == 0 {
        let pb = indicatif::ProgressBar::new((args.ops.len() * args.sweep.sizes.len()) as u64);
        pb.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} {bar:40} {pos}/{len} sizes, {elapsed}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        Some(pb)
    } else {
        None
    };
    let mut progress = |done: usize, _| {
        if let Some(pb) = &bar {
            pb.set_position(done as u64);
        }
    };
    let report = match device.as_str() {
        "cuda" => {
            let n = ringzero_kernels::device::cuda_devices()
                .map_err(|e| anyhow::anyhow!("--device cuda: {e}"))?;
            let ordinal = comm.config().launch.local_rank % n;
            let gpu = ringzero_kernels::device::cuda::Gpu::open(ordinal)
                .map_err(|e| anyhow::anyhow!("opening cuda:{ordinal}: {e}"))?;
            let name = format!("cuda:{ordinal} ({})", gpu.name().unwrap_or_default());
            let mut dc = ringzero_collectives::DeviceComm::new(&comm, gpu)
                .context("connecting the device communicator")?;
            ringzero_tools::bench::run_device(&comm, &mut dc, &args, name, &mut progress)?
        }
        "host-stream" => {
            let mut dc = ringzero_collectives::DeviceComm::new(
                &comm,
                ringzero_collectives::HostStream::new(),
            )
            .context("connecting the device communicator")?;
            ringzero_tools::bench::run_device(
                &comm,
                &mut dc,
                &args,
                "host-stream (device engine on the host)".into(),
                &mut progress,
            )?
        }
        _ => ringzero_tools::bench::run(&comm, &args, &mut progress)?,
    };
    if let Some(pb) = bar {
        pb.finish_and_clear();
    }
    let wrong: u64 = report.rows.iter().map(|r| r.wrong).sum();
    if comm.rank() == 0 {
        print!("{}", ringzero_tools::bench::text(&report));
        if let Some(path) = &b.json {
            let doc = serde_json::to_string_pretty(&report)?;
            std::fs::write(path, doc).with_context(|| format!("writing {}", path.display()))?;
        }
        if let Some(path) = &b.plot {
            ringzero_tools::bench::plot::write_svg(&report, path)
                .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
        }
    }
    Ok(if wrong == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
