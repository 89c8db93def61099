//! The optimizers' update rules on fp32 master weights and fp32 state, element-wise, so a rank
//! that owns a shard of the parameters runs a rule on its shard alone and gets exactly the values
//! a rank holding everything would compute there. `g` is the gradient times `grad_scale` (which
//! unscales a loss-scaled gradient, or averages), `t` the step (from 1), `wd` the weight decay:
//!
//! ```text
//! AdamW  (torch.optim.AdamW)     m = β1·m + (1 − β1)·g
//!                                v = β2·v + (1 − β2)·g²
//!                                p = p·(1 − lr·wd) − lr·(m / (1 − β1ᵗ)) / (sqrt(v / (1 − β2ᵗ)) + ε)
//! Adam   (torch.optim.Adam)      g = g + wd·p  (L2: the decay goes through the moments), then
//!                                as AdamW without the decoupled factor
//! Lion   (Chen et al. 2023)      c = β1·m + (1 − β1)·g
//!                                p = p·(1 − lr·wd) − lr·sign(c)
//!                                m = β2·m + (1 − β2)·g
//! SGD    (torch.optim.SGD)       g = g + wd·p;  with momentum μ: b = μ·b + g, and the step
//!                                takes b (or g + μ·b, Nesterov); p = p − lr·step
//! ```
//!
//! As in PyTorch, an L2 term is added only when `wd` is not zero, SGD's momentum buffer starts
//! at zero (so the first step's buffer is the gradient, as torch's clone), and `sign(0) = 0`.
//! Every kernel — this one, the device's, the emulated device source — computes each element in
//! this order with every multiply and add rounded on its own (no fused multiply-add), so all of
//! them give the same bits.

/// Which update rule ([`Optimizer::rule`]); see the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// Adam with decoupled weight decay (`torch.optim.AdamW`).
    AdamW,
    /// Adam with weight decay as an L2 term on the gradient (`torch.optim.Adam`; DeepSpeed's
    /// `Adam` with `adam_w_mode: false`).
    Adam,
    /// Lion: the sign of an interpolated momentum, with decoupled weight decay.
    Lion,
    /// Stochastic gradient descent with optional momentum (`beta1`) and L2 weight decay
    /// (`torch.optim.SGD`, no dampening).
    Sgd {
        /// Nesterov momentum (needs a momentum above zero, as torch requires).
        nesterov: bool,
    },
}

/// An optimizer: its rule and hyper-parameters. `beta1` is SGD's momentum; fields a rule does
/// not use are ignored (SGD's `beta2` and `eps`, Lion's `eps`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Optimizer {
    /// The update rule.
    pub rule: Rule,
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay (Adam, Lion's interpolation), or SGD's momentum (0: none).
    pub beta1: f32,
    /// Second-moment decay (Adam), or Lion's momentum decay.
    pub beta2: f32,
    /// Added to Adam's denominator.
    pub eps: f32,
    /// Weight decay: decoupled for AdamW and Lion, an L2 term for Adam and SGD.
    pub weight_decay: f32,
}

impl Default for Optimizer {
    /// AdamW at lr 1e-3, betas (0.9, 0.999), ε 1e-8, weight decay 0.01 (torch's defaults).
    fn default() -> Self {
        Optimizer::adamw(1e-3)
    }
}

/// What one step of a rule takes, flattened as every kernel receives it
/// ([`Optimizer::step_scalars`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepScalars {
    /// The kernels' rule code: 0 AdamW, 1 Adam, 2 Lion, 3 SGD, 4 SGD with momentum, 5 Nesterov.
    pub code: u32,
    /// Learning rate.
    pub lr: f32,
    /// β1 (SGD: μ).
    pub b1: f32,
    /// β2.
    pub b2: f32,
    /// ε.
    pub eps: f32,
    /// The decoupled decay factor `1 − lr·wd` (1 for the L2 rules).
    pub decay: f32,
    /// The L2 coefficient (0 for the decoupled rules; not applied when 0).
    pub l2: f32,
    /// `1 − β1ᵗ` (Adam rules).
    pub bc1: f32,
    /// `1 − β2ᵗ` (Adam rules).
    pub bc2: f32,
}

impl Optimizer {
    /// AdamW at `lr` with torch's other defaults (betas 0.9, 0.999; ε 1e-8; weight decay 0.01).
    pub fn adamw(lr: f32) -> Optimizer {
        Optimizer {
            rule: Rule::AdamW,
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }

    /// Adam (L2 weight decay) at `lr` with torch's defaults (weight decay 0).
    pub fn adam(lr: f32) -> Optimizer {
        Optimizer {
            rule: Rule::Adam,
            weight_decay: 0.0,
            ..Optimizer::adamw(lr)
        }
    }

    /// Lion at `lr` with the paper's betas (0.9, 0.99) and no weight decay. Lion wants a rate
    /// 3–10× below AdamW's (the sign makes every step as large as the rate).
    pub fn lion(lr: f32) -> Optimizer {
        Optimizer {
            rule: Rule::Lion,
            lr,
            beta1: 0.9,
            beta2: 0.99,
            eps: 0.0,
            weight_decay: 0.0,
        }
    }

    /// SGD at `lr` with `momentum` (0: plain SGD, no state), no weight decay.
    pub fn sgd(lr: f32, momentum: f32) -> Optimizer {
        Optimizer {
            rule: Rule::Sgd { nesterov: false },
            lr,
            beta1: momentum,
            beta2: 0.0,
            eps: 0.0,
            weight_decay: 0.0,
        }
    }

    /// One optimizer per rule and variant — AdamW, Adam, Lion, SGD without and with momentum,
    /// Nesterov — each with weight decay, at rates that move small models visibly in a few
    /// steps: what the checks run every kernel and engine with (`gpu-check`, the tests), so
    /// that a rule added here is checked everywhere.
    pub fn each_rule() -> [Optimizer; 6] {
        [
            Optimizer::adamw(0.01),
            Optimizer {
                weight_decay: 0.05,
                ..Optimizer::adam(0.01)
            },
            Optimizer {
                weight_decay: 0.1,
                ..Optimizer::lion(0.003)
            },
            Optimizer {
                weight_decay: 0.01,
                ..Optimizer::sgd(0.05, 0.0)
            },
            Optimizer {
                weight_decay: 0.01,
                ..Optimizer::sgd(0.05, 0.9)
            },
            Optimizer {
                rule: Rule::Sgd { nesterov: true },
                weight_decay: 0.01,
                ..Optimizer::sgd(0.05, 0.9)
            },
        ]
    }

    /// The name DeepSpeed's `optimizer.type` gives it.
    pub fn name(&self) -> &'static str {
        match self.rule {
            Rule::AdamW => "AdamW",
            Rule::Adam => "Adam",
            Rule::Lion => "Lion",
            Rule::Sgd { .. } => "SGD",
        }
    }

    /// The fp32 state it keeps per element, by the names torch's state dicts use: Adam's two
    /// moments, Lion's one, SGD's momentum buffer (none without momentum).
    pub fn states(&self) -> &'static [&'static str] {
        match self.rule {
            Rule::AdamW | Rule::Adam => &["exp_avg", "exp_avg_sq"],
            Rule::Lion => &["exp_avg"],
            Rule::Sgd { .. } if self.beta1 != 0.0 => &["momentum_buffer"],
            Rule::Sgd { .. } => &[],
        }
    }

    /// Why these settings cannot train (what torch refuses too), or `None`.
    pub fn invalid(&self) -> Option<String> {
        let unit = |x: f32| (0.0..1.0).contains(&x);
        let n = self.name();
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return Some(format!(
                "{n}: the learning rate {} must be finite and at least 0",
                self.lr
            ));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Some(format!(
                "{n}: weight decay {} must be finite and at least 0",
                self.weight_decay
            ));
        }
        match self.rule {
            Rule::AdamW | Rule::Adam | Rule::Lion if !(unit(self.beta1) && unit(self.beta2)) => {
                Some(format!(
                    "{n}: betas ({}, {}) must each be in [0, 1)",
                    self.beta1, self.beta2
                ))
            }
            Rule::AdamW | Rule::Adam if !(self.eps.is_finite() && self.eps > 0.0) => {
                Some(format!("{n}: eps {} must be finite and above 0", self.eps))
            }
            Rule::Sgd { nesterov }
                if !(self.beta1.is_finite() && self.beta1 >= 0.0)
                    || (nesterov && self.beta1 == 0.0) =>
            {
                Some(format!(
                    "SGD: momentum {} must be finite and at least 0, and above 0 with Nesterov",
                    self.beta1
                ))
            }
            _ => None,
        }
    }

    /// Step `t`'s scalars, the same for every kernel (CPU and device). Each power is taken by
    /// repeated squaring in `f32`, every rounding fixed, so all paths get the same bits:
    /// `powi`'s precision is unspecified, and LLVM folds a constant `t` differently from a
    /// run-time one (one ulp apart at `t = 3` for β₂ = 0.999).
    pub fn step_scalars(&self, t: u64) -> StepScalars {
        let decoupled = 1.0 - self.lr * self.weight_decay;
        let (code, decay, l2) = match self.rule {
            Rule::AdamW => (0, decoupled, 0.0),
            Rule::Adam => (1, 1.0, self.weight_decay),
            Rule::Lion => (2, decoupled, 0.0),
            Rule::Sgd { .. } if self.beta1 == 0.0 => (3, 1.0, self.weight_decay),
            Rule::Sgd { nesterov: false } => (4, 1.0, self.weight_decay),
            Rule::Sgd { nesterov: true } => (5, 1.0, self.weight_decay),
        };
        StepScalars {
            code,
            lr: self.lr,
            b1: self.beta1,
            b2: self.beta2,
            eps: self.eps,
            decay,
            l2,
            bc1: 1.0 - pow_f32(self.beta1, t),
            bc2: 1.0 - pow_f32(self.beta2, t),
        }
    }
}

/// `b` to the power `e`, by squaring, rounding to `f32` after each multiplication.
fn pow_f32(mut b: f32, mut e: u64) -> f32 {
    let mut r = 1.0f32;
    while e > 0 {
        if e & 1 == 1 {
            r *= b;
        }
        b *= b;
        e >>= 1;
    }
    r
}

/// `sign(c)` as the rules take it: 1, −1, or 0 for zero (and NaN, which no comparison holds).
fn sign(c: f32) -> f32 {
    if c > 0.0 {
        1.0
    } else if c < 0.0 {
        -1.0
    } else {
        0.0
    }
}

/// One step (`t` counts from 1) of `h`'s rule over equally long slices: `s1` is the first state
/// (Adam's and Lion's `exp_avg`, SGD's momentum buffer), `s2` the second (Adam's `exp_avg_sq`);
/// a state the rule does not keep is an empty slice.
///
/// # Panics
/// If a slice's length is neither the parameters' nor, for a state the rule does not keep, 0.
pub fn optim_step(
    h: &Optimizer,
    t: u64,
    params: &mut [f32],
    grads: &[f32],
    s1: &mut [f32],
    s2: &mut [f32],
    grad_scale: f32,
) {
    // The f32 case of the mixed step: the same loop, in the widest vectors this CPU has.
    super::float::step_mixed::<f32>(h, t, params, None, grads, s1, s2, grad_scale)
}

/// [`optim_step`]'s body for the step's scalars `k` ([`Optimizer::step_scalars`], computed
/// once per step by the caller, not per block), inlined into each vector width's version of
/// [`super::float::step_mixed`]. `keeps`: the states the rule keeps.
#[inline(always)]
pub(super) fn optim_step_inline(
    k: &StepScalars,
    keeps: usize,
    params: &mut [f32],
    grads: &[f32],
    s1: &mut [f32],
    s2: &mut [f32],
    grad_scale: f32,
) {
    let n = params.len();
    assert!(
        grads.len() == n
            && s1.len() == if keeps >= 1 { n } else { 0 }
            && s2.len() == if keeps >= 2 { n } else { 0 },
        "optim_step: slice lengths differ"
    );
    let StepScalars {
        lr,
        b1,
        b2,
        eps,
        decay,
        l2,
        bc1,
        bc2,
        ..
    } = *k;
    // The rule is chosen outside the loops, so each is a plain loop LLVM vectorizes.
    let l2_of = |g: f32, p: f32| if l2 != 0.0 { g + l2 * p } else { g };
    match k.code {
        0 | 1 => {
            for (((p, &g), m), v) in params
                .iter_mut()
                .zip(grads)
                .zip(s1.iter_mut())
                .zip(s2.iter_mut())
            {
                let g = l2_of(g * grad_scale, *p);
                *m = b1 * *m + (1.0 - b1) * g;
                *v = b2 * *v + (1.0 - b2) * g * g;
                let update = (*m / bc1) / ((*v / bc2).sqrt() + eps);
                *p = *p * decay - lr * update;
            }
        }
        2 => {
            for ((p, &g), m) in params.iter_mut().zip(grads).zip(s1.iter_mut()) {
                let g = g * grad_scale;
                let c = b1 * *m + (1.0 - b1) * g;
                *p = *p * decay - lr * sign(c);
                *m = b2 * *m + (1.0 - b2) * g;
            }
        }
        3 => {
            for (p, &g) in params.iter_mut().zip(grads) {
                let g = l2_of(g * grad_scale, *p);
                *p -= lr * g;
            }
        }
        _ => {
            let nesterov = k.code == 5;
            for ((p, &g), b) in params.iter_mut().zip(grads).zip(s1.iter_mut()) {
                let g = l2_of(g * grad_scale, *p);
                *b = b1 * *b + g;
                let d = if nesterov { g + b1 * *b } else { *b };
                *p -= lr * d;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rules in f64, written from their papers' and torch's formulas (not from the code
    /// above): one step on `p` with states `m` and `v` (v unused but by Adam).
    fn reference(h: &Optimizer, t: u64, p: &mut [f64], g: &[f64], m: &mut [f64], v: &mut [f64]) {
        let (b1, b2, lr, wd) = (
            h.beta1 as f64,
            h.beta2 as f64,
            h.lr as f64,
            h.weight_decay as f64,
        );
        for i in 0..p.len() {
            match h.rule {
                Rule::AdamW | Rule::Adam => {
                    let gi = if h.rule == Rule::Adam {
                        g[i] + wd * p[i]
                    } else {
                        g[i]
                    };
                    m[i] = b1 * m[i] + (1.0 - b1) * gi;
                    v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
                    let mh = m[i] / (1.0 - b1.powi(t as i32));
                    let vh = v[i] / (1.0 - b2.powi(t as i32));
                    if h.rule == Rule::AdamW {
                        p[i] *= 1.0 - lr * wd;
                    }
                    p[i] -= lr * mh / (vh.sqrt() + h.eps as f64);
                }
                Rule::Lion => {
                    let c = b1 * m[i] + (1.0 - b1) * g[i];
                    p[i] = p[i] * (1.0 - lr * wd) - lr * c.signum() * f64::from(c != 0.0);
                    m[i] = b2 * m[i] + (1.0 - b2) * g[i];
                }
                Rule::Sgd { nesterov } => {
                    let gi = g[i] + wd * p[i];
                    let d = if b1 == 0.0 {
                        gi
                    } else {
                        // torch: the first step's buffer is the gradient itself.
                        m[i] = if t == 1 { gi } else { b1 * m[i] + gi };
                        if nesterov {
                            gi + b1 * m[i]
                        } else {
                            m[i]
                        }
                    };
                    p[i] -= lr * d;
                }
            }
        }
    }

    /// Every rule, with weight decay (and SGD with and without momentum, and Nesterov).
    fn rules() -> [Optimizer; 6] {
        Optimizer::each_rule()
    }

    /// States of `h`'s shape for `n` elements.
    fn states(h: &Optimizer, n: usize) -> (Vec<f32>, Vec<f32>) {
        let k = h.states().len();
        (
            vec![0.0; if k >= 1 { n } else { 0 }],
            vec![0.0; if k >= 2 { n } else { 0 }],
        )
    }

    #[test]
    fn every_rule_matches_an_f64_reference_over_a_fixed_gradient_sequence() {
        for h in rules() {
            let n = 257;
            let mut p: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let (mut m, mut v) = states(&h, n);
            let mut p64: Vec<f64> = p.iter().map(|&x| x as f64).collect();
            let (mut m64, mut v64) = (vec![0f64; n], vec![0f64; n]);
            for t in 1..=20u64 {
                let g: Vec<f32> = (0..n)
                    .map(|i| (i as f32 * 1.3 + t as f32 * 0.7).cos() * 0.5)
                    .collect();
                let g64: Vec<f64> = g.iter().map(|&x| x as f64).collect();
                optim_step(&h, t, &mut p, &g, &mut m, &mut v, 1.0);
                reference(&h, t, &mut p64, &g64, &mut m64, &mut v64);
            }
            for i in 0..n {
                let err = (p[i] as f64 - p64[i]).abs();
                // Lion's sign flips where its interpolation is within rounding of 0: then the
                // f32 and f64 paths differ by 2·lr at that step; none does here.
                assert!(
                    err < 1e-5 * p64[i].abs().max(1.0),
                    "{h:?} element {i}: {} vs {}",
                    p[i],
                    p64[i]
                );
            }
        }
    }

    #[test]
    fn a_shard_computes_what_the_whole_computes() {
        for h in rules() {
            let g: Vec<f32> = (0..100).map(|i| i as f32 * 0.01 - 0.3).collect();
            let mut p = vec![0.5f32; 100];
            let (mut m, mut v) = states(&h, 100);
            let mut ps = p[40..70].to_vec();
            let (mut ms, mut vs) = states(&h, 30);
            for t in 1..=3 {
                optim_step(&h, t, &mut p, &g, &mut m, &mut v, 0.5);
                optim_step(&h, t, &mut ps, &g[40..70], &mut ms, &mut vs, 0.5);
            }
            assert_eq!(&p[40..70], &ps[..], "{h:?}");
        }
    }

    #[test]
    fn states_follow_the_rule_and_bad_settings_are_named() {
        assert_eq!(Optimizer::adamw(1e-3).states(), ["exp_avg", "exp_avg_sq"]);
        assert_eq!(Optimizer::lion(1e-4).states(), ["exp_avg"]);
        assert_eq!(Optimizer::sgd(0.1, 0.9).states(), ["momentum_buffer"]);
        assert!(Optimizer::sgd(0.1, 0.0).states().is_empty());
        assert_eq!(Optimizer::default(), Optimizer::adamw(1e-3));
        let bad = |h: Optimizer, want: &str| {
            let e = h.invalid().unwrap_or_else(|| panic!("{h:?} accepted"));
            assert!(e.contains(want), "{e}");
        };
        bad(
            Optimizer {
                beta2: 1.0,
                ..Optimizer::adam(1e-3)
            },
            "betas",
        );
        bad(
            Optimizer {
                lr: f32::NAN,
                ..Optimizer::lion(1e-3)
            },
            "learning rate",
        );
        bad(
            Optimizer {
                eps: 0.0,
                ..Optimizer::adamw(1e-3)
            },
            "eps",
        );
        bad(
            Optimizer {
                rule: Rule::Sgd { nesterov: true },
                ..Optimizer::sgd(0.1, 0.0)
            },
            "Nesterov",
        );
        bad(
            Optimizer {
                weight_decay: -1.0,
                ..Optimizer::sgd(0.1, 0.9)
            },
            "weight decay",
        );
        for h in rules() {
            assert_eq!(h.invalid(), None, "{h:?}");
        }
    }
}
