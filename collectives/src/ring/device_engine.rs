//! The device engine: drives one rank's [`Plan`](super::Plan) over device links ([`DevSendLink`],
//! [`DevRecvLink`]) by queueing work on a [`Stream`].
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
//! the other on the one stream, with the neighbours in step, each direction of the PCIe link sat
//! idle for a third of a 2-rank all-reduce (the H100 run: 74 % of what the link allows).
//!
//! Explicit-copy staging (`RINGZERO_STAGING=copy`, and `auto`'s pick where at most 2 ranks use a
//! GPU; kernels never touch host slots) puts its copies on the stream's two copy lanes
//! ([`CopyLane`]): into the device on one, out of it on the other, the compute order between
//! them joined where data passes. Such an op starts once everything before it has ended; within
//! it the pair's two copies run at once, and a combine goes in 8 parts (`STAGED_PARTS`), so that
//! part `k + 1` comes in while part `k − 1` goes out. On the H200 one kernel moving both ways
//! over mapped host memory made 29–31 GB/s each way where the copy engines make 46–50: this is
//! the copy engines' way to both directions at once, and it made 2-rank staging 1.18× faster
//! than mapped (22.6 against 19.2 GB/s busbw at 256 MiB, 90 % of the both-ways bound against
//! 77 %). On 4 ranks of one GPU it was 0.73× of mapped, whose four kernels fill the link.
//!
//! Deadlines and peer health are as in the host engine: nothing waits more than the call's
//! timeout without progress, and the error names the collective, its sequence number, the peer and
//! what was awaited.

use std::collections::VecDeque;
use std::time::Instant;

use ringzero_kernels::ReduceOp;

use super::engine::{
    base, expect, gone_unneeded, link_err, op_timeout, Call, Counters, LastOps, Needs, Patience,
    Tick,
};
use super::schedule::{Loc, Op};
use crate::device::stream::{CopyLane, Stream};
use crate::error::{Error, Result};
use crate::transport::device::{DevPtr, DevRecvLink, DevSendLink};
use crate::transport::wait::Waiter;
use crate::wire::{Expect, Fingerprint, FrameHeader};
use ringzero_kernels::device::DeviceError;

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
    /// may run as one kernel ([`Stream::copy_pair`];
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

pub use super::engine::DevBufs;

struct Pending<M> {
    marker: M,
    post: Option<FrameHeader>,
    release: bool,
    /// Which posted point-to-point message queued it ([`step_one_way`]); unused in a collective.
    tag: u64,
}

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
/// work, at most `timeout` ([`crate::device::stream::settle`]).
fn quiesce<S: Stream>(stream: &S, timeout: std::time::Duration) {
    if let Ok(m) = stream.mark() {
        crate::device::stream::settle(stream, &m, timeout);
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
    let mut pending: VecDeque<Pending<S::Marker>> = VecDeque::new();
    let mut waiter = Waiter::device();
    let ops = &call.plan.ops;
    let last = LastOps::of(call.plan);
    let pair_copies = links.pair_copies;
    let mut i = 0;
    while i < ops.len() {
        let mut w = Work {
            stream,
            links: &mut *links,
            call,
            bufs: &bufs,
            what: &what,
            pending: &mut pending,
            waiter: &mut waiter,
            needs: last.needs(i),
        };
        // SAFETY: forwarded from the caller.
        i += match ops.get(i + 1).filter(|b| pair_copies && pairs(&ops[i], b)) {
            Some(b) => unsafe { w.run_pair(&ops[i], b) }?,
            None => unsafe { w.run_op(&ops[i]) }.map(|()| 1)?,
        };
    }
    // Drain: every marker completes, every frame is posted (and has left this process: tcp
    // writes from its staging), every slot released.
    let mut patience = Patience::new(Instant::now());
    while !pending.is_empty() || !links.tx.flushed() {
        let sent = links
            .tx
            .progress()
            .map_err(|e| link_err(e, &what, call.seq, links.next, call.rank, Some(&call.fp)))?;
        let retired = retire(
            stream,
            links,
            (&what, call.seq, call.rank, Some(&call.fp)),
            &mut pending,
        )? || sent;
        let tick = patience.tick(Instant::now(), retired, call.timeout);
        if tick == Tick::Moved {
            waiter.progressed();
            continue;
        }
        call.abort.check(call)?;
        if tick == Tick::TimedOut {
            return Err(Error::Timeout {
                op: what,
                seq: call.seq,
                peer: call.rank,
                waiting: if pending.is_empty() {
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
        waiter.idle(call.timeout);
    }
    Ok(())
}

/// What a link error is reported as: the call's name, its sequence number, this rank and its
/// fingerprint.
type ErrAt<'a> = (&'a str, u64, usize, Option<&'a Fingerprint>);

/// Publish frames and release slots whose work has completed, in order. Whether any did.
fn retire<S: Stream>(
    stream: &S,
    links: &mut DevLinks,
    (what, seq, rank, fp): ErrAt<'_>,
    pending: &mut VecDeque<Pending<S::Marker>>,
) -> Result<bool> {
    let mut any = false;
    while let Some(p) = pending.front() {
        let done = stream.done(&p.marker).map_err(|e| Error::Device {
            context: format!("{what} seq {seq}: on {}", stream.name()),
            source: e,
        })?;
        if !done {
            break;
        }
        let p = pending.pop_front().expect("front exists");
        if let Some(h) = p.post {
            links
                .tx
                .post(&h)
                .map_err(|e| link_err(e, what, seq, links.next, rank, fp))?;
            links.counters.bytes_sent += h.len;
            links.counters.frames_sent += 1;
        }
        if p.release {
            links
                .rx
                .release()
                .map_err(|e| link_err(e, what, seq, links.prev, rank, fp))?;
        }
        any = true;
    }
    Ok(any)
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

/// Whether ops `a` and `b` (adjacent in the plan) are a slice's last receive — a frame copied
/// into the output, nothing sent — and the next slice's first send — a local chunk into the next
/// rank's slot, nothing received. Their copies are unrelated, so they can be queued as one piece
/// of work ([`Stream::copy_pair`]): on a link staged in host memory the first is host→device and
/// the second device→host, and one after the other each would leave the other direction idle
/// (all-reduce and in-place all-gather on 2 ranks are mostly such steps).
fn pairs(a: &Op, b: &Op) -> bool {
    a.recv
        && !a.send
        && a.local.is_none()
        && a.store.is_some()
        && !a.finalize
        && !b.recv
        && b.send
        && b.local.is_some()
        && !b.finalize
}

/// Explicit-copy staging cuts a combine into at most this many parts, so its copies in and out
/// overlap each other and the kernel. An op starts only once the one before it has ended (see
/// [`lanes_after_all`]), so its first part comes in alone and its last goes out alone: P parts
/// take about (P + 1)/P of the time both ways at once would.
const STAGED_PARTS: usize = 8;

/// `(first element, elements)` of each part of an `elems`-element combine of `es`-byte elements
/// (explicit-copy staging) on a link of `slot_bytes` slots: at most [`STAGED_PARTS`], each at
/// least a [`STAGED_PARTS`]th of a slot (a short op, the tail of a message, stays whole) but the
/// last, starting at multiples of 64 elements so that the kernels' 16-byte vectors stay aligned.
fn staged_parts(
    elems: usize,
    es: usize,
    slot_bytes: usize,
) -> impl Iterator<Item = (usize, usize)> {
    let min = (slot_bytes / STAGED_PARTS).div_ceil(es.max(1)).max(64);
    let parts = (elems / min).clamp(1, STAGED_PARTS);
    let per = elems.div_ceil(parts).next_multiple_of(64);
    (0..elems)
        .step_by(per.max(1))
        .map(move |at| (at, per.min(elems - at)))
}

/// Order the copy lanes and the compute order after everything queued on any of them: an op
/// whose copies go on the lanes starts only once every earlier op's work is done with what it
/// reads and writes.
fn lanes_after_all<S: Stream>(stream: &S) -> std::result::Result<(), DeviceError> {
    for lane in CopyLane::BOTH {
        stream.compute_after_lane(lane)?;
    }
    for lane in CopyLane::BOTH {
        stream.lane_after_compute(lane)?;
    }
    Ok(())
}

/// One call's engine state, borrowed for one op (or pair of ops).
struct Work<'a, S: Stream> {
    stream: &'a S,
    links: &'a mut DevLinks,
    call: &'a Call<'a>,
    bufs: &'a DevBufs,
    what: &'a str,
    pending: &'a mut VecDeque<Pending<S::Marker>>,
    waiter: &'a mut Waiter,
    /// What this op (or pair) and the ops after it still move: a peer gone from a direction
    /// with nothing left on it fails no wait (see `engine::health_of`).
    needs: Needs,
}

impl<S: Stream> Work<'_, S> {
    /// Refuse a slice larger than the next rank's slots.
    fn check_slot(&self, op: &Op) -> Result<()> {
        let bytes = op.elems * self.call.dtype.size();
        if op.send && bytes > self.links.tx.slot_bytes() {
            return Err(Error::InvalidArgument {
                op: self.what.into(),
                msg: format!(
                    "a slice of {bytes} bytes exceeds the {}-byte device slot",
                    self.links.tx.slot_bytes()
                ),
            });
        }
        Ok(())
    }

    /// The device address of `loc` in the caller's buffers.
    fn at(&self, loc: &Loc) -> DevPtr {
        let plan = self.call.plan;
        let start = match *self.bufs {
            DevBufs::Split { input, output, .. } => match loc.buf {
                super::schedule::Buf::Input => input,
                super::schedule::Buf::Output => output,
            },
            DevBufs::One { buf, .. } => buf,
        };
        start + ((loc.range.start - base(plan, loc.buf)) * self.call.dtype.size()) as u64
    }

    /// Run one op: wait for what it needs, queue its work.
    ///
    /// # Safety
    /// As for [`run`].
    unsafe fn run_op(&mut self, op: &Op) -> Result<()> {
        self.check_slot(op)?;
        let (incoming, slot) = self.acquire(op)?;
        // SAFETY: forwarded from the caller.
        unsafe { self.queue(op, incoming, slot) }
    }

    /// Run `a`, and `b` with it as one piece of work when a slot at the next rank is free at
    /// once (never waiting for one: the slot may be freed only by work `a` releases). Returns
    /// how many of the two ops ran.
    ///
    /// # Safety
    /// As for [`run`]; [`pairs`]`(a, b)`.
    unsafe fn run_pair(&mut self, a: &Op, b: &Op) -> Result<usize> {
        self.check_slot(b)?;
        let es = self.call.dtype.size();
        let (a_bytes, b_bytes) = (a.elems * es, b.elems * es);
        let a_dst = self.at(a.store.as_ref().expect("pairs: a stores"));
        let b_src = self.at(b.local.as_ref().expect("pairs: b has a local operand"));
        let keep = b
            .store
            .as_ref()
            .map(|l| self.at(l))
            .filter(|&st| st != b_src);
        // One launch runs both copies at once: `b` must not read or write what `a` writes (a
        // ring's first send reads this rank's own data, never what it received; checked, not
        // assumed).
        let overlap = |x: DevPtr, y: DevPtr, n: usize| x < y + n as u64 && y < x + a_bytes as u64;
        let independent =
            !overlap(a_dst, b_src, b_bytes) && keep.is_none_or(|k| !overlap(a_dst, k, b_bytes));
        let (incoming, _) = self.acquire(a)?;
        let incoming = incoming.expect("a receiving op waits for its frame");
        let (next, rank, seq) = (self.links.next, self.call.rank, self.call.seq);
        let slot = if independent {
            self.links
                .tx
                .reserve()
                .map_err(|e| link_err(e, self.what, seq, next, rank, Some(&self.call.fp)))?
        } else {
            None
        };
        let Some(sl) = slot else {
            // SAFETY: forwarded from the caller.
            return unsafe { self.queue(a, Some(incoming), None) }.map(|()| 1);
        };
        let dev = |e| Error::Device {
            context: format!(
                "{} seq {seq}: queueing work on {}",
                self.what,
                self.stream.name()
            ),
            source: e,
        };
        let explicit =
            self.links.rx.scratch(incoming).is_some() || self.links.tx.scratch(sl).is_some();
        // SAFETY: `incoming` is a slot this rank holds and `sl` one reserved at the next rank,
        // both until the marker below completes; the user's ranges come from the caller's
        // contract and `check_sizes`. The written ranges — `a`'s place in the output, the
        // slot, `b`'s kept copy — are the caller's memory or the link's; `a`'s overlaps none of
        // `b`'s (checked above), and the slots are the links' own memory.
        unsafe {
            if explicit {
                // Explicit-copy staging keeps kernels off host slots: the two copies go on the
                // copy lanes, in and out at once, after everything queued before them.
                lanes_after_all(self.stream).map_err(dev)?;
                self.stream
                    .copy_on(CopyLane::In, a_dst, incoming, a_bytes)
                    .map_err(dev)?;
                self.stream
                    .copy_on(CopyLane::Out, sl, b_src, b_bytes)
                    .map_err(dev)?;
                if let Some(k) = keep {
                    self.stream.copy(k, b_src, b_bytes).map_err(dev)?;
                }
            } else {
                self.stream
                    .copy_pair(a_dst, incoming, a_bytes, sl, keep, b_src, b_bytes)
                    .map_err(dev)?
            }
        };
        let marker = self.stream.mark().map_err(dev)?;
        self.links.rx.consume();
        self.links.counters.bytes_received += a_bytes as u64;
        self.pending.push_back(Pending {
            marker,
            post: Some(FrameHeader::data(
                seq,
                b.step,
                b.slice,
                self.call.fp,
                b_bytes,
            )),
            release: true,
            tag: 0,
        });
        Ok(2)
    }

    /// Wait for `op`'s incoming frame and outgoing slot, retiring finished work meanwhile.
    fn acquire(&mut self, op: &Op) -> Result<(Option<DevPtr>, Option<DevPtr>)> {
        let (stream, call, what) = (self.stream, self.call, self.what);
        let (links, pending, waiter) = (&mut *self.links, &mut *self.pending, &mut *self.waiter);
        let es = call.dtype.size();
        let bytes = op.elems * es;
        let (in_seq, in_fp) = call.expected();
        let expect = Expect {
            seq: in_seq,
            step: op.step.wrapping_sub(1),
            slice: op.slice,
            fp: in_fp,
            len: bytes,
        };
        let (prev, next, seq, rank) = (links.prev, links.next, call.seq, call.rank);
        let rx_err = |e| link_err(e, what, in_seq, prev, rank, Some(&in_fp));
        let tx_err = |e| link_err(e, what, seq, next, rank, Some(&call.fp));

        // Wait for the incoming frame and an outgoing slot, retiring finished work meanwhile.
        let mut patience = Patience::new(Instant::now());
        let mut incoming: Option<DevPtr> = None;
        let mut slot: Option<DevPtr> = None;
        loop {
            let mut moved = retire(stream, links, (what, seq, rank, Some(&call.fp)), pending)?;
            moved |= links.tx.progress().map_err(tx_err)?;
            if op.recv && incoming.is_none() {
                incoming = links.rx.peek(&expect).map_err(rx_err)?;
                moved |= incoming.is_some();
            }
            let have_in = !op.recv || incoming.is_some();
            if op.send && have_in && slot.is_none() {
                slot = links.tx.reserve().map_err(tx_err)?;
                moved |= slot.is_some();
            }
            if have_in && (!op.send || slot.is_some()) {
                break;
            }
            let tick = patience.tick(Instant::now(), moved, call.timeout);
            if tick == Tick::Moved {
                waiter.progressed();
                continue;
            }
            if tick == Tick::TimedOut {
                return Err(op_timeout(
                    call,
                    what,
                    &expect,
                    have_in,
                    prev,
                    next,
                    "device slot",
                ));
            }
            if tick == Tick::Check {
                call.abort.check(call)?;
                let rx = links.rx.health();
                if !gone_unneeded(&rx, self.needs.rx) {
                    rx.map_err(rx_err)?;
                }
                // Frames queued but not yet posted, or not yet flushed, still need the next rank.
                let posting = pending.iter().any(|p| p.post.is_some()) || !links.tx.flushed();
                let tx = links.tx.health();
                if !gone_unneeded(&tx, self.needs.tx || posting) {
                    tx.map_err(tx_err)?;
                }
            }
            waiter.idle(call.timeout);
        }
        waiter.progressed();
        Ok((incoming, slot))
    }

    /// Queue `op`'s work, given its incoming frame and outgoing slot.
    ///
    /// # Safety
    /// As for [`run`]; `incoming` is the frame `op` receives (held), `slot` the slot it sends
    /// into (reserved).
    unsafe fn queue(
        &mut self,
        op: &Op,
        incoming: Option<DevPtr>,
        slot: Option<DevPtr>,
    ) -> Result<()> {
        let local = op.local.as_ref().map(|l| self.at(l));
        let store = op.store.as_ref().map(|l| self.at(l));
        let (stream, call, what) = (self.stream, self.call, self.what);
        let (links, pending) = (&mut *self.links, &mut *self.pending);
        let es = call.dtype.size();
        let bytes = op.elems * es;
        let seq = call.seq;
        // Explicit-copy staging: a kernel never touches a host slot. An incoming slot a kernel
        // combines from is first copied to device scratch; a combine whose result only goes to the
        // next rank writes device scratch, which is then copied into the slot. (Plain copies to or
        // from a slot are copies already.)
        let stage_in = match (incoming, local) {
            (Some(sl), Some(_)) => links.rx.scratch(sl),
            _ => None,
        };
        let stage_out = match (incoming, local, store, slot) {
            (Some(_), Some(_), None, Some(sl)) => links.tx.scratch(sl),
            _ => None,
        };
        let finalize = op.finalize && call.op == ReduceOp::Avg && call.n > 1;
        let dev = |e| Error::Device {
            context: format!("{what} seq {seq}: queueing work on {}", stream.name()),
            source: e,
        };
        // Explicit-copy staging's copies to and from host slots go on the copy lanes: in and
        // out at once, and a combine's in parts, so that part k + 1 comes in while part k − 1
        // goes out. Each such op starts after everything queued before it.
        let staged_in = incoming.is_some_and(|i| links.rx.scratch(i).is_some());
        let staged_out = slot.is_some_and(|sl| links.tx.scratch(sl).is_some());
        if staged_in || staged_out {
            lanes_after_all(stream).map_err(dev)?;
        }
        // SAFETY (all queued work below): the user's ranges come from the caller's contract and
        // `check_sizes`; `incoming` is a slot this rank holds until the work's marker completes;
        // `slot` is reserved at the next rank and published only after the marker completes; the
        // scratch of a slot is the link's own device memory, one slot's worth per slot, used only
        // by the work of the op holding that slot (the same rules keep it free). A
        // combine writes to `store` or `slot`, never to an operand it only reads, except in place
        // where `store == local` exactly (the kernel reads each element before writing it). The
        // one-pass forms write `store` and `slot`, which never overlap: one is the caller's buffer,
        // the other the link's memory.
        unsafe {
            match (incoming, local, stage_in) {
                (Some(b), Some(a), Some(scratch)) => {
                    let dst = store.or(stage_out).or(slot);
                    let out = store.or(stage_out).zip(slot);
                    for (at, n) in staged_parts(op.elems, es, links.tx.slot_bytes()) {
                        let (off, len) = ((at * es) as DevPtr, n * es);
                        let scr = scratch + off;
                        stream
                            .copy_on(CopyLane::In, scr, b + off, len)
                            .map_err(dev)?;
                        stream.compute_after_lane(CopyLane::In).map_err(dev)?;
                        if let Some(dst) = dst {
                            stream
                                .combine(call.dtype, call.op, dst + off, a + off, scr, n)
                                .map_err(dev)?;
                            if finalize {
                                stream
                                    .divide(call.dtype, dst + off, n, call.n)
                                    .map_err(dev)?;
                            }
                        }
                        if let Some((st, sl)) = out {
                            stream.lane_after_compute(CopyLane::Out).map_err(dev)?;
                            stream
                                .copy_on(CopyLane::Out, sl + off, st + off, len)
                                .map_err(dev)?;
                        }
                    }
                    links.counters.bytes_staged += bytes as u64;
                    if stage_out.is_some() && out.is_some() {
                        links.counters.bytes_staged += bytes as u64;
                    }
                }
                (Some(b), Some(a), None) => {
                    let dst = store.or(stage_out).or(slot);
                    // Kept and sent: one pass writes both, unless an average must be divided
                    // first or explicit-copy staging keeps kernels off the host slot.
                    let both = match (store, slot) {
                        (Some(st), Some(sl)) if !finalize && links.tx.scratch(sl).is_none() => {
                            Some((st, sl))
                        }
                        _ => None,
                    };
                    if let Some((st, sl)) = both {
                        stream
                            .combine2(call.dtype, call.op, st, sl, a, b, op.elems)
                            .map_err(dev)?;
                    } else if let Some(dst) = dst {
                        stream
                            .combine(call.dtype, call.op, dst, a, b, op.elems)
                            .map_err(dev)?;
                        if finalize {
                            stream
                                .divide(call.dtype, dst, op.elems, call.n)
                                .map_err(dev)?;
                        }
                        if let (Some(st), Some(sl)) = (store.or(stage_out), slot) {
                            if staged_out {
                                stream.lane_after_compute(CopyLane::Out).map_err(dev)?;
                                stream.copy_on(CopyLane::Out, sl, st, bytes).map_err(dev)?;
                            } else {
                                stream.copy(sl, st, bytes).map_err(dev)?;
                            }
                            if stage_out.is_some() {
                                links.counters.bytes_staged += bytes as u64;
                            }
                        }
                    }
                }
                (Some(v), None, _) | (None, Some(v), _) => {
                    // Kept and forwarded: one pass reads `v` once, unless explicit-copy staging
                    // keeps kernels off a host slot at either end.
                    let kernels_may = slot.is_some_and(|sl| links.tx.scratch(sl).is_none())
                        && incoming.is_none_or(|i| links.rx.scratch(i).is_none());
                    let keep = store.filter(|&st| st != v);
                    match (keep, slot) {
                        (Some(st), Some(sl)) if kernels_may => {
                            stream.copy2(st, sl, v, bytes).map_err(dev)?;
                        }
                        _ if staged_in || staged_out => {
                            // Both copies read `v` only: the one in (from a host slot) and the
                            // one out (to the next slot) run at once.
                            if let Some(st) = keep {
                                if incoming.is_some() {
                                    stream.copy_on(CopyLane::In, st, v, bytes)
                                } else {
                                    stream.copy(st, v, bytes)
                                }
                                .map_err(dev)?;
                            }
                            if let Some(sl) = slot {
                                stream.copy_on(CopyLane::Out, sl, v, bytes).map_err(dev)?;
                            }
                        }
                        _ => {
                            if let Some(st) = keep {
                                stream.copy(st, v, bytes).map_err(dev)?;
                            }
                            if let Some(sl) = slot {
                                stream.copy(sl, v, bytes).map_err(dev)?;
                            }
                        }
                    }
                }
                (None, None, _) => {}
            }
        }
        let marker = stream.mark().map_err(dev)?;
        if op.recv {
            links.rx.consume();
            links.counters.bytes_received += bytes as u64;
        }
        pending.push_back(Pending {
            marker,
            post: op
                .send
                .then(|| FrameHeader::data(seq, op.step, op.slice, call.fp, bytes)),
            release: op.recv,
            tag: 0,
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{staged_parts, STAGED_PARTS};

    #[test]
    fn staged_parts_cover_an_op_once_in_aligned_parts() {
        for (elems, es, slot) in [
            (0usize, 4usize, 1024usize),
            (1, 4, 1024),
            (255, 4, 1024),
            (256, 4, 1024),
            (1000, 2, 1024),
            (1024, 4, 4096),
            (4_194_304, 4, 16 << 20),
            (4_194_300, 8, 16 << 20),
            (12_345, 1, 1 << 20),
        ] {
            let parts: Vec<_> = staged_parts(elems, es, slot).collect();
            let mut next = 0;
            for &(at, n) in &parts {
                assert_eq!(at, next, "{elems} {es} {slot}: {parts:?}");
                assert_eq!(at % 64, 0, "{elems} {es} {slot}: {parts:?}");
                assert!(n > 0, "{elems} {es} {slot}: {parts:?}");
                next = at + n;
            }
            assert_eq!(next, elems, "{elems} {es} {slot}: {parts:?}");
            assert!(parts.len() <= STAGED_PARTS);
            // A whole slot's op is cut in full; one under a part's worth stays whole.
            if elems * es >= slot && elems >= 64 * STAGED_PARTS {
                assert_eq!(parts.len(), STAGED_PARTS, "{elems} {es} {slot}: {parts:?}");
            }
            if elems * es < slot / STAGED_PARTS {
                assert!(parts.len() <= 1, "{elems} {es} {slot}: {parts:?}");
            }
        }
    }
}
