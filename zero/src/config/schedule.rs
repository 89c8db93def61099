//! Learning-rate schedules as DeepSpeed defines them (`scheduler.type` in its config):
//! `WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR`, `LRRangeTest` and `OneCycle`, formula for
//! formula as DeepSpeed 0.19's `lr_schedules` computes them. Each is a pure function of the
//! optimizer step, so a checkpoint's step count restores it at any world size.
//!
//! Which rate step `k` (1, 2, ...) uses follows DeepSpeed's engine, which steps the scheduler
//! after each optimizer step: step 1 uses what the scheduler set when it was made (`WarmupLR`
//! and `WarmupDecayLR` their minimum rate, `WarmupCosineLR` its ratio before the first
//! iteration, 0; `LRRangeTest` and `OneCycle` their minimum, and `OneCycle` its minimum
//! momentum), and step `k ≥ 2` the scheduler's rate at iteration `k − 2`. Skipped (overflowed)
//! steps do not advance it, as in DeepSpeed. `tests/fixtures/deepspeed-schedules.json` holds
//! the rates DeepSpeed's engine ran random schedules of each type at, step by step, and the
//! tests hold these to them.

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
    /// and stays there.
    WarmupCosineLr {
        /// `warmup_min_ratio`.
        min_ratio: f64,
        /// `cos_min_ratio`.
        cos_min_ratio: f64,
        /// `warmup_num_steps` (at least 2).
        warmup_steps: u64,
        /// `warmup_type`.
        warmup: Warmup,
        /// `total_num_steps` (at or below `warmup_steps`: no cosine, the floor at once).
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
    /// `second_steps` (in stairs when a stair count is set), then decays, divided by `1 +
    /// decay_lr_rate × (iterations past the cycle / decay_step_size)`; with `cycle_momentum`,
    /// Adam's β₁ moves the other way between `min_mom` and `max_mom`, then grows by
    /// `decay_mom_rate` likewise (and β₂ is 0.99, as DeepSpeed sets it).
    OneCycle {
        /// `cycle_min_lr`.
        min_lr: f64,
        /// `cycle_max_lr`.
        max_lr: f64,
        /// `decay_lr_rate`.
        decay_lr_rate: f64,
        /// `cycle_first_step_size` (above 0).
        first_steps: f64,
        /// `cycle_second_step_size` (default: `first_steps`).
        second_steps: f64,
        /// `cycle_first_stair_count` (0: a ramp).
        first_stairs: f64,
        /// `cycle_second_stair_count` (default: `first_stairs`).
        second_stairs: f64,
        /// `decay_step_size` (0: no decay after the cycle).
        decay_step_size: f64,
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
                // As made (it = −1), the minimum.
                let g = if it < 0 {
                    0.0
                } else {
                    warm(it as u64, warmup_steps, warmup, None)
                };
                h.lr = lerp(min_lr, max_lr, g);
            }
            LrSchedule::WarmupDecayLr {
                min_lr,
                max_lr,
                warmup_steps,
                warmup,
                total_steps,
            } => {
                let g = if it < 0 {
                    0.0
                } else {
                    warm(it as u64, warmup_steps, warmup, Some(total_steps))
                };
                h.lr = lerp(min_lr, max_lr, g);
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
                    // The cosine's progress stops at its end: the ratio stays at cos_min_ratio
                    // (and is there at once when total_steps ≤ warmup_steps).
                    let done = (it as u64 - warmup_steps + 1) as f64;
                    let span = (total_steps.saturating_sub(warmup_steps) as f64).max(1.0);
                    let progress = (done / span).min(1.0);
                    let c = (1.0 + (std::f64::consts::PI * progress).cos()) / 2.0;
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
                first_stairs,
                second_stairs,
                decay_step_size,
                momentum,
            } => {
                let total = first_steps + second_steps;
                let (lr, mom) = if it < 0 {
                    (min_lr, momentum.map(|(min_mom, _, _)| min_mom))
                } else if (it as f64) < total {
                    let cycle = Cycle {
                        first: first_steps,
                        second: second_steps,
                        first_stairs,
                        second_stairs,
                    };
                    let scale = cycle.scale((it + 1) as f64);
                    (
                        min_lr + (max_lr - min_lr) * scale,
                        momentum.map(|(min_mom, max_mom, _)| max_mom - (max_mom - min_mom) * scale),
                    )
                } else {
                    // DeepSpeed skips a decay whose step size or rate is 0.
                    let decay = |rate: f64| {
                        (decay_step_size != 0.0 && rate != 0.0)
                            .then(|| rate * ((it as f64 - total + 1.0) / decay_step_size))
                    };
                    let lr = decay(decay_lr_rate).map_or(min_lr, |d| min_lr / (1.0 + d));
                    let mom = momentum.map(|(_, max_mom, rate)| {
                        decay(rate).map_or(max_mom, |d| max_mom * (1.0 + d))
                    });
                    (lr, mom)
                };
                h.lr = lr as f32;
                if let Some(m) = mom {
                    (h.beta1, h.beta2) = (m as f32, 0.99);
                }
            }
        }
        h
    }
}

/// OneCycle's cycle: a rise over `first` iterations and a fall over `second`, each a ramp or,
/// with a stair count, that many stairs.
struct Cycle {
    first: f64,
    second: f64,
    first_stairs: f64,
    second_stairs: f64,
}

impl Cycle {
    /// How far up the cycle (0 to 1) batch iteration `b` is (DeepSpeed's scale factor).
    fn scale(&self, b: f64) -> f64 {
        let total = self.first + self.second;
        let ratio = self.first / total;
        let cycle = (1.0 + b / total).floor();
        let x = 1.0 + b / total - cycle;
        let (ramp, stairs) = if x <= ratio {
            (x / ratio, self.first_stairs)
        } else {
            ((x - 1.0) / (ratio - 1.0), self.second_stairs)
        };
        if stairs <= 0.0 {
            return ramp;
        }
        let at = b % total;
        let position = if at <= self.first {
            at * stairs / self.first
        } else {
            (total - at) * stairs / self.second
        };
        position.floor() / stairs
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
    /// formulas (step 1 is what the scheduler set when made); the fixture test in
    /// `tests/deepspeed_configs.rs` holds them to DeepSpeed's engine itself.
    #[test]
    fn the_rates_follow_deepspeeds_formulas() {
        let w = LrSchedule::WarmupLr {
            min_lr: 0.0,
            max_lr: 0.01,
            warmup_steps: 4,
            warmup: Warmup::Linear,
        };
        assert_eq!(lrs(&w, 7), [0.0, 0.0, 0.0025, 0.005, 0.0075, 0.01, 0.01]);
        let l = LrSchedule::WarmupLr {
            min_lr: 0.0,
            max_lr: 1.0,
            warmup_steps: 4,
            warmup: Warmup::Log,
        };
        let got = lrs(&l, 4);
        let want = [
            0.0,
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
        // As made 0; iterations 0..: warm 0, 0.5; then (6 − i)/4 for i = 2..: 1, 0.75, 0.5,
        // 0.25, 0, 0.
        assert_eq!(
            lrs(&d, 9),
            [0.0, 0.0, 0.005, 0.01, 0.0075, 0.005, 0.0025, 0.0, 0.0]
        );
        // WarmupCosineLR on the base rate 0.5: ratio 0 as made, then warm-up (linear, 2
        // iterations) from 0.2: 0.2, 0.6; then (1 + cos(π·j/4))/2 for j = 1..4, floored at 0.1:
        // 0.1 + 0.9·{0.8536, 0.5, 0.1464, 0}, and past the end it stays at the floor.
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
            cos(4.0),
        ]
        .iter()
        .map(|r| (0.5 * r) as f32)
        .collect();
        assert_eq!(lrs(&wc, 8), want);
        assert_eq!(lrs(&wc, 8)[7], 0.05, "the floor: 0.5 × cos_min_ratio");
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
            first_steps: 2.0,
            second_steps: 2.0,
            first_stairs: 0.0,
            second_stairs: 0.0,
            decay_step_size: 1.0,
            momentum: Some((0.8, 0.9, 0.0)),
        };
        let base = Optimizer::default();
        let got: Vec<(f32, f32, f32)> = (1..=8)
            .map(|k| o.at(k, base))
            .map(|h| (h.lr, h.beta1, h.beta2))
            .collect();
        // As made: the minimum rate and momentum. Iterations 0..3 at batch iterations 1..4:
        // the cycle's quarter, top, three quarters, end; then the rate divided by 1 + 0.5·j
        // for j = 1, 2, 3 iterations past the cycle, the momentum at its maximum.
        assert_eq!(
            got,
            [
                (0.1, 0.8, 0.99),
                (0.3, 0.85, 0.99),
                (0.5, 0.8, 0.99),
                (0.3, 0.85, 0.99),
                (0.1, 0.9, 0.99),
                ((0.1 / 1.5) as f32, 0.9, 0.99),
                (0.05, 0.9, 0.99),
                (0.04, 0.9, 0.99),
            ]
        );
        // In stairs: two up over 4 iterations, two down over 4.
        let stairs = LrSchedule::OneCycle {
            min_lr: 0.1,
            max_lr: 0.5,
            decay_lr_rate: 0.0,
            first_steps: 4.0,
            second_steps: 4.0,
            first_stairs: 2.0,
            second_stairs: 2.0,
            decay_step_size: 0.0,
            momentum: None,
        };
        assert_eq!(lrs(&stairs, 8), [0.1, 0.1, 0.3, 0.3, 0.5, 0.3, 0.3, 0.1]);
    }
}
