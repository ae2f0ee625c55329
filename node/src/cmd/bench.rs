//! `shoal bench train`: single-node throughput.
//!
//! Every figure is printed next to a baseline measured in the same run:
//! - training samples/s for each model against forward-only samples/s of the
//!   same model on the same batches (what backward + optimizer cost);
//! - candle's matmul GFLOP/s against a naive triple loop (what the gemm
//!   kernels buy over the obvious code).

use std::hint::black_box;
use std::time::Instant;

use anyhow::Context;
use candle_core::{Device, Tensor};
use shoal_models::{data, ArchKind, DatasetKind, LocalTrainer, ModelConfig, OptimizerConfig, OptimizerKind, Split};

use crate::cmd::cli::{BenchTrainArgs, BenchWireArgs};
use crate::config::NodeConfig;
use crate::node::NodeReport;

/// Write a benchmark's numbers to `--json PATH`, if given.
#[allow(clippy::print_stdout)] // The CLI's own output.
pub(crate) fn write_json(path: Option<&std::path::Path>, value: &serde_json::Value) -> anyhow::Result<()> {
    if let Some(path) = path {
        let text = serde_json::to_string_pretty(value)?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
        println!("numbers written to {}", path.display());
    }
    Ok(())
}

/// `shoal bench wire`: the protocol crate's wire benchmark.
#[allow(clippy::print_stdout)] // The CLI's own output.
pub fn wire(args: BenchWireArgs) -> anyhow::Result<()> {
    if args.shard_mb == 0 {
        anyhow::bail!("--shard-mb must be at least 1");
    }
    let opts = shoal_protocol::bench::WireBenchOptions {
        shard_bytes: args.shard_mb * 1_000_000,
        quic: !args.skip_quic,
        codecs: !args.skip_codecs,
        ..Default::default()
    };
    let rt = tokio::runtime::Runtime::new()?;
    let report = rt.block_on(shoal_protocol::bench::run_wire_bench(opts))?;
    println!("{report}");
    let transfer = |t: &shoal_protocol::bench::TransferResult| {
        serde_json::json!({
            "transport": t.name, "best_secs": t.best.as_secs_f64(),
            "mb_per_s": t.mb_per_s, "ratio_to_raw_tcp": t.ratio_to_raw_tcp,
        })
    };
    let codecs: Vec<serde_json::Value> = report
        .codecs
        .iter()
        .map(|c| {
            serde_json::json!({
                "encoding": c.encoding, "bytes_per_element": c.bytes_per_element,
                "encode_mb_per_s": c.encode_mb_per_s, "decode_mb_per_s": c.decode_mb_per_s,
                "encode_ratio_to_memcpy": c.encode_ratio_to_memcpy,
                "decode_ratio_to_memcpy": c.decode_ratio_to_memcpy,
            })
        })
        .collect();
    write_json(
        args.json.as_deref(),
        &serde_json::json!({
            "bench": "wire",
            "shard_bytes": report.options.shard_bytes,
            "raw_tcp": transfer(&report.raw_tcp),
            "tcp_noise_yamux": transfer(&report.tcp_noise_yamux),
            "quic": report.quic.as_ref().map(transfer),
            "memcpy": {
                "preallocated_mb_per_s": report.memcpy.preallocated_mb_per_s,
                "fresh_alloc_mb_per_s": report.memcpy.fresh_alloc_mb_per_s,
            },
            "codecs": codecs,
        }),
    )
}

#[allow(clippy::print_stdout)] // The CLI's own output.
pub fn train(args: BenchTrainArgs) -> anyhow::Result<()> {
    if args.steps == 0 || args.batch_size == 0 || args.matmul_size == 0 {
        anyhow::bail!("--steps, --batch-size and --matmul-size must be at least 1");
    }
    let threads = crate::ops::threads::configure_process(crate::ops::threads::resolve(args.threads, 1));
    let device = args.device.open()?;
    let archs = args.model.map_or_else(|| vec![ArchKind::Mlp, ArchKind::Cnn, ArchKind::Llama], |a| vec![a]);
    let images = archs.iter().any(|a| *a != ArchKind::Llama);
    let (kind, split) = match data::load(&DatasetKind::FashionMnist, args.data_dir.as_deref()) {
        Ok(s) if images => (DatasetKind::FashionMnist, s),
        Ok(_) => (DatasetKind::Digits, data::load(&DatasetKind::Digits, None)?),
        Err(e) => {
            if images {
                println!("fashion-mnist unavailable ({e}); benchmarking on digits");
            }
            (DatasetKind::Digits, data::load(&DatasetKind::Digits, None)?)
        }
    };
    let dataset = if images { format!("dataset {kind}, ") } else { String::new() };
    println!(
        "shoal bench train: {dataset}batch {}, {} timed steps, device {} in {}, {threads} compute threads",
        args.batch_size, args.steps, args.device, args.dtype
    );
    println!(
        "{:<48} {:>12} {:>12} {:>10} {:>12} {:>12} {:>10}",
        "model", "train smp/s", "fwd smp/s", "train/fwd", "grads smp/s", "graph smp/s", "grad/graph"
    );
    let mut models = Vec::new();
    // The Llama trains on the text shipped with the binary, in windows of 64 bytes.
    let text = data::text_split(data::SAMPLE_TEXT.as_bytes(), data::DEFAULT_CONTEXT, "gpl-3.0.txt")?;
    for arch in archs {
        let split = if arch == ArchKind::Llama { &text } else { &split };
        let r = bench_model(arch, split, args.batch_size, args.steps, &device, args.dtype)?;
        println!(
            "{:<48} {:>12.0} {:>12.0} {:>10.3} {:>12.0} {:>12.0} {:>9.2}x",
            r.name,
            r.train_sps,
            r.forward_sps,
            r.train_sps / r.forward_sps,
            r.grads_sps,
            r.graph_sps,
            r.grads_sps / r.graph_sps
        );
        models.push(serde_json::json!({
            "model": r.name, "arch": arch.to_string(), "train_samples_per_sec": r.train_sps,
            "forward_samples_per_sec": r.forward_sps, "train_over_forward": r.train_sps / r.forward_sps,
            "grads_samples_per_sec": r.grads_sps, "graph_grads_samples_per_sec": r.graph_sps,
            "grads_over_graph": r.grads_sps / r.graph_sps,
        }));
    }
    let (candle, naive) = bench_matmul(args.matmul_size, &device)?;
    println!(
        "matmul {n}x{n}x{n}: candle {candle:.2} GFLOP/s, naive loop {naive:.2} GFLOP/s, ratio {:.1}x",
        candle / naive,
        n = args.matmul_size
    );
    write_json(
        args.json.as_deref(),
        &serde_json::json!({
            "bench": "train", "dataset": if images { kind.to_string() } else { "none".into() }, "batch_size": args.batch_size,
            "steps": args.steps, "device": args.device.to_string(), "dtype": args.dtype.to_string(), "threads": threads,
            "models": models,
            "matmul": { "size": args.matmul_size, "candle_gflops": candle, "naive_gflops": naive, "ratio": candle / naive },
        }),
    )
}

struct ModelResult {
    name: String,
    train_sps: f64,
    forward_sps: f64,
    /// Gradients alone through the model's own step (hand-written on the
    /// CPU), and through candle's graph, on the same batches.
    grads_sps: f64,
    graph_sps: f64,
}

/// Samples per second of `f` over `steps` of `batches` in turn.
fn samples_per_sec(
    batches: &[Vec<usize>],
    steps: usize,
    mut f: impl FnMut(&[usize]) -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    let t = Instant::now();
    let mut samples = 0usize;
    for i in 0..steps {
        let b = &batches[i % batches.len()];
        f(b)?;
        samples += b.len();
    }
    Ok(samples as f64 / t.elapsed().as_secs_f64().max(1e-9))
}

fn bench_model(
    arch: ArchKind,
    split: &Split,
    batch: usize,
    steps: usize,
    device: &Device,
    dtype: shoal_models::Precision,
) -> anyhow::Result<ModelResult> {
    let config = ModelConfig::for_dataset(arch, &split.train);
    let opt = OptimizerConfig::new(OptimizerKind::Adamw, 1e-3);
    let mut trainer = LocalTrainer::new(config.clone(), opt, 1, batch, device)?;
    trainer.set_precision(dtype);
    let batches = split.train.epoch_batches(batch, 1, 0)?;
    if batches.is_empty() {
        anyhow::bail!("{} has no batch of {batch}", split.train.name);
    }
    let data = &split.train;
    for b in batches.iter().cycle().take(3) {
        trainer.train_batch(data, b)?;
    }
    let train_sps = samples_per_sec(&batches, steps, |b| {
        trainer.train_batch(data, b).context("training step")?;
        Ok(())
    })?;
    let model = trainer.model();
    let forward_sps = samples_per_sec(&batches, steps, |b| {
        let (x, _) = data.batch(b, device)?;
        black_box(model.forward(&x, false)?.flatten_all()?.to_vec1::<f32>()?);
        Ok(())
    })?;
    let grads_sps = samples_per_sec(&batches, steps, |b| {
        let (x, y) = data.batch(b, device)?;
        black_box(model.gradients(&x, &y)?.grads);
        Ok(())
    })?;
    let graph_sps = samples_per_sec(&batches, steps, |b| {
        let (x, y) = data.batch(b, device)?;
        let (_, store) = model.backward(&x, &y)?;
        black_box(model.layout().flatten_grads(model.varmap(), &store)?);
        Ok(())
    })?;
    Ok(ModelResult { name: config.describe(), train_sps, forward_sps, grads_sps, graph_sps })
}

/// GFLOP/s of candle's matmul and of a naive i-k-j loop on the same sizes.
fn bench_matmul(n: usize, device: &Device) -> anyhow::Result<(f64, f64)> {
    let a: Vec<f32> = (0..n * n).map(|i| ((i % 97) as f32) * 0.01).collect();
    let b: Vec<f32> = (0..n * n).map(|i| ((i % 89) as f32) * 0.01).collect();
    let flops = 2.0 * (n as f64).powi(3);

    let ta = Tensor::from_slice(&a, (n, n), device)?;
    let tb = Tensor::from_slice(&b, (n, n), device)?;
    black_box(ta.matmul(&tb)?.to_vec2::<f32>()?);
    let reps = 10;
    let t = Instant::now();
    for _ in 0..reps {
        black_box(ta.matmul(&tb)?.to_vec2::<f32>()?);
    }
    let candle = flops * reps as f64 / t.elapsed().as_secs_f64().max(1e-9) / 1e9;

    let t = Instant::now();
    let mut c = vec![0.0f32; n * n];
    for i in 0..n {
        for k in 0..n {
            let aik = a[i * n + k];
            for j in 0..n {
                c[i * n + j] += aik * b[k * n + j];
            }
        }
    }
    black_box(&c);
    let naive = flops / t.elapsed().as_secs_f64().max(1e-9) / 1e9;
    Ok((candle, naive))
}

/// `shoal bench cluster`: scaling with 1, 2 and 4 in-process nodes on real
/// loopback TCP, and an aggregation-bound case measured against raw TCP.
#[allow(clippy::print_stdout)] // The CLI's own output.
pub fn cluster(args: crate::cmd::cli::BenchClusterArgs) -> anyhow::Result<()> {
    if args.steps == 0 || args.batch_size == 0 {
        anyhow::bail!("--steps and --batch-size must be at least 1");
    }
    let (dataset, target) = fashion_or_digits(args.data_dir.as_deref(), args.target, 0.95);
    // Sized for the largest case (4 nodes), so that no case oversubscribes.
    let threads = crate::ops::threads::configure_process(crate::ops::threads::share(4));
    let rt = crate::ops::threads::runtime(crate::ops::threads::available())?;
    rt.block_on(async move {
        let bench = ClusterBench { args, dataset, target, threads };
        println!(
            "shoal bench cluster: {} MLP, BSP, SGD lr 0.1, batch {} per node, {} steps, target {:.0}%",
            bench.dataset,
            bench.args.batch_size,
            bench.args.steps,
            target * 100.0
        );
        println!(
            "{:>5} {:>12} {:>9} {:>14} {:>11} {:>12} {:>9}",
            "nodes", "samples/s", "speed-up", "time to target", "comm share", "bytes/step", "accuracy"
        );
        let rows = bench.scaling().await?;
        println!("bytes/step: pushed plus pulled payload bytes per worker per step, over the model's size.");
        let many_sps = rows.last().and_then(|r| r["samples_per_sec"].as_f64()).unwrap_or(f64::NAN);
        let exchange = bench.exchange(many_sps).await?;
        let big = if bench.args.skip_big { serde_json::Value::Null } else { bench.aggregation_bound().await? };
        write_json(
            bench.args.json.as_deref(),
            &serde_json::json!({
                "bench": "cluster", "dataset": bench.dataset.to_string(), "batch_size": bench.args.batch_size,
                "steps": bench.args.steps, "target": target, "threads_per_node": threads,
                "scaling": rows, "exchange": exchange, "aggregation_bound": big,
            }),
        )
    })
}

/// What the cases of `shoal bench cluster` share.
struct ClusterBench {
    args: crate::cmd::cli::BenchClusterArgs,
    dataset: DatasetKind,
    /// Accuracy whose time to reach is reported.
    target: f32,
    /// Compute threads per node.
    threads: usize,
}

/// What a scaling case's reports add up to, over every node with a status.
#[derive(Default)]
struct ScalingTotals {
    /// Seconds spent exchanging shards.
    comm: f64,
    /// Seconds spent exchanging and computing.
    total: f64,
    /// Payload bytes pushed and pulled.
    bytes: f64,
    /// Seconds until the last node reached the target accuracy (`None`
    /// if none did).
    reached: Option<f64>,
}

impl ScalingTotals {
    fn of(reports: &[NodeReport], target: f32) -> Self {
        let mut sum = Self::default();
        for s in reports.iter().filter_map(|r| r.status.as_ref()) {
            sum.comm += s.comm_secs;
            sum.total += s.comm_secs + s.compute_secs;
            sum.bytes += (s.bytes_out + s.bytes_in) as f64;
            let t = s.accuracy_history.iter().find(|h| h.2 >= target).map(|h| h.1);
            sum.reached = match (sum.reached, t) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (None, t) => t,
                (a, None) => a,
            };
        }
        sum
    }
}

impl ClusterBench {
    /// Samples a run of `nodes` nodes trains in all.
    fn samples(&self, nodes: u64) -> f64 {
        (nodes * self.args.steps * self.args.batch_size as u64) as f64
    }

    /// The node config every scaling case, and the exchange comparison,
    /// trains with.
    fn case_config(&self, run_id: String) -> NodeConfig {
        let mut cfg = NodeConfig { run_id, ..NodeConfig::default() };
        cfg.training.dataset = self.dataset.clone();
        cfg.training.data_dir = self.args.data_dir.clone();
        cfg.training.steps = self.args.steps;
        cfg.training.batch_size = self.args.batch_size;
        cfg.training.lr = Some(0.1);
        cfg.training.eval_every = self.args.eval_every;
        cfg.cluster.heartbeat_ms = 100;
        cfg.training.threads = Some(self.threads);
        cfg
    }

    /// Runs `nodes` in-process nodes with `cfg` to the end; their reports
    /// and the wall-clock seconds taken.
    async fn run(nodes: usize, cfg: NodeConfig) -> anyhow::Result<(Vec<NodeReport>, f64)> {
        use crate::cluster::{Cluster, ClusterSpec};

        let started = Instant::now();
        let reports = Cluster::start(&ClusterSpec::new(nodes, cfg)).await?.wait().await?;
        Ok((reports, started.elapsed().as_secs_f64()))
    }

    /// The scaling table: 1, 2 and 4 nodes, a printed row and a JSON row
    /// each, speed-ups against the single node.
    #[allow(clippy::print_stdout)] // The CLI's own output.
    async fn scaling(&self) -> anyhow::Result<Vec<serde_json::Value>> {
        let mut base_sps = None;
        let mut rows = Vec::new();
        for nodes in [1usize, 2, 4] {
            let (reports, wall) = Self::run(nodes, self.case_config(format!("bench-{nodes}"))).await?;
            let model_bytes = reports[0].params.len() as f64 * 4.0;
            let sps = self.samples(nodes as u64) / wall;
            let base = *base_sps.get_or_insert(sps);
            let sum = ScalingTotals::of(&reports, self.target);
            let per_step = sum.bytes / (nodes as f64 * self.args.steps as f64) / model_bytes;
            println!(
                "{:>5} {:>12.0} {:>8.2}x {:>14} {:>10.1}% {:>11.2}x {:>8.2}%",
                nodes,
                sps,
                sps / base,
                sum.reached.map(|t| format!("{t:.1} s")).unwrap_or_else(|| "not reached".into()),
                100.0 * sum.comm / sum.total.max(1e-9),
                per_step,
                reports[0].accuracy * 100.0
            );
            rows.push(serde_json::json!({
                "nodes": nodes, "samples_per_sec": sps, "speedup": sps / base,
                "time_to_target_secs": sum.reached, "comm_share": sum.comm / sum.total.max(1e-9),
                "bytes_per_step_over_model": per_step, "accuracy": reports[0].accuracy,
            }));
        }
        Ok(rows)
    }

    /// The same 4-node run with each shard's push and pull as two requests
    /// (PushGrad + PullShard), and as one request per shard (PushPull),
    /// against one request per owner (PushPullMany,
    /// the default: `many_sps`, the scaling table's 4-node case).
    #[allow(clippy::print_stdout)] // The CLI's own output.
    async fn exchange(&self, many_sps: f64) -> anyhow::Result<serde_json::Value> {
        let mut separate = self.case_config("bench-4-separate".into());
        separate.cluster.push_pull = false;
        let (_, wall) = Self::run(4, separate).await?;
        let separate_sps = self.samples(4) / wall;
        let mut per_shard = self.case_config("bench-4-per-shard".into());
        per_shard.cluster.push_pull_many = false;
        let (_, wall) = Self::run(4, per_shard).await?;
        let per_shard_sps = self.samples(4) / wall;
        println!(
            "4 nodes, push and pull as separate requests: {separate_sps:.0} samples/s; \
             one PushPull per shard: {per_shard_sps:.0} ({:.2}x); \
             one PushPullMany per owner: {many_sps:.0} ({:.2}x)",
            per_shard_sps / separate_sps,
            many_sps / separate_sps
        );
        Ok(serde_json::json!({
            "separate_samples_per_sec": separate_sps, "push_pull_samples_per_sec": per_shard_sps,
            "push_pull_many_samples_per_sec": many_sps,
            "push_pull_over_separate": per_shard_sps / separate_sps,
            "push_pull_many_over_separate": many_sps / separate_sps,
            "push_pull_many_over_push_pull": many_sps / per_shard_sps,
        }))
    }

    /// The aggregation-bound case: a large MLP on 2 nodes with tiny
    /// batches, its step time against raw TCP moving twice the model.
    #[allow(clippy::print_stdout)] // The CLI's own output.
    async fn aggregation_bound(&self) -> anyhow::Result<serde_json::Value> {
        let mut cfg = NodeConfig { run_id: "bench-big".into(), ..NodeConfig::default() };
        cfg.training.mlp_hidden = Some(vec![6144, 4096]);
        cfg.training.dataset = DatasetKind::Digits;
        cfg.training.steps = self.args.big_steps.max(2);
        cfg.training.batch_size = 4;
        cfg.cluster.shards = 16;
        cfg.cluster.heartbeat_ms = 100;
        let (reports, wall) = Self::run(2, cfg.clone()).await?;
        let params = reports[0].params.len();
        let model_bytes = params * 4;
        let raw = shoal_protocol::bench::raw_tcp_transfer(2 * model_bytes, 2).await?.as_secs_f64();
        let step = wall / cfg.training.steps as f64;
        let comm: f64 = reports.iter().filter_map(|r| r.status.as_ref()).map(|s| s.comm_secs).sum::<f64>()
            / (2.0 * cfg.training.steps as f64);
        println!(
            "aggregation-bound: mlp {params} parameters ({:.0} MB), 2 nodes, batch 4, {} steps: \
             {step:.3} s/step (communication {comm:.3} s/step); raw TCP moves 2x the model in {raw:.3} s; \
             step / raw = {:.1}x",
            model_bytes as f64 / 1e6,
            cfg.training.steps,
            step / raw
        );
        Ok(serde_json::json!({
            "parameters": params, "step_secs": step, "comm_secs_per_step": comm,
            "raw_tcp_secs": raw, "step_over_raw_tcp": step / raw,
        }))
    }
}

/// One straggler case: steps/s of the cluster, final accuracy, and (if the
/// slow node was demoted) seconds from the start of training to its demotion.
struct StragglerCase {
    steps_per_sec: f64,
    accuracy: f32,
    moved_after: Option<f64>,
    slow_step_ms: f64,
}

/// The settings the in-process cluster benchmarks share: SGD lr 0.1 and a
/// 100 ms heartbeat, `steps` steps of `batch_size` per node.
pub(crate) fn cluster_bench_config(run: &str, steps: u64, batch_size: usize) -> crate::config::NodeConfig {
    let mut cfg = crate::config::NodeConfig { run_id: run.into(), ..Default::default() };
    cfg.training.steps = steps;
    cfg.training.batch_size = batch_size;
    cfg.training.lr = Some(0.1);
    cfg.cluster.heartbeat_ms = 100;
    cfg
}

/// `node3_owns`: false keeps node3 from owning shards at all (the speed
/// elastic roles can reach once they have moved its shards away).
async fn straggler_case(
    args: &crate::cmd::cli::BenchStragglerArgs,
    run: &str,
    delay_ms: u64,
    elastic: bool,
    node3_owns: bool,
) -> anyhow::Result<StragglerCase> {
    use crate::cluster::{Cluster, ClusterSpec, NodeOverride};
    use crate::handles::status::RoleView;

    let mut cfg = cluster_bench_config(run, args.steps, args.batch_size);
    cfg.roles.elastic = elastic;
    let mut spec = ClusterSpec::new(4, cfg);
    spec.overrides = vec![NodeOverride::default(); 4];
    spec.overrides[3].fault_delay_ms = Some(delay_ms);
    spec.overrides[3].can_aggregate = Some(node3_owns);
    let cluster = Cluster::start(&spec).await?;
    let slow = cluster.nodes[3].peer_id;
    let reports = cluster.wait().await?;
    // Training time of the slowest node's step loop (compute + communication),
    // which excludes roster formation and lingering.
    let secs =
        reports.iter().filter_map(|r| r.status.as_ref().map(|s| s.compute_secs + s.comm_secs)).fold(0.0f64, f64::max);
    let accuracy = reports.iter().map(|r| r.accuracy).fold(f32::INFINITY, f32::min);
    let moved_after = reports.iter().find(|r| r.peer_id == slow).and_then(|r| {
        let changes = &r.status.as_ref()?.role_changes;
        let start = changes.iter().find(|c| c.role == RoleView::Aggregator)?.secs;
        let moved = changes.iter().find(|c| c.secs >= start && c.owned.is_empty() && c.role == RoleView::Worker)?;
        Some(moved.secs - start)
    });
    Ok(StragglerCase {
        steps_per_sec: args.steps as f64 / secs.max(1e-9),
        accuracy,
        moved_after,
        slow_step_ms: secs * 1e3 / args.steps as f64,
    })
}

/// `sync.fit_batch` in a slow-worker case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fit {
    Off,
    /// The slow worker's batch shrinks; the round is that much shorter.
    Shrink,
    /// And the others take on what it sheds (`sync.fit_rebalance`).
    Rebalance,
}

/// One slow-worker case: node3 computes `slowdown` times slower (1: none).
struct SlowWorkerCase {
    steps_per_sec: f64,
    samples_per_sec: f64,
    accuracy: f32,
    /// node3's mean batch over its steps.
    slow_batch: f64,
}

async fn slow_worker_case(
    args: &crate::cmd::cli::BenchStragglerArgs,
    run: &str,
    slowdown: f64,
    sync: crate::policy::sync::SyncPolicy,
    fit: Fit,
    backup_workers: u32,
) -> anyhow::Result<SlowWorkerCase> {
    use crate::cluster::{Cluster, ClusterSpec, NodeOverride};

    let mut cfg = cluster_bench_config(run, args.steps, args.batch_size);
    cfg.sync.policy = sync;
    cfg.sync.fit_batch = fit != Fit::Off;
    cfg.sync.fit_rebalance = fit == Fit::Rebalance;
    cfg.sync.backup_workers = backup_workers;
    let mut spec = ClusterSpec::new(4, cfg);
    spec.overrides = vec![NodeOverride::default(); 4];
    spec.overrides[3].slowdown = Some(slowdown);
    let cluster = Cluster::start(&spec).await?;
    let slow = cluster.nodes[3].peer_id;
    let reports = cluster.wait().await?;
    let secs =
        reports.iter().filter_map(|r| r.status.as_ref().map(|s| s.compute_secs + s.comm_secs)).fold(0.0f64, f64::max);
    // Samples whose gradients reached a round: a backup worker's dropped
    // pushes trained on samples that no round used.
    let samples: f64 =
        reports.iter().filter_map(|r| r.status.as_ref().map(|s| s.samples as f64 - s.dropped_samples)).sum();
    let slow_samples =
        reports.iter().find(|r| r.peer_id == slow).and_then(|r| r.status.as_ref()).map_or(0, |s| s.samples);
    Ok(SlowWorkerCase {
        steps_per_sec: args.steps as f64 / secs.max(1e-9),
        samples_per_sec: samples / secs.max(1e-9),
        accuracy: reports.iter().map(|r| r.accuracy).fold(f32::INFINITY, f32::min),
        slow_batch: slow_samples as f64 / args.steps as f64,
    })
}

/// `shoal bench straggler --worker`: a slow worker under BSP, waited for,
/// against a fitted batch (shrunk, and rebalanced over the others) and DSSP.
#[allow(clippy::print_stdout)] // The CLI's own output.
async fn slow_worker(args: crate::cmd::cli::BenchStragglerArgs) -> anyhow::Result<()> {
    use crate::policy::sync::SyncPolicy;
    println!(
        "shoal bench straggler --worker: 4 nodes on loopback TCP, digits MLP, batch {} per node, {} steps per case; \
         node3 computes {}x slower",
        args.batch_size, args.steps, args.slowdown
    );
    let dssp: SyncPolicy = "dssp:1-4".parse().map_err(|e: String| anyhow::anyhow!(e))?;
    let bsp = SyncPolicy::Bsp;
    let base = slow_worker_case(&args, "slow-worker-none", 1.0, bsp, Fit::Off, 0).await?;
    let wait = slow_worker_case(&args, "slow-worker-bsp", args.slowdown, bsp, Fit::Off, 0).await?;
    let shrink = slow_worker_case(&args, "slow-worker-shrink", args.slowdown, bsp, Fit::Shrink, 0).await?;
    let fit = slow_worker_case(&args, "slow-worker-fit", args.slowdown, bsp, Fit::Rebalance, 0).await?;
    let ds = slow_worker_case(&args, "slow-worker-dssp", args.slowdown, dssp, Fit::Off, 0).await?;
    let backup = slow_worker_case(&args, "slow-worker-backup", args.slowdown, bsp, Fit::Off, 1).await?;
    println!("{:<42} {:>9} {:>10} {:>10} {:>12}", "case", "steps/s", "samples/s", "accuracy", "node3 batch");
    let cases = [
        ("no slow worker (bsp)", &base),
        ("slow worker, bsp waits", &wait),
        ("slow worker, bsp + fit_batch, shrink only", &shrink),
        ("slow worker, bsp + fit_batch (rebalanced)", &fit),
        ("slow worker, dssp:1-4", &ds),
        ("slow worker, bsp + 1 backup worker", &backup),
    ];
    for (name, c) in cases {
        println!(
            "{name:<42} {:>9.1} {:>10.0} {:>9.2}% {:>12.1}",
            c.steps_per_sec,
            c.samples_per_sec,
            c.accuracy * 100.0,
            c.slow_batch
        );
    }
    let ratio = |c: &SlowWorkerCase| c.samples_per_sec / base.samples_per_sec;
    println!("bsp waits / no slow worker: {:.2}x samples/s (the injected slowdown)", ratio(&wait));
    println!("fit_batch, shrink only / no slow worker: {:.2}x samples/s", ratio(&shrink));
    println!("fit_batch (rebalanced) / no slow worker: {:.2}x samples/s (goal >= 0.8x)", ratio(&fit));
    println!("dssp / no slow worker: {:.2}x samples/s", ratio(&ds));
    println!(
        "backup worker / no slow worker: {:.2}x samples/s (samples of dropped pushes not counted)",
        ratio(&backup)
    );
    // On separate machines whose compute is all of a step, the cluster has
    // (n - 1 + 1/slowdown) / n of its compute left: no mode can beat that.
    // Here the nodes share this host's cores and the slowdown is a sleep,
    // so the others may take the cores the slow node leaves idle.
    let capacity = (3.0 + 1.0 / args.slowdown) / 4.0;
    println!("(separate compute-bound machines would have {capacity:.2}x of the compute left)");
    println!(
        "accuracy: fit_batch {:+.2} points (shrink only {:+.2}), dssp {:+.2}, backup worker {:+.2} points \
         against no slow worker (goal within 0.5)",
        (fit.accuracy - base.accuracy) * 100.0,
        (shrink.accuracy - base.accuracy) * 100.0,
        (ds.accuracy - base.accuracy) * 100.0,
        (backup.accuracy - base.accuracy) * 100.0
    );
    let case = |c: &SlowWorkerCase| {
        serde_json::json!({
            "steps_per_sec": c.steps_per_sec, "samples_per_sec": c.samples_per_sec,
            "accuracy": c.accuracy, "slow_worker_mean_batch": c.slow_batch,
        })
    };
    write_json(
        args.json.as_deref(),
        &serde_json::json!({
            "bench": "straggler_worker", "steps": args.steps, "batch_size": args.batch_size,
            "slowdown": args.slowdown,
            "no_slow_worker": case(&base), "bsp_waits": case(&wait), "fit_batch_shrink": case(&shrink),
            "fit_batch": case(&fit), "dssp": case(&ds), "backup_worker": case(&backup),
            "bsp_waits_over_no_slow_worker": ratio(&wait),
            "fit_batch_shrink_over_no_slow_worker": ratio(&shrink),
            "fit_batch_over_no_slow_worker": ratio(&fit),
            "compute_capacity_left": capacity,
            "dssp_over_no_slow_worker": ratio(&ds),
            "backup_worker_over_no_slow_worker": ratio(&backup),
            "backup_worker_accuracy_delta": backup.accuracy - base.accuracy,
            "fit_batch_accuracy_delta": fit.accuracy - base.accuracy,
            "fit_batch_shrink_accuracy_delta": shrink.accuracy - base.accuracy,
            "dssp_accuracy_delta": ds.accuracy - base.accuracy,
        }),
    )
}

/// `shoal bench straggler`: the PSLD comparison on one machine.
#[allow(clippy::print_stdout)] // The CLI's own output.
pub fn straggler(args: crate::cmd::cli::BenchStragglerArgs) -> anyhow::Result<()> {
    if args.steps == 0 || args.batch_size == 0 || !(args.slowdown > 1.0 && args.slowdown.is_finite()) {
        anyhow::bail!("--steps and --batch-size must be at least 1 and --slowdown above 1");
    }
    // Four nodes share this host: size candle's process-wide pools to one
    // node's share, as the nodes' own pools are (see `ops::threads`).
    crate::ops::threads::configure_process(crate::ops::threads::share(4));
    let rt = tokio::runtime::Runtime::new()?;
    if args.worker {
        return rt.block_on(slow_worker(args));
    }
    rt.block_on(async move {
        println!(
            "shoal bench straggler: 4 nodes on loopback TCP, digits MLP, BSP, batch {} per node, {} steps per case",
            args.batch_size, args.steps
        );
        let base = straggler_case(&args, "straggler-none", 0, true, true).await?;
        // A step meets the slow owner's delay once with `PushPull` (one
        // request per shard, all of a step's in parallel) and twice with a
        // push and then a pull, so this delay makes a static-role step about
        // `slowdown` times the baseline's. (Until 2026-11-26 it assumed two
        // with `PushPull` as well, and a "5x" slowdown was 3x.)
        let touches = if cluster_bench_config("", 1, 1).cluster.push_pull { 1.0 } else { 2.0 };
        let delay_ms = ((args.slowdown - 1.0) * base.slow_step_ms / touches).ceil().max(1.0) as u64;
        println!("baseline step {:.1} ms; node3 answers pushes and pulls {delay_ms} ms late", base.slow_step_ms);
        let fixed = straggler_case(&args, "straggler-static", delay_ms, false, true).await?;
        let elastic = straggler_case(&args, "straggler-elastic", delay_ms, true, true).await?;
        let three = straggler_case(&args, "straggler-three-owners", 0, true, false).await?;
        println!("{:<28} {:>9} {:>10} {:>10}", "case", "steps/s", "accuracy", "moved in");
        for (name, c) in [
            ("no straggler", &base),
            ("straggler, static roles", &fixed),
            ("straggler, elastic roles", &elastic),
            ("no straggler, 3 owners", &three),
        ] {
            let moved = c.moved_after.map_or("-".to_string(), |s| format!("{s:.2} s"));
            println!("{name:<28} {:>9.1} {:>9.2}% {moved:>10}", c.steps_per_sec, c.accuracy * 100.0);
        }
        println!("static / no straggler: {:.2}x (the injected slowdown)", fixed.steps_per_sec / base.steps_per_sec);
        println!("elastic / static: {:.2}x (PSLD reports up to 2.86x)", elastic.steps_per_sec / fixed.steps_per_sec);
        println!(
            "elastic / no straggler: {:.2}x (fraction of speed recovered)",
            elastic.steps_per_sec / base.steps_per_sec
        );
        println!(
            "elastic / 3 owners: {:.2}x (of the speed left once node3 owns nothing; 3 owners / no straggler {:.2}x)",
            elastic.steps_per_sec / three.steps_per_sec,
            three.steps_per_sec / base.steps_per_sec
        );
        match elastic.moved_after {
            Some(s) => println!("slowdown to shards moved: {s:.2} s"),
            None => println!("the straggler's shards never moved"),
        }
        let case = |c: &StragglerCase| {
            serde_json::json!({
                "steps_per_sec": c.steps_per_sec, "accuracy": c.accuracy,
                "moved_after_secs": c.moved_after, "step_ms": c.slow_step_ms,
            })
        };
        write_json(
            args.json.as_deref(),
            &serde_json::json!({
                "bench": "straggler", "steps": args.steps, "batch_size": args.batch_size, "delay_ms": delay_ms,
                "no_straggler": case(&base), "static": case(&fixed), "elastic": case(&elastic),
                "three_owners": case(&three),
                "elastic_over_three_owners": elastic.steps_per_sec / three.steps_per_sec,
                "three_owners_over_no_straggler": three.steps_per_sec / base.steps_per_sec,
                "static_over_no_straggler": fixed.steps_per_sec / base.steps_per_sec,
                "elastic_over_static": elastic.steps_per_sec / fixed.steps_per_sec,
                "elastic_over_no_straggler": elastic.steps_per_sec / base.steps_per_sec,
            }),
        )
    })
}

/// One case of `shoal bench aggregators`.
struct AggregatorsCase {
    steps_per_sec: f64,
    accuracy: f32,
    /// Aggregators at the end, and the explorer's decisions (of node0).
    final_k: usize,
    decisions: Vec<crate::handles::status::ExploreRecord>,
}

async fn aggregators_case(
    args: &crate::cmd::cli::BenchAggregatorsArgs,
    run: &str,
    aggregators: crate::config::Aggregators,
    start: u16,
) -> anyhow::Result<AggregatorsCase> {
    use crate::cluster::{Cluster, ClusterSpec};

    let mut cfg = cluster_bench_config(run, args.steps, args.batch_size);
    cfg.training.mlp_hidden = Some(args.hidden.clone());
    cfg.roles.aggregators = aggregators;
    cfg.roles.start_aggregators = start;
    cfg.roles.explore_window_steps = args.window;
    cfg.faults.serve_mbps = args.serve_mbps;
    let reports = Cluster::start(&ClusterSpec::new(4, cfg)).await?.wait().await?;
    let secs =
        reports.iter().filter_map(|r| r.status.as_ref().map(|s| s.compute_secs + s.comm_secs)).fold(0.0f64, f64::max);
    let status = reports.first().and_then(|r| r.status.clone()).unwrap_or_default();
    Ok(AggregatorsCase {
        steps_per_sec: args.steps as f64 / secs.max(1e-9),
        accuracy: reports.iter().map(|r| r.accuracy).fold(f32::INFINITY, f32::min),
        final_k: status.aggregators,
        decisions: status.exploration,
    })
}

/// `shoal bench aggregators`: PSLD's exploration of the number of
/// aggregators against a fixed single owner and against every node owning.
#[allow(clippy::print_stdout)] // The CLI's own output.
pub fn aggregators(args: crate::cmd::cli::BenchAggregatorsArgs) -> anyhow::Result<()> {
    use crate::config::Aggregators;
    if args.steps == 0 || args.batch_size == 0 || args.window == 0 || args.hidden.contains(&0) {
        anyhow::bail!("--steps, --batch-size, --window and every --hidden width must be at least 1");
    }
    crate::ops::faults::Faults::default()
        .set_serve_mbps(args.serve_mbps)
        .map_err(|e| anyhow::anyhow!("--serve-mbps: {e}"))?;
    crate::ops::threads::configure_process(crate::ops::threads::share(4));
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async move {
        println!(
            "shoal bench aggregators: 4 nodes on loopback TCP, digits MLP {:?}, BSP, batch {} per node, {} steps, \
             explorer window {} steps, each owner serving over an emulated {} Mbit/s uplink",
            args.hidden, args.batch_size, args.steps, args.window, args.serve_mbps
        );
        let one = aggregators_case(&args, "aggregators-one", Aggregators::Fixed(1), 0).await?;
        let auto = aggregators_case(&args, "aggregators-auto", Aggregators::Auto, 1).await?;
        let all = aggregators_case(&args, "aggregators-all", Aggregators::All, 0).await?;
        println!("{:<36} {:>9} {:>10} {:>12}", "case", "steps/s", "accuracy", "aggregators");
        for (name, c) in [("one aggregator, fixed", &one), ("explored from one (auto)", &auto), ("every node", &all)] {
            println!("{name:<36} {:>9.1} {:>9.2}% {:>12}", c.steps_per_sec, c.accuracy * 100.0, c.final_k);
        }
        println!("explored / one fixed: {:.2}x", auto.steps_per_sec / one.steps_per_sec);
        println!("explored / every node: {:.2}x", auto.steps_per_sec / all.steps_per_sec);
        println!("decisions of node0's explorer:");
        for d in &auto.decisions {
            let after = d.after_ms.map_or(String::new(), |a| format!(" -> {a:.1} ms"));
            println!(
                "  {:>6.1} s, step {:>5}: {:<6} {} -> {} aggregators (step {:.1} ms{after})",
                d.secs, d.step, d.action, d.from, d.to, d.before_ms
            );
        }
        let case = |c: &AggregatorsCase| {
            serde_json::json!({ "steps_per_sec": c.steps_per_sec, "accuracy": c.accuracy, "final_aggregators": c.final_k })
        };
        write_json(
            args.json.as_deref(),
            &serde_json::json!({
                "bench": "aggregators", "steps": args.steps, "batch_size": args.batch_size,
                "one_fixed": case(&one), "explored": case(&auto), "every_node": case(&all),
                "explored_over_one_fixed": auto.steps_per_sec / one.steps_per_sec,
                "explored_over_every_node": auto.steps_per_sec / all.steps_per_sec,
            }),
        )
    })
}

/// The cluster benchmarks' data set: Fashion-MNIST where it is installed
/// (target accuracy `target`, else 0.80), otherwise the embedded digits
/// (`target`, else `digits_target`), saying so.
#[allow(clippy::print_stdout)] // The CLI's own output.
pub(crate) fn fashion_or_digits(
    data_dir: Option<&std::path::Path>,
    target: Option<f32>,
    digits_target: f32,
) -> (DatasetKind, f32) {
    match data::load(&DatasetKind::FashionMnist, data_dir) {
        Ok(_) => (DatasetKind::FashionMnist, target.unwrap_or(0.80)),
        Err(e) => {
            println!("fashion-mnist unavailable ({e}); benchmarking on digits");
            (DatasetKind::Digits, target.unwrap_or(digits_target))
        }
    }
}
