//! `ringzero bench --explain FILE`: another library's benchmark beside theory. It reads what
//! nccl-tests writes — its text table (`all_reduce_perf ... > out.txt`) or its `-J` JSON — and
//! prints each row with the α–β model's time for that collective, size and rank count over
//! links of the given α and β, and the efficiency (model / measured), as `ringzero bench` sets
//! its own rows against the model. So a user benchmarking NCCL sees the same side-by-side.
//!
//! The model is the ring's (what NCCL's ring algorithm runs; its tree and NVLS algorithms beat
//! it at some sizes, and the efficiency then exceeds 100 %). The collective comes from the
//! program's name (`all_reduce_perf`, `all_gather_perf`, ...), the rank count from the ranks
//! the output lists.

use ringzero_collectives::Collective;
use serde_json::Value;

use super::report::size_text;
use super::theory::{efficiency, predict_us, Algo, Model};

/// One measured way (out of place or in place) of a row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timing {
    /// Mean time per call, µs.
    pub time_us: f64,
    /// Algorithm bandwidth, GB/s.
    pub algbw_gbs: f64,
    /// Bus bandwidth, GB/s.
    pub busbw_gbs: f64,
}

/// One size of the other library's sweep.
#[derive(Clone, Debug, PartialEq)]
pub struct ForeignRow {
    /// Bytes, as nccl-tests counts them (the same convention as `ringzero bench`).
    pub bytes: usize,
    /// Elements.
    pub count: usize,
    /// Element type.
    pub dtype: String,
    /// Reduce operator (`none` for collectives that do not reduce).
    pub redop: String,
    /// Out of place, if measured.
    pub out: Option<Timing>,
    /// In place, if measured.
    pub inp: Option<Timing>,
}

/// A benchmark another library wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct Foreign {
    /// The program (`all_reduce_perf`).
    pub program: String,
    /// What it measured.
    pub collective: Collective,
    /// Ranks (GPUs) it ran on.
    pub ranks: usize,
    /// Its rows.
    pub rows: Vec<ForeignRow>,
}

/// The collective an nccl-tests program measures, by its name.
fn collective_of(program: &str) -> Option<Collective> {
    let name = program.rsplit('/').next().unwrap_or(program);
    let name = name.strip_suffix("_mpi").unwrap_or(name);
    Some(match name {
        "all_reduce_perf" => Collective::AllReduce,
        "all_gather_perf" => Collective::AllGather,
        "reduce_scatter_perf" => Collective::ReduceScatter,
        "broadcast_perf" => Collective::Broadcast { root: 0 },
        "reduce_perf" => Collective::Reduce { root: 0 },
        "alltoall_perf" => Collective::AllToAll,
        "gather_perf" => Collective::Gather { root: 0 },
        "scatter_perf" => Collective::Scatter { root: 0 },
        _ => return None,
    })
}

/// Read nccl-tests output: its `-J` JSON when the text is a JSON object, else its text table.
pub fn parse(text: &str) -> Result<Foreign, String> {
    let (program, ranks, rows) = if text.trim_start().starts_with('{') {
        parse_json(text)?
    } else {
        parse_text(text)?
    };
    let collective = collective_of(&program).ok_or_else(|| {
        format!(
            "`{program}` is not an nccl-tests collective this model covers (all_reduce_perf, \
             all_gather_perf, reduce_scatter_perf, broadcast_perf, reduce_perf, alltoall_perf, \
             gather_perf, scatter_perf)"
        )
    })?;
    if ranks < 2 {
        return Err(format!(
            "the output lists {ranks} rank{}: the model needs at least 2",
            if ranks == 1 { "" } else { "s" }
        ));
    }
    if rows.is_empty() {
        return Err("no result rows (size, count, type, redop, root, then times)".into());
    }
    Ok(Foreign {
        program,
        collective,
        ranks,
        rows,
    })
}

type Parsed = (String, usize, Vec<ForeignRow>);

fn parse_text(text: &str) -> Result<Parsed, String> {
    let mut program = None;
    let (mut ranks, mut rows) = (0, Vec::new());
    for line in text.lines() {
        let t = line.trim();
        if let Some(p) = t.strip_prefix("# Collective test starting:") {
            program = Some(p.trim().to_string());
        } else if t.starts_with("#  Rank") || t.starts_with("# Rank") {
            ranks += 1;
        } else if !t.starts_with('#') {
            if let Some(r) = text_row(t) {
                rows.push(r);
            }
        }
    }
    let program = program.ok_or(
        "no `# Collective test starting: PROGRAM` line: is this nccl-tests' output (2.13 or \
         newer)?",
    )?;
    Ok((program, ranks, rows))
}

/// `size count type redop root  time algbw busbw #wrong  time algbw busbw #wrong`.
fn text_row(t: &str) -> Option<ForeignRow> {
    let f: Vec<&str> = t.split_whitespace().collect();
    if f.len() < 9 {
        return None;
    }
    let bytes = f[0].parse().ok()?;
    let count = f[1].parse().ok()?;
    let timing = |k: usize| -> Option<Timing> {
        Some(Timing {
            time_us: f.get(k)?.parse().ok()?,
            algbw_gbs: f.get(k + 1)?.parse().ok()?,
            busbw_gbs: f.get(k + 2)?.parse().ok()?,
        })
    };
    Some(ForeignRow {
        bytes,
        count,
        dtype: f[2].to_string(),
        redop: f[3].to_string(),
        out: timing(5),
        inp: timing(9),
    })
}

fn parse_json(text: &str) -> Result<Parsed, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let program = v["args"]
        .get(0)
        .and_then(Value::as_str)
        .ok_or("no `args` (the command line nccl-tests ran)")?
        .to_string();
    let ranks = v["devices"].as_array().map_or(0, Vec::len);
    let timing = |t: &Value| -> Option<Timing> {
        let time = t.get("time").or_else(|| t.get("cpu_time"))?;
        Some(Timing {
            time_us: time.as_f64()?,
            algbw_gbs: t["alg_bw"].as_f64()?,
            busbw_gbs: t["bus_bw"].as_f64()?,
        })
    };
    let rows = v["results"]
        .as_array()
        .ok_or("no `results`")?
        .iter()
        .filter_map(|r| {
            Some(ForeignRow {
                bytes: r["size"].as_u64()? as usize,
                count: r["count"].as_u64()? as usize,
                dtype: r["type"].as_str()?.to_string(),
                redop: r["redop"].as_str()?.to_string(),
                out: timing(&r["out_of_place"]),
                inp: timing(&r["in_place"]),
            })
        })
        .collect();
    Ok((program, ranks, rows))
}

/// The rows beside the model over links of `m` (ring), as a table.
pub fn explain(f: &Foreign, m: Model, source: &str) -> String {
    let mut s = format!(
        "# {source}: {} ({}) on {} ranks, set against the ring's α–β model with α = {} us per \
         step, β = {} GB/s per link\n# pred(us) is the model's time, eff = pred / measured \
         (above 100 %: faster than the ring model, as NCCL's tree or NVLS algorithms can be)\n",
        f.program,
        f.collective.name(),
        f.ranks,
        m.alpha_us,
        m.beta_gbs
    );
    s += &format!(
        "# {:>10} {:>12} {:>6} {:>6} | {:>10} {:>8} {:>10} {:>6} | {:>10} {:>8} {:>10} {:>6}\n",
        "size",
        "count",
        "type",
        "redop",
        "time(us)",
        "busbw",
        "pred(us)",
        "eff",
        "time(us)",
        "busbw",
        "pred(us)",
        "eff"
    );
    let pred = |bytes: usize| predict_us(f.collective, Algo::Ring, f.ranks, bytes, m);
    for r in &f.rows {
        let p = pred(r.bytes);
        let way = |t: Option<Timing>| match t {
            Some(t) => {
                let eff = efficiency(p, t.time_us)
                    .map_or("-".to_string(), |e| format!("{:.0}%", e * 100.0));
                let pr = p.map_or("-".to_string(), |p| format!("{p:.1}"));
                format!(
                    "{:>10.1} {:>8.2} {:>10} {:>6}",
                    t.time_us, t.busbw_gbs, pr, eff
                )
            }
            None => format!("{:>10} {:>8} {:>10} {:>6}", "n/a", "", "", ""),
        };
        s += &format!(
            "  {:>10} {:>12} {:>6} {:>6} | {} | {}\n",
            size_text(r.bytes),
            r.count,
            r.dtype,
            r.redop,
            way(r.out),
            way(r.inp)
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// nccl-tests 2.x's text output, as `all_reduce_perf -b 8 -e 128M -f 2 -g 2` prints it
    /// (rows trimmed; the layout is its own).
    const TEXT: &str = "\
# nccl-tests version 2.17.1 nccl-headers=22703 nccl-library=22703
# Collective test starting: all_reduce_perf
# nThread 1 nGpus 2 minBytes 1048576 maxBytes 134217728 step: 8(factor) warmup iters: 1 iters: 20 agg iters: 1 validation: 1 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid  12345 on     node1 device  0 [0000:18:00] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid  12345 on     node1 device  1 [0000:2a:00] NVIDIA H100 80GB HBM3
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
     1048576        262144     float     sum      -1    20.50   51.15   51.15      0    20.10   52.17   52.17      0
   134217728      33554432     float     sum      -1    400.0  335.54  335.54      0    398.0  337.23  337.23      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 194.02
";

    #[test]
    fn nccl_tests_text_is_read_and_set_against_the_model() {
        let f = parse(TEXT).unwrap();
        assert_eq!(
            (f.program.as_str(), f.collective, f.ranks, f.rows.len()),
            ("all_reduce_perf", Collective::AllReduce, 2, 2)
        );
        assert_eq!(f.rows[1].bytes, 134217728);
        assert_eq!(f.rows[1].inp.unwrap().busbw_gbs, 337.23);
        // β 400 GB/s, α 5 us: a 128 MiB all-reduce on 2 ranks moves 2·(1/2)·S per link in 2
        // steps: 2·5 + 134217728 / 400e3 = 345.5 us, so 86 % of the measured 400 us.
        let out = explain(&f, Model::links(5.0, 400.0), "h100.txt");
        assert!(
            out.contains("all_reduce_perf (all_reduce) on 2 ranks"),
            "{out}"
        );
        let row = out.lines().find(|l| l.contains("128 MiB")).unwrap();
        assert!(row.contains("345.5") && row.contains("86%"), "{row}");
    }

    #[test]
    fn nccl_tests_json_is_read_and_bad_files_are_named() {
        let json = r#"{"version": 1, "args": ["./build/all_gather_perf", "-b", "1M"],
            "devices": [{"rank": 0}, {"rank": 1}, {"rank": 2}, {"rank": 3}],
            "results": [{"size": 4194304, "count": 262144, "type": "float", "redop": "none",
                "root": "    -1", "out_of_place": {"time": 50.0, "alg_bw": 83.9, "bus_bw": 62.9,
                "nwrong": 0}, "in_place": {"time": 48.0, "alg_bw": 87.4, "bus_bw": 65.5,
                "nwrong": 0}}]}"#;
        let f = parse(json).unwrap();
        assert_eq!((f.collective, f.ranks), (Collective::AllGather, 4));
        assert_eq!(f.rows[0].out.unwrap().time_us, 50.0);
        for (text, want) in [
            ("hello", "Collective test starting"),
            (
                &TEXT.replace("all_reduce_perf", "hypercube_perf")[..],
                "not an nccl-tests collective",
            ),
            (
                &TEXT.replace("#  Rank  1", "# xx")[..],
                "1 rank: the model needs at least 2",
            ),
        ] {
            let e = parse(text).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
    }
}
