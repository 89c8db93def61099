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

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, SockRef, Socket, Type};

use super::{LinkError, LinkResult, RecvLink, SendLink, TransportKind};
use crate::bootstrap::gate::{refuse_flooded, Gate, HANDSHAKE_DEADLINE};
use crate::bootstrap::handshake::{self, Identity, Role};
use crate::error::{Error, Result};

mod recv;
mod send;

pub use recv::TcpRecv;
pub use send::TcpSend;

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
                let theirs = match handshake::client(&mut s, me, role, &who, timeout) {
                    // A listener busy with other callers' handshakes: try again.
                    Err(e) if handshake::is_turned_away(&e) && Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(20));
                        continue;
                    }
                    r => r?,
                };
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
    type Accepted = (
        Result<(TcpStream, std::io::Result<(usize, usize)>)>,
        SocketAddr,
    );
    let (done_tx, done_rx) = std::sync::mpsc::channel::<Accepted>();
    let mut refused = Vec::new();
    let mut got: Vec<Option<TcpStream>> = (0..count).map(|_| None).collect();
    let mut open = 0;
    let gate = Gate::default();
    loop {
        match l.accept() {
            Ok((s, from)) => {
                let Some(permit) = gate.admit() else {
                    refuse_flooded(from, "data listener");
                    continue;
                };
                let (secret, job, done) = (secret.clone(), job.clone(), done_tx.clone());
                let hs_timeout = timeout.min(HANDSHAKE_DEADLINE);
                std::thread::spawn(move || {
                    let _permit = permit;
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
                            let intro = match wires {
                                None => Ok((0, 1)),
                                Some(_) => read_intro(&mut s, hs_timeout),
                            };
                            Ok((s, intro))
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
                    let (i, theirs) = intro.map_err(|e| {
                        bad(format!(
                            "reading which of the edge's connections this is: {e}"
                        ))
                    })?;
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

/// Open a connection of an edge with its place among the edge's connections: index and count,
/// two little-endian u16 (see [`connect_wires`]).
pub fn write_intro(s: &mut TcpStream, index: usize, count: usize) -> std::io::Result<()> {
    let mut intro = [0u8; 4];
    intro[..2].copy_from_slice(&(index as u16).to_le_bytes());
    intro[2..].copy_from_slice(&(count as u16).to_le_bytes());
    s.write_all(&intro)
}

/// Read what [`write_intro`] wrote, waiting at most `timeout`: (index, count).
pub fn read_intro(s: &mut TcpStream, timeout: Duration) -> std::io::Result<(usize, usize)> {
    let mut intro = [0u8; 4];
    s.set_read_timeout(Some(timeout.max(Duration::from_millis(1))))?;
    s.read_exact(&mut intro)?;
    s.set_read_timeout(None)?;
    Ok((
        u16::from_le_bytes([intro[0], intro[1]]) as usize,
        u16::from_le_bytes([intro[2], intro[3]]) as usize,
    ))
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
            write_intro(&mut s, i, count).map_err(|e| {
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

/// The peer's address for messages, refusing an edge of no connections.
fn peer_address(streams: &[TcpStream]) -> Result<String> {
    let first = streams
        .first()
        .ok_or_else(|| Error::config("tcp_sockets", "an edge needs at least one connection"))?;
    Ok(first.peer_addr().map(|a| a.to_string()).unwrap_or_default())
}

fn into_mio(s: TcpStream) -> Result<mio::net::TcpStream> {
    s.set_nonblocking(true)
        .map_err(|e| Error::io("making a data socket non-blocking", e))?;
    Ok(mio::net::TcpStream::from_std(s))
}

/// Payloads are split into parts of at least this many bytes, one per connection: a frame of up
/// to this size travels whole on one connection (one write, one read: small calls cost what they
/// cost over one connection), a slice-sized one (512 KiB by default) on up to 8. NCCL's socket
/// transport splits its requests over sockets with the same floor.
pub const MIN_PART: usize = 64 << 10;

/// How a payload of `len` bytes is striped over `wires` connections: part `i` (on wire `i`) is
/// the returned range; the first part travels after the frame's header on wire 0. Both ends
/// compute it from the header's length. A frame always has part 0 (it carries the header).
pub fn parts(len: usize, wires: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let n = len.div_ceil(MIN_PART).clamp(1, wires.max(1));
    let each = len.div_ceil(n);
    (0..n).map(move |i| (i * each).min(len)..((i + 1) * each).min(len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::Collective;
    use crate::wire::{Expect, Fingerprint, FrameHeader, HEADER_LEN};

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
    fn parts_cover_the_payload_and_small_frames_use_fewer_connections() {
        let split = |len, k| parts(len, k).collect::<Vec<_>>();
        assert_eq!(split(0, 4), vec![0..0]);
        assert_eq!(split(100, 4), vec![0..100]);
        assert_eq!(split(MIN_PART, 4), vec![0..MIN_PART]);
        let half = MIN_PART / 2 + 1;
        assert_eq!(split(MIN_PART + 1, 4), [0..half, half..MIN_PART + 1]);
        for (len, k) in [
            (512 << 10, 4),
            (12_289, 3),
            (1 << 20, 32),
            (5 * MIN_PART, 8),
        ] {
            let p = split(len, k);
            assert!(p.len() <= k && p[0].start == 0 && p.last().unwrap().end == len);
            assert!(p
                .windows(2)
                .all(|w| w[0].end == w[1].start && !w[1].is_empty()));
        }
        assert_eq!(split(512 << 10, 4).len(), 4);
    }

    #[test]
    fn frames_striped_over_several_connections_arrive_whole_and_in_order() {
        let (mut tx, mut rx) = edge(3, 2, 3 * MIN_PART + 5);
        assert_eq!((tx.wires(), rx.wires()), (3, 3));
        // One part, two, three; empty frames carry only a header.
        let len_of = |step: u32| {
            [1, 3 * MIN_PART + 5, 0, 2 * MIN_PART, MIN_PART + 1, 100][step as usize % 6]
        };
        for step in 0..12u32 {
            let len = len_of(step);
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
            if step % 2 == 1 {
                // Two frames in flight at once before reading.
                for s in [step - 1, step] {
                    assert_eq!(
                        receive(&mut tx, &mut rx, s, len_of(s)),
                        pattern(s, len_of(s))
                    );
                }
            }
        }
        assert!(tx.flushed());
    }

    /// Drive `tx` and read frame `step` straight into a buffer of `len` bytes until it arrives
    /// (bounded).
    fn receive_into(tx: &mut TcpSend, rx: &mut TcpRecv, step: u32, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            tx.progress().unwrap();
            if rx.recv_into(&expect(step, len), &mut out).unwrap() {
                return out;
            }
            assert!(Instant::now() < deadline, "frame {step} never arrived");
        }
    }

    #[test]
    fn frames_written_from_the_callers_buffer_arrive_into_the_callers_buffer() {
        // Frames larger than the sockets take at once: part leaves straight from the caller's
        // buffer, the rest through the slot; a second frame posted behind a queued one waits
        // its turn. The receiver reads them straight into its buffer, or out of the slot where
        // a peek began the frame.
        let big = 6 << 20;
        for wires in [1, 3] {
            let (mut tx, mut rx) = edge(wires, 2, big);
            // Small socket buffers: a big frame cannot leave in one write.
            for w in &tx.wires {
                SockRef::from(&w.s).set_send_buffer_size(64 << 10).unwrap();
            }
            for s in &rx.wires {
                SockRef::from(s).set_recv_buffer_size(64 << 10).unwrap();
            }
            let mut queued = 0;
            let lens = [big, 1, big, 0, 3 * MIN_PART + 5, big / 2 + 3];
            for (pair, two) in lens.chunks(2).enumerate() {
                let steps = [2 * pair as u32, 2 * pair as u32 + 1];
                for (&step, &len) in steps.iter().zip(two) {
                    let deadline = Instant::now() + Duration::from_secs(10);
                    while tx.reserve(len).unwrap().is_none() {
                        tx.progress().unwrap();
                        assert!(Instant::now() < deadline);
                    }
                    let h = FrameHeader::data(7, step, 0, fp(len), len);
                    tx.post_from(&h, &pattern(step, len)).unwrap();
                    queued += usize::from(!tx.flushed());
                }
                if pair == 1 {
                    // A peek takes the frame's first bytes into the slot: recv_into finishes
                    // it there and copies it out.
                    let _ = rx.peek(&expect(steps[0], two[0])).unwrap();
                }
                for (&step, &len) in steps.iter().zip(two) {
                    let got = receive_into(&mut tx, &mut rx, step, len);
                    assert!(got == pattern(step, len), "frame {step} of {len} bytes");
                }
            }
            assert!(
                queued >= 3,
                "only {queued} frames left part of them to the slot"
            );
            let deadline = Instant::now() + Duration::from_secs(10);
            while !tx.flushed() {
                tx.progress().unwrap();
                assert!(Instant::now() < deadline);
            }
            // An abort read by recv_into fails the link with the sender's reason.
            tx.abort("rank 0 stops here");
            let mut out = vec![0u8; big];
            let deadline = Instant::now() + Duration::from_secs(10);
            let err = loop {
                match rx.recv_into(&expect(9, big), &mut out) {
                    Err(e) => break e,
                    Ok(false) => assert!(Instant::now() < deadline, "no abort seen"),
                    Ok(true) => panic!("a frame after the abort"),
                }
            };
            assert_eq!(err, LinkError::PeerAborted("rank 0 stops here".into()));
        }
    }

    /// Read what `s` has (without blocking) onto `out`.
    fn drain(s: &mut mio::net::TcpStream, out: &mut Vec<u8>) {
        let mut buf = vec![0u8; 1 << 20];
        loop {
            match s.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => out.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) => panic!("{e}"),
            }
        }
    }

    #[test]
    fn a_slot_freed_while_another_frame_is_still_writing_is_the_one_reused() {
        // A large frame's second part is held back (nobody reads connection 2; the part is
        // larger than the sockets' buffers) while a small frame behind its first part leaves: the
        // small frame's slot comes free first and must be the one reused.
        let big = 48 << 20;
        let (mut tx, mut rx) = edge(2, 2, big);
        let first = pattern(0, big);
        tx.reserve(big).unwrap().unwrap().copy_from_slice(&first);
        tx.post(&FrameHeader::data(7, 0, 0, fp(big), big)).unwrap();
        tx.reserve(10)
            .unwrap()
            .unwrap()
            .copy_from_slice(&pattern(1, 10));
        tx.post(&FrameHeader::data(7, 1, 0, fp(10), 10)).unwrap();
        let mut wire0 = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        while tx.reserve(10).unwrap().is_none() {
            tx.progress().unwrap();
            drain(&mut rx.wires[0], &mut wire0);
            assert!(Instant::now() < deadline, "the small frame never left");
        }
        assert!(
            !tx.flushed(),
            "the large frame's second part should still be waiting"
        );
        assert_eq!(tx.reserved.map(|(slot, _)| slot), Some(1));
        tx.reserve(big).unwrap().unwrap().fill(0xEE);
        let mut wire1 = Vec::new();
        let half = big / 2;
        while !tx.flushed() || wire1.len() < half {
            tx.progress().unwrap();
            drain(&mut rx.wires[1], &mut wire1);
            assert!(Instant::now() < deadline, "the second part never left");
        }
        drain(&mut rx.wires[0], &mut wire0);
        assert!(
            wire1 == first[half..],
            "the large frame's second part was overwritten"
        );
        let h0: [u8; HEADER_LEN] = bytemuck::cast(FrameHeader::data(7, 0, 0, fp(big), big));
        let h1: [u8; HEADER_LEN] = bytemuck::cast(FrameHeader::data(7, 1, 0, fp(10), 10));
        let want0 = [&h0[..], &first[..half], &h1[..], &pattern(1, 10)].concat();
        assert!(wire0 == want0, "connection 1 carried something else");
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
        let len = 3 * MIN_PART;
        let (mut tx, mut rx) = edge(3, 2, len);
        tx.reserve(5).unwrap().unwrap().fill(1);
        tx.post(&FrameHeader::data(7, 0, 0, fp(5), 5)).unwrap();
        assert_eq!(receive(&mut tx, &mut rx, 0, 5), vec![1; 5]);
        tx.wires[1].s.shutdown(std::net::Shutdown::Both).unwrap();
        tx.reserve(len).unwrap().unwrap().fill(2);
        tx.post(&FrameHeader::data(7, 1, 0, fp(len), len)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let err = loop {
            let _ = tx.progress();
            match rx.peek(&expect(1, len)) {
                Err(e) => break e,
                Ok(None) => assert!(
                    Instant::now() < deadline,
                    "the closed connection went unseen"
                ),
                Ok(Some(_)) => panic!("a frame with a part missing"),
            }
        };
        assert!(
            matches!(&err, LinkError::Lost(d) if d.contains("connection 2 of 3")),
            "{err:?}"
        );
    }
}
