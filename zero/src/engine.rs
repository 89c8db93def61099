//! The ZeRO engine: owns parameter storage, gradients, optimizer state and all communication; the
//! trainer owns forward and backward.
//!
//! Per micro-step the trainer reads parameters ([`Engine::param`] / [`Engine::param_f32`]; stage
//! 3: between [`Engine::gather`] and [`Engine::release`], optionally announcing the next layer
//! with [`Engine::prefetch`]), pushes one gradient per parameter ([`Engine::push_grad`]), in the
//! same order on every rank, and calls [`Engine::step`]; every `accumulation_steps` calls the step
//! is an optimizer step (the accumulation boundary).
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
//! Stages 1–2 all-gather the updated parameters after the optimizer step. Gradients are averaged
//! over ranks and accumulation steps; clipping uses the global norm, computed the same way in every
//! stage (squared norms of the owned ranges, summed with an all-reduce), so every stage computes the
//! same numbers: with one accumulation step the parameters are bit-identical across stages 0–3 and
//! a data-parallel baseline (tested). With several accumulation steps stages 2–3 sum reduced
//! micro-gradients rather than reducing the summed gradient, which rounds differently.
//!
//! Hybrid sharding ([`Engine::new_hybrid`]): the same engine on a shard group, with each reduced
//! gradient range averaged over the group's replicas at the accumulation boundary.
//!
//! Overflow (fp16): the owned gradient shard is checked for inf/NaN, the verdict agreed with a max
//! all-reduce of one byte, and on overflow every rank skips the step and the loss scale drops (see
//! [`crate::scaler`]). In every precision a non-finite global norm also skips the step, so inf/NaN
//! never reaches the weights.

use std::time::Instant;

use ringzero_collectives::{Algo, Communicator, ReduceOp, Work};
use ringzero_kernels::cpu::{adamw_mixed, all_finite, cast, reduce_into_typed, sq_norm, Float};

use crate::config::ZeroConfig;
use crate::ledger::{clip_factor, hybrid, layout, update_range, Ledger};
use crate::partition::{ParamSpec, Partition};

pub(crate) mod persist;

pub use crate::error::ZeroError;
pub use crate::report::{CommWait, Memory, StepOutcome};

/// Background collectives per bucket, with the elements each holds.
type InFlight<T> = Vec<Option<(Work<Vec<T>>, usize)>>;

/// The ZeRO engine on one rank, parameters and gradients in `T`.
pub struct Engine<'c, T: Float = f32> {
    comm: &'c Communicator,
    /// Hybrid sharding: the ranks that hold the same shard in the other shard groups (see
    /// [`Engine::new_hybrid`]).
    replicas: Option<&'c Communicator>,
    /// The layout, the configuration and the step's bookkeeping.
    led: Ledger,
    /// Per bucket: the whole bucket (stages 0–2) or this rank's shard (stage 3).
    params: Vec<Vec<T>>,
    /// fp32 master weights (16-bit `T` only; empty for f32): whole buckets in stage 0, owned shards
    /// otherwise.
    master: Vec<Vec<f32>>,
    /// Stage 3: whole buckets gathered for compute.
    gathered: Vec<Option<Vec<T>>>,
    /// Stage 3: prefetches in flight, with the elements they hold.
    inflight: InFlight<T>,
    /// Per bucket: the whole bucket (stages 0–1) or this rank's shard (stages 2–3).
    grads: Vec<Vec<T>>,
    /// Stages 2–3: a bucket's gradients while backward fills it.
    staging: Vec<Option<Vec<T>>>,
    /// Stages 2–3 with `overlap_comm`: reduce-scatters in flight, with the elements they hold.
    pending: InFlight<T>,
    m: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    wait: CommWait,
}

/// Hybrid sharding's communicators on `world` for [`Engine::new_hybrid`]: shard groups of `size`
/// ranks that share a node wherever the nodes allow it, and replica groups of the ranks at the
/// same place in each. Ranks are taken node by node (nodes in the order of their lowest rank,
/// ranks in order inside a node, nodes told apart by `RINGZERO_NODE_ID`), then cut into groups of
/// `size`: with ranks numbered node by node these are runs of consecutive ranks, and with ranks
/// dealt round-robin over nodes (Slurm's cyclic distribution) the groups still stay inside nodes.
/// A collective (an all-gather of node ids, then two splits) that every rank of `world` calls with
/// the same `size` ([`ZeroConfig::shard_size`]); a size that does not divide the world into whole
/// groups is refused before anything is split.
pub fn hybrid_groups(
    world: &Communicator,
    size: usize,
) -> Result<(Communicator, Communicator), ZeroError> {
    let n = world.size();
    crate::mem::replicas(n, size).map_err(ZeroError::Config)?;
    use sha2::Digest;
    let mine = sha2::Sha256::digest(world.config().node_id.as_bytes());
    let mut all = vec![0u8; n * mine.len()];
    world.all_gather(&mine[..], &mut all)?;
    let nodes: Vec<&[u8]> = all.chunks(mine.len()).collect();
    let at = node_major(&nodes)
        .iter()
        .position(|&x| x == world.rank())
        .expect("every rank has a place");
    let key = |k: usize| u32::try_from(k).expect("a rank fits u32");
    let shard = world.split(Some(key(at / size)), key(at % size))?;
    let replicas = world.split(Some(key(at % size)), key(at / size))?;
    match (shard, replicas) {
        (Some(s), Some(rep)) => Ok((s, rep)),
        _ => unreachable!("every rank passed a color"),
    }
}

/// Ranks in node-major order, given each rank's node: nodes in the order of their lowest rank,
/// ranks ascending inside each.
fn node_major<K: PartialEq>(node_of: &[K]) -> Vec<usize> {
    let first: Vec<usize> = node_of
        .iter()
        .map(|k| node_of.iter().position(|x| x == k).expect("k is there"))
        .collect();
    let mut order: Vec<usize> = (0..node_of.len()).collect();
    order.sort_by_key(|&r| (first[r], r));
    order
}

impl<'c, T: Float> Engine<'c, T> {
    /// An engine for `specs` on `comm`, every parameter element initialised by `init(param index,
    /// element index)` (the same function on every rank, so no broadcast is needed; with 16-bit
    /// `T` the master keeps the fp32 value and the parameter its rounding).
    pub fn new(
        comm: &'c Communicator,
        specs: &[ParamSpec],
        init: &dyn Fn(usize, usize) -> f32,
        cfg: ZeroConfig,
    ) -> Result<Engine<'c, T>, ZeroError> {
        if let Some(s) = cfg.shard_size.filter(|&s| s != comm.size()) {
            return Err(ZeroError::Config(format!(
                "the config shards over groups of {s} ranks (mics_shard_size) but Engine::new \
                 shards over all {} ranks of its communicator: build the groups with \
                 ringzero_zero::hybrid_groups and the engine with Engine::new_hybrid",
                comm.size()
            )));
        }
        Self::build(comm, None, specs, init, cfg)
    }

    /// Hybrid sharding (FSDP's `HYBRID_SHARD`, DeepSpeed's MiCS): the model states are sharded
    /// over `shard` (typically the ranks of one node, whose links are fast) and replicated over
    /// `replicas` (the ranks that hold the same shard in the other shard groups, one per node).
    /// Parameters are gathered inside the shard group only; gradients are reduce-scattered in it
    /// and then averaged over `replicas` once per optimizer step, so the slow links carry
    /// 2(R−1)/R of a shard per step rather than a share of every all-gather. With a world of
    /// `S × R` ranks, a node-major layout is built with
    /// `world.split(Some(node), local_rank)` and `world.split(Some(local_rank), node)`.
    ///
    /// Every rank of `replicas` must hold the same shard: the same rank in shard groups of the
    /// same size (checked here, with one all-gather over `replicas` and one agreement over
    /// `shard`; every rank fails alike if any does). Checkpoints are written by the first
    /// replica's shard group (an ordinary checkpoint of `S` ranks, loadable at any size) and
    /// read by every group; both stay all-or-nothing across the whole world.
    pub fn new_hybrid(
        shard: &'c Communicator,
        replicas: &'c Communicator,
        specs: &[ParamSpec],
        init: &dyn Fn(usize, usize) -> f32,
        cfg: ZeroConfig,
    ) -> Result<Engine<'c, T>, ZeroError> {
        hybrid::shard_size_matches(&cfg, shard.size())?;
        let mine = hybrid::record(shard.rank(), shard.size());
        let mut all = vec![0i64; 2 * replicas.size()];
        replicas.all_gather(&mine, &mut all)?;
        let odd = hybrid::disagreement(mine, &all, replicas.rank());
        // Every shard group learns whether any of its ranks' replica groups disagreed.
        let mut bad = [u8::from(odd.is_some())];
        shard.all_reduce_in_place(&mut bad, ReduceOp::Max)?;
        hybrid::verdict(odd, bad[0])?;
        Self::build(shard, Some(replicas), specs, init, cfg)
    }

    fn build(
        comm: &'c Communicator,
        replicas: Option<&'c Communicator>,
        specs: &[ParamSpec],
        init: &dyn Fn(usize, usize) -> f32,
        cfg: ZeroConfig,
    ) -> Result<Engine<'c, T>, ZeroError> {
        let (n, rank) = (comm.size(), comm.rank());
        let world = n * replicas.map_or(1, |r| r.size());
        let (part, full) = layout::<T>(&cfg, specs, init, n, world)?;
        let stage = cfg.stage;
        let nb = part.buckets.len();
        // The range of bucket b this rank updates: everything in stage 0, the owned range else.
        let upd = |b: usize| update_range(&part, stage, rank, b);
        let master: Vec<Vec<f32>> = if T::IS_F32 {
            vec![Vec::new(); nb]
        } else {
            (0..nb).map(|b| full[b][upd(b)].to_vec()).collect()
        };
        let narrow = |x: &[f32]| {
            let mut out = vec![T::default(); x.len()];
            cast(x, &mut out);
            out
        };
        let params: Vec<Vec<T>> = (0..nb)
            .map(|b| {
                if stage == 3 {
                    narrow(&full[b][part.owned(b, rank)])
                } else {
                    narrow(&full[b])
                }
            })
            .collect();
        let grads = (0..nb)
            .map(|b| {
                let len = if stage >= 2 {
                    part.owned(b, rank).len()
                } else {
                    part.buckets[b].len
                };
                vec![T::default(); len]
            })
            .collect();
        let moments: Vec<Vec<f32>> = (0..nb).map(|b| vec![0f32; upd(b).len()]).collect();
        Ok(Engine {
            comm,
            replicas,
            params,
            master,
            gathered: (0..nb).map(|_| None).collect(),
            inflight: (0..nb).map(|_| None).collect(),
            grads,
            staging: (0..nb).map(|_| None).collect(),
            pending: (0..nb).map(|_| None).collect(),
            m: moments.clone(),
            v: moments,
            wait: CommWait::default(),
            led: Ledger::new(part, cfg, rank),
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

    /// Time spent waiting on communication so far.
    pub fn comm_wait(&self) -> CommWait {
        self.wait
    }

    /// The current values of parameter `name` in `T` (stage 3: only while gathered).
    pub fn param(&self, name: &str) -> Result<&[T], ZeroError> {
        let s = self.led.part.slots[self.led.index(name)?];
        let bucket = if self.led.cfg.stage == 3 {
            self.gathered[s.bucket]
                .as_deref()
                .ok_or_else(|| ZeroError::NotGathered(name.to_string()))?
        } else {
            &self.params[s.bucket]
        };
        Ok(&bucket[s.offset..s.offset + s.len])
    }

    /// [`Engine::param`] widened to `f32` (for trainers that compute in fp32).
    pub fn param_f32(&self, name: &str) -> Result<Vec<f32>, ZeroError> {
        let p = self.param(name)?;
        let mut out = vec![0f32; p.len()];
        cast(p, &mut out);
        Ok(out)
    }

    /// Stage 3: start all-gathering the buckets holding `names` in the background, so a later
    /// [`Engine::gather`] finds them ready; at most `prefetch_elems` elements are in flight (the
    /// rest is left for `gather`). A no-op in stages 0–2 and when `prefetch_elems` is 0. Like every
    /// collective, prefetches must be issued in the same order on every rank.
    pub fn prefetch(&mut self, names: &[&str]) -> Result<(), ZeroError> {
        let flying: usize = self.inflight.iter().flatten().map(|(_, e)| e).sum();
        let (gathered, inflight) = (&self.gathered, &self.inflight);
        let start = self.led.to_prefetch(
            names,
            |b| gathered[b].is_some() || inflight[b].is_some(),
            flying,
        )?;
        for (b, held) in start {
            let shard = self.params[b].clone();
            let len = self.led.part.buckets[b].len;
            self.inflight[b] = Some((self.comm.all_gather_async(shard, len), held));
        }
        Ok(())
    }

    /// Stage 3: all-gather the buckets holding `names` so they can be read (waiting for a prefetch
    /// where one is in flight). A no-op in stages 0–2. Gathering something already gathered is an
    /// error, and nothing is gathered then.
    pub fn gather(&mut self, names: &[&str]) -> Result<(), ZeroError> {
        let gathered = &self.gathered;
        let Some(buckets) = self.led.to_gather(names, |b| gathered[b].is_some())? else {
            return Ok(());
        };
        let t0 = Instant::now();
        let mut out = Ok(());
        for b in buckets {
            let full = match self.inflight[b].take() {
                Some((w, _)) => w.wait(),
                None => {
                    let mut full = vec![T::default(); self.led.part.buckets[b].len];
                    self.comm
                        .all_gather(&self.params[b], &mut full)
                        .map(|()| full)
                }
            };
            match full {
                Ok(f) => self.gathered[b] = Some(f),
                Err(e) => {
                    out = Err(e.into());
                    break;
                }
            }
        }
        self.wait.gather += t0.elapsed();
        out
    }

    /// Stage 3: drop the gathered buckets holding `names`. A no-op in stages 0–2.
    pub fn release(&mut self, names: &[&str]) -> Result<(), ZeroError> {
        let gathered = &self.gathered;
        let Some(buckets) = self.led.to_release(names, |b| gathered[b].is_some())? else {
            return Ok(());
        };
        for b in buckets {
            self.gathered[b] = None;
        }
        Ok(())
    }

    /// Add this micro-step's gradient of `name` (already multiplied by [`Engine::loss_scale`]
    /// under fp16). In stages 2–3 a bucket is reduce-scattered as soon as all its gradients are
    /// in (in the background with `overlap_comm`).
    pub fn push_grad(&mut self, name: &str, grad: &[T]) -> Result<(), ZeroError> {
        self.push_with(name, grad.len(), |dst| {
            reduce_into_typed(ReduceOp::Sum, dst, grad).expect("lengths checked")
        })
    }

    /// [`Engine::push_grad`] from an `f32` gradient, rounded once into `T` (the sum with an
    /// earlier micro-step's gradient is rounded once too).
    pub fn push_grad_f32(&mut self, name: &str, grad: &[f32]) -> Result<(), ZeroError> {
        self.push_with(name, grad.len(), |dst| {
            if T::IS_F32 {
                let d: &mut [f32] = bytemuck::cast_slice_mut(dst);
                d.iter_mut().zip(grad).for_each(|(a, g)| *a += g);
                return;
            }
            let mut acc = vec![0f32; dst.len()];
            cast(dst, &mut acc);
            acc.iter_mut().zip(grad).for_each(|(a, g)| *a += g);
            cast(&acc, dst);
        })
    }

    fn push_with(
        &mut self,
        name: &str,
        len: usize,
        add: impl FnOnce(&mut [T]),
    ) -> Result<(), ZeroError> {
        let (i, s) = self.led.check_push(name, len)?;
        let blen = self.led.part.buckets[s.bucket].len;
        let dst = if self.led.cfg.stage >= 2 {
            self.staging[s.bucket].get_or_insert_with(|| vec![T::default(); blen])
        } else {
            &mut self.grads[s.bucket]
        };
        add(&mut dst[s.offset..s.offset + s.len]);
        self.led.pushed[i] = true;
        let b = s.bucket;
        if self.led.cfg.stage >= 2 && self.led.bucket_full(b) {
            let full = self.staging[b].take().expect("filled above");
            let t0 = Instant::now();
            if self.led.cfg.overlap_comm {
                let held = full.len() + full.len() / self.led.part.world;
                self.pending[b] = Some((self.comm.reduce_scatter_async(full, ReduceOp::Avg), held));
            } else {
                let mut shard = vec![T::default(); blen / self.led.part.world];
                let r = self.comm.reduce_scatter(&full, &mut shard, ReduceOp::Avg);
                self.wait.reduce += t0.elapsed();
                r?;
                reduce_into_typed(ReduceOp::Sum, &mut self.grads[b], &shard)
                    .expect("shard lengths match");
            }
        }
        Ok(())
    }

    /// End a micro-step; at the accumulation boundary, reduce gradients, check for overflow, clip,
    /// run AdamW on what this rank owns and share the result.
    pub fn step(&mut self) -> Result<StepOutcome, ZeroError> {
        let gathered = &self.gathered;
        let boundary = self.led.end_micro_step(|b| gathered[b].is_some())?;
        // Reduce-scatters still in flight belong to this micro-step.
        let t0 = Instant::now();
        for b in 0..self.pending.len() {
            if let Some((w, _)) = self.pending[b].take() {
                let shard = w.wait()?;
                reduce_into_typed(ReduceOp::Sum, &mut self.grads[b], &shard)
                    .expect("shard lengths match");
            }
        }
        if !boundary {
            self.wait.reduce += t0.elapsed();
            return Ok(StepOutcome::Accumulated);
        }
        self.led.micro = 0;
        // Prefetches of pre-step values would go stale: finish and drop them.
        for f in &mut self.inflight {
            if let Some((w, _)) = f.take() {
                w.wait()?;
            }
        }
        let (stage, n) = (self.led.cfg.stage, self.led.part.world);
        let nb = self.led.part.buckets.len();
        // Reduce what is not reduced yet; `red[b]` is this rank's averaged gradient range in
        // stage 1 (stages 0 and 2–3 keep it in `grads`).
        let mut red: Vec<Vec<T>> = vec![Vec::new(); nb];
        for (b, r) in red.iter_mut().enumerate() {
            match stage {
                // The ring's all-reduce reduces in its reduce-scatter's order, so stage 0 ends
                // bit-identical to stages 1–3 (recursive doubling, which `auto` picks for small
                // buffers, would round in another order).
                0 => self.comm.all_reduce_in_place_with(
                    &mut self.grads[b],
                    ReduceOp::Avg,
                    Algo::Ring,
                )?,
                1 => {
                    *r = vec![T::default(); self.led.part.buckets[b].len / n];
                    self.comm.reduce_scatter(&self.grads[b], r, ReduceOp::Avg)?;
                }
                _ => {}
            }
        }
        if let Some(rep) = self.replicas {
            // Hybrid sharding: the shard group's average, averaged over the replicas (every
            // replica ends bit-identical, so each computes the same norm and update below).
            let reduced = if stage == 1 {
                &mut red
            } else {
                &mut self.grads
            };
            for g in reduced.iter_mut() {
                rep.all_reduce_in_place_with(g, ReduceOp::Avg, Algo::Ring)?;
            }
        }
        self.wait.reduce += t0.elapsed();
        let t1 = Instant::now();
        let outcome = self.update(&red);
        for b in 0..nb {
            self.grads[b].iter_mut().for_each(|g| *g = T::default());
        }
        let outcome = outcome?;
        if matches!(outcome, StepOutcome::Stepped { .. }) && (stage == 1 || stage == 2) {
            for b in 0..nb {
                self.gather_updated(b)?;
            }
        }
        self.wait.update += t1.elapsed();
        Ok(outcome)
    }

    /// The optimizer half of a boundary step, on reduced gradients.
    fn update(&mut self, red: &[Vec<T>]) -> Result<StepOutcome, ZeroError> {
        let (stage, rank) = (self.led.cfg.stage, self.led.rank);
        let nb = self.led.part.buckets.len();
        // This rank's averaged gradient range of bucket b (stage 0: the owned range, for the norm).
        let owned: Vec<std::ops::Range<usize>> =
            (0..nb).map(|b| self.led.part.owned(b, rank)).collect();
        // This rank's reduced gradient range of bucket b, borrowed (no copy).
        let owned_grad = |grads: &'_ [Vec<T>], b: usize| -> std::ops::Range<usize> {
            if stage == 0 {
                owned[b].clone()
            } else {
                0..grads[b].len()
            }
        };
        let src: &[Vec<T>] = if stage == 1 { red } else { &self.grads };
        let local_overflow = self.led.scaler.checks_overflow()
            && (0..nb).any(|b| !all_finite(&src[b][owned_grad(src, b)]));
        let inv = 1.0 / (self.led.scaler.scale() * self.led.cfg.accumulation_steps as f32);
        let mut sq = [(0..nb)
            .map(|b| sq_norm(&src[b][owned_grad(src, b)], inv))
            .sum::<f64>()];
        if self.led.scaler.checks_overflow() {
            let mut flag = [local_overflow as u8];
            self.comm.all_reduce_in_place(&mut flag, ReduceOp::Max)?;
            if flag[0] != 0 {
                return Ok(self.led.skip());
            }
        }
        // In the ring's order, as the device engine's collectives sum it, so that both engines
        // compute the same norm (and clip alike).
        self.comm
            .all_reduce_in_place_with(&mut sq, ReduceOp::Sum, Algo::Ring)?;
        let grad_norm = sq[0].sqrt();
        if !grad_norm.is_finite() {
            return Ok(self.led.skip());
        }
        let clip = clip_factor(self.led.cfg.clip_norm, grad_norm);
        self.led.t += 1;
        let h = self.led.cfg.adamw;
        for b in 0..nb {
            // The stretch of `params[b]` this rank updates, and its gradient.
            let range = match stage {
                0 => 0..self.params[b].len(),
                3 => 0..self.params[b].len(),
                _ => owned[b].clone(),
            };
            let grad: &[T] = match stage {
                1 => &red[b],
                _ => &self.grads[b],
            };
            let p = &mut self.params[b][range];
            if T::IS_F32 {
                let master: &mut [f32] = bytemuck::cast_slice_mut(p);
                adamw_mixed::<T>(
                    &h,
                    self.led.t,
                    master,
                    None,
                    grad,
                    &mut self.m[b],
                    &mut self.v[b],
                    inv * clip,
                );
            } else {
                adamw_mixed(
                    &h,
                    self.led.t,
                    &mut self.master[b],
                    Some(p),
                    grad,
                    &mut self.m[b],
                    &mut self.v[b],
                    inv * clip,
                );
            }
        }
        self.led.scaler.update(false);
        Ok(StepOutcome::Stepped { grad_norm })
    }

    /// Stages 1–2: all-gather bucket b's updated parameters, in pieces of at most
    /// `allgather_elems` elements per call.
    fn gather_updated(&mut self, b: usize) -> Result<(), ZeroError> {
        let n = self.led.part.world;
        let shard = self.led.part.buckets[b].len / n;
        let piece = (self.led.cfg.allgather_elems / n).max(1);
        if shard <= piece {
            self.comm.all_gather_in_place(&mut self.params[b])?;
            return Ok(());
        }
        let own = self.led.part.owned(b, self.led.rank);
        let mut start = 0;
        while start < shard {
            let len = piece.min(shard - start);
            let send = self.params[b][own.start + start..own.start + start + len].to_vec();
            let mut recv = vec![T::default(); len * n];
            self.comm.all_gather(&send, &mut recv)?;
            for r in 0..n {
                let at = r * shard + start;
                self.params[b][at..at + len].copy_from_slice(&recv[r * len..(r + 1) * len]);
            }
            start += len;
        }
        Ok(())
    }

    /// Every parameter's fp32 master values, assembled from all ranks' shards (a collective: call
    /// it on every rank). In name order of the specs.
    pub fn consolidate(&self) -> Result<Vec<(String, Vec<f32>)>, ZeroError> {
        let (stage, n) = (self.led.cfg.stage, self.led.part.world);
        let mut full: Vec<Vec<f32>> = Vec::with_capacity(self.led.part.buckets.len());
        for b in 0..self.led.part.buckets.len() {
            let len = self.led.part.buckets[b].len;
            let mine: Vec<f32> = if !T::IS_F32 {
                self.master[b].clone()
            } else if stage == 3 {
                bytemuck::cast_slice(&self.params[b]).to_vec()
            } else {
                bytemuck::cast_slice(&self.params[b][self.led.part.owned(b, self.led.rank)])
                    .to_vec()
            };
            if stage == 0 && !T::IS_F32 {
                full.push(mine);
                continue;
            }
            let mut out = vec![0f32; len];
            debug_assert_eq!(mine.len(), len / n);
            self.comm.all_gather(&mine, &mut out)?;
            full.push(out);
        }
        Ok(self.led.part.by_param(&full))
    }

    /// Bytes held now, by category.
    pub fn memory(&self) -> Memory {
        let sz = std::mem::size_of::<T>();
        let elems = |v: &Vec<Vec<T>>| v.iter().map(|x| x.len()).sum::<usize>();
        let f32s = |v: &Vec<Vec<f32>>| v.iter().map(|x| x.len() * 4).sum::<usize>();
        let held = |v: &Vec<Option<Vec<T>>>| v.iter().flatten().map(|x| x.len()).sum::<usize>();
        let flying = |v: &InFlight<T>| v.iter().flatten().map(|(_, e)| e).sum::<usize>();
        Memory {
            params: elems(&self.params) * sz,
            grads: elems(&self.grads) * sz,
            optimizer: f32s(&self.m) + f32s(&self.v) + f32s(&self.master),
            comm_buffers: (held(&self.staging)
                + held(&self.gathered)
                + flying(&self.inflight)
                + flying(&self.pending))
                * sz,
        }
    }
}

#[cfg(test)]
mod node_major_tests {
    use super::node_major;

    #[test]
    fn node_major_keeps_node_major_numbering_and_regroups_round_robin() {
        assert_eq!(node_major(&["a", "a", "b", "b"]), [0, 1, 2, 3]);
        assert_eq!(node_major(&["a", "b", "a", "b"]), [0, 2, 1, 3]);
        assert_eq!(
            node_major(&["b", "a", "c", "a", "b", "c"]),
            [0, 4, 1, 3, 2, 5]
        );
        assert_eq!(node_major::<&str>(&[]), Vec::<usize>::new());
    }
}
