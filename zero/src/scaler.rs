//! Loss scaling for fp16: the trainer multiplies its loss (hence every gradient) by
//! [`LossScaler::scale`]; the engine divides it out before the optimizer. An overflow anywhere
//! (an inf or NaN in any rank's reduced gradient shard, agreed by a max all-reduce) skips the step
//! on every rank.
//!
//! Dynamic rule (DeepSpeed's keys): each overflow uses up one unit of `hysteresis`; when none is
//! left the scale is halved (not below `min_loss_scale`). After `loss_scale_window` consecutive
//! good steps the scale doubles and the hysteresis is refilled.

use serde::{Deserialize, Serialize};

use crate::config::{LossScaling, Precision};

/// fp16 dynamic loss scaling as saved.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScalerState {
    /// The loss scale.
    pub scale: f32,
    /// Good steps since the last change.
    pub good: u32,
    /// Overflows still absorbed before the scale halves.
    pub hysteresis_left: u32,
}

/// The state of loss scaling on one rank (identical on every rank: it only changes on decisions
/// all ranks agreed on).
#[derive(Clone, Debug, PartialEq)]
pub struct LossScaler {
    scale: f32,
    dynamic: bool,
    /// Whether overflow is checked at all (fp16 only).
    checks: bool,
    cfg: LossScaling,
    good: u32,
    hysteresis_left: u32,
}

impl LossScaler {
    /// The scaler for `precision`: scale 1 and no checks unless fp16.
    pub fn new(precision: Precision, cfg: LossScaling) -> LossScaler {
        let fp16 = precision == Precision::Fp16;
        let dynamic = fp16 && cfg.loss_scale == 0.0;
        let scale = if !fp16 {
            1.0
        } else if dynamic {
            2f32.powi(cfg.initial_scale_power as i32)
        } else {
            cfg.loss_scale
        };
        LossScaler {
            scale,
            dynamic,
            checks: fp16,
            cfg,
            good: 0,
            hysteresis_left: cfg.hysteresis,
        }
    }

    /// The factor the trainer multiplies its loss by.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Whether overflow is checked (and steps skipped on it).
    pub fn checks_overflow(&self) -> bool {
        self.checks
    }

    /// The state a checkpoint keeps (fp16 only).
    pub fn state(&self) -> Option<ScalerState> {
        self.checks.then_some(ScalerState {
            scale: self.scale,
            good: self.good,
            hysteresis_left: self.hysteresis_left,
        })
    }

    /// Resume from a checkpoint's state. Only dynamic scaling resumes: a static scale is the
    /// configuration's, and other precisions have none.
    pub fn restore(&mut self, s: ScalerState) {
        if self.dynamic {
            self.scale = s.scale;
            self.good = s.good;
            self.hysteresis_left = s.hysteresis_left;
        }
    }

    /// Record the outcome of one optimizer step (overflow = skipped).
    pub fn update(&mut self, overflow: bool) {
        if !self.dynamic {
            return;
        }
        if overflow {
            self.good = 0;
            if self.hysteresis_left <= 1 {
                self.scale = (self.scale / 2.0).max(self.cfg.min_loss_scale);
            } else {
                self.hysteresis_left -= 1;
            }
        } else {
            self.good += 1;
            if self.good >= self.cfg.loss_scale_window {
                self.good = 0;
                self.scale = (self.scale * 2.0).min(f32::MAX);
                self.hysteresis_left = self.cfg.hysteresis;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dynamic_scaling_halves_grows_and_respects_hysteresis_and_floor() {
        let cfg = LossScaling {
            initial_scale_power: 4,
            loss_scale_window: 3,
            hysteresis: 2,
            min_loss_scale: 4.0,
            ..LossScaling::default()
        };
        let mut s = LossScaler::new(Precision::Fp16, cfg);
        assert_eq!(s.scale(), 16.0);
        s.update(true); // first overflow: hysteresis absorbs it
        assert_eq!(s.scale(), 16.0);
        s.update(true);
        assert_eq!(s.scale(), 8.0);
        s.update(true);
        s.update(true);
        assert_eq!(s.scale(), 4.0, "floored at min_loss_scale");
        for _ in 0..3 {
            s.update(false);
        }
        assert_eq!(s.scale(), 8.0, "grown after a window of good steps");
        s.update(true);
        assert_eq!(s.scale(), 8.0, "hysteresis refilled on growth");
    }

    #[test]
    fn static_and_non_fp16_scales_never_move() {
        let mut s = LossScaler::new(
            Precision::Fp16,
            LossScaling {
                loss_scale: 128.0,
                ..LossScaling::default()
            },
        );
        s.update(true);
        assert_eq!((s.scale(), s.checks_overflow()), (128.0, true));
        let b = LossScaler::new(Precision::Bf16, LossScaling::default());
        assert_eq!((b.scale(), b.checks_overflow()), (1.0, false));
    }
}
