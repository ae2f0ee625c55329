//! Operations: the node's HTTP endpoint and its Prometheus metrics, runtime
//! fault injection, logging, compute threads and
//! the allocator's tuning.

pub mod allocator;
pub mod faults;
pub mod http;
pub mod logging;
pub mod memory;
pub mod metrics;
pub mod threads;
