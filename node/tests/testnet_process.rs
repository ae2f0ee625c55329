//! The process backend of the testnet, for real: `shoal testnet run` spawns
//! four `shoal node` processes on loopback, slows one shard owner through
//! its control endpoint, then kills its process. Training completes, the
//! survivors reach the accuracy target, and the report records the role
//! change and the kill.

use std::path::PathBuf;
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn process_testnet_survives_a_slowed_then_killed_aggregator() -> anyhow::Result<()> {
    let report = tempfile::tempdir()?;
    let scenario = repo().join("testnet/scenarios/slow-then-kill.toml");
    // The scenario's own time limit (600 s) bounds the run: the launcher
    // kills every node and fails when it is reached.
    let out = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(["testnet", "run", "--no-live", "--report"])
        .arg(report.path())
        .arg(&scenario)
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "shoal testnet run failed: {}", out.status);

    let summary: serde_json::Value = serde_json::from_slice(&std::fs::read(report.path().join("summary.json"))?)?;
    let png = std::fs::read(report.path().join("plot.png"))?;
    assert_eq!(&png[..4], b"\x89PNG");
    let nodes = summary["nodes"].as_array().cloned().unwrap_or_default();
    assert_eq!(nodes.len(), 4);
    for n in &nodes {
        let name = n["name"].as_str().unwrap_or("?");
        if name == "node3" {
            assert_eq!(n["exit"], "killed");
            continue;
        }
        assert_eq!(n["exit"], "exited", "{name}: {n}");
        assert_eq!(n["steps"], 1500, "{name} trained to the end");
        let acc = n["final_accuracy"].as_f64().unwrap_or(0.0);
        assert!(acc >= 0.93, "{name}: accuracy {acc} below 93%");
    }
    let faults = summary["faults"].as_array().cloned().unwrap_or_default();
    let at = |action: &str| {
        faults
            .iter()
            .find(|f| f["action"].as_str().is_some_and(|a| a.starts_with(action)))
            .and_then(|f| f["secs"].as_f64())
    };
    let (Some(slowed), Some(killed)) = (at("slow node3"), at("kill node3")) else {
        panic!("the report lacks the slow or the kill: {faults:?}");
    };
    assert!(faults.iter().any(|f| f["outcome"].as_str().is_some_and(|o| o.contains("killed"))), "{faults:?}");
    // node3 owned shards before the slowdown and none after it, before the kill.
    let roles = summary["role_changes"].as_array().cloned().unwrap_or_default();
    let node3: Vec<_> = roles.iter().filter(|r| r["node"] == "node3").collect();
    assert!(
        node3.iter().any(|r| r["role"] == "aggregator" && r["secs"].as_f64() < Some(slowed)),
        "node3 was never an owner: {node3:?}"
    );
    assert!(
        node3.iter().any(|r| {
            let t = r["secs"].as_f64().unwrap_or(-1.0);
            r["role"] == "worker" && r["owned"].as_array().is_some_and(Vec::is_empty) && t >= slowed && t <= killed
        }),
        "node3 was not demoted between the slowdown ({slowed} s) and the kill ({killed} s): {node3:?}"
    );
    Ok(())
}

#[test]
fn a_scenario_with_an_error_is_refused_with_its_line() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, "nodes = 4\n\n[[event]]\nat_secs = -3\naction = \"kill\"\nnode = 1\n")?;
    let out = Command::new(env!("CARGO_BIN_EXE_shoal")).args(["testnet", "run"]).arg(&path).output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("bad.toml:4: at_secs = -3: an event time cannot be negative"), "{stderr}");
    std::fs::write(&path, "nodes = 4\n\n[[event]]\nat_secs = 3\naction = \"kill\"\nnode = 9\n")?;
    let out = Command::new(env!("CARGO_BIN_EXE_shoal")).args(["testnet", "check"]).arg(&path).output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("bad.toml:3: node 9 does not exist (nodes 0..3 at that time)"), "{stderr}");
    Ok(())
}

#[test]
fn process_testnet_trains_on_through_a_partition_and_its_heal() -> anyhow::Result<()> {
    let report = tempfile::tempdir()?;
    let out = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(["testnet", "run", "--no-live", "--report"])
        .arg(report.path())
        .arg(repo().join("testnet/scenarios/partition.toml"))
        .output()?;
    eprintln!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "shoal testnet run failed: {}", out.status);
    let summary: serde_json::Value = serde_json::from_slice(&std::fs::read(report.path().join("summary.json"))?)?;
    let faults = summary["faults"].as_array().cloned().unwrap_or_default();
    let outcome = |prefix: &str| {
        faults
            .iter()
            .find(|f| f["action"].as_str().is_some_and(|a| a.starts_with(prefix)))
            .and_then(|f| f["outcome"].as_str().map(str::to_string))
    };
    assert!(outcome("partition").is_some_and(|o| o.starts_with("partitioned")), "{faults:?}");
    assert_eq!(outcome("heal").as_deref(), Some("healed"), "{faults:?}");
    let nodes = summary["nodes"].as_array().cloned().unwrap_or_default();
    assert_eq!(nodes.len(), 4);
    for n in &nodes {
        let name = n["name"].as_str().unwrap_or("?");
        assert_eq!(n["exit"], "exited", "{name}: {n}");
        assert_eq!(n["steps"], 2000, "{name} trained to the end");
        let acc = n["final_accuracy"].as_f64().unwrap_or(0.0);
        assert!(acc >= 0.93, "{name}: accuracy {acc} below 93%");
    }
    Ok(())
}
