//! The flight recorder: the last few collectives of one communicator, kept in memory and written
//! to a file when the communicator fails.
//!
//! Words used here:
//! - an *entry* is one collective call: its sequence number, what was called (the fingerprint
//!   every rank must agree on), when it started, how long it ran, what moved, how it ended;
//! - a *record* is one communicator's entries with who it is (job, rank, size, edges) and its
//!   first failure: what one rank knows about a hang or a crash; it also keeps the host
//!   communicator's point-to-point traffic per peer (messages finished each way, and the ones
//!   started and not finished), which are not entries: their numbers are each pair's own;
//! - a *dump* is a record written as JSON to `RINGZERO_DUMP_DIR` as
//!   `ringzero-flight-<comm>-rank<R>.json`: at the first failure (or [`abort`]), and again when
//!   the communicator is dropped, failed or not. A rank that left the ring cleanly while the
//!   others waited for it thus leaves a record too, and it shows the call it never made.
//!   `ringzero diag --flight DIR` sets the records of every rank side by side and names the rank
//!   that was missing, late or calling something else.
//!
//! The recorder has its own lock, held only to copy an entry in or out, so another thread can
//! read the record of a communicator that is stuck inside a call. With
//! `RINGZERO_DUMP_ON_SIGUSR1=1` a thread of the process writes every live communicator's record
//! when the process receives SIGUSR1, and the communicators go on: a hung job's ranks say what
//! they are doing without dying (`ringzero launch` sends it to them when interrupted). With
//! `RINGZERO_DUMP_ON_SIGTERM=1` it writes them on SIGTERM too, then lets the process end.
//!
//! [`abort`]: crate::Communicator::abort

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{SystemTime, UNIX_EPOCH};

use quanta::Instant;

use serde::{Deserialize, Serialize};

use crate::config::Config;
use crate::counters::Counters;
use crate::error::Error;
use crate::topology::Edge;
use crate::wire::Fingerprint;

/// Version of the dump format (`format` in the JSON).
pub const FORMAT: u32 = 1;
/// Prefix of every dump file's name.
pub const FILE_PREFIX: &str = "ringzero-flight-";

/// How a call ended, or that it has not.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallState {
    /// Still running when the record was taken.
    Running,
    /// Finished without error.
    Done,
    /// Returned an error (the entry's `error`).
    Failed,
}

/// One collective call.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FlightEntry {
    /// Sequence number on this communicator (the same call has the same number on every rank).
    pub seq: u64,
    /// What was called, as every rank must call it: `all_reduce(f32, sum, count=1024)`.
    pub call: String,
    /// Whether it was the in-place form (ranks may differ in this).
    pub in_place: bool,
    /// Bytes of the full buffer (`count` × element size).
    pub bytes: u64,
    /// When it started, microseconds since the Unix epoch (this host's clock).
    pub start_unix_us: u64,
    /// How long it ran (so far, while running), microseconds.
    pub elapsed_us: u64,
    /// Payload bytes sent to the next rank during the call.
    pub sent: u64,
    /// Payload bytes received from the previous rank during the call.
    pub received: u64,
    /// How it ended.
    pub state: CallState,
    /// The error, for a failed call.
    pub error: Option<String>,
}

/// A point-to-point message that started (a blocking call's, or a posted one) and has not
/// finished.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PendingMsg {
    /// A send (else a receive).
    pub send: bool,
    /// Its number in its direction of the pair: the peer's matching message has the same.
    pub seq: u64,
    /// What it is: `send_recv(f32, count=100)`.
    pub call: String,
    /// When it started, microseconds since the Unix epoch.
    pub start_unix_us: u64,
}

/// This rank's point-to-point traffic with one peer.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PeerTraffic {
    /// The peer.
    pub peer: usize,
    /// Messages to the peer that finished (numbered from 0 in order).
    pub sent: u64,
    /// Messages from the peer that finished.
    pub received: u64,
    /// Messages started and not finished, oldest first.
    pub pending: Vec<PendingMsg>,
}

/// What one rank's communicator knows: who it is, its last calls, and its first failure.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FlightRecord {
    /// [`FORMAT`].
    pub format: u32,
    /// Which communicator of the rank: `host` (a [`Communicator`](crate::Communicator)) or
    /// `device`, `device1`, ... (its [`DeviceComm`](crate::DeviceComm)s, in creation order).
    pub comm: String,
    /// The job (`RINGZERO_JOB_ID`).
    pub job_id: String,
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub size: usize,
    /// This rank's node (`RINGZERO_NODE_ID`).
    pub node: String,
    /// This process.
    pub pid: u32,
    /// The ring edges, as reported by `edges()`.
    pub edges: Vec<String>,
    /// The deadline of every wait, seconds.
    pub timeout_s: f64,
    /// When the record was taken, microseconds since the Unix epoch.
    pub taken_unix_us: u64,
    /// The first error that failed the communicator, if any.
    pub failure: Option<String>,
    /// Whether the communicator had been closed (dropped) when the record was taken.
    pub closed: bool,
    /// Calls older than the first entry that were no longer kept.
    pub dropped: u64,
    /// The last calls, oldest first.
    pub entries: Vec<FlightEntry>,
    /// Point-to-point traffic per peer (not entries: their numbers are each pair's own), by
    /// peer. Records written before it existed read as none.
    #[serde(default)]
    pub p2p: Vec<PeerTraffic>,
}

impl FlightRecord {
    /// The file name of this record's dump.
    pub fn file_name(&self) -> String {
        format!("{FILE_PREFIX}{}-rank{}.json", self.comm, self.rank)
    }
}

/// The recorder of one communicator.
pub(crate) struct Recorder {
    dir: Option<PathBuf>,
    cap: usize,
    /// Shared with the signal watcher's list ([`watch_signals`]), which holds it weakly.
    inner: Arc<Mutex<Inner>>,
    /// The monotonic clock and the Unix time at one moment: a call's start in Unix time is
    /// derived from the one monotonic reading it takes anyway. The clock is quanta's, the
    /// processor's time-stamp counter where it is invariant (about 10 ns a read against 25 for
    /// `clock_gettime` on a virtual machine, where a 4 KiB collective takes half a microsecond),
    /// the system's monotonic clock elsewhere.
    base: (Instant, u64),
}

struct Inner {
    head: FlightRecord,
    entries: VecDeque<Slot>,
    /// The running call: when it started, and the counters then.
    running: Option<(Instant, Counters)>,
    /// Where the dump went, once written.
    dumped: Option<PathBuf>,
    /// Point-to-point traffic by peer: finished counts and the messages started, their
    /// fingerprints binary until a record is taken.
    p2p: std::collections::BTreeMap<usize, Traffic>,
}

/// One peer's traffic as kept (see [`PeerTraffic`]).
#[derive(Default)]
struct Traffic {
    sent: u64,
    received: u64,
    /// (send, seq, fingerprint, start)
    pending: Vec<(bool, u64, Fingerprint, u64)>,
}

/// An entry as kept: the fingerprint stays binary until a record is taken, so recording costs a
/// call no formatting.
#[derive(Clone)]
struct Slot {
    fp: Fingerprint,
    entry: FlightEntry,
}

/// Microseconds since the Unix epoch.
fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

impl Recorder {
    pub(crate) fn new(cfg: &Config, comm: String, edges: &[Edge]) -> Recorder {
        let head = FlightRecord {
            format: FORMAT,
            comm,
            job_id: cfg.job_id.clone(),
            rank: cfg.launch.rank,
            size: cfg.launch.world_size,
            node: cfg.node_id.clone(),
            pid: std::process::id(),
            edges: edges.iter().map(ToString::to_string).collect(),
            timeout_s: cfg.timeout.as_secs_f64(),
            taken_unix_us: 0,
            failure: None,
            closed: false,
            dropped: 0,
            entries: Vec::new(),
            p2p: Vec::new(),
        };
        let r = Recorder {
            dir: cfg.dump_dir.clone(),
            cap: cfg.flight_entries,
            inner: Arc::new(Mutex::new(Inner {
                head,
                entries: VecDeque::new(),
                running: None,
                dumped: None,
                p2p: Default::default(),
            })),
            base: (Instant::now(), now_us()),
        };
        let on = (cfg.dump_on_sigusr1, cfg.dump_on_sigterm);
        if let Some(dir) = r.dir.as_ref().filter(|_| on.0 || on.1) {
            watch_signals(&r.inner, dir, &cfg.job_id, on);
        }
        r
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The edges are known only after connecting.
    pub(crate) fn set_edges(&self, edges: &[Edge]) {
        self.lock().head.edges = edges.iter().map(ToString::to_string).collect();
    }

    /// A call with sequence number `seq` starts; `now` are the links' counters before it.
    pub(crate) fn begin(
        &self,
        seq: u64,
        fp: &Fingerprint,
        in_place: bool,
        bytes: u64,
        now: Counters,
    ) {
        if self.cap == 0 {
            return;
        }
        let t = Instant::now();
        let mut g = self.lock();
        if g.entries.len() == self.cap {
            g.entries.pop_front();
            g.head.dropped += 1;
        }
        g.entries.push_back(Slot {
            fp: *fp,
            entry: FlightEntry {
                seq,
                call: String::new(),
                in_place,
                bytes,
                start_unix_us: self.base.1 + (t - self.base.0).as_micros() as u64,
                elapsed_us: 0,
                sent: 0,
                received: 0,
                state: CallState::Running,
                error: None,
            },
        });
        g.running = Some((t, now));
    }

    /// The running call ended with `r`; `now` are the links' counters after it.
    pub(crate) fn end(&self, r: &Result<(), Error>, now: Counters) {
        let mut g = self.lock();
        let Some((t, before)) = g.running.take() else {
            return;
        };
        if let Some(Slot { entry: e, .. }) = g.entries.back_mut() {
            e.elapsed_us = t.elapsed().as_micros() as u64;
            e.sent = now.bytes_sent.saturating_sub(before.bytes_sent);
            e.received = now.bytes_received.saturating_sub(before.bytes_received);
            match r {
                Ok(()) => e.state = CallState::Done,
                Err(err) => {
                    e.state = CallState::Failed;
                    e.error = Some(err.to_string());
                }
            }
        }
    }

    /// Point-to-point messages start: (peer, a send, its number in its direction, what it is).
    pub(crate) fn p2p_started(&self, msgs: &[(usize, bool, u64, Fingerprint)]) {
        if self.cap == 0 || msgs.is_empty() {
            return;
        }
        let now = now_us();
        let mut g = self.lock();
        for &(peer, send, seq, fp) in msgs {
            g.p2p
                .entry(peer)
                .or_default()
                .pending
                .push((send, seq, fp, now));
        }
    }

    /// Point-to-point messages finished: (peer, a send, its number), as started.
    pub(crate) fn p2p_finished(&self, msgs: impl IntoIterator<Item = (usize, bool, u64)>) {
        if self.cap == 0 {
            return;
        }
        let mut g = self.lock();
        for (peer, send, seq) in msgs {
            let t = g.p2p.entry(peer).or_default();
            if let Some(i) = t.pending.iter().position(|m| (m.0, m.1) == (send, seq)) {
                t.pending.remove(i);
            }
            let done = if send { &mut t.sent } else { &mut t.received };
            *done = (*done).max(seq + 1);
        }
    }

    /// The record as it stands.
    pub(crate) fn snapshot(&self) -> FlightRecord {
        let g = self.lock();
        snapshot(&g)
    }

    /// The communicator failed with `why`: remember it (later failures keep the first cause)
    /// and, when a dump directory is set, write the record there unless a failure already did.
    /// Returns where the record is.
    pub(crate) fn failed(&self, why: &str) -> Option<PathBuf> {
        let mut g = self.lock();
        if g.head.failure.is_none() {
            g.head.failure = Some(why.to_string());
        }
        if g.dumped.is_some() {
            return g.dumped.clone();
        }
        let p = self.dump(&g)?;
        tracing::error!(target: "ringzero::flight", rank = g.head.rank,
            "flight record of the last {} calls written to {} (`ringzero diag --flight {}` joins every rank's)",
            g.entries.len(), p.display(), p.parent().unwrap_or(Path::new(".")).display());
        g.dumped = Some(p.clone());
        Some(p)
    }

    /// The communicator is being dropped: write the final record where a dump directory is set.
    pub(crate) fn closed(&self) -> Option<PathBuf> {
        let mut g = self.lock();
        g.head.closed = true;
        let p = self.dump(&g)?;
        g.dumped = Some(p.clone());
        Some(p)
    }

    fn dump(&self, g: &Inner) -> Option<PathBuf> {
        let dir = self.dir.as_ref()?;
        let rec = snapshot(g);
        write_atomically(dir, &rec)
            .map_err(|e| {
                tracing::warn!(target: "ringzero::flight", rank = rec.rank,
                    "could not write the flight record to {}: {e}", dir.display())
            })
            .ok()
    }
}

/// The records written on SIGUSR1 or SIGTERM: each live recorder that asked, and its directory.
type Watched = Vec<(Weak<Mutex<Inner>>, PathBuf)>;
static ON_SIGNAL: Mutex<Watched> = Mutex::new(Vec::new());

/// Name of the file in a dump directory that says process `pid` of job `job` writes its records
/// on SIGUSR1 (and survives it): `ringzero launch` signals only the ranks that wrote one, so a
/// marker left by an earlier job whose pid came round again never gets a rank of this one killed.
/// The job is `RINGZERO_JOB_ID` (a split communicator's id counts up to its first `/`), its
/// characters other than ASCII letters, digits, `-` and `.` written `_`.
pub fn sigusr1_marker(job: &str, pid: u32) -> String {
    let job: String = job
        .split('/')
        .next()
        .unwrap_or_default()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!(".ringzero-sigusr1-{job}-{pid}")
}

/// Write `inner`'s record into `dir` whenever the process receives SIGUSR1 (`usr1`) or SIGTERM
/// (`term`, after which the process ends as SIGTERM ends it): start the watching thread (once per
/// process, for the signals the first recorder to ask asked for), list the recorder, and leave
/// the SIGUSR1 marker in `dir`.
fn watch_signals(inner: &Arc<Mutex<Inner>>, dir: &Path, job: &str, (usr1, term): (bool, bool)) {
    use signal_hook::consts::{SIGTERM, SIGUSR1};
    static WATCHER: OnceLock<std::result::Result<(bool, bool), String>> = OnceLock::new();
    let started = WATCHER.get_or_init(|| {
        let wanted = [(usr1, SIGUSR1), (term, SIGTERM)];
        let sigs: Vec<i32> = wanted.iter().filter(|w| w.0).map(|w| w.1).collect();
        let mut signals = signal_hook::iterator::Signals::new(sigs).map_err(|e| e.to_string())?;
        std::thread::Builder::new()
            .name("ringzero-flight-signals".into())
            .spawn(move || {
                for sig in signals.forever() {
                    dump_watched(if sig == SIGTERM { "SIGTERM" } else { "SIGUSR1" });
                    if sig == SIGTERM {
                        // As SIGTERM would have, now that the records are written.
                        let _ = signal_hook::low_level::emulate_default_handler(SIGTERM);
                        std::process::exit(128 + SIGTERM);
                    }
                }
            })
            .map(|_| (usr1, term))
            .map_err(|e| e.to_string())
    });
    let watching = match started {
        Ok(w) => *w,
        Err(e) => {
            tracing::warn!(target: "ringzero::flight", "cannot watch for signals ({e}): flight \
                records are written on failure and at close only");
            return;
        }
    };
    if (usr1 && !watching.0) || (term && !watching.1) {
        tracing::warn!(target: "ringzero::flight", "this process already watches only for \
            SIGUSR1: {}, SIGTERM: {} (its first communicator's RINGZERO_DUMP_ON_* settings)",
            watching.0, watching.1);
    }
    let mut watched = ON_SIGNAL.lock().unwrap_or_else(|p| p.into_inner());
    watched.retain(|(w, _)| w.strong_count() > 0);
    watched.push((Arc::downgrade(inner), dir.to_path_buf()));
    drop(watched);
    if !(usr1 && watching.0) {
        return;
    }
    let marker = dir.join(sigusr1_marker(job, std::process::id()));
    if let Err(e) = std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&marker, b"")) {
        tracing::warn!(target: "ringzero::flight", "cannot write {}: {e}", marker.display());
    }
}

/// Write the record of every live recorder listed by [`watch_signals`] (`sig` arrived).
fn dump_watched(sig: &str) {
    let live: Vec<(Arc<Mutex<Inner>>, PathBuf)> = ON_SIGNAL
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter_map(|(w, dir)| Some((w.upgrade()?, dir.clone())))
        .collect();
    for (inner, dir) in live {
        let rec = snapshot(&inner.lock().unwrap_or_else(|p| p.into_inner()));
        match write_atomically(&dir, &rec) {
            Ok(p) => tracing::info!(target: "ringzero::flight", rank = rec.rank,
                "{sig}: flight record of the last {} calls written to {}", rec.entries.len(),
                p.display()),
            Err(e) => tracing::warn!(target: "ringzero::flight", rank = rec.rank,
                "{sig}: could not write the flight record to {}: {e}", dir.display()),
        }
    }
}

fn snapshot(g: &Inner) -> FlightRecord {
    let mut rec = g.head.clone();
    rec.taken_unix_us = now_us();
    rec.entries = g
        .entries
        .iter()
        .map(|s| FlightEntry {
            call: s.fp.to_string(),
            ..s.entry.clone()
        })
        .collect();
    rec.p2p = g
        .p2p
        .iter()
        .map(|(&peer, t)| PeerTraffic {
            peer,
            sent: t.sent,
            received: t.received,
            pending: t
                .pending
                .iter()
                .map(|&(send, seq, fp, start_unix_us)| PendingMsg {
                    send,
                    seq,
                    call: fp.to_string(),
                    start_unix_us,
                })
                .collect(),
        })
        .collect();
    if let (Some((t, _)), Some(last)) = (g.running, rec.entries.last_mut()) {
        if last.state == CallState::Running {
            last.elapsed_us = t.elapsed().as_micros() as u64;
        }
    }
    rec
}

/// Write `rec` into `dir` under its file name, atomically (a reader never sees half a record).
fn write_atomically(dir: &Path, rec: &FlightRecord) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let json = serde_json::to_vec_pretty(rec).map_err(std::io::Error::other)?;
    crate::atomic_file::write_atomically(&dir.join(rec.file_name()), |tmp| {
        std::fs::write(tmp, &json)
    })
}

/// Read every dump in `dir` (files named `ringzero-flight-*.json`), sorted by (job, comm, rank).
/// A file that is not a record is an error naming it.
pub fn read_dir(dir: &Path) -> std::io::Result<Vec<FlightRecord>> {
    let mut out = Vec::new();
    for ent in std::fs::read_dir(dir)? {
        let p = ent?.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if !(name.starts_with(FILE_PREFIX) && name.ends_with(".json")) {
            continue;
        }
        let bytes = std::fs::read(&p)?;
        let rec: FlightRecord = serde_json::from_slice(&bytes).map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{}: not a ringzero flight record: {e}", p.display()),
            )
        })?;
        if rec.format != FORMAT {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "{}: flight record format {} (this ringzero reads format {FORMAT})",
                    p.display(),
                    rec.format
                ),
            ));
        }
        out.push(rec);
    }
    out.sort_by(|a, b| (&a.job_id, &a.comm, a.rank).cmp(&(&b.job_id, &b.comm, b.rank)));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::Collective;
    use ringzero_kernels::{DType, ReduceOp};

    #[test]
    fn sigusr1_markers_name_the_job_as_a_file_name_can() {
        assert_eq!(
            sigusr1_marker("0c3a2b74", 7),
            ".ringzero-sigusr1-0c3a2b74-7"
        );
        // A split communicator's id is its parent's, then `/split...`; explicit configs use
        // `addr:port`.
        assert_eq!(
            sigusr1_marker("0c3a2b74/split1.0", 7),
            ".ringzero-sigusr1-0c3a2b74-7"
        );
        assert_eq!(
            sigusr1_marker("127.0.0.1:29500", 42),
            ".ringzero-sigusr1-127.0.0.1_29500-42"
        );
    }

    fn cfg(entries: usize, dir: Option<PathBuf>) -> Config {
        let mut c = Config::new(1, 3, "127.0.0.1", 1);
        c.flight_entries = entries;
        c.dump_dir = dir;
        c
    }

    fn fp(count: usize) -> Fingerprint {
        Fingerprint::new(
            Collective::AllReduce,
            Some(DType::F32),
            Some(ReduceOp::Sum),
            count,
        )
    }

    fn counters(sent: u64, received: u64) -> Counters {
        Counters {
            bytes_sent: sent,
            bytes_received: received,
            ..Counters::default()
        }
    }

    #[test]
    fn keeps_the_last_entries_with_what_moved_and_how_they_ended() {
        let r = Recorder::new(&cfg(3, None), "host".into(), &[]);
        for seq in 0..5u64 {
            r.begin(
                seq,
                &fp(seq as usize + 1),
                false,
                4,
                counters(seq * 10, seq * 20),
            );
            let res = if seq == 4 {
                Err(Error::config("x", "boom"))
            } else {
                Ok(())
            };
            r.end(&res, counters(seq * 10 + 7, seq * 20 + 9));
        }
        let rec = r.snapshot();
        assert_eq!(rec.dropped, 2);
        let seqs: Vec<u64> = rec.entries.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, vec![2, 3, 4]);
        assert_eq!(rec.entries[0].call, fp(3).to_string());
        assert_eq!((rec.entries[1].sent, rec.entries[1].received), (7, 9));
        assert_eq!(rec.entries[1].state, CallState::Done);
        assert_eq!(rec.entries[2].state, CallState::Failed);
        assert!(rec.entries[2].error.as_deref().unwrap().contains("boom"));
        assert_eq!((rec.rank, rec.size), (1, 3));
    }

    #[test]
    fn a_running_call_shows_as_running_and_zero_entries_records_nothing() {
        let r = Recorder::new(&cfg(4, None), "device".into(), &[]);
        r.begin(0, &fp(8), true, 32, Counters::default());
        let rec = r.snapshot();
        assert_eq!(rec.entries.len(), 1);
        assert_eq!(rec.entries[0].state, CallState::Running);
        assert!(rec.entries[0].in_place);
        let off = Recorder::new(&cfg(0, None), "host".into(), &[]);
        off.begin(0, &fp(8), false, 32, Counters::default());
        off.end(&Ok(()), Counters::default());
        assert!(off.snapshot().entries.is_empty());
    }

    #[test]
    fn a_failure_is_dumped_once_and_reads_back() {
        let dir = std::env::temp_dir().join(format!("ringzero-flight-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let r = Recorder::new(&cfg(8, Some(dir.clone())), "host".into(), &[]);
        r.begin(0, &fp(5), false, 20, Counters::default());
        r.end(&Ok(()), counters(20, 20));
        r.begin(1, &fp(6), false, 24, Counters::default());
        r.end(&Err(Error::config("x", "first")), Counters::default());
        let p = r.failed("first").expect("dumped");
        assert_eq!(p, dir.join("ringzero-flight-host-rank1.json"));
        // A later failure keeps the first dump and the first cause.
        r.begin(2, &fp(7), false, 28, Counters::default());
        r.end(&Err(Error::config("x", "second")), Counters::default());
        assert_eq!(r.failed("second"), Some(p.clone()));
        let back = read_dir(&dir).unwrap();
        assert_eq!(back.len(), 1);
        assert_eq!(back[0].failure.as_deref(), Some("first"));
        assert_eq!(back[0].entries.len(), 2);
        assert_eq!(r.snapshot().failure.as_deref(), Some("first"));
        // Closing rewrites it, marked closed, with every entry.
        assert_eq!(r.closed(), Some(p.clone()));
        let back = read_dir(&dir).unwrap();
        assert!(back[0].closed);
        assert_eq!(back[0].entries.len(), 3);
        assert_eq!(back[0].failure.as_deref(), Some("first"));
        // A file that is not a record is named.
        std::fs::write(dir.join("ringzero-flight-bad.json"), "{").unwrap();
        let e = read_dir(&dir).unwrap_err();
        assert!(e.to_string().contains("ringzero-flight-bad.json"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn no_dump_directory_means_no_file_but_the_failure_is_kept() {
        let r = Recorder::new(&cfg(8, None), "host".into(), &[]);
        assert_eq!(r.failed("why"), None);
        assert_eq!(r.snapshot().failure.as_deref(), Some("why"));
    }
}
