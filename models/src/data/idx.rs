//! Reader for the IDX format used by MNIST and Fashion-MNIST.
//!
//! Layout (big-endian): two zero bytes, a type code (0x08 = u8), the number of
//! dimensions, then one u32 per dimension, then the data. Files may be gzipped
//! (detected by the gzip magic, not by the file name).
//!
//! Everything is checked before it is trusted: magic, type, rank, that the
//! declared sizes fit in memory limits, and that the data length matches the
//! header exactly (a truncated or padded file is an error).

use std::io::{BufRead, Read};
use std::path::Path;

use crate::error::{ModelError, Result};

/// Refuse files that would decompress beyond this (Fashion-MNIST train images
/// are 47 MB; this leaves room for larger sets while stopping gzip bombs).
pub const MAX_IDX_BYTES: u64 = 1 << 30;

/// A decoded IDX array of u8.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdxArray {
    /// The dimensions of `data` (the first counts the rows kept).
    pub dims: Vec<usize>,
    pub data: Vec<u8>,
    /// Rows (first dimension) in the file, kept or not.
    pub file_rows: usize,
}

/// Read and decode an IDX file (raw or gzip), streaming: the only large
/// allocation is the data itself, sized from the header (Fashion-MNIST's
/// training images take 47 MB while loading, not the compressed file plus
/// a growing buffer plus a copy).
pub fn read_idx_file(path: &Path) -> Result<IdxArray> {
    read_idx_file_rows(path, None)
}

/// Read an IDX file keeping only `rows` of its first dimension (ascending, no
/// repeats); `None`: all of it.
pub fn read_idx_file_rows(path: &Path, rows: Option<&[usize]>) -> Result<IdxArray> {
    with_idx_reader(path, |r| read_idx_rows(r, rows))
}

/// Run `read` on the decompressed stream of an IDX file (raw or gzip,
/// detected by the gzip magic); its errors name the file.
fn with_idx_reader<T>(path: &Path, read: impl FnOnce(&mut dyn Read) -> std::result::Result<T, String>) -> Result<T> {
    let file = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
    let mut reader = std::io::BufReader::new(file);
    let head = reader.fill_buf().map_err(|e| ModelError::io(path, e))?;
    let gzip = head.len() >= 2 && head[0] == 0x1f && head[1] == 0x8b;
    let parsed = if gzip {
        read(&mut flate2::bufread::GzDecoder::new(reader)).map_err(|reason| match reason.strip_prefix(READ_ERROR) {
            Some(e) => format!("corrupt gzip stream: {e}"),
            None => reason,
        })
    } else {
        read(&mut reader)
    };
    parsed.map_err(|reason| ModelError::bad_file(path, reason))
}

/// Parse IDX bytes that are already decompressed.
pub fn parse_idx(bytes: &[u8]) -> std::result::Result<IdxArray, String> {
    read_idx(&mut &bytes[..])
}

/// Read as many bytes as `buf` holds, or fewer at the end of the stream;
/// returns how many.
fn read_up_to(r: &mut (impl Read + ?Sized), buf: &mut [u8]) -> std::result::Result<usize, String> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(stream_error(e)),
        }
    }
    Ok(n)
}

const READ_ERROR: &str = "read error: ";

fn stream_error(e: std::io::Error) -> String {
    format!("{READ_ERROR}{e}")
}

/// Read and check an IDX header: the dimensions and the data bytes they
/// declare (at most [`MAX_IDX_BYTES`]). The stream is left at the data.
fn read_idx_header(r: &mut (impl Read + ?Sized)) -> std::result::Result<(Vec<usize>, u64), String> {
    let mut magic = [0u8; 4];
    let got = read_up_to(r, &mut magic)?;
    if got < 4 {
        return Err(format!("too short for an IDX header ({got} bytes)"));
    }
    if magic[0] != 0 || magic[1] != 0 {
        return Err(format!(
            "bad IDX magic {:02x}{:02x}{:02x}{:02x}: not an IDX file",
            magic[0], magic[1], magic[2], magic[3]
        ));
    }
    if magic[2] != 0x08 {
        return Err(format!("IDX element type 0x{:02x} unsupported (only u8, 0x08)", magic[2]));
    }
    let rank = magic[3] as usize;
    if rank == 0 || rank > 4 {
        return Err(format!("IDX rank {rank} unsupported (1 to 4)"));
    }
    let header = 4 + 4 * rank;
    let mut sizes = [0u8; 16];
    let got = read_up_to(r, &mut sizes[..4 * rank])?;
    if got < 4 * rank {
        return Err(format!("truncated IDX header: {} bytes, need {header}", 4 + got));
    }
    let mut dims: Vec<usize> = Vec::with_capacity(rank);
    let mut total: u64 = 1;
    for d in sizes[..4 * rank].chunks_exact(4) {
        let v = u32::from_be_bytes([d[0], d[1], d[2], d[3]]);
        total = total.saturating_mul(v as u64);
        dims.push(v as usize);
    }
    if total > MAX_IDX_BYTES {
        return Err(format!("IDX dims {dims:?} declare {total} bytes, over the {MAX_IDX_BYTES} limit"));
    }
    Ok((dims, total))
}

/// The dimensions of an IDX file (raw or gzip), from its header alone: the
/// data is neither read nor checked.
pub fn idx_file_dims(path: &Path) -> Result<Vec<usize>> {
    with_idx_reader(path, |r| read_idx_header(r).map(|(dims, _)| dims))
}

/// Decode one IDX array from a stream, checking the header before the data
/// is allocated and that the stream ends exactly where the data does.
pub fn read_idx(r: &mut impl Read) -> std::result::Result<IdxArray, String> {
    read_idx_rows(r, None)
}

/// Like [`read_idx`], keeping only `rows` (ascending, no repeats) of the
/// first dimension when given: the others are read and dropped, so memory
/// holds only the rows kept.
pub fn read_idx_rows(r: &mut (impl Read + ?Sized), rows: Option<&[usize]>) -> std::result::Result<IdxArray, String> {
    let (mut dims, total) = read_idx_header(r)?;
    let file_rows = dims[0];
    let data = match rows {
        None => {
            let mut data = Vec::with_capacity(total as usize);
            (&mut *r).take(total).read_to_end(&mut data).map_err(stream_error)?;
            if (data.len() as u64) < total {
                return Err(format!("truncated: dims {dims:?} need {total} data bytes, file has {}", data.len()));
            }
            data
        }
        Some(rows) => {
            let n = dims[0];
            if let Some(w) = rows.windows(2).find(|w| w[0] >= w[1]) {
                return Err(format!("rows must be ascending without repeats ({} then {})", w[0], w[1]));
            }
            if let Some(&last) = rows.last().filter(|&&l| l >= n) {
                return Err(format!("row {last} out of range: the file has {n} rows"));
            }
            let row_len = if n == 0 { 0 } else { (total / n as u64) as usize };
            let mut data = Vec::with_capacity(rows.len() * row_len);
            let mut row = vec![0u8; row_len];
            let mut wanted = rows.iter().peekable();
            for i in 0..n {
                if read_up_to(r, &mut row)? < row_len {
                    return Err(format!("truncated: dims {dims:?} need {total} data bytes, the file ends in row {i}"));
                }
                if wanted.next_if_eq(&&i).is_some() {
                    data.extend_from_slice(&row);
                }
            }
            dims[0] = rows.len();
            data
        }
    };
    let mut probe = [0u8; 1];
    if read_up_to(r, &mut probe)? > 0 {
        return Err(format!("trailing bytes: dims {dims:?} need {total} data bytes, the file has more"));
    }
    Ok(IdxArray { dims, data, file_rows })
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
    fn gzipped_and_raw_files_read_the_same_and_a_cut_gzip_is_truncated() -> Result<()> {
        use std::io::Write;
        let dir = tempfile::tempdir().map_err(|e| ModelError::Invalid(e.to_string()))?;
        let raw = images(5, 3, 4);
        let gz = |bytes: &[u8]| -> Vec<u8> {
            let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
            enc.write_all(bytes).ok();
            enc.finish().unwrap_or_default()
        };
        let (p_raw, p_gz, p_cut) = (dir.path().join("a"), dir.path().join("a.gz"), dir.path().join("cut.gz"));
        std::fs::write(&p_raw, &raw).map_err(|e| ModelError::io(&p_raw, e))?;
        std::fs::write(&p_gz, gz(&raw)).map_err(|e| ModelError::io(&p_gz, e))?;
        std::fs::write(&p_cut, gz(&raw[..raw.len() - 7])).map_err(|e| ModelError::io(&p_cut, e))?;
        let expected = parse_idx(&raw).map_err(ModelError::Invalid)?;
        assert_eq!(expected.data.len(), 60);
        assert_eq!(read_idx_file(&p_raw)?, expected);
        assert_eq!(read_idx_file(&p_gz)?, expected);
        let e = read_idx_file(&p_cut).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("truncated") && e.contains("53"), "{e}");
        // The header alone: the cut data is not read.
        assert_eq!(idx_file_dims(&p_cut)?, vec![5, 3, 4]);
        assert_eq!(idx_file_dims(&p_raw)?, vec![5, 3, 4]);
        Ok(())
    }

    #[test]
    fn only_the_rows_asked_for_are_kept() -> std::result::Result<(), String> {
        let raw = images(6, 2, 3);
        let all = parse_idx(&raw)?;
        let some = read_idx_rows(&mut &raw[..], Some(&[1, 4, 5]))?;
        assert_eq!(some.dims, vec![3, 2, 3]);
        let row = |i: usize| all.data[i * 6..(i + 1) * 6].to_vec();
        assert_eq!(some.data, [row(1), row(4), row(5)].concat());
        assert_eq!(read_idx_rows(&mut &raw[..], Some(&[]))?.data.len(), 0);
        let e = read_idx_rows(&mut &raw[..], Some(&[2, 1])).err().unwrap_or_default();
        assert!(e.contains("ascending"), "{e}");
        let e = read_idx_rows(&mut &raw[..], Some(&[6])).err().unwrap_or_default();
        assert!(e.contains("out of range"), "{e}");
        let e = read_idx_rows(&mut &raw[..raw.len() - 1], Some(&[0])).err().unwrap_or_default();
        assert!(e.contains("truncated"), "{e}");
        let mut padded = raw;
        padded.push(1);
        let e = read_idx_rows(&mut &padded[..], Some(&[0])).err().unwrap_or_default();
        assert!(e.contains("trailing"), "{e}");
        Ok(())
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
            let _ = read_idx(&mut flate2::read::GzDecoder::new(&bytes[..]));
        }
    }
}
