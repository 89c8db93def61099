//! `ringzero gpu-check` as a whole: every CUDA kernel against the CPU kernels and their
//! micro-benchmarks on the GPU ([`crate::gpu::kernels`]), then the collective runs: the rank program
//! ([`crate::gpu::collectives`], `ringzero gpu-collectives`) in processes on the GPU through the launcher,
//! one run per transport, plus runs where a rank kills itself. With `--host-stream` the same
//! collective runs go on the host stream instead, as a dry run without a GPU (`cargo test` runs
//! it), and the kernels are skipped.

use std::time::Duration;

use crate::gpu::kernels::{bench, checks, Row};
use crate::launch;

/// What `ringzero gpu-check` was asked.
#[derive(Clone, Copy, Debug, Default)]
pub struct GpuCheckArgs {
    /// The GPU's ordinal.
    pub device: usize,
    /// Skip the micro-benchmarks and the bandwidth rows.
    pub no_bench: bool,
    /// Only the kernels.
    pub kernels_only: bool,
    /// The collective runs on the host stream, no GPU (a dry run).
    pub host_stream: bool,
    /// The quick counts, in 4 KiB slices.
    pub quick: bool,
}

/// Every check `a` asks for: the device's name for the table, and the rows. An error only when
/// the GPU cannot be opened at all.
pub fn run(a: &GpuCheckArgs) -> Result<(String, Vec<Row>), String> {
    let mut rows = Vec::new();
    let name = if a.host_stream {
        crate::eline!("ringzero gpu-check: a dry run on the host stream (no GPU)");
        "host stream (dry run, no GPU)".to_string()
    } else {
        let gpu = ringzero_kernels::device::cuda::Gpu::open(a.device).map_err(|e| e.to_string())?;
        let name = gpu.name().unwrap_or_else(|e| e.to_string());
        crate::eline!(
            "ringzero gpu-check: {name} ({}), checking kernels...",
            gpu.arch()
        );
        rows = checks(&gpu);
        if !a.no_bench {
            crate::eline!("ringzero gpu-check: micro-benchmarks...");
            match bench(&gpu) {
                Ok(r) => rows.extend(r),
                Err(e) => rows.push(Row {
                    check: "bench".into(),
                    pass: false,
                    detail: e.to_string(),
                }),
            }
        }
        name
    };
    let runs = [
        (2usize, DevMode::Ipc),
        (4, DevMode::Ipc),
        (2, DevMode::IpcRing),
        (2, DevMode::Staging),
        (4, DevMode::Staging),
        (2, DevMode::StagingOther),
        (2, DevMode::Tcp),
        (4, DevMode::IpcKill),
        (4, DevMode::StagingKill),
    ];
    // On the host stream auto and RINGZERO_P2P_DISABLE=1 both stage through the host,
    // and both kills are one: a run of each kind.
    let on_host =
        |mode: &DevMode| !matches!(mode, DevMode::Ipc | DevMode::IpcRing | DevMode::IpcKill);
    let runs = runs
        .into_iter()
        .filter(|(_, m)| !a.kernels_only && (!a.host_stream || on_host(m)));
    let how = RunHow {
        host_stream: a.host_stream,
        quick: a.quick,
        no_bench: a.no_bench,
    };
    for (ranks, mode) in runs {
        crate::eline!(
            "ringzero gpu-check: collectives on device buffers, {ranks} processes, {}...",
            match mode {
                DevMode::Ipc => "auto (cuda_ipc; direct on one GPU)",
                DevMode::IpcRing => "cuda_ipc, RINGZERO_DEVICE_ALGO=ring",
                DevMode::Staging => "RINGZERO_P2P_DISABLE=1",
                DevMode::StagingOther if a.host_stream => {
                    "RINGZERO_P2P_DISABLE=1 RINGZERO_STAGING=copy"
                }
                DevMode::StagingOther => "RINGZERO_P2P_DISABLE=1 RINGZERO_STAGING=mapped",
                DevMode::Tcp => {
                    "RINGZERO_TRANSPORT=tcp RINGZERO_TCP_SOCKETS=2 (pinned tcp staging)"
                }
                DevMode::IpcKill => "cuda_ipc, rank 1 killed mid all-reduce",
                DevMode::StagingKill => "host staging, rank 1 killed mid all-reduce",
            }
        );
        rows.extend(gpu_collectives(a.device, ranks, mode, how));
    }
    Ok((name, rows))
}

/// Which device transport a gpu-check collective run asks for.
#[derive(Clone, Copy, Debug)]
enum DevMode {
    Ipc,
    /// cuda_ipc with `RINGZERO_DEVICE_ALGO=ring`: the slot ring where auto takes the direct step.
    IpcRing,
    Staging,
    /// Host staging the way `auto` does not take on 2 ranks, for comparison: kernels on the
    /// mapped slots on a GPU (`RINGZERO_STAGING=mapped`; auto copies there), explicit copies on
    /// the host stream (`RINGZERO_STAGING=copy`; auto maps there).
    StagingOther,
    Tcp,
    /// cuda_ipc, rank 1 kills itself mid all-reduce.
    IpcKill,
    /// Host staging, rank 1 kills itself mid all-reduce.
    StagingKill,
}

/// How gpu-check's collective runs go.
#[derive(Clone, Copy, Debug)]
struct RunHow {
    /// On the host stream (a dry run) instead of a GPU.
    host_stream: bool,
    /// The quick counts, in 4 KiB slices.
    quick: bool,
    no_bench: bool,
}

/// gpu-check's collective checks: `ranks` processes on device `device` through the launcher.
fn gpu_collectives(device: usize, ranks: usize, mode: DevMode, how: RunHow) -> Vec<Row> {
    // The staging way `auto` does not take here ([`DevMode::StagingOther`]).
    let other_way = if how.host_stream { "copy" } else { "mapped" };
    let other_label = format!("staging-{other_way}");
    let label = format!(
        "{}{} n={ranks}",
        if how.host_stream { "host-stream " } else { "" },
        match mode {
            DevMode::Ipc | DevMode::IpcKill => "cuda_ipc",
            DevMode::IpcRing => "cuda_ipc-ring",
            DevMode::Staging | DevMode::StagingKill => "staging",
            DevMode::StagingOther => &other_label,
            DevMode::Tcp => "tcp",
        }
    );
    let (staged, kill) = (
        matches!(
            mode,
            DevMode::Staging | DevMode::StagingOther | DevMode::StagingKill
        ),
        matches!(mode, DevMode::IpcKill | DevMode::StagingKill),
    );
    let fail = |detail: String| {
        vec![Row {
            check: format!("{label} run"),
            pass: false,
            detail,
        }]
    };
    let rows = std::env::temp_dir().join(format!(
        "ringzero-gpu-collectives-{}-{ranks}-{mode:?}.json",
        std::process::id()
    ));
    let mut args: Vec<std::ffi::OsString> = vec![
        "gpu-collectives".into(),
        "--device".into(),
        device.to_string().into(),
        "--rows".into(),
        rows.clone().into(),
    ];
    if how.no_bench {
        args.push("--no-bench".into());
    }
    if how.host_stream {
        args.push("--host-stream".into());
    }
    if how.quick {
        args.push("--quick".into());
    }
    if kill {
        args.extend(["--kill-rank".into(), "1".into()]);
    }
    let program = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => return fail(format!("finding this executable: {e}")),
    };
    // A killed-rank run also checks that the survivors' flight records name the dead rank.
    let dumps = kill.then(|| {
        std::env::temp_dir().join(format!(
            "ringzero-gpu-flight-{}-{ranks}-{mode:?}",
            std::process::id()
        ))
    });
    // Each knob: its value when `on`, else its default.
    let knob = |name: &str, on: bool, yes: &str, no: &str| {
        (name.to_string(), if on { yes } else { no }.to_string())
    };
    let mut env = vec![
        knob("RINGZERO_P2P_DISABLE", staged, "1", "0"),
        knob(
            "RINGZERO_TRANSPORT",
            matches!(mode, DevMode::Tcp),
            "tcp",
            "auto",
        ),
        // The tcp run's edges stripe every frame over two connections (pinned staging parts).
        knob("RINGZERO_TCP_SOCKETS", true, "2", "2"),
        knob(
            "RINGZERO_DEVICE_ALGO",
            matches!(mode, DevMode::IpcRing),
            "ring",
            "auto",
        ),
        knob(
            "RINGZERO_STAGING",
            matches!(mode, DevMode::StagingOther),
            other_way,
            "auto",
        ),
    ];
    if how.quick {
        // So that the quick counts still take several slices, and the posted messages several
        // slots.
        env.push(("RINGZERO_SLICE_BYTES".to_string(), "4096".to_string()));
    }
    let spec = launch::LaunchSpec {
        ranks,
        nodes: 1,
        program: program.into(),
        args,
        env,
        grace: Duration::from_secs(5),
        dump_dir: dumps.clone().map(|path| launch::DumpDir {
            path,
            remove_on_success: false,
        }),
    };
    let outcome = launch::launch(&spec, launch::Output::RankZeroPlain);
    let read = std::fs::read_to_string(&rows);
    let _ = std::fs::remove_file(&rows);
    let mut out = match (outcome, read) {
        (_, Ok(text)) => serde_json::from_str::<Vec<Row>>(&text)
            .unwrap_or_else(|e| fail(format!("rank 0's rows: {e}"))),
        (Ok(o), Err(e)) => fail(format!("exit {}: no rows ({e})", o.exit_code())),
        (Err(e), _) => fail(format!("launch: {e}")),
    };
    if let Some(d) = dumps {
        out.push(flight_names_the_killed_rank(&label, &d));
        let _ = std::fs::remove_dir_all(&d);
    }
    out
}

/// gpu-check's row for a killed-rank run's flight records: the device communicator's join must
/// name rank 1 first, as having left no record.
fn flight_names_the_killed_rank(label: &str, dir: &std::path::Path) -> Row {
    use crate::diag::flight::{self, FindingKind};
    let (pass, detail) = match flight::join(dir) {
        Err(e) => (false, e.to_string()),
        Ok(r) => match r.groups.iter().find(|g| g.comm == "device") {
            None => (false, "no device communicator's records".to_string()),
            Some(g) => {
                let f = &g.findings[0];
                let present = g.ranks.iter().filter(|l| l.present).count();
                (
                    f.kind == FindingKind::NO_RECORD && f.ranks == [1],
                    format!(
                        "{present} records; first finding {:?} {:?}",
                        f.kind, f.ranks
                    ),
                )
            }
        },
    };
    Row {
        check: format!("{label} killed rank: diag --flight names it"),
        pass,
        detail,
    }
}
