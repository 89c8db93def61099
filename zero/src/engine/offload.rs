//! ZeRO-Offload and ZeRO-Infinity's optimizer tier: the fp32 master weights and the optimizer's
//! states of the offloaded buckets live in host memory (page-locked and mapped on a GPU) or in
//! the NVMe tier's file ([`crate::swap`]), and their step runs on the CPU, on this rank's share
//! of the node's cores (the node's ranks step at once), with the arithmetic of the device's
//! kernel ([`step_mixed_threads`]: the same bits).
//!
//! At an optimizer step the offloaded buckets go through a pipeline, one bucket per stage:
//! - **fetch**: the reduced gradient range leaves the device (a copy queued on the stream into
//!   a host buffer) — at stages 2–3 it left already, during backward, as soon as its bucket's
//!   reduce-scatter of the window's last micro-step ended ([`Engine::copy_out_early`]);
//! - **step**: the CPU updates the master and states and rounds the new parameters into a host
//!   buffer (f32 parameters are the master's bits: they go back from the master itself, and
//!   the CPU writes no copy) — while bucket k+1's gradients are copied out and, on NVMe,
//!   bucket k+1's state is read and bucket k−1's written back; and at stages 1–2, while it
//!   steps, the calling thread all-gathers the parameters already back on the device (the
//!   device's own buckets first, then each offloaded bucket after its put), so only the last
//!   bucket's all-gather follows the CPU's work;
//! - **put**: the new parameters go back to the device (a copy queued on the stream), where
//!   stages 1–2 all-gather them and stage 3 keeps its shard.
//!
//! Two host buffers of each kind (gradients, parameters), only of a kind some bucket needs,
//! and three NVMe regions (read ahead, stepping, written back) are all the pipeline holds.
//! With `ratio` below 1 the buckets past the offloaded share step on the device, as without
//! offload.

use std::time::Instant;

use ringzero_collectives::TrainStream;
use ringzero_kernels::cpu::{step_mixed_threads, Float, Optimizer};

use super::buffers::{dev, DevVec, Spares};
use super::Engine;
use crate::config::{OffloadDevice, ZeroConfig};
use crate::error::ZeroError;
use crate::ledger::update_range;
use crate::partition::Partition;
use crate::report::OffloadStats;
use crate::swap::{Staged, Swap};

/// Where the offloaded buckets' optimizer state lives, and the buffers of the pipeline.
pub(super) struct Tier {
    /// Per bucket: where its optimizer state lives ([`OffloadDevice::None`]: on the device).
    pub(super) homes: Vec<OffloadDevice>,
    /// Host buffers for a bucket's gradient range and its updated parameters, in `T`.
    grads: Spares,
    params: Spares,
    /// The NVMe tier's file and its three host regions.
    pub(super) swap: Option<(Swap, Vec<Staged>)>,
    /// Threads the CPU step runs on.
    threads: usize,
    /// What the last optimizer step moved and spent (taken into its [`StepReport`]).
    ///
    /// [`StepReport`]: crate::StepReport
    pub(super) stats: OffloadStats,
    /// The NVMe file's bytes read and written before this step.
    nvme_seen: (u64, u64),
    /// The optimizer's NVMe file's size (the file itself is on a delayed update's thread while
    /// one is in flight).
    pub(super) nvme_bytes: usize,
    /// The delayed update in flight, if any, and the host buffers (gradients, parameters) per
    /// offloaded bucket its updates reuse.
    pub(super) delayed: Option<super::delayed::InFlight>,
    pub(super) delayed_bufs: Vec<(DevVec, DevVec)>,
    /// Bytes of those buffers, and of the NVMe tier's host regions, while an update holds
    /// them.
    pub(super) delayed_held: usize,
    /// Stage 3 with `offload_param` on NVMe: the shards' file, and host buffers (in `T`) a
    /// shard is read into to be gathered (`engine/param_nvme.rs`).
    pub(super) params_file: Option<Swap>,
    pub(super) shard_bufs: Spares,
    /// Stages 2–3: per bucket, its reduced gradient range already copied to the host while
    /// backward went on (`Engine::copy_out_early`), and the kept buffers for those copies.
    pub(super) early: Vec<Option<DevVec>>,
    pub(super) early_bufs: Spares,
    /// Stages 1–2: per bucket, whether this step's pipeline all-gathered its updated
    /// parameters already (while the CPU stepped a later bucket).
    pub(super) gathered: Vec<bool>,
}

/// Per bucket, where its optimizer state goes under `cfg`: buckets in layout order are
/// offloaded until `ratio` of the elements are.
pub(super) fn homes(cfg: &ZeroConfig, part: &Partition) -> Vec<OffloadDevice> {
    let o = &cfg.offload.optimizer;
    let total: usize = part.buckets.iter().map(|b| b.len).sum();
    let share = (o.ratio as f64 * total as f64).ceil() as usize;
    let mut done = 0;
    part.buckets
        .iter()
        .map(|b| {
            if o.device == OffloadDevice::None || done >= share {
                return OffloadDevice::None;
            }
            done += b.len;
            o.device
        })
        .collect()
}

impl Tier {
    /// The tier for buckets at `homes`, whose update ranges are at most `cap` elements of `T`;
    /// the CPU step runs on `threads`.
    pub(super) fn new<T: Float>(homes: Vec<OffloadDevice>, cap: usize, threads: usize) -> Tier {
        let nb = homes.len();
        Tier {
            homes,
            grads: Spares::on_host(T::DTYPE, cap, 2),
            params: Spares::on_host(T::DTYPE, cap, 2),
            swap: None,
            threads: threads.max(1),
            stats: OffloadStats::default(),
            nvme_seen: (0, 0),
            nvme_bytes: 0,
            delayed: None,
            delayed_bufs: Vec::new(),
            delayed_held: 0,
            params_file: None,
            shard_bufs: Spares::on_host(T::DTYPE, cap, 2),
            early: (0..nb).map(|_| None).collect(),
            early_bufs: Spares::on_host(T::DTYPE, cap, nb),
            gathered: vec![false; nb],
        }
    }

    /// Threads the CPU step runs on.
    pub(super) fn threads(&self) -> usize {
        self.threads
    }

    /// With buckets on the NVMe tier: create its file under `nvme_path` and write each such
    /// bucket's initial master (its update range of `full`) and zeroed states (`keeps` of
    /// them).
    pub(super) fn create_swap(
        &mut self,
        cfg: &ZeroConfig,
        rank: usize,
        part: &Partition,
        full: &[Vec<f32>],
        keeps: usize,
    ) -> Result<(), ZeroError> {
        if !self.homes.contains(&OffloadDevice::Nvme) {
            return Ok(());
        }
        let o = &cfg.offload.optimizer;
        let dir = o.nvme_path.as_deref().expect("validated: nvme has a path");
        let stage = cfg.stage;
        let elems: Vec<Option<usize>> = (0..part.buckets.len())
            .map(|b| {
                (self.homes[b] == OffloadDevice::Nvme)
                    .then(|| update_range(part, stage, rank, b).len())
            })
            .collect();
        let swap = Swap::create(
            dir,
            ("optimizer", rank),
            &elems,
            1 + keeps,
            &cfg.offload.aio,
        )?;
        let staged = (0..3).map(|_| swap.staged()).collect();
        self.nvme_bytes = swap.size() as usize;
        self.swap = Some((swap, staged));
        for (b, bucket) in full.iter().enumerate() {
            if self.homes[b] == OffloadDevice::Nvme {
                let r = update_range(part, stage, rank, b);
                let zeros = vec![0f32; r.len()];
                let mut parts = vec![&bucket[r]];
                parts.extend((0..keeps).map(|_| zeros.as_slice()));
                self.write_nvme(b, &parts)?;
            }
        }
        self.nvme_moved_since_last();
        Ok(())
    }

    /// Bytes both NVMe files (the optimizer's, the parameters') read and wrote since the last
    /// call.
    pub(super) fn nvme_moved_since_last(&mut self) -> (u64, u64) {
        let files = [
            self.swap.as_ref().map(|(s, _)| s),
            self.params_file.as_ref(),
        ];
        let (r, w) = files
            .into_iter()
            .flatten()
            .map(Swap::moved)
            .fold((0, 0), |(a, b), (x, y)| (a + x, b + y));
        let (r0, w0) = self.nvme_seen;
        self.nvme_seen = (r, w);
        (r - r0, w - w0)
    }

    /// Whether bucket `b`'s state is off the device.
    pub(super) fn offloaded(&self, b: usize) -> bool {
        self.homes[b] != OffloadDevice::None
    }

    /// Whether bucket `b`'s state is in the NVMe tier.
    pub(super) fn on_nvme(&self, b: usize) -> bool {
        self.homes[b] == OffloadDevice::Nvme
    }

    /// Host bytes the pipeline's buffers hold (gradients, the early copies' and the delayed
    /// update's included, parameters, NVMe regions).
    pub(super) fn buffer_bytes(&self) -> usize {
        let sz = self.grads.dtype.size();
        let delayed: usize = self
            .delayed_bufs
            .iter()
            .map(|(g, p)| g.elems + p.elems)
            .sum::<usize>();
        (self.grads.held() + self.params.held() + self.early_bufs.held() + delayed) * sz
            + self.delayed_held
            + self
                .swap
                .as_ref()
                .map_or(0, |(_, st)| st.iter().map(Staged::capacity).sum())
    }

    /// Bucket `b`'s master and states from the NVMe tier (its update range's f32s each).
    pub(super) fn read_nvme(&self, b: usize) -> Result<Vec<Vec<f32>>, ZeroError> {
        let (swap, _) = self.swap.as_ref().expect("an NVMe tier");
        let mut buf = swap.staged();
        swap.read(b, &mut buf)?;
        Ok(buf.parts_mut().into_iter().map(|p| p.to_vec()).collect())
    }

    /// Write bucket `b`'s master and states (`parts`, each its update range long) to the NVMe
    /// tier.
    /// Through the tier's first host region (free between steps).
    pub(super) fn write_nvme(&mut self, b: usize, parts: &[&[f32]]) -> Result<(), ZeroError> {
        let (swap, staged) = self.swap.as_mut().expect("an NVMe tier");
        let buf = &mut staged[0];
        swap.shape(b, buf);
        for (dst, src) in buf.parts_mut().into_iter().zip(parts) {
            dst.copy_from_slice(src);
        }
        swap.write(b, buf)
    }
}

/// `n` elements of `E` of host-reachable `v`, from element `from`.
///
/// # Safety
/// `v` must be host-reachable (`host` set) and hold `from + n` elements of `E`; no work of the
/// stream may touch the range, and no other borrow of it may live, while the slice does.
pub(super) unsafe fn on_host<'a, E>(v: &DevVec, from: usize, n: usize) -> &'a mut [E] {
    let h = v.host.expect("a host-reachable buffer");
    if n == 0 {
        return &mut [];
    }
    // SAFETY: guaranteed by the caller.
    unsafe { std::slice::from_raw_parts_mut((h as *mut E).add(from), n) }
}

/// One offloaded bucket's update: where its parameters' stretch and reduced gradients are on
/// the device, its length, and where it starts in the bucket.
#[derive(Clone, Copy)]
pub(super) struct Target {
    pub(super) b: usize,
    pub(super) params: u64,
    pub(super) grads: u64,
    pub(super) len: usize,
    pub(super) from: usize,
}

/// Where an offloaded bucket's updated parameters go from the CPU step.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Out {
    /// Rounded into a host buffer, then copied to the device (or written to the shards' NVMe
    /// file).
    Buffer,
    /// f32 parameters are the master's bits: copied to the device from the master itself, so
    /// the CPU writes no second copy (a quarter less memory traffic in its step). Not for a
    /// master in the NVMe tier's regions, nor where the shards go to NVMe (the file writes
    /// whole page-aligned regions from the parameter buffer).
    Master,
    /// Stage 3 with `offload_param` on the CPU: the shard is host memory, and the CPU step
    /// writes it in place; nothing is copied.
    Shard,
}

impl<T: Float, S: TrainStream + 'static> Engine<T, S> {
    /// The offloaded buckets' optimizer step `t` (see the module docs), gradients scaled by
    /// `scale`; stage 1's reduced ranges are `red`.
    pub(super) fn offload_update(
        &mut self,
        red: &[Option<DevVec>],
        h: &Optimizer,
        t: u64,
        scale: f32,
    ) -> Result<(), ZeroError> {
        let rank = self.led.rank;
        let targets: Vec<Target> = (0..self.params.len())
            .filter(|&b| self.tier.offloaded(b))
            .map(|b| {
                let own = self.led.part.owned(b, rank);
                let params = match self.led.cfg.stage {
                    3 => self.params[b].addr,
                    _ => self.params[b].at(own.start),
                };
                let grads = red[b].as_ref().map_or(self.grads[b].addr, |r| r.addr);
                Target {
                    b,
                    params,
                    grads,
                    len: own.len(),
                    from: own.start,
                }
            })
            .collect();
        if targets.is_empty() {
            return Ok(());
        }
        if self.delays(t) {
            return self.launch_delayed(&targets, h, t, scale);
        }
        let s = self.comm.stream();
        // Host buffers for the gradients that did not leave during backward and for parameters
        // that do not go back from the master, two of each kind (bucket k+1's fill while
        // bucket k steps); none of a kind no bucket needs.
        let need_grads = targets.iter().any(|tg| self.tier.early[tg.b].is_none());
        let need_params = targets.iter().any(|tg| self.out_of(tg.b) == Out::Buffer);
        let two = |sp: &mut Spares, need: bool| -> Result<Vec<DevVec>, ZeroError> {
            let n = if need { 2 } else { 0 };
            (0..n).map(|_| sp.take(s, sp.cap, false)).collect()
        };
        let gbufs = two(&mut self.tier.grads, need_grads)?;
        let pbufs = match two(&mut self.tier.params, need_params) {
            Ok(p) => p,
            Err(e) => {
                gbufs.into_iter().for_each(|v| self.tier.grads.give(v));
                return Err(e);
            }
        };
        let out = self.pipeline(&targets, (&gbufs, &pbufs), h, t, scale);
        // The puts read the parameter buffers: they end before the buffers are kept.
        let synced = self.sync("copying the offloaded step's parameters back");
        if synced.is_ok() {
            gbufs.into_iter().for_each(|v| self.tier.grads.give(v));
            pbufs.into_iter().for_each(|v| self.tier.params.give(v));
        }
        out?;
        synced
    }

    /// The fetch / step / put pipeline over `targets`; `bufs` holds two host buffers for
    /// gradients and two for parameters (or none of a kind no bucket needs).
    fn pipeline(
        &mut self,
        targets: &[Target],
        bufs: (&[DevVec], &[DevVec]),
        h: &Optimizer,
        t: u64,
        scale: f32,
    ) -> Result<(), ZeroError> {
        let es = T::DTYPE.size();
        let (gbuf, pbuf) = (|k: usize| &bufs.0[k % 2], |k: usize| &bufs.1[k % 2]);
        // Gradient ranges already copied out while backward went on (`copy_out_early`); their
        // copies ended when the push that queued them returned.
        let early: Vec<Option<DevVec>> = targets
            .iter()
            .map(|tg| self.tier.early[tg.b].take())
            .collect();
        let grads_of = |k: usize| early[k].as_ref().unwrap_or_else(|| gbuf(k));
        let fetch = |s: &S, k: usize| -> Result<Option<S::Marker>, ZeroError> {
            if early[k].is_some() {
                return Ok(None);
            }
            let tg = targets[k];
            // SAFETY: `tg.len` elements of `T` of the engine's reduced gradients into a host
            // buffer of at least that many (its capacity is the largest update range), which
            // nothing else uses until the marker below has passed.
            unsafe { s.copy(gbuf(k).addr, tg.grads, tg.len * es) }
                .map_err(dev("copying gradients to the host".into()))?;
            s.mark()
                .map(Some)
                .map_err(dev("marking a gradient copy".into()))
        };
        let mut stats = OffloadStats::default();
        // Per bucket, a marker after its put: the parameter buffer it read is written again
        // two buckets later, only once the put has ended.
        let mut puts: Vec<Option<S::Marker>> = Vec::with_capacity(targets.len());
        let mut fetched = fetch(self.comm.stream(), 0)?;
        // Stages 1–2: buckets whose updated parameters are on the device, to all-gather while
        // the CPU steps the next bucket: first those the device stepped.
        self.tier.gathered.fill(false);
        let mut share: Vec<usize> = match self.led.cfg.stage {
            1 | 2 => (0..self.params.len())
                .filter(|&b| !self.tier.offloaded(b))
                .collect(),
            _ => Vec::new(),
        };
        if self.tier.on_nvme(targets[0].b) {
            let (swap, staged) = self.tier.swap.as_mut().expect("an NVMe tier");
            swap.read(targets[0].b, &mut staged[0])?;
        }
        for (k, tg) in targets.iter().enumerate() {
            let w0 = Instant::now();
            if let Some(m) = fetched.take() {
                self.wait_mark(m, "copying gradients to the host")?;
            }
            if let Some(m) = k.checked_sub(2).and_then(|j| puts[j].take()) {
                self.wait_mark(m, "copying updated parameters to the device")?;
            }
            stats.device_wait += w0.elapsed();
            stats.to_host += (tg.len * es) as u64;
            if k + 1 < targets.len() {
                fetched = fetch(self.comm.stream(), k + 1)?;
            }
            let segs = self.led.update_segments(tg.b, tg.from, tg.len, h);
            let next = targets
                .get(k + 1)
                .map(|n| n.b)
                .filter(|&b| self.tier.on_nvme(b));
            let prev = k
                .checked_sub(1)
                .map(|p| targets[p].b)
                .filter(|&b| self.tier.on_nvme(b));
            let out = self.out_of(tg.b);
            // SAFETY: the gradients' copy has ended (its marker passed, or it was waited for
            // when it was queued) and the next copy goes to another buffer; the parameter
            // buffer's last put (two buckets back) has ended (its marker passed); a host shard
            // is read by no work during the step (the forward's gathers have ended, and the
            // next step starts after this one's closing wait); each holds `tg.len` elements
            // of `T`.
            let (g, p) = unsafe {
                (
                    on_host::<T>(grads_of(k), 0, tg.len),
                    match out {
                        Out::Buffer => Some(on_host::<T>(pbuf(k), 0, tg.len)),
                        Out::Shard => Some(on_host::<T>(&self.params[tg.b], 0, tg.len)),
                        Out::Master => None,
                    },
                )
            };
            // Stages 1–2: the buckets whose updated parameters are on the device already (the
            // device's own buckets, then each offloaded bucket after its put) are all-gathered
            // here, on this thread, while the CPU steps this bucket on others.
            let ready = std::mem::take(&mut share);
            let threads = self.tier.threads;
            let c0 = Instant::now();
            let stepped = if self.tier.on_nvme(tg.b) {
                let mut tier = self.tier.swap.take();
                let (swap, staged) = tier.as_mut().expect("an NVMe tier");
                let [cur, ahead, behind] = staged
                    .get_disjoint_mut([k % 3, (k + 1) % 3, (k + 2) % 3])
                    .expect("three regions");
                let swap = &*swap;
                let res = std::thread::scope(|sc| -> Result<(), ZeroError> {
                    let io = sc.spawn(move || -> Result<(), ZeroError> {
                        if let Some(b) = prev {
                            swap.write(b, behind)?;
                        }
                        if let Some(b) = next {
                            swap.read(b, ahead)?;
                        }
                        Ok(())
                    });
                    let step = sc.spawn(move || {
                        let mut parts = cur.parts_mut();
                        let (m, st) = parts.split_first_mut().expect("a master");
                        cpu_step(&segs, t, m, st, g, p, scale, threads);
                    });
                    let shared = self.share_updated(&ready);
                    step.join().expect("the CPU step panicked");
                    io.join().expect("the NVMe thread panicked")?;
                    shared
                });
                self.tier.swap = tier;
                res
            } else {
                let b = tg.b;
                let master = self.master[b].as_ref().expect("an offloaded master");
                // SAFETY: the offloaded master and states are host memory of the update
                // range's length that only this step touches (no stream work reads them: the
                // puts copy from the parameter buffer).
                let m = unsafe { on_host::<f32>(master, 0, tg.len) };
                let mut st: Vec<&mut [f32]> = self.states[b]
                    .iter()
                    // SAFETY: as above.
                    .map(|x| unsafe { on_host::<f32>(x, 0, tg.len) })
                    .collect();
                std::thread::scope(|sc| {
                    let step =
                        sc.spawn(move || cpu_step(&segs, t, m, &mut st, g, p, scale, threads));
                    let shared = self.share_updated(&ready);
                    step.join().expect("the CPU step panicked");
                    shared
                })
            };
            stepped?;
            for b in ready {
                self.tier.gathered[b] = true;
            }
            stats.cpu_step += c0.elapsed();
            if out == Out::Shard || (out == Out::Buffer && self.put_shard_to_nvme(tg.b, pbuf(k))?) {
                puts.push(None);
            } else {
                let s = self.comm.stream();
                let src = match out {
                    Out::Master => {
                        self.master[tg.b]
                            .as_ref()
                            .expect("an offloaded master")
                            .addr
                    }
                    _ => pbuf(k).addr,
                };
                // SAFETY: the updated parameters (`tg.len` elements of `T`) into the engine's
                // stretch of the bucket; the parameter buffer is not written again before this
                // copy ends (its marker, below, is waited for first), and the master not before
                // the next step, which starts after this one's closing wait for the stream.
                unsafe { s.copy(tg.params, src, tg.len * es) }
                    .map_err(dev("copying updated parameters to the device".into()))?;
                puts.push(Some(s.mark().map_err(dev("marking a put".into()))?));
                stats.to_device += (tg.len * es) as u64;
                if matches!(self.led.cfg.stage, 1 | 2) {
                    share.push(tg.b);
                }
            }
        }
        let last = targets.len() - 1;
        if self.tier.on_nvme(targets[last].b) {
            let (swap, staged) = self.tier.swap.as_mut().expect("an NVMe tier");
            swap.write(targets[last].b, &mut staged[last % 3])?;
        }
        (stats.nvme_read, stats.nvme_written) = self.tier.nvme_moved_since_last();
        self.tier.stats = stats;
        // The early copies' buffers: no work reads them any more (the CPU stepped them).
        early
            .into_iter()
            .flatten()
            .for_each(|v| self.tier.early_bufs.give(v));
        Ok(())
    }

    /// Where bucket `b`'s updated parameters go from the CPU step ([`Out`]).
    fn out_of(&self, b: usize) -> Out {
        let shards_on_host = self.led.cfg.stage == 3
            && self.led.cfg.offload.param.device == OffloadDevice::Cpu
            && self.params[b].host.is_some();
        if shards_on_host {
            Out::Shard
        } else if T::DTYPE == ringzero_kernels::DType::F32
            && !self.tier.on_nvme(b)
            && self.tier.params_file.is_none()
        {
            Out::Master
        } else {
            Out::Buffer
        }
    }

    /// Stages 2–3, the accumulation window's last micro-step: queue bucket `b`'s reduced
    /// gradient range's copy to the host now, while backward goes on, so the step finds it
    /// there (the caller waits for the stream before returning, as a push does).
    pub(super) fn copy_out_early(&mut self, b: usize) -> Result<(), ZeroError> {
        let o = &self.led.cfg.offload.optimizer;
        if !self.tier.offloaded(b) || self.led.cfg.stage < 2 || o.delayed_update_after.is_some() {
            return Ok(());
        }
        let s = self.comm.stream();
        let len = self.grads[b].elems;
        let buf = self.tier.early_bufs.take(s, len, false)?;
        // SAFETY: `len` elements of `T` of the bucket's reduced gradients into a kept host
        // buffer of at least that many, which nothing reads before the caller's wait.
        unsafe { s.copy(buf.addr, self.grads[b].addr, len * T::DTYPE.size()) }
            .map_err(dev("copying gradients to the host".into()))?;
        self.tier.early[b] = Some(buf);
        Ok(())
    }

    /// Wait for the work before `m` (under the communicator's deadline, as `sync`).
    pub(super) fn wait_mark(&self, m: S::Marker, what: &str) -> Result<(), ZeroError> {
        let s = self.stream();
        let (start, deadline) = (Instant::now(), self.comm.timeout());
        while !s.done(&m).map_err(dev(what.into()))? {
            if start.elapsed() >= deadline && s.memory_outlives_work() {
                return Err(ZeroError::Comm(ringzero_collectives::Error::Device {
                    context: what.into(),
                    source: ringzero_kernels::DeviceError::Invalid(format!(
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
}

/// One bucket's CPU step: each segment (`(offset, length, settings)`) of the master, states,
/// gradients and parameters.
#[allow(clippy::too_many_arguments)]
pub(super) fn cpu_step<T: Float>(
    segs: &[(usize, usize, Optimizer)],
    t: u64,
    master: &mut [f32],
    states: &mut [&mut [f32]],
    g: &[T],
    mut p: Option<&mut [T]>,
    scale: f32,
    threads: usize,
) {
    for &(off, len, hh) in segs {
        let r = off..off + len;
        let mut st = states.iter_mut().map(|x| &mut x[r.clone()]);
        let s1 = st.next().unwrap_or_default();
        let s2 = st.next().unwrap_or_default();
        step_mixed_threads(
            &hh,
            t,
            &mut master[r.clone()],
            p.as_deref_mut().map(|p| &mut p[r.clone()]),
            &g[r],
            s1,
            s2,
            scale,
            threads,
        );
    }
}
