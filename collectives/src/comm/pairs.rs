//! Point-to-point: send and receive between two ranks over links of their own (one each way per
//! pair, connected straight between the two ranks by the pair's first call).

use std::collections::BTreeMap;

use ringzero_kernels::{DType, Element, ReduceOp};

use super::{Communicator, Inner};
use crate::bootstrap::Role;
use crate::connect;
use crate::error::{Error, Result};
use crate::ring::call::{link_err, Call};
use crate::ring::engine::{Bufs, Links};
use crate::ring::failure;
use crate::ring::lanes::Lane;
use crate::ring::{plan_p2p, Collective, Plan};
use crate::transport::LinkError;
use crate::wire::{Expect, Fingerprint};

/// One message of a point-to-point call, as bytes: to or from a peer.
enum Msg<'a> {
    Send(&'a [u8], usize),
    Recv(&'a mut [u8], usize),
}

/// One peer's sends and receives in a point-to-point call, in program order.
type PeerMsgs<'a> = (Vec<&'a [u8]>, Vec<&'a mut [u8]>);

/// One message of [`Communicator::send_recv_batch`].
#[derive(Debug)]
pub enum P2p<'a, T> {
    /// Send the buffer to the rank.
    Send(&'a [T], usize),
    /// Receive into the buffer from the rank.
    Recv(&'a mut [T], usize),
}

/// One message of [`Communicator::send_recv_batch_async`], on a buffer it owns: a send's buffer
/// comes back as it went, a receive's (its length the count expected) filled.
#[derive(Debug)]
pub enum P2pOwned<T> {
    /// Send the buffer to the rank.
    Send(Vec<T>, usize),
    /// Receive into the buffer from the rank.
    Recv(Vec<T>, usize),
}

/// The links of this rank with one peer, for point-to-point calls, and how many messages each
/// direction has carried (each direction numbers its own: a message's sequence number).
pub(super) struct Pair {
    pub(super) links: Links,
    pub(super) sent: u64,
    pub(super) received: u64,
}

impl Communicator {
    /// Run several sends and receives, to and from any peers, at once (NCCL's grouped calls,
    /// torch's `batch_isend_irecv`): every message moves as soon as it can, so a batch never
    /// waits on itself — send to the next rank while receiving from the previous one, or swap
    /// with every rank — whatever calls the peers make. Messages to one peer (and from one peer)
    /// keep their order in the batch, and each is matched by the peer as if sent or received
    /// alone. Pairs that have not met yet connect at once. Returns once every message has
    /// completed; any error fails the communicator.
    pub fn send_recv_batch<T: Element>(&self, msgs: &mut [P2p<'_, T>]) -> Result<()> {
        check_peers(self.size(), self.rank(), msgs.iter().map(P2p::peer))?;
        self.wait_async_idle();
        self.inner.send_recv_batch(msgs)
    }
}

impl<T> P2p<'_, T> {
    /// Whether the message is a send, and its peer.
    fn peer(&self) -> (bool, usize) {
        match self {
            P2p::Send(_, p) => (true, *p),
            P2p::Recv(_, p) => (false, *p),
        }
    }
}

impl<T> P2pOwned<T> {
    /// Whether the message is a send, and its peer.
    pub(super) fn peer(&self) -> (bool, usize) {
        match self {
            P2pOwned::Send(_, p) => (true, *p),
            P2pOwned::Recv(_, p) => (false, *p),
        }
    }
}

/// Refuse a point-to-point call whose messages (send or not, peer) name a peer that is not
/// another rank of an `n`-rank communicator, before anything moves.
pub(crate) fn check_peers(
    n: usize,
    rank: usize,
    msgs: impl ExactSizeIterator<Item = (bool, usize)>,
) -> Result<()> {
    let batch = msgs.len() > 1;
    for (i, (is_send, peer)) in msgs.enumerate() {
        if peer < n && peer != rank {
            continue;
        }
        let verb = if is_send { "send to" } else { "recv from" };
        let why = if peer == rank {
            "is this rank (copy the buffer instead)".to_string()
        } else {
            format!("is not a rank of this {n}-rank communicator")
        };
        let which = if batch {
            format!(" (message {i} of the batch)")
        } else {
            String::new()
        };
        return Err(Error::InvalidArgument {
            op: format!("{verb} rank {peer}{which}"),
            msg: format!("peer {peer} {why}"),
        });
    }
    Ok(())
}

impl Inner {
    /// [`Communicator::send_recv_batch`] on messages whose peers [`check_peers`] accepted.
    pub(super) fn send_recv_batch<T: Element>(&self, msgs: &mut [P2p<'_, T>]) -> Result<()> {
        let msgs = msgs
            .iter_mut()
            .map(|m| match m {
                P2p::Send(b, p) => Msg::Send(bytemuck::cast_slice(b), *p),
                P2p::Recv(b, p) => Msg::Recv(bytemuck::cast_slice_mut(b), *p),
            })
            .collect();
        self.point_to_point(T::DTYPE, msgs)
    }

    /// Every point-to-point call ([`Communicator::send`](crate::Collectives::send), `recv`, `send_recv`,
    /// `send_recv_batch`, and their asynchronous forms) on messages of `dtype`: connect the
    /// pairs not yet connected (all at once), then run every peer's messages as one lane of
    /// [`engine::run_lanes`].
    fn point_to_point(&self, dtype: DType, mut msgs: Vec<Msg<'_>>) -> Result<()> {
        let es = dtype.size();
        let fp_of =
            |b: &[u8]| Fingerprint::new(Collective::SendRecv, Some(dtype), None, b.len() / es);
        let Some(first) = msgs.first() else {
            return Ok(());
        };
        let fp = match first {
            Msg::Send(b, _) => fp_of(b),
            Msg::Recv(b, _) => fp_of(b),
        };
        let mut st = self.lock();
        failure::refuse(st.failed.as_ref(), &self.abort, &fp, 0)?;
        let mut pairs = self.pairs.lock().unwrap_or_else(|p| p.into_inner());
        let r = match msgs.as_mut_slice() {
            // `send`, `recv`, `send_recv`: one call with one peer, without the batch's grouping
            // (small messages are latency-bound).
            [Msg::Send(s, p)] => self.run_single(&mut pairs, (dtype, &fp), *p, Some(s), None),
            [Msg::Recv(r, p)] => self.run_single(&mut pairs, (dtype, &fp), *p, None, Some(r)),
            [Msg::Send(s, p), Msg::Recv(r, q)] if p == q => {
                self.run_single(&mut pairs, (dtype, &fp), *p, Some(s), Some(r))
            }
            _ => {
                // Each peer's sends and receives, in program order.
                let mut by_peer: BTreeMap<usize, PeerMsgs> = BTreeMap::new();
                for m in msgs {
                    match m {
                        Msg::Send(b, p) => by_peer.entry(p).or_default().0.push(b),
                        Msg::Recv(b, p) => by_peer.entry(p).or_default().1.push(b),
                    }
                }
                self.connect_pairs(&mut pairs, by_peer.keys().copied(), &fp)
                    .and_then(|()| self.run_batch(&mut pairs, dtype, by_peer))
            }
        };
        drop(pairs);
        if let Err(e) = &r {
            self.fail(&mut st, e);
        }
        r
    }

    /// One call with one peer: at most one message each way.
    fn run_single(
        &self,
        pairs: &mut BTreeMap<usize, Pair>,
        (dtype, fp): (DType, &Fingerprint),
        peer: usize,
        send: Option<&[u8]>,
        recv: Option<&mut [u8]>,
    ) -> Result<()> {
        let es = dtype.size();
        let fp_of = |c| Fingerprint::new(Collective::SendRecv, Some(dtype), None, c);
        // Recorded from before the connect, which is where a first call waits for its peer.
        let (sent, received) = pairs.get(&peer).map_or((0, 0), |p| (p.sent, p.received));
        let s = send.map(|b| (peer, true, sent, fp_of(b.len() / es)));
        let r = recv
            .as_ref()
            .map(|b| (peer, false, received, fp_of(b.len() / es)));
        let (both, one);
        let msgs: &[_] = match (s, r) {
            (Some(s), Some(r)) => {
                both = [s, r];
                &both
            }
            (Some(m), None) | (None, Some(m)) => {
                one = [m];
                &one
            }
            (None, None) => &[],
        };
        self.tracked(msgs, || {
            self.connect_pairs(pairs, std::iter::once(peer), fp)?;
            let pair = pairs.get_mut(&peer).expect("connected above");
            let slice_elems = (self.cfg.slice_bytes / es).max(1);
            let plan = plan_p2p(
                send.map(|b| b.len() / es),
                recv.as_ref().map(|b| b.len() / es),
                slice_elems,
            );
            pair.sent += u64::from(send.is_some());
            pair.received += u64::from(recv.is_some());
            let call = self.p2p_call(&plan, (&fp_of, dtype), (send, sent), (recv, received));
            let mut lane = [Lane::new(&mut pair.links, vec![call])];
            crate::ring::lanes::run_lanes(&mut lane, self.cfg.timeout, &self.abort)
        })
    }

    /// Run `run` with point-to-point messages `msgs` (peer, a send, its number, what it is)
    /// pending in the flight record, finished there if it succeeds (a failed run leaves them
    /// pending: what the rank was waiting for).
    pub(super) fn tracked(
        &self,
        msgs: &[(usize, bool, u64, Fingerprint)],
        run: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        self.flight.p2p_started(msgs);
        run()?;
        self.flight
            .p2p_finished(msgs.iter().map(|&(p, send, seq, _)| (p, send, seq)));
        Ok(())
    }

    /// Connect this rank's point-to-point links with each of `peers` it has none with yet.
    fn connect_pairs(
        &self,
        pairs: &mut BTreeMap<usize, Pair>,
        peers: impl Iterator<Item = usize>,
        fp: &Fingerprint,
    ) -> Result<()> {
        for (peer, links) in self.connect_missing(pairs, peers, fp, Role::Data, None)? {
            self.others_exist();
            let (sent, received) = (0, 0);
            pairs.insert(
                peer,
                Pair {
                    links,
                    sent,
                    received,
                },
            );
        }
        Ok(())
    }

    /// Connect links of `role` with each of `peers` that `have` has none for, all at once
    /// (each connect waits for the peer's; one by one in ascending rank order could not wait in
    /// a cycle either, only longer); the new links by peer.
    ///
    /// Point-to-point links (`Role::Data`) also serve: a rank that dials this one while it
    /// waits (its own first call with this rank) is connected too, and its links returned with
    /// the others, so first calls that form a cycle (every rank sending to the one before it)
    /// meet instead of waiting on each other until the deadline. Connecting to such a caller
    /// may fail (it gave up, its connection is stale) without failing this call.
    ///
    /// With `watch`, the ring's incoming link is watched meanwhile: a collective's ranks connect
    /// after agreeing on the call, but a rank that fails after that (its watchdog aborts it, its
    /// neighbour dies) never comes to connect, and says so only on the ring. A peer's abort or
    /// loss seen there ends the wait at once, as the error.
    pub(super) fn connect_missing<V>(
        &self,
        have: &BTreeMap<usize, V>,
        peers: impl Iterator<Item = usize>,
        fp: &Fingerprint,
        role: Role,
        mut watch: Option<Watch<'_>>,
    ) -> Result<Vec<(usize, Links)>> {
        let missing: Vec<usize> = peers.filter(|p| !have.contains_key(p)).collect();
        if missing.is_empty() {
            return Ok(Vec::new());
        }
        let (Some(addrs), Some(listener)) = (self.peers.get(), &self.peer_listener) else {
            return Err(Error::Protocol {
                peer: format!("rank {}", missing[0]),
                detail: "this communicator has no peer listener".into(),
            });
        };
        let what = fp.to_string();
        let mut seen = None;
        let made: Vec<_> = std::thread::scope(|s| {
            let connect = |peer: usize| {
                let what = &what;
                s.spawn(move || {
                    connect::connect_pair(
                        &self.cfg,
                        (peer, role),
                        &addrs[peer],
                        listener,
                        &self.abort,
                        what,
                    )
                })
            };
            // (peer, asked for, its thread)
            let mut hs: Vec<_> = missing.iter().map(|&p| (p, true, connect(p))).collect();
            let serves = role == Role::Data;
            while watch.is_some() || serves {
                if hs.iter().all(|(_, _, h)| h.is_finished()) {
                    break;
                }
                if let Some(w) = watch.as_mut() {
                    if let Err(e) = w.check(&missing) {
                        let e = link_err(e, &what, w.seq, w.ring.prev, self.rank, Some(fp));
                        // The connecting threads wait on the abort flag.
                        self.abort.raise(e.to_string());
                        seen = Some(e);
                        break;
                    }
                }
                if serves {
                    for caller in listener.waiting(role) {
                        if !have.contains_key(&caller) && hs.iter().all(|(p, _, _)| *p != caller) {
                            hs.push((caller, false, connect(caller)));
                        }
                    }
                }
                std::thread::sleep(WATCH_EVERY);
            }
            hs.into_iter()
                .map(|(peer, asked, h)| {
                    let r = h.join().unwrap_or_else(|_| {
                        Err(Error::Io {
                            context: format!("connecting to rank {peer}"),
                            detail: "the connecting thread panicked".into(),
                        })
                    });
                    (peer, asked, r)
                })
                .collect()
        });
        if let Some(e) = seen {
            return Err(e);
        }
        let kind = match role {
            Role::Pairwise => "pairwise",
            _ => "point-to-point",
        };
        let mut out = Vec::with_capacity(made.len());
        for (peer, asked, r) in made {
            let (links, edges) = match r {
                Ok(made) => made,
                Err(e) if asked => return Err(e),
                Err(e) => {
                    tracing::warn!(target: "ringzero::topology", rank = self.rank, peer,
                        "rank {peer} was connecting to this rank, but joining it failed: {e}");
                    continue;
                }
            };
            for e in &edges {
                tracing::info!(target: "ringzero::topology", rank = self.rank, peer, "{kind} {e}");
            }
            out.push((peer, links));
        }
        Ok(out)
    }

    /// Run connected peers' messages: each peer's `i`-th send and `i`-th receive form its `i`-th
    /// call, numbered on from the pair's counts in each direction.
    fn run_batch(
        &self,
        pairs: &mut BTreeMap<usize, Pair>,
        dtype: DType,
        by_peer: BTreeMap<usize, PeerMsgs>,
    ) -> Result<()> {
        let es = dtype.size();
        let slice_elems = (self.cfg.slice_bytes / es).max(1);
        let fp_of = |c| Fingerprint::new(Collective::SendRecv, Some(dtype), None, c);
        // Plans first: the calls borrow them.
        let plans: Vec<Vec<Plan>> = by_peer
            .values()
            .map(|(sends, recvs)| {
                (0..sends.len().max(recvs.len()))
                    .map(|i| {
                        plan_p2p(
                            sends.get(i).map(|b| b.len() / es),
                            recvs.get(i).map(|b| b.len() / es),
                            slice_elems,
                        )
                    })
                    .collect()
            })
            .collect();
        let mut lanes = Vec::with_capacity(by_peer.len());
        let mut msgs = Vec::new();
        let peers: Vec<usize> = by_peer.keys().copied().collect();
        let peer_msgs = by_peer.into_values().zip(&plans);
        for (pair, ((sends, recvs), plans)) in pairs_of(pairs, &peers).into_iter().zip(peer_msgs) {
            // Numbered now: if the run fails, the communicator fails with it.
            let (sent, received) = (pair.sent, pair.received);
            pair.sent += sends.len() as u64;
            pair.received += recvs.len() as u64;
            let peer = pair.links.next;
            let numbered = |bufs: &[&[u8]], base: u64, send: bool| {
                (base..)
                    .zip(bufs.iter().map(|b| fp_of(b.len() / es)))
                    .map(move |(seq, fp)| (peer, send, seq, fp))
                    .collect::<Vec<_>>()
            };
            msgs.extend(numbered(&sends, sent, true));
            let recv_lens: Vec<&[u8]> = recvs.iter().map(|b| &b[..]).collect();
            msgs.extend(numbered(&recv_lens, received, false));
            let (mut sends, mut recvs) = (sends.into_iter(), recvs.into_iter());
            let calls = plans
                .iter()
                .enumerate()
                .map(|(i, plan)| {
                    let i = i as u64;
                    self.p2p_call(
                        plan,
                        (&fp_of, dtype),
                        (sends.next(), sent + i),
                        (recvs.next(), received + i),
                    )
                })
                .collect();
            lanes.push(Lane::new(&mut pair.links, calls));
        }
        self.tracked(&msgs, || {
            crate::ring::lanes::run_lanes(&mut lanes, self.cfg.timeout, &self.abort)
        })
    }

    /// One call of `plan` over one pair of links: the message it sends (its sequence number in
    /// that direction) and the one it receives, each fingerprinted by `fp_of` its element count.
    pub(super) fn p2p_call<'a>(
        &'a self,
        plan: &'a Plan,
        (fp_of, dtype): (&dyn Fn(usize) -> Fingerprint, DType),
        (send, send_seq): (Option<&'a [u8]>, u64),
        (recv, recv_seq): (Option<&'a mut [u8]>, u64),
    ) -> (Call<'a>, Bufs<'a>) {
        let es = dtype.size();
        let incoming = recv.as_ref().map(|b| (recv_seq, fp_of(b.len() / es)));
        let (seq, fp) = match send {
            Some(b) => (send_seq, fp_of(b.len() / es)),
            None => incoming.expect("a send or a receive"),
        };
        let out_bytes = recv.as_ref().map_or(0, |b| b.len());
        let call = Call {
            n: 2,
            incoming,
            ..self.call(plan, (seq, fp), dtype, ReduceOp::Sum, out_bytes)
        };
        let bufs = Bufs::Split {
            input: send.unwrap_or(&[]),
            output: recv.unwrap_or(&mut []),
        };
        (call, bufs)
    }
}

/// How often [`Inner::connect_missing`] looks at the ring while connecting.
const WATCH_EVERY: std::time::Duration = std::time::Duration::from_millis(2);

/// The ring's incoming link, watched while a collective connects pairs ([`Inner::connect_missing`]).
pub(super) struct Watch<'a> {
    /// The ring's links.
    pub(super) ring: &'a mut Links,
    /// The call's sequence number.
    pub(super) seq: u64,
    /// The frame due next on the ring, where known (the call's announcement): an abort frame
    /// in front of it is seen too, not only a closed or dead peer.
    pub(super) next: Option<Expect>,
}

impl Watch<'_> {
    /// The ring's incoming link while this rank connects to `missing`. Once the ring has
    /// carried all of the call's frames (`next` unknown), its previous rank may have finished
    /// the call and dropped its communicator or exited: that is a failure only if this rank
    /// still waits to connect to it. An abort always is.
    fn check(&mut self, missing: &[usize]) -> std::result::Result<(), LinkError> {
        match self.ring.rx.health() {
            Err(LinkError::Lost(_))
                if self.next.is_none() && !missing.contains(&self.ring.prev) => {}
            r => r?,
        }
        if let Some(x) = &self.next {
            self.ring.rx.peek(x)?;
        }
        Ok(())
    }
}

/// The entries of `peers` (ascending, each present), in that order.
pub(super) fn pairs_of<'p, V>(
    pairs: &'p mut BTreeMap<usize, V>,
    peers: &[usize],
) -> Vec<&'p mut V> {
    let got: Vec<&mut V> = pairs
        .iter_mut()
        .filter(|(p, _)| peers.binary_search(p).is_ok())
        .map(|(_, pair)| pair)
        .collect();
    assert_eq!(got.len(), peers.len(), "every peer was connected first");
    got
}
