//! The engine: drives one rank's [`Plan`] over its two links.
//!
//! Words as in [`super::schedule`]: the engine runs the plan's ops strictly in order. For each op it
//! waits until the incoming frame has arrived (if the op receives) and a slot at the next rank is
//! free (if it sends), then does the op's arithmetic straight between the user's buffers, the
//! incoming slot and the outgoing slot — a reduce writes into the peer's slot directly, so a
//! forwarded slice is copied once — posts the outgoing frame and releases the incoming slot.
//! Consecutive slices pipeline across the ring: while this rank reduces slice `j`, its neighbour
//! is already forwarding slice `j − 1`.
//!
//! Every wait has a deadline: if nothing moves for `timeout`, the op fails with an error that names
//! the collective, its sequence number, the peer and what was awaited. Peer health (abort flags,
//! dead processes, socket errors) is checked while idle.

use std::ops::Range;
use std::time::Duration;

use ringzero_kernels::{cpu, ReduceOp};

use super::call::{expect, gone_unneeded, link_err, Call, Needs};
use super::exec::{self, Executor};
pub use super::links::{Counters, Links};
use super::op_wait::{self, OpWait};
use super::schedule::{Buf, Loc, Op, Plan};
use crate::error::{Error, Result};
use crate::transport::device::DevPtr;
use crate::transport::{LinkError, SendLink};
use crate::wire::{Expect, Fingerprint, FrameHeader};

pub(crate) use crate::deadline::{Patience, Tick};

/// The user's device buffers: addresses and lengths in bytes.
#[derive(Clone, Copy, Debug)]
pub enum DevBufs {
    /// Out of place.
    Split {
        /// Send buffer.
        input: DevPtr,
        /// Its bytes.
        input_bytes: usize,
        /// Receive buffer.
        output: DevPtr,
        /// Its bytes.
        output_bytes: usize,
    },
    /// In place.
    One {
        /// The buffer.
        buf: DevPtr,
        /// Its bytes.
        bytes: usize,
    },
}

/// The user's buffers, as bytes.
pub enum Bufs<'a> {
    /// Out of place.
    Split {
        /// Send buffer.
        input: &'a [u8],
        /// Receive buffer.
        output: &'a mut [u8],
    },
    /// In place: one buffer.
    One(&'a mut [u8]),
}

impl Bufs<'_> {
    /// Bytes of the buffer the results go to.
    pub fn output_bytes(&self) -> usize {
        match self {
            Bufs::Split { output, .. } => output.len(),
            Bufs::One(b) => b.len(),
        }
    }
}

/// Run one call to completion (including flushing what it sent).
pub fn run(links: &mut Links, call: &Call, bufs: Bufs) -> Result<()> {
    check_sizes(call, &bufs)?;
    let what = what_of(&call.fp);
    let es = call.dtype.size();
    let mut ex = HostExec {
        links,
        call,
        bufs,
        what: &what,
        es,
    };
    let ran = exec::run_ops(call, &mut ex);
    if call.stream_stores {
        // The caller (or another thread it hands the buffer to) must see every streamed store.
        cpu::stream_fence();
    }
    ran
}

/// `fp`'s text, which errors name the call by: formatted once per fingerprint and thread (a
/// loop of like calls does not format, and allocate, its name every time).
fn what_of(fp: &Fingerprint) -> std::rc::Rc<str> {
    thread_local! {
        static LAST: std::cell::RefCell<Option<(Fingerprint, std::rc::Rc<str>)>> =
            const { std::cell::RefCell::new(None) };
    }
    LAST.with_borrow_mut(|last| match last {
        Some((f, text)) if f == fp => text.clone(),
        _ => {
            let text: std::rc::Rc<str> = fp.to_string().into();
            *last = Some((*fp, text.clone()));
            text
        }
    })
}

/// The host's [`Executor`]: each op applied at once, between the user's buffers and the slots.
struct HostExec<'a, 'b> {
    links: &'a mut Links,
    call: &'a Call<'a>,
    bufs: Bufs<'b>,
    what: &'a str,
    es: usize,
}

impl Executor for HostExec<'_, '_> {
    fn op(&mut self, i: usize, needs: Needs) -> Result<usize> {
        let op = &self.call.plan.ops[i];
        run_op(
            self.links,
            self.call,
            (op, needs),
            &mut self.bufs,
            self.what,
            self.es,
        )?;
        Ok(1)
    }

    fn finish(&mut self) -> Result<()> {
        let c = self.call;
        self.links.flush(self.what, c.seq, c.timeout, c.abort)
    }
}

/// Run a call that needs no link (a one-rank world): only local copies.
pub fn run_local(call: &Call, mut bufs: Bufs) -> Result<()> {
    check_sizes(call, &bufs)?;
    let es = call.dtype.size();
    for op in &call.plan.ops {
        debug_assert!(!op.send && !op.recv, "a one-rank plan has no frames");
        let at = |loc: &Loc| {
            (loc.range.start - base(call.plan, loc.buf)) * es
                ..(loc.range.end - base(call.plan, loc.buf)) * es
        };
        if let (Bufs::Split { input, output }, Some(l), Some(s)) = (&mut bufs, &op.local, &op.store)
        {
            output[at(s)].copy_from_slice(&input[at(l)]);
        }
    }
    Ok(())
}

pub(crate) fn base(plan: &Plan, buf: Buf) -> usize {
    match buf {
        Buf::Input => plan.input_base,
        Buf::Output => plan.output_base,
    }
}

/// Refuse buffers smaller than the plan needs (before anything is sent).
pub fn check_sizes(call: &Call, bufs: &Bufs) -> Result<()> {
    let es = call.dtype.size();
    let p = call.plan;
    let bad = |msg: String| {
        Err(Error::InvalidArgument {
            op: call.fp.to_string(),
            msg,
        })
    };
    match bufs {
        Bufs::Split { input, output } => {
            if input.len() < p.input_len * es || output.len() < p.output_len * es {
                return bad(format!(
                    "buffers of {} and {} bytes, the plan needs {} and {}",
                    input.len(),
                    output.len(),
                    p.input_len * es,
                    p.output_len * es
                ));
            }
        }
        Bufs::One(b) => {
            if b.len() < p.output_len.max(p.input_len) * es {
                return bad(format!(
                    "buffer of {} bytes, the plan needs {}",
                    b.len(),
                    p.output_len * es
                ));
            }
        }
    }
    Ok(())
}

/// The abort flag and the peers' health, for `call` on `links`. A peer that is gone from a
/// direction `needs` has no more frames on is no failure of this wait: a rank whose part of the
/// call is done may drop its communicator, or exit, while its neighbour still sends to the
/// other side (a lane's receives from the previous rank end before its sends to the next one).
/// Frames a link has not flushed yet still need their peer. An abort is a failure either way.
pub(super) fn health_of(links: &mut Links, call: &Call, what: &str, needs: Needs) -> Result<()> {
    call.abort.check(call)?;
    let (in_seq, in_fp) = call.expected();
    let (prev, next) = (links.prev, links.next);
    let rx = links.rx.health();
    if !gone_unneeded(&rx, needs.rx) {
        rx.map_err(|e| link_err(e, what, in_seq, prev, call.rank, Some(&in_fp)))?;
    }
    let tx = links.tx.health();
    if gone_unneeded(&tx, needs.tx || !links.tx.flushed()) {
        return Ok(());
    }
    tx.map_err(|e| link_err(e, what, call.seq, next, call.rank, Some(&call.fp)))
}

/// The host engine's links as one op waits on them ([`op_wait::frame_and_slot`]).
struct HostWait<'a> {
    links: &'a mut Links,
    call: &'a Call<'a>,
    what: &'a str,
    needs: Needs,
    /// Where the frame's payload goes when the link reads it straight there
    /// ([`crate::transport::RecvLink::recv_into`]); `None`: it is peeked in its slot.
    into: Option<&'a mut [u8]>,
    /// The frame was there at an earlier look.
    seen: bool,
    /// The slot was reserved at an earlier look.
    held: bool,
}

impl OpWait for HostWait<'_> {
    fn progress(&mut self) -> Result<bool> {
        let (l, c) = (&mut *self.links, self.call);
        l.tx.progress()
            .map_err(|e| link_err(e, self.what, c.seq, l.next, c.rank, Some(&c.fp)))
    }

    fn frame(&mut self, expect: &Expect) -> Result<(bool, bool)> {
        let (l, c) = (&mut *self.links, self.call);
        let err = |e| link_err(e, self.what, expect.seq, l.prev, c.rank, Some(&expect.fp));
        let there = match self.into.as_deref_mut() {
            // Received into the buffer already: the frame is done with at the link.
            Some(_) if self.seen => true,
            Some(dst) => l.rx.recv_into(expect, dst).map_err(err)?,
            None => l.rx.peek(expect).map_err(err)?.is_some(),
        };
        let new = there && !self.seen;
        self.seen |= there;
        Ok((there, new))
    }

    fn slot(&mut self, bytes: usize) -> Result<(bool, bool)> {
        let (l, c) = (&mut *self.links, self.call);
        let held =
            l.tx.reserve(bytes)
                .map_err(|e| link_err(e, self.what, c.seq, l.next, c.rank, Some(&c.fp)))?
                .is_some();
        let new = held && !self.held;
        self.held |= held;
        Ok((held, new))
    }

    fn health(&mut self) -> Result<()> {
        health_of(self.links, self.call, self.what, self.needs)
    }

    fn progressed(&mut self) {
        self.links.side.waiter.progressed();
    }

    fn idle(&mut self, timeout: Duration) {
        self.links.side.waiter.idle(timeout);
    }
}

/// Run `op` of `call` once its frame and slot are there; while it waits, a peer gone from a
/// direction it no longer `needs` is no failure (see [`health_of`]).
pub(super) fn run_op(
    links: &mut Links,
    call: &Call,
    (op, needs): (&Op, Needs),
    bufs: &mut Bufs,
    what: &str,
    es: usize,
) -> Result<()> {
    let bytes = op.elems * es;
    let expect = expect(call, op, es);
    let (in_seq, in_fp) = (expect.seq, expect.fp);
    let (prev, next, seq, rank) = (links.prev, links.next, call.seq, call.rank);
    let rx_err = |e| link_err(e, what, in_seq, prev, rank, Some(&in_fp));
    let tx_err = |e| link_err(e, what, seq, next, rank, Some(&call.fp));

    let plan = call.plan;
    let at = |loc: &Loc| -> Range<usize> {
        let b = base(plan, loc.buf);
        (loc.range.start - b) * es..(loc.range.end - b) * es
    };
    // A frame only stored (an all-gather's or a broadcast's part, nothing reduced with it) is
    // read off a tcp wire straight into the output: no copy out of a slot.
    let into = match (&op.store, &op.local) {
        (Some(s), None) if op.recv && links.rx.receives_into() => Some(at(s)),
        _ => None,
    };
    // Wait until both the incoming frame and an outgoing slot are there.
    let mut wait = HostWait {
        links: &mut *links,
        call,
        what,
        needs,
        into: into.clone().map(|r| match bufs {
            Bufs::Split { output, .. } => &mut output[r],
            Bufs::One(buf) => &mut buf[r],
        }),
        seen: false,
        held: false,
    };
    op_wait::frame_and_slot(&mut wait, call, op, &expect, (what, prev, next, "slot"))?;
    if let Some(r) = into {
        // The frame is in the output; forwarded (a middle rank's all-gather), it goes on from
        // there.
        if op.send {
            let stored = match bufs {
                Bufs::Split { output, .. } => &output[r],
                Bufs::One(buf) => &buf[r],
            };
            send(&mut *links.tx, &mut links.counters, call, op, Some(stored)).map_err(tx_err)?;
        }
        links.counters.bytes_received += bytes as u64;
        return Ok(());
    }

    let incoming: Option<&[u8]> = if op.recv {
        links.rx.peek(&expect).map_err(rx_err)?
    } else {
        None
    };
    // What a tcp wire sends it takes straight from where the value already is (the input, the
    // incoming frame, or the output it was stored to) rather than from a slot filled for it: a
    // value only copied, or one this rank stores too. A reduce that only goes on (a
    // reduce-scatter's middle steps) is still written into the slot.
    let from_user =
        op.send && (op.store.is_some() || op.recv != op.local.is_some()) && links.tx.sends_from();
    let slot: Option<&mut [u8]> = if op.send && !from_user {
        links.tx.reserve(bytes).map_err(tx_err)?
    } else {
        None
    };
    let finalize = op.finalize && call.op == ReduceOp::Avg && call.n > 1;
    // A value only copied, not reduced, that goes both to the next rank and into the output
    // (an all-gather's own chunk out of place, a chunk received and forwarded) goes into the
    // frame first: the frame leaves while this rank copies it into the output (`later`).
    let mut later: Option<(&mut [u8], &[u8])> = None;
    // The value to send where the wire takes it from the caller's memory (`from_user`).
    let mut out: Option<&[u8]> = None;
    match bufs {
        Bufs::Split { input, output } => {
            let local = op.local.as_ref().map(|l| &input[at(l)]);
            let store = op.store.as_ref().map(|l| &mut output[at(l)]);
            match (incoming, local, store, slot) {
                (Some(v), None, Some(st), sl) | (None, Some(v), Some(st), sl) if op.send => {
                    match sl {
                        Some(sl) => sl.copy_from_slice(v),
                        None => out = Some(v),
                    }
                    later = Some((st, v));
                }
                (Some(v), None, None, None) | (None, Some(v), None, None) if from_user => {
                    out = Some(v);
                }
                (incoming, local, mut store, slot) => {
                    apply(call, incoming, local, store.as_deref_mut(), slot, finalize)?;
                    if from_user {
                        out = store.map(|st| &*st);
                    }
                }
            }
        }
        Bufs::One(buf) => match (&op.local, &op.store) {
            (Some(l), Some(s)) => {
                // In place, an op that reads and stores does so on the same region.
                debug_assert_eq!(l.range, s.range);
                let dst = &mut buf[at(s)];
                if let Some(inb) = incoming {
                    cpu::reduce_into(call.dtype, call.op.pairwise(), dst, inb)?;
                    if finalize {
                        cpu::divide(call.dtype, dst, call.n)?;
                    }
                }
                if let Some(slot) = slot {
                    slot.copy_from_slice(dst);
                }
                if from_user {
                    out = Some(&buf[at(s)]);
                }
            }
            (local, None) => {
                let local = local.as_ref().map(|l| &buf[at(l)]);
                match (incoming, local) {
                    (Some(v), None) | (None, Some(v)) if from_user => out = Some(v),
                    (incoming, local) => apply(call, incoming, local, None, slot, finalize)?,
                }
            }
            (None, Some(s)) => match (incoming, slot) {
                (Some(v), sl) if op.send => {
                    match sl {
                        Some(sl) => sl.copy_from_slice(v),
                        None => out = Some(v),
                    }
                    later = Some((&mut buf[at(s)], v));
                }
                (incoming, slot) => {
                    let store = Some(&mut buf[at(s)]);
                    apply(call, incoming, None, store, slot, finalize)?;
                    if from_user {
                        out = Some(&buf[at(s)]);
                    }
                }
            },
        },
    }

    if op.send {
        if from_user && out.is_none() {
            let e = LinkError::Protocol("an op to send from the buffers has no value".into());
            return Err(tx_err(e));
        }
        send(&mut *links.tx, &mut links.counters, call, op, out).map_err(tx_err)?;
    }
    if let Some((st, v)) = later {
        if call.stream_stores {
            cpu::copy_streaming(st, v)?;
        } else {
            st.copy_from_slice(v);
        }
    }
    if op.recv {
        links.rx.release().map_err(rx_err)?;
        links.counters.bytes_received += bytes as u64;
    }
    Ok(())
}

/// Post `op`'s frame: from `from` where the wire takes it from there
/// ([`crate::transport::SendLink::post_from`]), else from the slot the op filled.
fn send(
    tx: &mut dyn SendLink,
    counters: &mut Counters,
    call: &Call,
    op: &Op,
    from: Option<&[u8]>,
) -> std::result::Result<(), LinkError> {
    let bytes = op.elems * call.dtype.size();
    let h = FrameHeader::data(call.seq, op.step, op.slice, call.fp, bytes);
    match from {
        Some(v) => tx.post_from(&h, v)?,
        None => tx.post(&h)?,
    }
    counters.bytes_sent += bytes as u64;
    counters.frames_sent += 1;
    tx.progress()?;
    Ok(())
}

/// `value = incoming ⊕ local` (or whichever exists), finalized, written to `store` and `slot`. A
/// copied value goes to `store` with streaming stores when the call says so; a reduced one with
/// plain stores (combining through an L1 tile to stream it measured slower: `benches/reduce.rs`).
fn apply(
    call: &Call,
    incoming: Option<&[u8]>,
    local: Option<&[u8]>,
    store: Option<&mut [u8]>,
    slot: Option<&mut [u8]>,
    finalize: bool,
) -> Result<()> {
    match (incoming, local) {
        (Some(a), Some(b)) => {
            let (dst, copy_to) = match (store, slot) {
                (Some(st), sl) => (st, sl),
                (None, Some(sl)) => (sl, None),
                (None, None) => return Ok(()),
            };
            cpu::reduce_to(call.dtype, call.op.pairwise(), dst, b, a)?;
            if finalize {
                cpu::divide(call.dtype, dst, call.n)?;
            }
            if let Some(c) = copy_to {
                c.copy_from_slice(dst);
            }
        }
        (Some(v), None) | (None, Some(v)) => {
            match store {
                Some(st) if call.stream_stores => cpu::copy_streaming(st, v)?,
                Some(st) => st.copy_from_slice(v),
                None => {}
            }
            if let Some(sl) = slot {
                sl.copy_from_slice(v);
            }
        }
        (None, None) => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::failure::AbortFlag;
    use crate::ring::lanes::{run_lanes, Lane};
    use crate::ring::schedule::plan_p2p;
    use crate::ring::Collective;
    use crate::transport::shm::{ShmRecv, ShmSend};
    use crate::transport::{RecvLink, SendLink};
    use crate::wire::Fingerprint;
    use ringzero_kernels::DType;

    const SLOTS: usize = 2;
    const SLOT_BYTES: usize = 4096;

    /// A FIFO from rank `from` to rank `to` in this process: its two ends.
    fn fifo(from: usize, to: usize) -> (Box<dyn SendLink>, Box<dyn RecvLink>) {
        let name = format!(
            "ringzero-lanes-{}-{from}-{to}-{}",
            std::process::id(),
            rand::random::<u32>()
        );
        let rx = ShmRecv::create(&std::env::temp_dir(), &name, SLOTS, SLOT_BYTES, from).unwrap();
        let tx = ShmSend::attach(rx.path(), SLOTS, SLOT_BYTES, to).unwrap();
        (Box::new(tx), Box::new(rx))
    }

    fn fp(count: usize) -> Fingerprint {
        Fingerprint::new(Collective::SendRecv, Some(DType::U8), None, count)
    }

    fn call<'a>(plan: &'a Plan, rank: usize, fp: Fingerprint, abort: &'a AbortFlag) -> Call<'a> {
        Call {
            plan,
            fp,
            seq: 1,
            dtype: DType::U8,
            op: ReduceOp::Sum,
            n: 3,
            rank,
            timeout: Duration::from_secs(10),
            stream_stores: false,
            abort,
            incoming: None,
        }
    }

    /// A ring of three in one process: rank 0 sends rank 1 a short message and drops its links
    /// at once; rank 1 sends rank 2 a message many times its FIFO, which rank 2 starts reading
    /// only later. Rank 1's receive from rank 0 is over long before its send ends, and rank
    /// 2's link to rank 0 carries nothing: the peers that left are no failure (they were, as
    /// "rank 0 closed its end of the link", before the health checks looked only at the
    /// directions still to move frames). Rank 1 runs its call as a lane ([`run_lanes`]: the
    /// ring messages of an all-to-all) or as a ring call ([`run`]: a broadcast's relay, whose
    /// last ops forward what the finished root sent).
    #[test]
    fn a_peer_that_left_after_its_part_fails_no_wait_that_needs_nothing_more_from_it() {
        ring_of_three_where_rank_0_leaves_early(true);
        ring_of_three_where_rank_0_leaves_early(false);
    }

    fn ring_of_three_where_rank_0_leaves_early(lanes: bool) {
        let (short, long) = (100usize, 16 * SLOT_BYTES + 7);
        let (tx01, rx01) = fifo(0, 1);
        let (tx12, rx12) = fifo(1, 2);
        let (tx20, rx20) = fifo(2, 0);
        let mut l0 = Links::new(tx01, rx20, 1, 2).unwrap();
        let mut l1 = Links::new(tx12, rx01, 2, 0).unwrap();
        let mut l2 = Links::new(tx20, rx12, 0, 1).unwrap();
        let abort = [
            AbortFlag::default(),
            AbortFlag::default(),
            AbortFlag::default(),
        ];
        let msg0: Vec<u8> = (0..short).map(|i| (i * 7) as u8).collect();
        let msg1: Vec<u8> = (0..long).map(|i| (i * 13 + 5) as u8).collect();
        let mut got1 = vec![0u8; short];
        let mut got2 = vec![0u8; long];
        let (p0, p1, p2) = (
            plan_p2p(Some(short), None, SLOT_BYTES),
            plan_p2p(Some(long), Some(short), SLOT_BYTES),
            plan_p2p(None, Some(long), SLOT_BYTES),
        );
        let wait = Duration::from_secs(10);
        std::thread::scope(|s| {
            let r0 = s.spawn(|| {
                let c = call(&p0, 0, fp(short), &abort[0]);
                let b = Bufs::Split {
                    input: &msg0,
                    output: &mut [],
                };
                let r = run_lanes(&mut [Lane::new(&mut l0, vec![(c, b)])], wait, &abort[0]);
                drop(l0);
                r
            });
            let r2 = s.spawn(|| {
                // Long enough for several of rank 1's health checks after rank 0 has gone.
                std::thread::sleep(Duration::from_millis(300));
                let c = call(&p2, 2, fp(long), &abort[2]);
                let b = Bufs::Split {
                    input: &[],
                    output: &mut got2,
                };
                run_lanes(&mut [Lane::new(&mut l2, vec![(c, b)])], wait, &abort[2])
            });
            let c = Call {
                incoming: Some((1, fp(short))),
                ..call(&p1, 1, fp(long), &abort[1])
            };
            let b = Bufs::Split {
                input: &msg1,
                output: &mut got1,
            };
            let r1 = if lanes {
                run_lanes(&mut [Lane::new(&mut l1, vec![(c, b)])], wait, &abort[1])
            } else {
                run(&mut l1, &c, b)
            };
            r0.join().unwrap().expect("rank 0");
            r1.unwrap_or_else(|e| panic!("rank 1 (lanes: {lanes}): {e}"));
            r2.join().unwrap().expect("rank 2");
        });
        assert_eq!(got1, msg0);
        assert_eq!(got2, msg1);
    }
}
