//! The engine's communication buffers at their peak, predicted before a run: a trainer's calls
//! replayed through the engine's own bookkeeping (the ledger: which buckets a gather fetches,
//! which it prefetches, which a release drops) with the buffers each call takes and gives back,
//! kept by the same rule as the engine's spare buffers. Pure (no memory, no collectives), so
//! `ringzero mem` can give the figure for a model no machine here could hold; the engine counts
//! the same buffers as they are made and dropped ([`crate::Memory::comm_buffers_peak`]), and the
//! tests hold the two equal.
//!
//! The buffers, all of one size per kind (the largest bucket, and its shard) but stage 1's:
//! - **Stages 2–3, backward**: a bucket's staging buffer from its first gradient until it is
//!   reduce-scattered into a shard; under `overlap_comm` at most two reduce-scatters in flight
//!   (each a bucket and a shard), the next full bucket waiting for the older.
//! - **Stage 3, gathers**: each bucket the trainer's live parameters need, the buckets
//!   persistent parameters keep from their first gather on, and the prefetches in flight (a
//!   bucket and a copy of the shard each), by the order the last step gathered in.
//! - **Stage 1, the step**: every bucket's reduced gradient range, each its own size, made at the
//!   first step and kept.
//! - **Stages 1–2, sharing the update**: one piece of `allgather_bucket_size` and its gathered
//!   pieces per bucket too large to all-gather in one call.
//!
//! Stage 0 and the hybrid replicas' all-reduces work in place and take none.

use crate::config::ZeroConfig;
use crate::engine::{alloc_bytes, kept_shards, KEPT_BUCKETS, REDUCES_IN_FLIGHT};
use crate::error::ZeroError;
use crate::ledger::Ledger;
use crate::partition::Partition;

/// A trainer's call, as the engine sees it (parameters by their index in the engine's order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Call {
    /// [`crate::Engine::gather`] of these parameters (stage 3; nothing in stages 0–2).
    Gather(Vec<usize>),
    /// [`crate::Engine::release`] of these parameters.
    Release(Vec<usize>),
    /// [`crate::Engine::prefetch`] of these parameters (stage 3 with prefetch on).
    Prefetch(Vec<usize>),
    /// The gradient of this parameter pushed ([`crate::Engine::push_grad`] and its batched
    /// forms alike).
    Push(usize),
    /// [`crate::Engine::step`]: the end of a micro-step, and at the accumulation boundary the
    /// optimizer step (taken: a skipped step shares nothing).
    Step,
    /// [`crate::Engine::restart_order`].
    RestartOrder,
}

/// Buffers of one size: those in use, those kept for the next use (at most `keep`), and the
/// rule the engine's spare buffers follow — a buffer is made only when none is kept, and one
/// given back beyond `keep` is freed.
struct Pool {
    bytes: usize,
    keep: usize,
    kept: usize,
    alive: usize,
}

impl Pool {
    fn take(&mut self) {
        if self.kept > 0 {
            self.kept -= 1;
        } else {
            self.alive += 1;
        }
    }

    fn give(&mut self) {
        if self.kept < self.keep {
            self.kept += 1;
        } else {
            self.alive -= 1;
        }
    }
}

/// The replayed engine: its ledger, and per bucket what it holds.
struct Replay {
    led: Ledger,
    buckets: Pool,
    shards: Pool,
    staging: Vec<bool>,
    gathered: Vec<bool>,
    /// Prefetches in flight: the elements each holds.
    inflight: Vec<Option<usize>>,
    /// Reduce-scatters in flight, oldest first.
    pending: std::collections::VecDeque<usize>,
    /// Stage 1's reduced shards, each its bucket's owned range, made at the first step and kept.
    reduced: usize,
    peak: usize,
}

impl Replay {
    fn bytes(&self) -> usize {
        self.buckets.alive * self.buckets.bytes
            + self.shards.alive * self.shards.bytes
            + self.reduced
    }

    fn take(&mut self, bucket: bool) {
        if bucket {
            self.buckets.take();
        } else {
            self.shards.take();
        }
        self.peak = self.peak.max(self.bytes());
    }

    /// Prefetches start: a copy of the shard and the whole bucket each, holding `h` elements.
    fn start_prefetches(&mut self, start: Vec<(usize, usize)>) {
        for (b, h) in start {
            self.take(false);
            self.take(true);
            self.inflight[b] = Some(h);
        }
    }

    /// The engine's `drop_gathered`: the gathered buckets among `buckets` go back.
    fn drop_gathered(&mut self, buckets: Vec<usize>) {
        for b in buckets {
            if std::mem::take(&mut self.gathered[b]) {
                self.buckets.give();
            }
        }
    }

    fn call(&mut self, c: &Call) -> Result<(), ZeroError> {
        let names = |ps: &[usize]| -> Result<Vec<String>, ZeroError> {
            ps.iter()
                .map(|&p| {
                    (self.led.part.specs.get(p).map(|s| s.name.clone()))
                        .ok_or_else(|| ZeroError::UnknownParam(format!("parameter index {p}")))
                })
                .collect()
        };
        match c {
            Call::Gather(ps) => {
                let names = names(ps)?;
                let names: Vec<&str> = names.iter().map(String::as_str).collect();
                let gathered = &self.gathered;
                let Some(fetch) = self.led.mark_gathered(&names, |b| gathered[b])? else {
                    return Ok(());
                };
                for b in fetch {
                    if self.inflight[b].take().is_some() {
                        self.shards.give();
                    } else {
                        self.take(true);
                    }
                    self.gathered[b] = true;
                }
                let flying: usize = self.inflight.iter().flatten().sum();
                let lens = &self.led.part.buckets;
                let busy = |b: usize| self.gathered[b] || self.inflight[b].is_some();
                let held: usize = (0..lens.len())
                    .filter(|&b| busy(b))
                    .map(|b| lens[b].len)
                    .sum();
                let start = self.led.recorded_prefetch(busy, flying, held);
                self.start_prefetches(start);
            }
            Call::Prefetch(ps) => {
                let names = names(ps)?;
                let names: Vec<&str> = names.iter().map(String::as_str).collect();
                let flying: usize = self.inflight.iter().flatten().sum();
                let busy = |b: usize| self.gathered[b] || self.inflight[b].is_some();
                let start = self.led.to_prefetch(&names, busy, flying)?;
                self.start_prefetches(start);
            }
            Call::Release(ps) => {
                let names = names(ps)?;
                let names: Vec<&str> = names.iter().map(String::as_str).collect();
                let dropped = self.led.mark_released(&names)?.unwrap_or_default();
                self.drop_gathered(dropped);
            }
            Call::Push(p) => {
                let name = names(&[*p])?.remove(0);
                let (i, slot) = self.led.check_push(&name, self.led.part.slots[*p].len)?;
                let b = slot.bucket;
                if self.led.cfg.stage >= 2 && !self.staging[b] {
                    self.take(true);
                    self.staging[b] = true;
                }
                self.led.pushed[i] = true;
                if self.led.cfg.stage < 2 || !self.led.bucket_full(b) {
                    return Ok(());
                }
                self.staging[b] = false;
                while self.pending.len() >= REDUCES_IN_FLIGHT {
                    self.pending.pop_front();
                    self.buckets.give();
                    self.shards.give();
                }
                self.take(false);
                if self.led.cfg.overlap_comm {
                    self.pending.push_back(b);
                } else {
                    self.buckets.give();
                    self.shards.give();
                }
            }
            Call::Step => self.step()?,
            Call::RestartOrder if self.led.cfg.stage == 3 => {
                let kept = self.led.live.restart_step();
                self.drop_gathered(kept);
            }
            Call::RestartOrder => {}
        }
        Ok(())
    }

    fn step(&mut self) -> Result<(), ZeroError> {
        let boundary = self.led.end_micro_step()?;
        for _ in self.pending.drain(..) {
            self.buckets.give();
            self.shards.give();
        }
        if !boundary {
            return Ok(());
        }
        self.led.micro = 0;
        for f in &mut self.inflight {
            if f.take().is_some() {
                self.shards.give();
                self.buckets.give();
            }
        }
        let kept = self.led.live.take_kept();
        self.drop_gathered(kept);
        let (stage, part) = (self.led.cfg.stage, &self.led.part);
        if stage == 1 && self.reduced == 0 {
            let dtype = self.led.cfg.precision.dtype();
            self.reduced = (part.buckets.iter())
                .map(|b| alloc_bytes(dtype, b.len / part.world))
                .sum();
        }
        let piece = (self.led.cfg.allgather_elems / part.world).max(1);
        let pieced = match stage {
            1 | 2 => (part.buckets.iter())
                .filter(|b| b.len / part.world > piece)
                .count(),
            _ => 0,
        };
        self.peak = self.peak.max(self.bytes());
        for _ in 0..pieced {
            self.take(false);
            self.take(true);
            self.shards.give();
            self.buckets.give();
        }
        Ok(())
    }
}

/// The most bytes the engine's communication buffers (the kinds in the module docs) hold at
/// once while a trainer makes `calls`, for `part` under `cfg` (in `cfg.precision`): what
/// [`crate::Memory::comm_buffers_peak`] reads after the same calls. Calls the engine would
/// refuse (an unknown index, a gradient pushed twice, a step with one missing) are refused
/// here the same way.
pub fn comm_buffers_peak(
    part: &Partition,
    cfg: &ZeroConfig,
    calls: impl IntoIterator<Item = Call>,
) -> Result<usize, ZeroError> {
    let nb = part.buckets.len();
    let cap = part.buckets.iter().map(|b| b.len).max().unwrap_or(0);
    let dtype = cfg.precision.dtype();
    let mut r = Replay {
        buckets: Pool {
            bytes: alloc_bytes(dtype, cap),
            keep: KEPT_BUCKETS,
            kept: 0,
            alive: 0,
        },
        shards: Pool {
            bytes: alloc_bytes(dtype, cap / part.world),
            keep: kept_shards(nb),
            kept: 0,
            alive: 0,
        },
        staging: vec![false; nb],
        gathered: vec![false; nb],
        inflight: vec![None; nb],
        pending: Default::default(),
        reduced: 0,
        peak: 0,
        led: Ledger::new(part.clone(), cfg.clone(), 0),
    };
    for c in calls {
        r.call(&c)?;
    }
    Ok(r.peak)
}
