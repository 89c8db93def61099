//! The names of the files ringzero keeps in the shared-memory directory, and the sweep that
//! removes the ones nothing will use again.
//!
//! Every such file is named `ringzero-PID-WHAT-TAG-UNIQUE`: the process that created it, what
//! it is, a tag of the job's id ([`job_tag`]) and something unique. A file is unlinked as soon
//! as both ends have mapped it (and by its creator when it is dropped), so only a process killed
//! between creating a file and its peer's attach leaves one behind. Two sweeps remove those:
//! - the **launcher's**, when a job it ran has ended ([`sweep`] with the job's id): every file
//!   of that job's tag, since no process of the job is left;
//! - a **start-up sweep** by every communicator (once per process and directory): every file
//!   whose creating process is gone and that is older than [`STALE_AFTER`] (a file of a live
//!   job on another PID namespace sharing the directory may carry a PID this one does not see;
//!   no live job keeps a file unattached that long).

use std::path::{Path, PathBuf};
use std::time::Duration;

/// How old a file of a vanished process must be before the start-up sweep removes it.
pub const STALE_AFTER: Duration = Duration::from_secs(600);

/// The 8-hex-digit tag of job `job` in file names.
pub fn job_tag(job: &str) -> String {
    use sha2::Digest;
    let h = sha2::Sha256::digest(job.as_bytes());
    h[..4].iter().map(|b| format!("{b:02x}")).collect()
}

/// The name of a file process `pid` creates for job `job`: `what` it is, and `unique`.
pub fn name(pid: u32, what: &str, job: &str, unique: &str) -> String {
    format!("ringzero-{pid}-{what}-{}-{unique}", job_tag(job))
}

/// A fresh name for a file this process creates for job `job`.
pub fn fresh_name(what: &str, job: &str) -> String {
    let unique = format!("{:08x}", rand::random::<u32>());
    name(std::process::id(), what, job, &unique)
}

/// Remove the leftover files in `dir`: with `job`, every file of that (ended) job; without,
/// every file whose creator is gone and that is older than `stale_after`. The paths removed.
pub fn sweep(dir: &Path, job: Option<&str>, stale_after: Duration) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let tag = job.map(|j| format!("-{}-", job_tag(j)));
    let mut removed = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(pid) = name
            .strip_prefix("ringzero-")
            .and_then(|rest| rest.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let leftover = match &tag {
            Some(tag) => name.contains(tag.as_str()),
            None => {
                let age = e
                    .metadata()
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.elapsed().ok());
                !super::pid_alive(pid) && age.is_some_and(|a| a >= stale_after)
            }
        };
        if leftover && std::fs::remove_file(e.path()).is_ok() {
            removed.push(e.path());
        }
    }
    removed
}

/// The start-up sweep of `dir`, once per process and directory.
pub(crate) fn sweep_once(dir: &Path) {
    static SWEPT: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());
    let mut swept = SWEPT.lock().unwrap_or_else(|e| e.into_inner());
    if swept.iter().any(|d| d == dir) {
        return;
    }
    swept.push(dir.to_path_buf());
    for path in sweep(dir, None, STALE_AFTER) {
        tracing::info!(
            target: "ringzero::shm",
            "removed {}, left by a process that is gone",
            path.display()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_jobs_files_go_with_it_and_a_vanished_processs_once_stale() {
        let dir = std::env::temp_dir().join(format!("ringzero-sweep-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let touch = |n: &str| std::fs::write(dir.join(n), b"").unwrap();
        // A pid no process has (beyond the kernel's pid_max).
        let gone = 4_194_305;
        let mine = fresh_name("0to1-host", "job-a");
        touch(&mine);
        touch(&name(gone, "bench1", "job-a", "7"));
        touch(&name(gone, "1to2-host", "job-b", "00000001"));
        touch(&name(std::process::id(), "2to0-host", "job-b", "00000002"));
        touch("unrelated-file");
        // Job a ended: both of its files go, whoever made them.
        let removed = sweep(&dir, Some("job-a"), STALE_AFTER);
        assert_eq!(removed.len(), 2, "{removed:?}");
        // A fresh file of a vanished process stays (it may be a live process's elsewhere)...
        assert!(sweep(&dir, None, STALE_AFTER).is_empty());
        // ...until it is stale; a live process's file never goes.
        let removed = sweep(&dir, None, Duration::ZERO);
        assert_eq!(
            removed,
            [dir.join(name(gone, "1to2-host", "job-b", "00000001"))]
        );
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
