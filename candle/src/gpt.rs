//! A decoder-only transformer (GPT) written with candle-nn: token and position embeddings, `layers`
//! blocks of pre-norm causal self-attention and MLP, a final layer norm and a language-model
//! head. Variables are named `tok`, `pos`, `h.{i}.{ln1,attn.qkv,attn.proj,ln2,fc,out}`, `ln_f`,
//! `head` (a module per prefix, for [`Zero::load_module`](crate::Zero::load_module)).

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{embedding, linear, Embedding, Init, Linear, VarBuilder, VarMap};

/// The model's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GptConfig {
    /// Tokens in the vocabulary.
    pub vocab: usize,
    /// The longest context (positions).
    pub ctx: usize,
    /// Width of the residual stream.
    pub dim: usize,
    /// Attention heads (`dim` divides by it).
    pub heads: usize,
    /// Transformer blocks.
    pub layers: usize,
}

impl GptConfig {
    /// A model that learns the generated corpus on 2 CPU ranks in about a minute: 2 blocks of
    /// width 64, 4 heads, a context of 32.
    pub fn tiny(vocab: usize) -> GptConfig {
        GptConfig {
            vocab,
            ctx: 32,
            dim: 64,
            heads: 4,
            layers: 2,
        }
    }

    /// The variables [`Gpt::new`] makes, by name and shape, in the order [`Gpt::new`] makes
    /// them: what a trainer knows of the model without building it.
    pub fn variables(&self) -> Vec<(String, Vec<usize>)> {
        let (v, c) = (self.vocab, self.dim);
        let mut out = vec![
            ("tok.weight".to_string(), vec![v, c]),
            ("pos.weight".to_string(), vec![self.ctx, c]),
        ];
        let linear = |out: &mut Vec<(String, Vec<usize>)>, name: String, i: usize, o: usize| {
            out.push((format!("{name}.weight"), vec![o, i]));
            out.push((format!("{name}.bias"), vec![o]));
        };
        let norm = |out: &mut Vec<(String, Vec<usize>)>, name: String| {
            out.push((format!("{name}.weight"), vec![c]));
            out.push((format!("{name}.bias"), vec![c]));
        };
        for i in 0..self.layers {
            norm(&mut out, format!("h.{i}.ln1"));
            linear(&mut out, format!("h.{i}.attn.qkv"), c, 3 * c);
            linear(&mut out, format!("h.{i}.attn.proj"), c, c);
            norm(&mut out, format!("h.{i}.ln2"));
            linear(&mut out, format!("h.{i}.fc"), c, 4 * c);
            linear(&mut out, format!("h.{i}.out"), 4 * c, c);
        }
        norm(&mut out, "ln_f".into());
        linear(&mut out, "head".into(), c, v);
        out
    }

    /// The prefixes [`Gpt::forward_with`] calls its hook with, in order: one per module.
    pub fn modules(&self) -> Vec<String> {
        let blocks = (0..self.layers).map(|i| format!("h.{i}."));
        ["tok".into(), "pos".into()]
            .into_iter()
            .chain(blocks)
            .chain(["ln_f".into(), "head".into()])
            .collect()
    }

    /// Parameters of the model.
    pub fn params(&self) -> usize {
        let (v, c, t) = (self.vocab, self.dim, self.ctx);
        let block =
            2 * 2 * c + (c * 3 * c + 3 * c) + (c * c + c) + (c * 4 * c + 4 * c) + (4 * c * c + c);
        v * c + t * c + self.layers * block + 2 * c + (c * v + v)
    }
}

/// Layer norm (ε = 1e-5, a scale and a bias) built from differentiable ops. candle-nn 0.11's
/// `LayerNorm` runs a fused kernel without a backward on contiguous input, so no gradient passes
/// it: a pre-norm transformer built on it trains only its head (it levels off at the bigram
/// loss, and each block it adds makes that worse).
struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
}

fn layer_norm(d: usize, vb: VarBuilder) -> Result<LayerNorm> {
    Ok(LayerNorm {
        weight: vb.get_with_hints(d, "weight", Init::Const(1.0))?,
        bias: vb.get_with_hints(d, "bias", Init::Const(0.0))?,
    })
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        candle_nn::ops::layer_norm_slow(x, &self.weight, &self.bias, 1e-5)
    }
}

/// One block: `x + attn(ln1(x))`, then `x + mlp(ln2(x))`.
struct Block {
    ln1: LayerNorm,
    qkv: Linear,
    proj: Linear,
    ln2: LayerNorm,
    fc: Linear,
    out: Linear,
    heads: usize,
}

impl Block {
    fn new(c: &GptConfig, vb: VarBuilder) -> Result<Block> {
        let d = c.dim;
        Ok(Block {
            ln1: layer_norm(d, vb.pp("ln1"))?,
            qkv: linear(d, 3 * d, vb.pp("attn.qkv"))?,
            proj: linear(d, d, vb.pp("attn.proj"))?,
            ln2: layer_norm(d, vb.pp("ln2"))?,
            fc: linear(d, 4 * d, vb.pp("fc"))?,
            out: linear(4 * d, d, vb.pp("out"))?,
            heads: c.heads,
        })
    }

    fn forward(&self, x: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let (h, hd) = (self.heads, c / self.heads);
        let qkv = self.qkv.forward(&self.ln1.forward(x)?)?;
        let split = |i: usize| -> Result<Tensor> {
            qkv.narrow(2, i * c, c)?
                .reshape((b, t, h, hd))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (split(0)?, split(1)?, split(2)?);
        let att = (q.matmul(&k.t()?)? * (1.0 / (hd as f64).sqrt()))?;
        let neg = Tensor::new(f32::NEG_INFINITY, x.device())?.broadcast_as(att.shape())?;
        let att = mask.broadcast_as(att.shape())?.where_cond(&neg, &att)?;
        let att = candle_nn::ops::softmax_last_dim(&att)?;
        let y = att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, c))?;
        let x = (x + self.proj.forward(&y)?)?;
        let m = self
            .out
            .forward(&self.fc.forward(&self.ln2.forward(&x)?)?.gelu()?)?;
        x + m
    }
}

/// The model.
pub struct Gpt {
    tok: Embedding,
    pos: Embedding,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    head: Linear,
    cfg: GptConfig,
}

impl Gpt {
    /// Build the model's variables through `vb` (over a `VarMap`, to train them).
    pub fn new(cfg: GptConfig, vb: VarBuilder) -> Result<Gpt> {
        if cfg.heads == 0 || !cfg.dim.is_multiple_of(cfg.heads) {
            candle_core::bail!("dim {} does not divide into {} heads", cfg.dim, cfg.heads);
        }
        Ok(Gpt {
            tok: embedding(cfg.vocab, cfg.dim, vb.pp("tok"))?,
            pos: embedding(cfg.ctx, cfg.dim, vb.pp("pos"))?,
            blocks: (0..cfg.layers)
                .map(|i| Block::new(&cfg, vb.pp(format!("h.{i}"))))
                .collect::<Result<_>>()?,
            ln_f: layer_norm(cfg.dim, vb.pp("ln_f"))?,
            head: linear(cfg.dim, cfg.vocab, vb.pp("head"))?,
            cfg,
        })
    }

    /// Its shape.
    pub fn config(&self) -> GptConfig {
        self.cfg
    }

    /// Logits `(b, t, vocab)` for tokens `idx` `(b, t)` (u32), `t` at most `ctx`.
    pub fn forward(&self, idx: &Tensor) -> Result<Tensor> {
        self.forward_with(idx, &mut |_| Ok(()))
    }

    /// [`Gpt::forward`], calling `before(prefix)` before each module runs (`"tok"`, `"pos"`,
    /// `"h.0."`, ..., `"ln_f"`, `"head"`): where a stage-3 trainer loads that module's
    /// parameters.
    pub fn forward_with(
        &self,
        idx: &Tensor,
        before: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<Tensor> {
        let (_, t) = idx.dims2()?;
        if t > self.cfg.ctx {
            candle_core::bail!(
                "a sequence of {t} tokens is longer than the context, {}",
                self.cfg.ctx
            );
        }
        let dev = idx.device();
        before("tok")?;
        let x = self.tok.forward(idx)?;
        before("pos")?;
        let positions = Tensor::arange(0u32, t as u32, dev)?;
        let mut x = x.broadcast_add(&self.pos.forward(&positions)?)?;
        let mask = causal_mask(t, dev)?;
        for (i, b) in self.blocks.iter().enumerate() {
            before(&format!("h.{i}."))?;
            x = b.forward(&x, &mask)?;
        }
        before("ln_f")?;
        let x = self.ln_f.forward(&x)?;
        before("head")?;
        self.head.forward(&x)
    }

    /// Mean cross-entropy of predicting `targets` `(b, t)` from `idx` `(b, t)`.
    pub fn loss(&self, idx: &Tensor, targets: &Tensor) -> Result<Tensor> {
        self.loss_with(idx, targets, &mut |_| Ok(()))
    }

    /// [`Gpt::loss`] with [`Gpt::forward_with`]'s hook.
    pub fn loss_with(
        &self,
        idx: &Tensor,
        targets: &Tensor,
        before: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<Tensor> {
        let logits = self.forward_with(idx, before)?;
        let (b, t, v) = logits.dims3()?;
        candle_nn::loss::cross_entropy(&logits.reshape((b * t, v))?, &targets.reshape(b * t)?)
    }
}

/// 1 where position `j` may not be seen from position `i` (`j > i`).
fn causal_mask(t: usize, dev: &Device) -> Result<Tensor> {
    let m: Vec<u8> = (0..t)
        .flat_map(|i| (0..t).map(move |j| u8::from(j > i)))
        .collect();
    Tensor::from_slice(&m, (t, t), dev)
}

/// Set every variable of `varmap` to a value that depends only on `seed`, its name and the
/// element (layer norms' scales 1 and biases 0, embeddings uniform in ±0.1, weights uniform in
/// ±1/√fan-in): the same model on every rank and in every process, which candle's CPU random
/// initialisation cannot give.
pub fn init(varmap: &VarMap, seed: u64) -> Result<()> {
    let vars = varmap
        .data()
        .lock()
        .map_err(|_| candle_core::Error::msg("poisoned VarMap"))?;
    for (name, var) in vars.iter() {
        let dims = var.dims().to_vec();
        let n = var.elem_count();
        let h = name.bytes().fold(seed ^ 0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        let values: Vec<f32> = if name.ends_with(".bias") {
            vec![0.0; n]
        } else if name.ends_with(".weight") && is_norm(name) {
            vec![1.0; n]
        } else {
            let scale = if dims.len() == 2 && !name.starts_with("tok") && !name.starts_with("pos") {
                1.0 / (dims[1] as f32).sqrt()
            } else {
                0.1
            };
            (0..n as u64)
                .map(|i| scale * unit(h ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15)))
                .collect()
        };
        var.set(&Tensor::from_vec(values, dims, var.device())?.to_dtype(var.dtype())?)?;
    }
    Ok(())
}

fn is_norm(name: &str) -> bool {
    name.contains("ln1") || name.contains("ln2") || name.starts_with("ln_f")
}

/// A number in [−1, 1) from `z` (splitmix64's finaliser).
fn unit(mut z: u64) -> f32 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    ((z >> 40) as f32 / (1u64 << 23) as f32) - 1.0
}

/// A model on `dev` with its variables in a new `VarMap`, initialised by [`init`].
pub fn build(cfg: GptConfig, seed: u64, dev: &Device) -> Result<(Gpt, VarMap)> {
    let varmap = VarMap::new();
    let model = Gpt::new(cfg, VarBuilder::from_varmap(&varmap, DType::F32, dev))?;
    init(&varmap, seed)?;
    Ok((model, varmap))
}

/// The mean of a loss tensor as a number.
pub fn scalar(loss: &Tensor) -> Result<f32> {
    loss.to_dtype(DType::F32)?.mean_all()?.to_scalar::<f32>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parameter_count_matches_the_variables() {
        let cfg = GptConfig::tiny(40);
        let (_, vm) = build(cfg, 1, &Device::Cpu).unwrap();
        let n: usize = vm.all_vars().iter().map(|v| v.elem_count()).sum();
        assert_eq!(n, cfg.params());
    }

    #[test]
    fn the_shape_names_every_variable_and_module_the_model_makes() {
        let cfg = GptConfig {
            layers: 3,
            ..GptConfig::tiny(11)
        };
        let (m, vm) = build(cfg, 1, &Device::Cpu).unwrap();
        let mut made: Vec<(String, Vec<usize>)> = (vm.data().lock().unwrap().iter())
            .map(|(n, v)| (n.clone(), v.dims().to_vec()))
            .collect();
        let mut named = cfg.variables();
        made.sort();
        named.sort();
        assert_eq!(named, made);
        let mut hooked = Vec::new();
        let x = Tensor::new(&[[1u32, 2, 3]], &Device::Cpu).unwrap();
        m.forward_with(&x, &mut |p| {
            hooked.push(p.to_string());
            Ok(())
        })
        .unwrap();
        assert_eq!(hooked, cfg.modules());
    }

    #[test]
    fn every_variable_gets_a_gradient() {
        let (m, vm) = build(GptConfig::tiny(12), 2, &Device::Cpu).unwrap();
        let x = Tensor::new(&[[1u32, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1]], &Device::Cpu).unwrap();
        let y = Tensor::new(&[[2u32, 3, 4, 5, 6, 7], [5, 4, 3, 2, 1, 0]], &Device::Cpu).unwrap();
        let grads = m.loss(&x, &y).unwrap().backward().unwrap();
        for (name, var) in vm.data().lock().unwrap().iter() {
            let g = grads.get(var.as_tensor());
            let norm = g.map_or(0.0, |g| {
                g.sqr()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap()
            });
            assert!(norm > 0.0, "{name}: no gradient reaches it");
        }
    }

    #[test]
    fn a_position_sees_no_later_token() {
        let cfg = GptConfig {
            ctx: 8,
            ..GptConfig::tiny(10)
        };
        let (m, _) = build(cfg, 3, &Device::Cpu).unwrap();
        let a = Tensor::new(&[[1u32, 2, 3, 4, 5, 6, 7, 8]], &Device::Cpu).unwrap();
        let b = Tensor::new(&[[1u32, 2, 3, 4, 9, 9, 9, 9]], &Device::Cpu).unwrap();
        let la = m.forward(&a).unwrap().narrow(1, 0, 4).unwrap();
        let lb = m.forward(&b).unwrap().narrow(1, 0, 4).unwrap();
        let d = (la - lb)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert_eq!(
            d, 0.0,
            "the first four positions' logits depend on later tokens"
        );
    }
}
