//! Configuration: who this rank is (from the launcher's environment) and the knobs.
//!
//! Launch conventions are read in this order, the first that is present wins:
//! 1. `RINGZERO_RANK`, `RINGZERO_WORLD_SIZE`, `RINGZERO_LOCAL_RANK`, `RINGZERO_LOCAL_WORLD_SIZE`,
//!    `RINGZERO_MASTER_ADDR`, `RINGZERO_MASTER_PORT` (set by `ringzero launch`);
//! 2. torchrun: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`;
//! 3. Slurm: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NTASKS_PER_NODE`
//!    (master address from `RINGZERO_MASTER_ADDR` or `MASTER_ADDR`);
//! 4. Open MPI: `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`,
//!    `OMPI_COMM_WORLD_LOCAL_SIZE` (master address as for Slurm).
//!
//! Knobs, all optional: see [`Config::from_env`].

use std::time::Duration;

use crate::error::{Error, Result};

mod env;
mod launcher;
mod policy;

pub use env::{env_flag, parse_bytes};
use launcher::launch_info;
pub use launcher::{default_node_id, LaunchInfo};
pub use policy::{
    Algo, DeviceAlgo, StagingMode, TransportPref, COPY_STAGING_MAX_SHARERS, TWO_RANK_DOUBLING_MAX,
};

/// Default deadline for any single wait.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// Default largest frame payload.
pub const DEFAULT_SLICE_BYTES: usize = 512 * 1024;

/// The most shared memory (or pinned host memory) one link's slots may reserve: a slice size
/// times the slot count (`RINGZERO_SLICE_BYTES` × `RINGZERO_SLOTS`), so a mistyped size fails
/// with a message instead of reserving gigabytes per link.
pub const MAX_LINK_BYTES: usize = 1 << 30;

/// The longest deadline `RINGZERO_TIMEOUT` may set: one week (beyond it a deadline is a hang,
/// and far beyond it, a time the clock cannot add).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(7 * 24 * 3600);
/// Default largest frame payload on a GPU's device ring edges, unless
/// `RINGZERO_DEVICE_SLICE_BYTES` says otherwise: the GPU's own choice
/// ([`ringzero_kernels::device::GPU_SLICE_BYTES`]; the sweep over slice sizes:
/// `docs/gpu-runs/README.md`).
pub const DEFAULT_GPU_SLICE_BYTES: usize = ringzero_kernels::device::GPU_SLICE_BYTES;
/// The same when `RINGZERO_P2P_DISABLE=1` (or a failed start-up probe) stages every device edge
/// inside a node through `/dev/shm`, which takes slots × slice bytes of it per edge, page-locked.
/// Larger slices run faster there too (`docs/gpu-runs/README.md`), so staging takes [`LARGE_GPU_STAGED_SLICE_BYTES`] when every rank's shm directory has
/// room for twice what the communicator's FIFOs need at that size, and this otherwise (a
/// container's default /dev/shm is often 64 MB); see [`staged_slice_bytes`].
pub const DEFAULT_GPU_STAGED_SLICE_BYTES: usize = 4 << 20;
/// Host staging's slice where the shm directory has room (see [`DEFAULT_GPU_STAGED_SLICE_BYTES`]).
pub const LARGE_GPU_STAGED_SLICE_BYTES: usize = 16 << 20;

/// Host staging's slice for a communicator of `ranks` ranks with `slots` slots per link, when
/// the emptiest shm directory among its ranks has `room` bytes free: the large slice when `room`
/// holds every rank's receive FIFO at that size twice over (ranks of other jobs and later
/// communicators need some too), else the default.
pub fn staged_slice_bytes(room: u64, ranks: usize, slots: usize) -> usize {
    let need = (ranks as u64)
        .saturating_mul(slots as u64)
        .saturating_mul(LARGE_GPU_STAGED_SLICE_BYTES as u64);
    if room / 2 >= need {
        LARGE_GPU_STAGED_SLICE_BYTES
    } else {
        DEFAULT_GPU_STAGED_SLICE_BYTES
    }
}

/// Default slots per link (at least 2: see the ring schedule's deadlock test).
pub const DEFAULT_SLOTS: usize = 4;
/// Default TCP connections per ring edge.
pub const DEFAULT_TCP_SOCKETS: usize = 1;
/// Most TCP connections per ring edge.
pub const MAX_TCP_SOCKETS: usize = 32;
/// Default smallest result (bytes of a rank's output buffer) written with streaming stores:
/// none. Whether they pay inside the ring depends on the machine, and where they lose they lose
/// more than they gain where they win (`docs/design-notes.md`, "Streaming stores"), so they wait
/// for `RINGZERO_STREAM_STORES_FROM`.
pub const DEFAULT_STREAM_STORES_FROM: usize = usize::MAX;
/// Default smallest all-gather (bytes of the whole result) that ranks of one node read straight
/// out of each other's memory (`RINGZERO_SINGLE_COPY_FROM`).
pub const DEFAULT_SINGLE_COPY_FROM: usize = 64 << 10;
/// Default size (bytes of the whole result) from which all-gathers go through the slots again
/// (`RINGZERO_SINGLE_COPY_BELOW`): none, every all-gather from
/// [`DEFAULT_SINGLE_COPY_FROM`] up reads in one copy.
pub const DEFAULT_SINGLE_COPY_BELOW: usize = usize::MAX;
/// Default largest all-reduce (bytes) that `auto` runs by recursive doubling.
pub const DEFAULT_DOUBLING_MAX: usize = 64 << 10;
/// Default largest all-reduce (bytes) that `auto` runs by halving-doubling (above
/// [`DEFAULT_DOUBLING_MAX`]).
pub const DEFAULT_HALVING_MAX: usize = 256 << 10;
/// Default largest all-gather-v (bytes of the whole result) that `auto` runs pairwise.
pub const DEFAULT_PAIRWISE_MAX: usize = 512 << 10;
/// Default master port when a launcher gives none.
pub const DEFAULT_PORT: u16 = 29500;
/// Default number of entries kept per communicator (`RINGZERO_FLIGHT_ENTRIES`).
pub const DEFAULT_FLIGHT_ENTRIES: usize = 256;

/// Everything a communicator needs to start.
#[derive(Clone, Debug)]
pub struct Config {
    /// Who this rank is and where the store is.
    pub launch: LaunchInfo,
    /// Shared job secret for the HMAC handshake (`RINGZERO_SECRET`).
    pub secret: Vec<u8>,
    /// Job id: connections from another job are refused (`RINGZERO_JOB_ID`).
    pub job_id: String,
    /// Identity of this node: ranks with equal ids share memory (`RINGZERO_NODE_ID`).
    pub node_id: String,
    /// Deadline for any wait without progress (`RINGZERO_TIMEOUT`, seconds).
    pub timeout: Duration,
    /// Transport choice (`RINGZERO_TRANSPORT`).
    pub transport: TransportPref,
    /// Never use shared memory (`RINGZERO_SHM_DISABLE=1`).
    pub shm_disable: bool,
    /// Never copy device buffers peer to peer; stage them through host shared memory
    /// (`RINGZERO_P2P_DISABLE=1`).
    pub p2p_disable: bool,
    /// Largest frame payload in bytes (`RINGZERO_SLICE_BYTES`).
    pub slice_bytes: usize,
    /// Largest frame payload on device ring edges (`RINGZERO_DEVICE_SLICE_BYTES`); `None`: the
    /// stream's own choice ([`DEFAULT_GPU_SLICE_BYTES`] on a GPU), else `slice_bytes`.
    pub device_slice_bytes: Option<usize>,
    /// Slots per link (`RINGZERO_SLOTS`, at least 2).
    pub slots: usize,
    /// TCP connections carrying each tcp ring edge (`RINGZERO_TCP_SOCKETS`, 1 to 32): frames go
    /// round-robin over them, so an edge is not held to what one connection can carry (a
    /// per-flow rate limit, one core's worth of receive processing, a window against a long
    /// round trip). The receiving rank's value counts; its sender follows.
    pub tcp_sockets: usize,
    /// Calls whose output buffer has at least this many bytes write their results with streaming
    /// stores, which skip the read-before-write of lines not in cache
    /// (`RINGZERO_STREAM_STORES_FROM`, a size or `off`).
    pub stream_stores_from: usize,
    /// All-gathers whose result has at least this many bytes (and fewer than
    /// [`Config::single_copy_below`]), on ranks whose ring edges are all shared memory, read
    /// each rank's part straight out of its process (one copy, by `process_vm_readv`) instead
    /// of passing it through the slots (`RINGZERO_SINGLE_COPY_FROM`, a size or `off`;
    /// `usize::MAX` is off).
    pub single_copy_from: usize,
    /// The size from which all-gathers go through the slots again, for a machine where their
    /// pipelined copies are faster than one copy between processes
    /// (`RINGZERO_SINGLE_COPY_BELOW`, a size or `off` for no bound; `usize::MAX`, the default,
    /// is none).
    pub single_copy_below: usize,
    /// How host staging of device buffers moves bytes (`RINGZERO_STAGING=mapped|copy`).
    pub staging: StagingMode,
    /// How device all-reduces, reduce-scatters, all-gathers, broadcasts and reduces move data
    /// (`RINGZERO_DEVICE_ALGO=auto|ring|direct`).
    pub device_algo: DeviceAlgo,
    /// Whether the device ring queues a slice's last receive and the next slice's first send
    /// as one copy-pair kernel where it can (`RINGZERO_DEVICE_COPY_PAIRS=on|off`; on by
    /// default; off for comparing the two on the same machine).
    pub device_copy_pairs: bool,
    /// Which algorithm host all-reduces, broadcasts, reduces, barriers and all-gather-vs run
    /// (`RINGZERO_ALGO=auto|ring|doubling|halving-doubling`, and `RINGZERO_DOUBLING_MAX`,
    /// `RINGZERO_HALVING_MAX` and `RINGZERO_PAIRWISE_MAX` for auto's thresholds).
    /// Device buffers take the ring, or the direct step ([`Config::device_algo`]).
    pub algo: Algo,
    /// Directory for shared-memory segments (`RINGZERO_SHM_DIR`, default `/dev/shm`).
    pub shm_dir: std::path::PathBuf,
    /// Calls each communicator's flight recorder keeps (`RINGZERO_FLIGHT_ENTRIES`, 0 turns it
    /// off).
    pub flight_entries: usize,
    /// Where a communicator that fails writes its flight record (`RINGZERO_DUMP_DIR`; unset:
    /// nowhere, the record is still readable through `flight_record()`). `ringzero launch` sets
    /// one per job.
    pub dump_dir: Option<std::path::PathBuf>,
    /// Also write every live communicator's flight record there, and go on, when the process
    /// receives SIGUSR1 (`RINGZERO_DUMP_ON_SIGUSR1=1`; `ringzero launch` sets it, and sends
    /// SIGUSR1 to every rank when it is interrupted or itself receives SIGUSR1): what each rank
    /// of a hung job is doing, before any deadline. Off by default: the process's SIGUSR1
    /// handling is its owner's (Slurm's `--signal`, a trainer's own handler).
    pub dump_on_sigusr1: bool,
    /// Write them there on SIGTERM too, then end as SIGTERM ends a process
    /// (`RINGZERO_DUMP_ON_SIGTERM=1`): a rank that torchrun's agent, Slurm or the launcher
    /// terminates leaves a record instead of none. Off by default, and not set by the launcher:
    /// it ends the process right after writing, even where the program handles SIGTERM itself
    /// (its handler still runs, chained, but the process does not outlive the records).
    pub dump_on_sigterm: bool,
}

impl Config {
    /// A configuration for `rank` of `world_size` with the store at `master_addr:master_port`, all
    /// ranks on one node, and every knob at its default. Used by tests and by embedders that do
    /// their own rendezvous.
    pub fn new(rank: usize, world_size: usize, master_addr: &str, master_port: u16) -> Config {
        Config {
            launch: LaunchInfo {
                rank,
                world_size,
                local_rank: rank,
                local_world_size: world_size,
                master_addr: master_addr.to_string(),
                master_port,
                source: "explicit",
            },
            secret: Vec::new(),
            job_id: format!("{master_addr}:{master_port}"),
            node_id: default_node_id(),
            timeout: DEFAULT_TIMEOUT,
            transport: TransportPref::Auto,
            shm_disable: false,
            p2p_disable: false,
            slice_bytes: DEFAULT_SLICE_BYTES,
            device_slice_bytes: None,
            slots: DEFAULT_SLOTS,
            tcp_sockets: DEFAULT_TCP_SOCKETS,
            stream_stores_from: DEFAULT_STREAM_STORES_FROM,
            single_copy_from: DEFAULT_SINGLE_COPY_FROM,
            single_copy_below: DEFAULT_SINGLE_COPY_BELOW,
            staging: StagingMode::default(),
            device_algo: DeviceAlgo::Auto,
            device_copy_pairs: true,
            algo: Algo::default(),
            shm_dir: "/dev/shm".into(),
            flight_entries: DEFAULT_FLIGHT_ENTRIES,
            dump_dir: None,
            dump_on_sigusr1: false,
            dump_on_sigterm: false,
        }
    }

    /// Read the launcher's variables and every `RINGZERO_*` knob from the process environment.
    pub fn from_env() -> Result<Config> {
        Config::from_lookup(&|k| std::env::var(k).ok())
    }

    /// As [`Config::from_env`], from any lookup function (tests pass a map).
    pub fn from_lookup(env: &dyn Fn(&str) -> Option<String>) -> Result<Config> {
        let launch = launch_info(env)?;
        let mut c = Config::new(
            launch.rank,
            launch.world_size,
            &launch.master_addr,
            launch.master_port,
        );
        c.launch = launch;
        env::read_identity(&mut c, env)?;
        env::read_links(&mut c, env)?;
        env::read_device(&mut c, env)?;
        c.algo = env::read_algo(env)?;
        env::read_flight(&mut c, env)?;
        c.validate()?;
        Ok(c)
    }

    /// Check the values against each other.
    pub fn validate(&self) -> Result<()> {
        let l = &self.launch;
        for (on, var) in [
            (self.dump_on_sigusr1, "RINGZERO_DUMP_ON_SIGUSR1"),
            (self.dump_on_sigterm, "RINGZERO_DUMP_ON_SIGTERM"),
        ] {
            if on && self.dump_dir.is_none() {
                return Err(Error::config(
                    var,
                    "is set but RINGZERO_DUMP_DIR is not: there is nowhere to write the records",
                ));
            }
        }
        if l.world_size == 0 {
            return Err(Error::config("world size", "must be at least 1"));
        }
        if l.rank >= l.world_size {
            return Err(Error::config(
                "rank",
                format!("rank {} is not below world size {}", l.rank, l.world_size),
            ));
        }
        if l.local_world_size == 0 || l.local_rank >= l.local_world_size {
            return Err(Error::config(
                "local rank",
                format!(
                    "local rank {} is not below local world size {}",
                    l.local_rank, l.local_world_size
                ),
            ));
        }
        if self.node_id.len() > 127 {
            return Err(Error::config(
                "RINGZERO_NODE_ID",
                format!(
                    "node id `{}…` is {} bytes; at most 127",
                    self.node_id.chars().take(32).collect::<String>(),
                    self.node_id.len()
                ),
            ));
        }
        if self.slots < 2 {
            return Err(Error::config(
                "slots",
                "need at least 2 slots per link (one can deadlock the ring)",
            ));
        }
        if self.slice_bytes == 0 {
            return Err(Error::config("slice_bytes", "must be at least 1"));
        }
        for (var, slice) in [
            ("RINGZERO_SLICE_BYTES", Some(self.slice_bytes)),
            ("RINGZERO_DEVICE_SLICE_BYTES", self.device_slice_bytes),
        ] {
            let link = slice.map_or(0, |b| b as u128 * self.slots as u128);
            if link > MAX_LINK_BYTES as u128 {
                return Err(Error::config(
                    var,
                    format!(
                        "{} slots of {} bytes are {link} bytes of slots per link, more than the {} MiB a link may reserve: use smaller slices or fewer slots",
                        self.slots,
                        slice.unwrap_or(0),
                        MAX_LINK_BYTES >> 20
                    ),
                ));
            }
        }
        if self.timeout.is_zero() || self.timeout > MAX_TIMEOUT {
            return Err(Error::config(
                "RINGZERO_TIMEOUT",
                format!(
                    "{:?} is not between 1 ms and {} s (one week)",
                    self.timeout,
                    MAX_TIMEOUT.as_secs()
                ),
            ));
        }
        if !(1..=MAX_TCP_SOCKETS).contains(&self.tcp_sockets) {
            return Err(Error::config(
                "tcp_sockets",
                format!(
                    "{} connections per edge; between 1 and {MAX_TCP_SOCKETS}",
                    self.tcp_sockets
                ),
            ));
        }
        if self.transport == TransportPref::Shm && self.shm_disable {
            return Err(Error::config(
                "RINGZERO_TRANSPORT",
                "shm was asked for but RINGZERO_SHM_DISABLE=1 forbids it",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::doubling::Schedule;
    use crate::ring::Collective;
    use std::collections::HashMap;

    fn cfg(vars: &[(&str, &str)]) -> Result<Config> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(&|k| m.get(k).cloned())
    }

    #[test]
    fn staging_takes_large_slices_only_where_every_shm_dir_has_room_twice_over() {
        let (small, large) = (DEFAULT_GPU_STAGED_SLICE_BYTES, LARGE_GPU_STAGED_SLICE_BYTES);
        let mib = 1u64 << 20;
        // 2 ranks × 4 slots × 16 MiB = 128 MiB of FIFOs: 256 MiB free is enough, a byte less not.
        assert_eq!(staged_slice_bytes(256 * mib, 2, 4), large);
        assert_eq!(staged_slice_bytes(256 * mib - 1, 2, 4), small);
        // A container's default 64 MB /dev/shm, an unreadable directory (0), many ranks.
        assert_eq!(staged_slice_bytes(64_000_000, 2, 4), small);
        assert_eq!(staged_slice_bytes(0, 2, 4), small);
        assert_eq!(staged_slice_bytes(64 << 30, 8, 4), large);
        assert_eq!(staged_slice_bytes(u64::MAX, usize::MAX, usize::MAX), small);
    }

    #[test]
    fn conventions_in_order() {
        let c = cfg(&[
            ("RINGZERO_RANK", "1"),
            ("RINGZERO_WORLD_SIZE", "4"),
            ("RINGZERO_MASTER_ADDR", "10.0.0.1"),
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
        ])
        .unwrap();
        assert_eq!(
            (c.launch.rank, c.launch.world_size, c.launch.source),
            (1, 4, "ringzero")
        );
        let c = cfg(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap();
        assert_eq!(
            (
                c.launch.rank,
                c.launch.local_rank,
                c.launch.local_world_size,
                c.launch.master_port
            ),
            (3, 1, 2, 1234)
        );
        let c = cfg(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "4(x2)"),
            ("MASTER_ADDR", "n1"),
        ])
        .unwrap();
        assert_eq!(
            (
                c.launch.rank,
                c.launch.local_world_size,
                c.launch.source,
                c.launch.master_port
            ),
            (5, 4, "slurm", DEFAULT_PORT)
        );
        let c = cfg(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "3"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "1"),
            ("RINGZERO_MASTER_ADDR", "m"),
        ])
        .unwrap();
        assert_eq!(
            (
                c.launch.rank,
                c.launch.source,
                c.launch.master_addr.as_str()
            ),
            (2, "openmpi", "m")
        );
    }

    #[test]
    fn bad_values_name_the_variable() {
        let base = [
            ("RINGZERO_RANK", "0"),
            ("RINGZERO_WORLD_SIZE", "2"),
            ("RINGZERO_MASTER_ADDR", "127.0.0.1"),
        ];
        let with = |k: &'static str, v: &'static str| {
            let mut v2 = base.to_vec();
            v2.push((k, v));
            cfg(&v2).unwrap_err().to_string()
        };
        assert!(with("RINGZERO_TIMEOUT", "-3").contains("RINGZERO_TIMEOUT"));
        assert!(with("RINGZERO_TRANSPORT", "udp").contains("`udp` is not one of"));
        assert!(with("RINGZERO_SLOTS", "1").contains("RINGZERO_SLOTS"));
        assert!(with("RINGZERO_DEVICE_SLICE_BYTES", "2G")
            .contains("RINGZERO_DEVICE_SLICE_BYTES: `2G` is not a size between 4K and 256M"));
        for big in ["1e20", "1e300", "604801", "inf"] {
            let e = with("RINGZERO_TIMEOUT", big);
            assert!(e.contains("between 0.001 and 604800"), "{big}: {e}");
        }
        assert!(cfg(&[base.as_slice(), &[("RINGZERO_TIMEOUT", "604800")]].concat()).is_ok());
        for tiny in ["1", "4095", "0"] {
            let e = with("RINGZERO_SLICE_BYTES", tiny);
            assert!(
                e.contains("is not a size between 4K and 256M"),
                "{tiny}: {e}"
            );
        }
        let e = with("RINGZERO_SLICE_BYTES", "1G");
        assert!(e.contains("between 4K and 256M"), "{e}");
        let mut many = base.to_vec();
        many.extend([("RINGZERO_SLICE_BYTES", "256M"), ("RINGZERO_SLOTS", "8")]);
        let e = cfg(&many).unwrap_err().to_string();
        assert!(
            e.contains("more than the 1024 MiB a link may reserve"),
            "{e}"
        );
        for bad in ["0", "33", "four"] {
            let e = with("RINGZERO_TCP_SOCKETS", bad);
            assert!(
                e.contains(&format!(
                    "RINGZERO_TCP_SOCKETS: `{bad}` is not a number between 1 and 32"
                )),
                "{e}"
            );
        }
        assert!(with("RINGZERO_STREAM_STORES_FROM", "soon").contains("`soon` is not a size"));
        assert!(with("RINGZERO_SHM_DISABLE", "maybe").contains("RINGZERO_SHM_DISABLE"));
        assert!(with("RINGZERO_STAGING", "zerocopy")
            .contains("`zerocopy` is not one of auto, mapped, copy"));
        assert!(with("RINGZERO_DEVICE_ALGO", "tree")
            .contains("`tree` is not one of auto, ring, direct"));
        assert!(with("RINGZERO_DEVICE_COPY_PAIRS", "sometimes")
            .contains("`sometimes` is not one of on, off"));
        assert!(with("RINGZERO_MASTER_PORT", "99999").contains("RINGZERO_MASTER_PORT"));
        assert!(with("RINGZERO_FLIGHT_ENTRIES", "-1").contains("RINGZERO_FLIGHT_ENTRIES"));
        assert!(with("RINGZERO_DUMP_DIR", " ").contains("RINGZERO_DUMP_DIR: is empty"));
        let e = cfg(&[
            ("RINGZERO_RANK", "2"),
            ("RINGZERO_WORLD_SIZE", "2"),
            ("RINGZERO_MASTER_ADDR", "x"),
        ])
        .unwrap_err();
        assert!(
            e.to_string().contains("rank 2 is not below world size 2"),
            "{e}"
        );
        let e = cfg(&[("RANK", "0"), ("WORLD_SIZE", "2")]).unwrap_err();
        assert!(e.to_string().contains("MASTER_ADDR"), "{e}");
        assert!(cfg(&[])
            .unwrap_err()
            .to_string()
            .contains("no launcher found"));
    }

    #[test]
    fn knobs() {
        let c = cfg(&[
            ("RINGZERO_RANK", "0"),
            ("RINGZERO_WORLD_SIZE", "1"),
            ("RINGZERO_TIMEOUT", "2.5"),
            ("RINGZERO_SLICE_BYTES", "64K"),
            ("RINGZERO_DEVICE_SLICE_BYTES", "8M"),
            ("RINGZERO_TRANSPORT", "TCP"),
            ("RINGZERO_NODE_ID", "fake-1"),
            ("RINGZERO_STREAM_STORES_FROM", "1M"),
            ("RINGZERO_SINGLE_COPY_FROM", "256K"),
            ("RINGZERO_SINGLE_COPY_BELOW", "8M"),
            ("RINGZERO_STAGING", "Mapped"),
            ("RINGZERO_DEVICE_ALGO", " Direct"),
            ("RINGZERO_DEVICE_COPY_PAIRS", "Off"),
            ("RINGZERO_FLIGHT_ENTRIES", "16"),
            ("RINGZERO_DUMP_DIR", "/tmp/rz-dumps"),
            ("RINGZERO_DUMP_ON_SIGUSR1", "1"),
            ("RINGZERO_TCP_SOCKETS", " 8"),
        ])
        .unwrap();
        assert!(c.dump_on_sigusr1 && !c.dump_on_sigterm);
        assert!(!Config::new(0, 1, "x", 1).dump_on_sigusr1);
        let e = cfg(&[
            ("RINGZERO_RANK", "0"),
            ("RINGZERO_WORLD_SIZE", "1"),
            ("RINGZERO_DUMP_ON_SIGTERM", "1"),
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("RINGZERO_DUMP_ON_SIGTERM"), "{e}");
        // Records on SIGUSR1 need somewhere to go.
        let e = cfg(&[
            ("RINGZERO_RANK", "0"),
            ("RINGZERO_WORLD_SIZE", "1"),
            ("RINGZERO_DUMP_ON_SIGUSR1", "1"),
        ])
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("RINGZERO_DUMP_ON_SIGUSR1") && e.contains("RINGZERO_DUMP_DIR"),
            "{e}"
        );
        assert_eq!(c.tcp_sockets, 8);
        assert_eq!(Config::new(0, 1, "x", 1).tcp_sockets, 1);
        assert_eq!(c.flight_entries, 16);
        assert_eq!(
            c.dump_dir.as_deref(),
            Some(std::path::Path::new("/tmp/rz-dumps"))
        );
        assert_eq!(Config::new(0, 1, "x", 1).dump_dir, None);
        assert_eq!(c.stream_stores_from, 1 << 20);
        assert_eq!(c.single_copy_from, 256 << 10);
        assert_eq!(c.single_copy_below, 8 << 20);
        assert_eq!(
            Config::new(0, 1, "x", 1).single_copy_below,
            DEFAULT_SINGLE_COPY_BELOW
        );
        assert_eq!(
            Config::new(0, 1, "x", 1).single_copy_from,
            DEFAULT_SINGLE_COPY_FROM
        );
        assert_eq!(c.staging, StagingMode::Mapped);
        assert_eq!(Config::new(0, 1, "x", 1).staging, StagingMode::Auto);
        assert_eq!(c.device_algo, DeviceAlgo::Direct);
        assert_eq!(Config::new(0, 1, "x", 1).device_algo, DeviceAlgo::Auto);
        assert!(!c.device_copy_pairs);
        assert!(Config::new(0, 1, "x", 1).device_copy_pairs);
        assert_eq!(c.timeout, Duration::from_millis(2500));
        assert_eq!(c.slice_bytes, 65536);
        assert_eq!(c.device_slice_bytes, Some(8 << 20));
        assert_eq!(Config::new(0, 1, "x", 1).device_slice_bytes, None);
        assert_eq!(c.transport, TransportPref::Tcp);
        assert_eq!(c.node_id, "fake-1");
        assert_eq!(c.launch.master_addr, "127.0.0.1");
        let off = |v: &str| {
            cfg(&[
                ("RINGZERO_RANK", "0"),
                ("RINGZERO_WORLD_SIZE", "1"),
                ("RINGZERO_STREAM_STORES_FROM", v),
            ])
            .unwrap()
            .stream_stores_from
        };
        assert_eq!(off("OFF"), usize::MAX);
        assert_eq!(off("0"), 0);
        let e = cfg(&[
            ("RINGZERO_RANK", "0"),
            ("RINGZERO_WORLD_SIZE", "1"),
            ("RINGZERO_SINGLE_COPY_FROM", "never"),
        ])
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("RINGZERO_SINGLE_COPY_FROM") && e.contains("`off`"),
            "{e}"
        );
    }

    #[test]
    fn all_reduce_algorithm() {
        let algo = |kv: &[(&str, &str)]| {
            let mut all = vec![("RINGZERO_RANK", "0"), ("RINGZERO_WORLD_SIZE", "1")];
            all.extend_from_slice(kv);
            cfg(&all).map(|c| c.algo)
        };
        let auto = Algo::default();
        assert_eq!(algo(&[]).unwrap(), auto);
        let (ar, bar) = (Collective::AllReduce, Collective::Barrier);
        let bc = Collective::Broadcast { root: 0 };
        let (d, hd) = (Some(Schedule::Doubling), Some(Schedule::HalvingDoubling));
        assert_eq!(auto.schedule(ar, DEFAULT_DOUBLING_MAX, 3, true), d);
        assert_eq!(auto.schedule(ar, DEFAULT_DOUBLING_MAX + 1, 3, true), hd);
        assert_eq!(auto.schedule(ar, DEFAULT_HALVING_MAX, 8, true), hd);
        assert_eq!(auto.schedule(ar, DEFAULT_HALVING_MAX + 1, 8, true), None);
        assert_eq!(
            auto.schedule(ar, 4, 2, true),
            None,
            "two ranks: the ring's two hops of half"
        );
        // Two ranks over tcp: one exchange of the whole buffer up to the two-rank limit, and
        // never past RINGZERO_DOUBLING_MAX; only the all-reduce.
        assert_eq!(auto.schedule(ar, TWO_RANK_DOUBLING_MAX, 2, false), d);
        assert_eq!(auto.schedule(ar, TWO_RANK_DOUBLING_MAX + 1, 2, false), None);
        let low = Algo::Auto {
            doubling_max: 1024,
            halving_max: 0,
            pairwise_max: 0,
        };
        assert_eq!(low.schedule(ar, 2048, 2, false), None);
        assert_eq!(auto.schedule(bar, 0, 2, false), None);
        assert_eq!(auto.schedule(bc, 4, 2, false), None);
        assert_eq!(auto.schedule(bar, 0, 3, true), d);
        assert_eq!(auto.schedule(bar, 0, 2, true), None);
        assert_eq!(
            auto.schedule(bc, 4, 8, true),
            None,
            "auto keeps broadcast on the chain"
        );
        assert_eq!(Algo::Doubling.schedule(ar, 1 << 30, 2, true), d);
        assert_eq!(Algo::Doubling.schedule(bc, 1 << 30, 8, true), d);
        assert_eq!(
            Algo::Doubling.schedule(Collective::AllGather, 4, 8, true),
            None
        );
        assert_eq!(Algo::HalvingDoubling.schedule(ar, 4, 2, true), hd);
        assert_eq!(Algo::HalvingDoubling.schedule(bar, 0, 8, true), None);
        assert_eq!(Algo::Ring.schedule(bar, 0, 8, true), None);
        assert_eq!(
            Algo::Doubling.schedule(ar, 4, 1, true),
            None,
            "one rank has nothing to exchange"
        );
        assert_eq!(algo(&[("RINGZERO_ALGO", "Ring")]).unwrap(), Algo::Ring);
        assert_eq!(
            algo(&[("RINGZERO_ALGO", "doubling")]).unwrap(),
            Algo::Doubling
        );
        assert_eq!(
            algo(&[("RINGZERO_ALGO", "halving-doubling")]).unwrap(),
            Algo::HalvingDoubling
        );
        assert_eq!(
            algo(&[
                ("RINGZERO_DOUBLING_MAX", "1M"),
                ("RINGZERO_HALVING_MAX", "0")
            ])
            .unwrap(),
            Algo::Auto {
                doubling_max: 1 << 20,
                halving_max: 0,
                pairwise_max: DEFAULT_PAIRWISE_MAX,
            }
        );
        let agv = |a: Algo, bytes, n| a.gathers_v_pairwise(bytes, n, 2);
        assert!(agv(auto, DEFAULT_PAIRWISE_MAX, 3));
        assert!(!agv(auto, DEFAULT_PAIRWISE_MAX + 1, 3));
        assert!(
            auto.gathers_v_pairwise(1 << 30, 3, 1),
            "one node: pairwise at every size"
        );
        assert!(
            !agv(auto, 4, 2),
            "two ranks: one exchange either way, the ring's"
        );
        assert!(agv(Algo::Doubling, 1 << 30, 2));
        assert!(
            !agv(Algo::Doubling, 4, 1),
            "one rank has nothing to exchange"
        );
        assert!(!agv(Algo::Ring, 4, 8));
        assert!(!Algo::Ring.gathers_v_pairwise(4, 8, 1));
        assert!(!agv(Algo::HalvingDoubling, 4, 8));
        let pmax = algo(&[("RINGZERO_PAIRWISE_MAX", "0")]).unwrap();
        assert!(!agv(pmax, 1, 8) && agv(pmax, 0, 8), "{pmax}");
        let e = algo(&[("RINGZERO_ALGO", "ring"), ("RINGZERO_PAIRWISE_MAX", "1M")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("RINGZERO_PAIRWISE_MAX: sets where"), "{e}");
        let e = algo(&[("RINGZERO_HALVING_MAX", "big")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("RINGZERO_HALVING_MAX: `big` is not a size"),
            "{e}"
        );
        let e = algo(&[
            ("RINGZERO_ALGO", "doubling"),
            ("RINGZERO_HALVING_MAX", "1M"),
        ])
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("RINGZERO_HALVING_MAX: sets where RINGZERO_ALGO=auto switches"),
            "{e}"
        );
        let e = algo(&[("RINGZERO_ALGO", "tree")]).unwrap_err().to_string();
        assert!(
            e.contains(
                "RINGZERO_ALGO: `tree` is not one of auto, ring, doubling, halving-doubling"
            ),
            "{e}"
        );
        let e = algo(&[("RINGZERO_DOUBLING_MAX", "lots")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("RINGZERO_DOUBLING_MAX: `lots` is not a size"),
            "{e}"
        );
        let e = algo(&[("RINGZERO_ALGO", "ring"), ("RINGZERO_DOUBLING_MAX", "1M")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("but RINGZERO_ALGO is `ring`"), "{e}");
    }

    #[test]
    fn auto_staging_copies_on_a_gpu_of_at_most_two_ranks_and_maps_otherwise() {
        for (sharers, want) in [
            (1, StagingMode::Copy),
            (2, StagingMode::Copy),
            (3, StagingMode::Mapped),
            (4, StagingMode::Mapped),
            (8, StagingMode::Mapped),
        ] {
            let (got, why) = StagingMode::Auto.resolve(sharers, true);
            assert_eq!(got, want, "{sharers} sharers: {why}");
            assert_eq!(
                why,
                format!(
                    "RINGZERO_STAGING=auto: {sharers} rank{} on this GPU, copies for at most 2",
                    if sharers == 1 { "" } else { "s" }
                )
            );
            // Without copy engines (the host stream) copies are only more memcpys: mapped.
            assert_eq!(
                StagingMode::Auto.resolve(sharers, false),
                (
                    StagingMode::Mapped,
                    "RINGZERO_STAGING=auto: not a GPU, no copy engines to gain from".to_string()
                )
            );
        }
        // A forced mode stays whatever the device and count, and says it was forced.
        for forced in [StagingMode::Mapped, StagingMode::Copy] {
            for sharers in [1, 2, 4] {
                for gpu in [true, false] {
                    let (got, why) = forced.resolve(sharers, gpu);
                    assert_eq!(got, forced);
                    assert_eq!(why, format!("RINGZERO_STAGING={forced}"));
                }
            }
        }
    }
}
