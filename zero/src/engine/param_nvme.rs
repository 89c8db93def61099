//! Stage 3 with `offload_param` on NVMe (ZeRO-Infinity's parameter tier): this rank's parameter
//! shards live in a file of their own under `offload_param.nvme_path` ([`crate::swap`]), one
//! region per bucket. A shard is read into a host buffer the stream addresses just before it is
//! all-gathered (on demand, prefetched, or to refresh a persistent bucket), and the CPU step
//! writes each updated shard straight back to the file: the shards take no device or host memory
//! between uses. It needs the optimizer state offloaded too (the step that writes them is the
//! CPU's); the engine's `params` then hold empty buffers for these buckets.

use ringzero_collectives::TrainStream;
use ringzero_kernels::cpu::{cast, Float};

use super::buffers::{alloc_host, DevVec};
use super::Engine;
use crate::config::{OffloadDevice, ZeroConfig};
use crate::error::ZeroError;
use crate::partition::Partition;
use crate::swap::Swap;

/// Whether `cfg` puts the stage-3 shards on NVMe.
pub(super) fn shards_on_nvme(cfg: &ZeroConfig) -> bool {
    cfg.stage == 3 && cfg.offload.param.device == OffloadDevice::Nvme
}

/// The parameter file for `full`'s buckets (this rank's shard of each, rounded into `T`),
/// written now.
pub(super) fn create<T: Float, S: TrainStream>(
    s: &S,
    cfg: &ZeroConfig,
    (part, rank): (&Partition, usize),
    full: &[Vec<f32>],
) -> Result<Swap, ZeroError> {
    let es = T::DTYPE.size();
    let dir = cfg
        .offload
        .param
        .nvme_path
        .as_deref()
        .expect("validated: nvme has a path");
    // Regions in f32 units (what the file counts in), each holding one shard in `T`.
    let elems: Vec<Option<usize>> = (0..part.buckets.len())
        .map(|b| Some((part.owned(b, rank).len() * es).div_ceil(4)))
        .collect();
    let file = Swap::create(dir, ("param", rank), &elems, 1, &cfg.offload.aio)?;
    let cap = (0..part.buckets.len())
        .map(|b| part.owned(b, rank).len())
        .max()
        .unwrap_or(0);
    let buf = alloc_host(s, T::DTYPE, cap)?;
    for (b, bucket) in full.iter().enumerate() {
        let own = &bucket[part.owned(b, rank)];
        // SAFETY: `buf` is host memory of `cap ≥ own.len()` elements of `T`, used by nothing
        // else.
        let out = unsafe { super::offload::on_host::<T>(&buf, 0, own.len()) };
        cast(own, out);
        // SAFETY: `buf` is page-aligned host memory of at least the region's bytes (its pages
        // cover `cap` elements of `T`, the region `own.len()` of them rounded up to 4096).
        unsafe { file.write_raw(b, buf.host.expect("host memory") as *const u8) }?;
    }
    Ok(file)
}

impl<T: Float, S: TrainStream + 'static> Engine<T, S> {
    /// Stage 3 with the shards on NVMe: bucket `b`'s shard read into a host buffer the stream
    /// addresses, to gather from (give it back with [`Engine::done_with_shard`] once the work
    /// reading it has ended); `None` where the shard lives in `params[b]`.
    pub(super) fn staged_shard(&mut self, b: usize) -> Result<Option<DevVec>, ZeroError> {
        let Some(file) = &self.tier.params_file else {
            return Ok(None);
        };
        let len = self.led.part.owned(b, self.led.rank).len();
        let buf = self.tier.shard_bufs.take(self.comm.stream(), len, false)?;
        // SAFETY: a kept host buffer of the largest shard's pages (so at least the region's
        // bytes), page-aligned, used by no queued work (it is given back only once the work
        // reading it has ended).
        unsafe { file.read_raw(b, buf.host.expect("host memory") as *mut u8) }?;
        Ok(Some(buf))
    }

    /// Keep a buffer [`Engine::staged_shard`] returned.
    pub(super) fn done_with_shard(&mut self, buf: Option<DevVec>) {
        if let Some(v) = buf {
            self.tier.shard_bufs.give(v);
        }
    }

    /// Stage 3 with the shards on NVMe: write bucket `b`'s updated shard from host buffer
    /// `from` (the CPU step's parameters); whether it did (otherwise the shard is on the
    /// device and the caller copies it there).
    pub(super) fn put_shard_to_nvme(&self, b: usize, from: &DevVec) -> Result<bool, ZeroError> {
        let Some(file) = &self.tier.params_file else {
            return Ok(false);
        };
        // SAFETY: `from` is one of the pipeline's page-aligned host buffers of the largest
        // update range's pages (at least the region's bytes), which nothing writes until this
        // returns.
        unsafe { file.write_raw(b, from.host.expect("host memory") as *const u8) }?;
        Ok(true)
    }

    /// Stage 3 with the shards on NVMe: write bucket `b`'s shard as `master` (a loaded
    /// checkpoint's fp32 values, this rank's range) rounds into `T`.
    pub(super) fn put_loaded_shard(&mut self, b: usize, master: &[f32]) -> Result<(), ZeroError> {
        let buf = self
            .tier
            .shard_bufs
            .take(self.comm.stream(), master.len(), false)?;
        // SAFETY: a kept host buffer of at least `master.len()` elements of `T`, used by no
        // queued work.
        cast(master, unsafe {
            super::offload::on_host::<T>(&buf, 0, master.len())
        });
        let r = self.put_shard_to_nvme(b, &buf);
        self.tier.shard_bufs.give(buf);
        r.map(|_| ())
    }
}
