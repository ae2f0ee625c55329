//! Single-node training: the loop behind `shoal train`, built from the same
//! pieces (flat gradients, flat optimizer) that a cluster uses.

use candle_core::Device;

use crate::checkpoint::Checkpoint;
use crate::data::Dataset;
use crate::error::{ModelError, Result};
use crate::model::{Evaluation, Model, ModelConfig, TrainableModel};
use crate::optim::{Optimizer, OptimizerConfig};
use crate::resident::ResidentOptimizer;

/// Progress of one batch, for progress bars.
#[derive(Debug, Clone, Copy)]
pub struct BatchProgress {
    pub epoch: u64,
    /// Batch index within the epoch.
    pub batch: usize,
    pub batches: usize,
    pub samples: usize,
    pub loss: f32,
}

/// What one epoch did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EpochStats {
    pub epoch: u64,
    pub mean_loss: f32,
    pub samples: usize,
    pub steps: usize,
}

/// A finite loss, or the error that says to lower the learning rate.
fn check(loss: f32, step: u64) -> Result<()> {
    if loss.is_finite() {
        Ok(())
    } else {
        Err(ModelError::Invalid(format!("loss became {loss} at step {step}; lower the learning rate")))
    }
}

/// A model, its optimizer and its position in the data.
///
/// On the CPU each step flattens the gradients, runs the flat optimizer and
/// writes the parameters back. On other devices the optimizer runs there
/// ([`ResidentOptimizer`]) and `params` and `optimizer` are brought up to
/// date once per call of [`Self::train_steps`] or [`Self::train_batch`],
/// so what they return is always current.
pub struct LocalTrainer {
    model: Box<dyn TrainableModel>,
    optimizer: Optimizer,
    /// The parameters in flat form; the model's variables mirror them.
    params: Vec<f32>,
    step: u64,
    seed: u64,
    batch_size: usize,
    resident: Option<ResidentOptimizer>,
    steps: StepOptions,
}

/// The learning rate at a step, from the step's number.
pub type LrAt = std::sync::Arc<dyn Fn(u64) -> f64 + Send + Sync>;

/// What a step does beyond the optimizer's own update.
#[derive(Clone, Default)]
pub struct StepOptions {
    /// The learning rate of each step (warm-up, decay); none: the
    /// optimizer's, unchanged.
    pub lr_at: Option<LrAt>,
    /// Scale the gradient down to this global L2 norm when it is larger.
    pub clip_grad: Option<f64>,
    /// Micro-batches per step, their gradients averaged (gradient
    /// accumulation: a batch's memory is a micro-batch's); 0 and 1: none.
    pub accumulate: usize,
}

impl std::fmt::Debug for StepOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepOptions")
            .field("scheduled", &self.lr_at.is_some())
            .field("clip_grad", &self.clip_grad)
            .field("accumulate", &self.accumulate)
            .finish()
    }
}

impl StepOptions {
    fn plain(&self) -> bool {
        self.clip_grad.is_none() && self.accumulate <= 1
    }
}

impl std::fmt::Debug for LocalTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalTrainer")
            .field("model", &self.model.config().describe())
            .field("step", &self.step)
            .field("batch_size", &self.batch_size)
            .finish()
    }
}

impl LocalTrainer {
    /// A fresh run: weights from `seed`, zeroed optimizer state.
    pub fn new(
        config: ModelConfig,
        optimizer: OptimizerConfig,
        seed: u64,
        batch_size: usize,
        device: &Device,
    ) -> Result<Self> {
        let model = Model::boxed(config, seed, device)?;
        let params = model.parameters()?;
        let optimizer = Optimizer::new(optimizer, params.len())?;
        Self::assemble(model, optimizer, params, 0, seed, batch_size)
    }

    /// Start from given weights (fine-tuning a saved model): a fresh
    /// optimizer and step 0; `seed` still fixes the data order.
    pub fn from_params(
        config: ModelConfig,
        params: Vec<f32>,
        optimizer: OptimizerConfig,
        seed: u64,
        batch_size: usize,
        device: &Device,
    ) -> Result<Self> {
        let model = Model::boxed(config, seed, device)?;
        model.set_parameters(&params)?;
        let optimizer = Optimizer::new(optimizer, params.len())?;
        Self::assemble(model, optimizer, params, 0, seed, batch_size)
    }

    /// Continue from a checkpoint. The optimizer config in the checkpoint wins
    /// unless `optimizer` overrides it (for example to change the learning rate).
    pub fn resume(
        ckpt: Checkpoint,
        optimizer: Option<OptimizerConfig>,
        batch_size: usize,
        device: &Device,
    ) -> Result<Self> {
        let model = Model::boxed(ckpt.model.clone(), ckpt.seed, device)?;
        model.set_parameters(&ckpt.params)?;
        let optimizer = match (ckpt.optimizer, optimizer) {
            (Some(state), None) => Optimizer::from_state(state)?,
            (Some(mut state), Some(cfg)) if state.config.kind() == cfg.kind() => {
                state.config = cfg;
                Optimizer::from_state(state)?
            }
            (_, Some(cfg)) => Optimizer::new(cfg, ckpt.params.len())?,
            (None, None) => {
                return Err(ModelError::Invalid("checkpoint has no optimizer state; name an optimizer".into()))
            }
        };
        Self::assemble(model, optimizer, ckpt.params, ckpt.step, ckpt.seed, batch_size)
    }

    fn assemble(
        model: Box<dyn TrainableModel>,
        optimizer: Optimizer,
        params: Vec<f32>,
        step: u64,
        seed: u64,
        batch_size: usize,
    ) -> Result<Self> {
        if batch_size == 0 {
            return Err(ModelError::Invalid("batch size must be at least 1".into()));
        }
        let on_device = !model.device().is_cpu();
        let t =
            Self { model, optimizer, params, step, seed, batch_size, resident: None, steps: StepOptions::default() };
        if on_device {
            t.keep_on_device()
        } else {
            Ok(t)
        }
    }

    /// Run the optimizer on the model's device from now on (the default
    /// off the CPU; on the CPU, for tests of the device path).
    pub fn keep_on_device(mut self) -> Result<Self> {
        self.resident = Some(ResidentOptimizer::new(&self.optimizer, self.model.layout(), self.model.varmap())?);
        Ok(self)
    }

    /// Bring `params` and `optimizer` up to date with the device.
    fn sync(&mut self) -> Result<()> {
        if let Some(r) = &self.resident {
            self.params = self.model.parameters()?;
            self.optimizer = Optimizer::from_state(r.to_state(self.model.layout())?)?;
        }
        Ok(())
    }

    pub fn model(&self) -> &dyn TrainableModel {
        self.model.as_ref()
    }

    pub fn step(&self) -> u64 {
        self.step
    }

    pub fn params(&self) -> &[f32] {
        &self.params
    }

    pub fn optimizer(&self) -> &Optimizer {
        &self.optimizer
    }

    /// Number of batches in an epoch of `data`.
    pub fn batches_per_epoch(&self, data: &Dataset) -> u64 {
        data.len().div_ceil(self.batch_size).max(1) as u64
    }

    /// The epoch the next step belongs to.
    pub fn epoch(&self, data: &Dataset) -> u64 {
        self.step / self.batches_per_epoch(data)
    }

    /// Set what each following step does beyond the optimizer's update.
    /// Clipping and accumulation run on the CPU's flat gradients: a model
    /// on another device refuses them.
    pub fn set_step_options(&mut self, steps: StepOptions) -> Result<()> {
        if let Some(c) = steps.clip_grad.filter(|c| !(*c > 0.0 && c.is_finite())) {
            return Err(ModelError::Invalid(format!("gradient clipping at norm {c}: it must be a number above 0")));
        }
        if self.resident.is_some() && !steps.plain() {
            return Err(ModelError::Invalid(
                "gradient clipping and accumulation run on the CPU only for now; train on --device cpu".into(),
            ));
        }
        self.steps = steps;
        Ok(())
    }

    /// Set the learning rate of the following steps (a schedule).
    pub fn set_lr(&mut self, lr: f64) -> Result<()> {
        self.optimizer.set_lr(lr)?;
        if let Some(r) = &mut self.resident {
            r.set_lr(lr);
        }
        Ok(())
    }

    /// Compute the model's matrix products in `precision` from the next
    /// step on ([`crate::Precision`]); parameters and optimizer state stay f32.
    pub fn set_precision(&mut self, precision: crate::Precision) {
        self.model.set_precision(precision);
    }

    /// One optimizer step on the given samples. Returns the batch loss.
    pub fn train_batch(&mut self, data: &Dataset, indices: &[usize]) -> Result<f32> {
        let loss = self.step_once(data, indices)?;
        self.sync()?;
        Ok(loss)
    }

    fn step_once(&mut self, data: &Dataset, indices: &[usize]) -> Result<f32> {
        if let Some(lr_at) = self.steps.lr_at.clone() {
            self.set_lr(lr_at(self.step))?;
        }
        if !self.steps.plain() {
            return self.step_accumulated(data, indices);
        }
        let (x, y) = data.batch(indices, self.model.device())?;
        let loss = match &mut self.resident {
            Some(r) => {
                let (loss, grads) = self.model.backward(&x, &y)?;
                check(loss, self.step)?;
                r.step(self.model.layout(), self.model.varmap(), &grads)?;
                loss
            }
            None => {
                let out = self.model.gradients(&x, &y)?;
                check(out.loss, self.step)?;
                self.optimizer.step(&mut self.params, &out.grads)?;
                self.model.set_parameters(&self.params)?;
                out.loss
            }
        };
        self.step += 1;
        Ok(loss)
    }

    /// A step in micro-batches (the batch cut into `accumulate` runs of
    /// nearly equal size), their gradients averaged by samples, the result
    /// clipped to `clip_grad`, then one optimizer update.
    fn step_accumulated(&mut self, data: &Dataset, indices: &[usize]) -> Result<f32> {
        let parts = self.steps.accumulate.clamp(1, indices.len().max(1));
        let mut sum = vec![0f32; self.params.len()];
        let (mut loss_sum, mut samples) = (0f64, 0usize);
        for k in 0..parts {
            let part = &indices[k * indices.len() / parts..(k + 1) * indices.len() / parts];
            if part.is_empty() {
                continue;
            }
            let (x, y) = data.batch(part, self.model.device())?;
            let out = self.model.gradients(&x, &y)?;
            check(out.loss, self.step)?;
            let w = part.len() as f32;
            for (s, g) in sum.iter_mut().zip(&out.grads) {
                *s += w * g;
            }
            loss_sum += f64::from(out.loss) * part.len() as f64;
            samples += part.len();
        }
        let scale = 1.0 / samples.max(1) as f32;
        sum.iter_mut().for_each(|g| *g *= scale);
        if let Some(max) = self.steps.clip_grad {
            let norm = sum.iter().map(|&g| f64::from(g) * f64::from(g)).sum::<f64>().sqrt();
            if norm > max {
                let k = (max / norm) as f32;
                sum.iter_mut().for_each(|g| *g *= k);
            }
        }
        self.optimizer.step(&mut self.params, &sum)?;
        self.model.set_parameters(&self.params)?;
        self.step += 1;
        Ok((loss_sum / samples.max(1) as f64) as f32)
    }

    /// Finish the current epoch (from wherever a resume left it).
    pub fn run_epoch(&mut self, data: &Dataset, on_batch: impl FnMut(BatchProgress)) -> Result<EpochStats> {
        let bpe = self.batches_per_epoch(data);
        let left = bpe - self.step % bpe;
        self.train_steps(data, left, on_batch)
    }

    /// Take up to `steps` steps, stopping at the end of the current epoch.
    /// The batch order depends only on `(seed, epoch)`, so a run that stops
    /// anywhere and resumes from a checkpoint sees exactly the same batches.
    pub fn train_steps(
        &mut self,
        data: &Dataset,
        steps: u64,
        mut on_batch: impl FnMut(BatchProgress),
    ) -> Result<EpochStats> {
        let bpe = self.batches_per_epoch(data);
        let epoch = self.step / bpe;
        // The order is computed, not listed, for a set too large to list.
        let order = data.epoch_order(self.seed, epoch)?;
        let batches = order.batches(self.batch_size);
        let first = (self.step % bpe) as usize;
        let last = batches.min(first.saturating_add(steps.min(usize::MAX as u64) as usize));
        let (mut loss_sum, mut samples, mut taken) = (0.0f64, 0usize, 0usize);
        for i in first..last {
            let idx = order.batch(i, self.batch_size);
            let loss = self.step_once(data, &idx)?;
            loss_sum += loss as f64 * idx.len() as f64;
            samples += idx.len();
            taken += 1;
            on_batch(BatchProgress { epoch, batch: i, batches, samples: idx.len(), loss });
        }
        self.sync()?;
        Ok(EpochStats { epoch, mean_loss: (loss_sum / samples.max(1) as f64) as f32, samples, steps: taken })
    }

    pub fn evaluate(&self, data: &Dataset) -> Result<Evaluation> {
        self.model.evaluate(data, 512)
    }

    pub fn checkpoint(&self) -> Checkpoint {
        Checkpoint {
            model: self.model.config().clone(),
            params: self.params.clone(),
            optimizer: Some(self.optimizer.state().clone()),
            step: self.step,
            version: self.step,
            seed: self.seed,
        }
    }
}
