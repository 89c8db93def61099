//! ringzero-tools: what the `ringzero` binary does, as a library so tests drive the same code.
//!
//! - [`launch`]: spawn N local ranks with the launcher environment, prefix their output, take the
//!   job down when one fails;
//! - [`bench`](mod@bench): every collective swept over sizes, checked, against the α–β model;
//! - [`check`]: a quick checked all-reduce sweep;
//! - [`diag`]: why multi-GPU communication hangs or crawls.

pub mod bench;
pub mod capacity;
pub mod check;
pub mod ckpt;
pub mod console;
pub mod demo;
pub mod diag;
pub mod gpu;
pub mod job_procs;
pub mod launch;
pub mod offload_bench;

/// splitmix64's finaliser: a well-spread hash of a seed, for reproducible pseudo-random inputs
/// (demo initialisation, gpu-check data) without carrying an RNG's state around.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
