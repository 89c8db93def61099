//! The GPU collective checks of `ringzero gpu-check`: ring collectives on device buffers
//! ([`DeviceComm`] over `Arc<Gpu>`), each rank a process on the same GPU, run through the launcher
//! (`ringzero gpu-collectives` is the rank program). Every collective, dtype and op against the
//! exact reference of `ringzero bench`'s `#wrong` check, outputs poisoned first; the edges'
//! transport checked against what was asked (cuda_ipc, or host staging under
//! `RINGZERO_P2P_DISABLE=1`, which must move every byte through staging); then all-reduce bus
//! bandwidth at 256 MiB next to a device-to-device copy (cuda_ipc) or a pinned host→device copy
//! (staging) measured in the same run.

use std::sync::Arc;
use std::time::Instant;

use ringzero_collectives::{Collective, Communicator, DeviceComm, TransportKind};
use ringzero_kernels::device::cuda::Gpu;
use ringzero_kernels::{DType, ReduceOp};

use crate::bench::device::{exact_result, BenchDev};
use crate::bench::exact::{decode as from_bytes, encode as to_bytes, reference, value};
use crate::gpucheck::Row;

type Check = Result<Option<String>, String>;

/// One collective on exact inputs (the bench's `#wrong` check): the first wrong element, if any.
fn one(
    dc: &mut DeviceComm<Arc<Gpu>>,
    coll: Collective,
    inplace: bool,
    d: DType,
    op: ReduceOp,
    count: usize,
    seed: usize,
) -> Check {
    let r = dc.rank();
    let Some((got, want)) =
        exact_result(dc, coll, inplace, count, (d, op, seed)).map_err(|x| x.to_string())?
    else {
        return Ok(None);
    };
    Ok((0..want.len())
        .find(|&i| got[i] != want[i] && !(got[i].is_nan() && want[i].is_nan()))
        .map(|i| {
            format!(
                "rank {r}: {}{} {d} {op} count {count}: element {i} is {} but should be {}",
                coll.name(),
                if inplace { " in place" } else { "" },
                got[i],
                want[i]
            )
        }))
}

/// Whether `coll` runs out of place only (the collectives over pairs of ranks).
fn one_way(coll: Collective) -> bool {
    matches!(
        coll,
        Collective::SendRecv
            | Collective::AllToAllV
            | Collective::Gather { .. }
            | Collective::Scatter { .. }
    )
}

/// Four asynchronous all-reduces queued back to back (the proxy thread drives them, using the GPU
/// from a thread that did not create its context), each checked exactly.
fn async_all_reduce(dc: &DeviceComm<Arc<Gpu>>, gpu: &Arc<Gpu>, seed: usize) -> Result<(), String> {
    let (r, n) = (dc.rank(), dc.size());
    let (d, op, count) = (DType::F32, ReduceOp::Sum, (1usize << 20) + 7);
    let e = |x: ringzero_kernels::device::DeviceError| x.to_string();
    let mut works = Vec::new();
    for k in 0..4 {
        let input: Vec<f64> = (0..count).map(|i| value(d, op, r, i, seed + k)).collect();
        let buf = gpu.upload(d, &to_bytes(d, &input)).map_err(e)?;
        works.push(dc.all_reduce_async(buf, op));
    }
    for (k, w) in works.into_iter().enumerate() {
        let out = w.wait().map_err(|x| x.to_string())?;
        let mut bytes = vec![0u8; out.bytes()];
        gpu.download(&out, &mut bytes).map_err(e)?;
        let got = from_bytes(d, &bytes);
        if let Some(i) = (0..count).find(|&i| got[i] != reference(d, op, n, i, seed + k)) {
            return Err(format!(
                "rank {r}: async all_reduce #{k}: element {i} is {} but should be {}",
                got[i],
                reference(d, op, n, i, seed + k)
            ));
        }
    }
    Ok(())
}

/// Posted point-to-point round the ring: every rank posts its receive from the rank before, then
/// its send to the rank after, each message more than the pair's slots hold (so no send fits
/// before its receive starts), and the other way round; on pairs the earlier checks may not have
/// connected (a first call within the proxy's session). Each message checked exactly.
fn posted_ring(dc: &DeviceComm<Arc<Gpu>>, gpu: &Arc<Gpu>, seed: usize) -> Result<(), String> {
    let (r, n) = (dc.rank(), dc.size());
    let (d, op) = (DType::F32, ReduceOp::Sum);
    let count = dc.slice_bytes() * 5 / 4 + 7;
    let e = |x: ringzero_kernels::device::DeviceError| x.to_string();
    let upload = |rank: usize, k: usize| -> Result<_, String> {
        let v: Vec<f64> = (0..count)
            .map(|i| value(d, op, rank, i, seed + k))
            .collect();
        gpu.upload(d, &to_bytes(d, &v)).map_err(e)
    };
    let (prev, next) = ((r + n - 1) % n, (r + 1) % n);
    for (k, (from, to)) in [(prev, next), (next, prev)].into_iter().enumerate() {
        let got = dc.recv_async(gpu.alloc(d, count).map_err(e)?, from);
        let sent = dc.send_async(upload(r, k)?, to);
        let out = got.wait().map_err(|x| x.to_string())?;
        sent.wait().map_err(|x| x.to_string())?;
        let mut bytes = vec![0u8; out.bytes()];
        gpu.download(&out, &mut bytes).map_err(e)?;
        let got = from_bytes(d, &bytes);
        if let Some(i) = (0..count).find(|&i| got[i] != value(d, op, from, i, seed + k)) {
            return Err(format!(
                "rank {r}: posted message #{k} from rank {from}: element {i} is {} but should be {}",
                got[i],
                value(d, op, from, i, seed + k)
            ));
        }
    }
    Ok(())
}

/// Run every check on this rank; rank 0's rows are the report.
pub fn rank_main(comm: &Communicator, device: usize, bench: bool) -> Vec<Row> {
    let n = comm.size();
    let tcp = comm.config().transport == ringzero_collectives::TransportPref::Tcp;
    let staged = comm.config().p2p_disable && !tcp;
    let ring = comm.config().device_algo == ringzero_collectives::DeviceAlgo::Ring;
    let label = if tcp {
        "tcp"
    } else if staged {
        "staging"
    } else if ring {
        "cuda_ipc-ring"
    } else {
        "cuda_ipc"
    };
    let mut rows = Vec::new();
    let gpu = match Gpu::open(device) {
        Ok(g) => g,
        Err(e) => {
            return vec![Row {
                check: format!("{label} n={n} open"),
                pass: false,
                detail: e.to_string(),
            }]
        }
    };
    let mut dc = match DeviceComm::new(comm, gpu.clone()) {
        Ok(dc) => dc,
        Err(e) => {
            return vec![Row {
                check: format!("{label} n={n} connect"),
                pass: false,
                detail: e.to_string(),
            }]
        }
    };
    let want = if tcp {
        TransportKind::Tcp
    } else if staged {
        TransportKind::Shm
    } else {
        TransportKind::CudaIpc
    };
    let edges: Vec<String> = dc.edges().iter().map(|e| e.to_string()).collect();
    rows.push(Row {
        check: format!("{label} n={n} edges"),
        pass: dc.edges().iter().all(|e| e.kind == want),
        detail: edges.join("; "),
    });
    // Ranks sharing one GPU over cuda_ipc take the direct step unless told to take the ring.
    let direct_expected = !tcp && !staged && !ring;
    rows.push(Row {
        check: format!("{label} n={n} algorithm"),
        pass: dc.direct().is_some() == direct_expected,
        detail: dc
            .direct()
            .map_or_else(|| "the slot ring".to_string(), str::to_string),
    });
    let mut seed = 0;
    for coll in [
        Collective::AllReduce,
        Collective::ReduceScatter,
        Collective::ReduceScatterV,
        Collective::AllGather,
        Collective::Broadcast { root: n - 1 },
        Collective::Reduce { root: n - 1 },
        Collective::RingShift,
        Collective::AllToAll,
        Collective::AllGatherV,
        Collective::SendRecv,
        Collective::AllToAllV,
        Collective::Gather { root: n - 1 },
        Collective::Scatter { root: 0 },
        Collective::Barrier,
    ] {
        let mut fail = None;
        let mut cases = 0;
        'all: for d in DType::ALL {
            for op in ReduceOp::ALL {
                for (count, inplace) in [1usize, 1023, (1 << 20) + 7]
                    .into_iter()
                    .flat_map(|c| [(c, false), (c, true)])
                    // Send-recv (pairs 0↔1, 2↔3), all-to-all-v, gather and scatter have no
                    // in-place form.
                    .filter(|&(_, inplace)| !(inplace && one_way(coll)))
                {
                    seed += 1;
                    cases += 1;
                    match one(&mut dc, coll, inplace, d, op, count, seed) {
                        Ok(None) => {}
                        Ok(Some(f)) => {
                            fail = Some(f);
                            break 'all;
                        }
                        Err(e) => {
                            fail = Some(e);
                            break 'all;
                        }
                    }
                }
            }
        }
        rows.push(Row {
            check: format!("{label} n={n} {}", coll.name()),
            pass: fail.is_none(),
            detail: fail.unwrap_or_else(|| {
                let ways = if one_way(coll) {
                    "out of place"
                } else {
                    "both ways"
                };
                format!("{cases} cases (7 dtypes × 5 ops × 3 sizes × {ways}) exact")
            }),
        });
    }
    let fail = async_all_reduce(&dc, &gpu, seed).err();
    rows.push(Row {
        check: format!("{label} n={n} async all_reduce"),
        pass: fail.is_none(),
        detail: fail.unwrap_or_else(|| {
            "4 f32 sum all-reduces of 2^20+7 queued on the proxy thread, exact".into()
        }),
    });
    let fail = posted_ring(&dc, &gpu, seed + 4).err();
    rows.push(Row {
        check: format!("{label} n={n} posted send/recv"),
        pass: fail.is_none(),
        detail: fail.unwrap_or_else(|| {
            "recv_async(prev) then send_async(next), then back, 5/4 of the slots each, exact".into()
        }),
    });
    let sent = dc.counters().bytes_sent;
    rows.push(Row {
        check: format!("{label} n={n} bytes moved"),
        pass: sent > 0 && dc.edges().iter().all(|e| e.kind == want),
        detail: format!(
            "{sent} payload bytes sent, every one over {want}; {} written straight into \
             other ranks' buffers by direct steps",
            dc.counters().bytes_direct
        ),
    });
    rows.push(crate::gpuzero::check(comm, &mut dc, &gpu, label));
    // tcp over loopback has no target next to a device copy: its checks are exactness only.
    if bench && !tcp {
        match bandwidth(&mut dc, &gpu, staged, ring) {
            Ok(r) => rows.push(r),
            Err(e) => rows.push(Row {
                check: format!("{label} n={n} bench"),
                pass: false,
                detail: e,
            }),
        }
    }
    rows
}

/// All-reduce bus bandwidth at 256 MiB of f32 against what the shared hardware allows.
///
/// Every rank here is a process on the *same* GPU, so the ranks share one GPU's memory (cuda_ipc)
/// or one PCIe link (host staging), and the yardsticks — 70 % of a device-to-device copy,
/// 80 % of a pinned host→device copy — assume a GPU or a link per rank. The row therefore sets the
/// figure against the bound for ranks that share the resource, derived from the baseline measured
/// in the same run (by rank 0 alone, the others waiting, so no rank's copy competes with another):
/// - cuda_ipc: an all-reduce reads every rank's input and writes every rank's output at least
///   once, 2·n·S bytes through the one GPU's memory, so busbw = 2(n−1)/n·S/t ≤ copy·(n−1)/n²
///   (copy counted as bytes read plus written);
/// - staging: every byte a rank sends (busbw·t of them) crosses the one PCIe link host-bound and
///   again device-bound, and every rank sends and receives at once, so n·busbw ≤ each
///   direction's rate while both run (two pinned copies at once, one each way: less than either
///   alone).
///
/// It passes at 70 % (cuda_ipc) or 80 % (staging) of that bound, and says the percentage of the
/// plain copy too. With `ring_forced` (cuda_ipc, `RINGZERO_DEVICE_ALGO=ring`, which `auto` does
/// not take on one GPU) the row is a comparison beside the direct step's and sets no target.
fn bandwidth(
    dc: &mut DeviceComm<Arc<Gpu>>,
    gpu: &Arc<Gpu>,
    staged: bool,
    ring_forced: bool,
) -> Result<Row, String> {
    let e = |x: ringzero_kernels::device::DeviceError| x.to_string();
    let n = dc.size();
    let elems = 64usize << 20; // 256 MiB of f32
    let bytes = elems * 4;
    let send = gpu.alloc(DType::F32, elems).map_err(e)?;
    let mut recv = gpu.alloc(DType::F32, elems).map_err(e)?;
    // The baseline, measured here and now, by rank 0 alone (the bench's: `BenchDev::baseline`).
    // Host staging: the one-way pinned copy, and each direction's rate while both run at once
    // (what its ranks get, since each sends and receives at the same time).
    let (mut base_gbs, mut both_gbs) = (0.0, 0.0);
    if dc.rank() == 0 {
        let b = gpu.baseline(bytes, staged)?;
        base_gbs = if staged {
            b.pinned_gbs.unwrap_or(0.0)
        } else {
            b.copy_gbs
        };
        both_gbs = b.both_ways_gbs.unwrap_or(0.0);
    }
    dc.barrier().map_err(|x| x.to_string())?;
    let iters = 5;
    dc.all_reduce(&send, &mut recv, ReduceOp::Sum)
        .map_err(|x| x.to_string())?;
    let t = Instant::now();
    for _ in 0..iters {
        dc.all_reduce(&send, &mut recv, ReduceOp::Sum)
            .map_err(|x| x.to_string())?;
    }
    let secs = t.elapsed().as_secs_f64() / iters as f64;
    let busbw = bytes as f64 / secs / 1e9 * 2.0 * (n - 1) as f64 / n as f64;
    let nf = n as f64;
    let algo = if dc.direct().is_some() {
        "direct"
    } else {
        "ring"
    };
    // Host staging moves 2(n−1)/n of the buffer each way per rank, every rank over the one
    // PCIe link at once: busbw ≤ (each direction's rate while both run) / n.
    let (label, base_name, bound, bound_rule, target) = if staged {
        (
            "staging",
            "one-way pinned host→device copy",
            both_gbs / nf,
            format!("copy both ways at once ({both_gbs:.1} GB/s each way)/n"),
            0.8,
        )
    } else {
        (
            "cuda_ipc",
            "device-to-device copy",
            base_gbs * (nf - 1.0) / (nf * nf),
            "copy·(n−1)/n²".to_string(),
            0.7,
        )
    };
    let target_text = if ring_forced {
        "no target: the slot ring for comparison, auto takes the direct step here".to_string()
    } else {
        format!("target {:.0}%", 100.0 * target)
    };
    Ok(Row {
        check: format!("{label} n={n} all_reduce 256 MiB ({algo})"),
        pass: ring_forced || busbw >= target * bound,
        detail: format!(
            "busbw {busbw:.1} GB/s = {:.0}% of what {n} ranks sharing one GPU allow \
             ({bound_rule} = {bound:.1} GB/s; {target_text}); {:.1}% of the {base_name} \
             ({base_gbs:.1} GB/s)",
            100.0 * busbw / bound,
            100.0 * busbw / base_gbs,
        ),
    })
}

/// gpu-check's killed-rank check: every rank all-reduces 64 MiB of f32 in a loop; `victim` sends
/// itself SIGKILL in its fourth iteration, mid-ring. The others must fail with an error (a lost
/// peer or an abort naming it) well before the deadline, never hang. Rank 0's row says how long
/// after its last completed all-reduce the error came.
pub fn killed_rank_main(comm: &Communicator, device: usize, victim: usize) -> Vec<Row> {
    let n = comm.size();
    let label = if comm.config().p2p_disable {
        "staging"
    } else {
        "cuda_ipc"
    };
    let check = format!("{label} n={n} rank {victim} killed");
    let row = |pass: bool, detail: String| {
        vec![Row {
            check: check.clone(),
            pass,
            detail,
        }]
    };
    let gpu = match Gpu::open(device) {
        Ok(g) => g,
        Err(e) => return row(false, e.to_string()),
    };
    let mut dc = match DeviceComm::new(comm, gpu.clone()) {
        Ok(dc) => dc,
        Err(e) => return row(false, format!("connect: {e}")),
    };
    let count = 16 << 20;
    let bufs = gpu
        .upload(DType::F32, &vec![0x3Fu8; count * 4])
        .and_then(|a| Ok((a, gpu.upload(DType::F32, &vec![0u8; count * 4])?)));
    let (send, mut recv) = match bufs {
        Ok(b) => b,
        Err(e) => return row(false, e.to_string()),
    };
    let timeout = comm.config().timeout;
    let mut last_ok = Instant::now();
    for i in 0..1000 {
        if dc.rank() == victim && i == 3 {
            // Mid-ring on purpose: the peers are inside the same all-reduce.
            let _ = rustix::process::kill_process(
                rustix::process::getpid(),
                rustix::process::Signal::KILL,
            );
        }
        match dc.all_reduce(&send, &mut recv, ReduceOp::Sum) {
            Ok(()) => last_ok = Instant::now(),
            Err(e) => {
                let after = last_ok.elapsed();
                return row(
                    after < timeout / 2,
                    format!(
                        "rank {} failed in iteration {i}, {:.2}s after its last all-reduce \
                         (deadline {:.0}s): {e}",
                        dc.rank(),
                        after.as_secs_f64(),
                        timeout.as_secs_f64()
                    ),
                );
            }
        }
    }
    row(
        false,
        format!("rank {} saw no error in 1000 all-reduces", dc.rank()),
    )
}
