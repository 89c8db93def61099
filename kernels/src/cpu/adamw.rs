//! AdamW (decoupled weight decay, as PyTorch's `torch.optim.AdamW`) on fp32 master weights and
//! fp32 moments:
//!
//! ```text
//! g  = grad · grad_scale            (grad_scale unscales a loss-scaled gradient, or averages)
//! m  = β1·m + (1 − β1)·g
//! v  = β2·v + (1 − β2)·g²
//! p  = p · (1 − lr·wd)
//! p  = p − lr · (m / (1 − β1^t)) / (sqrt(v / (1 − β2^t)) + ε)
//! ```
//! Element-wise, so a rank that owns a shard of the parameters runs it on its shard alone and gets
//! exactly the values a rank holding everything would compute there.

/// AdamW hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Added to the denominator.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

impl AdamW {
    /// Step `t`'s bias corrections, `1 − β₁ᵗ` and `1 − β₂ᵗ`, and the decoupled decay factor
    /// `1 − lr·weight_decay`: the scalars every AdamW kernel (CPU and device) takes. Each power
    /// is taken by repeated squaring in `f32`, every rounding fixed, so all paths get the same
    /// bits: `powi`'s precision is unspecified, and LLVM folds a constant `t` differently from
    /// a run-time one (one ulp apart at `t = 3` for β₂ = 0.999).
    pub fn step_scalars(&self, t: u64) -> (f32, f32, f32) {
        (
            1.0 - pow_f32(self.beta1, t),
            1.0 - pow_f32(self.beta2, t),
            1.0 - self.lr * self.weight_decay,
        )
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

/// One AdamW step (`t` counts from 1) over equally long slices.
///
/// # Panics
/// If the slices differ in length (the engine checks lengths before calling).
pub fn adamw_step(
    h: &AdamW,
    t: u64,
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    grad_scale: f32,
) {
    assert!(
        params.len() == grads.len() && m.len() == grads.len() && v.len() == grads.len(),
        "adamw_step: slice lengths differ"
    );
    let (bc1, bc2, decay) = h.step_scalars(t);
    let (b1, b2, lr, eps) = (h.beta1, h.beta2, h.lr, h.eps);
    for (((p, &g), m), v) in params
        .iter_mut()
        .zip(grads)
        .zip(m.iter_mut())
        .zip(v.iter_mut())
    {
        let g = g * grad_scale;
        *m = b1 * *m + (1.0 - b1) * g;
        *v = b2 * *v + (1.0 - b2) * g * g;
        let update = (*m / bc1) / ((*v / bc2).sqrt() + eps);
        *p = *p * decay - lr * update;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same step in f64.
    fn reference(h: &AdamW, t: u64, p: &mut [f64], g: &[f64], m: &mut [f64], v: &mut [f64]) {
        let (b1, b2) = (h.beta1 as f64, h.beta2 as f64);
        for i in 0..p.len() {
            m[i] = b1 * m[i] + (1.0 - b1) * g[i];
            v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
            let mh = m[i] / (1.0 - b1.powi(t as i32));
            let vh = v[i] / (1.0 - b2.powi(t as i32));
            p[i] = p[i] * (1.0 - h.lr as f64 * h.weight_decay as f64)
                - h.lr as f64 * mh / (vh.sqrt() + h.eps as f64);
        }
    }

    #[test]
    fn matches_an_f64_reference_over_a_fixed_gradient_sequence() {
        let h = AdamW {
            lr: 1e-2,
            ..AdamW::default()
        };
        let n = 257;
        let mut p: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
        let mut p64: Vec<f64> = p.iter().map(|&x| x as f64).collect();
        let (mut m64, mut v64) = (vec![0f64; n], vec![0f64; n]);
        for t in 1..=20u64 {
            let g: Vec<f32> = (0..n)
                .map(|i| (i as f32 * 1.3 + t as f32 * 0.7).cos() * 0.5)
                .collect();
            let g64: Vec<f64> = g.iter().map(|&x| x as f64).collect();
            adamw_step(&h, t, &mut p, &g, &mut m, &mut v, 1.0);
            reference(&h, t, &mut p64, &g64, &mut m64, &mut v64);
        }
        for i in 0..n {
            let err = (p[i] as f64 - p64[i]).abs();
            assert!(
                err < 1e-5 * p64[i].abs().max(1.0),
                "element {i}: {} vs {}",
                p[i],
                p64[i]
            );
        }
    }

    #[test]
    fn a_shard_computes_what_the_whole_computes() {
        let h = AdamW::default();
        let g: Vec<f32> = (0..100).map(|i| i as f32 * 0.01 - 0.3).collect();
        let (mut p, mut m, mut v) = (vec![0.5f32; 100], vec![0f32; 100], vec![0f32; 100]);
        let (mut ps, mut ms, mut vs) = (p[40..70].to_vec(), vec![0f32; 30], vec![0f32; 30]);
        adamw_step(&h, 1, &mut p, &g, &mut m, &mut v, 0.5);
        adamw_step(&h, 1, &mut ps, &g[40..70], &mut ms, &mut vs, 0.5);
        assert_eq!(&p[40..70], &ps[..]);
    }
}
