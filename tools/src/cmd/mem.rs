//! `ringzero mem`: the ZeRO paper's model-state and communication table.

use std::process::ExitCode;

use super::params_arg;

/// `ringzero mem`'s arguments.
#[derive(clap::Args)]
pub(crate) struct MemCli {
    /// Parameters: 7.5B, 350M, 1.3e9, ..., or a model's weights — a `.safetensors` file or a
    /// directory of them (a Hugging Face checkpoint's shards), counted from their headers — or
    /// its `config.json` alone (Llama, Mistral, Mixtral, Qwen2, Qwen3, Gemma, Gemma 2, Phi-3,
    /// GPT-2, GPT-NeoX), counted from its sizes (or --gpt).
    #[arg(long = "params", value_parser = params_arg, required_unless_present = "gpt")]
    pub(crate) params: Option<f64>,
    /// A GPT's shape, `LAYERS,DIM,HEADS,CTX,VOCAB` (`ringzero train`'s model): each rank's
    /// whole footprint while training it on the host in f32 — the engine's model states and
    /// communication buffers, the ring slots (`RINGZERO_SLOTS` × `RINGZERO_SLICE_BYTES` from
    /// the environment, as the run's communicator takes them), candle's variables, gradients
    /// and activations — per stage.
    #[arg(long, value_name = "SHAPE", conflicts_with_all = ["params", "k", "shard_size"])]
    pub(crate) gpt: Option<String>,
    /// With --gpt: a DeepSpeed-style JSON config (as `ringzero train --config` reads it) whose
    /// precision, optimizer (instead of --optimizer), bucket sizes, overlap, prefetch,
    /// persistence and accumulation set the table; its stage is the table's when --stage is
    /// given, every stage otherwise. Without it, `ringzero train`'s defaults without --config.
    #[arg(long, value_name = "FILE", requires = "gpt")]
    pub(crate) config: Option<std::path::PathBuf>,
    /// With --gpt: where candle computes, `cpu` or `cuda` (`ringzero train --device`): on a
    /// GPU the table adds each stage's bytes on the device — candle's tensors, the engine's
    /// model states not offloaded, its communication buffers and its communicator's slots
    /// (over cuda_ipc: `RINGZERO_SLOTS` × `RINGZERO_DEVICE_SLICE_BYTES`, 16 MiB by default):
    /// what to set against the driver's figure for the process less its CUDA context and
    /// libraries (`ringzero train --device cuda` reads it after a warm-up) — and
    /// those in host memory.
    /// [default: cpu]
    #[arg(long, value_name = "DEVICE")]
    pub(crate) device: Option<String>,
    /// With --gpt: sequences per rank and micro-step.
    /// [default: 8]
    #[arg(long)]
    pub(crate) batch: Option<usize>,
    /// Data-parallel ranks.
    #[arg(long = "dp", default_value_t = 1)]
    pub(crate) dp: usize,
    /// One stage (0-3); all stages when omitted.
    #[arg(long)]
    pub(crate) stage: Option<u8>,
    /// Optimizer bytes per parameter; default: what --optimizer keeps in mixed precision.
    #[arg(long)]
    pub(crate) k: Option<f64>,
    /// The optimizer whose states K counts (fp32 master + 4 bytes per state): adam and adamw
    /// 12, lion and sgd-momentum 8, sgd 4.
    #[arg(long, value_enum, default_value_t = OptimizerArg::Adamw)]
    pub(crate) optimizer: OptimizerArg,
    /// Hybrid sharding (MiCS's `mics_shard_size`, FSDP's HYBRID_SHARD): shard over groups of
    /// S ranks and replicate across the --dp/S groups; adds the traffic between groups.
    #[arg(long = "shard-size", value_name = "S")]
    pub(crate) shard_size: Option<usize>,
    /// ZeRO-Offload / ZeRO-Infinity: put the optimizer state (fp32 master and moments) in host
    /// memory (cpu) or on NVMe (nvme), and print each stage's bytes per tier next to the
    /// paper's row.
    #[arg(long, value_name = "DEVICE", conflicts_with = "gpt")]
    pub(crate) offload: Option<ringzero_zero::OffloadDevice>,
    /// With --offload: the share of the optimizer state offloaded (DeepSpeed's `ratio`).
    #[arg(long, default_value_t = 1.0, requires = "offload")]
    pub(crate) ratio: f64,
    /// With --offload: stage 3's parameter shards off the device too, in host memory (cpu) or
    /// on NVMe (nvme) (`offload_param`).
    #[arg(long = "offload-param", value_name = "DEVICE", requires = "offload")]
    pub(crate) offload_param: Option<ringzero_zero::OffloadDevice>,
}

/// `--optimizer`'s values.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub(crate) enum OptimizerArg {
    /// AdamW (two moments).
    Adamw,
    /// Adam with L2 weight decay (two moments).
    Adam,
    /// Lion (one momentum).
    Lion,
    /// SGD without momentum (no state).
    Sgd,
    /// SGD with momentum (one buffer).
    SgdMomentum,
}

impl OptimizerArg {
    fn optimizer(self) -> ringzero_kernels::cpu::Optimizer {
        use ringzero_kernels::cpu::Optimizer;
        match self {
            OptimizerArg::Adamw => Optimizer::adamw(1e-3),
            OptimizerArg::Adam => Optimizer::adam(1e-3),
            OptimizerArg::Lion => Optimizer::lion(1e-4),
            OptimizerArg::Sgd => Optimizer::sgd(0.1, 0.0),
            OptimizerArg::SgdMomentum => Optimizer::sgd(0.1, 0.9),
        }
    }
}

/// Print the table.
pub(crate) fn run(a: MemCli) -> anyhow::Result<ExitCode> {
    if let Some(shape) = &a.gpt {
        return gpt(shape, &a);
    }
    anyhow::ensure!(
        a.config.is_none() && a.device.is_none() && a.batch.is_none(),
        "--config, --device and --batch size a GPT's footprint: give --gpt \
         LAYERS,DIM,HEADS,CTX,VOCAB with them (the model-state table of --params takes --stage, --k and --offload instead)"
    );
    let MemCli {
        params,
        dp,
        stage,
        k,
        optimizer,
        shard_size,
        offload: a_offload,
        ratio: a_ratio,
        offload_param: a_offload_param,
        ..
    } = a;
    let params = params.expect("clap requires --params without --gpt");
    let opt = optimizer.optimizer();
    let k = k.unwrap_or_else(|| ringzero_zero::mem::k_for(&opt));
    anyhow::ensure!(dp >= 1, "--dp must be at least 1");
    anyhow::ensure!(
        k.is_finite() && k >= 0.0,
        "--k must be a non-negative number"
    );
    use ringzero_zero::mem;
    let shard = shard_size.unwrap_or(dp);
    let replicas = mem::replicas(dp, shard).map_err(|e| anyhow::anyhow!("--shard-size: {e}"))?;
    let stages: Vec<u8> = match stage {
        Some(s) => vec![s],
        None => vec![0, 1, 2, 3],
    };
    for &s in &stages {
        mem::model_states(params, shard, s, k).map_err(anyhow::Error::msg)?;
    }
    let layout = match shard_size {
        Some(_) => {
            format!("{dp} data-parallel ranks as {replicas} replicas of a shard group of {shard}")
        }
        None => format!("{dp} data-parallel ranks"),
    };
    println!(
        "ZeRO model states per rank: {params:.3e} parameters, {layout}, K = {k} \
         (mixed-precision {}: 2 B params + 2 B grads + K B optimizer per parameter)",
        opt.name()
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
    if let Some(dev) = a_offload {
        tiers(params, shard, stage, k, dev, a_ratio, a_offload_param)?;
    }
    if shard_size.is_some() {
        println!(
            "hybrid: N = the shard group ({shard}); between groups, the gradient average over \
             the {replicas} replicas: 2·(Ψ/{shard})·(R−1)/R elements (all Ψ in stage 0)"
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `--offload`: each stage's model states per tier (GB), the paper's row first.
fn tiers(
    params: f64,
    n: usize,
    stage: Option<u8>,
    k: f64,
    dev: ringzero_zero::OffloadDevice,
    ratio: f64,
    offload_param: Option<ringzero_zero::OffloadDevice>,
) -> anyhow::Result<()> {
    let shards = offload_param.unwrap_or_default();
    use ringzero_zero::mem::{model_states_by_tier, model_states_with, OffloadPlan};
    anyhow::ensure!(
        ratio > 0.0 && ratio <= 1.0,
        "--ratio {ratio} must be above 0 and at most 1"
    );
    let plan = OffloadPlan {
        optimizer: dev,
        ratio,
        k_offloaded: k,
        params: shards,
    };
    println!();
    println!(
        "with offload_optimizer on {dev} (ratio {ratio}){}: bytes per rank by tier (GB)",
        if shards == ringzero_zero::OffloadDevice::None {
            String::new()
        } else {
            format!(", offload_param on {shards}")
        }
    );
    println!(
        "{:>6} {:>14} {:>12} {:>10} {:>10}   device: params + grads + optimizer",
        "stage", "", "device", "host", "nvme"
    );
    let first = if shards == ringzero_zero::OffloadDevice::None {
        1
    } else {
        3
    };
    let stages: Vec<u8> = match stage {
        Some(s) => vec![s],
        None => (first..=3).collect(),
    };
    for s in stages {
        let paper = model_states_with(params, n, s, 2.0, k).map_err(anyhow::Error::msg)?;
        let t = model_states_by_tier(params, n, s, (2.0, k), plan)
            .map_err(|e| anyhow::anyhow!("stage {s}: {e}"))?;
        let gb = |x: f64| x / 1e9;
        println!(
            "{:>6} {:>14} {:>12.2} {:>10.2} {:>10.2}",
            s,
            "(paper)",
            gb(paper.total()),
            0.0,
            0.0
        );
        println!(
            "{:>6} {:>14} {:>12.2} {:>10.2} {:>10.2}   {:.2} + {:.2} + {:.2}",
            s,
            format!("+ {dev}"),
            gb(t.device.total()),
            gb(t.host.total()),
            gb(t.nvme.total()),
            gb(t.device.params),
            gb(t.device.grads),
            gb(t.device.optimizer)
        );
    }
    println!(
        "the engine also holds, off the device, two gradient and two parameter buffers of its \
         largest bucket's range (and on nvme three regions of its state): Engine::memory() \
         counts them"
    );
    Ok(())
}

/// `--gpt`: each rank's footprint training that GPT, per stage.
fn gpt(shape: &str, a: &MemCli) -> anyhow::Result<ExitCode> {
    use ringzero_candle::gpt::GptConfig;
    use ringzero_candle::memory::Footprint;
    let batch = a.batch.unwrap_or(8);
    let device = a.device.as_deref().unwrap_or("cpu");
    let v: Vec<usize> = shape
        .split(',')
        .map(|x| x.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .ok()
        .filter(|v: &Vec<usize>| v.len() == 5 && v.iter().all(|&x| x > 0))
        .ok_or_else(|| {
            anyhow::anyhow!(
                "--gpt {shape}: expected LAYERS,DIM,HEADS,CTX,VOCAB, five positive integers \
                 (ringzero train's default model is 2,64,4,32,32)"
            )
        })?;
    let g = GptConfig {
        layers: v[0],
        dim: v[1],
        heads: v[2],
        ctx: v[3],
        vocab: v[4],
    };
    anyhow::ensure!(
        g.dim.is_multiple_of(g.heads),
        "--gpt {shape}: width {} does not divide into {} heads",
        g.dim,
        g.heads
    );
    anyhow::ensure!(
        a.dp >= 1 && batch >= 1,
        "--dp and --batch must be at least 1"
    );
    let base = match &a.config {
        None => ringzero_zero::ZeroConfig::default(),
        Some(path) => {
            use anyhow::Context;
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let auto = ringzero_zero::Auto {
                micro_batch: batch,
                hidden: Some(g.dim),
                world: Some(a.dp),
                ..Default::default()
            };
            let c = ringzero_zero::ZeroConfig::from_json_auto(&text, &auto)
                .with_context(|| format!("{}", path.display()))?;
            c
        }
    };
    let gpu = match device {
        "cpu" => false,
        d if d == "cuda"
            || d.strip_prefix("cuda:")
                .is_some_and(|n| n.parse::<u32>().is_ok()) =>
        {
            true
        }
        d => anyhow::bail!("--device {d:?}: say cpu, cuda or cuda:N"),
    };
    let psi = g.params() as f64;
    let opt = match a.config {
        Some(_) => base.optimizer,
        None => a.optimizer.optimizer(),
    };
    // fp32 parameters are their own master, so K counts the rule's states only; 16-bit ones
    // keep an fp32 master beside them.
    let fp32 = base.precision == ringzero_zero::Precision::Fp32;
    let (elem, k) = match fp32 {
        true => (4.0, ringzero_zero::mem::k_for(&opt) - 4.0),
        false => (2.0, ringzero_zero::mem::k_for(&opt)),
    };
    // The ring slots as the run's communicator will have them: RINGZERO_SLOTS and
    // RINGZERO_SLICE_BYTES from this environment (a bad value refused, naming it), the
    // defaults otherwise.
    let world = a.dp.to_string();
    let lookup = |k: &str| match k {
        "RINGZERO_RANK" => Some("0".to_string()),
        "RINGZERO_WORLD_SIZE" => Some(world.clone()),
        "RINGZERO_MASTER_ADDR" => Some("127.0.0.1".to_string()),
        "RINGZERO_MASTER_PORT" => Some("29500".to_string()),
        // Never connects: only its slots are read.
        "RINGZERO_SECRET" => Some("ringzero mem".to_string()),
        "RINGZERO_SLOTS" | "RINGZERO_SLICE_BYTES" | "RINGZERO_DEVICE_SLICE_BYTES" => {
            std::env::var(k).ok()
        }
        _ => None,
    };
    let cfg = ringzero_collectives::Config::from_lookup(&lookup)?;
    let slots = if a.dp > 1 {
        (cfg.slots, cfg.slice_bytes)
    } else {
        (0, 0)
    };
    // On a GPU the engine's communicator keeps its receive edge's slots in device memory
    // (cuda_ipc, the edge ranks of one node's GPUs take), sized by the device slice.
    let device_slots = slots.0
        * cfg
            .device_slice_bytes
            .unwrap_or(ringzero_kernels::device::GPU_SLICE_BYTES);
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    println!(
        "GPT {} blocks × width {} ({} heads, context {}, vocabulary {}): {} parameters; {} ranks × {} \
         sequences, {}, {}; MiB per rank",
        g.layers, g.dim, g.heads, g.ctx, g.vocab, g.params(), a.dp, batch, base.precision,
        opt.name()
    );
    print!(
        "{:>6} {:>13} {:>13} {:>11} {:>12} {:>11} {:>12} {:>10} {:>10}",
        "stage",
        "model states",
        "comm buffers",
        "ring slots",
        "candle vars",
        "grads",
        "activations",
        "backward",
        "total"
    );
    if gpu {
        print!(" {:>10} {:>10}", "on GPU", "on host");
    }
    println!();
    // Where the config offloads, the stages that can (1-3; 3 when the parameters go too).
    use ringzero_zero::{mem, OffloadDevice};
    let off = &base.offload;
    let first = match (off.optimizer.device, off.param.device) {
        (OffloadDevice::None, OffloadDevice::None) => 0,
        (_, OffloadDevice::None) => 1,
        _ => 3,
    };
    let stages: Vec<u8> = a.stage.map_or((first..=3).collect(), |s| vec![s]);
    for s in stages {
        let plan = mem::OffloadPlan {
            optimizer: off.optimizer.device,
            ratio: f64::from(off.optimizer.ratio),
            k_offloaded: if fp32 { k + 4.0 } else { k },
            params: off.param.device,
        };
        let t = mem::model_states_by_tier(psi, a.dp, s, (elem, k), plan)
            .map_err(|e| anyhow::anyhow!("stage {s} with the config's offload: {e}"))?;
        let cfg = ringzero_zero::ZeroConfig {
            stage: s,
            ..base.clone()
        };
        let comm = ringzero_candle::memory::comm_buffers_peak_for(&g, &cfg, a.dp, 3)
            .map_err(|e| anyhow::anyhow!("stage {s}: {e}"))?;
        // In memory: the device's and the host tier's states (NVMe's are on disk).
        let states = (t.device.total() + t.host.total()) as usize;
        let mut f = Footprint::of(&g, batch, (states, comm), slots);
        if gpu {
            f = f.on_gpu(t.device.total() as usize + comm, device_slots, false);
        }
        print!(
            "{:>6} {:>13.2} {:>13.2} {:>11.2} {:>12.2} {:>11.2} {:>12.2} {:>10.2} {:>10.2}",
            s,
            mib(f.model_states),
            mib(f.comm_buffers),
            mib(f.slots + f.device_slots),
            mib(f.vars),
            mib(f.grads),
            mib(f.activations),
            mib(f.backward),
            mib(f.total())
        );
        if gpu {
            print!(" {:>10.2} {:>10.2}", mib(f.device()), mib(f.host()));
        }
        println!();
    }
    if gpu {
        println!(
            "on GPU: candle's tensors, the engine's device memory and its communicator's slots \
             ({:.2} MiB over cuda_ipc; ring slots counts them with the host communicator's), set \
             against the driver's figure for the process less its CUDA context and libraries \
             (cuBLAS's workspaces, loaded kernels: `ringzero train --device cuda` reads it after a \
             warm-up and prints both); the memory pool's free blocks come on top",
            mib(device_slots)
        );
    }
    println!(
        "comm buffers: the engine's gradient buckets in flight, stage 3's gathered and prefetched \
         buckets and stage 1-2's update pieces at their peak, from `ringzero train`'s calls \
         replayed ({}); `ringzero train` prints the same prediction beside what it measures",
        match &a.config {
            Some(p) => format!("settings from {}", p.display()),
            None => "the engine's default settings; --config FILE for a config's".into(),
        }
    );
    Ok(ExitCode::SUCCESS)
}
