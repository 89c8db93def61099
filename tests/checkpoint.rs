//! ZeRO checkpoints on thread ranks: a resumed run is bit-identical to an uninterrupted one in
//! every stage and precision; a checkpoint resharded through another world size, stage, precision
//! and bucket size and back loses nothing; the offline consolidation matches the engine; and bad
//! input (a corrupt or truncated shard, a missing meta.json, other parameters, a call inside an
//! accumulation window, a directory that already holds a checkpoint) is refused on every rank
//! with nothing changed.

use std::path::{Path, PathBuf};

use half::{bf16, f16};
use ringzero::kernels::cpu::{cast, Float, Optimizer};
use ringzero::{Communicator, TransportPref};
use ringzero_zero::checkpoint::{self, Checkpoint};
use ringzero_zero::{Engine, LossScaling, ParamSpec, Precision, Weights, ZeroConfig, ZeroError};

use crate::common::{fresh_dir, threads, Opts};
// The model and data of the ZeRO parity tests.
use crate::zero::{grad, init, specs};

/// Not `init`: a loaded engine must not keep anything of its own start.
fn other_init(_: usize, _: usize) -> f32 {
    0.5
}

fn cfg(p: Precision, stage: u8, bucket: usize) -> ZeroConfig {
    ZeroConfig {
        stage,
        precision: p,
        bucket_elems: bucket,
        clip_norm: Some(1.0),
        optimizer: Optimizer {
            lr: 0.05,
            ..Optimizer::default()
        },
        // fp16: dynamic scaling that starts too high and grows back every two good steps, so
        // steps are skipped now and then and the scaler's state matters on resume.
        loss_scaling: LossScaling {
            loss_scale: 0.0,
            initial_scale_power: 18,
            loss_scale_window: 2,
            hysteresis: 1,
            ..LossScaling::default()
        },
        ..ZeroConfig::default()
    }
}

/// Optimizer steps `from..to` (the step index picks the data, as a data loader's position would).
pub(crate) fn run<T: Float>(e: &mut Engine<T>, rank: usize, from: usize, to: usize) {
    let sp = specs();
    for t in from..to {
        for (i, s) in sp.iter().enumerate() {
            let n = s.name.as_str();
            e.gather(&[n]).unwrap();
            let scale = e.loss_scale();
            let g: Vec<f32> = grad(&e.param_f32(n).unwrap(), rank, t, i)
                .into_iter()
                .map(|x| x * scale)
                .collect();
            e.release(&[n]).unwrap();
            e.push_grad_f32(n, &g).unwrap();
        }
        e.step().unwrap();
    }
}

/// Every parameter's bytes in `T`, and every fp32 master by name.
type State = (Vec<Vec<u8>>, Vec<(String, Vec<f32>)>);

/// The engine's [`State`] (a collective).
fn state<T: Float>(e: &mut Engine<T>) -> State {
    let names: Vec<String> = specs().into_iter().map(|s| s.name).collect();
    let names: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
    e.gather(&names).unwrap();
    let params = names
        .iter()
        .map(|n| bytemuck::cast_slice(e.param(n).unwrap()).to_vec())
        .collect();
    e.release(&names).unwrap();
    (params, e.consolidate().unwrap())
}

fn opts(n: usize) -> Opts {
    Opts {
        transport: if n.is_multiple_of(2) {
            TransportPref::Shm
        } else {
            TransportPref::Tcp
        },
        ..Opts::default()
    }
}

fn resume_case<T: Float>(p: Precision, n: usize, root: &Path) {
    let (k, m) = (3, 4);
    for stage in 0..=3u8 {
        let dir = root.join(format!("{p}-n{n}-stage{stage}"));
        threads(n, &opts(n), |rank, comm| {
            let comm = comm.unwrap();
            let c = cfg(p, stage, 64);
            let mut whole = Engine::<T>::new(&comm, &specs(), &init, c.clone()).unwrap();
            run(&mut whole, rank, 0, k + m);
            let want = state(&mut whole);

            let mut first = Engine::<T>::new(&comm, &specs(), &init, c.clone()).unwrap();
            run(&mut first, rank, 0, k);
            first
                .save_checkpoint(&dir, serde_json::json!({ "next_step": k }))
                .unwrap();
            drop(first);

            let mut second = Engine::<T>::new(&comm, &specs(), &other_init, c).unwrap();
            let meta = second.load_checkpoint(&dir).unwrap();
            let from = meta.client_state["next_step"].as_u64().unwrap() as usize;
            assert_eq!((from, meta.world, meta.stage), (k, n, stage));
            assert_eq!(
                second.steps() + second.skipped_steps(),
                k as u64,
                "step counts restored"
            );
            run(&mut second, rank, from, k + m);
            let got = state(&mut second);
            assert_eq!(got.0, want.0, "{p} n={n} stage {stage}: parameters differ");
            assert_eq!(got.1, want.1, "{p} n={n} stage {stage}: masters differ");
            assert_eq!(
                (second.steps(), second.skipped_steps(), second.loss_scale()),
                (whole.steps(), whole.skipped_steps(), whole.loss_scale())
            );
            if p == Precision::Fp16 && rank == 0 {
                assert!(whole.skipped_steps() > 0, "the fp16 case skips steps");
            }
        });
    }
}

#[test]
fn resume_is_bit_identical_in_every_stage_and_precision() {
    let root = fresh_dir("ckpt-resume");
    for n in [2, 3] {
        resume_case::<f32>(Precision::Fp32, n, &root);
        resume_case::<bf16>(Precision::Bf16, n, &root);
        resume_case::<f16>(Precision::Fp16, n, &root);
    }
    std::fs::remove_dir_all(&root).unwrap();
}

/// A checkpoint holds the optimizer's own states (SGD's momentum buffer, Lion's one moment,
/// none for plain SGD), resumes bit for bit with the same optimizer at another stage, consolidates them under torch's names, and is refused by an engine with another
/// optimizer, which changes nothing.
#[test]
fn each_optimizer_checkpoints_its_own_states_and_another_optimizer_is_refused() {
    let root = fresh_dir("ckpt-optimizers");
    for (tag, h) in [
        ("sgd-momentum", Optimizer::sgd(0.05, 0.9)),
        (
            "lion",
            Optimizer {
                weight_decay: 0.1,
                ..Optimizer::lion(0.01)
            },
        ),
        ("sgd", Optimizer::sgd(0.05, 0.0)),
    ] {
        let dir = root.join(tag);
        let c = |stage| ZeroConfig {
            optimizer: h,
            ..cfg(Precision::Bf16, stage, 64)
        };
        // The whole run on 2 ranks at stage 2, and its first 3 steps saved.
        let want = threads(2, &opts(2), |rank, comm| {
            let comm = comm.unwrap();
            let mut whole = Engine::<bf16>::new(&comm, &specs(), &init, c(2)).unwrap();
            run(&mut whole, rank, 0, 3);
            whole
                .save_checkpoint(&dir, serde_json::Value::Null)
                .unwrap();
            run(&mut whole, rank, 3, 6);
            state(&mut whole)
        })
        .remove(0);
        let meta: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("meta.json")).unwrap()).unwrap();
        assert_eq!(meta["optimizer"], h.name(), "{tag}");
        assert_eq!(meta["states"], serde_json::json!(h.states()), "{tag}");
        // Resumed at other stages (each rank's data follows its rank, so the world size stays;
        // `a_checkpoint_resharded_and_back_loses_nothing` covers other world sizes).
        let resumed = |stage: u8| {
            threads(2, &opts(2), |rank, comm| {
                let comm = comm.unwrap();
                let mut e = Engine::<bf16>::new(&comm, &specs(), &other_init, c(stage)).unwrap();
                e.load_checkpoint(&dir).unwrap();
                run(&mut e, rank, 3, 6);
                state(&mut e)
            })
            .remove(0)
        };
        assert_eq!(resumed(3), want, "{tag}: resumed at stage 3");
        assert_eq!(resumed(0), want, "{tag}: resumed at stage 0");
        // Consolidated with its states under torch's names.
        let out = root.join(format!("{tag}.safetensors"));
        let r = checkpoint::consolidate(&dir, &out, Precision::Fp32, true).unwrap();
        assert_eq!(r.tensors, 4 * (1 + h.states().len()), "{tag}");
        let names: Vec<String> = tensors(&out).into_iter().map(|t| t.0).collect();
        for s in h.states() {
            assert!(
                names.iter().any(|n| n.ends_with(&format!(".{s}"))),
                "{tag}: {names:?}"
            );
        }
        // Another optimizer is refused on every rank, naming both, and nothing changes.
        let before = snapshot(&dir);
        threads(2, &opts(2), |_, comm| {
            let comm = comm.unwrap();
            let mut e =
                Engine::<bf16>::new(&comm, &specs(), &other_init, cfg(Precision::Bf16, 2, 64))
                    .unwrap();
            let kept = e.consolidate().unwrap();
            let m = msg(e.load_checkpoint(&dir));
            assert!(
                m.contains(&format!("holds the state of {}", h.name()))
                    && m.contains("this engine's optimizer is AdamW (exp_avg, exp_avg_sq)")
                    && m.contains("load it with the optimizer it was saved with"),
                "{tag}: {m}"
            );
            assert_eq!(
                e.consolidate().unwrap(),
                kept,
                "{tag}: the refused load changed the engine"
            );
            assert_eq!(e.steps(), 0);
        });
        assert_eq!(snapshot(&dir), before, "{tag}: the checkpoint changed");
    }
    std::fs::remove_dir_all(&root).unwrap();
}

/// Every tensor of a consolidated file, by name.
fn tensors(file: &Path) -> Vec<(String, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.shape().to_vec(), t.data().to_vec()))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[test]
fn a_checkpoint_resharded_and_back_loses_nothing() {
    let root = fresh_dir("ckpt-reshard");
    let (a, b, d1) = (root.join("n2"), root.join("n3"), root.join("n1"));
    let (k, m) = (3, 3);
    // Saved by 2 ranks, stage 1, fp32, buckets of 64.
    let want: Vec<_> = threads(2, &opts(2), |rank, comm| {
        let comm = comm.unwrap();
        let c = cfg(Precision::Fp32, 1, 64);
        let mut e = Engine::<f32>::new(&comm, &specs(), &init, c.clone()).unwrap();
        run(&mut e, rank, 0, k);
        e.save_checkpoint(&a, serde_json::Value::Null).unwrap();
        let saved = e.consolidate().unwrap();
        run(&mut e, rank, k, k + m);
        (saved, state(&mut e))
    });
    let saved = want[0].0.clone();
    // Loaded by 3 ranks in stage 3, bf16, buckets of 50: the masters are the saved ones exactly.
    threads(3, &opts(3), |_, comm| {
        let comm = comm.unwrap();
        let c = cfg(Precision::Bf16, 3, 50);
        let mut e = Engine::<bf16>::new(&comm, &specs(), &other_init, c).unwrap();
        e.load_checkpoint(&a).unwrap();
        assert_eq!(e.consolidate().unwrap(), saved);
        assert_eq!(e.steps(), k as u64);
        e.save_checkpoint(&b, serde_json::Value::Null).unwrap();
    });
    // And by one rank in stage 0, fp16.
    threads(1, &opts(1), |_, comm| {
        let comm = comm.unwrap();
        let c = cfg(Precision::Fp16, 0, 1000);
        let mut e = Engine::<f16>::new(&comm, &specs(), &other_init, c).unwrap();
        e.load_checkpoint(&b).unwrap();
        assert_eq!(e.consolidate().unwrap(), saved);
        e.save_checkpoint(&d1, serde_json::Value::Null).unwrap();
    });
    // Back at 2 ranks as saved: training goes on exactly as if never interrupted.
    threads(2, &opts(2), |rank, comm| {
        let comm = comm.unwrap();
        let cf = cfg(Precision::Fp32, 1, 64);
        let mut e = Engine::<f32>::new(&comm, &specs(), &other_init, cf).unwrap();
        e.load_checkpoint(&d1).unwrap();
        run(&mut e, rank, k, k + m);
        assert_eq!(
            state(&mut e),
            want[rank].1,
            "rank {rank} after the round trip"
        );
    });
    // Offline: the moments survived the trip too, bit for bit.
    let out: Vec<PathBuf> = [&a, &b, &d1]
        .iter()
        .map(|d| {
            let f = d.with_extension("safetensors");
            checkpoint::consolidate(d, &f, Precision::Fp32, true).unwrap();
            f
        })
        .collect();
    let first = tensors(&out[0]);
    assert_eq!(first.len(), 3 * specs().len());
    assert_eq!(tensors(&out[1]), first);
    assert_eq!(tensors(&out[2]), first);
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn offline_consolidation_matches_the_engine() {
    let root = fresh_dir("ckpt-consolidate");
    let dir = root.join("ck");
    let full = threads(3, &opts(3), |rank, comm| {
        let comm = comm.unwrap();
        let mut e =
            Engine::<f32>::new(&comm, &specs(), &init, cfg(Precision::Fp32, 2, 40)).unwrap();
        run(&mut e, rank, 0, 2);
        e.save_checkpoint(&dir, serde_json::Value::Null).unwrap();
        e.consolidate().unwrap()
    })
    .remove(0);
    let f32_file = root.join("full.safetensors");
    let r = checkpoint::consolidate(&dir, &f32_file, Precision::Fp32, false).unwrap();
    assert_eq!(r.tensors, 4);
    assert_eq!(r.elements, 37 + 5 + 130 + 3);
    let got = tensors(&f32_file);
    let shapes: Vec<(String, Vec<usize>)> =
        specs().into_iter().map(|s| (s.name, s.shape)).collect();
    for (name, shape, data) in &got {
        assert!(
            shapes.contains(&(name.clone(), shape.clone())),
            "{name} {shape:?}"
        );
        let want = &full.iter().find(|(n, _)| n == name).unwrap().1;
        assert_eq!(
            data.as_slice(),
            bytemuck::cast_slice::<f32, u8>(want),
            "{name}"
        );
    }
    // The consolidated file starts a new run as a Hugging Face checkpoint would: its tensors
    // are the parameters and their values the initial ones, here on 2 ranks at stage 3.
    let weights = Weights::from_safetensors(&f32_file).unwrap();
    threads(2, &opts(2), |_, comm| {
        let comm = comm.unwrap();
        let mut e =
            Engine::<f32>::from_weights(&comm, &weights, cfg(Precision::Fp32, 3, 64)).unwrap();
        for (name, want) in &full {
            e.gather(&[name]).unwrap();
            assert_eq!(&e.param_f32(name).unwrap(), want, "{name}");
            e.release(&[name]).unwrap();
        }
    });
    // bf16: the rounding of the masters.
    let bf_file = root.join("full-bf16.safetensors");
    checkpoint::consolidate(&dir, &bf_file, Precision::Bf16, false).unwrap();
    for (name, _, data) in tensors(&bf_file) {
        let want = &full.iter().find(|(n, _)| *n == name).unwrap().1;
        let mut r = vec![bf16::ZERO; want.len()];
        cast(want, &mut r);
        assert_eq!(
            data.as_slice(),
            bytemuck::cast_slice::<bf16, u8>(&r),
            "{name}"
        );
    }
    std::fs::remove_dir_all(&root).unwrap();
}

/// Every file in `dir` with its contents.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            let b = std::fs::read(&p).unwrap();
            (p, b)
        })
        .collect();
    v.sort();
    v
}

fn msg<T>(r: Result<T, ZeroError>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_checkpoints_and_bad_moments_are_refused_with_nothing_changed() {
    let root = fresh_dir("ckpt-bad");
    let good = root.join("good");
    threads(2, &opts(2), |rank, comm| {
        let comm = comm.unwrap();
        let mut e =
            Engine::<f32>::new(&comm, &specs(), &init, cfg(Precision::Fp32, 3, 64)).unwrap();
        run(&mut e, rank, 0, 2);
        e.save_checkpoint(&good, serde_json::Value::Null).unwrap();
    });
    let shard1 = good.join(checkpoint::shard_file(1, 2));
    let pristine = std::fs::read(&shard1).unwrap();
    let ck = Checkpoint::open(&good).unwrap();
    assert_eq!(ck.meta().shards.len(), 2);

    threads(2, &opts(2), |rank, comm| {
        let comm = comm.unwrap();
        let c = ZeroConfig {
            accumulation_steps: 2,
            ..cfg(Precision::Fp32, 3, 64)
        };
        let mut e = Engine::<f32>::new(&comm, &specs(), &other_init, c).unwrap();
        let before = state(&mut e);
        let barrier = |comm: &Communicator| comm.barrier().unwrap();

        // A shard flipped in one byte: rank 1 reads it and names it; rank 0 names rank 1.
        if rank == 0 {
            let mut bad = pristine.clone();
            let at = bad.len() - 3;
            bad[at] ^= 0x40;
            std::fs::write(&shard1, &bad).unwrap();
        }
        barrier(&comm);
        let err = msg(e.load_checkpoint(&good));
        if rank == 1 {
            assert!(err.contains("checksum mismatch"), "{err}");
            assert!(err.contains("rank-00001-of-00002.safetensors"), "{err}");
        } else {
            assert!(err.contains("rank(s) [1] failed"), "{err}");
            assert!(err.contains("nothing was changed"), "{err}");
        }
        assert_eq!(
            state(&mut e),
            before,
            "rank {rank}: a failed load changed the engine"
        );

        // Truncated.
        if rank == 0 {
            std::fs::write(&shard1, &pristine[..pristine.len() - 8]).unwrap();
        }
        barrier(&comm);
        let err = msg(e.load_checkpoint(&good));
        if rank == 1 {
            assert!(err.contains("truncated or replaced"), "{err}");
        }
        barrier(&comm);
        if rank == 0 {
            std::fs::write(&shard1, &pristine).unwrap();
        }
        barrier(&comm);

        // No meta.json, or none that parses.
        let err = msg(e.load_checkpoint(root.join("nowhere")));
        assert!(err.ends_with("nowhere: does not exist"), "{err}");
        let half_saved = root.join(format!("half{rank}"));
        std::fs::create_dir_all(&half_saved).unwrap();
        let err = msg(e.load_checkpoint(&half_saved));
        assert!(err.contains("has no meta.json"), "{err}");
        std::fs::write(half_saved.join("meta.json"), "{\"format\": 1}").unwrap();
        let err = msg(e.load_checkpoint(&half_saved));
        assert!(
            err.contains("meta.json: not a ringzero checkpoint"),
            "{err}"
        );

        // Saving into a directory that holds a checkpoint: refused, nothing written.
        let files = snapshot(&good);
        let err = msg(e.save_checkpoint(&good, serde_json::Value::Null));
        assert!(err.contains("already holds a checkpoint"), "{err}");
        assert_eq!(snapshot(&good), files);

        // Inside an accumulation window: refused, nothing created.
        let later = root.join(format!("later{rank}"));
        run(&mut e, rank, 0, 1);
        let err = msg(e.save_checkpoint(&later, serde_json::Value::Null));
        assert!(err.starts_with("save_checkpoint: "), "{err}");
        assert!(!later.exists(), "nothing created");
        let err = msg(e.load_checkpoint(&good));
        assert!(err.starts_with("load_checkpoint: "), "{err}");
        barrier(&comm);
    });

    // Other parameters: each rank names the first difference.
    threads(2, &opts(2), |_, comm| {
        let comm = comm.unwrap();
        let mut sp = specs();
        sp[2] = ParamSpec::new("w2", &[10, 13]);
        let mut e = Engine::<f32>::new(&comm, &sp, &init, cfg(Precision::Fp32, 1, 64)).unwrap();
        let err = msg(e.load_checkpoint(&good));
        assert!(
            err.contains("parameter `w2` has shape [10, 13] but the checkpoint holds [13, 10]"),
            "{err}"
        );
        sp = specs();
        sp.pop();
        let mut e = Engine::<f32>::new(&comm, &sp, &init, cfg(Precision::Fp32, 1, 64)).unwrap();
        let err = msg(e.load_checkpoint(&good));
        assert!(
            err.contains("`b2`, which this engine does not declare"),
            "{err}"
        );
        // Stage 3: nothing may be gathered while the parameters are replaced.
        let mut e =
            Engine::<f32>::new(&comm, &specs(), &init, cfg(Precision::Fp32, 3, 64)).unwrap();
        e.gather(&["w1"]).unwrap();
        let err = msg(e.load_checkpoint(&good));
        assert!(err.contains("`w1` is gathered"), "{err}");
        e.release(&["w1"]).unwrap();
        e.load_checkpoint(&good).unwrap();
    });
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_failed_save_is_not_a_checkpoint() {
    // Rank 1 cannot write its shard (its file name is taken by a directory): no rank commits,
    // and loading the directory says the save did not finish.
    let root = fresh_dir("ckpt-failed-save");
    let dir = root.join("ck");
    std::fs::create_dir_all(dir.join(checkpoint::shard_file(1, 2))).unwrap();
    threads(2, &opts(2), |rank, comm| {
        let comm = comm.unwrap();
        let mut e =
            Engine::<f32>::new(&comm, &specs(), &init, cfg(Precision::Fp32, 2, 64)).unwrap();
        run(&mut e, rank, 0, 1);
        let err = msg(e.save_checkpoint(&dir, serde_json::Value::Null));
        if rank == 1 {
            assert!(
                err.contains("rank-00001-of-00002.safetensors: cannot write it"),
                "{err}"
            );
        } else {
            assert!(err.contains("rank(s) [1] failed"), "{err}");
            assert!(err.contains("not committed"), "{err}");
        }
        let err = msg(e.load_checkpoint(&dir));
        assert!(err.contains("has no meta.json"), "{err}");
    });
    std::fs::remove_dir_all(&root).unwrap();
}

/// A save killed midway leaves temporaries (ours and the safetensors writer's): the next save
/// into the directory removes them, `ckpt inspect` lists any it finds; and every field of
/// `meta.json` is checked, so an edited `"stage": 9` is refused naming the field.
#[test]
fn leftovers_of_a_killed_save_are_removed_and_meta_fields_are_checked() {
    let root = fresh_dir("ckpt-leftovers");
    let dir = root.join("ck");
    std::fs::create_dir_all(&dir).unwrap();
    let ours = dir.join(".rank-00000-of-00002.safetensors.4242.tmp");
    let theirs = dir.join(".tmpAb3xYz");
    std::fs::write(&ours, vec![0u8; 1000]).unwrap();
    std::fs::write(&theirs, vec![0u8; 2000]).unwrap();
    threads(2, &opts(2), |rank, comm| {
        let comm = comm.unwrap();
        let mut e =
            Engine::<f16>::new(&comm, &specs(), &init, cfg(Precision::Fp16, 2, 64)).unwrap();
        run(&mut e, rank, 0, 2);
        e.save_checkpoint(&dir, serde_json::Value::Null).unwrap();
    });
    assert!(
        !ours.exists() && !theirs.exists(),
        "the save removed the leftovers"
    );
    assert!(checkpoint::temporaries(&dir).is_empty());
    // Shards are ordinary files: readable as the umask allows, not 0600.
    use std::os::unix::fs::PermissionsExt;
    let shard = dir.join(checkpoint::shard_file(0, 2));
    let mode = std::fs::metadata(&shard).unwrap().permissions().mode() & 0o777;
    assert_ne!(mode & 0o044, 0, "mode {mode:o}");
    std::fs::write(&theirs, b"x").unwrap();
    let i = ringzero_tools::ckpt::inspect(&dir).unwrap();
    assert_eq!(i.temporaries, [(".tmpAb3xYz".to_string(), 1)]);
    let text = ringzero_tools::ckpt::text(&dir, &i);
    assert!(
        text.contains("1 temporary file(s) of a save that did not finish"),
        "{text}"
    );

    let meta_path = dir.join("meta.json");
    let pristine: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&meta_path).unwrap()).unwrap();
    let edited = |field: &str, value: serde_json::Value| {
        let mut m = pristine.clone();
        m[field] = value;
        std::fs::write(&meta_path, serde_json::to_vec(&m).unwrap()).unwrap();
        msg(Checkpoint::open(&dir))
    };
    let e = edited("stage", 9.into());
    assert!(
        e.contains("field `stage` is 9; ZeRO stages are 0 to 3"),
        "{e}"
    );
    let e = edited("precision", "fp8".into());
    assert!(
        e.contains("field `precision`") && e.contains("unknown precision `fp8`"),
        "{e}"
    );
    let e = edited("bucket_elems", 0.into());
    assert!(e.contains("field `bucket_elems` is 0"), "{e}");
    let e = edited("precision", "bf16".into());
    assert!(
        e.contains("field `scaler` is set but the precision is bf16"),
        "{e}"
    );
    let mut shards = pristine["shards"].clone();
    shards[1]["file"] = "rank-00000-of-00002.safetensors".into();
    let e = edited("shards", shards);
    assert!(
        e.contains("gives rank 1 the file `rank-00000-of-00002.safetensors`"),
        "{e}"
    );
    std::fs::write(&meta_path, serde_json::to_vec(&pristine).unwrap()).unwrap();
    assert!(Checkpoint::open(&dir).is_ok());
}
