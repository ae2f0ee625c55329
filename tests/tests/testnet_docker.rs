//! The docker-compose testnet (`testnet/docker-compose.yml`) survives losing a
//! shard owner: `testnet/docker/smoke.sh` builds the `shoal:testnet` image,
//! starts four containers, SIGKILLs node3 mid-run and requires the other three
//! to finish every step, exit 0 and reach 93% test accuracy.
//!
//! Needs a Docker engine, so it is ignored by default:
//! `cargo test -p shoal-tests --test testnet_docker -- --ignored --nocapture`.
//! Without an engine it prints `skipped: no docker engine` and passes.

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// Longest the whole script may take, image build (a release build of
/// shoal-node when it is stale) included. The script's own waits are bounded
/// too; this is the last resort. Override with SHOAL_DOCKER_TEST_TIMEOUT (s).
const DEFAULT_LIMIT: Duration = Duration::from_secs(30 * 60);

fn docker_engine_available() -> bool {
    Command::new("docker")
        .arg("info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Echo a child's stream line by line (to stderr, so it shows with
/// --nocapture) and keep the last lines for the failure message.
fn pump(stream: impl Read + Send + 'static, tail: Arc<Mutex<Vec<String>>>) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            eprintln!("{line}");
            if let Ok(mut t) = tail.lock() {
                t.push(line);
                if t.len() > 40 {
                    t.remove(0);
                }
            }
        }
    })
}

#[test]
#[ignore = "needs a docker engine; run from .ci/run"]
fn docker_compose_testnet_survives_a_killed_aggregator() -> anyhow::Result<()> {
    if !docker_engine_available() {
        eprintln!("skipped: no docker engine");
        return Ok(());
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let script = root.join("testnet/docker/smoke.sh");
    anyhow::ensure!(script.is_file(), "{} is missing", script.display());
    let limit = std::env::var("SHOAL_DOCKER_TEST_TIMEOUT")
        .ok()
        .and_then(|s| s.parse().ok())
        .map(Duration::from_secs)
        .unwrap_or(DEFAULT_LIMIT);

    let started = Instant::now();
    let mut child = Command::new("bash")
        .arg(&script)
        .current_dir(&root)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let tail = Arc::new(Mutex::new(Vec::new()));
    let pumps =
        [child.stdout.take().map(|s| pump(s, tail.clone())), child.stderr.take().map(|s| pump(s, tail.clone()))];

    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if started.elapsed() > limit {
            // SIGTERM first so the script's EXIT trap tears the testnet down.
            let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
            let grace = Instant::now();
            while child.try_wait()?.is_none() && grace.elapsed() < Duration::from_secs(60) {
                thread::sleep(Duration::from_millis(200));
            }
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!("smoke.sh still running after {limit:?}; killed it");
        }
        thread::sleep(Duration::from_millis(200));
    };
    for p in pumps.into_iter().flatten() {
        let _ = p.join();
    }
    eprintln!("smoke.sh exited with {status} after {:.0?}", started.elapsed());
    let tail = tail.lock().map(|t| t.join("\n")).unwrap_or_default();
    anyhow::ensure!(status.success(), "testnet/docker/smoke.sh failed ({status}); last lines:\n{tail}");
    Ok(())
}
