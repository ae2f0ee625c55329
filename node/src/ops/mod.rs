//! Operations: the node's HTTP endpoint, runtime fault injection and
//! logging.

pub mod faults;
pub mod http;
pub mod logging;
