//! The schedule checked by simulation, with no IO: every rank runs its plan against bounded FIFO
//! links in an arbitrary interleaving; we check it never deadlocks, that every element is reduced
//! exactly once per rank (and finalized once), that every rank ends with the right data, and that
//! bytes per link match the ring's theory.

use super::*;
use proptest::prelude::*;
use std::collections::VecDeque;

/// A symbolic value: how many times each rank's input went into it, whether it was finalized,
/// and (the all-to-all, whose inputs are told apart by position) which element of its sender's
/// input it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Val {
    from: [u8; 8],
    finals: u8,
    at: u32,
}

const GARBAGE: Val = Val {
    from: [99; 8],
    finals: 0,
    at: u32::MAX,
};

fn unit(r: usize) -> Val {
    let mut from = [0; 8];
    from[r] = 1;
    Val {
        from,
        finals: 0,
        at: 0,
    }
}

/// Element `i` of rank `r`'s input: [`unit`], told apart by position where the collective moves
/// elements between positions.
fn seed(coll: Collective, r: usize, i: usize) -> Val {
    let at = if coll == Collective::AllToAll { i } else { 0 };
    Val {
        at: at as u32,
        ..unit(r)
    }
}

fn combine(a: Val, b: Val) -> Val {
    let from = std::array::from_fn(|i| a.from[i] + b.from[i]);
    Val {
        from,
        finals: a.finals + b.finals,
        // Values of different positions never meet in a reduction.
        at: if a.at == b.at { a.at } else { u32::MAX },
    }
}

struct Frame {
    step: u32,
    slice: u32,
    vals: Vec<Val>,
}

struct Sim {
    out: Vec<Vec<Val>>,
    input: Vec<Vec<Val>>,
    sent_elems: Vec<usize>,
}

/// Run all ranks' plans with `depth` slots per link, choosing which rank moves next from `order`.
fn simulate(
    coll: Collective,
    n: usize,
    count: usize,
    se: usize,
    in_place: bool,
    depth: usize,
    order: &[usize],
) -> Sim {
    simulate_with(coll, n, (count, None), se, in_place, depth, order)
}

/// [`simulate`] with the chunks at `counts` where they are given (the v-variants).
fn simulate_with(
    coll: Collective,
    n: usize,
    (count, counts): (usize, Option<&[usize]>),
    se: usize,
    in_place: bool,
    depth: usize,
    order: &[usize],
) -> Sim {
    let plans: Vec<Plan> = (0..n)
        .map(|rank| {
            plan(PlanArgs {
                coll,
                n,
                rank,
                count,
                slice_elems: se,
                in_place,
                counts,
            })
        })
        .collect();
    let mut input: Vec<Vec<Val>> = Vec::new();
    let mut out: Vec<Vec<Val>> = Vec::new();
    for (r, p) in plans.iter().enumerate() {
        let inp: Vec<Val> = (0..p.input_len)
            .map(|i| seed(coll, r, p.input_base + i))
            .collect();
        if in_place {
            // The one buffer: the input region holds this rank's data, the rest is garbage.
            let mut buf = vec![GARBAGE; p.output_len];
            for i in 0..p.input_len {
                let g = p.input_base + i;
                let own = match counts {
                    Some(c) => c[..r].iter().sum::<usize>()..c[..=r].iter().sum(),
                    None => chunk(count, n, r),
                };
                if matches!(coll, Collective::AllGather | Collective::AllGatherV)
                    && !own.contains(&g)
                {
                    continue;
                }
                buf[g - p.output_base] = unit(r);
            }
            out.push(buf);
        } else {
            out.push(vec![GARBAGE; p.output_len]);
        }
        input.push(inp);
    }
    let mut links: Vec<VecDeque<Frame>> = (0..n).map(|_| VecDeque::new()).collect(); // link r: r → r+1
    let mut pc = vec![0usize; n];
    let mut sent = vec![0usize; n];
    let mut t = 0;
    while (0..n).any(|r| pc[r] < plans[r].ops.len()) {
        // `order` picks who tries first; the others are tried in turn, so a real deadlock is the
        // only way for no rank to move.
        let first = order[t % order.len()];
        t += 1;
        let moved = (0..n).map(|i| (first + i) % n).any(|r| {
            step_rank(
                r, n, &plans[r], &mut pc[r], &mut links, depth, &mut input, &mut out, &mut sent,
                in_place,
            )
        });
        assert!(
            moved,
            "deadlock: pcs {pc:?} of {:?}",
            plans.iter().map(|p| p.ops.len()).collect::<Vec<_>>()
        );
    }
    assert!(links.iter().all(|l| l.is_empty()), "frames left on links");
    Sim {
        out,
        input,
        sent_elems: sent,
    }
}

#[allow(clippy::too_many_arguments)]
fn step_rank(
    r: usize,
    n: usize,
    p: &Plan,
    pc: &mut usize,
    links: &mut [VecDeque<Frame>],
    depth: usize,
    input: &mut [Vec<Val>],
    out: &mut [Vec<Val>],
    sent: &mut [usize],
    in_place: bool,
) -> bool {
    let Some(op) = p.ops.get(*pc) else {
        return false;
    };
    let prev = (r + n - 1) % n;
    if op.recv && links[prev].is_empty() {
        return false;
    }
    if op.send && links[r].len() >= depth {
        return false;
    }
    let read = |loc: &Loc, input: &[Vec<Val>], out: &[Vec<Val>]| -> Vec<Val> {
        let (buf, base) = match (loc.buf, in_place) {
            (Buf::Input, false) => (&input[r], p.input_base),
            _ => (&out[r], p.output_base),
        };
        loc.range.clone().map(|g| buf[g - base]).collect()
    };
    let incoming = if op.recv {
        let f = links[prev].pop_front().unwrap();
        assert_eq!(
            (f.step + 1, f.slice, f.vals.len()),
            (op.step, op.slice, op.elems),
            "rank {r} frame order"
        );
        Some(f.vals)
    } else {
        None
    };
    let local = op.local.as_ref().map(|l| read(l, input, out));
    let mut value = match (incoming, local) {
        (Some(a), Some(b)) => a.into_iter().zip(b).map(|(x, y)| combine(x, y)).collect(),
        (Some(a), None) | (None, Some(a)) => a,
        (None, None) => panic!("op with no source"),
    };
    assert_eq!(value.len(), op.elems);
    if op.finalize {
        value.iter_mut().for_each(|v| v.finals += 1);
    }
    if let Some(st) = &op.store {
        let (buf, base) = match (st.buf, in_place) {
            (Buf::Input, false) => panic!("stores go to the output"),
            _ => (&mut out[r], p.output_base),
        };
        for (g, v) in st.range.clone().zip(&value) {
            buf[g - base] = *v;
        }
    }
    if op.send {
        sent[r] += value.len();
        links[r].push_back(Frame {
            step: op.step,
            slice: op.slice,
            vals: value,
        });
    }
    *pc += 1;
    true
}

fn all_ones(n: usize) -> Val {
    let mut from = [0; 8];
    from[..n].iter_mut().for_each(|x| *x = 1);
    // A one-rank world has nothing to divide by.
    Val {
        from,
        finals: u8::from(n > 1),
        at: 0,
    }
}

fn check(coll: Collective, n: usize, count: usize, se: usize, in_place: bool, order: &[usize]) {
    let sim = simulate(coll, n, count, se, in_place, 2, order);
    let len = |c: usize| chunk(count, n, c).len();
    for r in 0..n {
        let own = chunk(count, n, r);
        let out = &sim.out[r];
        match coll {
            Collective::AllReduce => {
                assert!(out.iter().all(|v| *v == all_ones(n)), "rank {r}: {out:?}")
            }
            Collective::ReduceScatter => {
                let region: Vec<Val> = if in_place {
                    out[own.clone()].to_vec()
                } else {
                    out.clone()
                };
                assert_eq!(region.len(), own.len());
                assert!(
                    region.iter().all(|v| *v == all_ones(n)),
                    "rank {r}: {region:?}"
                );
            }
            Collective::AllGather => {
                for c in 0..n {
                    let want = unit(c);
                    assert!(
                        out[chunk(count, n, c)].iter().all(|v| *v == want),
                        "rank {r} chunk {c}: {out:?}"
                    );
                }
            }
            Collective::Broadcast { root } => {
                assert!(out.iter().all(|v| *v == unit(root)), "rank {r}: {out:?}")
            }
            Collective::Reduce { root } => {
                if r == root {
                    assert!(out.iter().all(|v| *v == all_ones(n)), "root {r}: {out:?}");
                }
            }
            Collective::Barrier => assert!(out.is_empty()),
            Collective::RingShift => {
                let want = unit((r + n - 1) % n);
                assert!(out.iter().all(|v| *v == want), "rank {r}: {out:?}");
            }
            // Block q holds rank q's block r, in order.
            Collective::AllToAll => {
                let b = count / n;
                for (i, v) in out.iter().enumerate() {
                    let (q, e) = (i / b, i % b);
                    assert_eq!(*v, seed(coll, q, r * b + e), "rank {r} element {i}");
                }
            }
            other => unreachable!("{other} is not a ring collective ([`collectives`] lists them)"),
        }
        if !in_place {
            assert!(
                (0..sim.input[r].len()).all(|i| sim.input[r][i] == seed(coll, r, i)),
                "rank {r} input modified"
            );
        }
        // Bytes per link: the ring's theory.
        let want = match coll {
            Collective::ReduceScatter => count - len(r),
            Collective::AllGather => count - len((r + 1) % n),
            Collective::AllReduce => 2 * count - len(r) - len((r + 1) % n),
            Collective::Broadcast { root } => {
                if (r + 1) % n == root {
                    0
                } else {
                    count
                }
            }
            Collective::Reduce { root } => {
                if r == root {
                    0
                } else {
                    count
                }
            }
            Collective::Barrier => 0,
            Collective::RingShift => count,
            // Each block goes its distance, 1 to n − 1 hops: n(n−1)/2 blocks per link.
            Collective::AllToAll => (n - 1) * count / 2,
            other => unreachable!("{other} is not a ring collective ([`collectives`] lists them)"),
        };
        assert_eq!(
            sim.sent_elems[r],
            if n == 1 { 0 } else { want },
            "rank {r} elements sent"
        );
    }
    if n > 1 && count.is_multiple_of(n) {
        let total: usize = sim.sent_elems.iter().sum();
        let per = match coll {
            Collective::ReduceScatter | Collective::AllGather => (n - 1) * count / n,
            Collective::AllReduce => 2 * (n - 1) * count / n,
            _ => total / n,
        };
        assert!(
            sim.sent_elems.iter().all(|&s| s == per) || coll.root().is_some(),
            "{:?} vs (n−1)/n·S",
            sim.sent_elems
        );
    }
}

fn collectives(n: usize, root: usize) -> Vec<Collective> {
    let root = root % n;
    vec![
        Collective::AllReduce,
        Collective::ReduceScatter,
        Collective::AllGather,
        Collective::Broadcast { root },
        Collective::Reduce { root },
        Collective::Barrier,
        Collective::RingShift,
        Collective::AllToAll,
    ]
}

/// The (count, in place) `coll` is planned with for a case of `count`: a barrier moves nothing;
/// an all-to-all runs out of place on whole blocks.
fn fit(coll: Collective, n: usize, count: usize, in_place: bool) -> (usize, bool) {
    match coll {
        Collective::Barrier => (0, in_place),
        Collective::AllToAll => (count - count % n, false),
        _ => (count, in_place),
    }
}

#[test]
fn every_collective_small_cases_round_robin() {
    for n in 1..=8 {
        for count in [0, 1, 2, 3, 7, 8, 13, 64, 97] {
            for se in [1, 3, 1000] {
                for in_place in [false, true] {
                    for coll in collectives(n, n / 2) {
                        let (count, in_place) = fit(coll, n, count, in_place);
                        check(coll, n, count, se, in_place, &(0..n).collect::<Vec<_>>());
                    }
                }
            }
        }
    }
}

#[test]
fn one_slot_per_link_can_deadlock_two_cannot() {
    // Documents why the transports insist on at least two slots per link.
    let r = std::panic::catch_unwind(|| {
        simulate(Collective::AllReduce, 3, 30, 10, false, 1, &[0, 1, 2])
    });
    assert!(r.is_err(), "depth 1 should deadlock a 3-rank all-reduce");
    simulate(Collective::AllReduce, 3, 30, 10, false, 2, &[0, 1, 2]);
}

#[test]
fn split_is_balanced_and_covers() {
    for len in 0..40 {
        for parts in 1..9 {
            let mut next = 5;
            for i in 0..parts {
                let s = split(5..5 + len, parts, i);
                assert_eq!(s.start, next);
                assert!(s.len() == len / parts || s.len() == len / parts + 1);
                next = s.end;
            }
            assert_eq!(next, 5 + len);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
    #[test]
    fn any_interleaving_completes_correctly(
        n in 1usize..=8,
        count in prop_oneof![0usize..20, 20usize..400],
        se in 1usize..50,
        in_place: bool,
        root in 0usize..8,
        which in 0usize..8,
        order in proptest::collection::vec(0usize..8, 1..40),
    ) {
        let coll = collectives(n, root)[which];
        let (count, in_place) = fit(coll, n, count, in_place);
        check(coll, n, count, se, in_place, &order);
    }
}

/// One point-to-point call of a rank with its peer: elements it sends, elements it receives.
type P2pCall = (Option<usize>, Option<usize>);

/// Two ranks run their point-to-point calls in program order, each call's plan the way the
/// engine's unordered runner does (each direction's ops in order, either direction whenever it
/// can go), over one link each way of `depth` slots, `order` choosing who tries first. Every
/// element carries (sender, message, position); returns what each rank received, per message.
#[allow(clippy::type_complexity)]
fn simulate_p2p(
    calls: [&[P2pCall]; 2],
    se: usize,
    depth: usize,
    order: &[usize],
) -> [Vec<Vec<(usize, usize, usize)>>; 2] {
    struct Rank {
        call: usize,
        sends: usize,
        recvs: usize,
        sent_msgs: usize,
        /// The current call's receive buffer is in `got`.
        opened: bool,
        got: Vec<Vec<(usize, usize, usize)>>,
    }
    let plans: [Vec<Plan>; 2] = calls.map(|c| c.iter().map(|&(s, r)| plan_p2p(s, r, se)).collect());
    let mut ranks: Vec<Rank> = (0..2)
        .map(|_| Rank {
            call: 0,
            sends: 0,
            recvs: 0,
            sent_msgs: 0,
            opened: false,
            got: Vec::new(),
        })
        .collect();
    // links[r]: r → 1 − r; a frame is (step, slice, values).
    let mut links: [VecDeque<(u32, u32, Vec<(usize, usize, usize)>)>; 2] = Default::default();
    let mut t = 0;
    let step = |r: usize,
                ranks: &mut Vec<Rank>,
                links: &mut [VecDeque<(u32, u32, Vec<(usize, usize, usize)>)>; 2]|
     -> bool {
        let me = &mut ranks[r];
        let Some(p) = plans[r].get(me.call) else {
            return false;
        };
        let send_ops: Vec<&Op> = p.ops.iter().filter(|o| o.send).collect();
        let recv_ops: Vec<&Op> = p.ops.iter().filter(|o| o.recv).collect();
        if !me.opened && !recv_ops.is_empty() {
            me.got.push(vec![(usize::MAX, 0, 0); p.output_len]);
            me.opened = true;
        }
        let mut moved = false;
        if let Some(op) = send_ops.get(me.sends) {
            if links[r].len() < depth {
                assert!(!op.recv && op.store.is_none(), "a sending op only sends");
                let l = op.local.as_ref().expect("a send reads its input");
                assert_eq!(l.buf, Buf::Input);
                let vals = l.range.clone().map(|g| (r, me.sent_msgs, g)).collect();
                links[r].push_back((op.step, op.slice, vals));
                me.sends += 1;
                moved = true;
            }
        }
        if let Some(op) = recv_ops.get(me.recvs) {
            if let Some((step, slice, vals)) = links[1 - r].pop_front() {
                assert_eq!(
                    (step + 1, slice, vals.len()),
                    (op.step, op.slice, op.elems),
                    "rank {r}: the frame is the one its op expects"
                );
                let st = op.store.as_ref().expect("a receive stores");
                let out = me.got.last_mut().unwrap();
                for (g, v) in st.range.clone().zip(vals) {
                    assert_eq!(
                        out[g],
                        (usize::MAX, 0, 0),
                        "rank {r}: element {g} stored twice"
                    );
                    out[g] = v;
                }
                me.recvs += 1;
                moved = true;
            }
        }
        if me.sends == send_ops.len() && me.recvs == recv_ops.len() {
            me.sent_msgs += usize::from(!send_ops.is_empty());
            me.call += 1;
            me.sends = 0;
            me.recvs = 0;
            me.opened = false;
            moved = true;
        }
        moved
    };
    while (0..2).any(|r| ranks[r].call < plans[r].len()) {
        let first = order[t % order.len()] % 2;
        t += 1;
        let moved = [first, 1 - first]
            .into_iter()
            .any(|r| step(r, &mut ranks, &mut links));
        assert!(
            moved,
            "deadlock: calls {:?}",
            ranks.iter().map(|r| r.call).collect::<Vec<_>>()
        );
    }
    assert!(links.iter().all(|l| l.is_empty()), "frames left on links");
    let [a, b]: [Rank; 2] = ranks.try_into().ok().unwrap();
    [a.got, b.got]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
    #[test]
    fn point_to_point_plans_agree_and_exchanges_never_wait_on_themselves(
        a in prop_oneof![0usize..5, 5usize..300],
        b in prop_oneof![0usize..5, 5usize..300],
        se in 1usize..50,
        depth in 1usize..4,
        shape in 0usize..4,
        order in proptest::collection::vec(0usize..2, 1..20),
    ) {
        // Rank 0 sends `a` elements, rank 1 sends `b`.
        let (r0, r1): (Vec<P2pCall>, Vec<P2pCall>) = match shape {
            0 => (vec![(Some(a), Some(b))], vec![(Some(b), Some(a))]),
            1 => (vec![(Some(a), Some(b))], vec![(None, Some(a)), (Some(b), None)]),
            2 => (vec![(Some(a), Some(b))], vec![(Some(b), None), (None, Some(a))]),
            // Two messages one way arrive in order.
            _ => (vec![(Some(a), None), (Some(b), None)], vec![(None, Some(a)), (None, Some(b))]),
        };
        let [got0, got1] = simulate_p2p([&r0, &r1], se, depth, &order);
        let msg = |from: usize, m: usize, len: usize| -> Vec<(usize, usize, usize)> {
            (0..len).map(|g| (from, m, g)).collect()
        };
        if shape == 3 {
            prop_assert!(got0.is_empty());
            prop_assert_eq!(got1, vec![msg(0, 0, a), msg(0, 1, b)]);
        } else {
            prop_assert_eq!(got0, vec![msg(1, 0, b)]);
            prop_assert_eq!(got1, vec![msg(0, 0, a)]);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
    /// The v-collectives, parts of any size (empty ones included). Reduce-scatter-v: each part
    /// is reduced exactly once per rank and ends on its owner, the rest of an in-place buffer
    /// untouched; each rank sends every part but its own. All-gather-v: every rank ends with
    /// every part where its counts put it; each rank sends every part but the next rank's. As
    /// the balanced forms do.
    #[test]
    fn v_collectives_handle_parts_of_any_size(
        counts in proptest::collection::vec(prop_oneof![Just(0usize), 0usize..60], 1..=8),
        gather: bool,
        se in 1usize..40,
        in_place: bool,
        order in proptest::collection::vec(0usize..8, 1..40),
    ) {
        let n = counts.len();
        let count: usize = counts.iter().sum();
        let at: Vec<usize> = std::iter::once(0)
            .chain(counts.iter().scan(0, |a, &k| { *a += k; Some(*a) }))
            .collect();
        let coll = if gather { Collective::AllGatherV } else { Collective::ReduceScatterV };
        let sim = simulate_with(coll, n, (count, Some(&counts)), se, in_place, 2, &order);
        let owner = |g: usize| (0..n).find(|&q| at[q + 1] > g).unwrap();
        for r in 0..n {
            let own = at[r]..at[r + 1];
            let out = &sim.out[r];
            if gather {
                prop_assert_eq!(out.len(), count);
                for (g, v) in out.iter().enumerate() {
                    prop_assert_eq!(*v, unit(owner(g)), "rank {} element {}", r, g);
                }
            } else if in_place {
                prop_assert_eq!(out.len(), count);
                for (g, v) in out.iter().enumerate() {
                    let want = if own.contains(&g) { all_ones(n) } else { unit(r) };
                    prop_assert_eq!(*v, want, "rank {} element {}", r, g);
                }
            } else {
                prop_assert_eq!(out.len(), own.len());
                prop_assert!(out.iter().all(|v| *v == all_ones(n)), "rank {}: {:?}", r, out);
            }
            let kept = if gather { counts[(r + 1) % n] } else { counts[r] };
            let want = if n == 1 { 0 } else { count - kept };
            prop_assert_eq!(sim.sent_elems[r], want, "rank {} elements sent", r);
        }
    }
}

#[test]
#[should_panic(expected = "counts add up to 5 of 6")]
fn counts_that_do_not_add_up_are_a_caller_bug() {
    plan(PlanArgs {
        coll: Collective::ReduceScatterV,
        n: 2,
        rank: 0,
        count: 6,
        slice_elems: 4,
        in_place: false,
        counts: Some(&[2, 3]),
    });
}
