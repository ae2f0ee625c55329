//! Shared by the testnet tests: run `shoal testnet run` and check its report.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Run a scenario (`extra` flags before it) to the end; returns the report
/// directory and its `summary.json`. The scenario's own time limit bounds
/// the run: the launcher kills every node and fails when it is reached.
pub fn run_testnet(extra: &[&str], scenario: &Path) -> anyhow::Result<(tempfile::TempDir, Value)> {
    let report = tempfile::tempdir()?;
    let out = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(["testnet", "run", "--no-live"])
        .args(extra)
        .arg("--report")
        .arg(report.path())
        .arg(scenario)
        .output()?;
    eprintln!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        // What the nodes warned of goes into the test's output (CI keeps
        // that, not the report), and the report stays on disk.
        print_warnings(report.path());
        let kept = report.keep();
        anyhow::bail!("shoal testnet run failed: {}; its report is kept in {}", out.status, kept.display());
    }
    let summary = serde_json::from_slice(&std::fs::read(report.path().join("summary.json"))?)?;
    Ok((report, summary))
}

/// The last warnings and errors of every node's log in a report (and of a
/// second run's, such as the fault-free twin's), for a failed run.
fn print_warnings(report: &Path) {
    let mut logs: Vec<PathBuf> = ["logs", "fault-free/logs"]
        .iter()
        .filter_map(|d| std::fs::read_dir(report.join(d)).ok())
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .collect();
    logs.sort();
    for log in logs {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().filter(|l| l.contains(" WARN ") || l.contains(" ERROR ")).collect();
        eprintln!("--- {} ({} warnings and errors; the last 40):", log.display(), lines.len());
        for l in &lines[lines.len().saturating_sub(40)..] {
            eprintln!("{l}");
        }
    }
}

/// Every node but `killed` exited cleanly after `steps` steps at 93% or more;
/// `killed` was killed.
pub fn assert_survivors(summary: &Value, nodes: usize, killed: Option<&str>, steps: u64) {
    let all = summary["nodes"].as_array().cloned().unwrap_or_default();
    assert_eq!(all.len(), nodes, "{all:?}");
    for n in &all {
        let name = n["name"].as_str().unwrap_or("?");
        if Some(name) == killed {
            assert_eq!(n["exit"], "killed", "{name}: {n}");
            continue;
        }
        assert_eq!(n["exit"], "exited", "{name}: {n}");
        assert_eq!(n["steps"], steps, "{name} trained to the end");
        let acc = n["final_accuracy"].as_f64().unwrap_or(0.0);
        assert!(acc >= 0.93, "{name}: accuracy {acc} below 93%");
    }
}

/// The time and outcome of the first fault whose action starts with `prefix`;
/// the fault must have been applied (its outcome is not `failed: ...`).
pub fn fault(summary: &Value, prefix: &str) -> (f64, String) {
    let faults = summary["faults"].as_array().cloned().unwrap_or_default();
    let f = faults
        .iter()
        .find(|f| f["action"].as_str().is_some_and(|a| a.starts_with(prefix)))
        .unwrap_or_else(|| panic!("no `{prefix}` fault in {faults:?}"));
    let outcome = f["outcome"].as_str().unwrap_or("").to_string();
    assert!(!outcome.starts_with("failed"), "`{prefix}` was not applied: {outcome}");
    (f["secs"].as_f64().unwrap_or(-1.0), outcome)
}

/// `node` owned shards before `from` and owned none, as a worker, between
/// `from` and `to`.
pub fn assert_demoted(summary: &Value, node: &str, from: f64, to: f64) {
    let roles = summary["role_changes"].as_array().cloned().unwrap_or_default();
    let mine: Vec<&Value> = roles.iter().filter(|r| r["node"] == node).collect();
    let at = |r: &Value| r["secs"].as_f64().unwrap_or(f64::NAN);
    assert!(
        mine.iter().any(|r| r["role"] == "aggregator" && at(r) < from),
        "{node} never owned shards before {from} s: {mine:?}"
    );
    assert!(
        mine.iter().any(|r| {
            r["role"] == "worker" && r["owned"].as_array().is_some_and(Vec::is_empty) && at(r) >= from && at(r) <= to
        }),
        "{node} was not demoted between {from} s and {to} s: {mine:?}"
    );
}

/// Every node that finished wrote its model into the report, and
/// `shoal eval` on that file gives the accuracy the node printed (within
/// 0.1 points: the node prints two decimals of a percentage).
pub fn assert_models(report: &Path, summary: &Value) -> anyhow::Result<()> {
    let all = summary["nodes"].as_array().cloned().unwrap_or_default();
    let mut checked = 0;
    for n in all.iter().filter(|n| n["exit"] == "exited") {
        let name = n["name"].as_str().unwrap_or("?");
        let model = n["model"].as_str().unwrap_or_else(|| panic!("{name} has no model in the report: {n}"));
        let out = Command::new(env!("CARGO_BIN_EXE_shoal"))
            .args(["eval", "--json", "--model"])
            .arg(report.join(model))
            .output()?;
        anyhow::ensure!(out.status.success(), "shoal eval failed: {}", String::from_utf8_lossy(&out.stderr));
        let eval: Value = serde_json::from_slice(&out.stdout)?;
        let (got, printed) = (eval["accuracy"].as_f64().unwrap_or(-1.0), n["final_accuracy"].as_f64().unwrap_or(-2.0));
        assert!((got - printed).abs() <= 0.001, "{name}: eval gives {got}, the node printed {printed}");
        checked += 1;
    }
    assert!(checked > 0, "no node finished");
    Ok(())
}
