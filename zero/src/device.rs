//! [`DeviceEngine`]: the ZeRO engine with parameters, gradients and optimizer state in device
//! memory, communicating through a [`DeviceComm`] — a trainer on GPUs keeps everything on the
//! GPU (`DeviceComm<Arc<Gpu>>`), and `DeviceComm<HostStream>` runs the same code on the host
//! (how CI tests it).
//!
//! It follows [`crate::Engine`] step for step — the same partition, the same collectives in the
//! same order, the optimizer's kernels on the same ranges ([`TrainStream`]) — so on the host
//! stream it ends bit-identical to the host engine, every stage and precision (tested). On a GPU
//! the kernels compute the same bits, except the squared norm (summed in a tree), so with
//! gradient clipping the parameters may differ from the host engine's in the last bit.
//!
//! With `overlap_comm` a full bucket's reduce-scatter, and with `stage3_prefetch_bucket_size` a
//! prefetched bucket's all-gather, run on the communicator's proxy thread while the trainer goes
//! on. Checkpoints are the host engine's format (either engine loads the other's), and hybrid
//! sharding runs over two device communicators ([`DeviceEngine::new_hybrid`]). What it does not
//! do (yet): the `allgather_bucket_size` pieces (each bucket is all-gathered in one call).

use std::marker::PhantomData;
use std::time::Instant;

use ringzero_collectives::{AdamAt, DType, DeviceComm, DeviceMemory, Error, ReduceOp, TrainStream};
use ringzero_kernels::cpu::{cast, Float};
use ringzero_kernels::DeviceError;

use crate::config::ZeroConfig;
use crate::error::ZeroError;
use crate::ledger::{clip_factor, hybrid, layout, update_range, Ledger};
use crate::partition::{ParamSpec, Partition};
use crate::report::{Memory, StepOutcome};

mod buffers;
mod persist;

use buffers::{all_gather_host, alloc, dev, DevVec, InFlight, Spares};

/// The ZeRO engine on one rank, its model states in device memory (see the module docs); the
/// API of [`crate::Engine`], with device buffers where that takes host slices.
pub struct DeviceEngine<'c, S: TrainStream + 'static, T: Float = f32> {
    comm: &'c DeviceComm<S>,
    /// Hybrid sharding: the ranks that hold the same shard in the other shard groups.
    replicas: Option<&'c DeviceComm<S>>,
    /// The layout, the configuration and the step's bookkeeping.
    led: Ledger,
    /// Per bucket: the whole bucket (stages 0–2) or this rank's shard (stage 3), in `T`.
    params: Vec<DevVec>,
    /// fp32 master weights (16-bit `T` only): the range this rank updates.
    master: Vec<Option<DevVec>>,
    /// Stage 3: whole buckets gathered for compute.
    gathered: Vec<Option<DevVec>>,
    /// Stage 3: prefetches in flight (a copy of the shard, the whole bucket).
    inflight: InFlight,
    /// Per bucket: the whole bucket (stages 0–1) or this rank's shard (stages 2–3), in `T`.
    grads: Vec<DevVec>,
    /// Stages 2–3: a bucket's gradients while backward fills it.
    staging: Vec<Option<DevVec>>,
    /// Stages 2–3 with `overlap_comm`: reduce-scatters in flight (the bucket, the shard).
    pending: InFlight,
    m: Vec<DevVec>,
    v: Vec<DevVec>,
    /// Kept bucket-sized buffers (staging, gathered buckets) and shard-sized ones (reduced
    /// shards, prefetch copies).
    buckets: Spares,
    shards: Spares,
    /// A small buffer for the one-element all-reduces (the norm, the overflow flag).
    scalar: Option<DevVec>,
    _t: PhantomData<T>,
}

impl<'c, S: TrainStream + 'static, T: Float> DeviceEngine<'c, S, T> {
    /// An engine for `specs` on `comm`, every parameter element initialised by `init(param index,
    /// element index)` (the same function on every rank), as [`crate::Engine::new`].
    pub fn new(
        comm: &'c DeviceComm<S>,
        specs: &[ParamSpec],
        init: &dyn Fn(usize, usize) -> f32,
        cfg: ZeroConfig,
    ) -> Result<DeviceEngine<'c, S, T>, ZeroError> {
        if let Some(s) = cfg.shard_size.filter(|&s| s != comm.size()) {
            return Err(ZeroError::Config(format!(
                "the config shards over groups of {s} ranks (mics_shard_size) but \
                 DeviceEngine::new shards over all {} ranks of its communicator: build device \
                 communicators on ringzero_zero::hybrid_groups' two and the engine with \
                 DeviceEngine::new_hybrid",
                comm.size()
            )));
        }
        Self::build(comm, None, specs, init, cfg)
    }

    /// Hybrid sharding, as [`crate::Engine::new_hybrid`]: model states sharded over `shard`
    /// and replicated over `replicas` (device communicators on the two that
    /// [`crate::hybrid_groups`] splits off), gradients averaged over `replicas` once per
    /// optimizer step. Every rank of `replicas` must hold the same shard (checked; every rank
    /// fails alike if not).
    pub fn new_hybrid(
        shard: &'c DeviceComm<S>,
        replicas: &'c DeviceComm<S>,
        specs: &[ParamSpec],
        init: &dyn Fn(usize, usize) -> f32,
        cfg: ZeroConfig,
    ) -> Result<DeviceEngine<'c, S, T>, ZeroError> {
        hybrid::shard_size_matches(&cfg, shard.size())?;
        let mine = hybrid::record(shard.rank(), shard.size());
        let all = all_gather_host(replicas, &mine)?;
        let odd = hybrid::disagreement(mine, &all, replicas.rank());
        // Every shard group learns whether any of its ranks' replica groups disagreed.
        let bad = all_gather_host(shard, &[u8::from(odd.is_some())])?;
        hybrid::verdict(odd, bad.into_iter().max().unwrap_or(0))?;
        Self::build(shard, Some(replicas), specs, init, cfg)
    }

    fn build(
        comm: &'c DeviceComm<S>,
        replicas: Option<&'c DeviceComm<S>>,
        specs: &[ParamSpec],
        init: &dyn Fn(usize, usize) -> f32,
        cfg: ZeroConfig,
    ) -> Result<DeviceEngine<'c, S, T>, ZeroError> {
        let (n, rank) = (comm.size(), comm.rank());
        let world = n * replicas.as_ref().map_or(1, |r| r.size());
        let (part, full) = layout::<T>(&cfg, specs, init, n, world)?;
        let stage = cfg.stage;
        let nb = part.buckets.len();
        let upd = |b: usize| update_range(&part, stage, rank, b);
        let s = comm.stream();
        let alloc = |dtype: DType, elems: usize| alloc(s, dtype, elems);
        let upload = |x: &[f32], as_t: bool| -> Result<DevVec, ZeroError> {
            let (d, bytes) = if as_t {
                let mut out = vec![T::default(); x.len()];
                cast(x, &mut out);
                (T::DTYPE, bytemuck::cast_slice::<T, u8>(&out).to_vec())
            } else {
                (DType::F32, bytemuck::cast_slice::<f32, u8>(x).to_vec())
            };
            let v = alloc(d, x.len())?;
            // SAFETY: `v` is a fresh allocation of the stream of `x.len()` elements of `d`,
            // which no work uses yet.
            unsafe { s.write(v.addr, &bytes) }
                .map_err(dev("uploading the initial values".into()))?;
            Ok(v)
        };
        let mut params = Vec::with_capacity(nb);
        let mut master = Vec::with_capacity(nb);
        let (mut grads, mut m, mut v) = (Vec::new(), Vec::new(), Vec::new());
        for (b, bucket) in full.iter().enumerate() {
            params.push(if stage == 3 {
                upload(&bucket[part.owned(b, rank)], true)?
            } else {
                upload(bucket, true)?
            });
            master.push(if T::IS_F32 {
                None
            } else {
                Some(upload(&bucket[upd(b)], false)?)
            });
            let g = if stage >= 2 {
                part.owned(b, rank).len()
            } else {
                part.buckets[b].len
            };
            grads.push(alloc(T::DTYPE, g)?);
            m.push(alloc(DType::F32, upd(b).len())?);
            v.push(alloc(DType::F32, upd(b).len())?);
        }
        let cap = part.buckets.iter().map(|b| b.len).max().unwrap_or(0);
        // Two bucket buffers in steady state (one filling while one reduces, or a gathered
        // bucket and a prefetched one); a reduced shard per bucket (stage 1 keeps them all
        // through the step).
        let buckets = Spares::new(T::DTYPE, cap, 2);
        let shards = Spares::new(T::DTYPE, cap / n, nb + 1);
        let scalar = Some(alloc(DType::F64, 1)?);
        Ok(DeviceEngine {
            buckets,
            shards,
            scalar,
            params,
            master,
            gathered: (0..nb).map(|_| None).collect(),
            inflight: (0..nb).map(|_| None).collect(),
            grads,
            staging: (0..nb).map(|_| None).collect(),
            pending: (0..nb).map(|_| None).collect(),
            m,
            v,
            led: Ledger::new(part, cfg, rank),
            comm,
            replicas,
            _t: PhantomData,
        })
    }

    /// The layout.
    pub fn partition(&self) -> &Partition {
        &self.led.part
    }

    /// The configuration.
    pub fn config(&self) -> &ZeroConfig {
        &self.led.cfg
    }

    /// The stream the engine's work runs on: the device its gradients ([`Self::push_grad`])
    /// must be made on, while the engine holds the communicator.
    pub fn stream(&self) -> &S {
        self.comm.stream()
    }

    /// Optimizer steps taken (skipped ones not counted).
    pub fn steps(&self) -> u64 {
        self.led.t
    }

    /// Optimizer steps skipped on overflow.
    pub fn skipped_steps(&self) -> u64 {
        self.led.skipped
    }

    /// The factor to multiply the loss by before backward (1 unless fp16).
    pub fn loss_scale(&self) -> f32 {
        self.led.scaler.scale()
    }

    /// Where parameter `name`'s current values (`T`, its element count) are in device memory,
    /// for the trainer's kernels: valid until the next [`DeviceEngine::step`] (stage 3: until
    /// [`DeviceEngine::release`], and only while gathered). Work reading it must have completed
    /// before either.
    pub fn param_addr(&self, name: &str) -> Result<(u64, usize), ZeroError> {
        let s = self.led.part.slots[self.led.index(name)?];
        let bucket = if self.led.cfg.stage == 3 {
            self.gathered[s.bucket]
                .as_ref()
                .ok_or_else(|| ZeroError::NotGathered(name.to_string()))?
        } else {
            &self.params[s.bucket]
        };
        Ok((bucket.at(s.offset), s.len))
    }

    /// Parameter `name`'s current values, copied to the host and widened to `f32` (stage 3:
    /// only while gathered).
    pub fn param_to_host(&self, name: &str) -> Result<Vec<f32>, ZeroError> {
        let (addr, len) = self.param_addr(name)?;
        let mut raw = vec![T::default(); len];
        // SAFETY: `addr` holds `len` elements of `T` of the stream's memory (param_addr).
        unsafe { self.stream().read(bytemuck::cast_slice_mut(&mut raw), addr) }
            .map_err(dev(format!("reading parameter `{name}`")))?;
        let mut out = vec![0f32; len];
        cast(&raw, &mut out);
        Ok(out)
    }

    /// Wait for the work queued on the stream (before temporaries it uses are dropped, or a
    /// caller's buffer is let go).
    fn sync(&self, what: &str) -> Result<(), ZeroError> {
        let s = self.stream();
        let m = s.mark().map_err(dev(what.into()))?;
        let (start, deadline) = (Instant::now(), self.comm.timeout());
        while !s.done(&m).map_err(dev(what.into()))? {
            if start.elapsed() >= deadline && s.memory_outlives_work() {
                return Err(ZeroError::Comm(Error::Device {
                    context: what.into(),
                    source: DeviceError::Invalid(format!(
                        "{}'s work did not complete within {:.1}s",
                        s.name(),
                        deadline.as_secs_f64()
                    )),
                }));
            }
            std::thread::yield_now();
        }
        Ok(())
    }

    /// Stage 3: start all-gathering the buckets holding `names` on the proxy thread, so a later
    /// [`DeviceEngine::gather`] finds them ready; at most `prefetch_elems` elements are in flight
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
        for b in buckets {
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

    /// Add this micro-step's gradient of `name`, a device buffer of the parameter's length in
    /// `T` (already multiplied by [`DeviceEngine::loss_scale`] under fp16); returns once it has
    /// been added, so the buffer is free again. In stages 2–3 a bucket is reduce-scattered as
    /// soon as all its gradients are in.
    pub fn push_grad<B: DeviceMemory<S> + ?Sized>(
        &mut self,
        name: &str,
        grad: &B,
    ) -> Result<(), ZeroError> {
        let (i, s) = self.led.check_push(name, grad.elems())?;
        if grad.dtype() != T::DTYPE {
            return Err(ZeroError::NotNow {
                call: "push_grad",
                why: format!(
                    "the gradient of `{name}` is {} but the engine's parameters are {}",
                    grad.dtype(),
                    T::DTYPE
                ),
            });
        }
        let b = s.bucket;
        let blen = self.led.part.buckets[b].len;
        if self.led.cfg.stage >= 2 && self.staging[b].is_none() {
            self.staging[b] = Some(self.buckets.take(self.comm.stream(), blen, true)?);
        }
        let dst = match &self.staging[b] {
            Some(full) if self.led.cfg.stage >= 2 => full.at(s.offset),
            _ => self.grads[b].at(s.offset),
        };
        let src = grad.addr(self.stream());
        // SAFETY: `dst` is `s.len` elements of `T` inside the engine's bucket buffer, `src` the
        // caller's `s.len` elements (checked), borrowed until the sync below; an in-place sum.
        unsafe {
            self.stream()
                .combine(T::DTYPE, ReduceOp::Sum, dst, dst, src, s.len)
        }
        .map_err(dev(format!("adding the gradient of `{name}`")))?;
        self.sync("adding a gradient")?;
        self.led.pushed[i] = true;
        if self.led.cfg.stage >= 2 && self.led.bucket_full(b) {
            let full = self.staging[b].take().expect("filled above");
            let mut shard =
                self.shards
                    .take(self.comm.stream(), blen / self.led.part.world, false)?;
            if self.led.cfg.overlap_comm {
                let held = full.elems + shard.elems;
                self.pending[b] = Some((
                    self.comm.reduce_scatter_async(full, shard, ReduceOp::Avg),
                    held,
                ));
            } else {
                self.comm.reduce_scatter(&full, &mut shard, ReduceOp::Avg)?;
                self.accumulate(b, &shard)?;
                self.buckets.give(full);
                self.shards.give(shard);
            }
        }
        Ok(())
    }

    /// Add a reduced gradient `shard` into bucket `b`'s owned gradients (waited for).
    fn accumulate(&self, b: usize, shard: &DevVec) -> Result<(), ZeroError> {
        let g = self.grads[b].addr;
        // SAFETY: `grads[b]` and `shard` both hold the owned range's elements of `T`.
        unsafe {
            self.stream()
                .combine(T::DTYPE, ReduceOp::Sum, g, g, shard.addr, shard.elems)
        }
        .map_err(dev("accumulating a reduced gradient shard".into()))?;
        self.sync("accumulating a reduced gradient shard")
    }

    /// End a micro-step; at the accumulation boundary, reduce gradients, check for overflow,
    /// clip, run AdamW on what this rank owns and share the result (as [`crate::Engine::step`]).
    pub fn step(&mut self) -> Result<StepOutcome, ZeroError> {
        let gathered = &self.gathered;
        let boundary = self.led.end_micro_step(|b| gathered[b].is_some())?;
        // Reduce-scatters still in flight belong to this micro-step.
        for b in 0..self.pending.len() {
            if let Some((w, _)) = self.pending[b].take() {
                let (full, shard) = w.wait()?;
                self.accumulate(b, &shard)?;
                self.buckets.give(full);
                self.shards.give(shard);
            }
        }
        if !boundary {
            return Ok(StepOutcome::Accumulated);
        }
        self.led.micro = 0;
        // Prefetches of pre-step values would go stale: finish and drop them.
        for f in self.inflight.iter_mut() {
            if let Some((w, _)) = f.take() {
                let (copy, full) = w.wait()?;
                self.shards.give(copy);
                self.buckets.give(full);
            }
        }
        let (stage, n) = (self.led.cfg.stage, self.led.part.world);
        let nb = self.led.part.buckets.len();
        // Stage 1: this rank's averaged gradient range per bucket (the others keep it in grads).
        let mut red: Vec<Option<DevVec>> = (0..nb).map(|_| None).collect();
        for (b, r) in red.iter_mut().enumerate() {
            match stage {
                0 => self
                    .comm
                    .all_reduce_in_place(&mut self.grads[b], ReduceOp::Avg)?,
                1 => {
                    let len = self.led.part.buckets[b].len / n;
                    let mut shard = self.shards.take(self.comm.stream(), len, false)?;
                    self.comm
                        .reduce_scatter(&self.grads[b], &mut shard, ReduceOp::Avg)?;
                    *r = Some(shard);
                }
                _ => {}
            }
        }
        if let Some(rep) = self.replicas {
            // Hybrid sharding: the shard group's average, averaged over the replicas (every
            // replica ends bit-identical, so each computes the same norm and update below).
            let reduced: Vec<&mut DevVec> = if stage == 1 {
                red.iter_mut().flatten().collect()
            } else {
                self.grads.iter_mut().collect()
            };
            for g in reduced {
                rep.all_reduce_in_place(g, ReduceOp::Avg)?;
            }
        }
        let outcome = self.update(&red).and_then(|o| self.finish_step(o));
        // `red` goes back now: the work reading it ends first, whatever happened.
        let synced = self.sync("the optimizer step");
        if synced.is_ok() {
            red.into_iter().flatten().for_each(|r| self.shards.give(r));
        }
        let outcome = outcome?;
        synced?;
        Ok(outcome)
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
        if matches!(outcome, StepOutcome::Stepped { .. }) && (stage == 1 || stage == 2) {
            for p in &mut self.params {
                self.comm.all_gather_in_place(p)?;
            }
        }
        Ok(outcome)
    }

    /// One value all-reduced over the ranks (`op`), through a one-element device buffer.
    fn all_reduce_scalar<E: ringzero_kernels::Element>(
        &mut self,
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
            self.comm.all_reduce_in_place(&mut buf, op)?;
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
            return Ok(self.led.skip());
        }
        let grad_norm = self.all_reduce_scalar(sq, ReduceOp::Sum)?.sqrt();
        if !grad_norm.is_finite() {
            return Ok(self.led.skip());
        }
        let clip = clip_factor(self.led.cfg.clip_norm, grad_norm);
        self.led.t += 1;
        let h = self.led.cfg.adamw;
        for (b, red) in red.iter().enumerate() {
            // The stretch of `params[b]` this rank updates.
            let range = match stage {
                0 | 3 => 0..self.params[b].elems,
                _ => self.led.part.owned(b, rank),
            };
            let p = self.params[b].at(range.start);
            let grads = match red {
                Some(r) => r.addr,
                None => self.grads[b].addr,
            };
            let at = AdamAt {
                master: self.master[b].as_ref().map_or(p, |x| x.addr),
                params: self.master[b].as_ref().map(|_| p),
                grads,
                m: self.m[b].addr,
                v: self.v[b].addr,
            };
            // SAFETY: every range holds `range.len()` elements of its type in the engine's
            // buffers (the update range's master and moments, the reduced gradient range, the
            // parameters' stretch), apart from each other (an f32 master is the parameters).
            unsafe {
                self.stream()
                    .adamw(&h, self.led.t, T::DTYPE, at, range.len(), inv * clip)
            }
            .map_err(dev("the AdamW step".into()))?;
        }
        self.led.scaler.update(false);
        Ok(StepOutcome::Stepped { grad_norm })
    }

    /// Every parameter's fp32 master values, assembled from all ranks' shards and copied to the
    /// host (a collective: call it on every rank). In the specs' order.
    pub fn consolidate(&mut self) -> Result<Vec<(String, Vec<f32>)>, ZeroError> {
        let (stage, n) = (self.led.cfg.stage, self.led.part.world);
        let mut full: Vec<Vec<f32>> = Vec::with_capacity(self.led.part.buckets.len());
        for b in 0..self.led.part.buckets.len() {
            let len = self.led.part.buckets[b].len;
            let mut out = alloc(self.stream(), DType::F32, len)?;
            match (&self.master[b], stage) {
                // Stage 0 keeps the whole master (16-bit) or the whole parameters (f32).
                (Some(m), 0) => self.copy(&mut out, m, len)?,
                (None, 0) => self.copy(&mut out, &self.params[b], len)?,
                (Some(m), _) => self.comm.all_gather(m, &mut out)?,
                (None, 3) => self.comm.all_gather(&self.params[b], &mut out)?,
                (None, _) => {
                    let own = self.led.part.owned(b, self.led.rank);
                    let mine = alloc(self.stream(), DType::F32, len / n)?;
                    // SAFETY: the owned range of the f32 bucket into a buffer of its length.
                    unsafe {
                        self.stream()
                            .copy(mine.addr, self.params[b].at(own.start), own.len() * 4)
                    }
                    .map_err(dev("copying the owned parameters".into()))?;
                    // (The copy is queued before the all-gather, which returns once its work
                    // is done.)
                    self.comm.all_gather(&mine, &mut out)?;
                }
            }
            let mut host = vec![0f32; len];
            // SAFETY: `out` holds `len` f32s.
            unsafe {
                self.stream()
                    .read(bytemuck::cast_slice_mut(&mut host), out.addr)
            }
            .map_err(dev("reading the consolidated weights".into()))?;
            full.push(host);
        }
        Ok(self.led.part.by_param(&full))
    }

    /// `len` f32s of `src` into `dst`, waited for.
    fn copy(&self, dst: &mut DevVec, src: &DevVec, len: usize) -> Result<(), ZeroError> {
        // SAFETY: both hold at least `len` f32s (whole buckets of f32).
        unsafe { self.stream().copy(dst.addr, src.addr, len * 4) }
            .map_err(dev("copying the master weights".into()))?;
        self.sync("copying the master weights")
    }

    /// Bytes held now, by category (as [`crate::Engine::memory`]).
    pub fn memory(&self) -> Memory {
        let sz = std::mem::size_of::<T>();
        let elems = |v: &[DevVec]| v.iter().map(|x| x.elems).sum::<usize>();
        let held = |v: &[Option<DevVec>]| v.iter().flatten().map(|x| x.elems).sum::<usize>();
        let flying = |v: &InFlight| v.iter().flatten().map(|(_, e)| e).sum::<usize>();
        Memory {
            params: elems(&self.params) * sz,
            grads: elems(&self.grads) * sz,
            optimizer: (elems(&self.m) + elems(&self.v) + held(&self.master)) * 4,
            comm_buffers: (held(&self.staging)
                + held(&self.gathered)
                + flying(&self.inflight)
                + flying(&self.pending)
                + self.buckets.held()
                + self.shards.held())
                * sz,
        }
    }
}

impl<S: TrainStream + 'static, T: Float> Drop for DeviceEngine<'_, S, T> {
    fn drop(&mut self) {
        // The buffers go with the engine: the work using them ends first.
        if let Err(e) = self.sync("dropping the engine") {
            tracing::warn!(target: "ringzero::zero", "{e}");
        }
    }
}
