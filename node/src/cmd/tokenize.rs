//! `shoal data train-tokenizer` and `shoal data tokenize`: a tokenizer for
//! people who have none, and text cut once into a token directory that
//! `--dataset tokens:DIR` trains on.

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use shoal_models::data::tokenize_files;
use shoal_models::tokenizer::Tokenizer;

use crate::cmd::cli::{TokenizeArgs, TrainTokenizerArgs};

#[allow(clippy::print_stdout)] // The CLI's own output.
pub fn train_tokenizer(args: TrainTokenizerArgs) -> anyhow::Result<()> {
    let bytes: u64 = args.files.iter().filter_map(|f| std::fs::metadata(f).ok()).map(|m| m.len()).sum();
    eprintln!("training a byte-level BPE of {} tokens on {} file(s), {bytes} bytes", args.vocab, args.files.len());
    let started = std::time::Instant::now();
    let tokenizer = Tokenizer::train_bpe(&args.files, args.vocab)?;
    tokenizer.save(&args.output).with_context(|| format!("writing {}", args.output.display()))?;
    println!(
        "wrote {} ({} tokens, end of text {:?}) in {:.1} s",
        args.output.display(),
        tokenizer.vocab_size(),
        tokenizer.eos(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

#[allow(clippy::print_stdout)] // The CLI's own output.
pub fn tokenize(args: TokenizeArgs) -> anyhow::Result<()> {
    let tokenizer = Tokenizer::from_file(&args.tokenizer)?;
    let mut total = 0u64;
    for f in &args.files {
        total += std::fs::metadata(f).with_context(|| format!("reading {}", f.display()))?.len();
    }
    let bar = ProgressBar::new(total).with_style(
        ProgressStyle::with_template("tokenizing [{bar:30.cyan/blue}] {bytes}/{total_bytes} {bytes_per_sec} {msg}")
            .context("progress bar template")?,
    );
    let started = std::time::Instant::now();
    let index = tokenize_files(&tokenizer, &args.files, &args.output, |_, bytes, tokens| {
        bar.set_position(bytes);
        bar.set_message(format!("{tokens} tokens"));
    })?;
    bar.finish_and_clear();
    let secs = started.elapsed().as_secs_f64();
    println!(
        "wrote {}: {} tokens ({:.2} bytes of text per token) from {} document(s) in {} shard(s) of {:?} ids, content hash {}, in {secs:.1} s ({:.1} MB/s)",
        args.output.display(),
        index.tokens,
        total as f64 / index.tokens.max(1) as f64,
        index.documents,
        index.shards.len(),
        index.width,
        index.content_hash,
        total as f64 / 1e6 / secs.max(1e-9)
    );
    Ok(())
}
