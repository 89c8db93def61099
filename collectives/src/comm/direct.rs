//! The host communicator's single-copy all-gather: ranks whose ring edges are all shared memory
//! (one node, processes or threads) read each other's part straight out of the owner's memory
//! with `process_vm_readv` ([`crate::transport::cma`]) — one copy per byte, all ranks at once —
//! instead of passing it hop by hop through the slots, which copies each byte twice and waits on
//! a hand-off per slice.
//!
//! Which sizes: from `RINGZERO_SINGLE_COPY_FROM` (64 KiB; below it the slots' one hand-off costs
//! less than the system call and two waits) up, bounded by `RINGZERO_SINGLE_COPY_BELOW` only
//! where it is set (for a machine where the slots' pipelined copies, the middle one in cache,
//! outrun one copy between processes at large sizes). `docs/design-notes.md` has the
//! measurements.
//!
//! Each call takes two steps on the node board ([`Board`], the device communicator's direct
//! collectives use the same), every rank alike:
//! 1. post the call's fingerprint and where its input is (process, address, bytes); wait for
//!    every rank. A rank that made another call fails the call on every rank, naming both (every
//!    host call notes itself on the board, [`Board::now_in`], so a rank that went round the ring
//!    is seen too);
//! 2. read every other rank's chunk into this rank's output ([`pulls`]: the next rank's first, so
//!    the ranks read from different peers at once; a chunk that lies in a [`crate::SharedBuf`]
//!    with a `memcpy` from this rank's kept mapping of it, `comm/shared_buf.rs`), post whether
//!    that worked, wait for every rank: then no rank reads this rank's input any more, and it
//!    may return.
//!
//! Where some rank could not read (Yama forbids it, a seccomp filter, another user), every rank
//! sees its verdict, runs this call round the ring instead, and takes the ring for every later
//! all-gather; the reason is logged once.
//!
//! A rank that fails returns while others may still be reading its input. That is sound — the
//! kernel checks each read against the owner's mappings, and only the reader's output is
//! written — and never silently wrong: the failing rank raises the board's abort flag before it
//! returns (so before its caller can change the input), and every rank looks at that flag after
//! its last wait, so a rank whose read may have overlapped the change fails too.
//!
//! Only this rank's output is ever written, by this rank; no rank writes another's memory.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bytemuck::Zeroable;

use super::shared_buf::{mark_shared, PeerMaps};
use super::{fixed, unfixed, Communicator};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::ring::call::Call;
use crate::ring::engine::Bufs;
use crate::ring::{chunk, Collective};
use crate::transport::board::{note, note_text, Board, Entry, Stall, Verdict};
use crate::transport::cma;
use crate::transport::TransportKind;
use crate::wire::Fingerprint;

/// One read of a single-copy all-gather: `elems` elements at element `src_at` of rank `from`'s
/// input into element `dst_at` of this rank's output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Pull {
    pub from: usize,
    pub src_at: usize,
    pub dst_at: usize,
    pub elems: usize,
}

/// Rank `rank`'s reads in a single-copy all-gather of `count` elements on `n` ranks: chunk `q`
/// of every other rank `q` (whose input is that chunk alone out of place, the whole buffer in
/// place), the next rank's first. Empty chunks are left out. Pure.
pub(crate) fn pulls(n: usize, rank: usize, count: usize, in_place: bool) -> Vec<Pull> {
    (1..n)
        .map(|k| (rank + k) % n)
        .map(|q| {
            let c = chunk(count, n, q);
            Pull {
                from: q,
                src_at: if in_place { c.start } else { 0 },
                dst_at: c.start,
                elems: c.len(),
            }
        })
        .filter(|p| p.elems > 0)
        .collect()
}

/// This rank's single-copy offer in the start-up all-gather ([`Communicator::single_copy_offer`]).
pub(super) struct Offer {
    /// Rank 0's board path; `!` and why this rank cannot take part; or nothing.
    pub record: [u8; 128],
    /// The board, on rank 0.
    pub board: Option<Board>,
}

/// A host communicator's single-copy side: the node board and its threshold.
pub(crate) struct HostDirect {
    board: Board,
    rank: usize,
    ranks: usize,
    /// This process's id, which the others read with (a system call each time otherwise).
    pid: u32,
    /// The all-gathers (bytes of the result) that read directly.
    sizes: std::ops::Range<usize>,
    /// Raised, alike on every rank, once some rank could not read another: every later call
    /// takes the ring.
    off: AtomicBool,
    /// The other ranks' [`crate::SharedBuf`]s this rank has mapped.
    peer_maps: PeerMaps,
    /// Bytes read through those mappings ([`crate::Counters::bytes_mapped`]).
    mapped: AtomicU64,
}

impl HostDirect {
    /// Whether a call of `coll` on `bytes` (the whole result; `balanced`: not a v-collective)
    /// reads directly. The same on every rank that shares the configuration.
    pub(crate) fn takes(&self, coll: Collective, balanced: bool, bytes: usize) -> bool {
        coll == Collective::AllGather
            && balanced
            && self.sizes.contains(&bytes)
            && !self.off.load(Ordering::Relaxed)
    }

    /// Note that this rank is in call `seq` ([`Board::now_in`]).
    pub(crate) fn now_in(&self, seq: u64, fp: &Fingerprint) {
        self.board.now_in(seq, fp);
    }

    /// Tell every rank waiting on the board that this one fails.
    pub(crate) fn abort(&self, reason: &str) {
        self.board.abort(reason);
    }

    /// Run `call`, an all-gather of `count` elements, on the board. `Ok(true)` when it ran
    /// directly; `Ok(false)` when every rank takes the ring for it instead (the output may have
    /// been partly written; the ring writes all of it).
    pub(crate) fn all_gather(&self, call: &Call, count: usize, bufs: &mut Bufs) -> Result<bool> {
        let (seq, fp, es) = (call.seq, call.fp, call.dtype.size());
        let in_place = matches!(bufs, Bufs::One(_));
        let mine = chunk(count, self.ranks, self.rank);
        let (src, src_len) = match bufs {
            Bufs::Split { input, .. } => (input.as_ptr(), input.len()),
            Bufs::One(buf) => (buf.as_ptr(), buf.len()),
        };
        let mut entry = Entry::zeroed();
        entry.fp = fp;
        entry.direct = 1;
        entry.has_src = 1;
        entry.src.handle[..4].copy_from_slice(&self.pid.to_le_bytes());
        entry.src.offset = src as u64;
        entry.src.bytes = src_len as u64;
        mark_shared(&mut entry.src);
        self.board.enter(seq, &entry);
        // From here the others may read this rank's input. Out of place, this rank's own part
        // goes into its output while the others arrive (no one reads this rank's output).
        if let Bufs::Split { input, output } = bufs {
            let own = &mut output[mine.start * es..mine.end * es];
            if call.stream_stores {
                // A part larger than the caches: no read-before-write of its lines.
                ringzero_kernels::cpu::copy_streaming(own, input).expect("equal lengths");
                ringzero_kernels::cpu::stream_fence();
            } else {
                own.copy_from_slice(input);
            }
        }
        let outcome = (|| -> Result<bool> {
            self.wait(call, 1, "enter the call")?;
            let entries: Vec<Entry> = (0..self.ranks).map(|q| self.board.entry(seq, q)).collect();
            if let Some(q) = (0..self.ranks).find(|&q| entries[q].fp != fp) {
                return Err(mismatch(call, self.rank, q, &entries[q].fp));
            }
            let mut verdict = Verdict::zeroed();
            match self.read(&entries, (count, in_place, es), call.stream_stores, bufs) {
                Ok(()) => verdict.ok = 1,
                Err(why) => verdict.note = note(&format!("rank {}: {why}", self.rank)),
            }
            self.board.decide(seq, &verdict);
            self.wait(call, 2, "finish reading")?;
            // A rank that failed raised the flag before its caller could change its input.
            if let Some(reason) = self.board.aborted() {
                return Err(Error::Aborted {
                    op: fp.to_string(),
                    seq,
                    reason,
                });
            }
            if let Some(q) = (0..self.ranks).find(|&q| !self.board.verdict_ok(q)) {
                let why = note_text(&self.board.verdict_note(q));
                if !self.off.swap(true, Ordering::Relaxed) && self.rank == 0 {
                    tracing::warn!(target: "ringzero::topology",
                        "single-copy all-gather off, the ring's slots from now on: {why}");
                }
                return Ok(false);
            }
            Ok(true)
        })();
        if let Err(e) = &outcome {
            self.board.abort(&format!("rank {}: {e}", self.rank));
        }
        outcome
    }

    /// This rank's reads: every other rank's part, out of that rank's process (through this
    /// rank's mapping where the part lies in a [`crate::SharedBuf`]; `streaming`: with
    /// streaming stores there). What failed, as the verdict's note.
    fn read(
        &self,
        entries: &[Entry],
        (count, in_place, es): (usize, bool, usize),
        streaming: bool,
        bufs: &mut Bufs,
    ) -> std::result::Result<(), String> {
        let out: &mut [u8] = match bufs {
            Bufs::Split { output, .. } => output,
            Bufs::One(buf) => buf,
        };
        for p in pulls(self.ranks, self.rank, count, in_place) {
            let e = &entries[p.from];
            let pid = u32::from_le_bytes(e.src.handle[..4].try_into().expect("4 bytes"));
            let (at, len) = (p.src_at * es, p.elems * es);
            if e.has_src == 0 || (at + len) as u64 > e.src.bytes {
                return Err(format!(
                    "rank {}'s input has {} bytes, {len} were to be read at {at}",
                    p.from, e.src.bytes
                ));
            }
            let dst = &mut out[p.dst_at * es..p.dst_at * es + len];
            match self.peer_maps.read(p.from, &e.src, at, dst, streaming) {
                Ok(true) => {
                    self.mapped.fetch_add(len as u64, Ordering::Relaxed);
                    continue;
                }
                Ok(false) => {}
                Err(why) => tracing::debug!(target: "ringzero::topology",
                    "rank {}: rank {}'s shared buffer could not be mapped, reading it with \
                     process_vm_readv: {why}", self.rank, p.from),
            }
            cma::read(pid, e.src.offset + at as u64, dst)
                .map_err(|err| format!("reading rank {}: {}", p.from, cma::explain(&err, pid)))?;
        }
        Ok(())
    }

    /// Bytes this rank read through its mappings of other ranks' shared buffers.
    pub(crate) fn bytes_mapped(&self) -> u64 {
        self.mapped.load(Ordering::Relaxed)
    }

    /// Wait for every rank to finish `step` of `call`; a rank found in another call fails it.
    fn wait(&self, call: &Call, step: u64, doing: &str) -> Result<()> {
        let check = || {
            call.abort.check(call)?;
            match self.board.other_call(call.seq, &call.fp) {
                Some((q, theirs)) => Err(mismatch(call, self.rank, q, &theirs)),
                None => Ok(()),
            }
        };
        self.board
            .wait(call.seq, step, call.timeout, check)
            .map_err(|s: Stall| {
                let place = format!("single-copy step {step} on the node board");
                s.error((call.fp.to_string(), call.seq), call.timeout, doing, &place)
            })
    }
}

/// Rank `q` is in `call`'s sequence number with `theirs` instead.
fn mismatch(call: &Call, rank: usize, q: usize, theirs: &Fingerprint) -> Error {
    Error::Mismatch {
        seq: call.seq,
        rank,
        ours: call.fp.to_string(),
        peer: q,
        theirs: format!("{theirs} (seq {})", call.seq),
    }
}

impl Communicator {
    /// The all-gathers (bytes of the whole result) that read each rank's part straight out of
    /// its process, or `None` where every all-gather goes through the slots (an edge that is not
    /// shared memory, `RINGZERO_SINGLE_COPY_FROM=off`, one rank, or a rank found unreadable by
    /// an earlier call). See [`Config::single_copy_from`] and [`Config::single_copy_below`].
    pub fn single_copy_sizes(&self) -> Option<std::ops::Range<usize>> {
        self.inner
            .direct
            .get()
            .filter(|d| !d.off.load(Ordering::Relaxed))
            .map(|d| d.sizes.clone())
    }

    /// This rank's part of the single-copy start-up, before the start-up all-gather: whether it
    /// can take part (every ring edge shared memory, the threshold not `off`, this process
    /// readable by the others) and, on rank 0, the node board created for it.
    pub(super) fn single_copy_offer(&self) -> Offer {
        let inner = &self.inner;
        let (from, below) = (inner.cfg.single_copy_from, inner.cfg.single_copy_below);
        let why_not = if from == usize::MAX || from >= below {
            Some(
                "RINGZERO_SINGLE_COPY_FROM=off (or not below RINGZERO_SINGLE_COPY_BELOW)"
                    .to_string(),
            )
        } else if let Some(e) = inner.edges.iter().find(|e| e.kind != TransportKind::Shm) {
            Some(format!("the edge {} → {} is {}", e.from, e.to, e.kind))
        } else {
            cma::allow_readers().err()
        };
        let made = match (&why_not, inner.rank) {
            (None, 0) => create_board(&inner.cfg, inner.size)
                .map_err(|e| format!("the node board could not be created: {e}")),
            _ => Err(String::new()),
        };
        let (record, board) = match (why_not, made) {
            (Some(why), _) => (fixed(&format!("!{why}")), None),
            (None, Ok(b)) => (fixed(&b.path().to_string_lossy()), Some(b)),
            (None, Err(why)) if inner.rank == 0 => (fixed(&format!("!{why}")), None),
            (None, Err(_)) => ([0u8; 128], None),
        };
        Offer { record, board }
    }

    /// The rest of the start-up, after the start-up all-gather brought every rank's offer
    /// (`offers`, in rank order): where every rank can take part, rank 0 keeps the board it
    /// created (`board`) and every other rank maps it; otherwise no rank reads directly. No
    /// collective: the file's name travels in the offers, and rank 0 waits until every rank has
    /// mapped it (the others do so right after the all-gather), then unlinks it.
    pub(super) fn single_copy_setup(
        &self,
        board: Option<Board>,
        offers: &[[u8; 128]],
    ) -> Result<()> {
        let inner = &self.inner;
        let refusal = offers
            .iter()
            .enumerate()
            .find(|(_, o)| o[0] == b'!')
            .map(|(r, o)| format!("rank {r}: {}", unfixed(&o[1..])));
        if let Some(why) = refusal {
            tracing::debug!(target: "ringzero::topology", rank = inner.rank,
                "all-gathers through the slots only: {why}");
            return Ok(());
        }
        let board = match board {
            Some(mut b) => {
                b.wait_joined(inner.cfg.timeout).map_err(|s| {
                    let what = ("the start-up's single-copy board".to_string(), 0);
                    s.error(what, inner.cfg.timeout, "map it", "rank 0's node board")
                })?;
                b.unlink();
                b
            }
            None => {
                let path = unfixed(&offers[0]);
                Board::attach(std::path::Path::new(&path), inner.size, inner.rank)?
            }
        };
        tracing::debug!(target: "ringzero::topology", rank = inner.rank,
            "all-gathers from {} B and below {} B read straight out of the other ranks' memory",
            inner.cfg.single_copy_from, inner.cfg.single_copy_below);
        let _ = inner.direct.set(HostDirect {
            board: board.host_paced(),
            rank: inner.rank,
            ranks: inner.size,
            pid: std::process::id(),
            sizes: inner.cfg.single_copy_from..inner.cfg.single_copy_below,
            off: AtomicBool::new(false),
            peer_maps: PeerMaps::new(inner.size),
            mapped: AtomicU64::new(0),
        });
        Ok(())
    }

    /// The node board for this communicator's ranks, all on one node: rank 0 creates it in
    /// `cfg.shm_dir` and shares its path, every rank maps it, rank 0 unlinks it once all have.
    /// Collective. A rank 0 that cannot create it tells the others, which fail too.
    pub(crate) fn node_board(&self, cfg: &Config) -> Result<Board> {
        let (rank, size) = (self.rank(), self.size());
        let mut board = if rank == 0 {
            let made = create_board(cfg, size);
            let path = made
                .as_ref()
                .map_or(String::new(), |b| b.path().to_string_lossy().into_owned());
            self.all_gather_bytes(&fixed::<128>(&path))?;
            made?
        } else {
            let paths = self.all_gather_bytes(&[0u8; 128])?;
            let path = unfixed(&paths[..128]);
            if path.is_empty() {
                return Err(Error::Protocol {
                    peer: "rank 0".into(),
                    detail: format!(
                        "rank 0 could not create the node board in {} (its own error says why)",
                        cfg.shm_dir.display()
                    ),
                });
            }
            Board::attach(std::path::Path::new(&path), size, rank)?
        };
        // Every rank has mapped it.
        self.all_gather_bytes(&[1u8])?;
        board.unlink();
        Ok(board)
    }
}

/// Rank 0's node board for `size` ranks in `cfg.shm_dir`, whose path fits the 128 bytes the
/// other ranks receive it in.
fn create_board(cfg: &Config, size: usize) -> Result<Board> {
    let name = crate::connect::segment_name(cfg, 0, 0, "board");
    let b = Board::create(&cfg.shm_dir, &name, size, 0)?;
    let path = b.path().to_string_lossy();
    if path.len() >= 128 {
        return Err(Error::config(
            "RINGZERO_SHM_DIR",
            format!("the shm path `{path}` is longer than 127 bytes; use a shorter directory"),
        ));
    }
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_reads_every_other_chunk_once_into_its_place() {
        for n in 1..7 {
            for count in [0, 1, 5, 6, 64, 1001] {
                for in_place in [false, true] {
                    for r in 0..n {
                        let ps = pulls(n, r, count, in_place);
                        let mut covered = vec![false; count];
                        covered[chunk(count, n, r)]
                            .iter_mut()
                            .for_each(|c| *c = true);
                        for p in &ps {
                            let c = chunk(count, n, p.from);
                            assert_ne!(p.from, r);
                            assert_eq!((p.dst_at, p.elems), (c.start, c.len()));
                            assert_eq!(p.src_at, if in_place { c.start } else { 0 });
                            for x in &mut covered[c] {
                                assert!(!*x, "read twice");
                                *x = true;
                            }
                        }
                        assert!(covered.iter().all(|&c| c), "n {n} r {r} count {count}");
                        if let Some(first) = ps.first().filter(|_| count >= n) {
                            assert_eq!(first.from, (r + 1) % n, "the next rank's first");
                        }
                    }
                }
            }
        }
    }
}
