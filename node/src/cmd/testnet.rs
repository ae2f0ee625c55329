//! `shoal testnet`: run and check testnet scenarios (see `shoal-testnet`).

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use shoal_testnet::process::Backend;
use shoal_testnet::{RunOptions, Scenario};

use crate::cmd::cli::TestnetRunArgs;

pub fn run(args: TestnetRunArgs) -> anyhow::Result<()> {
    let shoal_bin = match args.shoal_bin {
        Some(b) => b,
        None => std::env::current_exe()?,
    };
    let report_dir = args.report.unwrap_or_else(|| shoal_testnet::process::default_report_dir(&args.scenario));
    let backend = match args.backend.as_str() {
        "processes" => Backend::Processes,
        "docker" => Backend::Docker { image: args.image },
        other => anyhow::bail!("unknown backend `{other}`: processes or docker"),
    };
    node_configs_parse(&Scenario::from_file(&args.scenario)?)?;
    let stop = Arc::new(AtomicBool::new(false));
    watch_for_stop(stop.clone())?;
    let opts = RunOptions {
        scenario: args.scenario,
        report_dir,
        shoal_bin,
        aarch64_bin: args.aarch64_bin,
        live: args.no_live.then_some(false),
        backend,
        stop: Some(stop),
    };
    shoal_testnet::run(&opts)?;
    Ok(())
}

/// Sets `stop` on Ctrl-C or SIGTERM, from a thread of its own, so that the
/// launcher kills its nodes and writes the report instead of dying and
/// leaving them running. A second signal ends the process at once. The
/// handlers are in place when this returns.
fn watch_for_stop(stop: Arc<AtomicBool>) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_io().build()?;
    #[cfg(unix)]
    let mut signals = {
        use tokio::signal::unix::{signal, SignalKind};
        let _in_runtime = rt.enter();
        (signal(SignalKind::interrupt())?, signal(SignalKind::terminate())?)
    };
    std::thread::Builder::new().name("testnet-signals".into()).spawn(move || {
        rt.block_on(async {
            for _ in 0..2 {
                #[cfg(unix)]
                tokio::select! {
                    _ = signals.0.recv() => {}
                    _ = signals.1.recv() => {}
                }
                #[cfg(not(unix))]
                let _ = tokio::signal::ctrl_c().await;
                if stop.swap(true, Ordering::SeqCst) {
                    std::process::exit(130);
                }
            }
        })
    })?;
    Ok(())
}

/// Refuse a scenario whose node configs a node would refuse (an unknown
/// key, or a key that moved to its own table) before any node starts:
/// `[node_config]`, and each node's `[node.config]` merged over it.
fn node_configs_parse(s: &Scenario) -> anyhow::Result<()> {
    let mut configs = vec![("node_config".to_string(), s.node_config.clone())];
    for (index, spec) in &s.overrides {
        let mut merged = s.node_config.clone();
        shoal_testnet::layers::merge_tables(&mut merged, spec.config.clone());
        configs.push((format!("node_config with [node.config] of node {index}"), merged));
    }
    for (what, table) in configs {
        crate::config::NodeConfig::from_toml(&toml::to_string(&table)?, None)
            .map_err(|e| anyhow::anyhow!("{what}: {e:#}"))?;
    }
    Ok(())
}

#[allow(clippy::print_stdout)] // The command's own output.
pub fn check(path: &Path) -> anyhow::Result<()> {
    let s = Scenario::from_file(path)?;
    node_configs_parse(&s)?;
    println!("{}: {} nodes, run `{}`, time limit {} s", path.display(), s.nodes, s.run_id, s.time_limit.as_secs());
    for e in &s.events {
        println!("  {} (line {}): {}", e.at, e.line, e.action);
    }
    let c = &s.checks;
    if !c.is_empty() {
        let mut what = Vec::new();
        if let Some(g) = c.max_rss_growth {
            what.push(format!("RSS growth at most {:.0}% after {} s of warm-up", g * 100.0, c.warmup_secs));
        }
        if c.no_forced_rounds {
            what.push("no forced BSP round".to_string());
        }
        if let Some(p) = c.accuracy_within_points {
            what.push(format!("accuracy within {p} points of the same run without events (run after it)"));
        }
        if let Some(p) = c.max_accuracy_drop_points {
            what.push(format!("accuracy at most {p} points below the same run without events (run after it)"));
        }
        println!("  checks: {}", what.join("; "));
    }
    Ok(())
}
