//! The policies a configuration picks between: the transport of ring edges, how host staging
//! moves device bytes, the device collectives' algorithm, and the host collectives' algorithm.

use crate::ring::doubling::Schedule;
use crate::ring::Collective;

use super::{DEFAULT_DOUBLING_MAX, DEFAULT_HALVING_MAX, DEFAULT_PAIRWISE_MAX};

/// Which transport to use on ring edges.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TransportPref {
    /// Shared memory between ranks of one node, TCP between nodes.
    #[default]
    Auto,
    /// TCP on every edge.
    Tcp,
    /// Shared memory on every edge (an error if two neighbours are on different nodes).
    Shm,
    /// CUDA IPC peer copies on every device edge (an error where peer access is impossible);
    /// host buffers use shared memory.
    CudaIpc,
}

/// How host staging (the `shm` transport carrying device buffers) moves bytes between the device
/// and the pinned slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum StagingMode {
    /// Each rank picks one of the two others by its device and how many ranks use it
    /// ([`StagingMode::resolve`]): explicit copies on a GPU that at most
    /// [`COPY_STAGING_MAX_SHARERS`] ranks use, mapped kernels otherwise (more ranks, or a device
    /// without copy engines, such as the host stream).
    #[default]
    Auto,
    /// Kernels read and write the mapped host slots directly (no separate copies). One kernel
    /// moving both ways over mapped memory gets well under what the copy engines move, but
    /// several ranks' kernels on one GPU together come close to the link (`docs/gpu.md`).
    Mapped,
    /// Explicit copies on the copy engines: a kernel's result goes to device scratch and is
    /// copied into the host slot; a received slot is copied into device scratch before a kernel
    /// reads it. The copies into the device and out of it run at once on two copy lanes.
    Copy,
}

/// The most ranks sharing one GPU for which [`StagingMode::Auto`] stages by explicit copies:
/// with few ranks a mapped kernel leaves the link half idle and the copy engines fill it; with
/// more, the ranks' kernels fill it together (the measurements: `docs/gpu-runs/README.md`).
pub const COPY_STAGING_MAX_SHARERS: usize = 2;

impl StagingMode {
    /// The way a rank stages whose device `sharers` ranks use (itself included), and why; `gpu`
    /// says whether that device is a GPU, with copy engines beside its kernels (the host stream's
    /// "copies" are more memcpys on the same cores, 0.5× of mapped on 2 cores).
    /// [`StagingMode::Auto`] becomes [`StagingMode::Copy`] on a GPU that at most
    /// [`COPY_STAGING_MAX_SHARERS`] ranks use and [`StagingMode::Mapped`] otherwise; the others
    /// stay.
    pub fn resolve(self, sharers: usize, gpu: bool) -> (StagingMode, String) {
        let why = if gpu {
            format!(
                "RINGZERO_STAGING=auto: {sharers} rank{} on this GPU, copies for at most \
                 {COPY_STAGING_MAX_SHARERS}",
                if sharers == 1 { "" } else { "s" }
            )
        } else {
            "RINGZERO_STAGING=auto: not a GPU, no copy engines to gain from".to_string()
        };
        match self {
            StagingMode::Auto if gpu && sharers <= COPY_STAGING_MAX_SHARERS => {
                (StagingMode::Copy, why)
            }
            StagingMode::Auto => (StagingMode::Mapped, why),
            forced => (forced, format!("RINGZERO_STAGING={forced}")),
        }
    }
}

impl std::fmt::Display for StagingMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StagingMode::Auto => "auto",
            StagingMode::Mapped => "mapped",
            StagingMode::Copy => "copy",
        })
    }
}

/// How device all-reduces, reduce-scatters, all-gathers, broadcasts and reduces move data
/// (`RINGZERO_DEVICE_ALGO=auto|ring|direct`).
///
/// *Direct*: when every rank of a device communicator can map every other rank's buffers (one
/// node, CUDA IPC, peer access between every pair), each rank reduces its own part of the result
/// by reading that part of every rank's input, and writes it into every rank's output, in one
/// kernel; the ranks agree on each call and wait for each other on a shared-memory board. Every byte is read once and written
/// once, where the slot ring reads and writes each slice again in the slots. Ranks that share one
/// GPU are held to its memory bandwidth, so there the ring can reach only half of what direct can.
///
/// Both give every rank bit-identical results. The direct step combines the ranks' values in rank
/// order and the ring in ring order, so float sums may differ between the two in rounding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DeviceAlgo {
    /// Direct where every rank shares one GPU (the bandwidth bound above), else the ring. Between
    /// distinct GPUs the ring's neighbour-to-neighbour traffic suits PCIe and NVLink alike.
    #[default]
    Auto,
    /// Always the ring.
    Ring,
    /// Direct wherever every rank can map every other's buffers (set-up fails with the reason
    /// where they cannot). A call whose buffers cannot be shared (memory CUDA IPC cannot export)
    /// still takes the ring, on every rank alike.
    Direct,
}

impl std::fmt::Display for DeviceAlgo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceAlgo::Auto => "auto",
            DeviceAlgo::Ring => "ring",
            DeviceAlgo::Direct => "direct",
        })
    }
}

/// The largest all-reduce `auto` runs by recursive doubling on two ranks whose edges are not
/// shared memory (see [`Algo::Auto`]): on loopback tcp here doubling took 20 µs against the
/// ring's 28 at 16 KiB and 25 against 30 at 32 KiB, and lost from 64 KiB (34 against 31; best
/// of four interleaved runs each).
pub const TWO_RANK_DOUBLING_MAX: usize = 32 << 10;

/// Which algorithm the latency-bound host collectives run (`RINGZERO_ALGO`,
/// `RINGZERO_DOUBLING_MAX`, `RINGZERO_HALVING_MAX`, `RINGZERO_PAIRWISE_MAX`): all-reduce,
/// broadcast, reduce and barrier either go round the ring (`2(n − 1)` or `n − 1` hops) or by a
/// doubling schedule in about `log2 n` rounds (recursive doubling and halving-doubling, binomial
/// trees, a dissemination barrier: see `ring::doubling`); all-gather-v either goes round the
/// ring (`n − 1` hops) or sends every part straight to every rank in one step (pairwise).
///
/// Every rank must choose alike: a rank whose choice differs fails at the first frame with both
/// calls named. Each gives every rank of an all-reduce bit-identical results; recursive doubling
/// and halving-doubling reduce in the same order, the ring in another, so sums may differ in
/// rounding between the ring and the other two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algo {
    /// On three ranks or more: the all-reduce by recursive doubling up to `doubling_max` bytes,
    /// by halving-doubling up to `halving_max`, the ring above; every barrier by dissemination,
    /// where they measured faster; broadcast and reduce on the ring's chain at every size, whose
    /// calls pipeline one after another (a tree's root sends `log2 n` copies per call: it cut
    /// one call's latency but lost on back-to-back calls in `ringzero bench`, see the design
    /// notes). On two ranks every one of them takes the ring, whose steps are each one
    /// exchange, except the all-reduce over edges that are not shared memory (tcp) up to
    /// [`TWO_RANK_DOUBLING_MAX`] (or `doubling_max`, the smaller): there recursive doubling's one
    /// exchange of the whole buffer beats the ring's two of half, where each hop costs a
    /// network round trip (on shared memory the ring measured faster, about 1.2 µs against
    /// 2.3 at 4 KiB). Two ranks sum in one order either way (`a + b` is `b + a`), so the
    /// results are the ring's bit for bit.
    Auto {
        /// The largest all-reduce, in bytes, run by recursive doubling.
        doubling_max: usize,
        /// The largest all-reduce, in bytes, run by halving-doubling (those up to
        /// `doubling_max` excepted).
        halving_max: usize,
        /// The largest all-gather-v, in bytes of the whole result, run pairwise (one step,
        /// every part straight to every rank) on ranks that span several nodes; larger ones go
        /// round the ring, which crosses each node's boundary once where the pairs cross it
        /// for every pair of ranks on two nodes (`m(n − m)/n` of the result leaves a node of
        /// `m` ranks, against the ring's `(n − 1)/n`). On one node the two move the same bytes
        /// and measured alike, so all-gather-v runs pairwise there at every size.
        pairwise_max: usize,
    },
    /// The ring at every size (bandwidth-optimal; the order the reduce-scatter uses too).
    Ring,
    /// The whole-buffer doubling schedules at every size, broadcast and reduce by binomial tree
    /// included, and all-gather-v pairwise (one step) at every size.
    Doubling,
    /// The all-reduce by halving-doubling at every size; everything else on the ring.
    HalvingDoubling,
}

impl Default for Algo {
    fn default() -> Self {
        Algo::Auto {
            doubling_max: DEFAULT_DOUBLING_MAX,
            halving_max: DEFAULT_HALVING_MAX,
            pairwise_max: DEFAULT_PAIRWISE_MAX,
        }
    }
}

impl Algo {
    /// The schedule `coll` of `bytes` on `n` ranks runs, `None` for the ring's (never a
    /// schedule on one rank, where there is nothing to exchange, nor for a collective without
    /// one). `shm`: whether the ring's edges are all shared memory (two ranks choose by it).
    pub fn schedule(self, coll: Collective, bytes: usize, n: usize, shm: bool) -> Option<Schedule> {
        if n < 2 {
            return None;
        }
        let s = match self {
            Algo::Auto {
                doubling_max,
                halving_max,
                ..
            } => match coll {
                Collective::AllReduce
                    if n == 2 && !shm && bytes <= doubling_max.min(TWO_RANK_DOUBLING_MAX) =>
                {
                    Some(Schedule::Doubling)
                }
                _ if n == 2 => None,
                Collective::AllReduce if bytes <= doubling_max => Some(Schedule::Doubling),
                Collective::AllReduce if bytes <= halving_max => Some(Schedule::HalvingDoubling),
                Collective::Barrier => Some(Schedule::Doubling),
                _ => None,
            },
            Algo::Ring => None,
            Algo::Doubling => Some(Schedule::Doubling),
            Algo::HalvingDoubling => Some(Schedule::HalvingDoubling),
        };
        s.filter(|s| s.has(coll))
    }

    /// Whether an all-gather-v of `bytes` (the whole result) on `n` ranks on `nodes` nodes runs
    /// pairwise (every part straight to every rank, one step) rather than round the ring. Two
    /// ranks take the ring under `auto`, where both are one exchange and the ring needs no
    /// links of its own.
    pub fn gathers_v_pairwise(self, bytes: usize, n: usize, nodes: usize) -> bool {
        match self {
            Algo::Auto { pairwise_max, .. } => n > 2 && (nodes < 2 || bytes <= pairwise_max),
            Algo::Doubling => n > 1,
            Algo::Ring | Algo::HalvingDoubling => false,
        }
    }
}

impl std::str::FromStr for Algo {
    type Err = String;

    /// `auto` (with the default thresholds), `ring`, `doubling` or `halving-doubling`, as
    /// `RINGZERO_ALGO` takes them (any case).
    fn from_str(s: &str) -> std::result::Result<Algo, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(Algo::default()),
            "ring" => Ok(Algo::Ring),
            "doubling" => Ok(Algo::Doubling),
            "halving-doubling" => Ok(Algo::HalvingDoubling),
            _ => Err(format!(
                "`{s}` is not one of auto, ring, doubling, halving-doubling"
            )),
        }
    }
}

impl std::fmt::Display for Algo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Algo::Auto {
                doubling_max,
                halving_max,
                pairwise_max,
            } => {
                write!(f, "auto (all-reduce by doubling up to {doubling_max} B ")?;
                write!(
                    f,
                    "(on 2 ranks over tcp up to {} B), ",
                    (*doubling_max).min(TWO_RANK_DOUBLING_MAX)
                )?;
                if halving_max > doubling_max {
                    write!(f, "by halving-doubling up to {halving_max} B, ")?;
                }
                write!(
                    f,
                    "ring above; barrier by dissemination; broadcast and reduce on the ring; \
                     all-gather-v pairwise, across nodes up to {pairwise_max} B, ring above)"
                )
            }
            Algo::Ring => f.write_str("ring"),
            Algo::Doubling => f.write_str("doubling"),
            Algo::HalvingDoubling => f.write_str("halving-doubling"),
        }
    }
}
