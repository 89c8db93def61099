//! One device call's work on its links ([`Work`]): wait for an op's frame and slot, queue its
//! copies and kernels on the stream (explicit-copy staging in parts on the copy lanes), and
//! retire what completed — publish its frames, release its slots — in order.

use std::collections::VecDeque;

use ringzero_kernels::ReduceOp;

use super::call::{gone_unneeded, link_err, Call, Needs};
use super::engine::base;
use super::schedule::{Loc, Op};
use crate::error::{Error, Result};
use crate::transport::device::DevPtr;
use crate::transport::wait::Waiter;
use crate::wire::{Expect, Fingerprint, FrameHeader};
use ringzero_kernels::device::DeviceError;
use ringzero_kernels::device::{CopyLane, Stream};

use super::engine::DevBufs;
use super::links::DevLinks;
use super::op_wait::{self, OpWait};

pub(super) struct Pending<M> {
    pub(super) marker: M,
    pub(super) post: Option<FrameHeader>,
    pub(super) release: bool,
    /// Which posted point-to-point message queued it ([`step_one_way`]); unused in a collective.
    pub(super) tag: u64,
}

/// What a link error is reported as: the call's name, its sequence number, this rank and its
/// fingerprint.
pub(super) type ErrAt<'a> = (&'a str, u64, usize, Option<&'a Fingerprint>);

/// Publish frames and release slots whose work has completed, in order. Whether any did.
pub(super) fn retire<S: Stream>(
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

/// Whether ops `a` and `b` (adjacent in the plan) are a slice's last receive — a frame copied
/// into the output, nothing sent — and the next slice's first send — a local chunk into the next
/// rank's slot, nothing received. Their copies are unrelated, so they can be queued as one piece
/// of work ([`Stream::copy_pair`]): on a link staged in host memory the first is host→device and
/// the second device→host, and one after the other each would leave the other direction idle
/// (all-reduce and in-place all-gather on 2 ranks are mostly such steps).
pub(super) fn pairs(a: &Op, b: &Op) -> bool {
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
pub(super) const STAGED_PARTS: usize = 8;

/// `(first element, elements)` of each part of an `elems`-element combine of `es`-byte elements
/// (explicit-copy staging) on a link of `slot_bytes` slots: at most [`STAGED_PARTS`], each at
/// least a [`STAGED_PARTS`]th of a slot (a short op, the tail of a message, stays whole) but the
/// last, starting at multiples of 64 elements so that the kernels' 16-byte vectors stay aligned.
pub(super) fn staged_parts(
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
pub(super) fn lanes_after_all<S: Stream>(stream: &S) -> std::result::Result<(), DeviceError> {
    for lane in CopyLane::BOTH {
        stream.compute_after_lane(lane)?;
    }
    for lane in CopyLane::BOTH {
        stream.lane_after_compute(lane)?;
    }
    Ok(())
}

/// One call's engine state, borrowed for one op (or pair of ops).
pub(super) struct Work<'a, S: Stream> {
    pub(super) stream: &'a S,
    pub(super) links: &'a mut DevLinks,
    pub(super) call: &'a Call<'a>,
    pub(super) bufs: &'a DevBufs,
    pub(super) what: &'a str,
    pub(super) pending: &'a mut VecDeque<Pending<S::Marker>>,
    pub(super) waiter: &'a mut Waiter,
    /// What this op (or pair) and the ops after it still move: a peer gone from a direction
    /// with nothing left on it fails no wait (see `engine::health_of`).
    pub(super) needs: Needs,
}

impl<S: Stream> Work<'_, S> {
    /// Refuse a slice larger than the next rank's slots.
    pub(super) fn check_slot(&self, op: &Op) -> Result<()> {
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
    pub(super) fn at(&self, loc: &Loc) -> DevPtr {
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
    pub(super) unsafe fn run_op(&mut self, op: &Op) -> Result<()> {
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
    pub(super) unsafe fn run_pair(&mut self, a: &Op, b: &Op) -> Result<usize> {
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
    pub(super) fn acquire(&mut self, op: &Op) -> Result<(Option<DevPtr>, Option<DevPtr>)> {
        let call = self.call;
        let expect = super::call::expect(call, op, call.dtype.size());
        let (what, prev, next) = (self.what, self.links.prev, self.links.next);
        let mut wait = DevWait {
            work: self,
            incoming: None,
            slot: None,
        };
        op_wait::frame_and_slot(
            &mut wait,
            call,
            op,
            &expect,
            (what, prev, next, "device slot"),
        )?;
        Ok((wait.incoming, wait.slot))
    }

    /// Queue `op`'s work, given its incoming frame and outgoing slot.
    ///
    /// # Safety
    /// As for [`run`]; `incoming` is the frame `op` receives (held), `slot` the slot it sends
    /// into (reserved).
    pub(super) unsafe fn queue(
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
        let e = Ends {
            incoming,
            store,
            slot,
            stage_out,
            staged_in,
            staged_out,
            finalize,
        };
        let links = &mut *links;
        // SAFETY: as above.
        unsafe {
            match (incoming, local, stage_in) {
                (Some(b), Some(a), Some(scratch)) => {
                    combine_staged(stream, links, call, op, &e, (b, a, scratch)).map_err(dev)?
                }
                (Some(b), Some(a), None) => {
                    combine(stream, links, call, op, &e, (b, a)).map_err(dev)?
                }
                (Some(v), None, _) | (None, Some(v), _) => {
                    forward(stream, links, &e, v, bytes).map_err(dev)?
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

/// The device engine's links as one op waits on them ([`op_wait::frame_and_slot`]): finished
/// work is retired meanwhile, and the frame's and the slot's device addresses are kept.
struct DevWait<'a, 'w, S: Stream> {
    work: &'a mut Work<'w, S>,
    incoming: Option<DevPtr>,
    slot: Option<DevPtr>,
}

impl<S: Stream> OpWait for DevWait<'_, '_, S> {
    fn progress(&mut self) -> Result<bool> {
        let w = &mut *self.work;
        let (call, what) = (w.call, w.what);
        let at = (what, call.seq, call.rank, Some(&call.fp));
        let retired = retire(w.stream, w.links, at, w.pending)?;
        let (next, rank) = (w.links.next, call.rank);
        let sent = w
            .links
            .tx
            .progress()
            .map_err(|e| link_err(e, what, call.seq, next, rank, Some(&call.fp)))?;
        Ok(retired || sent)
    }

    fn frame(&mut self, expect: &Expect) -> Result<(bool, bool)> {
        if self.incoming.is_some() {
            return Ok((true, false));
        }
        let w = &mut *self.work;
        let (prev, rank) = (w.links.prev, w.call.rank);
        self.incoming = w
            .links
            .rx
            .peek(expect)
            .map_err(|e| link_err(e, w.what, expect.seq, prev, rank, Some(&expect.fp)))?;
        Ok((self.incoming.is_some(), self.incoming.is_some()))
    }

    fn slot(&mut self, _bytes: usize) -> Result<(bool, bool)> {
        if self.slot.is_some() {
            return Ok((true, false));
        }
        let w = &mut *self.work;
        let (next, call) = (w.links.next, w.call);
        self.slot = w
            .links
            .tx
            .reserve()
            .map_err(|e| link_err(e, w.what, call.seq, next, call.rank, Some(&call.fp)))?;
        Ok((self.slot.is_some(), self.slot.is_some()))
    }

    fn health(&mut self) -> Result<()> {
        let w = &mut *self.work;
        let call = w.call;
        call.abort.check(call)?;
        let (in_seq, in_fp) = call.expected();
        let (prev, next, rank) = (w.links.prev, w.links.next, call.rank);
        let rx = w.links.rx.health();
        if !gone_unneeded(&rx, w.needs.rx) {
            rx.map_err(|e| link_err(e, w.what, in_seq, prev, rank, Some(&in_fp)))?;
        }
        // Frames queued but not yet posted, or not yet flushed, still need the next rank.
        let posting = w.pending.iter().any(|p| p.post.is_some()) || !w.links.tx.flushed();
        let tx = w.links.tx.health();
        if !gone_unneeded(&tx, w.needs.tx || posting) {
            tx.map_err(|e| link_err(e, w.what, call.seq, next, rank, Some(&call.fp)))?;
        }
        Ok(())
    }

    fn progressed(&mut self) {
        self.work.waiter.progressed();
    }

    fn idle(&mut self, timeout: std::time::Duration) {
        self.work.waiter.idle(timeout);
    }
}

/// Where one op's work reads and writes, as [`Work::queue`] decided it: the incoming slot, the
/// caller's output, the next rank's slot, the device scratch a staged result goes through, and
/// whether explicit-copy staging moves either end on the copy lanes.
pub(super) struct Ends {
    incoming: Option<DevPtr>,
    store: Option<DevPtr>,
    slot: Option<DevPtr>,
    stage_out: Option<DevPtr>,
    staged_in: bool,
    staged_out: bool,
    finalize: bool,
}

type DevResult = std::result::Result<(), DeviceError>;

/// A combine of the incoming slot `b` (a host slot, copied to `scratch` first) with `a`, in
/// parts on the copy lanes: part k + 1 comes in while part k is combined and part k − 1 goes out.
///
/// # Safety
/// As for [`Work::queue`]'s work.
unsafe fn combine_staged<S: Stream>(
    stream: &S,
    links: &mut DevLinks,
    call: &Call,
    op: &Op,
    e: &Ends,
    (b, a, scratch): (DevPtr, DevPtr, DevPtr),
) -> DevResult {
    let (store, slot, stage_out, finalize) = (e.store, e.slot, e.stage_out, e.finalize);
    let es = call.dtype.size();
    let bytes = op.elems * es;
    let dst = store.or(stage_out).or(slot);
    let out = store.or(stage_out).zip(slot);
    for (at, n) in staged_parts(op.elems, es, links.tx.slot_bytes()) {
        let (off, len) = ((at * es) as DevPtr, n * es);
        let scr = scratch + off;
        stream.copy_on(CopyLane::In, scr, b + off, len)?;
        stream.compute_after_lane(CopyLane::In)?;
        if let Some(dst) = dst {
            stream.combine(call.dtype, call.op, dst + off, a + off, scr, n)?;
            if finalize {
                stream.divide(call.dtype, dst + off, n, call.n)?;
            }
        }
        if let Some((st, sl)) = out {
            stream.lane_after_compute(CopyLane::Out)?;
            stream.copy_on(CopyLane::Out, sl + off, st + off, len)?;
        }
    }
    links.counters.bytes_staged += bytes as u64;
    if stage_out.is_some() && out.is_some() {
        links.counters.bytes_staged += bytes as u64;
    }
    Ok(())
}

/// A combine of the incoming slot `b` with `a`, read by kernels where they are: kept and sent in
/// one pass where it can.
///
/// # Safety
/// As for [`Work::queue`]'s work.
unsafe fn combine<S: Stream>(
    stream: &S,
    links: &mut DevLinks,
    call: &Call,
    op: &Op,
    e: &Ends,
    (b, a): (DevPtr, DevPtr),
) -> DevResult {
    let (store, slot, stage_out, staged_out, finalize) =
        (e.store, e.slot, e.stage_out, e.staged_out, e.finalize);
    let bytes = op.elems * call.dtype.size();
    let dst = store.or(stage_out).or(slot);
    // Kept and sent: one pass writes both, unless an average must be divided
    // first or explicit-copy staging keeps kernels off the host slot.
    let both = match (store, slot) {
        (Some(st), Some(sl)) if !finalize && links.tx.scratch(sl).is_none() => Some((st, sl)),
        _ => None,
    };
    if let Some((st, sl)) = both {
        stream.combine2(call.dtype, call.op, st, sl, a, b, op.elems)?;
    } else if let Some(dst) = dst {
        stream.combine(call.dtype, call.op, dst, a, b, op.elems)?;
        if finalize {
            stream.divide(call.dtype, dst, op.elems, call.n)?;
        }
        if let (Some(st), Some(sl)) = (store.or(stage_out), slot) {
            if staged_out {
                stream.lane_after_compute(CopyLane::Out)?;
                stream.copy_on(CopyLane::Out, sl, st, bytes)?;
            } else {
                stream.copy(sl, st, bytes)?;
            }
            if stage_out.is_some() {
                links.counters.bytes_staged += bytes as u64;
            }
        }
    }
    Ok(())
}

/// A plain copy of `v` (the incoming slot or the caller's input): kept, forwarded, or both.
///
/// # Safety
/// As for [`Work::queue`]'s work.
unsafe fn forward<S: Stream>(
    stream: &S,
    links: &mut DevLinks,
    e: &Ends,
    v: DevPtr,
    bytes: usize,
) -> DevResult {
    let (incoming, store, slot, staged_in, staged_out) =
        (e.incoming, e.store, e.slot, e.staged_in, e.staged_out);
    // Kept and forwarded: one pass reads `v` once, unless explicit-copy staging
    // keeps kernels off a host slot at either end.
    let kernels_may = slot.is_some_and(|sl| links.tx.scratch(sl).is_none())
        && incoming.is_none_or(|i| links.rx.scratch(i).is_none());
    let keep = store.filter(|&st| st != v);
    match (keep, slot) {
        (Some(st), Some(sl)) if kernels_may => {
            stream.copy2(st, sl, v, bytes)?;
        }
        _ if staged_in || staged_out => {
            // Both copies read `v` only: the one in (from a host slot) and the
            // one out (to the next slot) run at once.
            if let Some(st) = keep {
                if incoming.is_some() {
                    stream.copy_on(CopyLane::In, st, v, bytes)
                } else {
                    stream.copy(st, v, bytes)
                }?;
            }
            if let Some(sl) = slot {
                stream.copy_on(CopyLane::Out, sl, v, bytes)?;
            }
        }
        _ => {
            if let Some(st) = keep {
                stream.copy(st, v, bytes)?;
            }
            if let Some(sl) = slot {
                stream.copy(sl, v, bytes)?;
            }
        }
    }
    Ok(())
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
