//! Tests that hold the help text and the docs to the code: every argument
//! has a help line, `shoal node`'s flags show their defaults, every flag is
//! in the docs, and every key of the config file is in its tables.

use std::collections::BTreeSet;

use crate::config::NodeConfig;

const OPERATIONS: &str = include_str!("../../../docs/operations.md");
const BENCHMARKS: &str = include_str!("../../../docs/benchmarks.md");
const PROTOCOL: &str = include_str!("../../../docs/protocol.md");

/// Every subcommand that runs something (`shoal data tokenize` and the
/// like), with its full name.
fn leaves(cmd: &clap::Command, name: String, out: &mut Vec<(String, clap::Command)>) {
    let subs: Vec<_> = cmd.get_subcommands().filter(|s| s.get_name() != "help").collect();
    if subs.is_empty() {
        out.push((name.clone(), cmd.clone()));
    }
    for s in subs {
        leaves(s, format!("{name} {}", s.get_name()), out);
    }
}

fn commands() -> Vec<(String, clap::Command)> {
    let mut cmd = super::command();
    cmd.build();
    let mut out = Vec::new();
    leaves(&cmd, "shoal".into(), &mut out);
    out
}

/// The long flags of a command, `--help` left out.
fn flags(cmd: &clap::Command) -> Vec<(String, &clap::Arg)> {
    cmd.get_arguments()
        .filter_map(|a| Some((format!("--{}", a.get_long()?), a)))
        .filter(|(l, _)| l != "--help" && l != "--version")
        .collect()
}

#[test]
fn every_argument_has_a_help_line() {
    let mut blank = Vec::new();
    for (name, cmd) in commands() {
        for a in cmd.get_arguments() {
            let help = a.get_help().map(ToString::to_string).unwrap_or_default();
            if help.trim().is_empty() {
                blank.push(format!(
                    "{name} {}",
                    a.get_long().map(|l| format!("--{l}")).unwrap_or(a.get_id().to_string())
                ));
            }
            assert!(!help.contains("[`"), "{name} {:?}: a rustdoc link in the help: {help}", a.get_long());
        }
    }
    assert!(blank.is_empty(), "arguments without help: {blank:?}");
}

#[test]
fn shoal_node_flags_show_their_default_from_the_config() {
    let mut cmd = super::command();
    cmd.build();
    let node = cmd.find_subcommand("node").cloned().unwrap_or_default();
    let defaults = NodeConfig::default();
    let mut missing = Vec::new();
    for (flag, a) in flags(&node) {
        let help = a.get_help().map(ToString::to_string).unwrap_or_default();
        if a.get_action().takes_values() && !help.contains("default") {
            missing.push(flag);
        }
    }
    assert!(missing.is_empty(), "`shoal node` flags whose help names no default: {missing:?}");
    // The shown default is the config's, not a copy of it.
    let help = |long: &str| {
        node.get_arguments()
            .find(|a| a.get_long() == Some(long))
            .and_then(|a| a.get_help().map(ToString::to_string))
            .unwrap_or_default()
    };
    assert!(help("batch-size").ends_with(&format!("[default: {}]", defaults.training.batch_size)));
    assert!(help("failure-timeout-ms").ends_with(&format!("[default: {}]", defaults.cluster.failure_timeout_ms)));
    assert!(help("sync").ends_with(&format!("[default: {}]", defaults.sync.policy)), "{}", help("sync"));
}

#[test]
fn every_flag_is_in_the_docs() {
    let mut missing = Vec::new();
    for (name, cmd) in commands() {
        // Benchmarks are documented with their numbers.
        let (docs, file) =
            if name.starts_with("shoal bench") { (BENCHMARKS, "benchmarks.md") } else { (OPERATIONS, "operations.md") };
        for (flag, arg) in flags(&cmd) {
            // `--log-format` and the like: `shoal`'s own, in operations.md.
            let docs = if arg.is_global_set() { OPERATIONS } else { docs };
            let named = docs.match_indices(&flag).any(|(i, _)| {
                let next = docs[i + flag.len()..].chars().next();
                !next.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            });
            if !named {
                missing.push(format!("{name} {flag} (docs/{file})"));
            }
        }
    }
    assert!(missing.is_empty(), "flags the docs never name: {missing:?}");
}

/// The dotted keys of a TOML table's values (tables walked into).
fn keys(table: &toml::Table, prefix: &str, out: &mut BTreeSet<String>) {
    for (k, v) in table {
        match v {
            toml::Value::Table(t) => keys(t, &format!("{prefix}{k}."), out),
            _ => {
                out.insert(format!("{prefix}{k}"));
            }
        }
    }
}

/// The rows of operations.md's config tables: `table.key` (the top level's
/// keys bare), and each row's text.
fn documented_rows() -> Vec<(String, String)> {
    let section = OPERATIONS.split_once("### The config file").map(|(_, r)| r).unwrap_or_default();
    let section = section.split("\n### ").next().unwrap_or_default();
    let mut table: Option<String> = None;
    let mut rows = Vec::new();
    for line in section.lines() {
        if line.starts_with("**Top level**") {
            table = Some(String::new());
        } else if let Some(rest) = line.strip_prefix("**`[") {
            table = rest.split_once("]`**").map(|(t, _)| format!("{t}."));
        } else if let (Some(t), Some(cell)) = (&table, line.strip_prefix("| `")) {
            if let Some((key, _)) = cell.split_once('`') {
                // A row for a table (`[network.limits]`) names it in full.
                let key = match key.strip_prefix('[') {
                    Some(table) => table.trim_end_matches(']').to_string(),
                    None => format!("{t}{key}"),
                };
                rows.push((key, line.to_string()));
            }
        }
    }
    rows
}

#[test]
fn every_config_key_is_in_the_docs_tables() -> anyhow::Result<()> {
    // The optional tables written out, and the keys that are unset by default.
    let mut code = BTreeSet::new();
    keys(&toml::Table::try_from(crate::config::with_every_table())?, "", &mut code);
    let rows = documented_rows();
    assert!(rows.len() > 40, "docs/operations.md, `### The config file`: {} rows read", rows.len());
    let section10 = PROTOCOL.split_once("## 10.").map(|(_, r)| r).unwrap_or_default();
    let mut missing = Vec::new();
    for key in &code {
        // Its own row, or a row for its table (`[network.limits]`) that
        // names it or points to protocol.md §10, which does.
        let own = rows.iter().any(|(k, _)| k == key);
        let (table, leaf) = key.rsplit_once('.').unwrap_or(("", key));
        let in_table_row = rows.iter().any(|(k, row)| {
            k == table && (row.contains(leaf) || (row.contains("protocol.md#10") && section10.contains(leaf)))
        });
        if !own && !in_table_row {
            missing.push(key.clone());
        }
    }
    assert!(missing.is_empty(), "config keys docs/operations.md does not list: {missing:?}");
    // And no row for a key the config does not have.
    let tables: BTreeSet<String> = code.iter().filter_map(|k| k.rsplit_once('.').map(|(t, _)| t.to_string())).collect();
    let optional = ["name", "identity", "output", "output_hf", "profile", "checkpoint.dir"];
    let stale: Vec<&String> = rows
        .iter()
        .map(|(k, _)| k)
        .filter(|k| !code.contains(*k) && !tables.contains(*k) && !optional.contains(&k.as_str()))
        .filter(|k| !k.starts_with("training.") || !optional_training_key(k))
        .collect();
    assert!(stale.is_empty(), "docs/operations.md lists keys the config does not have: {stale:?}");
    Ok(())
}

/// `[training]` keys that are unset by default (`None`), so absent from
/// the written config.
fn optional_training_key(k: &str) -> bool {
    [
        "training.data_dir",
        "training.tokenizer",
        "training.lr",
        "training.threads",
        "training.momentum",
        "training.weight_decay",
        "training.mlp_hidden",
    ]
    .contains(&k)
}

#[test]
fn the_slow_links_recipe_is_a_valid_config() -> anyhow::Result<()> {
    let section = OPERATIONS.split_once("### Slow links: one recipe").map(|(_, r)| r).unwrap_or_default();
    let toml = section.split_once("```toml\n").and_then(|(_, r)| r.split_once("```")).map(|(t, _)| t);
    let toml = toml.ok_or_else(|| anyhow::anyhow!("docs/operations.md: no TOML under `Slow links: one recipe`"))?;
    let c = NodeConfig::from_toml(toml, None)?;
    c.validate()?;
    assert_eq!(c.local_steps.map(|l| (l.steps, l.outer_lr, l.outer_momentum)), Some((30, 1.0, 0.0)));
    // The recommended case of `bench comm --workload llama`.
    assert_eq!(c.delta_pulls(), Some(crate::policy::compress::PushCompression::Int8));
    assert_eq!(c.compression.push, crate::policy::compress::PushCompression::Int8);
    Ok(())
}
