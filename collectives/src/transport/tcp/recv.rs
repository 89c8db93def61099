//! The receiving half of a tcp link: frames read from the edge's connections into the slots,
//! reassembled in order.

use std::io::{ErrorKind, IoSlice, IoSliceMut, Read, Write};
use std::net::TcpStream;

use super::{LinkError, LinkResult, RecvLink, TransportKind};
use crate::error::Result;
use crate::wire::{Expect, FrameHeader, HEADER_LEN, MAX_ABORT_REASON};

use super::*;

/// Receiving half over TCP: a frame's header from wire 0, then its parts from every wire at once
/// (see [`TcpSend`]).
pub struct TcpRecv {
    pub(super) wires: Vec<mio::net::TcpStream>,
    /// Bytes of the current frame's part received on each wire.
    part_got: Vec<usize>,
    peer: usize,
    addr: String,
    header: [u8; HEADER_LEN],
    header_got: usize,
    checked: Option<FrameHeader>,
    /// The current frame's payload goes into the caller's buffer ([`RecvLink::recv_into`]),
    /// not into a slot.
    into: bool,
    /// `slots` slots of `slot_bytes` (at least an abort reason's length).
    payload: Aligned,
    slot_bytes: usize,
    slots: usize,
    /// The oldest slot still held, and how many are held (consumed by the device engine, not yet
    /// released: the kernel reading them may still run). The host engine holds none.
    first: usize,
    held: usize,
}

/// The length of the first of `len`'s parts over `wires` connections (what comes with the
/// header on wire 0).
fn first_part(len: usize, wires: usize) -> usize {
    parts(len, wires).next().map_or(0, |p| p.len())
}

impl TcpRecv {
    /// Wrap an authenticated connection from rank `peer` (one slot: the host engine).
    pub fn new(s: TcpStream, peer: usize, slot_bytes: usize) -> Result<TcpRecv> {
        TcpRecv::over(vec![s], peer, 1, slot_bytes)
    }

    /// Wrap a connection with `slots` receive slots (the device engine: frames arrive into the
    /// next free slot while kernels still read the ones before it).
    pub fn with_slots(
        s: TcpStream,
        peer: usize,
        slots: usize,
        slot_bytes: usize,
    ) -> Result<TcpRecv> {
        TcpRecv::over(vec![s], peer, slots, slot_bytes)
    }

    /// Wrap the connections of one edge from rank `peer`, in the order they carry frames (see
    /// [`accept_wires`]), with `slots` receive slots.
    pub fn over(
        streams: Vec<TcpStream>,
        peer: usize,
        slots: usize,
        slot_bytes: usize,
    ) -> Result<TcpRecv> {
        let addr = peer_address(&streams)?;
        let (slots, slot_bytes) = (slots.max(1), slot_bytes.max(MAX_ABORT_REASON));
        Ok(TcpRecv {
            part_got: vec![0; streams.len()],
            wires: streams.into_iter().map(into_mio).collect::<Result<_>>()?,
            peer,
            addr,
            header: [0; HEADER_LEN],
            header_got: 0,
            checked: None,
            into: false,
            payload: Aligned::new(slots * stride(slot_bytes))?,
            slot_bytes,
            slots,
            first: 0,
            held: 0,
        })
    }

    /// The connections this edge uses.
    pub fn wires(&self) -> usize {
        self.wires.len()
    }

    /// ", connection 2 of 4" where an edge has several.
    fn wire_name(&self, wire: usize) -> String {
        match self.wires.len() {
            1 => String::new(),
            k => format!(", connection {} of {k}", wire + 1),
        }
    }

    /// The receive slots' memory (page-aligned; slot `i` at `i × stride`) and the stride: for a
    /// device to register.
    pub fn staging(&mut self) -> (*mut u8, usize, usize) {
        (
            self.payload.map.as_mut_ptr(),
            self.payload.map.len(),
            stride(self.slot_bytes),
        )
    }

    fn current(&self) -> usize {
        (self.first + self.held) % self.slots
    }

    /// The next frame's slot and length once it has fully arrived and matches `expect`.
    fn arrive(&mut self, expect: &Expect) -> LinkResult<Option<(usize, usize)>> {
        if self.held == self.slots {
            return Ok(None);
        }
        if self.checked.is_none() {
            let first = first_part(expect.len.min(self.slot_bytes), self.wires.len());
            if !self.read_header(first, None)? {
                return Ok(None);
            }
            let h = FrameHeader::decode(&self.header)?;
            if !h.is_abort() {
                // Checked before any payload byte is read: the length cannot exceed what we expect.
                h.check(expect)?;
                if expect.len > self.slot_bytes {
                    return Err(LinkError::Protocol(format!(
                        "frame of {} bytes exceeds the slot",
                        expect.len
                    )));
                }
            }
            self.checked = Some(h);
        }
        let h = self.checked.expect("set above");
        let len = h.len as usize;
        // An abort's reason follows its header on wire 0; data is striped.
        let wires = if h.is_abort() { 1 } else { self.wires.len() };
        let mut all = true;
        for (i, part) in parts(len, wires).enumerate() {
            all &= self.read_part(i, part, None)?;
        }
        if !all {
            return Ok(None);
        }
        let at = self.current() * stride(self.slot_bytes);
        if h.is_abort() {
            return Err(LinkError::PeerAborted(
                String::from_utf8_lossy(&self.payload.bytes()[at..at + len]).into_owned(),
            ));
        }
        Ok(Some((self.current(), len)))
    }

    /// The frame is done with.
    fn next_frame(&mut self) {
        self.checked = None;
        self.header_got = 0;
        self.part_got.fill(0);
        self.into = false;
    }

    /// The next frame's header and payload read into `dst` ([`RecvLink::recv_into`]).
    fn arrive_into(&mut self, expect: &Expect, dst: &mut [u8]) -> LinkResult<bool> {
        if self.checked.is_none() {
            let first = first_part(dst.len(), self.wires.len());
            if !self.read_header(first, Some(&mut *dst))? {
                return Ok(false);
            }
            let h = FrameHeader::decode(&self.header)?;
            if h.is_abort() {
                // The reason's first bytes came with the header: to the slot, where
                // `arrive` reads the rest of it and fails the link with it.
                let at = self.current() * stride(self.slot_bytes);
                let got = self.part_got[0].min(self.slot_bytes);
                self.payload.bytes_mut()[at..at + got].copy_from_slice(&dst[..got]);
                self.into = false;
                self.checked = Some(h);
                return self.arrive(expect).map(|_| false);
            }
            h.check(expect)?;
            if h.len as usize != dst.len() {
                return Err(LinkError::Protocol(format!(
                    "frame of {} bytes for a buffer of {}",
                    h.len,
                    dst.len()
                )));
            }
            self.checked = Some(h);
        }
        let mut all = true;
        for (i, part) in parts(dst.len(), self.wires.len()).enumerate() {
            all &= self.read_part(i, part, Some(&mut *dst))?;
        }
        if all {
            self.next_frame();
        }
        Ok(all)
    }

    /// The device engine's peek: the slot index of the next frame, once it has arrived.
    pub fn peek_slot(&mut self, expect: &Expect) -> LinkResult<Option<usize>> {
        Ok(self.arrive(expect)?.map(|(slot, _)| slot))
    }

    /// Move past the frame peeked last, holding its slot until [`TcpRecv::release_oldest`].
    pub fn consume(&mut self) {
        self.next_frame();
        self.held = (self.held + 1).min(self.slots);
    }

    /// Free the oldest held slot.
    pub fn release_oldest(&mut self) -> LinkResult<()> {
        if self.held == 0 {
            return Err(LinkError::Io("release without a held slot".into()));
        }
        self.first = (self.first + 1) % self.slots;
        self.held -= 1;
        Ok(())
    }

    /// Read the next header from wire 0: Ok(true) once whole, Ok(false) when the socket would
    /// block.
    ///
    /// The same read also takes what follows the header on wire 0, up to `first` bytes (the
    /// first part of the frame the caller expects), straight into where the payload goes (`dst`,
    /// or the current slot): a small frame arrives in one system call instead of two. It never
    /// reads past the frame's own bytes when the header is the one expected (a data frame must
    /// match the expected length exactly, and wire 0 carries the first part); when it is not
    /// (another call's frame, garbage, an abort whose reason is shorter), the link fails on that
    /// header, and bytes read beyond it are never looked at. An abort's reason starts at the
    /// payload's start, and `part_got[0]` counts what arrived either way.
    fn read_header(&mut self, first: usize, mut dst: Option<&mut [u8]>) -> LinkResult<bool> {
        let at = self.current() * stride(self.slot_bytes);
        while self.header_got < HEADER_LEN {
            let r = {
                let into = match dst.as_deref_mut() {
                    Some(d) => &mut d[..first],
                    None => &mut self.payload.bytes_mut()[at..at + first],
                };
                let mut iov = [
                    IoSliceMut::new(&mut self.header[self.header_got..]),
                    IoSliceMut::new(into),
                ];
                self.wires[0].read_vectored(&mut iov)
            };
            match self.got(0, r)? {
                Some(n) => {
                    let h = n.min(HEADER_LEN - self.header_got);
                    self.header_got += h;
                    self.part_got[0] = n - h;
                }
                None => return Ok(false),
            }
        }
        Ok(true)
    }

    /// Read part `part` of the current frame from `wire` into `dst` (or the current slot):
    /// Ok(true) once whole, Ok(false) when the socket would block.
    fn read_part(
        &mut self,
        wire: usize,
        part: std::ops::Range<usize>,
        mut dst: Option<&mut [u8]>,
    ) -> LinkResult<bool> {
        let at = match dst {
            Some(_) => 0,
            None => self.current() * stride(self.slot_bytes),
        };
        let (start, end) = (at + part.start, at + part.end);
        while start + self.part_got[wire] < end {
            let from = start + self.part_got[wire];
            let r = match dst.as_deref_mut() {
                Some(d) => self.wires[wire].read(&mut d[from..end]),
                None => self.wires[wire].read(&mut self.payload.bytes_mut()[from..end]),
            };
            match self.got(wire, r)? {
                Some(n) => self.part_got[wire] += n,
                None => return Ok(false),
            }
        }
        Ok(true)
    }

    /// A read's outcome on `wire`: bytes read, `None` when it would block, or the link lost.
    fn got(&self, wire: usize, r: std::io::Result<usize>) -> LinkResult<Option<usize>> {
        match r {
            Ok(0) => Err(LinkError::Lost(format!(
                "connection closed by rank {} ({}{})",
                self.peer,
                self.addr,
                self.wire_name(wire)
            ))),
            Ok(n) => Ok(Some(n)),
            Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(None),
            Err(e) if e.kind() == ErrorKind::Interrupted => Ok(Some(0)),
            Err(e) => Err(LinkError::Lost(format!(
                "reading from rank {} ({}{}): {e}",
                self.peer,
                self.addr,
                self.wire_name(wire)
            ))),
        }
    }
}

impl RecvLink for TcpRecv {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn peek(&mut self, expect: &Expect) -> LinkResult<Option<&[u8]>> {
        if self.into {
            return Err(LinkError::Protocol(
                "a frame begun by recv_into was peeked".into(),
            ));
        }
        Ok(match self.arrive(expect)? {
            Some((slot, len)) => {
                let at = slot * stride(self.slot_bytes);
                Some(&self.payload.bytes()[at..at + len])
            }
            None => None,
        })
    }

    fn release(&mut self) -> LinkResult<()> {
        self.next_frame();
        Ok(())
    }

    fn receives_into(&self) -> bool {
        true
    }

    fn recv_into(&mut self, expect: &Expect, dst: &mut [u8]) -> LinkResult<bool> {
        if self.header_got > 0 && !self.into {
            // Begun by a peek (a lane's or a posted message's readiness check): into the
            // slot, and out of it.
            return crate::transport::recv_out_of_slot(self, expect, dst);
        }
        if self.held == self.slots {
            return Ok(false);
        }
        self.into = true;
        self.arrive_into(expect, dst)
    }

    fn health(&mut self) -> LinkResult<()> {
        for s in &self.wires {
            if let Ok(Some(e)) | Err(e) = s.take_error() {
                return Err(LinkError::Lost(format!(
                    "rank {} ({}): {e}",
                    self.peer, self.addr
                )));
            }
        }
        Ok(())
    }

    fn abort(&mut self, reason: &str) {
        // Tell the sender why, on the connections' otherwise unused reverse direction, then stop
        // writing; the connections close when the link is dropped.
        let r = &reason.as_bytes()[..reason.len().min(MAX_ABORT_REASON)];
        let h: [u8; HEADER_LEN] = bytemuck::cast(FrameHeader::abort(r.len()));
        for s in &mut self.wires {
            let _ = s.write_vectored(&[IoSlice::new(&h), IoSlice::new(r)]);
            let _ = s.shutdown(std::net::Shutdown::Write);
        }
    }

    fn sockets(&mut self) -> Vec<&mut mio::net::TcpStream> {
        self.wires.iter_mut().collect()
    }
}
