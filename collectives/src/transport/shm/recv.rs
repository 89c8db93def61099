//! The receiving half of a shared-memory link: it creates the segment (slots and a control
//! block) and reads frames out of it.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use memmap2::MmapMut;

use super::{LinkError, LinkResult, RecvLink, TransportKind};
use crate::error::{Error, Result};
use crate::wire::{Expect, FrameHeader, HEADER_LEN};

use super::*;

/// The receiving end: owns (creates) the segment.
pub struct ShmRecv {
    seg: Segment,
    /// Frames released (the tail).
    next: u64,
    /// Frames consumed but not yet released (pipelined form only).
    held: u64,
    peer: usize,
    last_health: Instant,
}

impl ShmRecv {
    /// Create and map a segment for frames from rank `peer` in `dir`, reserving all its space.
    pub fn create(
        dir: &Path,
        name: &str,
        slots: usize,
        slot_bytes: usize,
        peer: usize,
    ) -> Result<ShmRecv> {
        let geo = Geometry {
            slots,
            slot_bytes: slot_bytes.next_multiple_of(64),
            data_in_file: true,
        };
        ShmRecv::create_with(dir, name, geo, peer)
    }

    /// Create the control block of a FIFO whose `slots` slots of `slot_bytes` live elsewhere
    /// (device memory): head, tail, slot headers and the abort flag, no data area.
    pub fn create_control(
        dir: &Path,
        name: &str,
        slots: usize,
        slot_bytes: usize,
        peer: usize,
    ) -> Result<ShmRecv> {
        let geo = Geometry {
            slots,
            slot_bytes: slot_bytes.next_multiple_of(64),
            data_in_file: false,
        };
        ShmRecv::create_with(dir, name, geo, peer)
    }

    fn create_with(dir: &Path, name: &str, geo: Geometry, peer: usize) -> Result<ShmRecv> {
        let (file, path) = create_segment(dir, name, geo.total())?;
        // SAFETY: the file was just created by us with O_EXCL and sized; it is shared only with
        // the peer process through the protocol described in the module docs, and every access
        // to memory the peer may write goes through atomics or happens after an acquire load
        // that orders it.
        let map =
            unsafe { MmapMut::map_mut(&file) }.map_err(|e| Error::io("mapping shm segment", e))?;
        let seg = Segment { map, geo, path };
        seg.atomic_u64(OFF_MAGIC).store(MAGIC, Ordering::Relaxed);
        seg.atomic_u32(OFF_VERSION)
            .store(VERSION, Ordering::Relaxed);
        seg.atomic_u32(OFF_SLOTS)
            .store(geo.slots as u32, Ordering::Relaxed);
        seg.atomic_u32(OFF_DATA_IN_FILE)
            .store(geo.data_in_file as u32, Ordering::Relaxed);
        seg.atomic_u64(OFF_SLOT_BYTES)
            .store(geo.slot_bytes as u64, Ordering::Relaxed);
        seg.atomic_u32(OFF_RECV_PID)
            .store(std::process::id(), Ordering::Release);
        Ok(ShmRecv {
            seg,
            next: 0,
            held: 0,
            peer,
            last_health: Instant::now(),
        })
    }

    /// The segment's path, the connect info the sender needs.
    pub fn path(&self) -> &Path {
        &self.seg.path
    }
}

impl Drop for ShmRecv {
    fn drop(&mut self) {
        // A sender still waiting for slots learns that none will be freed.
        self.seg
            .atomic_u32(OFF_RECV_CLOSED)
            .store(1, Ordering::Release);
        // Normally the sender unlinked it already.
        let _ = std::fs::remove_file(&self.seg.path);
    }
}

impl ShmRecv {
    /// Whether the sender is gone from this FIFO — it never attached, dropped its end, or its
    /// process has exited — waiting up to `wait` for it. A device-slot owner asks this before it
    /// frees memory the sender may still have mapped.
    pub fn sender_detached_within(&self, wait: Duration) -> bool {
        let deadline = crate::deadline::Deadline::after(Instant::now(), wait);
        loop {
            let pid = self.seg.atomic_u32(OFF_SEND_PID).load(Ordering::Acquire);
            if pid == 0
                || self
                    .seg
                    .atomic_u32(OFF_SEND_DETACHED)
                    .load(Ordering::Acquire)
                    != 0
                || !pid_alive(pid)
            {
                return true;
            }
            if deadline.passed(Instant::now()) {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl ShmRecv {
    /// Slots per FIFO and bytes per slot.
    pub fn geometry(&self) -> (usize, usize) {
        (self.seg.geo.slots, self.seg.geo.slot_bytes)
    }

    /// Pipelined receive: the slot of the next frame not yet consumed, once it has arrived and
    /// its header matches `expect`. Frames consumed earlier may still be held (not released).
    pub fn peek_slot(&mut self, expect: &Expect) -> LinkResult<Option<usize>> {
        let k = self.next + self.held;
        let head = self.seg.atomic_u64(OFF_HEAD).load(Ordering::Acquire);
        if head <= k {
            if let Some(reason) = self.seg.aborted_by_peer(2) {
                return Err(LinkError::PeerAborted(reason));
            }
            return Ok(None);
        }
        let slot = (k % self.seg.geo.slots as u64) as usize;
        self.check_header(slot, expect)?;
        Ok(Some(slot))
    }

    /// Move past the frame [`ShmRecv::peek_slot`] returned; its slot stays held until
    /// [`ShmRecv::release_oldest`].
    pub fn consume(&mut self) {
        self.held += 1;
    }

    /// Give the oldest held slot back to the sender.
    pub fn release_oldest(&mut self) -> LinkResult<()> {
        if self.held == 0 {
            return Err(LinkError::Io("release without a held frame".into()));
        }
        self.held -= 1;
        RecvLink::release(self)
    }

    /// Host address of slot `slot`'s payload (segments with their data in the file).
    pub fn slot_addr(&self, slot: usize) -> Option<*mut u8> {
        (self.seg.geo.data_in_file && slot < self.seg.geo.slots).then(|| self.seg.slot_ptr(slot))
    }

    /// The mapped segment (address and length), for registration with a device.
    pub fn mapping(&self) -> (*mut u8, usize) {
        (self.seg.map.as_ptr() as *mut u8, self.seg.map.len())
    }

    fn check_header(&self, slot: usize, expect: &Expect) -> LinkResult<()> {
        let mut bytes = [0u8; HEADER_LEN];
        // SAFETY: callers saw head > this frame's index with an acquire load, which orders the
        // sender's writes of the slot header before this read; the sender will not touch the slot
        // until it is released.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.seg.slot_header_ptr(slot),
                bytes.as_mut_ptr(),
                HEADER_LEN,
            )
        };
        let h = FrameHeader::decode(&bytes)?;
        if h.is_abort() {
            return Err(LinkError::PeerAborted("abort frame".into()));
        }
        h.check(expect)?;
        if expect.len > self.seg.geo.slot_bytes {
            return Err(LinkError::Protocol(format!(
                "frame of {} bytes exceeds the slot",
                expect.len
            )));
        }
        Ok(())
    }
}

impl RecvLink for ShmRecv {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn peek(&mut self, expect: &Expect) -> LinkResult<Option<&[u8]>> {
        if !self.seg.geo.data_in_file {
            return Err(LinkError::Io(
                "a control block has no host slots (its data lives on the device)".into(),
            ));
        }
        let slot = (self.next % self.seg.geo.slots as u64) as usize;
        // Acquire: the sender's writes of this frame (header and payload) happened before its
        // release store of the stamp. An older frame's stamp in this slot is smaller.
        if self.seg.slot_stamp(slot).load(Ordering::Acquire) <= self.next {
            if let Some(reason) = self.seg.aborted_by_peer(2) {
                return Err(LinkError::PeerAborted(reason));
            }
            return Ok(None);
        }
        self.check_header(slot, expect)?;
        // SAFETY: the acquire load of the stamp > next orders the sender's writes of this slot's
        // payload before our reads; the sender will not touch the slot until we release it; the
        // length was checked against the slot size.
        Ok(Some(unsafe {
            std::slice::from_raw_parts(self.seg.slot_ptr(slot), expect.len)
        }))
    }

    fn release(&mut self) -> LinkResult<()> {
        self.next += 1;
        self.seg
            .atomic_u64(OFF_TAIL)
            .store(self.next, Ordering::Release);
        Ok(())
    }

    fn health(&mut self) -> LinkResult<()> {
        check_health(&self.seg, 2, OFF_SEND_PID, self.peer, &mut self.last_health)?;
        let detached = self
            .seg
            .atomic_u32(OFF_SEND_DETACHED)
            .load(Ordering::Acquire)
            != 0;
        if detached && self.seg.geo.data_in_file {
            // Frames it published before it left are still good: lost once they are read.
            let head = self.seg.atomic_u64(OFF_HEAD).load(Ordering::Acquire);
            if head <= self.next + self.held {
                return Err(closed_by(self.peer));
            }
        }
        Ok(())
    }

    fn abort(&mut self, reason: &str) {
        self.seg.abort(2, reason);
    }
}
