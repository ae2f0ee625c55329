//! Operations: the node's HTTP endpoint and its Prometheus metrics, runtime
//! fault injection, logging, compute threads, the allocator's tuning, and
//! the set of tasks a node owns.

pub mod allocator;
pub mod faults;
pub mod http;
pub mod logging;
pub mod memory;
pub mod metrics;
pub mod tasks;
pub mod threads;
