//! One link to one peer, behind one small contract. A ring edge is a [`SendLink`] on the rank that
//! sends and a [`RecvLink`] on the rank that receives; each backend (`shm`, `tcp`) implements both
//! halves in one file, so "how shm sends a slice" sits next to "how tcp sends a slice".
//!
//! The contract (NCCL's and gloo's, cut to what the ring needs):
//! - the receiver owns a FIFO of `slots` slots of `slot_bytes` each; the sender may have at most
//!   `slots` frames outstanding (the credits);
//! - send: [`SendLink::reserve`] a slot, fill it (the engine reduces straight into it), then
//!   [`SendLink::post`] it with its header;
//! - receive: [`RecvLink::peek`] the next frame (its header is checked against what this rank
//!   expects before the payload is touched), consume it, then [`RecvLink::release`] the slot,
//!   which returns the credit;
//! - every call is non-blocking; the engine waits between calls (see [`wait`]).
//!
//! Choosing a transport per edge is [`crate::topology`]'s job, not the transports'.

pub mod board;
pub mod cma;
pub mod device;
pub mod memfd;
pub mod shm;
pub mod tcp;
pub mod wait;

use std::fmt;

use crate::wire::{Expect, FrameHeader};

/// Which backend carries an edge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// Slots in a shared-memory file (same node).
    Shm,
    /// A TCP connection.
    Tcp,
    /// Slots in the receiver's GPU memory, written by the sender through a CUDA IPC mapping
    /// (device buffers, same node, peer access allowed and working).
    CudaIpc,
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TransportKind::Shm => "shm",
            TransportKind::Tcp => "tcp",
            TransportKind::CudaIpc => "cuda_ipc",
        })
    }
}

/// What went wrong on a link, without the collective's context (the engine adds it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkError {
    /// The peer is gone (connection closed, process dead).
    Lost(String),
    /// The peer announced it is aborting, with its reason.
    PeerAborted(String),
    /// The peer sent a valid frame of a different collective.
    Mismatch {
        /// The peer's call.
        theirs: String,
    },
    /// The peer sent something that is not the protocol.
    Protocol(String),
    /// A local OS error.
    Io(String),
}

impl fmt::Display for LinkError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LinkError::Lost(d) => write!(f, "peer lost: {d}"),
            LinkError::PeerAborted(r) => write!(f, "peer aborted: {r}"),
            LinkError::Mismatch { theirs } => write!(f, "peer called {theirs}"),
            LinkError::Protocol(d) => write!(f, "protocol error: {d}"),
            LinkError::Io(d) => write!(f, "{d}"),
        }
    }
}

impl From<crate::wire::WireError> for LinkError {
    fn from(e: crate::wire::WireError) -> LinkError {
        match e {
            crate::wire::WireError::Garbage(d) => LinkError::Protocol(d),
            crate::wire::WireError::Mismatch { theirs } => LinkError::Mismatch { theirs },
        }
    }
}

/// Result of a link call.
pub type LinkResult<T> = Result<T, LinkError>;

/// The sending half of a ring edge.
pub trait SendLink: Send {
    /// The backend.
    fn kind(&self) -> TransportKind;
    /// Largest payload one frame can carry.
    fn slot_bytes(&self) -> usize;
    /// Room for the next frame's payload of `len` bytes, or `None` while no credit is free.
    fn reserve(&mut self, len: usize) -> LinkResult<Option<&mut [u8]>>;
    /// Publish the frame reserved last, with its header.
    fn post(&mut self, header: &FrameHeader) -> LinkResult<()>;
    /// Whether [`SendLink::post_from`] writes the payload to the wire straight from the
    /// caller's buffer (tcp), a copy fewer than filling the reserved slot.
    fn sends_from(&self) -> bool {
        false
    }
    /// Publish the frame reserved last with `data` (the reserved length) as its payload. tcp
    /// writes what its sockets take at once straight from `data` and copies only the rest
    /// into the reserved slot, to go as the sockets drain; the default copies all of it there.
    fn post_from(&mut self, header: &FrameHeader, data: &[u8]) -> LinkResult<()> {
        let slot = self
            .reserve(data.len())?
            .ok_or_else(|| LinkError::Io("post without reserve".into()))?;
        slot.copy_from_slice(data);
        self.post(header)
    }
    /// Move bytes along (tcp: write staged frames). Returns whether anything moved.
    fn progress(&mut self) -> LinkResult<bool>;
    /// Whether every posted frame has left this process.
    fn flushed(&self) -> bool;
    /// Whether the peer is still there (shm: abort flag and process liveness). Cheap; called
    /// while idle.
    fn health(&mut self) -> LinkResult<()>;
    /// Tell the peer this rank aborts, best effort, without blocking.
    fn abort(&mut self, reason: &str);
    /// The sockets the engine can sleep on (tcp), if any.
    fn sockets(&mut self) -> Vec<&mut mio::net::TcpStream> {
        Vec::new()
    }
}

/// [`RecvLink::recv_into`] through the slot: peek the frame, copy it into `dst`, release it.
pub(crate) fn recv_out_of_slot<L: RecvLink + ?Sized>(
    link: &mut L,
    expect: &Expect,
    dst: &mut [u8],
) -> LinkResult<bool> {
    match link.peek(expect)? {
        Some(v) => {
            dst.copy_from_slice(v);
            link.release()?;
            Ok(true)
        }
        None => Ok(false),
    }
}

/// The receiving half of a ring edge.
pub trait RecvLink: Send {
    /// The backend.
    fn kind(&self) -> TransportKind;
    /// The next frame's payload if it has fully arrived and its header matches `expect`; the
    /// same frame is returned until [`RecvLink::release`].
    fn peek(&mut self, expect: &Expect) -> LinkResult<Option<&[u8]>>;
    /// Give the slot of the frame last peeked back to the sender.
    fn release(&mut self) -> LinkResult<()>;
    /// Whether [`RecvLink::recv_into`] reads the payload straight off the wire into the
    /// caller's buffer, a copy fewer than [`RecvLink::peek`] and a copy out of the slot (tcp:
    /// the socket's read is the one copy; shm: the sender's copy into the slot is).
    fn receives_into(&self) -> bool {
        false
    }
    /// Receive the next frame's payload (`expect.len` bytes) into `dst`: `Ok(true)` once all of
    /// it is there and the frame is done with (no [`RecvLink::release`]), `Ok(false)` while it
    /// is on its way — call again with the same `dst`, which holds the part that arrived.
    fn recv_into(&mut self, expect: &Expect, dst: &mut [u8]) -> LinkResult<bool> {
        recv_out_of_slot(self, expect, dst)
    }
    /// Whether the peer is still there.
    fn health(&mut self) -> LinkResult<()>;
    /// Tell the peer this rank aborts, best effort.
    fn abort(&mut self, reason: &str);
    /// The sockets the engine can sleep on (tcp), if any.
    fn sockets(&mut self) -> Vec<&mut mio::net::TcpStream> {
        Vec::new()
    }
}
