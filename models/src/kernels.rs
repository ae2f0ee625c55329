//! Fused CPU kernels, each with its backward pass, for the transformer.
//!
//! candle's CPU backend builds the gradients of softmax, RMS norm, SwiGLU
//! and rotary embeddings out of many element-wise tensor ops, each
//! allocating a tensor as large as the input (and its fused softmax has no
//! backward pass at all). Here each of them
//! is one pass over memory forwards and one backwards. Other devices, and
//! dtypes other than f32, use candle's composed ops.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor, D};
use rayon::prelude::*;

use crate::error::Result;

/// Rows per rayon task: enough work to outweigh the scheduling.
const MIN_CHUNK: usize = 4096;

fn fast_path(x: &Tensor) -> bool {
    x.device().is_cpu() && x.dtype() == candle_core::DType::F32
}

/// A contiguous f32 CPU storage's values, in place (the fused kernels', the
/// im2col op's and the hand-written steps' reads).
pub(crate) fn contiguous<'a>(storage: &'a CpuStorage, layout: &Layout) -> candle_core::Result<&'a [f32]> {
    contiguous_of(storage, layout)
}

/// A contiguous CPU storage's values of type `T`, in place.
fn contiguous_of<'a, T: candle_core::WithDType>(
    storage: &'a CpuStorage,
    layout: &Layout,
) -> candle_core::Result<&'a [T]> {
    let data = storage.as_slice::<T>()?;
    match layout.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("a CPU kernel needs a contiguous {:?} input", T::DTYPE),
    }
}

/// Elements per rayon task over rows of `cols`: whole blocks of
/// `block_rows` rows, and at least [`MIN_CHUNK`] elements where rows are short.
fn task_len(cols: usize, block_rows: usize) -> usize {
    let block = cols.max(1) * block_rows.max(1);
    (MIN_CHUNK / block).max(1) * block
}

/// `f(row index within its task, out row, a row, b row)` over the rows of
/// `cols` of two equally long inputs, in parallel tasks of `task` elements.
/// One-input kernels pass their input twice.
fn map_rows(
    a: &[f32],
    b: &[f32],
    cols: usize,
    task: usize,
    f: impl Fn(usize, &mut [f32], &[f32], &[f32]) + Sync,
) -> candle_core::Result<Vec<f32>> {
    if a.len() != b.len() {
        candle_core::bail!("fused kernel: inputs of {} and {} values", a.len(), b.len());
    }
    let c = cols.max(1);
    let mut out = vec![0f32; a.len()];
    out.par_chunks_mut(task).zip(a.par_chunks(task).zip(b.par_chunks(task))).for_each(|(o, (a, b))| {
        for (r, ((o, a), b)) in o.chunks_mut(c).zip(a.chunks(c)).zip(b.chunks(c)).enumerate() {
            f(r, o, a, b);
        }
    });
    Ok(out)
}

/// `width` sums over the rows of `cols` of two equally long inputs:
/// `f(sums, a row, b row)` adds each row in, in parallel tasks.
fn sum_rows(
    a: &[f32],
    b: &[f32],
    cols: usize,
    width: usize,
    f: impl Fn(&mut [f32], &[f32], &[f32]) + Sync,
) -> candle_core::Result<Vec<f32>> {
    if a.len() != b.len() {
        candle_core::bail!("fused kernel: inputs of {} and {} values", a.len(), b.len());
    }
    let c = cols.max(1);
    let task = task_len(c, 1);
    // Partial sums per task, added up in task order: the result does not
    // depend on how rayon scheduled the tasks (bit-identical runs).
    let partials: Vec<Vec<f32>> = a
        .par_chunks(task)
        .zip(b.par_chunks(task))
        .map(|(a, b)| {
            let mut acc = vec![0f32; width];
            for (a, b) in a.chunks(c).zip(b.chunks(c)) {
                f(&mut acc, a, b);
            }
            acc
        })
        .collect();
    let mut sums = vec![0f32; width];
    for p in &partials {
        sums.iter_mut().zip(p).for_each(|(s, p)| *s += p);
    }
    Ok(sums)
}

/// Softmax over the last dimension, as `candle_nn::ops::softmax(x, D::Minus1)`.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if fast_path(x) {
        let cols = x.dim(D::Minus1)?;
        Ok(x.contiguous()?.apply_op1(Softmax { cols, scale: 1.0, causal: false })?)
    } else {
        Ok(candle_nn::ops::softmax(x, D::Minus1)?)
    }
}

/// Attention weights from scores `[.., t, t]`: the softmax of
/// `scale * scores` over the positions at or before each row's own (the
/// rest get 0). `mask` (`[t, t]`, 0 or a large negative number) serves the
/// devices without the fused kernel.
pub fn causal_softmax(scores: &Tensor, scale: f64, mask: &Tensor) -> Result<Tensor> {
    let (rows, cols) = (scores.dim(D::Minus2)?, scores.dim(D::Minus1)?);
    if rows != cols {
        return Err(crate::error::ModelError::Invalid(format!(
            "causal softmax needs square scores, got {rows} x {cols}"
        )));
    }
    if fast_path(scores) {
        Ok(scores.contiguous()?.apply_op1(Softmax { cols, scale: scale as f32, causal: true })?)
    } else {
        Ok(candle_nn::ops::softmax(&(scores * scale)?.broadcast_add(mask)?, D::Minus1)?)
    }
}

/// Softmax of `scale * x` over rows of `cols`; with `causal`, row `r` of
/// each `cols x cols` block covers only its first `r % cols + 1` columns.
struct Softmax {
    cols: usize,
    scale: f32,
    causal: bool,
}
struct SoftmaxGrad {
    cols: usize,
    scale: f32,
}

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        "fused-softmax"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = softmax_rows(contiguous(storage, layout)?, self.cols, self.scale, self.causal)?;
        Ok((CpuStorage::F32(out), layout.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let grad = SoftmaxGrad { cols: self.cols, scale: self.scale };
        Ok(Some(res.contiguous()?.apply_op2_no_bwd(&grad_res.contiguous()?, &grad)?))
    }
}

impl CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "fused-softmax-grad"
    }

    /// `dx = scale * y * (g - sum(g * y))` per row (0 where y is: the
    /// columns a causal row does not see).
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = softmax_grad_rows(contiguous(s1, l1)?, contiguous(s2, l2)?, self.cols, self.scale)?;
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// Softmax of `scale * x` over rows of `cols`; with `causal`, row `r` of
/// each `cols x cols` block covers only its first `r % cols + 1` columns
/// (the rest are 0): the rows of a causal block may repeat, as a group of
/// query heads' rows over one key head's columns do.
pub(crate) fn softmax_rows(x: &[f32], cols: usize, scale: f32, causal: bool) -> candle_core::Result<Vec<f32>> {
    let c = cols.max(1);
    // A causal task takes whole c x c blocks, so that its row r is row
    // r % c of its block.
    let task = task_len(c, if causal { c } else { 1 });
    map_rows(x, x, c, task, |r, o, x, _| {
        let seen = if causal { r % c + 1 } else { c };
        let (o, x) = (&mut o[..seen], &x[..seen]);
        let max = x.iter().map(|&v| v * scale).fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for (o, &x) in o.iter_mut().zip(x) {
            *o = (x * scale - max).exp();
            sum += *o;
        }
        let inv = 1.0 / sum;
        o.iter_mut().for_each(|o| *o *= inv);
    })
}

/// The backward of [`softmax_rows`] from its output `y` and the gradient
/// `g`: `scale * y * (g - sum(g * y))` per row (0 where `y` is: the
/// columns a causal row does not see).
pub(crate) fn softmax_grad_rows(y: &[f32], g: &[f32], cols: usize, scale: f32) -> candle_core::Result<Vec<f32>> {
    let c = cols.max(1);
    map_rows(y, g, c, task_len(c, 1), |_, o, y, g| {
        let dot: f32 = y.iter().zip(g).map(|(y, g)| y * g).sum();
        for ((o, &y), &g) in o.iter_mut().zip(y).zip(g) {
            *o = scale * y * (g - dot);
        }
    })
}

/// The summed cross-entropy of `x [rows, cols]` against `targets` and its
/// gradient times `scale` (`(softmax - onehot) * scale`, in place of the
/// logits, which are not needed after): one pass per row for each. The
/// sum adds per-task partials in task order, so it does not depend on
/// rayon's scheduling.
pub(crate) fn cross_entropy_grad_rows(
    x: &mut [f32],
    targets: &[u32],
    cols: usize,
    scale: f32,
) -> candle_core::Result<f64> {
    let c = cols.max(1);
    if !x.len().is_multiple_of(c) {
        candle_core::bail!("cross-entropy: {} logits in rows of {c}", x.len());
    }
    check_targets(targets, x.len() / c, c)?;
    let rows_per_task = task_len(c, 1) / c;
    let partials: Vec<f64> = x
        .par_chunks_mut(rows_per_task * c)
        .zip(targets.par_chunks(rows_per_task))
        .map(|(x, t)| {
            let mut loss = 0f64;
            for (row, &target) in x.chunks_mut(c).zip(t) {
                // One exp per entry: the shifted exponentials are kept in
                // the row for the gradient.
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let picked = row[target as usize];
                let mut sum = 0f32;
                for v in row.iter_mut() {
                    *v = (*v - max).exp();
                    sum += *v;
                }
                loss += (max + sum.ln() - picked) as f64;
                let inv = scale / sum;
                row.iter_mut().for_each(|v| *v *= inv);
                row[target as usize] -= scale;
            }
            loss
        })
        .collect();
    Ok(partials.iter().sum())
}

/// The mean cross-entropy of `logits [rows, cols]` against `targets
/// [rows]` (u32 class indices), as `candle_nn::loss::cross_entropy`. On the
/// CPU in f32 each row's log-sum-exp and its gradient (`softmax - onehot`)
/// are one pass each, instead of a log-softmax, a gather and their
/// backward passes, each allocating `[rows, cols]`.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    if fast_path(logits) && targets.dtype() == candle_core::DType::U32 && logits.rank() == 2 {
        let cols = logits.dim(1)?;
        let per_row = logits.contiguous()?.apply_op2(&targets.contiguous()?, CrossEntropy { cols })?;
        Ok(per_row.mean_all()?)
    } else {
        Ok(candle_nn::loss::cross_entropy(logits, targets)?)
    }
}

/// Each row's `log(sum(exp(x))) - x[target]`.
struct CrossEntropy {
    cols: usize,
}

/// `(softmax(x) - onehot(target)) * g[row]`, from `(x, targets, g)`.
struct CrossEntropyGrad {
    cols: usize,
}

/// The targets of `rows` rows of `cols` classes, each checked.
fn checked_targets<'a>(
    storage: &'a CpuStorage,
    layout: &Layout,
    rows: usize,
    cols: usize,
) -> candle_core::Result<&'a [u32]> {
    let t: &[u32] = contiguous_of(storage, layout)?;
    check_targets(t, rows, cols)?;
    Ok(t)
}

/// One target per row, each a class below `cols`.
fn check_targets(t: &[u32], rows: usize, cols: usize) -> candle_core::Result<()> {
    if t.len() != rows {
        candle_core::bail!("cross-entropy: {} targets for {rows} rows", t.len());
    }
    if let Some(bad) = t.iter().find(|&&t| t as usize >= cols) {
        candle_core::bail!("cross-entropy: target {bad} outside {cols} classes");
    }
    Ok(())
}

/// `max` and `log(sum(exp(x - max)))` of a row.
fn log_sum_exp(x: &[f32]) -> (f32, f32) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = x.iter().map(|&v| (v - max).exp()).sum();
    (max, sum.ln())
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "fused-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous(s1, l1)?;
        let c = self.cols.max(1);
        let rows = x.len() / c;
        let t = checked_targets(s2, l2, rows, c)?;
        let out: Vec<f32> = x
            .par_chunks(c)
            .zip(t.par_iter())
            .map(|(row, &target)| {
                let (max, lse) = log_sum_exp(row);
                max + lse - row[target as usize]
            })
            .collect();
        Ok((CpuStorage::F32(out), Shape::from(rows)))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = CrossEntropyGrad { cols: self.cols };
        let dx = logits.apply_op3_no_bwd(targets, &grad_res.contiguous()?, &grad)?;
        Ok((Some(dx), None))
    }
}

impl candle_core::CustomOp3 for CrossEntropyGrad {
    fn name(&self) -> &'static str {
        "fused-cross-entropy-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous(s1, l1)?;
        let c = self.cols.max(1);
        let rows = x.len() / c;
        let t = checked_targets(s2, l2, rows, c)?;
        let g = contiguous(s3, l3)?;
        if g.len() != rows {
            candle_core::bail!("cross-entropy gradient: {} values for {rows} rows", g.len());
        }
        let mut out = vec![0f32; x.len()];
        out.par_chunks_mut(c).zip(x.par_chunks(c)).zip(t.par_iter().zip(g.par_iter())).for_each(
            |((o, row), (&target, &g))| {
                let (max, lse) = log_sum_exp(row);
                for (o, &v) in o.iter_mut().zip(row) {
                    *o = (v - max - lse).exp() * g;
                }
                o[target as usize] -= g;
            },
        );
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// RMS norm over the last dimension with a gain, as Llama's:
/// `x / sqrt(mean(x^2) + eps) * gain`.
pub fn rms_norm(x: &Tensor, gain: &Tensor, eps: f32) -> Result<Tensor> {
    if fast_path(x) && fast_path(gain) {
        let cols = x.dim(D::Minus1)?;
        Ok(x.contiguous()?.apply_op2(&gain.contiguous()?, RmsNorm { cols, eps })?)
    } else {
        let inv = (x.sqr()?.mean_keepdim(D::Minus1)? + eps as f64)?.sqrt()?.recip()?;
        Ok(x.broadcast_mul(&inv)?.broadcast_mul(gain)?)
    }
}

struct RmsNorm {
    cols: usize,
    eps: f32,
}

/// The gradients of [`RmsNorm`]: rows of the input's, then one row of the
/// gain's.
struct RmsNormGrad {
    cols: usize,
    eps: f32,
}

/// RMS norm of the rows of `x`, each as long as `gain`.
pub(crate) fn rms_norm_rows(x: &[f32], gain: &[f32], eps: f32) -> candle_core::Result<Vec<f32>> {
    let c = gain.len().max(1);
    if !x.len().is_multiple_of(c) {
        candle_core::bail!("RMS norm over {c} columns of {} values", x.len());
    }
    map_rows(x, x, c, task_len(c, 1), |_, o, x, _| {
        let inv = inv_rms(x, eps);
        for ((o, &x), &g) in o.iter_mut().zip(x).zip(gain) {
            *o = x * inv * g;
        }
    })
}

/// The gradients of [`rms_norm_rows`] with respect to `x` and `gain`, from
/// the output's `g`. With `x^ = x * inv` and `h = g * gain`:
/// `dx = inv * (h - x^ * mean(h * x^))`, `dgain = sum over rows of g * x^`.
pub(crate) fn rms_norm_grad_rows(
    x: &[f32],
    gain: &[f32],
    g: &[f32],
    eps: f32,
) -> candle_core::Result<(Vec<f32>, Vec<f32>)> {
    let c = gain.len().max(1);
    if g.len() != x.len() || !x.len().is_multiple_of(c) {
        candle_core::bail!("RMS norm gradient: shapes do not match");
    }
    let dx = map_rows(x, g, c, task_len(c, 1), |_, o, x, g| {
        let inv = inv_rms(x, eps);
        let m = x.iter().zip(g).zip(gain).map(|((&x, &g), &w)| g * w * x * inv).sum::<f32>() / c as f32;
        for (((o, &x), &g), &w) in o.iter_mut().zip(x).zip(g).zip(gain) {
            *o = inv * (g * w - x * inv * m);
        }
    })?;
    let dgain = sum_rows(x, g, c, c, |acc, x, g| {
        let inv = inv_rms(x, eps);
        for ((a, &x), &g) in acc.iter_mut().zip(x).zip(g) {
            *a += g * x * inv;
        }
    })?;
    Ok((dx, dgain))
}

/// `1 / sqrt(mean(x^2) + eps)` of a row.
#[inline]
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len().max(1) as f32;
    1.0 / (ms + eps).sqrt()
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "fused-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = rms_norm_rows(contiguous(s1, l1)?, contiguous(s2, l2)?, self.eps)?;
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gain: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let both = x.apply_op3_no_bwd(gain, &grad, &RmsNormGrad { cols: self.cols, eps: self.eps })?;
        let n = x.elem_count();
        let dx = both.narrow(0, 0, n)?.reshape(x.shape())?;
        let dgain = both.narrow(0, n, self.cols)?.reshape(gain.shape())?;
        Ok((Some(dx), Some(dgain)))
    }
}

impl candle_core::CustomOp3 for RmsNormGrad {
    fn name(&self) -> &'static str {
        "fused-rms-norm-grad"
    }

    /// With `x^ = x * inv` and `h = g * gain`:
    /// `dx = inv * (h - x^ * mean(h * x^))`, `dgain = sum over rows of g * x^`.
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, gain, g) = (contiguous(s1, l1)?, contiguous(s2, l2)?, contiguous(s3, l3)?);
        if gain.len() != self.cols.max(1) {
            candle_core::bail!("RMS norm gradient: shapes do not match");
        }
        let (mut out, dgain) = rms_norm_grad_rows(x, gain, g, self.eps)?;
        out.extend_from_slice(&dgain);
        let len = out.len();
        Ok((CpuStorage::F32(out), Shape::from(len)))
    }
}

/// SwiGLU's gate: `silu(a) * b`, element-wise.
pub fn swiglu(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if fast_path(a) && fast_path(b) && a.shape() == b.shape() {
        Ok(a.contiguous()?.apply_op2(&b.contiguous()?, SwiGlu)?)
    } else {
        Ok((candle_nn::ops::silu(a)? * b)?)
    }
}

struct SwiGlu;

/// The gradients of [`SwiGlu`]: `a`'s, then `b`'s.
struct SwiGluGrad;

/// `silu(a) * b`, element-wise.
pub(crate) fn swiglu_rows(a: &[f32], b: &[f32]) -> candle_core::Result<Vec<f32>> {
    map_rows(a, b, MIN_CHUNK, MIN_CHUNK, |_, o, a, b| {
        for ((o, &a), &b) in o.iter_mut().zip(a).zip(b) {
            *o = a * sigmoid(a) * b;
        }
    })
}

/// The gradients of [`swiglu_rows`] from the output's `g`, into `da` and
/// `db`: `da = g * b * s * (1 + a * (1 - s))` with `s = sigmoid(a)`, and
/// `db = g * a * s`.
pub(crate) fn swiglu_grad_into(
    a: &[f32],
    b: &[f32],
    g: &[f32],
    da: &mut [f32],
    db: &mut [f32],
) -> candle_core::Result<()> {
    let n = a.len();
    if b.len() != n || g.len() != n || da.len() != n || db.len() != n {
        candle_core::bail!("SwiGLU gradient: shapes do not match");
    }
    da.par_chunks_mut(MIN_CHUNK)
        .zip(db.par_chunks_mut(MIN_CHUNK))
        .zip(a.par_chunks(MIN_CHUNK).zip(b.par_chunks(MIN_CHUNK)).zip(g.par_chunks(MIN_CHUNK)))
        .for_each(|((da, db), ((a, b), g))| {
            for ((((da, db), &a), &b), &g) in da.iter_mut().zip(db.iter_mut()).zip(a).zip(b).zip(g) {
                let s = sigmoid(a);
                *da = g * b * s * (1.0 + a * (1.0 - s));
                *db = g * a * s;
            }
        });
    Ok(())
}

#[inline]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "fused-swiglu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = swiglu_rows(contiguous(s1, l1)?, contiguous(s2, l2)?)?;
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let both = a.apply_op3_no_bwd(b, &grad.contiguous()?, &SwiGluGrad)?;
        let n = a.elem_count();
        let da = both.narrow(0, 0, n)?.reshape(a.shape())?;
        let db = both.narrow(0, n, n)?.reshape(b.shape())?;
        Ok((Some(da), Some(db)))
    }
}

impl candle_core::CustomOp3 for SwiGluGrad {
    fn name(&self) -> &'static str {
        "fused-swiglu-grad"
    }

    /// `da = g * b * s * (1 + a * (1 - s))` with `s = sigmoid(a)`, and
    /// `db = g * a * s`.
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (a, b, g) = (contiguous(s1, l1)?, contiguous(s2, l2)?, contiguous(s3, l3)?);
        let n = a.len();
        let mut out = vec![0f32; 2 * n];
        let (da, db) = out.split_at_mut(n);
        swiglu_grad_into(a, b, g, da, db)?;
        Ok((CpuStorage::F32(out), Shape::from(2 * n)))
    }
}

/// Rotary position embeddings on `x [.., t, d]` (Llama's "rotate half"
/// layout, as in Hugging Face's `LlamaForCausalLM`): for `i < d / 2`, the
/// pair `(x_i, x_{i + d/2})` at position `p` is rotated by the angle
/// `p * theta^(-2i/d)`. `cos` and `sin` are `[context, d / 2]` tables
/// (context at least `t`).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (t, d) = (x.dim(D::Minus2)?, x.dim(D::Minus1)?);
    let half = d / 2;
    if d % 2 != 0 || cos.dim(1)? != half || cos.dim(0)? < t {
        return Err(crate::error::ModelError::Invalid(format!(
            "rotary embedding of {d} columns over {t} positions with tables of {:?}",
            cos.dims()
        )));
    }
    let (cos, sin) = (cos.narrow(0, 0, t)?, sin.narrow(0, 0, t)?);
    if fast_path(x) && fast_path(&cos) {
        let table = |m: &Tensor| -> Result<std::sync::Arc<Vec<f32>>> {
            Ok(std::sync::Arc::new(m.flatten_all()?.to_vec1::<f32>()?))
        };
        return Ok(x.contiguous()?.apply_op1(Rope { t, d, cos: table(&cos)?, sin: table(&sin)?, sign: 1.0 })?);
    }
    let (cos, sin) = (Tensor::cat(&[&cos, &cos], 1)?, Tensor::cat(&[&sin, &sin], 1)?);
    let (x1, x2) = (x.narrow(D::Minus1, 0, half)?, x.narrow(D::Minus1, half, half)?);
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    Ok((x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?)?)
}

/// One row's rotary embedding: the pairs `(x_i, x_{i + d/2})` of `x`
/// rotated by the angles whose cosines and sines are `cos` and `sin`
/// (`sign` -1: by the opposite angles, the rotation's adjoint), into `o`.
#[inline]
pub(crate) fn rotate(o: &mut [f32], x: &[f32], cos: &[f32], sin: &[f32], sign: f32) {
    let half = x.len() / 2;
    let (x1, x2) = x.split_at(half);
    let (o1, o2) = o.split_at_mut(half);
    for i in 0..half {
        let (c, s) = (cos[i], sign * sin[i]);
        o1[i] = x1[i] * c - x2[i] * s;
        o2[i] = x2[i] * c + x1[i] * s;
    }
}

/// [`rope`]'s rotation (`sign` 1), or its inverse (`sign` -1: its backward).
struct Rope {
    t: usize,
    d: usize,
    cos: std::sync::Arc<Vec<f32>>,
    sin: std::sync::Arc<Vec<f32>>,
    sign: f32,
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "fused-rope"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous(storage, layout)?;
        let (t, d, half) = (self.t.max(1), self.d, self.d / 2);
        // Tasks of whole t x d blocks: row r of a task is position r % t.
        let out = map_rows(x, x, d, task_len(d, t), |r, o, x, _| {
            let p = r % t;
            rotate(o, x, &self.cos[p * half..(p + 1) * half], &self.sin[p * half..(p + 1) * half], self.sign);
        })?;
        Ok((CpuStorage::F32(out), layout.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> candle_core::Result<Option<Tensor>> {
        // A rotation's adjoint is the rotation by the opposite angle.
        let inverse = Rope { t: self.t, d: self.d, cos: self.cos.clone(), sin: self.sin.clone(), sign: -self.sign };
        Ok(Some(grad_res.contiguous()?.apply_op1_no_bwd(&inverse)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    /// `a` (a fused kernel's output) equals `b` (the reference's) within
    /// `fwd`, and the gradients of `sum(a * w)` and `sum(b * w)` with
    /// respect to each of `vars` agree within `grad`.
    fn same_values_and_gradients(
        what: &str,
        (a, b): (Tensor, Tensor),
        w: &Tensor,
        vars: &[(&str, &Tensor)],
        (fwd, grad): (f32, f32),
    ) -> Result<()> {
        let diff = (&a - &b)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < fwd, "{what} forward differs by {diff}");
        let (ga, gb) = ((a * w)?.sum_all()?.backward()?, (b * w)?.sum_all()?.backward()?);
        for (name, t) in vars {
            let (Some(da), Some(db)) = (ga.get(t), gb.get(t)) else { panic!("{what}: no {name} gradient") };
            let diff = (da - db)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < grad, "{what} {name} gradient differs by {diff}");
        }
        Ok(())
    }

    /// Forward values and input gradients equal candle's composed ops.
    #[test]
    fn fused_kernels_match_candle() -> Result<()> {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&(Tensor::randn(0f32, 2.0, (6, 4, 33), &dev)?))?;
        let w = Tensor::randn(0f32, 1.0, (6, 4, 33), &dev)?;
        type Op = fn(&Tensor) -> Result<Tensor>;
        let cases: [(&str, Op, Op); 1] =
            [("softmax", |x| softmax_last_dim(x), |x| Ok(candle_nn::ops::softmax(x, D::Minus1)?))];
        // Causal softmax against the masked, scaled composed form.
        let t = 33;
        let mask: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { -1e9 } else { 0.0 }).collect();
        let mask = Tensor::from_vec(mask, (t, t), &dev)?;
        let s = Var::from_tensor(&(Tensor::randn(0f32, 2.0, (2, 3, t, t), &dev)?))?;
        let ws = Tensor::randn(0f32, 1.0, (2, 3, t, t), &dev)?;
        let a = causal_softmax(s.as_tensor(), 0.3, &mask)?;
        let b = candle_nn::ops::softmax(&(s.as_tensor() * 0.3)?.broadcast_add(&mask)?, D::Minus1)?;
        let diff = (&a - &b)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "causal softmax forward differs by {diff}");
        let (ga, gb) = ((a * &ws)?.sum_all()?.backward()?, (b * &ws)?.sum_all()?.backward()?);
        let (Some(da), Some(db)) = (ga.get(s.as_tensor()), gb.get(s.as_tensor())) else {
            panic!("causal: no gradient")
        };
        let diff = (da - db)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-4, "causal softmax gradient differs by {diff}");
        let gain = Var::from_tensor(&(Tensor::randn(1f32, 0.3, 33, &dev)?))?;
        // RMS norm: the gradients of the input and the gain (the f64 path
        // is the composed one the other devices take).
        let wide = |t: &Tensor| t.to_dtype(DType::F64);
        same_values_and_gradients(
            "RMS norm",
            (
                rms_norm(x.as_tensor(), gain.as_tensor(), 1e-5)?,
                rms_norm(&wide(x.as_tensor())?, &wide(gain.as_tensor())?, 1e-5)?.to_dtype(DType::F32)?,
            ),
            &w,
            &[("input", x.as_tensor()), ("gain", gain.as_tensor())],
            (1e-4, 1e-3),
        )?;
        // Cross-entropy against class targets: the loss and the logits'
        // gradient.
        let logits = Var::from_tensor(&(Tensor::randn(0f32, 3.0, (24, 33), &dev)?))?;
        let targets = Tensor::from_vec((0..24u32).map(|i| (i * 7 + 3) % 33).collect::<Vec<_>>(), 24, &dev)?;
        let (a, b) = (
            cross_entropy(logits.as_tensor(), &targets)?,
            candle_nn::loss::cross_entropy(logits.as_tensor(), &targets)?,
        );
        let diff = (&a - &b)?.abs()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "cross-entropy differs by {diff}");
        let (ga, gb) = (a.backward()?, b.backward()?);
        let (Some(da), Some(db)) = (ga.get(logits.as_tensor()), gb.get(logits.as_tensor())) else {
            panic!("cross-entropy: no gradient")
        };
        let diff = (da - db)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6, "cross-entropy gradient differs by {diff}");
        let bad = Tensor::from_vec(vec![33u32; 24], 24, &dev)?;
        let e = cross_entropy(logits.as_tensor(), &bad).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("target 33 outside 33 classes"), "{e}");
        // SwiGLU: the gradients of both inputs.
        let up = Var::from_tensor(&(Tensor::randn(0f32, 1.5, (6, 4, 33), &dev)?))?;
        same_values_and_gradients(
            "SwiGLU",
            (swiglu(x.as_tensor(), up.as_tensor())?, (candle_nn::ops::silu(x.as_tensor())? * up.as_tensor())?),
            &w,
            &[("gate", x.as_tensor()), ("up", up.as_tensor())],
            (1e-5, 1e-4),
        )?;
        // Rotary embeddings: the fused rotation against the composed one
        // (f64), forward and backward.
        let (t, d) = (7, 8);
        let angles: Vec<f32> = (0..t * d / 2)
            .map(|k| (k / (d / 2)) as f32 * 10000f32.powf(-2.0 * (k % (d / 2)) as f32 / d as f32))
            .collect();
        let angles = Tensor::from_vec(angles, (t, d / 2), &dev)?;
        let (cos, sin) = (angles.cos()?, angles.sin()?);
        let q = Var::from_tensor(&(Tensor::randn(0f32, 1.0, (2, 3, t, d), &dev)?))?;
        same_values_and_gradients(
            "rope",
            (
                rope(q.as_tensor(), &cos, &sin)?,
                rope(&wide(q.as_tensor())?, &wide(&cos)?, &wide(&sin)?)?.to_dtype(DType::F32)?,
            ),
            &Tensor::randn(0f32, 1.0, (2, 3, t, d), &dev)?,
            &[("input", q.as_tensor())],
            (1e-5, 1e-5),
        )?;
        for (name, fused, reference) in cases {
            let (a, b) = (fused(x.as_tensor())?, reference(x.as_tensor())?);
            let diff = (&a - &b)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-5, "{name} forward differs by {diff}");
            let ga = (a * &w)?.sum_all()?.backward()?;
            let gb = (b * &w)?.sum_all()?.backward()?;
            let (Some(ga), Some(gb)) = (ga.get(x.as_tensor()), gb.get(x.as_tensor())) else {
                panic!("{name}: no gradient")
            };
            let diff = (ga - gb)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-4, "{name} gradient differs by {diff}");
        }
        Ok(())
    }
}
