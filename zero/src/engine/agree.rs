//! Ranks that must agree: every rank of an engine must be given the same configuration and the
//! same initial values. A learning rate that differs per rank, or an initialisation seeded by
//! rank (a habit from data-parallel code where each rank holds everything), trains to a wrong
//! result with no error; ranks built with different stages fail later with a collective
//! mismatch that never mentions the config. So construction compares, across the ranks, a
//! digest of every configuration field and of every parameter's initial values (sampled at up
//! to [`SAMPLES`] positions), and refuses naming the first field or parameter that differs.
//!
//! The parameters themselves come first: ranks that built different models (a layer count read
//! from a rank-dependent flag, a variable created on one rank only) are refused naming this
//! rank's parameter count or its first parameter that not every rank has in the same place
//! ([`check_same_params`], which a wrapper calls before it first communicates values).
//!
//! Each comparison is a max and a min all-reduce of a 63-bit digest: equal on every rank only
//! when every rank has the same (under hybrid sharding, over the shard group and over the
//! replicas, which together reach every rank of the world). One pair covers everything when
//! the ranks agree; the per-field pairs run only to name what differs.

use std::hash::{Hash, Hasher};

use ringzero_collectives::{ReduceOp, TrainStream};
use ringzero_kernels::cpu::Float;

use super::Engine;
use crate::error::ZeroError;
use crate::partition::ParamSpec;

/// Positions of a parameter whose initial values are compared (evenly spaced; all of a smaller
/// parameter).
pub const SAMPLES: usize = 256;

/// A digest of `x` that an i64 all-reduce carries exactly.
fn digest(x: &impl Hash) -> i64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    x.hash(&mut h);
    (h.finish() >> 1) as i64
}

/// Refuse, on every rank, parameter lists that differ between the ranks (see the module docs),
/// naming this rank's parameter count when the counts differ, else its first parameter (name
/// and shape) that not every rank has at that position. `agreed(d)` says whether every rank
/// has the digest `d` (one collective on every rank per call: every rank makes the same calls
/// here, whatever its list).
pub fn check_same_params(
    specs: &[ParamSpec],
    rank: usize,
    agreed: &mut dyn FnMut(i64) -> Result<bool, ZeroError>,
) -> Result<(), ZeroError> {
    let layout: Vec<(&str, &[usize])> = specs
        .iter()
        .map(|p| (p.name.as_str(), p.shape.as_slice()))
        .collect();
    if agreed(digest(&layout))? {
        return Ok(());
    }
    let fix = "build the same model on every rank (the same layers, names and shapes), then \
               wrap it";
    if !agreed(digest(&layout.len()))? {
        let elems: usize = specs.iter().map(ParamSpec::numel).sum();
        return Err(ZeroError::Config(format!(
            "the ranks built different models: this rank (rank {rank}) has {} parameters \
             ({elems} elements), not every rank has as many; {fix}",
            layout.len()
        )));
    }
    for (i, p) in layout.iter().enumerate() {
        if !agreed(digest(p))? {
            return Err(ZeroError::Config(format!(
                "the ranks built different models: parameter #{i} is `{}` of shape {:?} on \
                 this rank (rank {rank}), but not on every rank; {fix}",
                p.0, p.1
            )));
        }
    }
    Err(ZeroError::Config(format!(
        "the ranks built different models; {fix}"
    )))
}

impl<T: Float, S: TrainStream> Engine<T, S> {
    /// Refuse, on every rank, a configuration or initial values that differ between the ranks
    /// (see the module docs). `full` is every bucket's initial values as this rank computed them.
    pub(super) fn check_agreement(&mut self, full: &[Vec<f32>]) -> Result<(), ZeroError> {
        let fields = config_fields(&self.led.cfg);
        let part = &self.led.part;
        let inits: Vec<(String, Vec<u32>)> = part
            .slots
            .iter()
            .zip(&part.specs)
            .map(|(s, spec)| {
                let vals = &full[s.bucket][s.offset..s.offset + s.len];
                let step = (s.len / SAMPLES).max(1);
                let bits = vals.iter().step_by(step).map(|v| v.to_bits()).collect();
                (spec.name.clone(), bits)
            })
            .collect();
        let specs = part.specs.clone();
        let shapes: Vec<&[usize]> = specs.iter().map(|p| p.shape.as_slice()).collect();
        let all = digest(&(&fields, &inits, &shapes));
        if self.agreed(all)? {
            return Ok(());
        }
        let rank = self.led.rank;
        check_same_params(&specs, rank, &mut |d| self.agreed(d))?;
        for (name, value) in &fields {
            if !self.agreed(digest(value))? {
                return Err(ZeroError::Config(format!(
                    "the ranks were given different configurations: `{name}` is {value} on this \
                     rank (rank {}) but not on every rank; give every rank the same config",
                    self.led.rank
                )));
            }
        }
        for (name, bits) in &inits {
            if !self.agreed(digest(bits))? {
                return Err(ZeroError::Config(format!(
                    "the ranks computed different initial values for parameter `{name}` (this \
                     is rank {}): an initialisation that depends on the rank (a seed per rank?) \
                     trains to a wrong result; seed it the same on every rank",
                    self.led.rank
                )));
            }
        }
        Err(ZeroError::Config(
            "the ranks were given different configurations or initial values".into(),
        ))
    }

    /// Whether every rank has `d`: the shard group's, and under hybrid sharding this rank's
    /// replicas too (so every rank of the world, each being in both).
    fn agreed(&mut self, d: i64) -> Result<bool, ZeroError> {
        let mut same = true;
        for over_replicas in [false, true] {
            if over_replicas && self.replicas.is_none() {
                break;
            }
            let hi = self.all_reduce_scalar_over(over_replicas, d, ReduceOp::Max)?;
            let lo = self.all_reduce_scalar_over(over_replicas, d, ReduceOp::Min)?;
            same &= hi == lo;
        }
        Ok(same)
    }
}

/// Every configuration field that shapes the training, by name, as text.
fn config_fields(c: &crate::ZeroConfig) -> Vec<(&'static str, String)> {
    let h = &c.optimizer;
    vec![
        ("stage", c.stage.to_string()),
        ("precision", c.precision.to_string()),
        ("reduce_bucket_size", c.bucket_elems.to_string()),
        ("allgather_bucket_size", c.allgather_elems.to_string()),
        ("overlap_comm", c.overlap_comm.to_string()),
        ("prefetch_bucket_size", c.prefetch_elems.to_string()),
        (
            "stage3_param_persistence_threshold",
            c.persistence_threshold.to_string(),
        ),
        ("stage3_max_live_parameters", c.max_live_elems.to_string()),
        ("stage3_max_reuse_distance", c.reuse_elems.to_string()),
        ("fp16 loss scaling", format!("{:?}", c.loss_scaling)),
        (
            "gradient_accumulation_steps",
            c.accumulation_steps.to_string(),
        ),
        ("gradient_clipping", format!("{:?}", c.clip_norm)),
        ("optimizer.type", format!("{:?}", h.rule)),
        ("optimizer.params.lr", h.lr.to_string()),
        (
            "optimizer.params.betas",
            format!("[{}, {}]", h.beta1, h.beta2),
        ),
        ("optimizer.params.eps", h.eps.to_string()),
        ("optimizer.params.weight_decay", h.weight_decay.to_string()),
        ("scheduler", format!("{:?}", c.scheduler)),
        ("param_groups", format!("{:?}", c.param_groups)),
        ("shard_size", format!("{:?}", c.shard_size)),
    ]
}
