//! `shoal-node`: the `shoal` binary's library: the node's tokio actors and
//! the commands built on them.
//!
//! Actors (each with one job and a cloneable handle holding a bounded sender):
//! - [`net`] owns the libp2p `Swarm`;
//! - [`trainer`] runs candle on a dedicated OS thread;
//! - [`aggregator`] serves the shards this node owns;
//! - [`membership`] keeps the gossiped view and the failure detector;
//! - [`elect`] recomputes the shard placement whenever the view changes;
//! - [`status`] keeps counters.
//!
//! Pure cores: [`sync`] (sync policies, shard owner logic), [`assign`]
//! (weighted rendezvous), [`health`] (straggler detection) and
//! [`elect::elect`] (the placement from the view). [`worker`] is the step loop, [`node`]
//! wires one node, [`cluster`] builds an in-process cluster.

pub mod aggregator;
pub mod assign;
pub mod cli;
pub mod cluster;
pub mod cmd;
pub mod config;
pub mod elect;
pub mod explore;
pub mod faults;
pub mod handoff;
pub mod health;
pub mod http;
pub mod join;
pub mod logging;
pub mod membership;
pub mod net;
pub mod node;
pub mod status;
pub mod sync;
pub mod trainer;
pub mod worker;
