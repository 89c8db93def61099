//! The `ringzero` binary: parses the command line and dispatches to its subcommands (`cmd/`).

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cmd;

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
    Launch(cmd::launch_cmd::LaunchCli),
    /// Benchmark collectives against the ring's α–β model (nccl-tests semantics). Spawns its own
    /// local ranks unless run under a launcher.
    Bench(cmd::bench::BenchCli),
    /// Diagnose why multi-GPU communication hangs or crawls: host, IOMMU, PCI topology, ACS, probes.
    /// Exit code 0 OK, 1 degraded, 2 broken.
    Diag(cmd::diag::DiagCli),
    /// ZeRO memory and communication estimator (the paper's model-state formulas, mixed-precision
    /// Adam).
    Mem(cmd::mem::MemCli),
    /// The NVMe offload tier's throughput on a directory against a plain direct-I/O copy of the
    /// same bytes, in one run (what `offload_optimizer.nvme_path` and `aio` would reach).
    Nvme(cmd::nvme::NvmeCli),
    /// The ZeRO engine's optimizer step with its state on the device, in host memory and on
    /// NVMe, side by side: step time, the wait for gradients, the CPU step, PCIe and NVMe bytes.
    OffloadBench(cmd::offload_bench::OffloadBenchCli),
    /// ZeRO checkpoints: check one, or consolidate its shards into one file of full weights.
    Ckpt(cmd::ckpt::CkptCli),
    /// Train a small MLP with the ZeRO engine on N local ranks (any stage and precision), printing
    /// loss per step and per-rank memory against the paper's formula.
    Demo(cmd::demo::DemoCli),
    /// Train a GPT (candle) data-parallel with the ZeRO engine on N local ranks, on a generated
    /// character corpus; exits non-zero unless the loss falls below --threshold.
    Train(cmd::train::TrainCli),
    /// On a machine with an NVIDIA GPU: every CUDA kernel against the CPU kernels, then bandwidth
    /// micro-benchmarks; prints a PASS/FAIL table (what scripts/gpu-check.sh runs).
    GpuCheck(cmd::gpu::GpuCheckCli),
    /// One rank of gpu-check's collective checks (run by `gpu-check` under the launcher).
    #[command(hide = true)]
    GpuCollectives(cmd::gpu::GpuCollectivesCli),
    /// Run one diag probe (used by `ringzero diag` in a child process).
    #[command(hide = true)]
    DiagProbe(cmd::diag::ProbeCli),
    /// One rank of diag's ring probe on device buffers (run by `diag-probe cuda-ring…`).
    #[command(hide = true)]
    DiagRingRank(cmd::diag::RingRankCli),
    /// Checked all-reduce sweep (run it under `ringzero launch`): every result is verified exactly.
    Check(cmd::check::CheckCli),
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
            ringzero_tools::eline!("ringzero: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.cmd {
        Cmd::Launch(a) => cmd::launch_cmd::run(a),
        Cmd::Bench(a) => cmd::bench::run(a),
        Cmd::Diag(a) => cmd::diag::run(a),
        Cmd::Mem(a) => cmd::mem::run(a),
        Cmd::Nvme(a) => cmd::nvme::run(a),
        Cmd::OffloadBench(a) => cmd::offload_bench::run(a),
        Cmd::Ckpt(a) => cmd::ckpt::run(a),
        Cmd::Demo(a) => cmd::demo::run(a),
        Cmd::Train(a) => cmd::train::run(a),
        Cmd::GpuCheck(a) => cmd::gpu::check(a),
        Cmd::GpuCollectives(a) => cmd::gpu::collectives(a),
        Cmd::DiagProbe(a) => cmd::diag::probe(a),
        Cmd::DiagRingRank(a) => cmd::diag::ring_rank(a),
        Cmd::Check(a) => cmd::check::run(a),
    }
}
