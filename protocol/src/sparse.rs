//! The body of a `Sparse2` payload: top-k per chunk with 2-bit values, the
//! push encoding of SparseLoCo (Templar) and DeMo's relatives, for
//! pseudo-gradients with error feedback.
//!
//! The tensor is cut into chunks of `chunk` entries (the last may be
//! shorter). In each, the `min(k, nonzeros)` largest-magnitude nonzero
//! entries are kept (ties: the lower index); a shorter last chunk of `len`
//! entries keeps `ceil(k len / chunk)`, the same share. Their magnitudes are cut at the
//! median into a smaller and a larger half; the chunk's two levels are the
//! two halves' mean magnitudes (`lo`, `hi`; one kept entry: both its
//! magnitude). Each kept entry travels as its index within the chunk (u16)
//! and 2 bits: its sign and which level is nearer its magnitude. So a kept
//! entry costs 2.25 bytes and a chunk 10 more, against 8 per entry for
//! plain top-k: at 4,096-entry chunks and 1.5% kept, about 111x fewer
//! bytes than f32.
//!
//! Layout, little-endian: `chunks` u16 counts (kept per chunk), `chunks`
//! pairs of f32 levels (`lo`, `hi`; finite, not negative), `nnz` u16
//! indices (strictly increasing within their chunk, below its length),
//! then `ceil(nnz / 4)` bytes of 2-bit codes, entry `e` in bits `2 (e % 4)`
//! and up of byte `e / 4` (bit 0: `hi`, bit 1: negative); the last byte's
//! unused bits are 0. The counts must add up to `nnz`. One canonical body
//! for each decoded tensor and level pair, so the checksum and the fuzz
//! corpus see every malformed body as one.

use crate::error::{ProtocolError, Result};

/// Largest chunk: indices within a chunk, and counts, are u16.
pub const MAX_SPARSE_CHUNK: u32 = u16::MAX as u32;
/// SparseLoCo's chunk: 4,096 entries (a 64 x 64 tile's worth).
pub const DEFAULT_SPARSE_CHUNK: u32 = 4096;

/// A chunk size a header or an encoding may name: `1..=MAX_SPARSE_CHUNK`.
pub fn check_chunk(chunk: u32) -> Result<()> {
    if chunk == 0 || chunk > MAX_SPARSE_CHUNK {
        return Err(ProtocolError::InvalidTensor(format!(
            "sparse chunk of {chunk} entries not in 1..={MAX_SPARSE_CHUNK}"
        )));
    }
    Ok(())
}

/// Bytes per chunk: its count and its two levels.
const CHUNK_BYTES: u64 = 2 + 8;

/// Body bytes for `numel` entries in chunks of `chunk` with `nnz` kept;
/// `None` on overflow or a zero chunk.
pub(crate) fn body_len(numel: u64, nnz: u64, chunk: u32) -> Option<u64> {
    if chunk == 0 {
        return None;
    }
    let chunks = numel.div_ceil(u64::from(chunk));
    chunks.checked_mul(CHUNK_BYTES)?.checked_add(nnz.checked_mul(2)?)?.checked_add(nnz.div_ceil(4))
}

/// The mean of `s` (0 for none), summed in f64: at most the largest value,
/// so finite for finite input.
fn mean(s: &[f32]) -> f32 {
    if s.is_empty() {
        return 0.0;
    }
    (s.iter().map(|&v| f64::from(v)).sum::<f64>() / s.len() as f64) as f32
}

/// Encodes finite `values` in chunks of `chunk` (1..=[`MAX_SPARSE_CHUNK`]),
/// keeping up to `k` entries of each. Returns the body and the entries kept.
pub(crate) fn encode(values: &[f32], chunk: usize, k: usize) -> (Vec<u8>, u64) {
    let chunks = values.len().div_ceil(chunk);
    let mut counts = Vec::with_capacity(chunks * 2);
    let mut levels = Vec::with_capacity(chunks * 8);
    let mut indices = Vec::new();
    let mut codes: Vec<u8> = Vec::new();
    let mut nnz = 0usize;
    let (mut order, mut mags) = (Vec::<u16>::with_capacity(chunk), Vec::<f32>::with_capacity(chunk));
    for part in values.chunks(chunk) {
        order.clear();
        order.extend((0..part.len()).filter(|&i| part[i] != 0.0).map(|i| i as u16));
        let share = if part.len() == chunk { k } else { (k.saturating_mul(part.len())).div_ceil(chunk) };
        let keep = share.min(order.len());
        if keep < order.len() {
            if keep > 0 {
                order.select_nth_unstable_by(keep - 1, |&a, &b| {
                    part[usize::from(b)].abs().total_cmp(&part[usize::from(a)].abs()).then(a.cmp(&b))
                });
            }
            order.truncate(keep);
        }
        order.sort_unstable();
        mags.clear();
        mags.extend(order.iter().map(|&i| part[usize::from(i)].abs()));
        mags.sort_unstable_by(f32::total_cmp);
        let half = mags.len() / 2;
        let hi = mean(&mags[half..]);
        let lo = if half == 0 { hi } else { mean(&mags[..half]) };
        counts.extend_from_slice(&(order.len() as u16).to_le_bytes());
        levels.extend_from_slice(&lo.to_le_bytes());
        levels.extend_from_slice(&hi.to_le_bytes());
        for &i in &order {
            let v = part[usize::from(i)];
            let code = u8::from(v.abs() - lo > hi - v.abs()) | (u8::from(v < 0.0) << 1);
            if nnz.is_multiple_of(4) {
                codes.push(0);
            }
            if let Some(byte) = codes.last_mut() {
                *byte |= code << (2 * (nnz % 4));
            }
            indices.extend_from_slice(&i.to_le_bytes());
            nnz += 1;
        }
    }
    let mut body = counts;
    body.extend_from_slice(&levels);
    body.extend_from_slice(&indices);
    body.extend_from_slice(&codes);
    (body, nnz as u64)
}

/// Calls `f(index, value)` for each kept entry of a body whose length
/// [`body_len`] gave, in index order, after checking it as the module docs
/// say.
pub(crate) fn for_each(data: &[u8], numel: u64, nnz: u64, chunk: u32, mut f: impl FnMut(usize, f32)) -> Result<()> {
    let bad = |m: String| Err(ProtocolError::InvalidTensor(format!("sparse-2bit: {m}")));
    let chunks = numel.div_ceil(u64::from(chunk.max(1))) as usize;
    let nnz = nnz as usize;
    if body_len(numel, nnz as u64, chunk) != Some(data.len() as u64) {
        return bad(format!("a body of {} bytes for {numel} entries, {nnz} kept", data.len()));
    }
    let (counts, rest) = data.split_at(chunks * 2);
    let (levels, rest) = rest.split_at(chunks * 8);
    let (indices, codes) = rest.split_at(nnz * 2);
    let word = |b: &[u8], i: usize| u16::from_le_bytes([b[2 * i], b[2 * i + 1]]);
    let float = |b: &[u8], i: usize| f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]);
    let chunk = chunk as usize;
    let mut e = 0usize;
    for c in 0..chunks {
        let count = usize::from(word(counts, c));
        let len = chunk.min(numel as usize - c * chunk);
        if count > len || e + count > nnz {
            return bad(format!("chunk {c} of {len} entries keeps {count}, {} of {nnz} already kept", e));
        }
        let (lo, hi) = (float(levels, 2 * c), float(levels, 2 * c + 1));
        if !(lo.is_finite() && hi.is_finite() && lo >= 0.0 && hi >= 0.0) {
            return bad(format!("chunk {c} has levels {lo} and {hi}"));
        }
        let mut next_min = 0usize;
        for _ in 0..count {
            let i = usize::from(word(indices, e));
            if i < next_min || i >= len {
                return bad(format!("index {i} in chunk {c} (of {len} entries) is out of order or range"));
            }
            next_min = i + 1;
            let code = (codes[e / 4] >> (2 * (e % 4))) & 3;
            let magnitude = if code & 1 != 0 { hi } else { lo };
            f(c * chunk + i, if code & 2 != 0 { -magnitude } else { magnitude });
            e += 1;
        }
    }
    if e != nnz {
        return bad(format!("the chunks keep {e} entries, the header says {nnz}"));
    }
    if !nnz.is_multiple_of(4) && codes[nnz / 4] >> (2 * (nnz % 4)) != 0 {
        return bad("the last code byte's unused bits are not 0".into());
    }
    Ok(())
}
