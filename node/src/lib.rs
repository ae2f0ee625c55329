//! `shoal-node`: the `shoal` binary's library: the node's tokio actors and
//! the commands built on them.
//!
//! The folders follow the architecture:
//! - [`policy`]: pure decisions, free of tokio and libp2p: sync rules and the
//!   shard owner's logic, weighted rendezvous, straggler and capacity
//!   verdicts, the placement from the view, the number of aggregators;
//! - [`actors`]: the node's tokio actors and its step loop;
//! - [`ops`]: what operators touch: the HTTP endpoint, fault injection,
//!   logging;
//! - [`cmd`]: the command line and one module per subcommand.
//!
//! [`node`] wires one node from its actors, [`cluster`] starts several in
//! one process, and [`config`] is a node's configuration.

pub mod actors;
pub mod cluster;
pub mod cmd;
pub mod config;
pub mod handles;
pub mod node;
pub mod ops;
pub mod policy;
