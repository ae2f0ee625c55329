//! `shoal bench exchange`: the push and pull of a large model across an
//! in-process cluster (4 nodes by default, 100 MB of f32), the exchange a
//! gloo all-reduce does for DDP. Each node is a worker and owns a quarter of
//! the shards; per step it pushes its gradient to every owner and pulls the
//! new parameters back, over real loopback TCP + noise + yamux. The model is
//! an MLP with two equal hidden layers on the built-in digits, batch 1, so that the
//! step is nearly all exchange. Baseline in the same run: raw loopback TCP
//! moving the bytes the exchange put on the wire. PyTorch's all-reduce of the
//! same bytes runs beside it in `scripts/bench_pytorch.py --cases exchange-4`.

use shoal_models::data::DatasetKind;

use crate::cluster::{Cluster, ClusterSpec};
use crate::cmd::bench::write_json;
use crate::cmd::cli::BenchExchangeArgs;
use crate::config::{Aggregators, NodeConfig};
use crate::policy::compress::{CompressionConfig, PullCompression, PushCompression};

/// The largest model the bench builds, in MB (each of the nodes holds it
/// several times over).
const MAX_MB: f64 = 10_000.0;

/// The cases `--cases` can name.
const CASES: [&str; 3] = ["f32", "int8", "sparse"];

/// A case's printed name, run id and encodings; `None` for a name not in
/// [`CASES`].
fn case(name: &str) -> Option<(&'static str, &'static str, CompressionConfig)> {
    match name {
        "f32" => Some(("f32 push + f32 pull", "exchange-f32", CompressionConfig::default())),
        "int8" => Some((
            "int8+EF push + bf16 pull",
            "exchange-int8",
            CompressionConfig { push: PushCompression::Int8, pull: PullCompression::Bf16 },
        )),
        "sparse" => Some((
            "sparseloco 1.5% push + bf16",
            "exchange-sparse",
            CompressionConfig { push: PushCompression::SparseLoCo { fraction: 0.015 }, pull: PullCompression::Bf16 },
        )),
        _ => None,
    }
}

/// Inputs and classes of the digits data set the model trains on.
const INPUTS: usize = 64;
const CLASSES: usize = 10;

/// One case's figures.
#[derive(Debug, Clone, Copy)]
struct Measured {
    /// Mean over workers of a step's push + pull (BSP wait and the copy
    /// of the new parameters into the model included).
    comm_secs: f64,
    /// Mean over workers of a whole step.
    step_secs: f64,
    /// Payload bytes all workers pushed plus pulled in one step.
    wire_bytes_per_step: f64,
    model_bytes: f64,
    /// The owners' passes over a shard per optimizer step (mean over
    /// every owner's steps; `ShardCore::take_work`).
    owner_passes_per_step: f64,
}

impl Measured {
    /// Model bytes exchanged per second of push + pull: an all-reduce's
    /// "algorithm bandwidth" (the buffer's size over its time).
    fn effective_gb_per_s(&self) -> f64 {
        self.model_bytes / self.comm_secs / 1e9
    }
}

/// Parameters of the MLP `INPUTS-k-k-CLASSES`.
fn params_of(k: usize) -> usize {
    INPUTS * k + k + k * k + k + k * CLASSES + CLASSES
}

/// The width `k` of the two hidden layers that gives about `mb` MB of f32
/// parameters (the model's test-set evaluation at the end stays small, as
/// it would not with one very wide layer).
fn hidden_for(mb: f64) -> usize {
    let target = mb * 1e6 / 4.0;
    // k^2 + (INPUTS + CLASSES + 2) k + CLASSES = target.
    let b = (INPUTS + CLASSES + 2) as f64;
    let k = ((b * b + 4.0 * (target - CLASSES as f64)).max(0.0).sqrt() - b) / 2.0;
    (k.round() as usize).max(1)
}

fn config(args: &BenchExchangeArgs, hidden: usize, run: &str, compression: CompressionConfig) -> NodeConfig {
    let mut cfg = NodeConfig { run_id: run.into(), ..NodeConfig::default() };
    cfg.training.dataset = DatasetKind::Digits;
    cfg.training.mlp_hidden = Some(vec![hidden, hidden]);
    cfg.training.steps = args.steps;
    cfg.training.batch_size = 1;
    cfg.training.lr = Some(0.01);
    cfg.training.eval_every = 0;
    cfg.cluster.shards = args.shards;
    // Every node owns shards from the start, as every rank reduces a part
    // in a ring all-reduce.
    cfg.roles.aggregators = Aggregators::All;
    cfg.cluster.heartbeat_ms = 100;
    cfg.compression = compression;
    // One sample's gradient differs from the next by orders of magnitude
    // in norm, which the default norm check (BSP) would take for an attack:
    // off, so every push counts, as in an all-reduce.
    cfg.aggregation.norm_check = Some(0.0);
    cfg
}

async fn measure(
    args: &BenchExchangeArgs,
    hidden: usize,
    run: &str,
    compression: CompressionConfig,
) -> anyhow::Result<Measured> {
    let cfg = config(args, hidden, run, compression);
    let reports = Cluster::start(&ClusterSpec::new(args.nodes, cfg)).await?.wait().await?;
    let model_bytes = reports.first().map(|r| r.params.len() * 4).unwrap_or(0) as f64;
    let (mut comm, mut step, mut bytes, mut steps) = (0.0, 0.0, 0.0, 0u64);
    let (mut owner_steps, mut owner_passes) = (0u64, 0.0);
    for r in &reports {
        let s = r.status.as_ref().ok_or_else(|| anyhow::anyhow!("{} has no status", r.name))?;
        if s.step != args.steps {
            anyhow::bail!("{} ran {} of {} steps", r.name, s.step, args.steps);
        }
        comm += s.comm_secs;
        step += s.step_secs;
        bytes += (s.bytes_out + s.bytes_in) as f64;
        steps += s.step;
        owner_steps += s.owner_steps;
        owner_passes += s.owner_passes;
    }
    let steps = steps.max(1) as f64;
    Ok(Measured {
        comm_secs: comm / steps,
        step_secs: step / steps,
        wire_bytes_per_step: bytes / args.steps as f64,
        model_bytes,
        owner_passes_per_step: owner_passes / owner_steps.max(1) as f64,
    })
}

#[allow(clippy::print_stdout)] // The CLI's own output.
pub fn run(args: BenchExchangeArgs) -> anyhow::Result<()> {
    if args.nodes < 2 || args.steps < 2 || args.shards < args.nodes as u32 {
        anyhow::bail!("need --nodes >= 2, --steps >= 2 and --shards >= --nodes");
    }
    if !(args.mb.is_finite() && args.mb > 0.0 && args.mb <= MAX_MB) {
        anyhow::bail!("--mb must be above 0 and at most {MAX_MB}");
    }
    if let Some(bad) = args.cases.iter().find(|c| case(c).is_none()) {
        anyhow::bail!("unknown case `{bad}`: use {}", CASES.join(" or "));
    }
    if args.cases.is_empty() {
        anyhow::bail!("--cases names no case: use {}", CASES.join(" or "));
    }

    let threads = crate::ops::threads::configure_process(crate::ops::threads::share(args.nodes));
    let rt = crate::ops::threads::runtime(crate::ops::threads::available())?;
    rt.block_on(async move {
        let hidden = hidden_for(args.mb);
        let model_bytes = params_of(hidden) as f64 * 4.0;
        println!(
            "shoal bench exchange: {} nodes, MLP {INPUTS}-{hidden}-{hidden}-{CLASSES} ({:.1} MB of f32), {} shards, \
             batch 1, BSP, {} steps; {threads} compute thread(s) per node",
            args.nodes,
            model_bytes / 1e6,
            args.shards,
            args.steps,
        );
        let mut measured = Vec::new();
        // Every name was checked above.
        for (name, run, c) in args.cases.iter().filter_map(|c| case(c)) {
            measured.push((name, measure(&args, hidden, run, c).await?));
        }
        // The baseline: the bytes an f32 exchange puts on the wire in one
        // step (each worker pushes and pulls the (n-1)/n of the model that
        // others own), through one raw TCP connection.
        let wire = (model_bytes * 2.0 * (args.nodes - 1) as f64) as usize;
        let raw = shoal_protocol::bench::raw_tcp_transfer(wire, 3).await?.as_secs_f64();
        let raw_gb_per_s = model_bytes / raw / 1e9;
        println!(
            "{:<28} {:>10} {:>10} {:>14} {:>12} {:>10} {:>13}",
            "case", "step ms", "comm ms", "wire MB/step", "model GB/s", "x raw TCP", "owner passes"
        );
        println!(
            "{:<28} {:>10} {:>10.1} {:>14.1} {:>12.3} {:>9.2}x {:>13}",
            "raw TCP (one connection)",
            "",
            raw * 1e3,
            wire as f64 / 1e6,
            raw_gb_per_s,
            1.0,
            ""
        );
        let mut cases = Vec::new();
        for (name, m) in measured {
            println!(
                "{:<28} {:>10.1} {:>10.1} {:>14.1} {:>12.3} {:>9.2}x {:>13.2}",
                name,
                m.step_secs * 1e3,
                m.comm_secs * 1e3,
                m.wire_bytes_per_step / 1e6,
                m.effective_gb_per_s(),
                m.effective_gb_per_s() / raw_gb_per_s,
                m.owner_passes_per_step
            );
            cases.push(serde_json::json!({
                "case": name, "step_secs": m.step_secs, "comm_secs": m.comm_secs,
                "wire_bytes_per_step": m.wire_bytes_per_step,
                "effective_gb_per_s": m.effective_gb_per_s(),
                "over_raw_tcp": m.effective_gb_per_s() / raw_gb_per_s,
                "owner_passes_per_step": m.owner_passes_per_step,
            }));
        }
        println!(
            "model GB/s: the model's bytes over a worker's push + pull time per step (mean over workers and steps); \
             raw TCP: an f32 step's wire bytes (2 (n-1) x the model) through one loopback connection; \
             owner passes: loops over a shard an owner ran per step (taking pushes in, norms, the mean, the optimizer; \
             a sparse push's loop counts its kept entries)"
        );
        write_json(
            args.json.as_deref(),
            &serde_json::json!({
                "bench": "exchange", "nodes": args.nodes, "model_bytes": model_bytes,
                "shards": args.shards, "steps": args.steps, "threads_per_node": threads,
                "raw_tcp": { "secs": raw, "wire_bytes": wire, "effective_gb_per_s": raw_gb_per_s },
                "cases": cases,
            }),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hidden_width_gives_the_asked_size() {
        for mb in [1.0, 10.0, 100.0] {
            let k = hidden_for(mb);
            let bytes = params_of(k) as f64 * 4.0;
            // Within one unit of width (2k + 77 parameters) of the target.
            assert!((bytes - mb * 1e6).abs() <= 4.0 * (2 * k + 77) as f64, "{mb} MB: {bytes}");
        }
    }
}
