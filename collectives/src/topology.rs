//! Which transport carries each ring edge, and why. Pure: decided from the two ranks' published
//! node identities and this rank's configuration. The *receiving* rank of an edge decides (it owns
//! the FIFO) and publishes its choice; the sender follows it, so ranks with different settings
//! can never disagree.
//!
//! Rules, in order (NCCL's `shmCanConnect` in spirit):
//! 1. `RINGZERO_TRANSPORT=tcp` → tcp;
//! 2. `RINGZERO_TRANSPORT=shm` → shm, an error if the ranks are on different nodes;
//! 3. different node ids (`RINGZERO_NODE_ID`, default hostname + boot id) → tcp;
//! 4. `RINGZERO_SHM_DISABLE=1` → tcp;
//! 5. otherwise shm.
//!
//! (`RINGZERO_TRANSPORT=cuda_ipc` asks for peer copies of device buffers; host edges then follow
//! the automatic rules.)
//!
//! Device buffers ([`choose_device`]) start from the host edge and go on, in order:
//! 1. a tcp host edge (other node, or forced) → tcp with pinned staging;
//! 2. `RINGZERO_TRANSPORT=shm` → shm (host staging);
//! 3. `RINGZERO_P2P_DISABLE=1` → shm;
//! 4. both ranks on the same GPU (same UUID) → cuda_ipc;
//! 5. peer access unknown (the sender's GPU is not visible here) or refused by
//!    `cuDeviceCanAccessPeer` → shm, or an error when `RINGZERO_TRANSPORT=cuda_ipc`;
//! 6. otherwise cuda_ipc.
//!
//! and a cuda_ipc edge whose start-up probe fails (wrong data, or no data within its deadline)
//! falls back to shm with the probe's finding as the reason ([`after_probe`]).

use std::fmt;

use crate::config::{Config, TransportPref};
use crate::error::{Error, Result};
use crate::transport::TransportKind;

/// One ring edge as this rank sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Edge {
    /// Sending rank.
    pub from: usize,
    /// Receiving rank.
    pub to: usize,
    /// Backend in use.
    pub kind: TransportKind,
    /// Why it was chosen.
    pub reason: String,
    /// TCP connections carrying the edge (`RINGZERO_TCP_SOCKETS` of the receiving rank); 0 for
    /// shm and cuda_ipc.
    pub sockets: usize,
}

impl fmt::Display for Edge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let over = match self.sockets {
            0 | 1 => String::new(),
            k => format!(" over {k} connections"),
        };
        write!(
            f,
            "rank {} → rank {}: {}{over} ({})",
            self.from, self.to, self.kind, self.reason
        )
    }
}

/// Choose the transport for frames from rank `from` (on node `from_node`) to this rank `to`.
pub fn choose(cfg: &Config, from: usize, from_node: &str, to: usize) -> Result<Edge> {
    let same = from_node == cfg.node_id;
    let edge = |kind, reason: String| {
        Ok(Edge {
            from,
            to,
            kind,
            reason,
            sockets: match kind {
                TransportKind::Tcp => cfg.tcp_sockets,
                _ => 0,
            },
        })
    };
    match cfg.transport {
        TransportPref::Tcp => edge(TransportKind::Tcp, "forced by RINGZERO_TRANSPORT=tcp".into()),
        TransportPref::Shm if !same => Err(Error::config(
            "RINGZERO_TRANSPORT",
            format!(
                "shm was forced, but rank {from} (node `{from_node}`) and rank {to} (node `{}`) are on different nodes",
                cfg.node_id
            ),
        )),
        TransportPref::Shm => edge(TransportKind::Shm, "forced by RINGZERO_TRANSPORT=shm".into()),
        TransportPref::Auto | TransportPref::CudaIpc if !same => {
            edge(TransportKind::Tcp, format!("different nodes (`{from_node}` vs `{}`)", cfg.node_id))
        }
        TransportPref::Auto | TransportPref::CudaIpc if cfg.shm_disable => edge(TransportKind::Tcp, "same node, RINGZERO_SHM_DISABLE=1".into()),
        TransportPref::Auto | TransportPref::CudaIpc => edge(TransportKind::Shm, format!("same node `{}`", cfg.node_id)),
    }
}

/// What the receiving rank of a device edge knows about its sender.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DevicePeer {
    /// The host communicator's edge between the same two ranks.
    pub host_edge: Edge,
    /// This rank's device, for messages (`cuda:0`, `host`).
    pub mine: String,
    /// The sender's device, as it names it.
    pub theirs: String,
    /// Both ranks use the same GPU (same UUID).
    pub same_gpu: bool,
    /// Whether this rank's GPU may access the sender's GPU (`cuDeviceCanAccessPeer`), or why that
    /// cannot be known.
    pub peer_access: std::result::Result<bool, String>,
    /// The MPS control daemon's pipe, when one is running ([`mps_control`]): without it processes
    /// that share a GPU take turns on it, one context at a time.
    pub mps: Option<std::path::PathBuf>,
}

/// Where a running MPS control daemon listens, if one does: `$CUDA_MPS_PIPE_DIRECTORY/control`
/// (default `/tmp/nvidia-mps`), which CUDA clients in this environment would connect to.
pub fn mps_control() -> Option<std::path::PathBuf> {
    let dir = std::env::var_os("CUDA_MPS_PIPE_DIRECTORY")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| "/tmp/nvidia-mps".into());
    let control = dir.join("control");
    control.exists().then_some(control)
}

/// Choose the transport for device buffers sent from `p.host_edge.from` to this rank.
pub fn choose_device(cfg: &Config, p: &DevicePeer) -> Result<Edge> {
    let (from, to) = (p.host_edge.from, p.host_edge.to);
    let edge = |kind, reason: String| {
        Ok(Edge {
            from,
            to,
            kind,
            reason,
            sockets: match kind {
                TransportKind::Tcp => cfg.tcp_sockets,
                _ => 0,
            },
        })
    };
    let forced_ipc = cfg.transport == TransportPref::CudaIpc;
    if p.host_edge.kind == TransportKind::Tcp {
        if forced_ipc {
            return Err(Error::config(
                "RINGZERO_TRANSPORT",
                format!(
                    "cuda_ipc was forced, but rank {from} and rank {to} talk over tcp ({})",
                    p.host_edge.reason
                ),
            ));
        }
        return edge(
            TransportKind::Tcp,
            format!(
                "{}; device buffers staged through pinned host memory",
                p.host_edge.reason
            ),
        );
    }
    if cfg.transport == TransportPref::Shm {
        return edge(
            TransportKind::Shm,
            "forced by RINGZERO_TRANSPORT=shm (host staging)".into(),
        );
    }
    if cfg.p2p_disable {
        if forced_ipc {
            return Err(Error::config(
                "RINGZERO_TRANSPORT",
                "cuda_ipc was forced, but RINGZERO_P2P_DISABLE=1 forbids peer copies",
            ));
        }
        return edge(
            TransportKind::Shm,
            "RINGZERO_P2P_DISABLE=1: host staging".into(),
        );
    }
    if p.same_gpu {
        // Measured on an H100, 2 processes, 256 MiB all-reduce: 80 GB/s busbw without MPS, 307
        // with it (docs/gpu-runs/README.md).
        return edge(
            TransportKind::CudaIpc,
            match &p.mps {
                Some(pipe) => format!(
                    "same GPU ({}) in both processes, side by side under MPS ({})",
                    p.mine,
                    pipe.display()
                ),
                None => format!(
                    "same GPU ({}) in both processes; no MPS daemon, so they take turns on it \
                     (`nvidia-cuda-mps-control -d` runs them side by side)",
                    p.mine
                ),
            },
        );
    }
    let no_peer = match &p.peer_access {
        Ok(true) => None,
        Ok(false) => Some(format!(
            "cuDeviceCanAccessPeer({}, {}) = 0",
            p.mine, p.theirs
        )),
        Err(why) => Some(format!("peer access unknown: {why}")),
    };
    match (no_peer, forced_ipc) {
        (Some(why), true) => Err(Error::config(
            "RINGZERO_TRANSPORT",
            format!("cuda_ipc was forced, but rank {from} → rank {to} cannot use it: {why}"),
        )),
        (Some(why), false) => edge(TransportKind::Shm, format!("{why}: host staging")),
        (None, true) => edge(
            TransportKind::CudaIpc,
            "forced by RINGZERO_TRANSPORT=cuda_ipc".into(),
        ),
        (None, false) => edge(
            TransportKind::CudaIpc,
            format!("peer access {} ← {}", p.mine, p.theirs),
        ),
    }
}

/// The edge after its start-up probe: `finding` is `None` when the patterned data came back
/// right and in time, else what went wrong. A failed cuda_ipc edge falls back to host staging
/// (an error if cuda_ipc was forced); a failed staging edge has nothing left to fall back to.
pub fn after_probe(cfg: &Config, edge: Edge, finding: Option<&str>) -> Result<Edge> {
    let Some(f) = finding else {
        return Ok(edge);
    };
    match edge.kind {
        TransportKind::CudaIpc if cfg.transport != TransportPref::CudaIpc => Ok(Edge {
            kind: TransportKind::Shm,
            reason: format!("cuda_ipc probe failed ({f}): host staging"),
            sockets: 0,
            ..edge
        }),
        _ => Err(Error::Protocol {
            peer: format!("rank {}", edge.from),
            detail: format!("the start-up probe of {} failed: {f}", edge),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_in_order() {
        let mut c = Config::new(1, 2, "127.0.0.1", 1);
        c.node_id = "a".into();
        assert_eq!(choose(&c, 0, "a", 1).unwrap().kind, TransportKind::Shm);
        assert_eq!(choose(&c, 0, "b", 1).unwrap().kind, TransportKind::Tcp);
        c.shm_disable = true;
        let e = choose(&c, 0, "a", 1).unwrap();
        assert_eq!(
            (e.kind, e.reason.as_str()),
            (TransportKind::Tcp, "same node, RINGZERO_SHM_DISABLE=1")
        );
        c.shm_disable = false;
        c.transport = TransportPref::Tcp;
        assert_eq!(choose(&c, 0, "a", 1).unwrap().kind, TransportKind::Tcp);
        c.transport = TransportPref::Shm;
        assert!(choose(&c, 0, "b", 1)
            .unwrap_err()
            .to_string()
            .contains("different nodes"));
        assert_eq!(
            choose(&c, 0, "a", 1).unwrap().to_string(),
            "rank 0 → rank 1: shm (forced by RINGZERO_TRANSPORT=shm)"
        );
        c.transport = TransportPref::CudaIpc;
        assert_eq!(choose(&c, 0, "a", 1).unwrap().kind, TransportKind::Shm);
        assert_eq!(choose(&c, 0, "b", 1).unwrap().kind, TransportKind::Tcp);
    }

    fn peer(
        kind: TransportKind,
        same_gpu: bool,
        access: std::result::Result<bool, String>,
    ) -> DevicePeer {
        DevicePeer {
            host_edge: Edge {
                from: 0,
                to: 1,
                kind,
                reason: "host reason".into(),
                sockets: 0,
            },
            mine: "cuda:1".into(),
            theirs: "cuda:0".into(),
            same_gpu,
            peer_access: access,
            mps: None,
        }
    }

    #[test]
    fn device_rules_in_order() {
        let mut c = Config::new(1, 2, "127.0.0.1", 1);
        let pick = |c: &Config, p: DevicePeer| choose_device(c, &p).map(|e| (e.kind, e.reason));
        use TransportKind::*;
        // Auto.
        assert_eq!(
            pick(&c, peer(Shm, false, Ok(true))).unwrap(),
            (CudaIpc, "peer access cuda:1 ← cuda:0".into())
        );
        assert_eq!(
            pick(&c, peer(Shm, true, Ok(false))).unwrap(),
            (
                CudaIpc,
                "same GPU (cuda:1) in both processes; no MPS daemon, so they take turns on it \
                 (`nvidia-cuda-mps-control -d` runs them side by side)"
                    .into()
            )
        );
        let under_mps = DevicePeer {
            mps: Some("/tmp/nvidia-mps/control".into()),
            ..peer(Shm, true, Ok(false))
        };
        assert_eq!(
            pick(&c, under_mps).unwrap().1,
            "same GPU (cuda:1) in both processes, side by side under MPS (/tmp/nvidia-mps/control)"
        );
        assert_eq!(
            pick(&c, peer(Shm, false, Ok(false))).unwrap(),
            (
                Shm,
                "cuDeviceCanAccessPeer(cuda:1, cuda:0) = 0: host staging".into()
            )
        );
        assert_eq!(
            pick(&c, peer(Shm, false, Err("not visible here".into()))).unwrap(),
            (
                Shm,
                "peer access unknown: not visible here: host staging".into()
            )
        );
        assert_eq!(
            pick(&c, peer(Tcp, true, Ok(true))).unwrap(),
            (
                Tcp,
                "host reason; device buffers staged through pinned host memory".into()
            )
        );
        // P2P disabled wins over a shared GPU and peer access.
        c.p2p_disable = true;
        assert_eq!(
            pick(&c, peer(Shm, true, Ok(true))).unwrap(),
            (Shm, "RINGZERO_P2P_DISABLE=1: host staging".into())
        );
        // Forced shm.
        c.p2p_disable = false;
        c.transport = TransportPref::Shm;
        assert_eq!(pick(&c, peer(Shm, true, Ok(true))).unwrap().0, Shm);
        // Forced cuda_ipc: honoured where possible, an error naming why where not.
        c.transport = TransportPref::CudaIpc;
        assert_eq!(pick(&c, peer(Shm, false, Ok(true))).unwrap().0, CudaIpc);
        let e = pick(&c, peer(Shm, false, Ok(false)))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cuDeviceCanAccessPeer(cuda:1, cuda:0) = 0"),
            "{e}"
        );
        assert!(pick(&c, peer(Tcp, true, Ok(true)))
            .unwrap_err()
            .to_string()
            .contains("over tcp"));
        c.p2p_disable = true;
        assert!(pick(&c, peer(Shm, true, Ok(true)))
            .unwrap_err()
            .to_string()
            .contains("RINGZERO_P2P_DISABLE"));
    }

    #[test]
    fn a_failed_probe_falls_back_to_staging_unless_forced() {
        let mut c = Config::new(1, 2, "127.0.0.1", 1);
        let ipc = Edge {
            from: 0,
            to: 1,
            kind: TransportKind::CudaIpc,
            reason: "peer access".into(),
            sockets: 0,
        };
        assert_eq!(after_probe(&c, ipc.clone(), None).unwrap(), ipc);
        let e = after_probe(&c, ipc.clone(), Some("wrong data at byte 8")).unwrap();
        assert_eq!(
            (e.kind, e.reason.as_str()),
            (
                TransportKind::Shm,
                "cuda_ipc probe failed (wrong data at byte 8): host staging"
            )
        );
        let staged = Edge {
            kind: TransportKind::Shm,
            ..ipc.clone()
        };
        let err = after_probe(&c, staged, Some("no data after 2.0s"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rank 0") && err.contains("no data after 2.0s"),
            "{err}"
        );
        c.transport = TransportPref::CudaIpc;
        assert!(after_probe(&c, ipc, Some("wrong data")).is_err());
    }
}
