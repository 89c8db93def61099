//! Embedding the ZeRO engine in your own trainer: a two-layer MLP learns a fixed linear map,
//! configured from DeepSpeed-style JSON (any stage, fp32/bf16/fp16, gradient accumulation,
//! clipping, any optimizer), saving a checkpoint and resuming from one at another world size.
//! The trainer owns forward and backward; the engine owns parameters, gradients, optimizer
//! state and communication. It uses only the `ringzero` crate, as a program of yours would.
//!
//! ```text
//! cargo build --release --example zero_mlp
//! target/release/ringzero launch -n 2 -- target/release/examples/zero_mlp --save ck
//! target/release/ringzero launch -n 3 -- target/release/examples/zero_mlp --resume ck
//! ```
//! (`--config FILE` takes another config; `ringzero demo` is the full-featured version.)

use ringzero::half::{bf16, f16};
use ringzero::kernels::cpu::Float;
use ringzero::zero::{Engine, ParamSpec, Phase, Precision, StepOutcome, ZeroConfig};
use ringzero::Communicator;

const CONFIG: &str = r#"{
  "zero_optimization": {"stage": 3, "reduce_bucket_size": 2000, "stage3_prefetch_bucket_size": 4000},
  "bf16": {"enabled": true},
  "gradient_clipping": 1.0,
  "gradient_accumulation_steps": 2,
  "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.0}}
}"#;

const IN: usize = 8;
const HIDDEN: usize = 32;
const OUT: usize = 2;
const BATCH: usize = 16;

/// A reproducible number in [−1, 1) from a seed (every rank computes the same).
fn uniform(seed: u64) -> f32 {
    let z = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (seed >> 29);
    let z = z.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    ((z >> 40) as f32 / (1u64 << 23) as f32) - 1.0
}

/// `a · wᵀ + b` for rows of `a` (`inp` wide) and `w` (`out × inp`).
fn linear(a: &[f32], w: &[f32], b: &[f32], inp: usize, out: usize) -> Vec<f32> {
    a.chunks(inp)
        .flat_map(|row| (0..out).map(move |o| b[o] + dot(&w[o * inp..(o + 1) * inp], row)))
        .collect()
}

/// The gradients of [`linear`]: (dW, db, dA) from dZ.
fn linear_back(a: &[f32], w: &[f32], dz: &[f32], inp: usize, out: usize) -> [Vec<f32>; 3] {
    let (mut dw, mut db, mut da) = (vec![0.0; out * inp], vec![0.0; out], vec![0.0; a.len()]);
    for (r, row) in a.chunks(inp).enumerate() {
        for o in 0..out {
            let g = dz[r * out + o];
            db[o] += g;
            for i in 0..inp {
                dw[o * inp + i] += g * row[i];
                da[r * inp + i] += g * w[o * inp + i];
            }
        }
    }
    [dw, db, da]
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `--flag VALUE` from the command line.
fn arg(flag: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    let i = args.iter().position(|a| a == flag)?;
    args.get(i + 1).cloned()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let comm = Communicator::from_env()?; // under `ringzero launch`, torchrun, Slurm or mpirun
    let cfg = match arg("--config") {
        Some(path) => ZeroConfig::from_json(&std::fs::read_to_string(path)?)?,
        None => ZeroConfig::from_json(CONFIG)?,
    };
    match cfg.precision {
        Precision::Fp32 => train::<f32>(&comm, cfg),
        Precision::Bf16 => train::<bf16>(&comm, cfg),
        Precision::Fp16 => train::<f16>(&comm, cfg),
    }
}

fn train<T: Float>(comm: &Communicator, cfg: ZeroConfig) -> Result<(), Box<dyn std::error::Error>> {
    let specs = [
        ParamSpec::new("w0", &[HIDDEN, IN]),
        ParamSpec::new("b0", &[HIDDEN]),
        ParamSpec::new("w1", &[OUT, HIDDEN]),
        ParamSpec::new("b1", &[OUT]),
    ];
    // The same initial values on every rank (a pure function of parameter and element).
    let init = |p: usize, i: usize| match p {
        0 | 2 => 0.5 * uniform((p as u64) << 32 | i as u64),
        _ => 0.0,
    };
    let mut engine = Engine::<T>::new(comm, &specs, &init, cfg)?;
    // The engine's: a config may derive it from its batch sizes and the world size.
    let accumulation = engine.config().accumulation_steps as u64;
    // Resume where a checkpoint left off, saved at any world size, stage or precision.
    let mut first = 0;
    if let Some(dir) = arg("--resume") {
        first = engine.load_checkpoint(&dir)?.client_state["next_step"]
            .as_u64()
            .unwrap_or(0);
    }
    let teacher: Vec<f32> = (0..OUT * IN).map(|i| uniform(1 << 50 | i as u64)).collect();
    for step in first..first + 100 {
        for micro in 0..accumulation {
            // Each rank its own batch: inputs in [−1, 1), targets teacher · x.
            let seed = (comm.rank() as u64) << 40 | (step * accumulation + micro) << 16;
            let x: Vec<f32> = (0..BATCH * IN).map(|i| uniform(seed | i as u64)).collect();
            let y = linear(&x, &teacher, &[0.0; OUT], IN, OUT);
            // Forward: gather a layer when it runs (stage 3; a no-op otherwise); the engine
            // prefetches the next one by the order the last step gathered in.
            engine.phase(Phase::Forward);
            engine.gather(&["w0", "b0"])?;
            let w0 = engine.param_f32("w0")?;
            let z0 = linear(&x, &w0, &engine.param_f32("b0")?, IN, HIDDEN);
            engine.release(&["w0", "b0"])?;
            let h: Vec<f32> = z0.iter().map(|v| v.max(0.0)).collect();
            engine.gather(&["w1", "b1"])?;
            let w1 = engine.param_f32("w1")?;
            let out = linear(&h, &w1, &engine.param_f32("b1")?, HIDDEN, OUT);
            engine.release(&["w1", "b1"])?;
            // Loss 0.5·mean((out − y)²), and its gradient times the loss scale (fp16).
            let n = (BATCH * OUT) as f32;
            let loss = out
                .iter()
                .zip(&y)
                .map(|(o, t)| 0.5 * (o - t).powi(2))
                .sum::<f32>()
                / n;
            let s = engine.loss_scale();
            let d_out: Vec<f32> = out.iter().zip(&y).map(|(o, t)| (o - t) * s / n).collect();
            // Backward, pushing each layer's gradients as soon as they exist.
            engine.phase(Phase::Backward);
            let [dw1, db1, dh] = linear_back(&h, &w1, &d_out, HIDDEN, OUT);
            engine.push_grad_f32("w1", &dw1)?;
            engine.push_grad_f32("b1", &db1)?;
            let dz0: Vec<f32> = dh
                .iter()
                .zip(&z0)
                .map(|(g, z)| if *z > 0.0 { *g } else { 0.0 })
                .collect();
            let [dw0, db0, _] = linear_back(&x, &w0, &dz0, IN, HIDDEN);
            engine.push_grad_f32("w0", &dw0)?;
            engine.push_grad_f32("b0", &db0)?;
            let outcome = engine.step()?;
            if let (0, StepOutcome::Stepped { grad_norm }) = (comm.rank(), outcome) {
                if step % 20 == 0 {
                    println!("step {step:>3}  rank-0 loss {loss:.5}  grad norm {grad_norm:.4}");
                }
            }
        }
    }
    if let Some(dir) = arg("--save") {
        engine.save_checkpoint(
            &dir,
            ringzero::serde_json::json!({ "next_step": first + 100 }),
        )?;
    }
    if comm.rank() == 0 {
        println!(
            "rank 0 holds {}; {}",
            engine.memory(),
            engine.report().map_or(String::new(), |r| r.to_string())
        );
    }
    Ok(())
}
