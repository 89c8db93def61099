//! Stage 3's parameters: gathered on demand ([`Engine::gather`]), prefetched in the background
//! (by the order the last step gathered them in, and by hand with [`Engine::prefetch`]),
//! released after use ([`Engine::release`]). A bucket stays gathered while any of its
//! parameters is (the rules: `crate::live`). No-ops in stages 0–2.

use std::time::Instant;

use ringzero_collectives::{Collectives, NonBlocking, TrainStream};
use ringzero_kernels::cpu::Float;

use super::{dev, Engine};
use crate::error::ZeroError;

impl<T: Float, S: TrainStream + 'static> Engine<T, S> {
    /// Stage 3: start all-gathering the buckets holding `names` on the proxy thread, so a later
    /// [`Engine::gather`] finds them ready; at most `prefetch_elems` elements are in flight
    /// (the rest is left for `gather`). A no-op in stages 0–2 and when `prefetch_elems` is 0.
    /// Like every collective, prefetches must be issued in the same order on every rank.
    pub fn prefetch(&mut self, names: &[&str]) -> Result<(), ZeroError> {
        let flying: usize = self.inflight.iter().flatten().map(|(_, e)| e).sum();
        let (gathered, inflight) = (&self.gathered, &self.inflight);
        let start = self.led.to_prefetch(
            names,
            |b| gathered[b].is_some() || inflight[b].is_some(),
            flying,
        )?;
        self.start_prefetches(start)
    }

    /// After a gather that follows the order recorded in the last step: prefetch the buckets
    /// of the parameters next in it (within `stage3_prefetch_bucket_size` in flight and
    /// `stage3_max_live_parameters` held).
    fn prefetch_recorded(&mut self) -> Result<(), ZeroError> {
        let flying: usize = self.inflight.iter().flatten().map(|(_, e)| e).sum();
        let lens = &self.led.part.buckets;
        let held: usize = (0..lens.len())
            .filter(|&b| self.gathered[b].is_some() || self.inflight[b].is_some())
            .map(|b| lens[b].len)
            .sum();
        let (gathered, inflight) = (&self.gathered, &self.inflight);
        let start = self.led.recorded_prefetch(
            |b| gathered[b].is_some() || inflight[b].is_some(),
            flying,
            held,
        );
        self.start_prefetches(start)
    }

    /// Start all-gathering `start`'s buckets on the proxy thread (each with the elements it
    /// holds in flight).
    fn start_prefetches(&mut self, start: Vec<(usize, usize)>) -> Result<(), ZeroError> {
        for (b, held) in start {
            // The proxy thread owns what it gathers from: a copy of the shard, queued before.
            let staged = self.staged_shard(b)?;
            let shard = staged.as_ref().unwrap_or(&self.params[b]);
            let copy = self.shards.take(self.comm.stream(), shard.elems, false)?;
            // SAFETY: both hold the shard's elements of `T`; the all-gather that reads the copy
            // is queued after it on the same stream.
            let copied = unsafe {
                self.stream()
                    .copy(copy.addr, shard.addr, shard.elems * T::DTYPE.size())
            }
            .map_err(dev("copying a shard to prefetch".into()));
            // A shard read from NVMe is copied before its buffer is kept for the next.
            let copied = copied.and_then(|()| match staged {
                Some(_) => self.sync("copying a shard read from NVMe"),
                None => Ok(()),
            });
            self.done_with_shard(staged);
            copied?;
            let len = self.led.part.buckets[b].len;
            let full = self.buckets.take(self.comm.stream(), len, false)?;
            self.inflight[b] = Some((self.comm.all_gather_async(copy, full), held));
            self.gathered_elems += len as u64;
        }
        Ok(())
    }

    /// Stage 3: gather `names` so they can be read: the buckets holding them are all-gathered
    /// unless gathered already for another live parameter (or a persistent one), and the
    /// buckets next in the order the last step gathered in are prefetched. A no-op in stages
    /// 0–2. Gathering a parameter already gathered is an error, and nothing is gathered then.
    pub fn gather(&mut self, names: &[&str]) -> Result<(), ZeroError> {
        let gathered = &self.gathered;
        let Some(buckets) = self.led.mark_gathered(names, |b| gathered[b].is_some())? else {
            return Ok(());
        };
        let t0 = Instant::now();
        let out = self.gather_buckets(&buckets);
        self.wait.gather += t0.elapsed();
        out?;
        self.prefetch_recorded()
    }

    /// All-gather `buckets` (or take their prefetches).
    pub(super) fn gather_buckets(&mut self, buckets: &[usize]) -> Result<(), ZeroError> {
        for &b in buckets {
            let full = match self.inflight[b].take() {
                Some((w, _)) => {
                    let (copy, full) = w.wait()?;
                    self.shards.give(copy);
                    full
                }
                None => {
                    let len = self.led.part.buckets[b].len;
                    let mut full = self.buckets.take(self.comm.stream(), len, false)?;
                    let staged = self.staged_shard(b)?;
                    let shard = staged.as_ref().unwrap_or(&self.params[b]);
                    let r = self.comm.all_gather(shard, &mut full);
                    self.done_with_shard(staged);
                    r?;
                    self.gathered_elems += len as u64;
                    full
                }
            };
            self.gathered[b] = Some(full);
        }
        Ok(())
    }

    /// Stage 3, after the parameters changed (an optimizer step, a loaded checkpoint): gather
    /// again the buckets that persistent parameters keep gathered.
    pub(super) fn refresh_pinned(&mut self) -> Result<(), ZeroError> {
        for b in 0..self.gathered.len() {
            if !self.led.live.pins(&self.led.part, b) {
                continue;
            }
            if let Some(mut full) = self.gathered[b].take() {
                let staged = self.staged_shard(b)?;
                let shard = staged.as_ref().unwrap_or(&self.params[b]);
                let r = self.comm.all_gather(shard, &mut full);
                self.done_with_shard(staged);
                self.gathered_elems += full.elems as u64;
                self.gathered[b] = Some(full);
                r?;
            }
        }
        Ok(())
    }

    /// Stage 3: forget the order of this step's gathers so far, so the next step follows (and
    /// records) the training loop's order from its start: for gathers outside it, such as
    /// reading every parameter once after construction or a checkpoint, which would otherwise
    /// become the record the next step is compared with (losing that step's prefetch and
    /// reuse). Drops the buckets kept for a reuse. A no-op in stages 0–2.
    pub fn restart_order(&mut self) {
        if self.led.cfg.stage != 3 {
            return;
        }
        let kept = self.led.live.restart_step();
        self.drop_gathered(kept);
    }

    /// Give back the gathered buckets `buckets` (those not gathered are skipped).
    pub(super) fn drop_gathered(&mut self, buckets: Vec<usize>) {
        for b in buckets {
            if let Some(full) = self.gathered[b].take() {
                self.buckets.give(full);
            }
        }
    }

    /// Stage 3: release `names` (work reading them must have completed); a bucket is dropped
    /// once none of its parameters is gathered and none is persistent. A no-op in stages 0–2.
    /// Releasing a parameter not gathered is an error, and nothing is released then.
    pub fn release(&mut self, names: &[&str]) -> Result<(), ZeroError> {
        let Some(buckets) = self.led.mark_released(names)? else {
            return Ok(());
        };
        self.sync("releasing gathered parameters")?;
        self.drop_gathered(buckets);
        Ok(())
    }
}
