//! [`Zero`]: a candle model's variables under the ZeRO engine.

use candle_core::{DType as CDType, Tensor, Var};
use candle_nn::VarMap;
use ringzero_collectives::{
    Collectives, Communicator, DType, DeviceComm, HostStream, InPlace, ReduceOp,
};
use ringzero_kernels::cpu::Float;
use ringzero_kernels::DevPtr;
use ringzero_zero::{
    check_same_params, Engine, Memory, ParamSpec, Phase, StepOutcome, ZeroConfig, ZeroError,
};

use crate::stream::{CandleStream, Lent};
use crate::{Error, Result};

/// The most bytes of parameters put into candle's variables with one wait
/// ([`CandleStream::tensors_from`]): few waits a step, and a bounded transient copy.
const LOAD_GROUP_BYTES: usize = 64 << 20;

/// A candle model's variables trained by the ZeRO engine (any stage, precision, optimizer and
/// schedule its [`ZeroConfig`] names), its model states in the memory of stream `S`: the host's
/// for CPU tensors ([`Zero::new`]), the GPU's for CUDA tensors ([`Zero::on`] with the `cuda`
/// feature's `Arc<Gpu>`), or host memory again where the config offloads them.
///
/// The engine owns the parameters (in `T`: `f32`, `bf16` or `f16`), gradients, optimizer state
/// and communication; the `Var`s hold the values forward and backward use, in their own dtype
/// (candle computes in it; a 16-bit engine's values arrive rounded to `T`). Each micro-step:
/// forward with [`Zero::hook`] (or [`Zero::load_params`] before it, or [`Zero::load_module`]
/// per module at stage 3), [`Zero::backward`] on the loss, [`Zero::step`] — or, as a loop
/// written for candle's optimizers does it, forward then [`Zero::backward_step`].
///
/// The engine's [`StepReport`](ringzero_zero::StepReport) splits each step's time as a trainer
/// sees it: forward from the first load of the micro-step (the hook's first call, or
/// [`Zero::load_params`]) to [`Zero::backward`], backward from there to [`Zero::step`].
///
/// Variables are ordered by name, digits compared as numbers (`h.2` before `h.10`), the same on
/// every rank. A gradient in `T` enters the engine without a copy (its kernel reads candle's
/// memory); one in another dtype is converted by candle first. A parameter leaves by one copy on
/// the stream into a tensor of candle's, then candle's `Var::set` (the variable's storage is
/// candle's to write).
pub struct Zero<T: Float = f32, S: CandleStream = HostStream> {
    engine: Engine<T, S>,
    vars: Vec<(String, Var)>,
    /// The variables hold every parameter's current value (set by a full load; cleared by a
    /// step that may have changed them, or by lending the engine out).
    fresh: bool,
    /// The engine's forward phase is open (since this micro-step's first load).
    in_forward: bool,
}

impl<T: Float> Zero<T> {
    /// Wrap every variable of `varmap` (build the model through a `VarBuilder` over it first),
    /// the engine on the host. Rank 0's current values become every rank's, as PyTorch's DDP
    /// does at wrap time; every rank must have built the same model (names and shapes; ranks
    /// that did not are refused first, each naming its parameter count or first difference).
    pub fn new(comm: &Communicator, varmap: &VarMap, cfg: ZeroConfig) -> Result<Zero<T>> {
        Zero::on(comm, HostStream::new(), varmap, cfg)
    }

    /// Wrap named variables (see [`Zero::new`]); names must be unique.
    pub fn from_vars(
        comm: &Communicator,
        vars: Vec<(String, Var)>,
        cfg: ZeroConfig,
    ) -> Result<Zero<T>> {
        Zero::on_vars(comm, HostStream::new(), vars, cfg)
    }
}

impl<T: Float, S: CandleStream> Zero<T, S> {
    /// [`Zero::new`] with the engine on `stream` (a device communicator on `comm`'s ranks is made
    /// for it): every variable must live in that stream's memory (checked first). For a model on
    /// `Device::new_cuda(n)`, with the `cuda` feature:
    /// `Zero::<f32, _>::on(&comm, ringzero_kernels::device::cuda::Gpu::open(n)?, &varmap, cfg)`.
    pub fn on(comm: &Communicator, stream: S, varmap: &VarMap, cfg: ZeroConfig) -> Result<Self> {
        let vars = varmap
            .data()
            .lock()
            .map_err(|_| Error::Invalid("the VarMap's lock is poisoned".into()))?
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        Zero::on_vars(comm, stream, vars, cfg)
    }

    /// [`Zero::from_vars`] with the engine on `stream` (see [`Zero::on`]).
    pub fn on_vars(
        comm: &Communicator,
        stream: S,
        mut vars: Vec<(String, Var)>,
        cfg: ZeroConfig,
    ) -> Result<Self> {
        if vars.is_empty() {
            return Err(Error::Invalid(
                "no variables to train: build the model through a VarBuilder over the VarMap \
                 (VarBuilder::from_varmap) before wrapping it"
                    .into(),
            ));
        }
        vars.sort_by_key(|v| natural(&v.0));
        if let Some(w) = vars.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(Error::Invalid(format!(
                "variable {:?} is named twice: give each variable its own name",
                w[0].0
            )));
        }
        for (name, v) in &vars {
            stream
                .check_device(v.device())
                .map_err(|e| Error::Invalid(format!("variable {name:?}: {e}")))?;
        }
        let specs: Vec<ParamSpec> = vars
            .iter()
            .map(|(n, v)| ParamSpec::new(n.clone(), v.dims()))
            .collect();
        // Every rank built the same model, or each learns which variable differs (a broadcast of
        // different lengths would fail as a bare collective mismatch).
        let mut agreed = |d: i64| -> std::result::Result<bool, ZeroError> {
            let (mut hi, mut lo) = ([d], [d]);
            comm.all_reduce(InPlace, &mut hi[..], ReduceOp::Max)?;
            comm.all_reduce(InPlace, &mut lo[..], ReduceOp::Min)?;
            Ok(hi == lo)
        };
        check_same_params(&specs, comm.rank(), &mut agreed)?;
        // Rank 0's values, on every rank, in one broadcast.
        let mut flat = Vec::new();
        for (_, v) in &vars {
            flat.extend(to_f32(v.as_tensor())?);
        }
        comm.broadcast(InPlace, &mut flat[..], 0)?;
        let mut starts = Vec::with_capacity(vars.len());
        let mut at = 0;
        for s in &specs {
            starts.push(at);
            at += s.numel();
        }
        let init = |p: usize, i: usize| flat[starts[p] + i];
        let engine = Engine::<T, S>::on(DeviceComm::new(comm, stream)?, &specs, &init, cfg)?;
        let mut z = Zero {
            engine,
            vars,
            fresh: false,
            in_forward: false,
        };
        z.load_all()?;
        // Those gathers are no part of the training loop's order.
        z.engine.restart_order();
        Ok(z)
    }

    /// The engine: its configuration, memory, report, learning rate, loss scale.
    pub fn engine(&self) -> &Engine<T, S> {
        &self.engine
    }

    /// The engine, to set the learning rate or to prefetch. The variables count as stale
    /// afterwards: the hook at stages 0–2 loads them all again.
    pub fn engine_mut(&mut self) -> &mut Engine<T, S> {
        self.fresh = false;
        &mut self.engine
    }

    /// The variables, by name, in the engine's order.
    pub fn vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// Put the engine's current parameters into every variable (at stage 3 each is gathered,
    /// written and released in turn). Opens the micro-step's forward phase.
    pub fn load_params(&mut self) -> Result<()> {
        self.forward_starts();
        self.load_all()
    }

    /// [`Zero::load_params`] without opening a phase (at wrap time, after a checkpoint).
    fn load_all(&mut self) -> Result<()> {
        if self.engine.config().stage != 3 {
            self.load_where(|_| true)?;
            self.fresh = true;
            return Ok(());
        }
        // Bucket by bucket: never more of the model gathered at once than one bucket (and the
        // buckets persistent parameters keep), as in forward.
        let buckets: Vec<Vec<usize>> = (self.engine.partition().buckets.iter())
            .map(|b| b.params.clone())
            .collect();
        for params in buckets {
            self.load(&params)?;
        }
        self.fresh = true;
        Ok(())
    }

    /// Put the parameters whose names start with `prefix` (a module: `"h.3."`) into their
    /// variables: at stage 3 gathered together (the engine prefetches the next module by the
    /// order of the last step's gathers), written, and released. An error if none match. Opens
    /// the micro-step's forward phase.
    pub fn load_module(&mut self, prefix: &str) -> Result<()> {
        if !self.vars.iter().any(|(n, _)| n.starts_with(prefix)) {
            return Err(Error::Invalid(format!(
                "no variable's name starts with {prefix:?}; the names are {}",
                self.names_hint()
            )));
        }
        self.forward_starts();
        self.load_where(|n| n.starts_with(prefix))
    }

    /// The hook for a model's forward that calls it before each module (as
    /// [`Gpt::forward_with`](crate::gpt::Gpt::forward_with) does), its error handed to candle.
    /// At stage 3: [`Zero::load_module`] of the prefix it is given. At stages 0–2 every
    /// variable stays whole: its first call after an optimizer step is [`Zero::load_params`],
    /// later calls only open the forward phase (inside an accumulation window the variables
    /// are already current). So one training loop serves every stage. A module none of whose
    /// variables this wrapper holds (frozen: left out of [`Zero::from_vars`]) is passed over.
    pub fn hook(&mut self) -> impl FnMut(&str) -> candle_core::Result<()> + '_ {
        |prefix| {
            if self.engine.config().stage == 3 {
                self.forward_starts();
                if self.vars.iter().any(|(n, _)| n.starts_with(prefix)) {
                    self.load_where(|n| n.starts_with(prefix))
                } else {
                    Ok(())
                }
            } else if self.fresh {
                self.forward_starts();
                Ok(())
            } else {
                self.load_params()
            }
            .map_err(candle_core::Error::wrap)
        }
    }

    /// Open the engine's forward phase unless this micro-step's is open already.
    fn forward_starts(&mut self) {
        if !self.in_forward {
            self.engine.phase(Phase::Forward);
            self.in_forward = true;
        }
    }

    fn load_where(&mut self, want: impl Fn(&str) -> bool) -> Result<()> {
        let params: Vec<usize> = (0..self.vars.len())
            .filter(|&i| want(&self.vars[i].0))
            .collect();
        self.load(&params)
    }

    /// Gather the variables at `params` (indices in the engine's order) together, write them,
    /// release them.
    fn load(&mut self, params: &[usize]) -> Result<()> {
        let (names, vars): (Vec<&str>, Vec<&Var>) = params
            .iter()
            .map(|&i| (self.vars[i].0.as_str(), &self.vars[i].1))
            .unzip();
        self.engine.gather(&names)?;
        let dtype = candle_dtype::<T>();
        let srcs = names
            .iter()
            .zip(&vars)
            .map(|(name, var)| Ok((self.engine.param_addr(name)?.0, var.dims())))
            .collect::<Result<Vec<_>>>()?;
        // In groups of at most LOAD_GROUP_BYTES (or one larger tensor): one wait per group,
        // and no more than a group's copy of the model alive at once beside the variables.
        let es = dtype.size_in_bytes();
        let sizes: Vec<usize> = srcs
            .iter()
            .map(|(_, d)| d.iter().product::<usize>() * es)
            .collect();
        for g in groups(&sizes, LOAD_GROUP_BYTES) {
            let device = vars[g.start].device();
            let ts = self
                .engine
                .stream()
                .tensors_from(&srcs[g.clone()], dtype, device)?;
            for (t, var) in ts.iter().zip(&vars[g]) {
                var.set(&t.to_dtype(var.dtype())?)?;
            }
        }
        self.engine.release(&names)?;
        Ok(())
    }

    /// `loss` times the loss scale (fp16's dynamic or static scale; 1 otherwise): what to take
    /// the gradients of.
    pub fn scaled(&self, loss: &Tensor) -> Result<Tensor> {
        let s = self.engine.loss_scale();
        Ok(if s == 1.0 {
            loss.clone()
        } else {
            loss.affine(f64::from(s), 0.0)?
        })
    }

    /// candle's backward of `loss` (already [`Zero::scaled`]), each gradient handed to the
    /// engine (last variable first, as backward produces them). A variable the loss does not
    /// depend on gets a zero gradient.
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        self.engine.phase(Phase::Backward);
        self.in_forward = false;
        let mut grads = loss.backward()?;
        let dtype = candle_dtype::<T>();
        let mut ins = Vec::with_capacity(self.vars.len());
        for (_, var) in self.vars.iter().rev() {
            // Each f32 gradient leaves the store as it is converted and is freed once its
            // conversion is queued (backward's gradients are detached: the copy does not keep
            // it), so a 16-bit engine's copies never sit beside every f32 gradient at once.
            ins.push(match grads.remove(var.as_tensor()) {
                Some(g) => g.to_dtype(dtype)?.contiguous()?,
                None => Tensor::zeros(var.shape(), dtype, var.device())?,
            });
        }
        drop(grads);
        // candle's backward (and the conversions) are done before the engine reads a gradient.
        self.engine.stream().settle(loss.device())?;
        // Every gradient's storage held while the engine adds them all (it waits once).
        let (engine, vars) = (&mut self.engine, &self.vars);
        let mut addrs = Vec::with_capacity(ins.len());
        with_addrs::<S>(&ins, &mut addrs, &mut |addrs| {
            let lent: Vec<Lent> = addrs
                .iter()
                .zip(&ins)
                .map(|(&addr, g)| Lent {
                    addr,
                    elems: g.elem_count(),
                    dtype: T::DTYPE,
                })
                .collect();
            let names = vars.iter().rev().map(|(n, _)| n.as_str());
            Ok(engine.push_grads_by_name(names.zip(&lent))?)
        })
    }

    /// The optimizer step (or, inside a gradient-accumulation window, the micro-step): what
    /// happened. The variables keep their values until the next load (the hook's, or
    /// [`Zero::load_params`]).
    pub fn step(&mut self) -> Result<StepOutcome> {
        self.in_forward = false;
        let fresh = std::mem::take(&mut self.fresh);
        let outcome = self.engine.step()?;
        // Only a micro-step inside the accumulation window leaves the parameters as they were
        // (a delayed update lands at an optimizer step, too).
        self.fresh = fresh && matches!(outcome, StepOutcome::Accumulated);
        Ok(outcome)
    }

    /// candle's `Optimizer::backward_step` for a loop written for candle's optimizers, which
    /// loads nothing before forward: [`Zero::backward`] of `loss` times the loss scale,
    /// [`Zero::step`], and after an optimizer step [`Zero::load_params`]'s load, so that the
    /// variables hold the updated parameters when the next forward starts (at stage 3 that
    /// gathers every parameter, bucket by bucket). What the step did. The step report then
    /// counts forward under "other": no load marks where it starts.
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<StepOutcome> {
        let scaled = self.scaled(loss)?;
        self.backward(&scaled)?;
        let outcome = self.step()?;
        if !matches!(outcome, StepOutcome::Accumulated) {
            self.load_all()?;
        }
        Ok(outcome)
    }

    /// This rank's model-state and communication bytes, by category.
    pub fn memory(&self) -> Memory {
        self.engine.memory()
    }

    /// Save a checkpoint (every rank calls it) with the trainer's own `client_state`.
    pub fn save_checkpoint(
        &mut self,
        dir: impl AsRef<std::path::Path>,
        client_state: serde_json::Value,
    ) -> Result<()> {
        Ok(self.engine.save_checkpoint(dir, client_state)?)
    }

    /// Load a checkpoint saved at any world size, stage or precision, and put its parameters
    /// into the variables; its `client_state`.
    pub fn load_checkpoint(
        &mut self,
        dir: impl AsRef<std::path::Path>,
    ) -> Result<serde_json::Value> {
        self.fresh = false;
        let meta = self.engine.load_checkpoint(dir)?;
        self.load_all()?;
        self.engine.restart_order();
        Ok(meta.client_state)
    }

    fn names_hint(&self) -> String {
        let mut names: Vec<&str> = self.vars.iter().map(|(n, _)| n.as_str()).take(6).collect();
        if self.vars.len() > 6 {
            names.push("...");
        }
        names.join(", ")
    }
}

/// Run `f` with the address in `S`'s memory of every tensor of `ts`, each tensor's storage held
/// until `f` returns (`addrs` gathers them).
fn with_addrs<S: CandleStream>(
    ts: &[Tensor],
    addrs: &mut Vec<DevPtr>,
    f: &mut dyn FnMut(&[DevPtr]) -> Result<()>,
) -> Result<()> {
    match ts.split_first() {
        None => f(addrs),
        Some((t, rest)) => S::with_addr(t, |a| {
            addrs.push(a);
            with_addrs::<S>(rest, addrs, f)
        }),
    }
}

/// The candle dtype of the engine's `T`.
fn candle_dtype<T: Float>() -> CDType {
    match T::DTYPE {
        DType::BF16 => CDType::BF16,
        DType::F16 => CDType::F16,
        _ => CDType::F32,
    }
}

/// A tensor's values as f32, in row-major order.
fn to_f32(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(CDType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

/// A name's sort key: runs of digits compare as numbers.
pub(crate) fn natural(name: &str) -> Vec<(String, u64)> {
    let mut key = Vec::new();
    let mut text = String::new();
    let mut chars = name.chars().peekable();
    while let Some(c) = chars.next() {
        if c.is_ascii_digit() {
            let mut n = u64::from(c as u8 - b'0');
            while let Some(d) = chars.peek().filter(|d| d.is_ascii_digit()) {
                n = n
                    .saturating_mul(10)
                    .saturating_add(u64::from(*d as u8 - b'0'));
                chars.next();
            }
            key.push((std::mem::take(&mut text), n));
        } else {
            text.push(c);
        }
    }
    key.push((text, 0));
    key
}

/// Consecutive ranges of `sizes` whose sums stay within `cap`, one item alone where it is
/// larger; they cover every index in order.
fn groups(sizes: &[usize], cap: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut from = 0;
    while from < sizes.len() {
        let (mut to, mut sum) = (from + 1, sizes[from]);
        while to < sizes.len() && sum + sizes[to] <= cap {
            (sum, to) = (sum + sizes[to], to + 1);
        }
        out.push(from..to);
        from = to;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{groups, natural};

    #[test]
    fn parameters_load_in_groups_within_the_cap_a_larger_one_alone() {
        assert_eq!(groups(&[3, 4, 2, 10, 1, 1], 8), [0..2, 2..3, 3..4, 4..6]);
        assert_eq!(groups(&[1, 1, 1], 100), vec![0..3]);
        assert!(groups(&[], 8).is_empty());
    }

    #[test]
    fn names_sort_with_numbers_as_numbers() {
        let mut v = vec!["h.10.fc", "h.2.fc", "h.2.attn", "ln_f", "h.1.fc", "tok"];
        v.sort_by_key(|n| natural(n));
        assert_eq!(
            v,
            ["h.1.fc", "h.2.attn", "h.2.fc", "h.10.fc", "ln_f", "tok"]
        );
    }
}
