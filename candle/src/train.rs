//! The data-parallel training loop of [`crate::gpt`] on the generated [`crate::corpus`]: each
//! rank draws its part of every global batch, the engine averages the gradients and steps, and
//! the loss reported is the global batch's (the mean over ranks). `ringzero train` runs it.

use std::path::PathBuf;
use std::time::Instant;

use candle_core::Device;
use ringzero_collectives::{
    Collectives, Communicator, HostStream, InPlace, ReduceOp, TransportKind,
};
use ringzero_kernels::cpu::Float;
use ringzero_zero::{Memory, StepOutcome, StepReport, ZeroConfig};

use crate::corpus::Corpus;
use crate::gpt::{self, GptConfig};
use crate::memory::{self, Footprint};
use crate::stream::CandleStream;
use crate::{Error, Result, Zero};

/// What to train and for how long.
#[derive(Clone, Debug)]
pub struct TrainArgs {
    /// The model's shape (its `vocab` is the corpus's).
    pub model: GptConfig,
    /// Optimizer steps.
    pub steps: usize,
    /// Sequences per rank and micro-step.
    pub batch: usize,
    /// The corpus's and the initial weights' seed.
    pub seed: u64,
    /// Bytes of generated text.
    pub corpus_bytes: usize,
    /// Where candle runs forward and backward (the variables, gradients and activations live
    /// there) and the engine keeps the model states (unless the config offloads them): the
    /// host, or with the `cuda` feature a GPU.
    pub device: Device,
    /// A checkpoint to start from (saved by [`TrainArgs::save`] at any world size, stage or
    /// precision): its weights and optimizer state, and the step to go on from (so the data
    /// goes on where it stopped).
    pub resume: Option<PathBuf>,
    /// Where to save a checkpoint after the last step (a directory; every rank writes its
    /// shard).
    pub save: Option<PathBuf>,
}

impl Default for TrainArgs {
    fn default() -> Self {
        TrainArgs {
            model: GptConfig::tiny(0),
            steps: 200,
            batch: 8,
            seed: 1,
            corpus_bytes: 1 << 20,
            device: Device::Cpu,
            resume: None,
            save: None,
        }
    }
}

/// One optimizer step, as the loop reports it.
#[derive(Clone, Copy, Debug)]
pub struct StepLog {
    /// The step, from 0 (from the checkpoint's next step when resumed).
    pub step: usize,
    /// The global batch's mean loss (every rank's, averaged), before the step.
    pub loss: f32,
    /// What the engine did.
    pub outcome: StepOutcome,
}

/// What a run did.
#[derive(Clone, Debug)]
pub struct TrainReport {
    /// The global batch's loss at each step.
    pub losses: Vec<f32>,
    /// Tokens trained on, over all ranks.
    pub tokens: u64,
    /// Seconds the loop took on this rank.
    pub seconds: f64,
    /// This rank's engine memory at the end.
    pub memory: Memory,
    /// The model's parameters.
    pub params: usize,
    /// What this rank holds while training, by category ([`Footprint`]), predicted: its
    /// communication buffers from the trainer's calls replayed
    /// ([`memory::comm_buffers_peak_for`]).
    pub footprint: Footprint,
    /// The engine's own count of its communication buffers at their peak (what the footprint
    /// predicts).
    pub comm_buffers_counted: usize,
    /// Resident memory this rank's training added at its peak: `VmHWM` at the end over `VmRSS`
    /// before the model was built (Linux; `None` elsewhere). It is the process's: ranks run as
    /// threads of one process (as tests do) share one figure.
    pub measured_peak: Option<usize>,
    /// On a CUDA device: the driver's figure for this process (`nvidia-smi`'s used memory),
    /// before the model was built and at its largest when sampled right after backward (where
    /// the variables, gradients and activations are all alive) on the first two steps and the
    /// last; `None` on the CPU or where the driver cannot say.
    pub device_measured: Option<(usize, usize)>,
    /// On a CUDA device: the most candle's tensors held at once, and the most the device
    /// memory pool they come from reserved, from the pool's high-water marks (restarted before
    /// the model was built).
    pub device_pool_peak: Option<memory::PoolPeak>,
    /// On a CUDA device: the most device memory ringzero's own allocations held at once (the
    /// engine's model states and buffers, its communicator's slots and scratch), and the most
    /// of the other ranks' memory mapped into this process at once (a direct collective's CUDA
    /// IPC view of their buffers), counted from before the model was built.
    pub device_engine_peak: Option<(usize, usize)>,
    /// With the engine on the host stream: the most the stream's allocations (the engine's
    /// "device" buffers) held at once, measured as they were made and dropped, from before
    /// the model was built.
    pub host_stream_peak: Option<usize>,
    /// The engine's own count of its model states and communication buffers at their peak
    /// (what `host_stream_peak` measures, on the host stream).
    pub engine_counted_peak: usize,
    /// The engine's report of the last optimizer step on this rank: its wall time, the time in
    /// the step, and with offload the CPU step, the device's wait and the bytes each way.
    pub last_step: Option<StepReport>,
}

/// Train on this rank of `comm` with `cfg` (stage, precision as `T`, optimizer, schedule,
/// accumulation, clipping), calling `log` after every optimizer step. The engine runs where
/// [`TrainArgs::device`] is: on the host stream for the CPU, on the GPU's stream for a CUDA
/// device (the `cuda` feature).
pub fn train<T: Float>(
    comm: &Communicator,
    cfg: ZeroConfig,
    args: &TrainArgs,
    log: impl FnMut(&StepLog),
) -> Result<TrainReport> {
    match &args.device {
        Device::Cpu => train_on::<T, HostStream>(comm, HostStream::new(), cfg, args, log),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let candle_core::DeviceLocation::Cuda { gpu_id } = args.device.location() else {
                unreachable!("a CUDA device's location is a GPU")
            };
            let gpu = ringzero_kernels::device::cuda::Gpu::open(gpu_id).map_err(|e| {
                Error::Invalid(format!("opening cuda:{gpu_id} for the engine: {e}"))
            })?;
            train_on::<T, _>(comm, gpu, cfg, args, log)
        }
        other => Err(Error::Invalid(format!(
            "training on {other:?}: this build trains on the CPU{}",
            if cfg!(feature = "cuda") {
                " and on CUDA devices"
            } else {
                " (CUDA devices need the `cuda` feature)"
            }
        ))),
    }
}

/// [`train`] with the engine on `stream`.
fn train_on<T: Float, S: CandleStream>(
    comm: &Communicator,
    stream: S,
    cfg: ZeroConfig,
    args: &TrainArgs,
    mut log: impl FnMut(&StepLog),
) -> Result<TrainReport> {
    if args.batch == 0 || args.steps == 0 {
        return Err(Error::Invalid(format!(
            "batch {} and steps {} must both be at least 1",
            args.batch, args.steps
        )));
    }
    // The accumulation a config derives from its batch sizes, for the loop and the prediction.
    let cfg = cfg.for_world(comm.size())?;
    let dev = args.device.clone();
    let corpus = Corpus::generate(args.corpus_bytes, args.seed);
    let shape = GptConfig {
        vocab: corpus.vocab(),
        ..args.model
    };
    let ordinal = match dev.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => Some(gpu_id),
        _ => None,
    };
    if let Some(o) = ordinal {
        warm_up(&shape, &corpus, args.seed, &dev)?;
        memory::trim_pool(o);
    }
    // The peak from here on is what training adds (the corpus and communicator exist already).
    let before = memory::reset_peak()
        .then(memory::rss)
        .flatten()
        .map(|(rss, _)| rss);
    let device_before = if dev.is_cuda() {
        memory::device_used()
    } else {
        None
    };
    let mut device_peak = device_before;
    if let Some(o) = ordinal {
        // The driver's figure after backward then holds the step's peak, not what is left once
        // the pool has handed freed memory back at a synchronisation.
        memory::keep_pool(o);
        memory::pool_peak(o, true);
        memory::ringzero_device_peak(true);
    }
    // On the host stream the engine's "device" buffers are the stream's scratch, counted as
    // they are made and dropped: the measurement its own count of them is checked against.
    ringzero_kernels::device::reset_host_scratch_peak();
    let scratch_before = ringzero_kernels::device::host_scratch().live;
    let comm_predicted = memory::comm_buffers_peak_for(&shape, &cfg, comm.size(), args.steps)?;
    let (model, varmap) = gpt::build(shape, args.seed, &dev)?;
    let accum = cfg.accumulation_steps.max(1);
    let mut zero = Zero::<T, S>::on(comm, stream, &varmap, cfg)?;
    let first_step = match &args.resume {
        Some(dir) => next_step(&zero.load_checkpoint(dir)?, dir)?,
        None => 0,
    };
    let (world, rank, batch) = (comm.size(), comm.rank(), args.batch);
    let mut losses = Vec::with_capacity(args.steps);
    let start = Instant::now();
    for step in first_step..first_step + args.steps {
        let mut sum = 0f32;
        for micro in 0..accum {
            let first = ((step * accum + micro) * world + rank) * batch;
            let ids: Vec<u64> = (first..first + batch).map(|g| g as u64).collect();
            let (x, y) = corpus.batch(&ids, shape.ctx, &dev)?;
            // Stage 3: each module's parameters gathered as it runs (the engine prefetches the
            // next); stages 0–2: every parameter loaded at the first module after a step.
            let loss = model.loss_with(&x, &y, &mut zero.hook())?;
            sum += gpt::scalar(&loss)?;
            let scaled = zero.scaled(&loss)?;
            zero.backward(&scaled)?;
            let nth = step - first_step;
            if device_before.is_some() && (nth < 2 || nth + 1 == args.steps) && micro == 0 {
                dev.synchronize()?;
                device_peak = device_peak.max(memory::device_used());
            }
            let outcome = zero.step()?;
            if micro + 1 == accum {
                let mut mean = [sum / accum as f32];
                comm.all_reduce(InPlace, &mut mean[..], ReduceOp::Sum)?;
                let loss = mean[0] / world as f32;
                losses.push(loss);
                log(&StepLog {
                    step,
                    loss,
                    outcome,
                });
            }
        }
    }
    // A delayed parameter update still in flight lands (nothing happens without one).
    zero.engine_mut().flush()?;
    let seconds = start.elapsed().as_secs_f64();
    let tokens = (args.steps * accum * world * batch * shape.ctx) as u64;
    let measured_peak = before
        .zip(memory::rss())
        .map(|(b, (_, hwm))| hwm.saturating_sub(b));
    if let Some(dir) = &args.save {
        let next = first_step + args.steps;
        zero.save_checkpoint(dir, serde_json::json!({ NEXT_STEP: next }))?;
    }
    let slots = if world > 1 {
        (comm.config().slots, comm.config().slice_bytes)
    } else {
        (0, 0)
    };
    // The offload tier's host memory is this process's memory too.
    let m = zero.memory();
    let comm_peak = m.comm_buffers_peak;
    let engine = (m.model_states() + m.host(), comm_predicted);
    let mut footprint = Footprint::of(&shape, batch, engine, slots);
    if !zero.engine().stream().host_addressable() {
        let dc = zero.engine().comm();
        let staged = dc.edges().iter().any(|e| e.kind != TransportKind::CudaIpc);
        footprint = footprint.on_gpu(m.model_states() + comm_predicted, dc.device_bytes(), staged);
    }
    Ok(TrainReport {
        losses,
        tokens,
        seconds,
        memory: zero.memory(),
        params: shape.params(),
        footprint,
        comm_buffers_counted: comm_peak,
        measured_peak,
        device_measured: device_before.zip(device_peak),
        device_pool_peak: ordinal.and_then(|o| memory::pool_peak(o, false)),
        device_engine_peak: ordinal.and_then(|_| memory::ringzero_device_peak(false)),
        host_stream_peak: zero.engine().stream().host_addressable().then(|| {
            ringzero_kernels::device::host_scratch()
                .peak
                .saturating_sub(scratch_before)
        }),
        engine_counted_peak: m.model_states() + comm_peak,
        last_step: zero.engine().report(),
    })
}

/// The client-state key of the step a saved run goes on from.
const NEXT_STEP: &str = "next_step";

/// The step a checkpoint's run goes on from.
fn next_step(client_state: &serde_json::Value, dir: &std::path::Path) -> Result<usize> {
    client_state
        .get(NEXT_STEP)
        .and_then(serde_json::Value::as_u64)
        .map(|n| n as usize)
        .ok_or_else(|| {
            Error::Invalid(format!(
                "checkpoint {}: its client state has no `{NEXT_STEP}` (it was not saved by \
                 this training loop); resume from one saved with `save`",
                dir.display()
            ))
        })
}

/// On a GPU, candle's first matmuls and kernels load what any process computing with candle
/// there keeps, whatever the model: cuBLAS's workspaces and the kernels' modules (about 100 MiB
/// on an H100), a fixed cost like the CUDA context's. One forward and backward of a one-block
/// GPT of the run's width on one sequence loads them before the driver's figure is read, so
/// that figure holds them and what training adds is what [`Footprint`] models. Its tensors
/// are freed and the pool then trimmed ([`memory::trim_pool`]), so none of their memory is in
/// the figure.
fn warm_up(shape: &GptConfig, corpus: &Corpus, seed: u64, dev: &Device) -> Result<()> {
    let one = GptConfig {
        layers: 1,
        ..*shape
    };
    let (model, varmap) = gpt::build(one, seed, dev)?;
    let (x, y) = corpus.batch(&[0], shape.ctx, dev)?;
    let grads = model.loss(&x, &y)?.backward()?;
    drop((grads, model, varmap));
    dev.synchronize()?;
    Ok(())
}
