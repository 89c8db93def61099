//! `Zero::hook` in a trainer's loop, as the README writes it: at stage 3 a step gathers each
//! bucket once (a bucket two modules share stays for the second, not gathered again); at
//! stages 0–2 it loads the variables once per optimizer step, also across an accumulation
//! window; at every stage the engine's report splits the step into forward and backward.

mod common;

use candle_core::Device;
use ringzero_candle::gpt;
use ringzero_candle::Zero;
use ringzero_zero::ZeroConfig;

use common::{ranks, small_gpt};

/// What one rank saw: the loss of every micro-step, and per optimizer step its report's
/// elements gathered, forward and backward time.
struct Seen {
    losses: Vec<f32>,
    gathered: Vec<u64>,
    padded: u64,
    timed: Vec<(bool, bool)>,
}

/// How a loop puts the parameters into the variables.
#[derive(Clone, Copy, PartialEq)]
enum Loop {
    /// Forward through `Zero::hook`.
    Hook,
    /// `Zero::load_params` before every micro-step, then plain forward.
    Load,
    /// Plain forward, then `Zero::backward_step` (candle's optimizers' loop).
    BackwardStep,
    /// As `Hook`, with an evaluation forward (through the hook, no backward) before each
    /// micro-step.
    HookEval,
}

/// `steps` optimizer steps of a two-block GPT on 2 ranks under `json`, loading as `how` says.
fn run(json: &str, steps: usize, how: Loop) -> Vec<Seen> {
    let (corpus, shape) = small_gpt(3);
    let cfg = ZeroConfig::from_json(json).unwrap();
    let accum = cfg.accumulation_steps.max(1);
    ranks(2, |comm| {
        let (model, varmap) = gpt::build(shape, 3, &Device::Cpu).unwrap();
        let mut zero = Zero::<f32>::new(&comm, &varmap, cfg.clone()).unwrap();
        let padded = (zero.engine().partition().buckets.iter())
            .map(|b| b.len as u64)
            .sum();
        let mut seen = Seen {
            losses: Vec::new(),
            gathered: Vec::new(),
            padded,
            timed: Vec::new(),
        };
        let rank = comm.rank() as u64;
        for step in 0..steps * accum {
            let ids: Vec<u64> = (0..4).map(|k| (step as u64 * 2 + rank) * 4 + k).collect();
            let (x, y) = corpus.batch(&ids, shape.ctx, &Device::Cpu).unwrap();
            if how == Loop::HookEval {
                let (ex, ey) = corpus.batch(&[9999], shape.ctx, &Device::Cpu).unwrap();
                model.loss_with(&ex, &ey, &mut zero.hook()).unwrap();
            }
            let loss = match how {
                Loop::Hook | Loop::HookEval => model.loss_with(&x, &y, &mut zero.hook()).unwrap(),
                Loop::Load => {
                    zero.load_params().unwrap();
                    model.loss(&x, &y).unwrap()
                }
                Loop::BackwardStep => model.loss(&x, &y).unwrap(),
            };
            seen.losses.push(gpt::scalar(&loss).unwrap());
            if how == Loop::BackwardStep {
                zero.backward_step(&loss).unwrap();
            } else {
                zero.backward(&zero.scaled(&loss).unwrap()).unwrap();
                zero.step().unwrap();
            }
            if step % accum == accum - 1 {
                let r = zero.engine().report().unwrap();
                seen.gathered.push(r.gathered_elems);
                seen.timed
                    .push((!r.forward.is_zero(), !r.backward.is_zero()));
            }
        }
        seen
    })
}

#[test]
fn at_stage_3_a_step_gathers_each_bucket_once_after_the_first() {
    // Buckets of 3000 elements: most are shared by two modules.
    let json = r#"{"zero_optimization": {"stage": 3, "reduce_bucket_size": 3000}}"#;
    for s in run(json, 4, Loop::Hook) {
        // The first step has no record of the order: a bucket two modules share is released
        // after the first and gathered again for the second.
        assert!(
            s.gathered[0] > s.padded,
            "step 1 gathered {} of {} elements: the buckets are not shared by modules, so \
             this test shows nothing",
            s.gathered[0],
            s.padded
        );
        for (t, &g) in s.gathered.iter().enumerate().skip(1) {
            assert_eq!(g, s.padded, "step {}: each bucket once", t + 1);
        }
        assert!(
            s.timed.iter().all(|&(f, b)| f && b),
            "forward and backward are timed"
        );
    }
}

#[test]
fn at_stages_0_to_2_the_hook_loads_once_per_step_and_trains_as_loading_every_micro_step() {
    for stage in 0..=2 {
        let json = accumulating(stage);
        let hooked = run(&json, 3, Loop::Hook);
        let loaded = run(&json, 3, Loop::Load);
        for (h, l) in hooked.iter().zip(&loaded) {
            // A stale variable (a load skipped after a step) or a wrong one changes the loss.
            assert_eq!(h.losses, l.losses, "stage {stage}");
            assert!(h.timed.iter().all(|&(f, b)| f && b), "stage {stage}");
            assert!(
                h.gathered.iter().all(|&g| g == 0),
                "stage {stage} gathers nothing"
            );
        }
    }
}

/// A loop written for candle's optimizers — forward, then `backward_step` — trains as loading
/// before every micro-step does, bit for bit, at every stage, with accumulation: the variables
/// are current when each forward starts.
#[test]
fn backward_step_trains_as_loading_before_forward() {
    same_losses_at_every_stage(Loop::BackwardStep, Loop::Load);
}

/// An evaluation forward through the hook between training micro-steps (no backward) changes
/// nothing the training computes, at every stage.
#[test]
fn an_evaluation_forward_between_steps_changes_no_loss() {
    same_losses_at_every_stage(Loop::HookEval, Loop::Hook);
}

/// Stages 0–3 with accumulation 2: loops `a` and `b` see the same losses on every rank.
fn same_losses_at_every_stage(a: Loop, b: Loop) {
    for stage in 0..=3 {
        let json = accumulating(stage);
        for (x, y) in run(&json, 3, a).iter().zip(&run(&json, 3, b)) {
            assert_eq!(x.losses, y.losses, "stage {stage}");
        }
    }
}

/// A config of `stage` with buckets of 3000 elements and 2 accumulation steps.
fn accumulating(stage: u8) -> String {
    format!(
        r#"{{"zero_optimization": {{"stage": {stage}, "reduce_bucket_size": 3000}},
            "gradient_accumulation_steps": 2}}"#
    )
}

/// Fine-tuning with the embeddings frozen: only the other variables are wrapped
/// (`Zero::from_vars`); the hook passes over the frozen modules at stage 3, the frozen
/// variables keep their values bit for bit, and every stage trains the rest alike.
#[test]
fn frozen_variables_left_out_of_the_wrapper_stay_as_they_are() {
    let (corpus, shape) = small_gpt(4);
    let frozen = |name: &str| name.starts_with("tok") || name.starts_with("pos");
    let curves: Vec<Vec<f32>> = (0..=3)
        .map(|stage| {
            let cfg = ZeroConfig::from_json(&format!(
                r#"{{"zero_optimization": {{"stage": {stage}, "reduce_bucket_size": 3000}}}}"#
            ))
            .unwrap();
            ranks(2, |comm| {
                let (model, varmap) = gpt::build(shape, 3, &Device::Cpu).unwrap();
                let all = varmap.data().lock().unwrap().clone();
                let values = |name: &str| {
                    (all[name].as_tensor().flatten_all().unwrap())
                        .to_vec1::<f32>()
                        .unwrap()
                };
                let before: Vec<(String, Vec<f32>)> =
                    (all.keys()).map(|n| (n.clone(), values(n))).collect();
                let trained = (all.iter())
                    .filter(|(n, _)| !frozen(n))
                    .map(|(n, v)| (n.clone(), v.clone()))
                    .collect();
                let mut zero = Zero::<f32>::from_vars(&comm, trained, cfg.clone()).unwrap();
                let mut losses = Vec::new();
                for step in 0..4u64 {
                    let ids: Vec<u64> = (0..4)
                        .map(|k| (step * 2 + comm.rank() as u64) * 4 + k)
                        .collect();
                    let (x, y) = corpus.batch(&ids, shape.ctx, &Device::Cpu).unwrap();
                    let loss = model.loss_with(&x, &y, &mut zero.hook()).unwrap();
                    losses.push(gpt::scalar(&loss).unwrap());
                    zero.backward(&zero.scaled(&loss).unwrap()).unwrap();
                    zero.step().unwrap();
                }
                zero.load_params().unwrap();
                for (name, was) in &before {
                    let same = &values(name) == was;
                    assert_eq!(same, frozen(name), "stage {stage}: {name}");
                }
                losses
            })
            .remove(0)
        })
        .collect();
    for (stage, c) in curves.iter().enumerate() {
        assert_eq!(c, &curves[0], "stage {stage} differs from stage 0");
    }
    assert!(curves[0][3] < curves[0][0], "{:?}", curves[0]);
}
