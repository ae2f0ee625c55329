//! The docker backend of `shoal testnet run`: the same scenario file as the
//! process test, with one container per node from the `shoal:testnet` image
//! on a private network. Needs a docker engine and the image
//! (`testnet/docker/build-image.sh`; `.ci/run` builds it first), so it is
//! ignored by default:
//! `cargo test -p shoal-node --test testnet_docker_backend -- --ignored --nocapture`.
//! Without an engine it prints `skipped: no docker engine` and passes.

mod common;

use std::process::{Command, Stdio};

use common::{assert_demoted, assert_models, assert_survivors, fault, repo, run_testnet};

fn docker_ok(args: &[&str]) -> bool {
    Command::new("docker")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A docker engine and the `shoal:testnet` image (built when missing);
/// `false`, with a line saying the test skipped, without an engine.
fn docker_ready() -> anyhow::Result<bool> {
    if !docker_ok(&["info"]) {
        eprintln!("skipped: no docker engine");
        return Ok(false);
    }
    if !docker_ok(&["image", "inspect", "shoal:testnet"]) {
        let built = Command::new(repo().join("testnet/docker/build-image.sh")).status()?;
        anyhow::ensure!(built.success(), "building the image failed");
    }
    Ok(true)
}

#[test]
#[ignore = "needs a docker engine and the shoal:testnet image; run from .ci/run"]
fn docker_testnet_runs_the_same_scenario_file() -> anyhow::Result<()> {
    if !docker_ready()? {
        return Ok(());
    }
    let (report, summary) =
        run_testnet(&["--backend", "docker"], &repo().join("testnet/scenarios/slow-then-kill.toml"))?;
    assert_survivors(&summary, 4, Some("node3"), 1500);
    let (slowed, _) = fault(&summary, "slow node3");
    let (killed, _) = fault(&summary, "kill node3");
    assert_demoted(&summary, "node3", slowed, killed);
    // The containers wrote their models into the report's mounted folder.
    assert_models(report.path(), &summary)?;
    // Nothing is left behind: the launcher removes its containers and network.
    let left = Command::new("docker").args(["ps", "-a", "--filter", "name=shoal-slow-then-kill-", "-q"]).output()?;
    assert!(String::from_utf8_lossy(&left.stdout).trim().is_empty(), "containers left behind");
    Ok(())
}

/// mDNS, tested by leaving every other way out: the nodes get no bootstrap
/// address (`discovery = "mdns"` in the scenario), so they only form a
/// roster, and train, if mDNS finds the others on the docker network.
#[test]
#[ignore = "needs a docker engine and the shoal:testnet image; run from .ci/run"]
fn docker_nodes_with_no_bootstrap_address_find_each_other_by_mdns_and_train() -> anyhow::Result<()> {
    if !docker_ready()? {
        return Ok(());
    }
    let scenario = repo().join("testnet/scenarios/mdns.toml");
    let text = std::fs::read_to_string(&scenario)?;
    assert!(text.lines().any(|l| l.trim() == "discovery = \"mdns\""), "the scenario no longer tests mDNS");
    let (report, summary) = run_testnet(&["--backend", "docker"], &scenario)?;
    assert_survivors(&summary, 3, None, 600);
    // Training needs a roster of all three (min_peers is the node count),
    // and each node logged the peers mDNS found.
    for i in 0..3 {
        let log = std::fs::read_to_string(report.path().join("logs").join(format!("node{i}.log")))?;
        assert!(log.contains("found by mDNS"), "node{i} found no peer by mDNS");
    }
    Ok(())
}

/// Relay (circuit relay v2), tested by leaving no other way: node3 sits on
/// a docker network that only node0, the relay, shares; node0 owns no shard,
/// so node3 can only push and pull, and be pushed to, through the relay.
#[test]
#[ignore = "needs a docker engine and the shoal:testnet image; run from .ci/run"]
fn a_node_on_a_network_the_others_cannot_reach_trains_through_a_relay() -> anyhow::Result<()> {
    if !docker_ready()? {
        return Ok(());
    }
    let scenario = repo().join("testnet/scenarios/relay.toml");
    let text = std::fs::read_to_string(&scenario)?;
    assert!(text.lines().any(|l| l.trim() == "discovery = \"relay\""), "the scenario no longer tests the relay");
    let (report, summary) = run_testnet(&["--backend", "docker"], &scenario)?;
    assert_survivors(&summary, 4, None, 600);
    let log = |i: usize| std::fs::read_to_string(report.path().join("logs").join(format!("node{i}.log")));
    let far = log(3)?;
    assert!(far.contains("reservation accepted"), "node3 took no reservation on the relay");
    assert!(far.contains("connected through a relay"), "node3 reached no peer through the relay");
    let relay = log(0)?;
    assert!(relay.contains("relay: circuit opened"), "node0 relayed no circuit");
    // The far node owned shards or pushed to owners on the other network:
    // every peer it exchanged with beyond the relay was reached through it.
    for i in 1..3 {
        assert!(log(i)?.contains("reservation accepted"), "node{i} took no reservation on the relay");
    }
    Ok(())
}
