//! The node's tokio actors, each with one job, and the step loop.

pub mod aggregator;
pub mod handoff;
pub mod join;
pub mod membership;
pub mod net;
pub mod status;
pub mod trainer;
pub mod worker;
