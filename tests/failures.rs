//! Failure behaviour with ranks as threads: mismatched calls, wrong secrets, garbage on the
//! wire, stuck peers, bad arguments. Every error must name what went wrong, and nothing may hang.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use ringzero::{Collectives, Communicator, Error, InPlace, NonBlocking, ReduceOp, TransportPref};
use ringzero_collectives::internals::bootstrap::{Identity, Role};
use ringzero_collectives::internals::transport::tcp;

use crate::common::{config, free_port, threads, Opts};

fn both(transport: TransportPref, timeout: Duration) -> Opts {
    Opts {
        transport,
        timeout,
        ..Opts::default()
    }
}

#[test]
fn mismatched_collectives_fail_fast_with_both_calls_named() {
    for transport in [TransportPref::Shm, TransportPref::Tcp] {
        let t = Instant::now();
        let errs = threads(
            2,
            &both(transport, Duration::from_secs(20)),
            |rank, comm| {
                let comm = comm.unwrap();
                let send = vec![1f32; 64];
                let mut recv = vec![0f32; 64];
                let e = if rank == 0 {
                    comm.all_reduce(&send, &mut recv, ReduceOp::Sum)
                        .unwrap_err()
                } else {
                    comm.all_gather(&send[comm.chunk_range(64)], &mut recv)
                        .unwrap_err()
                };
                // The communicator stays failed, naming the first cause.
                let again = comm.barrier().unwrap_err();
                assert!(matches!(again, Error::Aborted { .. }), "{again}");
                e.to_string()
            },
        );
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "mismatch must not wait for the deadline"
        );
        for e in &errs {
            // Over tcp two ranks all-reduce by doubling: "all_reduce(f32, sum, count=64, by
            // doubling)".
            assert!(
                e.contains("all_reduce(f32, sum, count=64")
                    && e.contains("all_gather(f32, count=64)"),
                "{transport:?}: {e}"
            );
        }
    }
}

#[test]
fn different_counts_are_a_mismatch() {
    let errs = threads(
        3,
        &both(TransportPref::Tcp, Duration::from_secs(20)),
        |rank, comm| {
            let comm = comm.unwrap();
            let n = if rank == 2 { 100 } else { 99 };
            let mut b = vec![1i32; n];
            comm.all_reduce(InPlace, &mut b, ReduceOp::Max)
                .unwrap_err()
                .to_string()
        },
    );
    assert!(
        errs.iter()
            .any(|e| e.contains("count=100") && e.contains("count=99")),
        "{errs:?}"
    );
}

#[test]
fn a_wrong_secret_is_refused_and_nobody_hangs() {
    let t = Instant::now();
    let port = free_port();
    let errs: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|rank| {
                let secret = if rank == 2 { "intruder" } else { "right" };
                let o = Opts {
                    secret,
                    timeout: Duration::from_secs(3),
                    ..Opts::default()
                };
                s.spawn(
                    move || match Communicator::init(config(rank, 3, port, &o)) {
                        Ok(_) => panic!("rank {rank} joined a job with a wrong secret in it"),
                        Err(e) => e.to_string(),
                    },
                )
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(errs[2].contains("RINGZERO_SECRET"), "{}", errs[2]);
    assert!(
        errs[0].contains("rank 2") && errs[1].contains("rank 2"),
        "{errs:?}"
    );
    // The store told the others at once: well inside their 3 s deadline.
    assert!(
        t.elapsed() < Duration::from_millis(2500),
        "took {:?}",
        t.elapsed()
    );
}

#[test]
fn random_bytes_on_the_store_port_do_not_disturb_the_job() {
    let port = free_port();
    let o = Opts::default();
    std::thread::scope(|s| {
        let o = &o;
        let rank = move |r: usize| {
            let comm = Communicator::init(config(r, 2, port, o))?;
            let mut b = vec![2u8; 10];
            comm.all_reduce(InPlace, &mut b, ReduceOp::Sum)?;
            Ok::<_, Error>(b)
        };
        let r0 = s.spawn(move || rank(0));
        // Pester the store while rank 0 waits for rank 1.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut pestered = 0;
        while pestered < 3 {
            assert!(Instant::now() < deadline, "store never came up");
            if let Ok(mut c) = TcpStream::connect(("127.0.0.1", port)) {
                let junk: Vec<u8> = (0..500).map(|i| (i * 37 % 251) as u8).collect();
                let _ = c.write_all(&junk);
                pestered += 1;
            } else {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let r1 = s.spawn(move || rank(1));
        assert_eq!(r0.join().unwrap().unwrap(), vec![4u8; 10]);
        assert_eq!(r1.join().unwrap().unwrap(), vec![4u8; 10]);
    });
}

#[test]
fn data_listener_drops_garbage_and_strangers_and_accepts_the_peer() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let me = Identity {
        secret: b"k",
        job_id: "job",
        rank: 1,
    };
    let mut junk = TcpStream::connect(addr).unwrap();
    junk.write_all(&[0xff; 300]).unwrap();
    // A caller that connects and then says nothing must not hold up the real peer.
    let _silent = TcpStream::connect(addr).unwrap();
    let t = Instant::now();
    let stranger = std::thread::spawn(move || {
        let other_job = Identity {
            secret: b"k",
            job_id: "other",
            rank: 0,
        };
        tcp::connect(addr, &other_job, 1, Duration::from_secs(5))
            .unwrap_err()
            .to_string()
    });
    let peer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        let mine = Identity {
            secret: b"k",
            job_id: "job",
            rank: 0,
        };
        tcp::connect(addr, &mine, 1, Duration::from_secs(5)).map(|_| ())
    });
    let accepted = tcp::accept_from(&l, &me, 0, Duration::from_secs(30)).unwrap();
    assert!(accepted.peer_addr().is_ok());
    assert!(
        t.elapsed() < Duration::from_secs(8),
        "the silent caller held up the peer: {:?}",
        t.elapsed()
    );
    assert!(stranger.join().unwrap().contains("job id mismatch"));
    peer.join().unwrap().unwrap();
    let _ = Role::Data;
}

#[test]
fn a_stuck_peer_times_out_with_the_collective_seq_and_peer_named() {
    for transport in [TransportPref::Shm, TransportPref::Tcp] {
        let errs = threads(
            2,
            &both(transport, Duration::from_millis(800)),
            |rank, comm| {
                let comm = comm.unwrap();
                let mut b = vec![1f64; 1000];
                comm.all_reduce(InPlace, &mut b, ReduceOp::Sum).unwrap();
                if rank == 1 {
                    std::thread::sleep(Duration::from_millis(2500));
                }
                let t = Instant::now();
                let e = comm.all_reduce(InPlace, &mut b, ReduceOp::Sum).unwrap_err();
                (e, t.elapsed())
            },
        );
        let (e0, t0) = &errs[0];
        assert!(
            matches!(
                e0,
                Error::Timeout {
                    peer: 1,
                    seq: 2,
                    ..
                }
            ),
            "{transport:?}: {e0}"
        );
        let by = match transport {
            TransportPref::Tcp => ", by doubling",
            _ => "",
        };
        assert!(
            e0.to_string()
                .contains(&format!("all_reduce(f64, sum, count=1000{by}) seq 2")),
            "{e0}"
        );
        assert!(*t0 < Duration::from_millis(2400), "{t0:?}");
        // Rank 1 comes back to find the communicator aborted by rank 0.
        let (e1, t1) = &errs[1];
        assert!(
            e1.to_string().contains("aborted") || e1.to_string().contains("lost"),
            "{e1}"
        );
        assert!(*t1 < Duration::from_secs(2), "{t1:?}");
    }
}

#[test]
fn bad_arguments_are_refused_and_change_nothing() {
    threads(2, &Opts::default(), |rank, comm| {
        let comm = comm.unwrap();
        let send = vec![1f32; 10];
        let mut short = vec![7f32; 9];
        let e = comm
            .all_reduce(&send, &mut short, ReduceOp::Sum)
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("send has 10 elements but recv has 9"),
            "{e}"
        );
        assert_eq!(short, vec![7f32; 9], "nothing written");
        let mut wrong_chunk = vec![0f32; 6];
        let e = comm
            .reduce_scatter(&send, &mut wrong_chunk, ReduceOp::Sum)
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        let e = comm.broadcast(InPlace, &mut short, 2).unwrap_err();
        assert!(e.to_string().contains("root 2 is not a rank"), "{e}");
        let e = comm
            .all_gather_async(vec![1u8; 3], vec![0u8; 10])
            .wait()
            .unwrap_err();
        assert!(e.to_string().contains("all_gather"), "{e}");
        // The communicator is still healthy: the refused calls never reached the wire.
        let mut ok = vec![rank as f32; 4];
        comm.all_reduce(InPlace, &mut ok, ReduceOp::Sum).unwrap();
        assert_eq!(ok, vec![1.0; 4]);
    });
}

#[test]
fn an_explicit_abort_reaches_every_rank() {
    let errs = threads(
        3,
        &both(TransportPref::Shm, Duration::from_secs(20)),
        |rank, comm| {
            let comm = comm.unwrap();
            if rank == 0 {
                comm.abort("operator asked");
            }
            let t = Instant::now();
            let mut b = vec![1u8; 100];
            let e = comm.all_reduce(InPlace, &mut b, ReduceOp::Sum).unwrap_err();
            (e.to_string(), t.elapsed())
        },
    );
    for (e, t) in &errs {
        assert!(e.contains("operator asked"), "{e}");
        assert!(*t < Duration::from_secs(5));
    }
}

/// Rank 2 is busy elsewhere; rank 0's watchdog aborts its stuck all-reduce long before the
/// deadline. `device`: the same on a `DeviceComm` (host stream), whose call runs on the proxy
/// thread while the caller aborts.
fn watchdog_abort(transport: TransportPref, device: bool) {
    let t = Instant::now();
    // Nobody drops its communicator (closing its sockets) before every rank has its error.
    let done = std::sync::Barrier::new(3);
    let got = threads(
        3,
        &both(transport, Duration::from_secs(30)),
        |rank, comm| {
            let comm = comm.unwrap();
            let dc = device
                .then(|| ringzero::DeviceComm::new(&comm, ringzero::HostStream::new()).unwrap());
            let buf = vec![1f32; 4096];
            let call = |buf: Vec<f32>| match &dc {
                Some(dc) => dc.all_reduce_async(buf, ReduceOp::Sum),
                None => comm.all_reduce_async(buf, ReduceOp::Sum),
            };
            if rank == 2 {
                std::thread::sleep(Duration::from_millis(1500));
            }
            let work = call(buf);
            if rank == 0 {
                std::thread::sleep(Duration::from_millis(300));
                match &dc {
                    Some(dc) => dc.abort("watchdog: step took too long"),
                    None => comm.abort("watchdog: step took too long"),
                }
            }
            let e = work.wait().unwrap_err();
            let took = t.elapsed();
            // Later calls fail at once too.
            let again = call(vec![1f32; 8]).wait().unwrap_err();
            assert!(matches!(again, Error::Aborted { .. }), "{again}");
            done.wait();
            (e.to_string(), took)
        },
    );
    for (rank, (e, took)) in got.iter().enumerate() {
        assert!(
            e.contains("rank 0: watchdog: step took too long"),
            "{transport:?} rank {rank}: {e}"
        );
        assert!(
            *took < Duration::from_secs(10),
            "{transport:?} rank {rank} took {took:?}"
        );
    }
}

#[test]
fn abort_from_a_watchdog_ends_a_stuck_call_on_every_rank() {
    for transport in [TransportPref::Shm, TransportPref::Tcp] {
        watchdog_abort(transport, false);
    }
}

#[test]
fn abort_from_a_watchdog_ends_a_stuck_device_call_on_every_rank() {
    for transport in [TransportPref::Shm, TransportPref::Tcp] {
        watchdog_abort(transport, true);
    }
}

/// A blocking device call holds `&mut` its communicator, so a watchdog thread aborts it through
/// an `AbortHandle` taken beforehand: every rank fails long before the deadline, naming the
/// reason, and a handle that outlives its communicator does nothing.
#[test]
fn an_abort_handle_ends_a_blocking_device_call_from_another_thread() {
    let t = Instant::now();
    let done = std::sync::Barrier::new(3);
    let got = threads(
        3,
        &both(TransportPref::Shm, Duration::from_secs(30)),
        |rank, comm| {
            let comm = comm.unwrap();
            let dc = ringzero::DeviceComm::new(&comm, ringzero::HostStream::new()).unwrap();
            let handle = dc.abort_handle();
            let late = handle.clone();
            let mut buf = vec![1f32; 4096];
            if rank == 2 {
                std::thread::sleep(Duration::from_millis(1500));
            }
            let e = std::thread::scope(|s| {
                if rank == 0 {
                    s.spawn(move || {
                        std::thread::sleep(Duration::from_millis(300));
                        handle.abort("watchdog: step took too long");
                    });
                }
                dc.all_reduce(InPlace, buf.as_mut_slice(), ReduceOp::Sum)
                    .unwrap_err()
            });
            let took = t.elapsed();
            done.wait();
            drop(dc);
            late.abort("after the communicator is gone");
            (e.to_string(), took)
        },
    );
    for (rank, (e, took)) in got.iter().enumerate() {
        assert!(
            e.contains("rank 0: watchdog: step took too long"),
            "rank {rank}: {e}"
        );
        assert!(*took < Duration::from_secs(10), "rank {rank} took {took:?}");
    }
}
