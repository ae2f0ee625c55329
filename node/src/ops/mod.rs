//! Operations: the node's HTTP endpoint and its Prometheus metrics, runtime
//! fault injection, logging and compute threads.

pub mod faults;
pub mod http;
pub mod logging;
pub mod memory;
pub mod metrics;
pub mod threads;
