//! Operations: the node's HTTP endpoint, runtime fault injection,
//! logging and compute threads.

pub mod faults;
pub mod http;
pub mod logging;
pub mod threads;
