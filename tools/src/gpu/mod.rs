//! `ringzero gpu-check`: every GPU check in one place.
//!
//! - [`kernels`]: every CUDA kernel against the CPU kernels, bit for bit, and their bandwidth
//!   against a device copy; the result rows and their table;
//! - [`run`]: the whole check — the kernels, then the collective runs in processes on the GPU
//!   through the launcher (or on the host stream: `--host-stream`);
//! - [`collectives`]: one rank of a collective run (`ringzero gpu-collectives`): every
//!   collective × dtype × op exact, the async and posted calls, the bandwidth rows, a killed rank;
//! - [`zero`]: the ZeRO device engine against the host engine, bit for bit.

pub mod collectives;
pub mod kernels;
pub mod run;
pub mod zero;
