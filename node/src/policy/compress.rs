//! What a node sends on the wire: the encoding of its gradient pushes and
//! of the parameters it pulls (`compression`), and error feedback
//! for the lossy push encodings.
//!
//! Each node chooses for itself: an edge board on a slow link may push
//! int8 while a LAN box pushes f32. Owners accept any encoding from any
//! worker (the encoding travels in the payload header) and keep the f32
//! master copy; a worker asks for its pulls in the encoding it chose.
//!
//! **Error feedback.** A lossy encoding drops part of each gradient. The
//! worker keeps what was dropped, per shard (the residual), and adds it to
//! the next gradient of that shard before encoding it, so nothing is lost,
//! only delayed: after any number of steps, the sum of everything sent plus
//! the residual equals the sum of the gradients (exactly for top-k, whose
//! kept entries travel exactly; within rounding for int8 and bf16).
//!
//! **Sufficient factors** (`sfb`, Poseidon). A fully connected layer's
//! weight gradient over a batch is a sum of `batch` outer products, so the
//! rows of it in a shard can travel as `batch x (rows + cols)` values
//! instead of `rows x cols`. Per layer and shard, [`factored_push`] sends
//! the factors where that is smaller and f32 elsewhere; the owner rebuilds
//! the gradient. Nothing is dropped, so there is no residual.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use shoal_models::LayerFactors;
use shoal_protocol::payload::{DEFAULT_INT8_BLOCK, DEFAULT_SPARSE_CHUNK};
use shoal_protocol::{Encoding, FactorBlock, Payload, ProtocolError};

/// How a worker encodes its gradient pushes (`compression.push`).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum PushCompression {
    /// f32: exact.
    #[default]
    None,
    /// bfloat16: half the bytes.
    Bf16,
    /// int8 with one f32 scale per 256 values: about a quarter of the bytes.
    Int8,
    /// Only the largest-magnitude `fraction` of each shard's entries (index
    /// and f32 value each): `8 * fraction` bytes per entry.
    TopK { fraction: f32 },
    /// Sufficient factors for the fully connected layers' weights where
    /// they are smaller ([`factored_push`]), f32 for the rest: lossless up
    /// to f32 rounding.
    Sfb,
    /// SparseLoCo's push: the largest-magnitude `fraction` of each chunk
    /// of 4,096 entries, as signs and two levels per chunk
    /// (`shoal_protocol::sparse`): about 2.25 bytes per kept entry.
    SparseLoCo { fraction: f32 },
}

impl PushCompression {
    /// The wire encoding of a shard of `len` values.
    pub fn encoding(&self, len: usize) -> Encoding {
        match *self {
            PushCompression::None | PushCompression::Sfb => Encoding::F32,
            PushCompression::Bf16 => Encoding::Bf16,
            PushCompression::Int8 => Encoding::Int8 { block: DEFAULT_INT8_BLOCK },
            PushCompression::TopK { fraction } => {
                // At least one entry, so a small shard still moves.
                let k = ((len as f64) * f64::from(fraction)).ceil().max(1.0) as u64;
                Encoding::TopK { k }
            }
            PushCompression::SparseLoCo { fraction } => {
                // A shard smaller than a chunk is one chunk of its own size.
                let chunk = DEFAULT_SPARSE_CHUNK.min(u32::try_from(len.max(1)).unwrap_or(u32::MAX));
                let k = (f64::from(chunk) * f64::from(fraction)).ceil().max(1.0) as u32;
                Encoding::Sparse2 { chunk, k }
            }
        }
    }

    /// Whether the encoding loses information (and so keeps residuals).
    pub fn is_lossy(&self) -> bool {
        !matches!(self, PushCompression::None | PushCompression::Sfb)
    }
}

impl FromStr for PushCompression {
    type Err = String;
    /// `none`, `bf16`, `int8`, `topk:FRACTION` (FRACTION in (0, 1]), `sfb`,
    /// `sparseloco:FRACTION`.
    fn from_str(s: &str) -> Result<Self, String> {
        let lower = s.trim().to_ascii_lowercase();
        match lower.split_once(':') {
            None if lower == "none" || lower == "f32" => Ok(PushCompression::None),
            None if lower == "bf16" => Ok(PushCompression::Bf16),
            None if lower == "int8" => Ok(PushCompression::Int8),
            None if lower == "sfb" => Ok(PushCompression::Sfb),
            Some((name @ ("topk" | "sparseloco"), f)) => {
                let fraction: f32 =
                    f.trim().parse().map_err(|_| format!("{name}:{f}: the fraction kept is not a number"))?;
                if !(fraction > 0.0 && fraction <= 1.0) {
                    return Err(format!("{name}:{f}: the fraction kept must be in (0, 1], for example {name}:0.01"));
                }
                Ok(if name == "topk" {
                    PushCompression::TopK { fraction }
                } else {
                    PushCompression::SparseLoCo { fraction }
                })
            }
            _ => Err(format!(
                "unknown push compression `{s}`: use none, bf16, int8, topk:FRACTION, sfb or sparseloco:FRACTION"
            )),
        }
    }
}

impl fmt::Display for PushCompression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PushCompression::None => write!(f, "none"),
            PushCompression::Bf16 => write!(f, "bf16"),
            PushCompression::Int8 => write!(f, "int8"),
            PushCompression::TopK { fraction } => write!(f, "topk:{fraction}"),
            PushCompression::Sfb => write!(f, "sfb"),
            PushCompression::SparseLoCo { fraction } => write!(f, "sparseloco:{fraction}"),
        }
    }
}

impl From<PushCompression> for String {
    fn from(c: PushCompression) -> String {
        c.to_string()
    }
}

impl TryFrom<String> for PushCompression {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

/// How a worker asks for the parameters it pulls
/// (`compression.pull`). The owner keeps f32 and encodes each
/// answer as asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum PullCompression {
    /// f32: exact.
    #[default]
    None,
    /// bfloat16: half the bytes; the worker computes on parameters rounded
    /// to about 3 significant digits.
    Bf16,
}

impl PullCompression {
    /// The encoding asked for in a pull.
    pub fn encoding(&self) -> Encoding {
        match self {
            PullCompression::None => Encoding::F32,
            PullCompression::Bf16 => Encoding::Bf16,
        }
    }
}

impl FromStr for PullCompression {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "none" | "f32" => Ok(PullCompression::None),
            "bf16" => Ok(PullCompression::Bf16),
            _ => Err(format!("unknown pull compression `{s}`: use none or bf16")),
        }
    }
}

impl fmt::Display for PullCompression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PullCompression::None => "none",
            PullCompression::Bf16 => "bf16",
        })
    }
}

impl From<PullCompression> for String {
    fn from(c: PullCompression) -> String {
        c.to_string()
    }
}

impl TryFrom<String> for PullCompression {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

/// `compression`: this node's choice, not part of the run's config
/// hash (nodes of one run may choose differently).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CompressionConfig {
    /// Gradient pushes. Default `none`.
    pub push: PushCompression,
    /// Parameter pulls. Default `none`.
    pub pull: PullCompression,
}

/// One shard's gradient, ready to push: the values the owner will see (what
/// the payload decodes to) and, for a lossy encoding, the payload itself.
#[derive(Debug)]
pub struct Compressed {
    /// What the push carries, decoded: what a local owner is given, so that
    /// a local and a remote owner see the same contribution.
    pub values: Vec<f32>,
    /// The encoded push.
    pub payload: Payload,
}

/// The residuals of error feedback, one per shard (empty until the shard's
/// first lossy push).
#[derive(Debug, Default)]
pub struct ErrorFeedback {
    residuals: Vec<Vec<f32>>,
}

impl ErrorFeedback {
    /// Residuals for `shards` shards.
    pub fn new(shards: usize) -> Self {
        Self { residuals: vec![Vec::new(); shards] }
    }

    /// Encode `grad` (shard `shard`'s gradient) plus that shard's residual
    /// with `encoding`, and keep what the encoding lost as the new residual.
    /// Call once per shard and step: the result is what every attempt of
    /// that push sends.
    pub fn compress(&mut self, shard: usize, grad: &[f32], encoding: Encoding) -> Result<Compressed, ProtocolError> {
        let Some(residual) = self.residuals.get_mut(shard) else {
            return Err(ProtocolError::InvalidTensor(format!("no shard {shard} in the error feedback")));
        };
        if residual.len() != grad.len() {
            // First push of this shard (or a shard of a new size): nothing owed.
            *residual = vec![0.0; grad.len()];
        }
        // The corrected gradient, built in the residual's buffer.
        for (r, g) in residual.iter_mut().zip(grad) {
            *r += g;
        }
        // On an error nothing is sent, and the step fails.
        let payload = Payload::encode(residual, encoding)?;
        let mut values = vec![0.0; grad.len()];
        payload.decode_into(&mut values)?;
        for (r, v) in residual.iter_mut().zip(&values) {
            *r -= v;
        }
        Ok(Compressed { values, payload })
    }

    /// Bytes held in residuals.
    pub fn bytes(&self) -> u64 {
        self.residuals.iter().map(|r| (r.len() * std::mem::size_of::<f32>()) as u64).sum()
    }

    /// Shard `shard`'s residual (empty before its first lossy push).
    pub fn residual(&self, shard: usize) -> &[f32] {
        self.residuals.get(shard).map_or(&[], Vec::as_slice)
    }
}

/// The gradient of the shard spanning `range` of the flat gradient
/// (`grad`, that range's values) as a push in which the whole weight rows
/// of each fully connected layer inside the shard travel as their factors
/// wherever `batch x (rows + cols) < rows x cols` (Poseidon's cost rule,
/// per layer), and everything else as f32. With no factors to send, plain
/// f32.
pub fn factored_push(range: Range<usize>, grad: &[f32], factors: &[LayerFactors]) -> Result<Payload, ProtocolError> {
    if grad.len() != range.len() {
        return Err(ProtocolError::InvalidTensor(format!(
            "a shard of {} values given {} gradient values",
            range.len(),
            grad.len()
        )));
    }
    /// A block to factor, its left factors gathered for the shard's rows.
    struct Rows<'a> {
        start: usize,
        rows: usize,
        cols: usize,
        left: Vec<f32>,
        right: &'a [f32],
    }
    let mut lefts: Vec<Rows<'_>> = Vec::new();
    let mut order: Vec<&LayerFactors> = factors.iter().collect();
    order.sort_by_key(|f| f.offset);
    for f in order {
        if f.rows == 0 || f.cols == 0 || f.delta.len() % f.rows != 0 {
            return Err(ProtocolError::InvalidTensor(format!(
                "factors of a {} x {} layer are malformed",
                f.rows, f.cols
            )));
        }
        let batch = f.delta.len() / f.rows;
        if f.input.len() != batch * f.cols {
            return Err(ProtocolError::InvalidTensor(format!(
                "{} input values for a batch of {batch} and {} columns",
                f.input.len(),
                f.cols
            )));
        }
        // The weight's whole rows inside the shard.
        let weight = f.offset..f.offset + f.rows * f.cols;
        let (lo, hi) = (range.start.max(weight.start), range.end.min(weight.end));
        if lo >= hi {
            continue;
        }
        let (r0, r1) = ((lo - weight.start).div_ceil(f.cols), (hi - weight.start) / f.cols);
        if r1 <= r0 {
            continue;
        }
        let rows = r1 - r0;
        if batch * (rows + f.cols) >= rows * f.cols {
            continue;
        }
        let left: Vec<f32> =
            (0..batch).flat_map(|b| f.delta[b * f.rows + r0..b * f.rows + r1].iter().copied()).collect();
        lefts.push(Rows { start: weight.start + r0 * f.cols - range.start, rows, cols: f.cols, left, right: &f.input });
    }
    if lefts.is_empty() {
        return Payload::encode(grad, Encoding::F32);
    }
    let blocks: Vec<FactorBlock<'_>> = lefts
        .iter()
        .map(|b| FactorBlock { start: b.start, rows: b.rows, cols: b.cols, left: &b.left, right: b.right })
        .collect();
    Payload::encode_factored(grad, &blocks)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reproducible gradient of `n` values that are multiples of 1/1024 in
    /// [-8, 8): their sums are exact in f32, so top-k mass can be compared
    /// exactly.
    fn dyadic_grad(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                ((x % 16384) as f32 - 8192.0) / 1024.0
            })
            .collect()
    }

    fn run_steps(compression: PushCompression, steps: u64, n: usize) -> (Vec<f64>, Vec<f64>, Vec<f32>) {
        let mut ef = ErrorFeedback::new(1);
        let (mut sent, mut total) = (vec![0.0f64; n], vec![0.0f64; n]);
        for step in 0..steps {
            let g = dyadic_grad(n, step + 1);
            let c = ef.compress(0, &g, compression.encoding(n)).expect("finite gradient encodes");
            assert_eq!(c.payload.decode().expect("decodes"), c.values, "values are what the payload carries");
            for i in 0..n {
                sent[i] += f64::from(c.values[i]);
                total[i] += f64::from(g[i]);
            }
        }
        (sent, total, ef.residual(0).to_vec())
    }

    #[test]
    fn top_k_error_feedback_conserves_every_gradient_exactly() {
        let n = 1000;
        let (sent, total, residual) = run_steps(PushCompression::TopK { fraction: 0.01 }, 50, n);
        for i in 0..n {
            assert_eq!(sent[i] + f64::from(residual[i]), total[i], "entry {i}: sent + residual = gradients");
        }
        // Most of the mass is still owed after 50 steps at 1%, but some moved.
        assert!(sent.iter().filter(|s| **s != 0.0).count() >= 10);
    }

    #[test]
    fn int8_and_bf16_error_feedback_conserve_the_gradients_within_rounding() {
        let n = 1000;
        for c in [PushCompression::Int8, PushCompression::Bf16] {
            let (sent, total, residual) = run_steps(c, 50, n);
            for i in 0..n {
                let err = (sent[i] + f64::from(residual[i]) - total[i]).abs();
                // 50 additions of values below 16 in f32: a few ulps of 2^-20 each.
                assert!(err <= 1e-4, "{c}: entry {i} off by {err}");
            }
            // The residual stays small: one step's quantisation error, not a sum.
            let worst = residual.iter().fold(0.0f32, |m, r| m.max(r.abs()));
            let bound = if c == PushCompression::Int8 { 16.0 / 127.0 } else { 16.0 / 128.0 };
            assert!(worst <= bound, "{c}: residual {worst} above one quantisation step {bound}");
        }
    }

    /// SparseLoCo's values are levels, not the entries, so what a push
    /// drops stays in the residual: sent plus residual is the sum of the
    /// gradients within f32 rounding, and the residual stays bounded (a
    /// few steps' gradients), not a growing sum.
    #[test]
    fn sparseloco_error_feedback_conserves_the_gradients_and_keeps_the_residual_bounded() {
        let n = 10_000;
        let (sent, total, residual) = run_steps(PushCompression::SparseLoCo { fraction: 0.02 }, 60, n);
        for i in 0..n {
            let err = (sent[i] + f64::from(residual[i]) - total[i]).abs();
            assert!(err <= 1e-3, "entry {i} off by {err}");
        }
        let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|x| x * x).sum::<f64>().sqrt();
        let owed = norm(&mut residual.iter().map(|r| f64::from(*r)));
        let one_step = norm(&mut dyadic_grad(n, 1).into_iter().map(f64::from));
        let moved = norm(&mut sent.iter().copied());
        assert!(moved > one_step, "60 steps at 2% moved {moved:.1}, less than one step's norm {one_step:.1}");
        assert!(owed < 10.0 * one_step, "the residual grew to {owed:.1}, {:.1} steps' norm", owed / one_step);
    }

    #[test]
    fn encodings_shrink_the_push_as_stated() {
        let n = 25_600;
        let g = dyadic_grad(n, 3);
        let bytes = |c: PushCompression| {
            ErrorFeedback::new(1).compress(0, &g, c.encoding(n)).expect("encodes").payload.byte_len()
        };
        let f32_bytes = bytes(PushCompression::None);
        assert_eq!(f32_bytes, 4 * n as u64);
        assert_eq!(bytes(PushCompression::Bf16), 2 * n as u64);
        assert!(f32_bytes as f64 / bytes(PushCompression::Int8) as f64 >= 3.9, "int8 is about a quarter");
        assert_eq!(bytes(PushCompression::TopK { fraction: 0.01 }), 8 * 256, "1% of 25,600 entries, 8 bytes each");
        // 7 chunks: 6 of 4,096 entries that keep 62 each (1.5%, rounded
        // up) and one of 1,024 that keeps 16 (the same share); 2.25 bytes
        // per kept entry and 10 per chunk.
        let sparse = bytes(PushCompression::SparseLoCo { fraction: 0.015 });
        let kept: u64 = 6 * 62 + 16;
        assert_eq!(sparse, 7 * 10 + 2 * kept + kept.div_ceil(4), "every chunk keeps its share");
        assert!(f32_bytes as f64 / sparse as f64 > 100.0, "{f32_bytes} / {sparse}");
    }

    #[test]
    fn lossless_push_leaves_no_residual() {
        let g = dyadic_grad(100, 9);
        let mut ef = ErrorFeedback::new(2);
        let c = ef.compress(1, &g, PushCompression::None.encoding(100)).expect("encodes");
        assert_eq!(c.values, g);
        assert!(ef.residual(1).iter().all(|r| *r == 0.0));
        assert_eq!(ef.bytes(), 400, "one shard's residual is held");
        assert!(ef.compress(2, &g, Encoding::F32).is_err(), "no shard 2");
    }

    #[test]
    fn a_gradient_that_cannot_be_encoded_is_an_error() {
        let mut ef = ErrorFeedback::new(1);
        assert!(ef.compress(0, &[1.0, f32::NAN], Encoding::Int8 { block: 256 }).is_err());
    }

    #[test]
    fn compression_settings_parse_and_print_back() {
        for s in ["none", "bf16", "int8", "topk:0.01", "topk:1", "sfb", "sparseloco:0.015"] {
            let c: PushCompression = s.parse().expect("valid");
            assert_eq!(c.to_string(), s);
        }
        for bad in ["topk:0", "topk:1.5", "topk:x", "int4", "topk", "sparseloco", "sparseloco:0"] {
            assert!(bad.parse::<PushCompression>().is_err(), "{bad} is refused");
        }
        assert_eq!("bf16".parse::<PullCompression>(), Ok(PullCompression::Bf16));
        assert!("int8".parse::<PullCompression>().is_err(), "owners send parameters as f32 or bf16 only");
        let cfg: CompressionConfig = toml::from_str("push = \"topk:0.05\"\npull = \"bf16\"").expect("parses");
        assert_eq!(cfg.push, PushCompression::TopK { fraction: 0.05 });
        assert_eq!(cfg.pull, PullCompression::Bf16);
        assert_eq!(PushCompression::TopK { fraction: 0.01 }.encoding(50), Encoding::TopK { k: 1 });
        let sparse = PushCompression::SparseLoCo { fraction: 0.015 };
        assert_eq!(sparse.encoding(1 << 20), Encoding::Sparse2 { chunk: 4096, k: 62 });
        assert_eq!(sparse.encoding(100), Encoding::Sparse2 { chunk: 100, k: 2 }, "a small shard is one chunk");
    }

    /// A gradient of a 10 x 40 layer (at 3) and a 4 x 10 layer (at 413)
    /// over a batch of 2, with bias-like entries around them, and its
    /// factors.
    fn layered_grad() -> (Vec<f32>, Vec<LayerFactors>) {
        let wave = |n: usize, k: f32| (0..n).map(|i| ((i as f32) * k).sin()).collect::<Vec<f32>>();
        let layers = [(3usize, 10usize, 40usize), (413, 4, 10)];
        let mut grad = wave(460, 0.37);
        let factors: Vec<LayerFactors> = layers
            .iter()
            .enumerate()
            .map(|(i, &(offset, rows, cols))| {
                let f = LayerFactors {
                    offset,
                    rows,
                    cols,
                    delta: wave(2 * rows, 0.11 + i as f32),
                    input: wave(2 * cols, 0.7 + i as f32),
                };
                for r in 0..rows {
                    for c in 0..cols {
                        grad[offset + r * cols + c] =
                            (0..2).map(|b| f.delta[b * rows + r] * f.input[b * cols + c]).sum();
                    }
                }
                f
            })
            .collect();
        (grad, factors)
    }

    #[test]
    fn factored_pushes_rebuild_each_shard_and_send_fewer_bytes() {
        let (grad, factors) = layered_grad();
        // Shards cutting the first layer mid-row, one holding the second,
        // and the whole gradient.
        for range in [120..300, 300..460, 0..460] {
            let slice = &grad[range.clone()];
            let p = factored_push(range.clone(), slice, &factors).expect("encodes");
            let back = p.decode().expect("decodes");
            for (i, (a, b)) in back.iter().zip(slice).enumerate() {
                assert!((a - b).abs() <= 1e-5, "{range:?}: entry {i} is {a}, not {b}");
            }
            // Whole rows of the 10 x 40 layer go as 2 x (rows + 40) values.
            assert!(p.byte_len() < 4 * slice.len() as u64, "{range:?}: {} bytes", p.byte_len());
        }
        // The second layer alone: 4 x 10 entries as 2 x (4 + 10) factors.
        let p = factored_push(400..460, &grad[400..460], &factors).expect("encodes");
        assert_eq!(p.meta().block, 1, "one layer's rows factored");
        assert_eq!(p.byte_len(), 16 + 4 * (60 - 40 + 28));
        let p = factored_push(0..120, &grad[0..120], &factors).expect("encodes");
        assert_eq!(p.meta().block, 0, "2 whole rows cost 2 x 42 values for 80: sent as f32");
        // With no factors, or a shard outside every layer: plain f32.
        let p = factored_push(0..3, &grad[0..3], &factors).expect("encodes");
        assert_eq!(p.meta().dtype, shoal_protocol::Dtype::F32 as u8);
        assert_eq!(factored_push(0..460, &grad, &[]).expect("encodes").decode().expect("decodes"), grad);
        assert!(factored_push(0..10, &grad[0..9], &factors).is_err(), "slice and range disagree");
        assert_eq!("sfb".parse::<PushCompression>(), Ok(PushCompression::Sfb));
        assert!(!PushCompression::Sfb.is_lossy(), "no residual is kept");
    }
}
