//! The sending half of a shared-memory link: it attaches to the receiver's segment and fills its
//! slots.

use std::fs::OpenOptions;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Instant;

use memmap2::MmapMut;

use super::{LinkError, LinkResult, SendLink, TransportKind};
use crate::error::{Error, Result};
use crate::wire::{FrameHeader, HEADER_LEN};

use super::*;

/// The sending end: attaches to the receiver's segment.
pub struct ShmSend {
    seg: Segment,
    head: u64,
    /// The receiver's tail as last read: slots below it are free for good, so the shared line
    /// (which the receiver writes at every release) is read again only when these run out.
    tail_seen: u64,
    reserved: Option<usize>,
    /// Slots reserved but not yet posted (pipelined form only).
    ahead: u64,
    peer: usize,
    last_health: Instant,
}

/// Why a sender could not open rank `peer`'s segment (the peer created it before telling the
/// sender its path). A missing file has two causes that look alike from here: the peer has
/// already dropped its communicator (it failed, or left), removing the file; or the two ranks
/// see different `/dev/shm`s though they share a node id.
fn attach_failure(e: &std::io::Error, peer: usize) -> String {
    let shared = "ranks that share a node id must share /dev/shm (different containers?); set \
                  RINGZERO_SHM_DISABLE=1 or distinct RINGZERO_NODE_ID values";
    if e.kind() == std::io::ErrorKind::NotFound {
        format!(
            "{e} — rank {peer} made it and has removed it: it has dropped its communicator \
             (look for its own error first), or {shared}"
        )
    } else {
        format!("{e} — {shared}")
    }
}

impl ShmSend {
    /// Map the segment rank `peer` created at `path`, check it, and unlink it.
    pub fn attach(path: &Path, slots: usize, slot_bytes: usize, peer: usize) -> Result<ShmSend> {
        let geo = Geometry {
            slots,
            slot_bytes: slot_bytes.next_multiple_of(64),
            data_in_file: true,
        };
        ShmSend::attach_with(path, geo, peer)
    }

    /// Attach to a control block made by [`ShmRecv::create_control`].
    pub fn attach_control(
        path: &Path,
        slots: usize,
        slot_bytes: usize,
        peer: usize,
    ) -> Result<ShmSend> {
        let geo = Geometry {
            slots,
            slot_bytes: slot_bytes.next_multiple_of(64),
            data_in_file: false,
        };
        ShmSend::attach_with(path, geo, peer)
    }

    fn attach_with(path: &Path, geo: Geometry, peer: usize) -> Result<ShmSend> {
        let (slots, slot_bytes) = (geo.slots, geo.slot_bytes);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| Error::Io {
                context: format!("opening rank {peer}'s shm segment {}", path.display()),
                detail: attach_failure(&e, peer),
            })?;
        let len = file
            .metadata()
            .map_err(|e| Error::io("shm segment size", e))?
            .len() as usize;
        if len < geo.total() {
            return Err(Error::Protocol {
                peer: format!("rank {peer}"),
                detail: format!(
                    "shm segment {} is {len} bytes, expected {}",
                    path.display(),
                    geo.total()
                ),
            });
        }
        // SAFETY: see `ShmRecv::create`; the size was checked above.
        let map =
            unsafe { MmapMut::map_mut(&file) }.map_err(|e| Error::io("mapping shm segment", e))?;
        let seg = Segment {
            map,
            geo,
            path: path.to_path_buf(),
        };
        let version = seg.atomic_u32(OFF_VERSION).load(Ordering::Relaxed);
        if seg.atomic_u64(OFF_MAGIC).load(Ordering::Acquire) == MAGIC && version != VERSION {
            return Err(Error::Protocol {
                peer: format!("rank {peer}"),
                detail: format!(
                    "shm segment {} has layout version {version}, this build speaks {VERSION}: \
                     run every rank from the same ringzero build",
                    path.display()
                ),
            });
        }
        let ok = seg.atomic_u64(OFF_MAGIC).load(Ordering::Acquire) == MAGIC
            && version == VERSION
            && seg.atomic_u32(OFF_SLOTS).load(Ordering::Relaxed) as usize == slots
            && seg.atomic_u64(OFF_SLOT_BYTES).load(Ordering::Relaxed) as usize == slot_bytes
            && seg.atomic_u32(OFF_DATA_IN_FILE).load(Ordering::Relaxed) == geo.data_in_file as u32;
        if !ok {
            return Err(Error::Protocol {
                peer: format!("rank {peer}"),
                detail: format!(
                    "shm segment {} has another layout (do the ranks use the same RINGZERO_SLOTS and \
                     RINGZERO_SLICE_BYTES?)",
                    path.display()
                ),
            });
        }
        seg.atomic_u32(OFF_SEND_PID)
            .store(std::process::id(), Ordering::Release);
        let _ = std::fs::remove_file(path);
        Ok(ShmSend {
            seg,
            head: 0,
            tail_seen: 0,
            reserved: None,
            ahead: 0,
            peer,
            last_health: Instant::now(),
        })
    }
}

impl Drop for ShmSend {
    fn drop(&mut self) {
        // Owners of device mappings of the receiver's slots are dropped before this (see
        // `FifoSend`), so the receiver may now free them.
        self.seg
            .atomic_u32(OFF_SEND_DETACHED)
            .store(1, Ordering::Release);
    }
}

impl ShmSend {
    /// Whether frame `k`'s slot is free: the receiver has released frame `k − slots`. The tail
    /// is read from the shared line only when the value seen last does not say so already.
    fn free_slot(&mut self, k: u64) -> bool {
        let slots = self.seg.geo.slots as u64;
        if k - self.tail_seen >= slots {
            // Acquire: the receiver's reads of every frame below the tail happened before its
            // release store of it, so those slots may be written now.
            self.tail_seen = self.seg.atomic_u64(OFF_TAIL).load(Ordering::Acquire);
        }
        k - self.tail_seen < slots
    }

    /// Slots per FIFO and bytes per slot.
    pub fn geometry(&self) -> (usize, usize) {
        (self.seg.geo.slots, self.seg.geo.slot_bytes)
    }

    /// Pipelined send, step 1: the index of the next slot, once it is free, reserved for a frame
    /// that [`ShmSend::post_slot`] publishes later. Several may be reserved at once (up to the
    /// credits); they are posted in the order reserved.
    pub fn reserve_slot(&mut self) -> LinkResult<Option<usize>> {
        debug_assert!(self.reserved.is_none(), "pipelined and plain sends mixed");
        if !self.free_slot(self.head + self.ahead) {
            if let Some(reason) = self.seg.aborted_by_peer(1) {
                return Err(LinkError::PeerAborted(reason));
            }
            return Ok(None);
        }
        let slot = ((self.head + self.ahead) % self.seg.geo.slots as u64) as usize;
        self.ahead += 1;
        Ok(Some(slot))
    }

    /// Pipelined send, step 2: publish the oldest reserved slot with `header` (its bytes must be
    /// complete: for device slots, the copy or kernel that wrote them has finished).
    pub fn post_slot(&mut self, header: &FrameHeader) -> LinkResult<()> {
        if self.ahead == 0 {
            return Err(LinkError::Io("post_slot without reserve_slot".into()));
        }
        self.ahead -= 1;
        self.reserved = Some(header.len as usize);
        SendLink::post(self, header)
    }

    /// Host address of slot `slot`'s payload (segments with their data in the file).
    pub fn slot_addr(&self, slot: usize) -> Option<*mut u8> {
        (self.seg.geo.data_in_file && slot < self.seg.geo.slots).then(|| self.seg.slot_ptr(slot))
    }

    /// The mapped segment (address and length), for registration with a device.
    pub fn mapping(&self) -> (*mut u8, usize) {
        (self.seg.map.as_ptr() as *mut u8, self.seg.map.len())
    }
}

impl SendLink for ShmSend {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn slot_bytes(&self) -> usize {
        self.seg.geo.slot_bytes
    }

    fn reserve(&mut self, len: usize) -> LinkResult<Option<&mut [u8]>> {
        if !self.seg.geo.data_in_file {
            return Err(LinkError::Io(
                "a control block has no host slots (its data lives on the device)".into(),
            ));
        }
        if len > self.seg.geo.slot_bytes {
            return Err(LinkError::Io(format!(
                "frame of {len} bytes exceeds the {}-byte slot",
                self.seg.geo.slot_bytes
            )));
        }
        if !self.free_slot(self.head) {
            if let Some(reason) = self.seg.aborted_by_peer(1) {
                return Err(LinkError::PeerAborted(reason));
            }
            return Ok(None);
        }
        self.reserved = Some(len);
        let slot = (self.head % self.seg.geo.slots as u64) as usize;
        // SAFETY: slot `head % slots` is free (head − tail < slots: the receiver released it and
        // will not read it again until we publish head + 1), lies inside the mapping, and only this
        // sender writes it. The borrow of `self` keeps the mapping alive for the slice's lifetime.
        Ok(Some(unsafe {
            std::slice::from_raw_parts_mut(self.seg.slot_ptr(slot), len)
        }))
    }

    fn post(&mut self, header: &FrameHeader) -> LinkResult<()> {
        let len = self
            .reserved
            .take()
            .ok_or_else(|| LinkError::Io("post without reserve".into()))?;
        debug_assert_eq!(header.len as usize, len);
        let slot = (self.head % self.seg.geo.slots as u64) as usize;
        let bytes: [u8; HEADER_LEN] = bytemuck::cast(*header);
        // SAFETY: the slot header belongs to the free slot reserved above (same reasoning).
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.seg.slot_header_ptr(slot),
                HEADER_LEN,
            )
        };
        self.head += 1;
        // Release: the header and payload written above are seen by a receiver that sees the
        // stamp (it polls the stamp) or the head (the pipelined form and the health checks).
        self.seg
            .slot_stamp(slot)
            .store(self.head, Ordering::Release);
        self.seg
            .atomic_u64(OFF_HEAD)
            .store(self.head, Ordering::Release);
        Ok(())
    }

    fn progress(&mut self) -> LinkResult<bool> {
        Ok(false)
    }

    fn flushed(&self) -> bool {
        true
    }

    fn health(&mut self) -> LinkResult<()> {
        check_health(&self.seg, 1, OFF_RECV_PID, self.peer, &mut self.last_health)?;
        let closed = self.seg.atomic_u32(OFF_RECV_CLOSED).load(Ordering::Acquire) != 0;
        if closed && self.seg.geo.data_in_file {
            return Err(closed_by(self.peer));
        }
        Ok(())
    }

    fn abort(&mut self, reason: &str) {
        self.seg.abort(1, reason);
    }
}
