//! `shoal train`: single-node training with a progress bar per epoch.

use std::time::Instant;

use anyhow::Context;
use candle_core::Device;
use indicatif::{ProgressBar, ProgressStyle};
use shoal_models::tokenizer::Tokenizer;
use shoal_models::StepOptions;

use crate::policy::schedule::LrSchedule;
use shoal_models::{
    data, Checkpoint, Dataset, EpochStats, LocalTrainer, ModelConfig, ModelFile, ModelMeta, OptimizerConfig, Split,
};
use tracing::{debug, info};

use crate::cmd::cli::TrainArgs;

#[allow(clippy::print_stdout)] // The CLI's own output.
pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    if args.epochs == 0 {
        anyhow::bail!("--epochs must be at least 1");
    }
    if args.batch_size == 0 {
        anyhow::bail!("--batch-size must be at least 1");
    }
    args.model.check_dataset(&args.dataset)?;
    // A step's work, where the data set's shape is known before loading it
    // (the built-in image sets): a small one trains faster on one thread.
    let step_macs = args.dataset.image_shape().map(|(shape, classes)| {
        ModelConfig::new(args.model, shape, classes).forward_macs().saturating_mul(args.batch_size as u64)
    });
    let threads = crate::ops::threads::configure_process(crate::ops::threads::for_training(args.threads, step_macs));
    let device = args.device.open()?;
    if args.tokenizer.is_some() && !args.dataset.is_language() {
        anyhow::bail!("--tokenizer cuts text into tokens, but --dataset {} is not a text", args.dataset);
    }
    let tokenizer = data::dataset_tokenizer(&args.dataset, args.tokenizer.as_deref())?;
    let split = data::load_with(&args.dataset, args.data_dir.as_deref(), tokenizer.as_ref())
        .with_context(|| format!("loading data set {}", args.dataset))?;
    let config = match &args.init_hf {
        // The directory's sizes, at the data's context.
        Some(dir) => {
            let file = shoal_models::hf::read_dir(dir, split.train.shape.width.checked_sub(1))
                .with_context(|| format!("--init-hf {}", dir.display()))?;
            if args.model != shoal_models::ArchKind::Llama {
                anyhow::bail!("--init-hf reads a Llama: pass --model llama");
            }
            file.model
        }
        None => ModelConfig::for_dataset(args.model, &split.train).with_llama_size(args.llama_size()),
    };
    if config.classes != split.train.classes {
        anyhow::bail!(
            "{} has a vocabulary of {} tokens; {} has {}",
            config.describe(),
            config.classes,
            args.dataset,
            split.train.classes
        );
    }
    if args.output_hf.is_some() {
        shoal_models::hf::config_json(&config).context("--output-hf")?;
    }
    config.validate().with_context(|| format!("--model {} on {}", args.model, args.dataset))?;
    let mut trainer = open_trainer(&args, &config, &device, &split.train)?;
    println!(
        "training {} on {} ({} train / {} test samples) on {} in {}, {} parameters, {threads} compute threads",
        config.describe(),
        args.dataset,
        split.train.len(),
        split.test.len(),
        args.device,
        args.dtype,
        trainer.model().layout().total_len()
    );
    let totals = train(&args, &mut trainer, &split)?;
    finish(&args, &config, &trainer, &split, &totals, tokenizer.as_ref())
}

/// The trainer to start from: the checkpoint of `--resume`, the model file
/// of `--init`, or a fresh model; with the schedule, clipping and
/// accumulation of its steps.
fn open_trainer(
    args: &TrainArgs,
    config: &ModelConfig,
    device: &Device,
    train: &Dataset,
) -> anyhow::Result<LocalTrainer> {
    let mut opt_cfg = args
        .lr
        .map(|lr| OptimizerConfig::new(args.optimizer, lr))
        .unwrap_or_else(|| OptimizerConfig::new(args.optimizer, OptimizerConfig::default_lr(args.optimizer)));
    if let Some(wd) = args.weight_decay {
        opt_cfg = opt_cfg.with_weight_decay(wd);
    }
    opt_cfg.validate().context("--lr and --weight-decay")?;
    let init = args.init.as_ref().or(args.init_hf.as_ref());
    let mut trainer = match (&args.resume, init) {
        (Some(path), _) => {
            let ckpt = Checkpoint::load(path, Some(config))?;
            // Keep the checkpoint's optimizer unless the user named a learning rate.
            let opt = args.lr.map(|_| opt_cfg);
            info!(path = %path.display(), step = ckpt.step, "resuming");
            LocalTrainer::resume(ckpt, opt, args.batch_size, device)?
        }
        (None, Some(path)) => {
            let init = shoal_models::hf::load_model(path, Some(config)).with_context(|| {
                format!(
                    "--init and --init-hf must hold a {} model for {} (the model and data set given)",
                    config.describe(),
                    args.dataset
                )
            })?;
            info!(path = %path.display(), from_run = %init.meta.run_id, from_step = init.meta.step, "starting from a model file");
            LocalTrainer::from_params(config.clone(), init.params, opt_cfg, args.seed, args.batch_size, device)?
        }
        (None, None) => LocalTrainer::new(config.clone(), opt_cfg, args.seed, args.batch_size, device)?,
    };
    let schedule = LrSchedule {
        base: trainer.optimizer().config().lr(),
        decay: args.lr_decay,
        steps: total_steps(args, trainer.batches_per_epoch(train)),
        warmup: args.warmup_steps,
    };
    let lr_at: Option<shoal_models::LrAt> =
        schedule.varies().then(|| std::sync::Arc::new(move |step| schedule.lr_at(step)) as shoal_models::LrAt);
    trainer
        .set_step_options(StepOptions { lr_at, clip_grad: args.clip_grad, accumulate: args.accumulate })
        .context("--clip-grad and --accumulate")?;
    trainer.set_precision(args.dtype);
    Ok(trainer)
}

/// The steps the run takes: `--steps`, or `--epochs` of `per_epoch` steps.
fn total_steps(args: &TrainArgs, per_epoch: u64) -> u64 {
    args.steps.unwrap_or(args.epochs.saturating_mul(per_epoch))
}

/// Trains up to `--steps` (in rounds of `--eval-every` steps, cut at epoch
/// ends) or `--epochs` (in whole epochs), with a progress bar per round,
/// and evaluates (and checkpoints) at each round's end that is due.
fn train(args: &TrainArgs, trainer: &mut LocalTrainer, split: &Split) -> anyhow::Result<Totals> {
    let mut totals = Totals::default();
    let style = ProgressStyle::with_template(
        "epoch {prefix:>3} [{bar:30.cyan/blue}] {pos:>6}/{len:6} {per_sec:>12} loss {msg}",
    )
    .context("progress bar template")?
    .progress_chars("=> ");
    let bpe = trainer.batches_per_epoch(&split.train);
    let total = total_steps(args, bpe);
    while trainer.step() < total {
        let epoch = trainer.epoch(&split.train);
        let in_epoch = trainer.step() % bpe;
        let mut n = (bpe - in_epoch).min(total - trainer.step());
        if args.steps.is_some() {
            n = n.min(args.eval_every - trainer.step() % args.eval_every);
        }
        let bar = ProgressBar::new(split.train.len() as u64).with_style(style.clone());
        bar.set_prefix(format!("{}", epoch + 1));
        // A resumed run starts mid-epoch: show the samples already done.
        bar.set_position((in_epoch as usize * args.batch_size).min(split.train.len()) as u64);
        let started = Instant::now();
        let stats = trainer.train_steps(&split.train, n, |p| {
            bar.inc(p.samples as u64);
            bar.set_message(format!("{:.4}", p.loss));
        })?;
        bar.finish_and_clear();
        let secs = started.elapsed().as_secs_f64().max(1e-9);
        totals.samples += stats.samples as u64;
        totals.secs += secs;
        totals.last_loss = Some(stats.mean_loss);
        let due = match args.steps {
            Some(_) => trainer.step().is_multiple_of(args.eval_every),
            None => trainer.step().is_multiple_of(bpe),
        };
        if due || trainer.step() == total {
            evaluate_round(args, trainer, split, epoch, &stats, secs)?;
        }
    }
    Ok(totals)
}

/// What this run trained: samples and seconds of training (evaluations
/// left out), and the mean loss of its last round.
#[derive(Debug, Default)]
struct Totals {
    samples: u64,
    secs: f64,
    last_loss: Option<f32>,
}

/// What `shoal train --json PATH` writes: the run's final figures.
#[derive(Debug, serde::Serialize)]
pub struct TrainSummary {
    pub model: String,
    pub steps: u64,
    /// Training samples (windows, for a language model) per second of
    /// training, evaluations left out.
    pub samples_per_sec: f64,
    /// Language models: tokens predicted per second (`samples_per_sec`
    /// times the context).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_sec: Option<f64>,
    /// The mean training loss of the last round (since the last evaluation);
    /// none for a resumed run that trained no step.
    pub train_loss: Option<f32>,
    /// The final loss on the test (validation) split.
    pub val_loss: f32,
    /// Language models: `exp(val_loss)`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub perplexity: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bits_per_byte: Option<f32>,
    pub accuracy: f32,
    /// The most resident memory the process held (Linux's `VmHWM`; none
    /// elsewhere).
    pub peak_rss_bytes: Option<u64>,
}

/// At the end of a round: evaluates on the test set, prints the round's
/// losses and speed, and saves the checkpoint if `--checkpoint` asks.
#[allow(clippy::print_stdout)] // The CLI's own output.
fn evaluate_round(
    args: &TrainArgs,
    trainer: &LocalTrainer,
    split: &Split,
    epoch: u64,
    stats: &EpochStats,
    secs: f64,
) -> anyhow::Result<()> {
    let eval = trainer.evaluate(&split.test)?;
    let position = match args.steps {
        Some(steps) => format!("step {}/{steps}", trainer.step()),
        None => format!("epoch {}/{}", epoch + 1, args.epochs),
    };
    println!(
        "{position}: train loss {:.4}, test loss {:.4}, test {}, {:.0} samples/s",
        stats.mean_loss,
        eval.loss,
        eval.headline(),
        stats.samples as f64 / secs
    );
    debug!(
        step = trainer.step(),
        accuracy = eval.accuracy,
        loss = eval.loss,
        bits_per_byte = eval.bits_per_byte,
        "evaluated"
    );
    if let Some(path) = &args.checkpoint {
        trainer.checkpoint().save(path).with_context(|| format!("saving checkpoint {}", path.display()))?;
    }
    Ok(())
}

/// After training: the final evaluation, and the model file of `--output`.
#[allow(clippy::print_stdout)] // The CLI's own output.
fn finish(
    args: &TrainArgs,
    config: &ModelConfig,
    trainer: &LocalTrainer,
    split: &Split,
    totals: &Totals,
    tokenizer: Option<&Tokenizer>,
) -> anyhow::Result<()> {
    let eval = trainer.evaluate(&split.test)?;
    println!("final test {} after {} steps", eval.headline(), trainer.step());
    if let Some(path) = &args.json {
        let samples_per_sec = totals.samples as f64 / totals.secs.max(1e-9);
        let summary = TrainSummary {
            model: config.describe(),
            steps: trainer.step(),
            samples_per_sec,
            tokens_per_sec: config.context().map(|c| samples_per_sec * c as f64),
            train_loss: totals.last_loss,
            val_loss: eval.loss,
            perplexity: config.is_language_model().then(|| f64::from(eval.loss).exp()),
            bits_per_byte: eval.bits_per_byte,
            accuracy: eval.accuracy,
            peak_rss_bytes: crate::ops::memory::current().map(|m| m.peak_rss_bytes),
        };
        crate::cmd::bench::write_json(Some(path), &serde_json::to_value(&summary)?)?;
    }
    if let Some(path) = &args.checkpoint {
        println!("checkpoint saved to {}", path.display());
    }
    let file = || ModelFile {
        model: config.clone(),
        params: trainer.params().to_vec(),
        meta: ModelMeta {
            run_id: "train".into(),
            step: trainer.step(),
            seed: args.seed,
            dataset: args.dataset.to_string(),
            accuracy: Some(eval.accuracy),
            loss: Some(eval.loss),
        },
    };
    if let Some(path) = &args.output {
        file().save(path).with_context(|| format!("writing the model to {}", path.display()))?;
        println!("model written to {}", path.display());
    }
    if let Some(dir) = &args.output_hf {
        shoal_models::hf::write_dir(&file(), dir, tokenizer)
            .with_context(|| format!("writing the Hugging Face directory {}", dir.display()))?;
        println!("Hugging Face model written to {}", dir.display());
    }
    Ok(())
}
