//! All-to-all on thread ranks: the bytes it moves, link reuse, bad counts, and a rank that calls
//! something else. (Its results against the serial reference are in the proptest and the
//! process scenarios, through `host_collectives`.)

use std::time::{Duration, Instant};

use ringzero::{Algo, Collective, Collectives, DType, Error, InPlace, ReduceOp, TransportPref};

use crate::common::{check_case, threads, Case, Opts};

#[test]
fn all_to_all_sends_n_minus_1_over_n_of_the_buffer_and_connects_once() {
    for transport in [TransportPref::Shm, TransportPref::Tcp] {
        for n in 2..=5usize {
            let o = Opts {
                transport,
                ..Opts::default()
            };
            threads(n, &o, |_, comm| {
                let comm = comm.unwrap();
                let count = n * 1000;
                for seed in 0..3 {
                    let before = comm.counters();
                    let case = Case {
                        coll: Collective::AllToAll,
                        count,
                        dtype: DType::F64,
                        op: ReduceOp::Sum,
                        in_place: seed == 1,
                        seed,
                    };
                    check_case(&comm, &case);
                    let after = comm.counters();
                    // Payload bytes: n − 1 blocks of count/n f64 out, as many in.
                    let want = ((n - 1) * (count / n) * 8) as u64;
                    assert_eq!(
                        after.bytes_sent - before.bytes_sent,
                        want,
                        "{transport:?} n={n}"
                    );
                    assert_eq!(after.bytes_received - before.bytes_received, want);
                }
                assert_eq!(
                    comm.edges().len(),
                    2,
                    "the ring's edges are still the ring's"
                );
            });
        }
    }
}

#[test]
fn all_to_all_refuses_bad_counts_and_names_a_rank_that_calls_something_else() {
    let o = Opts {
        transport: TransportPref::Tcp,
        timeout: Duration::from_secs(20),
        ..Opts::default()
    };
    let t = Instant::now();
    let errs = threads(3, &o, |rank, comm| {
        let comm = comm.unwrap();
        let mut recv = vec![0f32; 10];
        let e = comm.all_to_all(&[1f32; 10], &mut recv).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        assert!(
            e.to_string()
                .contains("send has 10 elements, not a multiple of the world size 3"),
            "{e}"
        );
        let e = comm.all_to_all(&[1f32; 9], &mut recv).unwrap_err();
        assert!(
            e.to_string()
                .contains("send has 9 elements but recv has 10"),
            "{e}"
        );
        // Refused calls changed nothing: the next all-to-all works.
        let mut out = vec![0f32; 3];
        comm.all_to_all(&[rank as f32; 3], &mut out).unwrap();
        assert_eq!(out, vec![0.0, 1.0, 2.0]);
        // Rank 0 calls all-to-all, the others all-reduce.
        let mut b = vec![1f32; 6];
        let e = if rank == 0 {
            comm.all_to_all(&[1f32; 6], &mut b).unwrap_err()
        } else {
            comm.with_algo(Algo::Ring)
                .all_reduce(InPlace, &mut b, ReduceOp::Sum)
                .unwrap_err()
        };
        e.to_string()
    });
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "a mismatch must not wait for the deadline: {errs:?}"
    );
    for e in &errs[..2] {
        assert!(
            e.contains("all_to_all(f32, count=6)") && e.contains("all_reduce(f32, sum, count=6)"),
            "{e}"
        );
    }
}

#[test]
fn a_first_all_to_all_against_a_ring_collective_fails_at_once_not_in_a_connect() {
    // Rank 0's first all-to-all would connect its pair links; the others never will. Its ring
    // exchange runs first, so both sides meet the other's frame and fail with both calls named.
    let o = Opts {
        timeout: Duration::from_secs(20),
        ..Opts::default()
    };
    let t = Instant::now();
    let errs = threads(4, &o, |rank, comm| {
        let comm = comm.unwrap();
        let mut b = vec![1f32; 8];
        let e = if rank == 0 {
            comm.all_to_all(&[1f32; 8], &mut b).unwrap_err()
        } else {
            comm.with_algo(Algo::Ring)
                .all_reduce(InPlace, &mut b, ReduceOp::Sum)
                .unwrap_err()
        };
        e.to_string()
    });
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "a mismatch must not wait for the deadline: {errs:?}"
    );
    assert!(
        errs[0].contains("all_to_all(f32, count=8)")
            && errs[0].contains("all_reduce(f32, sum, count=8)"),
        "{}",
        errs[0]
    );
}

/// An in-place all-to-all sends from a copy the communicator keeps for the next one: a smaller
/// call after a larger one uses only its own part of it, and a larger one grows it; every
/// result checked against the serial reference.
#[test]
fn in_place_all_to_alls_of_changing_sizes_reuse_the_kept_copy() {
    for transport in [TransportPref::Shm, TransportPref::Tcp] {
        let o = Opts {
            transport,
            ..Opts::default()
        };
        let n = 3;
        threads(n, &o, |_, comm| {
            let comm = comm.unwrap();
            for (seed, blocks) in [(0, 4000), (1, 7), (2, 1), (3, 9000), (4, 4000)] {
                check_case(
                    &comm,
                    &Case {
                        coll: Collective::AllToAll,
                        count: n * blocks,
                        dtype: DType::F32,
                        op: ReduceOp::Sum,
                        in_place: true,
                        seed,
                    },
                );
            }
        });
    }
}
