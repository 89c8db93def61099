//! `ringzero nvme`: the NVMe tier's throughput on a directory (where `offload_optimizer.nvme_path`
//! would point) against a plain direct-I/O copy of the same bytes on the same disk, in one run —
//! to see what the tier's `aio` settings reach before training with them.

use std::path::PathBuf;
use std::process::ExitCode;

use super::size;

/// `ringzero nvme`'s arguments.
#[derive(clap::Args)]
pub(crate) struct NvmeCli {
    /// The directory to measure (created if missing; the two files are removed after).
    pub(crate) dir: PathBuf,
    /// Bytes written and read each round (K/M/G suffixes).
    #[arg(long, value_parser = size, default_value = "256M")]
    pub(crate) size: usize,
    /// The tier's request size (`aio.block_size`), a multiple of 4096.
    #[arg(long = "block-size", value_parser = size, default_value = "1M")]
    pub(crate) block_size: usize,
    /// The tier's I/O threads (`aio.thread_count`).
    #[arg(long, default_value_t = 1)]
    pub(crate) threads: usize,
    /// Rounds each way (the best is reported).
    #[arg(long, default_value_t = 3)]
    pub(crate) rounds: usize,
}

/// Print the table; exit non-zero only on an I/O error or bad settings.
pub(crate) fn run(a: NvmeCli) -> anyhow::Result<ExitCode> {
    let mut cfg = ringzero_zero::ZeroConfig::default();
    cfg.offload.aio.block_size = a.block_size;
    cfg.offload.aio.thread_count = a.threads;
    cfg.validate()
        .map_err(|e| anyhow::anyhow!("--block-size/--threads: {e}"))?;
    anyhow::ensure!(
        a.size > 0 && a.rounds > 0,
        "--size and --rounds must be above 0"
    );
    let r = ringzero_zero::swap::bench(&a.dir, a.size, &cfg.offload.aio, a.rounds)?;
    println!(
        "{}: {} MB each way, best of {} rounds, {}",
        a.dir.display(),
        r.bytes / 1_000_000,
        a.rounds,
        if r.direct {
            "O_DIRECT"
        } else {
            "buffered (the filesystem refuses O_DIRECT: these are page-cache figures)"
        }
    );
    println!("{:>44} {:>10} {:>10}", "", "write GB/s", "read GB/s");
    println!(
        "{:>44} {:>10.2} {:>10.2}",
        format!(
            "NVMe tier ({} KiB requests, {} thread{})",
            a.block_size / 1024,
            a.threads,
            if a.threads == 1 { "" } else { "s" }
        ),
        r.tier_write_gbs,
        r.tier_read_gbs
    );
    println!(
        "{:>44} {:>10.2} {:>10.2}",
        "plain copy (8 MiB requests, 1 thread)", r.plain_write_gbs, r.plain_read_gbs
    );
    println!(
        "{:>44} {:>9.0}% {:>9.0}%",
        "tier / plain",
        100.0 * r.tier_write_gbs / r.plain_write_gbs,
        100.0 * r.tier_read_gbs / r.plain_read_gbs
    );
    Ok(ExitCode::SUCCESS)
}
