//! ringzero-zero: ZeRO (stages 1–3) built on ringzero's own collectives.
//!
//! - [`mem`]: the paper's memory and communication model (what `ringzero mem` prints, and what the
//!   engine's counters are compared with);
//! - [`partition`]: parameters flattened into buckets padded to a multiple of the world size, each
//!   rank owning one contiguous range of every bucket — pure and property-tested;
//! - [`engine`]: stages 0–3 (fp32 parameters, AdamW, clipping, accumulation, memory counters).
//!
//! Not yet here (the ZeRO issue stays open for them): 16-bit parameters with fp32 masters and
//! dynamic loss scaling, stage-3 prefetch overlapping compute, the DeepSpeed JSON config,
//! checkpoints, `ringzero demo`.
#![deny(missing_docs)]

pub mod engine;
pub mod mem;
pub mod partition;

pub use engine::{Engine, Memory, StepOutcome, ZeroConfig, ZeroError};
pub use partition::{ParamSpec, Partition};
