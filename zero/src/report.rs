//! What the engines report: the bytes they hold ([`Memory`]), what a step did ([`StepOutcome`]),
//! the time the trainer waited on communication ([`CommWait`]), and where one optimizer step's
//! wall time went ([`StepReport`], DeepSpeed's `wall_clock_breakdown`).

use std::time::Duration;

/// Bytes the engine holds, by category and tier: the engine's device (its stream's memory: a
/// GPU's, or the host's for an engine on the host stream), host memory the offload tier keeps
/// (`offload_optimizer` / `offload_param` on `"cpu"`, page-locked on a GPU), and the NVMe
/// tier's file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Memory {
    /// Parameters in `T` on the device (full, or the owned shards in stage 3).
    pub params: usize,
    /// Gradients in `T` (full in stages 0–1, owned shards in 2–3).
    pub grads: usize,
    /// Optimizer state on the device: the rule's states (Adam's two moments, Lion's or SGD's
    /// one, plain SGD's none), plus fp32 master weights when `T` is 16-bit (full in stage 0,
    /// owned shards otherwise).
    pub optimizer: usize,
    /// Communication buffers held right now (stage 2–3 gradient staging and reduce-scatters in
    /// flight, stage 3 gathered and prefetching parameters).
    pub comm_buffers: usize,
    /// The most communication buffers the engine held at once since it was built (in use or
    /// kept): a stage-3 forward's gathered window and prefetches, buckets in flight, at their
    /// largest. What a process's peak needs, where `comm_buffers` is one moment's.
    pub comm_buffers_peak: usize,
    /// Host tier: stage-3 parameter shards (`offload_param`).
    pub host_params: usize,
    /// Host tier: the offloaded buckets' fp32 master weights (in every precision: the CPU
    /// steps the master and copies the parameters to the device) and optimizer states.
    pub host_optimizer: usize,
    /// Host tier: the offload pipeline's buffers (two gradient buffers unless every bucket's
    /// gradients leave during backward; two parameter buffers unless every bucket's parameters
    /// go back from its f32 master or are written in place into a stage-3 shard in host
    /// memory; each of the largest update range; a gradient copy per bucket made during
    /// backward; three NVMe regions).
    pub host_buffers: usize,
    /// NVMe tier: the file holding the offloaded buckets' master weights and states (each
    /// stretch rounded up to 4096 bytes).
    pub nvme_optimizer: usize,
    /// NVMe tier: the file holding stage 3's parameter shards (`offload_param` on `"nvme"`;
    /// each shard rounded up to 4096 bytes).
    pub nvme_params: usize,
}

impl Memory {
    /// Model states on the device: params + grads + optimizer (what the paper's formulas
    /// count).
    pub fn model_states(&self) -> usize {
        self.params + self.grads + self.optimizer
    }

    /// Everything the engine holds in host memory off the device (the offload tier).
    pub fn host(&self) -> usize {
        self.host_params + self.host_optimizer + self.host_buffers
    }
}

/// One line in MiB: the device's categories, then the host and NVMe tiers where the config
/// offloads (`params 0.33 MiB, grads 0.33 MiB, optimizer 0.66 MiB, comm buffers 0.00 MiB (peak
/// 0.50 MiB)`).
impl std::fmt::Display for Memory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
        write!(
            f,
            "params {:.2} MiB, grads {:.2} MiB, optimizer {:.2} MiB, comm buffers {:.2} MiB \
             (peak {:.2} MiB)",
            mib(self.params),
            mib(self.grads),
            mib(self.optimizer),
            mib(self.comm_buffers),
            mib(self.comm_buffers_peak)
        )?;
        if self.host() > 0 {
            write!(
                f,
                "; host: params {:.2} MiB, optimizer {:.2} MiB, buffers {:.2} MiB",
                mib(self.host_params),
                mib(self.host_optimizer),
                mib(self.host_buffers)
            )?;
        }
        if self.nvme_optimizer + self.nvme_params > 0 {
            write!(
                f,
                "; nvme: optimizer {:.2} MiB, params {:.2} MiB",
                mib(self.nvme_optimizer),
                mib(self.nvme_params)
            )?;
        }
        Ok(())
    }
}

/// What the offloaded part of one optimizer step moved and spent (all zero without offload).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OffloadStats {
    /// Time the CPU optimizer stage took (all buckets, wall time on the calling thread; on
    /// NVMe it includes waiting for the reads and writes it overlaps).
    pub cpu_step: Duration,
    /// Time the step waited for gradients to arrive from the device (what the pipeline did
    /// not hide).
    pub device_wait: Duration,
    /// Gradient bytes copied device → host.
    pub to_host: u64,
    /// Parameter bytes copied host → device.
    pub to_device: u64,
    /// Bytes read from the NVMe tier.
    pub nvme_read: u64,
    /// Bytes written to the NVMe tier.
    pub nvme_written: u64,
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
    /// The part of `update` spent all-gathering the updated parameters (stages 1–2).
    pub share: Duration,
}

impl std::ops::Sub for CommWait {
    type Output = CommWait;
    fn sub(self, o: CommWait) -> CommWait {
        CommWait {
            gather: self.gather.saturating_sub(o.gather),
            reduce: self.reduce.saturating_sub(o.reduce),
            update: self.update.saturating_sub(o.update),
            share: self.share.saturating_sub(o.share),
        }
    }
}

/// A part of a micro-step the trainer times with [`crate::Engine::phase`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// The forward pass.
    Forward,
    /// The backward pass.
    Backward,
}

/// Where one optimizer step's wall time went, over its micro-steps ([`crate::Engine::report`];
/// logged after each step with `wall_clock_breakdown`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepReport {
    /// The optimizer step it describes (1, 2, ...; skipped steps count).
    pub step: u64,
    /// Micro-steps in it.
    pub micro_steps: usize,
    /// From the first micro-step's start (the previous step's end) to this step's end.
    pub wall: Duration,
    /// Time the trainer marked as forward ([`Phase::Forward`]).
    pub forward: Duration,
    /// Time the trainer marked as backward ([`Phase::Backward`]).
    pub backward: Duration,
    /// Time inside [`crate::Engine::step`] (the micro-steps' ends and the optimizer step).
    pub in_step: Duration,
    /// Time waiting on the engine's communication, by kind, wherever it fell (a gather's wait
    /// is inside the phase that gathered; `update` includes the optimizer's kernels).
    pub wait: CommWait,
    /// Stage 3: bucket elements all-gathered.
    pub gathered_elems: u64,
    /// The offloaded optimizer step's traffic and times (zero without offload).
    pub offload: OffloadStats,
}

impl std::fmt::Display for StepReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        write!(
            f,
            "step {} ({} micro-step{}): {:.1} ms = forward {:.1} + backward {:.1} + step {:.1} + \
             other {:.1}; waits: gather {:.1}, reduce {:.1}, update {:.1} (sharing the updated parameters \
             {:.1}); {} elements gathered",
            self.step,
            self.micro_steps,
            if self.micro_steps == 1 { "" } else { "s" },
            ms(self.wall),
            ms(self.forward),
            ms(self.backward),
            ms(self.in_step),
            ms(self
                .wall
                .saturating_sub(self.forward + self.backward + self.in_step)),
            ms(self.wait.gather),
            ms(self.wait.reduce),
            ms(self.wait.update),
            ms(self.wait.share),
            self.gathered_elems
        )?;
        let o = &self.offload;
        if o.to_host + o.to_device > 0 {
            let mb = |b: u64| b as f64 / 1e6;
            write!(
                f,
                "; offload: cpu step {:.1} ms, waited {:.1} ms, {:.1} MB to host, {:.1} MB to \
                 device, nvme {:.1} MB read, {:.1} MB written",
                ms(o.cpu_step),
                ms(o.device_wait),
                mb(o.to_host),
                mb(o.to_device),
                mb(o.nvme_read),
                mb(o.nvme_written)
            )?;
        }
        Ok(())
    }
}

/// The engine's clock for [`StepReport`]s: the open phase and what the current optimizer step
/// has gathered so far.
pub(crate) struct StepTimer {
    started: std::time::Instant,
    open: Option<(Phase, std::time::Instant)>,
    forward: Duration,
    backward: Duration,
    in_step: Duration,
    micro: usize,
    wait_at_start: CommWait,
    gathered_at_start: u64,
}

impl StepTimer {
    /// A step starting `now`, the engine's counters at `wait` and `gathered`.
    pub(crate) fn new(now: std::time::Instant, wait: CommWait, gathered: u64) -> StepTimer {
        StepTimer {
            started: now,
            open: None,
            forward: Duration::ZERO,
            backward: Duration::ZERO,
            in_step: Duration::ZERO,
            micro: 0,
            wait_at_start: wait,
            gathered_at_start: gathered,
        }
    }

    /// Close the open phase at `now` and open `p` (or none).
    pub(crate) fn phase(&mut self, p: Option<Phase>, now: std::time::Instant) {
        if let Some((q, since)) = self.open.take() {
            let d = now.saturating_duration_since(since);
            match q {
                Phase::Forward => self.forward += d,
                Phase::Backward => self.backward += d,
            }
        }
        self.open = p.map(|p| (p, now));
    }

    /// A micro-step's [`crate::Engine::step`] began at `now` (the open phase ends).
    pub(crate) fn micro_step(&mut self, now: std::time::Instant) {
        self.phase(None, now);
        self.micro += 1;
    }

    /// `d` spent inside [`crate::Engine::step`].
    pub(crate) fn stepped(&mut self, d: Duration) {
        self.in_step += d;
    }

    /// Optimizer step `step` ended at `now` with the engine's counters at `wait` and
    /// `gathered`: its report; the timer starts the next step.
    pub(crate) fn finish(
        &mut self,
        step: u64,
        (wait, gathered): (CommWait, u64),
        now: std::time::Instant,
    ) -> StepReport {
        let r = StepReport {
            step,
            micro_steps: self.micro,
            wall: now.saturating_duration_since(self.started),
            forward: self.forward,
            backward: self.backward,
            in_step: self.in_step,
            wait: wait - self.wait_at_start,
            gathered_elems: gathered - self.gathered_at_start,
            offload: OffloadStats::default(),
        };
        *self = StepTimer::new(now, wait, gathered);
        r
    }
}

#[cfg(test)]
mod tests {
    use super::Memory;

    #[test]
    fn memory_prints_the_tiers_it_holds_in_mib() {
        let mut m = Memory {
            params: 3 << 19,
            grads: 1 << 20,
            optimizer: 2 << 20,
            comm_buffers_peak: 1 << 18,
            ..Memory::default()
        };
        assert_eq!(
            m.to_string(),
            "params 1.50 MiB, grads 1.00 MiB, optimizer 2.00 MiB, comm buffers 0.00 MiB \
             (peak 0.25 MiB)"
        );
        m.host_optimizer = 4 << 20;
        m.nvme_params = 1 << 20;
        let s = m.to_string();
        assert!(
            s.ends_with(
                "; host: params 0.00 MiB, optimizer 4.00 MiB, buffers 0.00 MiB; \
                 nvme: optimizer 0.00 MiB, params 1.00 MiB"
            ),
            "{s}"
        );
    }
}
