//! The start-up probe of every device edge: the sender writes a pattern (never zeros) into the
//! receiver's slot and posts it; the receiver checks every byte within a deadline. A failed
//! cuda_ipc edge is rebuilt as host staging (see [`super::setup`]).

use std::time::{Duration, Instant};

use super::core::{dev_err, Core};
use super::records::{text, FINDING_BYTES};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::ring::device_engine::DevLinks;
use crate::ring::Collective;
use crate::transport::wait::Waiter;
use crate::wire::{Expect, Fingerprint, FrameHeader};
use ringzero_kernels::device::Stream;

/// How long a probe waits for its frame.
pub(super) const PROBE_DEADLINE: Duration = Duration::from_secs(5);
/// Bytes a probe moves (or the slot size, if smaller).
pub(super) const PROBE_BYTES: usize = 64 * 1024;

/// The byte at offset `i` of a probe from rank `from`: never zero, differs between neighbours.
pub fn probe_pattern(from: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            let x = (i as u64).wrapping_mul(0x9e37_79b9) ^ (from as u64).wrapping_mul(0x85eb_ca6b);
            ((x >> 7) as u8 % 251) + 1
        })
        .collect()
}

/// Compare what arrived with what was sent: `None` if equal, else the first difference.
pub fn judge_probe(expected: &[u8], seen: &[u8]) -> Option<String> {
    if seen.len() != expected.len() {
        return Some(format!(
            "{} bytes arrived, {} were sent",
            seen.len(),
            expected.len()
        ));
    }
    let bad = expected.iter().zip(seen).filter(|(a, b)| a != b).count();
    let first = expected.iter().zip(seen).position(|(a, b)| a != b)?;
    let show = |b: &[u8]| {
        b[first..(first + 8).min(b.len())]
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    Some(format!(
        "wrong data: {bad} of {} bytes differ, first at byte {first}: expected {} saw {}",
        expected.len(),
        show(expected),
        show(seen)
    ))
}

impl<S: Stream> Core<S> {
    /// Send a pattern to the next rank, check the one from the previous rank.
    pub(super) fn probe(&self, links: &mut DevLinks, round: u64) -> Result<Probe> {
        let len = PROBE_BYTES.min(links.tx.slot_bytes());
        let fp = Fingerprint::new(Collective::Barrier, None, None, len);
        let seq = u64::MAX - round;
        let what = "device probe";
        let deadline = PROBE_DEADLINE.min(self.cfg.timeout);
        let until = Deadline::after(Instant::now(), deadline);
        let slot = loop {
            if let Some(a) = links.tx.reserve().map_err(|e| {
                crate::ring::call::link_err(e, what, seq, links.next, self.rank, None)
            })? {
                break a;
            }
            if until.passed(Instant::now()) {
                return Err(Error::Timeout {
                    op: what.into(),
                    seq,
                    peer: links.next,
                    waiting: "a free slot for the probe".into(),
                    after: deadline,
                });
            }
            std::thread::yield_now();
        };
        // The pattern goes through the device queue like any slice (a copy from page-locked host
        // memory into the slot), so a peer write that never completes is seen here within the
        // deadline instead of hanging set-up in a synchronous copy.
        let mut src = memmap2::MmapMut::map_anon(len)
            .map_err(|e| Error::io("allocating the probe pattern", e))?;
        src.copy_from_slice(&probe_pattern(self.rank, len));
        let to = format!("copying the probe into rank {}'s slot", links.next);
        // SAFETY: an anonymous mapping is whole pages, so rounding `len` up to a page stays
        // inside it; `src` outlives the registration `keep` (both dropped below, or leaked
        // together if the copy never completes).
        let (src_dev, keep) = unsafe {
            self.stream
                .map_host(src.as_mut_ptr(), len.next_multiple_of(4096))
        }
        .map_err(dev_err(&to))?;
        // SAFETY: `slot` is a reserved slot of `slot_bytes ≥ len` bytes at the next rank, and
        // `src_dev` the `len` registered bytes of `src`, both live until the copy completes.
        unsafe { self.stream.copy(slot, src_dev, len) }.map_err(dev_err(&to))?;
        let copied = self.stream.mark().map_err(dev_err(&to))?;
        let (copy_until, mut wait) = (Deadline::after(Instant::now(), deadline), Waiter::backoff());
        while !self.stream.done(&copied).map_err(dev_err(&to))? {
            if copy_until.passed(Instant::now()) {
                // The copy may still write (and read `src`) whenever the device gets to it:
                // keep everything it touches.
                std::mem::forget((keep, src));
                return Ok(Probe::Stuck(format!(
                    "rank {}'s copy of its probe into rank {}'s slot did not complete within \
                     {:.1}s (a peer path that hangs: run `ringzero diag`; RINGZERO_P2P_DISABLE=1 \
                     avoids it)",
                    self.rank,
                    links.next,
                    deadline.as_secs_f64()
                )));
            }
            wait.idle(deadline);
        }
        drop((keep, src));
        links
            .tx
            .post(&FrameHeader::data(seq, 0, 0, fp, len))
            .map_err(|e| crate::ring::call::link_err(e, what, seq, links.next, self.rank, None))?;
        let expect = Expect {
            seq,
            step: 0,
            slice: 0,
            fp,
            len,
        };
        let until = Deadline::after(Instant::now(), deadline);
        let tx_err = |e, next| crate::ring::call::link_err(e, what, seq, next, self.rank, None);
        let incoming = loop {
            links.tx.progress().map_err(|e| tx_err(e, links.next))?;
            if let Some(a) = links.rx.peek(&expect).map_err(|e| {
                crate::ring::call::link_err(e, what, seq, links.prev, self.rank, None)
            })? {
                break a;
            }
            if until.passed(Instant::now()) {
                return Ok(Probe::Failed(format!(
                    "no probe frame from rank {} within {:.1}s",
                    links.prev,
                    deadline.as_secs_f64()
                )));
            }
            std::thread::yield_now();
        };
        let mut seen = vec![0u8; len];
        // SAFETY: `incoming` is the held slot of a frame of `len` bytes.
        unsafe { self.stream.read(&mut seen, incoming) }.map_err(|e| Error::Device {
            context: format!("reading rank {}'s probe", links.prev),
            source: e,
        })?;
        links.rx.consume();
        links
            .rx
            .release()
            .map_err(|e| crate::ring::call::link_err(e, what, seq, links.prev, self.rank, None))?;
        // Our own probe must have left (tcp) before the finding is all-gathered.
        while !links.tx.flushed() {
            links.tx.progress().map_err(|e| tx_err(e, links.next))?;
            if until.passed(Instant::now()) {
                return Err(Error::Timeout {
                    op: what.into(),
                    seq,
                    peer: links.next,
                    waiting: format!("rank {} to read the probe", links.next),
                    after: deadline,
                });
            }
            std::thread::yield_now();
        }
        Ok(match judge_probe(&probe_pattern(links.prev, len), &seen) {
            Some(f) => Probe::Failed(f),
            None => Probe::Passed,
        })
    }
}

/// What a rank's start-up probe found.
pub(super) enum Probe {
    /// Both directions passed.
    Passed,
    /// The receive edge delivered wrong data or nothing (the edge may be rebuilt).
    Failed(String),
    /// This rank's own probe copy never completed: its device queue is stuck behind it, so no
    /// edge can be rebuilt on it.
    Stuck(String),
}

impl Probe {
    /// Code and text, as all-gathered.
    pub(super) fn record(&self) -> [u8; FINDING_BYTES] {
        let mut rec = [0u8; FINDING_BYTES];
        let (code, t) = match self {
            Probe::Passed => return rec,
            Probe::Failed(t) => (1, t),
            Probe::Stuck(t) => (2, t),
        };
        rec[0] = code;
        let t: [u8; FINDING_BYTES - 1] = text(t);
        rec[1..].copy_from_slice(&t);
        rec
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_patterns_have_no_zero_and_differ_between_ranks() {
        let a = probe_pattern(0, 4096);
        let b = probe_pattern(1, 4096);
        assert!(a.iter().all(|&x| x != 0) && b.iter().all(|&x| x != 0));
        assert_ne!(a, b);
        assert_eq!(judge_probe(&a, &a), None);
    }

    #[test]
    fn a_wrong_probe_names_the_first_bad_byte_and_what_was_seen() {
        let a = probe_pattern(3, 64);
        let mut seen = a.clone();
        seen[10..14].fill(0);
        let f = judge_probe(&a, &seen).unwrap();
        assert!(f.starts_with("wrong data: "), "{f}");
        assert!(f.contains("first at byte 10"), "{f}");
        assert!(f.contains("saw 00 00 00 00"), "{f}");
        let zeros = vec![0u8; 64];
        assert!(judge_probe(&a, &zeros)
            .unwrap()
            .contains("64 of 64 bytes differ"));
        assert!(judge_probe(&a, &a[..10])
            .unwrap()
            .contains("10 bytes arrived"));
    }
}
