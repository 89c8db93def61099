//! The doubling schedules. The recursive-doubling and halving-doubling all-reduces: every dtype
//! and op on world sizes with and without a fold, against the serial reference; bit-identical
//! ranks in the schedules' one tree order on values that round; the bytes they move; `auto`
//! switching at its thresholds; and ranks that chose different algorithms failing at once with
//! both calls named. The binomial
//! broadcast and reduce from every root and the dissemination barrier: the same checks, beside
//! the ring's forms of the same calls.

use std::time::{Duration, Instant};

use ringzero::{
    Algo, Collective, Collectives, DType, InPlace, NonBlocking, ReduceOp, TransportPref,
};

use crate::common::{check_case, threads, Case, Opts};

#[test]
fn every_dtype_and_op_matches_the_serial_reference() {
    // 2 and 4 ranks run the exchanges alone; 3, 5 and 6 fold ranks first. Counts: empty, one
    // element, several slices of 1 KiB (multi-frame messages).
    // Halving-doubling splits the buffer in 2, 4 or 8 parts: 1 element leaves parts empty, 777
    // does not split evenly.
    for (n, transport, algo) in [
        (2, TransportPref::Shm, Algo::Doubling),
        (3, TransportPref::Tcp, Algo::Doubling),
        (4, TransportPref::Shm, Algo::Doubling),
        (5, TransportPref::Shm, Algo::Doubling),
        (6, TransportPref::Tcp, Algo::Doubling),
        (2, TransportPref::Tcp, Algo::HalvingDoubling),
        (3, TransportPref::Shm, Algo::HalvingDoubling),
        (4, TransportPref::Tcp, Algo::HalvingDoubling),
        (6, TransportPref::Shm, Algo::HalvingDoubling),
        (8, TransportPref::Shm, Algo::HalvingDoubling),
    ] {
        let o = Opts {
            transport,
            slice_bytes: 1024,
            algo: Some(algo),
            ..Opts::default()
        };
        threads(n, &o, |_, comm| {
            let comm = comm.unwrap();
            let mut seed = 0;
            for dtype in DType::ALL {
                for op in ReduceOp::ALL {
                    for (count, in_place) in [(0, false), (1, true), (1000, false), (777, true)] {
                        seed += 1;
                        let c = Case {
                            coll: Collective::AllReduce,
                            count,
                            dtype,
                            op,
                            in_place,
                            seed,
                        };
                        check_case(&comm, &c);
                    }
                }
            }
            // Every call went by the schedule: the flight record names it.
            let rec = comm.flight_record();
            let last = rec.entries.last().unwrap();
            assert!(
                last.call.ends_with(&format!(", by {algo})")),
                "{}",
                last.call
            );
        });
    }
}

/// Rank `r`'s input: values whose sums round, so the order of the reduction shows.
fn rounding(r: usize, count: usize) -> Vec<f32> {
    (0..count)
        .map(|i| 1.0 / (3.0 + (r * 7 + i) as f32) + (r as f32) * 1e3)
        .collect()
}

#[test]
fn ranks_end_bit_identical_in_the_schedules_tree_order() {
    let count = 513;
    for (n, algo) in [
        (4, Algo::Doubling),
        (5, Algo::Doubling),
        (4, Algo::HalvingDoubling),
        (5, Algo::HalvingDoubling),
    ] {
        let o = Opts {
            algo: Some(algo),
            ..Opts::default()
        };
        let got = threads(n, &o, |r, comm| {
            let comm = comm.unwrap();
            let mut buf = rounding(r, count);
            comm.all_reduce(InPlace, &mut buf, ReduceOp::Sum).unwrap();
            buf
        });
        // The tree, written out: pairs in rank order, then pairs of pairs; on 5 ranks ranks 0
        // and 1 fold into one first.
        let x: Vec<Vec<f32>> = (0..n).map(|r| rounding(r, count)).collect();
        let want: Vec<f32> = (0..count)
            .map(|i| match n {
                4 => (x[0][i] + x[1][i]) + (x[2][i] + x[3][i]),
                _ => ((x[0][i] + x[1][i]) + x[2][i]) + (x[3][i] + x[4][i]),
            })
            .collect();
        for (r, g) in got.iter().enumerate() {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(g), bits(&want), "{algo} n = {n}, rank {r}");
        }
        // The ring's order is another: on these values it rounds differently somewhere (so the
        // comparison above is not vacuous).
        let ring: Vec<f32> = (0..count)
            .map(|i| (0..n).map(|r| x[r][i]).fold(0.0, |a, b| a + b))
            .collect();
        assert_ne!(ring, want, "n = {n}");
    }
}

#[test]
fn it_moves_the_whole_buffer_once_per_round_and_auto_switches_at_the_threshold() {
    let max = 4096;
    let o = Opts {
        algo: Some(Algo::Auto {
            doubling_max: max,
            halving_max: 0,
            pairwise_max: ringzero_collectives::config::DEFAULT_PAIRWISE_MAX,
        }),
        ..Opts::default()
    };
    threads(4, &o, |_, comm| {
        let comm = comm.unwrap();
        // Up to the threshold: 2 rounds on 4 ranks, the whole buffer out and in each.
        let mut small = vec![1f32; max / 4];
        let before = comm.counters();
        comm.all_reduce(InPlace, &mut small, ReduceOp::Sum).unwrap();
        let mid = comm.counters();
        assert_eq!(mid.bytes_sent - before.bytes_sent, 2 * max as u64);
        assert_eq!(mid.bytes_received - before.bytes_received, 2 * max as u64);
        assert_eq!(small, vec![4.0; max / 4]);
        // One element more: the ring, 2(n − 1)/n of the buffer.
        let big = vec![1f32; max / 4 + 4];
        let mut out = vec![0f32; big.len()];
        comm.all_reduce(&big, &mut out, ReduceOp::Sum).unwrap();
        let after = comm.counters();
        assert_eq!(after.bytes_sent - mid.bytes_sent, 6 * (max as u64 + 16) / 4);
        assert_eq!(out, vec![4.0; big.len()]);
        let rec = comm.flight_record();
        let calls: Vec<&str> = rec.entries.iter().map(|e| e.call.as_str()).collect();
        assert_eq!(
            calls[calls.len() - 2..],
            [
                "all_reduce(f32, sum, count=1024, by doubling)",
                "all_reduce(f32, sum, count=1028)"
            ]
        );
        // The async form chooses alike.
        let back = comm.all_reduce_async(vec![2f32; 8], ReduceOp::Avg).wait();
        assert_eq!(back.unwrap(), vec![2.0; 8]);
        let rec = comm.flight_record();
        assert!(rec.entries.last().unwrap().call.ends_with("by doubling)"));
    });
}

/// Two ranks over tcp: `auto` runs the all-reduce by doubling (one exchange of the whole
/// buffer) up to `TWO_RANK_DOUBLING_MAX`, the ring above; over shared memory two ranks keep
/// the ring. Either way the sums are the ring's bit for bit (two addends have one order).
#[test]
fn two_ranks_over_tcp_all_reduce_by_doubling_up_to_their_limit() {
    use ringzero_collectives::config::TWO_RANK_DOUBLING_MAX;
    let max = TWO_RANK_DOUBLING_MAX / 4;
    for (transport, small_by) in [
        (TransportPref::Tcp, "by doubling)"),
        (TransportPref::Shm, &format!("count={max})")[..]),
    ] {
        let o = Opts {
            transport,
            ..Opts::default()
        };
        threads(2, &o, |r, comm| {
            let comm = comm.unwrap();
            let mine = rounding(r, max + 1);
            let mut small = mine[..max].to_vec();
            let before = comm.counters();
            comm.all_reduce(InPlace, &mut small, ReduceOp::Sum).unwrap();
            let sent = comm.counters().bytes_sent - before.bytes_sent;
            let mut big = vec![0f32; max + 1];
            comm.all_reduce(&mine[..], &mut big, ReduceOp::Sum).unwrap();
            let calls: Vec<String> = comm
                .flight_record()
                .entries
                .iter()
                .map(|e| e.call.clone())
                .collect();
            let n = calls.len();
            assert!(calls[n - 2].ends_with(small_by), "{transport:?}: {calls:?}");
            assert!(
                calls[n - 1].ends_with(&format!("count={})", max + 1)),
                "{calls:?}"
            );
            // Doubling sends the whole buffer once; the ring half of it twice: the same bytes.
            assert_eq!(sent, (max * 4) as u64, "{transport:?}");
            // The same sums as the ring's (its first `max` elements).
            assert_eq!(
                small.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                big[..max].iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
        });
    }
}

#[test]
fn halving_doubling_moves_the_rings_bytes_and_auto_takes_it_between_the_thresholds() {
    let (dmax, hmax) = (1024, 16384);
    let o = Opts {
        algo: Some(Algo::Auto {
            doubling_max: dmax,
            halving_max: hmax,
            pairwise_max: ringzero_collectives::config::DEFAULT_PAIRWISE_MAX,
        }),
        ..Opts::default()
    };
    for n in [4, 5] {
        threads(n, &o, |r, comm| {
            let comm = comm.unwrap();
            let calls = |k: usize| {
                let rec = comm.flight_record();
                let all: Vec<String> = rec.entries.iter().map(|e| e.call.clone()).collect();
                all[all.len() - k..].to_vec()
            };
            // Connect the pairs' links first, so the counts below are the calls' own.
            let mut warm = vec![1f32; 2 * dmax / 4];
            comm.all_reduce(InPlace, &mut warm, ReduceOp::Sum).unwrap();
            // Above doubling_max, up to halving_max: halving-doubling. On 4 ranks every rank
            // sends and receives 2 · 3/4 of the buffer (2 rounds of halves, 2 of quarters back
            // up: the ring's bytes); on 5, ranks 0 and 1 fold first: rank 0 sends the buffer
            // once and gets it back, rank 1 carries the fold both ways on top of its share.
            let bytes = hmax as u64;
            let mut buf = vec![r as f32; hmax / 4];
            let before = comm.counters();
            comm.all_reduce(InPlace, &mut buf, ReduceOp::Sum).unwrap();
            let after = comm.counters();
            let want = (0..n).sum::<usize>() as f32;
            assert_eq!(buf, vec![want; hmax / 4]);
            let sent = after.bytes_sent - before.bytes_sent;
            let got = after.bytes_received - before.bytes_received;
            let share = bytes * 3 / 2;
            let (want_sent, want_got) = match (n, r) {
                (5, 0) => (bytes, bytes),
                (5, 1) => (share + bytes, share + bytes),
                _ => (share, share),
            };
            assert_eq!((sent, got), (want_sent, want_got), "n = {n} rank {r}");
            // Above halving_max: the ring.
            let mut big = vec![1f32; hmax / 4 + 4];
            comm.all_reduce(InPlace, &mut big, ReduceOp::Sum).unwrap();
            assert_eq!(big, vec![n as f32; hmax / 4 + 4]);
            assert_eq!(
                calls(2),
                [
                    "all_reduce(f32, sum, count=4096, by halving-doubling)",
                    "all_reduce(f32, sum, count=4100)"
                ]
            );
            // The async form chooses alike.
            let back = comm
                .all_reduce_async(vec![2f32; 1000], ReduceOp::Avg)
                .wait();
            assert_eq!(back.unwrap(), vec![2.0; 1000]);
            assert!(calls(1)[0].ends_with("by halving-doubling)"));
        });
    }
}

#[test]
fn ranks_that_choose_different_algorithms_fail_at_once_naming_both() {
    // First call (the pair links are not connected yet), then once they are; rank 2 on the
    // ring, then by halving-doubling, the others by recursive doubling.
    for (connected, other, named) in [
        (false, Algo::Ring, ""),
        (true, Algo::Ring, ""),
        (false, Algo::HalvingDoubling, ", by halving-doubling"),
        (true, Algo::HalvingDoubling, ", by halving-doubling"),
    ] {
        let t = Instant::now();
        let errs = threads(4, &Opts::default(), |r, comm| {
            // A rank that finishes a step first may fail the mismatched call and abort while a
            // slower one is still in that step (start-up or the warm-up): the slower one then
            // fails there, with the aborting rank's reason.
            let comm = match comm {
                Ok(c) => c,
                Err(e) => return e.to_string(),
            };
            if connected {
                let mut warm = [1f32; 4];
                if let Err(e) =
                    comm.with_algo(Algo::Doubling)
                        .all_reduce(InPlace, &mut warm, ReduceOp::Sum)
                {
                    return e.to_string();
                }
            }
            let algo = if r == 2 { other } else { Algo::Doubling };
            let mut b = [1f32; 16];
            let e = comm
                .with_algo(algo)
                .all_reduce(InPlace, &mut b, ReduceOp::Sum)
                .unwrap_err();
            e.to_string()
        });
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "connected={connected} {other}: must not wait for the deadline: {errs:?}"
        );
        // Rank 2 meets rank 1's announcement; rank 3 meets rank 2's first frame.
        for r in [2, 3] {
            assert!(
                errs[r].contains("all_reduce(f32, sum, count=16, by doubling)")
                    && errs[r].contains(&format!("all_reduce(f32, sum, count=16{named})")),
                "connected={connected} {other} rank {r}: {}",
                errs[r]
            );
        }
    }
}

#[test]
fn broadcast_reduce_and_barrier_match_the_reference_by_either_algorithm() {
    for (n, transport) in [
        (3, TransportPref::Tcp),
        (5, TransportPref::Shm),
        (6, TransportPref::Shm),
    ] {
        for algo in [Algo::Doubling, Algo::Ring] {
            let o = Opts {
                transport,
                slice_bytes: 1024,
                algo: Some(algo),
                ..Opts::default()
            };
            threads(n, &o, |_, comm| {
                let comm = comm.unwrap();
                let mut seed = 100;
                for root in [0, n / 2, n - 1] {
                    for dtype in DType::ALL {
                        for op in ReduceOp::ALL {
                            for (count, in_place) in
                                [(0, true), (1, false), (777, true), (1000, false)]
                            {
                                seed += 1;
                                for coll in
                                    [Collective::Broadcast { root }, Collective::Reduce { root }]
                                {
                                    if matches!(coll, Collective::Broadcast { .. })
                                        && op != ReduceOp::Sum
                                    {
                                        continue;
                                    }
                                    let c = Case {
                                        coll,
                                        count,
                                        dtype,
                                        op,
                                        in_place,
                                        seed,
                                    };
                                    check_case(&comm, &c);
                                }
                            }
                        }
                    }
                }
                comm.barrier().unwrap();
                let rec = comm.flight_record();
                let calls: Vec<&str> = rec.entries.iter().map(|e| e.call.as_str()).collect();
                let last = calls[calls.len() - 3..].to_vec();
                if algo == Algo::Doubling {
                    assert!(last[0].ends_with(", by binomial tree)"), "{last:?}");
                    assert!(last[1].ends_with(", by binomial tree)"), "{last:?}");
                    assert_eq!(last[2], "barrier(by dissemination)");
                } else {
                    assert!(last.iter().all(|c| !c.contains(" by ")), "{last:?}");
                }
            });
        }
    }
}

#[test]
fn the_binomial_reduce_combines_in_rank_order_counted_from_the_root() {
    let count = 257;
    let o = Opts {
        algo: Some(Algo::Doubling),
        ..Opts::default()
    };
    let (n, root) = (5, 2);
    let got = threads(n, &o, |r, comm| {
        let comm = comm.unwrap();
        let mut out = vec![0f32; if r == root { count } else { 0 }];
        comm.reduce(&rounding(r, count), &mut out, ReduceOp::Sum, root)
            .unwrap();
        out
    });
    // Counted from the root, ranks 2, 3, 4, 0, 1: pairs, then pairs of pairs, then the fifth.
    let x: Vec<Vec<f32>> = (0..n).map(|r| rounding(r, count)).collect();
    let want: Vec<f32> = (0..count)
        .map(|i| ((x[2][i] + x[3][i]) + (x[4][i] + x[0][i])) + x[1][i])
        .collect();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&got[root]), bits(&want));
    let ring: Vec<f32> = (0..count)
        .map(|i| (0..n).map(|r| x[r][i]).fold(0.0, |a, b| a + b))
        .collect();
    assert_ne!(ring, want, "the order shows on these values");
    assert!(got
        .iter()
        .enumerate()
        .all(|(r, g)| r == root || g.is_empty()));
}

#[test]
fn the_tree_sends_log_n_copies_from_the_root_and_auto_keeps_broadcast_on_the_chain() {
    let size = 4096;
    for algo in [Algo::Doubling, Algo::default()] {
        let o = Opts {
            algo: Some(algo),
            ..Opts::default()
        };
        threads(8, &o, |r, comm| {
            let comm = comm.unwrap();
            // Connect the tree's links first, so the counts below are the calls' own.
            let mut warm = vec![0u8; 8];
            comm.broadcast(InPlace, &mut warm, 0).unwrap();
            comm.barrier().unwrap();
            let before = comm.counters();
            let mut buf = vec![r as u8; size];
            comm.broadcast(InPlace, &mut buf, 0).unwrap();
            let after = comm.counters();
            assert_eq!(buf, vec![0u8; size]);
            let sent = after.bytes_sent - before.bytes_sent;
            let want = if algo == Algo::Doubling {
                // The root sends the buffer once in each of the 3 rounds; rank 4 passes it on
                // to 6 and 5, ranks 2 and 6 to 3 and 7; odd ranks are leaves.
                match r {
                    0 => 3 * size,
                    4 => 2 * size,
                    2 | 6 => size,
                    _ => 0,
                }
            } else {
                // The chain: once over every link but the last.
                if r == 7 {
                    0
                } else {
                    size
                }
            };
            assert_eq!(sent, want as u64, "{algo} rank {r}");
            // Barriers take 3 rounds, an empty frame each, beside the announcement's, either way.
            let f0 = comm.counters().frames_sent;
            comm.barrier().unwrap();
            assert_eq!(comm.counters().frames_sent - f0, 3 + 1, "rank {r}");
            // The async forms choose alike.
            let b = comm.broadcast_async(vec![r as u8; 16], 3).wait().unwrap();
            assert_eq!(b, vec![3u8; 16]);
            comm.barrier_async().wait().unwrap();
            let rec = comm.flight_record();
            let calls: Vec<&str> = rec.entries.iter().map(|e| e.call.as_str()).collect();
            let tree = if algo == Algo::Doubling {
                ", by binomial tree"
            } else {
                ""
            };
            assert_eq!(
                calls[calls.len() - 4..],
                [
                    format!("broadcast(u8, count=4096, root=0{tree})"),
                    "barrier(by dissemination)".into(),
                    format!("broadcast(u8, count=16, root=3{tree})"),
                    "barrier(by dissemination)".into(),
                ]
            );
        });
    }
}

#[test]
fn no_rank_leaves_the_dissemination_barrier_before_the_last_one_entered() {
    let o = Opts {
        algo: Some(Algo::Doubling),
        ..Opts::default()
    };
    for n in [3, 5, 7] {
        let start = Instant::now();
        let times = threads(n, &o, |r, comm| {
            let comm = comm.unwrap();
            // Connect first; then enter one after another, 40 ms apart, the last rank last.
            comm.barrier().unwrap();
            std::thread::sleep(Duration::from_millis(40 * r as u64));
            let entered = start.elapsed();
            comm.barrier().unwrap();
            (entered, start.elapsed())
        });
        let last_in = times.iter().map(|t| t.0).max().unwrap();
        for (r, (_, out)) in times.iter().enumerate() {
            assert!(
                *out >= last_in,
                "n = {n}: rank {r} left at {out:?}, before {last_in:?}"
            );
        }
    }
}

#[test]
fn a_barrier_by_another_algorithm_fails_at_once_naming_both() {
    for connected in [false, true] {
        let t = Instant::now();
        let errs = threads(5, &Opts::default(), |r, comm| {
            let comm = comm.unwrap();
            if connected {
                comm.with_algo(Algo::Doubling).barrier().unwrap();
            }
            let algo = if r == 3 { Algo::Ring } else { Algo::Doubling };
            comm.with_algo(algo).barrier().unwrap_err().to_string()
        });
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "connected={connected}: must not wait for the deadline: {errs:?}"
        );
        for r in [3, 4] {
            assert!(
                errs[r].contains("barrier(by dissemination)") && errs[r].contains("barrier()"),
                "connected={connected} rank {r}: {}",
                errs[r]
            );
        }
    }
}

#[test]
fn a_rank_that_leaves_mid_call_fails_the_others_at_once_naming_it() {
    // Rank 3 drops its communicator (its thread lives on, as a rank whose process goes on
    // would) while the others call an all-reduce: they fail at once, not at the deadline, over
    // the ring's links and the pairs' alike.
    for (algo, named) in [
        (Algo::HalvingDoubling, ", by halving-doubling"),
        (Algo::Ring, ""),
    ] {
        for transport in [TransportPref::Shm, TransportPref::Tcp] {
            let o = Opts {
                transport,
                algo: Some(algo),
                ..Opts::default()
            };
            let t = Instant::now();
            let errs = threads(4, &o, |r, comm| {
                let comm = comm.unwrap();
                // One call first, so every link is up and rank 3 leaves mid-collective.
                let mut warm = vec![1f32; 1000];
                comm.all_reduce(InPlace, &mut warm, ReduceOp::Sum).unwrap();
                assert_eq!(warm, vec![4.0; 1000]);
                if r == 3 {
                    drop(comm);
                    return String::new();
                }
                let mut b = vec![1f32; 100_000];
                let e = comm.all_reduce(InPlace, &mut b, ReduceOp::Sum).unwrap_err();
                e.to_string()
            });
            let what = format!("{algo} over {transport:?}");
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "{what}: must not wait for the deadline: {errs:?}"
            );
            let call = format!("all_reduce(f32, sum, count=100000{named}) seq 2");
            for (r, e) in errs.iter().take(3).enumerate() {
                assert!(e.contains(&call), "{what} rank {r}: {e}");
            }
            // Rank 3's ring successor (rank 0) waits on it in either algorithm.
            assert!(errs[0].contains("rank 3"), "{what}: {}", errs[0]);
        }
    }
}

#[test]
fn broadcast_and_reduce_take_the_algorithm_one_call_names() {
    let n = 5;
    let o = Opts {
        algo: Some(Algo::Ring),
        ..Opts::default()
    };
    let errs = threads(n, &o, |r, comm| {
        let comm = comm.unwrap();
        let last = || comm.flight_record().entries.last().unwrap().call.clone();
        let data: Vec<i32> = (0..100).map(|i| i * (r as i32 + 1)).collect();
        let mut out = vec![0i32; 100];
        comm.with_algo(Algo::Doubling)
            .broadcast(&data, &mut out, 2)
            .unwrap();
        assert_eq!(out, (0..100).map(|i| i * 3).collect::<Vec<_>>());
        assert_eq!(
            last(),
            "broadcast(i32, count=100, root=2, by binomial tree)"
        );
        let mut buf = data.clone();
        comm.with_algo(Algo::Doubling)
            .broadcast(InPlace, &mut buf, 4)
            .unwrap();
        assert_eq!(buf, (0..100).map(|i| i * 5).collect::<Vec<_>>());
        let mut sum = vec![0i32; if r == 1 { 100 } else { 0 }];
        comm.with_algo(Algo::Doubling)
            .reduce(&data, &mut sum, ReduceOp::Sum, 1)
            .unwrap();
        if r == 1 {
            assert_eq!(sum, (0..100).map(|i| i * 15).collect::<Vec<_>>());
        }
        assert_eq!(
            last(),
            "reduce(i32, sum, count=100, root=1, by binomial tree)"
        );
        let mut buf = data.clone();
        comm.with_algo(Algo::Doubling)
            .reduce(InPlace, &mut buf, ReduceOp::Max, 0)
            .unwrap();
        let want = if r == 0 {
            (0..100).map(|i| i * 5).collect()
        } else {
            data.clone()
        };
        assert_eq!(buf, want, "rank {r}: only the root's buffer changes");
        // The configured algorithm otherwise.
        comm.broadcast(&data, &mut out, 0).unwrap();
        assert_eq!(last(), "broadcast(i32, count=100, root=0)");
        // A rank that picks otherwise fails at once, both calls named (ranks whose part of the
        // tree never meets it may finish: a failure reaches them at their next call).
        let algo = if r == 3 { Algo::Ring } else { Algo::Doubling };
        let e = comm.with_algo(algo).broadcast(&data, &mut out, 0);
        e.err().map(|e| e.to_string()).unwrap_or_default()
    });
    assert!(
        errs[3].contains("broadcast(i32, count=100, root=0, by binomial tree)")
            && errs[3].contains("broadcast(i32, count=100, root=0)"),
        "{}",
        errs[3]
    );
}
