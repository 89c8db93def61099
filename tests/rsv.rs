//! Reduce-scatter with a part per rank (`reduce_scatter_v`), on the host communicator and on the
//! device communicator over the host stream: the ring moves exactly the theory's bytes, ranks
//! that split the total differently fail at once naming both splits, bad counts are refused and
//! change nothing, and the asynchronous form agrees with the blocking one. (Its results against
//! the serial reference, every dtype and op, run with the other collectives in `threads`,
//! `device` and `processes`.)

use std::time::{Duration, Instant};

use ringzero::{
    Collectives, DeviceComm, Error, HostStream, InPlace, NonBlocking, ReduceOp, TransportPref,
};

use crate::common::{threads, Opts};

/// Parts of 3 ranks: one empty, one much larger than the others.
const COUNTS: [usize; 3] = [5, 0, 1000];

fn input(r: usize) -> Vec<f64> {
    (0..COUNTS.iter().sum::<usize>())
        .map(|i| (i * 3 + r) as f64)
        .collect()
}

/// Element `i` of the sum over the 3 ranks' inputs.
fn summed(i: usize) -> f64 {
    (0..3).map(|r| (i * 3 + r) as f64).sum()
}

#[test]
fn uneven_parts_land_on_their_owners_and_the_ring_moves_all_but_its_own() {
    for (transport, tcp_sockets) in [(TransportPref::Shm, 1), (TransportPref::Tcp, 2)] {
        let o = Opts {
            transport,
            tcp_sockets,
            slice_bytes: 1024,
            ..Opts::default()
        };
        threads(3, &o, |r, comm| {
            let comm = comm.unwrap();
            let at: usize = COUNTS[..r].iter().sum();
            let before = comm.counters();
            let mut out = vec![-1f64; COUNTS[r]];
            comm.reduce_scatter_v(&input(r), &mut out, &COUNTS, ReduceOp::Sum)
                .unwrap();
            let after = comm.counters();
            let want: Vec<f64> = (at..at + COUNTS[r]).map(summed).collect();
            assert_eq!(out, want, "{transport:?} rank {r}");
            // Each rank sends every part but its own once: total − counts[r] elements.
            let total: usize = COUNTS.iter().sum();
            assert_eq!(
                after.bytes_sent - before.bytes_sent,
                ((total - COUNTS[r]) * 8) as u64,
                "{transport:?} rank {r} bytes sent"
            );
            // In place: this rank's part is overwritten, the rest of the buffer stays.
            let mut buf = input(r);
            comm.reduce_scatter_v(InPlace, &mut buf, &COUNTS, ReduceOp::Sum)
                .unwrap();
            let mine = input(r);
            for (i, x) in buf.iter().enumerate() {
                let want = if (at..at + COUNTS[r]).contains(&i) {
                    summed(i)
                } else {
                    mine[i]
                };
                assert_eq!(*x, want, "{transport:?} rank {r} in place, element {i}");
            }
            // The asynchronous form: the same result, in order with blocking calls.
            let w =
                comm.reduce_scatter_v_async(input(r), vec![0.0; COUNTS[r]], &COUNTS, ReduceOp::Sum);
            assert_eq!(w.wait().unwrap().1, want, "{transport:?} rank {r} async");
        });
    }
}

#[test]
fn ranks_that_split_the_total_differently_fail_at_once_naming_both_splits() {
    let t = Instant::now();
    let o = Opts {
        timeout: Duration::from_secs(20),
        ..Opts::default()
    };
    let errs = threads(2, &o, |r, comm| {
        let comm = comm.unwrap();
        let counts: [usize; 2] = if r == 0 { [3, 5] } else { [4, 4] };
        let mut out = vec![0f32; counts[r]];
        let e = comm
            .reduce_scatter_v(&[1f32; 8], &mut out, &counts, ReduceOp::Sum)
            .unwrap_err();
        assert!(matches!(e, Error::Mismatch { .. }), "rank {r}: {e}");
        e.to_string()
    });
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "a mismatch must not wait for the deadline"
    );
    for e in &errs {
        let digests: Vec<&str> = e
            .match_indices("reduce_scatter_v(f32, sum, count=8, counts#")
            .map(|(at, _)| &e[at..])
            .collect();
        assert_eq!(digests.len(), 2, "both calls named: {e}");
        assert_ne!(
            digests[0].split(')').next(),
            digests[1].split(')').next(),
            "two different splits: {e}"
        );
    }
}

#[test]
fn bad_counts_are_refused_and_change_nothing_on_both_communicators() {
    threads(3, &Opts::default(), |r, comm| {
        let comm = comm.unwrap();
        let refused = |e: Error, has: &str| {
            assert!(
                matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains(has),
                "rank {r}: {e} (wanted `{has}`)"
            );
        };
        let send = [1i64; 6];
        let mut out = vec![-1i64; 2];
        refused(
            comm.reduce_scatter_v(&send, &mut out, &[2, 4], ReduceOp::Sum)
                .unwrap_err(),
            "counts has 2 entries but the communicator has 3 ranks",
        );
        refused(
            comm.reduce_scatter_v(&send, &mut out, &[2, 2, 3], ReduceOp::Sum)
                .unwrap_err(),
            "counts add up to 7 elements but send has 6",
        );
        refused(
            comm.reduce_scatter_v(&send, &mut out[..1], &[2, 2, 2], ReduceOp::Sum)
                .unwrap_err(),
            &format!("recv has 1 elements but counts[{r}] (this rank's part) is 2"),
        );
        refused(
            comm.reduce_scatter_v(&send, &mut out, &[usize::MAX, 1, 0], ReduceOp::Sum)
                .unwrap_err(),
            "add up to more than usize::MAX",
        );
        let mut buf = [7i64; 5];
        refused(
            comm.reduce_scatter_v(InPlace, &mut buf, &[2, 2, 2], ReduceOp::Max)
                .unwrap_err(),
            "counts add up to 6 elements but recv has 5",
        );
        refused(
            comm.reduce_scatter_v_async(send.to_vec(), Vec::new(), &[6], ReduceOp::Sum)
                .wait()
                .unwrap_err(),
            "counts has 1 entries",
        );
        assert_eq!(out, [-1, -1], "rank {r}: a refused call wrote");
        assert_eq!(buf, [7; 5], "rank {r}: a refused call wrote");

        let dc = DeviceComm::new(&comm, HostStream::new()).unwrap();
        let mut dout = vec![-1i64; 2];
        refused(
            dc.reduce_scatter_v(&send[..], &mut dout[..], &[2, 2], ReduceOp::Sum)
                .unwrap_err(),
            "counts has 2 entries but the communicator has 3 ranks",
        );
        refused(
            dc.reduce_scatter_v(&send[..], &mut dout[..1], &[2, 2, 2], ReduceOp::Sum)
                .unwrap_err(),
            &format!("recv has 1 elements but counts[{r}] (this rank's part) is 2"),
        );
        refused(
            dc.reduce_scatter_v(InPlace, &mut buf[..], &[1, 1, 1], ReduceOp::Sum)
                .unwrap_err(),
            "counts add up to 3 elements but recv has 5",
        );
        assert_eq!(dout, [-1, -1], "rank {r}: a refused device call wrote");
        assert_eq!(buf, [7; 5], "rank {r}: a refused device call wrote");

        // Refused calls used no sequence number: both communicators still agree with the
        // other ranks and run.
        comm.reduce_scatter_v(&send, &mut out, &[2, 2, 2], ReduceOp::Sum)
            .unwrap();
        assert_eq!(out, [3, 3], "rank {r}");
        dc.reduce_scatter_v(&send[..], &mut dout[..], &[2, 2, 2], ReduceOp::Max)
            .unwrap();
        assert_eq!(dout, [1, 1], "rank {r}");
    });
}
