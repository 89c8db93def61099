//! TCP transport: one connection per ring edge, non-blocking, driven by the engine's loop.
//!
//! The sender's "slots" are local staging buffers: the engine reduces straight into one, posts it,
//! and [`SendLink::progress`] writes header and payload with one vectored write per call until the
//! socket would block. The receiver reads the 48-byte header first, checks it against what it
//! expects (before reading or buffering a single payload byte), then reads the payload into its
//! slot. Connection setup uses socket2 (NODELAY, large buffers) and the authenticated handshake;
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
    let deadline = Instant::now() + timeout;
    l.set_nonblocking(true)
        .map_err(|e| Error::io("listener", e))?;
    let secret: std::sync::Arc<[u8]> = me.secret.into();
    let job: std::sync::Arc<str> = me.job_id.into();
    let rank = me.rank;
    let (done_tx, done_rx) = std::sync::mpsc::channel::<(Result<TcpStream>, SocketAddr)>();
    let mut refused = Vec::new();
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
                            Ok(s)
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
                Ok(s) => return Ok(s),
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
            return Err(Error::Timeout {
                op: "connect".into(),
                seq: 0,
                peer,
                waiting: format!("rank {peer} to open its data connection{also}"),
                after: timeout,
            });
        }
        std::thread::sleep(Duration::from_millis(2));
    }
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

/// Sending half over TCP.
pub struct TcpSend {
    s: mio::net::TcpStream,
    peer: usize,
    addr: String,
    slot_bytes: usize,
    slots: usize,
    /// `slots` slots of `slot_bytes`, each starting a multiple of [`STRIDE_ALIGN`] after the
    /// last.
    staging: Aligned,
    queue: VecDeque<Pending>,
    next_slot: usize,
    /// The host engine's one reservation: slot and length.
    reserved: Option<(usize, usize)>,
    /// The device engine's reservations, oldest first (pipelined: filled by queued device work,
    /// posted in order once that work has completed).
    reserved_slots: VecDeque<usize>,
    /// Bytes read back from the peer: the only thing a receiver ever sends is an abort frame.
    back: Vec<u8>,
}

impl TcpSend {
    /// Wrap an authenticated connection to rank `peer`.
    pub fn new(s: TcpStream, peer: usize, slots: usize, slot_bytes: usize) -> Result<TcpSend> {
        let addr = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        Ok(TcpSend {
            s: into_mio(s)?,
            peer,
            addr,
            slot_bytes,
            slots: slots.max(1),
            staging: Aligned::new(slots.max(1) * stride(slot_bytes))?,
            queue: VecDeque::new(),
            back: Vec::new(),
            next_slot: 0,
            reserved: None,
            reserved_slots: VecDeque::new(),
        })
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

    /// Reserve the next slot without its length (the device engine's pipelined send): its index,
    /// or `None` while every slot is reserved or waiting to be written. Posted in order by
    /// [`TcpSend::post_slot`].
    pub fn reserve_slot(&mut self) -> Option<usize> {
        if self.queue.len() + self.reserved_slots.len() >= self.slots {
            return None;
        }
        let slot = self.next_slot;
        self.next_slot = (self.next_slot + 1) % self.slots;
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
        self.queue.push_back(Pending {
            header: bytemuck::cast(*header),
            slot,
            len,
            written: 0,
        });
        Ok(())
    }

    fn lost(&mut self, e: std::io::Error) -> LinkError {
        if let Some(aborted) = self.read_back() {
            return aborted;
        }
        LinkError::Lost(format!(
            "writing to rank {} ({}): {e}",
            self.peer, self.addr
        ))
    }

    /// Read what the peer sent back (without blocking): an abort frame with its reason once it
    /// has fully arrived, garbage as a protocol error, else nothing.
    fn read_back(&mut self) -> Option<LinkError> {
        let mut buf = [0u8; 256];
        while self.back.len() < HEADER_LEN + MAX_ABORT_REASON {
            match self.s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => self.back.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
        }
        if self.back.len() < HEADER_LEN {
            return None;
        }
        let head: [u8; HEADER_LEN] = self.back[..HEADER_LEN].try_into().expect("length checked");
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
        (self.back.len() >= end).then(|| {
            LinkError::PeerAborted(
                String::from_utf8_lossy(&self.back[HEADER_LEN..end]).into_owned(),
            )
        })
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
        if self.queue.len() + self.reserved_slots.len() >= self.slots {
            return Ok(None);
        }
        let slot = self.next_slot;
        self.reserved = Some((slot, len));
        let at = slot * stride(self.slot_bytes);
        Ok(Some(&mut self.staging.bytes_mut()[at..at + len]))
    }

    fn post(&mut self, header: &FrameHeader) -> LinkResult<()> {
        let (slot, len) = self
            .reserved
            .take()
            .ok_or_else(|| LinkError::Io("post without reserve".into()))?;
        self.queue.push_back(Pending {
            header: bytemuck::cast(*header),
            slot,
            len,
            written: 0,
        });
        self.next_slot = (self.next_slot + 1) % self.slots;
        Ok(())
    }

    fn progress(&mut self) -> LinkResult<bool> {
        let mut moved = false;
        while let Some(p) = self.queue.front_mut() {
            let total = HEADER_LEN + p.len;
            let at = p.slot * stride(self.slot_bytes);
            let payload = &self.staging.bytes()[at..at + p.len];
            let r = if p.written < HEADER_LEN {
                self.s
                    .write_vectored(&[IoSlice::new(&p.header[p.written..]), IoSlice::new(payload)])
            } else {
                self.s.write(&payload[p.written - HEADER_LEN..])
            };
            match r {
                Ok(0) => {
                    return Err(LinkError::Lost(format!(
                        "rank {} ({}) stopped reading",
                        self.peer, self.addr
                    )))
                }
                Ok(n) => {
                    moved = true;
                    p.written += n;
                    if p.written == total {
                        self.queue.pop_front();
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(self.lost(e)),
            }
        }
        Ok(moved)
    }

    fn flushed(&self) -> bool {
        self.queue.is_empty()
    }

    fn health(&mut self) -> LinkResult<()> {
        match self.s.take_error() {
            Ok(Some(e)) | Err(e) => Err(self.lost(e)),
            Ok(None) => match self.read_back() {
                Some(e) => Err(e),
                None => Ok(()),
            },
        }
    }

    fn abort(&mut self, reason: &str) {
        // An abort frame can only be sent at a frame boundary; mid-frame, closing says enough.
        if self.queue.is_empty() {
            let r = &reason.as_bytes()[..reason.len().min(MAX_ABORT_REASON)];
            let h: [u8; HEADER_LEN] = bytemuck::cast(FrameHeader::abort(r.len()));
            let _ = self.s.write_vectored(&[IoSlice::new(&h), IoSlice::new(r)]);
        }
        let _ = self.s.shutdown(std::net::Shutdown::Write);
    }

    fn pollable(&mut self) -> Option<&mut mio::net::TcpStream> {
        Some(&mut self.s)
    }
}

/// Receiving half over TCP.
pub struct TcpRecv {
    s: mio::net::TcpStream,
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
        TcpRecv::with_slots(s, peer, 1, slot_bytes)
    }

    /// Wrap a connection with `slots` receive slots (the device engine: frames arrive into the
    /// next free slot while kernels still read the ones before it).
    pub fn with_slots(
        s: TcpStream,
        peer: usize,
        slots: usize,
        slot_bytes: usize,
    ) -> Result<TcpRecv> {
        let addr = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        let (slots, slot_bytes) = (slots.max(1), slot_bytes.max(MAX_ABORT_REASON));
        Ok(TcpRecv {
            s: into_mio(s)?,
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

    fn next_frame(&mut self) {
        self.checked = None;
        self.header_got = 0;
        self.got = 0;
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
            match self.s.read(&mut buf[*got..]) {
                Ok(0) => {
                    return Err(LinkError::Lost(format!(
                        "connection closed by rank {} ({})",
                        self.peer, self.addr
                    )))
                }
                Ok(n) => *got += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(LinkError::Lost(format!(
                        "reading from rank {} ({}): {e}",
                        self.peer, self.addr
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
        match self.s.take_error() {
            Ok(Some(e)) | Err(e) => Err(LinkError::Lost(format!(
                "rank {} ({}): {e}",
                self.peer, self.addr
            ))),
            Ok(None) => Ok(()),
        }
    }

    fn abort(&mut self, reason: &str) {
        // Tell the sender why, on the connection's otherwise unused reverse direction, then stop
        // writing; the connection closes when the link is dropped.
        let r = &reason.as_bytes()[..reason.len().min(MAX_ABORT_REASON)];
        let h: [u8; HEADER_LEN] = bytemuck::cast(FrameHeader::abort(r.len()));
        let _ = self.s.write_vectored(&[IoSlice::new(&h), IoSlice::new(r)]);
        let _ = self.s.shutdown(std::net::Shutdown::Write);
    }

    fn pollable(&mut self) -> Option<&mut mio::net::TcpStream> {
        Some(&mut self.s)
    }
}
