//! ringzero-kernels: the element types ringzero moves, the devices that hold them, and the math on
//! them.
//!
//! This crate owns *what a reduction computes*; it knows nothing about ranks, links or schedules.
//! Every kernel works on byte slices tagged with a [`DType`] so the ring engine can stay untyped,
//! and on typed slices for callers that have them.
//!
//! # Accumulation rule for 16-bit floats
//! `f16` and `bf16` are **widened to `f32` for each pairwise combine and rounded back to the wire
//! type after it** (round-to-nearest-even). A ring of `n` ranks therefore rounds `n − 1` times per
//! element, in an order fixed by the ring, so the result is deterministic and bit-identical on
//! every rank. `Avg` is computed as `Sum` followed by a single division by `n` in `f32` (`f64` for
//! `f64`), rounded once to the wire type.
//!
//! Integers wrap on overflow (two's complement, like C's unsigned arithmetic and NCCL); integer
//! `Avg` is the wrapped sum divided by `n`, truncating toward zero.
#![deny(missing_docs)]

pub mod cpu;
pub mod device;
mod dtype;

pub use device::{DevPtr, DeviceError};
pub use dtype::{DType, Element, ReduceOp};

/// Errors raised by kernels: always about the inputs, never about peers.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum KernelError {
    /// Two operands of an element-wise kernel differ in length.
    #[error("{kernel}: operand lengths differ ({left} vs {right} bytes)")]
    LengthMismatch {
        /// Kernel name.
        kernel: &'static str,
        /// Length of the first operand in bytes.
        left: usize,
        /// Length of the second operand in bytes.
        right: usize,
    },
    /// A byte slice is not a whole number of elements or not aligned for the dtype.
    #[error(
        "{kernel}: {bytes} bytes at {addr:#x} are not an aligned whole number of {dtype} elements"
    )]
    BadLayout {
        /// Kernel name.
        kernel: &'static str,
        /// Element type expected.
        dtype: DType,
        /// Length in bytes.
        bytes: usize,
        /// Address of the slice.
        addr: usize,
    },
}
