//! A rank's two links, on a ring or with one peer ([`Links`]): the transports' halves, the
//! neighbours, the counters, and what each kind of link adds — the host's way to wait
//! ([`HostSide`]), a device's direct board and copy pairing ([`DevSide`]).

use std::time::{Duration, Instant};

use super::call::link_err;
use super::failure::{AbortFlag, TellAbort};
pub use crate::counters::Counters;
use crate::deadline::{Patience, Tick};
use crate::error::{Error, Result};
use crate::transport::device::{DevRecvLink, DevSendLink};
use crate::transport::wait::Waiter;
use crate::transport::{RecvLink, SendLink};

/// A rank's two links: to the next rank and from the previous one (on a pair, both the peer).
/// The host's ring and pairs are `Links`; a device's are [`DevLinks`].
pub struct Links<Tx: ?Sized = dyn SendLink, Rx: ?Sized = dyn RecvLink, Side = HostSide> {
    /// To the next rank.
    pub tx: Box<Tx>,
    /// From the previous rank.
    pub rx: Box<Rx>,
    /// Next rank.
    pub next: usize,
    /// Previous rank.
    pub prev: usize,
    /// Byte counters (payload bytes, per link).
    pub counters: Counters,
    /// What this kind of link adds.
    pub side: Side,
}

/// What the host's links add: how the engine sleeps on them.
pub struct HostSide {
    pub(crate) waiter: Waiter,
}

/// What a device's links add.
pub struct DevSide {
    /// The direct collectives' board and mappings, where every rank maps every other's buffers.
    pub(crate) direct: Option<crate::device::direct::Direct>,
    /// Whether a slice's last receive and the next slice's first send, unrelated plain copies,
    /// may run as one kernel ([`Stream::copy_pair`](crate::device::Stream::copy_pair);
    /// [`Config::device_copy_pairs`](crate::Config::device_copy_pairs)).
    pub pair_copies: bool,
}

/// A rank's two device links.
pub type DevLinks = Links<dyn DevSendLink, dyn DevRecvLink, DevSide>;

impl Links {
    /// Bundle two links.
    pub fn new(
        mut tx: Box<dyn SendLink>,
        mut rx: Box<dyn RecvLink>,
        next: usize,
        prev: usize,
    ) -> Result<Links> {
        let waiter = Waiter::new(tx.as_mut(), rx.as_mut())
            .map_err(|e| Error::io("setting up the poller", e))?;
        Ok(Links {
            tx,
            rx,
            next,
            prev,
            counters: Counters::default(),
            side: HostSide { waiter },
        })
    }

    /// Send everything posted so far, within `timeout` of no progress (or until `abort` is
    /// raised).
    pub fn flush(
        &mut self,
        what: &str,
        seq: u64,
        timeout: Duration,
        abort: &AbortFlag,
    ) -> Result<()> {
        // The clock is read only once the flush has to wait.
        let mut patience: Option<Patience> = None;
        while !self.tx.flushed() {
            if let Some(reason) = abort.reason() {
                return Err(Error::Aborted {
                    op: what.into(),
                    seq,
                    reason,
                });
            }
            let moved = self
                .tx
                .progress()
                .map_err(|e| link_err(e, what, seq, self.next, 0, None))?;
            let now = Instant::now();
            let tick = patience
                .get_or_insert_with(|| Patience::new(now))
                .tick(now, moved, timeout);
            if tick == Tick::Moved {
                self.side.waiter.progressed();
                continue;
            }
            if tick == Tick::TimedOut {
                return Err(Error::Timeout {
                    op: what.into(),
                    seq,
                    peer: self.next,
                    waiting: format!("rank {} to read the frames already sent to it", self.next),
                    after: timeout,
                });
            }
            self.tx
                .health()
                .map_err(|e| link_err(e, what, seq, self.next, 0, None))?;
            self.side.waiter.idle(timeout);
        }
        Ok(())
    }

    /// Tell both neighbours this rank aborts.
    pub fn abort(&mut self, reason: &str) {
        self.tx.abort(reason);
        self.rx.abort(reason);
    }
}

impl DevLinks {
    /// Tell both neighbours this rank aborts.
    pub fn abort(&mut self, reason: &str) {
        self.tx.abort(reason);
        self.rx.abort(reason);
        if let Some(d) = &self.side.direct {
            d.abort(reason);
        }
    }
}

impl TellAbort for Links {
    fn tell_abort(&mut self, why: &str) {
        self.abort(why);
    }
}

impl TellAbort for DevLinks {
    fn tell_abort(&mut self, why: &str) {
        self.abort(why);
    }
}
