//! One collective call as both engines run it: its identity ([`Call`]: plan, fingerprint,
//! sequence number, deadline), the frames it expects, which link directions it still needs, and
//! the errors that name it (a link's failure, a wait's timeout, an abort).

use std::time::Duration;

use ringzero_kernels::{DType, ReduceOp};

use super::failure::AbortFlag;
use super::schedule::{Op, Plan};
use crate::error::{Error, Result};
use crate::transport::LinkError;
use crate::wire::{Expect, Fingerprint};

/// One collective call on this rank.
pub struct Call<'a> {
    /// The plan.
    pub plan: &'a Plan,
    /// The call's fingerprint.
    pub fp: Fingerprint,
    /// Its sequence number.
    pub seq: u64,
    /// Element type.
    pub dtype: DType,
    /// Reduce operator (ignored by collectives that do not reduce).
    pub op: ReduceOp,
    /// World size.
    pub n: usize,
    /// This rank.
    pub rank: usize,
    /// Deadline for any wait without progress.
    pub timeout: Duration,
    /// Copy received results into the user's buffers with streaming stores (the output is larger
    /// than the caches; see [`cpu::copy_streaming`]).
    pub stream_stores: bool,
    /// The communicator's abort request, checked while waiting.
    pub abort: &'a AbortFlag,
    /// The sequence number and fingerprint of the frames this rank receives, where they are not
    /// `seq` and `fp` (a point-to-point call: each direction of a pair counts its own frames,
    /// and an exchange's two directions may differ in count).
    pub incoming: Option<(u64, Fingerprint)>,
}

impl<'a> Call<'a> {
    /// A call of `plan` on rank `rank` of `n` (frames numbered `seq` and fingerprinted `fp`
    /// both ways, plain stores), waiting at most `timeout` without progress and watching
    /// `abort`: what both communicators build every call from.
    pub(crate) fn on(
        plan: &'a Plan,
        (seq, fp): (u64, Fingerprint),
        (dtype, op): (DType, ReduceOp),
        (n, rank): (usize, usize),
        (timeout, abort): (Duration, &'a AbortFlag),
    ) -> Call<'a> {
        Call {
            plan,
            fp,
            seq,
            dtype,
            op,
            n,
            rank,
            timeout,
            stream_stores: false,
            abort,
            incoming: None,
        }
    }

    /// The sequence number and fingerprint of the frames this rank receives.
    pub fn expected(&self) -> (u64, Fingerprint) {
        self.incoming.unwrap_or((self.seq, self.fp))
    }
}

/// The abort check of a running call (see [`AbortFlag`]).
impl AbortFlag {
    /// An [`Error::Aborted`] for `call` once raised.
    pub(crate) fn check(&self, call: &Call) -> Result<()> {
        match self.reason() {
            None => Ok(()),
            Some(reason) => Err(Error::Aborted {
                op: call.fp.to_string(),
                seq: call.seq,
                reason,
            }),
        }
    }
}

pub(crate) fn link_err(
    e: LinkError,
    what: &str,
    seq: u64,
    peer: usize,
    rank: usize,
    fp: Option<&Fingerprint>,
) -> Error {
    match e {
        LinkError::Lost(detail) => Error::PeerLost {
            op: what.into(),
            seq,
            peer,
            detail,
        },
        LinkError::PeerAborted(reason) => Error::Aborted {
            op: what.into(),
            seq,
            reason: format!("rank {peer} aborted: {reason}"),
        },
        LinkError::Mismatch { theirs } => Error::Mismatch {
            seq,
            rank,
            ours: fp.map_or_else(|| what.to_string(), |f| f.to_string()),
            peer,
            theirs,
        },
        LinkError::Protocol(detail) => Error::Protocol {
            peer: format!("rank {peer}"),
            detail: format!("{what} seq {seq}: {detail}"),
        },
        LinkError::Io(detail) => Error::Io {
            context: format!("{what} seq {seq}"),
            detail,
        },
    }
}

/// The frame a receiving `op` of `call` waits for (elements of `es` bytes).
pub(crate) fn expect(call: &Call, op: &Op, es: usize) -> Expect {
    let (seq, fp) = call.expected();
    Expect {
        seq,
        step: op.step.wrapping_sub(1),
        slice: op.slice,
        fp,
        len: op.elems * es,
    }
}

/// The timeout of an op that waited for its incoming frame (`have_in` false) or for a free `slot`
/// at the next rank.
pub(crate) fn op_timeout(
    call: &Call,
    what: &str,
    expect: &Expect,
    have_in: bool,
    prev: usize,
    next: usize,
    slot: &str,
) -> Error {
    let (peer, waiting) = if !have_in {
        (
            prev,
            format!(
                "frame (step {}, slice {}) from rank {prev}",
                expect.step, expect.slice
            ),
        )
    } else {
        (
            next,
            format!("a free {slot} at rank {next} (it has not consumed earlier frames)"),
        )
    };
    Error::Timeout {
        op: what.into(),
        seq: if have_in { call.seq } else { expect.seq },
        peer,
        waiting,
        after: call.timeout,
    }
}

/// Which directions of a link pair a wait still has frames to move on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Needs {
    /// Frames are still to come from the previous rank.
    pub(crate) rx: bool,
    /// Frames are still to go to the next rank.
    pub(crate) tx: bool,
}

impl Needs {
    pub(crate) const BOTH: Needs = Needs { rx: true, tx: true };
}

/// Where a plan's last receiving op and its last sending op are: each direction is needed up
/// to its last op (a broadcast's relay ends sending, its root done and perhaps gone).
#[derive(Clone, Copy, Debug)]
pub(crate) struct LastOps {
    recv: Option<usize>,
    send: Option<usize>,
}

impl LastOps {
    pub(crate) fn of(plan: &Plan) -> LastOps {
        LastOps {
            recv: plan.ops.iter().rposition(|o| o.recv),
            send: plan.ops.iter().rposition(|o| o.send),
        }
    }

    /// What op `at` and the ops after it still move.
    pub(crate) fn needs(self, at: usize) -> Needs {
        Needs {
            rx: self.recv.is_some_and(|l| at <= l),
            tx: self.send.is_some_and(|l| at <= l),
        }
    }
}

/// Whether a health check's result `r` is the peer gone from a direction nothing more is
/// `needed` on: no failure (see [`health_of`]).
pub(crate) fn gone_unneeded(r: &std::result::Result<(), LinkError>, needed: bool) -> bool {
    !needed && matches!(r, Err(LinkError::Lost(_)))
}
