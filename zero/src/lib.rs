//! ringzero-zero: ZeRO (stages 1–3) built on ringzero's own collectives.
//!
//! - [`comm_peak`]: the engine's communication buffers at their peak, from a trainer's calls
//!   replayed before a run;
//! - [`mem`]: the paper's memory and communication model (what `ringzero mem` prints, and what the
//!   engine's counters are compared with);
//! - [`partition`]: parameters flattened into buckets padded to a multiple of the world size, each
//!   rank owning one contiguous range of every bucket — pure and property-tested;
//! - [`config`]: the engine's settings, from a builder or a DeepSpeed-style JSON subset;
//! - [`scaler`]: fp16 dynamic loss scaling;
//! - [`engine`]: [`Engine`], stages 0–3 in fp32, bf16 and fp16 (fp32 masters), AdamW, clipping,
//!   accumulation, stage-3 prefetch, memory and wait counters — one engine whose model states
//!   live in the memory of a stream: the host's ([`Engine::new`]) or a GPU's ([`Engine::on`]);
//! - [`swap`]: the NVMe tier's file (ZeRO-Infinity), and [`swap::bench()`], its throughput
//!   against a plain direct-I/O copy;
//! - [`checkpoint`]: one safetensors shard per rank and a `meta.json` commit marker, loaded at any
//!   world size, stage or precision (resharded by parameter name), and consolidated offline.
#![deny(missing_docs)]

pub mod checkpoint;
pub mod comm_peak;
pub mod config;
pub mod engine;
mod error;
mod ledger;
mod live;
pub mod mem;
pub mod partition;
mod report;
pub mod scaler;
pub mod swap;
mod weights;

pub use checkpoint::{Checkpoint, Meta as CheckpointMeta};
pub use config::{
    Aio, Auto, LossScaling, LrSchedule, Offload, OffloadDevice, OffloadOptimizer, OffloadParam,
    ParamGroup, Precision, ZeroConfig, ZeroConfigBuilder,
};
pub use engine::{check_same_params, hybrid_groups, Engine};
pub use error::ZeroError;
pub use partition::{ParamSpec, Partition};
pub use report::{CommWait, Memory, OffloadStats, Phase, StepOutcome, StepReport};
pub use scaler::LossScaler;
pub use weights::Weights;
