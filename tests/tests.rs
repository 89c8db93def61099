//! Integration tests: one binary (link once), ranks as threads for breadth, as processes (through
//! the launcher's own code) for isolation and for killing one mid-collective.

mod alltoall;
mod bench;
mod checkpoint;
mod comm_peak;
mod common;
mod deepspeed_configs;
mod device;
mod device_p2p;
mod direct;
mod doubling;
mod failures;
mod flight;
mod hybrid;
mod no_panic;
mod nonblocking;
mod offload;
mod p2p;
mod pairwise;
mod processes;
mod rsv;
mod single_copy;
mod split;
mod threads;
mod zero;
