//! Point-to-point on device buffers: [`DeviceComm::send`](crate::Collectives::send), [`DeviceComm::recv`](crate::Collectives::recv),
//! [`DeviceComm::send_recv`](crate::Collectives::send_recv).
//!
//! The ring's edges reach the neighbours only, and one way round; a pipeline sends activations
//! to the next stage and gradients back to the one before. So two ranks that meet in a
//! point-to-point call get device links of their own, one FIFO each way, chosen and built as a
//! ring edge is ([`topology::choose_device`]: `cuda_ipc` slots where peer copies work, host
//! staging in `/dev/shm` where they are off or were found broken at set-up, tcp between nodes)
//! when the pair's first call meets: the two trade their connect infos over the host
//! communicator's own point-to-point links, so no other rank takes part. Later calls need no
//! rendezvous. Each direction numbers its messages (a frame's sequence number), so a message is
//! matched by the peer's next receive whatever else either rank does meanwhile; a receive
//! expecting another count or element type fails with both calls named. The asynchronous forms
//! are posted calls, moved by the proxy thread as their links allow (`device/posted.rs`), their
//! pairs connected there without waiting on a peer's turn.
//!
//! All-to-all-v is built on the pairs: the ranks meet pair by pair in the rounds of a
//! round-robin tournament ([`partner`]), each pair trading its two blocks at once.
//!
//! Not done: the pair's links get no start-up probe of their own (the ring's probe decides, for
//! every pair, whether peer copies are trusted), and a blocking call moves at most one message
//! each way (posted calls to several peers move at once).

use super::comm::DeviceComm;
use super::records::{untext, ConnectInfo, FINDING_BYTES};
use super::DeviceMemory;
use crate::error::{Error, Result};
use crate::ring::Collective;
use crate::topology::Edge;
use crate::wire::Fingerprint;
use crate::work::Work;
use ringzero_kernels::device::Stream;

impl<S: Stream> DeviceComm<S> {
    /// Connect this rank's device links with each of `peers` it has not met yet, now and all at
    /// once, instead of at each pair's first call: every one of them must call this (or a
    /// point-to-point call with this rank) too. Connecting them together never waits in a
    /// cycle, so ranks whose first calls would form one (each sending to the rank before it)
    /// can call this first with the ranks they will talk to.
    pub fn connect_peers(&self, peers: &[usize]) -> Result<()> {
        check(self, &peers.iter().map(|&p| (true, p)).collect::<Vec<_>>())?;
        self.wait_async();
        let fp = Fingerprint::new(Collective::SendRecv, None, None, 0);
        self.core().on_pairs(&fp, peers, |_| Ok(()))
    }

    /// The device edges with `peer` (from it, then to it) once a point-to-point call has
    /// connected them, with the transport and why; `None` before.
    pub fn pair_edges(&self, peer: usize) -> Option<[Edge; 2]> {
        let pairs = self.core().pairs.lock().unwrap_or_else(|p| p.into_inner());
        pairs.get(&peer).map(|p| p.edges.clone())
    }
}

/// Asynchronous forms: owned buffers, driven by the proxy thread (see [`DeviceComm`]): the
/// point-to-point calls are posted (`device/posted.rs`), all-to-all-v runs in submission order
/// with the collectives; bad peers fail the `Work` at once.
impl<S: Stream + 'static> DeviceComm<S> {}

/// One message of [`DeviceComm::send_recv_batch_async`] (torch's `P2POp`), on a buffer it
/// owns: a send's comes back as it went, a receive's (its length the count expected) filled.
#[derive(Debug)]
pub enum DeviceP2p<B> {
    /// Send the buffer to the rank.
    Send(B, usize),
    /// Receive into the buffer from the rank.
    Recv(B, usize),
}

impl<S: Stream + 'static> DeviceComm<S> {
    /// Post `msgs` as one call (torch's `batch_isend_irecv`): each message to or from its own
    /// peer, moving as its link allows, as [`DeviceComm::send_async`](crate::NonBlocking::send_async)'s do; the `Work` gives
    /// the messages back in the order given, receives filled, once every one has moved.
    /// Messages to one peer (and from one) keep their order. Element types may differ between
    /// messages, each matched with its peer's. A bad peer fails the `Work` at once and moves
    /// nothing.
    pub fn send_recv_batch_async<B>(&self, msgs: Vec<DeviceP2p<B>>) -> Work<Vec<DeviceP2p<B>>>
    where
        B: DeviceMemory<S> + Send + 'static,
    {
        let peers: Vec<(bool, usize)> = msgs
            .iter()
            .map(|m| match m {
                DeviceP2p::Send(_, p) => (true, *p),
                DeviceP2p::Recv(_, p) => (false, *p),
            })
            .collect();
        if let Err(e) = check(self, &peers) {
            return Work::failed(e);
        }
        let raw = msgs
            .into_iter()
            .map(|m| match m {
                DeviceP2p::Send(b, p) => (true, p, b),
                DeviceP2p::Recv(b, p) => (false, p, b),
            })
            .collect();
        self.post_p2p(raw, move |bufs| {
            bufs.into_iter()
                .zip(peers)
                .map(|(b, (send, p))| {
                    if send {
                        DeviceP2p::Send(b, p)
                    } else {
                        DeviceP2p::Recv(b, p)
                    }
                })
                .collect()
        })
    }
}

/// The one buffer of a one-message call.
pub(super) fn one<B>(mut b: Vec<B>) -> B {
    b.pop().expect("one buffer in, one out")
}

/// Where each rank's block starts in an all-to-all-v's `send` and `recv` (elements), or why the
/// counts or element types do not fit them.
pub(super) fn a2av_layout<S: Stream, B: DeviceMemory<S> + ?Sized>(
    dc: &DeviceComm<S>,
    (send, sc): (&B, &[usize]),
    (recv, rc): (&B, &[usize]),
) -> Result<(Vec<usize>, Vec<usize>)> {
    super::same_dtype(Collective::AllToAllV, send.dtype(), recv.dtype())?;
    crate::comm::pairwise::all_to_all_v_layout(
        (dc.rank(), dc.size()),
        (sc, send.elems()),
        (rc, recv.elems()),
    )
}

/// Refuse a gather or scatter (`c`) whose root is no rank, whose buffers' element types differ,
/// or whose root's whole buffer (`whole`) is not `size()` times the block (`block`), as the host
/// communicator does.
pub(super) fn rooted_check<S: Stream, B: DeviceMemory<S> + ?Sized>(
    dc: &DeviceComm<S>,
    c: Collective,
    (block, block_name): (&B, &str),
    (whole, whole_name): (&B, &str),
) -> Result<()> {
    let root = c.root().expect("gather and scatter have a root");
    let n = dc.size();
    if root >= n {
        return Err(Error::InvalidArgument {
            op: c.name().into(),
            msg: format!("root {root} is not a rank of this {n}-rank communicator"),
        });
    }
    if dc.rank() != root {
        return Ok(());
    }
    super::same_dtype(c, block.dtype(), whole.dtype())?;
    if block.elems().checked_mul(n) != Some(whole.elems()) {
        return Err(Error::InvalidArgument {
            op: c.name().into(),
            msg: format!(
                "{whole_name} has {} elements but the root moves {n} × {} (the world size times \
                 {block_name}'s length)",
                whole.elems(),
                block.elems()
            ),
        });
    }
    Ok(())
}

/// Refuse a peer that is not another rank, as the host communicator does.
pub(super) fn check<S: Stream>(dc: &DeviceComm<S>, msgs: &[(bool, usize)]) -> Result<()> {
    crate::comm::pairs::check_peers(dc.size(), dc.rank(), msgs.iter().copied())
}

/// Bytes of the record a rank sends a peer it connects a pair with ([`Core::open_pair`]).
pub(super) const RECORD_BYTES: usize = std::mem::size_of::<ConnectInfo>() + FINDING_BYTES;

/// The connect info and the reason in a peer's record ([`RECORD_BYTES`] long).
pub(super) fn read_record(record: &[u8]) -> (ConnectInfo, String) {
    let (info, reason) = record.split_at(std::mem::size_of::<ConnectInfo>());
    (bytemuck::pod_read_unaligned(info), untext(reason))
}

/// Rounds of the round-robin tournament on `n` ranks: `n − 1`, or `n` when `n` is odd (each rank
/// sits one out).
pub fn rounds(n: usize) -> usize {
    if n < 2 {
        0
    } else {
        n + n % 2 - 1
    }
}

/// Whom rank `r` of `n` meets in round `k` of the round-robin tournament (the circle method:
/// with `m` the even number of seats, `n` or `n + 1`, the last seat meets `k`, and every other
/// seat `s` meets `2k − s` modulo `m − 1`), or `None` when it sits the round out (odd `n`). Every
/// round pairs ranks off, and over [`rounds`] rounds every two ranks meet exactly once. Pure.
pub fn partner(n: usize, r: usize, k: usize) -> Option<usize> {
    let m = n + n % 2;
    let p = if r == m - 1 {
        k
    } else if r == k {
        m - 1
    } else {
        (2 * k + (m - 1) - r) % (m - 1)
    };
    (p < n).then_some(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_round_pairs_ranks_off_and_every_two_meet_once() {
        for n in 1..=12 {
            let mut met = std::collections::BTreeSet::new();
            for k in 0..rounds(n) {
                let mut idle = 0;
                for r in 0..n {
                    let Some(p) = partner(n, r, k) else {
                        idle += 1;
                        continue;
                    };
                    assert_ne!(p, r, "n={n} round {k}");
                    assert_eq!(partner(n, p, k), Some(r), "n={n} round {k}: not mutual");
                    assert!(met.insert((r, p)), "n={n}: {r} meets {p} twice");
                }
                // At most one rank sits a round out, and only when n is odd.
                assert_eq!(idle, n % 2, "n={n} round {k}");
            }
            assert_eq!(met.len(), n * (n - 1), "n={n}: every ordered pair once");
        }
    }
}
