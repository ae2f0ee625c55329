//! What a soak asserts about a finished testnet: the `[checks]` table of a
//! scenario, judged from the run's [`Summary`] (and, for accuracy, the
//! summary of the same scenario run again without its faults).
//!
//! ```toml
//! [checks]
//! warmup_secs = 60             # memory before this, in each process's life, is warm-up
//! max_rss_growth = 0.10        # each node process's RSS after warm-up grows at most 10%
//! no_forced_rounds = true      # no BSP round is closed by its timeout
//! accuracy_within_points = 0.5 # survivors' mean accuracy within 0.5 points of a fault-free run
//! max_accuracy_drop_points = 0.5 # or: at most 0.5 points below it (any amount above)
//! min_accuracy = 0.9           # every survivor's final test accuracy is at least 90%
//! max_node_peak_rss_mib = 200  # every node process's peak resident memory (VmHWM)
//! kill_grace_secs = 30         # rounds forced within 30 s after a kill are counted, not failed
//! views_agree_within_secs = 60 # after each kill, restart, add or leave, every live node's
//!                              # placement holds the same members, every live node,
//!                              # within 60 s (changes that overlap settle together)
//!
//! [[node]]
//! index = 3
//! max_peak_rss_mib = 64        # node3's peak resident memory (VmHWM), in every life
//! ```
//!
//! Pure: no processes, no clock. The launcher runs the scenarios and calls
//! [`judge`].

use std::collections::BTreeMap;

use crate::report::{ResourceSample, Sample, Summary};
// The table a scenario sets and the verdict the report carries: at home in
// their file formats, and kept here under their old paths.
pub use crate::report::{CheckReport, RssGrowth};
pub use crate::scenario::Checks;
use crate::scenario::{Action, Scenario};

/// Mean final accuracy of the nodes that trained to the end, and their names.
pub fn survivors_accuracy(s: &Summary) -> (Option<f64>, Vec<String>) {
    let done: Vec<(&str, f64)> = s
        .nodes
        .iter()
        .filter(|n| n.exit == "exited" && !n.left)
        .filter_map(|n| Some((n.name.as_str(), n.final_accuracy?)))
        .collect();
    let mean = (!done.is_empty()).then(|| done.iter().map(|d| d.1).sum::<f64>() / done.len() as f64);
    (mean, done.iter().map(|d| d.0.to_string()).collect())
}

/// A `start_all` that did not bring the run back from its checkpoints: a
/// node that trained to the end after it but never reported resuming.
/// (On a fast build a run can end before its `stop_all`, and the restarted
/// nodes then have nothing to resume; that is a missed fault, not a pass.)
pub fn missed_resumes(scenario: &Scenario, s: &Summary) -> Vec<String> {
    let Some(start) = scenario.events.iter().find(|e| e.action == Action::StartAll) else { return Vec::new() };
    s.nodes
        .iter()
        .filter(|n| n.exit == "exited" && !n.left && n.resumed_at_step.is_none())
        .map(|n| format!("start all (line {}): {} finished without resuming from its checkpoints", start.line, n.name))
        .collect()
}

/// RSS growth of each node process after `warmup_secs` of its life.
pub fn rss_growth(resources: &[ResourceSample], warmup_secs: f64) -> (Vec<RssGrowth>, Vec<String>) {
    let mut lives: BTreeMap<(&str, u32), Vec<&ResourceSample>> = BTreeMap::new();
    for r in resources {
        lives.entry((r.node.as_str(), r.pid)).or_default().push(r);
    }
    let (mut judged, mut short) = (Vec::new(), Vec::new());
    for ((node, pid), mut life) in lives {
        life.sort_by(|a, b| a.secs.total_cmp(&b.secs));
        let born = life[0].secs;
        let after: Vec<&&ResourceSample> = life.iter().filter(|r| r.secs - born >= warmup_secs).collect();
        let (first, last) = match after.as_slice() {
            [first, .., last] if first.rss_bytes > 0 => (first, last),
            _ => {
                short.push(format!("{node} (pid {pid})"));
                continue;
            }
        };
        let peak = after.iter().map(|r| r.rss_bytes).max().unwrap_or(first.rss_bytes);
        judged.push(RssGrowth {
            node: node.to_string(),
            pid,
            from_secs: first.secs,
            to_secs: last.secs,
            baseline_bytes: first.rss_bytes,
            peak_bytes: peak,
            growth: peak as f64 / first.rss_bytes as f64 - 1.0,
        });
    }
    (judged, short)
}

/// Seconds after a partition heals in which forced rounds are excused, as
/// they are during the partition. After a heal, workers can be a round
/// apart on different shards and wait on each other in a cycle that only
/// the round timeout breaks (`ShardCore::close_overdue_round`). During a
/// partition, each side restores the other side's shards from older copies
/// and the same can happen: a worker whose push reached the lost owner
/// (which applied the round) without an answer pushes again into the
/// restored round, which then waits for a worker that already pulled the
/// lost owner's result and is itself waiting for the first one's next
/// push on another shard (a 4-node soak, 2026-12-06). Both are known
/// limits of restoring from older copies, as a kill's are (`kill_grace_secs`).
pub const HEAL_GRACE_SECS: f64 = 30.0;

/// Each node's forced rounds as (seconds, count) from its `/status`
/// samples: the counter's increases, and its value after a restart.
fn forced_rounds(samples: &[Sample]) -> Vec<(String, f64, u64)> {
    let mut last: BTreeMap<&str, u64> = BTreeMap::new();
    let mut out = Vec::new();
    let mut sorted: Vec<&Sample> = samples.iter().collect();
    sorted.sort_by(|a, b| a.secs.total_cmp(&b.secs));
    for s in sorted {
        let before = last.insert(s.node.as_str(), s.rounds_forced).unwrap_or(0);
        let new = if s.rounds_forced >= before { s.rounds_forced - before } else { s.rounds_forced };
        if new > 0 {
            out.push((s.node.clone(), s.secs, new));
        }
    }
    out
}

/// Judge `run` against `checks`; `fault_free` is the same scenario run
/// without its events (needed by `accuracy_within_points`). Rounds forced
/// during a partition or within [`HEAL_GRACE_SECS`] after it heals are
/// counted but not failed.
pub fn judge(checks: &Checks, run: &Summary, fault_free: Option<&Summary>) -> CheckReport {
    let mut r = CheckReport::default();
    let (rss, short) = rss_growth(&run.resources, checks.warmup_secs);
    r.rss = rss;
    r.rss_not_judged = short;
    let heals: Vec<f64> = run.faults.iter().filter(|f| f.action.starts_with("heal")).map(|f| f.secs).collect();
    // Each partition's window runs from its start to its heal (each side
    // restores the other's shards from older copies meanwhile), and each
    // heal's from the heal; both then for the grace.
    let partitions = run
        .faults
        .iter()
        .filter(|f| f.action.starts_with("partition"))
        .map(|f| (f.secs, heals.iter().copied().filter(|h| *h >= f.secs).fold(f64::INFINITY, f64::min)));
    let windows: Vec<(f64, f64)> = partitions.chain(heals.iter().map(|h| (*h, *h))).collect();
    let partitioned =
        |secs: f64| windows.iter().any(|(from, healed)| secs >= *from && secs <= healed + HEAL_GRACE_SECS);
    let kills: Vec<f64> = run.faults.iter().filter(|f| f.failure).map(|f| f.secs).collect();
    let within = |times: &[f64], secs: f64, grace: f64| times.iter().any(|t| secs >= *t && secs <= t + grace);
    let mut unexcused: Vec<(String, f64, u64)> = Vec::new();
    for s in &run.samples {
        r.rounds_forced.entry(s.node.clone()).or_insert(0);
    }
    for (node, secs, n) in forced_rounds(&run.samples) {
        *r.rounds_forced.entry(node.clone()).or_insert(0) += n;
        if partitioned(secs) {
            r.rounds_forced_after_heal += n;
        } else if within(&kills, secs, checks.kill_grace_secs) {
            r.rounds_forced_after_kill += n;
        } else {
            unexcused.push((node, secs, n));
        }
    }
    (r.survivors_accuracy, r.survivors) = survivors_accuracy(run);
    r.fault_free_accuracy = fault_free.and_then(|f| survivors_accuracy(f).0);

    memory_failures(checks, run, &mut r);
    if checks.no_forced_rounds {
        for (node, secs, n) in &unexcused {
            r.failures.push(format!(
                "rounds: {node} closed {n} BSP round(s) at the round timeout (seen at {secs:.0} s, not during a \
                 partition or within {HEAL_GRACE_SECS} s after it healed{})",
                if checks.kill_grace_secs > 0.0 {
                    format!(" or {} s after a kill", checks.kill_grace_secs)
                } else {
                    String::new()
                }
            ));
        }
    }
    if checks.needs_fault_free_run() {
        accuracy_failures(checks, &mut r);
    }
    survivor_failures(checks, run, &mut r);
    view_failures(checks, run, &mut r);
    r
}

/// `min_accuracy`: every node that trained to the end reached it.
fn survivor_failures(checks: &Checks, run: &Summary, r: &mut CheckReport) {
    let Some(min) = checks.min_accuracy else { return };
    let survivors: Vec<_> = run.nodes.iter().filter(|n| n.exit == "exited" && !n.left).collect();
    if survivors.is_empty() {
        r.failures.push("accuracy: no node trained to the end".into());
    }
    for n in survivors {
        match n.final_accuracy {
            Some(a) if a >= min => {}
            Some(a) => r.failures.push(format!(
                "accuracy: {} ended at {:.2}% (every survivor must reach {:.2}%)",
                n.name,
                a * 100.0,
                min * 100.0
            )),
            None => r.failures.push(format!("accuracy: {} trained to the end but reported no accuracy", n.name)),
        }
    }
}

/// `views_agree_within_secs`: after each change of membership the views
/// agreed, soon enough and before the next change.
fn view_failures(checks: &Checks, run: &Summary, r: &mut CheckReport) {
    let Some(limit) = checks.views_agree_within_secs else { return };
    for v in &run.view_agreement {
        match v.agreed_after_secs {
            Some(t) if t <= limit => {}
            Some(t) => r.failures.push(format!(
                "views: after `{}` at {:.0} s the views agreed on the members only {t:.1} s later (limit {limit} s)",
                v.action, v.at_secs
            )),
            None => r.failures.push(format!(
                "views: after `{}` at {:.0} s the views never agreed on the members again before the end",
                v.action, v.at_secs
            )),
        }
    }
}

/// The memory checks: growth after warm-up and peak resident memory.
fn memory_failures(checks: &Checks, run: &Summary, r: &mut CheckReport) {
    if let Some(max) = checks.max_rss_growth {
        if r.rss.is_empty() {
            r.failures.push(
                "memory: no node process has two samples after warm-up (the RSS check needs the process \
                 backend and a run longer than warmup_secs + 20 s)"
                    .into(),
            );
        }
        for g in r.rss.iter().filter(|g| g.growth > max) {
            r.failures.push(format!(
                "memory: {} (pid {}) grew {:.1}% after warm-up, from {:.1} MiB at {:.0} s to a peak of {:.1} MiB \
                 (limit {:.1}%)",
                g.node,
                g.pid,
                g.growth * 100.0,
                mib(g.baseline_bytes),
                g.from_secs,
                mib(g.peak_bytes),
                max * 100.0
            ));
        }
    }
    if let Some(max) = checks.max_node_peak_rss {
        if run.peak_rss.is_empty() {
            r.failures
                .push("memory: no node has a resource sample (max_node_peak_rss_mib needs the process backend)".into());
        }
        for (node, &p) in run.peak_rss.iter().filter(|(_, &p)| p > max) {
            r.failures.push(format!(
                "memory: {node} peaked at {:.1} MiB resident (limit for every node {:.1} MiB)",
                mib(p),
                mib(max)
            ));
        }
    }
    for (node, &max) in &checks.max_peak_rss {
        let peak = run.resources.iter().filter(|s| &s.node == node).map(|s| s.peak_rss_bytes).max();
        match peak {
            None => r.failures.push(format!(
                "memory: {node} has no resource sample, so its peak cannot be judged (the check needs the \
                 process backend)"
            )),
            Some(p) => {
                r.peak_rss.insert(node.clone(), p);
                if p > max {
                    r.failures.push(format!(
                        "memory: {node} peaked at {:.1} MiB resident (limit {:.1} MiB)",
                        mib(p),
                        mib(max)
                    ));
                }
            }
        }
    }
}

/// The accuracy checks: the survivors' mean against the fault-free run's.
fn accuracy_failures(checks: &Checks, r: &mut CheckReport) {
    match (r.survivors_accuracy, r.fault_free_accuracy) {
        (Some(a), Some(b)) => {
            let diff = (a - b) * 100.0;
            let limits = [
                checks.accuracy_within_points.filter(|p| diff.abs() > *p).map(|p| format!("±{p}")),
                checks.max_accuracy_drop_points.filter(|p| diff < -*p).map(|p| format!("at most {p} below")),
            ];
            for limit in limits.into_iter().flatten() {
                r.failures.push(format!(
                    "accuracy: the survivors reached {:.2}%, the fault-free run {:.2}%: {diff:+.2} points \
                     (limit {limit})",
                    a * 100.0,
                    b * 100.0
                ));
            }
        }
        (None, _) => r.failures.push("accuracy: no node trained to the end".into()),
        (_, None) => r.failures.push("accuracy: the fault-free run has no node that trained to the end".into()),
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// The report in a few lines, for the terminal.
pub fn describe(r: &CheckReport, run: &Summary) -> String {
    let mut out = String::new();
    if let Some(worst) = r.rss.iter().max_by(|a, b| a.growth.total_cmp(&b.growth)) {
        out += &format!(
            "memory after warm-up: {} node processes, largest growth {:+.1}% ({} pid {}: {:.1} -> {:.1} MiB)\n",
            r.rss.len(),
            worst.growth * 100.0,
            worst.node,
            worst.pid,
            mib(worst.baseline_bytes),
            mib(worst.peak_bytes)
        );
    }
    for (node, peak) in &r.peak_rss {
        out += &format!("peak resident memory of {node}: {:.1} MiB\n", mib(*peak));
    }
    if let Some((node, peak)) = run.peak_rss.iter().max_by_key(|(_, &p)| p) {
        let mut peaks: Vec<u64> = run.peak_rss.values().copied().collect();
        peaks.sort_unstable();
        out += &format!(
            "peak resident memory of {} node processes: median {:.1} MiB, largest {:.1} MiB ({node})\n",
            peaks.len(),
            mib(peaks[peaks.len() / 2]),
            mib(*peak)
        );
    }
    let agreed: Vec<f64> = run.view_agreement.iter().filter_map(|v| v.agreed_after_secs).collect();
    if !run.view_agreement.is_empty() {
        out += &format!(
            "views agreed after {} of {} changes of membership, the slowest in {} s\n",
            agreed.len(),
            run.view_agreement.len(),
            agreed
                .iter()
                .copied()
                .fold(None, |m: Option<f64>, t| Some(m.map_or(t, |m| m.max(t))))
                .map_or("-".into(), |t| format!("{t:.1}"))
        );
    }
    out += &format!(
        "rounds closed at the timeout: {} ({} of them during a partition or within {HEAL_GRACE_SECS} s after it healed, {} \
         within the grace after a kill)\n",
        r.rounds_forced.values().sum::<u64>(),
        r.rounds_forced_after_heal,
        r.rounds_forced_after_kill
    );
    if let Some(a) = r.survivors_accuracy {
        out += &format!("survivors' mean accuracy: {:.2}% ({})", a * 100.0, r.survivors.join(", "));
        if let Some(b) = r.fault_free_accuracy {
            out += &format!(", fault-free run: {:.2}% ({:+.2} points)", b * 100.0, (a - b) * 100.0);
        }
        out += "\n";
    }
    if r.passed() {
        out += "checks: passed\n";
    } else {
        for f in &r.failures {
            out += &format!("check failed: {f}\n");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::NodeOutcome;

    fn res(secs: f64, node: &str, pid: u32, mib: u64) -> ResourceSample {
        ResourceSample { secs, node: node.into(), pid, rss_bytes: mib << 20, peak_rss_bytes: mib << 20, open_fds: 20 }
    }

    #[test]
    fn a_node_over_its_peak_memory_limit_fails_and_one_without_samples_cannot_pass() {
        let checks = Checks {
            max_peak_rss: [("node3".to_string(), 64 << 20), ("node9".to_string(), 64 << 20)].into(),
            ..Checks::default()
        };
        assert!(!checks.is_empty());
        // node3 peaks at 70 MiB in its first life, though it holds 50 MiB later.
        let mut r = res(5.0, "node3", 10, 50);
        r.peak_rss_bytes = 70 << 20;
        let run = summary(vec![], vec![res(1.0, "node3", 10, 40), r, res(9.0, "node0", 11, 500)], &[]);
        let report = judge(&checks, &run, None);
        assert_eq!(report.peak_rss.get("node3"), Some(&(70 << 20)));
        assert_eq!(report.failures.len(), 2, "{:?}", report.failures);
        assert!(report.failures[0].contains("node3 peaked at 70.0 MiB"), "{:?}", report.failures);
        assert!(report.failures[1].contains("node9 has no resource sample"), "{:?}", report.failures);
        // Under the limit: passes; node0's 500 MiB has no limit.
        let checks = Checks { max_peak_rss: [("node3".to_string(), 80 << 20)].into(), ..Checks::default() };
        assert!(judge(&checks, &run, None).passed());
    }

    fn outcome(name: &str, exit: &str, acc: Option<f64>, left: bool) -> NodeOutcome {
        NodeOutcome {
            name: name.into(),
            peer_id: String::new(),
            exit: exit.into(),
            killed: exit == "killed",
            final_accuracy: acc,
            final_bits_per_byte: None,
            steps: acc.map(|_| 100),
            left,
            resumed_at_step: None,
            model: None,
            arch: "x86_64".into(),
            profile: None,
            bytes_out: None,
            bytes_in: None,
            utilization: None,
            link_mbps: None,
        }
    }

    fn summary(nodes: Vec<NodeOutcome>, resources: Vec<ResourceSample>, forced: &[(&str, u64)]) -> Summary {
        let samples = forced
            .iter()
            .map(|(n, f)| Sample {
                secs: 1.0,
                node: n.to_string(),
                step: 1,
                loss: None,
                accuracy: None,
                samples_per_sec: 0.0,
                rounds_forced: *f,
                role: "worker".into(),
                members: None,
                live: 0,
            })
            .collect();
        Summary {
            scenario: "s".into(),
            run_id: "r".into(),
            timed_out: false,
            duration_secs: 100.0,
            training_started_secs: Some(1.0),
            nodes,
            role_changes: vec![],
            faults: vec![],
            samples,
            resources,
            peak_rss: BTreeMap::new(),
            view_agreement: vec![],
            checks: None,
        }
    }

    #[test]
    fn a_start_all_whose_nodes_did_not_resume_is_a_missed_fault() -> Result<(), crate::scenario::ScenarioError> {
        let text = "nodes = 3\n[node_config.checkpoint]\nevery_steps = 20\n[[event]]\nat_step = 300\naction = \
                    \"stop_all\"\n[[event]]\nat_secs = 1\naction = \"start_all\"\n";
        let scenario = Scenario::parse(text, "s.toml", "s")?;
        let resumed = |mut o: NodeOutcome| {
            o.resumed_at_step = Some(275);
            o
        };
        let run = summary(
            vec![
                resumed(outcome("node0", "exited", Some(0.95), false)),
                outcome("node1", "exited", Some(0.95), false),
                outcome("node2", "exited", Some(0.95), true),
            ],
            vec![],
            &[],
        );
        let missed = missed_resumes(&scenario, &run);
        assert_eq!(missed, vec!["start all (line 7): node1 finished without resuming from its checkpoints"]);
        // No start_all: nothing to resume, nothing missed.
        let plain = Scenario::parse("nodes = 3\n", "s.toml", "s")?;
        assert!(missed_resumes(&plain, &run).is_empty());
        Ok(())
    }

    #[test]
    fn memory_is_judged_per_process_life_after_warm_up() {
        let resources = vec![
            // node0: 100 MiB during warm-up, then 40 -> 43 MiB: +7.5%.
            res(0.0, "node0", 10, 100),
            res(10.0, "node0", 10, 40),
            res(20.0, "node0", 10, 43),
            res(30.0, "node0", 10, 41),
            // node1's first life grows 50%, its second (a restart) is flat.
            res(0.0, "node1", 11, 30),
            res(10.0, "node1", 11, 30),
            res(20.0, "node1", 11, 45),
            res(40.0, "node1", 21, 90),
            res(50.0, "node1", 21, 30),
            res(60.0, "node1", 21, 30),
            // node2 died before two samples after warm-up.
            res(0.0, "node2", 12, 30),
            res(10.0, "node2", 12, 30),
        ];
        let (judged, short) = rss_growth(&resources, 10.0);
        assert_eq!(short, vec!["node2 (pid 12)".to_string()]);
        let growth: Vec<(&str, u32, i64)> =
            judged.iter().map(|g| (g.node.as_str(), g.pid, (g.growth * 1000.0).round() as i64)).collect();
        assert_eq!(growth, vec![("node0", 10, 75), ("node1", 11, 500), ("node1", 21, 0)]);

        let checks = Checks { warmup_secs: 10.0, max_rss_growth: Some(0.10), ..Checks::default() };
        let r = judge(&checks, &summary(vec![], resources, &[]), None);
        assert_eq!(r.failures.len(), 1, "{:?}", r.failures);
        assert!(r.failures[0].starts_with("memory: node1 (pid 11) grew 50.0%"), "{}", r.failures[0]);
    }

    #[test]
    fn a_forced_round_and_an_accuracy_gap_fail_the_run() {
        let checks = Checks { no_forced_rounds: true, accuracy_within_points: Some(0.5), ..Checks::default() };
        let run = summary(
            vec![
                outcome("node0", "exited", Some(0.880), false),
                outcome("node1", "exited", Some(0.870), false),
                outcome("node2", "killed", None, false),
                outcome("node3", "exited", Some(0.20), true),
            ],
            vec![],
            &[("node0", 0), ("node1", 2)],
        );
        let base = summary(vec![outcome("node0", "exited", Some(0.884), false)], vec![], &[]);
        let r = judge(&checks, &run, Some(&base));
        assert_eq!(r.rounds_forced_after_heal, 0);
        assert_eq!(r.survivors, vec!["node0".to_string(), "node1".to_string()], "killed and left nodes are out");
        assert!((r.survivors_accuracy.unwrap_or(0.0) - 0.875).abs() < 1e-9);
        assert_eq!(r.rounds_forced.get("node1"), Some(&2));
        assert_eq!(r.failures.len(), 2, "{:?}", r.failures);
        assert!(r.failures[0].contains("node1 closed 2 BSP round(s)"), "{}", r.failures[0]);
        assert!(r.failures[1].contains("-0.90 points"), "{}", r.failures[1]);

        let close = summary(vec![outcome("node0", "exited", Some(0.880), false)], vec![], &[]);
        let ok = judge(&checks, &close, Some(&base));
        assert!(ok.passed(), "{:?}", ok.failures);
        // Asked for, but nothing to compare with: a failure, not a pass.
        let none = judge(&checks, &close, None);
        assert!(!none.passed());
        let memory = Checks { max_rss_growth: Some(0.1), ..Checks::default() };
        assert!(!judge(&memory, &close, None).passed(), "no memory samples: the check cannot pass");

        // One-sided: any gain passes, a drop past the limit fails.
        let drop = Checks { max_accuracy_drop_points: Some(0.5), ..Checks::default() };
        assert!(drop.needs_fault_free_run() && !drop.is_empty());
        let above = summary(vec![outcome("node0", "exited", Some(0.900), false)], vec![], &[]);
        assert!(judge(&drop, &above, Some(&base)).passed(), "+1.6 points is no drop");
        assert!(!judge(&checks, &above, Some(&base)).passed(), "but it is outside ±0.5");
        let r = judge(&drop, &run, Some(&base));
        assert_eq!(r.failures.len(), 1, "{:?}", r.failures);
        assert!(r.failures[0].contains("-0.90 points (limit at most 0.5 below)"), "{}", r.failures[0]);
        assert!(!judge(&drop, &close, None).passed(), "no fault-free run to compare with");

        // Rounds forced just after a heal are counted and excused; the same
        // rounds long after it are not.
        let rounds = Checks { no_forced_rounds: true, ..Checks::default() };
        let heal = |secs: f64| crate::report::FaultRecord {
            secs,
            at_secs: secs,
            at_step: None,
            line: 0,
            action: "heal [[0, 1], [2, 3]]".into(),
            outcome: "healed".into(),
            membership: false,
            failure: false,
            steps_per_sec_before: None,
            steps_per_sec_after: None,
        };
        let mut healed = summary(vec![], vec![], &[("node1", 0), ("node1", 2)]);
        healed.samples[0].secs = 0.5;
        healed.faults = vec![heal(0.2)];
        let r = judge(&rounds, &healed, None);
        assert!(r.passed(), "{:?}", r.failures);
        assert_eq!((r.rounds_forced.get("node1"), r.rounds_forced_after_heal), (Some(&2), 2));
        healed.faults = vec![heal(-100.0)];
        assert!(!judge(&rounds, &healed, None).passed());
        // During a partition (before its heal) as well; a partition long
        // healed excuses nothing.
        let mut partition = heal(0.1);
        partition.action = "partition [[0, 1], [2, 3]] for 300 s".into();
        healed.faults = vec![partition.clone(), heal(300.0)];
        let r = judge(&rounds, &healed, None);
        assert!(r.passed(), "{:?}", r.failures);
        assert_eq!(r.rounds_forced_after_heal, 2);
        (partition.secs, partition.at_secs) = (-200.0, -200.0);
        healed.faults = vec![partition, heal(-100.0)];
        assert!(!judge(&rounds, &healed, None).passed());
        // Within kill_grace_secs of a kill: counted and excused; without the grace: failed.
        let mut kill = heal(0.2);
        (kill.action, kill.membership, kill.failure) = ("kill node3".into(), true, true);
        healed.faults = vec![kill];
        assert!(!judge(&rounds, &healed, None).passed());
        let graced = Checks { kill_grace_secs: 30.0, ..rounds };
        let r = judge(&graced, &healed, None);
        assert!(r.passed(), "{:?}", r.failures);
        assert_eq!((r.rounds_forced_after_kill, r.rounds_forced_after_heal), (2, 0));
    }

    /// The swarm's checks: every survivor's accuracy, every node's peak
    /// memory, and the views' agreement after each change of membership.
    #[test]
    fn every_survivor_every_node_and_every_change_is_judged() {
        let nodes = vec![
            outcome("node0", "exited", Some(0.95), false),
            outcome("node1", "exited", Some(0.85), false),
            outcome("node2", "killed", None, false),
            outcome("node3", "exited", None, true),
        ];
        let mut run = summary(nodes, vec![], &[]);
        run.peak_rss = [("node0".to_string(), 40 << 20), ("node64".to_string(), 90 << 20)].into();
        let agreement = |after: Option<f64>| crate::report::ViewAgreement {
            action: "add a node".into(),
            secs: 10.0,
            at_secs: 5.0,
            agreed_after_secs: after,
            live: after.map(|_| 3),
        };
        run.view_agreement = vec![agreement(Some(20.0)), agreement(Some(61.0)), agreement(None)];
        let checks = Checks {
            min_accuracy: Some(0.9),
            max_node_peak_rss: Some(64 << 20),
            views_agree_within_secs: Some(60.0),
            ..Checks::default()
        };
        assert!(!checks.is_empty());
        let r = judge(&checks, &run, None);
        let f = r.failures.join("\n");
        assert_eq!(r.failures.len(), 4, "{f}");
        assert!(f.contains("node1 ended at 85.00% (every survivor must reach 90.00%)"), "{f}");
        assert!(f.contains("node64 peaked at 90.0 MiB"), "{f}");
        assert!(f.contains("agreed on the members only 61.0 s later (limit 60 s)"), "{f}");
        assert!(f.contains("never agreed on the members again"), "{f}");
        assert!(!f.contains("node0") && !f.contains("node2") && !f.contains("node3"), "{f}");
        // Within every limit: passes, and the terminal summary gives the figures.
        run.nodes[1].final_accuracy = Some(0.91);
        run.peak_rss.remove("node64");
        run.view_agreement.truncate(1);
        let r = judge(&checks, &run, None);
        assert!(r.passed(), "{:?}", r.failures);
        let d = describe(&r, &run);
        assert!(d.contains("peak resident memory of 1 node processes: median 40.0 MiB"), "{d}");
        assert!(d.contains("views agreed after 1 of 1 changes of membership, the slowest in 20.0 s"), "{d}");
    }
}
