//! Point-to-point send/recv on thread ranks: every ordered pair in order and exactly, exchanges
//! larger than the links' slots, mixing with collectives, mismatches, bad peers, a peer that
//! never comes and one that aborts.

use std::time::{Duration, Instant};

use half::bf16;
use ringzero::{Collectives, Communicator, Error, InPlace, P2p, ReduceOp, TransportPref};

use crate::common::{threads, Opts};

/// Message `m` from `src` to `dst`: `count` values that differ by position, pair and message
/// (small integers, exact in every type used here).
fn message(src: usize, dst: usize, m: usize, count: usize) -> Vec<f64> {
    (0..count)
        .map(|i| ((i * 7 + src * 31 + dst * 17 + m * 5) % 97) as f64 + 1.0)
        .collect()
}

/// Elements of message `m` from `src` to `dst`: from empty to several times the links' slots
/// (`Opts::default()`'s 4 KiB slices).
fn count_of(src: usize, dst: usize, m: usize) -> usize {
    match (src * 4 + dst + m) % 4 {
        0 => 0,
        1 => 1,
        2 => 1023,
        _ => 9000,
    }
}

#[test]
fn every_pair_sends_in_order_exact_bytes_over_shm_and_tcp() {
    let n = 4;
    for transport in [TransportPref::Shm, TransportPref::Tcp] {
        let o = Opts {
            transport,
            ..Opts::default()
        };
        threads(n, &o, |r, comm| {
            let comm = comm.unwrap();
            let before = comm.counters();
            let mut moved = (0u64, 0u64);
            // Up: receive from every lower rank, then send to every higher one (two messages
            // each, f64). Every wait is on a lower rank, so none can close a cycle.
            for src in 0..r {
                for m in 0..2 {
                    let mut buf = vec![-1f64; count_of(src, r, m)];
                    comm.recv(&mut buf, src).unwrap();
                    assert_eq!(
                        buf,
                        message(src, r, m, buf.len()),
                        "{transport:?} {src}→{r} #{m}"
                    );
                    moved.1 += buf.len() as u64 * 8;
                }
            }
            for dst in r + 1..n {
                for m in 0..2 {
                    let buf = message(r, dst, m, count_of(r, dst, m));
                    comm.send(&buf, dst).unwrap();
                    moved.0 += buf.len() as u64 * 8;
                }
            }
            // Down, in bf16: the same from the top rank, over the same pair links.
            for src in (r + 1..n).rev() {
                let want: Vec<bf16> = message(src, r, 2, count_of(src, r, 2))
                    .into_iter()
                    .map(bf16::from_f64)
                    .collect();
                let mut buf = vec![bf16::from_f64(-1.0); want.len()];
                comm.recv(&mut buf, src).unwrap();
                assert_eq!(buf, want, "{transport:?} {src}→{r}");
                moved.1 += buf.len() as u64 * 2;
            }
            for dst in (0..r).rev() {
                let buf: Vec<bf16> = message(r, dst, 2, count_of(r, dst, 2))
                    .into_iter()
                    .map(bf16::from_f64)
                    .collect();
                comm.send(&buf, dst).unwrap();
                moved.0 += buf.len() as u64 * 2;
            }
            // Payload bytes on the pair links: exactly the messages, nothing on the ring.
            let after = comm.counters();
            assert_eq!(after.bytes_sent - before.bytes_sent, moved.0, "rank {r}");
            assert_eq!(
                after.bytes_received - before.bytes_received,
                moved.1,
                "rank {r}"
            );
            assert_eq!(
                comm.edges().len(),
                2,
                "the ring's edges are still the ring's"
            );
        });
    }
}

/// Rank `r` exchanges with rank `r ^ 1` (`base + 1000 r` elements each way, so the directions
/// differ) and checks what came back: returns what it sent, the peer's count and its message.
fn exchange_with_neighbour(comm: &Communicator, base: usize) -> (Vec<f32>, usize, Vec<f32>) {
    let (r, peer) = (comm.rank(), comm.rank() ^ 1);
    let (mine, theirs) = (base + r * 1000, base + peer * 1000);
    let f32s = |v: Vec<f64>| v.iter().map(|&v| v as f32).collect::<Vec<f32>>();
    let send = f32s(message(r, peer, 0, mine));
    let mut recv = vec![0f32; theirs];
    comm.send_recv(&send, &mut recv, peer).unwrap();
    let want = f32s(message(peer, r, 0, theirs));
    assert!(
        recv == want,
        "rank {r}: the exchange with rank {peer} came back wrong"
    );
    (send, theirs, want)
}

#[test]
fn exchanges_of_any_size_never_wait_on_themselves_and_mix_with_collectives() {
    let o = Opts {
        transport: TransportPref::Tcp,
        ..Opts::default()
    };
    threads(4, &o, |r, comm| {
        let comm = comm.unwrap();
        let peer = r ^ 1;
        // Counts that differ by direction, far beyond the links' slots.
        let (send, theirs, want) = exchange_with_neighbour(&comm, 30_000);

        // The even rank exchanges; the odd one receives first, then sends: the exchange keeps
        // sending while it waits, so neither side waits on the other.
        let mut got = vec![0f32; theirs];
        if r % 2 == 0 {
            comm.send_recv(&send, &mut got, peer).unwrap();
        } else {
            comm.recv(&mut got, peer).unwrap();
            comm.send(&send, peer).unwrap();
        }
        assert_eq!(got, want);

        // Small messages go eagerly: both send first, then receive.
        comm.send(&[r as i32; 64], peer).unwrap();
        let mut small = [0i32; 64];
        comm.recv(&mut small, peer).unwrap();
        assert_eq!(small, [peer as i32; 64]);

        // A send left pending across a collective: pair links and the ring are apart. (The
        // pair's first call connects its links, which both must reach: 0 and 3 meet first.)
        if r == 0 || r == 3 {
            let mut hello = [0u8; 1];
            comm.send_recv(&[1u8], &mut hello, 3 - r).unwrap();
        }
        let mut sum = vec![r as f64 + 1.0; 1000];
        if r == 0 {
            comm.send(&[7u8; 100], 3).unwrap();
            comm.all_reduce(InPlace, &mut sum, ReduceOp::Sum).unwrap();
        } else if r == 3 {
            comm.all_reduce(InPlace, &mut sum, ReduceOp::Sum).unwrap();
            let mut b = [0u8; 100];
            comm.recv(&mut b, 0).unwrap();
            assert_eq!(b, [7u8; 100]);
        } else {
            comm.all_reduce(InPlace, &mut sum, ReduceOp::Sum).unwrap();
        }
        assert!(sum.iter().all(|&v| v == 10.0));
        comm.barrier().unwrap();
    });
}

#[test]
fn bad_peers_are_refused_and_change_nothing() {
    let errs = threads(2, &Opts::default(), |r, comm| {
        let comm = comm.unwrap();
        let mut errs = Vec::new();
        for peer in [r, 2, usize::MAX] {
            let e = comm.send(&[1f32; 4], peer).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
            errs.push(e.to_string());
        }
        let e = comm.recv(&mut [0f32; 4], 5).unwrap_err();
        errs.push(e.to_string());
        // Nothing changed: the pair and the ring still work.
        let mut b = [0f32; 4];
        comm.send_recv(&[r as f32; 4], &mut b, 1 - r).unwrap();
        assert_eq!(b, [(1 - r) as f32; 4]);
        comm.barrier().unwrap();
        errs
    });
    let e = &errs[0];
    assert!(e[0].contains("peer 0 is this rank"), "{e:?}");
    assert!(
        e[1].contains("peer 2 is not a rank of this 2-rank communicator"),
        "{e:?}"
    );
    assert!(e[3].contains("recv from rank 5"), "{e:?}");
    // A one-rank world has no peer at all.
    let mut cfg = crate::common::config(0, 1, crate::common::free_port(), &Opts::default());
    cfg.timeout = Duration::from_secs(5);
    let solo = Communicator::init(cfg).unwrap();
    assert!(matches!(
        solo.send(&[1u8], 0),
        Err(Error::InvalidArgument { .. })
    ));
}

#[test]
fn a_receiver_expecting_another_message_names_both_and_the_sender_learns() {
    let o = Opts {
        timeout: Duration::from_secs(20),
        ..Opts::default()
    };
    let t = Instant::now();
    let errs = threads(2, &o, |r, comm| {
        let comm = comm.unwrap();
        // One good message first, so the mismatch is the pair's second in that direction.
        if r == 0 {
            comm.send(&[1f32; 10], 1).unwrap();
            comm.send(&[1f32; 10], 1).unwrap();
            // Waits for rank 1, which fails instead of sending: the abort must reach this.
            comm.recv(&mut [0f32; 3], 1).unwrap_err().to_string()
        } else {
            comm.recv(&mut [0f32; 10], 0).unwrap();
            comm.recv(&mut [0f32; 12], 0).unwrap_err().to_string()
        }
    });
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "a mismatch must not wait for the deadline: {errs:?}"
    );
    let (sender, receiver) = (&errs[0], &errs[1]);
    assert!(
        receiver.contains("send_recv(f32, count=12)")
            && receiver.contains("send_recv(f32, count=10) (its seq 1)")
            && receiver.contains("rank 0"),
        "{receiver}"
    );
    assert!(sender.contains("rank 1 aborted"), "{sender}");
}

#[test]
fn a_peer_that_never_calls_or_aborts_ends_the_wait() {
    let o = Opts {
        timeout: Duration::from_secs(2),
        ..Opts::default()
    };
    // Rank 1 never makes a point-to-point call: rank 0's first send names it at the deadline.
    let t = Instant::now();
    let errs = threads(2, &o, |r, comm| {
        let comm = comm.unwrap();
        if r == 0 {
            Some(comm.send(&[1u8; 10], 1).unwrap_err().to_string())
        } else {
            std::thread::sleep(Duration::from_secs(4));
            None
        }
    });
    let e = errs[0].as_ref().unwrap();
    assert!(
        e.contains("rank 1 to make its first send or receive with rank 0"),
        "{e}"
    );
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());

    // Connected, then rank 1 stops receiving: a send larger than the slots names it, and where.
    let errs = threads(2, &o, |r, comm| {
        let comm = comm.unwrap();
        if r == 0 {
            comm.send(&[1u8; 10], 1).unwrap();
            let t = Instant::now();
            let e = comm.send(&vec![1u8; 1 << 20], 1).unwrap_err();
            assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
            Some(e.to_string())
        } else {
            comm.recv(&mut [0u8; 10], 0).unwrap();
            std::thread::sleep(Duration::from_secs(4));
            None
        }
    });
    let e = errs[0].as_ref().unwrap();
    assert!(
        e.contains("seq 1") && e.contains("a free slot at rank 1"),
        "{e}"
    );

    // A watchdog aborts rank 1 while rank 0 waits for its message: rank 0 fails long before
    // the deadline, naming it.
    let o = Opts {
        timeout: Duration::from_secs(30),
        ..Opts::default()
    };
    let errs = threads(2, &o, |r, comm| {
        let comm = comm.unwrap();
        if r == 0 {
            comm.send(&[1u8; 10], 1).unwrap();
            let t = Instant::now();
            let e = comm.recv(&mut [0u8; 10], 1).unwrap_err();
            assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
            e.to_string()
        } else {
            comm.recv(&mut [0u8; 10], 0).unwrap();
            std::thread::sleep(Duration::from_millis(300));
            comm.abort("watchdog");
            comm.send(&[1u8; 10], 0).unwrap_err().to_string()
        }
    });
    assert!(
        errs[0].contains("rank 1 aborted") && errs[0].contains("watchdog"),
        "{errs:?}"
    );
    assert!(errs[1].contains("watchdog"), "{errs:?}");
}

#[test]
fn pairs_connect_straight_even_after_rank_0_has_left() {
    // Pairs meet through each other's peer listeners, not rank 0's store: once rank 0 has
    // dropped its communicator, ranks 1 and 2 still connect and exchange, over shm and tcp.
    for transport in [TransportPref::Shm, TransportPref::Tcp] {
        let o = Opts {
            transport,
            timeout: Duration::from_secs(10),
            ..Opts::default()
        };
        threads(3, &o, |r, comm| {
            let comm = comm.unwrap();
            if r == 0 {
                drop(comm);
                return;
            }
            std::thread::sleep(Duration::from_millis(300));
            let peer = 3 - r;
            let mut b = vec![0f64; 5000];
            comm.send_recv(&message(r, peer, 0, 5000), &mut b, peer)
                .unwrap();
            assert_eq!(b, message(peer, r, 0, 5000), "{transport:?}");
        });
    }
}

#[test]
fn a_batch_shifts_around_the_ring_and_swaps_with_every_rank_at_once() {
    let n = 4;
    for transport in [TransportPref::Shm, TransportPref::Tcp] {
        let o = Opts {
            transport,
            ..Opts::default()
        };
        threads(n, &o, |r, comm| {
            let comm = comm.unwrap();
            let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
            // Send to the next rank while receiving from the previous one, far beyond the slots,
            // as the pairs' first calls: every rank connects with both neighbours at once.
            let out = message(r, next, 0, 40_000);
            let mut got = vec![0f64; 40_000];
            comm.send_recv_batch(&mut [P2p::Send(&out, next), P2p::Recv(&mut got, prev)])
                .unwrap();
            assert_eq!(got, message(prev, r, 0, 40_000), "{transport:?} rank {r}");

            // Swap with every rank in one batch, two messages each way per peer, of sizes that
            // differ by pair and message; receives listed before sends on odd ranks.
            let peers: Vec<usize> = (0..n).filter(|&q| q != r).collect();
            let outs: Vec<Vec<f64>> = peers
                .iter()
                .flat_map(|&q| (1..3).map(move |m| message(r, q, m, count_of(r, q, m) + 500)))
                .collect();
            let mut ins: Vec<Vec<f64>> = peers
                .iter()
                .flat_map(|&q| (1..3).map(move |m| vec![-1f64; count_of(q, r, m) + 500]))
                .collect();
            let mut batch: Vec<P2p<f64>> = Vec::new();
            let mut recvs: Vec<P2p<f64>> = ins
                .iter_mut()
                .enumerate()
                .map(|(i, b)| P2p::Recv(b.as_mut_slice(), peers[i / 2]))
                .collect();
            let sends = outs
                .iter()
                .enumerate()
                .map(|(i, b)| P2p::Send(b.as_slice(), peers[i / 2]));
            if r % 2 == 1 {
                batch.append(&mut recvs);
                batch.extend(sends);
            } else {
                batch.extend(sends);
                batch.append(&mut recvs);
            }
            comm.send_recv_batch(&mut batch).unwrap();
            drop(batch);
            for (i, b) in ins.iter().enumerate() {
                let (q, m) = (peers[i / 2], 1 + i % 2);
                assert_eq!(*b, message(q, r, m, b.len()), "{transport:?} {q}→{r} #{m}");
            }

            // Single calls go on where the batch left each pair's numbering.
            let mut one = [0f64; 3];
            comm.send_recv(&[r as f64; 3], &mut one, r ^ 1).unwrap();
            assert_eq!(one, [(r ^ 1) as f64; 3]);
            comm.barrier().unwrap();
        });
    }
}

#[test]
fn a_batch_with_a_bad_peer_is_refused_whole() {
    threads(2, &Opts::default(), |r, comm| {
        let comm = comm.unwrap();
        let mut b = [0u8; 4];
        let e = comm
            .send_recv_batch(&mut [
                P2p::Send(&[1u8; 4], 1 - r),
                P2p::Recv(&mut b, 1 - r),
                P2p::Send(&[1u8; 4], 7),
            ])
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        assert!(e.to_string().contains("message 2 of the batch"), "{e}");
        assert!(e.to_string().contains("peer 7 is not a rank"), "{e}");
        // Nothing moved: an empty batch is fine, and the pair's first exchange works.
        comm.send_recv_batch::<u8>(&mut []).unwrap();
        comm.send_recv(&[r as u8; 4], &mut b, 1 - r).unwrap();
        assert_eq!(b, [(1 - r) as u8; 4]);
    });
}

#[test]
fn pair_and_pairwise_links_stripe_large_frames_over_three_connections() {
    // 256 KiB slices over tcp links of three connections: the pairs' frames travel in three
    // parts each, point-to-point and pairwise collectives alike.
    let n = 4;
    let o = Opts {
        transport: TransportPref::Tcp,
        slice_bytes: 256 << 10,
        tcp_sockets: 3,
        // All-gather-v pairwise whatever its size and the nodes.
        algo: Some(ringzero::Algo::Doubling),
        ..Opts::default()
    };
    threads(n, &o, |_, comm| {
        let comm = comm.unwrap();
        exchange_with_neighbour(&comm, 200_000);
        for coll in crate::common::host_collectives(1) {
            use ringzero::Collective::{AllGatherV, AllToAll};
            if coll.is_pairwise() || coll == AllToAll || coll == AllGatherV {
                crate::common::check_case(
                    &comm,
                    &crate::common::Case {
                        coll,
                        count: n * 100_003,
                        dtype: ringzero::DType::F32,
                        op: ReduceOp::Sum,
                        in_place: false,
                        seed: 11,
                    },
                );
            }
        }
    });
}

#[test]
fn first_calls_that_form_a_cycle_meet() {
    // Every rank's first call sends to the rank before it, then receives from the one after:
    // each first call waits on a rank whose own first call waits on another. A rank that waits
    // to connect connects those who call it meanwhile, so the cycle meets (the messages fit the
    // links' slots, so each send returns before its receive, as `MPI_Send` of a small message).
    for transport in [TransportPref::Shm, TransportPref::Tcp] {
        let o = Opts {
            transport,
            timeout: Duration::from_secs(10),
            ..Opts::default()
        };
        let t = Instant::now();
        threads(4, &o, |r, comm| {
            let comm = comm.unwrap();
            let (prev, next) = ((r + 3) % 4, (r + 1) % 4);
            comm.send(&message(r, prev, 0, 100), prev).unwrap();
            let mut got = vec![0f64; 100];
            comm.recv(&mut got, next).unwrap();
            assert_eq!(got, message(next, r, 0, 100), "{transport:?} rank {r}");
            let mut x = [1i32];
            comm.all_reduce(InPlace, &mut x, ReduceOp::Sum).unwrap();
            assert_eq!(x, [4]);
        });
        assert!(
            t.elapsed() < Duration::from_secs(8),
            "{transport:?}: {:?}",
            t.elapsed()
        );
    }
}

#[test]
fn a_stale_caller_does_not_fail_a_first_call() {
    // Rank 2's first call with rank 0 gives up before rank 0 makes any: its connection waits,
    // stale, at rank 0's listener. Rank 0's first call with rank 1 then tries to connect the
    // waiting caller too (it might be a cycle's); that fails, and the call goes on.
    let o = Opts {
        timeout: Duration::from_secs(2),
        ..Opts::default()
    };
    let out = threads(3, &o, |r, comm| {
        let comm = comm.unwrap();
        match r {
            2 => {
                let e = comm.send(&[1f32], 0).unwrap_err().to_string();
                assert!(e.contains("rank 0"), "{e}");
                std::thread::sleep(Duration::from_secs(3));
                None
            }
            _ => {
                std::thread::sleep(Duration::from_millis(2500));
                let mut got = [0f32; 2];
                comm.send_recv(&[r as f32; 2], &mut got, 1 - r).unwrap();
                Some(got)
            }
        }
    });
    assert_eq!(out[0], Some([1.0; 2]));
    assert_eq!(out[1], Some([0.0; 2]));
}
