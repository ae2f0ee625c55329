//! Memory in the election over real loopback TCP: a node that offers less
//! memory than its share of the shards owns none of them, and trains.
//!
//! Alone in its own test binary: the elastic tests already run 8 clusters
//! on 2 cores at once, and a ninth beside them made a demoted owner's
//! verdict flap under the load (CI, once).

use shoal_node::cluster::{Cluster, ClusterSpec, NodeOverride};
use shoal_tests::{elastic_config, status, wait_all, ELASTIC_STEPS as STEPS};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_the_memory_for_its_share_owns_nothing_and_still_trains() -> anyhow::Result<()> {
    // node3 offers 1 kB (`cluster.memory_bytes`), less than one shard's
    // owner state; the others offer what the machine has left. Every node
    // reads node3's figure from its heartbeats and leaves it out of the
    // placement, from the first one on.
    let mut base = elastic_config("elastic-memory");
    base.roles.elastic = false;
    let mut spec = ClusterSpec::new(4, base);
    spec.overrides = vec![NodeOverride::default(); 4];
    spec.overrides[3].memory_bytes = Some(1000);
    let cluster = Cluster::start(&spec).await?;
    let small = cluster.nodes[3].peer_id;
    let reports = wait_all(cluster).await?;
    let mut owners = 0;
    for r in &reports {
        let s = status(r)?;
        eprintln!(
            "{}: accuracy {:.2}%, {} steps, owns {:?}, role changes {:?}",
            r.name,
            r.accuracy * 100.0,
            s.step,
            r.owned_shards,
            s.role_changes.iter().map(|c| (c.step, c.role, c.owned.clone())).collect::<Vec<_>>(),
        );
        assert!(r.accuracy >= 0.93, "{}: accuracy {:.4} below 93%", r.name, r.accuracy);
        assert_eq!(s.step, STEPS, "{}", r.name);
        let gossiped = r.peer_capabilities.get(&small).map(|c| c.memory_bytes);
        if r.peer_id == small {
            assert!(r.owned_shards.is_empty(), "node3 owns {:?}", r.owned_shards);
            assert!(s.role_changes.iter().all(|c| c.owned.is_empty()), "node3 owned shards at some point");
        } else {
            assert_eq!(gossiped, Some(1000), "{}: node3's memory as gossiped", r.name);
            owners += usize::from(!r.owned_shards.is_empty());
        }
    }
    assert_eq!(owners, 3, "the three nodes with memory share the shards");
    Ok(())
}
