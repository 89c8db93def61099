//! ZeRO stages 0–3 against plain data parallel (all-reduce of each bucket's gradients, full AdamW on
//! every rank) on 1–4 thread ranks: bit-identical parameters in fp32; memory and communication
//! counters against the formulas; bad input refused with nothing changed.

use ringzero::kernels::cpu::{adamw_step, AdamW};
use ringzero::{Communicator, ReduceOp, TransportPref};
use ringzero_zero::{Engine, ParamSpec, Partition, StepOutcome, ZeroConfig, ZeroError};

use crate::common::{threads, Opts};

fn specs() -> Vec<ParamSpec> {
    vec![
        ParamSpec::new("w1", &[37]),
        ParamSpec::new("b1", &[5]),
        ParamSpec::new("w2", &[13, 10]),
        ParamSpec::new("b2", &[3]),
    ]
}

const BUCKET: usize = 64;

fn init(p: usize, i: usize) -> f32 {
    ((p * 131 + i) as f32 * 0.173).sin()
}

/// A gradient that depends on the parameters, the rank and the step (so any divergence grows).
fn grad(params: &[f32], rank: usize, step: usize, p: usize) -> Vec<f32> {
    params
        .iter()
        .enumerate()
        .map(|(i, &x)| {
            (x * (rank as f32 + 1.3) + (step * 7 + p * 3 + i) as f32 * 0.11).sin() * 0.37
        })
        .collect()
}

fn cfg(stage: u8, clip: Option<f32>) -> ZeroConfig {
    ZeroConfig {
        stage,
        bucket_elems: BUCKET,
        accumulation_steps: 1,
        clip_norm: clip,
        adamw: AdamW {
            lr: 0.05,
            ..AdamW::default()
        },
    }
}

/// Plain data parallel with the same buckets: returns every parameter after `steps` steps.
fn baseline(comm: &Communicator, steps: usize, clip: Option<f32>) -> Vec<Vec<f32>> {
    let sp = specs();
    let part = Partition::new(&sp, comm.size(), BUCKET).unwrap();
    let mut buckets: Vec<Vec<f32>> = part.buckets.iter().map(|b| vec![0f32; b.len]).collect();
    for (i, s) in part.slots.iter().enumerate() {
        for k in 0..s.len {
            buckets[s.bucket][s.offset + k] = init(i, k);
        }
    }
    let mut m: Vec<Vec<f32>> = buckets.iter().map(|b| vec![0f32; b.len()]).collect();
    let mut v = m.clone();
    let h = cfg(0, clip).adamw;
    for t in 0..steps {
        let mut g: Vec<Vec<f32>> = buckets.iter().map(|b| vec![0f32; b.len()]).collect();
        for (i, s) in part.slots.iter().enumerate() {
            let gi = grad(
                &buckets[s.bucket][s.offset..s.offset + s.len],
                comm.rank(),
                t,
                i,
            );
            g[s.bucket][s.offset..s.offset + s.len].copy_from_slice(&gi);
        }
        for b in &mut g {
            comm.all_reduce_in_place(b, ReduceOp::Avg).unwrap();
        }
        // Global norm as the engine defines it: squared sums of each rank's owned ranges, summed.
        let mut sq = vec![0f64];
        for (b, gb) in g.iter().enumerate() {
            sq[0] += gb[part.owned(b, comm.rank())]
                .iter()
                .map(|&x| (x as f64).powi(2))
                .sum::<f64>();
        }
        comm.all_reduce_in_place(&mut sq, ReduceOp::Sum).unwrap();
        let c = clip.map_or(1.0, |c| {
            ((c as f64) / (sq[0].sqrt() + 1e-6)).min(1.0) as f32
        });
        for b in 0..buckets.len() {
            adamw_step(
                &h,
                t as u64 + 1,
                &mut buckets[b],
                &g[b],
                &mut m[b],
                &mut v[b],
                c,
            );
        }
    }
    part.slots
        .iter()
        .map(|s| buckets[s.bucket][s.offset..s.offset + s.len].to_vec())
        .collect()
}

fn train(comm: &Communicator, stage: u8, steps: usize, clip: Option<f32>) -> Vec<Vec<f32>> {
    let sp = specs();
    let names: Vec<&str> = sp.iter().map(|s| s.name.as_str()).collect();
    let mut e = Engine::new(comm, &sp, &init, cfg(stage, clip)).unwrap();
    for t in 0..steps {
        e.gather(&names).unwrap();
        let grads: Vec<Vec<f32>> = names
            .iter()
            .enumerate()
            .map(|(i, n)| grad(e.param(n).unwrap(), comm.rank(), t, i))
            .collect();
        e.release(&names).unwrap();
        for (n, g) in names.iter().zip(&grads) {
            e.push_grad(n, g).unwrap();
        }
        assert!(matches!(e.step().unwrap(), StepOutcome::Stepped { .. }));
    }
    e.gather(&names).unwrap();
    names.iter().map(|n| e.param(n).unwrap().to_vec()).collect()
}

#[test]
fn every_stage_matches_data_parallel_bit_for_bit() {
    for n in 1..=4 {
        for clip in [None, Some(0.5)] {
            let o = Opts {
                transport: if n % 2 == 0 {
                    TransportPref::Tcp
                } else {
                    TransportPref::Shm
                },
                ..Opts::default()
            };
            threads(n, &o, |_, comm| {
                let comm = comm.unwrap();
                let want = baseline(&comm, 4, clip);
                for stage in 0..=3 {
                    let got = train(&comm, stage, 4, clip);
                    for (p, (g, w)) in got.iter().zip(&want).enumerate() {
                        let gb: Vec<u32> = g.iter().map(|x| x.to_bits()).collect();
                        let wb: Vec<u32> = w.iter().map(|x| x.to_bits()).collect();
                        assert_eq!(
                            gb, wb,
                            "n={n} stage {stage} clip {clip:?}: parameter {p} differs"
                        );
                    }
                }
            });
        }
    }
}

#[test]
fn memory_and_communication_counters_follow_the_formulas() {
    let n = 4;
    threads(n, &Opts::default(), |rank, comm| {
        let comm = comm.unwrap();
        let sp = specs();
        let part = Partition::new(&sp, n, BUCKET).unwrap();
        let padded = part.padded_numel(); // Ψ plus < n padding elements per bucket
        assert_eq!(part.numel(), 37 + 5 + 130 + 3);
        let names: Vec<&str> = sp.iter().map(|s| s.name.as_str()).collect();
        for stage in 0..=3u8 {
            let mut e = Engine::new(&comm, &sp, &init, cfg(stage, None)).unwrap();
            let m = e.memory();
            let (full, shard) = (4 * padded, 4 * padded / n);
            let want_params = if stage == 3 { shard } else { full };
            let want_grads = if stage >= 2 { shard } else { full };
            let want_opt = 2 * if stage == 0 { full } else { shard };
            assert_eq!(
                (m.params, m.grads, m.optimizer, m.comm_buffers),
                (want_params, want_grads, want_opt, 0),
                "stage {stage}"
            );
            // One step: stage 3 gathers for forward and again for backward.
            let before = comm.counters().bytes_sent;
            let passes = if stage == 3 { 2 } else { 1 };
            for _ in 0..passes {
                e.gather(&names).unwrap();
                if stage == 3 {
                    assert_eq!(
                        e.memory().comm_buffers,
                        full,
                        "gathered buckets are communication buffers"
                    );
                }
                e.release(&names).unwrap();
            }
            for (i, nme) in names.iter().enumerate() {
                e.push_grad(nme, &vec![0.25; sp[i].numel()]).unwrap();
            }
            e.step().unwrap();
            let sent = comm.counters().bytes_sent - before;
            // Parameters: 2Ψ (stages 0-2) or 3Ψ (stage 3) elements × (n−1)/n, 4 bytes each, plus the
            // norm's one-element f64 all-reduce (8 bytes on each link its chunk crosses).
            let volume = if stage == 3 { 3 } else { 2 };
            let norm =
                2 * 8 - if rank == 0 { 8 } else { 0 } - if (rank + 1) % n == 0 { 8 } else { 0 };
            assert_eq!(
                sent as usize,
                volume * 4 * padded * (n - 1) / n + norm,
                "stage {stage} rank {rank}"
            );
        }
    });
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    threads(2, &Opts::default(), |_, comm| {
        let comm = comm.unwrap();
        let sp = specs();
        assert!(
            matches!(Engine::new(&comm, &sp, &init, cfg(4, None)), Err(ZeroError::Config(m)) if m.contains("stage 4"))
        );
        let mut e = Engine::new(&comm, &sp, &init, cfg(3, None)).unwrap();
        assert!(matches!(e.param("w1"), Err(ZeroError::NotGathered(_))));
        e.gather(&["w1"]).unwrap();
        assert!(matches!(e.gather(&["w1", "w2"]), Err(ZeroError::AlreadyGathered(n)) if n == "w1"));
        assert!(e.param("w2").is_err(), "a refused gather gathers nothing");
        e.release(&["w1"]).unwrap();
        assert!(matches!(e.push_grad("w9", &[1.0]), Err(ZeroError::UnknownParam(n)) if n == "w9"));
        let err = e.push_grad("b1", &[1.0; 4]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "gradient for `b1` has 4 elements, the parameter has 5"
        );
        e.push_grad("b1", &[1.0; 5]).unwrap();
        assert!(matches!(
            e.push_grad("b1", &[1.0; 5]),
            Err(ZeroError::GradTwice(_))
        ));
        assert!(matches!(e.step(), Err(ZeroError::MissingGrads(m)) if m == "w1, w2, b2"));
        for (nme, len) in [("w1", 37), ("w2", 130), ("b2", 3)] {
            e.push_grad(nme, &vec![1.0; len]).unwrap();
        }
        assert!(matches!(e.step().unwrap(), StepOutcome::Stepped { .. }));
        assert_eq!(e.steps(), 1);
    });
}

#[test]
fn accumulation_steps_only_at_the_boundary() {
    threads(3, &Opts::default(), |_, comm| {
        let comm = comm.unwrap();
        let sp = specs();
        let mut e = Engine::new(
            &comm,
            &sp,
            &init,
            ZeroConfig {
                accumulation_steps: 3,
                ..cfg(2, None)
            },
        )
        .unwrap();
        let before = e.param("w1").unwrap().to_vec();
        for k in 0..3 {
            for s in &sp {
                e.push_grad(&s.name, &vec![0.1; s.numel()]).unwrap();
            }
            let out = e.step().unwrap();
            if k < 2 {
                assert_eq!(out, StepOutcome::Accumulated);
                assert_eq!(e.param("w1").unwrap(), &before[..]);
            } else {
                assert!(
                    matches!(out, StepOutcome::Stepped { grad_norm } if (grad_norm - (0.01f64 * 175.0).sqrt()).abs() < 1e-5)
                );
            }
        }
        assert_ne!(e.param("w1").unwrap(), &before[..]);
    });
}
