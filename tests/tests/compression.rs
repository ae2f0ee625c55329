//! Compressed pushes and pulls (`compression`) over real loopback
//! TCP: 4 nodes under BSP on digits, each node with its own encodings.
//! Lossy push encodings carry error feedback (the residual sums are tested
//! in `node::policy::compress`); here the clusters must still reach 93%,
//! and the bytes on the wire must shrink as the encodings promise.
//! Sufficient factors (`sfb`) are lossless: owners rebuild the gradient
//! (the rebuild is tested within 1e-5 in `shoal_models` and
//! `node::policy::compress`).

use shoal_models::OptimizerKind;
use shoal_node::cluster::{ClusterSpec, NodeOverride};
use shoal_node::handles::status::StatusSnapshot;
use shoal_node::node::NodeReport;
use shoal_node::policy::compress::{CompressionConfig, PullCompression, PushCompression};
use shoal_node::policy::sync::SyncPolicy;
use shoal_tests::{digits_config, run_cluster};

const STEPS: u64 = 300;
const TARGET: f32 = 0.93;

fn status(r: &NodeReport) -> anyhow::Result<&StatusSnapshot> {
    r.status.as_ref().ok_or_else(|| anyhow::anyhow!("{} has no status", r.name))
}

/// A 4-node BSP cluster where node `i` uses `per_node[i]`.
async fn cluster(name: &str, per_node: [CompressionConfig; 4]) -> anyhow::Result<Vec<NodeReport>> {
    cluster_at(name, per_node, None).await
}

/// [`cluster`] at a batch size of `batch` per node (default: the tests').
async fn cluster_at(
    name: &str,
    per_node: [CompressionConfig; 4],
    batch: Option<usize>,
) -> anyhow::Result<Vec<NodeReport>> {
    let mut base = digits_config(name, STEPS, SyncPolicy::Bsp, OptimizerKind::Sgd, 0.1);
    if let Some(b) = batch {
        base.training.batch_size = b;
    }
    let mut spec = ClusterSpec::new(4, base);
    spec.overrides = per_node.iter().map(|c| NodeOverride { compression: Some(*c), ..Default::default() }).collect();
    let reports = run_cluster(&spec).await?;
    for (r, c) in reports.iter().zip(&per_node) {
        let s = status(r)?;
        eprintln!(
            "{name}: {} push {} pull {}: accuracy {:.2}%, {} B pushed, {} B pulled, {} B of residuals",
            r.name,
            c.push,
            c.pull,
            100.0 * r.accuracy,
            s.bytes_out,
            s.bytes_in,
            s.residual_bytes
        );
        assert!(r.accuracy >= TARGET, "{name}: {} ({} / {}) reached only {:.4}", r.name, c.push, c.pull, r.accuracy);
        assert_eq!((s.compress_push.as_str(), s.compress_pull.as_str()), (&*c.push.to_string(), &*c.pull.to_string()));
        // Residuals are held exactly when the push encoding is lossy: one
        // f32 per parameter.
        let params = (r.params.len() * 4) as u64;
        assert_eq!(s.residual_bytes, if c.push.is_lossy() { params } else { 0 }, "{}", r.name);
    }
    // 8 shards over 4 equal nodes, fixed: every node pushes and pulls the
    // same 6 remote shards' worth of values each step, so bytes compare.
    assert!(reports.iter().all(|r| r.owned_shards.len() == 2), "2 shards per node");
    Ok(reports)
}

const F32: CompressionConfig = CompressionConfig { push: PushCompression::None, pull: PullCompression::None };

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_cluster_trains_and_each_node_sends_what_its_encoding_promises() -> anyhow::Result<()> {
    let int8_push = CompressionConfig { push: PushCompression::Int8, pull: PullCompression::None };
    let bf16_pull = CompressionConfig { push: PushCompression::None, pull: PullCompression::Bf16 };
    let reports = cluster("compress-mixed", [F32, F32, bf16_pull, int8_push]).await?;
    let (f32_node, bf16_node, int8_node) = (status(&reports[0])?, status(&reports[2])?, status(&reports[3])?);
    // int8 with a scale per 256 values: 1.016 bytes a value against 4.
    let push_ratio = f32_node.bytes_out as f64 / int8_node.bytes_out as f64;
    eprintln!("int8 pushes: {push_ratio:.2}x fewer bytes than f32");
    assert!(push_ratio >= 3.5, "int8 pushes only {push_ratio:.2}x smaller than f32");
    // bf16 pulls: half the bytes of f32 (give or take a retried pull).
    let pull_ratio = f32_node.bytes_in as f64 / bf16_node.bytes_in as f64;
    eprintln!("bf16 pulls: {pull_ratio:.2}x fewer bytes than f32");
    assert!((1.9..=2.1).contains(&pull_ratio), "bf16 pulls {pull_ratio:.2}x smaller than f32");
    // The owners keep f32: the f32 pullers end on the same model, and the
    // bf16 puller's copy is that model rounded to bf16.
    assert_eq!(reports[0].params, reports[1].params, "f32 pullers agree bit for bit");
    for (a, b) in reports[2].params.iter().zip(&reports[0].params) {
        assert!((a - b).abs() <= b.abs() / 256.0 + f32::MIN_POSITIVE, "bf16 copy {a} of {b}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_k_and_bf16_pushes_with_error_feedback_train_to_93_percent() -> anyhow::Result<()> {
    let topk = CompressionConfig { push: PushCompression::TopK { fraction: 0.01 }, pull: PullCompression::None };
    let reports = cluster("compress-topk", [topk; 4]).await?;
    // Indices and values of 1% of the entries: under 1/10 of f32's bytes.
    let pushed: u64 = reports.iter().map(|r| status(r).map(|s| s.bytes_out)).sum::<anyhow::Result<u64>>()?;
    let remote_values = 4 * STEPS * (reports[0].params.len() as u64 * 3 / 4);
    assert!(pushed * 10 < remote_values * 4, "top-k 1% pushed {pushed} B against {} B in f32", remote_values * 4);
    let bf16 = CompressionConfig { push: PushCompression::Bf16, pull: PullCompression::Bf16 };
    cluster("compress-bf16", [bf16; 4]).await?;
    Ok(())
}

/// Sufficient factors at batch 8, where they are smaller than the f32
/// rows of both hidden layers in every shard: two nodes push factors, two
/// f32, and the cluster trains to 93% on the same model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sufficient_factor_pushes_train_to_93_percent_beside_f32_ones_in_fewer_bytes() -> anyhow::Result<()> {
    let sfb = CompressionConfig { push: PushCompression::Sfb, pull: PullCompression::None };
    let reports = cluster_at("compress-sfb", [F32, F32, sfb, sfb], Some(8)).await?;
    let (f32_node, sfb_node) = (status(&reports[0])?, status(&reports[2])?);
    let push_ratio = f32_node.bytes_out as f64 / sfb_node.bytes_out as f64;
    eprintln!("sfb pushes: {push_ratio:.2}x fewer bytes than f32");
    assert!(push_ratio >= 2.0, "sfb pushes only {push_ratio:.2}x smaller than f32");
    // Every node pulls f32 from the same owners: one model.
    assert!(reports.iter().all(|r| r.params == reports[0].params), "the nodes end on one model");
    Ok(())
}
