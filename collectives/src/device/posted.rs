//! Posted point-to-point calls on device buffers: how [`DeviceComm::send_async`](crate::NonBlocking::send_async),
//! `recv_async` and `send_recv_async` run.
//!
//! Queued one after another on the proxy thread, `recv_async(prev)` then `send_async(next)`
//! around a ring would wait until the deadline (every rank's receive waits for a send queued
//! behind its neighbour's own receive), as would two ranks that each post a send larger than
//! the peer's slots before their receives. So, as on the host (`comm/posted.rs`), a run of
//! posted calls at the front of the proxy's queue is one *session*: every message joins a queue
//! per peer and direction as it is posted, and each direction of each pair moves as its link
//! allows ([`device_engine::step_one_way`]: a send's slice while a slot at the peer is free, a
//! receive's while its frame is there, the work queued on the stream and its frame published or
//! slot released once its marker completes). A call's `Work` completes once the device work of
//! its messages has completed. A collective queued behind them waits for the session to end,
//! which it does once nothing is queued behind it, every message has moved and every link has
//! flushed. Any error fails the communicator and every call of the session.
//!
//! A pair not yet connected connects *within* the session, never waiting on the peer's turn:
//! its receive FIFO is opened (a tcp edge starts accepting at once), the connect infos are
//! traded over the host communicator's links as posted host calls (on a worker of their own,
//! [`crate::comm::HostPoster`]), then this rank attaches to the peer's FIFO (which exists, or
//! whose accept runs, since the peer sent its info), the accept is collected once it has ended,
//! and a last posted exchange tells each side that the other has attached (so that neither
//! leaves, removing a FIFO, before its peer has opened it). Meanwhile the session moves every
//! other pair's messages, so first calls that form a cycle meet too.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use ringzero_kernels::DType;

use super::core::{Core, DevMsg, DevPair, DevPosted, Rx};
use super::pairs::{read_record, RECORD_BYTES};
use crate::comm::P2pOwned;
use crate::error::{Error, Result};
use crate::ring::call::{expect, gone_unneeded, link_err, op_timeout, Call};
use crate::ring::device_engine::{self, DevBufs, Inflight};
use crate::ring::engine::{Patience, Tick};
use crate::ring::{plan_p2p, Collective, Plan};
use crate::topology::Edge;
use crate::transport::device::{DevPtr, DevSendLink};
use crate::transport::wait::Waiter;
use crate::wire::Fingerprint;
use crate::work::{Feed, PostedJob, Ticket, Work};
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
            raw.push(DevMsg {
                send,
                peer,
                addr,
                dtype: b.dtype(),
                elems: b.elems(),
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
            move |first, ticket, feed| core.run_posted(first, ticket, feed),
        )
    }
}

/// One direction of one message in a session: its job, its one-way plan and where it is.
struct Msg {
    job: usize,
    send: bool,
    dtype: DType,
    plan: Plan,
    seq: u64,
    addr: DevPtr,
    elems: usize,
    at: usize,
    what: String,
}

impl Msg {
    /// Its tag in the pair's [`Inflight`] work: the direction and its number there.
    fn tag(&self) -> u64 {
        (self.seq << 1) | u64::from(self.send)
    }

    fn fp(&self) -> Fingerprint {
        Fingerprint::new(Collective::SendRecv, Some(self.dtype), None, self.elems)
    }

    /// The user's buffer as the engine sees it: the input of a send, the output of a receive.
    fn bufs(&self) -> DevBufs {
        let bytes = self.elems * self.dtype.size();
        let (input, input_bytes, output, output_bytes) = if self.send {
            (self.addr, bytes, 0, 0)
        } else {
            (0, 0, self.addr, bytes)
        };
        DevBufs::Split {
            input,
            input_bytes,
            output,
            output_bytes,
        }
    }
}

/// One peer's messages in a session, each direction in order.
#[derive(Default)]
struct Flow {
    sends: VecDeque<Msg>,
    recvs: VecDeque<Msg>,
}

/// How far a pair connecting in a session has come.
enum Phase {
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
        pair: DevPair,
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

/// The state of one session.
struct Session<M> {
    jobs: Vec<PostedJob>,
    flows: BTreeMap<usize, Flow>,
    connecting: BTreeMap<usize, Phase>,
    /// Each pair's device work queued and not yet retired.
    inflight: BTreeMap<usize, Inflight<M>>,
    /// Pairs whose links carried something in this session (flushed before it ends), each with
    /// the name its errors carry when no message of it is at fault.
    used: BTreeMap<usize, String>,
}

impl<M> Default for Session<M> {
    fn default() -> Self {
        Session {
            jobs: Vec::new(),
            flows: BTreeMap::new(),
            connecting: BTreeMap::new(),
            inflight: BTreeMap::new(),
            used: BTreeMap::new(),
        }
    }
}

type Pairs = BTreeMap<usize, DevPair>;

impl<S: Stream> Core<S> {
    /// Run a session that starts with `first` and takes each posted call queued behind it
    /// (see the module docs).
    pub(super) fn run_posted(
        self: &Arc<Self>,
        first: DevPosted,
        ticket: Ticket,
        feed: &Feed<DevPosted>,
    ) {
        let dtype = first.msgs.first().map(|m| m.dtype);
        let fp = Fingerprint::new(Collective::SendRecv, dtype, None, 0);
        let mut st = self.lock();
        if let Err(e) = crate::ring::failure::refuse(st.failed.as_ref(), &self.abort, &fp, st.seq) {
            (first.fill)(Err(e));
            return;
        }
        let mut pairs = self.pairs.lock().unwrap_or_else(|p| p.into_inner());
        let mut s = Session::default();
        let r = self
            .take(&mut s, &pairs, first, ticket)
            .and_then(|()| self.drive(&mut s, &mut pairs, feed));
        drop(pairs);
        if let Err(e) = r {
            // Work queued before the error still touches the callers' buffers and the slots:
            // it ends before the buffers go back (within the deadline where the device keeps
            // its memory alive).
            if let Ok(m) = self.stream.mark() {
                super::settle::settle(&self.stream, &m, self.cfg.timeout);
            }
            self.fail(&mut st, &e);
            for job in &mut s.jobs {
                job.finish(Err(e.clone()));
            }
        }
    }

    /// Move the session's messages until none is left and nothing is queued behind it.
    fn drive(
        &self,
        s: &mut Session<S::Marker>,
        pairs: &mut Pairs,
        feed: &Feed<DevPosted>,
    ) -> Result<()> {
        let mut patience = Patience::new(Instant::now());
        let mut waiter = Waiter::device();
        loop {
            let mut moved = false;
            while let Some((p, t)) = feed.next() {
                self.take(s, pairs, p, t)?;
                moved = true;
            }
            moved |= self.advance_connects(s, pairs)?;
            moved |= self.step(s, pairs)?;
            if s.flows.is_empty() && s.connecting.is_empty() && self.settled(s, pairs) {
                // Done unless a call was queued meanwhile.
                match feed.next() {
                    Some((p, t)) => self.take(s, pairs, p, t)?,
                    None => return Ok(()),
                }
                continue;
            }
            match patience.tick(Instant::now(), moved, self.cfg.timeout) {
                Tick::Moved => {
                    waiter.progressed();
                    continue;
                }
                // A pair still connecting ends by its own deadlines (the host exchange's, the
                // accept's).
                Tick::TimedOut if s.connecting.is_empty() => return Err(self.stuck(s, pairs)),
                Tick::TimedOut => patience = Patience::new(Instant::now()),
                Tick::Check => self.check(s, pairs)?,
                Tick::Idle => {}
            }
            waiter.idle(self.cfg.timeout);
        }
    }

    /// Whether every pair used in the session has retired its work and flushed its frames.
    fn settled(&self, s: &Session<S::Marker>, pairs: &mut Pairs) -> bool {
        s.used.keys().all(|p| {
            s.inflight.get(p).is_none_or(Inflight::is_empty)
                && pairs.get_mut(p).is_none_or(|pair| pair.links.tx.flushed())
        })
    }

    /// Take posted call `p` into the session: number each message in its direction, queue it on
    /// its peer's flow, and start connecting a peer this rank has no pair with yet.
    fn take(
        &self,
        s: &mut Session<S::Marker>,
        pairs: &Pairs,
        p: DevPosted,
        ticket: Ticket,
    ) -> Result<()> {
        let job = s.jobs.len();
        s.jobs.push(PostedJob::new(p.msgs.len(), p.fill, ticket));
        for m in p.msgs {
            let slice_elems = (self.slot_bytes() / m.dtype.size()).max(1);
            if !pairs.contains_key(&m.peer) && !s.connecting.contains_key(&m.peer) {
                let c = self.start_connect(m.peer)?;
                s.connecting.insert(m.peer, c);
            }
            // A pair connecting in this session has carried nothing yet.
            let (sent, received) = pairs.get(&m.peer).map_or((0, 0), |p| (p.sent, p.received));
            // Numbered after the messages already queued for the peer in this session.
            let flow = s.flows.entry(m.peer).or_default();
            let queued = |q: &VecDeque<Msg>| q.back().map(|b| b.seq + 1);
            let seq = if m.send {
                queued(&flow.sends).unwrap_or(sent)
            } else {
                queued(&flow.recvs).unwrap_or(received)
            };
            let msg = Msg {
                job,
                send: m.send,
                dtype: m.dtype,
                plan: plan_p2p(
                    m.send.then_some(m.elems),
                    (!m.send).then_some(m.elems),
                    slice_elems,
                ),
                seq,
                addr: m.addr,
                elems: m.elems,
                at: 0,
                what: String::new(),
            };
            let what = format!(
                "{} {} rank {}",
                msg.fp(),
                if m.send { "to" } else { "from" },
                m.peer
            );
            let msg = Msg { what, ..msg };
            self.flight.p2p_started(&[(m.peer, m.send, seq, msg.fp())]);
            self.with_call(&msg, |call| device_engine::check_sizes(call, &msg.bufs()))?;
            if m.send {
                flow.sends.push_back(msg);
            } else {
                flow.recvs.push_back(msg);
            }
        }
        Ok(())
    }

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
    fn advance_connects(&self, s: &mut Session<S::Marker>, pairs: &mut Pairs) -> Result<bool> {
        let mut moved = false;
        for peer in s.connecting.keys().copied().collect::<Vec<_>>() {
            let phase = s.connecting.remove(&peer).expect("listed above");
            match self.advance(peer, phase)? {
                Advanced::Same(p) => {
                    s.connecting.insert(peer, p);
                }
                Advanced::Next(p) => {
                    s.connecting.insert(peer, p);
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
                Advanced::Next(Phase::Confirming { pair, work })
            }
            Phase::Confirming { pair, work } if work.is_done() => {
                work.wait()?;
                Advanced::Joined(pair)
            }
            waiting => Advanced::Same(waiting),
        })
    }

    /// Move what can move on every connected peer's flows, finishing the calls whose messages'
    /// work has completed; whether anything moved.
    fn step(&self, s: &mut Session<S::Marker>, pairs: &mut Pairs) -> Result<bool> {
        let mut moved = false;
        let Session {
            jobs,
            flows,
            inflight,
            used,
            ..
        } = s;
        for (peer, flow) in flows.iter_mut() {
            let Some(pair) = pairs.get_mut(peer) else {
                continue; // still connecting
            };
            used.entry(*peer)
                .or_insert_with(|| format!("send_recv with rank {peer}"));
            let work = inflight.entry(*peer).or_default();
            for queue in [&mut flow.sends, &mut flow.recvs] {
                while let Some(m) = queue.front_mut() {
                    if m.at < m.plan.ops.len() {
                        let (tag, bufs, mut at) = (m.tag(), m.bufs(), m.at);
                        // SAFETY: the message's buffer is owned by its job's `Work` filler
                        // (checked against the plan at `take`), which is not filled until this
                        // message's work has completed (`holds` below); the stream is this
                        // communicator's, whose memory the buffer is.
                        let r = self.with_call(m, |call| unsafe {
                            device_engine::step_one_way(
                                &self.stream,
                                &mut pair.links,
                                call,
                                &bufs,
                                &mut at,
                                (&mut *work, tag),
                                &m.what,
                            )
                        });
                        m.at = at;
                        moved |= r?;
                    }
                    moved |= work.retire(&self.stream, &mut pair.links, &m.what, self.rank)?;
                    if m.at < m.plan.ops.len() || work.holds(m.tag()) {
                        break;
                    }
                    if m.send {
                        pair.sent = m.seq + 1;
                    } else {
                        pair.received = m.seq + 1;
                    }
                    self.flight.p2p_finished([(*peer, m.send, m.seq)]);
                    jobs[m.job].one_done();
                    queue.pop_front();
                }
            }
        }
        flows.retain(|_, f| !f.sends.is_empty() || !f.recvs.is_empty());
        // Pairs whose messages are all queued still retire their work and push out frames.
        for (peer, what) in used.iter() {
            let pair = pairs.get_mut(peer).expect("a used pair is connected");
            if let Some(work) = inflight.get_mut(peer) {
                moved |= work.retire(&self.stream, &mut pair.links, what, self.rank)?;
            }
            moved |= pair
                .links
                .tx
                .progress()
                .map_err(|e| link_err(e, what, pair.sent, *peer, self.rank, None))?;
        }
        Ok(moved)
    }

    /// The abort flag, and the health of every connected peer a message or unfinished work
    /// still needs. A failure seen on a direction with no message waiting (a peer's abort) is
    /// named after the session's first waiting message, which it stops.
    fn check(&self, s: &mut Session<S::Marker>, pairs: &mut Pairs) -> Result<()> {
        let first = s
            .flows
            .values()
            .find_map(|f| f.recvs.front().or(f.sends.front()));
        let name = |m: Option<&Msg>, peer: usize, done: u64| match m.or(first) {
            Some(m) => (m.what.clone(), m.seq),
            None => (format!("send_recv with rank {peer}"), done),
        };
        if let Some(reason) = self.abort.reason() {
            let (op, seq) = name(None, self.rank, 0);
            return Err(Error::Aborted { op, seq, reason });
        }
        for peer in s.used.keys().copied().collect::<Vec<_>>() {
            let pair = pairs.get_mut(&peer).expect("a used pair is connected");
            // The first message each way that still needs the link (one whose ops are all
            // queued only waits for this rank's device).
            let flow = s.flows.get(&peer);
            let recv = flow.and_then(|f| f.recvs.iter().find(|m| m.at < m.plan.ops.len()));
            let send = flow.and_then(|f| f.sends.iter().find(|m| m.at < m.plan.ops.len()));
            let posting = s.inflight.get(&peer).is_some_and(Inflight::posting);
            let rx = pair.links.rx.health();
            if !gone_unneeded(&rx, recv.is_some()) {
                let (what, seq) = name(recv, peer, pair.received);
                rx.map_err(|e| link_err(e, &what, seq, peer, self.rank, None))?;
            }
            let tx = pair.links.tx.health();
            let needed = send.is_some() || posting || !pair.links.tx.flushed();
            if !gone_unneeded(&tx, needed) {
                let (what, seq) = name(send, peer, pair.sent);
                tx.map_err(|e| link_err(e, &what, seq, peer, self.rank, None))?;
            }
        }
        Ok(())
    }

    /// The timeout of the session's first waiting message (a receive before a send), or of the
    /// device work or frames it waits for: nothing moved for the whole timeout.
    fn stuck(&self, s: &Session<S::Marker>, pairs: &Pairs) -> Error {
        let waiting = s.flows.iter().find_map(|(peer, f)| {
            let pair = pairs.get(peer)?;
            f.recvs
                .front()
                .or_else(|| f.sends.front())
                .filter(|m| m.at < m.plan.ops.len())
                .map(|m| (pair, m))
        });
        if let Some((pair, m)) = waiting {
            return self.with_call(m, |call| {
                let op = &call.plan.ops[m.at];
                let e = expect(call, op, call.dtype.size());
                op_timeout(
                    call,
                    &m.what,
                    &e,
                    op.send,
                    pair.links.prev,
                    pair.links.next,
                    "device slot",
                )
            });
        }
        let peer = s.used.keys().next().copied().unwrap_or(self.rank);
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

    /// `f` on message `m`'s one-way call: a send numbered in its direction, a receive expecting
    /// the peer's message of that number.
    fn with_call<R>(&self, m: &Msg, f: impl FnOnce(&Call) -> R) -> R {
        let fp = m.fp();
        let call = self.pair_call(
            &m.plan,
            (fp, m.seq),
            m.dtype,
            (!m.send).then_some((m.seq, fp)),
        );
        f(&call)
    }
}
