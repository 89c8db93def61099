//! How a communicator fails, written once for the host `Communicator` and the `DeviceComm`.
//!
//! A communicator fails at most once: its first error is kept in its [`RingState`], every later
//! call is refused with it ([`refuse`]), and the failure is told to every peer this rank has a
//! link with, so that no peer waits for its deadline on a rank that has already given up:
//! - the ring's two neighbours, through the ring links ([`TellAbort`]);
//! - every other peer (point-to-point pairs, the host's pairwise links), through the caller's
//!   `tell_others`;
//! - this process's own threads (a posted session holding links outside the state), through the
//!   [`AbortFlag`], which they check while they wait.
//!
//! `abort()` from another thread raises the flag first, without the state lock (the running call
//! holds it and sees the flag at its next health check), then takes the state and fails it.
//! A call that only refused its arguments ([`Error::InvalidArgument`]) fails nothing.

use crate::error::{Error, Result};
use crate::flight::Recorder;
use crate::wire::Fingerprint;

/// A communicator's abort request, raised from any thread (`abort()`), seen by the call in
/// progress at its next health check (every `HEALTH_EVERY`, 20 ms, of waiting), so a stuck call ends
/// without waiting for its deadline.
#[derive(Debug, Default)]
pub struct AbortFlag {
    raised: std::sync::atomic::AtomicBool,
    reason: std::sync::Mutex<Option<String>>,
}

impl AbortFlag {
    /// Raise it (the first reason stays).
    pub fn raise(&self, reason: String) {
        let mut r = self.reason.lock().unwrap_or_else(|p| p.into_inner());
        r.get_or_insert(reason);
        self.raised
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// The reason, once raised.
    pub fn reason(&self) -> Option<String> {
        if !self.raised.load(std::sync::atomic::Ordering::Acquire) {
            return None;
        }
        self.reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// A communicator's mutable state (the host `Communicator`'s over [`Links`], a `DeviceComm`'s
/// over device links): its links, the next call's sequence number, its first failure.
pub(crate) struct RingState<L> {
    /// The two ring links (None for a one-rank world).
    pub links: Option<L>,
    /// The next call's sequence number.
    pub seq: u64,
    /// The first failure, once there is one.
    pub failed: Option<Error>,
}

/// Links that can tell both neighbours this rank aborts.
pub(crate) trait TellAbort {
    /// Tell both neighbours, with the reason.
    fn tell_abort(&mut self, why: &str);
}

impl<L: TellAbort> RingState<L> {
    /// A fresh state over `links`.
    pub(crate) fn new(links: Option<L>) -> RingState<L> {
        RingState {
            links,
            seq: 0,
            failed: None,
        }
    }

    fn tell_neighbours(&mut self, why: &str) {
        if let Some(l) = self.links.as_mut() {
            l.tell_abort(why);
        }
    }
}

/// Who fails: the rank, the communicator's abort flag and its flight recorder, and what kind of
/// communicator it is (for the log line).
pub(crate) struct Failing<'a> {
    /// This rank.
    pub rank: usize,
    /// The communicator's abort flag, raised so that its other threads stop waiting.
    pub flag: &'a AbortFlag,
    /// Where the failure is recorded and dumped.
    pub flight: &'a Recorder,
    /// `"host"` or `"device"`.
    pub kind: &'static str,
}

/// A call on `who.rank` failed with `e`: unless it only refused its arguments, keep the first
/// failure, write the flight record, raise the abort flag, tell the ring's neighbours and then
/// the other peers (`tell_others`, with the reason). Call with the state held.
pub(crate) fn fail<L: TellAbort>(
    st: &mut RingState<L>,
    who: &Failing<'_>,
    e: &Error,
    tell_others: impl FnOnce(&str),
) {
    if matches!(e, Error::InvalidArgument { .. }) {
        return;
    }
    tracing::error!(target: "ringzero::fail", rank = who.rank, comm = who.kind, "{e}");
    let why = format!("rank {}: {e}", who.rank);
    st.tell_neighbours(&why);
    st.failed.get_or_insert_with(|| e.clone());
    who.flight.failed(&e.to_string());
    // A posted session on another thread (which holds links outside the state) ends at the
    // flag rather than at its deadline, and gives its links back for `tell_others`.
    who.flag.raise(why.clone());
    tell_others(&why);
}

/// `abort()` on `rank`: raise the flag without a lock (a running call holds the state; it sees
/// the flag at its next health check and returns), then take the state, tell the neighbours, and
/// fail every later call.
pub(crate) fn abort<L: TellAbort>(
    state: &std::sync::Mutex<RingState<L>>,
    flag: &AbortFlag,
    rank: usize,
    reason: &str,
    flight: &Recorder,
) {
    let why = format!("rank {rank}: {reason}");
    flag.raise(why.clone());
    let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
    let e = Error::Aborted {
        op: "abort".into(),
        seq: st.seq,
        reason: why,
    };
    st.tell_neighbours(&e.to_string());
    flight.failed(&e.to_string());
    st.failed.get_or_insert(e);
}

/// A communicator runs no more calls once it failed, or once `abort()` was called (which is
/// about to take the state): the error says which.
pub(crate) fn refuse(
    failed: Option<&Error>,
    abort: &AbortFlag,
    fp: &Fingerprint,
    seq: u64,
) -> Result<()> {
    let reason = match (failed, abort.reason()) {
        (Some(e), _) => format!("an earlier error: {e}"),
        (None, Some(r)) => r,
        (None, None) => return Ok(()),
    };
    Err(Error::Aborted {
        op: fp.to_string(),
        seq,
        reason,
    })
}
