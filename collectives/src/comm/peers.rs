//! What a device communicator borrows from the host communicator it was set up through: the
//! point-to-point links to connect device pairs ([`HostPeers`]) and posted host calls that
//! trade connect records without holding the host state ([`HostPoster`]).

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::topology::Edge;
use crate::work::{Work, Worker};

use super::*;

/// A device communicator's hold on its host communicator: the host's point-to-point links, over
/// which two ranks trade how to reach each other's device FIFOs when their first device
/// point-to-point call meets, and where each rank is.
pub(crate) struct HostPeers(pub(super) Arc<Inner>);

impl HostPeers {
    /// [`Communicator::nodes`].
    pub(crate) fn nodes(&self) -> usize {
        self.0.nodes()
    }

    /// How host frames from `peer` to this rank travel (shm on one node, else tcp) and why: the
    /// ring's choice ([`crate::topology::choose`]) for that pair.
    pub(crate) fn edge_from(&self, peer: usize) -> Result<Edge> {
        let node = self
            .0
            .peers
            .get()
            .and_then(|p| p.get(peer))
            .map(|p| p.node.clone())
            .ok_or_else(|| Error::Protocol {
                peer: format!("rank {peer}"),
                detail: "this communicator does not know where its peers are".into(),
            })?;
        crate::topology::choose(&self.0.cfg, peer, &node, self.0.rank)
    }

    /// [`Communicator::data_ip`].
    pub(crate) fn data_ip(&self) -> Option<std::net::IpAddr> {
        self.0.data_ip
    }

    /// A worker of its own that runs point-to-point calls on these links as the asynchronous
    /// forms do ([`Communicator::send_recv_batch_async`]: posted, so they never wait on each
    /// other in a cycle), for a device communicator's posted session to trade connect infos
    /// without waiting on its peers' turns.
    pub(crate) fn poster(&self, name: String) -> HostPoster {
        HostPoster {
            inner: self.0.clone(),
            worker: Worker::new(name),
        }
    }
}

/// Posted point-to-point calls on a communicator's host links from a thread of their own
/// ([`HostPeers::poster`]).
pub(crate) struct HostPoster {
    inner: Arc<Inner>,
    worker: Worker<posted::Posted>,
}

impl HostPoster {
    /// Post `msgs` as one call ([`Communicator::send_recv_batch_async`]'s rules, peers checked
    /// by the caller): the `Work` gives them back, receives filled.
    pub(crate) fn post(&self, msgs: Vec<P2pOwned<u8>>) -> Work<Vec<P2pOwned<u8>>> {
        let inner = self.inner.clone();
        self.worker.post(
            |fill| posted::Posted::new(msgs, move |r, msgs| fill(r.map(|()| msgs))),
            move |first, ticket, feed| inner.run_posted(first, ticket, feed),
        )
    }

    /// Send `sends[i].1` to rank `sends[i].0` and receive `len` bytes from each of those ranks,
    /// all as one posted call, and wait for it: what each sent, in the same order. (A device
    /// communicator's blocking connect: like the posted one, it holds the host communicator's
    /// point-to-point links only, not its state, so host collectives go on meanwhile.)
    pub(crate) fn exchange(
        &self,
        sends: Vec<(usize, Vec<u8>)>,
        len: usize,
    ) -> Result<Vec<Vec<u8>>> {
        let peers = sends.iter().map(|(p, _)| *p).collect::<Vec<_>>();
        let mut msgs: Vec<P2pOwned<u8>> = sends
            .into_iter()
            .map(|(p, b)| P2pOwned::Send(b, p))
            .collect();
        msgs.extend(peers.iter().map(|&p| P2pOwned::Recv(vec![0u8; len], p)));
        let checked = msgs.iter().map(P2pOwned::peer);
        pairs::check_peers(self.inner.size, self.inner.rank, checked)?;
        let done = self.post(msgs).wait()?;
        Ok(done
            .into_iter()
            .filter_map(|m| match m {
                P2pOwned::Recv(b, _) => Some(b),
                P2pOwned::Send(..) => None,
            })
            .collect())
    }
}
