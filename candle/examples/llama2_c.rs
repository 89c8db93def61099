//! A model from `candle-transformers`, unchanged, trained data-parallel with ZeRO: llama2.c's
//! Llama (RMS norm, rotary embeddings, SwiGLU, grouped heads) as candle's own llama2-c training
//! example builds and trains it, with `candle_nn::AdamW` replaced by [`Zero`].
//!
//! The loop is candle's: forward, then `backward_step` on the loss. [`Zero::backward_step`]
//! reduces the gradients, steps and puts the updated parameters into the model's variables
//! (its forward cannot call a hook between modules, so at stage 3 that gathers them all; the
//! engine still keeps only this rank's shard of the parameters, gradients and optimizer state).
//!
//! ```sh
//! cargo build --release -p ringzero-candle --features transformers --example llama2_c
//! target/release/ringzero launch -n 2 -- target/release/examples/llama2_c --stage 3
//! ```
//! Options: `--stage N` (0–3, default 3), `--steps N` (default 200), `--init FILE` (rank 0 loads
//! the initial weights from this safetensors file, or writes its random ones there if it does
//! not exist: runs at different stages then start from the same weights and print the same
//! losses, bit for bit).

use std::collections::HashMap;

use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use candle_transformers::models::llama2_c::{Cache, Config, Llama};
use ringzero::{zero::ZeroConfig, Communicator};
use ringzero_candle::{corpus::Corpus, Zero};

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let comm = Communicator::from_env()?;
    let stage: u32 = arg("--stage").map_or(Ok(3), |s| s.parse())?;
    let steps: u64 = arg("--steps").map_or(Ok(200), |s| s.parse())?;
    let text = Corpus::generate(1 << 20, 1);
    let device = Device::Cpu;
    let mut varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &device);
    let config = Config {
        dim: 64,
        hidden_dim: 172,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        vocab_size: text.vocab(),
        seq_len: 32,
        norm_eps: 1e-5,
    };
    // The rotary tables come from a builder that has none, so `Cache::new` computes them (one
    // over the VarMap would create them as zero-valued variables to train).
    let no_tensors = VarBuilder::from_tensors(HashMap::new(), DType::F32, &device);
    let mut cache = Cache::new(false, &config, no_tensors)?;
    let model = Llama::load(vb, config)?;
    if let (Some(file), 0) = (arg("--init"), comm.rank()) {
        if std::path::Path::new(&file).exists() {
            varmap.load(&file)?;
        } else {
            varmap.save(&file)?;
        }
    }
    let cfg = ZeroConfig::from_json(&format!(
        r#"{{"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
            "zero_optimization": {{"stage": {stage}}},
            "optimizer": {{"type": "AdamW", "params": {{"lr": 0.004, "weight_decay": 0.01}}}},
            "scheduler": {{"type": "WarmupCosineLR",
                           "params": {{"warmup_num_steps": 10, "total_num_steps": {steps}}}}}}}"#
    ))?;
    // Rank 0's weights on every rank.
    let mut zero = Zero::<f32>::new(&comm, &varmap, cfg)?;
    let (rank, world, batch) = (comm.rank() as u64, comm.size() as u64, 8);
    for step in 0..steps {
        let ids: Vec<u64> = (0..batch)
            .map(|k| (step * world + rank) * batch + k)
            .collect();
        let (inp, tgt) = text.batch(&ids, 32, &device)?;
        let logits = model.forward(&inp, 0, &mut cache)?;
        let loss = candle_nn::loss::cross_entropy(&logits.flatten_to(1)?, &tgt.flatten_to(1)?)?;
        zero.backward_step(&loss)?;
        if rank == 0 && (step % 10 == 9 || step + 1 == steps) {
            // Rust prints the shortest text that reads back as the same f32: equal text, equal bits.
            println!("step {step}: loss {}", loss.to_scalar::<f32>()?);
        }
    }
    if rank == 0 {
        println!("rank 0 engine memory: {}", zero.memory());
    }
    Ok(())
}
