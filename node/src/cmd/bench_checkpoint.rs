//! `shoal bench checkpoint`: how long an owner's checkpoint writer takes
//! for one shard, against the same bytes written and fsynced with plain
//! `std::fs` in the same run (what the safetensors encoding, the atomic
//! rename and the pruning cost on top of the disk).

use std::io::Write;
use std::time::Instant;

use serde::Serialize;
use shoal_models::{
    ArchKind, ImageShape, ModelConfig, OptimizerConfig, OptimizerKind, ShardCheckpoint, ShardDir, ShardOf,
};

use crate::cmd::cli::BenchCheckpointArgs;

/// What `--json` writes.
#[derive(Debug, Serialize)]
pub struct CheckpointBench {
    pub shard_mb: f64,
    pub file_mb: f64,
    pub repeats: usize,
    /// Median seconds per shard checkpoint (encode, write, fsync, rename, prune).
    pub checkpoint_secs: f64,
    /// Median seconds to write and fsync the same number of bytes.
    pub raw_write_secs: f64,
    /// raw / checkpoint throughput: 1.0 means the checkpoint costs no more than the disk.
    pub ratio: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

#[allow(clippy::print_stdout)] // The CLI's own output.
pub fn run(args: BenchCheckpointArgs) -> anyhow::Result<()> {
    if args.shard_mb == 0 || args.repeats == 0 {
        anyhow::bail!("--shard-mb and --repeats must be at least 1");
    }
    let dir = match &args.dir {
        Some(d) => tempfile::Builder::new().prefix("shoal-bench-").tempdir_in(d)?,
        None => tempfile::tempdir()?,
    };
    let n = args.shard_mb * 1_000_000 / 4;
    let optimizer = OptimizerConfig::new(OptimizerKind::Sgd, 0.05);
    let mut opt = shoal_models::Optimizer::new(optimizer, n)?;
    let mut params: Vec<f32> = (0..n).map(|i| (i as f32 * 1e-6).sin()).collect();
    opt.step(&mut params, &vec![1e-3; n])?;
    let ckpt = ShardCheckpoint { shard: 0, range: 0..n, version: 1, step: 1, params, optimizer: opt.into_state() };
    let of = ShardOf {
        run_id: "bench".into(),
        model: ModelConfig::new(ArchKind::Mlp, ImageShape { channels: 1, height: 8, width: 8 }, 10),
        shards: 1,
    };
    let shard_dir = ShardDir::new(dir.path().join("ckpt"), of, 2);
    println!(
        "shoal bench checkpoint: a {} MB shard with SGD momentum, {} repeats, in {}",
        args.shard_mb,
        args.repeats,
        dir.path().display()
    );
    let mut ckpt_secs = Vec::new();
    let mut last = None;
    for r in 0..args.repeats {
        let c = ShardCheckpoint { version: r as u64 + 1, ..ckpt.clone() };
        let t = Instant::now();
        let path = shard_dir.write(&c)?;
        ckpt_secs.push(t.elapsed().as_secs_f64());
        last = Some(path);
    }
    // The baseline writes the very bytes of the last checkpoint file.
    let raw = std::fs::read(last.ok_or_else(|| anyhow::anyhow!("no checkpoint written"))?)?;
    let file_bytes = raw.len() as u64;
    let mut raw_secs = Vec::new();
    for r in 0..args.repeats {
        let path = dir.path().join(format!("raw-{r}"));
        let t = Instant::now();
        let mut f = std::fs::File::create(&path)?;
        f.write_all(&raw)?;
        f.sync_all()?;
        raw_secs.push(t.elapsed().as_secs_f64());
        std::fs::remove_file(&path)?;
    }
    let (c, w) = (median(ckpt_secs), median(raw_secs));
    let report = CheckpointBench {
        shard_mb: args.shard_mb as f64,
        file_mb: file_bytes as f64 / 1e6,
        repeats: args.repeats,
        checkpoint_secs: c,
        raw_write_secs: w,
        ratio: w / c,
    };
    println!(
        "shard checkpoint ({:.0} MB file): {:.3} s ({:.0} MB/s); raw write+fsync of the same bytes: {:.3} s ({:.0} MB/s); raw/checkpoint {:.2}x",
        report.file_mb,
        c,
        report.file_mb / c,
        w,
        report.file_mb / w,
        report.ratio
    );
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
        println!("numbers written to {}", path.display());
    }
    Ok(())
}
