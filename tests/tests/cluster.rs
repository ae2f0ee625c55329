//! Multi-node training over real loopback TCP: numerical equivalence with a
//! single node, accuracy under each sync policy, and recorded staleness.

use candle_core::Device;
use shoal_models::{data, DatasetKind, LocalTrainer, ModelConfig, OptimizerConfig, OptimizerKind};
use shoal_node::actors::worker::batch_for_step;
use shoal_node::cluster::{ClusterSpec, NodeOverride};
use shoal_node::config::LrDecay;
use shoal_node::node::NodeReport;
use shoal_node::policy::schedule::LrSchedule;
use shoal_node::policy::sync::SyncPolicy;
use shoal_tests::{digits_config, rel_diff, run_cluster};

const STEPS: u64 = 5;

/// Train one node on the concatenation (in roster order) of every worker's
/// batch, step by step, and return its parameters.
fn single_node_reference(
    reports: &[NodeReport],
    batch_of: &dyn Fn(&NodeReport) -> usize,
    optimizer: OptimizerConfig,
    schedule: Option<LrSchedule>,
) -> anyhow::Result<Vec<f32>> {
    let split = data::load(&DatasetKind::Digits, None)?;
    let config = ModelConfig::for_dataset(shoal_models::ArchKind::Mlp, &split.train);
    let mut single = LocalTrainer::new(config, optimizer, 42, 1, &Device::Cpu)?;
    let roster = &reports[0].roster;
    let world = roster.len();
    for step in 0..STEPS {
        let mut batch = Vec::new();
        for (rank, peer) in roster.iter().enumerate() {
            let r = reports.iter().find(|r| r.peer_id == *peer).ok_or_else(|| anyhow::anyhow!("peer missing"))?;
            batch.extend(batch_for_step(split.train.len(), rank, world, batch_of(r), 42, step)?);
        }
        if let Some(s) = schedule {
            single.set_lr(s.lr_at(step))?;
        }
        single.train_batch(&split.train, &batch)?;
    }
    Ok(single.params().to_vec())
}

async fn equivalence(nodes: usize, kind: OptimizerKind, lr: f64, batches: &[usize], tol: f64) -> anyhow::Result<()> {
    equivalence_with(nodes, kind, lr, batches, tol, LrDecay::None, true).await
}

async fn equivalence_with(
    nodes: usize,
    kind: OptimizerKind,
    lr: f64,
    batches: &[usize],
    tol: f64,
    decay: LrDecay,
    many: bool,
) -> anyhow::Result<()> {
    let mut base = digits_config(&format!("equiv-{nodes}-{kind}-{decay}-{many}"), STEPS, SyncPolicy::Bsp, kind, lr);
    base.training.lr_decay = decay;
    base.cluster.push_pull_many = many;
    let opt = base.training.optimizer_config();
    let schedule = base.training.lr_schedule();
    let mut spec = ClusterSpec::new(nodes, base);
    spec.overrides = batches.iter().map(|&b| NodeOverride { batch_size: Some(b), ..Default::default() }).collect();
    let reports = run_cluster(&spec).await?;
    let names: Vec<String> = reports.iter().map(|r| r.name.clone()).collect();
    let batch_of = |r: &NodeReport| {
        let i = names.iter().position(|n| *n == r.name).unwrap_or(0);
        batches.get(i).copied().unwrap_or(32)
    };
    let reference = single_node_reference(&reports, &batch_of, opt, Some(schedule))?;
    for r in &reports {
        let d = rel_diff(&r.params, &reference);
        eprintln!("{nodes} nodes, {kind}, {decay}, batches {batches:?}: {} differs from one node by {d:.3e}", r.name);
        assert!(d <= tol, "{}: relative difference {d:e} > {tol:e}", r.name);
    }
    // The path under test was the one taken: with 8 shards over several
    // owners, some remote owner holds two or more of them, and those go
    // in one PushPullMany (and in one PushPull each without it).
    let batched: u64 = reports.iter().filter_map(|r| r.status.as_ref()).map(|s| s.batched_shards).sum();
    if many && nodes > 1 {
        assert!(batched > 0, "no shard went in a PushPullMany");
    } else {
        assert_eq!(batched, 0, "PushPullMany sent with cluster.push_pull_many off");
    }
    if schedule.varies() {
        // The owners did follow the schedule: a constant rate ends elsewhere.
        let constant = single_node_reference(&reports, &batch_of, opt, None)?;
        let d = rel_diff(&reports[0].params, &constant);
        assert!(d > 10.0 * tol, "the cluster matches a constant rate as well ({d:e}): no schedule was applied");
    }
    // And training did move the parameters (the comparison is not vacuous).
    let split = data::load(&DatasetKind::Digits, None)?;
    let init = LocalTrainer::new(
        ModelConfig::for_dataset(shoal_models::ArchKind::Mlp, &split.train),
        opt,
        42,
        1,
        &Device::Cpu,
    )?;
    assert!(rel_diff(&reference, init.params()) > 1e-3, "five steps should change the model");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bsp_sgd_two_and_four_workers_equal_one_node_on_the_concatenated_batch() -> anyhow::Result<()> {
    equivalence(2, OptimizerKind::Sgd, 0.05, &[32, 32], 1e-5).await?;
    equivalence(4, OptimizerKind::Sgd, 0.05, &[32, 32, 32, 32], 1e-5).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bsp_owners_follow_the_cosine_schedule_like_one_node() -> anyhow::Result<()> {
    // Shard owners set the rate by shard version: the same steps as one node
    // that sets it by step.
    equivalence_with(4, OptimizerKind::Sgd, 0.2, &[32, 32, 32, 32], 1e-5, LrDecay::Cosine, true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bsp_with_one_push_pull_per_shard_equals_one_node_too() -> anyhow::Result<()> {
    // `cluster.push_pull_many = false`: the exchange as wire minor 3 made it.
    equivalence_with(4, OptimizerKind::Sgd, 0.05, &[32, 32, 32, 32], 1e-5, LrDecay::None, false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bsp_adamw_four_workers_equal_one_node() -> anyhow::Result<()> {
    let _ = tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).try_init();
    equivalence(4, OptimizerKind::Adamw, 2e-3, &[32, 32, 32, 32], 1e-4).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heterogeneous_batches_weighted_by_samples_stay_equivalent() -> anyhow::Result<()> {
    equivalence(3, OptimizerKind::Sgd, 0.05, &[16, 32, 64], 1e-5).await
}

async fn train_policy(sync: SyncPolicy, steps: u64, target: f32) -> anyhow::Result<Vec<NodeReport>> {
    let base =
        digits_config(&format!("acc-{}", sync.to_string().replace(':', "-")), steps, sync, OptimizerKind::Sgd, 0.1);
    let reports = run_cluster(&ClusterSpec::new(4, base)).await?;
    for r in &reports {
        eprintln!(
            "{sync}: {} accuracy {:.4}, owned {:?}, shard stats {:?}",
            r.name, r.accuracy, r.owned_shards, r.shard_stats
        );
        assert!(r.accuracy >= target, "{sync}: {} reached only {:.4}", r.name, r.accuracy);
    }
    // The run ended with nobody taken for failed: each node read its report
    // while every peer was still in its view (the last node to finish
    // stays until its peers have its last step, docs/protocol.md §6.3).
    for r in &reports {
        assert_eq!(r.peer_capabilities.len(), 3, "{sync}: {} saw {:?} at the end", r.name, r.peer_capabilities.keys());
    }
    let owned: usize = reports.iter().map(|r| r.owned_shards.len()).sum();
    assert_eq!(owned, 8, "every shard has exactly one owner");
    assert!(reports.iter().all(|r| r.owned_shards.len() == 2), "8 shards over 4 equal nodes: 2 each");
    Ok(reports)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_node_bsp_cluster_reaches_95_percent_on_digits() -> anyhow::Result<()> {
    let reports = train_policy(SyncPolicy::Bsp, 300, 0.95).await?;
    // BSP: everyone ends on the same model.
    for r in &reports[1..] {
        assert_eq!(r.params, reports[0].params, "BSP workers must agree bit for bit");
    }
    for r in &reports {
        assert!(r.shard_stats.iter().all(|s| s.max_staleness == 0 && s.version == 300), "{:?}", r.shard_stats);
        // The default norm check (K = 50 under BSP) dropped no honest gradient.
        let rejected = r.status.as_ref().map(|s| s.rejected_contributions.clone()).unwrap_or_default();
        assert!(rejected.is_empty(), "{}: honest gradients rejected: {rejected:?}", r.name);
    }
    // Capabilities are measured and gossiped: every node's view holds the
    // others' memory and rates, and each peer's rates agree with what its
    // own status counted (moving averages of per-step rates against the
    // totals' ratio, so within a factor of 3).
    for r in &reports {
        for peer in reports.iter().filter(|p| p.peer_id != r.peer_id) {
            let c = r
                .peer_capabilities
                .get(&peer.peer_id)
                .ok_or_else(|| anyhow::anyhow!("{}: no {}", r.name, peer.name))?;
            let s = peer.status.as_ref().ok_or_else(|| anyhow::anyhow!("{}: no status", peer.name))?;
            let compute = s.samples as f64 / s.compute_secs;
            // The link rate: bytes of the exchanges with remote owners over
            // their round trips less the owners' holds for the round.
            let net = s.link_bytes as f64 / s.link_secs;
            assert!(
                s.link_bytes > 0 && s.link_bytes <= s.bytes_in + s.bytes_out,
                "{}: {} link bytes of {} moved",
                peer.name,
                s.link_bytes,
                s.bytes_in + s.bytes_out
            );
            eprintln!(
                "{} sees {}: {} MB of memory, {:.0} samples/s ({compute:.0} by its status), {:.1} MB/s ({:.1})",
                r.name,
                peer.name,
                c.memory_bytes >> 20,
                c.compute_samples_per_sec,
                c.net_bytes_per_sec / 1e6,
                net / 1e6
            );
            assert!(c.memory_bytes > 1 << 20, "{}: {} gossiped {} bytes of memory", r.name, peer.name, c.memory_bytes);
            let within =
                |gossiped: f32, counted: f64| gossiped as f64 >= counted / 3.0 && gossiped as f64 <= counted * 3.0;
            assert!(
                within(c.compute_samples_per_sec, compute),
                "{}: {} compute {c:?} against {compute}",
                r.name,
                peer.name
            );
            assert!(within(c.net_bytes_per_sec, net), "{}: {} link {c:?} against {net}", r.name, peer.name);
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ssp_dssp_and_asp_clusters_reach_93_percent_within_their_staleness_bounds() -> anyhow::Result<()> {
    for sync in [SyncPolicy::Ssp { staleness: 2 }, SyncPolicy::Dssp { lo: 1, hi: 4 }, SyncPolicy::Asp] {
        let reports = train_policy(sync, 300, 0.93).await?;
        let worst = reports.iter().flat_map(|r| r.shard_stats.iter().map(|s| s.max_staleness)).max().unwrap_or(0);
        eprintln!("{sync}: largest recorded staleness {worst}");
        if let Some(bound) = sync.max_bound() {
            assert!(worst <= bound, "{sync}: staleness {worst} exceeds {bound}");
        }
        // Asynchronous owners step once per push: 4 workers x 300 steps.
        for r in &reports {
            assert!(r.shard_stats.iter().all(|s| s.version == 1200), "{sync}: {:?}", r.shard_stats);
        }
    }
    Ok(())
}

/// Gossip mode on digits for `steps` steps: SGD at 0.1, an average with a
/// random peer every 5 steps, and cosine decay (decentralised SGD reaches
/// consensus as the step size decays, and the nodes end on the average of
/// their final models).
fn gossip_config(run: &str, steps: u64) -> shoal_node::config::NodeConfig {
    let mut c = digits_config(run, steps, SyncPolicy::Bsp, OptimizerKind::Sgd, 0.1);
    c.cluster.mode = shoal_node::config::Mode::Gossip;
    c.gossip = Some(shoal_node::config::GossipConfig { every: 5 });
    c.training.lr_decay = LrDecay::Cosine;
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gossip_mode_converges_and_nodes_agree() -> anyhow::Result<()> {
    let base = gossip_config("gossip", 300);
    let reports = run_cluster(&ClusterSpec::new(4, base)).await?;
    let mut first = 0.0f32;
    // Every node's figures first: a CI run failed on node0 at 90.25% (its
    // distances as usual) and showed no other node; 26 runs here gave
    // 96.10-97.21% on every node, 8 of them beside two busy processes.
    for r in &reports {
        let s = r.status.as_ref().ok_or_else(|| anyhow::anyhow!("no status"))?;
        eprintln!(
            "gossip: {} accuracy {:.4}, distance first {:?} last {:?}, steps {}, samples {}, roster {}",
            r.name,
            r.accuracy,
            s.gossip_first_distance,
            s.gossip_last_distance,
            r.steps,
            s.samples,
            r.roster.len()
        );
    }
    for r in &reports {
        let s = r.status.as_ref().ok_or_else(|| anyhow::anyhow!("no status"))?;
        assert!(r.accuracy >= 0.93, "gossip: {} reached only {:.4}", r.name, r.accuracy);
        assert!(r.owned_shards.is_empty(), "gossip mode has no shard owners");
        first = first.max(s.gossip_first_distance.ok_or_else(|| anyhow::anyhow!("{} never exchanged", r.name))?);
    }
    // Largest pairwise distance between the final models.
    let mut last = 0.0f64;
    for a in &reports {
        for b in &reports {
            last = last.max(rel_diff(&a.params, &b.params));
        }
    }
    eprintln!("gossip: largest distance at the first exchange {first:.3e}, between final models {last:.3e}");
    assert!(first as f64 >= 10.0 * last, "distance shrank only from {first:e} to {last:e}");
    Ok(())
}

/// A node that arrives after a gossip run started joins it at once. Gossip
/// mode has no shard owners, and a joiner once waited a whole failure
/// timeout for them to be heard (CI saw a late roster member do so and
/// find the run over): the long failure timeout here would outlast the run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_node_joins_a_gossip_run_without_waiting_for_owners() -> anyhow::Result<()> {
    let _ = tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).try_init();
    const RUN: u64 = 300;
    let mut base = gossip_config("gossip-join", RUN);
    base.cluster.failure_timeout_ms = 120_000;
    let spec = ClusterSpec::new(3, base);
    let mut cluster = shoal_node::cluster::Cluster::start(&spec).await?;
    let mut progress = cluster.nodes[0].progress.clone();
    tokio::time::timeout(std::time::Duration::from_secs(300), progress.wait_for(|s| s.step >= 30))
        .await
        .map_err(|_| anyhow::anyhow!("node0 never reached step 30"))??;
    let joiner = cluster.add_via(&spec, 3, &[0]).await?;
    let joiner_id = cluster.nodes[joiner].peer_id;
    let reports = shoal_tests::wait_all(cluster).await?;
    let j = reports.iter().find(|r| r.peer_id == joiner_id).ok_or_else(|| anyhow::anyhow!("no joiner report"))?;
    let js = shoal_tests::status(j)?;
    let at = js.joined_at_step.ok_or_else(|| anyhow::anyhow!("the joiner did not record a join"))?;
    eprintln!("gossip joiner: joined at step {at} from {} donors, accuracy {:.4}", js.join_donors, j.accuracy);
    assert!((30..RUN).contains(&at), "joined at step {at}");
    assert_eq!(j.steps, RUN, "the joiner trains to the end");
    assert!(js.gossip_first_distance.is_some(), "the joiner never gossiped");
    for r in &reports {
        assert!(r.accuracy >= 0.93, "{}: accuracy {:.4} below 93%", r.name, r.accuracy);
        // The last node to finish stops at once, and its `finished` can go
        // down with its connections: the others take the closed connection
        // for it instead of waiting out the two-minute failure timeout.
        assert!(r.peers_finished, "{} waited out the failure timeout for a peer at the end", r.name);
    }
    Ok(())
}

/// Gossip mode with node3 computing 100x slower: the others average only
/// with copies at most `GOSSIP_MAX_BEHIND` gossip periods behind theirs, so
/// node3's early models do not drag them back, while node3 averages with
/// their copies, which are ahead, and catches up. Without the bound the
/// cluster ended at 87.74% (64x: 91.92-92.76%); with it 94.71% (64x:
/// 94.99-95.26%, 32x: 96.10-97.21%).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_far_slower_node_does_not_drag_the_gossip_average_back() -> anyhow::Result<()> {
    let mut spec = ClusterSpec::new(4, gossip_config("gossip-lag", 300));
    spec.overrides = vec![NodeOverride::default(); 4];
    spec.overrides[3].slowdown = Some(100.0);
    let reports = run_cluster(&spec).await?;
    for r in &reports {
        let s = r.status.as_ref().ok_or_else(|| anyhow::anyhow!("no status"))?;
        eprintln!(
            "gossip, node3 100x slower: {} accuracy {:.4}, steps {}, samples {}",
            r.name, r.accuracy, r.steps, s.samples
        );
    }
    for r in &reports {
        assert_eq!(r.steps, 300, "{}", r.name);
        assert!(r.accuracy >= 0.93, "gossip, node3 100x slower: {} reached only {:.4}", r.name, r.accuracy);
    }
    Ok(())
}
