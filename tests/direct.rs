//! The direct collectives (`RINGZERO_DEVICE_ALGO=direct`): ranks that map each other's buffers
//! reduce their chunk of every input and write it into every output, agreeing on each call on
//! the node board. On the host stream, ranks that are threads of one process share their buffers
//! as plain addresses, so the whole protocol — board, sharing, mappings, the one-pass kernel on an
//! asynchronous stream — runs here; on a GPU the same code opens CUDA IPC handles.

use std::time::{Duration, Instant};

use ringzero::{
    chunk, Collective, Collectives, Communicator, DType, DeviceAlgo, DeviceComm, Error, HostStream,
    InPlace, ReduceOp,
};

use crate::common::{all_collectives, check_with, threads, Case, Opts};
use crate::device::HangingCopies;

fn direct() -> Opts {
    Opts {
        device_algo: DeviceAlgo::Direct,
        slice_bytes: 1024,
        ..Opts::default()
    }
}

fn device_comm(comm: &Communicator) -> DeviceComm<HostStream> {
    DeviceComm::new(comm, HostStream::new())
        .unwrap_or_else(|e| panic!("rank {}: device comm: {e}", comm.rank()))
}

/// Every collective, dtype and op, in and out of place: those with a direct form take it (the
/// ring moves no byte for them), the others go round the ring after the board's first step.
#[test]
fn every_collective_dtype_and_op_with_direct_steps_matches_the_reference() {
    for n in [2, 3, 4] {
        threads(n, &direct(), |_, comm| {
            let comm = comm.unwrap();
            let mut dc = device_comm(&comm);
            let why = dc.direct().expect("direct was asked for").to_string();
            assert!(why.contains("RINGZERO_DEVICE_ALGO=direct"), "{why}");
            let mut seed = 0;
            for dtype in DType::ALL {
                for op in ReduceOp::ALL {
                    for (k, coll) in all_collectives(n - 1).into_iter().enumerate() {
                        for in_place in [false, true] {
                            for count in [[3001, 1], [7, 2050], [0, 999]][(k + seed) % 3] {
                                let count = if coll == Collective::Barrier {
                                    0
                                } else {
                                    count
                                };
                                seed += 1;
                                let before = dc.counters();
                                check_with(
                                    &mut dc,
                                    &Case {
                                        coll,
                                        count,
                                        dtype,
                                        op,
                                        in_place,
                                        seed,
                                    },
                                );
                                let after = dc.counters();
                                let direct_form =
                                    ringzero_collectives::device::direct::has_direct_form(coll);
                                if direct_form && count > 0 {
                                    assert_eq!(
                                        after.bytes_sent, before.bytes_sent,
                                        "{coll} of {count} went round the ring"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        });
    }
}

/// What a direct all-reduce writes into the other ranks, and that the ring stays idle.
#[test]
fn a_direct_all_reduce_writes_its_chunk_into_every_other_rank_and_sends_no_frame() {
    let n = 3;
    let count = 30_001usize;
    threads(n, &direct(), |rank, comm| {
        let comm = comm.unwrap();
        let dc = device_comm(&comm);
        let send: Vec<f32> = (0..count).map(|i| (i % 97) as f32 + rank as f32).collect();
        let mut recv = vec![0.0f32; count];
        let before = dc.counters();
        for _ in 0..3 {
            dc.all_reduce(&send[..], &mut recv[..], ReduceOp::Avg)
                .unwrap();
        }
        for (i, v) in recv.iter().enumerate() {
            assert_eq!(*v, (i % 97) as f32 + 1.0, "element {i}");
        }
        let after = dc.counters();
        assert_eq!(after.bytes_sent, before.bytes_sent);
        assert_eq!(after.frames_sent, before.frames_sent);
        let mine = chunk(count, n, rank).len();
        assert_eq!(
            after.bytes_direct - before.bytes_direct,
            3 * ((n - 1) * mine * 4) as u64
        );
    });
}

/// A direct all-to-all pulls every block into the rank's own output: no frame, nothing written
/// into another rank's buffer; in place it sends from the communicator's kept copy.
#[test]
fn a_direct_all_to_all_pulls_its_blocks_and_writes_no_other_rank() {
    let n = 3;
    let b = 10_007usize;
    threads(n, &direct(), |rank, comm| {
        let comm = comm.unwrap();
        let dc = device_comm(&comm);
        let send: Vec<f32> = (0..n * b).map(|i| (i + rank * n * b) as f32).collect();
        let before = dc.counters();
        for in_place in [false, true, true] {
            let mut recv = vec![0.0f32; n * b];
            if in_place {
                recv.copy_from_slice(&send);
                dc.all_to_all(InPlace, &mut recv[..]).unwrap();
            } else {
                dc.all_to_all(&send[..], &mut recv[..]).unwrap();
            }
            for (i, v) in recv.iter().enumerate() {
                let (q, e) = (i / b, i % b);
                assert_eq!(*v, (q * n * b + rank * b + e) as f32, "element {i}");
            }
        }
        let after = dc.counters();
        assert_eq!(after.bytes_sent, before.bytes_sent, "went round the ring");
        assert_eq!(after.frames_sent, before.frames_sent);
        assert_eq!(after.bytes_direct, before.bytes_direct, "wrote into a peer");
    });
}

/// Auto keeps the ring on the host stream (direct is for ranks sharing one GPU); `ring` keeps it
/// everywhere; `direct` where peers may not map each other is refused at set-up with the reason.
#[test]
fn auto_and_ring_keep_the_ring_and_an_impossible_direct_is_refused_with_the_reason() {
    for algo in [DeviceAlgo::Auto, DeviceAlgo::Ring] {
        let o = Opts {
            device_algo: algo,
            ..Opts::default()
        };
        threads(2, &o, |_, comm| {
            let comm = comm.unwrap();
            let dc = device_comm(&comm);
            assert_eq!(dc.direct(), None, "{algo}");
            let send = [2.0f64; 100];
            let mut out = [0.0f64; 100];
            let before = dc.counters();
            dc.all_reduce(&send[..], &mut out[..], ReduceOp::Sum)
                .unwrap();
            assert_eq!(out, [4.0; 100]);
            assert!(dc.counters().bytes_sent > before.bytes_sent);
            assert_eq!(dc.counters().bytes_direct, 0);
        });
    }
    let port = crate::common::free_port();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let mut cfg = crate::common::config(rank, 2, port, &direct());
                cfg.p2p_disable = true;
                s.spawn(move || {
                    let comm = Communicator::init(cfg).unwrap();
                    let e = DeviceComm::new(&comm, HostStream::new())
                        .err()
                        .expect("refused")
                        .to_string();
                    assert!(
                        e.contains("RINGZERO_DEVICE_ALGO")
                            && e.contains("RINGZERO_P2P_DISABLE=1 forbids peer access"),
                        "{e}"
                    );
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
    });
}

/// Ranks that call different things fail at the board's first step, each naming the other's
/// call, well before the deadline; a collective without a direct form against one with it too.
#[test]
fn mismatched_direct_calls_fail_at_once_naming_both() {
    let o = Opts {
        timeout: Duration::from_secs(30),
        ..direct()
    };
    threads(2, &o, |rank, comm| {
        let comm = comm.unwrap();
        let dc = device_comm(&comm);
        let send = vec![1.0f32; 200];
        let mut out = vec![0.0f32; 200];
        let t = Instant::now();
        let r = if rank == 0 {
            dc.all_reduce(&send[..100], &mut out[..100], ReduceOp::Sum)
        } else {
            dc.all_reduce(&send[..], &mut out[..], ReduceOp::Sum)
        };
        let e = r.unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(10), "{e}");
        match &e {
            Error::Mismatch {
                peer, ours, theirs, ..
            } => {
                assert_eq!(*peer, 1 - rank);
                assert!(ours.contains("all_reduce") && theirs.contains("all_reduce"));
                assert_ne!(ours, theirs);
            }
            other => panic!("rank {rank}: {other}"),
        }
    });
    threads(2, &o, |rank, comm| {
        let comm = comm.unwrap();
        let dc = device_comm(&comm);
        let mut buf = vec![1.0f32; 64];
        let t = Instant::now();
        let r = if rank == 0 {
            dc.all_reduce(InPlace, &mut buf[..], ReduceOp::Sum)
        } else {
            dc.broadcast(InPlace, &mut buf[..], 0)
        };
        let e = r.unwrap_err().to_string();
        assert!(t.elapsed() < Duration::from_secs(10), "{e}");
        assert!(e.contains("all_reduce") && e.contains("broadcast"), "{e}");
    });
}

/// A rank that never comes to the call: the others time out naming it and the step; a rank that
/// drops its communicator while another waits on the board: the waiting rank names it at once.
#[test]
fn a_missing_or_departed_rank_is_named_by_the_board() {
    let o = Opts {
        timeout: Duration::from_millis(1500),
        ..direct()
    };
    threads(3, &o, |rank, comm| {
        let comm = comm.unwrap();
        let dc = device_comm(&comm);
        let mut buf = vec![1.0f32; 300];
        if rank != 2 {
            let e = dc
                .all_reduce(InPlace, &mut buf[..], ReduceOp::Sum)
                .unwrap_err();
            match &e {
                Error::Timeout { peer, waiting, .. } => {
                    assert_eq!(*peer, 2, "{e}");
                    assert!(waiting.contains("direct step 1"), "{e}");
                }
                Error::Aborted { reason, .. } => {
                    // The other waiting rank timed out first and told the board.
                    assert!(reason.contains("rank 2"), "{e}");
                }
                other => panic!("rank {rank}: {other}"),
            }
        } else {
            // Stay until the others have given up (beyond their deadline).
            std::thread::sleep(Duration::from_millis(2500));
        }
        comm.barrier().unwrap();
    });
    let o = Opts {
        timeout: Duration::from_secs(30),
        ..direct()
    };
    threads(2, &o, |rank, comm| {
        let comm = comm.unwrap();
        let dc = device_comm(&comm);
        let mut buf = vec![1.0f32; 300];
        // In step: one call together first.
        dc.all_reduce(InPlace, &mut buf[..], ReduceOp::Sum).unwrap();
        if rank == 1 {
            std::thread::sleep(Duration::from_millis(300));
            drop(dc);
        } else {
            let t = Instant::now();
            let e = dc
                .all_reduce(InPlace, &mut buf[..], ReduceOp::Sum)
                .unwrap_err();
            assert!(t.elapsed() < Duration::from_secs(10), "{e}");
            match &e {
                Error::PeerLost { peer: 1, .. } => {}
                other => panic!("{other}"),
            }
        }
    });
}

/// One rank whose buffers cannot be shared (memory CUDA IPC cannot export): every rank takes the
/// ring for the call, alike, and gets the right result.
#[test]
fn a_rank_that_cannot_share_its_buffers_sends_every_rank_round_the_ring() {
    threads(3, &direct(), |rank, comm| {
        let comm = comm.unwrap();
        let stream = HangingCopies {
            inner: HostStream::new(),
            hang: false,
            hung: Default::default(),
            refuse_share: rank == 2,
            pairs: Default::default(),
            slow_ms: Default::default(),
            late: Default::default(),
        };
        let dc = DeviceComm::new(&comm, stream).unwrap();
        assert!(dc.direct().is_some());
        let send = vec![rank as i64 + 1; 5000];
        let mut out = vec![0i64; 5000];
        for _ in 0..2 {
            let bufs = ringzero_collectives::internals::ring::device_engine::DevBufs::Split {
                input: send.as_ptr() as u64,
                input_bytes: send.len() * 8,
                output: out.as_mut_ptr() as u64,
                output_bytes: out.len() * 8,
            };
            // SAFETY: both vectors are live host memory of the lengths given (the host stream's
            // addresses), untouched until the call returns.
            unsafe { dc.run_raw(Collective::AllReduce, DType::I64, ReduceOp::Sum, 5000, bufs) }
                .unwrap();
            assert!(out.iter().all(|&v| v == 6));
        }
        let c = dc.counters();
        assert_eq!(c.bytes_direct, 0, "rank {rank}");
        assert!(c.bytes_sent > 0, "rank {rank}");
    });
}

/// A rank whose direct step's kernel lands after the others' deadline: no rank returns while it
/// may still write into that rank's buffers. Rank 1's kernel writes its chunk of every output
/// 1.5 s late, the deadline is 0.3 s: rank 0, done with its own part, waits for it (and returns
/// its full, right result); rank 1 fails by timeout, and returns only once its late writes have
/// landed.
#[test]
fn no_rank_returns_while_another_may_still_write_its_buffers() {
    let slow = std::time::Duration::from_millis(1500);
    let o = Opts {
        timeout: std::time::Duration::from_millis(300),
        ..direct()
    };
    threads(2, &o, |rank, comm| {
        let comm = comm.unwrap();
        let dc = if rank == 1 {
            crate::device::slow_device(&comm, slow)
        } else {
            crate::device::slow_device(&comm, std::time::Duration::ZERO)
        };
        assert!(dc.direct().is_some());
        // Leaked: had a call returned early, the late kernel would still write into them.
        let send: &'static [i64] = Box::leak(vec![rank as i64 + 1; 4096].into_boxed_slice());
        let out: &'static mut [i64] = Box::leak(vec![0i64; 4096].into_boxed_slice());
        let bufs = ringzero_collectives::internals::ring::device_engine::DevBufs::Split {
            input: send.as_ptr() as u64,
            input_bytes: send.len() * 8,
            output: out.as_mut_ptr() as u64,
            output_bytes: out.len() * 8,
        };
        let t = std::time::Instant::now();
        // SAFETY: both are live host memory of the lengths given (leaked), borrowed for the call.
        let r = unsafe { dc.run_raw(Collective::AllReduce, DType::I64, ReduceOp::Sum, 4096, bufs) };
        let took = t.elapsed();
        assert!(took >= slow, "rank {rank}: returned after {took:?} ({r:?})");
        match rank {
            0 => {
                r.unwrap();
                assert!(
                    out.iter().all(|&v| v == 3),
                    "rank 0: rank 1's chunk had landed"
                );
            }
            _ => assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}"),
        }
    });
}
