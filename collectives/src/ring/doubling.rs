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

use super::schedule::Collective;

/// What one rank does with the buffer it receives in a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Take {
    /// Combine as `mine ⊕ theirs` (this rank holds the lower side).
    MineFirst,
    /// Combine as `theirs ⊕ mine` (the peer holds the lower side).
    TheirsFirst,
    /// Replace this rank's buffer with the peer's (a broadcast's data, a barrier's empty
    /// message, the all-reduce's unfold: finished results).
    Replace,
}

/// One round of one rank: at most one message out and one in, both at once (to the same peer in
/// an exchange, to two different peers in the barrier). What is sent is this rank's buffer as
/// the round starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Round {
    /// The rank this rank's buffer goes to, if any.
    pub to: Option<usize>,
    /// The rank a buffer comes from, if any, and what to do with it.
    pub from: Option<(usize, Take)>,
}

impl Round {
    fn send(to: usize) -> Round {
        Round {
            to: Some(to),
            from: None,
        }
    }

    fn receive(from: usize, take: Take) -> Round {
        Round {
            to: None,
            from: Some((from, take)),
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

/// Rank `rank`'s rounds of `coll` by its doubling schedule on `n` ranks, in order (none on one
/// rank). `None` for a collective that has no doubling schedule.
pub fn rounds(coll: Collective, n: usize, rank: usize) -> Option<Vec<Round>> {
    assert!(rank < n, "rank {rank} of {n}");
    Some(match coll {
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
    let v = virtual_rank(rank, extra);
    for k in 0..p.trailing_zeros() {
        let pv = v ^ (1 << k);
        let peer = real_rank(pv, extra);
        let take = if v < pv {
            Take::MineFirst
        } else {
            Take::TheirsFirst
        };
        out.push(Round {
            to: Some(peer),
            from: Some((peer, take)),
        });
    }
    if folds {
        out.push(Round::send(rank - 1));
    }
    out
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
            Round {
                to: Some((rank + d) % n),
                from: Some(((rank + n - d) % n, Take::Replace)),
            }
        })
        .collect()
}

/// The pairs of ranks (lower first, ascending, each once) that exchange anything in `coll`'s
/// doubling schedule on `n` ranks: the links it needs.
pub fn pairs(coll: Collective, n: usize) -> Vec<(usize, usize)> {
    let mut all: Vec<(usize, usize)> = (0..n)
        .flat_map(|r| {
            rounds(coll, n, r)
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
/// without a doubling schedule).
pub fn depth(coll: Collective, n: usize) -> usize {
    (0..n)
        .map(|r| rounds(coll, n, r).map_or(0, |x| x.len()))
        .max()
        .unwrap_or(0)
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

    /// Run every rank's rounds of `coll` with a FIFO per ordered pair (sends never block, as on
    /// the links: a round's send and receive proceed together), starting from `init(rank)` and
    /// combining by `combine(take, mine, theirs)`. Returns each rank's final value, or the ranks
    /// stuck.
    fn simulate(
        coll: Collective,
        n: usize,
        init: impl Fn(usize) -> String,
        combine: impl Fn(Take, &str, String) -> String,
    ) -> Result<Vec<String>, Vec<usize>> {
        let plans: Vec<Vec<Round>> = (0..n).map(|r| rounds(coll, n, r).unwrap()).collect();
        let mut val: Vec<String> = (0..n).map(init).collect();
        let mut next = vec![0usize; n];
        // Whether rank r has already sent in its current round.
        let mut sent = vec![false; n];
        let mut fifo: HashMap<(usize, usize), VecDeque<String>> = HashMap::new();
        loop {
            let mut moved = false;
            for r in 0..n {
                let Some(&round) = plans[r].get(next[r]) else {
                    continue;
                };
                if let (Some(to), false) = (round.to, sent[r]) {
                    fifo.entry((r, to)).or_default().push_back(val[r].clone());
                    sent[r] = true;
                    moved = true;
                }
                if let Some((from, take)) = round.from {
                    let Some(theirs) = fifo.get_mut(&(from, r)).and_then(|q| q.pop_front()) else {
                        continue;
                    };
                    val[r] = combine(take, &val[r], theirs);
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
            let mut c = vec![Collective::AllReduce, Collective::Barrier];
            for root in [0, n / 2, n.saturating_sub(1)] {
                c.push(Collective::Broadcast { root });
                c.push(Collective::Reduce { root });
            }
            c
        };
        for n in 1..=64usize {
            for c in colls(n) {
                for r in 0..n {
                    for (i, x) in rounds(c, n, r).unwrap().iter().enumerate() {
                        for p in x.peers() {
                            assert!(p != r && p < n, "{c} n = {n}, rank {r}, round {i}");
                        }
                        // The receiver of what this rank sends has a round that takes it.
                        if let Some(to) = x.to {
                            let takes = rounds(c, n, to)
                                .unwrap()
                                .iter()
                                .filter(|y| y.from.is_some_and(|(f, _)| f == r))
                                .count();
                            assert_eq!(takes, 1, "{c} n = {n}: {r} → {to}");
                        }
                    }
                }
                let log = ceil_log2(n) as usize;
                let want = match c {
                    Collective::AllReduce if !n.is_power_of_two() => n.ilog2() as usize + 2,
                    _ => log,
                };
                assert_eq!(depth(c, n), want, "{c} n = {n}");
                // Each rank talks to about log2 n others: far fewer links than every pair.
                assert!(pairs(c, n).len() <= n * (log + 2), "{c} n = {n}");
            }
        }
        let ar = Collective::AllReduce;
        assert_eq!(pairs(ar, 4), [(0, 1), (0, 2), (1, 3), (2, 3)]);
        assert_eq!(pairs(ar, 3), [(0, 1), (1, 2)]);
        assert!(pairs(ar, 1).is_empty());
        assert_eq!(pairs(Collective::Barrier, 3), [(0, 1), (0, 2), (1, 2)]);
        assert_eq!(
            pairs(Collective::Broadcast { root: 1 }, 4),
            [(0, 3), (1, 2), (1, 3)]
        );
        assert_eq!(rounds(Collective::AllGather, 4, 0), None);
    }
}
