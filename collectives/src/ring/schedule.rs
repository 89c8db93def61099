//! The ring schedule as pure data: no IO, no clock, no buffers.
//!
//! # Words
//! - **chunk**: the `count` elements of a collective are split into `n` chunks, one per rank,
//!   balanced so sizes differ by at most one element ([`chunk`]). Rank `r` owns chunk `r`: it ends
//!   a reduce-scatter holding chunk `r` fully reduced, and contributes chunk `r` to an all-gather.
//!   Counts not divisible by `n` therefore need no padding: the first `count % n` chunks are one
//!   element longer.
//!   [`Collective::ReduceScatterV`] takes the chunks' sizes from its caller instead (any sizes,
//!   zero included); everything below holds for them unchanged.
//! - **slice**: the unit of one frame on a link. Every chunk is split into the same number `J` of
//!   slices (`J = ceil(largest chunk / slice_elems)`, at least 1), so every rank runs the same
//!   program shape and an empty chunk still sends (empty) frames: a collective with `n > 1` always
//!   exchanges at least one frame per step, which is what lets every rank check the fingerprint of
//!   what its neighbour called, and what makes a zero-count all-gather a barrier.
//! - **step**: one hop of the ring. Reduce-scatter and all-gather take `n − 1` steps, all-reduce
//!   `2(n − 1)`; broadcast and reduce pass slices down a chain of `n − 1` hops from/to the root.
//! - **op**: what one rank does for one slice at one step, NCCL-style fused: optionally receive a
//!   frame from the previous rank, optionally combine it with a local region, optionally store the
//!   result, optionally send it to the next rank. Ops run strictly in order (slice-major:
//!   all steps of slice 0, then slice 1, ...), which keeps every link's frames in one agreed order
//!   and, with at least two slots per link, can never deadlock (tested by simulation).
//!
//! Reduction order depends only on `(n, rank order, chunking)`: chunk `c` is reduced starting at
//! rank `c + 1` and ending at rank `c`, which then distributes the result, so every rank ends with
//! bit-identical data.

use std::fmt;
use std::ops::Range;

/// Which collective, with its root where it has one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Collective {
    /// Every rank ends with the reduction of every rank's input.
    AllReduce,
    /// Rank `r` ends with chunk `r` of the reduction.
    ReduceScatter,
    /// Every rank ends with every rank's chunk.
    AllGather,
    /// Every rank ends with the root's input.
    Broadcast {
        /// Source rank.
        root: usize,
    },
    /// The root ends with the reduction of every rank's input.
    Reduce {
        /// Destination rank.
        root: usize,
    },
    /// No rank leaves before every rank has entered.
    Barrier,
    /// Every rank sends its buffer to the next rank and receives the previous rank's (all links
    /// busy at once: the streaming probe of `ringzero bench`, and ring attention's exchange).
    RingShift,
    /// Rank `r` sends block `j` of its input to rank `j` and ends with block `r` of every rank's
    /// input, in rank order. The host communicator exchanges a block with every other rank at
    /// once (the neighbours' over the ring's links, the others' over each pair's), each planned
    /// by [`plan_p2p`]. Device communicators, whose only links are the ring's, run [`plan`]'s
    /// store-and-forward ring: each block travels its distance hop by hop, (n−1)/2 of the
    /// buffer over every link (n/2 times what direct pairs move), out of place only.
    AllToAll,
    /// Point-to-point: one rank's send matched by another rank's receive. Not a collective: only
    /// the two ranks take part, over links of their own, and the frames of each direction carry
    /// that direction's own sequence numbers. Planned by [`plan_p2p`].
    SendRecv,
    /// All-to-all with a count per pair of ranks (`MPI_Alltoallv`). Like the three below, it
    /// runs over the point-to-point links: each pair of ranks exchanges one message each way
    /// (possibly empty), planned by [`plan_p2p`] and numbered with the collective's sequence
    /// number.
    AllToAllV,
    /// All-gather of parts of different sizes (`MPI_Allgatherv`): every rank sends its part to
    /// every other rank. The host communicator sends it over the point-to-point links, as the
    /// others here; device communicators run the all-gather's ring over the given parts
    /// ([`PlanArgs::counts`]), as [`Collective::ReduceScatterV`] runs the reduce-scatter's.
    AllGatherV,
    /// The root ends with every rank's buffer, in rank order (`MPI_Gather`).
    Gather {
        /// Destination rank.
        root: usize,
    },
    /// Rank `r` ends with block `r` of the root's buffer (`MPI_Scatter`).
    Scatter {
        /// Source rank.
        root: usize,
    },
    /// Reduce-scatter with a count per rank (`MPI_Reduce_scatter`): rank `r` ends with part `r`
    /// of the reduction, parts of any size (shards that do not split evenly, with no padding).
    /// A ring collective: the reduce-scatter's schedule over the given parts instead of balanced
    /// chunks (see [`PlanArgs::counts`]).
    ReduceScatterV,
}

impl Collective {
    /// Wire code.
    pub fn code(self) -> u8 {
        match self {
            Collective::AllReduce => 1,
            Collective::ReduceScatter => 2,
            Collective::AllGather => 3,
            Collective::Broadcast { .. } => 4,
            Collective::Reduce { .. } => 5,
            Collective::Barrier => 6,
            Collective::RingShift => 7,
            Collective::AllToAll => 8,
            Collective::SendRecv => 9,
            Collective::AllToAllV => 10,
            Collective::AllGatherV => 11,
            Collective::Gather { .. } => 12,
            Collective::Scatter { .. } => 13,
            Collective::ReduceScatterV => 14,
        }
    }

    /// The root, if this collective has one.
    pub fn root(self) -> Option<usize> {
        match self {
            Collective::Broadcast { root }
            | Collective::Reduce { root }
            | Collective::Gather { root }
            | Collective::Scatter { root } => Some(root),
            _ => None,
        }
    }

    /// The name used in messages and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllGather => "all_gather",
            Collective::Broadcast { .. } => "broadcast",
            Collective::Reduce { .. } => "reduce",
            Collective::Barrier => "barrier",
            Collective::RingShift => "ring_shift",
            Collective::AllToAll => "all_to_all",
            Collective::SendRecv => "send_recv",
            Collective::AllToAllV => "all_to_all_v",
            Collective::AllGatherV => "all_gather_v",
            Collective::Gather { .. } => "gather",
            Collective::Scatter { .. } => "scatter",
            Collective::ReduceScatterV => "reduce_scatter_v",
        }
    }

    /// Whether this collective always runs pairwise (over each pair's own links, not a ring:
    /// all-to-all-v, gather, scatter). All-gather-v runs pairwise only up to a size
    /// ([`Algo::gathers_v_pairwise`](crate::Algo::gathers_v_pairwise)), round the ring above it.
    pub fn is_pairwise(self) -> bool {
        matches!(
            self,
            Collective::AllToAllV | Collective::Gather { .. } | Collective::Scatter { .. }
        )
    }

    /// Whether this collective combines values (and so takes a reduce op).
    pub fn reduces(self) -> bool {
        matches!(
            self,
            Collective::AllReduce
                | Collective::ReduceScatter
                | Collective::ReduceScatterV
                | Collective::Reduce { .. }
        )
    }

    /// Rebuild from a wire code and root.
    pub fn from_code(code: u8, root: usize) -> Option<Collective> {
        Some(match code {
            1 => Collective::AllReduce,
            2 => Collective::ReduceScatter,
            3 => Collective::AllGather,
            4 => Collective::Broadcast { root },
            5 => Collective::Reduce { root },
            6 => Collective::Barrier,
            7 => Collective::RingShift,
            8 => Collective::AllToAll,
            9 => Collective::SendRecv,
            10 => Collective::AllToAllV,
            11 => Collective::AllGatherV,
            12 => Collective::Gather { root },
            13 => Collective::Scatter { root },
            14 => Collective::ReduceScatterV,
            _ => return None,
        })
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.root() {
            Some(root) => write!(f, "{}(root={root})", self.name()),
            None => f.write_str(self.name()),
        }
    }
}

/// The elements of chunk `i` of `count` elements split over `n` ranks (balanced; the first
/// `count % n` chunks hold one extra element).
pub fn chunk(count: usize, n: usize, i: usize) -> Range<usize> {
    split(0..count, n, i)
}

/// Part `i` of `parts` balanced parts of `range`.
pub fn split(range: Range<usize>, parts: usize, i: usize) -> Range<usize> {
    assert!(parts > 0 && i < parts, "split: part {i} of {parts}");
    let len = range.len();
    let (base, rem) = (len / parts, len % parts);
    let start = range.start + i * base + i.min(rem);
    start..start + base + usize::from(i < rem)
}

/// One of the two user buffers an op reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buf {
    /// The send buffer (in place: the one buffer).
    Input,
    /// The receive buffer (in place: the one buffer).
    Output,
}

/// A region of a user buffer, in the collective's global element coordinates (see
/// [`Plan::input_base`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Loc {
    /// Which buffer.
    pub buf: Buf,
    /// Elements, in global coordinates.
    pub range: Range<usize>,
}

/// What one rank does for one slice at one step. Semantics, in order:
/// `value = recv ⊕ local` (or whichever of the two is present); `finalize` divides by `n` for
/// `Avg`; `value` is written to `store`, then sent to the next rank if `send`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Op {
    /// The step of the frame this op sends; a receiving op expects a frame of step `step − 1`.
    pub step: u32,
    /// Slice index (the same on sender and receiver of a frame).
    pub slice: u32,
    /// Elements in this op's frame or copy.
    pub elems: usize,
    /// Receive a frame of `elems` elements from the previous rank.
    pub recv: bool,
    /// Local operand: reduced with the received frame, or the value itself when nothing is received.
    pub local: Option<Loc>,
    /// Where the value is written (None: not kept locally).
    pub store: Option<Loc>,
    /// Apply the `Avg` division here (the value is complete).
    pub finalize: bool,
    /// Send the value to the next rank.
    pub send: bool,
}

/// The whole program of one rank for one collective.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Ops, run strictly in order.
    pub ops: Vec<Op>,
    /// Global coordinate of element 0 of the input buffer.
    pub input_base: usize,
    /// Global coordinate of element 0 of the output buffer.
    pub output_base: usize,
    /// Elements the input buffer must hold.
    pub input_len: usize,
    /// Elements the output buffer must hold.
    pub output_len: usize,
    /// Whether input and output are one buffer.
    pub in_place: bool,
}

/// Parameters of one rank's plan.
#[derive(Clone, Copy, Debug)]
pub struct PlanArgs<'a> {
    /// The collective.
    pub coll: Collective,
    /// World size.
    pub n: usize,
    /// This rank.
    pub rank: usize,
    /// Total elements (all-gather: of the output; reduce-scatter: of the input).
    pub count: usize,
    /// Largest slice in elements (≥ 1).
    pub slice_elems: usize,
    /// One buffer for input and output.
    pub in_place: bool,
    /// Elements of each rank's chunk, where they are given (`n` of them, adding up to `count`)
    /// rather than balanced by [`chunk`]: [`Collective::ReduceScatterV`]'s and
    /// [`Collective::AllGatherV`]'s parts (which both need them). `None` for every other
    /// collective.
    pub counts: Option<&'a [usize]>,
}

/// The elements a collective call runs on: a total, split into balanced chunks, or with each
/// rank's part given ([`Collective::ReduceScatterV`]).
#[derive(Clone, Copy, Debug)]
pub struct Count<'a> {
    /// Total elements ([`PlanArgs::count`]).
    pub total: usize,
    /// Each rank's part, adding up to `total` ([`PlanArgs::counts`]).
    pub parts: Option<&'a [usize]>,
}

impl From<usize> for Count<'_> {
    fn from(total: usize) -> Self {
        Count { total, parts: None }
    }
}

impl<'a> Count<'a> {
    /// A v-collective's count: `parts`, which the caller has checked add up to `total`.
    pub fn parts(total: usize, parts: &'a [usize]) -> Count<'a> {
        Count {
            total,
            parts: Some(parts),
        }
    }
}

/// Where every rank's chunk lies: balanced ([`chunk`]) or at the given counts.
enum Chunks {
    Balanced { count: usize, n: usize },
    At(Vec<usize>),
}

impl Chunks {
    fn new(count: usize, n: usize, counts: Option<&[usize]>) -> Chunks {
        match counts {
            None => Chunks::Balanced { count, n },
            Some(c) => {
                assert_eq!(c.len(), n, "plan: {} counts for {n} ranks", c.len());
                let at: Vec<usize> = std::iter::once(0)
                    .chain(c.iter().scan(0usize, |a, &k| {
                        *a += k;
                        Some(*a)
                    }))
                    .collect();
                assert_eq!(at[n], count, "plan: counts add up to {} of {count}", at[n]);
                Chunks::At(at)
            }
        }
    }

    fn get(&self, c: usize) -> Range<usize> {
        match self {
            Chunks::Balanced { count, n } => chunk(*count, *n, c),
            Chunks::At(at) => at[c]..at[c + 1],
        }
    }

    fn largest(&self) -> usize {
        match self {
            Chunks::Balanced { count, n } => chunk(*count, *n, 0).len(),
            Chunks::At(at) => at.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0),
        }
    }
}

/// Build the plan of one rank. Pure: the same arguments always give the same plan.
pub fn plan(a: PlanArgs) -> Plan {
    let PlanArgs {
        coll,
        n,
        rank: r,
        count,
        in_place,
        ..
    } = a;
    assert!(n > 0 && r < n, "plan: rank {r} of {n}");
    let v = matches!(coll, Collective::ReduceScatterV | Collective::AllGatherV);
    assert_eq!(
        a.counts.is_some(),
        v,
        "plan: counts are given to the v-collectives and to them only ({coll})"
    );
    assert!(
        coll != Collective::AllToAll || ((n == 1 || !in_place) && count.is_multiple_of(n)),
        "plan: an all-to-all is planned out of place on a multiple of the {n} ranks (count {count})"
    );
    // The v-variants are the ring's over parts of the given sizes.
    let coll = match coll {
        Collective::ReduceScatterV => Collective::ReduceScatter,
        Collective::AllGatherV => Collective::AllGather,
        c => c,
    };
    let chunks = Chunks::new(count, n, a.counts);
    let se = a.slice_elems.max(1);
    let own = chunks.get(r);
    let (input_base, input_len, output_base, output_len) = match coll {
        Collective::ReduceScatter if !in_place => (0, count, own.start, own.len()),
        Collective::AllGather if !in_place => (own.start, own.len(), 0, count),
        Collective::Barrier => (0, 0, 0, 0),
        // Out of place, a non-root's unused buffer may be empty.
        Collective::Reduce { root } if !in_place && r != root => (0, count, 0, 0),
        Collective::Broadcast { root } if !in_place && r != root => (0, 0, 0, count),
        _ => (0, count, 0, count),
    };
    let mut p = Plan {
        ops: Vec::new(),
        input_base,
        output_base,
        input_len,
        output_len,
        in_place,
    };
    let l = Locs { in_place };
    if n == 1 {
        let all = match coll {
            Collective::Barrier => 0..0,
            _ => own.clone(),
        };
        let mut o = op(0, 0, &all);
        o.local = l.input(all.clone());
        o.store = l.output(all, true);
        if o.store.is_some() {
            p.ops.push(o);
        }
        return p;
    }
    match coll {
        Collective::ReduceScatter
        | Collective::AllGather
        | Collective::AllReduce
        | Collective::Barrier => ring_ops(&mut p, &l, coll, &chunks, (n, r), se),
        // The pairwise collectives plan each message like this (`plan_p2p` is the same frames).
        Collective::ReduceScatterV | Collective::AllGatherV => {
            unreachable!("planned as the ring's collective over the given parts")
        }
        Collective::AllToAll => all_to_all(&mut p, n, r, count / n, se),
        Collective::RingShift
        | Collective::SendRecv
        | Collective::AllToAllV
        | Collective::Gather { .. }
        | Collective::Scatter { .. } => exchange_ops(&mut p, &l, count, se),
        Collective::Broadcast { root } | Collective::Reduce { root } => {
            chain_ops(&mut p, &l, coll, root, (n, r), count, se)
        }
    }
    p
}

/// Where one plan's ops read and write: the caller's input or output, in place or not.
struct Locs {
    in_place: bool,
}

impl Locs {
    /// `range` of the input.
    fn input(&self, range: Range<usize>) -> Option<Loc> {
        Some(Loc {
            buf: Buf::Input,
            range,
        })
    }

    /// `range` of the output; in place, copying a region onto itself is a no-op
    /// (`read_from_same`: the value is the local operand unchanged).
    fn output(&self, range: Range<usize>, read_from_same: bool) -> Option<Loc> {
        if self.in_place && read_from_same {
            None
        } else {
            Some(Loc {
                buf: Buf::Output,
                range,
            })
        }
    }
}

/// An op at `step` of `slice` over `range`'s elements that does nothing yet.
fn op(step: usize, slice: usize, range: &Range<usize>) -> Op {
    Op {
        step: step as u32,
        slice: slice as u32,
        elems: range.len(),
        recv: false,
        local: None,
        store: None,
        finalize: false,
        send: false,
    }
}

/// The ring's reduce-scatter, all-gather, all-reduce (the two in turn, per slice) and barrier
/// (an empty all-gather) on rank `r` of `n`, slice-major.
fn ring_ops(
    p: &mut Plan,
    l: &Locs,
    coll: Collective,
    chunks: &Chunks,
    (n, r): (usize, usize),
    se: usize,
) {
    let ring = |x: isize| x.rem_euclid(n as isize) as usize;
    let ri = r as isize;
    let slices = chunks.largest().div_ceil(se).max(1);
    let slice_of = |c: usize, j: usize| split(chunks.get(c), slices, j);
    for j in 0..slices {
        let mut step = 0;
        if matches!(coll, Collective::ReduceScatter | Collective::AllReduce) {
            // op k: receive chunk r−k−1 (k ≥ 1), add own input, send it on (k < n−1).
            for k in 0..n {
                let c = ring(ri - k as isize - 1);
                let s = slice_of(c, j);
                let mut o = op(step, j, &s);
                o.recv = k > 0;
                o.local = l.input(s.clone());
                o.send = k < n - 1;
                if k == n - 1 {
                    o.finalize = true;
                    o.store = l.output(s, false);
                    o.send = coll == Collective::AllReduce;
                }
                p.ops.push(o);
                step += 1;
            }
            // The all-gather's first send was the reduce-scatter's last op (step n − 1).
        }
        if matches!(
            coll,
            Collective::AllGather | Collective::AllReduce | Collective::Barrier
        ) {
            // op k: receive chunk r−k (k ≥ 1), keep it, send it on (k < n−1).
            let first = if coll == Collective::AllReduce { 1 } else { 0 };
            for k in first..n {
                let c = ring(ri - k as isize);
                let s = slice_of(c, j);
                let mut o = op(step, j, &s);
                if k == 0 {
                    o.local = l.input(s.clone());
                    o.store = l.output(s, true);
                } else {
                    o.recv = true;
                    o.store = l.output(s, false);
                }
                o.send = k < n - 1;
                p.ops.push(o);
                step += 1;
            }
        }
    }
}

/// A message each way between two ranks (ring shift, send/recv and the pairwise collectives):
/// send slice j before receiving slice j into the same place, so in place works too.
fn exchange_ops(p: &mut Plan, l: &Locs, count: usize, se: usize) {
    let slices = count.div_ceil(se).max(1);
    for j in 0..slices {
        let s = split(0..count, slices, j);
        let mut send = op(0, j, &s);
        send.send = true;
        send.local = l.input(s.clone());
        let mut recv = op(1, j, &s);
        recv.recv = true;
        recv.store = l.output(s, false);
        p.ops.push(send);
        p.ops.push(recv);
    }
}

/// Broadcast and reduce as a chain along the ring: a broadcast starts at the root, a reduce
/// ends at it.
fn chain_ops(
    p: &mut Plan,
    l: &Locs,
    coll: Collective,
    root: usize,
    (n, r): (usize, usize),
    count: usize,
    se: usize,
) {
    let ring = |x: isize| x.rem_euclid(n as isize) as usize;
    let ri = r as isize;
    let reduce = matches!(coll, Collective::Reduce { .. });
    // Position along the chain: broadcast starts at the root, reduce ends at it.
    let pos = if reduce {
        ring(ri - root as isize - 1)
    } else {
        ring(ri - root as isize)
    };
    let slices = count.div_ceil(se).max(1);
    for j in 0..slices {
        let s = split(0..count, slices, j);
        let mut o = op(pos, j, &s);
        o.recv = pos > 0;
        o.send = pos < n - 1;
        if reduce {
            o.local = l.input(s.clone());
            if pos == n - 1 {
                o.finalize = true;
                o.store = l.output(s, false);
            }
        } else if pos == 0 {
            o.local = l.input(s.clone());
            o.store = l.output(s, true);
        } else {
            o.store = l.output(s, false);
        }
        p.ops.push(o);
    }
}

/// The ring all-to-all of rank `r` of `n`, blocks of `block` elements, into `p` (out of place).
///
/// Each block travels from its sender to its receiver hop by hop down the ring, as on a conveyor
/// belt: every link carries one frame per *tick*. Blocks go out farthest first: in *phase* `d`
/// (from `n − 1` down to 1) a rank puts its block for rank `r + d` on the belt, and every rank
/// forwards what it receives until the block has gone `d` hops, when its receiver keeps it. A
/// phase's block leaves its last hop just as the next phase's goes out, so the belt never stands
/// idle: `n(n−1)/2` frames per slice on every link. Every op either receives frame `t` and sends
/// frame `t + 1` (a forward), receives and keeps, or puts a new block out right after a keep,
/// so no rank is more than one frame ahead of what it has received, as in the other rings (two
/// slots per link suffice). A rank's own block is a local copy. Slice-major, as the other rings:
/// slice `j` of every block, then slice `j + 1`. Steps count ticks within a slice from 1.
fn all_to_all(p: &mut Plan, n: usize, r: usize, block: usize, se: usize) {
    let slices = block.div_ceil(se).max(1);
    let ring = |x: usize| x % n;
    let loc = |buf: Buf, b: usize, s: &Range<usize>| Loc {
        buf,
        range: b * block + s.start..b * block + s.end,
    };
    let op = |step: usize, j: usize, s: &Range<usize>| Op {
        step: step as u32,
        slice: j as u32,
        elems: s.len(),
        recv: false,
        local: None,
        store: None,
        finalize: false,
        send: false,
    };
    for j in 0..slices {
        let s = split(0..block, slices, j);
        let mut own = op(0, j, &s);
        own.local = Some(loc(Buf::Input, r, &s));
        own.store = Some(loc(Buf::Output, r, &s));
        p.ops.push(own);
        // Tick t: frame t leaves on every link (step t + 1); rank r's comes from r − 1.
        let mut t = 0;
        for d in (1..n).rev() {
            let mut out = op(t + 1, j, &s);
            out.local = Some(loc(Buf::Input, ring(r + d), &s));
            out.send = true;
            p.ops.push(out);
            for hop in 1..=d {
                // The frame of tick t has now gone `hop` hops: from rank r − hop.
                let mut o = op(t + 2, j, &s);
                o.recv = true;
                if hop < d {
                    o.send = true;
                } else {
                    o.store = Some(loc(Buf::Output, ring(r + n - d), &s));
                }
                p.ops.push(o);
                t += 1;
            }
        }
    }
}

/// The plan of one rank's point-to-point call with one peer: send `send` elements to it, receive
/// `recv` elements from it, or both at once. Each direction is sliced as
/// [`Collective::RingShift`] slices its buffer (sends are step 0, receives expect step 0), so a
/// rank's `send` and its peer's `recv` of the same count agree frame by frame whichever call each
/// made. The sends only read the input and the receives only write the output, so the engine
/// runs the two directions independently ([`super::lanes::run_lanes`]): an exchange never
/// waits on itself, whichever calls the peer makes.
pub fn plan_p2p(send: Option<usize>, recv: Option<usize>, slice_elems: usize) -> Plan {
    let se = slice_elems.max(1);
    let slices = |c: usize| c.div_ceil(se).max(1);
    let (ns, nr) = (send.map_or(0, slices), recv.map_or(0, slices));
    // Sends (step 0) read slice j of the input; receives expect it and store it in the output.
    let op = |send: bool, j: usize, s: Range<usize>| Op {
        step: u32::from(!send),
        slice: j as u32,
        elems: s.len(),
        recv: !send,
        local: send.then(|| Loc {
            buf: Buf::Input,
            range: s.clone(),
        }),
        store: (!send).then(|| Loc {
            buf: Buf::Output,
            range: s.clone(),
        }),
        finalize: false,
        send,
    };
    let mut ops = Vec::with_capacity(ns + nr);
    for j in 0..ns.max(nr) {
        if let Some(c) = send.filter(|_| j < ns) {
            ops.push(op(true, j, split(0..c, ns, j)));
        }
        if let Some(c) = recv.filter(|_| j < nr) {
            ops.push(op(false, j, split(0..c, nr, j)));
        }
    }
    Plan {
        ops,
        input_base: 0,
        output_base: 0,
        input_len: send.unwrap_or(0),
        output_len: recv.unwrap_or(0),
        in_place: false,
    }
}

impl Plan {
    /// Bytes this rank sends under this plan, for elements of `elem_size` bytes (payload only).
    pub fn bytes_sent(&self, elem_size: usize) -> usize {
        self.ops
            .iter()
            .filter(|o| o.send)
            .map(|o| o.elems * elem_size)
            .sum()
    }

    /// Frames this rank sends.
    pub fn frames_sent(&self) -> usize {
        self.ops.iter().filter(|o| o.send).count()
    }
}

#[cfg(test)]
#[path = "schedule_tests.rs"]
mod tests;
