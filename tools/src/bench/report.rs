//! What `ringzero bench` prints and writes: an nccl-tests-style table with the α–β prediction and
//! efficiency next to every line, and the same data as JSON.

use serde::{Deserialize, Serialize};

use super::probe::EdgeBeta;
use super::sweep::Row;

/// The header of a report.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Header {
    /// ringzero version.
    pub version: String,
    /// Host name.
    pub host: String,
    /// Number of ranks.
    pub ranks: usize,
    /// Why that many, when the user did not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks_note: Option<String>,
    /// Element type.
    pub dtype: String,
    /// Reduce operator.
    pub redop: String,
    /// Device of the buffers.
    pub device: String,
    /// Latency per ring step, µs.
    pub alpha_us: f64,
    /// Bandwidth of the slowest link, GB/s (the model's β).
    pub beta_gbs: f64,
    /// Every ring edge: transport, reason, measured β.
    pub edges: Vec<EdgeOut>,
    /// The device communicator's edges (device buffers only): transport and why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_edges: Vec<DeviceEdgeOut>,
    /// memcpy of the β probe's bytes in slice-sized copies on every rank at once, paired with the
    /// streams, GB/s per rank.
    pub memcpy_gbs: f64,
    /// A plain loopback TCP stream pair, GB/s per direction (when an edge uses TCP).
    pub tcp_stream_gbs: Option<f64>,
    /// A copy out of the previous rank's memory in slice-sized pieces on every rank at once,
    /// paired with the streams like `memcpy_gbs`, GB/s per rank (when every edge is shm): what a
    /// single-copy design (CMA, registered buffers) would do per byte.
    #[serde(default)]
    pub shared_copy_gbs: Option<f64>,
    /// Slice size, bytes.
    pub slice_bytes: usize,
    /// Bytes each rank streamed to measure the header's β (and its baselines): a size the
    /// caches do not hold, so the header's β is the links' rate out of memory; the rows'
    /// own β (`--model row`) is measured at each row's size.
    #[serde(default)]
    pub probe_bytes: usize,
    /// Timed iterations per size.
    pub iters: usize,
    /// Warm-up iterations per size.
    pub warmup: usize,
    /// How `time_us` is defined.
    pub time: String,
    /// Which model each row's prediction uses.
    #[serde(default)]
    pub model: String,
    /// How the device ring is set up (device buffers only): slice bytes, slots, the copy pair,
    /// host staging's mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_ring: Option<String>,
    /// The device's copy rates measured at the start by rank 0 alone (device buffers only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_baseline: Option<super::device::Baseline>,
    /// What bounds the device rows (see [`super::theory::device_bound_gbs`]): each row's
    /// `predicted_us` is the time at its bound, `efficiency` predicted / measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_bound: Option<DeviceBound>,
}

/// The limit device rows are set against.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct DeviceBound {
    /// For ranks sharing one device with no tcp edge, `memory` (the one device's memory, at the
    /// baseline's copy rate) or `staging` (the one host link, each direction's rate while both
    /// run); otherwise `links` (the device ring's slowest edge while every rank sends to the next
    /// at once: here out of place on the baseline's bytes; each row carries its own size's, in
    /// its `beta_gbs`).
    pub limit: String,
    /// That rate, GB/s.
    pub gbs: f64,
    /// The all-reduce's busbw bound it gives, GB/s.
    pub all_reduce_busbw_gbs: f64,
}

/// A device communicator's edge in the header.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct DeviceEdgeOut {
    /// Sending rank.
    pub from: usize,
    /// Receiving rank.
    pub to: usize,
    /// Transport (`cuda_ipc`, `shm` staging, `tcp` with pinned staging).
    pub transport: String,
    /// Why.
    pub reason: String,
    /// TCP connections carrying the edge (0: not tcp).
    #[serde(default)]
    pub sockets: usize,
}

/// An edge in the header.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct EdgeOut {
    /// Sending rank.
    pub from: usize,
    /// Receiving rank.
    pub to: usize,
    /// Transport.
    pub transport: String,
    /// Why.
    pub reason: String,
    /// TCP connections carrying the edge (0: not tcp).
    #[serde(default)]
    pub sockets: usize,
    /// Measured bandwidth, GB/s.
    pub beta_gbs: f64,
}

impl From<&EdgeBeta> for EdgeOut {
    fn from(e: &EdgeBeta) -> EdgeOut {
        EdgeOut {
            from: e.from,
            to: e.to,
            transport: e.transport.clone(),
            reason: e.reason.clone(),
            sockets: e.sockets,
            beta_gbs: e.beta_gbs,
        }
    }
}

/// A whole report: the JSON document `--json` writes.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Report {
    /// Header.
    pub header: Header,
    /// One object per (op, size, in place or not).
    pub rows: Vec<Row>,
}

/// " over 4 connections" for a tcp edge of several.
fn connections(sockets: usize) -> String {
    match sockets {
        0 | 1 => String::new(),
        k => format!(" over {k} connections"),
    }
}

/// Header lines of the table.
pub fn header_text(h: &Header) -> String {
    let note = h
        .ranks_note
        .as_ref()
        .map_or(String::new(), |n| format!(" ({n})"));
    let mut s = format!(
        "# ringzero bench {} on {}: {} ranks{note}, {} {}, {} buffers\n",
        h.version, h.host, h.ranks, h.dtype, h.redop, h.device
    );
    for e in &h.edges {
        s += &format!(
            "#   edge rank {} → rank {}: {}{} ({}), β {:.2} GB/s\n",
            e.from,
            e.to,
            e.transport,
            connections(e.sockets),
            e.reason,
            e.beta_gbs
        );
    }
    for e in &h.device_edges {
        s += &format!(
            "#   device edge rank {} → rank {}: {}{} ({})\n",
            e.from,
            e.to,
            e.transport,
            connections(e.sockets),
            e.reason
        );
    }
    if let Some(r) = &h.device_ring {
        s += &format!("# device ring: {r}\n");
    }
    if let Some(b) = &h.device_baseline {
        s += &format!(
            "# device baseline (rank 0 alone, {} B, the fastest of 3 timings): copy {:.1} GB/s (read + \
             written){}\n",
            b.bytes,
            b.copy_gbs,
            match (b.pinned_gbs, b.both_ways_gbs) {
                (Some(p), Some(w)) => format!(
                    "; pinned host→device {p:.1} GB/s alone, {w:.1} GB/s each way with both \
                     directions at once{}",
                    b.kernel_both_ways_gbs
                        .map(|k| format!(
                            " ({k:.1} by one kernel on the mapped memory, as mapped staging moves)"
                        ))
                        .unwrap_or_default()
                ),
                _ => String::new(),
            }
        );
    }
    match &h.device_bound {
        Some(b) => {
            let family = if b.limit == "links" {
                format!(
                    "the ring's links (β: the slowest edge's rate while every rank shifts what \
                     one link carries in a row's call, busbw's factor × its bytes, to the next \
                     through the device ring at once, in place or not as the row, timed as the \
                     rows: its β column; {:.1} GB/s at {} B): busbw ≤ β for every ring \
                     collective where links do not share what carries them (NVLink); where \
                     they do (host memory, one PCIe switch) a broadcast or reduce, which \
                     leaves one link idle, can pass it: eff over 100 % says so. Rows the \
                     direct step runs carry none",
                    b.gbs,
                    h.device_baseline.map_or(0, |x| x.bytes)
                )
            } else if b.limit == "staging" {
                format!(
                    "the {} ranks share one host link ({:.1} GB/s each way with both at once = w): \
                     busbw ≤ w/n (all_reduce, reduce_scatter, all_gather), w/(n−1) (broadcast, \
                     reduce)",
                    h.ranks, b.gbs
                )
            } else {
                format!(
                    "the {} ranks share one device's memory (copy {:.1} GB/s): busbw ≤ \
                     factor·copy/T, T the bytes reading every input and writing every output once \
                     move, in sizes (all_reduce 2n; reduce_scatter, reduce n+1; all_gather, \
                     broadcast n+1, n in place)",
                    h.ranks, b.gbs
                )
            };
            s += &format!(
                "# device bound: {family}; all_reduce {:.1} GB/s. pred(us) is the time at a \
                 row's bound, eff = pred / measured (the model below is the host links')\n",
                b.all_reduce_busbw_gbs
            );
        }
        None if !h.device_edges.is_empty() => {
            s += "# device buffers: the model below is the host links'; rows carry no prediction\n";
        }
        None => {}
    }
    s += &format!(
        "# model: α = {:.2} us per step, β = {:.2} GB/s per link (slowest edge, streams of {}); baselines: \
         memcpy in {} B slices on every rank at once {:.2} GB/s (β/memcpy {:.0}%){}\n",
        h.alpha_us,
        h.beta_gbs,
        size_text(h.probe_bytes),
        h.slice_bytes,
        h.memcpy_gbs,
        if h.memcpy_gbs > 0.0 { h.beta_gbs / h.memcpy_gbs * 100.0 } else { 0.0 },
        h.tcp_stream_gbs.map(|t| format!(", a loopback TCP stream pair {t:.2} GB/s per direction (β/that {:.0}%)", h.beta_gbs / t * 100.0)).unwrap_or_default()
    );
    if let Some(x) = h.shared_copy_gbs.filter(|x| *x > 0.0) {
        s += &format!(
            "#   and one copy straight out of the previous rank's memory (/dev/shm), what a single-copy \
             design (CMA, registered buffers) would do per byte: {x:.2} GB/s (β/that {:.0}%)\n",
            h.beta_gbs / x * 100.0
        );
    }
    if !h.model.is_empty() {
        s += &format!("# lines: {}\n", h.model);
    }
    s += &format!(
        "# time: {}; {} warm-up and {} timed iterations per size\n",
        h.time, h.warmup, h.iters
    );
    s += &format!(
        "#{:>11} {:>10} {:>5} {:>5} | {:>10} {:>7} {:>7} {:>6} {:>6} {:>9} {:>5} | {:>10} {:>7} {:>7} {:>6} {:>6} {:>9} {:>5}\n",
        "size(B)", "count", "type", "redop", "time(us)", "algbw", "busbw", "#wrong", "β", "pred(us)", "eff",
        "time(us)", "algbw", "busbw", "#wrong", "β", "pred(us)", "eff"
    );
    s += &format!(
        "#{:>35} | {:^61} | {:^61}\n",
        "", "out-of-place", "in-place"
    );
    s
}

/// One table line from the out-of-place and in-place rows of a size.
pub fn line(out: &Row, inp: &Row) -> String {
    line_of(Some(out), Some(inp))
}

/// A line where a variant may be missing (a row set read back that lacks one): `n/a` there.
fn line_of(out: Option<&Row>, inp: Option<&Row>) -> String {
    let half = |r: Option<&Row>| match r {
        Some(r) => format!(
            "{:>10.1} {:>7.3} {:>7.3} {:>6} {:>6} {:>9} {:>5}",
            r.time_us,
            r.algbw_gbs,
            r.busbw_gbs,
            r.wrong,
            r.beta_gbs.map_or("-".into(), |b| format!("{b:.2}")),
            r.predicted_us.map_or("-".into(), |p| format!("{p:.1}")),
            r.efficiency
                .map_or("-".into(), |e| format!("{:.0}%", e * 100.0)),
        ),
        None => format!(
            "{:>10} {:>7} {:>7} {:>6} {:>6} {:>9} {:>5}",
            "n/a", "", "", "", "", "", ""
        ),
    };
    let any = out.or(inp).expect("one of the two");
    format!(
        "{:>12} {:>10} {:>5} {:>5} | {} | {}",
        any.bytes,
        any.count,
        any.dtype,
        any.redop,
        half(out),
        half(inp)
    )
}

/// The table of one op's rows: per size (and per algorithm, when `--algos` set several side by
/// side), the out-of-place and the in-place row (either may be missing); then, with several
/// algorithms, the fastest at each size.
pub fn table(op: &str, rows: &[Row]) -> String {
    let mut s = format!("# {op}\n");
    let mut algos: Vec<&str> = rows.iter().map(|r| r.algo.as_str()).collect();
    algos.sort_unstable();
    algos.dedup();
    // Side by side: some size ran by more than one algorithm (`auto` alone picks one per size).
    let compared = rows
        .iter()
        .any(|r| rows.iter().any(|q| q.bytes == r.bytes && q.algo != r.algo));
    let mut i = 0;
    while i < rows.len() {
        let (bytes, algo) = (rows[i].bytes, &rows[i].algo);
        let n = rows[i..]
            .iter()
            .take_while(|r| r.bytes == bytes && r.algo == *algo)
            .count();
        let group = &rows[i..i + n];
        s += &line_of(
            group.iter().find(|r| !r.inplace),
            group.iter().find(|r| r.inplace),
        );
        if compared || (!algo.is_empty() && algo != "ring") {
            s += "  by ";
            s += algo;
        }
        s.push('\n');
        i += n;
    }
    if compared {
        s += &fastest(op, rows, &algos);
    }
    s
}

/// The fastest algorithm at each size (out of place, where there is such a row), and for the
/// all-reduce and the all-gather-v the `auto` thresholds they suggest.
fn fastest(op: &str, rows: &[Row], algos: &[&str]) -> String {
    let mut sizes: Vec<usize> = rows.iter().map(|r| r.bytes).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let winners: Vec<(usize, &str)> = sizes
        .iter()
        .filter_map(|&b| {
            let at: Vec<&Row> = rows.iter().filter(|r| r.bytes == b).collect();
            let out = at.iter().any(|r| !r.inplace);
            at.into_iter()
                .filter(|r| r.inplace != out)
                .min_by(|x, y| x.time_us.total_cmp(&y.time_us))
                .map(|r| (b, r.algo.as_str()))
        })
        .collect();
    let list: Vec<String> = winners.iter().map(|(b, a)| format!("{b} {a}")).collect();
    let mut s = format!("# fastest: {}\n", list.join(", "));
    if op == "all_reduce" && algos.contains(&"doubling") {
        let (dmax, hmax) = thresholds(&winners);
        s += &format!("# suggests: RINGZERO_DOUBLING_MAX={dmax}");
        if algos.contains(&"halving-doubling") {
            s += &format!(" RINGZERO_HALVING_MAX={hmax}");
        }
        s += " (the smallest sizes' run of doubling wins, then of halving-doubling wins; \
              measured here, on these ranks)\n";
    }
    if op == "all_gather_v" && algos.contains(&"pairwise") && algos.contains(&"ring") {
        let pmax = leading_run(&winners, "pairwise");
        s += &format!(
            "# suggests: RINGZERO_PAIRWISE_MAX={pmax} (the smallest sizes' run of pairwise wins; \
             measured here, on these ranks)\n"
        );
    }
    s
}

/// The last size of the leading run of `algo`'s wins (0 when the first size went to another).
fn leading_run(winners: &[(usize, &str)], algo: &str) -> usize {
    winners
        .iter()
        .take_while(|(_, a)| *a == algo)
        .last()
        .map_or(0, |(b, _)| *b)
}

/// `auto`'s thresholds from the fastest algorithm per size (ascending): doubling up to the last
/// size of the leading run of `doubling` wins, halving-doubling up to the last of the run of
/// `halving-doubling` wins after it (the doubling threshold when there is none).
pub fn thresholds(winners: &[(usize, &str)]) -> (usize, usize) {
    let mut it = winners.iter().peekable();
    let mut dmax = 0;
    while let Some((b, _)) = it.next_if(|(_, a)| *a == "doubling") {
        dmax = *b;
    }
    let mut hmax = dmax;
    while let Some((b, _)) = it.next_if(|(_, a)| *a == "halving-doubling") {
        hmax = *b;
    }
    (dmax, hmax)
}

/// Summary after the tables: the exactness count, the mean bus bandwidth (as nccl-tests ends),
/// then one line per collective.
pub fn summary(rows: &[Row]) -> String {
    let wrong: u64 = rows.iter().map(|r| r.wrong).sum();
    let n = rows.len().max(1) as f64;
    let avg_bus = rows.iter().map(|r| r.busbw_gbs).sum::<f64>() / n;
    let mut s = format!(
        "# out of bounds values : {wrong} {}\n# avg bus bandwidth    : {avg_bus:.3} GB/s\n",
        if wrong == 0 { "OK" } else { "FAILED" }
    );
    s += &per_collective(rows);
    s
}

/// Above this spread of a row's β streams between groups ([`Row::stream_swing`]), the summary
/// says an efficiency outside 80–120 % may be the machine's noise rather than the model's miss.
const NOISY: f64 = 1.5;

/// The collectives that combine what they receive with their own input: out of place they read
/// that input beside each received slice and store the sum into fresh lines, more memory traffic
/// per link byte than the link streams make (`docs/bench.md` says why the streams do not read
/// it too).
const REDUCTIONS: [&str; 3] = ["reduce", "reduce_scatter", "reduce_scatter_v"];

/// Per collective (its out-of-place rows; in place where it has no other): the peak bus
/// bandwidth and the size reaching it, the smallest size reaching half of it (the size a
/// message must have to use the links), and how the α–β model fits from 1 MiB up (the rows'
/// efficiencies, predicted / measured: 100 % is a perfect prediction).
pub fn per_collective(rows: &[Row]) -> String {
    let mut ops: Vec<&str> = Vec::new();
    for r in rows {
        if !ops.contains(&r.op.as_str()) {
            ops.push(&r.op);
        }
    }
    let mut s = String::new();
    for op in ops {
        let of: Vec<&Row> = rows.iter().filter(|r| r.op == op).collect();
        let mut mine: Vec<&Row> = of.iter().copied().filter(|r| !r.inplace).collect();
        if mine.is_empty() {
            mine = of;
        }
        mine.sort_by_key(|r| r.bytes);
        let Some(peak) = mine
            .iter()
            .max_by(|a, b| a.busbw_gbs.total_cmp(&b.busbw_gbs))
        else {
            continue;
        };
        let half = mine
            .iter()
            .find(|r| r.busbw_gbs >= peak.busbw_gbs / 2.0)
            .map_or(0, |r| r.bytes);
        let eff: Vec<f64> = mine
            .iter()
            .filter(|r| r.bytes >= 1 << 20)
            .filter_map(|r| r.efficiency)
            .collect();
        let widest = |of: fn(&Row) -> Option<f64>| {
            mine.iter()
                .filter(|r| r.bytes >= 1 << 20 && r.efficiency.is_some())
                .filter_map(|r| of(r))
                .fold(1.0, f64::max)
        };
        let (swing, call_swing) = (widest(|r| r.stream_swing), widest(|r| r.call_swing));
        let fit = if eff.is_empty() {
            "no model rows from 1 MiB".to_string()
        } else {
            let lo = eff.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = eff.iter().copied().fold(0.0, f64::max);
            let within = lo >= 0.8 && hi <= 1.2;
            format!(
                "model efficiency from 1 MiB {:.0}–{:.0} % ({}{})",
                lo * 100.0,
                hi * 100.0,
                if within {
                    "within 80–120 %"
                } else {
                    "outside 80–120 %"
                },
                match (!within, swing > NOISY, call_swing > NOISY) {
                    (true, false, false) if lo < 0.8 && REDUCTIONS.contains(&op) => {
                        "; out of place it reads its input beside each slice it receives, \
                         which the model's streams do not"
                            .to_string()
                    }
                    (true, true, _) => format!(
                        "; β swung {swing:.1}× between its rows' groups: the machine is noisy"
                    ),
                    (true, false, true) => format!(
                        "; its calls' own times swung {call_swing:.1}× between a row's groups: \
                         the machine is noisy"
                    ),
                    _ => String::new(),
                }
            )
        };
        s += &format!(
            "# {op:<16} peak {:.3} GB/s at {}; half of it from {}; {fit}\n",
            peak.busbw_gbs,
            size_text(peak.bytes),
            size_text(half)
        );
    }
    s
}

/// A size as a person reads it: `4 KiB`, `64 MiB`, `1 GiB`, or bytes when it is none of them.
pub fn size_text(b: usize) -> String {
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::{per_collective, size_text, thresholds, Row};

    fn row(bytes: usize, busbw: f64, eff: f64, inplace: bool) -> Row {
        Row {
            op: "all_gather".into(),
            bytes,
            count: bytes / 4,
            dtype: "f32".into(),
            redop: "-".into(),
            ranks: 2,
            transport: "shm".into(),
            time_us: 1.0,
            algbw_gbs: busbw,
            busbw_gbs: busbw,
            wrong: 0,
            inplace,
            alpha_us: None,
            beta_gbs: None,
            copy_gbs: None,
            stream_swing: None,
            call_swing: None,
            predicted_us: Some(eff),
            efficiency: Some(eff),
            algo: "ring".into(),
        }
    }

    #[test]
    fn the_summary_gives_each_collectives_peak_half_point_and_model_fit() {
        let rows = [
            row(4 << 10, 1.0, 0.5, false),
            row(256 << 10, 5.0, 0.7, false),
            row(1 << 20, 9.0, 0.9, false),
            row(4 << 20, 8.0, 1.1, false),
            row(4 << 20, 20.0, 3.0, true),
        ];
        assert_eq!(
            per_collective(&rows),
            "# all_gather       peak 9.000 GB/s at 1 MiB; half of it from 256 KiB; model \
             efficiency from 1 MiB 90–110 % (within 80–120 %)\n"
        );
        // Outside the band: a row whose streams swung more than NOISY says so.
        let mut noisy = rows.clone();
        noisy[3].efficiency = Some(1.5);
        assert!(per_collective(&noisy).ends_with("90–150 % (outside 80–120 %)\n"));
        noisy[2].call_swing = Some(1.7);
        assert!(
            per_collective(&noisy).contains(
                "(outside 80–120 %; its calls' own times swung 1.7× between a row's groups: the \
                 machine is noisy)"
            ),
            "{}",
            per_collective(&noisy)
        );
        // A reduction below the band on steady streams names what the model leaves out.
        let mut reduction = rows.clone();
        for r in &mut reduction {
            r.op = "reduce_scatter".into();
        }
        reduction[3].efficiency = Some(0.7);
        assert!(per_collective(&reduction)
            .contains("70–90 % (outside 80–120 %; out of place it reads its input beside"));
        reduction[3].efficiency = Some(1.3);
        assert!(per_collective(&reduction).ends_with("90–130 % (outside 80–120 %)\n"));
        noisy[2].stream_swing = Some(1.9);
        assert!(
            per_collective(&noisy).contains(
                "(outside 80–120 %; β swung 1.9× between its rows' groups: the machine is noisy)"
            ),
            "{}",
            per_collective(&noisy)
        );
        assert_eq!(
            [
                size_text(4096),
                size_text(1 << 30),
                size_text(3 << 20),
                size_text(1000)
            ],
            ["4 KiB", "1 GiB", "3 MiB", "1000 B"]
        );
    }

    #[test]
    fn thresholds_follow_the_leading_runs_of_winners() {
        let w = |v: &[(usize, &'static str)]| thresholds(v);
        let (d, h, r) = ("doubling", "halving-doubling", "ring");
        assert_eq!(w(&[(4, d), (8, d), (16, h), (32, h), (64, r)]), (8, 32));
        // No halving-doubling win: its threshold is the doubling one (never used).
        assert_eq!(w(&[(4, d), (8, r), (16, h)]), (4, 4));
        // The ring wins from the start: neither.
        assert_eq!(w(&[(4, r), (8, d)]), (0, 0));
        // Halving-doubling wins from the start.
        assert_eq!(w(&[(4, h), (8, h), (16, d)]), (0, 8));
        assert_eq!(w(&[]), (0, 0));
        let p = "pairwise";
        assert_eq!(
            super::leading_run(&[(4, p), (8, p), (16, r), (32, p)], p),
            8
        );
        assert_eq!(super::leading_run(&[(4, r), (8, p)], p), 0);
    }
}
