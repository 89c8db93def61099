//! How the host communicator runs a call: its shared state ([`Inner`]) building the call,
//! recording it, executing it on the ring or a doubling schedule, and failing it; and the
//! argument checks the collectives share.

use std::collections::BTreeMap;
use std::sync::MutexGuard;

use ringzero_kernels::{DType, ReduceOp};

use crate::config::Algo;
use crate::error::{Error, Result};
use crate::ring::call::Call;
use crate::ring::engine::{self, Bufs, Counters, Links};
use crate::ring::failure;
use crate::ring::{plan, Collective, Count, PlanArgs};
use crate::wire::Fingerprint;

use super::*;

/// A call of `c` refused for `msg` before anything moved.
pub(crate) fn refused(c: Collective, msg: String) -> Error {
    Error::InvalidArgument {
        op: c.to_string(),
        msg,
    }
}

/// Where each rank's block starts in a buffer of `len` elements split by `counts` (`n + 1`
/// offsets, the last `len`), or why `counts` cannot split it.
pub(crate) fn offsets(
    c: Collective,
    (what, counts): (&str, &[usize]),
    n: usize,
    (buf, len): (&str, usize),
) -> Result<Vec<usize>> {
    let bad = |msg: String| refused(c, msg);
    if counts.len() != n {
        return Err(bad(format!(
            "{what} has {} entries but the communicator has {n} ranks (one count per rank)",
            counts.len()
        )));
    }
    let mut at = Vec::with_capacity(n + 1);
    at.push(0usize);
    for &k in counts {
        let next = at[at.len() - 1]
            .checked_add(k)
            .ok_or_else(|| bad(format!("{what} add up to more than usize::MAX elements")))?;
        at.push(next);
    }
    if at[n] != len {
        return Err(bad(format!(
            "{what} add up to {} elements but {buf} has {len}",
            at[n]
        )));
    }
    Ok(at)
}

/// Refuse a buffer (`what`, `len` elements) that should hold this rank's part, `counts[rank]`.
/// `counts` has one entry per rank (checked by [`offsets`] first).
pub(crate) fn own_part(
    c: Collective,
    (what, len): (&str, usize),
    counts: &[usize],
    rank: usize,
) -> Result<()> {
    if len == counts[rank] {
        return Ok(());
    }
    Err(refused(
        c,
        format!(
            "{what} has {len} elements but counts[{rank}] (this rank's part) is {}",
            counts[rank]
        ),
    ))
}

/// The counters of `links` together.
pub(crate) fn links_sum<'a>(links: impl Iterator<Item = &'a Links>) -> Counters {
    links.fold(Counters::default(), |a, l| a + l.counters)
}

pub(crate) fn same_len(
    c: Collective,
    a: usize,
    b: usize,
    a_name: &str,
    b_name: &str,
) -> Result<()> {
    if a == b {
        Ok(())
    } else {
        Err(Error::InvalidArgument {
            op: c.name().into(),
            msg: format!("{a_name} has {a} elements but {b_name} has {b}; they must be equal"),
        })
    }
}

impl Inner {
    pub(super) fn abort(&self, reason: &str) {
        failure::abort(&self.state, &self.abort, self.rank, reason, &self.flight);
        let _st = self.lock();
        self.tell_other_links(&format!("rank {}: {reason}", self.rank));
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The plan of `args`: the last one again where a loop repeats a call (a plan is pure, and
    /// building it allocates), else built and kept. Per-rank `counts` are not kept.
    pub(super) fn plan_of(&self, args: PlanArgs) -> std::sync::Arc<crate::ring::Plan> {
        let key = (args.coll, args.count, args.slice_elems, args.in_place);
        let mut last = self.last_plan.lock().unwrap_or_else(|p| p.into_inner());
        let kept = last
            .as_ref()
            .filter(|(k, _)| args.counts.is_none() && *k == key);
        if let Some((_, p)) = kept {
            return p.clone();
        }
        let p = std::sync::Arc::new(plan(args));
        if args.counts.is_none() {
            *last = Some((key, p.clone()));
        }
        p
    }

    /// A call of `plan` on this communicator (all ranks; frames numbered `seq`, fingerprinted `fp`,
    /// both ways) writing `out_bytes` of results.
    pub(super) fn call<'a>(
        &'a self,
        plan: &'a crate::ring::Plan,
        (seq, fp): (u64, Fingerprint),
        dtype: DType,
        op: ReduceOp,
        out_bytes: usize,
    ) -> Call<'a> {
        let (world, wait) = ((self.size, self.rank), (self.cfg.timeout, &self.abort));
        Call {
            stream_stores: out_bytes >= self.cfg.stream_stores_from,
            ..Call::on(plan, (seq, fp), (dtype, op), world, wait)
        }
    }

    /// Bytes and frames over every link: the ring's and [`Inner::other_links`] (waiting for a
    /// posted session on another thread to end).
    pub(super) fn counters(&self, st: &State) -> Counters {
        let pairs = self.pairs.lock().unwrap_or_else(|p| p.into_inner());
        self.with_ring_and_mesh(st, self.note_pairs(pairs))
    }

    /// [`Inner::counters`] without waiting: while a posted session holds the point-to-point
    /// links, they count as they were when last free (`pairs_seen`; monotone). A ring call's
    /// flight record reads these, so that it never waits for a session (whose messages, on
    /// links of their own, are none of the call's traffic).
    pub(super) fn counters_now(&self, st: &State) -> Counters {
        if !self.others.load(std::sync::atomic::Ordering::Acquire) {
            return links_sum(st.links.iter()) + self.mapped();
        }
        let pairs = match self.pairs.try_lock() {
            Ok(pairs) => self.note_pairs(pairs),
            Err(std::sync::TryLockError::Poisoned(p)) => self.note_pairs(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => {
                *self.pairs_seen.lock().unwrap_or_else(|p| p.into_inner())
            }
        };
        self.with_ring_and_mesh(st, pairs)
    }

    /// The point-to-point links' counters (`pairs` held), noted in `pairs_seen`.
    pub(super) fn note_pairs(&self, pairs: MutexGuard<'_, BTreeMap<usize, Pair>>) -> Counters {
        let seen = links_sum(pairs.values().map(|p| &p.links));
        *self.pairs_seen.lock().unwrap_or_else(|p| p.into_inner()) = seen;
        seen
    }

    /// `pairs` (the point-to-point links' counters) with the ring's and the pairwise links'.
    pub(super) fn with_ring_and_mesh(&self, st: &State, pairs: Counters) -> Counters {
        let mesh = self.mesh.lock().unwrap_or_else(|p| p.into_inner());
        links_sum(st.links.iter().chain(mesh.values())) + pairs + self.mapped()
    }

    /// What the single-copy all-gather read through mappings of shared buffers, as counters.
    fn mapped(&self) -> Counters {
        Counters {
            bytes_mapped: self.direct.get().map_or(0, |d| d.bytes_mapped()),
            ..Counters::default()
        }
    }

    /// [`Communicator::ring_on_shm`](crate::Communicator::ring_on_shm).
    pub(crate) fn ring_on_shm(&self) -> bool {
        self.edges
            .iter()
            .all(|e| e.kind == crate::TransportKind::Shm)
    }

    /// Note that a point-to-point or pairwise link is about to exist (before it is inserted):
    /// counter snapshots take those links from now on.
    pub(super) fn others_exist(&self) {
        self.others
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Run `f` on every link beside the ring's: point-to-point's pairs and the pairwise
    /// collectives' (locked in that order). Call with `state` held.
    pub(super) fn other_links<R>(
        &self,
        f: impl FnOnce(&mut dyn Iterator<Item = &mut Links>) -> R,
    ) -> R {
        let mut pairs = self.pairs.lock().unwrap_or_else(|p| p.into_inner());
        let mut mesh = self.mesh.lock().unwrap_or_else(|p| p.into_inner());
        let mut all = pairs
            .values_mut()
            .map(|p| &mut p.links)
            .chain(mesh.values_mut());
        f(&mut all)
    }

    /// Run one call that passed its checks: take its sequence number, record it in the flight
    /// recorder, and fail the communicator if it fails (bad arguments found late excepted).
    pub(super) fn recorded(
        &self,
        st: &mut State,
        fp: &Fingerprint,
        in_place: bool,
        bytes: u64,
        run: impl FnOnce(&mut State) -> Result<()>,
    ) -> Result<()> {
        let seq = st.seq;
        st.seq += 1;
        if let Some(d) = self.direct.get() {
            d.now_in(seq, fp);
        }
        self.flight
            .begin(seq, fp, in_place, bytes, self.counters_now(st));
        let r = run(st);
        self.flight.end(&r, self.counters_now(st));
        if let Err(e) = &r {
            self.fail(st, e);
        }
        r
    }

    /// A call failed with `e`: unless it only refused its arguments, fail the communicator and
    /// tell every peer this rank has a link with.
    pub(super) fn fail(&self, st: &mut State, e: &Error) {
        let who = failure::Failing {
            rank: self.rank,
            flag: &self.abort,
            flight: &self.flight,
            kind: "host",
        };
        failure::fail(st, &who, e, |why| self.tell_other_links(why));
    }

    /// Tell the peers of the links beside the ring's ([`Inner::other_links`]) that this rank
    /// aborts. Call with `state` held.
    pub(super) fn tell_other_links(&self, why: &str) {
        if let Some(d) = self.direct.get() {
            d.abort(why);
        }
        self.other_links(|others| others.for_each(|l| l.abort(why)));
    }

    /// A ring collective, or its doubling schedule where the configured algorithm picks that
    /// for this size ([`Inner::execute_by`]).
    /// [`Communicator::nodes`]: 1 before the ranks have told each other where they run (or on
    /// one rank).
    pub(crate) fn nodes(&self) -> usize {
        self.peers.get().map_or(1, |peers| {
            let nodes: std::collections::BTreeSet<&str> =
                peers.iter().map(|p| p.node.as_str()).collect();
            nodes.len()
        })
    }

    pub(super) fn execute(
        &self,
        coll: Collective,
        dtype: Option<DType>,
        op: ReduceOp,
        count: Count,
        in_place: bool,
        bufs: Bufs,
    ) -> Result<()> {
        self.execute_by(self.cfg.algo, coll, (dtype, op), count, in_place, bufs)
    }

    /// [`Inner::execute`] by `algo`: the collectives that have a doubling schedule (all-reduce,
    /// broadcast, reduce, barrier) run the one `algo` picks for this size and world, if any;
    /// every other call runs the ring.
    pub(super) fn execute_by(
        &self,
        algo: Algo,
        coll: Collective,
        (dtype, op): (Option<DType>, ReduceOp),
        count: Count,
        in_place: bool,
        bufs: Bufs,
    ) -> Result<()> {
        let bytes = count.total.saturating_mul(dtype.map_or(1, DType::size));
        if let Some(sched) = algo.schedule(coll, bytes, self.size, self.ring_on_shm()) {
            if count.parts.is_none() {
                let call = (sched, coll, dtype, op);
                return self.by_doubling(call, count.total, in_place, bufs);
            }
        }
        let mut st = self.lock();
        let dt = dtype.unwrap_or(DType::U8);
        let fp = Fingerprint::new(coll, dtype, Some(op), count.total);
        let fp = count.parts.map_or(fp, |c| fp.with_counts(c));
        let direct = self
            .direct
            .get()
            .filter(|d| d.takes(coll, count.parts.is_none(), bytes));
        let fp = if direct.is_some() {
            fp.single_copy()
        } else {
            fp
        };
        let seq = st.seq;
        failure::refuse(st.failed.as_ref(), &self.abort, &fp, seq)?;
        let slot_bytes = st.links.as_ref().map_or(self.cfg.slice_bytes, |l| {
            l.tx.slot_bytes().min(self.cfg.slice_bytes)
        });
        let p = self.plan_of(PlanArgs {
            coll,
            n: self.size,
            rank: self.rank,
            count: count.total,
            slice_elems: (slot_bytes / dt.size()).max(1),
            in_place,
            counts: count.parts,
        });
        let call = self.call(&p, (seq, fp), dt, op, bufs.output_bytes());
        // Refused calls consume no sequence number: the ranks stay in step.
        engine::check_sizes(&call, &bufs)?;
        let bytes = (count.total * dt.size()) as u64;
        let mut bufs = bufs;
        self.recorded(&mut st, &fp, in_place, bytes, |st| {
            if let Some(d) = direct {
                if d.all_gather(&call, count.total, &mut bufs)? {
                    return Ok(());
                }
            }
            match st.links.as_mut() {
                Some(links) => engine::run(links, &call, bufs),
                None => engine::run_local(&call, bufs),
            }
        })
    }
}
