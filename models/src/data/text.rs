//! Text for language models: any UTF-8 file as a stream of bytes (a
//! byte-level vocabulary of 256, so no tokenizer is needed), split into
//! train and validation by position and cut into windows of `context + 1`
//! bytes: the model reads the first `context` and predicts each next one.
//!
//! A window is stored as one sample of a [`Dataset`] of shape
//! `1 x 1 x (context + 1)`, its bytes as f32 values (exact up to 2^24), so
//! that partitions, seeded batching, workers and shard owners treat text
//! exactly like images. Labels are unused and zero.

use std::path::Path;

use super::{Dataset, ImageShape, Samples, Split};
use crate::error::{ModelError, Result};
use crate::rng::DetRng;

/// The byte-level vocabulary.
pub const BYTE_VOCAB: usize = 256;

/// Context length when `text:PATH` names none.
pub const DEFAULT_CONTEXT: usize = 64;

/// The share of the file, from its end, held out for validation.
const VALIDATION_FRACTION: f64 = 0.1;

/// Training windows per `context` bytes of training text: each epoch visits
/// every byte about this many times, at random offsets.
const WINDOWS_PER_CONTEXT: usize = 2;

/// Fixed seed of the window offsets: independent of the training seed, so
/// that every peer cuts the same windows.
const WINDOW_SEED: u64 = 0x5EED_7E47_0000_0001;

/// The largest text file accepted (the windows are held in memory as f32).
pub const MAX_TEXT_BYTES: u64 = 64 << 20;

/// A small English text shipped with the repository (the GNU GPL v3, copied
/// verbatim as its own notice allows; see `models/data/README.md`). Tests
/// and examples train on it.
pub static SAMPLE_TEXT: &str = include_str!("../../data/gpl-3.0.txt");

/// Load a UTF-8 text file as train and validation windows of `context + 1`
/// bytes.
pub fn load_text(path: &Path, context: usize) -> Result<Split> {
    text_split(&read_text(path)?, context, &path.display().to_string())
}

/// The bytes of a UTF-8 text file of at most [`MAX_TEXT_BYTES`] (a text
/// read whole into memory, as bytes or to be tokenized).
pub(crate) fn read_text(path: &Path) -> Result<Vec<u8>> {
    let meta =
        std::fs::metadata(path).map_err(|e| ModelError::Invalid(format!("text file {}: {e}", path.display())))?;
    if meta.len() > MAX_TEXT_BYTES {
        return Err(ModelError::Invalid(format!(
            "text file {} has {} bytes; at most {} are held in memory: cut a larger text into a token directory (`shoal data tokenize`) and use tokens:DIR",
            path.display(),
            meta.len(),
            MAX_TEXT_BYTES
        )));
    }
    let bytes = std::fs::read(path).map_err(|e| ModelError::Invalid(format!("text file {}: {e}", path.display())))?;
    if let Err(e) = std::str::from_utf8(&bytes) {
        return Err(ModelError::Invalid(format!(
            "text file {} is not UTF-8 (first bad byte at offset {})",
            path.display(),
            e.valid_up_to()
        )));
    }
    Ok(bytes)
}

/// Cut `bytes` into train windows (random offsets in the first 90%) and
/// validation windows (back to back over the last 10%).
pub fn text_split(bytes: &[u8], context: usize, name: &str) -> Result<Split> {
    if context == 0 {
        return Err(ModelError::Invalid("text context must be at least 1".into()));
    }
    let window = context + 1;
    let cut = ((bytes.len() as f64) * (1.0 - VALIDATION_FRACTION)).round() as usize;
    let (train, valid) = bytes.split_at(cut.min(bytes.len()));
    if train.len() < window || valid.len() < window {
        return Err(ModelError::Invalid(format!(
            "text {name} has {} bytes: too short for windows of {window} bytes (the last {}% is held out for validation, so at least {} bytes are needed)",
            bytes.len(),
            (VALIDATION_FRACTION * 100.0) as u32,
            ((window as f64) / VALIDATION_FRACTION).ceil() as usize
        )));
    }
    let count = (WINDOWS_PER_CONTEXT * train.len() / context).max(1);
    let span = (train.len() - window + 1) as u64;
    let mut rng = DetRng::derive(WINDOW_SEED, "text-windows");
    let starts: Vec<usize> = (0..count).map(|_| rng.below(span) as usize).collect();
    let valid_starts: Vec<usize> = (0..valid.len() / window).map(|i| i * window).collect();
    Ok(Split {
        train: windows(train, &starts, window, format!("{name} (train)")),
        test: windows(valid, &valid_starts, window, format!("{name} (validation)")),
    })
}

pub(crate) fn windows(bytes: &[u8], starts: &[usize], window: usize, name: String) -> Dataset {
    let mut raw = Vec::with_capacity(starts.len() * window);
    for &s in starts {
        raw.extend_from_slice(&bytes[s..s + window]);
    }
    Dataset {
        name,
        shape: ImageShape { channels: 1, height: 1, width: window },
        classes: BYTE_VOCAB,
        samples: Samples::Bytes(raw),
        divisor: 1.0,
        labels: vec![0; starts.len()],
    }
}

/// The entropy in bits per byte of the byte frequencies of `bytes`: what a
/// model that learned only letter frequencies would reach.
pub fn unigram_entropy(bytes: &[u8]) -> f64 {
    let mut counts = [0u64; 256];
    for &b in bytes {
        counts[b as usize] += 1;
    }
    let n = bytes.len().max(1) as f64;
    counts.iter().filter(|&&c| c > 0).map(|&c| c as f64 / n).map(|p| -p * p.log2()).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_hold_the_text_and_split_by_position() -> Result<()> {
        let text: Vec<u8> = (0..1000u32).map(|i| b'a' + (i % 26) as u8).collect();
        let split = text_split(&text, 8, "abc")?;
        assert_eq!(split.train.shape.width, 9);
        assert_eq!(split.train.classes, 256);
        assert_eq!(split.train.len(), 2 * 900 / 8);
        assert_eq!(split.test.len(), 100 / 9);
        // Every window is a run of the alphabet: consecutive bytes differ by 1 mod 26.
        let (train, test) = (split.train.raw_bytes().unwrap_or_default(), split.test.raw_bytes().unwrap_or_default());
        for w in train.chunks(9).chain(test.chunks(9)) {
            for pair in w.windows(2) {
                assert_eq!((pair[1] as i32 - pair[0] as i32).rem_euclid(26), 1);
            }
        }
        // The validation windows are the last 100 bytes, back to back.
        assert_eq!(test[0], text[900]);
        // The same text gives the same windows.
        assert_eq!(text_split(&text, 8, "abc")?.train.raw_bytes(), Some(train));
        Ok(())
    }

    #[test]
    fn short_or_bad_text_is_an_error() {
        assert!(text_split(b"short", 8, "t").is_err());
        assert!(text_split(&[b'x'; 1000], 0, "t").is_err());
        let dir = std::env::temp_dir().join(format!("shoal-text-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let bad = dir.join("bad.txt");
        let _ = std::fs::write(&bad, [b'a', 0xff, 0xfe, b'b'].repeat(100));
        let err = load_text(&bad, 8).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("not UTF-8"), "{err}");
        let err = load_text(&dir.join("missing.txt"), 8).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("missing.txt"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn unigram_entropy_of_uniform_and_constant_text() {
        assert!((unigram_entropy(b"abcdabcd") - 2.0).abs() < 1e-12);
        assert_eq!(unigram_entropy(b"aaaa"), 0.0);
        let e = unigram_entropy(SAMPLE_TEXT.as_bytes());
        assert!((3.5..5.0).contains(&e), "English text has 4 to 4.5 bits per byte of unigram entropy; got {e}");
    }
}
