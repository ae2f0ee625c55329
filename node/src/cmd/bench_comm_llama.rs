//! `shoal bench comm --workload llama`: bytes against loss on a language
//! model. 4 in-process nodes over loopback TCP, each behind an emulated
//! link, train the same Llama from the same initial model on the text
//! shipped with the binary, for the same token budget, in pull mode with
//! fixed owners; each case changes only how the nodes communicate:
//!
//! - `dense`: every step's gradient pushed in f32 and the model pulled in
//!   f32 (BSP), the baseline;
//! - DiLoCo (`local_steps`): H local AdamW steps, then the round's
//!   pseudo-gradient pushed and the owners' outer Nesterov step pulled;
//! - the same with int8 pushes, with SparseLoCo-class pushes (top-k per
//!   chunk, 2-bit values, error feedback), and with those and bf16 pulls;
//! - delta pulls (`local_steps.delta`): the owners send each round's update,
//!   int8, SparseLoCo-class or top-k, in place of the shard.
//!
//! Each case reports the payload bytes the workers pushed and pulled over
//! the network (all nodes, both directions), the held-out loss at the end,
//! and the compute utilization (compute time over step time).

use std::time::Instant;

use shoal_models::data::{ImageShape, SAMPLE_TEXT};
use shoal_models::llama::Float;
use shoal_models::{Arch, ArchKind, DatasetKind, LlamaSize, ModelConfig, OptimizerKind};

use crate::cluster::{Cluster, ClusterSpec};
use crate::cmd::bench::write_json;
use crate::cmd::cli::BenchCommArgs;
use crate::config::{LocalStepsConfig, NodeConfig};
use crate::policy::compress::{CompressionConfig, PullCompression, PushCompression};
use crate::policy::sync::SyncPolicy;

const NODES: usize = 4;
/// Bytes per window the model reads.
const CONTEXT: usize = 64;
/// 2 layers, 4 query and 2 key/value heads, width 64, an untied head: the
/// Llama of the cluster tests, about 125k parameters.
const SIZE: LlamaSize = LlamaSize {
    layers: 2,
    heads: 4,
    kv_heads: 2,
    width: 64,
    ff: 176,
    tie: false,
    rope_theta: Float(10_000.0),
    norm_eps: Float(1e-5),
};
/// AdamW's rate, the same in every case (DiLoCo's inner optimizer).
const LR: f64 = 2e-3;
/// The rounds' local steps of the DiLoCo cases that compress.
const H: u64 = 30;
/// The share of each chunk a SparseLoCo-class push keeps (Templar's).
const SPARSE: f32 = 0.015;

/// One case: how the nodes communicate.
#[derive(Debug, Clone, Copy)]
struct Case {
    name: &'static str,
    local_steps: u64,
    push: PushCompression,
    pull: PullCompression,
    /// The setting `docs/operations.md` recommends for slow links.
    recommended: bool,
    /// The owners' outer learning rate and Nesterov momentum (none:
    /// DiLoCo's 0.7 and 0.9).
    outer: Option<(f64, f64)>,
    /// Delta pulls (`local_steps.delta`): how the owners send each round's
    /// update; `None` pulls whole shards.
    delta: PushCompression,
}

const fn case(name: &'static str, local_steps: u64, push: PushCompression, pull: PullCompression) -> Case {
    Case { name, local_steps, push, pull, recommended: false, outer: None, delta: PushCompression::None }
}

/// The cases, the first of which (dense) is every other's baseline.
fn cases() -> Vec<Case> {
    use PullCompression as Pull;
    use PushCompression as Push;
    let sparse = Push::SparseLoCo { fraction: SPARSE };
    // Plain averaging of the workers' models (outer rate 1, no momentum):
    // SparseLoCo's outer step, whose error feedback stands in for momentum.
    let avg = Some((1.0, 0.0));
    vec![
        case("dense", 1, Push::None, Pull::None),
        case("diloco H=30", H, Push::None, Pull::None),
        Case { outer: avg, ..case("diloco H=30 avg", H, Push::None, Pull::None) },
        Case { outer: avg, ..case("diloco H=30 avg int8", H, Push::Int8, Pull::None) },
        Case { outer: avg, ..case("diloco H=30 avg int8 bf16-pull", H, Push::Int8, Pull::Bf16) },
        Case { outer: avg, ..case("sparseloco H=30", H, sparse, Pull::None) },
        Case { outer: avg, ..case("sparseloco H=30 bf16-pull", H, sparse, Pull::Bf16) },
        Case { outer: avg, ..case("sparseloco 5% H=30 bf16-pull", H, Push::SparseLoCo { fraction: 0.05 }, Pull::Bf16) },
        Case {
            outer: avg,
            delta: Push::Int8,
            recommended: true,
            ..case("diloco H=30 avg int8 delta-int8", H, Push::Int8, Pull::None)
        },
        Case { outer: avg, delta: sparse, ..case("sparseloco H=30 delta-sparse", H, sparse, Pull::None) },
        Case {
            outer: avg,
            delta: Push::SparseLoCo { fraction: 0.05 },
            ..case("sparseloco 5% H=30 delta-sparse 5%", H, Push::SparseLoCo { fraction: 0.05 }, Pull::None)
        },
        Case {
            outer: avg,
            delta: Push::SparseLoCo { fraction: 0.05 },
            ..case("sparseloco 5% H=15 delta-sparse 5%", 15, Push::SparseLoCo { fraction: 0.05 }, Pull::None)
        },
        Case {
            outer: avg,
            delta: Push::TopK { fraction: SPARSE },
            ..case("topk 1.5% H=30 delta-topk 1.5%", H, Push::TopK { fraction: SPARSE }, Pull::None)
        },
    ]
}

/// What one case measured.
#[derive(Debug, Clone, Copy)]
struct Outcome {
    /// Payload bytes the workers pushed and pulled over the network, all
    /// nodes.
    bytes_total: u64,
    /// The nodes' mean held-out loss at the end (nats per token).
    val_loss: f64,
    bits_per_byte: f64,
    /// Compute time over step time, all workers' steps.
    utilization: f64,
    wall_secs: f64,
    /// Delta pulls that did not lead to the owners' shard (all nodes).
    delta_mismatches: u64,
}

async fn measure(cfg: NodeConfig) -> anyhow::Result<Outcome> {
    let started = Instant::now();
    let reports = Cluster::start(&ClusterSpec::new(NODES, cfg)).await?.wait().await?;
    let wall_secs = started.elapsed().as_secs_f64();
    let (mut bytes, mut loss, mut bpb, mut compute, mut step) = (0u64, 0.0, 0.0, 0.0, 0.0);
    let mut delta_mismatches = 0;
    for r in &reports {
        let s = r.status.as_ref().ok_or_else(|| anyhow::anyhow!("{} has no status", r.name))?;
        bytes += s.bytes_out + s.bytes_in;
        delta_mismatches += s.delta_mismatches;
        loss += f64::from(r.loss);
        bpb += f64::from(r.bits_per_byte.unwrap_or(f32::NAN));
        compute += s.compute_secs;
        step += s.step_secs;
    }
    let n = reports.len().max(1) as f64;
    Ok(Outcome {
        bytes_total: bytes,
        val_loss: loss / n,
        bits_per_byte: bpb / n,
        utilization: if step > 0.0 { compute / step } else { 0.0 },
        wall_secs,
        delta_mismatches,
    })
}

/// The node config of `case` on a link of `mbps` (0: loopback).
fn case_config(args: &BenchCommArgs, text: &std::path::Path, case: &Case, mbps: f64, run: usize) -> NodeConfig {
    let mut cfg = NodeConfig { run_id: format!("bench-comm-llama-{run}"), ..NodeConfig::default() };
    cfg.training.model = ArchKind::Llama;
    cfg.training.llama = Some(SIZE);
    cfg.training.dataset = DatasetKind::Text { path: text.to_path_buf(), context: CONTEXT };
    cfg.training.steps = args.steps;
    cfg.training.batch_size = batch(args);
    cfg.training.optimizer = OptimizerKind::Adamw;
    cfg.training.lr = Some(LR);
    // Evaluated once, at the end: the loss every case is judged by.
    cfg.training.eval_every = 0;
    cfg.training.threads = Some(crate::ops::threads::share(NODES));
    cfg.cluster.heartbeat_ms = 100;
    // Fixed owners: every case moves the same shards between the same nodes.
    cfg.roles.elastic = false;
    cfg.sync.policy = SyncPolicy::Bsp;
    cfg.local_steps = local_steps_of(case);
    cfg.compression = CompressionConfig { push: case.push, pull: case.pull };
    cfg.faults.link_mbps = mbps;
    cfg.faults.link_latency_ms = if mbps > 0.0 { args.latency_ms } else { 0.0 };
    cfg
}

/// The `[local_steps]` table of `case` (none for a step-by-step case).
fn local_steps_of(case: &Case) -> Option<LocalStepsConfig> {
    let l = LocalStepsConfig { delta: case.delta, ..LocalStepsConfig::per_round(case.local_steps)? };
    Some(match case.outer {
        Some((outer_lr, outer_momentum)) => LocalStepsConfig { outer_lr, outer_momentum, ..l },
        None => l,
    })
}

fn batch(args: &BenchCommArgs) -> usize {
    args.batch_size.unwrap_or(8)
}

/// The cases to run: all, or dense and the ones `--cases` names (an
/// unknown name is an error).
fn chosen(args: &BenchCommArgs) -> anyhow::Result<Vec<Case>> {
    let all = cases();
    if let Some(bad) = args.cases.iter().find(|n| !all.iter().any(|c| c.name == n.as_str())) {
        let names: Vec<&str> = all.iter().map(|c| c.name).collect();
        anyhow::bail!("--cases: no llama case `{bad}`; the cases are {}", names.join(", "));
    }
    Ok(all
        .into_iter()
        .enumerate()
        .filter(|(i, c)| *i == 0 || args.cases.is_empty() || args.cases.iter().any(|n| n == c.name))
        .map(|(_, c)| c)
        .collect())
}

/// One case's line of the table (and a note of any delta mismatch), and
/// its JSON row; `base` is dense's outcome on the same link.
#[allow(clippy::print_stdout)] // The CLI's own output.
fn report_case(c: &Case, mbps: f64, m: &Outcome, base: &Outcome) -> serde_json::Value {
    let fewer = base.bytes_total as f64 / m.bytes_total.max(1) as f64;
    let worse = m.val_loss / base.val_loss - 1.0;
    println!(
        "{:<34} {:>12} {:>9.1}x {:>9.4} {:>+8.2}% {:>10.3} {:>8.3} {:>7.1}{}",
        c.name,
        m.bytes_total,
        fewer,
        m.val_loss,
        100.0 * worse,
        m.bits_per_byte,
        m.utilization,
        m.wall_secs,
        if c.recommended { "  (recommended)" } else { "" }
    );
    if m.delta_mismatches > 0 {
        println!("  {} delta pulls did not match the owners' shards (each pulled it whole)", m.delta_mismatches);
    }
    let outer = local_steps_of(c).map(|l| (l.outer_lr, l.outer_momentum));
    serde_json::json!({
        "name": c.name, "link_mbps": mbps, "local_steps": c.local_steps,
        "push": c.push.to_string(), "pull": c.pull.to_string(), "delta": c.delta.to_string(),
        "outer_lr": outer.map(|o| o.0), "outer_momentum": outer.map(|o| o.1),
        "delta_mismatches": m.delta_mismatches,
        "bytes_total": m.bytes_total, "fewer_bytes_than_dense": fewer,
        "val_loss": m.val_loss, "val_loss_vs_dense": worse, "bits_per_byte": m.bits_per_byte,
        "utilization": m.utilization, "wall_secs": m.wall_secs, "recommended": c.recommended,
    })
}

/// `shoal bench comm --workload llama`.
#[allow(clippy::print_stdout)] // The CLI's own output.
pub fn run(args: BenchCommArgs) -> anyhow::Result<()> {
    let cases = chosen(&args)?;
    let dir = tempfile::tempdir()?;
    let text = match &args.text {
        Some(path) => path.clone(),
        None => {
            let path = dir.path().join("gpl-3.0.txt");
            std::fs::write(&path, SAMPLE_TEXT)?;
            path
        }
    };
    let bytes = std::fs::metadata(&text).map_err(|e| anyhow::anyhow!("--text {}: {e}", text.display()))?.len();
    let model = ModelConfig {
        arch: Arch::Llama { size: SIZE, context: CONTEXT },
        input: ImageShape { channels: 1, height: 1, width: CONTEXT + 1 },
        classes: 256,
    };
    let threads = crate::ops::threads::configure_process(crate::ops::threads::share(NODES));
    let rt = crate::ops::threads::runtime(crate::ops::threads::available())?;
    let tokens = args.steps * (batch(&args) * CONTEXT) as u64;
    println!(
        "shoal bench comm --workload llama: {NODES} nodes on loopback TCP, {} ({} parameters) over the bytes \
         of {} ({bytes} bytes), batch {} windows of {CONTEXT} per node, {} steps ({tokens} tokens per node), \
         AdamW {LR}, {threads} compute threads per node",
        model.describe(),
        SIZE.parameters(256),
        args.text.as_ref().map_or_else(|| "the built-in text".to_string(), |p| p.display().to_string()),
        batch(&args),
        args.steps,
    );
    let mut points: Vec<shoal_testnet::report::LabelledPoint> = Vec::new();
    let rows = rt.block_on(async {
        let mut rows = Vec::new();
        for &mbps in &args.links {
            let link = if mbps > 0.0 { format!("{mbps} Mbit/s, {} ms", args.latency_ms) } else { "loopback".into() };
            println!("\nlink: {link} on every node, each way");
            println!(
                "{:<34} {:>12} {:>10} {:>9} {:>9} {:>10} {:>8} {:>7}",
                "case", "bytes", "vs dense", "val loss", "vs dense", "bits/byte", "util", "wall s"
            );
            let mut dense: Option<Outcome> = None;
            for c in &cases {
                let m = measure(case_config(&args, &text, c, mbps, rows.len())).await?;
                let base = *dense.get_or_insert(m);
                let label = if args.links.len() > 1 { format!("{} ({mbps} Mbit/s)", c.name) } else { c.name.into() };
                points.push((label, m.bytes_total as f64, m.val_loss));
                rows.push(report_case(c, mbps, &m, &base));
            }
        }
        anyhow::Ok(rows)
    })?;
    println!(
        "\nbytes: payload bytes the workers pushed and pulled over the network, all {NODES} nodes, both \
         directions. val loss: the nodes' mean held-out loss (nats per byte) at the end; vs dense: relative. \
         util: compute time over step time, all workers."
    );
    if let Some(path) = &args.plot {
        let title = format!("{NODES} nodes, {} steps: bytes on the wire against held-out loss", args.steps);
        shoal_testnet::report::plot_points(
            path,
            &title,
            ("bytes, all nodes (log)", "held-out loss, nats/byte"),
            &points,
        )?;
        println!("plot written to {}", path.display());
    }
    write_json(
        args.json.as_deref(),
        &serde_json::json!({
            "bench": "comm", "workload": "llama", "model": model.describe(), "parameters": SIZE.parameters(256),
            "text_bytes": bytes, "nodes": NODES, "batch_size": batch(&args), "context": CONTEXT, "steps": args.steps,
            "tokens_per_node": tokens, "threads_per_node": threads, "latency_ms": args.latency_ms, "cases": rows,
        }),
    )
}
