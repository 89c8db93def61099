//! Errors as data. Every error that happens inside a collective names the collective, its
//! sequence number and the peer involved; configuration errors name the variable.

use std::time::Duration;

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in a communicator. `Clone` so that a communicator that failed can
/// return the original cause from every later call.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// A configuration value (usually an environment variable) is missing or malformed.
    #[error("configuration: {var}: {msg}")]
    Config {
        /// The variable or setting.
        var: String,
        /// What is wrong with it.
        msg: String,
    },
    /// The caller passed arguments that cannot work; nothing was changed or sent.
    #[error("{op}: invalid argument: {msg}")]
    InvalidArgument {
        /// The call.
        op: String,
        /// What is wrong.
        msg: String,
    },
    /// A connection's handshake was refused or failed (wrong secret, version or job id).
    #[error("handshake with {peer}: {reason}")]
    Handshake {
        /// Who we talked to (rank and/or address).
        peer: String,
        /// Why it failed.
        reason: String,
    },
    /// A wait passed its deadline.
    #[error("{op} seq {seq}: timed out after {:.1}s waiting for {waiting} (peer rank {peer})", .after.as_secs_f64())]
    Timeout {
        /// The collective with its arguments.
        op: String,
        /// Its sequence number on this communicator.
        seq: u64,
        /// The peer waited on.
        peer: usize,
        /// What was awaited.
        waiting: String,
        /// The deadline that passed.
        after: Duration,
    },
    /// A peer went away: socket closed, process dead, shm segment gone.
    #[error("{op} seq {seq}: lost peer rank {peer}: {detail}")]
    PeerLost {
        /// The collective.
        op: String,
        /// Its sequence number.
        seq: u64,
        /// The peer.
        peer: usize,
        /// What was observed.
        detail: String,
    },
    /// Two ranks called different collectives (or the same one with different arguments).
    #[error("collective mismatch at seq {seq}: this rank ({rank}) called {ours}, but rank {peer} called {theirs}")]
    Mismatch {
        /// Sequence number on this rank.
        seq: u64,
        /// This rank.
        rank: usize,
        /// What this rank called.
        ours: String,
        /// The peer.
        peer: usize,
        /// What the peer called (with its own sequence number).
        theirs: String,
    },
    /// The communicator was aborted, here or by a peer; every later call returns this.
    #[error("{op} seq {seq}: communicator aborted: {reason}")]
    Aborted {
        /// The collective during which the abort was seen.
        op: String,
        /// Its sequence number.
        seq: u64,
        /// The cause, as reported by whoever aborted first.
        reason: String,
    },
    /// A peer sent something that is not the protocol.
    #[error("protocol error from {peer}: {detail}")]
    Protocol {
        /// Who sent it.
        peer: String,
        /// What was wrong.
        detail: String,
    },
    /// An operating-system call failed.
    #[error("{context}: {detail}")]
    Io {
        /// What we were doing.
        context: String,
        /// The OS error.
        detail: String,
    },
    /// A kernel rejected its operands.
    #[error(transparent)]
    Kernel(#[from] ringzero_kernels::KernelError),
    /// A device (CUDA) call failed, or no device is usable.
    #[error("{context}: {source}")]
    Device {
        /// What the communicator was doing.
        context: String,
        /// The device's error.
        source: ringzero_kernels::device::DeviceError,
    },
}

impl Error {
    /// This error with the sequence number of the call it happened in (connects, which know no
    /// call, report 0).
    pub(crate) fn at_seq(mut self, at: u64) -> Error {
        if let Error::Timeout { seq, .. }
        | Error::PeerLost { seq, .. }
        | Error::Aborted { seq, .. } = &mut self
        {
            *seq = at;
        }
        self
    }

    /// An [`Error::Io`] from an `io::Error` and a description of what was being done.
    pub fn io(context: impl Into<String>, e: std::io::Error) -> Error {
        Error::Io {
            context: context.into(),
            detail: e.to_string(),
        }
    }

    /// An [`Error::Config`].
    pub fn config(var: impl Into<String>, msg: impl Into<String>) -> Error {
        Error::Config {
            var: var.into(),
            msg: msg.into(),
        }
    }
}
