//! ringzero-collectives: the communicator.
#![deny(missing_docs)]
pub mod ring;
