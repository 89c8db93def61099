//! The node board: one shared-memory file every rank of a device communicator maps, with one
//! record per rank, through which ranks that write straight into each other's buffers (the direct
//! collectives, `device::direct`) agree on each call and wait for one another.
//!
//! Layout of the file (offsets in bytes):
//! ```text
//! 0      magic, version, ranks, abort flag (who + 1), reason length, reason (up to 960 bytes)
//! 1024   record of rank 0, 2048 bytes:
//!          0     phase: seq × 4 + step, the last step this rank finished (release store)
//!          8     pid
//!          12    closed: 1 once the rank dropped its end
//!          16    ok: the verdict's flag (1 when it may write), set at step 2, retracted (0) by
//!                a rank that fails after it
//!          64    the rank's [`Entry`] for even calls, 512: for odd calls (written before step 1
//!                is published)
//!          1024  its [`Verdict`] after step 2 (written before step 2 is published)
//!          1536  the call it is in, whatever algorithm runs it: seq + 1 (0: none yet), then
//!                its fingerprint as two words ([`Board::now_in`], a seqlock of atomics)
//! 3072   record of rank 1, ...
//! ```
//! A call's steps on every rank: publish the entry and step 1, wait until every rank has; read the
//! others' entries; then either stop there (the call goes round the ring) or publish a verdict
//! and step 2, wait; do the work; publish step 3, wait. Entries alternate between two places by
//! the call's parity: a rank writes the entry of call `s + 2` only after every rank has published
//! step 1 of call `s + 1`, which each does only after reading the entries of call `s`. A verdict
//! is rewritten only in a later call's step 2, after every rank has entered that call, which each
//! does only after reading the verdicts before. So no read is ever torn or overtaken.
//!
//! Once a rank has published an ok verdict, the others may read its input and write its output
//! as soon as they see every verdict ok, so it must not return (and let its buffers go) while one
//! of them may still do so. Every rank that published a verdict therefore publishes step 3 once
//! it will write no more (its work ended, or it will not write at all), and a rank that fails
//! after step 2 first retracts its flag (so a rank that has not read it yet will not write) and
//! then waits for every rank that may have read it ([`Board::settle`]). The flag, the phases and
//! the loads in between are sequentially consistent: a rank that sees another still before
//! step 2 after retracting knows that rank will read the retraction.
//!
//! A waiting rank notices, at least every `HEALTH_EVERY`: the abort flag (any rank that fails
//! raises it with its reason), a rank whose process died (its pid, as the shm transport checks
//! it) and a rank that dropped its end while its process lives on (the closed flag).

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytemuck::{Pod, Zeroable};
use memmap2::MmapMut;

use super::shm::pid_alive;
use crate::deadline::{Patience, Tick, HEALTH_EVERY};
use crate::error::{Error, Result};
use crate::wire::Fingerprint;

const MAGIC: u64 = u64::from_le_bytes(*b"RZBOARD1");
const VERSION: u32 = 1;
const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_RANKS: usize = 12;
const OFF_ABORT: usize = 16;
const OFF_REASON_LEN: usize = 20;
const OFF_REASON: usize = 64;
const REASON_MAX: usize = 960;
const HEAD: usize = 1024;
const RECORD: usize = 2048;
const R_PHASE: usize = 0;
const R_PID: usize = 8;
const R_CLOSED: usize = 12;
const R_OK: usize = 16;
const R_ENTRY: [usize; 2] = [64, 512];
const R_VERDICT: usize = 1024;
const R_NOW: usize = 1536;
/// [`R_NOW`]'s sequence word while the fingerprint after it is being rewritten.
const NOW_WRITING: u64 = u64::MAX;
/// [`Board::wait`] reads the clock once in this many rounds without progress.
const CLOCK_EVERY: u32 = 16;

pub use ringzero_kernels::device::ShareRecord;

/// Bytes of an [`Entry`]'s or a [`Verdict`]'s note.
pub const NOTE_BYTES: usize = 192;

/// What a rank posts when it enters a call (step 1).
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct Entry {
    /// The call.
    pub fp: Fingerprint,
    /// 1 when this rank can take the direct step for this call (its buffers are shared below).
    pub direct: u32,
    /// 1 when `src` is set.
    pub has_src: u32,
    /// 1 when `dst` is set.
    pub has_dst: u32,
    /// Zero.
    pub _pad: u32,
    /// The buffer the others read.
    pub src: ShareRecord,
    /// The buffer the others write.
    pub dst: ShareRecord,
    /// Why not direct (NUL-padded text).
    pub note: [u8; NOTE_BYTES],
}
const _: () = assert!(std::mem::size_of::<Entry>() <= R_ENTRY[1] - R_ENTRY[0]);
const _: () = assert!(R_ENTRY[1] + std::mem::size_of::<Entry>() <= R_VERDICT);

/// What a rank posts after opening the others' buffers (step 2).
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct Verdict {
    /// 1 when it opened every buffer it needs.
    pub ok: u32,
    /// Zero.
    pub _pad: u32,
    /// Why not (NUL-padded text).
    pub note: [u8; NOTE_BYTES],
}
const _: () = assert!(R_VERDICT + std::mem::size_of::<Verdict>() <= R_NOW);
const _: () = assert!(std::mem::size_of::<Fingerprint>() == 16 && R_NOW + 24 <= RECORD);

/// Why a wait on the board ended without every rank getting there.
#[derive(Debug)]
pub enum Stall {
    /// No progress within the deadline; the first rank still missing.
    Timeout {
        /// The rank.
        rank: usize,
    },
    /// A rank's process exited or it dropped its end.
    Lost {
        /// The rank.
        rank: usize,
        /// What was seen.
        detail: String,
    },
    /// A rank raised the abort flag.
    Aborted {
        /// Its reason.
        reason: String,
    },
    /// The caller's own check failed (an abort on this rank).
    Check(Error),
}

impl Stall {
    /// The error of call `seq` (`op`, its fingerprint's text) whose wait for the other ranks
    /// to `doing` ended with this stall; `timeout` is the call's deadline, `place` where on the
    /// board it waited (`direct step 2 on the node board`).
    pub fn error(
        self,
        (op, seq): (String, u64),
        timeout: Duration,
        doing: &str,
        place: &str,
    ) -> Error {
        match self {
            Stall::Timeout { rank } => Error::Timeout {
                op,
                seq,
                peer: rank,
                waiting: format!("rank {rank} to {doing} ({place})"),
                after: timeout,
            },
            Stall::Lost { rank, detail } => Error::PeerLost {
                op,
                seq,
                peer: rank,
                detail,
            },
            Stall::Aborted { reason } => Error::Aborted { op, seq, reason },
            Stall::Check(e) => e,
        }
    }
}

/// One rank's view of the board.
pub struct Board {
    map: MmapMut,
    path: PathBuf,
    ranks: usize,
    rank: usize,
    /// Whether this end still has to unlink the file.
    unlink: bool,
    /// Whether waits are paced by the host (spin, yield, nap) rather than by device work.
    host_paced: bool,
}

impl Board {
    /// Create the board for `ranks` ranks in `dir` (rank 0 does, then shares the path).
    pub fn create(dir: &Path, name: &str, ranks: usize, rank: usize) -> Result<Board> {
        let (file, path) = super::shm::create_segment(dir, name, HEAD + ranks * RECORD)?;
        // SAFETY: the file was just created by us with O_EXCL and sized; it is shared only with
        // the other ranks through the protocol in the module docs (atomics, and plain bytes read
        // only after an acquire load that orders them).
        let map = match unsafe { MmapMut::map_mut(&file) } {
            Ok(m) => m,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(Error::io("mapping the node board", e));
            }
        };
        let b = Board {
            map,
            path,
            ranks,
            rank,
            unlink: true,
            host_paced: false,
        };
        b.u64(OFF_MAGIC).store(MAGIC, Ordering::Relaxed);
        b.u32(OFF_VERSION).store(VERSION, Ordering::Relaxed);
        b.u32(OFF_RANKS).store(ranks as u32, Ordering::Release);
        b.join();
        Ok(b)
    }

    /// Map the board rank 0 created at `path`.
    pub fn attach(path: &Path, ranks: usize, rank: usize) -> Result<Board> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| Error::io(format!("opening the node board {}", path.display()), e))?;
        let len = file
            .metadata()
            .map_err(|e| Error::io("reading the node board's size", e))?
            .len() as usize;
        if len != HEAD + ranks * RECORD {
            return Err(Error::Protocol {
                peer: "rank 0".into(),
                detail: format!(
                    "the node board {} has {len} bytes, {} were expected for {ranks} ranks",
                    path.display(),
                    HEAD + ranks * RECORD
                ),
            });
        }
        // SAFETY: as in `create`; the length was just checked against the layout.
        let map = unsafe { MmapMut::map_mut(&file) }
            .map_err(|e| Error::io("mapping the node board", e))?;
        let b = Board {
            map,
            path: path.to_path_buf(),
            ranks,
            rank,
            unlink: false,
            host_paced: false,
        };
        let (magic, version, n) = (
            b.u64(OFF_MAGIC).load(Ordering::Acquire),
            b.u32(OFF_VERSION).load(Ordering::Relaxed),
            b.u32(OFF_RANKS).load(Ordering::Relaxed),
        );
        if magic != MAGIC || version != VERSION || n as usize != ranks {
            return Err(Error::Protocol {
                peer: "rank 0".into(),
                detail: format!(
                    "{} is not a node board of version {VERSION} for {ranks} ranks",
                    path.display()
                ),
            });
        }
        b.join();
        Ok(b)
    }

    /// This board with waits paced by the host: the ranks wait for one another's copies, not
    /// for kernels, so a wait yields for microseconds before it naps
    /// ([`super::wait::Waiter::backoff`]) rather than milliseconds.
    pub fn host_paced(mut self) -> Board {
        self.host_paced = true;
        self
    }

    fn waiter(&self) -> super::wait::Waiter {
        if self.host_paced {
            super::wait::Waiter::backoff()
        } else {
            super::wait::Waiter::device()
        }
    }

    /// The file's path (what rank 0 shares).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Remove the file once every rank has mapped it (rank 0; dropping does it otherwise).
    pub fn unlink(&mut self) {
        if std::mem::take(&mut self.unlink) {
            let _ = std::fs::remove_file(&self.path);
        }
    }

    /// Wait until every rank has mapped the board (its pid is in its record): what rank 0 waits
    /// for before it unlinks a board whose path it shared without a collective after it. No
    /// progress for `timeout` is a [`Stall::Timeout`] naming the first rank missing (one that
    /// failed to map it, or died first).
    pub fn wait_joined(&self, timeout: Duration) -> std::result::Result<(), Stall> {
        let mut waiter = self.waiter();
        let mut patience = Patience::new(Instant::now());
        loop {
            let missing = (0..self.ranks)
                .find(|&q| self.u32(self.record(q) + R_PID).load(Ordering::Acquire) == 0);
            let Some(rank) = missing else {
                return Ok(());
            };
            // Not the abort flag: a rank that mapped the board may fail its first call while
            // another has yet to map it, and that one still needs the file.
            if patience.tick(Instant::now(), false, timeout) == Tick::TimedOut {
                return Err(Stall::Timeout { rank });
            }
            waiter.idle(timeout);
        }
    }

    fn join(&self) {
        let r = self.rank * RECORD + HEAD;
        self.u32(r + R_PID)
            .store(std::process::id(), Ordering::Release);
    }

    fn u64(&self, off: usize) -> &AtomicU64 {
        assert!(off.is_multiple_of(8) && off + 8 <= self.map.len());
        // SAFETY: in bounds and 8-byte aligned (the mapping is page-aligned); shared memory is
        // accessed only through atomics at these offsets.
        unsafe { &*(self.map.as_ptr().add(off) as *const AtomicU64) }
    }

    fn u32(&self, off: usize) -> &AtomicU32 {
        assert!(off.is_multiple_of(4) && off + 4 <= self.map.len());
        // SAFETY: as for `u64`.
        unsafe { &*(self.map.as_ptr().add(off) as *const AtomicU32) }
    }

    fn record(&self, rank: usize) -> usize {
        HEAD + rank * RECORD
    }

    /// Write `value` at `off` (this rank's own record; no other rank reads it until the phase
    /// store that follows).
    fn put<T: Pod>(&self, off: usize, value: &T) {
        let bytes = bytemuck::bytes_of(value);
        assert!(off + bytes.len() <= self.map.len());
        // SAFETY: in bounds; only this rank writes its record, and the other ranks read these
        // bytes only after the release store of the phase that follows (see the module docs), so
        // no access races with this copy. The pointer comes from the mapping's base, which is
        // writable shared memory.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.map.as_ptr().add(off) as *mut u8,
                bytes.len(),
            )
        };
    }

    fn get<T: Pod>(&self, off: usize) -> T {
        let n = std::mem::size_of::<T>();
        assert!(off + n <= self.map.len());
        let mut v = T::zeroed();
        // SAFETY: in bounds; the caller has seen, with an acquire load, the phase published after
        // these bytes were written, and the writer does not rewrite them until this rank has
        // published a later phase.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(off),
                bytemuck::bytes_of_mut(&mut v).as_mut_ptr(),
                n,
            )
        };
        v
    }

    fn phase(seq: u64, step: u64) -> u64 {
        seq * 4 + step
    }

    /// Note that this rank is in call `seq`, fingerprinted `fp`, whatever algorithm runs it: a
    /// rank waiting on the board for that call learns from [`Board::now_in`] that this one made
    /// another call instead, and fails at once naming both rather than at the deadline.
    pub fn now_in(&self, seq: u64, fp: &Fingerprint) {
        let r = self.record(self.rank) + R_NOW;
        let words: [u64; 2] = bytemuck::cast(*fp);
        self.u64(r).store(NOW_WRITING, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Release);
        self.u64(r + 8).store(words[0], Ordering::Relaxed);
        self.u64(r + 16).store(words[1], Ordering::Relaxed);
        self.u64(r).store(seq + 1, Ordering::Release);
    }

    /// The call `rank` last noted with [`Board::now_in`], if any, read consistently.
    pub fn call_of(&self, rank: usize) -> Option<(u64, Fingerprint)> {
        let r = self.record(rank) + R_NOW;
        loop {
            let before = self.u64(r).load(Ordering::Acquire);
            if before == 0 {
                return None;
            }
            let words = [
                self.u64(r + 8).load(Ordering::Relaxed),
                self.u64(r + 16).load(Ordering::Relaxed),
            ];
            std::sync::atomic::fence(Ordering::Acquire);
            if before != NOW_WRITING && self.u64(r).load(Ordering::Relaxed) == before {
                return Some((before - 1, bytemuck::cast(words)));
            }
            std::hint::spin_loop();
        }
    }

    /// The first rank whose noted call is `seq` with a fingerprint other than `fp`, with its.
    pub fn other_call(&self, seq: u64, fp: &Fingerprint) -> Option<(usize, Fingerprint)> {
        (0..self.ranks)
            .filter(|&q| q != self.rank)
            .find_map(|q| match self.call_of(q) {
                Some((s, theirs)) if s == seq && theirs != *fp => Some((q, theirs)),
                _ => None,
            })
    }

    /// Post this rank's entry for call `seq` and finish step 1.
    pub fn enter(&self, seq: u64, entry: &Entry) {
        let r = self.record(self.rank);
        self.put(r + R_ENTRY[(seq % 2) as usize], entry);
        self.u64(r + R_PHASE)
            .store(Self::phase(seq, 1), Ordering::Release);
    }

    /// Post this rank's verdict for call `seq` and finish step 2.
    pub fn decide(&self, seq: u64, verdict: &Verdict) {
        let r = self.record(self.rank);
        self.put(r + R_VERDICT, verdict);
        self.u32(r + R_OK).store(verdict.ok, Ordering::SeqCst);
        self.u64(r + R_PHASE)
            .store(Self::phase(seq, 2), Ordering::SeqCst);
    }

    /// Take back this rank's ok verdict (it fails after step 2): a rank that reads the verdicts
    /// from now on takes the ring instead of writing into this rank's buffers.
    pub fn retract(&self) {
        let r = self.record(self.rank);
        self.u32(r + R_OK).store(0, Ordering::SeqCst);
    }

    /// Finish step 3 of call `seq`: this rank writes into no other rank's buffers for it any
    /// more.
    pub fn done(&self, seq: u64) {
        let r = self.record(self.rank);
        self.u64(r + R_PHASE)
            .store(Self::phase(seq, 3), Ordering::SeqCst);
    }

    /// `rank`'s entry for call `seq` (after a wait for its step 1 has returned).
    pub fn entry(&self, seq: u64, rank: usize) -> Entry {
        self.get(self.record(rank) + R_ENTRY[(seq % 2) as usize])
    }

    /// Whether `rank`'s verdict lets the others write (after a wait for step 2 of this call has
    /// returned; 0 once retracted).
    pub fn verdict_ok(&self, rank: usize) -> bool {
        self.u32(self.record(rank) + R_OK).load(Ordering::SeqCst) != 0
    }

    /// Why `rank`'s verdict is not ok (after a wait for step 2 of this call has returned).
    pub fn verdict_note(&self, rank: usize) -> [u8; NOTE_BYTES] {
        let off = self.record(rank) + R_VERDICT + std::mem::offset_of!(Verdict, note);
        self.get(off)
    }

    /// After this rank published step 3 of call `seq` (and, failing, retracted its verdict):
    /// wait until no other rank may still write into its buffers for that call — each has
    /// published step 3, or had not published step 2 when this rank looked (it will read the
    /// retraction), or is gone ([`Stall::Lost`]). No deadline: host memory must outlive the
    /// others' writes, and those always end (every rank that published a verdict publishes
    /// step 3 once it writes no more).
    pub fn settle(&self, seq: u64) -> std::result::Result<(), Stall> {
        let (decided, done) = (Self::phase(seq, 2), Self::phase(seq, 3));
        let mut waiter = self.waiter();
        // No deadline (see above): only the health checks are due.
        let mut health = Patience::new(Instant::now());
        loop {
            let writing = (0..self.ranks).filter(|&q| q != self.rank).find(|&q| {
                let p = self.u64(self.record(q) + R_PHASE).load(Ordering::SeqCst);
                p >= decided && p < done
            });
            let Some(q) = writing else {
                return Ok(());
            };
            if health.tick(Instant::now(), false, Duration::MAX) == Tick::Check {
                if let Some(lost) = self.gone(q) {
                    return Err(lost);
                }
            }
            waiter.idle(HEALTH_EVERY);
        }
    }

    /// Whether rank `q`'s process exited or it dropped its end.
    fn gone(&self, q: usize) -> Option<Stall> {
        let r = self.record(q);
        let pid = self.u32(r + R_PID).load(Ordering::Acquire);
        if !pid_alive(pid) {
            return Some(Stall::Lost {
                rank: q,
                detail: format!("rank {q}'s process (pid {pid}) has exited"),
            });
        }
        if self.u32(r + R_CLOSED).load(Ordering::Acquire) != 0 {
            return Some(Stall::Lost {
                rank: q,
                detail: format!("rank {q} closed its communicator"),
            });
        }
        None
    }

    /// Wait until every rank has finished `step` of call `seq`: no progress for `timeout` is a
    /// [`Stall::Timeout`]; `check` runs at every health check (this rank's own abort).
    pub fn wait(
        &self,
        seq: u64,
        step: u64,
        timeout: Duration,
        mut check: impl FnMut() -> Result<()>,
    ) -> std::result::Result<(), Stall> {
        let want = Self::phase(seq, step);
        let mut waiter = self.waiter();
        let mut patience = Patience::new(Instant::now());
        let (mut missing, mut rounds) = (0, 0u32);
        loop {
            let before = missing;
            while missing < self.ranks
                && self
                    .u64(self.record(missing) + R_PHASE)
                    .load(Ordering::Acquire)
                    >= want
            {
                missing += 1;
            }
            if missing == self.ranks {
                return Ok(());
            }
            // The clock only every few idle rounds: reading it costs about what a round does.
            rounds += 1;
            if missing == before && !rounds.is_multiple_of(CLOCK_EVERY) {
                waiter.idle(timeout);
                continue;
            }
            let tick = patience.tick(Instant::now(), missing != before, timeout);
            if tick == Tick::Moved {
                waiter.progressed();
                continue;
            }
            if tick == Tick::Check {
                check().map_err(Stall::Check)?;
                if let Err(stall) = self.health() {
                    // A rank that got there and then left (closed its end, exited, aborted a
                    // later call) published its phase first: look again before blaming it.
                    let all = (0..self.ranks).all(|q| {
                        self.u64(self.record(q) + R_PHASE).load(Ordering::Acquire) >= want
                    });
                    return if all { Ok(()) } else { Err(stall) };
                }
            }
            if tick == Tick::TimedOut {
                return Err(Stall::Timeout { rank: missing });
            }
            waiter.idle(timeout);
        }
    }

    /// The abort flag, then every other rank's process and closed flag.
    fn health(&self) -> std::result::Result<(), Stall> {
        if let Some(reason) = self.aborted() {
            return Err(Stall::Aborted { reason });
        }
        match (0..self.ranks)
            .filter(|&q| q != self.rank)
            .find_map(|q| self.gone(q))
        {
            Some(lost) => Err(lost),
            None => Ok(()),
        }
    }

    /// Raise the abort flag with `reason` (the first reason stays).
    pub fn abort(&self, reason: &str) {
        let who = self.rank as u32 + 1;
        if self
            .u32(OFF_ABORT)
            .compare_exchange(0, u32::MAX, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return;
        }
        let b = reason.as_bytes();
        let n = b.len().min(REASON_MAX);
        let mut text = [0u8; REASON_MAX];
        text[..n].copy_from_slice(&b[..n]);
        self.put(OFF_REASON, &text);
        self.u32(OFF_REASON_LEN).store(n as u32, Ordering::Relaxed);
        // Published last: readers see the reason once they see who.
        self.u32(OFF_ABORT).store(who, Ordering::Release);
    }

    /// Who raised the abort flag and why, once one has (and finished writing the reason).
    pub fn aborted(&self) -> Option<String> {
        let who = self.u32(OFF_ABORT).load(Ordering::Acquire);
        if who == 0 || who == u32::MAX {
            return None;
        }
        let n = (self.u32(OFF_REASON_LEN).load(Ordering::Relaxed) as usize).min(REASON_MAX);
        let text: [u8; REASON_MAX] = self.get(OFF_REASON);
        Some(format!(
            "rank {} aborted: {}",
            who - 1,
            String::from_utf8_lossy(&text[..n])
        ))
    }
}

impl Drop for Board {
    fn drop(&mut self) {
        let r = self.record(self.rank);
        self.u32(r + R_CLOSED).store(1, Ordering::Release);
        self.unlink();
    }
}

/// `s` as NUL-padded note text.
pub fn note(s: &str) -> [u8; NOTE_BYTES] {
    let mut b = [0u8; NOTE_BYTES];
    let n = s.len().min(NOTE_BYTES);
    b[..n].copy_from_slice(&s.as_bytes()[..n]);
    b
}

/// A note's text.
pub fn note_text(b: &[u8; NOTE_BYTES]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::Collective;

    fn entry(count: usize) -> Entry {
        let mut e = Entry::zeroed();
        e.fp = Fingerprint::new(Collective::AllReduce, None, None, count);
        e.direct = 1;
        e.src.offset = count as u64;
        e
    }

    fn boards(n: usize) -> Vec<Board> {
        let dir = std::env::temp_dir();
        let name = format!(
            "ringzero-board-test-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        );
        let first = Board::create(&dir, &name, n, 0).unwrap();
        let path = first.path().to_path_buf();
        let mut v = vec![first];
        for r in 1..n {
            v.push(Board::attach(&path, n, r).unwrap());
        }
        v[0].unlink();
        assert!(!path.exists(), "unlinked once every rank mapped it");
        v
    }

    #[test]
    fn every_rank_sees_the_others_entries_after_each_step() {
        let b = boards(3);
        let short = Duration::from_millis(200);
        for seq in 0..3u64 {
            for (r, x) in b.iter().enumerate() {
                // Not all there yet: rank 2 has not entered.
                if r == 2 {
                    assert!(matches!(
                        b[0].wait(seq, 1, short, || Ok(())),
                        Err(Stall::Timeout { rank: 2 })
                    ));
                }
                x.enter(seq, &entry(100 * seq as usize + r));
            }
            for x in &b {
                x.wait(seq, 1, short, || Ok(())).unwrap();
                for q in 0..3 {
                    assert_eq!(x.entry(seq, q).src.offset, 100 * seq + q as u64);
                }
            }
            for (r, x) in b.iter().enumerate() {
                let mut v = Verdict::zeroed();
                v.ok = (r != 1) as u32;
                v.note = note("cannot open");
                x.decide(seq, &v);
            }
            for x in &b {
                x.wait(seq, 2, short, || Ok(())).unwrap();
                assert!(!x.verdict_ok(1) && x.verdict_ok(0));
                assert_eq!(note_text(&x.verdict_note(1)), "cannot open");
                x.done(seq);
            }
            for x in &b {
                x.wait(seq, 3, short, || Ok(())).unwrap();
            }
        }
    }

    /// A rank that finds everyone entered may run ahead into the next call (a ring call has no
    /// later step to hold it) before a slower rank has read its entry: the slower rank still
    /// reads the entry of the call it is in.
    #[test]
    fn a_rank_running_ahead_does_not_overwrite_the_entry_a_slower_rank_reads() {
        let b = boards(2);
        let short = Duration::from_millis(200);
        b[0].enter(0, &entry(10));
        b[1].enter(0, &entry(11));
        b[0].wait(0, 1, short, || Ok(())).unwrap();
        b[0].enter(1, &entry(20));
        b[1].wait(0, 1, short, || Ok(())).unwrap();
        assert_eq!(b[1].entry(0, 0).src.offset, 10);
        assert_eq!(b[1].entry(1, 0).src.offset, 20);
    }

    #[test]
    fn an_abort_a_closed_rank_and_the_callers_check_end_a_wait_early() {
        let mut b = boards(3);
        let long = Duration::from_secs(30);
        b[1].abort("device error");
        b[2].abort("second reason, ignored");
        let t = Instant::now();
        match b[0].wait(0, 1, long, || Ok(())) {
            Err(Stall::Aborted { reason }) => assert_eq!(reason, "rank 1 aborted: device error"),
            other => panic!("{other:?}"),
        }
        assert!(t.elapsed() < Duration::from_secs(5));
        let c = boards(2);
        let mut c = c.into_iter();
        let (c0, c1) = (c.next().unwrap(), c.next().unwrap());
        drop(c1);
        match c0.wait(0, 1, long, || Ok(())) {
            Err(Stall::Lost { rank: 1, detail }) => assert!(detail.contains("closed"), "{detail}"),
            other => panic!("{other:?}"),
        }
        // A rank that finished the step and then closed is not lost for that step.
        let c = boards(2);
        let mut c = c.into_iter();
        let (c0, c1) = (c.next().unwrap(), c.next().unwrap());
        c0.enter(0, &entry(1));
        c1.enter(0, &entry(2));
        drop(c1);
        std::thread::sleep(Duration::from_millis(30));
        c0.wait(0, 1, long, || Ok(())).unwrap();
        let e = b.remove(0).wait(0, 1, long, || {
            Err(Error::Protocol {
                peer: "me".into(),
                detail: "stop".into(),
            })
        });
        assert!(matches!(e, Err(Stall::Check(_))), "{e:?}");
    }

    /// A rank whose process has exited (here: rank 1's record carries the pid of a child that
    /// has been reaped) is named within a health check, not at the deadline.
    #[test]
    fn a_rank_whose_process_exited_is_named_at_once() {
        let b = boards(2);
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        b[1].u32(b[1].record(1) + R_PID)
            .store(pid, Ordering::Release);
        b[0].enter(0, &entry(1));
        let t = Instant::now();
        match b[0].wait(0, 1, Duration::from_secs(30), || Ok(())) {
            Err(Stall::Lost { rank: 1, detail }) => {
                assert!(detail.contains(&format!("pid {pid}")), "{detail}")
            }
            other => panic!("{other:?}"),
        }
        assert!(t.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_board_of_another_size_is_refused() {
        let dir = std::env::temp_dir();
        let name = format!(
            "ringzero-board-size-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        );
        let b = Board::create(&dir, &name, 2, 0).unwrap();
        let e = Board::attach(b.path(), 3, 1).err().unwrap().to_string();
        assert!(e.contains("were expected for 3 ranks"), "{e}");
    }
}
