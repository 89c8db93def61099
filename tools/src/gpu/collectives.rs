//! The GPU collective checks of `ringzero gpu-check`: ring collectives on device buffers
//! ([`DeviceComm`] over `Arc<Gpu>`), each rank a process on the same GPU, run through the launcher
//! (`ringzero gpu-collectives` is the rank program). Every collective, dtype and op against the
//! exact reference of `ringzero bench`'s `#wrong` check, outputs poisoned first; the edges'
//! transport checked against what was asked (cuda_ipc, or host staging under
//! `RINGZERO_P2P_DISABLE=1`, which must move every byte through staging); then all-reduce bus
//! bandwidth at 256 MiB next to a device-to-device copy (cuda_ipc) or a pinned host→device copy
//! (staging) measured in the same run.
//!
//! The same checks run on the host stream (`ringzero gpu-check --host-stream`: the device engine
//! with the host as its device, host staging on every edge), so that their own logic is tested
//! by `cargo test` on a machine without a GPU before a GPU session depends on it.

use std::time::Instant;

use ringzero_collectives::{
    Collective, Collectives, Communicator, DeviceComm, HostStream, NonBlocking, StagingMode,
    TransportKind, COPY_STAGING_MAX_SHARERS,
};
use ringzero_kernels::device::cuda::Gpu;
use ringzero_kernels::{DType, ReduceOp};

use crate::bench::device::exact_result;
use crate::bench::exact::{reference, value};
use crate::gpu::kernels::Row;
use crate::gpu::CheckDev;

/// How a collective run checks ([`rank_main`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct RunOpts {
    /// Also measure all-reduce bandwidth at 256 MiB.
    pub bench: bool,
    /// Counts 1, 1023 and 4099 instead of 1, 1023 and 2^20+7 (a dry run's, whose launcher sets
    /// small slices so that the larger count still takes several).
    pub quick: bool,
}

/// Counts of every collective check.
fn counts(quick: bool) -> [usize; 3] {
    [1, 1023, if quick { 4099 } else { (1 << 20) + 7 }]
}

type Check = Result<Option<String>, String>;

/// One collective on exact inputs (the bench's `#wrong` check): the first wrong element, if any.
fn one<D: CheckDev>(
    dc: &DeviceComm<D>,
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
fn async_all_reduce<D: CheckDev>(dc: &DeviceComm<D>, seed: usize) -> Result<(), String>
where
    D::Buf: Send,
{
    let (r, n) = (dc.rank(), dc.size());
    let (d, op, count) = (DType::F32, ReduceOp::Sum, (1usize << 20) + 7);
    let mut works = Vec::new();
    for k in 0..4 {
        let input: Vec<f64> = (0..count).map(|i| value(d, op, r, i, seed + k)).collect();
        works.push(dc.all_reduce_async(dc.stream().make(d, &input)?, op));
    }
    for (k, w) in works.into_iter().enumerate() {
        let got = dc
            .stream()
            .contents(&w.wait().map_err(|x| x.to_string())?)?;
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
fn posted_ring<D: CheckDev>(dc: &DeviceComm<D>, seed: usize) -> Result<(), String>
where
    D::Buf: Send,
{
    let (r, n) = (dc.rank(), dc.size());
    let (d, op) = (DType::F32, ReduceOp::Sum);
    let count = dc.slice_bytes() * 5 / 4 + 7;
    let values = |rank: usize, k: usize| -> Vec<f64> {
        (0..count)
            .map(|i| value(d, op, rank, i, seed + k))
            .collect()
    };
    let (prev, next) = ((r + n - 1) % n, (r + 1) % n);
    for (k, (from, to)) in [(prev, next), (next, prev)].into_iter().enumerate() {
        let got = dc.recv_async(dc.stream().zeros(d, count)?, from);
        let sent = dc.send_async(dc.stream().make(d, &values(r, k))?, to);
        let out = got.wait().map_err(|x| x.to_string())?;
        sent.wait().map_err(|x| x.to_string())?;
        let got = dc.stream().contents(&out)?;
        let want = values(from, k);
        if let Some(i) = (0..count).find(|&i| got[i] != want[i]) {
            return Err(format!(
                "rank {r}: posted message #{k} from rank {from}: element {i} is {} but should be {}",
                got[i], want[i]
            ));
        }
    }
    Ok(())
}

/// What a run checks for, from the launcher's settings: its rows' label, the transport every
/// device edge must take and whether the direct step must run.
struct Expect {
    /// `cuda_ipc`, `cuda_ipc-ring`, `staging`, `staging-mapped`, `staging-copy` or `tcp`;
    /// `host-stream staging`, `host-stream staging-mapped`, ... on the host stream.
    label: String,
    want: TransportKind,
    direct: bool,
    host: bool,
    tcp: bool,
    staged: bool,
    ring: bool,
    /// The staging way forced by `RINGZERO_STAGING` (mapped or copy, for comparison), `None`
    /// where `auto` picks.
    forced: Option<StagingMode>,
}

impl Expect {
    /// What `cfg` asks of a run on a GPU, or on the host stream when `host` (host staging on
    /// every edge but tcp's, never the direct step: the ranks are processes).
    fn of(cfg: &ringzero_collectives::Config, host: bool) -> Expect {
        let tcp = cfg.transport == ringzero_collectives::TransportPref::Tcp;
        let staged = cfg.p2p_disable && !tcp;
        let ring = cfg.device_algo == ringzero_collectives::DeviceAlgo::Ring;
        let forced = (cfg.staging != StagingMode::Auto).then_some(cfg.staging);
        let kind = if tcp {
            "tcp"
        } else if staged || host {
            match forced {
                Some(StagingMode::Mapped) => "staging-mapped",
                Some(StagingMode::Copy) => "staging-copy",
                _ => "staging",
            }
        } else if ring {
            "cuda_ipc-ring"
        } else {
            "cuda_ipc"
        };
        let want = if tcp {
            TransportKind::Tcp
        } else if staged || host {
            TransportKind::Shm
        } else {
            TransportKind::CudaIpc
        };
        Expect {
            label: if host {
                format!("host-stream {kind}")
            } else {
                kind.to_string()
            },
            want,
            // Ranks sharing one GPU over cuda_ipc take the direct step unless told to take the
            // ring.
            direct: !host && !tcp && !staged && !ring,
            host,
            tcp,
            staged,
            ring,
            forced,
        }
    }
}

/// Run every check on this rank, on GPU `device` or (`None`) the host stream; rank 0's rows are
/// the report.
pub fn rank_main(comm: &Communicator, device: Option<usize>, opts: RunOpts) -> Vec<Row> {
    let x = Expect::of(comm.config(), device.is_none());
    let n = comm.size();
    let fail = |what: &str, e: String| {
        vec![Row {
            check: format!("{} n={n} {what}", x.label),
            pass: false,
            detail: e,
        }]
    };
    match device {
        Some(ordinal) => match Gpu::open(ordinal) {
            Ok(gpu) => run(comm, gpu, &x, opts),
            Err(e) => fail("open", e.to_string()),
        },
        None => run(comm, HostStream::new(), &x, opts),
    }
}

/// [`rank_main`] on device `dev`.
fn run<D: CheckDev>(comm: &Communicator, dev: D, x: &Expect, opts: RunOpts) -> Vec<Row>
where
    D::Buf: Send,
{
    let n = comm.size();
    let label = &x.label;
    let mut rows = Vec::new();
    let dc = match DeviceComm::new(comm, dev) {
        Ok(dc) => std::sync::Arc::new(dc),
        Err(e) => {
            return vec![Row {
                check: format!("{label} n={n} connect"),
                pass: false,
                detail: e.to_string(),
            }]
        }
    };
    let want = x.want;
    let mut edges: Vec<String> = dc.edges().iter().map(|e| e.to_string()).collect();
    // A staged run's staging way: the forced one, else auto's pick for this run, where every
    // rank shares the one GPU (copies for at most 2), or each process is its own host stream
    // (no copy engines: mapped).
    let staged = want == TransportKind::Shm;
    let way = x
        .forced
        .unwrap_or(if x.host || n > COPY_STAGING_MAX_SHARERS {
            StagingMode::Mapped
        } else {
            StagingMode::Copy
        });
    if staged {
        edges.push(format!(
            "staging {} ({}; want {way})",
            dc.staging().0,
            dc.staging().1
        ));
    }
    rows.push(Row {
        check: format!("{label} n={n} edges"),
        pass: dc.edges().iter().all(|e| e.kind == want) && (!staged || dc.staging().0 == way),
        detail: edges.join("; "),
    });
    rows.push(Row {
        check: format!("{label} n={n} algorithm"),
        pass: dc.direct().is_some() == x.direct,
        detail: dc
            .direct()
            .map_or_else(|| "the slot ring".to_string(), str::to_string),
    });
    let mut seed = 0;
    rows.extend(exact_rows(&dc, label, opts.quick, &mut seed));
    let fail = async_all_reduce(&dc, seed).err();
    rows.push(Row {
        check: format!("{label} n={n} async all_reduce"),
        pass: fail.is_none(),
        detail: fail.unwrap_or_else(|| {
            "4 f32 sum all-reduces of 2^20+7 queued on the proxy thread, exact".into()
        }),
    });
    let fail = posted_ring(&dc, seed + 4).err();
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
    rows.push(crate::gpu::zero::check(comm, &dc, label));
    // tcp over loopback has no target next to a device copy, nor has the host stream (a host
    // copy is no PCIe link): their checks are exactness only.
    if opts.bench && !x.tcp && !x.host {
        let comparison = if x.ring {
            Some("the slot ring for comparison, auto takes the direct step here")
        } else if x.staged && x.forced.is_some() {
            Some("RINGZERO_STAGING forced, for comparison with auto's pick")
        } else {
            None
        };
        match bandwidth(&dc, (x.staged, &x.label), comparison) {
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

/// One row per collective: every dtype × op × count, out of place and in place where it has
/// that form, checked exactly (the first failure ends a collective's cases); `seed` numbers the
/// cases across calls.
fn exact_rows<D: CheckDev>(
    dc: &DeviceComm<D>,
    label: &str,
    quick: bool,
    seed: &mut usize,
) -> Vec<Row>
where
    D::Buf: Send,
{
    let n = dc.size();
    let mut rows = Vec::new();
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
                for (count, inplace) in counts(quick)
                    .into_iter()
                    .flat_map(|c| [(c, false), (c, true)])
                    // Send-recv (pairs 0↔1, 2↔3), all-to-all-v, gather and scatter have no
                    // in-place form.
                    .filter(|&(_, inplace)| !(inplace && one_way(coll)))
                {
                    *seed += 1;
                    cases += 1;
                    match one(dc, coll, inplace, d, op, count, *seed) {
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
                let [a, b, c] = counts(quick);
                format!("{cases} cases (7 dtypes × 5 ops × counts {a}, {b}, {c} × {ways}) exact")
            }),
        });
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
/// plain copy too. A `comparison` (cuda_ipc with `RINGZERO_DEVICE_ALGO=ring`, which `auto` does
/// not take on one GPU; a staging way forced by `RINGZERO_STAGING`) sets no target, and
/// says why.
fn bandwidth<D: CheckDev>(
    dc: &DeviceComm<D>,
    (staged, kind): (bool, &str),
    comparison: Option<&str>,
) -> Result<Row, String> {
    let n = dc.size();
    let elems = 64usize << 20; // 256 MiB of f32
    let bytes = elems * 4;
    // Never timed on zeros: small integers, so that every rank's sum is exact and checked below.
    let value = |rank: usize, i: usize| ((i * 7 + rank) % 251) as f64 - 125.0;
    let me = dc.rank();
    let vals: Vec<f64> = (0..elems).map(|i| value(me, i)).collect();
    let send = dc.stream().make(DType::F32, &vals)?;
    drop(vals);
    let mut recv = dc.stream().zeros(DType::F32, elems)?;
    // The baseline, measured here and now, by rank 0 alone (the bench's: `BenchDev::baseline`).
    // Host staging: the one-way pinned copy, and each direction's rate while both run at once
    // (what its ranks get, since each sends and receives at the same time).
    let (mut base_gbs, mut both_gbs) = (0.0, 0.0);
    if dc.rank() == 0 {
        let b = dc.stream().baseline(bytes, staged)?;
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
    // The timed result, checked.
    let got = dc.stream().contents(&recv)?;
    let want = |i: usize| (0..n).map(|r| value(r, i)).sum::<f64>();
    if let Some(i) = (0..elems).find(|&i| got[i] != want(i)) {
        return Err(format!(
            "the timed all-reduce's element {i} is {} but should be {}",
            got[i],
            want(i)
        ));
    }
    let nf = n as f64;
    let algo = if dc.direct().is_some() {
        "direct".to_string()
    } else if staged {
        format!("ring, {} staging", dc.staging().0)
    } else {
        "ring".to_string()
    };
    // Host staging moves 2(n−1)/n of the buffer each way per rank, every rank over the one
    // PCIe link at once: busbw ≤ (each direction's rate while both run) / n.
    let (label, base_name, bound, bound_rule, target) = if staged {
        (
            kind,
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
    let target_text = match comparison {
        Some(why) => format!("no target: {why}"),
        None => format!("target {:.0}%", 100.0 * target),
    };
    Ok(Row {
        check: format!("{label} n={n} all_reduce 256 MiB ({algo})"),
        pass: comparison.is_some() || busbw >= target * bound,
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
/// On GPU `device`, or (`None`) the host stream.
pub fn killed_rank_main(comm: &Communicator, device: Option<usize>, victim: usize) -> Vec<Row> {
    let x = Expect::of(comm.config(), device.is_none());
    let check = format!("{} n={} rank {victim} killed", x.label, comm.size());
    let r = match device {
        Some(ordinal) => Gpu::open(ordinal)
            .map_err(|e| e.to_string())
            .and_then(|gpu| killed_rank(comm, gpu, victim)),
        None => killed_rank(comm, HostStream::new(), victim),
    };
    let (pass, detail) = r.unwrap_or_else(|e| (false, e));
    vec![Row {
        check,
        pass,
        detail,
    }]
}

/// [`killed_rank_main`] on device `dev`: whether the row passes, and its detail.
fn killed_rank<D: CheckDev>(
    comm: &Communicator,
    dev: D,
    victim: usize,
) -> Result<(bool, String), String> {
    let dc = DeviceComm::new(comm, dev).map_err(|e| format!("connect: {e}"))?;
    let count = 16 << 20;
    let send = dc.stream().make(DType::F32, &vec![1.5; count])?;
    let mut recv = dc.stream().zeros(DType::F32, count)?;
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
                return Ok((
                    after < timeout / 2,
                    format!(
                        "rank {} failed in iteration {i}, {:.2}s after its last all-reduce \
                         (deadline {:.0}s): {e}",
                        dc.rank(),
                        after.as_secs_f64(),
                        timeout.as_secs_f64()
                    ),
                ));
            }
        }
    }
    Ok((
        false,
        format!("rank {} saw no error in 1000 all-reduces", dc.rank()),
    ))
}
