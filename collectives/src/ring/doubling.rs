//! Recursive doubling: the all-reduce schedule for small buffers, as pure data (no IO).
//!
//! The ring all-reduce takes `2(n − 1)` steps whatever the size, each a hop's latency: on small
//! buffers (a loss-scale flag, a gradient norm, a few KiB of metrics) that latency is the whole
//! cost. Recursive doubling takes `log2 n` rounds instead, each an exchange of the whole buffer
//! with one partner: fewer hops, more bytes (`log2 n · S` per rank against the ring's
//! `2(n − 1)/n · S`), so it wins below a size and the ring wins above it
//! ([`crate::config::AllReduceAlgo`]).
//!
//! With `p` the largest power of two not above `n` and `e = n − p`, the first `2e` ranks pair up
//! first (**fold**): even rank `2i` sends its buffer to `2i + 1` and sits out. The `p` ranks left,
//! renumbered `0..p` in rank order, run `log2 p` rounds: in round `k` each exchanges its buffer
//! with the rank whose number differs in bit `k` and combines the two. At the end each odd rank
//! below `2e` sends the result back to the even rank it folded (**unfold**).
//!
//! Every combine puts the lower-numbered side's value first, so the reduction is one fixed tree
//! over the ranks in order, `((x0 ⊕ x1) ⊕ (x2 ⊕ x3)) ⊕ …` on 4 ranks, and both sides of an
//! exchange compute the same bits: every rank ends bit-identical, and the order depends only on
//! `n` (it differs from the ring's order, so the two algorithms may round differently).

/// What one rank does with what it receives in a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Take {
    /// Nothing is received.
    Nothing,
    /// Combine as `mine ⊕ theirs` (this rank holds the lower side).
    MineFirst,
    /// Combine as `theirs ⊕ mine` (the peer holds the lower side).
    TheirsFirst,
    /// Replace this rank's buffer with the peer's (the unfold: the finished result).
    Replace,
}

/// One round of one rank: an exchange with one peer. A rank that sends and receives in a round
/// does both at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Round {
    /// The other rank.
    pub peer: usize,
    /// Whether this rank sends its whole buffer to `peer`.
    pub send: bool,
    /// What it does with the buffer `peer` sends (whether it receives one).
    pub take: Take,
}

/// Rank `rank`'s rounds of a recursive-doubling all-reduce on `n` ranks, in order (none when
/// `n` is 1).
pub fn rounds(n: usize, rank: usize) -> Vec<Round> {
    assert!(rank < n, "rank {rank} of {n}");
    if n < 2 {
        return Vec::new();
    }
    let p = 1usize << n.ilog2();
    let extra = n - p;
    if rank < 2 * extra && rank.is_multiple_of(2) {
        // Folded away: hand the buffer to the odd neighbour, get the result back at the end.
        let peer = rank + 1;
        let fold = Round {
            peer,
            send: true,
            take: Take::Nothing,
        };
        let unfold = Round {
            peer,
            send: false,
            take: Take::Replace,
        };
        return vec![fold, unfold];
    }
    let mut out = Vec::new();
    let folds = rank < 2 * extra;
    if folds {
        out.push(Round {
            peer: rank - 1,
            send: false,
            take: Take::TheirsFirst,
        });
    }
    let v = virtual_rank(rank, extra);
    for k in 0..p.trailing_zeros() {
        let pv = v ^ (1 << k);
        out.push(Round {
            peer: real_rank(pv, extra),
            send: true,
            take: if v < pv {
                Take::MineFirst
            } else {
                Take::TheirsFirst
            },
        });
    }
    if folds {
        out.push(Round {
            peer: rank - 1,
            send: true,
            take: Take::Nothing,
        });
    }
    out
}

/// The pairs of ranks (lower first, ascending, each once) that exchange anything in a
/// recursive-doubling all-reduce on `n` ranks: the links it needs.
pub fn pairs(n: usize) -> Vec<(usize, usize)> {
    let mut all: Vec<(usize, usize)> = (0..n)
        .flat_map(|r| {
            rounds(n, r)
                .into_iter()
                .map(move |x| (r.min(x.peer), r.max(x.peer)))
        })
        .collect();
    all.sort_unstable();
    all.dedup();
    all
}

/// Rounds of messages one after the other on the busiest rank: what sets the latency.
pub fn depth(n: usize) -> usize {
    (0..n).map(|r| rounds(n, r).len()).max().unwrap_or(0)
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
    use std::collections::VecDeque;

    /// Run every rank's rounds with a FIFO per ordered pair (sends never block, as on the links:
    /// a round's send and receive proceed together), values as expression strings combined in
    /// the order the schedule says. Returns each rank's final value, or the ranks stuck.
    fn simulate(n: usize) -> Result<Vec<String>, Vec<usize>> {
        let plans: Vec<Vec<Round>> = (0..n).map(|r| rounds(n, r)).collect();
        let mut val: Vec<String> = (0..n).map(|r| r.to_string()).collect();
        let mut next = vec![0usize; n];
        // Whether rank r has already sent in its current round.
        let mut sent = vec![false; n];
        let mut fifo: std::collections::HashMap<(usize, usize), VecDeque<String>> =
            Default::default();
        loop {
            let mut moved = false;
            for r in 0..n {
                let Some(&round) = plans[r].get(next[r]) else {
                    continue;
                };
                if round.send && !sent[r] {
                    fifo.entry((r, round.peer))
                        .or_default()
                        .push_back(val[r].clone());
                    sent[r] = true;
                    moved = true;
                }
                let got = if round.take == Take::Nothing {
                    Some(None)
                } else {
                    fifo.get_mut(&(round.peer, r))
                        .and_then(|q| q.pop_front())
                        .map(Some)
                };
                let Some(got) = got else { continue };
                if let Some(theirs) = got {
                    val[r] = match round.take {
                        Take::MineFirst => format!("({}+{theirs})", val[r]),
                        Take::TheirsFirst => format!("({theirs}+{})", val[r]),
                        Take::Replace => theirs,
                        Take::Nothing => unreachable!(),
                    };
                }
                next[r] += 1;
                sent[r] = false;
                moved = true;
            }
            if (0..n).all(|r| next[r] == plans[r].len()) {
                assert!(
                    fifo.values().all(VecDeque::is_empty),
                    "n = {n}: messages left unread"
                );
                return Ok(val);
            }
            if !moved {
                return Err((0..n).filter(|&r| next[r] < plans[r].len()).collect());
            }
        }
    }

    #[test]
    fn every_rank_ends_with_one_tree_over_all_ranks_in_order() {
        for n in 1..=33 {
            let vals = simulate(n).unwrap_or_else(|stuck| panic!("n = {n}: stuck {stuck:?}"));
            assert!(
                vals.iter().all(|v| *v == vals[0]),
                "n = {n}: ranks differ: {vals:?}"
            );
            // Every rank's input exactly once, in rank order (the tree keeps the order).
            let leaves: Vec<String> = vals[0]
                .split(['(', ')', '+'])
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect();
            let want: Vec<String> = (0..n).map(|r| r.to_string()).collect();
            assert_eq!(leaves, want, "n = {n}: {}", vals[0]);
        }
        assert_eq!(simulate(4).unwrap()[0], "((0+1)+(2+3))");
        assert_eq!(simulate(3).unwrap()[2], "((0+1)+2)");
        assert_eq!(simulate(6).unwrap()[5], "(((0+1)+(2+3))+(4+5))");
    }

    #[test]
    fn partners_agree_and_depth_is_logarithmic() {
        for n in 1..=64usize {
            for r in 0..n {
                for (i, x) in rounds(n, r).iter().enumerate() {
                    assert_ne!(x.peer, r, "n = {n}, rank {r}, round {i}");
                    assert!(x.peer < n);
                    // The peer has a round with this rank that receives what this one sends.
                    let back: Vec<Round> = rounds(n, x.peer)
                        .into_iter()
                        .filter(|y| y.peer == r)
                        .collect();
                    assert!(!back.is_empty(), "n = {n}: {r} ↔ {}", x.peer);
                    if x.send {
                        assert!(back.iter().any(|y| y.take != Take::Nothing));
                    }
                }
            }
            let log = if n < 2 { 0 } else { n.ilog2() as usize };
            let want = if n.is_power_of_two() || n < 2 {
                log
            } else {
                log + 2
            };
            assert_eq!(depth(n), want, "n = {n}");
            // Each rank talks to at most log2 n + 1 others: far fewer links than every pair.
            assert!(pairs(n).len() <= n * (log + 1) / 2 + n, "n = {n}");
        }
        assert_eq!(pairs(4), [(0, 1), (0, 2), (1, 3), (2, 3)]);
        assert_eq!(pairs(3), [(0, 1), (1, 2)]);
        assert!(pairs(1).is_empty());
    }
}
