//! ZeRO on candle against candle alone: a GPT trained data-parallel with every stage, on 2 and
//! 3 ranks, follows the loss curve of single-process candle training (candle-nn's AdamW) on the
//! same global batches, and the stages match one another bit for bit.

mod common;

use candle_core::Device;
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use ringzero_candle::corpus::Corpus;
use ringzero_candle::gpt::{self, GptConfig};
use ringzero_candle::train::{train, TrainArgs};
use ringzero_candle::Zero;
use ringzero_zero::ZeroConfig;

use common::ranks;

const STEPS: usize = 20;
const LR: f64 = 0.003;

fn args() -> TrainArgs {
    TrainArgs {
        model: GptConfig {
            vocab: 0,
            ctx: 16,
            dim: 32,
            heads: 2,
            layers: 1,
        },
        steps: STEPS,
        batch: 4,
        seed: 5,
        corpus_bytes: 64 << 10,
        ..TrainArgs::default()
    }
}

/// The engine as candle-nn's AdamW runs alone: no clipping (DeepSpeed's default clips at 1.0).
fn config(stage: u8) -> ZeroConfig {
    ZeroConfig::from_json(&format!(
        r#"{{"zero_optimization": {{"stage": {stage}, "reduce_bucket_size": 3000}},
            "gradient_clipping": 0,
            "optimizer": {{"type": "AdamW", "params": {{"lr": {LR}, "betas": [0.9, 0.999],
                           "eps": 1e-8, "weight_decay": 0.01}}}}}}"#
    ))
    .unwrap()
}

/// Single-process candle: the same model and initial weights, candle-nn's AdamW, each step on
/// the whole global batch of `world` ranks.
fn candle_alone(world: usize) -> Vec<f32> {
    let a = args();
    let corpus = Corpus::generate(a.corpus_bytes, a.seed);
    let shape = GptConfig {
        vocab: corpus.vocab(),
        ..a.model
    };
    let (model, varmap) = gpt::build(shape, a.seed, &Device::Cpu).unwrap();
    let p = ParamsAdamW {
        lr: LR,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    };
    let mut opt = AdamW::new(varmap.all_vars(), p).unwrap();
    let global = world * a.batch;
    (0..STEPS)
        .map(|step| {
            let ids: Vec<u64> = (step * global..(step + 1) * global)
                .map(|g| g as u64)
                .collect();
            let (x, y) = corpus.batch(&ids, shape.ctx, &Device::Cpu).unwrap();
            let loss = model.loss(&x, &y).unwrap();
            opt.backward_step(&loss).unwrap();
            gpt::scalar(&loss).unwrap()
        })
        .collect()
}

/// Every stage on `world` ranks: the same curve bit for bit; candle alone's within 2e-4 of the
/// loss (float sums in another order, in the gradient average and in the optimizer's
/// arithmetic, compound over 20 steps; a real divergence — a wrong average, a missed gradient,
/// a stale parameter — moves the curve by 1e-2 and more within a few steps), and the loss falls.
fn parity(world: usize) {
    let reference = candle_alone(world);
    let mut curves = Vec::new();
    for stage in 0..=3u8 {
        let per_rank = ranks(world, |comm| {
            let r = train::<f32>(&comm, config(stage), &args(), |_| {}).unwrap();
            assert_eq!(
                r.footprint.comm_buffers, r.comm_buffers_counted,
                "stage {stage}: the predicted communication buffers against the engine's count"
            );
            r.losses
        });
        assert!(
            per_rank.windows(2).all(|w| w[0] == w[1]),
            "stage {stage}: ranks disagree"
        );
        curves.push(per_rank.into_iter().next().unwrap());
    }
    for (stage, c) in curves.iter().enumerate() {
        assert_eq!(c, &curves[0], "stage {stage} differs from stage 0");
    }
    for (step, (z, r)) in curves[0].iter().zip(&reference).enumerate() {
        assert!(
            (z - r).abs() <= 2e-4 * r.abs().max(1.0),
            "step {step}: ZeRO {z} against candle alone {r}\nZeRO:   {:?}\ncandle: {reference:?}",
            curves[0]
        );
    }
    assert!(
        reference[STEPS - 1] < reference[0] - 0.3,
        "the loss did not fall: {reference:?}"
    );
}

/// The communication buffers `train` predicts (its calls replayed before the model is built)
/// are the engine's count of them, to the byte, with the settings that change them: the
/// reductions overlapped, stage 3's prefetch and persistent parameters, accumulation, offload.
#[test]
fn the_predicted_communication_buffers_are_the_engines() {
    let runs = [
        (
            2,
            r#""overlap_comm": true, "allgather_bucket_size": 500"#,
            1,
        ),
        (
            3,
            r#""overlap_comm": true, "stage3_prefetch_bucket_size": 9000"#,
            1,
        ),
        (
            3,
            r#""stage3_prefetch_bucket_size": 5000, "stage3_param_persistence_threshold": 40, "stage3_max_live_parameters": 12000"#,
            2,
        ),
        (
            2,
            r#""offload_optimizer": {"device": "cpu"}, "overlap_comm": true"#,
            2,
        ),
        (
            3,
            r#""offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}, "stage3_prefetch_bucket_size": 9000"#,
            1,
        ),
    ];
    for (stage, extra, accum) in runs {
        let cfg = ZeroConfig::from_json(&format!(
            r#"{{"zero_optimization": {{"stage": {stage}, "reduce_bucket_size": 3000, {extra}}},
                "gradient_accumulation_steps": {accum}}}"#
        ))
        .unwrap();
        let a = TrainArgs { steps: 4, ..args() };
        ranks(2, |comm| {
            let r = train::<f32>(&comm, cfg.clone(), &a, |_| {}).unwrap();
            assert!(r.comm_buffers_counted > 0, "{extra}");
            assert_eq!(
                r.footprint.comm_buffers, r.comm_buffers_counted,
                "stage {stage}, {extra}, accumulation {accum}"
            );
        });
    }
}

#[test]
fn zero_on_two_ranks_follows_candle_alone() {
    parity(2);
}

#[test]
fn zero_on_three_ranks_follows_candle_alone() {
    parity(3);
}

#[test]
fn wrapping_nothing_or_naming_no_module_says_what_to_do() {
    ranks(1, |comm| {
        let e = Zero::<f32>::new(&comm, &candle_nn::VarMap::new(), config(2))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("no variables to train"), "{e}");
        let (_, vm) = gpt::build(GptConfig::tiny(30), 1, &Device::Cpu).unwrap();
        let mut z = Zero::<f32>::new(&comm, &vm, config(3)).unwrap();
        let e = z.load_module("blocks.0.").unwrap_err().to_string();
        assert!(
            e.contains("\"blocks.0.\"") && e.contains("h.0.attn.proj.bias"),
            "{e}"
        );
    });
}

/// Ranks that built different models are refused before any value moves, each naming its own
/// parameter count (a broadcast of rank 0's weights would otherwise fail as a bare collective
/// mismatch).
#[test]
fn ranks_that_built_different_models_are_told_which() {
    let errs = ranks(2, |comm| {
        let shape = GptConfig {
            layers: 1 + comm.rank(),
            ..GptConfig::tiny(30)
        };
        let (_, vm) = gpt::build(shape, 1, &Device::Cpu).unwrap();
        Zero::<f32>::new(&comm, &vm, config(3))
            .err()
            .expect("different models were wrapped")
            .to_string()
    });
    let counts: Vec<usize> = (1..=2)
        .map(|layers| {
            GptConfig {
                layers,
                ..GptConfig::tiny(30)
            }
            .variables()
            .len()
        })
        .collect();
    for (rank, e) in errs.iter().enumerate() {
        let want = format!("this rank (rank {rank}) has {} parameters", counts[rank]);
        assert!(
            e.contains("the ranks built different models") && e.contains(&want),
            "{e}"
        );
    }
}

/// In bf16 (parameters and gradients 16-bit, fp32 master and moments), every stage on 2 ranks
/// still gives the same curve bit for bit, and it learns.
#[test]
fn bf16_stages_match_one_another() {
    let bf16 = |stage: u8| {
        let mut c = config(stage);
        c.precision = ringzero_zero::Precision::Bf16;
        c
    };
    let curves: Vec<Vec<f32>> = (0..=3u8)
        .map(|stage| {
            ranks(2, |comm| {
                train::<ringzero::half::bf16>(&comm, bf16(stage), &args(), |_| {})
                    .unwrap()
                    .losses
            })
            .remove(0)
        })
        .collect();
    for (stage, c) in curves.iter().enumerate() {
        assert_eq!(c, &curves[0], "bf16 stage {stage} differs from stage 0");
    }
    assert!(curves[0][STEPS - 1] < curves[0][0] - 0.3, "{:?}", curves[0]);
}

/// The GPT trained with its optimizer state offloaded — to host memory at stage 2, to the NVMe
/// tier with the parameter shards on NVMe too at stage 3 (ZeRO-Infinity) — gives the curve of
/// the same stage with everything on the engine's device, bit for bit.
#[test]
fn offloaded_state_trains_the_gpt_bit_for_bit() {
    use ringzero_zero::{OffloadDevice, OffloadOptimizer};
    let dir = std::env::temp_dir().join(format!("ringzero-candle-offload-{}", std::process::id()));
    for (stage, nvme) in [(2u8, false), (3, true)] {
        let curve = |offload: bool| {
            ranks(2, |comm| {
                let mut c = config(stage);
                if offload {
                    c.offload.optimizer = if nvme {
                        OffloadOptimizer::nvme(dir.join(comm.rank().to_string()))
                    } else {
                        OffloadOptimizer::cpu()
                    };
                    if stage == 3 {
                        // ZeRO-Infinity: the shards on NVMe beside the optimizer state.
                        c.offload.param.device = OffloadDevice::Nvme;
                        c.offload.param.nvme_path = Some(dir.join(comm.rank().to_string()));
                    }
                }
                train::<f32>(&comm, c, &args(), |_| {}).unwrap().losses
            })
            .remove(0)
        };
        assert_eq!(curve(true), curve(false), "stage {stage}, nvme {nvme}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A checkpoint saved through `Zero` on 2 ranks at stage 3 loads on 3 ranks at stage 1: every
/// variable holds the saved values, and the client state comes back.
#[test]
fn a_checkpoint_saved_on_two_ranks_loads_on_three() {
    let dir = std::env::temp_dir().join(format!("ringzero-candle-ck-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let shape = GptConfig {
        vocab: 30,
        ..args().model
    };
    let x = candle_core::Tensor::new(&[[1u32, 2, 3, 4, 5, 6, 7, 8]], &Device::Cpu).unwrap();
    let saved = ranks(2, |comm| {
        let (model, vm) = gpt::build(shape, 9, &Device::Cpu).unwrap();
        let mut zero = Zero::<f32>::new(&comm, &vm, config(3)).unwrap();
        for _ in 0..3 {
            zero.load_params().unwrap();
            let loss = model.loss(&x, &x).unwrap();
            zero.backward(&loss).unwrap();
            zero.step().unwrap();
        }
        zero.load_params().unwrap();
        zero.save_checkpoint(&dir, serde_json::json!({"step": 3}))
            .unwrap();
        snapshot(&zero)
    });
    let loaded = ranks(3, |comm| {
        let (_, vm) = gpt::build(shape, 1, &Device::Cpu).unwrap(); // other initial values
        let mut zero = Zero::<f32>::new(&comm, &vm, config(1)).unwrap();
        let client = zero.load_checkpoint(&dir).unwrap();
        assert_eq!(client["step"], 3);
        snapshot(&zero)
    });
    assert!(
        loaded.iter().all(|l| l == &saved[0]),
        "a variable differs after loading"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every variable's values, by name.
fn snapshot(z: &Zero<f32>) -> Vec<(String, Vec<f32>)> {
    z.vars()
        .iter()
        .map(|(n, v)| {
            let t = v.as_tensor().flatten_all().unwrap();
            (n.clone(), t.to_vec1::<f32>().unwrap())
        })
        .collect()
}

/// Variables that are bf16 themselves, under a bf16 engine on an explicit host stream
/// (`Zero::on_vars`): each rank's gradient (its own input, exact in bf16) enters the engine as
/// candle produced it, is averaged over the ranks, and plain SGD's step lands in the variables
/// exactly on both ranks.
#[test]
fn bf16_variables_take_their_gradients_as_they_are_and_step_exactly() {
    use candle_core::{DType, Tensor, Var};
    use ringzero_collectives::HostStream;
    let cfg = || {
        ZeroConfig::from_json(
            r#"{"bf16": {"enabled": true}, "zero_optimization": {"stage": 2},
                "gradient_clipping": 0,
                "optimizer": {"type": "SGD", "params": {"lr": 0.5}}}"#,
        )
        .unwrap()
    };
    let after = ranks(2, |comm| {
        let w = Tensor::new(&[1f32, 2.0, 3.0, 4.0], &Device::Cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let w = Var::from_tensor(&w).unwrap();
        let vars = vec![("w".to_string(), w.clone())];
        let mut z = Zero::<ringzero::half::bf16, HostStream>::on_vars(
            &comm,
            HostStream::new(),
            vars,
            cfg(),
        )
        .unwrap();
        let x = Tensor::full(comm.rank() as f32 + 1.0, 4, &Device::Cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let loss = (w.as_tensor() * &x).unwrap().sum_all().unwrap();
        z.backward(&z.scaled(&loss).unwrap()).unwrap();
        z.step().unwrap();
        z.load_params().unwrap();
        let v = w
            .as_tensor()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        v
    });
    // The averaged gradient is 1.5 everywhere; 0.5 × 1.5 off each weight.
    for v in after {
        assert_eq!(v, [0.25, 1.25, 2.25, 3.25]);
    }
}
