//! How a [`DeviceComm`] is set up through a host [`Communicator`].
//!
//! Set-up, all of it over the host communicator's own collectives (every rank takes part):
//! 1. every rank all-gathers a [`DeviceInfo`] record (its device's UUID, name, pid, and the free
//!    space of its shm directory);
//! 2. each rank chooses the transport of the edge it *receives* on ([`topology::choose_device`]),
//!    creates that FIFO (an shm staging segment mapped into its device, or device slots from
//!    `cuMemAlloc` with an shm control block) and all-gathers a [`ConnectInfo`] record;
//! 3. each rank attaches to the FIFO of the rank it sends to;
//! 4. every edge is probed: the sender writes a pattern (never zeros) into the receiver's slot and
//!    posts it; the receiver checks every byte within a deadline. Findings are all-gathered; a
//!    failed cuda_ipc edge is rebuilt as host staging ([`topology::after_probe`]), and the probe
//!    runs again on the rebuilt edge.
//!
//! The chosen transport of both edges, with its reason, is logged once and returned by
//! [`DeviceComm::edges`].

use std::any::Any;
use std::sync::atomic::Ordering;
use std::time::Instant;

use bytemuck::Zeroable;

use super::core::{dev_err, Core, Rx, SendSide};
use super::probe::Probe;
use super::records::{
    kind_code, path_text, sent_sockets, text, untext, ConnectInfo, DeviceInfo, FINDING_BYTES,
};
use crate::comm::Communicator;
use crate::config::StagingMode;
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::ring::engine::Counters;
use crate::ring::links::{DevLinks, DevSide};
use crate::topology::{self, DevicePeer, Edge};
use crate::transport::device::{
    DevPtr, DevRecvLink, DevSendLink, FifoRecv, FifoSend, TcpDevRecv, TcpDevSend,
};
use crate::transport::shm::{ShmRecv, ShmSend};
use crate::transport::wait::Waiter;
use crate::transport::{tcp, TransportKind};
use ringzero_kernels::device::Stream;

impl<S: Stream> Core<S> {
    pub(super) fn connect(&mut self, comm: &Communicator) -> Result<()> {
        let (rank, size) = (self.rank, self.size);
        let prev = (rank + size - 1) % size;
        let next = (rank + 1) % size;
        // 1. Who is on which device.
        let me = DeviceInfo {
            uuid: self.stream.identity().unwrap_or([0; 16]),
            has_uuid: self.stream.identity().is_some() as u32,
            pid: std::process::id(),
            name: text(&self.stream.name()),
            shm_free: rustix::fs::statvfs(&self.cfg.shm_dir)
                .map(|s| s.f_bavail.saturating_mul(s.f_frsize))
                .unwrap_or(0),
        };
        let infos: Vec<DeviceInfo> = comm.all_gather_records(&me)?;
        self.shm_room = infos.iter().map(|i| i.shm_free).min().unwrap_or(0);
        // On my device: the same GPU, or for the host stream the same process.
        let mine = |i: &&DeviceInfo| {
            i.has_uuid == me.has_uuid
                && if me.has_uuid == 1 {
                    i.uuid == me.uuid
                } else {
                    i.pid == me.pid
                }
        };
        let sharers = infos.iter().filter(mine).count();
        self.one_device = sharers == infos.len();
        self.staging = self.cfg.staging.resolve(sharers, me.has_uuid == 1);
        let host_edges = comm.edges();
        let host_recv = host_edges
            .iter()
            .find(|e| e.to == rank && e.from == prev)
            .cloned()
            .ok_or_else(|| Error::Protocol {
                peer: format!("rank {prev}"),
                detail: "the host communicator has no edge from it".into(),
            })?;
        let peer = self.device_peer(&me, &infos[prev], host_recv);
        self.infos = infos.clone();
        let mut recv_edge = topology::choose_device(&self.cfg, &peer)?;
        // 2–4, at most twice: a failed cuda_ipc probe rebuilds that edge as host staging.
        const ROUNDS: u64 = 2;
        for round in 0..ROUNDS {
            let (links, (send_kind, send_sockets)) = self.build(comm, &recv_edge, prev, next)?;
            let mut links = links;
            let finding = self.probe(&mut links, round)?;
            let all = comm.all_gather_bytes(&finding.record())?;
            let code = |r: usize| all[r * FINDING_BYTES];
            let finding_of =
                |r: usize| untext(&all[r * FINDING_BYTES + 1..(r + 1) * FINDING_BYTES]);
            if let Some(r) = (0..size).find(|&r| code(r) == 2) {
                if matches!(finding, Probe::Stuck(_)) {
                    // The stuck copy may still write into the next rank's slots through these
                    // mappings: they stay open.
                    std::mem::forget(links);
                }
                return Err(Error::Protocol {
                    peer: format!("rank {r}"),
                    detail: format!(
                        "device set-up failed, no transport can be rebuilt: {}",
                        finding_of(r)
                    ),
                });
            }
            let failed = |r: usize| code(r) == 1;
            let send_edge = Edge {
                from: rank,
                to: next,
                kind: send_kind,
                reason: String::new(),
                sockets: send_sockets,
            };
            if (0..size).all(|r| !failed(r)) {
                if recv_edge.kind == TransportKind::Shm {
                    recv_edge.reason += &format!(
                        "; {} ({})",
                        match self.staging.0 {
                            StagingMode::Copy => "explicit copies through device scratch",
                            _ => "kernels read and write the mapped slots",
                        },
                        self.staging.1
                    );
                }
                // Learn the reason the next rank gave for our send edge.
                let reasons = comm.all_gather_bytes(&text::<FINDING_BYTES>(&recv_edge.reason))?;
                let their_reason =
                    untext(&reasons[next * FINDING_BYTES..(next + 1) * FINDING_BYTES]);
                let send_edge = Edge {
                    reason: their_reason,
                    ..send_edge
                };
                for e in [&recv_edge, &send_edge] {
                    tracing::info!(target: "ringzero::topology", rank, "device edge {e}");
                }
                self.edges = vec![recv_edge, send_edge];
                links.side.direct = self.direct_setup(comm, &infos)?;
                self.state
                    .get_mut()
                    .unwrap_or_else(|p| p.into_inner())
                    .links = Some(links);
                return Ok(());
            }
            drop(links);
            // Every rank saw the same findings: all slice alike on the rebuilt links.
            self.staged_fallback = true;
            let finding_text = finding_of(rank);
            recv_edge = topology::after_probe(
                &self.cfg,
                recv_edge,
                failed(rank).then_some(finding_text.as_str()),
            )?;
            if let Some(r) = (0..size).find(|&r| failed(r) && round + 1 == ROUNDS) {
                return Err(Error::Protocol {
                    peer: format!("rank {r}"),
                    detail: "device edges failed their start-up probe twice".into(),
                });
            }
        }
        Err(Error::Protocol {
            peer: format!("rank {prev}"),
            detail: "device edges failed their start-up probe twice".into(),
        })
    }

    /// What this rank (`me`) knows of the rank `p` whose device frames reach it, with the host
    /// communicator's edge between the two.
    pub(super) fn device_peer(
        &self,
        me: &DeviceInfo,
        p: &DeviceInfo,
        host_edge: Edge,
    ) -> DevicePeer {
        let same_gpu = me.has_uuid == 1 && p.has_uuid == 1 && me.uuid == p.uuid;
        let peer_access = if me.has_uuid == 0 || p.has_uuid == 0 {
            Err(format!(
                "{} and {} are not both GPUs",
                untext(&me.name),
                untext(&p.name)
            ))
        } else if same_gpu {
            Ok(true)
        } else {
            self.stream.can_access_peer(&p.uuid)
        };
        DevicePeer {
            host_edge,
            mine: untext(&me.name),
            theirs: untext(&p.name),
            same_gpu,
            peer_access,
            mps: same_gpu.then(topology::mps_control).flatten(),
        }
    }

    /// Decide whether this communicator's all-reduces, reduce-scatters, all-gathers, broadcasts and reduces run
    /// directly ([`super::direct`]) and, if so, set up the node board: rank 0 creates it, every
    /// rank maps it, rank 0 unlinks it. Every rank comes to the same answer from the same
    /// all-gathered records.
    fn direct_setup(
        &mut self,
        comm: &Communicator,
        infos: &[DeviceInfo],
    ) -> Result<Option<super::direct::Direct>> {
        use crate::config::DeviceAlgo;
        let (rank, size) = (self.rank, self.size);
        let algo = self.cfg.device_algo;
        if algo == DeviceAlgo::Ring {
            return Ok(None);
        }
        // Whom this rank can map: a rank of another process on the same GPU or on a GPU it has
        // peer access to (CUDA IPC opens no handle of its own process), or (host stream) a rank
        // of this process.
        let me = &infos[rank];
        let mut reach = [0u8; 64];
        for (q, o) in infos.iter().enumerate().take(64) {
            let ok = match (me.has_uuid, o.has_uuid) {
                (1, 1) => {
                    q == rank
                        || (me.pid != o.pid
                            && (me.uuid == o.uuid
                                || self.stream.can_access_peer(&o.uuid) == Ok(true)))
                }
                (0, 0) => me.pid == o.pid,
                _ => false,
            };
            reach[q] = ok as u8;
        }
        let node = {
            use sha2::Digest;
            let h = sha2::Sha256::digest(self.cfg.node_id.as_bytes());
            let mut b = [0u8; 32];
            b.copy_from_slice(&h);
            b
        };
        // A GPU's receive edge must have stayed cuda_ipc: one the start-up probe rebuilt as host
        // staging found peer copies broken, and the direct step is peer copies too.
        let ipc_ok = me.has_uuid == 0 || self.edges[0].kind == TransportKind::CudaIpc;
        let mut rec = [0u8; 97];
        rec[..32].copy_from_slice(&node);
        rec[32..96].copy_from_slice(&reach);
        rec[96] = ipc_ok as u8;
        let all = comm.all_gather_bytes(&rec)?;
        let of = |r: usize| &all[r * 97..(r + 1) * 97];
        let why_not = if size > ringzero_kernels::device::GATHER_MAX {
            Some(format!(
                "{size} ranks; the direct step takes at most {}",
                ringzero_kernels::device::GATHER_MAX
            ))
        } else if self.cfg.p2p_disable {
            Some("RINGZERO_P2P_DISABLE=1 forbids peer access".into())
        } else if let Some(r) = (0..size).find(|&r| of(r)[..32] != node[..]) {
            Some(format!("rank {r} is on another node"))
        } else if let Some(r) = (0..size).find(|&r| of(r)[96] == 0) {
            Some(format!(
                "rank {r}'s edge from rank {} is not cuda_ipc (peer copies failed its start-up \
                 probe or are not possible)",
                (r + size - 1) % size
            ))
        } else {
            (0..size)
                .flat_map(|r| (0..size).map(move |q| (r, q)))
                .find(|&(r, q)| of(r)[32 + q] == 0)
                .map(|(r, q)| {
                    format!(
                        "rank {r} ({}) cannot map rank {q}'s ({}) memory",
                        untext(&infos[r].name),
                        untext(&infos[q].name)
                    )
                })
        };
        let one_gpu = infos
            .iter()
            .all(|i| i.has_uuid == 1 && i.uuid == infos[0].uuid);
        let why = match (algo, why_not) {
            (DeviceAlgo::Direct, Some(w)) => {
                return Err(Error::config(
                    "RINGZERO_DEVICE_ALGO",
                    format!("`direct` needs every rank to map every other rank's buffers: {w}"),
                ))
            }
            (_, Some(_)) => return Ok(None),
            (DeviceAlgo::Auto, None) if !one_gpu => return Ok(None),
            (DeviceAlgo::Auto, None) => format!(
                "direct: all {size} ranks share {}, so each reduces its chunk of every rank's \
                 input and writes it into every output in one pass (RINGZERO_DEVICE_ALGO=ring \
                 for the slot ring)",
                untext(&me.name)
            ),
            (_, None) => format!(
                "direct (RINGZERO_DEVICE_ALGO=direct): every rank maps every other rank's \
                 buffers ({})",
                untext(&me.name)
            ),
        };
        let board = comm.node_board(&self.cfg)?;
        tracing::info!(target: "ringzero::topology", rank, "device collectives: {why}");
        self.direct_why = Some(why);
        Ok(Some(super::direct::Direct::new(board, rank, size)))
    }

    /// Bytes of one slot of this rank's device edges: the configured device slice, else the
    /// stream's choice (capped as for host staging when P2P is disabled or some edge fell back
    /// to it: [`crate::config::staged_slice_bytes`]), else the host slice; rounded up to 64 bytes.
    /// Every rank must come to the same figure (their plans slice alike), so it depends on the
    /// configuration, the kind of device and what was all-gathered (probe findings, the least
    /// free shm space) only, never on one edge's transport.
    pub(super) fn slot_bytes(&self) -> usize {
        let staged = crate::config::staged_slice_bytes(self.shm_room, self.size, self.cfg.slots);
        self.cfg
            .device_slice_bytes
            .or_else(|| {
                let b = self.stream.slice_bytes()?;
                Some(if self.cfg.p2p_disable || self.staged_fallback {
                    b.min(staged)
                } else {
                    b
                })
            })
            .unwrap_or(self.cfg.slice_bytes)
            .next_multiple_of(64)
    }

    /// Create this rank's receive FIFO for `recv_edge`, exchange connect infos, attach to the next
    /// rank's FIFO. Returns the links and the send edge's kind and tcp connections.
    fn build(
        &self,
        comm: &Communicator,
        recv_edge: &Edge,
        prev: usize,
        next: usize,
    ) -> Result<(DevLinks, (TransportKind, usize))> {
        let name = crate::connect::segment_name(&self.cfg, prev, self.rank, "dev");
        let (rx, info) = self.open_rx(comm.data_ip(), recv_edge, prev, &name)?;
        let all: Vec<ConnectInfo> = comm.all_gather_records(&info)?;
        self.join(rx, prev, (&all[next], next))
    }

    /// This rank's receive FIFO from `from` for `recv_edge` (shm segment `name`), or for a tcp
    /// edge a listener on `ip`; and how the sender attaches to it.
    pub(super) fn open_rx(
        &self,
        ip: Option<std::net::IpAddr>,
        recv_edge: &Edge,
        from: usize,
        name: &str,
    ) -> Result<(Rx, ConnectInfo)> {
        let cfg = &self.cfg;
        let (slots, slot_bytes) = (cfg.slots, self.slot_bytes());
        let mut info = ConnectInfo::zeroed();
        info.slots = slots as u32;
        info.slot_bytes = slot_bytes as u64;
        info.kind = kind_code(recv_edge.kind);
        info.sockets = recv_edge.sockets as u32;
        let rx = match recv_edge.kind {
            TransportKind::Shm => {
                let ctl = ShmRecv::create(&cfg.shm_dir, name, slots, slot_bytes, from)?;
                let (map, len) = ctl.mapping();
                let slot0 = ctl.slot_addr(0).expect("data segment");
                // SAFETY: the mapping lives in `ctl`; the FifoRecv drops `keep` (the registration)
                // before `ctl`.
                let (dev, keep) = unsafe { self.stream.map_host(map, len.next_multiple_of(4096)) }
                    .map_err(dev_err("mapping the shm staging slots into the device"))?;
                info.path = path_text(ctl.path())?;
                let base = dev + (slot0 as usize - map as usize) as u64;
                Rx::Ready(Box::new(
                    FifoRecv::new(ctl, TransportKind::Shm, base, keep)
                        .with_scratch(self.staging_scratch(slots * slot_bytes)?),
                ))
            }
            TransportKind::CudaIpc => {
                let (base, handle, keep) = self
                    .stream
                    .export(slots * slot_bytes)
                    .map_err(dev_err("allocating the device slots"))?;
                self.held.fetch_add(slots * slot_bytes, Ordering::Relaxed);
                let ctl = ShmRecv::create_control(&cfg.shm_dir, name, slots, slot_bytes, from)?;
                info.ipc = handle;
                info.path = path_text(ctl.path())?;
                Rx::Ready(Box::new(FifoRecv::new(
                    ctl,
                    TransportKind::CudaIpc,
                    base,
                    keep,
                )))
            }
            TransportKind::Tcp => {
                // A connection of its own (the host communicator's carries host frames), on the
                // address the host data connections use.
                let ip = ip.ok_or_else(|| Error::Protocol {
                    peer: format!("rank {from}"),
                    detail: "a tcp device edge without a host data address".into(),
                })?;
                let l = std::net::TcpListener::bind((ip, 0))
                    .map_err(|e| Error::io(format!("binding a device data listener on {ip}"), e))?;
                let addr = l
                    .local_addr()
                    .map_err(|e| Error::io("device data listener address", e))?;
                info.path = text(&addr.to_string());
                // Accepting starts now, on a thread of its own, so that the sender's connect
                // completes whenever it comes, whatever this rank is doing meanwhile (a posted
                // session connecting several pairs never waits on a peer's turn). The sender
                // comes once the connect infos are traded, which may take most of a deadline of
                // its own (a set-up all-gather waits on the slowest rank's progress), so the
                // thread gives up after two deadlines; whoever waits for it ([`Core::finish_rx`])
                // keeps its own.
                let (secret, job_id, rank) = (cfg.secret.clone(), cfg.job_id.clone(), self.rank);
                let (sockets, timeout) = (recv_edge.sockets, cfg.timeout.saturating_mul(2));
                let accept = std::thread::Builder::new()
                    .name(format!("ringzero-accept-{rank}-{from}"))
                    .spawn(move || -> Result<tcp::TcpRecv> {
                        let me = crate::bootstrap::Identity {
                            secret: &secret,
                            job_id: &job_id,
                            rank: rank as u32,
                        };
                        let wires = tcp::accept_wires(&l, &me, from, sockets, timeout)?;
                        tcp::TcpRecv::over(wires, from, slots, slot_bytes)
                    })
                    .map_err(|e| Error::io("starting a device data accept thread", e))?;
                Rx::Accepting(accept)
            }
        };
        Ok((rx, info))
    }

    /// Attach to the receive FIFO of `to` that `theirs` describes, then finish `rx` (a tcp
    /// edge's accept, running since [`Core::open_rx`]): the links, and the send edge's kind and
    /// tcp connections. Neither step waits on the peer's turn: its FIFO exists (or its accept
    /// runs) since it sent `theirs`.
    pub(super) fn join(
        &self,
        rx: Rx,
        from: usize,
        (theirs, to): (&ConnectInfo, usize),
    ) -> Result<(DevLinks, (TransportKind, usize))> {
        let (tx, kind) = self.attach_to(theirs, to)?;
        let rx = self.finish_rx(rx, from)?;
        Ok((
            self.links(tx, rx, from, to),
            (kind, sent_sockets(theirs, kind)),
        ))
    }

    /// Attach to the receive FIFO of `to` that `theirs` describes (for tcp, connect to its
    /// accepting listener): the send link and its transport.
    pub(super) fn attach_to(&self, theirs: &ConnectInfo, to: usize) -> Result<SendSide> {
        let path = std::path::PathBuf::from(untext(&theirs.path));
        let (t_slots, t_bytes) = (theirs.slots as usize, theirs.slot_bytes as usize);
        let me = crate::bootstrap::Identity {
            secret: &self.cfg.secret,
            job_id: &self.cfg.job_id,
            rank: self.rank as u32,
        };
        self.attach(theirs, &path, t_slots, t_bytes, to, &me)
    }

    /// The receive link of `rx`, waiting for a tcp edge's accept to end (within the deadline
    /// its thread keeps).
    pub(super) fn finish_rx(&self, rx: Rx, from: usize) -> Result<Box<dyn DevRecvLink>> {
        let h = match rx {
            Rx::Ready(r) => return Ok(r),
            Rx::Accepting(h) => h,
        };
        let (until, mut waiter) = (
            Deadline::after(Instant::now(), self.cfg.timeout),
            Waiter::backoff(),
        );
        while !h.is_finished() {
            if until.passed(Instant::now()) {
                return Err(Error::Timeout {
                    op: "device set-up".into(),
                    seq: 0,
                    peer: from,
                    waiting: format!("rank {from} to connect its device tcp link to this rank"),
                    after: self.cfg.timeout,
                });
            }
            waiter.idle(self.cfg.timeout);
        }
        let mut t = h.join().map_err(|_| Error::Io {
            context: "accepting a device data connection".into(),
            detail: "accept thread panicked".into(),
        })??;
        let (ptr, len, stride) = t.staging();
        // SAFETY: the staging is an anonymous mapping owned by `t`, which the TcpDevRecv keeps
        // (and drops after `keep`); moving `t` does not move it.
        let (dev, keep) = unsafe { self.stream.map_host(ptr, len) }
            .map_err(dev_err("mapping the tcp receive slots into the device"))?;
        Ok(Box::new(TcpDevRecv::new(t, dev, stride, keep)))
    }

    /// The links of a pair of FIFO ends: `tx` to `to`, `rx` from `from`.
    pub(super) fn links(
        &self,
        tx: Box<dyn DevSendLink>,
        rx: Box<dyn DevRecvLink>,
        from: usize,
        to: usize,
    ) -> DevLinks {
        DevLinks {
            tx,
            rx,
            next: to,
            prev: from,
            counters: Counters::default(),
            side: DevSide {
                direct: None,
                pair_copies: self.cfg.device_copy_pairs,
            },
        }
    }

    /// Device scratch of `bytes` for a host-staging link where this rank stages by explicit
    /// copies ([`DeviceComm::staging`]).
    fn staging_scratch(&self, bytes: usize) -> Result<Option<(DevPtr, Box<dyn Any + Send>)>> {
        if self.staging.0 != StagingMode::Copy {
            return Ok(None);
        }
        let scratch = self.stream.scratch(bytes).map_err(dev_err(
            "allocating device scratch for explicit-copy staging",
        ))?;
        self.held.fetch_add(bytes, Ordering::Relaxed);
        Ok(Some(scratch))
    }

    /// Attach to the next rank's receive FIFO (or connect to it) as `theirs` describes.
    fn attach(
        &self,
        theirs: &ConnectInfo,
        path: &std::path::Path,
        t_slots: usize,
        t_bytes: usize,
        next: usize,
        me: &crate::bootstrap::Identity<'_>,
    ) -> Result<SendSide> {
        Ok(match theirs.kind {
            1 => {
                let ctl = ShmSend::attach(path, t_slots, t_bytes, next)?;
                let (map, len) = ctl.mapping();
                let slot0 = ctl.slot_addr(0).expect("data segment");
                // SAFETY: as for the receiver: the FifoSend drops `keep` before `ctl`.
                let (dev, keep) = unsafe { self.stream.map_host(map, len.next_multiple_of(4096)) }
                    .map_err(dev_err(
                        "mapping the peer's shm staging slots into the device",
                    ))?;
                let base = dev + (slot0 as usize - map as usize) as u64;
                let fifo = FifoSend::new(ctl, TransportKind::Shm, base, keep)
                    .with_scratch(self.staging_scratch(t_slots * t_bytes)?);
                (Box::new(fifo), TransportKind::Shm)
            }
            3 => {
                let ctl = ShmSend::attach_control(path, t_slots, t_bytes, next)?;
                let (base, keep) = self
                    .stream
                    .open_exported(&theirs.ipc, t_slots * t_bytes)
                    .map_err(dev_err(&format!("opening rank {next}'s device slots")))?;
                (
                    Box::new(FifoSend::new(ctl, TransportKind::CudaIpc, base, keep)),
                    TransportKind::CudaIpc,
                )
            }
            2 => {
                let addr: std::net::SocketAddr =
                    path.to_string_lossy()
                        .parse()
                        .map_err(|_| Error::Protocol {
                            peer: format!("rank {next}"),
                            detail: format!("bad device data address `{}`", path.display()),
                        })?;
                let k = theirs.sockets as usize;
                if !(1..=crate::config::MAX_TCP_SOCKETS).contains(&k) {
                    return Err(Error::Protocol {
                        peer: format!("rank {next}"),
                        detail: format!("{k} tcp connections asked for its device edge"),
                    });
                }
                let wires = tcp::connect_wires(addr, me, next, k, self.cfg.timeout)?;
                let mut t = tcp::TcpSend::over(wires, next, t_slots, t_bytes)?;
                let (ptr, len, stride) = t.staging();
                // SAFETY: the staging is an anonymous mapping owned by `t`, which the TcpDevSend
                // keeps (and drops after `keep`); moving `t` does not move it.
                let (dev, keep) = unsafe { self.stream.map_host(ptr, len) }
                    .map_err(dev_err("mapping the tcp send staging into the device"))?;
                (
                    Box::new(TcpDevSend::new(t, dev, stride, keep)),
                    TransportKind::Tcp,
                )
            }
            k => {
                return Err(Error::Protocol {
                    peer: format!("rank {next}"),
                    detail: format!("unknown device transport code {k}"),
                })
            }
        })
    }
}
