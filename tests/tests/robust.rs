//! Robust aggregation against a bad peer: 5 nodes on loopback TCP, BSP, one
//! of them Byzantine (it pushes corrupted gradients and owns no shard).
//! One test per kind of attack; each runs the plain mean without the norm
//! check (the unprotected baseline, whose accuracy is printed), then
//! `trimmed_mean`, `median` and `centered_clip`, and asserts that the four
//! honest nodes reach 93% on digits with each (the mean of `RUNS` clusters
//! under `sign_flip`, the closest to the line, and of `RUNS_WIDE_MARGIN`
//! under the others).
//!
//! With the norm check on, the attacker is caught: every owner rejects it
//! and names it a suspect, in its status and in its heartbeat, so every
//! honest node's view lists it.
//!
//! The setup follows Karimireddy, He and Jaggi (2021): workers push the
//! moving average of their gradients (`aggregation.worker_momentum = 0.9`, with
//! the owners' SGD momentum off and the rate scaled up to match), so honest
//! pushes vary less and a bad one stands out; and the rate decays (cosine).
//! Without worker momentum, a sign-flipping peer held `trimmed_mean` and
//! `median` to 92.8-94.7% at batch 32 (docs/benchmarks.md).
//!
//! Minutes each (23 clusters in all): `#[ignore]`d in the README's test command and run
//! by `.ci/run`:
//!
//! ```text
//! cargo test -p shoal-tests --test robust -- --ignored --nocapture --test-threads 1
//! ```

use shoal_models::OptimizerKind;
use shoal_node::cluster::{ClusterSpec, NodeOverride};
use shoal_node::node::NodeReport;
use shoal_node::ops::faults::Byzantine;
use shoal_node::policy::robust::Aggregation;
use shoal_node::policy::sync::SyncPolicy;
use shoal_tests::{digits_config, run_cluster};

const NODES: usize = 5;
const BAD: usize = NODES - 1;
const STEPS: u64 = 400;
/// Per node: the default.
const BATCH: usize = 32;
const WORKER_MOMENTUM: f32 = 0.9;
/// SGD without momentum at the owners: 1 / (1 - 0.9) times the rate the
/// other cluster tests use with momentum 0.9 (0.1).
const LR: f64 = 1.0;
const TARGET: f32 = 0.93;
/// Clusters per robust rule under `sign_flip`; their mean accuracy is
/// judged. Single runs take a few discrete values (93.04 to 96.66%), so
/// the mean of several is what clears the line (the means of 5 on
/// 2026-11-25: 95.04, 95.65 and 95.43%; the lowest mean of 3 on record
/// was 93.41%, so 4).
const RUNS: usize = 4;
/// Clusters per robust rule under the other attacks, whose runs sit 2 to 4
/// points above the line (95.26 to 97.21%, docs/benchmarks.md): one each.
const RUNS_WIDE_MARGIN: usize = 1;

/// The run with node `BAD` attacking with `attack`; owners use `rule` and
/// the norm check with factor `norm_check` (0: off).
async fn run(attack: Byzantine, rule: Aggregation, norm_check: f32) -> anyhow::Result<Vec<NodeReport>> {
    let name = format!("byz-{attack}-{rule}-{norm_check}").replace([':', '.'], "-");
    let mut base = digits_config(&name, STEPS, SyncPolicy::Bsp, OptimizerKind::Sgd, LR);
    base.aggregation.rule = rule;
    base.aggregation.norm_check = Some(norm_check);
    base.training.batch_size = BATCH;
    base.training.momentum = Some(0.0);
    base.training.lr_decay = shoal_node::config::LrDecay::Cosine;
    base.aggregation.worker_momentum = WORKER_MOMENTUM;
    let mut spec = ClusterSpec::new(NODES, base);
    spec.overrides = vec![NodeOverride::default(); NODES];
    spec.overrides[BAD] = NodeOverride { byzantine: Some(attack), can_aggregate: Some(false), ..Default::default() };
    run_cluster(&spec).await
}

/// The lowest accuracy among the honest nodes.
fn honest_accuracy(reports: &[NodeReport]) -> f32 {
    reports.iter().take(BAD).map(|r| r.accuracy).fold(f32::INFINITY, f32::min)
}

/// The unprotected mean, then each robust rule over `runs` clusters.
/// Returns the mean's accuracy.
async fn defend_against(attack: Byzantine, tau: f32, runs: usize) -> anyhow::Result<f32> {
    let mean = honest_accuracy(&run(attack, Aggregation::Mean, 0.0).await?);
    eprintln!("{attack}: mean without the norm check: honest nodes reach {:.2}%", 100.0 * mean);
    for rule in [Aggregation::TrimmedMean { trim: 0.2 }, Aggregation::Median, Aggregation::CenteredClip { tau }] {
        // The norm check off, so the rule alone is tested. One run's final
        // accuracy on digits' 359 test images swings by about 1.5 points
        // with the identities (which set the data slices), so the figure is
        // the mean of `runs` clusters.
        let mut accs = Vec::new();
        for _ in 0..runs {
            accs.push(honest_accuracy(&run(attack, rule, 0.0).await?));
        }
        let acc = accs.iter().sum::<f32>() / accs.len() as f32;
        let each: Vec<String> = accs.iter().map(|a| format!("{:.2}%", 100.0 * a)).collect();
        eprintln!("{attack}: {rule}: honest nodes reach {:.2}% (runs: {})", 100.0 * acc, each.join(", "));
        assert!(acc >= TARGET, "{attack}: {rule} reached only {:.2}% ({})", 100.0 * acc, each.join(", "));
    }
    Ok(mean)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "5-node clusters for minutes: .ci/run runs it"]
async fn a_peer_scaling_its_gradients_by_100_is_outvoted_and_caught() -> anyhow::Result<()> {
    let honest = honest_accuracy(&run(Byzantine::None, Aggregation::Mean, 10.0).await?);
    eprintln!("no attacker: mean with the norm check: the four nodes reach {:.2}%", 100.0 * honest);
    let attack = Byzantine::Scale(100.0);
    let mean = defend_against(attack, 0.01, RUNS_WIDE_MARGIN).await?;
    assert!(mean < 0.5, "the unprotected mean should fail visibly under a 100x attacker, reached {mean}");

    // The norm check at K = 10 (tighter than the default 50, and safe with
    // worker momentum) with the plain mean: the attacker's gradients are
    // rejected every round, counted against it, and it is reported as a
    // suspect by every owner.
    let reports = run(attack, Aggregation::Mean, 10.0).await?;
    let acc = honest_accuracy(&reports);
    eprintln!("{attack}: mean with the norm check: honest nodes reach {:.2}%", 100.0 * acc);
    assert!(acc >= TARGET, "{attack}: mean with the norm check reached only {acc}");
    let norms: Vec<String> = reports
        .iter()
        .flat_map(|r| r.shard_stats.iter())
        .map(|s| format!("{}: {:.3}", s.shard, s.median_norm.unwrap_or(f32::NAN)))
        .collect();
    eprintln!("{attack}: honest median gradient norm per shard at the end: {}", norms.join(", "));
    let bad = reports[BAD].peer_id.to_string();
    let mut owners = 0;
    for r in reports.iter().filter(|r| !r.owned_shards.is_empty()) {
        owners += 1;
        let Some(status) = &r.status else { anyhow::bail!("{} has no status", r.name) };
        let rejected = status.rejected_contributions.get(&bad).copied().unwrap_or(0);
        // Every round of every owned shard, give or take the first rounds of
        // a shard that moved.
        let rounds = STEPS * r.owned_shards.len() as u64;
        assert!(rejected * 10 >= rounds * 9, "{}: rejected {rejected} of ~{rounds} bad gradients", r.name);
        assert_eq!(status.suspects, vec![bad.clone()], "{}", r.name);
        let honest: u64 = status.rejected_contributions.iter().filter(|(p, _)| **p != bad).map(|(_, n)| n).sum();
        assert!(honest * 100 <= rounds, "{}: {honest} honest gradients rejected", r.name);
    }
    assert!(owners >= 2, "the honest nodes own the shards");
    // Owners gossip their suspects: every honest node's view names the
    // attacker, on the word of every owner, and no one else.
    let attacker = reports[BAD].peer_id;
    let owner_ids: Vec<_> = reports.iter().filter(|r| !r.owned_shards.is_empty()).map(|r| r.peer_id).collect();
    for r in reports.iter().take(BAD) {
        let by = r.suspected_by.get(&attacker).cloned().unwrap_or_default();
        for o in &owner_ids {
            assert!(by.contains(o), "{}: owner {o} does not name the attacker in this view ({by:?})", r.name);
        }
        assert_eq!(r.suspected_by.len(), 1, "{}: only the attacker is a suspect: {:?}", r.name, r.suspected_by);
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "5-node clusters for minutes: .ci/run runs it"]
async fn a_peer_flipping_its_gradients_signs_is_outvoted() -> anyhow::Result<()> {
    defend_against(Byzantine::SignFlip, 0.01, RUNS).await.map(|_| ())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "5-node clusters for minutes: .ci/run runs it"]
async fn a_peer_sending_random_gradients_of_the_honest_norm_is_outvoted() -> anyhow::Result<()> {
    defend_against(Byzantine::Random, 0.01, RUNS_WIDE_MARGIN).await.map(|_| ())
}
