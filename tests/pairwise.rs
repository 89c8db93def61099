//! The pairwise collectives (all-to-all-v, all-gather-v, gather, scatter) on thread ranks, beyond
//! the reference checks every collective gets in `threads` and `processes`: interleaving with
//! ring collectives and point-to-point messages on the same links, bad arguments, counts the
//! ranks disagree on, and their flight-record entries.

use std::time::{Duration, Instant};

use ringzero::{Algo, Collectives, Error, InPlace, P2p, ReduceOp, TransportPref};

use crate::common::{threads, Opts};

/// Value `i` of what rank `src` sends rank `dst` in call `k` (exact in f32).
fn val(src: usize, dst: usize, k: usize, i: usize) -> f32 {
    ((i * 13 + src * 101 + dst * 7 + k * 3) % 4093) as f32
}

/// Elements from `src` to `dst` in call `k`: uneven, often zero, sometimes many slices.
fn cnt(src: usize, dst: usize, k: usize) -> usize {
    match (src * 5 + dst * 3 + k) % 5 {
        0 => 0,
        1 => 1,
        2 => 700,
        3 => 5000,
        _ => 33,
    }
}

#[test]
fn uneven_all_to_all_v_mixes_with_ring_collectives_and_messages_over_shm_and_tcp() {
    let n = 4;
    for transport in [TransportPref::Shm, TransportPref::Tcp] {
        let o = Opts {
            transport,
            ..Opts::default()
        };
        threads(n, &o, |r, comm| {
            let comm = comm.unwrap();
            let next = (r + 1) % n;
            let prev = (r + n - 1) % n;
            // Connect the point-to-point links around the ring (a pair's first call is a
            // rendezvous).
            let mut b = [0f32; 1];
            comm.send_recv_batch(&mut [P2p::Send(&[r as f32], next), P2p::Recv(&mut b, prev)])
                .unwrap();
            assert_eq!(b, [prev as f32]);
            for k in 0..3 {
                if k == 1 {
                    // A message left in the link to the next rank, received after the
                    // collectives: they never wait behind it (their links are their own).
                    comm.send(&[r as f32; 5], next).unwrap();
                }
                let sends: Vec<usize> = (0..n).map(|j| cnt(r, j, k)).collect();
                let recvs: Vec<usize> = (0..n).map(|q| cnt(q, r, k)).collect();
                let send: Vec<f32> = (0..n)
                    .flat_map(|j| (0..sends[j]).map(move |i| val(r, j, k, i)))
                    .collect();
                let mut recv = vec![-1f32; recvs.iter().sum()];
                comm.all_to_all_v(&send, &sends, &mut recv, &recvs).unwrap();
                let want: Vec<f32> = (0..n)
                    .flat_map(|q| (0..recvs[q]).map(move |i| val(q, r, k, i)))
                    .collect();
                assert_eq!(recv, want, "{transport:?} rank {r} call {k}");
                // A ring collective between pairwise ones keeps the sequence numbers in step.
                let mut x = [1f64; 3];
                comm.all_reduce(InPlace, &mut x, ReduceOp::Sum).unwrap();
                assert_eq!(x, [n as f64; 3]);
            }
            let mut got = [0f32; 5];
            comm.recv(&mut got, prev).unwrap();
            assert_eq!(got, [prev as f32; 5]);
            // All-gather-v with one rank contributing nothing, then gather and scatter at rank 2.
            let counts = [3, 0, 4100, 1];
            let mine: Vec<i64> = (0..counts[r]).map(|i| (r * 10_000 + i) as i64).collect();
            let mut all = vec![-1i64; counts.iter().sum()];
            comm.all_gather_v(&mine, &mut all, &counts).unwrap();
            let want: Vec<i64> = (0..n)
                .flat_map(|q| (0..counts[q]).map(move |i| (q * 10_000 + i) as i64))
                .collect();
            assert_eq!(all, want, "{transport:?} rank {r} all_gather_v");
            let mut at_root = vec![0u8; if r == 2 { 4 * 3000 } else { 0 }];
            comm.gather(&vec![r as u8 + 1; 3000], &mut at_root, 2)
                .unwrap();
            if r == 2 {
                for q in 0..n {
                    assert!(at_root[q * 3000..(q + 1) * 3000]
                        .iter()
                        .all(|&b| b == q as u8 + 1));
                }
            }
            let blocks: Vec<u8> = if r == 2 {
                (0..4 * 3000).map(|i| (i / 3000) as u8 + 7).collect()
            } else {
                Vec::new()
            };
            let mut mine = vec![0u8; 3000];
            comm.scatter(&blocks, &mut mine, 2).unwrap();
            assert!(mine.iter().all(|&b| b == r as u8 + 7), "rank {r} scatter");
            // Every rank recorded the same calls under the same numbers.
            let calls: Vec<(u64, String)> = comm
                .flight_record()
                .entries
                .iter()
                .map(|e| (e.seq, e.call.clone()))
                .collect();
            calls
        })
        .windows(2)
        .for_each(|w| assert_eq!(w[0], w[1], "flight records differ between ranks"));
    }
}

#[test]
fn the_flight_record_names_the_pairwise_calls_as_every_rank_made_them() {
    let calls = threads(3, &Opts::default(), |r, comm| {
        let comm = comm.unwrap();
        let counts = [r, 1, 2];
        let send = vec![1f32; 3 + r];
        let recv_counts = [0, 1, 2].map(|q| [q, 1, 2][r]);
        let mut recv = vec![0f32; recv_counts.iter().sum()];
        comm.all_to_all_v(&send, &counts, &mut recv, &recv_counts)
            .unwrap();
        let mut all = vec![0i32; 6];
        comm.all_gather_v(&vec![1i32; [1, 2, 3][r]], &mut all, &[1, 2, 3])
            .unwrap();
        let mut g = vec![0f64; if r == 1 { 6 } else { 0 }];
        comm.gather(&[1.0, 2.0], &mut g, 1).unwrap();
        comm.flight_record()
            .entries
            .iter()
            .map(|e| e.call.clone())
            .collect::<Vec<_>>()
    });
    // Seq 0 is the start-up all-gather.
    assert_eq!(
        calls[0][1..],
        [
            "all_to_all_v(f32)",
            "all_gather_v(i32, count=6)",
            "gather(f64, count=2, root=1)"
        ]
    );
    assert!(calls.windows(2).all(|w| w[0] == w[1]), "{calls:?}");
}

#[test]
fn bad_arguments_are_refused_and_change_nothing() {
    threads(3, &Opts::default(), |r, comm| {
        let comm = comm.unwrap();
        let mut recv = vec![-1f32; 6];
        let refused = |e: Error, has: &str| {
            assert!(
                matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains(has),
                "rank {r}: {e} (wanted `{has}`)"
            );
        };
        let send = [1f32; 6];
        refused(
            comm.all_to_all_v(&send, &[2, 2], &mut recv, &[2, 2, 2])
                .unwrap_err(),
            "send_counts has 2 entries but the communicator has 3 ranks",
        );
        refused(
            comm.all_to_all_v(&send, &[2, 2, 2], &mut recv, &[2, 2, 3])
                .unwrap_err(),
            "recv_counts add up to 7 elements but recv has 6",
        );
        let own = if r == 0 { [1, 2, 3] } else { [2, 2, 2] };
        if r == 0 {
            refused(
                comm.all_to_all_v(&send, &own, &mut recv, &[2, 2, 2])
                    .unwrap_err(),
                "send_counts[0] is 1 but recv_counts[0] is 2",
            );
        }
        refused(
            comm.all_gather_v(&send[..r + 2], &mut recv, &[1, 2, 3])
                .unwrap_err(),
            &format!(
                "send has {} elements but counts[{r}] (this rank's part) is {}",
                r + 2,
                r + 1
            ),
        );
        refused(
            comm.all_gather_v(InPlace, &mut recv, &[1, 2, 2])
                .unwrap_err(),
            "counts add up to 5 elements but recv has 6",
        );
        refused(
            comm.gather(&send[..2], &mut recv, 3).unwrap_err(),
            "root 3 is not a rank of this 3-rank communicator",
        );
        if r == 1 {
            refused(
                comm.gather(&send[..2], &mut recv[..5], 1).unwrap_err(),
                "recv has 5 elements but the root gathers 3 × 2",
            );
            refused(
                comm.scatter(&send[..5], &mut recv[..2], 1).unwrap_err(),
                "send has 5 elements but the root scatters 3 × 2",
            );
        }
        assert!(
            recv.iter().all(|&x| x == -1.0),
            "rank {r}: a refused call wrote"
        );
        // Nothing was numbered: the ranks are still in step.
        let counts = [2, 2, 2];
        let send: Vec<f32> = (0..6).map(|i| (r * 6 + i) as f32).collect();
        comm.all_to_all_v(&send, &counts, &mut recv, &counts)
            .unwrap();
        let want: Vec<f32> = (0..3)
            .flat_map(|q| (0..2).map(move |i| (q * 6 + r * 2 + i) as f32))
            .collect();
        assert_eq!(recv, want, "rank {r}");
    });
}

#[test]
fn counts_the_ranks_disagree_on_fail_fast_naming_both() {
    let o = Opts {
        timeout: Duration::from_secs(20),
        ..Opts::default()
    };
    let t = Instant::now();
    let errs = threads(3, &o, |r, comm| {
        let comm = comm.unwrap();
        // Rank 2 expects 5 elements from rank 0, which sends it 4.
        let sends = [4usize, 4, 4];
        let mut recvs = [4usize, 4, 4];
        if r == 2 {
            recvs[0] = 5;
        }
        let send = vec![1f32; 12];
        let mut recv = vec![0f32; recvs.iter().sum()];
        comm.all_to_all_v(&send, &sends, &mut recv, &recvs)
            .map(|()| String::new())
            .unwrap_or_else(|e| e.to_string())
    });
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "a disagreement must not wait for the deadline: {errs:?}"
    );
    assert!(
        errs[2].contains("all_to_all_v(f32, count=5)")
            && errs[2].contains("all_to_all_v(f32, count=4)")
            && errs[2].contains("rank 0"),
        "{}",
        errs[2]
    );
    // Rank 2 fails; whoever was still waiting on it learns so.
    for e in &errs[..2] {
        assert!(e.is_empty() || e.contains("rank 2"), "{e}");
    }
}

#[test]
fn a_peer_that_never_joins_is_named_with_the_call_and_its_sequence_number() {
    let o = Opts {
        timeout: Duration::from_secs(2),
        ..Opts::default()
    };
    let errs = threads(2, &o, |r, comm| {
        let comm = comm.unwrap();
        if r == 1 {
            // Never joins; stays alive past rank 0's deadline.
            std::thread::sleep(Duration::from_secs(3));
            return String::new();
        }
        let mut mine = [0f32; 4];
        let e = comm.scatter(&[1f32; 8], &mut mine, 0).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        e.to_string()
    });
    assert!(
        errs[0].contains("scatter(f32, count=4, root=0) seq 1")
            && errs[0].contains("waiting for frame (step 0, slice 0) from rank 1"),
        "{}",
        errs[0]
    );
}

/// A rank that calls a ring collective, or another pairwise one, where its neighbours call a
/// pairwise collective meets their announcement on the ring: every rank fails within a hop, not
/// at the deadline, and the rank that found it names both calls. Checked on a first pairwise
/// call (whose pairs are not yet connected) and on a later one, over shm and tcp.
#[test]
fn a_ring_collective_against_a_pairwise_one_fails_at_once_naming_both() {
    for transport in [TransportPref::Shm, TransportPref::Tcp] {
        let o = Opts {
            transport,
            timeout: Duration::from_secs(20),
            ..Opts::default()
        };
        for connected in [false, true] {
            let t = Instant::now();
            // The first gather ends on every rank before any rank starts the mismatched call:
            // a peer's abort may otherwise end the root's gather before it has read the data.
            let all_connected = std::sync::Barrier::new(3);
            let errs = threads(3, &o, |r, comm| {
                let comm = comm.unwrap();
                let mut g = vec![0f32; if r == 0 { 6 } else { 0 }];
                if connected {
                    comm.gather(&[1f32, 2.0], &mut g, 0).unwrap();
                    all_connected.wait();
                }
                let e = match r {
                    2 => {
                        let mut b = [1f32; 6];
                        comm.with_algo(Algo::Ring)
                            .all_reduce(InPlace, &mut b, ReduceOp::Sum)
                            .unwrap_err()
                    }
                    1 if connected => {
                        let mut all = [0f32; 6];
                        comm.all_gather_v(&[1f32; 2], &mut all, &[2, 2, 2])
                            .unwrap_err()
                    }
                    _ => comm.gather(&[1f32, 2.0], &mut g, 0).unwrap_err(),
                };
                e.to_string()
            });
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "{transport:?} connected={connected}: must not wait for the deadline: {errs:?}"
            );
            // Rank 2 meets rank 1's announcement (gather, or all-gather-v once connected).
            let theirs = if connected {
                "all_gather_v(f32, count=6)"
            } else {
                "gather(f32, count=2, root=0)"
            };
            assert!(
                errs[2].contains("all_reduce(f32, sum, count=6)") && errs[2].contains(theirs),
                "{transport:?} connected={connected}: {}",
                errs[2]
            );
            // Rank 0 meets rank 2's all-reduce frame, or (once connected) rank 1's abort can
            // reach it first: then it names rank 1's finding, which names rank 0's own gather.
            assert!(
                errs[0].contains("all_reduce(f32, sum, count=6)")
                    || (connected
                        && errs[0].contains("rank 1 aborted")
                        && errs[0].contains("collective mismatch")
                        && errs[0].contains("rank 0 called gather(f32, count=2, root=0)")),
                "{transport:?} connected={connected}: {}",
                errs[0]
            );
            if connected {
                assert!(
                    errs[1].contains("gather(f32, count=2, root=0)")
                        && errs[1].contains("all_gather_v(f32, count=6)"),
                    "{transport:?}: {}",
                    errs[1]
                );
            } else {
                assert!(errs[1].contains("rank "), "{transport:?}: {}", errs[1]);
            }
        }
    }
}

/// Across nodes, all-gather-v runs pairwise up to `pairwise_max` bytes of result and round the
/// ring above it; on one node, pairwise at every size. Both exact, out of place and in place,
/// with empty parts and parts of many slices, over shm and tcp (two fake nodes of two ranks
/// each). Which one ran shows in the bytes sent (the counters of every link): the pairwise form
/// sends this rank's part to each other rank, the ring every part but the next rank's.
#[test]
fn across_nodes_all_gather_v_goes_pairwise_up_to_the_threshold_and_round_the_ring_above() {
    let n = 4;
    let small = [3usize, 0, 7, 1000]; // 4040 bytes of f32
    let large = [300usize, 0, 1, 2000]; // 9204 bytes
    for nodes in [1, 2] {
        let o = Opts {
            transport: TransportPref::Auto,
            nodes,
            slice_bytes: 1024,
            algo: Some(Algo::Auto {
                doubling_max: 0,
                halving_max: 0,
                pairwise_max: 4096,
            }),
            ..Opts::default()
        };
        threads(n, &o, |r, comm| {
            let comm = comm.unwrap();
            assert_eq!(comm.nodes(), nodes);
            let part = |q: usize, k: usize| (0..k).map(move |i| (q * 100_000 + i) as f32);
            for (counts, ring) in [(small, false), (large, nodes > 1)] {
                let total: usize = counts.iter().sum();
                let want: Vec<f32> = (0..n).flat_map(|q| part(q, counts[q])).collect();
                let at: usize = counts[..r].iter().sum();
                for in_place in [false, true] {
                    let before = comm.counters().bytes_sent;
                    let mut all = vec![-1f32; total];
                    if in_place {
                        all[at..at + counts[r]].copy_from_slice(&want[at..at + counts[r]]);
                        comm.all_gather_v(InPlace, &mut all, &counts).unwrap();
                    } else {
                        let mine: Vec<f32> = part(r, counts[r]).collect();
                        comm.all_gather_v(&mine, &mut all, &counts).unwrap();
                    }
                    let how = format!("{nodes} nodes, rank {r} ring={ring} in_place={in_place}");
                    assert_eq!(all, want, "{how}");
                    let sent = comm.counters().bytes_sent - before;
                    let by_ring = 4 * (total - counts[(r + 1) % n]) as u64;
                    let by_pairs = 4 * (counts[r] * (n - 1)) as u64;
                    assert_eq!(sent, if ring { by_ring } else { by_pairs }, "{how}");
                }
            }
        });
    }
}

/// On the ring, ranks that split the same total differently fail at the first frame, both
/// splits named (the counts' digest is in the fingerprint); nothing waits for the deadline.
#[test]
fn ring_all_gather_v_with_counts_the_ranks_disagree_on_fails_at_once_naming_both() {
    let o = Opts {
        timeout: Duration::from_secs(20),
        algo: Some(Algo::Ring),
        ..Opts::default()
    };
    let t = Instant::now();
    let errs = threads(3, &o, |r, comm| {
        let comm = comm.unwrap();
        let counts = if r == 1 { [1, 3, 2] } else { [2, 2, 2] };
        let mut all = vec![0f32; 6];
        let e = comm
            .all_gather_v(&vec![1f32; counts[r]], &mut all, &counts)
            .unwrap_err();
        e.to_string()
    });
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "a mismatch must not wait for the deadline: {errs:?}"
    );
    let named = errs.iter().filter(|e| {
        let calls: Vec<&str> = e
            .match_indices("all_gather_v(f32, count=6, counts#")
            .map(|(at, _)| e[at..].split(')').next().unwrap_or(""))
            .collect();
        calls.len() == 2 && calls[0] != calls[1]
    });
    assert!(named.count() >= 1, "both splits named: {errs:?}");
}
