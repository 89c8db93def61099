//! The ZeRO paper's model-state memory and communication model (Rajbhandari et al., 2020, §3 and
//! Table 1): mixed-precision Adam keeps 2Ψ bytes of 16-bit parameters, 2Ψ of 16-bit gradients and
//! KΨ of optimizer state (K = 12: fp32 master weights, momentum and variance) for Ψ parameters.
//!
//! | stage | bytes per rank      | what is sharded                      |
//! |-------|---------------------|--------------------------------------|
//! | 0     | (2 + 2 + K)Ψ        | nothing (plain data parallel)        |
//! | 1     | 2Ψ + 2Ψ + KΨ/N      | optimizer states                     |
//! | 2     | 2Ψ + (2 + K)Ψ/N     | + gradients                          |
//! | 3     | (2 + 2 + K)Ψ/N      | + parameters                         |
//!
//! Communication per step and rank: 2Ψ elements for stages 0–2 (a reduce-scatter and an all-gather,
//! or an all-reduce), 3Ψ for stage 3 (parameters are all-gathered for forward and again for
//! backward), each scaled by (N − 1)/N for a ring.
//!
//! Hybrid sharding (MiCS, FSDP's `HYBRID_SHARD`, [`crate::Engine::new_hybrid`]): the N ranks
//! form R = N/S groups of S; each group shards the states as above over its S ranks (so memory is
//! the table's with N = S), and the R ranks holding the same shard average the reduced gradients
//! once per step with a ring all-reduce: 2(R − 1)/R of the gradient shard (Ψ/S elements; all Ψ in
//! stage 0, which shards nothing) on the links between groups, in exchange for S-way instead of
//! N-way sharding.

/// Optimizer bytes per parameter for mixed-precision Adam.
pub const K_ADAM: f64 = 12.0;

/// Optimizer bytes per parameter for `o` in mixed precision: the fp32 master and 4 bytes per
/// state it keeps (Adam 12, Lion 8, SGD with momentum 8, plain SGD 4). In fp32 training the
/// parameters are their own master: subtract 4.
pub fn k_for(o: &ringzero_kernels::cpu::Optimizer) -> f64 {
    4.0 * (1 + o.states().len()) as f64
}

/// Model-state bytes per rank by category.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelStates {
    /// 16-bit parameters.
    pub params: f64,
    /// 16-bit gradients.
    pub grads: f64,
    /// Optimizer states (fp32 master, momentum, variance).
    pub optimizer: f64,
}

impl ModelStates {
    /// The sum.
    pub fn total(&self) -> f64 {
        self.params + self.grads + self.optimizer
    }
}

/// Bytes per rank for `psi` parameters on `n` ranks at ZeRO stage `stage` (0–3), optimizer
/// bytes per parameter `k`.
pub fn model_states(psi: f64, n: usize, stage: u8, k: f64) -> Result<ModelStates, String> {
    model_states_with(psi, n, stage, 2.0, k)
}

/// [`model_states`] for parameters and gradients of `elem` bytes each (4 for fp32 training, whose
/// optimizer state is then K = 8: momentum and variance, the parameters being their own master).
pub fn model_states_with(
    psi: f64,
    n: usize,
    stage: u8,
    elem: f64,
    k: f64,
) -> Result<ModelStates, String> {
    let n = n.max(1) as f64;
    let (p, g, o) = (elem * psi, elem * psi, k * psi);
    Ok(match stage {
        0 => ModelStates {
            params: p,
            grads: g,
            optimizer: o,
        },
        1 => ModelStates {
            params: p,
            grads: g,
            optimizer: o / n,
        },
        2 => ModelStates {
            params: p,
            grads: g / n,
            optimizer: o / n,
        },
        3 => ModelStates {
            params: p / n,
            grads: g / n,
            optimizer: o / n,
        },
        s => {
            return Err(format!(
                "ZeRO stage {s} does not exist (expected 0, 1, 2 or 3)"
            ))
        }
    })
}

/// Elements each rank sends per training step (ring collectives).
pub fn comm_elements_per_step(psi: f64, n: usize, stage: u8) -> f64 {
    let n = n.max(1) as f64;
    let volume = if stage == 3 { 3.0 } else { 2.0 };
    volume * psi * (n - 1.0) / n
}

/// Replica groups of a hybrid layout: `n` ranks sharded over groups of `shard`, refused (with the
/// reason) unless `shard` divides `n` into whole groups.
pub fn replicas(n: usize, shard: usize) -> Result<usize, String> {
    if shard == 0 || n == 0 || !n.is_multiple_of(shard) {
        return Err(format!(
            "shard size {shard} does not divide the {n} ranks into whole groups"
        ));
    }
    Ok(n / shard)
}

/// Elements each rank sends per training step under hybrid sharding.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HybridComm {
    /// Inside its shard group ([`comm_elements_per_step`] on `shard` ranks).
    pub group: f64,
    /// To the other replicas of its shard (the gradient average, a ring all-reduce).
    pub replicas: f64,
}

/// [`comm_elements_per_step`] for `psi` parameters sharded over groups of `shard` ranks with
/// `replicas` copies of each group (ring collectives in both).
pub fn hybrid_comm_elements_per_step(
    psi: f64,
    shard: usize,
    replicas: usize,
    stage: u8,
) -> HybridComm {
    let (s, r) = (shard.max(1) as f64, replicas.max(1) as f64);
    // Stage 0 averages whole gradients across replicas; the others the shard's reduced range.
    let averaged = if stage == 0 { psi } else { psi / s };
    HybridComm {
        group: comm_elements_per_step(psi, shard, stage),
        replicas: 2.0 * averaged * (r - 1.0) / r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reproduces_the_papers_table_for_7_5b_on_64_ranks() {
        let psi = 7.5e9;
        let gb = |s| model_states(psi, 64, s, K_ADAM).unwrap().total() / 1e9;
        assert!((gb(0) - 120.0).abs() < 0.05, "{}", gb(0));
        assert!((gb(1) - 31.4).abs() < 0.05, "{}", gb(1));
        assert!((gb(2) - 16.6).abs() < 0.05, "{}", gb(2));
        assert!((gb(3) - 1.9).abs() < 0.05, "{}", gb(3));
        assert!(model_states(psi, 64, 4, K_ADAM)
            .unwrap_err()
            .contains("stage 4"));
        assert_eq!(comm_elements_per_step(100.0, 4, 1), 150.0);
        assert_eq!(comm_elements_per_step(100.0, 4, 3), 225.0);
    }

    #[test]
    fn hybrid_sharding_trades_memory_for_traffic_between_groups() {
        let psi = 7.5e9;
        // 64 ranks as 8 groups of 8: memory is the table's for 8 ranks.
        assert_eq!(replicas(64, 8), Ok(8));
        let m = model_states(psi, 8, 3, K_ADAM).unwrap().total() / 1e9;
        assert!((m - 15.0).abs() < 0.05, "{m}");
        // Stage 3: 3Ψ·7/8 inside the group, 2·(Ψ/8)·7/8 across the 8 replicas.
        let c = hybrid_comm_elements_per_step(800.0, 8, 8, 3);
        assert_eq!(c.group, 2100.0);
        assert_eq!(c.replicas, 175.0);
        // Stage 0 averages whole gradients across groups.
        assert_eq!(
            hybrid_comm_elements_per_step(800.0, 8, 8, 0).replicas,
            1400.0
        );
        // One group is plain ZeRO; groups of one are plain data parallel across ranks.
        let one = hybrid_comm_elements_per_step(800.0, 64, 1, 2);
        assert_eq!(
            (one.group, one.replicas),
            (comm_elements_per_step(800.0, 64, 2), 0.0)
        );
        let solo = hybrid_comm_elements_per_step(800.0, 1, 64, 1);
        assert_eq!(solo.group, 0.0);
        assert_eq!(solo.replicas, 2.0 * 800.0 * 63.0 / 64.0);
        for (n, s) in [(64, 0), (64, 7), (0, 1), (4, 8)] {
            let e = replicas(n, s).unwrap_err();
            assert!(e.contains(&format!("shard size {s}")), "{e}");
        }
    }
}
