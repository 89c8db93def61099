//! The ZeRO engine: owns parameter storage, gradients, optimizer state and all communication; the
//! trainer owns forward and backward.
//!
//! Per micro-step the trainer reads parameters ([`Engine::param`]; stage 3: between
//! [`Engine::gather`] and [`Engine::release`]), pushes one gradient per parameter
//! ([`Engine::push_grad`]) and calls [`Engine::step`]; every `accumulation_steps` calls the step is
//! an optimizer step (the accumulation boundary).
//!
//! | stage | parameters      | gradients                                    | Adam moments |
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
//! world sizes' data-parallel baseline (tested). With several accumulation steps stages 2–3 sum
//! reduced micro-gradients rather than reducing the summed gradient, which rounds differently.
//!
//! This version keeps fp32 parameters (which serve as their own master copy); 16-bit parameters with
//! fp32 masters, loss scaling and prefetch are the next steps (see the crate docs).

use ringzero_collectives::{Communicator, ReduceOp};
use ringzero_kernels::cpu::{adamw_step, AdamW};

use crate::partition::{ParamSpec, Partition};

/// Engine configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct ZeroConfig {
    /// ZeRO stage, 0–3.
    pub stage: u8,
    /// Largest bucket, in elements.
    pub bucket_elems: usize,
    /// Micro-steps per optimizer step.
    pub accumulation_steps: usize,
    /// Clip gradients to this global L2 norm.
    pub clip_norm: Option<f32>,
    /// Optimizer.
    pub adamw: AdamW,
}

impl Default for ZeroConfig {
    fn default() -> Self {
        ZeroConfig {
            stage: 1,
            bucket_elems: 1 << 20,
            accumulation_steps: 1,
            clip_norm: None,
            adamw: AdamW::default(),
        }
    }
}

/// Errors of the engine: bad input (nothing changed) or a failed collective.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ZeroError {
    /// The configuration cannot work.
    #[error("ZeRO config: {0}")]
    Config(String),
    /// A parameter name the engine does not know.
    #[error("unknown parameter `{0}`")]
    UnknownParam(String),
    /// A gradient of the wrong length.
    #[error("gradient for `{name}` has {got} elements, the parameter has {want}")]
    GradLength {
        /// Parameter.
        name: String,
        /// Elements pushed.
        got: usize,
        /// Elements expected.
        want: usize,
    },
    /// A gradient pushed twice in one micro-step.
    #[error("gradient for `{0}` was already pushed in this micro-step")]
    GradTwice(String),
    /// `step` before every gradient was pushed.
    #[error("step: no gradient pushed for {0}")]
    MissingGrads(String),
    /// Stage 3: a parameter read while not gathered.
    #[error("parameter `{0}` is not gathered (stage 3: call gather before reading it)")]
    NotGathered(String),
    /// Stage 3: a gather of something already gathered.
    #[error("parameter `{0}` is already gathered")]
    AlreadyGathered(String),
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] ringzero_collectives::Error),
}

/// Bytes the engine holds, by category.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Memory {
    /// Parameters (full, or the owned shards in stage 3).
    pub params: usize,
    /// Gradients (full in stages 0–1, owned shards in 2–3).
    pub grads: usize,
    /// Optimizer state (Adam moments; full in stage 0, owned shards otherwise).
    pub optimizer: usize,
    /// Communication buffers held right now (stage 2–3 gradient staging, stage 3 gathered
    /// parameters).
    pub comm_buffers: usize,
}

/// What a call to [`Engine::step`] did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum StepOutcome {
    /// A micro-step inside the accumulation window.
    Accumulated,
    /// An optimizer step; the global gradient norm before clipping.
    Stepped {
        /// Global L2 norm of the averaged gradient.
        grad_norm: f64,
    },
}

/// The ZeRO engine on one rank.
pub struct Engine<'c> {
    comm: &'c Communicator,
    cfg: ZeroConfig,
    part: Partition,
    rank: usize,
    /// Per bucket: the whole bucket (stages 0–2) or this rank's shard (stage 3).
    params: Vec<Vec<f32>>,
    /// Stage 3: whole buckets gathered for compute.
    gathered: Vec<Option<Vec<f32>>>,
    /// Per bucket: the whole bucket (stages 0–1) or this rank's shard (stages 2–3).
    grads: Vec<Vec<f32>>,
    /// Stages 2–3: a bucket's gradients while backward fills it.
    staging: Vec<Option<Vec<f32>>>,
    pushed: Vec<bool>,
    m: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    micro: usize,
    t: u64,
}

impl<'c> Engine<'c> {
    /// An engine for `specs` on `comm`, every parameter element initialised by `init(param index,
    /// element index)` (the same function on every rank, so no broadcast is needed).
    pub fn new(
        comm: &'c Communicator,
        specs: &[ParamSpec],
        init: &dyn Fn(usize, usize) -> f32,
        cfg: ZeroConfig,
    ) -> Result<Engine<'c>, ZeroError> {
        if cfg.stage > 3 {
            return Err(ZeroError::Config(format!(
                "stage {} does not exist (expected 0, 1, 2 or 3)",
                cfg.stage
            )));
        }
        if cfg.accumulation_steps == 0 {
            return Err(ZeroError::Config(
                "accumulation_steps must be at least 1".into(),
            ));
        }
        if cfg.clip_norm.is_some_and(|c| !(c > 0.0 && c.is_finite())) {
            return Err(ZeroError::Config(
                "clip_norm must be a positive number".into(),
            ));
        }
        let (n, rank) = (comm.size(), comm.rank());
        let part = Partition::new(specs, n, cfg.bucket_elems)
            .map_err(|e| ZeroError::Config(e.to_string()))?;
        let mut full: Vec<Vec<f32>> = part.buckets.iter().map(|b| vec![0f32; b.len]).collect();
        for (i, s) in part.slots.iter().enumerate() {
            for (k, x) in full[s.bucket][s.offset..s.offset + s.len]
                .iter_mut()
                .enumerate()
            {
                *x = init(i, k);
            }
        }
        let stage = cfg.stage;
        let shard = |b: usize| part.buckets[b].len / n;
        let params = if stage == 3 {
            full.iter()
                .enumerate()
                .map(|(b, f)| f[part.owned(b, rank)].to_vec())
                .collect()
        } else {
            full
        };
        let nb = part.buckets.len();
        let grads = (0..nb)
            .map(|b| {
                vec![
                    0f32;
                    if stage >= 2 {
                        shard(b)
                    } else {
                        part.buckets[b].len
                    }
                ]
            })
            .collect();
        let opt = |b: usize| {
            vec![
                0f32;
                if stage == 0 {
                    part.buckets[b].len
                } else {
                    shard(b)
                }
            ]
        };
        Ok(Engine {
            comm,
            rank,
            params,
            gathered: vec![None; nb],
            grads,
            staging: vec![None; nb],
            pushed: vec![false; specs.len()],
            m: (0..nb).map(opt).collect(),
            v: (0..nb).map(opt).collect(),
            micro: 0,
            t: 0,
            part,
            cfg,
        })
    }

    /// The layout.
    pub fn partition(&self) -> &Partition {
        &self.part
    }

    /// The configuration.
    pub fn config(&self) -> &ZeroConfig {
        &self.cfg
    }

    /// Optimizer steps taken.
    pub fn steps(&self) -> u64 {
        self.t
    }

    fn index(&self, name: &str) -> Result<usize, ZeroError> {
        self.part
            .index(name)
            .ok_or_else(|| ZeroError::UnknownParam(name.to_string()))
    }

    /// The current values of parameter `name` (stage 3: only while gathered).
    pub fn param(&self, name: &str) -> Result<&[f32], ZeroError> {
        let s = self.part.slots[self.index(name)?];
        let bucket = if self.cfg.stage == 3 {
            self.gathered[s.bucket]
                .as_deref()
                .ok_or_else(|| ZeroError::NotGathered(name.to_string()))?
        } else {
            &self.params[s.bucket]
        };
        Ok(&bucket[s.offset..s.offset + s.len])
    }

    /// Stage 3: all-gather the buckets holding `names` so they can be read. A no-op in stages 0–2.
    /// Gathering something already gathered is an error, and nothing is gathered then.
    pub fn gather(&mut self, names: &[&str]) -> Result<(), ZeroError> {
        let buckets = self.buckets_of(names)?;
        if self.cfg.stage != 3 {
            return Ok(());
        }
        for (b, name) in &buckets {
            if self.gathered[*b].is_some() {
                return Err(ZeroError::AlreadyGathered(name.clone()));
            }
        }
        for (b, _) in buckets {
            if self.gathered[b].is_none() {
                let mut full = vec![0f32; self.part.buckets[b].len];
                self.comm.all_gather(&self.params[b], &mut full)?;
                self.gathered[b] = Some(full);
            }
        }
        Ok(())
    }

    /// Stage 3: drop the gathered buckets holding `names`. A no-op in stages 0–2.
    pub fn release(&mut self, names: &[&str]) -> Result<(), ZeroError> {
        let buckets = self.buckets_of(names)?;
        if self.cfg.stage != 3 {
            return Ok(());
        }
        for (b, name) in &buckets {
            if self.gathered[*b].is_none() {
                return Err(ZeroError::NotGathered(name.clone()));
            }
        }
        for (b, _) in buckets {
            self.gathered[b] = None;
        }
        Ok(())
    }

    fn buckets_of(&self, names: &[&str]) -> Result<Vec<(usize, String)>, ZeroError> {
        let mut out: Vec<(usize, String)> = Vec::new();
        for n in names {
            let b = self.part.slots[self.index(n)?].bucket;
            if !out.iter().any(|(x, _)| *x == b) {
                out.push((b, n.to_string()));
            }
        }
        Ok(out)
    }

    /// Add this micro-step's gradient of `name`. In stages 2–3 a bucket is reduce-scattered as
    /// soon as all its gradients are in.
    pub fn push_grad(&mut self, name: &str, grad: &[f32]) -> Result<(), ZeroError> {
        let i = self.index(name)?;
        let s = self.part.slots[i];
        if grad.len() != s.len {
            return Err(ZeroError::GradLength {
                name: name.into(),
                got: grad.len(),
                want: s.len,
            });
        }
        if self.pushed[i] {
            return Err(ZeroError::GradTwice(name.into()));
        }
        let len = self.part.buckets[s.bucket].len;
        let dst = if self.cfg.stage >= 2 {
            self.staging[s.bucket].get_or_insert_with(|| vec![0f32; len])
        } else {
            &mut self.grads[s.bucket]
        };
        for (d, g) in dst[s.offset..s.offset + s.len].iter_mut().zip(grad) {
            *d += g;
        }
        self.pushed[i] = true;
        if self.cfg.stage >= 2
            && self.part.buckets[s.bucket]
                .params
                .iter()
                .all(|&p| self.pushed[p])
        {
            let full = self.staging[s.bucket].take().expect("filled above");
            let mut shard = vec![0f32; len / self.part.world];
            self.comm.reduce_scatter(&full, &mut shard, ReduceOp::Avg)?;
            for (g, x) in self.grads[s.bucket].iter_mut().zip(&shard) {
                *g += x;
            }
        }
        Ok(())
    }

    /// End a micro-step; at the accumulation boundary, reduce gradients, clip, run AdamW on what
    /// this rank owns and share the result.
    pub fn step(&mut self) -> Result<StepOutcome, ZeroError> {
        let missing: Vec<&str> = (0..self.pushed.len())
            .filter(|&i| !self.pushed[i])
            .map(|i| self.part.specs[i].name.as_str())
            .collect();
        if !missing.is_empty() {
            return Err(ZeroError::MissingGrads(missing.join(", ")));
        }
        self.pushed.iter_mut().for_each(|p| *p = false);
        self.micro += 1;
        if self.micro < self.cfg.accumulation_steps {
            return Ok(StepOutcome::Accumulated);
        }
        self.micro = 0;
        let (stage, n, rank) = (self.cfg.stage, self.part.world, self.rank);
        // Reduce what is not reduced yet.
        for b in 0..self.part.buckets.len() {
            match stage {
                0 => self
                    .comm
                    .all_reduce_in_place(&mut self.grads[b], ReduceOp::Avg)?,
                1 => {
                    let mut shard = vec![0f32; self.part.buckets[b].len / n];
                    self.comm
                        .reduce_scatter(&self.grads[b], &mut shard, ReduceOp::Avg)?;
                    self.grads[b] = shard;
                }
                _ => {}
            }
        }
        // The owned gradient range of bucket b, whatever the stage keeps.
        let owned_grad = |e: &Engine, b: usize| -> std::ops::Range<usize> {
            if stage == 0 {
                e.part.owned(b, rank)
            } else {
                0..e.grads[b].len()
            }
        };
        let scale = 1.0 / self.cfg.accumulation_steps as f32;
        let mut sq = vec![0f64];
        for b in 0..self.part.buckets.len() {
            let r = owned_grad(self, b);
            sq[0] += self.grads[b][r]
                .iter()
                .map(|&g| ((g * scale) as f64).powi(2))
                .sum::<f64>();
        }
        self.comm.all_reduce_in_place(&mut sq, ReduceOp::Sum)?;
        let grad_norm = sq[0].sqrt();
        let clip = self
            .cfg
            .clip_norm
            .map_or(1.0, |c| ((c as f64) / (grad_norm + 1e-6)).min(1.0) as f32);
        self.t += 1;
        for b in 0..self.part.buckets.len() {
            let owned = self.part.owned(b, rank);
            let p: &mut [f32] = match stage {
                0 => &mut self.params[b],
                3 => &mut self.params[b],
                _ => &mut self.params[b][owned],
            };
            adamw_step(
                &self.cfg.adamw,
                self.t,
                p,
                &self.grads[b],
                &mut self.m[b],
                &mut self.v[b],
                scale * clip,
            );
            if stage == 1 {
                // Back to a whole bucket for the next accumulation window.
                self.grads[b] = vec![0f32; self.part.buckets[b].len];
            } else {
                self.grads[b].iter_mut().for_each(|g| *g = 0.0);
            }
            if stage == 1 || stage == 2 {
                self.comm.all_gather_in_place(&mut self.params[b])?;
            }
        }
        Ok(StepOutcome::Stepped { grad_norm })
    }

    /// Bytes held now, by category.
    pub fn memory(&self) -> Memory {
        let bytes = |v: &Vec<Vec<f32>>| v.iter().map(|x| x.len() * 4).sum::<usize>();
        let held =
            |v: &Vec<Option<Vec<f32>>>| v.iter().flatten().map(|x| x.len() * 4).sum::<usize>();
        Memory {
            params: bytes(&self.params),
            grads: bytes(&self.grads),
            optimizer: bytes(&self.m) + bytes(&self.v),
            comm_buffers: held(&self.staging) + held(&self.gathered),
        }
    }
}
