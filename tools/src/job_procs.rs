//! The processes of one launched job, wherever they went: every rank leads a process group of its
//! own, and every process a rank starts inherits the job's `RINGZERO_JOB_ID`, so the launcher
//! finds a rank's whole tree — what a wrapper such as `sh -c "ringzero bench ...; echo done"`
//! started, and what left the group with `setsid` — by its process group and by that variable
//! in `/proc/PID/environ`. A process that both leaves its group and clears its environment is
//! out of reach (it has asked to be a daemon).

use std::path::Path;

use rustix::process::{kill_process, kill_process_group, Pid, Signal};

/// Every live process other than this one whose environment holds `RINGZERO_JOB_ID=job` (the
/// ranks, and whatever they started).
pub fn with_job_id(job: &str) -> Vec<Pid> {
    let want = format!("RINGZERO_JOB_ID={job}");
    let me = std::process::id();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .filter(|&pid| {
            // Unreadable (another user's, or gone): not this job's.
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|v| v == want.as_bytes()))
        })
        .filter_map(|pid| Pid::from_raw(pid as i32))
        .collect()
}

/// The SIGUSR1 markers of job `job` in `dir` (each names the process that left it), whatever
/// process wrote them.
pub fn markers(dir: &Path, job: &str) -> Vec<(std::path::PathBuf, Pid)> {
    let marker = ringzero_collectives::flight::sigusr1_marker(job, 0);
    let prefix = marker.strip_suffix('0').unwrap_or(&marker);
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| {
            let e = e.ok()?;
            let name = e.file_name();
            let pid: i32 = name.to_str()?.strip_prefix(prefix)?.parse().ok()?;
            Some((e.path(), Pid::from_raw(pid)?))
        })
        .collect()
}

/// The processes of job `job` that said they write their flight records on SIGUSR1 (each left
/// its marker in `dir`) and are still running: the ranks' communicators, however deep under a
/// wrapper they run.
pub fn writing_records(dir: &Path, job: &str) -> Vec<Pid> {
    let alive = with_job_id(job);
    markers(dir, job)
        .into_iter()
        .map(|(_, pid)| pid)
        .filter(|pid| alive.contains(pid))
        .collect()
}

/// Send `sig` to every rank's process group (`leaders`: the ranks' pids, each its group's id)
/// and to every process of job `job`; how many processes of the job were found.
pub fn signal_all(leaders: &[u32], job: &str, sig: Signal) -> usize {
    for &leader in leaders {
        if let Some(pgid) = Pid::from_raw(leader as i32) {
            // ESRCH: the group is empty.
            let _ = kill_process_group(pgid, sig);
        }
    }
    let rest = with_job_id(job);
    for &pid in &rest {
        let _ = kill_process(pid, sig);
    }
    rest.len()
}

/// The ranks of job `job` with a process that is stopped (SIGSTOP, or held by a debugger): a
/// rank that stopped answering without exiting, which its peers' timeouts point at.
pub fn stopped_ranks(job: &str) -> std::collections::BTreeSet<usize> {
    with_job_id(job)
        .into_iter()
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{}/stat", pid.as_raw_nonzero()));
            // The state follows the parenthesised command name.
            stat.is_ok_and(|s| {
                matches!(s.rsplit(')').next().map(str::trim_start), Some(st) if st.starts_with(['T', 't']))
            })
        })
        .filter_map(|pid| {
            let env = std::fs::read(format!("/proc/{}/environ", pid.as_raw_nonzero())).ok()?;
            let var = env
                .split(|b| *b == 0)
                .find_map(|v| v.strip_prefix(b"RINGZERO_RANK="))?;
            std::str::from_utf8(var).ok()?.parse().ok()
        })
        .collect()
}
