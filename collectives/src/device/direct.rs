//! The direct collectives: ranks that can all map each other's buffers (one node, CUDA IPC, peer
//! access between every pair; on the host stream, ranks that are threads of one process) run an
//! all-reduce, reduce-scatter, all-gather, broadcast or reduce as one kernel per rank instead of a
//! ring of slots, and an all-to-all as one copy per block.
//!
//! Rank `r` owns chunk `r` of the result ([`chunk`], as the ring's reduce-scatter does). In an
//! all-reduce it reads chunk `r` of every rank's input, combines them in rank order, and writes
//! the result into chunk `r` of every rank's output, in one pass ([`Stream::gather`]): every
//! input byte is read once and every output byte written once, which is the memory-bandwidth
//! bound of ranks that share one GPU, where the slot ring reads and writes each slice a second
//! time in the slots. A reduce-scatter writes only its own output; an all-gather copies its own
//! chunk into every output; a broadcast copies chunk `r` of the root's input into every output;
//! a reduce combines chunk `r` of every input into the root's output. An all-to-all pulls: rank
//! `r` copies block `r` of every rank's input into its own output, so no rank writes another's
//! buffer (the ring moves each block up to n − 1 hops instead).
//!
//! Each call takes three steps on the node board ([`Board`]), every rank alike:
//! 1. wait for this rank's earlier device work (its input is complete, its output free), then
//!    post the call's fingerprint and how to open its buffers ([`Stream::share`]); wait for every
//!    rank. A rank that called something else fails the call on every rank, naming both calls. A
//!    call without a direct form, or whose buffers some rank cannot share, takes the ring
//!    on every rank (nothing has been written yet);
//! 2. open the others' buffers (mappings are kept, keyed by the allocation's unique id, so a
//!    training loop opens each buffer once); post whether that worked; wait. If any rank could
//!    not, every rank takes the ring;
//! 3. queue the kernel, wait for it, post step 3; wait until every rank has, so no rank returns
//!    while another still writes into its output.
//!
//! What is pure — which chunk a rank reads from whom and writes to whom — is [`parts`], apart from
//! the board and the device.

use std::collections::VecDeque;
use std::time::Instant;

use bytemuck::Zeroable;
use ringzero_kernels::ReduceOp;

use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::ring::call::Call;
use crate::ring::engine::DevBufs;
use crate::ring::{chunk, Collective};
use crate::transport::board::{note, note_text, Board, Entry, Stall, Verdict};
use crate::transport::device::{DevPtr, Keep};
use crate::transport::wait::Waiter;
use ringzero_kernels::device::{ShareRecord, Stream, GATHER_MAX};

/// Mappings of one rank's buffers kept open (the oldest is closed when a new one would exceed
/// this): enough for a training loop's buffers, few enough that memory a peer freed is not held
/// for long (an open IPC mapping keeps the exporter's allocation alive).
const MAPS_PER_RANK: usize = 8;

/// Whether `coll` has a direct form (all-reduce, reduce-scatter, all-gather, broadcast, reduce,
/// all-to-all).
pub fn has_direct_form(coll: Collective) -> bool {
    matches!(
        coll,
        Collective::AllReduce
            | Collective::ReduceScatter
            | Collective::AllGather
            | Collective::Broadcast { .. }
            | Collective::Reduce { .. }
            | Collective::AllToAll
    )
}

/// Which of `rank`'s buffers the other ranks use in a direct `coll`: (they read its input, they
/// write its output); `None` where the collective has no direct form.
pub fn roles(coll: Collective, rank: usize, in_place: bool) -> Option<(bool, bool)> {
    Some(match coll {
        Collective::AllReduce => (true, true),
        Collective::ReduceScatter => (true, false),
        Collective::AllGather => (false, true),
        // In place the root's buffer already holds what it broadcasts.
        Collective::Broadcast { root } => (rank == root, !(in_place && rank == root)),
        Collective::Reduce { root } => (true, rank == root),
        // Out of place only: every rank pulls into its own output.
        Collective::AllToAll if !in_place => (true, false),
        _ => return None,
    })
}

/// A place in some rank's buffer: its input (`src`) or its output (`dst`), at an element offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Place {
    /// Whose buffer.
    pub rank: usize,
    /// The output (else the input).
    pub dst: bool,
    /// Element offset in that buffer.
    pub at: usize,
}

/// One piece of a rank's part in a direct call: it combines `ins` (in order) and writes the
/// result to every place of `outs`, `elems` elements each.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Part {
    /// Read, in this order.
    pub ins: Vec<Place>,
    /// Written.
    pub outs: Vec<Place>,
    /// Elements of each.
    pub elems: usize,
}

/// Rank `rank`'s part of a direct `coll` of `count` elements (the whole buffer's count, as the
/// ring takes it) over `n` ranks, in pieces run one after the other: one piece for the
/// reductions and their kin, one per block for an all-to-all (out of place, `count` a multiple
/// of `n`). Pure. `None` where `coll` has no direct form.
pub fn parts(
    coll: Collective,
    n: usize,
    rank: usize,
    count: usize,
    in_place: bool,
) -> Option<Vec<Part>> {
    roles(coll, rank, in_place)?;
    if coll == Collective::AllToAll {
        // Block `rank` of rank q's input into block q of this rank's output, starting with the
        // next rank's so that ranks on different devices read from different peers at once.
        let b = count / n;
        let place = |rank, dst, at| Place { rank, dst, at };
        return Some(
            (0..n)
                .map(|k| (rank + 1 + k) % n)
                .map(|q| Part {
                    ins: vec![place(q, false, rank * b)],
                    outs: vec![place(rank, true, q * b)],
                    elems: b,
                })
                .collect(),
        );
    }
    part(coll, n, rank, count, in_place).map(|p| vec![p])
}

/// The one piece of a reduction's (or its kin's) direct part: see [`parts`].
fn part(coll: Collective, n: usize, rank: usize, count: usize, in_place: bool) -> Option<Part> {
    let c = chunk(count, n, rank);
    let at = |q: usize, dst: bool| Place {
        rank: q,
        dst,
        at: c.start,
    };
    let all = |dst: bool| (0..n).map(|q| at(q, dst)).collect::<Vec<_>>();
    // Out of place, a reduce-scatter's output and an all-gather's input hold only this rank's
    // chunk; in place they are the chunk's range of the one buffer.
    let own = if in_place { c.start } else { 0 };
    let (ins, outs) = match coll {
        Collective::AllReduce => (all(false), all(true)),
        Collective::ReduceScatter => (
            all(false),
            vec![Place {
                rank,
                dst: true,
                at: own,
            }],
        ),
        Collective::AllGather => {
            let mut outs = all(true);
            if in_place {
                // This rank's chunk is already where it belongs.
                outs.retain(|p| p.rank != rank);
            }
            (
                vec![Place {
                    rank,
                    dst: false,
                    at: own,
                }],
                outs,
            )
        }
        Collective::Broadcast { root } => {
            let mut outs = all(true);
            if in_place {
                outs.retain(|p| p.rank != root);
            }
            (vec![at(root, false)], outs)
        }
        Collective::Reduce { root } => (all(false), vec![at(root, true)]),
        _ => unreachable!("roles: {coll} has no direct form"),
    };
    Some(Part {
        ins,
        outs,
        elems: c.len(),
    })
}

/// A mapping of another rank's allocation.
struct Mapping {
    id: u64,
    handle: [u8; 64],
    base: DevPtr,
    _keep: Keep,
}

/// A device communicator's direct side: the board and the mappings of the other ranks' buffers.
pub(crate) struct Direct {
    board: Board,
    rank: usize,
    ranks: usize,
    maps: Vec<VecDeque<Mapping>>,
}

impl Direct {
    /// Over `board`, for `rank` of `ranks`.
    pub(crate) fn new(board: Board, rank: usize, ranks: usize) -> Direct {
        Direct {
            board,
            rank,
            ranks,
            maps: (0..ranks).map(|_| VecDeque::new()).collect(),
        }
    }

    /// Tell every rank this one fails (they see it at their next wait).
    pub(crate) fn abort(&self, reason: &str) {
        self.board.abort(reason);
    }

    /// Run `call` (a `coll` of `count` elements) on the board. `Ok(Some(bytes))` when it ran
    /// directly, with the bytes this rank wrote into other ranks' buffers; `Ok(None)` when every
    /// rank takes the ring for it instead.
    ///
    /// # Safety
    /// As for [`crate::ring::device_engine::run`]: the addresses in `bufs` are memory of
    /// `stream`'s device of the lengths given (checked against the call), not used by anything
    /// else until this returns.
    pub(crate) unsafe fn run<S: Stream>(
        &mut self,
        stream: &S,
        call: &Call,
        coll: Collective,
        count: usize,
        bufs: DevBufs,
    ) -> Result<Option<u64>> {
        let (seq, fp) = (call.seq, call.fp);
        let what = fp.to_string();
        let in_place = matches!(bufs, DevBufs::One { .. });
        let (src, dst) = match bufs {
            DevBufs::Split { input, output, .. } => (input, output),
            DevBufs::One { buf, .. } => (buf, buf),
        };
        let parts = parts(coll, self.ranks, self.rank, count, in_place).filter(|_| count > 0);
        let mut clock = Clock::start();
        // Step 1.
        let mut entry = Entry::zeroed();
        entry.fp = fp;
        if let Some((read, written)) = parts.as_ref().and(roles(coll, self.rank, in_place)) {
            // Peers may read this rank's input and write its output from now on.
            self.drain(stream, call, "the work queued before the call")?;
            clock.lap("drain");
            let shared = (|| -> std::result::Result<(), String> {
                if read {
                    entry.src = stream.share(src).map_err(|e| e.to_string())?;
                    entry.has_src = 1;
                }
                if written {
                    entry.dst = stream.share(dst).map_err(|e| e.to_string())?;
                    entry.has_dst = 1;
                }
                Ok(())
            })();
            match shared {
                Ok(()) => entry.direct = 1,
                Err(why) => entry.note = note(&format!("rank {}: {why}", self.rank)),
            }
        }
        clock.lap("share");
        self.board.enter(seq, &entry);
        self.wait(call, 1, "enter the call")?;
        clock.lap("step 1");
        let entries: Vec<Entry> = (0..self.ranks).map(|q| self.board.entry(seq, q)).collect();
        if let Some(q) = (0..self.ranks).find(|&q| entries[q].fp != fp) {
            return Err(Error::Mismatch {
                seq,
                rank: self.rank,
                ours: what,
                peer: q,
                theirs: format!("{} (seq {seq})", entries[q].fp),
            });
        }
        let Some(parts) = parts else {
            return Ok(None);
        };
        if let Some(q) = (0..self.ranks).find(|&q| entries[q].direct == 0) {
            tracing::debug!(target: "ringzero::device", rank = self.rank, seq,
                "{what}: the ring, not direct: {}", note_text(&entries[q].note));
            return Ok(None);
        }
        // Step 2.
        let es = call.dtype.size();
        let mut verdict = Verdict::zeroed();
        let places = parts
            .iter()
            .map(|part| self.places(stream, &entries, part, es, src, dst))
            .collect::<std::result::Result<Vec<_>, _>>();
        let places = match places {
            Ok(p) => {
                verdict.ok = 1;
                Some(p)
            }
            Err(why) => {
                verdict.note = note(&format!("rank {}: {why}", self.rank));
                None
            }
        };
        clock.lap("open");
        self.board.decide(seq, &verdict);
        // From here the others may read and write this rank's buffers (once they see every
        // verdict ok): whatever happens, this rank returns only after publishing step 3 and
        // seeing that no other rank still may (`Board::settle`).
        let outcome = (|| -> Result<bool> {
            self.wait(call, 2, "open the others' buffers")?;
            clock.lap("step 2");
            if let Some(q) = (0..self.ranks).find(|&q| !self.board.verdict_ok(q)) {
                tracing::debug!(target: "ringzero::device", rank = self.rank, seq,
                    "{what}: the ring, not direct: {}", note_text(&self.board.verdict_note(q)));
                return Ok(false);
            }
            // Step 3.
            let divide = (call.op == ReduceOp::Avg && coll.reduces()).then_some(self.ranks);
            for (part, (ins, outs)) in parts
                .iter()
                .zip(places.expect("this rank's verdict was ok"))
            {
                // SAFETY: every address is this rank's buffer (checked sizes) or another rank's
                // buffer opened above, `elems` elements inside it (checked against its
                // allocation where the device reports one); the other ranks are inside this
                // call (step 2) and do not let their buffers go until every rank that may write
                // them has finished (step 3, `Board::settle`). In place, an output equals an
                // input, which the kernel allows.
                unsafe { stream.gather(call.dtype, call.op, &outs, &ins, part.elems, divide) }
                    .map_err(|e| Error::Device {
                        context: format!("{what} seq {seq}: the direct step"),
                        source: e,
                    })?;
            }
            clock.lap("launch");
            self.drain(stream, call, "the direct step")?;
            clock.lap("kernel");
            Ok(true)
        })();
        if outcome.is_err() {
            self.board.retract();
        }
        // This rank writes no more (its drain waited for its kernel, or it never launched one).
        self.board.done(seq);
        let doing = "finish writing into this rank's buffers";
        let settled = match (stream.memory_outlives_work(), &outcome) {
            // Device memory stays valid while another rank's mapping writes it: after the
            // direct step, the usual bounded wait; after the ring's verdict or a failure, none.
            (true, Ok(true)) => self.wait(call, 3, doing),
            (true, _) => Ok(()),
            // Host memory: no return while another rank may still write it.
            (false, _) => self
                .board
                .settle(seq)
                .map_err(|s| self.stalled(call, 3, doing, s)),
        };
        if !outcome? {
            return Ok(None);
        }
        settled?;
        clock.lap("step 3");
        tracing::trace!(target: "ringzero::direct", rank = self.rank, seq,
            "{what}: {} pieces of {} elements, µs {}", parts.len(), parts[0].elems, clock.laps);
        let to_peers = parts
            .iter()
            .map(|p| p.outs.iter().filter(|o| o.rank != self.rank).count() * p.elems * es)
            .sum::<usize>();
        Ok(Some(to_peers as u64))
    }

    /// The addresses of `part`'s inputs and outputs, opening the other ranks' buffers.
    fn places<S: Stream>(
        &mut self,
        stream: &S,
        entries: &[Entry],
        part: &Part,
        es: usize,
        src: DevPtr,
        dst: DevPtr,
    ) -> std::result::Result<(Vec<DevPtr>, Vec<DevPtr>), String> {
        let need = part.elems * es;
        if part.ins.len() > GATHER_MAX || part.outs.len() > GATHER_MAX {
            return Err(format!("more than {GATHER_MAX} ranks"));
        }
        let mut addr = |p: &Place| -> std::result::Result<DevPtr, String> {
            let off = (p.at * es) as u64;
            if p.rank == self.rank {
                return Ok(if p.dst { dst } else { src } + off);
            }
            let e = &entries[p.rank];
            let (has, share) = if p.dst {
                (e.has_dst, &e.dst)
            } else {
                (e.has_src, &e.src)
            };
            if has == 0 {
                return Err(format!("rank {} shared no buffer for this", p.rank));
            }
            // Bounds, where the device reports the allocation's size (the host stream does not).
            if share.bytes != 0 && share.offset + off + need as u64 > share.bytes {
                return Err(format!(
                    "rank {}'s buffer ends before the {need} bytes at {}",
                    p.rank,
                    share.offset + off
                ));
            }
            Ok(self.open(stream, p.rank, share)? + share.offset + off)
        };
        let ins = part
            .ins
            .iter()
            .map(&mut addr)
            .collect::<std::result::Result<_, _>>()?;
        let outs = part
            .outs
            .iter()
            .map(&mut addr)
            .collect::<std::result::Result<_, _>>()?;
        Ok((ins, outs))
    }

    /// The base address of `rank`'s allocation `share`, opened once and kept.
    fn open<S: Stream>(
        &mut self,
        stream: &S,
        rank: usize,
        share: &ShareRecord,
    ) -> std::result::Result<DevPtr, String> {
        let maps = &mut self.maps[rank];
        if let Some(m) = maps
            .iter()
            .find(|m| m.id == share.id && m.handle == share.handle)
        {
            return Ok(m.base);
        }
        let (base, keep) = stream
            .open_exported(&share.handle, share.bytes as usize)
            .map_err(|e| format!("opening rank {rank}'s buffer: {e}"))?;
        if maps.len() == MAPS_PER_RANK {
            // No queued work uses it: every earlier call completed before it returned.
            maps.pop_front();
        }
        maps.push_back(Mapping {
            id: share.id,
            handle: share.handle,
            base,
            _keep: keep,
        });
        Ok(base)
    }

    /// Wait for every rank to finish `step` of the call.
    fn wait(&self, call: &Call, step: u64, doing: &str) -> Result<()> {
        self.board
            .wait(call.seq, step, call.timeout, || call.abort.check(call))
            .map_err(|s| self.stalled(call, step, doing, s))
    }

    /// The error of a wait on the board for `step` that ended with `stall`.
    fn stalled(&self, call: &Call, step: u64, doing: &str, stall: Stall) -> Error {
        let place = format!("direct step {step} on the node board");
        stall.error((call.fp.to_string(), call.seq), call.timeout, doing, &place)
    }

    /// Wait until everything queued on `stream` so far has completed.
    fn drain<S: Stream>(&self, stream: &S, call: &Call, work: &str) -> Result<()> {
        let dev = |e| Error::Device {
            context: format!("{} seq {}: {work}", call.fp, call.seq),
            source: e,
        };
        let m = stream.mark().map_err(dev)?;
        let (until, mut waiter) = (
            Deadline::after(Instant::now(), call.timeout),
            Waiter::device(),
        );
        let stop = |e: Error| {
            // The work still reads and writes the caller's buffers (and, by the direct step,
            // other ranks'): it ends before the error is returned where that memory would not
            // outlive it.
            super::settle::settle(stream, &m, until.left(Instant::now()));
            Err(e)
        };
        while !stream.done(&m).map_err(dev)? {
            if until.passed(Instant::now()) {
                return stop(Error::Timeout {
                    op: call.fp.to_string(),
                    seq: call.seq,
                    peer: self.rank,
                    waiting: format!("this rank's device ({}) to finish {work}", stream.name()),
                    after: call.timeout,
                });
            }
            if let Err(e) = call.abort.check(call) {
                return stop(e);
            }
            waiter.idle(call.timeout);
        }
        Ok(())
    }
}

/// Where a direct call spends its time, for `RINGZERO_LOG=ringzero::direct=trace`: microseconds
/// per phase, measured only when that level is on.
struct Clock {
    last: Option<Instant>,
    laps: String,
}

impl Clock {
    fn start() -> Clock {
        let on = tracing::enabled!(target: "ringzero::direct", tracing::Level::TRACE);
        Clock {
            last: on.then(Instant::now),
            laps: String::new(),
        }
    }

    fn lap(&mut self, phase: &str) {
        use std::fmt::Write;
        if let Some(last) = &mut self.last {
            let now = Instant::now();
            let _ = write!(
                self.laps,
                " {phase} {:.1}",
                (now - *last).as_secs_f64() * 1e6
            );
            *last = now;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element of every rank's result is written exactly once, by the rank that owns its
    /// chunk, from every rank's input (reductions) or from the one input that holds it.
    #[test]
    fn the_parts_cover_every_output_once_and_read_what_they_must() {
        for n in 1..=GATHER_MAX {
            for count in [0, 1, 7, 64, 1001] {
                for in_place in [false, true] {
                    let root = n / 2;
                    for coll in [
                        Collective::AllReduce,
                        Collective::ReduceScatter,
                        Collective::AllGather,
                        Collective::Broadcast { root },
                        Collective::Reduce { root },
                    ] {
                        // (rank written, element) → times written.
                        let mut written = std::collections::HashMap::new();
                        for r in 0..n {
                            let mut ps = parts(coll, n, r, count, in_place).unwrap();
                            assert_eq!(ps.len(), 1, "{coll}: one piece");
                            let p = ps.pop().unwrap();
                            let c = chunk(count, n, r);
                            assert_eq!(p.elems, c.len());
                            assert!(p.ins.len() <= GATHER_MAX && p.outs.len() <= GATHER_MAX);
                            match coll {
                                Collective::AllGather => {
                                    let own = if in_place { c.start } else { 0 };
                                    assert_eq!(
                                        p.ins,
                                        vec![Place {
                                            rank: r,
                                            dst: false,
                                            at: own
                                        }]
                                    );
                                }
                                Collective::Broadcast { root } => {
                                    assert_eq!(
                                        p.ins,
                                        vec![Place {
                                            rank: root,
                                            dst: false,
                                            at: c.start
                                        }]
                                    );
                                }
                                _ => {
                                    let from: Vec<usize> = p.ins.iter().map(|x| x.rank).collect();
                                    assert_eq!(from, (0..n).collect::<Vec<_>>(), "rank order");
                                    assert!(p.ins.iter().all(|x| !x.dst && x.at == c.start));
                                }
                            }
                            // A rank reads another's input only where that rank shares it.
                            for i in &p.ins {
                                assert!(roles(coll, i.rank, in_place).unwrap().0 || i.rank == r);
                            }
                            for o in &p.outs {
                                assert!(o.dst);
                                if o.rank != r {
                                    assert!(roles(coll, o.rank, in_place).unwrap().1);
                                }
                                // Where the element lands in the global index space.
                                let global = match coll {
                                    Collective::ReduceScatter if !in_place => o.at + c.start,
                                    _ => o.at,
                                };
                                for e in global..global + p.elems {
                                    *written.entry((o.rank, e)).or_insert(0) += 1;
                                }
                            }
                        }
                        for ((q, e), k) in &written {
                            assert_eq!(*k, 1, "{coll} n={n} rank {q} element {e} written {k}×");
                        }
                        let expect: usize = match coll {
                            Collective::AllReduce => n * count,
                            Collective::ReduceScatter | Collective::Reduce { .. } => count,
                            // In place the rank's own chunk (all-gather), the root's buffer
                            // (broadcast) is already there.
                            _ if in_place => (n - 1) * count,
                            _ => n * count,
                        };
                        assert_eq!(written.len(), expect, "{coll} n={n} count={count}");
                    }
                }
            }
        }
        assert!(parts(Collective::RingShift, 2, 0, 10, false).is_none());
        assert!(roles(Collective::ReduceScatterV, 0, false).is_none());
        assert!(!has_direct_form(Collective::Barrier));
    }

    /// A direct all-to-all: every rank writes only its own output, each block exactly once, from
    /// block `rank` of the rank the block is named after; in place it takes the ring.
    #[test]
    fn an_all_to_all_pulls_every_block_once_into_its_own_output() {
        let c = Collective::AllToAll;
        for n in 1..=GATHER_MAX {
            for b in [0, 1, 5] {
                for r in 0..n {
                    let ps = parts(c, n, r, n * b, false).unwrap();
                    let mut from: Vec<usize> = ps.iter().map(|p| p.ins[0].rank).collect();
                    for p in &ps {
                        let q = p.ins[0].rank;
                        assert_eq!(p.elems, b);
                        assert_eq!(
                            p.ins,
                            vec![Place {
                                rank: q,
                                dst: false,
                                at: r * b
                            }]
                        );
                        assert_eq!(
                            p.outs,
                            vec![Place {
                                rank: r,
                                dst: true,
                                at: q * b
                            }]
                        );
                        assert!(roles(c, q, false).unwrap().0, "rank {q} shares its input");
                    }
                    from.sort_unstable();
                    assert_eq!(from, (0..n).collect::<Vec<_>>(), "n={n} rank {r}");
                    assert_eq!(roles(c, r, false), Some((true, false)));
                }
            }
            assert!(parts(c, n, 0, n, true).is_none());
        }
    }
}
