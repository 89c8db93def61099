//! α and β measured on the links the ring actually uses, plus the baselines the ratios are taken
//! against (memcpy in slice-sized copies, one copy out of the previous rank's memory, and a plain
//! TCP stream pair on loopback), each paired with the timed streams so both see the same seconds.
//!
//! - α, the latency of one ring step: the mean time of a barrier (an empty-frame all-gather of
//!   n − 1 steps, every link busy at once) divided by n − 1.
//! - β, the bandwidth of each link: every rank streams `stream_bytes` to the next with
//!   [`Communicator::ring_shift`](ringzero_collectives::Collectives::ring_shift) (all links busy at once, as in the ring); the receiving rank's time
//!   gives its incoming edge's β = bytes / (time − α), the median of five streams. The model uses the
//!   slowest edge, as the ring does.
//! - memcpy: after each stream, every rank copies the same bytes from its send buffer to its
//!   receive buffer in slice-sized pieces, all ranks at once (the load the streams run under); the
//!   median per rank, averaged over ranks.
//! - copy out of the previous rank's memory (every edge shm): each rank maps a `/dev/shm` buffer
//!   the previous rank filled and, after each memcpy pass, copies it into its receive buffer the
//!   same way: what a single-copy design would do per byte (a read straight from the peer's
//!   buffer with registered buffers or XPMEM; CMA's `process_vm_readv` is such a copy done by the
//!   kernel). Where β beats it, the slot pipeline (two copies, the middle one in cache) is already
//!   the better design on that machine (`docs/design-notes.md`, "What a copy between processes
//!   costs").
//! - TCP stream pair (some edge is tcp): after each stream, rank 0 streams the same bytes both
//!   ways over two plain blocking loopback connections while the other ranks wait; the median.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use ringzero_collectives::internals::transport::shm::segments;
use ringzero_collectives::internals::transport::TransportKind;
use ringzero_collectives::{Collectives, Communicator, InPlace, ReduceOp, Result};
use serde::Serialize;

use super::theory::Model;

/// One ring edge with its measured bandwidth.
#[derive(Clone, Debug, Serialize)]
pub struct EdgeBeta {
    /// Sending rank.
    pub from: usize,
    /// Receiving rank.
    pub to: usize,
    /// Transport name.
    pub transport: String,
    /// Why this transport.
    pub reason: String,
    /// TCP connections carrying the edge (0: not tcp).
    pub sockets: usize,
    /// Measured bandwidth, GB/s.
    pub beta_gbs: f64,
}

/// What the probes found.
#[derive(Clone, Debug, Serialize)]
pub struct Probe {
    /// Latency per ring step, µs.
    pub alpha_us: f64,
    /// Every edge of the ring (edge `r` ends at rank `r`).
    pub edges: Vec<EdgeBeta>,
    /// The model used for predictions: α, and the slowest edge's β.
    #[serde(skip)]
    pub model: Model,
    /// memcpy of the probe's bytes in slice-sized copies, on every rank at once, each paired with
    /// a timed stream; the median per rank, averaged over ranks, GB/s.
    pub memcpy_gbs: f64,
    /// A plain loopback TCP stream pair, GB/s per direction (rank 0; only when an edge uses TCP).
    pub tcp_stream_gbs: Option<f64>,
    /// A copy out of the previous rank's memory (a `/dev/shm` mapping it filled) in slice-sized
    /// pieces, paired with each stream like `memcpy_gbs`, GB/s (only when every edge is shm).
    pub shared_copy_gbs: Option<f64>,
}

/// Run the probes on every rank; every rank returns the same result.
pub fn measure(comm: &Communicator, stream_bytes: usize) -> Result<Probe> {
    let n = comm.size();
    let mut memcpy = 0.0;
    let mut shared_copy = None;
    let mut tcp_pair = None;
    let (alpha_us, betas) = if n > 1 {
        // α is one ring step: the ring's barrier (n − 1 hops), whatever RINGZERO_ALGO picks.
        let ring_barrier = || comm.with_algo(ringzero_collectives::Algo::Ring).barrier();
        for _ in 0..20 {
            ring_barrier()?;
        }
        let reps = 200;
        let t = Instant::now();
        for _ in 0..reps {
            ring_barrier()?;
        }
        let mut a = vec![t.elapsed().as_secs_f64() * 1e6 / reps as f64 / (n - 1) as f64];
        comm.all_reduce(InPlace, &mut a, ReduceOp::Avg)?;

        let send = vec![1u8; stream_bytes];
        let mut recv = vec![0u8; stream_bytes];
        comm.ring_shift(&send, &mut recv)?;
        comm.barrier()?;
        // The median of several timed streams: one noisy neighbour must not set the model. Each
        // stream is paired with a plain memcpy of the same bytes in slice-sized pieces on every
        // rank at once (the baseline), so the two are measured under the same load.
        let piece = comm.config().slice_bytes;
        let peer = PeerBuffer::map_previous(comm, stream_bytes)?;
        let mut tcp = TcpBaseline::new(comm, piece)?;
        let (mut rates, mut copies, mut shared) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..5 {
            let t = Instant::now();
            comm.ring_shift(&send, &mut recv)?;
            let us = t.elapsed().as_secs_f64() * 1e6;
            rates.push(stream_bytes as f64 / ((us - a[0]).max(us * 0.5) * 1e3));
            comm.barrier()?;
            copies.push(memcpy_pass_gbs(&mut recv, &send, piece));
            comm.barrier()?;
            if let Some(p) = &peer {
                shared.push(memcpy_pass_gbs(&mut recv, p.bytes(), piece));
                comm.barrier()?;
            }
            tcp.pass(comm, stream_bytes)?;
        }
        tcp_pair = tcp.median(comm)?;
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let mine = median(&mut rates);
        let mut copy = vec![median(&mut copies), 0.0];
        if peer.is_some() {
            copy[1] = median(&mut shared);
        }
        comm.all_reduce(InPlace, &mut copy, ReduceOp::Avg)?;
        memcpy = copy[0];
        shared_copy = peer.is_some().then_some(copy[1]);
        let mut all = vec![0f64; n];
        comm.all_gather(&[mine], &mut all)?;
        (a[0], all)
    } else {
        (0.0, Vec::new())
    };
    let mut edges = Vec::new();
    if n > 1 {
        // Each rank knows its own edges; rank r's receive edge is edge r. Gather their names.
        let me = &comm.edges()[0];
        let name = format!("{}\t{}\t{}", me.kind, me.sockets, me.reason);
        let mut len = vec![name.len() as i64];
        comm.all_reduce(InPlace, &mut len, ReduceOp::Max)?;
        let width = len[0] as usize;
        let mut mine = name.into_bytes();
        mine.resize(width, b' ');
        let mut names = vec![0u8; width * n];
        comm.all_gather(&mine, &mut names)?;
        for (r, beta) in betas.iter().enumerate() {
            let text = String::from_utf8_lossy(&names[r * width..(r + 1) * width])
                .trim_end()
                .to_string();
            let mut parts = text.splitn(3, '\t');
            let (transport, sockets, reason) = (
                parts.next().unwrap_or(""),
                parts.next().and_then(|k| k.parse().ok()).unwrap_or(0),
                parts.next().unwrap_or(""),
            );
            edges.push(EdgeBeta {
                from: (r + n - 1) % n,
                to: r,
                transport: transport.to_string(),
                reason: reason.to_string(),
                sockets,
                beta_gbs: *beta,
            });
        }
    }
    let beta = edges
        .iter()
        .map(|e| e.beta_gbs)
        .fold(f64::INFINITY, f64::min);
    if n == 1 {
        let send = vec![1u8; stream_bytes.max(1)];
        let mut recv = vec![0u8; stream_bytes.max(1)];
        memcpy = memcpy_pass_gbs(&mut recv, &send, comm.config().slice_bytes);
    }
    // A collective's local copies go at the memcpy baseline's rate in the header's model.
    let model = Model {
        copy_gbs: (memcpy > 0.0).then_some(memcpy),
        ..Model::links(alpha_us, if beta.is_finite() { beta } else { 0.0 })
    };
    Ok(Probe {
        alpha_us,
        edges,
        model,
        memcpy_gbs: memcpy,
        tcp_stream_gbs: tcp_pair,
        shared_copy_gbs: shared_copy,
    })
}

/// The plain TCP stream pair, run on rank 0 after each timed stream while the other ranks wait in
/// a barrier (when any edge is tcp; every rank agrees on that first).
struct TcpBaseline {
    /// Whether any edge is tcp (the same on every rank).
    on: bool,
    /// Rank 0's pair, once connected.
    pair: Option<TcpPair>,
    rates: Vec<f64>,
}

impl TcpBaseline {
    fn new(comm: &Communicator, chunk: usize) -> Result<TcpBaseline> {
        let mut any = vec![comm.edges().iter().any(|e| e.kind == TransportKind::Tcp) as i64];
        comm.all_reduce(InPlace, &mut any, ReduceOp::Max)?;
        let on = any[0] != 0;
        let pair = if on && comm.rank() == 0 {
            TcpPair::connect(chunk)
                .map_err(|e| {
                    tracing::warn!(target: "ringzero::bench", "no TCP stream pair baseline: {e}")
                })
                .ok()
        } else {
            None
        };
        Ok(TcpBaseline {
            on,
            pair,
            rates: Vec::new(),
        })
    }

    fn pass(&mut self, comm: &Communicator, bytes: usize) -> Result<()> {
        if !self.on {
            return Ok(());
        }
        if let Some(p) = &mut self.pair {
            match p.pass(bytes) {
                Ok(r) => self.rates.push(r),
                Err(e) => {
                    tracing::warn!(target: "ringzero::bench", "TCP stream pair baseline failed: {e}");
                    self.pair = None;
                }
            }
        }
        comm.barrier()
    }

    /// The median pass on rank 0, on every rank.
    fn median(mut self, comm: &Communicator) -> Result<Option<f64>> {
        if !self.on {
            return Ok(None);
        }
        self.rates.sort_by(f64::total_cmp);
        let mut m = vec![self.rates.get(self.rates.len() / 2).copied().unwrap_or(0.0)];
        comm.broadcast(InPlace, &mut m, 0)?;
        Ok((m[0] > 0.0).then_some(m[0]))
    }
}

/// A file removed when this is dropped.
struct Unlink(std::path::PathBuf);

impl Drop for Unlink {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The previous rank's buffer, mapped from a `/dev/shm` file it created and filled.
struct PeerBuffer {
    map: memmap2::Mmap,
}

impl PeerBuffer {
    /// On every rank at once: create and fill this rank's buffer of `len` bytes, map the previous
    /// rank's, unlink this rank's file. `None` on every rank (with the reason logged) unless every
    /// edge is shm and every rank succeeded; an error only when a collective fails.
    fn map_previous(comm: &Communicator, len: usize) -> Result<Option<PeerBuffer>> {
        let (n, rank) = (comm.size(), comm.rank());
        // Every rank must take the same branch: agree on whether every edge is shm first.
        let mut other = vec![comm.edges().iter().any(|e| e.kind != TransportKind::Shm) as i64];
        comm.all_reduce(InPlace, &mut other, ReduceOp::Max)?;
        if len == 0 || other[0] != 0 {
            return Ok(None);
        }
        let mut token = vec![(rand::random::<u64>() >> 1) as i64];
        comm.broadcast(InPlace, &mut token, 0)?;
        // Named as every shared-memory file of the job is, so that the launcher's sweep and the
        // start-up sweep find it if this rank is killed before it removes it.
        let mut pids = vec![0i64; n];
        comm.all_gather(&[std::process::id() as i64], &mut pids)?;
        let cfg = comm.config();
        let path = |r: usize| {
            let what = format!("bench{r}");
            let name = segments::name(
                pids[r] as u32,
                &what,
                &cfg.job_id,
                &format!("{:x}", token[0]),
            );
            cfg.shm_dir.join(name)
        };
        // Removed on every way out of here, the early returns of a failed collective included.
        let own = Self::create(&path(rank), len, rank).map(|()| Unlink(path(rank)));
        let mut failed = vec![own.is_err() as i64];
        comm.all_reduce(InPlace, &mut failed, ReduceOp::Max)?;
        let peer = if failed[0] == 0 {
            Self::open(&path((rank + n - 1) % n), len)
        } else {
            Err(std::io::Error::other(match &own {
                Err(e) => format!("could not create this rank's buffer: {e}"),
                Ok(_) => "another rank could not create its buffer".into(),
            }))
        };
        let mut failed = vec![peer.is_err() as i64];
        comm.all_reduce(InPlace, &mut failed, ReduceOp::Max)?;
        // Every rank has mapped its peer's file (or given up): the names can go.
        drop(own);
        match peer {
            Ok(p) if failed[0] == 0 => Ok(Some(p)),
            Ok(_) => Ok(None),
            Err(e) => {
                tracing::warn!(target: "ringzero::bench", "no copy-between-processes baseline: {e}");
                Ok(None)
            }
        }
    }

    /// Create `path` with `len` bytes reserved up front (a `/dev/shm` too small fails here, with
    /// the space it has, instead of a SIGBUS while the buffer is filled) and fill it.
    fn create(path: &std::path::Path, len: usize, rank: usize) -> std::io::Result<()> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)?;
        let guard = Unlink(path.to_path_buf());
        let flags = rustix::fs::FallocateFlags::empty();
        let reserved = match rustix::fs::fallocate(&file, flags, 0, len as u64) {
            // A file system without fallocate: sized sparsely.
            Err(rustix::io::Errno::OPNOTSUPP) => file.set_len(len as u64),
            r => r.map_err(Into::into),
        };
        if let Err(e) = reserved {
            let free = path
                .parent()
                .and_then(|d| rustix::fs::statvfs(d).ok())
                .map_or(0, |s| s.f_bavail.saturating_mul(s.f_frsize));
            return Err(std::io::Error::other(format!(
                "reserving {len} bytes for {}: {e} ({free} bytes free there)",
                path.display()
            )));
        }
        // SAFETY: the file was just created by this process (create_new) and its space
        // reserved; the only other process that maps it does so read-only after the collective
        // that follows, once this rank has finished writing it.
        let mut map = unsafe { memmap2::MmapMut::map_mut(&file) }?;
        for (i, b) in map.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(31) ^ rank as u8;
        }
        std::mem::forget(guard);
        Ok(())
    }

    fn open(path: &std::path::Path, len: usize) -> std::io::Result<PeerBuffer> {
        let file = std::fs::File::open(path)?;
        // SAFETY: the owner finished writing the file before the collective that precedes this
        // call and never writes it again; it is only read through this mapping.
        let map = unsafe { memmap2::Mmap::map(&file) }?;
        if map.len() < len {
            return Err(std::io::Error::other(format!(
                "{} is {} bytes, expected {len}",
                path.display(),
                map.len()
            )));
        }
        Ok(PeerBuffer { map })
    }

    fn bytes(&self) -> &[u8] {
        &self.map
    }
}

/// GB/s of one pass copying `src` to `dst` in `piece`-sized copies (what each side of a shm link
/// does per slice).
pub fn memcpy_pass_gbs(dst: &mut [u8], src: &[u8], piece: usize) -> f64 {
    let piece = piece.clamp(1, src.len().max(1));
    let t = Instant::now();
    for (d, s) in dst.chunks_mut(piece).zip(src.chunks(piece)) {
        d.copy_from_slice(std::hint::black_box(s));
    }
    std::hint::black_box(&dst);
    src.len() as f64 / t.elapsed().as_secs_f64().max(1e-9) / 1e9
}

/// A plain TCP stream pair on loopback: two connections that carry bytes in opposite directions at
/// once (as the two links of a 2-rank ring do), each written in `chunk`-sized blocking writes by
/// one thread and read by another. Made once, timed once per [`TcpPair::pass`].
pub struct TcpPair {
    pairs: Vec<(std::net::TcpStream, std::net::TcpStream)>,
    chunk: usize,
}

impl TcpPair {
    /// Connect the two streams.
    pub fn connect(chunk: usize) -> std::io::Result<TcpPair> {
        let one_way = || -> std::io::Result<(std::net::TcpStream, std::net::TcpStream)> {
            let l = std::net::TcpListener::bind("127.0.0.1:0")?;
            let w = std::net::TcpStream::connect(l.local_addr()?)?;
            let (r, _) = l.accept()?;
            w.set_nodelay(true)?;
            w.set_write_timeout(Some(Duration::from_secs(30)))?;
            r.set_read_timeout(Some(Duration::from_secs(30)))?;
            Ok((w, r))
        };
        Ok(TcpPair {
            pairs: vec![one_way()?, one_way()?],
            chunk: chunk.max(1),
        })
    }

    /// Stream `total` bytes each way at once; GB/s per direction.
    pub fn pass(&mut self, total: usize) -> std::io::Result<f64> {
        let chunk = self.chunk;
        let t = Instant::now();
        let got = std::thread::scope(|scope| -> std::io::Result<usize> {
            let mut threads = Vec::new();
            for (w, r) in &mut self.pairs {
                threads.push(scope.spawn(move || -> std::io::Result<usize> {
                    let buf = vec![7u8; chunk];
                    let mut sent = 0;
                    while sent < total {
                        let k = chunk.min(total - sent);
                        w.write_all(&buf[..k])?;
                        sent += k;
                    }
                    Ok(0)
                }));
                threads.push(scope.spawn(move || -> std::io::Result<usize> {
                    let mut buf = vec![0u8; chunk];
                    let mut got = 0;
                    while got < total {
                        match r.read(&mut buf[..chunk.min(total - got)])? {
                            0 => return Err(std::io::Error::other("loopback stream closed")),
                            k => got += k,
                        }
                    }
                    Ok(got)
                }));
            }
            let mut got = 0;
            for th in threads {
                got += th
                    .join()
                    .map_err(|_| std::io::Error::other("stream thread panicked"))??;
            }
            Ok(got)
        })?;
        Ok(got as f64 / 2.0 / t.elapsed().as_secs_f64() / 1e9)
    }
}
