//! A model's parameter count from its files as published: one safetensors file, or a
//! directory of them (a Hugging Face checkpoint sharded as `model-00001-of-00004.safetensors`
//! ...), read from the files' headers alone; or, before any weight is downloaded, the model's
//! `config.json` ([`super::hf_config`]); so `ringzero mem --params` can take a model as a user
//! has it.

use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::SafeTensors;

/// The parameters (elements of every tensor) in `path`: a `.safetensors` file, or every
/// `.safetensors` file directly in a directory; a `.json` file, or a directory with no
/// safetensors file but a `config.json`, is counted from the config.
pub(crate) fn params_in(path: &Path) -> Result<u64, String> {
    if path.extension().is_some_and(|x| x == "json") {
        return super::hf_config::params_in_config(path);
    }
    let files: Vec<PathBuf> = if path.is_dir() {
        let mut fs: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|e| format!("{}: {e}", path.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        fs.sort();
        if fs.is_empty() {
            let config = path.join("config.json");
            if config.is_file() {
                return super::hf_config::params_in_config(&config);
            }
            return Err(format!(
                "{}: a directory with no .safetensors file and no config.json in it",
                path.display()
            ));
        }
        fs
    } else {
        vec![path.to_path_buf()]
    };
    files.iter().map(|f| params_in_file(f)).sum()
}

fn params_in_file(path: &Path) -> Result<u64, String> {
    let bad = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let file = std::fs::File::open(path).map_err(|e| bad(&e))?;
    // SAFETY: the map is read-only and private to this process, and only its header and
    // length are read (the tensors' bytes are never touched); a file truncated meanwhile by
    // another process would fault on access, as reading a model being rewritten would fail
    // any reader.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| bad(&e))?;
    let (_, meta) = SafeTensors::read_metadata(&map)
        .map_err(|e| bad(&format!("not a safetensors file ({e})")))?;
    Ok(meta
        .tensors()
        .values()
        .map(|t| t.shape.iter().product::<usize>() as u64)
        .sum())
}

#[cfg(test)]
mod tests {
    use super::params_in;
    use std::path::PathBuf;

    fn write(path: &std::path::Path, tensors: &[(&str, Vec<usize>)]) {
        let data: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
            .iter()
            .map(|(n, s)| {
                (
                    n.to_string(),
                    vec![0u8; 2 * s.iter().product::<usize>()],
                    s.clone(),
                )
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView)> = data
            .iter()
            .map(|(n, b, s)| {
                let v =
                    safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, s.clone(), b)
                        .unwrap();
                (n.clone(), v)
            })
            .collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    #[test]
    fn a_file_or_a_directory_of_shards_counts_every_tensor() {
        let dir = std::env::temp_dir().join(format!("ringzero-model-files-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let one = dir.join("model-00001-of-00002.safetensors");
        write(
            &one,
            &[("embed.weight", vec![100, 8]), ("norm.weight", vec![8])],
        );
        write(
            &dir.join("model-00002-of-00002.safetensors"),
            &[("head.weight", vec![8, 100])],
        );
        // The weights count, not the config, where both are there.
        let gpt2 = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/hf-configs/gpt2.json");
        std::fs::copy(&gpt2, dir.join("config.json")).unwrap();
        assert_eq!(params_in(&one), Ok(808));
        assert_eq!(params_in(&dir), Ok(1608));
        assert_eq!(params_in(&dir.join("config.json")), Ok(124_439_808));
        std::fs::write(dir.join("config.json.bak"), "{}").unwrap();
        let e = params_in(&dir.join("config.json.bak")).unwrap_err();
        assert!(e.contains("config.json.bak: not a safetensors file"), "{e}");
        // A directory with the config alone: a model before its weights are downloaded.
        let config_only = dir.join("config-only");
        std::fs::create_dir_all(&config_only).unwrap();
        std::fs::copy(&gpt2, config_only.join("config.json")).unwrap();
        assert_eq!(params_in(&config_only), Ok(124_439_808));
        let empty = dir.join("empty");
        std::fs::create_dir_all(&empty).unwrap();
        assert!(params_in(&empty)
            .unwrap_err()
            .contains("no .safetensors file and no config.json"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
