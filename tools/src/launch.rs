//! `ringzero launch -n N [--nodes K] -- CMD ARGS...`: run N ranks of CMD on this host.
//!
//! Every rank gets `RINGZERO_RANK`, `RINGZERO_WORLD_SIZE`, `RINGZERO_LOCAL_RANK`,
//! `RINGZERO_LOCAL_WORLD_SIZE`, `RINGZERO_MASTER_ADDR`/`_PORT`, a fresh `RINGZERO_SECRET` and
//! `RINGZERO_JOB_ID`. With `--nodes K` the ranks are split into K contiguous fake nodes, each with
//! its own `RINGZERO_NODE_ID`, so edges between them use TCP and edges inside use shared memory.
//!
//! Each output line is prefixed with `[rank R]`. When a rank fails (non-zero exit or signal), the
//! launcher names it, gives the others a grace period to report their own errors (they notice the
//! dead peer within their deadline), then terminates whoever is left, and exits non-zero. With a
//! dump directory, the ranks write their flight records there (`RINGZERO_DUMP_DIR`), and a failed
//! job's last message says how to join them (`ringzero diag --flight DIR`).

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What to launch.
#[derive(Clone, Debug)]
pub struct LaunchSpec {
    /// Number of ranks.
    pub ranks: usize,
    /// Number of fake nodes (1: all ranks on this node).
    pub nodes: usize,
    /// Program to run.
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Extra environment for every rank.
    pub env: Vec<(String, String)>,
    /// How long survivors get to exit on their own after a rank fails.
    pub grace: Duration,
    /// Where the ranks write their flight records (`RINGZERO_DUMP_DIR`), if anywhere.
    pub dump_dir: Option<DumpDir>,
}

/// The directory the ranks' flight records go to.
#[derive(Clone, Debug)]
pub struct DumpDir {
    /// The directory (created if missing).
    pub path: std::path::PathBuf,
    /// Remove it when every rank succeeded (a directory made for this job); otherwise it is
    /// kept, and a failed job's message points to it.
    pub remove_on_success: bool,
}

/// Where ranks' output lines go.
#[derive(Clone)]
pub enum Output {
    /// The launcher's stdout/stderr, prefixed.
    Inherit,
    /// Collected (tests): `(rank, line)`.
    Capture(Arc<Mutex<Vec<(usize, String)>>>),
    /// Rank 0 writes straight to the launcher's terminal (its progress bar stays live); the other
    /// ranks' lines are prefixed. For tools whose rank 0 does the reporting (`ringzero bench`).
    RankZeroPlain,
}

/// How one rank ended.
#[derive(Clone, Debug)]
pub struct RankExit {
    /// The rank.
    pub rank: usize,
    /// Its exit status.
    pub status: ExitStatus,
    /// Whether the launcher had to terminate it.
    pub killed_by_launcher: bool,
}

/// How the job ended.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// Every rank's exit, by rank.
    pub exits: Vec<RankExit>,
    /// The first rank seen failing, if any.
    pub first_failure: Option<usize>,
    /// The signal that interrupted the launcher ([`launch_interruptible`]), if one did.
    pub interrupted: Option<i32>,
}

impl Outcome {
    /// The launcher's exit code: 128 + the signal that interrupted it, else 0, or the first
    /// failed rank's code (128 + signal if killed).
    pub fn exit_code(&self) -> i32 {
        if let Some(sig) = self.interrupted {
            return 128 + sig;
        }
        match self.first_failure {
            None => 0,
            Some(r) => {
                let s = self.exits[r].status;
                s.code()
                    .filter(|c| *c != 0)
                    .unwrap_or_else(|| 128 + s.signal().unwrap_or(1))
            }
        }
    }
}

/// Describe an exit status in words.
pub fn describe(s: ExitStatus) -> String {
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(sig)) => format!("signal {sig}"),
        _ => "unknown status".into(),
    }
}

/// The fake node of `rank` when `ranks` are split into `nodes` contiguous groups.
pub fn node_of(rank: usize, ranks: usize, nodes: usize) -> usize {
    rank * nodes / ranks
}

fn say(out: &Output, msg: &str) {
    match out {
        Output::Inherit | Output::RankZeroPlain => crate::eline!("ringzero launch: {msg}"),
        Output::Capture(v) => v.lock().unwrap().push((usize::MAX, msg.to_string())),
    }
}

/// Run the job to completion.
pub fn launch(spec: &LaunchSpec, out: Output) -> std::io::Result<Outcome> {
    launch_with(spec, out, None)
}

/// [`launch`] for a process that is the launcher and nothing else (`ringzero launch`): it also
/// acts on signals. SIGUSR1 asks every rank for its flight records and the job goes on (what a
/// hung job's ranks are doing, for `ringzero diag --flight`, before any deadline); SIGINT
/// (Ctrl-C) or SIGTERM asks for them too, gives the ranks up to [`RECORDS_WAIT`] to write them,
/// then stops the job (a second one kills it at once). Only ranks that said they write records
/// on SIGUSR1 (a ringzero communicator with `RINGZERO_DUMP_ON_SIGUSR1=1`, which the launcher
/// sets, leaves a marker in the dump directory) are sent it: its default action kills a process.
/// The handlers stay installed after the job (the process is about to exit). (Ranks write
/// their records on the SIGTERM that stops them too where `RINGZERO_DUMP_ON_SIGTERM=1` is in
/// the launcher's environment, which they inherit: it is not set for them, since it ends a
/// process whose program would handle SIGTERM itself.)
pub fn launch_interruptible(spec: &LaunchSpec, out: Output) -> std::io::Result<Outcome> {
    use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1};
    let signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGUSR1])?;
    launch_with(spec, out, Some(signals))
}

/// How long an interrupted launcher waits for the ranks' flight records before stopping them.
pub const RECORDS_WAIT: Duration = Duration::from_secs(2);

/// Send SIGUSR1 to every process of the job that writes its flight records on it (its marker is
/// in `dir`: a rank's communicator, under whatever wrapper started it); how many were asked.
fn ask_for_records((dir, job): (&std::path::Path, &str)) -> usize {
    crate::job_procs::writing_records(dir, job)
        .into_iter()
        .filter(|pid| rustix::process::kill_process(*pid, rustix::process::Signal::USR1).is_ok())
        .count()
}

/// Ranks with a record in `dir` taken at or after `since_us` (Unix microseconds).
fn ranks_recorded_since(dir: &std::path::Path, since_us: u64) -> std::collections::BTreeSet<usize> {
    ringzero_collectives::flight::read_dir(dir)
        .map(|recs| {
            recs.iter()
                .filter(|r| r.taken_unix_us >= since_us)
                .map(|r| r.rank)
                .collect()
        })
        .unwrap_or_default()
}

fn unix_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// What every rank of one job shares: the store's port, the job's secret and id, this host.
struct Job {
    port: u16,
    secret: String,
    id: String,
    host: String,
    /// Where the ranks keep their shared memory (swept when the job ends).
    shm_dir: std::path::PathBuf,
}

/// The job's ranks while they run: each one's exit once seen (and whether the launcher stopped
/// it), the rank blamed for the failure, and the clock of the stop.
struct Supervisor {
    status: Vec<Option<(ExitStatus, bool)>>,
    first_failure: Option<usize>,
    failed_at: Option<Instant>,
    termed_at: Option<Instant>,
    /// The signal that interrupted the launcher, when, and the records asked for then: (rank
    /// count, Unix microseconds).
    interrupted: Option<(i32, Instant, usize, u64)>,
    /// The ranks found stopped (SIGSTOP, a debugger) when the survivors were terminated.
    stopped: std::collections::BTreeSet<usize>,
    /// SIGKILL passes made over the job's processes.
    kill_passes: u128,
}

fn launch_with(
    spec: &LaunchSpec,
    out: Output,
    mut signals: Option<signal_hook::iterator::Signals>,
) -> std::io::Result<Outcome> {
    let job = prepare(spec)?;
    let (mut children, readers) = spawn_ranks(spec, &job, &out)?;
    let mut sup = Supervisor {
        status: vec![None; spec.ranks],
        first_failure: None,
        failed_at: None,
        termed_at: None,
        interrupted: None,
        stopped: Default::default(),
        kill_passes: 0,
    };
    while sup.status.iter().any(Option::is_none) {
        let pending = signals
            .as_mut()
            .map(|s| s.pending().collect::<Vec<_>>())
            .unwrap_or_default();
        for sig in pending {
            sup.on_signal(sig, spec, &job, &children, &out);
        }
        sup.records_written(spec);
        sup.reap(&mut children, &out, spec)?;
        sup.escalate(&children, &out, (spec, &job.id));
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(finish(spec, &job, &children, readers, sup, &out))
}

/// Check the spec, pick the store's port and the job's secret and id, make the dump directory.
fn prepare(spec: &LaunchSpec) -> std::io::Result<Job> {
    let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, m);
    if spec.ranks == 0 {
        return Err(invalid("-n must be at least 1".into()));
    }
    if spec.nodes == 0 || spec.nodes > spec.ranks {
        return Err(invalid(format!(
            "--nodes {} must be between 1 and the number of ranks ({})",
            spec.nodes, spec.ranks
        )));
    }
    let (shm_dir, link_bytes) = rank_links(spec);
    let machine = crate::capacity::Machine::here(&shm_dir);
    crate::capacity::check(spec.ranks, link_bytes, &machine).map_err(invalid)?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let hex = |b: &[u8]| b.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let (secret, id) = (
        hex(&rand::random::<[u8; 32]>()),
        hex(&rand::random::<[u8; 8]>()),
    );
    if let Some(d) = &spec.dump_dir {
        std::fs::create_dir_all(&d.path).map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!(
                    "creating the flight record directory {}: {e}",
                    d.path.display()
                ),
            )
        })?;
    }
    let host = rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned();
    Ok(Job {
        port,
        secret,
        id,
        host,
        shm_dir,
    })
}

/// Where the ranks' shared memory goes and how much of it each rank's receive link reserves:
/// `RINGZERO_SHM_DIR`, `RINGZERO_SLOTS` × `RINGZERO_SLICE_BYTES` as the ranks will read them (the
/// spec's environment first, then the launcher's), or the defaults.
fn rank_links(spec: &LaunchSpec) -> (std::path::PathBuf, u64) {
    use ringzero_collectives::config as c;
    let var = |key: &str| {
        let given = spec.env.iter().rev().find(|(k, _)| k == key);
        given
            .map(|(_, v)| v.clone())
            .or_else(|| std::env::var(key).ok())
    };
    let dir = var("RINGZERO_SHM_DIR").unwrap_or_else(|| "/dev/shm".into());
    let slots = var("RINGZERO_SLOTS").and_then(|v| v.trim().parse().ok());
    let slice = var("RINGZERO_SLICE_BYTES").and_then(|v| c::parse_bytes(&v));
    let bytes =
        slots.unwrap_or(c::DEFAULT_SLOTS) as u64 * slice.unwrap_or(c::DEFAULT_SLICE_BYTES) as u64;
    (dir.into(), bytes)
}

/// The command that starts `rank`: the program with the launcher environment, in a process
/// group of its own, ended by SIGTERM if the launcher dies.
fn rank_command(spec: &LaunchSpec, job: &Job, rank: usize, out: &Output) -> Command {
    let node = node_of(rank, spec.ranks, spec.nodes);
    let on_node: Vec<usize> = (0..spec.ranks)
        .filter(|r| node_of(*r, spec.ranks, spec.nodes) == node)
        .collect();
    let local_rank = on_node.iter().position(|r| *r == rank).unwrap();
    let mut cmd = Command::new(&spec.program);
    cmd.args(&spec.args)
        .env("RINGZERO_RANK", rank.to_string())
        .env("RINGZERO_WORLD_SIZE", spec.ranks.to_string())
        .env("RINGZERO_LOCAL_RANK", local_rank.to_string())
        .env("RINGZERO_LOCAL_WORLD_SIZE", on_node.len().to_string())
        .env("RINGZERO_MASTER_ADDR", "127.0.0.1")
        .env("RINGZERO_MASTER_PORT", job.port.to_string())
        .env("RINGZERO_SECRET", &job.secret)
        .env("RINGZERO_JOB_ID", &job.id)
        .stdin(Stdio::null());
    if matches!(out, Output::RankZeroPlain) && rank == 0 {
        cmd.stdout(Stdio::inherit()).stderr(Stdio::inherit());
    } else {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    }
    if spec.nodes > 1 {
        cmd.env("RINGZERO_NODE_ID", format!("{}/fake-node-{node}", job.host));
    }
    if let Some(d) = &spec.dump_dir {
        cmd.env("RINGZERO_DUMP_DIR", &d.path);
        cmd.env("RINGZERO_DUMP_ON_SIGUSR1", "1");
    }
    for (k, v) in &spec.env {
        cmd.env(k, v);
    }
    // Each rank leads its own process group, so stopping a rank stops what it started too; and
    // each rank gets SIGTERM if the launcher dies (Ctrl-C), so no rank outlives the job.
    cmd.process_group(0);
    // SAFETY: the closure runs in the child between fork and exec; it makes one prctl system
    // call, which is async-signal-safe, and allocates nothing.
    unsafe {
        cmd.pre_exec(|| {
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::TERM))
                .map_err(std::io::Error::from)
        });
    }
    cmd
}

/// Start every rank, with a thread per piped output that prefixes its lines; if one cannot
/// start, the ones started are killed.
fn spawn_ranks(
    spec: &LaunchSpec,
    job: &Job,
    out: &Output,
) -> std::io::Result<(Vec<Child>, Vec<std::thread::JoinHandle<()>>)> {
    let mut children: Vec<Child> = Vec::with_capacity(spec.ranks);
    let mut readers = Vec::new();
    for rank in 0..spec.ranks {
        let mut child = match rank_command(spec, job, rank, out).spawn() {
            Ok(c) => c,
            Err(e) => {
                for c in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(std::io::Error::new(
                    e.kind(),
                    format!("starting rank {rank} ({:?}): {e}", spec.program),
                ));
            }
        };
        if let Some(o) = child.stdout.take() {
            readers.push(pump(o, rank, false, out.clone()));
        }
        if let Some(e) = child.stderr.take() {
            readers.push(pump(e, rank, true, out.clone()));
        }
        children.push(child);
    }
    Ok((children, readers))
}

impl Supervisor {
    /// A signal to the launcher: SIGUSR1 asks every rank for its flight record and goes on; the
    /// first other signal asks for the records and stops the job; a second kills every rank.
    fn on_signal(
        &mut self,
        sig: i32,
        spec: &LaunchSpec,
        job: &Job,
        children: &[Child],
        out: &Output,
    ) {
        let dir = spec.dump_dir.as_ref().map(|d| d.path.as_path());
        let (since, asked) = (unix_us(), dir.map_or(0, |d| ask_for_records((d, &job.id))));
        let place = dir.map_or("nowhere (no dump directory)".into(), |d| {
            d.display().to_string()
        });
        if sig == signal_hook::consts::SIGUSR1 {
            say(
                out,
                &format!(
                    "SIGUSR1: asked {asked} of {} ranks for their flight records \
                ({place}; `ringzero diag --flight` joins them); the job goes on",
                    spec.ranks
                ),
            );
        } else if self.interrupted.is_none() {
            say(
                out,
                &format!(
                    "interrupted (signal {sig}): asked {asked} of {} ranks for \
                their flight records ({place}), stopping the job",
                    spec.ranks
                ),
            );
            self.interrupted = Some((sig, Instant::now(), asked, since));
        } else {
            say(out, &format!("signal {sig} again: killing every rank"));
            let leaders: Vec<u32> = children.iter().map(Child::id).collect();
            crate::job_procs::signal_all(&leaders, &job.id, rustix::process::Signal::KILL);
        }
    }

    /// Interrupted: stop the ranks once every rank asked has written its record (or after the
    /// wait); they end as a failed job's survivors do.
    fn records_written(&mut self, spec: &LaunchSpec) {
        if let (Some((_, at, asked, since)), None) = (self.interrupted, self.termed_at) {
            let written = spec
                .dump_dir
                .as_ref()
                .map_or(0, |d| ranks_recorded_since(&d.path, since).len());
            if written >= asked || at.elapsed() >= RECORDS_WAIT {
                self.failed_at.get_or_insert_with(Instant::now);
            }
        }
    }

    /// The ranks that exited since the last look, failed ones listed.
    fn exited(&mut self, children: &mut [Child], by_launcher: bool) -> std::io::Result<Vec<usize>> {
        let mut failed = Vec::new();
        for (rank, c) in children.iter_mut().enumerate() {
            if self.status[rank].is_none() {
                if let Some(s) = c.try_wait()? {
                    self.status[rank] = Some((s, by_launcher));
                    if !s.success() {
                        failed.push(rank);
                    }
                }
            }
        }
        Ok(failed)
    }

    /// Record the ranks that exited; at the first failure (not an interruption), blame one rank
    /// and start the others' grace period.
    fn reap(
        &mut self,
        children: &mut [Child],
        out: &Output,
        spec: &LaunchSpec,
    ) -> std::io::Result<()> {
        let mut failed_now = self.exited(children, self.termed_at.is_some())?;
        if self.first_failure.is_some() || failed_now.is_empty() || self.interrupted.is_some() {
            return Ok(());
        }
        // The ranks that notice a dead peer exit within milliseconds of it, and one pass may see
        // several exits. Look once more after a moment, then blame a rank that died by a signal
        // (ranks reacting to a failure exit with an error code) before one that exited.
        std::thread::sleep(Duration::from_millis(30));
        failed_now.extend(self.exited(children, false)?);
        let signalled = failed_now
            .iter()
            .copied()
            .find(|r| self.status[*r].unwrap().0.signal().is_some());
        let rank = signalled.unwrap_or(failed_now[0]);
        self.first_failure = Some(rank);
        self.failed_at = Some(Instant::now());
        say(
            out,
            &format!(
                "rank {rank} failed ({}); giving the other ranks {:.1}s to stop",
                describe(self.status[rank].unwrap().0),
                spec.grace.as_secs_f64()
            ),
        );
        Ok(())
    }

    /// After the grace period, SIGTERM to every rank's process tree (its group, and every process
    /// of job `job`); 2 s later, SIGKILL to them.
    fn escalate(&mut self, children: &[Child], out: &Output, (spec, job): (&LaunchSpec, &str)) {
        if let (Some(t), None) = (self.failed_at, self.termed_at) {
            // An interrupted job's ranks had their wait for the records.
            let grace = if self.interrupted.is_some() {
                Duration::ZERO
            } else {
                spec.grace
            };
            if t.elapsed() >= grace {
                self.termed_at = Some(Instant::now());
                // A rank that froze rather than failed: what its peers' timeouts are about.
                self.stopped = crate::job_procs::stopped_ranks(job);
                for rank in (0..children.len()).filter(|r| self.status[*r].is_none()) {
                    say(out, &format!("terminating rank {rank}"));
                }
                // The whole tree: a wrapper's children go too, not only the wrapper.
                let leaders: Vec<u32> = children.iter().map(Child::id).collect();
                crate::job_procs::signal_all(&leaders, job, rustix::process::Signal::TERM);
            }
        }
        if let Some(t) = self.termed_at {
            // Then SIGKILL, again every 200 ms (each pass reads /proc) until every rank is gone.
            let since = t.elapsed();
            let pass = since.saturating_sub(Duration::from_secs(2)).as_millis() / 200;
            if since >= Duration::from_secs(2) && self.kill_passes <= pass {
                self.kill_passes = pass + 1;
                let leaders: Vec<u32> = children.iter().map(Child::id).collect();
                crate::job_procs::signal_all(&leaders, job, rustix::process::Signal::KILL);
            }
        }
    }
}

/// Every rank has exited: drain their output, remove their markers, say how the job ended and
/// where its flight records are (or remove an unneeded dump directory).
fn finish(
    spec: &LaunchSpec,
    job: &Job,
    children: &[Child],
    readers: Vec<std::thread::JoinHandle<()>>,
    sup: Supervisor,
    out: &Output,
) -> Outcome {
    // Nothing a rank started outlives the job: whatever is left of the ranks' trees (a wrapper's
    // children, background processes, what left the group) is killed.
    let leaders: Vec<u32> = children.iter().map(Child::id).collect();
    let left = crate::job_procs::signal_all(&leaders, &job.id, rustix::process::Signal::KILL);
    if left > 0 {
        say(
            out,
            &format!("killed {left} process(es) the ranks had started and left running"),
        );
    }
    // Nor does its shared memory: a rank killed between creating a segment and its peer's
    // attach leaves it behind.
    let segments = ringzero_collectives::internals::transport::shm::segments::sweep(
        &job.shm_dir,
        Some(&job.id),
        Duration::ZERO,
    );
    if !segments.is_empty() {
        say(
            out,
            &format!(
                "removed {} shared-memory file(s) the ranks left in {}",
                segments.len(),
                job.shm_dir.display()
            ),
        );
    }
    // Output still buffered in the pipes is drained; a grandchild that kept a pipe open does not
    // hold the launcher.
    let drain = Instant::now() + Duration::from_secs(2);
    while readers.iter().any(|r| !r.is_finished()) && Instant::now() < drain {
        std::thread::sleep(Duration::from_millis(5));
    }
    for r in readers.into_iter().filter(|r| r.is_finished()) {
        let _ = r.join();
    }
    let exits: Vec<RankExit> = sup
        .status
        .into_iter()
        .enumerate()
        .map(|(rank, s)| {
            let (status, killed_by_launcher) = s.expect("all ranks exited");
            RankExit {
                rank,
                status,
                killed_by_launcher,
            }
        })
        .collect();
    // The ranks' SIGUSR1 markers go with them.
    if let Some(d) = &spec.dump_dir {
        for (marker, _) in crate::job_procs::markers(&d.path, &job.id) {
            let _ = std::fs::remove_file(marker);
        }
    }
    let (first_failure, stopped) = (sup.first_failure, sup.stopped.clone());
    let outcome = Outcome {
        exits,
        first_failure,
        interrupted: sup.interrupted.map(|(sig, ..)| sig),
    };
    if let Some(r) = first_failure {
        let frozen = match stopped.iter().map(usize::to_string).collect::<Vec<_>>() {
            v if v.is_empty() => String::new(),
            v => format!(
                "; rank {} was stopped (SIGSTOP, or held by a debugger) and stopped answering: \
                 the others' timeouts point at it",
                v.join(", rank ")
            ),
        };
        say(
            out,
            &format!(
                "job failed: rank {r} exited first with {}{frozen}",
                describe(outcome.exits[r].status)
            ),
        );
    }
    if let Some(d) = &spec.dump_dir {
        tell_records(spec, d, &outcome, out);
    }
    outcome
}

/// Where the flight records of an interrupted or failed job are; a succeeded job's directory
/// of its own is removed.
fn tell_records(spec: &LaunchSpec, d: &DumpDir, outcome: &Outcome, out: &Output) {
    if let Some(sig) = outcome.interrupted {
        let ranks = ranks_recorded_since(&d.path, 0);
        say(
            out,
            &format!(
                "interrupted by signal {sig}: flight records of {} of {} ranks are in {}: \
                 `ringzero diag --flight {}` shows what each rank was doing",
                ranks.len(),
                spec.ranks,
                d.path.display(),
                d.path.display()
            ),
        );
    } else if outcome.first_failure.is_some() {
        let ranks: std::collections::BTreeSet<usize> =
            ringzero_collectives::flight::read_dir(&d.path)
                .map(|recs| recs.iter().map(|r| r.rank).collect())
                .unwrap_or_default();
        if !ranks.is_empty() {
            say(
                out,
                &format!(
                    "flight records of {} of {} ranks are in {}: `ringzero diag --flight {}` \
                     names the rank that broke the job",
                    ranks.len(),
                    spec.ranks,
                    d.path.display(),
                    d.path.display()
                ),
            );
        }
    } else if d.remove_on_success {
        let _ = std::fs::remove_dir_all(&d.path);
    }
}

fn pump(
    stream: impl Read + Send + 'static,
    rank: usize,
    is_err: bool,
    out: Output,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut r = BufReader::new(stream);
        let mut line = Vec::new();
        loop {
            line.clear();
            match r.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let text = String::from_utf8_lossy(&line);
            let text = text.trim_end_matches(['\n', '\r']);
            match &out {
                Output::Inherit | Output::RankZeroPlain if is_err => {
                    crate::console::err_line(&format!("[rank {rank}] {text}"));
                }
                Output::Inherit | Output::RankZeroPlain => {
                    crate::console::out_line(&format!("[rank {rank}] {text}"));
                }
                Output::Capture(v) => v.lock().unwrap().push((rank, text.to_string())),
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_are_contiguous_and_balanced() {
        let nodes: Vec<usize> = (0..5).map(|r| node_of(r, 5, 2)).collect();
        assert_eq!(nodes, vec![0, 0, 0, 1, 1]);
        assert!((0..8).all(|r| node_of(r, 8, 1) == 0));
    }

    #[test]
    fn bad_specs_are_refused_before_anything_starts() {
        let spec = LaunchSpec {
            ranks: 2,
            nodes: 3,
            program: "true".into(),
            args: vec![],
            env: vec![],
            grace: Duration::ZERO,
            dump_dir: None,
        };
        let e = launch(&spec, Output::Inherit).unwrap_err();
        assert!(e.to_string().contains("--nodes 3"), "{e}");
        let e = launch(
            &LaunchSpec {
                ranks: 1,
                program: "/nonexistent/prog".into(),
                nodes: 1,
                ..spec
            },
            Output::Inherit,
        )
        .unwrap_err();
        assert!(e.to_string().contains("starting rank 0"), "{e}");
    }

    #[test]
    fn a_failing_rank_is_named_and_the_rest_are_stopped() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let spec = LaunchSpec {
            ranks: 3,
            nodes: 1,
            program: "sh".into(),
            args: vec![
                "-c".into(),
                "echo hi from $RINGZERO_RANK; if [ $RINGZERO_RANK = 1 ]; then exit 7; fi; sleep 30"
                    .into(),
            ],
            env: vec![],
            grace: Duration::from_millis(100),
            dump_dir: None,
        };
        let t = Instant::now();
        let o = launch(&spec, Output::Capture(log.clone())).unwrap();
        assert!(t.elapsed() < Duration::from_secs(10));
        assert_eq!(o.first_failure, Some(1));
        assert_eq!(o.exit_code(), 7);
        assert!(o.exits[0].killed_by_launcher && o.exits[2].killed_by_launcher);
        let log = log.lock().unwrap();
        assert!(log.contains(&(2, "hi from 2".to_string())));
        assert!(log
            .iter()
            .any(|(r, l)| *r == usize::MAX && l.contains("rank 1 exited first with exit code 7")));
    }
}
