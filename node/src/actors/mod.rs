//! The node's tokio actors, each with one job, and the step loop. Each one
//! reaches the others only through their handles ([`crate::handles`]).

pub mod aggregator;
pub mod checkpoint;
pub mod election;
pub mod join;
pub mod membership;
pub mod net;
pub mod status;
pub mod trainer;
pub mod worker;
