//! `shoal train`: single-node training with a progress bar per epoch.

use std::time::Instant;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use shoal_models::{data, Checkpoint, LocalTrainer, ModelConfig, ModelFile, ModelMeta, OptimizerConfig};
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
    let threads = crate::ops::threads::configure_process(crate::ops::threads::resolve(args.threads, 1));
    let device = args.device.open()?;
    let split = data::load(args.dataset, args.data_dir.as_deref())
        .with_context(|| format!("loading data set {}", args.dataset))?;
    let config = ModelConfig::for_dataset(args.model, &split.train);
    let opt_cfg = args
        .lr
        .map(|lr| OptimizerConfig::new(args.optimizer, lr))
        .unwrap_or_else(|| OptimizerConfig::new(args.optimizer, OptimizerConfig::default_lr(args.optimizer)));

    let mut trainer = match (&args.resume, &args.init) {
        (Some(path), _) => {
            let ckpt = Checkpoint::load(path, Some(&config))?;
            // Keep the checkpoint's optimizer unless the user named a learning rate.
            let opt = args.lr.map(|_| opt_cfg);
            info!(path = %path.display(), step = ckpt.step, "resuming");
            LocalTrainer::resume(ckpt, opt, args.batch_size, &device)?
        }
        (None, Some(path)) => {
            let init = ModelFile::load(path, Some(&config)).with_context(|| {
                format!(
                    "--init must hold a {} model for {} (the model and data set given)",
                    config.describe(),
                    args.dataset
                )
            })?;
            info!(path = %path.display(), from_run = %init.meta.run_id, from_step = init.meta.step, "starting from a model file");
            LocalTrainer::from_params(config.clone(), init.params, opt_cfg, args.seed, args.batch_size, &device)?
        }
        (None, None) => LocalTrainer::new(config.clone(), opt_cfg, args.seed, args.batch_size, &device)?,
    };

    println!(
        "training {} on {} ({} train / {} test samples) on {}, {} parameters, {threads} compute threads",
        config.describe(),
        args.dataset,
        split.train.len(),
        split.test.len(),
        args.device,
        trainer.model().layout().total_len()
    );
    let style = ProgressStyle::with_template(
        "epoch {prefix:>3} [{bar:30.cyan/blue}] {pos:>6}/{len:6} {per_sec:>12} loss {msg}",
    )
    .context("progress bar template")?
    .progress_chars("=> ");

    while trainer.epoch(&split.train) < args.epochs {
        let epoch = trainer.epoch(&split.train);
        let bar = ProgressBar::new(split.train.len() as u64).with_style(style.clone());
        bar.set_prefix(format!("{}", epoch + 1));
        let bpe = trainer.batches_per_epoch(&split.train);
        // A resumed run starts mid-epoch: show the samples already done.
        bar.set_position(((trainer.step() % bpe) as usize * args.batch_size) as u64);
        let started = Instant::now();
        let stats = trainer.run_epoch(&split.train, |p| {
            bar.inc(p.samples as u64);
            bar.set_message(format!("{:.4}", p.loss));
        })?;
        bar.finish_and_clear();
        let secs = started.elapsed().as_secs_f64().max(1e-9);
        let eval = trainer.evaluate(&split.test)?;
        println!(
            "epoch {}/{}: train loss {:.4}, test loss {:.4}, test accuracy {:.2}%, {:.0} samples/s",
            epoch + 1,
            args.epochs,
            stats.mean_loss,
            eval.loss,
            eval.accuracy * 100.0,
            stats.samples as f64 / secs
        );
        debug!(epoch = epoch + 1, step = trainer.step(), accuracy = eval.accuracy, loss = eval.loss, "epoch done");
        if let Some(path) = &args.checkpoint {
            trainer.checkpoint().save(path).with_context(|| format!("saving checkpoint {}", path.display()))?;
        }
    }
    let eval = trainer.evaluate(&split.test)?;
    println!("final test accuracy {:.2}% after {} steps", eval.accuracy * 100.0, trainer.step());
    if let Some(path) = &args.checkpoint {
        println!("checkpoint saved to {}", path.display());
    }
    if let Some(path) = &args.output {
        let file = ModelFile {
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
        file.save(path).with_context(|| format!("writing the model to {}", path.display()))?;
        println!("model written to {}", path.display());
    }
    Ok(())
}
