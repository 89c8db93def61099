//! The `ringzero` binary's subcommands, one file each, and what several of them share: the
//! value parsers, joining the launcher's job, and spawning this command line on local ranks.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use ringzero_collectives::{config::parse_bytes, Communicator};
use ringzero_tools::launch;

pub(crate) mod bench;
pub(crate) mod check;
pub(crate) mod ckpt;
pub(crate) mod demo;
pub(crate) mod diag;
pub(crate) mod gpu;
mod hf_config;
pub(crate) mod launch_cmd;
pub(crate) mod mem;
mod model_files;
pub(crate) mod nvme;
pub(crate) mod offload_bench;
pub(crate) mod train;

pub(crate) fn count(s: &str) -> Result<f64, String> {
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

/// `ringzero mem --params`: a count ([`count`]), or a model's safetensors file or directory of
/// them, whose tensors' elements are counted from the headers, or its `config.json`.
pub(crate) fn params_arg(s: &str) -> Result<f64, String> {
    let path = std::path::Path::new(s);
    let files = "a model's .safetensors file, a directory of them, or its config.json";
    if !path.exists() {
        return count(s).map_err(|e| {
            if s.contains(std::path::MAIN_SEPARATOR)
                || s.ends_with(".safetensors")
                || s.ends_with(".json")
            {
                format!(
                    "{s}: no such file or directory (give a parameter count such as 7.5B, or \
                     {files})"
                )
            } else {
                format!("{e}, or {files}")
            }
        });
    }
    let n = model_files::params_in(path)?;
    if n == 0 {
        return Err(format!("{s}: its tensors hold no parameters"));
    }
    Ok(n as f64)
}

pub(crate) fn size(s: &str) -> Result<usize, String> {
    parse_bytes(s).ok_or_else(|| format!("`{s}` is not a size (e.g. 4096, 64K, 16M)"))
}

/// `--dump-dir`, else `RINGZERO_DUMP_DIR`, else a fresh directory for this job.
pub(crate) fn dump_dir_for_launch(flag: Option<std::path::PathBuf>) -> launch::DumpDir {
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

/// Whether a launcher (ours, torchrun, Slurm, Open MPI) started this process as a rank.
pub(crate) fn under_launcher() -> bool {
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
pub(crate) fn spawn_self(
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

/// Refuse a `--transport` other than auto, shm or tcp.
pub(crate) fn check_transport(transport: Option<&str>) -> anyhow::Result<()> {
    if let Some(t) = transport {
        anyhow::ensure!(
            matches!(t, "auto" | "shm" | "tcp"),
            "--transport {t}: expected auto, shm or tcp"
        );
    }
    Ok(())
}

/// Join the job the launcher started, with `--transport` and `--tcp-sockets` applied.
pub(crate) fn join(
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
            ringzero_tools::eline!(
                "ringzero {tool}: -n {n} ignored: the launcher started {} ranks",
                comm.size()
            );
        }
    }
    Ok(comm)
}

/// This rank's GPU (local rank mod the count, as `bench --device cuda` and `offload-bench`
/// pick it) and its name for reports; `flag` names the option in errors.
pub(crate) fn local_gpu(
    comm: &Communicator,
    flag: &str,
) -> anyhow::Result<(std::sync::Arc<ringzero_kernels::device::cuda::Gpu>, String)> {
    let n = ringzero_kernels::device::cuda_devices().map_err(|e| anyhow::anyhow!("{flag}: {e}"))?;
    let ordinal = comm.config().launch.local_rank % n;
    let gpu = ringzero_kernels::device::cuda::Gpu::open(ordinal)
        .map_err(|e| anyhow::anyhow!("opening cuda:{ordinal}: {e}"))?;
    let name = format!("cuda:{ordinal} ({})", gpu.name().unwrap_or_default());
    Ok((gpu, name))
}

/// `--precision` and `--lr` (where `precision` and `lr` say they were given) beside a config's
/// `text`: each fills the config's `"auto"` values ([`fills_auto`]). A text that is not JSON is
/// the config parser's to report.
pub(crate) fn flags_fill_auto(text: &str, precision: bool, lr: bool) -> anyhow::Result<()> {
    if let Ok(json) = serde_json::from_str::<serde_json::Value>(text) {
        if precision {
            fills_auto(&json, "--precision", &["fp16.enabled", "bf16.enabled"])?;
        }
        if lr {
            fills_auto(&json, "--lr", &["optimizer.params.lr"])?;
        }
    }
    Ok(())
}

/// A flag given with `--config` fills the config's `"auto"` values at `keys` (as Hugging Face's
/// Trainer fills them from its arguments). Where the config sets one of them itself, or has
/// none to fill, the flag is refused, naming the keys.
fn fills_auto(json: &serde_json::Value, flag: &str, keys: &[&str]) -> anyhow::Result<()> {
    let at = |key: &str| key.split('.').try_fold(json, |v, k| v.get(k));
    let is_auto = |v: &serde_json::Value| v.as_str() == Some("auto");
    let set: Vec<String> = (keys.iter())
        .filter_map(|k| at(k).filter(|v| !is_auto(v)).map(|v| format!("{k} = {v}")))
        .collect();
    anyhow::ensure!(
        set.is_empty(),
        "{flag} and --config both given, and the config sets {}: set it in one place (the \
         config's value, or \"auto\" there for {flag} to fill)",
        set.join(", ")
    );
    anyhow::ensure!(
        keys.iter().any(|k| at(k).is_some_and(is_auto)),
        "{flag} with --config fills the config's \"auto\" {}, and the config has none: write \
         \"auto\" there for {flag} to fill, or set the value in the config",
        keys.join(" or ")
    );
    Ok(())
}
