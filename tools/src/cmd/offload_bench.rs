//! `ringzero offload-bench`: the step time of the ZeRO engine with its optimizer state on the
//! device, in host memory and on NVMe, side by side in one run (`ringzero_tools::offload_bench`).

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use ringzero_collectives::{DeviceComm, HostStream};
use ringzero_tools::offload_bench::{self, OffloadBenchArgs};
use ringzero_zero::OffloadDevice;

use super::{count, join, spawn_self, under_launcher};

/// `ringzero offload-bench`'s arguments.
#[derive(clap::Args)]
pub(crate) struct OffloadBenchCli {
    /// Local ranks to spawn (ignored under a launcher, which decides).
    #[arg(short = 'n', long = "ranks", default_value_t = 2)]
    pub(crate) ranks: usize,
    /// Parameters in the model: 1B, 350M, ... (bf16 parameters and gradients, fp32 master and
    /// AdamW moments: 16 bytes each, sharded by the stage).
    #[arg(long, value_parser = count, default_value = "64M")]
    pub(crate) params: f64,
    /// Tensors the parameters are split into (each its own bucket).
    #[arg(long, default_value_t = 8)]
    pub(crate) pieces: usize,
    /// ZeRO stage, 1-3.
    #[arg(long, default_value_t = 2)]
    pub(crate) stage: u8,
    /// Timed optimizer steps per mode.
    #[arg(long, default_value_t = 5)]
    pub(crate) steps: usize,
    /// Where the optimizer state goes, in order (comma-separated: none, cpu, nvme).
    #[arg(long, value_delimiter = ',', default_value = "none,cpu,nvme")]
    pub(crate) modes: Vec<OffloadDevice>,
    /// The NVMe tier's directory (default: a directory under the system's temporary one).
    #[arg(long)]
    pub(crate) nvme_path: Option<std::path::PathBuf>,
    /// At stage 3, the nvme mode puts the parameter shards on NVMe too (ZeRO-Infinity).
    #[arg(long)]
    pub(crate) infinity: bool,
    /// Where the engine's device memory is: cuda (rank r on GPU local_rank mod count),
    /// host-stream (the host as the device: the same code without a GPU), or auto.
    #[arg(long, default_value = "auto")]
    pub(crate) device: String,
}

/// Run every mode on every rank; rank 0 prints the table.
pub(crate) fn run(c: OffloadBenchCli) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        (1..=3).contains(&c.stage),
        "--stage {}: offload needs stage 1, 2 or 3",
        c.stage
    );
    anyhow::ensure!(
        c.pieces >= 1 && c.steps >= 1,
        "--pieces and --steps must be at least 1"
    );
    anyhow::ensure!(
        !c.modes.is_empty(),
        "--modes: name at least one of none, cpu, nvme"
    );
    let device = match c.device.as_str() {
        "cuda" | "host-stream" => c.device.clone(),
        "auto" => match ringzero_kernels::device::cuda_devices() {
            Ok(_) => "cuda".into(),
            Err(_) => "host-stream".into(),
        },
        other => anyhow::bail!("--device {other}: expected cuda, host-stream or auto"),
    };
    if !under_launcher() {
        return spawn_self(c.ranks, None, None);
    }
    let comm = join("offload-bench", Some(c.ranks), None, None)?;
    let a = OffloadBenchArgs {
        params: c.params as usize,
        pieces: c.pieces,
        stage: c.stage,
        steps: c.steps,
        modes: c.modes.clone(),
        nvme_path: c.nvme_path.clone().unwrap_or_else(|| {
            std::env::temp_dir().join(format!("ringzero-offload-bench-rank{}", comm.rank()))
        }),
        infinity: c.infinity,
    };
    let (lines, name) = match device.as_str() {
        "cuda" => {
            let (gpu, name) = super::local_gpu(&comm, "--device cuda")?;
            let dc = Arc::new(
                DeviceComm::new(&comm, gpu).context("connecting the device communicator")?,
            );
            (offload_bench::run(&comm, &dc, &a), name)
        }
        _ => {
            let dc = Arc::new(
                DeviceComm::new(&comm, HostStream::new())
                    .context("connecting the device communicator")?,
            );
            (
                offload_bench::run(&comm, &dc, &a),
                "the host stream (the host as the device)".to_string(),
            )
        }
    };
    let lines = lines.map_err(anyhow::Error::msg)?;
    if comm.rank() == 0 {
        print!("{}", offload_bench::text(&a, &name, comm.size(), &lines));
    }
    Ok(ExitCode::SUCCESS)
}
