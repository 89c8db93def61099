//! Posted point-to-point calls: how the asynchronous forms ([`Communicator::send_async`](crate::NonBlocking::send_async),
//! `recv_async`, `send_recv_async`, `send_recv_batch_async`) run.
//!
//! A blocking call runs alone, so a rank's calls happen in program order. Queued, that order
//! would make `recv_async(prev)` then `send_async(next)` around a ring wait forever (every rank
//! waits for a send queued behind its own receive), as would two ranks that each post a large
//! send before their receives. So a run of posted calls at the front of the worker's queue is one
//! session (see [`crate::work::Worker`]): every message joins a queue per peer and direction as
//! it is posted, even while earlier ones still move, and each direction of each pair moves as its
//! link allows. A pair not yet connected connects on a thread of its own meanwhile, as does
//! any rank found connecting to this one (its first call may be what this session's wait on),
//! so first calls that form a cycle meet too. Messages to one peer keep their order, as do messages from
//! one, and each is numbered and matched as if sent alone, so the peer may use any form; each
//! call's `Work` completes as soon as its own messages have. A collective queued behind them
//! waits for the session to end, which it does once nothing is queued behind it and every
//! message has moved; any error fails the communicator and every call of the session.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use ringzero_kernels::{DType, Element, ReduceOp};

use super::pairs::{P2pOwned, Pair};
use super::Inner;
use crate::bootstrap::Role;
use crate::connect;
use crate::error::{Error, Result};
use crate::ring::engine::{Bufs, Links, Patience, Tick};
use crate::ring::failure;
use crate::ring::{plan_p2p, Collective, Plan};
use crate::topology::Edge;
use crate::transport::wait::Waiter;
use crate::wire::Fingerprint;
use crate::work::{Feed, PostedJob, Ticket};

#[cfg(doc)]
use super::Communicator;

/// How often a session looks for ranks connecting to this one ([`Inner::serve`]).
const SERVE_EVERY: std::time::Duration = std::time::Duration::from_millis(2);

/// One posted call: its messages, and what fills its `Work` (which owns their buffers).
pub(crate) struct Posted {
    dtype: DType,
    msgs: Vec<RawMsg>,
    fill: Box<dyn FnOnce(Result<()>) + Send>,
}

/// One message of a posted call: a send or a receive, the peer, and its buffer's bytes.
struct RawMsg {
    send: bool,
    peer: usize,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the pointers lead into the buffers that `fill` owns (a `Vec<T>` per message, taken
// from its owner by `Posted::new` and moved into `fill` whole, so their heap memory stays where
// it is); nothing else refers to them, and they travel with `fill` to whichever thread runs the
// call.
unsafe impl Send for Posted {}

impl Posted {
    /// The call on `msgs`; `done` gets its result and the buffers back.
    pub(crate) fn new<T: Element>(
        mut msgs: Vec<P2pOwned<T>>,
        done: impl FnOnce(Result<()>, Vec<P2pOwned<T>>) + Send + 'static,
    ) -> Posted {
        let raw = msgs
            .iter_mut()
            .map(|m| {
                let (send, peer) = m.peer();
                let buf = match m {
                    P2pOwned::Send(b, _) | P2pOwned::Recv(b, _) => b,
                };
                let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf.as_mut_slice());
                RawMsg {
                    send,
                    peer,
                    ptr: bytes.as_mut_ptr(),
                    len: bytes.len(),
                }
            })
            .collect();
        Posted {
            dtype: T::DTYPE,
            msgs: raw,
            fill: Box::new(move |r| done(r, msgs)),
        }
    }
}

/// One direction of one message in a session: its job, its one-way plan and where it is.
struct Msg {
    job: usize,
    dtype: DType,
    plan: Plan,
    seq: u64,
    ptr: *mut u8,
    len: usize,
    at: usize,
    what: String,
}

/// One peer's messages in a session, each direction in order.
#[derive(Default)]
struct Flow {
    sends: VecDeque<Msg>,
    recvs: VecDeque<Msg>,
}

/// A thread connecting a pair: the links and their edges.
type Connector = JoinHandle<Result<(Links, Vec<Edge>)>>;

/// A pair connecting on its own thread, and the messages numbered for it meanwhile.
struct Connecting {
    thread: Connector,
    sent: u64,
    received: u64,
    /// Started because the peer was connecting to this rank, not for a message: a failure is
    /// no error of the session.
    served: bool,
}

/// The state of one session: its calls, each peer's messages, the pairs connecting and those
/// whose links have frames to flush.
#[derive(Default)]
struct Session {
    jobs: Vec<PostedJob>,
    flows: BTreeMap<usize, Flow>,
    connecting: BTreeMap<usize, Connecting>,
    unflushed: BTreeSet<usize>,
}

impl Inner {
    /// Run a session that starts with `first` and takes each posted call queued behind it
    /// (see the module docs).
    pub(super) fn run_posted(self: &Arc<Self>, first: Posted, ticket: Ticket, feed: &Feed<Posted>) {
        let fp = Fingerprint::new(Collective::SendRecv, Some(first.dtype), None, 0);
        let refused = failure::refuse(self.lock().failed.as_ref(), &self.abort, &fp, 0);
        if let Err(e) = refused {
            (first.fill)(Err(e));
            return;
        }
        // The session holds the point-to-point links only, not the communicator's state: a ring
        // collective on another thread goes on meanwhile (a device communicator's connect trades
        // its records here while the trainer all-reduces a loss, which the peer may reach first).
        // A failure meanwhile elsewhere raises the abort flag, which the session's waits watch.
        let mut pairs = self.pairs.lock().unwrap_or_else(|p| p.into_inner());
        let mut s = Session::default();
        let r = self
            .take(&mut s, &mut pairs, first, ticket)
            .and_then(|()| self.drive(&mut s, &mut pairs, feed));
        // Released before the state is taken (the state's lock comes first everywhere else).
        drop(pairs);
        if let Err(e) = r {
            self.fail(&mut self.lock(), &e);
            // Pairs still connecting give up at the abort flag.
            self.abort.raise(e.to_string());
            for c in std::mem::take(&mut s.connecting).into_values() {
                let _ = c.thread.join();
            }
            for job in &mut s.jobs {
                job.finish(Err(e.clone()));
            }
        }
    }

    /// Move the session's messages until none is left and nothing is queued behind it.
    fn drive(
        self: &Arc<Self>,
        s: &mut Session,
        pairs: &mut BTreeMap<usize, Pair>,
        feed: &Feed<Posted>,
    ) -> Result<()> {
        let mut patience = Patience::new(Instant::now());
        let mut waiter = Waiter::backoff();
        let mut served_at = std::time::Instant::now() - SERVE_EVERY;
        loop {
            let mut moved = false;
            while let Some((p, t)) = feed.next() {
                self.take(s, pairs, p, t)?;
                moved = true;
            }
            // The listener is asked every few milliseconds, not on every spin of the wait.
            if served_at.elapsed() >= SERVE_EVERY {
                served_at = std::time::Instant::now();
                moved |= self.serve(s, pairs)?;
            }
            moved |= self.joined(s, pairs)?;
            moved |= self.step(s, pairs)?;
            if s.flows.is_empty() && s.connecting.is_empty() {
                // Done unless a call was queued meanwhile.
                match feed.next() {
                    Some((p, t)) => self.take(s, pairs, p, t)?,
                    None => break,
                }
                continue;
            }
            match patience.tick(Instant::now(), moved, self.cfg.timeout) {
                Tick::Moved => {
                    waiter.progressed();
                    continue;
                }
                // A pair still connecting has its own deadline.
                Tick::TimedOut if s.connecting.is_empty() => return Err(self.stuck(s, pairs)),
                Tick::TimedOut => patience = Patience::new(Instant::now()),
                Tick::Check => self.check(s, pairs)?,
                Tick::Idle => {}
            }
            waiter.idle(self.cfg.timeout);
        }
        // What the sends left in their links' buffers goes out before the session ends.
        for peer in std::mem::take(&mut s.unflushed) {
            let pair = pairs.get_mut(&peer).expect("a flushed pair is connected");
            let what = format!("send to rank {peer}");
            let seq = pair.sent.saturating_sub(1);
            pair.links
                .flush(&what, seq, self.cfg.timeout, &self.abort)?;
        }
        Ok(())
    }

    /// Take posted call `p` into the session: number each message in its direction, queue it on
    /// its peer's flow, and start connecting a peer this rank has no pair with yet.
    fn take(
        self: &Arc<Self>,
        s: &mut Session,
        pairs: &mut BTreeMap<usize, Pair>,
        p: Posted,
        ticket: Ticket,
    ) -> Result<()> {
        let job = s.jobs.len();
        s.jobs.push(PostedJob::new(p.msgs.len(), p.fill, ticket));
        if p.msgs.is_empty() {
            return Ok(());
        }
        let es = p.dtype.size();
        let slice_elems = (self.cfg.slice_bytes / es).max(1);
        for m in p.msgs {
            if !pairs.contains_key(&m.peer) && !s.connecting.contains_key(&m.peer) {
                let thread = self.connect_thread(m.peer)?;
                s.connecting.insert(
                    m.peer,
                    Connecting {
                        thread,
                        sent: 0,
                        received: 0,
                        served: false,
                    },
                );
            }
            let (sent, received) = match pairs.get_mut(&m.peer) {
                Some(pair) => (&mut pair.sent, &mut pair.received),
                None => {
                    let c = s.connecting.get_mut(&m.peer).expect("connecting above");
                    c.served = false;
                    (&mut c.sent, &mut c.received)
                }
            };
            let count = m.len / es;
            let seq = if m.send { sent } else { received };
            let fp = Fingerprint::new(Collective::SendRecv, Some(p.dtype), None, count);
            self.flight.p2p_started(&[(m.peer, m.send, *seq, fp)]);
            let msg = Msg {
                job,
                dtype: p.dtype,
                plan: plan_p2p(
                    m.send.then_some(count),
                    (!m.send).then_some(count),
                    slice_elems,
                ),
                seq: *seq,
                ptr: m.ptr,
                len: m.len,
                at: 0,
                what: format!(
                    "{fp} {} rank {}",
                    if m.send { "to" } else { "from" },
                    m.peer
                ),
            };
            *seq += 1;
            let flow = s.flows.entry(m.peer).or_default();
            if m.send {
                flow.sends.push_back(msg);
            } else {
                flow.recvs.push_back(msg);
            }
        }
        Ok(())
    }

    /// Start connecting the pair with `peer` on a thread of its own (the peer does the same
    /// when its call with this rank comes).
    fn connect_thread(self: &Arc<Self>, peer: usize) -> Result<Connector> {
        if self.peers.get().is_none() || self.peer_listener.is_none() {
            return Err(Error::Protocol {
                peer: format!("rank {peer}"),
                detail: "this communicator has no peer listener".into(),
            });
        }
        let inner = Arc::clone(self);
        std::thread::Builder::new()
            .name(format!("ringzero-connect-{}-{peer}", self.rank))
            .spawn(move || {
                let addrs = inner.peers.get().expect("checked above");
                let listener = inner.peer_listener.as_ref().expect("checked above");
                let what = format!("send_recv with rank {peer}");
                connect::connect_pair(
                    &inner.cfg,
                    (peer, Role::Data),
                    &addrs[peer],
                    listener,
                    &inner.abort,
                    &what,
                )
            })
            .map_err(|e| Error::io(format!("starting to connect to rank {peer}"), e))
    }

    /// Start connecting to every rank that is connecting to this one and has no pair yet (its
    /// first call with this rank waits for that, and may be what this session's calls wait
    /// for in turn); whether any.
    fn serve(self: &Arc<Self>, s: &mut Session, pairs: &BTreeMap<usize, Pair>) -> Result<bool> {
        let Some(listener) = &self.peer_listener else {
            return Ok(false);
        };
        let mut any = false;
        for caller in listener.waiting(Role::Data) {
            if pairs.contains_key(&caller) || s.connecting.contains_key(&caller) {
                continue;
            }
            let thread = self.connect_thread(caller)?;
            let c = Connecting {
                thread,
                sent: 0,
                received: 0,
                served: true,
            };
            s.connecting.insert(caller, c);
            any = true;
        }
        Ok(any)
    }

    /// Make pairs of the connections that have finished; whether any did.
    fn joined(&self, s: &mut Session, pairs: &mut BTreeMap<usize, Pair>) -> Result<bool> {
        let done: Vec<usize> = s
            .connecting
            .iter()
            .filter(|(_, c)| c.thread.is_finished())
            .map(|(&p, _)| p)
            .collect();
        for peer in &done {
            let c = s.connecting.remove(peer).expect("listed above");
            let joined = c.thread.join().unwrap_or_else(|_| {
                Err(Error::Io {
                    context: format!("connecting to rank {peer}"),
                    detail: "the connecting thread panicked".into(),
                })
            });
            let (links, edges) = match joined {
                Ok(made) => made,
                Err(e) if c.served => {
                    tracing::warn!(target: "ringzero::topology", rank = self.rank, peer,
                        "rank {peer} was connecting to this rank, but joining it failed: {e}");
                    continue;
                }
                Err(e) => return Err(e),
            };
            for e in &edges {
                tracing::info!(target: "ringzero::topology", rank = self.rank, peer, "point-to-point {e}");
            }
            let (sent, received) = (c.sent, c.received);
            pairs.insert(
                *peer,
                Pair {
                    links,
                    sent,
                    received,
                },
            );
        }
        Ok(!done.is_empty())
    }

    /// Move what can move on every connected peer's flows, finishing the calls whose last
    /// message has moved, and push on the links' unflushed frames; whether anything moved.
    fn step(&self, s: &mut Session, pairs: &mut BTreeMap<usize, Pair>) -> Result<bool> {
        let mut moved = false;
        let Session {
            jobs,
            flows,
            unflushed,
            ..
        } = s;
        for (peer, flow) in flows.iter_mut() {
            let Some(pair) = pairs.get_mut(peer) else {
                continue; // still connecting
            };
            for (send, queue) in [(true, &mut flow.sends), (false, &mut flow.recvs)] {
                while let Some(m) = queue.front_mut() {
                    moved |= self.step_msg(&mut pair.links, m, send)?;
                    if m.at < m.plan.ops.len() {
                        break;
                    }
                    self.flight.p2p_finished([(*peer, send, m.seq)]);
                    jobs[m.job].one_done();
                    queue.pop_front();
                    if send {
                        unflushed.insert(*peer);
                    }
                }
            }
        }
        flows.retain(|_, f| !f.sends.is_empty() || !f.recvs.is_empty());
        let mut flushed = Vec::new();
        for &peer in unflushed.iter() {
            let pair = pairs
                .get_mut(&peer)
                .expect("an unflushed pair is connected");
            let what = || format!("send to rank {peer}");
            moved |= pair.links.tx.progress().map_err(|e| {
                crate::ring::call::link_err(e, &what(), pair.sent, peer, self.rank, None)
            })?;
            if pair.links.tx.flushed() {
                flushed.push(peer);
            }
        }
        flushed.iter().for_each(|p| {
            unflushed.remove(p);
        });
        Ok(moved)
    }

    /// Move message `m` (a send when `send`) on `links` as far as it can go now.
    fn step_msg(&self, links: &mut Links, m: &mut Msg, send: bool) -> Result<bool> {
        self.with_call(m, send, |call, bufs, at, what| {
            crate::ring::one_way::step_one_way(links, call, bufs, at, what)
        })
    }

    /// The health checks of every connected peer's first waiting message each way.
    fn check(&self, s: &mut Session, pairs: &mut BTreeMap<usize, Pair>) -> Result<()> {
        for (peer, flow) in s.flows.iter_mut() {
            let Some(pair) = pairs.get_mut(peer) else {
                continue;
            };
            for (send, queue) in [(true, &mut flow.sends), (false, &mut flow.recvs)] {
                if let Some(m) = queue.front_mut() {
                    self.with_call(m, send, |call, _, _, what| {
                        crate::ring::one_way::one_way_health(&mut pair.links, call, what, send)
                    })?;
                }
            }
        }
        Ok(())
    }

    /// The timeout of the session's first waiting message (a receive before a send): nothing
    /// moved on any flow for the whole timeout.
    fn stuck(&self, s: &mut Session, pairs: &mut BTreeMap<usize, Pair>) -> Error {
        let waiting = s.flows.iter_mut().find_map(|(peer, f)| {
            let pair = pairs.get(peer)?;
            f.recvs
                .front_mut()
                .map(|m| (pair, m, false))
                .or_else(|| f.sends.front_mut().map(|m| (pair, m, true)))
        });
        let Some((pair, m, send)) = waiting else {
            return Error::Protocol {
                peer: "none".into(),
                detail: "a point-to-point session timed out with nothing waiting".into(),
            };
        };
        self.with_call(m, send, |call, _, at, what| {
            crate::ring::one_way::one_way_timeout(&pair.links, call, what, *at)
        })
    }

    /// `f` on message `m`'s call, its buffer (borrowed for `f`'s run), where it is and its name.
    fn with_call<R>(
        &self,
        m: &mut Msg,
        send: bool,
        f: impl FnOnce(&crate::ring::call::Call, &mut Bufs, &mut usize, &str) -> R,
    ) -> R {
        let Msg {
            dtype,
            plan,
            seq,
            ptr,
            len,
            at,
            what,
            ..
        } = m;
        let dtype = *dtype;
        let fp_of = |c| Fingerprint::new(Collective::SendRecv, Some(dtype), None, c);
        // SAFETY: `ptr`/`len` are the bytes of a buffer that the message's job owns (see
        // `Posted`), which is not filled (so not handed back) until this message and the job's
        // others have moved; each message has a buffer of its own, and nothing else touches it
        // meanwhile. The borrow ends with `f`.
        let (call, mut bufs) = unsafe {
            if send {
                let b = std::slice::from_raw_parts(ptr.cast_const(), *len);
                self.p2p_call(plan, (&fp_of, dtype), (Some(b), *seq), (None, 0))
            } else {
                let b = std::slice::from_raw_parts_mut(*ptr, *len);
                self.p2p_call(plan, (&fp_of, dtype), (None, 0), (Some(b), *seq))
            }
        };
        debug_assert_eq!(call.op, ReduceOp::Sum);
        f(&call, &mut bufs, at, what)
    }
}
