//! Posted point-to-point calls on the host's links: the host's [`PairKind`] for the session
//! that runs the asynchronous forms ([`Communicator::send_async`](crate::NonBlocking::send_async),
//! `recv_async`, `send_recv_async`, `send_recv_batch_async`; the session itself is
//! `crate::posted`).
//!
//! A message's ops run at once, on the caller's bytes, as its link allows. A pair not yet
//! connected connects on a thread of its own meanwhile, as does any rank found connecting to this
//! one (its first call may be what this session's calls wait on), so first calls that form a
//! cycle meet too; a pair used in the session has settled once its link has flushed.

use std::collections::BTreeMap;
use std::sync::{Arc, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ringzero_kernels::{DType, Element, ReduceOp};

use super::pairs::{P2pOwned, Pair};
use super::Inner;
use crate::bootstrap::Role;
use crate::connect;
use crate::error::{Error, Result};
use crate::posted::{Common, Connects, Msg, PairKind, Request};
use crate::ring::call::{link_err, Call};
use crate::ring::engine::{Bufs, Links};
use crate::ring::failure;
use crate::ring::one_way::{one_way_timeout, step_one_way};
use crate::topology::Edge;
use crate::transport::wait::Waiter;
use crate::transport::LinkResult;
use crate::wire::Fingerprint;
use crate::work::{Feed, Ticket};

#[cfg(doc)]
use super::Communicator;

/// How often a session looks for ranks connecting to this one ([`Inner::serve`]).
const SERVE_EVERY: Duration = Duration::from_millis(2);

/// One posted host call.
pub(crate) type Posted = crate::posted::Posted<HostBytes>;

/// The first byte of a posted message's buffer, which its call's filler owns.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HostBytes(*mut u8);

// SAFETY: the pointer leads into a buffer that the call's filler owns (a `Vec<T>` per message,
// taken from its owner by `Posted::new` and moved into the filler whole, so its heap memory stays
// where it is); nothing else refers to it, and it travels with the filler to whichever thread
// runs the call.
unsafe impl Send for HostBytes {}

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
                Request {
                    send,
                    peer,
                    dtype: T::DTYPE,
                    elems: buf.len(),
                    buf: HostBytes(buf.as_mut_ptr().cast()),
                }
            })
            .collect();
        Posted {
            msgs: raw,
            fill: Box::new(move |r| done(r, msgs)),
        }
    }
}

/// A thread connecting a pair: the links and their edges.
type Connector = JoinHandle<Result<(Links, Vec<Edge>)>>;

/// A pair connecting on its own thread.
pub(crate) struct Connecting {
    thread: Connector,
    /// Started because the peer was connecting to this rank, not for a message: a failure is
    /// no error of the session.
    served: bool,
}

impl Inner {
    /// Run a session that starts with `first` and takes each posted call queued behind it.
    pub(super) fn run_posted(self: &Arc<Self>, first: Posted, ticket: Ticket, feed: &Feed<Posted>) {
        crate::posted::run(self, first, ticket, feed);
    }

    /// Run a session that starts with `first` and takes each posted call queued behind it
    /// (see the module docs).
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
    fn serve(
        self: &Arc<Self>,
        c: &mut Connects<Connecting>,
        pairs: &BTreeMap<usize, Pair>,
    ) -> Result<bool> {
        let Some(listener) = &self.peer_listener else {
            return Ok(false);
        };
        let mut any = false;
        for caller in listener.waiting(Role::Data) {
            if pairs.contains_key(&caller) || c.pairs.contains_key(&caller) {
                continue;
            }
            let thread = self.connect_thread(caller)?;
            let served = Connecting {
                thread,
                served: true,
            };
            c.pairs.insert(caller, served);
            any = true;
        }
        Ok(any)
    }

    /// Make pairs of the connections that have finished; whether any did.
    fn joined(
        &self,
        c: &mut Connects<Connecting>,
        pairs: &mut BTreeMap<usize, Pair>,
    ) -> Result<bool> {
        let done: Vec<usize> = c
            .pairs
            .iter()
            .filter(|(_, c)| c.thread.is_finished())
            .map(|(&p, _)| p)
            .collect();
        for peer in &done {
            let one = c.pairs.remove(peer).expect("listed above");
            let joined = one.thread.join().unwrap_or_else(|_| {
                Err(Error::Io {
                    context: format!("connecting to rank {peer}"),
                    detail: "the connecting thread panicked".into(),
                })
            });
            let (links, edges) = match joined {
                Ok(made) => made,
                Err(e) if one.served => {
                    tracing::warn!(target: "ringzero::topology", rank = self.rank, peer,
                        "rank {peer} was connecting to this rank, but joining it failed: {e}");
                    continue;
                }
                Err(e) => return Err(e),
            };
            for e in &edges {
                tracing::info!(target: "ringzero::topology", rank = self.rank, peer, "point-to-point {e}");
            }
            let pair = Pair {
                links,
                sent: 0,
                received: 0,
            };
            self.others_exist();
            pairs.insert(*peer, pair);
        }
        Ok(!done.is_empty())
    }

    /// Message `m`'s one-way call: a send numbered in its direction, a receive expecting the
    /// peer's message of that number.
    fn msg_call<'a>(&'a self, m: &'a Msg<HostBytes>) -> Call<'a> {
        let fp = m.fp();
        let out_bytes = if m.send { 0 } else { m.elems * m.dtype.size() };
        Call {
            n: 2,
            incoming: (!m.send).then_some((m.seq, fp)),
            ..self.call(&m.plan, (m.seq, fp), m.dtype, ReduceOp::Sum, out_bytes)
        }
    }
}

impl PairKind for Arc<Inner> {
    type Buf = HostBytes;
    type Pair = Pair;
    type Connecting = Connecting;
    type Work = ();

    fn common(&self) -> Common<'_> {
        Common {
            rank: self.rank,
            timeout: self.cfg.timeout,
            flight: &self.flight,
            abort: &self.abort,
        }
    }

    fn waiter(&self) -> Waiter {
        Waiter::backoff()
    }

    fn slice_elems(&self, dtype: DType) -> usize {
        (self.cfg.slice_bytes / dtype.size()).max(1)
    }

    fn pairs(&self) -> MutexGuard<'_, BTreeMap<usize, Pair>> {
        self.pairs.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn refuse(&self, fp: &Fingerprint) -> Result<()> {
        failure::refuse(self.lock().failed.as_ref(), &self.abort, fp, 0)
    }

    fn failed(&self, e: &Error, connecting: BTreeMap<usize, Connecting>) {
        self.fail(&mut self.lock(), e);
        // Pairs still connecting give up at the abort flag.
        self.abort.raise(e.to_string());
        for c in connecting.into_values() {
            let _ = c.thread.join();
        }
    }

    fn counts(pair: &mut Pair) -> [&mut u64; 2] {
        [&mut pair.received, &mut pair.sent]
    }

    fn admit(&self, _: &Msg<HostBytes>) -> Result<()> {
        Ok(()) // its plan is made from its buffer's length
    }

    fn connect(&self, peer: usize) -> Result<Connecting> {
        let thread = self.connect_thread(peer)?;
        Ok(Connecting {
            thread,
            served: false,
        })
    }

    fn wanted(c: &mut Connecting) {
        c.served = false;
    }

    fn connects(
        &self,
        c: &mut Connects<Connecting>,
        pairs: &mut BTreeMap<usize, Pair>,
    ) -> Result<bool> {
        // The listener is asked every few milliseconds, not on every spin of the wait.
        let now = Instant::now();
        let mut moved = false;
        if c.looked
            .is_none_or(|t| now.duration_since(t) >= SERVE_EVERY)
        {
            c.looked = Some(now);
            moved |= self.serve(c, pairs)?;
        }
        Ok(moved | self.joined(c, pairs)?)
    }

    fn step(&self, pair: &mut Pair, _: &mut (), m: &mut Msg<HostBytes>) -> Result<bool> {
        let len = m.elems * m.dtype.size();
        let HostBytes(ptr) = m.buf;
        // SAFETY: `ptr` and `len` are the bytes of a buffer that the message's job owns (see
        // `HostBytes`), which is not filled (so not handed back) until this message and the
        // job's others have moved; each message has a buffer of its own, and nothing else
        // touches it meanwhile. The borrow ends with this function.
        let mut bufs = unsafe {
            if m.send {
                Bufs::Split {
                    input: std::slice::from_raw_parts(ptr.cast_const(), len),
                    output: &mut [],
                }
            } else {
                Bufs::Split {
                    input: &[],
                    output: std::slice::from_raw_parts_mut(ptr, len),
                }
            }
        };
        let mut at = m.at;
        let r = step_one_way(
            &mut pair.links,
            &self.msg_call(m),
            &mut bufs,
            &mut at,
            &m.what,
        );
        m.at = at;
        r
    }

    fn holds(_: &(), _: &Msg<HostBytes>) -> bool {
        false // its ops ran at once
    }

    fn progress(&self, peer: usize, pair: &mut Pair, _: &mut (), what: &str) -> Result<bool> {
        pair.links
            .tx
            .progress()
            .map_err(|e| link_err(e, what, pair.sent, peer, self.rank, None))
    }

    fn posting(_: &()) -> bool {
        false
    }

    fn settled(pair: &Pair, _: &()) -> bool {
        pair.links.tx.flushed()
    }

    fn health(pair: &mut Pair) -> [LinkResult<()>; 2] {
        [pair.links.rx.health(), pair.links.tx.health()]
    }

    fn msg_timeout(&self, pair: &Pair, m: &Msg<HostBytes>) -> Error {
        one_way_timeout(&pair.links, &self.msg_call(m), &m.what, m.at)
    }

    fn settle_timeout(&self, peer: usize) -> Error {
        Error::Timeout {
            op: format!("send_recv with rank {peer}"),
            seq: 0,
            peer,
            waiting: format!("rank {peer} to read the frames already sent to it"),
            after: self.cfg.timeout,
        }
    }
}
