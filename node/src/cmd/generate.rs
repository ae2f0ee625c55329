//! `shoal generate`: sample text from a trained language model: bytes, or
//! tokens decoded by the model's tokenizer.

use anyhow::{bail, Context};
use shoal_models::{Model, TrainableModel};

use crate::cmd::cli::GenerateArgs;

/// The generated text (the prompt not included). Bytes that do not form
/// UTF-8 are shown as U+FFFD.
pub fn generate(args: &GenerateArgs) -> anyhow::Result<String> {
    let file = shoal_models::hf::load_model(&args.model, None)?;
    if !file.model.is_language_model() {
        bail!(
            "{} holds {}, which is not a language model (train one with --model llama --dataset text:PATH)",
            args.model.display(),
            file.model.describe()
        );
    }
    let tokenizer = shoal_models::hf::tokenizer_for(&args.model, &file, args.tokenizer.as_deref())?;
    let device = args.device.open()?;
    let model = Model::new(file.model.clone(), file.meta.seed, &device)?;
    model.set_parameters(&file.params)?;
    let sampling = || format!("sampling from {}", args.model.display());
    let Some(tokenizer) = tokenizer else {
        let bytes =
            model.generate(args.prompt.as_bytes(), args.tokens, args.temperature, args.seed).with_context(sampling)?;
        return Ok(String::from_utf8_lossy(&bytes).into_owned());
    };
    // An empty prompt starts from the end-of-text token, as a new document.
    let mut prompt = tokenizer.encode(&args.prompt)?;
    if prompt.is_empty() {
        prompt.extend(tokenizer.eos().or_else(|| tokenizer.encode("\n").ok()?.first().copied()));
    }
    let ids = model.generate_tokens(&prompt, args.tokens, args.temperature, args.seed).with_context(sampling)?;
    Ok(tokenizer.decode(&ids)?)
}

#[allow(clippy::print_stdout)] // The CLI's own output.
pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let text = generate(&args)?;
    println!("{}{text}", args.prompt);
    Ok(())
}
