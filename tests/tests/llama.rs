//! The Llama (`--model llama`) on real text (the GNU GPL v3 that
//! `models/data` ships): over bytes it learns more than letter frequencies;
//! on the text cut by a BPE trained here, 4 nodes over TCP in pull BSP end
//! within 0.02 nats of one node on the same samples; 4 nodes with local
//! steps (DiLoCo) train and end on one model, with f32 or SparseLoCo-class
//! pushes; bf16 matrix products train
//! to f32's loss within 2%; and a Hugging Face directory
//! written from a trained model evaluates to the same loss through
//! `shoal eval`.

use std::path::PathBuf;

use candle_core::Device;
use shoal_models::data::{self, text_split, unigram_entropy, SAMPLE_TEXT};
use shoal_models::{
    ArchKind, DatasetKind, LlamaSize, LocalTrainer, ModelConfig, ModelFile, ModelMeta, OptimizerConfig, OptimizerKind,
    Precision,
};
use shoal_node::actors::worker::batch_for_step;
use shoal_node::cluster::ClusterSpec;
use shoal_node::cmd::cli::EvalArgs;
use shoal_node::config::{LocalStepsConfig, NodeConfig};
use shoal_node::node::NodeReport;
use shoal_node::policy::compress::PushCompression;
use shoal_node::policy::sync::SyncPolicy;
use shoal_tests::{digits_config, run_cluster, status};

const CONTEXT: usize = 64;
/// 2 layers, 4 query and 2 key/value heads, width 64, an untied head: every
/// part of the architecture is in play.
const SIZE: LlamaSize = LlamaSize {
    layers: 2,
    heads: 4,
    kv_heads: 2,
    width: 64,
    ff: 176,
    tie: false,
    rope_theta: shoal_models::llama::Float(10_000.0),
    norm_eps: shoal_models::llama::Float(1e-5),
};
/// AdamW's rate: low enough that the order in which a batch's gradients
/// are summed does not move where training ends (as for the GPT).
const LR: f64 = 1e-3;

fn sample_text() -> DatasetKind {
    DatasetKind::Text {
        path: PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/data/gpl-3.0.txt"),
        context: CONTEXT,
    }
}

fn trainer(split: &shoal_models::Split, batch: usize) -> anyhow::Result<LocalTrainer> {
    trainer_at(split, batch, LR)
}

fn trainer_at(split: &shoal_models::Split, batch: usize, lr: f64) -> anyhow::Result<LocalTrainer> {
    let config = ModelConfig::for_dataset(ArchKind::Llama, &split.train).with_llama_size(SIZE);
    Ok(LocalTrainer::new(config, OptimizerConfig::new(OptimizerKind::Adamw, lr), 42, batch, &Device::Cpu)?)
}

fn llama_config(run: &str, steps: u64, batch: usize) -> NodeConfig {
    let mut base = digits_config(run, steps, SyncPolicy::Bsp, OptimizerKind::Adamw, LR);
    base.training.model = ArchKind::Llama;
    base.training.llama = Some(SIZE);
    base.training.dataset = sample_text();
    base.training.batch_size = batch;
    base
}

#[test]
fn a_small_llama_learns_more_than_letter_frequencies() -> anyhow::Result<()> {
    let split = text_split(SAMPLE_TEXT.as_bytes(), CONTEXT, "gpl-3.0.txt")?;
    let entropy = unigram_entropy(SAMPLE_TEXT.as_bytes());
    // A higher rate than the cluster comparison's: this one is about learning.
    let mut t = trainer_at(&split, 32, 3e-3)?;
    let before = t.evaluate(&split.test)?;
    while t.step() < 300 {
        let left = 300 - t.step();
        t.train_steps(&split.train, left, |_| {})?;
    }
    let after = t.evaluate(&split.test)?;
    let bpb = after.bits_per_byte.unwrap_or(f32::INFINITY) as f64;
    eprintln!(
        "llama l2 h4/2 d64 ff176 ctx64, 300 steps of 32 windows: validation bits/byte {bpb:.3} (untrained {:.3}); unigram entropy {entropy:.3}",
        before.bits_per_byte.unwrap_or(f32::NAN)
    );
    assert!(before.bits_per_byte.unwrap_or(0.0) > 7.0, "untrained: {before:?}");
    assert!(bpb <= entropy - 0.5, "validation bits/byte {bpb:.3} is not 0.5 below the unigram entropy {entropy:.3}");
    Ok(())
}

/// `--dtype bf16` (bf16 matrix products, f32 weights and AdamW state)
/// trains the same model on the same batches to f32's held-out loss within
/// 2%, and both learn (about a third below the untrained loss).
#[test]
fn bf16_products_train_to_the_f32_loss_within_2_percent() -> anyhow::Result<()> {
    const STEPS: u64 = 150;
    let split = text_split(SAMPLE_TEXT.as_bytes(), CONTEXT, "gpl-3.0.txt")?;
    let mut losses = Vec::new();
    for dtype in [Precision::F32, Precision::Bf16] {
        let mut t = trainer_at(&split, 16, 3e-3)?;
        t.set_precision(dtype);
        let before = t.evaluate(&split.test)?.loss;
        while t.step() < STEPS {
            let left = STEPS - t.step();
            t.train_steps(&split.train, left, |_| {})?;
        }
        let after = t.evaluate(&split.test)?.loss;
        eprintln!("{dtype}: held-out loss {before:.4} untrained, {after:.4} after {STEPS} steps of 16 windows");
        assert!(after < 0.7 * before, "{dtype} did not learn: {before} -> {after}");
        losses.push(after);
    }
    let (f32_loss, bf16_loss) = (losses[0], losses[1]);
    assert!(f32_loss != bf16_loss, "bf16 products gave f32's loss to the bit: were they bf16?");
    assert!(
        (bf16_loss - f32_loss).abs() <= 0.02 * f32_loss,
        "bf16 ended at {bf16_loss:.4}, f32 at {f32_loss:.4}: more than 2% apart"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_llama_nodes_over_tcp_in_pull_bsp_end_within_0_02_nats_of_one_node() -> anyhow::Result<()> {
    const STEPS: u64 = 150;
    const BATCH: usize = 8;
    // A tokenized text: a BPE of 512 tokens, learned from the text itself.
    let dir = tempfile::tempdir()?;
    let text = dir.path().join("gpl-3.0.txt");
    std::fs::write(&text, SAMPLE_TEXT)?;
    let bpe = shoal_models::tokenizer::Tokenizer::train_bpe(std::slice::from_ref(&text), 512)?;
    let bpe_path = dir.path().join("tokenizer.json");
    bpe.save(&bpe_path)?;
    let mut config = llama_config("llama-4", STEPS, BATCH);
    config.training.tokenizer = Some(bpe_path);
    let reports = run_cluster(&ClusterSpec::new(4, config)).await?;
    // One node on the same samples: at each step, the concatenation (in
    // roster order) of the 4 workers' batches.
    let split = data::load_with(&sample_text(), None, Some(&bpe))?;
    assert_eq!(split.train.classes, 512);
    let mut one = trainer(&split, 4 * BATCH)?;
    let roster = &reports[0].roster;
    for step in 0..STEPS {
        let mut batch = Vec::new();
        for rank in 0..roster.len() {
            batch.extend(batch_for_step(split.train.len(), rank, roster.len(), BATCH, 42, step)?);
        }
        one.train_batch(&split.train, &batch)?;
    }
    let single = one.evaluate(&split.test)?;
    let untrained = trainer(&split, BATCH)?.evaluate(&split.test)?;
    for r in &reports {
        eprintln!(
            "{}: validation loss {:.4} nats; one node {:.4}; untrained {:.4}",
            r.name, r.loss, single.loss, untrained.loss
        );
        assert!((r.loss - single.loss).abs() <= 0.02, "{}: {:.4} vs one node's {:.4}", r.name, r.loss, single.loss);
        assert_eq!(r.steps, STEPS);
        assert_eq!(r.model.describe(), one.model().config().describe());
    }
    // Both learned: the comparison is not between two untrained models.
    // (Per token of a 512-token BPE: 6.25 nats untrained, 4.31 after 150 steps.)
    assert!(single.loss < untrained.loss - 1.5, "one node went from {} only to {}", untrained.loss, single.loss);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_llama_nodes_with_local_steps_train_and_end_on_one_model() -> anyhow::Result<()> {
    const STEPS: u64 = 100;
    const H: u64 = 10;
    let mut base = llama_config("llama-diloco", STEPS, 8);
    base.training.lr = Some(3e-3);
    base.local_steps = Some(LocalStepsConfig::every(H));
    let reports = run_cluster(&ClusterSpec::new(4, base)).await?;
    let split = data::load(&sample_text(), None)?;
    let untrained = trainer(&split, 8)?.evaluate(&split.test)?;
    for r in &reports {
        eprintln!(
            "{}: validation loss {:.4} nats ({:.3} bits/byte; untrained {:.4}), shard versions {:?}",
            r.name,
            r.loss,
            r.bits_per_byte.unwrap_or(f32::NAN),
            untrained.loss,
            r.shard_stats.iter().map(|s| s.version).collect::<Vec<_>>()
        );
        assert!(r.loss < untrained.loss - 1.5, "{}: {} from {}", r.name, r.loss, untrained.loss);
        // One outer round per H steps.
        assert!(r.shard_stats.iter().all(|s| s.version == STEPS / H), "{}: {:?}", r.name, r.shard_stats);
    }
    for r in &reports[1..] {
        assert_eq!(r.params, reports[0].params, "the workers end on the owners' model");
    }
    Ok(())
}

/// Local steps of the SparseLoCo tests: H = 10 over 100 steps.
const SPARSE_STEPS: u64 = 100;
const SPARSE_H: u64 = 10;

/// 4 Llama nodes with SparseLoCo-class pushes (1.5% of each chunk, 2-bit
/// values, error feedback), plain averaging as the outer step, and
/// `delta` as `local_steps.delta`. Asserts what both tests ask: every node
/// learned (its loss at least 1 nat below the untrained model's) and all
/// end on one model. Returns the reports and the bytes whole f32 shards
/// would take each way over the run (every shard, every round: at most).
async fn sparse_llama_cluster(run: &str, delta: PushCompression) -> anyhow::Result<(Vec<NodeReport>, u64)> {
    let sparse = PushCompression::SparseLoCo { fraction: 0.015 };
    let mut base = llama_config(run, SPARSE_STEPS, 8);
    base.training.lr = Some(3e-3);
    base.local_steps =
        Some(LocalStepsConfig { outer_lr: 1.0, outer_momentum: 0.0, delta, ..LocalStepsConfig::every(SPARSE_H) });
    base.compression.push = sparse;
    let reports = run_cluster(&ClusterSpec::new(4, base)).await?;
    let split = data::load(&sample_text(), None)?;
    let untrained = trainer(&split, 8)?.evaluate(&split.test)?;
    for r in &reports {
        eprintln!("{}: validation loss {:.4} (untrained {:.4})", r.name, r.loss, untrained.loss);
        assert!(r.loss < untrained.loss - 1.0, "{}: {} from {}", r.name, r.loss, untrained.loss);
    }
    for r in &reports[1..] {
        assert_eq!(r.params, reports[0].params, "the workers end on the owners' model");
    }
    let f32_bytes = 4 * reports[0].params.len() as u64 * (SPARSE_STEPS / SPARSE_H);
    Ok((reports, f32_bytes))
}

/// DiLoCo with SparseLoCo-class pushes: the nodes learn, end on one model,
/// and push over 50x fewer bytes than f32 pseudo-gradients would take.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_llama_nodes_with_sparseloco_pushes_learn_and_end_on_one_model() -> anyhow::Result<()> {
    let (reports, f32_bytes) = sparse_llama_cluster("llama-sparseloco", PushCompression::None).await?;
    for r in &reports {
        let s = status(r)?;
        // Each round pushes the shards other nodes own: 3 in 4.
        eprintln!("{}: pushed {} B, f32 would be up to {f32_bytes} B", r.name, s.bytes_out);
        assert!(s.bytes_out > 0 && s.bytes_out * 50 < f32_bytes * 3 / 4, "{}: pushed {} B", r.name, s.bytes_out);
        assert_eq!(s.compress_push, "sparseloco:0.015");
    }
    Ok(())
}

/// Delta pulls (`local_steps.delta`): the owners send each round's update
/// as SparseLoCo-class top-k with error feedback instead of the shard, and
/// each worker adds it to its copy. The nodes learn, every copy is the
/// owners' bit for bit (no hash mismatch, one model at the end), and the
/// pulls take over 50x fewer bytes than whole f32 shards would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_llama_nodes_with_delta_pulls_learn_and_hold_the_owners_bits() -> anyhow::Result<()> {
    let delta = PushCompression::SparseLoCo { fraction: 0.015 };
    let (reports, f32_bytes) = sparse_llama_cluster("llama-delta", delta).await?;
    for r in &reports {
        let s = status(r)?;
        // Each round pulls the shards other nodes own: 3 in 4.
        eprintln!(
            "{}: pulled {} B, whole f32 shards would be up to {f32_bytes} B; {} delta mismatches",
            r.name, s.bytes_in, s.delta_mismatches
        );
        assert_eq!(s.delta_mismatches, 0, "{}: every update led to the owners' bits", r.name);
        assert!(s.bytes_in > 0 && s.bytes_in * 50 < f32_bytes * 3 / 4, "{}: pulled {} B", r.name, s.bytes_in);
        let rounds = SPARSE_STEPS / SPARSE_H;
        assert!(r.shard_stats.iter().all(|s| s.version == rounds), "{}: {:?}", r.name, r.shard_stats);
    }
    Ok(())
}

#[test]
fn a_hugging_face_directory_evaluates_like_the_model_it_was_written_from() -> anyhow::Result<()> {
    let split = data::load(&sample_text(), None)?;
    let mut t = trainer(&split, 16)?;
    t.train_steps(&split.train, 30, |_| {})?;
    let eval = t.evaluate(&split.test)?;
    let dir = tempfile::tempdir()?;
    let file = ModelFile {
        model: t.model().config().clone(),
        params: t.params().to_vec(),
        meta: ModelMeta {
            run_id: "test".into(),
            step: t.step(),
            seed: 42,
            dataset: sample_text().to_string(),
            accuracy: Some(eval.accuracy),
            loss: Some(eval.loss),
        },
    };
    let hf = dir.path().join("hf");
    shoal_models::hf::write_dir(&file, &hf, None)?;
    for name in ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json"] {
        assert!(hf.join(name).is_file(), "no {name}");
    }
    let args = EvalArgs {
        model: hf.clone(),
        dataset: None,
        data_dir: None,
        tokenizer: None,
        device: shoal_models::DeviceKind::Cpu,
        json: true,
    };
    let report = shoal_node::cmd::eval::evaluate(&args)?;
    // shoal eval reads the whole text in consecutive windows.
    let context = sample_text().context().unwrap_or_default();
    let whole = data::load_whole(&sample_text(), None, context)?;
    let expected = t.evaluate(&whole)?;
    eprintln!(
        "trained: loss {:.6} on the whole text; its Hugging Face directory through shoal eval: {:.6}",
        expected.loss, report.loss
    );
    assert_eq!(report.loss, expected.loss, "the directory holds other weights");
    assert_eq!((report.samples, report.tokens), (whole.len(), Some(whole.len() * context)));
    let text_len = shoal_models::data::SAMPLE_TEXT.len();
    assert_eq!(whole.len(), text_len / (context + 1), "consecutive windows of context + 1 bytes");
    assert_eq!(report.step, t.step());
    // At another context (a Llama has no position table): still a valid,
    // trained model, evaluated on windows of 32.
    let short = DatasetKind::Text {
        path: PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/data/gpl-3.0.txt"),
        context: 32,
    };
    let other = shoal_node::cmd::eval::evaluate(&EvalArgs { dataset: Some(short), ..args })?;
    assert!(other.loss < eval.loss + 0.5, "at context 32: {} against {}", other.loss, eval.loss);
    Ok(())
}
