//! Datasets: the embedded UCI digits, Fashion-MNIST from IDX files, splits,
//! per-worker partitions and seeded per-epoch batching.

mod digits;
mod fashion;
pub mod idx;
pub mod text;
pub mod tokens;

use std::fmt;
use std::str::FromStr;

use candle_core::{Device, Tensor};

pub use digits::{load_digits, DIGITS_CSV_GZ};
pub use fashion::{
    fashion_mnist_dir, load_fashion_mnist, open_fashion_mnist, FASHION_MNIST_FILES, SYSTEM_FASHION_MNIST_DIR,
};
pub use text::{load_text, text_split, unigram_entropy, BYTE_VOCAB, DEFAULT_CONTEXT, SAMPLE_TEXT};
pub use tokens::{load_text_tokens, load_tokens, tokenize_files, TokenIndex};

use crate::error::{ModelError, Result};
use crate::rng::{stable_hash64, DetRng};
use crate::tokenizer::Tokenizer;

/// Which data set to train on. Written and parsed as `digits`,
/// `fashion-mnist`, `text:PATH` (windows of 64 bytes or tokens plus the next
/// one), `text@N:PATH` (windows of N), `tokens:DIR` or `tokens@N:DIR` (a
/// token directory that `shoal data tokenize` wrote).
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum DatasetKind {
    /// UCI handwritten digits, 8x8, embedded in the binary.
    #[default]
    Digits,
    /// Fashion-MNIST, 28x28, from Debian's `dataset-fashion-mnist`.
    FashionMnist,
    /// A UTF-8 text file, for language models: byte by byte, or tokenized
    /// on load when a tokenizer is given.
    Text { path: std::path::PathBuf, context: usize },
    /// A token directory (`shoal data tokenize`), read by position.
    Tokens { dir: std::path::PathBuf, context: usize },
}

impl DatasetKind {
    /// The sample shape and class count of a built-in image data set,
    /// known before it is loaded; `None` for text and tokens.
    pub fn image_shape(&self) -> Option<(ImageShape, usize)> {
        match self {
            DatasetKind::Digits => Some((ImageShape { channels: 1, height: 8, width: 8 }, 10)),
            DatasetKind::FashionMnist => Some((ImageShape { channels: 1, height: 28, width: 28 }, 10)),
            DatasetKind::Text { .. } | DatasetKind::Tokens { .. } => None,
        }
    }

    /// The context length of a text or token data set; `None` for images.
    pub fn context(&self) -> Option<usize> {
        match self {
            DatasetKind::Text { context, .. } | DatasetKind::Tokens { context, .. } => Some(*context),
            _ => None,
        }
    }

    /// Whether this is a language data set (text or tokens).
    pub fn is_language(&self) -> bool {
        self.context().is_some()
    }
}

/// `PREFIX:PATH` or `PREFIX@N:PATH` (N > 0): the context and the path.
fn with_context<'a>(s: &'a str, prefix: &str) -> Option<(usize, &'a str)> {
    let (ctx, path) = s.strip_prefix(prefix)?.split_once(':')?;
    let context = match ctx.strip_prefix('@') {
        Some(n) => n.parse::<usize>().ok().filter(|&n| n > 0)?,
        None if ctx.is_empty() => text::DEFAULT_CONTEXT,
        None => return None,
    };
    (!path.is_empty()).then_some((context, path))
}

impl FromStr for DatasetKind {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "digits" => Ok(DatasetKind::Digits),
            "fashion-mnist" | "fashion_mnist" | "fashion" => Ok(DatasetKind::FashionMnist),
            other => with_context(other, "text")
                .map(|(context, path)| DatasetKind::Text { path: path.into(), context })
                .or_else(|| with_context(other, "tokens").map(|(context, dir)| DatasetKind::Tokens { dir: dir.into(), context }))
                .ok_or_else(|| {
                    ModelError::Invalid(format!(
                        "unknown dataset `{other}`: expected digits, fashion-mnist, text:PATH, text@CONTEXT:PATH, tokens:DIR or tokens@CONTEXT:DIR"
                    ))
                }),
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
            DatasetKind::Tokens { dir, context } if *context == text::DEFAULT_CONTEXT => {
                write!(f, "tokens:{}", dir.display())
            }
            DatasetKind::Tokens { dir, context } => write!(f, "tokens@{context}:{}", dir.display()),
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

/// A labelled set of samples: images, or windows of a text. Image values
/// are kept as the bytes the files hold (a quarter of the memory of f32:
/// Fashion-MNIST's training set is 47 MB rather than 188 MB), and token
/// windows as their positions in a token stream; both are turned into f32
/// only for a batch.
#[derive(Clone)]
pub struct Dataset {
    pub name: String,
    pub shape: ImageShape,
    /// Classes of an image set; the vocabulary of a language set.
    pub classes: usize,
    pub(crate) samples: Samples,
    /// What a raw value is divided by to give the model's input: 255 for
    /// Fashion-MNIST (pixels in [0, 1]), 16 for digits, 1 for text.
    pub divisor: f32,
    pub labels: Vec<u8>,
}

/// Where a data set's input values are.
#[derive(Debug, Clone)]
pub(crate) enum Samples {
    /// `len() * shape.len()` raw values, row-major per sample.
    Bytes(Vec<u8>),
    /// Windows of `shape.len()` tokens of a token stream.
    Tokens(tokens::TokenWindows),
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
        match &self.samples {
            Samples::Bytes(_) => self.labels.len(),
            Samples::Tokens(w) => w.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The label of sample `i` (token windows have none: 0).
    fn label(&self, i: usize) -> u8 {
        self.labels.get(i).copied().unwrap_or(0)
    }

    /// The raw values of an in-memory set (images, byte windows); `None`
    /// for token windows, which are read from their stream for each batch.
    pub fn raw_bytes(&self) -> Option<&[u8]> {
        match &self.samples {
            Samples::Bytes(raw) => Some(raw),
            Samples::Tokens(_) => None,
        }
    }

    /// Bytes of text per token: 1 for byte windows (and images), the
    /// tokenizer's compression for token windows.
    pub fn bytes_per_token(&self) -> f64 {
        match &self.samples {
            Samples::Bytes(_) => 1.0,
            Samples::Tokens(w) => w.bytes_per_token,
        }
    }

    /// Bytes the samples take in memory (for token windows, their positions:
    /// the tokens stay in their files).
    pub fn memory_bytes(&self) -> usize {
        let samples = match &self.samples {
            Samples::Bytes(raw) => raw.len(),
            Samples::Tokens(w) => w.listed_bytes(),
        };
        samples + self.labels.len()
    }

    /// A new dataset holding the given samples, in the given order.
    pub fn select(&self, indices: &[usize]) -> Result<Dataset> {
        let d = self.shape.len();
        if let Some(&bad) = indices.iter().find(|&&i| i >= self.len()) {
            return Err(ModelError::Invalid(format!("sample index {bad} out of range ({} samples)", self.len())));
        }
        let (samples, labels) = match &self.samples {
            Samples::Bytes(raw) => (
                Samples::Bytes(indices.iter().flat_map(|&i| &raw[i * d..(i + 1) * d]).copied().collect()),
                indices.iter().map(|&i| self.labels[i]).collect(),
            ),
            Samples::Tokens(w) => (Samples::Tokens(w.select(indices)), Vec::new()),
        };
        Ok(Dataset {
            name: self.name.clone(),
            shape: self.shape,
            classes: self.classes,
            samples,
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
    /// A token window's values are its token ids.
    pub fn batch(&self, indices: &[usize], device: &Device) -> Result<(Tensor, Tensor)> {
        let d = self.shape.len();
        let mut images = vec![0f32; indices.len() * d];
        let mut labels = Vec::with_capacity(indices.len());
        for (&i, out) in indices.iter().zip(images.chunks_exact_mut(d)) {
            if i >= self.len() {
                return Err(ModelError::Invalid(format!("sample index {i} out of range ({} samples)", self.len())));
            }
            match &self.samples {
                Samples::Bytes(raw) => {
                    for (o, &v) in out.iter_mut().zip(&raw[i * d..(i + 1) * d]) {
                        *o = v as f32 / self.divisor;
                    }
                }
                Samples::Tokens(w) => w.source.read(w.start(i), out)?,
            }
            labels.push(self.label(i) as u32);
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
        if batch_size == 0 {
            return Err(ModelError::Invalid("batch size must be at least 1".into()));
        }
        let order = self.epoch_order(seed, epoch)?;
        Ok((0..order.batches(batch_size)).map(|b| order.batch(b, batch_size)).collect())
    }

    /// The seeded order of an epoch's samples, without listing it for token
    /// windows: a data set larger than memory has more windows than are
    /// worth holding. Images and byte windows get [`shuffled_batches`]'s
    /// order.
    pub fn epoch_order(&self, seed: u64, epoch: u64) -> Result<EpochOrder> {
        let n = self.len();
        match &self.samples {
            Samples::Tokens(_) => Ok(EpochOrder::permuted(n, epoch_key(seed, epoch))),
            Samples::Bytes(_) => {
                let n32 =
                    u32::try_from(n).map_err(|_| ModelError::Invalid(format!("{n} samples are too many to list")))?;
                let mut order: Vec<u32> = (0..n32).collect();
                DetRng::derive(epoch_key(seed, epoch), "epoch-shuffle").shuffle(&mut order);
                Ok(EpochOrder { n, order: Order::Listed(order) })
            }
        }
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
    DetRng::derive(epoch_key(seed, epoch), "epoch-shuffle").shuffle(&mut order);
    Ok(order.chunks(batch_size).map(|c| c.to_vec()).collect())
}

fn epoch_key(seed: u64, epoch: u64) -> u64 {
    seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// The order in which an epoch visits a data set's samples: a listed
/// shuffle, or for token windows a seeded permutation computed index by
/// index (a Feistel network over the next power of four, walking the
/// cycle until it lands inside the set), which holds no list at all.
#[derive(Debug, Clone)]
pub struct EpochOrder {
    n: usize,
    order: Order,
}

#[derive(Debug, Clone)]
enum Order {
    Listed(Vec<u32>),
    Permuted { half: u32, keys: [u64; 4] },
}

impl EpochOrder {
    fn permuted(n: usize, key: u64) -> Self {
        let bits = usize::BITS - n.saturating_sub(1).leading_zeros();
        let half = bits.div_ceil(2).max(1);
        let mut rng = DetRng::derive(key, "epoch-permutation");
        let keys = [rng.next_u64(), rng.next_u64(), rng.next_u64(), rng.next_u64()];
        EpochOrder { n, order: Order::Permuted { half, keys } }
    }

    /// Samples in the epoch.
    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The sample visited `k`-th (`k < len()`).
    pub fn get(&self, k: usize) -> usize {
        match &self.order {
            Order::Listed(order) => order[k] as usize,
            Order::Permuted { half, keys } => {
                let mask = (1u64 << half) - 1;
                let mut x = k as u64;
                loop {
                    let (mut l, mut r) = (x >> half, x & mask);
                    for key in keys {
                        let f = crate::rng::StableHasher::new().update(&(r ^ key).to_le_bytes()).finish() & mask;
                        (l, r) = (r, l ^ f);
                    }
                    x = (l << half) | r;
                    if x < self.n as u64 {
                        return x as usize;
                    }
                }
            }
        }
    }

    /// Batches of `batch_size` in the epoch (the last may be short).
    pub fn batches(&self, batch_size: usize) -> usize {
        self.n.div_ceil(batch_size.max(1))
    }

    /// The samples of batch `b`.
    pub fn batch(&self, b: usize, batch_size: usize) -> Vec<usize> {
        let bs = batch_size.max(1);
        (b * bs..((b + 1) * bs).min(self.n)).map(|k| self.get(k)).collect()
    }
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
    open_with(kind, data_dir, None)
}

/// [`open`], a text tokenized by `tokenizer` when given.
pub fn open_with(
    kind: &DatasetKind,
    data_dir: Option<&std::path::Path>,
    tokenizer: Option<&Tokenizer>,
) -> Result<OpenedData> {
    match kind {
        DatasetKind::FashionMnist => {
            let (dir, test, train_len) = fashion::open_fashion_mnist(data_dir)?;
            Ok(OpenedData { test, train_len, train: TrainSource::FashionFiles(dir) })
        }
        _ => {
            let Split { train, test } = load_with(kind, data_dir, tokenizer)?;
            Ok(OpenedData { test, train_len: train.len(), train: TrainSource::InMemory(train) })
        }
    }
}

/// Load a dataset's train/test split. `data_dir` overrides where
/// Fashion-MNIST is looked for; digits are embedded and ignore it, and a
/// text or token directory names its own place.
pub fn load(kind: &DatasetKind, data_dir: Option<&std::path::Path>) -> Result<Split> {
    load_with(kind, data_dir, None)
}

/// [`load`], a text tokenized by `tokenizer` when given (byte by byte
/// otherwise). A token directory's ids are cut already: it takes no
/// tokenizer (see [`dataset_tokenizer`]).
pub fn load_with(
    kind: &DatasetKind,
    data_dir: Option<&std::path::Path>,
    tokenizer: Option<&Tokenizer>,
) -> Result<Split> {
    match (kind, tokenizer) {
        (DatasetKind::Digits, _) => load_digits(),
        (DatasetKind::FashionMnist, _) => load_fashion_mnist(data_dir),
        (DatasetKind::Text { path, context }, None) => load_text(path, *context),
        (DatasetKind::Text { path, context }, Some(t)) => load_text_tokens(path, t, *context),
        (DatasetKind::Tokens { dir, context }, _) => load_tokens(dir, *context),
    }
}

/// A language data set whole, for `shoal eval`: consecutive,
/// non-overlapping windows of `context + 1` tokens (or bytes) from its
/// first token, a last partial window dropped. The model reads the first
/// `context` of each and predicts the `context` that follow.
pub fn load_whole(kind: &DatasetKind, tokenizer: Option<&Tokenizer>, context: usize) -> Result<Dataset> {
    match kind {
        DatasetKind::Text { path, .. } => tokens::whole_text(path, tokenizer, context),
        DatasetKind::Tokens { dir, .. } => tokens::whole_tokens(dir, context),
        other => Err(ModelError::Invalid(format!("{other} is not a text or a token directory"))),
    }
}

/// The tokenizer of a language data set: the one given, else a token
/// directory's own; `None` for bytes and images. One given with a token
/// directory must be the one that wrote it.
pub fn dataset_tokenizer(kind: &DatasetKind, given: Option<&std::path::Path>) -> Result<Option<Tokenizer>> {
    match (kind, given) {
        (DatasetKind::Tokens { dir, .. }, Some(path)) => {
            let t = Tokenizer::from_file(path)?;
            if TokenIndex::read(dir)?.tokenizer_hash != format!("{:016x}", t.hash()) {
                return Err(ModelError::Invalid(format!(
                    "tokens:{} was written by another tokenizer than {}; leave the tokenizer out to use the directory's own",
                    dir.display(),
                    path.display()
                )));
            }
            Ok(Some(t))
        }
        (_, Some(path)) => Tokenizer::from_file(path).map(Some),
        (DatasetKind::Tokens { dir, .. }, None) => Tokenizer::from_file(&dir.join(tokens::TOKENIZER_FILE)).map(Some),
        _ => Ok(None),
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
            samples: Samples::Bytes((0..n * 2).map(|v| (v % 256) as u8).collect()),
            divisor: 1.0,
            labels: (0..n).map(|v| (v % 10) as u8).collect(),
        }
    }

    #[test]
    fn an_opened_set_gives_the_rows_asked_for_once() -> Result<()> {
        let mut opened = open(&DatasetKind::Digits, None)?;
        let all = load_digits()?;
        assert_eq!(opened.train_len, all.train.len());
        assert_eq!(opened.test.raw_bytes(), all.test.raw_bytes());
        let rows = Partition::Rank { rank: 2, world: 3 }.indices(opened.train_len)?;
        let part = opened.take_train(&rows)?;
        let expected = all.train.select(&rows)?;
        assert_eq!((part.raw_bytes(), &part.labels), (expected.raw_bytes(), &expected.labels));
        let e = opened.take_train(&rows).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("already taken"), "{e}");
        let mut opened = open(&DatasetKind::Digits, None)?;
        assert!(opened.take_train(&[3, 2]).is_err(), "rows must ascend");
        assert!(opened.take_train(&[opened.train_len]).is_err(), "rows must exist");
        let every: Vec<usize> = (0..opened.train_len).collect();
        assert_eq!(opened.take_train(&every)?.raw_bytes(), all.train.raw_bytes());
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
    fn a_computed_epoch_order_is_a_seeded_permutation() {
        for n in [1usize, 2, 3, 17, 1000, 4097] {
            let a = EpochOrder::permuted(n, 5);
            let mut seen: Vec<usize> = (0..n).map(|k| a.get(k)).collect();
            let first = seen.clone();
            seen.sort_unstable();
            assert_eq!(seen, (0..n).collect::<Vec<_>>(), "n = {n}: not a permutation");
            let again: Vec<usize> = (0..n).map(|k| EpochOrder::permuted(n, 5).get(k)).collect();
            assert_eq!(again, first, "n = {n}: the same key gives the same order");
            if n >= 17 {
                let other: Vec<usize> = (0..n).map(|k| EpochOrder::permuted(n, 6).get(k)).collect();
                assert_ne!(other, first, "n = {n}: another epoch, another order");
                assert_ne!(first, (0..n).collect::<Vec<_>>(), "n = {n}: shuffled");
            }
        }
        let o = EpochOrder::permuted(10, 1);
        assert_eq!((o.batches(4), o.batch(2, 4).len()), (3, 2));
    }

    #[test]
    fn listed_epoch_batches_keep_the_worker_shuffle() {
        let d = toy(103);
        let all: Vec<usize> = (0..103).collect();
        assert_eq!(d.epoch_batches(10, 5, 3).ok(), shuffled_batches(&all, 10, 5, 3).ok());
    }

    #[test]
    fn dataset_names_round_trip() {
        for s in ["digits", "fashion-mnist", "text:/tmp/a.txt", "text@128:rel/b:c.txt", "tokens:/d", "tokens@256:d"] {
            let k: Result<DatasetKind> = s.parse();
            assert_eq!(k.as_ref().map(|k| k.to_string()).ok().as_deref(), Some(s));
        }
        assert_eq!("text@16:x".parse::<DatasetKind>().ok(), Some(DatasetKind::Text { path: "x".into(), context: 16 }));
        assert_eq!("tokens@8:d".parse::<DatasetKind>().ok(), Some(DatasetKind::Tokens { dir: "d".into(), context: 8 }));
        for bad in ["text", "text:", "text@0:x", "text@x:y", "textfoo:x", "mnist", "tokens:", "tokens@0:d"] {
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
