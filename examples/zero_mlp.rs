//! Embedding the ZeRO engine in your own trainer: a two-layer MLP learning a linear teacher with
//! ZeRO stage 3 in bf16, configured from DeepSpeed-style JSON. The trainer owns forward and
//! backward; the engine owns parameters, gradients, optimizer state and communication.
//!
//! ```text
//! cargo build --release --example zero_mlp
//! target/release/ringzero launch -n 2 -- target/release/examples/zero_mlp
//! ```
//! (`ringzero demo` is the full-featured version of this loop: any depth, stage and precision.)

use ringzero::Communicator;
use ringzero_tools::demo::{linear, linear_back, Mlp};
use ringzero_zero::{Engine, StepOutcome, ZeroConfig};

const CONFIG: &str = r#"{
  "zero_optimization": {"stage": 3, "reduce_bucket_size": 2000, "stage3_prefetch_bucket_size": 4000},
  "bf16": {"enabled": true},
  "gradient_clipping": 1.0,
  "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.0}}
}"#;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let comm = Communicator::from_env()?; // under `ringzero launch`, torchrun, Slurm or mpirun
    let cfg = ZeroConfig::from_json(CONFIG)?;
    let mlp = Mlp {
        input: 8,
        hidden: 32,
        output: 2,
        layers: 2,
    };
    let init = |p: usize, i: usize| mlp.init(p, i);
    let mut engine = Engine::<half::bf16>::new(&comm, &mlp.specs(), &init, cfg)?;
    let teacher = mlp.teacher();
    let batch = 16;
    for step in 0..200 {
        let (x, y) = mlp.batch(&teacher, comm.rank(), step, batch);
        // Forward: gather layer 0, prefetch layer 1 while computing, release.
        engine.gather(&["w0", "b0"])?;
        engine.prefetch(&["w1", "b1"])?;
        let z0 = linear(
            &x,
            &engine.param_f32("w0")?,
            &engine.param_f32("b0")?,
            8,
            32,
        );
        engine.release(&["w0", "b0"])?;
        let h: Vec<f32> = z0.iter().map(|v| v.max(0.0)).collect();
        engine.gather(&["w1", "b1"])?;
        let w1 = engine.param_f32("w1")?;
        let out = linear(&h, &w1, &engine.param_f32("b1")?, 32, 2);
        engine.release(&["w1", "b1"])?;
        // Loss 0.5·mean((out − y)²); its gradient, times the loss scale (1 in bf16).
        let n = (batch * 2) as f32;
        let loss: f32 = out
            .iter()
            .zip(&y)
            .map(|(o, t)| 0.5 * (o - t).powi(2))
            .sum::<f32>()
            / n;
        let s = engine.loss_scale();
        let d_out: Vec<f32> = out.iter().zip(&y).map(|(o, t)| (o - t) * s / n).collect();
        // Backward, pushing each layer's gradients as soon as they exist.
        let (dw1, db1, dh) = linear_back(&h, &w1, &d_out, 32, 2);
        engine.push_grad_f32("w1", &dw1)?;
        engine.push_grad_f32("b1", &db1)?;
        engine.gather(&["w0", "b0"])?;
        let w0 = engine.param_f32("w0")?;
        engine.release(&["w0", "b0"])?;
        let dz0: Vec<f32> = dh
            .iter()
            .zip(&z0)
            .map(|(g, z)| if *z > 0.0 { *g } else { 0.0 })
            .collect();
        let (dw0, db0, _) = linear_back(&x, &w0, &dz0, 8, 32);
        engine.push_grad_f32("w0", &dw0)?;
        engine.push_grad_f32("b0", &db0)?;
        let outcome = engine.step()?;
        if comm.rank() == 0 && step % 20 == 0 {
            let norm = match outcome {
                StepOutcome::Stepped { grad_norm } => grad_norm,
                _ => f64::NAN,
            };
            println!("step {step:>3}  rank-0 loss {loss:.5}  grad norm {norm:.4}");
        }
    }
    if comm.rank() == 0 {
        let m = engine.memory();
        println!(
            "rank 0 holds {} B params, {} B grads, {} B optimizer state",
            m.params, m.grads, m.optimizer
        );
    }
    Ok(())
}
