//! The sending half of a tcp link: frames striped over the edge's connections, written from
//! the slots as the sockets take them.

use std::collections::VecDeque;
use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::TcpStream;

use super::{LinkError, LinkResult, SendLink, TransportKind};
use crate::error::Result;
use crate::wire::{FrameHeader, HEADER_LEN, MAX_ABORT_REASON};

use super::*;

/// One part of a frame queued on a connection: the header goes first on wire 0.
struct Piece {
    header: Option<[u8; HEADER_LEN]>,
    slot: usize,
    /// The part's bytes within the slot.
    at: usize,
    len: usize,
    written: usize,
}

/// One of a sending edge's connections: the parts queued for it, and what the peer sent back.
pub(super) struct SendWire {
    pub(super) s: mio::net::TcpStream,
    queue: VecDeque<Piece>,
    /// Bytes read back from the peer: the only thing a receiver ever sends is an abort frame.
    back: Vec<u8>,
}

/// Sending half over TCP: one or more connections ("wires"); each frame's payload is striped over
/// them (see [`parts`]), so a single frame in flight keeps every connection busy.
pub struct TcpSend {
    pub(super) wires: Vec<SendWire>,
    peer: usize,
    addr: String,
    slot_bytes: usize,
    /// `slots` slots of `slot_bytes`, each starting a multiple of [`STRIDE_ALIGN`] after the
    /// last.
    staging: Aligned,
    /// Slots neither reserved nor waiting to be written. The parts of a frame leave on different
    /// connections at their own pace, so slots come free in any order: a set, not a ring.
    free: Vec<usize>,
    /// Parts of each slot's frame not yet written.
    unwritten: Vec<usize>,
    /// The host engine's one reservation: slot and length.
    pub(super) reserved: Option<(usize, usize)>,
    /// The device engine's reservations, oldest first (pipelined: filled by queued device work,
    /// posted in order once that work has completed).
    reserved_slots: VecDeque<usize>,
}

impl TcpSend {
    /// Wrap an authenticated connection to rank `peer`.
    pub fn new(s: TcpStream, peer: usize, slots: usize, slot_bytes: usize) -> Result<TcpSend> {
        TcpSend::over(vec![s], peer, slots, slot_bytes)
    }

    /// Wrap the connections of one edge to rank `peer`, in the order the receiver reads them
    /// (see [`connect_wires`]).
    pub fn over(
        streams: Vec<TcpStream>,
        peer: usize,
        slots: usize,
        slot_bytes: usize,
    ) -> Result<TcpSend> {
        let addr = peer_address(&streams)?;
        let wires = streams
            .into_iter()
            .map(|s| {
                Ok(SendWire {
                    s: into_mio(s)?,
                    queue: VecDeque::new(),
                    back: Vec::new(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let slots = slots.max(1);
        Ok(TcpSend {
            wires,
            peer,
            addr,
            slot_bytes,
            staging: Aligned::new(slots * stride(slot_bytes))?,
            free: (0..slots).rev().collect(),
            unwritten: vec![0; slots],
            reserved: None,
            reserved_slots: VecDeque::new(),
        })
    }

    /// The connections this edge uses.
    pub fn wires(&self) -> usize {
        self.wires.len()
    }

    /// The staging memory (page-aligned; slot `i` at `i × stride`) and the stride: for a device
    /// to register.
    pub fn staging(&mut self) -> (*mut u8, usize, usize) {
        (
            self.staging.map.as_mut_ptr(),
            self.staging.map.len(),
            stride(self.slot_bytes),
        )
    }

    /// Reserve a free slot without its length (the device engine's pipelined send): its index,
    /// or `None` while every slot is reserved or waiting to be written. Posted in order by
    /// [`TcpSend::post_slot`].
    pub fn reserve_slot(&mut self) -> Option<usize> {
        let slot = self.free.pop()?;
        self.reserved_slots.push_back(slot);
        Some(slot)
    }

    /// Queue the oldest slot from [`TcpSend::reserve_slot`] for writing, `header.len` bytes.
    pub fn post_slot(&mut self, header: &FrameHeader) -> LinkResult<()> {
        let len = header.len as usize;
        if len > self.slot_bytes {
            return Err(LinkError::Io(format!(
                "frame of {len} bytes exceeds the {}-byte slot",
                self.slot_bytes
            )));
        }
        let slot = self
            .reserved_slots
            .pop_front()
            .ok_or_else(|| LinkError::Io("post without reserve".into()))?;
        self.queue_frame(header, slot, len);
        Ok(())
    }

    fn queue_frame(&mut self, header: &FrameHeader, slot: usize, len: usize) {
        let base = slot * stride(self.slot_bytes);
        let mut n = 0;
        for (i, part) in parts(len, self.wires.len()).enumerate() {
            self.wires[i].queue.push_back(Piece {
                header: (i == 0).then(|| bytemuck::cast(*header)),
                slot,
                at: base + part.start,
                len: part.len(),
                written: 0,
            });
            n += 1;
        }
        self.unwritten[slot] = n;
    }

    fn lost(&mut self, wire: usize, e: std::io::Error) -> LinkError {
        if let Some(aborted) = self.read_back(wire) {
            return aborted;
        }
        LinkError::Lost(format!(
            "writing to rank {} ({}{}): {e}",
            self.peer,
            self.addr,
            self.wire_name(wire)
        ))
    }

    /// ", connection 2 of 4" where an edge has several.
    fn wire_name(&self, wire: usize) -> String {
        match self.wires.len() {
            1 => String::new(),
            k => format!(", connection {} of {k}", wire + 1),
        }
    }

    /// Read what the peer sent back on `wire` (without blocking): an abort frame with its reason
    /// once it has fully arrived, garbage as a protocol error, else nothing.
    fn read_back(&mut self, wire: usize) -> Option<LinkError> {
        let w = &mut self.wires[wire];
        let mut buf = [0u8; 256];
        while w.back.len() < HEADER_LEN + MAX_ABORT_REASON {
            match w.s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => w.back.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
        }
        if w.back.len() < HEADER_LEN {
            return None;
        }
        let head: [u8; HEADER_LEN] = w.back[..HEADER_LEN].try_into().expect("length checked");
        let h = match FrameHeader::decode(&head) {
            Ok(h) if h.is_abort() => h,
            Ok(_) => {
                return Some(LinkError::Protocol(format!(
                    "rank {} ({}) sent a data frame against the ring's direction",
                    self.peer, self.addr
                )))
            }
            Err(e) => return Some(e.into()),
        };
        let end = HEADER_LEN + h.len as usize;
        (w.back.len() >= end).then(|| {
            LinkError::PeerAborted(String::from_utf8_lossy(&w.back[HEADER_LEN..end]).into_owned())
        })
    }

    /// Write `head` then `payload` to `wire`'s socket until it would block: the bytes written.
    fn write_now(&mut self, wire: usize, head: &[u8], payload: &[u8]) -> LinkResult<usize> {
        let mut written = 0;
        while written < head.len() + payload.len() {
            match write_step(&mut self.wires[wire].s, head, payload, written) {
                Ok(Some(n)) => written += n,
                Ok(None) => break,
                Err(e) => return Err(self.write_failed(wire, e)),
            }
        }
        Ok(written)
    }

    /// The link error for a failed write on `wire`.
    fn write_failed(&mut self, wire: usize, e: std::io::Error) -> LinkError {
        match e.kind() {
            ErrorKind::WriteZero => LinkError::Lost(format!(
                "rank {} ({}{}) stopped reading",
                self.peer,
                self.addr,
                self.wire_name(wire)
            )),
            _ => self.lost(wire, e),
        }
    }

    /// Write `wire`'s queued parts until its socket would block; frees the slots whose frames
    /// have left on every connection.
    fn write_wire(&mut self, wire: usize) -> LinkResult<bool> {
        let mut moved = false;
        loop {
            let w = &mut self.wires[wire];
            let Some(p) = w.queue.front_mut() else {
                return Ok(moved);
            };
            let head = p.header.as_ref().map_or(&[][..], |h| &h[..]);
            let payload = &self.staging.bytes()[p.at..p.at + p.len];
            match write_step(&mut w.s, head, payload, p.written) {
                Ok(Some(n)) => {
                    moved |= n > 0;
                    p.written += n;
                    if p.written == head.len() + p.len {
                        let slot = p.slot;
                        w.queue.pop_front();
                        self.unwritten[slot] -= 1;
                        if self.unwritten[slot] == 0 {
                            self.free.push(slot);
                        }
                    }
                }
                Ok(None) => return Ok(moved),
                Err(e) => return Err(self.write_failed(wire, e)),
            }
        }
    }
}

/// One write of what is left of `head` then `payload` (`written` bytes of the two already
/// gone) to `s`: the bytes written (0 after an interrupted call), `None` when the socket would
/// block, `WriteZero` when the peer takes nothing although bytes are left.
fn write_step(
    s: &mut mio::net::TcpStream,
    head: &[u8],
    payload: &[u8],
    written: usize,
) -> std::io::Result<Option<usize>> {
    let r = if written < head.len() {
        s.write_vectored(&[IoSlice::new(&head[written..]), IoSlice::new(payload)])
    } else {
        s.write(&payload[written - head.len()..])
    };
    match r {
        Ok(0) if head.len() + payload.len() > written => Err(ErrorKind::WriteZero.into()),
        Ok(n) => Ok(Some(n)),
        Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(None),
        Err(e) if e.kind() == ErrorKind::Interrupted => Ok(Some(0)),
        Err(e) => Err(e),
    }
}

impl SendLink for TcpSend {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn reserve(&mut self, len: usize) -> LinkResult<Option<&mut [u8]>> {
        if len > self.slot_bytes {
            return Err(LinkError::Io(format!(
                "frame of {len} bytes exceeds the {}-byte slot",
                self.slot_bytes
            )));
        }
        // The slot stays in `free` until posted: reserving again before a post gets it again.
        let Some(&slot) = self.free.last() else {
            return Ok(None);
        };
        self.reserved = Some((slot, len));
        let at = slot * stride(self.slot_bytes);
        Ok(Some(&mut self.staging.bytes_mut()[at..at + len]))
    }

    fn post(&mut self, header: &FrameHeader) -> LinkResult<()> {
        let (slot, len) = self
            .reserved
            .take()
            .ok_or_else(|| LinkError::Io("post without reserve".into()))?;
        debug_assert_eq!(self.free.last(), Some(&slot));
        self.free.pop();
        self.queue_frame(header, slot, len);
        Ok(())
    }

    fn sends_from(&self) -> bool {
        true
    }

    fn post_from(&mut self, header: &FrameHeader, data: &[u8]) -> LinkResult<()> {
        let (slot, len) = self
            .reserved
            .take()
            .ok_or_else(|| LinkError::Io("post without reserve".into()))?;
        if len != data.len() {
            return Err(LinkError::Io(format!(
                "frame of {} bytes posted into a reservation of {len}",
                data.len()
            )));
        }
        debug_assert_eq!(self.free.last(), Some(&slot));
        self.free.pop();
        let base = slot * stride(self.slot_bytes);
        let mut queued = 0;
        for (i, part) in parts(len, self.wires.len()).enumerate() {
            let header: Option<[u8; HEADER_LEN]> = (i == 0).then(|| bytemuck::cast(*header));
            let mine = &data[part.clone()];
            // Behind frames still queued on this connection, the part waits its turn.
            let written = match self.wires[i].queue.is_empty() {
                true => self.write_now(i, header.as_ref().map_or(&[][..], |h| &h[..]), mine)?,
                false => 0,
            };
            let head = header.map_or(0, |h| h.len());
            if written == head + mine.len() {
                continue;
            }
            // The rest from the slot, where only the bytes not yet written are copied.
            let from = written.saturating_sub(head);
            let at = base + part.start;
            self.staging.bytes_mut()[at + from..at + part.len()].copy_from_slice(&mine[from..]);
            self.wires[i].queue.push_back(Piece {
                header,
                slot,
                at,
                len: part.len(),
                written,
            });
            queued += 1;
        }
        self.unwritten[slot] = queued;
        if queued == 0 {
            self.free.push(slot);
        }
        Ok(())
    }

    fn progress(&mut self) -> LinkResult<bool> {
        let mut moved = false;
        for wire in 0..self.wires.len() {
            moved |= self.write_wire(wire)?;
        }
        Ok(moved)
    }

    fn flushed(&self) -> bool {
        self.wires.iter().all(|w| w.queue.is_empty())
    }

    fn health(&mut self) -> LinkResult<()> {
        for wire in 0..self.wires.len() {
            match self.wires[wire].s.take_error() {
                Ok(Some(e)) | Err(e) => return Err(self.lost(wire, e)),
                Ok(None) => {
                    if let Some(e) = self.read_back(wire) {
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }

    fn abort(&mut self, reason: &str) {
        // An abort frame (header and reason, on wire 0 where headers go) can only be sent at a
        // frame boundary; mid-frame, closing says enough.
        if self.flushed() {
            let r = &reason.as_bytes()[..reason.len().min(MAX_ABORT_REASON)];
            let h: [u8; HEADER_LEN] = bytemuck::cast(FrameHeader::abort(r.len()));
            let _ = self.wires[0]
                .s
                .write_vectored(&[IoSlice::new(&h), IoSlice::new(r)]);
        }
        for w in &mut self.wires {
            let _ = w.s.shutdown(std::net::Shutdown::Write);
        }
    }

    fn sockets(&mut self) -> Vec<&mut mio::net::TcpStream> {
        self.wires.iter_mut().map(|w| &mut w.s).collect()
    }
}
