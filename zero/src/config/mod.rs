//! Engine configuration: from code (a builder with checked values) or from a DeepSpeed-style JSON
//! subset ([`ZeroConfig::from_json`]). Unknown keys, and DeepSpeed keys ringzero does not
//! implement, are errors that name every offending key: a setting that is silently ignored is a
//! bug the user finds weeks later.

use crate::error::ZeroError;
use ringzero_kernels::cpu::Optimizer;
use ringzero_kernels::DType;

mod deepspeed;
mod offload;
mod schedule;

pub use deepspeed::Auto;
pub use offload::{Aio, Offload, OffloadDevice, OffloadOptimizer, OffloadParam};
pub use schedule::{LrSchedule, Warmup};

/// Parameter and gradient precision (optimizer state is always fp32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// fp32 parameters and gradients; the parameters are their own master copy.
    Fp32,
    /// bf16 parameters and gradients, fp32 master weights; no loss scaling.
    Bf16,
    /// fp16 parameters and gradients, fp32 master weights, loss scaling.
    Fp16,
}

impl Precision {
    /// The dtype parameters and gradients are kept in.
    pub fn dtype(self) -> DType {
        match self {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::Fp16 => DType::F16,
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fp32" | "f32" => Ok(Precision::Fp32),
            "bf16" => Ok(Precision::Bf16),
            "fp16" | "f16" => Ok(Precision::Fp16),
            _ => Err(format!(
                "unknown precision `{s}` (expected fp32, bf16 or fp16)"
            )),
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        })
    }
}

/// fp16 loss scaling, with DeepSpeed's keys and defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaling {
    /// A fixed scale, or 0 for dynamic scaling.
    pub loss_scale: f32,
    /// Dynamic scaling starts at 2^this.
    pub initial_scale_power: u32,
    /// Grow the scale ×2 after this many steps without overflow.
    pub loss_scale_window: u32,
    /// Overflows tolerated before the scale is halved (1: halve on every overflow).
    pub hysteresis: u32,
    /// Refill the hysteresis after every step without overflow, not only when the scale grows
    /// (`consecutive_hysteresis`): only overflows in a row then halve the scale.
    pub consecutive_hysteresis: bool,
    /// The scale never drops below this; an overflow at it with no hysteresis left stops the
    /// run, as in DeepSpeed.
    pub min_loss_scale: f32,
}

impl Default for LossScaling {
    fn default() -> Self {
        LossScaling {
            loss_scale: 0.0,
            initial_scale_power: 16,
            loss_scale_window: 1000,
            hysteresis: 2,
            consecutive_hysteresis: false,
            min_loss_scale: 1.0,
        }
    }
}

/// Everything the engine needs to know; build it with [`ZeroConfig::builder`] or
/// [`ZeroConfig::from_json`], both of which validate.
#[derive(Clone, Debug, PartialEq)]
pub struct ZeroConfig {
    /// ZeRO stage, 0–3 (0 = plain data parallel).
    pub stage: u8,
    /// Largest gradient bucket, in elements (`reduce_bucket_size`); buckets are the unit of the
    /// gradient reduce-scatter and of the stage-3 parameter gather.
    pub bucket_elems: usize,
    /// Largest all-gather of updated parameters in stages 1–2, in elements
    /// (`allgather_bucket_size`); a larger bucket is gathered in pieces.
    pub allgather_elems: usize,
    /// Stages 2–3: reduce-scatter a bucket asynchronously while backward goes on (`overlap_comm`).
    pub overlap_comm: bool,
    /// Stage 3: elements [`crate::Engine::prefetch`] may have in flight
    /// (`stage3_prefetch_bucket_size`); 0 turns prefetching off.
    pub prefetch_elems: usize,
    /// Stage 3: parameters with fewer elements than this stay gathered between optimizer steps
    /// (`stage3_param_persistence_threshold`); 0, the default, gathers every parameter when
    /// asked. DeepSpeed's own default is 100000: set it to match.
    pub persistence_threshold: usize,
    /// Stage 3: at most this many elements gathered or in flight when prefetching by the
    /// recorded order (`stage3_max_live_parameters`; what the trainer gathers itself is never
    /// refused). Unlimited by default.
    pub max_live_elems: usize,
    /// Stage 3: a bucket whose parameters are all released stays gathered when the recorded
    /// order gathers one of them again after fewer than this many elements of other
    /// parameters (`stage3_max_reuse_distance`), until that gather or the optimizer step.
    /// DeepSpeed's default, 1e9: a bucket modules share is gathered once a step, and what
    /// forward gathers stays until backward gathers it again (less communication, a live
    /// window up to the whole model); 0 releases at once.
    pub reuse_elems: usize,
    /// Log where each optimizer step's wall time went on rank 0 (`wall_clock_breakdown`; the
    /// report is [`crate::Engine::report`] either way).
    pub wall_clock_breakdown: bool,
    /// Parameter and gradient precision.
    pub precision: Precision,
    /// fp16 loss scaling (used only with [`Precision::Fp16`]).
    pub loss_scaling: LossScaling,
    /// Micro-steps per optimizer step (`gradient_accumulation_steps`).
    pub accumulation_steps: usize,
    /// `accumulation_steps` is `train_batch` / (`micro_batch` × world size), set once the world
    /// size is known ([`ZeroConfig::for_world`], which the engine calls): a DeepSpeed config
    /// that gives both batch sizes and no `gradient_accumulation_steps`, as DeepSpeed derives it.
    pub accumulation_from_batch: bool,
    /// Clip gradients to this global L2 norm (`gradient_clipping`; 0 in JSON means off).
    pub clip_norm: Option<f32>,
    /// The optimizer (`optimizer`: its `type` and `params`): AdamW, Adam (L2), Lion or SGD.
    pub optimizer: Optimizer,
    /// `train_micro_batch_size_per_gpu`, checked against `train_batch_size` when both are given.
    pub micro_batch: Option<usize>,
    /// `train_batch_size` = micro batch × accumulation steps × world size (checked by the engine,
    /// which knows the world size).
    pub train_batch: Option<usize>,
    /// Hybrid sharding (`zero_optimization.mics_shard_size`; DeepSpeed's -1, or none, is off):
    /// the states are sharded over groups of this many ranks and replicated across the groups.
    /// The engine is then built with [`crate::Engine::new_hybrid`] on the communicators
    /// [`crate::hybrid_groups`] splits off (the plain constructor refuses such a config, so the
    /// setting is never silently dropped).
    pub shard_size: Option<usize>,
    /// The learning-rate schedule (`scheduler`); `None` keeps `optimizer.lr` (or what
    /// [`crate::Engine::set_lr`] sets).
    pub scheduler: Option<LrSchedule>,
    /// What reading a DeepSpeed config noted: keys accepted that change nothing here (and why),
    /// `"auto"` values and what they became. For the trainer to print once.
    pub notes: Vec<String>,
    /// Parameters with optimizer settings of their own (torch's `param_groups`), the first
    /// group whose pattern a parameter's name contains wins; the others use `optimizer` (and the
    /// schedule). The usual one: [`ParamGroup::no_decay`] for biases and norms.
    pub param_groups: Vec<ParamGroup>,
    /// Where the optimizer's states and the stage-3 parameters live (`offload_optimizer`,
    /// `offload_param`, `aio`); all on the engine's device by default.
    pub offload: Offload,
}

/// A group of parameters with optimizer settings of their own ([`ZeroConfig::param_groups`]).
#[derive(Clone, Debug, PartialEq)]
pub struct ParamGroup {
    /// A parameter belongs to the group when its name contains one of these.
    pub names_containing: Vec<String>,
    /// Their decoupled weight decay; `None` keeps the optimizer's.
    pub weight_decay: Option<f32>,
    /// Their learning rate as a multiple of the scheduled one (1: the same).
    pub lr_scale: f32,
}

impl ParamGroup {
    /// No weight decay for parameters whose names contain any of `patterns` (as `["bias",
    /// "norm"]`: the group most trainers make).
    pub fn no_decay(patterns: &[&str]) -> ParamGroup {
        ParamGroup {
            names_containing: patterns.iter().map(|p| p.to_string()).collect(),
            weight_decay: Some(0.0),
            lr_scale: 1.0,
        }
    }

    /// Whether parameter `name` is in the group.
    pub fn contains(&self, name: &str) -> bool {
        self.names_containing
            .iter()
            .any(|p| name.contains(p.as_str()))
    }

    /// The optimizer settings `h` as this group changes them.
    pub fn apply(&self, mut h: Optimizer) -> Optimizer {
        h.lr *= self.lr_scale;
        if let Some(wd) = self.weight_decay {
            h.weight_decay = wd;
        }
        h
    }
}

impl Default for ZeroConfig {
    fn default() -> Self {
        ZeroConfig {
            stage: 1,
            bucket_elems: 1 << 20,
            allgather_elems: 1 << 22,
            overlap_comm: false,
            prefetch_elems: 1 << 22,
            persistence_threshold: 0,
            max_live_elems: usize::MAX,
            reuse_elems: 1_000_000_000,
            wall_clock_breakdown: false,
            precision: Precision::Fp32,
            loss_scaling: LossScaling::default(),
            accumulation_steps: 1,
            accumulation_from_batch: false,
            clip_norm: None,
            optimizer: Optimizer::default(),
            micro_batch: None,
            train_batch: None,
            shard_size: None,
            scheduler: None,
            notes: Vec::new(),
            param_groups: Vec::new(),
            offload: Offload::default(),
        }
    }
}

/// Builds a [`ZeroConfig`]; [`ZeroConfigBuilder::build`] checks every value.
#[derive(Clone, Debug, Default)]
pub struct ZeroConfigBuilder {
    cfg: ZeroConfig,
}

impl ZeroConfigBuilder {
    /// Add a parameter group ([`ZeroConfig::param_groups`]).
    pub fn param_group(mut self, g: ParamGroup) -> Self {
        self.cfg.param_groups.push(g);
        self
    }

    /// ZeRO stage 0–3.
    pub fn stage(mut self, s: u8) -> Self {
        self.cfg.stage = s;
        self
    }
    /// Gradient bucket size in elements.
    pub fn bucket_elems(mut self, n: usize) -> Self {
        self.cfg.bucket_elems = n;
        self
    }
    /// All-gather piece size in elements.
    pub fn allgather_elems(mut self, n: usize) -> Self {
        self.cfg.allgather_elems = n;
        self
    }
    /// Asynchronous gradient reduce-scatter (stages 2–3).
    pub fn overlap_comm(mut self, on: bool) -> Self {
        self.cfg.overlap_comm = on;
        self
    }
    /// Stage-3 prefetch budget in elements (0: off).
    pub fn prefetch_elems(mut self, n: usize) -> Self {
        self.cfg.prefetch_elems = n;
        self
    }
    /// Parameter/gradient precision.
    pub fn precision(mut self, p: Precision) -> Self {
        self.cfg.precision = p;
        self
    }
    /// fp16 loss scaling.
    pub fn loss_scaling(mut self, l: LossScaling) -> Self {
        self.cfg.loss_scaling = l;
        self
    }
    /// Micro-steps per optimizer step.
    pub fn accumulation_steps(mut self, n: usize) -> Self {
        self.cfg.accumulation_steps = n;
        self
    }
    /// Global-norm clipping.
    pub fn clip_norm(mut self, c: Option<f32>) -> Self {
        self.cfg.clip_norm = c;
        self
    }
    /// The optimizer: its rule and hyper-parameters (`Optimizer::adamw(lr)`, `adam`, `lion`,
    /// `sgd`, or a struct literal).
    pub fn optimizer(mut self, h: Optimizer) -> Self {
        self.cfg.optimizer = h;
        self
    }
    /// Hybrid sharding over groups of this many ranks (`None`: shard over every rank).
    pub fn shard_size(mut self, s: Option<usize>) -> Self {
        self.cfg.shard_size = s;
        self
    }
    /// Where the optimizer's states live and step (`offload_optimizer`):
    /// [`OffloadOptimizer::cpu`], [`OffloadOptimizer::nvme`].
    pub fn offload_optimizer(mut self, o: OffloadOptimizer) -> Self {
        self.cfg.offload.optimizer = o;
        self
    }
    /// Where the stage-3 parameter shards live (`offload_param`).
    pub fn offload_param(mut self, p: OffloadParam) -> Self {
        self.cfg.offload.param = p;
        self
    }
    /// How the NVMe tier reads and writes (`aio`).
    pub fn aio(mut self, a: Aio) -> Self {
        self.cfg.offload.aio = a;
        self
    }
    /// The checked configuration.
    pub fn build(self) -> Result<ZeroConfig, ZeroError> {
        self.cfg.validate()?;
        Ok(self.cfg)
    }
}

pub(crate) fn bad(msg: impl Into<String>) -> ZeroError {
    ZeroError::Config(msg.into())
}

impl ZeroConfig {
    /// A builder starting from the defaults.
    pub fn builder() -> ZeroConfigBuilder {
        ZeroConfigBuilder::default()
    }

    /// The config for a job of `world` data-parallel ranks: `gradient_accumulation_steps`
    /// derived from the batch sizes where [`ZeroConfig::accumulation_from_batch`] says so, and
    /// `train_batch_size` checked against micro batch × accumulation × world, as DeepSpeed
    /// checks it. The engine calls it; a trainer that plans its loop from the config before
    /// making the engine calls it too (or reads [`crate::Engine::config`]).
    pub fn for_world(mut self, world: usize) -> Result<ZeroConfig, ZeroError> {
        let (Some(mb), Some(tb)) = (self.micro_batch, self.train_batch) else {
            return Ok(self);
        };
        if self.accumulation_from_batch {
            let per_step = mb * world;
            if per_step == 0 || tb % per_step != 0 {
                return Err(bad(format!(
                    "train_batch_size {tb} is not a multiple of train_micro_batch_size_per_gpu \
                     {mb} × world size {world}, so no gradient_accumulation_steps gives it: \
                     change one of them, or give gradient_accumulation_steps"
                )));
            }
            self.accumulation_steps = tb / per_step;
            self.accumulation_from_batch = false;
        }
        if mb * self.accumulation_steps * world != tb {
            return Err(bad(format!(
                "train_batch_size {tb} != train_micro_batch_size_per_gpu {mb} × \
                 gradient_accumulation_steps {} × world size {world}",
                self.accumulation_steps
            )));
        }
        Ok(self)
    }

    /// Check every value; the error names the first bad one.
    pub fn validate(&self) -> Result<(), ZeroError> {
        if self.stage > 3 {
            return Err(bad(format!(
                "stage {} does not exist (expected 0, 1, 2 or 3)",
                self.stage
            )));
        }
        if self.bucket_elems == 0 {
            return Err(bad("reduce_bucket_size must be at least 1 element"));
        }
        if self.allgather_elems == 0 {
            return Err(bad("allgather_bucket_size must be at least 1 element"));
        }
        if self.accumulation_steps == 0 {
            return Err(bad("gradient_accumulation_steps must be at least 1"));
        }
        if self.clip_norm.is_some_and(|c| !(c > 0.0 && c.is_finite())) {
            return Err(bad("gradient_clipping must be a positive number"));
        }
        if let Some(why) = self.optimizer.invalid() {
            return Err(bad(format!("optimizer: {why}")));
        }
        for (i, g) in self.param_groups.iter().enumerate() {
            if g.names_containing.is_empty() || g.names_containing.iter().any(String::is_empty) {
                return Err(bad(format!(
                    "param_groups[{i}] needs name patterns, none of them empty (an empty one \
                     would match every parameter)"
                )));
            }
            if g.weight_decay.is_some_and(|w| !(w >= 0.0 && w.is_finite())) {
                return Err(bad(format!(
                    "param_groups[{i}].weight_decay {:?} must be non-negative",
                    g.weight_decay
                )));
            }
            if !(g.lr_scale >= 0.0 && g.lr_scale.is_finite()) {
                return Err(bad(format!(
                    "param_groups[{i}].lr_scale {} must be a non-negative number",
                    g.lr_scale
                )));
            }
        }
        let l = &self.loss_scaling;
        if !(l.loss_scale >= 0.0 && l.loss_scale.is_finite()) {
            return Err(bad(
                "fp16.loss_scale must be 0 (dynamic) or a positive number",
            ));
        }
        if l.initial_scale_power > 64 {
            return Err(bad(format!(
                "fp16.initial_scale_power {} is larger than 64",
                l.initial_scale_power
            )));
        }
        if l.loss_scale_window == 0 {
            return Err(bad("fp16.loss_scale_window must be at least 1"));
        }
        if l.hysteresis == 0 {
            return Err(bad("fp16.hysteresis must be at least 1"));
        }
        if !(l.min_loss_scale > 0.0 && l.min_loss_scale.is_finite()) {
            return Err(bad("fp16.min_loss_scale must be a positive number"));
        }
        if self.micro_batch == Some(0) || self.train_batch == Some(0) {
            return Err(bad("batch sizes must be at least 1"));
        }
        if self.shard_size == Some(0) {
            return Err(bad(
                "mics_shard_size must be at least 1 rank (or -1 for no hybrid sharding)",
            ));
        }
        self.offload.validate(self.stage)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ringzero_kernels::cpu::Rule;

    #[test]
    fn a_deepspeed_config_parses() {
        let c = ZeroConfig::from_json(
            r#"{
              "train_batch_size": 64,
              "train_micro_batch_size_per_gpu": 8,
              "gradient_accumulation_steps": 2,
              "gradient_clipping": 1.0,
              "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 12,
                       "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95],
                            "eps": 1e-8, "weight_decay": 0.1}},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8,
                  "allgather_bucket_size": 2e8, "overlap_comm": true,
                  "stage3_prefetch_bucket_size": 5e7}
            }"#,
        )
        .unwrap();
        assert_eq!(c.stage, 3);
        assert_eq!(c.bucket_elems, 500_000_000);
        assert_eq!(c.allgather_elems, 200_000_000);
        assert!(c.overlap_comm);
        assert_eq!(c.prefetch_elems, 50_000_000);
        assert_eq!(c.precision, Precision::Fp16);
        assert_eq!(c.loss_scaling.initial_scale_power, 12);
        assert_eq!(c.loss_scaling.loss_scale_window, 500);
        assert_eq!(c.accumulation_steps, 2);
        assert_eq!(c.clip_norm, Some(1.0));
        assert_eq!(c.optimizer.beta2, 0.95);
        assert_eq!((c.micro_batch, c.train_batch), (Some(8), Some(64)));
        assert_eq!(c.shard_size, None);
        let d = ZeroConfig::from_json(r#"{"bf16": {"enabled": true}, "gradient_clipping": 0}"#)
            .unwrap();
        assert_eq!(
            (d.stage, d.precision, d.clip_norm),
            (0, Precision::Bf16, None)
        );
    }

    #[test]
    fn mics_shard_size_turns_hybrid_sharding_on_and_minus_one_off() {
        let on =
            ZeroConfig::from_json(r#"{"zero_optimization": {"stage": 3, "mics_shard_size": 8}}"#);
        assert_eq!(on.unwrap().shard_size, Some(8));
        let off = ZeroConfig::from_json(r#"{"zero_optimization": {"mics_shard_size": -1}}"#);
        assert_eq!(off.unwrap().shard_size, None);
        for bad in ["0", "-2", "1.5", "\"8\""] {
            let text = format!(r#"{{"zero_optimization": {{"mics_shard_size": {bad}}}}}"#);
            let e = ZeroConfig::from_json(&text).unwrap_err().to_string();
            assert!(
                e.contains("`zero_optimization.mics_shard_size`"),
                "{bad}: {e}"
            );
        }
        let e = ZeroConfig::builder()
            .shard_size(Some(0))
            .build()
            .unwrap_err();
        assert!(
            e.to_string().contains("mics_shard_size must be at least 1"),
            "{e}"
        );
    }

    /// DeepSpeed's optimizer types as its docs and unit tests spell them: `Adam` (decoupled
    /// unless `adam_w_mode` is false), `AdamW`, `Lion` (its fused Lion's defaults), and a
    /// `torch.optim` name (`SGD`), each with DeepSpeed's defaults for what is left out, whatever
    /// the order of `type` and `params`.
    #[test]
    fn deepspeeds_optimizer_types_become_their_rules() {
        let opt = |json: &str| ZeroConfig::from_json(json).unwrap().optimizer;
        let o = opt(r#"{"optimizer": {"type": "adam", "params": {"lr": 0.0006}}}"#);
        assert_eq!((o.rule, o.lr, o.weight_decay), (Rule::AdamW, 0.0006, 0.0));
        let o = opt(
            r#"{"optimizer": {"params": {"lr": 1e-4, "weight_decay": 0.1, "adam_w_mode": false},
                              "type": "Adam"}}"#,
        );
        assert_eq!((o.rule, o.weight_decay), (Rule::Adam, 0.1));
        let c = ZeroConfig::from_json(
            r#"{"optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}}"#,
        )
        .unwrap();
        assert_eq!(c.optimizer.rule, Rule::AdamW);
        assert!(
            c.notes.iter().any(|n| n.contains("stays decoupled")),
            "{:?}",
            c.notes
        );
        let o = opt(r#"{"optimizer": {"type": "Lion", "params": {"lr": 0.00015}}}"#);
        assert_eq!(
            o,
            Optimizer {
                lr: 0.00015,
                ..Optimizer::lion(0.0)
            }
        );
        assert_eq!(o.states(), ["exp_avg"]);
        let o = opt(
            r#"{"optimizer": {"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9,
                "weight_decay": 0.0001, "nesterov": true, "dampening": 0}}}"#,
        );
        assert_eq!(
            o,
            Optimizer {
                rule: Rule::Sgd { nesterov: true },
                weight_decay: 0.0001,
                ..Optimizer::sgd(0.01, 0.9)
            }
        );
        assert!(
            opt(r#"{"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}"#)
                .states()
                .is_empty()
        );
    }

    /// DeepSpeed's `WarmupCosineLR` with its defaults for what is left out; a cosine with no
    /// span runs as in DeepSpeed, noted; bad counts and OneCycle without its rates are refused.
    #[test]
    fn warmup_cosine_lr_is_read_with_deepspeeds_defaults() {
        let c = ZeroConfig::from_json(
            r#"{"scheduler": {"type": "WarmupCosineLR",
                              "params": {"total_num_steps": 100, "warmup_num_steps": 10}}}"#,
        )
        .unwrap();
        assert_eq!(
            c.scheduler,
            Some(LrSchedule::WarmupCosineLr {
                min_ratio: 0.0,
                cos_min_ratio: 0.0001,
                warmup_steps: 10,
                warmup: Warmup::Log,
                total_steps: 100,
            })
        );
        assert!(
            c.notes.iter().any(|n| n.contains("step 1 runs at 0")),
            "{:?}",
            c.notes
        );
        let c = ZeroConfig::from_json(
            r#"{"scheduler": {"type": "WarmupCosineLR",
                              "params": {"total_num_steps": 10, "warmup_num_steps": 10}}}"#,
        )
        .unwrap();
        assert!(
            c.notes.iter().any(|n| n.contains("with no cosine between")),
            "{:?}",
            c.notes
        );
        let refused = |json: &str, want: &str| {
            let e = ZeroConfig::from_json(json).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        };
        refused(
            r#"{"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}"#,
            "`scheduler.params.warmup_num_steps` must be at least 1",
        );
        refused(
            r#"{"scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_step_size": 0}}}"#,
            "`scheduler.params.lr_range_test_step_size` must be at least 1",
        );
        refused(
            r#"{"scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 0.1}}}"#,
            "`scheduler.params.cycle_min_lr` is required by OneCycle",
        );
        refused(
            r#"{"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01,
                "cycle_max_lr": 0.1, "cycle_first_step_size": 0}}}"#,
            "cycle_first_step_size` (0) must be above 0",
        );
        // SGD has no betas: OneCycle cycles no momentum with it, as DeepSpeed does.
        let c = ZeroConfig::from_json(
            r#"{"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
                "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01,
                    "cycle_max_lr": 0.1}}}"#,
        )
        .unwrap();
        assert!(matches!(
            c.scheduler,
            Some(LrSchedule::OneCycle { momentum: None, .. })
        ));
        assert!(c
            .notes
            .iter()
            .any(|n| n.contains("cycles no momentum with SGD")));
    }

    /// DeepSpeed derives `gradient_accumulation_steps` from the two batch sizes when a config
    /// leaves it out: here once the world size is known, refused where it does not divide.
    #[test]
    fn accumulation_is_derived_from_the_batch_sizes_as_deepspeed_does() {
        let text = r#"{"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8}"#;
        let c = ZeroConfig::from_json(text).unwrap();
        assert!(c.accumulation_from_batch, "{c:?}");
        assert!(c
            .notes
            .iter()
            .any(|n| n.contains("as DeepSpeed derives it")));
        let two = c.clone().for_world(2).unwrap();
        assert_eq!(
            (two.accumulation_steps, two.accumulation_from_batch),
            (4, false)
        );
        assert_eq!(two.clone().for_world(2).unwrap(), two, "idempotent");
        let e = c.clone().for_world(3).unwrap_err().to_string();
        assert!(
            e.contains("train_batch_size 64 is not a multiple of"),
            "{e}"
        );
        let known = ZeroConfig::from_json_auto(
            text,
            &Auto {
                world: Some(4),
                ..Auto::default()
            },
        )
        .unwrap();
        assert_eq!(known.accumulation_steps, 2);
        // Given, it is checked, not derived.
        let given = ZeroConfig::from_json(
            r#"{"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8,
                "gradient_accumulation_steps": 2}"#,
        )
        .unwrap();
        assert!(!given.accumulation_from_batch);
        assert!(given.clone().for_world(4).is_ok());
        let e = given.for_world(2).unwrap_err().to_string();
        assert!(
            e.contains("train_batch_size 64 != train_micro_batch_size_per_gpu 8"),
            "{e}"
        );
    }

    #[test]
    fn offload_keys_are_read_as_deepspeed_spells_them() {
        let c = ZeroConfig::from_json(
            r#"{"zero_optimization": {"stage": 3,
                  "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme",
                      "pin_memory": true, "buffer_count": 4, "fast_init": false, "ratio": 0.3},
                  "offload_param": {"device": "cpu", "pin_memory": true, "buffer_count": 5,
                      "buffer_size": 1e8, "max_in_cpu": 1e9}},
                "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 2,
                        "single_submit": false, "overlap_events": true}}"#,
        )
        .unwrap();
        let o = &c.offload;
        assert_eq!(o.optimizer.device, OffloadDevice::Nvme);
        assert_eq!(
            o.optimizer.nvme_path.as_deref(),
            Some(std::path::Path::new("/local_nvme"))
        );
        assert_eq!((o.optimizer.ratio, o.optimizer.buffer_count), (0.3, 4));
        assert_eq!(o.param.device, OffloadDevice::Cpu);
        assert_eq!(
            (o.param.buffer_size, o.param.max_in_cpu),
            (100_000_000, 1_000_000_000)
        );
        assert_eq!(
            (o.aio.block_size, o.aio.queue_depth, o.aio.thread_count),
            (262144, 32, 2)
        );
        assert!(
            c.notes.iter().any(|n| n.contains("fast_init")),
            "{:?}",
            c.notes
        );
        // Hugging Face's NVMe example (ZeRO-Infinity): both on NVMe, `aio` nested.
        let c = ZeroConfig::from_json(
            r#"{"zero_optimization": {"stage": 3,
                  "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme",
                      "pin_memory": true, "buffer_count": 4, "fast_init": false},
                  "offload_param": {"device": "nvme", "nvme_path": "/local_nvme",
                      "pin_memory": true, "buffer_count": 5, "buffer_size": 1e8,
                      "max_in_cpu": 1e9},
                  "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 1,
                      "single_submit": false, "overlap_events": true},
                  "overlap_comm": true, "contiguous_gradients": true, "sub_group_size": 1e9,
                  "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                  "stage3_param_persistence_threshold": "auto",
                  "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                  "stage3_gather_16bit_weights_on_model_save": true}}"#,
        )
        .unwrap();
        assert_eq!(c.offload.param.device, OffloadDevice::Nvme);
        assert_eq!(c.offload.aio.block_size, 262144);
        assert_eq!(c.reuse_elems, 1_000_000_000);
        let c = ZeroConfig::from_json(
            r#"{"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0}}"#,
        )
        .unwrap();
        assert_eq!(c.reuse_elems, 0, "0 releases at once");
        let e = ZeroConfig::from_json(
            r#"{"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": -1}}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("stage3_max_reuse_distance"), "{e}");
        // DeepSpeed's legacy spelling.
        let c =
            ZeroConfig::from_json(r#"{"zero_optimization": {"stage": 2, "cpu_offload": true}}"#)
                .unwrap();
        assert_eq!(c.offload.optimizer.device, OffloadDevice::Cpu);
        // The same through the builder.
        let b = ZeroConfig::builder()
            .stage(2)
            .offload_optimizer(OffloadOptimizer::cpu())
            .build()
            .unwrap();
        assert_eq!(b.offload.optimizer.device, OffloadDevice::Cpu);
    }

    #[test]
    fn offload_settings_that_cannot_work_are_refused_with_what_to_do() {
        let refused = |json: &str, want: &[&str]| {
            let e = ZeroConfig::from_json(json).unwrap_err().to_string();
            for w in want {
                assert!(e.contains(w), "{json}: {e}");
            }
        };
        refused(
            r#"{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}"#,
            &["nvme_path", "name a directory"],
        );
        refused(
            r#"{"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}"#,
            &["offload_param needs ZeRO stage 3"],
        );
        refused(
            r#"{"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"},
                 "offload_optimizer": {"device": "cpu"}}}"#,
            &["offload_param.device is \"nvme\" but no nvme_path"],
        );
        refused(
            r#"{"zero_optimization": {"stage": 3,
                 "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}}}"#,
            &["needs the whole optimizer state offloaded"],
        );
        refused(
            r#"{"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}"#,
            &["stage 1, 2 or 3"],
        );
        refused(
            r#"{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}}"#,
            &["offload_optimizer.device", "none, cpu or nvme"],
        );
        refused(
            r#"{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0}}}"#,
            &["ratio 0", "above 0"],
        );
        let mut c = ZeroConfig::builder()
            .stage(2)
            .offload_optimizer(OffloadOptimizer {
                delayed_update_after: Some(0),
                ratio: 0.5,
                ..OffloadOptimizer::cpu()
            })
            .build()
            .unwrap_err()
            .to_string();
        assert!(c.contains("delayed_update_after needs the whole"), "{c}");
        c = ZeroConfig::builder()
            .stage(2)
            .offload_optimizer(OffloadOptimizer {
                delayed_update_after: Some(0),
                ..OffloadOptimizer::default()
            })
            .build()
            .unwrap_err()
            .to_string();
        assert!(c.contains("device cpu or nvme"), "{c}");
        refused(
            r#"{"zero_optimization": {"stage": 2}, "aio": {"block_size": 1000}}"#,
            &["aio.block_size 1000", "4096"],
        );
        refused(
            r#"{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memry": true}}}"#,
            &["zero_optimization.offload_optimizer.pin_memry"],
        );
    }

    /// The buckets' `"auto"` come from the model's hidden size, as Hugging Face's Trainer fills
    /// them (hidden², 0.9 hidden², 10 hidden); without one, the engine's defaults.
    #[test]
    fn bucket_sizes_auto_follow_the_hidden_size() {
        let text = r#"{"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                       "stage3_prefetch_bucket_size": "auto",
                       "stage3_param_persistence_threshold": "auto"}}"#;
        let auto = crate::Auto {
            hidden: Some(64),
            ..Default::default()
        };
        let c = ZeroConfig::from_json_auto(text, &auto).unwrap();
        assert_eq!(
            (c.bucket_elems, c.prefetch_elems, c.persistence_threshold),
            (4096, 3686, 640)
        );
        assert!(
            c.notes.iter().any(|n| n.contains("hidden size 64")),
            "{:?}",
            c.notes
        );
        let d = ZeroConfig::default();
        let c = ZeroConfig::from_json(text).unwrap();
        assert_eq!(
            (c.bucket_elems, c.prefetch_elems, c.persistence_threshold),
            (d.bucket_elems, d.prefetch_elems, d.persistence_threshold)
        );
    }

    #[test]
    fn unknown_and_bad_keys_are_named() {
        let e = ZeroConfig::from_json(
            r#"{"zero_optimization": {"stage": 2, "overlap_comms": true},
                "fp16": {"enabled": true, "auto_cst": true}, "stepz_per_print": 1}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("unknown keys `fp16.auto_cst`, `zero_optimization.overlap_comms`")
                && e.contains("`stepz_per_print`: did you mean `steps_per_print`?"),
            "{e}"
        );
        let e = ZeroConfig::from_json(r#"{"scheduler": {"type": "Cosine"}}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("WarmupLR") && e.contains("set_lr"), "{e}");
        let e = ZeroConfig::from_json(r#"{"prescale_gradients": true}"#)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`prescale_gradients` = true is not supported")
                && e.contains("set it to false"),
            "{e}"
        );
        let cases = [
            (
                r#"{"zero_optimization": {"stage": 4}}"#,
                "stage 4 does not exist",
            ),
            (
                r#"{"zero_optimization": {"stage": "2"}}"#,
                "`zero_optimization.stage` must be a number",
            ),
            (
                r#"{"zero_optimization": {"stage": 1.5}}"#,
                "must be a non-negative integer",
            ),
            (
                r#"{"gradient_accumulation_steps": 0}"#,
                "gradient_accumulation_steps must be at least 1",
            ),
            (
                r#"{"fp16": {"enabled": true}, "bf16": {"enabled": true}}"#,
                "both true",
            ),
            (r#"{"fp16": {"loss_scale_window": 0}}"#, "loss_scale_window"),
            (
                r#"{"optimizer": {"type": "Lamb"}}"#,
                "ringzero has Adam, AdamW, Lion and SGD",
            ),
            (
                r#"{"optimizer": {"type": "SGD", "params": {"dampening": 0.1}}}"#,
                "dampening is not implemented",
            ),
            (
                r#"{"optimizer": {"type": "SGD", "params": {"nesterov": true}}}"#,
                "above 0 with Nesterov",
            ),
            (
                r#"{"optimizer": {"type": "Adam", "params": {"momentum": 0.9}}}"#,
                "`optimizer.params.momentum` is not a parameter of Adam (here: lr, betas, eps, \
                 weight_decay, adam_w_mode)",
            ),
            (
                r#"{"optimizer": {"type": "Lion", "params": {"betas": [0.9, 1.5]}}}"#,
                "betas (0.9, 1.5) must each be in [0, 1)",
            ),
            (
                r#"{"optimizer": {"params": {"betas": [0.9]}}}"#,
                "two numbers",
            ),
            (
                r#"{"fp16": {"loss_scale": "auto"}}"#,
                "\"auto\" has no value here",
            ),
            (
                r#"{"gradient_clipping": -1}"#,
                "gradient_clipping must be a positive",
            ),
            (r#"[1]"#, "must be a JSON object"),
            (r#"{"stage": 2"#, "not JSON"),
        ];
        for (json, want) in cases {
            let e = ZeroConfig::from_json(json).unwrap_err().to_string();
            assert!(e.contains(want), "{json}: {e}");
        }
    }

    #[test]
    fn the_builder_checks_values() {
        assert!(ZeroConfig::builder()
            .stage(2)
            .clip_norm(Some(1.0))
            .build()
            .is_ok());
        let e = ZeroConfig::builder()
            .stage(7)
            .build()
            .unwrap_err()
            .to_string();
        assert!(e.contains("stage 7"), "{e}");
        let e = ZeroConfig::builder()
            .optimizer(Optimizer {
                beta1: 1.0,
                ..Optimizer::default()
            })
            .build()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("AdamW: betas (1, 0.999) must each be in [0, 1)"),
            "{e}"
        );
    }
}
