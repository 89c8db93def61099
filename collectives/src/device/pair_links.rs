//! How a device communicator's pairs are connected and driven: each pair's FIFOs opened and
//! attached through the host communicator's links, and a blocking point-to-point call run over
//! them, with its failure told to every connected peer.

use std::collections::BTreeMap;

use ringzero_kernels::{DType, ReduceOp};

use super::core::Rx;
use super::core::{Core, DevPair, DevState};
use super::records::{text, FINDING_BYTES};
use crate::comm::HostPeers;
use crate::error::{Error, Result};
use crate::ring::call::Call;
use crate::ring::device_engine::{self, DevBufs, DevLinks};
use crate::ring::{plan_p2p, Collective};
use crate::topology::{self, Edge};
use crate::transport::device::DevPtr;
use crate::transport::TransportKind;
use crate::wire::Fingerprint;
use ringzero_kernels::device::Stream;

use super::pairs::{partner, read_record, rounds, RECORD_BYTES};

impl<S: Stream> Core<S> {
    /// One point-to-point call with `peer`: send `send` (address, elements) to it, receive
    /// `recv` from it, or both; connects the pair first if it has never met.
    ///
    /// # Safety
    /// The addresses are memory of this stream's device holding the elements given (of
    /// `dtype`), not used by anything else until this returns.
    pub(super) unsafe fn p2p(
        &self,
        peer: usize,
        dtype: DType,
        send: Option<(DevPtr, usize)>,
        recv: Option<(DevPtr, usize)>,
    ) -> Result<()> {
        let fp_of = |c| Fingerprint::new(Collective::SendRecv, Some(dtype), None, c);
        let first = send.or(recv).map_or(0, |m| m.1);
        // The messages are pending in the flight record from before the pair's connect (a
        // first call that never meets is what a hang shows), finished once they have moved.
        let (sent, received) = {
            let pairs = self.pairs.lock().unwrap_or_else(|p| p.into_inner());
            pairs.get(&peer).map_or((0, 0), |p| (p.sent, p.received))
        };
        let msgs: Vec<_> = [
            send.map(|m| (peer, true, sent, fp_of(m.1))),
            recv.map(|m| (peer, false, received, fp_of(m.1))),
        ]
        .into_iter()
        .flatten()
        .collect();
        self.flight.p2p_started(&msgs);
        self.on_pairs(&fp_of(first), &[peer], |pairs| {
            let pair = pairs.get_mut(&peer).expect("connected");
            // SAFETY: forwarded from the caller.
            unsafe { self.run_pair(pair, Collective::SendRecv, dtype, send, recv) }
        })?;
        self.flight
            .p2p_finished(msgs.iter().map(|&(p, send, seq, _)| (p, send, seq)));
        Ok(())
    }

    /// Run `f` on the pairs, with `peers` connected first (those not yet, all at once), the
    /// communicator's state held: refused once it has failed (`fp` names the call), failed by
    /// any error `f` or the connect returns (every connected peer told).
    pub(super) fn on_pairs(
        &self,
        fp: &Fingerprint,
        peers: &[usize],
        f: impl FnOnce(&mut BTreeMap<usize, DevPair>) -> Result<()>,
    ) -> Result<()> {
        let mut st = self.lock();
        crate::ring::failure::refuse(st.failed.as_ref(), &self.abort, fp, st.seq)?;
        let mut pairs = self.pairs.lock().unwrap_or_else(|p| p.into_inner());
        let mut missing: Vec<usize> = peers
            .iter()
            .copied()
            .filter(|p| !pairs.contains_key(p))
            .collect();
        missing.sort_unstable();
        missing.dedup();
        let connected = if missing.is_empty() {
            Ok(())
        } else {
            self.connect_pairs(&missing).map(|made| pairs.extend(made))
        };
        let r = connected.and_then(|()| f(&mut pairs));
        drop(pairs);
        if let Err(e) = &r {
            self.fail(&mut st, e);
        }
        r
    }

    /// One message each way at most with the peer of `pair`, on its links, as part of `coll`
    /// (send-recv, or a collective built of pairs): the frames carry `coll` and the message's
    /// count, and each direction's own sequence number.
    ///
    /// # Safety
    /// As for [`Core::p2p`].
    pub(super) unsafe fn run_pair(
        &self,
        pair: &mut DevPair,
        coll: Collective,
        dtype: DType,
        send: Option<(DevPtr, usize)>,
        recv: Option<(DevPtr, usize)>,
    ) -> Result<()> {
        let es = dtype.size();
        let fp_of = |c| Fingerprint::new(coll, Some(dtype), None, c);
        let plan = plan_p2p(
            send.map(|m| m.1),
            recv.map(|m| m.1),
            (self.slot_bytes() / es).max(1),
        );
        let incoming = recv.map(|m| (pair.received, fp_of(m.1)));
        let (seq, fp) = match send {
            Some(m) => (pair.sent, fp_of(m.1)),
            None => incoming.expect("a send or a receive"),
        };
        let call = self.pair_call(&plan, (fp, seq), dtype, incoming);
        let bufs = DevBufs::Split {
            input: send.map_or(0, |m| m.0),
            input_bytes: send.map_or(0, |m| m.1 * es),
            output: recv.map_or(0, |m| m.0),
            output_bytes: recv.map_or(0, |m| m.1 * es),
        };
        // SAFETY: forwarded from the caller; `check_sizes` in `run` holds the plan to the
        // lengths given.
        unsafe { device_engine::run(&self.stream, &mut pair.links, &call, bufs) }?;
        pair.sent += u64::from(send.is_some());
        pair.received += u64::from(recv.is_some());
        Ok(())
    }

    /// The call a pair's `plan` runs as: sending as `fp` numbered `seq` in its direction,
    /// receiving the peer's message `incoming` (number, fingerprint), if any.
    pub(super) fn pair_call<'a>(
        &'a self,
        plan: &'a crate::ring::Plan,
        (fp, seq): (Fingerprint, u64),
        dtype: DType,
        incoming: Option<(u64, Fingerprint)>,
    ) -> Call<'a> {
        let wait = (self.cfg.timeout, &self.abort);
        Call {
            incoming,
            ..Call::on(
                plan,
                (seq, fp),
                (dtype, ReduceOp::Sum),
                (2, self.rank),
                wait,
            )
        }
    }

    /// All-to-all-v on device buffers: `send` and `recv` (addresses) with each rank's block at
    /// `sd[q]`/`rd[q]` elements of `sc[q]`/`rc[q]` (checked by the caller). An empty frame to the
    /// next rank announces the call (its sequence number and flight entry; a rank that called
    /// something else fails at once, both calls named); the first call connects every pair at
    /// once; this rank's own block is a local copy; then the ranks meet pair by pair in the
    /// rounds of a round-robin tournament ([`partner`]), trading their blocks both ways at once.
    ///
    /// # Safety
    /// The blocks lie in memory of this stream's device, `send`'s not written, `recv`'s not used
    /// by anything else until this returns.
    pub(super) unsafe fn all_to_all_v(
        &self,
        dtype: DType,
        send: (DevPtr, &[usize], &[usize]),
        recv: (DevPtr, &[usize], &[usize]),
    ) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.exchange_blocks(Collective::AllToAllV, dtype, send, recv) }
    }

    /// An all-to-all (`count` elements of `dtype` in `bufs`, a multiple of the world size:
    /// checked by the caller; in place it sends from the kept copy, as the ring does) as an
    /// all-to-all-v of equal blocks over the pairs:
    /// what ranks on several nodes run, where the ring's store-and-forward would carry every
    /// block that crosses between nodes, and every block that wraps round within one, over the
    /// one ring edge out of each node (on two emulated nodes of 4 ranks, 1.7× the pairs' time).
    ///
    /// # Safety
    /// As for [`Core::all_to_all_v`]: `bufs` holds the input and the output.
    pub(super) unsafe fn all_to_all_by_pairs(
        &self,
        dtype: DType,
        count: usize,
        bufs: DevBufs,
    ) -> Result<()> {
        let c = Collective::AllToAll;
        let (n, es) = (self.size, dtype.size());
        let need = count.saturating_mul(es);
        let (input, input_bytes, output, output_bytes) = match bufs {
            DevBufs::Split {
                input,
                input_bytes,
                output,
                output_bytes,
            } => (input, input_bytes, output, output_bytes),
            DevBufs::One { buf, bytes } if bytes >= need => {
                // Under the state lock, as every call that uses the kept copy; a failure fails
                // the communicator (the peers would otherwise wait for this rank's call).
                let mut st = self.lock();
                // SAFETY: `buf` holds at least `need` bytes (checked) by the caller's contract.
                let copy = unsafe { self.copy_to_send(buf, need) };
                let input = copy.inspect_err(|e| self.fail(&mut st, e))?;
                (input, need, buf, bytes)
            }
            DevBufs::One { bytes, .. } => (0, bytes, 0, bytes),
        };
        if input_bytes < need || output_bytes < need {
            return Err(Error::InvalidArgument {
                op: Fingerprint::new(c, Some(dtype), None, count).to_string(),
                msg: format!("device buffers of {bufs:?}; the call needs {need} bytes of each"),
            });
        }
        let block = count / n;
        let counts = vec![block; n];
        let at: Vec<usize> = (0..n).map(|i| i * block).collect();
        // SAFETY: forwarded from the caller; both buffers hold `count` elements (above).
        unsafe { self.exchange_blocks(c, dtype, (input, &at, &counts), (output, &at, &counts)) }
    }

    /// [`Core::all_to_all_v`] as collective `c` (all-to-all-v, or an all-to-all by pairs),
    /// which names the announcement and the pairs' frames.
    ///
    /// # Safety
    /// As for [`Core::all_to_all_v`].
    pub(super) unsafe fn exchange_blocks(
        &self,
        c: Collective,
        dtype: DType,
        (send, sd, sc): (DevPtr, &[usize], &[usize]),
        (recv, rd, rc): (DevPtr, &[usize], &[usize]),
    ) -> Result<()> {
        let (n, me, es) = (self.size, self.rank, dtype.size());
        // The announcement, under `c`'s name, so a rank in another call meets it at once.
        // Its flight entry's size is what this rank sends, as the host's all-to-all-v's.
        let bytes = (sc.iter().sum::<usize>() * es) as u64;
        self.announce(Fingerprint::new(c, Some(dtype), None, 0), dtype, bytes)?;
        let fp = Fingerprint::new(c, Some(dtype), None, sc.iter().sum());
        let others: Vec<usize> = (0..n).filter(|&q| q != me).collect();
        let r = self.on_pairs(&fp, &others, |pairs| {
            let at = |base: DevPtr, off: usize| base + (off * es) as u64;
            // SAFETY: both blocks lie in the caller's buffers (the caller's contract).
            unsafe { self.copy_and_wait(at(recv, rd[me]), at(send, sd[me]), sc[me] * es, &fp) }?;
            for k in 0..rounds(n) {
                let Some(q) = partner(n, me, k) else {
                    continue;
                };
                let pair = pairs.get_mut(&q).expect("every pair connected");
                let (s, r) = ((at(send, sd[q]), sc[q]), (at(recv, rd[q]), rc[q]));
                // SAFETY: forwarded from the caller.
                unsafe { self.run_pair(pair, c, dtype, Some(s), Some(r)) }?;
            }
            Ok(())
        });
        self.end_announced(&r);
        r
    }

    /// Gather or scatter (`c`) of blocks of `block` elements: `send` and `recv` (addresses)
    /// as [`DeviceComm::gather`](crate::Collectives::gather) and [`DeviceComm::scatter`](crate::Collectives::scatter) describe them (checked by the
    /// caller). An empty frame on the ring announces the call; the first call connects the root
    /// with every rank; the root copies its own block and then moves every other rank's over
    /// their pair, in rank order.
    ///
    /// # Safety
    /// The buffers are memory of this stream's device holding what the collective reads and
    /// writes on this rank, the written one used by nothing else until this returns.
    pub(super) unsafe fn rooted(
        &self,
        c: Collective,
        dtype: DType,
        block: usize,
        (send, recv): (DevPtr, DevPtr),
    ) -> Result<()> {
        let (n, me, es) = (self.size, self.rank, dtype.size());
        let root = c.root().expect("gather and scatter have a root");
        let gather = matches!(c, Collective::Gather { .. });
        // The flight entry's size is the root's whole buffer, as the host's.
        let bytes = (n * block * es) as u64;
        self.announce(Fingerprint::new(c, Some(dtype), None, 0), dtype, bytes)?;
        let fp = Fingerprint::new(c, Some(dtype), None, block);
        let peers: Vec<usize> = if me == root {
            (0..n).filter(|&q| q != me).collect()
        } else {
            vec![root]
        };
        let r = self.on_pairs(&fp, &peers, |pairs| {
            let at = |base: DevPtr, q: usize| base + (q * block * es) as u64;
            let msg = |a: DevPtr| Some((a, block));
            if me != root {
                let pair = pairs.get_mut(&root).expect("connected");
                let (s, r) = if gather {
                    (msg(send), None)
                } else {
                    (None, msg(recv))
                };
                // SAFETY: forwarded from the caller.
                return unsafe { self.run_pair(pair, c, dtype, s, r) };
            }
            let (dst, src) = if gather {
                (at(recv, me), send)
            } else {
                (recv, at(send, me))
            };
            // SAFETY: both blocks lie in the caller's buffers (the caller's contract).
            unsafe { self.copy_and_wait(dst, src, block * es, &fp) }?;
            for &q in &peers {
                let pair = pairs.get_mut(&q).expect("connected");
                let (s, r) = if gather {
                    (None, msg(at(recv, q)))
                } else {
                    (msg(at(send, q)), None)
                };
                // SAFETY: forwarded from the caller.
                unsafe { self.run_pair(pair, c, dtype, s, r) }?;
            }
            Ok(())
        });
        self.end_announced(&r);
        r
    }

    /// Copy `bytes` from `src` to `dst` on the stream and wait for it, within the deadline.
    ///
    /// # Safety
    /// Both ranges are memory of this stream's device, `dst`'s used by nothing else meanwhile.
    pub(super) unsafe fn copy_and_wait(
        &self,
        dst: DevPtr,
        src: DevPtr,
        bytes: usize,
        fp: &Fingerprint,
    ) -> Result<()> {
        let dev = |e| Error::Device {
            context: format!("{fp}: this rank's own block"),
            source: e,
        };
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: forwarded from the caller.
        unsafe { self.stream.copy(dst, src, bytes) }.map_err(dev)?;
        let m = self.stream.mark().map_err(dev)?;
        let what = "the local copy of this rank's own block";
        super::settle::wait_local(&self.stream, &m, self.cfg.timeout, (fp, 0, self.rank), what)
    }

    /// Fail the communicator after `e` (a refused argument fails nothing): every later call
    /// refuses, and the ring's neighbours and every connected peer are told.
    pub(super) fn fail(&self, st: &mut DevState, e: &Error) {
        let who = crate::ring::failure::Failing {
            rank: self.rank,
            flag: &self.abort,
            flight: &self.flight,
            kind: "device",
        };
        crate::ring::failure::fail(st, &who, e, |why| self.tell_pairs(why));
    }

    /// The byte counters of every pair's links together.
    pub(super) fn pair_counters(&self) -> crate::counters::Counters {
        let pairs = self.pairs.lock().unwrap_or_else(|p| p.into_inner());
        pairs
            .values()
            .fold(Default::default(), |a, p| a + p.links.counters)
    }

    /// Tell every connected peer that this rank aborts.
    pub(super) fn tell_pairs(&self, why: &str) {
        let mut pairs = self.pairs.lock().unwrap_or_else(|p| p.into_inner());
        pairs.values_mut().for_each(|p| p.links.abort(why));
    }

    /// Build this rank's device links with each of `peers` (distinct, none connected yet), each
    /// of which is doing the same with this rank: its receive FIFOs, chosen as ring edges are,
    /// then every connect info traded at once over the host's point-to-point links (a batch,
    /// which connects the host pairs without waiting in a cycle), then the attaches, in
    /// ascending peer order (a tcp pair accepts and connects at once, so two ranks meet there
    /// whatever else they connect: the lowest pair not yet joined can always go on).
    pub(super) fn connect_pairs(&self, peers: &[usize]) -> Result<Vec<(usize, DevPair)>> {
        let host = self.host.as_ref().ok_or_else(|| Error::Protocol {
            peer: format!("rank {}", peers.first().copied().unwrap_or(0)),
            detail: "a one-rank device communicator has no peers".into(),
        })?;
        let mut peers = peers.to_vec();
        peers.sort_unstable();
        let mut opened = Vec::with_capacity(peers.len());
        for &peer in &peers {
            opened.push(self.open_pair(host, peer)?);
        }
        let poster = self.poster.as_ref().expect("a host implies a poster");
        let records = opened.iter().map(|(_, _, record)| record.clone());
        let theirs = poster.exchange(peers.iter().copied().zip(records).collect(), RECORD_BYTES)?;
        let mut made = Vec::with_capacity(peers.len());
        for ((rx, recv_edge, _), (&peer, record)) in
            opened.into_iter().zip(peers.iter().zip(&theirs))
        {
            let (info, reason) = read_record(record);
            let (links, (kind, sockets)) = self.join(rx, peer, (&info, peer))?;
            made.push((peer, self.pair(links, recv_edge, (kind, sockets), reason)));
        }
        // Each side now holds the other's FIFO: say so, and hear it, so that neither returns (and
        // may close, removing a FIFO's file) before its peer has attached.
        poster.exchange(peers.iter().map(|&p| (p, vec![1u8])).collect(), 1)?;
        Ok(made)
    }

    /// Open this rank's receive FIFO from `peer`, its transport chosen as a ring edge's: the
    /// FIFO's end, the edge and why, and the record that tells `peer` how to reach it
    /// ([`RECORD_BYTES`]: the connect info, then the reason).
    pub(super) fn open_pair(&self, host: &HostPeers, peer: usize) -> Result<(Rx, Edge, Vec<u8>)> {
        let me = &self.infos[self.rank];
        let dp = self.device_peer(me, &self.infos[peer], host.edge_from(peer)?);
        let mut recv_edge = topology::choose_device(&self.cfg, &dp)?;
        if self.staged_fallback && recv_edge.kind == TransportKind::CudaIpc {
            // The ring's start-up probe found peer copies broken somewhere: not trusted.
            let why = "the ring's start-up probe found peer copies broken";
            recv_edge = topology::after_probe(&self.cfg, recv_edge, Some(why))?;
        }
        let name = crate::connect::segment_name(&self.cfg, peer, self.rank, "devp2p");
        let (rx, info) = self.open_rx(host.data_ip(), &recv_edge, peer, &name)?;
        let mut record = bytemuck::bytes_of(&info).to_vec();
        record.extend_from_slice(&text::<FINDING_BYTES>(&recv_edge.reason));
        Ok((rx, recv_edge, record))
    }

    /// The pair with `peer` over `links`: its receive edge, and the send edge's kind, tcp
    /// connections and the reason `peer` gave (logged once).
    pub(super) fn pair(
        &self,
        links: DevLinks,
        recv_edge: Edge,
        (kind, sockets): (TransportKind, usize),
        reason: String,
    ) -> DevPair {
        let send_edge = Edge {
            from: self.rank,
            to: links.next,
            kind,
            reason,
            sockets,
        };
        for e in [&recv_edge, &send_edge] {
            tracing::info!(target: "ringzero::topology", rank = self.rank,
                "device point-to-point edge {e}");
        }
        DevPair {
            links,
            sent: 0,
            received: 0,
            edges: [recv_edge, send_edge],
        }
    }
}
