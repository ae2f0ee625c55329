//! Single-node training on real data: accuracy reached and bit-identical resume.

use candle_core::Device;
use shoal_models::data::{self, fashion_mnist_dir};
use shoal_models::{ArchKind, Checkpoint, DatasetKind, LocalTrainer, ModelConfig, OptimizerConfig, OptimizerKind};

fn trainer_for(split: &shoal_models::Split, kind: OptimizerKind, seed: u64) -> anyhow::Result<LocalTrainer> {
    let config = ModelConfig::for_dataset(ArchKind::Mlp, &split.train);
    let opt = OptimizerConfig::new(kind, OptimizerConfig::default_lr(kind));
    Ok(LocalTrainer::new(config, opt, seed, 32, &Device::Cpu)?)
}

/// The README's main job: MLP on embedded digits, default seed (42) and
/// settings, reaches 95% on the held-out split within six epochs.
#[test]
fn mlp_reaches_95_percent_on_embedded_digits() -> anyhow::Result<()> {
    let split = data::load(&DatasetKind::Digits, None)?;
    let mut t = trainer_for(&split, OptimizerKind::Adamw, 42)?;
    let mut accuracies = Vec::new();
    for _ in 0..6 {
        t.run_epoch(&split.train, |_| {})?;
        accuracies.push(t.evaluate(&split.test)?.accuracy);
    }
    let last = *accuracies.last().unwrap_or(&0.0);
    eprintln!("digits MLP test accuracy per epoch: {accuracies:?}");
    assert!(last >= 0.95, "test accuracy per epoch: {accuracies:?}");
    Ok(())
}

/// SGD with Nesterov momentum also learns the digits.
#[test]
fn sgd_nesterov_learns_digits() -> anyhow::Result<()> {
    let split = data::load(&DatasetKind::Digits, None)?;
    let mut t = trainer_for(&split, OptimizerKind::Sgd, 42)?;
    for _ in 0..5 {
        t.run_epoch(&split.train, |_| {})?;
    }
    let acc = t.evaluate(&split.test)?.accuracy;
    assert!(acc >= 0.93, "sgd accuracy {acc}");
    Ok(())
}

/// Stop mid-epoch, checkpoint to disk, resume in a fresh trainer: the next
/// steps produce bit-identical parameters and optimizer state, across an
/// epoch boundary.
#[test]
fn checkpoint_resume_is_bit_identical() -> anyhow::Result<()> {
    let split = data::load(&DatasetKind::Digits, None)?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("mid.safetensors");
    for kind in [OptimizerKind::Adamw, OptimizerKind::Sgd] {
        let mut straight = trainer_for(&split, kind, 7)?;
        straight.train_steps(&split.train, 20, |_| {})?;
        straight.checkpoint().save(&path)?;

        let ckpt = Checkpoint::load(&path, Some(straight.model().config()))?;
        let mut resumed = LocalTrainer::resume(ckpt, None, 32, &Device::Cpu)?;
        assert_eq!(resumed.step(), 20);

        // 45 batches per epoch: 40 more steps cross into epoch 1.
        for t in [&mut straight, &mut resumed] {
            let mut left = 40u64;
            while left > 0 {
                left -= t.train_steps(&split.train, left, |_| {})?.steps as u64;
            }
        }
        assert_eq!(straight.step(), 60);
        let bits = |t: &LocalTrainer| t.params().iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&straight), bits(&resumed), "{kind}: parameters diverged after resume");
        assert_eq!(straight.optimizer().state(), resumed.optimizer().state(), "{kind}: optimizer state diverged");
        // And the model's own variables mirror the flat copy.
        assert_eq!(resumed.model().parameters()?, resumed.params());
    }
    Ok(())
}

/// Fashion-MNIST, one epoch of the MLP: at least 82% test accuracy. `.ci/run`
/// installs the data so CI runs this; elsewhere it reports a skip.
#[test]
fn fashion_mnist_one_epoch_mlp_reaches_82_percent() -> anyhow::Result<()> {
    if fashion_mnist_dir(None).is_none() {
        eprintln!("skipped: fashion-mnist not installed (run `shoal data fetch fashion-mnist`)");
        if std::env::var_os("SHOAL_REQUIRE_FASHION_MNIST").is_some() {
            anyhow::bail!("SHOAL_REQUIRE_FASHION_MNIST is set but fashion-mnist is missing");
        }
        return Ok(());
    }
    let split = data::load(&DatasetKind::FashionMnist, None)?;
    assert_eq!((split.train.len(), split.test.len()), (60_000, 10_000));
    let mut t = trainer_for(&split, OptimizerKind::Adamw, 42)?;
    let stats = t.run_epoch(&split.train, |_| {})?;
    assert_eq!(stats.samples, 60_000);
    let acc = t.evaluate(&split.test)?.accuracy;
    eprintln!("fashion-mnist MLP, one epoch: test accuracy {acc:.4}");
    assert!(acc >= 0.82, "fashion-mnist accuracy after one epoch: {acc}");
    Ok(())
}
