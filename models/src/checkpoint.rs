//! Safetensors checkpoints with Shoal metadata.
//!
//! A checkpoint holds every parameter under its own name (so standard
//! safetensors tools can read the model), the optimizer's state slots as
//! `optim.<slot>` flat tensors, and metadata: format version, model config
//! (JSON), optimizer config (JSON), optimizer step, training step, model
//! version and seed. Loading rebuilds the layout from the stored config and
//! checks every tensor's name, dtype and shape against it.

use std::collections::HashMap;
use std::path::Path;

use candle_core::Device;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::error::{ModelError, Result};
pub use crate::files::{write_atomic, write_atomic_with};
use crate::layout::ParamLayout;
use crate::model::{Model, ModelConfig, TrainableModel};
use crate::optim::{OptimizerConfig, OptimizerState};

const FORMAT: &str = "shoal-checkpoint-1";

/// Everything needed to resume training bit-identically.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    pub model: ModelConfig,
    /// Flat parameters in [`ParamLayout`] order.
    pub params: Vec<f32>,
    pub optimizer: Option<OptimizerState>,
    /// Training steps taken (batches), which fixes the data position.
    pub step: u64,
    /// Model version (equal to `step` for one node; owners bump it in a cluster).
    pub version: u64,
    /// The run's seed (init and data order derive from it).
    pub seed: u64,
}

impl Checkpoint {
    /// Write atomically ([`write_atomic`]): a crash never leaves a
    /// half-written checkpoint under the real name.
    pub fn save(&self, path: &Path) -> Result<()> {
        let layout = layout_for(&self.model)?;
        if self.params.len() != layout.total_len() {
            return Err(ModelError::FlatLength { expected: layout.total_len(), got: self.params.len() });
        }
        let mut blobs: Vec<(String, Vec<usize>, Vec<u8>)> = layout
            .entries()
            .iter()
            .map(|e| (format!("param.{}", e.name), e.shape.clone(), le_bytes(&self.params[e.range()])))
            .collect();
        let mut meta = HashMap::new();
        meta.insert("shoal.format".to_string(), FORMAT.to_string());
        meta.insert("shoal.model".to_string(), to_json(&self.model)?);
        meta.insert("shoal.step".to_string(), self.step.to_string());
        meta.insert("shoal.version".to_string(), self.version.to_string());
        meta.insert("shoal.seed".to_string(), self.seed.to_string());
        if let Some(opt) = &self.optimizer {
            if opt.len() != layout.total_len() {
                return Err(ModelError::FlatLength { expected: layout.total_len(), got: opt.len() });
            }
            meta.insert("shoal.optimizer".to_string(), to_json(&opt.config)?);
            meta.insert("shoal.optimizer_step".to_string(), opt.step.to_string());
            for (name, v) in &opt.slots {
                blobs.push((format!("optim.{name}"), vec![v.len()], le_bytes(v)));
            }
        }
        save_f32(path, &blobs, meta)?;
        Ok(())
    }

    /// Read and validate a checkpoint. With `expect`, the stored model config
    /// must equal it.
    pub fn load(path: &Path, expect: Option<&ModelConfig>) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| ModelError::io(path, e))?;
        let (st, meta) = parse(path, &bytes)?;
        let get = |k: &str| {
            meta.get(k).ok_or_else(|| ckpt_err(path, format!("metadata has no `{k}`; not a Shoal checkpoint?")))
        };
        let format = get("shoal.format")?;
        if format != FORMAT {
            return Err(ckpt_err(path, format!("format `{format}`, this shoal reads `{FORMAT}`")));
        }
        let model = model_from_meta(path, &meta, expect)?;
        let num = |k: &str| -> Result<u64> {
            get(k)?.parse::<u64>().map_err(|_| ckpt_err(path, format!("`{k}` is not a number")))
        };
        let layout = layout_for(&model).map_err(|e| ckpt_err(path, format!("stored model config is invalid: {e}")))?;

        let mut params = Vec::with_capacity(layout.total_len());
        for e in layout.entries() {
            let name = format!("param.{}", e.name);
            params.extend(read_f32(path, &st, &name, &e.shape)?);
        }
        let expected_names: usize = layout.entries().len();
        let optimizer = match meta.get("shoal.optimizer") {
            None => None,
            Some(json) => {
                let config: OptimizerConfig =
                    serde_json::from_str(json).map_err(|e| ckpt_err(path, format!("bad optimizer config: {e}")))?;
                let slots = config
                    .slot_names()
                    .iter()
                    .map(|s| Ok((s.to_string(), read_f32(path, &st, &format!("optim.{s}"), &[layout.total_len()])?)))
                    .collect::<Result<Vec<_>>>()?;
                Some(OptimizerState { config, step: num("shoal.optimizer_step")?, slots })
            }
        };
        let known = expected_names + optimizer.as_ref().map(|o| o.slots.len()).unwrap_or(0);
        if st.names().len() != known {
            let mut extra: Vec<&str> = st
                .names()
                .into_iter()
                .filter(|n| {
                    !(n.strip_prefix("param.").is_some_and(|p| layout.entry(p).is_some()) || n.starts_with("optim."))
                })
                .collect();
            extra.sort_unstable();
            return Err(ckpt_err(path, format!("unexpected tensors {extra:?} for model {}", model.describe())));
        }
        Ok(Checkpoint {
            model,
            params,
            optimizer,
            step: num("shoal.step")?,
            version: num("shoal.version")?,
            seed: num("shoal.seed")?,
        })
    }
}

pub(crate) fn layout_for(config: &ModelConfig) -> Result<ParamLayout> {
    // Building the model is cheap (small layers, zero-cost init on CPU) and keeps
    // one source of truth for parameter names and shapes.
    Ok(Model::new(config.clone(), 0, &Device::Cpu)?.layout().clone())
}

/// Write named f32 tensors `(name, shape, little-endian bytes)` with string
/// metadata as a safetensors file, atomically, streaming the tensors to the
/// file rather than building the whole file in memory first.
pub(crate) fn save_f32(
    path: &Path,
    blobs: &[(String, Vec<usize>, Vec<u8>)],
    meta: HashMap<String, String>,
) -> Result<()> {
    let views = blobs
        .iter()
        .map(|(n, s, b)| Ok((n.clone(), TensorView::new(Dtype::F32, s.clone(), b)?)))
        .collect::<std::result::Result<Vec<_>, safetensors::SafeTensorError>>()
        .map_err(|e| ckpt_err(path, format!("cannot build tensors: {e}")))?;
    write_atomic_with(path, |tmp| {
        safetensors::serialize_to_file(views, Some(meta), tmp).map_err(|e| ckpt_err(path, format!("cannot write: {e}")))
    })
}

/// Parse a safetensors file image: its tensors and its metadata.
pub(crate) fn parse<'a>(path: &Path, bytes: &'a [u8]) -> Result<(SafeTensors<'a>, HashMap<String, String>)> {
    let st =
        SafeTensors::deserialize(bytes).map_err(|e| ckpt_err(path, format!("not a valid safetensors file: {e}")))?;
    let (_, header) =
        SafeTensors::read_metadata(bytes).map_err(|e| ckpt_err(path, format!("unreadable header: {e}")))?;
    Ok((st, header.metadata().clone().unwrap_or_default()))
}

/// The model config stored in a file's metadata; with `expect`, it must
/// equal that one.
pub(crate) fn model_from_meta(
    path: &Path,
    meta: &HashMap<String, String>,
    expect: Option<&ModelConfig>,
) -> Result<ModelConfig> {
    let json = meta.get("shoal.model").ok_or_else(|| ckpt_err(path, "metadata has no `shoal.model`"))?;
    let model: ModelConfig =
        serde_json::from_str(json).map_err(|e| ckpt_err(path, format!("bad model config: {e}")))?;
    match expect {
        Some(want) if *want != model => {
            Err(ckpt_err(path, format!("holds model {}, but {} was requested", model.describe(), want.describe())))
        }
        _ => Ok(model),
    }
}

pub(crate) fn read_f32(path: &Path, st: &SafeTensors<'_>, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    let t = st.tensor(name).map_err(|_| ckpt_err(path, format!("missing tensor `{name}`")))?;
    if t.dtype() != Dtype::F32 {
        return Err(ckpt_err(path, format!("tensor `{name}` is {:?}, expected F32", t.dtype())));
    }
    if t.shape() != shape {
        return Err(ckpt_err(path, format!("tensor `{name}` has shape {:?}, model needs {shape:?}", t.shape())));
    }
    Ok(t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
}

pub(crate) fn le_bytes(v: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; v.len() * 4];
    for (dst, f) in out.chunks_exact_mut(4).zip(v) {
        dst.copy_from_slice(&f.to_le_bytes());
    }
    out
}

pub(crate) fn to_json<T: serde::Serialize>(v: &T) -> Result<String> {
    serde_json::to_string(v).map_err(|e| ModelError::Invalid(format!("cannot encode metadata: {e}")))
}

pub(crate) fn ckpt_err(path: &Path, reason: impl Into<String>) -> ModelError {
    ModelError::Checkpoint { path: path.to_path_buf(), reason: reason.into() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::ImageShape;
    use crate::model::ArchKind;
    use crate::optim::{Optimizer, OptimizerKind};

    fn cfg(kind: ArchKind) -> ModelConfig {
        ModelConfig::new(kind, ImageShape { channels: 1, height: 8, width: 8 }, 10)
    }

    fn sample() -> Checkpoint {
        let model = cfg(ArchKind::Mlp);
        let n = layout_for(&model).map(|l| l.total_len()).unwrap_or(0);
        let params: Vec<f32> = (0..n).map(|i| (i as f32).sin()).collect();
        let mut opt = Optimizer::new(OptimizerConfig::new(OptimizerKind::Adamw, 1e-3), n).ok();
        let mut p = params.clone();
        if let Some(o) = opt.as_mut() {
            let _ = o.step(&mut p, &params);
        }
        Checkpoint { model, params: p, optimizer: opt.map(Optimizer::into_state), step: 7, version: 7, seed: 42 }
    }

    #[test]
    fn round_trips_exactly() {
        let Ok(dir) = tempfile::tempdir() else { return };
        let path = dir.path().join("c.safetensors");
        let c = sample();
        assert!(c.save(&path).is_ok());
        let back = Checkpoint::load(&path, Some(&c.model));
        assert_eq!(back.ok(), Some(c));
    }

    #[test]
    fn mismatches_and_corruption_are_clear_errors() {
        let Ok(dir) = tempfile::tempdir() else { return };
        let path = dir.path().join("c.safetensors");
        let c = sample();
        assert!(c.save(&path).is_ok());
        // Wrong model requested.
        let e = Checkpoint::load(&path, Some(&cfg(ArchKind::Cnn))).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("requested"), "{e}");
        // Truncated file.
        let bytes = std::fs::read(&path).unwrap_or_default();
        let cut = dir.path().join("cut.safetensors");
        std::fs::write(&cut, &bytes[..bytes.len() / 2]).ok();
        let e = Checkpoint::load(&cut, None).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("safetensors"), "{e}");
        // Garbage.
        std::fs::write(&cut, b"\xff\xff\xff\xff\xff\xff\xff\xffjunk").ok();
        assert!(Checkpoint::load(&cut, None).is_err());
        // A safetensors file that is not a Shoal checkpoint.
        let plain = safetensors::serialize(
            vec![(
                "x".to_string(),
                TensorView::new(Dtype::F32, vec![1], &[0u8; 4]).ok().unwrap_or_else(|| unreachable!()),
            )],
            None,
        )
        .unwrap_or_default();
        std::fs::write(&cut, plain).ok();
        let e = Checkpoint::load(&cut, None).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("not a Shoal checkpoint"), "{e}");
        // Missing file.
        assert!(matches!(Checkpoint::load(&dir.path().join("none"), None), Err(ModelError::Io { .. })));
    }

    #[test]
    fn shape_mismatch_in_file_is_an_error() {
        let Ok(dir) = tempfile::tempdir() else { return };
        let path = dir.path().join("c.safetensors");
        let c = sample();
        assert!(c.save(&path).is_ok());
        // Claim a wider MLP in the metadata than the tensors stored (same byte
        // length, so the file stays a valid safetensors): load must notice.
        let mut bytes = std::fs::read(&path).unwrap_or_default();
        let (from, to) = (b"[256,128]", b"[257,128]");
        let at = bytes.windows(from.len()).position(|w| w == from);
        assert!(at.is_some(), "metadata should hold the hidden widths");
        if let Some(i) = at {
            bytes[i..i + to.len()].copy_from_slice(to);
        }
        std::fs::write(&path, &bytes).ok();
        let e = Checkpoint::load(&path, None).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("shape"), "{e}");
        // A params vector of the wrong length is refused at save time.
        let mut short = sample();
        short.params.pop();
        assert!(short.save(&path).is_err());
    }
}
