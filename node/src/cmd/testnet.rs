//! `shoal testnet`: run and check testnet scenarios (see `shoal-testnet`).

use std::path::Path;

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
    let opts =
        RunOptions { scenario: args.scenario, report_dir, shoal_bin, live: args.no_live.then_some(false), backend };
    shoal_testnet::run(&opts)?;
    Ok(())
}

#[allow(clippy::print_stdout)] // The command's own output.
pub fn check(path: &Path) -> anyhow::Result<()> {
    let s = Scenario::from_file(path)?;
    println!("{}: {} nodes, run `{}`, time limit {} s", path.display(), s.nodes, s.run_id, s.time_limit.as_secs());
    for e in &s.events {
        println!("  at {:>6.1} s (line {}): {}", e.at_secs, e.line, e.action);
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
        println!("  checks: {}", what.join("; "));
    }
    Ok(())
}
