//! The communication buffers' peak predicted by replaying a trainer's calls
//! (`ringzero_zero::comm_peak`) against the engine's own count of the same buffers as it makes
//! and drops them, for the same calls on real engines (thread ranks, the host stream): equal to
//! the byte in every stage, precision and setting that changes which buffers exist —
//! `overlap_comm`, prefetch, the all-gather's pieces, accumulation, persistent parameters,
//! buckets kept for a reuse, the optimizer offloaded, and the order gradients come in.

use half::bf16;
use ringzero::kernels::cpu::Float;
use ringzero_zero::comm_peak::{comm_buffers_peak, Call};
use ringzero_zero::{Engine, OffloadOptimizer, ParamSpec, Partition, Precision, ZeroConfig};

use crate::common::{threads, Opts};
use crate::zero::{grad, init};

/// Eight parameters in buckets of 64 elements: several buckets of different lengths, one
/// parameter larger than a bucket, small ones beside large ones.
fn specs() -> Vec<ParamSpec> {
    [
        ("emb", &[9usize, 7][..]),
        ("ln.w", &[7]),
        ("ln.b", &[7]),
        ("fc.w", &[7, 12]),
        ("fc.b", &[12]),
        ("proj.w", &[12, 5]),
        ("proj.b", &[5]),
        ("head", &[5, 9]),
    ]
    .iter()
    .map(|(n, s)| ParamSpec::new(*n, s))
    .collect()
}

/// The trainer's calls over `steps` optimizer steps: at stage 3 forward gathers `modules` in
/// turn (each released before the next; with `by_hand`, the next prefetched before each
/// gather), then every gradient is pushed in `pushes`' order.
fn calls_with(
    steps: usize,
    accum: usize,
    modules: &[Vec<usize>],
    pushes: &[usize],
    by_hand: bool,
) -> Vec<Call> {
    let mut out = Vec::new();
    for _ in 0..steps * accum {
        for (k, m) in modules.iter().enumerate() {
            if let Some(next) = modules.get(k + 1).filter(|_| by_hand) {
                out.push(Call::Prefetch(next.clone()));
            }
            out.push(Call::Gather(m.clone()));
            out.push(Call::Release(m.clone()));
        }
        out.extend(pushes.iter().map(|&p| Call::Push(p)));
        out.push(Call::Step);
    }
    out
}

fn calls(steps: usize, accum: usize, modules: &[Vec<usize>], pushes: &[usize]) -> Vec<Call> {
    calls_with(steps, accum, modules, pushes, false)
}

/// Make `calls` on an engine of `T` under `c`; its counted peak.
fn run<T: Float>(
    comm: &ringzero::Communicator,
    sp: &[ParamSpec],
    c: &ZeroConfig,
    calls: &[Call],
) -> usize {
    let mut e = Engine::<T>::new(comm, sp, &init, c.clone()).unwrap();
    let mut t = 0;
    for call in calls {
        let names = |ps: &[usize]| ps.iter().map(|&p| sp[p].name.as_str()).collect::<Vec<_>>();
        match call {
            Call::Gather(ps) if c.stage == 3 => e.gather(&names(ps)).unwrap(),
            Call::Release(ps) if c.stage == 3 => e.release(&names(ps)).unwrap(),
            Call::Prefetch(ps) if c.stage == 3 => e.prefetch(&names(ps)).unwrap(),
            Call::Gather(_) | Call::Release(_) | Call::Prefetch(_) => {}
            Call::Push(p) => {
                let g = grad(&vec![0.5; sp[*p].numel()], comm.rank(), t, *p);
                e.push_grad_f32(&sp[*p].name, &g).unwrap();
            }
            Call::RestartOrder => e.restart_order(),
            Call::Step => {
                e.step().unwrap();
                t += 1;
            }
        }
    }
    e.memory().comm_buffers_peak
}

#[test]
fn the_replayed_peak_equals_the_engines_count_in_every_setting() {
    for world in [2usize, 3] {
        threads(world, &Opts::default(), |_, comm| {
            let comm = comm.unwrap();
            let sp = specs();
            let np = sp.len();
            let forward_order: Vec<usize> = (0..np).collect();
            let backward: Vec<usize> = (0..np).rev().collect();
            // Gradients arriving out of bucket order keep several buckets filling at once.
            let interleaved: Vec<usize> = (0..np).step_by(2).chain((1..np).step_by(2)).collect();
            let alone: Vec<Vec<usize>> = (0..np).map(|p| vec![p]).collect();
            let modules = vec![vec![0], vec![1, 2], vec![3, 4], vec![5, 6], vec![7]];
            let mut checked = 0;
            for stage in 0..=3u8 {
                for (overlap, prefetch, allgather, accum, persist, reuse) in [
                    (false, 0, 1 << 20, 1, 0, 0),
                    (true, 0, 1 << 20, 1, 0, 1_000_000_000),
                    (true, 200, 7, 2, 0, 20),
                    (false, 90, 20, 1, 8, 0),
                    (true, 1000, 1 << 20, 2, 13, 40),
                ] {
                    for offload in [false, true] {
                        if offload && stage == 0 {
                            continue;
                        }
                        let mut c = ZeroConfig {
                            stage,
                            bucket_elems: 64,
                            overlap_comm: overlap,
                            prefetch_elems: prefetch,
                            allgather_elems: allgather,
                            accumulation_steps: accum,
                            persistence_threshold: persist,
                            reuse_elems: reuse,
                            ..ZeroConfig::default()
                        };
                        if offload {
                            c.offload.optimizer = OffloadOptimizer::cpu();
                        }
                        let part = Partition::new(&sp, world, c.bucket_elems).unwrap();
                        for (fwd, push) in [
                            (&modules, &backward),
                            (&alone, &forward_order),
                            (&modules, &interleaved),
                        ] {
                            let fwd: &[Vec<usize>] = if stage == 3 { fwd } else { &[] };
                            let cs = calls(3, accum, fwd, push);
                            let predicted = comm_buffers_peak(&part, &c, cs.clone()).unwrap();
                            let counted = run::<f32>(&comm, &sp, &c, &cs);
                            let what = format!(
                                "{world} ranks, stage {stage}, overlap {overlap}, prefetch \
                                 {prefetch}, allgather {allgather}, accumulation {accum}, \
                                 persistence {persist}, reuse {reuse}, offload {offload}, \
                                 pushes {push:?}"
                            );
                            assert_eq!(predicted, counted, "{what}");
                            checked += usize::from(counted > 0);
                        }
                        if stage == 3 {
                            // Prefetches by hand as well as by the record.
                            let cs = calls_with(3, accum, &modules, &backward, true);
                            assert_eq!(
                                comm_buffers_peak(&part, &c, cs.clone()).unwrap(),
                                run::<f32>(&comm, &sp, &c, &cs),
                                "{world} ranks, prefetch {prefetch} by hand, offload {offload}"
                            );
                            // Every parameter read once before training, that order forgotten.
                            let all: Vec<usize> = (0..np).collect();
                            let mut cs = vec![
                                Call::Gather(all.clone()),
                                Call::Release(all),
                                Call::RestartOrder,
                            ];
                            cs.extend(calls(3, accum, &modules, &backward));
                            assert_eq!(
                                comm_buffers_peak(&part, &c, cs.clone()).unwrap(),
                                run::<f32>(&comm, &sp, &c, &cs),
                                "{world} ranks, a first read, reuse {reuse}, offload {offload}"
                            );
                        }
                        // In bf16 the same calls, half the bytes.
                        let c16 = ZeroConfig {
                            precision: Precision::Bf16,
                            ..c.clone()
                        };
                        let fwd: &[Vec<usize>] = if stage == 3 { &modules } else { &[] };
                        let cs = calls(2, accum, fwd, &backward);
                        assert_eq!(
                            comm_buffers_peak(&part, &c16, cs.clone()).unwrap(),
                            run::<bf16>(&comm, &sp, &c16, &cs),
                            "bf16, stage {stage}, overlap {overlap}, offload {offload}"
                        );
                    }
                }
            }
            // Every stage but 0 (whose all-reduces work in place) holds buffers: the test
            // compares something.
            assert!(checked >= 3 * 5 * 3, "only {checked} runs held buffers");
        });
    }
}

#[test]
fn overlap_comm_holds_three_buckets_and_two_shards_whatever_the_model() {
    // Forty equal buckets pushed back to back: without the bound every reduce-scatter could be
    // in flight at once.
    let sp: Vec<ParamSpec> = (0..40)
        .map(|i| ParamSpec::new(format!("p{i}"), &[64]))
        .collect();
    threads(2, &Opts::default(), |_, comm| {
        let comm = comm.unwrap();
        let c = ZeroConfig {
            stage: 2,
            bucket_elems: 64,
            overlap_comm: true,
            ..ZeroConfig::default()
        };
        let part = Partition::new(&sp, 2, 64).unwrap();
        assert_eq!(part.buckets.len(), 40);
        let cs = calls(2, 1, &[], &(0..40).rev().collect::<Vec<_>>());
        let counted = run::<f32>(&comm, &sp, &c, &cs);
        assert_eq!(counted, 4 * (3 * 64 + 2 * 32));
        assert_eq!(comm_buffers_peak(&part, &c, cs).unwrap(), counted);
    });
}

#[test]
fn calls_the_engine_would_refuse_are_refused() {
    let sp = specs();
    let part = Partition::new(&sp, 2, 64).unwrap();
    let c = ZeroConfig {
        stage: 2,
        bucket_elems: 64,
        ..ZeroConfig::default()
    };
    let e = comm_buffers_peak(&part, &c, [Call::Push(99)]).unwrap_err();
    assert!(e.to_string().contains("99"), "{e}");
    let e = comm_buffers_peak(&part, &c, [Call::Push(1), Call::Push(1)]).unwrap_err();
    assert!(e.to_string().contains("ln.w"), "{e}");
    let e = comm_buffers_peak(&part, &c, [Call::Push(1), Call::Step]).unwrap_err();
    assert!(
        e.to_string().contains("emb"),
        "a step with gradients missing: {e}"
    );
}
