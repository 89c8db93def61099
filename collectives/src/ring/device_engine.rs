//! The device engine: drives one rank's [`Plan`](super::Plan) over device links ([`DevSendLink`](crate::transport::device::DevSendLink),
//! [`DevRecvLink`](crate::transport::device::DevRecvLink)) by queueing work on a [`Stream`].
//!
//! Words as in [`super::schedule`]. The engine runs the plan's ops in order, as the host engine
//! does, but never waits for the device between them: for each op it waits (on the host) until the
//! incoming frame has arrived and a slot at the next rank is free, then *queues* the op's
//! arithmetic — `local ⊕ incoming` written by one kernel straight to its destination (the user's
//! output, or the next rank's slot when nothing is kept), a copy into the slot when both are
//! written — and a marker after it. The frame is published and the incoming slot released only
//! when that marker completes (the *pending* queue, retired in order while the engine waits for
//! anything else). So while the device reduces slice `j`, the host is already waiting for slice
//! `j + 1`'s frame, and up to `slots` frames per link are in flight: copies, kernels and the
//! neighbours' work on consecutive slices overlap.
//!
//! One exception to one op at a time: a slice's last receive (a frame copied into the output,
//! nothing sent) and the next slice's first send (a local chunk copied into the next rank's slot)
//! are queued as one piece of work ([`Stream::copy_pair`]) when a slot is free at once. On a link
//! staged in host memory the first is host→device and the second device→host; queued one after
//! the other on the one stream, with the neighbours in step, each direction of the PCIe link would
//! sit idle for a third of a 2-rank all-reduce.
//!
//! Explicit-copy staging (`RINGZERO_STAGING=copy`, and `auto`'s pick where at most 2 ranks use a
//! GPU; kernels never touch host slots) puts its copies on the stream's two copy lanes
//! ([`CopyLane`](crate::device::CopyLane)): into the device on one, out of it on the other, the compute order between
//! them joined where data passes. Such an op starts once everything before it has ended; within
//! it the pair's two copies run at once, and a combine goes in 8 parts (`STAGED_PARTS`), so that
//! part `k + 1` comes in while part `k − 1` goes out: the copy engines' way to both directions at
//! once, where one kernel over mapped host memory moves well under what they do. With several
//! ranks on one GPU their mapped kernels fill the link together instead (`StagingMode`; the
//! figures per GPU: `docs/gpu-runs/README.md`).
//!
//! Deadlines and peer health are as in the host engine: nothing waits more than the call's
//! timeout without progress, and the error names the collective, its sequence number, the peer and
//! what was awaited.

use std::collections::VecDeque;
use std::time::Instant;

use super::call::{expect, link_err, Call, LastOps, Needs};
use super::engine::{Patience, Tick};
use super::exec::{self, Executor};
use crate::error::{Error, Result};
use crate::transport::wait::Waiter;
use ringzero_kernels::device::Stream;

use super::device_work::{pairs, retire, Pending, Work};
pub use super::engine::DevBufs;
pub use super::links::DevLinks;

/// Refuse buffers smaller than the plan needs.
pub fn check_sizes(call: &Call, bufs: &DevBufs) -> Result<()> {
    let es = call.dtype.size();
    let p = call.plan;
    let (need_in, need_out) = (p.input_len * es, p.output_len * es);
    let ok = match *bufs {
        DevBufs::Split {
            input_bytes,
            output_bytes,
            ..
        } => input_bytes >= need_in && output_bytes >= need_out,
        DevBufs::One { bytes, .. } => bytes >= need_in.max(need_out),
    };
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidArgument {
            op: call.fp.to_string(),
            msg: format!(
                "device buffers of {bufs:?}; the plan needs {need_in} input and {need_out} output bytes"
            ),
        })
    }
}

/// Run one call on the device to completion (every frame posted, every slot released, the
/// stream's work for it complete).
///
/// # Safety
/// The addresses in `bufs` must be device-addressable memory of `stream` of the given lengths,
/// live and not used by anything else until this returns.
pub unsafe fn run<S: Stream>(
    stream: &S,
    links: &mut DevLinks,
    call: &Call,
    bufs: DevBufs,
) -> Result<()> {
    check_sizes(call, &bufs)?;
    // SAFETY: forwarded from the caller.
    let r = unsafe { run_ops(stream, links, call, bufs) };
    if r.is_err() {
        // Work queued before the error still reads and writes the user's buffers and the slots:
        // let it finish before the caller may free or unmap them (within the deadline where
        // the device keeps its memory alive until then).
        quiesce(stream, call.timeout);
    }
    r
}

/// Wait until everything queued on `stream` has ended; on a stream whose memory outlives its
/// work, at most `timeout` ([`crate::device::settle::settle`]).
fn quiesce<S: Stream>(stream: &S, timeout: std::time::Duration) {
    if let Ok(m) = stream.mark() {
        crate::device::settle::settle(stream, &m, timeout);
    }
}

/// The body of [`run`].
///
/// # Safety
/// As for [`run`].
unsafe fn run_ops<S: Stream>(
    stream: &S,
    links: &mut DevLinks,
    call: &Call,
    bufs: DevBufs,
) -> Result<()> {
    let what = call.fp.to_string();
    let mut ex = DevExec {
        stream,
        links,
        call,
        bufs,
        what: &what,
        pending: VecDeque::new(),
        waiter: Waiter::device(),
    };
    exec::run_ops(call, &mut ex)
}

/// The device's [`Executor`]: each op queued on the stream, retired once its marker completes.
/// Made only by [`run_ops`], under [`run`]'s safety contract.
struct DevExec<'a, S: Stream> {
    stream: &'a S,
    links: &'a mut DevLinks,
    call: &'a Call<'a>,
    bufs: DevBufs,
    what: &'a str,
    pending: VecDeque<Pending<S::Marker>>,
    waiter: Waiter,
}

impl<S: Stream> Executor for DevExec<'_, S> {
    fn op(&mut self, i: usize, needs: Needs) -> Result<usize> {
        let ops = &self.call.plan.ops;
        let pair_copies = self.links.side.pair_copies;
        let mut w = Work {
            stream: self.stream,
            links: &mut *self.links,
            call: self.call,
            bufs: &self.bufs,
            what: self.what,
            pending: &mut self.pending,
            waiter: &mut self.waiter,
            needs,
        };
        // SAFETY: a `DevExec` is made only by `run_ops`, whose caller vouches for the buffers
        // and the stream ([`run`]'s contract) until the call returns.
        match ops.get(i + 1).filter(|b| pair_copies && pairs(&ops[i], b)) {
            Some(b) => unsafe { w.run_pair(&ops[i], b) },
            None => unsafe { w.run_op(&ops[i]) }.map(|()| 1),
        }
    }

    /// Drain: every marker completes, every frame is posted (and has left this process: tcp
    /// writes from its staging), every slot released.
    fn finish(&mut self) -> Result<()> {
        let (stream, call, what) = (self.stream, self.call, self.what);
        let links = &mut *self.links;
        let mut patience = Patience::new(Instant::now());
        while !self.pending.is_empty() || !links.tx.flushed() {
            let sent = links
                .tx
                .progress()
                .map_err(|e| link_err(e, what, call.seq, links.next, call.rank, Some(&call.fp)))?;
            let retired = retire(
                stream,
                links,
                (what, call.seq, call.rank, Some(&call.fp)),
                &mut self.pending,
            )? || sent;
            let tick = patience.tick(Instant::now(), retired, call.timeout);
            if tick == Tick::Moved {
                self.waiter.progressed();
                continue;
            }
            call.abort.check(call)?;
            if tick == Tick::TimedOut {
                return Err(Error::Timeout {
                    op: what.to_string(),
                    seq: call.seq,
                    peer: call.rank,
                    waiting: if self.pending.is_empty() {
                        format!("rank {} to read this rank's last frames", links.next)
                    } else {
                        format!(
                            "this rank's device ({}) to finish its queued work",
                            stream.name()
                        )
                    },
                    after: call.timeout,
                });
            }
            self.waiter.idle(call.timeout);
        }
        Ok(())
    }
}

/// The device work that posted point-to-point messages on one pair's links have queued and
/// that has not completed yet, oldest first ([`step_one_way`], [`Inflight::retire`]).
pub(crate) struct Inflight<M>(VecDeque<Pending<M>>);

impl<M> Default for Inflight<M> {
    fn default() -> Self {
        Inflight(VecDeque::new())
    }
}

impl<M> Inflight<M> {
    /// Whether work queued for the message tagged `tag` has still to complete.
    pub(crate) fn holds(&self, tag: u64) -> bool {
        self.0.iter().any(|p| p.tag == tag)
    }

    /// Whether nothing is left to complete.
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether a frame is still to be published to the peer.
    pub(crate) fn posting(&self) -> bool {
        self.0.iter().any(|p| p.post.is_some())
    }

    /// Publish the frames and release the slots whose work has completed, in order, on `links`
    /// (errors name `what`, this `rank` and the entry's message); whether any did.
    pub(crate) fn retire<S: Stream<Marker = M>>(
        &mut self,
        stream: &S,
        links: &mut DevLinks,
        what: &str,
        rank: usize,
    ) -> Result<bool> {
        let seq = self.0.front().map_or(0, |p| p.tag >> 1);
        retire(stream, links, (what, seq, rank, None), &mut self.0)
    }
}

/// One direction of one posted point-to-point message (the asynchronous forms, which run as
/// they can, each direction of each pair on its own: `device/posted.rs`): queue whatever of
/// `call`'s plan, which only sends or only receives, can go now from op `at` on — a send while
/// a slot at the peer is free, a receive while its frame is there — moving `at` past each, its
/// work tagged `tag` in `inflight` (retired by [`Inflight::retire`]: the message is done once
/// `at` is at the plan's end and `inflight` holds nothing of `tag`). Never waits. Whether
/// anything was queued. `what` names the call in errors.
///
/// # Safety
/// As for [`run`], for as long as `inflight` holds work of `tag`; [`check_sizes`] passed.
pub(crate) unsafe fn step_one_way<S: Stream>(
    stream: &S,
    links: &mut DevLinks,
    call: &Call,
    bufs: &DevBufs,
    at: &mut usize,
    (inflight, tag): (&mut Inflight<S::Marker>, u64),
    what: &str,
) -> Result<bool> {
    let es = call.dtype.size();
    let (prev, next, rank) = (links.prev, links.next, call.rank);
    let mut moved = false;
    let mut waiter = Waiter::device();
    while let Some(op) = call.plan.ops.get(*at) {
        debug_assert!(
            op.send != op.recv,
            "a posted message's op only sends or receives"
        );
        let (incoming, slot) = if op.send {
            let slot = links
                .tx
                .reserve()
                .map_err(|e| link_err(e, what, call.seq, next, rank, Some(&call.fp)))?;
            match slot {
                Some(sl) => (None, Some(sl)),
                None => break,
            }
        } else {
            let e = expect(call, op, es);
            match links
                .rx
                .peek(&e)
                .map_err(|err| link_err(err, what, e.seq, prev, rank, Some(&e.fp)))?
            {
                Some(a) => (Some(a), None),
                None => break,
            }
        };
        let mut w = Work {
            stream,
            links: &mut *links,
            call,
            bufs,
            what,
            pending: &mut inflight.0,
            waiter: &mut waiter,
            needs: LastOps::of(call.plan).needs(*at),
        };
        w.check_slot(op)?;
        // SAFETY: forwarded from the caller; `incoming` is the frame this op receives (held
        // until its work's marker completes), `slot` the one it sends into (reserved).
        unsafe { w.queue(op, incoming, slot) }?;
        inflight.0.back_mut().expect("queue pushes one").tag = tag;
        *at += 1;
        moved = true;
    }
    Ok(moved)
}
