//! One module per subcommand.

pub mod bench;
pub mod bench_checkpoint;
pub mod bench_comm;
pub mod bench_exchange;
pub mod cli;
pub mod data;
pub mod demo;
pub mod eval;
pub mod generate;
pub mod node;
pub mod testnet;
pub mod tokenize;
pub mod train;
