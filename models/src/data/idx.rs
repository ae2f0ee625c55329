//! Reader for the IDX format used by MNIST and Fashion-MNIST.
//!
//! Layout (big-endian): two zero bytes, a type code (0x08 = u8), the number of
//! dimensions, then one u32 per dimension, then the data. Files may be gzipped
//! (detected by the gzip magic, not by the file name).
//!
//! Everything is checked before it is trusted: magic, type, rank, that the
//! declared sizes fit in memory limits, and that the data length matches the
//! header exactly (a truncated or padded file is an error).

use std::io::Read;
use std::path::Path;

use flate2::read::GzDecoder;

use crate::error::{ModelError, Result};

/// Refuse files that would decompress beyond this (Fashion-MNIST train images
/// are 47 MB; this leaves room for larger sets while stopping gzip bombs).
pub const MAX_IDX_BYTES: u64 = 1 << 30;

/// A decoded IDX array of u8.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdxArray {
    pub dims: Vec<usize>,
    pub data: Vec<u8>,
}

/// Read and decode an IDX file (raw or gzip).
pub fn read_idx_file(path: &Path) -> Result<IdxArray> {
    let raw = std::fs::read(path).map_err(|e| ModelError::io(path, e))?;
    let bytes = decompress_if_gzip(&raw).map_err(|reason| ModelError::bad_file(path, reason))?;
    parse_idx(&bytes).map_err(|reason| ModelError::bad_file(path, reason))
}

fn decompress_if_gzip(raw: &[u8]) -> std::result::Result<Vec<u8>, String> {
    if raw.len() >= 2 && raw[0] == 0x1f && raw[1] == 0x8b {
        let mut out = Vec::new();
        GzDecoder::new(raw)
            .take(MAX_IDX_BYTES + 1)
            .read_to_end(&mut out)
            .map_err(|e| format!("corrupt gzip stream: {e}"))?;
        if out.len() as u64 > MAX_IDX_BYTES {
            return Err(format!("decompresses to more than {MAX_IDX_BYTES} bytes"));
        }
        Ok(out)
    } else {
        Ok(raw.to_vec())
    }
}

/// Parse IDX bytes that are already decompressed.
pub fn parse_idx(bytes: &[u8]) -> std::result::Result<IdxArray, String> {
    if bytes.len() < 4 {
        return Err(format!("too short for an IDX header ({} bytes)", bytes.len()));
    }
    if bytes[0] != 0 || bytes[1] != 0 {
        return Err(format!(
            "bad IDX magic {:02x}{:02x}{:02x}{:02x}: not an IDX file",
            bytes[0], bytes[1], bytes[2], bytes[3]
        ));
    }
    if bytes[2] != 0x08 {
        return Err(format!("IDX element type 0x{:02x} unsupported (only u8, 0x08)", bytes[2]));
    }
    let rank = bytes[3] as usize;
    if rank == 0 || rank > 4 {
        return Err(format!("IDX rank {rank} unsupported (1 to 4)"));
    }
    let header = 4 + 4 * rank;
    if bytes.len() < header {
        return Err(format!("truncated IDX header: {} bytes, need {header}", bytes.len()));
    }
    let mut dims = Vec::with_capacity(rank);
    let mut total: u64 = 1;
    for d in 0..rank {
        let o = 4 + 4 * d;
        let v = u32::from_be_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]);
        total = total.saturating_mul(v as u64);
        dims.push(v as usize);
    }
    if total > MAX_IDX_BYTES {
        return Err(format!("IDX dims {dims:?} declare {total} bytes, over the {MAX_IDX_BYTES} limit"));
    }
    let body = &bytes[header..];
    if (body.len() as u64) != total {
        let what = if (body.len() as u64) < total { "truncated" } else { "trailing bytes" };
        return Err(format!("{what}: dims {dims:?} need {total} data bytes, file has {}", body.len()));
    }
    Ok(IdxArray { dims, data: body.to_vec() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn images(n: u32, h: u32, w: u32) -> Vec<u8> {
        let mut v = vec![0, 0, 8, 3];
        for d in [n, h, w] {
            v.extend_from_slice(&d.to_be_bytes());
        }
        v.extend((0..n * h * w).map(|i| (i % 251) as u8));
        v
    }

    #[test]
    fn parses_valid_images() {
        let a = parse_idx(&images(3, 2, 2));
        assert_eq!(a.as_ref().map(|a| a.dims.clone()).ok(), Some(vec![3, 2, 2]));
        assert_eq!(a.map(|a| a.data.len()).ok(), Some(12));
    }

    #[test]
    fn rejects_truncated_padded_and_bad_magic() {
        let good = images(3, 2, 2);
        let e = parse_idx(&good[..good.len() - 1]).err().unwrap_or_default();
        assert!(e.contains("truncated"), "{e}");
        let mut padded = good.clone();
        padded.push(0);
        assert!(parse_idx(&padded).err().unwrap_or_default().contains("trailing"));
        let mut bad = good.clone();
        bad[0] = 1;
        assert!(parse_idx(&bad).err().unwrap_or_default().contains("magic"));
        let mut bad_type = good;
        bad_type[2] = 0x0d;
        assert!(parse_idx(&bad_type).is_err());
        assert!(parse_idx(&[0, 0, 8]).is_err());
        assert!(parse_idx(&[0, 0, 8, 3, 0, 0]).err().unwrap_or_default().contains("header"));
    }

    #[test]
    fn rejects_huge_declared_dims_without_allocating() {
        let mut v = vec![0, 0, 8, 3];
        for d in [u32::MAX, u32::MAX, 28] {
            v.extend_from_slice(&d.to_be_bytes());
        }
        assert!(parse_idx(&v).err().unwrap_or_default().contains("limit"));
    }

    #[test]
    fn corrupt_gzip_is_an_error() {
        let dir = tempfile::tempdir().ok();
        let Some(dir) = dir else { return };
        let p = dir.path().join("x.gz");
        std::fs::write(&p, [0x1f, 0x8b, 8, 0, 1, 2, 3, 4, 5]).ok();
        let e = read_idx_file(&p).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("gzip"), "{e}");
        let missing = read_idx_file(&dir.path().join("nope"));
        assert!(matches!(missing, Err(ModelError::Io { .. })));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = parse_idx(&bytes);
            let _ = decompress_if_gzip(&bytes);
        }
    }
}
