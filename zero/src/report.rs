//! What the engines report: the bytes they hold ([`Memory`]), what a step did ([`StepOutcome`]),
//! and the time the trainer waited on communication ([`CommWait`]).

use std::time::Duration;

/// Bytes the engine holds, by category.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Memory {
    /// Parameters in `T` (full, or the owned shards in stage 3).
    pub params: usize,
    /// Gradients in `T` (full in stages 0–1, owned shards in 2–3).
    pub grads: usize,
    /// Optimizer state: Adam moments, plus fp32 master weights when `T` is 16-bit (full in stage 0,
    /// owned shards otherwise).
    pub optimizer: usize,
    /// Communication buffers held right now (stage 2–3 gradient staging and reduce-scatters in
    /// flight, stage 3 gathered and prefetching parameters).
    pub comm_buffers: usize,
}

impl Memory {
    /// Model states: params + grads + optimizer (what the paper's formulas count).
    pub fn model_states(&self) -> usize {
        self.params + self.grads + self.optimizer
    }
}

/// What a call to [`crate::Engine::step`] did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum StepOutcome {
    /// A micro-step inside the accumulation window.
    Accumulated,
    /// An optimizer step; the global gradient norm before clipping.
    Stepped {
        /// Global L2 norm of the averaged (unscaled) gradient.
        grad_norm: f64,
    },
    /// An optimizer step skipped on every rank: a gradient overflowed (or its norm is not
    /// finite). The loss scale to use from now on.
    Skipped {
        /// The new loss scale.
        loss_scale: f32,
    },
}

/// Time the trainer spent waiting on the engine's communication (what prefetch and
/// `overlap_comm` try to hide).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CommWait {
    /// Inside [`crate::Engine::gather`] (stage 3).
    pub gather: Duration,
    /// Inside [`crate::Engine::push_grad`] and [`crate::Engine::step`] on gradient reduction.
    pub reduce: Duration,
    /// Inside [`crate::Engine::step`] on the parameter all-gather (stages 1–2) and the norm/overflow
    /// all-reduces.
    pub update: Duration,
}
