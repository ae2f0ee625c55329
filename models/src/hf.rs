//! Hugging Face model directories for the Llama (`Arch::Llama`): what
//! `LlamaForCausalLM.from_pretrained(DIR)` loads, and what its
//! `save_pretrained(DIR)` writes.
//!
//! [`write_dir`] writes:
//! - `config.json`: a `LlamaConfig` (`architectures: ["LlamaForCausalLM"]`,
//!   the sizes, `rope_theta`, `rms_norm_eps`, `vocab_size`,
//!   `tie_word_embeddings`, `max_position_embeddings` = the context);
//! - `model.safetensors`: every parameter as f32 under its Hugging Face
//!   name (the Llama's variables carry those names already; a tied head
//!   has no `lm_head.weight`), with the metadata `format = pt` that
//!   `transformers` asks for and Shoal's own model-file metadata;
//! - `generation_config.json`;
//! - `tokenizer.json`: the tokenizer the model was trained with, or for a
//!   byte vocabulary (256 tokens) a byte-level BPE without merges whose
//!   token `i` is byte `i`, so the `tokenizers` library encodes text
//!   exactly as Shoal's `text:PATH` does without a tokenizer.
//!
//! [`read_dir`] reads such a directory, or one `transformers` wrote: f32,
//! bf16 or f16 weights in one `model.safetensors`, a Llama config without
//! rope scaling and without biases.

use std::collections::HashMap;
use std::path::Path;

use serde_json::{json, Value};

use crate::checkpoint::{ckpt_err, le_bytes, save_f32, to_json, write_atomic};
use crate::data::ImageShape;
use crate::error::{ModelError, Result};
use crate::llama::{Float, LlamaSize};
use crate::model::{Arch, ModelConfig};
use crate::modelfile::{ModelFile, ModelMeta, MODEL_FORMAT};
use crate::tokenizer::Tokenizer;

/// The weights file's name in a Hugging Face directory.
pub const WEIGHTS: &str = "model.safetensors";
/// The tokenizer file's name in a Hugging Face directory.
pub const TOKENIZER: &str = "tokenizer.json";

/// `config.json` for a Llama config; an error for other architectures.
pub fn config_json(model: &ModelConfig) -> Result<Value> {
    let Arch::Llama { size: s, context } = &model.arch else {
        return Err(ModelError::Config(format!(
            "{} has no Hugging Face form: only --model llama is written as a LlamaForCausalLM",
            model.describe()
        )));
    };
    Ok(json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": model.classes,
        "hidden_size": s.width,
        "intermediate_size": s.ff,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim(),
        "max_position_embeddings": context,
        "rms_norm_eps": s.norm_eps.0,
        "rope_theta": s.rope_theta.0,
        "rope_scaling": null,
        "tie_word_embeddings": s.tie,
        "hidden_act": "silu",
        "attention_bias": false,
        "attention_dropout": 0.0,
        "mlp_bias": false,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": true,
        "torch_dtype": "float32",
    }))
}

/// GPT-2's map of bytes to printable characters (what a byte-level BPE
/// sees): printable Latin-1 bytes stand for themselves, the rest take the
/// code points from 256 up, in order.
fn byte_chars() -> Vec<char> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut next = 256u32;
    (0u32..256)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            char::from_u32(c).unwrap_or('?')
        })
        .collect()
}

/// A `tokenizer.json` (Hugging Face `tokenizers`) whose token `i` is byte
/// `i`: byte-level pre-tokenization without splitting, a BPE with no
/// merges, and the byte-level decoder.
pub fn byte_tokenizer_json() -> Value {
    let vocab: serde_json::Map<String, Value> =
        byte_chars().into_iter().enumerate().map(|(i, c)| (c.to_string(), json!(i))).collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": [],
        },
    })
}

fn write_json(path: &Path, value: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| ModelError::Invalid(format!("cannot encode: {e}")))?;
    write_atomic(path, format!("{text}\n").as_bytes())
}

/// Write `file` (a Llama) as a Hugging Face model directory at `dir`
/// (created if missing; the four files replaced atomically one by one).
/// The `tokenizer.json` is `tokenizer`'s, which must have the model's
/// vocabulary, or without one the byte tokenizer for a byte model; its
/// end-of-text token goes into the configs as `eos_token_id`.
pub fn write_dir(file: &ModelFile, dir: &Path, tokenizer: Option<&Tokenizer>) -> Result<()> {
    let mut config = config_json(&file.model)?;
    if let Some(t) = tokenizer.filter(|t| t.vocab_size() != file.model.classes) {
        return Err(ModelError::Config(format!(
            "the tokenizer has {} tokens, but the model's vocabulary is {}",
            t.vocab_size(),
            file.model.classes
        )));
    }
    let eos = tokenizer.and_then(Tokenizer::eos);
    let mut generation = json!({"do_sample": true, "temperature": 0.8, "top_k": 0});
    if let Some(eos) = eos {
        config["eos_token_id"] = json!(eos);
        generation["eos_token_id"] = json!(eos);
    }
    let layout = crate::checkpoint::layout_for(&file.model)?;
    if file.params.len() != layout.total_len() {
        return Err(ModelError::FlatLength { expected: layout.total_len(), got: file.params.len() });
    }
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let blobs: Vec<(String, Vec<usize>, Vec<u8>)> =
        layout.entries().iter().map(|e| (e.name.clone(), e.shape.clone(), le_bytes(&file.params[e.range()]))).collect();
    let m = &file.meta;
    let mut meta = HashMap::from([
        ("format".to_string(), "pt".to_string()),
        ("shoal.format".to_string(), MODEL_FORMAT.to_string()),
        ("shoal.model".to_string(), to_json(&file.model)?),
        ("shoal.run_id".to_string(), m.run_id.clone()),
        ("shoal.step".to_string(), m.step.to_string()),
        ("shoal.seed".to_string(), m.seed.to_string()),
        ("shoal.dataset".to_string(), m.dataset.clone()),
    ]);
    if let Some(l) = m.loss {
        meta.insert("shoal.loss".to_string(), l.to_string());
    }
    save_f32(&dir.join(WEIGHTS), &blobs, meta)?;
    write_json(&dir.join("config.json"), &config)?;
    write_json(&dir.join("generation_config.json"), &generation)?;
    match tokenizer {
        Some(t) => t.save(&dir.join(TOKENIZER))?,
        None if file.model.classes == 256 => write_json(&dir.join(TOKENIZER), &byte_tokenizer_json())?,
        None => {}
    }
    Ok(())
}

/// A model file, or a Hugging Face Llama directory read at the context of
/// `expect` when given: what `shoal eval`, `shoal generate` and `--init`
/// read. With `expect`, the model must equal it.
pub fn load_model(path: &Path, expect: Option<&ModelConfig>) -> Result<ModelFile> {
    if !is_hf_dir(path) {
        return ModelFile::load(path, expect);
    }
    let file = read_dir(path, expect.and_then(ModelConfig::context))?;
    match expect {
        Some(want) if *want != file.model => {
            Err(ckpt_err(path, format!("holds model {}, but {} was requested", file.model.describe(), want.describe())))
        }
        _ => Ok(file),
    }
}

/// The tokenizer of a model over tokens, read from `path` (a model file
/// or directory): `given` when there is one; else the directory's
/// `tokenizer.json`; else the tokenizer of the token directory the model was
/// trained on. A byte model (256 tokens) needs none and gets `None`.
pub fn tokenizer_for(path: &Path, file: &ModelFile, given: Option<&Path>) -> Result<Option<Tokenizer>> {
    let vocab = file.model.classes;
    let tokenizer = match given {
        Some(p) => Tokenizer::from_file(p)?,
        None if vocab == 256 => return Ok(None),
        None if is_hf_dir(path) && path.join(TOKENIZER).is_file() => Tokenizer::from_file(&path.join(TOKENIZER))?,
        None => match file.meta.dataset.parse::<crate::data::DatasetKind>() {
            Ok(crate::data::DatasetKind::Tokens { dir, .. }) => {
                Tokenizer::from_file(&dir.join(crate::data::tokens::TOKENIZER_FILE))?
            }
            _ => {
                return Err(ckpt_err(
                    path,
                    format!("its vocabulary of {vocab} tokens is not bytes: pass the tokenizer it was trained with (--tokenizer)"),
                ))
            }
        },
    };
    if tokenizer.vocab_size() != vocab {
        return Err(ckpt_err(
            path,
            format!("its vocabulary is {vocab} tokens, but the tokenizer has {}", tokenizer.vocab_size()),
        ));
    }
    Ok(Some(tokenizer))
}

/// Whether `path` is a Hugging Face model directory (it holds a
/// `config.json`).
pub fn is_hf_dir(path: &Path) -> bool {
    path.is_dir() && path.join("config.json").is_file()
}

/// The Llama config of a `config.json`: its size, vocabulary and
/// `max_position_embeddings`. A config this Llama cannot compute exactly
/// (rope scaling, biases, another activation) is refused by name.
pub fn read_config(path: &Path, config: &Value) -> Result<(LlamaSize, usize, usize)> {
    let bad = |m: String| ckpt_err(path, m);
    let kind = config.get("model_type").and_then(Value::as_str).unwrap_or("");
    if kind != "llama" {
        return Err(bad(format!("model_type `{kind}`: only Llama models (`llama`) are read")));
    }
    let int = |k: &str| -> Result<usize> {
        config.get(k).and_then(Value::as_u64).map(|v| v as usize).ok_or_else(|| bad(format!("no integer `{k}`")))
    };
    let real = |k: &str, default: f64| config.get(k).and_then(Value::as_f64).unwrap_or(default);
    let flag = |k: &str, default: bool| config.get(k).and_then(Value::as_bool).unwrap_or(default);
    if config.get("rope_scaling").is_some_and(|v| !v.is_null()) {
        return Err(bad("`rope_scaling` is set: scaled rotary embeddings are not supported".into()));
    }
    for k in ["attention_bias", "mlp_bias"] {
        if flag(k, false) {
            return Err(bad(format!("`{k}` is true: this Llama has no biases")));
        }
    }
    let act = config.get("hidden_act").and_then(Value::as_str).unwrap_or("silu");
    if act != "silu" {
        return Err(bad(format!("hidden_act `{act}`: only silu (SwiGLU) is supported")));
    }
    let heads = int("num_attention_heads")?;
    let width = int("hidden_size")?;
    let size = LlamaSize {
        layers: int("num_hidden_layers")?,
        heads,
        kv_heads: config.get("num_key_value_heads").and_then(Value::as_u64).map_or(heads, |v| v as usize),
        width,
        ff: int("intermediate_size")?,
        // transformers' LlamaConfig ties by default.
        tie: flag("tie_word_embeddings", true),
        rope_theta: Float(real("rope_theta", 10_000.0)),
        norm_eps: Float(real("rms_norm_eps", 1e-6)),
    };
    if let Some(hd) = config.get("head_dim").and_then(Value::as_u64) {
        if hd as usize != size.head_dim() {
            return Err(bad(format!("head_dim {hd} is not hidden_size / num_attention_heads ({})", size.head_dim())));
        }
    }
    Ok((size, int("vocab_size")?, int("max_position_embeddings").unwrap_or(2048)))
}

/// Read a Hugging Face Llama directory as a model of `context` tokens
/// (none: its `max_position_embeddings`). Weights in f32, bf16 or f16 are
/// read as f32; a tied model's `lm_head.weight`, where one is stored
/// anyway, must equal the embedding.
pub fn read_dir(dir: &Path, context: Option<usize>) -> Result<ModelFile> {
    let config_path = dir.join("config.json");
    let text = std::fs::read_to_string(&config_path).map_err(|e| ModelError::io(&config_path, e))?;
    let config: Value =
        serde_json::from_str(&text).map_err(|e| ckpt_err(&config_path, format!("not valid JSON: {e}")))?;
    let (size, vocab, positions) = read_config(&config_path, &config)?;
    let context = context.unwrap_or(positions);
    let model = ModelConfig {
        arch: Arch::Llama { size, context },
        input: ImageShape { channels: 1, height: 1, width: context + 1 },
        classes: vocab,
    };
    model.validate().map_err(|e| ckpt_err(&config_path, format!("{e}")))?;
    let weights = dir.join(WEIGHTS);
    if !weights.is_file() {
        return Err(ckpt_err(
            dir,
            format!(
                "no {WEIGHTS} (sharded or .bin weights are not read; save with safe_serialization=True in one file)"
            ),
        ));
    }
    let bytes = std::fs::read(&weights).map_err(|e| ModelError::io(&weights, e))?;
    let (_, stored) = crate::checkpoint::parse(&weights, &bytes)?;
    let tensors = candle_core::safetensors::load_buffer(&bytes, &candle_core::Device::Cpu)
        .map_err(|e| ckpt_err(&weights, format!("cannot read: {e}")))?;
    let layout = crate::checkpoint::layout_for(&model)?;
    let mut params = Vec::with_capacity(layout.total_len());
    for e in layout.entries() {
        let t = tensors.get(&e.name).ok_or_else(|| ckpt_err(&weights, format!("missing tensor `{}`", e.name)))?;
        if t.dims() != e.shape.as_slice() {
            return Err(ckpt_err(
                &weights,
                format!("tensor `{}` has shape {:?}, config.json makes it {:?}", e.name, t.dims(), e.shape),
            ));
        }
        let values = t
            .to_dtype(candle_core::DType::F32)
            .and_then(|t| t.flatten_all()?.to_vec1::<f32>())
            .map_err(|err| ckpt_err(&weights, format!("tensor `{}`: {err}", e.name)))?;
        params.extend(values);
    }
    // A tied model may store its head anyway; it must be the embedding.
    if let (true, Some(head)) = (size.tie, tensors.get("lm_head.weight")) {
        let embed = tensors.get("model.embed_tokens.weight");
        let same = embed.is_some_and(|e| {
            let flat = |t: &candle_core::Tensor| t.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>();
            matches!((flat(e), flat(head)), (Ok(a), Ok(b)) if a == b)
        });
        if !same {
            return Err(ckpt_err(
                &weights,
                "tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight",
            ));
        }
    }
    let mut extra: Vec<&String> = tensors.keys().filter(|n| layout.entry(n).is_none()).collect();
    extra.retain(|n| !(n.ends_with("rotary_emb.inv_freq") || size.tie && n.as_str() == "lm_head.weight"));
    if !extra.is_empty() {
        extra.sort_unstable();
        return Err(ckpt_err(&weights, format!("unexpected tensors {extra:?} for {}", model.describe())));
    }
    // Where Shoal wrote the directory, its model-file metadata says where
    // the model came from; `transformers` writes none of it.
    let text = |k: &str| stored.get(k).cloned().unwrap_or_default();
    let number = |k: &str| stored.get(k).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    let meta = ModelMeta {
        run_id: text("shoal.run_id"),
        step: number("shoal.step"),
        seed: number("shoal.seed"),
        dataset: text("shoal.dataset"),
        accuracy: None,
        loss: stored.get("shoal.loss").and_then(|v| v.parse().ok()),
    };
    Ok(ModelFile { model, params, meta })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Model, TrainableModel};

    fn llama(tie: bool) -> ModelConfig {
        let size = LlamaSize { layers: 2, heads: 4, kv_heads: 2, width: 16, ff: 24, tie, ..LlamaSize::default() };
        ModelConfig {
            arch: Arch::Llama { size, context: 8 },
            input: ImageShape { channels: 1, height: 1, width: 9 },
            classes: 256,
        }
    }

    #[test]
    fn a_written_directory_reads_back_bit_for_bit() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        for tie in [true, false] {
            let model = Model::new(llama(tie), 7, &candle_core::Device::Cpu)?;
            let file = ModelFile {
                model: model.config().clone(),
                params: model.parameters()?,
                meta: ModelMeta { run_id: "t".into(), step: 3, ..ModelMeta::default() },
            };
            let at = dir.path().join(format!("tie-{tie}"));
            write_dir(&file, &at, None)?;
            assert!(is_hf_dir(&at));
            let back = read_dir(&at, None)?;
            assert_eq!(back.model, file.model);
            assert_eq!(back.params, file.params);
            let config: Value = serde_json::from_str(&std::fs::read_to_string(at.join("config.json"))?)?;
            assert_eq!(config["tie_word_embeddings"], json!(tie));
            assert_eq!(config["num_key_value_heads"], json!(2));
            let tokenizer: Value = serde_json::from_str(&std::fs::read_to_string(at.join("tokenizer.json"))?)?;
            assert_eq!(tokenizer["model"]["vocab"].as_object().map(|v| v.len()), Some(256));
        }
        Ok(())
    }

    #[test]
    fn configs_it_cannot_compute_are_refused_by_name() {
        let base = config_json(&llama(true)).unwrap_or_default();
        let path = Path::new("config.json");
        assert!(read_config(path, &base).is_ok());
        for (key, value, says) in [
            ("rope_scaling", json!({"type": "linear", "factor": 2.0}), "rope_scaling"),
            ("attention_bias", json!(true), "attention_bias"),
            ("hidden_act", json!("gelu"), "hidden_act"),
            ("model_type", json!("mistral"), "model_type"),
            ("head_dim", json!(8), "head_dim"),
        ] {
            let mut c = base.clone();
            c[key] = value;
            let e = read_config(path, &c).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains(says), "{key}: {e}");
        }
    }

    #[test]
    fn the_byte_tokenizer_maps_every_byte_to_one_printable_char() {
        let chars = byte_chars();
        let mut unique = chars.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), 256);
        assert_eq!(chars[b'A' as usize], 'A');
        assert_eq!(chars[b' ' as usize], '\u{120}', "GPT-2 writes a space as Ġ");
        assert!(chars.iter().all(|c| !c.is_whitespace() && !c.is_control()));
    }
}
