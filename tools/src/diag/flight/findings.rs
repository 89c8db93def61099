//! What one communicator's flight records say together: the records joined by rank and
//! sequence number, then one finding per kind of fault (a mismatch, a rank with no record, a
//! rank behind or late, a point-to-point message never started, the first error).

use std::collections::{BTreeMap, BTreeSet};

use ringzero_collectives::{CallState, FlightEntry, FlightRecord};

use super::*;

/// What one communicator's records say together: every rank's record, every rank's entry at
/// each sequence number, the furthest sequence number any rank reached, and the time it began.
struct Joined<'a> {
    size: usize,
    by_rank: BTreeMap<usize, &'a FlightRecord>,
    at: BTreeMap<u64, BTreeMap<usize, &'a FlightEntry>>,
    frontier: Option<u64>,
    t0: u64,
    rs: &'a [&'a FlightRecord],
}

pub(super) fn group(job_id: String, comm: String, rs: &[&FlightRecord]) -> Group {
    let size = rs.iter().map(|r| r.size).max().unwrap_or(0);
    let by_rank: BTreeMap<usize, &FlightRecord> = rs.iter().map(|r| (r.rank, *r)).collect();
    let frontier = by_rank
        .values()
        .filter_map(|r| r.entries.last().map(|e| e.seq))
        .max();
    // Every rank's entry at each sequence number.
    let mut at: BTreeMap<u64, BTreeMap<usize, &FlightEntry>> = BTreeMap::new();
    for (rank, r) in &by_rank {
        for e in &r.entries {
            at.entry(e.seq).or_default().insert(*rank, e);
        }
    }
    let t0 = frontier
        .and_then(|s| at.get(&s))
        .and_then(|m| m.values().map(|e| e.start_unix_us).min())
        .unwrap_or(0);
    let j = Joined {
        size,
        by_rank,
        at,
        frontier,
        t0,
        rs,
    };
    let mut findings = Vec::new();
    findings.extend(sizes_disagree(&j));
    findings.extend(mismatched_calls(&j));
    findings.extend(missing_ranks(&j));
    findings.extend(behind_and_late(&j));
    findings.extend(p2p_waits(&j.by_rank, t0));
    findings.extend(first_error(&j));
    if findings.is_empty() {
        let n = j
            .by_rank
            .values()
            .map(|r| r.entries.len())
            .max()
            .unwrap_or(0);
        findings.push(Finding {
            kind: FindingKind::CONSISTENT,
            ranks: vec![],
            seq: frontier,
            text: format!("every rank recorded the same calls (the last {n} kept) and none failed"),
        });
    }
    Group {
        job_id,
        comm,
        size,
        t0_unix_us: t0,
        ranks: rank_lines(&j),
        findings,
    }
}

/// Records that disagree on the world size come from different runs.
fn sizes_disagree(j: &Joined) -> Vec<Finding> {
    let Joined { size, rs, .. } = j;
    let size = *size;
    let mut out = Vec::new();
    if rs.iter().any(|r| r.size != size) {
        let sizes: BTreeSet<usize> = rs.iter().map(|r| r.size).collect();
        out.push(Finding {
            kind: FindingKind::MISMATCH,
            ranks: vec![],
            seq: None,
            text: format!(
                "the records disagree on the number of ranks ({sizes:?}): they come from \
                 different runs that shared a job id; use one dump directory per run"
            ),
        });
    }
    out
}

/// 1. Different calls at one sequence number (the first such number).
fn mismatched_calls(j: &Joined) -> Vec<Finding> {
    let Joined { at, .. } = j;
    let mut out = Vec::new();
    if let Some((seq, calls)) = at.iter().find_map(|(seq, m)| {
        let mut calls: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (rank, e) in m {
            calls.entry(e.call.as_str()).or_default().push(*rank);
        }
        (calls.len() > 1).then_some((*seq, calls))
    }) {
        let ranks: Vec<usize> = calls.values().flatten().copied().collect();
        let parts: Vec<String> = calls
            .iter()
            .map(|(c, rk)| format!("{} called {c}", list(rk)))
            .collect();
        out.push(Finding {
            kind: FindingKind::MISMATCH,
            ranks,
            seq: Some(seq),
            text: format!(
                "at seq {seq} {}: every rank must make the same calls in the same order \
                 (look for a branch on rank, or on data that differs between ranks)",
                parts.join("; ")
            ),
        });
    }
    out
}

/// 2. Ranks without a record, with what the others said about them.
fn missing_ranks(j: &Joined) -> Vec<Finding> {
    let Joined {
        size,
        by_rank,
        at,
        frontier,
        ..
    } = j;
    let (size, frontier) = (*size, *frontier);
    let mut out = Vec::new();
    let missing: Vec<usize> = (0..size).filter(|r| !by_rank.contains_key(r)).collect();
    for m in &missing {
        let needle = format!("peer rank {m}");
        // The most direct witness: the shortest failure that names the rank (the others relay
        // it through aborts).
        let witness = by_rank
            .iter()
            .filter_map(|(rank, r)| {
                let f = r.failure.as_deref()?;
                f.contains(&needle).then_some((f.len(), *rank, f))
            })
            .min();
        let mut text = format!(
            "rank {m} left no record: its process most likely died without running destructors \
             (SIGKILL, the OOM killer, a crash), or it ran with another RINGZERO_DUMP_DIR"
        );
        if let Some(f) = frontier {
            let call = at.get(&f).and_then(|m| m.values().next());
            if let Some(e) = call {
                text += &format!("; the others had reached seq {f} {}", e.call);
            }
        }
        if let Some((_, rank, f)) = witness {
            text += &format!("; the others saw it go: rank {rank}: {f}");
        }
        out.push(Finding {
            kind: FindingKind::NO_RECORD,
            ranks: vec![*m],
            seq: None,
            text,
        });
    }
    out
}

/// 3. Ranks whose last call is older than the frontier; 4. late entry into the frontier call.
fn behind_and_late(j: &Joined) -> Vec<Finding> {
    let Joined {
        by_rank,
        at,
        frontier,
        t0,
        rs,
        ..
    } = j;
    let (frontier, t0) = (*frontier, *t0);
    let mut out = Vec::new();
    if let Some(f) = frontier {
        let call = at
            .get(&f)
            .and_then(|m| m.values().next())
            .map_or("?".to_string(), |e| e.call.clone());
        let waiting: Vec<usize> = at.get(&f).map_or(vec![], |m| m.keys().copied().collect());
        for (rank, r) in by_rank.iter() {
            let mine = r.entries.last();
            if mine.is_some_and(|e| e.seq >= f) {
                continue;
            }
            let before = match mine {
                Some(e) => format!(
                    "its last call was seq {} {} ({}, ended {})",
                    e.seq,
                    e.call,
                    state_word(e.state),
                    rel(end_us(e), t0)
                ),
                None => "it recorded no call".to_string(),
            };
            let after = match (&r.failure, r.closed) {
                (Some(why), _) => format!("; then it failed: {why}"),
                (None, true) => "; then it closed its communicator".to_string(),
                (None, false) => String::new(),
            };
            out.push(Finding {
                kind: FindingKind::NEVER_CALLED,
                ranks: vec![*rank],
                seq: Some(f),
                text: format!(
                    "rank {rank} never called seq {f} {call}, which {} entered; {before}{after}",
                    list(&waiting)
                ),
            });
        }

        // 4. Late entry into the frontier call.
        if let Some(m) = at.get(&f) {
            let first_fail = m
                .iter()
                .filter(|(_, e)| e.state == CallState::Failed)
                .min_by_key(|(_, e)| end_us(e));
            let first_in = m.iter().min_by_key(|(_, e)| e.start_unix_us);
            let timeout_us = rs.iter().map(|r| r.timeout_s).fold(0.0, f64::max) * 1e6;
            for (rank, e) in m {
                let late_after_fail =
                    first_fail.filter(|(q, fe)| *q != rank && e.start_unix_us >= end_us(fe));
                if let Some((q, fe)) = late_after_fail {
                    out.push(Finding {
                        kind: FindingKind::LATE,
                        ranks: vec![*rank],
                        seq: Some(f),
                        text: format!(
                            "rank {rank} entered seq {f} {} at {}, after rank {q} had already \
                             failed in it at {}: the others waited for rank {rank} until their \
                             deadline (what was rank {rank} doing? a slow data loader, compute, \
                             a checkpoint, a debugger)",
                            e.call,
                            rel(e.start_unix_us, t0),
                            rel(end_us(fe), t0)
                        ),
                    });
                } else if let Some((q, fe)) = first_in {
                    let lag = e.start_unix_us.saturating_sub(fe.start_unix_us) as f64;
                    if q != rank && timeout_us > 0.0 && lag >= timeout_us / 2.0 {
                        out.push(Finding {
                            kind: FindingKind::LATE,
                            ranks: vec![*rank],
                            seq: Some(f),
                            text: format!(
                                "rank {rank} entered seq {f} {} {:.3} s after rank {q} (at least \
                                 half the {:.1} s deadline)",
                                e.call,
                                lag / 1e6,
                                timeout_us / 1e6
                            ),
                        });
                    }
                }
            }
        }
    }
    out
}

/// 6. The earliest error by the clock (or a failure outside any recorded call).
fn first_error(j: &Joined) -> Vec<Finding> {
    let Joined {
        by_rank, t0, rs, ..
    } = j;
    let t0 = *t0;
    let mut out = Vec::new();
    if let Some((rank, e)) = by_rank
        .iter()
        .flat_map(|(rank, r)| r.entries.iter().map(move |e| (*rank, e)))
        .filter(|(_, e)| e.state == CallState::Failed)
        .min_by_key(|(_, e)| end_us(e))
    {
        let nodes: BTreeSet<&str> = rs.iter().map(|r| r.node.as_str()).collect();
        let clocks = if nodes.len() > 1 {
            " (times from the clocks of several hosts)"
        } else {
            ""
        };
        out.push(Finding {
            kind: FindingKind::FIRST_ERROR,
            ranks: vec![rank],
            seq: Some(e.seq),
            text: format!(
                "rank {rank} failed first{clocks}, at {} in seq {} {} after {:.3} s: {}",
                rel(end_us(e), t0),
                e.seq,
                e.call,
                e.elapsed_us as f64 / 1e6,
                e.error.as_deref().unwrap_or("?")
            ),
        });
    } else if let Some((rank, why)) = by_rank
        .iter()
        .find_map(|(rank, r)| r.failure.as_ref().map(|f| (*rank, f)))
    {
        out.push(Finding {
            kind: FindingKind::FIRST_ERROR,
            ranks: vec![rank],
            seq: None,
            text: format!("rank {rank} failed outside a recorded call: {why}"),
        });
    }
    out
}

/// One line per rank: where it ran, its last call, how it ended.
fn rank_lines(j: &Joined) -> Vec<RankLine> {
    let last = |r: &FlightRecord| r.entries.last().cloned();
    let (size, by_rank) = (j.size, &j.by_rank);
    (0..size)
        .map(|rank| match by_rank.get(&rank) {
            Some(r) => RankLine {
                rank,
                present: true,
                node: Some(r.node.clone()),
                pid: Some(r.pid),
                last: last(r),
                failure: r.failure.clone(),
                closed: r.closed,
            },
            None => RankLine {
                rank,
                present: false,
                node: None,
                pid: None,
                last: None,
                failure: None,
                closed: false,
            },
        })
        .collect()
}

/// For every message a rank's record shows pending (a receive waiting for its frames, a send for
/// the receiver), what the peer's record says of its side: never started (the peer's count of
/// that direction is below it and nothing is pending there), or started as another call.
fn p2p_waits(by_rank: &BTreeMap<usize, &FlightRecord>, t0: u64) -> Vec<Finding> {
    let mut out = Vec::new();
    for (&rank, r) in by_rank {
        for t in &r.p2p {
            let Some(theirs) = by_rank.get(&t.peer) else {
                continue; // NO_RECORD says it
            };
            let back = theirs.p2p.iter().find(|b| b.peer == rank);
            for m in &t.pending {
                let (verb, other, did, dir, done) = if m.send {
                    (
                        "send",
                        "receive",
                        "received",
                        "from",
                        back.map_or(0, |b| b.received),
                    )
                } else {
                    ("receive", "send", "sent", "to", back.map_or(0, |b| b.sent))
                };
                let matching = back.and_then(|b| {
                    b.pending
                        .iter()
                        .find(|x| x.send != m.send && x.seq == m.seq)
                });
                let peer = t.peer;
                let text = match matching {
                    // Said once, from the receiver's side.
                    Some(x) if x.call != m.call && !m.send => format!(
                        "rank {rank}'s {verb} #{} {} with rank {peer} meets rank {peer}'s {other} \
                         #{} {}: the two disagree (count or type)",
                        m.seq, m.call, x.seq, x.call
                    ),
                    Some(_) => continue, // both sides are in it: a link or a deadline, not a gap
                    None if done > m.seq => continue, // the peer finished its side
                    None => {
                        let last = theirs.entries.last().map_or(String::new(), |e| {
                            format!(
                                "; its last collective was seq {} {} ({})",
                                e.seq,
                                e.call,
                                state_word(e.state)
                            )
                        });
                        let after = match (&theirs.failure, theirs.closed) {
                            (Some(why), _) => format!("; it failed: {why}"),
                            (None, true) => "; it closed its communicator".into(),
                            (None, false) => String::new(),
                        };
                        format!(
                            "rank {rank} waited from {} on its {verb} #{} {} with rank {peer}, \
                             which never started the matching {other}: it had {did} {done} \
                             message(s) {dir} rank {rank}{last}{after}",
                            rel(m.start_unix_us, t0),
                            m.seq,
                            m.call,
                        )
                    }
                };
                out.push(Finding {
                    kind: FindingKind::P2P_WAIT,
                    ranks: vec![rank, peer],
                    seq: None,
                    text,
                });
            }
        }
    }
    out
}
