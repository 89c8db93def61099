//! Resharding, pure: where the elements a rank needs now lie in the shards of a checkpoint saved
//! with another world size, bucket size or parameter order. Elements are matched by parameter
//! name, never by flat position, so only the set of parameters and their shapes must agree.

use std::ops::Range;

use crate::partition::Partition;

/// One contiguous stretch to copy from a saved shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The rank whose shard holds it (in the saved layout).
    pub rank: usize,
    /// Its bucket (in the saved layout).
    pub bucket: usize,
    /// Offset of its first element in that rank's shard of the bucket.
    pub src: usize,
    /// Offset of its first element in the destination.
    pub dst: usize,
    /// Elements.
    pub len: usize,
}

/// Why two layouts cannot be mapped onto each other.
pub fn mismatch(saved: &Partition, now: &Partition) -> Option<String> {
    for p in &now.specs {
        match saved.index(&p.name) {
            None => return Some(format!("parameter `{}` is not in the checkpoint", p.name)),
            Some(i) if saved.specs[i].shape != p.shape => {
                return Some(format!(
                    "parameter `{}` has shape {:?} but the checkpoint holds {:?}",
                    p.name, p.shape, saved.specs[i].shape
                ))
            }
            Some(_) => {}
        }
    }
    saved
        .specs
        .iter()
        .find(|p| now.index(&p.name).is_none())
        .map(|p| {
            format!(
                "the checkpoint holds parameter `{}`, which this engine does not declare",
                p.name
            )
        })
}

/// Where elements `range` of parameter `p` of `saved` lie; `dst` counts from `range.start`.
pub fn param_pieces(saved: &Partition, p: usize, range: Range<usize>) -> Vec<Piece> {
    let s = saved.slots[p];
    saved
        .owners(p)
        .into_iter()
        .filter_map(|(rank, own)| {
            let (lo, hi) = (own.start.max(range.start), own.end.min(range.end));
            (lo < hi).then(|| Piece {
                rank,
                bucket: s.bucket,
                // `own` is in the parameter; the shard starts at the rank's owned offset.
                src: s.offset + lo - saved.owned(s.bucket, rank).start,
                dst: lo - range.start,
                len: hi - lo,
            })
        })
        .collect()
}

/// Where elements `range` of bucket `b` of layout `now` lie in the shards of `saved` (the two
/// must pass [`mismatch`]); `dst` counts from `range.start`. Padding is in no piece.
pub fn bucket_pieces(
    saved: &Partition,
    now: &Partition,
    b: usize,
    range: Range<usize>,
) -> Vec<Piece> {
    let mut out = Vec::new();
    for &p in &now.buckets[b].params {
        let s = now.slots[p];
        let (lo, hi) = (range.start.max(s.offset), range.end.min(s.offset + s.len));
        if lo >= hi {
            continue;
        }
        let q = saved
            .index(&now.specs[p].name)
            .expect("layouts checked by `mismatch`");
        for mut piece in param_pieces(saved, q, lo - s.offset..hi - s.offset) {
            piece.dst += lo - range.start;
            out.push(piece);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::partition::ParamSpec;
    use proptest::prelude::*;

    /// The value element `k` of parameter `name` carries in these tests: unique and never 0.
    fn tag(name: &str, k: usize) -> f32 {
        let p: usize = name[1..].parse().unwrap();
        (p * 10_000 + k + 1) as f32
    }

    /// Range `own` of bucket `b` of layout `part`: each parameter's tagged elements where the
    /// layout puts them, zero in the padding.
    fn tagged(part: &Partition, b: usize, own: Range<usize>) -> Vec<f32> {
        let mut v = vec![0f32; own.len()];
        for &p in &part.buckets[b].params {
            let s = part.slots[p];
            for k in 0..s.len {
                if own.contains(&(s.offset + k)) {
                    v[s.offset + k - own.start] = tag(&part.specs[p].name, k);
                }
            }
        }
        v
    }

    /// Shards as `saved` would write them: `[rank][bucket]`.
    fn shards(saved: &Partition) -> Vec<Vec<Vec<f32>>> {
        (0..saved.world)
            .map(|r| {
                (0..saved.buckets.len())
                    .map(|b| tagged(saved, b, saved.owned(b, r)))
                    .collect()
            })
            .collect()
    }

    #[test]
    fn names_what_does_not_match() {
        let a = Partition::new(
            &[ParamSpec::new("w", &[4]), ParamSpec::new("b", &[2])],
            2,
            8,
        );
        let b = Partition::new(
            &[ParamSpec::new("w", &[2, 2]), ParamSpec::new("b", &[2])],
            2,
            8,
        );
        let c = Partition::new(&[ParamSpec::new("w", &[4])], 3, 8);
        let (a, b, c) = (a.unwrap(), b.unwrap(), c.unwrap());
        assert_eq!(
            mismatch(&a, &b).unwrap(),
            "parameter `w` has shape [2, 2] but the checkpoint holds [4]"
        );
        assert_eq!(
            mismatch(&a, &c).unwrap(),
            "the checkpoint holds parameter `b`, which this engine does not declare"
        );
        assert_eq!(
            mismatch(&c, &a).unwrap(),
            "parameter `b` is not in the checkpoint"
        );
        assert_eq!(mismatch(&a, &a), None);
    }

    proptest! {
        #[test]
        fn every_element_comes_from_where_it_was_saved(
            sizes in proptest::collection::vec(1usize..60, 1..10),
            order in proptest::collection::vec(any::<u32>(), 10),
            (w0, w1) in (1usize..7, 1usize..7),
            (b0, b1) in (1usize..150, 1usize..150),
        ) {
            let specs: Vec<ParamSpec> = sizes.iter().enumerate()
                .map(|(i, &n)| ParamSpec::new(format!("p{i}"), &[n])).collect();
            // The engine may declare the parameters in another order.
            let mut shuffled = specs.clone();
            shuffled.sort_by_key(|p| order[p.name[1..].parse::<usize>().unwrap()]);
            let saved = Partition::new(&specs, w0, b0).unwrap();
            let now = Partition::new(&shuffled, w1, b1).unwrap();
            prop_assert_eq!(mismatch(&saved, &now), None);
            let files = shards(&saved);
            for b in 0..now.buckets.len() {
                for r in 0..w1 {
                    let own = now.owned(b, r);
                    let mut got = vec![0f32; own.len()];
                    for pc in bucket_pieces(&saved, &now, b, own.clone()) {
                        let src = &files[pc.rank][pc.bucket][pc.src..pc.src + pc.len];
                        let dst = &mut got[pc.dst..pc.dst + pc.len];
                        prop_assert!(dst.iter().all(|&x| x == 0.0), "pieces overlap");
                        dst.copy_from_slice(src);
                    }
                    let want = tagged(&now, b, own);
                    prop_assert_eq!(got, want);
                }
            }
        }
    }
}
