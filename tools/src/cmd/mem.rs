//! `ringzero mem`: the ZeRO paper's model-state and communication table.

use std::process::ExitCode;

use super::count;

/// `ringzero mem`'s arguments.
#[derive(clap::Args)]
pub(crate) struct MemCli {
    /// Parameters: 7.5B, 350M, 1.3e9, ...
    #[arg(long = "params", value_parser = count)]
    pub(crate) params: f64,
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
    let MemCli {
        params,
        dp,
        stage,
        k,
        optimizer,
        shard_size,
    } = a;
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
    if shard_size.is_some() {
        println!(
            "hybrid: N = the shard group ({shard}); between groups, the gradient average over \
             the {replicas} replicas: 2·(Ψ/{shard})·(R−1)/R elements (all Ψ in stage 0)"
        );
    }
    Ok(ExitCode::SUCCESS)
}
