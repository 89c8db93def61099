//! DeepSpeed's JSON configuration ([`ZeroConfig::from_json`]). Every key of DeepSpeed's
//! `config-json` reference is one of three things here:
//! - **read**: it sets what it sets in DeepSpeed;
//! - **noted**: accepted, with a one-line notice (in [`ZeroConfig::notes`]) that says why it
//!   changes nothing here — it describes what ringzero always does, or something a trainer does
//!   itself;
//! - **refused**: only where honouring it silently would change the results, with a message that
//!   says what to do.
//!
//! `"auto"` values are resolved as Hugging Face's Trainer resolves them, from the trainer's own
//! arguments ([`Auto`]; its defaults are the Trainer's), and every resolution is noted too.
//!
//! Keys the reference does not know follow DeepSpeed too: inside a section (`zero_optimization`,
//! `fp16`, `optimizer`, ...) they are refused, all of them in one message, as DeepSpeed's
//! section models forbid them; at the top level, where DeepSpeed reads the keys it knows and
//! ignores the rest (published configs carry `comms_config` or `monitor_config`), they are
//! noted, unless one looks like a mistake: a key of `zero_optimization` written at the top level
//! (`"stage": 3`, which would leave stage 0) or a near-miss of a known key
//! (`gradient_acumulation_steps`), both refused. `zero_optimization`'s stage-3 keys are read
//! under both of DeepSpeed's names (`max_live_parameters` is `stage3_max_live_parameters`).

use serde_json::{Map, Value};

use super::{bad, Precision, ZeroConfig};
use crate::error::ZeroError;

mod offload;
mod optimizer;
mod scheduler;

use offload::{read_aio, read_offload};
use optimizer::optimizer;
use scheduler::read_scheduler;

/// What `"auto"` resolves to: the trainer's own arguments, as Hugging Face's Trainer passes its
/// `TrainingArguments` (the defaults are the Trainer's).
#[derive(Clone, Debug, PartialEq)]
pub struct Auto {
    /// `optimizer.params.lr`, `scheduler.params.warmup_max_lr` (the Trainer's 5e-5).
    pub lr: f32,
    /// `optimizer.params.betas` (0.9, 0.999).
    pub betas: (f32, f32),
    /// `optimizer.params.eps` (1e-8).
    pub eps: f32,
    /// `optimizer.params.weight_decay` (0).
    pub weight_decay: f32,
    /// `gradient_clipping` (1.0).
    pub clip_norm: f32,
    /// `gradient_accumulation_steps` (1).
    pub accumulation_steps: usize,
    /// `train_micro_batch_size_per_gpu` (8).
    pub micro_batch: usize,
    /// The world size, for `train_batch_size` = micro batch × accumulation × world (unknown
    /// until the engine is made: `None` leaves the batch size unchecked).
    pub world: Option<usize>,
    /// `fp16.enabled` / `bf16.enabled` (fp32).
    pub precision: Precision,
    /// `scheduler.params.warmup_num_steps` (0).
    pub warmup_steps: u64,
    /// `scheduler.params.total_num_steps` (none: a config that needs it says so).
    pub total_steps: Option<u64>,
    /// The model's hidden size, from which the Trainer fills `zero_optimization`'s
    /// `reduce_bucket_size` (hidden²), `stage3_prefetch_bucket_size` (0.9 × hidden²) and
    /// `stage3_param_persistence_threshold` (10 × hidden); without one (none), those are the
    /// engine's defaults.
    pub hidden: Option<usize>,
}

impl Default for Auto {
    fn default() -> Auto {
        Auto {
            lr: 5e-5,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            clip_norm: 1.0,
            accumulation_steps: 1,
            micro_batch: 8,
            world: None,
            precision: Precision::Fp32,
            warmup_steps: 0,
            total_steps: None,
            hidden: None,
        }
    }
}

/// Keys accepted with a notice: (key, why it changes nothing here). `*` ends a prefix.
const NOTED: &[(&str, &str)] = &[
    ("steps_per_print", "ringzero prints nothing per step itself; StepOutcome and comm_wait() give the trainer what to print"),
    ("memory_breakdown", "the engine always counts its memory: Engine::memory()"),
    ("zero_allow_untested_optimizer", "every optimizer ringzero has is tested with every stage"),
    ("zero_force_ds_cpu_optimizer", "ringzero has one optimizer implementation per memory"),
    ("dump_state", "ringzero dumps no state at start-up"),
    ("sparse_gradients", "gradients are always dense buffers"),
    ("flops_profiler", "no profiler integration; profile the trainer"),
    ("tensorboard", "no monitor integration; the trainer logs"),
    ("wandb", "no monitor integration; the trainer logs"),
    ("csv_monitor", "no monitor integration; the trainer logs"),
    ("comms_logger", "communication is counted by the communicator's counters() and flight record"),
    ("activation_checkpointing", "activation checkpointing is the trainer's forward"),
    ("checkpoint", "checkpoints are always the resharding format of save_checkpoint"),
    ("zero_optimization.contiguous_gradients", "buckets are always contiguous buffers"),
    ("zero_optimization.reduce_scatter", "gradients are always reduce-scattered per bucket (the same average either way)"),
    ("zero_optimization.allgather_partitions", "updated parameters are always all-gathered per bucket"),
    ("zero_optimization.round_robin_gradients", "each bucket is reduced whole; there is nothing to interleave"),
    ("zero_optimization.load_from_fp32_weights", "checkpoints always hold and load the fp32 masters"),
    ("zero_optimization.elastic_checkpoint", "checkpoints always load at any world size"),
    ("zero_optimization.sub_group_size", "the optimizer steps one bucket at a time"),
    ("zero_optimization.stage3_gather_16bit_weights_on_model_save", "`ringzero ckpt consolidate --dtype bf16|fp16` writes 16-bit weights from any checkpoint"),
    ("zero_optimization.stage3_gather_fp16_weights_on_model_save", "`ringzero ckpt consolidate --dtype fp16` writes 16-bit weights from any checkpoint"),
    ("zero_optimization.ignore_unused_parameters", "every parameter needs a gradient each micro-step (push zeros for an unused one)"),
    ("zero_optimization.legacy_stage1", "there is one stage-1 implementation"),
    ("zero_optimization.memory_efficient_linear", "linear layers are the trainer's"),
    ("zero_optimization.stage3_module_granularity_threshold", "stage 3 gathers by bucket, as the trainer asks"),
    ("zero_optimization.stage3_model_persistence_threshold", "persistent parameters are those below stage3_param_persistence_threshold, with no cap on their total"),
    ("zero_optimization.use_all_reduce_for_fetch_params", "stage 3 gathers with all-gather"),
    ("zero_optimization.log_trace_cache_warnings", "there is no trace cache"),
    ("zero_optimization.offload_optimizer.fast_init", "the NVMe tier's files are written once, at start-up, either way"),
    ("fp16.auto_cast", "inputs are the trainer's to cast"),
    ("bf16.immediate_grad_update", "gradients are summed into their bucket as they are pushed"),
    ("optimizer.params.torch_adam", "there is one implementation of each optimizer per memory, bit-identical between them"),
    ("optimizer.params.fused", "the optimizer kernels are always fused"),
];

/// `zero_optimization`'s keys DeepSpeed reads under two names (a field and its alias): (the
/// other name, the one read here).
const ZERO_ALIASES: &[(&str, &str)] = &[
    ("prefetch_bucket_size", "stage3_prefetch_bucket_size"),
    (
        "param_persistence_threshold",
        "stage3_param_persistence_threshold",
    ),
    (
        "model_persistence_threshold",
        "stage3_model_persistence_threshold",
    ),
    ("max_live_parameters", "stage3_max_live_parameters"),
    ("max_reuse_distance", "stage3_max_reuse_distance"),
    (
        "gather_16bit_weights_on_model_save",
        "stage3_gather_16bit_weights_on_model_save",
    ),
    (
        "module_granularity_threshold",
        "stage3_module_granularity_threshold",
    ),
    (
        "stage3_use_all_reduce_for_fetch_params",
        "use_all_reduce_for_fetch_params",
    ),
];

/// The top-level keys read here, beside the tables' (a near-miss of one is refused).
const TOP_LEVEL: &[&str] = &[
    "zero_optimization",
    "fp16",
    "bf16",
    "gradient_clipping",
    "gradient_accumulation_steps",
    "train_micro_batch_size_per_gpu",
    "train_batch_size",
    "optimizer",
    "wall_clock_breakdown",
    "scheduler",
    "aio",
    "elasticity",
    "amp",
];

/// Keys that are fine at one value and refused at any other: (key, the harmless value, why).
const ONLY_AT: &[(&str, &str, &str)] = &[
    (
        "prescale_gradients",
        "false",
        "gradients are averaged by the reduce-scatter itself",
    ),
    (
        "gradient_predivide_factor",
        "1",
        "gradients are averaged by the reduce-scatter itself",
    ),
    (
        "communication_data_type",
        "null",
        "collectives move the parameters' precision",
    ),
    (
        "elasticity.enabled",
        "false",
        "the world size is fixed for a run (checkpoints reshard between runs)",
    ),
    (
        "amp.enabled",
        "false",
        "mixed precision is fp16.enabled or bf16.enabled",
    ),
    (
        "fp16.fp16_master_weights_and_grads",
        "false",
        "master weights are always fp32",
    ),
    (
        "zero_optimization.zero_hpz_partition_size",
        "1",
        "ZeRO++'s secondary partition is not implemented; use mics_shard_size for hybrid sharding",
    ),
    (
        "zero_optimization.zero_quantized_weights",
        "false",
        "ZeRO++ weight quantization is not implemented",
    ),
    (
        "zero_optimization.zero_quantized_gradients",
        "false",
        "ZeRO++ gradient quantization is not implemented",
    ),
    (
        "optimizer.params.bias_correction",
        "true",
        "Adam always corrects its moments' bias",
    ),
    (
        "optimizer.params.amsgrad",
        "false",
        "AMSGrad is not implemented",
    ),
];

/// Reading state: the notes so far and the keys nobody knows.
struct Reader<'a> {
    auto: &'a Auto,
    notes: Vec<String>,
    unknown: Vec<String>,
}

impl Reader<'_> {
    /// `v`, or what `"auto"` resolves to (noted).
    fn auto(&mut self, key: &str, v: &Value, resolved: Value) -> Value {
        self.auto_because(key, v, resolved, "from the trainer's arguments")
    }

    /// `v`, or what `"auto"` resolves to (noted, saying `because`).
    fn auto_because(&mut self, key: &str, v: &Value, resolved: Value, because: &str) -> Value {
        if v.as_str() == Some("auto") {
            self.notes
                .push(format!("`{key}`: \"auto\" is {resolved} ({because})"));
            resolved
        } else {
            v.clone()
        }
    }

    /// What `"auto"` is for a key the Trainer fills from the model's hidden size `h` (`of(h)`),
    /// or `default` without one; and why.
    fn by_hidden(&self, of: impl Fn(usize) -> usize, default: usize) -> (Value, String) {
        match self.auto.hidden {
            Some(h) => (
                of(h).into(),
                format!("from the model's hidden size {h}, as Hugging Face's Trainer fills it"),
            ),
            None => (
                default.into(),
                "the engine's default: no hidden size given".into(),
            ),
        }
    }

    /// A key the tables above decide, if they do: noted, or refused unless at its harmless value.
    fn settled(&mut self, key: &str, v: &Value) -> Result<bool, ZeroError> {
        if let Some((_, why)) = NOTED.iter().find(|(k, _)| *k == key) {
            self.notes
                .push(format!("`{key}` changes nothing here: {why}"));
            return Ok(true);
        }
        if let Some((_, ok, why)) = ONLY_AT.iter().find(|(k, _, _)| *k == key) {
            let fine = match *ok {
                "true" => v.as_bool() == Some(true),
                "false" => v.as_bool() == Some(false),
                "null" => v.is_null(),
                n => v.as_f64() == n.parse::<f64>().ok(),
            };
            if !fine {
                return Err(bad(format!(
                    "`{key}` = {v} is not supported: {why} (remove it, or set it to {ok})"
                )));
            }
            return Ok(true);
        }
        Ok(false)
    }
}

impl ZeroConfig {
    /// Read DeepSpeed's JSON config, `"auto"` resolved from the defaults of [`Auto`] (Hugging
    /// Face's Trainer's); see [`ZeroConfig::from_json_auto`].
    pub fn from_json(text: &str) -> Result<ZeroConfig, ZeroError> {
        ZeroConfig::from_json_auto(text, &Auto::default())
    }

    /// Read DeepSpeed's JSON config, `"auto"` resolved from `auto` (the module docs say what each
    /// key becomes). What was noted or resolved is in [`ZeroConfig::notes`], for the trainer to
    /// print once. Unknown keys are refused, all at once, as is a value of the wrong type.
    pub fn from_json_auto(text: &str, auto: &Auto) -> Result<ZeroConfig, ZeroError> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| bad(format!("config is not JSON: {e}")))?;
        let top = v
            .as_object()
            .ok_or_else(|| bad("config must be a JSON object"))?;
        let mut cfg = ZeroConfig {
            // DeepSpeed's default when `zero_optimization` is absent.
            stage: 0,
            // DeepSpeed clips at a norm of 1.0 unless `gradient_clipping` says otherwise (0 is
            // off).
            clip_norm: Some(1.0),
            ..ZeroConfig::default()
        };
        let mut r = Reader {
            auto,
            notes: Vec::new(),
            unknown: Vec::new(),
        };
        if !top.contains_key("gradient_clipping") {
            r.notes.push(
                "`gradient_clipping` is not set: gradients are clipped at a global norm of 1.0, \
                 DeepSpeed's default (0 turns clipping off)"
                    .to_string(),
            );
        }
        let (mut fp16, mut bf16) = (None, None);
        let mut scheduler = None;
        for (k, val) in top {
            let k = k.as_str();
            match k {
                "zero_optimization" => zero_optimization(&mut r, &mut cfg, val)?,
                "fp16" => fp16 = Some(half(&mut r, &mut cfg, k, val)?),
                "bf16" => bf16 = Some(half(&mut r, &mut cfg, k, val)?),
                "gradient_clipping" => {
                    let c = num(k, &r.auto(k, val, auto.clip_norm.into()))?;
                    cfg.clip_norm = (c != 0.0).then_some(c as f32);
                }
                "gradient_accumulation_steps" => {
                    let a = r.auto(k, val, auto.accumulation_steps.into());
                    cfg.accumulation_steps = uint(k, &a)? as usize;
                }
                "train_micro_batch_size_per_gpu" => {
                    let m = r.auto(k, val, auto.micro_batch.into());
                    cfg.micro_batch = Some(uint(k, &m)? as usize);
                }
                "train_batch_size" => cfg.train_batch = train_batch(&mut r, val)?,
                "optimizer" => optimizer(&mut r, &mut cfg, val)?,
                "wall_clock_breakdown" => cfg.wall_clock_breakdown = boolean(k, val)?,
                "scheduler" => scheduler = Some(val),
                "aio" => read_aio(&mut r, &mut cfg.offload.aio, val)?,
                "elasticity" | "amp" => for_each(&mut r, k, val, |_, _, _| Ok(false))?,
                _ => {
                    if !r.settled(k, val)? {
                        r.unknown.push(k.to_string());
                    }
                }
            }
        }
        if let Some(s) = scheduler {
            cfg.scheduler = Some(read_scheduler(&mut r, &cfg, s)?);
        }
        // Top-level keys nobody reads: noted, as DeepSpeed ignores them, unless misplaced or
        // misspelled.
        let (top_unknown, nested): (Vec<String>, Vec<String>) =
            r.unknown.drain(..).partition(|k| !k.contains('.'));
        r.unknown = nested;
        let mut mistakes = Vec::new();
        for k in top_unknown {
            match mistaken_top_level(auto, &k, &top[&k]) {
                Some(why) => mistakes.push(why),
                None => r.notes.push(format!(
                    "`{k}` is not a key DeepSpeed reads: it ignores it, and so does ringzero"
                )),
            }
        }
        if !r.unknown.is_empty() {
            r.unknown.sort();
            let list: Vec<String> = r.unknown.iter().map(|k| format!("`{k}`")).collect();
            mistakes.insert(
                0,
                format!(
                    "unknown key{} {}: not in DeepSpeed's configuration reference (check the \
                     spelling; docs/zero.md lists what each key does here)",
                    if r.unknown.len() > 1 { "s" } else { "" },
                    list.join(", ")
                ),
            );
        }
        if !mistakes.is_empty() {
            return Err(bad(mistakes.join("; ")));
        }
        let auto_half = |x: Option<Option<bool>>, p: Precision| match x {
            Some(Some(on)) => on,
            Some(None) => auto.precision == p,
            None => false,
        };
        let (f, b) = (
            auto_half(fp16, Precision::Fp16),
            auto_half(bf16, Precision::Bf16),
        );
        cfg.precision = match (f, b) {
            (true, true) => return Err(bad("fp16.enabled and bf16.enabled are both true")),
            (true, false) => Precision::Fp16,
            (false, true) => Precision::Bf16,
            (false, false) => Precision::Fp32,
        };
        if matches!(fp16, Some(None)) || matches!(bf16, Some(None)) {
            r.notes.push(format!(
                "`fp16.enabled`/`bf16.enabled`: \"auto\" is {} (from the trainer's arguments)",
                cfg.precision
            ));
        }
        // DeepSpeed derives the accumulation from the two batch sizes when it is left out.
        if cfg.train_batch.is_some()
            && cfg.micro_batch.is_some()
            && !top.contains_key("gradient_accumulation_steps")
        {
            cfg.accumulation_from_batch = true;
            r.notes.push(
                "`gradient_accumulation_steps` is not set: it is train_batch_size / \
                 (train_micro_batch_size_per_gpu × world size), as DeepSpeed derives it"
                    .to_string(),
            );
        }
        cfg.notes = r.notes;
        cfg.validate()?;
        match auto.world {
            Some(world) => cfg.for_world(world),
            None => Ok(cfg),
        }
    }
}

/// Why the unknown top-level key `k` (with value `v`) looks like a mistake, if it does: a key of
/// `zero_optimization` (read there, it would be known), or within two edits of a key read here
/// (both of six characters or more: `fp8` is not a misspelt `fp16`), or the same but for case
/// and underscores.
fn mistaken_top_level(auto: &Auto, k: &str, v: &Value) -> Option<String> {
    let mut probe = Reader {
        auto,
        notes: Vec::new(),
        unknown: Vec::new(),
    };
    let mut scratch = ZeroConfig::default();
    let inner = Value::Object(Map::from_iter([(k.to_string(), v.clone())]));
    let known_inside =
        zero_optimization(&mut probe, &mut scratch, &inner).is_err() || probe.unknown.is_empty();
    if known_inside {
        return Some(format!(
            "`{k}` is a key of `zero_optimization`, not of the top level (where DeepSpeed \
             ignores it): move it inside `\"zero_optimization\": {{...}}`"
        ));
    }
    let squash = |s: &str| s.replace('_', "").to_lowercase();
    let tables = NOTED
        .iter()
        .map(|(n, _)| *n)
        .chain(ONLY_AT.iter().map(|(n, _, _)| *n));
    let known = TOP_LEVEL
        .iter()
        .copied()
        .chain(tables.filter(|n| !n.contains('.')));
    let near = known
        .filter(|n| {
            let long = k.len() >= 6 && n.len() >= 6;
            (long && strsim::levenshtein(k, n) <= 2) || squash(k) == squash(n)
        })
        .min_by_key(|n| strsim::levenshtein(k, n))?;
    Some(format!(
        "`{k}`: did you mean `{near}`? (DeepSpeed would ignore `{k}`; fix the spelling)"
    ))
}

/// `v` (the `zero_optimization` object) with each key DeepSpeed also reads under another name
/// renamed to the name read here (noted); refused when both names are given.
fn zero_names(r: &mut Reader<'_>, v: &Value) -> Result<Value, ZeroError> {
    let Some(m) = v.as_object() else {
        return Ok(v.clone());
    };
    let mut out = Map::new();
    for (k, val) in m {
        let name = match ZERO_ALIASES.iter().find(|(other, _)| other == k) {
            Some((_, read)) => {
                r.notes.push(format!(
                    "`zero_optimization.{k}` is read as `{read}` (DeepSpeed's other name for it)"
                ));
                *read
            }
            None => k.as_str(),
        };
        if out.insert(name.to_string(), val.clone()).is_some() {
            let (one, other) = ZERO_ALIASES
                .iter()
                .find(|(o, read)| *o == name || *read == name)
                .copied()
                .unwrap_or((k, name));
            return Err(bad(format!(
                "`zero_optimization.{one}` and `zero_optimization.{other}` are one key under \
                 DeepSpeed's two names: give it once"
            )));
        }
    }
    Ok(Value::Object(out))
}

/// Every `key.k2` of the object `v`, to `read` (which says whether it knew it); the rest go to
/// the tables, then to the unknown.
fn for_each(
    r: &mut Reader<'_>,
    key: &str,
    v: &Value,
    mut read: impl FnMut(&mut Reader<'_>, &str, &Value) -> Result<bool, ZeroError>,
) -> Result<(), ZeroError> {
    for (k2, v2) in obj(key, v)? {
        let full = format!("{key}.{k2}");
        if !read(r, k2, v2)? && !r.settled(&full, v2)? {
            r.unknown.push(full);
        }
    }
    Ok(())
}

fn zero_optimization(r: &mut Reader<'_>, cfg: &mut ZeroConfig, v: &Value) -> Result<(), ZeroError> {
    // The legacy form: `true` is stage 1, `false` stage 0.
    if let Some(on) = v.as_bool() {
        cfg.stage = u8::from(on);
        r.notes.push(format!(
            "`zero_optimization`: {on} is the legacy form of stage {}",
            cfg.stage
        ));
        return Ok(());
    }
    let key = "zero_optimization";
    let v = &zero_names(r, v)?;
    for_each(r, key, v, |r, k2, v2| {
        let full = format!("{key}.{k2}");
        match k2 {
            "stage" => cfg.stage = uint(&full, v2)?.min(255) as u8,
            "reduce_bucket_size" => {
                let (x, why) = r.by_hidden(|h| h * h, cfg.bucket_elems);
                let x = r.auto_because(&full, v2, x, &why);
                cfg.bucket_elems = uint(&full, &x)? as usize;
                if cfg.bucket_elems == 0 {
                    cfg.bucket_elems = 1;
                    r.notes.push(format!(
                        "`{full}`: 0 puts each parameter in a bucket of its own"
                    ));
                }
            }
            "allgather_bucket_size" => cfg.allgather_elems = uint(&full, v2)? as usize,
            "overlap_comm" => cfg.overlap_comm = boolean(&full, v2)?,
            "stage3_param_persistence_threshold" => {
                let (x, why) = r.by_hidden(|h| 10 * h, cfg.persistence_threshold);
                let x = r.auto_because(&full, v2, x, &why);
                cfg.persistence_threshold = uint(&full, &x)? as usize;
            }
            "stage3_max_live_parameters" => {
                cfg.max_live_elems = uint(&full, v2)?.min(usize::MAX as u64) as usize;
            }
            "stage3_max_reuse_distance" => {
                cfg.reuse_elems = uint(&full, v2)?.min(usize::MAX as u64) as usize;
            }
            "stage3_prefetch_bucket_size" => {
                let (x, why) = r.by_hidden(|h| h * h * 9 / 10, cfg.prefetch_elems);
                let x = r.auto_because(&full, v2, x, &why);
                cfg.prefetch_elems = uint(&full, &x)? as usize;
            }
            "mics_shard_size" => cfg.shard_size = shard_size(&full, v2)?,
            "cpu_offload" => {
                if boolean(&full, v2)? {
                    cfg.offload.optimizer.device = crate::config::OffloadDevice::Cpu;
                    r.notes.push(format!(
                        "`{full}`: true is the legacy form of offload_optimizer.device \"cpu\""
                    ));
                }
            }
            // Hugging Face's NVMe example nests `aio` here; DeepSpeed's reference has it at the
            // top. Either is read.
            "aio" => read_aio(r, &mut cfg.offload.aio, v2)?,
            "offload_optimizer" | "offload_param" => read_offload(r, &mut cfg.offload, &full, v2)?,
            _ => return Ok(false),
        }
        Ok(true)
    })
}

/// `fp16` / `bf16`: whether enabled (`None`: "auto"), the loss-scaling keys into `cfg`.
fn half(
    r: &mut Reader<'_>,
    cfg: &mut ZeroConfig,
    key: &str,
    v: &Value,
) -> Result<Option<bool>, ZeroError> {
    let mut enabled = Some(false);
    let l = &mut cfg.loss_scaling;
    for_each(r, key, v, |_, k2, v2| {
        let full = format!("{key}.{k2}");
        match (key, k2) {
            (_, "enabled") => {
                enabled = if v2.as_str() == Some("auto") {
                    None
                } else {
                    Some(boolean(&full, v2)?)
                }
            }
            ("fp16", "loss_scale") => l.loss_scale = num(&full, v2)? as f32,
            ("fp16", "initial_scale_power") => l.initial_scale_power = small(&full, v2)?,
            ("fp16", "loss_scale_window") => l.loss_scale_window = small(&full, v2)?,
            ("fp16", "hysteresis") => l.hysteresis = small(&full, v2)?,
            ("fp16", "consecutive_hysteresis") => l.consecutive_hysteresis = boolean(&full, v2)?,
            ("fp16", "min_loss_scale") => l.min_loss_scale = num(&full, v2)? as f32,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    Ok(enabled)
}

fn train_batch(r: &mut Reader<'_>, v: &Value) -> Result<Option<usize>, ZeroError> {
    let key = "train_batch_size";
    if v.as_str() == Some("auto") {
        let a = r.auto;
        let Some(world) = a.world else {
            r.notes.push(format!(
                "`{key}`: \"auto\" is left open (the world size is not known yet)"
            ));
            return Ok(None);
        };
        let x = a.micro_batch * a.accumulation_steps * world;
        r.notes.push(format!(
            "`{key}`: \"auto\" is {x} (micro batch × accumulation × world)"
        ));
        return Ok(Some(x));
    }
    Ok(Some(uint(key, v)? as usize))
}

fn obj<'a>(key: &str, v: &'a Value) -> Result<&'a Map<String, Value>, ZeroError> {
    v.as_object()
        .ok_or_else(|| bad(format!("`{key}` must be an object, got {v}")))
}

fn boolean(key: &str, v: &Value) -> Result<bool, ZeroError> {
    v.as_bool()
        .ok_or_else(|| bad(format!("`{key}` must be true or false, got {v}")))
}

fn num(key: &str, v: &Value) -> Result<f64, ZeroError> {
    if v.as_str() == Some("auto") {
        return Err(bad(format!(
            "`{key}`: \"auto\" has no value here; give a number"
        )));
    }
    v.as_f64()
        .filter(|x| x.is_finite())
        .ok_or_else(|| bad(format!("`{key}` must be a number, got {v}")))
}

/// A non-negative integer; DeepSpeed configs often write sizes as `5e8`, so integral floats count.
fn uint(key: &str, v: &Value) -> Result<u64, ZeroError> {
    let x = num(key, v)?;
    if x < 0.0 || x.fract() != 0.0 || x > u64::MAX as f64 {
        return Err(bad(format!(
            "`{key}` must be a non-negative integer, got {v}"
        )));
    }
    Ok(x as u64)
}

fn small(key: &str, v: &Value) -> Result<u32, ZeroError> {
    Ok(uint(key, v)?.min(u32::MAX as u64) as u32)
}

/// `mics_shard_size`: a group size of at least 1, or DeepSpeed's -1 for off.
fn shard_size(key: &str, v: &Value) -> Result<Option<usize>, ZeroError> {
    if num(key, v)? == -1.0 {
        return Ok(None);
    }
    match uint(key, v) {
        Ok(s) if s >= 1 => Ok(Some(s as usize)),
        _ => Err(bad(format!(
            "`{key}` must be a group size of at least 1 rank, or -1 for no hybrid sharding, got {v}"
        ))),
    }
}
