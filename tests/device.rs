//! Collectives on device buffers through [`DeviceComm`]. On machines without a GPU the device is
//! the host as an asynchronous stream ([`HostStream`]: work completes on a worker thread after the
//! call returns, as on a GPU), over the real shm staging FIFO with its pipelined protocol; the same
//! engine drives CUDA devices (the GPU check script runs those tests where a GPU exists).

use ringzero::{
    Collective, Collectives, Communicator, DType, DeviceComm, Error, HostStream, InPlace,
    NonBlocking, ReduceOp, StagingMode, TransportKind, TransportPref,
};

use crate::common::{all_collectives, check_with, threads, Case, Opts};

fn device_comm(comm: &Communicator) -> DeviceComm<HostStream> {
    DeviceComm::new(comm, HostStream::new())
        .unwrap_or_else(|e| panic!("rank {}: device comm: {e}", comm.rank()))
}

#[test]
fn every_collective_dtype_and_op_on_the_host_stream_matches_the_reference() {
    every_collective(
        TransportPref::Shm,
        StagingMode::Mapped,
        &[(2, 1), (3, 1), (4, 1)],
    );
}

/// Host staging with explicit copies through device scratch (`RINGZERO_STAGING=copy`).
#[test]
fn every_collective_dtype_and_op_with_explicit_copy_staging_matches_the_reference() {
    every_collective(TransportPref::Shm, StagingMode::Copy, &[(2, 1), (3, 1)]);
}

/// Device buffers between nodes: tcp edges whose staging slots are mapped into the device, of
/// one connection (two ranks) and of three (three ranks).
#[test]
fn every_collective_dtype_and_op_over_tcp_device_edges_matches_the_reference() {
    every_collective(TransportPref::Tcp, StagingMode::Mapped, &[(2, 1), (3, 3)]);
}

/// Each (ranks, tcp connections per edge) of `runs`.
fn every_collective(transport: TransportPref, staging: StagingMode, runs: &[(usize, usize)]) {
    let want = match transport {
        TransportPref::Tcp => TransportKind::Tcp,
        _ => TransportKind::Shm,
    };
    for &(n, tcp_sockets) in runs {
        // Small slots (1 KiB, 4 of them) so counts of a few thousand elements keep every slot in
        // flight and wrap the FIFO many times.
        let o = Opts {
            slice_bytes: 1024,
            transport,
            staging,
            tcp_sockets,
            ..Opts::default()
        };
        threads(n, &o, |rank, comm| {
            let comm = comm.unwrap();
            let mut dc = device_comm(&comm);
            for e in dc.edges() {
                assert_eq!(e.kind, want, "{e}");
                if want == TransportKind::Tcp {
                    assert_eq!(e.sockets, tcp_sockets, "{e}");
                }
            }
            let mut seed = 0;
            for dtype in DType::ALL {
                for op in ReduceOp::ALL {
                    for (k, coll) in all_collectives(n - 1).into_iter().enumerate() {
                        for in_place in [false, true] {
                            // Counts: empty, one element, fewer than the ranks, and enough to
                            // wrap the FIFO many times; the mix turns with the collective.
                            for count in [[3001, 1], [7, 2050], [0, 999]][(k + seed) % 3] {
                                let count = if coll == Collective::Barrier {
                                    0
                                } else {
                                    count
                                };
                                seed += 1;
                                let c = Case {
                                    coll,
                                    count,
                                    dtype,
                                    op,
                                    in_place,
                                    seed,
                                };
                                check_with(&mut dc, &c);
                            }
                        }
                    }
                }
            }
            let _ = rank;
        });
    }
}

/// Slice-sized frames (256 KiB) over tcp device edges of three connections: each frame's pinned
/// staging slot leaves in three parts.
#[test]
fn slice_sized_frames_striped_over_tcp_device_edges_match_the_reference() {
    let o = Opts {
        slice_bytes: 256 << 10,
        transport: TransportPref::Tcp,
        tcp_sockets: 3,
        ..Opts::default()
    };
    threads(3, &o, |_, comm| {
        let comm = comm.unwrap();
        let mut dc = device_comm(&comm);
        for (k, coll) in all_collectives(1).into_iter().enumerate() {
            let count = if coll == Collective::Barrier {
                0
            } else {
                200_003
            };
            for dtype in [DType::F32, DType::F16] {
                let c = Case {
                    coll,
                    count,
                    dtype,
                    op: ReduceOp::Sum,
                    in_place: k % 2 == 1,
                    seed: k,
                };
                check_with(&mut dc, &c);
            }
        }
        assert!(
            dc.edges().iter().all(|e| e.sockets == 3),
            "{:?}",
            dc.edges()
        );
    });
}

#[test]
fn device_edges_report_host_staging_and_why_and_move_the_ring_volume() {
    for (p2p_disable, reason) in [
        (
            false,
            "peer access unknown: host and host are not both GPUs: host staging",
        ),
        (true, "RINGZERO_P2P_DISABLE=1: host staging"),
    ] {
        let n = 3;
        let port = crate::common::free_port();
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..n)
                .map(|rank| {
                    let o = Opts {
                        transport: TransportPref::Auto,
                        ..Opts::default()
                    };
                    let mut cfg = crate::common::config(rank, n, port, &o);
                    cfg.p2p_disable = p2p_disable;
                    s.spawn(move || {
                        let comm = Communicator::init(cfg).unwrap();
                        let dc = device_comm(&comm);
                        let edges = dc.edges().to_vec();
                        assert_eq!(edges.len(), 2);
                        assert_eq!(edges[0].to, rank);
                        assert_eq!(edges[1].from, rank);
                        for e in &edges {
                            assert_eq!(e.kind, TransportKind::Shm, "{e}");
                            assert_eq!(
                                e.reason,
                                format!(
                                    "{reason}; kernels read and write the mapped slots \
                                     (RINGZERO_STAGING=mapped)"
                                ),
                                "{e}"
                            );
                        }
                        let before = dc.counters();
                        let count = 30_000usize;
                        let send = vec![1.0f32; count];
                        let mut recv = vec![0.0f32; count];
                        dc.all_reduce(&send[..], &mut recv[..], ReduceOp::Sum)
                            .unwrap();
                        assert!(recv.iter().all(|&v| v == n as f32));
                        let sent = dc.counters().bytes_sent - before.bytes_sent;
                        // Reduce-scatter then all-gather: 2(n−1) chunks of count/n elements.
                        assert_eq!(sent as usize, 2 * (n - 1) * (count / n) * 4);
                        assert_eq!(
                            dc.counters().bytes_staged,
                            0,
                            "mapped staging copies nothing"
                        );
                        // All-to-all: each block goes its distance round the ring, 1 + 2 hops
                        // for n = 3: (n−1)/2 of the buffer over every link, in place or not.
                        let send: Vec<f32> =
                            (0..count).map(|i| (i + rank * count) as f32).collect();
                        for in_place in [false, true] {
                            let before = dc.counters().bytes_sent;
                            let mut recv = vec![0.0f32; count];
                            if in_place {
                                recv.copy_from_slice(&send);
                                dc.all_to_all(InPlace, &mut recv[..]).unwrap();
                            } else {
                                dc.all_to_all(&send[..], &mut recv[..]).unwrap();
                            }
                            let b = count / n;
                            for (i, v) in recv.iter().enumerate() {
                                let (q, e) = (i / b, i % b);
                                assert_eq!(*v, (q * count + rank * b + e) as f32, "element {i}");
                            }
                            let sent = dc.counters().bytes_sent - before;
                            assert_eq!(
                                sent as usize,
                                (n - 1) * count / 2 * 4,
                                "in place {in_place}"
                            );
                        }
                    })
                })
                .collect();
            for h in hs {
                h.join().unwrap();
            }
        });
    }
}

/// `RINGZERO_STAGING=copy`: every slice a kernel combines from a host slot is first copied to
/// device scratch, and every combined slice bound only for the next rank goes through scratch
/// into the slot; the edges say so.
#[test]
fn explicit_copy_staging_moves_every_combined_slice_through_device_scratch() {
    let n = 3;
    let o = Opts {
        transport: TransportPref::Shm,
        staging: StagingMode::Copy,
        slice_bytes: 4096,
        ..Opts::default()
    };
    threads(n, &o, |_, comm| {
        let comm = comm.unwrap();
        let dc = device_comm(&comm);
        for e in dc.edges() {
            assert!(
                e.reason
                    .ends_with("; explicit copies through device scratch (RINGZERO_STAGING=copy)"),
                "{e}"
            );
        }
        let count = 30_000usize;
        let send: Vec<f32> = (0..count)
            .map(|i| (i % 7) as f32 + comm.rank() as f32)
            .collect();
        let mut recv = vec![0.0f32; count];
        dc.all_reduce(&send[..], &mut recv[..], ReduceOp::Sum)
            .unwrap();
        for (i, v) in recv.iter().enumerate() {
            assert_eq!(*v, 3.0 * (i % 7) as f32 + 3.0, "element {i}");
        }
        // Reduce-scatter: n − 1 incoming slices combined (staged in), n − 2 combined results
        // bound only for the next rank (staged out); the all-gather only copies.
        let chunk_bytes = (count / n * 4) as u64;
        assert_eq!(dc.counters().bytes_staged, (2 * n as u64 - 3) * chunk_bytes);
    });
}

/// `RINGZERO_STAGING=auto` (the default) stages by explicit copies only on a GPU that at most two
/// ranks use (`StagingMode::resolve`, unit-tested); the host stream has no copy engines, so auto
/// maps there for any number of ranks, and a forced way holds. The edges say which and why, and
/// the staging counter shows that the copies ran (or did not).
#[test]
fn auto_staging_maps_on_the_host_stream_and_a_forced_way_holds() {
    let auto = "RINGZERO_STAGING=auto: not a GPU, no copy engines to gain from";
    for (n, staging, want, why_want) in [
        (2usize, StagingMode::Auto, StagingMode::Mapped, auto),
        (3, StagingMode::Auto, StagingMode::Mapped, auto),
        (
            2,
            StagingMode::Copy,
            StagingMode::Copy,
            "RINGZERO_STAGING=copy",
        ),
        (
            3,
            StagingMode::Mapped,
            StagingMode::Mapped,
            "RINGZERO_STAGING=mapped",
        ),
    ] {
        let o = Opts {
            transport: TransportPref::Shm,
            staging,
            slice_bytes: 4096,
            ..Opts::default()
        };
        threads(n, &o, |_, comm| {
            let comm = comm.unwrap();
            let dc = device_comm(&comm);
            let (mode, why) = dc.staging();
            assert_eq!((mode, why), (want, why_want), "{n} ranks, {staging}");
            let how = match want {
                StagingMode::Copy => "explicit copies through device scratch",
                _ => "kernels read and write the mapped slots",
            };
            let why = why.to_string();
            for e in dc.edges() {
                assert!(e.reason.ends_with(&format!("; {how} ({why})")), "{e}");
            }
            let count = 30_000usize;
            let send: Vec<f32> = (0..count).map(|i| (i % 5) as f32).collect();
            let mut recv = vec![0.0f32; count];
            dc.all_reduce(&send[..], &mut recv[..], ReduceOp::Sum)
                .unwrap();
            for (i, v) in recv.iter().enumerate() {
                assert_eq!(*v, n as f32 * (i % 5) as f32, "element {i}");
            }
            // As in the explicit-copy test above: 2n − 3 chunks staged, or none when mapped.
            let chunk_bytes = (count / n * 4) as u64;
            let staged = match want {
                StagingMode::Copy => (2 * n as u64 - 3) * chunk_bytes,
                _ => 0,
            };
            assert_eq!(dc.counters().bytes_staged, staged, "{n} ranks");
        });
    }
}

/// `RINGZERO_DEVICE_SLICE_BYTES` sizes the device edges' frames apart from the host path's
/// `RINGZERO_SLICE_BYTES` (a GPU wants megabytes per slice, a CPU ring a cache's worth); without
/// it the host stream keeps the host slice.
#[test]
fn device_slices_take_their_own_size_when_one_is_configured() {
    let n = 3;
    let count = 30_000usize; // chunks of 10 000 f32 = 40 000 bytes
    for (device_slice_bytes, frames_per_chunk) in [(Some(16384), 3), (None, 40)] {
        let o = Opts {
            slice_bytes: 1000,
            device_slice_bytes,
            ..Opts::default()
        };
        threads(n, &o, |_, comm| {
            let comm = comm.unwrap();
            let dc = device_comm(&comm);
            let send = vec![1.5f32; count];
            let mut recv = vec![0.0f32; count];
            dc.all_reduce(&send[..], &mut recv[..], ReduceOp::Sum)
                .unwrap();
            assert!(recv.iter().all(|&v| v == 4.5));
            assert_eq!(
                dc.counters().frames_sent,
                2 * (n as u64 - 1) * frames_per_chunk,
                "device slice {device_slice_bytes:?}"
            );
        });
    }
}

#[test]
fn tcp_device_edges_say_why_and_move_the_ring_volume() {
    let o = Opts {
        transport: TransportPref::Tcp,
        slice_bytes: 8192,
        ..Opts::default()
    };
    let n = 3;
    threads(n, &o, |_, comm| {
        let comm = comm.unwrap();
        let dc = device_comm(&comm);
        for e in dc.edges() {
            assert_eq!(e.kind, TransportKind::Tcp, "{e}");
            assert!(e.reason.contains("tcp"), "{e}");
        }
        let before = dc.counters();
        let count = 90_000usize;
        let send = vec![2.0f32; count];
        let mut recv = vec![0.0f32; count];
        dc.all_reduce(&send[..], &mut recv[..], ReduceOp::Sum)
            .unwrap();
        assert!(recv.iter().all(|&v| v == 2.0 * n as f32));
        let sent = dc.counters().bytes_sent - before.bytes_sent;
        assert_eq!(sent as usize, 2 * (n - 1) * (count / n) * 4);
    });
}

#[test]
fn bad_device_calls_are_refused_and_mismatched_calls_name_both() {
    threads(2, &Opts::default(), |rank, comm| {
        let comm = comm.unwrap();
        let dc = device_comm(&comm);
        let send = [1.0f32; 10];
        let mut short = [0.0f32; 9];
        let e = dc
            .all_reduce(&send[..], &mut short[..], ReduceOp::Sum)
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        let mut wrong = [0.0f32; 10];
        let e = dc
            .reduce_scatter(&send[..], &mut wrong[..], ReduceOp::Sum)
            .unwrap_err();
        assert!(e.to_string().contains("this rank's chunk"), "{e}");
        let mut b = [0.0f32; 4];
        assert!(dc.broadcast(InPlace, &mut b[..], 2).is_err());
        let e = dc
            .reduce(InPlace, &mut b[..], ReduceOp::Sum, 7)
            .unwrap_err();
        assert!(e.to_string().contains("root 7 is not a rank"), "{e}");
        // The root's recv must match; on the other rank it is not written and may be empty.
        let e = dc
            .reduce(&send[..], &mut b[..], ReduceOp::Sum, rank)
            .unwrap_err();
        assert!(e.to_string().contains("recv has 4 elements, 10"), "{e}");
        let e = dc.ring_shift(&send[..], &mut b[..]).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        // All-to-all: one block per rank, send and recv alike; nothing is written.
        let (odd, mut odd_out) = ([1.0f32; 9], [5.0f32; 9]);
        let e = dc.all_to_all(&odd[..], &mut odd_out[..]).unwrap_err();
        assert!(
            e.to_string()
                .contains("9 elements, not a multiple of the world size 2"),
            "{e}"
        );
        let e = dc.all_to_all(InPlace, &mut odd_out[..]).unwrap_err();
        assert!(
            e.to_string().contains("not a multiple of the world size 2"),
            "{e}"
        );
        assert_eq!(odd_out, [5.0; 9], "a refused all-to-all wrote its buffer");
        let e = dc.all_to_all(&send[..], &mut b[..]).unwrap_err();
        assert!(e.to_string().contains("recv has 4 elements, 10"), "{e}");
        // All-gather-v: one count per rank, adding up to recv; send is this rank's part.
        let mut ten = [7.0f32; 10];
        let e = dc
            .all_gather_v(&send[..4], &mut ten[..], &[4, 4, 2])
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("3 entries but the communicator has 2 ranks"),
            "{e}"
        );
        let e = dc
            .all_gather_v(&send[..4], &mut ten[..], &[4, 5])
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("counts add up to 9 elements but recv has 10"),
            "{e}"
        );
        let e = dc
            .all_gather_v(&send[..3], &mut ten[..], &[4, 6])
            .unwrap_err();
        assert!(
            e.to_string().contains("send has 3 elements but counts"),
            "{e}"
        );
        let e = dc.all_gather_v(InPlace, &mut ten[..], &[4, 4]).unwrap_err();
        assert!(e.to_string().contains("but recv has 10"), "{e}");
        assert_eq!(ten, [7.0; 10], "a refused all-gather-v wrote its buffer");
        let none =
            ringzero_collectives::internals::ring::device_engine::DevBufs::One { buf: 0, bytes: 0 };
        // SAFETY: refused before any address is used.
        let e = unsafe { dc.run_raw(Collective::AllGatherV, DType::F32, ReduceOp::Sum, 0, none) }
            .unwrap_err();
        assert!(
            e.to_string().contains("call DeviceComm::all_gather_v"),
            "{e}"
        );
        // Raw calls of what device buffers cannot run are refused by name.
        let none =
            ringzero_collectives::internals::ring::device_engine::DevBufs::One { buf: 0, bytes: 0 };
        // SAFETY: refused before any address is used.
        let e = unsafe {
            dc.run_raw(
                Collective::Gather { root: 0 },
                DType::F32,
                ReduceOp::Sum,
                0,
                none,
            )
        }
        .unwrap_err();
        assert!(e.to_string().contains("call DeviceComm::gather"), "{e}");
        // Refused calls used no sequence number: the ranks are still in step.
        let mut out = vec![0.0f32; 10];
        dc.all_reduce(&send[..], &mut out[..], ReduceOp::Sum)
            .unwrap();
        assert_eq!(out, vec![2.0; 10]);
        // Now rank 1 calls something else.
        let r = if rank == 0 {
            dc.all_reduce(&send[..], &mut out[..], ReduceOp::Sum)
        } else {
            dc.all_reduce(&send[..], &mut out[..], ReduceOp::Max)
        };
        let e = r.unwrap_err().to_string();
        assert!(e.contains("all_reduce"), "{e}");
        // After an error the communicator refuses further calls.
        assert!(dc
            .all_reduce(&send[..], &mut out[..], ReduceOp::Sum)
            .is_err());
    });
}

/// The host stream, except that once `hang` is set every copy it is given never completes: what
/// a peer write through a broken P2P path looks like to the engine (the driver accepts the copy,
/// its event never fires). With `refuse_share` it cannot share its buffers (as a GPU cannot
/// share memory from a stream-ordered pool). It counts the copy pairs the engine queues. With
/// `slow_ms`, a slow device: every copy and gather lands that long after it was queued (on a
/// thread of its own), into the caller's memory, and no marker completes while one is due.
pub(crate) struct HangingCopies {
    pub(crate) inner: HostStream,
    pub(crate) hang: bool,
    pub(crate) hung: std::sync::atomic::AtomicBool,
    pub(crate) refuse_share: bool,
    pub(crate) pairs: std::sync::atomic::AtomicUsize,
    /// Milliseconds a slow device takes (0: not slow); set after set-up, whose probe would time
    /// out on a slow device.
    pub(crate) slow_ms: std::sync::atomic::AtomicU64,
    /// Slow copies not landed yet.
    pub(crate) late: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl HangingCopies {
    fn slow(&self) -> Option<std::time::Duration> {
        match self.slow_ms.load(std::sync::atomic::Ordering::SeqCst) {
            0 => None,
            ms => Some(std::time::Duration::from_millis(ms)),
        }
    }
}

impl ringzero::Stream for HangingCopies {
    /// The host stream's marker, and whether a hung copy was queued before it.
    type Marker = (u64, bool);
    fn name(&self) -> String {
        "host (copies hang)".into()
    }
    fn memory_outlives_work(&self) -> bool {
        // A hung copy never touches memory (a GPU's would be held by the buffers it uses).
        self.hang
    }
    unsafe fn combine(
        &self,
        dtype: DType,
        op: ReduceOp,
        dst: u64,
        a: u64,
        b: u64,
        n: usize,
    ) -> Result<(), ringzero::kernels::DeviceError> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.combine(dtype, op, dst, a, b, n) }
    }
    unsafe fn divide(
        &self,
        dtype: DType,
        dst: u64,
        n: usize,
        ranks: usize,
    ) -> Result<(), ringzero::kernels::DeviceError> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.divide(dtype, dst, n, ranks) }
    }
    unsafe fn copy(
        &self,
        dst: u64,
        src: u64,
        bytes: usize,
    ) -> Result<(), ringzero::kernels::DeviceError> {
        if self.hang {
            self.hung.store(true, std::sync::atomic::Ordering::SeqCst);
            return Ok(());
        }
        if let Some(d) = self.slow() {
            use std::sync::atomic::Ordering::SeqCst;
            self.late.fetch_add(1, SeqCst);
            let late = self.late.clone();
            let (dst, src) = (dst as usize, src as usize);
            std::thread::spawn(move || {
                std::thread::sleep(d);
                // SAFETY: the stream's contract keeps both ranges live until the copy has
                // completed, which `done` reports only after this (what the tests check).
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
                late.fetch_sub(1, SeqCst);
            });
            return Ok(());
        }
        // SAFETY: forwarded contract.
        unsafe { self.inner.copy(dst, src, bytes) }
    }
    unsafe fn copy_pair(
        &self,
        a: u64,
        a_src: u64,
        a_bytes: usize,
        b: u64,
        b_also: Option<u64>,
        b_src: u64,
        b_bytes: usize,
    ) -> Result<(), ringzero::kernels::DeviceError> {
        if self.hang {
            self.hung.store(true, std::sync::atomic::Ordering::SeqCst);
            return Ok(());
        }
        self.pairs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        // SAFETY: forwarded contract.
        unsafe {
            self.inner
                .copy_pair(a, a_src, a_bytes, b, b_also, b_src, b_bytes)
        }
    }
    fn mark(&self) -> Result<(u64, bool), ringzero::kernels::DeviceError> {
        Ok((
            self.inner.mark()?,
            self.hung.load(std::sync::atomic::Ordering::SeqCst),
        ))
    }
    fn done(&self, m: &(u64, bool)) -> Result<bool, ringzero::kernels::DeviceError> {
        let slow_done = self.late.load(std::sync::atomic::Ordering::SeqCst) == 0;
        Ok(!m.1 && slow_done && self.inner.done(&m.0)?)
    }
    unsafe fn map_host(
        &self,
        host: *mut u8,
        bytes: usize,
    ) -> Result<(u64, Box<dyn std::any::Any + Send>), ringzero::kernels::DeviceError> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.map_host(host, bytes) }
    }
    fn scratch(
        &self,
        bytes: usize,
    ) -> Result<(u64, Box<dyn std::any::Any + Send>), ringzero::kernels::DeviceError> {
        self.inner.scratch(bytes)
    }
    fn identity(&self) -> Option<[u8; 16]> {
        None
    }
    fn can_access_peer(&self, peer: &[u8; 16]) -> Result<bool, String> {
        self.inner.can_access_peer(peer)
    }
    fn export(
        &self,
        bytes: usize,
    ) -> Result<ringzero::kernels::device::Exported, ringzero::kernels::DeviceError> {
        self.inner.export(bytes)
    }
    fn open_exported(
        &self,
        handle: &[u8; 64],
        bytes: usize,
    ) -> Result<(u64, Box<dyn std::any::Any + Send>), ringzero::kernels::DeviceError> {
        self.inner.open_exported(handle, bytes)
    }
    unsafe fn read(&self, dst: &mut [u8], src: u64) -> Result<(), ringzero::kernels::DeviceError> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.read(dst, src) }
    }
    unsafe fn gather(
        &self,
        dtype: DType,
        op: ReduceOp,
        outs: &[u64],
        ins: &[u64],
        n: usize,
        ranks: Option<usize>,
    ) -> Result<(), ringzero::kernels::DeviceError> {
        if let Some(d) = self.slow() {
            // The direct step's kernel, landing late: the inputs combined in order into every
            // output (as the host stream's gather does), on a thread of its own.
            use std::sync::atomic::Ordering::SeqCst;
            self.late.fetch_add(1, SeqCst);
            let late = self.late.clone();
            let (outs, ins) = (outs.to_vec(), ins.to_vec());
            std::thread::spawn(move || {
                std::thread::sleep(d);
                let len = n * dtype.size();
                let at = |a: u64| a as usize as *mut u8;
                // SAFETY: the stream's contract keeps every range live until the work has
                // completed, which `done` reports only after this (what the tests check).
                let mut acc = unsafe { std::slice::from_raw_parts(at(ins[0]), len) }.to_vec();
                for &i in &ins[1..] {
                    // SAFETY: as above.
                    let x = unsafe { std::slice::from_raw_parts(at(i), len) };
                    ringzero::kernels::cpu::reduce_into(dtype, op.pairwise(), &mut acc, x).unwrap();
                }
                if let Some(r) = ranks {
                    ringzero::kernels::cpu::divide(dtype, &mut acc, r).unwrap();
                }
                for &o in &outs {
                    // SAFETY: as above.
                    unsafe { std::ptr::copy(acc.as_ptr(), at(o), len) };
                }
                late.fetch_sub(1, SeqCst);
            });
            return Ok(());
        }
        // SAFETY: forwarded contract.
        unsafe { self.inner.gather(dtype, op, outs, ins, n, ranks) }
    }
    fn share(
        &self,
        addr: u64,
    ) -> Result<ringzero::kernels::device::ShareRecord, ringzero::kernels::DeviceError> {
        if self.refuse_share {
            return Err(ringzero::kernels::DeviceError::Invalid(
                "this memory cannot be exported".into(),
            ));
        }
        self.inner.share(addr)
    }
}

/// A rank whose probe copy never completes makes every rank's set-up fail within the probe
/// deadline, naming that rank, instead of hanging in the copy.
#[test]
fn a_probe_copy_that_never_completes_fails_set_up_on_every_rank_naming_the_stuck_rank() {
    let t = std::time::Instant::now();
    let errs = threads(3, &Opts::default(), |rank, comm| {
        let comm = comm.unwrap();
        let stream = HangingCopies {
            inner: HostStream::new(),
            hang: rank == 1,
            hung: Default::default(),
            refuse_share: false,
            pairs: Default::default(),
            slow_ms: Default::default(),
            late: Default::default(),
        };
        match DeviceComm::new(&comm, stream) {
            Ok(_) => panic!("rank {rank}: set-up succeeded over a stuck copy"),
            Err(e) => e.to_string(),
        }
    });
    for (rank, e) in errs.iter().enumerate() {
        assert!(e.contains("rank 1"), "rank {rank}: {e}");
        assert!(
            e.contains("copy of its probe into rank 2's slot did not complete"),
            "rank {rank}: {e}"
        );
        assert!(e.contains("RINGZERO_P2P_DISABLE=1"), "rank {rank}: {e}");
    }
    // The probe deadline is 5 s; nothing waits for the test timeout.
    assert!(
        t.elapsed() < std::time::Duration::from_secs(20),
        "{:?}",
        t.elapsed()
    );
}

/// Asynchronous calls return at once and are driven by the proxy thread: rank 0 submits, and
/// only then (told through a barrier) do the others submit theirs — a submission that blocked
/// until the collective finished would never return. Several calls queue in order, a blocking
/// call waits for them, and every result is exact.
#[test]
fn async_device_collectives_run_on_the_proxy_thread_in_order() {
    async_in_order(ringzero::DeviceAlgo::Auto);
}

/// The same with the direct step (all-reduce, reduce-scatter, all-gather, broadcast and reduce on the board, the
/// rest round the ring, all in submission order).
#[test]
fn async_direct_device_collectives_run_on_the_proxy_thread_in_order() {
    async_in_order(ringzero::DeviceAlgo::Direct);
}

fn async_in_order(device_algo: ringzero::DeviceAlgo) {
    let n = 3;
    let submitted = std::sync::Barrier::new(n);
    let o = Opts {
        slice_bytes: 1024,
        device_algo,
        ..Opts::default()
    };
    threads(n, &o, |rank, comm| {
        let comm = comm.unwrap();
        let dc = device_comm(&comm);
        let count = 10_000usize;
        let own = dc.chunk_range(count);
        let grads = |k: usize| vec![(rank + k) as f32; count];
        if rank != 0 {
            submitted.wait();
        }
        let first = dc.all_reduce_async(grads(0), ReduceOp::Sum);
        if rank == 0 {
            submitted.wait();
        }
        let second = dc.all_reduce_async(grads(1), ReduceOp::Max);
        let rs = dc.reduce_scatter_async(grads(2), vec![0.0f32; own.len()], ReduceOp::Sum);
        let ag = dc.all_gather_async(vec![rank as f32 + 0.5; own.len()], vec![0.0f32; count]);
        let root = vec![if rank == 2 { 7.0f32 } else { 0.0 }; count];
        let bc = dc.broadcast_async(root, 2);
        let red = dc.reduce_async(vec![rank as f32 + 1.0; 100], ReduceOp::Max, 1);
        let counts = [1, 0, 99];
        let part = vec![-1.0f32; counts[rank]];
        let rsv = dc.reduce_scatter_v_async(vec![1.0f32; 100], part, &counts, ReduceOp::Sum);
        let shift = dc.ring_shift_async(vec![rank as f32; 50], vec![-1.0f32; 50]);
        let agv =
            dc.all_gather_v_async(vec![rank as f32; counts[rank]], vec![-1.0f32; 100], &counts);
        let a2a_send: Vec<f32> = (0..n * 7).map(|i| (rank * 100 + i) as f32).collect();
        let a2a = dc.all_to_all_async(a2a_send, vec![-1.0f32; n * 7]);
        let bar = dc.barrier_async();
        // A blocking call after them runs after them.
        let mut last = vec![1.0f32; count];
        dc.all_reduce(InPlace, &mut last[..], ReduceOp::Sum)
            .unwrap();
        assert!(first.is_done() && bc.is_done(), "rank {rank}");
        assert!(last.iter().all(|&v| v == n as f32));

        let sum0: f32 = (0..n).map(|r| r as f32).sum();
        assert!(
            first.wait().unwrap().iter().all(|&v| v == sum0),
            "rank {rank}"
        );
        let max1 = (n - 1 + 1) as f32;
        assert!(
            second.wait().unwrap().iter().all(|&v| v == max1),
            "rank {rank}"
        );
        let (send, mine) = rs.wait().unwrap();
        assert_eq!(send.len(), count);
        let sum2: f32 = (0..n).map(|r| (r + 2) as f32).sum();
        assert!(mine.iter().all(|&v| v == sum2), "rank {rank}");
        let (_, all) = ag.wait().unwrap();
        for r in 0..n {
            let c = ringzero::chunk(count, n, r);
            assert!(
                all[c].iter().all(|&v| v == r as f32 + 0.5),
                "rank {rank}: chunk {r}"
            );
        }
        assert!(bc.wait().unwrap().iter().all(|&v| v == 7.0), "rank {rank}");
        let want = if rank == 1 {
            n as f32
        } else {
            rank as f32 + 1.0
        };
        assert_eq!(red.wait().unwrap(), vec![want; 100], "rank {rank}");
        let (_, part) = rsv.wait().unwrap();
        assert_eq!(part, vec![n as f32; counts[rank]], "rank {rank}");
        let (_, got) = shift.wait().unwrap();
        assert_eq!(got, vec![((rank + n - 1) % n) as f32; 50], "rank {rank}");
        let (_, all) = agv.wait().unwrap();
        let want: Vec<f32> = (0..n).flat_map(|q| vec![q as f32; counts[q]]).collect();
        assert_eq!(all, want, "rank {rank}");
        let (_, got) = a2a.wait().unwrap();
        let want: Vec<f32> = (0..n * 7)
            .map(|i| ((i / 7) * 100 + rank * 7 + i % 7) as f32)
            .collect();
        assert_eq!(got, want, "rank {rank}");
        bar.wait().unwrap();
        let direct = dc.counters().bytes_direct;
        assert_eq!(
            direct > 0,
            device_algo == ringzero::DeviceAlgo::Direct,
            "rank {rank}: {direct} bytes written directly"
        );
    });
}

/// Bad arguments fail an asynchronous call's Work at once and use no sequence number; a
/// mismatch found on the proxy thread fails that call on every rank and aborts the communicator,
/// as a blocking one does.
#[test]
fn async_device_calls_refuse_bad_arguments_and_report_mismatches() {
    threads(2, &Opts::default(), |rank, comm| {
        let comm = comm.unwrap();
        let dc = device_comm(&comm);
        let e = dc
            .reduce_scatter_async(vec![1.0f32; 10], vec![0.0f32; 9], ReduceOp::Sum)
            .wait()
            .unwrap_err();
        assert!(e.to_string().contains("this rank's chunk"), "{e}");
        let e = dc.broadcast_async(vec![1.0f32; 4], 5).wait().unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        let e = dc.reduce_async(vec![1.0f32; 4], ReduceOp::Sum, 2);
        assert!(e.is_done());
        let e = e.wait().unwrap_err().to_string();
        assert!(e.contains("root 2 is not a rank"), "{e}");
        let rsv = dc.reduce_scatter_v_async(vec![1.0f32; 4], vec![0.0; 2], &[2, 1], ReduceOp::Sum);
        let e = rsv.wait().unwrap_err().to_string();
        assert!(
            e.contains("counts add up to 3 elements but send has 4"),
            "{e}"
        );
        let rsv = dc.reduce_scatter_v_async(vec![1.0f32; 4], vec![0.0; 1], &[2, 2], ReduceOp::Sum);
        let e = rsv.wait().unwrap_err().to_string();
        assert!(e.contains("recv has 1 elements but counts"), "{e}");
        // All-gather-v: the counts split recv, and send is this rank's part.
        let agv = dc.all_gather_v_async(vec![1.0f32; 2], vec![0.0; 4], &[2, 1]);
        let e = agv.wait().unwrap_err().to_string();
        assert!(
            e.contains("counts add up to 3 elements but recv has 4"),
            "{e}"
        );
        let agv = dc.all_gather_v_async(vec![1.0f32; 3], vec![0.0; 4], &[2, 2]);
        let e = agv.wait().unwrap_err().to_string();
        assert!(e.contains("send has 3 elements but counts"), "{e}");
        let a2a = dc.all_to_all_async(vec![1.0f32; 5], vec![0.0; 5]);
        let e = a2a.wait().unwrap_err().to_string();
        assert!(e.contains("not a multiple of the world size 2"), "{e}");
        let ok = dc
            .all_reduce_async(vec![1.0f32; 10], ReduceOp::Sum)
            .wait()
            .unwrap();
        assert_eq!(ok, vec![2.0; 10]);
        let op = if rank == 0 {
            ReduceOp::Sum
        } else {
            ReduceOp::Min
        };
        let e = dc
            .all_reduce_async(vec![1.0f32; 10], op)
            .wait()
            .unwrap_err();
        assert!(e.to_string().contains("all_reduce"), "rank {rank}: {e}");
        let later = dc.all_reduce_async(vec![1.0f32; 10], ReduceOp::Sum).wait();
        assert!(later.is_err(), "rank {rank}: a call after the failure ran");
    });
}

/// A slice's last receive and the next slice's first send are queued as one piece of work
/// (`Stream::copy_pair`) whenever a slot at the next rank is free at once, so a link staged in
/// host memory carries both directions at once: an all-reduce on 2 ranks pairs some, with exact
/// results, and a reduce-scatter (no receive-only step) never does.
#[test]
fn a_slices_last_receive_and_the_next_slices_first_send_are_queued_together() {
    // And with `RINGZERO_DEVICE_COPY_PAIRS=off`, never: the same results from single copies.
    for pair in [true, false] {
        slice_and_next_slice_paired(pair);
    }
}

/// A device communicator on a stream that turns slow (`slow` per piece of work) once set up.
pub(crate) fn slow_device(
    comm: &Communicator,
    slow: std::time::Duration,
) -> DeviceComm<HangingCopies> {
    let stream = HangingCopies {
        inner: HostStream::new(),
        hang: false,
        hung: Default::default(),
        refuse_share: false,
        pairs: Default::default(),
        slow_ms: Default::default(),
        late: Default::default(),
    };
    let dc = DeviceComm::new(comm, stream).unwrap();
    let ms = u64::try_from(slow.as_millis()).unwrap();
    dc.stream()
        .slow_ms
        .store(ms, std::sync::atomic::Ordering::SeqCst);
    dc
}

/// An out-of-place f32 sum all-reduce of `send` into `recv` on `dc`'s raw addresses.
fn raw_all_reduce(
    dc: &mut DeviceComm<HangingCopies>,
    send: &[f32],
    recv: &mut [f32],
) -> Result<(), Error> {
    let bufs = ringzero_collectives::internals::ring::device_engine::DevBufs::Split {
        input: send.as_ptr() as u64,
        input_bytes: send.len() * 4,
        output: recv.as_mut_ptr() as u64,
        output_bytes: recv.len() * 4,
    };
    // SAFETY: both are live host memory of the lengths given (the host stream's addresses),
    // borrowed for the whole call.
    unsafe {
        dc.run_raw(
            Collective::AllReduce,
            DType::F32,
            ReduceOp::Sum,
            send.len(),
            bufs,
        )
    }
}

/// A call that fails while work it queued still runs returns only once that work has ended: a
/// host stream's work reads and writes the caller's memory, which may be freed the moment the
/// call returns. One rank: the out-of-place call's local copy outlasts the deadline.
#[test]
fn a_failed_call_returns_only_once_the_host_work_it_queued_has_written_its_output() {
    let (deadline, slow) = (
        std::time::Duration::from_millis(200),
        std::time::Duration::from_millis(1500),
    );
    let o = Opts {
        timeout: deadline,
        ..Opts::default()
    };
    threads(1, &o, |_, comm| {
        let comm = comm.unwrap();
        let mut dc = slow_device(&comm, slow);
        // Leaked: had the call returned early, the late copy would still write into them.
        let send: &'static [f32] = Box::leak((0..4096).map(|i| i as f32).collect());
        let recv: &'static mut [f32] = Box::leak(vec![0f32; 4096].into_boxed_slice());
        let t = std::time::Instant::now();
        let e = raw_all_reduce(&mut dc, send, recv).unwrap_err();
        let took = t.elapsed();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert!(e.to_string().contains("the local copy"), "{e}");
        assert!(
            took >= slow,
            "returned after {took:?}, with its copy still to land"
        );
        assert_eq!(recv, send, "the copy had landed when the call returned");
    });
}

/// The same on the ring, 2 ranks: every piece of device work outlasts the deadline, the call
/// fails on both ranks, and neither returns before the work it queued has ended.
#[test]
fn a_ring_call_that_fails_returns_only_once_its_queued_host_work_has_ended() {
    let (deadline, slow) = (
        std::time::Duration::from_millis(300),
        std::time::Duration::from_millis(1500),
    );
    let o = Opts {
        timeout: deadline,
        ..Opts::default()
    };
    threads(2, &o, |rank, comm| {
        let comm = comm.unwrap();
        let mut dc = slow_device(&comm, slow);
        let send: &'static [f32] = Box::leak(vec![1f32; 4096].into_boxed_slice());
        let recv: &'static mut [f32] = Box::leak(vec![0f32; 4096].into_boxed_slice());
        let t = std::time::Instant::now();
        let e = raw_all_reduce(&mut dc, send, recv).unwrap_err();
        let took = t.elapsed();
        assert!(
            took >= slow,
            "rank {rank}: returned after {took:?} ({e}), with its work still running"
        );
        assert!(
            took < std::time::Duration::from_secs(15),
            "rank {rank}: {took:?}"
        );
    });
}

fn slice_and_next_slice_paired(pair: bool) {
    let o = Opts {
        slice_bytes: 1024,
        device_copy_pairs: pair,
        ..Opts::default()
    };
    threads(2, &o, |rank, comm| {
        let comm = comm.unwrap();
        let stream = HangingCopies {
            inner: HostStream::new(),
            hang: false,
            hung: Default::default(),
            refuse_share: false,
            pairs: Default::default(),
            slow_ms: Default::default(),
            late: Default::default(),
        };
        let dc = DeviceComm::new(&comm, stream).unwrap();
        let count = 20_000; // f32: 10 slices of 1 KiB per chunk
        let send: Vec<f32> = (0..count).map(|i| (i % 97 + rank) as f32).collect();
        let run = |coll: Collective, out: &mut [f32]| {
            let bufs = ringzero_collectives::internals::ring::device_engine::DevBufs::Split {
                input: send.as_ptr() as u64,
                input_bytes: send.len() * 4,
                output: out.as_mut_ptr() as u64,
                output_bytes: out.len() * 4,
            };
            // SAFETY: both are live host memory of the lengths given (the host stream's
            // addresses), untouched until the call returns.
            unsafe { dc.run_raw(coll, DType::F32, ReduceOp::Sum, count, bufs) }.unwrap();
            dc.stream().pairs.load(std::sync::atomic::Ordering::SeqCst)
        };
        let mut out = vec![0f32; count];
        let pairs = run(Collective::AllReduce, &mut out);
        for (i, x) in out.iter().enumerate() {
            assert_eq!(*x, (2 * (i % 97) + 1) as f32, "rank {rank}: element {i}");
        }
        assert_eq!(pairs > 0, pair, "rank {rank}: {pairs} copy pairs queued");
        let mut part = vec![0f32; count / 2];
        let after = run(Collective::ReduceScatter, &mut part);
        let base = rank * count / 2;
        for (i, x) in part.iter().enumerate() {
            assert_eq!(
                *x,
                (2 * ((base + i) % 97) + 1) as f32,
                "rank {rank}: element {i}"
            );
        }
        assert_eq!(
            after, pairs,
            "rank {rank}: a reduce-scatter has no receive-only step to pair"
        );
    });
}

/// `DeviceComm::device_bytes`: explicit-copy staging holds one slot's worth of device scratch per
/// slot of each of its two links; mapped staging holds none (its slots are host memory); an
/// in-place all-to-all adds the copy it sends from, kept at its largest size.
#[test]
fn a_device_communicator_counts_the_device_memory_it_holds() {
    for (staging, links) in [(StagingMode::Copy, 2), (StagingMode::Mapped, 0)] {
        let o = Opts {
            transport: TransportPref::Shm,
            staging,
            slice_bytes: 4096,
            ..Opts::default()
        };
        threads(2, &o, |_, comm| {
            let comm = comm.unwrap();
            let dc = device_comm(&comm);
            let slots = links * comm.config().slots * dc.slice_bytes();
            assert_eq!(dc.device_bytes(), slots, "{staging}");
            let mut buf = vec![1.0f32; 1000];
            dc.all_to_all(InPlace, &mut buf[..]).unwrap();
            assert_eq!(dc.device_bytes(), slots + 4000, "{staging}");
            let mut small = [1.0f32; 10];
            dc.all_to_all(InPlace, &mut small[..]).unwrap();
            assert_eq!(
                dc.device_bytes(),
                slots + 4000,
                "{staging}: the larger copy is kept"
            );
        });
    }
}
