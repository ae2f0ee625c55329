//! The docker backend of `shoal testnet run`: the same scenario file as the
//! process test, with one container per node from the `shoal:testnet` image
//! on a private network. Needs a docker engine and the image
//! (`testnet/docker/build-image.sh`; `.ci/run` builds it first), so it is
//! ignored by default:
//! `cargo test -p shoal-node --test testnet_docker_backend -- --ignored --nocapture`.
//! Without an engine it prints `skipped: no docker engine` and passes.

use std::path::PathBuf;
use std::process::{Command, Stdio};

fn docker_ok(args: &[&str]) -> bool {
    Command::new("docker")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
#[ignore = "needs a docker engine and the shoal:testnet image; run from .ci/run"]
fn docker_testnet_runs_the_same_scenario_file() -> anyhow::Result<()> {
    if !docker_ok(&["info"]) {
        eprintln!("skipped: no docker engine");
        return Ok(());
    }
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    if !docker_ok(&["image", "inspect", "shoal:testnet"]) {
        let built = Command::new(repo.join("testnet/docker/build-image.sh")).status()?;
        assert!(built.success(), "building the image failed");
    }
    let report = tempfile::tempdir()?;
    // Bounded by the scenario's time limit (600 s).
    let out = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(["testnet", "run", "--backend", "docker", "--no-live", "--report"])
        .arg(report.path())
        .arg(repo.join("testnet/scenarios/slow-then-kill.toml"))
        .output()?;
    eprintln!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "shoal testnet run --backend docker failed: {}", out.status);
    let summary: serde_json::Value = serde_json::from_slice(&std::fs::read(report.path().join("summary.json"))?)?;
    let nodes = summary["nodes"].as_array().cloned().unwrap_or_default();
    assert_eq!(nodes.len(), 4);
    for n in &nodes {
        let name = n["name"].as_str().unwrap_or("?");
        if name == "node3" {
            assert_eq!(n["exit"], "killed");
            continue;
        }
        assert_eq!(n["exit"], "exited", "{name}: {n}");
        let acc = n["final_accuracy"].as_f64().unwrap_or(0.0);
        assert!(acc >= 0.93, "{name}: accuracy {acc} below 93%");
    }
    let roles = summary["role_changes"].as_array().cloned().unwrap_or_default();
    assert!(roles.iter().any(|r| r["node"] == "node3" && r["role"] == "worker"), "node3 was never demoted: {roles:?}");
    // Nothing is left behind: the launcher removes its containers and network.
    let left = Command::new("docker").args(["ps", "-a", "--filter", "name=shoal-slow-then-kill-", "-q"]).output()?;
    assert!(String::from_utf8_lossy(&left.stdout).trim().is_empty(), "containers left behind");
    Ok(())
}
