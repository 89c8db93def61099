//! Point-to-point on device buffers ([`DeviceComm::send`](ringzero_collectives::Collectives::send), `recv`, `send_recv`): pairs of ranks
//! that are not ring neighbours, both directions, over host staging (mapped and explicit
//! copies) and tcp device links, with the host as the device (the GPU check runs them on GPUs).

use ringzero::{
    Collectives, DType, DeviceComm, Error, HostStream, InPlace, NonBlocking, ReduceOp, StagingMode,
    TransportKind, TransportPref,
};

use crate::common::{threads, Opts};

/// Run `body` on `n` thread ranks, each with a device communicator on the host stream.
fn ranks(n: usize, o: &Opts, body: impl Fn(usize, &mut DeviceComm<HostStream>) + Sync) {
    threads(n, o, |r, comm| {
        let comm = comm.unwrap();
        let mut dc = DeviceComm::new(&comm, HostStream::new())
            .unwrap_or_else(|e| panic!("rank {r}: device comm: {e}"));
        body(r, &mut dc);
    });
}

/// What rank `from` sends in message `k`: `len` elements that tell sender, message and
/// position apart.
fn msg(from: usize, k: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (from * 1_000_000 + k * 10_000 + i % 9_973) as f32)
        .collect()
}

/// A 4-stage pipeline, forward and back: stage r sends activations to r + 1 and gradients to
/// r − 1 (the ring reaches r + 1 only, one way), then every rank swaps with the rank across
/// (0↔2, 1↔3: no ring edge at all) by `send_recv`, messages of several slots each way; and ranks
/// 0 and 3 trade several messages in a row, which each direction numbers. Every element checked.
#[test]
fn a_pipeline_forward_and_back_and_swaps_across_the_ring_arrive_exactly() {
    for (transport, staging, want) in [
        (TransportPref::Shm, StagingMode::Mapped, TransportKind::Shm),
        (TransportPref::Shm, StagingMode::Copy, TransportKind::Shm),
        (TransportPref::Tcp, StagingMode::Mapped, TransportKind::Tcp),
    ] {
        let o = Opts {
            transport,
            staging,
            slice_bytes: 1024,
            ..Opts::default()
        };
        let n = 4;
        ranks(n, &o, |r, dc| {
            let len = 3001;
            // Forward: activations 0 → 1 → 2 → 3, each stage adding its rank.
            let mut act = vec![0f32; len];
            if r > 0 {
                dc.recv(&mut act[..], r - 1).unwrap();
                assert_eq!(act, msg(r - 1, 0, len), "rank {r}: activations");
            }
            if r + 1 < n {
                dc.send(&msg(r, 0, len)[..], r + 1).unwrap();
            }
            // Backward: gradients 3 → 2 → 1 → 0, against the ring.
            let mut grad = vec![0f32; len + 7];
            if r + 1 < n {
                dc.recv(&mut grad[..], r + 1).unwrap();
                assert_eq!(grad, msg(r + 1, 1, len + 7), "rank {r}: gradients");
            }
            if r > 0 {
                dc.send(&msg(r, 1, len + 7)[..], r - 1).unwrap();
            }
            // Across: 0↔2 and 1↔3 swap at once, counts differing by direction.
            let peer = r ^ 2;
            let mut got = vec![0f32; 5000 + peer];
            dc.send_recv(&msg(r, 2, 5000 + r)[..], &mut got[..], peer)
                .unwrap();
            assert_eq!(got, msg(peer, 2, 5000 + peer), "rank {r}: swap");
            // Several messages in a row between 0 and 3, small enough to be in flight at once.
            if r == 0 || r == 3 {
                let other = 3 - r;
                if r == 0 {
                    for k in 0..3 {
                        dc.send(&msg(r, 10 + k, 100)[..], other).unwrap();
                    }
                } else {
                    for k in 0..3 {
                        let mut b = vec![0f32; 100];
                        dc.recv(&mut b[..], other).unwrap();
                        assert_eq!(b, msg(other, 10 + k, 100), "message {k}");
                    }
                }
            }
            // Collectives still run in step around the point-to-point calls.
            let mut all = vec![1f32; 1000];
            dc.all_reduce(InPlace, &mut all[..], ReduceOp::Sum).unwrap();
            assert!(all.iter().all(|&v| v == n as f32));
            // The pairs say how they are linked.
            let [from, to] = dc.pair_edges(peer).expect("connected");
            assert_eq!((from.from, from.to, to.from, to.to), (peer, r, r, peer));
            assert!(from.kind == want && to.kind == want, "{from} / {to}");
            assert!(dc.pair_edges(r).is_none());
        });
    }
}

/// Bad peers are refused by name and change nothing; a receive expecting another count fails
/// with both calls named, on both ranks, and the communicator refuses later calls.
#[test]
fn bad_device_point_to_point_calls_are_refused_and_mismatches_name_both() {
    ranks(3, &Opts::default(), |r, dc| {
        let e = dc.send(&[1f32; 4][..], r).unwrap_err();
        assert!(e.to_string().contains("is this rank"), "{e}");
        let e = dc.recv(&mut [0f32; 4][..], 3).unwrap_err();
        assert!(e.to_string().contains("not a rank of this 3-rank"), "{e}");
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        // Refused calls used nothing: a collective still runs in step.
        let mut b = vec![1f32; 10];
        dc.all_reduce(InPlace, &mut b[..], ReduceOp::Sum).unwrap();
        assert_eq!(b, vec![3.0; 10]);
        match r {
            0 => {
                // The send may land in rank 2's slots before rank 2 looks at it; the mismatch
                // then reaches this rank as rank 2's abort, at its next wait on the pair.
                let _ = dc.send(&[1f32; 8][..], 2);
                let e = dc.recv(&mut [0f32; 8][..], 2).unwrap_err();
                assert!(e.to_string().contains("rank 2"), "{e}");
            }
            2 => {
                let e = dc.recv(&mut [0f32; 9][..], 0).unwrap_err();
                let t = e.to_string();
                assert!(
                    t.contains("count=8") && t.contains("count=9"),
                    "both calls named: {t}"
                );
            }
            _ => {}
        }
        if r != 1 {
            let e = dc.send(&[1f32; 8][..], 1).unwrap_err();
            assert!(!matches!(e, Error::InvalidArgument { .. }), "{e}");
        }
    });
}

/// Every element type crosses a pair both ways, bit for bit (messages of one element, of a
/// part of a slot and of several slots; 1 → 0 runs against the ring's direction on 3 ranks).
#[test]
fn every_element_type_crosses_a_device_pair_exactly() {
    ranks(
        3,
        &Opts {
            slice_bytes: 1024,
            ..Opts::default()
        },
        |r, dc| {
            for (k, d) in DType::ALL.into_iter().enumerate() {
                let len = [1, 255, 4099][k % 3];
                let bytes: Vec<u8> = (0..len * d.size())
                    .map(|i| (i * 7 + r) as u8 % 120)
                    .collect();
                match r {
                    0 => {
                        let mut got = vec![0u8; bytes.len()];
                        send_recv_bytes(dc, d, &bytes, &mut got, 1);
                        let want: Vec<u8> = (0..len * d.size())
                            .map(|i| (i * 7 + 1) as u8 % 120)
                            .collect();
                        assert_eq!(got, want, "{d}");
                    }
                    1 => {
                        let mut got = vec![0u8; bytes.len()];
                        send_recv_bytes(dc, d, &bytes, &mut got, 0);
                    }
                    _ => {}
                }
            }
        },
    );
}

/// `send_recv` of raw bytes viewed as `d`'s elements (u8 buffers of whole elements).
fn send_recv_bytes(
    dc: &mut DeviceComm<HostStream>,
    d: DType,
    send: &[u8],
    recv: &mut [u8],
    peer: usize,
) {
    use half::{bf16, f16};
    fn elems<T: bytemuck::Pod>(b: &[u8]) -> Vec<T> {
        b.chunks_exact(std::mem::size_of::<T>())
            .map(bytemuck::pod_read_unaligned)
            .collect()
    }
    macro_rules! go {
        ($t:ty) => {{
            let s: Vec<$t> = elems(send);
            let mut g: Vec<$t> = elems(recv);
            dc.send_recv(&s[..], &mut g[..], peer).unwrap();
            recv.copy_from_slice(bytemuck::cast_slice(&g));
        }};
    }
    match d {
        DType::F32 => go!(f32),
        DType::F64 => go!(f64),
        DType::F16 => go!(f16),
        DType::BF16 => go!(bf16),
        DType::I32 => go!(i32),
        DType::I64 => go!(i64),
        DType::U8 => go!(u8),
    }
}

/// Asynchronous point-to-point on owned buffers: ranks pair up (0↔1, 2↔3) and each queues a send
/// to its partner then a receive from it, then an exchange with the rank across (0↔2, 1↔3),
/// then a blocking collective, which runs after them; a bad peer fails its `Work` at once.
/// (A pair's first call is a rendezvous, as on the host: had every rank's first call gone to
/// the rank before it, each would wait for that rank to turn to it.)
#[test]
fn async_device_point_to_point_runs_on_the_proxy_thread_in_order() {
    let o = Opts {
        slice_bytes: 1024,
        ..Opts::default()
    };
    let n = 4;
    ranks(n, &o, |r, dc| {
        let partner = r ^ 1;
        // Small enough to sit in the partner's slots until it receives.
        let sent = dc.send_async(msg(r, 0, 600), partner);
        let got = dc.recv_async(vec![0f32; 600], partner);
        let swap = dc.send_recv_async(msg(r, 1, 3000), vec![0f32; 3000], r ^ 2);
        let mut all = vec![1f32; 100];
        dc.all_reduce(InPlace, &mut all[..], ReduceOp::Sum).unwrap();
        assert!(sent.is_done() && got.is_done() && swap.is_done());
        assert_eq!(sent.wait().unwrap(), msg(r, 0, 600));
        assert_eq!(got.wait().unwrap(), msg(partner, 0, 600), "rank {r}");
        assert_eq!(swap.wait().unwrap().1, msg(r ^ 2, 1, 3000), "rank {r}");
        let e = dc.recv_async(vec![0f32; 1], r).wait().unwrap_err();
        assert!(e.to_string().contains("is this rank"), "{e}");
    });
}

/// `connect_peers` connects a rank's pairs all at once: afterwards every rank's first message
/// may go to the rank before it while it receives from the rank after (a cycle, which first
/// calls alone would wait in until the deadline), and a second `connect_peers` is free. Each
/// rank leaves as soon as it is done: a connect returns only once both sides of every pair have
/// attached, so none removes a FIFO its slower peer has yet to open.
#[test]
fn connected_peers_need_no_rendezvous_even_in_a_cycle() {
    for transport in [TransportPref::Shm, TransportPref::Tcp] {
        let o = Opts {
            transport,
            slice_bytes: 1024,
            ..Opts::default()
        };
        let n = 4;
        ranks(n, &o, |r, dc| {
            let (before, after) = ((r + n - 1) % n, (r + 1) % n);
            dc.connect_peers(&[after, before, after])
                .unwrap_or_else(|e| panic!("rank {r}: {e}"));
            let (e0, e1) = (
                dc.pair_edges(before).unwrap(),
                dc.pair_edges(after).unwrap(),
            );
            assert_eq!((e0[0].from, e1[1].to), (before, after));
            dc.connect_peers(&[before]).unwrap();
            let sent = dc.send_async(msg(r, 0, 600), before);
            let got = dc.recv_async(vec![0f32; 600], after);
            assert_eq!(got.wait().unwrap(), msg(after, 0, 600), "rank {r}");
            sent.wait().unwrap();
            let e = dc.connect_peers(&[r]).unwrap_err();
            assert!(e.to_string().contains("is this rank"), "{e}");
        });
    }
}

/// The communicator's counters include the pairs' links: a send of S bytes adds S sent on the
/// sender, S received on the receiver, and nothing on the ring's edges.
#[test]
fn point_to_point_bytes_are_counted() {
    ranks(3, &Opts::default(), |r, dc| {
        let before = dc.counters();
        match r {
            2 => dc.send(&msg(r, 0, 1000)[..], 0).unwrap(),
            0 => dc.recv(&mut vec![0f32; 1000][..], 2).unwrap(),
            _ => {}
        }
        dc.barrier().unwrap();
        let (after, d) = (dc.counters(), |a: u64, b: u64| a - b);
        let sent = d(after.bytes_sent, before.bytes_sent);
        let received = d(after.bytes_received, before.bytes_received);
        assert_eq!(
            (sent, received),
            [(0, 4000), (0, 0), (4000, 0)][r],
            "rank {r}"
        );
    });
}

/// Device all-to-all-v: blocks of every size (empty ones included) arrive where the counts put
/// them, over each pair's links (the first call connects every pair), on 3 ranks (a rank sits
/// each round out) and 4; bad counts are refused by name and change nothing; a rank calling
/// something else is named.
#[test]
fn device_all_to_all_v_moves_uneven_blocks_and_refuses_bad_counts() {
    for n in [3, 4] {
        let o = Opts {
            slice_bytes: 1024,
            ..Opts::default()
        };
        ranks(n, &o, |r, dc| {
            // Rank q sends rank j (q·7 + j·300) % 1100 elements.
            let count = |q: usize, j: usize| (q * 7 + j * 300) % 1100;
            let sc: Vec<usize> = (0..n).map(|j| count(r, j)).collect();
            let rc: Vec<usize> = (0..n).map(|q| count(q, r)).collect();
            let send: Vec<f32> = (0..n)
                .flat_map(|j| (0..sc[j]).map(move |i| (r * 100_000 + j * 1000 + i) as f32))
                .collect();
            for _ in 0..2 {
                let mut recv = vec![-1f32; rc.iter().sum()];
                dc.all_to_all_v(&send[..], &sc, &mut recv[..], &rc).unwrap();
                let want: Vec<f32> = (0..n)
                    .flat_map(|q| (0..rc[q]).map(move |i| (q * 100_000 + r * 1000 + i) as f32))
                    .collect();
                assert_eq!(recv, want, "n={n} rank {r}");
            }
            let mut out = vec![5f32; rc.iter().sum()];
            let mut bad = sc.clone();
            bad[r] += 1;
            let e = dc
                .all_to_all_v(&send[..], &bad, &mut out[..], &rc)
                .unwrap_err();
            assert!(e.to_string().contains("send_counts add up to"), "{e}");
            let e = dc
                .all_to_all_v(&send[..], &sc, &mut out[..], &rc[..n - 1])
                .unwrap_err();
            assert!(
                e.to_string().contains("entries but the communicator has"),
                "{e}"
            );
            assert!(
                out.iter().all(|&v| v == 5.0),
                "a refused call wrote its output"
            );
            // The asynchronous form, then a mismatch: rank 0 calls an all-reduce instead.
            let w = dc.all_to_all_v_async(send.clone(), &sc, vec![0f32; out.len()], &rc);
            let (_, got) = w.wait().unwrap();
            assert_eq!(got.len(), out.len());
            let e = if r == 0 {
                dc.all_reduce(InPlace, &mut out[..], ReduceOp::Sum)
                    .unwrap_err()
            } else {
                dc.all_to_all_v(&send[..], &sc, &mut out[..], &rc)
                    .unwrap_err()
            };
            let t = e.to_string();
            assert!(!matches!(e, Error::InvalidArgument { .. }), "{t}");
            if r == 1 {
                // Rank 1 receives rank 0's announcement: both calls are named.
                assert!(
                    t.contains("all_to_all_v") && t.contains("all_reduce"),
                    "{t}"
                );
            }
        });
    }
}

/// Device gather and scatter: bad roots and a root's buffer of the wrong length are refused by
/// name and change nothing; a gather and a scatter through a non-zero root arrive exactly, twice
/// (the second call needs no connect).
#[test]
fn device_gather_and_scatter_refuse_bad_input_and_move_blocks() {
    ranks(3, &Opts::default(), |r, dc| {
        let mut out = [7f32; 30];
        let e = dc.gather(&[1f32; 10][..], &mut out[..], 3).unwrap_err();
        assert!(
            e.to_string()
                .contains("root 3 is not a rank of this 3-rank"),
            "{e}"
        );
        if r == 1 {
            let e = dc.gather(&[1f32; 10][..], &mut out[..29], 1).unwrap_err();
            assert!(
                e.to_string()
                    .contains("recv has 29 elements but the root moves 3 × 10"),
                "{e}"
            );
            let e = dc.scatter(&out[..29], &mut [0f32; 10][..], 1).unwrap_err();
            assert!(e.to_string().contains("send has 29 elements"), "{e}");
        }
        assert!(
            out.iter().all(|&v| v == 7.0),
            "a refused call wrote its buffer"
        );
        for _ in 0..2 {
            let mine = msg(r, 3, 10);
            let mut all = if r == 1 { vec![0f32; 30] } else { Vec::new() };
            dc.gather(&mine[..], &mut all[..], 1).unwrap();
            if r == 1 {
                let want: Vec<f32> = (0..3).flat_map(|q| msg(q, 3, 10)).collect();
                assert_eq!(all, want);
            }
            let mut part = vec![0f32; 10];
            dc.scatter(&all[..], &mut part[..], 1).unwrap();
            assert_eq!(part, msg(r, 3, 10), "rank {r}: its block back");
        }
    });
}

/// On ranks that span nodes, a device all-to-all runs over the pairs (one exchange per pair,
/// as all-to-all-v does; in place from the kept copy), where one node keeps the ring: the pairs
/// are connected after the first call only across nodes. Exact either way, in place and out of
/// place, and the flight record names the call `all_to_all`.
#[test]
fn across_nodes_a_device_all_to_all_goes_over_the_pairs() {
    let n = 4;
    for nodes in [1, 2] {
        let o = Opts {
            transport: TransportPref::Auto,
            nodes,
            slice_bytes: 4096,
            ..Opts::default()
        };
        ranks(n, &o, |r, dc| {
            let block = 3001;
            let send: Vec<f32> = (0..n).flat_map(|q| msg(r, q, block)).collect();
            let want: Vec<f32> = (0..n).flat_map(|q| msg(q, r, block)).collect();
            let mut buf = send.clone();
            dc.all_to_all(InPlace, &mut buf[..]).unwrap();
            assert_eq!(buf, want, "{nodes} nodes, rank {r}, in place");
            let paired = (0..n).filter(|&q| q != r && dc.pair_edges(q).is_some());
            assert_eq!(
                paired.count(),
                if nodes > 1 { n - 1 } else { 0 },
                "rank {r}"
            );
            let mut recv = vec![-1f32; n * block];
            dc.all_to_all(&send[..], &mut recv[..]).unwrap();
            assert_eq!(recv, want, "{nodes} nodes, rank {r}");
            let calls: Vec<String> = dc
                .flight_record()
                .entries
                .iter()
                .map(|e| e.call.clone())
                .collect();
            assert!(
                calls
                    .iter()
                    .filter(|c| c.starts_with("all_to_all(f32"))
                    .count()
                    == 2,
                "{calls:?}"
            );
            // Each entry spans the whole call, pairs included: its size, and at least the
            // other ranks' blocks sent and received (the ring forwards more).
            let whole = (n * block * 4) as u64;
            let theirs = ((n - 1) * block * 4) as u64;
            for e in dc.flight_record().entries.iter() {
                if e.call.starts_with("all_to_all(f32") {
                    assert_eq!(e.bytes, whole, "{nodes} nodes, rank {r}: {e:?}");
                    assert!(e.sent >= theirs && e.received >= theirs, "{nodes}: {e:?}");
                    assert_eq!(e.state, ringzero::CallState::Done, "{e:?}");
                }
            }
            if nodes == 1 {
                return;
            }
            // Rank 0 calls the all-to-all, the others an all-to-all-v of the same blocks: the
            // announcements name both calls, and every rank fails.
            let counts = [block; 4];
            let e = if r == 0 {
                dc.all_to_all(&send[..], &mut recv[..]).unwrap_err()
            } else {
                dc.all_to_all_v(&send[..], &counts, &mut recv[..], &counts)
                    .unwrap_err()
            };
            let t = e.to_string();
            assert!(!matches!(e, Error::InvalidArgument { .. }), "{t}");
            if r == 1 {
                assert!(
                    t.contains("all_to_all(") && t.contains("all_to_all_v("),
                    "{t}"
                );
            }
        });
    }
}

/// Posted device point-to-point (the asynchronous forms) never waits on itself: every rank
/// posts its receive from the rank before it, then its send to the rank after (each message
/// several times what the slots hold, so no send fits before its receive starts), as its
/// pairs' very first calls — a cycle that calls run one at a time wait in until the deadline.
/// Then, on the pairs now connected, the other way round, and two ranks each posting a large
/// send before their receive. Every element checked, over shm (mapped and explicit-copy
/// staging) and tcp device links (of one connection and of three).
#[test]
fn posted_device_calls_complete_in_a_cycle_of_first_calls_and_both_ways() {
    for (transport, staging, want, tcp_sockets) in [
        (
            TransportPref::Shm,
            StagingMode::Mapped,
            TransportKind::Shm,
            1,
        ),
        (TransportPref::Shm, StagingMode::Copy, TransportKind::Shm, 1),
        (
            TransportPref::Tcp,
            StagingMode::Mapped,
            TransportKind::Tcp,
            1,
        ),
        (
            TransportPref::Tcp,
            StagingMode::Mapped,
            TransportKind::Tcp,
            3,
        ),
    ] {
        let o = Opts {
            transport,
            staging,
            tcp_sockets,
            slice_bytes: 1024,
            timeout: std::time::Duration::from_secs(20),
            ..Opts::default()
        };
        let n = 4;
        ranks(n, &o, |r, dc| {
            let (prev, next) = ((r + n - 1) % n, (r + 1) % n);
            let len = 3001; // 12 KB: three times the four 1 KiB slots
            let got = dc.recv_async(vec![0f32; len], prev);
            let sent = dc.send_async(msg(r, 0, len), next);
            assert_eq!(got.wait().unwrap(), msg(prev, 0, len), "rank {r}: ring");
            assert_eq!(sent.wait().unwrap(), msg(r, 0, len), "rank {r}: sent back");
            // The other way round on the same pairs, posted in the same order.
            let got = dc.recv_async(vec![0f32; len + 1], next);
            let sent = dc.send_async(msg(r, 1, len + 1), prev);
            assert_eq!(got.wait().unwrap(), msg(next, 1, len + 1), "rank {r}: back");
            sent.wait().unwrap();
            // Both sends of a pair first, each larger than the slots.
            let partner = r ^ 1;
            let sent = dc.send_async(msg(r, 2, 5000), partner);
            let got = dc.recv_async(vec![0f32; 5000], partner);
            let swap = dc.send_recv_async(msg(r, 3, 700), vec![0f32; 700], partner);
            assert_eq!(got.wait().unwrap(), msg(partner, 2, 5000), "rank {r}: swap");
            assert_eq!(swap.wait().unwrap().1, msg(partner, 3, 700), "rank {r}");
            sent.wait().unwrap();
            // A collective after them runs in step.
            let mut all = vec![1f32; 100];
            dc.all_reduce(InPlace, &mut all[..], ReduceOp::Sum).unwrap();
            assert!(all.iter().all(|&v| v == n as f32));
            for peer in [prev, next, partner] {
                let [from, to] = dc.pair_edges(peer).expect("connected");
                assert!(from.kind == want && to.kind == want, "{from} / {to}");
                if want == TransportKind::Tcp {
                    assert_eq!((from.sockets, to.sockets), (tcp_sockets, tcp_sockets));
                }
            }
        });
    }
}

/// A posted call and a blocking one meet: the same messages, numbered alike, whichever form
/// each rank uses, on a pair's first call and later ones.
#[test]
fn posted_and_blocking_device_calls_meet() {
    let o = Opts {
        slice_bytes: 1024,
        ..Opts::default()
    };
    ranks(2, &o, |r, dc| {
        let other = 1 - r;
        for k in 0..3 {
            let len = 1500 + k;
            if r == 0 {
                let got = dc.recv_async(vec![0f32; len], other);
                let sent = dc.send_async(msg(r, k, len), other);
                assert_eq!(got.wait().unwrap(), msg(other, k, len), "message {k}");
                sent.wait().unwrap();
            } else {
                let mut b = vec![0f32; len];
                dc.send_recv(&msg(r, k, len)[..], &mut b[..], other)
                    .unwrap();
                assert_eq!(b, msg(other, k, len), "message {k}");
            }
        }
    });
}

/// A posted receive whose sender never sends fails at the deadline, naming the peer and the
/// message; every call of the session fails with it, and later calls are refused.
#[test]
fn a_posted_device_receive_that_never_comes_times_out_naming_the_peer() {
    let o = Opts {
        slice_bytes: 1024,
        timeout: std::time::Duration::from_millis(1500),
        ..Opts::default()
    };
    ranks(2, &o, |r, dc| {
        if r == 1 {
            // Connect the pair (a message each way), then go quiet past rank 0's deadline.
            let got = dc.recv_async(vec![0f32; 10], 0);
            dc.send_async(msg(r, 0, 10), 0).wait().unwrap();
            got.wait().unwrap();
            std::thread::sleep(std::time::Duration::from_millis(2500));
            return;
        }
        let got = dc.recv_async(vec![0f32; 10], 1);
        dc.send_async(msg(r, 0, 10), 1).wait().unwrap();
        got.wait().unwrap();
        let start = std::time::Instant::now();
        let waits = dc.recv_async(vec![0f32; 64], 1);
        let e = waits.wait().unwrap_err();
        let took = start.elapsed();
        let s = e.to_string();
        assert!(matches!(e, Error::Timeout { .. }), "{s}");
        assert!(s.contains("rank 1") && s.contains("send_recv"), "{s}");
        assert!(took < std::time::Duration::from_secs(5), "took {took:?}");
        let e = dc.send_async(msg(r, 1, 4), 1).wait().unwrap_err();
        assert!(e.to_string().contains("rank 1"), "refused: {e}");
    });
}

/// A batch of posted messages to and from several peers (torch's `batch_isend_irecv`) as the
/// pairs' first call: every rank receives from both neighbours and sends to both at once, in one
/// call, messages larger than the slots and of two element types; the messages come back in the
/// order given. An empty batch is done at once; a bad peer fails the batch and moves nothing.
#[test]
fn a_posted_device_batch_moves_every_message_of_it_at_once() {
    use ringzero::DeviceP2p;
    for transport in [TransportPref::Shm, TransportPref::Tcp] {
        let o = Opts {
            transport,
            slice_bytes: 1024,
            ..Opts::default()
        };
        let n = 3;
        ranks(n, &o, |r, dc| {
            let (prev, next) = ((r + n - 1) % n, (r + 1) % n);
            let e = dc
                .send_recv_batch_async(vec![DeviceP2p::Send(vec![1f32; 4], n)])
                .wait()
                .unwrap_err();
            assert!(e.to_string().contains("not a rank of this 3-rank"), "{e}");
            assert!(dc
                .send_recv_batch_async::<Vec<f32>>(vec![])
                .wait()
                .unwrap()
                .is_empty());
            let msgs = vec![
                DeviceP2p::Recv(vec![0f32; 2000], prev),
                DeviceP2p::Recv(vec![0f32; 2001], next),
                DeviceP2p::Send(msg(r, 0, 2000), next),
                DeviceP2p::Send(msg(r, 1, 2001), prev),
            ];
            let back = dc.send_recv_batch_async(msgs).wait().unwrap();
            match &back[..] {
                [DeviceP2p::Recv(a, p0), DeviceP2p::Recv(b, p1), DeviceP2p::Send(c, _), DeviceP2p::Send(_, p3)] =>
                {
                    assert_eq!((*p0, *p1, *p3), (prev, next, prev));
                    assert_eq!(*a, msg(prev, 0, 2000), "rank {r}: from the rank before");
                    assert_eq!(*b, msg(next, 1, 2001), "rank {r}: from the rank after");
                    assert_eq!(*c, msg(r, 0, 2000), "rank {r}: a send comes back");
                }
                other => panic!("rank {r}: {other:?}"),
            }
            // Another element type on the same pairs.
            let ints: Vec<i64> = (0..3000).map(|i| (r * 100_000 + i) as i64).collect();
            let msgs = vec![
                DeviceP2p::Send(ints, next),
                DeviceP2p::Recv(vec![0i64; 3000], prev),
            ];
            let back = dc.send_recv_batch_async(msgs).wait().unwrap();
            let DeviceP2p::Recv(got, _) = &back[1] else {
                panic!("a receive comes back second")
            };
            assert!(got
                .iter()
                .enumerate()
                .all(|(i, &v)| v == (prev * 100_000 + i) as i64));
        });
    }
}

/// `abort` from another thread ends a posted session waiting on a message that never comes
/// within a few tens of milliseconds, not at the deadline, and fails the call with the reason.
#[test]
fn abort_ends_a_posted_device_session_at_once() {
    let o = Opts {
        slice_bytes: 1024,
        timeout: std::time::Duration::from_secs(20),
        ..Opts::default()
    };
    ranks(2, &o, |r, dc| {
        // Connect the pair first.
        let w = dc.send_recv_async(msg(r, 0, 10), vec![0f32; 10], 1 - r);
        assert_eq!(w.wait().unwrap().1, msg(1 - r, 0, 10));
        if r == 1 {
            // Alive and quiet (a rank that leaves is seen as gone, not waited for).
            std::thread::sleep(std::time::Duration::from_millis(1500));
            return;
        }
        let h = dc.abort_handle();
        let waits = dc.recv_async(vec![0f32; 64], 1);
        let start = std::time::Instant::now();
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(200));
            h.abort("the test's watchdog");
        });
        let e = waits.wait().unwrap_err();
        t.join().unwrap();
        assert!(e.to_string().contains("the test's watchdog"), "{e}");
        assert!(
            start.elapsed() < std::time::Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
    });
}

/// Every rank posts, for every other rank, three messages to it and three from it (empty to
/// several times the slots), in an order drawn per seed — each peer's sends in order and its
/// receives in order, the peers and directions shuffled together, now and then several in one
/// batch — as the pairs' first calls; only then does it wait, in another drawn order. Every
/// message arrives exact and in order, over shm and tcp device links.
#[test]
fn posted_device_calls_in_any_interleaving_arrive_exact_and_in_order() {
    use ringzero::DeviceP2p;
    let n = 4;
    let count = |src: usize, dst: usize, m: usize, seed: u64| -> usize {
        [0, 1, 700, 3000, 9000][(src * 7 + dst * 3 + m + seed as usize) % 5]
    };
    for (seed, transport) in [
        (1u64, TransportPref::Shm),
        (2, TransportPref::Shm),
        (3, TransportPref::Tcp),
    ] {
        let o = Opts {
            transport,
            slice_bytes: 4096,
            timeout: std::time::Duration::from_secs(10),
            ..Opts::default()
        };
        ranks(n, &o, |r, dc| {
            let mut draw = crate::common::drawer(seed, r);
            let mut works = Vec::new();
            for what in crate::common::drawn_posts(n, r, &mut draw) {
                let msgs = what
                    .iter()
                    .map(|&(q, send, m)| {
                        if send {
                            DeviceP2p::Send(msg(r, q * 10 + m, count(r, q, m, seed)), q)
                        } else {
                            DeviceP2p::Recv(vec![-1f32; count(q, r, m, seed)], q)
                        }
                    })
                    .collect();
                works.push((dc.send_recv_batch_async(msgs), what));
            }
            while !works.is_empty() {
                let (w, what) = works.swap_remove(draw(works.len()));
                let got = w
                    .wait()
                    .unwrap_or_else(|e| panic!("seed {seed} rank {r}: {e}"));
                for (m, (q, send, k)) in got.into_iter().zip(what) {
                    match m {
                        DeviceP2p::Recv(b, p) => {
                            assert!(!send && p == q);
                            let want = msg(q, r * 10 + k, count(q, r, k, seed));
                            assert_eq!(b, want, "seed {seed}: {q}→{r} #{k}");
                        }
                        DeviceP2p::Send(_, p) => assert!(send && p == q),
                    }
                }
            }
            let mut x = vec![1f32; 8];
            dc.all_reduce(InPlace, &mut x[..], ReduceOp::Sum).unwrap();
            assert_eq!(x, [n as f32; 8]);
        });
    }
}

/// A rank's host calls go on while its device communicator connects a pair: rank 0 makes its
/// first device send to rank 1 (posted, or blocking on a thread of its own), then joins a host
/// all-reduce (a trainer's loss) that rank 1 calls before its matching receive. The pair's
/// connect trades its records over the host communicator's links, and must not hold that
/// communicator meanwhile: else rank 0's all-reduce waits for the connect, which waits for rank
/// 1's receive, which comes after the all-reduce — until the deadline. Over shm and tcp, and
/// with a second host call (a barrier) after the pair has connected.
#[test]
fn host_collectives_go_on_while_a_device_pair_connects() {
    for (transport, posted) in [
        (TransportPref::Shm, true),
        (TransportPref::Tcp, true),
        (TransportPref::Shm, false),
    ] {
        let o = Opts {
            transport,
            slice_bytes: 1024,
            timeout: std::time::Duration::from_secs(10),
            ..Opts::default()
        };
        threads(2, &o, |r, comm| {
            let comm = comm.unwrap();
            let mut dc = DeviceComm::new(&comm, HostStream::new()).unwrap();
            let start = std::time::Instant::now();
            let mut loss = [r as f32 + 1.0; 3];
            let len = 3001; // three times the slots: the send waits for the receive
            let all_reduce = |loss: &mut [f32]| {
                if r == 0 {
                    // Let the connect start before the host call.
                    std::thread::sleep(std::time::Duration::from_millis(300));
                }
                comm.all_reduce(InPlace, loss, ReduceOp::Sum).unwrap();
            };
            match (r, posted) {
                (0, true) => {
                    let sent = dc.send_async(msg(0, 0, len), 1);
                    all_reduce(&mut loss);
                    sent.wait().unwrap();
                }
                (0, false) => std::thread::scope(|s| {
                    let dc = &mut dc;
                    let sent = s.spawn(move || dc.send(&msg(0, 0, len)[..], 1));
                    all_reduce(&mut loss);
                    sent.join().unwrap().unwrap();
                }),
                _ => {
                    all_reduce(&mut loss);
                    let got = dc.recv_async(vec![0f32; len], 0).wait().unwrap();
                    assert_eq!(got, msg(0, 0, len), "{transport:?}");
                }
            }
            assert_eq!(loss, [3.0; 3], "{transport:?}");
            comm.barrier().unwrap();
            let took = start.elapsed();
            assert!(
                took < std::time::Duration::from_secs(5),
                "rank {r} over {transport:?}, posted {posted}: {took:?} (the deadline is 10 s)"
            );
        });
    }
}

/// A host collective that fails while the device communicator's connect still trades records
/// over the host links ends that trade too, at once: rank 0 posts a first device send that
/// rank 1 never receives, then the two call host all-reduces of different counts. Both
/// all-reduces fail naming both calls, and rank 0's send fails with the host communicator's
/// failure, all well before the deadline (the failure no longer waits for the record trade's
/// own deadline to reach the point-to-point links).
#[test]
fn a_failed_host_collective_ends_a_device_connect_in_progress() {
    let o = Opts {
        slice_bytes: 1024,
        timeout: std::time::Duration::from_secs(10),
        ..Opts::default()
    };
    threads(2, &o, |r, comm| {
        let comm = comm.unwrap();
        let dc = DeviceComm::new(&comm, HostStream::new()).unwrap();
        let start = std::time::Instant::now();
        let sent = (r == 0).then(|| dc.send_async(msg(0, 0, 3001), 1));
        std::thread::sleep(std::time::Duration::from_millis(300));
        let mut loss = vec![1f32; 3 + r];
        let e = comm
            .all_reduce(InPlace, &mut loss, ReduceOp::Sum)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("count=3") && e.contains("count=4"),
            "rank {r}: {e}"
        );
        if let Some(sent) = sent {
            let e = sent.wait().unwrap_err().to_string();
            // `send_recv with rank 1 seq 0: communicator aborted: rank 0: collective mismatch..`
            assert!(
                e.contains("send_recv with rank 1") && e.contains("count=4"),
                "{e}"
            );
        }
        let took = start.elapsed();
        assert!(
            took < std::time::Duration::from_secs(5),
            "rank {r}: {took:?} (the deadline is 10 s)"
        );
    });
}

/// A device pair that fails tells every peer this rank is linked with, not only the ring's
/// neighbours, so none of them waits for its deadline: on a 4-rank ring (0-1-2-3), ranks 1 and 3
/// (no ring edge between them) connect a pair; then rank 1's receive from rank 0 mismatches the
/// count rank 0 sent, which fails rank 1, while rank 3 waits on a message from rank 1 that
/// never comes. Rank 3 fails with rank 1's abort well before its deadline, and so does rank 0
/// at its next call with rank 1; rank 1 refuses every later call with its first error.
#[test]
fn a_failed_device_pair_ends_every_linked_peers_wait_at_once() {
    let o = Opts {
        timeout: std::time::Duration::from_secs(10),
        ..Opts::default()
    };
    ranks(4, &o, |r, dc| {
        match r {
            1 => dc.send(&msg(1, 0, 100)[..], 3).unwrap(),
            3 => dc.recv(&mut vec![0f32; 100][..], 1).unwrap(),
            _ => {}
        }
        let start = std::time::Instant::now();
        let e = match r {
            0 => {
                let _ = dc.send(&[1f32; 8][..], 1);
                dc.recv(&mut [0f32; 8][..], 1).unwrap_err()
            }
            1 => {
                let e = dc.recv(&mut [0f32; 9][..], 0).unwrap_err();
                let later = dc.send(&[1f32; 4][..], 3).unwrap_err();
                assert!(later.to_string().contains("count=9"), "{later}");
                e
            }
            3 => dc.recv(&mut [0f32; 100][..], 1).unwrap_err(),
            _ => return,
        };
        let took = start.elapsed();
        let t = e.to_string();
        assert!(
            t.contains("count=8") && t.contains("count=9"),
            "rank {r}: {t}"
        );
        assert!(
            took < std::time::Duration::from_secs(5),
            "rank {r} waited {took:?} (the deadline is 10 s): {t}"
        );
    });
}
