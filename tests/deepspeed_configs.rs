//! DeepSpeed configurations as DeepSpeed, Hugging Face transformers and accelerate, LLaMA-Factory
//! and axolotl publish them (`tests/fixtures/deepspeed/`), read by `ZeroConfig::from_json` and
//! trained with as published — the ones with `offload_optimizer` / `offload_param` on `"cpu"`
//! offload. Each drives two ranks for 30 steps of a least-squares fit, and the loss falls. A
//! scheduler's rate is the one the engine reports. Keys outside DeepSpeed's reference are
//! treated as DeepSpeed treats them.

use std::path::PathBuf;

use half::{bf16, f16};
use ringzero::kernels::cpu::Float;
use ringzero_zero::{Engine, ParamSpec, Precision, StepOutcome, ZeroConfig};

use crate::common::{threads, Opts};

fn fixtures() -> Vec<(String, String)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepspeed");
    let mut out: Vec<(String, String)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read_to_string(&p).unwrap())
        })
        .collect();
    out.sort();
    out
}

/// ½‖w − target‖², from the engine's fp32 masters.
fn loss(e: &Engine<impl Float>, target: &[f32]) -> f64 {
    let w = &e.consolidate().unwrap()[0].1;
    w.iter()
        .zip(target)
        .map(|(a, b)| 0.5 * f64::from(a - b).powi(2))
        .sum()
}

/// 30 steps of the fit on this rank; the loss before and after, and each rate used with the
/// optimizer step it was for.
fn fit<T: Float>(comm: &ringzero::Communicator, cfg: ZeroConfig) -> (f64, f64, Vec<(u64, f32)>) {
    let target: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut e = Engine::<T>::new(comm, &[ParamSpec::new("w", &[64])], &|_, _| 0.0, cfg).unwrap();
    let first = loss(&e, &target);
    let mut lrs = Vec::new();
    for _ in 0..30 {
        // Skipped (overflowed) steps do not advance the schedule: the step the rate is for.
        lrs.push((e.steps() + 1, e.lr()));
        for _ in 0..e.config().accumulation_steps {
            e.gather(&["w"]).unwrap();
            let w = e.param_f32("w").unwrap();
            e.release(&["w"]).unwrap();
            let scale = e.loss_scale();
            let g: Vec<f32> = w
                .iter()
                .zip(&target)
                .map(|(a, b)| (a - b) * scale)
                .collect();
            e.push_grad_f32("w", &g).unwrap();
            let _ = e.step().unwrap();
        }
    }
    (first, loss(&e, &target), lrs)
}

#[test]
fn published_deepspeed_configs_are_read_and_train() {
    let all = fixtures();
    assert!(all.len() >= 11, "{} fixtures", all.len());
    let mut offloaded = 0;
    for (name, text) in all {
        let cfg = ZeroConfig::from_json(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
        if text.contains("\"cpu\"") {
            offloaded += 1;
            assert!(cfg.offload.any(), "{name}: its offload was dropped");
        }
        threads(2, &Opts::default(), |_, comm| {
            let comm = comm.unwrap();
            let (first, last, lrs) = match cfg.precision {
                Precision::Fp32 => fit::<f32>(&comm, cfg.clone()),
                Precision::Bf16 => fit::<bf16>(&comm, cfg.clone()),
                Precision::Fp16 => fit::<f16>(&comm, cfg.clone()),
            };
            assert!(last < first, "{name}: loss {first} → {last}");
            if let Some(s) = &cfg.scheduler {
                for &(k, lr) in &lrs {
                    assert_eq!(lr, s.at(k, cfg.optimizer).lr, "{name}: step {k}");
                }
            }
        });
    }
    assert!(offloaded >= 6, "{offloaded} fixtures offload");
}

/// DeepSpeed reads the top-level keys it knows and ignores the rest, so published configs carry
/// some of their own: noted. A key of `zero_optimization` at the top level, or a near-miss of a
/// known key, is a mistake DeepSpeed would hide: refused, saying what to do. Inside
/// `zero_optimization` unknown keys are refused (DeepSpeed's model forbids them), and its
/// stage-3 keys read under both of DeepSpeed's names, once.
#[test]
fn keys_outside_the_reference_are_treated_as_deepspeed_treats_them() {
    let ok = |t: &str| ZeroConfig::from_json(t).unwrap_or_else(|e| panic!("{t}: {e}"));
    let err = |t: &str| ZeroConfig::from_json(t).unwrap_err().to_string();
    let c = ok(r#"{"monitor_config": {"enabled": true}, "zero_optimization": {"stage": 2}}"#);
    assert_eq!(c.stage, 2);
    assert!(
        c.notes
            .iter()
            .any(|n| n.contains("`monitor_config`") && n.contains("ignores")),
        "{:?}",
        c.notes
    );
    // Short keys are not near-misses of one another: LLaMA-Factory's `fp8` section is no `fp16`.
    let c = ok(r#"{"fp8": {"enabled": true}, "bf16": {"enabled": false}}"#);
    assert!(c.notes.iter().any(|n| n.contains("`fp8`")), "{:?}", c.notes);
    for (text, want) in [
        (r#"{"stage": 3}"#, "move it inside"),
        (
            r#"{"offload_optimizer": {"device": "cpu"}}"#,
            "`offload_optimizer` is a key of `zero_optimization`",
        ),
        (
            r#"{"gradient_acumulation_steps": 4}"#,
            "did you mean `gradient_accumulation_steps`",
        ),
        (
            r#"{"Gradient_Clipping": 1.0}"#,
            "did you mean `gradient_clipping`",
        ),
        (
            r#"{"zero_optimization": {"stage": 3, "comms_config": {}}}"#,
            "unknown key `zero_optimization.comms_config`",
        ),
        (
            r#"{"zero_optimization": {"max_reuse_distance": 0, "stage3_max_reuse_distance": 0}}"#,
            "`zero_optimization.max_reuse_distance` and \
             `zero_optimization.stage3_max_reuse_distance` are one key",
        ),
    ] {
        let e = err(text);
        assert!(e.contains(want), "{text}: {e}");
    }
    let c = ok(
        r#"{"zero_optimization": {"stage": 3, "max_live_parameters": 7,
                   "max_reuse_distance": 0, "prefetch_bucket_size": 5,
                   "param_persistence_threshold": 3}}"#,
    );
    assert_eq!(
        (
            c.max_live_elems,
            c.reuse_elems,
            c.prefetch_elems,
            c.persistence_threshold
        ),
        (7, 0, 5, 3)
    );
}

/// Skipped (overflowed) steps do not advance the schedule, as in DeepSpeed; `set_lr` is a
/// trainer's own schedule, refused next to a configured one.
#[test]
fn the_schedule_advances_with_optimizer_steps_and_set_lr_is_the_trainers_own() {
    threads(2, &Opts::default(), |_, comm| {
        let comm = comm.unwrap();
        let cfg = ZeroConfig::from_json(
            r#"{"zero_optimization": {"stage": 2}, "fp16": {"enabled": true},
                "optimizer": {"type": "AdamW", "params": {"lr": 0.5}},
                "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.002,
                    "warmup_max_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"}}}"#,
        )
        .unwrap();
        let mut e =
            Engine::<f16>::new(&comm, &[ParamSpec::new("w", &[8])], &|_, _| 0.0, cfg).unwrap();
        assert_eq!(
            e.lr(),
            0.002,
            "step 1 runs at warmup_min_lr, as in DeepSpeed"
        );
        let step = |e: &mut Engine<f16>, g: f32| {
            e.push_grad_f32("w", &[g; 8]).unwrap();
            e.step().unwrap()
        };
        assert!(matches!(step(&mut e, 1.0), StepOutcome::Stepped { .. }));
        assert!(matches!(step(&mut e, 1.0), StepOutcome::Stepped { .. }));
        // Step 3: warm-up iteration 1 of 4.
        assert_eq!(e.lr(), 0.004);
        // An overflow: skipped, and the rate stays.
        assert!(matches!(
            step(&mut e, f32::INFINITY),
            StepOutcome::Skipped { .. }
        ));
        assert_eq!(e.lr(), 0.004);
        assert!(matches!(step(&mut e, 1.0), StepOutcome::Stepped { .. }));
        assert_eq!(e.lr(), 0.006, "step 4: iteration 2");
        let err = e.set_lr(0.1).unwrap_err().to_string();
        assert!(err.contains("remove `scheduler`"), "{err}");
        let mut plain = Engine::<f32>::new(
            &comm,
            &[ParamSpec::new("w", &[8])],
            &|_, _| 0.0,
            ZeroConfig::default(),
        )
        .unwrap();
        plain.set_lr(0.25).unwrap();
        assert_eq!(plain.lr(), 0.25);
        assert!(plain.set_lr(f32::NAN).is_err());
        assert_eq!(plain.lr(), 0.25, "a refused rate changes nothing");
    });
}

/// The entries of a fixture made by DeepSpeed itself (`tests/fixtures/NAME`, written by a
/// script of `scripts/` that names itself in the fixture's `made_by`): at least `at_least`.
fn reference_entries(name: &str, at_least: usize) -> Vec<serde_json::Value> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let mut fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let serde_json::Value::Array(entries) = fixture["entries"].take() else {
        panic!("{name}: no entries");
    };
    assert!(
        entries.len() >= at_least,
        "{name}: {} entries",
        entries.len()
    );
    entries
}

/// Random `scheduler` sections of every type, parameters given or left out, each with the rate
/// (and Adam's betas) DeepSpeed's own engine ran each optimizer step at
/// (`tests/fixtures/deepspeed-schedules.json`, written by `scripts/deepspeed-schedules.py` from
/// `deepspeed.initialize` on the CPU): the engine's rate, step by step, is DeepSpeed's to f32
/// rounding, and so are OneCycle's cycled betas.
#[test]
fn schedules_match_deepspeeds_engine_step_by_step() {
    let entries = reference_entries("deepspeed-schedules.json", 50);
    let close = |ours: f32, theirs: f64| (f64::from(ours) - theirs).abs() <= theirs.abs() * 1e-6;
    threads(1, &Opts::default(), |_, comm| {
        let comm = comm.unwrap();
        let mut bad = Vec::new();
        for (i, entry) in entries.iter().enumerate() {
            let config = &entry["config"];
            let cfg = ZeroConfig::from_json(&config.to_string())
                .unwrap_or_else(|e| panic!("schedule {i} ({config}): {e}"));
            let schedule = cfg.scheduler.clone().expect("every entry has a scheduler");
            let base = cfg.optimizer;
            let mut e =
                Engine::<f32>::new(&comm, &[ParamSpec::new("w", &[4])], &|_, _| 0.0, cfg).unwrap();
            for (s, want) in entry["lr"].as_array().unwrap().iter().enumerate() {
                let k = s as u64 + 1;
                let h = schedule.at(k, base);
                // SGD has no betas (null): its momentum is not cycled.
                let (lr, b1, b2) = (
                    want.as_f64().unwrap(),
                    entry["beta1"][s].as_f64().unwrap_or(f64::from(base.beta1)),
                    entry["beta2"][s].as_f64().unwrap_or(f64::from(base.beta2)),
                );
                if !close(e.lr(), lr) || !close(h.beta1, b1) || !close(h.beta2, b2) {
                    bad.push(format!(
                        "schedule {i} step {k}: ours lr {} betas ({}, {}), DeepSpeed's lr {lr} \
                         betas ({b1}, {b2}); {}",
                        e.lr(),
                        h.beta1,
                        h.beta2,
                        config["scheduler"]
                    ));
                    break;
                }
                e.push_grad_f32("w", &[0.5; 4]).unwrap();
                assert!(matches!(e.step().unwrap(), StepOutcome::Stepped { .. }));
            }
        }
        assert!(bad.is_empty(), "{} differ:\n{}", bad.len(), bad.join("\n"));
    });
}

/// Random DeepSpeed configs — ZeRO stage 0, 1 or 2; Adam, AdamW or SGD with their parameters;
/// gradient clipping; accumulation, given or derived from `train_batch_size`; a scheduler or
/// none — each trained by DeepSpeed's own
/// engine on given gradients (`tests/fixtures/deepspeed-trajectories.json`, written by
/// `scripts/deepspeed-trajectories.py`): ringzero's engine, read from the same config and fed
/// the same gradients, holds the same parameters after every optimizer step, to fp32 rounding.
#[test]
fn training_matches_deepspeeds_engine_step_by_step() {
    let entries = reference_entries("deepspeed-trajectories.json", 30);
    let floats = |v: &serde_json::Value| -> Vec<f32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect()
    };
    let names = ["w", "b"];
    threads(1, &Opts::default(), |_, comm| {
        let comm = comm.unwrap();
        let mut bad = Vec::new();
        for (i, entry) in entries.iter().enumerate() {
            let config = &entry["config"];
            let cfg = ZeroConfig::from_json(&config.to_string())
                .unwrap_or_else(|e| panic!("run {i} ({config}): {e}"));
            let init: Vec<Vec<f32>> = names.iter().map(|n| floats(&entry["init"][n])).collect();
            let specs: Vec<ParamSpec> = names
                .iter()
                .zip(&init)
                .map(|(&n, v)| ParamSpec::new(n, &[v.len()]))
                .collect();
            let mut e = Engine::<f32>::new(&comm, &specs, &|p, j| init[p][j], cfg).unwrap();
            // The engine's: a config without it derives it from its batch sizes.
            let gas = e.config().accumulation_steps;
            let grads = entry["grads"].as_array().unwrap();
            'steps: for (s, want) in entry["params"].as_array().unwrap().iter().enumerate() {
                for g in &grads[s * gas..(s + 1) * gas] {
                    for n in names {
                        e.push_grad_f32(n, &floats(&g[n])).unwrap();
                    }
                    e.step().unwrap();
                }
                let ours = e.consolidate().unwrap();
                for (n, got) in &ours {
                    let theirs = floats(&want[n.as_str()]);
                    // torch's Adam orders its arithmetic otherwise (the bias corrections
                    // as f64 scalars, the rate divided in before the update): each step can
                    // differ by a few ulps of the update, which over the fixture's steps at
                    // rates up to 0.1 stays below 1e-5 of a weight. What the config means —
                    // a schedule a step off, clipping, averaging, decay — moves weights by
                    // orders of magnitude more.
                    if let Some(j) = (0..theirs.len())
                        .find(|&j| (got[j] - theirs[j]).abs() > 1e-5 * theirs[j].abs().max(1.0))
                    {
                        bad.push(format!(
                            "run {i} step {}: {n}[{j}] ours {} DeepSpeed's {}; {config}",
                            s + 1,
                            got[j],
                            theirs[j]
                        ));
                        break 'steps;
                    }
                }
            }
        }
        assert!(bad.is_empty(), "{} differ:\n{}", bad.len(), bad.join("\n"));
    });
}
