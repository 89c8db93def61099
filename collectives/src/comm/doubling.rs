//! The doubling schedules ([`crate::ring::doubling`]: recursive doubling and halving-doubling for
//! the all-reduce, binomial trees for broadcast and reduce, dissemination for the barrier) over
//! the pairs' own links: how a latency-bound collective runs in about `log2 n` rounds (`2 log2 n`
//! for halving-doubling) instead of the ring's `n − 1` or `2(n − 1)` hops.
//!
//! It is the same collective as the ring's (same checks, the communicator's next sequence number,
//! a flight record entry), with its schedule in its fingerprint ([`Fingerprint::by`]). Each round
//! is at most one message out and one in over the pairs' links (`Inner::mesh`, shared with the
//! pairwise collectives and connected by the first call that needs them), each the part of the
//! buffer the round names (the whole buffer but in halving-doubling), sliced as `send_recv`
//! slices it. With the first round an empty frame goes to the next rank and one comes
//! from the previous over the ring's links, as the pairwise collectives announce themselves: a
//! neighbour that called anything else (the ring's form of the same collective included) meets it
//! and both fail at once with the two calls named. On two ranks the rounds go over the ring's
//! links themselves (the one pair there is), which carry the call's fingerprint on every frame.

use std::collections::BTreeMap;

use ringzero_kernels::{cpu, DType, ReduceOp};

use super::pairs::{pairs_of, Watch};
use super::{refused, Inner, State};
use crate::error::Result;
use crate::ring::call::Call;
use crate::ring::doubling::{self, Round, Schedule, Take};
use crate::ring::engine::Bufs;
use crate::ring::failure;
use crate::ring::lanes::Lane;
use crate::ring::links::Links;
use crate::ring::{plan_p2p, Collective, Loc, Op, Plan};
use crate::wire::{Expect, Fingerprint};

impl Inner {
    /// `coll` (one that `sched` has a schedule for) of `count` elements of `dtype` by that
    /// schedule: `bufs` as the ring's form of `coll` takes them.
    pub(super) fn by_doubling(
        &self,
        (sched, coll, dtype, op): (Schedule, Collective, Option<DType>, ReduceOp),
        count: usize,
        in_place: bool,
        bufs: Bufs,
    ) -> Result<()> {
        let dt = dtype.unwrap_or(DType::U8);
        let fp = Fingerprint::new(coll, dtype, Some(op), count).by(sched);
        let bytes = count * dt.size();
        let me = self.rank;
        // The lengths the ring's checks would insist on: the input everywhere it is read, the
        // output everywhere it is written.
        let (reads, writes) = match coll {
            Collective::AllReduce | Collective::Barrier => (true, true),
            Collective::Broadcast { root } => (me == root, true),
            Collective::Reduce { root } => (true, me == root),
            _ => unreachable!("{coll} has no doubling schedule"),
        };
        let (input, output) = match &bufs {
            Bufs::One(b) => (b.len(), b.len()),
            Bufs::Split { input, output } => (input.len(), output.len()),
        };
        for (what, len, checked) in [("send", input, reads), ("recv", output, writes)] {
            if checked && len != bytes {
                return Err(refused(
                    coll,
                    format!("{what} holds {len} bytes, not the {count} elements of the call"),
                ));
            }
        }
        let rounds = doubling::rounds(sched, coll, self.size, me).expect("checked by the caller");
        let mut st = self.lock();
        let seq = st.seq;
        failure::refuse(st.failed.as_ref(), &self.abort, &fp, seq)?;
        self.recorded(&mut st, &fp, in_place, bytes as u64, |st| {
            let call = (seq, &fp, dt, op);
            let coll = (sched, coll);
            match (coll, bufs) {
                // The buffer itself: received into, sent from.
                ((_, Collective::Broadcast { root }), Bufs::Split { input, output }) => {
                    if me == root {
                        output.copy_from_slice(input);
                    }
                    self.run_rounds(st, coll, call, &rounds, output)
                }
                ((_, Collective::Broadcast { .. } | Collective::Barrier), Bufs::One(b)) => {
                    self.run_rounds(st, coll, call, &rounds, b)
                }
                ((_, Collective::Barrier), Bufs::Split { output, .. }) => {
                    self.run_rounds(st, coll, call, &rounds, output)
                }
                // Reductions where this rank ends with the result (the all-reduce, the
                // reduce's root): combined in the output itself, the input copied there first.
                (_, bufs) if writes => {
                    let out = match bufs {
                        Bufs::One(b) => b,
                        Bufs::Split { input, output } => {
                            output.copy_from_slice(input);
                            output
                        }
                    };
                    self.run_rounds(st, coll, call, &rounds, out)?;
                    if op == ReduceOp::Avg {
                        cpu::divide(dt, out, self.size)?;
                    }
                    Ok(())
                }
                // A reduce's other ranks: partial results in scratch, their buffers untouched.
                (_, bufs) => {
                    let mut acc = Aligned::copy_of(match bufs {
                        Bufs::One(b) => b,
                        Bufs::Split { input, .. } => input,
                    });
                    self.run_rounds(st, coll, call, &rounds, acc.bytes_mut())
                }
            }
        })
    }

    /// This rank's `rounds` of the call (`seq`, `fp`) on `acc`, which ends holding what the
    /// schedule leaves this rank (before an average's division).
    fn run_rounds(
        &self,
        st: &mut State,
        (sched, coll): (Schedule, Collective),
        (seq, fp, dtype, op): (u64, &Fingerprint, DType, ReduceOp),
        rounds: &[Round],
        acc: &mut [u8],
    ) -> Result<()> {
        let (n, es) = (self.size, dtype.size());
        let count = acc.len() / es;
        let mut peers: Vec<usize> = rounds.iter().flat_map(Round::peers).collect();
        peers.sort_unstable();
        peers.dedup();
        // Two ranks: the ring's own links join the one pair every round uses (each rank's
        // previous and next are the other), so the rounds go over them, with no pair links to
        // connect and no announcement: the rounds' frames carry the call's fingerprint on the
        // ring itself, where a neighbour in any other call meets them.
        let ring_pair = n == 2 && st.links.is_some();
        let mut mesh = if ring_pair {
            None
        } else {
            Some(self.mesh_for(st, (seq, fp, dtype), || doubling::pairs(sched, coll, n))?)
        };
        if let Some(mesh) = mesh.as_mut().filter(|m| m.connects) {
            // The ring's next frame is this call's announcement (below): watch for it, and for
            // an abort in front of it.
            let next = Expect {
                seq,
                step: 0,
                slice: 0,
                fp: *fp,
                len: 0,
            };
            let watch = st.links.as_mut().map(|ring| Watch {
                ring,
                seq,
                next: Some(next),
            });
            mesh.connect(self, &peers, (seq, fp), watch)?;
        }
        let slice_elems = (self.cfg.slice_bytes / es).max(1);
        let whole = |_| *fp;
        // The bytes each round sends and receives, and whether the round runs on the buffer
        // itself: one peer, and what goes out is not what comes in. Any other round (recursive
        // doubling's exchanges, the barrier's two peers) receives into scratch beside it.
        let bytes = |s: doubling::Span| {
            let e = s.elems(count);
            e.start * es..e.end * es
        };
        let on_buffer = |x: &Round| {
            let (s, r) = (bytes(x.send), bytes(x.recv));
            x.peers().count() == 1
                && (x.to.is_none() || x.from.is_none() || s.end <= r.start || r.end <= s.start)
        };
        let scratch = rounds
            .iter()
            .filter(|x| x.from.is_some() && !on_buffer(x))
            .map(|x| bytes(x.recv).len())
            .max()
            .unwrap_or(0);
        let mut theirs = Aligned::zeroed(scratch);
        // The announcement: an empty frame each way around the ring, with the first round (one
        // empty slice, whatever the slot size).
        let announce_plan = plan_p2p(Some(0), Some(0), 1);
        let (mut ring, mut announce) = if ring_pair {
            (st.links.as_mut(), None)
        } else {
            let announce = st.links.as_mut().map(|links| {
                let call = self.p2p_call(
                    &announce_plan,
                    (&whole, dtype),
                    (Some(&[][..]), seq),
                    (Some(&mut [][..]), seq),
                );
                (links, call)
            });
            (None, announce)
        };

        for round in rounds {
            let mut now: Vec<usize> = round.peers().collect();
            now.sort_unstable();
            let from = round.from.map(|(p, _)| p);
            let (sb, rb) = (bytes(round.send), bytes(round.recv));
            let plans: Vec<_> = now
                .iter()
                .map(|&p| {
                    let send = (round.to == Some(p)).then_some(sb.len() / es);
                    let recv = (from == Some(p)).then_some(rb.len() / es);
                    plan_p2p(send, recv, slice_elems)
                })
                .collect();
            if on_buffer(round) {
                // Each received slice combined into the buffer or stored there straight from
                // the link, as the ring's in-place steps do.
                let pairs = mesh.as_mut().map(|m| &mut *m.links);
                let links = round_links(ring.as_deref_mut(), pairs, &now)
                    .pop()
                    .expect("one peer");
                let combine = matches!(round.from, Some((_, t)) if t != Take::Replace);
                let plan = placed(&plans[0], (sb.start / es, rb.start / es), combine, count);
                let call = Call {
                    n: 2,
                    incoming: from.map(|_| (seq, *fp)),
                    ..self.call(&plan, (seq, *fp), dtype, op, rb.len())
                };
                let mut lanes = vec![Lane::new(links, vec![(call, Bufs::One(&mut *acc))])];
                if let Some((ring, call)) = announce.take() {
                    lanes.push(Lane::new(ring, vec![call]));
                }
                crate::ring::lanes::run_lanes(&mut lanes, self.cfg.timeout, &self.abort)?;
                continue;
            }
            let got_len = if from.is_some() { rb.len() } else { 0 };
            let mut send = round.to.map(|_| &acc[sb.clone()]);
            let mut recv = from.map(|_| &mut theirs.bytes_mut()[..got_len]);
            let mut lanes = Vec::with_capacity(3);
            let pairs = mesh.as_mut().map(|m| &mut *m.links);
            let links = round_links(ring.as_deref_mut(), pairs, &now);
            for ((&p, links), plan) in now.iter().zip(links).zip(&plans) {
                let s = if round.to == Some(p) {
                    send.take()
                } else {
                    None
                };
                let r = if from == Some(p) { recv.take() } else { None };
                let call = self.p2p_call(plan, (&whole, dtype), (s, seq), (r, seq));
                lanes.push(Lane::new(links, vec![call]));
            }
            if let Some((ring, call)) = announce.take() {
                lanes.push(Lane::new(ring, vec![call]));
            }
            crate::ring::lanes::run_lanes(&mut lanes, self.cfg.timeout, &self.abort)?;
            drop(lanes);
            let got = &mut theirs.bytes_mut()[..got_len];
            match round.from {
                Some((_, Take::MineFirst)) => cpu::reduce_into(dtype, op, &mut acc[rb], got)?,
                Some((_, Take::TheirsFirst)) => {
                    cpu::reduce_into(dtype, op, got, &acc[rb.clone()])?;
                    acc[rb].copy_from_slice(got);
                }
                Some((_, Take::Replace)) => acc[rb].copy_from_slice(got),
                None => {}
            }
        }
        if let Some((ring, call)) = announce {
            // No rounds (not reached with two ranks or more): the announcement alone.
            crate::ring::lanes::run_lanes(
                &mut [Lane::new(ring, vec![call])],
                self.cfg.timeout,
                &self.abort,
            )?;
        }
        Ok(())
    }
}

/// A round's links, one per peer of `now` in its order: the ring's (two ranks), or the pairs'.
fn round_links<'a>(
    ring: Option<&'a mut Links>,
    pairs: Option<&'a mut BTreeMap<usize, Links>>,
    now: &[usize],
) -> Vec<&'a mut Links> {
    match (ring, pairs) {
        (Some(ring), _) => vec![ring],
        (None, Some(pairs)) => pairs_of(pairs, now),
        (None, None) => unreachable!("a world of two has the ring's links"),
    }
}

/// A point-to-point `plan` (sends reading input elements from 0, receives storing output elements
/// from 0) placed on one buffer of `count` elements: its sends reading from element `send_at`,
/// its receives storing from `recv_at`, and combining into what is there when `combine`.
fn placed(plan: &Plan, (send_at, recv_at): (usize, usize), combine: bool, count: usize) -> Plan {
    let shift = |l: &Loc, by: usize| Loc {
        buf: l.buf,
        range: l.range.start + by..l.range.end + by,
    };
    let ops = plan
        .ops
        .iter()
        .map(|o| {
            let store = o.store.as_ref().map(|l| shift(l, recv_at));
            Op {
                local: match (&o.local, combine) {
                    (Some(l), _) => Some(shift(l, send_at)),
                    (None, true) => store.clone(),
                    (None, false) => None,
                },
                store,
                ..o.clone()
            }
        })
        .collect();
    Plan {
        ops,
        input_len: count,
        output_len: count,
        in_place: true,
        ..plan.clone()
    }
}

/// Bytes in 8-byte-aligned storage, so the kernels may view them as any element type (a
/// `Vec<u8>` promises no alignment, and an empty one points at address 1).
struct Aligned {
    words: Vec<u64>,
    len: usize,
}

impl Aligned {
    fn zeroed(len: usize) -> Aligned {
        Aligned {
            words: vec![0; len.div_ceil(8)],
            len,
        }
    }

    fn copy_of(b: &[u8]) -> Aligned {
        let mut a = Aligned::zeroed(b.len());
        a.bytes_mut().copy_from_slice(b);
        a
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }
}
