//! `ringzero bench`: every collective swept over sizes, checked exactly, and set against the ring's
//! α–β model measured on the links in use. See [`theory`] for the arithmetic, [`probe`] for how α and
//! β are measured, [`sweep`] for timing and `#wrong`, [`report`] and [`plot`] for the outputs.
//!
//! Like nccl-tests, it is one harness with small per-collective descriptors (`sweep::Buffers` and
//! the match in `sweep::run`).

pub mod device;
pub mod exact;
pub mod explain;
pub mod plot;
pub mod probe;
pub mod report;
pub mod sweep;
pub mod theory;

use ringzero_collectives::{
    Collective, Collectives, Communicator, DType, InPlace, ReduceOp, Result,
};

use report::{Header, Report};

/// Everything the sweep needs to know.
#[derive(Clone, Debug)]
pub struct BenchArgs {
    /// Collectives to run, in order.
    pub ops: Vec<Collective>,
    /// The sweep itself.
    pub sweep: sweep::SweepArgs,
    /// Bytes each rank streams in the β probe.
    pub probe_bytes: usize,
    /// Why the job has this many ranks, for the header, when the user did not choose.
    pub ranks_note: Option<String>,
}

/// Parse an op name: `all-reduce` (or `all_reduce`, `allreduce`), ..., or `all`.
pub fn parse_ops(s: &str) -> std::result::Result<Vec<Collective>, String> {
    let norm: String = s
        .to_ascii_lowercase()
        .chars()
        .filter(|c| *c != '-' && *c != '_')
        .collect();
    Ok(match norm.as_str() {
        "allreduce" => vec![Collective::AllReduce],
        "reducescatter" => vec![Collective::ReduceScatter],
        "reducescatterv" => vec![Collective::ReduceScatterV],
        "allgather" => vec![Collective::AllGather],
        "broadcast" | "bcast" => vec![Collective::Broadcast { root: 0 }],
        "reduce" => vec![Collective::Reduce { root: 0 }],
        "alltoall" | "a2a" => vec![Collective::AllToAll],
        "sendrecv" | "p2p" => vec![Collective::SendRecv],
        "alltoallv" => vec![Collective::AllToAllV],
        "allgatherv" => vec![Collective::AllGatherV],
        "gather" => vec![Collective::Gather { root: 0 }],
        "scatter" => vec![Collective::Scatter { root: 0 }],
        "all" => vec![
            Collective::AllReduce,
            Collective::ReduceScatter,
            Collective::AllGather,
            Collective::Broadcast { root: 0 },
            Collective::Reduce { root: 0 },
            Collective::AllToAll,
            Collective::AllToAllV,
            Collective::AllGatherV,
            Collective::ReduceScatterV,
            Collective::Gather { root: 0 },
            Collective::Scatter { root: 0 },
        ],
        _ => {
            return Err(format!(
                "unknown op `{s}` (expected all-reduce, reduce-scatter, all-gather, broadcast, \
                 reduce, all-to-all, all-to-all-v, all-gather-v, reduce-scatter-v, gather, \
                 scatter, send-recv or all)"
            ))
        }
    })
}

/// Sizes from `min` to `max` multiplying by `factor` (nccl-tests' -b/-e/-f).
pub fn sizes(min: usize, max: usize, factor: usize) -> std::result::Result<Vec<usize>, String> {
    if min > max {
        return Err(format!("-b {min} is larger than -e {max}"));
    }
    if factor < 2 {
        return Err(format!("-f {factor} must be at least 2"));
    }
    let mut v = Vec::new();
    let mut s = min;
    while s <= max {
        v.push(s);
        match s.checked_mul(factor) {
            Some(next) if next > s => s = next,
            _ => break,
        }
    }
    Ok(v)
}

/// Buffers of the largest size the bench holds per rank at once (send, receive, and the
/// expected result it checks against).
pub const BUFFERS_PER_RANK: u64 = 3;

/// Refuse sizes the bench cannot run: one below an element of `elem_bytes` (it would run zero
/// elements), or a largest size whose buffers, on `ranks` ranks of this machine, need more
/// memory than `available` (it would abort allocating).
pub fn check_sizes(
    sizes: &[usize],
    elem_bytes: usize,
    ranks: usize,
    available: Option<u64>,
) -> std::result::Result<(), String> {
    if let Some(&small) = sizes.iter().find(|&&b| b < elem_bytes) {
        return Err(format!(
            "-b {small}: smaller than one element ({elem_bytes} bytes): sizes are in bytes (1K, 64M, ...), at least {elem_bytes}"
        ));
    }
    let (Some(&max), Some(avail)) = (sizes.last(), available) else {
        return Ok(());
    };
    let need = (max as u64)
        .saturating_mul(BUFFERS_PER_RANK)
        .saturating_mul(ranks as u64);
    if need > avail {
        return Err(format!(
            "size {max}: {ranks} rank(s) × {BUFFERS_PER_RANK} buffers of {max} bytes need {need} bytes but this machine has {avail} available: lower -e (or -b)"
        ));
    }
    Ok(())
}

/// Bytes of memory available to new allocations (`MemAvailable` in `/proc/meminfo`).
pub fn memory_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The ring's transports in one word: `shm`, `tcp` or `shm+tcp`.
pub fn transport_summary(comm: &Communicator, probe: &probe::Probe) -> String {
    let mut kinds: Vec<&str> = probe.edges.iter().map(|e| e.transport.as_str()).collect();
    kinds.sort();
    kinds.dedup();
    if kinds.is_empty() {
        return if comm.size() == 1 {
            "none".into()
        } else {
            "?".into()
        };
    }
    kinds.join("+")
}

/// Run the whole benchmark on every rank; every rank returns the same report. `progress` is
/// called after each (op, size) with the number done and the total.
pub fn run(
    comm: &Communicator,
    a: &BenchArgs,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Report> {
    let n = comm.size();
    even_for_send_recv(n, a)?;
    let probe = probe::measure(comm, a.probe_bytes)?;
    let transport = transport_summary(comm, &probe);
    let total = a.ops.len() * a.sweep.sizes.len();
    let mut done = 0;
    let mut rows = Vec::new();
    for &op in &a.ops {
        let mut tick = || {
            done += 1;
            progress(done, total);
        };
        rows.extend(sweep::sweep(
            comm,
            op,
            &a.sweep,
            probe.model,
            &transport,
            &mut tick,
        )?);
    }
    let header = header(comm, a, &probe, "host".into());
    Ok(Report { header, rows })
}

/// Refuse a send-recv sweep on an odd number of ranks.
fn even_for_send_recv(n: usize, a: &BenchArgs) -> Result<()> {
    if a.ops.contains(&Collective::SendRecv) && !n.is_multiple_of(2) {
        // A rank left out would count its idle time in the mean over ranks.
        return Err(ringzero_collectives::Error::InvalidArgument {
            op: "bench send-recv".into(),
            msg: format!(
                "it pairs ranks 0↔1, 2↔3, ...: run it on an even number of ranks, not {n}"
            ),
        });
    }
    Ok(())
}

fn header(comm: &Communicator, a: &BenchArgs, probe: &probe::Probe, device: String) -> Header {
    let host_buffers = device == "host";
    Header {
        version: env!("CARGO_PKG_VERSION").to_string(),
        host: rustix::system::uname()
            .nodename()
            .to_string_lossy()
            .into_owned(),
        ranks: comm.size(),
        ranks_note: a.ranks_note.clone(),
        dtype: a.sweep.dtype.to_string(),
        redop: a.sweep.redop.to_string(),
        device,
        alpha_us: probe.alpha_us,
        beta_gbs: probe.model.beta_gbs,
        edges: probe.edges.iter().map(Into::into).collect(),
        device_edges: Vec::new(),
        memcpy_gbs: probe.memcpy_gbs,
        tcp_stream_gbs: probe.tcp_stream_gbs,
        shared_copy_gbs: probe.shared_copy_gbs,
        slice_bytes: comm.config().slice_bytes,
        probe_bytes: a.probe_bytes,
        iters: a.sweep.iters,
        warmup: a.sweep.warmup,
        time: "mean over ranks of each rank's mean time per call".into(),
        model: if !host_buffers {
            String::new()
        } else {
            let lines = if a.sweep.model_per_row {
                format!(
                    "each line's α and β (its β column) re-measured in the same seconds as its timed calls: groups of \
                     up to {} calls, each followed by as many barriers (α) and streams of the bytes one link \
                     carries in that call (β, slowest edge) over the links the call loads, in its directions: \
                     every rank to the next at once for the ring collectives, rank r to r+1 one way for the \
                     rooted ones (broadcast, reduce, gather, scatter), each stream a window further along \
                     buffers of the call's size (so streams and calls meet the caches alike; in place, \
                     receiving into the next window as often as the call stores into lines it has not \
                     just read), and by as many plain copies, on \
                     every rank at once, of the bytes a rank copies within its own memory beside its \
                     links (out of place an all-gather's own part, a root's own block, a broadcast's \
                     input into its output, an all-to-all's own block; a relay's second write on 3+ ranks; \
                     the all-gathers' and the broadcast's from a slice-sized source in cache, as those \
                     calls store a slice they have just sent), \
                     whose time at that rate the prediction adds (the JSON's copy_gbs); α, β and that rate from \
                     the median group, so one stalled group does not become the line's model; --model start \
                     uses the model above",
                    sweep::GROUP
                )
            } else {
                "every line uses the model above, measured once at the start (a rank's own copies \
                 at the memcpy baseline's rate)"
                    .into()
            };
            format!(
                "{lines}\n# algorithms: {} (RINGZERO_ALGO); lines marked `by doubling` ran \
                 a whole-buffer doubling schedule (recursive doubling, binomial tree), predicted as \
                 rounds·α + rounds·S/β (each round sends the whole buffer); `by halving-doubling` \
                 as rounds·α + V·S/β, V the busiest rank's share of the buffer over all rounds \
                 (2(p−1)/p, p the largest power of two ≤ n, 2 more when n is not one){}",
                comm.config().algo,
                match comm.single_copy_sizes() {
                    Some(s) => format!(
                        "; all-gathers from {} B{} (RINGZERO_SINGLE_COPY_FROM, \
                         RINGZERO_SINGLE_COPY_BELOW) read each \
                         rank's part straight out of its process, marked `single-copy`: \
                         predicted as 2·α + (n−1)/n·S/β, β from streams that are the call's \
                         copies (process_vm_readv of the previous rank's buffer and, out of \
                         place, the copy of the rank's own part), not the slots'{}",
                        s.start,
                        match s.end {
                            usize::MAX => " up".to_string(),
                            end => format!(" to below {end} B"),
                        },
                        if a.sweep.shared_buffers {
                            "; every buffer a ringzero::SharedBuf (--shared-buffers): those \
                             reads, and their β streams, are plain copies from mappings of the \
                             other ranks' buffers kept from call to call, no process_vm_readv"
                        } else {
                            ""
                        }
                    ),
                    None => String::new(),
                }
            )
        },
        device_ring: None,
        device_baseline: None,
        device_bound: None,
    }
}

/// The device's copy rates, measured by rank 0 alone (the others wait) on the sweep's largest
/// size (1 to 256 MiB) and shared with every rank, and what limits the rows: where every rank is
/// on one device and no edge is tcp, that device's memory, or over host staging the one host
/// link; otherwise the ring's links, the slowest edge's rate with every rank shifting that size
/// to the next at once ([`device::ring_links`]; [`theory::device_bound_gbs`] gives each
/// collective's bound). A baseline that cannot be measured is said on stderr and leaves it out,
/// and the bounds that need it.
fn device_bound<D: device::BenchDev>(
    comm: &Communicator,
    dc: &mut ringzero_collectives::DeviceComm<D>,
    a: &BenchArgs,
) -> Result<(Option<device::Baseline>, Option<theory::DeviceLimit>)> {
    use ringzero_collectives::TransportKind;
    let kinds: Vec<TransportKind> = dc.edges().iter().map(|e| e.kind).collect();
    let staged = kinds.contains(&TransportKind::Shm);
    let bytes = a
        .sweep
        .sizes
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .clamp(1 << 20, 256 << 20);
    comm.barrier()?;
    // [copy, pinned, both ways, bytes, kernel both ways]; NaN: none. Rank 0's, broadcast so
    // every rank's rows agree.
    let mut v = [f64::NAN; 5];
    if comm.rank() == 0 {
        match dc.stream().baseline(bytes, staged) {
            Ok(b) => {
                v = [
                    b.copy_gbs,
                    b.pinned_gbs.unwrap_or(f64::NAN),
                    b.both_ways_gbs.unwrap_or(f64::NAN),
                    b.bytes as f64,
                    b.kernel_both_ways_gbs.unwrap_or(f64::NAN),
                ]
            }
            Err(e) => {
                crate::eline!("ringzero bench: no device baseline ({e}); rows carry no bound")
            }
        }
    }
    comm.broadcast(InPlace, &mut v, 0)?;
    if v[0].is_nan() {
        return Ok((None, None));
    }
    let some = |x: f64| (!x.is_nan()).then_some(x);
    let b = device::Baseline {
        bytes: v[3] as usize,
        copy_gbs: v[0],
        pinned_gbs: some(v[1]),
        both_ways_gbs: some(v[2]),
        kernel_both_ways_gbs: some(v[4]),
    };
    let limit = if dc.size() < 2 {
        None
    } else if !dc.one_device() || kinds.contains(&TransportKind::Tcp) {
        let count = b.bytes / a.sweep.dtype.size();
        let timing = (a.sweep.warmup, a.sweep.iters);
        let beta = device::ring_links(comm, dc, (a.sweep.dtype, count), false, timing)?;
        Some(theory::DeviceLimit::Links(beta))
    } else if let (true, Some(w)) = (staged, b.both_ways_gbs) {
        Some(theory::DeviceLimit::Staged(w))
    } else {
        // (A host stream's "staging" is host memory: the memory bound.)
        Some(theory::DeviceLimit::Memory(b.copy_gbs))
    };
    Ok((Some(b), limit))
}

/// [`run`] on device buffers through `dc` (the device and its stream `device` names). α and β
/// are still measured on the host links (the header's model) and predict no device row; the
/// rows are set against the device's bound (`Header::device_bound`): ranks sharing one device
/// against its memory or host link, others against the device ring's links (rows the direct
/// step runs between devices get none).
/// Collectives device buffers do not support are left out, and rank 0 says so on stderr.
pub fn run_device<D: device::BenchDev>(
    comm: &Communicator,
    dc: &mut ringzero_collectives::DeviceComm<D>,
    a: &BenchArgs,
    device_name: String,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Report> {
    even_for_send_recv(comm.size(), a)?;
    let probe = probe::measure(comm, a.probe_bytes)?;
    let mut kinds: Vec<String> = dc.edges().iter().map(|e| e.kind.to_string()).collect();
    kinds.sort();
    kinds.dedup();
    let transport = if kinds.is_empty() {
        "none".to_string()
    } else {
        kinds.join("+")
    };
    let ops = a.ops.clone();
    let (baseline, limit) = device_bound(comm, dc, a)?;
    // The links' rate per (elements shifted, in place), measured when a row first needs it.
    let mut links: Vec<((usize, bool), f64)> = Vec::new();
    let total = ops.len() * a.sweep.sizes.len();
    let mut done = 0;
    let mut rows = Vec::new();
    let per_node = comm.ranks_per_node();
    for &op in &ops {
        let mut tick = || {
            done += 1;
            progress(done, total);
        };
        // Ranks that map each other's buffers run these by the direct step, not over the
        // ring's edges: the rows say so.
        let direct =
            dc.direct().is_some() && ringzero_collectives::device::direct::has_direct_form(op);
        let how = if direct {
            "direct".to_string()
        } else {
            transport.clone()
        };
        let mut got = device::sweep(comm, dc, op, &a.sweep, &how, &mut tick)?;
        for r in got.iter_mut().filter(|r| r.bytes > 0) {
            let row_limit = match limit {
                // The direct step does not go over the ring's links: they bound nothing there;
                // nor do they bound what goes over other links (send-recv's pairs).
                Some(theory::DeviceLimit::Links(_)) if direct => None,
                Some(l @ theory::DeviceLimit::Links(_))
                    if theory::device_bound_gbs(op, r.ranks, r.inplace, l).is_none() =>
                {
                    None
                }
                // The links carrying what one link carries in this row's call (busbw's factor
                // times its count, as the host model's β), in place or not as the row.
                Some(theory::DeviceLimit::Links(_)) => {
                    let per_link =
                        (theory::busbw_factor(op, r.ranks) * r.count as f64).round() as usize;
                    let key = (per_link, r.inplace);
                    let beta = match links.iter().find(|(k, _)| *k == key) {
                        Some(&(_, beta)) => beta,
                        None => {
                            let beta = device::ring_links(
                                comm,
                                dc,
                                (a.sweep.dtype, per_link),
                                r.inplace,
                                (a.sweep.warmup, a.sweep.iters),
                            )?;
                            links.push((key, beta));
                            beta
                        }
                    };
                    r.beta_gbs = Some(beta);
                    Some(theory::DeviceLimit::Links(beta))
                }
                l => l,
            };
            let Some(gbs) =
                row_limit.and_then(|l| theory::device_bound_on(op, &per_node, r.inplace, l))
            else {
                continue;
            };
            // The time at the bound: busbw = factor · bytes / t.
            let t_us = theory::busbw_factor(op, r.ranks) * r.bytes as f64 / (gbs * 1e9) * 1e6;
            r.predicted_us = Some(t_us);
            r.efficiency = Some(t_us / r.time_us);
        }
        rows.extend(got);
    }
    let mut header = header(comm, a, &probe, device_name);
    let cfg = comm.config();
    header.device_ring = Some(format!(
        "slices of {} B, {} slots per edge, copy pairs {} (RINGZERO_DEVICE_COPY_PAIRS), host \
         staging {} ({})",
        dc.slice_bytes(),
        cfg.slots,
        if cfg.device_copy_pairs { "on" } else { "off" },
        dc.staging().0,
        dc.staging().1,
    ));
    header.device_baseline = baseline;
    header.device_bound = limit.map(|l| {
        let (name, gbs) = match l {
            theory::DeviceLimit::Memory(c) => ("memory", c),
            theory::DeviceLimit::Staged(w) => ("staging", w),
            theory::DeviceLimit::Links(beta) => ("links", beta),
        };
        report::DeviceBound {
            limit: name.into(),
            gbs,
            all_reduce_busbw_gbs: theory::device_bound_gbs(
                Collective::AllReduce,
                dc.size(),
                false,
                l,
            )
            .unwrap_or(0.0),
        }
    });
    header.device_edges = dc
        .edges()
        .iter()
        .map(|e| report::DeviceEdgeOut {
            from: e.from,
            to: e.to,
            transport: e.kind.to_string(),
            reason: e.reason.clone(),
            sockets: e.sockets,
        })
        .collect();
    Ok(Report { header, rows })
}

/// The whole text report: header, one table per op, summary.
pub fn text(r: &Report) -> String {
    let mut s = report::header_text(&r.header);
    let mut start = 0;
    while start < r.rows.len() {
        let op = &r.rows[start].op;
        let end = start + r.rows[start..].iter().take_while(|x| &x.op == op).count();
        s += &report::table(op, &r.rows[start..end]);
        start = end;
    }
    s += &report::summary(&r.rows);
    s
}

/// Defaults that make a sensible first run: f32 sum.
pub fn default_sweep() -> sweep::SweepArgs {
    sweep::SweepArgs {
        dtype: DType::F32,
        redop: ReduceOp::Sum,
        sizes: sizes(4 << 10, 64 << 20, 4).expect("valid defaults"),
        iters: 20,
        warmup: 5,
        corrupt_rank: None,
        model_per_row: true,
        algos: Vec::new(),
        shared_buffers: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ops_and_sizes_parse_like_nccl_tests() {
        assert_eq!(
            parse_ops("all-reduce").unwrap(),
            vec![Collective::AllReduce]
        );
        assert_eq!(
            parse_ops("reduce_scatter").unwrap(),
            vec![Collective::ReduceScatter]
        );
        assert_eq!(parse_ops("all").unwrap().len(), 11);
        assert_eq!(
            parse_ops("reduce-scatter-v").unwrap(),
            vec![Collective::ReduceScatterV]
        );
        assert_eq!(
            parse_ops("all_to_all_v").unwrap(),
            vec![Collective::AllToAllV]
        );
        assert_eq!(
            parse_ops("AllGatherV").unwrap(),
            vec![Collective::AllGatherV]
        );
        assert_eq!(
            parse_ops("scatter").unwrap(),
            vec![Collective::Scatter { root: 0 }]
        );
        assert_eq!(parse_ops("all-to-all").unwrap(), vec![Collective::AllToAll]);
        assert_eq!(parse_ops("send-recv").unwrap(), vec![Collective::SendRecv]);
        assert!(!parse_ops("all").unwrap().contains(&Collective::SendRecv));
        assert!(parse_ops("hypercube")
            .unwrap_err()
            .contains("unknown op `hypercube`"));
        assert_eq!(sizes(8, 64, 2).unwrap(), vec![8, 16, 32, 64]);
        assert_eq!(sizes(4096, 4096, 2).unwrap(), vec![4096]);
        assert!(sizes(10, 5, 2).is_err());
        assert!(sizes(1, 5, 1).unwrap_err().contains("-f 1"));
    }
}
