//! The ZeRO engine on device memory ([`DeviceEngine`] over a `DeviceComm` on the host stream:
//! the device engine's collectives, the optimizer's work queued on the stream) against the host
//! [`Engine`] on the same data: bit for bit, every stage and precision, clipped or not, with
//! gradient accumulation; fp16 overflow; bad input refused with nothing changed.

use half::{bf16, f16};
use ringzero::kernels::cpu::{cast, Float};
use ringzero::{Communicator, DeviceComm, HostStream, TransportPref};
use ringzero_zero::{
    DeviceEngine, Engine, LossScaling, Precision, StepOutcome, ZeroConfig, ZeroError,
};

use crate::common::{threads, Opts};
use crate::zero::{cfg_in, grad, init, specs};

fn narrow<T: Float>(x: &[f32]) -> Vec<T> {
    let mut out = vec![T::default(); x.len()];
    cast(x, &mut out);
    out
}

/// What one training run gives: every step's outcome, each parameter's final values (widened
/// from `T`) and the consolidated fp32 masters.
type Run = (Vec<StepOutcome>, Vec<Vec<f32>>, Vec<(String, Vec<f32>)>);

/// The gradients of one micro-step (scaled by `scale`, in `T`), from the parameters' values.
fn grads_of<T: Float>(values: &[Vec<f32>], rank: usize, micro: usize, scale: f32) -> Vec<Vec<T>> {
    values
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let g: Vec<f32> = grad(v, rank, micro, i).iter().map(|x| x * scale).collect();
            narrow(&g)
        })
        .collect()
}

/// What the training loops below ask of either engine.
trait Trains<T> {
    fn gather(&mut self, names: &[&str]);
    fn prefetch(&mut self, names: &[&str]);
    fn release(&mut self, names: &[&str]);
    fn value(&self, name: &str) -> Vec<f32>;
    fn push(&mut self, name: &str, g: &[T]);
    fn step(&mut self) -> StepOutcome;
    fn loss_scale(&self) -> f32;
}

impl<T: Float> Trains<T> for Engine<'_, T> {
    fn gather(&mut self, names: &[&str]) {
        Engine::gather(self, names).unwrap()
    }
    fn prefetch(&mut self, names: &[&str]) {
        Engine::prefetch(self, names).unwrap()
    }
    fn release(&mut self, names: &[&str]) {
        Engine::release(self, names).unwrap()
    }
    fn value(&self, name: &str) -> Vec<f32> {
        self.param_f32(name).unwrap()
    }
    fn push(&mut self, name: &str, g: &[T]) {
        self.push_grad(name, g).unwrap()
    }
    fn step(&mut self) -> StepOutcome {
        Engine::step(self).unwrap()
    }
    fn loss_scale(&self) -> f32 {
        Engine::loss_scale(self)
    }
}

impl<T: Float> Trains<T> for DeviceEngine<'_, HostStream, T> {
    fn gather(&mut self, names: &[&str]) {
        DeviceEngine::gather(self, names).unwrap()
    }
    fn prefetch(&mut self, names: &[&str]) {
        DeviceEngine::prefetch(self, names).unwrap()
    }
    fn release(&mut self, names: &[&str]) {
        DeviceEngine::release(self, names).unwrap()
    }
    fn value(&self, name: &str) -> Vec<f32> {
        self.param_to_host(name).unwrap()
    }
    fn push(&mut self, name: &str, g: &[T]) {
        self.push_grad(name, g).unwrap()
    }
    fn step(&mut self) -> StepOutcome {
        DeviceEngine::step(self).unwrap()
    }
    fn loss_scale(&self) -> f32 {
        DeviceEngine::loss_scale(self)
    }
}

/// `count` micro-steps from micro-step `from` (the data of `rank`): layer by layer, each
/// prefetching the next (a no-op unless stage 3 with prefetch on), then every gradient.
fn train<T: Float>(
    e: &mut impl Trains<T>,
    rank: usize,
    from: usize,
    count: usize,
) -> Vec<StepOutcome> {
    let sp = specs();
    let names: Vec<&str> = sp.iter().map(|s| s.name.as_str()).collect();
    let mut outs = Vec::new();
    for t in from..from + count {
        let mut values = Vec::new();
        for (i, n) in names.iter().enumerate() {
            e.gather(&[n]);
            if let Some(next) = names.get(i + 1) {
                e.prefetch(&[next]);
            }
            values.push(e.value(n));
            e.release(&[n]);
        }
        for (n, g) in names
            .iter()
            .zip(grads_of::<T>(&values, rank, t, e.loss_scale()))
        {
            e.push(n, &g);
        }
        outs.push(e.step());
    }
    outs
}

/// Every parameter's values now (gathered and released again).
fn values<T: Float>(e: &mut impl Trains<T>) -> Vec<Vec<f32>> {
    let sp = specs();
    let names: Vec<&str> = sp.iter().map(|s| s.name.as_str()).collect();
    e.gather(&names);
    let values = names.iter().map(|n| e.value(n)).collect();
    e.release(&names);
    values
}

fn host_run<T: Float>(comm: &Communicator, c: ZeroConfig, micro_steps: usize) -> Run {
    let mut e = Engine::<T>::new(comm, &specs(), &init, c).unwrap();
    let outs = train(&mut e, comm.rank(), 0, micro_steps);
    (outs, values(&mut e), e.consolidate().unwrap())
}

fn device_run<T: Float>(comm: &Communicator, c: ZeroConfig, micro_steps: usize) -> Run {
    let mut dc = DeviceComm::new(comm, HostStream::new()).unwrap();
    let mut e = DeviceEngine::<_, T>::new(&mut dc, &specs(), &init, c).unwrap();
    let outs = train(&mut e, comm.rank(), 0, micro_steps);
    (outs, values(&mut e), e.consolidate().unwrap())
}

fn parity<T: Float>(p: Precision, accumulation: &[usize]) {
    for n in 1..=3 {
        let o = Opts {
            transport: if n == 2 {
                TransportPref::Tcp
            } else {
                TransportPref::Shm
            },
            ..Opts::default()
        };
        threads(n, &o, |rank, comm| {
            let comm = comm.unwrap();
            for &acc in accumulation {
                for (clip, overlap) in [(None, false), (Some(0.5), false), (Some(0.5), true)] {
                    for stage in 0..=3 {
                        // Overlap: reduce-scatters and (stage 3) prefetches on the proxy thread.
                        let c = ZeroConfig {
                            accumulation_steps: acc,
                            overlap_comm: overlap,
                            prefetch_elems: if overlap { 100 } else { 0 },
                            ..cfg_in(p, stage, clip)
                        };
                        let want = host_run::<T>(&comm, c.clone(), 3 * acc);
                        let got = device_run::<T>(&comm, c, 3 * acc);
                        let what = format!(
                            "{p} n={n} rank {rank} stage {stage} clip {clip:?} accumulation \
                             {acc} overlap {overlap}"
                        );
                        assert_eq!(got.0, want.0, "{what}: step outcomes");
                        for (i, (g, w)) in got.1.iter().zip(&want.1).enumerate() {
                            let (g, w): (Vec<u32>, Vec<u32>) = (
                                g.iter().map(|x| x.to_bits()).collect(),
                                w.iter().map(|x| x.to_bits()).collect(),
                            );
                            assert_eq!(g, w, "{what}: parameter {i}");
                        }
                        assert_eq!(got.2, want.2, "{what}: consolidated masters");
                    }
                }
            }
        });
    }
}

#[test]
fn the_device_engine_matches_the_host_engine_bit_for_bit_in_fp32() {
    parity::<f32>(Precision::Fp32, &[1, 2]);
}

#[test]
fn the_device_engine_matches_the_host_engine_bit_for_bit_in_bf16_and_fp16() {
    parity::<bf16>(Precision::Bf16, &[1]);
    parity::<f16>(Precision::Fp16, &[1, 2]);
}

/// An inf on one rank's gradient skips the step on every rank, halves the loss scale and
/// changes no weight.
#[test]
fn an_fp16_overflow_on_one_rank_skips_the_device_step_everywhere() {
    threads(3, &Opts::default(), |rank, comm| {
        let comm = comm.unwrap();
        let sp = specs();
        for stage in 0..=3u8 {
            let c = ZeroConfig {
                loss_scaling: LossScaling {
                    initial_scale_power: 10,
                    hysteresis: 1,
                    ..LossScaling::default()
                },
                ..cfg_in(Precision::Fp16, stage, Some(1.0))
            };
            let mut dc = DeviceComm::new(&comm, HostStream::new()).unwrap();
            let mut e = DeviceEngine::<_, f16>::new(&mut dc, &sp, &init, c).unwrap();
            let before = e.consolidate().unwrap();
            for s in &sp {
                let mut g = vec![0.1 * e.loss_scale(); s.numel()];
                if rank == 1 && s.name == "w2" {
                    g[77] = f32::INFINITY;
                }
                e.push_grad(&s.name, &narrow::<f16>(&g)).unwrap();
            }
            assert_eq!(
                e.step().unwrap(),
                StepOutcome::Skipped { loss_scale: 512.0 },
                "stage {stage} rank {rank}"
            );
            assert_eq!((e.steps(), e.skipped_steps()), (0, 1));
            assert_eq!(before, e.consolidate().unwrap(), "stage {stage}");
            for s in &sp {
                e.push_grad(&s.name, &narrow::<f16>(&vec![0.1 * 512.0; s.numel()]))
                    .unwrap();
            }
            assert!(matches!(e.step().unwrap(), StepOutcome::Stepped { .. }));
            for (_, w) in e.consolidate().unwrap() {
                assert!(w.iter().all(|x| x.is_finite()), "stage {stage}");
            }
        }
    });
}

/// Prefetch is real: the next buckets are in flight (counted as communication buffers, bounded by
/// `prefetch_elems`), and `gather` takes them.
#[test]
fn device_prefetch_is_real_and_bounded() {
    threads(2, &Opts::default(), |_, comm| {
        let comm = comm.unwrap();
        let sp = specs();
        let part =
            ringzero_zero::Partition::new(&sp, 2, cfg_in(Precision::Fp32, 3, None).bucket_elems)
                .unwrap();
        let (b1, b2) = (part.slots[0].bucket, part.slots[2].bucket);
        assert_ne!(b1, b2, "w1 and w2 in different buckets");
        // Room for w1's bucket (the whole bucket and the shard copy it gathers from), not more.
        let len = part.buckets[b1].len;
        let c = ZeroConfig {
            prefetch_elems: len + len / 2,
            ..cfg_in(Precision::Fp32, 3, None)
        };
        let mut dc = DeviceComm::new(&comm, HostStream::new()).unwrap();
        let mut e = DeviceEngine::<_, f32>::new(&mut dc, &sp, &init, c).unwrap();
        assert_eq!(e.memory().comm_buffers, 0);
        e.prefetch(&["w1", "w2"]).unwrap();
        assert_eq!(
            e.memory().comm_buffers,
            4 * (len + len / 2),
            "only w1's bucket flies"
        );
        // Buffers given back are kept for the next micro-step (counted as communication
        // buffers, by capacity: the largest bucket, or its shard).
        let cap = part.buckets.iter().map(|b| b.len).max().unwrap();
        e.gather(&["w1"]).unwrap();
        assert_eq!(
            e.memory().comm_buffers,
            4 * (len + cap / 2),
            "the prefetched bucket, now gathered, and the kept shard copy"
        );
        assert_eq!(e.param_to_host("w1").unwrap()[5], init(0, 5));
        e.release(&["w1"]).unwrap();
        assert_eq!(e.memory().comm_buffers, 4 * (cap + cap / 2), "both kept");
        // Gathering another bucket takes the kept buffer: nothing more is held.
        e.gather(&["w2"]).unwrap();
        let w2 = part.buckets[b2].len;
        assert_eq!(e.memory().comm_buffers, 4 * (w2 + cap / 2));
        assert_eq!(e.param_to_host("w2").unwrap()[7], init(2, 7));
    });
}

/// A checkpoint saved by either engine loads into the other, at another stage (and precision
/// where the states allow it): the consolidated weights agree, and one more step on both gives
/// the same parameters (masters, moments and the step count all came across).
#[test]
fn checkpoints_move_between_the_device_and_the_host_engine() {
    let root = crate::common::fresh_dir("zero-device-ckpt");
    threads(2, &Opts::default(), |rank, comm| {
        let comm = comm.unwrap();
        let sp = specs();
        for (k, (stage_a, stage_b)) in [(1u8, 3u8), (3, 0), (2, 2), (0, 1)].into_iter().enumerate()
        {
            let (ca, cb) = (
                cfg_in(Precision::Bf16, stage_a, Some(0.5)),
                cfg_in(Precision::Bf16, stage_b, Some(0.5)),
            );
            // Device → host.
            let dir = root.join(format!("d2h-{k}"));
            let mut dc = DeviceComm::new(&comm, HostStream::new()).unwrap();
            let mut d = DeviceEngine::<_, bf16>::new(&mut dc, &sp, &init, ca.clone()).unwrap();
            train(&mut d, rank, 0, 2);
            d.save_checkpoint(&dir, serde_json::json!({"k": k}))
                .unwrap();
            let mut h = Engine::<bf16>::new(&comm, &sp, &init, cb.clone()).unwrap();
            let meta = h.load_checkpoint(&dir).unwrap();
            assert_eq!(
                (meta.step, meta.client_state["k"].as_u64()),
                (2, Some(k as u64))
            );
            assert_eq!(
                h.consolidate().unwrap(),
                d.consolidate().unwrap(),
                "case {k}"
            );
            assert_eq!(train(&mut h, rank, 2, 1), train(&mut d, rank, 2, 1));
            assert_eq!(values(&mut h), values(&mut d), "case {k} after a step");
            drop(d);
            // Host → device.
            let dir = root.join(format!("h2d-{k}"));
            h.save_checkpoint(&dir, serde_json::Value::Null).unwrap();
            let mut d = DeviceEngine::<_, bf16>::new(&mut dc, &sp, &init, ca).unwrap();
            d.load_checkpoint(&dir).unwrap();
            assert_eq!(d.steps(), 3);
            assert_eq!(
                h.consolidate().unwrap(),
                d.consolidate().unwrap(),
                "case {k}"
            );
            assert_eq!(train(&mut h, rank, 3, 1), train(&mut d, rank, 3, 1));
            assert_eq!(values(&mut h), values(&mut d), "case {k} after a step");
        }
    });
}

/// Hybrid sharding on device communicators (four thread ranks, two groups of two): bit for bit
/// the host engine's hybrid sharding, every stage; a checkpoint the device groups save loads
/// into the host groups; replicas holding different shards are refused on every rank.
#[test]
fn device_hybrid_sharding_matches_the_host_engines() {
    let root = crate::common::fresh_dir("zero-device-hybrid");
    threads(4, &Opts::default(), |rank, world| {
        let world = world.unwrap();
        let (shard, rep) = ringzero_zero::hybrid_groups(&world, 2).unwrap();
        let mut ds = DeviceComm::new(&shard, HostStream::new()).unwrap();
        let mut dr = DeviceComm::new(&rep, HostStream::new()).unwrap();
        let sp = specs();
        for (k, stage) in (0..=3u8).enumerate() {
            let c = ZeroConfig {
                shard_size: Some(2),
                ..cfg_in(Precision::Bf16, stage, Some(0.5))
            };
            let mut h = Engine::<bf16>::new_hybrid(&shard, &rep, &sp, &init, c.clone()).unwrap();
            let mut d =
                DeviceEngine::<_, bf16>::new_hybrid(&mut ds, &mut dr, &sp, &init, c.clone())
                    .unwrap();
            assert_eq!(
                train(&mut h, rank, 0, 3),
                train(&mut d, rank, 0, 3),
                "stage {stage}"
            );
            assert_eq!(values(&mut h), values(&mut d), "stage {stage}");
            let dir = root.join(format!("stage{k}"));
            d.save_checkpoint(&dir, serde_json::Value::Null).unwrap();
            let mut h2 = Engine::<bf16>::new_hybrid(&shard, &rep, &sp, &init, c).unwrap();
            assert_eq!(h2.load_checkpoint(&dir).unwrap().step, 3);
            assert_eq!(h2.consolidate().unwrap(), d.consolidate().unwrap());
        }
        // Replicas holding different shards: shard groups {0,1} and {2,3} but replica groups
        // {0,3} and {1,2} (colors by rank parity, ordered so 0 and 3 pair).
        let bad = world
            .split(Some(u32::from(rank == 0 || rank == 3)), rank as u32)
            .unwrap()
            .unwrap();
        let mut db = DeviceComm::new(&bad, HostStream::new()).unwrap();
        let c = cfg_in(Precision::Fp32, 2, None);
        let e = DeviceEngine::<_, f32>::new_hybrid(&mut ds, &mut db, &sp, &init, c)
            .err()
            .expect("refused");
        assert!(
            e.to_string().contains("hybrid sharding"),
            "rank {rank}: {e}"
        );
    });
}

#[test]
fn bad_input_to_the_device_engine_is_refused_and_changes_nothing() {
    threads(2, &Opts::default(), |_, comm| {
        let comm = comm.unwrap();
        let sp = specs();
        let mut dc = DeviceComm::new(&comm, HostStream::new()).unwrap();
        let mut e =
            DeviceEngine::<_, f32>::new(&mut dc, &sp, &init, cfg_in(Precision::Fp32, 3, None))
                .unwrap();
        let before = e.consolidate().unwrap();
        let b1 = vec![0.5f32; 5];
        assert!(matches!(
            e.push_grad("nope", &b1),
            Err(ZeroError::UnknownParam(n)) if n == "nope"
        ));
        assert!(matches!(
            e.push_grad("w1", &b1),
            Err(ZeroError::GradLength {
                got: 5,
                want: 37,
                ..
            })
        ));
        let e16 = e.push_grad("b1", &vec![bf16::ZERO; 5]).unwrap_err();
        assert!(e16.to_string().contains("is bf16 but"), "{e16}");
        e.push_grad("b1", &b1).unwrap();
        assert!(matches!(
            e.push_grad("b1", &b1),
            Err(ZeroError::GradTwice(n)) if n == "b1"
        ));
        assert!(matches!(e.step(), Err(ZeroError::MissingGrads(_))));
        assert!(matches!(
            e.param_addr("w1"),
            Err(ZeroError::NotGathered(n)) if n == "w1"
        ));
        e.gather(&["w1"]).unwrap();
        assert!(matches!(
            e.gather(&["w1"]),
            Err(ZeroError::AlreadyGathered(n)) if n == "w1"
        ));
        assert_eq!(e.param_to_host("w1").unwrap().len(), 37);
        assert!(matches!(e.release(&["b2"]), Err(ZeroError::NotGathered(_))));
        e.release(&["w1"]).unwrap();
        assert_eq!(before, e.consolidate().unwrap());
        // A config that shards over groups is not for `new`.
        drop(e);
        let c = ZeroConfig {
            shard_size: Some(1),
            ..cfg_in(Precision::Fp32, 3, None)
        };
        let err = DeviceEngine::<_, f32>::new(&mut dc, &sp, &init, c)
            .err()
            .expect("refused");
        assert!(
            err.to_string().contains("DeviceEngine::new_hybrid"),
            "{err}"
        );
    });
}
