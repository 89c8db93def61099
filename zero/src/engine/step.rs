//! A micro-step: gradients pushed into their buckets (stages 2–3: reduce-scattered as each
//! bucket fills), and at the accumulation boundary the reduction, the overflow and norm
//! agreement, AdamW on what this rank owns, and the all-gather of the updated parameters.

use std::time::Instant;

use ringzero_collectives::{
    Collectives, DeviceMemory, InPlace, NonBlocking, ReduceOp, StepAt, TrainStream,
};
use ringzero_kernels::cpu::Float;

use super::{alloc, alloc_bytes, dev, DevVec, Engine};
use crate::error::ZeroError;
use crate::ledger::clip_factor;
use crate::partition::Slot;
use crate::report::StepOutcome;

/// `overlap_comm`'s reduce-scatters in flight at most: one running on the proxy thread and
/// one queued behind it, as DeepSpeed double-buffers its reduction buckets. A bucket that fills
/// while both are in flight waits for the older one, so backward holds at most three buckets
/// and two shards whatever the model's size ([`crate::comm_peak`]).
pub(crate) const REDUCES_IN_FLIGHT: usize = 2;

impl<T: Float, S: TrainStream + 'static> Engine<T, S> {
    /// Add this micro-step's gradient of `name`, a device buffer of the parameter's length in
    /// `T` (already multiplied by [`Engine::loss_scale`] under fp16); returns once it has
    /// been added, so the buffer is free again. In stages 2–3 a bucket is reduce-scattered as
    /// soon as all its gradients are in.
    pub fn push_grad<B: DeviceMemory<S> + ?Sized>(
        &mut self,
        name: &str,
        grad: &B,
    ) -> Result<(), ZeroError> {
        self.add_grads("push_grad", [(name, grad)])
    }

    /// Add this micro-step's gradients of every parameter, in registration order (the
    /// `specs` given to the engine, or a safetensors file's order), each as
    /// [`Engine::push_grad`] takes it. The count, lengths and dtypes are checked before any is
    /// added: bad input changes nothing.
    pub fn push_grads<'a, B: DeviceMemory<S> + ?Sized + 'a>(
        &mut self,
        grads: impl IntoIterator<Item = &'a B>,
    ) -> Result<(), ZeroError> {
        let grads: Vec<&B> = grads.into_iter().collect();
        let specs = &self.led.part.specs;
        if grads.len() != specs.len() {
            return Err(ZeroError::NotNow {
                call: "push_grads",
                why: format!(
                    "{} gradients for {} parameters; give one per parameter, in registration \
                     order",
                    grads.len(),
                    specs.len()
                ),
            });
        }
        let names: Vec<String> = specs.iter().map(|s| s.name.clone()).collect();
        self.add_grads("push_grads", names.iter().map(String::as_str).zip(grads))
    }

    /// Add this micro-step's gradients of the named parameters, in any order (a trainer's
    /// backward order), each as [`Engine::push_grad`] takes it, waiting for the additions once
    /// at the end rather than after each (a bucket that fills is reduced as it fills). Names,
    /// lengths and dtypes are checked before any is added, a name given twice included: bad
    /// input changes nothing. The buffers are free again when it returns.
    pub fn push_grads_by_name<'a, B: DeviceMemory<S> + ?Sized + 'a>(
        &mut self,
        grads: impl IntoIterator<Item = (&'a str, &'a B)>,
    ) -> Result<(), ZeroError> {
        self.add_grads("push_grads_by_name", grads)
    }

    /// [`Engine::push_grads_by_name`] for `call`.
    fn add_grads<'a, B: DeviceMemory<S> + ?Sized + 'a>(
        &mut self,
        call: &'static str,
        grads: impl IntoIterator<Item = (&'a str, &'a B)>,
    ) -> Result<(), ZeroError> {
        let grads: Vec<(&str, &B)> = grads.into_iter().collect();
        let mut seen = std::collections::HashSet::with_capacity(grads.len());
        let mut checked = Vec::with_capacity(grads.len());
        for &(name, g) in &grads {
            checked.push(self.check_grad(call, name, g)?);
            if !seen.insert(name) {
                return Err(ZeroError::NotNow {
                    call,
                    why: format!("the gradient of `{name}` is given twice; give each once"),
                });
            }
        }
        for ((name, g), (i, s)) in grads.into_iter().zip(checked) {
            let dst = self.grad_slot(s)?;
            let src = g.addr(self.stream());
            // SAFETY: `dst` is `s.len` elements of `T` inside the engine's bucket buffer, `src`
            // the caller's `s.len` elements (checked), borrowed until the sync below; an
            // in-place sum.
            unsafe {
                self.stream()
                    .combine(T::DTYPE, ReduceOp::Sum, dst, dst, src, s.len)
            }
            .map_err(dev(format!("adding the gradient of `{name}`")))?;
            self.pushed(i, s.bucket)?;
        }
        self.sync("adding gradients")
    }

    /// Check `grad` for parameter `name` (known, its length, not in yet, in `T`), naming `call`
    /// when its dtype is wrong: the parameter's index and slot.
    fn check_grad<B: DeviceMemory<S> + ?Sized>(
        &self,
        call: &'static str,
        name: &str,
        grad: &B,
    ) -> Result<(usize, Slot), ZeroError> {
        let found = self.led.check_push(name, grad.elems())?;
        if grad.dtype() != T::DTYPE {
            return Err(ZeroError::NotNow {
                call,
                why: format!(
                    "the gradient of `{name}` is {} but the engine's parameters are {}",
                    grad.dtype(),
                    T::DTYPE
                ),
            });
        }
        Ok(found)
    }

    /// Where the gradient of the parameter at `s` is summed this micro-step: its bucket's
    /// staging buffer (stages 2–3, taken when the bucket's first gradient comes) or its
    /// gradients (stages 0–1).
    pub(super) fn grad_slot(&mut self, s: Slot) -> Result<u64, ZeroError> {
        let b = s.bucket;
        if self.led.cfg.stage < 2 {
            return Ok(self.grads[b].at(s.offset));
        }
        if self.staging[b].is_none() {
            let blen = self.led.part.buckets[b].len;
            self.staging[b] = Some(self.buckets.take(self.comm.stream(), blen, true)?);
        }
        Ok(self.staging[b].as_ref().expect("taken above").at(s.offset))
    }

    /// Parameter `i`'s gradient is in (bucket `b`); in stages 2–3 a bucket whose gradients are
    /// all in is reduce-scattered now (on the proxy thread with `overlap_comm`).
    pub(super) fn pushed(&mut self, i: usize, b: usize) -> Result<(), ZeroError> {
        self.led.pushed[i] = true;
        if self.led.cfg.stage < 2 || !self.led.bucket_full(b) {
            return Ok(());
        }
        // The bucket's additions are done before anything reduces it.
        self.sync("adding a gradient")?;
        let blen = self.led.part.buckets[b].len;
        let full = self.staging[b].take().expect("filled above");
        // With as many reduce-scatters in flight as may be, the oldest ends first (and gives
        // back its shard for this one).
        while self.pending.len() >= REDUCES_IN_FLIGHT {
            let t0 = Instant::now();
            let r = self.finish_pending(false);
            self.wait.reduce += t0.elapsed();
            r?;
        }
        let mut shard = self
            .shards
            .take(self.comm.stream(), blen / self.led.part.world, false)?;
        if self.led.cfg.overlap_comm {
            let held = full.elems + shard.elems;
            let work = self.comm.reduce_scatter_async(full, shard, ReduceOp::Avg);
            self.pending.push_back((b, work, held));
            return Ok(());
        }
        let t0 = Instant::now();
        let r = self.comm.reduce_scatter(&full, &mut shard, ReduceOp::Avg);
        self.wait.reduce += t0.elapsed();
        r?;
        let last = self.led.micro + 1 == self.led.cfg.accumulation_steps;
        self.accumulate(b, &shard, last)?;
        self.buckets.give(full);
        self.shards.give(shard);
        Ok(())
    }

    /// Wait for the oldest reduce-scatter in flight and add its shard into its bucket's
    /// gradients (in the window's last micro-step, before the step itself, an offloaded bucket's
    /// sum leaves for the host now, as without `overlap_comm`); `at_step`: the micro-step has
    /// ended.
    fn finish_pending(&mut self, at_step: bool) -> Result<(), ZeroError> {
        let (b, w, _) = self
            .pending
            .pop_front()
            .expect("called with a reduce-scatter in flight");
        let (full, shard) = w.wait()?;
        let last = !at_step && self.led.micro + 1 == self.led.cfg.accumulation_steps;
        self.accumulate(b, &shard, last)?;
        self.buckets.give(full);
        self.shards.give(shard);
        Ok(())
    }

    /// Add a reduced gradient `shard` into bucket `b`'s owned gradients (waited for); in the
    /// window's `last` micro-step an offloaded bucket's sum also leaves for the host now.
    fn accumulate(&mut self, b: usize, shard: &DevVec, last: bool) -> Result<(), ZeroError> {
        let g = self.grads[b].addr;
        // SAFETY: `grads[b]` and `shard` both hold the owned range's elements of `T`.
        unsafe {
            self.stream()
                .combine(T::DTYPE, ReduceOp::Sum, g, g, shard.addr, shard.elems)
        }
        .map_err(dev("accumulating a reduced gradient shard".into()))?;
        if last {
            self.copy_out_early(b)?;
        }
        self.sync("accumulating a reduced gradient shard")
    }

    /// End a micro-step; at the accumulation boundary, reduce gradients, check for overflow,
    /// clip, run the optimizer on what this rank owns and share the result. An optimizer step
    /// (taken or skipped) leaves its [`Engine::report`], which `wall_clock_breakdown` logs. In
    /// fp16, an overflow with the loss scale already at `min_loss_scale` and no hysteresis left
    /// is [`ZeroError::LossScaleAtMinimum`] on every rank, as DeepSpeed stops there.
    pub fn step(&mut self) -> Result<StepOutcome, ZeroError> {
        let t0 = Instant::now();
        self.timer.micro_step(t0);
        let outcome = self.micro_step();
        self.timer.stepped(t0.elapsed());
        let outcome = outcome?;
        if !matches!(outcome, StepOutcome::Accumulated) {
            let counters = (self.wait, self.gathered_elems);
            let step = self.led.t + self.led.skipped;
            let mut r = self.timer.finish(step, counters, Instant::now());
            r.offload = std::mem::take(&mut self.tier.stats);
            if self.led.cfg.wall_clock_breakdown && self.led.rank == 0 {
                tracing::info!(target: "ringzero::zero", "{r}");
            }
            self.last_report = Some(r);
        }
        Ok(outcome)
    }

    /// [`Engine::step`]'s work.
    fn micro_step(&mut self) -> Result<StepOutcome, ZeroError> {
        let boundary = self.led.end_micro_step()?;
        let t0 = Instant::now();
        // Reduce-scatters still in flight belong to this micro-step (at the step itself the
        // offload pipeline fetches their gradients).
        while !self.pending.is_empty() {
            self.finish_pending(true)?;
        }
        if !boundary {
            self.wait.reduce += t0.elapsed();
            return Ok(StepOutcome::Accumulated);
        }
        self.led.micro = 0;
        // Prefetches of pre-step values would go stale: finish and drop them; so would buckets
        // kept for a reuse that did not come.
        for f in self.inflight.iter_mut() {
            if let Some((w, _)) = f.take() {
                let (copy, full) = w.wait()?;
                self.shards.give(copy);
                self.buckets.give(full);
            }
        }
        let kept = self.led.live.take_kept();
        self.drop_gathered(kept);
        // Stage 1: this rank's averaged gradient range per bucket (the others keep it in grads),
        // in the engine's kept buffers, lent to this step and kept again after it, whatever
        // happened (after a failure, work may still be queued on them: they are not freed).
        let mut red = std::mem::take(&mut self.reduced);
        let reduced = self.reduce_at_boundary(&mut red);
        if let Err(e) = reduced {
            self.reduced = red;
            return Err(e);
        }
        self.wait.reduce += t0.elapsed();
        let t1 = Instant::now();
        // The last step's delayed update lands before this one's update reads the state.
        let outcome = self
            .land_delayed()
            .and_then(|_| self.update(&red))
            .and_then(|o| self.finish_step(o));
        // The work reading `red` and the early copies ends before they are used again.
        let synced = self.sync("the optimizer step");
        self.reduced = red;
        if synced.is_ok() {
            // Gradient copies a skipped step left unread go back for the next window (never
            // read there: each is made afresh in the window's last micro-step).
            for v in self.tier.early.iter_mut().filter_map(Option::take) {
                self.tier.early_bufs.give(v);
            }
        }
        self.wait.update += t1.elapsed();
        let outcome = outcome?;
        synced?;
        Ok(outcome)
    }

    /// The boundary's reductions: stage 0 all-reduces every bucket's gradients in place, stage
    /// 1 reduce-scatters each into its kept range in `red` (made at the first step); under
    /// hybrid sharding the result is then averaged over the replicas.
    fn reduce_at_boundary(&mut self, red: &mut [Option<DevVec>]) -> Result<(), ZeroError> {
        let (stage, n) = (self.led.cfg.stage, self.led.part.world);
        for (b, r) in red.iter_mut().enumerate() {
            match stage {
                0 => self
                    .comm
                    .all_reduce(InPlace, &mut self.grads[b], ReduceOp::Avg)?,
                1 => {
                    if r.is_none() {
                        let len = self.led.part.buckets[b].len / n;
                        *r = Some(alloc(self.comm.stream(), T::DTYPE, len)?);
                        self.comm_meter.add(alloc_bytes(T::DTYPE, len));
                    }
                    let shard = r.as_mut().expect("made above");
                    self.comm
                        .reduce_scatter(&self.grads[b], shard, ReduceOp::Avg)?;
                }
                _ => {}
            }
        }
        if let Some(rep) = &self.replicas {
            // Hybrid sharding: the shard group's average, averaged over the replicas (every
            // replica ends bit-identical, so each computes the same norm and update below).
            let reduced: Vec<&mut DevVec> = if stage == 1 {
                red.iter_mut().flatten().collect()
            } else {
                self.grads.iter_mut().collect()
            };
            for g in reduced {
                rep.all_reduce(InPlace, g, ReduceOp::Avg)?;
            }
        }
        Ok(())
    }

    /// Clear the gradients and (stages 1–2, after an optimizer step) all-gather the updated
    /// parameters.
    fn finish_step(&mut self, outcome: StepOutcome) -> Result<StepOutcome, ZeroError> {
        for g in &self.grads {
            // SAFETY: the engine's gradient buffer of `elems` elements of `T`.
            unsafe { self.stream().zero(g.addr, g.elems * T::DTYPE.size()) }
                .map_err(dev("clearing the gradients".into()))?;
        }
        let stage = self.led.cfg.stage;
        // A delayed update shares its parameters when it lands.
        if matches!(outcome, StepOutcome::Stepped { .. }) && self.tier.delayed.is_none() {
            match stage {
                1 | 2 => self.gather_updated()?,
                3 => self.refresh_pinned()?,
                _ => {}
            }
        }
        Ok(outcome)
    }

    /// Stages 1–2: all-gather the updated parameters of every bucket the offload pipeline has
    /// not gathered already (it gathers while the CPU steps; [`Engine::share_updated`]).
    pub(super) fn gather_updated(&mut self) -> Result<(), ZeroError> {
        let t0 = Instant::now();
        let rest: Vec<usize> = (0..self.params.len())
            .filter(|&b| !std::mem::take(&mut self.tier.gathered[b]))
            .collect();
        let out = self.share_updated(&rest);
        self.wait.share += t0.elapsed();
        out
    }

    /// Stages 1–2: all-gather `buckets`' updated parameters, in pieces of at most
    /// `allgather_elems` elements per call (each rank's piece copied out of its owned range, the
    /// gathered pieces copied back to every rank's range).
    pub(super) fn share_updated(&mut self, buckets: &[usize]) -> Result<(), ZeroError> {
        let (n, rank) = (self.led.part.world, self.led.rank);
        let piece = (self.led.cfg.allgather_elems / n).max(1);
        let sz = T::DTYPE.size();
        for &b in buckets {
            let shard = self.led.part.buckets[b].len / n;
            if shard <= piece {
                self.comm.all_gather(InPlace, &mut self.params[b])?;
                continue;
            }
            let own = self.led.part.owned(b, rank);
            let mut send = self.shards.take(self.comm.stream(), piece, false)?;
            let mut recv = self.buckets.take(self.comm.stream(), piece * n, false)?;
            let mut start = 0;
            let out = (|| {
                while start < shard {
                    let len = piece.min(shard - start);
                    (send.elems, recv.elems) = (len, len * n);
                    let p = &self.params[b];
                    let s = self.comm.stream();
                    // SAFETY: `len` elements of `T` of the owned range into the piece buffer
                    // (capacity ≥ piece ≥ len); the all-gather below is queued after it.
                    unsafe { s.copy(send.addr, p.at(own.start + start), len * sz) }
                        .map_err(dev("copying a piece to all-gather".into()))?;
                    self.comm.all_gather(&send, &mut recv)?;
                    for r in 0..n {
                        // SAFETY: rank r's `len` gathered elements into its range of the bucket
                        // (r·shard + start + len ≤ the bucket's length).
                        unsafe { s.copy(p.at(r * shard + start), recv.at(r * len), len * sz) }
                            .map_err(dev("copying a gathered piece back".into()))?;
                    }
                    start += len;
                }
                self.sync("all-gathering the updated parameters")
            })();
            // The pieces' work ended (or the stream failed and nothing reuses them).
            self.shards.give(send);
            self.buckets.give(recv);
            out?;
        }
        Ok(())
    }

    /// One value all-reduced over the ranks (`op`), through a one-element device buffer.
    pub(super) fn all_reduce_scalar<E: ringzero_kernels::Element>(
        &mut self,
        x: E,
        op: ReduceOp,
    ) -> Result<E, ZeroError> {
        self.all_reduce_scalar_over(false, x, op)
    }

    /// [`Engine::all_reduce_scalar`] over the shard group's ranks, or with `replicas` over this
    /// rank's replicas (hybrid sharding; the shard group without).
    pub(super) fn all_reduce_scalar_over<E: ringzero_kernels::Element>(
        &mut self,
        replicas: bool,
        x: E,
        op: ReduceOp,
    ) -> Result<E, ZeroError> {
        // The kept 8-byte buffer, as one `E` (at most 8 bytes: f64 or u8 here).
        assert!(E::DTYPE.size() <= 8);
        let mut buf = self
            .scalar
            .take()
            .expect("the scalar buffer is put back after each use");
        buf.dtype = E::DTYPE;
        let r = (|| {
            // SAFETY: `buf` holds 8 bytes and no queued work uses it (each use ends in a read,
            // which waits for the stream).
            unsafe { self.stream().write(buf.addr, bytemuck::bytes_of(&x)) }
                .map_err(dev("uploading a scalar".into()))?;
            let comm = match (&self.replicas, replicas) {
                (Some(r), true) => r,
                _ => &self.comm,
            };
            comm.all_reduce(InPlace, &mut buf, op)?;
            let mut out = E::zeroed();
            // SAFETY: `buf` holds one `E`.
            unsafe {
                self.stream()
                    .read(bytemuck::bytes_of_mut(&mut out), buf.addr)
            }
            .map_err(dev("reading a scalar".into()))?;
            Ok(out)
        })();
        self.scalar = Some(buf);
        r
    }

    /// The optimizer half of a boundary step, on reduced gradients (stage 1: `red`).
    fn update(&mut self, red: &[Option<DevVec>]) -> Result<StepOutcome, ZeroError> {
        let (stage, rank) = (self.led.cfg.stage, self.led.rank);
        let nb = self.led.part.buckets.len();
        // This rank's averaged gradient range of each bucket: (address, elements).
        let src: Vec<(u64, usize)> = (0..nb)
            .map(|b| match (stage, &red[b]) {
                (1, Some(r)) => (r.addr, r.elems),
                (0, _) => {
                    let o = self.led.part.owned(b, rank);
                    (self.grads[b].at(o.start), o.len())
                }
                _ => (self.grads[b].addr, self.grads[b].elems),
            })
            .collect();
        let s = self.comm.stream();
        let mut local_overflow = false;
        if self.led.scaler.checks_overflow() {
            for &(a, len) in &src {
                // SAFETY: `len` elements of `T` of the engine's buffers at `a`.
                let ok = unsafe { s.all_finite(T::DTYPE, a, len) }
                    .map_err(dev("checking the gradients for overflow".into()))?;
                local_overflow |= !ok;
            }
        }
        let inv = 1.0 / (self.led.scaler.scale() * self.led.cfg.accumulation_steps as f32);
        let mut sq = 0f64;
        for &(a, len) in &src {
            // SAFETY: as above.
            sq += unsafe { s.sq_norm(T::DTYPE, a, len, inv) }
                .map_err(dev("the gradients' squared norm".into()))?;
        }
        if self.led.scaler.checks_overflow()
            && self.all_reduce_scalar(local_overflow as u8, ReduceOp::Max)? != 0
        {
            return self.led.skip();
        }
        let grad_norm = self.all_reduce_scalar(sq, ReduceOp::Sum)?.sqrt();
        if !grad_norm.is_finite() {
            return self.led.skip();
        }
        let clip = clip_factor(self.led.cfg.clip_norm, grad_norm);
        self.led.t += 1;
        let h = self.led.hyper(self.led.t);
        for (b, red) in red.iter().enumerate() {
            if self.tier.offloaded(b) {
                continue;
            }
            // The stretch of `params[b]` this rank updates, and where it starts in the bucket.
            let (range, from) = match stage {
                0 => (0..self.params[b].elems, 0),
                3 => (0..self.params[b].elems, self.led.part.owned(b, rank).start),
                _ => {
                    let o = self.led.part.owned(b, rank);
                    (o.clone(), o.start)
                }
            };
            let p = self.params[b].at(range.start);
            let grads = match red {
                Some(r) => r.addr,
                None => self.grads[b].addr,
            };
            let (es, f32s) = (T::DTYPE.size() as u64, 4u64);
            for (off, len, hh) in self.led.update_segments(b, from, range.len(), &h) {
                let o = off as u64;
                let at = StepAt {
                    master: self.master[b]
                        .as_ref()
                        .map_or(p + o * es, |x| x.addr + o * f32s),
                    params: self.master[b].as_ref().map(|_| p + o * es),
                    grads: grads + o * es,
                    s1: self.states[b].first().map_or(0, |x| x.addr + o * f32s),
                    s2: self.states[b].get(1).map_or(0, |x| x.addr + o * f32s),
                };
                // SAFETY: every range holds `len` elements of its type in the engine's buffers
                // (a segment of the update range's master and the states the rule keeps, the
                // others not read, of the reduced gradient
                // range and of the parameters' stretch: `off + len` is within the range),
                // apart from each other (an f32 master is the parameters).
                unsafe {
                    self.stream()
                        .optim_step(&hh, self.led.t, T::DTYPE, at, len, inv * clip)
                }
                .map_err(dev(format!("the {} step", hh.name())))?;
            }
        }
        self.offload_update(red, &h, self.led.t, inv * clip)?;
        // A good step cannot fail: only an overflow can find the scale at its minimum.
        let _ = self.led.scaler.update(false);
        Ok(StepOutcome::Stepped { grad_norm })
    }
}
