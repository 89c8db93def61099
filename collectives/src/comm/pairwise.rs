//! Collectives over the point-to-point links: all-to-all with a count per pair of ranks,
//! all-gather of parts of different sizes (on one node, and small ones across nodes: larger
//! ones go round the ring there, see
//! [`Algo::gathers_v_pairwise`](crate::Algo::gathers_v_pairwise)), gather and scatter.
//!
//! A ring has no schedule for these (their messages differ per pair of ranks, or all meet at
//! one root), so each rank exchanges one message each way with every peer concerned, all at once:
//! one [`engine::Lane`] per peer over the pair's own links, each message sliced as
//! `send_recv` slices it ([`plan_p2p`]). The links are the pair's own for these collectives
//! (`Inner::mesh`, connected by the first pairwise collective that needs them), apart from its
//! point-to-point ones, so messages sent and not yet received never stand in their way. They are collectives all the same: every rank calls
//! them in the same order as its other collectives, each takes the communicator's next sequence
//! number (its frames carry it both ways, with the collective and that pair's count as the
//! fingerprint, so a peer that disagrees on a count fails with an [`Error::Mismatch`](crate::Error::Mismatch) naming
//! both), and each is an entry of the flight record. Each rank sends only its own data, once
//! per peer that needs it: the volume of a ring's all-gather, straight to where it goes.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::MutexGuard;

use ringzero_kernels::{DType, ReduceOp};

use super::pairs::{pairs_of, Watch};
use super::{offsets, own_part, refused, Communicator, Inner, State};
use crate::bootstrap::Role;
use crate::error::Result;
use crate::ring::engine::{self, Bufs, Links};
use crate::ring::failure;
use crate::ring::lanes::Lane;
use crate::ring::{plan, plan_p2p, Collective, Count, Plan, PlanArgs};
use crate::wire::Fingerprint;

/// This rank's message to and from one peer in a pairwise collective. Either may be absent; an
/// empty one still travels (it carries the fingerprint).
struct Exchange<'a> {
    peer: usize,
    send: Option<&'a [u8]>,
    recv: Option<&'a mut [u8]>,
}

impl Communicator {
    /// Where each rank's block starts in an all-to-all-v's `send` and `recv` (elements), or why
    /// the counts do not fit the buffers (lengths in elements). Checked before the call takes a
    /// sequence number, by its blocking and asynchronous forms alike.
    pub(super) fn all_to_all_v_layout(
        &self,
        send: (&[usize], usize),
        recv: (&[usize], usize),
    ) -> Result<(Vec<usize>, Vec<usize>)> {
        all_to_all_v_layout((self.rank(), self.size()), send, recv)
    }
}

/// [`Communicator::all_to_all_v_layout`] for rank `r` of `n` (device communicators check alike).
pub(crate) fn all_to_all_v_layout(
    (r, n): (usize, usize),
    (send_counts, send_len): (&[usize], usize),
    (recv_counts, recv_len): (&[usize], usize),
) -> Result<(Vec<usize>, Vec<usize>)> {
    let c = Collective::AllToAllV;
    let sd = offsets(c, ("send_counts", send_counts), n, ("send", send_len))?;
    let rd = offsets(c, ("recv_counts", recv_counts), n, ("recv", recv_len))?;
    if send_counts[r] != recv_counts[r] {
        return Err(refused(
            c,
            format!(
                "send_counts[{r}] is {} but recv_counts[{r}] is {}: this rank's own block is \
                 copied locally, so they must be equal",
                send_counts[r], recv_counts[r]
            ),
        ));
    }
    Ok((sd, rd))
}

impl Communicator {
    /// Where each rank's part starts in an all-gather-v's `recv`, or why `counts` do not fit
    /// `send` (this rank's part) and `recv` (lengths in elements).
    pub(super) fn all_gather_v_layout(
        &self,
        send_len: usize,
        (counts, recv_len): (&[usize], usize),
    ) -> Result<Vec<usize>> {
        let c = Collective::AllGatherV;
        let at = offsets(c, ("counts", counts), self.size(), ("recv", recv_len))?;
        own_part(c, ("send", send_len), counts, self.rank())?;
        Ok(at)
    }

    /// Refuse a gather or scatter (`c`) whose root is no rank, or whose root's whole buffer
    /// (`whole`: its name and length) is not `size()` blocks of `block` (name, length; lengths
    /// in elements).
    pub(super) fn blocks_check(
        &self,
        c: Collective,
        (block, block_len): (&str, usize),
        (whole, whole_len): (&str, usize),
    ) -> Result<()> {
        let root = c.root().expect("gather and scatter have a root");
        let c = self.rooted(c, root)?;
        let n = self.size();
        if self.rank() == root && block_len.checked_mul(n) != Some(whole_len) {
            let verb = if matches!(c, Collective::Gather { .. }) {
                "gathers"
            } else {
                "scatters"
            };
            return Err(refused(
                c,
                format!(
                    "{whole} has {whole_len} elements but the root {verb} {n} × {block_len} (the \
                     world size times {block}'s length)"
                ),
            ));
        }
        Ok(())
    }
}

impl Inner {
    /// [`Communicator::all_to_all_v`](crate::Collectives::all_to_all_v) on bytes of `dtype`, its blocks at the offsets (in
    /// elements) that [`Communicator::all_to_all_v_layout`] found.
    pub(super) fn all_to_all_v(
        &self,
        dtype: DType,
        (send, sd): (&[u8], &[usize]),
        (recv, rd): (&mut [u8], &[usize]),
    ) -> Result<()> {
        let (c, r, es) = (Collective::AllToAllV, self.rank, dtype.size());
        let block = |p: usize| &send[sd[p] * es..sd[p + 1] * es];
        let recvs = split_mut(recv, rd, es);
        let (own, ex) = from_every_peer(recvs, r, |p| Some(block(p)));
        // Counts differ by rank: the call as a whole has none (every rank records the same call).
        let fp = Fingerprint::new(c, Some(dtype), None, usize::MAX);
        let bytes = send.len() as u64;
        self.pairwise((fp, dtype), (bytes, false), Some((block(r), own)), None, ex)
    }

    /// [`Communicator::all_gather_v`](crate::Collectives::all_gather_v) on bytes of `dtype`, the parts at offsets `at` (in
    /// elements) of `recv`; in place (this rank's part of `recv` is sent) where `send` is
    /// `None`. Pairwise or round the ring, as `algo` says.
    pub(super) fn all_gather_v(
        &self,
        algo: crate::Algo,
        dtype: DType,
        send: Option<&[u8]>,
        recv: &mut [u8],
        at: &[usize],
    ) -> Result<()> {
        let (c, r, es) = (Collective::AllGatherV, self.rank, dtype.size());
        let total = at[at.len() - 1];
        let bytes = total * es;
        if !algo.gathers_v_pairwise(bytes, self.size, self.nodes()) {
            let counts: Vec<usize> = at.windows(2).map(|w| w[1] - w[0]).collect();
            let count = Count::parts(total, &counts);
            let (bufs, in_place) = match send {
                Some(input) => (
                    Bufs::Split {
                        input,
                        output: recv,
                    },
                    false,
                ),
                None => (Bufs::One(recv), true),
            };
            return self.execute(c, Some(dtype), ReduceOp::Sum, count, in_place, bufs);
        }
        let mut recvs = split_mut(recv, at, es);
        let (send, local) = match send {
            Some(send) => (send, true),
            // In place: this rank's part is what it sends, and nothing is copied locally.
            None => (&*std::mem::take(&mut recvs[r]), false),
        };
        let (own, ex) = from_every_peer(recvs, r, |_| Some(send));
        let fp = Fingerprint::new(c, Some(dtype), None, total);
        let local = local.then_some((send, own));
        let recorded = (bytes as u64, local.is_none());
        self.pairwise((fp, dtype), recorded, local, None, ex)
    }

    /// [`Communicator::gather`](crate::Collectives::gather) on bytes of `dtype` (checked by
    /// [`Communicator::blocks_check`]).
    pub(super) fn gather(
        &self,
        dtype: DType,
        send: &[u8],
        recv: &mut [u8],
        root: usize,
    ) -> Result<()> {
        let c = Collective::Gather { root };
        let (n, r, es) = (self.size, self.rank, dtype.size());
        let count = send.len() / es;
        let (local, ex) = if r == root {
            let d: Vec<usize> = (0..=n).map(|i| i * count).collect();
            let recvs = split_mut(recv, &d, es);
            let (own, ex) = from_every_peer(recvs, r, |_| None);
            (Some((send, own)), ex)
        } else {
            let to_root = Exchange {
                peer: root,
                send: Some(send),
                recv: None,
            };
            (None, vec![to_root])
        };
        let fp = Fingerprint::new(c, Some(dtype), None, count);
        // The flight record's size is the root's whole buffer, as for the bench.
        let bytes = n.saturating_mul(send.len()) as u64;
        self.pairwise((fp, dtype), (bytes, false), local, None, ex)
    }

    /// [`Communicator::scatter`](crate::Collectives::scatter) on bytes of `dtype` (checked by
    /// [`Communicator::blocks_check`]).
    pub(super) fn scatter(
        &self,
        dtype: DType,
        send: &[u8],
        recv: &mut [u8],
        root: usize,
    ) -> Result<()> {
        let c = Collective::Scatter { root };
        let (n, r, es) = (self.size, self.rank, dtype.size());
        let count = recv.len() / es;
        let bytes = n.saturating_mul(recv.len()) as u64;
        let (local, ex) = if r == root {
            let block = |p: usize| &send[p * recv.len()..(p + 1) * recv.len()];
            let ex: Vec<Exchange> = (0..n)
                .filter(|&p| p != r)
                .map(|peer| Exchange {
                    peer,
                    send: Some(block(peer)),
                    recv: None,
                })
                .collect();
            (Some((block(r), recv)), ex)
        } else {
            let from_root = Exchange {
                peer: root,
                send: None,
                recv: Some(recv),
            };
            (None, vec![from_root])
        };
        let fp = Fingerprint::new(c, Some(dtype), None, count);
        self.pairwise((fp, dtype), (bytes, false), local, None, ex)
    }

    /// [`Communicator::all_to_all`](crate::Collectives::all_to_all) on bytes (`count` elements of `dtype`, a multiple of the
    /// world size, checked): one round of pairwise exchanges, the one with the next rank's block
    /// out and the previous rank's in over the ring's own links, every other over the pairs'.
    pub(super) fn all_to_all(
        &self,
        dtype: DType,
        count: usize,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<()> {
        let (n, r) = (self.size, self.rank);
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let es = dtype.size();
        let block = count / n;
        let blk = |p: usize| &input[p * block * es..(p + 1) * block * es];
        let bounds: Vec<usize> = (0..=n).map(|i| i * block).collect();
        let mut outs: Vec<Option<&mut [u8]>> = split_mut(output, &bounds, es)
            .into_iter()
            .map(Some)
            .collect();
        let own = outs[r].take().expect("every block is there");
        let ring = (n > 1).then(|| (blk(next), outs[prev].take().expect("prev is not this rank")));
        // The rest: to every peer but the next rank, from every peer but the previous one
        // (with two ranks, nothing is left).
        let ex = (0..n)
            .filter(|&p| p != r)
            .map(|peer| Exchange {
                peer,
                send: (peer != next).then(|| blk(peer)),
                recv: outs[peer].take(),
            })
            .filter(|e| e.send.is_some() || e.recv.is_some())
            .collect();
        let fp = Fingerprint::new(Collective::AllToAll, Some(dtype), None, count);
        let bytes = (count * es) as u64;
        self.pairwise((fp, dtype), (bytes, false), Some((blk(r), own)), ring, ex)
    }

    /// Run a pairwise collective fingerprinted `fp` as a whole: take the next sequence number,
    /// copy this rank's own block (`local`), then every exchange at once, each peer's as one
    /// lane. `ex` is in ascending peer order.
    ///
    /// `ring`, when given, is this rank's message to the next rank and the one from the previous
    /// rank, over the ring's own links (`ex` then leaves those directions out): all-to-all's.
    /// Every other pairwise collective sends an empty message around the ring instead (its
    /// announcement, at the same time as the exchanges). Either way a rank whose neighbour
    /// called a ring collective, or another pairwise one, meets its frame and both fail at once
    /// with the two calls named; a failing rank aborts and tells every peer, so the whole job
    /// learns within a hop, not at the deadline. The ring frames carry the whole call's
    /// fingerprint, as ring collectives' do; the other collectives' pair frames carry each
    /// message's count.
    fn pairwise(
        &self,
        (fp, dtype): (Fingerprint, DType),
        (bytes, in_place): (u64, bool),
        local: Option<(&[u8], &mut [u8])>,
        ring: Option<(&[u8], &mut [u8])>,
        ex: Vec<Exchange<'_>>,
    ) -> Result<()> {
        let coll = Collective::from_code(fp.coll, fp.root as usize)
            .expect("a fingerprint made here names a collective");
        let whole = ring.is_some();
        let announce = (ring.is_none() && self.size > 1).then(|| (&[][..], &mut [][..]));
        let ring = ring.or(announce);
        let fp_of = |c| {
            if whole {
                fp
            } else {
                Fingerprint::new(coll, Some(dtype), None, c)
            }
        };
        let mut st = self.lock();
        let seq = st.seq;
        failure::refuse(st.failed.as_ref(), &self.abort, &fp, seq)?;
        self.recorded(&mut st, &fp, in_place, bytes, |st| {
            if let Some((from, to)) = local {
                to.copy_from_slice(from);
            }
            let es = dtype.size();
            let slice_elems = (self.cfg.slice_bytes / es).max(1);
            let len = |b: &[u8]| b.len() / es;
            // Plans first: the calls borrow them. A frame must fit the ring's slots too.
            let ring_slice = st.links.as_ref().map_or(slice_elems, |l| {
                (l.tx.slot_bytes().min(self.cfg.slice_bytes) / es).max(1)
            });
            let ring_plan = ring
                .as_ref()
                .map(|(s, r)| plan_p2p(Some(len(s)), Some(len(r)), ring_slice));
            let plans: Vec<Plan> = ex
                .iter()
                .map(|e| plan_p2p(e.send.map(len), e.recv.as_deref().map(len), slice_elems))
                .collect();
            let peers: Vec<usize> = ex.iter().map(|e| e.peer).collect();
            let mut mesh = self.mesh_for(st, (seq, &fp, dtype), || call_pairs(coll, self.size))?;
            let whole = |_| fp;
            let mut ring = ring.zip(ring_plan.as_ref());
            if mesh.connects {
                // All-to-all's ring messages before connecting (and the announcement, though
                // the pass in `mesh_for` has done its work).
                if let (Some(((s, r), plan)), Some(links)) = (ring.take(), st.links.as_mut()) {
                    let call = self.p2p_call(plan, (&whole, dtype), (Some(s), seq), (Some(r), seq));
                    let lane = Lane::new(links, vec![call]);
                    crate::ring::lanes::run_lanes(&mut [lane], self.cfg.timeout, &self.abort)?;
                }
                // The ring has carried this call's frames: what comes next is unknown.
                let watch = st.links.as_mut().map(|ring| Watch {
                    ring,
                    seq,
                    next: None,
                });
                mesh.connect(self, &peers, (seq, &fp), watch)?;
            }
            let ring_lane = match (ring, st.links.as_mut()) {
                (Some(((s, r), plan)), Some(links)) => {
                    let call = self.p2p_call(plan, (&whole, dtype), (Some(s), seq), (Some(r), seq));
                    Some(Lane::new(links, vec![call]))
                }
                _ => None,
            };
            let mesh_lanes = pairs_of(&mut mesh.links, &peers)
                .into_iter()
                .zip(ex.into_iter().zip(&plans))
                .map(|(links, (e, plan))| {
                    // Both directions carry the collective's own sequence number.
                    let call = self.p2p_call(plan, (&fp_of, dtype), (e.send, seq), (e.recv, seq));
                    Lane::new(links, vec![call])
                });
            let mut lanes: Vec<Lane> = ring_lane.into_iter().chain(mesh_lanes).collect();
            crate::ring::lanes::run_lanes(&mut lanes, self.cfg.timeout, &self.abort)
        })
    }
}

/// The pairs' own links (`Inner::mesh`), locked for one call, and whether that call connects
/// some of them first ([`Inner::mesh_for`]).
pub(super) struct Mesh<'a> {
    pub(super) links: MutexGuard<'a, BTreeMap<usize, Links>>,
    known: MutexGuard<'a, BTreeSet<(usize, usize)>>,
    wanted: Vec<(usize, usize)>,
    /// Whether some pair of the call is not connected yet (the same answer on every rank).
    pub(super) connects: bool,
}

impl Inner {
    /// Lock the pairs' links for the call (`seq`, `fp`), which exchanges between the pairs
    /// `pairs()` lists (lower rank first, whatever this rank's place). When some of them are not
    /// connected yet (every rank knows alike: they all connect the same pairs in the same
    /// calls), first make sure every rank made this call: an empty frame carrying it goes all
    /// the way round the ring (a barrier's n − 1 hops), and a rank that finishes has checked,
    /// through its neighbours', every rank's fingerprint. A rank that called something else
    /// fails there, and its abort travels the same way, so no rank is left dialling a peer that
    /// will never answer. Then [`Mesh::connect`] connects this rank's missing links.
    pub(super) fn mesh_for(
        &self,
        st: &mut State,
        (seq, fp, dtype): (u64, &Fingerprint, DType),
        pairs: impl FnOnce() -> Vec<(usize, usize)>,
    ) -> Result<Mesh<'_>> {
        let links = self.mesh.lock().unwrap_or_else(|p| p.into_inner());
        let known = self.mesh_pairs.lock().unwrap_or_else(|p| p.into_inner());
        // Once every pair is connected (the usual steady state) no call connects: skip listing
        // the call's pairs.
        let n = self.size;
        let wanted = if known.len() < n * (n - 1) / 2 {
            pairs()
        } else {
            Vec::new()
        };
        let connects = wanted.iter().any(|p| !known.contains(p));
        if let (true, Some(ring)) = (connects, st.links.as_mut()) {
            let agree = plan(PlanArgs {
                coll: Collective::Barrier,
                n,
                rank: self.rank,
                count: 0,
                slice_elems: 1,
                in_place: false,
                counts: None,
            });
            let call = self.call(&agree, (seq, *fp), dtype, ReduceOp::Sum, 0);
            engine::run(ring, &call, Bufs::One(&mut []))?;
        }
        Ok(Mesh {
            links,
            known,
            wanted,
            connects,
        })
    }
}

impl Mesh<'_> {
    /// Connect this rank's missing links with `peers` (all among the call's pairs), all at once,
    /// watching the ring meanwhile (`watch`: see [`Inner::connect_missing`]).
    pub(super) fn connect(
        &mut self,
        inner: &Inner,
        peers: &[usize],
        (seq, fp): (u64, &Fingerprint),
        watch: Option<Watch<'_>>,
    ) -> Result<()> {
        let me = inner.rank;
        debug_assert!(
            peers
                .iter()
                .all(|&p| self.wanted.contains(&(p.min(me), p.max(me)))),
            "{fp}: rank {me} exchanges with {peers:?}, outside {:?}",
            self.wanted
        );
        let made = inner
            .connect_missing(
                &self.links,
                peers.iter().copied(),
                fp,
                Role::Pairwise,
                watch,
            )
            .map_err(|e| e.at_seq(seq))?;
        if !made.is_empty() {
            inner.others_exist();
        }
        self.links.extend(made);
        self.known.extend(self.wanted.drain(..));
        Ok(())
    }
}

/// The pairs of ranks (lower first) that pairwise collective `coll` exchanges between on `n`
/// ranks, whatever this rank's place: the root with every other rank for gather and scatter;
/// every pair for the others, except all-to-all on two ranks (whose one pair is the ring's).
fn call_pairs(coll: Collective, n: usize) -> Vec<(usize, usize)> {
    let all = (0..n).flat_map(|i| (i + 1..n).map(move |j| (i, j)));
    match coll {
        Collective::Gather { root } | Collective::Scatter { root } => (0..n)
            .filter(|&j| j != root)
            .map(|j| (j.min(root), j.max(root)))
            .collect(),
        Collective::AllToAll if n <= 2 => Vec::new(),
        _ => all.collect(),
    }
}

/// Rank `r`'s own block of `recvs` (one per rank, in rank order), and an exchange with every
/// other rank: receive its block, send it `send(peer)`.
fn from_every_peer<'a>(
    mut recvs: Vec<&'a mut [u8]>,
    r: usize,
    send: impl Fn(usize) -> Option<&'a [u8]>,
) -> (&'a mut [u8], Vec<Exchange<'a>>) {
    let own = std::mem::take(&mut recvs[r]);
    let ex = recvs
        .into_iter()
        .enumerate()
        .filter(|&(p, _)| p != r)
        .map(|(peer, recv)| Exchange {
            peer,
            send: send(peer),
            recv: Some(recv),
        })
        .collect();
    (own, ex)
}

/// `buf` cut into the blocks between consecutive `offsets` (in elements of `es` bytes).
fn split_mut<'a>(mut buf: &'a mut [u8], offsets: &[usize], es: usize) -> Vec<&'a mut [u8]> {
    offsets
        .windows(2)
        .map(|w| {
            let (block, rest) = std::mem::take(&mut buf).split_at_mut((w[1] - w[0]) * es);
            buf = rest;
            block
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_calls_pairs_are_the_same_whichever_rank_asks() {
        assert_eq!(
            call_pairs(Collective::Gather { root: 1 }, 3),
            [(0, 1), (1, 2)]
        );
        assert_eq!(call_pairs(Collective::Scatter { root: 0 }, 2), [(0, 1)]);
        assert_eq!(
            call_pairs(Collective::AllGatherV, 3),
            [(0, 1), (0, 2), (1, 2)]
        );
        assert_eq!(call_pairs(Collective::AllToAllV, 4).len(), 6);
        // Two ranks' all-to-all runs over the ring alone; three ranks' needs every pair.
        assert!(call_pairs(Collective::AllToAll, 2).is_empty());
        assert_eq!(call_pairs(Collective::AllToAll, 3).len(), 3);
        assert!(call_pairs(Collective::AllGatherV, 1).is_empty());
    }

    #[test]
    fn offsets_split_a_buffer_or_say_why_not() {
        let c = Collective::AllToAllV;
        assert_eq!(
            offsets(c, ("send_counts", &[2, 0, 3]), 3, ("send", 5)).unwrap(),
            [0, 2, 2, 5]
        );
        let e = offsets(c, ("send_counts", &[2, 3]), 3, ("send", 5)).unwrap_err();
        assert!(
            e.to_string()
                .contains("2 entries but the communicator has 3 ranks"),
            "{e}"
        );
        let e = offsets(c, ("recv_counts", &[2, 3, 1]), 3, ("recv", 5)).unwrap_err();
        assert!(
            e.to_string()
                .contains("add up to 6 elements but recv has 5"),
            "{e}"
        );
        let e = offsets(c, ("counts", &[usize::MAX, 1]), 2, ("recv", 0)).unwrap_err();
        assert!(e.to_string().contains("more than usize::MAX"), "{e}");
        let mut buf = [0u8, 1, 2, 3, 4, 5, 6, 7, 8, 9];
        let parts = split_mut(&mut buf, &[0, 2, 2, 5], 2);
        let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
        assert_eq!(lens, [4, 0, 6]);
        assert_eq!(parts[2], [4, 5, 6, 7, 8, 9]);
    }
}
