//! The trained model as one file: what a run produces for people and for
//! other software.
//!
//! A model file is a plain safetensors file. Every parameter is stored under
//! the model's own layer name (`fc0.weight`, `fc0.bias`, `conv0.weight` ...)
//! as little-endian f32 with its real shape, so numpy, PyTorch or any
//! safetensors reader can use it without Shoal. The metadata (all strings,
//! as safetensors requires) holds:
//!
//! | key | value |
//! | --- | --- |
//! | `shoal.format` | `shoal-model-1` |
//! | `shoal.model` | the model config, JSON (rebuilds the layer shapes) |
//! | `shoal.run_id` | the run it came from (`train` for `shoal train`) |
//! | `shoal.step` | training steps taken |
//! | `shoal.seed` | the run's seed |
//! | `shoal.dataset` | the data set it was trained on |
//! | `shoal.accuracy`, `shoal.loss` | test accuracy (0..1) and loss when written, if evaluated |
//!
//! Writes are atomic ([`crate::checkpoint::write_atomic`]): a crash never
//! leaves a half-written file under the real name.

use std::collections::HashMap;
use std::path::Path;

use crate::checkpoint::{ckpt_err, layout_for, le_bytes, model_from_meta, parse, read_f32, save_f32, to_json};
use crate::error::{ModelError, Result};
use crate::model::ModelConfig;

/// The format tag in a model file's metadata.
pub const MODEL_FORMAT: &str = "shoal-model-1";

/// Where a model came from and how good it was when written.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ModelMeta {
    pub run_id: String,
    pub step: u64,
    pub seed: u64,
    pub dataset: String,
    /// Test accuracy (0..1), if the model was evaluated before writing.
    pub accuracy: Option<f32>,
    pub loss: Option<f32>,
}

/// A trained model: its config, its parameters (flat, `ParamLayout` order)
/// and where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelFile {
    pub model: ModelConfig,
    pub params: Vec<f32>,
    pub meta: ModelMeta,
}

impl ModelFile {
    /// Write the model atomically to `path` (folders are created).
    pub fn save(&self, path: &Path) -> Result<()> {
        let layout = layout_for(&self.model)?;
        if self.params.len() != layout.total_len() {
            return Err(ModelError::FlatLength { expected: layout.total_len(), got: self.params.len() });
        }
        let blobs: Vec<(String, Vec<usize>, Vec<u8>)> = layout
            .entries()
            .iter()
            .map(|e| (e.name.clone(), e.shape.clone(), le_bytes(&self.params[e.range()])))
            .collect();
        let m = &self.meta;
        let mut meta = HashMap::new();
        meta.insert("shoal.format".to_string(), MODEL_FORMAT.to_string());
        meta.insert("shoal.model".to_string(), to_json(&self.model)?);
        meta.insert("shoal.run_id".to_string(), m.run_id.clone());
        meta.insert("shoal.step".to_string(), m.step.to_string());
        meta.insert("shoal.seed".to_string(), m.seed.to_string());
        meta.insert("shoal.dataset".to_string(), m.dataset.clone());
        if let Some(a) = m.accuracy {
            meta.insert("shoal.accuracy".to_string(), a.to_string());
        }
        if let Some(l) = m.loss {
            meta.insert("shoal.loss".to_string(), l.to_string());
        }
        save_f32(path, &blobs, meta)
    }

    /// Read and validate a model file. With `expect`, the stored model
    /// config must equal it (a clear error names both otherwise).
    /// ([`crate::hf::load_model`] also reads Hugging Face directories.)
    pub fn load(path: &Path, expect: Option<&ModelConfig>) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| ModelError::io(path, e))?;
        let (st, meta) = parse(path, &bytes)?;
        let get = |k: &str| {
            meta.get(k).ok_or_else(|| ckpt_err(path, format!("metadata has no `{k}`; not a Shoal model file?")))
        };
        let format = get("shoal.format")?;
        if format != MODEL_FORMAT {
            let hint = if format.starts_with("shoal-checkpoint") {
                " (a training checkpoint; `shoal train --resume` reads those)"
            } else {
                ""
            };
            return Err(ckpt_err(
                path,
                format!("format `{format}`, this shoal reads model files `{MODEL_FORMAT}`{hint}"),
            ));
        }
        let model = model_from_meta(path, &meta, expect)?;
        let num = |k: &str| -> Result<u64> {
            get(k)?.parse::<u64>().map_err(|_| ckpt_err(path, format!("`{k}` is not a number")))
        };
        let real = |k: &str| -> Result<Option<f32>> {
            meta.get(k)
                .map(|v| v.parse::<f32>().map_err(|_| ckpt_err(path, format!("`{k}` is not a number"))))
                .transpose()
        };
        let layout = layout_for(&model).map_err(|e| ckpt_err(path, format!("stored model config is invalid: {e}")))?;
        let mut params = Vec::with_capacity(layout.total_len());
        for e in layout.entries() {
            params.extend(read_f32(path, &st, &e.name, &e.shape)?);
        }
        if st.names().len() != layout.entries().len() {
            let mut extra: Vec<&str> = st.names().into_iter().filter(|n| layout.entry(n).is_none()).collect();
            extra.sort_unstable();
            return Err(ckpt_err(path, format!("unexpected tensors {extra:?} for model {}", model.describe())));
        }
        Ok(ModelFile {
            model,
            params,
            meta: ModelMeta {
                run_id: get("shoal.run_id")?.clone(),
                step: num("shoal.step")?,
                seed: num("shoal.seed")?,
                dataset: get("shoal.dataset")?.clone(),
                accuracy: real("shoal.accuracy")?,
                loss: real("shoal.loss")?,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::Checkpoint;
    use crate::data::ImageShape;
    use crate::model::ArchKind;
    use safetensors::tensor::SafeTensors;

    fn sample(kind: ArchKind) -> ModelFile {
        let model = ModelConfig::new(kind, ImageShape { channels: 1, height: 8, width: 8 }, 10);
        let n = layout_for(&model).map(|l| l.total_len()).unwrap_or(0);
        ModelFile {
            model,
            params: (0..n).map(|i| (i as f32 * 0.37).cos()).collect(),
            meta: ModelMeta {
                run_id: "r".into(),
                step: 12,
                seed: 3,
                dataset: "digits".into(),
                accuracy: Some(0.9375),
                loss: Some(0.25),
            },
        }
    }

    #[test]
    fn round_trips_with_layer_names_and_shapes() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("m.safetensors");
        for kind in [ArchKind::Mlp, ArchKind::Cnn] {
            let m = sample(kind);
            m.save(&path)?;
            assert_eq!(ModelFile::load(&path, Some(&m.model))?, m);
            // Tensors carry the model's own names and shapes.
            let bytes = std::fs::read(&path)?;
            let st = SafeTensors::deserialize(&bytes)?;
            let layout = layout_for(&m.model)?;
            for e in layout.entries() {
                let t = st.tensor(&e.name)?;
                assert_eq!(t.shape(), e.shape.as_slice(), "{}", e.name);
            }
        }
        let left: Vec<_> = std::fs::read_dir(dir.path())?
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .collect();
        assert!(left.is_empty(), "no temporary file is left behind: {left:?}");
        Ok(())
    }

    #[test]
    fn wrong_model_checkpoint_and_truncation_are_clear_errors() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("m.safetensors");
        let m = sample(ArchKind::Mlp);
        m.save(&path)?;
        let cnn = sample(ArchKind::Cnn).model;
        let e = ModelFile::load(&path, Some(&cnn)).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("was requested") && e.contains("m.safetensors"), "{e}");

        let bytes = std::fs::read(&path)?;
        std::fs::write(&path, &bytes[..bytes.len() - 10])?;
        let e = ModelFile::load(&path, None).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("safetensors") && e.contains("m.safetensors"), "{e}");

        let ck = Checkpoint {
            model: m.model.clone(),
            params: m.params.clone(),
            optimizer: None,
            step: 1,
            version: 1,
            seed: 0,
        };
        ck.save(&path)?;
        let e = ModelFile::load(&path, None).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("checkpoint"), "{e}");
        Ok(())
    }
}
