//! One module per subcommand.

pub mod bench;
pub mod bench_checkpoint;
pub mod bench_comm;
pub mod bench_comm_llama;
pub mod bench_exchange;
pub mod bench_robust;
pub mod cli;
pub mod data;
pub mod demo;
pub mod eval;
pub mod generate;
pub mod node;
pub mod testnet;
pub mod tokenize;
pub mod top;
pub mod train;

use clap::{CommandFactory, FromArgMatches};

/// The command line as `shoal` parses it: clap's, with the defaults of
/// `shoal node`'s flags written into their help (they come from the config,
/// not from clap).
pub fn command() -> clap::Command {
    cli::Cli::command().mut_subcommand("node", node::with_defaults)
}

/// Parse the process's arguments (clap's errors and `--help` exit here).
pub fn parse() -> cli::Cli {
    let matches = command().get_matches();
    cli::Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

#[cfg(test)]
mod help_docs;
