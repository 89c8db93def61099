//! A model's parameter count from its Hugging Face `config.json`, the kilobyte a user has before
//! downloading any weight, for the decoder families whose config fixes every tensor's shape:
//! Llama and the models built like it (Mistral, Mixtral, Qwen2, Qwen3, Gemma, Gemma 2, Phi-3),
//! GPT-2 and GPT-NeoX (Pythia). Each family's count is the tensors `transformers` builds for it,
//! so it is the published checkpoint's element count (the tests hold published models' totals).
//! Any other `model_type`, and a multimodal config, is refused: a count that leaves out a
//! vision tower or a family's extra tensors would plan memory that is not there.

use std::path::Path;

use serde_json::{Map, Value};

/// How a Llama-like decoder varies from Llama itself, as `transformers` builds each family
/// (its modeling code reads some switches of the config and ignores others; its config class
/// supplies what a config leaves out).
struct Decoder {
    /// The family reads `attention_bias` (biases on Q, K, V and O): Llama, Qwen3, the Gemmas.
    attention_bias: bool,
    /// The family reads `mlp_bias` (biases on the MLP's three projections): Llama.
    mlp_bias: bool,
    /// Q, K and V carry a bias whatever the config says (Qwen2).
    qkv_bias: bool,
    /// RMS norms on each head's query and key (Qwen3).
    qk_norm: bool,
    /// Norms per block: 2, or 4 with the norms after attention and MLP (Gemma 2).
    norms: u128,
    /// `tie_word_embeddings` when the config leaves it out.
    tied: bool,
    /// `head_dim` when the config leaves it out; `None`: width / heads.
    head_dim: Option<u128>,
    /// `num_key_value_heads` when the config leaves it out; `None`: as many as the heads.
    kv_heads: Option<u128>,
    /// A mixture of `num_local_experts` MLPs behind a router (Mixtral).
    experts: bool,
}

const LLAMA: Decoder = Decoder {
    attention_bias: true,
    mlp_bias: true,
    qkv_bias: false,
    qk_norm: false,
    norms: 2,
    tied: false,
    head_dim: None,
    kv_heads: None,
    experts: false,
};

/// Llama with no switch to read.
const PLAIN: Decoder = Decoder {
    attention_bias: false,
    mlp_bias: false,
    ..LLAMA
};

fn decoder(model_type: &str) -> Option<Decoder> {
    Some(match model_type {
        "llama" => LLAMA,
        "phi3" => PLAIN,
        "mistral" => Decoder {
            kv_heads: Some(8),
            ..PLAIN
        },
        "mixtral" => Decoder {
            experts: true,
            kv_heads: Some(8),
            ..PLAIN
        },
        "qwen2" => Decoder {
            qkv_bias: true,
            kv_heads: Some(32),
            ..PLAIN
        },
        "qwen3" => Decoder {
            mlp_bias: false,
            qk_norm: true,
            head_dim: Some(128),
            kv_heads: Some(32),
            ..LLAMA
        },
        "gemma" => Decoder {
            mlp_bias: false,
            tied: true,
            head_dim: Some(256),
            kv_heads: Some(16),
            ..LLAMA
        },
        "gemma2" => Decoder {
            mlp_bias: false,
            tied: true,
            head_dim: Some(256),
            kv_heads: Some(4),
            norms: 4,
            ..LLAMA
        },
        _ => return None,
    })
}

const FAMILIES: &str =
    "llama, mistral, mixtral, qwen2, qwen3, gemma, gemma2, phi3, gpt2 and gpt_neox";

/// The parameters of the model `path` (a `config.json`) describes.
pub(crate) fn params_in_config(path: &Path) -> Result<u64, String> {
    let name = path.display();
    let text = std::fs::read_to_string(path).map_err(|e| format!("{name}: {e}"))?;
    let json: Value = serde_json::from_str(&text)
        .map_err(|e| format!("{name}: not a model's config.json ({e})"))?;
    params_of(&json, &name)
}

/// The parameters of the model a parsed config describes; `name` names it in errors.
fn params_of(json: &Value, name: &dyn std::fmt::Display) -> Result<u64, String> {
    let Some(map) = json.as_object() else {
        return Err(format!(
            "{name}: not a model's config.json (not a JSON object)"
        ));
    };
    if map.contains_key("weight_map") {
        return Err(format!(
            "{name}: the index of a sharded checkpoint, which names the shards but not the \
             tensors' shapes: give the directory holding the shards, or the model's config.json"
        ));
    }
    let f = Fields { map, name };
    let Some(model_type) = map.get("model_type").and_then(Value::as_str) else {
        return Err(format!(
            "{name}: no `model_type`: not a Hugging Face model config (ringzero counts {FAMILIES} \
             from their config.json; for another model give --params its .safetensors files or \
             its count, e.g. 7.5B)"
        ));
    };
    if let Some(key) = ["text_config", "vision_config", "audio_config"]
        .into_iter()
        .find(|k| map.contains_key(*k))
    {
        return Err(format!(
            "{name}: a multimodal model's config (`{key}`): ringzero counts only the text \
             decoders {FAMILIES} from a config; give --params the model's .safetensors files \
             or its count (e.g. 7.5B)"
        ));
    }
    let n = match model_type {
        "gpt2" => gpt2(&f)?,
        "gpt_neox" => gpt_neox(&f)?,
        t => match decoder(t) {
            Some(d) => llama_like(&f, &d)?,
            None => {
                return Err(format!(
                    "{name}: model_type `{t}` is not one ringzero counts from a config (it \
                     counts {FAMILIES}); give --params the model's .safetensors files or its \
                     count (e.g. 7.5B)"
                ))
            }
        },
    };
    u64::try_from(n)
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("{name}: its sizes give {n} parameters, not a model to plan for"))
}

/// The largest size a config may give (2^24): far above any model's, and small enough that no
/// product of a model's sizes overflows the `u128` it is counted in.
const MAX_SIZE: u64 = 1 << 24;

/// The config's fields, each error naming the file and the field.
struct Fields<'a> {
    map: &'a Map<String, Value>,
    name: &'a dyn std::fmt::Display,
}

impl Fields<'_> {
    /// A positive integer the family needs; absent or `null` gives `default`, or an error when
    /// there is none.
    fn size(&self, key: &str, default: Option<u128>) -> Result<u128, String> {
        match self.map.get(key) {
            None | Some(Value::Null) => default.ok_or_else(|| {
                format!(
                    "{}: no `{key}`, which this model's parameter count needs",
                    self.name
                )
            }),
            Some(v) => v
                .as_u64()
                .filter(|&x| x > 0 && x <= MAX_SIZE)
                .map(u128::from)
                .ok_or_else(|| {
                    format!(
                        "{}: `{key}` is {v}, not a whole number from 1 to {MAX_SIZE}",
                        self.name
                    )
                }),
        }
    }

    fn flag(&self, key: &str, default: bool) -> Result<bool, String> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(format!("{}: `{key}` is {v}, not true or false", self.name)),
        }
    }
}

/// Llama: token embeddings; per block attention (Q, K, V, O over `num_key_value_heads` shared
/// key/value heads), a gated MLP (gate, up, down) and two RMS norms; a final norm; the head,
/// unless tied to the embeddings.
fn llama_like(f: &Fields, d: &Decoder) -> Result<u128, String> {
    let dim = f.size("hidden_size", None)?;
    let layers = f.size("num_hidden_layers", None)?;
    let vocab = f.size("vocab_size", None)?;
    let inner = f.size("intermediate_size", None)?;
    let heads = f.size("num_attention_heads", None)?;
    // Left out, the family's default; `null`, as many as the heads (as the config classes do).
    let kv = match f.map.get("num_key_value_heads") {
        None => d.kv_heads.unwrap_or(heads),
        Some(_) => f.size("num_key_value_heads", Some(heads))?,
    };
    let head_dim = match (d.head_dim, f.map.get("head_dim")) {
        (Some(h), None) => h,
        _ => f.size("head_dim", (dim % heads == 0).then_some(dim / heads))?,
    };
    let (q, k) = (heads * head_dim, kv * head_dim);
    let attn_bias = d.attention_bias && f.flag("attention_bias", false)?;
    let mut attn = dim * q + 2 * dim * k + q * dim;
    if attn_bias || d.qkv_bias {
        attn += q + 2 * k;
    }
    if attn_bias {
        attn += dim;
    }
    if d.qk_norm {
        attn += 2 * head_dim;
    }
    let mut mlp = 3 * dim * inner;
    if d.mlp_bias && f.flag("mlp_bias", false)? {
        mlp += 2 * inner + dim;
    }
    if d.experts {
        let experts = f.size("num_local_experts", None)?;
        mlp = experts * mlp + dim * experts;
    }
    let block = attn + mlp + d.norms * dim;
    let embed = vocab * dim;
    let head = if f.flag("tie_word_embeddings", d.tied)? {
        0
    } else {
        embed
    };
    Ok(embed + layers * block + dim + head)
}

/// GPT-2: token and position embeddings; per block two layer norms (weight and bias), the fused
/// QKV projection and the output projection, and the MLP, all with biases; a final layer norm;
/// the head, tied to the token embeddings unless the config says not.
fn gpt2(f: &Fields) -> Result<u128, String> {
    let dim = f.size("n_embd", None)?;
    let layers = f.size("n_layer", None)?;
    let vocab = f.size("vocab_size", None)?;
    let positions = f.size("n_positions", None)?;
    let inner = f.size("n_inner", Some(4 * dim))?;
    let block =
        2 * 2 * dim + (3 * dim * dim + 3 * dim) + (dim * dim + dim) + 2 * dim * inner + inner + dim;
    let head = if f.flag("tie_word_embeddings", true)? {
        0
    } else {
        vocab * dim
    };
    Ok(vocab * dim + positions * dim + layers * block + 2 * dim + head)
}

/// GPT-NeoX (Pythia): token embeddings; per block two layer norms, the fused QKV and output
/// projections (with biases unless `attention_bias` is false) and the MLP with biases; a final
/// layer norm; the head (`embed_out`, no bias) unless tied.
fn gpt_neox(f: &Fields) -> Result<u128, String> {
    let dim = f.size("hidden_size", None)?;
    let layers = f.size("num_hidden_layers", None)?;
    let vocab = f.size("vocab_size", None)?;
    let inner = f.size("intermediate_size", None)?;
    let bias = u128::from(f.flag("attention_bias", true)?);
    let attn = 3 * dim * dim + 3 * dim * bias + dim * dim + dim * bias;
    let block = 2 * 2 * dim + attn + 2 * dim * inner + inner + dim;
    let embed = vocab * dim;
    let head = if f.flag("tie_word_embeddings", false)? {
        0
    } else {
        embed
    };
    Ok(embed + layers * block + 2 * dim + head)
}

#[cfg(test)]
mod tests {
    use super::{params_in_config, params_of};
    use std::path::PathBuf;

    fn fixtures() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf-configs")
    }

    /// Every published config in `tests/fixtures/hf-configs/` gives its model's published
    /// parameter count, to the parameter.
    #[test]
    fn published_configs_give_their_models_published_counts() {
        let published: &[(&str, u64)] = &[
            ("gpt2.json", 124_439_808),
            ("pythia-160m.json", 162_322_944),
            ("qwen2-0.5b.json", 494_032_768),
            ("qwen3-0.6b.json", 596_049_920),
            ("tinyllama-1.1b.json", 1_100_048_384),
            ("phi-3-mini-4k-instruct.json", 3_821_079_552),
            ("llama-2-7b-hf.json", 6_738_415_616),
            ("mistral-7b-v0.1.json", 7_241_732_096),
            ("meta-llama-3-8b.json", 8_030_261_248),
            ("gemma-7b.json", 8_537_680_896),
            ("gemma-2-9b.json", 9_241_705_984),
            ("mixtral-8x7b-v0.1.json", 46_702_792_704),
        ];
        let mut files: Vec<String> = std::fs::read_dir(fixtures())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".json"))
            .collect();
        files.sort();
        let mut listed: Vec<String> = published.iter().map(|(n, _)| n.to_string()).collect();
        listed.sort();
        assert_eq!(files, listed, "every fixture has its published count here");
        for &(file, count) in published {
            assert_eq!(
                params_in_config(&fixtures().join(file)),
                Ok(count),
                "{file}"
            );
        }
    }

    /// Random small configs of every family, each with the count `transformers` gives the
    /// model it builds (`tests/fixtures/hf-config-counts.json`, written by
    /// `scripts/hf-config-counts.py`): the switches each family reads, and those it ignores,
    /// count as `transformers` counts them.
    #[test]
    fn random_configs_count_as_transformers_builds_them() {
        let path = fixtures().join("../hf-config-counts.json");
        let fixture: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let entries = fixture["entries"].as_array().unwrap();
        assert!(entries.len() >= 100);
        for (i, e) in entries.iter().enumerate() {
            let want = e["params"].as_u64().unwrap();
            assert_eq!(
                params_of(&e["config"], &format!("entry {i}")),
                Ok(want),
                "entry {i}: {}",
                e["config"]
            );
        }
    }

    /// The count of a config given as JSON text.
    fn count_of(json: &str) -> Result<u64, String> {
        params_of(&serde_json::from_str(json).unwrap(), &"config.json")
    }

    fn refused(json: &str) -> String {
        count_of(json).unwrap_err()
    }

    #[test]
    fn what_it_cannot_count_is_refused_naming_why() {
        let e = refused(r#"{"model_type": "mamba", "hidden_size": 768}"#);
        assert!(
            e.contains("model_type `mamba` is not one ringzero counts"),
            "{e}"
        );
        assert!(e.contains(".safetensors files or its count"), "{e}");
        let e = refused(r#"{"model_type": "llava", "text_config": {"model_type": "llama"}}"#);
        assert!(
            e.contains("multimodal model's config (`text_config`)"),
            "{e}"
        );
        let e = refused(r#"{"hidden_size": 768}"#);
        assert!(e.contains("no `model_type`"), "{e}");
        let e = refused(r#"{"metadata": {"total_size": 1}, "weight_map": {"a": "b"}}"#);
        assert!(e.contains("the index of a sharded checkpoint"), "{e}");
        let e = refused(
            r#"{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                "vocab_size": 100, "num_attention_heads": 4}"#,
        );
        assert!(e.contains("no `intermediate_size`"), "{e}");
        let e = refused(
            r#"{"model_type": "gpt2", "n_embd": -768, "n_layer": 2, "vocab_size": 100,
                "n_positions": 64}"#,
        );
        assert!(
            e.contains("`n_embd` is -768, not a whole number from 1 to 16777216"),
            "{e}"
        );
        let e = refused(
            r#"{"model_type": "gpt_neox", "hidden_size": 64, "num_hidden_layers": 2,
                "vocab_size": 100, "intermediate_size": 256, "tie_word_embeddings": "no"}"#,
        );
        assert!(
            e.contains("`tie_word_embeddings` is \"no\", not true or false"),
            "{e}"
        );
        // Not JSON at all: the file's reader names it.
        let path =
            std::env::temp_dir().join(format!("ringzero-hf-bad-{}.json", std::process::id()));
        std::fs::write(&path, "{\"model_type\": ").unwrap();
        let e = params_in_config(&path).unwrap_err();
        std::fs::remove_file(&path).unwrap();
        assert!(e.contains("not a model's config.json"), "{e}");
    }

    /// The switches a config may turn on add the tensors they name: biases on attention and
    /// MLP, a head of its own, a head_dim that is not width / heads.
    #[test]
    fn a_configs_switches_add_their_tensors() {
        let base = r#""model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
            "vocab_size": 100, "intermediate_size": 256, "num_attention_heads": 4,
            "num_key_value_heads": 2"#;
        let count = |extra: &str| count_of(&format!("{{{base}{extra}}}")).unwrap();
        // Per block: q 64·64, k and v 64·32 each, o 64·64; MLP 3·64·256; two norms of 64.
        let block = 64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 256 + 2 * 64;
        let plain = 100 * 64 * 2 + 2 * block + 64;
        assert_eq!(count(""), plain);
        assert_eq!(count(r#", "tie_word_embeddings": true"#), plain - 6400);
        assert_eq!(
            count(r#", "attention_bias": true"#),
            plain + 2 * (64 + 32 + 32 + 64)
        );
        assert_eq!(count(r#", "mlp_bias": true"#), plain + 2 * (256 * 2 + 64));
        // 4 heads of 32 over a width of 64: q and o are 64×128, k and v 64×64.
        assert_eq!(
            count(r#", "head_dim": 32, "extra": null"#),
            plain + 2 * (2 * 64 * 64 + 2 * 64 * 32)
        );
    }
}
