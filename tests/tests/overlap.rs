//! Overlap of communication with compute (`sync.overlap`): 4 nodes over
//! loopback TCP under SSP, each computing step t+1 while step t's pushes
//! and pulls are on the wire. The run must train, every step but the last
//! must have overlapped, and the parameters a worker computes on must stay
//! within the policy's bound: the owners enforce one step less (the lead
//! they record), and the pipeline adds exactly one.

use shoal_models::OptimizerKind;
use shoal_node::cluster::ClusterSpec;
use shoal_node::handles::status::StatusSnapshot;
use shoal_node::node::NodeReport;
use shoal_node::policy::sync::SyncPolicy;
use shoal_tests::{digits_config, run_cluster};

/// Steps per worker, under both policies. After 300 steps SSP's nodes
/// ended between 92.8% and 96.4% here (8 runs) and once at 88.9% in CI,
/// and ASP's between 92.8% and 93.3%: owners apply every push at once,
/// from parameters a few versions old, with momentum 0.9 on top of that
/// delay, and the model is still noisy. At 450 steps SSP's ended between
/// 95.8% and 97.5% (18 runs, 6 of them with two busy processes beside it)
/// and ASP's between 96.1% and 97.5% (9 runs): a margin over the bar.
const STEPS: u64 = 450;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapped_ssp_trains_to_93_percent_within_its_staleness_bound() -> anyhow::Result<()> {
    for sync in [SyncPolicy::Ssp { staleness: 2 }, SyncPolicy::Asp] {
        let name = format!("overlap-{}", sync.to_string().replace(':', "-"));
        // Owners under SSP and ASP take one optimizer step per push: a
        // quarter of the BSP rate with 4 workers. At 0.1 (what the
        // non-overlapped policies train with) the extra step of delay made
        // the run diverge (8% accuracy).
        let steps = STEPS;
        let mut base = digits_config(&name, steps, sync, OptimizerKind::Sgd, 0.025);
        base.sync.overlap = true;
        // An emulated 200 Mbit/s, 1 ms link on every node: communication
        // takes time of its own, as off loopback, for the overlap to hide.
        base.faults.link_mbps = 200.0;
        base.faults.link_latency_ms = 1.0;
        let reports = run_cluster(&ClusterSpec::new(4, base)).await?;
        for r in &reports {
            let (s, lead) = figures(r)?;
            eprintln!(
                "{sync} with overlap: {} accuracy {:.2}%, {} of {steps} steps overlapped, largest lead at its owners {lead}, \
                 compute {:.2} s, communication {:.2} s",
                r.name,
                100.0 * r.accuracy,
                s.overlapped_steps,
                s.compute_secs,
                s.comm_secs
            );
        }
        // Every node's figures are printed before any is judged.
        for r in &reports {
            let (s, lead) = figures(r)?;
            assert!(r.accuracy >= 0.93, "{sync}: {} reached only {:.4}", r.name, r.accuracy);
            assert_eq!(s.overlapped_steps, steps - 1, "{}: every step but the last overlaps the next", r.name);
            if let Some(bound) = sync.max_bound() {
                // Owners gate on one step less, and the pipeline adds one:
                // the parameters computed on are lead + 1 <= bound behind.
                assert!(lead < bound, "{sync}: {} recorded a lead of {lead}; the owners allow {}", r.name, bound - 1);
            }
            // Asynchronous owners step once per push: 4 workers x their steps.
            assert!(r.shard_stats.iter().all(|s| s.version == 4 * steps), "{sync}: {:?}", r.shard_stats);
        }
    }
    Ok(())
}

/// A node's status and the largest lead its owners recorded.
fn figures(r: &NodeReport) -> anyhow::Result<(&StatusSnapshot, u64)> {
    let s = r.status.as_ref().ok_or_else(|| anyhow::anyhow!("{} has no status", r.name))?;
    Ok((s, r.shard_stats.iter().map(|s| s.max_staleness).max().unwrap_or(0)))
}
