//! `ringzero bench`'s harness with ranks as threads: exact checks that catch a corrupted result,
//! rows that add up, and a JSON report that parses back.

use ringzero::{Collective, DType, ReduceOp, TransportPref};
use ringzero_tools::bench::{self, report::Report, sweep::SweepArgs, theory::Algo, BenchArgs};

use crate::common::{threads, Opts};

fn args(corrupt_rank: Option<usize>, dtype: DType, redop: ReduceOp) -> BenchArgs {
    BenchArgs {
        ops: bench::parse_ops("all").unwrap(),
        sweep: SweepArgs {
            dtype,
            redop,
            sizes: vec![0, 8, 1000, 4096],
            iters: 2,
            warmup: 1,
            corrupt_rank,
            model_per_row: true,
            algos: Vec::new(),
            shared_buffers: false,
        },
        probe_bytes: 64 << 10,
        ranks_note: None,
    }
}

#[test]
fn a_corrupted_result_is_counted_and_a_clean_run_counts_nothing() {
    for (corrupt, transport) in [(None, TransportPref::Shm), (Some(1), TransportPref::Tcp)] {
        let o = Opts {
            transport,
            slice_bytes: 1024,
            ..Opts::default()
        };
        let reports = threads(3, &o, |_, comm| {
            let comm = comm.unwrap();
            bench::run(
                &comm,
                &args(corrupt, DType::BF16, ReduceOp::Avg),
                &mut |_, _| {},
            )
            .unwrap()
        });
        let r = &reports[0];
        assert!(
            reports.iter().all(|x| x.rows == r.rows),
            "every rank returns the same rows"
        );
        assert_eq!(
            r.rows.len(),
            8 * 4 * 2 + 3 * 4,
            "8 ops × 4 sizes × (out of place, in place), 3 with no in-place form × 4 sizes"
        );
        for row in &r.rows {
            // Rank 1 holds a checked result unless its part is empty (or it is not the root).
            let rank1_checks = match row.op.as_str() {
                "reduce" | "gather" => false,
                "reduce_scatter" | "reduce_scatter_v" => {
                    !ringzero::chunk(row.count, 3, 1).is_empty()
                }
                _ => row.count > 0,
            };
            let want = u64::from(corrupt.is_some() && rank1_checks);
            assert_eq!(row.wrong, want, "{row:?}");
            assert_eq!(
                row.transport,
                if transport == TransportPref::Shm {
                    "shm"
                } else {
                    "tcp"
                }
            );
            assert_eq!((row.ranks, row.dtype.as_str()), (3, "bf16"));
        }
        assert_eq!(r.header.edges.len(), 3);
        assert!(
            r.header.alpha_us > 0.0 && r.header.beta_gbs > 0.0,
            "{:?}",
            r.header
        );
        // The baselines that fit the transport: a copy out of the previous rank's shared memory
        // when every edge is shm, a plain TCP stream pair when one is tcp.
        let shm = transport == TransportPref::Shm;
        assert_eq!(
            r.header.shared_copy_gbs.is_some_and(|x| x > 0.0),
            shm,
            "{:?}",
            r.header
        );
        assert_eq!(
            r.header.tcp_stream_gbs.is_some_and(|x| x > 0.0),
            !shm,
            "{:?}",
            r.header
        );
        let text = bench::text(r);
        assert_eq!(text.contains("previous rank's memory"), shm, "{text}");
    }
}

#[test]
fn send_recv_pairs_ranks_and_checks_what_each_received() {
    // Ranks 0↔1 and 2↔3 exchange; a rank's corrupted result is counted once.
    for (corrupt, want) in [(None, 0), (Some(1), 1), (Some(2), 1)] {
        let reports = threads(4, &Opts::default(), |_, comm| {
            let comm = comm.unwrap();
            let mut a = args(corrupt, DType::F16, ReduceOp::Sum);
            a.ops = bench::parse_ops("send-recv").unwrap();
            bench::run(&comm, &a, &mut |_, _| {}).unwrap()
        });
        let r = &reports[0];
        assert_eq!(r.rows.len(), 4, "4 sizes, out of place only");
        assert!(
            bench::text(r).contains("n/a"),
            "the in-place column says it has none"
        );
        for row in &r.rows {
            assert_eq!(row.op, "send_recv");
            assert_eq!(row.redop, "-");
            assert_eq!(row.wrong, if row.count > 0 { want } else { 0 }, "{row:?}");
            // One message each way between two ranks: one step, the whole buffer per link.
            let m = bench::theory::Model::links(row.alpha_us.unwrap(), row.beta_gbs.unwrap());
            // A send-recv copies nothing within a rank's own memory.
            assert_eq!(row.copy_gbs, None, "{row:?}");
            let pred = m.alpha_us + row.bytes as f64 / (m.beta_gbs * 1e3);
            assert!((row.predicted_us.unwrap() - pred).abs() < 1e-9, "{row:?}");
            assert_eq!(row.busbw_gbs, row.algbw_gbs);
        }
    }
    odd_world_refused(|comm, a| bench::run(comm, a, &mut |_, _| {}).map(|_| ()));
}

/// A send-recv sweep on an odd world would leave a rank idle, its time in the mean: `run`
/// refuses it on every rank.
fn odd_world_refused(
    run: impl Fn(&ringzero::Communicator, &BenchArgs) -> ringzero::Result<()> + Sync,
) {
    let errs = threads(3, &Opts::default(), |_, comm| {
        let comm = comm.unwrap();
        let mut a = args(None, DType::F32, ReduceOp::Sum);
        a.ops = bench::parse_ops("p2p").unwrap();
        run(&comm, &a).unwrap_err().to_string()
    });
    for e in errs {
        assert!(
            e.contains("run it on an even number of ranks, not 3"),
            "{e}"
        );
    }
}

#[test]
fn rows_follow_the_nccl_tests_definitions_and_the_json_parses_back() {
    let o = Opts {
        transport: TransportPref::Shm,
        // The largest all-gather reads directly (its row's β from single-copy streams).
        single_copy_from: Some(4096),
        ..Opts::default()
    };
    let reports = threads(2, &o, |_, comm| {
        let comm = comm.unwrap();
        let mut a = args(None, DType::F32, ReduceOp::Sum);
        let per_row = bench::run(&comm, &a, &mut |_, _| {}).unwrap();
        a.sweep.model_per_row = false;
        let start = bench::run(&comm, &a, &mut |_, _| {}).unwrap();
        (per_row, start, comm.single_copy_sizes())
    });
    // Per-row models: every row carries the α and β its prediction was computed from.
    let (r, _, single_copy) = &reports[0];
    let choice = || (ringzero::Algo::default(), single_copy.clone());
    assert_eq!(*single_copy, Some(4096..usize::MAX));
    assert!(r.header.model.contains("single-copy"), "{}", r.header.model);
    assert_eq!(r.rows.iter().filter(|x| x.algo == "single-copy").count(), 2);
    assert!(reports.iter().all(|(x, _, _)| x.rows == r.rows));
    assert!(r.header.model.contains("re-measured"), "{}", r.header.model);
    for row in &r.rows {
        let op = ringzero_tools::bench::parse_ops(&row.op.replace('_', "-")).unwrap()[0];
        let (alpha_us, beta_gbs) = (row.alpha_us.unwrap(), row.beta_gbs.unwrap());
        assert!(alpha_us > 0.0 && beta_gbs > 0.0, "{row:?}");
        // Two ranks on one node: the ring, but for the collectives that always run pairwise and
        // the all-gathers that read directly.
        let algo = bench::theory::runs(choice(), op, row.bytes, (2, 1, true));
        assert_eq!(row.algo, algo.name(), "{row:?}");
        // A row whose collective copies within a rank's memory carries the copy rate measured
        // with it, and only such a row.
        let relays = bench::theory::relays_copy(&row.transport);
        let local = bench::theory::local_copy_bytes(op, algo, 2, (row.bytes, row.inplace), relays);
        assert_eq!(row.copy_gbs.is_some(), local > 0.0, "{row:?}");
        assert!(row.copy_gbs.is_none_or(|c| c > 0.0), "{row:?}");
        let m = bench::theory::Model {
            copy_gbs: row.copy_gbs,
            relays_copy: relays,
            ..bench::theory::Model::links(alpha_us, beta_gbs)
        };
        assert_eq!(
            row.predicted_us,
            bench::theory::predict_us_on(op, algo, &[2], (row.bytes, row.inplace), m)
        );
        assert!(
            local == 0.0
                || row.predicted_us
                    > bench::theory::predict_us_on(
                        op,
                        algo,
                        &[2],
                        (row.bytes, row.inplace),
                        bench::theory::Model::links(alpha_us, beta_gbs)
                    ),
            "{row:?}"
        );
        assert_eq!(
            row.efficiency,
            bench::theory::efficiency(row.predicted_us, row.time_us)
        );
    }
    // One model for the whole run (`--model start`): the header's.
    let (_, r, _) = &reports[0];
    assert!(
        r.header.model.contains("measured once"),
        "{}",
        r.header.model
    );
    for row in &r.rows {
        let op = ringzero_tools::bench::parse_ops(&row.op.replace('_', "-")).unwrap()[0];
        assert_eq!(row.bytes, row.count * 4);
        assert!((row.algbw_gbs - bench::theory::algbw_gbs(row.bytes, row.time_us)).abs() < 1e-12);
        assert!((row.busbw_gbs - row.algbw_gbs * bench::theory::busbw_factor(op, 2)).abs() < 1e-12);
        // Two ranks: every all-reduce goes round the ring under `auto`; all-gathers from the
        // threshold read directly.
        let algo = bench::theory::runs(choice(), op, row.bytes, (2, 1, true));
        let pairwise = op.is_pairwise();
        let direct =
            op == Collective::AllGather && single_copy.as_ref().unwrap().contains(&row.bytes);
        let want = match (pairwise, direct) {
            (true, _) => Algo::Pairwise,
            (_, true) => Algo::SingleCopy,
            _ => Algo::Ring,
        };
        assert_eq!(algo, want);
        assert_eq!(row.algo, algo.name(), "{row:?}");
        // The header's model: its own copies at the memcpy baseline's rate.
        let pred =
            bench::theory::predict_us_on(op, algo, &[2], (row.bytes, row.inplace), start_model(r));
        assert_eq!(row.predicted_us, pred);
        let relays = bench::theory::relays_copy(&row.transport);
        let local = bench::theory::local_copy_bytes(op, algo, 2, (row.bytes, row.inplace), relays);
        assert_eq!(
            row.copy_gbs,
            (local > 0.0).then_some(r.header.memcpy_gbs),
            "{row:?}"
        );
        assert_eq!(
            (row.alpha_us, row.beta_gbs),
            (Some(r.header.alpha_us), Some(r.header.beta_gbs))
        );
        assert_eq!(row.redop, if op.reduces() { "sum" } else { "-" });
    }
    let json = serde_json::to_string(r).unwrap();
    let back: Report = serde_json::from_str(&json).unwrap();
    assert_eq!(&back, r);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    for key in [
        "op",
        "bytes",
        "count",
        "dtype",
        "redop",
        "ranks",
        "transport",
        "time_us",
        "algbw_gbs",
        "busbw_gbs",
        "wrong",
        "inplace",
        "predicted_us",
        "efficiency",
    ] {
        assert!(v["rows"][0].get(key).is_some(), "row lacks `{key}`");
    }
    for key in ["alpha_us", "beta_gbs", "host", "version"] {
        assert!(v["header"].get(key).is_some(), "header lacks `{key}`");
    }
    let text = bench::text(r);
    assert!(
        text.contains("# all_reduce") && text.contains("out of bounds values : 0 OK"),
        "{text}"
    );
}

/// Send-recv on device buffers: pairs 0↔1 and 2↔3 over device links of their own, each result
/// checked (a corrupted one counted), set against the one memory the thread ranks share (each
/// rank reads its message and writes its partner's: busbw ≤ copy/2n); an odd world is refused.
#[test]
fn the_device_sweep_runs_send_recv_between_pairs() {
    for (corrupt, want) in [(None, 0), (Some(2), 1)] {
        let reports = threads(4, &Opts::default(), |_, comm| {
            let comm = comm.unwrap();
            let mut dc = ringzero::DeviceComm::new(&comm, ringzero::HostStream::new()).unwrap();
            let mut a = args(corrupt, DType::F32, ReduceOp::Sum);
            a.ops = bench::parse_ops("send-recv").unwrap();
            let r = bench::run_device(&comm, &mut dc, &a, "host-stream".into(), &mut |_, _| {});
            (r.unwrap(), dc.pair_edges(comm.rank() ^ 1).is_some())
        });
        let r = &reports[0].0;
        assert!(reports.iter().all(|x| x.1), "every rank met its partner");
        assert_eq!(r.rows.len(), 4, "4 sizes, out of place only");
        let c = r.header.device_baseline.unwrap().copy_gbs;
        for row in &r.rows {
            assert_eq!(row.op, "send_recv");
            assert_eq!(row.wrong, if row.count > 0 { want } else { 0 }, "{row:?}");
            if let Some(p) = row.predicted_us {
                let busbw_at_pred = row.bytes as f64 / (p * 1e3);
                assert!((busbw_at_pred - c / 8.0).abs() <= 1e-9 * c, "{row:?}");
            }
            assert_eq!(row.predicted_us.is_some(), row.bytes > 0, "{row:?}");
        }
    }
    odd_world_refused(|comm, a| {
        let mut dc = ringzero::DeviceComm::new(comm, ringzero::HostStream::new())?;
        bench::run_device(comm, &mut dc, a, "host-stream".into(), &mut |_, _| {}).map(|_| ())
    });
}

/// The device collectives that go over pairs of ranks and have no in-place form.
const ONE_WAY: [&str; 3] = ["all_to_all_v", "gather", "scatter"];

/// The same sweep on device buffers (the device engine with the host as its device): every
/// collective both ways checked exactly, a corrupted result counted, the device edges in the
/// header.
#[test]
fn the_device_sweep_checks_every_variant_and_catches_corruption() {
    for (corrupt, transport) in [(None, TransportPref::Shm), (Some(1), TransportPref::Tcp)] {
        let o = Opts {
            transport,
            slice_bytes: 1024,
            ..Opts::default()
        };
        let reports = threads(3, &o, |_, comm| {
            let comm = comm.unwrap();
            let mut dc = ringzero::DeviceComm::new(&comm, ringzero::HostStream::new()).unwrap();
            bench::run_device(
                &comm,
                &mut dc,
                &args(corrupt, DType::F16, ReduceOp::Max),
                "host-stream".into(),
                &mut |_, _| {},
            )
            .unwrap()
        });
        let r = &reports[0];
        assert!(reports.iter().all(|x| x.rows == r.rows));
        // Every collective both ways, as on the host.
        // (All-to-all runs on whole blocks: 4092 of the 4096 bytes.)
        let variants: Vec<(String, bool)> = r
            .rows
            .iter()
            .filter(|x| x.bytes > 4000)
            .map(|x| (x.op.clone(), x.inplace))
            .collect();
        let want: Vec<(String, bool)> = [
            "all_reduce",
            "reduce_scatter",
            "all_gather",
            "broadcast",
            "reduce",
            "all_to_all",
            "all_to_all_v",
            "all_gather_v",
            "reduce_scatter_v",
            "gather",
            "scatter",
        ]
        .iter()
        .flat_map(|o| [(o.to_string(), false), (o.to_string(), true)])
        // All-to-all-v, gather and scatter have no in-place form.
        .filter(|(o, inplace)| !inplace || !ONE_WAY.contains(&o.as_str()))
        .collect();
        assert_eq!(variants, want);
        assert_eq!(r.rows.len(), 8 * 4 * 2 + 3 * 4);
        for row in &r.rows {
            // Rank 1 holds a checked result unless its part is empty (or it is not the root).
            let rank1_checks = match row.op.as_str() {
                // The root is rank 0.
                "reduce" | "gather" => false,
                "reduce_scatter" | "reduce_scatter_v" => {
                    !ringzero::chunk(row.count, 3, 1).is_empty()
                }
                _ => row.count > 0,
            };
            assert_eq!(
                row.wrong,
                u64::from(corrupt.is_some() && rank1_checks),
                "{row:?}"
            );
            // Thread ranks of a host stream share one memory: every row is set against the
            // bytes its collective must move through it. On 3 ranks, copy c: all-reduce
            // (4/3)·c/6; reduce-scatter (2/3)·c/4; all-gather (2/3)·c/4, in place (2/3)·c/3;
            // broadcast c/4, in place c/3; reduce c/4; all-to-all (2/3)·c/6, in place
            // (2/3)·c/4. Over tcp the ring's links bound them instead: busbw ≤ β, the slowest
            // edge's measured rate, for every ring collective, and 2β/3 for the all-to-all,
            // whose blocks go 1 or 2 hops.
            // All-to-all-v, gather and scatter go over pairs, not the ring's links: over tcp
            // they have no bound.
            let pairs = ONE_WAY.contains(&row.op.as_str());
            let bounded = row.bytes > 0 && (transport == TransportPref::Shm || !pairs);
            assert_eq!(row.predicted_us.is_some(), bounded, "{row:?}");
            assert_eq!(row.efficiency.is_some(), bounded, "{row:?}");
            if let (Some(p), Some(e)) = (row.predicted_us, row.efficiency) {
                let c = r.header.device_baseline.unwrap().copy_gbs;
                let (factor, bound) = match (row.op.as_str(), row.inplace) {
                    ("all_reduce", _) => (4.0 / 3.0, 4.0 / 3.0 * c / 6.0),
                    ("reduce_scatter" | "reduce_scatter_v", _) => (2.0 / 3.0, 2.0 / 3.0 * c / 4.0),
                    ("all_gather" | "all_gather_v", false) => (2.0 / 3.0, 2.0 / 3.0 * c / 4.0),
                    ("all_gather" | "all_gather_v", true) => (2.0 / 3.0, 2.0 / 3.0 * c / 3.0),
                    ("broadcast", false) | ("reduce", _) => (1.0, c / 4.0),
                    ("broadcast", true) => (1.0, c / 3.0),
                    ("all_to_all" | "all_to_all_v", false) => (2.0 / 3.0, 2.0 / 3.0 * c / 6.0),
                    ("gather" | "scatter", false) => (2.0 / 3.0, 2.0 / 3.0 * c / 2.0),
                    ("all_to_all", true) => (2.0 / 3.0, 2.0 / 3.0 * c / 4.0),
                    _ => panic!("no bound expected: {row:?}"),
                };
                let bound = match transport {
                    TransportPref::Shm => {
                        assert_eq!(row.beta_gbs, None, "{row:?}");
                        bound
                    }
                    // β measured at this row's size, in place or not as the row.
                    _ => {
                        let beta = row.beta_gbs.expect("a links-bound row carries its β");
                        if row.op == "all_to_all" {
                            2.0 * beta / 3.0
                        } else {
                            beta
                        }
                    }
                };
                let busbw_at_pred = factor * row.bytes as f64 / (p * 1e3);
                assert!(
                    (busbw_at_pred - bound).abs() <= 1e-9 * bound,
                    "{row:?} {bound}"
                );
                assert!((e - p / row.time_us).abs() <= 1e-12, "{row:?}");
            }
            assert_eq!(
                row.transport,
                if transport == TransportPref::Shm {
                    "shm"
                } else {
                    "tcp"
                }
            );
        }
        assert_eq!(r.header.device_edges.len(), 2);
        assert_eq!(r.header.device, "host-stream");
        // The device ring's set-up: the host stream slices as the host does (1 KiB here).
        assert_eq!(
            r.header.device_ring.as_deref(),
            Some(
                "slices of 1024 B, 4 slots per edge, copy pairs on (RINGZERO_DEVICE_COPY_PAIRS), \
                 host staging mapped (RINGZERO_STAGING=mapped)"
            )
        );
        let base = r
            .header
            .device_baseline
            .expect("a host stream's copy baseline");
        assert!(base.copy_gbs > 0.0 && base.pinned_gbs.is_none(), "{base:?}");
        assert_eq!(
            base.bytes,
            1 << 20,
            "the sweep's largest size, at least 1 MiB"
        );
        match (transport, &r.header.device_bound) {
            (TransportPref::Shm, Some(b)) => {
                assert_eq!((b.limit.as_str(), b.gbs), ("memory", base.copy_gbs));
                let want = base.copy_gbs * 2.0 / 9.0; // copy·(n−1)/n² on 3 ranks
                assert!(
                    (b.all_reduce_busbw_gbs - want).abs() <= 1e-9 * want,
                    "{b:?}"
                );
            }
            (TransportPref::Shm, None) => panic!("thread ranks on shm share one memory: a bound"),
            (_, Some(b)) => {
                // Over tcp: the device ring's links, shifting the baseline's bytes.
                assert_eq!(b.limit, "links");
                assert!(b.gbs > 0.0 && b.gbs.is_finite(), "{b:?}");
                assert_eq!(b.all_reduce_busbw_gbs, b.gbs);
            }
            (_, None) => panic!("over tcp the ring's links bound the rows"),
        }
        let text = bench::text(r);
        // Every variant has its line; only the in-place columns of all-to-all-v, gather and
        // scatter read n/a.
        assert_eq!(text.matches("n/a").count(), 3 * 4, "{text}");
        assert!(text.contains("# device ring: slices of 1024 B"), "{text}");
        assert!(
            text.contains("# device baseline (rank 0 alone, 1048576 B, the fastest of 3 timings)"),
            "{text}"
        );
        assert_eq!(
            text.contains("# device bound: the 3 ranks share one device's memory"),
            transport == TransportPref::Shm,
            "{text}"
        );
        assert_eq!(
            text.contains("# device bound: the ring's links (β: the slowest edge's rate while"),
            transport != TransportPref::Shm,
            "{text}"
        );
        assert!(
            !text.contains("# device buffers: the model below is the host links'"),
            "every row has a bound: {text}"
        );
    }
}

#[test]
fn lines_name_and_model_the_schedule_auto_picked() {
    let o = Opts {
        algo: Some(ringzero::Algo::Auto {
            doubling_max: 1024,
            halving_max: 8192,
            pairwise_max: ringzero_collectives::config::DEFAULT_PAIRWISE_MAX,
        }),
        ..Opts::default()
    };
    let reports = threads(4, &o, |_, comm| {
        let comm = comm.unwrap();
        let mut a = args(None, DType::F32, ReduceOp::Sum);
        a.ops = bench::parse_ops("all-reduce").unwrap();
        a.sweep.sizes = vec![1024, 4096, 16384];
        a.sweep.model_per_row = false;
        bench::run(&comm, &a, &mut |_, _| {}).unwrap()
    });
    let r = &reports[0];
    let m = start_model(r);
    let by = |s| Algo::By(s);
    for (bytes, algo) in [
        (1024, by(ringzero::Schedule::Doubling)),
        (4096, by(ringzero::Schedule::HalvingDoubling)),
        (16384, Algo::Ring),
    ] {
        let rows: Vec<_> = r.rows.iter().filter(|x| x.bytes == bytes).collect();
        assert_eq!(rows.len(), 2, "out of place and in place at {bytes}");
        for row in rows {
            assert_eq!(row.algo, algo.name(), "{row:?}");
            assert_eq!(row.wrong, 0, "{row:?}");
            let op = ringzero::Collective::AllReduce;
            assert_eq!(
                row.predicted_us,
                bench::theory::predict_us(op, algo, 4, bytes, m)
            );
        }
    }
    let text = bench::text(r);
    let line = |b: &str| {
        text.lines()
            .find(|l| l.trim_start().starts_with(b))
            .unwrap_or_else(|| panic!("no line for {b}: {text}"))
            .to_string()
    };
    assert!(line("1024 ").ends_with("  by doubling"), "{text}");
    assert!(line("4096 ").ends_with("  by halving-doubling"), "{text}");
    assert!(!line("16384 ").contains(" by "), "{text}");
}

#[test]
fn algorithms_side_by_side_each_get_a_checked_line_and_the_fastest_is_named() {
    use ringzero::Algo as A;
    let reports = threads(4, &Opts::default(), |_, comm| {
        let comm = comm.unwrap();
        let mut a = args(None, DType::F32, ReduceOp::Sum);
        a.ops = ["all-reduce", "broadcast", "all-gather", "all-gather-v"]
            .iter()
            .flat_map(|o| bench::parse_ops(o).unwrap())
            .collect();
        a.sweep.sizes = vec![1024, 4096];
        a.sweep.model_per_row = false;
        a.sweep.algos = vec![A::Ring, A::Doubling, A::HalvingDoubling];
        bench::run(&comm, &a, &mut |_, _| {}).unwrap()
    });
    let r = &reports[0];
    let algos = |op: &str, bytes: usize| {
        let mut v: Vec<&str> = r
            .rows
            .iter()
            .filter(|x| x.op == op && x.bytes == bytes)
            .map(|x| x.algo.as_str())
            .collect();
        v.dedup();
        v
    };
    // Each algorithm with a schedule of its own, once per size, both ways, checked.
    for bytes in [1024, 4096] {
        assert_eq!(
            algos("all_reduce", bytes),
            ["ring", "doubling", "halving-doubling"]
        );
        // Halving-doubling has no broadcast: the ring's is not run twice.
        assert_eq!(algos("broadcast", bytes), ["ring", "doubling"]);
        assert_eq!(algos("all_gather", bytes), ["ring"]);
        // All-gather-v: the ring, and the pairs (doubling's choice; halving-doubling's is the
        // ring, not run twice).
        assert_eq!(algos("all_gather_v", bytes), ["ring", "pairwise"]);
    }
    assert!(r.rows.iter().all(|x| x.wrong == 0), "{:?}", r.rows);
    assert_eq!(r.rows.iter().filter(|x| x.op == "all_reduce").count(), 12);
    let text = bench::text(r);
    assert!(text.contains("  by halving-doubling\n"), "{text}");
    assert!(text.contains("  by ring\n"), "{text}");
    let fastest: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("# fastest: "))
        .collect();
    assert_eq!(
        fastest.len(),
        3,
        "all-reduce, broadcast and all-gather-v: {text}"
    );
    assert!(
        text.contains("# suggests: RINGZERO_DOUBLING_MAX=")
            && text.contains(" RINGZERO_HALVING_MAX=")
            && text.contains("# suggests: RINGZERO_PAIRWISE_MAX="),
        "{text}"
    );
}

/// Across nodes the all-to-all's model counts the busiest node's link, not one ring link: two
/// fake nodes of two thread ranks (tcp between them), so each node's link carries 2·2/4 = 1 of
/// the buffer, where a ring link carries 3/4. The all-gather, a ring, keeps its ring link.
#[test]
fn across_nodes_the_all_to_all_model_counts_the_busiest_nodes_link() {
    let o = Opts {
        transport: TransportPref::Auto,
        nodes: 2,
        ..Opts::default()
    };
    let reports = threads(4, &o, |_, comm| {
        let comm = comm.unwrap();
        assert_eq!(comm.ranks_per_node(), [2, 2]);
        let mut a = args(None, DType::F32, ReduceOp::Sum);
        a.ops = ["all-to-all", "all-gather"]
            .iter()
            .flat_map(|o| bench::parse_ops(o).unwrap())
            .collect();
        a.sweep.sizes = vec![1 << 16];
        a.sweep.model_per_row = false;
        bench::run(&comm, &a, &mut |_, _| {}).unwrap()
    });
    let r = &reports[0];
    let m = start_model(r);
    for row in &r.rows {
        assert_eq!(row.wrong, 0, "{row:?}");
        let op = bench::parse_ops(&row.op.replace('_', "-")).unwrap()[0];
        let link = if op == ringzero::Collective::AllToAll {
            row.bytes as f64
        } else {
            0.75 * row.bytes as f64
        };
        // Each rank's own block (a quarter) is a local copy at the header's memcpy rate.
        let local = if op == ringzero::Collective::AllToAll {
            0.25 * row.bytes as f64 * if row.inplace { 5.0 } else { 1.0 }
        } else if row.inplace {
            0.0
        } else {
            0.25 * row.bytes as f64
        };
        let copy = m.copy_gbs.expect("every edge measured a memcpy baseline");
        let want = 3.0 * m.alpha_us + link / (m.beta_gbs * 1e3) + local / (copy * 1e3);
        let got = row.predicted_us.unwrap();
        assert!((got - want).abs() < 1e-6 * want, "{row:?}: want {want}");
    }
}

/// The model measured once at the start of a run (the header's), as `--model start` uses it.
fn start_model(r: &Report) -> bench::theory::Model {
    bench::theory::Model {
        copy_gbs: Some(r.header.memcpy_gbs),
        ..bench::theory::Model::links(r.header.alpha_us, r.header.beta_gbs)
    }
}
