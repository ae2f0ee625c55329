//! An in-process cluster: N nodes in one process, each with its own actors
//! and its own libp2p `Swarm` on real loopback TCP sockets. `shoal demo`,
//! the tests and the benchmarks all build clusters with this.
//!
//! (The multi-process and docker-compose testnets are in `shoal-testnet`.)

use anyhow::Context;
use shoal_protocol::libp2p::identity::Keypair;
use shoal_protocol::libp2p::Multiaddr;

use crate::config::NodeConfig;
use crate::node::{start, NodeReport, RunningNode};

/// Per-node differences from the shared config.
#[derive(Debug, Clone, Default)]
pub struct NodeOverride {
    pub batch_size: Option<usize>,
    pub can_aggregate: Option<bool>,
    pub memory_bytes: Option<u64>,
    /// Fault injection: this node answers pushes and pulls this many ms late.
    pub fault_delay_ms: Option<u64>,
    /// Fault injection: this node computes this many times slower.
    pub slowdown: Option<f64>,
    /// Fault injection: this node's link, Mbit/s each way (`faults.link_mbps`).
    pub link_mbps: Option<f64>,
    /// Fault injection: this node pushes bad gradients.
    pub byzantine: Option<crate::ops::faults::Byzantine>,
    /// This node's own push and pull encodings.
    pub compression: Option<crate::policy::compress::CompressionConfig>,
}

/// How to build a cluster.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    pub nodes: usize,
    /// Shared config; `listen` is forced to loopback TCP on an ephemeral port
    /// and `min_peers` to `nodes`; `training.threads`, when unset, becomes
    /// each node's share of the host's cores. A `checkpoint.dir` is the parent of one
    /// folder per node (`node0`, `node1`, ...).
    pub base: NodeConfig,
    pub overrides: Vec<NodeOverride>,
}

impl ClusterSpec {
    pub fn new(nodes: usize, base: NodeConfig) -> Self {
        Self { nodes, base, overrides: Vec::new() }
    }

    /// The config node `i` runs with (before bootstrap addresses are added).
    pub fn node_config(&self, i: usize) -> anyhow::Result<NodeConfig> {
        let mut c = self.base.clone();
        c.name = Some(format!("node{i}"));
        c.cluster.min_peers = self.nodes;
        c.network.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().context("loopback address")?];
        c.network.quic = false;
        c.network.discovery.mdns = false;
        // The nodes share this host: each gets its share of the cores.
        c.training.threads = Some(crate::ops::threads::resolve(c.training.threads, self.nodes));
        // One checkpoint folder per node, as on separate machines.
        if let Some(dir) = &self.base.checkpoint.dir {
            c.checkpoint.dir = Some(dir.join(format!("node{i}")));
        }
        if let Some(o) = self.overrides.get(i) {
            if let Some(b) = o.batch_size {
                c.training.batch_size = b;
            }
            if let Some(m) = o.memory_bytes {
                c.cluster.memory_bytes = m;
            }
            if let Some(a) = o.can_aggregate {
                c.cluster.can_aggregate = a;
            }
            if let Some(d) = o.fault_delay_ms {
                c.faults.delay_ms = d;
            }
            if let Some(s) = o.slowdown {
                c.faults.slowdown = s;
            }
            if let Some(m) = o.link_mbps {
                c.faults.link_mbps = m;
            }
            if let Some(k) = o.compression {
                c.compression = k;
            }
            if let Some(b) = o.byzantine {
                c.faults.byzantine = b;
            }
        }
        Ok(c)
    }
}

/// A running cluster.
#[derive(Debug)]
pub struct Cluster {
    pub nodes: Vec<RunningNode>,
}

impl Cluster {
    /// Start every node; node `i` dials nodes `0..i`, so the cluster is a
    /// full mesh of real TCP connections.
    pub async fn start(spec: &ClusterSpec) -> anyhow::Result<Self> {
        if spec.nodes == 0 {
            anyhow::bail!("a cluster needs at least one node");
        }
        let mut nodes: Vec<RunningNode> = Vec::with_capacity(spec.nodes);
        let mut addrs: Vec<Multiaddr> = Vec::new();
        for i in 0..spec.nodes {
            let mut cfg = spec.node_config(i)?;
            cfg.cluster.bootstrap = addrs.clone();
            let node = start(cfg, Keypair::generate_ed25519()).await.with_context(|| format!("starting node{i}"))?;
            let addr = node.listen.first().cloned().with_context(|| format!("node{i} has no listen address"))?;
            addrs.push(addr);
            nodes.push(node);
        }
        Ok(Self { nodes })
    }

    /// Start one more node mid-run (it joins the running training) with
    /// the config of node index `i` in `spec`; it dials every node still in
    /// the cluster. Returns its index in `nodes`.
    pub async fn add(&mut self, spec: &ClusterSpec, i: usize) -> anyhow::Result<usize> {
        let all: Vec<usize> = (0..self.nodes.len()).collect();
        self.add_via(spec, i, &all).await
    }

    /// [`Cluster::add`], but the new node dials only the nodes at `via`
    /// (indices in `nodes`); it learns of the others from them.
    pub async fn add_via(&mut self, spec: &ClusterSpec, i: usize, via: &[usize]) -> anyhow::Result<usize> {
        let mut cfg = spec.node_config(i)?;
        cfg.cluster.bootstrap = via.iter().filter_map(|&k| self.nodes.get(k)?.listen.first().cloned()).collect();
        anyhow::ensure!(!cfg.cluster.bootstrap.is_empty(), "no running node at {via:?} to bootstrap from");
        let node = start(cfg, Keypair::generate_ed25519()).await.with_context(|| format!("starting node{i}"))?;
        self.nodes.push(node);
        Ok(self.nodes.len() - 1)
    }

    /// Crash node `i` (no handoff, every connection closed) and drop it from
    /// the cluster; returns its name and peer id.
    pub async fn kill(&mut self, i: usize) -> anyhow::Result<(String, shoal_protocol::libp2p::PeerId)> {
        if i >= self.nodes.len() {
            anyhow::bail!("no node {i} to kill (the cluster has {})", self.nodes.len());
        }
        let node = self.nodes.remove(i);
        let out = (node.name.clone(), node.peer_id);
        node.kill().await;
        Ok(out)
    }

    /// Wait for every node to finish; the first failure is returned with
    /// the node's name.
    pub async fn wait(self) -> anyhow::Result<Vec<NodeReport>> {
        let mut reports = Vec::with_capacity(self.nodes.len());
        for n in self.nodes {
            let name = n.name.clone();
            let r =
                n.task.await.with_context(|| format!("{name} panicked"))?.with_context(|| format!("{name} failed"))?;
            reports.push(r);
        }
        Ok(reports)
    }
}
