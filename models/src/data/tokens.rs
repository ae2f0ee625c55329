//! Token data sets: text tokenized once (`shoal data tokenize`) into shards
//! of little-endian token ids, u16 where the vocabulary fits and u32 where it
//! does not, beside a small JSON index. Training reads windows back by
//! position (`pread`), so a data set larger than memory trains: only the
//! windows of a batch are in memory, and the operating system's page cache
//! holds what it can of the rest.
//!
//! The layout of a token directory:
//! - `index.json`: [`TokenIndex`]: the format, the token width, the
//!   vocabulary size, the token and document counts, the end-of-document
//!   token, the tokenizer's hash, the content hash and the shards;
//! - `tokens-00000.bin`, `tokens-00001.bin`, ...: the ids, one document after
//!   another, each document followed by the end-of-document token when the
//!   tokenizer has one;
//! - `tokenizer.json`: the tokenizer that wrote them.
//!
//! Windows and the split, the same on every peer:
//! - the validation split is the last 10% of the tokens, at most
//!   [`MAX_VALIDATION_TOKENS`]; the training split is everything before it;
//! - a window is `context + 1` tokens: the model reads the first `context`
//!   and predicts each next one;
//! - windows start every `context` tokens, from the split's first token, so
//!   that each token is predicted once per epoch; a last, partial window is
//!   dropped.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{Dataset, ImageShape, Samples, Split};
use crate::error::{ModelError, Result};
use crate::rng::StableHasher;
use crate::tokenizer::Tokenizer;

/// The index file of a token directory.
pub const INDEX_FILE: &str = "index.json";
/// The tokenizer file of a token directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
const FORMAT: &str = "shoal-tokens";
const VERSION: u32 = 1;
/// Tokens per shard file (128 MiB of u16).
pub const SHARD_TOKENS: u64 = 1 << 26;
/// The share of the tokens, from the end, held out for validation.
const VALIDATION_FRACTION: f64 = 0.1;
/// The most tokens held out for validation: evaluation stays quick on a
/// large set.
pub const MAX_VALIDATION_TOKENS: u64 = 1 << 18;
/// Text is tokenized in pieces of about this many bytes, cut at line ends.
const PIECE_BYTES: usize = 1 << 20;
/// Pieces encoded at once, in parallel.
const PIECES_AT_ONCE: usize = 8;

/// How wide each stored token id is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenWidth {
    U16,
    U32,
}

impl TokenWidth {
    /// The narrowest width for a vocabulary of `vocab` tokens.
    pub fn for_vocab(vocab: usize) -> Self {
        if vocab <= 1 << 16 {
            TokenWidth::U16
        } else {
            TokenWidth::U32
        }
    }

    pub fn bytes(self) -> usize {
        match self {
            TokenWidth::U16 => 2,
            TokenWidth::U32 => 4,
        }
    }
}

/// One shard file of a token directory.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShardEntry {
    pub file: String,
    pub tokens: u64,
}

/// `index.json` of a token directory.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TokenIndex {
    pub format: String,
    pub version: u32,
    pub width: TokenWidth,
    pub vocab_size: usize,
    pub tokens: u64,
    /// Bytes of text the tokens were cut from (for bits per byte).
    pub text_bytes: u64,
    pub documents: u64,
    pub eos: Option<u32>,
    /// [`Tokenizer::hash`] of the tokenizer that wrote the ids, in hex.
    pub tokenizer_hash: String,
    /// [`StableHasher`] over the ids as stored (little-endian, at the
    /// index's width, in order, whatever the shard boundaries), in hex:
    /// what peers compare, so that two copies of a data set in different
    /// folders agree and two different sets do not.
    pub content_hash: String,
    pub shards: Vec<ShardEntry>,
}

impl TokenIndex {
    /// Read and check the index of the token directory `dir`.
    pub fn read(dir: &Path) -> Result<TokenIndex> {
        let path = dir.join(INDEX_FILE);
        let text = std::fs::read_to_string(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => ModelError::DatasetMissing {
                name: format!("tokens:{}", dir.display()),
                hint: format!("{} is missing; write the directory with `shoal data tokenize`", path.display()),
            },
            _ => ModelError::io(&path, e),
        })?;
        let bad = |reason: String| ModelError::BadFile { path: path.clone(), reason };
        let index: TokenIndex = serde_json::from_str(&text).map_err(|e| bad(format!("not a token index: {e}")))?;
        if index.format != FORMAT || index.version != VERSION {
            return Err(bad(format!(
                "format {} version {}; this build reads {FORMAT} version {VERSION}",
                index.format, index.version
            )));
        }
        let sum: u64 = index.shards.iter().map(|s| s.tokens).sum();
        if sum != index.tokens {
            return Err(bad(format!("its shards hold {sum} tokens, but it counts {}", index.tokens)));
        }
        if index.vocab_size == 0 || TokenWidth::for_vocab(index.vocab_size).bytes() > index.width.bytes() {
            return Err(bad(format!("a vocabulary of {} does not fit {:?} ids", index.vocab_size, index.width)));
        }
        if let Some(s) = index.shards.iter().find(|s| s.file.contains(['/', '\\']) || s.file.starts_with('.')) {
            return Err(bad(format!("shard file name {:?} leaves the directory", s.file)));
        }
        Ok(index)
    }
}

/// Writes a token directory, document by document.
#[derive(Debug)]
pub struct TokenWriter {
    dir: PathBuf,
    width: TokenWidth,
    vocab: usize,
    eos: Option<u32>,
    tokenizer_hash: u64,
    hasher: StableHasher,
    shards: Vec<ShardEntry>,
    current: Option<BufWriter<File>>,
    in_shard: u64,
    tokens: u64,
    documents: u64,
}

impl TokenWriter {
    /// Start a token directory at `dir` (created; an index already there is
    /// an error, so that a set is never half overwritten).
    pub fn create(dir: &Path, tokenizer: &Tokenizer) -> Result<Self> {
        if dir.join(INDEX_FILE).exists() {
            return Err(ModelError::Invalid(format!(
                "{} already holds a token data set; remove it or choose another directory",
                dir.display()
            )));
        }
        std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
        tokenizer.save(&dir.join(TOKENIZER_FILE))?;
        let vocab = tokenizer.vocab_size();
        Ok(TokenWriter {
            dir: dir.into(),
            width: TokenWidth::for_vocab(vocab),
            vocab,
            eos: tokenizer.eos(),
            tokenizer_hash: tokenizer.hash(),
            hasher: StableHasher::new(),
            shards: Vec::new(),
            current: None,
            in_shard: 0,
            tokens: 0,
            documents: 0,
        })
    }

    /// Append token ids.
    pub fn push(&mut self, ids: &[u32]) -> Result<()> {
        let mut rest = ids;
        while !rest.is_empty() {
            if self.current.is_none() || self.in_shard == SHARD_TOKENS {
                self.next_shard()?;
            }
            let take = rest.len().min((SHARD_TOKENS - self.in_shard) as usize);
            let (now, later) = rest.split_at(take);
            let mut bytes = Vec::with_capacity(now.len() * self.width.bytes());
            for &id in now {
                if id as usize >= self.vocab {
                    return Err(ModelError::Invalid(format!(
                        "token id {id} is outside the vocabulary of {}",
                        self.vocab
                    )));
                }
                match self.width {
                    TokenWidth::U16 => bytes.extend_from_slice(&(id as u16).to_le_bytes()),
                    TokenWidth::U32 => bytes.extend_from_slice(&id.to_le_bytes()),
                }
            }
            self.hasher = self.hasher.update(&bytes);
            let path = self.shard_path(self.shards.len() - 1);
            if let Some(w) = self.current.as_mut() {
                w.write_all(&bytes).map_err(|e| ModelError::io(&path, e))?;
            }
            self.in_shard += take as u64;
            self.tokens += take as u64;
            if let Some(last) = self.shards.last_mut() {
                last.tokens += take as u64;
            }
            rest = later;
        }
        Ok(())
    }

    /// End a document: the end-of-document token, when there is one.
    pub fn end_document(&mut self) -> Result<()> {
        if let Some(eos) = self.eos {
            self.push(&[eos])?;
        }
        self.documents += 1;
        Ok(())
    }

    fn shard_path(&self, k: usize) -> PathBuf {
        self.dir.join(shard_name(k))
    }

    fn next_shard(&mut self) -> Result<()> {
        self.flush_current()?;
        let k = self.shards.len();
        let path = self.shard_path(k);
        let file = File::create(&path).map_err(|e| ModelError::io(&path, e))?;
        self.current = Some(BufWriter::with_capacity(1 << 20, file));
        self.shards.push(ShardEntry { file: shard_name(k), tokens: 0 });
        self.in_shard = 0;
        Ok(())
    }

    fn flush_current(&mut self) -> Result<()> {
        if let Some(w) = self.current.take() {
            let path = self.shard_path(self.shards.len().saturating_sub(1));
            let file = w.into_inner().map_err(|e| ModelError::io(&path, e.into_error()))?;
            file.sync_all().map_err(|e| ModelError::io(&path, e))?;
        }
        Ok(())
    }

    /// Close the last shard and write the index (last, so that a directory
    /// with an index is complete); `text_bytes` is the size of the text the
    /// tokens came from.
    pub fn finish(mut self, text_bytes: u64) -> Result<TokenIndex> {
        self.flush_current()?;
        let index = TokenIndex {
            format: FORMAT.into(),
            version: VERSION,
            width: self.width,
            vocab_size: self.vocab,
            tokens: self.tokens,
            text_bytes,
            documents: self.documents,
            eos: self.eos,
            tokenizer_hash: format!("{:016x}", self.tokenizer_hash),
            content_hash: format!("{:016x}", self.hasher.finish()),
            shards: self.shards,
        };
        let text =
            serde_json::to_string_pretty(&index).map_err(|e| ModelError::Invalid(format!("token index: {e}")))?;
        crate::files::write_atomic(&self.dir.join(INDEX_FILE), format!("{text}\n").as_bytes())?;
        Ok(index)
    }
}

fn shard_name(k: usize) -> String {
    format!("tokens-{k:05}.bin")
}

/// Tokenize the UTF-8 text read from `reader` in pieces of about a MiB cut
/// at line ends, handing each piece's ids to `sink` with the bytes read so
/// far; returns the bytes read.
/// The same text gives the same ids whether it comes from a file being
/// written to a token directory or from a `text:PATH` read in memory.
pub fn tokenize_pieces(
    tokenizer: &Tokenizer,
    reader: impl std::io::Read,
    name: &str,
    mut sink: impl FnMut(Vec<u32>, u64) -> Result<()>,
) -> Result<u64> {
    let mut reader = BufReader::with_capacity(1 << 20, reader);
    let mut piece = String::with_capacity(PIECE_BYTES + 4096);
    let mut pieces: Vec<String> = Vec::with_capacity(PIECES_AT_ONCE);
    let mut total = 0u64;
    loop {
        let n = reader.read_line(&mut piece).map_err(|e| match e.kind() {
            std::io::ErrorKind::InvalidData => {
                ModelError::Invalid(format!("{name} is not UTF-8 (after byte {})", total + piece.len() as u64))
            }
            _ => ModelError::io(name, e),
        })?;
        total += n as u64;
        if (n == 0 && !piece.is_empty()) || piece.len() >= PIECE_BYTES {
            pieces.push(std::mem::replace(&mut piece, String::with_capacity(PIECE_BYTES + 4096)));
        }
        // The pieces are encoded in parallel and handed on in order.
        if (n == 0 && !pieces.is_empty()) || pieces.len() == PIECES_AT_ONCE {
            for ids in tokenizer.encode_batch(std::mem::take(&mut pieces))? {
                sink(ids, total)?;
            }
        }
        if n == 0 {
            return Ok(total);
        }
    }
}

/// Tokenize UTF-8 text files into a token directory, one document per file;
/// `progress` hears each file's name and the bytes and tokens so far.
pub fn tokenize_files(
    tokenizer: &Tokenizer,
    files: &[PathBuf],
    dir: &Path,
    mut progress: impl FnMut(&Path, u64, u64),
) -> Result<TokenIndex> {
    if files.is_empty() {
        return Err(ModelError::Invalid("tokenize needs at least one text file".into()));
    }
    let mut writer = TokenWriter::create(dir, tokenizer)?;
    let mut bytes = 0u64;
    for f in files {
        let file = File::open(f).map_err(|e| ModelError::io(f, e))?;
        let name = f.display().to_string();
        bytes += tokenize_pieces(tokenizer, file, &name, |ids, in_file| {
            writer.push(&ids)?;
            progress(f, bytes + in_file, writer.tokens);
            Ok(())
        })?;
        writer.end_document()?;
        progress(f, bytes, writer.tokens);
    }
    writer.finish(bytes)
}

/// Where a token stream lives: in memory (a text tokenized on load) or in a
/// token directory's shard files, read by position.
#[derive(Debug)]
pub(crate) enum TokenSource {
    Memory(Vec<u32>),
    Files { width: TokenWidth, shards: Vec<(File, PathBuf, u64)>, total: u64 },
}

impl TokenSource {
    /// Open the shards of a token directory, checking each file's size.
    fn open(dir: &Path, index: &TokenIndex) -> Result<TokenSource> {
        let mut shards = Vec::with_capacity(index.shards.len());
        for s in &index.shards {
            let path = dir.join(&s.file);
            let file = File::open(&path).map_err(|e| ModelError::io(&path, e))?;
            let len = file.metadata().map_err(|e| ModelError::io(&path, e))?.len();
            let want = s.tokens * index.width.bytes() as u64;
            if len != want {
                return Err(ModelError::BadFile {
                    path,
                    reason: format!("{len} bytes, but the index gives it {} tokens ({want} bytes)", s.tokens),
                });
            }
            shards.push((file, path, s.tokens));
        }
        Ok(TokenSource::Files { width: index.width, shards, total: index.tokens })
    }

    pub(crate) fn len(&self) -> u64 {
        match self {
            TokenSource::Memory(v) => v.len() as u64,
            TokenSource::Files { total, .. } => *total,
        }
    }

    /// Tokens `start .. start + out.len()`, as f32 (exact below 2^24).
    pub(crate) fn read(&self, start: u64, out: &mut [f32]) -> Result<()> {
        let end = start + out.len() as u64;
        if end > self.len() {
            return Err(ModelError::Invalid(format!("tokens {start}..{end} past the end ({})", self.len())));
        }
        match self {
            TokenSource::Memory(v) => {
                for (o, &t) in out.iter_mut().zip(&v[start as usize..end as usize]) {
                    *o = t as f32;
                }
                Ok(())
            }
            TokenSource::Files { width, shards, .. } => read_files(*width, shards, start, out),
        }
    }
}

fn read_files(width: TokenWidth, shards: &[(File, PathBuf, u64)], start: u64, out: &mut [f32]) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let w = width.bytes();
    let mut buf = vec![0u8; out.len() * w];
    let (mut at, mut first, mut filled) = (start, 0u64, 0usize);
    for (file, path, tokens) in shards {
        if filled == out.len() {
            break;
        }
        if at >= first + tokens {
            first += tokens;
            continue;
        }
        let offset = at - first;
        let take = ((first + tokens - at) as usize).min(out.len() - filled);
        file.read_exact_at(&mut buf[filled * w..(filled + take) * w], offset * w as u64)
            .map_err(|e| ModelError::io(path, e))?;
        filled += take;
        at += take as u64;
        first += tokens;
    }
    for (o, b) in out.iter_mut().zip(buf.chunks_exact(w)) {
        *o = match width {
            TokenWidth::U16 => u16::from_le_bytes([b[0], b[1]]) as f32,
            TokenWidth::U32 => u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f32,
        };
    }
    Ok(())
}

/// Windows over a stretch of a token stream: window `i` of this set is
/// tokens `first + id(i) * stride ..` for `window` tokens.
#[derive(Debug, Clone)]
pub(crate) struct TokenWindows {
    pub(crate) source: Arc<TokenSource>,
    pub(crate) first: u64,
    pub(crate) stride: u64,
    pub(crate) ids: WindowIds,
    /// Bytes of text per token of the stream, for bits per byte.
    pub(crate) bytes_per_token: f64,
}

/// Which windows of a stretch a set holds, in order.
#[derive(Debug, Clone)]
pub(crate) enum WindowIds {
    /// All of the first N, unlisted.
    All(usize),
    /// Those a partition kept.
    Listed(Vec<u32>),
}

impl TokenWindows {
    pub(crate) fn len(&self) -> usize {
        match &self.ids {
            WindowIds::All(n) => *n,
            WindowIds::Listed(ids) => ids.len(),
        }
    }

    fn id(&self, i: usize) -> u32 {
        match &self.ids {
            WindowIds::All(_) => i as u32,
            WindowIds::Listed(ids) => ids[i],
        }
    }

    pub(crate) fn start(&self, i: usize) -> u64 {
        self.first + self.id(i) as u64 * self.stride
    }

    /// Bytes the listed window numbers take (none when unlisted).
    pub(crate) fn listed_bytes(&self) -> usize {
        match &self.ids {
            WindowIds::All(_) => 0,
            WindowIds::Listed(ids) => ids.len() * std::mem::size_of::<u32>(),
        }
    }

    /// The windows `indices` (each below [`Self::len`]), in that order.
    pub(crate) fn select(&self, indices: &[usize]) -> Self {
        TokenWindows {
            source: Arc::clone(&self.source),
            first: self.first,
            stride: self.stride,
            ids: WindowIds::Listed(indices.iter().map(|&i| self.id(i)).collect()),
            bytes_per_token: self.bytes_per_token,
        }
    }

    fn all(source: Arc<TokenSource>, first: u64, stride: u64, count: u64, bytes_per_token: f64) -> Self {
        TokenWindows { source, first, stride, ids: WindowIds::All(count as usize), bytes_per_token }
    }
}

/// Cut a token stream into training and validation windows of
/// `context + 1` tokens (see the module's documentation).
pub(crate) fn token_split(
    source: TokenSource,
    vocab: usize,
    context: usize,
    text_bytes: u64,
    name: &str,
) -> Result<Split> {
    if context == 0 {
        return Err(ModelError::Invalid("the context must be at least 1 token".into()));
    }
    let total = source.len();
    let held = ((total as f64 * VALIDATION_FRACTION).round() as u64).min(MAX_VALIDATION_TOKENS);
    let cut = total - held;
    let window = context as u64 + 1;
    let count = |len: u64| if len < window { 0 } else { (len - 1) / context as u64 };
    let (train_n, valid_n) = (count(cut), count(held));
    if train_n == 0 || valid_n == 0 {
        return Err(ModelError::Invalid(format!(
            "{name} has {total} tokens: too few for windows of {window} (the last {}% is held out for validation, so at least {} tokens are needed)",
            (VALIDATION_FRACTION * 100.0) as u32,
            (window as f64 / VALIDATION_FRACTION).ceil() as u64
        )));
    }
    if train_n > u32::MAX as u64 {
        return Err(ModelError::Invalid(format!("{name} has {train_n} windows; at most {} are supported", u32::MAX)));
    }
    let source = Arc::new(source);
    let bytes_per_token = text_bytes as f64 / total.max(1) as f64;
    let set = |first: u64, n: u64, label: &str| Dataset {
        name: format!("{name} ({label})"),
        shape: ImageShape { channels: 1, height: 1, width: context + 1 },
        classes: vocab,
        samples: Samples::Tokens(TokenWindows::all(Arc::clone(&source), first, context as u64, n, bytes_per_token)),
        divisor: 1.0,
        labels: Vec::new(),
    };
    Ok(Split { train: set(0, train_n, "train"), test: set(cut, valid_n, "validation") })
}

/// The whole of a token stream as consecutive, non-overlapping windows of
/// `context + 1` tokens (a last, partial window dropped): what `shoal eval`
/// reports on, so that any other tool can cut the same windows.
pub(crate) fn whole_windows(
    source: TokenSource,
    vocab: usize,
    context: usize,
    text_bytes: u64,
    name: &str,
) -> Result<Dataset> {
    let window = context as u64 + 1;
    let n = whole_count(source.len(), context, name)?;
    let bytes_per_token = text_bytes as f64 / source.len().max(1) as f64;
    Ok(Dataset {
        name: format!("{name} (whole)"),
        shape: ImageShape { channels: 1, height: 1, width: context + 1 },
        classes: vocab,
        samples: Samples::Tokens(TokenWindows::all(Arc::new(source), 0, window, n, bytes_per_token)),
        divisor: 1.0,
        labels: Vec::new(),
    })
}

/// How many whole windows of `context + 1` tokens `len` tokens hold: an
/// error unless 1 to 2^32 - 1.
fn whole_count(len: u64, context: usize, name: &str) -> Result<u64> {
    let window = context as u64 + 1;
    let n = len / window;
    if context == 0 || n == 0 || n > u32::MAX as u64 {
        return Err(ModelError::Invalid(format!(
            "{name} has {len} tokens: that is not 1 to {} windows of {window}",
            u32::MAX
        )));
    }
    Ok(n)
}

/// A token directory whole: see [`whole_windows`].
pub fn whole_tokens(dir: &Path, context: usize) -> Result<Dataset> {
    let index = TokenIndex::read(dir)?;
    let source = TokenSource::open(dir, &index)?;
    whole_windows(source, index.vocab_size, context, index.text_bytes, &format!("tokens:{}", dir.display()))
}

/// A text file whole, as bytes or cut by `tokenizer`: see [`whole_windows`].
pub fn whole_text(path: &Path, tokenizer: Option<&Tokenizer>, context: usize) -> Result<Dataset> {
    let name = path.display().to_string();
    match tokenizer {
        Some(t) => {
            let (ids, bytes) = read_text_tokens(path, t)?;
            whole_windows(TokenSource::Memory(ids), t.vocab_size(), context, bytes, &name)
        }
        // Bytes stay bytes: the windows of a byte text, back to back.
        None => {
            let bytes = super::text::read_text(path)?;
            let n = whole_count(bytes.len() as u64, context, &name)? as usize;
            let starts: Vec<usize> = (0..n).map(|i| i * (context + 1)).collect();
            Ok(super::text::windows(&bytes, &starts, context + 1, format!("{name} (whole)")))
        }
    }
}

/// A text file's token ids (with the end-of-document token after it, as a
/// token directory holds it) and its size in bytes.
fn read_text_tokens(path: &Path, tokenizer: &Tokenizer) -> Result<(Vec<u32>, u64)> {
    let bytes = super::text::read_text(path)?;
    let mut ids = Vec::new();
    let n = tokenize_pieces(tokenizer, bytes.as_slice(), &path.display().to_string(), |piece, _| {
        ids.extend(piece);
        Ok(())
    })?;
    if let Some(eos) = tokenizer.eos() {
        ids.push(eos);
    }
    Ok((ids, n))
}

/// Open a token directory as training and validation windows of
/// `context + 1` tokens.
pub fn load_tokens(dir: &Path, context: usize) -> Result<Split> {
    let index = TokenIndex::read(dir)?;
    let source = TokenSource::open(dir, &index)?;
    token_split(source, index.vocab_size, context, index.text_bytes, &format!("tokens:{}", dir.display()))
}

/// A UTF-8 text tokenized in memory, cut as a token directory of the same
/// text would be.
pub fn load_text_tokens(path: &Path, tokenizer: &Tokenizer, context: usize) -> Result<Split> {
    let (ids, bytes) = read_text_tokens(path, tokenizer)?;
    token_split(TokenSource::Memory(ids), tokenizer.vocab_size(), context, bytes, &path.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> Result<(tempfile::TempDir, Tokenizer, PathBuf)> {
        let dir = tempfile::tempdir().map_err(|e| ModelError::io("tempdir", e))?;
        let text = dir.path().join("sample.txt");
        std::fs::write(&text, super::super::SAMPLE_TEXT).map_err(|e| ModelError::io(&text, e))?;
        let t = Tokenizer::train_bpe(std::slice::from_ref(&text), 600)?;
        Ok((dir, t, text))
    }

    #[test]
    fn a_token_directory_holds_the_text_and_reads_back_like_the_text_in_memory() -> Result<()> {
        let (dir, t, text) = tokenizer()?;
        let out = dir.path().join("tokens");
        let mut seen = 0;
        let index = tokenize_files(&t, &[text.clone(), text.clone()], &out, |_, _, _| seen += 1)?;
        assert!(seen >= 2);
        assert_eq!((index.width, index.vocab_size, index.documents), (TokenWidth::U16, 600, 2));
        assert_eq!(TokenIndex::read(&out)?, index);
        // The ids decode to the two copies, each followed by the end-of-text token.
        let source = TokenSource::open(&out, &index)?;
        let mut all = vec![0f32; index.tokens as usize];
        source.read(0, &mut all)?;
        let ids: Vec<u32> = all.iter().map(|&v| v as u32).collect();
        let one = t.encode(super::super::SAMPLE_TEXT)?;
        let eos = t.eos().unwrap_or(u32::MAX);
        let expected: Vec<u32> = [one.clone(), vec![eos], one, vec![eos]].concat();
        assert_eq!(ids, expected);
        assert_eq!(t.decode(&ids[..ids.len() / 2 - 1])?, super::super::SAMPLE_TEXT);

        // The same content in another folder has the same hash; a change changes it.
        let again = tokenize_files(&t, &[text.clone(), text.clone()], &dir.path().join("copy"), |_, _, _| ())?;
        assert_eq!(again.content_hash, index.content_hash);
        let once = tokenize_files(&t, std::slice::from_ref(&text), &dir.path().join("once"), |_, _, _| ())?;
        assert_ne!(once.content_hash, index.content_hash);

        // Windows from the files equal windows of the text tokenized in memory.
        let files = load_tokens(&dir.path().join("once"), 32)?;
        let memory = load_text_tokens(&text, &t, 32)?;
        assert_eq!((files.train.len(), files.test.len()), (memory.train.len(), memory.test.len()));
        let cpu = candle_core::Device::Cpu;
        for (a, b) in [(&files.train, &memory.train), (&files.test, &memory.test)] {
            let rows: Vec<usize> = (0..a.len()).step_by(7).collect();
            let (xa, _) = a.batch(&rows, &cpu)?;
            let (xb, _) = b.batch(&rows, &cpu)?;
            assert_eq!(xa.flatten_all()?.to_vec1::<f32>()?, xb.flatten_all()?.to_vec1::<f32>()?);
        }
        // Consecutive training windows overlap by one token; the validation
        // split is the end of the stream.
        let (x, _) = files.train.batch(&[0, 1], &cpu)?;
        let x = x.flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(x[32], x[33]);
        let held = (once.tokens as f64 * 0.1).round() as u64;
        assert_eq!(files.test.len() as u64, (held - 1) / 32);
        Ok(())
    }

    #[test]
    fn a_damaged_directory_is_an_error_that_names_the_file() -> Result<()> {
        let (dir, t, text) = tokenizer()?;
        let out = dir.path().join("tokens");
        tokenize_files(&t, std::slice::from_ref(&text), &out, |_, _, _| ())?;
        let e = tokenize_files(&t, std::slice::from_ref(&text), &out, |_, _, _| ())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("already holds"), "{e}");
        let shard = out.join(shard_name(0));
        let bytes = std::fs::read(&shard).map_err(|e| ModelError::io(&shard, e))?;
        std::fs::write(&shard, &bytes[..bytes.len() - 2]).map_err(|e| ModelError::io(&shard, e))?;
        // The directory's own tokenizer is taken for it; another one is refused.
        let own = out.join(TOKENIZER_FILE);
        let kind = super::super::DatasetKind::Tokens { dir: out.clone(), context: 16 };
        let found = super::super::dataset_tokenizer(&kind, None)?.map(|t| t.hash());
        assert_eq!(found, Some(t.hash()));
        assert_eq!(super::super::dataset_tokenizer(&kind, Some(&own))?.map(|t| t.hash()), Some(t.hash()));
        let other = dir.path().join("other.json");
        Tokenizer::train_bpe(std::slice::from_ref(&text), 300)?.save(&other)?;
        let e = super::super::dataset_tokenizer(&kind, Some(&other)).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("another tokenizer"), "{e}");
        let e = load_tokens(&out, 16).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("tokens-00000.bin") && e.contains("bytes"), "{e}");
        let e = load_tokens(&dir.path().join("nothing"), 16).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("shoal data tokenize"), "{e}");
        let short = dir.path().join("short");
        let mut w = TokenWriter::create(&short, &t)?;
        w.push(&[1, 2, 3])?;
        assert!(w.push(&[600]).is_err(), "an id outside the vocabulary");
        w.finish(6)?;
        let e = load_tokens(&short, 16).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("too few"), "{e}");
        Ok(())
    }
}
