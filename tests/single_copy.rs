//! The single-copy all-gather (`RINGZERO_SINGLE_COPY_FROM`): ranks whose ring edges are all
//! shared memory read each other's part straight out of the owner's process. Ranks as threads
//! read their own process (`process_vm_readv` on its own pid, the same call); the processes
//! tests (`processes.rs`) read across processes and kill a rank mid-call.

use std::time::{Duration, Instant};

use ringzero::{Collectives, Communicator, DType, Error, InPlace, ReduceOp, TransportPref};

use crate::common::{check_case, threads, Case, Opts};

fn single_copy(from: usize) -> Opts {
    Opts {
        single_copy_from: Some(from),
        ..Opts::default()
    }
}

/// Bytes the ring's links moved so far.
fn link_bytes(comm: &Communicator) -> u64 {
    comm.counters().bytes_sent
}

#[test]
fn all_gathers_of_every_dtype_read_directly_and_match_the_reference() {
    for n in [2, 3, 4] {
        threads(n, &single_copy(0), |_, comm| {
            let comm = comm.unwrap();
            assert_eq!(comm.single_copy_sizes(), Some(0..usize::MAX));
            let mut seed = 0;
            for dtype in DType::ALL {
                for in_place in [false, true] {
                    // Uneven chunks, empty ones (count < n), and one larger than a slot.
                    for count in [0, 1, 3, 1001, 70_003] {
                        seed += 1;
                        let before = link_bytes(&comm);
                        let case = Case {
                            coll: ringzero::Collective::AllGather,
                            count,
                            dtype,
                            op: ReduceOp::Sum,
                            in_place,
                            seed,
                        };
                        check_case(&comm, &case);
                        // Nothing went round the ring: the parts were read, not sent.
                        assert_eq!(link_bytes(&comm), before, "{case:?}");
                    }
                }
            }
            let rec = comm.flight_record();
            let last = rec.entries.last().unwrap();
            assert!(last.call.contains("single copy"), "{}", last.call);
        });
    }
}

#[test]
fn the_thresholds_split_the_sizes_alike_on_every_rank() {
    // From 4 KiB to below 16 KiB read directly; the rest goes round the ring. Every rank agrees.
    let port = crate::common::free_port();
    std::thread::scope(|s| {
        for r in 0..3 {
            let mut c = crate::common::config(r, 3, port, &single_copy(4096));
            c.single_copy_below = 16 << 10;
            s.spawn(move || thresholds(r, Communicator::init(c)));
        }
    });
}

fn thresholds(r: usize, comm: ringzero::Result<Communicator>) {
    {
        let comm = comm.unwrap();
        assert_eq!(comm.single_copy_sizes(), Some(4096..16 << 10));
        for count in [10, 1023, 1024, 4095, 4096, 5000] {
            let send = vec![r as f32 + 0.5; comm.chunk_range(count).len()];
            let mut recv = vec![0f32; count];
            let before = link_bytes(&comm);
            comm.all_gather(&send[..], &mut recv).unwrap();
            for q in 0..3 {
                let c = ringzero::chunk(count, 3, q);
                assert!(recv[c].iter().all(|&x| x == q as f32 + 0.5));
            }
            let direct = (4096..16 << 10).contains(&(count * 4));
            assert_eq!(link_bytes(&comm) == before, direct, "count {count}");
        }
    }
}

#[test]
fn off_or_a_tcp_edge_keeps_every_all_gather_on_the_ring() {
    threads(2, &single_copy(usize::MAX), |_, comm| {
        assert_eq!(comm.unwrap().single_copy_sizes(), None);
    });
    let tcp = Opts {
        transport: TransportPref::Tcp,
        ..single_copy(0)
    };
    threads(2, &tcp, |_, comm| {
        let comm = comm.unwrap();
        assert_eq!(comm.single_copy_sizes(), None);
        let mut buf = vec![1u8; 1 << 16];
        comm.all_gather(InPlace, &mut buf[..]).unwrap();
    });
}

#[test]
fn a_rank_in_another_call_fails_every_rank_at_once_naming_both() {
    let t = Instant::now();
    let o = Opts {
        timeout: Duration::from_secs(30),
        ..single_copy(0)
    };
    let errs = threads(2, &o, |r, comm| {
        let comm = comm.unwrap();
        let mut buf = vec![1f32; 4096];
        match r {
            0 => comm.all_gather(InPlace, &mut buf[..]).unwrap_err(),
            _ => comm
                .all_reduce(InPlace, &mut buf[..], ReduceOp::Sum)
                .unwrap_err(),
        }
    });
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    match &errs[0] {
        Error::Mismatch { ours, theirs, .. } => {
            assert!(
                ours.contains("all_gather") && ours.contains("single copy"),
                "{ours}"
            );
            assert!(theirs.contains("all_reduce"), "{theirs}");
        }
        e => panic!("rank 0: {e}"),
    }
    // Rank 1 waited on the ring; rank 0 told it why it stopped.
    let e1 = errs[1].to_string();
    assert!(
        e1.contains("all_reduce") && e1.contains("all_gather"),
        "{e1}"
    );
}

#[test]
fn ranks_disagreeing_on_the_threshold_fail_naming_both_calls() {
    // Rank 0 reads directly, rank 1 goes round the ring: the same collective, two algorithms.
    let t = Instant::now();
    let port = crate::common::free_port();
    let errs: Vec<Error> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let mut c = crate::common::config(r, 2, port, &Opts::default());
                c.timeout = Duration::from_secs(30);
                c.single_copy_from = if r == 0 { 0 } else { 1 << 20 };
                c.single_copy_below = usize::MAX;
                s.spawn(move || {
                    let comm = Communicator::init(c).unwrap();
                    let mut buf = vec![1f32; 4096];
                    comm.all_gather(InPlace, &mut buf[..]).unwrap_err()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    let e0 = errs[0].to_string();
    assert!(
        e0.contains("single copy") && e0.contains("all_gather"),
        "{e0}"
    );
    assert!(matches!(errs[0], Error::Mismatch { .. }), "{e0}");
    assert!(errs[1].to_string().contains("all_gather"), "{}", errs[1]);
}

#[test]
fn an_abort_during_the_call_fails_every_rank_within_the_deadline() {
    let o = Opts {
        timeout: Duration::from_secs(30),
        ..single_copy(0)
    };
    let t = Instant::now();
    let errs = threads(3, &o, |r, comm| {
        let comm = comm.unwrap();
        let mut buf = vec![1f32; 1 << 16];
        if r == 2 {
            // Rank 2 never enters the call; it aborts instead.
            std::thread::sleep(Duration::from_millis(200));
            comm.abort("the test stops rank 2");
            return None;
        }
        Some(comm.all_gather(InPlace, &mut buf[..]).unwrap_err())
    });
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    for e in errs.into_iter().flatten() {
        let s = e.to_string();
        assert!(s.contains("the test stops rank 2"), "{s}");
        assert!(s.contains("all_gather"), "{s}");
    }
}

#[test]
fn all_gathers_from_shared_buffers_read_through_kept_mappings() {
    for n in [2, 3] {
        threads(n, &single_copy(0), |r, comm| {
            let comm = comm.unwrap();
            let value = |i: usize| (i * 7 + 1) as f32;
            // Uneven chunks, an empty one (count < n), in place, and an input at an offset
            // inside a larger shared buffer.
            for (count, in_place, offset) in [
                (1001, false, 0),
                (70_003, false, 5),
                (70_003, true, 0),
                (2, false, 0),
            ] {
                let c = comm.chunk_range(count);
                let mut out = vec![0f32; count];
                let before = comm.counters();
                if in_place {
                    let mut buf = ringzero::SharedBuf::<f32>::zeroed(count).unwrap();
                    for i in c.clone() {
                        buf[i] = value(i);
                    }
                    comm.all_gather(InPlace, &mut buf[..]).unwrap();
                    out.copy_from_slice(&buf);
                } else {
                    let mut big = ringzero::SharedBuf::<f32>::zeroed(offset + c.len() + 3).unwrap();
                    for (k, i) in c.clone().enumerate() {
                        big[offset + k] = value(i);
                    }
                    comm.all_gather(&big[offset..offset + c.len()], &mut out)
                        .unwrap();
                }
                let after = comm.counters();
                let want: Vec<f32> = (0..count).map(value).collect();
                assert_eq!(out, want, "rank {r} of {n}, count {count}");
                // Every other rank's part came through a mapping; nothing went round the ring.
                let read = ((count - c.len()) * 4) as u64;
                assert_eq!(
                    after.bytes_mapped - before.bytes_mapped,
                    read,
                    "count {count}"
                );
                assert_eq!(after.bytes_sent, before.bytes_sent);
            }
            // An input outside any shared buffer is read with process_vm_readv, as before.
            let mine = vec![r as f32; comm.chunk_range(4000).len()];
            let mut out = vec![0f32; 4000];
            let before = comm.counters().bytes_mapped;
            comm.all_gather(&mine[..], &mut out).unwrap();
            assert_eq!(comm.counters().bytes_mapped, before);
            for q in 0..n {
                assert!(out[ringzero::chunk(4000, n, q)]
                    .iter()
                    .all(|&x| x == q as f32));
            }
        });
    }
}
