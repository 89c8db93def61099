//! `ringzero bench`: every collective against the α–β model.

use std::process::ExitCode;

use anyhow::Context;

use super::{join, size, spawn_self, under_launcher};

#[derive(clap::Args)]
pub(crate) struct BenchCli {
    /// all-reduce, reduce-scatter, all-gather, broadcast, reduce, all-to-all, all-to-all-v,
    /// all-gather-v, reduce-scatter-v, gather, scatter (balanced counts; root 0), send-recv
    /// (ranks 0↔1, 2↔3, ... exchange), or all (every collective: all but send-recv).
    #[arg(default_value = "all")]
    pub(crate) op: String,
    /// Local ranks to spawn (default: one per core, at least 2, at most 4; ignored under a
    /// launcher, which decides).
    #[arg(short = 'n', long = "ranks")]
    pub(crate) ranks: Option<usize>,
    /// Smallest size in bytes (K/M/G suffixes).
    #[arg(short = 'b', long = "minbytes", default_value = "4K", value_parser = size)]
    pub(crate) min_bytes: usize,
    /// Largest size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "64M", value_parser = size)]
    pub(crate) max_bytes: usize,
    /// Multiplier between sizes.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 4)]
    pub(crate) factor: usize,
    /// Element type: f32 f64 f16 bf16 i32 i64 u8.
    #[arg(short = 'd', long = "datatype", default_value = "f32")]
    pub(crate) dtype: ringzero_collectives::DType,
    /// Reduce operator: sum prod min max avg.
    #[arg(short = 'o', long = "op", default_value = "sum")]
    pub(crate) redop: ringzero_collectives::ReduceOp,
    /// Transport: auto, shm or tcp (sets RINGZERO_TRANSPORT for the ranks).
    #[arg(long)]
    pub(crate) transport: Option<String>,
    /// TCP connections per tcp ring edge, 1 to 32 (sets RINGZERO_TCP_SOCKETS for the ranks):
    /// edges between nodes, or every edge with --transport tcp.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=32))]
    pub(crate) tcp_sockets: Option<u16>,
    /// Timed iterations per size.
    #[arg(long, default_value_t = 20)]
    pub(crate) iters: usize,
    /// Warm-up iterations per size.
    #[arg(long, default_value_t = 5)]
    pub(crate) warmup: usize,
    /// Which α–β model each line is set against: `row` re-measures α (barriers), β (every rank
    /// streaming what one link carries in that call) and the rate of a rank's own copies (the
    /// bytes a call copies within a rank's memory beside its links) interleaved with the line's
    /// timed calls; `start` uses the model measured once at the start (the header's: its own
    /// copies at the memcpy baseline) for every line.
    #[arg(long, default_value = "row", value_parser = ["row", "start"])]
    pub(crate) model: String,
    /// Where the buffers live: host (the host communicator), cuda (device buffers on this node's
    /// GPUs, rank r on GPU local_rank mod count), host-stream (the device engine with the host as
    /// its device: the device path without a GPU), or auto (cuda when a GPU is found, else host).
    #[arg(long, default_value = "auto")]
    pub(crate) device: String,
    /// Algorithms to set side by side (comma-separated: ring, doubling, halving-doubling, auto):
    /// all-reduce, broadcast, reduce and all-gather-v (doubling: pairwise) run each size by each
    /// in turn, a line per schedule, and the report says which was fastest at each size and, for
    /// the all-reduce, where to set RINGZERO_DOUBLING_MAX and RINGZERO_HALVING_MAX on these
    /// links (for the all-gather-v, RINGZERO_PAIRWISE_MAX). Without it every call runs what
    /// RINGZERO_ALGO picks.
    #[arg(long, value_delimiter = ',')]
    pub(crate) algos: Vec<ringzero_collectives::Algo>,
    /// Allocate every buffer as a ringzero::SharedBuf (as nccl-tests' -R registers its buffers;
    /// host buffers only): the single-copy all-gathers then read the other ranks' parts through
    /// mappings kept from call to call instead of a process_vm_readv per call.
    #[arg(long)]
    pub(crate) shared_buffers: bool,
    /// Write the report as JSON to this file.
    #[arg(long)]
    pub(crate) json: Option<std::path::PathBuf>,
    /// Write an SVG plot of bus bandwidth against size.
    #[arg(long)]
    pub(crate) plot: Option<std::path::PathBuf>,
    /// Run nothing: read another library's benchmark (nccl-tests' text output, or its `-J`
    /// JSON) and print each row beside the ring's α–β model for that collective and rank count
    /// over links of --alpha-us and --beta-gbs.
    #[arg(long, value_name = "FILE", requires = "beta_gbs")]
    pub(crate) explain: Option<std::path::PathBuf>,
    /// With --explain: latency of one ring step, µs (this machine's is in `ringzero bench`'s
    /// header).
    #[arg(long, default_value_t = 0.0)]
    pub(crate) alpha_us: f64,
    /// With --explain: bandwidth of one link, GB/s (NVLink, PCIe, a NIC's; this machine's is
    /// in `ringzero bench`'s header).
    #[arg(long)]
    pub(crate) beta_gbs: Option<f64>,
    /// Bytes each rank streams to measure β.
    #[arg(long, default_value = "16M", value_parser = size, hide = true)]
    pub(crate) probe_bytes: usize,
    /// Testing aid: this rank corrupts one element of every checked result.
    #[arg(long, hide = true)]
    pub(crate) corrupt_rank: Option<usize>,
}

/// `--explain FILE`: another library's rows beside the model; nothing runs.
fn explain(
    path: &std::path::Path,
    alpha_us: f64,
    beta_gbs: Option<f64>,
) -> anyhow::Result<ExitCode> {
    use ringzero_tools::bench::{explain, theory::Model};
    let beta_gbs = beta_gbs.unwrap_or(0.0);
    anyhow::ensure!(
        beta_gbs.is_finite() && beta_gbs > 0.0 && alpha_us.is_finite() && alpha_us >= 0.0,
        "--beta-gbs must be above 0 and --alpha-us at least 0 (GB/s per link, µs per step)"
    );
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("--explain {}: {e}", path.display()))?;
    let f =
        explain::parse(&text).map_err(|e| anyhow::anyhow!("--explain {}: {e}", path.display()))?;
    let source = path.display().to_string();
    print!(
        "{}",
        explain::explain(&f, Model::links(alpha_us, beta_gbs), &source)
    );
    Ok(ExitCode::SUCCESS)
}

/// The most ranks `ringzero bench` starts by itself (the main job stays short on large hosts).
const MAX_DEFAULT_RANKS: usize = 4;

/// Ranks to start when `-n` is not given: one per core, at least 2, at most
/// [`MAX_DEFAULT_RANKS`].
fn default_ranks() -> usize {
    std::thread::available_parallelism()
        .map_or(2, |c| c.get())
        .clamp(2, MAX_DEFAULT_RANKS)
}

/// Run the sweep (spawning local ranks outside a launcher) and print the report.
pub(crate) fn run(b: BenchCli) -> anyhow::Result<ExitCode> {
    if let Some(path) = &b.explain {
        return explain(path, b.alpha_us, b.beta_gbs);
    }
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
    super::check_transport(b.transport.as_deref())?;
    anyhow::ensure!(b.iters > 0, "--iters must be at least 1");
    anyhow::ensure!(
        !b.shared_buffers || device == "host",
        "--shared-buffers allocates host memory; the buffers here are {device}'s: add --device host"
    );
    // This node's ranks: those about to start here, or the launcher's.
    let here = match under_launcher() {
        false => b.ranks.unwrap_or_else(default_ranks),
        true => ringzero_collectives::Config::from_env().map_or(1, |c| c.launch.local_world_size),
    };
    let avail = ringzero_tools::bench::memory_available();
    ringzero_tools::bench::check_sizes(&sizes, b.dtype.size(), here, avail)
        .map_err(anyhow::Error::msg)?;
    if !under_launcher() {
        let n = b.ranks.unwrap_or_else(default_ranks);
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
            shared_buffers: b.shared_buffers,
        },
        probe_bytes: b.probe_bytes,
        // The ranks re-read the command line: no -n there means the default chose their count.
        ranks_note: b.ranks.is_none().then(|| {
            format!(
                "one per core, at least 2 and at most {MAX_DEFAULT_RANKS}: more ranks than cores \
                 time-slice and measure the scheduler; -n to choose"
            )
        }),
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
            let (gpu, name) = super::local_gpu(&comm, "--device cuda")?;
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
