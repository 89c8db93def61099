//! How a communicator's two ring edges get connected: rendezvous through rank 0's store, choose
//! each edge's transport (the receiver decides), create or attach the shm FIFO or open the
//! authenticated TCP connection, in parallel for both directions.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};

use crate::bootstrap::handshake::Role;
use crate::bootstrap::peers::PeerListener;
use crate::bootstrap::{Identity, StoreClient, StoreServer};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::ring::engine::Links;
use crate::ring::failure::AbortFlag;
use crate::topology::{self, Edge};
use crate::transport::shm::{ShmRecv, ShmSend};
use crate::transport::{tcp, RecvLink, SendLink, TransportKind};

/// Rendezvous, choose transports, connect both ring edges. Rank 0 serves the store: `server`
/// when one was started already (a split's), else one it starts on the master port.
#[allow(clippy::type_complexity)]
pub(crate) fn connect_ring(
    cfg: &Config,
    server: Option<StoreServer>,
) -> Result<(
    Option<Links>,
    Vec<Edge>,
    Option<StoreServer>,
    Option<std::net::IpAddr>,
)> {
    let rank = cfg.launch.rank;
    let (host, port) = (cfg.launch.master_addr.as_str(), cfg.launch.master_port);
    let server = if server.is_some() {
        server
    } else if rank == 0 {
        Some(StoreServer::start(
            store_bind_addr(host, port)?,
            cfg.secret.clone(),
            cfg.job_id.clone(),
            cfg.timeout,
        )?)
    } else {
        None
    };
    let (links, edges, ip) = connect_stride(cfg, 1).inspect_err(|_| {
        if let Some(s) = &server {
            s.linger_for_refused(
                cfg.launch.world_size,
                cfg.timeout.min(std::time::Duration::from_secs(10)),
            );
        }
    })?;
    Ok((Some(links), edges, server, Some(ip)))
}

/// Connect the links of the ring with stride `stride`: to rank `rank + stride` and from rank
/// `rank − stride` (stride 1 is the communicator's ring). Every rank must call it with the same
/// stride at about the same time; rank 0's store must be up. Returns the links, the two edges
/// (receive, send) and this rank's data address.
pub(crate) fn connect_stride(
    cfg: &Config,
    stride: usize,
) -> Result<(Links, Vec<Edge>, std::net::IpAddr)> {
    let (rank, size) = (cfg.launch.rank, cfg.launch.world_size);
    // Stride 1 keeps the keys it always had; the others get their own.
    let scope = match stride {
        1 => String::new(),
        _ => format!("stride{stride}/"),
    };
    connect_links(
        cfg,
        (rank + size - stride) % size,
        (rank + stride) % size,
        &scope,
    )
}

/// Where a rank can be reached after start-up: its node and its peer listener.
#[derive(Clone, Debug)]
pub(crate) struct PeerAddr {
    /// Node id (`RINGZERO_NODE_ID`).
    pub node: String,
    /// Its [`PeerListener`]'s address.
    pub addr: SocketAddr,
}

/// Connect this rank's two links with `peer` alone, one each way, for their point-to-point
/// calls, straight between the two ranks (no store: rank 0 may have left). Both must call it at
/// about the same time (each one's first send or receive naming the other). Each dials the
/// other's peer listener and takes the other's call from its own; on the stream it dialled it
/// sends how it receives (shm segment or tcp), and reads on the accepted one how the peer
/// receives. A tcp link then carries its frames on that same connection and, with
/// `RINGZERO_TCP_SOCKETS` above 1, on as many more as the receiver published, dialled once the
/// count is known. `role` tells a pair's point-to-point links from its pairwise collectives'
/// ones.
pub(crate) fn connect_pair(
    cfg: &Config,
    (peer, role): (usize, Role),
    theirs: &PeerAddr,
    listener: &PeerListener,
    abort: &AbortFlag,
    what: &str,
) -> Result<(Links, Vec<Edge>)> {
    let rank = cfg.launch.rank;
    let me = Identity {
        secret: &cfg.secret,
        job_id: &cfg.job_id,
        rank: rank as u32,
    };
    let slot_bytes = cfg.slice_bytes;
    let label = match role {
        Role::Pairwise => "pairwise",
        _ => "pair",
    };
    let (recv_edge, shm_rx, published) =
        receive_side(cfg, peer, &theirs.node, label, cfg.tcp_sockets)?;
    let mut incoming = Incoming {
        key: (peer, role),
        want: match recv_edge.kind {
            TransportKind::Tcp => recv_edge.sockets,
            _ => 1,
        },
        wires: Vec::new(),
    };
    // Dial and accept at once: each side waits for the other's call. The first connection each
    // way carries the published text (and, for tcp, the link's frames).
    let (out, taken) = std::thread::scope(|s| {
        let dial = s.spawn(|| -> Result<TcpStream> {
            let mut out = tcp::connect_as(theirs.addr, &me, role, peer, cfg.timeout)?;
            tcp::write_intro(&mut out, 0, 0)
                .and_then(|()| write_blob(&mut out, published.as_bytes()))
                .map_err(|e| Error::io(format!("telling rank {peer} how this rank receives"), e))?;
            Ok(out)
        });
        let taken = incoming.take_until(
            listener,
            |w| w.first().is_some_and(Option::is_some),
            cfg,
            abort,
            what,
        );
        let out = dial.join().map_err(|_| Error::Io {
            context: format!("connecting to rank {peer}"),
            detail: "the dialling thread panicked".into(),
        });
        (out, taken)
    });
    let (out, ()) = (out??, taken?);
    let inc = incoming.wires[0].as_mut().expect("taken above");
    let info = read_blob(inc).map_err(|e| Error::PeerLost {
        op: what.into(),
        seq: 0,
        peer,
        detail: format!("reading how rank {peer} receives: {e}"),
    })?;
    let route = parse_published(&String::from_utf8_lossy(&info), peer)?;
    // The rest of a tcp link's connections, both ways at once: ours now that the peer's count is
    // known, the peer's as they come.
    let (extra, rest) = std::thread::scope(|s| {
        let dial = s.spawn(|| -> Result<Vec<TcpStream>> {
            let k = match route.kind {
                TransportKind::Tcp => route.sockets,
                _ => 1,
            };
            (1..k)
                .map(|i| {
                    let mut c = tcp::connect_as(theirs.addr, &me, role, peer, cfg.timeout)?;
                    tcp::write_intro(&mut c, i, k).map_err(|e| {
                        Error::io(
                            format!("opening connection {} of {k} to rank {peer}", i + 1),
                            e,
                        )
                    })?;
                    Ok(c)
                })
                .collect()
        });
        let want = incoming.want;
        let rest = incoming.take_until(
            listener,
            |w| w.len() == want && w.iter().all(Option::is_some),
            cfg,
            abort,
            what,
        );
        let extra = dial.join().map_err(|_| Error::Io {
            context: format!("connecting to rank {peer}"),
            detail: "the dialling thread panicked".into(),
        });
        (extra, rest)
    });
    let (extra, ()) = (extra??, rest?);
    let shm_tx = match route.kind {
        TransportKind::Shm => Some(ShmSend::attach(
            route.path.as_ref(),
            cfg.slots,
            slot_bytes,
            peer,
        )?),
        _ => None,
    };
    // Neither side goes on before both have attached: a rank whose calls with the peer end at
    // once (sends that fit the slots) could otherwise drop its receive segment before the peer
    // maps it. The byte precedes any frame on a tcp link's streams.
    let mut out = out;
    let inc = incoming.wires[0].as_mut().expect("taken above");
    both_attached(&mut out, inc, peer, what)?;
    let tx: Box<dyn SendLink> = match shm_tx {
        Some(tx) => Box::new(tx),
        None => Box::new(tcp::TcpSend::over(
            std::iter::once(out).chain(extra).collect(),
            peer,
            cfg.slots,
            slot_bytes,
        )?),
    };
    let rx: Box<dyn RecvLink> = match shm_rx {
        Some(rx) => Box::new(rx),
        None => Box::new(tcp::TcpRecv::over(
            incoming.wires.into_iter().flatten().collect(),
            peer,
            1,
            slot_bytes,
        )?),
    };
    let send_edge = route.edge(rank, peer);
    let links = Links::new(tx, rx, peer, peer)?;
    Ok((links, vec![recv_edge, send_edge]))
}

/// Neither side goes on before both have attached: a rank whose calls with the peer end at
/// once (sends that fit the slots) could otherwise drop its receive segment before the peer maps
/// it. Each side writes one byte on its first connection and reads the peer's; the byte precedes
/// any frame on a tcp link's streams.
fn both_attached(out: &mut TcpStream, inc: &mut TcpStream, peer: usize, what: &str) -> Result<()> {
    out.write_all(&[ATTACHED])
        .and_then(|()| {
            let mut b = [0u8];
            inc.read_exact(&mut b)?;
            match b[0] {
                ATTACHED => Ok(()),
                x => Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("byte {x:#04x} where the attach acknowledgement was expected"),
                )),
            }
        })
        .map_err(|e| Error::PeerLost {
            op: what.into(),
            seq: 0,
            peer,
            detail: format!("waiting for rank {peer} to attach to this rank's links: {e}"),
        })
}

/// A pair's incoming connections by index ([`tcp::write_intro`]): the listener hands them over in
/// the order their handshakes end, which need not be the order they were dialled.
struct Incoming {
    key: (usize, Role),
    /// Connections this rank's receive side takes: its published count for tcp, else one (the
    /// connection that carries the published text).
    want: usize,
    wires: Vec<Option<TcpStream>>,
}

impl Incoming {
    /// Take the peer's connections, placing each by its index, until `done`.
    fn take_until(
        &mut self,
        listener: &PeerListener,
        done: impl Fn(&[Option<TcpStream>]) -> bool,
        cfg: &Config,
        abort: &AbortFlag,
        what: &str,
    ) -> Result<()> {
        let peer = self.key.0;
        while !done(&self.wires) {
            let mut s = listener.take(self.key, cfg.timeout, abort, what)?;
            tcp::tune(&s);
            let bad = |detail: String| Error::Protocol {
                peer: format!("rank {peer}"),
                detail,
            };
            let (i, count) = tcp::read_intro(&mut s, cfg.timeout)
                .map_err(|e| bad(format!("reading which connection of the link this is: {e}")))?;
            // The first connection comes before the peer knows this rank's count (it reads it
            // there): it says 0.
            if i >= self.want || (i > 0 && count != self.want) {
                return Err(bad(format!(
                    "opened connection {} of {count} where this rank published {}",
                    i + 1,
                    self.want
                )));
            }
            if self.wires.len() < self.want {
                self.wires.resize_with(self.want, || None);
            }
            if self.wires[i].replace(s).is_some() {
                return Err(bad(format!("opened connection {} twice", i + 1)));
            }
        }
        Ok(())
    }
}

/// What each side of [`connect_pair`] writes once it has attached its send link.
const ATTACHED: u8 = 0xA7;

/// Length-prefixed bytes (u32 little-endian length).
fn write_blob(s: &mut TcpStream, b: &[u8]) -> std::io::Result<()> {
    s.write_all(&(b.len() as u32).to_le_bytes())?;
    s.write_all(b)
}

/// Bytes written by [`write_blob`] (at most 64 KiB), within the stream's read timeout.
fn read_blob(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut n = [0u8; 4];
    s.read_exact(&mut n)?;
    let n = u32::from_le_bytes(n) as usize;
    if n > 1 << 16 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{n} bytes is not an edge description"),
        ));
    }
    let mut b = vec![0u8; n];
    s.read_exact(&mut b)?;
    Ok(b)
}

/// Connect a link to `next` and one from `prev` (the same rank on two ranks), rendezvousing under
/// the store keys of `scope`. Returns the links, the two edges (receive, send) and this rank's
/// data address.
fn connect_links(
    cfg: &Config,
    prev: usize,
    next: usize,
    scope: &str,
) -> Result<(Links, Vec<Edge>, std::net::IpAddr)> {
    let rank = cfg.launch.rank;
    let key = |what: &str, r: usize| format!("{scope}{what}/{r}");
    let me = Identity {
        secret: &cfg.secret,
        job_id: &cfg.job_id,
        rank: rank as u32,
    };
    let (host, port) = (cfg.launch.master_addr.as_str(), cfg.launch.master_port);
    let mut store = StoreClient::connect(host, port, &me, cfg.timeout)?;
    let ip = store.local_addr()?.ip();
    let listener = TcpListener::bind((ip, 0))
        .map_err(|e| Error::io(format!("binding a data listener on {ip}"), e))?;
    let listen = listener
        .local_addr()
        .map_err(|e| Error::io("data listener address", e))?;
    store.set(
        &key("rank", rank),
        format!("{}\n{listen}", cfg.node_id).as_bytes(),
    )?;

    let info = |store: &mut StoreClient, r: usize| -> Result<(String, SocketAddr)> {
        let v = String::from_utf8(store.get(&key("rank", r), r)?).map_err(|_| Error::Protocol {
            peer: format!("rank {r}"),
            detail: "rank info is not UTF-8".into(),
        })?;
        let (node, addr) = v.rsplit_once('\n').ok_or_else(|| Error::Protocol {
            peer: format!("rank {r}"),
            detail: format!("bad rank info `{v}`"),
        })?;
        let addr = addr.parse().map_err(|_| Error::Protocol {
            peer: format!("rank {r}"),
            detail: format!("bad address `{addr}`"),
        })?;
        Ok((node.to_string(), addr))
    };
    let (prev_node, _) = info(&mut store, prev)?;
    let (_, next_addr) = info(&mut store, next)?;

    // This rank decides the edge it receives on, creates its FIFO, and publishes the choice.
    let slot_bytes = cfg.slice_bytes;
    let (recv_edge, shm_rx, published) =
        receive_side(cfg, prev, &prev_node, "host", cfg.tcp_sockets)?;
    store.set(&key("edge", rank), published.as_bytes())?;
    let theirs = String::from_utf8(store.get(&key("edge", next), next)?).unwrap_or_default();
    let route = parse_published(&theirs, next)?;
    let send_edge = route.edge(rank, next);

    let (tx, rx): (Box<dyn SendLink>, Box<dyn RecvLink>) = std::thread::scope(|s| -> Result<_> {
        let accept = match shm_rx {
            Some(rx) => {
                let b: Box<dyn RecvLink> = Box::new(rx);
                Ok(b)
            }
            None => Err(s.spawn(|| -> Result<Box<dyn RecvLink>> {
                let wires =
                    tcp::accept_wires(&listener, &me, prev, recv_edge.sockets, cfg.timeout)?;
                Ok(Box::new(tcp::TcpRecv::over(wires, prev, 1, slot_bytes)?))
            })),
        };
        let tx: Result<Box<dyn SendLink>> = match route.kind {
            TransportKind::Shm => ShmSend::attach(route.path.as_ref(), cfg.slots, slot_bytes, next)
                .map(|t| Box::new(t) as _),
            TransportKind::Tcp => {
                tcp::connect_wires(next_addr, &me, next, route.sockets, cfg.timeout)
                    .and_then(|w| tcp::TcpSend::over(w, next, cfg.slots, slot_bytes))
                    .map(|t| Box::new(t) as _)
            }
            TransportKind::CudaIpc => Err(host_cuda_ipc()),
        };
        let rx = match accept {
            Ok(rx) => rx,
            Err(handle) => handle.join().map_err(|_| Error::Io {
                context: "accepting".into(),
                detail: "accept thread panicked".into(),
            })??,
        };
        Ok((tx?, rx))
    })?;
    for e in [&recv_edge, &send_edge] {
        tracing::info!(target: "ringzero::topology", rank, "{e}");
    }
    let links = Links::new(tx, rx, next, prev)?;
    Ok((links, vec![recv_edge, send_edge], ip))
}

/// This rank's side of the edge it receives on from rank `from` (on node `from_node`): the
/// transport (the receiver decides), its shm FIFO when shm (`what` names the segment: host,
/// pair), and the text that tells the sender how to reach it. A tcp edge gets `sockets`
/// connections.
fn receive_side(
    cfg: &Config,
    from: usize,
    from_node: &str,
    what: &str,
    sockets: usize,
) -> Result<(Edge, Option<ShmRecv>, String)> {
    let rank = cfg.launch.rank;
    let mut edge = topology::choose(cfg, from, from_node, rank)?;
    let shm_rx = match edge.kind {
        TransportKind::Shm => Some(ShmRecv::create(
            &cfg.shm_dir,
            &segment_name(cfg, from, rank, what),
            cfg.slots,
            cfg.slice_bytes,
            from,
        )?),
        TransportKind::Tcp => {
            edge.sockets = sockets;
            None
        }
        TransportKind::CudaIpc => return Err(host_cuda_ipc()),
    };
    let published = match &shm_rx {
        Some(rx) => format!("shm\n{}\n{}", edge.reason, rx.path().display()),
        None => format!("tcp\n{}\n{}", edge.reason, edge.sockets),
    };
    Ok((edge, shm_rx, published))
}

/// How a rank receives on its edge from us, as [`receive_side`] published it.
struct Route {
    kind: TransportKind,
    reason: String,
    /// The shm file (shm).
    path: String,
    /// The connections to open (tcp).
    sockets: usize,
}

impl Route {
    fn edge(&self, from: usize, to: usize) -> Edge {
        Edge {
            from,
            to,
            kind: self.kind,
            reason: self.reason.clone(),
            sockets: self.sockets,
        }
    }
}

/// The sender's reading of what [`receive_side`] published by rank `to`.
fn parse_published(text: &str, to: usize) -> Result<Route> {
    let mut parts = text.splitn(3, '\n');
    let (kind, reason, rest) = (
        parts.next().unwrap_or(""),
        parts.next().unwrap_or(""),
        parts.next().unwrap_or(""),
    );
    let bad = || Error::Protocol {
        peer: format!("rank {to}"),
        detail: format!("bad edge info `{text}`"),
    };
    let (kind, path, sockets) = match kind {
        "shm" => (TransportKind::Shm, rest.to_string(), 0),
        "tcp" => {
            let k: usize = rest.parse().map_err(|_| bad())?;
            if !(1..=crate::config::MAX_TCP_SOCKETS).contains(&k) {
                return Err(bad());
            }
            (TransportKind::Tcp, String::new(), k)
        }
        _ => return Err(bad()),
    };
    Ok(Route {
        kind,
        reason: reason.to_string(),
        path,
        sockets,
    })
}

fn host_cuda_ipc() -> Error {
    Error::config(
        "RINGZERO_TRANSPORT",
        "cuda_ipc carries device buffers only; a communicator's host edges are shm or tcp",
    )
}

/// A unique name for the shm file of the FIFO carrying frames `prev → rank` (`what`: host, dev).
pub(crate) fn segment_name(cfg: &Config, prev: usize, rank: usize, what: &str) -> String {
    crate::transport::shm::segments::fresh_name(&format!("{prev}to{rank}-{what}"), &cfg.job_id)
}

/// The store binds the master address when it is one of ours, else every interface.
fn store_bind_addr(host: &str, port: u16) -> Result<SocketAddr> {
    let addrs = crate::bootstrap::store::resolve_master(host, port)?;
    for a in &addrs {
        if TcpListener::bind(SocketAddr::new(a.ip(), 0)).is_ok() {
            return Ok(*a);
        }
    }
    Ok(SocketAddr::from(([0, 0, 0, 0], port)))
}
