//! The asynchronous forms of every host call: against the serial reference through the
//! [`Queued`] driver, many queued at once before any is waited on, and bad arguments refused at
//! once without taking a sequence number.

use proptest::prelude::*;
use ringzero::{Collectives, DType, InPlace, NonBlocking, P2pOwned, ReduceOp};

use crate::common::{check_with, host_collectives, threads, Case, Opts, Queued};

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, max_shrink_iters: 8, ..ProptestConfig::default() })]
    #[test]
    fn every_async_form_matches_the_serial_reference(
        n in 1usize..=5,
        count in prop_oneof![Just(0usize), Just(1), Just(7), Just(1009), 0usize..300],
        dtype in proptest::sample::select(DType::ALL.to_vec()),
        op in proptest::sample::select(ReduceOp::ALL.to_vec()),
        in_place: bool,
        root in 0usize..5,
        seed in 0usize..1000,
    ) {
        let o = Opts { slice_bytes: 256, ..Opts::default() };
        threads(n, &o, |_, comm| {
            let comm = comm.expect("init");
            // Every host collective in turn, each on the same communicator.
            for (k, coll) in host_collectives(root % n).into_iter().enumerate() {
                let count = if coll == ringzero::Collective::Barrier { 0 } else { count };
                let case = Case { coll, count, dtype, op, in_place, seed: seed + k };
                check_with(&mut Queued(&comm), &case);
            }
        });
    }
}

#[test]
fn many_calls_queued_at_once_complete_in_program_order() {
    let o = Opts {
        slice_bytes: 64,
        ..Opts::default()
    };
    threads(4, &o, |r, comm| {
        let comm = comm.unwrap();
        let (n, ri) = (4usize, r as i64);
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        // Nothing is waited on until every call is queued.
        let reduce = comm.reduce_async(vec![ri + 1; 5], ReduceOp::Sum, 1);
        let shift = comm.ring_shift_async(vec![ri; 3], vec![-1; 3]);
        let barrier = comm.barrier_async();
        let a2a = comm.all_to_all_async((0..8).map(|i| ri * 100 + i).collect(), vec![-1i64; 8]);
        // Rank r sends rank j (r + j) % 3 elements, each r·10 + j.
        let sc: Vec<usize> = (0..n).map(|j| (r + j) % 3).collect();
        let rc: Vec<usize> = (0..n).map(|q| (q + r) % 3).collect();
        let send: Vec<i64> = (0..n)
            .flat_map(|j| std::iter::repeat_n(ri * 10 + j as i64, sc[j]))
            .collect();
        let a2av = comm.all_to_all_v_async(send, &sc, vec![-1; rc.iter().sum()], &rc);
        let agv = comm.all_gather_v_async(vec![ri; r], vec![-1; 6], &[0, 1, 2, 3]);
        let gather = comm.gather_async(vec![ri; 2], vec![-1; if r == 2 { 8 } else { 0 }], 2);
        let scattered: Vec<i64> = if r == 3 { (0..8).collect() } else { Vec::new() };
        let scatter = comm.scatter_async(scattered, vec![-1; 2], 3);
        // Point-to-point between 0↔1 and 2↔3, then once around the ring in one batch.
        let pair = comm.send_recv_async(vec![ri; 4], vec![-1; 4], r ^ 1);
        let round = comm.send_recv_batch_async(vec![
            P2pOwned::Send(vec![ri; 2], next),
            P2pOwned::Recv(vec![-1i64; 2], prev),
        ]);
        // A blocking call waits for every queued one first.
        let mut x = vec![1u8; 3];
        comm.all_reduce(InPlace, &mut x, ReduceOp::Sum).unwrap();
        assert_eq!(x, [4; 3]);
        assert!(reduce.is_done() && round.is_done(), "rank {r}");

        let want = if r == 1 { 10 } else { ri + 1 };
        assert_eq!(reduce.wait().unwrap(), vec![want; 5], "rank {r}");
        assert_eq!(shift.wait().unwrap().1, vec![prev as i64; 3], "rank {r}");
        barrier.wait().unwrap();
        let want: Vec<i64> = (0..n as i64)
            .flat_map(|q| [q * 100 + 2 * ri, q * 100 + 2 * ri + 1])
            .collect();
        assert_eq!(a2a.wait().unwrap().1, want, "rank {r}");
        let want: Vec<i64> = (0..n)
            .flat_map(|q| std::iter::repeat_n(q as i64 * 10 + ri, rc[q]))
            .collect();
        assert_eq!(a2av.wait().unwrap().1, want, "rank {r}");
        assert_eq!(agv.wait().unwrap().1, [1, 2, 2, 3, 3, 3], "rank {r}");
        let want: Vec<i64> = if r == 2 {
            vec![0, 0, 1, 1, 2, 2, 3, 3]
        } else {
            Vec::new()
        };
        assert_eq!(gather.wait().unwrap().1, want, "rank {r}");
        assert_eq!(scatter.wait().unwrap().1, [2 * ri, 2 * ri + 1], "rank {r}");
        let (sent, got) = pair.wait().unwrap();
        assert_eq!((sent, got), (vec![ri; 4], vec![(r ^ 1) as i64; 4]));
        let round = round.wait().unwrap();
        assert!(
            matches!(&round[..], [P2pOwned::Send(s, p), P2pOwned::Recv(g, q)]
                if s == &[ri; 2] && *p == next && g == &[prev as i64; 2] && *q == prev),
            "rank {r}: {round:?}"
        );
        // Recorded in program order after the start-up all-gather (point-to-point calls are
        // not collectives, so not entries).
        let calls: Vec<String> = comm.flight_record().entries[1..]
            .iter()
            .map(|e| format!("{} {}", e.seq, e.call.split('(').next().unwrap()))
            .collect();
        let want = [
            "1 reduce",
            "2 ring_shift",
            "3 barrier",
            "4 all_to_all",
            "5 all_to_all_v",
            "6 all_gather_v",
            "7 gather",
            "8 scatter",
            "9 all_reduce",
        ];
        assert_eq!(calls, want, "rank {r}");
    });
}

#[test]
fn bad_async_arguments_fail_at_once_and_take_no_sequence_number() {
    let o = Opts::default();
    threads(3, &o, |r, comm| {
        let comm = comm.unwrap();
        fn refused_at<R: std::fmt::Debug>(r: usize, w: ringzero::Work<R>, what: &str) {
            assert!(w.is_done(), "rank {r}: {what}: not refused at once");
            let e = w.wait().unwrap_err().to_string();
            assert!(e.contains(what), "rank {r}: {e}");
        }
        let refused = |w, what: &str| refused_at::<Vec<i32>>(r, w, what);
        let refused2 = |w, what: &str| refused_at::<(Vec<i32>, Vec<i32>)>(r, w, what);
        refused(
            comm.reduce_async(vec![1], ReduceOp::Sum, 3),
            "root 3 is not a rank",
        );
        refused2(
            comm.all_to_all_async(vec![1; 4], vec![0; 4]),
            "not a multiple of the world size 3",
        );
        refused2(
            comm.all_to_all_v_async(vec![1; 3], &[1, 1, 1], vec![0; 2], &[1, 1]),
            "recv_counts has 2 entries",
        );
        refused2(
            comm.all_to_all_v_async(vec![1; 3], &[1, 1, 1], vec![0; 3], &[usize::MAX, 1, 1]),
            "add up to more than usize::MAX",
        );
        let mut own = [0usize; 3];
        own[r] = 2;
        let mut other = [0usize; 3];
        other[r] = 1;
        refused2(
            comm.all_to_all_v_async(vec![1; 2], &own, vec![0; 1], &other),
            "this rank's own block is copied locally",
        );
        refused2(
            comm.all_gather_v_async(vec![1; 2], vec![0; 3], &[1, 1, 1]),
            &format!("send has 2 elements but counts[{r}]"),
        );
        let mut huge = [usize::MAX / 8; 3];
        huge[r] = 1;
        refused2(
            comm.all_gather_v_async(vec![1], vec![0; 3], &huge),
            "but recv has 3",
        );
        refused2(
            comm.gather_async(vec![1], vec![0; 3], 5),
            "root 5 is not a rank",
        );
        if r == 0 {
            refused2(
                comm.scatter_async(vec![1; 5], vec![0; 2], 0),
                "send has 5 elements",
            );
        }
        refused(comm.send_async(vec![1], r), "is this rank");
        refused(
            comm.recv_async(vec![1], 7),
            "peer 7 is not a rank of this 3-rank",
        );
        let batch = comm.send_recv_batch_async(vec![
            P2pOwned::Send(vec![1i32], (r + 1) % 3),
            P2pOwned::Recv(vec![1i32], 3),
        ]);
        assert!(batch.is_done());
        let e = batch.wait().unwrap_err().to_string();
        assert!(e.contains("message 1 of the batch"), "{e}");
        // Nothing was numbered or broken: the next collective follows the start-up all-gather.
        let mut x = [r as i32];
        comm.all_reduce(InPlace, &mut x, ReduceOp::Sum).unwrap();
        assert_eq!(x, [3]);
        let seqs: Vec<u64> = comm.flight_record().entries.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, [0, 1], "rank {r}");
    });
}

/// Values of message `m` from `src` to `dst` (exact in f64).
fn posted_message(src: usize, dst: usize, m: usize, count: usize) -> Vec<f64> {
    (0..count)
        .map(|i| ((i * 3 + src * 29 + dst * 13 + m * 7) % 89) as f64)
        .collect()
}

#[test]
fn posted_point_to_point_calls_are_independent_across_peers_and_directions() {
    // Messages far larger than the links' slots (4 × 4 KiB): no send can finish before its
    // receive runs, so each pattern below completes only if a rank's queued calls move at once.
    let big = 20_000;
    for transport in [ringzero::TransportPref::Shm, ringzero::TransportPref::Tcp] {
        let o = Opts {
            transport,
            timeout: std::time::Duration::from_secs(10),
            ..Opts::default()
        };
        threads(4, &o, |r, comm| {
            let comm = comm.unwrap();
            let n = 4;
            let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
            // 1. The pairs' first calls, around the ring: receive from the previous rank, then
            //    send to the next (every rank's first call waits on a rank waiting on another).
            let got = comm.recv_async(vec![-1f64; big], prev);
            let sent = comm.send_async(posted_message(r, next, 0, big), next);
            assert_eq!(
                got.wait().unwrap(),
                posted_message(prev, r, 0, big),
                "{transport:?} rank {r}"
            );
            sent.wait().unwrap();
            // 2. Each rank of a pair sends the other a large message before receiving.
            let peer = r ^ 1;
            let sent = comm.send_async(posted_message(r, peer, 1, big + r), peer);
            let got = comm.recv_async(vec![-1f64; big + peer], peer);
            sent.wait().unwrap();
            assert_eq!(got.wait().unwrap(), posted_message(peer, r, 1, big + peer));
            // 3. Every receive posted first, then every send, each its own call; then a
            //    collective, queued behind them.
            let others: Vec<usize> = (0..n).filter(|&q| q != r).collect();
            let recvs: Vec<_> = others
                .iter()
                .map(|&q| (q, comm.recv_async(vec![-1f64; big + q], q)))
                .collect();
            let sends: Vec<_> = others
                .iter()
                .map(|&q| comm.send_async(posted_message(r, q, 2, big + r), q))
                .collect();
            let sum = comm.all_reduce_async(vec![r as f64; 3], ReduceOp::Sum);
            for (q, w) in recvs {
                assert_eq!(
                    w.wait().unwrap(),
                    posted_message(q, r, 2, big + q),
                    "{q}→{r}"
                );
            }
            sends.into_iter().for_each(|w| drop(w.wait().unwrap()));
            assert_eq!(sum.wait().unwrap(), vec![6.0; 3]);
        });
    }
}

#[test]
fn a_posted_call_that_cannot_finish_fails_every_call_of_its_session() {
    use std::time::{Duration, Instant};
    let o = Opts {
        timeout: Duration::from_secs(2),
        ..Opts::default()
    };
    // Rank 2 never calls: rank 0's receive from it fails at the deadline, naming it, and so does
    // the send to rank 1 posted beside it, which rank 1 never receives; rank 0's exchange with
    // rank 1 posted first completes. The communicator refuses what comes after.
    let errs = threads(3, &o, |r, comm| {
        let comm = comm.unwrap();
        match r {
            0 => {
                let t = Instant::now();
                let swap = comm.send_recv_async(vec![1f32; 3], vec![0f32; 3], 1);
                let stuck = comm.recv_async(vec![0f32; 5], 2);
                let unread = comm.send_async(vec![1f32; 1 << 16], 1);
                assert_eq!(swap.wait().unwrap().1, [2.0; 3]);
                let e = stuck.wait().unwrap_err().to_string();
                let e2 = unread.wait().unwrap_err().to_string();
                assert!(t.elapsed() < Duration::from_secs(12), "{:?}", t.elapsed());
                let later = comm.send(&[1f32], 1).unwrap_err().to_string();
                Some((e, e2, later))
            }
            1 => {
                let swap = comm.send_recv_async(vec![2f32; 3], vec![0f32; 3], 0);
                assert_eq!(swap.wait().unwrap().1, [1.0; 3]);
                std::thread::sleep(Duration::from_secs(5));
                None
            }
            _ => {
                std::thread::sleep(Duration::from_secs(5));
                None
            }
        }
    });
    let (e, e2, later) = errs[0].clone().unwrap();
    assert!(e.contains("rank 2"), "{e}");
    assert_eq!(
        e, e2,
        "every call of the session fails with the session's error"
    );
    assert!(
        later.contains("an earlier error") && later.contains(&e),
        "the communicator failed with it: {later}"
    );

    // Connected, then rank 1 stops receiving: a posted send larger than the slots names it,
    // the message and where it waits.
    let errs = threads(2, &o, |r, comm| {
        let comm = comm.unwrap();
        if r == 0 {
            comm.send(&[1u8; 10], 1).unwrap();
            let e = comm.send_async(vec![1u8; 1 << 20], 1).wait().unwrap_err();
            Some(e.to_string())
        } else {
            comm.recv(&mut [0u8; 10], 0).unwrap();
            std::thread::sleep(Duration::from_secs(4));
            None
        }
    });
    let e = errs[0].as_ref().unwrap();
    assert!(
        e.contains("seq 1") && e.contains("to rank 1") && e.contains("a free slot at rank 1"),
        "{e}"
    );

    // A watchdog aborts rank 1 while rank 0's posted receive waits: it fails long before the
    // deadline, naming the abort.
    let o = Opts {
        timeout: Duration::from_secs(30),
        ..Opts::default()
    };
    let errs = threads(2, &o, |r, comm| {
        let comm = comm.unwrap();
        if r == 0 {
            comm.send(&[1u8; 10], 1).unwrap();
            let t = Instant::now();
            let e = comm.recv_async(vec![0u8; 10], 1).wait().unwrap_err();
            assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
            e.to_string()
        } else {
            comm.recv(&mut [0u8; 10], 0).unwrap();
            std::thread::sleep(Duration::from_millis(300));
            comm.abort("watchdog");
            String::new()
        }
    });
    assert!(
        errs[0].contains("rank 1 aborted") && errs[0].contains("watchdog"),
        "{errs:?}"
    );
}

#[test]
fn posted_calls_in_any_interleaving_arrive_exact_and_in_order() {
    // Every rank posts, for every other rank, three messages to it and three from it (sizes from
    // empty to several times the slots), in an order drawn per seed: each peer's sends in
    // order and its receives in order, but the peers and the directions shuffled together, now
    // and then several in one batch. Only then does it wait, in another drawn order.
    let n = 4;
    let count = |src: usize, dst: usize, m: usize, seed: u64| -> usize {
        [0, 1, 700, 5000, 20_000][(src * 7 + dst * 3 + m + seed as usize) % 5]
    };
    for (seed, transport) in [
        (1u64, ringzero::TransportPref::Shm),
        (2, ringzero::TransportPref::Shm),
        (3, ringzero::TransportPref::Tcp),
    ] {
        let o = Opts {
            transport,
            timeout: std::time::Duration::from_secs(10),
            ..Opts::default()
        };
        threads(n, &o, |r, comm| {
            let comm = comm.unwrap();
            let mut draw = crate::common::drawer(seed, r);
            let mut works = Vec::new();
            for what in crate::common::drawn_posts(n, r, &mut draw) {
                let msgs = what
                    .iter()
                    .map(|&(q, send, m)| {
                        if send {
                            let c = count(r, q, m, seed);
                            P2pOwned::Send(posted_message(r, q, m, c), q)
                        } else {
                            P2pOwned::Recv(vec![-1f64; count(q, r, m, seed)], q)
                        }
                    })
                    .collect();
                works.push((comm.send_recv_batch_async(msgs), what));
            }
            while !works.is_empty() {
                let (w, what) = works.swap_remove(draw(works.len()));
                let got = w.wait().unwrap();
                for (msg, (q, send, m)) in got.into_iter().zip(what) {
                    match msg {
                        P2pOwned::Recv(b, p) => {
                            assert!(!send && p == q);
                            let want = posted_message(q, r, m, count(q, r, m, seed));
                            assert_eq!(b, want, "seed {seed}: {q}→{r} #{m}");
                        }
                        P2pOwned::Send(_, p) => assert!(send && p == q),
                    }
                }
            }
            let mut x = [1i32];
            comm.all_reduce(InPlace, &mut x, ReduceOp::Sum).unwrap();
            assert_eq!(x, [n as i32]);
        });
    }
}
