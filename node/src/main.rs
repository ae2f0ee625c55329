//! `shoal`: a peer-to-peer trainer for neural networks.

use std::process::ExitCode;

use shoal_node::cmd;
use shoal_node::cmd::cli::{BenchCommand, Command, DataCommand, TestnetCommand};
use shoal_node::ops::{allocator, logging};

fn main() -> ExitCode {
    // First, before anything has started: on success this does not return.
    let reexec_failed = allocator::reexec_tuned();
    let cli = cmd::parse();
    let default_level = if matches!(
        cli.command,
        Command::Demo(_) | Command::Bench { .. } | Command::Testnet { .. } | Command::Top(_)
    ) {
        "warn"
    } else {
        "info"
    };
    if let Err(e) = logging::init(cli.log_format, default_level) {
        eprintln!("error: cannot start logging: {e:#}");
        return ExitCode::from(2);
    }
    if let Some(why) = reexec_failed {
        tracing::warn!("{why}; running on glibc's allocator defaults (slower: see docs/operations.md)");
    }
    let result = match cli.command {
        Command::Train(args) => cmd::train::run(*args),
        Command::Node(args) => cmd::node::run(*args),
        Command::Demo(args) => cmd::demo::run(args),
        Command::Eval(args) => cmd::eval::run(args),
        Command::Generate(args) => cmd::generate::run(args),
        Command::Data { command: DataCommand::Fetch(args) } => cmd::data::fetch(args),
        Command::Data { command: DataCommand::TrainTokenizer(args) } => cmd::tokenize::train_tokenizer(args),
        Command::Data { command: DataCommand::Tokenize(args) } => cmd::tokenize::tokenize(args),
        Command::Bench { command: BenchCommand::Train(args) } => cmd::bench::train(args),
        Command::Bench { command: BenchCommand::Wire(args) } => cmd::bench::wire(args),
        Command::Bench { command: BenchCommand::Cluster(args) } => cmd::bench::cluster(args),
        Command::Bench { command: BenchCommand::Straggler(args) } => cmd::bench::straggler(args),
        Command::Bench { command: BenchCommand::Aggregators(args) } => cmd::bench::aggregators(args),
        Command::Bench { command: BenchCommand::Checkpoint(args) } => cmd::bench_checkpoint::run(args),
        Command::Bench { command: BenchCommand::Comm(args) } => cmd::bench_comm::run(args),
        Command::Bench { command: BenchCommand::Exchange(args) } => cmd::bench_exchange::run(args),
        Command::Bench { command: BenchCommand::Robust(args) } => cmd::bench_robust::run(args),
        Command::Top(args) => cmd::top::run(args),
        Command::Testnet { command: TestnetCommand::Run(args) } => cmd::testnet::run(args),
        Command::Testnet { command: TestnetCommand::Check { scenario } } => cmd::testnet::check(&scenario),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // `{:#}` prints the whole cause chain on one line.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
