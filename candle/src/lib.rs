//! ZeRO for [candle](https://docs.rs/candle-core) models: one call wraps a `VarMap` (or named
//! `Var`s) with a [`ZeroConfig`](ringzero_zero::ZeroConfig) and a communicator ([`Zero::new`]),
//! and the handle moves the engine's parameters into the `Var`s before forward, hands candle's
//! gradients to the engine after backward, steps (optimizer, schedule, clipping, loss scaling)
//! and saves and loads checkpoints that reshard.
//!
//! ```no_run
//! use candle_core::{DType, Device};
//! use candle_nn::{VarBuilder, VarMap};
//! use ringzero_candle::gpt::{Gpt, GptConfig};
//! use ringzero_candle::Zero;
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let comm = ringzero::Communicator::from_env()?;
//! let cfg = ringzero::zero::ZeroConfig::from_json(r#"{"zero_optimization": {"stage": 2},
//!     "optimizer": {"type": "AdamW", "params": {"lr": 0.003}}}"#)?;
//! let varmap = VarMap::new();
//! let model = Gpt::new(GptConfig::tiny(65), VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
//! let mut zero = Zero::<f32>::new(&comm, &varmap, cfg)?; // rank 0's values on every rank
//! # let (x, y) = (candle_core::Tensor::zeros((1, 8), DType::U32, &Device::Cpu)?, candle_core::Tensor::zeros((1, 8), DType::U32, &Device::Cpu)?);
//! for _step in 0..100 {
//!     // The engine's parameters into the Vars (at stage 3 module by module, as forward runs).
//!     let loss = model.loss_with(&x, &y, &mut zero.hook())?;
//!     zero.backward(&zero.scaled(&loss)?)?; // candle's backward; the gradients to the engine
//!     zero.step()?;                        // reduce-scatter, optimizer step, all-gather
//! }
//! # Ok(()) }
//! ```
//!
//! - [`Zero`]: the handle;
//! - [`stream`]: where the engine's model states live (the host, or a GPU with the `cuda`
//!   feature) and how candle's tensors are addressed there;
//! - [`gpt`]: a decoder-only transformer written with candle-nn;
//! - [`corpus`]: a generated character-level corpus (nothing is downloaded);
//! - [`train`]: the data-parallel training loop `ringzero train` runs.
#![deny(missing_docs)]

pub mod corpus;
mod error;
pub mod gpt;
pub mod memory;
pub mod stream;
pub mod train;
mod zero;

pub use error::Error;
pub use stream::CandleStream;
pub use zero::Zero;

/// Results of this crate.
pub type Result<T> = std::result::Result<T, Error>;
