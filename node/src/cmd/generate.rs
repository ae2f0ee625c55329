//! `shoal generate`: sample text from a trained GPT model file.

use anyhow::{bail, Context};
use shoal_models::{Model, TrainableModel};

use crate::cmd::cli::GenerateArgs;

/// The generated text (the prompt not included). Bytes that do not form
/// UTF-8 are shown as U+FFFD.
pub fn generate(args: &GenerateArgs) -> anyhow::Result<String> {
    let file = shoal_models::hf::load_model(&args.model, None)?;
    if !file.model.is_language_model() {
        bail!(
            "{} holds {}, which is not a language model (train one with --model gpt --dataset text:PATH)",
            args.model.display(),
            file.model.describe()
        );
    }
    let device = args.device.open()?;
    let model = Model::new(file.model.clone(), file.meta.seed, &device)?;
    model.set_parameters(&file.params)?;
    let bytes = model
        .generate(args.prompt.as_bytes(), args.tokens, args.temperature, args.seed)
        .with_context(|| format!("sampling from {}", args.model.display()))?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

#[allow(clippy::print_stdout)] // The CLI's own output.
pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let text = generate(&args)?;
    println!("{}{text}", args.prompt);
    Ok(())
}
