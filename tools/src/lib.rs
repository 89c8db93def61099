//! ringzero-tools: what the `ringzero` binary does, as a library so tests drive the same code.
//!
//! - [`launch`]: spawn N local ranks with the launcher environment, prefix their output, take the
//!   job down when one fails;
//! - [`check`]: the checked all-reduce sweep every rank of the main job runs.

pub mod check;
pub mod launch;
