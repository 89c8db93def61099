//! ringzero: ring collectives over shared memory and TCP, written from scratch (no NCCL, no MPI).
//!
//! This facade re-exports the crates of the workspace; see [`Communicator`] to start.
//! - [`kernels`]: element types, devices, CPU reduction kernels;
//! - [`zero`]: ZeRO stages 0–3 on the communicator (`ringzero-zero`);
//! - everything else: the communicator and its parts (`ringzero-collectives`).
#![deny(missing_docs)]

pub use ringzero_collectives::*;
pub use ringzero_kernels as kernels;
pub use ringzero_zero as zero;
