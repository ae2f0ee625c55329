//! Tokenizers: Hugging Face `tokenizer.json` files, read and written with the
//! `tokenizers` crate, and a byte-level BPE trained from local text for
//! clusters that cannot download one from a hub.
//!
//! A language model's vocabulary is its tokenizer's: token ids are what the
//! data sets hold and what the model's embedding rows are indexed by. Without
//! a tokenizer a text is read byte by byte (a vocabulary of 256).

use std::path::{Path, PathBuf};
use std::str::FromStr;

use crate::error::{ModelError, Result};
use crate::rng::stable_hash64;

/// The end-of-text token a trained BPE gets, put between documents.
pub const END_OF_TEXT: &str = "<|endoftext|>";

/// End-of-document tokens looked for in a tokenizer, in this order.
const EOS_NAMES: [&str; 4] = [END_OF_TEXT, "</s>", "<|end_of_text|>", "<eos>"];

/// The largest vocabulary: token ids travel through the model's input as f32
/// values, exact up to 2^24.
pub const MAX_VOCAB: usize = 1 << 24;

/// The smallest byte-level BPE: the 256 byte symbols and the end-of-text
/// token.
pub const MIN_BPE_VOCAB: usize = 257;

/// A tokenizer read from (or trained into) Hugging Face's `tokenizer.json`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// [`Self::hash`], computed once.
    hash: u64,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("vocab", &self.vocab_size()).field("eos", &self.eos()).finish()
    }
}

fn tk_err(what: impl std::fmt::Display, e: tokenizers::Error) -> ModelError {
    ModelError::Invalid(format!("{what}: {e}"))
}

impl Tokenizer {
    /// Read a `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        Self::from_json(&text).map_err(|e| ModelError::BadFile { path: path.into(), reason: e.to_string() })
    }

    /// Parse the text of a `tokenizer.json`.
    pub fn from_json(text: &str) -> Result<Self> {
        Self::new(tokenizers::Tokenizer::from_str(text).map_err(|e| tk_err("not a tokenizer.json", e))?)
    }

    /// Check a tokenizer's vocabulary and hash its compact JSON.
    fn new(inner: tokenizers::Tokenizer) -> Result<Self> {
        let json = inner.to_string(false).map_err(|e| tk_err("cannot write the tokenizer back", e))?;
        let t = Tokenizer { inner, hash: stable_hash64(json.as_bytes()) };
        let vocab = t.vocab_size();
        if vocab == 0 || vocab > MAX_VOCAB {
            return Err(ModelError::Invalid(format!(
                "the tokenizer has {vocab} tokens; 1 to {MAX_VOCAB} are supported"
            )));
        }
        Ok(t)
    }

    /// Train a byte-level BPE of `vocab` tokens (the end-of-text token
    /// included) on UTF-8 text files, as GPT-2 and Llama 3 tokenizers are
    /// built: GPT-2's pre-tokenizing regex over bytes mapped to printable
    /// characters, so that any text encodes without an unknown token.
    pub fn train_bpe(files: &[PathBuf], vocab: usize) -> Result<Self> {
        use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
        use tokenizers::pre_tokenizers::byte_level::ByteLevel;
        use tokenizers::{AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper};

        if !(MIN_BPE_VOCAB..=MAX_VOCAB).contains(&vocab) {
            return Err(ModelError::Invalid(format!(
                "a byte-level BPE needs {MIN_BPE_VOCAB} to {MAX_VOCAB} tokens (256 bytes and {END_OF_TEXT}); got {vocab}"
            )));
        }
        if files.is_empty() {
            return Err(ModelError::Invalid("train-tokenizer needs at least one text file".into()));
        }
        for f in files {
            std::fs::metadata(f).map_err(|e| ModelError::io(f, e))?;
        }
        let mut trainer = BpeTrainerBuilder::new()
            .show_progress(false)
            .vocab_size(vocab)
            .min_frequency(2)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .special_tokens(vec![AddedToken::from(END_OF_TEXT, true)])
            .build();
        let byte_level = ByteLevel::new(false, true, true);
        let mut tk = tokenizers::TokenizerBuilder::<
            BPE,
            NormalizerWrapper,
            PreTokenizerWrapper,
            PostProcessorWrapper,
            DecoderWrapper,
        >::new()
        .with_model(BPE::default())
        .with_pre_tokenizer(Some(byte_level.into()))
        .with_post_processor(Some(byte_level.into()))
        .with_decoder(Some(byte_level.into()))
        .build()
        .map_err(|e| tk_err("building the tokenizer", e))?;
        let names: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
        tk.train_from_files(&mut trainer, names).map_err(|e| tk_err("training the tokenizer", e))?;
        Self::new(tk.into())
    }

    /// Tokens in the vocabulary, added (special) tokens included: the size
    /// of a model's embedding.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The end-of-document token, when the tokenizer has one of the usual
    /// names.
    pub fn eos(&self) -> Option<u32> {
        EOS_NAMES.iter().find_map(|n| self.inner.token_to_id(n))
    }

    /// Token ids of `text`, without special tokens added around it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        // `encode_fast` leaves out the character offsets, which nothing here reads.
        let enc = self.inner.encode_fast(text, false).map_err(|e| tk_err("tokenizing", e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of each text, encoded in parallel on the current rayon
    /// pool.
    pub fn encode_batch(&self, texts: Vec<String>) -> Result<Vec<Vec<u32>>> {
        let encodings = self.inner.encode_batch_fast(texts, false).map_err(|e| tk_err("tokenizing", e))?;
        Ok(encodings.into_iter().map(|e| e.get_ids().to_vec()).collect())
    }

    /// The text of token ids (special tokens kept).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| tk_err("decoding", e))
    }

    /// A hash of the tokenizer's JSON: two tokenizers with equal hashes cut
    /// text alike.
    pub fn hash(&self) -> u64 {
        self.hash
    }

    /// Write the tokenizer as a `tokenizer.json`.
    pub fn save(&self, path: &Path) -> Result<()> {
        let text = self.inner.to_string(true).map_err(|e| tk_err("cannot write the tokenizer", e))?;
        crate::files::write_atomic(path, format!("{text}\n").as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_file(dir: &Path) -> PathBuf {
        let p = dir.join("sample.txt");
        let _ = std::fs::write(&p, include_str!("../data/gpl-3.0.txt"));
        p
    }

    #[test]
    fn a_trained_bpe_round_trips_text_and_its_file() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| ModelError::io("tempdir", e))?;
        let t = Tokenizer::train_bpe(&[sample_file(dir.path())], 1000)?;
        assert_eq!(t.vocab_size(), 1000);
        let eos = t.eos();
        assert!(eos.is_some(), "a trained BPE has {END_OF_TEXT}");
        let text = "The GNU General Public License is a free, copyleft license. Ünïcödé ✓\n";
        let ids = t.encode(text)?;
        assert!(
            ids.len() < text.len() / 2,
            "{} tokens for {} bytes: the merges did not compress",
            ids.len(),
            text.len()
        );
        assert_eq!(t.decode(&ids)?, text);
        // Every id is inside the vocabulary, and bytes the text never held still encode.
        assert!(ids.iter().all(|&i| (i as usize) < t.vocab_size()));
        assert_eq!(t.decode(&t.encode("\u{1F980}\t\0")?)?, "\u{1F980}\t\0");
        // The file written reads back as the same tokenizer.
        let path = dir.path().join("tokenizer.json");
        t.save(&path)?;
        let back = Tokenizer::from_file(&path)?;
        assert_eq!((back.hash(), back.encode(text)?, back.eos()), (t.hash(), ids, eos));
        Ok(())
    }

    #[test]
    fn bad_sizes_and_files_are_errors() {
        let dir = tempfile::tempdir().ok();
        let Some(dir) = dir else { return };
        let f = sample_file(dir.path());
        let e = Tokenizer::train_bpe(std::slice::from_ref(&f), 100).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("257"), "{e}");
        let e = Tokenizer::train_bpe(&[dir.path().join("missing.txt")], 500)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("missing.txt"), "{e}");
        let bad = dir.path().join("tokenizer.json");
        let _ = std::fs::write(&bad, "{\"model\": 3}");
        let e = Tokenizer::from_file(&bad).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("tokenizer.json"), "{e}");
    }
}
