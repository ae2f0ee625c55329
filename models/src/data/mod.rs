//! Datasets: the embedded UCI digits, Fashion-MNIST from IDX files, splits,
//! per-worker partitions and seeded per-epoch batching.

mod digits;
mod fashion;
pub mod idx;
pub mod text;

use std::fmt;
use std::str::FromStr;

use candle_core::{Device, Tensor};

pub use digits::{load_digits, DIGITS_CSV_GZ};
pub use fashion::{
    fashion_mnist_dir, load_fashion_mnist, open_fashion_mnist, FASHION_MNIST_FILES, SYSTEM_FASHION_MNIST_DIR,
};
pub use text::{load_text, text_split, unigram_entropy, BYTE_VOCAB, DEFAULT_CONTEXT, SAMPLE_TEXT};

use crate::error::{ModelError, Result};
use crate::rng::{stable_hash64, DetRng};

/// Which data set to train on. Written and parsed as `digits`,
/// `fashion-mnist`, `text:PATH` (windows of 64 bytes plus the next one) or
/// `text@N:PATH` (windows of N bytes).
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum DatasetKind {
    /// UCI handwritten digits, 8x8, embedded in the binary.
    #[default]
    Digits,
    /// Fashion-MNIST, 28x28, from Debian's `dataset-fashion-mnist`.
    FashionMnist,
    /// A UTF-8 text file, byte by byte, for language models.
    Text { path: std::path::PathBuf, context: usize },
}

impl DatasetKind {
    /// The context length of a text data set; `None` for images.
    pub fn context(&self) -> Option<usize> {
        match self {
            DatasetKind::Text { context, .. } => Some(*context),
            _ => None,
        }
    }
}

impl FromStr for DatasetKind {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "digits" => Ok(DatasetKind::Digits),
            "fashion-mnist" | "fashion_mnist" | "fashion" => Ok(DatasetKind::FashionMnist),
            other => {
                let text = other.strip_prefix("text").and_then(|rest| {
                    let (ctx, path) = rest.split_once(':')?;
                    let context = match ctx.strip_prefix('@') {
                        Some(n) => n.parse::<usize>().ok().filter(|&n| n > 0)?,
                        None if ctx.is_empty() => text::DEFAULT_CONTEXT,
                        None => return None,
                    };
                    (!path.is_empty()).then(|| DatasetKind::Text { path: path.into(), context })
                });
                text.ok_or_else(|| {
                    ModelError::Invalid(format!(
                        "unknown dataset `{other}`: expected digits, fashion-mnist, text:PATH or text@CONTEXT:PATH"
                    ))
                })
            }
        }
    }
}

impl fmt::Display for DatasetKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DatasetKind::Digits => f.write_str("digits"),
            DatasetKind::FashionMnist => f.write_str("fashion-mnist"),
            DatasetKind::Text { path, context } if *context == text::DEFAULT_CONTEXT => {
                write!(f, "text:{}", path.display())
            }
            DatasetKind::Text { path, context } => write!(f, "text@{context}:{}", path.display()),
        }
    }
}

impl TryFrom<String> for DatasetKind {
    type Error = ModelError;
    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

impl From<DatasetKind> for String {
    fn from(k: DatasetKind) -> String {
        k.to_string()
    }
}

/// Shape of one input image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ImageShape {
    pub channels: usize,
    pub height: usize,
    pub width: usize,
}

impl ImageShape {
    pub fn len(&self) -> usize {
        self.channels * self.height * self.width
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// An in-memory labelled image set. Values are kept as the bytes the files
/// hold (a quarter of the memory of f32: Fashion-MNIST's training set is 47
/// MB rather than 188 MB) and turned into f32 only for a batch.
#[derive(Clone)]
pub struct Dataset {
    pub name: String,
    pub shape: ImageShape,
    pub classes: usize,
    /// `len() * shape.len()` raw values, row-major per image.
    pub raw: Vec<u8>,
    /// What a raw value is divided by to give the model's input: 255 for
    /// Fashion-MNIST (pixels in [0, 1]), 16 for digits, 1 for text bytes.
    pub divisor: f32,
    pub labels: Vec<u8>,
}

impl fmt::Debug for Dataset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dataset")
            .field("name", &self.name)
            .field("shape", &self.shape)
            .field("classes", &self.classes)
            .field("len", &self.len())
            .finish()
    }
}

/// A train/test pair.
#[derive(Debug, Clone)]
pub struct Split {
    pub train: Dataset,
    pub test: Dataset,
}

impl Dataset {
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Input value `k` of sample `i` as the model sees it.
    pub fn value(&self, i: usize, k: usize) -> f32 {
        self.raw[i * self.shape.len() + k] as f32 / self.divisor
    }

    /// Bytes the samples take in memory.
    pub fn memory_bytes(&self) -> usize {
        self.raw.len() + self.labels.len()
    }

    /// A new dataset holding the given samples, in the given order.
    pub fn select(&self, indices: &[usize]) -> Result<Dataset> {
        let d = self.shape.len();
        let mut raw = Vec::with_capacity(indices.len() * d);
        let mut labels = Vec::with_capacity(indices.len());
        for &i in indices {
            let label = *self.labels.get(i).ok_or_else(|| {
                ModelError::Invalid(format!("sample index {i} out of range ({} samples)", self.len()))
            })?;
            raw.extend_from_slice(&self.raw[i * d..(i + 1) * d]);
            labels.push(label);
        }
        Ok(Dataset {
            name: self.name.clone(),
            shape: self.shape,
            classes: self.classes,
            raw,
            divisor: self.divisor,
            labels,
        })
    }

    /// This worker's slice of the data, chosen deterministically so that the
    /// slices of all workers are disjoint and cover the whole set.
    pub fn partition(&self, partition: &Partition) -> Result<Dataset> {
        let indices = partition.indices(self.len())?;
        self.select(&indices)
    }

    /// A batch as tensors: images `[n, c, h, w]` (f32) and labels `[n]` (u32).
    pub fn batch(&self, indices: &[usize], device: &Device) -> Result<(Tensor, Tensor)> {
        let d = self.shape.len();
        let mut images = Vec::with_capacity(indices.len() * d);
        let mut labels = Vec::with_capacity(indices.len());
        for &i in indices {
            if i >= self.len() {
                return Err(ModelError::Invalid(format!("sample index {i} out of range ({} samples)", self.len())));
            }
            images.extend(self.raw[i * d..(i + 1) * d].iter().map(|&v| v as f32 / self.divisor));
            labels.push(self.labels[i] as u32);
        }
        let n = indices.len();
        let s = self.shape;
        let x = Tensor::from_vec(images, (n, s.channels, s.height, s.width), device)?;
        let y = Tensor::from_vec(labels, n, device)?;
        Ok((x, y))
    }

    /// Seeded per-epoch batch order: the same `(seed, epoch)` always gives the
    /// same batches. The last, short batch is kept so no sample is skipped.
    pub fn epoch_batches(&self, batch_size: usize, seed: u64, epoch: u64) -> Result<Vec<Vec<usize>>> {
        let all: Vec<usize> = (0..self.len()).collect();
        shuffled_batches(&all, batch_size, seed, epoch)
    }

    /// Stratification-free seeded split into `(train, test)` with
    /// `test_fraction` of the samples held out.
    pub fn split(&self, test_fraction: f64, seed: u64) -> Result<Split> {
        if !(0.0..1.0).contains(&test_fraction) {
            return Err(ModelError::Invalid(format!("test fraction {test_fraction} not in [0, 1)")));
        }
        let mut order: Vec<usize> = (0..self.len()).collect();
        DetRng::derive(seed, "train-test-split").shuffle(&mut order);
        let n_test = (self.len() as f64 * test_fraction).round() as usize;
        let (test, train) = order.split_at(n_test);
        Ok(Split { train: self.select(train)?, test: self.select(test)? })
    }
}

/// Seeded per-epoch batches over a subset of sample indices (a worker's
/// partition): the same `(items, seed, epoch)` always gives the same batches.
pub fn shuffled_batches(items: &[usize], batch_size: usize, seed: u64, epoch: u64) -> Result<Vec<Vec<usize>>> {
    if batch_size == 0 {
        return Err(ModelError::Invalid("batch size must be at least 1".into()));
    }
    let mut order = items.to_vec();
    DetRng::derive(seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15), "epoch-shuffle").shuffle(&mut order);
    Ok(order.chunks(batch_size).map(|c| c.to_vec()).collect())
}

/// How a data set is cut across workers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Partition {
    /// Everything (a single node).
    Full,
    /// Worker `rank` of `world` takes every sample `i` with `i % world == rank`.
    Rank { rank: usize, world: usize },
    /// Rendezvous hashing over peer ids: sample `i` goes to the peer whose
    /// `hash(peer, i)` is highest. Needs no ranks, only the list of peers,
    /// and moves only 1/n of the samples when a peer joins or leaves.
    Peers { me: String, peers: Vec<String> },
}

impl Partition {
    /// The sample indices this partition keeps, out of `n`.
    pub fn indices(&self, n: usize) -> Result<Vec<usize>> {
        match self {
            Partition::Full => Ok((0..n).collect()),
            Partition::Rank { rank, world } => {
                if *world == 0 || rank >= world {
                    return Err(ModelError::Invalid(format!("partition rank {rank} is not below world size {world}")));
                }
                Ok((*rank..n).step_by(*world).collect())
            }
            Partition::Peers { me, peers } => {
                if !peers.iter().any(|p| p == me) {
                    return Err(ModelError::Invalid(format!("peer {me} is not in the peer list")));
                }
                let hashes: Vec<u64> = peers.iter().map(|p| stable_hash64(p.as_bytes())).collect();
                let mine = stable_hash64(me.as_bytes());
                Ok((0..n)
                    .filter(|&i| {
                        let score =
                            |h: u64| stable_hash64(&(h ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_le_bytes());
                        // Ties (astronomically unlikely) break towards the smaller hash.
                        let best =
                            hashes.iter().copied().max_by_key(|&h| (score(h), std::cmp::Reverse(h))).unwrap_or(mine);
                        best == mine
                    })
                    .collect())
            }
        }
    }
}

/// A data set opened for training in a cluster: the test split in memory,
/// and the training split either in memory (the embedded digits, a text) or
/// left in its files (Fashion-MNIST), to be read only for the samples this
/// node trains on ([`OpenedData::take_train`]). A worker of four then holds a
/// quarter of Fashion-MNIST's training images (12 MB) instead of all 47 MB.
#[derive(Debug)]
pub struct OpenedData {
    pub test: Dataset,
    /// Samples in the training split.
    pub train_len: usize,
    train: TrainSource,
}

#[derive(Debug)]
enum TrainSource {
    InMemory(Dataset),
    FashionFiles(std::path::PathBuf),
    Taken,
}

impl OpenedData {
    /// The training samples `rows` (ascending, no repeats), in that order:
    /// row `k` of the result is sample `rows[k]`. Once per opened data set;
    /// what was not asked for is not kept.
    pub fn take_train(&mut self, rows: &[usize]) -> Result<Dataset> {
        if let Some(w) = rows.windows(2).find(|w| w[0] >= w[1]) {
            return Err(ModelError::Invalid(format!(
                "training rows must ascend without repeats ({} then {})",
                w[0], w[1]
            )));
        }
        if let Some(&last) = rows.last().filter(|&&l| l >= self.train_len) {
            return Err(ModelError::Invalid(format!("training row {last} out of range ({} samples)", self.train_len)));
        }
        match std::mem::replace(&mut self.train, TrainSource::Taken) {
            TrainSource::InMemory(all) if rows.len() == all.len() => Ok(all),
            TrainSource::InMemory(all) => all.select(rows),
            TrainSource::FashionFiles(dir) => fashion::load_fashion_train_rows(&dir, rows),
            TrainSource::Taken => Err(ModelError::Invalid("the training samples were already taken".into())),
        }
    }
}

/// Open a data set for a node: see [`OpenedData`].
pub fn open(kind: &DatasetKind, data_dir: Option<&std::path::Path>) -> Result<OpenedData> {
    match kind {
        DatasetKind::FashionMnist => {
            let (dir, test, train_len) = fashion::open_fashion_mnist(data_dir)?;
            Ok(OpenedData { test, train_len, train: TrainSource::FashionFiles(dir) })
        }
        _ => {
            let Split { train, test } = load(kind, data_dir)?;
            Ok(OpenedData { test, train_len: train.len(), train: TrainSource::InMemory(train) })
        }
    }
}

/// Load a dataset's train/test split. `data_dir` overrides where
/// Fashion-MNIST is looked for; digits are embedded and ignore it, and a
/// text names its own file.
pub fn load(kind: &DatasetKind, data_dir: Option<&std::path::Path>) -> Result<Split> {
    match kind {
        DatasetKind::Digits => load_digits(),
        DatasetKind::FashionMnist => load_fashion_mnist(data_dir),
        DatasetKind::Text { path, context } => load_text(path, *context),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toy(n: usize) -> Dataset {
        Dataset {
            name: "toy".into(),
            shape: ImageShape { channels: 1, height: 1, width: 2 },
            classes: 10,
            raw: (0..n * 2).map(|v| (v % 256) as u8).collect(),
            divisor: 1.0,
            labels: (0..n).map(|v| (v % 10) as u8).collect(),
        }
    }

    #[test]
    fn an_opened_set_gives_the_rows_asked_for_once() -> Result<()> {
        let mut opened = open(&DatasetKind::Digits, None)?;
        let all = load_digits()?;
        assert_eq!(opened.train_len, all.train.len());
        assert_eq!(opened.test.raw, all.test.raw);
        let rows = Partition::Rank { rank: 2, world: 3 }.indices(opened.train_len)?;
        let part = opened.take_train(&rows)?;
        let expected = all.train.select(&rows)?;
        assert_eq!((part.raw, part.labels), (expected.raw, expected.labels));
        let e = opened.take_train(&rows).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("already taken"), "{e}");
        let mut opened = open(&DatasetKind::Digits, None)?;
        assert!(opened.take_train(&[3, 2]).is_err(), "rows must ascend");
        assert!(opened.take_train(&[opened.train_len]).is_err(), "rows must exist");
        let every: Vec<usize> = (0..opened.train_len).collect();
        assert_eq!(opened.take_train(&every)?.raw, all.train.raw);
        Ok(())
    }

    fn assert_disjoint_cover(parts: &[Vec<usize>], n: usize) {
        let mut all: Vec<usize> = parts.iter().flatten().copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..n).collect::<Vec<_>>());
    }

    #[test]
    fn rank_partitions_are_disjoint_and_cover() {
        let parts: Vec<_> =
            (0..3).map(|rank| Partition::Rank { rank, world: 3 }.indices(100).unwrap_or_default()).collect();
        assert_disjoint_cover(&parts, 100);
        assert!(Partition::Rank { rank: 3, world: 3 }.indices(10).is_err());
    }

    #[test]
    fn peer_partitions_are_disjoint_balanced_and_stable() {
        let peers: Vec<String> = (0..4).map(|i| format!("12D3KooPeer{i}")).collect();
        let parts: Vec<_> = peers
            .iter()
            .map(|me| Partition::Peers { me: me.clone(), peers: peers.clone() }.indices(4000).unwrap_or_default())
            .collect();
        assert_disjoint_cover(&parts, 4000);
        for p in &parts {
            assert!((800..1200).contains(&p.len()), "unbalanced partition: {}", p.len());
        }
        // The same inputs give the same partition.
        let again = Partition::Peers { me: peers[0].clone(), peers: peers.clone() }.indices(4000).unwrap_or_default();
        assert_eq!(again, parts[0]);
    }

    #[test]
    fn epoch_batches_are_seeded_and_complete() {
        let d = toy(103);
        let a = d.epoch_batches(10, 5, 0).unwrap_or_default();
        let b = d.epoch_batches(10, 5, 0).unwrap_or_default();
        let c = d.epoch_batches(10, 5, 1).unwrap_or_default();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(a.len(), 11);
        assert_disjoint_cover(&a, 103);
        assert!(d.epoch_batches(0, 5, 0).is_err());
    }

    #[test]
    fn dataset_names_round_trip() {
        for s in ["digits", "fashion-mnist", "text:/tmp/a.txt", "text@128:rel/b:c.txt"] {
            let k: Result<DatasetKind> = s.parse();
            assert_eq!(k.as_ref().map(|k| k.to_string()).ok().as_deref(), Some(s));
        }
        assert_eq!("text@16:x".parse::<DatasetKind>().ok(), Some(DatasetKind::Text { path: "x".into(), context: 16 }));
        for bad in ["text", "text:", "text@0:x", "text@x:y", "textfoo:x", "mnist"] {
            assert!(bad.parse::<DatasetKind>().is_err(), "{bad} parsed");
        }
    }

    #[test]
    fn split_is_deterministic_and_disjoint() {
        let d = toy(50);
        let s1 = d.split(0.2, 1).ok();
        let s2 = d.split(0.2, 1).ok();
        let (s1, s2) = (s1.as_ref(), s2.as_ref());
        assert_eq!(s1.map(|s| s.test.labels.clone()), s2.map(|s| s.test.labels.clone()));
        assert_eq!(s1.map(|s| s.test.len()), Some(10));
        assert_eq!(s1.map(|s| s.train.len()), Some(40));
    }
}
