//! Stage 3's gathered parameters, by parameter: which ones the trainer holds, which buckets that
//! keeps gathered, and the order the trainer gathers them in, replayed to prefetch. Pure
//! bookkeeping (no memory, no collectives): the engine asks it what to gather, release and
//! prefetch, and does it.
//!
//! - **Liveness by parameter.** Communication moves whole buckets (a bucket packs several
//!   parameters), but a bucket stays gathered while any of its parameters is live: releasing
//!   `fc1.weight` keeps the bucket that `fc1.bias` or `fc2.weight` still needs, and it goes when
//!   its last live parameter is released.
//! - **Persistent parameters** (`stage3_param_persistence_threshold`: fewer elements than it)
//!   stay gathered: releasing one changes nothing, and its bucket stays until the optimizer
//!   step, after which the engine gathers it again (the values changed).
//! - **The recorded order.** Each optimizer step's micro-steps record every parameter gathered,
//!   in order (forward's and backward's gathers alike). Once a step has been recorded, every
//!   gather that follows the record moves a cursor along it, and the buckets of the parameters next in it are
//!   prefetched, within `stage3_prefetch_bucket_size` elements in flight and
//!   `stage3_max_live_parameters` elements gathered or in flight. A gather that leaves the
//!   record stops the prefetching for the rest of the step, and the step's own order becomes
//!   the record at the step: a changed order costs prefetching for one step, never a wrong
//!   result (what is gathered is always what the trainer asked for; a prefetch is only taken
//!   by a later gather or dropped at the step).
//! - **Reuse.** A bucket whose last live parameter is released stays gathered when the record
//!   says one of its parameters is gathered again soon: after fewer than
//!   `stage3_max_reuse_distance` elements of other parameters' gathers, DeepSpeed's rule (0
//!   releases at once). A trainer that gathers module by module releases a bucket the next
//!   module shares and would gather it again at once; one that gathers in forward and again in
//!   backward keeps what backward gathers soon. A kept bucket goes at the next release where
//!   its reuse is no longer that near (or the step left the record), and at the optimizer step
//!   (its values change).

use crate::error::ZeroError;
use crate::partition::Partition;

/// Stage 3's liveness and order (see the module docs).
pub(crate) struct Live {
    /// Per parameter: gathered by the trainer and not released.
    live: Vec<bool>,
    /// Per parameter: fewer elements than the persistence threshold.
    persistent: Vec<bool>,
    /// Per bucket: its live parameters.
    count: Vec<usize>,
    /// The last recorded step's gathers, in order (parameter indices).
    order: Vec<usize>,
    /// This step's order so far.
    recording: Vec<usize>,
    /// How far this step follows `order`; `None` once it left it.
    at: Option<usize>,
    /// Per bucket: kept gathered with no live parameter, for a reuse the record says is near.
    kept: Vec<bool>,
}

/// What a gather asks of the engine.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Gather {
    /// Buckets to gather now (or to take from their prefetch), in order.
    pub(crate) fetch: Vec<usize>,
}

impl Live {
    /// Nothing live, nothing recorded, for the parameters of `part`; parameters with fewer than
    /// `threshold` elements are persistent.
    pub(crate) fn new(part: &Partition, threshold: usize) -> Live {
        let np = part.specs.len();
        Live {
            live: vec![false; np],
            persistent: part.slots.iter().map(|s| s.len < threshold).collect(),
            count: vec![0; part.buckets.len()],
            order: Vec::new(),
            recording: Vec::new(),
            at: Some(0),
            kept: vec![false; part.buckets.len()],
        }
    }

    /// Mark `params` live (refused, changing nothing, when one is live already; `names` names
    /// them); the buckets to fetch are those with no live parameter before and not `held`
    /// (gathered for a persistent parameter, say).
    pub(crate) fn gather(
        &mut self,
        part: &Partition,
        params: &[usize],
        held: impl Fn(usize) -> bool,
    ) -> Result<Gather, ZeroError> {
        if let Some(&p) = params.iter().find(|&&p| self.live[p]) {
            return Err(ZeroError::AlreadyGathered(part.specs[p].name.clone()));
        }
        let mut fetch = Vec::new();
        for &p in params {
            self.live[p] = true;
            let b = part.slots[p].bucket;
            if self.count[b] == 0 && !held(b) && !fetch.contains(&b) {
                fetch.push(b);
            }
            self.count[b] += 1;
            self.kept[b] = false;
            self.recording.push(p);
            self.at = match self.at {
                Some(i) if self.order.get(i) == Some(&p) => Some(i + 1),
                _ => None,
            };
        }
        Ok(Gather { fetch })
    }

    /// Mark `params` not live (refused, changing nothing, when one is not live); the buckets
    /// to drop: those left with no live parameter and none persistent, unless reused within
    /// `reuse` elements by the record (then kept), and buckets kept before whose reuse is no
    /// longer that near.
    pub(crate) fn release(
        &mut self,
        part: &Partition,
        params: &[usize],
        reuse: usize,
    ) -> Result<Vec<usize>, ZeroError> {
        if let Some(&p) = params.iter().find(|&&p| !self.live[p]) {
            return Err(ZeroError::NotGathered(part.specs[p].name.clone()));
        }
        let mut idle = Vec::new();
        for &p in params {
            self.live[p] = false;
            let b = part.slots[p].bucket;
            self.count[b] -= 1;
            if self.count[b] == 0 && !self.pins(part, b) && !idle.contains(&b) {
                idle.push(b);
            }
        }
        // A kept bucket has no live parameter, so none is in `idle` already.
        idle.extend((0..self.kept.len()).filter(|&b| self.kept[b]));
        let mut drop = Vec::new();
        if idle.is_empty() {
            return Ok(drop);
        }
        let soon = self.reused_soon(part, reuse);
        for b in idle {
            self.kept[b] = soon[b];
            if !soon[b] {
                drop.push(b);
            }
        }
        Ok(drop)
    }

    /// Per bucket: whether the record, from where this step stands in it, gathers one of its
    /// parameters after fewer than `reuse` elements of other parameters' gathers (one pass over
    /// the record, as far as `reuse` reaches).
    fn reused_soon(&self, part: &Partition, reuse: usize) -> Vec<bool> {
        let mut soon = vec![false; part.buckets.len()];
        let Some(at) = self.at else {
            return soon;
        };
        let mut before = 0usize;
        for &p in self.order.iter().skip(at) {
            if before >= reuse {
                break;
            }
            soon[part.slots[p].bucket] = true;
            before = before.saturating_add(part.slots[p].len);
        }
        soon
    }

    /// Forget what this step recorded so far and follow the record from its start again (the
    /// gathers before were no part of training); the buckets kept for a reuse, to drop.
    pub(crate) fn restart_step(&mut self) -> Vec<usize> {
        self.recording.clear();
        self.at = Some(0);
        self.take_kept()
    }

    /// The buckets kept for a reuse, now to drop (the optimizer step changes their values).
    pub(crate) fn take_kept(&mut self) -> Vec<usize> {
        let kept = (0..self.kept.len()).filter(|&b| self.kept[b]).collect();
        self.kept.iter_mut().for_each(|k| *k = false);
        kept
    }

    /// Whether bucket `b` holds a persistent parameter (it stays gathered between steps).
    pub(crate) fn pins(&self, part: &Partition, b: usize) -> bool {
        part.buckets[b].params.iter().any(|&p| self.persistent[p])
    }

    /// Live parameters' names, for the step's refusal ("release them first").
    pub(crate) fn live_names(&self, part: &Partition) -> Vec<String> {
        (0..self.live.len())
            .filter(|&p| self.live[p] && !self.persistent[p])
            .map(|p| format!("`{}`", part.specs[p].name))
            .collect()
    }

    /// The buckets to prefetch after a gather: those of the parameters next in the record,
    /// in order, skipping buckets `busy` (gathered or in flight), while the elements in flight
    /// (`flying`, each adding its bucket and shard) stay within `budget` and those gathered or
    /// in flight (`held_elems`, each adding its bucket) within `max_live`; with the elements
    /// each will hold in flight. Empty before a step has been recorded, and once this step
    /// left the record.
    pub(crate) fn next_prefetch(
        &self,
        part: &Partition,
        busy: impl Fn(usize) -> bool,
        (mut flying, budget): (usize, usize),
        (mut held_elems, max_live): (usize, usize),
    ) -> Vec<(usize, usize)> {
        let Some(at) = self.at else {
            return Vec::new();
        };
        let mut out: Vec<(usize, usize)> = Vec::new();
        for &p in self.order.iter().skip(at) {
            let b = part.slots[p].bucket;
            if busy(b) || out.iter().any(|&(o, _)| o == b) {
                continue;
            }
            let len = part.buckets[b].len;
            let in_flight = len + len / part.world;
            if flying + in_flight > budget || held_elems + len > max_live {
                break;
            }
            flying += in_flight;
            held_elems += len;
            out.push((b, in_flight));
        }
        out
    }

    /// The optimizer step: this step's order becomes the record (when it followed the old one
    /// to the end, the two are the same), and the next step starts at its beginning.
    pub(crate) fn end_step(&mut self) {
        self.order = std::mem::take(&mut self.recording);
        self.at = Some(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::partition::ParamSpec;

    /// Two buckets of 4 ranks: `a`, `b` (bucket 0), `c` (bucket 1); `tiny` (3 elements) in
    /// bucket 1.
    fn part() -> Partition {
        let specs = [
            ParamSpec::new("a", &[8]),
            ParamSpec::new("b", &[8]),
            ParamSpec::new("c", &[13]),
            ParamSpec::new("tiny", &[3]),
        ];
        Partition::new(&specs, 4, 16).unwrap()
    }

    #[test]
    fn a_bucket_stays_while_any_of_its_parameters_is_live() {
        let p = part();
        assert_eq!(p.slots[0].bucket, p.slots[1].bucket);
        let mut l = Live::new(&p, 0);
        let b0 = p.slots[0].bucket;
        assert_eq!(l.gather(&p, &[0], |_| false).unwrap().fetch, [b0]);
        // `b` shares the bucket: nothing to fetch.
        assert!(l.gather(&p, &[1], |_| false).unwrap().fetch.is_empty());
        assert!(
            l.release(&p, &[0], 0).unwrap().is_empty(),
            "`b` still needs it"
        );
        assert_eq!(l.release(&p, &[1], 0).unwrap(), [b0]);
        // Refusals change nothing.
        let e = l.release(&p, &[1], 0).unwrap_err().to_string();
        assert!(e.contains("`b`"), "{e}");
        l.gather(&p, &[2], |_| false).unwrap();
        let e = l.gather(&p, &[0, 2], |_| false).unwrap_err().to_string();
        assert!(e.contains("`c` is already gathered"), "{e}");
        assert!(!l.live[0], "the refused gather marked nothing");
    }

    #[test]
    fn persistent_parameters_pin_their_bucket_and_are_not_stale_gathers() {
        let p = part();
        let mut l = Live::new(&p, 4);
        let b1 = p.slots[3].bucket;
        assert!(l.pins(&p, b1) && !l.pins(&p, p.slots[0].bucket));
        l.gather(&p, &[3], |_| false).unwrap();
        assert!(l.release(&p, &[3], 0).unwrap().is_empty(), "pinned");
        assert!(l.live_names(&p).is_empty());
        // Gathered for the persistent one, the bucket is not fetched again for `c`.
        assert!(l.gather(&p, &[2], |b| b == b1).unwrap().fetch.is_empty());
        assert_eq!(l.live_names(&p), ["`c`"]);
    }

    #[test]
    fn the_recorded_order_drives_prefetch_and_a_changed_order_stops_it_for_one_step() {
        let p = part();
        let (b0, b1) = (p.slots[0].bucket, p.slots[2].bucket);
        let mut l = Live::new(&p, 0);
        let big = (0, usize::MAX);
        let none = |_: usize| false;
        // Nothing recorded yet: no prefetch.
        l.gather(&p, &[0], none).unwrap();
        assert!(l.next_prefetch(&p, none, (0, 1000), big).is_empty());
        l.gather(&p, &[2], none).unwrap();
        l.release(&p, &[0, 2], 0).unwrap();
        l.end_step();
        assert_eq!(l.order, [0, 2]);
        // Step 2 follows the record: after `a`, bucket 1 (for `c`) is next.
        l.gather(&p, &[0], none).unwrap();
        let len1 = p.buckets[b1].len;
        assert_eq!(
            l.next_prefetch(&p, |b| b == b0, (0, 1000), big),
            [(b1, len1 + len1 / 4)]
        );
        // Within the budget only.
        assert!(l.next_prefetch(&p, |b| b == b0, (0, len1), big).is_empty());
        assert!(l
            .next_prefetch(&p, |b| b == b0, (0, 1000), (p.buckets[b0].len, len1))
            .is_empty());
        // Step 2 leaves the record (`b` before `c`): no more prefetch this step, and the new
        // order is the record for step 3.
        l.gather(&p, &[1], none).unwrap();
        assert!(l.next_prefetch(&p, none, (0, 1000), big).is_empty());
        l.gather(&p, &[2], none).unwrap();
        l.release(&p, &[0, 1, 2], 0).unwrap();
        l.end_step();
        assert_eq!(l.order, [0, 1, 2]);
    }

    #[test]
    fn a_bucket_the_record_gathers_again_soon_stays_until_its_reuse_passes_or_the_step() {
        let p = part();
        let (b0, b1) = (p.slots[0].bucket, p.slots[2].bucket);
        let mut l = Live::new(&p, 0);
        let none = |_: usize| false;
        // Module by module: `a` alone, then `b` with `c` (`b` shares `a`'s bucket).
        let step = |l: &mut Live, reuse: usize| -> Vec<Vec<usize>> {
            let mut fetched = Vec::new();
            let mut gathered = [false; 2];
            for m in [&[0usize][..], &[1, 2]] {
                let f = l.gather(&p, m, |b| gathered[b]).unwrap().fetch;
                f.iter().for_each(|&b| gathered[b] = true);
                fetched.push(f);
                for b in l.release(&p, m, reuse).unwrap() {
                    gathered[b] = false;
                }
            }
            fetched
        };
        // No record yet: `a`'s release drops bucket 0, and `b` gathers it again.
        assert_eq!(step(&mut l, 1), [vec![b0], vec![b0, b1]]);
        assert!(l.take_kept().is_empty());
        l.end_step();
        // Recorded: `b` is the next parameter gathered (0 elements before it, fewer than 1),
        // so bucket 0 stays for it; with a distance of 0 nothing stays.
        let mut l0 = Live::new(&p, 0);
        step(&mut l0, 0);
        l0.end_step();
        assert_eq!(step(&mut l0, 0), [vec![b0], vec![b0, b1]]);
        assert_eq!(step(&mut l, 1), [vec![b0], vec![b1]]);
        l.end_step();
        // Kept after `a`, dropped at the step when nothing gathers it again.
        l.gather(&p, &[0], none).unwrap();
        assert!(l.release(&p, &[0], 1).unwrap().is_empty(), "kept for `b`");
        assert_eq!(l.take_kept(), [b0]);
        assert!(l.take_kept().is_empty());
        // A bucket the record does not gather again soon goes at once.
        let mut l = Live::new(&p, 0);
        l.gather(&p, &[0, 2], none).unwrap();
        l.release(&p, &[0, 2], 1).unwrap();
        l.end_step();
        l.gather(&p, &[0], none).unwrap();
        assert_eq!(l.release(&p, &[0], 1).unwrap(), [b0], "`c` is next");
        // Leaving the record drops a kept bucket at the next release.
        let mut l = Live::new(&p, 0);
        l.gather(&p, &[0, 1, 2], none).unwrap();
        l.release(&p, &[0, 1, 2], 1).unwrap();
        l.end_step();
        l.gather(&p, &[0], none).unwrap();
        assert!(l.release(&p, &[0], 1).unwrap().is_empty(), "`b` is next");
        l.gather(&p, &[2], |b| b == b0).unwrap();
        assert_eq!(l.release(&p, &[2], 1).unwrap(), [b1, b0]);
        assert!(l.take_kept().is_empty());
        // The distance counts the elements gathered before the reuse: `c` (13 elements) comes
        // before `b` reuses bucket 0.
        let recorded = || {
            let mut l = Live::new(&p, 0);
            l.gather(&p, &[0, 2, 1], none).unwrap();
            l.release(&p, &[0, 2, 1], 0).unwrap();
            l.end_step();
            l.gather(&p, &[0], none).unwrap();
            l
        };
        assert_eq!(recorded().release(&p, &[0], 13).unwrap(), [b0]);
        let mut l = recorded();
        assert!(l.release(&p, &[0], 14).unwrap().is_empty(), "13 < 14");
        // Gathering `c` then `b` finds bucket 0 still held: nothing to fetch for `b`.
        assert_eq!(l.gather(&p, &[2], |b| b == b0).unwrap().fetch, [b1]);
        assert!(l
            .gather(&p, &[1], |b| b == b0 || b == b1)
            .unwrap()
            .fetch
            .is_empty());
    }
}
