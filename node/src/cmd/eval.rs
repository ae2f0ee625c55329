//! `shoal eval`: a model file's loss and accuracy on a data set's test
//! split, or on the whole of a text or token directory.

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
    /// The mean loss: per token (nats) for a language model.
    pub loss: f32,
    pub accuracy: f32,
    /// Language models: `exp(loss)`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub perplexity: Option<f64>,
    /// Language models: the tokens predicted (windows times the context).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens: Option<usize>,
    /// Language models: the loss in bits per byte.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bits_per_byte: Option<f32>,
    /// The accuracy the file records from when it was written, if any.
    pub recorded_accuracy: Option<f32>,
}

/// Load a model file and evaluate it (the work behind `shoal eval`): on an
/// image set's test split, or on the whole of a text or token directory in
/// consecutive windows of the model's context plus one.
pub fn evaluate(args: &EvalArgs) -> anyhow::Result<EvalReport> {
    let mut file = shoal_models::hf::load_model(&args.model, None)?;
    let dataset = match &args.dataset {
        Some(d) => d.clone(),
        None => file.meta.dataset.parse::<DatasetKind>().with_context(|| {
            format!("{} names data set `{}`; pass --dataset", args.model.display(), file.meta.dataset)
        })?,
    };
    // A Llama reads windows of the data set's context whatever context it
    // was trained at; a GPT's learned positions fix its own.
    if let Some(m) = dataset.context().and_then(|c| file.model.with_context(c)) {
        file.model = m;
    }
    let test = match (file.model.context(), &dataset) {
        (Some(context), DatasetKind::Text { .. }) => {
            let tokenizer = shoal_models::hf::tokenizer_for(&args.model, &file, args.tokenizer.as_deref())?;
            data::load_whole(&dataset, tokenizer.as_ref(), context)
        }
        (Some(context), DatasetKind::Tokens { .. }) => data::load_whole(&dataset, None, context),
        _ => data::load(&dataset, args.data_dir.as_deref()).map(|s| s.test),
    }
    .with_context(|| format!("loading data set {dataset}"))?;
    let (shape, classes) = (test.shape, test.classes);
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
    let eval = model.evaluate(&test, 512)?;
    let context = file.model.context();
    Ok(EvalReport {
        model: file.model.describe(),
        path: args.model.display().to_string(),
        run_id: file.meta.run_id,
        step: file.meta.step,
        dataset: dataset.to_string(),
        samples: test.len(),
        loss: eval.loss,
        accuracy: eval.accuracy,
        perplexity: context.map(|_| f64::from(eval.loss).exp()),
        tokens: context.map(|c| test.len() * c),
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
            "{} ({}, run {}, step {}) on {}: loss {:.4}, {}",
            r.path,
            r.model,
            r.run_id,
            r.step,
            match r.tokens {
                Some(tokens) => format!("{} whole ({} windows, {tokens} tokens predicted)", r.dataset, r.samples),
                None => format!("the {} test split ({} samples)", r.dataset, r.samples),
            },
            r.loss,
            match (r.bits_per_byte, r.perplexity) {
                (Some(bpb), Some(ppl)) =>
                    format!("perplexity {ppl:.3}, bits/byte {bpb:.3}, next-token accuracy {:.2}%", r.accuracy * 100.0),
                _ => format!("accuracy {:.2}%", r.accuracy * 100.0),
            }
        );
    }
    Ok(())
}
