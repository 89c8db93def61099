//! Probes in child processes under a watchdog: a probe that hangs is killed and reported as HANG;
//! data that comes back wrong is WRONG_DATA with the pattern seen. The child is this same binary
//! (`ringzero diag-probe KIND`), which prints one JSON line with its result.
//!
//! Probes without a GPU: ringzero's own ring over shared memory and over loopback TCP (two ranks as
//! threads in the child), streaming patterned data (never zeros) and checking every byte, then an
//! all-reduce checked exactly. `hang` exists to test the watchdog.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ringzero_collectives::{Collectives, Communicator, Config, InPlace, ReduceOp, TransportPref};
use serde::{Deserialize, Serialize};

/// How a probe ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[allow(non_camel_case_types)]
pub enum ProbeStatus {
    /// Data arrived intact.
    OK,
    /// Data arrived wrong.
    WRONG_DATA,
    /// The child did not finish before the watchdog fired.
    HANG,
    /// The child failed (error, crash).
    FAILED,
}

/// One probe's result.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ProbeResult {
    /// Which probe.
    pub name: String,
    /// How it ended.
    pub status: ProbeStatus,
    /// Streaming bandwidth per link, GB/s, when it ran.
    pub gbs: Option<f64>,
    /// What was seen.
    pub detail: String,
    /// A ring probe whose edge fell back from peer copies to host staging: why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fell_back: Option<String>,
    /// The CUDA inventory (the `cuda-inventory` probe).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda: Option<super::cuda::inventory::CudaInventory>,
}

impl ProbeResult {
    /// A result with no CUDA extras.
    pub fn new(
        name: impl Into<String>,
        status: ProbeStatus,
        gbs: Option<f64>,
        detail: impl Into<String>,
    ) -> ProbeResult {
        ProbeResult {
            name: name.into(),
            status,
            gbs,
            detail: detail.into(),
            fell_back: None,
            cuda: None,
        }
    }
}

/// What a watched child did.
#[derive(Debug)]
pub enum Watched {
    /// It exited; its stdout and exit code.
    Exited(String, Option<i32>),
    /// The watchdog killed it after the timeout.
    Hung,
}

/// Run `cmd`, killing it (and what it started) if it has not exited after `timeout`.
pub fn watchdog(mut cmd: Command, timeout: Duration) -> std::io::Result<Watched> {
    use std::os::unix::process::CommandExt;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .process_group(0);
    let mut child = cmd.spawn()?;
    let mut out = child.stdout.take().expect("piped");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Watched::Exited(
                reader.join().unwrap_or_default(),
                status.code(),
            ));
        }
        if Instant::now() >= deadline {
            if let Some(pid) = rustix::process::Pid::from_raw(child.id() as i32) {
                let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
            }
            let _ = child.kill();
            let _ = child.wait();
            return Ok(Watched::Hung);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Run probe `name` in a child of `exe` under the watchdog.
pub fn run(exe: &std::path::Path, name: &str, timeout: Duration) -> ProbeResult {
    let mut cmd = Command::new(exe);
    cmd.args(["diag-probe", name]);
    for v in [
        "RINGZERO_RANK",
        "RANK",
        "SLURM_PROCID",
        "OMPI_COMM_WORLD_RANK",
    ] {
        cmd.env_remove(v);
    }
    let failed = |detail: String| ProbeResult::new(name, ProbeStatus::FAILED, None, detail);
    match watchdog(cmd, timeout) {
        Ok(Watched::Hung) => ProbeResult::new(
            name,
            ProbeStatus::HANG,
            None,
            format!(
                "no result after {:.1}s; the probe process was killed",
                timeout.as_secs_f64()
            ),
        ),
        Ok(Watched::Exited(out, code)) => match out
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str::<ProbeResult>(l).ok())
        {
            Some(r) => r,
            None => failed(format!("the probe exited ({code:?}) without a result")),
        },
        Err(e) => failed(format!("could not start the probe: {e}")),
    }
}

/// The byte rank `rank` sends at position `i`: a pattern that is never zero.
pub fn pattern(rank: usize, i: usize) -> u8 {
    let h = (i as u32)
        .wrapping_mul(2_654_435_761)
        .wrapping_add(rank as u32 * 0x9e37);
    (h >> 24) as u8 % 255 + 1
}

/// The child side of a probe without a GPU (`shm`, `tcp`, `hang`): its result, or `None` for
/// another name.
pub fn host_child(name: &str) -> Option<ProbeResult> {
    match name {
        "hang" => loop {
            std::thread::sleep(Duration::from_secs(3600));
        },
        "shm" => Some(ring(name, TransportPref::Shm)),
        "tcp" => Some(ring(name, TransportPref::Tcp)),
        _ => None,
    }
}

fn ring(name: &str, transport: TransportPref) -> ProbeResult {
    const BYTES: usize = 8 << 20;
    let port = match std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()) {
        Ok(a) => a.port(),
        Err(e) => return ProbeResult::new(name, ProbeStatus::FAILED, None, e.to_string()),
    };
    let results: Vec<Result<(f64, Option<String>), String>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                s.spawn(move || -> Result<(f64, Option<String>), String> {
                    let mut cfg = Config::new(rank, 2, "127.0.0.1", port);
                    cfg.transport = transport;
                    cfg.timeout = Duration::from_secs(10);
                    let comm = Communicator::init(cfg).map_err(|e| e.to_string())?;
                    let send: Vec<u8> = (0..BYTES).map(|i| pattern(rank, i)).collect();
                    let mut recv = vec![0u8; BYTES];
                    comm.ring_shift(&send, &mut recv)
                        .map_err(|e| e.to_string())?;
                    let t = Instant::now();
                    for _ in 0..3 {
                        comm.ring_shift(&send, &mut recv)
                            .map_err(|e| e.to_string())?;
                    }
                    let gbs = 3.0 * BYTES as f64 / t.elapsed().as_secs_f64() / 1e9;
                    let prev = 1 - rank;
                    let bad = (0..BYTES).find(|&i| recv[i] != pattern(prev, i)).map(|i| {
                        format!(
                            "byte {i} from rank {prev}: expected {:#04x}, got {:#04x}",
                            pattern(prev, i),
                            recv[i]
                        )
                    });
                    // ringzero's own all-reduce on exact values.
                    let mut x: Vec<f32> =
                        (0..4096).map(|i| (i % 13) as f32 + rank as f32).collect();
                    comm.all_reduce(InPlace, &mut x, ReduceOp::Sum)
                        .map_err(|e| e.to_string())?;
                    let bad = bad.or_else(|| {
                        (0..x.len())
                            .find(|&i| x[i] != 2.0 * (i % 13) as f32 + 1.0)
                            .map(|i| format!("all-reduce element {i} is {}", x[i]))
                    });
                    Ok((gbs, bad))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("rank thread panicked".into()))
            })
            .collect()
    });
    let mut gbs = f64::INFINITY;
    for r in &results {
        match r {
            Err(e) => return ProbeResult::new(name, ProbeStatus::FAILED, None, e.clone()),
            Ok((g, Some(bad))) => {
                return ProbeResult::new(name, ProbeStatus::WRONG_DATA, Some(*g), bad.clone())
            }
            Ok((g, None)) => gbs = gbs.min(*g),
        }
    }
    ProbeResult::new(
        name,
        ProbeStatus::OK,
        Some(gbs),
        format!(
            "2 ranks streamed {} MiB of patterned data each way, every byte checked",
            BYTES >> 20
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watchdog_kills_a_child_that_hangs() {
        let t = Instant::now();
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "sleep 60"]);
        assert!(matches!(
            watchdog(cmd, Duration::from_millis(300)).unwrap(),
            Watched::Hung
        ));
        assert!(t.elapsed() < Duration::from_secs(5));
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo done"]);
        assert!(
            matches!(watchdog(cmd, Duration::from_secs(5)).unwrap(), Watched::Exited(s, Some(0)) if s == "done\n")
        );
    }

    #[test]
    fn the_pattern_is_never_zero() {
        assert!((0..100_000).all(|i| pattern(0, i) != 0 && pattern(1, i) != 0));
        assert!((0..1000).any(|i| pattern(0, i) != pattern(1, i)));
    }
}
