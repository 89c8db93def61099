//! DeepSpeed's `optimizer` section: its types as ringzero's rules, with DeepSpeed's defaults
//! for what a config leaves out, and each type's parameters.

use ringzero_kernels::cpu::{Optimizer, Rule};
use serde_json::Value;

use super::{bad, boolean, for_each, num, obj, Reader};
use crate::config::ZeroConfig;
use crate::error::ZeroError;

/// The optimizer DeepSpeed builds for `optimizer.type`, with DeepSpeed's defaults for the
/// parameters the config leaves out: its fused Adam and AdamW (weight decay 0), its fused Lion
/// (betas 0.9, 0.99), and `torch.optim.SGD` for `SGD` (DeepSpeed takes an unknown type from
/// `torch.optim`). `None` for a type ringzero does not have.
fn optimizer_of(ty: &str) -> Option<Optimizer> {
    let t = ty.to_ascii_lowercase();
    Some(match t.as_str() {
        "adamw" => Optimizer {
            weight_decay: 0.0,
            ..Optimizer::adamw(1e-3)
        },
        // DeepSpeed's `Adam` decouples the decay unless `adam_w_mode` is false.
        "adam" => Optimizer {
            weight_decay: 0.0,
            ..Optimizer::adamw(1e-3)
        },
        "lion" => Optimizer::lion(1e-3),
        "sgd" => Optimizer::sgd(1e-3, 0.0),
        _ => return None,
    })
}

/// The parameters each optimizer takes here, by its [`Optimizer::name`].
const OPTIMIZER_PARAMS: &[(&str, &[&str])] = &[
    (
        "AdamW",
        &["lr", "betas", "eps", "weight_decay", "adam_w_mode"],
    ),
    (
        "Adam",
        &["lr", "betas", "eps", "weight_decay", "adam_w_mode"],
    ),
    ("Lion", &["lr", "betas", "weight_decay"]),
    (
        "SGD",
        &["lr", "momentum", "nesterov", "weight_decay", "dampening"],
    ),
];

pub(super) fn optimizer(
    r: &mut Reader<'_>,
    cfg: &mut ZeroConfig,
    v: &Value,
) -> Result<(), ZeroError> {
    let key = "optimizer";
    let a = r.auto.clone();
    // The type first, whatever the keys' order: it decides the defaults and which parameters
    // mean something.
    let ty = match obj(key, v)?.get("type") {
        None => None,
        Some(t) => {
            let name = t.as_str().unwrap_or_default();
            cfg.optimizer = optimizer_of(name).ok_or_else(|| {
                bad(format!(
                    "`{key}.type` = {t} is not implemented: ringzero has Adam, AdamW, Lion and \
                     SGD (with momentum and Nesterov); use one of those"
                ))
            })?;
            Some(name.to_string())
        }
    };
    let written = ty.clone();
    let ty = ty.map(|t| t.to_ascii_lowercase());
    let (adam, sgd) = (
        matches!(cfg.optimizer.rule, Rule::AdamW | Rule::Adam),
        matches!(cfg.optimizer.rule, Rule::Sgd { .. }),
    );
    for_each(r, key, v, |r, k2, v2| {
        let full = format!("{key}.{k2}");
        match k2 {
            "type" => {}
            "params" => {
                let h = &mut cfg.optimizer;
                for_each(r, &full, v2, |r, k3, v3| {
                    let key3 = format!("{full}.{k3}");
                    match k3 {
                        "lr" => h.lr = num(&key3, &r.auto(&key3, v3, a.lr.into()))? as f32,
                        "eps" if adam => {
                            h.eps = num(&key3, &r.auto(&key3, v3, a.eps.into()))? as f32
                        }
                        "weight_decay" => {
                            let w = r.auto(&key3, v3, a.weight_decay.into());
                            h.weight_decay = num(&key3, &w)? as f32
                        }
                        "betas" if !sgd => {
                            let b = r.auto(&key3, v3, serde_json::json!([a.betas.0, a.betas.1]));
                            let b = b.as_array().filter(|x| x.len() == 2).ok_or_else(|| {
                                bad(format!("`{key3}`: expected two numbers, got {v3}"))
                            })?;
                            h.beta1 = num(&key3, &b[0])? as f32;
                            h.beta2 = num(&key3, &b[1])? as f32;
                        }
                        // Adam's decay is an L2 term only where the config says so (AdamW's
                        // stays decoupled, as DeepSpeed's).
                        "adam_w_mode" if adam => {
                            if !boolean(&key3, v3)? {
                                if ty.as_deref() == Some("adamw") {
                                    r.notes.push(format!(
                                        "`{key3}`: false does not apply to AdamW, whose decay \
                                         stays decoupled (as in DeepSpeed)"
                                    ));
                                } else {
                                    h.rule = Rule::Adam;
                                }
                            }
                        }
                        "momentum" if sgd => h.beta1 = num(&key3, v3)? as f32,
                        "nesterov" if sgd => {
                            h.rule = Rule::Sgd {
                                nesterov: boolean(&key3, v3)?,
                            }
                        }
                        "dampening" if sgd => {
                            if num(&key3, v3)? != 0.0 {
                                return Err(bad(format!(
                                    "`{key3}` = {v3}: SGD's dampening is not implemented (it \
                                     would scale every gradient the momentum takes in); use 0"
                                )));
                            }
                        }
                        // Another optimizer's parameter: name the ones this type takes.
                        k if OPTIMIZER_PARAMS.iter().any(|(_, ks)| ks.contains(&k)) => {
                            // The type as the config names it (DeepSpeed's `Adam` is AdamW here
                            // until `adam_w_mode` says otherwise), else the default's.
                            let name = written.as_deref().unwrap_or(h.name());
                            let own = OPTIMIZER_PARAMS
                                .iter()
                                .find(|(n, _)| n.eq_ignore_ascii_case(name))
                                .map_or(&[][..], |(_, ks)| ks);
                            return Err(bad(format!(
                                "`{key3}` is not a parameter of {name} (here: {})",
                                own.join(", ")
                            )));
                        }
                        _ => return Ok(false),
                    }
                    Ok(true)
                })?;
            }
            _ => return Ok(false),
        }
        Ok(true)
    })
}
