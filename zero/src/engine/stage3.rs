//! Stage 3's parameters: gathered on demand ([`Engine::gather`]), prefetched in the background
//! ([`Engine::prefetch`]), released after use ([`Engine::release`]). No-ops in stages 0–2.

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
        for (b, held) in start {
            // The proxy thread owns what it gathers from: a copy of the shard, queued before.
            let shard = &self.params[b];
            let copy = self.shards.take(self.comm.stream(), shard.elems, false)?;
            // SAFETY: both hold the shard's elements of `T`; the all-gather that reads the copy
            // is queued after it on the same stream.
            unsafe {
                self.stream()
                    .copy(copy.addr, shard.addr, shard.elems * T::DTYPE.size())
            }
            .map_err(dev("copying a shard to prefetch".into()))?;
            let len = self.led.part.buckets[b].len;
            let full = self.buckets.take(self.comm.stream(), len, false)?;
            self.inflight[b] = Some((self.comm.all_gather_async(copy, full), held));
        }
        Ok(())
    }

    /// Stage 3: all-gather the buckets holding `names` so they can be read. A no-op in stages
    /// 0–2. Gathering something already gathered is an error, and nothing is gathered then.
    pub fn gather(&mut self, names: &[&str]) -> Result<(), ZeroError> {
        let gathered = &self.gathered;
        let Some(buckets) = self.led.to_gather(names, |b| gathered[b].is_some())? else {
            return Ok(());
        };
        let t0 = Instant::now();
        let out = self.gather_buckets(&buckets);
        self.wait.gather += t0.elapsed();
        out
    }

    /// All-gather `buckets` (or take their prefetches).
    fn gather_buckets(&mut self, buckets: &[usize]) -> Result<(), ZeroError> {
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
                    self.comm.all_gather(&self.params[b], &mut full)?;
                    full
                }
            };
            self.gathered[b] = Some(full);
        }
        Ok(())
    }

    /// Stage 3: drop the gathered buckets holding `names` (work reading them must have
    /// completed). A no-op in stages 0–2.
    pub fn release(&mut self, names: &[&str]) -> Result<(), ZeroError> {
        let gathered = &self.gathered;
        let Some(buckets) = self.led.to_release(names, |b| gathered[b].is_some())? else {
            return Ok(());
        };
        self.sync("releasing gathered parameters")?;
        for b in buckets {
            if let Some(full) = self.gathered[b].take() {
                self.buckets.give(full);
            }
        }
        Ok(())
    }
}
