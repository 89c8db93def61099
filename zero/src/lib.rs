//! ringzero-zero: ZeRO (stages 1–3) built on ringzero's own collectives.
//!
//! - [`mem`]: the paper's memory and communication model (what `ringzero mem` prints, and what the
//!   engine's counters are compared with);
//! - [`partition`]: parameters flattened into buckets padded to a multiple of the world size, each
//!   rank owning one contiguous range of every bucket — pure and property-tested.
#![deny(missing_docs)]

pub mod mem;
pub mod partition;
