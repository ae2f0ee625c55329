//! `shoal demo`: a whole cluster in one process, on real loopback sockets,
//! with live per-node progress.

use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

use crate::cluster::{Cluster, ClusterSpec};
use crate::cmd::cli::DemoArgs;
use crate::config::NodeConfig;

/// The demo's learning rate when `--lr` is not given: a finite run of a
/// few hundred steps at 4 workers' batch, decayed by cosine (the demo's
/// default `--lr-decay`). On Fashion-MNIST (4 nodes, batch 64, 235 steps)
/// it ends at 84.5% (seed 42) where the optimizer's default 0.05 at a
/// constant rate ends at 81.2% (docs/benchmarks.md). Not with DiLoCo's
/// local steps: 4 of them at 0.15 diverged, so those keep the optimizer's
/// default.
const DEMO_LR: f64 = 0.15;

#[allow(clippy::print_stdout)] // The CLI's own output.
pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    if args.nodes == 0 || args.steps == 0 {
        anyhow::bail!("--nodes and --steps must be at least 1");
    }
    let mut base = NodeConfig { run_id: "demo".into(), ..NodeConfig::default() };
    base.training.model = args.model;
    base.training.dataset = args.dataset.clone();
    base.training.data_dir = args.data_dir.clone();
    base.training.steps = args.steps;
    base.training.batch_size = args.batch_size;
    base.training.lr = args.lr.or((args.local_steps <= 1).then_some(DEMO_LR));
    base.training.lr_decay = args.lr_decay;
    base.training.seed = args.seed;
    base.sync.policy = args.sync;
    base.cluster.mode = args.mode;
    base.cluster.shards = args.shards;
    base.compression.push = args.compress_push;
    base.compression.pull = args.compress_pull;
    base.sync.overlap = args.overlap;
    base.local_steps = crate::config::LocalStepsConfig::per_round(args.local_steps);
    base.cluster.start_timeout_ms = 30_000;
    // The nodes share this host: each gets its share (or --threads).
    let threads = crate::ops::threads::resolve(args.threads, args.nodes);
    crate::ops::threads::configure_process(threads);
    base.training.threads = Some(threads);
    let spec = ClusterSpec::new(args.nodes, base);
    println!(
        "shoal demo: {} nodes on loopback TCP, {} {} on {}, mode {:?}, sync {}, {} shards, {threads} compute threads per node",
        args.nodes, args.steps, args.model, args.dataset, args.mode, args.sync, args.shards
    );
    let rt = crate::ops::threads::runtime(crate::ops::threads::available())?;
    rt.block_on(async move {
        let cluster = Cluster::start(&spec).await?;
        let multi = MultiProgress::new();
        let style = ProgressStyle::with_template("{prefix:>6} [{bar:30.cyan/blue}] {pos:>4}/{len:4} {msg}")?
            .progress_chars("=> ");
        let bars: Vec<(ProgressBar, crate::handles::status::StatusHandle)> = cluster
            .nodes
            .iter()
            .map(|n| {
                let b = multi.add(ProgressBar::new(args.steps).with_style(style.clone()));
                b.set_prefix(n.name.clone());
                (b, n.status.clone())
            })
            .collect();
        // Refresh the display from status snapshots while the cluster runs.
        let ui = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(200));
            loop {
                tick.tick().await;
                for (bar, status) in &bars {
                    if let Some(s) = status.snapshot().await {
                        bar.set_position(s.step);
                        bar.set_message(format!(
                            "{:<10} shards {:<12} {:>7.0} samples/s loss {}",
                            format!("{:?}", s.role).to_lowercase(),
                            format!("{:?}", s.owned_shards),
                            s.samples_per_sec,
                            s.last_loss.map(|l| format!("{l:.3}")).unwrap_or_else(|| "-".into())
                        ));
                    }
                }
            }
        });
        let reports = cluster.wait().await;
        ui.abort();
        multi.clear().ok();
        let reports = reports?;
        for r in &reports {
            println!(
                "{}: {} after {} steps, owned shards {:?}{}",
                r.name,
                r.headline(),
                r.steps,
                r.owned_shards,
                r.status
                    .as_ref()
                    .map(|s| format!(
                        ", {:.0} samples/s, {} B out, {} B in",
                        s.samples_per_sec, s.bytes_out, s.bytes_in
                    ))
                    .unwrap_or_default()
            );
        }
        if let (Some(path), Some(first)) = (&args.output, reports.first()) {
            first.write_model(&spec.base, path).await?;
            println!(
                "model of {} written to {} (test accuracy {:.2}%; check it with `shoal eval --model {}`)",
                first.name,
                path.display(),
                first.accuracy * 100.0,
                path.display()
            );
        }
        Ok(())
    })
}
