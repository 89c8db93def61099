//! Who this rank is, from the launcher's environment: the first convention present wins
//! (`RINGZERO_*`, torchrun, Slurm, Open MPI; see the [module docs](super)).

use crate::error::{Error, Result};

use super::DEFAULT_PORT;

/// Where rank, world size and master came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchInfo {
    /// Global rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Rank within its node.
    pub local_rank: usize,
    /// Ranks on this node.
    pub local_world_size: usize,
    /// Host of the rendezvous store (rank 0).
    pub master_addr: String,
    /// Port of the rendezvous store.
    pub master_port: u16,
    /// Which convention supplied these: `ringzero`, `torchrun`, `slurm` or `openmpi`.
    pub source: &'static str,
}

pub(super) fn launch_info(env: &dyn Fn(&str) -> Option<String>) -> Result<LaunchInfo> {
    let num =
        |var: &str| -> Result<Option<usize>> {
            match env(var) {
                None => Ok(None),
                Some(v) => v.trim().parse().map(Some).map_err(|_| {
                    Error::config(var, format!("`{v}` is not a non-negative integer"))
                }),
            }
        };
    let port = |vars: &[&str]| -> Result<u16> {
        for v in vars {
            if let Some(p) = env(v) {
                return p
                    .trim()
                    .parse()
                    .map_err(|_| Error::config(*v, format!("`{p}` is not a port number")));
            }
        }
        Ok(DEFAULT_PORT)
    };
    let addr = |vars: &[&str]| -> Option<String> { vars.iter().find_map(|v| env(v)) };
    let need = |v: Option<usize>, var: &str, source: &str| -> Result<usize> {
        v.ok_or_else(|| Error::config(var, format!("missing (other {source} variables are set)")))
    };
    // (name, [rank, world, local rank, local world] variables, master address vars, port vars)
    type Convention<'a> = (&'static str, [&'a str; 4], &'a [&'a str], &'a [&'a str]);
    let conventions: [Convention; 4] = [
        (
            "ringzero",
            [
                "RINGZERO_RANK",
                "RINGZERO_WORLD_SIZE",
                "RINGZERO_LOCAL_RANK",
                "RINGZERO_LOCAL_WORLD_SIZE",
            ],
            &["RINGZERO_MASTER_ADDR"],
            &["RINGZERO_MASTER_PORT"],
        ),
        (
            "torchrun",
            ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"],
            &["MASTER_ADDR"],
            &["MASTER_PORT"],
        ),
        (
            "slurm",
            [
                "SLURM_PROCID",
                "SLURM_NTASKS",
                "SLURM_LOCALID",
                "SLURM_NTASKS_PER_NODE",
            ],
            &[
                "RINGZERO_MASTER_ADDR",
                "MASTER_ADDR",
                "SLURM_LAUNCH_NODE_IPADDR",
            ],
            &["RINGZERO_MASTER_PORT", "MASTER_PORT"],
        ),
        (
            "openmpi",
            [
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE",
            ],
            &["RINGZERO_MASTER_ADDR", "MASTER_ADDR"],
            &["RINGZERO_MASTER_PORT", "MASTER_PORT"],
        ),
    ];
    for (source, [rank_v, world_v, local_v, local_world_v], addr_vars, port_vars) in conventions {
        let Some(rank) = num(rank_v)? else { continue };
        let world_size = need(num(world_v)?, world_v, source)?;
        let local_rank = num(local_v)?.unwrap_or(rank);
        // SLURM_NTASKS_PER_NODE may read "4(x2)": the leading number is what we need.
        let local_world_size = match env(local_world_v) {
            None => world_size,
            Some(v) => {
                let digits: String = v
                    .trim()
                    .chars()
                    .take_while(|c| c.is_ascii_digit())
                    .collect();
                digits.parse().map_err(|_| {
                    Error::config(local_world_v, format!("`{v}` is not a number of ranks"))
                })?
            }
        };
        let master_addr = match addr(addr_vars) {
            Some(a) => a,
            None if world_size == 1 => "127.0.0.1".to_string(),
            None => {
                return Err(Error::config(
                    addr_vars[0],
                    format!("missing: {source} gave a rank but no master address"),
                ))
            }
        };
        return Ok(LaunchInfo {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port: port(port_vars)?,
            source,
        });
    }
    Err(Error::config(
        "RINGZERO_RANK",
        "no launcher found: set RINGZERO_RANK/RINGZERO_WORLD_SIZE/RINGZERO_MASTER_ADDR (or run under \
         `ringzero launch`, torchrun, srun or mpirun)",
    ))
}

/// This host's identity: hostname plus boot id, so two containers with one hostname on different
/// machines differ, and two processes on one machine agree.
pub fn default_node_id() -> String {
    let host = rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{host}/{}", boot.trim())
}
