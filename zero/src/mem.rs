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
//!
//! Offload (ZeRO-Offload, ZeRO-Infinity; [`model_states_by_tier`]): the offloaded share of the
//! optimizer state (`ratio`, all by default) moves from the device to host memory or to NVMe,
//! and at stage 3 `offload_param` moves the parameter shards to host memory or NVMe. An offloaded state
//! keeps an fp32 master in every precision (the CPU steps the master and copies the parameters
//! to the device), so in fp32 training it is K + 4 bytes per parameter where the device's is K.

use crate::config::OffloadDevice;

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

/// Model-state bytes per rank by tier ([`model_states_by_tier`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tiers {
    /// On the engine's device.
    pub device: ModelStates,
    /// In host memory (`"cpu"`).
    pub host: ModelStates,
    /// On NVMe.
    pub nvme: ModelStates,
}

/// Where each part of the model states goes ([`model_states_by_tier`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OffloadPlan {
    /// Where the offloaded optimizer state goes.
    pub optimizer: OffloadDevice,
    /// The share of it offloaded (0 < ratio ≤ 1).
    pub ratio: f64,
    /// Optimizer bytes per parameter once offloaded (K, or K + 4 in fp32 training).
    pub k_offloaded: f64,
    /// Where stage 3's parameter shards go (`offload_param`).
    pub params: OffloadDevice,
}

/// [`model_states_with`] split by tier under `plan` (see the module docs). Refuses what the
/// engine refuses: offload at stage 0, parameters offloaded below stage 3.
pub fn model_states_by_tier(
    psi: f64,
    n: usize,
    stage: u8,
    (elem, k): (f64, f64),
    plan: OffloadPlan,
) -> Result<Tiers, String> {
    let all = model_states_with(psi, n, stage, elem, k)?;
    let zero = ModelStates {
        params: 0.0,
        grads: 0.0,
        optimizer: 0.0,
    };
    let mut t = Tiers {
        device: all,
        host: zero,
        nvme: zero,
    };
    if plan.optimizer != OffloadDevice::None {
        if stage == 0 {
            return Err("offload needs ZeRO stage 1, 2 or 3".into());
        }
        let moved = all.optimizer * plan.ratio;
        let off = moved * plan.k_offloaded / k.max(f64::MIN_POSITIVE);
        t.device.optimizer -= moved;
        if plan.optimizer == OffloadDevice::Cpu {
            t.host.optimizer = off;
        } else {
            t.nvme.optimizer = off;
        }
    }
    if plan.params != OffloadDevice::None {
        if stage != 3 {
            return Err("offload_param needs ZeRO stage 3".into());
        }
        let moved = std::mem::replace(&mut t.device.params, 0.0);
        if plan.params == OffloadDevice::Cpu {
            t.host.params = moved;
        } else {
            t.nvme.params = moved;
        }
    }
    Ok(t)
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
    fn offload_moves_the_optimizer_state_and_stage_3_parameters_off_the_device() {
        let psi = 7.5e9;
        let cpu = OffloadPlan {
            optimizer: OffloadDevice::Cpu,
            ratio: 1.0,
            k_offloaded: K_ADAM,
            params: OffloadDevice::None,
        };
        let t = model_states_by_tier(psi, 64, 2, (2.0, K_ADAM), cpu).unwrap();
        // Stage 2 + offload: 2Ψ + 2Ψ/N on the GPU, 12Ψ/N on the CPU.
        assert_eq!(t.device.optimizer, 0.0);
        assert!((t.device.total() / 1e9 - 15.23).abs() < 0.01, "{t:?}");
        assert!((t.host.optimizer / 1e9 - 1.41).abs() < 0.01, "{t:?}");
        let both = OffloadPlan {
            params: OffloadDevice::Cpu,
            ..cpu
        };
        let t3 = model_states_by_tier(psi, 64, 3, (2.0, K_ADAM), both).unwrap();
        assert!((t3.device.total() / 1e9 - 0.23).abs() < 0.01, "{t3:?}");
        // A 30 % share on NVMe; fp32 training adds the master off the device.
        let part = OffloadPlan {
            optimizer: OffloadDevice::Nvme,
            ratio: 0.3,
            k_offloaded: 12.0,
            params: OffloadDevice::None,
        };
        let t = model_states_by_tier(100.0, 1, 1, (4.0, 8.0), part).unwrap();
        assert!((t.device.optimizer - 560.0).abs() < 1e-9, "{t:?}");
        assert!((t.nvme.optimizer - 360.0).abs() < 1e-9, "{t:?}");
        assert!(model_states_by_tier(psi, 8, 0, (2.0, K_ADAM), cpu).is_err());
        assert!(model_states_by_tier(psi, 8, 2, (2.0, K_ADAM), both).is_err());
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
