//! The flight recorder end to end, ranks as threads: each rank misbehaves in a way that breaks real
//! jobs (skips a call, arrives late, calls something else), every rank writes its record to a dump
//! directory, and `diag --flight`'s join must name the culprit first. (A killed rank: see
//! `processes.rs`.)

use std::time::Duration;

use ringzero::{
    CallState, Collectives, Communicator, InPlace, NonBlocking, ReduceOp, TransportPref,
};
use ringzero_tools::diag::flight::{self, FindingKind, FlightReport};

use crate::common::{fresh_dir, threads, Opts};

fn opts(dir: &std::path::Path, timeout: Duration) -> Opts {
    Opts {
        transport: TransportPref::Tcp,
        timeout,
        dump_dir: Some(dir.to_path_buf()),
        ..Opts::default()
    }
}

fn all_reduce(comm: &Communicator) -> ringzero::Result<()> {
    let mut buf = vec![1f32; 1000];
    comm.all_reduce(InPlace, &mut buf, ReduceOp::Sum)
}

fn joined(dir: &std::path::Path) -> FlightReport {
    let r = flight::join(dir).unwrap();
    assert_eq!(r.groups.len(), 1, "{}", flight::text(&r));
    r
}

#[test]
fn a_rank_that_leaves_before_a_call_is_named_as_never_making_it() {
    let dir = fresh_dir("flight-skip");
    threads(3, &opts(&dir, Duration::from_secs(20)), |rank, comm| {
        let comm = comm.unwrap();
        all_reduce(&comm).unwrap();
        all_reduce(&comm).unwrap();
        if rank != 2 {
            // Rank 2 closed its communicator instead of making this call.
            assert!(all_reduce(&comm).is_err());
        }
    });
    let r = joined(&dir);
    let g = &r.groups[0];
    let f = &g.findings[0];
    assert_eq!(f.kind, FindingKind::NEVER_CALLED, "{}", flight::text(&r));
    assert_eq!((f.ranks.as_slice(), f.seq), (&[2][..], Some(3)));
    assert!(
        f.text.contains("closed its communicator")
            && f.text
                .contains("all_reduce(f32, sum, count=1000, by doubling)"),
        "{}",
        f.text
    );
    assert!(g
        .findings
        .iter()
        .any(|f| f.kind == FindingKind::FIRST_ERROR));
    // Every rank recorded the setup barrier and both all-reduces with the bytes they moved.
    let last2 = g.ranks[2].last.as_ref().unwrap();
    assert_eq!((last2.seq, last2.state), (2, CallState::Done));
    // A 4000-byte all-reduce on 3 ranks goes by recursive doubling: ranks 0 and 1 fold into
    // one, which exchanges the whole buffer with rank 2 once.
    assert_eq!((last2.sent, last2.received), (4000, 4000), "{last2:?}");
    assert_eq!(r.exit_code, 2);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_rank_that_enters_after_the_others_failed_is_named_late() {
    let dir = fresh_dir("flight-late");
    // The ring: rank 1's second step needs a frame rank 0 never sends once it has failed. (By
    // doubling, which auto takes for two ranks over tcp, the late rank finds rank 0's one
    // message already sent, completes the call with the right sum, and learns of the failure
    // at its next call.)
    let o = Opts {
        algo: Some(ringzero::Algo::Ring),
        ..opts(&dir, Duration::from_millis(800))
    };
    threads(2, &o, |rank, comm| {
        let comm = comm.unwrap();
        all_reduce(&comm).unwrap();
        if rank == 1 {
            // Busy elsewhere (a slow data loader) past rank 0's deadline.
            std::thread::sleep(Duration::from_millis(2000));
        }
        assert!(all_reduce(&comm).is_err());
    });
    let r = joined(&dir);
    let g = &r.groups[0];
    let f = &g.findings[0];
    assert_eq!(f.kind, FindingKind::LATE, "{}", flight::text(&r));
    assert_eq!((f.ranks.as_slice(), f.seq), (&[1][..], Some(2)));
    assert!(
        f.text.contains("after rank 0 had already failed in it"),
        "{}",
        f.text
    );
    let first = g
        .findings
        .iter()
        .find(|f| f.kind == FindingKind::FIRST_ERROR)
        .unwrap();
    assert!(
        first.ranks == [0] && first.text.contains("timed out"),
        "{}",
        first.text
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn ranks_calling_different_collectives_are_a_mismatch_naming_both() {
    let dir = fresh_dir("flight-mismatch");
    threads(3, &opts(&dir, Duration::from_secs(20)), |rank, comm| {
        let comm = comm.unwrap();
        all_reduce(&comm).unwrap();
        let r = if rank == 1 {
            let mut out = vec![0f32; 999];
            comm.all_gather(&[1.0; 333], &mut out)
        } else {
            all_reduce(&comm)
        };
        assert!(r.is_err());
    });
    let r = joined(&dir);
    let f = &r.groups[0].findings[0];
    assert_eq!(
        (f.kind, f.seq),
        (FindingKind::MISMATCH, Some(2)),
        "{}",
        flight::text(&r)
    );
    assert!(
        f.text
            .contains("ranks 0, 2 called all_reduce(f32, sum, count=1000, by doubling)")
            && f.text.contains("rank 1 called all_gather(f32, count=999)"),
        "{}",
        f.text
    );
    assert_eq!(r.exit_code, 2);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_healthy_job_leaves_consistent_records_and_the_recorder_is_readable_live() {
    let dir = fresh_dir("flight-ok");
    threads(2, &opts(&dir, Duration::from_secs(20)), |_, comm| {
        let comm = comm.unwrap();
        for _ in 0..5 {
            all_reduce(&comm).unwrap();
        }
        let rec = comm.flight_record();
        assert_eq!(rec.entries.len(), 6, "setup barrier + 5 all-reduces");
        assert!(rec.entries.iter().all(|e| e.state == CallState::Done));
        assert!(!rec.closed && rec.failure.is_none());
    });
    let r = joined(&dir);
    assert_eq!(r.groups[0].findings[0].kind, FindingKind::CONSISTENT);
    assert!(r.groups[0].ranks.iter().all(|l| l.closed));
    assert_eq!(r.exit_code, 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_point_to_point_message_never_sent_is_named_with_both_sides_counts() {
    // Rank 1 sends rank 0 one message of the two rank 0 receives (the second blocking, the
    // first posted), then goes on to a collective rank 0 never reaches. The records show the
    // traffic per peer, and the join names the missing message and what rank 1 did instead.
    let dir = fresh_dir("flight-p2p");
    threads(2, &opts(&dir, Duration::from_secs(2)), |rank, comm| {
        let comm = comm.unwrap();
        if rank == 0 {
            let first = comm.recv_async(vec![0f32; 10], 1).wait().unwrap();
            assert_eq!(first, [1.0; 10]);
            let mut second = [0f32; 10];
            comm.recv(&mut second, 1).unwrap_err();
            let rec = comm.flight_record();
            let t = &rec.p2p[0];
            assert_eq!((t.peer, t.sent, t.received), (1, 0, 1), "{rec:?}");
            assert!(
                t.pending[0].call.starts_with("send_recv(f32, count=10)"),
                "{t:?}"
            );
            assert!(!t.pending[0].send && t.pending[0].seq == 1, "{t:?}");
        } else {
            comm.send(&[1f32; 10], 0).unwrap();
            all_reduce(&comm).unwrap_err();
        }
    });
    let r = joined(&dir);
    assert_second_message_never_sent(&r, "host");
    assert_eq!(r.exit_code, 2);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_device_point_to_point_message_never_sent_is_named_too() {
    // As above on device buffers (the host stream): rank 1 sends one of the two messages rank 0
    // receives (the first posted, the second blocking), then goes on to a device all-reduce
    // rank 0 never reaches. The device communicator's record keeps its pairs' traffic, and the
    // join names the missing message in the device group.
    let dir = fresh_dir("flight-device-p2p");
    let o = Opts {
        transport: TransportPref::Shm,
        ..opts(&dir, Duration::from_secs(2))
    };
    threads(2, &o, |rank, comm| {
        let comm = comm.unwrap();
        let dc = ringzero::DeviceComm::new(&comm, ringzero::HostStream::new()).unwrap();
        if rank == 0 {
            let first = dc.recv_async(vec![0f32; 10], 1).wait().unwrap();
            assert_eq!(first, [1.0; 10]);
            let mut second = [0f32; 10];
            dc.recv(&mut second[..], 1).unwrap_err();
            let rec = dc.flight_record();
            let t = &rec.p2p[0];
            assert_eq!((t.peer, t.sent, t.received), (1, 0, 1), "{rec:?}");
            assert!(!t.pending[0].send && t.pending[0].seq == 1, "{t:?}");
        } else {
            dc.send(&[1f32; 10][..], 0).unwrap();
            let mut b = vec![1f32; 100];
            dc.all_reduce(InPlace, &mut b[..], ReduceOp::Sum)
                .unwrap_err();
        }
    });
    assert_second_message_never_sent(&flight::join(&dir).unwrap(), "device");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The join's `P2P_WAIT` finding in `comm`'s group: rank 0 waited on receive #1 from rank 1,
/// which had sent one message and gone on to an all-reduce.
fn assert_second_message_never_sent(r: &FlightReport, comm: &str) {
    let f = r
        .groups
        .iter()
        .find(|g| g.comm == comm)
        .and_then(|g| g.findings.iter().find(|f| f.kind == FindingKind::P2P_WAIT))
        .unwrap_or_else(|| panic!("{}", flight::text(r)));
    assert_eq!(f.ranks, [0, 1]);
    assert!(
        f.text
            .contains("its receive #1 send_recv(f32, count=10) with rank 1")
            && f.text.contains("it had sent 1 message(s) to rank 0")
            && f.text.contains("all_reduce"),
        "{}",
        f.text
    );
}
