//! `shoal bench comm`: what each way of communicating costs and buys, on 4
//! in-process nodes over loopback TCP behind an emulated link per node,
//! against f32 BSP in the same run: compressed pushes and pulls, overlap of
//! communication with compute, DiLoCo's local steps and sufficient
//! factors; and, without a cluster, the bytes sufficient factors save on
//! one wide layer at a small batch, where Poseidon's rule favours them.

use std::time::Instant;

use shoal_models::{DatasetKind, OptimizerKind};

use crate::cluster::{Cluster, ClusterSpec};
use crate::cmd::bench::write_json;
use crate::cmd::cli::BenchCommArgs;
use crate::config::NodeConfig;
use crate::policy::compress::{CompressionConfig, PullCompression, PushCompression};
use crate::policy::sync::SyncPolicy;

const NODES: usize = 4;

/// One case's figures.
#[derive(Debug, Clone, Copy)]
struct Measured {
    push_bytes_per_step: f64,
    pull_bytes_per_step: f64,
    /// Per worker step, from its start to its end (evaluations excluded).
    step_secs: f64,
    /// The whole run, start-up and evaluations included.
    wall_secs: f64,
    compute_secs: f64,
    comm_secs: f64,
    /// The part of `comm_secs` after the last shard arrived.
    apply_secs: f64,
    final_accuracy: f32,
    time_to_target_secs: Option<f64>,
}

impl Measured {
    fn bytes_per_step(&self) -> f64 {
        self.push_bytes_per_step + self.pull_bytes_per_step
    }

    /// 1 - (step - compute) / communication: the share of communication that
    /// did not add to the step (0 when every step is compute then exchange).
    fn hidden_fraction(&self) -> f64 {
        if self.comm_secs <= 0.0 {
            return 0.0;
        }
        1.0 - (self.step_secs - self.compute_secs) / self.comm_secs
    }
}

/// Run one case and measure it.
async fn measure(cfg: NodeConfig, steps: u64, target: f32) -> anyhow::Result<Measured> {
    let started = Instant::now();
    let reports = Cluster::start(&ClusterSpec::new(NODES, cfg)).await?.wait().await?;
    let wall = started.elapsed().as_secs_f64();
    let (mut pushed, mut pulled, mut compute, mut comm, mut step, mut apply) = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
    let mut reached: Option<f64> = Some(0.0);
    let mut accuracy = f32::INFINITY;
    for r in &reports {
        let s = r.status.as_ref().ok_or_else(|| anyhow::anyhow!("{} has no status", r.name))?;
        pushed += s.bytes_out as f64;
        pulled += s.bytes_in as f64;
        compute += s.compute_secs;
        comm += s.comm_secs;
        apply += s.apply_secs;
        step += s.step_secs;
        accuracy = accuracy.min(r.accuracy);
        // The run reaches the target when its slowest node does.
        let t = s.accuracy_history.iter().find(|h| h.2 >= target).map(|h| h.1);
        reached = match (reached, t) {
            (Some(a), Some(b)) => Some(a.max(b)),
            _ => None,
        };
    }
    let worker_steps = (NODES as u64 * steps) as f64;
    Ok(Measured {
        push_bytes_per_step: pushed / worker_steps,
        pull_bytes_per_step: pulled / worker_steps,
        step_secs: step / worker_steps,
        wall_secs: wall,
        compute_secs: compute / worker_steps,
        comm_secs: comm / worker_steps,
        apply_secs: apply / worker_steps,
        final_accuracy: accuracy,
        time_to_target_secs: reached,
    })
}

/// One case of the benchmark: how the run synchronises and what it sends.
#[derive(Debug, Clone, Copy)]
struct Case {
    name: &'static str,
    sync: SyncPolicy,
    overlap: bool,
    local_steps: u64,
    push: PushCompression,
    pull: PullCompression,
    optimizer: OptimizerKind,
    lr: f64,
    /// Stretch compute (the `slowdown` fault: a slower machine) until it
    /// matches the communication measured in the plain `ssp:1` case, where
    /// overlap has the most to hide.
    match_comm: bool,
    /// Train at this batch per node instead of `--batch-size`.
    batch: Option<usize>,
    /// The case whose accuracy this one's points are against (default:
    /// the first, f32 bsp); bytes are always against the first.
    reference: Option<&'static str>,
}

impl Case {
    const fn bsp(name: &'static str, push: PushCompression, pull: PullCompression) -> Self {
        Case {
            name,
            sync: SyncPolicy::Bsp,
            overlap: false,
            local_steps: 1,
            push,
            pull,
            optimizer: OptimizerKind::Sgd,
            lr: 0.1,
            match_comm: false,
            batch: None,
            reference: None,
        }
    }
}

/// Sufficient factors pay at small batches: the batch of the `b16` cases.
const SMALL_BATCH: usize = 16;
/// The f32 reference of the small-batch cases.
const F32_SMALL: &str = "f32 bsp b16";

/// The plain SSP case whose communication the slowed cases' compute matches.
const SSP: &str = "ssp:1";

/// The cases, the first of which (f32 BSP) is every other's baseline.
fn cases() -> Vec<Case> {
    use PullCompression as Pull;
    use PushCompression as Push;
    // Owners under SSP step once per push: a quarter of BSP's rate with 4
    // workers (and the overlap's extra step of delay diverged at 0.1).
    let ssp = |name, overlap, match_comm| Case {
        sync: SyncPolicy::Ssp { staleness: 1 },
        overlap,
        lr: 0.025,
        match_comm,
        ..Case::bsp(name, Push::None, Pull::None)
    };
    vec![
        Case::bsp("f32 bsp", Push::None, Pull::None),
        Case::bsp("bf16 pulls", Push::None, Pull::Bf16),
        Case::bsp("int8 + EF", Push::Int8, Pull::None),
        Case::bsp("top-k 1% + EF", Push::TopK { fraction: 0.01 }, Pull::None),
        Case::bsp("sfb", Push::Sfb, Pull::None),
        Case { batch: Some(SMALL_BATCH), ..Case::bsp(F32_SMALL, Push::None, Pull::None) },
        Case { batch: Some(SMALL_BATCH), reference: Some(F32_SMALL), ..Case::bsp("sfb b16", Push::Sfb, Pull::None) },
        ssp(SSP, false, false),
        ssp("ssp:1 + overlap", true, false),
        ssp("ssp:1 slowed", false, true),
        ssp("slowed + overlap", true, true),
        Case {
            local_steps: 20,
            optimizer: OptimizerKind::Adamw,
            lr: 2e-3,
            ..Case::bsp("diloco H=20", Push::None, Pull::None)
        },
    ]
}

/// The wide layer of the sufficient-factor case: `SFB_WIDTH x SFB_WIDTH`
/// weights trained at batch `SFB_BATCH` (Poseidon's example regime).
const SFB_WIDTH: usize = 4096;
const SFB_BATCH: usize = 16;

/// One `SFB_WIDTH x SFB_WIDTH` layer's real weight gradient (candle, batch
/// `SFB_BATCH`) pushed as one shard: f32 against sufficient factors.
#[derive(Debug, Clone, Copy, serde::Serialize)]
struct SfbLayer {
    rows: usize,
    cols: usize,
    batch: usize,
    f32_bytes: u64,
    factored_bytes: u64,
    fewer_bytes_than_f32: f64,
    encode_f32_s: f64,
    encode_factored_s: f64,
    decode_f32_s: f64,
    /// A factored decode rebuilds the gradient.
    decode_factored_s: f64,
    /// Largest difference of the rebuilt gradient from candle's.
    max_abs_error: f32,
}

/// `f()` and the seconds it took.
fn timed<T>(f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<(T, f64)> {
    let t = Instant::now();
    let out = f()?;
    Ok((out, t.elapsed().as_secs_f64()))
}

fn sfb_layer() -> anyhow::Result<SfbLayer> {
    use shoal_models::{data::ImageShape, Arch, Model, ModelConfig, TrainableModel};
    use shoal_protocol::{Encoding, Payload};
    let input = ImageShape { channels: 1, height: 64, width: SFB_WIDTH / 64 };
    let config = ModelConfig { arch: Arch::Mlp { hidden: vec![SFB_WIDTH] }, input, classes: 10 };
    let dev = candle_core::Device::Cpu;
    let model = Model::new(config, 1, &dev)?;
    let x = candle_core::Tensor::randn(0f32, 1.0, (SFB_BATCH, 1, 64, SFB_WIDTH / 64), &dev)?;
    let labels: Vec<u32> = (0..SFB_BATCH as u32).map(|i| i % 10).collect();
    let y = candle_core::Tensor::new(labels.as_slice(), &dev)?;
    let g = model.gradients_factored(&x, &y)?;
    let range = model.layout().entry("fc0.weight").ok_or_else(|| anyhow::anyhow!("no fc0.weight"))?.range();
    let grad = &g.grads[range.clone()];
    let (dense, encode_f32_s) = timed(|| Ok(Payload::encode(grad, Encoding::F32)?))?;
    let (factored, encode_factored_s) = timed(|| Ok(crate::policy::compress::factored_push(range, grad, &g.factors)?))?;
    let mut out = vec![0.0f32; grad.len()];
    let ((), decode_f32_s) = timed(|| Ok(dense.decode_into(&mut out)?))?;
    let ((), decode_factored_s) = timed(|| Ok(factored.decode_into(&mut out)?))?;
    Ok(SfbLayer {
        rows: SFB_WIDTH,
        cols: SFB_WIDTH,
        batch: SFB_BATCH,
        f32_bytes: dense.byte_len(),
        factored_bytes: factored.byte_len(),
        fewer_bytes_than_f32: dense.byte_len() as f64 / factored.byte_len().max(1) as f64,
        encode_f32_s,
        encode_factored_s,
        decode_f32_s,
        decode_factored_s,
        max_abs_error: out.iter().zip(grad).fold(0.0f32, |m, (a, b)| m.max((a - b).abs())),
    })
}

/// `shoal bench comm`.
#[allow(clippy::print_stdout)] // The CLI's own output.
pub fn run(mut args: BenchCommArgs) -> anyhow::Result<()> {
    let llama = args.workload == crate::cmd::cli::CommWorkload::Llama;
    if args.steps == 0 || args.batch_size == Some(0) || args.eval_every == 0 {
        anyhow::bail!("--steps, --batch-size and --eval-every must be at least 1");
    }
    if args.links.iter().any(|l| !(l.is_finite() && *l >= 0.0)) {
        anyhow::bail!("--links takes link rates in Mbit/s, 0 for none: for example --links 1000,100");
    }
    if args.links.is_empty() {
        args.links = if llama { vec![100.0] } else { vec![1000.0, 100.0] };
    }
    if llama {
        return crate::cmd::bench_comm_llama::run(args);
    }
    if args.plot.is_some() {
        anyhow::bail!("--plot draws bytes against loss for --workload llama; the mlp workload prints its table");
    }
    if args.text.is_some() {
        anyhow::bail!("--text is the corpus of --workload llama; the mlp workload trains on images");
    }
    let batch = args.batch_size.unwrap_or(64);
    let (dataset, target) = crate::cmd::bench::fashion_or_digits(args.data_dir.as_deref(), args.target, 0.93);
    let threads = crate::ops::threads::configure_process(crate::ops::threads::share(NODES));
    let rt = crate::ops::threads::runtime(crate::ops::threads::available())?;
    rt.block_on(async move {
        println!(
            "shoal bench comm: {NODES} nodes on loopback TCP, {dataset} MLP, batch {} per node, {} steps, \
             target {:.0}%, {threads} compute threads per node",
            batch,
            args.steps,
            target * 100.0
        );
        let layer = sfb_layer()?;
        print_sfb_layer(&layer);
        let bench = CommBench { args, batch, dataset, target, threads };
        let chosen = bench.chosen_cases()?;
        let mut rows = Vec::new();
        for &mbps in &bench.args.links {
            bench.link(mbps, &chosen, &mut rows).await?;
        }
        print_legend();
        write_json(
            bench.args.json.as_deref(),
            &serde_json::json!({
                "bench": "comm", "dataset": bench.dataset.to_string(), "nodes": NODES,
                "batch_size": bench.batch, "steps": bench.args.steps, "target": target,
                "threads_per_node": threads, "latency_ms": bench.args.latency_ms, "cases": rows, "sfb_layer": layer,
            }),
        )
    })
}

/// The sufficient-factor layer's line: bytes and times against f32.
#[allow(clippy::print_stdout)] // The CLI's own output.
fn print_sfb_layer(layer: &SfbLayer) {
    println!(
        "\nsufficient factors on one {SFB_WIDTH} x {SFB_WIDTH} layer at batch {SFB_BATCH} (one shard, no cluster): \
         f32 {} bytes, factors {} bytes, {:.1}x fewer; encode {:.1} ms against {:.1} ms, decode (rebuild) \
         {:.1} ms against {:.1} ms; rebuilt within {:.1e} of candle's gradient",
        layer.f32_bytes,
        layer.factored_bytes,
        layer.fewer_bytes_than_f32,
        1e3 * layer.encode_factored_s,
        1e3 * layer.encode_f32_s,
        1e3 * layer.decode_factored_s,
        1e3 * layer.decode_f32_s,
        layer.max_abs_error,
    );
}

/// What the columns of the tables mean.
#[allow(clippy::print_stdout)] // The CLI's own output.
fn print_legend() {
    println!(
        "\nbytes/step: payload bytes pushed and pulled per worker per step; vs f32: f32 bsp's bytes over the \
         case's; pushed: the same for pushed bytes alone. step: a worker step from start to end. compute, comm: per worker step. \
         apply: the part of comm after the last shard arrived (loading the parameters into the model), all that \
         applying shards as they arrive could hide under bsp. hidden: 1 - (step - compute) / comm. \
         slowed: compute stretched (a slower machine, by sleeping) to the \
         communication of ssp:1. b16: batch 16 per node. accuracy: the lowest node's on the test set; points: \
         against f32 bsp on the same link (sfb b16: against f32 bsp b16)."
    );
}

/// What the cases of `shoal bench comm` share.
struct CommBench {
    args: BenchCommArgs,
    /// Samples per step per node (`--batch-size`).
    batch: usize,
    dataset: DatasetKind,
    /// Accuracy whose time to reach is reported.
    target: f32,
    /// Compute threads per node.
    threads: usize,
}

/// One link's table as its cases run.
struct LinkTable {
    /// The first case measured (f32 BSP): every case's baseline.
    baseline: Option<Measured>,
    /// The cases measured so far, for the cases whose reference they are.
    measured: Vec<(&'static str, Measured)>,
    /// Communication over compute in the plain SSP case: the slowdown of
    /// the slowed cases.
    comm_over_compute: f64,
}

impl CommBench {
    /// The cases to run: every case without `--cases`; else the baseline,
    /// the cases named, their references, and ssp:1 when a slowed case
    /// needs its communication time. An unknown name is an error.
    fn chosen_cases(&self) -> anyhow::Result<Vec<Case>> {
        let known: Vec<&str> = cases().iter().map(|c| c.name).collect();
        if let Some(bad) = self.args.cases.iter().find(|c| !known.contains(&c.as_str())) {
            anyhow::bail!("--cases: no case `{bad}`; the cases are {}", known.join(", "));
        }
        let named = |c: &Case| self.args.cases.iter().any(|n| n == c.name);
        let referenced = |c: &Case| {
            cases().iter().any(|o| named(o) && (o.reference == Some(c.name) || (o.match_comm && c.name == SSP)))
        };
        let chosen = |c: &Case| self.args.cases.is_empty() || c.name == "f32 bsp" || named(c) || referenced(c);
        Ok(cases().into_iter().filter(chosen).collect())
    }

    /// The node config of `case` on a link of `mbps` (0: loopback), run
    /// number `run` of the benchmark, compute slowed by `slowdown` if the
    /// case matches communication.
    fn case_config(&self, case: &Case, mbps: f64, run: usize, slowdown: f64) -> NodeConfig {
        let mut cfg = NodeConfig { run_id: format!("bench-comm-{run}"), ..NodeConfig::default() };
        cfg.training.dataset = self.dataset.clone();
        cfg.training.data_dir = self.args.data_dir.clone();
        cfg.training.steps = self.args.steps;
        cfg.training.batch_size = case.batch.unwrap_or(self.batch);
        cfg.training.optimizer = case.optimizer;
        cfg.training.lr = Some(case.lr);
        cfg.training.eval_every = self.args.eval_every;
        cfg.training.threads = Some(self.threads);
        cfg.cluster.heartbeat_ms = 100;
        // Fixed owners: every case moves the same shards between the same nodes.
        cfg.roles.elastic = false;
        cfg.sync.policy = case.sync;
        cfg.sync.overlap = case.overlap;
        cfg.local_steps = crate::config::LocalStepsConfig::per_round(case.local_steps);
        cfg.compression = CompressionConfig { push: case.push, pull: case.pull };
        cfg.faults.link_mbps = mbps;
        cfg.faults.link_latency_ms = if mbps > 0.0 { self.args.latency_ms } else { 0.0 };
        if case.match_comm {
            cfg.faults.slowdown = slowdown;
        }
        cfg
    }

    /// Runs `cases` on a link of `mbps` (0: loopback) on every node,
    /// printing the link's table and adding its JSON rows to `rows`.
    #[allow(clippy::print_stdout)] // The CLI's own output.
    async fn link(&self, mbps: f64, cases: &[Case], rows: &mut Vec<serde_json::Value>) -> anyhow::Result<()> {
        let link = if mbps > 0.0 { format!("{mbps} Mbit/s, {} ms", self.args.latency_ms) } else { "loopback".into() };
        println!("\nlink: {link} on every node, each way");
        println!(
            "{:<16} {:>11} {:>8} {:>8} {:>8} {:>10} {:>8} {:>8} {:>7} {:>14} {:>9} {:>7}",
            "case",
            "bytes/step",
            "vs f32",
            "pushed",
            "step ms",
            "compute ms",
            "comm ms",
            "apply ms",
            "hidden",
            "time to target",
            "accuracy",
            "points"
        );
        let mut table = LinkTable { baseline: None, measured: Vec::new(), comm_over_compute: 1.0 };
        for case in cases {
            let cfg = self.case_config(case, mbps, rows.len(), table.comm_over_compute);
            let m = measure(cfg, self.args.steps, self.target).await?;
            if case.name == SSP && m.compute_secs > 0.0 {
                table.comm_over_compute = (m.comm_secs / m.compute_secs).clamp(1.0, crate::ops::faults::MAX_SLOWDOWN);
            }
            rows.push(self.report_case(&mut table, case, mbps, m));
        }
        Ok(())
    }

    /// Prints `case`'s row of the table against the baseline (the first
    /// case measured, which `m` becomes if none is yet) and its reference,
    /// and returns its JSON row.
    #[allow(clippy::print_stdout)] // The CLI's own output.
    fn report_case(&self, table: &mut LinkTable, case: &Case, mbps: f64, m: Measured) -> serde_json::Value {
        // The first case, f32 BSP, is the baseline of the others.
        let base = *table.baseline.get_or_insert(m);
        let fewer = base.bytes_per_step() / m.bytes_per_step().max(1.0);
        let fewer_pushed = base.push_bytes_per_step / m.push_bytes_per_step.max(1.0);
        let reference =
            case.reference.and_then(|r| table.measured.iter().find(|(n, _)| *n == r).map(|(_, m)| *m)).unwrap_or(base);
        table.measured.push((case.name, m));
        let points = 100.0 * (m.final_accuracy - reference.final_accuracy);
        println!(
            "{:<16} {:>11.0} {:>7.1}x {:>7.1}x {:>8.1} {:>10.1} {:>8.1} {:>8.2} {:>6.0}% {:>14} {:>8.2}% {:>+7.2}",
            case.name,
            m.bytes_per_step(),
            fewer,
            fewer_pushed,
            m.step_secs * 1e3,
            m.compute_secs * 1e3,
            m.comm_secs * 1e3,
            m.apply_secs * 1e3,
            100.0 * m.hidden_fraction(),
            m.time_to_target_secs.map(|t| format!("{t:.1} s")).unwrap_or_else(|| "not reached".into()),
            100.0 * m.final_accuracy,
            points
        );
        serde_json::json!({
            "case": case.name, "link_mbps": mbps, "sync": case.sync.to_string(), "overlap": case.overlap,
            "local_steps": case.local_steps, "push": case.push.to_string(), "pull": case.pull.to_string(),
            "batch_size": case.batch.unwrap_or(self.batch),
            "points_against": case.reference.unwrap_or("f32 bsp"),
            "slowdown": if case.match_comm { table.comm_over_compute } else { 1.0 },
            "bytes_per_step": m.bytes_per_step(), "push_bytes_per_step": m.push_bytes_per_step,
            "pull_bytes_per_step": m.pull_bytes_per_step, "fewer_bytes_than_f32": fewer,
            "fewer_push_bytes_than_f32": fewer_pushed, "wall_secs": m.wall_secs,
            "step_secs": m.step_secs, "compute_secs": m.compute_secs, "comm_secs": m.comm_secs,
            "hidden_fraction": m.hidden_fraction(), "time_to_target_s": m.time_to_target_secs,
            "apply_secs": m.apply_secs,
            "final_accuracy": m.final_accuracy, "accuracy_points_vs_f32": points,
        })
    }
}
