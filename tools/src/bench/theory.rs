//! The arithmetic of the benchmark, pure and unit-tested: nccl-tests' algbw/busbw and the ring's
//! α–β model.
//!
//! - algbw = S / t, in GB/s (10⁹ bytes per second), S the total buffer bytes;
//! - busbw = algbw · factor, factor 2(n−1)/n for all-reduce, (n−1)/n for reduce-scatter and
//!   all-gather, 1 for broadcast and reduce (nccl-tests' definitions, so the numbers compare);
//! - predicted time t = steps · α + bytes per link / β, with steps 2(n−1) and bytes per link
//!   2(n−1)/n · S for all-reduce, n−1 and (n−1)/n · S for reduce-scatter and all-gather, n−1 and S
//!   for broadcast and reduce (a pipelined chain);
//! - a collective by a doubling schedule (see `ringzero::Algo`: recursive doubling or
//!   halving-doubling for all-reduce, binomial trees for broadcast and reduce) takes its
//!   schedule's rounds as steps (⌈log2 n⌉; the all-reduce log2 n by recursive doubling, 2 log2 n
//!   by halving-doubling, two more when n is not a power of two) and its busiest rank's volume
//!   as bytes per link: rounds · S for the whole-buffer schedules, 2(p−1)/p · S for
//!   halving-doubling (p the largest power of two ≤ n; 2 S more for the fold);
//! - the single-copy all-gather takes 2 steps (its two waits on the node board) and each rank's
//!   one copy of (n−1)/n · S out of the other ranks' memory, at the rate of one copy between
//!   processes (β measured by such a copy, not by the slots);
//! - a rank's own copies (an out-of-place all-gather's own part, a root's own block, an
//!   out-of-place broadcast's input into its output, a chain's relay writing a received slice
//!   into its output beside the next rank's slot) run on the same core as its link copies, one
//!   after the other: the busiest rank's bytes of them ([`local_copy_bytes`]) add their time at
//!   the rate of a plain copy on that rank (`Model::copy_gbs`, measured with the row; from a
//!   source in cache where the copy re-reads a slice the link copy has just read,
//!   [`local_copy_rereads`]);
//! - efficiency = predicted / measured time (1.0: the implementation runs at the model's limit).

use ringzero_collectives::internals::ring::doubling;
use ringzero_collectives::{Collective, Schedule};

/// How a collective moves: round the ring, by a doubling schedule (an all-reduce, broadcast or
/// reduce that `ringzero::Algo` picks it for), or pairwise (every message straight to its
/// rank in one step: all-to-all-v, gather, scatter, and a small all-gather-v).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algo {
    /// The ring's schedule.
    Ring,
    /// A doubling schedule ([`doubling`]).
    By(Schedule),
    /// The pairwise exchange, one step.
    Pairwise,
    /// The single-copy all-gather: every rank reads the others' parts straight out of their
    /// memory (`RINGZERO_SINGLE_COPY_FROM`), two steps on the node board around one copy.
    SingleCopy,
}

impl Algo {
    /// The name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Algo::Ring => "ring",
            Algo::By(Schedule::Doubling) => "doubling",
            Algo::By(Schedule::HalvingDoubling) => "halving-doubling",
            Algo::Pairwise => "pairwise",
            Algo::SingleCopy => "single-copy",
        }
    }
}

/// How `op` of `bytes` on `n` ranks over `nodes` nodes (`shm`: whether the ring's edges are
/// all shared memory) runs on host buffers when the
/// communicator's algorithm choice is `choice` and its all-gathers of `single_copy` bytes read
/// directly ([`Communicator::single_copy_sizes`](ringzero_collectives::Communicator::single_copy_sizes)).
pub fn runs(
    (choice, single_copy): (ringzero_collectives::Algo, Option<std::ops::Range<usize>>),
    op: Collective,
    bytes: usize,
    (n, nodes, shm): (usize, usize, bool),
) -> Algo {
    match op {
        Collective::AllGather if single_copy.is_some_and(|s| s.contains(&bytes)) => {
            Algo::SingleCopy
        }
        Collective::AllGatherV if choice.gathers_v_pairwise(bytes, n, nodes) => Algo::Pairwise,
        op if op.is_pairwise() => Algo::Pairwise,
        _ => choice
            .schedule(op, bytes, n, shm)
            .map_or(Algo::Ring, Algo::By),
    }
}

/// The α–β model of the links in use.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Model {
    /// Latency of one ring step, µs.
    pub alpha_us: f64,
    /// Bandwidth of one link, GB/s (10⁹ bytes per second).
    pub beta_gbs: f64,
    /// The rate of a rank's copy within its own memory, GB/s, for the copies a collective makes
    /// beside its links ([`local_copy_bytes`]); `None` leaves them out of the prediction.
    pub copy_gbs: Option<f64>,
    /// Whether a ring relay copies a frame it forwards into its output itself ([`relays_copy`]).
    pub relays_copy: bool,
}

/// Whether a ring relay copies what it forwards into its output itself, on a ring whose edges
/// are `transport` (`shm`, `tcp`, `shm+tcp`): over slot links it does, from the slot; where
/// every edge is tcp the socket reads the frame straight into the output and writes it on from
/// there, no copy of the rank's own.
pub fn relays_copy(transport: &str) -> bool {
    transport != "tcp"
}

impl Model {
    /// α and β alone: the links' model, a collective's local copies not counted.
    pub fn links(alpha_us: f64, beta_gbs: f64) -> Model {
        Model {
            alpha_us,
            beta_gbs,
            copy_gbs: None,
            relays_copy: true,
        }
    }
}

/// nccl-tests' bus-bandwidth factor.
pub fn busbw_factor(op: Collective, n: usize) -> f64 {
    let n = n as f64;
    match op {
        Collective::AllReduce => 2.0 * (n - 1.0) / n,
        Collective::ReduceScatter
        | Collective::ReduceScatterV
        | Collective::AllGather
        | Collective::AllGatherV
        | Collective::AllToAll => (n - 1.0) / n,
        op if op.is_pairwise() => (n - 1.0) / n,
        _ => 1.0,
    }
}

/// What bounds device collectives (`ringzero bench --device`): for ranks sharing one device,
/// that device's memory or its one host link; otherwise the ring's own links.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DeviceLimit {
    /// The one device's memory, copying at this many GB/s (read + written).
    Memory(f64),
    /// Host staging: the one host link, each direction at this many GB/s while both run.
    Staged(f64),
    /// The ring's links, the slowest edge moving this many GB/s while every rank sends to the
    /// next at once (one device per rank, or tcp edges).
    Links(f64),
}

/// The bus bandwidth `op` (`inplace` or not) can reach on `n` ranks under `limit`, or `None`
/// for collectives it does not cover.
///
/// - `Memory(copy)`: every input byte is read and every output byte written at least once, all
///   through the one memory, so t ≥ T·S/copy with T (in units of the size S): all-reduce 2n;
///   reduce-scatter and reduce n + 1 (n inputs read, S written); all-gather and broadcast n + 1
///   out of place (S read, n outputs written), n in place (a rank's own part is already there);
///   all-to-all 2n out of place (n inputs read, n outputs written), 2(n − 1) in place (a rank's
///   own block may stay where it is; ringzero's in-place form copies it all first, which this
///   bound does not excuse); send-recv 2n (each rank reads its message and writes its
///   partner's); gather and scatter 2 (every block read and written once, S the root's buffer).
/// - `Staged(w)`: every byte a rank sends leaves its device through the one link and comes back
///   through it: all-reduce, reduce-scatter and all-gather send busbw·t per rank with every rank
///   sending, so busbw ≤ w/n (all-to-all too: (n−1)/n·S leaves each rank and comes back, and
///   send-recv: S); gather and scatter move (n−1)/n·S one way through it, busbw ≤ w; a
///   broadcast or reduce moves S through each of n − 1 ranks, so busbw ≤ w/(n − 1).
/// - `Links(β)`: a ring collective moves busbw·t bytes over every link (that is how busbw is
///   defined: all-reduce 2(n−1)/n·S, reduce-scatter and all-gather (n−1)/n·S, a pipelined
///   broadcast or reduce S), so busbw ≤ β for each. An all-to-all's blocks each go their
///   distance round a one-way ring, (n−1)/2·S over every link: busbw = (n−1)/n·S/t ≤ 2β/n.
///   Send-recv goes over each pair's own links, not the ring's: no bound.
pub fn device_bound_gbs(
    op: Collective,
    n: usize,
    inplace: bool,
    limit: DeviceLimit,
) -> Option<f64> {
    if n < 2 {
        return None;
    }
    let nf = n as f64;
    match limit {
        DeviceLimit::Memory(copy) => {
            let traffic = match op {
                Collective::AllReduce => 2.0 * nf,
                Collective::ReduceScatter
                | Collective::ReduceScatterV
                | Collective::Reduce { .. } => nf + 1.0,
                Collective::AllGather | Collective::AllGatherV | Collective::Broadcast { .. } => {
                    if inplace {
                        nf
                    } else {
                        nf + 1.0
                    }
                }
                Collective::AllToAll if inplace => 2.0 * (nf - 1.0),
                // Every rank reads its message and writes its partner's.
                Collective::AllToAll | Collective::AllToAllV | Collective::SendRecv => 2.0 * nf,
                // Every block read once and written once: the root's whole buffer twice.
                Collective::Gather { .. } | Collective::Scatter { .. } => 2.0,
                _ => return None,
            };
            Some(busbw_factor(op, n) * copy / traffic)
        }
        DeviceLimit::Staged(w) => match op {
            Collective::AllReduce
            | Collective::ReduceScatter
            | Collective::ReduceScatterV
            | Collective::AllGather
            | Collective::AllGatherV
            | Collective::AllToAll
            | Collective::AllToAllV
            | Collective::SendRecv => Some(w / nf),
            // (n−1)/n·S crosses the link one way (into the root's device, or out of it).
            Collective::Gather { .. } | Collective::Scatter { .. } => Some(w),
            Collective::Broadcast { .. } | Collective::Reduce { .. } => Some(w / (nf - 1.0)),
            _ => None,
        },
        DeviceLimit::Links(beta) => match op {
            Collective::AllReduce
            | Collective::ReduceScatter
            | Collective::ReduceScatterV
            | Collective::AllGather
            | Collective::AllGatherV
            | Collective::Broadcast { .. }
            | Collective::Reduce { .. } => Some(beta),
            Collective::AllToAll => Some(2.0 * beta / nf),
            _ => None,
        },
    }
}

/// [`device_bound_gbs`] for ranks spread over nodes (`per_node`: how many on each). Across
/// nodes a device all-to-all runs over the pairs, so under `Links(β)` the
/// busiest node's link bounds it: `m(n − m)/n · S` through a link of β for a node of `m`
/// ranks, so busbw = (n − 1)/n · S/t ≤ (n − 1)·β / (m(n − m)). Everything else as on one node.
pub fn device_bound_on(
    op: Collective,
    per_node: &[usize],
    inplace: bool,
    limit: DeviceLimit,
) -> Option<f64> {
    let n: usize = per_node.iter().sum();
    match limit {
        DeviceLimit::Links(beta) if op == Collective::AllToAll && per_node.len() > 1 && n > 2 => {
            Some(busbw_factor(op, n) * beta / busiest_node_share(per_node))
        }
        _ => device_bound_gbs(op, n, inplace, limit),
    }
}

/// Algorithm bandwidth in GB/s.
pub fn algbw_gbs(bytes: usize, time_us: f64) -> f64 {
    if time_us <= 0.0 {
        return 0.0;
    }
    bytes as f64 / (time_us * 1e-6) / 1e9
}

/// Bus bandwidth in GB/s.
pub fn busbw_gbs(op: Collective, n: usize, bytes: usize, time_us: f64) -> f64 {
    algbw_gbs(bytes, time_us) * busbw_factor(op, n)
}

/// Ring steps of a collective on `n` ranks (rounds, for recursive doubling).
pub fn steps(op: Collective, algo: Algo, n: usize) -> usize {
    let hops = n.saturating_sub(1);
    match (algo, op) {
        (Algo::By(s), _) => doubling::depth(s, op, n),
        // The pairwise collectives send all their messages at once.
        (Algo::Pairwise, _) => 1,
        // Post where the input is, wait; read, wait.
        (Algo::SingleCopy, _) => 2,
        (_, Collective::AllReduce) => 2 * hops,
        // One message each way between two ranks.
        (_, Collective::SendRecv) => 1,
        _ => hops,
    }
}

/// Bytes each link carries for a collective of `bytes` total bytes on `n` ranks.
pub fn bytes_per_link(op: Collective, algo: Algo, n: usize, bytes: usize) -> f64 {
    if n < 2 {
        return 0.0;
    }
    if let Algo::By(sched) = algo {
        return doubling::volume(sched, op, n) * bytes as f64;
    }
    let (s, n) = (bytes as f64, n as f64);
    if algo == Algo::Pairwise {
        // Each rank moves its messages through itself (the root, for gather and scatter),
        // driven by one engine thread: they count as one link.
        return (n - 1.0) / n * s;
    }
    match op {
        Collective::AllReduce => 2.0 * (n - 1.0) / n * s,
        // All-to-all: n − 1 exchanges of one block (s/n), each over its own link.
        Collective::ReduceScatter
        | Collective::ReduceScatterV
        | Collective::AllGather
        | Collective::AllGatherV
        | Collective::AllToAll => (n - 1.0) / n * s,
        Collective::RingShift => s,
        _ => s,
    }
}

/// Bytes the busiest rank copies within its own memory, beside what its links carry, in `op`
/// of `bytes` on `n` ranks (`inplace` or not). Each is a copy its links' streams do not make:
///
/// - all-gather (and all-gather-v) out of place: its own part into its output, S/n (the
///   single-copy form's streams copy it already: 0);
/// - broadcast on the chain: out of place the root's input into its output, S; on 3 or more
///   ranks a relay writes each received slice into its output as well as into the next rank's
///   slot, S, where a one-way stream writes it once (in place on 2 ranks: 0);
/// - gather and scatter: the root's own block, S/n; all-to-all and all-to-all-v: the own
///   block, S/n, and in place the all-to-all first copies its whole buffer, S more;
/// - 0 for the reductions (a received slice is combined straight into the next slot or the
///   output, as the streams' copies are) and the doubling schedules.
pub fn local_copy_bytes(
    op: Collective,
    algo: Algo,
    n: usize,
    (bytes, inplace): (usize, bool),
    relays_copy: bool,
) -> f64 {
    if n < 2 || matches!(algo, Algo::SingleCopy | Algo::By(_)) {
        return 0.0;
    }
    let (s, nf) = (bytes as f64, n as f64);
    match op {
        Collective::AllGather | Collective::AllGatherV if !inplace => s / nf,
        Collective::Broadcast { .. } if (n > 2 && relays_copy) || !inplace => s,
        Collective::Gather { .. } | Collective::Scatter { .. } | Collective::AllToAllV => s / nf,
        Collective::AllToAll if inplace => s + s / nf,
        Collective::AllToAll => s / nf,
        _ => 0.0,
    }
}

/// Whether the busiest rank's local copies ([`local_copy_bytes`]) read bytes its link copy has
/// just read, slice by slice, so that only their writes reach memory: the ring's all-gather
/// (and all-gather-v) sends its own part's slice, then stores it into the output; a broadcast's
/// root does the same with its input, and a relay stores the slice it forwards. The gather's,
/// scatter's and all-to-all's own blocks are copies of their own, from memory.
pub fn local_copy_rereads(op: Collective, algo: Algo) -> bool {
    algo == Algo::Ring
        && matches!(
            op,
            Collective::AllGather | Collective::AllGatherV | Collective::Broadcast { .. }
        )
}

/// The share of an in-place ring call's link bytes that cost its buffer's memory what a
/// stream storing into lines it has not just read costs (sending one window, receiving into
/// another: the window read, the other fetched and written back), the rest costing what a
/// stream storing onto the lines it sent costs (read and written back), once the buffer is
/// larger than the caches. An all-gather stores each part it receives at that part's own place
/// (1); a reduce-scatter stores its sums where it read its own chunk, but reads that chunk
/// besides the received one, the same traffic (1); an all-reduce's all-gather half stores onto
/// lines its reduce-scatter half has just read, slice by slice (½); an in-place all-to-all
/// first copies its whole buffer out, so what it receives lands on lines that copy has just
/// read (0).
pub fn in_place_fresh_share(op: Collective) -> f64 {
    match op {
        Collective::AllGather
        | Collective::AllGatherV
        | Collective::ReduceScatter
        | Collective::ReduceScatterV => 1.0,
        Collective::AllReduce => 0.5,
        _ => 0.0,
    }
}

/// Predicted time in µs (None for a one-rank world, where there is nothing to predict), the
/// ranks on one node, out of place.
pub fn predict_us(op: Collective, algo: Algo, n: usize, bytes: usize, m: Model) -> Option<f64> {
    predict_us_on(op, algo, &[n], (bytes, false), m)
}

/// [`predict_us`] for ranks spread over nodes (`per_node`: how many on each), in place or
/// not: a collective whose every pair of ranks exchanges directly must also get its share
/// through the busiest node's link ([`node_link_bytes`]), which can be more than one ring link
/// carries; and the busiest rank's local copies ([`local_copy_bytes`]) add their time at
/// `m.copy_gbs` where the model has it.
pub fn predict_us_on(
    op: Collective,
    algo: Algo,
    per_node: &[usize],
    (bytes, inplace): (usize, bool),
    m: Model,
) -> Option<f64> {
    let n: usize = per_node.iter().sum();
    if n < 2 || m.beta_gbs <= 0.0 {
        return None;
    }
    // β GB/s = β·10³ bytes per µs.
    let link = bytes_per_link(op, algo, n, bytes).max(node_link_bytes(op, algo, per_node, bytes));
    let local = match m.copy_gbs {
        Some(c) if c > 0.0 => {
            local_copy_bytes(op, algo, n, (bytes, inplace), m.relays_copy) / (c * 1e3)
        }
        _ => 0.0,
    };
    Some(steps(op, algo, n) as f64 * m.alpha_us + link / (m.beta_gbs * 1e3) + local)
}

/// Bytes the busiest node's link carries each way when every pair of ranks exchanges directly
/// (all-to-all, all-to-all-v, and all-gather-v by pairs): a node of `m` of the `n` ranks sends
/// each of its ranks' blocks (S/n each) to the `n − m` ranks elsewhere, `m(n − m)/n · S`, where
/// a ring crosses each node boundary once. 0 on one node, and for collectives that go round the
/// ring (whose links [`bytes_per_link`] already counts) or meet at one root.
pub fn node_link_bytes(op: Collective, algo: Algo, per_node: &[usize], bytes: usize) -> f64 {
    let direct = matches!(op, Collective::AllToAll | Collective::AllToAllV)
        || (op == Collective::AllGatherV && algo == Algo::Pairwise);
    if per_node.len() < 2 || !direct {
        return 0.0;
    }
    busiest_node_share(per_node) * bytes as f64
}

/// The share of a buffer that leaves the busiest node when every pair of ranks trades a block
/// of `1/n` of it: `m(n − m)/n` for a node of `m` of the `n` ranks (0 for an empty world).
fn busiest_node_share(per_node: &[usize]) -> f64 {
    let n: usize = per_node.iter().sum();
    let worst = per_node.iter().map(|&m| m * (n - m)).max().unwrap_or(0);
    if n == 0 {
        0.0
    } else {
        worst as f64 / n as f64
    }
}

/// Predicted over measured time.
pub fn efficiency(predicted_us: Option<f64>, measured_us: f64) -> Option<f64> {
    predicted_us
        .filter(|_| measured_us > 0.0)
        .map(|p| p / measured_us)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bandwidths_match_hand_computed_values() {
        // 1 GB in 1 s is 1 GB/s; 8 MiB in 1000 µs is 8.388608 GB/s.
        assert!((algbw_gbs(1_000_000_000, 1e6) - 1.0).abs() < 1e-12);
        assert!((algbw_gbs(8 << 20, 1000.0) - 8.388608).abs() < 1e-9);
        // all-reduce on 4 ranks: factor 1.5; reduce-scatter: 0.75; broadcast: 1.
        assert!((busbw_gbs(Collective::AllReduce, 4, 8 << 20, 1000.0) - 12.582912).abs() < 1e-9);
        // Across nodes: two nodes of 4, an 8 MB all-to-all: each node's link carries 4·4/8 = 2
        // times it (16 MB), not a ring link's 7/8; one node of 8 sends nothing out.
        let (a2a, ag) = (Collective::AllToAll, Collective::AllGather);
        assert_eq!(node_link_bytes(a2a, Algo::Ring, &[4, 4], 8_000_000), 16e6);
        assert_eq!(node_link_bytes(a2a, Algo::Ring, &[8], 8_000_000), 0.0);
        assert_eq!(node_link_bytes(a2a, Algo::Ring, &[6, 2], 8_000_000), 12e6);
        let agv = Collective::AllGatherV;
        assert_eq!(
            node_link_bytes(agv, Algo::Pairwise, &[2, 2], 4_000_000),
            4e6
        );
        assert_eq!(node_link_bytes(agv, Algo::Ring, &[2, 2], 4_000_000), 0.0);
        assert_eq!(node_link_bytes(ag, Algo::Ring, &[4, 4], 8_000_000), 0.0);
        let m = Model::links(10.0, 1.0);
        // 7 steps · 10 µs + 16 MB at 1 GB/s (16 000 µs), where one node would give 7 000 µs.
        assert_eq!(
            predict_us_on(a2a, Algo::Ring, &[4, 4], (8_000_000, false), m),
            Some(16_070.0)
        );
        assert_eq!(
            predict_us_on(a2a, Algo::Ring, &[8], (8_000_000, false), m),
            predict_us(a2a, Algo::Ring, 8, 8_000_000, m)
        );
        assert!((busbw_gbs(Collective::ReduceScatter, 4, 8 << 20, 1000.0) - 6.291456).abs() < 1e-9);
        assert_eq!(busbw_factor(Collective::Broadcast { root: 0 }, 8), 1.0);
        assert_eq!(busbw_factor(Collective::AllReduce, 2), 1.0);
        assert_eq!(algbw_gbs(10, 0.0), 0.0);
    }

    #[test]
    fn device_bounds_match_hand_computed_values() {
        let close = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() < 1e-9);
        let (a2a, ag) = (Collective::AllToAll, Collective::AllGather);
        // The device all-to-all across two nodes of 4 goes over the pairs: 7β/16, where the
        // ring's one-way store-and-forward allows 2β/8 (one node keeps that); in place too.
        let links = DeviceLimit::Links(1.6);
        assert!(close(device_bound_on(a2a, &[4, 4], false, links), 0.7));
        assert!(close(device_bound_on(a2a, &[4, 4], true, links), 0.7));
        assert!(close(device_bound_on(a2a, &[8], false, links), 0.4));
        assert_eq!(device_bound_on(ag, &[4, 4], false, links), Some(1.6));
        let (bc, rd) = (
            Collective::Broadcast { root: 0 },
            Collective::Reduce { root: 1 },
        );
        // One memory copying 3000 GB/s, 4 ranks: all-reduce 3000·3/16 = 562.5 (the H100's
        // shared-memory bound); reduce-scatter 0.75·3000/5 = 450; broadcast 3000/5, in place /4.
        let m = DeviceLimit::Memory(3000.0);
        assert!(close(
            device_bound_gbs(Collective::AllReduce, 4, false, m),
            562.5
        ));
        assert!(close(
            device_bound_gbs(Collective::AllReduce, 4, true, m),
            562.5
        ));
        assert!(close(
            device_bound_gbs(Collective::ReduceScatter, 4, true, m),
            450.0
        ));
        assert!(close(
            device_bound_gbs(Collective::AllGather, 4, false, m),
            450.0
        ));
        assert!(close(
            device_bound_gbs(Collective::AllGather, 4, true, m),
            562.5
        ));
        assert!(close(device_bound_gbs(bc, 4, false, m), 600.0));
        assert!(close(device_bound_gbs(bc, 4, true, m), 750.0));
        assert!(close(device_bound_gbs(rd, 4, true, m), 600.0));
        // One host link at 48 GB/s each way with both at once: w/n, or w/(n−1) for the chains.
        let w = DeviceLimit::Staged(48.0);
        assert!(close(
            device_bound_gbs(Collective::AllReduce, 2, false, w),
            24.0
        ));
        assert!(close(
            device_bound_gbs(Collective::AllGather, 4, true, w),
            12.0
        ));
        assert!(close(device_bound_gbs(bc, 4, false, w), 16.0));
        assert!(close(device_bound_gbs(rd, 3, false, w), 24.0));
        // The ring's links at 20 GB/s: busbw ≤ 20 for every ring collective, in place or not.
        let l = DeviceLimit::Links(20.0);
        for op in [
            Collective::AllReduce,
            Collective::ReduceScatter,
            Collective::ReduceScatterV,
            Collective::AllGather,
            bc,
            rd,
        ] {
            for inplace in [false, true] {
                assert!(close(device_bound_gbs(op, 3, inplace, l), 20.0), "{op:?}");
            }
        }
        // All-to-all: one memory, 4 ranks: 0.75·3000/8 = 281.25 (in place 0.75·3000/6 = 375);
        // one host link w/n = 12; a one-way ring of 4 links at 20 GB/s: 2·20/4 = 10.
        let a2a = Collective::AllToAll;
        assert!(close(device_bound_gbs(a2a, 4, false, m), 281.25));
        assert!(close(device_bound_gbs(a2a, 4, true, m), 375.0));
        assert!(close(device_bound_gbs(a2a, 4, false, w), 12.0));
        assert!(close(device_bound_gbs(a2a, 4, true, l), 10.0));
        assert!(close(device_bound_gbs(a2a, 2, false, l), 20.0));
        // Send-recv (busbw = algbw): one memory, 4 ranks each reading and writing S: 3000/8;
        // one host link w/n; no bound from the ring's links.
        let sr = Collective::SendRecv;
        assert!(close(device_bound_gbs(sr, 4, false, m), 375.0));
        assert!(close(device_bound_gbs(sr, 4, false, w), 12.0));
        assert_eq!(device_bound_gbs(sr, 4, false, l), None);
        // None for one rank, and for what the device sweep does not run.
        assert_eq!(device_bound_gbs(Collective::AllReduce, 1, false, m), None);
        assert_eq!(device_bound_gbs(Collective::RingShift, 4, false, m), None);
        // Gather and scatter: 0.75·3000/2 through one memory, w through the host link.
        for g in [
            Collective::Gather { root: 0 },
            Collective::Scatter { root: 3 },
        ] {
            assert!(close(device_bound_gbs(g, 4, false, m), 1125.0));
            assert!(close(device_bound_gbs(g, 4, false, w), 48.0));
            assert_eq!(device_bound_gbs(g, 4, false, l), None);
        }
        // All-to-all-v (the sweep's equal blocks) is bounded as the all-to-all, except by the
        // ring's links, which its pairs do not use.
        let a2av = Collective::AllToAllV;
        for limit in [m, w] {
            assert_eq!(
                device_bound_gbs(a2av, 4, false, limit),
                device_bound_gbs(a2a, 4, false, limit)
            );
        }
        assert_eq!(device_bound_gbs(a2av, 4, false, l), None);
        // All-gather-v (the sweep's balanced parts) is bounded as the all-gather.
        for limit in [m, w, l] {
            for inplace in [false, true] {
                let (v, ag) = (Collective::AllGatherV, Collective::AllGather);
                assert_eq!(
                    device_bound_gbs(v, 4, inplace, limit),
                    device_bound_gbs(ag, 4, inplace, limit)
                );
            }
        }
    }

    #[test]
    fn predictions_match_hand_computed_values() {
        let m = Model::links(2.0, 4.0);
        // all-reduce, 4 ranks, 8 MB: 6 steps · 2 µs + 1.5 · 8e6 B / 4e3 B/µs = 12 + 3000 µs.
        assert_eq!(
            predict_us(Collective::AllReduce, Algo::Ring, 4, 8_000_000, m),
            Some(3012.0)
        );
        // all-gather, 2 ranks, 1 MB: 1 · 2 + 0.5 · 1e6 / 4e3 = 2 + 125.
        assert_eq!(
            predict_us(Collective::AllGather, Algo::Ring, 2, 1_000_000, m),
            Some(127.0)
        );
        // broadcast, 3 ranks, 4 kB: 2 · 2 + 4000 / 4000 = 5.
        assert_eq!(
            predict_us(Collective::Broadcast { root: 0 }, Algo::Ring, 3, 4000, m),
            Some(5.0)
        );
        assert_eq!(
            predict_us(Collective::AllReduce, Algo::Ring, 1, 4000, m),
            None
        );
        // By recursive doubling, 4 ranks, 8 kB: 2 rounds · 2 µs + 2 · 8000 / 4000 = 8; 5 ranks
        // fold first: 4 rounds.
        let d = |n, b| {
            let algo = Algo::By(Schedule::Doubling);
            predict_us(Collective::AllReduce, algo, n, b, m)
        };
        assert_eq!(d(4, 8000), Some(8.0));
        assert_eq!(d(5, 8000), Some(16.0));
        // By halving-doubling, 4 ranks, 8 kB: 4 rounds · 2 µs + 1.5 · 8000 / 4000 = 11; 5 ranks
        // add the fold: 6 rounds, 3.5 · 8000 / 4000.
        let hd = |n, b| {
            let algo = Algo::By(Schedule::HalvingDoubling);
            predict_us(Collective::AllReduce, algo, n, b, m)
        };
        assert_eq!(hd(4, 8000), Some(11.0));
        assert_eq!(hd(5, 8000), Some(19.0));
        assert_eq!(efficiency(Some(50.0), 100.0), Some(0.5));
        assert_eq!(efficiency(None, 100.0), None);
    }

    #[test]
    fn local_copies_add_the_busiest_ranks_own_copies_at_the_copy_rate() {
        let (ag, bc) = (Collective::AllGather, Collective::Broadcast { root: 0 });
        let (ring, s) = (Algo::Ring, 8_000_000);
        // The own part out of place (S/n), nothing in place; the single copy's streams copy it.
        assert_eq!(local_copy_bytes(ag, ring, 4, (s, false), true), 2e6);
        assert_eq!(local_copy_bytes(ag, ring, 4, (s, true), true), 0.0);
        assert_eq!(
            local_copy_bytes(ag, Algo::SingleCopy, 2, (s, false), true),
            0.0
        );
        // Broadcast: the root's input into its output; a relay's second write on 3+ ranks.
        assert_eq!(local_copy_bytes(bc, ring, 2, (s, false), true), 8e6);
        assert_eq!(local_copy_bytes(bc, ring, 2, (s, true), true), 0.0);
        assert_eq!(local_copy_bytes(bc, ring, 3, (s, true), true), 8e6);
        // In place: an all-gather stores fresh, an all-to-all onto what its first copy read.
        assert_eq!(in_place_fresh_share(ag), 1.0);
        assert_eq!(in_place_fresh_share(Collective::AllReduce), 0.5);
        assert_eq!(in_place_fresh_share(Collective::AllToAll), 0.0);
        // Those stores re-read the slice just sent; the gather's own block is a copy of its own.
        assert!(local_copy_rereads(ag, ring) && local_copy_rereads(bc, ring));
        assert!(!local_copy_rereads(
            Collective::Gather { root: 0 },
            Algo::Pairwise
        ));
        assert!(!local_copy_rereads(Collective::AllGatherV, Algo::Pairwise));
        assert!(!local_copy_rereads(Collective::AllToAll, ring));
        // Over tcp the socket reads the relay's frame into its output and sends it on from
        // there; the root still copies its input out of place.
        assert!(!relays_copy("tcp") && relays_copy("shm") && relays_copy("shm+tcp"));
        assert_eq!(local_copy_bytes(bc, ring, 3, (s, true), false), 0.0);
        assert_eq!(local_copy_bytes(bc, ring, 3, (s, false), false), 8e6);
        // The reductions combine into the slot or the output: nothing more.
        for op in [
            Collective::AllReduce,
            Collective::ReduceScatter,
            Collective::Reduce { root: 1 },
        ] {
            assert_eq!(local_copy_bytes(op, ring, 4, (s, false), true), 0.0);
        }
        let pw = Algo::Pairwise;
        assert_eq!(
            local_copy_bytes(Collective::Gather { root: 0 }, pw, 4, (s, false), true),
            2e6
        );
        assert_eq!(
            local_copy_bytes(Collective::AllToAll, pw, 4, (s, false), true),
            2e6
        );
        // In place the all-to-all copies its whole buffer first.
        assert_eq!(
            local_copy_bytes(Collective::AllToAll, pw, 4, (s, true), true),
            10e6
        );
        assert_eq!(local_copy_bytes(ag, ring, 1, (s, false), true), 0.0);
        // All-gather, 2 ranks, 1 MB out of place, links at 4 GB/s and copies at 2 GB/s:
        // 2 + 0.5e6 / 4e3 + 0.5e6 / 2e3 = 2 + 125 + 250; in place, or without a copy rate, 127.
        let m = Model {
            copy_gbs: Some(2.0),
            ..Model::links(2.0, 4.0)
        };
        assert_eq!(
            predict_us_on(ag, ring, &[2], (1_000_000, false), m),
            Some(377.0)
        );
        assert_eq!(
            predict_us_on(ag, ring, &[2], (1_000_000, true), m),
            Some(127.0)
        );
        assert_eq!(
            predict_us(ag, ring, 2, 1_000_000, Model::links(2.0, 4.0)),
            Some(127.0)
        );
    }
}
