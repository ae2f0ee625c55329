//! `shoal-testnet`: local testnets for trying Shoal and testing it under faults.
//!
//! - [`scenario`]: the TOML scenario format (nodes, per-node overrides, a
//!   timeline of faults), validated with errors that point at the line;
//! - [`process`]: the process backend behind `shoal testnet run`: it spawns
//!   `shoal node` processes on loopback, applies the timeline through each
//!   node's HTTP control endpoint and real process kills, shows a live table
//!   and writes a report;
//! - [`report`]: `summary.json` and the accuracy/loss plot;
//! - [`layers`]: how layers of a node's TOML config combine (shared with
//!   the node);
//! - [`checks`]: what a soak asserts (memory after warm-up, forced rounds,
//!   accuracy against a fault-free run), judged from the summaries.
//!
//! The docker-compose backend lives in `testnet/docker-compose.yml` and
//! `testnet/docker/`. This crate talks to nodes only over HTTP and the
//! command line, so it does not depend on `shoal-node` (the `shoal` binary
//! depends on it instead).

pub mod checks;
pub mod http;
pub mod layers;
pub mod netns;
pub mod process;
pub mod report;
pub mod scenario;

pub use process::{run, RunOptions};
pub use scenario::{Action, Event, Scenario, ScenarioError};
