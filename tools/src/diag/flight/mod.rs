//! `ringzero diag --flight DIR`: join the flight records every rank wrote (`RINGZERO_DUMP_DIR`)
//! and say which rank broke the job and how.
//!
//! A hang in a collective is rarely the fault of the rank that reports it: every rank waits in
//! the same call until its deadline, and the error each one prints names only its neighbour. The
//! records of all ranks together say more. Read in this order (most likely cause first):
//! 1. **MISMATCH**: at some sequence number the ranks called different collectives (or the same
//!    one with other arguments);
//! 2. **NO_RECORD**: a rank wrote nothing: its process died without running destructors
//!    (SIGKILL, the OOM killer, a segfault) or ran with another dump directory;
//! 3. **NEVER_CALLED**: a rank's last call is older than the others': it closed its communicator
//!    or failed elsewhere without entering the call the others waited in;
//! 4. **LATE**: a rank entered the call after another rank had already failed in it (or long
//!    after the first rank entered): the others timed out waiting for it;
//! 5. **P2P_WAIT**: a rank waited on a point-to-point message (its record's `p2p`) that its
//!    peer never started, or started as another call;
//! 6. **FIRST_ERROR**: the earliest error by the clock; the later ones are usually its echo.
//!
//! The analysis is a pure function of the records ([`analyse`]), tested on records written by
//! real failing jobs and on hand-made ones.

use std::collections::BTreeMap;
use std::path::Path;

use ringzero_collectives::{CallState, FlightEntry, FlightRecord};
use serde::Serialize;

mod findings;

use findings::group;

/// What kind of finding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[allow(non_camel_case_types)]
pub enum FindingKind {
    /// Ranks called different collectives at the same sequence number.
    MISMATCH,
    /// A rank left no record.
    NO_RECORD,
    /// A rank never entered the call the others were in.
    NEVER_CALLED,
    /// A rank entered the call late.
    LATE,
    /// A rank waited on a point-to-point message its peer never started (or started as
    /// another).
    P2P_WAIT,
    /// The earliest error.
    FIRST_ERROR,
    /// Every rank recorded the same calls and none failed.
    CONSISTENT,
}

/// One finding, with the ranks it is about.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Finding {
    /// Its kind.
    pub kind: FindingKind,
    /// The ranks it names.
    pub ranks: Vec<usize>,
    /// The sequence number it is about, if one.
    pub seq: Option<u64>,
    /// What was found, in words.
    pub text: String,
}

/// One rank's line of the table.
#[derive(Clone, Debug, Serialize)]
pub struct RankLine {
    /// The rank.
    pub rank: usize,
    /// Whether it wrote a record.
    pub present: bool,
    /// Its node and process.
    pub node: Option<String>,
    /// Its process id.
    pub pid: Option<u32>,
    /// Its last call.
    pub last: Option<FlightEntry>,
    /// Its first failure.
    pub failure: Option<String>,
    /// Whether its communicator had been closed.
    pub closed: bool,
}

/// The join of one communicator's records (same job, same `comm`).
#[derive(Clone, Debug, Serialize)]
pub struct Group {
    /// The job.
    pub job_id: String,
    /// Which communicator (`host`, `device`, ...).
    pub comm: String,
    /// Ranks in the job.
    pub size: usize,
    /// Unix microseconds that table times are relative to (the earliest start of a last call).
    pub t0_unix_us: u64,
    /// One line per rank.
    pub ranks: Vec<RankLine>,
    /// Most likely cause first.
    pub findings: Vec<Finding>,
}

/// What `diag --flight` reports.
#[derive(Clone, Debug, Serialize)]
pub struct FlightReport {
    /// The directory read.
    pub dir: String,
    /// One group per (job, communicator).
    pub groups: Vec<Group>,
    /// 0: every rank agreed and none failed; 1: something is off but nothing failed; 2: a
    /// failure.
    pub exit_code: i32,
}

/// Read `dir` and analyse it. A directory without records is an error naming it.
pub fn join(dir: &Path) -> std::io::Result<FlightReport> {
    let recs = ringzero_collectives::flight::read_dir(dir)
        .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", dir.display())))?;
    if recs.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!(
                "{}: no flight records (files named {}*.json); a communicator writes one when \
                 RINGZERO_DUMP_DIR is set (`ringzero launch` sets it)",
                dir.display(),
                ringzero_collectives::flight::FILE_PREFIX
            ),
        ));
    }
    Ok(analyse(&dir.display().to_string(), &recs))
}

/// Join records (of any jobs and communicators) into one report.
pub fn analyse(dir: &str, recs: &[FlightRecord]) -> FlightReport {
    let mut by: BTreeMap<(String, String), Vec<&FlightRecord>> = BTreeMap::new();
    for r in recs {
        by.entry((r.job_id.clone(), r.comm.clone()))
            .or_default()
            .push(r);
    }
    let groups: Vec<Group> = by
        .into_iter()
        .map(|((job, comm), rs)| group(job, comm, &rs))
        .collect();
    let exit_code = groups.iter().map(severity).max().unwrap_or(0);
    FlightReport {
        dir: dir.to_string(),
        groups,
        exit_code,
    }
}

fn severity(g: &Group) -> i32 {
    let failed = g.ranks.iter().any(|r| r.failure.is_some());
    match g
        .findings
        .iter()
        .map(|f| f.kind)
        .collect::<Vec<_>>()
        .as_slice()
    {
        [FindingKind::CONSISTENT] => 0,
        ks if failed
            || ks
                .iter()
                .any(|k| matches!(k, FindingKind::MISMATCH | FindingKind::NO_RECORD)) =>
        {
            2
        }
        _ => 1,
    }
}

/// When an entry ended (or the record was taken, for a running one), Unix microseconds.
fn end_us(e: &FlightEntry) -> u64 {
    e.start_unix_us + e.elapsed_us
}

fn rel(us: u64, t0: u64) -> String {
    format!("{:+.3} s", (us as f64 - t0 as f64) / 1e6)
}

fn list(ranks: &[usize]) -> String {
    let s: Vec<String> = ranks.iter().map(usize::to_string).collect();
    match s.len() {
        1 => format!("rank {}", s[0]),
        _ => format!("ranks {}", s.join(", ")),
    }
}

fn state_word(s: CallState) -> &'static str {
    match s {
        CallState::Running => "running",
        CallState::Done => "done",
        CallState::Failed => "FAILED",
    }
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1 << 20) as f64)
}

/// The report as text: per group a table of every rank's last call, then the findings.
pub fn text(r: &FlightReport) -> String {
    let mut s = String::new();
    for g in &r.groups {
        s += &format!(
            "== Flight records in {}: job {}, {} communicator, {} ranks\n",
            r.dir, g.job_id, g.comm, g.size
        );
        s += "rank  last call                                          state    started     ran        sent / received\n";
        for l in &g.ranks {
            match (&l.last, l.present) {
                (_, false) => s += &format!("{:<5} no record\n", l.rank),
                (None, true) => s += &format!("{:<5} no call recorded\n", l.rank),
                (Some(e), true) => {
                    s += &format!(
                        "{:<5} {:<50} {:<8} {:<11} {:<10} {} / {}\n",
                        l.rank,
                        format!("seq {} {}", e.seq, e.call),
                        state_word(e.state),
                        rel(e.start_unix_us, g.t0_unix_us),
                        format!("{:.3} s", e.elapsed_us as f64 / 1e6),
                        mib(e.sent),
                        mib(e.received)
                    )
                }
            }
        }
        s += "\nFindings, most likely cause first:\n";
        for (i, f) in g.findings.iter().enumerate() {
            s += &format!("{}. {:?}: {}\n", i + 1, f.kind, f.text);
        }
        s += "\n";
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(seq: u64, call: &str, start: u64, ran: u64, state: CallState) -> FlightEntry {
        FlightEntry {
            seq,
            call: call.into(),
            in_place: false,
            bytes: 64,
            start_unix_us: start,
            elapsed_us: ran,
            sent: 0,
            received: 0,
            state,
            error: (state == CallState::Failed).then(|| format!("seq {seq}: boom")),
        }
    }

    fn rec(rank: usize, size: usize, entries: Vec<FlightEntry>) -> FlightRecord {
        let failure = entries
            .iter()
            .find(|e| e.state == CallState::Failed)
            .and_then(|e| e.error.clone());
        FlightRecord {
            format: ringzero_collectives::flight::FORMAT,
            comm: "host".into(),
            job_id: "j".into(),
            rank,
            size,
            node: "n".into(),
            pid: 100 + rank as u32,
            edges: vec![],
            timeout_s: 2.0,
            taken_unix_us: 0,
            failure,
            closed: true,
            dropped: 0,
            entries,
            p2p: vec![],
        }
    }

    const AR: &str = "all_reduce(f32, sum, count=8)";
    const AG: &str = "all_gather(f32, count=8)";

    #[test]
    fn agreeing_records_are_consistent() {
        let recs: Vec<FlightRecord> = (0..3)
            .map(|r| rec(r, 3, vec![entry(0, AR, 10, 5, CallState::Done)]))
            .collect();
        let rep = analyse("d", &recs);
        assert_eq!(rep.exit_code, 0);
        assert_eq!(rep.groups[0].findings[0].kind, FindingKind::CONSISTENT);
    }

    #[test]
    fn a_different_call_is_a_mismatch_naming_both_sides() {
        let recs = vec![
            rec(
                0,
                2,
                vec![
                    entry(0, AR, 0, 5, CallState::Done),
                    entry(1, AR, 10, 5, CallState::Failed),
                ],
            ),
            rec(
                1,
                2,
                vec![
                    entry(0, AR, 0, 5, CallState::Done),
                    entry(1, AG, 10, 5, CallState::Failed),
                ],
            ),
        ];
        let rep = analyse("d", &recs);
        let f = &rep.groups[0].findings[0];
        assert_eq!((f.kind, f.seq), (FindingKind::MISMATCH, Some(1)));
        assert!(
            f.text.contains(&format!("rank 0 called {AR}")),
            "{}",
            f.text
        );
        assert!(
            f.text.contains(&format!("rank 1 called {AG}")),
            "{}",
            f.text
        );
        assert_eq!(rep.exit_code, 2);
    }

    #[test]
    fn a_rank_that_stopped_early_never_called_and_a_missing_one_has_no_record() {
        let recs = vec![
            rec(0, 3, vec![entry(4, AR, 0, 2_000_000, CallState::Failed)]),
            rec(1, 3, vec![entry(3, AR, 0, 5, CallState::Done)]),
        ];
        let rep = analyse("d", &recs);
        let kinds: Vec<FindingKind> = rep.groups[0].findings.iter().map(|f| f.kind).collect();
        assert_eq!(
            kinds,
            vec![
                FindingKind::NO_RECORD,
                FindingKind::NEVER_CALLED,
                FindingKind::FIRST_ERROR
            ]
        );
        let never = &rep.groups[0].findings[1];
        assert_eq!(never.ranks, vec![1]);
        assert!(never.text.contains("never called seq 4"), "{}", never.text);
        assert!(
            never.text.contains("closed its communicator"),
            "{}",
            never.text
        );
        assert!(rep.groups[0].findings[0]
            .text
            .contains("rank 2 left no record"));
        assert!(!rep.groups[0].ranks[2].present);
    }

    #[test]
    fn a_rank_entering_after_a_failure_is_late() {
        let recs = vec![
            rec(
                0,
                2,
                vec![entry(7, AR, 1_000, 2_000_000, CallState::Failed)],
            ),
            rec(
                1,
                2,
                vec![entry(7, AR, 2_500_000, 1_000, CallState::Failed)],
            ),
        ];
        let rep = analyse("d", &recs);
        let g = &rep.groups[0];
        assert_eq!(g.findings[0].kind, FindingKind::LATE);
        assert_eq!(g.findings[0].ranks, vec![1]);
        assert!(
            g.findings[0]
                .text
                .contains("after rank 0 had already failed"),
            "{}",
            g.findings[0].text
        );
        assert_eq!(g.findings[1].kind, FindingKind::FIRST_ERROR);
        assert_eq!(g.findings[1].ranks, vec![0]);
        assert!(text(&rep).contains("LATE: rank 1 entered seq 7"));
    }

    #[test]
    fn a_slow_entry_without_a_failure_is_late_and_degraded() {
        let recs = vec![
            rec(0, 2, vec![entry(1, AR, 0, 1_500_000, CallState::Done)]),
            rec(
                1,
                2,
                vec![entry(1, AR, 1_400_000, 100_000, CallState::Done)],
            ),
        ];
        let rep = analyse("d", &recs);
        assert_eq!(rep.groups[0].findings[0].kind, FindingKind::LATE);
        assert_eq!(rep.exit_code, 1);
    }

    #[test]
    fn point_to_point_sides_that_disagree_are_named_and_matching_ones_are_not() {
        use ringzero_collectives::{PeerTraffic, PendingMsg};
        let pending = |send, seq, call: &str| PendingMsg {
            send,
            seq,
            call: call.into(),
            start_unix_us: 10,
        };
        let traffic = |peer, msgs| PeerTraffic {
            peer,
            sent: 2,
            received: 2,
            pending: msgs,
        };
        let entries = || vec![entry(0, AR, 0, 5, CallState::Done)];
        let (mut a, mut b) = (rec(0, 2, entries()), rec(1, 2, entries()));
        // Rank 0 receives #2 of 8 elements while rank 1 sends #2 of 9: named. Rank 0's send #2
        // meets rank 1's receive #2 of the same call: both are in it, nothing to say.
        let (r8, r9) = ("send_recv(f32, count=8)", "send_recv(f32, count=9)");
        a.p2p = vec![traffic(
            1,
            vec![pending(false, 2, r8), pending(true, 2, r8)],
        )];
        b.p2p = vec![traffic(
            0,
            vec![pending(true, 2, r9), pending(false, 2, r8)],
        )];
        let rep = analyse("d", &[a, b]);
        let p2p: Vec<&Finding> = rep.groups[0]
            .findings
            .iter()
            .filter(|f| f.kind == FindingKind::P2P_WAIT)
            .collect();
        assert_eq!(p2p.len(), 1, "{:?}", rep.groups[0].findings);
        assert!(p2p[0].text.contains("disagree"), "{p2p:?}");
        assert!(
            p2p[0].text.contains(r8) && p2p[0].text.contains(r9),
            "{p2p:?}"
        );
        assert_eq!(rep.exit_code, 1);
    }
}
