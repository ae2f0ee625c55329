//! A decoder-only transformer of the Llama architecture: token embeddings,
//! `layers` blocks of RMS-normed grouped-query attention with rotary
//! position embeddings and an RMS-normed SwiGLU MLP, a final RMS norm, and a
//! head that is tied to the embedding or a matrix of its own. No biases.
//!
//! The variables carry Hugging Face's names and shapes
//! (`model.layers.0.self_attn.q_proj.weight`, `[out, in]`), and the
//! rotary embeddings use its "rotate half" layout, so a trained model is a
//! `LlamaForCausalLM` as it is ([`crate::hf`] writes and reads such
//! directories).
//!
//! Inputs are windows of `context + 1` tokens (see [`crate::data::text`]):
//! the first `context` are read, and every position predicts the token after
//! it. On the CPU, RMS norm, the rotary embeddings, SwiGLU and the causal
//! softmax run as fused kernels of [`crate::kernels`]; other devices use
//! candle's composed ops.

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};

use crate::error::{ModelError, Result};
use crate::layout::ParamLayout;
use crate::rng::DetRng;

mod step;

/// A float that compares and hashes by its bits, so that a model config
/// holding one stays `Eq` (configs are compared between peers).
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct Float(pub f64);

impl PartialEq for Float {
    fn eq(&self, other: &Self) -> bool {
        self.0.to_bits() == other.0.to_bits()
    }
}

impl Eq for Float {}

/// The size of a Llama, apart from its context (which the data fixes) and
/// its vocabulary (the tokenizer's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LlamaSize {
    /// Transformer blocks.
    pub layers: usize,
    /// Query heads per block.
    pub heads: usize,
    /// Key and value heads per block (grouped-query attention); divides
    /// `heads`. Equal to `heads`: plain multi-head attention.
    pub kv_heads: usize,
    /// Embedding width: `heads` times an even head width.
    pub width: usize,
    /// The MLP's hidden width.
    pub ff: usize,
    /// The output head is the token embedding (`tie_word_embeddings`).
    pub tie: bool,
    /// The rotary embeddings' base (`rope_theta`).
    pub rope_theta: Float,
    /// RMS norm's epsilon (`rms_norm_eps`).
    pub norm_eps: Float,
}

impl Default for LlamaSize {
    /// 4 layers, 4 query and 2 key/value heads, width 128, MLP 352, a tied
    /// head: about 0.8M parameters over bytes, which trains at a useful
    /// speed on a CPU.
    fn default() -> Self {
        Self {
            layers: 4,
            heads: 4,
            kv_heads: 2,
            width: 128,
            ff: 352,
            tie: true,
            rope_theta: Float(10_000.0),
            norm_eps: Float(1e-5),
        }
    }
}

impl LlamaSize {
    pub fn validate(&self, context: usize) -> Result<()> {
        let bad = |m: String| Err(ModelError::Config(m));
        if self.layers == 0 || self.heads == 0 || self.kv_heads == 0 || self.width == 0 || self.ff == 0 || context == 0
        {
            return bad(format!(
                "Llama layers ({}), heads ({}), kv_heads ({}), width ({}), ff ({}) and context ({context}) must be positive",
                self.layers, self.heads, self.kv_heads, self.width, self.ff
            ));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!("Llama heads ({}) must be a multiple of kv_heads ({})", self.heads, self.kv_heads));
        }
        if !self.width.is_multiple_of(self.heads) || !(self.width / self.heads).is_multiple_of(2) {
            return bad(format!(
                "Llama width {} must be its {} heads times an even head width (rotary embeddings turn pairs)",
                self.width, self.heads
            ));
        }
        if !(self.rope_theta.0.is_finite() && self.rope_theta.0 > 1.0) {
            return bad(format!("Llama rope_theta {} must be a finite number above 1", self.rope_theta.0));
        }
        if !(self.norm_eps.0.is_finite() && self.norm_eps.0 > 0.0 && self.norm_eps.0 < 1.0) {
            return bad(format!("Llama norm_eps {} must be between 0 and 1", self.norm_eps.0));
        }
        Ok(())
    }

    pub fn head_dim(&self) -> usize {
        self.width / self.heads.max(1)
    }

    /// Parameters of a model of this size over `vocab` tokens.
    pub fn parameters(&self, vocab: usize) -> usize {
        let (d, kv) = (self.width, self.kv_heads * self.head_dim());
        let block = 2 * d + d * d * 2 + 2 * d * kv + 3 * d * self.ff;
        vocab * d * if self.tie { 1 } else { 2 } + self.layers * block + d
    }
}

struct Block {
    attn_norm: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    mlp_norm: Tensor,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
}

/// The network. Built by [`crate::Model`] for `Arch::Llama`.
pub(crate) struct Llama {
    embed: Tensor,
    blocks: Vec<Block>,
    norm: Tensor,
    /// `lm_head.weight`; `None`: tied to the embedding.
    head: Option<Tensor>,
    size: LlamaSize,
    context: usize,
    /// `[context, head_dim / 2]`: the rotary angles' cosines and sines.
    cos: Tensor,
    sin: Tensor,
    /// `[context, context]`: 0 on and below the diagonal, a large negative
    /// number above it (the devices without the fused causal softmax).
    mask: Tensor,
    /// The matrix products' dtype (set through [`crate::Model`]).
    pub(crate) precision: crate::Precision,
}

/// `x [rows, in] @ w^T` for a weight `[out, in]`.
fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(x.matmul(&w.t()?)?)
}

impl Llama {
    /// [`linear`] in the model's precision.
    fn linear(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        self.precision.matmul(x, &w.t()?)
    }

    pub(crate) fn new(size: LlamaSize, context: usize, vocab: usize, vb: VarBuilder, device: &Device) -> Result<Self> {
        size.validate(context)?;
        let (d, hd) = (size.width, size.head_dim());
        let kv = size.kv_heads * hd;
        let blocks = (0..size.layers)
            .map(|i| {
                let vb = vb.pp(format!("model.layers.{i}"));
                Ok(Block {
                    attn_norm: vb.get(d, "input_layernorm.weight")?,
                    q: vb.get((d, d), "self_attn.q_proj.weight")?,
                    k: vb.get((kv, d), "self_attn.k_proj.weight")?,
                    v: vb.get((kv, d), "self_attn.v_proj.weight")?,
                    o: vb.get((d, d), "self_attn.o_proj.weight")?,
                    mlp_norm: vb.get(d, "post_attention_layernorm.weight")?,
                    gate: vb.get((size.ff, d), "mlp.gate_proj.weight")?,
                    up: vb.get((size.ff, d), "mlp.up_proj.weight")?,
                    down: vb.get((d, size.ff), "mlp.down_proj.weight")?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let half = hd / 2;
        let angles: Vec<f32> = (0..context * half)
            .map(|k| {
                let (p, i) = (k / half, k % half);
                (p as f64 * size.rope_theta.0.powf(-2.0 * i as f64 / hd as f64)) as f32
            })
            .collect();
        // The tables in the variables' dtype: the composed ops of other
        // dtypes and devices mix them with activations.
        let angles = Tensor::from_vec(angles, (context, half), device)?.to_dtype(vb.dtype())?;
        let mask: Vec<f32> =
            (0..context * context).map(|i| if i % context > i / context { -1e9 } else { 0.0 }).collect();
        Ok(Self {
            embed: vb.get((vocab, d), "model.embed_tokens.weight")?,
            blocks,
            norm: vb.get(d, "model.norm.weight")?,
            head: if size.tie { None } else { Some(vb.get((vocab, d), "lm_head.weight")?) },
            size,
            context,
            cos: angles.cos()?,
            sin: angles.sin()?,
            mask: Tensor::from_vec(mask, (context, context), device)?.to_dtype(vb.dtype())?,
            precision: crate::Precision::F32,
        })
    }

    /// Logits `[n, t, vocab]` for tokens `[n, t]` (u32, `t <= context`).
    ///
    /// The residual stream is one matrix `[n * t, width]`, so that every
    /// linear layer is one matrix product.
    pub(crate) fn logits(&self, tokens: &Tensor) -> Result<Tensor> {
        let (n, t) = tokens.dims2()?;
        let x = self.hidden(tokens, None)?;
        let head = self.head.as_ref().unwrap_or(&self.embed);
        Ok(self.linear(&x, head)?.reshape((n, t, head.dim(0)?))?)
    }

    /// The last position's logits `[vocab]` for `tokens` that follow the
    /// ones `cache` holds (one sequence): their keys and values join the
    /// cache, so each generated token costs one position, not the whole
    /// context again.
    pub(crate) fn next_logits(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Tensor> {
        let t = tokens.len();
        let input = Tensor::from_vec(tokens.to_vec(), (1, t), self.mask.device())?;
        let x = self.hidden(&input, Some(cache))?.narrow(0, t - 1, 1)?;
        let head = self.head.as_ref().unwrap_or(&self.embed);
        Ok(self.linear(&x, head)?.flatten_all()?)
    }

    /// The final normed residual stream `[n * t, width]` of tokens `[n, t]`
    /// at positions `cache.len ..` (0 without a cache).
    fn hidden(&self, tokens: &Tensor, mut cache: Option<&mut KvCache>) -> Result<Tensor> {
        let (n, t) = tokens.dims2()?;
        let pos = cache.as_ref().map_or(0, |c| c.len);
        if t == 0 || pos + t > self.context {
            return Err(ModelError::Invalid(format!(
                "Llama input of {t} tokens after {pos}; its context is {}",
                self.context
            )));
        }
        let s = &self.size;
        let (d, hd, h, kvh) = (s.width, s.head_dim(), s.heads, s.kv_heads);
        let eps = s.norm_eps.0 as f32;
        let mut x = self.embed.index_select(&tokens.flatten_all()?, 0)?;
        // Rows: the new positions; columns: every key so far.
        let mask = self.mask.narrow(0, pos, t)?.narrow(1, 0, pos + t)?;
        let (cos, sin) = (self.cos.narrow(0, pos, t)?, self.sin.narrow(0, pos, t)?);
        let scale = 1.0 / (hd as f64).sqrt();
        let heads = |m: Tensor, count: usize| -> Result<Tensor> {
            Ok(m.reshape((n, t, count, hd))?.transpose(1, 2)?.contiguous()?)
        };
        // Each key/value head serves `heads / kv_heads` query heads in a
        // row, so a group's queries are one `[group * t, hd]` matrix against
        // its keys and values: reshapes of contiguous tensors, no copy of
        // the keys and values per query head (nor a sum back in backward).
        let group = h / kvh;
        for (i, b) in self.blocks.iter().enumerate() {
            let a = crate::kernels::rms_norm(&x, &b.attn_norm, eps)?;
            let q = crate::kernels::rope(&heads(self.linear(&a, &b.q)?, h)?, &cos, &sin)?;
            let k = crate::kernels::rope(&heads(self.linear(&a, &b.k)?, kvh)?, &cos, &sin)?;
            let v = heads(self.linear(&a, &b.v)?, kvh)?;
            let (k, v) = match cache.as_deref_mut() {
                Some(c) => c.extend(i, k, v)?,
                None => (k, v),
            };
            let keys = k.dim(2)?;
            let scores =
                self.precision.matmul(&q.reshape((n, kvh, group * t, hd))?, &k.t()?)?.reshape((n, h, t, keys))?;
            let att = if pos == 0 {
                crate::kernels::causal_softmax(&scores, scale, &mask)?
            } else {
                crate::kernels::softmax_last_dim(&(scores * scale)?.broadcast_add(&mask)?)?
            };
            let y = self.precision.matmul(&att.reshape((n, kvh, group * t, keys))?, &v)?.reshape((n, h, t, hd))?;
            let y = y.transpose(1, 2)?.reshape((n * t, d))?;
            x = (x + self.linear(&y, &b.o)?)?;
            let m = crate::kernels::rms_norm(&x, &b.mlp_norm, eps)?;
            let m = crate::kernels::swiglu(&self.linear(&m, &b.gate)?, &self.linear(&m, &b.up)?)?;
            x = (x + self.linear(&m, &b.down)?)?;
        }
        if let Some(c) = cache {
            c.len += t;
        }
        crate::kernels::rms_norm(&x, &self.norm, eps)
    }

    /// The weights are f32 (the hand-written CPU step's dtype).
    pub(crate) fn is_f32(&self) -> bool {
        self.embed.dtype() == DType::F32
    }

    /// Split windows `[n, .., context + 1]` (f32 token values) into inputs
    /// `[n, context]` and next-token targets `[n * context]`, both u32.
    pub(crate) fn inputs_and_targets(&self, windows: &Tensor) -> Result<(Tensor, Tensor)> {
        crate::lm::split_windows(windows, self.context, "Llama")
    }

    /// Continue `prompt` by `tokens` tokens, sampling each from the softmax
    /// of the last position's logits divided by `temperature` (0: the most
    /// likely token). The same seed gives the same tokens on the same device.
    ///
    /// A [`KvCache`] holds the keys and values of the positions so far, so
    /// each token costs one position. Within the context this equals running
    /// the whole sequence again for every token; once the context is full,
    /// the cache starts again from the last half of it (a prompt longer
    /// than the context is cut to its last `context` tokens).
    pub(crate) fn generate(&self, prompt: &[u32], tokens: usize, temperature: f64, seed: u64) -> Result<Vec<u32>> {
        if !(temperature >= 0.0 && temperature.is_finite()) {
            return Err(ModelError::Invalid(format!("temperature {temperature} must be a finite number >= 0")));
        }
        let vocab = self.embed.dim(0)? as u32;
        if let Some(bad) = prompt.iter().find(|&&t| t >= vocab) {
            return Err(ModelError::Invalid(format!("prompt token {bad} is outside the vocabulary of {vocab}")));
        }
        let mut rng = DetRng::derive(seed, "generate");
        let mut out: Vec<u32> = prompt.to_vec();
        let mut cache = KvCache::new(self.blocks.len());
        let mut logits = self.next_logits(&out[out.len().saturating_sub(self.context)..], &mut cache)?;
        for left in (0..tokens).rev() {
            let next = crate::lm::sample(&logits.to_dtype(DType::F32)?.to_vec1()?, temperature, &mut rng) as u32;
            out.push(next);
            if left == 0 {
                break;
            }
            logits = if cache.len < self.context {
                self.next_logits(&[next], &mut cache)?
            } else {
                // The context is full: start again from its last half.
                cache = KvCache::new(self.blocks.len());
                self.next_logits(&out[out.len() - (self.context / 2).max(1)..], &mut cache)?
            };
        }
        Ok(out.split_off(prompt.len()))
    }
}

/// The keys and values of the positions a sequence has been through, per
/// layer (`[1, kv_heads, len, head_dim]`), for generating one token at a
/// time.
pub(crate) struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    /// Positions held.
    len: usize,
}

impl KvCache {
    pub(crate) fn new(layers: usize) -> Self {
        Self { layers: vec![None; layers], len: 0 }
    }

    /// Appends layer `i`'s new keys and values; returns all of them.
    fn extend(&mut self, i: usize, k: Tensor, v: Tensor) -> Result<(Tensor, Tensor)> {
        let slot = self.layers.get_mut(i).ok_or_else(|| ModelError::Invalid(format!("no layer {i} in the cache")))?;
        let both = match slot.take() {
            Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 2)?, Tensor::cat(&[&pv, &v], 2)?),
            None => (k, v),
        };
        *slot = Some(both.clone());
        Ok(both)
    }
}

/// Init as Hugging Face's Llama: weights N(0, 0.02) (here uniform with
/// that deviation), the residual projections (`o_proj`, `down_proj`) scaled
/// by 1/sqrt(2 layers) as GPT-2 does, norm gains 1. Each tensor gets its
/// own stream derived from (seed, name).
pub(crate) fn init(varmap: &VarMap, layout: &ParamLayout, layers: usize, seed: u64, device: &Device) -> Result<()> {
    let data = varmap.data().lock().map_err(|_| ModelError::Invalid("variable map lock poisoned".into()))?;
    let bound = 0.02 * 3f32.sqrt();
    let residual = 1.0 / ((2 * layers.max(1)) as f32).sqrt();
    for entry in layout.entries() {
        let name = entry.name.as_str();
        let values: Vec<f32> = if name.ends_with("norm.weight") {
            vec![1.0; entry.len]
        } else {
            let b = if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
                bound * residual
            } else {
                bound
            };
            let mut rng = DetRng::derive(seed, name);
            (0..entry.len).map(|_| rng.uniform(-b, b)).collect()
        };
        let var = data.get(name).ok_or_else(|| ModelError::Invalid(format!("variable {name} vanished")))?;
        var.set(&Tensor::from_vec(values, entry.shape.as_slice(), device)?)?;
    }
    Ok(())
}

/// The last position's logits, `[vocab]`, for a check against another
/// implementation.
#[cfg(test)]
pub(crate) fn last_logits(model: &Llama, tokens: &[u32]) -> Result<Vec<f32>> {
    let t = tokens.len();
    let input = Tensor::from_vec(tokens.to_vec(), (1, t), model.mask.device())?;
    Ok(model.logits(&input)?.narrow(1, t - 1, 1)?.flatten_all()?.to_vec1()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::ImageShape;
    use crate::model::{Arch, Model, ModelConfig, TrainableModel};

    fn tiny(tie: bool, kv_heads: usize, context: usize) -> ModelConfig {
        let size = LlamaSize { layers: 2, heads: 4, kv_heads, width: 16, ff: 24, tie, ..LlamaSize::default() };
        ModelConfig {
            arch: Arch::Llama { size, context },
            input: ImageShape { channels: 1, height: 1, width: context + 1 },
            classes: 64,
        }
    }

    /// Every parameter's analytic gradient (fused kernels and all) agrees
    /// with a central finite difference of the loss: a wrong backward pass
    /// anywhere (RMS norm, rotary embeddings, grouped-query attention,
    /// SwiGLU, the tied or untied head) shows up here.
    #[test]
    fn gradients_match_finite_differences() -> crate::Result<()> {
        let context = 6;
        for (tie, kv) in [(true, 2), (false, 4), (true, 1)] {
            let model = Model::new(tiny(tie, kv, context), 3, &Device::Cpu)?;
            let what = format!("llama, tie {tie}, kv_heads {kv}");
            crate::model::testing::lm_gradients_match_finite_differences(&model, 64, context, &what)?;
        }
        Ok(())
    }

    /// The fused CPU path and the composed ops the other devices take
    /// (forced here by computing in f64) give the same logits.
    #[test]
    fn fused_and_composed_paths_agree() -> crate::Result<()> {
        let config = tiny(false, 2, 8);
        let model = Model::new(config.clone(), 9, &Device::Cpu)?;
        let Some(net) = model.llama() else { panic!("not a llama") };
        let tokens: Vec<u32> = (0..8).map(|i| (i * 13 + 5) % 64).collect();
        let fused = last_logits(net, &tokens)?;
        // The same weights as f64 tensors.
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F64, &Device::Cpu);
        let Arch::Llama { size, context } = config.arch else { panic!("not a llama") };
        let wide = Llama::new(size, context, config.classes, vb, &Device::Cpu)?;
        {
            let src = model.varmap().data().lock().map_err(|_| ModelError::Invalid("lock".into()))?;
            let dst = varmap.data().lock().map_err(|_| ModelError::Invalid("lock".into()))?;
            for (name, var) in src.iter() {
                let Some(target) = dst.get(name) else { panic!("no {name} in the f64 model") };
                target.set(&var.as_tensor().to_dtype(DType::F64)?)?;
            }
        }
        let input = Tensor::from_vec(tokens.clone(), (1, 8), &Device::Cpu)?;
        let composed: Vec<f32> =
            wide.logits(&input)?.narrow(1, 7, 1)?.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
        let diff = fused.iter().zip(&composed).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(diff < 1e-4, "fused and composed logits differ by {diff}");
        Ok(())
    }

    /// Token by token through the cache, the logits are those of the
    /// whole sequence run at once, and generating past the context goes on.
    #[test]
    fn the_kv_cache_gives_the_logits_of_the_whole_sequence() -> crate::Result<()> {
        let context = 12;
        for (tie, kv) in [(true, 2), (false, 1), (false, 4)] {
            let model = Model::new(tiny(tie, kv, context), 5, &Device::Cpu)?;
            let Some(net) = model.llama() else { panic!("not a llama") };
            let tokens: Vec<u32> = (0..context as u32).map(|i| (i * 29 + 3) % 64).collect();
            let mut cache = KvCache::new(2);
            let mut worst = 0f32;
            // A prompt of 4 at once, then one position at a time.
            let mut cached: Vec<f32> = net.next_logits(&tokens[..4], &mut cache)?.to_vec1()?;
            for end in 4..=context {
                let whole = last_logits(net, &tokens[..end])?;
                let diff = whole.iter().zip(&cached).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                worst = worst.max(diff);
                if end < context {
                    cached = net.next_logits(&tokens[end..end + 1], &mut cache)?.to_vec1()?;
                }
            }
            assert!(worst < 1e-5, "tie {tie}, kv {kv}: cached logits differ by {worst}");
            let full = net.next_logits(&tokens[..1], &mut cache).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(full.contains("context is 12"), "a full cache took another position: {full}");
            // Greedy: the cached generation is the recomputing one while it
            // fits, and it goes on past the context.
            let out = net.generate(&tokens[..3], 3 * context, 0.0, 1)?;
            assert_eq!(out.len(), 3 * context);
            let mut seq = tokens[..3].to_vec();
            for want in &out[..context - 3] {
                let logits = last_logits(net, &seq)?;
                let best = (0..logits.len()).fold(0, |b, i| if logits[i] > logits[b] { i } else { b }) as u32;
                assert_eq!(best, *want, "tie {tie}, kv {kv}: greedy token {} differs", seq.len());
                seq.push(best);
            }
        }
        Ok(())
    }

    #[test]
    fn sizes_are_checked_and_counted() {
        let ok = LlamaSize::default();
        assert!(ok.validate(64).is_ok());
        for (bad, what) in [
            (LlamaSize { kv_heads: 3, ..ok }, "multiple of kv_heads"),
            (LlamaSize { width: 100, heads: 4, ..ok }, "even head width"),
            (LlamaSize { width: 12, heads: 4, kv_heads: 4, ..ok }, "even head width"),
            (LlamaSize { layers: 0, ..ok }, "positive"),
            (LlamaSize { rope_theta: Float(0.5), ..ok }, "rope_theta"),
        ] {
            let e = bad.validate(64).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains(what), "{bad:?}: {e}");
        }
        let model = Model::new(tiny(false, 2, 8), 1, &Device::Cpu).ok();
        let counted = model.map(|m| m.layout().total_len());
        let Arch::Llama { size, .. } = tiny(false, 2, 8).arch else { panic!("not a llama") };
        assert_eq!(counted, Some(size.parameters(64)));
    }
}
