//! CPU kernels: element-wise reductions for every [`DType`](crate::DType) and [`ReduceOp`](crate::ReduceOp).
//!
//! The hot loops are plain `zip` loops over slices with the operator chosen *outside* the loop, so
//! each (dtype, op) pair is its own monomorphized loop that LLVM vectorizes (no bounds checks, no
//! branch per element). `f16`/`bf16` go through `half`'s slice conversions in blocks of
//! [`HALF_BLOCK`] elements: widen to `f32`, combine, round back (see the crate docs for why).
//!
//! These are real code paths, not test doubles: the host is a supported device.

mod float;
mod optim;
mod reduce;
mod stream;

pub use float::{
    all_finite, cast, optim_step_threads, scale, sq_norm, step_mixed, step_mixed_threads, Float,
};
pub use optim::{optim_step, Optimizer, Rule, StepScalars};

pub use stream::{copy_streaming, stream_fence};

pub use reduce::{divide, reduce_into, reduce_into_typed, reduce_to, reduce_to_typed, HALF_BLOCK};
