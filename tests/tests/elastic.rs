//! Elastic roles over real loopback TCP: a slowed aggregator is demoted and
//! its shards move (once: probes keep it out, and bring it back when its
//! slowdown ends); a killed aggregator's shards are re-homed from replicas
//! within the loss bound; training still reaches the accuracy target. (A
//! slow worker fitting its batch is in `fit_batch.rs`.)

use std::time::Duration;

use shoal_node::cluster::{Cluster, ClusterSpec, NodeOverride};
use shoal_node::handles::status::RoleView;
use shoal_node::node::NodeReport;
use shoal_tests::{elastic_config, status, wait_all, ELASTIC_STEPS};

const STEPS: u64 = ELASTIC_STEPS;

/// The idle-aggregator test runs alone (`write`), the others beside one
/// another (`read`): its exchange share is mostly the round's wait for the
/// slowest worker, and another cluster on the same cores stretches that
/// wait (a CI run, beside the other tests of this file, saw a share over
/// its threshold at most windows and never kept a removal).
static ALONE: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowed_aggregator_is_demoted_its_shards_move_and_accuracy_reaches_93_percent() -> anyhow::Result<()> {
    let _beside_others = ALONE.read().await;
    // node3 answers every push and pull 25 ms late: on loopback that is far
    // more than 5x the others' service time (about 1 ms). 600 steps: six
    // times `service_forget_steps`, after which reports used to age out and
    // hand a demoted owner its shards back.
    let mut base = elastic_config("elastic-slow");
    base.training.steps = 2 * ELASTIC_STEPS;
    let mut spec = ClusterSpec::new(4, base);
    spec.overrides = vec![NodeOverride::default(); 4];
    spec.overrides[3].fault_delay_ms = Some(25);
    let cluster = Cluster::start(&spec).await?;
    let slow = cluster.nodes[3].peer_id;
    // node0's `/history` as it trains: the last one read before its status
    // actor stopped.
    let watch = cluster.nodes[0].status.clone();
    let history = tokio::spawn(async move {
        let mut last = None;
        while let Some(doc) = watch.history().await {
            last = Some(doc);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        last
    });
    let reports = wait_all(cluster).await?;
    let shards = spec.base.cluster.shards as usize;
    // The ownership timeline node0 kept shows node3's shards moving: node3
    // owned some at first and none in the last placement.
    let doc = history.await?.ok_or_else(|| anyhow::anyhow!("node0 never answered /history"))?;
    let slow_index = doc.history.peers.iter().position(|p| *p == slow.to_string()).map(|i| i as u32);
    let owns = |o: &shoal_node::policy::history::Ownership| slow_index.is_some_and(|i| o.owners.contains(&i));
    let marks = &doc.history.ownership;
    eprintln!("node0's ownership timeline: {} placements, peers {:?}", marks.len(), doc.history.peers);
    assert!(marks.iter().all(|o| o.owners.len() == shards), "a placement without every shard: {marks:?}");
    assert!(marks.iter().any(owns), "node3 owns nothing in node0's timeline: {marks:?}");
    assert!(marks.last().is_some_and(|o| !owns(o)), "node3 still owns shards in node0's last placement: {marks:?}");
    let mut handed_in = 0;
    for r in &reports {
        let s = status(r)?;
        eprintln!(
            "{}: accuracy {:.2}%, owns {:?}, role changes {:?}, handoffs in {} out {}",
            r.name,
            r.accuracy * 100.0,
            r.owned_shards,
            s.role_changes.iter().map(|c| (c.step, c.role, c.owned.clone())).collect::<Vec<_>>(),
            s.handoffs_in,
            s.handoffs_out
        );
        assert!(r.accuracy >= 0.93, "{}: accuracy {:.4} below 93%", r.name, r.accuracy);
        handed_in += s.handoffs_in;
    }
    let slow_report = reports.iter().find(|r| r.peer_id == slow).ok_or_else(|| anyhow::anyhow!("no node3"))?;
    let s = status(slow_report)?;
    // node3 started as an aggregator and was demoted to a worker.
    assert!(s.role_changes.iter().any(|c| c.role == RoleView::Aggregator && !c.owned.is_empty()), "never owned");
    assert!(
        s.role_changes.iter().any(|c| c.role == RoleView::Worker && c.owned.is_empty()),
        "node3 was not demoted: {:?}",
        s.role_changes
    );
    assert!(slow_report.owned_shards.is_empty(), "node3 still owns {:?}", slow_report.owned_shards);
    // Demoted once, for good: its probes keep the reports about it fresh,
    // so they never age out and hand it shards again (the old flapping).
    let demoted = s.role_changes.iter().position(|c| c.role == RoleView::Worker && c.owned.is_empty());
    let after: Vec<_> = demoted
        .map(|i| {
            s.role_changes[i + 1..]
                .iter()
                .filter(|c| c.role != RoleView::Done)
                .map(|c| (c.step, c.role, c.owned.clone()))
                .collect()
        })
        .unwrap_or_default();
    assert!(after.is_empty(), "node3 changed role again after its demotion: {after:?}");
    assert!(s.handoffs_out >= 1, "node3 handed nothing over");
    assert!(handed_in >= s.handoffs_out, "transfers out {} but only {handed_in} received", s.handoffs_out);
    // Every shard is owned by exactly one of the healthy nodes at the end.
    let mut owned: Vec<u32> = reports.iter().flat_map(|r| r.owned_shards.clone()).collect();
    owned.sort_unstable();
    assert_eq!(owned, (0..shards as u32).collect::<Vec<_>>(), "final ownership");
    // Nothing was restored from a replica or a worker copy: a clean move loses nothing.
    for r in &reports {
        let st = status(r)?;
        assert_eq!(st.restored_from_worker_copy, 0, "{}", r.name);
        assert_eq!(st.max_version_regression, 0, "{}: version went back", r.name);
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demoted_owner_is_readmitted_by_its_probes_once_its_slowdown_ends() -> anyhow::Result<()> {
    let _beside_others = ALONE.read().await;
    let mut base = elastic_config("elastic-readmit");
    // Reports never age out in this run: only fresh measurements (the
    // probes) can bring the demoted owner back.
    base.roles.service_forget_steps = 100_000;
    let mut spec = ClusterSpec::new(4, base);
    spec.overrides = vec![NodeOverride::default(); 4];
    spec.overrides[3].fault_delay_ms = Some(25);
    let cluster = Cluster::start(&spec).await?;
    let slow = cluster.nodes[3].peer_id;
    let mut placement = cluster.nodes[0].placement.subscribe();
    let mut progress = cluster.nodes[0].progress.clone();
    // Until node0's placement demotes node3 (or node0 finishes training).
    tokio::select! {
        r = placement.wait_for(|p| p.as_ref().is_some_and(|p| p.stragglers.contains(&slow))) => { r?; }
        r = progress.wait_for(|s| s.step >= STEPS) => { r?; anyhow::bail!("node3 was never demoted"); }
        _ = tokio::time::sleep(Duration::from_secs(300)) => anyhow::bail!("node3 not demoted within 300 s"),
    }
    let ended_at = cluster.nodes[3].progress.borrow().step;
    cluster.nodes[3].faults.set_serve_delay_ms(0);
    let mut progress = cluster.nodes[0].progress.clone();
    let eligible = |p: &Option<std::sync::Arc<shoal_node::policy::placement::Placement>>| {
        p.as_ref().is_some_and(|p| !p.stragglers.contains(&slow) && p.levels.iter().any(|(q, _)| *q == slow))
    };
    tokio::select! {
        r = placement.wait_for(eligible) => { r?; }
        r = progress.wait_for(|s| s.step >= STEPS) => {
            r?;
            anyhow::bail!("node3 still out at the end of the run (its slowdown ended at step {ended_at})");
        }
        _ = tokio::time::sleep(Duration::from_secs(300)) => anyhow::bail!("node3 not readmitted within 300 s"),
    }
    let back_at = cluster.nodes[3].progress.borrow().step;
    eprintln!("node3: slowdown ended at step {ended_at}, eligible again at step {back_at}");
    let reports = wait_all(cluster).await?;
    for r in &reports {
        let s = status(r)?;
        eprintln!(
            "{}: accuracy {:.2}%, owns {:?}, role changes {:?}",
            r.name,
            r.accuracy * 100.0,
            r.owned_shards,
            s.role_changes.iter().map(|c| (c.step, c.role, c.owned.clone())).collect::<Vec<_>>(),
        );
        assert!(r.accuracy >= 0.93, "{}: accuracy {:.4} below 93%", r.name, r.accuracy);
    }
    // And it stayed in: node0's last placement still counts it eligible.
    // (Whether it owns a shard there is the rendezvous's draw among 4.)
    let last = placement.borrow().clone();
    assert!(eligible(&last), "node3 was demoted again: {last:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_aggregator_shards_are_rehomed_from_replicas_within_the_loss_bound() -> anyhow::Result<()> {
    let _beside_others = ALONE.read().await;
    let mut base = elastic_config("elastic-kill");
    // Only the failure moves shards here: no straggler judgement (noise on a
    // loaded 2-core machine must not add moves to the loss accounting).
    base.roles.elastic = false;
    let replica_every = base.roles.replica_every;
    let spec = ClusterSpec::new(4, base);
    let mut cluster = Cluster::start(&spec).await?;
    let victim = 3;
    // Kill node3 once it is well into training (an event, not a timer).
    let mut progress = cluster.nodes[victim].progress.clone();
    let mut placement = cluster.nodes[victim].placement.subscribe();
    tokio::time::timeout(Duration::from_secs(300), progress.wait_for(|s| s.step >= 60))
        .await
        .map_err(|_| anyhow::anyhow!("node3 never reached step 60"))??;
    let owned_at_kill = placement.borrow_and_update().as_ref().map(|p| p.owned_by(&cluster.nodes[victim].peer_id));
    let (name, dead) = cluster.kill(victim).await?;
    eprintln!("killed {name} ({dead}) owning {owned_at_kill:?}");
    assert!(owned_at_kill.as_ref().is_some_and(|o| !o.is_empty()), "the victim owned no shard");
    let reports = wait_all(cluster).await?;
    let mut from_replica = 0;
    for r in &reports {
        let s = status(r)?;
        eprintln!(
            "{}: accuracy {:.2}%, owns {:?}, role changes {:?}, restored from replica {} / worker copy {}, version regression {}",
            r.name,
            r.accuracy * 100.0,
            r.owned_shards,
            s.role_changes.iter().map(|c| (c.step, c.owned.clone())).collect::<Vec<_>>(),
            s.restored_from_replica,
            s.restored_from_worker_copy,
            s.max_version_regression
        );
        assert!(r.accuracy >= 0.93, "{}: accuracy {:.4} below 93%", r.name, r.accuracy);
        // The loss bound: a replica is at most `replica_every` versions old,
        // plus the versions applied while one replica was on the wire.
        assert!(
            s.max_version_regression <= replica_every + 1,
            "{}: version went back by {} (> {})",
            r.name,
            s.max_version_regression,
            replica_every + 1
        );
        assert_eq!(s.restored_from_worker_copy, 0, "{}: a shard lost its optimizer state", r.name);
        from_replica += s.restored_from_replica;
        assert!(!r.owned_shards.is_empty(), "{}: survivors share the shards", r.name);
    }
    let owned_at_kill = owned_at_kill.unwrap_or_default();
    assert!(from_replica >= owned_at_kill.len() as u64, "{from_replica} restores for {owned_at_kill:?}");
    let mut owned: Vec<u32> = reports.iter().flat_map(|r| r.owned_shards.clone()).collect();
    owned.sort_unstable();
    assert_eq!(owned, (0..spec.base.cluster.shards).collect::<Vec<_>>(), "every shard re-homed once");
    Ok(())
}

/// Sum, over every node's shards, of the pushes they accepted from `peer`.
fn pushes_from(reports: &[NodeReport], peer: &shoal_protocol::libp2p::PeerId) -> anyhow::Result<u64> {
    let id = peer.to_string();
    let mut n = 0;
    for r in reports {
        n += status(r)?.pushes_accepted.get(&id).copied().unwrap_or(0);
    }
    Ok(n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_joins_mid_run_fetches_the_model_from_several_peers_and_its_gradients_count() -> anyhow::Result<()> {
    let _beside_others = ALONE.read().await;
    let mut base = elastic_config("elastic-join");
    // Only the join moves shards here (see the kill test).
    base.roles.elastic = false;
    let shards = base.cluster.shards as u64;
    let spec = ClusterSpec::new(4, base);
    let mut cluster = Cluster::start(&spec).await?;
    let mut progress = cluster.nodes[0].progress.clone();
    tokio::time::timeout(Duration::from_secs(300), progress.wait_for(|s| s.step >= 60))
        .await
        .map_err(|_| anyhow::anyhow!("node0 never reached step 60"))??;
    // It dials node0 alone, yet must fetch the model from several donors
    // (a joiner once fetched every shard from its one bootstrap peer).
    let joiner = cluster.add_via(&spec, 4, &[0]).await?;
    let joiner_id = cluster.nodes[joiner].peer_id;
    let reports = wait_all(cluster).await?;
    let j = reports.iter().find(|r| r.peer_id == joiner_id).ok_or_else(|| anyhow::anyhow!("no joiner report"))?;
    let js = status(j)?;
    let at = js.joined_at_step.ok_or_else(|| anyhow::anyhow!("the joiner did not record a join"))?;
    let trained = STEPS - at;
    let counted = pushes_from(&reports, &joiner_id)?;
    eprintln!(
        "joiner {}: joined at step {at} from {} donors, trained {trained} steps, {counted} pushes accepted, \
         owns {:?}, handoffs in {}, accuracy {:.2}%",
        j.name,
        js.join_donors,
        j.owned_shards,
        js.handoffs_in,
        j.accuracy * 100.0
    );
    assert!((60..STEPS).contains(&at), "joined at step {at}");
    assert_eq!(j.steps, STEPS, "the joiner trains to the end");
    assert!(js.join_donors >= 2, "the model came from {} donor(s); it must be spread", js.join_donors);
    // Its gradients were taken by the owners: one push per shard per step,
    // less the few refused while the owners had not yet seen it ready.
    assert!(counted >= shards * trained * 8 / 10, "{counted} pushes counted for {trained} steps x {shards} shards");
    assert!(js.handoffs_in >= j.owned_shards.len() as u64, "the joiner's shards came by handoff");
    for r in &reports {
        let s = status(r)?;
        eprintln!(
            "{}: accuracy {:.2}%, owns {:?}, versions {:?}",
            r.name,
            r.accuracy * 100.0,
            r.owned_shards,
            r.shard_stats.iter().map(|s| s.version).collect::<Vec<_>>()
        );
        // The joiner too: it starts at the step of the round in progress
        // (`join::start_step`), so it ends with the others instead of
        // running rounds of its own after they finished (it once ended
        // 6.4 points below them that way, at 89.69%).
        assert!(r.accuracy >= 0.93, "{}: accuracy {:.4} below 93%", r.name, r.accuracy);
        assert_eq!(s.restored_from_worker_copy, 0, "{}: a shard lost its optimizer state", r.name);
        assert_eq!(s.max_version_regression, 0, "{}: version went back", r.name);
    }
    let first: Vec<_> = reports.iter().filter(|r| r.peer_id != joiner_id).collect();
    assert!(
        first.windows(2).all(|w| w[0].params == w[1].params),
        "the nodes there from the start ended on different models"
    );
    let mut owned: Vec<u32> = reports.iter().flat_map(|r| r.owned_shards.clone()).collect();
    owned.sort_unstable();
    assert_eq!(owned, (0..shards as u32).collect::<Vec<_>>(), "every shard owned once");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_leaves_cleanly_hands_off_its_shards_and_loses_nothing() -> anyhow::Result<()> {
    let _ = tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).try_init();
    let _beside_others = ALONE.read().await;
    let mut base = elastic_config("elastic-leave");
    base.roles.elastic = false;
    let shards = base.cluster.shards;
    let spec = ClusterSpec::new(4, base);
    let cluster = Cluster::start(&spec).await?;
    let leaver = 3;
    let leaver_id = cluster.nodes[leaver].peer_id;
    let mut progress = cluster.nodes[leaver].progress.clone();
    tokio::time::timeout(Duration::from_secs(300), progress.wait_for(|s| s.step >= 60))
        .await
        .map_err(|_| anyhow::anyhow!("node3 never reached step 60"))??;
    let owned_at_leave = cluster.nodes[leaver].placement.current().map(|p| p.owned_by(&leaver_id)).unwrap_or_default();
    cluster.nodes[leaver].leave();
    let reports = wait_all(cluster).await?;
    let l = reports.iter().find(|r| r.peer_id == leaver_id).ok_or_else(|| anyhow::anyhow!("no leaver report"))?;
    let ls = status(l)?;
    eprintln!(
        "leaver {}: left at step {:?} owning {owned_at_leave:?}; handoffs out {}, owns {:?} at the end, {} pushes counted",
        l.name,
        ls.left_at_step,
        ls.handoffs_out,
        l.owned_shards,
        pushes_from(&reports, &leaver_id)?
    );
    assert!(l.left && l.steps >= 60 && l.steps < STEPS, "left {} at step {}", l.left, l.steps);
    assert_eq!(ls.left_at_step, Some(l.steps));
    assert!(!owned_at_leave.is_empty(), "the leaver owned no shard");
    assert!(l.shard_stats.is_empty(), "the leaver still serves {:?}", l.shard_stats);
    assert!(ls.handoffs_out >= owned_at_leave.len() as u64, "handed off {} of {owned_at_leave:?}", ls.handoffs_out);
    let mut handed_in = 0;
    for r in reports.iter().filter(|r| r.peer_id != leaver_id) {
        let s = status(r)?;
        eprintln!(
            "{}: accuracy {:.2}%, owns {:?}, handoffs in {}, versions {:?}",
            r.name,
            r.accuracy * 100.0,
            r.owned_shards,
            s.handoffs_in,
            r.shard_stats.iter().map(|s| s.version).collect::<Vec<_>>()
        );
        assert!(r.accuracy >= 0.93, "{}: accuracy {:.4} below 93%", r.name, r.accuracy);
        assert_eq!(r.steps, STEPS);
        // Lost nothing: every moved shard came with its optimizer state and version.
        assert_eq!(s.restored_from_replica, 0, "{}: restored from a replica", r.name);
        assert_eq!(s.restored_from_worker_copy, 0, "{}: restored from a worker copy", r.name);
        assert_eq!(s.max_version_regression, 0, "{}: version went back", r.name);
        handed_in += s.handoffs_in;
    }
    assert!(handed_in >= owned_at_leave.len() as u64, "{handed_in} transfers received for {owned_at_leave:?}");
    let mut owned: Vec<u32> = reports.iter().flat_map(|r| r.owned_shards.clone()).collect();
    owned.sort_unstable();
    assert_eq!(owned, (0..shards).collect::<Vec<_>>(), "every shard owned once, none by the leaver");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_aggregator_is_removed_and_its_shards_move_without_loss() -> anyhow::Result<()> {
    let _alone = ALONE.write().await;
    // Every node owns shards at the start and computes 32x slower (an
    // injected slowdown of its CPU time), so exchanging shards is a small
    // share of a step, under the idle threshold (raised to 45% here): the
    // explorer tries one owner fewer, and keeps it unless steps get 10%
    // slower. The share measured at the trials, on 2 cores: 16x gave
    // 0.26-0.37 alone and 0.38-0.50 beside two busy processes (where 2
    // runs in 3 failed); 32x gives 0.17-0.23 alone. (8x left it near the
    // threshold whenever other tests shared the cores.)
    let mut base = elastic_config("elastic-idle");
    base.training.steps = 240;
    base.roles.aggregators = shoal_node::config::Aggregators::Auto;
    base.roles.explore_window_steps = 20;
    base.roles.explore_idle_share = 0.45;
    base.faults.slowdown = 32.0;
    // One compute thread on any host, so that the slowdown stretches CPU
    // time everywhere (with more it falls back to wall time).
    base.training.threads = Some(1);
    let steps = base.training.steps;
    let spec = ClusterSpec::new(4, base);
    let reports = wait_all(Cluster::start(&spec).await?).await?;
    let mut removed = Vec::new();
    let mut tried = 0;
    for r in &reports {
        let s = status(r)?;
        eprintln!(
            "{}: accuracy {:.2}%, aggregators {}, exploration {:?}, role changes {:?}",
            r.name,
            r.accuracy * 100.0,
            s.aggregators,
            s.exploration.iter().map(|e| (e.step, e.action, e.from, e.to)).collect::<Vec<_>>(),
            s.role_changes.iter().map(|c| (c.step, c.role, c.owned.clone())).collect::<Vec<_>>(),
        );
        assert!(r.accuracy >= 0.93, "{}: accuracy {:.4} below 93%", r.name, r.accuracy);
        tried += s.exploration.iter().filter(|e| e.action == "try" && e.to < e.from).count();
        // An owner that handed all its shards over and went on as a worker.
        let owned_then_none = s
            .role_changes
            .iter()
            .skip_while(|c| c.owned.is_empty())
            .any(|c| c.role == RoleView::Worker && c.owned.is_empty() && c.step > 0);
        if owned_then_none {
            removed.push(r.name.clone());
        }
        // No update lost: every shard moved by a transfer, none restored.
        assert_eq!(s.restored_from_replica + s.restored_from_worker_copy, 0, "{}", r.name);
        assert_eq!(s.max_version_regression, 0, "{}: version went back", r.name);
        assert_eq!(s.model_version, steps, "{}: every BSP round applied exactly once", r.name);
    }
    assert!(tried >= 1, "no node tried one aggregator fewer");
    assert!(!removed.is_empty(), "no aggregator was removed");
    // And the removal was kept: freeing an idle owner costs no speed.
    let kept_removals: usize = reports
        .iter()
        .map(|r| status(r).map(|s| s.exploration.iter().filter(|e| e.action == "keep" && e.to < e.from).count()))
        .sum::<anyhow::Result<usize>>()?;
    assert!(kept_removals >= 1, "every removal was reverted");
    // Where the cluster's exploration last settled: the latest keep or
    // revert any node made. The agreed count is the lower median of every
    // node's proposal, so it follows the others' decisions too; a node's
    // own last decision may be older than the count it ended on (in one
    // run node0 kept 4 at step 181, the other three went back to 3 at 229,
    // and node0, on 3, tried 2). Below the 4 it started from. The count at
    // the very end may be a new try that the run ended in the middle of
    // (one run tried 2 -> 4 at step 224 of 240 and ended on 4).
    let mut decisions = Vec::new();
    for r in &reports {
        let s = status(r)?;
        decisions.extend(
            s.exploration.iter().filter(|e| e.action == "keep" || e.action == "revert").map(|e| (e.step, e.to)),
        );
    }
    let settled = decisions.iter().max_by_key(|(step, _)| *step).map_or(4, |(_, to)| *to);
    assert!(settled < 4, "the cluster's exploration last settled on {settled} aggregators: {decisions:?}");
    eprintln!("removed: {removed:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_number_of_aggregators_grows_while_one_owner_is_the_bottleneck() -> anyhow::Result<()> {
    let _beside_others = ALONE.read().await;
    // Every owner serves shard states over an emulated 40 Mbit/s uplink,
    // starting from a single owner: four workers pull the whole model
    // through that one link each step, so communication dominates and a
    // second owner halves the pull time. The explorer must try more owners
    // (as many as the communication share predicts), see the steps get
    // faster, keep them, and lose nothing on the way.
    let mut base = elastic_config("elastic-explore");
    base.training.mlp_hidden = Some(vec![256, 256]);
    base.training.steps = 240;
    base.roles.aggregators = shoal_node::config::Aggregators::Auto;
    base.roles.start_aggregators = 1;
    base.roles.explore_window_steps = 20;
    base.faults.serve_mbps = 40.0;
    let steps = base.training.steps;
    let spec = ClusterSpec::new(4, base);
    let reports = wait_all(Cluster::start(&spec).await?).await?;
    let mut owners_seen = std::collections::BTreeSet::new();
    let mut kept = 0;
    for r in &reports {
        let s = status(r)?;
        eprintln!(
            "{}: accuracy {:.2}%, aggregators {}, exploration {:?}, role changes {:?}",
            r.name,
            r.accuracy * 100.0,
            s.aggregators,
            s.exploration.iter().map(|e| (e.step, e.action, e.from, e.to, e.before_ms, e.after_ms)).collect::<Vec<_>>(),
            s.role_changes.iter().map(|c| (c.step, c.role, c.owned.clone())).collect::<Vec<_>>(),
        );
        assert!(r.accuracy >= 0.93, "{}: accuracy {:.4} below 93%", r.name, r.accuracy);
        assert!(s.exploration.first().is_some_and(|e| e.action == "try" && e.from == 1 && e.to >= 2), "{}", r.name);
        kept += s.exploration.iter().filter(|e| e.action == "keep").count();
        if s.role_changes.iter().any(|c| c.role == RoleView::Aggregator && !c.owned.is_empty()) {
            owners_seen.insert(r.peer_id);
        }
        // No update lost: every shard moved by a transfer, none restored.
        assert_eq!(s.restored_from_replica + s.restored_from_worker_copy, 0, "{}", r.name);
        assert_eq!(s.max_version_regression, 0, "{}: version went back", r.name);
        assert_eq!(s.model_version, steps, "{}: every BSP round applied exactly once", r.name);
    }
    assert!(kept >= 1, "no node kept a second aggregator");
    assert!(owners_seen.len() >= 2, "shards never moved to a second owner");
    let last_k = reports.iter().map(|r| status(r).map(|s| s.aggregators)).collect::<anyhow::Result<Vec<_>>>()?;
    assert!(last_k.iter().all(|&k| k >= 2), "aggregators at the end: {last_k:?}");
    Ok(())
}
