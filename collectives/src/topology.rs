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
}

impl fmt::Display for Edge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} → rank {}: {} ({})",
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
        TransportPref::Auto if !same => {
            edge(TransportKind::Tcp, format!("different nodes (`{from_node}` vs `{}`)", cfg.node_id))
        }
        TransportPref::Auto if cfg.shm_disable => edge(TransportKind::Tcp, "same node, RINGZERO_SHM_DISABLE=1".into()),
        TransportPref::Auto => edge(TransportKind::Shm, format!("same node `{}`", cfg.node_id)),
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
    }
}
