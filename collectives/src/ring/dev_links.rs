//! A rank's two device ring links ([`DevLinks`]): the transports' halves, the counters, the
//! direct step's board where there is one, and how they are told this rank aborts.

use super::engine::Counters;
use crate::transport::device::{DevRecvLink, DevSendLink};

/// A rank's two device ring links.
pub struct DevLinks {
    /// To the next rank.
    pub tx: Box<dyn DevSendLink>,
    /// From the previous rank.
    pub rx: Box<dyn DevRecvLink>,
    /// Next rank.
    pub next: usize,
    /// Previous rank.
    pub prev: usize,
    /// Byte counters (payload bytes, per link).
    pub counters: Counters,
    /// The direct collectives' board and mappings, where every rank maps every other's buffers.
    pub(crate) direct: Option<crate::device::direct::Direct>,
    /// Whether a slice's last receive and the next slice's first send, unrelated plain copies,
    /// may run as one kernel ([`Stream::copy_pair`](crate::device::Stream::copy_pair);
    /// [`Config::device_copy_pairs`](crate::Config::device_copy_pairs)).
    pub pair_copies: bool,
}

impl super::failure::TellAbort for DevLinks {
    fn tell_abort(&mut self, why: &str) {
        self.abort(why);
    }
}

impl DevLinks {
    /// Tell both neighbours this rank aborts.
    pub fn abort(&mut self, reason: &str) {
        self.tx.abort(reason);
        self.rx.abort(reason);
        if let Some(d) = &self.direct {
            d.abort(reason);
        }
    }
}
