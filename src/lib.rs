//! ringzero: ring collectives and ZeRO, written from scratch (no NCCL, no MPI).
//!
//! A [`Communicator`] joins the ranks of a job (started by `ringzero launch`, torchrun, Slurm or
//! Open MPI) and runs the collectives on host buffers: reduce-scatter, all-gather, all-reduce,
//! broadcast, reduce, barrier, all-to-all and point-to-point, over shared memory inside a node
//! and TCP between nodes. A [`DeviceComm`] runs the same ring on device buffers (CUDA IPC peer
//! copies, or host staging), set up through a communicator. [`zero::Engine`] builds ZeRO stages
//! 0–3 on them, its model states in host memory or on a GPU.
//!
//! ```no_run
//! use ringzero::prelude::*;
//! let comm = Communicator::from_env()?; // RINGZERO_*, torchrun, Slurm or Open MPI variables
//! let send = vec![comm.rank() as f32; 1024];
//! let mut recv = vec![0.0f32; 1024];
//! comm.all_reduce(&send, &mut recv, ReduceOp::Sum)?;
//! # Ok::<(), ringzero::Error>(())
//! ```
//!
//! - the communicators, their configuration ([`Config`]) and errors ([`Error`]): this page;
//! - [`zero`]: the ZeRO engine, its configuration and checkpoints;
//! - [`kernels`]: element types, devices and the CPU kernels (reduction, casts, AdamW);
//! - [`half`]: the 16-bit float types the API takes (`f16`, `bf16`).
#![deny(missing_docs)]

pub use ringzero_collectives::{
    chunk, AbortHandle, Algo, CallState, Collective, Collectives, Communicator, Config, Counters,
    DType, DeviceAlgo, DeviceComm, DeviceMemory, DeviceP2p, Edge, Element, Error, FlightEntry,
    FlightRecord, HostStream, InPlace, Input, NonBlocking, P2p, P2pOwned, PeerTraffic, PendingMsg,
    ReduceOp, Result, Schedule, SharedBuf, StagingMode, StepAt, Stream, TrainStream, TransportKind,
    TransportPref, WithAlgo, Work, COPY_STAGING_MAX_SHARERS,
};

/// What a program that runs collectives names: `use ringzero::prelude::*;`.
pub mod prelude {
    pub use ringzero_collectives::{
        Collectives, Communicator, DeviceComm, InPlace, NonBlocking, ReduceOp,
    };
}

/// The 16-bit float types (`f16`, `bf16`) the communicators and the ZeRO engine move.
pub use half;

/// JSON values: a checkpoint's `client_state` (a data loader's position, an epoch) is one.
pub use serde_json;

/// Element types, devices and the math on them (`ringzero-kernels`): what a reduction
/// computes, the CPU kernels (reduce, casts, the optimizers), the CUDA device behind the `cuda` feature.
#[doc(inline)]
pub use ringzero_kernels as kernels;

/// ZeRO stages 0–3 on the communicators (`ringzero-zero`): [`zero::Engine`] on host or device
/// memory, [`zero::ZeroConfig`] (a builder or a DeepSpeed-style JSON file), checkpoints that
/// reshard, and the memory model `ringzero mem` prints.
#[doc(inline)]
pub use ringzero_zero as zero;
