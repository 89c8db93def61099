//! Posted point-to-point calls on device buffers: the device's [`PairKind`] for the session
//! that runs [`DeviceComm::send_async`](crate::NonBlocking::send_async), `recv_async` and
//! `send_recv_async` (the session itself is `crate::posted`).
//!
//! A message's ops are queued on the stream as its link allows
//! ([`device_engine::step_one_way`]: a send's slice while a slot at the peer is free, a receive's
//! while its frame is there), and its frame is published or slot released once its marker
//! completes; a call's `Work` completes once the device work of its messages has completed. A pair
//! used in the session has settled once its work is retired and its link flushed.
//!
//! A pair not yet connected connects *within* the session, never waiting on the peer's turn:
//! its receive FIFO is opened (a tcp edge starts accepting at once), the connect infos are
//! traded over the host communicator's links as posted host calls (on a worker of their own,
//! [`crate::comm::HostPoster`]), then this rank attaches to the peer's FIFO (which exists, or
//! whose accept runs, since the peer sent its info), the accept is collected once it has ended,
//! and a last posted exchange tells each side that the other has attached (so that neither
//! leaves, removing a FIFO, before its peer has opened it).

use std::collections::BTreeMap;
use std::sync::MutexGuard;

use ringzero_kernels::DType;

use super::core::{Core, DevPair, DevPosted, Rx};
use super::pairs::{read_record, RECORD_BYTES};
use crate::comm::P2pOwned;
use crate::error::{Error, Result};
use crate::posted::{Common, Connects, Msg, PairKind, Request};
use crate::ring::call::{expect, link_err, op_timeout, Call};
use crate::ring::device_engine::{self, DevBufs, Inflight};
use crate::topology::Edge;
use crate::transport::device::{DevPtr, DevSendLink};
use crate::transport::wait::Waiter;
use crate::transport::LinkResult;
use crate::wire::Fingerprint;
use crate::work::Work;
use ringzero_kernels::device::Stream;

use super::{DeviceComm, DeviceMemory};

impl<S: Stream + 'static> DeviceComm<S> {
    /// Post a point-to-point call of `msgs` (a send or not, the peer, the buffer; peers checked
    /// by the caller) on the proxy thread (see the module docs); its `Work` gives back
    /// `finish` of the buffers, in the order given, once every message has moved.
    pub(super) fn post_p2p<B, R>(
        &self,
        msgs: Vec<(bool, usize, B)>,
        finish: impl FnOnce(Vec<B>) -> R + Send + 'static,
    ) -> Work<R>
    where
        B: DeviceMemory<S> + Send + 'static,
        R: Send + 'static,
    {
        let stream = self.stream();
        // Boxed first, so that the addresses taken here stay where the buffers are however the
        // boxes move (into the filler, to the proxy thread, back to the caller).
        let mut bufs: Vec<Box<B>> = Vec::with_capacity(msgs.len());
        let mut raw = Vec::with_capacity(msgs.len());
        for (send, peer, b) in msgs {
            let mut b = Box::new(b);
            let addr = if send {
                b.addr(stream)
            } else {
                b.addr_mut(stream)
            };
            raw.push(Request {
                send,
                peer,
                dtype: b.dtype(),
                elems: b.elems(),
                buf: addr,
            });
            bufs.push(b);
        }
        let core = self.core_arc();
        self.worker().post(
            move |fill| DevPosted {
                msgs: raw,
                fill: Box::new(move |r| {
                    fill(r.map(|()| finish(bufs.into_iter().map(|b| *b).collect())))
                }),
            },
            move |first, ticket, feed| crate::posted::run(&*core, first, ticket, feed),
        )
    }
}

/// How far a pair connecting in a session has come.
pub(super) enum Phase {
    /// This rank's receive FIFO is open; the two records are being traded.
    Trading {
        rx: Rx,
        edge: Edge,
        work: Work<Vec<P2pOwned<u8>>>,
    },
    /// Attached to the peer's FIFO; a tcp edge's accept may still be running.
    Accepting {
        rx: Rx,
        edge: Edge,
        tx: Box<dyn DevSendLink>,
        send: (crate::transport::TransportKind, usize, String),
    },
    /// Both ends open here; each side tells the other.
    Confirming {
        // Boxed: a pair is several times the other phases' size.
        pair: Box<DevPair>,
        work: Work<Vec<P2pOwned<u8>>>,
    },
}

/// What [`Core::advance`] made of a connecting pair's phase.
enum Advanced {
    /// It cannot move now.
    Same(Phase),
    /// It moved on to this phase.
    Next(Phase),
    /// Both sides are done: the pair is ready.
    Joined(DevPair),
}

/// Message `m`'s buffer as the engine sees it: the input of a send, the output of a receive.
fn dev_bufs(m: &Msg<DevPtr>) -> DevBufs {
    let bytes = m.elems * m.dtype.size();
    let (input, input_bytes, output, output_bytes) = if m.send {
        (m.buf, bytes, 0, 0)
    } else {
        (0, 0, m.buf, bytes)
    };
    DevBufs::Split {
        input,
        input_bytes,
        output,
        output_bytes,
    }
}

impl<S: Stream> Core<S> {
    /// Open the receive FIFO from `peer` and post the trade of connect records.
    fn start_connect(&self, peer: usize) -> Result<Phase> {
        let (host, poster) = self
            .host
            .as_ref()
            .zip(self.poster.as_ref())
            .ok_or_else(|| Error::Protocol {
                peer: format!("rank {peer}"),
                detail: "a one-rank device communicator has no peers".into(),
            })?;
        let (rx, edge, record) = self.open_pair(host, peer)?;
        let work = poster.post(vec![
            P2pOwned::Send(record, peer),
            P2pOwned::Recv(vec![0u8; RECORD_BYTES], peer),
        ]);
        Ok(Phase::Trading { rx, edge, work })
    }

    /// Take every connecting pair as far as it can go now (see the module docs); whether any
    /// moved. A pair whose last exchange has ended joins `pairs`.
    fn advance_connects(
        &self,
        c: &mut Connects<Phase>,
        pairs: &mut BTreeMap<usize, DevPair>,
    ) -> Result<bool> {
        let mut moved = false;
        for peer in c.pairs.keys().copied().collect::<Vec<_>>() {
            let phase = c.pairs.remove(&peer).expect("listed above");
            match self.advance(peer, phase)? {
                Advanced::Same(p) => {
                    c.pairs.insert(peer, p);
                }
                Advanced::Next(p) => {
                    c.pairs.insert(peer, p);
                    moved = true;
                }
                Advanced::Joined(pair) => {
                    pairs.insert(peer, pair);
                    moved = true;
                }
            }
        }
        Ok(moved)
    }

    /// Take the pair with `peer` from `phase` to the next one if it can go now.
    fn advance(&self, peer: usize, phase: Phase) -> Result<Advanced> {
        let poster = self.poster.as_ref().expect("connecting implies a poster");
        Ok(match phase {
            Phase::Trading { rx, edge, work } if work.is_done() => {
                let theirs = work.wait()?;
                let record = match theirs.as_slice() {
                    [_, P2pOwned::Recv(b, _)] => b,
                    _ => unreachable!("a send and a receive in, the same out"),
                };
                let (info, reason) = read_record(record);
                let (tx, kind) = self.attach_to(&info, peer)?;
                let send = (kind, super::records::sent_sockets(&info, kind), reason);
                Advanced::Next(Phase::Accepting { rx, edge, tx, send })
            }
            Phase::Accepting {
                rx,
                edge,
                tx,
                send: (kind, sockets, reason),
            } if rx.is_ready() => {
                let rx = self.finish_rx(rx, peer)?;
                let links = self.links(tx, rx, peer, peer);
                let pair = self.pair(links, edge, (kind, sockets), reason);
                let work = poster.post(vec![
                    P2pOwned::Send(vec![1u8], peer),
                    P2pOwned::Recv(vec![0u8], peer),
                ]);
                Advanced::Next(Phase::Confirming {
                    pair: Box::new(pair),
                    work,
                })
            }
            Phase::Confirming { pair, work } if work.is_done() => {
                work.wait()?;
                Advanced::Joined(*pair)
            }
            waiting => Advanced::Same(waiting),
        })
    }

    /// Message `m`'s one-way call: a send numbered in its direction, a receive expecting the
    /// peer's message of that number.
    fn msg_call<'a>(&'a self, m: &'a Msg<DevPtr>) -> Call<'a> {
        let fp = m.fp();
        self.pair_call(
            &m.plan,
            (fp, m.seq),
            m.dtype,
            (!m.send).then_some((m.seq, fp)),
        )
    }
}

impl<S: Stream> PairKind for Core<S> {
    type Buf = DevPtr;
    type Pair = DevPair;
    type Connecting = Phase;
    type Work = Inflight<S::Marker>;

    fn common(&self) -> Common<'_> {
        Common {
            rank: self.rank,
            timeout: self.cfg.timeout,
            flight: &self.flight,
            abort: &self.abort,
        }
    }

    fn waiter(&self) -> Waiter {
        Waiter::device()
    }

    fn slice_elems(&self, dtype: DType) -> usize {
        (self.slot_bytes() / dtype.size()).max(1)
    }

    fn pairs(&self) -> MutexGuard<'_, BTreeMap<usize, DevPair>> {
        self.pairs.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn refuse(&self, fp: &Fingerprint) -> Result<()> {
        let st = self.lock();
        crate::ring::failure::refuse(st.failed.as_ref(), &self.abort, fp, st.seq)
    }

    fn failed(&self, e: &Error, _connecting: BTreeMap<usize, Phase>) {
        // Work queued before the error still touches the callers' buffers and the slots: it
        // ends before the buffers go back (within the deadline where the device keeps its
        // memory alive).
        if let Ok(m) = self.stream.mark() {
            super::settle::settle(&self.stream, &m, self.cfg.timeout);
        }
        self.fail(&mut self.lock(), e);
    }

    fn counts(pair: &mut DevPair) -> [&mut u64; 2] {
        [&mut pair.received, &mut pair.sent]
    }

    fn admit(&self, m: &Msg<DevPtr>) -> Result<()> {
        device_engine::check_sizes(&self.msg_call(m), &dev_bufs(m))
    }

    fn connect(&self, peer: usize) -> Result<Phase> {
        self.start_connect(peer)
    }

    fn wanted(_: &mut Phase) {}

    fn connects(
        &self,
        c: &mut Connects<Phase>,
        pairs: &mut BTreeMap<usize, DevPair>,
    ) -> Result<bool> {
        self.advance_connects(c, pairs)
    }

    fn step(
        &self,
        pair: &mut DevPair,
        work: &mut Inflight<S::Marker>,
        m: &mut Msg<DevPtr>,
    ) -> Result<bool> {
        let (tag, bufs, mut at) = (m.tag(), dev_bufs(m), m.at);
        // SAFETY: the message's buffer is owned by its job's `Work` filler (checked against the
        // plan by `admit`), which is not filled until this message's work has completed (the
        // session asks `holds`); the stream is this communicator's, whose memory the buffer is.
        let r = unsafe {
            device_engine::step_one_way(
                &self.stream,
                &mut pair.links,
                &self.msg_call(m),
                &bufs,
                &mut at,
                (work, tag),
                &m.what,
            )
        };
        m.at = at;
        r
    }

    fn holds(work: &Inflight<S::Marker>, m: &Msg<DevPtr>) -> bool {
        work.holds(m.tag())
    }

    fn progress(
        &self,
        peer: usize,
        pair: &mut DevPair,
        work: &mut Inflight<S::Marker>,
        what: &str,
    ) -> Result<bool> {
        let retired = work.retire(&self.stream, &mut pair.links, what, self.rank)?;
        let sent = pair
            .links
            .tx
            .progress()
            .map_err(|e| link_err(e, what, pair.sent, peer, self.rank, None))?;
        Ok(retired | sent)
    }

    fn posting(work: &Inflight<S::Marker>) -> bool {
        work.posting()
    }

    fn settled(pair: &DevPair, work: &Inflight<S::Marker>) -> bool {
        work.is_empty() && pair.links.tx.flushed()
    }

    fn health(pair: &mut DevPair) -> [LinkResult<()>; 2] {
        [pair.links.rx.health(), pair.links.tx.health()]
    }

    fn msg_timeout(&self, pair: &DevPair, m: &Msg<DevPtr>) -> Error {
        let call = self.msg_call(m);
        let op = &call.plan.ops[m.at];
        let e = expect(&call, op, call.dtype.size());
        let (prev, next) = (pair.links.prev, pair.links.next);
        op_timeout(&call, &m.what, &e, op.send, prev, next, "device slot")
    }

    fn settle_timeout(&self, peer: usize) -> Error {
        Error::Timeout {
            op: format!("send_recv with rank {peer}"),
            seq: 0,
            peer,
            waiting: format!(
                "this rank's device ({}) to finish its queued work, or rank {peer} to read \
                 this rank's last frames",
                self.stream.name()
            ),
            after: self.cfg.timeout,
        }
    }
}
