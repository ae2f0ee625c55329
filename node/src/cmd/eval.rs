//! `shoal eval`: a model file's loss and accuracy on a data set's test split.

use anyhow::{bail, Context};
use serde::Serialize;
use shoal_models::{data, DatasetKind, Model, TrainableModel};

use crate::cmd::cli::EvalArgs;

/// What `shoal eval --json` prints.
#[derive(Debug, Serialize)]
pub struct EvalReport {
    pub model: String,
    pub path: String,
    pub run_id: String,
    pub step: u64,
    pub dataset: String,
    pub samples: usize,
    pub loss: f32,
    pub accuracy: f32,
    /// Language models: the loss in bits per byte.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bits_per_byte: Option<f32>,
    /// The accuracy the file records from when it was written, if any.
    pub recorded_accuracy: Option<f32>,
}

/// Load a model file and evaluate it (the work behind `shoal eval`).
pub fn evaluate(args: &EvalArgs) -> anyhow::Result<EvalReport> {
    let file = shoal_models::hf::load_model(&args.model, None)?;
    let dataset = match &args.dataset {
        Some(d) => d.clone(),
        None => file.meta.dataset.parse::<DatasetKind>().with_context(|| {
            format!("{} names data set `{}`; pass --dataset", args.model.display(), file.meta.dataset)
        })?,
    };
    let split =
        data::load(&dataset, args.data_dir.as_deref()).with_context(|| format!("loading data set {dataset}"))?;
    let (shape, classes) = (split.test.shape, split.test.classes);
    let mut file = file;
    // A Llama reads the data's windows whatever context it was trained at.
    if let Some(m) = shape.width.checked_sub(1).and_then(|c| file.model.with_context(c)) {
        file.model = m;
    }
    if (shape, classes) != (file.model.input, file.model.classes) {
        bail!(
            "{} holds model {}, which does not fit {dataset} ({}x{}x{} inputs, {} classes)",
            args.model.display(),
            file.model.describe(),
            shape.channels,
            shape.height,
            shape.width,
            classes
        );
    }
    let device = args.device.open()?;
    let model = Model::new(file.model.clone(), file.meta.seed, &device)?;
    model.set_parameters(&file.params)?;
    let eval = model.evaluate(&split.test, 512)?;
    Ok(EvalReport {
        model: file.model.describe(),
        path: args.model.display().to_string(),
        run_id: file.meta.run_id,
        step: file.meta.step,
        dataset: dataset.to_string(),
        samples: split.test.len(),
        loss: eval.loss,
        accuracy: eval.accuracy,
        bits_per_byte: eval.bits_per_byte,
        recorded_accuracy: file.meta.accuracy,
    })
}

#[allow(clippy::print_stdout)] // The CLI's own output.
pub fn run(args: EvalArgs) -> anyhow::Result<()> {
    let r = evaluate(&args)?;
    if args.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "{} ({}, run {}, step {}) on the {} test split ({} samples): loss {:.4}, {}",
            r.path,
            r.model,
            r.run_id,
            r.step,
            r.dataset,
            r.samples,
            r.loss,
            match r.bits_per_byte {
                Some(bpb) => format!("bits/byte {bpb:.3}, next-byte accuracy {:.2}%", r.accuracy * 100.0),
                None => format!("accuracy {:.2}%", r.accuracy * 100.0),
            }
        );
    }
    Ok(())
}
