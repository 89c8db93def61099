//! Learning-rate schedules as DeepSpeed defines them (`scheduler.type` in its config):
//! `WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR`, `LRRangeTest` and `OneCycle`. Each is a pure
//! function of the optimizer step, so a checkpoint's step count restores it at any world size.
//!
//! Which rate step `k` (1, 2, ...) uses follows DeepSpeed's engine, which steps the scheduler
//! after each optimizer step: step 1 uses what the scheduler set when it was made (`WarmupLR` and
//! `WarmupDecayLR` set nothing, so the optimizer's own `lr`; `WarmupCosineLR` its ratio before
//! the first iteration, 0; `LRRangeTest` and `OneCycle` their minimum), and step `k ≥ 2` the scheduler's rate at iteration `k − 2`. Skipped (overflowed)
//! steps do not advance it, as in DeepSpeed.

use ringzero_kernels::cpu::Optimizer;

/// How DeepSpeed's warm-up rises from the minimum to the maximum rate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Warmup {
    /// `log(i + 1) / log(n)` of the way at iteration `i` of `n` (DeepSpeed's default).
    Log,
    /// `i / n` of the way.
    Linear,
}

/// A learning-rate schedule (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub enum LrSchedule {
    /// `WarmupLR`: from `min_lr` to `max_lr` over `warmup_steps`, then `max_lr`.
    WarmupLr {
        /// `warmup_min_lr`.
        min_lr: f64,
        /// `warmup_max_lr`.
        max_lr: f64,
        /// `warmup_num_steps` (at least 2, as DeepSpeed makes it).
        warmup_steps: u64,
        /// `warmup_type`.
        warmup: Warmup,
    },
    /// `WarmupDecayLR`: `WarmupLR`, then a linear decay to 0 at `total_steps`.
    WarmupDecayLr {
        /// `warmup_min_lr`.
        min_lr: f64,
        /// `warmup_max_lr`.
        max_lr: f64,
        /// `warmup_num_steps` (at least 2).
        warmup_steps: u64,
        /// `warmup_type`.
        warmup: Warmup,
        /// `total_num_steps`.
        total_steps: u64,
    },
    /// `WarmupCosineLR`: the optimizer's own rate times a ratio that rises from `min_ratio` to 1
    /// over `warmup_steps`, then follows a half cosine down to `cos_min_ratio` at `total_steps`
    /// (and, as DeepSpeed's formula does, back up after it).
    WarmupCosineLr {
        /// `warmup_min_ratio`.
        min_ratio: f64,
        /// `cos_min_ratio`.
        cos_min_ratio: f64,
        /// `warmup_num_steps` (at least 2).
        warmup_steps: u64,
        /// `warmup_type`.
        warmup: Warmup,
        /// `total_num_steps` (above `warmup_steps`).
        total_steps: u64,
    },
    /// `LRRangeTest`: `min_lr × (1 + rate × interval)`, the interval growing by one every
    /// `step_size` steps (continuously, or in stairs).
    LrRangeTest {
        /// `lr_range_test_min_lr`.
        min_lr: f64,
        /// `lr_range_test_step_size`.
        step_size: u64,
        /// `lr_range_test_step_rate`.
        step_rate: f64,
        /// `lr_range_test_staircase`.
        staircase: bool,
    },
    /// `OneCycle`: the rate rises from `min_lr` to `max_lr` over `first_steps`, falls back over
    /// `second_steps`, then decays by `decay_lr_rate` every `decay_step_size` steps; with
    /// `cycle_momentum`, Adam's β₁ moves the other way between `min_mom` and `max_mom` (and β₂
    /// is 0.99, as DeepSpeed sets it).
    OneCycle {
        /// `cycle_min_lr`.
        min_lr: f64,
        /// `cycle_max_lr`.
        max_lr: f64,
        /// `decay_lr_rate`.
        decay_lr_rate: f64,
        /// `cycle_first_step_size`.
        first_steps: u64,
        /// `cycle_second_step_size` (default: `first_steps`).
        second_steps: u64,
        /// `decay_step_size` (0: no decay after the cycle).
        decay_step_size: u64,
        /// `cycle_momentum`, with `(cycle_min_mom, cycle_max_mom, decay_mom_rate)`.
        momentum: Option<(f64, f64, f64)>,
    },
}

impl LrSchedule {
    /// The optimizer's hyper-parameters for optimizer step `k` (1-based), from the configured
    /// ones (`base`, whose `lr` step 1 of the warm-up schedules uses).
    pub fn at(&self, k: u64, base: Optimizer) -> Optimizer {
        assert!(k >= 1, "optimizer steps count from 1");
        // DeepSpeed's `last_batch_iteration` when step k runs; -1 is "as made".
        let it = k as i64 - 2;
        let mut h = base;
        match *self {
            LrSchedule::WarmupLr {
                min_lr,
                max_lr,
                warmup_steps,
                warmup,
            } => {
                if it >= 0 {
                    h.lr = lerp(min_lr, max_lr, warm(it as u64, warmup_steps, warmup, None));
                }
            }
            LrSchedule::WarmupDecayLr {
                min_lr,
                max_lr,
                warmup_steps,
                warmup,
                total_steps,
            } => {
                if it >= 0 {
                    let g = warm(it as u64, warmup_steps, warmup, Some(total_steps));
                    h.lr = lerp(min_lr, max_lr, g);
                }
            }
            LrSchedule::WarmupCosineLr {
                min_ratio,
                cos_min_ratio,
                warmup_steps,
                warmup,
                total_steps,
            } => {
                let ratio = if it < 0 {
                    0.0
                } else if (it as u64) < warmup_steps {
                    let g = warm(it as u64, warmup_steps, warmup, None);
                    min_ratio + g * (1.0 - min_ratio)
                } else {
                    let done = (it as u64 - warmup_steps + 1) as f64;
                    let span = (total_steps - warmup_steps) as f64;
                    let c = (1.0 + (std::f64::consts::PI * done / span).cos()) / 2.0;
                    (cos_min_ratio + (1.0 - cos_min_ratio) * c).max(0.0)
                };
                h.lr = (f64::from(base.lr) * ratio) as f32;
            }
            LrSchedule::LrRangeTest {
                min_lr,
                step_size,
                step_rate,
                staircase,
            } => {
                let x = (it + 1) as f64 / step_size as f64;
                let interval = if staircase { x.floor() } else { x };
                h.lr = (min_lr * (1.0 + step_rate * interval)) as f32;
            }
            LrSchedule::OneCycle {
                min_lr,
                max_lr,
                decay_lr_rate,
                first_steps,
                second_steps,
                decay_step_size,
                momentum,
            } => {
                let total = (first_steps + second_steps) as f64;
                if it < 0 {
                    h.lr = min_lr as f32;
                    if let Some((min_mom, _, _)) = momentum {
                        (h.beta1, h.beta2) = (min_mom as f32, 0.99);
                    }
                } else if it as f64 <= total {
                    let ratio = first_steps as f64 / total;
                    let cycle = (1.0 + it as f64 / total).floor();
                    let x = 1.0 + it as f64 / total - cycle;
                    let scale = if x <= ratio {
                        x / ratio
                    } else {
                        (x - 1.0) / (ratio - 1.0)
                    };
                    h.lr = (min_lr + (max_lr - min_lr) * scale) as f32;
                    if let Some((min_mom, max_mom, _)) = momentum {
                        h.beta1 = (max_mom - (max_mom - min_mom) * scale) as f32;
                        h.beta2 = 0.99;
                    }
                } else {
                    let interval = if decay_step_size == 0 {
                        0.0
                    } else {
                        (it as f64 - total) / decay_step_size as f64
                    };
                    h.lr = (min_lr * (1.0 + decay_lr_rate * interval)) as f32;
                    if let Some((_, max_mom, decay_mom_rate)) = momentum {
                        h.beta1 = (max_mom * (1.0 + decay_mom_rate * interval)) as f32;
                        h.beta2 = 0.99;
                    }
                }
            }
        }
        h
    }
}

fn lerp(min: f64, max: f64, g: f64) -> f32 {
    (min + (max - min) * g) as f32
}

/// The warm-up's fraction at iteration `it` of `n`; after it 1 (or, with a `total`, the linear
/// decay to 0 at `total`).
fn warm(it: u64, n: u64, how: Warmup, total: Option<u64>) -> f64 {
    if it < n {
        return match how {
            Warmup::Log => ((it + 1) as f64).ln() / (n as f64).ln(),
            Warmup::Linear => it as f64 / n as f64,
        };
    }
    match total {
        None => 1.0,
        Some(t) => ((t as f64 - it as f64) / (t.saturating_sub(n) as f64).max(1.0)).max(0.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lrs(s: &LrSchedule, steps: u64) -> Vec<f32> {
        let base = Optimizer {
            lr: 0.5,
            ..Optimizer::default()
        };
        (1..=steps).map(|k| s.at(k, base).lr).collect()
    }

    /// The rates DeepSpeed's schedulers set, iteration by iteration, worked by hand from their
    /// formulas (step 1 is what the scheduler set when made).
    #[test]
    fn the_rates_follow_deepspeeds_formulas() {
        let w = LrSchedule::WarmupLr {
            min_lr: 0.0,
            max_lr: 0.01,
            warmup_steps: 4,
            warmup: Warmup::Linear,
        };
        assert_eq!(lrs(&w, 7), [0.5, 0.0, 0.0025, 0.005, 0.0075, 0.01, 0.01]);
        let l = LrSchedule::WarmupLr {
            min_lr: 0.0,
            max_lr: 1.0,
            warmup_steps: 4,
            warmup: Warmup::Log,
        };
        let got = lrs(&l, 4);
        let want = [
            0.5,
            0.0,
            (2f64.ln() / 4f64.ln()) as f32,
            (3f64.ln() / 4f64.ln()) as f32,
        ];
        assert_eq!(got, want);
        let d = LrSchedule::WarmupDecayLr {
            min_lr: 0.0,
            max_lr: 0.01,
            warmup_steps: 2,
            warmup: Warmup::Linear,
            total_steps: 6,
        };
        // Iterations 0..: warm 0, 0.5; then (6 − i)/4 for i = 2..: 1, 0.75, 0.5, 0.25, 0, 0.
        assert_eq!(
            lrs(&d, 9),
            [0.5, 0.0, 0.005, 0.01, 0.0075, 0.005, 0.0025, 0.0, 0.0]
        );
        // WarmupCosineLR on the base rate 0.5: ratio 0 as made, then warm-up (linear, 2
        // iterations) from 0.2: 0.2, 0.6; then (1 + cos(π·j/4))/2 for j = 1..4, floored at 0.1:
        // 0.1 + 0.9·{0.8536, 0.5, 0.1464, 0}, and past the end the cosine rises again (j = 5).
        let wc = LrSchedule::WarmupCosineLr {
            min_ratio: 0.2,
            cos_min_ratio: 0.1,
            warmup_steps: 2,
            warmup: Warmup::Linear,
            total_steps: 6,
        };
        let cos = |j: f64| 0.1 + 0.9 * (1.0 + (std::f64::consts::PI * j / 4.0).cos()) / 2.0;
        let want: Vec<f32> = [
            0.0,
            0.2,
            0.6,
            cos(1.0),
            cos(2.0),
            cos(3.0),
            cos(4.0),
            cos(5.0),
        ]
        .iter()
        .map(|r| (0.5 * r) as f32)
        .collect();
        assert_eq!(lrs(&wc, 8), want);
        assert_eq!(lrs(&wc, 7)[6], 0.05, "the floor: 0.5 × cos_min_ratio");
        let r = LrSchedule::LrRangeTest {
            min_lr: 0.1,
            step_size: 2,
            step_rate: 1.0,
            staircase: true,
        };
        assert_eq!(lrs(&r, 5), [0.1, 0.1, 0.2, 0.2, 0.3]);
        let c = LrSchedule::LrRangeTest {
            min_lr: 0.1,
            step_size: 2,
            step_rate: 1.0,
            staircase: false,
        };
        assert_eq!(lrs(&c, 3), [0.1, 0.15, 0.2]);
        let o = LrSchedule::OneCycle {
            min_lr: 0.1,
            max_lr: 0.5,
            decay_lr_rate: 0.5,
            first_steps: 2,
            second_steps: 2,
            decay_step_size: 1,
            momentum: Some((0.8, 0.9, 0.0)),
        };
        let base = Optimizer::default();
        let got: Vec<(f32, f32, f32)> = (1..=8)
            .map(|k| o.at(k, base))
            .map(|h| (h.lr, h.beta1, h.beta2))
            .collect();
        // Iterations −1 (as made), 0, 1, 2 (top), 3, 4 (end of the cycle), then decay 1, 2.
        assert_eq!(
            got,
            [
                (0.1, 0.8, 0.99),
                (0.1, 0.9, 0.99),
                (0.3, 0.85, 0.99),
                (0.5, 0.8, 0.99),
                (0.3, 0.85, 0.99),
                (0.1, 0.9, 0.99),
                (0.15, 0.9, 0.99),
                (0.2, 0.9, 0.99),
            ]
        );
    }
}
