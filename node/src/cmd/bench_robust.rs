//! `shoal bench robust`: honest accuracy with `--byzantine` bad peers among
//! `--nodes`, under each attack and each aggregation rule, against the same
//! cluster with no attacker, the plain mean and no checks (measured in the
//! same run, and with the checks as well when they are on).
//!
//! The setup is the robust-aggregation tests' (Karimireddy, He and Jaggi,
//! 2021): digits, BSP, workers push the moving average of their gradients
//! (`aggregation.worker_momentum = 0.9`), owners step plain SGD at rate 1.0
//! with a cosine decay. The bad peers own no shard (an attacker that owned
//! one could rewrite it; that is outside what aggregation rules defend), and
//! the norm check and floor are off unless `--norm-check` and `--norm-floor`
//! set them, so each rule is measured alone.

use anyhow::Context;

use crate::cluster::{Cluster, ClusterSpec, NodeOverride};
use crate::cmd::bench::write_json;
use crate::cmd::cli::BenchRobustArgs;
use crate::config::NodeConfig;
use crate::node::NodeReport;
use crate::ops::faults::Byzantine;
use crate::policy::robust::Aggregation;

/// One attack under one rule.
#[derive(Debug, Clone, serde::Serialize)]
struct Case {
    attack: String,
    rule: String,
    /// The lowest accuracy among the honest nodes, the mean over `--runs`
    /// clusters.
    honest_accuracy: f32,
    /// Each cluster's.
    each: Vec<f32>,
    /// Percentage points below the fault-free run (the plain mean, no checks).
    points_below_fault_free: f32,
    /// Gradients the owners rejected from the bad peers and from honest ones
    /// (the norm check's count; 0 with it off).
    rejected_bad: u64,
    rejected_honest: u64,
    secs: f64,
}

/// The cluster's config: the robust tests' setup for `steps` steps, with
/// the owners' norm check, norm floor and contribution check as
/// `--norm-check`, `--norm-floor` and `--min-agreement` set them, or
/// (`checks` false) with none of them.
fn config(run: &str, args: &BenchRobustArgs, rule: Aggregation, checks: bool) -> NodeConfig {
    let mut c = crate::cmd::bench::cluster_bench_config(run, args.steps, args.batch_size);
    c.training.optimizer = shoal_models::OptimizerKind::Sgd;
    c.training.lr = Some(1.0);
    c.training.momentum = Some(0.0);
    c.training.lr_decay = crate::config::LrDecay::Cosine;
    c.aggregation.rule = rule;
    c.aggregation.norm_check = Some(if checks { args.norm_check } else { 0.0 });
    c.aggregation.norm_floor = if checks { args.norm_floor } else { 0.0 };
    c.aggregation.worker_momentum = 0.9;
    c.aggregation.min_agreement = args.min_agreement.filter(|_| checks);
    c.cluster.shards = 8;
    c.cluster.failure_timeout_ms = 10_000;
    c.cluster.start_timeout_ms = 120_000;
    c.cluster.request_timeout_ms = 120_000;
    // Measured accuracy, not elasticity: no shard moves on a scheduling hiccup.
    c.roles.elastic = false;
    c
}

/// `--runs` clusters of one cell: their mean, and their counts summed.
async fn run_case(args: &BenchRobustArgs, attack: Byzantine, rule: Aggregation, checks: bool) -> anyhow::Result<Case> {
    let mut case = run_one(args, (attack, rule, checks), 0).await?;
    for i in 1..args.runs {
        let c = run_one(args, (attack, rule, checks), i).await?;
        case.each.extend(c.each);
        case.rejected_bad += c.rejected_bad;
        case.rejected_honest += c.rejected_honest;
        case.secs += c.secs;
    }
    case.honest_accuracy = case.each.iter().sum::<f32>() / case.each.len() as f32;
    Ok(case)
}

/// One cluster: the last `bad` nodes push `attack` and own no shard. The
/// run id (`i`) sets the identities, and so the data slices.
async fn run_one(
    args: &BenchRobustArgs,
    (attack, rule, checks): (Byzantine, Aggregation, bool),
    i: usize,
) -> anyhow::Result<Case> {
    let run = format!("robust-{attack}-{rule}-{checks}-{i}").replace([':', '.'], "-");
    let mut spec = ClusterSpec::new(args.nodes, config(&run, args, rule, checks));
    spec.overrides = vec![NodeOverride::default(); args.nodes];
    let bad = if attack == Byzantine::None { 0 } else { args.byzantine };
    for o in spec.overrides.iter_mut().skip(args.nodes - bad) {
        o.byzantine = Some(attack);
        o.can_aggregate = Some(false);
    }
    let started = std::time::Instant::now();
    let reports = Cluster::start(&spec).await?.wait().await.with_context(|| format!("{attack} under {rule}"))?;
    let (honest, attackers) = reports.split_at(args.nodes - bad);
    let honest_accuracy = honest.iter().map(|r| r.accuracy).fold(f32::INFINITY, f32::min);
    let (rejected_bad, rejected_honest) = rejections(&reports, attackers);
    Ok(Case {
        attack: attack.to_string(),
        rule: rule.to_string(),
        honest_accuracy,
        each: vec![honest_accuracy],
        points_below_fault_free: 0.0,
        rejected_bad,
        rejected_honest,
        secs: started.elapsed().as_secs_f64(),
    })
}

/// The owners' rejected contributions: from the `attackers`, and from the rest.
fn rejections(reports: &[NodeReport], attackers: &[NodeReport]) -> (u64, u64) {
    let bad: Vec<String> = attackers.iter().map(|r| r.peer_id.to_string()).collect();
    let mut counts = (0, 0);
    for s in reports.iter().filter_map(|r| r.status.as_ref()) {
        for (peer, n) in &s.rejected_contributions {
            if bad.contains(peer) {
                counts.0 += n;
            } else {
                counts.1 += n;
            }
        }
    }
    counts
}

/// Each cluster's figure, when a cell has more than one.
fn runs_of(c: &Case) -> String {
    if c.each.len() < 2 {
        return String::new();
    }
    let each: Vec<String> = c.each.iter().map(|a| format!("{:.2}", 100.0 * a)).collect();
    format!("({})", each.join(", "))
}

fn check(args: &BenchRobustArgs) -> anyhow::Result<()> {
    if args.nodes < 3 || args.byzantine == 0 || args.byzantine * 2 >= args.nodes {
        anyhow::bail!(
            "--byzantine {} of --nodes {}: need at least 3 nodes and at least one bad peer, fewer than half",
            args.byzantine,
            args.nodes
        );
    }
    if args.steps == 0 || args.batch_size == 0 || args.runs == 0 {
        anyhow::bail!("--steps, --batch-size and --runs must be at least 1");
    }
    if args.attacks.contains(&Byzantine::None) || args.attacks.is_empty() {
        anyhow::bail!("--attacks: list one or more attacks (none is the fault-free run, which always runs)");
    }
    if args.min_agreement.is_some_and(|m| !(-1.0..1.0).contains(&m)) {
        anyhow::bail!("--min-agreement: a cosine from -1 to below 1");
    }
    if !(args.norm_check == 0.0 || args.norm_check > 1.0) {
        anyhow::bail!("--norm-check {}: 0 (off) or a factor above 1", args.norm_check);
    }
    if !(args.norm_floor == 0.0 || args.norm_floor >= 1.0) {
        anyhow::bail!("--norm-floor {}: 0 (off) or a factor of at least 1", args.norm_floor);
    }
    Ok(())
}

/// `shoal bench robust`.
#[allow(clippy::print_stdout)] // The CLI's own output.
pub fn run(args: BenchRobustArgs) -> anyhow::Result<()> {
    check(&args)?;
    crate::ops::threads::configure_process(crate::ops::threads::share(args.nodes));
    let rt = crate::ops::threads::runtime(crate::ops::threads::available())?;
    rt.block_on(async move {
        println!(
            "shoal bench robust: {} nodes on loopback TCP, {} of them bad (owning no shard), digits MLP, BSP, \
             batch {} per node, {} steps, worker momentum 0.9, norm check {}, norm floor {}, \
             contribution check {}, {} cluster(s) per cell",
            args.nodes,
            args.byzantine,
            args.batch_size,
            args.steps,
            if args.norm_check > 0.0 { format!("{}x the median", args.norm_check) } else { "off".into() },
            if args.norm_floor > 0.0 { format!("the median / {}", args.norm_floor) } else { "off".into() },
            args.min_agreement.map_or("off".into(), |m| format!("below {m}")),
            args.runs,
        );
        // The fault-free run the bound is about: the plain mean, no checks.
        let base = run_case(&args, Byzantine::None, Aggregation::Mean, false).await?;
        println!(
            "fault-free (mean, no checks): honest accuracy {:.2}% ({:.0} s)  {}",
            100.0 * base.honest_accuracy,
            base.secs,
            runs_of(&base)
        );
        // And what the checks cost with every peer honest.
        let checked = if args.norm_check > 0.0 || args.norm_floor > 0.0 || args.min_agreement.is_some() {
            let c = run_case(&args, Byzantine::None, Aggregation::Mean, true).await?;
            println!(
                "fault-free (mean, with the checks): honest accuracy {:.2}% ({:.0} s, {} honest gradients rejected)  {}",
                100.0 * c.honest_accuracy,
                c.secs,
                c.rejected_honest,
                runs_of(&c)
            );
            Some(c)
        } else {
            None
        };
        println!(
            "{:<12} {:<20} {:>9} {:>13} {:>9} {:>9} {:>7}",
            "attack", "rule", "honest", "vs fault-free", "rej. bad", "rej. good", "secs"
        );
        let mut cases = Vec::new();
        for &attack in &args.attacks {
            for &rule in &args.rules {
                let mut c = run_case(&args, attack, rule, true).await?;
                c.points_below_fault_free = 100.0 * (base.honest_accuracy - c.honest_accuracy);
                println!(
                    "{:<12} {:<20} {:>8.2}% {:>+12.2}pt {:>9} {:>9} {:>7.0}  {}",
                    c.attack,
                    c.rule,
                    100.0 * c.honest_accuracy,
                    -c.points_below_fault_free,
                    c.rejected_bad,
                    c.rejected_honest,
                    c.secs,
                    runs_of(&c)
                );
                cases.push(c);
            }
        }
        // Per rule: its worst attack, the figure the 2-point bound is about.
        println!("worst attack per rule (points below fault-free):");
        for &rule in &args.rules {
            let name = rule.to_string();
            let worst = cases
                .iter()
                .filter(|c| c.rule == name)
                .max_by(|a, b| a.points_below_fault_free.total_cmp(&b.points_below_fault_free));
            if let Some(w) = worst {
                println!("  {name:<20} {:>6.2} ({})", w.points_below_fault_free, w.attack);
            }
        }
        write_json(
            args.json.as_deref(),
            &serde_json::json!({
                "bench": "robust", "nodes": args.nodes, "byzantine": args.byzantine, "steps": args.steps,
                "batch_size": args.batch_size, "norm_check": args.norm_check,
                "norm_floor": args.norm_floor, "runs": args.runs,
                "min_agreement": args.min_agreement,
                "fault_free_accuracy": base.honest_accuracy,
                "fault_free_with_checks": checked,
                "attacks": cases,
            }),
        )
    })
}
