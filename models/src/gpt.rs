//! A decoder-only transformer (GPT-2 style, pre-layer-norm) over a
//! byte-level vocabulary: token and position embeddings, `layers` blocks of
//! causal self-attention and a 4x MLP with GELU, a final layer norm, and a
//! head tied to the token embedding.
//!
//! Inputs are windows of `context + 1` tokens stored as f32 (see
//! [`crate::data::text`]): the first `context` are read, and every position
//! predicts the token after it. On the CPU, GELU, the causal softmax,
//! layer norm and bias adds run as the fused kernels of [`crate::kernels`]
//! (candle's own fused softmax and layer norm have no backward pass); other
//! devices use candle's composed ops, which do.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Embedding, Linear, VarBuilder, VarMap};

use crate::error::{ModelError, Result};
use crate::layout::ParamLayout;
use crate::rng::DetRng;

/// The size of a GPT, apart from its context (which the data fixes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GptSize {
    pub layers: usize,
    pub heads: usize,
    /// Embedding width; a multiple of `heads`.
    pub width: usize,
}

impl Default for GptSize {
    /// 4 layers, 4 heads, width 128: about 0.8M parameters, which trains
    /// at a useful speed on a CPU.
    fn default() -> Self {
        Self { layers: 4, heads: 4, width: 128 }
    }
}

impl GptSize {
    pub fn validate(&self, context: usize) -> Result<()> {
        if self.layers == 0 || self.heads == 0 || self.width == 0 || context == 0 {
            return Err(ModelError::Config(format!(
                "GPT layers ({}), heads ({}), width ({}) and context ({context}) must be positive",
                self.layers, self.heads, self.width
            )));
        }
        if !self.width.is_multiple_of(self.heads) {
            return Err(ModelError::Config(format!(
                "GPT width {} is not a multiple of its {} heads",
                self.width, self.heads
            )));
        }
        Ok(())
    }
}

struct Norm {
    weight: Tensor,
    bias: Tensor,
}

impl Norm {
    fn new(width: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self { weight: vb.get(width, "weight")?, bias: vb.get(width, "bias")? })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        crate::kernels::layer_norm(x, &self.weight, &self.bias, 1e-5)
    }
}

struct Block {
    ln1: Norm,
    qkv: Dense,
    proj: Dense,
    ln2: Norm,
    fc: Dense,
    fc_proj: Dense,
}

/// A linear layer (candle's `weight [out, in]` and `bias [out]`, so names
/// and shapes are candle's) over a matrix of rows, with the fused bias add.
struct Dense(Linear);

impl Dense {
    fn new(inputs: usize, outputs: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self(candle_nn::linear(inputs, outputs, vb)?))
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = x.matmul(&self.0.weight().t()?)?;
        match self.0.bias() {
            Some(b) => crate::kernels::add_bias(&y, b),
            None => Ok(y),
        }
    }
}

/// The network. Built by [`crate::Model`] for `Arch::Gpt`.
pub(crate) struct Gpt {
    wte: Embedding,
    wpe: Embedding,
    blocks: Vec<Block>,
    ln_f: Norm,
    heads: usize,
    width: usize,
    context: usize,
    /// `[context, context]`: 0 on and below the diagonal, a large negative
    /// number above it (a position sees only itself and what came before).
    mask: Tensor,
}

impl Gpt {
    pub(crate) fn new(size: GptSize, context: usize, vocab: usize, vb: VarBuilder, device: &Device) -> Result<Self> {
        size.validate(context)?;
        let d = size.width;
        let blocks = (0..size.layers)
            .map(|i| {
                let vb = vb.pp(format!("h.{i}"));
                Ok(Block {
                    ln1: Norm::new(d, vb.pp("ln1"))?,
                    qkv: Dense::new(d, 3 * d, vb.pp("attn.qkv"))?,
                    proj: Dense::new(d, d, vb.pp("attn.proj"))?,
                    ln2: Norm::new(d, vb.pp("ln2"))?,
                    fc: Dense::new(d, 4 * d, vb.pp("mlp.fc"))?,
                    fc_proj: Dense::new(4 * d, d, vb.pp("mlp.proj"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mask: Vec<f32> =
            (0..context * context).map(|i| if i % context > i / context { -1e9 } else { 0.0 }).collect();
        Ok(Self {
            wte: candle_nn::embedding(vocab, d, vb.pp("wte"))?,
            wpe: candle_nn::embedding(context, d, vb.pp("wpe"))?,
            blocks,
            ln_f: Norm::new(d, vb.pp("ln_f"))?,
            heads: size.heads,
            width: d,
            context,
            mask: Tensor::from_vec(mask, (context, context), device)?,
        })
    }

    /// Logits `[n, t, vocab]` for tokens `[n, t]` (u32, `t <= context`).
    ///
    /// The residual stream is kept as one matrix `[n * t, width]`, so that
    /// every linear layer is one matrix product (candle multiplies a 3-D
    /// input by a weight broadcast over the batch, and its backward pass
    /// then builds one weight gradient per sample and sums them).
    pub(crate) fn logits(&self, tokens: &Tensor) -> Result<Tensor> {
        let (n, t) = tokens.dims2()?;
        if t == 0 || t > self.context {
            return Err(ModelError::Invalid(format!("GPT input of {t} tokens; its context is {}", self.context)));
        }
        let d = self.width;
        let positions = Tensor::arange(0u32, t as u32, tokens.device())?;
        let x = self.wte.forward(&tokens.flatten_all()?)?.reshape((n, t * d))?;
        let mut x = crate::kernels::add_bias(&x, &self.wpe.forward(&positions)?)?.reshape((n * t, d))?;
        let mask = self.mask.narrow(0, 0, t)?.narrow(1, 0, t)?;
        let (h, hd) = (self.heads, d / self.heads);
        let scale = 1.0 / (hd as f64).sqrt();
        for b in &self.blocks {
            let qkv = b.qkv.forward(&b.ln1.forward(&x)?)?;
            let split = |i: usize| -> Result<Tensor> {
                Ok(qkv.narrow(1, i * d, d)?.reshape((n, t, h, hd))?.transpose(1, 2)?.contiguous()?)
            };
            let (q, k, v) = (split(0)?, split(1)?, split(2)?);
            let att = crate::kernels::causal_softmax(&q.matmul(&k.t()?)?, scale, &mask)?;
            let y = att.matmul(&v)?.transpose(1, 2)?.reshape((n * t, d))?;
            x = (x + b.proj.forward(&y)?)?;
            let m = b.fc_proj.forward(&crate::kernels::gelu(&b.fc.forward(&b.ln2.forward(&x)?)?)?)?;
            x = (x + m)?;
        }
        let x = self.ln_f.forward(&x)?;
        let vocab = self.wte.embeddings().dim(0)?;
        Ok(x.matmul(&self.wte.embeddings().t()?)?.reshape((n, t, vocab))?)
    }

    /// Split windows `[n, .., context + 1]` (f32 token values) into inputs
    /// `[n, context]` and next-token targets `[n * context]`, both u32.
    pub(crate) fn inputs_and_targets(&self, windows: &Tensor) -> Result<(Tensor, Tensor)> {
        split_windows(windows, self.context, "GPT")
    }
}

/// Windows `[n, .., context + 1]` (f32 token values) as inputs
/// `[n, context]` and next-token targets `[n * context]`, both u32: what
/// every language model (`what`, for the error) reads.
pub(crate) fn split_windows(windows: &Tensor, context: usize, what: &str) -> Result<(Tensor, Tensor)> {
    let tokens = windows.flatten_from(1)?.to_dtype(DType::U32)?;
    let w = tokens.dim(1)?;
    if w != context + 1 {
        return Err(ModelError::Invalid(format!(
            "{what} windows of {w} tokens; this model reads {context} plus the next one"
        )));
    }
    Ok((tokens.narrow(1, 0, context)?, tokens.narrow(1, 1, context)?.flatten_all()?))
}

/// GPT-2's init: weights N(0, 0.02) (here uniform with that deviation), the
/// residual projections scaled by 1/sqrt(2 layers), biases 0, layer-norm
/// gains 1. Each tensor gets its own stream derived from (seed, name).
pub(crate) fn init(varmap: &VarMap, layout: &ParamLayout, layers: usize, seed: u64, device: &Device) -> Result<()> {
    let data = varmap.data().lock().map_err(|_| ModelError::Invalid("variable map lock poisoned".into()))?;
    let bound = 0.02 * 3f32.sqrt();
    let residual = 1.0 / ((2 * layers.max(1)) as f32).sqrt();
    for entry in layout.entries() {
        let name = entry.name.as_str();
        let is_norm = name.starts_with("ln_f") || name.contains(".ln1.") || name.contains(".ln2.");
        let values: Vec<f32> = if name.ends_with(".bias") {
            vec![0.0; entry.len]
        } else if is_norm {
            vec![1.0; entry.len]
        } else {
            let b = if name.ends_with("proj.weight") { bound * residual } else { bound };
            let mut rng = DetRng::derive(seed, name);
            (0..entry.len).map(|_| rng.uniform(-b, b)).collect()
        };
        let var = data.get(name).ok_or_else(|| ModelError::Invalid(format!("variable {name} vanished")))?;
        var.set(&Tensor::from_vec(values, entry.shape.as_slice(), device)?)?;
    }
    Ok(())
}

impl Gpt {
    /// Continue `prompt` by `tokens` bytes, sampling each from the softmax
    /// of the last position's logits divided by `temperature` (0: the most
    /// likely byte). The same seed gives the same text on the same device.
    pub(crate) fn generate(&self, prompt: &[u8], tokens: usize, temperature: f64, seed: u64) -> Result<Vec<u8>> {
        if !(temperature >= 0.0 && temperature.is_finite()) {
            return Err(ModelError::Invalid(format!("temperature {temperature} must be a finite number >= 0")));
        }
        let device = self.mask.device();
        let mut rng = DetRng::derive(seed, "generate");
        let mut out: Vec<u8> = prompt.to_vec();
        if out.is_empty() {
            out.push(b'\n');
        }
        for _ in 0..tokens {
            let start = out.len().saturating_sub(self.context);
            let ctx: Vec<u32> = out[start..].iter().map(|&b| b as u32).collect();
            let t = ctx.len();
            let input = Tensor::from_vec(ctx, (1, t), device)?;
            let logits = self.logits(&input)?.narrow(1, t - 1, 1)?.flatten_all()?.to_dtype(DType::F32)?;
            let logits: Vec<f32> = logits.to_vec1()?;
            out.push(sample(&logits, temperature, &mut rng) as u8);
        }
        Ok(out.split_off(if prompt.is_empty() { 1 } else { prompt.len() }))
    }
}

/// Index drawn from softmax(logits / temperature); the argmax at 0.
pub(crate) fn sample(logits: &[f32], temperature: f64, rng: &mut DetRng) -> usize {
    let argmax = logits
        .iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &l)| if l > best.1 { (i, l) } else { best })
        .0;
    if temperature == 0.0 {
        return argmax;
    }
    let max = logits[argmax] as f64;
    let weights: Vec<f64> = logits.iter().map(|&l| ((l as f64 - max) / temperature).exp()).collect();
    let total: f64 = weights.iter().sum();
    let mut draw = rng.next_f32() as f64 * total;
    for (i, w) in weights.iter().enumerate() {
        if draw < *w {
            return i;
        }
        draw -= w;
    }
    argmax
}

#[cfg(test)]
mod tests {
    use crate::data::ImageShape;
    use crate::model::{Arch, Model, ModelConfig};
    use candle_core::Device;

    /// Every parameter's analytic gradient (fused kernels and all) agrees
    /// with a central finite difference of the loss, in f64 arithmetic of
    /// the f32 loss: a wrong backward pass anywhere shows up here.
    #[test]
    fn gradients_match_finite_differences() -> crate::Result<()> {
        let context = 6;
        let config = ModelConfig {
            arch: Arch::Gpt { layers: 2, heads: 2, width: 8, context },
            input: ImageShape { channels: 1, height: 1, width: context + 1 },
            classes: 256,
        };
        let model = Model::new(config, 3, &Device::Cpu)?;
        crate::model::testing::lm_gradients_match_finite_differences(&model, 256, context, "gpt")?;
        Ok(())
    }
}
