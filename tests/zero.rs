//! ZeRO stages 0–3 against plain data parallel (all-reduce of each bucket's gradients, full AdamW on
//! every rank) on 1–4 thread ranks, in fp32, bf16 and fp16; memory and communication counters
//! against the paper's formulas; fp16 overflow; prefetch, overlap_comm and piecewise all-gather
//! changing nothing numerically; bad input refused with nothing changed.

use half::{bf16, f16};
use ringzero::kernels::cpu::{cast, sq_norm, step_mixed, Float, Optimizer};
use ringzero::{Algo, Collectives, Communicator, InPlace, ReduceOp, TransportPref};
use ringzero_zero::mem::{comm_elements_per_step, model_states, K_ADAM};
use ringzero_zero::{
    Engine, LossScaling, ParamSpec, Partition, Phase, Precision, StepOutcome, ZeroConfig, ZeroError,
};

use crate::common::{threads, Opts};

pub(crate) fn specs() -> Vec<ParamSpec> {
    vec![
        ParamSpec::new("w1", &[37]),
        ParamSpec::new("b1", &[5]),
        ParamSpec::new("w2", &[13, 10]),
        ParamSpec::new("b2", &[3]),
    ]
}

const BUCKET: usize = 64;

// Never inlined: where an optimised caller's constant folding evaluates `sin` at compile time,
// it may differ from the run-time `sinf` in the last bit, and tests compare exactly.
#[inline(never)]
pub(crate) fn init(p: usize, i: usize) -> f32 {
    ((p * 131 + i) as f32 * 0.173).sin()
}

/// A gradient that depends on the parameters, the rank and the step (so any divergence grows).
pub(crate) fn grad(params: &[f32], rank: usize, step: usize, p: usize) -> Vec<f32> {
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
        clip_norm: clip,
        optimizer: Optimizer {
            lr: 0.05,
            ..Optimizer::default()
        },
        ..ZeroConfig::default()
    }
}

/// `cfg` in a precision; fp16 with a static scale of 1024 (so unscaling is exercised and the
/// baseline knows the scale).
pub(crate) fn cfg_in(p: Precision, stage: u8, clip: Option<f32>) -> ZeroConfig {
    ZeroConfig {
        precision: p,
        loss_scaling: LossScaling {
            loss_scale: 1024.0,
            ..LossScaling::default()
        },
        ..cfg(stage, clip)
    }
}

fn widen<T: Float>(x: &[T]) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    cast(x, &mut out);
    out
}

/// Plain data parallel in `T` with the same buckets (all-reduce of 16-bit gradients, full
/// mixed-precision AdamW on every rank): every parameter after `steps` steps.
fn baseline<T: Float>(comm: &Communicator, steps: usize, c: &ZeroConfig) -> Vec<Vec<T>> {
    baseline_on(comm, None, comm.rank(), steps, c)
}

/// [`baseline`] with gradients averaged over `comm` and then over `replicas` (hybrid sharding's
/// order), the data of `data_rank`, and the norm over `comm`'s owned ranges.
pub(crate) fn baseline_on<T: Float>(
    comm: &Communicator,
    replicas: Option<&Communicator>,
    data_rank: usize,
    steps: usize,
    c: &ZeroConfig,
) -> Vec<Vec<T>> {
    let sp = specs();
    let part = Partition::new(&sp, comm.size(), BUCKET).unwrap();
    let mut master: Vec<Vec<f32>> = part.buckets.iter().map(|b| vec![0f32; b.len]).collect();
    for (i, s) in part.slots.iter().enumerate() {
        for k in 0..s.len {
            master[s.bucket][s.offset + k] = init(i, k);
        }
    }
    let mut params: Vec<Vec<T>> = master
        .iter()
        .map(|m| {
            let mut p = vec![T::default(); m.len()];
            cast(m, &mut p);
            p
        })
        .collect();
    // The states the optimizer keeps, as long as the bucket; the others empty.
    let keeps = c.optimizer.states().len();
    let state = |k: usize| -> Vec<Vec<f32>> {
        master
            .iter()
            .map(|b| vec![0f32; if keeps > k { b.len() } else { 0 }])
            .collect()
    };
    let (mut m, mut v) = (state(0), state(1));
    let scale = if c.precision == Precision::Fp16 {
        c.loss_scaling.loss_scale
    } else {
        1.0
    };
    let inv = 1.0 / scale;
    for t in 0..steps {
        let mut g: Vec<Vec<T>> = params.iter().map(|b| vec![T::default(); b.len()]).collect();
        for (i, s) in part.slots.iter().enumerate() {
            let p32 = widen(&params[s.bucket][s.offset..s.offset + s.len]);
            let gi: Vec<f32> = grad(&p32, data_rank, t, i)
                .into_iter()
                .map(|x| x * scale)
                .collect();
            cast(&gi, &mut g[s.bucket][s.offset..s.offset + s.len]);
        }
        // The ring's all-reduce: the order of the engine's reduce-scatter.
        for b in &mut g {
            comm.with_algo(Algo::Ring)
                .all_reduce(InPlace, b, ReduceOp::Avg)
                .unwrap();
            if let Some(rep) = replicas {
                rep.with_algo(Algo::Ring)
                    .all_reduce(InPlace, b, ReduceOp::Avg)
                    .unwrap();
            }
        }
        // Global norm as the engine defines it: squared sums of each rank's owned ranges, summed.
        let mut sq = vec![0f64];
        for (b, gb) in g.iter().enumerate() {
            sq[0] += sq_norm(&gb[part.owned(b, comm.rank())], inv);
        }
        comm.with_algo(Algo::Ring)
            .all_reduce(InPlace, &mut sq, ReduceOp::Sum)
            .unwrap();
        let clip = c.clip_norm.map_or(1.0, |c| {
            ((c as f64) / (sq[0].sqrt() + 1e-6)).min(1.0) as f32
        });
        for b in 0..params.len() {
            step_mixed(
                &c.optimizer,
                t as u64 + 1,
                &mut master[b],
                Some(&mut params[b]),
                &g[b],
                &mut m[b],
                &mut v[b],
                inv * clip,
            );
        }
    }
    part.slots
        .iter()
        .map(|s| params[s.bucket][s.offset..s.offset + s.len].to_vec())
        .collect()
}

/// Train with the engine; stage 3 gathers and releases around "forward" and prefetches.
fn train<T: Float>(comm: &Communicator, c: ZeroConfig, steps: usize) -> Vec<Vec<T>> {
    let e = Engine::<T>::new(comm, &specs(), &init, c).unwrap();
    train_engine(e, comm.rank(), steps)
}

/// [`train`] on an engine already made, with the data of `data_rank`.
pub(crate) fn train_engine<T: Float>(
    mut e: Engine<T>,
    data_rank: usize,
    steps: usize,
) -> Vec<Vec<T>> {
    let sp = specs();
    let names: Vec<&str> = sp.iter().map(|s| s.name.as_str()).collect();
    for t in 0..steps {
        let mut grads = Vec::new();
        for (i, n) in names.iter().enumerate() {
            e.gather(&[n]).unwrap();
            if let Some(next) = names.get(i + 1) {
                e.prefetch(&[next]).unwrap();
            }
            let scale = e.loss_scale();
            let g: Vec<f32> = grad(&e.param_f32(n).unwrap(), data_rank, t, i)
                .into_iter()
                .map(|x| x * scale)
                .collect();
            grads.push(g);
            e.release(&[n]).unwrap();
        }
        for (n, g) in names.iter().zip(&grads) {
            e.push_grad_f32(n, g).unwrap();
        }
        assert!(matches!(e.step().unwrap(), StepOutcome::Stepped { .. }));
    }
    e.gather(&names).unwrap();
    names.iter().map(|n| e.param(n).unwrap().to_vec()).collect()
}

pub(crate) fn bits<T: Float>(x: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(x).to_vec()
}

fn parity<T: Float>(p: Precision) {
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
                let want = baseline::<T>(&comm, 4, &cfg_in(p, 0, clip));
                for stage in 0..=3 {
                    let got = train::<T>(&comm, cfg_in(p, stage, clip), 4);
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            bits(g),
                            bits(w),
                            "{p} n={n} stage {stage} clip {clip:?}: parameter {i} differs"
                        );
                    }
                }
            });
        }
    }
}

#[test]
fn every_stage_matches_data_parallel_bit_for_bit_in_fp32() {
    parity::<f32>(Precision::Fp32);
}

/// The parameters' bits after 3 steps with `c`, and after 3 steps of data parallel with `base`.
fn stage_and_baseline<T: Float>(
    comm: &Communicator,
    c: ZeroConfig,
    base: &ZeroConfig,
) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let bits_of = |v: Vec<Vec<T>>| v.iter().map(|x| bits(x)).collect();
    (
        bits_of(train::<T>(comm, c, 3)),
        bits_of(baseline::<T>(comm, 3, base)),
    )
}

/// Every optimizer rule (Adam with L2 decay, Lion, SGD plain, with momentum and Nesterov; AdamW
/// is the tests above) on 3 ranks, in fp32 and bf16, with clipping and weight decay: every stage
/// gives data parallel's bits, and each rule keeps only its own states (SGD without momentum
/// none, so its optimizer memory is the master alone).
#[test]
fn every_optimizer_matches_data_parallel_bit_for_bit_in_every_stage() {
    // Every rule but AdamW (the tests above).
    let rules = Optimizer::each_rule().into_iter().skip(1);
    threads(3, &Opts::default(), |_, comm| {
        let comm = comm.unwrap();
        for h in rules.clone() {
            for p in [Precision::Fp32, Precision::Bf16] {
                let c = |stage| ZeroConfig {
                    optimizer: h,
                    ..cfg_in(p, stage, Some(0.5))
                };
                for stage in 0..=3 {
                    let (got, want) = match p {
                        Precision::Fp32 => stage_and_baseline::<f32>(&comm, c(stage), &c(0)),
                        _ => stage_and_baseline::<bf16>(&comm, c(stage), &c(0)),
                    };
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(g, w, "{h:?} {p} stage {stage}: parameter {i} differs");
                    }
                }
                // The states it keeps, and no more: stage 0 holds them whole.
                if p == Precision::Bf16 {
                    let e = Engine::<bf16>::new(&comm, &specs(), &init, c(0)).unwrap();
                    let elems: usize = specs().iter().map(|s| s.numel()).sum();
                    let per = 4 * (1 + h.states().len());
                    let o = e.memory().optimizer;
                    assert!(
                        o >= per * elems && o < (per + 1) * elems,
                        "{h:?}: {o} bytes of optimizer state for {elems} elements ({per} per element expected)"
                    );
                }
            }
        }
    });
}

/// 16-bit training is bit-identical to 16-bit data parallel too: both reduce the same 16-bit
/// gradients in the ring's fixed order and run the same element-wise fp32 master update, so the
/// tolerance is zero. (Against fp32 training the difference is the 16-bit rounding itself; see
/// `sixteen_bit_training_stays_close_to_fp32`.)
#[test]
fn every_stage_matches_data_parallel_bit_for_bit_in_bf16_and_fp16() {
    parity::<bf16>(Precision::Bf16);
    parity::<f16>(Precision::Fp16);
}

/// Tolerance against fp32: after 4 steps of lr 0.05 the parameters differ by bf16's rounding of
/// the inputs and gradients: at most 2⁻⁷ relative per rounding, compounded over a few steps; we
/// allow 0.02 absolute on values of magnitude ≤ ~1.3 (fp16: 0.005, three more mantissa bits).
#[test]
fn sixteen_bit_training_stays_close_to_fp32() {
    threads(2, &Opts::default(), |_, comm| {
        let comm = comm.unwrap();
        let f = train::<f32>(&comm, cfg_in(Precision::Fp32, 2, None), 4);
        let b = train::<bf16>(&comm, cfg_in(Precision::Bf16, 2, None), 4);
        let h = train::<f16>(&comm, cfg_in(Precision::Fp16, 2, None), 4);
        for (i, x) in f.iter().enumerate() {
            for (k, &want) in x.iter().enumerate() {
                let (gb, gh) = (b[i][k].to_f32(), h[i][k].to_f32());
                assert!(
                    (gb - want).abs() <= 0.02,
                    "bf16 param {i}[{k}]: {gb} vs {want}"
                );
                assert!(
                    (gh - want).abs() <= 0.005,
                    "fp16 param {i}[{k}]: {gh} vs {want}"
                );
            }
        }
    });
}

#[test]
fn prefetch_overlap_comm_and_allgather_pieces_change_no_bit() {
    threads(3, &Opts::default(), |_, comm| {
        let comm = comm.unwrap();
        for p in [Precision::Fp32, Precision::Bf16] {
            for stage in [2u8, 3] {
                let plain = ZeroConfig {
                    prefetch_elems: 0,
                    overlap_comm: false,
                    ..cfg_in(p, stage, Some(0.5))
                };
                let tuned = ZeroConfig {
                    prefetch_elems: 10 * BUCKET,
                    overlap_comm: true,
                    allgather_elems: 7,
                    ..cfg_in(p, stage, Some(0.5))
                };
                if p == Precision::Fp32 {
                    let a = train::<f32>(&comm, plain, 3);
                    let b = train::<f32>(&comm, tuned, 3);
                    assert_eq!(a, b, "stage {stage} fp32");
                } else {
                    let a = train::<bf16>(&comm, plain, 3);
                    let b = train::<bf16>(&comm, tuned, 3);
                    assert_eq!(a, b, "stage {stage} bf16");
                }
            }
        }
    });
}

/// Prefetch is real: the next buckets are in flight (counted as communication buffers, bounded by
/// `prefetch_elems`), and `gather` takes them. Buffers given back are kept for the next
/// micro-step and counted too.
#[test]
fn prefetch_is_real_and_bounded() {
    threads(2, &Opts::default(), |_, comm| {
        let comm = comm.unwrap();
        let sp = specs();
        let part = Partition::new(&sp, 2, BUCKET).unwrap();
        let (b1, b2) = (part.slots[0].bucket, part.slots[2].bucket);
        assert_ne!(b1, b2, "w1 and w2 in different buckets");
        // Room for w1's bucket (the whole bucket and the shard copy it gathers from), not more.
        let len = part.buckets[b1].len;
        let c = ZeroConfig {
            prefetch_elems: len + len / 2,
            ..cfg(3, None)
        };
        let mut e = Engine::<f32>::new(&comm, &sp, &init, c).unwrap();
        assert_eq!(e.memory().comm_buffers, 0);
        e.prefetch(&["w1", "w2"]).unwrap();
        assert_eq!(
            e.memory().comm_buffers,
            4 * (len + len / 2),
            "only the first bucket is in flight"
        );
        // By capacity: the largest bucket, or its shard.
        let cap = part.buckets.iter().map(|b| b.len).max().unwrap();
        e.gather(&["w1"]).unwrap();
        assert_eq!(
            e.memory().comm_buffers,
            4 * (len + cap / 2),
            "the prefetch became the gathered copy; the shard copy is kept"
        );
        let want: Vec<f32> = (0..37).map(|k| init(0, k)).collect();
        assert_eq!(e.param("w1").unwrap(), &want[..]);
        e.release(&["w1"]).unwrap();
        assert_eq!(e.memory().comm_buffers, 4 * (cap + cap / 2), "both kept");
        // Gathering another bucket takes the kept buffer: nothing more is held.
        e.gather(&["w2"]).unwrap();
        let w2 = part.buckets[b2].len;
        assert_eq!(e.memory().comm_buffers, 4 * (w2 + cap / 2));
        assert_eq!(e.param_f32("w2").unwrap()[7], init(2, 7));
        // Prefetching a gathered bucket or twice is harmless; the step refuses gathered params.
        e.prefetch(&["w2"]).unwrap();
        for s in &sp {
            e.push_grad_f32(&s.name, &vec![0.5; s.numel()]).unwrap();
        }
        let err = e.step().unwrap_err();
        assert!(
            matches!(&err, ZeroError::StillGathered(m) if m.contains("`w2`")),
            "{err}"
        );
        e.release(&["w2"]).unwrap();
        assert!(matches!(e.step().unwrap(), StepOutcome::Stepped { .. }));
    });
}

/// Memory by category equals the paper's model-state formulas for the padded Ψ, and the bytes
/// each rank sends per step equal 2Ψ (3Ψ in stage 3) × (N−1)/N elements plus the small
/// all-reduces (norm; fp16's overflow flag).
fn counters<T: Float>(p: Precision) {
    let n = 4;
    threads(n, &Opts::default(), |rank, comm| {
        let comm = comm.unwrap();
        let sp = specs();
        let part = Partition::new(&sp, n, BUCKET).unwrap();
        let padded = part.padded_numel(); // Ψ plus < n padding elements per bucket
        assert_eq!(part.numel(), 37 + 5 + 130 + 3);
        let names: Vec<&str> = sp.iter().map(|s| s.name.as_str()).collect();
        let sz = std::mem::size_of::<T>();
        for stage in 0..=3u8 {
            let mut e = Engine::<T>::new(&comm, &sp, &init, cfg_in(p, stage, None)).unwrap();
            // What the step's one-element all-reduces send (the norm's f64 sum; fp16's one-byte
            // overflow flag), measured on the same collectives of the engine's communicator.
            let small = |x: &mut dyn FnMut()| {
                let b0 = e.comm().counters().bytes_sent;
                x();
                (e.comm().counters().bytes_sent - b0) as usize
            };
            let norm_bytes = small(&mut || {
                e.comm()
                    .all_reduce(InPlace, &mut [0f64], ReduceOp::Sum)
                    .unwrap()
            });
            let flag_bytes = small(&mut || {
                e.comm()
                    .all_reduce(InPlace, &mut [0u8], ReduceOp::Max)
                    .unwrap()
            });
            assert!(
                norm_bytes <= 2 * 8,
                "a one-element all-reduce: {norm_bytes} B"
            );
            let m = e.memory();
            if sz == 2 {
                // The paper's mixed-precision Adam: 2 + 2 + K(=12) bytes per parameter.
                let f = model_states(padded as f64, n, stage, K_ADAM).unwrap();
                assert_eq!(
                    (m.params as f64, m.grads as f64, m.optimizer as f64),
                    (f.params, f.grads, f.optimizer),
                    "{p} stage {stage}"
                );
            } else {
                // fp32: 4 + 4 + 8 (moments; the params are the master).
                let (full, shard) = (4 * padded, 4 * padded / n);
                let want = (
                    if stage == 3 { shard } else { full },
                    if stage >= 2 { shard } else { full },
                    2 * if stage == 0 { full } else { shard },
                );
                assert_eq!((m.params, m.grads, m.optimizer), want, "stage {stage}");
            }
            assert_eq!(m.comm_buffers, 0);
            let before = e.comm().counters().bytes_sent;
            let passes = if stage == 3 { 2 } else { 1 };
            for _ in 0..passes {
                e.gather(&names).unwrap();
                if stage == 3 {
                    assert_eq!(
                        e.memory().comm_buffers,
                        sz * padded,
                        "gathered = comm buffers"
                    );
                }
                e.release(&names).unwrap();
            }
            for (i, nme) in names.iter().enumerate() {
                e.push_grad_f32(nme, &vec![0.25; sp[i].numel()]).unwrap();
            }
            assert!(matches!(e.step().unwrap(), StepOutcome::Stepped { .. }));
            let sent = e.comm().counters().bytes_sent - before;
            let extra = norm_bytes + if p == Precision::Fp16 { flag_bytes } else { 0 };
            let volume = comm_elements_per_step(padded as f64, n, stage);
            assert_eq!(
                sent as usize,
                volume as usize * sz + extra,
                "{p} stage {stage} rank {rank}"
            );
        }
    });
}

#[test]
fn memory_and_communication_counters_follow_the_formulas() {
    counters::<f32>(Precision::Fp32);
    counters::<bf16>(Precision::Bf16);
    counters::<f16>(Precision::Fp16);
}

#[test]
fn fp16_overflow_on_one_rank_skips_the_step_everywhere_and_halves_the_scale() {
    threads(3, &Opts::default(), |rank, comm| {
        let comm = comm.unwrap();
        let sp = specs();
        for stage in 0..=3u8 {
            let c = ZeroConfig {
                precision: Precision::Fp16,
                loss_scaling: LossScaling {
                    initial_scale_power: 10,
                    hysteresis: 1,
                    loss_scale_window: 2,
                    ..LossScaling::default()
                },
                ..cfg(stage, Some(1.0))
            };
            let mut e = Engine::<f16>::new(&comm, &sp, &init, c).unwrap();
            assert_eq!(e.loss_scale(), 1024.0);
            let before = e.consolidate().unwrap();
            for s in &sp {
                let mut g = vec![0.1 * e.loss_scale(); s.numel()];
                if rank == 1 && s.name == "w2" {
                    g[77] = f32::INFINITY; // only rank 1, only one element
                }
                e.push_grad_f32(&s.name, &g).unwrap();
            }
            let out = e.step().unwrap();
            assert_eq!(
                out,
                StepOutcome::Skipped { loss_scale: 512.0 },
                "stage {stage} rank {rank}"
            );
            assert_eq!((e.steps(), e.skipped_steps()), (0, 1));
            let after = e.consolidate().unwrap();
            assert_eq!(before, after, "a skipped step changes no weight");
            // The next clean steps run, and on the one after loss_scale_window of them the scale
            // grows back (as DeepSpeed's scaler counts).
            for k in 0..3 {
                for s in &sp {
                    e.push_grad_f32(&s.name, &vec![0.1 * e.loss_scale(); s.numel()])
                        .unwrap();
                }
                // fp16 rounds the scaled gradient, the 3-rank sum and the average: ~3 × 2⁻¹¹.
                let out = e.step().unwrap();
                assert!(
                    matches!(out, StepOutcome::Stepped { grad_norm } if (grad_norm - (0.01f64 * 175.0).sqrt()).abs() < 2e-3),
                    "step {k}: {out:?}"
                );
            }
            assert_eq!(e.loss_scale(), 1024.0);
            for (_, w) in e.consolidate().unwrap() {
                assert!(w.iter().all(|x| x.is_finite()));
            }
            e.gather(&["w2"]).unwrap();
            assert!(e.param_f32("w2").unwrap().iter().all(|x| x.is_finite()));
            e.release(&["w2"]).unwrap();
        }
    });
}

#[test]
fn a_non_finite_gradient_never_reaches_bf16_weights_either() {
    threads(2, &Opts::default(), |rank, comm| {
        let comm = comm.unwrap();
        let sp = specs();
        let mut e =
            Engine::<bf16>::new(&comm, &sp, &init, cfg_in(Precision::Bf16, 1, None)).unwrap();
        let before = e.consolidate().unwrap();
        for s in &sp {
            let mut g = vec![0.1; s.numel()];
            if rank == 0 && s.name == "b1" {
                g[2] = f32::NAN;
            }
            e.push_grad_f32(&s.name, &g).unwrap();
        }
        assert!(
            matches!(e.step().unwrap(), StepOutcome::Skipped { loss_scale } if loss_scale == 1.0)
        );
        assert_eq!(before, e.consolidate().unwrap());
    });
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    threads(2, &Opts::default(), |_, comm| {
        let comm = comm.unwrap();
        let sp = specs();
        assert!(
            matches!(Engine::<f32>::new(&comm, &sp, &init, cfg(4, None)), Err(ZeroError::Config(m)) if m.contains("stage 4"))
        );
        let e = Engine::<f32>::new(&comm, &sp, &init, cfg_in(Precision::Bf16, 1, None));
        assert!(
            matches!(&e, Err(ZeroError::Config(m)) if m.contains("asks for bf16") && m.contains("created for f32"))
        );
        let batch = ZeroConfig {
            micro_batch: Some(4),
            train_batch: Some(12),
            ..cfg(1, None)
        };
        let e = Engine::<f32>::new(&comm, &sp, &init, batch);
        assert!(matches!(&e, Err(ZeroError::Config(m)) if m.contains("train_batch_size 12")));
        let mut e = Engine::<f32>::new(&comm, &sp, &init, cfg(3, None)).unwrap();
        assert!(matches!(e.param("w1"), Err(ZeroError::NotGathered(_))));
        e.gather(&["w1"]).unwrap();
        assert!(matches!(e.gather(&["w1", "w2"]), Err(ZeroError::AlreadyGathered(n)) if n == "w1"));
        assert!(e.param("w2").is_err(), "a refused gather gathers nothing");
        e.release(&["w1"]).unwrap();
        assert!(matches!(e.prefetch(&["zz"]), Err(ZeroError::UnknownParam(n)) if n == "zz"));
        assert!(matches!(e.push_grad("w9", &[1.0]), Err(ZeroError::UnknownParam(n)) if n == "w9"));
        let err = e.push_grad("b1", &[1.0; 4]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "gradient for `b1` has 4 elements, the parameter has 5"
        );
        let e16 = e.push_grad("b1", &[bf16::ZERO; 5]).unwrap_err();
        assert!(e16.to_string().contains("is bf16 but"), "{e16}");
        e.push_grad("b1", &[1.0f32; 5]).unwrap();
        assert!(matches!(
            e.push_grad("b1", &[1.0f32; 5]),
            Err(ZeroError::GradTwice(_))
        ));
        assert!(matches!(e.step(), Err(ZeroError::MissingGrads(m)) if m == "w1, w2, b2"));
        for (nme, len) in [("w1", 37), ("w2", 130), ("b2", 3)] {
            e.push_grad(nme, &vec![1.0f32; len]).unwrap();
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
        for overlap in [false, true] {
            let c = ZeroConfig {
                accumulation_steps: 3,
                overlap_comm: overlap,
                ..cfg(2, None)
            };
            let mut e = Engine::<f32>::new(&comm, &sp, &init, c).unwrap();
            let before = e.param("w1").unwrap().to_vec();
            for k in 0..3 {
                for s in &sp {
                    e.push_grad(&s.name, &vec![0.1f32; s.numel()]).unwrap();
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
        }
    });
}

/// Stage 3 by parameter: a bucket stays gathered while any of its parameters is (releasing
/// `w1` keeps the bucket `b1` needs), so a forward and a backward that gather every parameter
/// move each bucket once each — twice the padded Ψ per step, the all-gather part of the paper's
/// 3Ψ — less the buckets kept for a reuse the record shows (`stage3_max_reuse_distance`). From
/// the second step the engine prefetches by the order the first step gathered in; a step in
/// another order only loses the prefetch and the reuse. Every schedule and reuse distance gives
/// the bits of the run without prefetching, and persistent parameters stay gathered across
/// steps.
#[test]
fn stage_3_gathers_by_parameter_and_prefetches_by_the_recorded_order() {
    // Buckets: [w1, b1] (42 elements), [w2] (130), [b2] (3).
    let forward = ["w1", "b1", "w2", "b2"];
    // One micro-step: gather in `order`, releasing each parameter once the next one is in
    // (w1 after b1: its bucket stays for b1), then backward in reverse, and step; the engine's
    // gathered elements after each gather.
    fn micro(e: &mut Engine<f32>, order: &[&str], rank: usize, t: usize) -> Vec<u64> {
        let mut held_elems = Vec::new();
        let sp = specs();
        let mut grads = vec![Vec::new(); sp.len()];
        for pass in [order.to_vec(), order.iter().rev().copied().collect()] {
            for (k, n) in pass.iter().enumerate() {
                e.gather(&[n]).unwrap();
                held_elems.push(e.gathered_elems());
                if k > 0 {
                    e.release(&[pass[k - 1]]).unwrap();
                }
                let i = sp.iter().position(|s| s.name == *n).unwrap();
                grads[i] = grad(&e.param_f32(n).unwrap(), rank, t, i);
            }
            e.release(&[pass[pass.len() - 1]]).unwrap();
        }
        for (s, g) in sp.iter().zip(&grads) {
            e.push_grad_f32(&s.name, g).unwrap();
        }
        assert!(matches!(e.step().unwrap(), StepOutcome::Stepped { .. }));
        held_elems
    }
    threads(2, &Opts::default(), |rank, comm| {
        let comm = comm.unwrap();
        let c = |prefetch| ZeroConfig {
            bucket_elems: 64,
            prefetch_elems: prefetch,
            ..cfg(3, None)
        };
        let orders = [forward, forward, ["w2", "b2", "w1", "b1"], forward];
        let run_with = |c: ZeroConfig| {
            let mut e = Engine::<f32>::new(&comm, &specs(), &init, c).unwrap();
            let mut per_step = Vec::new();
            let mut buffers = Vec::new();
            for (t, order) in orders.iter().enumerate() {
                let before = e.gathered_elems();
                buffers.push(micro(&mut e, order, rank, t));
                per_step.push(e.gathered_elems() - before);
            }
            let names: Vec<String> = specs().into_iter().map(|s| s.name).collect();
            let names: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
            e.gather(&names).unwrap();
            let bits: Vec<Vec<u8>> = names.iter().map(|n| bits(e.param(n).unwrap())).collect();
            e.release(&names).unwrap();
            (bits, per_step, buffers)
        };
        let run = |prefetch: usize| run_with(c(prefetch));
        let padded: u64 = {
            let e = Engine::<f32>::new(&comm, &specs(), &init, c(0)).unwrap();
            e.partition().buckets.iter().map(|b| b.len as u64).sum()
        };
        // Released at once (reuse distance 0), without prefetch: each bucket once for forward,
        // once for backward.
        let (want, plain, _) = run_with(ZeroConfig {
            reuse_elems: 0,
            ..c(0)
        });
        assert_eq!(plain, [2 * padded; 4], "gathered elements per step");
        // By default (DeepSpeed's reuse distance, 1e9) a step that follows the record (step 2)
        // keeps what forward gathers for backward: each bucket once. Steps 3 and 4 leave the
        // record (the order changed) and gather as before.
        let (got, kept, _) = run(0);
        assert_eq!(got, want, "keeping buckets changes no bit");
        assert_eq!(kept, [2 * padded, padded, 2 * padded, 2 * padded]);
        // b2's bucket (4 elements padded), released last in forward and gathered first in
        // backward, stays even at the shortest distance.
        let (got, next, _) = run_with(ZeroConfig {
            reuse_elems: 1,
            ..c(0)
        });
        assert_eq!(got, want);
        let len2 = 4;
        assert_eq!(next[1], 2 * padded - len2);
        let (got, prefetched, gathered) = run(1 << 20);
        assert_eq!(got, want, "prefetching changes no bit, in any order");
        // With it, the same buckets move, but ahead of their gather: in step 2, `w1`'s gather
        // also starts the buckets next in the record (w2's, b2's); in step 1, with nothing
        // recorded, it moves `w1`'s bucket alone.
        let first = |t: usize| {
            let start = if t == 0 {
                0
            } else {
                gathered[t - 1].last().copied().unwrap()
            };
            gathered[t][0] - start
        };
        let len0 = 42u64.div_ceil(2) * 2;
        assert_eq!(prefetched[0], 2 * padded);
        assert_eq!(
            first(0),
            len0,
            "step 1: nothing recorded, nothing prefetched"
        );
        assert!(first(1) > len0, "step 2 prefetched: {} elements", first(1));
        // Each bucket at least once a step (step 2 keeps them for their reuse, as above).
        for (t, &n) in prefetched.iter().enumerate() {
            assert!(
                n >= padded && n <= 3 * padded,
                "step {t}: {n} elements gathered"
            );
        }
        // Persistent parameters (fewer than 10 elements: b1, b2) keep their buckets gathered
        // across steps, refreshed after each, with the same bits.
        let mut e = Engine::<f32>::new(
            &comm,
            &specs(),
            &init,
            ZeroConfig {
                persistence_threshold: 10,
                ..c(0)
            },
        )
        .unwrap();
        for (t, order) in orders.iter().enumerate() {
            micro(&mut e, order, rank, t);
            assert!(
                e.memory().comm_buffers > 0,
                "the pinned buckets stay gathered"
            );
        }
        let names: Vec<String> = specs().into_iter().map(|s| s.name).collect();
        let names: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
        e.gather(&names).unwrap();
        let bits_p: Vec<Vec<u8>> = names.iter().map(|n| bits(e.param(n).unwrap())).collect();
        assert_eq!(bits_p, want, "persistence changes no bit");
    });
}

/// `wall_clock_breakdown`'s report: per optimizer step, over its micro-steps, the phases the
/// trainer marked, the engine's waits and (stage 3) the elements gathered.
#[test]
fn each_optimizer_step_reports_where_its_time_went() {
    let c = ZeroConfig::from_json(
        r#"{"wall_clock_breakdown": true, "gradient_accumulation_steps": 2,
            "zero_optimization": {"stage": 3, "reduce_bucket_size": 64,
                                  "stage3_prefetch_bucket_size": 0}}"#,
    )
    .unwrap();
    assert!(c.wall_clock_breakdown);
    threads(2, &Opts::default(), |rank, comm| {
        let comm = comm.unwrap();
        let mut e = Engine::<f32>::new(&comm, &specs(), &init, c.clone()).unwrap();
        assert_eq!(e.report(), None);
        let sp = specs();
        let pause = std::time::Duration::from_millis(3);
        for t in 0..4 {
            e.phase(Phase::Forward);
            std::thread::sleep(pause);
            e.phase(Phase::Backward);
            for (i, s) in sp.iter().enumerate() {
                e.gather(&[&s.name]).unwrap();
                let g = grad(&e.param_f32(&s.name).unwrap(), rank, t, i);
                e.release(&[&s.name]).unwrap();
                e.push_grad_f32(&s.name, &g).unwrap();
            }
            std::thread::sleep(pause);
            let out = e.step().unwrap();
            if t % 2 == 0 {
                assert_eq!(out, StepOutcome::Accumulated);
                continue;
            }
            let r = e.report().unwrap();
            // Each parameter gathered and released alone: its bucket moves for each (w1 and
            // b1 share one, which moves twice) in the first step; the second follows the
            // record, and every bucket stays for its reuse: each moves once in the step.
            let part = e.partition();
            let per_micro: u64 = part
                .slots
                .iter()
                .map(|s| part.buckets[s.bucket].len as u64)
                .sum();

            assert_eq!((r.step, r.micro_steps), (t as u64 / 2 + 1, 2));
            assert!(r.forward >= 2 * pause && r.backward >= 2 * pause, "{r}");
            assert!(r.wall >= r.forward + r.backward + r.in_step, "{r}");
            assert!(r.in_step >= r.wait.update, "{r}");
            let padded: u64 = part.buckets.iter().map(|b| b.len as u64).sum();
            let want = if t == 1 { 2 * per_micro } else { padded };
            assert_eq!(r.gathered_elems, want, "over the 2 micro-steps");
            assert!(r.to_string().contains("2 micro-steps"), "{r}");
        }
    });
}

/// Gradients pushed in registration order in one call, in backward's order by name in one call
/// (one wait), or computed from the weights read in place, give the bits of pushing them one by
/// one by name; a wrong count, a wrong length or a name given twice is refused before anything
/// is added.
#[test]
fn gradients_pushed_in_registration_order() {
    threads(2, &Opts::default(), |rank, comm| {
        let comm = comm.unwrap();
        let sp = specs();
        let grads = |e: &Engine<f32>, t: usize| -> Vec<Vec<f32>> {
            sp.iter()
                .enumerate()
                .map(|(i, s)| grad(e.param(&s.name).unwrap(), rank, t, i))
                .collect()
        };
        let mut by_name = Engine::<f32>::new(&comm, &sp, &init, cfg(2, None)).unwrap();
        let mut in_order = Engine::<f32>::new(&comm, &sp, &init, cfg(2, None)).unwrap();
        let mut from_params = Engine::<f32>::new(&comm, &sp, &init, cfg(2, None)).unwrap();
        let mut batched = Engine::<f32>::new(&comm, &sp, &init, cfg(2, None)).unwrap();
        for t in 0..3 {
            for (s, g) in sp.iter().zip(grads(&by_name, t)) {
                by_name.push_grad(&s.name, &g[..]).unwrap();
            }
            by_name.step().unwrap();
            let g = grads(&in_order, t);
            let e = in_order
                .push_grads(g.iter().take(3).map(|v| &v[..]))
                .unwrap_err();
            assert!(
                e.to_string().contains("3 gradients for 4 parameters"),
                "{e}"
            );
            let mut bad = g.clone();
            bad[2].pop();
            let e = in_order.push_grads(bad.iter().map(|v| &v[..])).unwrap_err();
            assert!(e.to_string().contains("w2"), "{e}");
            in_order.push_grads(g.iter().map(|v| &v[..])).unwrap();
            in_order.step().unwrap();
            // The same step computed from the weights read in place.
            let e = &mut from_params;
            let names: Vec<&str> = sp.iter().map(|s| s.name.as_str()).collect();
            let short = e
                .push_grads_from(&names, |_| vec![vec![0.0; 3]])
                .unwrap_err();
            assert!(
                short.to_string().contains("1 gradients returned for 4"),
                "{short}"
            );
            e.push_grads_from(&names, |params| {
                params
                    .iter()
                    .enumerate()
                    .map(|(i, w)| grad(w, rank, t, i))
                    .collect()
            })
            .unwrap();
            e.step().unwrap();
            // Last parameter first, as backward produces them, in one call.
            let g = grads(&batched, t);
            let twice = [
                (sp[0].name.as_str(), &g[0][..]),
                (sp[0].name.as_str(), &g[0][..]),
            ];
            let e = batched.push_grads_by_name(twice).unwrap_err();
            assert!(e.to_string().contains("is given twice"), "{e}");
            let backward = sp
                .iter()
                .zip(&g)
                .rev()
                .map(|(s, v)| (s.name.as_str(), &v[..]));
            batched.push_grads_by_name(backward).unwrap();
            batched.step().unwrap();
        }
        for s in &sp {
            assert_eq!(
                bits(by_name.param(&s.name).unwrap()),
                bits(batched.param(&s.name).unwrap()),
                "{}",
                s.name
            );
            assert_eq!(
                bits(by_name.param(&s.name).unwrap()),
                bits(in_order.param(&s.name).unwrap()),
                "{}",
                s.name
            );
            assert_eq!(
                bits(by_name.param(&s.name).unwrap()),
                bits(from_params.param(&s.name).unwrap()),
                "{}",
                s.name
            );
        }
    });
}

#[test]
fn a_deepspeed_json_config_drives_the_engine() {
    threads(2, &Opts::default(), |_, comm| {
        let comm = comm.unwrap();
        let c = ZeroConfig::from_json(
            r#"{"zero_optimization": {"stage": 3, "reduce_bucket_size": 64,
                 "stage3_prefetch_bucket_size": 0},
                "bf16": {"enabled": true},
                "optimizer": {"type": "AdamW", "params": {"lr": 0.05}}}"#,
        )
        .unwrap();
        // DeepSpeed's AdamW leaves weight decay at its fused Adam's 0 when the config names none,
        // and it clips at 1.0 unless told otherwise.
        let want = cfg_in(Precision::Bf16, 3, None);
        assert!(
            c.notes[0].contains("clipped at a global norm of 1.0"),
            "{:?}",
            c.notes
        );
        assert_eq!(
            c,
            ZeroConfig {
                prefetch_elems: 0,
                clip_norm: Some(1.0),
                notes: c.notes.clone(),
                optimizer: Optimizer {
                    weight_decay: 0.0,
                    ..want.optimizer
                },
                ..want
            }
            .with_loss_scaling_default()
        );
        let a = train::<bf16>(&comm, c.clone(), 2);
        let b = train::<bf16>(
            &comm,
            ZeroConfig {
                optimizer: c.optimizer,
                clip_norm: Some(1.0),
                ..cfg_in(Precision::Bf16, 3, None)
            },
            2,
        );
        assert_eq!(a, b);
    });
}

trait Defaults {
    fn with_loss_scaling_default(self) -> Self;
}
impl Defaults for ZeroConfig {
    fn with_loss_scaling_default(self) -> Self {
        ZeroConfig {
            loss_scaling: LossScaling::default(),
            ..self
        }
    }
}

/// Every parameter by name, full (`Engine::consolidate`).
type Consolidated = Vec<(String, Vec<f32>)>;

/// Parameter groups: with weight decay 0.1 and "no decay for `b*`", every stage's biases end
/// bit-identical to a run without decay and its weights bit-identical to a run that decays
/// everything (the update is elementwise, so splitting it by parameter changes nothing else).
#[test]
fn a_no_decay_group_decays_the_weights_and_not_the_biases_in_every_stage() {
    use ringzero_zero::ParamGroup;
    for stage in 0..=3u8 {
        let with_decay = |wd: f32, groups: Vec<ParamGroup>| ZeroConfig {
            optimizer: Optimizer {
                lr: 0.05,
                weight_decay: wd,
                ..Optimizer::default()
            },
            param_groups: groups,
            ..cfg(stage, None)
        };
        // Per run, per rank, the consolidated parameters.
        let runs: Vec<Vec<Consolidated>> = [
            with_decay(0.1, vec![ParamGroup::no_decay(&["b"])]),
            with_decay(0.0, Vec::new()),
            with_decay(0.1, Vec::new()),
        ]
        .into_iter()
        .map(|c| {
            threads(2, &Opts::default(), move |rank, comm| {
                let comm = comm.unwrap();
                let mut e = Engine::<f32>::new(&comm, &specs(), &init, c.clone()).unwrap();
                crate::checkpoint::run(&mut e, rank, 0, 4);
                e.consolidate().unwrap()
            })
        })
        .collect();
        let (grouped, no_decay, decay) = (&runs[0][0], &runs[1][0], &runs[2][0]);
        for (i, (name, got)) in grouped.iter().enumerate() {
            let (want, other) = if name.starts_with('b') {
                (&no_decay[i].1, &decay[i].1)
            } else {
                (&decay[i].1, &no_decay[i].1)
            };
            assert_eq!(got, want, "stage {stage}: {name}");
            assert_ne!(
                got, other,
                "stage {stage}: {name} is not decayed as its group says"
            );
        }
        assert!(
            runs.iter().all(|r| r[0] == r[1]),
            "stage {stage}: ranks differ"
        );
    }
}

#[test]
fn param_groups_are_checked() {
    use ringzero_zero::ParamGroup;
    let bad = [
        ParamGroup {
            names_containing: Vec::new(),
            ..ParamGroup::no_decay(&["b"])
        },
        ParamGroup::no_decay(&[""]),
        ParamGroup {
            weight_decay: Some(-1.0),
            ..ParamGroup::no_decay(&["b"])
        },
        ParamGroup {
            lr_scale: f32::NAN,
            ..ParamGroup::no_decay(&["b"])
        },
    ];
    for g in bad {
        let e = ZeroConfig::builder()
            .param_group(g.clone())
            .build()
            .unwrap_err()
            .to_string();
        assert!(e.contains("param_groups[0]"), "{g:?}: {e}");
    }
}

/// A config per rank.
type PerRank = dyn Fn(usize) -> ZeroConfig + Sync;

/// A model (its parameter list) per rank.
type ModelPerRank = dyn Fn(usize) -> Vec<ParamSpec> + Sync;

/// Ranks given different configurations or initial values are refused at construction, on
/// every rank, naming the first field or parameter that differs (a per-rank learning rate used
/// to train to a wrong result silently; different stages failed later with a collective
/// mismatch).
#[test]
fn ranks_that_disagree_are_refused_naming_what_differs() {
    let lr_per_rank = |rank: usize| ZeroConfig {
        optimizer: Optimizer {
            lr: 0.05 * (rank + 1) as f32,
            ..Optimizer::default()
        },
        ..cfg(2, None)
    };
    let stage_per_rank = |rank: usize| cfg(1 + rank as u8, None);
    let cases: [(&PerRank, bool, &str); 3] = [
        (&lr_per_rank, false, "`optimizer.params.lr` is"),
        (&stage_per_rank, false, "`stage` is"),
        (&|_| cfg(3, None), true, "initial values for parameter `w1`"),
    ];
    for (config, rank_init, want) in cases {
        let errs = threads(2, &Opts::default(), |rank, comm| {
            let comm = comm.unwrap();
            let seeded = move |p: usize, i: usize| init(p, i) + rank as f32;
            let init_fn: &dyn Fn(usize, usize) -> f32 = if rank_init { &seeded } else { &init };
            match Engine::<f32>::new(&comm, &specs(), init_fn, config(rank)) {
                Ok(_) => panic!("rank {rank}: {want}: the engine was built"),
                Err(e) => e.to_string(),
            }
        });
        for (rank, e) in errs.iter().enumerate() {
            assert!(
                e.contains(want) && e.contains(&format!("rank {rank}")),
                "{e}"
            );
        }
    }
    // Ranks that built different models: each names its parameter count, or the first
    // parameter not every rank has in its place.
    let extra = |rank: usize| {
        let mut s = specs();
        if rank == 1 {
            s.push(ParamSpec::new("w3", &[4]));
        }
        s
    };
    let transposed = |rank: usize| {
        let mut s = specs();
        if rank == 1 {
            s[2] = ParamSpec::new("w2", &[10, 13]);
        }
        s
    };
    let models: [(&ModelPerRank, [&str; 2]); 2] = [
        (
            &extra,
            [
                "has 4 parameters (175 elements)",
                "has 5 parameters (179 elements)",
            ],
        ),
        (
            &transposed,
            [
                "parameter #2 is `w2` of shape [13, 10]",
                "parameter #2 is `w2` of shape [10, 13]",
            ],
        ),
    ];
    for (model, want) in models {
        let errs = threads(2, &Opts::default(), |rank, comm| {
            match Engine::<f32>::new(&comm.unwrap(), &model(rank), &init, cfg(3, None)) {
                Ok(_) => panic!("rank {rank}: {}: the engine was built", want[rank]),
                Err(e) => e.to_string(),
            }
        });
        for (rank, e) in errs.iter().enumerate() {
            assert!(
                e.contains(want[rank])
                    && e.contains(&format!("(rank {rank})"))
                    && e.contains("build the same model on every rank"),
                "{e}"
            );
        }
    }
    // Agreeing ranks are built as before.
    threads(2, &Opts::default(), |_, comm| {
        Engine::<f32>::new(&comm.unwrap(), &specs(), &init, cfg(2, None)).unwrap();
    });
}
