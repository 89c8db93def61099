//! ringzero-tools: what the `ringzero` binary does, as a library so tests drive the same code.
//!
//! - [`launch`]: spawn N local ranks with the launcher environment, prefix their output, take the
//!   job down when one fails;
//! - [`bench`]: every collective swept over sizes, checked, against the α–β model;
//! - [`check`]: a quick checked all-reduce sweep;
//! - [`diag`]: why multi-GPU communication hangs or crawls.

pub mod bench;
pub mod check;
pub mod demo;
pub mod diag;
pub mod gpucheck;
pub mod launch;
