//! Ranks as processes, started through the launcher's own code with this test binary as the
//! program (`worker_entry` below runs a scenario when `RINGZERO_TEST_SCENARIO` is set).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ringzero::{Collective, Collectives, Communicator, DType, InPlace, NonBlocking, ReduceOp};
use ringzero_tools::diag::flight::{self, FindingKind};
use ringzero_tools::launch::{launch, DumpDir, LaunchSpec, Outcome, Output};

use crate::common::{check_case, fresh_dir, host_collectives, Case};

const SCENARIO: &str = "RINGZERO_TEST_SCENARIO";

/// Not a test of its own: the entry point of worker processes. Without `RINGZERO_TEST_SCENARIO`
/// it returns at once.
#[test]
fn worker_entry() {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        return;
    };
    println!(); // end libtest's "test worker_entry ... " line
    let code = match scenario.as_str() {
        "all" => all_collectives_scenario(),
        "kill" => kill_scenario(false),
        "kill-device" => kill_scenario(true),
        "kill-device-a2a" => kill_a2a_scenario(),
        "kill-gather" => kill_gather_scenario(false),
        "kill-gather-shared" => kill_gather_scenario(true),
        "kill-device-p2p" => kill_p2p_scenario(),
        "flood" => flood_scenario(),
        "kill-offload" => kill_offload_scenario(),
        other => {
            eprintln!("unknown scenario {other}");
            2
        }
    };
    std::process::exit(code);
}

/// An all-gather whose input is a `SharedBuf`: every other process's part arrives through this
/// process's mapping of that process's buffer. Prints how many bytes did.
fn shared_buffer_all_gather(comm: &Communicator) {
    let count = 300_007;
    let c = comm.chunk_range(count);
    let mut send = ringzero::SharedBuf::<f32>::zeroed(c.len()).unwrap();
    for (k, i) in c.clone().enumerate() {
        send[k] = i as f32;
    }
    let mut out = vec![0f32; count];
    for _ in 0..2 {
        comm.all_gather(&send[..], &mut out).unwrap();
        assert!(out.iter().enumerate().all(|(i, &x)| x == i as f32));
        out.fill(0.0);
    }
    let mapped = comm.counters().bytes_mapped;
    assert_eq!(mapped, 2 * 4 * (count - c.len()) as u64);
    println!("shared buffer mapped");
}

fn all_collectives_scenario() -> i32 {
    let comm = match Communicator::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("init failed: {e}");
            return 3;
        }
    };
    for e in comm.edges() {
        println!("edge {e}");
    }
    println!("single copy {:?}", comm.single_copy_sizes());
    for (k, coll) in host_collectives(comm.size() - 1).into_iter().enumerate() {
        for (dtype, op) in [
            (DType::F32, ReduceOp::Sum),
            (DType::BF16, ReduceOp::Avg),
            (DType::I64, ReduceOp::Min),
            (DType::U8, ReduceOp::Prod),
        ] {
            for in_place in [false, true] {
                let count = if coll == Collective::Barrier {
                    0
                } else {
                    [0, 1, 997, 300_007][k % 4]
                };
                check_case(
                    &comm,
                    &Case {
                        coll,
                        count,
                        dtype,
                        op,
                        in_place,
                        seed: k,
                    },
                );
            }
        }
    }
    if comm.single_copy_sizes().is_some() {
        shared_buffer_all_gather(&comm);
    }
    println!("all collectives ok");
    0
}

/// Rank 1 kills itself mid-stream; the others must fail, naming the collective. `device`: the
/// all-reduces run on device buffers (the device engine over the host stream).
fn kill_scenario(device: bool) -> i32 {
    let comm = Communicator::from_env().expect("init");
    let mut dc = device.then(|| {
        ringzero::DeviceComm::new(&comm, ringzero::HostStream::new()).expect("device comm")
    });
    if comm.rank() == 1 {
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            let me = rustix::process::getpid();
            let _ = rustix::process::kill_process(me, rustix::process::Signal::KILL);
        });
    }
    let mut buf = vec![1f32; 1 << 20];
    for i in 0..100_000 {
        let r = match dc.as_mut() {
            Some(dc) => dc.all_reduce(InPlace, &mut buf[..], ReduceOp::Sum),
            None => comm.all_reduce(InPlace, &mut buf, ReduceOp::Sum),
        };
        if let Err(e) = r {
            println!("rank {} failed in iteration {i}: {e}", comm.rank());
            return 3;
        }
        buf.fill(1.0);
    }
    println!("rank {} finished without noticing", comm.rank());
    0
}

/// Rank 1 kills itself while the ranks train with the optimizer state on the NVMe tier (under
/// `RINGZERO_TEST_DIR`); the others must fail a step, not wait, and remove their swap files.
fn kill_offload_scenario() -> i32 {
    use ringzero_zero::{Engine, OffloadOptimizer, ParamSpec, ZeroConfig};
    let comm = Communicator::from_env().expect("init");
    let dir = std::path::PathBuf::from(std::env::var("RINGZERO_TEST_DIR").expect("a directory"));
    let cfg = ZeroConfig::builder()
        .stage(2)
        .bucket_elems(1 << 16)
        .offload_optimizer(OffloadOptimizer::nvme(&dir))
        .build()
        .expect("config");
    let specs = [ParamSpec::new("w", &[1 << 18])];
    let mut e = Engine::<f32>::new(&comm, &specs, &|_, i| (i as f32).sin(), cfg).expect("engine");
    // Every rank has its engine (and its swap file) before rank 1's clock starts.
    comm.barrier().expect("barrier");
    if comm.rank() == 1 {
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            let me = rustix::process::getpid();
            let _ = rustix::process::kill_process(me, rustix::process::Signal::KILL);
        });
    }
    let g = vec![1e-3f32; 1 << 18];
    for i in 0..100_000 {
        let r = e.push_grad_f32("w", &g).and_then(|_| e.step());
        if let Err(err) = r {
            println!("rank {} failed in step {i}: {err}", comm.rank());
            drop(e);
            return 3;
        }
    }
    println!("rank {} finished without noticing", comm.rank());
    0
}

/// Rank 1 kills itself while the ranks run device all-to-alls, whose blocks the ring forwards
/// hop by hop: the others must fail, naming the collective.
fn kill_a2a_scenario() -> i32 {
    let comm = Communicator::from_env().expect("init");
    let dc = ringzero::DeviceComm::new(&comm, ringzero::HostStream::new()).expect("device");
    if comm.rank() == 1 {
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            let me = rustix::process::getpid();
            let _ = rustix::process::kill_process(me, rustix::process::Signal::KILL);
        });
    }
    let send = vec![comm.rank() as f32; 1 << 20];
    let mut recv = vec![0f32; 1 << 20];
    for i in 0..100_000 {
        if let Err(e) = dc.all_to_all(&send[..], &mut recv[..]) {
            println!("rank {} failed in iteration {i}: {e}", comm.rank());
            return 3;
        }
    }
    println!("rank {} finished without noticing", comm.rank());
    0
}

/// Rank 1 kills itself while the ranks run 512 KiB all-gathers that read each part straight out
/// of its owner's process (`shared`: out of a `SharedBuf`, through mappings that outlive the
/// process): the others must fail, naming the collective.
fn kill_gather_scenario(shared: bool) -> i32 {
    let comm = Communicator::from_env().expect("init");
    if comm.single_copy_sizes().is_none() {
        println!("rank {}: no single copy", comm.rank());
        return 4;
    }
    if comm.rank() == 1 {
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            let me = rustix::process::getpid();
            let _ = rustix::process::kill_process(me, rustix::process::Signal::KILL);
        });
    }
    let mut buf: Box<dyn std::ops::DerefMut<Target = [f32]>> = if shared {
        Box::new(ringzero::SharedBuf::<f32>::zeroed(1 << 17).unwrap())
    } else {
        Box::new(vec![0f32; 1 << 17])
    };
    buf.fill(comm.rank() as f32);
    for i in 0..100_000 {
        if let Err(e) = comm.all_gather(InPlace, &mut buf[..]) {
            println!("rank {} failed in iteration {i}: {e}", comm.rank());
            return 3;
        }
    }
    println!("rank {} finished without noticing", comm.rank());
    0
}

/// Rank 1 kills itself while the ranks pass 1 MiB messages round the ring with posted device
/// calls (`recv_async` from the rank before, `send_async` to the rank after): its neighbours
/// must fail, naming the call, and rank 3, which never talks to it, must hear of it from them.
fn kill_p2p_scenario() -> i32 {
    let comm = Communicator::from_env().expect("init");
    let dc = ringzero::DeviceComm::new(&comm, ringzero::HostStream::new()).expect("device");
    let (r, n) = (comm.rank(), comm.size());
    if r == 1 {
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            let me = rustix::process::getpid();
            let _ = rustix::process::kill_process(me, rustix::process::Signal::KILL);
        });
    }
    let (prev, next) = ((r + n - 1) % n, (r + 1) % n);
    let (mut send, mut recv) = (vec![r as f32; 1 << 18], vec![0f32; 1 << 18]);
    for i in 0..100_000 {
        let got = dc.recv_async(recv, prev);
        let sent = dc.send_async(send, next);
        match (got.wait(), sent.wait()) {
            (Ok(g), Ok(s)) => (recv, send) = (g, s),
            (Err(e), _) | (_, Err(e)) => {
                println!("rank {r} failed in iteration {i}: {e}");
                return 3;
            }
        }
    }
    println!("rank {r} finished without noticing");
    0
}

fn run(
    n: usize,
    nodes: usize,
    scenario: &str,
    env: &[(&str, &str)],
    grace: Duration,
) -> (Outcome, Vec<(usize, String)>) {
    run_with(n, nodes, scenario, env, grace, None)
}

fn run_with(
    n: usize,
    nodes: usize,
    scenario: &str,
    env: &[(&str, &str)],
    grace: Duration,
    dump_dir: Option<&std::path::Path>,
) -> (Outcome, Vec<(usize, String)>) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let mut e: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    e.push((SCENARIO.into(), scenario.into()));
    let spec = LaunchSpec {
        ranks: n,
        nodes,
        program: std::env::current_exe().unwrap().into(),
        args: [
            "processes::worker_entry",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ]
        .map(Into::into)
        .to_vec(),
        env: e,
        grace,
        dump_dir: dump_dir.map(|d| DumpDir {
            path: d.to_path_buf(),
            remove_on_success: false,
        }),
    };
    let outcome = launch(&spec, Output::Capture(log.clone())).expect("launch");
    let lines = log.lock().unwrap().clone();
    (outcome, lines)
}

fn assert_all_ok(outcome: &Outcome, lines: &[(usize, String)], n: usize) {
    assert_eq!(outcome.first_failure, None, "{lines:#?}");
    let ok = lines
        .iter()
        .filter(|(_, l)| l == "all collectives ok")
        .count();
    assert_eq!(ok, n, "{lines:#?}");
}

#[test]
fn all_collectives_as_processes_over_shm() {
    // Every all-gather reads its parts straight out of the other processes (the slot ring's
    // all-gather runs as processes over tcp below, and as threads over shm).
    let env = [
        ("RINGZERO_TRANSPORT", "shm"),
        ("RINGZERO_SINGLE_COPY_FROM", "0"),
        ("RINGZERO_SINGLE_COPY_BELOW", "off"),
    ];
    let (o, lines) = run(3, 1, "all", &env, Duration::from_secs(5));
    assert_all_ok(&o, &lines, 3);
    let direct = format!("single copy {:?}", Some(0..usize::MAX));
    assert_eq!(lines.iter().filter(|(_, l)| *l == direct).count(), 3);
    // The shared buffers' all-gather read every other process's part through a mapping.
    let mapped = lines.iter().filter(|(_, l)| l == "shared buffer mapped");
    assert_eq!(mapped.count(), 3);
    assert!(
        lines
            .iter()
            .filter(|(_, l)| l.starts_with("edge") && l.contains(": shm ("))
            .count()
            == 6,
        "{lines:#?}"
    );
}

#[test]
fn all_collectives_as_processes_over_tcp() {
    // Two connections per edge: the receiving rank's knob reaches its sender.
    let (o, lines) = run(
        3,
        1,
        "all",
        &[("RINGZERO_SHM_DISABLE", "1"), ("RINGZERO_TCP_SOCKETS", "2")],
        Duration::from_secs(5),
    );
    assert_all_ok(&o, &lines, 3);
    assert!(
        lines.iter().any(
            |(_, l)| l.contains(": tcp over 2 connections (same node, RINGZERO_SHM_DISABLE=1)")
        ),
        "{lines:#?}"
    );
}

#[test]
fn two_fake_nodes_mix_shm_inside_and_tcp_between() {
    let (o, lines) = run(4, 2, "all", &[], Duration::from_secs(5));
    assert_all_ok(&o, &lines, 4);
    let edge = |from: usize, to: usize, kind: &str| {
        lines
            .iter()
            .any(|(_, l)| l.starts_with(&format!("edge rank {from} → rank {to}: {kind} (")))
    };
    assert!(edge(0, 1, "shm") && edge(2, 3, "shm"), "{lines:#?}");
    assert!(edge(1, 2, "tcp") && edge(3, 0, "tcp"), "{lines:#?}");
}

fn killed_rank_is_noticed(nodes: usize, env: &[(&str, &str)]) {
    killed_rank_is_noticed_in(nodes, env, "kill")
}

fn killed_rank_is_noticed_in(nodes: usize, env: &[(&str, &str)], scenario: &str) {
    let t = Instant::now();
    // A long deadline: survivors must notice the death itself, not time out.
    let mut env = env.to_vec();
    env.push(("RINGZERO_TIMEOUT", "60"));
    let dir = fresh_dir(&format!("kill-{scenario}-{nodes}-{}", env[0].1));
    let (o, lines) = run_with(
        4,
        nodes,
        scenario,
        &env,
        Duration::from_secs(30),
        Some(&dir),
    );
    let took = t.elapsed();
    // The survivors' flight records name the dead rank first, and the launcher points to them.
    let report = flight::join(&dir).unwrap();
    let comm = if scenario == "kill-device" {
        "device"
    } else {
        "host"
    };
    let g = report
        .groups
        .iter()
        .find(|g| g.comm == comm)
        .expect("group");
    let f = &g.findings[0];
    assert_eq!(
        (f.kind, f.ranks.as_slice()),
        (FindingKind::NO_RECORD, &[1][..]),
        "{}",
        flight::text(&report)
    );
    assert!(
        f.text.contains("the others saw it go") && f.text.contains("peer rank 1"),
        "{}",
        f.text
    );
    for r in [0, 2, 3] {
        let line = &g.ranks[r];
        assert!(
            line.present && line.closed && line.failure.is_some(),
            "{line:?}"
        );
        assert!(
            line.last
                .as_ref()
                .unwrap()
                .call
                .starts_with("all_reduce(f32, sum"),
            "{line:?}"
        );
    }
    assert_eq!(report.exit_code, 2);
    assert!(
        lines.iter().any(|(q, l)| *q == usize::MAX
            && l.contains("flight records of 3 of 4 ranks")
            && l.contains("ringzero diag --flight")),
        "{lines:#?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(o.first_failure, Some(1), "{lines:#?}");
    assert_eq!(o.exit_code(), 128 + 9);
    for r in [0, 2, 3] {
        let e = &o.exits[r];
        assert!(
            !e.killed_by_launcher,
            "rank {r} had to be killed: it did not notice\n{lines:#?}"
        );
        assert_eq!(e.status.code(), Some(3), "rank {r}: {lines:#?}");
        assert!(
            lines.iter().any(|(q, l)| *q == r
                && l.contains("failed in iteration")
                && l.contains("all_reduce")),
            "{lines:#?}"
        );
    }
    assert!(
        lines
            .iter()
            .any(|(q, l)| *q == usize::MAX && l.contains("rank 1 exited first with signal 9")),
        "{lines:#?}"
    );
    assert!(took < Duration::from_secs(20), "took {took:?}");
}

#[test]
fn a_rank_killed_mid_all_reduce_over_shm_fails_every_other_rank() {
    killed_rank_is_noticed(1, &[("RINGZERO_TRANSPORT", "shm")]);
}

#[test]
fn a_rank_killed_mid_all_reduce_over_tcp_fails_every_other_rank() {
    killed_rank_is_noticed(1, &[("RINGZERO_TRANSPORT", "tcp")]);
}

#[test]
fn a_rank_killed_mid_all_reduce_over_tcp_edges_of_four_connections_fails_every_other_rank() {
    killed_rank_is_noticed(
        1,
        &[("RINGZERO_TCP_SOCKETS", "4"), ("RINGZERO_TRANSPORT", "tcp")],
    );
}

#[test]
fn a_rank_killed_mid_all_reduce_across_fake_nodes_fails_every_other_rank() {
    killed_rank_is_noticed(2, &[]);
}

#[test]
fn a_rank_killed_mid_device_all_reduce_over_staging_fails_every_other_rank() {
    killed_rank_is_noticed_in(1, &[("RINGZERO_TRANSPORT", "shm")], "kill-device");
}

#[test]
fn a_rank_killed_mid_device_all_reduce_over_tcp_fails_every_other_rank() {
    killed_rank_is_noticed_in(1, &[("RINGZERO_TRANSPORT", "tcp")], "kill-device");
}

#[test]
fn a_rank_killed_mid_device_all_to_all_fails_every_other_rank() {
    survivors_fail("kill-device-a2a", &[&["all_to_all"]; 3]);
}

#[test]
fn a_rank_killed_mid_posted_device_point_to_point_fails_every_other_rank() {
    // Rank 2 waits on rank 1's message; ranks 0 and 3 may wait on each other's, and hear of
    // the death through their neighbours' aborts: every error names the message waited on and
    // carries the root cause.
    let (call, cause) = ("send_recv(f32, count=262144)", "lost peer rank 1");
    let names: [&[&str]; 3] = [
        &[call, cause],
        &[call, "from rank 1", cause],
        &[call, cause],
    ];
    survivors_fail("kill-device-p2p", &names);
}

#[test]
fn a_rank_killed_mid_single_copy_all_gather_fails_every_other_rank() {
    let names: [&[&str]; 3] = [&["all_gather", "single copy"]; 3];
    survivors_fail("kill-gather", &names);
}

#[test]
fn a_rank_killed_mid_all_gather_from_shared_buffers_fails_every_other_rank() {
    // Its buffer stays mapped by the others after it dies: the board, not a failed read, tells.
    let names: [&[&str]; 3] = [&["all_gather", "single copy"]; 3];
    survivors_fail("kill-gather-shared", &names);
}

/// Rank 1 of 4 dies in `scenario`: every other rank fails, on its own (not killed by the
/// launcher) and well within the deadline, the error of rank 0, 2 and 3 naming each of
/// `names[0]`, `[1]` and `[2]`.
fn survivors_fail(scenario: &str, names: &[&[&str]; 3]) {
    let t = Instant::now();
    // A long deadline: the survivors must notice the death itself, not time out.
    let env = [("RINGZERO_TRANSPORT", "shm"), ("RINGZERO_TIMEOUT", "60")];
    let (o, lines) = run(4, 1, scenario, &env, Duration::from_secs(30));
    assert_eq!(o.first_failure, Some(1), "{lines:#?}");
    for (r, names) in [0, 2, 3].into_iter().zip(names) {
        let e = &o.exits[r];
        assert!(!e.killed_by_launcher, "rank {r} did not notice\n{lines:#?}");
        assert_eq!(e.status.code(), Some(3), "rank {r}: {lines:#?}");
        assert!(
            lines.iter().any(|(q, l)| *q == r
                && l.contains("failed in iteration")
                && names.iter().all(|w| l.contains(w))),
            "rank {r} names {names:?}: {lines:#?}"
        );
    }
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "took {:?}",
        t.elapsed()
    );
}

/// Threads of this process.
fn threads_now() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("Threads:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Rank 1 opens 400 idle connections to rank 0's store port (unauthenticated, saying nothing)
/// while the job runs; rank 0's threads stay within the handshake bound, and the job's
/// all-reduces and a split (which the store serves) still come out right.
fn flood_scenario() -> i32 {
    let comm = Communicator::from_env().unwrap();
    let (rank, n) = (comm.rank(), comm.size());
    let before = threads_now();
    comm.barrier().unwrap();
    let mut flood = Vec::new();
    if rank == 1 {
        let port: u16 = std::env::var("RINGZERO_MASTER_PORT")
            .unwrap()
            .parse()
            .unwrap();
        for _ in 0..400 {
            if let Ok(s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
                flood.push(s);
            }
        }
    }
    comm.barrier().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let during = threads_now();
    let mut v = vec![rank as f32 + 1.0; 4096];
    comm.all_reduce(InPlace, &mut v, ReduceOp::Sum).unwrap();
    let want = (n * (n + 1) / 2) as f32;
    assert!(v.iter().all(|x| *x == want), "rank {rank}: {}", v[0]);
    let sub = comm
        .split(Some(0), rank as u32)
        .unwrap()
        .expect("in color 0");
    let mut w = vec![1i32; 16];
    sub.all_reduce(InPlace, &mut w, ReduceOp::Sum).unwrap();
    assert_eq!(w, [n as i32; 16]);
    drop(flood);
    println!("flood threads {before} {during}");
    0
}

#[test]
fn a_connection_flood_bounds_the_threads_and_changes_no_result() {
    let (o, lines) = run(2, 1, "flood", &[], Duration::from_secs(5));
    assert_eq!(o.first_failure, None, "{lines:#?}");
    let counts: Vec<(usize, usize)> = lines
        .iter()
        .filter(|(r, _)| *r == 0)
        .filter_map(|(_, l)| {
            let mut w = l.strip_prefix("flood threads ")?.split(' ');
            Some((w.next()?.parse().ok()?, w.next()?.parse().ok()?))
        })
        .collect();
    let [(before, during)] = counts[..] else {
        panic!("{lines:#?}");
    };
    // 400 connections: at most MAX_HANDSHAKES (64) are being authenticated at once.
    assert!(
        during <= before + 64 + 8,
        "{before} threads before the flood, {during} during"
    );
}

#[test]
fn a_rank_killed_while_training_with_offloaded_state_fails_the_others_and_they_clean_up() {
    let t = Instant::now();
    let dir = fresh_dir("kill-offload");
    let d = dir.to_string_lossy().into_owned();
    let env = [
        ("RINGZERO_TIMEOUT", "60"),
        ("RINGZERO_TEST_DIR", d.as_str()),
    ];
    let (o, lines) = run(3, 1, "kill-offload", &env, Duration::from_secs(30));
    assert_eq!(o.first_failure, Some(1), "{lines:#?}");
    for r in [0, 2] {
        let e = &o.exits[r];
        assert!(!e.killed_by_launcher, "rank {r} did not notice\n{lines:#?}");
        assert_eq!(e.status.code(), Some(3), "rank {r}: {lines:#?}");
        assert!(
            lines
                .iter()
                .any(|(q, l)| *q == r && l.contains("failed in step") && l.contains("rank 1")),
            "{lines:#?}"
        );
    }
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "took {:?}",
        t.elapsed()
    );
    // Only the killed rank's swap file is left (it could not remove it).
    let left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        left.len() == 1 && left[0].starts_with("ringzero-swap-optimizer-rank1-"),
        "{left:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
