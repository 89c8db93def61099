//! Sub-communicators (`Communicator::split`), ranks as threads: groups by color ordered by key,
//! ranks that join none, nesting, and parent and children used side by side.

use ringzero::{Collectives, Communicator, InPlace, ReduceOp, TransportPref};

use crate::common::{threads, Opts};

/// Sum over a group of `value(parent rank)`, all-reduced in `comm`.
fn sum(comm: &Communicator, mine: f64) -> f64 {
    let mut b = vec![mine; 5];
    comm.all_reduce(InPlace, &mut b, ReduceOp::Sum).unwrap();
    assert!(b.iter().all(|x| *x == b[0]));
    b[0]
}

#[test]
fn ranks_of_one_color_form_a_communicator_ordered_by_key() {
    for transport in [TransportPref::Shm, TransportPref::Tcp] {
        let o = Opts {
            transport,
            ..Opts::default()
        };
        let got = threads(5, &o, |rank, comm| {
            let comm = comm.unwrap();
            // Even ranks in reverse order (key), odd ranks in order; rank 4 joins none.
            let (color, key) = match rank {
                4 => (None, 0),
                r if r % 2 == 0 => (Some(0), 100 - r as u32),
                _ => (Some(7), rank as u32),
            };
            let sub = comm.split(color, key).unwrap();
            let Some(sub) = sub else {
                assert_eq!(rank, 4);
                // The parent still works after the split.
                return (None, sum(&comm, rank as f64));
            };
            let total = sum(&sub, 1u64.wrapping_shl(rank as u32) as f64);
            // Interleave parent and child calls.
            let parent_total = sum(&comm, rank as f64);
            // All-gather shows the new rank order.
            let mut order = vec![0i32; sub.size()];
            sub.all_gather(&[rank as i32], &mut order).unwrap();
            assert_eq!(sub.edges().len(), if sub.size() > 1 { 2 } else { 0 });
            (Some((sub.rank(), sub.size(), total, order)), parent_total)
        });
        for (rank, (sub, parent_total)) in got.iter().enumerate() {
            assert_eq!(*parent_total, 10.0, "{transport:?}");
            match (rank, sub) {
                (4, None) => {}
                (r, Some((sr, size, total, order))) if r % 2 == 0 => {
                    assert_eq!(*size, 2);
                    assert_eq!(*total, (1 + 4) as f64);
                    assert_eq!(order, &vec![2, 0], "keys 98 < 100: rank 2 is new rank 0");
                    assert_eq!(*sr, if r == 2 { 0 } else { 1 });
                }
                (r, Some((sr, size, total, order))) => {
                    assert_eq!(*size, 2);
                    assert_eq!(*total, (2 + 8) as f64);
                    assert_eq!(order, &vec![1, 3]);
                    assert_eq!(*sr, r / 2);
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    }
}

#[test]
fn splits_nest_and_outlive_their_parent() {
    let got = threads(4, &Opts::default(), |rank, comm| {
        let comm = comm.unwrap();
        let half = comm
            .split(Some(rank as u32 / 2), rank as u32)
            .unwrap()
            .unwrap();
        // A split of a split: every rank alone.
        let alone = half.split(Some(half.rank() as u32), 0).unwrap().unwrap();
        assert_eq!((alone.rank(), alone.size()), (0, 1));
        let mut one = vec![rank as f32; 3];
        alone.all_reduce(InPlace, &mut one, ReduceOp::Sum).unwrap();
        assert_eq!(one, vec![rank as f32; 3]);
        // The whole world again, through the first split: the parent may go first.
        let again = comm.split(Some(0), rank as u32).unwrap().unwrap();
        drop(comm);
        let h = sum(&half, rank as f64);
        let w = sum(&again, rank as f64);
        (again.rank(), h, w)
    });
    for (rank, (r, h, w)) in got.into_iter().enumerate() {
        assert_eq!(r, rank);
        assert_eq!(h, if rank < 2 { 1.0 } else { 5.0 });
        assert_eq!(w, 6.0);
    }
}
