//! DeepSpeed's `scheduler` section: its learning-rate schedules with DeepSpeed's defaults, and
//! `"auto"` resolved as Hugging Face's Trainer does.

use serde_json::{Map, Value};

use super::{bad, num, obj, uint, Reader};
use crate::config::schedule::{LrSchedule, Warmup};
use crate::config::ZeroConfig;
use crate::error::ZeroError;
use ringzero_kernels::cpu::Rule;

/// `scheduler.params` once `"auto"` is resolved: each schedule takes its keys, and what is left
/// is unknown.
struct Params(Map<String, Value>);

impl Params {
    fn take(&mut self, k: &str) -> Option<Value> {
        self.0.remove(k).filter(|v| !v.is_null())
    }

    /// A number, `d` when absent.
    fn f(&mut self, k: &str, d: f64) -> Result<f64, ZeroError> {
        self.take(k)
            .map_or(Ok(d), |v| num(&format!("scheduler.params.{k}"), &v))
    }

    /// A count, `d` when absent.
    fn u(&mut self, k: &str, d: u64) -> Result<u64, ZeroError> {
        self.take(k)
            .map_or(Ok(d), |v| uint(&format!("scheduler.params.{k}"), &v))
    }

    /// A count above 0, `d` when absent (DeepSpeed refuses 0).
    fn positive(&mut self, k: &str, d: u64) -> Result<u64, ZeroError> {
        match self.u(k, d)? {
            0 => Err(bad(format!(
                "`scheduler.params.{k}` must be at least 1, as DeepSpeed requires"
            ))),
            n => Ok(n),
        }
    }

    /// A number DeepSpeed's schedule cannot do without.
    fn required(&mut self, ty: &str, k: &str) -> Result<f64, ZeroError> {
        match self.take(k) {
            Some(v) => num(&format!("scheduler.params.{k}"), &v),
            None => Err(bad(format!("`scheduler.params.{k}` is required by {ty}"))),
        }
    }

    /// `total_num_steps`, which schedule `ty` cannot do without.
    fn total(&mut self, ty: &str) -> Result<u64, ZeroError> {
        match self.take("total_num_steps") {
            Some(v) => uint("scheduler.params.total_num_steps", &v),
            None => Err(bad(format!(
                "`scheduler.params.total_num_steps` is required by {ty}"
            ))),
        }
    }

    /// `warmup_type`: `log` (DeepSpeed's default) or `linear`.
    fn warmup(&mut self) -> Result<Warmup, ZeroError> {
        let v = self.take("warmup_type");
        match v.as_ref().map(|v| v.as_str()) {
            None | Some(Some("log")) => Ok(Warmup::Log),
            Some(Some("linear")) => Ok(Warmup::Linear),
            _ => Err(bad(format!(
                "`scheduler.params.warmup_type` must be \"log\" or \"linear\", got {}",
                v.unwrap_or(Value::Null)
            ))),
        }
    }
}

pub(super) fn read_scheduler(
    r: &mut Reader<'_>,
    cfg: &ZeroConfig,
    v: &Value,
) -> Result<LrSchedule, ZeroError> {
    let o = obj("scheduler", v)?;
    let ty = o.get("type").and_then(Value::as_str).unwrap_or("");
    let empty = Value::Object(Map::new());
    let params = o.get("params").unwrap_or(&empty);
    for k in o.keys().filter(|k| *k != "type" && *k != "params") {
        r.unknown.push(format!("scheduler.{k}"));
    }
    let mut p = Params(resolve_auto(r, cfg, params)?);
    let s = match ty {
        "WarmupLR" | "WarmupDecayLR" => warmup_lr(r, cfg, ty, &mut p)?,
        "WarmupCosineLR" => warmup_cosine_lr(r, &mut p)?,
        "LRRangeTest" => LrSchedule::LrRangeTest {
            min_lr: p.f("lr_range_test_min_lr", 1e-3)?,
            step_size: p.positive("lr_range_test_step_size", 2000)?,
            step_rate: p.f("lr_range_test_step_rate", 1.0)?,
            staircase: p
                .take("lr_range_test_staircase")
                .is_some_and(|v| v.as_bool() == Some(true)),
        },
        "OneCycle" => one_cycle(r, cfg, &mut p)?,
        _ => {
            return Err(bad(format!(
                "`scheduler.type` = {:?} is not one of DeepSpeed's WarmupLR, WarmupDecayLR, \
                 WarmupCosineLR, LRRangeTest, OneCycle; for another schedule, drop `scheduler` \
                 and call Engine::set_lr before each step",
                o.get("type").cloned().unwrap_or(Value::Null)
            )))
        }
    };
    for k in p.0.keys() {
        r.unknown.push(format!("scheduler.params.{k}"));
    }
    Ok(s)
}

/// `scheduler.params` with `"auto"` resolved as Hugging Face's Trainer does.
fn resolve_auto(
    r: &mut Reader<'_>,
    cfg: &ZeroConfig,
    params: &Value,
) -> Result<Map<String, Value>, ZeroError> {
    let a = r.auto.clone();
    let mut got = Map::new();
    for (k, v) in obj("scheduler.params", params)? {
        let key = format!("scheduler.params.{k}");
        let resolved = match k.as_str() {
            "warmup_min_lr" => 0.0.into(),
            "warmup_max_lr" => f64::from(cfg.optimizer.lr).into(),
            // The Trainer's default is no warm-up (0), which DeepSpeed refuses; any count below
            // 2 warms up over 2 iterations in DeepSpeed, so 1 runs what 0 meant.
            "warmup_num_steps" => a.warmup_steps.max(1).into(),
            "total_num_steps" => match a.total_steps {
                Some(t) => t.into(),
                None if v.as_str() == Some("auto") => {
                    return Err(bad(format!(
                        "`{key}`: \"auto\" needs the run's length: pass Auto::total_steps (the \
                         demo passes --steps), or give a number"
                    )))
                }
                None => Value::Null,
            },
            _ => v.clone(),
        };
        got.insert(k.clone(), r.auto(&key, v, resolved));
    }
    Ok(got)
}

/// `WarmupLR`, or `WarmupDecayLR` (`ty`).
fn warmup_lr(
    r: &mut Reader<'_>,
    cfg: &ZeroConfig,
    ty: &str,
    p: &mut Params,
) -> Result<LrSchedule, ZeroError> {
    let min_lr = p.f("warmup_min_lr", 0.0)?;
    // WarmupLR's maximum defaults to the optimizer's rate, WarmupDecayLR's to 0.001.
    let max_default = if ty == "WarmupLR" {
        f64::from(cfg.optimizer.lr)
    } else {
        0.001
    };
    let max_lr = p.f("warmup_max_lr", max_default)?;
    let warmup_steps = p.positive("warmup_num_steps", 1000)?.max(2);
    let warmup = p.warmup()?;
    r.notes.push(format!(
        "`scheduler`: {ty} sets warmup_min_lr ({min_lr}) when made, so step 1 runs at it, as \
         in DeepSpeed; the warm-up's iterations start at step 2"
    ));
    Ok(if ty == "WarmupLR" {
        LrSchedule::WarmupLr {
            min_lr,
            max_lr,
            warmup_steps,
            warmup,
        }
    } else {
        LrSchedule::WarmupDecayLr {
            min_lr,
            max_lr,
            warmup_steps,
            warmup,
            total_steps: p.total(ty)?,
        }
    })
}

/// `WarmupCosineLR`: ratios of `optimizer.params.lr`.
fn warmup_cosine_lr(r: &mut Reader<'_>, p: &mut Params) -> Result<LrSchedule, ZeroError> {
    let warmup_steps = p.positive("warmup_num_steps", 1000)?.max(2);
    let total_steps = p.total("WarmupCosineLR")?;
    if total_steps <= warmup_steps {
        r.notes.push(format!(
            "`scheduler`: WarmupCosineLR's total_num_steps ({total_steps}) is not above its \
             warmup_num_steps ({warmup_steps}): the rate goes from the warm-up straight to \
             cos_min_ratio, with no cosine between, as in DeepSpeed (which warns)"
        ));
    }
    r.notes.push(
        "`scheduler`: WarmupCosineLR sets the rate to 0 when made, so step 1 runs at 0, as in \
         DeepSpeed; its ratios scale optimizer.params.lr"
            .to_string(),
    );
    Ok(LrSchedule::WarmupCosineLr {
        min_ratio: p.f("warmup_min_ratio", 0.0)?,
        cos_min_ratio: p.f("cos_min_ratio", 0.0001)?,
        warmup_steps,
        warmup: p.warmup()?,
        total_steps,
    })
}

/// `OneCycle`, with its β₁ cycling unless `cycle_momentum` is false or the optimizer has no
/// betas (SGD: DeepSpeed turns the cycling off for it).
fn one_cycle(
    r: &mut Reader<'_>,
    cfg: &ZeroConfig,
    p: &mut Params,
) -> Result<LrSchedule, ZeroError> {
    let min_lr = p.required("OneCycle", "cycle_min_lr")?;
    let max_lr = p.required("OneCycle", "cycle_max_lr")?;
    let first = p.f("cycle_first_step_size", 2000.0)?;
    let second = p.f("cycle_second_step_size", first)?;
    if !(first > 0.0 && second >= 0.0) {
        return Err(bad(format!(
            "`scheduler.params.cycle_first_step_size` ({first}) must be above 0 and \
             cycle_second_step_size ({second}) at least 0, as DeepSpeed requires"
        )));
    }
    let first_stairs = p.f("cycle_first_stair_count", 0.0)?;
    let second_stairs = p.f("cycle_second_stair_count", first_stairs)?;
    let mut cycle_momentum = p
        .take("cycle_momentum")
        .is_none_or(|v| v.as_bool() != Some(false));
    let min_mom = p.f("cycle_min_mom", 0.8)?;
    let max_mom = p.f("cycle_max_mom", 0.9)?;
    let decay_mom = p.f("decay_mom_rate", 0.0)?;
    if cycle_momentum && matches!(cfg.optimizer.rule, Rule::Sgd { .. }) {
        r.notes.push(
            "`scheduler`: OneCycle cycles no momentum with SGD, which has no betas (DeepSpeed \
             turns cycle_momentum off for it too)"
                .to_string(),
        );
        cycle_momentum = false;
    }
    Ok(LrSchedule::OneCycle {
        min_lr,
        max_lr,
        decay_lr_rate: p.f("decay_lr_rate", 0.0)?,
        first_steps: first,
        second_steps: second,
        first_stairs,
        second_stairs,
        decay_step_size: p.f("decay_step_size", 0.0)?,
        momentum: cycle_momentum.then_some((min_mom, max_mom, decay_mom)),
    })
}
