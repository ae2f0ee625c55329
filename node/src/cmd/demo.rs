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

/// The nodes' config from the demo's flags (checked), with each node's
/// share of this host's cores; returns it and the threads per node.
fn demo_config(args: &DemoArgs) -> anyhow::Result<(NodeConfig, usize)> {
    if args.nodes == 0 || args.steps == 0 {
        anyhow::bail!("--nodes and --steps must be at least 1");
    }
    if args.straggler > 0 && (args.nodes < 2 || args.mode != crate::config::Mode::Pull) {
        anyhow::bail!("--straggler needs pull mode and at least 2 nodes: a slow owner's shards move to another");
    }
    if args.output_hf.is_some() && args.model != shoal_models::ArchKind::Llama {
        anyhow::bail!("--output-hf writes a Hugging Face LlamaForCausalLM: it needs --model llama, not {}", args.model);
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
    Ok((base, threads))
}

#[allow(clippy::print_stdout)] // The CLI's own output.
pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    let (base, threads) = demo_config(&args)?;
    let spec = ClusterSpec::new(args.nodes, base);
    println!(
        "shoal demo: {} nodes on loopback TCP, {} {} on {}, mode {:?}, sync {}, {} shards, {threads} compute threads per node",
        args.nodes, args.steps, args.model, args.dataset, args.mode, args.sync, args.shards
    );
    let rt = crate::ops::threads::runtime(crate::ops::threads::available())?;
    rt.block_on(async move {
        let cluster = Cluster::start(&spec).await?;
        let pages: Vec<String> =
            cluster.nodes.iter().filter_map(|n| Some(format!("{} http://{}/", n.name, n.http?))).collect();
        if !pages.is_empty() {
            println!("live charts (status pages): {}", pages.join(", "));
        }
        let straggler = (args.straggler > 0).then(|| {
            let nodes = cluster.nodes.iter().map(|n| (n.name.clone(), n.status.clone(), n.faults.clone())).collect();
            let log = std::sync::Arc::new(std::sync::Mutex::new(StragglerLog::default()));
            let task = tokio::spawn(watch_straggler(nodes, args.straggler, args.steps / 3, log.clone()));
            (task, log)
        });
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
        let straggler = straggler.map(|(task, log)| {
            task.abort();
            log.lock().map(|l| l.clone()).unwrap_or_default()
        });
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
        if let Some(log) = straggler {
            for line in log.summary(args.straggler) {
                println!("{line}");
            }
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
        if let (Some(dir), Some(first)) = (&args.output_hf, reports.first()) {
            first.write_hf(&spec.base, dir).await?;
            println!("Hugging Face directory of {} written to {}", first.name, dir.display());
        }
        Ok(())
    })
}

/// `--straggler`: what the demo saw of its slowed owner.
#[derive(Debug, Clone, Default)]
struct StragglerLog {
    /// The node slowed, the shards it owned then, the step and the
    /// seconds (since the watch began) it was slowed at.
    slowed: Option<(String, Vec<u32>, u64, f64)>,
    /// When it owned no shard any more: seconds and step.
    demoted: Option<(f64, u64)>,
    /// Who owned its shards then.
    new_owners: Vec<(String, Vec<u32>)>,
    /// (seconds, samples trained by all nodes): when training began, when
    /// the straggler was slowed, demoted, and the latest reading.
    began: Option<(f64, u64)>,
    at_slow: Option<(f64, u64)>,
    at_demote: Option<(f64, u64)>,
    last: Option<(f64, u64)>,
}

impl StragglerLog {
    /// Samples per second from `a` to `b`.
    fn rate(a: Option<(f64, u64)>, b: Option<(f64, u64)>) -> Option<f64> {
        let ((ta, sa), (tb, sb)) = (a?, b?);
        (tb > ta).then(|| (sb.saturating_sub(sa)) as f64 / (tb - ta))
    }

    /// What happened, in lines.
    fn summary(&self, delay_ms: u64) -> Vec<String> {
        let Some((name, owned, step, at)) = &self.slowed else {
            return vec!["straggler: no owner slowed (the run ended first, or no node owned a shard)".into()];
        };
        let mut out = vec![format!(
            "straggler: {name}, owner of shards {owned:?}, answers {delay_ms} ms late from step {step} ({at:.1} s)"
        )];
        match self.demoted {
            Some((t, s)) => {
                let owners: Vec<String> = self.new_owners.iter().map(|(n, o)| format!("{n} {o:?}")).collect();
                out.push(format!(
                    "  demoted at step {s} ({t:.1} s): its shards moved {:.1} s after the slowdown; owners now {}",
                    t - at,
                    owners.join(", ")
                ));
            }
            None => out.push("  never demoted before the run ended (a longer run, or a longer delay, shows it)".into()),
        }
        let before = Self::rate(self.began, self.at_slow);
        let during = Self::rate(self.at_slow, self.at_demote.or(self.last));
        let after = self.at_demote.and_then(|d| Self::rate(Some(d), self.last));
        let show = |r: Option<f64>| r.map_or("-".to_string(), |r| format!("{r:.0}"));
        let ratio = match (before, after) {
            (Some(b), Some(a)) if b > 0.0 => format!(" ({:.2}x of before)", a / b),
            _ => String::new(),
        };
        out.push(format!(
            "  cluster samples/s: before {}, slowed {}, after the move {}{ratio}",
            show(before),
            show(during),
            show(after)
        ));
        out
    }
}

/// One node as the straggler watch sees it: name, status, faults.
type Watched = (String, crate::handles::status::StatusHandle, std::sync::Arc<crate::ops::faults::Faults>);

/// `--straggler`: once the cluster passes `at_step`, the last node that
/// owns shards answers every push and pull `delay_ms` late; then note when it owns none, and the
/// cluster's samples throughout. Samples the nodes' status every 100 ms
/// (a reading for the summary, not a synchronisation), until aborted.
async fn watch_straggler(
    nodes: Vec<Watched>,
    delay_ms: u64,
    at_step: u64,
    log: std::sync::Arc<std::sync::Mutex<StragglerLog>>,
) {
    let start = tokio::time::Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut slowed: Option<usize> = None;
    loop {
        tick.tick().await;
        let mut snaps = Vec::with_capacity(nodes.len());
        for (_, status, _) in &nodes {
            snaps.push(status.snapshot().await.unwrap_or_default());
        }
        let now = start.elapsed().as_secs_f64();
        let samples: u64 = snaps.iter().map(|s| s.samples).sum();
        let step = snaps.iter().map(|s| s.step).max().unwrap_or(0);
        let Ok(mut l) = log.lock() else { return };
        if samples > 0 {
            l.began.get_or_insert((now, samples));
            l.last = Some((now, samples));
        }
        match slowed {
            None if step >= at_step => {
                if let Some(i) = snaps.iter().rposition(|s| !s.owned_shards.is_empty()) {
                    nodes[i].2.set_serve_delay_ms(delay_ms);
                    slowed = Some(i);
                    l.slowed = Some((nodes[i].0.clone(), snaps[i].owned_shards.clone(), step, now));
                    l.at_slow = Some((now, samples));
                }
            }
            Some(i) if l.demoted.is_none() && snaps[i].owned_shards.is_empty() => {
                l.demoted = Some((now, step));
                l.at_demote = Some((now, samples));
                l.new_owners = nodes
                    .iter()
                    .zip(&snaps)
                    .filter(|(_, s)| !s.owned_shards.is_empty())
                    .map(|((n, _, _), s)| (n.clone(), s.owned_shards.clone()))
                    .collect();
            }
            _ => {}
        }
    }
}
