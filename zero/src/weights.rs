//! A model's named weights from a safetensors file — a Hugging Face checkpoint, or what
//! `ringzero ckpt consolidate` writes — as the engine takes them: the parameters' names and
//! shapes, and their values as the initialiser.

use std::path::Path;

use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};

use crate::error::ZeroError;
use crate::partition::ParamSpec;

/// Named weights held in fp32 on the host, in the file's order ([`Weights::from_safetensors`]);
/// hand them to [`crate::Engine::new`] as `(weights.specs(), &|p, i| weights.init(p, i))`, or
/// with [`crate::Engine::from_weights`] in one call.
#[derive(Clone, Debug, PartialEq)]
pub struct Weights {
    specs: Vec<ParamSpec>,
    values: Vec<Vec<f32>>,
}

impl Weights {
    /// Read every tensor of the safetensors file at `path`, in the order their data lies in the
    /// file (the same on every rank), widened to fp32 from F32, F16, BF16 or F64. A tensor of
    /// another dtype (integers: a tokenizer's table, a buffer) is refused, naming it, as is a
    /// file that is not safetensors or holds no tensor.
    pub fn from_safetensors(path: impl AsRef<Path>) -> Result<Weights, ZeroError> {
        let path = path.as_ref();
        let err = |msg: String| ZeroError::Checkpoint {
            path: path.to_path_buf(),
            msg,
        };
        let bytes = std::fs::read(path).map_err(|e| err(format!("cannot read it: {e}")))?;
        let (_, meta) = SafeTensors::read_metadata(&bytes)
            .map_err(|e| err(format!("is not a safetensors file: {e}")))?;
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| err(format!("is not a safetensors file: {e}")))?;
        let (mut specs, mut values) = (Vec::new(), Vec::new());
        for name in meta.offset_keys() {
            let t = st
                .tensor(&name)
                .map_err(|e| err(format!("tensor `{name}`: {e}")))?;
            let data = t.data();
            let v: Vec<f32> = match t.dtype() {
                Dtype::F32 => widen(data, f32::from_le_bytes),
                Dtype::F64 => widen(data, |b: [u8; 8]| f64::from_le_bytes(b) as f32),
                Dtype::F16 => widen(data, |b| f16::from_le_bytes(b).to_f32()),
                Dtype::BF16 => widen(data, |b| bf16::from_le_bytes(b).to_f32()),
                d => {
                    return Err(err(format!(
                        "tensor `{name}` is {d:?}; the engine trains floating-point weights \
                         (F32, F16, BF16, F64): save the others apart"
                    )))
                }
            };
            // A scalar (shape []) is one element.
            let shape = if t.shape().is_empty() {
                vec![1]
            } else {
                t.shape().to_vec()
            };
            specs.push(ParamSpec::new(name, &shape));
            values.push(v);
        }
        if specs.is_empty() {
            return Err(err("holds no tensor".into()));
        }
        Ok(Weights { specs, values })
    }

    /// The parameters' names and shapes, in the file's order.
    pub fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// Element `i` of parameter `p` (the engine's initialiser).
    pub fn init(&self, p: usize, i: usize) -> f32 {
        self.values[p][i]
    }

    /// Parameter `name`'s values, if there is one.
    pub fn get(&self, name: &str) -> Option<&[f32]> {
        let p = self.specs.iter().position(|s| s.name == name)?;
        Some(&self.values[p])
    }
}

/// Little-endian elements of `N` bytes each, widened by `f`.
fn widen<const N: usize>(data: &[u8], f: impl Fn([u8; N]) -> f32) -> Vec<f32> {
    data.chunks_exact(N)
        .map(|c| f(c.try_into().expect("N bytes")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    #[test]
    fn every_float_dtype_is_read_in_file_order_and_the_rest_is_refused() {
        let dir = std::env::temp_dir().join(format!("rz-weights-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f32s: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let b16: Vec<u8> = [bf16::from_f32(0.25)]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let h16: Vec<u8> = [f16::from_f32(-3.0), f16::from_f32(4.0)]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let t = |d, shape: &[usize], data| TensorView::new(d, shape.to_vec(), data).unwrap();
        let file = dir.join("w.safetensors");
        safetensors::serialize_to_file(
            [
                ("z.weight", t(Dtype::F32, &[2, 1], &f32s)),
                ("a.bias", t(Dtype::BF16, &[1], &b16)),
                ("m.scale", t(Dtype::F16, &[2], &h16)),
            ],
            None,
            &file,
        )
        .unwrap();
        let w = Weights::from_safetensors(&file).unwrap();
        let names: Vec<&str> = w.specs().iter().map(|s| s.name.as_str()).collect();
        // The serializer orders by dtype alignment and name; the engine's order is the file's.
        assert_eq!(names.len(), 3);
        assert_eq!(w.get("z.weight").unwrap(), [1.5, -2.0]);
        assert_eq!(w.get("a.bias").unwrap(), [0.25]);
        assert_eq!(w.get("m.scale").unwrap(), [-3.0, 4.0]);
        let z = names.iter().position(|n| *n == "z.weight").unwrap();
        assert_eq!(
            (w.specs()[z].shape.as_slice(), w.init(z, 1)),
            (&[2, 1][..], -2.0)
        );
        let ints = dir.join("i.safetensors");
        let i64s: Vec<u8> = 7i64.to_le_bytes().to_vec();
        safetensors::serialize_to_file([("ids", t(Dtype::I64, &[1], &i64s))], None, &ints).unwrap();
        let e = Weights::from_safetensors(&ints).unwrap_err().to_string();
        assert!(e.contains("tensor `ids` is I64"), "{e}");
        std::fs::write(dir.join("x"), b"not a model").unwrap();
        let e = Weights::from_safetensors(dir.join("x"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("is not a safetensors file"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
