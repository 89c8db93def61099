//! The doubling schedules: the latency-bound collectives in `⌈log2 n⌉` rounds whose reach doubles
//! each round, as pure data (no IO).
//!
//! The ring takes `n − 1` hops for a broadcast, a reduce or a barrier and `2(n − 1)` for an
//! all-reduce, whatever the size: on small buffers (a loss-scale flag, a gradient norm, a few KiB
//! of metrics, a random seed) that latency is the whole cost. These schedules take about `log2 n`
//! rounds instead, each message the whole buffer: fewer hops, more bytes through the busiest
//! rank, so they win below a size and the ring wins above it ([`crate::config::Algo`]).
//!
//! - **All-reduce, recursive doubling** ([`all_reduce`]). With `p` the largest power of two not
//!   above `n` and `e = n − p`, the first `2e` ranks pair up first (**fold**): even rank `2i`
//!   sends its buffer to `2i + 1` and sits out. The `p` ranks left, renumbered `0..p` in rank
//!   order, run `log2 p` rounds: in round `k` each exchanges its buffer with the rank whose number
//!   differs in bit `k` and combines the two. At the end each odd rank below `2e` sends the result
//!   back to the even rank it folded (**unfold**). Every combine puts the lower-numbered side
//!   first, so the reduction is one fixed tree over the ranks in order, `((x0 ⊕ x1) ⊕ (x2 ⊕ x3))
//!   ⊕ …` on 4 ranks, and both sides of an exchange compute the same bits: every rank ends
//!   bit-identical, in an order that depends only on `n` (it differs from the ring's, so the two
//!   may round differently).
//! - **Broadcast, binomial tree** ([`broadcast`]). Number the ranks from the root, `v = (rank −
//!   root) mod n`. In round `k = K−1, …, 0` (`K = ⌈log2 n⌉`) every rank that has the data and
//!   whose `v` is a multiple of `2^(k+1)` sends it to `v + 2^k`: the holders double each round.
//! - **Reduce, binomial tree** ([`reduce`]): the broadcast backwards. In round `k = 0, …, K−1`
//!   rank `v` with `v mod 2^(k+1) = 2^k` sends its partial result to `v − 2^k` and is done; the
//!   receiver combines as `mine ⊕ theirs`, so the root ends with the tree over `v` in order:
//!   `((x0 ⊕ x1) ⊕ (x2 ⊕ x3))` counted from the root (fixed by `n` and the root).
//! - **Barrier, dissemination** ([`barrier`]). In round `k < K` every rank sends an empty message
//!   to `rank + 2^k` and waits for one from `rank − 2^k` (mod `n`): after round `k` a rank has
//!   heard, through the chain, from the `2^(k+1) − 1` ranks before it, so after `K` rounds from
//!   all of them.
//! - **All-reduce, halving-doubling** ([`halving_doubling`]; Rabenseifner's, Gloo's
//!   "halving-doubling"): the recursive doubling's pairs, but each round moves part of the
//!   buffer, so mid-size buffers cost the ring's bytes in `2 log2 p` rounds. Split the buffer
//!   into `p` balanced parts. After the same fold, round `k = 0, …, log2 p − 1` of the
//!   **reduce-scatter** pairs doubling numbers differing in bit `k`: each keeps the half of its
//!   current span that bit `k` of its number picks (lower for 0), sends the other half and
//!   combines the peer's copy of its own half, lower number first; the span halves each round
//!   and ends one part. The **all-gather** runs the same pairs backwards (`k = log2 p − 1, …,
//!   0`): each sends the span it holds and receives its peer's, the sibling half, so the span
//!   doubles back to the whole buffer; then the unfold. Every part is reduced by the same tree
//!   as the recursive doubling's (`((x0 ⊕ x1) ⊕ (x2 ⊕ x3))`, pairs by bit 0 first), on one rank,
//!   and copied to the others: the two schedules give bit-identical results (but for which
//!   NaN or zero a min or max keeps, see [`Take::TheirsFirst`]), so a size threshold between
//!   them changes no bits.

use std::ops::Range;

use super::schedule::{chunk, Collective};

/// Which doubling schedule runs a collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Schedule {
    /// The whole buffer each round: recursive doubling (all-reduce), binomial trees (broadcast,
    /// reduce), dissemination (barrier).
    Doubling,
    /// Halving-doubling (all-reduce only): reduce-scatter by halving spans, all-gather by
    /// doubling them back.
    HalvingDoubling,
}

impl Schedule {
    /// Whether `coll` has a schedule of this kind.
    pub fn has(self, coll: Collective) -> bool {
        match self {
            Schedule::Doubling => has_schedule(coll),
            Schedule::HalvingDoubling => coll == Collective::AllReduce,
        }
    }
}

/// Parts `lo..hi` of the buffer split into `of` balanced parts ([`chunk`]): what one message of
/// a round carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// The first part.
    pub lo: usize,
    /// One past the last part.
    pub hi: usize,
    /// The number of parts the buffer is split into.
    pub of: usize,
}

impl Span {
    /// The whole buffer.
    pub const WHOLE: Span = Span {
        lo: 0,
        hi: 1,
        of: 1,
    };

    /// The elements of a buffer of `count` this span covers.
    pub fn elems(self, count: usize) -> Range<usize> {
        debug_assert!(self.lo < self.hi && self.hi <= self.of, "{self:?}");
        chunk(count, self.of, self.lo).start..chunk(count, self.of, self.hi - 1).end
    }

    /// The share of the buffer it covers.
    pub fn fraction(self) -> f64 {
        (self.hi - self.lo) as f64 / self.of as f64
    }
}

/// What one rank does with the buffer it receives in a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Take {
    /// Combine as `mine ⊕ theirs` (this rank holds the lower side).
    MineFirst,
    /// Combine as `theirs ⊕ mine` (the peer holds the lower side). The operand order of one ⊕
    /// matters only for which of two NaNs, or of +0 and −0, min and max return (every operator
    /// is commutative otherwise, floating point included): the runner keeps it where both sides
    /// of an exchange compute the same element (recursive doubling's exchanges, so both get the
    /// same bits), and combines in place as `mine ⊕ theirs` where one rank alone computes it
    /// (the fold, halving-doubling's halves).
    TheirsFirst,
    /// Replace this rank's buffer with the peer's (a broadcast's data, a barrier's empty
    /// message, the all-reduce's unfold: finished results).
    Replace,
}

/// One round of one rank: at most one message out and one in, both at once (to the same peer in
/// an exchange, to two different peers in the barrier). What is sent is the `send` span of this
/// rank's buffer as the round starts; what comes in is the peer's copy of the `recv` span, taken
/// into the same span here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Round {
    /// The rank this rank's buffer goes to, if any.
    pub to: Option<usize>,
    /// The rank a buffer comes from, if any, and what to do with it.
    pub from: Option<(usize, Take)>,
    /// The part of the buffer sent ([`Span::WHOLE`] but in halving-doubling).
    pub send: Span,
    /// The part of the buffer received.
    pub recv: Span,
}

impl Round {
    fn send(to: usize) -> Round {
        Round::exchange(Some(to), None)
    }

    fn receive(from: usize, take: Take) -> Round {
        Round::exchange(None, Some((from, take)))
    }

    fn exchange(to: Option<usize>, from: Option<(usize, Take)>) -> Round {
        Round {
            to,
            from,
            send: Span::WHOLE,
            recv: Span::WHOLE,
        }
    }

    /// The ranks this round talks to (one or two).
    pub fn peers(&self) -> impl Iterator<Item = usize> {
        let from = self.from.map(|(p, _)| p);
        self.to
            .into_iter()
            .chain(from.filter(|&p| Some(p) != self.to))
    }
}

/// Rank `rank`'s rounds of `coll` by schedule `sched` on `n` ranks, in order (none on one rank).
/// `None` for a collective that has no such schedule.
pub fn rounds(sched: Schedule, coll: Collective, n: usize, rank: usize) -> Option<Vec<Round>> {
    assert!(rank < n, "rank {rank} of {n}");
    if !sched.has(coll) {
        return None;
    }
    Some(match coll {
        Collective::AllReduce if sched == Schedule::HalvingDoubling => halving_doubling(n, rank),
        Collective::AllReduce => all_reduce(n, rank),
        Collective::Broadcast { root } => broadcast(n, root, rank),
        Collective::Reduce { root } => reduce(n, root, rank),
        Collective::Barrier => barrier(n, rank),
        _ => return None,
    })
}

/// Whether `coll` has a doubling schedule.
pub fn has_schedule(coll: Collective) -> bool {
    matches!(
        coll,
        Collective::AllReduce
            | Collective::Broadcast { .. }
            | Collective::Reduce { .. }
            | Collective::Barrier
    )
}

/// Rank `rank`'s rounds of a recursive-doubling all-reduce on `n` ranks.
pub fn all_reduce(n: usize, rank: usize) -> Vec<Round> {
    if n < 2 {
        return Vec::new();
    }
    let p = 1usize << n.ilog2();
    let extra = n - p;
    let v = virtual_rank(rank, extra);
    folded(n, rank, |out| {
        for k in 0..p.trailing_zeros() {
            let (peer, take) = partner(v, k, extra);
            out.push(Round::exchange(Some(peer), Some((peer, take))));
        }
    })
}

/// Rank `rank`'s rounds of a halving-doubling all-reduce on `n` ranks.
pub fn halving_doubling(n: usize, rank: usize) -> Vec<Round> {
    if n < 2 {
        return Vec::new();
    }
    let p = 1usize << n.ilog2();
    let extra = n - p;
    let v = virtual_rank(rank, extra);
    let bits = p.trailing_zeros();
    let span = |lo, hi| Span { lo, hi, of: p };
    folded(n, rank, |out| {
        // Reduce-scatter: keep the half bit k picks, give the other.
        let (mut lo, mut hi) = (0, p);
        for k in 0..bits {
            let (peer, take) = partner(v, k, extra);
            let mid = (lo + hi) / 2;
            let (keep, give) = if v & (1 << k) == 0 {
                ((lo, mid), (mid, hi))
            } else {
                ((mid, hi), (lo, mid))
            };
            out.push(Round {
                to: Some(peer),
                from: Some((peer, take)),
                send: span(give.0, give.1),
                recv: span(keep.0, keep.1),
            });
            (lo, hi) = keep;
        }
        // All-gather: the same pairs backwards, the span doubling back.
        for k in (0..bits).rev() {
            let (peer, _) = partner(v, k, extra);
            let size = hi - lo;
            let sibling = if v & (1 << k) == 0 {
                (hi, hi + size)
            } else {
                (lo - size, lo)
            };
            out.push(Round {
                to: Some(peer),
                from: Some((peer, Take::Replace)),
                send: span(lo, hi),
                recv: span(sibling.0, sibling.1),
            });
            (lo, hi) = (lo.min(sibling.0), hi.max(sibling.1));
        }
        debug_assert_eq!((lo, hi), (0, p));
    })
}

/// The all-reduce's fold around the rounds `body` pushes: on `n` ranks with `p` the largest
/// power of two not above `n` and `e = n − p`, even ranks below `2e` hand their buffer to the
/// odd one above and get the result back; the odd ones combine it first, run `body` and send
/// the result back last.
fn folded(n: usize, rank: usize, body: impl FnOnce(&mut Vec<Round>)) -> Vec<Round> {
    let extra = n - (1usize << n.ilog2());
    if rank < 2 * extra && rank.is_multiple_of(2) {
        // Folded away: hand the buffer to the odd neighbour, get the result back at the end.
        return vec![
            Round::send(rank + 1),
            Round::receive(rank + 1, Take::Replace),
        ];
    }
    let mut out = Vec::new();
    let folds = rank < 2 * extra;
    if folds {
        out.push(Round::receive(rank - 1, Take::TheirsFirst));
    }
    body(&mut out);
    if folds {
        out.push(Round::send(rank - 1));
    }
    out
}

/// The rank whose doubling number differs from `v` in bit `k`, and how `v` combines what it
/// sends: lower number first.
fn partner(v: usize, k: u32, extra: usize) -> (usize, Take) {
    let pv = v ^ (1 << k);
    let take = if v < pv {
        Take::MineFirst
    } else {
        Take::TheirsFirst
    };
    (real_rank(pv, extra), take)
}

/// `⌈log2 n⌉`: the rounds of the trees and the barrier.
fn ceil_log2(n: usize) -> u32 {
    n.next_power_of_two().trailing_zeros()
}

/// Rank `rank`'s rounds of a binomial-tree broadcast from `root` on `n` ranks.
pub fn broadcast(n: usize, root: usize, rank: usize) -> Vec<Round> {
    assert!(root < n, "root {root} of {n}");
    let v = (rank + n - root) % n;
    let real = |v: usize| (v + root) % n;
    (0..ceil_log2(n))
        .rev()
        .filter_map(|k| {
            let (step, span) = (1usize << k, 1usize << (k + 1));
            if v.is_multiple_of(span) && v + step < n {
                Some(Round::send(real(v + step)))
            } else if v % span == step {
                Some(Round::receive(real(v - step), Take::Replace))
            } else {
                None
            }
        })
        .collect()
}

/// Rank `rank`'s rounds of a binomial-tree reduce to `root` on `n` ranks.
pub fn reduce(n: usize, root: usize, rank: usize) -> Vec<Round> {
    assert!(root < n, "root {root} of {n}");
    let v = (rank + n - root) % n;
    let real = |v: usize| (v + root) % n;
    let mut out = Vec::new();
    for k in 0..ceil_log2(n) {
        let (step, span) = (1usize << k, 1usize << (k + 1));
        if v % span == step {
            out.push(Round::send(real(v - step)));
            break;
        }
        if v + step < n {
            out.push(Round::receive(real(v + step), Take::MineFirst));
        }
    }
    out
}

/// Rank `rank`'s rounds of a dissemination barrier on `n` ranks (empty messages).
pub fn barrier(n: usize, rank: usize) -> Vec<Round> {
    (0..ceil_log2(n))
        .map(|k| {
            let d = (1usize << k) % n;
            Round::exchange(
                Some((rank + d) % n),
                Some(((rank + n - d) % n, Take::Replace)),
            )
        })
        .collect()
}

/// The pairs of ranks (lower first, ascending, each once) that exchange anything in `coll`'s
/// schedule `sched` on `n` ranks: the links it needs.
pub fn pairs(sched: Schedule, coll: Collective, n: usize) -> Vec<(usize, usize)> {
    let mut all: Vec<(usize, usize)> = (0..n)
        .flat_map(|r| {
            rounds(sched, coll, n, r)
                .unwrap_or_default()
                .into_iter()
                .flat_map(|x| x.peers().collect::<Vec<_>>())
                .map(move |p| (r.min(p), r.max(p)))
        })
        .collect();
    all.sort_unstable();
    all.dedup();
    all
}

/// Rounds one after the other on the busiest rank: what sets the latency (0 for a collective
/// without such a schedule).
pub fn depth(sched: Schedule, coll: Collective, n: usize) -> usize {
    (0..n)
        .map(|r| rounds(sched, coll, n, r).map_or(0, |x| x.len()))
        .max()
        .unwrap_or(0)
}

/// The most any rank moves through its links, one round after another, as a multiple of the
/// buffer: each round counts the larger of its message out and in. What sets the bandwidth term
/// (the number of rounds for the whole-buffer schedules; `2(p − 1)/p` for halving-doubling on a
/// power of two, 2 more with the fold).
pub fn volume(sched: Schedule, coll: Collective, n: usize) -> f64 {
    (0..n)
        .map(|r| {
            rounds(sched, coll, n, r)
                .unwrap_or_default()
                .iter()
                .map(|x| {
                    let out = x.to.map_or(0.0, |_| x.send.fraction());
                    let got = x.from.map_or(0.0, |_| x.recv.fraction());
                    out.max(got)
                })
                .sum::<f64>()
        })
        .fold(0.0, f64::max)
}

/// The number (among the `p` ranks that run the doubling rounds) of a rank that does.
fn virtual_rank(rank: usize, extra: usize) -> usize {
    if rank < 2 * extra {
        rank / 2
    } else {
        rank - extra
    }
}

/// The rank with doubling number `v`.
fn real_rank(v: usize, extra: usize) -> usize {
    if v < extra {
        2 * v + 1
    } else {
        v + extra
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{HashMap, VecDeque};

    /// Run every rank's rounds of `coll` by `sched` with a FIFO per ordered pair (sends never
    /// block, as on the links: a round's send and receive proceed together), each rank's buffer
    /// `P` parts (`P` the largest power of two not above `n`, so every span is whole parts)
    /// starting as `init(rank)` in each, combining part by part by `combine(take, mine,
    /// theirs)`. Returns each rank's final parts, or the ranks stuck.
    fn simulate_by(
        sched: Schedule,
        coll: Collective,
        n: usize,
        init: impl Fn(usize) -> String,
        combine: impl Fn(Take, &str, String) -> String,
    ) -> Result<Vec<Vec<String>>, Vec<usize>> {
        let plans: Vec<Vec<Round>> = (0..n).map(|r| rounds(sched, coll, n, r).unwrap()).collect();
        let parts = 1usize << n.max(1).ilog2();
        let range = |s: Span| {
            assert_eq!(parts % s.of, 0, "{s:?} of {parts} parts");
            s.lo * parts / s.of..s.hi * parts / s.of
        };
        let mut val: Vec<Vec<String>> = (0..n).map(|r| vec![init(r); parts]).collect();
        let mut next = vec![0usize; n];
        // Whether rank r has already sent in its current round.
        let mut sent = vec![false; n];
        type Msg = (Span, Vec<String>);
        let mut fifo: HashMap<(usize, usize), VecDeque<Msg>> = HashMap::new();
        loop {
            let mut moved = false;
            for r in 0..n {
                let Some(&round) = plans[r].get(next[r]) else {
                    continue;
                };
                if let (Some(to), false) = (round.to, sent[r]) {
                    let msg = (round.send, val[r][range(round.send)].to_vec());
                    fifo.entry((r, to)).or_default().push_back(msg);
                    sent[r] = true;
                    moved = true;
                }
                if let Some((from, take)) = round.from {
                    let Some((span, theirs)) = fifo.get_mut(&(from, r)).and_then(|q| q.pop_front())
                    else {
                        continue;
                    };
                    assert_eq!(
                        span, round.recv,
                        "{coll} n = {n}: {from} → {r} sent another span"
                    );
                    for (i, t) in range(span).zip(theirs) {
                        val[r][i] = combine(take, &val[r][i], t);
                    }
                }
                next[r] += 1;
                sent[r] = false;
                moved = true;
            }
            if (0..n).all(|r| next[r] == plans[r].len()) {
                assert!(
                    fifo.values().all(VecDeque::is_empty),
                    "{coll} n = {n}: messages left unread"
                );
                return Ok(val);
            }
            if !moved {
                return Err((0..n).filter(|&r| next[r] < plans[r].len()).collect());
            }
        }
    }

    /// [`simulate_by`] for the whole-buffer schedules: each rank's one value.
    fn simulate(
        coll: Collective,
        n: usize,
        init: impl Fn(usize) -> String,
        combine: impl Fn(Take, &str, String) -> String,
    ) -> Result<Vec<String>, Vec<usize>> {
        let vals = simulate_by(Schedule::Doubling, coll, n, init, combine)?;
        Ok(vals
            .into_iter()
            .map(|parts| {
                assert!(
                    parts.iter().all(|p| *p == parts[0]),
                    "{coll} n = {n}: {parts:?}"
                );
                parts[0].clone()
            })
            .collect())
    }

    /// Values as expression strings, combined in the order the schedule says.
    fn expr(take: Take, mine: &str, theirs: String) -> String {
        match take {
            Take::MineFirst => format!("({mine}+{theirs})"),
            Take::TheirsFirst => format!("({theirs}+{mine})"),
            Take::Replace => theirs,
        }
    }

    fn leaves(v: &str) -> Vec<usize> {
        v.split(['(', ')', '+'])
            .filter(|s| !s.is_empty())
            .map(|s| s.parse().unwrap())
            .collect()
    }

    fn run(coll: Collective, n: usize) -> Vec<String> {
        simulate(coll, n, |r| r.to_string(), expr)
            .unwrap_or_else(|stuck| panic!("{coll} n = {n}: stuck {stuck:?}"))
    }

    #[test]
    fn all_reduce_ends_with_one_tree_over_all_ranks_in_order_on_every_rank() {
        let c = Collective::AllReduce;
        for n in 1..=33 {
            let vals = run(c, n);
            assert!(
                vals.iter().all(|v| *v == vals[0]),
                "n = {n}: ranks differ: {vals:?}"
            );
            // Every rank's input exactly once, in rank order (the tree keeps the order).
            assert_eq!(leaves(&vals[0]), (0..n).collect::<Vec<_>>(), "n = {n}");
        }
        assert_eq!(run(c, 4)[0], "((0+1)+(2+3))");
        assert_eq!(run(c, 3)[2], "((0+1)+2)");
        assert_eq!(run(c, 6)[5], "(((0+1)+(2+3))+(4+5))");
    }

    #[test]
    fn broadcast_reaches_every_rank_from_every_root() {
        for n in 1..=33 {
            for root in 0..n {
                let c = Collective::Broadcast { root };
                let init = |r: usize| {
                    if r == root {
                        "data".into()
                    } else {
                        format!("stale{r}")
                    }
                };
                let vals = simulate(c, n, init, expr)
                    .unwrap_or_else(|stuck| panic!("{c} n = {n}: stuck {stuck:?}"));
                assert!(vals.iter().all(|v| v == "data"), "{c} n = {n}: {vals:?}");
                // Every other rank receives once; the root never does.
                for r in 0..n {
                    let gets = broadcast(n, root, r)
                        .iter()
                        .filter(|x| x.from.is_some())
                        .count();
                    assert_eq!(gets, usize::from(r != root), "{c} n = {n} rank {r}");
                }
            }
        }
    }

    #[test]
    fn reduce_leaves_one_tree_counted_from_the_root_at_the_root() {
        for n in 1..=33 {
            for root in 0..n {
                let c = Collective::Reduce { root };
                let vals = run(c, n);
                // Every input once, in the order of the ranks counted from the root.
                let want: Vec<usize> = (0..n).map(|v| (v + root) % n).collect();
                assert_eq!(leaves(&vals[root]), want, "{c} n = {n}: {}", vals[root]);
                // Every other rank sends once, as its last round; the root never sends.
                for r in 0..n {
                    let x = reduce(n, root, r);
                    let sends = x.iter().filter(|x| x.to.is_some()).count();
                    assert_eq!(sends, usize::from(r != root), "{c} n = {n} rank {r}");
                    assert!(x.iter().rev().skip(1).all(|x| x.to.is_none()));
                }
            }
        }
        let c = |root| Collective::Reduce { root };
        assert_eq!(run(c(0), 4)[0], "((0+1)+(2+3))");
        assert_eq!(run(c(2), 4)[2], "((2+3)+(0+1))");
        assert_eq!(run(c(0), 5)[0], "(((0+1)+(2+3))+4)");
    }

    #[test]
    fn the_barrier_lets_no_rank_out_before_it_heard_from_every_rank() {
        // A message carries everything its sender has heard of (the set of ranks, as a string);
        // the barrier is correct when every rank ends having heard of all.
        let union = |_: Take, mine: &str, theirs: String| {
            let mut all: Vec<usize> = leaves(mine).into_iter().chain(leaves(&theirs)).collect();
            all.sort_unstable();
            all.dedup();
            all.iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join("+")
        };
        for n in 1..=40 {
            let c = Collective::Barrier;
            let vals = simulate(c, n, |r| r.to_string(), union)
                .unwrap_or_else(|stuck| panic!("n = {n}: stuck {stuck:?}"));
            for (r, v) in vals.iter().enumerate() {
                assert_eq!(leaves(v), (0..n).collect::<Vec<_>>(), "n = {n}: rank {r}");
            }
            // One round fewer would not do (for n > 1): some rank would leave early.
            if n > 1 {
                let k = ceil_log2(n) as usize;
                let heard = (1usize << (k - 1)).min(n);
                assert!(heard < n, "n = {n}: {k} rounds are not all needed");
            }
        }
    }

    #[test]
    fn partners_agree_and_depth_is_logarithmic() {
        let colls = |n: usize| {
            let mut c = vec![
                (Schedule::Doubling, Collective::AllReduce),
                (Schedule::HalvingDoubling, Collective::AllReduce),
                (Schedule::Doubling, Collective::Barrier),
            ];
            for root in [0, n / 2, n.saturating_sub(1)] {
                c.push((Schedule::Doubling, Collective::Broadcast { root }));
                c.push((Schedule::Doubling, Collective::Reduce { root }));
            }
            c
        };
        for n in 1..=64usize {
            for (sched, c) in colls(n) {
                let plan = |r| rounds(sched, c, n, r).unwrap();
                for r in 0..n {
                    for (i, x) in plan(r).iter().enumerate() {
                        for p in x.peers() {
                            assert!(p != r && p < n, "{c} n = {n}, rank {r}, round {i}");
                        }
                        // The receiver takes as many messages from this rank as it sends.
                        if let Some(to) = x.to {
                            let sends = plan(r).iter().filter(|y| y.to == Some(to)).count();
                            let takes = plan(to)
                                .iter()
                                .filter(|y| y.from.is_some_and(|(f, _)| f == r))
                                .count();
                            assert_eq!(takes, sends, "{sched:?} {c} n = {n}: {r} → {to}");
                        }
                    }
                }
                let log = ceil_log2(n) as usize;
                let folds = usize::from(!n.is_power_of_two());
                let want = match (sched, c) {
                    (Schedule::HalvingDoubling, _) if n > 1 => 2 * n.ilog2() as usize + 2 * folds,
                    (_, Collective::AllReduce) if n > 1 => n.ilog2() as usize + 2 * folds,
                    _ => log,
                };
                assert_eq!(depth(sched, c, n), want, "{sched:?} {c} n = {n}");
                // Each rank talks to about log2 n others: far fewer links than every pair.
                assert!(pairs(sched, c, n).len() <= n * (log + 2), "{c} n = {n}");
            }
        }
        let (d, hd, ar) = (
            Schedule::Doubling,
            Schedule::HalvingDoubling,
            Collective::AllReduce,
        );
        assert_eq!(pairs(d, ar, 4), [(0, 1), (0, 2), (1, 3), (2, 3)]);
        assert_eq!(pairs(hd, ar, 4), pairs(d, ar, 4), "the same pairs");
        assert_eq!(pairs(d, ar, 3), [(0, 1), (1, 2)]);
        assert!(pairs(d, ar, 1).is_empty());
        assert_eq!(pairs(d, Collective::Barrier, 3), [(0, 1), (0, 2), (1, 2)]);
        assert_eq!(
            pairs(d, Collective::Broadcast { root: 1 }, 4),
            [(0, 3), (1, 2), (1, 3)]
        );
        assert_eq!(rounds(d, Collective::AllGather, 4, 0), None);
        assert_eq!(rounds(hd, Collective::Barrier, 4, 0), None);
        // What moves: the whole buffer per round, or the ring's 2(p − 1)/p (plus the fold's 2).
        assert_eq!(volume(d, ar, 8), 3.0);
        assert_eq!(volume(hd, ar, 8), 2.0 * 7.0 / 8.0);
        assert_eq!(volume(hd, ar, 6), 2.0 * 3.0 / 4.0 + 2.0);
        assert_eq!(volume(d, Collective::Broadcast { root: 0 }, 5), 3.0);
    }

    #[test]
    fn halving_doubling_reduces_each_part_by_the_recursive_doublings_tree() {
        for n in 1..=33 {
            let c = Collective::AllReduce;
            let hd = simulate_by(Schedule::HalvingDoubling, c, n, |r| r.to_string(), expr)
                .unwrap_or_else(|stuck| panic!("n = {n}: stuck {stuck:?}"));
            let d = run(c, n);
            for (r, parts) in hd.iter().enumerate() {
                for (i, v) in parts.iter().enumerate() {
                    // The very expression of the recursive doubling: the same bits.
                    assert_eq!(*v, d[0], "n = {n}: rank {r} part {i}");
                }
            }
        }
        // Each part is reduced on one rank only: the reduce-scatter ends with the ranks holding
        // distinct single parts (bit-reversed numbers), and the rounds move halves.
        let x = halving_doubling(8, 1);
        let spans: Vec<(usize, usize)> = x.iter().map(|r| (r.send.lo, r.send.hi)).collect();
        assert_eq!(spans, [(0, 4), (6, 8), (5, 6), (4, 5), (4, 6), (4, 8)]);
        let recv: Vec<(usize, usize)> = x.iter().map(|r| (r.recv.lo, r.recv.hi)).collect();
        assert_eq!(recv, [(4, 8), (4, 6), (4, 5), (5, 6), (6, 8), (0, 4)]);
    }

    #[test]
    fn spans_cover_a_buffer_in_balanced_parts() {
        let s = |lo, hi| Span { lo, hi, of: 4 };
        assert_eq!(Span::WHOLE.elems(10), 0..10);
        assert_eq!(s(0, 2).elems(10), 0..6);
        assert_eq!(s(2, 4).elems(10), 6..10);
        assert_eq!(s(3, 4).elems(10), 8..10);
        // Fewer elements than parts: some spans are empty.
        assert_eq!(s(0, 1).elems(2), 0..1);
        assert_eq!(s(2, 4).elems(2), 2..2);
        assert_eq!(s(1, 3).fraction(), 0.5);
    }
}
