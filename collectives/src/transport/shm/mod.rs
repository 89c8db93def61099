//! Shared-memory transport: the receiver's FIFO of slots lives in a file under `/dev/shm`.
//!
//! Layout of the file (offsets in bytes):
//! ```text
//! 0     control block: magic, version, slots, slot_bytes, receiver pid, sender pid,
//!       sender-detached flag, receiver-closed flag, abort flag + reason (512 bytes)
//! 1024  head: frames the sender has published          (own cache line; written by the sender)
//! 1088  tail: frames the receiver has released          (own cache line; written by the receiver)
//! 4096  slot headers, 64 bytes each: a FrameHeader (48), then the slot's stamp (u64)
//! data  slots × slot_bytes, page-aligned
//! ```
//! Frame `k` lives in slot `k % slots`. The sender may write frame `head` once
//! `head − tail < slots`, then publishes it with release stores of `k + 1` into the slot's stamp
//! and into `head`; the receiver reads it after an acquire load sees the stamp `> k` (the
//! pipelined form: `head > k`), and gives the slot back with a release store of `tail = k + 1`.
//! A waiting receiver polls the stamp, in the line of the header it reads next, and a sender
//! reads `tail` again only when the value it saw last leaves no free slot: a frame moves two
//! shared cache lines fewer between the cores than with both ends polling `head` and `tail`
//! (a 4 KiB all-gather of 2 ranks ~10 % faster, `docs/bench.md`). Space is reserved up front
//! with `fallocate`, so a too-small `/dev/shm` fails at setup with a clear error instead of a
//! SIGBUS mid-collective. The receiver creates the file; the
//! sender unlinks it as soon as it has mapped it (both ends attached); the receiver unlinks it on
//! drop in case the sender never came.
//!
//! The same file without its data area is the *control block* of the `cuda_ipc` transport, whose
//! slots live in device memory ([`ShmRecv::create_control`], [`ShmSend::attach_control`]). The
//! device ring engine keeps several frames in flight (a frame is published only when the copy or
//! kernel writing it has completed, a slot is released only when the kernel reading it has), so
//! both ends also offer a pipelined form of the protocol on slot indices:
//! [`ShmSend::reserve_slot`]/[`ShmSend::post_slot`] and
//! [`ShmRecv::peek_slot`]/[`ShmRecv::consume`]/[`ShmRecv::release_oldest`].
//!
//! The sender sets the *detached* flag when its end is dropped (after whatever it mapped of the
//! receiver's slots is unmapped): the `cuda_ipc` receiver must not free device memory another
//! process still has open through IPC, so it waits for that flag, briefly, before it does
//! ([`ShmRecv::sender_detached_within`]).
//!
//! A dead peer is noticed by [`SendLink::health`]/[`RecvLink::health`]: the abort flag, and the
//! peer's pid checked with `kill(pid, 0)` plus its `/proc` state (a zombie is dead). So is a
//! peer that closed its end while its process lives on (a rank that dropped its communicator
//! and went on, or one of the threads of one process): the receiver sets the *closed* flag when
//! its end is dropped, the sender the detached flag, and a host FIFO whose peer end is gone is
//! lost once nothing it published is left unread.

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use memmap2::MmapMut;

mod recv;
pub mod segments;
mod send;

pub use recv::ShmRecv;
pub use send::ShmSend;

use super::{LinkError, LinkResult, RecvLink, SendLink, TransportKind};
use crate::error::{Error, Result};
use crate::wire::{HEADER_LEN, MAX_ABORT_REASON};

const MAGIC: u64 = u64::from_le_bytes(*b"RZSHM001");
/// The segment's layout and protocol; 2: each slot's stamp is what a receiver polls.
const VERSION: u32 = 2;
const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_SLOTS: usize = 12;
const OFF_SLOT_BYTES: usize = 16;
const OFF_RECV_PID: usize = 24;
const OFF_SEND_PID: usize = 28;
const OFF_ABORT: usize = 32;
const OFF_REASON_LEN: usize = 36;
const OFF_DATA_IN_FILE: usize = 40;
const OFF_SEND_DETACHED: usize = 44;
const OFF_RECV_CLOSED: usize = 48;
const OFF_REASON: usize = 64;
const REASON_CAP: usize = 512;
const OFF_HEAD: usize = 1024;
const OFF_TAIL: usize = 1088;
const OFF_SLOT_HEADERS: usize = 4096;
const SLOT_HEADER_STRIDE: usize = 64;
const PAGE: usize = 4096;
const HEALTH_EVERY: Duration = Duration::from_millis(50);

/// Geometry of one segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Geometry {
    slots: usize,
    slot_bytes: usize,
    /// Whether the slots' bytes are in the file (shm) or elsewhere (cuda_ipc's device memory).
    data_in_file: bool,
}

impl Geometry {
    fn data_offset(&self) -> usize {
        OFF_SLOT_HEADERS + (self.slots * SLOT_HEADER_STRIDE).next_multiple_of(PAGE)
    }
    fn total(&self) -> usize {
        if self.data_in_file {
            self.data_offset() + self.slots * self.slot_bytes
        } else {
            self.data_offset()
        }
    }
}

/// A mapped segment and typed access to its control block.
struct Segment {
    map: MmapMut,
    geo: Geometry,
    path: PathBuf,
}

impl Segment {
    fn atomic_u64(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off.is_multiple_of(8) && off + 8 <= OFF_SLOT_HEADERS);
        // SAFETY: the mapping is page-aligned and at least OFF_SLOT_HEADERS long, `off` is a fixed
        // 8-aligned offset inside the control block, and both processes only ever touch these 8
        // bytes through atomics. The reference cannot outlive `self.map`.
        unsafe { &*(self.map.as_ptr().add(off) as *const AtomicU64) }
    }

    fn atomic_u32(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off.is_multiple_of(4) && off + 4 <= OFF_SLOT_HEADERS);
        // SAFETY: as for `atomic_u64`, with 4-byte alignment.
        unsafe { &*(self.map.as_ptr().add(off) as *const AtomicU32) }
    }

    fn slot_header_ptr(&self, slot: usize) -> *mut u8 {
        debug_assert!(slot < self.geo.slots);
        // SAFETY (of the pointer arithmetic): slot < slots, so the header lies inside the mapping.
        unsafe {
            self.map
                .as_ptr()
                .add(OFF_SLOT_HEADERS + slot * SLOT_HEADER_STRIDE) as *mut u8
        }
    }

    /// Slot `slot`'s stamp: frame `k`'s index + 1 once the sender has written that frame there
    /// (its header and payload), in the header's cache line past the header, so a receiver
    /// waiting for the frame polls the line it reads next anyway.
    fn slot_stamp(&self, slot: usize) -> &AtomicU64 {
        const _: () = assert!(HEADER_LEN + 8 <= SLOT_HEADER_STRIDE);
        // SAFETY: the stamp lies in slot `slot`'s header stride (slot < slots, checked in
        // slot_header_ptr), past the header's bytes, 8-aligned (the stride and the headers'
        // offset are multiples of 64, HEADER_LEN of 8); both processes touch these 8 bytes only
        // through atomics. The reference cannot outlive `self.map`.
        unsafe { &*(self.slot_header_ptr(slot).add(HEADER_LEN) as *const AtomicU64) }
    }

    fn slot_ptr(&self, slot: usize) -> *mut u8 {
        debug_assert!(slot < self.geo.slots && self.geo.data_in_file);
        // SAFETY (of the pointer arithmetic): slot < slots, so the slot lies inside the mapping.
        unsafe {
            self.map
                .as_ptr()
                .add(self.geo.data_offset() + slot * self.geo.slot_bytes) as *mut u8
        }
    }

    /// Set the abort flag (first writer wins) with `reason`; `who` is 1 for the sender, 2 for the
    /// receiver.
    fn abort(&self, who: u32, reason: &str) {
        if self.atomic_u32(OFF_ABORT).load(Ordering::Acquire) != 0 {
            return;
        }
        let r = &reason.as_bytes()[..reason.len().min(REASON_CAP)];
        // SAFETY: the reason area is a fixed region of the control block, written only here, before
        // the release store that publishes it; readers read it only after seeing the flag.
        unsafe {
            std::ptr::copy_nonoverlapping(
                r.as_ptr(),
                self.map.as_ptr().add(OFF_REASON) as *mut u8,
                r.len(),
            )
        };
        self.atomic_u32(OFF_REASON_LEN)
            .store(r.len() as u32, Ordering::Relaxed);
        let _ = self.atomic_u32(OFF_ABORT).compare_exchange(
            0,
            who,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    fn aborted_by_peer(&self, me: u32) -> Option<String> {
        let flag = self.atomic_u32(OFF_ABORT).load(Ordering::Acquire);
        if flag == 0 || flag == me {
            return None;
        }
        let len =
            (self.atomic_u32(OFF_REASON_LEN).load(Ordering::Relaxed) as usize).min(REASON_CAP);
        let reason = String::from_utf8_lossy(&self.map[OFF_REASON..OFF_REASON + len]).into_owned();
        Some(reason)
    }
}

/// Whether process `pid` is alive (not gone, not a zombie).
pub(crate) fn pid_alive(pid: u32) -> bool {
    if pid == 0 || pid == std::process::id() {
        return true;
    }
    let Some(p) = rustix::process::Pid::from_raw(pid as i32) else {
        return true;
    };
    match rustix::process::test_kill_process(p) {
        Err(rustix::io::Errno::SRCH) => false,
        _ => match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            // The state follows the parenthesised command name.
            Ok(stat) => {
                !matches!(stat.rsplit(')').next().map(str::trim_start), Some(s) if s.starts_with('Z') || s.starts_with('X'))
            }
            Err(_) => true,
        },
    }
}

/// Create `dir/name` (mode 0600, failing if it exists) with `total` bytes reserved up front, so
/// a too-small `/dev/shm` fails here with a clear error instead of a SIGBUS later. On error the
/// file is gone. The first creation in `dir` sweeps it ([`segments`]).
pub(crate) fn create_segment(
    dir: &Path,
    name: &str,
    total: usize,
) -> Result<(std::fs::File, PathBuf)> {
    segments::sweep_once(dir);
    let path = dir.join(name);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| Error::io(format!("creating shm segment {}", path.display()), e))?;
    match rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, total as u64) {
        Ok(()) => {}
        Err(rustix::io::Errno::OPNOTSUPP) => {
            if let Err(e) = file.set_len(total as u64) {
                let _ = std::fs::remove_file(&path);
                return Err(Error::io("sizing shm segment", e));
            }
        }
        Err(e) => {
            let _ = std::fs::remove_file(&path);
            let free = rustix::fs::statvfs(dir)
                .map(|s| s.f_bavail * s.f_frsize)
                .unwrap_or(0);
            return Err(Error::Io {
                    context: format!("reserving {total} bytes for shm segment {}", path.display()),
                    detail: format!(
                        "{e} ({} has {free} bytes free; a container's default /dev/shm is often 64 MB: raise it \
                         (docker --shm-size), lower RINGZERO_SLICE_BYTES/RINGZERO_SLOTS, or set RINGZERO_SHM_DISABLE=1)",
                        dir.display()
                    ),
                });
        }
    }
    Ok((file, path))
}

/// The peer closed its end of a host FIFO while its process lives on: nothing more will come
/// through (or be taken from) it. (Device control blocks keep the pid check only: their frames
/// are tracked by the device engine's own counters.)
fn closed_by(peer: usize) -> LinkError {
    LinkError::Lost(format!(
        "rank {peer} closed its end of the link (its communicator was dropped)"
    ))
}

fn check_health(
    seg: &Segment,
    me: u32,
    pid_off: usize,
    peer: usize,
    last: &mut Instant,
) -> LinkResult<()> {
    if let Some(reason) = seg.aborted_by_peer(me) {
        return Err(LinkError::PeerAborted(reason));
    }
    if last.elapsed() >= HEALTH_EVERY {
        *last = Instant::now();
        let pid = seg.atomic_u32(pid_off).load(Ordering::Acquire);
        if !pid_alive(pid) {
            return Err(LinkError::Lost(format!(
                "rank {peer}'s process (pid {pid}) has exited"
            )));
        }
    }
    Ok(())
}

const _: () = assert!(MAX_ABORT_REASON >= REASON_CAP);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::Collective;
    use crate::wire::{Expect, Fingerprint, FrameHeader};

    #[test]
    fn a_missing_segment_names_both_causes_and_the_peer() {
        let path = std::env::temp_dir().join(format!("ringzero-absent-{}", std::process::id()));
        let e = ShmSend::attach(&path, 2, 64, 3)
            .err()
            .expect("no such file")
            .to_string();
        assert!(
            e.contains("opening rank 3's shm segment")
                && e.contains("rank 3 made it and has removed it")
                && e.contains("must share /dev/shm"),
            "{e}"
        );
    }

    fn fp() -> Fingerprint {
        Fingerprint::new(
            Collective::AllGather,
            Some(ringzero_kernels::DType::U8),
            None,
            10,
        )
    }

    /// A fresh segment name under the temporary directory.
    fn fresh() -> (std::path::PathBuf, String) {
        let name = format!(
            "ringzero-test-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        );
        (std::env::temp_dir(), name)
    }

    /// What the receiver expects of step `step`'s 10-byte frame of call 0.
    fn expect(step: u32) -> Expect {
        Expect {
            seq: 0,
            step,
            slice: 0,
            fp: fp(),
            len: 10,
        }
    }

    #[test]
    fn frames_flow_with_credits_and_the_file_is_unlinked() {
        let (dir, name) = fresh();
        let mut rx = ShmRecv::create(&dir, &name, 2, 100, 0).unwrap();
        let mut tx = ShmSend::attach(rx.path(), 2, 100, 1).unwrap();
        assert!(!dir.join(&name).exists(), "sender unlinks once attached");
        for k in 0..2u32 {
            let s = tx.reserve(10).unwrap().unwrap();
            s.fill(k as u8 + 1);
            tx.post(&FrameHeader::data(0, k, 0, fp(), 10)).unwrap();
        }
        assert!(
            tx.reserve(10).unwrap().is_none(),
            "no credit left with 2 slots"
        );
        assert_eq!(rx.peek(&expect(0)).unwrap().unwrap(), &[1u8; 10]);
        rx.release().unwrap();
        assert!(tx.reserve(10).unwrap().is_some(), "credit returned");
        // A frame of another call is a mismatch naming it.
        let err = rx
            .peek(&Expect {
                fp: Fingerprint::new(Collective::AllReduce, None, None, 10),
                ..expect(1)
            })
            .unwrap_err();
        assert!(
            matches!(err, LinkError::Mismatch { ref theirs } if theirs.starts_with("all_gather")),
            "{err:?}"
        );
        tx.abort("boom");
        assert_eq!(
            rx.health().unwrap_err(),
            LinkError::PeerAborted("boom".into())
        );
    }

    #[test]
    fn a_slot_holds_no_frame_until_its_own_is_posted_however_often_it_was_used() {
        let (dir, name) = fresh();
        let mut rx = ShmRecv::create(&dir, &name, 2, 100, 0).unwrap();
        let mut tx = ShmSend::attach(rx.path(), 2, 100, 1).unwrap();
        // Round the two slots several times: a slot's stamp from its last frame is not this one.
        for k in 0..7u32 {
            assert!(
                rx.peek(&expect(k)).unwrap().is_none(),
                "frame {k} before it is posted"
            );
            tx.reserve(10).unwrap().unwrap().fill(k as u8);
            tx.post(&FrameHeader::data(0, k, 0, fp(), 10)).unwrap();
            assert_eq!(rx.peek(&expect(k)).unwrap().unwrap(), &[k as u8; 10]);
            rx.release().unwrap();
        }
    }

    #[test]
    fn a_segment_from_another_build_is_refused_naming_both_versions() {
        use std::io::{Seek, Write};
        let (dir, name) = fresh();
        let rx = ShmRecv::create(&dir, &name, 2, 100, 0).unwrap();
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(rx.path())
            .unwrap();
        f.seek(std::io::SeekFrom::Start(OFF_VERSION as u64))
            .unwrap();
        f.write_all(&1u32.to_le_bytes()).unwrap();
        let e = ShmSend::attach(rx.path(), 2, 100, 1)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("layout version 1, this build speaks 2")
                && e.contains("same ringzero build")
                && e.contains("from rank 1"),
            "{e}"
        );
    }

    #[test]
    fn pipelined_frames_keep_several_in_flight_within_the_credits() {
        let (dir, name) = fresh();
        let mut rx = ShmRecv::create_control(&dir, &name, 3, 100, 0).unwrap();
        // A data-path attach to a control block is refused: the layouts differ.
        let err = ShmSend::attach(rx.path(), 3, 100, 1)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("bytes, expected") || err.contains("another layout"),
            "{err}"
        );
        let mut tx = ShmSend::attach_control(rx.path(), 3, 100, 1).unwrap();
        assert_eq!(tx.slot_addr(0), None, "control blocks have no host slots");
        assert!(tx.reserve(10).is_err(), "plain sends need host slots");
        let slots: Vec<usize> = (0..3)
            .map(|_| tx.reserve_slot().unwrap().unwrap())
            .collect();
        assert_eq!(slots, [0, 1, 2]);
        assert_eq!(
            tx.reserve_slot().unwrap(),
            None,
            "three credits, three reserved"
        );
        let e = |step| Expect {
            seq: 0,
            step,
            slice: 0,
            fp: fp(),
            len: 10,
        };
        assert_eq!(rx.peek_slot(&e(0)).unwrap(), None, "nothing posted yet");
        tx.post_slot(&FrameHeader::data(0, 0, 0, fp(), 10)).unwrap();
        tx.post_slot(&FrameHeader::data(0, 1, 0, fp(), 10)).unwrap();
        assert_eq!(rx.peek_slot(&e(0)).unwrap(), Some(0));
        assert_eq!(
            rx.peek_slot(&e(0)).unwrap(),
            Some(0),
            "same frame until consumed"
        );
        rx.consume();
        assert_eq!(
            rx.peek_slot(&e(1)).unwrap(),
            Some(1),
            "the next frame while 0 is held"
        );
        rx.consume();
        assert_eq!(
            rx.peek_slot(&e(2)).unwrap(),
            None,
            "frame 2 reserved, not posted"
        );
        assert_eq!(
            tx.reserve_slot().unwrap(),
            None,
            "held slots give no credit"
        );
        rx.release_oldest().unwrap();
        assert_eq!(
            tx.reserve_slot().unwrap(),
            Some(0),
            "slot 0 again after its release"
        );
        tx.post_slot(&FrameHeader::data(0, 2, 0, fp(), 10)).unwrap();
        tx.post_slot(&FrameHeader::data(0, 3, 0, fp(), 10)).unwrap();
        assert!(tx.post_slot(&FrameHeader::data(0, 4, 0, fp(), 10)).is_err());
        assert_eq!(rx.peek_slot(&e(2)).unwrap(), Some(2));
        rx.consume();
        assert_eq!(rx.peek_slot(&e(3)).unwrap(), Some(0));
        rx.release_oldest().unwrap();
        rx.release_oldest().unwrap();
        assert!(
            rx.release_oldest().is_err(),
            "only consumed frames can be released"
        );
    }

    #[test]
    fn an_end_dropped_while_its_process_lives_is_lost_once_its_frames_are_read() {
        let dir = std::env::temp_dir();
        let name = |k: u32| {
            format!(
                "ringzero-test-{}-{k}-{}",
                std::process::id(),
                rand::random::<u32>()
            )
        };
        let e = Expect {
            seq: 0,
            step: 0,
            slice: 0,
            fp: fp(),
            len: 10,
        };
        // The sender posts a frame and drops its end: the frame is still read, then the link is
        // lost, naming the peer.
        let mut rx = ShmRecv::create(&dir, &name(1), 2, 100, 3).unwrap();
        let mut tx = ShmSend::attach(rx.path(), 2, 100, 1).unwrap();
        tx.reserve(10).unwrap().unwrap().fill(7);
        tx.post(&FrameHeader::data(0, 0, 0, fp(), 10)).unwrap();
        assert!(rx.health().is_ok());
        drop(tx);
        assert!(rx.health().is_ok(), "a frame is left to read");
        assert_eq!(rx.peek(&e).unwrap().unwrap(), &[7u8; 10]);
        rx.release().unwrap();
        let err = rx.health().unwrap_err();
        assert!(
            matches!(&err, LinkError::Lost(d) if d.contains("rank 3 closed its end")),
            "{err:?}"
        );
        // The receiver drops its end: a sender is lost at once.
        let rx = ShmRecv::create(&dir, &name(2), 2, 100, 0).unwrap();
        let mut tx = ShmSend::attach(rx.path(), 2, 100, 5).unwrap();
        assert!(tx.health().is_ok());
        drop(rx);
        let err = tx.health().unwrap_err();
        assert!(
            matches!(&err, LinkError::Lost(d) if d.contains("rank 5 closed its end")),
            "{err:?}"
        );
    }

    #[test]
    fn zombie_and_missing_pids_are_dead() {
        assert!(pid_alive(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        std::thread::sleep(Duration::from_millis(200));
        assert!(
            !pid_alive(pid),
            "an exited, unreaped child is a zombie: dead"
        );
        child.wait().unwrap();
        assert!(!pid_alive(pid));
    }
}
