//! Posted point-to-point calls: the session that runs the asynchronous forms (`send_async`,
//! `recv_async`, `send_recv_async`, `send_recv_batch_async`) of both communicators.
//!
//! A blocking call runs alone, so a rank's calls happen in program order. Queued, that order
//! would make `recv_async(prev)` then `send_async(next)` around a ring wait forever (every rank
//! waits for a send queued behind its own receive), as would two ranks that each post a send
//! larger than the peer's slots before their receives. So a run of posted calls at the front of
//! the worker's queue is one *session* (see [`crate::work::Worker`]): every message joins a queue
//! per peer and direction as it is posted, even while earlier ones still move, and each direction
//! of each pair moves as its link allows. Messages to one peer keep their order, as do messages
//! from one, and each is numbered and matched as if sent alone, so the peer may use any form; each
//! call's `Work` completes as soon as its own messages have. A pair not yet connected connects
//! within the session, never waiting on the peer's turn, while the session moves every other
//! pair's messages, so first calls that form a cycle meet too. A collective queued behind the
//! session waits for it to end, which it does once nothing is queued behind it, every message has
//! moved and every link used has settled. Any error fails the communicator and every call of the
//! session.
//!
//! The session is written once, here; what differs between the host's links and a device's is a
//! [`PairKind`]: how a pair connects (`comm/posted.rs`: on a thread of its own;
//! `device/posted.rs`: phases traded over the host communicator), how a message's ops run (at
//! once on the host; queued on the stream and retired when their marker completes on a device),
//! and what "settled" means (frames flushed; and the device's work retired).

use std::collections::{BTreeMap, VecDeque};
use std::sync::MutexGuard;
use std::time::{Duration, Instant};

use ringzero_kernels::DType;

use crate::deadline::{Patience, Tick};
use crate::error::{Error, Result};
use crate::flight::Recorder;
use crate::ring::call::{gone_unneeded, link_err};
use crate::ring::failure::AbortFlag;
use crate::ring::{plan_p2p, Collective, Plan};
use crate::transport::wait::Waiter;
use crate::transport::LinkResult;
use crate::wire::Fingerprint;
use crate::work::{Feed, PostedJob, Ticket};

/// One posted call: its messages, and what fills its `Work` (which owns their buffers).
pub(crate) struct Posted<B> {
    pub(crate) msgs: Vec<Request<B>>,
    pub(crate) fill: Box<dyn FnOnce(Result<()>) + Send>,
}

/// One message of a posted call: a send or a receive, the peer, and its buffer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Request<B> {
    pub(crate) send: bool,
    pub(crate) peer: usize,
    pub(crate) dtype: DType,
    pub(crate) elems: usize,
    pub(crate) buf: B,
}

/// One direction of one message in a session: its job, its one-way plan and where it is.
pub(crate) struct Msg<B> {
    pub(crate) job: usize,
    pub(crate) send: bool,
    pub(crate) dtype: DType,
    pub(crate) elems: usize,
    pub(crate) buf: B,
    pub(crate) plan: Plan,
    /// Its number in its direction of its pair.
    pub(crate) seq: u64,
    /// The next op of `plan` to run.
    pub(crate) at: usize,
    /// Its name in errors.
    pub(crate) what: String,
}

impl<B> Msg<B> {
    /// Its fingerprint, as the peer's message of the same number must carry.
    pub(crate) fn fp(&self) -> Fingerprint {
        Fingerprint::new(Collective::SendRecv, Some(self.dtype), None, self.elems)
    }

    /// Its tag among the work of its pair: the direction and its number there.
    pub(crate) fn tag(&self) -> u64 {
        (self.seq << 1) | u64::from(self.send)
    }

    /// Whether ops of it are still to run (not only to complete).
    pub(crate) fn running(&self) -> bool {
        self.at < self.plan.ops.len()
    }
}

/// One peer's messages in a session, each direction in order.
struct Flow<B> {
    sends: VecDeque<Msg<B>>,
    recvs: VecDeque<Msg<B>>,
}

impl<B> Default for Flow<B> {
    fn default() -> Self {
        Flow {
            sends: VecDeque::new(),
            recvs: VecDeque::new(),
        }
    }
}

/// The pairs connecting in a session.
pub(crate) struct Connects<C> {
    pub(crate) pairs: BTreeMap<usize, C>,
    /// When the kind last looked for ranks connecting to this one, for kinds that look.
    pub(crate) looked: Option<Instant>,
}

/// The messages a health check names: the first still running each way on one pair, and the
/// session's first waiting one (named for a failure no message of the pair is at).
pub(crate) struct Waiting<'a, B> {
    recv: Option<&'a Msg<B>>,
    send: Option<&'a Msg<B>>,
    first: Option<&'a Msg<B>>,
}

impl<B> Waiting<'_, B> {
    /// The name and number an error in direction `send` carries; `done` is the pair's count of
    /// messages that way when no message is waiting at all.
    fn name(&self, send: bool, peer: usize, done: u64) -> (String, u64) {
        let m = if send { self.send } else { self.recv };
        match m.or(self.first) {
            Some(m) => (m.what.clone(), m.seq),
            None => (format!("send_recv with rank {peer}"), done),
        }
    }
}

/// What a session moves messages over: one kind of links (the host's, a device's), its pairs,
/// how they connect and how a message's ops run on them.
pub(crate) trait PairKind {
    /// A message's buffer (its address).
    type Buf: Copy;
    /// A connected pair: its links and how many messages each direction has carried.
    type Pair;
    /// A pair on its way to being connected.
    type Connecting;
    /// A used pair's work in the session that has still to complete.
    type Work: Default;

    /// What every kind has: its rank, deadline, flight recorder and abort flag.
    fn common(&self) -> Common<'_>;
    /// A new waiter for the session's idle rounds.
    fn waiter(&self) -> Waiter;
    /// Elements of `dtype` in one slice of a message.
    fn slice_elems(&self, dtype: DType) -> usize;
    /// The communicator's pairs, held for the session.
    fn pairs(&self) -> MutexGuard<'_, BTreeMap<usize, Self::Pair>>;
    /// An error if the communicator has failed or been aborted.
    fn refuse(&self, fp: &Fingerprint) -> Result<()>;
    /// Fail the communicator with `e`, after the session's pairs still `connecting` have ended.
    fn failed(&self, e: &Error, connecting: BTreeMap<usize, Self::Connecting>);

    /// The counts of messages `pair` has carried: received, sent.
    fn counts(pair: &mut Self::Pair) -> [&mut u64; 2];

    /// The count of messages moved in direction `send` on `pair`.
    fn count(pair: &mut Self::Pair, send: bool) -> u64 {
        *Self::counts(pair)[usize::from(send)]
    }
    /// An error if message `m` cannot run on this kind (its buffer against its plan).
    fn admit(&self, m: &Msg<Self::Buf>) -> Result<()>;
    /// Start connecting the pair with `peer`.
    fn connect(&self, peer: usize) -> Result<Self::Connecting>;
    /// A message of the session now needs the connecting pair `c`.
    fn wanted(c: &mut Self::Connecting);
    /// Take connecting pairs as far as they go now; those that are done join `pairs`. Whether
    /// any moved.
    fn connects(
        &self,
        c: &mut Connects<Self::Connecting>,
        pairs: &mut BTreeMap<usize, Self::Pair>,
    ) -> Result<bool>;

    /// Run or queue what of message `m` can go now on `pair`, moving `m.at`. Whether any did.
    fn step(
        &self,
        pair: &mut Self::Pair,
        work: &mut Self::Work,
        m: &mut Msg<Self::Buf>,
    ) -> Result<bool>;
    /// Whether `work` still holds something of message `m`.
    fn holds(work: &Self::Work, m: &Msg<Self::Buf>) -> bool;
    /// Move what moves without a message (frames posted, work completed) on the pair with
    /// `peer`; errors name `what`. Whether anything did.
    fn progress(
        &self,
        peer: usize,
        pair: &mut Self::Pair,
        work: &mut Self::Work,
        what: &str,
    ) -> Result<bool>;
    /// Whether a frame of `work` is still to be published to the peer.
    fn posting(work: &Self::Work) -> bool;
    /// Whether `work` is done and `pair`'s frames have all left.
    fn settled(pair: &Self::Pair, work: &Self::Work) -> bool;
    /// The health of `pair`'s incoming and outgoing links.
    fn health(pair: &mut Self::Pair) -> [LinkResult<()>; 2];
    /// The timeout of message `m`, waiting at its op `m.at` on `pair`.
    fn msg_timeout(&self, pair: &Self::Pair, m: &Msg<Self::Buf>) -> Error;
    /// The timeout of a session whose messages have all run and whose pair with `peer` has
    /// not settled.
    fn settle_timeout(&self, peer: usize) -> Error;
}

/// What a session reads of every kind.
pub(crate) struct Common<'a> {
    pub(crate) rank: usize,
    pub(crate) timeout: Duration,
    pub(crate) flight: &'a Recorder,
    pub(crate) abort: &'a AbortFlag,
}

/// A pair used in a session: its work not yet completed, and the name its errors carry when no
/// message of it is at fault.
struct Used<W> {
    work: W,
    name: String,
}

/// The state of one session.
struct Session<K: PairKind> {
    jobs: Vec<PostedJob>,
    flows: BTreeMap<usize, Flow<K::Buf>>,
    connecting: Connects<K::Connecting>,
    /// The pairs used in this session.
    used: BTreeMap<usize, Used<K::Work>>,
}

type Pairs<K> = BTreeMap<usize, <K as PairKind>::Pair>;

/// Run a session on `kind` that starts with `first` and takes each posted call queued behind
/// it (see the module docs).
pub(crate) fn run<K: PairKind>(
    kind: &K,
    first: Posted<K::Buf>,
    ticket: Ticket,
    feed: &Feed<Posted<K::Buf>>,
) {
    let dtype = first.msgs.first().map(|m| m.dtype);
    if let Err(e) = kind.refuse(&Fingerprint::new(Collective::SendRecv, dtype, None, 0)) {
        (first.fill)(Err(e));
        return;
    }
    // The session holds the point-to-point pairs only, not the communicator's state: a ring
    // collective on another thread goes on meanwhile (a device communicator's connect trades
    // its records here while the trainer all-reduces a loss, which the peer may reach first).
    // A failure meanwhile elsewhere raises the abort flag, which the session's checks watch.
    let mut pairs = kind.pairs();
    let mut s = Session::<K> {
        jobs: Vec::new(),
        flows: BTreeMap::new(),
        connecting: Connects {
            pairs: BTreeMap::new(),
            looked: None,
        },
        used: BTreeMap::new(),
    };
    let r = s
        .take(kind, &mut pairs, first, ticket)
        .and_then(|()| s.drive(kind, &mut pairs, feed));
    // Released before the state is taken (the state's lock comes first everywhere else).
    drop(pairs);
    if let Err(e) = r {
        kind.failed(&e, std::mem::take(&mut s.connecting.pairs));
        for job in &mut s.jobs {
            job.finish(Err(e.clone()));
        }
    }
}

impl<K: PairKind> Session<K> {
    /// Move the session's messages until none is left and nothing is queued behind it.
    fn drive(&mut self, kind: &K, pairs: &mut Pairs<K>, feed: &Feed<Posted<K::Buf>>) -> Result<()> {
        let timeout = kind.common().timeout;
        let mut patience = Patience::new(Instant::now());
        let mut waiter = kind.waiter();
        loop {
            let mut moved = false;
            while let Some((p, t)) = feed.next() {
                self.take(kind, pairs, p, t)?;
                moved = true;
            }
            moved |= kind.connects(&mut self.connecting, pairs)?;
            moved |= self.step(kind, pairs)?;
            let settled = self
                .used
                .iter()
                .all(|(p, u)| pairs.get(p).is_none_or(|pair| K::settled(pair, &u.work)));
            if self.flows.is_empty() && self.connecting.pairs.is_empty() && settled {
                // Done unless a call was queued meanwhile.
                match feed.next() {
                    Some((p, t)) => self.take(kind, pairs, p, t)?,
                    None => return Ok(()),
                }
                continue;
            }
            match patience.tick(Instant::now(), moved, timeout) {
                Tick::Moved => {
                    waiter.progressed();
                    continue;
                }
                // A pair still connecting ends by its own deadlines.
                Tick::TimedOut if self.connecting.pairs.is_empty() => {
                    return Err(self.stuck(kind, pairs))
                }
                Tick::TimedOut => patience = Patience::new(Instant::now()),
                Tick::Check => self.check(kind, pairs)?,
                Tick::Idle => {}
            }
            waiter.idle(timeout);
        }
    }

    /// Take posted call `p` into the session: number each message in its direction, queue it on
    /// its peer's flow, and start connecting a peer this rank has no pair with yet.
    fn take(
        &mut self,
        kind: &K,
        pairs: &mut Pairs<K>,
        p: Posted<K::Buf>,
        ticket: Ticket,
    ) -> Result<()> {
        let job = self.jobs.len();
        self.jobs.push(PostedJob::new(p.msgs.len(), p.fill, ticket));
        for r in p.msgs {
            let connected = pairs.contains_key(&r.peer);
            if !connected && !self.connecting.pairs.contains_key(&r.peer) {
                let c = kind.connect(r.peer)?;
                self.connecting.pairs.insert(r.peer, c);
            }
            if let Some(c) = self.connecting.pairs.get_mut(&r.peer) {
                K::wanted(c);
            }
            // Numbered after the messages already queued for the peer in this session, or
            // those its pair has carried (none, for a pair connecting in this session).
            let flow = self.flows.entry(r.peer).or_default();
            let queue = if r.send {
                &mut flow.sends
            } else {
                &mut flow.recvs
            };
            let seq = match queue.back() {
                Some(b) => b.seq + 1,
                None => pairs
                    .get_mut(&r.peer)
                    .map_or(0, |pair| K::count(pair, r.send)),
            };
            let m = Msg {
                job,
                send: r.send,
                dtype: r.dtype,
                elems: r.elems,
                buf: r.buf,
                plan: plan_p2p(
                    r.send.then_some(r.elems),
                    (!r.send).then_some(r.elems),
                    kind.slice_elems(r.dtype),
                ),
                seq,
                at: 0,
                what: String::new(),
            };
            let dir = if r.send { "to" } else { "from" };
            let m = Msg {
                what: format!("{} {dir} rank {}", m.fp(), r.peer),
                ..m
            };
            kind.common()
                .flight
                .p2p_started(&[(r.peer, r.send, seq, m.fp())]);
            kind.admit(&m)?;
            queue.push_back(m);
        }
        Ok(())
    }

    /// Move what can move on every connected peer's flows, finishing the calls whose messages
    /// have moved (and whose work has completed); whether anything moved.
    fn step(&mut self, kind: &K, pairs: &mut Pairs<K>) -> Result<bool> {
        let mut moved = false;
        let Session {
            jobs, flows, used, ..
        } = self;
        for (&peer, flow) in flows.iter_mut() {
            let Some(pair) = pairs.get_mut(&peer) else {
                continue; // still connecting
            };
            let Used { work, .. } = used.entry(peer).or_insert_with(|| Used {
                work: K::Work::default(),
                name: format!("send_recv with rank {peer}"),
            });
            for queue in [&mut flow.sends, &mut flow.recvs] {
                while let Some(m) = queue.front_mut() {
                    if m.running() {
                        moved |= kind.step(pair, work, m)?;
                    }
                    moved |= kind.progress(peer, pair, work, &m.what)?;
                    if m.running() || K::holds(work, m) {
                        break;
                    }
                    *K::counts(pair)[usize::from(m.send)] = m.seq + 1;
                    kind.common().flight.p2p_finished([(peer, m.send, m.seq)]);
                    jobs[m.job].one_done();
                    queue.pop_front();
                }
            }
        }
        flows.retain(|_, f| !f.sends.is_empty() || !f.recvs.is_empty());
        // Pairs whose messages have all run still complete their work and push out frames.
        for (&peer, u) in used.iter_mut() {
            let pair = pairs.get_mut(&peer).expect("a used pair is connected");
            moved |= kind.progress(peer, pair, &mut u.work, &u.name)?;
        }
        Ok(moved)
    }

    /// The abort flag, and the health of every used pair a message, unfinished work or
    /// unflushed frames still need. A failure seen on a direction with no message waiting (a
    /// peer's abort) is named after the session's first waiting message, which it stops.
    fn check(&mut self, kind: &K, pairs: &mut Pairs<K>) -> Result<()> {
        let rank = kind.common().rank;
        let first = self
            .flows
            .values()
            .find_map(|f| f.recvs.front().or(f.sends.front()));
        if let Some(reason) = kind.common().abort.reason() {
            // Named after the first waiting message of a connected pair, or else the first pair
            // still connecting (whose messages have no link to be waiting on yet).
            let waiting = self
                .flows
                .iter()
                .filter(|(p, _)| pairs.contains_key(p))
                .find_map(|(_, f)| f.recvs.front().or(f.sends.front()));
            let (op, seq) = match waiting {
                Some(m) => (m.what.clone(), m.seq),
                None => {
                    let peer = self.connecting.pairs.keys().next().copied().unwrap_or(rank);
                    (format!("send_recv with rank {peer}"), 0)
                }
            };
            return Err(Error::Aborted { op, seq, reason });
        }
        for (&peer, Used { work, .. }) in self.used.iter() {
            let pair = pairs.get_mut(&peer).expect("a used pair is connected");
            // The first message each way that still needs the link (one whose ops have all
            // run only waits for this rank's own work).
            let flow = self.flows.get(&peer);
            let ways = Waiting {
                recv: flow.and_then(|f| f.recvs.iter().find(|m| m.running())),
                send: flow.and_then(|f| f.sends.iter().find(|m| m.running())),
                first,
            };
            let needs_tx = ways.send.is_some() || K::posting(work) || !K::settled(pair, work);
            let [rx, tx] = K::health(pair);
            if !gone_unneeded(&rx, ways.recv.is_some()) {
                let (what, seq) = ways.name(false, peer, K::count(pair, false));
                rx.map_err(|e| link_err(e, &what, seq, peer, rank, None))?;
            }
            if !gone_unneeded(&tx, needs_tx) {
                let (what, seq) = ways.name(true, peer, K::count(pair, true));
                tx.map_err(|e| link_err(e, &what, seq, peer, rank, None))?;
            }
        }
        Ok(())
    }

    /// The timeout of the session's first waiting message (a receive before a send), or of the
    /// work or frames a used pair waits for: nothing moved for the whole timeout.
    fn stuck(&self, kind: &K, pairs: &Pairs<K>) -> Error {
        let waiting = self.flows.iter().find_map(|(peer, f)| {
            let pair = pairs.get(peer)?;
            f.recvs
                .front()
                .or_else(|| f.sends.front())
                .filter(|m| m.running())
                .map(|m| (pair, m))
        });
        match waiting {
            Some((pair, m)) => kind.msg_timeout(pair, m),
            None => {
                let peer = self
                    .used
                    .keys()
                    .next()
                    .copied()
                    .unwrap_or(kind.common().rank);
                kind.settle_timeout(peer)
            }
        }
    }
}
