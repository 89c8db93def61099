//! The engine's bookkeeping, apart from where its model states live: the layout and its
//! checks, and the [`Ledger`] of a run — partition, configuration, which gradients are in, where
//! the accumulation window stands, the step counters and the loss scaler. Pure (no memory of a
//! stream, no collectives), so the rules it keeps are read and tested in one place.

use ringzero_kernels::cpu::Float;

use crate::config::ZeroConfig;
use crate::error::ZeroError;
use crate::live::Live;
use crate::partition::{ParamSpec, Partition, Slot};
use crate::report::StepOutcome;
use crate::scaler::LossScaler;

/// The bookkeeping of one engine (see the module docs).
pub(crate) struct Ledger {
    pub(crate) part: Partition,
    pub(crate) cfg: ZeroConfig,
    pub(crate) rank: usize,
    /// Per parameter: whether this micro-step's gradient is in.
    pub(crate) pushed: Vec<bool>,
    /// Micro-steps done in the current accumulation window.
    pub(crate) micro: usize,
    /// Optimizer steps taken.
    pub(crate) t: u64,
    /// Optimizer steps skipped on overflow.
    pub(crate) skipped: u64,
    pub(crate) scaler: LossScaler,
    /// The rate [`crate::Engine::set_lr`] set, used instead of `cfg.optimizer.lr`.
    pub(crate) lr: Option<f32>,
    /// Per parameter: the index of its group in `cfg.param_groups`, if any (matched once).
    group: Vec<Option<usize>>,
    /// Stage 3: the parameters gathered, the buckets that keeps, the recorded order.
    pub(crate) live: Live,
}

impl Ledger {
    /// A fresh run of `part` under `cfg` on `rank`.
    pub(crate) fn new(part: Partition, cfg: ZeroConfig, rank: usize) -> Ledger {
        let group = part
            .specs
            .iter()
            .map(|p| cfg.param_groups.iter().position(|g| g.contains(&p.name)))
            .collect();
        Ledger {
            live: Live::new(&part, cfg.persistence_threshold),
            group,
            pushed: vec![false; part.specs.len()],
            scaler: LossScaler::new(cfg.precision, cfg.loss_scaling),
            micro: 0,
            t: 0,
            skipped: 0,
            lr: None,
            part,
            cfg,
            rank,
        }
    }

    /// The optimizer's hyper-parameters for optimizer step `k` (1-based): the configured ones,
    /// the rate set by `set_lr`, or the schedule's.
    pub(crate) fn hyper(&self, k: u64) -> ringzero_kernels::cpu::Optimizer {
        let mut h = self.cfg.optimizer;
        if let Some(lr) = self.lr {
            h.lr = lr;
        }
        match &self.cfg.scheduler {
            Some(s) => s.at(k, h),
            None => h,
        }
    }

    /// The pieces of one update of bucket `b`'s `len` positions from `from` (bucket
    /// coordinates) by their parameters' settings: `(offset into the range, length, settings)`.
    /// Without parameter groups, one piece with `h`; with them, a piece per run of positions
    /// with the same settings (padding takes `h`). The update is elementwise, so the pieces
    /// compute what one call would, each with its own settings.
    pub(crate) fn update_segments(
        &self,
        b: usize,
        from: usize,
        len: usize,
        h: &ringzero_kernels::cpu::Optimizer,
    ) -> Vec<(usize, usize, ringzero_kernels::cpu::Optimizer)> {
        let groups = &self.cfg.param_groups;
        if groups.is_empty() || len == 0 {
            return vec![(0, len, *h)];
        }
        let end = from + len;
        // Each position's settings: the bucket's parameters' slots, padding with `h`.
        let mut marks: Vec<(usize, usize, ringzero_kernels::cpu::Optimizer)> = Vec::new();
        for &pi in &self.part.buckets[b].params {
            let slot = &self.part.slots[pi];
            let (lo, hi) = (slot.offset.max(from), (slot.offset + slot.len).min(end));
            if lo >= hi {
                continue;
            }
            let hp = self.group[pi].map_or(*h, |g| groups[g].apply(*h));
            marks.push((lo, hi, hp));
        }
        marks.sort_by_key(|m| m.0);
        let mut out: Vec<(usize, usize, ringzero_kernels::cpu::Optimizer)> = Vec::new();
        let mut at = from;
        let mut push =
            |lo: usize, hi: usize, hp: ringzero_kernels::cpu::Optimizer| match out.last_mut() {
                Some(last) if last.2 == hp && from + last.0 + last.1 == lo => last.1 += hi - lo,
                _ => out.push((lo - from, hi - lo, hp)),
            };
        for (lo, hi, hp) in marks {
            if at < lo {
                push(at, lo, *h);
            }
            push(lo, hi, hp);
            at = hi;
        }
        if at < end {
            push(at, end, *h);
        }
        out
    }

    /// The index of parameter `name`.
    pub(crate) fn index(&self, name: &str) -> Result<usize, ZeroError> {
        self.part
            .index(name)
            .ok_or_else(|| ZeroError::UnknownParam(name.to_string()))
    }

    /// The buckets holding `names`, each once, with the first name that led to it.
    pub(crate) fn buckets_of(&self, names: &[&str]) -> Result<Vec<(usize, String)>, ZeroError> {
        let mut out: Vec<(usize, String)> = Vec::new();
        for n in names {
            let b = self.part.slots[self.index(n)?].bucket;
            if !out.iter().any(|(x, _)| *x == b) {
                out.push((b, n.to_string()));
            }
        }
        Ok(out)
    }

    /// Check a gradient of `len` elements for `name` (known, the right length, not in yet):
    /// its index and slot.
    pub(crate) fn check_push(&self, name: &str, len: usize) -> Result<(usize, Slot), ZeroError> {
        let i = self.index(name)?;
        let s = self.part.slots[i];
        if len != s.len {
            return Err(ZeroError::GradLength {
                name: name.into(),
                got: len,
                want: s.len,
            });
        }
        if self.pushed[i] {
            return Err(ZeroError::GradTwice(name.into()));
        }
        Ok((i, s))
    }

    /// Whether every gradient of bucket `b` is in.
    pub(crate) fn bucket_full(&self, b: usize) -> bool {
        self.part.buckets[b].params.iter().all(|&p| self.pushed[p])
    }

    /// End a micro-step (refused when a gradient is missing, or, at the boundary, when the
    /// trainer still holds parameters gathered); whether it is the accumulation boundary, where
    /// the recorded order of stage 3's gathers is renewed.
    pub(crate) fn end_micro_step(&mut self) -> Result<bool, ZeroError> {
        let boundary = self.micro + 1 == self.cfg.accumulation_steps;
        let held = if boundary {
            self.live.live_names(&self.part)
        } else {
            Vec::new()
        };
        ready_to_step(&self.part, &self.pushed, held)?;
        self.pushed.iter_mut().for_each(|p| *p = false);
        self.micro += 1;
        if boundary {
            self.live.end_step();
        }
        Ok(boundary)
    }

    /// The parameters named, by index (refused, naming it, when one is unknown).
    fn indices(&self, names: &[&str]) -> Result<Vec<usize>, ZeroError> {
        names.iter().map(|n| self.index(n)).collect()
    }

    /// Stage 3: mark `names` gathered; the buckets to gather (`None` in stages 0–2, where
    /// gathering is a no-op): those no live parameter holds and not `held` already. Refused,
    /// changing nothing, when one is gathered already.
    pub(crate) fn mark_gathered(
        &mut self,
        names: &[&str],
        held: impl Fn(usize) -> bool,
    ) -> Result<Option<Vec<usize>>, ZeroError> {
        let params = self.indices(names)?;
        if self.cfg.stage != 3 {
            return Ok(None);
        }
        Ok(Some(self.live.gather(&self.part, &params, held)?.fetch))
    }

    /// Stage 3: mark `names` released; the buckets to drop (`None` in stages 0–2): those left
    /// with no live parameter and no persistent one. Refused, changing nothing, when one is not
    /// gathered.
    pub(crate) fn mark_released(
        &mut self,
        names: &[&str],
    ) -> Result<Option<Vec<usize>>, ZeroError> {
        let params = self.indices(names)?;
        if self.cfg.stage != 3 {
            return Ok(None);
        }
        (self.live.release(&self.part, &params, self.cfg.reuse_elems)).map(Some)
    }

    /// Stage 3 with prefetch on, after a gather: the buckets next in the recorded order to
    /// prefetch (see [`Live::next_prefetch`]), skipping those `busy`; `flying` elements in
    /// flight and `held` gathered or in flight now.
    pub(crate) fn recorded_prefetch(
        &self,
        busy: impl Fn(usize) -> bool,
        flying: usize,
        held: usize,
    ) -> Vec<(usize, usize)> {
        if self.cfg.stage != 3 || self.cfg.prefetch_elems == 0 {
            return Vec::new();
        }
        let c = &self.cfg;
        self.live.next_prefetch(
            &self.part,
            busy,
            (flying, c.prefetch_elems),
            (held, c.max_live_elems),
        )
    }

    /// Stage 3 with prefetch on: the buckets holding `names` to start prefetching, in order,
    /// skipping those gathered or in flight (`busy(bucket)`) and stopping before the elements in
    /// flight (`flying` now, each bucket adding its length and its shard's) would pass
    /// `prefetch_elems`; with the elements each will hold.
    pub(crate) fn to_prefetch(
        &self,
        names: &[&str],
        busy: impl Fn(usize) -> bool,
        mut flying: usize,
    ) -> Result<Vec<(usize, usize)>, ZeroError> {
        let buckets = self.buckets_of(names)?;
        let mut out = Vec::new();
        if self.cfg.stage != 3 || self.cfg.prefetch_elems == 0 {
            return Ok(out);
        }
        for (b, _) in buckets {
            let len = self.part.buckets[b].len;
            if busy(b) {
                continue;
            }
            if flying + len > self.cfg.prefetch_elems {
                break;
            }
            let held = len + len / self.part.world;
            out.push((b, held));
            flying += held;
        }
        Ok(out)
    }

    /// Count a skipped step (an overflow) and give its outcome; an error when fp16's loss scale
    /// has nowhere left to go (every rank agreed on the overflow, so every rank returns it).
    pub(crate) fn skip(&mut self) -> Result<StepOutcome, ZeroError> {
        self.skipped += 1;
        self.scaler
            .update(true)
            .map_err(|scale| ZeroError::LossScaleAtMinimum {
                scale,
                step: self.t + 1,
            })?;
        Ok(StepOutcome::Skipped {
            loss_scale: self.scaler.scale(),
        })
    }
}

/// Check `cfg` for an engine of `T` parameters sharded over `n` ranks, and lay the parameters
/// out: the partition and every bucket's initial fp32 values (`init(param index, element
/// index)`, zero in the padding).
pub(crate) fn layout<T: Float>(
    cfg: &ZeroConfig,
    specs: &[ParamSpec],
    init: &dyn Fn(usize, usize) -> f32,
    n: usize,
) -> Result<(Partition, Vec<Vec<f32>>), ZeroError> {
    cfg.validate()?;
    if cfg.precision.dtype() != T::DTYPE {
        return Err(ZeroError::Config(format!(
            "the config asks for {} parameters but the engine was created for {}",
            cfg.precision,
            T::DTYPE
        )));
    }
    let part =
        Partition::new(specs, n, cfg.bucket_elems).map_err(|e| ZeroError::Config(e.to_string()))?;
    let mut full: Vec<Vec<f32>> = part.buckets.iter().map(|b| vec![0f32; b.len]).collect();
    for (i, s) in part.slots.iter().enumerate() {
        for (k, x) in full[s.bucket][s.offset..s.offset + s.len]
            .iter_mut()
            .enumerate()
        {
            *x = init(i, k);
        }
    }
    Ok((part, full))
}

/// Refuse a step (nothing changed) before every parameter's gradient is in (`pushed`), or at the
/// accumulation `boundary` while a bucket is still gathered (`gathered(bucket)`).
fn ready_to_step(part: &Partition, pushed: &[bool], held: Vec<String>) -> Result<(), ZeroError> {
    let missing: Vec<&str> = (0..pushed.len())
        .filter(|&i| !pushed[i])
        .map(|i| part.specs[i].name.as_str())
        .collect();
    if !missing.is_empty() {
        return Err(ZeroError::MissingGrads(missing.join(", ")));
    }
    if !held.is_empty() {
        return Err(ZeroError::StillGathered(held.join(", ")));
    }
    Ok(())
}

/// The range of bucket `b` that `rank` updates: everything in stage 0, its owned range else.
pub(crate) fn update_range(
    part: &Partition,
    stage: u8,
    rank: usize,
    b: usize,
) -> std::ops::Range<usize> {
    if stage == 0 {
        0..part.buckets[b].len
    } else {
        part.owned(b, rank)
    }
}

/// The factor gradients are multiplied by so that their global norm is at most `clip_norm`.
pub(crate) fn clip_factor(clip_norm: Option<f32>, grad_norm: f64) -> f32 {
    clip_norm.map_or(1.0, |c| ((c as f64) / (grad_norm + 1e-6)).min(1.0) as f32)
}

/// Hybrid sharding's construction checks, the same for both engines: every rank of a replica
/// group must hold the same shard (the same rank of shard groups of the same size).
pub(crate) mod hybrid {
    use crate::config::ZeroConfig;
    use crate::error::ZeroError;

    /// Refuse a config whose `mics_shard_size` is not the shard group's size.
    pub(crate) fn shard_size_matches(cfg: &ZeroConfig, size: usize) -> Result<(), ZeroError> {
        match cfg.shard_size.filter(|&s| s != size) {
            Some(s) => Err(ZeroError::Config(format!(
                "the config shards over groups of {s} ranks (mics_shard_size) but the shard \
                 communicator has {size} ranks"
            ))),
            None => Ok(()),
        }
    }

    /// What a rank tells its replicas: its shard rank and the shard group's size.
    pub(crate) fn record(rank: usize, size: usize) -> [i64; 2] {
        [rank as i64, size as i64]
    }

    /// Why the replicas' records (`all`, all-gathered) disagree with this rank's (`mine`,
    /// replica `me`), if they do.
    pub(crate) fn disagreement(mine: [i64; 2], all: &[i64], me: usize) -> Option<String> {
        all.chunks_exact(2)
            .enumerate()
            .find(|(_, c)| c[..] != mine[..])
            .map(|(k, c)| {
                format!(
                    "hybrid sharding: replica {k} holds shard rank {} of {} but this rank (replica \
                     {me}) holds shard rank {} of {}; every rank of `replicas` must hold the same \
                     shard",
                    c[0], c[1], mine[0], mine[1]
                )
            })
    }

    /// This rank's finding (`odd`) and whether any rank of its shard group had one (`bad`, the
    /// group's max): every rank of the group fails alike.
    pub(crate) fn verdict(odd: Option<String>, bad: u8) -> Result<(), ZeroError> {
        match (odd, bad) {
            (Some(why), _) => Err(ZeroError::Config(why)),
            (None, 0) => Ok(()),
            (None, _) => Err(ZeroError::Config(
                "hybrid sharding: another rank of this shard group found its replicas holding \
                 different shards (its error says which)"
                    .into(),
            )),
        }
    }
}
