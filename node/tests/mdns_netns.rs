//! mDNS for real, inside network namespaces this test makes: two namespaces
//! joined by a veth pair, IPv6 off in both so that the kernel itself sends
//! nothing, and nothing touches the host's own interfaces.
//! - Two nodes listening on `0.0.0.0`, with no bootstrap address, find each
//!   other by mDNS alone and train to the end.
//! - A node bound to loopback, with mDNS on in its config, sends not one
//!   packet on its namespace's veth while a peer next door multicasts: it
//!   never multicasts where it does not listen.
//!
//! Needs root and `ip` (iproute2). Elsewhere each test says it skipped,
//! unless `SHOAL_REQUIRE_NETNS` is set (`.ci/run` sets it when it runs as
//! root).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Two namespaces joined by a veth pair (`va` in `a`, `vb` in `b`),
/// removed on drop.
struct Pair {
    a: String,
    b: String,
}

fn ip(args: &[&str]) -> Result<Output, String> {
    let o = Command::new("ip").args(args).output().map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if !o.status.success() {
        return Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&o.stderr).trim()));
    }
    Ok(o)
}

impl Pair {
    /// Make the pair, or say why it cannot be made here.
    fn new(tag: &str) -> Result<Pair, String> {
        let base = format!("shoal-{tag}-{}", std::process::id());
        let pair = Pair { a: format!("{base}-a"), b: format!("{base}-b") };
        for ns in [&pair.a, &pair.b] {
            ip(&["netns", "add", ns])?;
            for key in ["all", "default"] {
                ip(&["netns", "exec", ns, "sysctl", "-qw", &format!("net.ipv6.conf.{key}.disable_ipv6=1")])?;
            }
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        ip(&["link", "add", "va", "netns", &pair.a, "type", "veth", "peer", "name", "vb", "netns", &pair.b])?;
        for (ns, dev, addr) in [(&pair.a, "va", "10.231.0.1/24"), (&pair.b, "vb", "10.231.0.2/24")] {
            ip(&["-n", ns, "addr", "add", addr, "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
        }
        Ok(pair)
    }

    /// Packets sent on `dev` in namespace `ns` so far.
    fn tx_packets(ns: &str, dev: &str) -> u64 {
        let path = format!("/sys/class/net/{dev}/statistics/tx_packets");
        let o = ip(&["netns", "exec", ns, "cat", &path]).unwrap_or_else(|e| panic!("{e}"));
        String::from_utf8_lossy(&o.stdout).trim().parse().unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    /// `shoal node ARGS` inside namespace `ns`, stdout and stderr piped.
    fn node(ns: &str, args: &[&str]) -> Child {
        Command::new("ip")
            .args(["netns", "exec", ns, env!("CARGO_BIN_EXE_shoal"), "node", "--http", "off"])
            .args(args)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{e}"))
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth end in it, and its peer.
        for ns in [&self.a, &self.b] {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

/// The pair, or `None` after saying why the test skips.
fn pair(tag: &str) -> Option<Pair> {
    match Pair::new(tag) {
        Ok(p) => Some(p),
        Err(e) => {
            assert!(std::env::var_os("SHOAL_REQUIRE_NETNS").is_none(), "SHOAL_REQUIRE_NETNS is set, but: {e}");
            eprintln!("skipped: network namespaces need root and iproute2 ({e})");
            None
        }
    }
}

/// Wait for `child` to exit, killing it after `limit`; its stdout and stderr.
fn finish(mut child: Child, limit: Duration) -> (bool, String, String) {
    let read = |r: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            r.map(|r| BufReader::new(r).lines().map_while(Result::ok).collect::<Vec<_>>().join("\n"))
                .unwrap_or_default()
        })
    };
    let out = read(child.stdout.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>));
    let err = read(child.stderr.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>));
    let deadline = Instant::now() + limit;
    let ok = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status.success(),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break false;
            }
        }
    };
    (ok, out.join().unwrap_or_default(), err.join().unwrap_or_default())
}

#[test]
fn nodes_with_no_bootstrap_address_find_each_other_by_mdns_across_a_veth_and_train() {
    let Some(p) = pair("mdns") else { return };
    let args = ["--listen", "/ip4/0.0.0.0/tcp/0", "--min-peers", "2", "--run-id", "mdns-netns", "--steps", "60"];
    let wait = ["--start-timeout-ms", "60000"];
    let a = Pair::node(&p.a, &[&args[..], &wait[..]].concat());
    let b = Pair::node(&p.b, &[&args[..], &wait[..]].concat());
    let (a_ok, a_out, a_err) = finish(a, Duration::from_secs(180));
    let (b_ok, b_out, b_err) = finish(b, Duration::from_secs(30));
    for (name, ok, out, err) in [("a", a_ok, &a_out, &a_err), ("b", b_ok, &b_out, &b_err)] {
        assert!(ok && out.contains("finished 60 steps"), "node {name} did not train to the end:\n{out}\n{err}");
        assert!(!err.contains("mDNS is off"), "node {name}: {err}");
    }
    // Found by mDNS: the only discovery with no address to start from.
    assert!(a_err.contains("found by mDNS") || b_err.contains("found by mDNS"), "{a_err}\n{b_err}");
}

#[test]
fn a_node_bound_to_loopback_sends_nothing_on_the_namespace_s_other_interface() {
    let Some(p) = pair("lo") else { return };
    // Next door, a node on every interface: it multicasts its queries and
    // would answer any. It waits for a peer that never comes.
    let neighbour = ["--listen", "/ip4/0.0.0.0/tcp/0", "--min-peers", "2", "--start-timeout-ms", "4000"];
    let b = Pair::node(&p.b, &neighbour);
    let before = Pair::tx_packets(&p.a, "va");
    // mDNS is on in its config (the default); it listens on loopback only.
    let lo = ["--listen", "/ip4/127.0.0.1/tcp/0", "--min-peers", "2", "--start-timeout-ms", "3000"];
    let (_, out, err) = finish(Pair::node(&p.a, &lo), Duration::from_secs(60));
    let (_, b_out, b_err) = finish(b, Duration::from_secs(60));
    let sent = Pair::tx_packets(&p.a, "va") - before;
    assert!(out.contains("listening on /ip4/127.0.0.1/tcp/"), "the node did not start:\n{out}\n{err}");
    assert!(err.contains("mDNS is off: the node listens on loopback only"), "{err}");
    assert_eq!(sent, 0, "the loopback node sent {sent} packets on va:\n{out}\n{err}");
    // The count does see mDNS: the neighbour's queries went out on vb.
    let neighbour_sent = Pair::tx_packets(&p.b, "vb");
    assert!(neighbour_sent > 0, "no packet left vb, so the count proves nothing:\n{b_out}\n{b_err}");
}
