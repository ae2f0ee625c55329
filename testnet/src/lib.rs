//! `shoal-testnet`: harnesses for Shoal clusters.
//!
//! Today: the in-process cluster builder (defined in `shoal-node`, because
//! the `shoal demo` command needs it and Cargo forbids the cycle
//! node -> testnet -> node) and the example node config
//! (`testnet/node.example.toml`). The multi-process launcher and the
//! docker-compose testnet are the testnet issue's work.

pub use shoal_node::cluster::{Cluster, ClusterSpec, NodeOverride};
pub use shoal_node::config::NodeConfig;
pub use shoal_node::node::NodeReport;
