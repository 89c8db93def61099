//! Loss scaling for fp16: the trainer multiplies its loss (hence every gradient) by
//! [`LossScaler::scale`]; the engine divides it out before the optimizer. An overflow anywhere
//! (an inf or NaN in any rank's reduced gradient shard, agreed by a max all-reduce) skips the step
//! on every rank.
//!
//! Dynamic rule, DeepSpeed's ZeRO loss scaler (`DynamicLossScaler`) from the same keys: each
//! overflow uses up one unit of `hysteresis`; on the last one the scale is halved (not below
//! `min_loss_scale`), and an overflow with the scale already there stops the run (DeepSpeed
//! raises "Current loss scale already at minimum"). A step without overflow doubles the scale
//! when the good steps before it since the last overflow are a positive multiple of
//! `loss_scale_window` (so the first doubling comes on the window's next step), refilling the
//! hysteresis; with `consecutive_hysteresis` every good step refills it.
//! `tests/fixtures/deepspeed-loss-scaler.json` holds DeepSpeed's scaler's scales over random
//! settings and overflow patterns, and the tests hold this one to them.

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

    /// Record the outcome of one optimizer step (overflow = skipped). `Err` with the scale when
    /// an overflow finds it at `min_loss_scale` with no hysteresis left: no scale is left to
    /// try, and the state is left as it was.
    pub fn update(&mut self, overflow: bool) -> Result<(), f32> {
        if !self.dynamic {
            return Ok(());
        }
        let c = self.cfg;
        if overflow {
            if c.hysteresis <= 1 || self.hysteresis_left <= 1 {
                if self.scale == c.min_loss_scale {
                    return Err(self.scale);
                }
                self.scale = (self.scale / 2.0).max(c.min_loss_scale);
            } else {
                self.hysteresis_left -= 1;
            }
            self.good = 0;
        } else {
            if c.consecutive_hysteresis {
                self.hysteresis_left = c.hysteresis;
            }
            if self.good > 0 && self.good.is_multiple_of(c.loss_scale_window) {
                self.hysteresis_left = c.hysteresis;
                self.scale = (self.scale * 2.0).min(f32::MAX);
            }
            self.good = self.good.saturating_add(1);
        }
        Ok(())
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
        s.update(true).unwrap(); // first overflow: hysteresis absorbs it
        assert_eq!(s.scale(), 16.0);
        s.update(true).unwrap();
        assert_eq!(s.scale(), 8.0);
        s.update(true).unwrap();
        assert_eq!(s.scale(), 4.0, "down to min_loss_scale");
        for _ in 0..3 {
            s.update(false).unwrap();
        }
        assert_eq!(s.scale(), 4.0, "three good steps: not yet");
        s.update(false).unwrap();
        assert_eq!(
            s.scale(),
            8.0,
            "grown on the step after a window of good steps"
        );
        s.update(true).unwrap();
        assert_eq!(s.scale(), 8.0, "hysteresis refilled on growth");
        s.update(true).unwrap();
        assert_eq!(s.scale(), 4.0);
        let before = s.clone();
        assert_eq!(s.update(true), Err(4.0), "an overflow at the floor stops");
        assert_eq!(s, before, "and changes nothing");
    }

    /// Random settings and overflow patterns, with the scale DeepSpeed's ZeRO loss scaler held
    /// after each step and the step it stopped the run at
    /// (`tests/fixtures/deepspeed-loss-scaler.json`, written by
    /// `scripts/deepspeed-loss-scaler.py` from DeepSpeed's own scaler): the same here.
    #[test]
    fn dynamic_scaling_matches_deepspeeds_zero_scaler() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/deepspeed-loss-scaler.json"
        );
        let fixture: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let entries = fixture["entries"].as_array().unwrap();
        assert!(entries.len() >= 100);
        let (mut stops, mut grows) = (0, 0);
        for (i, e) in entries.iter().enumerate() {
            let f = &e["fp16"];
            let int = |k: &str| f[k].as_u64().unwrap() as u32;
            let cfg = LossScaling {
                loss_scale: 0.0,
                initial_scale_power: int("initial_scale_power"),
                loss_scale_window: int("loss_scale_window"),
                hysteresis: int("hysteresis"),
                consecutive_hysteresis: f["consecutive_hysteresis"].as_bool().unwrap(),
                min_loss_scale: f["min_loss_scale"].as_f64().unwrap() as f32,
            };
            let mut s = LossScaler::new(Precision::Fp16, cfg);
            let scales = e["scales"].as_array().unwrap();
            for (k, overflow) in e["overflows"].as_array().unwrap().iter().enumerate() {
                let before = s.scale();
                match (s.update(overflow.as_bool().unwrap()), scales.get(k)) {
                    (Ok(()), Some(want)) => {
                        assert_eq!(
                            s.scale() as f64,
                            want.as_f64().unwrap(),
                            "{i} step {k}: {f}"
                        );
                        grows += usize::from(s.scale() > before);
                    }
                    (Err(_), None) => {
                        assert_eq!(e["stopped_at"].as_u64(), Some(k as u64), "{i}: {f}");
                        stops += 1;
                    }
                    (got, want) => panic!("{i} step {k}: ours {got:?}, DeepSpeed's {want:?}: {f}"),
                }
            }
        }
        assert!(stops > 10 && grows > 10, "{stops} stops, {grows} growths");
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
        s.update(true).unwrap();
        assert_eq!((s.scale(), s.checks_overflow()), (128.0, true));
        let b = LossScaler::new(Precision::Bf16, LossScaling::default());
        assert_eq!((b.scale(), b.checks_overflow()), (1.0, false));
    }
}
