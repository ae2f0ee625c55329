//! Gossiped capabilities weigh the placement over real loopback TCP: a node
//! on a slow uplink (an emulated 16 Mbit/s link, the others on loopback)
//! measures a low link rate, gossips it, and every node caps its weight, so
//! it owns fewer shards. Its own service times cannot show it: an owner
//! reports the time it took to serve, which leaves out its link.
//! (A node computing 8x slower is capped by its compute rate in
//! `fit_batch.rs`.)
//!
//! Alone in its own test binary: the link rates are compared between the
//! nodes, which CPU contention from other clusters would blur.

use shoal_node::cluster::{Cluster, ClusterSpec, NodeOverride};
use shoal_tests::{elastic_config, status, wait_all};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_on_a_slow_uplink_is_weighted_down_by_its_gossiped_link_rate() -> anyhow::Result<()> {
    const STEPS: u64 = 80;
    let mut base = elastic_config("capabilities-link");
    // 85k parameters in 8 shards of 42 KB: a shard takes 21 ms each way on
    // 16 Mbit/s, past the noise floor (2 x 5 ms per push), and under a
    // millisecond on loopback.
    base.training.mlp_hidden = Some(vec![256, 256]);
    base.training.steps = STEPS;
    let mut spec = ClusterSpec::new(4, base);
    spec.overrides = vec![NodeOverride::default(); 4];
    spec.overrides[3].link_mbps = Some(16.0);
    let cluster = Cluster::start(&spec).await?;
    let slow = cluster.nodes[3].peer_id;
    let reports = wait_all(cluster).await?;
    for r in &reports {
        let s = status(r)?;
        eprintln!(
            "{}: accuracy {:.2}%, link {:.1} MB/s ({} bytes in {:.2} s), owns {:?}, role changes {:?}",
            r.name,
            r.accuracy * 100.0,
            s.link_bytes as f64 / s.link_secs.max(f64::MIN_POSITIVE) / 1e6,
            s.link_bytes,
            s.link_secs,
            r.owned_shards,
            s.role_changes.iter().map(|c| (c.step, c.owned.clone())).collect::<Vec<_>>(),
        );
    }
    for r in &reports {
        let s = status(r)?;
        assert_eq!(s.step, STEPS, "{}", r.name);
        // Shards moved with their state: no update lost.
        assert_eq!(s.model_version, STEPS, "{}: every BSP round applied exactly once", r.name);
        assert_eq!(s.restored_from_replica + s.restored_from_worker_copy, 0, "{}", r.name);
        assert_eq!(s.max_version_regression, 0, "{}: version went back", r.name);
        assert!(r.accuracy >= 0.8, "{}: accuracy {:.4}", r.name, r.accuracy);
    }
    let node3 = reports.iter().find(|r| r.peer_id == slow).ok_or_else(|| anyhow::anyhow!("no node3"))?;
    // Every node saw node3's link rate well below the others'.
    for r in reports.iter().filter(|r| r.peer_id != slow) {
        let of = |id| r.peer_capabilities.get(id).map(|c| c.net_bytes_per_sec).unwrap_or(0.0);
        let theirs = of(&slow);
        let others: Vec<f32> =
            reports.iter().filter(|p| p.peer_id != slow && p.peer_id != r.peer_id).map(|p| of(&p.peer_id)).collect();
        assert!(
            theirs > 0.0 && others.iter().all(|&o| theirs * 2.0 < o),
            "{} sees node3 at {theirs} bytes/s and the others at {others:?}",
            r.name
        );
    }
    // A link at a fortieth of the others' caps it at a quarter of the
    // weight: of 8 shards it owns at most ceil(8 x 0.25 / 3.25) = 1 (equal
    // weights give exactly 2).
    let owned: usize = reports.iter().map(|r| r.owned_shards.len()).sum();
    assert_eq!(owned, 8, "every shard owned once");
    assert!(node3.owned_shards.len() <= 1, "node3 owns {:?}", node3.owned_shards);
    // Its share moved once its rate was reported (after 3 steps), within
    // the first 10 steps, and never back.
    let s = status(node3)?;
    let moves: Vec<u64> = s.role_changes.iter().map(|c| c.step).filter(|&step| step > 0 && step < STEPS).collect();
    assert!(moves.len() <= 2 && moves.iter().all(|&step| step <= 10), "node3's share moved at steps {moves:?}");
    Ok(())
}
