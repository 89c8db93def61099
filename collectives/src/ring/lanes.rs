//! The lanes scheduler: a point-to-point run over several link pairs at once.
//!
//! A *lane* is one link pair's share of a run: its calls, each a plan whose sends only read the
//! input and whose receives only write the output. [`run_lanes`] moves every lane's calls, each
//! direction of each lane as soon as it can (so two ranks that each send more than the other's
//! slots hold before receiving still meet), under one deadline that progress on any lane
//! restarts. The ops themselves run through the engine ([`super::engine`]).

use std::time::{Duration, Instant};

use ringzero_kernels::cpu;

use super::call::*;
use super::engine::*;
use super::failure::AbortFlag;
use super::schedule::{Op, Plan};
use crate::error::{Error, Result};
use crate::transport::wait::Waiter;

/// One link pair's share of a point-to-point run ([`run_lanes`]): its calls, run one after the
/// other, each a plan whose sends only read the input and whose receives only write the output.
pub struct Lane<'a> {
    links: &'a mut Links,
    calls: Vec<(Call<'a>, Bufs<'a>)>,
    at: Cursor,
}

impl<'a> Lane<'a> {
    /// The calls (in order, with their buffers) to run over the links to and from one peer.
    pub fn new(links: &'a mut Links, calls: Vec<(Call<'a>, Bufs<'a>)>) -> Lane<'a> {
        Lane {
            links,
            calls,
            at: Cursor::default(),
        }
    }

    /// Which directions still have frames to move: an op left in the current call (at or
    /// after the cursor) or in a later one.
    fn needs(&self) -> Needs {
        let Some((call, _)) = self.calls.get(self.at.call) else {
            return Needs {
                rx: false,
                tx: false,
            };
        };
        let later = &self.calls[self.at.call + 1..];
        let left = |from: usize, send: bool| {
            let of = |o: &Op| if send { o.send } else { o.recv };
            call.plan
                .ops
                .get(from..)
                .is_some_and(|ops| ops.iter().any(of))
                || later.iter().any(|(c, _)| c.plan.ops.iter().any(of))
        };
        Needs {
            rx: left(self.at.recv_at, false),
            tx: left(self.at.send_at, true),
        }
    }
}

/// Where a lane is: its current call, and the index in that call's ops at or after which its
/// next send op and its next receive op are.
#[derive(Default)]
struct Cursor {
    call: usize,
    send_at: usize,
    recv_at: usize,
    /// A call's name (its index, the name), for errors and the final flush: made once per
    /// call, not per poll.
    what: Option<(usize, String)>,
}

impl Cursor {
    /// The current call's next send op and next receive op (`None` once a direction is done),
    /// moving the indices up to them.
    fn next<'p>(&mut self, plan: &'p Plan) -> (Option<&'p Op>, Option<&'p Op>) {
        let find = |at: &mut usize, want: fn(&Op) -> bool| {
            while plan.ops.get(*at).is_some_and(|o| !want(o)) {
                *at += 1;
            }
            plan.ops.get(*at)
        };
        (
            find(&mut self.send_at, |o| o.send),
            find(&mut self.recv_at, |o| o.recv),
        )
    }
}

/// Run every lane's calls to completion: each lane's calls in order, and within a call the send
/// ops in order and the receive ops in order, but each direction of each lane as soon as it can
/// go. So an exchange never waits on itself, whatever calls its peer makes (`send_recv`, or
/// `recv` then `send`), and a batch over several peers never waits on one peer while another
/// could move. Every wait has the calls' deadline (no progress on any lane for `timeout`).
pub fn run_lanes(lanes: &mut [Lane], timeout: Duration, abort: &AbortFlag) -> Result<()> {
    for lane in lanes.iter() {
        for (call, bufs) in &lane.calls {
            check_sizes(call, bufs)?;
            debug_assert!(
                call.plan.ops.iter().all(|o| o.send != o.recv),
                "every op of a lane's plan only sends or only receives"
            );
        }
    }
    // One lane waits on its own poller; several share a backoff.
    let mut shared = Waiter::backoff();
    let mut patience = Patience::new(Instant::now());
    let ran = loop {
        let mut moved = false;
        let mut pending = false;
        for lane in lanes.iter_mut() {
            moved |= step_lane(lane)?;
            pending |= lane.at.call < lane.calls.len();
        }
        if !pending {
            break Ok(());
        }
        let single = lanes.len() == 1;
        match patience.tick(Instant::now(), moved, timeout) {
            Tick::Moved => {
                if single {
                    lanes[0].links.side.waiter.progressed();
                } else {
                    shared.progressed();
                }
                continue;
            }
            Tick::TimedOut => {
                let lane = lanes
                    .iter_mut()
                    .find(|l| l.at.call < l.calls.len())
                    .expect("a lane is pending");
                break Err(lane_timeout(lane));
            }
            Tick::Check => {
                for lane in lanes.iter_mut() {
                    let needs = lane.needs();
                    if let Some((call, _)) = lane.calls.get(lane.at.call) {
                        health_of(lane.links, call, &call.fp.to_string(), needs)?;
                    }
                }
            }
            Tick::Idle => {}
        }
        if single {
            lanes[0].links.side.waiter.idle(timeout);
        } else {
            shared.idle(timeout);
        }
    };
    if lanes
        .iter()
        .any(|l| l.calls.iter().any(|(c, _)| c.stream_stores))
    {
        cpu::stream_fence();
    }
    ran?;
    for lane in lanes.iter_mut() {
        if let Some((call, _)) = lane.calls.last() {
            let what = match lane.at.what.take() {
                Some((i, w)) if i + 1 == lane.calls.len() => w,
                _ => call.fp.to_string(),
            };
            lane.links.flush(&what, call.seq, timeout, abort)?;
        }
    }
    Ok(())
}

/// Run whatever of `lane`'s current call can go now (its next send if a slot is free, its next
/// receive if the frame is there), moving to the next call when one completes. Whether anything
/// moved.
fn step_lane(lane: &mut Lane) -> Result<bool> {
    let (links, cur) = (&mut *lane.links, &mut lane.at);
    let mut moved = false;
    while let Some((call, bufs)) = lane.calls.get_mut(cur.call) {
        let what = match cur.what.take() {
            Some((i, w)) if i == cur.call => w,
            _ => call.fp.to_string(),
        };
        let es = call.dtype.size();
        let (prev, next, rank) = (links.prev, links.next, call.rank);
        moved |= links
            .tx
            .progress()
            .map_err(|e| link_err(e, &what, call.seq, next, rank, Some(&call.fp)))?;
        let (send, recv) = cur.next(call.plan);
        let mut ran = false;
        if let Some(op) = send {
            let slot = links.tx.reserve(op.elems * es);
            if slot
                .map_err(|e| link_err(e, &what, call.seq, next, rank, Some(&call.fp)))?
                .is_some()
            {
                // Ready: run_op finds its slot at once.
                run_op(links, call, (op, Needs::BOTH), bufs, &what, es)?;
                cur.send_at += 1;
                ran = true;
            }
        }
        if let Some(op) = recv {
            let e = expect(call, op, es);
            let ready = links
                .rx
                .peek(&e)
                .map_err(|err| link_err(err, &what, e.seq, prev, rank, Some(&e.fp)))?;
            if ready.is_some() {
                run_op(links, call, (op, Needs::BOTH), bufs, &what, es)?;
                cur.recv_at += 1;
                ran = true;
            }
        }
        moved |= ran;
        if send.is_none() && recv.is_none() {
            // This call is complete: on to the lane's next one (its name stays for the flush).
            *cur = Cursor {
                call: cur.call + 1,
                what: Some((cur.call, what)),
                ..Cursor::default()
            };
            moved = true;
            continue;
        }
        cur.what = Some((cur.call, what));
        break;
    }
    Ok(moved)
}

/// The timeout of a lane's current call: a missing frame names the sender; else the send waits
/// for a slot at the receiver.
fn lane_timeout(lane: &mut Lane) -> Error {
    let cur = &mut lane.at;
    let (call, _) = &lane.calls[cur.call];
    let es = call.dtype.size();
    let (send, recv) = cur.next(call.plan);
    let (op, have_in) = match recv {
        Some(op) => (op, false),
        None => (send.expect("an op is pending"), true),
    };
    let e = expect(call, op, es);
    let what = call.fp.to_string();
    op_timeout(
        call,
        &what,
        &e,
        have_in,
        lane.links.prev,
        lane.links.next,
        "slot",
    )
}
