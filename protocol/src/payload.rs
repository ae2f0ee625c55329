//! Tensor payloads: a small header ([`TensorMeta`]) that travels inside the
//! postcard message header, and the raw little-endian body bytes that travel
//! after it in the frame (never inside postcard).
//!
//! Encodings and their round-trip accuracy contracts (all inputs must be
//! finite; `x` is an input element, `x'` the decoded one):
//!
//! | encoding | body | contract |
//! |---|---|---|
//! | `F32` | `numel` x f32 LE | exact (bit-identical) |
//! | `F16` | `numel` x IEEE binary16 LE | `\|x'-x\| <= 2^-11 \|x\|` for `\|x\| >= 2^-14`; `\|x'-x\| <= 2^-25` below; `\|x\| > 65504` is an encode error |
//! | `Bf16` | `numel` x bfloat16 LE | `\|x'-x\| <= 2^-8 \|x\|` for normal `x`; `\|x'-x\| <= 2^-133` for subnormal `x`; round-to-nearest-even |
//! | `Int8 { block }` | `ceil(numel/block)` x f32 LE scales, then `numel` x i8 | per block, `scale = max\|x\|/127`, `\|x'-x\| <= scale/2 + 2^-20 max\|x\| + f32::MIN_POSITIVE` |
//! | `TopK { k }` | `nnz` x u32 LE indices (strictly increasing), then `nnz` x f32 LE values | the `min(k, numel)` largest-magnitude entries (ties: lower index) are exact, all others decode to 0 |
//! | `Sparse2 { chunk, k }` | see [`crate::sparse`]: per chunk a u16 count and f32 levels `lo`, `hi`; per kept entry a u16 index and 2 bits | in each chunk the `min(k, nonzeros)` largest-magnitude nonzero entries (ties: lower index; a shorter last chunk of `len`: `ceil(k len / chunk)`) decode to their sign times the nearer of the chunk's two levels (the mean magnitudes of the smaller and the larger half of the kept); all others decode to 0 |
//! | factors ([`Payload::encode_factored`]) | `block` x 4 u32 LE (`start`, `rows`, `cols`, `batch`) describing the factored blocks, then the entries outside every block as f32 LE in index order, then each block's `batch x rows` left and `batch x cols` right factors as f32 LE; `nnz` counts the f32 values | entries outside the blocks are exact; block entry `(r, c)` is `sum_b left[b][r] * right[b][c]`, summed in f32 in `b` order |
//!
//! Decoding reads straight out of the received [`Bytes`] (which the codec
//! slices out of the frame without copying) into the caller's `f32` buffer:
//! one copy in total.

use bytes::Bytes;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use serde::{Deserialize, Serialize};

use crate::error::{ProtocolError, Result};

/// Largest rank a tensor header may declare.
pub const MAX_RANK: usize = 8;
/// Largest int8 block size.
pub const MAX_INT8_BLOCK: u32 = 1 << 16;
/// A sensible int8 block size: 1.6 % scale overhead, tight per-block ranges.
pub const DEFAULT_INT8_BLOCK: u32 = 256;

pub use crate::sparse::{DEFAULT_SPARSE_CHUNK, MAX_SPARSE_CHUNK};

/// Most factored blocks one payload may carry.
pub const MAX_FACTOR_BLOCKS: u32 = 4096;
/// Bytes of one factored block's entry in a payload's table.
const FACTOR_ENTRY_BYTES: u64 = 16;

/// Staging size for chunked conversions (fits in L1).
const CHUNK: usize = 1024;

/// The on-wire dtype tag (`TensorMeta::dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Dtype {
    /// IEEE binary32.
    F32 = 0,
    /// IEEE binary16.
    F16 = 1,
    /// bfloat16.
    Bf16 = 2,
    /// int8 with one f32 scale per block.
    Int8Block = 3,
    /// Top-k sparse: u32 indices + f32 values.
    TopK = 4,
    /// Dense f32 with some blocks sent as their sufficient factors
    /// ([`Payload::encode_factored`]); lossless up to f32 rounding.
    Factors = 5,
    /// Top-k per chunk with 2-bit values ([`crate::sparse`]).
    Sparse2 = 6,
}

impl Dtype {
    /// Parses a wire tag.
    pub fn from_tag(tag: u8) -> Result<Dtype> {
        Ok(match tag {
            0 => Dtype::F32,
            1 => Dtype::F16,
            2 => Dtype::Bf16,
            3 => Dtype::Int8Block,
            4 => Dtype::TopK,
            5 => Dtype::Factors,
            6 => Dtype::Sparse2,
            other => return Err(ProtocolError::UnknownDtype(other)),
        })
    }

    /// Human-readable name.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::Int8Block => "int8-block",
            Dtype::TopK => "top-k",
            Dtype::Factors => "factors",
            Dtype::Sparse2 => "sparse-2bit",
        }
    }
}

/// How to encode a tensor (what a sender asks for; see the module docs for
/// each contract).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Encoding {
    /// Exact.
    F32,
    /// Half the bytes, ~3 significant decimal digits, range +-65504.
    F16,
    /// Half the bytes, ~2 significant decimal digits, full f32 range.
    Bf16,
    /// About a quarter of the bytes; error at most half a quantisation step.
    Int8 {
        /// Elements per scale, `1..=65536`.
        block: u32,
    },
    /// Keep only the `k` largest-magnitude entries.
    TopK {
        /// Entries kept (clamped to the element count).
        k: u64,
    },
    /// Keep the `k` largest-magnitude entries of each chunk of `chunk`, as
    /// signs and two levels per chunk ([`crate::sparse`]): SparseLoCo's
    /// push.
    Sparse2 {
        /// Entries per chunk, `1..=MAX_SPARSE_CHUNK`.
        chunk: u32,
        /// Entries kept per chunk (clamped to its nonzero entries).
        k: u32,
    },
}

impl Encoding {
    /// The dtype this encoding produces.
    pub fn dtype(self) -> Dtype {
        match self {
            Encoding::F32 => Dtype::F32,
            Encoding::F16 => Dtype::F16,
            Encoding::Bf16 => Dtype::Bf16,
            Encoding::Int8 { .. } => Dtype::Int8Block,
            Encoding::TopK { .. } => Dtype::TopK,
            Encoding::Sparse2 { .. } => Dtype::Sparse2,
        }
    }
}

/// The header of one tensor. Encoded with postcard inside the message header;
/// the body it describes follows in the frame body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorMeta {
    /// [`Dtype`] tag. Kept as a raw byte so a header from a newer peer still
    /// decodes and can be refused with [`ProtocolError::UnknownDtype`].
    pub dtype: u8,
    /// Int8 block size; the number of factored blocks for factors; 0 for
    /// every other dtype.
    pub block: u32,
    /// Logical shape; the product must equal `numel` (empty = scalar).
    pub shape: Vec<u64>,
    /// Element count of the dense tensor.
    pub numel: u64,
    /// Stored entries: `numel` for dense dtypes, the kept count for top-k.
    pub nnz: u64,
    /// Body length in bytes; must match what dtype, numel, nnz and block imply.
    pub byte_len: u64,
    /// xxh3-64 (seed 0) of the body bytes.
    pub checksum: u64,
}

impl TensorMeta {
    /// The dtype.
    pub fn dtype(&self) -> Result<Dtype> {
        Dtype::from_tag(self.dtype)
    }

    /// Checks that the header is self-consistent and within limits. This is
    /// the cheap check a receiver runs before touching the body.
    pub fn check(&self, max_elements: u64) -> Result<Dtype> {
        let dtype = self.dtype()?;
        if self.shape.len() > MAX_RANK {
            return Err(ProtocolError::InvalidTensor(format!("rank {} exceeds {MAX_RANK}", self.shape.len())));
        }
        let product = self
            .shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| ProtocolError::ShapeMismatch { shape: self.shape.clone(), numel: self.numel })?;
        if product != self.numel {
            return Err(ProtocolError::ShapeMismatch { shape: self.shape.clone(), numel: self.numel });
        }
        if self.numel > max_elements {
            return Err(ProtocolError::TooLarge { what: "tensor element count", len: self.numel, max: max_elements });
        }
        match dtype {
            Dtype::Int8Block if self.block == 0 || self.block > MAX_INT8_BLOCK => {
                return Err(ProtocolError::InvalidTensor(format!(
                    "int8 block size {} not in 1..={MAX_INT8_BLOCK}",
                    self.block
                )));
            }
            Dtype::Int8Block => {}
            Dtype::Factors if self.block > MAX_FACTOR_BLOCKS => {
                return Err(ProtocolError::InvalidTensor(format!(
                    "{} factored blocks, at most {MAX_FACTOR_BLOCKS}",
                    self.block
                )));
            }
            Dtype::Factors => {}
            Dtype::Sparse2 => crate::sparse::check_chunk(self.block)?,
            _ if self.block != 0 => {
                return Err(ProtocolError::InvalidTensor(format!("block must be 0 for {}", dtype.name())));
            }
            _ => {}
        }
        match dtype {
            Dtype::Sparse2 if self.nnz > self.numel => {
                return Err(ProtocolError::InvalidTensor(format!(
                    "sparse-2bit keeps {} of {} entries",
                    self.nnz, self.numel
                )));
            }
            Dtype::Sparse2 => {}
            Dtype::TopK => {
                if self.nnz > self.numel {
                    return Err(ProtocolError::InvalidTensor(format!(
                        "top-k keeps {} of {} entries",
                        self.nnz, self.numel
                    )));
                }
                if self.numel > u64::from(u32::MAX) + 1 {
                    return Err(ProtocolError::InvalidTensor("top-k indices are u32: numel must be <= 2^32".into()));
                }
            }
            Dtype::Factors => {
                // Factors are sent only where they are smaller than the
                // entries they stand for, so never more values than numel.
                if self.nnz > self.numel {
                    return Err(ProtocolError::InvalidTensor(format!(
                        "a factored tensor of {} entries carries {} values",
                        self.numel, self.nnz
                    )));
                }
                if self.numel > u64::from(u32::MAX) {
                    return Err(ProtocolError::InvalidTensor("factored offsets are u32: numel must be < 2^32".into()));
                }
            }
            _ if self.nnz != self.numel => {
                return Err(ProtocolError::InvalidTensor(format!(
                    "dense {} tensor must have nnz == numel",
                    dtype.name()
                )));
            }
            _ => {}
        }
        let expected = body_len(dtype, self.numel, self.nnz, self.block)
            .ok_or_else(|| ProtocolError::InvalidTensor("body length overflows u64".into()))?;
        if expected != self.byte_len {
            return Err(ProtocolError::SizeMismatch { expected, actual: self.byte_len });
        }
        Ok(dtype)
    }
}

/// Body bytes implied by a header; `None` on overflow.
fn body_len(dtype: Dtype, numel: u64, nnz: u64, block: u32) -> Option<u64> {
    match dtype {
        Dtype::F32 => numel.checked_mul(4),
        Dtype::F16 | Dtype::Bf16 => numel.checked_mul(2),
        Dtype::Int8Block => {
            let blocks = numel.div_ceil(u64::from(block.max(1)));
            blocks.checked_mul(4)?.checked_add(numel)
        }
        Dtype::TopK => nnz.checked_mul(8),
        Dtype::Factors => u64::from(block).checked_mul(FACTOR_ENTRY_BYTES)?.checked_add(nnz.checked_mul(4)?),
        Dtype::Sparse2 => crate::sparse::body_len(numel, nnz, block),
    }
}

/// One tensor: header plus body. `Serialize` writes only the header; the
/// codec carries the body after the postcard header and re-attaches it on
/// receipt (see `frame`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Payload {
    meta: TensorMeta,
    #[serde(skip)]
    data: Bytes,
}

/// A block of a tensor to send as its sufficient factors
/// ([`Payload::encode_factored`]): the `rows x cols` entries from `start`
/// (row-major) are `sum_b left[b * rows + r] * right[b * cols + c]`.
#[derive(Debug, Clone, Copy)]
pub struct FactorBlock<'a> {
    /// First entry of the block in the tensor.
    pub start: usize,
    pub rows: usize,
    pub cols: usize,
    /// `batch x rows`, one row per term.
    pub left: &'a [f32],
    /// `batch x cols`, one row per term.
    pub right: &'a [f32],
}

/// A factored block as a received table describes it.
#[derive(Debug, Clone, Copy)]
struct FactorBlockMeta {
    start: usize,
    rows: usize,
    cols: usize,
    batch: usize,
}

/// Calls `f(start + i, values)` for consecutive chunks of the
/// little-endian f32 values in `bytes` (value `i` onwards), after checking
/// each chunk is finite.
fn for_each_f32_chunk(bytes: &[u8], start: usize, f: &mut impl FnMut(usize, &[f32])) -> Result<()> {
    let mut buf = [0.0f32; CHUNK];
    for (c, chunk) in bytes.chunks(CHUNK * 4).enumerate() {
        let n = chunk.len() / 4;
        for (o, b) in buf[..n].iter_mut().zip(chunk.chunks_exact(4)) {
            *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        emit_chunk(start + c * CHUNK, &buf[..n], f)?;
    }
    Ok(())
}

/// Little-endian f32 bytes as values, each checked finite.
fn finite_f32s(bytes: &[u8]) -> Result<Vec<f32>> {
    let mut out = Vec::with_capacity(bytes.len() / 4);
    for_each_f32_chunk(bytes, 0, &mut |_, chunk| out.extend_from_slice(chunk))?;
    Ok(out)
}

/// xxh3-64 with seed 0, the checksum used for every body.
pub fn checksum(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// xxh3-64 (seed 0) of `values` as little-endian f32 bytes: what a delta
/// answer to a pull says the shard hashes to once the update is added
/// ([`crate::messages::DeltaOf::hash`]). Equal hashes mean, short of an
/// xxh3 collision, the same bits in every value.
pub fn params_hash(values: &[f32]) -> u64 {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut bytes = [0u8; 4 * CHUNK];
    for chunk in values.chunks(CHUNK) {
        for (o, v) in bytes.chunks_exact_mut(4).zip(chunk) {
            o.copy_from_slice(&v.to_le_bytes());
        }
        hasher.update(&bytes[..4 * chunk.len()]);
    }
    hasher.digest()
}

impl Payload {
    /// Encodes a 1-D tensor.
    pub fn encode(values: &[f32], encoding: Encoding) -> Result<Payload> {
        Payload::encode_shaped(values, &[values.len() as u64], encoding)
    }

    /// Encodes a tensor of the given shape (`values` in row-major order).
    pub fn encode_shaped(values: &[f32], shape: &[u64], encoding: Encoding) -> Result<Payload> {
        let numel = values.len() as u64;
        if shape.len() > MAX_RANK {
            return Err(ProtocolError::InvalidTensor(format!("rank {} exceeds {MAX_RANK}", shape.len())));
        }
        let product = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        if product != Some(numel) {
            return Err(ProtocolError::ShapeMismatch { shape: shape.to_vec(), numel });
        }
        // Dense encodings check finiteness, convert and hash chunk by chunk
        // (one pass over memory); the others check first, hash after.
        let (data, nnz, block, sum) = match encoding {
            Encoding::F32 => {
                let (d, h) = encode_dense(values, 4, |_, chunk, out| {
                    for (o, v) in out.chunks_exact_mut(4).zip(chunk) {
                        o.copy_from_slice(&v.to_le_bytes());
                    }
                    Ok(())
                })?;
                (d, numel, 0, h)
            }
            Encoding::F16 => {
                let (d, h) = encode_dense(values, 2, |start, chunk, out| {
                    let mut halves = [f16::ZERO; CHUNK];
                    let halves = &mut halves[..chunk.len()];
                    // Vectorised (F16C) where the CPU has it.
                    halves.convert_from_f32_slice(chunk);
                    if !halves.iter().fold(true, |ok, h| ok & !h.is_infinite()) {
                        let i = halves.iter().position(|h| h.is_infinite()).unwrap_or(0);
                        return Err(ProtocolError::OutOfRange {
                            index: (start + i) as u64,
                            value: chunk[i],
                            dtype: "f16",
                        });
                    }
                    for (o, x) in out.chunks_exact_mut(2).zip(halves.iter()) {
                        o.copy_from_slice(&x.to_bits().to_le_bytes());
                    }
                    Ok(())
                })?;
                (d, numel, 0, h)
            }
            Encoding::Bf16 => {
                let (d, h) = encode_dense(values, 2, |start, chunk, out| {
                    let mut overflow = false;
                    for (o, &v) in out.chunks_exact_mut(2).zip(chunk) {
                        let x = bf16::from_f32(v);
                        overflow |= x.is_infinite();
                        o.copy_from_slice(&x.to_bits().to_le_bytes());
                    }
                    if overflow {
                        let i = chunk.iter().position(|&v| bf16::from_f32(v).is_infinite()).unwrap_or(0);
                        return Err(ProtocolError::OutOfRange {
                            index: (start + i) as u64,
                            value: chunk[i],
                            dtype: "bf16",
                        });
                    }
                    Ok(())
                })?;
                (d, numel, 0, h)
            }
            Encoding::Int8 { block } => {
                if block == 0 || block > MAX_INT8_BLOCK {
                    return Err(ProtocolError::InvalidTensor(format!(
                        "int8 block size {block} not in 1..={MAX_INT8_BLOCK}"
                    )));
                }
                check_finite(values)?;
                let d = encode_int8(values, block as usize);
                let h = checksum(&d);
                (d, numel, block, h)
            }
            Encoding::TopK { k } => {
                if numel > u64::from(u32::MAX) + 1 {
                    return Err(ProtocolError::InvalidTensor("top-k indices are u32: numel must be <= 2^32".into()));
                }
                check_finite(values)?;
                let (d, kept) = encode_top_k(values, k.min(numel) as usize);
                let h = checksum(&d);
                (d, kept as u64, 0, h)
            }
            Encoding::Sparse2 { chunk, k } => {
                crate::sparse::check_chunk(chunk)?;
                check_finite(values)?;
                let (d, kept) = crate::sparse::encode(values, chunk as usize, k as usize);
                let h = checksum(&d);
                (d, kept, chunk, h)
            }
        };
        let meta = TensorMeta {
            dtype: encoding.dtype() as u8,
            block,
            shape: shape.to_vec(),
            numel,
            nnz,
            byte_len: data.len() as u64,
            checksum: sum,
        };
        Ok(Payload { meta, data: Bytes::from(data) })
    }

    /// Encodes a 1-D tensor with some blocks sent as their sufficient
    /// factors (Poseidon's sufficient-factor broadcast): a fully connected
    /// layer's weight gradient over a batch is `sum_b delta_b x_b^T`, so
    /// `batch x (rows + cols)` values stand for `rows x cols`. The entries
    /// of `values` outside the blocks travel as f32; those inside are not
    /// read. Blocks must be in order, not overlap, and each be smaller as
    /// factors than as entries.
    pub fn encode_factored(values: &[f32], blocks: &[FactorBlock<'_>]) -> Result<Payload> {
        let numel = values.len();
        if numel as u64 > u64::from(u32::MAX) {
            return Err(ProtocolError::InvalidTensor("factored offsets are u32: numel must be < 2^32".into()));
        }
        if blocks.len() > MAX_FACTOR_BLOCKS as usize {
            return Err(ProtocolError::InvalidTensor(format!(
                "{} factored blocks, at most {MAX_FACTOR_BLOCKS}",
                blocks.len()
            )));
        }
        let mut table = Vec::with_capacity(blocks.len() * FACTOR_ENTRY_BYTES as usize);
        let mut gaps: Vec<&[f32]> = Vec::with_capacity(blocks.len() + 1);
        let mut next_free = 0usize;
        for (k, b) in blocks.iter().enumerate() {
            let batch = b.left.len().checked_div(b.rows).unwrap_or(0);
            let len = b.rows * b.cols;
            if batch == 0 || b.cols == 0 || b.left.len() != batch * b.rows || b.right.len() != batch * b.cols {
                return Err(ProtocolError::InvalidTensor(format!(
                    "factored block {k}: {} left and {} right values for {} x {}",
                    b.left.len(),
                    b.right.len(),
                    b.rows,
                    b.cols
                )));
            }
            if batch * (b.rows + b.cols) >= len {
                return Err(ProtocolError::InvalidTensor(format!(
                    "factored block {k}: {batch} x ({} + {}) factors are no smaller than its {len} entries",
                    b.rows, b.cols
                )));
            }
            if b.start < next_free || b.start + len > numel {
                return Err(ProtocolError::InvalidTensor(format!(
                    "factored block {k} at {}..{} overlaps another or runs past {numel} entries",
                    b.start,
                    b.start + len
                )));
            }
            for word in [b.start, b.rows, b.cols, batch] {
                let word = u32::try_from(word)
                    .map_err(|_| ProtocolError::InvalidTensor(format!("factored block {k}: {word} exceeds u32")))?;
                table.extend_from_slice(&word.to_le_bytes());
            }
            gaps.push(&values[next_free..b.start]);
            next_free = b.start + len;
        }
        gaps.push(&values[next_free..]);
        let values_sent: usize = gaps.iter().map(|g| g.len()).sum::<usize>()
            + blocks.iter().map(|b| b.left.len() + b.right.len()).sum::<usize>();
        let mut data = table;
        data.reserve(values_sent * 4);
        for run in gaps.iter().copied().chain(blocks.iter().flat_map(|b| [b.left, b.right])) {
            check_finite(run)?;
            for v in run {
                data.extend_from_slice(&v.to_le_bytes());
            }
        }
        let meta = TensorMeta {
            dtype: Dtype::Factors as u8,
            block: blocks.len() as u32,
            shape: vec![numel as u64],
            numel: numel as u64,
            nnz: values_sent as u64,
            byte_len: data.len() as u64,
            checksum: checksum(&data),
        };
        Ok(Payload { meta, data: Bytes::from(data) })
    }

    /// Builds a payload from a received header and body, checking that they
    /// agree (but not the checksum: that is a pass over the body, done by
    /// [`Payload::verify`] and every decode).
    pub fn from_parts(meta: TensorMeta, data: Bytes, max_elements: u64) -> Result<Payload> {
        meta.check(max_elements)?;
        if data.len() as u64 != meta.byte_len {
            return Err(ProtocolError::SizeMismatch { expected: meta.byte_len, actual: data.len() as u64 });
        }
        Ok(Payload { meta, data })
    }

    /// The header.
    pub fn meta(&self) -> &TensorMeta {
        &self.meta
    }

    /// The body bytes (shares the frame's buffer).
    pub fn data(&self) -> &Bytes {
        &self.data
    }

    /// Element count of the dense tensor.
    pub fn numel(&self) -> u64 {
        self.meta.numel
    }

    /// Body length in bytes.
    pub fn byte_len(&self) -> u64 {
        self.meta.byte_len
    }

    /// Replaces the body (the codec does this after decoding the header).
    pub(crate) fn attach(&mut self, data: Bytes) {
        self.data = data;
    }

    /// Checks the checksum, and that every value decodes to a finite number
    /// (and top-k indices are strictly increasing and in range), without
    /// allocating. What a receiver runs before queueing a contribution.
    pub fn verify(&self) -> Result<()> {
        self.check_body()?;
        match self.meta.dtype()? {
            Dtype::TopK => self.for_each_sparse(|_, _| {}),
            Dtype::Sparse2 => self.for_each_sparse2(|_, _| {}),
            // The table, and every value finite; rebuilding the blocks is
            // left to the decode that uses them.
            Dtype::Factors => {
                let table = self.factor_table()?;
                for_each_f32_chunk(&self.data[table.len() * FACTOR_ENTRY_BYTES as usize..], 0, &mut |_, _| {})
            }
            dtype => self.for_each_dense_chunk(dtype, |_, _| {}),
        }
    }

    /// Decodes into a new vector of `numel` elements.
    pub fn decode(&self) -> Result<Vec<f32>> {
        let numel = usize::try_from(self.meta.numel)
            .map_err(|_| ProtocolError::InvalidTensor("numel does not fit in memory".into()))?;
        let mut out = vec![0.0f32; numel];
        self.decode_into(&mut out)?;
        Ok(out)
    }

    /// [`Self::verify`], keeping the outcome: the [`Verified`] payload
    /// decodes later without reading the body for its checks again.
    pub fn verified(self) -> Result<Verified> {
        self.verify()?;
        Ok(Verified(self))
    }

    /// Decodes into `out`, which must have exactly `numel` elements. On error
    /// `out` may be partly written.
    pub fn decode_into(&self, out: &mut [f32]) -> Result<()> {
        self.check_out_len(out.len())?;
        self.check_body()?;
        self.decode_body_into(out, true)
    }

    /// The decode after `check_out_len` and `check_body`. f32 values are
    /// checked for finiteness in a pass of their own, and only when
    /// `check_f32`; the other encodings check each chunk as they convert it.
    fn decode_body_into(&self, out: &mut [f32], check_f32: bool) -> Result<()> {
        match self.meta.dtype()? {
            Dtype::F32 => {
                // Fast path: straight from the frame bytes into `out`.
                for (o, b) in out.iter_mut().zip(self.data.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
                if check_f32 {
                    check_finite(out)
                } else {
                    Ok(())
                }
            }
            Dtype::TopK => {
                out.fill(0.0);
                self.for_each_sparse(|i, v| out[i] = v)
            }
            Dtype::Sparse2 => {
                out.fill(0.0);
                self.for_each_sparse2(|i, v| out[i] = v)
            }
            Dtype::Factors => self.for_each_factored(|start, chunk| {
                out[start..start + chunk.len()].copy_from_slice(chunk);
            }),
            dtype => self.for_each_dense_chunk(dtype, |start, chunk| {
                out[start..start + chunk.len()].copy_from_slice(chunk);
            }),
        }
    }

    /// Adds `weight * decoded` into `acc` (length `numel`) without
    /// materialising the decoded tensor: what an aggregator does with each
    /// contribution.
    pub fn add_scaled_into(&self, acc: &mut [f32], weight: f32) -> Result<()> {
        self.check_out_len(acc.len())?;
        // Only the stored values are visited (a sparse tensor's kept entries).
        self.for_each_stored(|start, chunk| {
            for (a, v) in acc[start..start + chunk.len()].iter_mut().zip(chunk) {
                *a += weight * v;
            }
        })
    }

    /// Calls `f(start, values)` for the values the body stores, in index
    /// order: consecutive chunks of a dense or factored tensor, one kept
    /// entry at a time of a sparse one (every entry not stored is zero),
    /// after the checksum; each value is checked finite and each index in
    /// order before `f` sees it, so one pass both checks and reads. On an
    /// error `f` may have seen part of the values.
    pub fn for_each_stored(&self, mut f: impl FnMut(usize, &[f32])) -> Result<()> {
        self.check_body()?;
        match self.meta.dtype()? {
            Dtype::TopK => self.for_each_sparse(|i, v| f(i, &[v])),
            Dtype::Sparse2 => self.for_each_sparse2(|i, v| f(i, &[v])),
            Dtype::Factors => self.for_each_factored(f),
            dtype => self.for_each_dense_chunk(dtype, f),
        }
    }

    /// How many values the body stores: `numel` for a dense or factored
    /// tensor, the kept entries of a sparse one. What a pass over the
    /// stored values costs, in elements.
    pub fn stored(&self) -> u64 {
        match self.meta.dtype() {
            Ok(Dtype::TopK | Dtype::Sparse2) => self.meta.nnz,
            _ => self.meta.numel,
        }
    }

    fn check_out_len(&self, len: usize) -> Result<()> {
        if len as u64 != self.meta.numel {
            return Err(ProtocolError::InvalidTensor(format!(
                "output buffer has {len} elements, tensor has {}",
                self.meta.numel
            )));
        }
        Ok(())
    }

    /// Header/body agreement and checksum. Cheap relative to any use of the
    /// body; run by every decode so a payload built by hand is still checked.
    fn check_body(&self) -> Result<()> {
        self.meta.check(u64::MAX)?;
        if self.data.len() as u64 != self.meta.byte_len {
            return Err(ProtocolError::SizeMismatch { expected: self.meta.byte_len, actual: self.data.len() as u64 });
        }
        let actual = checksum(&self.data);
        if actual != self.meta.checksum {
            return Err(ProtocolError::ChecksumMismatch { expected: self.meta.checksum, actual });
        }
        Ok(())
    }

    /// Calls `f(start, values)` for consecutive chunks of a dense tensor,
    /// after checking each chunk is finite. `check_body` must have passed.
    fn for_each_dense_chunk(&self, dtype: Dtype, mut f: impl FnMut(usize, &[f32])) -> Result<()> {
        let mut buf = [0.0f32; CHUNK];
        let data = &self.data[..];
        match dtype {
            Dtype::F32 => for_each_f32_chunk(data, 0, &mut f)?,
            Dtype::F16 => {
                let mut halves = [f16::ZERO; CHUNK];
                for (c, bytes) in data.chunks(CHUNK * 2).enumerate() {
                    let n = bytes.len() / 2;
                    for (h, b) in halves[..n].iter_mut().zip(bytes.chunks_exact(2)) {
                        *h = f16::from_bits(u16::from_le_bytes([b[0], b[1]]));
                    }
                    halves[..n].convert_to_f32_slice(&mut buf[..n]);
                    emit_chunk(c * CHUNK, &buf[..n], &mut f)?;
                }
            }
            Dtype::Bf16 => {
                for (c, bytes) in data.chunks(CHUNK * 2).enumerate() {
                    let n = bytes.len() / 2;
                    for (o, b) in buf[..n].iter_mut().zip(bytes.chunks_exact(2)) {
                        // bf16 is the top half of an f32: widening is exact.
                        *o = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
                    }
                    emit_chunk(c * CHUNK, &buf[..n], &mut f)?;
                }
            }
            Dtype::Int8Block => {
                let block = self.meta.block as usize;
                let numel = self.meta.numel as usize;
                let (scales, quants) = data.split_at(numel.div_ceil(block) * 4);
                for (b, (q_block, s)) in quants.chunks(block).zip(scales.chunks_exact(4)).enumerate() {
                    let scale = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                    if !scale.is_finite() || scale < 0.0 {
                        return Err(ProtocolError::InvalidTensor(format!("int8 block {b} has scale {scale}")));
                    }
                    // Blocks may exceed CHUNK; stage them in CHUNK pieces.
                    for (p, piece) in q_block.chunks(CHUNK).enumerate() {
                        for (o, &q) in buf[..piece.len()].iter_mut().zip(piece) {
                            *o = f32::from(q as i8) * scale;
                        }
                        emit_chunk(b * block + p * CHUNK, &buf[..piece.len()], &mut f)?;
                    }
                }
            }
            Dtype::TopK | Dtype::Factors | Dtype::Sparse2 => {
                return Err(ProtocolError::InvalidTensor(format!("{} is not dense", dtype.name())))
            }
        }
        Ok(())
    }

    /// The factored blocks of a factors payload, checked: in order, not
    /// overlapping, within the tensor, each smaller as factors than as
    /// entries, and the values they and the entries between them need
    /// adding up to `nnz`. `check_body` must have passed.
    fn factor_table(&self) -> Result<Vec<FactorBlockMeta>> {
        let count = self.meta.block as usize;
        let table_bytes = count * FACTOR_ENTRY_BYTES as usize;
        if self.data.len() < table_bytes {
            return Err(ProtocolError::InvalidTensor("factored table runs past the body".into()));
        }
        let word = |b: &[u8]| u64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        let mut blocks = Vec::with_capacity(count);
        let (mut next_free, mut values) = (0u64, 0u64);
        for (k, e) in self.data[..table_bytes].chunks_exact(FACTOR_ENTRY_BYTES as usize).enumerate() {
            let (start, rows, cols, batch) = (word(&e[0..4]), word(&e[4..8]), word(&e[8..12]), word(&e[12..16]));
            let len = rows * cols; // u32 x u32 fits in u64
            let factors = batch * (rows + cols);
            if rows == 0 || cols == 0 || batch == 0 || factors >= len {
                return Err(ProtocolError::InvalidTensor(format!(
                    "factored block {k}: {batch} x ({rows} + {cols}) factors for {rows} x {cols} entries"
                )));
            }
            if start < next_free || start + len > self.meta.numel {
                return Err(ProtocolError::InvalidTensor(format!(
                    "factored block {k} at {start}..{} overlaps another or runs past numel {}",
                    start + len,
                    self.meta.numel
                )));
            }
            values += (start - next_free) + factors;
            next_free = start + len;
            blocks.push(FactorBlockMeta {
                start: start as usize,
                rows: rows as usize,
                cols: cols as usize,
                batch: batch as usize,
            });
        }
        values += self.meta.numel - next_free;
        if values != self.meta.nnz {
            return Err(ProtocolError::InvalidTensor(format!(
                "factored table implies {values} values, the header says {}",
                self.meta.nnz
            )));
        }
        Ok(blocks)
    }

    /// Calls `f(start, values)` for consecutive runs of a factors payload
    /// in index order: the entries between blocks as sent, each block row
    /// by row as rebuilt from its factors. Every run is checked finite.
    /// `check_body` must have passed.
    fn for_each_factored(&self, mut f: impl FnMut(usize, &[f32])) -> Result<()> {
        let blocks = self.factor_table()?;
        let numel = self.meta.numel as usize;
        let mut rest = &self.data[blocks.len() * FACTOR_ENTRY_BYTES as usize..];
        // The entries outside the blocks come first in the body.
        let dense = numel - blocks.iter().map(|b| b.rows * b.cols).sum::<usize>();
        let (mut gaps, factors) = rest.split_at(dense * 4);
        rest = factors;
        // The entries from `pos` up to `to`, the next ones in `gaps`.
        let mut emit_gap = |pos: usize, to: usize, f: &mut _| {
            let (run, tail) = gaps.split_at((to - pos) * 4);
            gaps = tail;
            for_each_f32_chunk(run, pos, f)
        };
        let mut pos = 0usize;
        let mut row = Vec::new();
        for b in &blocks {
            emit_gap(pos, b.start, &mut f)?;
            let (left, tail) = rest.split_at(b.batch * b.rows * 4);
            let (right, tail) = tail.split_at(b.batch * b.cols * 4);
            rest = tail;
            let (left, right) = (finite_f32s(left)?, finite_f32s(right)?);
            row.resize(b.cols, 0.0);
            for r in 0..b.rows {
                row.fill(0.0);
                for (k, right) in right.chunks_exact(b.cols).enumerate() {
                    let l = left[k * b.rows + r];
                    for (o, v) in row.iter_mut().zip(right) {
                        *o += l * v;
                    }
                }
                emit_chunk(b.start + r * b.cols, &row, &mut f)?;
            }
            pos = b.start + b.rows * b.cols;
        }
        emit_gap(pos, numel, &mut f)
    }

    /// Calls `f(index, value)` for each kept entry of a sparse-2bit tensor
    /// after checking its body ([`crate::sparse`]). `check_body` must have
    /// passed.
    fn for_each_sparse2(&self, f: impl FnMut(usize, f32)) -> Result<()> {
        crate::sparse::for_each(&self.data, self.meta.numel, self.meta.nnz, self.meta.block, f)
    }

    /// Calls `f(index, value)` for each stored entry of a top-k tensor after
    /// checking indices are strictly increasing and in range and values are
    /// finite. `check_body` must have passed.
    fn for_each_sparse(&self, mut f: impl FnMut(usize, f32)) -> Result<()> {
        let nnz = self.meta.nnz as usize;
        let (idx, vals) = self.data.split_at(nnz * 4);
        let mut next_min: u64 = 0;
        for (k, (ib, vb)) in idx.chunks_exact(4).zip(vals.chunks_exact(4)).enumerate() {
            let i = u64::from(u32::from_le_bytes([ib[0], ib[1], ib[2], ib[3]]));
            if i < next_min || i >= self.meta.numel {
                return Err(ProtocolError::InvalidTensor(format!(
                    "top-k index {i} at position {k} is out of order or >= numel {}",
                    self.meta.numel
                )));
            }
            next_min = i + 1;
            let v = f32::from_le_bytes([vb[0], vb[1], vb[2], vb[3]]);
            if !v.is_finite() {
                return Err(ProtocolError::NonFinite { index: i, value: v });
            }
            f(i as usize, v);
        }
        Ok(())
    }
}

fn emit_chunk(start: usize, chunk: &[f32], f: &mut impl FnMut(usize, &[f32])) -> Result<()> {
    check_finite(chunk).map_err(|e| match e {
        ProtocolError::NonFinite { index, value } => ProtocolError::NonFinite { index: index + start as u64, value },
        other => other,
    })?;
    f(start, chunk);
    Ok(())
}

/// A payload whose checksum and values [`Payload::verified`] has checked
/// (for a receiver that checks on arrival and decodes later): its decode
/// does not read the body for those checks a second time.
#[derive(Debug, Clone, PartialEq)]
pub struct Verified(Payload);

impl Verified {
    pub fn numel(&self) -> u64 {
        self.0.numel()
    }

    /// [`Payload::decode_into`], without the checks already made.
    pub fn decode_into(&self, out: &mut [f32]) -> Result<()> {
        self.0.check_out_len(out.len())?;
        self.0.decode_body_into(out, false)
    }
}

/// Errors with the first non-finite value. Scans branch-free per chunk so the
/// common all-finite case vectorises.
pub fn check_finite(values: &[f32]) -> Result<()> {
    for (c, chunk) in values.chunks(CHUNK).enumerate() {
        if !chunk.iter().fold(true, |ok, v| ok & v.is_finite()) {
            let (i, v) =
                chunk.iter().enumerate().find(|(_, v)| !v.is_finite()).map(|(i, v)| (i, *v)).unwrap_or((0, f32::NAN));
            return Err(ProtocolError::NonFinite { index: (c * CHUNK + i) as u64, value: v });
        }
    }
    Ok(())
}

/// Encodes a dense tensor of `width` bytes per element, one chunk at a
/// time: check finiteness, convert with `put(start, chunk, out)`, and hash
/// the output while it is still in cache (one pass over memory).
fn encode_dense(
    values: &[f32],
    width: usize,
    mut put: impl FnMut(usize, &[f32], &mut [u8]) -> Result<()>,
) -> Result<(Vec<u8>, u64)> {
    let mut out = vec![0u8; values.len() * width];
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    for (c, (chunk, dst)) in values.chunks(CHUNK).zip(out.chunks_mut(CHUNK * width)).enumerate() {
        let start = c * CHUNK;
        check_finite(chunk).map_err(|e| match e {
            ProtocolError::NonFinite { index, value } => {
                ProtocolError::NonFinite { index: index + start as u64, value }
            }
            other => other,
        })?;
        put(start, chunk, dst)?;
        hasher.update(dst);
    }
    Ok((out, hasher.digest()))
}

/// `x.round().clamp(-127.0, 127.0) as i8` (half away from zero) for a
/// finite `x`, written so that the loop over a block vectorises: `round` is
/// a call into libm on baseline x86-64, which cost a fifth of int8
/// encoding. `x` is first brought within +-128 (where every f32 keeps its
/// fraction exactly); the cast then truncates toward zero, and the
/// fraction it dropped decides the rounding.
#[inline]
fn quantize(x: f32) -> i8 {
    let x = x.clamp(-128.0, 128.0);
    let t = x as i32;
    let frac = x - t as f32;
    let q = t + i32::from(frac >= 0.5) - i32::from(frac <= -0.5);
    q.clamp(-127, 127) as i8
}

fn encode_int8(values: &[f32], block: usize) -> Vec<u8> {
    let blocks = values.len().div_ceil(block);
    let mut out = vec![0u8; blocks * 4 + values.len()];
    let (scales, quants) = out.split_at_mut(blocks * 4);
    for ((chunk, s), q) in values.chunks(block).zip(scales.chunks_exact_mut(4)).zip(quants.chunks_mut(block)) {
        let max_abs = chunk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let scale = max_abs / 127.0;
        s.copy_from_slice(&scale.to_le_bytes());
        if scale > 0.0 {
            for (o, &v) in q.iter_mut().zip(chunk) {
                *o = quantize(v / scale) as u8;
            }
        }
        // scale == 0: the block is all zeros (or below f32 resolution); q stays 0.
    }
    out
}

fn encode_top_k(values: &[f32], k: usize) -> (Vec<u8>, usize) {
    let n = values.len();
    let mut chosen: Vec<u32> = if k == 0 {
        Vec::new()
    } else if k >= n {
        (0..n as u32).collect()
    } else {
        let mut idx: Vec<u32> = (0..n as u32).collect();
        // Larger magnitude first; ties go to the lower index so the choice is
        // deterministic across peers.
        idx.select_nth_unstable_by(k - 1, |&a, &b| {
            values[b as usize].abs().total_cmp(&values[a as usize].abs()).then(a.cmp(&b))
        });
        idx.truncate(k);
        idx
    };
    chosen.sort_unstable();
    let mut out = vec![0u8; chosen.len() * 8];
    let (idx_bytes, val_bytes) = out.split_at_mut(chosen.len() * 4);
    for ((ib, vb), &i) in idx_bytes.chunks_exact_mut(4).zip(val_bytes.chunks_exact_mut(4)).zip(&chosen) {
        ib.copy_from_slice(&i.to_le_bytes());
        vb.copy_from_slice(&values[i as usize].to_le_bytes());
    }
    let kept = chosen.len();
    (out, kept)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use proptest::prelude::*;

    fn finite() -> impl Strategy<Value = f32> {
        prop_oneof![
            -1e4f32..1e4f32,
            -1.0f32..1.0f32,
            (-1e-6f32..1e-6f32),
            Just(0.0f32),
            Just(-0.0f32),
            proptest::num::f32::NORMAL | proptest::num::f32::SUBNORMAL | proptest::num::f32::ZERO,
        ]
    }

    /// The hash is xxh3 of the f32 bytes, whatever the chunking, and tells
    /// a sign bit (0.0 from -0.0) or one ulp apart.
    #[test]
    fn params_hash_is_the_checksum_of_the_values_bytes() {
        let values: Vec<f32> = (0..2500).map(|i| (i as f32 * 0.37).sin()).collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(params_hash(&values), checksum(&bytes));
        assert_eq!(params_hash(&[]), checksum(&[]));
        let mut signed = values.clone();
        signed[1500] = if signed[1500] == 0.0 { -0.0 } else { f32::from_bits(signed[1500].to_bits() + 1) };
        assert_ne!(params_hash(&signed), params_hash(&values));
        assert_ne!(params_hash(&[0.0]), params_hash(&[-0.0]));
    }

    fn vec_f32() -> impl Strategy<Value = Vec<f32>> {
        proptest::collection::vec(finite(), 0..600)
    }

    /// Finite values that bf16 can hold: bf16 shares f32's exponent range, but its
    /// largest finite value is below `f32::MAX`, so the top of the f32 range rounds
    /// to infinity and is rejected (see `rejects_bf16_overflow`).
    fn vec_bf16_range() -> impl Strategy<Value = Vec<f32>> {
        let max = bf16::MAX.to_f32();
        proptest::collection::vec(finite().prop_filter("outside bf16 range", move |x| x.abs() <= max), 0..600)
    }

    proptest! {
        #[test]
        fn f32_round_trip_is_exact(v in vec_f32()) {
            let p = Payload::encode(&v, Encoding::F32).unwrap();
            let back = p.decode().unwrap();
            prop_assert_eq!(v.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                            back.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        }

        #[test]
        fn f16_round_trip_within_contract(v in proptest::collection::vec(-65000.0f32..65000.0, 0..600)) {
            let back = Payload::encode(&v, Encoding::F16).unwrap().decode().unwrap();
            for (x, y) in v.iter().zip(&back) {
                let tol = if x.abs() >= 2f32.powi(-14) { x.abs() * 2f32.powi(-11) } else { 2f32.powi(-25) };
                prop_assert!((x - y).abs() <= tol, "{x} -> {y}");
            }
        }

        #[test]
        fn bf16_round_trip_within_contract(v in vec_bf16_range()) {
            let back = Payload::encode(&v, Encoding::Bf16).unwrap().decode().unwrap();
            for (x, y) in v.iter().zip(&back) {
                // 2^-133 below the normal range: its bits, since `2f32.powi(-133)`
                // is 0 where it is not constant-folded (2^133 overflows, 1/inf).
                let tol = if x.abs() >= f32::MIN_POSITIVE { x.abs() * 2f32.powi(-8) } else { f32::from_bits(1 << 16) };
                prop_assert!((x - y).abs() <= tol, "{x} -> {y}");
            }
        }

        #[test]
        fn int8_round_trip_within_half_a_step(v in vec_f32(), block in 1u32..300) {
            let p = Payload::encode(&v, Encoding::Int8 { block }).unwrap();
            let back = p.decode().unwrap();
            for (xs, ys) in v.chunks(block as usize).zip(back.chunks(block as usize)) {
                let max_abs = xs.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                let scale = max_abs / 127.0;
                let tol = scale / 2.0 + max_abs * 2f32.powi(-20) + f32::MIN_POSITIVE;
                for (x, y) in xs.iter().zip(ys) {
                    prop_assert!((x - y).abs() <= tol, "{x} -> {y} (scale {scale})");
                }
            }
        }

        #[test]
        fn top_k_keeps_largest_exactly(v in vec_f32(), k in 0u64..700) {
            let p = Payload::encode(&v, Encoding::TopK { k }).unwrap();
            let back = p.decode().unwrap();
            let kept = k.min(v.len() as u64) as usize;
            prop_assert_eq!(p.meta().nnz as usize, kept);
            // Reference: sort by (magnitude desc, index asc).
            let mut order: Vec<usize> = (0..v.len()).collect();
            order.sort_by(|&a, &b| v[b].abs().total_cmp(&v[a].abs()).then(a.cmp(&b)));
            let keep: std::collections::HashSet<usize> = order[..kept].iter().copied().collect();
            for (i, (x, y)) in v.iter().zip(&back).enumerate() {
                if keep.contains(&i) {
                    prop_assert_eq!(x.to_bits(), y.to_bits());
                } else {
                    prop_assert_eq!(*y, 0.0);
                }
            }
        }

        #[test]
        fn sparse2_keeps_the_largest_of_each_chunk_as_sign_and_level(
            v in vec_f32(), chunk in 1u32..90, k in 0u32..20, zeros in 0usize..4,
        ) {
            // Some exact zeros, which are never kept.
            let v: Vec<f32> = v.into_iter().enumerate().map(|(i, x)| if i % 4 < zeros { 0.0 } else { x }).collect();
            let p = Payload::encode(&v, Encoding::Sparse2 { chunk, k }).unwrap();
            let back = p.decode().unwrap();
            p.verify().unwrap();
            let mut kept_total = 0;
            for (c, (part, got)) in v.chunks(chunk as usize).zip(back.chunks(chunk as usize)).enumerate() {
                let mut order: Vec<usize> = (0..part.len()).filter(|&i| part[i] != 0.0).collect();
                order.sort_by(|&a, &b| part[b].abs().total_cmp(&part[a].abs()).then(a.cmp(&b)));
                order.truncate(if part.len() == chunk as usize { k as usize } else { (k as usize * part.len()).div_ceil(chunk as usize) });
                kept_total += order.len();
                let keep: std::collections::HashSet<usize> = order.iter().copied().collect();
                let mut mags: Vec<f32> = order.iter().map(|&i| part[i].abs()).collect();
                mags.sort_by(f32::total_cmp);
                // Two levels per chunk at most.
                let mut levels: Vec<u32> = order.iter().map(|&i| got[i].abs().to_bits()).collect();
                levels.sort_unstable();
                levels.dedup();
                prop_assert!(levels.len() <= 2, "chunk {} decodes to {} magnitudes", c, levels.len());
                for (i, (x, y)) in part.iter().zip(got).enumerate() {
                    if !keep.contains(&i) {
                        prop_assert_eq!(*y, 0.0, "chunk {} entry {} was not kept", c, i);
                        continue;
                    }
                    prop_assert_eq!(x.is_sign_negative(), y.is_sign_negative(), "chunk {} entry {}: sign", c, i);
                    // Each level is a mean of kept magnitudes: within their range.
                    prop_assert!(y.abs() >= mags[0] * (1.0 - 1e-6) && y.abs() <= mags[mags.len() - 1] * (1.0 + 1e-6));
                }
            }
            prop_assert_eq!(p.meta().nnz as usize, kept_total);
            prop_assert_eq!(p.byte_len(), crate::sparse::body_len(v.len() as u64, kept_total as u64, chunk).unwrap());
        }

        #[test]
        fn add_scaled_matches_decode(v in vec_f32(), w in -2.0f32..2.0, enc in 0usize..6) {
            let encoding = [
                Encoding::F32,
                Encoding::F16,
                Encoding::Bf16,
                Encoding::Int8 { block: 7 },
                Encoding::TopK { k: 5 },
                Encoding::Sparse2 { chunk: 16, k: 3 },
            ][enc];
            let v: Vec<f32> = v.into_iter().map(|x| x.clamp(-60000.0, 60000.0)).collect();
            let p = Payload::encode(&v, encoding).unwrap();
            let dec = p.decode().unwrap();
            let mut acc = vec![1.0f32; v.len()];
            p.add_scaled_into(&mut acc, w).unwrap();
            for (a, d) in acc.iter().zip(&dec) {
                prop_assert_eq!(a.to_bits(), (1.0 + w * d).to_bits());
            }
        }

        #[test]
        fn arbitrary_bodies_never_panic(
            dtype in 0u8..8, block in 0u32..20, shape in proptest::collection::vec(0u64..50, 0..4),
            nnz in 0u64..100, body in proptest::collection::vec(any::<u8>(), 0..400), fix_checksum in any::<bool>(),
        ) {
            let numel = shape.iter().product::<u64>();
            let checksum_v = if fix_checksum { checksum(&body) } else { 7 };
            let meta = TensorMeta { dtype, block, shape, numel, nnz, byte_len: body.len() as u64, checksum: checksum_v };
            if let Ok(p) = Payload::from_parts(meta, Bytes::from(body), 1 << 20) {
                let _ = p.verify();
                let _ = p.decode();
            }
        }
    }

    /// Every malformed sparse-2bit body is refused by verify and decode,
    /// with its checksum made right so that only the body's check can
    /// refuse it.
    #[test]
    fn rejects_malformed_sparse2_bodies() {
        let v: Vec<f32> = (0..11).map(|i| (i as f32 - 4.5) * if i % 3 == 0 { 3.0 } else { 1.0 }).collect();
        let good = Payload::encode(&v, Encoding::Sparse2 { chunk: 4, k: 3 }).unwrap();
        good.verify().unwrap();
        // 3 chunks (4, 4, 3 entries) keep 3 each: 9 entries, 3 code bytes.
        assert_eq!(good.meta().nnz, 9);
        assert_eq!(good.byte_len(), 3 * 10 + 9 * 2 + 3);
        let with = |edit: &dyn Fn(&mut Vec<u8>)| {
            let mut body = good.data().to_vec();
            edit(&mut body);
            let meta = TensorMeta { checksum: checksum(&body), ..good.meta().clone() };
            Payload { meta, data: Bytes::from(body) }
        };
        let (levels, indices, codes) = (6, 30, 48);
        type Edit<'a> = (&'a str, &'a dyn Fn(&mut Vec<u8>));
        let cases: [Edit<'_>; 6] = [
            ("a count above its chunk", &|b| b[4] = 4),
            ("counts that do not add up", &|b| b[0] = 2),
            ("an index out of order", &|b| b.swap(indices, indices + 2)),
            ("an index past its chunk", &|b| b[indices + 4] = 4),
            ("a negative level", &|b| b[levels..levels + 4].copy_from_slice(&(-1.0f32).to_le_bytes())),
            ("unused code bits set", &|b| b[codes + 2] |= 0x80),
        ];
        for (what, edit) in cases {
            let p = with(edit);
            assert!(p.verify().is_err(), "{what}: verified");
            assert!(p.decode().is_err(), "{what}: decoded");
            assert!(p.add_scaled_into(&mut [0.0; 11], 1.0).is_err(), "{what}: added");
        }
        let zero_chunk = TensorMeta { block: 0, ..good.meta().clone() };
        assert!(zero_chunk.check(1 << 20).is_err());
        assert!(Payload::encode(&v, Encoding::Sparse2 { chunk: MAX_SPARSE_CHUNK + 1, k: 1 }).is_err());
    }

    #[test]
    fn rejects_non_finite_on_encode() {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let err = Payload::encode(&[1.0, bad], Encoding::F32).unwrap_err();
            assert!(matches!(err, ProtocolError::NonFinite { index: 1, .. }), "{err}");
        }
    }

    #[test]
    fn rejects_non_finite_on_decode() {
        // Hand-build an f32 body containing NaN with a valid checksum.
        let mut body = Vec::new();
        for v in [1.0f32, 2.0, f32::NAN] {
            body.extend_from_slice(&v.to_le_bytes());
        }
        let meta = TensorMeta {
            dtype: 0,
            block: 0,
            shape: vec![3],
            numel: 3,
            nnz: 3,
            byte_len: 12,
            checksum: checksum(&body),
        };
        let p = Payload::from_parts(meta, Bytes::from(body), 10).unwrap();
        assert!(matches!(p.decode().unwrap_err(), ProtocolError::NonFinite { index: 2, .. }));
        assert!(matches!(p.verify().unwrap_err(), ProtocolError::NonFinite { index: 2, .. }));
    }

    #[test]
    fn rejects_f16_overflow() {
        let err = Payload::encode(&[0.0, 70000.0], Encoding::F16).unwrap_err();
        assert!(matches!(err, ProtocolError::OutOfRange { index: 1, .. }), "{err}");
    }

    #[test]
    fn rejects_bf16_overflow() {
        // 3.3978e38 lies above bf16::MAX (3.3895e38) and rounds to infinity.
        let err = Payload::encode(&[1.0, 3.397_847_6e38], Encoding::Bf16).unwrap_err();
        assert!(matches!(err, ProtocolError::OutOfRange { index: 1, .. }), "{err}");
        assert!(Payload::encode(&[bf16::MAX.to_f32()], Encoding::Bf16).is_ok());
    }

    #[test]
    fn rejects_checksum_mismatch() {
        let p = Payload::encode(&[1.0, 2.0, 3.0], Encoding::F32).unwrap();
        let mut body = p.data().to_vec();
        body[0] ^= 1;
        let tampered = Payload::from_parts(p.meta().clone(), Bytes::from(body), 10).unwrap();
        assert!(matches!(tampered.decode().unwrap_err(), ProtocolError::ChecksumMismatch { .. }));
    }

    #[test]
    fn rejects_size_and_shape_mismatch() {
        let p = Payload::encode(&[1.0, 2.0, 3.0], Encoding::F32).unwrap();
        let short = p.data().slice(0..8);
        assert!(matches!(
            Payload::from_parts(p.meta().clone(), short, 10).unwrap_err(),
            ProtocolError::SizeMismatch { .. }
        ));
        let mut meta = p.meta().clone();
        meta.shape = vec![2, 2];
        assert!(matches!(
            Payload::from_parts(meta, p.data().clone(), 10).unwrap_err(),
            ProtocolError::ShapeMismatch { .. }
        ));
        assert!(matches!(
            Payload::encode_shaped(&[1.0, 2.0], &[3], Encoding::F32).unwrap_err(),
            ProtocolError::ShapeMismatch { .. }
        ));
        let mut meta = p.meta().clone();
        meta.dtype = 42;
        assert!(matches!(
            Payload::from_parts(meta, p.data().clone(), 10).unwrap_err(),
            ProtocolError::UnknownDtype(42)
        ));
        assert!(matches!(
            Payload::from_parts(p.meta().clone(), p.data().clone(), 2).unwrap_err(),
            ProtocolError::TooLarge { .. }
        ));
    }

    #[test]
    fn rejects_unsorted_top_k_indices() {
        let mut body = Vec::new();
        for i in [3u32, 1] {
            body.extend_from_slice(&i.to_le_bytes());
        }
        for v in [1.0f32, 2.0] {
            body.extend_from_slice(&v.to_le_bytes());
        }
        let meta = TensorMeta {
            dtype: 4,
            block: 0,
            shape: vec![5],
            numel: 5,
            nnz: 2,
            byte_len: 16,
            checksum: checksum(&body),
        };
        let p = Payload::from_parts(meta, Bytes::from(body), 10).unwrap();
        assert!(matches!(p.decode().unwrap_err(), ProtocolError::InvalidTensor(_)));
    }

    #[test]
    fn decode_shares_the_frame_buffer() {
        // A payload sliced out of a bigger buffer decodes from that buffer
        // without a copy of the body: the Bytes point into the same memory.
        let p = Payload::encode(&[1.5, -2.0], Encoding::F32).unwrap();
        let mut frame = vec![0xAAu8; 5];
        frame.extend_from_slice(p.data());
        let frame = Bytes::from(frame);
        let body = frame.slice(5..);
        assert_eq!(body.as_ptr(), frame[5..].as_ptr());
        let q = Payload::from_parts(p.meta().clone(), body, 10).unwrap();
        assert_eq!(q.decode().unwrap(), vec![1.5, -2.0]);
    }

    #[test]
    fn a_verified_payload_decodes_as_the_checked_decode_and_a_bad_one_is_not_verified() {
        let values: Vec<f32> = (0..5000).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        for encoding in [Encoding::F32, Encoding::F16, Encoding::Bf16, Encoding::Int8 { block: 64 }] {
            let p = Payload::encode(&values, encoding).expect("encodes");
            let expect = p.decode().expect("decodes");
            let v = p.verified().expect("verifies");
            assert_eq!(v.numel(), 5000);
            let mut out = vec![f32::NAN; 5000];
            v.decode_into(&mut out).expect("decodes");
            assert_eq!(out, expect, "{encoding:?}");
            let wrong_length = v.decode_into(&mut out[1..]);
            assert!(
                matches!(&wrong_length, Err(ProtocolError::InvalidTensor(r)) if r.contains("output buffer")),
                "{encoding:?}: a wrong length: {wrong_length:?}"
            );
        }
        let good = Payload::encode(&values, Encoding::F32).expect("encodes");
        let mut body = good.data().to_vec();
        body[40] ^= 1;
        let corrupt = Payload::from_parts(good.meta().clone(), body.into(), u64::MAX).expect("parts");
        assert!(matches!(corrupt.verified(), Err(ProtocolError::ChecksumMismatch { .. })));
        let inf = f32::INFINITY.to_le_bytes();
        let mut body = good.data().to_vec();
        body[8..12].copy_from_slice(&inf);
        let meta = TensorMeta { checksum: checksum(&body), ..good.meta().clone() };
        let nonfinite = Payload::from_parts(meta, body.into(), u64::MAX).expect("parts");
        assert!(matches!(nonfinite.verified(), Err(ProtocolError::NonFinite { index: 2, .. })));
    }

    #[test]
    fn quantize_rounds_half_away_from_zero_as_round_does() {
        let mut xs = vec![0.0f32, -0.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -126.5, 127.0, 127.49, 200.0, -1e9];
        xs.extend([3e9f32, -3e9, 2147483648.0, -2147483648.0, f32::MAX, f32::MIN, 127.5, -127.5, 128.0, -128.5]);
        xs.extend([0.49999997f32, -0.49999997, 0.50000006, 1.4999999, 126.49999, f32::MIN_POSITIVE]);
        for i in -260_000..=260_000 {
            xs.push(i as f32 / 1000.0);
        }
        for x in xs {
            assert_eq!(quantize(x), x.round().clamp(-127.0, 127.0) as i8, "{x}");
        }
    }

    #[test]
    fn int8_scale_zero_block_decodes_to_zero() {
        let p = Payload::encode(&[0.0; 10], Encoding::Int8 { block: 4 }).unwrap();
        assert_eq!(p.byte_len(), 3 * 4 + 10);
        assert_eq!(p.decode().unwrap(), vec![0.0; 10]);
    }

    /// A tensor of 3 + (4 x 6) + 2 + (6 x 5) + 1 entries whose two blocks
    /// are sums of outer products over a batch of 1 and 2.
    type FactoredCase = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

    fn factored_case() -> FactoredCase {
        let left_a = vec![0.5, -1.0, 2.0, 0.25];
        let right_a = vec![1.0, 2.0, 3.0, -4.0, 0.5, 0.0];
        let left_b: Vec<f32> = (0..12).map(|i| i as f32 * 0.1 - 0.5).collect();
        let right_b: Vec<f32> = (0..10).map(|i| 1.0 - i as f32 * 0.3).collect();
        let mut full = vec![7.0, 8.0, 9.0];
        for l in &left_a {
            full.extend(right_a.iter().map(|c| l * c));
        }
        full.extend([-1.0, -2.0]);
        for r in 0..6 {
            full.extend((0..5).map(|c| (0..2).map(|b| left_b[b * 6 + r] * right_b[b * 5 + c]).sum::<f32>()));
        }
        full.push(3.5);
        (full, left_a, right_a, left_b, right_b)
    }

    #[test]
    fn factored_blocks_decode_to_their_outer_products() {
        let (full, la, ra, lb, rb) = factored_case();
        let blocks = [
            FactorBlock { start: 3, rows: 4, cols: 6, left: &la, right: &ra },
            FactorBlock { start: 29, rows: 6, cols: 5, left: &lb, right: &rb },
        ];
        let p = Payload::encode_factored(&full, &blocks).expect("valid blocks");
        // 6 entries outside the blocks, 1 x (4 + 6) and 2 x (6 + 5) factors.
        assert_eq!(p.meta().nnz, 6 + 10 + 22);
        assert_eq!(p.byte_len(), 2 * 16 + 4 * 38);
        assert!(p.byte_len() < 4 * full.len() as u64, "smaller than f32");
        p.verify().expect("verifies");
        let back = p.decode().expect("decodes");
        assert_eq!(back.len(), full.len());
        for (i, (a, b)) in back.iter().zip(&full).enumerate() {
            assert!((a - b).abs() <= 1e-6, "entry {i}: {a} against {b}");
        }
        let mut acc = vec![1.0f32; full.len()];
        p.add_scaled_into(&mut acc, 2.0).expect("adds");
        for (i, (a, b)) in acc.iter().zip(&full).enumerate() {
            assert!((a - (1.0 + 2.0 * b)).abs() <= 1e-5, "entry {i}");
        }
        // Received as a header and a body, it decodes the same.
        let q = Payload::from_parts(p.meta().clone(), p.data().clone(), 1000).expect("consistent");
        assert_eq!(q.decode().expect("decodes"), back);
        assert_eq!(Dtype::from_tag(5).expect("known"), Dtype::Factors);
    }

    #[test]
    fn bad_factored_payloads_are_refused() {
        let (full, la, ra, lb, rb) = factored_case();
        let a = FactorBlock { start: 3, rows: 4, cols: 6, left: &la, right: &ra };
        let b = FactorBlock { start: 29, rows: 6, cols: 5, left: &lb, right: &rb };
        // Out of order, overlapping, past the end, wrong factor lengths.
        let refused = |blocks: &[FactorBlock<'_>], why: &str| matches!(Payload::encode_factored(&full, blocks), Err(ProtocolError::InvalidTensor(r)) if r.contains(why));
        assert!(refused(&[b, a], "block 1 at 3..27 overlaps another"));
        assert!(refused(&[a, FactorBlock { start: 20, ..b }], "block 1 at 20..50 overlaps another"));
        assert!(refused(&[FactorBlock { start: 40, ..b }], "runs past 60 entries"));
        assert!(refused(&[FactorBlock { right: &ra[..5], ..a }], "4 left and 5 right values for 4 x 6"));
        // Factors no smaller than the block: 2 x (2 + 2) against 2 x 2.
        let two = [1.0, 2.0, 3.0, 4.0];
        assert!(refused(&[FactorBlock { start: 0, rows: 2, cols: 2, left: &two, right: &two }], "no smaller"));
        let nan = [f32::NAN, 1.0, 1.0, 1.0];
        assert!(matches!(
            Payload::encode_factored(&full, &[FactorBlock { left: &nan, ..a }]),
            Err(ProtocolError::NonFinite { value, .. }) if value.is_nan()
        ));

        // A received table that claims more values than it carries.
        let p = Payload::encode_factored(&full, &[a, b]).expect("valid");
        let mut meta = p.meta().clone();
        meta.nnz -= 1;
        meta.byte_len -= 4;
        let body = p.data().slice(..p.data().len() - 4);
        meta.checksum = checksum(&body);
        let q = Payload::from_parts(meta, body, 1000).expect("the header alone is consistent");
        assert!(matches!(q.verify().unwrap_err(), ProtocolError::InvalidTensor(_)));
        assert!(matches!(q.decode(), Err(ProtocolError::InvalidTensor(r)) if r.contains("the header says")));
        // A table whose first block overlaps the second.
        let mut body = p.data().to_vec();
        body[0..4].copy_from_slice(&27u32.to_le_bytes());
        let mut meta = p.meta().clone();
        meta.checksum = checksum(&body);
        let q = Payload::from_parts(meta, Bytes::from(body), 1000).expect("header consistent");
        assert!(matches!(q.verify(), Err(ProtocolError::InvalidTensor(r)) if r.contains("overlaps another")));
        // Too many blocks for a header.
        let mut meta = p.meta().clone();
        meta.block = MAX_FACTOR_BLOCKS + 1;
        assert!(matches!(
            meta.check(1000),
            Err(ProtocolError::InvalidTensor(r)) if r.contains("factored blocks, at most")
        ));
    }
}
