//! `ringzero gpu-check`, and the hidden rank program it launches.

use std::process::ExitCode;

use anyhow::Context;

use super::join;

/// `ringzero gpu-check`'s arguments.
#[derive(clap::Args)]
pub(crate) struct GpuCheckCli {
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    pub(crate) device: usize,
    /// Also write the rows as JSON here.
    #[arg(long)]
    pub(crate) json: Option<std::path::PathBuf>,
    /// Skip the micro-benchmarks.
    #[arg(long)]
    pub(crate) no_bench: bool,
    /// Only the kernels (and their micro-benchmarks): skip the collectives on device buffers.
    #[arg(long, conflicts_with = "host_stream")]
    pub(crate) kernels_only: bool,
    /// A dry run without a GPU: the collective checks on the host stream (the device engine
    /// with the host as its device; host staging, tcp, a killed rank), no kernels, no
    /// bandwidth. It tests the checks themselves.
    #[arg(long)]
    pub(crate) host_stream: bool,
    /// Counts up to 4099 elements in 4 KiB slices instead of up to 2^20+7 in the default
    /// slices (the dry run's sizes).
    #[arg(long)]
    pub(crate) quick: bool,
}

/// Run the checks and print the PASS/FAIL table.
pub(crate) fn check(a: GpuCheckCli) -> anyhow::Result<ExitCode> {
    let GpuCheckCli {
        device,
        json,
        no_bench,
        kernels_only,
        host_stream,
        quick,
    } = a;
    use ringzero_tools::gpu::{kernels, run};
    let args = run::GpuCheckArgs {
        device,
        no_bench,
        kernels_only,
        host_stream,
        quick,
    };
    let (name, rows) = run::run(&args).map_err(|e| anyhow::anyhow!("gpu-check: {e}"))?;
    if let Some(path) = json {
        std::fs::write(&path, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    print!("{}", kernels::table(&name, &rows));
    Ok(if rows.iter().all(|r| r.pass) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// `ringzero gpu-collectives`'s arguments.
#[derive(clap::Args)]
pub(crate) struct GpuCollectivesCli {
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    pub(crate) device: usize,
    /// Rank 0 writes its rows here as JSON.
    #[arg(long)]
    pub(crate) rows: std::path::PathBuf,
    /// Skip the bandwidth measurement.
    #[arg(long)]
    pub(crate) no_bench: bool,
    /// Instead of the checks: all-reduce in a loop while this rank kills itself.
    #[arg(long)]
    pub(crate) kill_rank: Option<usize>,
    /// On the host stream instead of a GPU.
    #[arg(long)]
    pub(crate) host_stream: bool,
    /// The quick counts.
    #[arg(long)]
    pub(crate) quick: bool,
}

/// One rank of the collective checks.
pub(crate) fn collectives(a: GpuCollectivesCli) -> anyhow::Result<ExitCode> {
    let GpuCollectivesCli {
        device,
        rows,
        no_bench,
        kill_rank,
        host_stream,
        quick,
    } = a;
    use ringzero_tools::gpu::collectives;
    let comm = join("gpu-collectives", None, None, None)?;
    let device = (!host_stream).then_some(device);
    let r = match kill_rank {
        Some(k) => collectives::killed_rank_main(&comm, device, k),
        None => {
            let opts = collectives::RunOpts {
                bench: !no_bench,
                quick,
            };
            collectives::rank_main(&comm, device, opts)
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
