//! `shoal node`: one node of a real deployment.

use crate::cmd::cli::NodeArgs;
use crate::config::NodeConfig;
use crate::node::{load_identity, start};

/// Apply command-line overrides on top of the file (or defaults).
pub fn resolve(args: &NodeArgs) -> anyhow::Result<NodeConfig> {
    let mut c = NodeConfig::load(args.config.as_deref(), args.profile)?;
    macro_rules! set {
        ($field:expr, $val:expr) => {
            if let Some(v) = $val.clone() {
                $field = v;
            }
        };
    }
    set!(c.run_id, args.run_id);
    if args.name.is_some() {
        c.name = args.name.clone();
    }
    if args.identity.is_some() {
        c.identity = args.identity.clone();
    }
    if !args.listen.is_empty() {
        c.network.listen = args.listen.clone();
    }
    if !args.bootstrap.is_empty() {
        c.cluster.bootstrap = args.bootstrap.clone();
    }
    if args.no_mdns {
        c.network.discovery.mdns = false;
    }
    if !args.relay.is_empty() {
        let d = &mut c.network.discovery;
        d.relays = args.relay.clone();
        d.relay_client = true;
        d.dcutr = true;
    }
    if args.relay_server {
        c.network.discovery.relay_server = true;
    }
    let t = &mut c.training;
    set!(t.model, args.model);
    set!(t.dataset, args.dataset);
    if args.data_dir.is_some() {
        t.data_dir = args.data_dir.clone();
    }
    set!(t.batch_size, args.batch_size);
    set!(t.optimizer, args.optimizer);
    if args.lr.is_some() {
        t.lr = args.lr;
    }
    set!(t.lr_decay, args.lr_decay);
    set!(t.seed, args.seed);
    set!(t.steps, args.steps);
    set!(t.device, args.device);
    let k = &mut c.cluster;
    set!(k.mode, args.mode);
    set!(k.sync, args.sync);
    set!(k.min_peers, args.min_peers);
    set!(k.shards, args.shards);
    set!(k.can_aggregate, args.can_aggregate);
    set!(k.heartbeat_ms, args.heartbeat_ms);
    set!(k.failure_timeout_ms, args.failure_timeout_ms);
    set!(k.start_timeout_ms, args.start_timeout_ms);
    set!(k.elastic, args.elastic);
    set!(k.aggregators, args.aggregators);
    set!(k.start_aggregators, args.start_aggregators);
    set!(k.replicas, args.replicas);
    set!(k.replica_every, args.replica_every);
    set!(k.fault_delay_ms, args.fault_delay_ms);
    set!(k.slowdown, args.slowdown);
    set!(k.fault_serve_mbps, args.fault_serve_mbps);
    set!(k.overlap, args.overlap);
    set!(k.local_steps, args.local_steps);
    set!(k.link_mbps, args.link_mbps);
    set!(k.link_latency_ms, args.link_latency_ms);
    set!(k.aggregation, args.aggregation);
    if args.norm_check.is_some() {
        k.norm_check = args.norm_check;
    }
    set!(k.fault_byzantine, args.fault_byzantine);
    set!(k.compression.push, args.compress_push);
    set!(k.compression.pull, args.compress_pull);
    set!(c.http.listen, args.http);
    if args.checkpoint_dir.is_some() {
        c.checkpoint.dir = args.checkpoint_dir.clone();
    }
    if args.output.is_some() {
        c.output = args.output.clone();
    }
    if args.control {
        c.http.control = true;
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
    let open: Vec<String> = config.network.open_listeners().iter().map(ToString::to_string).collect();
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
