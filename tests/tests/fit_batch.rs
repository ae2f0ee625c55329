//! A worker computing 8x slower fits its batch to the BSP rounds
//! (`sync.fit_batch`) over real loopback TCP, while the workers at the
//! cluster's pace keep their full batch and take on the samples it sheds
//! (`sync.fit_rebalance`, the default).
//!
//! Alone in its own test binary: beside the elastic tests (8 clusters on 2
//! cores at once) a healthy worker was starved for most of 9 steps in a
//! row and, measured 2x slower than its peers, fitted its batch (CI: 1 to
//! 5 steps of 300). Test binaries run one after another.
//!
//! 8x, not 4x: the slowdown stretches the trainer's CPU time, and at 4x
//! node3 slept so much less than under the old wall-time stretch that the
//! healthy workers were starved more, and one of them fitted its batch in
//! 2 of about 17 runs alone (7 steps of 300); 14 of 14 passed at 8x.

use shoal_tests::{elastic_config, run_with_slow_node3, status, ELASTIC_STEPS as STEPS};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_8x_slower_worker_fits_its_batch_to_the_bsp_rounds_and_accuracy_reaches_93_percent() -> anyhow::Result<()> {
    // node3 computes 8x slower; with sync.fit_batch it trains on a
    // smaller batch instead of holding every BSP round back.
    let mut base = elastic_config("fit-batch");
    base.sync.fit_batch = true;
    let batch = base.training.batch_size as u64;
    let (slow, reports) = run_with_slow_node3(base, 8.0).await?;
    for r in &reports {
        let s = status(r)?;
        eprintln!(
            "{}: accuracy {:.2}%, {} samples in {} steps, {} steps fitted ({} samples, {} shed), {} grown (+{} samples), \
             compute {:.2} s, comm {:.2} s, owns {:?}, role changes {:?}",
            r.name,
            r.accuracy * 100.0,
            s.samples,
            s.step,
            s.fitted_steps,
            s.fitted_samples,
            s.shed_samples,
            s.grown_steps,
            s.grown_samples,
            s.compute_secs,
            s.comm_secs,
            r.owned_shards,
            s.role_changes.iter().map(|c| (c.step, c.owned.clone())).collect::<Vec<_>>(),
        );
    }
    let s = status(reports.iter().find(|r| r.peer_id == slow).ok_or_else(|| anyhow::anyhow!("no node3"))?)?;
    for r in &reports {
        let own = status(r)?;
        assert!(r.accuracy >= 0.93, "{}: accuracy {:.4} below 93%", r.name, r.accuracy);
        assert_eq!(own.step, STEPS, "{}", r.name);
        if r.peer_id != slow {
            // A worker at the cluster's pace fits its batch at most a
            // twentieth as often as the slow one: a hiccup of the host may
            // make a round or two look late (one run here fitted 3 steps of
            // 300 against node3's 292), a policy that fits the wrong worker
            // would do it all the time.
            assert!(
                own.fitted_steps * 20 <= s.fitted_steps,
                "{}: a worker at the cluster's pace shrank its batch {} times (node3: {})",
                r.name,
                own.fitted_steps,
                s.fitted_steps
            );
        } else {
            assert_eq!(own.grown_steps, 0, "node3 grew its batch");
        }
    }
    // Most of its steps ran on a fitted batch, on average at most half the
    // full one (an eighth if compute were all that a step costs).
    assert!(s.fitted_steps * 2 >= STEPS, "node3 fitted only {} of {STEPS} steps", s.fitted_steps);
    assert!(s.samples * 2 <= STEPS * batch, "node3 trained {} samples of {}", s.samples, STEPS * batch);
    // The others took on what node3 shed: the rounds held about the
    // configured global batch. They learn node3's share from its
    // heartbeats (every 100 ms), so they lag it by a few steps at the start
    // and the end.
    let shed = s.shed_samples;
    let grown: u64 =
        reports.iter().filter(|r| r.peer_id != slow).filter_map(|r| r.status.as_ref()).map(|s| s.grown_samples).sum();
    assert!(
        grown * 10 >= shed * 7 && grown * 10 <= shed * 13,
        "the other workers took on {grown} samples of the {shed} node3 shed"
    );
    Ok(())
}
