//! Model configs, the two architectures, and [`TrainableModel`], the
//! interface the node drives without knowing which architecture it holds.

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Device, ModuleT, Tensor, D};
use candle_nn::{Conv2d, Conv2dConfig, Linear, VarBuilder, VarMap};

use crate::cpu_step::{CnnStep, ConvParams, CpuStep, Dense, LinearParams, MlpStep, Unfold};
use crate::data::{Dataset, ImageShape};
use crate::error::{ModelError, Result};
pub use crate::grads::{GradOutput, LayerFactors};
use crate::layout::ParamLayout;
use crate::llama::{Llama, LlamaSize};
use crate::precision::Precision;
use crate::rng::DetRng;

/// Which architecture.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Arch {
    /// Fully connected layers with ReLU; `hidden` lists the hidden widths.
    Mlp { hidden: Vec<usize> },
    /// LeNet-style: two conv+ReLU+max-pool blocks, then two linear layers.
    /// 5x5 kernels for inputs of 16 pixels or more, 3x3 below.
    Cnn { conv1: usize, conv2: usize, fc: usize },
    /// A Llama-architecture transformer over `classes` tokens (see
    /// [`crate::llama`]); the input is a window of `context + 1` tokens.
    Llama { size: LlamaSize, context: usize },
}

/// Architecture names accepted on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ArchKind {
    #[default]
    Mlp,
    Cnn,
    Llama,
}

impl FromStr for ArchKind {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "mlp" => Ok(ArchKind::Mlp),
            "cnn" => Ok(ArchKind::Cnn),
            "llama" => Ok(ArchKind::Llama),
            "gpt" => Err(ModelError::Config(
                "model `gpt` is gone: the language model is `llama` (over bytes when no tokenizer is given)".into(),
            )),
            other => Err(ModelError::Config(format!("unknown model `{other}`: expected mlp, cnn or llama"))),
        }
    }
}

impl ArchKind {
    /// A language model trains on text and nothing else does.
    pub fn check_dataset(&self, data: &crate::data::DatasetKind) -> Result<()> {
        match (self, data.context()) {
            (ArchKind::Llama, None) => {
                Err(ModelError::Config(format!("model {self} is a language model: it trains on text:PATH, not {data}")))
            }
            (ArchKind::Mlp | ArchKind::Cnn, Some(_)) => {
                Err(ModelError::Config(format!("{data} is text: it needs a language model (llama), not {self}")))
            }
            _ => Ok(()),
        }
    }
}

impl fmt::Display for ArchKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ArchKind::Mlp => "mlp",
            ArchKind::Cnn => "cnn",
            ArchKind::Llama => "llama",
        })
    }
}

/// Everything needed to rebuild a model's shape: stored in checkpoints and
/// compared between peers.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ModelConfig {
    pub arch: Arch,
    pub input: ImageShape,
    pub classes: usize,
}

impl ModelConfig {
    /// The default config of an architecture for a given input. A Llama
    /// reads windows of `input.width` tokens: a context one shorter.
    pub fn new(kind: ArchKind, input: ImageShape, classes: usize) -> Self {
        let arch = match kind {
            ArchKind::Mlp => Arch::Mlp { hidden: vec![256, 128] },
            ArchKind::Cnn => Arch::Cnn { conv1: 16, conv2: 32, fc: 128 },
            ArchKind::Llama => Arch::Llama { size: LlamaSize::default(), context: input.width.saturating_sub(1) },
        };
        Self { arch, input, classes }
    }

    /// This config with a Llama's size replaced (no change for other
    /// architectures).
    pub fn with_llama_size(mut self, size: LlamaSize) -> Self {
        if let Arch::Llama { context, .. } = self.arch {
            self.arch = Arch::Llama { size, context };
        }
        self
    }

    /// Whether this is a language model (its evaluations carry bits per byte).
    pub fn is_language_model(&self) -> bool {
        matches!(self.arch, Arch::Llama { .. })
    }

    /// This Llama config reading `context` tokens (its weights do not depend
    /// on the context: rotary embeddings have no table to outgrow); `None`
    /// for other architectures.
    pub fn with_context(&self, context: usize) -> Option<Self> {
        let Arch::Llama { size, .. } = self.arch else { return None };
        Some(Self {
            arch: Arch::Llama { size, context },
            input: ImageShape { channels: 1, height: 1, width: context + 1 },
            classes: self.classes,
        })
    }

    /// A language model's context (the tokens it reads); `None` otherwise.
    pub fn context(&self) -> Option<usize> {
        match self.arch {
            Arch::Llama { context, .. } => Some(context),
            _ => None,
        }
    }

    /// The default config for a dataset.
    pub fn for_dataset(kind: ArchKind, data: &Dataset) -> Self {
        Self::new(kind, data.shape, data.classes)
    }

    pub fn validate(&self) -> Result<()> {
        if self.input.is_empty() {
            return Err(ModelError::Config(format!("input shape {:?} is empty", self.input)));
        }
        if self.classes < 2 {
            return Err(ModelError::Config(format!("{} classes; need at least 2", self.classes)));
        }
        match &self.arch {
            Arch::Mlp { hidden } => {
                if hidden.contains(&0) {
                    return Err(ModelError::Config(format!("MLP hidden widths {hidden:?} contain 0")));
                }
            }
            Arch::Cnn { conv1, conv2, fc } => {
                if *conv1 == 0 || *conv2 == 0 || *fc == 0 {
                    return Err(ModelError::Config("CNN widths must be positive".into()));
                }
                let ImageShape { height, width, .. } = self.input;
                if height < 4 || width < 4 || height % 4 != 0 || width % 4 != 0 {
                    return Err(ModelError::Config(format!(
                        "CNN needs height and width divisible by 4 (two 2x2 pools); got {height}x{width}"
                    )));
                }
            }
            Arch::Llama { size, context } => {
                let context = *context;
                size.validate(context)?;
                let expected = ImageShape { channels: 1, height: 1, width: context + 1 };
                if self.input != expected {
                    return Err(ModelError::Config(format!(
                        "a language model with context {context} reads text windows of {} tokens, not {}x{}x{} images (train it on text:PATH)",
                        context + 1,
                        self.input.channels,
                        self.input.height,
                        self.input.width
                    )));
                }
            }
        }
        Ok(())
    }

    /// Multiply-adds in one sample's forward pass through the matrix
    /// products (the convolutions as products; a Llama's attention over
    /// its whole context, masked half included): how much work a step has
    /// to share among threads.
    pub fn forward_macs(&self) -> u64 {
        let ImageShape { channels, height: h, width: w } = self.input;
        let macs = match &self.arch {
            Arch::Mlp { hidden } => {
                let mut widths = vec![self.input.len()];
                widths.extend(hidden);
                widths.push(self.classes);
                widths.windows(2).map(|p| p[0] * p[1]).sum()
            }
            Arch::Cnn { conv1, conv2, fc } => {
                let k = if h >= 16 { 5 } else { 3 };
                conv1 * channels * k * k * h * w
                    + conv2 * conv1 * k * k * (h / 2) * (w / 2)
                    + conv2 * (h / 4) * (w / 4) * fc
                    + fc * self.classes
            }
            Arch::Llama { size, context } => {
                let (d, kv) = (size.width, size.kv_heads * size.head_dim());
                let block = 2 * d * d + 2 * d * kv + 3 * d * size.ff + 2 * context * d;
                (size.layers * block + self.classes * d) * context
            }
        };
        macs as u64
    }

    /// A short human description, e.g. `mlp[64-128-64-10]`.
    pub fn describe(&self) -> String {
        match &self.arch {
            Arch::Mlp { hidden } => {
                let mut widths = vec![self.input.len()];
                widths.extend(hidden);
                widths.push(self.classes);
                let w: Vec<String> = widths.iter().map(|w| w.to_string()).collect();
                format!("mlp[{}]", w.join("-"))
            }
            Arch::Cnn { conv1, conv2, fc } => format!(
                "cnn[{}x{}x{} c{conv1} c{conv2} fc{fc} {}]",
                self.input.channels, self.input.height, self.input.width, self.classes
            ),
            Arch::Llama { size: s, context } => format!(
                "llama[l{} h{}/{} d{} ff{} ctx{context} vocab{}{}]",
                s.layers,
                s.heads,
                s.kv_heads,
                s.width,
                s.ff,
                self.classes,
                if s.tie { " tied" } else { "" }
            ),
        }
    }
}

/// Loss and accuracy on a data set. For a language model, `loss` is the
/// mean cross-entropy per token (nats), `accuracy` that of next-token
/// predictions, and `bits_per_byte` the loss in bits per byte of text.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Evaluation {
    pub loss: f32,
    pub accuracy: f32,
    pub samples: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bits_per_byte: Option<f32>,
}

impl Evaluation {
    /// The figure people read: `bits/byte 2.104` for a language model,
    /// `accuracy 93.45%` otherwise.
    pub fn headline(&self) -> String {
        match self.bits_per_byte {
            Some(bpb) => format!("bits/byte {bpb:.3}"),
            None => format!("accuracy {:.2}%", self.accuracy * 100.0),
        }
    }
}

/// What a node needs from a model. Parameters cross this boundary only as
/// flat vectors in [`ParamLayout`] order, so optimizers, shard owners and the
/// wire never see candle types.
pub trait TrainableModel: Send {
    fn config(&self) -> &ModelConfig;
    fn layout(&self) -> &ParamLayout;
    fn device(&self) -> &Device;
    /// The variables, by name (for checkpoints).
    fn varmap(&self) -> &VarMap;
    /// The dtype of the matrix products ([`Precision`]).
    fn precision(&self) -> Precision;
    /// Compute the matrix products in `precision` from now on; the
    /// parameters stay f32.
    fn set_precision(&mut self, precision: Precision);
    /// Logits `[n, classes]` for images `[n, c, h, w]`.
    fn forward(&self, images: &Tensor, train: bool) -> Result<Tensor>;
    /// Forward and backward on one batch; gradients of the mean loss.
    fn gradients(&self, images: &Tensor, labels: &Tensor) -> Result<GradOutput> {
        let (loss, store) = self.backward(images, labels)?;
        let grads = self.layout().flatten_grads(self.varmap(), &store)?;
        Ok(GradOutput { loss, samples: images.dim(0)?, grads, factors: Vec::new() })
    }
    /// [`Self::gradients`], with the fully connected layers' weight
    /// gradients also given as their factors. Models without such layers
    /// give none.
    fn gradients_factored(&self, images: &Tensor, labels: &Tensor) -> Result<GradOutput> {
        self.gradients(images, labels)
    }
    /// Forward and backward on one batch, the gradients left on the
    /// model's device: the mean loss and candle's gradient store.
    fn backward(&self, images: &Tensor, labels: &Tensor) -> Result<(f32, candle_core::backprop::GradStore)> {
        let (logits, targets) = self.logits_and_targets(images, labels, true)?;
        let loss = crate::kernels::cross_entropy(&logits, &targets)?;
        let store = loss.backward()?;
        Ok((loss.to_scalar::<f32>()?, store))
    }
    /// Logits `[m, classes]` and targets `[m]` of a batch: a classifier's
    /// logits and labels, or a language model's predictions at every
    /// position of every window and the tokens that follow.
    fn logits_and_targets(&self, images: &Tensor, labels: &Tensor, train: bool) -> Result<(Tensor, Tensor)> {
        Ok((self.forward(images, train)?, labels.clone()))
    }
    /// The current parameters, flattened.
    fn parameters(&self) -> Result<Vec<f32>> {
        self.layout().flatten_vars(self.varmap())
    }
    /// Overwrite the parameters from a flat vector.
    fn set_parameters(&self, flat: &[f32]) -> Result<()> {
        self.layout().write_vars(self.varmap(), flat)
    }
    /// Mean loss and accuracy over a data set, in batches of `batch_size`.
    fn evaluate(&self, data: &Dataset, batch_size: usize) -> Result<Evaluation> {
        let mut loss_sum = 0.0f64;
        let mut correct = 0usize;
        let mut predictions = 0usize;
        // A language model's logits are windows x context x vocabulary:
        // at most about 4M values (16 MB) a batch, whatever was asked.
        let per_sample = self.config().context().unwrap_or(1) * self.config().classes;
        let bs = batch_size.min((EVAL_LOGITS / per_sample.max(1)).max(1)).max(1);
        for start in (0..data.len()).step_by(bs) {
            let chunk: Vec<usize> = (start..(start + bs).min(data.len())).collect();
            let (x, y) = data.batch(&chunk, self.device())?;
            let (logits, y) = self.logits_and_targets(&x, &y, false)?;
            let m = y.dim(0)?;
            let loss = crate::kernels::cross_entropy(&logits, &y)?.to_scalar::<f32>()?;
            loss_sum += loss as f64 * m as f64;
            predictions += m;
            let pred = logits.argmax(D::Minus1)?;
            correct += pred.eq(&y)?.to_dtype(DType::U32)?.sum_all()?.to_scalar::<u32>()? as usize;
        }
        let n = predictions.max(1);
        let loss = (loss_sum / n as f64) as f32;
        // Nats per token to bits per byte of text: a figure that compares
        // across tokenizers.
        let bits_per_byte = self
            .config()
            .is_language_model()
            .then(|| loss / std::f32::consts::LN_2 / data.bytes_per_token().max(f64::MIN_POSITIVE) as f32);
        Ok(Evaluation { loss, accuracy: correct as f32 / n as f32, samples: data.len(), bits_per_byte })
    }
}

/// The most logits an evaluation batch holds (see [`TrainableModel::evaluate`]).
const EVAL_LOGITS: usize = 1 << 22;

enum Net {
    Mlp(Vec<Linear>),
    Cnn { conv1: Conv, conv2: Conv, fc1: Linear, fc2: Linear },
    Llama(Llama),
}

/// A same-padded, stride-1 convolution computed on the CPU as an im2col
/// unfolding and one matrix product, so that its backward pass is two
/// matrix products and a fold. candle's own CPU convolution computes the
/// input's gradient with a direct transposed convolution, which made the
/// CNN's step about 10x slower than PyTorch's (issue 14). Other devices use
/// candle's convolution. The variables are candle's `Conv2d` ones (`weight`
/// `[out, in, k, k]`, `bias` `[out]`), so model files and checkpoints are
/// unchanged.
struct Conv {
    conv: Conv2d,
    k: usize,
}

/// candle's op for [`Unfold`] of a `[b, c, h, w]` input; its backward is
/// the fold.
#[derive(Debug, Clone, Copy)]
struct Im2Col(Unfold);

/// The adjoint of [`Im2Col`].
#[derive(Debug, Clone, Copy)]
struct Col2Im(Unfold);

impl candle_core::CustomOp1 for Im2Col {
    fn name(&self) -> &'static str {
        "im2col"
    }

    fn cpu_fwd(
        &self,
        storage: &candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let out = self.0.unfold(crate::kernels::contiguous(storage, layout)?);
        Ok((candle_core::CpuStorage::F32(out), (self.0.rows(), self.0.cols()).into()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad_res.contiguous()?.apply_op1_no_bwd(&Col2Im(self.0))?))
    }
}

impl candle_core::CustomOp1 for Col2Im {
    fn name(&self) -> &'static str {
        "col2im"
    }

    fn cpu_fwd(
        &self,
        storage: &candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let out = self.0.fold(crate::kernels::contiguous(storage, layout)?);
        Ok((candle_core::CpuStorage::F32(out), self.0.dims.into()))
    }
}

impl Conv {
    fn new(conv: Conv2d, k: usize) -> Self {
        Self { conv, k }
    }

    fn forward(&self, x: &Tensor, precision: Precision) -> Result<Tensor> {
        if !x.device().is_cpu() || x.dtype() != DType::F32 {
            let Some(low) = precision.narrow(x.dtype()) else { return Ok(self.conv.forward_t(x, true)?) };
            // candle's convolution in bf16 (cuDNN's on a GPU).
            let cfg = self.conv.config();
            let w = self.conv.weight().to_dtype(low)?;
            let y =
                x.to_dtype(low)?.conv2d(&w, cfg.padding, cfg.stride, cfg.dilation, cfg.groups)?.to_dtype(x.dtype())?;
            return Ok(match self.conv.bias() {
                Some(b) => y.broadcast_add(&b.reshape((1, b.dim(0)?, 1, 1))?)?,
                None => y,
            });
        }
        let (b, c, h, w) = x.dims4()?;
        let kk = self.k * self.k;
        let cols = x.contiguous()?.apply_op1(Im2Col(Unfold { k: self.k, dims: (b, c, h, w), channel_major: false }))?;
        let weight = self.conv.weight();
        let out_c = weight.dim(0)?;
        // [out, c*k*k] x [c*k*k, b*h*w]: one product for the whole batch.
        let y = precision.matmul(&weight.reshape((out_c, c * kk))?, &cols)?;
        let y = match self.conv.bias() {
            Some(bias) => y.broadcast_add(&bias.reshape((out_c, 1))?)?,
            None => y,
        };
        Ok(y.reshape((out_c, b, h, w))?.transpose(0, 1)?.contiguous()?)
    }
}

/// 2x2 max pooling, stride 2, as two maxima over a view: candle 0.11's
/// `max_pool2d` scales its gradient by the share of the window that holds
/// the maximum (1/4 for a single one), which trained each convolution
/// under a pool with 4x too small a gradient (16x for the first); the
/// maximum's backward passes the whole gradient to the winner. Outside
/// training, candle's faster op: the values are the same.
fn max_pool2(x: &Tensor, train: bool) -> Result<Tensor> {
    if !train {
        return Ok(x.max_pool2d(2)?);
    }
    let (b, c, h, w) = x.dims4()?;
    let x = x.narrow(2, 0, h / 2 * 2)?.narrow(3, 0, w / 2 * 2)?.contiguous()?;
    Ok(x.reshape((b, c, h / 2, 2, w / 2, 2))?.max(5)?.max(3)?)
}

/// A fully connected layer seen during a factored backward pass: its
/// weight's name, its input, and a zero variable added to its output
/// whose gradient is the output's (candle keeps gradients of variables
/// only).
struct Tap {
    weight: String,
    input: Tensor,
    probe: candle_core::Var,
}

/// `layer(x)`, recorded in `taps` when there are taps.
fn linear(
    layer: &Linear,
    name: &str,
    x: &Tensor,
    precision: Precision,
    taps: &mut Option<&mut Vec<Tap>>,
) -> Result<Tensor> {
    // candle's `Linear::forward` on a batch of rows, with the product in `precision`.
    let y = precision.matmul(x, &layer.weight().t()?)?;
    let y = match layer.bias() {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    let Some(taps) = taps.as_mut() else { return Ok(y) };
    let probe = candle_core::Var::zeros(y.shape(), y.dtype(), y.device())?;
    let y = (y + probe.as_tensor())?;
    taps.push(Tap { weight: format!("{name}.weight"), input: x.clone(), probe });
    Ok(y)
}

/// The concrete model behind [`TrainableModel`] for both architectures.
pub struct Model {
    config: ModelConfig,
    varmap: VarMap,
    layout: ParamLayout,
    device: Device,
    net: Net,
    /// The matrix products' dtype ([`Precision`]).
    precision: Precision,
    /// A gradient buffer its user is done with, for the next step's
    /// gradients on the CPU ([`Model::recycle_gradients`]).
    spare_grads: std::sync::Mutex<Option<Vec<f32>>>,
}

impl fmt::Debug for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Model")
            .field("config", &self.config.describe())
            .field("params", &self.layout.total_len())
            .field("device", &self.device)
            .finish()
    }
}

impl Model {
    /// Build a model with weights initialised deterministically from `seed`:
    /// the same seed gives bit-identical weights on every peer.
    pub fn new(config: ModelConfig, seed: u64, device: &Device) -> Result<Self> {
        config.validate()?;
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, device);
        let net = match &config.arch {
            Arch::Mlp { hidden } => {
                let mut widths = vec![config.input.len()];
                widths.extend(hidden);
                widths.push(config.classes);
                let layers = widths
                    .windows(2)
                    .enumerate()
                    .map(|(i, w)| candle_nn::linear(w[0], w[1], vb.pp(format!("fc{i}"))))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Net::Mlp(layers)
            }
            Arch::Cnn { conv1, conv2, fc } => {
                let k = if config.input.height >= 16 { 5 } else { 3 };
                let cfg = Conv2dConfig { padding: k / 2, ..Default::default() };
                let flat = conv2 * (config.input.height / 4) * (config.input.width / 4);
                let ch = config.input.channels;
                Net::Cnn {
                    conv1: Conv::new(candle_nn::conv2d(ch, *conv1, k, cfg, vb.pp("conv1"))?, k),
                    conv2: Conv::new(candle_nn::conv2d(*conv1, *conv2, k, cfg, vb.pp("conv2"))?, k),
                    fc1: candle_nn::linear(flat, *fc, vb.pp("fc1"))?,
                    fc2: candle_nn::linear(*fc, config.classes, vb.pp("fc2"))?,
                }
            }
            Arch::Llama { size, context } => Net::Llama(Llama::new(*size, *context, config.classes, vb, device)?),
        };
        let layout = ParamLayout::from_varmap(&varmap)?;
        match &config.arch {
            Arch::Llama { size, .. } => crate::llama::init(&varmap, &layout, size.layers, seed, device)?,
            _ => init_params(&varmap, &layout, seed, device)?,
        }
        Ok(Self {
            config,
            varmap,
            layout,
            device: device.clone(),
            net,
            precision: Precision::F32,
            spare_grads: Default::default(),
        })
    }

    /// Continue `prompt` (token ids of a tokenizer with the model's
    /// vocabulary) by `tokens` sampled ids; a Llama only.
    pub fn generate_tokens(&self, prompt: &[u32], tokens: usize, temperature: f64, seed: u64) -> Result<Vec<u32>> {
        match &self.net {
            Net::Llama(l) => {
                if prompt.is_empty() {
                    return Err(ModelError::Invalid("generating needs at least one prompt token".into()));
                }
                l.generate(prompt, tokens, temperature, seed)
            }
            _ => {
                Err(ModelError::Invalid(format!("{} does not generate from a tokenizer's ids", self.config.describe())))
            }
        }
    }

    /// Continue `prompt` by `tokens` bytes sampled at `temperature`: a
    /// Llama over bytes (see [`crate::llama`]); an error for other models.
    pub fn generate(&self, prompt: &[u8], tokens: usize, temperature: f64, seed: u64) -> Result<Vec<u8>> {
        match &self.net {
            Net::Llama(l) => {
                if self.config.classes > 256 {
                    return Err(ModelError::Invalid(format!(
                        "a vocabulary of {} tokens is not bytes: generating text needs its tokenizer",
                        self.config.classes
                    )));
                }
                // Bytes are the tokens; an empty prompt starts from a newline.
                let ids: Vec<u32> =
                    if prompt.is_empty() { vec![b'\n' as u32] } else { prompt.iter().map(|&b| b as u32).collect() };
                let out = l.generate(&ids, tokens, temperature, seed)?;
                Ok(out.into_iter().map(|t| t as u8).collect())
            }
            _ => Err(ModelError::Invalid(format!("{} is not a language model", self.config.describe()))),
        }
    }

    /// The forward pass; with `taps`, each fully connected layer is
    /// recorded for [`TrainableModel::gradients_factored`].
    fn forward_tapped(&self, images: &Tensor, train: bool, mut taps: Option<&mut Vec<Tap>>) -> Result<Tensor> {
        Ok(match &self.net {
            Net::Mlp(layers) => {
                let mut x = images.flatten_from(1)?;
                for (i, layer) in layers.iter().enumerate() {
                    x = linear(layer, &format!("fc{i}"), &x, self.precision, &mut taps)?;
                    if i + 1 < layers.len() {
                        x = x.relu()?;
                    }
                }
                x
            }
            Net::Cnn { conv1, conv2, fc1, fc2 } => {
                let p = self.precision;
                let x = max_pool2(&conv1.forward(images, p)?.relu()?, train)?;
                let x = max_pool2(&conv2.forward(&x, p)?.relu()?, train)?;
                let x = linear(fc1, "fc1", &x.flatten_from(1)?, p, &mut taps)?.relu()?;
                linear(fc2, "fc2", &x, p, &mut taps)?
            }
            // Windows in, logits at every position of the context out.
            Net::Llama(l) => l.logits(&l.inputs_and_targets(images)?.0)?,
        })
    }

    /// The hand-written step ([`crate::cpu_step`]) of an MLP or a CNN with
    /// biases, or a Llama's ([`crate::llama`]), on the CPU in f32; `None`
    /// otherwise (candle's graph).
    fn cpu_step<'a>(&'a self, images: &Tensor) -> Option<CpuStep<'a>> {
        if !images.device().is_cpu() || images.dtype() != DType::F32 || self.precision != Precision::F32 {
            return None;
        }
        let linear = |name: String, l: &'a Linear| Some(LinearParams { name, weight: l.weight(), bias: l.bias()? });
        Some(match &self.net {
            Net::Mlp(layers) => {
                let layers =
                    layers.iter().enumerate().map(|(i, l)| linear(format!("fc{i}"), l)).collect::<Option<_>>()?;
                CpuStep::Mlp(MlpStep { dense: Dense { layers }, layout: &self.layout })
            }
            Net::Cnn { conv1, conv2, fc1, fc2 } => {
                let conv = |name, c: &'a Conv| {
                    Some(ConvParams { name, weight: c.conv.weight(), bias: c.conv.bias()?, k: c.k })
                };
                CpuStep::Cnn(CnnStep {
                    conv: [conv("conv1", conv1)?, conv("conv2", conv2)?],
                    fc: Dense { layers: vec![linear("fc1".into(), fc1)?, linear("fc2".into(), fc2)?] },
                    layout: &self.layout,
                })
            }
            Net::Llama(l) if l.is_f32() => CpuStep::Llama(l, &self.layout),
            Net::Llama(_) => return None,
        })
    }

    /// The Llama network; `None` for other architectures.
    #[cfg(test)]
    pub(crate) fn llama(&self) -> Option<&Llama> {
        match &self.net {
            Net::Llama(l) => Some(l),
            _ => None,
        }
    }

    /// Boxed, for callers that only want the trait.
    pub fn boxed(config: ModelConfig, seed: u64, device: &Device) -> Result<Box<dyn TrainableModel>> {
        Ok(Box::new(Self::new(config, seed, device)?))
    }
}

/// PyTorch's default init for linear and conv layers: U(-b, b) with
/// b = 1/sqrt(fan_in), for weights and biases alike. Each tensor gets its own
/// stream derived from (seed, name), so init does not depend on build order.
fn init_params(varmap: &VarMap, layout: &ParamLayout, seed: u64, device: &Device) -> Result<()> {
    let data = varmap.data().lock().map_err(|_| ModelError::Invalid("variable map lock poisoned".into()))?;
    for entry in layout.entries() {
        let fan_in = if let Some(prefix) = entry.name.strip_suffix(".bias") {
            layout
                .entry(&format!("{prefix}.weight"))
                .map(|w| w.len / w.shape.first().copied().unwrap_or(1).max(1))
                .unwrap_or(entry.len)
        } else {
            entry.len / entry.shape.first().copied().unwrap_or(1).max(1)
        };
        let bound = 1.0 / (fan_in.max(1) as f32).sqrt();
        let mut rng = DetRng::derive(seed, &entry.name);
        let values: Vec<f32> = (0..entry.len).map(|_| rng.uniform(-bound, bound)).collect();
        let t = Tensor::from_vec(values, entry.shape.as_slice(), device)?;
        let var =
            data.get(&entry.name).ok_or_else(|| ModelError::Invalid(format!("variable {} vanished", entry.name)))?;
        var.set(&t)?;
    }
    Ok(())
}

impl TrainableModel for Model {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn varmap(&self) -> &VarMap {
        &self.varmap
    }

    fn precision(&self) -> Precision {
        self.precision
    }

    fn set_precision(&mut self, precision: Precision) {
        self.precision = precision;
        if let Net::Llama(l) = &mut self.net {
            l.precision = precision;
        }
    }

    fn forward(&self, images: &Tensor, train: bool) -> Result<Tensor> {
        self.forward_tapped(images, train, None)
    }

    fn gradients(&self, images: &Tensor, labels: &Tensor) -> Result<GradOutput> {
        if let Some(step) = self.cpu_step(images) {
            return step.gradients(images, labels, false, self.take_spare_grads());
        }
        let (loss, store) = self.backward(images, labels)?;
        let grads = self.layout.flatten_grads(&self.varmap, &store)?;
        Ok(GradOutput { loss, samples: images.dim(0)?, grads, factors: Vec::new() })
    }

    fn gradients_factored(&self, images: &Tensor, labels: &Tensor) -> Result<GradOutput> {
        if let Some(step) = self.cpu_step(images) {
            return step.gradients(images, labels, true, self.take_spare_grads());
        }
        if matches!(self.net, Net::Llama(_)) {
            return self.gradients(images, labels);
        }
        self.graph_gradients_factored(images, labels)
    }

    fn logits_and_targets(&self, images: &Tensor, labels: &Tensor, train: bool) -> Result<(Tensor, Tensor)> {
        match &self.net {
            Net::Llama(l) => flat_logits(l.inputs_and_targets(images)?, |x| l.logits(x)),
            _ => Ok((self.forward(images, train)?, labels.clone())),
        }
    }
}

/// A language model's logits at every position `[n * t, vocab]`, with the
/// targets of `split` (inputs, next tokens).
fn flat_logits(split: (Tensor, Tensor), logits: impl Fn(&Tensor) -> Result<Tensor>) -> Result<(Tensor, Tensor)> {
    let (inputs, targets) = split;
    let out = logits(&inputs)?;
    let (n, t, v) = out.dims3()?;
    Ok((out.reshape((n * t, v))?, targets))
}

impl Model {
    /// Hand back the flat gradients of an earlier step once they are used
    /// (pushed, applied): the next step's gradients on the CPU are written
    /// into that buffer instead of a fresh one. A fresh model-sized buffer
    /// costs its page faults every step, which for a 100 MB model is more
    /// than the copy into it. One buffer is kept, and only where the
    /// hand-written step will take it (on the CPU); one of another length,
    /// or for a model that computes its gradients through candle's graph
    /// (another device), is dropped.
    pub fn recycle_gradients(&self, grads: Vec<f32>) {
        let takes = self.device.is_cpu();
        if takes && grads.len() == self.layout.total_len() {
            if let Ok(mut spare) = self.spare_grads.lock() {
                *spare = Some(grads);
            }
        }
    }

    fn take_spare_grads(&self) -> Option<Vec<f32>> {
        self.spare_grads.lock().ok().and_then(|mut s| s.take())
    }

    /// [`TrainableModel::gradients_factored`] through candle's graph: each
    /// linear layer's output gets a zero probe whose gradient is the
    /// layer's delta. Devices other than the CPU take this path.
    fn graph_gradients_factored(&self, images: &Tensor, labels: &Tensor) -> Result<GradOutput> {
        let mut taps = Vec::new();
        let logits = self.forward_tapped(images, true, Some(&mut taps))?;
        let loss = crate::kernels::cross_entropy(&logits, labels)?;
        let store = loss.backward()?;
        let grads = self.layout.flatten_grads(&self.varmap, &store)?;
        let mut factors = Vec::with_capacity(taps.len());
        for tap in taps {
            let entry = self
                .layout
                .entry(&tap.weight)
                .ok_or_else(|| ModelError::Invalid(format!("no variable {}", tap.weight)))?;
            let delta = store
                .get(tap.probe.as_tensor())
                .ok_or_else(|| ModelError::Invalid(format!("no gradient reached {}", tap.weight)))?;
            let (rows, cols) = (delta.dim(1)?, tap.input.dim(1)?);
            if rows * cols != entry.len {
                return Err(ModelError::Invalid(format!(
                    "{} has {} values, not {rows} x {cols}",
                    tap.weight, entry.len
                )));
            }
            factors.push(LayerFactors {
                offset: entry.offset,
                rows,
                cols,
                delta: delta.flatten_all()?.to_vec1::<f32>()?,
                input: tap.input.flatten_all()?.to_vec1::<f32>()?,
            });
        }
        Ok(GradOutput { loss: loss.to_scalar::<f32>()?, samples: images.dim(0)?, grads, factors })
    }
}

/// Checks shared by the language models' tests.
#[cfg(test)]
pub(crate) mod testing {
    use super::{Model, TrainableModel};
    use crate::rng::DetRng;
    use candle_core::{DType, Device, Tensor};

    /// Every parameter's analytic gradient (fused kernels and all) agrees
    /// with a central finite difference of the loss, in f64 arithmetic of
    /// the f32 loss, on three windows of `context + 1` tokens below
    /// `vocab`: three elements of every tensor, each within 5%. Returns
    /// the worst relative error.
    pub(crate) fn lm_gradients_match_finite_differences(
        model: &Model,
        vocab: usize,
        context: usize,
        what: &str,
    ) -> crate::Result<f64> {
        // Larger weights than the init, so that every path carries signal.
        let mut rng = DetRng::new(5);
        let params: Vec<f32> = model.parameters()?.iter().map(|p| p + rng.uniform(-0.3, 0.3)).collect();
        model.set_parameters(&params)?;
        let tokens: Vec<f32> = (0..3 * (context + 1)).map(|i| ((i * 37 + 11) % vocab) as f32).collect();
        let x = Tensor::from_vec(tokens, (3, 1, 1, context + 1), &Device::Cpu)?;
        let y = Tensor::zeros(3, DType::U32, &Device::Cpu)?;
        let analytic = model.gradients(&x, &y)?.grads;
        let loss_at = |p: &[f32]| -> crate::Result<f64> {
            model.set_parameters(p)?;
            Ok(model.gradients(&x, &y)?.loss as f64)
        };
        let mut worst = 0f64;
        for entry in model.layout().entries() {
            for k in 0..3 {
                let i = entry.offset + (k * 7919) % entry.len;
                let h = 1e-2f32;
                let mut p = params.clone();
                p[i] += h;
                let up = loss_at(&p)?;
                p[i] -= 2.0 * h;
                let down = loss_at(&p)?;
                let numeric = (up - down) / (2.0 * h as f64);
                let err = (numeric - analytic[i] as f64).abs() / (numeric.abs() + analytic[i].abs() as f64 + 1e-2);
                worst = worst.max(err);
                assert!(
                    err < 0.05,
                    "{what}: {}[{}]: analytic {} vs numeric {numeric}",
                    entry.name,
                    i - entry.offset,
                    analytic[i]
                );
            }
        }
        eprintln!("{what}: worst relative gradient error {worst:.4}");
        Ok(worst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digits_shape() -> ImageShape {
        ImageShape { channels: 1, height: 8, width: 8 }
    }

    /// The forward pass's multiply-adds: the MLP's and the CNN's are their
    /// weights' (times the output pixels of a convolution), and the
    /// built-in image sets' shapes are known before loading.
    #[test]
    fn forward_work_is_counted_from_the_config() -> Result<()> {
        let digits = crate::data::load(&crate::DatasetKind::Digits, None)?;
        assert_eq!(crate::DatasetKind::Digits.image_shape(), Some((digits.train.shape, digits.train.classes)));
        let (fashion, classes) = crate::DatasetKind::FashionMnist.image_shape().unwrap_or((digits_shape(), 0));
        let mlp = ModelConfig::new(ArchKind::Mlp, fashion, classes);
        let weights: usize = Model::new(mlp.clone(), 1, &Device::Cpu)?
            .layout()
            .entries()
            .iter()
            .filter(|e| e.name.ends_with("weight"))
            .map(|e| e.len)
            .sum();
        assert_eq!(mlp.forward_macs(), weights as u64);
        assert_eq!(mlp.forward_macs(), 784 * 256 + 256 * 128 + 128 * 10);
        // 5x5 convolutions of 1 -> 16 channels on 28x28, 16 -> 32 on 14x14,
        // then 32 * 7 * 7 -> 128 -> 10.
        let cnn = ModelConfig::new(ArchKind::Cnn, fashion, classes);
        assert_eq!(cnn.forward_macs(), 16 * 25 * 784 + 32 * 16 * 25 * 196 + 1568 * 128 + 128 * 10);
        let text = crate::DatasetKind::Text { path: "t.txt".into(), context: 64 };
        assert_eq!(text.image_shape(), None);
        Ok(())
    }

    #[test]
    fn same_seed_same_weights_other_seed_other_weights() {
        let cfg = ModelConfig::new(ArchKind::Mlp, digits_shape(), 10);
        let a = Model::new(cfg.clone(), 1, &Device::Cpu).and_then(|m| m.parameters()).ok();
        let b = Model::new(cfg.clone(), 1, &Device::Cpu).and_then(|m| m.parameters()).ok();
        let c = Model::new(cfg, 2, &Device::Cpu).and_then(|m| m.parameters()).ok();
        assert!(a.is_some());
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    /// The im2col convolution equals candle's direct one, forward and in
    /// the gradients of its weight, bias and input.
    #[test]
    fn im2col_conv_matches_candle_conv2d() -> Result<()> {
        let dev = Device::Cpu;
        for (c_in, c_out, k, h, w) in [(1, 4, 5, 12, 12), (3, 2, 3, 8, 6)] {
            let varmap = VarMap::new();
            let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
            let cfg = Conv2dConfig { padding: k / 2, ..Default::default() };
            let conv = candle_nn::conv2d(c_in, c_out, k, cfg, vb.pp("c"))?;
            let ours = Conv::new(conv.clone(), k);
            let x = candle_core::Var::from_tensor(&Tensor::randn(0f32, 1.0, (2, c_in, h, w), &dev)?)?;
            let reference = conv.forward_t(x.as_tensor(), true)?;
            let got = ours.forward(x.as_tensor(), Precision::F32)?;
            assert_eq!(got.dims(), reference.dims());
            let diff = (&got - &reference)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-5, "forward differs by {diff}");
            // The same loss through both; every gradient must agree.
            let weights = Tensor::randn(0f32, 1.0, got.dims(), &dev)?;
            let g_ref = (reference * &weights)?.sum_all()?.backward()?;
            let g_got = (got * &weights)?.sum_all()?.backward()?;
            let bias = conv.bias().cloned().ok_or_else(|| ModelError::Invalid("bias".into()))?;
            for t in [conv.weight(), &bias, x.as_tensor()] {
                let (a, b) = (g_ref.get(t), g_got.get(t));
                let (Some(a), Some(b)) = (a, b) else { panic!("missing gradient") };
                let diff = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(diff < 1e-4, "gradient differs by {diff}");
            }
        }
        Ok(())
    }

    /// Sufficient factors: every fully connected layer's weight gradient
    /// rebuilt from its factors equals the full gradient within 1e-5, and
    /// taking them leaves the gradients as they were.
    #[test]
    fn factors_rebuild_the_fully_connected_weight_gradients() -> Result<()> {
        let dev = Device::Cpu;
        for (kind, shape, layers) in
            [(ArchKind::Mlp, digits_shape(), 3), (ArchKind::Cnn, ImageShape { channels: 1, height: 8, width: 8 }, 2)]
        {
            let model = Model::new(ModelConfig::new(kind, shape, 10), 7, &dev)?;
            let batch = 5;
            let x = Tensor::randn(0f32, 1.0, (batch, 1, 8, 8), &dev)?;
            let y = Tensor::new(&[0u32, 3, 9, 3, 1], &dev)?;
            let plain = model.gradients(&x, &y)?;
            let out = model.gradients_factored(&x, &y)?;
            assert_eq!(out.grads, plain.grads, "{kind}: the probes change nothing");
            assert_eq!(out.factors.len(), layers, "{kind}: one set of factors per linear layer");
            for f in &out.factors {
                assert_eq!((f.delta.len(), f.input.len()), (batch * f.rows, batch * f.cols));
                let mut worst = 0.0f32;
                for r in 0..f.rows {
                    for c in 0..f.cols {
                        let rebuilt: f32 = (0..batch).map(|b| f.delta[b * f.rows + r] * f.input[b * f.cols + c]).sum();
                        worst = worst.max((rebuilt - out.grads[f.offset + r * f.cols + c]).abs());
                    }
                }
                assert!(worst <= 1e-5, "{kind}: layer at {} rebuilt within {worst}", f.offset);
            }
        }
        Ok(())
    }

    /// The hand-written CPU steps ([`crate::cpu_step`]) give candle's
    /// graph's loss, gradients and factors: the MLP, and the CNN on 1 and
    /// 3 channels with both kernel sizes.
    #[test]
    fn hand_written_steps_match_the_graph() -> Result<()> {
        let dev = Device::Cpu;
        for (kind, channels, side, batch) in
            [(ArchKind::Mlp, 1, 8, 5), (ArchKind::Cnn, 1, 8, 5), (ArchKind::Cnn, 3, 8, 3), (ArchKind::Cnn, 1, 28, 4)]
        {
            let shape = ImageShape { channels, height: side, width: side };
            let model = Model::new(ModelConfig::new(kind, shape, 10), 11, &dev)?;
            let x = seeded_images(batch, channels, side, 5)?;
            let y = Tensor::from_vec((0..batch as u32).map(|i| (i * 7) % 10).collect::<Vec<_>>(), batch, &dev)?;
            let (loss, store) = model.backward(&x, &y)?;
            let graph = model.layout.flatten_grads(&model.varmap, &store)?;
            let out = model.gradients_factored(&x, &y)?;
            let case = format!("{kind} {side}x{side}x{channels}");
            assert!((out.loss - loss).abs() <= 1e-5, "{case}: loss {} vs {loss}", out.loss);
            assert_eq!(out.grads.len(), graph.len());
            let scale = graph.iter().fold(0f32, |m, g| m.max(g.abs()));
            for entry in model.layout.entries() {
                let range = entry.offset..entry.offset + entry.len;
                let worst =
                    out.grads[range.clone()].iter().zip(&graph[range]).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(worst <= 1e-5 * scale.max(1.0), "{case} {}: off by {worst}", entry.name);
            }
            assert_eq!(out.factors.len(), if kind == ArchKind::Mlp { 3 } else { 2 });
            assert_eq!(model.gradients(&x, &y)?.grads, out.grads, "factors change nothing");
            // The graph's probes (the path off the CPU) give the same factors.
            let probed = model.graph_gradients_factored(&x, &y)?;
            assert_eq!(probed.factors.len(), out.factors.len(), "{case}");
            for (p, f) in probed.factors.iter().zip(&out.factors) {
                assert_eq!((p.offset, p.rows, p.cols), (f.offset, f.rows, f.cols), "{case}");
                for (what, a, b) in [("delta", &p.delta, &f.delta), ("input", &p.input, &f.input)] {
                    let worst = a.iter().zip(b.iter()).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                    assert!(a.len() == b.len() && worst <= 1e-5, "{case}: {what} at {} off by {worst}", f.offset);
                }
            }
            let worst = probed.grads.iter().zip(&graph).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(worst <= 1e-6 * scale.max(1.0), "{case}: the probes change the gradients by {worst}");
        }
        Ok(())
    }

    /// The hand-written steps' gradients against central differences of
    /// their own loss, for an entry of every variable: pins the pooling's
    /// backward (candle 0.11's own `max_pool2d` gives a quarter of it)
    /// independently of candle; the graph is pinned through its equality
    /// with these steps.
    #[test]
    fn cpu_step_gradients_match_finite_differences() -> Result<()> {
        for kind in [ArchKind::Mlp, ArchKind::Cnn] {
            finite_differences(kind)?;
        }
        Ok(())
    }

    #[test]
    fn recycled_gradient_buffers_are_reused_zeroed_and_give_the_same_gradients() -> Result<()> {
        let dev = Device::Cpu;
        let mut cases = Vec::new();
        for kind in [ArchKind::Mlp, ArchKind::Cnn] {
            let shape = ImageShape { channels: 1, height: 8, width: 8 };
            let model = Model::new(ModelConfig::new(kind, shape, 10), 3, &dev)?;
            cases.push((kind, model, seeded_images(4, 1, 8, 9)?, Tensor::from_vec(vec![1u32, 4, 7, 9], 4, &dev)?));
        }
        // A Llama's hand-written step takes the buffer too.
        let size = LlamaSize { layers: 1, heads: 2, kv_heads: 1, width: 8, ff: 16, ..LlamaSize::default() };
        let llama = ModelConfig::new(ArchKind::Llama, ImageShape { channels: 1, height: 1, width: 9 }, 16)
            .with_llama_size(size);
        let windows: Vec<f32> = (0..2 * 9).map(|i| ((i * 5 + 3) % 16) as f32).collect();
        let windows = Tensor::from_vec(windows, (2, 1, 1, 9), &dev)?;
        cases.push((ArchKind::Llama, Model::new(llama, 3, &dev)?, windows, Tensor::zeros(2, DType::U32, &dev)?));
        for (kind, model, x, y) in cases {
            let fresh = model.gradients(&x, &y)?.grads;
            // A used buffer full of what must not leak into the next step.
            let spare = vec![f32::NAN; fresh.len()];
            let at = spare.as_ptr();
            model.recycle_gradients(spare);
            let out = model.gradients_factored(&x, &y)?;
            assert_eq!(out.grads.as_ptr(), at, "{kind}: the recycled buffer took the gradients");
            assert_eq!(out.grads, fresh, "{kind}");
            // Taken once: nothing is left for the step after.
            assert!(model.take_spare_grads().is_none(), "{kind}");
            // A buffer of another length is not kept.
            model.recycle_gradients(vec![0.0; 3]);
            assert!(model.take_spare_grads().is_none(), "{kind}");
            assert_eq!(model.gradients(&x, &y)?.grads, fresh, "{kind}");
        }
        Ok(())
    }

    /// `[batch, channels, side, side]` drawn from U(-1, 1), the same on every run.
    fn seeded_images(batch: usize, channels: usize, side: usize, seed: u64) -> Result<Tensor> {
        let mut rng = DetRng::new(seed);
        let values: Vec<f32> = (0..batch * channels * side * side).map(|_| rng.uniform(-1.0, 1.0)).collect();
        Ok(Tensor::from_vec(values, (batch, channels, side, side), &Device::Cpu)?)
    }

    fn finite_differences(kind: ArchKind) -> Result<()> {
        let dev = Device::Cpu;
        let shape = ImageShape { channels: 1, height: 8, width: 8 };
        let model = Model::new(ModelConfig::new(kind, shape, 10), 3, &dev)?;
        let x = seeded_images(6, 1, 8, 9)?;
        let y = Tensor::new(&[1u32, 4, 9, 0, 4, 7], &dev)?;
        let params = model.parameters()?;
        let analytic = model.gradients(&x, &y)?.grads;
        let loss_at = |p: &[f32]| -> Result<f64> {
            model.set_parameters(p)?;
            Ok(model.gradients(&x, &y)?.loss as f64)
        };
        let mut checked = 0;
        for entry in model.layout.entries() {
            // The entry with the largest gradient: well above f32's noise.
            let range = entry.offset..entry.offset + entry.len;
            let i =
                range.clone().max_by(|&a, &b| analytic[a].abs().total_cmp(&analytic[b].abs())).unwrap_or(entry.offset);
            let eps = 1e-3f32;
            let mut p = params.clone();
            p[i] += eps;
            let up = loss_at(&p)?;
            p[i] -= 2.0 * eps;
            let down = loss_at(&p)?;
            let numeric = (up - down) / (2.0 * eps as f64);
            let a = analytic[i] as f64;
            assert!(
                (numeric - a).abs() <= 0.05 * a.abs() + 1e-4,
                "{}[{}]: analytic {a}, numeric {numeric}",
                entry.name,
                i - entry.offset
            );
            checked += 1;
        }
        model.set_parameters(&params)?;
        assert_eq!(checked, model.layout.entries().len());
        Ok(())
    }

    /// Bad batches are errors on the hand-written path, not panics.
    #[test]
    fn cpu_step_refuses_bad_batches() -> Result<()> {
        let shape = ImageShape { channels: 1, height: 8, width: 8 };
        for kind in [ArchKind::Mlp, ArchKind::Cnn] {
            let model = Model::new(ModelConfig::new(kind, shape, 10), 1, &Device::Cpu)?;
            let empty = seeded_images(0, 1, 8, 1)?;
            assert!(model.gradients(&empty, &Tensor::new(&[] as &[u32], &Device::Cpu)?).is_err(), "{kind}: empty");
            let x = seeded_images(2, 1, 8, 1)?;
            assert!(model.gradients(&x, &Tensor::new(&[1u32, 10], &Device::Cpu)?).is_err(), "{kind}: label 10");
            assert!(model.gradients(&x, &Tensor::new(&[1u32], &Device::Cpu)?).is_err(), "{kind}: one label");
            let tiny = seeded_images(2, 1, 2, 1)?;
            assert!(model.gradients(&tiny, &Tensor::new(&[1u32, 2], &Device::Cpu)?).is_err(), "{kind}: 2x2");
        }
        Ok(())
    }

    #[test]
    fn cnn_runs_on_8x8_and_28x28() {
        for (h, w) in [(8, 8), (28, 28)] {
            let shape = ImageShape { channels: 1, height: h, width: w };
            let m = Model::new(ModelConfig::new(ArchKind::Cnn, shape, 10), 0, &Device::Cpu);
            assert!(m.is_ok(), "{m:?}");
            let Ok(m) = m else { return };
            let x = Tensor::zeros((3, 1, h, w), DType::F32, &Device::Cpu).ok();
            let out = x.and_then(|x| m.forward(&x, false).ok()).map(|t| t.dims().to_vec());
            assert_eq!(out, Some(vec![3, 10]));
        }
    }

    /// Under bf16 products each architecture's loss and gradients (candle's
    /// graph) are the f32 step's within bf16's rounding, and not equal to
    /// them: the products did run in bf16, and the weights stayed f32. (The
    /// same happens under PyTorch's autocast.)
    #[test]
    fn bf16_products_give_the_f32_gradients_within_bf16_rounding() -> Result<()> {
        let dev = Device::Cpu;
        let size = LlamaSize { layers: 2, heads: 4, kv_heads: 2, width: 32, ff: 48, ..LlamaSize::default() };
        let llama = ModelConfig {
            arch: Arch::Llama { size, context: 16 },
            input: ImageShape { channels: 1, height: 1, width: 17 },
            classes: 64,
        };
        let windows: Vec<f32> = (0..4 * 17).map(|i| ((i * 37 + 11) % 64) as f32).collect();
        let cases = [
            (ModelConfig::new(ArchKind::Mlp, digits_shape(), 10), seeded_images(8, 1, 8, 3)?),
            (ModelConfig::new(ArchKind::Cnn, digits_shape(), 10), seeded_images(8, 1, 8, 4)?),
            (llama, Tensor::from_vec(windows, (4, 1, 1, 17), &dev)?),
        ];
        for (config, x) in cases {
            let what = config.describe();
            let y = Tensor::from_vec((0..x.dim(0)? as u32).map(|i| i % 10).collect::<Vec<_>>(), x.dim(0)?, &dev)?;
            let mut model = Model::new(config, 7, &dev)?;
            let exact = model.gradients(&x, &y)?;
            model.set_precision(Precision::Bf16);
            assert_eq!(model.precision(), Precision::Bf16);
            let low = model.gradients(&x, &y)?;
            assert_eq!(model.parameters()?.len(), exact.grads.len(), "{what}");
            let norm = |g: &[f32]| g.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
            let diff: Vec<f32> = exact.grads.iter().zip(&low.grads).map(|(a, b)| a - b).collect();
            let rel = norm(&diff) / norm(&exact.grads);
            // A ReLU whose input bf16 rounding moves across 0 passes a
            // whole gradient or none: a few such units in thousands move
            // an MLP's or CNN's gradients by several percent. SwiGLU is
            // smooth.
            let bound = if model.config().is_language_model() { 1e-2 } else { 0.15 };
            eprintln!("{what}: loss {} vs {}, gradient error {rel:.2e}", exact.loss, low.loss);
            assert!(rel > 0.0, "{what}: bf16 changed nothing");
            assert!(rel < bound, "{what}: bf16 gradients off by {rel:.3} of their norm, above {bound}");
            assert!((exact.loss - low.loss).abs() < 1e-2 * exact.loss.abs(), "{what}: {} vs {}", exact.loss, low.loss);
        }
        Ok(())
    }

    #[test]
    fn bad_configs_are_errors() {
        let odd = ImageShape { channels: 1, height: 9, width: 9 };
        assert!(Model::new(ModelConfig::new(ArchKind::Cnn, odd, 10), 0, &Device::Cpu).is_err());
        let cfg = ModelConfig { arch: Arch::Mlp { hidden: vec![0] }, input: digits_shape(), classes: 10 };
        assert!(Model::new(cfg, 0, &Device::Cpu).is_err());
    }
}
