//! Shard checkpoints: what a shard owner writes while a cluster trains, so
//! that the run survives every node stopping at once.
//!
//! One file per shard and version, `shard-<k>-v<version>.safetensors` in
//! the node's checkpoint folder, holding the shard's parameters (`param`)
//! and optimizer slots (`optim.<slot>`) as flat f32 tensors, and metadata:
//! `shoal.format = shoal-shard-1`, `shoal.run_id`, `shoal.model` (JSON),
//! `shoal.shards` (how many the model is cut into), `shoal.shard`,
//! `shoal.range` (`start..end` in the flat model), `shoal.version`,
//! `shoal.step`, `shoal.optimizer` (JSON) and `shoal.optimizer_step`.
//! Writes are atomic ([`crate::checkpoint::write_atomic_with`]); [`ShardDir`] keeps the newest few
//! per shard and, when reading, skips a corrupt or truncated file with an
//! error that names it.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};

use crate::checkpoint::{ckpt_err, le_bytes, model_from_meta, parse, read_f32, save_f32, to_json};
use crate::error::{ModelError, Result};
use crate::model::ModelConfig;
use crate::optim::{OptimizerConfig, OptimizerState};

/// The format tag in a shard checkpoint's metadata.
pub const SHARD_FORMAT: &str = "shoal-shard-1";

/// Which run and model a shard belongs to: a checkpoint of another run,
/// model or shard plan is refused.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardOf {
    pub run_id: String,
    pub model: ModelConfig,
    /// Shards the model is cut into.
    pub shards: u32,
}

/// One shard's state at one version.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardCheckpoint {
    pub shard: u32,
    /// Its elements in the flat model.
    pub range: Range<usize>,
    pub version: u64,
    /// The step every worker had reached when it was written (the slowest
    /// worker's clock; equal to `version` under BSP).
    pub step: u64,
    pub params: Vec<f32>,
    pub optimizer: OptimizerState,
}

impl ShardCheckpoint {
    fn save(&self, of: &ShardOf, path: &Path) -> Result<()> {
        let n = self.range.len();
        if self.params.len() != n || self.optimizer.slots.iter().any(|(_, v)| v.len() != n) {
            return Err(ModelError::FlatLength { expected: n, got: self.params.len() });
        }
        let mut blobs = vec![("param".to_string(), vec![n], le_bytes(&self.params))];
        for (name, v) in &self.optimizer.slots {
            blobs.push((format!("optim.{name}"), vec![n], le_bytes(v)));
        }
        let mut meta = HashMap::new();
        meta.insert("shoal.format".to_string(), SHARD_FORMAT.to_string());
        meta.insert("shoal.run_id".to_string(), of.run_id.clone());
        meta.insert("shoal.model".to_string(), to_json(&of.model)?);
        meta.insert("shoal.shards".to_string(), of.shards.to_string());
        meta.insert("shoal.shard".to_string(), self.shard.to_string());
        meta.insert("shoal.range".to_string(), format!("{}..{}", self.range.start, self.range.end));
        meta.insert("shoal.version".to_string(), self.version.to_string());
        meta.insert("shoal.step".to_string(), self.step.to_string());
        meta.insert("shoal.optimizer".to_string(), to_json(&self.optimizer.config)?);
        meta.insert("shoal.optimizer_step".to_string(), self.optimizer.step.to_string());
        save_f32(path, &blobs, meta)
    }

    /// Read and validate one shard checkpoint against the run it must belong to.
    pub fn load(path: &Path, of: &ShardOf) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| ModelError::io(path, e))?;
        let (st, meta) = parse(path, &bytes)?;
        let get = |k: &str| {
            meta.get(k).ok_or_else(|| ckpt_err(path, format!("metadata has no `{k}`; not a Shoal shard checkpoint?")))
        };
        let format = get("shoal.format")?;
        if format != SHARD_FORMAT {
            return Err(ckpt_err(path, format!("format `{format}`, expected a shard checkpoint `{SHARD_FORMAT}`")));
        }
        let run = get("shoal.run_id")?;
        if *run != of.run_id {
            return Err(ckpt_err(path, format!("belongs to run `{run}`, not `{}`", of.run_id)));
        }
        model_from_meta(path, &meta, Some(&of.model))?;
        let num = |k: &str| -> Result<u64> {
            get(k)?.parse::<u64>().map_err(|_| ckpt_err(path, format!("`{k}` is not a number")))
        };
        let shards = num("shoal.shards")?;
        if shards != u64::from(of.shards) {
            return Err(ckpt_err(path, format!("written for {shards} shards, this run has {}", of.shards)));
        }
        let range = get("shoal.range")?
            .split_once("..")
            .and_then(|(a, b)| Some(a.parse::<usize>().ok()?..b.parse::<usize>().ok()?))
            .filter(|r| r.start <= r.end)
            .ok_or_else(|| ckpt_err(path, "`shoal.range` is not start..end"))?;
        let n = range.len();
        let config: OptimizerConfig = serde_json::from_str(get("shoal.optimizer")?)
            .map_err(|e| ckpt_err(path, format!("bad optimizer config: {e}")))?;
        let slots = config
            .slot_names()
            .iter()
            .map(|s| Ok((s.to_string(), read_f32(path, &st, &format!("optim.{s}"), &[n])?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(ShardCheckpoint {
            shard: u32::try_from(num("shoal.shard")?).map_err(|_| ckpt_err(path, "`shoal.shard` is out of range"))?,
            params: read_f32(path, &st, "param", &[n])?,
            range,
            version: num("shoal.version")?,
            step: num("shoal.step")?,
            optimizer: OptimizerState { config, step: num("shoal.optimizer_step")?, slots },
        })
    }
}

/// A node's checkpoint folder.
#[derive(Debug, Clone)]
pub struct ShardDir {
    dir: PathBuf,
    of: ShardOf,
    /// Files kept per shard (the newest).
    keep: usize,
}

/// What [`ShardDir::scan`] found.
#[derive(Debug, Default)]
pub struct Scan {
    /// Per shard, every readable checkpoint, newest first.
    pub shards: BTreeMap<u32, Vec<ShardCheckpoint>>,
    /// Files that could not be used, each with the reason (naming the file).
    pub skipped: Vec<String>,
}

impl ShardDir {
    pub fn new(dir: impl Into<PathBuf>, of: ShardOf, keep: usize) -> Self {
        Self { dir: dir.into(), of, keep: keep.max(1) }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, shard: u32, version: u64) -> PathBuf {
        self.dir.join(format!("shard-{shard:05}-v{version:012}.safetensors"))
    }

    /// Write one shard's state atomically, then delete all but the newest
    /// `keep` files of that shard.
    pub fn write(&self, ckpt: &ShardCheckpoint) -> Result<PathBuf> {
        let path = self.path(ckpt.shard, ckpt.version);
        ckpt.save(&self.of, &path)?;
        let mut mine: Vec<(u64, PathBuf)> =
            self.files()?.into_iter().filter(|(s, _, _)| *s == ckpt.shard).map(|(_, v, p)| (v, p)).collect();
        mine.sort_by_key(|m| std::cmp::Reverse(m.0));
        for (_, old) in mine.into_iter().skip(self.keep) {
            match std::fs::remove_file(&old) {
                // Another writer of the folder pruned it first.
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(ModelError::io(&old, e)),
                _ => {}
            }
        }
        Ok(path)
    }

    /// Delete every checkpoint newer than the version a shard resumed from
    /// (`versions[shard]`): they belong to the timeline the resume gave up,
    /// and must not be taken for newer state at the next full stop. Returns
    /// how many were deleted.
    pub fn discard_newer(&self, versions: &[u64]) -> Result<usize> {
        let mut n = 0;
        for (shard, version, path) in self.files()? {
            if versions.get(shard as usize).is_some_and(|&v| version > v) {
                match std::fs::remove_file(&path) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(ModelError::io(&path, e)),
                    _ => n += 1,
                }
            }
        }
        Ok(n)
    }

    /// Every shard file in the folder by its name: (shard, version, path).
    /// A missing folder holds none.
    fn files(&self) -> Result<Vec<(u32, u64, PathBuf)>> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(ModelError::io(&self.dir, e)),
        };
        let mut out = Vec::new();
        for entry in entries {
            let path = entry.map_err(|e| ModelError::io(&self.dir, e))?.path();
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else { continue };
            let parsed = name
                .strip_prefix("shard-")
                .and_then(|r| r.strip_suffix(".safetensors"))
                .and_then(|r| r.split_once("-v"))
                .and_then(|(s, v)| Some((s.parse::<u32>().ok()?, v.parse::<u64>().ok()?)));
            if let Some((shard, version)) = parsed {
                out.push((shard, version, path));
            }
        }
        Ok(out)
    }

    /// Read every shard checkpoint in the folder. A file that cannot be read
    /// (truncated, corrupt, another run's) is reported in `skipped` and the
    /// older ones of its shard are still used.
    pub fn scan(&self) -> Result<Scan> {
        let mut scan = Scan::default();
        for (shard, version, path) in self.files()? {
            match ShardCheckpoint::load(&path, &self.of) {
                Ok(c) if c.shard == shard && c.version == version => {
                    scan.shards.entry(shard).or_default().push(c);
                }
                Ok(c) => scan.skipped.push(format!(
                    "{}: holds shard {} version {}, not what its name says",
                    path.display(),
                    c.shard,
                    c.version
                )),
                Err(e) => scan.skipped.push(e.to_string()),
            }
        }
        for list in scan.shards.values_mut() {
            list.sort_by_key(|c| std::cmp::Reverse(c.version));
        }
        scan.skipped.sort();
        Ok(scan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::ImageShape;
    use crate::model::ArchKind;
    use crate::optim::{Optimizer, OptimizerKind};

    fn of() -> ShardOf {
        ShardOf {
            run_id: "r".into(),
            model: ModelConfig::new(ArchKind::Mlp, ImageShape { channels: 1, height: 8, width: 8 }, 10),
            shards: 4,
        }
    }

    fn ckpt(shard: u32, version: u64) -> ShardCheckpoint {
        let range = 10..20;
        let mut opt = Optimizer::new(OptimizerConfig::new(OptimizerKind::Adamw, 1e-3), range.len()).ok();
        let mut params: Vec<f32> = (0..range.len()).map(|i| i as f32 + version as f32).collect();
        if let Some(o) = opt.as_mut() {
            let grad = vec![0.5; params.len()];
            let _ = o.step(&mut params, &grad);
        }
        let optimizer = opt.map(Optimizer::into_state).unwrap_or_else(|| unreachable!());
        ShardCheckpoint { shard, range, version, step: version, params, optimizer }
    }

    #[test]
    fn writes_keep_the_newest_and_read_back_exactly() -> anyhow::Result<()> {
        let tmp = tempfile::tempdir()?;
        let dir = ShardDir::new(tmp.path().join("ckpt"), of(), 2);
        for v in [10, 20, 30] {
            dir.write(&ckpt(1, v))?;
        }
        dir.write(&ckpt(3, 20))?;
        let scan = dir.scan()?;
        assert!(scan.skipped.is_empty(), "{:?}", scan.skipped);
        let versions: Vec<u64> = scan.shards[&1].iter().map(|c| c.version).collect();
        assert_eq!(versions, vec![30, 20], "the two newest are kept, newest first");
        assert_eq!(scan.shards[&1][0], ckpt(1, 30));
        assert_eq!(scan.shards[&3][0], ckpt(3, 20));
        Ok(())
    }

    #[test]
    fn a_corrupt_newest_file_is_named_and_the_older_one_used() -> anyhow::Result<()> {
        let tmp = tempfile::tempdir()?;
        let dir = ShardDir::new(tmp.path(), of(), 2);
        dir.write(&ckpt(0, 10))?;
        let newest = dir.write(&ckpt(0, 20))?;
        let bytes = std::fs::read(&newest)?;
        std::fs::write(&newest, &bytes[..bytes.len() - 7])?;
        let scan = dir.scan()?;
        assert_eq!(scan.shards[&0].iter().map(|c| c.version).collect::<Vec<_>>(), vec![10]);
        assert_eq!(scan.skipped.len(), 1);
        assert!(scan.skipped[0].contains("shard-00000-v000000000020.safetensors"), "{:?}", scan.skipped);
        // Another run's checkpoint is refused by name, too.
        let other = ShardDir::new(tmp.path(), ShardOf { run_id: "other".into(), ..of() }, 2);
        let scan = other.scan()?;
        assert!(scan.shards.is_empty());
        assert!(scan.skipped.iter().any(|s| s.contains("belongs to run `r`")), "{:?}", scan.skipped);
        Ok(())
    }

    #[test]
    fn a_crash_before_the_rename_leaves_the_old_file_intact() -> anyhow::Result<()> {
        let tmp = tempfile::tempdir()?;
        let dir = ShardDir::new(tmp.path(), of(), 2);
        let path = dir.write(&ckpt(2, 10))?;
        // A writer killed mid-write leaves only its temporary file behind.
        let tmp_file = tmp.path().join("shard-00002-v000000000020.safetensors.tmp");
        std::fs::write(&tmp_file, b"half a file")?;
        let scan = dir.scan()?;
        assert_eq!(scan.shards[&2], vec![ckpt(2, 10)]);
        assert!(scan.skipped.is_empty(), "a temporary file is not a checkpoint: {:?}", scan.skipped);
        assert!(path.is_file());
        Ok(())
    }

    #[test]
    fn a_missing_folder_holds_nothing() -> anyhow::Result<()> {
        let tmp = tempfile::tempdir()?;
        let scan = ShardDir::new(tmp.path().join("none"), of(), 2).scan()?;
        assert!(scan.shards.is_empty() && scan.skipped.is_empty());
        Ok(())
    }
}
