//! Every collective, dtype, op, size and transport, with ranks as threads, against the serial
//! reference.

use proptest::prelude::*;
use ringzero::{
    Algo, Collective, Collectives, DType, InPlace, NonBlocking, ReduceOp, TransportKind,
    TransportPref,
};

use crate::common::{check_case, host_collectives, threads, Case, Opts};

/// A transport, and the connections per edge when it is tcp.
fn transport() -> impl Strategy<Value = (TransportPref, usize)> {
    prop_oneof![
        Just((TransportPref::Shm, 1)),
        Just((TransportPref::Tcp, 1)),
        Just((TransportPref::Tcp, 3)),
    ]
}

fn count() -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(0usize),
        Just(1),
        Just(2),
        Just(7),
        Just(13),
        Just(97),
        Just(1009),
        Just(65_537),
        0usize..300,
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, max_shrink_iters: 16, ..ProptestConfig::default() })]
    #[test]
    fn any_collective_matches_the_serial_reference(
        n in 1usize..=8,
        count in count(),
        dtype in proptest::sample::select(DType::ALL.to_vec()),
        op in proptest::sample::select(ReduceOp::ALL.to_vec()),
        which in 0usize..14,
        in_place: bool,
        slice_bytes in prop_oneof![Just(8usize), Just(100), Just(4096), Just(512 * 1024)],
        (transport, tcp_sockets) in transport(),
        root in 0usize..8,
        seed in 0usize..1000,
    ) {
        let coll = host_collectives(root % n)[which];
        let count = if coll == Collective::Barrier { 0 } else { count };
        let case = Case { coll, count, dtype, op, in_place, seed };
        let o = Opts { transport, slice_bytes, tcp_sockets, ..Opts::default() };
        threads(n, &o, |_, comm| {
            let comm = comm.expect("init");
            check_case(&comm, &case);
            // A second call on the same communicator (sequence numbers, slot reuse).
            check_case(&comm, &Case { seed: seed + 1, ..case });
        });
    }
}

#[test]
fn every_dtype_and_op_on_both_transports_with_multi_slice_chunks() {
    every_dtype_and_op(None, 1);
}

#[test]
fn every_dtype_and_op_with_streaming_stores_into_the_results() {
    // Every result written with non-temporal stores (odd counts: unaligned heads and tails);
    // tcp edges of three connections each.
    every_dtype_and_op(Some(0), 3);
}

fn every_dtype_and_op(stream_stores_from: Option<usize>, tcp_sockets: usize) {
    for transport in [TransportPref::Shm, TransportPref::Tcp] {
        let o = Opts {
            transport,
            slice_bytes: 64,
            stream_stores_from,
            tcp_sockets,
            ..Opts::default()
        };
        threads(3, &o, |_, comm| {
            let comm = comm.unwrap();
            for dtype in DType::ALL {
                for op in ReduceOp::ALL {
                    for coll in host_collectives(1) {
                        for in_place in [false, true] {
                            let count = if coll == Collective::Barrier { 0 } else { 301 };
                            check_case(
                                &comm,
                                &Case {
                                    coll,
                                    count,
                                    dtype,
                                    op,
                                    in_place,
                                    seed: 5,
                                },
                            );
                        }
                    }
                }
            }
        });
    }
}

#[test]
fn results_are_bit_identical_across_ranks_transports_and_slicing() {
    // Arbitrary floats (not exactly summable): the order of reduction must not depend on timing,
    // slice size or transport.
    let count = 10_007;
    let input = |rank: usize, i: usize| ((i as f32 * 0.37 + rank as f32 * 1.1).sin() * 1e3) / 7.0;
    let mut runs = Vec::new();
    for (transport, slice_bytes, stream_stores_from, tcp_sockets) in [
        (TransportPref::Shm, 1024, None, 1),
        (TransportPref::Tcp, 64 * 1024, None, 1),
        (TransportPref::Tcp, 1000, None, 4),
        (TransportPref::Shm, 40, None, 1),
        (TransportPref::Shm, 4096, Some(0), 1),
    ] {
        let o = Opts {
            transport,
            slice_bytes,
            stream_stores_from,
            tcp_sockets,
            ..Opts::default()
        };
        let outs = threads(4, &o, |rank, comm| {
            let comm = comm.unwrap();
            let send: Vec<f32> = (0..count).map(|i| input(rank, i)).collect();
            let mut recv = vec![0f32; count];
            comm.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap();
            recv.iter().map(|x| x.to_bits()).collect::<Vec<u32>>()
        });
        assert!(
            outs.iter().all(|o| *o == outs[0]),
            "ranks disagree ({transport:?}, slice {slice_bytes})"
        );
        runs.push(outs[0].clone());
    }
    assert!(
        runs.iter().all(|r| *r == runs[0]),
        "results depend on transport or slicing"
    );
}

#[test]
fn bytes_per_link_match_the_ring_theory() {
    for (transport, tcp_sockets) in [
        (TransportPref::Shm, 1),
        (TransportPref::Tcp, 1),
        (TransportPref::Tcp, 2),
    ] {
        let o = Opts {
            transport,
            tcp_sockets,
            ..Opts::default()
        };
        let n = 4;
        threads(n, &o, |_, comm| {
            let comm = comm.unwrap();
            let s = 4000usize; // f32 elements, divisible by n
            let buf = vec![1f32; s];
            let mut out = vec![0f32; s];
            let before = comm.counters();
            comm.with_algo(Algo::Ring)
                .all_reduce(&buf, &mut out, ReduceOp::Sum)
                .unwrap();
            let mid = comm.counters();
            let mut chunk = vec![0f32; s / n];
            comm.reduce_scatter(&buf, &mut chunk, ReduceOp::Sum)
                .unwrap();
            let after = comm.counters();
            let bytes = (s * 4) as u64;
            assert_eq!(
                mid.bytes_sent - before.bytes_sent,
                2 * (n as u64 - 1) * bytes / n as u64,
                "all-reduce"
            );
            assert_eq!(
                after.bytes_sent - mid.bytes_sent,
                (n as u64 - 1) * bytes / n as u64,
                "reduce-scatter"
            );
            assert_eq!(
                after.bytes_received - mid.bytes_received,
                (n as u64 - 1) * bytes / n as u64
            );
            // Recursive doubling: log2 n exchanges of the whole buffer, each way.
            comm.with_algo(Algo::Doubling)
                .all_reduce(&buf, &mut out, ReduceOp::Sum)
                .unwrap();
            let end = comm.counters();
            assert_eq!(end.bytes_sent - after.bytes_sent, 2 * bytes, "doubling");
            assert_eq!(end.bytes_received - after.bytes_received, 2 * bytes);
            assert_eq!(out, vec![n as f32; s]);
            let kinds: Vec<(TransportKind, usize)> =
                comm.edges().iter().map(|e| (e.kind, e.sockets)).collect();
            let want = if transport == TransportPref::Shm {
                (TransportKind::Shm, 0)
            } else {
                (TransportKind::Tcp, tcp_sockets)
            };
            assert_eq!(kinds, vec![want, want]);
        });
    }
}

#[test]
fn async_collectives_keep_program_order_with_blocking_ones() {
    let o = Opts::default();
    threads(3, &o, |rank, comm| {
        let comm = comm.unwrap();
        let a = comm.all_reduce_async(vec![rank as i64 + 1; 1000], ReduceOp::Sum);
        let b = comm.reduce_scatter_async(
            vec![2i32; 10],
            vec![0; comm.chunk_range(10).len()],
            ReduceOp::Prod,
        );
        let c = comm.all_gather_async(vec![rank as u8; comm.chunk_range(7).len()], vec![9; 7]);
        let d = comm.broadcast_async(vec![rank as f64; 5], 2);
        // A blocking call after asynchronous ones runs after them on every rank.
        let mut x = vec![1f32; 3];
        comm.all_reduce(InPlace, &mut x, ReduceOp::Sum).unwrap();
        assert_eq!(x, vec![3.0; 3]);
        assert_eq!(a.wait().unwrap(), vec![6; 1000]);
        assert_eq!(b.wait().unwrap().1, vec![8; comm.chunk_range(10).len()]);
        assert_eq!(c.wait().unwrap().1, vec![0, 0, 0, 1, 1, 2, 2]);
        assert!(d.is_done());
        assert_eq!(d.wait().unwrap(), vec![2.0; 5]);
    });
}

#[test]
fn one_rank_world_needs_no_links() {
    let o = Opts::default();
    threads(1, &o, |_, comm| {
        let comm = comm.unwrap();
        assert!(comm.edges().is_empty());
        for coll in host_collectives(0) {
            for in_place in [false, true] {
                check_case(
                    &comm,
                    &Case {
                        coll,
                        count: 17,
                        dtype: DType::F32,
                        op: ReduceOp::Avg,
                        in_place,
                        seed: 1,
                    },
                );
            }
        }
    });
}

#[test]
fn slice_sized_frames_striped_over_four_connections_match_the_reference() {
    // 512 KiB slices over tcp edges of four connections: the ring's frames travel in four parts
    // each (the smaller tests' frames fit in one).
    let o = Opts {
        transport: TransportPref::Tcp,
        slice_bytes: 512 << 10,
        tcp_sockets: 4,
        ..Opts::default()
    };
    threads(3, &o, |_, comm| {
        let comm = comm.unwrap();
        for (k, coll) in host_collectives(2).into_iter().enumerate() {
            for dtype in [DType::F32, DType::BF16] {
                let count = if coll == Collective::Barrier {
                    0
                } else {
                    300_007
                };
                check_case(
                    &comm,
                    &Case {
                        coll,
                        count,
                        dtype,
                        op: ReduceOp::Sum,
                        in_place: k % 2 == 0,
                        seed: k,
                    },
                );
            }
        }
        assert!(comm.edges().iter().all(|e| e.sockets == 4));
    });
}
