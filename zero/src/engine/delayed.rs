//! The delayed parameter update (the ZeRO-Offload paper's DPU, opt-in:
//! [`crate::OffloadOptimizer::delayed_update_after`]): optimizer step t's CPU update runs on a
//! thread of its own while the trainer computes step t+1's forward and backward, and lands —
//! the new parameters copied to the device and (stages 1–2) all-gathered — at the start of step
//! t+1's optimizer step, before that step's update begins.
//!
//! So the gradients of step t+1 are computed on the parameters from before step t's update (one
//! step stale) and applied to the parameters after it: the trainer sees each update one step
//! late. [`Engine::flush`] lands the update in flight (the end of training, before reading
//! parameters that must be current); checkpoints land it first themselves.

use std::time::{Duration, Instant};

use ringzero_collectives::TrainStream;
use ringzero_kernels::cpu::{Float, Optimizer};

use super::buffers::{dev, DevVec};
use super::offload::{cpu_step, on_host, Target};
use super::Engine;
use crate::error::ZeroError;
use crate::swap::{Staged, Swap};

/// One bucket's CPU update: where it lands, its gradients and new parameters (host buffers of
/// its length), its segments, and its master and states (host addresses; none on NVMe).
struct Job {
    target: Target,
    grads: DevVec,
    params: DevVec,
    segs: Vec<(usize, usize, Optimizer)>,
    state: Option<(usize, Vec<usize>)>,
}

/// What the thread hands back.
struct Done {
    jobs: Vec<Job>,
    swap: Option<(Swap, Vec<Staged>)>,
    cpu_step: Duration,
}

/// The update in flight.
pub(super) struct InFlight(std::thread::JoinHandle<Result<Done, ZeroError>>);

impl InFlight {
    /// Wait for the thread and drop what it did (the engine is going away).
    pub(super) fn wait(self) {
        if let Ok(Err(e)) = self.0.join() {
            tracing::warn!(target: "ringzero::zero", "the delayed update failed: {e}");
        }
    }
}

impl<T: Float, S: TrainStream + 'static> Engine<T, S> {
    /// Whether optimizer step `t` (counting from 1) is delayed.
    pub(super) fn delays(&self, t: u64) -> bool {
        self.led
            .cfg
            .offload
            .optimizer
            .delayed_update_after
            .is_some_and(|k| t > k)
    }

    /// Start step `t`'s update of every bucket on a thread (see the module docs): the reduced
    /// gradients copied to the host now, the CPU step later.
    pub(super) fn launch_delayed(
        &mut self,
        targets: &[Target],
        h: &Optimizer,
        t: u64,
        scale: f32,
    ) -> Result<(), ZeroError> {
        let es = T::DTYPE.size();
        let s = self.comm.stream();
        let mut jobs = Vec::with_capacity(targets.len());
        // The buffers the engine made for it, or the last update's, one pair per bucket in
        // the same order (on a GPU a new host buffer is a page-locking driver call).
        let mut kept = std::mem::take(&mut self.tier.delayed_bufs).into_iter();
        for &tg in targets {
            let (grads, params) = match kept.next() {
                Some(pair) => pair,
                None => (
                    super::alloc_host(s, T::DTYPE, tg.len)?,
                    super::alloc_host(s, T::DTYPE, tg.len)?,
                ),
            };
            // SAFETY: `tg.len` elements of `T` of the engine's reduced gradients into a fresh
            // host buffer of that many; waited for below before the thread reads it.
            unsafe { s.copy(grads.addr, tg.grads, tg.len * es) }
                .map_err(dev("copying gradients to the host".into()))?;
            let state = self.master[tg.b].as_ref().map(|m| {
                let host = |v: &DevVec| v.host.expect("host-tier state");
                (host(m), self.states[tg.b].iter().map(host).collect())
            });
            jobs.push(Job {
                target: tg,
                grads,
                params,
                segs: self.led.update_segments(tg.b, tg.from, tg.len, h),
                state,
            });
        }
        self.sync("copying gradients to the host")?;
        self.tier.stats.to_host += (targets.iter().map(|t| t.len).sum::<usize>() * es) as u64;
        let mut swap = self.tier.swap.take();
        self.tier.delayed_held = jobs.iter().map(|j| 2 * j.target.len * es).sum::<usize>()
            + swap
                .as_ref()
                .map_or(0, |(_, st)| st.iter().map(Staged::capacity).sum());
        let threads = self.tier.threads();
        let work = move || -> Result<Done, ZeroError> {
            let c0 = Instant::now();
            for j in &jobs {
                let n = j.target.len;
                // SAFETY: the thread owns these host buffers until it hands them back; the
                // copy into `grads` ended before it started.
                let (g, p) =
                    unsafe { (on_host::<T>(&j.grads, 0, n), on_host::<T>(&j.params, 0, n)) };
                match (&j.state, swap.as_mut()) {
                    (Some((m, st)), _) => {
                        // SAFETY: the bucket's host master and states, `n` f32s each, which
                        // nothing else touches while an update is in flight (the engine lands
                        // it before any other use).
                        let (m, mut st): (&mut [f32], Vec<&mut [f32]>) = unsafe {
                            (
                                std::slice::from_raw_parts_mut(*m as *mut f32, n),
                                st.iter()
                                    .map(|&a| std::slice::from_raw_parts_mut(a as *mut f32, n))
                                    .collect(),
                            )
                        };
                        cpu_step(&j.segs, t, m, &mut st, g, Some(p), scale, threads);
                    }
                    (None, Some((sw, staged))) => {
                        let b = j.target.b;
                        sw.read(b, &mut staged[0])?;
                        let mut parts = staged[0].parts_mut();
                        let (m, st) = parts.split_first_mut().expect("a master");
                        cpu_step(&j.segs, t, m, st, g, Some(p), scale, threads);
                        sw.write(b, &mut staged[0])?;
                    }
                    (None, None) => unreachable!("an offloaded bucket has a master or a file"),
                }
            }
            Ok(Done {
                jobs,
                swap,
                cpu_step: c0.elapsed(),
            })
        };
        let handle = std::thread::Builder::new()
            .name("ringzero-delayed-update".into())
            .spawn(work)
            .map_err(|e| {
                ZeroError::Offload(format!("starting the delayed update's thread: {e}"))
            })?;
        self.tier.delayed = Some(InFlight(handle));
        Ok(())
    }

    /// Land the update in flight, if any: wait for its thread, copy the new parameters to the
    /// device and (stages 1–2) all-gather them.
    pub(super) fn land_delayed(&mut self) -> Result<(), ZeroError> {
        let Some(InFlight(handle)) = self.tier.delayed.take() else {
            return Ok(());
        };
        let w0 = Instant::now();
        // No deadline here, as for the host stream's own work: the thread only computes and
        // reads and writes a local file, waits on no other rank, and owns raw pointers into the
        // host state, which nothing may touch (or free) before it has ended.
        let done = handle
            .join()
            .map_err(|_| ZeroError::Offload("the delayed update's thread panicked".into()))?;
        self.tier.stats.device_wait += w0.elapsed();
        let done = done?;
        self.tier.swap = done.swap;
        self.tier.stats.cpu_step += done.cpu_step;
        let (es, s) = (T::DTYPE.size(), self.comm.stream());
        for j in &done.jobs {
            let tg = j.target;
            if self.put_shard_to_nvme(tg.b, &j.params)? {
                continue;
            }
            // SAFETY: the new parameters (`tg.len` elements of `T`) into the engine's stretch of
            // the bucket; `done.jobs` lives until the sync below.
            unsafe { s.copy(tg.params, j.params.addr, tg.len * es) }
                .map_err(dev("copying updated parameters to the device".into()))?;
            self.tier.stats.to_device += (tg.len * es) as u64;
        }
        let (r, w) = self.tier.nvme_moved_since_last();
        self.tier.stats.nvme_read += r;
        self.tier.stats.nvme_written += w;
        self.sync("copying the delayed update's parameters to the device")?;
        self.tier.delayed_bufs = done.jobs.into_iter().map(|j| (j.grads, j.params)).collect();
        self.tier.delayed_held = 0;
        match self.led.cfg.stage {
            1 | 2 => self.gather_updated(),
            _ => self.refresh_pinned(),
        }
    }

    /// Apply the delayed update in flight now ([`crate::OffloadOptimizer::delayed_update_after`]):
    /// at the end of training, or before reading parameters that must include every step. Does
    /// nothing without one. A collective at stages 1–2 (the all-gather): every rank calls it.
    pub fn flush(&mut self) -> Result<(), ZeroError> {
        self.land_delayed()
    }

    /// Refuse `call` while a delayed update is in flight (it needs the landed state).
    pub(super) fn nothing_in_flight(&self, call: &'static str) -> Result<(), ZeroError> {
        if self.tier.delayed.is_some() {
            return Err(ZeroError::NotNow {
                call,
                why: "the last optimizer step's delayed update is still in flight; call \
                      Engine::flush first (on every rank)"
                    .into(),
            });
        }
        Ok(())
    }
}
