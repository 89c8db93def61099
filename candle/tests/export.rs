//! A trained model leaves as one safetensors file that candle loads for inference, named as the
//! model names its variables: from the variables themselves (`VarMap::save` after
//! `Zero::load_params`, on one rank) or from a ZeRO checkpoint consolidated shard by shard
//! (`ringzero_zero::checkpoint::consolidate`, what `ringzero ckpt consolidate` runs). Both give
//! back the trained model's loss bit for bit.

mod common;

use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use ringzero_candle::gpt::{self, Gpt};
use ringzero_candle::Zero;
use ringzero_zero::{checkpoint::consolidate, Precision, ZeroConfig};

use common::{ranks, small_gpt};

#[test]
fn a_trained_model_saves_as_one_file_candle_loads() {
    let dir = std::env::temp_dir().join(format!("ringzero-export-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (corpus, shape) = small_gpt(7);
    let (x, y) = corpus.batch(&[1000, 2000], 16, &Device::Cpu).unwrap();
    let (ckpt, saved) = (dir.join("ckpt"), dir.join("model.safetensors"));
    let trained = ranks(2, |comm| {
        let cfg = ZeroConfig::from_json(
            r#"{"zero_optimization": {"stage": 3, "reduce_bucket_size": 2000},
                "optimizer": {"type": "AdamW", "params": {"lr": 0.003}}}"#,
        )
        .unwrap();
        let (model, vm) = gpt::build(shape, 3, &Device::Cpu).unwrap();
        let mut zero = Zero::<f32>::new(&comm, &vm, cfg).unwrap();
        for step in 0..4u64 {
            let ids: Vec<u64> = (0..2)
                .map(|k| step * 4 + comm.rank() as u64 * 2 + k)
                .collect();
            let (xs, ys) = corpus.batch(&ids, 16, &Device::Cpu).unwrap();
            let loss = model.loss_with(&xs, &ys, &mut zero.hook()).unwrap();
            zero.backward(&zero.scaled(&loss).unwrap()).unwrap();
            zero.step().unwrap();
        }
        zero.save_checkpoint(&ckpt, serde_json::json!({})).unwrap();
        // The variables hold the trained values once loaded; one rank writes them.
        zero.load_params().unwrap();
        if comm.rank() == 0 {
            vm.save(&saved).unwrap();
        }
        gpt::scalar(&model.loss(&x, &y).unwrap()).unwrap()
    });
    assert_eq!(trained[0], trained[1]);
    let consolidated = dir.join("consolidated.safetensors");
    consolidate(&ckpt, &consolidated, Precision::Fp32, false).unwrap();
    for file in [&saved, &consolidated] {
        let tensors = candle_core::safetensors::load(file, &Device::Cpu).unwrap();
        assert_eq!(tensors.len(), shape.variables().len(), "{file:?}");
        let vb = VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
        let model = Gpt::new(shape, vb).unwrap();
        let loss = gpt::scalar(&model.loss(&x, &y).unwrap()).unwrap();
        assert_eq!(loss, trained[0], "{file:?}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
