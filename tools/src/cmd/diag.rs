//! `ringzero diag`, and the hidden children it runs (one probe, one rank of the ring probe).

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;

/// `ringzero diag`'s arguments.
#[derive(clap::Args)]
pub(crate) struct DiagCli {
    /// Read sysfs from here (fixtures, captured trees).
    #[arg(long, default_value = "/sys")]
    pub(crate) sysfs_root: std::path::PathBuf,
    /// Read procfs from here.
    #[arg(long, default_value = "/proc")]
    pub(crate) procfs_root: std::path::PathBuf,
    /// Print JSON instead of text.
    #[arg(long)]
    pub(crate) json: bool,
    /// Probes to run in child processes (comma-separated: shm, tcp, cuda; `none` for none).
    /// `cuda` lists the devices and peer facts, then probes peer copies, pinned host copies,
    /// CUDA IPC and ringzero's ring on device buffers (skipped, and said so, without a GPU).
    #[arg(long, default_value = "shm,tcp,cuda")]
    pub(crate) probes: String,
    /// Seconds before the watchdog kills a probe and calls it HANG.
    #[arg(long, default_value_t = 20.0)]
    pub(crate) probe_timeout: f64,
    /// Instead of examining this machine, join the flight records a failed job's ranks wrote
    /// to this directory (`RINGZERO_DUMP_DIR`; `ringzero launch` prints it) and name the rank
    /// that was missing, late or calling something else.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["sysfs_root", "procfs_root", "probes", "probe_timeout"])]
    pub(crate) flight: Option<std::path::PathBuf>,
}

/// Examine this machine (or join a failed job's flight records) and print the verdicts.
pub(crate) fn run(a: DiagCli) -> anyhow::Result<ExitCode> {
    let DiagCli {
        sysfs_root,
        procfs_root,
        json,
        probes,
        probe_timeout,
        flight,
    } = a;
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
    anyhow::ensure!(
        (0.001..=86_400.0).contains(&probe_timeout),
        "--probe-timeout {probe_timeout}: give each probe between 0.001 and 86400 seconds"
    );
    let args = ringzero_tools::diag::DiagArgs {
        sysfs_root,
        procfs_root,
        probes,
        p2p_disabled: ringzero_collectives::config::env_flag("RINGZERO_P2P_DISABLE")?,
        probe_timeout: Duration::from_secs_f64(probe_timeout),
        exe: std::env::current_exe().context("finding this executable")?,
    };
    let report = ringzero_tools::diag::diagnose(&args, &mut |what| {
        ringzero_tools::eline!("ringzero diag: {what}...")
    })?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", ringzero_tools::diag::text(&report));
    }
    Ok(ExitCode::from(report.exit_code as u8))
}

/// `ringzero diag-probe`'s argument.
#[derive(clap::Args)]
pub(crate) struct ProbeCli {
    /// Probe name.
    pub(crate) name: String,
}

/// Run one probe and print its result as JSON.
pub(crate) fn probe(a: ProbeCli) -> anyhow::Result<ExitCode> {
    let ProbeCli { name } = a;
    let r = ringzero_tools::diag::probe_child(&name);
    println!("{}", serde_json::to_string(&r)?);
    Ok(ExitCode::SUCCESS)
}

/// `ringzero diag-ring-rank`'s argument.
#[derive(clap::Args)]
pub(crate) struct RingRankCli {
    /// Rank 0's and rank 1's device ordinals (`0,1`; `0,0` shares one GPU).
    #[arg(long, value_delimiter = ',', required = true)]
    pub(crate) devices: Vec<usize>,
}

/// Run one rank of the ring probe on device buffers and print its result as JSON.
pub(crate) fn ring_rank(a: RingRankCli) -> anyhow::Result<ExitCode> {
    let RingRankCli { devices } = a;
    anyhow::ensure!(devices.len() == 2, "--devices takes two ordinals (`0,1`)");
    let r = ringzero_tools::diag::cuda::ring_rank([devices[0], devices[1]]);
    println!("{}", serde_json::to_string(&r)?);
    Ok(ExitCode::SUCCESS)
}
