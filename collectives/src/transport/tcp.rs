//! TCP transport: one or more connections per ring edge (`RINGZERO_TCP_SOCKETS`), non-blocking,
//! driven by the engine's loop.
//!
//! The sender's "slots" are local staging buffers: the engine reduces straight into one, posts it,
//! and [`SendLink::progress`] writes header and payload with one vectored write per call until the
//! socket would block. The receiver reads the 48-byte header first, checks it against what it
//! expects (before reading or buffering a single payload byte), then reads the payload into its
//! slot. With several connections ("wires") frame `n` travels on wire `n mod k`: the sender writes
//! every wire that has frames queued, the receiver reads the wire its next frame is due on while the
//! others fill their kernel buffers, so k flows move at once and frames still arrive in order.
//! Connection setup uses socket2 (NODELAY, large buffers) and the authenticated handshake;
//! the established streams are `mio` streams so the engine can sleep on both directions at once.

use std::collections::VecDeque;
use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, SockRef, Socket, Type};

use super::{LinkError, LinkResult, RecvLink, SendLink, TransportKind};
use crate::bootstrap::handshake::{self, Identity, Role};
use crate::error::{Error, Result};
use crate::wire::{Expect, FrameHeader, HEADER_LEN, MAX_ABORT_REASON};

const SOCKET_BUFFER: usize = 4 << 20;

/// Page-aligned, zero-filled byte storage (an anonymous mapping): every dtype can be viewed in
/// place, and a device can register it as pinned staging memory.
struct Aligned {
    map: memmap2::MmapMut,
    len: usize,
}

impl Aligned {
    fn new(len: usize) -> Result<Aligned> {
        let map = memmap2::MmapMut::map_anon(len.max(1))
            .map_err(|e| Error::io(format!("allocating {len} bytes of tcp staging"), e))?;
        Ok(Aligned { map, len })
    }
    fn bytes(&self) -> &[u8] {
        &self.map[..self.len]
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map[..self.len]
    }
}

/// Slots start at multiples of this, so every dtype (and a device's vector loads) can read a
/// slot in place whatever the slot size.
const STRIDE_ALIGN: usize = 64;

fn stride(slot_bytes: usize) -> usize {
    slot_bytes.next_multiple_of(STRIDE_ALIGN)
}

pub(crate) fn tune(s: &TcpStream) {
    let r = SockRef::from(s);
    let _ = r.set_nodelay(true);
    let _ = r.set_send_buffer_size(SOCKET_BUFFER);
    let _ = r.set_recv_buffer_size(SOCKET_BUFFER);
}

/// Connect to rank `peer` listening at `addr` and authenticate, retrying refused connections
/// until `timeout`.
pub fn connect(
    addr: SocketAddr,
    me: &Identity,
    peer: usize,
    timeout: Duration,
) -> Result<TcpStream> {
    connect_as(addr, me, Role::Data, peer, timeout)
}

/// [`connect`] for a connection of `role`.
pub fn connect_as(
    addr: SocketAddr,
    me: &Identity,
    role: Role,
    peer: usize,
    timeout: Duration,
) -> Result<TcpStream> {
    let deadline = Instant::now() + timeout;
    let who = format!("rank {peer} at {addr}");
    loop {
        let sock = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))
            .map_err(|e| Error::io("creating a socket", e))?;
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(10));
        match sock.connect_timeout(&addr.into(), left) {
            Ok(()) => {
                let mut s: TcpStream = sock.into();
                tune(&s);
                let theirs = handshake::client(&mut s, me, role, &who, timeout)?;
                if theirs as usize != peer {
                    return Err(Error::Handshake {
                        peer: who,
                        reason: format!("expected rank {peer}, found rank {theirs}"),
                    });
                }
                return Ok(s);
            }
            Err(e) if Instant::now() < deadline && e.kind() == ErrorKind::ConnectionRefused => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(Error::io(format!("connecting to {who}"), e)),
        }
    }
}

/// Accept the data connection of rank `peer` on `l`, authenticating every caller; callers that
/// fail the handshake (random bytes, another job, a wrong secret) are dropped and logged and the
/// wait goes on, until `timeout`. Each caller is authenticated on its own thread, so one that
/// connects and then says nothing cannot hold up the real peer.
pub fn accept_from(
    l: &TcpListener,
    me: &Identity,
    peer: usize,
    timeout: Duration,
) -> Result<TcpStream> {
    let mut one = accept_n(l, me, peer, None, timeout)?;
    Ok(one.pop().expect("one connection"))
}

/// [`accept_from`] for one connection (`wires` None), or for the `wires` connections of rank
/// `peer`'s edge, each introduced by its place among them (see [`connect_wires`]), returned in
/// that order. One loop takes them all: the peer dials the next as soon as its handshake ends,
/// so a connection accepted while the loop was returning another would be lost.
fn accept_n(
    l: &TcpListener,
    me: &Identity,
    peer: usize,
    wires: Option<usize>,
    timeout: Duration,
) -> Result<Vec<TcpStream>> {
    let count = wires.unwrap_or(1);
    let deadline = Instant::now() + timeout;
    l.set_nonblocking(true)
        .map_err(|e| Error::io("listener", e))?;
    let secret: std::sync::Arc<[u8]> = me.secret.into();
    let job: std::sync::Arc<str> = me.job_id.into();
    let rank = me.rank;
    // An authenticated connection and its introduction (or why it could not be read), or why a
    // caller was dropped.
    type Accepted = (Result<(TcpStream, std::io::Result<[u8; 4]>)>, SocketAddr);
    let (done_tx, done_rx) = std::sync::mpsc::channel::<Accepted>();
    let mut refused = Vec::new();
    let mut got: Vec<Option<TcpStream>> = (0..count).map(|_| None).collect();
    let mut open = 0;
    loop {
        match l.accept() {
            Ok((s, from)) => {
                let (secret, job, done) = (secret.clone(), job.clone(), done_tx.clone());
                let hs_timeout = timeout.min(Duration::from_secs(10));
                std::thread::spawn(move || {
                    let r = (|| {
                        let mut s = s;
                        s.set_nonblocking(false)
                            .map_err(|e| Error::io("accepted socket", e))?;
                        tune(&s);
                        let me = Identity {
                            secret: &secret,
                            job_id: &job,
                            rank,
                        };
                        let h = handshake::server(&mut s, &me, hs_timeout)?;
                        if h.role == Role::Data && h.rank as usize == peer {
                            let mut intro = [0u8; 4];
                            let read = match wires {
                                None => Ok(()),
                                Some(_) => s
                                    .set_read_timeout(Some(hs_timeout))
                                    .and_then(|()| s.read_exact(&mut intro))
                                    .and_then(|()| s.set_read_timeout(None)),
                            };
                            Ok((s, read.map(|()| intro)))
                        } else {
                            Err(Error::Handshake {
                                peer: from.to_string(),
                                reason: format!(
                                    "rank {} role {:?} where rank {peer} was expected",
                                    h.rank, h.role
                                ),
                            })
                        }
                    })();
                    let _ = done.send((r, from));
                });
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => return Err(Error::io("accepting a data connection", e)),
        }
        while let Ok((r, from)) = done_rx.try_recv() {
            match r {
                Ok((s, intro)) => {
                    let bad = |detail: String| Error::Protocol {
                        peer: format!("rank {peer} ({from})"),
                        detail,
                    };
                    let intro = intro.map_err(|e| {
                        bad(format!(
                            "reading which of the edge's connections this is: {e}"
                        ))
                    })?;
                    let (i, theirs) = match wires {
                        None => (0, 1),
                        Some(_) => (
                            u16::from_le_bytes([intro[0], intro[1]]) as usize,
                            u16::from_le_bytes([intro[2], intro[3]]) as usize,
                        ),
                    };
                    if theirs != count {
                        return Err(bad(format!(
                            "opened its edge with {theirs} connections where this rank \
                             published {count}"
                        )));
                    }
                    match got.get_mut(i) {
                        Some(w @ None) => *w = Some(s),
                        _ => {
                            return Err(bad(format!(
                                "connection index {i} is repeated or past {count}"
                            )))
                        }
                    }
                    open += 1;
                    if open == count {
                        return Ok(got.into_iter().map(|w| w.expect("all filled")).collect());
                    }
                }
                Err(e) => {
                    tracing::warn!(target: "ringzero::transport", "dropped data connection from {from}: {e}");
                    refused.push(e.to_string());
                }
            }
        }
        if Instant::now() >= deadline {
            let also = if refused.is_empty() {
                String::new()
            } else {
                format!("; refused: {}", refused.join("; "))
            };
            let which = match count {
                1 => "its data connection".to_string(),
                _ => format!("its data connections ({open} of {count} open)"),
            };
            return Err(Error::Timeout {
                op: "connect".into(),
                seq: 0,
                peer,
                waiting: format!("rank {peer} to open {which}{also}"),
                after: timeout,
            });
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Dial the `count` connections of one edge to rank `peer` at `addr` (see [`TcpSend::over`]).
/// Each opens with its place among them (index, count: two little-endian u16), so the receiver
/// orders them whatever order they are accepted in, and refuses a count it did not publish.
pub fn connect_wires(
    addr: SocketAddr,
    me: &Identity,
    peer: usize,
    count: usize,
    timeout: Duration,
) -> Result<Vec<TcpStream>> {
    let deadline = Instant::now() + timeout;
    (0..count)
        .map(|i| {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut s = connect(addr, me, peer, left.max(Duration::from_millis(10)))?;
            let mut intro = [0u8; 4];
            intro[..2].copy_from_slice(&(i as u16).to_le_bytes());
            intro[2..].copy_from_slice(&(count as u16).to_le_bytes());
            s.write_all(&intro).map_err(|e| {
                Error::io(
                    format!(
                        "opening connection {} of {count} to rank {peer} at {addr}",
                        i + 1
                    ),
                    e,
                )
            })?;
            Ok(s)
        })
        .collect()
}

/// Accept the `count` connections of rank `peer`'s edge on `l` (see [`connect_wires`]), in the
/// order they carry frames.
pub fn accept_wires(
    l: &TcpListener,
    me: &Identity,
    peer: usize,
    count: usize,
    timeout: Duration,
) -> Result<Vec<TcpStream>> {
    accept_n(l, me, peer, Some(count), timeout)
}

fn into_mio(s: TcpStream) -> Result<mio::net::TcpStream> {
    s.set_nonblocking(true)
        .map_err(|e| Error::io("making a data socket non-blocking", e))?;
    Ok(mio::net::TcpStream::from_std(s))
}

struct Pending {
    header: [u8; HEADER_LEN],
    slot: usize,
    len: usize,
    written: usize,
}

/// One of a sending edge's connections: the frames queued for it, and what the peer sent back.
struct SendWire {
    s: mio::net::TcpStream,
    queue: VecDeque<Pending>,
    /// Bytes read back from the peer: the only thing a receiver ever sends is an abort frame.
    back: Vec<u8>,
}

/// Sending half over TCP: one or more connections ("wires"); frame `n` goes on wire `n mod k`,
/// so the receiver, reading the wires in the same turn, sees the frames in order.
pub struct TcpSend {
    wires: Vec<SendWire>,
    /// Frames posted so far: the next one goes on wire `posted mod k`.
    posted: usize,
    peer: usize,
    addr: String,
    slot_bytes: usize,
    /// `slots` slots of `slot_bytes`, each starting a multiple of [`STRIDE_ALIGN`] after the
    /// last.
    staging: Aligned,
    /// Slots neither reserved nor waiting to be written. Frames on different wires finish in
    /// any order, so the free slots are a set, not a ring position.
    free: Vec<usize>,
    /// The host engine's one reservation: slot and length.
    reserved: Option<(usize, usize)>,
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
        if streams.is_empty() {
            return Err(Error::config(
                "tcp_sockets",
                "an edge needs at least one connection",
            ));
        }
        let addr = streams[0]
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
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
            posted: 0,
            peer,
            addr,
            slot_bytes,
            staging: Aligned::new(slots * stride(slot_bytes))?,
            free: (0..slots).rev().collect(),
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
        let k = self.wires.len();
        self.wires[self.posted % k].queue.push_back(Pending {
            header: bytemuck::cast(*header),
            slot,
            len,
            written: 0,
        });
        self.posted = self.posted.wrapping_add(1);
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

    /// Write `wire`'s queued frames until its socket would block; frees the slots of the frames
    /// that have left.
    fn write_wire(&mut self, wire: usize) -> LinkResult<bool> {
        let mut moved = false;
        let st = stride(self.slot_bytes);
        loop {
            let w = &mut self.wires[wire];
            let Some(p) = w.queue.front_mut() else {
                return Ok(moved);
            };
            let total = HEADER_LEN + p.len;
            let payload = &self.staging.bytes()[p.slot * st..p.slot * st + p.len];
            let r = if p.written < HEADER_LEN {
                w.s.write_vectored(&[IoSlice::new(&p.header[p.written..]), IoSlice::new(payload)])
            } else {
                w.s.write(&payload[p.written - HEADER_LEN..])
            };
            match r {
                Ok(0) => {
                    return Err(LinkError::Lost(format!(
                        "rank {} ({}{}) stopped reading",
                        self.peer,
                        self.addr,
                        self.wire_name(wire)
                    )))
                }
                Ok(n) => {
                    moved = true;
                    p.written += n;
                    if p.written == total {
                        let slot = p.slot;
                        w.queue.pop_front();
                        self.free.push(slot);
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(moved),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(self.lost(wire, e)),
            }
        }
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
        // An abort frame can only be sent at a frame boundary; mid-frame, closing says enough.
        // The receiver reads whichever wire its next frame is due on: each idle wire says why.
        let r = &reason.as_bytes()[..reason.len().min(MAX_ABORT_REASON)];
        let h: [u8; HEADER_LEN] = bytemuck::cast(FrameHeader::abort(r.len()));
        for w in &mut self.wires {
            if w.queue.is_empty() {
                let _ = w.s.write_vectored(&[IoSlice::new(&h), IoSlice::new(r)]);
            }
            let _ = w.s.shutdown(std::net::Shutdown::Write);
        }
    }

    fn sockets(&mut self) -> Vec<&mut mio::net::TcpStream> {
        self.wires.iter_mut().map(|w| &mut w.s).collect()
    }
}

/// Receiving half over TCP: reads frame `n` from wire `n mod k`, in turn (see [`TcpSend`]).
pub struct TcpRecv {
    wires: Vec<mio::net::TcpStream>,
    /// The wire the next frame arrives on.
    at: usize,
    peer: usize,
    addr: String,
    header: [u8; HEADER_LEN],
    header_got: usize,
    checked: Option<FrameHeader>,
    /// `slots` slots of `slot_bytes` (at least an abort reason's length).
    payload: Aligned,
    slot_bytes: usize,
    slots: usize,
    got: usize,
    /// The oldest slot still held, and how many are held (consumed by the device engine, not yet
    /// released: the kernel reading them may still run). The host engine holds none.
    first: usize,
    held: usize,
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
        if streams.is_empty() {
            return Err(Error::config(
                "tcp_sockets",
                "an edge needs at least one connection",
            ));
        }
        let addr = streams[0]
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        let (slots, slot_bytes) = (slots.max(1), slot_bytes.max(MAX_ABORT_REASON));
        Ok(TcpRecv {
            wires: streams.into_iter().map(into_mio).collect::<Result<_>>()?,
            at: 0,
            peer,
            addr,
            header: [0; HEADER_LEN],
            header_got: 0,
            checked: None,
            payload: Aligned::new(slots * stride(slot_bytes))?,
            slot_bytes,
            slots,
            got: 0,
            first: 0,
            held: 0,
        })
    }

    /// The connections this edge uses.
    pub fn wires(&self) -> usize {
        self.wires.len()
    }

    /// ", connection 2 of 4" where an edge has several.
    fn wire_name(&self) -> String {
        match self.wires.len() {
            1 => String::new(),
            k => format!(", connection {} of {k}", self.at + 1),
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
            if !self.fill(Buf::Header, HEADER_LEN)? {
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
        if !self.fill(Buf::Payload, len)? {
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

    /// The frame is done with: the next one arrives on the next wire.
    fn next_frame(&mut self) {
        self.checked = None;
        self.header_got = 0;
        self.got = 0;
        self.at = (self.at + 1) % self.wires.len();
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

    /// Read into `buf[*got..]`; Ok(true) when full, Ok(false) when the socket would block.
    fn fill(&mut self, which: Buf, want: usize) -> LinkResult<bool> {
        loop {
            let at = self.current() * stride(self.slot_bytes);
            let (buf, got) = match which {
                Buf::Header => (&mut self.header[..], &mut self.header_got),
                Buf::Payload => (&mut self.payload.bytes_mut()[at..at + want], &mut self.got),
            };
            if *got == buf.len() {
                return Ok(true);
            }
            match self.wires[self.at].read(&mut buf[*got..]) {
                Ok(0) => {
                    return Err(LinkError::Lost(format!(
                        "connection closed by rank {} ({}{})",
                        self.peer,
                        self.addr,
                        self.wire_name()
                    )))
                }
                Ok(n) => *got += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(LinkError::Lost(format!(
                        "reading from rank {} ({}{}): {e}",
                        self.peer,
                        self.addr,
                        self.wire_name()
                    )))
                }
            }
        }
    }
}

#[derive(Clone, Copy)]
enum Buf {
    Header,
    Payload,
}

impl RecvLink for TcpRecv {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn peek(&mut self, expect: &Expect) -> LinkResult<Option<&[u8]>> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::Collective;
    use crate::wire::Fingerprint;

    fn fp(len: usize) -> Fingerprint {
        Fingerprint::new(
            Collective::AllGather,
            Some(ringzero_kernels::DType::U8),
            None,
            len,
        )
    }

    fn expect(step: u32, len: usize) -> Expect {
        Expect {
            seq: 7,
            step,
            slice: 0,
            fp: fp(len),
            len,
        }
    }

    fn who(rank: u32) -> Identity<'static> {
        Identity {
            secret: b"wires",
            job_id: "tcp-test",
            rank,
        }
    }

    /// An edge of `k` connections from rank 0 to rank 1 on loopback.
    fn edge(k: usize, slots: usize, slot_bytes: usize) -> (TcpSend, TcpRecv) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = Duration::from_secs(10);
        let dial = std::thread::spawn(move || connect_wires(addr, &who(0), 1, k, t).unwrap());
        let rx = accept_wires(&l, &who(1), 0, k, t).unwrap();
        let tx = dial.join().unwrap();
        (
            TcpSend::over(tx, 1, slots, slot_bytes).unwrap(),
            TcpRecv::over(rx, 0, 1, slot_bytes).unwrap(),
        )
    }

    /// Drive `tx` and read frame `step` on `rx` until it arrives (bounded).
    fn receive(tx: &mut TcpSend, rx: &mut TcpRecv, step: u32, len: usize) -> Vec<u8> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            tx.progress().unwrap();
            if let Some(b) = rx.peek(&expect(step, len)).unwrap() {
                let out = b.to_vec();
                rx.release().unwrap();
                return out;
            }
            assert!(Instant::now() < deadline, "frame {step} never arrived");
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    fn pattern(step: u32, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u32 * 31 + step * 7 + 1) as u8)
            .collect()
    }

    #[test]
    fn frames_arrive_in_order_over_several_connections() {
        let (mut tx, mut rx) = edge(3, 2, 4096);
        assert_eq!((tx.wires(), rx.wires()), (3, 3));
        for step in 0..10u32 {
            let len = [1, 4096, 100, 3000][step as usize % 4];
            let deadline = Instant::now() + Duration::from_secs(10);
            while tx.reserve(len).unwrap().is_none() {
                tx.progress().unwrap();
                assert!(Instant::now() < deadline);
            }
            tx.reserve(len)
                .unwrap()
                .unwrap()
                .copy_from_slice(&pattern(step, len));
            tx.post(&FrameHeader::data(7, step, 0, fp(len), len))
                .unwrap();
            // Every frame is read back before the next: the receiver turns to the next wire each
            // time, so a frame on the wrong connection would never be found.
            assert_eq!(receive(&mut tx, &mut rx, step, len), pattern(step, len));
        }
        assert!(tx.flushed());
    }

    #[test]
    fn a_slot_freed_on_one_connection_is_reused_while_another_is_still_writing() {
        // Slots larger than the sockets' buffers: a frame on a connection the receiver is not
        // reading cannot leave. Frames on different connections finish out of order, and the
        // slot of the one that left must be the one reused.
        let big = 24 << 20;
        let (mut tx, mut rx) = edge(2, 2, big);
        let first = pattern(0, big);
        tx.reserve(big).unwrap().unwrap().copy_from_slice(&first);
        tx.post(&FrameHeader::data(7, 0, 0, fp(big), big)).unwrap();
        tx.reserve(10)
            .unwrap()
            .unwrap()
            .copy_from_slice(&pattern(1, 10));
        tx.post(&FrameHeader::data(7, 1, 0, fp(10), 10)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while tx.reserve(10).unwrap().is_none() {
            tx.progress().unwrap();
            assert!(Instant::now() < deadline, "the small frame never left");
        }
        assert!(
            !tx.flushed(),
            "the large frame should still be waiting for the receiver"
        );
        // Frame 2 reuses the small frame's slot (on connection 1 again); the large frame's slot
        // must be untouched.
        tx.reserve(10)
            .unwrap()
            .unwrap()
            .copy_from_slice(&pattern(2, 10));
        tx.post(&FrameHeader::data(7, 2, 0, fp(10), 10)).unwrap();
        assert!(tx.reserve(1).unwrap().is_none(), "both slots are busy");
        assert!(
            receive(&mut tx, &mut rx, 0, big) == first,
            "the large frame was overwritten"
        );
        assert_eq!(receive(&mut tx, &mut rx, 1, 10), pattern(1, 10));
        assert_eq!(receive(&mut tx, &mut rx, 2, 10), pattern(2, 10));
    }

    #[test]
    fn a_connection_count_the_receiver_did_not_publish_is_refused() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = Duration::from_secs(10);
        let dial = std::thread::spawn(move || connect_wires(addr, &who(0), 1, 2, t));
        let err = accept_wires(&l, &who(1), 0, 3, t).unwrap_err().to_string();
        assert!(
            err.contains("rank 0")
                && err.contains("opened its edge with 2 connections where this rank published 3"),
            "{err}"
        );
        let _ = dial.join().unwrap();
    }

    #[test]
    fn aborts_and_lost_connections_are_seen_across_connections() {
        // The sender aborts between frames: the receiver learns why on whichever connection its
        // next frame is due.
        let (mut tx, mut rx) = edge(3, 2, 64);
        tx.reserve(5).unwrap().unwrap().fill(9);
        tx.post(&FrameHeader::data(7, 0, 0, fp(5), 5)).unwrap();
        assert_eq!(receive(&mut tx, &mut rx, 0, 5), vec![9; 5]);
        tx.abort("rank 0 gives up");
        let deadline = Instant::now() + Duration::from_secs(10);
        let err = loop {
            match rx.peek(&expect(1, 5)) {
                Err(e) => break e,
                Ok(None) => assert!(Instant::now() < deadline, "no abort seen"),
                Ok(Some(_)) => panic!("a frame after the abort"),
            }
        };
        assert_eq!(err, LinkError::PeerAborted("rank 0 gives up".into()));

        // The receiver aborts: the sender's health check reads the reason back.
        let (mut tx, mut rx) = edge(2, 2, 64);
        rx.abort("rank 1 saw bad data");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match tx.health() {
                Err(e) => {
                    assert_eq!(e, LinkError::PeerAborted("rank 1 saw bad data".into()));
                    break;
                }
                Ok(()) => assert!(Instant::now() < deadline, "no abort seen"),
            }
            std::thread::sleep(Duration::from_millis(1));
        }

        // One connection of the edge closes mid-run: the error names it.
        let (mut tx, mut rx) = edge(3, 2, 64);
        tx.wires[1].s.shutdown(std::net::Shutdown::Both).unwrap();
        tx.reserve(5).unwrap().unwrap().fill(1);
        tx.post(&FrameHeader::data(7, 0, 0, fp(5), 5)).unwrap();
        assert_eq!(receive(&mut tx, &mut rx, 0, 5), vec![1; 5]);
        let deadline = Instant::now() + Duration::from_secs(10);
        let err = loop {
            match rx.peek(&expect(1, 5)) {
                Err(e) => break e,
                Ok(None) => assert!(
                    Instant::now() < deadline,
                    "the closed connection went unseen"
                ),
                Ok(Some(_)) => panic!("a frame that was never sent"),
            }
        };
        assert!(
            matches!(&err, LinkError::Lost(d) if d.contains("connection 2 of 3")),
            "{err:?}"
        );
    }
}
