//! Where the optimizer's states and the stage-3 parameters live (ZeRO-Offload and
//! ZeRO-Infinity): the engine's device, page-locked host memory, or files on a fast disk. With
//! DeepSpeed's keys (`zero_optimization.offload_optimizer`, `offload_param`, `aio`) and defaults.

use std::path::PathBuf;

use super::bad;
use crate::error::ZeroError;

/// A tier of memory (`"device"` in DeepSpeed's offload settings).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OffloadDevice {
    /// The engine's own device (`"none"`): nothing is offloaded.
    #[default]
    None,
    /// Host memory, page-locked where the engine's device is a GPU (`"cpu"`).
    Cpu,
    /// Files under `nvme_path`, read and written with direct I/O (`"nvme"`).
    Nvme,
}

impl std::str::FromStr for OffloadDevice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(OffloadDevice::None),
            "cpu" => Ok(OffloadDevice::Cpu),
            "nvme" => Ok(OffloadDevice::Nvme),
            _ => Err(format!(
                "unknown offload device `{s}` (expected none, cpu or nvme)"
            )),
        }
    }
}

impl std::fmt::Display for OffloadDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OffloadDevice::None => "none",
            OffloadDevice::Cpu => "cpu",
            OffloadDevice::Nvme => "nvme",
        })
    }
}

/// `offload_optimizer`: the fp32 master weights and the optimizer's moments, and the step that
/// updates them, on the CPU (ZeRO-Offload) with the state in host memory or on NVMe.
#[derive(Clone, Debug, PartialEq)]
pub struct OffloadOptimizer {
    /// Where the state lives.
    pub device: OffloadDevice,
    /// The directory the NVMe tier's files go in (required for [`OffloadDevice::Nvme`]).
    pub nvme_path: Option<PathBuf>,
    /// Page-lock the host buffers (`pin_memory`). On a GPU the engine page-locks them either
    /// way (its copies to and from the device overlap only from page-locked memory); on the
    /// host stream there is nothing to lock.
    pub pin_memory: bool,
    /// NVMe tier: buckets of state held in host memory at once (`buffer_count`, DeepSpeed's 4;
    /// at least 2: one stepped while the next is read).
    pub buffer_count: usize,
    /// The share of the optimizer state offloaded (`ratio`, 0 < ratio ≤ 1): buckets in layout
    /// order are offloaded until this share of the elements is; the rest steps on the device.
    pub ratio: f32,
    /// The delayed parameter update (the ZeRO-Offload paper's DPU; not a DeepSpeed key, set
    /// it in code): `Some(k)` runs every optimizer step after the k-th on a CPU thread beside
    /// the trainer's next forward and backward, whose gradients are then computed on
    /// parameters one update old (see [`crate::Engine::flush`]). `None` (the default) updates
    /// in the step.
    pub delayed_update_after: Option<u64>,
}

impl Default for OffloadOptimizer {
    fn default() -> Self {
        OffloadOptimizer {
            device: OffloadDevice::None,
            nvme_path: None,
            pin_memory: false,
            buffer_count: 4,
            ratio: 1.0,
            delayed_update_after: None,
        }
    }
}

impl OffloadOptimizer {
    /// The state in host memory, stepped on the CPU.
    pub fn cpu() -> OffloadOptimizer {
        OffloadOptimizer {
            device: OffloadDevice::Cpu,
            pin_memory: true,
            ..OffloadOptimizer::default()
        }
    }

    /// The state in files under `dir`, stepped on the CPU.
    pub fn nvme(dir: impl Into<PathBuf>) -> OffloadOptimizer {
        OffloadOptimizer {
            device: OffloadDevice::Nvme,
            nvme_path: Some(dir.into()),
            pin_memory: true,
            ..OffloadOptimizer::default()
        }
    }
}

/// `offload_param` (stage 3): this rank's parameter shards in host memory, gathered from there.
#[derive(Clone, Debug, PartialEq)]
pub struct OffloadParam {
    /// Where the shards live: on NVMe they are read into host memory before each gather
    /// (which needs the optimizer state offloaded too).
    pub device: OffloadDevice,
    /// As [`OffloadOptimizer::nvme_path`].
    pub nvme_path: Option<PathBuf>,
    /// As [`OffloadOptimizer::pin_memory`].
    pub pin_memory: bool,
    /// DeepSpeed's NVMe parameter buffers (`buffer_count`, 5; read: the tier reads each shard
    /// into one of two host buffers of the largest shard).
    pub buffer_count: usize,
    /// Elements per NVMe parameter buffer (`buffer_size`, 1e8; read, as `buffer_count`).
    pub buffer_size: usize,
    /// Elements kept in host memory from NVMe (`max_in_cpu`, 1e9; read: the tier keeps none).
    pub max_in_cpu: usize,
}

impl Default for OffloadParam {
    fn default() -> Self {
        OffloadParam {
            device: OffloadDevice::None,
            nvme_path: None,
            pin_memory: false,
            buffer_count: 5,
            buffer_size: 100_000_000,
            max_in_cpu: 1_000_000_000,
        }
    }
}

/// `aio`: how the NVMe tier reads and writes (DeepSpeed's defaults).
#[derive(Clone, Debug, PartialEq)]
pub struct Aio {
    /// Bytes per read or write request (`block_size`, 1 MiB; a multiple of 4096 for direct
    /// I/O).
    pub block_size: usize,
    /// Requests in flight per thread (`queue_depth`, 8).
    pub queue_depth: usize,
    /// Threads reading and writing (`thread_count`, 1).
    pub thread_count: usize,
    /// Submit requests one at a time (`single_submit`; each thread's requests are sequential
    /// `pread`/`pwrite` calls here either way).
    pub single_submit: bool,
    /// Overlap reads with the optimizer step (`overlap_events`, true).
    pub overlap_events: bool,
}

impl Default for Aio {
    fn default() -> Self {
        Aio {
            block_size: 1 << 20,
            queue_depth: 8,
            thread_count: 1,
            single_submit: false,
            overlap_events: true,
        }
    }
}

/// The three offload settings together ([`super::ZeroConfig::offload`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Offload {
    /// `offload_optimizer`.
    pub optimizer: OffloadOptimizer,
    /// `offload_param`.
    pub param: OffloadParam,
    /// `aio`.
    pub aio: Aio,
}

impl Offload {
    /// Whether anything leaves the engine's device.
    pub fn any(&self) -> bool {
        self.optimizer.device != OffloadDevice::None || self.param.device != OffloadDevice::None
    }

    /// Check the settings against `stage`; the error names the key and says what to do.
    pub(crate) fn validate(&self, stage: u8) -> Result<(), ZeroError> {
        let o = &self.optimizer;
        if o.device == OffloadDevice::Nvme && o.nvme_path.is_none() {
            return Err(bad(
                "offload_optimizer.device is \"nvme\" but no nvme_path is given: name a \
                 directory on the disk the state should go to",
            ));
        }
        if o.device != OffloadDevice::None && stage == 0 {
            return Err(bad(
                "offload_optimizer needs ZeRO stage 1, 2 or 3 (stage 0 keeps the whole state on \
                 every rank); set zero_optimization.stage",
            ));
        }
        if !(o.ratio > 0.0 && o.ratio <= 1.0) {
            return Err(bad(format!(
                "offload_optimizer.ratio {} must be above 0 and at most 1 (the share of the \
                 optimizer state offloaded)",
                o.ratio
            )));
        }
        if o.delayed_update_after.is_some() && (o.device == OffloadDevice::None || o.ratio < 1.0) {
            return Err(bad(
                "offload_optimizer.delayed_update_after needs the whole optimizer state \
                 offloaded (device cpu or nvme, ratio 1): the delay is the CPU step's",
            ));
        }
        if o.device == OffloadDevice::Nvme && o.buffer_count < 2 {
            return Err(bad(format!(
                "offload_optimizer.buffer_count {} must be at least 2 (one bucket stepped while \
                 the next is read)",
                o.buffer_count
            )));
        }
        let p = &self.param;
        if p.device != OffloadDevice::None && stage != 3 {
            return Err(bad(format!(
                "offload_param needs ZeRO stage 3 (stage {stage} keeps every parameter on every \
                 rank); set zero_optimization.stage to 3, or remove offload_param"
            )));
        }
        if p.device == OffloadDevice::Nvme && p.nvme_path.is_none() {
            return Err(bad(
                "offload_param.device is \"nvme\" but no nvme_path is given: name a directory \
                 on the disk the parameter shards should go to",
            ));
        }
        if p.device == OffloadDevice::Nvme && (o.device == OffloadDevice::None || o.ratio < 1.0) {
            return Err(bad(
                "offload_param.device \"nvme\" needs the whole optimizer state offloaded \
                 (offload_optimizer.device \"cpu\" or \"nvme\", ratio 1): the CPU step writes \
                 the new shards to the file",
            ));
        }
        let a = &self.aio;
        if a.block_size == 0 || !a.block_size.is_multiple_of(4096) {
            return Err(bad(format!(
                "aio.block_size {} must be a positive multiple of 4096 bytes (direct I/O's \
                 alignment)",
                a.block_size
            )));
        }
        if a.thread_count == 0 || a.queue_depth == 0 {
            return Err(bad(
                "aio.thread_count and aio.queue_depth must be at least 1",
            ));
        }
        Ok(())
    }
}
