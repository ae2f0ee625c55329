//! Shared helpers for cross-crate scenarios: cluster configs that finish
//! quickly on a 2-core machine, and parameter comparisons.

use shoal_models::OptimizerKind;
use shoal_node::cluster::{Cluster, ClusterSpec, NodeOverride};
use shoal_node::config::NodeConfig;
use shoal_node::handles::status::StatusSnapshot;
use shoal_node::node::NodeReport;
use shoal_node::policy::sync::SyncPolicy;
use shoal_protocol::PeerId;

/// A digits/MLP config with the given policy; timeouts generous enough for
/// a loaded CI machine but bounded, so a broken cluster fails instead of hanging.
pub fn digits_config(run: &str, steps: u64, sync: SyncPolicy, optimizer: OptimizerKind, lr: f64) -> NodeConfig {
    let mut c = NodeConfig { run_id: run.into(), ..NodeConfig::default() };
    c.training.steps = steps;
    c.training.optimizer = optimizer;
    c.training.lr = Some(lr);
    c.sync.policy = sync;
    c.cluster.shards = 8;
    c.cluster.heartbeat_ms = 100;
    c.cluster.failure_timeout_ms = 5_000;
    c.cluster.start_timeout_ms = 60_000;
    c.cluster.request_timeout_ms = 60_000;
    c.cluster.linger_ms = 30_000;
    // These scenarios test sync policies and exact results; several clusters
    // share 2 cores, so keep scheduling noise from moving shards. Elastic
    // roles are tested in tests/elastic.rs.
    c.roles.elastic = false;
    c
}

/// Start a cluster, wait for it, and return the reports (in node order).
pub async fn run_cluster(spec: &ClusterSpec) -> anyhow::Result<Vec<NodeReport>> {
    wait_all(Cluster::start(spec).await?).await
}

/// Wait for a started cluster and return the reports (in node order).
pub async fn wait_all(cluster: Cluster) -> anyhow::Result<Vec<NodeReport>> {
    // Bound the whole run: a hung cluster is a failure, not a stuck CI job.
    tokio::time::timeout(std::time::Duration::from_secs(600), cluster.wait())
        .await
        .map_err(|_| anyhow::anyhow!("cluster did not finish within 600 s"))?
}

/// Steps of the elastic-role scenarios ([`elastic_config`]).
pub const ELASTIC_STEPS: u64 = 300;

/// The elastic-role scenarios' config: digits, BSP, fast heartbeats and
/// failure detection, a replica every 4 versions, elastic roles on.
pub fn elastic_config(run: &str) -> NodeConfig {
    let mut c = digits_config(run, ELASTIC_STEPS, SyncPolicy::Bsp, OptimizerKind::Sgd, 0.1);
    c.cluster.heartbeat_ms = 100;
    c.cluster.failure_timeout_ms = 1_500;
    c.roles.replica_every = 4;
    c.roles.elastic = true;
    c
}

/// Four nodes of `base` where node3 computes `slowdown` times slower, run
/// to the end: node3's peer id and every node's report.
pub async fn run_with_slow_node3(base: NodeConfig, slowdown: f64) -> anyhow::Result<(PeerId, Vec<NodeReport>)> {
    let mut spec = ClusterSpec::new(4, base);
    spec.overrides = vec![NodeOverride::default(); 4];
    spec.overrides[3].slowdown = Some(slowdown);
    let cluster = Cluster::start(&spec).await?;
    let slow = cluster.nodes[3].peer_id;
    Ok((slow, wait_all(cluster).await?))
}

/// A node's final /status.
pub fn status(r: &NodeReport) -> anyhow::Result<&StatusSnapshot> {
    r.status.as_ref().ok_or_else(|| anyhow::anyhow!("{} has no status", r.name))
}

/// `||a - b|| / ||b||`.
pub fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((*x - *y) as f64).powi(2)).sum::<f64>().sqrt();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum::<f64>().sqrt();
    num / den.max(f64::MIN_POSITIVE)
}
