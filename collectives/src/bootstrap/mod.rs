//! Bootstrap: how ranks find each other before any collective can run.
//!
//! Rank 0 serves a small key-value [`store`] over TCP; every rank publishes what its neighbours
//! need (node identity, listen address, connect info of its receive edge) and reads theirs. Every
//! TCP connection the library opens — store and data alike — starts with the authenticated
//! [`handshake`].

pub(crate) mod gate;
pub mod handshake;
pub(crate) mod peers;
pub mod store;

pub use handshake::{Identity, Role};
pub use store::{StoreClient, StoreServer};
