//! The Llama's training step on the CPU in f32, written out by hand as
//! [`crate::cpu_step`] writes the MLP's and the CNN's (issue 45).
//!
//! Through candle's graph, a step spent about as long outside the matrix
//! products as in them: every node's gradient starts as a zeroed tensor
//! that each contribution is added into, every transpose is a copy, and
//! each element-wise op is handed to candle's thread pool, whose workers
//! spin between ops. Here the step is the matrix products (candle's, so
//! the same `gemm` kernels) and one pass each for RMS norm, the heads'
//! split with the rotary embedding, the causal softmax, SwiGLU and the
//! cross-entropy, forwards and backwards ([`crate::kernels`]' row
//! kernels, shared with the fused ops of the graph). Gradients are written
//! once, straight into the flat vector in layout order.
//!
//! The arithmetic is the graph's: the tests check loss and gradients
//! against it, and the model's finite-difference test runs through this
//! step.

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use super::{linear, Block, Llama};
use crate::cpu_step::{cpu, values, with_values, Grads};
use crate::error::{ModelError, Result};
use crate::grads::GradOutput;
use crate::kernels;
use crate::layout::ParamLayout;

/// Element-wise additions per rayon task.
const ADD_CHUNK: usize = 1 << 14;

/// The sizes of one step: `n` windows of `t` positions are `rows` rows of
/// the residual stream, `d` wide; `h` query heads and `kvh` key/value
/// heads of `hd` columns; an MLP `ff` wide.
#[derive(Debug, Clone, Copy)]
struct Dims {
    n: usize,
    t: usize,
    rows: usize,
    d: usize,
    h: usize,
    kvh: usize,
    hd: usize,
    ff: usize,
}

impl Dims {
    /// Query heads per key/value head.
    fn group(&self) -> usize {
        self.h / self.kvh
    }
}

/// The rotary tables `[context, hd / 2]`, read once a step.
struct Rotary {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
}

impl Rotary {
    /// One head's row `src` at position `p` turned into `o` (`sign` -1:
    /// turned back, the backward), or copied without a table.
    fn apply(rot: Option<(&Self, f32)>, o: &mut [f32], src: &[f32], p: usize) {
        match rot {
            Some((r, sign)) => {
                let at = p * r.half..(p + 1) * r.half;
                kernels::rotate(o, src, &r.cos[at.clone()], &r.sin[at], sign);
            }
            None => o.copy_from_slice(src),
        }
    }
}

/// What one block's backward needs from its forward.
struct Saved {
    /// The block's input, and the residual stream after its attention.
    x: Vec<f32>,
    x1: Vec<f32>,
    /// The attention's normed input `[rows, d]`.
    a: Tensor,
    /// Rotated queries `[n, kvh, group * t, hd]` (a key/value head's query
    /// heads one after another), rotated keys and values `[n, kvh, t, hd]`.
    q: Tensor,
    k: Tensor,
    v: Tensor,
    /// Attention weights `[n, kvh, group * t, t]`.
    p: Tensor,
    /// The heads' outputs side by side, `[rows, d]`.
    y: Tensor,
    /// The MLP's normed input, its gate and up projections, their SwiGLU.
    m: Tensor,
    gate: Tensor,
    up: Tensor,
    s: Tensor,
}

/// `[rows, heads * hd]` (row `b * t + p`) to `[n, heads, t, hd]`, each
/// head's row rotated when `rot` is given.
fn to_heads(src: &[f32], dm: Dims, heads: usize, rot: Option<(&Rotary, f32)>) -> Vec<f32> {
    let (t, hd, width) = (dm.t, dm.hd, heads * dm.hd);
    let mut out = vec![0f32; src.len()];
    out.par_chunks_mut((t * hd).max(1)).enumerate().for_each(|(bh, o)| {
        let (b, head) = (bh / heads, bh % heads);
        for (p, o) in o.chunks_mut(hd).enumerate() {
            Rotary::apply(rot, o, &src[(b * t + p) * width + head * hd..][..hd], p);
        }
    });
    out
}

/// The inverse of [`to_heads`]: `[n, heads, t, hd]` to `[rows, heads * hd]`.
fn from_heads(src: &[f32], dm: Dims, heads: usize, rot: Option<(&Rotary, f32)>) -> Vec<f32> {
    let (t, hd, width) = (dm.t, dm.hd, heads * dm.hd);
    let mut out = vec![0f32; src.len()];
    out.par_chunks_mut((t * width).max(1)).enumerate().for_each(|(b, o)| {
        for head in 0..heads {
            for p in 0..t {
                let from = &src[((b * heads + head) * t + p) * hd..][..hd];
                Rotary::apply(rot, &mut o[p * width + head * hd..][..hd], from, p);
            }
        }
    });
    out
}

/// `dst += src`, element-wise.
fn add_into(dst: &mut [f32], src: &[f32]) {
    dst.par_chunks_mut(ADD_CHUNK).zip(src.par_chunks(ADD_CHUNK)).for_each(|(d, s)| {
        d.iter_mut().zip(s).for_each(|(d, s)| *d += s);
    });
}

/// `dst += t`, for a contiguous f32 tensor as long as `dst`.
fn add_tensor(dst: &mut [f32], t: &Tensor) -> Result<()> {
    with_values(t, |v| {
        if v.len() == dst.len() {
            add_into(dst, v);
            Ok(())
        } else {
            Err(ModelError::Invalid(format!("adding {} values to {}", v.len(), dst.len())))
        }
    })?
}

/// RMS norm of the rows of `x` with the gain `gain`, as a `[rows, d]` tensor.
fn rms_norm(x: &[f32], gain: &Tensor, eps: f32, dm: Dims) -> Result<Tensor> {
    let out = with_values(gain, |g| kernels::rms_norm_rows(x, g, eps))??;
    cpu(out, dm.rows, dm.d)
}

/// The backward of [`rms_norm`]: `x`'s gradient added into `dx`, the gain's
/// written to `name`.
fn rms_norm_back(
    x: &[f32],
    gain: &Tensor,
    g: &Tensor,
    eps: f32,
    dx: &mut [f32],
    grads: &mut Grads,
    name: &str,
) -> Result<()> {
    let (d, dgain) = with_values(gain, |w| with_values(g, |g| kernels::rms_norm_grad_rows(x, w, g, eps)))???;
    add_into(dx, &d);
    grads.put(name, "weight", &dgain)
}

impl Llama {
    /// Gradients of the mean next-token cross-entropy over `windows`
    /// (`[n, .., context + 1]` token values) in layout order, written into
    /// `spare` when it is a model-sized buffer. CPU and f32 only.
    pub(crate) fn cpu_gradients(
        &self,
        windows: &Tensor,
        layout: &ParamLayout,
        spare: Option<Vec<f32>>,
    ) -> Result<GradOutput> {
        let (inputs, targets) = self.inputs_and_targets(windows)?;
        let (n, t) = inputs.dims2()?;
        if n == 0 {
            return Err(ModelError::Invalid("an empty batch has no gradient".into()));
        }
        let s = &self.size;
        let dm = Dims { n, t, rows: n * t, d: s.width, h: s.heads, kvh: s.kv_heads, hd: s.head_dim(), ff: s.ff };
        let tokens = inputs.flatten_all()?.to_vec1::<u32>()?;
        let targets = targets.to_vec1::<u32>()?;
        let vocab = self.embed.dim(0)?;
        if let Some(bad) = tokens.iter().find(|&&x| x as usize >= vocab) {
            return Err(ModelError::Invalid(format!("token {bad} is outside the vocabulary of {vocab}")));
        }
        let rot = Rotary { cos: values(&self.cos)?, sin: values(&self.sin)?, half: dm.hd / 2 };
        let eps = s.norm_eps.0 as f32;
        let mut grads = Grads::new(layout, spare);

        let mut x = with_values(&self.embed, |e| {
            tokens.iter().flat_map(|&tok| &e[tok as usize * dm.d..][..dm.d]).copied().collect::<Vec<f32>>()
        })?;
        let mut saved = Vec::with_capacity(self.blocks.len());
        for b in &self.blocks {
            saved.push(self.block_forward(b, &mut x, dm, &rot)?);
        }
        let xf = rms_norm(&x, &self.norm, eps, dm)?;
        let head = self.head.as_ref().unwrap_or(&self.embed);
        let mut logits = values(&linear(&xf, head)?)?;
        let loss = kernels::cross_entropy_grad_rows(&mut logits, &targets, vocab, 1.0 / dm.rows.max(1) as f32)?;
        let dlogits = cpu(logits, dm.rows, vocab)?;
        let dhead = dlogits.t()?.matmul(&xf)?;
        let mut dx = vec![0f32; x.len()];
        rms_norm_back(&x, &self.norm, &dlogits.matmul(head)?, eps, &mut dx, &mut grads, "model.norm")?;
        for (i, (b, s)) in self.blocks.iter().zip(saved).enumerate().rev() {
            self.block_backward(i, b, s, &mut dx, &mut grads, dm, &rot)?;
        }

        // The embedding: the head's gradient when tied, and each input
        // row's gradient added to its token's row.
        match self.head {
            Some(_) => grads.put_tensor("lm_head", "weight", &dhead)?,
            None => grads.put_tensor("model.embed_tokens", "weight", &dhead)?,
        }
        let slot = grads.slot("model.embed_tokens", "weight")?;
        for (&tok, g) in tokens.iter().zip(dx.chunks(dm.d)) {
            slot[tok as usize * dm.d..][..dm.d].iter_mut().zip(g).for_each(|(s, g)| *s += g);
        }
        Ok(GradOutput {
            loss: (loss / dm.rows.max(1) as f64) as f32,
            samples: n,
            grads: grads.values,
            factors: Vec::new(),
        })
    }

    /// One block forwards: `x` goes from the block's input to its output.
    fn block_forward(&self, b: &Block, x: &mut [f32], dm: Dims, rot: &Rotary) -> Result<Saved> {
        let (n, t, hd, kvh, gt) = (dm.n, dm.t, dm.hd, dm.kvh, dm.group() * dm.t);
        let eps = self.size.norm_eps.0 as f32;
        let dev = Device::Cpu;
        let a = rms_norm(x, &b.attn_norm, eps, dm)?;
        let heads = |w: &Tensor, count: usize, rot: Option<(&Rotary, f32)>| -> Result<Vec<f32>> {
            with_values(&linear(&a, w)?, |m| to_heads(m, dm, count, rot))
        };
        let q = Tensor::from_vec(heads(&b.q, dm.h, Some((rot, 1.0)))?, (n, kvh, gt, hd), &dev)?;
        let k = Tensor::from_vec(heads(&b.k, kvh, Some((rot, 1.0)))?, (n, kvh, t, hd), &dev)?;
        let v = Tensor::from_vec(heads(&b.v, kvh, None)?, (n, kvh, t, hd), &dev)?;
        let scale = 1.0 / (hd as f32).sqrt();
        let p = with_values(&q.matmul(&k.t()?)?, |s| kernels::softmax_rows(s, t, scale, true))??;
        let p = Tensor::from_vec(p, (n, kvh, gt, t), &dev)?;
        let y = cpu(with_values(&p.matmul(&v)?, |y| from_heads(y, dm, dm.h, None))?, dm.rows, dm.d)?;
        let input = x.to_vec();
        add_tensor(x, &linear(&y, &b.o)?)?;
        let m = rms_norm(x, &b.mlp_norm, eps, dm)?;
        let (gate, up) = (linear(&m, &b.gate)?, linear(&m, &b.up)?);
        let s = with_values(&gate, |g| with_values(&up, |u| kernels::swiglu_rows(g, u)))???;
        let s = cpu(s, dm.rows, dm.ff)?;
        let x1 = x.to_vec();
        add_tensor(x, &linear(&s, &b.down)?)?;
        Ok(Saved { x: input, x1, a, q, k, v, p, y, m, gate, up, s })
    }

    /// One block backwards: `dx` goes from the gradient at the block's
    /// output to the one at its input; the block's weights' gradients go
    /// into `grads`.
    #[allow(clippy::too_many_arguments)]
    fn block_backward(
        &self,
        i: usize,
        b: &Block,
        s: Saved,
        dx: &mut [f32],
        grads: &mut Grads,
        dm: Dims,
        rot: &Rotary,
    ) -> Result<()> {
        let (n, t, hd, kvh, gt) = (dm.n, dm.t, dm.hd, dm.kvh, dm.group() * dm.t);
        let eps = self.size.norm_eps.0 as f32;
        let dev = Device::Cpu;
        let name = |what: &str| format!("model.layers.{i}.{what}");

        // The MLP.
        let g = cpu(dx.to_vec(), dm.rows, dm.d)?;
        grads.put_tensor(&name("mlp.down_proj"), "weight", &g.t()?.matmul(&s.s)?)?;
        let ds = g.matmul(&b.down)?;
        let (mut dgate, mut dup) = (vec![0f32; dm.rows * dm.ff], vec![0f32; dm.rows * dm.ff]);
        with_values(&s.gate, |a| {
            with_values(&s.up, |u| with_values(&ds, |g| kernels::swiglu_grad_into(a, u, g, &mut dgate, &mut dup)))
        })????;
        let (dgate, dup) = (cpu(dgate, dm.rows, dm.ff)?, cpu(dup, dm.rows, dm.ff)?);
        grads.put_tensor(&name("mlp.gate_proj"), "weight", &dgate.t()?.matmul(&s.m)?)?;
        grads.put_tensor(&name("mlp.up_proj"), "weight", &dup.t()?.matmul(&s.m)?)?;
        let mut dm_in = values(&dgate.matmul(&b.gate)?)?;
        add_tensor(&mut dm_in, &dup.matmul(&b.up)?)?;
        let dm_in = cpu(dm_in, dm.rows, dm.d)?;
        rms_norm_back(&s.x1, &b.mlp_norm, &dm_in, eps, dx, grads, &name("post_attention_layernorm"))?;

        // The attention.
        let g = cpu(dx.to_vec(), dm.rows, dm.d)?;
        grads.put_tensor(&name("self_attn.o_proj"), "weight", &g.t()?.matmul(&s.y)?)?;
        let dy = with_values(&g.matmul(&b.o)?, |v| to_heads(v, dm, dm.h, None))?;
        let dy = Tensor::from_vec(dy, (n, kvh, gt, hd), &dev)?;
        let dp = dy.matmul(&s.v.t()?)?;
        let dv = s.p.t()?.matmul(&dy)?;
        let scale = 1.0 / (hd as f32).sqrt();
        let dscores = with_values(&s.p, |p| with_values(&dp, |g| kernels::softmax_grad_rows(p, g, t, scale)))???;
        let dscores = Tensor::from_vec(dscores, (n, kvh, gt, t), &dev)?;
        let back = |m: &Tensor, count: usize, rot: Option<(&Rotary, f32)>| -> Result<Tensor> {
            cpu(with_values(m, |m| from_heads(m, dm, count, rot))?, dm.rows, count * hd)
        };
        let dq = back(&dscores.matmul(&s.k)?, dm.h, Some((rot, -1.0)))?;
        let dk = back(&dscores.t()?.matmul(&s.q)?, kvh, Some((rot, -1.0)))?;
        let dv = back(&dv, kvh, None)?;
        for (d, what) in [(&dq, "q_proj"), (&dk, "k_proj"), (&dv, "v_proj")] {
            grads.put_tensor(&name(&format!("self_attn.{what}")), "weight", &d.t()?.matmul(&s.a)?)?;
        }
        let mut da = values(&dq.matmul(&b.q)?)?;
        add_tensor(&mut da, &dk.matmul(&b.k)?)?;
        add_tensor(&mut da, &dv.matmul(&b.v)?)?;
        let da = cpu(da, dm.rows, dm.d)?;
        rms_norm_back(&s.x, &b.attn_norm, &da, eps, dx, grads, &name("input_layernorm"))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use crate::data::ImageShape;
    use crate::llama::LlamaSize;
    use crate::model::{ArchKind, Model, ModelConfig, TrainableModel};
    use crate::rng::DetRng;

    /// The hand-written step gives candle's graph's loss and gradients
    /// (the graph runs the same row kernels, so they agree to rounding):
    /// tied and untied heads, multi-head, grouped and single key/value
    /// heads, one window and several.
    #[test]
    fn the_hand_written_step_gives_the_graphs_loss_and_gradients() -> crate::Result<()> {
        let dev = Device::Cpu;
        for (tie, heads, kv_heads, context, batch) in
            [(true, 4, 2, 6, 3), (false, 4, 4, 5, 2), (true, 4, 1, 8, 1), (false, 2, 1, 7, 4)]
        {
            let size = LlamaSize { layers: 2, heads, kv_heads, width: 16, ff: 24, tie, ..LlamaSize::default() };
            let shape = ImageShape { channels: 1, height: 1, width: context + 1 };
            let model = Model::new(ModelConfig::new(ArchKind::Llama, shape, 64).with_llama_size(size), 7, &dev)?;
            // Larger weights than the init, so that every path carries signal.
            let mut rng = DetRng::new(3);
            let params: Vec<f32> = model.parameters()?.iter().map(|p| p + rng.uniform(-0.2, 0.2)).collect();
            model.set_parameters(&params)?;
            let tokens: Vec<f32> = (0..batch * (context + 1)).map(|_| rng.below(64) as f32).collect();
            let x = Tensor::from_vec(tokens, (batch, 1, 1, context + 1), &dev)?;
            let y = Tensor::zeros(batch, DType::U32, &dev)?;
            let (loss, store) = model.backward(&x, &y)?;
            let graph = model.layout().flatten_grads(model.varmap(), &store)?;
            let out = model.gradients(&x, &y)?;
            let case = format!("tie {tie}, heads {heads}/{kv_heads}, context {context}, batch {batch}");
            assert!((out.loss - loss).abs() <= 1e-5 * loss.abs().max(1.0), "{case}: loss {} vs {loss}", out.loss);
            assert_eq!(out.samples, batch, "{case}");
            let scale = graph.iter().fold(0f32, |m, g| m.max(g.abs()));
            assert!(scale > 0.0, "{case}: no gradient at all");
            for entry in model.layout().entries() {
                let range = entry.offset..entry.offset + entry.len;
                let worst =
                    out.grads[range.clone()].iter().zip(&graph[range]).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(worst <= 1e-5 * scale.max(1.0), "{case} {}: off by {worst}", entry.name);
            }
        }
        Ok(())
    }

    /// A token outside the vocabulary and an empty batch are errors, not
    /// panics.
    #[test]
    fn bad_batches_are_refused() -> crate::Result<()> {
        let dev = Device::Cpu;
        let size = LlamaSize { layers: 1, heads: 2, kv_heads: 1, width: 8, ff: 16, ..LlamaSize::default() };
        let shape = ImageShape { channels: 1, height: 1, width: 5 };
        let model = Model::new(ModelConfig::new(ArchKind::Llama, shape, 16).with_llama_size(size), 1, &dev)?;
        let x = Tensor::from_vec(vec![1f32, 2.0, 99.0, 3.0, 4.0], (1, 1, 1, 5), &dev)?;
        let err = model.gradients(&x, &Tensor::zeros(1, DType::U32, &dev)?).err().map(|e| e.to_string());
        assert!(err.as_deref().unwrap_or_default().contains("99"), "{err:?}");
        let empty = Tensor::zeros((0, 1, 1, 5), DType::F32, &dev)?;
        let err = model.gradients(&empty, &Tensor::zeros(0, DType::U32, &dev)?).err().map(|e| e.to_string());
        assert!(err.is_some(), "an empty batch gave gradients");
        Ok(())
    }
}
