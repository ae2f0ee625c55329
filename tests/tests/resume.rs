//! Durable training over real TCP: a 4-node cluster writing shard
//! checkpoints is stopped at once (every node killed, no handoff) midway,
//! restarted with the same configs and checkpoint folders, and finishes
//! from where it stopped, with its optimizer state, at the accuracy of an
//! uninterrupted run; also when one node comes back with an empty folder
//! and another finds its newest checkpoint truncated.

use std::path::Path;
use std::time::Duration;

use shoal_models::OptimizerKind;
use shoal_node::cluster::{Cluster, ClusterSpec};
use shoal_node::node::NodeReport;
use shoal_node::policy::sync::SyncPolicy;
use shoal_tests::{digits_config, rel_diff, run_cluster};

const STEPS: u64 = 300;
const EVERY: u64 = 25;
/// How far back a resume may start from the furthest step reached: one
/// interval, plus one more for a checkpoint still being written when every
/// node was killed. A digits step takes milliseconds, and under a loaded CI
/// machine the write of step 150 had not landed when the nodes, at 160 and
/// 161, were killed: both resume tests resumed at 125 (2026-11-28).
const LAG: u64 = 2 * EVERY;

fn spec(run: &str, dir: Option<&Path>) -> ClusterSpec {
    spec_with(run, dir, 4, 8, SyncPolicy::Bsp)
}

fn spec_with(run: &str, dir: Option<&Path>, nodes: usize, shards: u32, sync: SyncPolicy) -> ClusterSpec {
    let mut cfg = digits_config(run, STEPS, sync, OptimizerKind::Sgd, 0.05);
    cfg.cluster.shards = shards;
    cfg.checkpoint.dir = dir.map(Path::to_path_buf);
    cfg.checkpoint.every_steps = EVERY;
    cfg.checkpoint.every_secs = 0;
    ClusterSpec::new(nodes, cfg)
}

fn mean_accuracy(reports: &[NodeReport]) -> f64 {
    reports.iter().map(|r| r.accuracy as f64).sum::<f64>() / reports.len().max(1) as f64
}

/// Train until every node is at step 160 or more, then kill every node at
/// once (no handoff, every connection closed). Returns the furthest step.
async fn first_life_killed(spec: &ClusterSpec) -> anyhow::Result<u64> {
    let cluster = Cluster::start(spec).await?;
    let mut progress: Vec<_> = cluster.nodes.iter().map(|n| n.progress.clone()).collect();
    for p in progress.iter_mut() {
        tokio::time::timeout(Duration::from_secs(300), p.wait_for(|s| s.step >= 160))
            .await
            .map_err(|_| anyhow::anyhow!("the first life never reached step 160"))??;
    }
    let reached = progress.iter().map(|p| p.borrow().step).max().unwrap_or(0);
    for node in cluster.nodes {
        node.kill().await;
    }
    eprintln!("killed every node; the furthest was at step {reached}");
    Ok(reached)
}

/// Every node resumed at the same checkpointed round, at most [`LAG`]
/// back, with every shard's optimizer state, trained only the steps left,
/// and finished at the last step. Returns the resume step.
fn assert_resumed(reports: &[NodeReport], reached: u64) -> anyhow::Result<u64> {
    let mut steps = Vec::new();
    for r in reports {
        let s = r.status.as_ref().ok_or_else(|| anyhow::anyhow!("{} has no status", r.name))?;
        let from = s.resumed_at_step.ok_or_else(|| anyhow::anyhow!("{} did not resume", r.name))?;
        eprintln!(
            "{}: resumed at step {from}, finished at {}, accuracy {:.2}%, checkpoints written {}",
            r.name,
            r.steps,
            r.accuracy * 100.0,
            s.checkpoints_written
        );
        assert!(reached - from <= LAG, "{}: resumed at {from}, {reached} was reached", r.name);
        assert_eq!(from % EVERY, 0, "BSP resumes at a checkpointed round");
        assert_eq!(r.steps, STEPS, "{}: the run ends at its last step", r.name);
        // Only the steps left were trained (batches of 32; an epoch's last is smaller).
        let left = (STEPS - from) * 32;
        assert!(s.samples <= left && s.samples * 10 >= left * 9, "{}: {} samples for {left}", r.name, s.samples);
        assert_eq!(s.restored_from_worker_copy, 0, "{}: a shard lost its optimizer state", r.name);
        steps.push(from);
    }
    steps.dedup();
    assert_eq!(steps.len(), 1, "every node resumes at the same step: {steps:?}");
    Ok(steps[0])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_stopped_at_once_resumes_from_its_checkpoints_and_finishes() -> anyhow::Result<()> {
    // The same work without a stop, for the accuracy it should reach.
    let uninterrupted = run_cluster(&spec("resume", None)).await?;

    let dir = tempfile::tempdir()?;
    let spec = spec("resume", Some(dir.path()));
    let reached = first_life_killed(&spec).await?;
    // Second life: the same configs and folders.
    let reports = run_cluster(&spec).await?;
    assert_resumed(&reports, reached)?;
    let (resumed, straight) = (mean_accuracy(&reports), mean_accuracy(&uninterrupted));
    eprintln!("accuracy: resumed {:.2}%, uninterrupted {:.2}%", resumed * 100.0, straight * 100.0);
    assert!((resumed - straight).abs() <= 0.005, "resumed {resumed:.4} vs uninterrupted {straight:.4}");
    // The same model, not only the same accuracy: the resumed run continued
    // from the checkpointed parameters and optimizer state on the same data
    // (BSP sums gradients in peer-id order, so bits may differ slightly).
    let d = rel_diff(&reports[0].params, &uninterrupted[0].params);
    eprintln!("relative parameter difference to the uninterrupted run: {d:.2e}");
    assert!(d < 1e-4, "resumed parameters differ by {d:.2e}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_folder_and_a_truncated_file_still_resume_from_the_copies() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let spec = spec("resume-damaged", Some(dir.path()));
    let reached = first_life_killed(&spec).await?;
    // node2 comes back with an empty folder: its shards' backups wrote the
    // same versions. The newest file on node0, node1 or node3 that has a
    // copy on another of them is cut short: it is skipped and the copy used.
    // (Which node holds it depends on the placement, which follows the
    // random peer ids: node0's shards may all be backed up on node2.)
    std::fs::remove_dir_all(dir.path().join("node2"))?;
    let names = |node: &str| -> Vec<String> {
        std::fs::read_dir(dir.path().join(node))
            .map(|d| d.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect())
            .unwrap_or_default()
    };
    let kept = ["node0", "node1", "node3"].map(|n| (n, names(n)));
    let mut shared: Vec<(&str, &String)> = kept
        .iter()
        .flat_map(|(n, files)| files.iter().map(move |f| (*n, f)))
        .filter(|(n, f)| kept.iter().any(|(o, files)| o != n && files.contains(f)))
        .collect();
    shared.sort_by_key(|(_, f)| f.rsplit('-').next().map(str::to_string));
    let (node, file) = shared.last().ok_or_else(|| anyhow::anyhow!("no file has a copy outside node2"))?;
    let newest = dir.path().join(node).join(file);
    let bytes = std::fs::read(&newest)?;
    std::fs::write(&newest, &bytes[..bytes.len() / 2])?;
    eprintln!("removed node2's folder, truncated {}", newest.display());

    let reports = run_cluster(&spec).await?;
    assert_resumed(&reports, reached)?;
    for r in &reports {
        assert!(r.accuracy >= 0.93, "{}: accuracy {:.4}", r.name, r.accuracy);
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_owning_many_shards_each_resume_under_ssp() -> anyhow::Result<()> {
    // 16 shards on 2 nodes: every node owns and backs up 8 shards, all due at
    // the same versions. Under SSP a version is one push, so it runs ahead
    // of the step: the step is recorded with each checkpoint.
    let dir = tempfile::tempdir()?;
    let spec = spec_with("resume-ssp", Some(dir.path()), 2, 16, SyncPolicy::Ssp { staleness: 2 });
    let reached = first_life_killed(&spec).await?;
    let reports = run_cluster(&spec).await?;
    for r in &reports {
        let s = r.status.as_ref().ok_or_else(|| anyhow::anyhow!("{} has no status", r.name))?;
        let from = s.resumed_at_step.ok_or_else(|| anyhow::anyhow!("{} did not resume", r.name))?;
        eprintln!("{}: resumed at step {from} ({reached} reached), accuracy {:.2}%", r.name, r.accuracy * 100.0);
        assert!(from > 0 && from <= reached && reached - from <= LAG, "{}: resumed at {from}", r.name);
        assert_eq!(r.steps, STEPS);
        assert_eq!(s.checkpoint_failures, 0);
        // SSP's final accuracy varies with push order: 93-96% in ten runs
        // here, and 88.30% once in a clean-clone CI run under load
        // (2026-11-25). The resume itself is checked above; this only says
        // the resumed cluster learns.
        assert!(r.accuracy >= 0.85, "{}: accuracy {:.4}", r.name, r.accuracy);
    }
    Ok(())
}
