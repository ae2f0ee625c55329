//! The MLP's and the CNN's training steps on the CPU, written out by hand.
//!
//! candle's autograd took most of these small models' steps on the CPU in
//! work that is not arithmetic (issue 14): a freshly zeroed gradient tensor for every
//! node of the graph and an addition into it, max-pool's backward built
//! from upsampling, comparison and average pooling, transposes between
//! candle's `[b, c, h, w]` and the products' `[c, b, h, w]`, and the bias,
//! ReLU and pooling as separate passes, each op's output allocated and,
//! for element-wise ops, handed to a thread pool. Here the step is the matrix
//! products (still candle's, hence the same `gemm` kernels) and one pass
//! each for the unfolding, the bias with ReLU and pooling, its backward,
//! and the fold. Activations stay channel-major (`[c, b, h, w]`), the
//! layout the products produce, so nothing is transposed but the small
//! input of the first linear layer.
//!
//! The arithmetic is the candle graph's: `model`'s tests check loss,
//! gradients and factors against it, and the gradients against central
//! differences. Two cases differ by definition, both of measure zero for
//! real-valued data: a pre-activation of exactly 0 (candle's ReLU passes
//! the gradient there, this one does not, as PyTorch), and exact ties
//! inside a pooling window (the graph's maximum gives the whole gradient
//! to each of them, this one to the first, as PyTorch).

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use crate::error::{ModelError, Result};
use crate::grads::{GradOutput, LayerFactors};
use crate::layout::ParamLayout;

/// The geometry of a same-padded, stride-1 `k x k` convolution's
/// unfolding: `[c * k * k, b * h * w]`, row `(ci, ky, kx)`, column
/// `(bi, y, x)` holding input pixel `(bi, ci, y + ky - k/2, x + kx - k/2)`,
/// or 0 outside the image. The input is `[b, c, h, w]`, or `[c, b, h, w]`
/// when `channel_major`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Unfold {
    pub k: usize,
    /// `(b, c, h, w)`.
    pub dims: (usize, usize, usize, usize),
    pub channel_major: bool,
}

impl Unfold {
    pub fn rows(&self) -> usize {
        self.dims.1 * self.k * self.k
    }

    pub fn cols(&self) -> usize {
        let (b, _, h, w) = self.dims;
        b * h * w
    }

    /// Offset of image `bi`'s channel `ci` in the input.
    fn plane(&self, bi: usize, ci: usize) -> usize {
        let (b, c, h, w) = self.dims;
        if self.channel_major {
            (ci * b + bi) * h * w
        } else {
            (bi * c + ci) * h * w
        }
    }

    /// Every run of row `row` that maps to a run of input pixels:
    /// `f(column, input index, length)`. The other columns of the row are 0.
    pub fn row_runs(&self, row: usize, mut f: impl FnMut(usize, usize, usize)) {
        let (b, _, h, w) = self.dims;
        let (k, pad) = (self.k, self.k / 2);
        let (ci, ky, kx) = (row / (k * k), row / k % k, row % k);
        // x + kx - pad within 0..w
        let x0 = pad.saturating_sub(kx);
        let x1 = (w + pad).saturating_sub(kx).min(w);
        if x1 <= x0 {
            return;
        }
        for bi in 0..b {
            let img = self.plane(bi, ci);
            for y in 0..h {
                let sy = y + ky;
                if sy < pad || sy - pad >= h {
                    continue;
                }
                f((bi * h + y) * w + x0, img + (sy - pad) * w + x0 + kx - pad, x1 - x0);
            }
        }
    }

    /// The unfolded matrix, rows in parallel.
    pub fn unfold(&self, input: &[f32]) -> Vec<f32> {
        let cols = self.cols();
        let mut out = vec![0f32; self.rows() * cols];
        out.par_chunks_mut(cols.max(1)).enumerate().for_each(|(r, row)| {
            self.row_runs(r, |col, src, n| row[col..col + n].copy_from_slice(&input[src..src + n]));
        });
        out
    }

    /// The adjoint of [`Self::unfold`]: each entry of `cols` summed back
    /// into its pixel; channels in parallel when channel-major.
    pub fn fold(&self, cols: &[f32]) -> Vec<f32> {
        let (b, c, h, w) = self.dims;
        let (plane, width, kk) = (b * h * w, self.cols(), self.k * self.k);
        let mut out = vec![0f32; c * plane];
        let add = |dst: &mut [f32], r: usize, shift: usize| {
            let row = &cols[r * width..(r + 1) * width];
            self.row_runs(r, |col, px, n| {
                let px = px - shift;
                dst[px..px + n].iter_mut().zip(&row[col..col + n]).for_each(|(d, s)| *d += s);
            });
        };
        if self.channel_major {
            out.par_chunks_mut(plane.max(1)).enumerate().for_each(|(ci, dst)| {
                (ci * kk..(ci + 1) * kk).for_each(|r| add(dst, r, ci * plane));
            });
        } else {
            (0..self.rows()).for_each(|r| add(&mut out, r, 0));
        }
        out
    }
}

/// Bias, ReLU and 2x2 max pooling of a convolution's output `y`
/// (`[c, b, h, w]`), channels in parallel: the pooled `[c, b, h/2, w/2]`
/// and, for each pooled value, which of its window's four entries won
/// (the first maximum).
fn bias_relu_pool(y: &[f32], bias: &[f32], (b, h, w): (usize, usize, usize)) -> (Vec<f32>, Vec<u8>) {
    let (ph, pw) = (h / 2, w / 2);
    let mut pooled = vec![0f32; bias.len() * b * ph * pw];
    let mut arg = vec![0u8; pooled.len()];
    let plane = (b * ph * pw).max(1);
    pooled.par_chunks_mut(plane).zip(arg.par_chunks_mut(plane)).enumerate().for_each(|(ci, (p, a))| {
        let bias = bias[ci];
        for bi in 0..b {
            let img = &y[(ci * b + bi) * h * w..];
            for oy in 0..ph {
                for ox in 0..pw {
                    let at = |i: usize| img[(2 * oy + i / 2) * w + 2 * ox + i % 2];
                    let (mut best, mut which) = (at(0), 0u8);
                    for i in 1..4 {
                        if at(i) > best {
                            (best, which) = (at(i), i as u8);
                        }
                    }
                    let o = (bi * ph + oy) * pw + ox;
                    p[o] = (best + bias).max(0.0);
                    a[o] = which;
                }
            }
        }
    });
    (pooled, arg)
}

/// The backward of [`bias_relu_pool`]: the gradient with respect to `y`
/// (zero off each window's winner and where the ReLU was off) and the
/// bias's gradient.
fn unpool(
    grad: &[f32],
    pooled: &[f32],
    arg: &[u8],
    (c, b, h, w): (usize, usize, usize, usize),
) -> (Vec<f32>, Vec<f32>) {
    let (ph, pw) = (h / 2, w / 2);
    let mut dy = vec![0f32; c * b * h * w];
    let mut dbias = vec![0f32; c];
    dy.par_chunks_mut((b * h * w).max(1)).zip(dbias.par_iter_mut()).enumerate().for_each(|(ci, (d, db))| {
        let base = ci * b * ph * pw;
        let mut sum = 0f32;
        for bi in 0..b {
            for oy in 0..ph {
                for ox in 0..pw {
                    let o = base + (bi * ph + oy) * pw + ox;
                    if pooled[o] > 0.0 {
                        let i = arg[o] as usize;
                        d[(bi * h + 2 * oy + i / 2) * w + 2 * ox + i % 2] = grad[o];
                        sum += grad[o];
                    }
                }
            }
        }
        *db = sum;
    });
    (dy, dbias)
}

/// A contiguous f32 CPU tensor's values, read in place.
pub(crate) fn with_values<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        return Err(ModelError::Invalid("the hand-written step runs on the CPU only".into()));
    };
    Ok(f(crate::kernels::contiguous(cpu, layout)?))
}

pub(crate) fn values(t: &Tensor) -> Result<Vec<f32>> {
    with_values(t, <[f32]>::to_vec)
}

pub(crate) fn cpu(values: Vec<f32>, rows: usize, cols: usize) -> Result<Tensor> {
    Ok(Tensor::from_vec(values, (rows, cols), &Device::Cpu)?)
}

/// Column sums of a `[rows, cols]` matrix.
fn column_sums(m: &[f32], cols: usize) -> Vec<f32> {
    let mut sums = vec![0f32; cols];
    for row in m.chunks(cols.max(1)) {
        sums.iter_mut().zip(row).for_each(|(s, v)| *s += v);
    }
    sums
}

/// One convolution block's parameters.
pub(crate) struct ConvParams<'a> {
    pub name: &'a str,
    pub weight: &'a Tensor,
    pub bias: &'a Tensor,
    pub k: usize,
}

/// One linear layer's parameters.
pub(crate) struct LinearParams<'a> {
    pub name: String,
    pub weight: &'a Tensor,
    pub bias: &'a Tensor,
}

/// The gradient vector in layout order, filled by variable name.
pub(crate) struct Grads<'a> {
    layout: &'a ParamLayout,
    pub(crate) values: Vec<f32>,
}

impl<'a> Grads<'a> {
    /// Zeroed gradients: in `spare` (a gradient its user is done with, see
    /// [`crate::Model::recycle_gradients`]) when it is the model's size, so
    /// that no fresh model-sized buffer is faulted in; else in a new one.
    pub(crate) fn new(layout: &'a ParamLayout, spare: Option<Vec<f32>>) -> Self {
        let values = match spare {
            Some(mut v) if v.len() == layout.total_len() => {
                v.fill(0.0);
                v
            }
            _ => vec![0f32; layout.total_len()],
        };
        Self { layout, values }
    }

    fn entry(&self, name: &str, part: &str) -> Result<&'a crate::layout::ParamEntry> {
        self.layout
            .entry(&format!("{name}.{part}"))
            .ok_or_else(|| ModelError::Invalid(format!("no variable {name}.{part}")))
    }

    /// The zeroed gradient of one variable, to be written in place.
    pub(crate) fn slot(&mut self, name: &str, part: &str) -> Result<&mut [f32]> {
        let entry = self.entry(name, part)?;
        Ok(&mut self.values[entry.offset..entry.offset + entry.len])
    }

    pub(crate) fn put(&mut self, name: &str, part: &str, values: &[f32]) -> Result<()> {
        let entry = self.entry(name, part)?;
        if entry.len != values.len() {
            return Err(ModelError::Invalid(format!("{name}.{part}: {} values, not {}", values.len(), entry.len)));
        }
        self.values[entry.offset..entry.offset + entry.len].copy_from_slice(values);
        Ok(())
    }

    pub(crate) fn put_tensor(&mut self, name: &str, part: &str, t: &Tensor) -> Result<()> {
        with_values(t, |v| self.put(name, part, v))?
    }
}

fn labels_of(labels: &Tensor, batch: usize) -> Result<Vec<u32>> {
    if batch == 0 {
        return Err(ModelError::Invalid("an empty batch has no gradient".into()));
    }
    let labels = labels.to_vec1::<u32>()?;
    if labels.len() != batch {
        return Err(ModelError::Invalid(format!("{} labels for {batch} inputs", labels.len())));
    }
    Ok(labels)
}

/// Linear layers with ReLU between them, the last giving the logits of a
/// mean cross-entropy.
pub(crate) struct Dense<'a> {
    pub layers: Vec<LinearParams<'a>>,
}

/// What [`Dense::train`] gives besides the gradients.
struct DenseOut {
    /// Summed over the batch.
    loss: f64,
    /// With respect to the input, `[b, in]`, when asked for.
    input_grad: Option<Vec<f32>>,
    factors: Vec<LayerFactors>,
}

impl Dense<'_> {
    /// Forward and backward on `input` `[b, in]`, the layers' gradients
    /// into `grads`.
    fn train(
        &self,
        input: Tensor,
        labels: &[u32],
        grads: &mut Grads,
        input_grad: bool,
        factored: bool,
    ) -> Result<DenseOut> {
        let b = input.dim(0)?;
        // Each layer's input: the batch, then the ReLU of each hidden layer.
        let mut acts = vec![input];
        let mut logits = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            let bias = values(layer.bias)?;
            let mut z = values(&acts[i].matmul(&layer.weight.t()?)?)?;
            let last = i + 1 == self.layers.len();
            for row in z.chunks_mut(bias.len().max(1)) {
                if last {
                    row.iter_mut().zip(&bias).for_each(|(v, b)| *v += b);
                } else {
                    row.iter_mut().zip(&bias).for_each(|(v, b)| *v = (*v + b).max(0.0));
                }
            }
            if last {
                logits = z;
            } else {
                acts.push(cpu(z, b, bias.len())?);
            }
        }
        let classes = self.layers.last().map_or(Ok(0), |l| l.bias.dim(0))?;

        // Mean cross-entropy and its gradient with respect to the logits.
        let mut loss = 0f64;
        for (row, &label) in logits.chunks_mut(classes.max(1)).zip(labels) {
            let label = label as usize;
            if label >= classes {
                return Err(ModelError::Invalid(format!("label {label} with {classes} classes")));
            }
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = row.iter().map(|v| (v - max).exp()).sum();
            loss += (max + sum.ln() - row[label]) as f64;
            for (i, v) in row.iter_mut().enumerate() {
                *v = ((*v - max).exp() / sum - (i == label) as u8 as f32) / b as f32;
            }
        }

        // Backward, last layer first; `delta` is the gradient with respect
        // to the layer's output.
        let mut delta = cpu(logits, b, classes)?;
        let mut deltas = Vec::with_capacity(self.layers.len());
        let mut input_gradient = None;
        for (i, layer) in self.layers.iter().enumerate().rev() {
            grads.put_tensor(&layer.name, "weight", &delta.t()?.matmul(&acts[i])?)?;
            let width = delta.dim(1)?;
            with_values(&delta, |d| grads.put(&layer.name, "bias", &column_sums(d, width)))??;
            let next = if i > 0 || input_grad {
                let mut dx = values(&delta.matmul(layer.weight)?)?;
                if i > 0 {
                    with_values(&acts[i], |a| dx.iter_mut().zip(a).for_each(|(d, &v)| *d *= (v > 0.0) as u8 as f32))?;
                    Some(cpu(dx, b, acts[i].dim(1)?)?)
                } else {
                    input_gradient = Some(dx);
                    None
                }
            } else {
                None
            };
            deltas.push(delta);
            match next {
                Some(next) => delta = next,
                None => break,
            }
        }
        let factors = if factored {
            deltas
                .iter()
                .rev()
                .zip(self.layers.iter().zip(&acts))
                .map(|(delta, (layer, input))| {
                    Ok(LayerFactors {
                        offset: grads.entry(&layer.name, "weight")?.offset,
                        rows: delta.dim(1)?,
                        cols: input.dim(1)?,
                        delta: values(delta)?,
                        input: values(input)?,
                    })
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            Vec::new()
        };
        Ok(DenseOut { loss, input_grad: input_gradient, factors })
    }
}

/// The MLP of [`crate::model::Arch::Mlp`].
pub(crate) struct MlpStep<'a> {
    pub dense: Dense<'a>,
    pub layout: &'a ParamLayout,
}

impl MlpStep<'_> {
    /// Forward and backward on `images` (flattened per sample) with
    /// `labels` `[b]`: gradients of the mean cross-entropy in layout order
    /// and, when `factored`, the layers' sufficient factors.
    pub fn gradients(
        &self,
        images: &Tensor,
        labels: &Tensor,
        factored: bool,
        spare: Option<Vec<f32>>,
    ) -> Result<GradOutput> {
        let b = images.dim(0)?;
        let labels = labels_of(labels, b)?;
        let mut grads = Grads::new(self.layout, spare);
        let out = self.dense.train(images.flatten_from(1)?.contiguous()?, &labels, &mut grads, false, factored)?;
        Ok(GradOutput {
            loss: (out.loss / b.max(1) as f64) as f32,
            samples: b,
            grads: grads.values,
            factors: out.factors,
        })
    }
}

/// What a convolution block's backward needs from its forward.
struct Block<'a> {
    conv: &'a ConvParams<'a>,
    unfold: Unfold,
    /// `[out, c * k * k]`.
    weight: Tensor,
    /// The unfolded input.
    cols: Tensor,
    /// After bias, ReLU and pooling, `[out, b, h/2, w/2]`.
    pooled: Vec<f32>,
    arg: Vec<u8>,
    /// The convolution's output, `(out, b, h, w)`.
    out: (usize, usize, usize, usize),
}

/// The CNN of [`crate::model::Arch::Cnn`]: two conv + ReLU + 2x2 max-pool
/// blocks, then linear + ReLU and linear.
pub(crate) struct CnnStep<'a> {
    pub conv: [ConvParams<'a>; 2],
    pub fc: Dense<'a>,
    pub layout: &'a ParamLayout,
}

impl CnnStep<'_> {
    /// Forward and backward on `images` `[b, c, h, w]` with `labels` `[b]`:
    /// gradients of the mean cross-entropy in layout order, and, when
    /// `factored`, the linear layers' sufficient factors.
    pub fn gradients(
        &self,
        images: &Tensor,
        labels: &Tensor,
        factored: bool,
        spare: Option<Vec<f32>>,
    ) -> Result<GradOutput> {
        let (b, c, h, w) = images.dims4()?;
        let labels = labels_of(labels, b)?;
        if h < 4 || w < 4 {
            return Err(ModelError::Invalid(format!("the CNN needs images of 4x4 or more, not {h}x{w}")));
        }
        let mut grads = Grads::new(self.layout, spare);

        // Forward, keeping what the backward needs.
        let images = values(&images.contiguous()?)?;
        let mut blocks: Vec<Block> = Vec::with_capacity(self.conv.len());
        let mut dims = (b, c, h, w);
        for conv in &self.conv {
            let input: &[f32] = blocks.last().map_or(&images, |last| &last.pooled);
            let unfold = Unfold { k: conv.k, dims, channel_major: !blocks.is_empty() };
            let out_c = conv.weight.dim(0)?;
            let weight = conv.weight.reshape((out_c, unfold.rows()))?;
            let cols = cpu(unfold.unfold(input), unfold.rows(), unfold.cols())?;
            let bias = values(conv.bias)?;
            let (pooled, arg) =
                with_values(&weight.matmul(&cols)?, |y| bias_relu_pool(y, &bias, (dims.0, dims.2, dims.3)))?;
            blocks.push(Block { conv, unfold, weight, cols, pooled, arg, out: (out_c, dims.0, dims.2, dims.3) });
            dims = (dims.0, out_c, dims.2 / 2, dims.3 / 2);
        }
        // [c, b, hw] to [b, c * hw]: PyTorch's flattening order.
        let (_, pc, ph, pw) = dims;
        let pooled = blocks.last().map_or(&images, |last| &last.pooled);
        let hw = ph * pw;
        let flat_len = pc * hw;
        let mut flat = vec![0f32; b * flat_len];
        for (ci, plane) in pooled.chunks((b * hw).max(1)).enumerate() {
            for (bi, px) in plane.chunks(hw.max(1)).enumerate() {
                flat[bi * flat_len + ci * hw..][..hw].copy_from_slice(px);
            }
        }
        let out = self.fc.train(cpu(flat, b, flat_len)?, &labels, &mut grads, true, factored)?;
        let dflat = out.input_grad.ok_or_else(|| ModelError::Invalid("no gradient reached the convolutions".into()))?;
        let mut grad = vec![0f32; dflat.len()];
        for (ci, plane) in grad.chunks_mut((b * hw).max(1)).enumerate() {
            for (bi, px) in plane.chunks_mut(hw.max(1)).enumerate() {
                px.copy_from_slice(&dflat[bi * flat_len + ci * hw..][..hw]);
            }
        }

        // Backward through the convolution blocks, last first.
        for (i, Block { conv, unfold, weight, cols, pooled, arg, out: dims }) in blocks.into_iter().enumerate().rev() {
            let (dy, dbias) = unpool(&grad, &pooled, &arg, dims);
            let dy = cpu(dy, dims.0, dims.1 * dims.2 * dims.3)?;
            grads.put_tensor(conv.name, "weight", &dy.matmul(&cols.t()?)?)?;
            grads.put(conv.name, "bias", &dbias)?;
            if i > 0 {
                let dcols = weight.t()?.matmul(&dy)?;
                grad = with_values(&dcols, |d| unfold.fold(d))?;
            }
        }
        Ok(GradOutput {
            loss: (out.loss / b.max(1) as f64) as f32,
            samples: b,
            grads: grads.values,
            factors: out.factors,
        })
    }
}

/// The hand-written step of a model that has one.
pub(crate) enum CpuStep<'a> {
    Mlp(MlpStep<'a>),
    Cnn(CnnStep<'a>),
    /// [`crate::llama`]'s own step: the images are windows of tokens.
    Llama(&'a crate::llama::Llama, &'a ParamLayout),
}

impl CpuStep<'_> {
    /// Gradients of the mean loss on one batch, written into `spare` when
    /// it is a model-sized buffer (see [`crate::Model::recycle_gradients`]).
    pub fn gradients(
        &self,
        images: &Tensor,
        labels: &Tensor,
        factored: bool,
        spare: Option<Vec<f32>>,
    ) -> Result<GradOutput> {
        match self {
            Self::Mlp(step) => step.gradients(images, labels, factored, spare),
            Self::Cnn(step) => step.gradients(images, labels, factored, spare),
            Self::Llama(net, layout) => net.cpu_gradients(images, layout, spare),
        }
    }
}
