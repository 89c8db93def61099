//! The ZeRO engine: owns parameter storage, gradients, optimizer state and all communication; the
//! trainer owns forward and backward.
//!
//! Per micro-step the trainer reads parameters ([`Engine::param_f32`], [`Engine::param`] on the
//! host, [`Engine::param_addr`] for a device's kernels; stage 3: between [`Engine::gather`] and
//! [`Engine::release`], optionally announcing the next layer with [`Engine::prefetch`]), pushes
//! one gradient per parameter ([`Engine::push_grad`]), in the same order on every rank, and calls
//! [`Engine::step`]; every `accumulation_steps` calls the step is an optimizer step (the
//! accumulation boundary).
//!
//! One engine serves every memory: its model states live in the memory of a stream `S` and its
//! work is queued there, through a [`DeviceComm`] on that stream. [`Engine::new`] runs it on the
//! host ([`HostStream`]: host memory, the CPU kernels); [`Engine::on`] on any device communicator
//! (a GPU's, `DeviceComm<Arc<Gpu>>`). On a GPU the kernels compute the host's bits, except the
//! squared norm (summed in a tree), so with gradient clipping the parameters may differ from a
//! host run's in the last bit.
//!
//! The engine is generic over the parameter/gradient type `T` (`f32`, `bf16`, `f16`; it must
//! match [`ZeroConfig::precision`]). With 16-bit `T`, fp32 master weights live next to the Adam
//! moments (12 bytes per element: the paper's K = 12); with `f32` the parameters are their own
//! master (8 bytes of moments).
//!
//! | stage | parameters      | gradients                                    | master + moments |
//! |-------|-----------------|----------------------------------------------|--------------|
//! | 0     | full            | full, all-reduced (avg) at the boundary      | full         |
//! | 1     | full            | full, reduce-scattered at the boundary       | owned range  |
//! | 2     | full            | owned range; each bucket reduce-scattered as soon as backward has pushed all its gradients | owned range |
//! | 3     | owned range (gathered on demand) | as stage 2                  | owned range  |
//!
//! Stages 1–2 all-gather the updated parameters after the optimizer step (in pieces of at most
//! `allgather_elems`). Gradients are averaged over ranks and accumulation steps; clipping uses
//! the global norm, computed the same way in every stage (squared norms of the owned ranges,
//! summed with an all-reduce), so every stage computes the same numbers: with one accumulation
//! step the parameters are bit-identical across stages 0–3 and a data-parallel baseline
//! (tested). With several accumulation steps stages 2–3 sum reduced micro-gradients rather than
//! reducing the summed gradient, which rounds differently.
//!
//! With `overlap_comm` a full bucket's reduce-scatter, and with `stage3_prefetch_bucket_size` a
//! prefetched bucket's all-gather, run on the communicator's proxy thread while the trainer goes
//! on. Buffers the engine needs every micro-step (a bucket filling, a gathered bucket, a reduced
//! shard) are kept once used ([`Memory::comm_buffers`] counts them): on a GPU an allocation is a
//! driver call and, under the direct step, a new IPC mapping in every peer.
//!
//! Hybrid sharding ([`Engine::new_hybrid`], [`Engine::on_hybrid`]): the same engine on a shard
//! group, with each reduced gradient range averaged over the group's replicas at the
//! accumulation boundary.
//!
//! Overflow (fp16): the owned gradient shard is checked for inf/NaN, the verdict agreed with a max
//! all-reduce of one byte, and on overflow every rank skips the step and the loss scale drops (see
//! [`crate::scaler`]). In every precision a non-finite global norm also skips the step, so inf/NaN
//! never reaches the weights.

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Instant;

use ringzero_collectives::{DType, DeviceComm, HostStream, TrainStream};
use ringzero_kernels::cpu::{cast, Float};
use ringzero_kernels::device::Held;

use crate::config::{OffloadDevice, ZeroConfig};
use crate::error::ZeroError;
use crate::ledger::{hybrid, layout, update_range, Ledger};
use crate::partition::{ParamSpec, Partition};
use crate::report::{CommWait, Memory, Phase, StepReport, StepTimer};

mod agree;
mod buffers;
mod cores;
mod delayed;
mod host;
mod offload;
mod param_nvme;
mod persist;
mod stage3;
mod step;

pub(crate) use buffers::alloc_bytes;
use buffers::{all_gather_host, alloc, alloc_host, dev, DevVec, InFlight, Reducing, Spares};
pub(crate) use step::REDUCES_IN_FLIGHT;

/// Bucket-sized buffers the engine keeps for reuse: two in steady state (one filling while one
/// reduces, or a gathered bucket and a prefetched one).
pub(crate) const KEPT_BUCKETS: usize = 2;

/// Shard-sized buffers the engine keeps for reuse with `nb` buckets: as many as stage 3 may have
/// prefetching at once, and one more.
pub(crate) fn kept_shards(nb: usize) -> usize {
    nb + 1
}
pub use agree::check_same_params;
pub use host::hybrid_groups;

/// The ZeRO engine on one rank (see the module docs): model states in the memory of stream `S`
/// (host memory by default), parameters and gradients in `T`.
pub struct Engine<T: Float = f32, S: TrainStream + 'static = HostStream> {
    comm: Arc<DeviceComm<S>>,
    /// Hybrid sharding: the ranks that hold the same shard in the other shard groups.
    replicas: Option<Arc<DeviceComm<S>>>,
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
    /// Stage 1: per bucket, the reduced gradient of the owned range (made at the first step,
    /// kept; lent to the step as its `red`).
    reduced: Vec<Option<DevVec>>,
    /// Stages 2–3: a bucket's gradients while backward fills it.
    staging: Vec<Option<DevVec>>,
    /// Stages 2–3 with `overlap_comm`: reduce-scatters in flight (the bucket, the shard), oldest
    /// first (at most `step::REDUCES_IN_FLIGHT`), each with its bucket and the elements it holds.
    pending: Reducing,
    /// Per bucket, the optimizer's fp32 states over the range this rank updates, in
    /// `Optimizer::states`' order (none for SGD without momentum).
    states: Vec<Vec<DevVec>>,
    /// Kept bucket-sized buffers (staging, gathered buckets) and shard-sized ones (reduced
    /// shards, prefetch copies).
    buckets: Spares,
    /// The bytes of those two kinds of buffers, kept or in use, now and at their peak.
    comm_meter: Arc<Held>,
    shards: Spares,
    /// A small buffer for the one-element all-reduces (the norm, the overflow flag).
    scalar: Option<DevVec>,
    /// Where each bucket's optimizer state lives, and the offload pipeline's buffers.
    tier: offload::Tier,
    /// Time the trainer waited on communication.
    wait: CommWait,
    /// Stage 3: bucket elements all-gathered so far, on demand and prefetched.
    gathered_elems: u64,
    /// The current optimizer step's clock, and the last step's report.
    timer: StepTimer,
    last_report: Option<StepReport>,
    _t: PhantomData<T>,
}

impl<T: Float, S: TrainStream + 'static> Engine<T, S> {
    /// An engine for `specs` on the ranks of `comm`, its model states in the memory of `comm`'s
    /// stream, initialised by `init(param index, element index)` (the same function on every
    /// rank), as [`Engine::new`] does on the host. `comm` is the engine's from now on (an
    /// `Arc` shares it with the trainer's own collectives; [`Engine::comm`] lends it).
    pub fn on(
        comm: impl Into<Arc<DeviceComm<S>>>,
        specs: &[ParamSpec],
        init: &dyn Fn(usize, usize) -> f32,
        cfg: ZeroConfig,
    ) -> Result<Engine<T, S>, ZeroError> {
        let comm = comm.into();
        if let Some(s) = cfg.shard_size.filter(|&s| s != comm.size()) {
            return Err(ZeroError::Config(format!(
                "the config shards over groups of {s} ranks (mics_shard_size) but this engine \
                 shards over all {} ranks of its communicator: build the groups with \
                 ringzero::zero::hybrid_groups and the engine with Engine::new_hybrid (or \
                 Engine::on_hybrid on device communicators over the two)",
                comm.size()
            )));
        }
        Self::build(comm, None, specs, init, cfg)
    }

    /// Hybrid sharding, as [`Engine::new_hybrid`] does on the host: model states sharded over
    /// `shard` and replicated over `replicas` (device communicators on the two that
    /// [`hybrid_groups`] splits off), gradients averaged over `replicas` once per optimizer step.
    /// Every rank of `replicas` must hold the same shard (checked; every rank fails alike if
    /// not).
    pub fn on_hybrid(
        shard: impl Into<Arc<DeviceComm<S>>>,
        replicas: impl Into<Arc<DeviceComm<S>>>,
        specs: &[ParamSpec],
        init: &dyn Fn(usize, usize) -> f32,
        cfg: ZeroConfig,
    ) -> Result<Engine<T, S>, ZeroError> {
        let (shard, replicas) = (shard.into(), replicas.into());
        hybrid::shard_size_matches(&cfg, shard.size())?;
        let mine = hybrid::record(shard.rank(), shard.size());
        let all = all_gather_host(&replicas, &mine)?;
        let odd = hybrid::disagreement(mine, &all, replicas.rank());
        // Every shard group learns whether any of its ranks' replica groups disagreed.
        let bad = all_gather_host(&shard, &[u8::from(odd.is_some())])?;
        hybrid::verdict(odd, bad.into_iter().max().unwrap_or(0))?;
        Self::build(shard, Some(replicas), specs, init, cfg)
    }

    fn build(
        comm: Arc<DeviceComm<S>>,
        replicas: Option<Arc<DeviceComm<S>>>,
        specs: &[ParamSpec],
        init: &dyn Fn(usize, usize) -> f32,
        cfg: ZeroConfig,
    ) -> Result<Engine<T, S>, ZeroError> {
        let (n, rank) = (comm.size(), comm.rank());
        let world = n * replicas.as_ref().map_or(1, |r| r.size());
        let cfg = cfg.for_world(world)?;
        let (part, full) = layout::<T>(&cfg, specs, init, n)?;
        if comm.rank() == 0 && replicas.as_ref().is_none_or(|r| r.rank() == 0) {
            for note in &cfg.notes {
                tracing::info!(target: "ringzero::zero", "config: {note}");
            }
        }
        let stage = cfg.stage;
        let nb = part.buckets.len();
        let upd = |b: usize| update_range(&part, stage, rank, b);
        let s = comm.stream();
        // `host`: in the offload tier's host memory rather than the device's.
        let alloc = |dtype: DType, elems: usize, host: bool| {
            if host {
                alloc_host(s, dtype, elems)
            } else {
                alloc(s, dtype, elems)
            }
        };
        let upload = |x: &[f32], as_t: bool, host: bool| -> Result<DevVec, ZeroError> {
            let (d, bytes) = if as_t {
                let mut out = vec![T::default(); x.len()];
                cast(x, &mut out);
                (T::DTYPE, bytemuck::cast_slice::<T, u8>(&out).to_vec())
            } else {
                (DType::F32, bytemuck::cast_slice::<f32, u8>(x).to_vec())
            };
            let v = alloc(d, x.len(), host)?;
            // SAFETY: `v` is a fresh allocation of the stream of `x.len()` elements of `d`,
            // which no work uses yet.
            unsafe { s.write(v.addr, &bytes) }
                .map_err(dev("uploading the initial values".into()))?;
            Ok(v)
        };
        let homes = offload::homes(&cfg, &part);
        let host_params = cfg.offload.param.device == OffloadDevice::Cpu;
        let nvme_params = param_nvme::shards_on_nvme(&cfg);
        let mut params = Vec::with_capacity(nb);
        let mut master = Vec::with_capacity(nb);
        let (mut grads, mut states) = (Vec::new(), Vec::new());
        let keeps = cfg.optimizer.states().len();
        for (b, bucket) in full.iter().enumerate() {
            params.push(if nvme_params {
                // The shard lives in the parameter file (`param_nvme.rs`).
                alloc(T::DTYPE, 0, false)?
            } else if stage == 3 {
                upload(&bucket[part.owned(b, rank)], true, host_params)?
            } else {
                upload(bucket, true, false)?
            });
            // An offloaded bucket keeps an fp32 master in every precision (the CPU steps it and
            // copies the parameters to the device); the NVMe tier keeps it in its file.
            master.push(match homes[b] {
                OffloadDevice::None if T::IS_F32 => None,
                OffloadDevice::None => Some(upload(&bucket[upd(b)], false, false)?),
                OffloadDevice::Cpu => Some(upload(&bucket[upd(b)], false, true)?),
                OffloadDevice::Nvme => None,
            });
            let g = if stage >= 2 {
                part.owned(b, rank).len()
            } else {
                part.buckets[b].len
            };
            grads.push(alloc(T::DTYPE, g, false)?);
            let (on_host, kept) = match homes[b] {
                OffloadDevice::Nvme => (false, 0),
                h => (h == OffloadDevice::Cpu, keeps),
            };
            states.push(
                (0..kept)
                    .map(|_| alloc(DType::F32, upd(b).len(), on_host))
                    .collect::<Result<Vec<_>, _>>()?,
            );
        }
        let range_cap = (0..nb).map(|b| upd(b).len()).max().unwrap_or(0);
        // Each rank's share of the node's cores (`cores.rs`).
        let threads = cores::step_threads(comm.local_size());
        let mut tier = offload::Tier::new::<T>(homes, range_cap, threads);
        tier.create_swap(&cfg, rank, &part, &full, keeps)?;
        if nvme_params {
            tier.params_file = Some(param_nvme::create::<T, S>(s, &cfg, (&part, rank), &full)?);
        }
        if cfg.offload.optimizer.delayed_update_after.is_some() {
            // The delayed update's gradient and parameter buffers, one pair per offloaded
            // bucket in the order its steps take them: on a GPU each is a page-locking driver
            // call, which would otherwise fall on the first delayed step.
            tier.delayed_bufs = (0..nb)
                .filter(|&b| tier.offloaded(b))
                .map(|b| {
                    let len = part.owned(b, rank).len();
                    Ok((alloc_host(s, T::DTYPE, len)?, alloc_host(s, T::DTYPE, len)?))
                })
                .collect::<Result<_, ZeroError>>()?;
        }
        let cap = part.buckets.iter().map(|b| b.len).max().unwrap_or(0);
        // Their peak is what `comm_peak` predicts from the trainer's calls.
        let comm_meter = Arc::new(Held::new());
        let buckets = Spares::new(T::DTYPE, cap, KEPT_BUCKETS).metered(&comm_meter);
        let shards = Spares::new(T::DTYPE, cap / n, kept_shards(nb)).metered(&comm_meter);
        let scalar = Some(alloc(DType::F64, 1, false)?);
        let mut e = Engine {
            comm_meter,
            buckets,
            shards,
            scalar,
            tier,
            params,
            master,
            gathered: (0..nb).map(|_| None).collect(),
            inflight: (0..nb).map(|_| None).collect(),
            grads,
            staging: (0..nb).map(|_| None).collect(),
            reduced: (0..nb).map(|_| None).collect(),
            pending: Reducing::new(),
            states,
            led: Ledger::new(part, cfg, rank),
            comm,
            replicas,
            wait: CommWait::default(),
            gathered_elems: 0,
            timer: StepTimer::new(Instant::now(), CommWait::default(), 0),
            last_report: None,
            _t: PhantomData,
        };
        e.check_agreement(&full)?;
        Ok(e)
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
    /// must be made on.
    pub fn stream(&self) -> &S {
        self.comm.stream()
    }

    /// The engine's communicator (the shard group's under hybrid sharding): for the trainer's
    /// own collectives (a loss to average, say), between the engine's calls, in the same order
    /// on every rank.
    pub fn comm(&self) -> &DeviceComm<S> {
        &self.comm
    }

    /// Hybrid sharding: the communicator over the replicas of this rank's shard.
    pub fn replicas(&self) -> Option<&DeviceComm<S>> {
        self.replicas.as_deref()
    }

    /// Time spent waiting on communication so far.
    pub fn comm_wait(&self) -> CommWait {
        self.wait
    }

    /// Start timing `phase` of this micro-step (the phase before it, if any, ends); the step
    /// ends the last. The times go to [`Engine::report`].
    pub fn phase(&mut self, phase: Phase) {
        self.timer.phase(Some(phase), Instant::now());
    }

    /// Where the last optimizer step's wall time went (`None` before the first). With
    /// `wall_clock_breakdown` the engine also logs it on rank 0 after each step.
    pub fn report(&self) -> Option<StepReport> {
        self.last_report
    }

    /// Stage 3: bucket elements all-gathered so far, on demand and prefetched (padding
    /// included). A step that gathers every parameter once for forward and once for backward
    /// adds twice the padded Ψ when each bucket is released at once — the all-gather part of
    /// the ZeRO paper's 3Ψ per step (the reduce-scatter is the third Ψ) — and less where buckets
    /// stay for their reuse (`stage3_max_reuse_distance`).
    pub fn gathered_elems(&self) -> u64 {
        self.gathered_elems
    }

    /// Optimizer steps taken (skipped ones not counted).
    pub fn steps(&self) -> u64 {
        self.led.t
    }

    /// Optimizer steps skipped on overflow.
    pub fn skipped_steps(&self) -> u64 {
        self.led.skipped
    }

    /// The learning rate the next optimizer step uses (the configured one, the schedule's, or
    /// what [`Engine::set_lr`] set).
    pub fn lr(&self) -> f32 {
        self.led.hyper(self.led.t + 1).lr
    }

    /// Use `lr` from the next optimizer step on: a trainer's own schedule, called before each
    /// step as it likes (every rank must set the same rate). Refused, with nothing changed, for
    /// a rate that is not a non-negative number, and when the config has a `scheduler` (the two
    /// would fight: drop one).
    pub fn set_lr(&mut self, lr: f32) -> Result<(), ZeroError> {
        if !(lr >= 0.0 && lr.is_finite()) {
            return Err(ZeroError::NotNow {
                call: "set_lr",
                why: format!("the learning rate must be a non-negative number, got {lr}"),
            });
        }
        if self.led.cfg.scheduler.is_some() {
            return Err(ZeroError::NotNow {
                call: "set_lr",
                why: "the config has a scheduler, which sets the rate every step; remove `scheduler` \
                      from the config to set the rate yourself"
                    .into(),
            });
        }
        self.led.lr = Some(lr);
        Ok(())
    }

    /// The factor to multiply the loss by before backward (1 unless fp16).
    pub fn loss_scale(&self) -> f32 {
        self.led.scaler.scale()
    }

    /// Where parameter `name`'s current values (`T`, its element count) are in device memory,
    /// for the trainer's kernels: valid until the next [`Engine::step`] (stage 3: until
    /// [`Engine::release`], and only while gathered). Work reading it must have completed
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
    /// only while gathered; for trainers that compute in fp32).
    pub fn param_f32(&self, name: &str) -> Result<Vec<f32>, ZeroError> {
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
        let m = self.stream().mark().map_err(dev(what.into()))?;
        self.wait_mark(m, what)
    }

    /// Bytes held now, by category and tier.
    pub fn memory(&self) -> Memory {
        let sz = std::mem::size_of::<T>();
        let elems = |v: &[DevVec]| v.iter().map(|x| x.elems).sum::<usize>();
        let held = |v: &[Option<DevVec>]| v.iter().flatten().map(|x| x.elems).sum::<usize>();
        let flying = |v: &InFlight| v.iter().flatten().map(|(_, e)| e).sum::<usize>();
        // Per bucket, the optimizer's f32s (master and states) in this engine's memory.
        let optim =
            |b: usize| elems(&self.states[b]) + self.master[b].as_ref().map_or(0, |m| m.elems);
        let nb = self.params.len();
        let (off, on): (Vec<usize>, Vec<usize>) = (0..nb).partition(|&b| self.tier.offloaded(b));
        let params = elems(&self.params) * sz;
        let host_params = self.led.cfg.offload.param.device == OffloadDevice::Cpu;
        Memory {
            params: if host_params { 0 } else { params },
            grads: elems(&self.grads) * sz,
            optimizer: on.iter().map(|&b| optim(b)).sum::<usize>() * 4,
            comm_buffers: (held(&self.staging)
                + held(&self.gathered)
                + held(&self.reduced)
                + flying(&self.inflight)
                + self.pending.iter().map(|(_, _, e)| e).sum::<usize>()
                + self.buckets.held()
                + self.shards.held())
                * sz,
            comm_buffers_peak: self.comm_meter.read().peak,
            host_params: if host_params { params } else { 0 },
            host_optimizer: off.iter().map(|&b| optim(b)).sum::<usize>() * 4,
            host_buffers: self.tier.buffer_bytes(),
            nvme_optimizer: self.tier.nvme_bytes,
            nvme_params: self
                .tier
                .params_file
                .as_ref()
                .map_or(0, |f| f.size() as usize),
        }
    }
}

impl<T: Float, S: TrainStream + 'static> Drop for Engine<T, S> {
    fn drop(&mut self) {
        // A delayed update's thread writes the host state: it ends before the state goes.
        if let Some(d) = self.tier.delayed.take() {
            d.wait();
        }
        // The buffers go with the engine: the work using them ends first.
        if let Err(e) = self.sync("dropping the engine") {
            tracing::warn!(target: "ringzero::zero", "{e}");
        }
    }
}
