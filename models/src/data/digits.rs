//! The UCI handwritten digits, compiled into the binary (see `models/data/README.md`
//! for provenance and licence: CC BY 4.0, Alpaydin and Kaynak, 1998).

use std::io::Read;

use flate2::read::GzDecoder;

use super::{Dataset, ImageShape, Samples, Split};
use crate::error::{ModelError, Result};

/// The gzipped CSV, exactly as shipped by scikit-learn 1.9.1.
pub static DIGITS_CSV_GZ: &[u8] = include_bytes!("../../data/digits.csv.gz");

/// Seed of the fixed train/test split. It is independent of the training seed
/// so that every run, and every peer, evaluates on the same held-out set.
const SPLIT_SEED: u64 = 0x5EED_D161_7500_0001;
const TEST_FRACTION: f64 = 0.2;

/// Load the embedded digits: 1438 training and 359 test images of 8x8.
pub fn load_digits() -> Result<Split> {
    parse_digits_csv_gz(DIGITS_CSV_GZ)?.split(TEST_FRACTION, SPLIT_SEED)
}

/// Parse the gzipped CSV (64 pixels in 0..=16, then a label in 0..=9 per row).
pub fn parse_digits_csv_gz(gz: &[u8]) -> Result<Dataset> {
    let name = "embedded digits.csv.gz";
    let mut text = String::new();
    GzDecoder::new(gz)
        .take(16 << 20)
        .read_to_string(&mut text)
        .map_err(|e| ModelError::bad_file(name, format!("corrupt gzip/utf-8: {e}")))?;
    let mut raw = Vec::new();
    let mut labels = Vec::new();
    for (lineno, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split(',').collect();
        if fields.len() != 65 {
            return Err(ModelError::bad_file(
                name,
                format!("line {}: {} fields, expected 65", lineno + 1, fields.len()),
            ));
        }
        for (col, f) in fields.iter().enumerate() {
            // The file stores integers, sometimes written as floats ("0.0").
            let v: f32 = f.trim().parse().map_err(|_| {
                ModelError::bad_file(name, format!("line {} column {}: `{f}` is not a number", lineno + 1, col + 1))
            })?;
            if col < 64 {
                if !(0.0..=16.0).contains(&v) || v.fract() != 0.0 {
                    return Err(ModelError::bad_file(
                        name,
                        format!("line {}: pixel {v} is not a whole number in 0..16", lineno + 1),
                    ));
                }
                raw.push(v as u8);
            } else {
                if !(0.0..=9.0).contains(&v) || v.fract() != 0.0 {
                    return Err(ModelError::bad_file(name, format!("line {}: label {v} outside 0..9", lineno + 1)));
                }
                labels.push(v as u8);
            }
        }
    }
    if labels.is_empty() {
        return Err(ModelError::bad_file(name, "no rows"));
    }
    Ok(Dataset {
        name: "digits".into(),
        shape: ImageShape { channels: 1, height: 8, width: 8 },
        classes: 10,
        samples: Samples::Bytes(raw),
        divisor: 16.0,
        labels,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_digits_have_expected_size_and_split() {
        let all = parse_digits_csv_gz(DIGITS_CSV_GZ).ok();
        assert_eq!(all.as_ref().map(|d| d.len()), Some(1797));
        let split = load_digits().ok();
        assert_eq!(split.as_ref().map(|s| (s.train.len(), s.test.len())), Some((1438, 359)));
        // Every class appears in the held-out set.
        let test_labels = split.map(|s| s.test.labels).unwrap_or_default();
        for c in 0..10u8 {
            assert!(test_labels.contains(&c), "class {c} missing from the test split");
        }
    }

    #[test]
    fn corrupt_input_is_an_error() {
        assert!(parse_digits_csv_gz(b"not gzip").is_err());
    }
}
