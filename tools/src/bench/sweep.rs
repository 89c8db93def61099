//! One collective over a range of sizes: a checked untimed call (`#wrong`), then warm-up and timed
//! calls, out of place and in place, on every rank.
//!
//! Time per call is the **mean over ranks of each rank's mean** over the timed iterations
//! (iterations start together after a barrier).

use std::ops::DerefMut;
use std::time::Instant;

use ringzero_collectives::{
    chunk, Collective, Collectives, Communicator, DType, Element, InPlace, P2p, ReduceOp, Result,
    SharedBuf,
};
use serde::Serialize;

use super::exact;
use super::theory::{self, Algo, Model};
use ringzero_collectives::internals::ring::doubling;
use ringzero_collectives::internals::transport::{cma, memfd};

/// What to sweep.
#[derive(Clone, Debug)]
pub struct SweepArgs {
    /// Element type.
    pub dtype: DType,
    /// Reduce operator.
    pub redop: ReduceOp,
    /// Sizes in bytes.
    pub sizes: Vec<usize>,
    /// Timed iterations per size.
    pub iters: usize,
    /// Untimed iterations before them.
    pub warmup: usize,
    /// Test hook: this rank corrupts one element of its checked result.
    pub corrupt_rank: Option<usize>,
    /// Re-measure α and β interleaved with every row's timed calls (see [`timed_with_model`]);
    /// otherwise every row uses the model measured at the start.
    pub model_per_row: bool,
    /// Algorithms to set side by side, each size run by each in turn (`--algos`), for the
    /// collectives that have more than one (all-reduce, broadcast, reduce); empty: the
    /// communicator's own (`RINGZERO_ALGO`).
    pub algos: Vec<ringzero_collectives::Algo>,
    /// Allocate every timed buffer as a [`ringzero_collectives::SharedBuf`] (`--shared-buffers`,
    /// as nccl-tests' `-R` registers its buffers): single-copy all-gathers then read the other
    /// ranks' parts through kept mappings, and their β streams do the same.
    pub shared_buffers: bool,
}

/// One line of the report.
#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct Row {
    /// Collective name.
    pub op: String,
    /// Total buffer bytes.
    pub bytes: usize,
    /// Total elements.
    pub count: usize,
    /// Element type.
    pub dtype: String,
    /// Reduce operator (`-` for collectives that do not reduce).
    pub redop: String,
    /// Number of ranks.
    pub ranks: usize,
    /// Transports of the ring's edges (`shm`, `tcp`, `shm+tcp`).
    pub transport: String,
    /// Mean time per call, µs.
    pub time_us: f64,
    /// Algorithm bandwidth, GB/s.
    pub algbw_gbs: f64,
    /// Bus bandwidth, GB/s.
    pub busbw_gbs: f64,
    /// Elements that differed from the exact result, summed over ranks.
    pub wrong: u64,
    /// In place or out of place.
    pub inplace: bool,
    /// α of the model this row's prediction uses, µs per step.
    #[serde(default)]
    pub alpha_us: Option<f64>,
    /// β of the model this row's prediction uses, GB/s per link.
    #[serde(default)]
    pub beta_gbs: Option<f64>,
    /// The rate of the copies a rank makes within its own memory beside its links (the
    /// model's `copy_gbs`), GB/s, where the row's collective makes any and the model counts
    /// them ([`theory::local_copy_bytes`]); from a source in cache where the call re-reads
    /// what its link copy read ([`theory::local_copy_rereads`]).
    #[serde(default)]
    pub copy_gbs: Option<f64>,
    /// How far the row's β streams varied: the slowest group of streams' time over the
    /// fastest's, on the rank where that ratio is largest (1.0: steady). The calls ran
    /// between those groups, so their timing varied as much: the noise the efficiency carries.
    #[serde(default)]
    pub stream_swing: Option<f64>,
    /// How far the row's own calls varied: the slowest group of calls' time per call over the
    /// fastest's, on the rank where that ratio is largest (1.0: steady). Where it is large, the
    /// mean time the efficiency divides by is an average over different machine speeds.
    #[serde(default)]
    pub call_swing: Option<f64>,
    /// α–β prediction, µs.
    pub predicted_us: Option<f64>,
    /// predicted / measured.
    pub efficiency: Option<f64>,
    /// How the collective moved: `ring`, or `doubling` (a small all-reduce; see
    /// `ringzero::Algo`). Empty in reports written before it was recorded.
    #[serde(default)]
    pub algo: String,
}

/// Sweep `op` over `a.sizes`, calling `tick` after each size; every rank returns the same rows.
pub fn sweep(
    comm: &Communicator,
    op: Collective,
    a: &SweepArgs,
    model: Model,
    transport: &str,
    tick: &mut dyn FnMut(),
) -> Result<Vec<Row>> {
    macro_rules! go {
        ($t:ty) => {
            sweep_typed::<$t>(comm, op, a, model, transport, tick)
        };
    }
    match a.dtype {
        DType::F32 => go!(f32),
        DType::F64 => go!(f64),
        DType::F16 => go!(half::f16),
        DType::BF16 => go!(half::bf16),
        DType::I32 => go!(i32),
        DType::I64 => go!(i64),
        DType::U8 => go!(u8),
    }
}

fn sweep_typed<T: Element>(
    comm: &Communicator,
    op: Collective,
    a: &SweepArgs,
    model: Model,
    transport: &str,
    tick: &mut dyn FnMut(),
) -> Result<Vec<Row>> {
    let n = comm.size();
    let mut rows = Vec::new();
    let own = [comm.config().algo];
    let shm = comm.ring_on_shm();
    let compares = doubling::has_schedule(op) || op == Collective::AllGatherV;
    let choices = if a.algos.is_empty() || !compares {
        &own[..]
    } else {
        &a.algos[..]
    };
    for &size in &a.sizes {
        let count = exact::round_count(op, n, size / T::DTYPE.size());
        let bytes = count * T::DTYPE.size();
        // Each choice in turn at this size (so a slow patch of the machine hits them alike),
        // once for each schedule they come to.
        let mut ran = Vec::new();
        for &choice in choices {
            let choice_of = (choice, comm.single_copy_sizes());
            let algo = theory::runs(choice_of, op, bytes, (n, comm.nodes(), shm));
            if ran.contains(&algo) {
                continue;
            }
            ran.push(algo);
            // Send/recv has no in-place form: its column is n/a.
            for inplace in [false, true]
                .into_iter()
                .filter(|&i| !i || has_in_place(op))
            {
                rows.push(size_row::<T>(
                    comm,
                    (op, choice, algo),
                    a,
                    (count, bytes, inplace),
                    model,
                    transport,
                )?);
            }
        }
        tick();
    }
    Ok(rows)
}

/// One row: `op` of `count` elements by `choice` (which runs `algo` at this size), checked, then
/// timed.
fn size_row<T: Element>(
    comm: &Communicator,
    (op, choice, algo): (Collective, ringzero_collectives::Algo, Algo),
    a: &SweepArgs,
    (count, bytes, inplace): (usize, usize, bool),
    model: Model,
    transport: &str,
) -> Result<Row> {
    let n = comm.size();
    let wrong = check::<T>(comm, (op, choice), a, count, inplace)?;
    let mut bufs = Buffers::<T>::new(comm, op, count, a.shared_buffers)?;
    let call = || bufs.call(comm, (op, choice), a.redop, inplace);
    let (time_us, wrong, model) = if a.model_per_row && n > 1 {
        let link = theory::bytes_per_link(op, algo, n, bytes) as usize;
        let relays = theory::relays_copy(transport);
        let local = theory::local_copy_bytes(op, algo, n, (bytes, inplace), relays) as usize;
        let streams = if algo == Algo::SingleCopy {
            Streams::PeerCopy
        } else if op.root().is_some() {
            Streams::Chain
        } else {
            Streams::Ring
        };
        let shape = Shape {
            link_bytes: link,
            call_bytes: bytes,
            fresh_share: theory::in_place_fresh_share(op),
        };
        // Where the call's local copies re-read what its link copy just read, their stand-in
        // copies from a source in cache, a slice at a time (only the writes reach memory).
        let local = (
            local,
            theory::local_copy_rereads(op, algo).then_some(comm.config().slice_bytes),
        );
        timed_with_model(comm, a, wrong, (shape, streams, local), inplace, call)?
    } else {
        let (t, w) = timed(comm, a, wrong, call)?;
        (t, w, (model, None))
    };
    let (model, swing) = model;
    let mut row = row(
        (op, algo),
        a,
        &comm.ranks_per_node(),
        bytes,
        count,
        transport,
        time_us,
        wrong,
        inplace,
        Some(model),
    );
    (row.stream_swing, row.call_swing) = swing.map_or((None, None), |(s, c)| (Some(s), Some(c)));
    Ok(row)
}

/// Whether `op` has an in-place form to sweep.
pub fn has_in_place(op: Collective) -> bool {
    op != Collective::SendRecv && !op.is_pairwise()
}

/// Time `call` on every rank: warm-up calls, a barrier, timed calls. Returns the mean over ranks of
/// each rank's mean time per call (µs) and `wrong` summed over ranks.
pub fn timed(
    comm: &Communicator,
    a: &SweepArgs,
    wrong: u64,
    mut call: impl FnMut() -> Result<()>,
) -> Result<(f64, u64)> {
    for _ in 0..a.warmup {
        call()?;
    }
    let iters = a.iters.max(1);
    let mine = group(comm, iters, &mut call)? * 1e6 / iters as f64;
    over_ranks(comm, mine, wrong)
}

/// After a barrier, the seconds `k` calls of `f` take on this rank.
fn group(comm: &Communicator, k: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    comm.barrier()?;
    let t = Instant::now();
    for _ in 0..k {
        f()?;
    }
    Ok(t.elapsed().as_secs_f64())
}

/// This rank's mean time per call (µs) averaged over ranks, and `wrong` summed over ranks.
fn over_ranks(comm: &Communicator, mine_us: f64, wrong: u64) -> Result<(f64, u64)> {
    let mut time = vec![mine_us];
    comm.all_reduce(InPlace, &mut time, ReduceOp::Avg)?;
    let mut w = vec![wrong as i64];
    comm.all_reduce(InPlace, &mut w, ReduceOp::Sum)?;
    Ok((time[0], w[0] as u64))
}

/// Which links carry [`timed_with_model`]'s β streams: the links a collective loads, in the
/// directions it loads them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Streams {
    /// Every rank to the next at once, every link both ways (as the ring collectives load them).
    Ring,
    /// Rank r to r + 1 for r < n − 1, each link one way and the last rank's outgoing one idle:
    /// what a rooted collective's chain (broadcast, reduce) or pairs (gather, scatter) load.
    /// A stream both ways would halve β where both directions share the cores or the memory
    /// (shared memory, loopback tcp) and the model would then sit far below a rooted call.
    Chain,
    /// Every rank reads the bytes straight out of the previous rank's buffer, all at once, by
    /// the single-copy all-gather's own copy (`process_vm_readv`), and out of place also copies
    /// its own part as the call does: the call's copies without its protocol. No hand-off, so β
    /// is the bytes read over the copies' whole time.
    PeerCopy,
}

/// What a row's β streams carry and how they meet memory, as its call does.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// The bytes one link carries in one call: each stream's size.
    pub link_bytes: usize,
    /// The call's buffer: the streams sweep windows along buffers this large.
    pub call_bytes: usize,
    /// In place, the share of streams that receive into the window after the one they send
    /// ([`theory::in_place_fresh_share`]).
    pub fresh_share: f64,
}

/// Calls per group in [`timed_with_model`].
pub const GROUP: usize = 5;

/// A row's model and, where it was measured beside the calls, how far its streams and its
/// calls swung ([`Row::stream_swing`], [`Row::call_swing`]).
pub type RowModel = (Model, Option<(f64, f64)>);

/// [`timed`], with the model measured in the same seconds as the calls: the timed iterations run
/// in groups of up to five, each group followed by as many streams of `link_bytes` (what each
/// link carries in one call) from every rank to the next at once ([`Communicator::ring_shift`](ringzero_collectives::Collectives::ring_shift), in
/// place when the call is, so the working sets match), as many barriers and, where the call
/// copies `local_bytes` within a rank's own memory beside its links, as many plain copies of
/// that many bytes on every rank at once, each part starting after a barrier.
/// α is the mean barrier time / (n − 1); an edge's β is `link_bytes / (stream time − α)`, and the
/// model takes the slowest edge; the copy rate is the slowest rank's. On a shared machine whose
/// memory bandwidth swings within seconds, this keeps the efficiency column a ratio of things
/// measured together.
pub fn timed_with_model(
    comm: &Communicator,
    a: &SweepArgs,
    wrong: u64,
    (shape, streams, (local_bytes, hot_slices)): (Shape, Streams, (usize, Option<usize>)),
    inplace: bool,
    mut call: impl FnMut() -> Result<()>,
) -> Result<(f64, u64, RowModel)> {
    let (n, r) = (comm.size(), comm.rank());
    let Shape {
        link_bytes,
        call_bytes,
        fresh_share,
    } = shape;
    let single_copy = streams == Streams::PeerCopy;
    // The link streams sweep buffers as large as the call's, a window of `link_bytes` further
    // on each time, so the call and its streams meet the caches alike: streams repeating one
    // window half the call's size stay cached at sizes where the call's own buffers no longer do.
    // In place, a share of them (`fresh_share`, as the call does) receive into the window after
    // the one they send, in the same buffer, and the rest into the window they send.
    let span = if single_copy {
        link_bytes.max(1)
    } else {
        call_bytes.max(link_bytes).max(1)
    };
    let mut window = windows(link_bytes.max(1), span);
    let mut stream_count = 0usize;
    let shared = if single_copy && a.shared_buffers {
        let mut b = SharedBuf::<u8>::zeroed(link_bytes.max(1))?;
        b.fill(1);
        Some(b)
    } else {
        None
    };
    let (fd, ino) = shared.as_ref().map_or((-1, 0), SharedBuf::locator);
    let mut send: Box<dyn DerefMut<Target = [u8]>> = match shared {
        Some(b) => Box::new(b),
        // In place, each stream receives into the window after the one it sends (below).
        None if inplace && streams == Streams::Ring => {
            Box::new(vec![1u8; span + link_bytes.max(1)])
        }
        None => Box::new(vec![1u8; span]),
    };
    let mut recv = vec![
        0u8;
        if inplace && streams == Streams::Ring {
            0
        } else {
            span
        }
    ];
    let mut own = vec![
        0u8;
        if single_copy {
            link_bytes / (n - 1).max(1)
        } else {
            0
        }
    ];
    // Where the previous rank's `send` is: the single-copy streams read it out of its process,
    // or, from shared buffers, through a mapping of it kept for the whole line.
    let prev = if single_copy {
        let at = send.as_ptr() as u64;
        let mine = [
            i64::from(std::process::id()),
            at as i64,
            fd.into(),
            ino as i64,
        ];
        let mut all = vec![0i64; 4 * n];
        comm.all_gather(&mine[..], &mut all)?;
        let p = 4 * ((r + n - 1) % n);
        (
            all[p] as u32,
            all[p + 1] as u64,
            (all[p + 2], all[p + 3] as u64),
        )
    } else {
        (0, 0, (-1, 0))
    };
    let mapped = match prev {
        (pid, _, (fd, ino)) if fd >= 0 => Some(
            memfd::PeerSegment::open(pid, fd as i32, ino, link_bytes.max(1)).map_err(|e| {
                ringzero_collectives::Error::io("mapping a peer's shared buffer", e)
            })?,
        ),
        _ => None,
    };
    let mut stream = || match streams {
        Streams::PeerCopy => {
            // Out of place the call also copies this rank's own part (1/(n−1) of what it reads).
            if !inplace {
                let k = own.len();
                own.copy_from_slice(std::hint::black_box(&send[..k]));
            }
            if let Some(m) = &mapped {
                // Its owner does not write it while the streams run.
                let src = &m.bytes()[..link_bytes];
                recv[..link_bytes].copy_from_slice(std::hint::black_box(src));
                return Ok(());
            }
            // Every rank's `send` outlives its reads: a barrier follows the streams before any
            // rank leaves (and a read of memory gone would fail, not read it).
            cma::read(prev.0, prev.1, &mut recv[..link_bytes])
                .map_err(|e| ringzero_collectives::Error::io("a single-copy β stream", e))
        }
        // An in-place all-gather sends from its buffer and stores what it receives elsewhere in
        // it, into lines it has not just read, where a ring shift in place overwrites the very
        // lines it sent, found in cache ([`theory::in_place_fresh_share`]).
        Streams::Ring if inplace => {
            let w = window();
            let i = stream_count as f64;
            stream_count += 1;
            if ((i + 1.0) * fresh_share).floor() > (i * fresh_share).floor() {
                let (sent, rest) = send.split_at_mut(w.end);
                comm.ring_shift(&sent[w.clone()], &mut rest[..w.len()])
            } else {
                comm.ring_shift(InPlace, &mut send[w])
            }
        }
        Streams::Ring => {
            let w = window();
            comm.ring_shift(&send[w.clone()], &mut recv[w])
        }
        Streams::Chain => {
            let w = window();
            let mut msgs = Vec::with_capacity(2);
            if r + 1 < n {
                msgs.push(P2p::Send(&send[w.clone()], r + 1));
            }
            if r > 0 {
                msgs.push(P2p::Recv(&mut recv[w], r - 1));
            }
            comm.send_recv_batch(&mut msgs)
        }
    };
    for _ in 0..a.warmup {
        call()?;
    }
    stream()?;
    // The local copies' stand-in: the same bytes from one buffer of this rank's to another, or,
    // where the call re-reads its slices (`hot_slices`), each slice of the destination from one
    // slice-sized source that stays in cache.
    let hot = hot_slices.map(|s| s.clamp(1, local_bytes.max(1)));
    let (from, mut to) = (
        vec![1u8; hot.unwrap_or(local_bytes)],
        vec![0u8; local_bytes],
    );
    let mut copy = || {
        for slice in to.chunks_mut(from.len().max(1)) {
            let k = slice.len();
            slice.copy_from_slice(std::hint::black_box(&from[..k]));
        }
        std::hint::black_box(&to);
        Ok(())
    };
    if local_bytes > 0 {
        copy()?;
    }
    // Each group's time per call, per stream, per barrier and per copy, in µs: the calls' mean
    // is the row's time (nccl-tests' mean); the model takes the median group of each of the
    // others, so one stall of the machine in a stream group (a descheduled rank) does not
    // become the row's β; the spread of the streams' groups is the noise the row's timing
    // carries, and the spread of the calls' groups is the calls' own.
    let (mut calls, mut streams, mut barriers, mut copies) = (0.0f64, vec![], vec![], vec![]);
    let (mut quickest, mut slowest_call) = (f64::INFINITY, 0.0f64);
    let iters = a.iters.max(1);
    let mut left = iters;
    while left > 0 {
        let k = left.min(GROUP);
        left -= k;
        let per_call = |secs: f64| secs * 1e6 / k as f64;
        let c = group(comm, k, &mut call)?;
        calls += c;
        (quickest, slowest_call) = (quickest.min(per_call(c)), slowest_call.max(per_call(c)));
        streams.push(per_call(group(comm, k, &mut stream)?));
        // α is one ring step: the ring's barrier, whatever RINGZERO_ALGO picks for barriers.
        barriers.push(per_call(group(comm, k, &mut || {
            comm.with_algo(ringzero_collectives::Algo::Ring).barrier()
        })?));
        if local_bytes > 0 {
            copies.push(per_call(group(comm, k, &mut copy)?));
        }
    }
    // α averaged over ranks; β the slowest edge's.
    let mut alpha = vec![median(&barriers) / (n - 1).max(1) as f64];
    comm.all_reduce(InPlace, &mut alpha, ReduceOp::Avg)?;
    let alpha_us = alpha[0];
    let stream_us = median(&streams);
    let streamed = link_bytes.max(1) as f64;
    let hand_off = if single_copy { 0.0 } else { alpha_us };
    let mut beta = vec![streamed / ((stream_us - hand_off).max(stream_us * 0.5) * 1e3)];
    comm.all_reduce(InPlace, &mut beta, ReduceOp::Min)?;
    let copy_gbs = if local_bytes > 0 {
        let mut rate = vec![local_bytes as f64 / (median(&copies).max(1e-3) * 1e3)];
        comm.all_reduce(InPlace, &mut rate, ReduceOp::Min)?;
        Some(rate[0])
    } else {
        None
    };
    let spread = |lo: f64, hi: f64| if lo > 0.0 { hi / lo } else { 1.0 };
    let (fastest, slowest) = streams
        .iter()
        .fold((f64::INFINITY, 0.0f64), |(lo, hi), &t| {
            (lo.min(t), hi.max(t))
        });
    let mut swing = vec![spread(fastest, slowest), spread(quickest, slowest_call)];
    comm.all_reduce(InPlace, &mut swing, ReduceOp::Max)?;
    let (time_us, wrong) = over_ranks(comm, calls * 1e6 / iters as f64, wrong)?;
    let model = Model {
        copy_gbs,
        ..Model::links(alpha_us, beta[0])
    };
    Ok((time_us, wrong, (model, Some((swing[0], swing[1])))))
}

/// Windows of `len` bytes one after the other along a buffer of `span` (≥ `len`), back to the
/// start where the next would not fit.
fn windows(len: usize, span: usize) -> impl FnMut() -> std::ops::Range<usize> {
    let mut at = 0;
    move || {
        let w = at..at + len;
        at = if w.end + len > span { 0 } else { w.end };
        w
    }
}

/// The median of `xs` (the mean of the middle two when their count is even); 0 when empty.
fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        k if k % 2 == 1 => v[k / 2],
        k => (v[k / 2 - 1] + v[k / 2]) / 2.0,
    }
}

/// One report line; the α–β columns when a `model` applies to these buffers.
#[allow(clippy::too_many_arguments)]
pub fn row(
    (op, algo): (Collective, Algo),
    a: &SweepArgs,
    per_node: &[usize],
    bytes: usize,
    count: usize,
    transport: &str,
    time_us: f64,
    wrong: u64,
    inplace: bool,
    model: Option<Model>,
) -> Row {
    let n: usize = per_node.iter().sum();
    let relays_copy = theory::relays_copy(transport);
    let model = model.map(|m| Model { relays_copy, ..m });
    let predicted_us =
        model.and_then(|m| theory::predict_us_on(op, algo, per_node, (bytes, inplace), m));
    let model = model.filter(|_| predicted_us.is_some());
    let local = theory::local_copy_bytes(op, algo, n, (bytes, inplace), relays_copy) > 0.0;
    Row {
        op: op.name().to_string(),
        bytes,
        count,
        dtype: a.dtype.to_string(),
        redop: if op.reduces() {
            a.redop.to_string()
        } else {
            "-".into()
        },
        ranks: n,
        transport: transport.to_string(),
        time_us,
        algbw_gbs: theory::algbw_gbs(bytes, time_us),
        busbw_gbs: theory::busbw_gbs(op, n, bytes, time_us),
        wrong,
        inplace,
        alpha_us: model.map(|m| m.alpha_us),
        beta_gbs: model.map(|m| m.beta_gbs),
        copy_gbs: model.and_then(|m| m.copy_gbs).filter(|_| local),
        stream_swing: None,
        call_swing: None,
        predicted_us,
        efficiency: theory::efficiency(predicted_us, time_us),
        algo: algo.name().into(),
    }
}

/// The buffers of one timed collective (contents irrelevant, but written: a buffer of zeros
/// fresh from the allocator maps the kernel's shared zero page until written, and a call
/// reading it — the single-copy all-gather reads the other ranks' `recv` in place — would time
/// reads of one cached page).
struct Buffers<T> {
    send: Box<dyn DerefMut<Target = [T]>>,
    recv: Box<dyn DerefMut<Target = [T]>>,
}

impl<T: Element> Buffers<T> {
    /// The buffers of `op` on `count` elements, in shared memory where `shared`.
    fn new(comm: &Communicator, op: Collective, count: usize, shared: bool) -> Result<Buffers<T>> {
        let (s, r) = exact::lens(op, comm.size(), comm.rank(), count);
        Buffers::holding(vec![T::from_f64(1.0); s], vec![T::from_f64(3.0); r], shared)
    }

    /// Buffers holding `send` and `recv`: those vectors, or copies of them in shared memory.
    fn holding(send: Vec<T>, recv: Vec<T>, shared: bool) -> Result<Buffers<T>> {
        let hold = |v: Vec<T>| -> Result<Box<dyn DerefMut<Target = [T]>>> {
            if !shared {
                return Ok(Box::new(v));
            }
            let mut b = SharedBuf::<T>::zeroed(v.len())?;
            b.copy_from_slice(&v);
            Ok(Box::new(b))
        };
        Ok(Buffers {
            send: hold(send)?,
            recv: hold(recv)?,
        })
    }

    fn call(
        &mut self,
        comm: &Communicator,
        (op, algo): (Collective, ringzero_collectives::Algo),
        redop: ReduceOp,
        inplace: bool,
    ) -> Result<()> {
        run(
            comm,
            (op, algo),
            redop,
            inplace,
            &mut self.send,
            &mut self.recv,
        )
    }
}

/// One call of `op` by `algo` (where `op` has more than one algorithm); in place it works on
/// `send` (which must then hold the whole buffer).
fn run<T: Element>(
    comm: &Communicator,
    (op, algo): (Collective, ringzero_collectives::Algo),
    redop: ReduceOp,
    inplace: bool,
    send: &mut [T],
    recv: &mut [T],
) -> Result<()> {
    match (op, inplace) {
        (Collective::AllReduce, false) => comm.with_algo(algo).all_reduce(send, recv, redop),
        (Collective::AllReduce, true) => comm.with_algo(algo).all_reduce(InPlace, send, redop),
        (Collective::ReduceScatter, false) => comm.reduce_scatter(send, recv, redop),
        (Collective::ReduceScatter, true) => comm.reduce_scatter(InPlace, send, redop),
        (Collective::AllGather, false) => comm.all_gather(send, recv),
        (Collective::AllGather, true) => comm.all_gather(InPlace, recv),
        (Collective::Broadcast { root }, false) => comm.with_algo(algo).broadcast(send, recv, root),
        (Collective::Broadcast { root }, true) => {
            comm.with_algo(algo).broadcast(InPlace, send, root)
        }
        (Collective::Reduce { root }, false) => {
            comm.with_algo(algo).reduce(send, recv, redop, root)
        }
        (Collective::Reduce { root }, true) => {
            comm.with_algo(algo).reduce(InPlace, send, redop, root)
        }
        (Collective::Barrier, _) => comm.with_algo(algo).barrier(),
        (Collective::RingShift, false) => comm.ring_shift(send, recv),
        (Collective::RingShift, true) => comm.ring_shift(InPlace, send),
        (Collective::AllToAll, false) => comm.all_to_all(send, recv),
        (Collective::AllToAll, true) => comm.all_to_all(InPlace, send),
        (Collective::SendRecv, false) => match exact::partner(comm.rank(), comm.size()) {
            None => Ok(()),
            Some(peer) => comm.send_recv(send, recv, peer),
        },
        (Collective::AllToAllV, false) => {
            let counts = vec![send.len() / comm.size(); comm.size()];
            comm.all_to_all_v(send, &counts, recv, &counts)
        }
        (Collective::AllGatherV, false) => {
            let counts = balanced(comm.size(), recv.len());
            comm.with_algo(algo).all_gather_v(send, recv, &counts)
        }
        (Collective::AllGatherV, true) => {
            let counts = balanced(comm.size(), recv.len());
            comm.with_algo(algo).all_gather_v(InPlace, recv, &counts)
        }
        (Collective::ReduceScatterV, false) => {
            let counts = balanced(comm.size(), send.len());
            comm.reduce_scatter_v(send, recv, &counts, redop)
        }
        (Collective::ReduceScatterV, true) => {
            let counts = balanced(comm.size(), send.len());
            comm.reduce_scatter_v(InPlace, send, &counts, redop)
        }
        (Collective::Gather { root }, false) => comm.gather(send, recv, root),
        (Collective::Scatter { root }, false) => comm.scatter(send, recv, root),
        (
            Collective::SendRecv
            | Collective::AllToAllV
            | Collective::Gather { .. }
            | Collective::Scatter { .. },
            true,
        ) => Err(ringzero_collectives::Error::InvalidArgument {
            op: op.name().into(),
            msg: format!("{} has no in-place form", op.name()),
        }),
    }
}

/// The ring forms' balanced chunks of `count` as the counts of a `-v` form.
pub fn balanced(n: usize, count: usize) -> Vec<usize> {
    (0..n).map(|q| chunk(count, n, q).len()).collect()
}

/// One untimed call on exact inputs; returns how many elements of this rank's result are wrong.
fn check<T: Element>(
    comm: &Communicator,
    (op, algo): (Collective, ringzero_collectives::Algo),
    a: &SweepArgs,
    count: usize,
    inplace: bool,
) -> Result<u64> {
    let (r, n) = (comm.rank(), comm.size());
    let (dt, redop, seed) = (T::DTYPE, a.redop, count % 97);
    let mine = |i: usize| exact::value(dt, redop, r, i, seed);
    // Outputs start as poison so a result that never arrives counts as wrong.
    let (send, recv) = exact::inputs(op, inplace, n, r, count, mine);
    let typed = |v: Vec<f64>| v.into_iter().map(T::from_f64).collect::<Vec<T>>();
    let mut b = Buffers::holding(typed(send), typed(recv), a.shared_buffers)?;
    b.call(comm, (op, algo), redop, inplace)?;
    let Some((lands, range, want)) = exact::landing(op, inplace, n, r, count, (dt, redop, seed))
    else {
        return Ok(0);
    };
    let mut got: Vec<f64> = match lands {
        exact::Lands::Send => &b.send[range],
        exact::Lands::Recv => &b.recv[range],
    }
    .iter()
    .map(|x| x.to_f64())
    .collect();
    Ok(wrong(a, r, &mut got, &want))
}

/// How many of `got` differ from `want` (NaN equals NaN); the bench's own `--corrupt-rank` test
/// hook spoils one element first.
pub fn wrong(a: &SweepArgs, r: usize, got: &mut [f64], want: &[f64]) -> u64 {
    if a.corrupt_rank == Some(r) {
        if let Some(x) = got.first_mut() {
            *x += 1.0;
        }
    }
    got.iter()
        .zip(want)
        .filter(|(g, w)| **g != **w && !(g.is_nan() && w.is_nan()))
        .count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_windows_sweep_the_span_and_wrap() {
        let mut w = windows(4, 10);
        let got: Vec<_> = (0..4).map(|_| w()).collect();
        assert_eq!(got, [0..4, 4..8, 0..4, 4..8]);
        let mut whole = windows(6, 6);
        assert_eq!((whole(), whole()), (0..6, 0..6));
    }

    #[test]
    fn a_stalled_group_does_not_move_the_median() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[2.0, 2.2, 1.8, 4000.0]), 2.1);
        assert_eq!(median(&[]), 0.0);
    }
}
