//! Real shaped links for the process backend (`network = "netns"`): each
//! node in a network namespace of its own, joined to the others by a veth
//! pair into a bridge in a hub namespace the launcher makes, with the
//! node's `link_mbps` enforced by the kernel (`tc` `tbf` on both ends of
//! its veth: the node's end shapes what it sends, the bridge's end what it
//! receives). Latency stays with Shoal's own emulation
//! (`faults.link_latency_ms`): these machines have no `sch_netem`.
//!
//! Nothing here touches the host's own interfaces: the namespaces, the
//! bridge and every veth are made here and go when the launcher is
//! dropped, IPv6 is off on all of them (so the kernel sends no neighbour
//! discovery of its own), and the nodes' mDNS stays off (the scenario's
//! discovery is bootstrap).
//! Needs root and iproute2.

use std::process::Command;

use anyhow::{bail, Context};

/// The nodes' subnet: `10.233.N.0/24`, N from the launcher's pid, so two
/// launchers on one host rarely meet (and a clash fails loudly at
/// `ip addr add`, not silently).
fn subnet(pid: u32) -> u8 {
    (pid % 250) as u8
}

fn run(program: &str, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("{program} {}: cannot run it", args.join(" ")))?;
    if !out.status.success() {
        bail!("{program} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

fn ip(args: &[&str]) -> anyhow::Result<()> {
    run("ip", args)
}

/// The `tbf` arguments for `mbps` each way: the rate, a burst of at least
/// one 10 ms tick of it (and 16 KiB), and 200 ms of queue.
fn tbf_args(mbps: f64) -> Vec<String> {
    let bytes_per_sec = mbps * 1e6 / 8.0;
    let burst = (bytes_per_sec / 100.0).max(16_384.0).round() as u64;
    vec![
        "root".into(),
        "tbf".into(),
        "rate".into(),
        format!("{}kbit", (mbps * 1000.0).round() as u64),
        "burst".into(),
        burst.to_string(),
        "latency".into(),
        "200ms".into(),
    ]
}

/// The hub (a namespace holding the bridge, joined to the host by one
/// veth), and each node's namespace and veth as they are made.
#[derive(Debug)]
pub struct Netns {
    /// `sn<pid>`: the host's end of the veth to the hub.
    host_end: String,
    /// `shoal-<pid>-hub`: the bridge's namespace; `shoal-<pid>-n<i>`: node i's.
    hub: String,
    ns_prefix: String,
    subnet: u8,
    /// Nodes whose namespace exists.
    made: Vec<usize>,
}

impl Netns {
    /// Make the hub: a namespace with a bridge `br0`, joined to the host by
    /// a veth whose host end carries the launcher's own address (it reads
    /// each node's `/status` over it). The bridge lives in the hub, not on
    /// the host, so the host's firewall (Docker's `FORWARD DROP`, say)
    /// never sees the nodes' traffic. An error says what failed: not root,
    /// or no iproute2.
    pub fn new() -> anyhow::Result<Self> {
        let pid = std::process::id();
        let n = Netns {
            host_end: format!("sn{pid}"),
            hub: format!("shoal-{pid}-hub"),
            ns_prefix: format!("shoal-{pid}-n"),
            subnet: subnet(pid),
            made: Vec::new(),
        };
        ip(&["netns", "add", &n.hub])
            .context("network = \"netns\" needs root and iproute2 (it makes a namespace per node and a bridge)")?;
        // From here on, drop removes what was made.
        n.quiet(&n.hub)?;
        ip(&["-n", &n.hub, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &n.hub, "link", "set", "br0", "up"])?;
        ip(&["link", "add", &n.host_end, "type", "veth", "peer", "name", "uplink", "netns", &n.hub])?;
        run("sysctl", &["-qw", &format!("net.ipv6.conf.{}.disable_ipv6=1", n.host_end)])?;
        ip(&["-n", &n.hub, "link", "set", "uplink", "master", "br0"])?;
        ip(&["-n", &n.hub, "link", "set", "uplink", "up"])?;
        ip(&["addr", "add", &format!("10.233.{}.254/24", n.subnet), "dev", &n.host_end])?;
        ip(&["link", "set", &n.host_end, "up"])?;
        Ok(n)
    }

    /// IPv6 off (no neighbour discovery of the kernel's own) and loopback
    /// up in namespace `ns`.
    fn quiet(&self, ns: &str) -> anyhow::Result<()> {
        for key in ["all", "default"] {
            ip(&["netns", "exec", ns, "sysctl", "-qw", &format!("net.ipv6.conf.{key}.disable_ipv6=1")])?;
        }
        ip(&["-n", ns, "link", "set", "lo", "up"])
    }

    /// Node `i`'s namespace.
    pub fn namespace(&self, i: usize) -> String {
        format!("{}{i}", self.ns_prefix)
    }

    /// Node `i`'s address.
    pub fn address(&self, i: usize) -> anyhow::Result<String> {
        if i >= 250 {
            bail!("network = \"netns\" takes at most 250 nodes (node {i})");
        }
        Ok(format!("10.233.{}.{}", self.subnet, i + 1))
    }

    /// Make node `i`'s namespace and its veth into the hub's bridge, shaped
    /// to `mbps` each way (none: unshaped), unless they exist (a restarted
    /// node keeps its own).
    pub fn ensure(&mut self, i: usize, mbps: Option<f64>) -> anyhow::Result<()> {
        if self.made.contains(&i) {
            return Ok(());
        }
        let (ns, addr) = (self.namespace(i), self.address(i)?);
        let hub_end = format!("n{i}");
        ip(&["netns", "add", &ns])?;
        self.made.push(i);
        self.quiet(&ns)?;
        ip(&["-n", &self.hub, "link", "add", &hub_end, "type", "veth", "peer", "name", "eth0", "netns", &ns])?;
        ip(&["-n", &self.hub, "link", "set", &hub_end, "master", "br0"])?;
        ip(&["-n", &self.hub, "link", "set", &hub_end, "up"])?;
        ip(&["-n", &ns, "addr", "add", &format!("{addr}/24"), "dev", "eth0"])?;
        ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
        if let Some(mbps) = mbps {
            // What the node sends queues on its own end; what it receives
            // on the hub's.
            let tbf = tbf_args(mbps);
            for (netns, dev) in [(ns.as_str(), "eth0"), (self.hub.as_str(), hub_end.as_str())] {
                let mut args = vec!["netns", "exec", netns, "tc", "qdisc", "add", "dev", dev];
                args.extend(tbf.iter().map(String::as_str));
                ip(&args)?;
            }
        }
        Ok(())
    }

    /// `program ARGS` inside node `i`'s namespace (`ip netns exec` execs
    /// it: the child's pid is the node's).
    pub fn command(&self, i: usize, program: &std::path::Path) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.namespace(i)]).arg(program);
        cmd
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // A namespace takes its ends of the veths with it, and each pair
        // goes: the nodes', then the hub's (and the host's end with it).
        for &i in &self.made {
            let _ = ip(&["netns", "del", &self.namespace(i)]);
        }
        let _ = ip(&["netns", "del", &self.hub]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tbf_bursts_cover_a_tick_of_the_rate() {
        let a = tbf_args(100.0);
        assert_eq!(a[3], "100000kbit");
        assert_eq!(a[5], "125000", "100 Mbit/s: 12.5 MB/s, 10 ms of it");
        assert_eq!(tbf_args(1.0)[5], "16384", "at least 16 KiB");
        assert_eq!(tbf_args(20.0)[3], "20000kbit");
    }
}
