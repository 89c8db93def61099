//! ringzero-collectives: the communicator.
//!
//! Ring reduce-scatter, all-gather, all-reduce, broadcast, reduce and barrier between processes
//! (or threads), over shared memory inside a node and TCP between nodes, written from scratch.
//!
//! Map of the crate:
//! - [`config`]: who this rank is (launcher environment) and the knobs;
//! - `bootstrap`: rank 0's key-value store and the authenticated handshake;
//! - `topology`: which transport each ring edge uses, and why;
//! - `transport`: one link to one peer, one contract, one file per backend (`shm`, `tcp`);
//! - `ring`: the schedule as pure data, and the engine that drives a transport through it;
//! - `wire`: frame headers, fingerprints, bounds checks;
//! - [`flight`]: the flight recorder: each communicator's last calls, dumped when it fails;
//! - [`Communicator`]: the public API (with `split` into sub-communicators); [`DeviceComm`]: the
//!   same ring on device buffers
//!   (cuda_ipc peer copies, shm host staging), set up through a communicator.
//!
//! Two ranks as threads, the way tests run them:
//! ```
//! use ringzero_collectives::{Collectives, Communicator, Config, ReduceOp};
//! let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
//! let ranks: Vec<_> = (0..2)
//!     .map(|rank| {
//!         std::thread::spawn(move || {
//!             let comm = Communicator::init(Config::new(rank, 2, "127.0.0.1", port))?;
//!             let send = vec![rank as f32 + 1.0; 5];
//!             let mut recv = vec![0.0f32; 5];
//!             comm.all_reduce(&send, &mut recv, ReduceOp::Sum)?;
//!             Ok::<_, ringzero_collectives::Error>(recv)
//!         })
//!     })
//!     .collect();
//! for r in ranks {
//!     assert_eq!(r.join().unwrap().unwrap(), vec![3.0; 5]);
//! }
//! ```
#![deny(missing_docs)]

mod atomic_file;
mod bootstrap;
mod calls;
mod comm;
pub mod config;
mod connect;
mod counters;
mod deadline;
pub mod device;
pub mod error;
pub mod flight;
mod input;
mod posted;
mod ring;
mod split;
mod topology;
mod transport;
mod wire;
mod work;

/// The parts under the communicators, for ringzero's own tools, tests and benches: the ring's
/// schedule and engine, the transports, the wire format, bootstrap and topology. Not part of the
/// API: they change with the implementation.
#[doc(hidden)]
pub mod internals {
    /// Atomic file writes.
    pub mod atomic_file {
        pub use crate::atomic_file::*;
    }
    /// Rendezvous store and handshake.
    pub mod bootstrap {
        pub use crate::bootstrap::*;
    }
    /// Schedules and engines.
    pub mod ring {
        pub use crate::ring::*;
    }
    /// Which transport each edge uses.
    pub mod topology {
        pub use crate::topology::*;
    }
    /// One link to one peer.
    pub mod transport {
        pub use crate::transport::*;
    }
    /// Frame headers and fingerprints.
    pub mod wire {
        pub use crate::wire::*;
    }
}

pub use calls::{Collectives, NonBlocking};
pub use comm::{AbortHandle, Communicator, P2p, P2pOwned, SharedBuf, WithAlgo};
pub use config::{Algo, Config, DeviceAlgo, StagingMode, TransportPref, COPY_STAGING_MAX_SHARERS};
pub use counters::Counters;
pub use device::{DeviceComm, DeviceMemory, DeviceP2p, HostStream, StepAt, Stream, TrainStream};
pub use error::{Error, Result};
pub use flight::{CallState, FlightEntry, FlightRecord, PeerTraffic, PendingMsg};
pub use input::{InPlace, Input};
pub use ring::doubling::Schedule;
pub use ring::{chunk, Collective};
pub use ringzero_kernels::{DType, Element, ReduceOp};
pub use topology::Edge;
pub use transport::TransportKind;
pub use work::Work;
