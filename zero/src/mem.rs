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

/// Optimizer bytes per parameter for mixed-precision Adam.
pub const K_ADAM: f64 = 12.0;

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
}
