//! The `ringzero` binary end to end: the README's main command, and its failure modes.

use ringzero_collectives::Collectives;
use std::process::Command;

#[path = "../../tests/common/scratch.rs"]
mod scratch;

fn ringzero() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ringzero"))
}

/// Run `cmd`, which must succeed; its stdout (both streams in the failure message).
fn succeeds(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{cmd:?}: {stdout}\n{stderr}");
    stdout
}

/// Run `cmd`, which must fail cleanly (no panic) and print nothing on stdout; its stderr.
fn fails(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{cmd:?} succeeded: {stderr}");
    assert!(!stderr.contains("panicked"), "{cmd:?}: {stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.is_empty(),
        "{cmd:?} printed before failing: {stdout}"
    );
    stderr
}

#[test]
fn launch_runs_the_checked_sweep_on_four_ranks_and_two_fake_nodes() {
    let bin = env!("CARGO_BIN_EXE_ringzero");
    for nodes in ["1", "2"] {
        let out = ringzero()
            .args([
                "launch", "-n", "4", "--nodes", nodes, "--", bin, "check", "-b", "1K", "-e",
                "256K", "--iters", "2",
            ])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("[rank 0] all results exact"), "{stdout}");
        assert_eq!(
            stdout.lines().filter(|l| l.contains("] edge rank")).count(),
            4,
            "{stdout}"
        );
        if nodes == "2" {
            assert!(stdout.contains(": tcp (different nodes"), "{stdout}");
        }
    }
}

/// A rank count the machine cannot hold is refused before any rank starts, saying why (it
/// used to fork until the process limit, then panic).
#[test]
fn launch_and_bench_refuse_more_ranks_than_the_machine_holds_before_starting_any() {
    let dir = std::env::temp_dir().join(format!("ringzero-cli-ranks-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let started = format!("touch {}/$RINGZERO_RANK", dir.display());
    let e = fails(ringzero().args(["launch", "-n", "100000", "--", "sh", "-c", &started]));
    assert!(
        e.contains("-n 100000") && e.contains("ranks per core"),
        "{e}"
    );
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "a rank started"
    );
    let e = fails(ringzero().args(["bench", "-n", "100000", "-b", "4K", "-e", "4K"]));
    assert!(e.contains("ranks per core"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Environment values out of range fail every rank with the variable and its range (a huge
/// deadline used to panic converting it; a one-byte slice to run out of memory).
#[test]
fn out_of_range_timeouts_and_slices_fail_with_the_range() {
    for (var, value, range) in [
        ("RINGZERO_TIMEOUT", "1e20", "between 0.001 and 604800"),
        ("RINGZERO_TIMEOUT", "1e300", "between 0.001 and 604800"),
        ("RINGZERO_SLICE_BYTES", "1", "between 4K and 256M"),
        ("RINGZERO_SLICE_BYTES", "1G", "between 4K and 256M"),
    ] {
        let out = ringzero()
            .args(["bench", "-n", "2", "-b", "4K", "-e", "4K", "--iters", "1"])
            .env(var, value)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{var}={value} ran: {stderr}");
        assert!(!stderr.contains("panicked"), "{var}={value}: {stderr}");
        assert!(
            stderr.contains(var) && stderr.contains(range),
            "{var}={value}: {stderr}"
        );
    }
}

#[test]
fn launch_exits_non_zero_naming_the_failed_rank() {
    // A failed job keeps its flight-record directory under TMPDIR: this test's own.
    let tmp = scratch::fresh_dir("cli-failed-rank");
    let out = ringzero()
        .args([
            "launch",
            "-n",
            "3",
            "--grace",
            "0.2",
            "--",
            "sh",
            "-c",
            "[ $RINGZERO_RANK = 2 ] && exit 5; sleep 20",
        ])
        .env("TMPDIR", &*tmp)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(5));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("rank 2 exited first with exit code 5"),
        "{stderr}"
    );
}

#[test]
fn bad_input_gets_a_clear_error() {
    let out = ringzero()
        .args(["check"])
        .env_remove("RINGZERO_RANK")
        .env_remove("RANK")
        .env_remove("SLURM_PROCID")
        .env_remove("OMPI_COMM_WORLD_RANK")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no launcher found"));
    let out = ringzero()
        .args(["launch", "-n", "0", "--", "true"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("-n must be at least 1"));
    let out = ringzero()
        .args(["launch", "-n", "2", "--", "true"])
        .env("RINGZERO_TIMEOUT", "x")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the launcher itself does not read rank knobs"
    );
    let out = ringzero()
        .args(["check"])
        .env("RINGZERO_RANK", "0")
        .env("RINGZERO_WORLD_SIZE", "1")
        .env("RINGZERO_TRANSPORT", "carrier-pigeon")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("RINGZERO_TRANSPORT"));
}

#[test]
fn bench_spawns_its_ranks_and_writes_json_and_svg() {
    let dir = std::env::temp_dir().join(format!("ringzero-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (json, svg) = (dir.join("b.json"), dir.join("b.svg"));
    let out = ringzero()
        .args([
            "bench",
            "all-reduce",
            "-n",
            "2",
            "-b",
            "1K",
            "-e",
            "16K",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--transport",
            "tcp",
        ])
        .arg("--json")
        .arg(&json)
        .arg("--plot")
        .arg(&svg)
        .env_remove("RINGZERO_RANK")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("# all_reduce")
            && stdout.contains(": tcp (forced by RINGZERO_TRANSPORT=tcp)"),
        "{stdout}"
    );
    assert!(
        stdout
            .lines()
            .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
            .count()
            == 3,
        "{stdout}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["rows"].as_array().unwrap().len(), 6);
    assert_eq!(v["header"]["ranks"], 2);
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(
        plot.starts_with("<svg") && plot.contains("all_reduce measured"),
        "{}",
        &plot[..200.min(plot.len())]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_refuses_bad_arguments_without_starting_ranks() {
    // Without a GPU, asking for one says no driver was found (with a GPU, these would run).
    let mut cases = vec![
        (vec!["bench", "hypercube"], "unknown op `hypercube`"),
        (vec!["bench", "-b", "1M", "-e", "1K"], "is larger than"),
        (vec!["bench", "-d", "f8"], "unknown dtype"),
        (
            vec!["bench", "-b", "3", "-e", "3"],
            "-b 3: smaller than one element (4 bytes)",
        ),
        (
            vec!["bench", "-b", "512G", "-e", "512G"],
            "buffers of 549755813888 bytes need",
        ),
        (vec!["bench", "--transport", "udp"], "--transport udp"),
        (
            vec!["bench", "--shared-buffers", "--device", "host-stream"],
            "--shared-buffers allocates host memory; the buffers here are host-stream's",
        ),
        (
            vec!["bench", "send-recv", "-n", "3", "--device", "host"],
            "run it on an even number of ranks, not -n 3",
        ),
    ];
    if ringzero_kernels::device::cuda_devices().is_err() {
        cases.push((
            vec!["bench", "--device", "cuda"],
            "no CUDA driver was found",
        ));
        cases.push((
            vec!["gpu-check", "--device", "99"],
            "no CUDA driver was found",
        ));
    } else {
        cases.push((
            vec!["gpu-check", "--device", "99"],
            "cuda:99 does not exist",
        ));
    }
    for (args, msg) in cases {
        let out = ringzero().args(&args).output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(msg), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("panicked") && !stderr.contains("backtrace"),
            "{stderr}"
        );
    }
}

#[test]
fn mem_reproduces_the_zero_papers_table() {
    let out = ringzero()
        .args(["mem", "--params", "7.5B", "--dp", "64"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let totals: Vec<String> = text
        .lines()
        .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .map(|l| l.split_whitespace().nth(4).unwrap().to_string())
        .collect();
    assert_eq!(totals, ["120.00", "31.41", "16.64", "1.88"], "{text}");
    let out = ringzero()
        .args(["mem", "--params", "1B", "--dp", "8", "--stage", "4"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("stage 4 does not exist"));
    assert!(out.stdout.is_empty(), "nothing printed before the error");
}

/// `ringzero mem --params` takes a model's weights as published: a safetensors file (its
/// header counted) gives the table its parameter count gives; a missing path or another file
/// is refused, naming it.
#[test]
fn mem_counts_the_parameters_of_a_safetensors_file() {
    let dir = std::env::temp_dir().join(format!("ringzero-mem-st-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // A 1.5e9-element bf16 tensor and a 2.5e8 one, declared: the data need not be read, but a
    // safetensors file holds it, so it is a sparse file of the declared length.
    let header = r#"{"w":{"dtype":"BF16","shape":[50000,30000],"data_offsets":[0,3000000000]},"b":{"dtype":"BF16","shape":[250000000],"data_offsets":[3000000000,3500000000]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    let file = dir.join("model.safetensors");
    std::fs::write(&file, &bytes).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
    f.set_len(bytes.len() as u64 + 3_500_000_000).unwrap();
    let table = |params: &std::ffi::OsStr| {
        succeeds(
            ringzero()
                .args(["mem", "--dp", "8", "--params"])
                .arg(params),
        )
    };
    let from_file = table(file.as_os_str());
    assert!(from_file.contains("1.750e9 parameters"), "{from_file}");
    assert_eq!(from_file, table("1.75B".as_ref()));
    let e = fails(
        ringzero()
            .args(["mem", "--params"])
            .arg(dir.join("none.safetensors")),
    );
    assert!(
        e.contains("none.safetensors: no such file or directory"),
        "{e}"
    );
    std::fs::write(dir.join("config.json"), "{}").unwrap();
    let e = fails(
        ringzero()
            .args(["mem", "--params"])
            .arg(dir.join("config.json")),
    );
    assert!(e.contains("config.json: no `model_type`"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `ringzero mem --params` takes a model's `config.json` as the hub publishes it, before any
/// weight is downloaded: Llama 2 7B's gives the table its exact count gives.
#[test]
fn mem_counts_the_parameters_of_a_published_config() {
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/hf-configs/llama-2-7b-hf.json"
    );
    let table = |params: &str| {
        succeeds(ringzero().args(["mem", "--dp", "8", "--stage", "3", "--params", params]))
    };
    let from_config = table(config);
    assert!(from_config.contains("6.738e9 parameters"), "{from_config}");
    assert_eq!(from_config, table("6738415616"));
    let e = fails(ringzero().args(["mem", "--params", "llama/config.json"]));
    assert!(
        e.contains("llama/config.json: no such file or directory") && e.contains("config.json"),
        "{e}"
    );
}

#[test]
fn mem_with_a_shard_size_prices_hybrid_sharding() {
    let text =
        succeeds(ringzero().args(["mem", "--params", "7.5B", "--dp", "64", "--shard-size", "8"]));
    assert!(
        text.contains("64 data-parallel ranks as 8 replicas of a shard group of 8"),
        "{text}"
    );
    let rows: Vec<Vec<String>> = text
        .lines()
        .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .map(|l| l.split_whitespace().map(String::from).collect())
        .collect();
    // Memory is the paper's for 8 ranks; the last column the gradient average across groups:
    // 2·Ψ·7/8 in stage 0, 2·(Ψ/8)·7/8 after that (16-bit elements, GB).
    let col = |i: usize| rows.iter().map(|r| r[i].as_str()).collect::<Vec<_>>();
    assert_eq!(col(4), ["120.00", "41.25", "28.12", "15.00"], "{text}");
    assert_eq!(col(5), ["26.25", "26.25", "26.25", "39.38"], "{text}");
    assert_eq!(col(6), ["26.25", "3.28", "3.28", "3.28"], "{text}");
    let stderr =
        fails(ringzero().args(["mem", "--params", "1B", "--dp", "64", "--shard-size", "7"]));
    assert!(
        stderr.contains("--shard-size: shard size 7 does not divide the 64 ranks"),
        "{stderr}"
    );
}

#[test]
fn demo_trains_every_stage_and_precision_and_loss_goes_down() {
    for (n, stage, precision) in [
        ("2", "0", "fp32"),
        ("3", "1", "bf16"),
        ("2", "2", "fp16"),
        ("4", "3", "bf16"),
    ] {
        let stdout = succeeds(ringzero().args([
            "demo",
            "-n",
            n,
            "--stage",
            stage,
            "--precision",
            precision,
            "--steps",
            "40",
        ]));
        assert!(stdout.contains("loss went down"), "{stdout}");
        assert!(
            stdout.contains("every rank's model states equal the formula exactly"),
            "{stdout}"
        );
        let ratio: f64 = stdout
            .split("× lower")
            .next()
            .and_then(|s| s.rsplit('(').next())
            .and_then(|s| s.parse().ok())
            .expect("a loss ratio");
        assert!(ratio > 3.0, "40 steps should cut the loss well: {stdout}");
        let numeric = |cols: usize| {
            stdout
                .lines()
                .filter(|l| {
                    let t: Vec<&str> = l.split_whitespace().collect();
                    t.len() == cols && t.iter().all(|x| x.parse::<f64>().is_ok())
                })
                .count()
        };
        assert_eq!(numeric(5), 5, "steps 0, 10, 20, 30, 39 printed: {stdout}");
        assert_eq!(
            numeric(6),
            n.parse::<usize>().unwrap(),
            "one memory row per rank: {stdout}"
        );
    }
}

#[test]
fn demo_trains_with_hybrid_sharding_and_refuses_a_shard_size_that_does_not_divide() {
    let stdout = succeeds(ringzero().args([
        "demo",
        "-n",
        "4",
        "--stage",
        "3",
        "--shard-size",
        "2",
        "--steps",
        "30",
    ]));
    assert!(
        stdout.contains("hybrid (sharded over groups of 2, 2 replicas)"),
        "{stdout}"
    );
    assert!(stdout.contains("loss went down"), "{stdout}");
    // Each rank holds half the model states (the shard group's size is 2, not 4).
    assert!(
        stdout.contains("every rank's model states equal the formula exactly"),
        "{stdout}"
    );
    let out = ringzero()
        .args(["demo", "-n", "4", "--shard-size", "3", "--steps", "2"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("shard size 3 does not divide the 4 ranks"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    // DeepSpeed's key for it, from a config file; the flag and the file may not both say.
    let dir = std::env::temp_dir().join(format!("ringzero-mics-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("ds.json");
    std::fs::write(
        &cfg,
        r#"{"zero_optimization": {"stage": 3, "mics_shard_size": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.003}}}"#,
    )
    .unwrap();
    let stdout = succeeds(
        ringzero()
            .args(["demo", "-n", "4", "--steps", "3", "--config"])
            .arg(&cfg),
    );
    assert!(
        stdout.contains("hybrid (sharded over groups of 2, 2 replicas)"),
        "{stdout}"
    );
    let stderr = fails(
        ringzero()
            .args(["demo", "-n", "4", "--shard-size", "2", "--config"])
            .arg(&cfg),
    );
    assert!(
        stderr.contains("--shard-size and --config both given"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `bench --explain` reads nccl-tests' text output and prints it beside the model; without the
/// links' β it is refused before reading anything.
#[test]
fn bench_explains_nccl_tests_output() {
    let dir = std::env::temp_dir().join(format!("ringzero-explain-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("nccl.txt");
    std::fs::write(
        &f,
        "# Collective test starting: reduce_scatter_perf\n\
         #  Rank  0 Group  0 Pid 1 on n device 0 [0x18] GPU\n\
         #  Rank  1 Group  0 Pid 1 on n device 1 [0x2a] GPU\n\
         #  Rank  2 Group  0 Pid 1 on n device 2 [0x3a] GPU\n\
         #  Rank  3 Group  0 Pid 1 on n device 3 [0x5d] GPU\n\
         \x20   67108864  4194304  float  sum  -1  500.0  134.2  100.7  0  480.0  139.8  104.9  0\n",
    )
    .unwrap();
    let out = succeeds(ringzero().args(["bench", "--explain"]).arg(&f).args([
        "--beta-gbs",
        "100",
        "--alpha-us",
        "2",
    ]));
    assert!(
        out.contains("reduce_scatter_perf (reduce_scatter) on 4 ranks"),
        "{out}"
    );
    assert!(out.contains("64 MiB"), "{out}");
    let err = fails(ringzero().args(["bench", "--explain"]).arg(&f));
    assert!(err.contains("--beta-gbs"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every published config in `tests/fixtures/deepspeed/` drives `ringzero demo` as given (those
/// with offload on "cpu" with the state in host memory): the loss goes down, and a scheduler's
/// rate is printed per step (OneCycle's first step runs at its `cycle_min_lr`, as DeepSpeed's
/// does).
#[test]
fn demo_runs_every_published_deepspeed_config() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/deepspeed");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    assert!(files.len() >= 8, "{} fixtures", files.len());
    let mut trained = 0;
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let run = || {
            let mut c = ringzero();
            c.args(["demo", "-n", "2", "--steps", "60", "--config"])
                .arg(f);
            c
        };
        // The ones with offload on "cpu" run as published, the state in host memory.
        let stdout = succeeds(&mut run());
        assert!(
            stdout.contains("loss went down"),
            "{}: {stdout}",
            f.display()
        );
        if text.contains("OneCycle") {
            let row0 = stdout
                .lines()
                .find(|l| l.trim_start().starts_with("0 "))
                .unwrap_or_else(|| panic!("{}: no step 0 row: {stdout}", f.display()));
            assert!(row0.contains("1.000e-4"), "{}: {row0}", f.display());
        }
        trained += 1;
    }
    assert_eq!(trained, files.len(), "{trained} of the fixtures trained");
}

#[test]
fn demo_reads_a_deepspeed_config_and_names_bad_keys() {
    let dir = std::env::temp_dir().join(format!("ringzero-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("ds.json");
    std::fs::write(
        &good,
        r#"{"zero_optimization": {"stage": 3, "reduce_bucket_size": 5000},
            "fp16": {"enabled": true, "initial_scale_power": 8},
            "train_micro_batch_size_per_gpu": 24,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.003}}}"#,
    )
    .unwrap();
    let stdout = succeeds(
        ringzero()
            .args(["demo", "-n", "2", "--steps", "20", "--config"])
            .arg(&good),
    );
    assert!(stdout.contains("ZeRO stage 3, fp16"), "{stdout}");
    // The config's micro batch is the batch the ranks train on.
    assert!(stdout.contains("batch 24 per rank"), "{stdout}");
    assert!(
        stdout.contains("     256 "),
        "initial scale 2^8 printed: {stdout}"
    );
    // --lr fills only an "auto" learning rate; this config sets its own.
    let e = fails(
        ringzero()
            .args(["demo", "--lr", "0.01", "--config"])
            .arg(&good),
    );
    assert!(
        e.contains("--lr and --config both given, and the config sets optimizer.params.lr = 0.003"),
        "{e}"
    );
    // Hugging Face's zero2 config leaves precision and learning rate "auto": the flags fill them.
    let hf = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/deepspeed/hf-ds_config_zero2.json"
    );
    let stdout = succeeds(ringzero().args([
        "demo",
        "-n",
        "2",
        "--steps",
        "20",
        "--precision",
        "fp32",
        "--lr",
        "0.001",
        "--config",
        hf,
    ]));
    assert!(stdout.contains("ZeRO stage 2, fp32"), "{stdout}");
    // Keys that describe what ringzero always does are accepted, each with its reason printed.
    let noted = dir.join("noted.json");
    std::fs::write(
        &noted,
        r#"{"zero_optimization": {"stage": 2, "contiguous_gradients": true}, "steps_per_print": 10,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.003}}}"#,
    )
    .unwrap();
    let stdout = succeeds(
        ringzero()
            .args(["demo", "-n", "2", "--steps", "20", "--config"])
            .arg(&noted),
    );
    assert!(
        stdout.contains("config: `zero_optimization.contiguous_gradients` changes nothing here: buckets are always contiguous"),
        "{stdout}"
    );
    let bad = dir.join("bad.json");
    std::fs::write(
        &bad,
        r#"{"zero_optimization": {"stage": 2, "contiguous_gradient": true}, "step_per_print": 10}"#,
    )
    .unwrap();
    for extra in [vec![], vec!["--stage", "1"]] {
        let stderr = fails(
            ringzero()
                .args(["demo", "-n", "2", "--config"])
                .arg(&bad)
                .args(&extra),
        );
        if extra.is_empty() {
            assert!(
                stderr.contains("unknown key `zero_optimization.contiguous_gradient`")
                    && stderr.contains("`step_per_print`: did you mean `steps_per_print`?"),
                "{stderr}"
            );
        } else {
            assert!(
                stderr.contains("--stage and --config both given"),
                "{stderr}"
            );
        }
    }
    let out = ringzero().args(["demo", "--stage", "5"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("stage 5 does not exist"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn launch_keeps_flight_records_and_diag_joins_them() {
    let bin = env!("CARGO_BIN_EXE_ringzero");
    let base = std::env::temp_dir().join(format!("ringzero-cli-flight-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let dumps = base.join("dumps");
    let tmp = base.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let check = [bin, "check", "-b", "1K", "-e", "4K", "--iters", "1"];
    // With --dump-dir every rank's record stays there, and a healthy job joins as consistent.
    let out = ringzero()
        .args(["launch", "-n", "2", "--dump-dir"])
        .arg(&dumps)
        .arg("--")
        .args(check)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let names: Vec<String> = std::fs::read_dir(&dumps)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    for r in 0..2 {
        assert!(
            names.contains(&format!("ringzero-flight-host-rank{r}.json")),
            "{names:?}"
        );
    }
    let out = ringzero()
        .arg("diag")
        .arg("--flight")
        .arg(&dumps)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(
        stdout.contains("1. CONSISTENT: every rank recorded the same calls"),
        "{stdout}"
    );
    let out = ringzero()
        .args(["diag", "--json", "--flight"])
        .arg(&dumps)
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["groups"][0]["ranks"][1]["closed"], true);
    // Without it, the launcher's own directory (under TMPDIR) is gone after a job that succeeded.
    let out = ringzero()
        .args(["launch", "-n", "2", "--"])
        .args(check)
        .env("TMPDIR", &tmp)
        .env_remove("RINGZERO_DUMP_DIR")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        std::fs::read_dir(&tmp).unwrap().count(),
        0,
        "left behind in {}",
        tmp.display()
    );
    // A directory without records, and --flight mixed with machine checks, are refused.
    let out = ringzero()
        .arg("diag")
        .arg("--flight")
        .arg(&tmp)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no flight records"));
    let out = ringzero()
        .args(["diag", "--probes", "shm", "--flight"])
        .arg(&tmp)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot be used with"));
    std::fs::remove_dir_all(&base).unwrap();
}

#[test]
fn demo_resumes_exactly_and_ckpt_checks_and_consolidates() {
    let root = std::env::temp_dir().join(format!("ringzero-cli-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let ck = root.join("ck");
    let demo = |extra: &[&str]| {
        let mut args = vec![
            "demo",
            "-n",
            "2",
            "--stage",
            "2",
            "--precision",
            "fp32",
            "--log-every",
            "1",
        ];
        args.extend_from_slice(extra);
        let out = ringzero().args(&args).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        (out.status.success(), stdout, stderr)
    };
    // (step, loss, scale, lr) of every logged step: the step time differs from run to run.
    let losses = |stdout: &str| -> Vec<String> {
        stdout
            .lines()
            .filter_map(|l| {
                let t: Vec<&str> = l.split_whitespace().collect();
                (t.len() == 5 && t.iter().all(|x| x.parse::<f64>().is_ok()))
                    .then(|| t[..4].join(" "))
            })
            .collect()
    };
    let (ok, whole, err) = demo(&["--steps", "8"]);
    assert!(ok, "{whole}\n{err}");
    let ck_s = ck.to_str().unwrap();
    let (ok, first, err) = demo(&["--steps", "4", "--save", ck_s]);
    assert!(ok, "{first}\n{err}");
    assert!(first.contains("saved a checkpoint in"), "{first}");
    let (ok, second, err) = demo(&["--steps", "4", "--resume", ck_s]);
    assert!(ok, "{second}\n{err}");
    let (whole, first, second) = (losses(&whole), losses(&first), losses(&second));
    assert_eq!(whole.len(), 8);
    assert_eq!(first[..], whole[..4]);
    assert_eq!(second[..], whole[4..], "the resumed run continues exactly");

    // Saving over it is refused; a model of another shape cannot load it.
    let (ok, out, err) = demo(&["--steps", "1", "--save", ck_s]);
    assert!(
        !ok && err.contains("already holds a checkpoint"),
        "{out}\n{err}"
    );
    let (ok, out, err) = demo(&["--steps", "1", "--resume", ck_s, "--hidden", "32"]);
    assert!(!ok, "{out}");
    assert!(err.contains("parameter `w0` has shape [32, 16]"), "{err}");

    let inspect = |dir: &std::path::Path, json: bool| {
        let mut c = ringzero();
        c.args(["ckpt", "inspect", dir.to_str().unwrap()]);
        if json {
            c.arg("--json");
        }
        c.output().unwrap()
    };
    let out = inspect(&ck, false);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("saved by 2 ranks (stage 2, fp32"), "{text}");
    assert!(text.contains("after 4 optimizer steps"), "{text}");
    assert!(text.contains("all 2 shards check out"), "{text}");
    let out = inspect(&ck, true);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["meta"]["client_state"]["step"], 4);
    assert_eq!(v["shards"], serde_json::json!([null, null]));

    let full = root.join("full.safetensors");
    let out = ringzero()
        .args(["ckpt", "consolidate", ck_s, "-o", full.to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    // 4 layers of 16 → 64 → 64 → 64 → 4: weights and biases.
    let psi = 16 * 64 + 64 + 2 * (64 * 64 + 64) + 64 * 4 + 4;
    assert!(
        text.contains(&format!("8 tensors, {psi} parameter elements in fp32")),
        "{text}"
    );
    let header_len = u64::from_le_bytes(std::fs::read(&full).unwrap()[..8].try_into().unwrap());
    assert_eq!(
        std::fs::metadata(&full).unwrap().len(),
        8 + header_len + 4 * psi as u64
    );

    // A corrupt shard: inspect says which and exits 1; consolidate refuses and writes nothing.
    let shard = ck.join("rank-00001-of-00002.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 1;
    std::fs::write(&shard, bytes).unwrap();
    let out = inspect(&ck, false);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("rank-00001-of-00002.safetensors") && text.contains("BAD: checkpoint"),
        "{text}"
    );
    assert!(text.contains("checksum mismatch"), "{text}");
    let other = root.join("other.safetensors");
    let out = ringzero()
        .args(["ckpt", "consolidate", ck_s, "-o", other.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("checksum mismatch"));
    assert!(!other.exists());
    let out = inspect(&root.join("nowhere"), false);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nowhere: does not exist"));
    std::fs::remove_dir_all(&root).unwrap();
}

/// `gpu-check --host-stream`: the GPU check's collective runs (host staging on 2 and 4 ranks,
/// tcp, a rank killed) on the host stream, so that the checks a GPU session depends on are
/// themselves tested here: every row there, every row passing.
#[test]
fn gpu_check_dry_run_on_the_host_stream_passes_every_row() {
    let json = std::env::temp_dir().join(format!("ringzero-dry-{}.json", std::process::id()));
    let out = succeeds(
        ringzero()
            .args(["gpu-check", "--host-stream", "--quick", "--no-bench"])
            .arg("--json")
            .arg(&json),
    );
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    let checks: Vec<&str> = rows.iter().map(|r| r["check"].as_str().unwrap()).collect();
    let failed: Vec<&serde_json::Value> = rows.iter().filter(|r| r["pass"] != true).collect();
    assert!(failed.is_empty(), "{failed:#?}\n{out}");
    let per_run = [
        "edges",
        "algorithm",
        "all_reduce",
        "reduce_scatter",
        "reduce_scatter_v",
        "all_gather",
        "broadcast",
        "reduce",
        "ring_shift",
        "all_to_all",
        "all_gather_v",
        "send_recv",
        "all_to_all_v",
        "gather",
        "scatter",
        "barrier",
        "async all_reduce",
        "posted send/recv",
        "bytes moved",
        "zero device engine",
    ];
    let mut want: Vec<String> = ["staging n=2", "staging n=4", "staging-copy n=2", "tcp n=2"]
        .iter()
        .flat_map(|run| {
            per_run
                .iter()
                .map(move |c| format!("host-stream {run} {c}"))
        })
        .collect();
    want.push("host-stream staging n=4 rank 1 killed".into());
    want.push("host-stream staging n=4 killed rank: diag --flight names it".into());
    assert_eq!(checks, want, "{out}");
    assert!(
        out.contains(&format!("{} passed, 0 failed", want.len())),
        "{out}"
    );
    // The host stream stages every byte through shm (or tcp), and never takes the direct step.
    for r in &rows {
        let (check, detail) = (r["check"].as_str().unwrap(), r["detail"].as_str().unwrap());
        if check.ends_with("algorithm") {
            assert_eq!(detail, "the slot ring", "{check}");
        }
        if check.ends_with("bytes moved") {
            assert!(detail.contains("; 0 written straight"), "{check}: {detail}");
        }
    }
    // The kernels and bandwidth checks need a GPU: a dry run refuses to be asked for them.
    let err = fails(ringzero().args(["gpu-check", "--host-stream", "--kernels-only"]));
    assert!(
        err.contains("--kernels-only") && err.contains("--host-stream"),
        "{err}"
    );
}

/// Not a test of its own: the rank program of the hang test below when `RINGZERO_TEST_HANG` is
/// set. Rank 0 all-reduces; rank 1 never calls (it sleeps), so rank 0 waits in the all-reduce.
#[test]
fn hang_rank_entry() {
    if std::env::var_os("RINGZERO_TEST_HANG").is_none() {
        return;
    }
    let comm = ringzero_collectives::Communicator::from_env().unwrap();
    if comm.rank() == 0 {
        let mut v = vec![1f32; 1024];
        let _ = comm.all_reduce(
            ringzero_collectives::InPlace,
            &mut v,
            ringzero_collectives::ReduceOp::Sum,
        );
    } else {
        std::thread::sleep(std::time::Duration::from_secs(60));
    }
    std::process::exit(0);
}

/// `ringzero launch` of two ranks of [`hang_rank_entry`] writing flight records into `dir`
/// (emptied first), with `env` for the launcher and its ranks.
fn hung_job(dir: &std::path::Path, env: &[(&str, &str)]) -> std::process::Child {
    let _ = std::fs::remove_dir_all(dir);
    let mut cmd = ringzero();
    cmd.args(["launch", "-n", "2", "--grace", "1", "--dump-dir"])
        .arg(dir)
        .arg("--")
        .arg(std::env::current_exe().unwrap())
        .args(["hang_rank_entry", "--exact", "--nocapture"])
        .args(["--test-threads", "1"])
        .env("RINGZERO_TEST_HANG", "1")
        .env("RINGZERO_TIMEOUT", "60")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().unwrap()
}

/// Files in `dir` whose names start with `prefix`.
fn files_in(dir: &std::path::Path, prefix: &str) -> usize {
    std::fs::read_dir(dir).map_or(0, |d| {
        d.filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.file_name().to_string_lossy().starts_with(prefix))
        })
        .count()
    })
}

/// Wait (30 s at most) until `ok`.
fn wait_until(what: &str, ok: &dyn Fn() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !ok() {
        assert!(
            std::time::Instant::now() < deadline,
            "waited 30 s for {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// `ringzero diag --flight dir` (then `dir` is removed): its exit code and its report.
fn flight_report(dir: &std::path::Path) -> (Option<i32>, String) {
    let diag = ringzero()
        .args(["diag", "--flight"])
        .arg(dir)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(dir);
    let report = String::from_utf8_lossy(&diag.stdout).into_owned();
    (diag.status.code(), report)
}

/// The process `pid` (a rank or the launcher).
fn signal(pid: u32, sig: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_raw(pid as i32).unwrap();
    rustix::process::kill_process(pid, sig).unwrap();
}

/// A hung job's ranks say what they are doing, before any deadline: SIGUSR1 to `ringzero
/// launch` makes every rank write its flight record and the job goes on; Ctrl-C (SIGINT) does
/// the same, then stops the job (exit 130) and names the directory, where `ringzero diag
/// --flight` finds rank 0 waiting in an all-reduce that rank 1 never called.
#[test]
fn launch_asks_a_hung_job_for_its_flight_records_on_sigusr1_and_on_ctrl_c() {
    use rustix::process::Signal;
    let dir = std::env::temp_dir().join(format!("ringzero-sig-{}", std::process::id()));
    let mut job = hung_job(&dir, &[]);
    let files = |prefix: &str| files_in(&dir, prefix);
    // Each rank's communicator leaves its marker once it watches for SIGUSR1.
    wait_until("both ranks' markers", &|| files(".ringzero-sigusr1-") == 2);
    assert_eq!(
        files("ringzero-flight-"),
        0,
        "no record before it is asked for"
    );
    // Rank 0 is then in its all-reduce (or about to be: a record shows it either way).
    std::thread::sleep(std::time::Duration::from_millis(200));
    signal(job.id(), Signal::USR1);
    wait_until("both records", &|| files("ringzero-flight-") == 2);
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(
        job.try_wait().unwrap().is_none(),
        "the job goes on after SIGUSR1"
    );
    signal(job.id(), Signal::INT);
    let out = job.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("SIGUSR1: asked 2 of 2 ranks"), "{stderr}");
    assert!(
        stderr.contains("interrupted by signal 2: flight records of 2 of 2 ranks are in"),
        "{stderr}"
    );
    assert_eq!(
        files(".ringzero-sigusr1-"),
        0,
        "the launcher removes its ranks' markers"
    );
    let (code, report) = flight_report(&dir);
    let rank0 = report.lines().find(|l| l.starts_with("0 ")).unwrap_or("");
    assert!(
        rank0.contains("all_reduce(f32, sum, count=1024)") && rank0.contains("running"),
        "{report}"
    );
    // The hang's culprit, named while the job was still up.
    assert!(
        report.contains("NEVER_CALLED: rank 1 never called seq 1 all_reduce"),
        "{report}"
    );
    assert_eq!(code, Some(1), "something is off: {report}");
}

/// Processes whose environment holds `RINGZERO_TEST_TOKEN=token`.
fn with_token(token: &str) -> usize {
    let want = format!("RINGZERO_TEST_TOKEN={token}");
    std::fs::read_dir("/proc").map_or(0, |d| {
        d.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/environ"))
                    .is_ok_and(|env| env.split(|b| *b == 0).any(|v| v == want.as_bytes()))
            })
            .count()
    })
}

/// Ranks behind a wrapper command (`sh -c "RANK_PROGRAM; echo done"`), one of which also left a
/// process in a session of its own: Ctrl-C to the launcher asks the real ranks (not the shells)
/// for their flight records, and when the launcher has exited nothing the ranks started is left
/// (the shells used to exit on SIGTERM and leave the ranks running, parent pid 1).
#[test]
fn nothing_a_wrapped_rank_started_outlives_the_launcher() {
    use rustix::process::Signal;
    let dir = std::env::temp_dir().join(format!("ringzero-wrap-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let token = format!("wrap-{}", std::process::id());
    let exe = std::env::current_exe().unwrap();
    let script = format!(
        "setsid sleep 300 & '{}' hang_rank_entry --exact --nocapture --test-threads 1; echo done",
        exe.display()
    );
    let job = ringzero()
        .args(["launch", "-n", "2", "--grace", "1", "--dump-dir"])
        .arg(&dir)
        .args(["--", "sh", "-c", &script])
        .env("RINGZERO_TEST_HANG", "1")
        .env("RINGZERO_TIMEOUT", "60")
        .env("RINGZERO_TEST_TOKEN", &token)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_until("both ranks' markers", &|| {
        files_in(&dir, ".ringzero-sigusr1-") == 2
    });
    // Launcher, two shells, two ranks, two sleeps.
    assert_eq!(with_token(&token), 7);
    std::thread::sleep(std::time::Duration::from_millis(200));
    signal(job.id(), Signal::INT);
    let out = job.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("asked 2 of 2 ranks"), "{stderr}");
    assert_eq!(files_in(&dir, "ringzero-flight-"), 2, "{stderr}");
    assert_eq!(files_in(&dir, ".ringzero-sigusr1-"), 0, "markers left");
    // Killed processes may take a moment to leave /proc once reaped.
    wait_until("every process of the job gone", &|| with_token(&token) == 0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A rank that fails during set-up leaves its peers waiting with their shared-memory segments
/// created and not yet attached; the launcher stops them, and no `ringzero-*` file of the job is
/// left in the shared-memory directory (one 2 MiB segment used to leak every run).
#[test]
fn no_shared_memory_outlives_a_job_whose_rank_failed_during_set_up() {
    // A failed job keeps its flight-record directory under TMPDIR: this test's own.
    let tmp = scratch::fresh_dir("cli-shm-leak");
    let shm = std::env::temp_dir().join(format!("ringzero-shm-leak-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&shm);
    std::fs::create_dir_all(&shm).unwrap();
    let script = format!(
        "if [ $RINGZERO_RANK = 2 ]; then sleep 1; exit 3; fi; exec '{}' bench all-reduce -b 64K -e 64K",
        env!("CARGO_BIN_EXE_ringzero")
    );
    for _ in 0..2 {
        let out = ringzero()
            .args([
                "launch", "-n", "4", "--grace", "0.5", "--", "sh", "-c", &script,
            ])
            .env("RINGZERO_SHM_DIR", &shm)
            .env("TMPDIR", &*tmp)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{stderr}");
        let left: Vec<_> = std::fs::read_dir(&shm)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(left.is_empty(), "left behind: {left:?}\n{stderr}");
    }
    let _ = std::fs::remove_dir_all(&shm);
}

/// One rank started with another secret or job id: the store refuses it and tells the ranks
/// waiting for it, which fail within moments naming it (they used to wait out their 60 s
/// deadline and blame another rank); a rank that never comes is named by the ranks that did.
#[test]
fn ranks_fail_at_once_naming_a_refused_rank_and_name_who_never_came() {
    // A failed job keeps its flight-record directory under TMPDIR: this test's own.
    let tmp = scratch::fresh_dir("cli-refused");
    let bench = env!("CARGO_BIN_EXE_ringzero");
    for (var, value) in [
        ("RINGZERO_SECRET", "not-the-secret"),
        ("RINGZERO_JOB_ID", "another-job"),
    ] {
        let script = format!(
            "if [ $RINGZERO_RANK = 2 ]; then export {var}={value}; fi; \
             exec '{bench}' bench all-reduce -b 4K -e 4K --iters 1"
        );
        let t = std::time::Instant::now();
        let out = ringzero()
            .args([
                "launch", "-n", "3", "--grace", "10", "--", "sh", "-c", &script,
            ])
            .env("RINGZERO_TIMEOUT", "60")
            .env("TMPDIR", &*tmp)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{stderr}");
        assert!(
            t.elapsed().as_secs() < 20,
            "{var}: took {:?}: {stderr}",
            t.elapsed()
        );
        let named = stderr
            .lines()
            .filter(|l| l.contains("the store refused a rank") && l.contains("rank 2 at"))
            .count();
        assert!(named >= 1, "{var}: {stderr}");
    }
    let script =
        format!("RINGZERO_WORLD_SIZE=3 exec '{bench}' bench all-reduce -b 4K -e 4K --iters 1");
    let out = ringzero()
        .args([
            "launch", "-n", "2", "--grace", "10", "--", "sh", "-c", &script,
        ])
        .env("RINGZERO_TIMEOUT", "2")
        .env("TMPDIR", &*tmp)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("the ranks that reached the store: [0, 1]"),
        "{stderr}"
    );
}

/// Two processes started as rank 1 of one job: the store refuses the second, naming where
/// each came from, so it can never overwrite the first one's address.
#[test]
fn a_second_process_started_as_the_same_rank_is_refused_naming_both() {
    // A failed job keeps its flight-record directory under TMPDIR: this test's own.
    let tmp = scratch::fresh_dir("cli-same-rank");
    let b = env!("CARGO_BIN_EXE_ringzero");
    let run = format!("'{b}' bench all-reduce -b 4K -e 4K --iters 20");
    let script = format!("if [ $RINGZERO_RANK = 1 ]; then {run} & fi; exec {run}");
    let out = ringzero()
        .args(["launch", "-n", "2", "--", "sh", "-c", &script])
        .env("TMPDIR", &*tmp)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let refusal = stderr
        .lines()
        .find(|l| {
            l.starts_with("[rank 1]") && l.contains("refused: rank 1 joined this job already")
        })
        .unwrap_or_else(|| panic!("{stderr}"));
    assert!(refusal.contains("was started as rank 1 too"), "{refusal}");
    assert_eq!(refusal.matches("from 127.0.0.1:").count(), 2, "{refusal}");
}

/// A rank frozen by SIGSTOP mid-job: its peers time out and exit first, and the launcher's last
/// word names the stopped rank, not only the first to exit.
#[test]
fn the_launcher_names_a_stopped_rank_when_the_others_time_out_on_it() {
    // A failed job keeps its flight-record directory under TMPDIR: this test's own.
    let tmp = scratch::fresh_dir("cli-stopped");
    let b = env!("CARGO_BIN_EXE_ringzero");
    let script = format!(
        "if [ $RINGZERO_RANK = 2 ]; then (sleep 1; kill -STOP $$) & fi; \
         exec '{b}' bench all-reduce -b 1M -e 1M --iters 100000"
    );
    let out = ringzero()
        .args([
            "launch", "-n", "3", "--grace", "1", "--", "sh", "-c", &script,
        ])
        .env("RINGZERO_TIMEOUT", "3")
        .env("TMPDIR", &*tmp)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("rank 2 was stopped (SIGSTOP, or held by a debugger)"),
        "{stderr}"
    );
}

/// Arguments at and past every bound, for every subcommand: each run ends (within its own
/// bound) with a message, never a panic. `RINGZERO_TIMEOUT=3` bounds any job that starts.
#[test]
fn no_argument_makes_the_cli_panic_or_hang() {
    // A failed job keeps its flight-record directory under TMPDIR: this test's own.
    let tmp = scratch::fresh_dir("cli-bounds");
    let cases: &[&[&str]] = &[
        &["bench", "-b", "0", "-e", "0"],
        &["bench", "-b", "1", "-e", "4"],
        &["bench", "-f", "1"],
        &["bench", "-f", "0"],
        &["bench", "--iters", "0"],
        &["bench", "-n", "0"],
        &["bench", "-n", "1", "-b", "4", "-e", "4", "--iters", "1"],
        &["bench", "-b", "18446744073709551615"],
        &["bench", "--tcp-sockets", "0"],
        &["bench", "--tcp-sockets", "65536"],
        &["launch", "-n", "0", "--", "true"],
        &["launch", "-n", "2", "--nodes", "5", "--", "true"],
        &["launch", "-n", "2", "--nodes", "0", "--", "true"],
        &["launch", "--grace", "-1", "--", "true"],
        &["launch", "--grace", "NaN", "--", "true"],
        &["launch", "--grace", "1e300", "--", "true"],
        &["launch", "-n", "1", "--", "/nonexistent/program"],
        &["launch", "-n", "1"],
        &["mem", "--params", "1e30"],
        &["mem", "--params", "-5"],
        &["mem", "--dp", "0"],
        &["mem", "--stage", "9"],
        &["mem", "--k", "1e300"],
        &["mem", "--shard-size", "0"],
        &["demo", "-n", "0"],
        &["demo", "-n", "1", "--steps", "0"],
        &["demo", "-n", "1", "--hidden", "0"],
        &["demo", "-n", "1", "--batch", "0"],
        &["demo", "-n", "1", "--layers", "0"],
        &["demo", "-n", "1", "--lr", "NaN"],
        &["demo", "-n", "1", "--stage", "7"],
        &["demo", "-n", "1", "--precision", "fp8"],
        &["demo", "-n", "1", "--config", "/nonexistent.json"],
        &["demo", "-n", "1", "--resume", "/nonexistent"],
        &["ckpt", "inspect", "/nonexistent"],
        &[
            "ckpt",
            "consolidate",
            "/nonexistent",
            "-o",
            "/nonexistent/x",
        ],
        &["diag", "--probes", "nosuch", "--probe-timeout", "1"],
        &["diag", "--probe-timeout", "-1"],
        &["diag", "--flight", "/nonexistent"],
        &[
            "diag",
            "--sysfs-root",
            "/nonexistent",
            "--procfs-root",
            "/nonexistent",
        ],
        &["check", "-b", "0", "-e", "0"],
        &["check", "-f", "1"],
    ];
    for args in cases {
        let mut child = ringzero()
            .args(*args)
            .env("RINGZERO_TIMEOUT", "3")
            .env("TMPDIR", &*tmp)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                panic!("{args:?} still running after 60 s");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let mut stderr = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        // Killed by a signal only if it is the launcher's own stop (none here).
        assert!(
            status.code().is_some(),
            "{args:?} died of {status:?}: {stderr}"
        );
    }
}

/// The pids of processes whose environment holds `RINGZERO_TEST_TOKEN=token` and, if given,
/// `RINGZERO_RANK=rank`.
fn pids_with(token: &str, rank: Option<usize>) -> Vec<i32> {
    let want = format!("RINGZERO_TEST_TOKEN={token}");
    let rank = rank.map(|r| format!("RINGZERO_RANK={r}"));
    std::fs::read_dir("/proc").map_or(Vec::new(), |d| {
        d.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|env| {
                    let mut vars = env.split(|b| *b == 0);
                    let has = |v: &[u8]| env.split(|b| *b == 0).any(|x| x == v);
                    vars.any(|v| v == want.as_bytes())
                        && rank.as_ref().is_none_or(|r| has(r.as_bytes()))
                })
            })
            .collect()
    })
}

/// A small fault matrix, run on every test run: a rank of a 3-rank job over shm or tcp is
/// SIGKILLed, SIGSTOPped or SIGTERMed during set-up or mid-collective. Every run must end (no
/// hang: the survivors fail within the deadline, the launcher stops the rest), leave no
/// `ringzero-*` file in the shared-memory directory and no process of the job behind.
#[test]
fn a_fault_matrix_leaves_no_hang_no_shared_memory_and_no_process() {
    // A failed job keeps its flight-record directory under TMPDIR: this test's own.
    let tmp = scratch::fresh_dir("cli-faults");
    use rustix::process::Signal;
    let b = env!("CARGO_BIN_EXE_ringzero");
    let shm = std::env::temp_dir().join(format!("ringzero-faults-{}", std::process::id()));
    let (mut runs, mut hangs, mut leaked, mut left, mut unstarted) = (0, 0, 0, 0, 0);
    let mut notes = Vec::new();
    for (i, transport) in ["shm", "tcp"].into_iter().enumerate() {
        for (j, sig) in [Signal::KILL, Signal::STOP, Signal::TERM]
            .into_iter()
            .enumerate()
        {
            for (k, delay_ms) in [30u64, 700].into_iter().enumerate() {
                let victim = (i + j + k) % 3;
                let _ = std::fs::remove_dir_all(&shm);
                std::fs::create_dir_all(&shm).unwrap();
                let token = format!("faults-{}-{runs}", std::process::id());
                let script = format!("exec '{b}' bench all-reduce -b 256K -e 256K --iters 100000");
                let mut job = ringzero()
                    .args([
                        "launch", "-n", "3", "--grace", "1", "--", "sh", "-c", &script,
                    ])
                    .env("RINGZERO_TIMEOUT", "3")
                    .env("TMPDIR", &*tmp)
                    .env("RINGZERO_TRANSPORT", transport)
                    .env("RINGZERO_SHM_DIR", &shm)
                    .env("RINGZERO_TEST_TOKEN", &token)
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .spawn()
                    .unwrap();
                runs += 1;
                // The delay counts from the victim's start: on a loaded machine the launcher
                // may take longer than the delay to start it, and a signal sent before then
                // would reach nobody (the job then runs its whole bench, which looks like a hang).
                let since = std::time::Instant::now();
                let pids = loop {
                    let pids = pids_with(&token, Some(victim));
                    if !pids.is_empty() || since.elapsed() > std::time::Duration::from_secs(20) {
                        break pids;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(1));
                };
                if pids.is_empty() {
                    unstarted += 1;
                    notes.push(format!("{transport}: rank {victim} not started after 20 s"));
                }
                std::thread::sleep(std::time::Duration::from_millis(delay_ms));
                for pid in pids {
                    let pid = rustix::process::Pid::from_raw(pid).unwrap();
                    let _ = rustix::process::kill_process(pid, sig);
                }
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(40);
                while job.try_wait().unwrap().is_none() {
                    if std::time::Instant::now() > deadline {
                        hangs += 1;
                        notes.push(format!(
                            "{transport} {sig:?} rank {victim} at {delay_ms} ms: hung"
                        ));
                        let _ = job.kill();
                        let _ = job.wait();
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                let files = std::fs::read_dir(&shm).unwrap().count();
                leaked += files;
                if files > 0 {
                    notes.push(format!(
                        "{transport} {sig:?} rank {victim} at {delay_ms} ms: {files} files"
                    ));
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
                let procs = pids_with(&token, None);
                left += procs.len();
                for pid in procs {
                    let _ = rustix::process::kill_process(
                        rustix::process::Pid::from_raw(pid).unwrap(),
                        Signal::KILL,
                    );
                    notes.push(format!(
                        "{transport} {sig:?} rank {victim} at {delay_ms} ms: pid {pid} left"
                    ));
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&shm);
    println!(
        "fault matrix: {runs} runs, {hangs} hangs, {leaked} leaked files, {left} processes left"
    );
    assert_eq!((hangs, leaked, left, unstarted), (0, 0, 0, 0), "{notes:#?}");
}

/// The bench's copy baseline needs 16 MiB per rank of shared memory; in a 12 MiB tmpfs (mounted
/// in a user namespace of the test's own) it cannot have it: the bench says so and runs on
/// without the baseline (its files used to be sized sparsely, and filling them killed a rank
/// with SIGBUS), and leaves nothing in the directory.
#[test]
fn a_full_shared_memory_directory_costs_the_bench_its_baseline_not_a_rank() {
    let dir = std::env::temp_dir().join(format!("ringzero-small-shm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let b = env!("CARGO_BIN_EXE_ringzero");
    let d = dir.display();
    let script = format!(
        "mount -t tmpfs -o size=12m tmpfs '{d}' || exit 77; \
         RINGZERO_SHM_DIR='{d}' '{b}' bench all-reduce -n 2 -b 64K -e 64K --iters 2; rc=$?; \
         ls -A '{d}'; exit $rc"
    );
    let out = Command::new("unshare")
        .args(["-rm", "sh", "-c", &script])
        .output();
    let out = match out {
        Ok(o)
            if o.status.code() != Some(77)
                && !String::from_utf8_lossy(&o.stderr).contains("unshare:") =>
        {
            o
        }
        other => {
            println!("SKIPPED: cannot mount a small tmpfs in a user namespace here: {other:?}");
            return;
        }
    };
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("no copy-between-processes baseline")
            && stderr.contains("reserving 16777216 bytes"),
        "{stderr}"
    );
    assert!(
        !stdout.lines().any(|l| l.starts_with("ringzero-")),
        "left behind: {stdout}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A rank terminated by SIGTERM (the launcher's stop, torchrun's agent, Slurm's time limit)
/// writes its flight record before it ends where `RINGZERO_DUMP_ON_SIGTERM=1` (the ranks inherit
/// it from the launcher's environment): rank 1 of the hung job is sent SIGTERM; its record
/// is rewritten (taken after the one SIGUSR1 asked for), the job fails with rank 1 first, and
/// `ringzero diag --flight` no longer says NO_RECORD for it.
#[test]
fn a_rank_ended_by_sigterm_leaves_its_flight_record() {
    use rustix::process::Signal;
    let dir = std::env::temp_dir().join(format!("ringzero-term-{}", std::process::id()));
    let job = hung_job(&dir, &[("RINGZERO_DUMP_ON_SIGTERM", "1")]);
    let record = |rank: usize| -> Option<serde_json::Value> {
        let path = dir.join(format!("ringzero-flight-host-rank{rank}.json"));
        serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
    };
    wait_until("both ranks' markers", &|| {
        files_in(&dir, ".ringzero-sigusr1-") == 2
    });
    signal(job.id(), Signal::USR1);
    wait_until("rank 1's record", &|| record(1).is_some());
    let asked = record(1).unwrap();
    let taken = |r: &serde_json::Value| r["taken_unix_us"].as_u64().unwrap();
    signal(asked["pid"].as_u64().unwrap() as u32, Signal::TERM);
    let out = job.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + 15), "{stderr}");
    assert!(stderr.contains("rank 1 failed (signal 15)"), "{stderr}");
    let last = record(1).expect("rank 1's record");
    assert!(taken(&last) > taken(&asked), "rewritten on SIGTERM: {last}");
    let (_, report) = flight_report(&dir);
    assert!(!report.contains("NO_RECORD"), "{report}");
    let rank1 = report.lines().find(|l| l.starts_with("1 ")).unwrap_or("");
    assert!(
        rank1.contains("seq 0"),
        "rank 1 never got past set-up: {report}"
    );
}

/// `ringzero train`: a candle GPT learns on 2 and 3 ranks at stages 2 and 3 (the loss falls
/// below 2.0, well under the untrained ≈3.7), a run that cannot reach its threshold
/// exits non-zero saying so, and a bad shape is refused before any rank starts.
#[test]
fn train_learns_a_gpt_and_exits_non_zero_when_the_loss_stays_high() {
    for (ranks, stage) in [("2", "2"), ("3", "3")] {
        let out = succeeds(ringzero().args([
            "train",
            "-n",
            ranks,
            "--stage",
            stage,
            "--steps",
            "120",
            "--threshold",
            "2.0",
        ]));
        assert!(
            out.contains("tokens/s") && out.contains("engine memory"),
            "{out}"
        );
        assert!(out.contains(&format!("stage {stage}")), "{out}");
        // The engine's own count of its buffers at their peak (stage 3: the forward's
        // gathered window) is what its stream allocated, measured as made and dropped.
        assert!(out.contains("counted / allocated 1.00"), "{out}");
        // The communication buffers' peak, predicted before the model was built, is the
        // engine's count of them.
        let line = out
            .lines()
            .find(|l| l.contains("communication buffers at their peak: predicted"))
            .unwrap_or_else(|| panic!("{out}"));
        let mib: Vec<&str> = line
            .split_whitespace()
            .zip(line.split_whitespace().skip(1))
            .filter(|(_, unit)| unit.starts_with("MiB"))
            .map(|(x, _)| x)
            .collect();
        assert_eq!(mib.len(), 2, "{line}");
        assert_eq!(mib[0], mib[1], "{line}");
    }
    let out = ringzero()
        .args(["train", "--steps", "3", "--threshold", "1.0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("did not fall below 1"), "{stderr}");
    let e = fails(ringzero().args(["train", "--dim", "30", "--heads", "4"]));
    assert!(e.contains("--dim 30 does not divide into --heads 4"), "{e}");
    let e = fails(ringzero().args(["train", "--transport", "udp"]));
    assert!(
        e.contains("--transport udp: expected auto, shm or tcp"),
        "{e}"
    );
    let e = fails(ringzero().args(["train", "--stage", "3", "--config", "ds.json"]));
    assert!(e.contains("--stage and --config both given"), "{e}");
    let e = fails(ringzero().args(["train", "--device", "gpu"]));
    assert!(
        e.contains("--device \"gpu\": say cpu, cuda or cuda:N"),
        "{e}"
    );
    // The test build has no CUDA backend: said once, before any rank starts.
    let e = fails(ringzero().args(["train", "--device", "cuda:0"]));
    assert!(
        e.contains("built without candle's CUDA backend") && e.contains("scripts/build-gpu.sh"),
        "{e}"
    );
    assert!(!e.contains("rank 0"), "{e}");
}

/// `ringzero train` under Hugging Face's published ZeRO-2 config (the optimizer offloaded to the
/// CPU) with the delayed parameter update: the GPT still learns, the last step's offload traffic
/// is reported, and the delayed update without an offloaded optimizer is refused before any rank
/// starts, naming the fix.
#[test]
fn train_offloads_under_the_published_zero2_config_with_the_delayed_update() {
    let hf = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/deepspeed/hf-ds_config_zero2.json"
    );
    let out = succeeds(ringzero().args([
        "train",
        "-n",
        "2",
        "--config",
        hf,
        "--delayed-update-after",
        "1",
        "--steps",
        "120",
        "--threshold",
        "2.5",
    ]));
    assert!(out.contains("offload: CPU step"), "{out}");
    assert!(out.contains("; host: params"), "{out}");
    let e = fails(ringzero().args(["train", "--delayed-update-after", "1"]));
    assert!(
        e.contains("--delayed-update-after") && e.contains("delayed_update_after needs the whole"),
        "{e}"
    );
    assert!(!e.contains("rank 0"), "{e}");
}

/// `--precision` and `--lr` fill a config's `"auto"` values, as Hugging Face's Trainer fills
/// them from its arguments; where the config sets the value itself, or has no `"auto"` to fill,
/// the flag is refused before any rank starts, naming the key.
#[test]
fn train_flags_fill_a_configs_auto_values_and_only_those() {
    let fixture = |name: &str| {
        format!(
            "{}/../tests/fixtures/deepspeed/{name}",
            env!("CARGO_MANIFEST_DIR")
        )
    };
    let hf2 = fixture("hf-ds_config_zero2.json");
    let out = succeeds(ringzero().args([
        "train",
        "-n",
        "2",
        "--config",
        &hf2,
        "--precision",
        "bf16",
        "--lr",
        "1e-3",
        "--steps",
        "2",
        "--threshold",
        "100",
    ]));
    assert!(out.contains("stage 2, Bf16"), "{out}");
    let hf3 = fixture("hf-ds_config_zero3.json");
    let e = fails(ringzero().args(["train", "--config", &hf3, "--lr", "1e-4"]));
    assert!(
        e.contains("--lr and --config both given, and the config sets optimizer.params.lr = "),
        "{e}"
    );
    let e = fails(ringzero().args(["train", "--config", &hf3, "--precision", "bf16"]));
    assert!(
        e.contains("the config sets fp16.enabled = true: set it in one place"),
        "{e}"
    );
    let e = fails(ringzero().args([
        "train",
        "--config",
        &fixture("ds-tutorial-zero2.json"),
        "--lr",
        "1e-4",
    ]));
    assert!(
        e.contains("fills the config's \"auto\" optimizer.params.lr, and the config has none"),
        "{e}"
    );
    assert!(!e.contains("rank 0"), "{e}");
}

/// `ringzero train --save` then `--resume` at another rank count, stage and precision: the
/// second run goes on from the step and the weights the first stopped at (its first loss is the
/// trained model's, not an untrained one's), and its checkpoint consolidates into one file.
#[test]
fn train_resumes_from_its_checkpoint_at_another_rank_count_and_stage() {
    let dir = std::env::temp_dir().join(format!("ringzero-train-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (first, second) = (dir.join("a"), dir.join("b"));
    let losses = |out: &str| -> Vec<(usize, f32)> {
        out.lines()
            .filter_map(|l| {
                let w: Vec<&str> = l.split_whitespace().collect();
                (w.len() > 3 && w[0] == "step" && w[2] == "loss")
                    .then(|| (w[1].parse().unwrap(), w[3].parse().unwrap()))
            })
            .collect()
    };
    fn steps(n: &str) -> [&str; 6] {
        ["--steps", n, "--log-every", "10", "--threshold", "100"]
    }
    let out = succeeds(
        ringzero()
            .args(["train", "-n", "2", "--stage", "3", "--save"])
            .arg(&first)
            .args(steps("40")),
    );
    assert!(out.contains("saved a checkpoint in"), "{out}");
    let a = losses(&out);
    assert_eq!((a[0].0, a.last().unwrap().0), (0, 39), "{out}");
    let out = succeeds(
        ringzero()
            .args([
                "train",
                "-n",
                "3",
                "--stage",
                "1",
                "--precision",
                "bf16",
                "--resume",
            ])
            .arg(&first)
            .arg("--save")
            .arg(&second)
            .args(steps("5")),
    );
    let b = losses(&out);
    assert_eq!((b[0].0, b.last().unwrap().0), (40, 44), "{out}");
    assert!(
        b[0].1 < a[0].1 - 0.5,
        "resumed at an untrained loss: {a:?} then {b:?}"
    );
    let file = dir.join("model.safetensors");
    succeeds(
        ringzero()
            .args(["ckpt", "consolidate", "--out"])
            .arg(&file)
            .arg(&second),
    );
    assert!(file.is_file());
    let e = fails(ringzero().args(["train", "--resume"]).arg(dir.join("none")));
    assert!(
        e.contains("no such directory; name one a run wrote with --save"),
        "{e}"
    );
    // A model of another shape: refused by every rank, naming the parameter.
    let out = ringzero()
        .args(["train", "-n", "2", "--dim", "32", "--resume"])
        .arg(&first)
        .args(steps("1"))
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && !e.contains("panicked"), "{e}");
    assert!(
        e.contains("has shape [32] but the checkpoint holds [64]"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `ringzero mem --gpt`: a GPT's whole footprint per stage (model states fall with the stage,
/// candle's share does not), and a malformed shape refused with the expected form.
#[test]
fn mem_predicts_a_gpts_footprint_per_stage() {
    let out = succeeds(ringzero().args(["mem", "--gpt", "2,64,4,32,32", "--dp", "2"]));
    assert!(out.contains("106272 parameters"), "{out}");
    let totals: Vec<f64> = out
        .lines()
        .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .map(|l| l.split_whitespace().last().unwrap().parse().unwrap())
        .collect();
    assert_eq!(totals.len(), 4, "{out}");
    let states: Vec<f64> = out
        .lines()
        .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .map(|l| l.split_whitespace().nth(1).unwrap().parse().unwrap())
        .collect();
    assert!(states.windows(2).all(|w| w[1] < w[0]), "{out}");
    // A published config sets the precision and the buffers: Hugging Face's ZeRO-3 trains in
    // fp16, and stage 3 holds its gathered and prefetched buckets.
    let hf = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/deepspeed/hf-ds_config_zero3.json"
    );
    let out =
        succeeds(ringzero().args(["mem", "--gpt", "2,64,4,32,32", "--dp", "2", "--config", hf]));
    assert!(
        out.contains(", fp16, AdamW") && out.contains("comm buffers"),
        "{out}"
    );
    // That config offloads the optimizer and the parameters (stage 3 only); on a GPU the
    // table says what the device holds, candle's tensors and the engine's buffers there.
    assert!(!out.contains("\n     2 "), "{out}");
    // The GPU table for that config, with RINGZERO_DEVICE_SLICE_BYTES as given.
    let on_cuda = |slice: Option<&str>| {
        let mut c = ringzero();
        if let Some(s) = slice {
            c.env("RINGZERO_DEVICE_SLICE_BYTES", s);
        }
        let args = ["mem", "--gpt", "2,64,4,32,32", "--dp", "2", "--config", hf];
        succeeds(c.args(args).args(["--device", "cuda"]))
    };
    let out = on_cuda(None);
    let row = out
        .lines()
        .find(|l| l.trim_start().starts_with("3 "))
        .unwrap_or_else(|| panic!("{out}"));
    let cells: Vec<f64> = row.split_whitespace().map(|c| c.parse().unwrap()).collect();
    // stage, states, comm, slots, vars, grads, activations, backward, total, GPU, host.
    assert_eq!(cells.len(), 11, "{out}");
    let candle: f64 = cells[4..8].iter().sum();
    // The ring slots: the host communicator's (2 links × 4 slots × 512 KiB) and, over cuda_ipc,
    // the engine's receive edge's in device memory (4 slots × 16 MiB).
    assert_eq!(cells[3], 4.0 + 64.0, "{out}");
    // The GPU holds candle's tensors, the buffers, the device slots and what the config leaves
    // of the states there (stage 3's gradient shard).
    let on_gpu = candle + cells[2] + 64.0;
    assert!(cells[9] > on_gpu && cells[9] < on_gpu + cells[1], "{out}");
    assert!((cells[9] + cells[10] - cells[8]).abs() < 0.02, "{out}");
    assert!(
        out.contains("communicator's slots (64.00 MiB over cuda_ipc"),
        "{out}"
    );
    // The device slots follow RINGZERO_DEVICE_SLICE_BYTES.
    let out = on_cuda(Some("1M"));
    assert!(
        out.contains("communicator's slots (4.00 MiB over cuda_ipc"),
        "{out}"
    );
    let e = fails(ringzero().args(["mem", "--params", "1e9", "--config", hf]));
    assert!(
        e.contains("--config, --device and --batch size a GPT's footprint: give --gpt"),
        "{e}"
    );
    // The ring slots follow the communicator's settings in the environment.
    let slots = |out: &str| -> f64 {
        let row = out
            .lines()
            .find(|l| l.trim_start().starts_with("0 "))
            .unwrap();
        row.split_whitespace().nth(3).unwrap().parse().unwrap()
    };
    let base = succeeds(ringzero().args(["mem", "--gpt", "2,64,4,32,32", "--dp", "2"]));
    let big = succeeds(ringzero().env("RINGZERO_SLICE_BYTES", "1M").args([
        "mem",
        "--gpt",
        "2,64,4,32,32",
        "--dp",
        "2",
    ]));
    assert_eq!(slots(&big), 2.0 * slots(&base), "{base}\n{big}");
    let e = fails(ringzero().env("RINGZERO_SLOTS", "1").args([
        "mem",
        "--gpt",
        "2,64,4,32,32",
        "--dp",
        "2",
    ]));
    assert!(e.contains("RINGZERO_SLOTS"), "{e}");
    let e = fails(ringzero().args(["mem", "--params", "1e9", "--batch", "4"]));
    assert!(e.contains("--batch size a GPT's footprint"), "{e}");
    let e = fails(ringzero().args(["mem", "--gpt", "2,64,4,32,32", "--device", "gpu"]));
    assert!(
        e.contains("--device \"gpu\": say cpu, cuda or cuda:N"),
        "{e}"
    );
    let e = fails(ringzero().args(["mem", "--gpt", "2,64,4,32,32", "--config", "/no/such.json"]));
    assert!(e.contains("reading /no/such.json"), "{e}");
    let e = fails(ringzero().args(["mem", "--gpt", "2,64,4"]));
    assert!(e.contains("expected LAYERS,DIM,HEADS,CTX,VOCAB"), "{e}");
    let e = fails(ringzero().args(["mem", "--gpt", "2,30,4,32,32"]));
    assert!(e.contains("does not divide into 4 heads"), "{e}");
}

/// `ringzero nvme` measures the NVMe tier against a plain copy of the same bytes and removes
/// its files; settings direct I/O cannot take are refused, naming the flag.
#[test]
fn nvme_sets_the_tier_against_a_plain_copy_and_leaves_nothing() {
    let dir = std::env::temp_dir().join(format!("ringzero-nvme-cli-{}", std::process::id()));
    let out = succeeds(
        ringzero()
            .args(["nvme", "--size", "8M", "--rounds", "1"])
            .arg(&dir),
    );
    for want in [
        "NVMe tier (1024 KiB requests, 1 thread)",
        "plain copy",
        "tier / plain",
    ] {
        assert!(out.contains(want), "{out}");
    }
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "files left in {dir:?}"
    );
    let err = fails(ringzero().args(["nvme", "--block-size", "1000"]).arg(&dir));
    assert!(
        err.contains("--block-size") && err.contains("multiple of 4096"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `ringzero offload-bench` on the host stream: a line per mode, the device's as the ratios'
/// base, PCIe bytes only where the state left the device, NVMe bytes only on NVMe.
#[test]
fn offload_bench_sets_each_tier_against_the_device() {
    let dir = std::env::temp_dir().join(format!("ringzero-offload-bench-{}", std::process::id()));
    let out = succeeds(
        ringzero()
            .args(["offload-bench", "-n", "2", "--params", "1M", "--steps", "1"])
            .args(["--device", "host-stream", "--nvme-path"])
            .arg(&dir),
    );
    let row = |mode: &str| -> Vec<String> {
        out.lines()
            .find(|l| l.trim_start().starts_with(mode))
            .unwrap_or_else(|| panic!("no {mode} line: {out}"))
            .split_whitespace()
            .map(String::from)
            .collect()
    };
    let (none, cpu, nvme) = (row("none"), row("cpu"), row("nvme"));
    assert_eq!(none[2], "1.00", "{out}");
    // → host MB, nvme r MB
    assert_eq!(
        (none[5].as_str(), none[7].as_str()),
        ("0.0", "0.0"),
        "{out}"
    );
    assert!(cpu[5] != "0.0" && cpu[7] == "0.0", "{out}");
    assert!(nvme[5] != "0.0" && nvme[7] != "0.0", "{out}");
    assert_eq!(
        std::fs::read_dir(&dir).map_or(0, |d| d.count()),
        0,
        "files left"
    );
    let _ = std::fs::remove_dir_all(&dir);
    let err = fails(ringzero().args(["offload-bench", "--stage", "0"]));
    assert!(
        err.contains("--stage 0") && err.contains("stage 1, 2 or 3"),
        "{err}"
    );
}
