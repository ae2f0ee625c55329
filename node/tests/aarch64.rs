//! The aarch64 build, run under user-mode emulation (qemu). CI cross-builds
//! `shoal` with `scripts/build-aarch64.sh` and points `SHOAL_AARCH64_BIN` at
//! it; these tests are `#[ignore]`d in the README's test command because
//! they need that binary and `qemu-aarch64-static` (Debian's
//! `qemu-user-static` and `libc6-arm64-cross`).
//!
//! ```sh
//! SHOAL_AARCH64_BIN=$(scripts/build-aarch64.sh) cargo test -p shoal-node --test aarch64 -- --ignored
//! ```

#[allow(dead_code)] // The helpers the other testnet tests use.
mod common;

use std::path::PathBuf;
use std::process::{Command, Output};

use common::{repo, run_testnet};

/// The cross-built binary; an error that says how to build it.
fn arm_binary() -> anyhow::Result<PathBuf> {
    let path = std::env::var_os("SHOAL_AARCH64_BIN").map(PathBuf::from).ok_or_else(|| {
        anyhow::anyhow!(
            "SHOAL_AARCH64_BIN is not set: build with `scripts/build-aarch64.sh` and set it to the path it prints"
        )
    })?;
    let path = if path.is_relative() { repo().join(path) } else { path };
    let elf = std::fs::read(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    // ELF, 64-bit, machine 0xB7 (EM_AARCH64) at offset 18, little-endian.
    anyhow::ensure!(
        elf.len() > 20 && &elf[..4] == b"\x7fELF" && elf[4] == 2 && u16::from_le_bytes([elf[18], elf[19]]) == 0xB7,
        "{} is not an aarch64 ELF executable",
        path.display()
    );
    Ok(path)
}

/// Run the aarch64 `shoal` with `args` under qemu.
fn run_arm(args: &[&str]) -> anyhow::Result<Output> {
    let bin = arm_binary()?;
    let out = shoal_testnet::process::qemu_aarch64_command(&bin)?.args(args).env("NO_COLOR", "1").output()?;
    eprintln!("aarch64 shoal {}:\n{}", args.join(" "), String::from_utf8_lossy(&out.stdout));
    anyhow::ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    Ok(out)
}

fn run_native(args: &[&str]) -> anyhow::Result<Output> {
    let out = Command::new(env!("CARGO_BIN_EXE_shoal")).args(args).env("NO_COLOR", "1").output()?;
    eprintln!("native shoal {}:\n{}", args.join(" "), String::from_utf8_lossy(&out.stdout));
    anyhow::ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    Ok(out)
}

/// `final test accuracy 87.19% after 45 steps` from `shoal train`: (accuracy
/// in [0, 1], steps).
fn train_result(out: &Output) -> Option<(f64, u64)> {
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find_map(|l| l.strip_prefix("final test accuracy "))?;
    let (acc, rest) = line.split_once("% after ")?;
    Some((acc.parse::<f64>().ok()? / 100.0, rest.split_whitespace().next()?.parse().ok()?))
}

#[test]
#[ignore = "needs the aarch64 build (SHOAL_AARCH64_BIN) and qemu; .ci/run runs it"]
fn the_aarch64_binary_trains_an_epoch_of_digits_as_the_native_one_does() -> anyhow::Result<()> {
    let args = ["train", "--epochs", "1", "--threads", "1"];
    let arm = run_arm(&args)?;
    let native = run_native(&args)?;
    let (arm_acc, arm_steps) = train_result(&arm).ok_or_else(|| anyhow::anyhow!("no final line from aarch64"))?;
    let (native_acc, native_steps) =
        train_result(&native).ok_or_else(|| anyhow::anyhow!("no final line from the native binary"))?;
    assert_eq!(arm_steps, native_steps, "the same epoch is the same number of steps");
    // Same seed, same data order: only the floating-point kernels differ
    // (NEON against AVX), so the accuracy after one epoch is the same up to
    // a sample or two of the 359 in the test set.
    assert!(arm_acc >= 0.85, "aarch64: {:.2}% after one epoch", arm_acc * 100.0);
    assert!(
        (arm_acc - native_acc).abs() <= 0.01,
        "aarch64 {:.2}% against native {:.2}% after one epoch",
        arm_acc * 100.0,
        native_acc * 100.0
    );
    Ok(())
}

#[test]
#[ignore = "needs the aarch64 build (SHOAL_AARCH64_BIN) and qemu; .ci/run runs it"]
fn the_aarch64_binary_runs_a_two_node_cluster_over_loopback_tcp() -> anyhow::Result<()> {
    let out = run_arm(&["demo", "--nodes", "2"])?;
    let text = String::from_utf8_lossy(&out.stdout);
    // `node0: test accuracy 96.10% after 300 steps, owned shards [0, 1, 2, 3], ...`
    let finals: Vec<(String, f64, u64, bool)> = text
        .lines()
        .filter_map(|l| {
            let (name, rest) = l.split_once(": test accuracy ")?;
            let (acc, rest) = rest.split_once("% after ")?;
            let steps = rest.split_whitespace().next()?.parse().ok()?;
            let owns = rest.contains("owned shards [") && !rest.contains("owned shards []");
            Some((name.to_string(), acc.parse::<f64>().ok()? / 100.0, steps, owns))
        })
        .collect();
    assert_eq!(finals.len(), 2, "{text}");
    for (name, acc, steps, owns) in &finals {
        assert_eq!(*steps, 300, "{name}");
        assert!(*acc >= 0.93, "{name}: {:.2}%", acc * 100.0);
        assert!(*owns, "{name} owned no shard: both nodes aggregate in a 2-node demo");
    }
    Ok(())
}

/// Three native nodes and one emulated aarch64 worker
/// (`testnet/scenarios/mixed-arch.toml`). The scenario's own checks compare
/// the final accuracy with the same testnet run all native (at most 0.5
/// points below it) and bound the edge node's peak memory; here the report must also
/// name each node's architecture, and the native nodes must not be held to
/// the emulated node's pace.
#[test]
#[ignore = "needs the aarch64 build (SHOAL_AARCH64_BIN) and qemu; .ci/run runs it"]
fn a_mixed_testnet_with_an_emulated_arm_worker_trains_to_the_all_native_accuracy() -> anyhow::Result<()> {
    let bin = arm_binary()?;
    let bin = bin.to_string_lossy().to_string();
    let (report, summary) = run_testnet(&["--aarch64-bin", &bin], &repo().join("testnet/scenarios/mixed-arch.toml"))?;
    let nodes = summary["nodes"].as_array().cloned().unwrap_or_default();
    let arch: Vec<(&str, &str)> =
        nodes.iter().map(|n| (n["name"].as_str().unwrap_or("?"), n["arch"].as_str().unwrap_or("?"))).collect();
    assert_eq!(
        arch,
        [
            ("node0", std::env::consts::ARCH),
            ("node1", std::env::consts::ARCH),
            ("node2", std::env::consts::ARCH),
            ("node3", "aarch64")
        ]
    );
    for n in &nodes {
        assert_eq!(n["exit"], "exited", "{n}");
    }
    let checks = &summary["checks"];
    assert_eq!(checks["failures"].as_array().map(Vec::len), Some(0), "{checks}");
    let (mixed, native) = (checks["survivors_accuracy"].as_f64(), checks["fault_free_accuracy"].as_f64());
    let (Some(mixed), Some(native)) = (mixed, native) else { panic!("no accuracies: {checks}") };
    assert!(mixed >= native - 0.005, "mixed {mixed} against all-native {native}");
    // The emulated node trained its samples and owned no shard.
    let roles = summary["role_changes"].as_array().cloned().unwrap_or_default();
    assert!(
        !roles.iter().any(|r| r["node"] == "node3" && r["role"] == "aggregator"),
        "node3 (can_aggregate = false) owned shards: {roles:?}"
    );
    // Not held back beyond its share: the native nodes' pace against the
    // all-native run of the same scenario (its report is beside this one).
    let base: serde_json::Value =
        serde_json::from_slice(&std::fs::read(report.path().join("fault-free").join("summary.json"))?)?;
    let rate = |s: &serde_json::Value| -> f64 {
        let samples = s["samples"].as_array().cloned().unwrap_or_default();
        let native: Vec<f64> = ["node0", "node1", "node2"]
            .iter()
            .filter_map(|n| {
                samples.iter().rev().filter(|x| x["node"] == *n).find_map(|x| x["samples_per_sec"].as_f64())
            })
            .collect();
        native.iter().sum::<f64>() / native.len().max(1) as f64
    };
    let (mixed_rate, native_rate) = (rate(&summary), rate(&base));
    eprintln!("native nodes' samples/s: mixed run {mixed_rate:.0}, all-native run {native_rate:.0}");
    assert!(native_rate > 0.0, "no rates in the all-native run");
    assert!(
        mixed_rate >= 0.6 * native_rate,
        "the native nodes ran at {mixed_rate:.0} samples/s beside the emulated node, {native_rate:.0} without it"
    );
    Ok(())
}
