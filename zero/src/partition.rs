//! Partitioning, pure: parameters are laid end to end in flat buckets (in the order given), each
//! bucket padded with zeros to a multiple of the world size `n`, and rank `r` owns the `r`-th of
//! the `n` equal ranges of every bucket. A parameter never straddles two buckets; a parameter larger
//! than the bucket size gets a bucket of its own.
//!
//! Padding per bucket is less than `n` elements; the engine's memory counters include it and the
//! tests state it.

use std::collections::HashMap;
use std::ops::Range;

/// A parameter as the trainer declares it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSpec {
    /// Unique name.
    pub name: String,
    /// Shape; the parameter has `shape.iter().product()` elements.
    pub shape: Vec<usize>,
}

impl ParamSpec {
    /// A parameter named `name` of `shape`.
    pub fn new(name: impl Into<String>, shape: &[usize]) -> ParamSpec {
        ParamSpec {
            name: name.into(),
            shape: shape.to_vec(),
        }
    }

    /// Elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// One flat bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// Elements including padding (a multiple of the world size).
    pub len: usize,
    /// Elements used by parameters (the rest is padding).
    pub used: usize,
    /// Indices of the parameters in this bucket, in order.
    pub params: Vec<usize>,
}

/// Where a parameter lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    /// Its bucket.
    pub bucket: usize,
    /// Offset of its first element in the bucket.
    pub offset: usize,
    /// Elements.
    pub len: usize,
}

/// Bad partitioning input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PartitionError {
    /// Two parameters share a name.
    #[error("parameter `{0}` is declared twice")]
    Duplicate(String),
    /// A parameter has no elements.
    #[error("parameter `{0}` has no elements (shape {1:?})")]
    Empty(String, Vec<usize>),
    /// World size or bucket size is zero.
    #[error("{0} must be at least 1")]
    Zero(&'static str),
}

/// The layout of every parameter, bucket and owned range.
#[derive(Clone, Debug)]
pub struct Partition {
    /// World size.
    pub world: usize,
    /// Buckets, in order.
    pub buckets: Vec<Bucket>,
    /// Parameters, in declaration order.
    pub specs: Vec<ParamSpec>,
    /// Where each parameter lives.
    pub slots: Vec<Slot>,
    by_name: HashMap<String, usize>,
}

impl Partition {
    /// Every parameter's values cut out of whole buckets (`full[b]` holds bucket `b`), by name in
    /// the specs' order: how a consolidated model leaves the bucket layout.
    pub fn by_param(&self, full: &[Vec<f32>]) -> Vec<(String, Vec<f32>)> {
        self.slots
            .iter()
            .zip(&self.specs)
            .map(|(s, p)| {
                (
                    p.name.clone(),
                    full[s.bucket][s.offset..s.offset + s.len].to_vec(),
                )
            })
            .collect()
    }

    /// Lay out `specs` for `world` ranks in buckets of at most `bucket_elems` elements.
    pub fn new(
        specs: &[ParamSpec],
        world: usize,
        bucket_elems: usize,
    ) -> Result<Partition, PartitionError> {
        if world == 0 {
            return Err(PartitionError::Zero("world size"));
        }
        if bucket_elems == 0 {
            return Err(PartitionError::Zero("bucket size"));
        }
        let mut by_name = HashMap::new();
        let mut buckets: Vec<Bucket> = Vec::new();
        let mut slots = Vec::new();
        for (i, p) in specs.iter().enumerate() {
            if by_name.insert(p.name.clone(), i).is_some() {
                return Err(PartitionError::Duplicate(p.name.clone()));
            }
            let n = p.numel();
            if n == 0 {
                return Err(PartitionError::Empty(p.name.clone(), p.shape.clone()));
            }
            let fits = buckets.last().is_some_and(|b| b.used + n <= bucket_elems);
            if !fits {
                buckets.push(Bucket {
                    len: 0,
                    used: 0,
                    params: Vec::new(),
                });
            }
            let index = buckets.len() - 1;
            let b = &mut buckets[index];
            slots.push(Slot {
                bucket: index,
                offset: b.used,
                len: n,
            });
            b.used += n;
            b.params.push(i);
        }
        for b in &mut buckets {
            b.len = b.used.div_ceil(world) * world;
        }
        Ok(Partition {
            world,
            buckets,
            specs: specs.to_vec(),
            slots,
            by_name,
        })
    }

    /// Index of the parameter named `name`.
    pub fn index(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// The range of bucket `b` that rank `r` owns.
    pub fn owned(&self, b: usize, r: usize) -> Range<usize> {
        let share = self.buckets[b].len / self.world;
        r * share..(r + 1) * share
    }

    /// Which ranks own which elements of parameter `p`: `(rank, range in the parameter)`.
    pub fn owners(&self, p: usize) -> Vec<(usize, Range<usize>)> {
        let s = self.slots[p];
        (0..self.world)
            .filter_map(|r| {
                let o = self.owned(s.bucket, r);
                let (lo, hi) = (o.start.max(s.offset), o.end.min(s.offset + s.len));
                (lo < hi).then(|| (r, lo - s.offset..hi - s.offset))
            })
            .collect()
    }

    /// Ψ: parameter elements, without padding.
    pub fn numel(&self) -> usize {
        self.slots.iter().map(|s| s.len).sum()
    }

    /// Elements including padding.
    pub fn padded_numel(&self) -> usize {
        self.buckets.iter().map(|b| b.len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn small_example_by_hand() {
        let specs = [
            ParamSpec::new("w1", &[3, 4]),
            ParamSpec::new("b1", &[4]),
            ParamSpec::new("w2", &[40]),
        ];
        let p = Partition::new(&specs, 3, 16).unwrap();
        // w1 (12) + b1 (4) fill bucket 0 (16 → padded 18); w2 (40 > 16) gets bucket 1 (→ 42).
        assert_eq!(
            p.buckets
                .iter()
                .map(|b| (b.used, b.len))
                .collect::<Vec<_>>(),
            vec![(16, 18), (40, 42)]
        );
        assert_eq!(
            p.slots[1],
            Slot {
                bucket: 0,
                offset: 12,
                len: 4
            }
        );
        assert_eq!(p.owned(0, 2), 12..18);
        assert_eq!(p.owners(1), vec![(2, 0..4)]);
        assert_eq!(p.owners(0), vec![(0, 0..6), (1, 6..12)]);
        assert_eq!((p.numel(), p.padded_numel()), (56, 60));
    }

    #[test]
    fn bad_input_is_named() {
        let dup = [ParamSpec::new("w", &[2]), ParamSpec::new("w", &[3])];
        assert_eq!(
            Partition::new(&dup, 2, 8).unwrap_err().to_string(),
            "parameter `w` is declared twice"
        );
        let empty = [ParamSpec::new("e", &[3, 0])];
        assert!(Partition::new(&empty, 2, 8)
            .unwrap_err()
            .to_string()
            .contains("`e` has no elements"));
        assert!(Partition::new(&[], 0, 8).is_err());
    }

    proptest! {
        #[test]
        fn every_element_has_one_home_and_one_owner(
            sizes in proptest::collection::vec(1usize..200, 1..20),
            world in 1usize..9,
            bucket in 1usize..500,
        ) {
            let specs: Vec<ParamSpec> = sizes.iter().enumerate().map(|(i, &n)| ParamSpec::new(format!("p{i}"), &[n])).collect();
            let p = Partition::new(&specs, world, bucket).unwrap();
            // Buckets: padded to a multiple of the world, padding below the world size, within
            // the bucket size unless a single parameter is larger.
            for b in &p.buckets {
                prop_assert_eq!(b.len % world, 0);
                prop_assert!(b.len - b.used < world);
                prop_assert!(b.used <= bucket || b.params.len() == 1);
            }
            // Parameters tile their buckets in order without overlap.
            let mut cursor = vec![0usize; p.buckets.len()];
            for s in &p.slots {
                prop_assert_eq!(s.offset, cursor[s.bucket]);
                cursor[s.bucket] += s.len;
            }
            for (b, c) in p.buckets.iter().zip(&cursor) {
                prop_assert_eq!(b.used, *c);
            }
            // Owned ranges cover each parameter exactly once, in order.
            for (i, spec) in specs.iter().enumerate() {
                let mut next = 0;
                for (_, r) in p.owners(i) {
                    prop_assert_eq!(r.start, next);
                    next = r.end;
                }
                prop_assert_eq!(next, spec.numel());
            }
            prop_assert_eq!(p.numel(), sizes.iter().sum::<usize>());
        }
    }
}
