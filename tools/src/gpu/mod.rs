//! `ringzero gpu-check`: every GPU check in one place.
//!
//! - [`kernels`]: every CUDA kernel against the CPU kernels, bit for bit, and their bandwidth
//!   against a device copy; the result rows and their table;
//! - [`run`]: the whole check — the kernels, then the collective runs in processes on the GPU
//!   through the launcher (or on the host stream: `--host-stream`);
//! - [`collectives`]: one rank of a collective run (`ringzero gpu-collectives`): every
//!   collective × dtype × op exact, the async and posted calls, the bandwidth rows, a killed rank;
//! - [`zero`]: the ZeRO device engine against the host engine, bit for bit;
//! - [`CheckDev`]: what both run on (a GPU, or the host stream).

pub mod collectives;
pub mod kernels;
pub mod run;
pub mod zero;

use ringzero_collectives::TrainStream;

use crate::bench::device::BenchDev;

/// A device the checks run on: a GPU, or the host stream.
pub trait CheckDev: BenchDev + TrainStream + 'static {}
impl<D: BenchDev + TrainStream + 'static> CheckDev for D {}
