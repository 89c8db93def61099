//! [`Zero`]: a candle model's variables under the ZeRO engine.

use candle_core::{DType, Tensor, Var};
use candle_nn::VarMap;
use ringzero_collectives::{Collectives, Communicator, InPlace};
use ringzero_kernels::cpu::Float;
use ringzero_zero::{Engine, Memory, ParamSpec, StepOutcome, ZeroConfig};

use crate::{Error, Result};

/// A candle model's variables trained by the ZeRO engine (any stage, precision, optimizer and
/// schedule its [`ZeroConfig`] names), in host memory.
///
/// The engine owns the parameters (in `T`: `f32`, `bf16` or `f16`), gradients, optimizer state
/// and communication; the `Var`s hold the values forward and backward use, in their own dtype
/// (candle computes in it; a 16-bit engine's values arrive rounded to `T`). Each step:
/// [`Zero::load_params`] (or [`Zero::load_module`] per module at stage 3) before forward,
/// [`Zero::backward`] on the loss, [`Zero::step`].
///
/// Variables are ordered by name, digits compared as numbers (`h.2` before `h.10`), the same on
/// every rank. Their values leave and enter candle through host memory: on a CUDA device that is
/// one copy each way per parameter and gradient.
pub struct Zero<T: Float = f32> {
    engine: Engine<T>,
    vars: Vec<(String, Var)>,
}

impl<T: Float> Zero<T> {
    /// Wrap every variable of `varmap` (build the model through a `VarBuilder` over it first).
    /// Rank 0's current values become every rank's, as PyTorch's DDP does at wrap time.
    pub fn new(comm: &Communicator, varmap: &VarMap, cfg: ZeroConfig) -> Result<Zero<T>> {
        let vars = varmap
            .data()
            .lock()
            .map_err(|_| Error::Invalid("the VarMap's lock is poisoned".into()))?
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        Zero::from_vars(comm, vars, cfg)
    }

    /// Wrap named variables (see [`Zero::new`]); names must be unique.
    pub fn from_vars(
        comm: &Communicator,
        mut vars: Vec<(String, Var)>,
        cfg: ZeroConfig,
    ) -> Result<Zero<T>> {
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
        let specs: Vec<ParamSpec> = vars
            .iter()
            .map(|(n, v)| ParamSpec::new(n.clone(), v.dims()))
            .collect();
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
        let engine = Engine::<T>::new(comm, &specs, &init, cfg)?;
        let mut z = Zero { engine, vars };
        z.load_params()?;
        Ok(z)
    }

    /// The engine: its configuration, memory, report, learning rate, loss scale.
    pub fn engine(&self) -> &Engine<T> {
        &self.engine
    }

    /// The engine, to set the phase, the learning rate, or to prefetch.
    pub fn engine_mut(&mut self) -> &mut Engine<T> {
        &mut self.engine
    }

    /// The variables, by name, in the engine's order.
    pub fn vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// Put the engine's current parameters into every variable (at stage 3 each is gathered,
    /// written and released in turn).
    pub fn load_params(&mut self) -> Result<()> {
        self.load_where(|_| true)
    }

    /// Put the parameters whose names start with `prefix` (a module: `"h.3."`) into their
    /// variables: at stage 3 gathered together (the engine prefetches the next module by the
    /// order of the last step's gathers), written, and released. An error if none match.
    pub fn load_module(&mut self, prefix: &str) -> Result<()> {
        if !self.vars.iter().any(|(n, _)| n.starts_with(prefix)) {
            return Err(Error::Invalid(format!(
                "no variable's name starts with {prefix:?}; the names are {}",
                self.names_hint()
            )));
        }
        self.load_where(|n| n.starts_with(prefix))
    }

    /// The hook for a model's forward that calls it before each module (as
    /// [`Gpt::forward_with`](crate::gpt::Gpt::forward_with) does): [`Zero::load_module`] of the
    /// prefix it is given, its error handed to candle.
    pub fn hook(&mut self) -> impl FnMut(&str) -> candle_core::Result<()> + '_ {
        |prefix| self.load_module(prefix).map_err(candle_core::Error::wrap)
    }

    fn load_where(&mut self, want: impl Fn(&str) -> bool) -> Result<()> {
        let names: Vec<&str> = self
            .vars
            .iter()
            .filter(|(n, _)| want(n))
            .map(|(n, _)| n.as_str())
            .collect();
        self.engine.gather(&names)?;
        for (name, var) in self.vars.iter().filter(|(n, _)| want(n)) {
            let values = self.engine.param_f32(name)?;
            let t = Tensor::from_vec(values, var.dims(), var.device())?.to_dtype(var.dtype())?;
            var.set(&t)?;
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
        let grads = loss.backward()?;
        for (name, var) in self.vars.iter().rev() {
            let g = match grads.get(var.as_tensor()) {
                Some(g) => to_f32(g)?,
                None => vec![0.0; var.elem_count()],
            };
            self.engine.push_grad_f32(name, &g)?;
        }
        Ok(())
    }

    /// The optimizer step (or, inside a gradient-accumulation window, the micro-step): what
    /// happened. The variables keep their values until the next [`Zero::load_params`].
    pub fn step(&mut self) -> Result<StepOutcome> {
        Ok(self.engine.step()?)
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
        let meta = self.engine.load_checkpoint(dir)?;
        self.load_params()?;
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

/// A tensor's values as f32, in row-major order.
fn to_f32(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

/// A name's sort key: runs of digits compare as numbers.
fn natural(name: &str) -> Vec<(String, u64)> {
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

#[cfg(test)]
mod tests {
    use super::natural;

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
