//! `shoal node`: one node of a real deployment.

use std::net::IpAddr;

use crate::cmd::cli::NodeArgs;
use anyhow::Context;
use shoal_protocol::libp2p::multiaddr::Protocol;
use shoal_protocol::libp2p::{Multiaddr, PeerId};

use crate::config::{LocalStepsConfig, NodeConfig};
use crate::node::{load_identity, start};

/// One flag of `shoal node` and the one config path it sets (it wins over
/// the file and the profile). `docs/operations.md`, "Flags and the keys
/// they set", lists this table; a test holds the two together.
#[derive(Debug)]
pub struct Flag {
    pub flag: &'static str,
    pub path: &'static str,
    apply: fn(&NodeArgs, &mut NodeConfig),
}

/// Set `$field` to the flag's value when the flag was given.
macro_rules! set {
    ($field:expr, $val:expr) => {
        if let Some(v) = $val.clone() {
            $field = v;
        }
    };
}

/// A flag whose value, when given, replaces the one key it names.
macro_rules! plain {
    ($flag:literal, $path:literal, $($field:ident).+ = $arg:ident) => {
        Flag { flag: $flag, path: $path, apply: |a, c| set!(c.$($field).+, a.$arg) }
    };
}

/// Every flag of `shoal node` but `--config`, in `--help` order.
pub const FLAGS: &[Flag] = &[
    Flag { flag: "--profile", path: "profile", apply: |a, c| c.profile = a.profile.or(c.profile) },
    plain!("--run-id", "run_id", run_id = run_id),
    Flag { flag: "--name", path: "name", apply: |a, c| c.name = a.name.clone().or(c.name.take()) },
    Flag { flag: "--identity", path: "identity", apply: |a, c| c.identity = a.identity.clone().or(c.identity.take()) },
    Flag {
        flag: "--listen",
        path: "network.listen",
        apply: |a, c| {
            if !a.listen.is_empty() {
                c.network.listen = a.listen.clone();
            }
        },
    },
    Flag {
        flag: "--bootstrap",
        path: "cluster.bootstrap",
        apply: |a, c| {
            if !a.bootstrap.is_empty() {
                c.cluster.bootstrap = a.bootstrap.clone();
            }
        },
    },
    Flag { flag: "--no-mdns", path: "network.discovery.mdns", apply: |a, c| c.network.discovery.mdns &= !a.no_mdns },
    Flag {
        flag: "--relay",
        path: "network.discovery.relays",
        apply: |a, c| {
            if !a.relay.is_empty() {
                let d = &mut c.network.discovery;
                d.relays = a.relay.clone();
                // A relay is of no use without being its client, and a
                // relayed connection is upgraded to a direct one when it can.
                d.relay_client = true;
                d.dcutr = true;
            }
        },
    },
    Flag {
        flag: "--relay-server",
        path: "network.discovery.relay_server",
        apply: |a, c| c.network.discovery.relay_server |= a.relay_server,
    },
    plain!("--model", "training.model", training.model = model),
    plain!("--dataset", "training.dataset", training.dataset = dataset),
    Flag {
        flag: "--data-dir",
        path: "training.data_dir",
        apply: |a, c| c.training.data_dir = a.data_dir.clone().or(c.training.data_dir.take()),
    },
    Flag {
        flag: "--tokenizer",
        path: "training.tokenizer",
        apply: |a, c| c.training.tokenizer = a.tokenizer.clone().or(c.training.tokenizer.take()),
    },
    plain!("--batch-size", "training.batch_size", training.batch_size = batch_size),
    plain!("--optimizer", "training.optimizer", training.optimizer = optimizer),
    Flag { flag: "--lr", path: "training.lr", apply: |a, c| c.training.lr = a.lr.or(c.training.lr) },
    plain!("--lr-decay", "training.lr_decay", training.lr_decay = lr_decay),
    plain!("--warmup-steps", "training.warmup_steps", training.warmup_steps = warmup_steps),
    Flag {
        flag: "--weight-decay",
        path: "training.weight_decay",
        apply: |a, c| c.training.weight_decay = a.weight_decay.or(c.training.weight_decay),
    },
    plain!("--seed", "training.seed", training.seed = seed),
    plain!("--steps", "training.steps", training.steps = steps),
    plain!("--device", "training.device", training.device = device),
    plain!("--dtype", "training.dtype", training.dtype = dtype),
    plain!("--mode", "cluster.mode", cluster.mode = mode),
    plain!("--sync", "sync.policy", sync.policy = sync),
    plain!("--min-peers", "cluster.min_peers", cluster.min_peers = min_peers),
    plain!("--shards", "cluster.shards", cluster.shards = shards),
    plain!("--can-aggregate", "cluster.can_aggregate", cluster.can_aggregate = can_aggregate),
    plain!("--heartbeat-ms", "cluster.heartbeat_ms", cluster.heartbeat_ms = heartbeat_ms),
    plain!("--failure-timeout-ms", "cluster.failure_timeout_ms", cluster.failure_timeout_ms = failure_timeout_ms),
    plain!("--start-timeout-ms", "cluster.start_timeout_ms", cluster.start_timeout_ms = start_timeout_ms),
    plain!("--elastic", "roles.elastic", roles.elastic = elastic),
    plain!("--aggregators", "roles.aggregators", roles.aggregators = aggregators),
    plain!("--start-aggregators", "roles.start_aggregators", roles.start_aggregators = start_aggregators),
    plain!("--replicas", "roles.replicas", roles.replicas = replicas),
    plain!("--replica-every", "roles.replica_every", roles.replica_every = replica_every),
    plain!("--fault-delay-ms", "faults.delay_ms", faults.delay_ms = fault_delay_ms),
    plain!("--slowdown", "faults.slowdown", faults.slowdown = slowdown),
    plain!("--fault-serve-mbps", "faults.serve_mbps", faults.serve_mbps = fault_serve_mbps),
    plain!("--overlap", "sync.overlap", sync.overlap = overlap),
    Flag {
        flag: "--local-steps",
        path: "local_steps.steps",
        apply: |a, c| {
            if let Some(h) = a.local_steps {
                // The file's outer optimizer stays; 1 means no local steps.
                let outer = c.local_steps.unwrap_or(LocalStepsConfig::every(h));
                c.local_steps = LocalStepsConfig::per_round(h).map(|_| LocalStepsConfig { steps: h, ..outer });
            }
        },
    },
    plain!("--link-mbps", "faults.link_mbps", faults.link_mbps = link_mbps),
    plain!("--link-latency-ms", "faults.link_latency_ms", faults.link_latency_ms = link_latency_ms),
    plain!("--aggregation", "aggregation.rule", aggregation.rule = aggregation),
    Flag {
        flag: "--norm-check",
        path: "aggregation.norm_check",
        apply: |a, c| c.aggregation.norm_check = a.norm_check.or(c.aggregation.norm_check),
    },
    plain!("--norm-floor", "aggregation.norm_floor", aggregation.norm_floor = norm_floor),
    plain!("--fault-byzantine", "faults.byzantine", faults.byzantine = fault_byzantine),
    plain!("--compress-push", "compression.push", compression.push = compress_push),
    plain!("--compress-pull", "compression.pull", compression.pull = compress_pull),
    plain!("--http", "http.listen", http.listen = http),
    Flag { flag: "--control", path: "http.control", apply: |a, c| c.http.control |= a.control },
    Flag { flag: "--output", path: "output", apply: |a, c| c.output = a.output.clone().or(c.output.take()) },
    Flag {
        flag: "--output-hf",
        path: "output_hf",
        apply: |a, c| c.output_hf = a.output_hf.clone().or(c.output_hf.take()),
    },
    Flag {
        flag: "--checkpoint-dir",
        path: "checkpoint.dir",
        apply: |a, c| c.checkpoint.dir = a.checkpoint_dir.clone().or(c.checkpoint.dir.take()),
    },
];

/// `shoal node`'s arguments with each flag's default in its help, read from
/// `NodeConfig::default()` at the key the flag sets (see [`FLAGS`]), so the
/// help cannot drift from the code. A switch (off unless given) and a help
/// line that already names its default are left as they are.
pub fn with_defaults(mut node: clap::Command) -> clap::Command {
    let defaults = toml::Table::try_from(NodeConfig::default()).unwrap_or_default();
    for f in FLAGS {
        let long = f.flag.trim_start_matches("--");
        let Some(arg) = node.get_arguments().find(|a| a.get_long() == Some(long)) else {
            continue;
        };
        let help = arg.get_help().map(ToString::to_string).unwrap_or_default();
        if !arg.get_action().takes_values() || help.contains("default") {
            continue;
        }
        let id = arg.get_id().clone();
        let shown = default_at(&defaults, f.path);
        node = node.mut_arg(id, |a| {
            let long_help = a.get_long_help().map(ToString::to_string);
            let a = a.help(format!("{help} [default: {shown}]"));
            match long_help {
                Some(l) => a.long_help(format!("{l}\n\n[default: {shown}]")),
                None => a,
            }
        });
    }
    node
}

/// The value at a dotted key of a config written as TOML, as a person
/// writes it on the command line (`none` where the key is unset).
fn default_at(table: &toml::Table, path: &str) -> String {
    let mut at: Option<&toml::Value> = None;
    let mut current = Some(table);
    for part in path.split('.') {
        at = current.and_then(|t| t.get(part));
        current = at.and_then(toml::Value::as_table);
    }
    fn show(v: &toml::Value) -> String {
        match v {
            toml::Value::String(s) => s.clone(),
            toml::Value::Array(items) if items.is_empty() => "none".into(),
            toml::Value::Array(items) => items.iter().map(show).collect::<Vec<_>>().join(", "),
            other => other.to_string(),
        }
    }
    at.map(show).unwrap_or_else(|| "none".into())
}

/// The addresses other machines can bootstrap from. A listener on an
/// unspecified address (`/ip4/0.0.0.0/tcp/7000`) serves every interface,
/// and libp2p reports them one at a time: each reported address of such a
/// listener stands for the same transport and port on every interface
/// (loopback and IPv6 link-local left out). A listener bound to one address
/// is shared as reported, unless it is loopback. A wildcard listener with
/// a fixed port is shared even before libp2p reports it (as `/p2p/me`).
fn to_share(reported: &[Multiaddr], configured: &[Multiaddr], interfaces: &[IpAddr], me: PeerId) -> Vec<Multiaddr> {
    fn split(a: &Multiaddr) -> Option<(IpAddr, Vec<Protocol<'static>>)> {
        let mut it = a.iter();
        let ip = match it.next()? {
            Protocol::Ip4(ip) => IpAddr::V4(ip),
            Protocol::Ip6(ip) => IpAddr::V6(ip),
            _ => return None,
        };
        Some((ip, it.map(|p| p.acquire()).collect()))
    }
    // The transport: TCP or UDP (QUIC), whatever the port.
    fn kind(rest: &[Protocol<'static>]) -> Option<std::mem::Discriminant<Protocol<'static>>> {
        rest.first().map(std::mem::discriminant)
    }
    let reachable = |ip: &IpAddr| match ip {
        IpAddr::V4(v4) => !v4.is_loopback() && !v4.is_unspecified(),
        IpAddr::V6(v6) => !v6.is_loopback() && !v6.is_unspecified() && (v6.segments()[0] & 0xffc0) != 0xfe80,
    };
    let fixed = configured.iter().filter_map(split).filter(|(ip, rest)| {
        ip.is_unspecified() && matches!(rest.first(), Some(Protocol::Tcp(p) | Protocol::Udp(p)) if *p != 0)
    });
    let fixed = fixed.map(|(ip, mut rest)| {
        rest.push(Protocol::P2p(me));
        (ip, rest)
    });
    let mut out: Vec<Multiaddr> = Vec::new();
    for (ip, rest) in reported.iter().filter_map(split).chain(fixed) {
        let wildcard = configured
            .iter()
            .filter_map(split)
            .any(|(c, crest)| c.is_unspecified() && c.is_ipv4() == ip.is_ipv4() && kind(&crest) == kind(&rest));
        let ips: Vec<IpAddr> = if wildcard {
            interfaces.iter().copied().filter(|i| i.is_ipv4() == ip.is_ipv4()).collect()
        } else {
            vec![ip]
        };
        for i in ips.into_iter().filter(reachable) {
            let mut a = Multiaddr::empty().with(match i {
                IpAddr::V4(v4) => Protocol::Ip4(v4),
                IpAddr::V6(v6) => Protocol::Ip6(v6),
            });
            for p in &rest {
                a.push(p.clone());
            }
            if !out.contains(&a) {
                out.push(a);
            }
        }
    }
    out
}

/// The file (or the defaults) under its profile, then every flag given on
/// top (see [`FLAGS`]), checked.
pub fn resolve(args: &NodeArgs) -> anyhow::Result<NodeConfig> {
    let mut c = NodeConfig::load(args.config.as_deref(), args.profile)?;
    for flag in FLAGS {
        (flag.apply)(args, &mut c);
    }
    c.validate()?;
    Ok(c)
}

/// Print a line of the command's own output. A closed stdout (the reader
/// went away) must not bring the node down, so errors are ignored.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

pub fn run(args: NodeArgs) -> anyhow::Result<()> {
    let config = resolve(&args)?;
    if args.print_config {
        say!("{}", toml::to_string(&config).context("writing the config as TOML")?);
        return Ok(());
    }
    let open: Vec<String> = config.network.open_listeners().iter().map(ToString::to_string).collect();
    let config_listen = config.network.listen.clone();
    let keypair = load_identity(config.identity.as_deref())?;
    // This process is one node: it gets `training.threads`, or every core.
    let threads = crate::ops::threads::resolve(config.training.threads, 1);
    crate::ops::threads::configure_process(threads);
    let rt = crate::ops::threads::runtime(threads)?;
    rt.block_on(async move {
        let node = start(config, keypair).await?;
        say!("peer id {}", node.peer_id);
        for a in &node.listen {
            say!("listening on {a}");
        }
        // A listener on 0.0.0.0 may have reported only 127.0.0.1 so far:
        // name the addresses another machine can dial.
        let interfaces: Vec<std::net::IpAddr> =
            if_addrs::get_if_addrs().unwrap_or_default().iter().map(if_addrs::Interface::ip).collect();
        for a in to_share(&node.listen, &config_listen, &interfaces, node.peer_id) {
            say!("other machines bootstrap from {a}");
        }
        if let Some(h) = node.http {
            say!("status on http://{h}/");
        }
        if !open.is_empty() {
            say!(
                "warning: any peer may join: {} is reachable beyond this machine and neither \
                 network.admission.psk nor network.admission.allowlist is set (see docs/operations.md#admission-control)",
                open.join(", ")
            );
        }
        let leave = node.leave_switch();
        let mut task = node.task;
        let report = tokio::select! {
            r = &mut task => r??,
            _ = shutdown_signal() => {
                say!("leaving cleanly: finishing the current step and handing off shards (signal again to stop at once)");
                leave.leave();
                tokio::select! {
                    r = &mut task => r??,
                    _ = shutdown_signal() => {
                        task.abort();
                        anyhow::bail!("stopped at once by a second signal; shards were not handed off");
                    }
                }
            }
        };
        if report.left {
            say!(
                "{}: left after {} steps, {}",
                report.name,
                report.steps,
                report.headline()
            );
        } else {
            say!(
                "{}: finished {} steps, {}, owned shards {:?}",
                report.name,
                report.steps,
                report.headline(),
                report.owned_shards
            );
        }
        Ok(())
    })
}

/// Ctrl-C, or SIGTERM on Unix (what `docker stop` and `kill` send).
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use clap::{CommandFactory, Parser};

    use super::*;
    use crate::cmd::cli::{Cli, Command};

    /// `shoal node ARGS...` parsed as the binary parses it.
    fn node_args(args: &[&str]) -> anyhow::Result<NodeArgs> {
        let cli = Cli::try_parse_from(["shoal", "node"].iter().chain(args))?;
        match cli.command {
            Command::Node(args) => Ok(*args),
            _ => anyhow::bail!("not the node command"),
        }
    }

    #[test]
    fn a_wildcard_listener_is_shared_on_every_interface_and_loopback_never() -> anyhow::Result<()> {
        let id = "/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN";
        let reported: Vec<Multiaddr> = vec![
            format!("/ip4/127.0.0.1/tcp/7000{id}").parse()?,
            format!("/ip4/127.0.0.1/udp/7001/quic-v1{id}").parse()?,
        ];
        let ifaces: Vec<IpAddr> =
            vec!["127.0.0.1".parse()?, "10.0.0.5".parse()?, "192.168.1.9".parse()?, "fe80::1".parse()?];
        // Both listeners on 0.0.0.0: every interface, for each transport.
        let any: Vec<Multiaddr> = vec!["/ip4/0.0.0.0/tcp/7000".parse()?, "/ip4/0.0.0.0/udp/7001/quic-v1".parse()?];
        let me: PeerId = id.trim_start_matches("/p2p/").parse()?;
        let shown: Vec<String> = to_share(&reported, &any, &ifaces, me).iter().map(ToString::to_string).collect();
        assert_eq!(
            shown,
            [
                format!("/ip4/10.0.0.5/tcp/7000{id}"),
                format!("/ip4/192.168.1.9/tcp/7000{id}"),
                format!("/ip4/10.0.0.5/udp/7001/quic-v1{id}"),
                format!("/ip4/192.168.1.9/udp/7001/quic-v1{id}"),
            ]
        );
        // TCP on loopback only: nothing to share for it, and QUIC (still
        // on 0.0.0.0) is shared.
        let tcp_local: Vec<Multiaddr> =
            vec!["/ip4/127.0.0.1/tcp/7000".parse()?, "/ip4/0.0.0.0/udp/7001/quic-v1".parse()?];
        let shown: Vec<String> = to_share(&reported, &tcp_local, &ifaces, me).iter().map(ToString::to_string).collect();
        assert_eq!(
            shown,
            [format!("/ip4/10.0.0.5/udp/7001/quic-v1{id}"), format!("/ip4/192.168.1.9/udp/7001/quic-v1{id}")]
        );
        // A listener bound to one address is shared as it is.
        let one: Vec<Multiaddr> = vec![format!("/ip4/10.0.0.5/tcp/7000{id}").parse()?];
        assert_eq!(to_share(&one, &["/ip4/10.0.0.5/tcp/7000".parse()?], &ifaces, me), one);
        // QUIC on a fixed port not reported yet (libp2p answered with the
        // first address it had): shared all the same.
        let shown: Vec<String> = to_share(&reported[..1], &any, &ifaces, me).iter().map(ToString::to_string).collect();
        assert_eq!(shown.len(), 4, "{shown:?}");
        assert!(shown.contains(&format!("/ip4/10.0.0.5/udp/7001/quic-v1{id}")), "{shown:?}");
        // A free port (0) is known only once reported.
        let free: Vec<Multiaddr> = vec!["/ip4/0.0.0.0/udp/0/quic-v1".parse()?];
        assert!(to_share(&[], &free, &ifaces, me).is_empty());
        Ok(())
    }

    #[test]
    fn every_flag_of_shoal_node_is_in_the_table_once() {
        let cmd = Cli::command();
        let node = cmd.find_subcommand("node").cloned().unwrap_or_default();
        let clap: BTreeSet<String> = node
            .get_arguments()
            .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
            .filter(|l| !["--config", "--print-config", "--help"].contains(&l.as_str()))
            .collect();
        let table: Vec<&str> = FLAGS.iter().map(|f| f.flag).collect();
        let unique: BTreeSet<String> = table.iter().map(|f| f.to_string()).collect();
        assert_eq!(unique.len(), table.len(), "a flag is in FLAGS twice");
        assert_eq!(unique, clap, "FLAGS and the flags of `shoal node` differ");
    }

    #[test]
    fn the_docs_list_exactly_the_flags_and_their_keys() {
        let docs = include_str!("../../../docs/operations.md");
        let section = docs.split_once("### `shoal node` flags").map(|(_, r)| r).unwrap_or_default();
        let section = section.split("\n#").next().unwrap_or_default();
        let documented: BTreeSet<(String, String)> = section
            .lines()
            .filter_map(|l| {
                // `\|` is a bar inside a cell (`--model mlp\|cnn`).
                let l = l.replace("\\|", "/");
                let cells: Vec<&str> = l.split('|').map(str::trim).collect();
                let flag = cells.get(1)?.strip_prefix("`--")?.split([' ', '`']).next()?;
                let path = cells.get(2)?.strip_prefix('`')?.split(['`', ' ']).next()?;
                Some((format!("--{flag}"), path.to_string()))
            })
            .collect();
        let code: BTreeSet<(String, String)> = FLAGS.iter().map(|f| (f.flag.to_string(), f.path.to_string())).collect();
        assert_eq!(documented, code, "docs/operations.md's flags table differs from FLAGS");
    }

    #[test]
    fn each_flag_sets_the_key_it_names() -> anyhow::Result<()> {
        let c = resolve(&node_args(&[
            "--sync",
            "ssp:2",
            "--overlap",
            "true",
            "--slowdown",
            "2",
            "--fault-delay-ms",
            "7",
            "--link-mbps",
            "10",
            "--aggregators",
            "3",
            "--replicas",
            "1",
            "--compress-push",
            "int8",
            "--norm-check",
            "0",
            "--min-peers",
            "2",
        ])?)?;
        assert_eq!(c.sync.policy, crate::policy::sync::SyncPolicy::Ssp { staleness: 2 });
        assert!(c.sync.overlap);
        assert_eq!((c.faults.slowdown, c.faults.delay_ms, c.faults.link_mbps), (2.0, 7, 10.0));
        assert_eq!(c.roles.aggregators, crate::config::Aggregators::Fixed(3));
        assert_eq!(c.roles.replicas, 1);
        assert_eq!(c.compression.push, crate::policy::compress::PushCompression::Int8);
        assert_eq!(c.aggregation.norm_check, Some(0.0));
        assert_eq!(c.cluster.min_peers, 2);
        // --local-steps: H > 1 is a [local_steps] table, 1 is none.
        let c = resolve(&node_args(&["--local-steps", "8"])?)?;
        assert_eq!(c.local_steps, Some(LocalStepsConfig::every(8)));
        let c = resolve(&node_args(&["--local-steps", "1"])?)?;
        assert_eq!(c.local_steps, None);
        // No flag: the defaults, untouched.
        assert_eq!(resolve(&node_args(&[])?)?, NodeConfig::default());
        Ok(())
    }

    #[test]
    fn a_flag_wins_over_the_file_and_keeps_the_rest_of_its_table() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("node.toml");
        std::fs::write(&path, "[local_steps]\nsteps = 4\nouter_lr = 0.5\n[faults]\nslowdown = 3.0\n")?;
        let file = path.to_string_lossy().to_string();
        let c = resolve(&node_args(&["--config", &file, "--local-steps", "10", "--link-mbps", "5"])?)?;
        assert_eq!(c.local_steps.map(|l| (l.steps, l.outer_lr)), Some((10, 0.5)));
        assert_eq!((c.faults.slowdown, c.faults.link_mbps), (3.0, 5.0));
        Ok(())
    }

    #[test]
    fn the_printed_config_reads_back_as_the_same_config() -> anyhow::Result<()> {
        let c = resolve(&node_args(&[
            "--sync",
            "asp",
            "--local-steps",
            "1",
            "--bootstrap",
            "/ip4/127.0.0.1/tcp/7000/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN",
        ])?)?;
        let text = toml::to_string(&c)?;
        assert_eq!(NodeConfig::from_toml(&text, None)?, c, "{text}");
        for table in ["[cluster]", "[sync]", "[roles]", "[aggregation]", "[faults]", "[network]"] {
            assert!(text.contains(table), "{table} missing from\n{text}");
        }
        Ok(())
    }
}
