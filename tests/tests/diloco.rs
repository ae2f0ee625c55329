//! DiLoCo (`local_steps.steps`): 4 nodes over loopback TCP, each taking
//! local AdamW steps and pushing a pseudo-gradient every H steps to owners
//! that apply Nesterov SGD (lr 0.7, momentum 0.9), with and without int8
//! compression of the pseudo-gradients.

use shoal_models::OptimizerKind;
use shoal_node::cluster::ClusterSpec;
use shoal_node::node::NodeReport;
use shoal_node::policy::compress::{CompressionConfig, PullCompression, PushCompression};
use shoal_node::policy::sync::SyncPolicy;
use shoal_tests::{digits_config, run_cluster};

const STEPS: u64 = 300;
const H: u64 = 20;

async fn diloco(name: &str, push: PushCompression) -> anyhow::Result<Vec<NodeReport>> {
    let mut base = digits_config(name, STEPS, SyncPolicy::Bsp, OptimizerKind::Adamw, 2e-3);
    base.local_steps = Some(shoal_node::config::LocalStepsConfig::every(H));
    base.compression = CompressionConfig { push, pull: PullCompression::None };
    let reports = run_cluster(&ClusterSpec::new(4, base)).await?;
    for r in &reports {
        let s = r.status.as_ref().ok_or_else(|| anyhow::anyhow!("{} has no status", r.name))?;
        eprintln!(
            "{name}: {} accuracy {:.2}%, {} B pushed, {} B pulled, shard versions {:?}",
            r.name,
            100.0 * r.accuracy,
            s.bytes_out,
            s.bytes_in,
            r.shard_stats.iter().map(|s| s.version).collect::<Vec<_>>()
        );
        assert!(r.accuracy >= 0.93, "{name}: {} reached only {:.4}", r.name, r.accuracy);
        // One outer round per H steps: 15 versions, not 300.
        assert!(r.shard_stats.iter().all(|s| s.version == STEPS / H), "{name}: {:?}", r.shard_stats);
    }
    // Every node ends on the owners' model (the last step is a round).
    for r in &reports[1..] {
        assert_eq!(r.params, reports[0].params, "{name}: the workers end on one model");
    }
    Ok(reports)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diloco_with_20_local_steps_trains_to_93_percent_and_pushes_every_20th_step() -> anyhow::Result<()> {
    let plain = diloco("diloco-f32", PushCompression::None).await?;
    let int8 = diloco("diloco-int8", PushCompression::Int8).await?;
    let bytes = |rs: &[NodeReport]| rs.iter().filter_map(|r| r.status.as_ref()).map(|s| s.bytes_out).sum::<u64>();
    // Each node pushes 6 remote shards of f32 per round: 15 rounds, where a
    // gradient every step would push 300.
    let model = plain[0].params.len() as u64 * 4;
    let rounds_bytes = 4 * (STEPS / H) * model * 3 / 4;
    eprintln!(
        "pushed: f32 {} B, int8 {} B; 15 rounds of 3/4 of the model from 4 nodes: {rounds_bytes} B",
        bytes(&plain),
        bytes(&int8)
    );
    assert!(bytes(&plain) <= rounds_bytes * 11 / 10, "f32 pseudo-gradients: {} B", bytes(&plain));
    assert!(bytes(&int8) * 35 <= bytes(&plain) * 10, "int8 pseudo-gradients are about a quarter of f32's");
    Ok(())
}
