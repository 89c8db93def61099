//! How many ranks this machine can hold: what `ringzero launch` (and `bench`, `demo`, which
//! start their ranks through it) checks before it starts any, so that `-n 100000` is refused
//! with the reason instead of forking until the process limit and panicking.
//!
//! Three limits, each with its own message:
//! - **cores**: more than [`RANKS_PER_CORE`] ranks per core only time-slice (every rank spins
//!   on its links while it waits), so a job that large cannot make progress;
//! - **processes**: every rank is a process with threads of its own (its links, its worker, the
//!   launcher's two output readers), [`THREADS_PER_RANK`] counted per rank against the
//!   process limit (`ulimit -u`, `RLIMIT_NPROC`);
//! - **shared memory**: every rank on a node reserves its receive link's slots in `/dev/shm`
//!   (`RINGZERO_SLOTS` × `RINGZERO_SLICE_BYTES`, 2 MiB by default), which must fit in what the
//!   file system has free.

use std::path::Path;

/// The most ranks per core a job may have.
pub const RANKS_PER_CORE: usize = 32;

/// Threads a rank is counted for against the process limit.
pub const THREADS_PER_RANK: u64 = 8;

/// What the machine offers, read once ([`Machine::here`]) or made up (tests).
#[derive(Clone, Copy, Debug)]
pub struct Machine {
    /// Cores this process may run on.
    pub cores: usize,
    /// The soft process limit (`RLIMIT_NPROC`), `None` where unlimited.
    pub process_limit: Option<u64>,
    /// Bytes free in the shared-memory directory, `None` where it cannot be read.
    pub shm_free: Option<u64>,
}

impl Machine {
    /// This machine, with its shared memory in `shm_dir`.
    pub fn here(shm_dir: &Path) -> Machine {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let limit = rustix::process::getrlimit(rustix::process::Resource::Nproc).current;
        let shm_free = rustix::fs::statvfs(shm_dir)
            .ok()
            .map(|s| s.f_bavail.saturating_mul(s.f_frsize));
        Machine {
            cores,
            process_limit: limit,
            shm_free,
        }
    }
}

/// Refuse `ranks` ranks on this machine when it cannot hold them; each rank reserves
/// `link_bytes` of shared memory. The error says which limit and what to do.
pub fn check(ranks: usize, link_bytes: u64, m: &Machine) -> Result<(), String> {
    let most = m.cores.saturating_mul(RANKS_PER_CORE);
    if ranks > most {
        return Err(format!(
            "-n {ranks}: this machine has {} cores, and more than {RANKS_PER_CORE} ranks per core \
             ({most} here) only time-slice; run at most {most} ranks here, or spread the job over \
             more machines",
            m.cores
        ));
    }
    if let Some(limit) = m.process_limit {
        let need = ranks as u64 * THREADS_PER_RANK;
        if need > limit {
            return Err(format!(
                "-n {ranks}: the ranks need about {need} threads ({THREADS_PER_RANK} each) but the \
                 process limit (ulimit -u) is {limit}: run fewer ranks, or raise the limit"
            ));
        }
    }
    if let Some(free) = m.shm_free {
        let need = ranks as u64 * link_bytes;
        if need > free {
            return Err(format!(
                "-n {ranks}: every rank reserves {link_bytes} bytes of shared memory for its \
                 link, {need} in all, but /dev/shm has {free} free: run fewer ranks, use smaller \
                 slices (RINGZERO_SLICE_BYTES) or fewer slots (RINGZERO_SLOTS), or make /dev/shm \
                 larger"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: Machine = Machine {
        cores: 2,
        process_limit: Some(4096),
        shm_free: Some(1 << 30),
    };

    #[test]
    fn a_job_that_fits_passes() {
        assert_eq!(check(4, 2 << 20, &M), Ok(()));
        assert_eq!(check(64, 2 << 20, &M), Ok(()));
    }

    #[test]
    fn each_limit_is_named_with_what_to_do() {
        let e = check(100_000, 2 << 20, &M).unwrap_err();
        assert!(
            e.contains("2 cores") && e.contains("at most 64 ranks"),
            "{e}"
        );
        let few = Machine {
            process_limit: Some(100),
            ..M
        };
        let e = check(20, 2 << 20, &few).unwrap_err();
        assert!(e.contains("process limit (ulimit -u) is 100"), "{e}");
        let small = Machine {
            shm_free: Some(8 << 20),
            ..M
        };
        let e = check(8, 2 << 20, &small).unwrap_err();
        assert!(e.contains("/dev/shm has 8388608 free"), "{e}");
        let unknown = Machine {
            process_limit: None,
            shm_free: None,
            ..M
        };
        assert_eq!(check(64, 2 << 20, &unknown), Ok(()));
    }
}
