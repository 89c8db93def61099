//! Hybrid sharding (ZeRO sharded inside groups, replicated across them) on four thread ranks laid
//! out as two "nodes" of two: bit-identical to data parallel that averages in the same order, in
//! every stage; close to plain data parallel over the world; replicas that hold different shards
//! refused on every rank; checkpoints written once, readable at any size, all-or-nothing across
//! the groups.

use half::bf16;
use ringzero::kernels::cpu::Float;
use ringzero::{Collectives, Communicator, InPlace};
use ringzero_zero::{hybrid_groups, Engine, Precision, StepOutcome, ZeroError};

use crate::common::{fresh_dir, threads, Opts};
use crate::zero::{baseline_on, bits, cfg_in, grad, init, specs, train_engine};

/// Node-major layout of four ranks: shard groups {0,1} and {2,3}, replica groups {0,2} and {1,3}.
fn groups(world: &Communicator) -> (Communicator, Communicator) {
    let (shard, replicas) = hybrid_groups(world, 2).unwrap();
    let r = world.rank();
    assert_eq!(
        (shard.size(), shard.rank()),
        (2, r % 2),
        "rank {r}'s shard group"
    );
    assert_eq!(
        (replicas.size(), replicas.rank()),
        (2, r / 2),
        "rank {r}'s replicas"
    );
    (shard, replicas)
}

fn parity<T: Float>(p: Precision) {
    threads(4, &Opts::default(), |rank, world| {
        let world = world.unwrap();
        let (shard, rep) = groups(&world);
        for clip in [None, Some(0.5)] {
            let want = baseline_on::<T>(&shard, Some(&rep), rank, 4, &cfg_in(p, 0, clip));
            for stage in 0..=3 {
                let c = cfg_in(p, stage, clip);
                let e = Engine::<T>::new_hybrid(&shard, &rep, &specs(), &init, c).unwrap();
                let got = train_engine(e, rank, 4);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        bits(g),
                        bits(w),
                        "{p} rank {rank} stage {stage} clip {clip:?}: parameter {i} differs"
                    );
                }
            }
        }
    });
}

#[test]
fn hybrid_sharding_matches_data_parallel_in_its_order_bit_for_bit() {
    parity::<f32>(Precision::Fp32);
    parity::<bf16>(Precision::Bf16);
}

/// Four steps on `e` with the data of `data_rank`: the global gradient norm of each, and the
/// parameters after them.
fn norms_and_params(e: &mut Engine<f32>, data_rank: usize) -> (Vec<f64>, Vec<Vec<f32>>) {
    let names: Vec<String> = specs().into_iter().map(|s| s.name).collect();
    let mut norms = Vec::new();
    for t in 0..4 {
        for (i, n) in names.iter().enumerate() {
            e.gather(&[n]).unwrap();
            let g = grad(&e.param_f32(n).unwrap(), data_rank, t, i);
            e.release(&[n]).unwrap();
            e.push_grad_f32(n, &g).unwrap();
        }
        match e.step().unwrap() {
            StepOutcome::Stepped { grad_norm } => norms.push(grad_norm),
            other => panic!("step {t}: {other:?}"),
        }
    }
    let names: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
    e.gather(&names).unwrap();
    let params = names.iter().map(|n| e.param(n).unwrap().to_vec()).collect();
    e.release(&names).unwrap();
    (norms, params)
}

/// Averaging within groups and then across them is the world's average up to rounding: hybrid
/// stage 3 reports the gradient norms of ZeRO-3 over all four ranks and stays within fp32 noise
/// of its parameters.
#[test]
fn hybrid_sharding_tracks_zero_over_the_whole_world() {
    threads(4, &Opts::default(), |rank, world| {
        let world = world.unwrap();
        let (shard, rep) = groups(&world);
        let c = cfg_in(Precision::Fp32, 3, Some(0.5));
        let mut plain = Engine::<f32>::new(&world, &specs(), &init, c.clone()).unwrap();
        let (want_norms, want) = norms_and_params(&mut plain, rank);
        let mut e = Engine::<f32>::new_hybrid(&shard, &rep, &specs(), &init, c).unwrap();
        let counted = |e: &Engine<f32>| e.replicas().unwrap().counters().bytes_sent;
        let before = counted(&e);
        let (norms, got) = norms_and_params(&mut e, rank);
        // Across the replicas only the gradient shard travels: one two-rank all-reduce of it
        // per step, which sends the whole shard (2(R−1)/R of it) from each rank.
        let shard_bytes = 4 * e.partition().padded_numel() / 2;
        let sent = counted(&e) - before;
        assert_eq!(sent as usize, 4 * shard_bytes, "rank {rank}");
        for (t, (a, b)) in norms.iter().zip(&want_norms).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * b,
                "rank {rank} step {t}: norm {a} vs {b}"
            );
        }
        let worst = got
            .iter()
            .flatten()
            .zip(want.iter().flatten())
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-4, "rank {rank}: differs by {worst}");
    });
}

#[test]
fn replicas_holding_different_shards_are_refused_on_every_rank() {
    threads(4, &Opts::default(), |rank, world| {
        let world = world.unwrap();
        let r = rank as u32;
        let shard = world.split(Some(r / 2), r).unwrap().unwrap();
        // {0,3} and {1,2}: rank 0 holds shard 0, rank 3 shard 1.
        let colour = u32::from(rank == 1 || rank == 2);
        let rep = world.split(Some(colour), r).unwrap().unwrap();
        let c = cfg_in(Precision::Fp32, 2, None);
        let Err(e) = Engine::<f32>::new_hybrid(&shard, &rep, &specs(), &init, c) else {
            panic!("rank {rank}: replicas of different shards were accepted");
        };
        assert!(matches!(e, ZeroError::Config(_)), "rank {rank}: {e}");
        assert!(
            e.to_string().contains("must hold the same shard"),
            "rank {rank}: {e}"
        );
        still_works(&world);
    });
}

/// Nothing was left half-done by a refusal: the four-rank world still all-reduces.
fn still_works(world: &Communicator) {
    let mut x = [1.0f32];
    world
        .all_reduce(InPlace, &mut x, ringzero::ReduceOp::Sum)
        .unwrap();
    assert_eq!(x, [4.0]);
}

#[test]
fn a_configured_shard_size_is_honoured_or_refused_never_dropped() {
    threads(4, &Opts::default(), |rank, world| {
        let world = world.unwrap();
        let mut c = cfg_in(Precision::Fp32, 3, None);
        c.shard_size = Some(2);
        // The plain constructor would shard over all four ranks: refused, naming both sizes.
        let Err(e) = Engine::<f32>::new(&world, &specs(), &init, c.clone()) else {
            panic!("rank {rank}: a shard size of 2 was dropped on a 4-rank engine");
        };
        let e = e.to_string();
        assert!(
            e.contains("groups of 2") && e.contains("all 4 ranks"),
            "{e}"
        );
        // A size that does not divide the world is refused before any split.
        let Err(e) = hybrid_groups(&world, 3) else {
            panic!("rank {rank}: groups of 3 out of 4 ranks")
        };
        assert!(
            e.to_string()
                .contains("shard size 3 does not divide the 4 ranks"),
            "{e}"
        );
        let (shard, rep) = groups(&world);
        // Groups of 2 built, but the config says 4 (the world's size): refused too.
        let mut four = c.clone();
        four.shard_size = Some(4);
        let Err(e) = Engine::<f32>::new_hybrid(&shard, &rep, &specs(), &init, four) else {
            panic!("rank {rank}: a 2-rank shard group accepted a shard size of 4");
        };
        assert!(e.to_string().contains("has 2 ranks"), "{e}");
        // The matching size trains, and the communicators still work after the refusals.
        let mut e = Engine::<f32>::new_hybrid(&shard, &rep, &specs(), &init, c).unwrap();
        let (norms, _) = norms_and_params(&mut e, rank);
        assert!(norms.iter().all(|g| g.is_finite() && *g > 0.0), "{norms:?}");
        still_works(&world);
    });
}

#[test]
fn a_hybrid_checkpoint_is_written_once_and_loads_anywhere() {
    let dir = fresh_dir("hybrid-checkpoint");
    let c = cfg_in(Precision::Fp32, 3, Some(0.5));
    let saved = threads(4, &Opts::default(), |rank, world| {
        let world = world.unwrap();
        let (shard, rep) = groups(&world);
        let mut e = Engine::<f32>::new_hybrid(&shard, &rep, &specs(), &init, c.clone()).unwrap();
        crate::checkpoint::run(&mut e, rank, 0, 3);
        e.save_checkpoint(&dir, serde_json::json!({"step": 3}))
            .unwrap();
        // A second save into the same directory fails where it is written, and the other
        // group learns it through the replicas' round.
        let e2 = e
            .save_checkpoint(&dir, serde_json::Value::Null)
            .unwrap_err();
        if rank < 2 {
            assert!(
                e2.to_string().contains("already holds a checkpoint"),
                "{e2}"
            );
        } else {
            assert!(
                matches!(&e2, ZeroError::ReplicaFailed { replicas, .. } if replicas == &[0]),
                "rank {rank}: {e2}"
            );
        }
        e.consolidate().unwrap()
    });
    // One shard group's files: two shards.
    let shards = std::fs::read_dir(&dir)
        .unwrap()
        .filter(|f| f.as_ref().unwrap().file_name() != "meta.json")
        .count();
    assert_eq!(shards, 2, "{}", dir.display());
    // Loaded by one plain rank and by another hybrid layout, the weights are the same.
    let loaded = threads(1, &Opts::default(), |_, comm| {
        let comm = comm.unwrap();
        let mut e = Engine::<f32>::new(&comm, &specs(), &|_, _| 0.5, c.clone()).unwrap();
        e.load_checkpoint(&dir).unwrap();
        e.consolidate().unwrap()
    });
    assert_eq!(loaded[0], saved[0]);
    let again = threads(4, &Opts::default(), |_, world| {
        let world = world.unwrap();
        let (shard, rep) = groups(&world);
        let mut e =
            Engine::<f32>::new_hybrid(&shard, &rep, &specs(), &|_, _| 0.5, c.clone()).unwrap();
        e.load_checkpoint(&dir).unwrap();
        e.consolidate().unwrap()
    });
    assert!(again.iter().all(|w| *w == saved[0]));
}

/// Ranks dealt round-robin over two nodes (Slurm's cyclic distribution: ranks 0 and 2 on one,
/// 1 and 3 on the other): the shard groups are still the ranks of a node, so their edges are
/// shared memory, and the replica groups cross nodes over tcp.
#[test]
fn shard_groups_follow_the_nodes_when_ranks_are_dealt_round_robin() {
    let n = 4;
    let port = crate::common::free_port();
    let o = Opts {
        transport: ringzero::TransportPref::Auto,
        ..Opts::default()
    };
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let mut cfg = crate::common::config(rank, n, port, &o);
                cfg.node_id = format!("node-{}", rank % 2);
                s.spawn(move || {
                    let world = Communicator::init(cfg).unwrap();
                    let (shard, rep) = hybrid_groups(&world, 2).unwrap();
                    let mut members = [0i32; 2];
                    shard.all_gather(&[rank as i32], &mut members).unwrap();
                    let want = if rank % 2 == 0 { [0, 2] } else { [1, 3] };
                    assert_eq!(members, want, "rank {rank}'s shard group");
                    rep.all_gather(&[rank as i32], &mut members).unwrap();
                    let want = if rank < 2 { [0, 1] } else { [2, 3] };
                    assert_eq!(members, want, "rank {rank}'s replicas");
                    for e in shard.edges() {
                        assert_eq!(e.kind, ringzero::TransportKind::Shm, "{e}");
                    }
                    for e in rep.edges() {
                        assert_eq!(e.kind, ringzero::TransportKind::Tcp, "{e}");
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().expect("rank thread panicked");
        }
    });
}

/// Shard groups that agree inside but differ from each other (a learning rate per node) are
/// refused too: the comparison runs over the replicas as well.
#[test]
fn shard_groups_given_different_configs_are_refused() {
    threads(4, &Opts::default(), |rank, world| {
        let world = world.unwrap();
        let (shard, rep) = groups(&world);
        let mut c = cfg_in(Precision::Fp32, 2, None);
        c.optimizer.lr *= (1 + rank / 2) as f32;
        let Err(e) = Engine::<f32>::new_hybrid(&shard, &rep, &specs(), &init, c) else {
            panic!("rank {rank}: shard groups with different rates were accepted");
        };
        assert!(
            e.to_string().contains("`optimizer.params.lr` is"),
            "rank {rank}: {e}"
        );
        still_works(&world);
    });
}
