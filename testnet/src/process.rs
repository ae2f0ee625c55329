//! The process backend: `shoal testnet run scenario.toml`.
//!
//! Node `i` is a `shoal node` process named `node{i}` with its own config
//! file, identity file and log file in the report directory, listening on
//! loopback (libp2p on a free TCP port, HTTP with the control endpoint on
//! another). Node 0 starts first; the others bootstrap from it (added and
//! restarted nodes from any live node). Each node's data partition is its
//! rank in the roster.
//!
//! The timeline starts when every initial node has trained its first step.
//! Faults are applied through the nodes' control endpoints (slowdowns,
//! connection blocks for partitions, clean leave) and real process kills.
//! Every 500 ms the launcher reads each node's `/status`, redraws the live
//! table, and records the samples the report is made of; every
//! [`RESOURCE_EVERY_SECS`] it also reads each node process's resident
//! memory and open file descriptors from `/proc` (process backend on
//! Linux). It stops when
//! every node process has exited, or kills them all at the scenario's time
//! limit or when it is told to stop ([`RunOptions::stop`]: `shoal testnet
//! run` sets it on SIGINT or SIGTERM), and writes the report either way.
//!
//! What differs between backends (how a node is started, frozen and
//! killed, which address it is reached at, what is cleaned up) is a
//! `Launcher`, chosen once per run: `ProcessLauncher` (an aarch64 node runs
//! under qemu there) or `DockerLauncher`.

use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::checks;
use crate::http;
use crate::netns::Netns;
use crate::report::{
    vm_hwm_bytes, vm_rss_bytes, FaultRecord, NodeOutcome, ResourceSample, RoleRecord, Sample, Summary,
};
use crate::scenario::{Action, Arch, At, Discovery, Network, Scenario};

/// How to run a scenario.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub scenario: PathBuf,
    /// Where logs, configs and the report go (created).
    pub report_dir: PathBuf,
    /// The `shoal` binary to start nodes with.
    pub shoal_bin: PathBuf,
    /// The aarch64 `shoal` binary for nodes with `arch = "aarch64"`, run
    /// under user-mode emulation (`qemu-aarch64-static` or `qemu-aarch64`).
    pub aarch64_bin: Option<PathBuf>,
    /// Redraw the live table in place (a terminal) or print it every few seconds.
    pub live: Option<bool>,
    pub backend: Backend,
    /// Set (by a signal handler) to stop the run early: every node is
    /// killed, the report of what ran is written, and `run` returns an
    /// error. `None`: run to the end or the time limit.
    pub stop: Option<Arc<AtomicBool>>,
}

/// Where the nodes run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    /// `shoal node` processes on loopback.
    Processes,
    /// One container per node from `image` (see `testnet/docker/build-image.sh`)
    /// on a private network of its own (`docker network create --internal`).
    Docker { image: String },
}

/// Port every node listens on inside its container.
const DOCKER_P2P_PORT: u16 = 7000;
/// Port of every node's HTTP endpoint inside its container.
const DOCKER_HTTP_PORT: u16 = 8080;

/// What a node's stdout told us.
enum Line {
    PeerId(String),
    Listen(String),
    Http(SocketAddr),
    Finished(Finished),
}

/// A node's last line: how many steps it ran, whether it left, and a
/// classifier's test accuracy (a fraction) or a language model's test bits
/// per byte.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Finished {
    accuracy: Option<f64>,
    bits_per_byte: Option<f64>,
    steps: u64,
    left: bool,
}

/// Parse one line of `shoal node` stdout.
fn parse_line(line: &str) -> Option<Line> {
    if let Some(id) = line.strip_prefix("peer id ") {
        return Some(Line::PeerId(id.trim().to_string()));
    }
    if let Some(a) = line.strip_prefix("listening on ") {
        return Some(Line::Listen(a.trim().to_string()));
    }
    if let Some(h) = line.strip_prefix("status on http://") {
        return h.trim().trim_end_matches('/').parse().ok().map(Line::Http);
    }
    // "node1: finished 300 steps, test accuracy 96.38%, owned shards [..]"
    // "node1: left after 60 steps, test accuracy 95.00%"
    // "node1: finished 300 steps, test bits/byte 3.215, owned shards [..]" (a language model)
    let left = line.contains(": left after ");
    if line.contains(": finished ") || left {
        let steps = line.split_whitespace().find_map(|w| w.parse::<u64>().ok())?;
        let after = |key: &str, end: char| -> Option<f64> {
            line.split(key).nth(1)?.split(end).next()?.trim().parse::<f64>().ok()
        };
        let accuracy = after("test accuracy ", '%').map(|a| a / 100.0);
        let bits_per_byte = after("test bits/byte ", ',');
        accuracy.or(bits_per_byte)?;
        return Some(Line::Finished(Finished { accuracy, bits_per_byte, steps, left }));
    }
    None
}

/// How often the launcher samples each node process's memory and open files.
pub const RESOURCE_EVERY_SECS: f64 = 10.0;

/// Resident memory now and at its peak, and open file descriptors, of
/// process `pid`, from `/proc` (`None` off Linux or once the process is gone).
fn proc_resources(pid: u32) -> Option<(u64, u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
    Some((vm_rss_bytes(&status)?, vm_hwm_bytes(&status)?, fds))
}

struct NodeProc {
    index: usize,
    name: String,
    child: Option<Child>,
    lines: mpsc::Receiver<Line>,
    peer_id: Option<String>,
    listen: Option<String>,
    http: Option<SocketAddr>,
    exit: Option<String>,
    finished: Option<Finished>,
    last: Option<serde_json::Value>,
    last_role: Option<(String, Vec<u64>)>,
    /// Stopped by `freeze`: not polled (it cannot answer) until killed.
    frozen: bool,
}

impl NodeProc {
    fn alive(&self) -> bool {
        self.child.is_some()
    }

    /// The step and total of the node's last status.
    /// A number from the node's last `/status`.
    fn last_num(&self, key: &str) -> Option<f64> {
        self.last.as_ref()?.get(key)?.as_f64()
    }

    fn progress(&self) -> Option<(u64, u64)> {
        let s = self.last.as_ref()?;
        Some((s.get("step")?.as_u64()?, s.get("total_steps")?.as_u64()?))
    }

    /// `/ip4/.../tcp/N/p2p/<id>`: what others bootstrap from.
    fn p2p_addr(&self) -> Option<String> {
        let (listen, id) = (self.listen.as_ref()?, self.peer_id.as_ref()?);
        // `shoal node` prints its listen addresses with the /p2p part already.
        Some(if listen.contains("/p2p/") { listen.clone() } else { format!("{listen}/p2p/{id}") })
    }

    fn drain_lines(&mut self) {
        while let Ok(l) = self.lines.try_recv() {
            match l {
                Line::PeerId(p) => self.peer_id = Some(p),
                Line::Listen(a) => {
                    if self.listen.is_none() {
                        self.listen = Some(a);
                    }
                }
                Line::Http(h) => self.http = Some(h),
                Line::Finished(f) => self.finished = Some(f),
            }
        }
    }
}

/// Whether node `n` may still be training, as far as the launcher knows:
/// running, no final line yet, and its last status short of its steps.
fn still_training(n: &NodeProc) -> bool {
    n.alive() && n.finished.is_none() && n.progress().is_none_or(|(step, total)| step < total)
}

/// How a node that is not training stands, for a missed event's message.
fn training_state(n: &NodeProc) -> String {
    match (n.alive(), n.finished, n.progress()) {
        (false, _, _) => format!("it is not running: {}", n.exit.as_deref().unwrap_or("stopped")),
        (true, Some(Finished { steps, left: true, .. }), _) => format!("it left after {steps} steps"),
        (true, Some(Finished { steps, left: false, .. }), _) => format!("it finished its {steps} steps"),
        (true, None, Some((step, total))) => format!("it is at step {step} of {total}"),
        (true, None, None) => "no status yet".into(),
    }
}

/// A running testnet: the scenario, its nodes, and the launcher of the
/// backend they run on.
struct Testnet<'a> {
    scenario: &'a Scenario,
    opts: &'a RunOptions,
    launcher: Box<dyn Launcher>,
    nodes: Vec<NodeProc>,
    begun: Instant,
}

const HTTP_TIMEOUT: Duration = Duration::from_secs(2);
const START_TIMEOUT: Duration = Duration::from_secs(60);
const POLL: Duration = Duration::from_millis(500);
/// The pause between polls grows by this much per live node: the pages are
/// read at once, so without it 64 nodes would each answer twice a second
/// (read in turn, a poll of 64 took seconds), and every answer takes a
/// node's CPU from its training.
const POLL_PER_NODE: Duration = Duration::from_millis(25);
/// Bootstrap addresses a node is started with, at most (live nodes, lowest
/// index first).
const BOOTSTRAPS: usize = 3;

/// What a node is started with, whichever backend runs it.
struct NodeArgs {
    /// `node{i}`.
    name: String,
    /// Its config file, written from the scenario.
    config: PathBuf,
    arch: Arch,
    /// Its link each way under `network = "netns"`, in Mbit/s.
    link_mbps: Option<f64>,
    /// On the far network of a relay scenario.
    far: bool,
    /// The relay node of a relay scenario.
    relay_server: bool,
    /// `--no-mdns`: every discovery but mDNS.
    no_mdns: bool,
    /// `--bootstrap <addr>`, `--relay-server` or `--relay <addr>`.
    peers: Vec<String>,
    /// `RUST_LOG` for the node.
    log_filter: String,
}

impl NodeArgs {
    fn mdns_flag(&self) -> &'static [&'static str] {
        if self.no_mdns {
            &["--no-mdns"]
        } else {
            &[]
        }
    }
}

impl Testnet<'_> {
    fn secs(&self) -> f64 {
        self.begun.elapsed().as_secs_f64()
    }

    /// Write node `i`'s config file from the scenario.
    fn write_config(&self, i: usize) -> anyhow::Result<PathBuf> {
        let mut cfg = self.scenario.node_config.clone();
        let spec = self.scenario.node_spec(i);
        crate::layers::merge_tables(&mut cfg, spec.config.clone());
        cfg.insert("run_id".into(), self.scenario.run_id.clone().into());
        let table = |cfg: &mut toml::Table, key: &str| -> anyhow::Result<toml::Table> {
            match cfg.remove(key) {
                None => Ok(toml::Table::new()),
                Some(toml::Value::Table(t)) => Ok(t),
                Some(_) => bail!("node_config.{key} must be a table"),
            }
        };
        let mut training = table(&mut cfg, "training")?;
        let mut cluster = table(&mut cfg, "cluster")?;
        cluster.insert("min_peers".into(), (self.scenario.nodes as i64).into());
        if let Some(b) = spec.batch_size {
            training.insert("batch_size".into(), (b as i64).into());
        }
        if !training.contains_key("threads") {
            // The nodes share this host: each gets its share of the cores
            // rather than every core (which oversubscribes them all).
            let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
            training.insert("threads".into(), ((cores / self.scenario.nodes.max(1)).max(1) as i64).into());
        }
        let mut faults = table(&mut cfg, "faults")?;
        if let Some(s) = spec.slowdown {
            faults.insert("slowdown".into(), s.into());
        }
        if let Some(a) = spec.can_aggregate {
            cluster.insert("can_aggregate".into(), a.into());
        }
        if let Some(d) = spec.serve_delay_ms {
            faults.insert("delay_ms".into(), (d as i64).into());
        }
        if !faults.is_empty() {
            cfg.insert("faults".into(), faults.into());
        }
        if let Some(p) = &spec.profile {
            cfg.insert("profile".into(), p.clone().into());
        }
        if training.get("model").and_then(toml::Value::as_str) == Some("llama") && !cfg.contains_key("output_hf") {
            // A Llama also leaves a Hugging Face directory per node.
            cfg.insert("output_hf".into(), format!("{}/node{i}-hf", self.launcher.models_dir()?).into());
        }
        cfg.insert("training".into(), training.into());
        cfg.insert("cluster".into(), cluster.into());
        if cfg.contains_key("checkpoint") {
            // Each node its own folder in the report, kept across restarts.
            let mut checkpoint = table(&mut cfg, "checkpoint")?;
            checkpoint.insert("dir".into(), self.launcher.checkpoint_dir(i)?.into());
            cfg.insert("checkpoint".into(), checkpoint.into());
        }
        let dir = self.opts.report_dir.join("configs");
        std::fs::create_dir_all(&dir)?;
        let path = dir.join(format!("node{i}.toml"));
        std::fs::write(&path, toml::to_string(&cfg)?).with_context(|| format!("writing {}", path.display()))?;
        Ok(path)
    }

    /// Start node `i` (again, for a restart) and wait until it prints its
    /// addresses.
    fn spawn(&mut self, i: usize) -> anyhow::Result<()> {
        let config = self.write_config(i)?;
        let args = self.node_args(i, config)?;
        for dir in ["logs", "keys", "models"] {
            std::fs::create_dir_all(self.opts.report_dir.join(dir))?;
        }
        let cmd = self.launcher.command(i, &args)?;
        let proc = self.start(i, &args.name, cmd)?;
        match self.nodes.iter().position(|n| n.index == i) {
            Some(p) => self.nodes[p] = proc,
            None => self.nodes.push(proc),
        }
        self.wait_ready(i, &args)
    }

    /// How node `i` finds the others: the same on every backend.
    fn node_args(&self, i: usize, config: PathBuf) -> anyhow::Result<NodeArgs> {
        let far = self.scenario.is_far(i);
        // Up to BOOTSTRAPS live nodes, so that a node added as another dies
        // (a churning swarm) still finds the run.
        let reachable = |n: &&NodeProc| n.alive() && n.index != i && !self.scenario.is_far(n.index);
        let bootstrap: Vec<String> = match self.scenario.discovery {
            Discovery::Bootstrap => self
                .nodes
                .iter()
                .filter(|n| n.alive() && n.index != i)
                .filter_map(NodeProc::p2p_addr)
                .take(BOOTSTRAPS)
                .collect(),
            Discovery::Relay if far => self.launcher.relay_far_addr().into_iter().collect(),
            // Live nodes this one can reach: not far ones.
            Discovery::Relay => {
                self.nodes.iter().filter(reachable).filter_map(NodeProc::p2p_addr).take(BOOTSTRAPS).collect()
            }
            Discovery::Mdns => Vec::new(),
        };
        let mut peers: Vec<String> = bootstrap.into_iter().flat_map(|b| ["--bootstrap".into(), b]).collect();
        // The relay serves; every other node reserves on it, by the address
        // on its own network, so that the far nodes reach it and it them.
        match &self.scenario.relay {
            None => {}
            Some(r) if r.node == i => peers.push("--relay-server".into()),
            Some(r) => {
                let addr = if far { self.launcher.relay_far_addr() } else { self.node(r.node)?.p2p_addr() };
                peers.push("--relay".into());
                peers.push(addr.with_context(|| format!("node{i} starts before its relay, node{}", r.node))?);
            }
        }
        Ok(NodeArgs {
            name: format!("node{i}"),
            config,
            arch: self.scenario.node_spec(i).arch,
            link_mbps: self.scenario.node_spec(i).link_mbps,
            far,
            relay_server: self.scenario.relay.as_ref().is_some_and(|r| r.node == i),
            no_mdns: self.scenario.discovery != Discovery::Mdns,
            peers,
            log_filter: std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
        })
    }

    /// Run `cmd` as node `i`: stderr to its log, stdout read line by line
    /// (kept in `<name>.out`) for what it tells the launcher.
    fn start(&self, i: usize, name: &str, mut cmd: Command) -> anyhow::Result<NodeProc> {
        let logs = self.opts.report_dir.join("logs");
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(logs.join(format!("{name}.log")))
            .context("opening the node log")?;
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::from(stderr));
        let mut child =
            cmd.spawn().with_context(|| format!("starting {} for {name}", self.opts.shoal_bin.display()))?;
        let stdout = child.stdout.take().context("no stdout pipe")?;
        let (tx, rx) = mpsc::channel();
        let out_path = logs.join(format!("{name}.out"));
        std::thread::spawn(move || {
            let mut out = std::fs::OpenOptions::new().create(true).append(true).open(out_path).ok();
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(f) = out.as_mut() {
                    let _ = writeln!(f, "{line}");
                }
                if let Some(l) = parse_line(&line) {
                    if tx.send(l).is_err() {
                        break;
                    }
                }
            }
        });
        Ok(NodeProc {
            index: i,
            name: name.to_string(),
            child: Some(child),
            lines: rx,
            peer_id: None,
            listen: None,
            http: None,
            exit: None,
            finished: None,
            last: None,
            last_role: None,
            frozen: false,
        })
    }

    /// Wait until node `i`, just started, is ready (see [`Launcher::ready`]).
    fn wait_ready(&mut self, i: usize, args: &NodeArgs) -> anyhow::Result<()> {
        let name = &args.name;
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let n = self.nodes.iter_mut().find(|n| n.index == i).with_context(|| format!("no node{i}"))?;
            n.drain_lines();
            if self.launcher.ready(n, args)? {
                return Ok(());
            }
            if let Some(c) = n.child.as_mut() {
                if let Some(status) = c.try_wait()? {
                    let log = self.opts.report_dir.join("logs").join(format!("{name}.log"));
                    bail!("{name} exited at start ({status}); see {}", log.display());
                }
            }
            if Instant::now() > deadline {
                bail!("{name} did not print its addresses within {} s", START_TIMEOUT.as_secs());
            }
            // Waiting for a child process's output: nothing to wait on but time.
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn node_mut(&mut self, i: usize) -> anyhow::Result<&mut NodeProc> {
        self.nodes.iter_mut().find(|n| n.index == i).with_context(|| format!("no node{i}"))
    }

    fn node(&self, i: usize) -> anyhow::Result<&NodeProc> {
        self.nodes.iter().find(|n| n.index == i).with_context(|| format!("no node{i}"))
    }

    fn control(&self, i: usize, path: &str) -> anyhow::Result<String> {
        let addr = self.node(i)?.http.with_context(|| format!("node{i} has no HTTP endpoint"))?;
        http::post(addr, path, HTTP_TIMEOUT)
    }

    /// Apply one action; returns a description of what was done.
    fn apply(&mut self, action: &Action, heals: &mut Vec<(f64, Vec<Vec<usize>>)>) -> anyhow::Result<String> {
        match action {
            Action::Slow { node, serve_delay_ms, slowdown } => {
                let mut q = Vec::new();
                if let Some(d) = serve_delay_ms {
                    q.push(format!("serve_delay_ms={d}"));
                }
                if let Some(s) = slowdown {
                    q.push(format!("slowdown={s}"));
                }
                self.control(*node, &format!("/control/fault?{}", q.join("&")))
            }
            Action::StopAll => {
                let live: Vec<usize> = self.nodes.iter().filter(|n| n.alive()).map(|n| n.index).collect();
                for &i in &live {
                    self.apply(&Action::Kill { node: i }, heals)?;
                }
                Ok(format!("stopped {} nodes at once (SIGKILL): {live:?}", live.len()))
            }
            Action::StartAll => {
                let dead: Vec<usize> = self.nodes.iter().filter(|n| !n.alive()).map(|n| n.index).collect();
                for &i in &dead {
                    self.spawn(i)?;
                }
                Ok(format!("started {} nodes again: {dead:?}", dead.len()))
            }
            Action::Freeze { node } => {
                let pid = self.node(*node)?.child.as_ref().map(Child::id).context("the node is not running")?;
                self.launcher.freeze(*node, pid)?;
                self.node_mut(*node)?.frozen = true;
                Ok(format!("node{node} frozen (stopped; its connections stay open)"))
            }
            Action::Kill { node } => {
                self.launcher.kill(*node, self.node(*node)?.frozen)?;
                let n = self.node_mut(*node)?;
                n.frozen = false;
                if let Some(mut c) = n.child.take() {
                    c.kill().with_context(|| format!("killing node{node}"))?;
                    let _ = c.wait();
                }
                n.exit = Some("killed".into());
                Ok(format!("node{node} killed (SIGKILL)"))
            }
            Action::Restart { node } => {
                self.spawn(*node)?;
                Ok(format!("node{node} restarted"))
            }
            Action::Add => {
                let i = self.nodes.iter().map(|n| n.index + 1).max().unwrap_or(0);
                self.spawn(i)?;
                Ok(format!("node{i} added"))
            }
            Action::Leave { node } => self.control(*node, "/control/leave"),
            Action::Partition { groups, duration } => {
                self.set_partition(groups, true)?;
                heals.push((self.secs() + duration.as_secs_f64(), groups.clone()));
                Ok(format!("partitioned {groups:?}"))
            }
        }
    }

    /// Block (or unblock and redial) every pair across groups, both ways.
    /// Every pair is tried even if one fails (a node may have exited), so
    /// a heal never leaves part of a partition in place.
    fn set_partition(&self, groups: &[Vec<usize>], block: bool) -> anyhow::Result<()> {
        let mut failed = Vec::new();
        for (gi, g) in groups.iter().enumerate() {
            for (hi, h) in groups.iter().enumerate() {
                if gi == hi {
                    continue;
                }
                for &a in g {
                    for &b in h {
                        let (na, nb) = (self.node(a)?, self.node(b)?);
                        if !na.alive() {
                            continue;
                        }
                        let Some(peer) = nb.peer_id.clone() else { continue };
                        let path = if block {
                            format!("/control/block?peer={}", http::encode(&peer))
                        } else {
                            let addr = nb.p2p_addr().unwrap_or_default();
                            format!("/control/unblock?peer={}&addr={}", http::encode(&peer), http::encode(&addr))
                        };
                        if let Err(e) = self.control(a, &path) {
                            failed.push(format!("node{a} -> node{b}: {e:#}"));
                        }
                    }
                }
            }
        }
        anyhow::ensure!(failed.is_empty(), "{}", failed.join("; "));
        Ok(())
    }

    /// Memory and open files of every live node process, where the
    /// backend can read them ([`Launcher::resources`]).
    fn sample_resources(&self, t: f64, out: &mut Vec<ResourceSample>) {
        for n in &self.nodes {
            let Some(pid) = n.child.as_ref().map(Child::id) else { continue };
            if let Some((rss_bytes, peak_rss_bytes, open_fds)) = self.launcher.resources(pid) {
                out.push(ResourceSample { secs: t, node: n.name.clone(), pid, rss_bytes, peak_rss_bytes, open_fds });
            }
        }
    }

    /// Read every live node's status; record samples and role changes.
    ///
    /// The pages are read at once, one thread each: read in turn, 64 nodes
    /// on an overloaded host took 10 to 20 s a poll, so a sample stamped
    /// with the poll's time could be that much older than what it read,
    /// and the events the timeline applied after the poll later still.
    fn poll(&mut self, t: f64, samples: &mut Vec<Sample>, roles: &mut Vec<RoleRecord>) {
        for n in self.nodes.iter_mut() {
            n.drain_lines();
            if let Some(c) = n.child.as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    n.exit = Some(if status.success() { "exited".into() } else { format!("failed: {status}") });
                    n.child = None;
                }
            }
        }
        let targets: Vec<(usize, SocketAddr)> = self
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| match (n.alive(), n.frozen, n.http) {
                (true, false, Some(addr)) => Some((i, addr)),
                _ => None,
            })
            .collect();
        let read: Vec<(usize, serde_json::Value)> = std::thread::scope(|scope| {
            let readers: Vec<_> = targets
                .iter()
                .map(|&(i, addr)| scope.spawn(move || (i, http::get_json(addr, "/status", HTTP_TIMEOUT))))
                .collect();
            readers.into_iter().filter_map(|r| r.join().ok()).filter_map(|(i, r)| Some((i, r.ok()?))).collect()
        });
        for (i, s) in read {
            let n = &mut self.nodes[i];
            let num = |k: &str| s.get(k).and_then(serde_json::Value::as_f64);
            let role = s.get("role").and_then(|r| r.as_str()).unwrap_or("?").to_string();
            let owned: Vec<u64> = s
                .get("owned_shards")
                .and_then(|o| o.as_array())
                .map(|a| a.iter().filter_map(serde_json::Value::as_u64).collect())
                .unwrap_or_default();
            samples.push(Sample {
                secs: t,
                node: n.name.clone(),
                step: num("step").unwrap_or(0.0) as u64,
                loss: num("last_loss"),
                accuracy: num("last_accuracy"),
                samples_per_sec: num("samples_per_sec").unwrap_or(0.0),
                rounds_forced: num("rounds_forced").unwrap_or(0.0) as u64,
                role: role.clone(),
                members: s.get("placement_members").and_then(|e| e.as_str()).map(str::to_string),
                live: num("placement_live").unwrap_or(0.0) as u64,
            });
            if n.last_role.as_ref() != Some(&(role.clone(), owned.clone())) {
                roles.push(RoleRecord { secs: t, node: n.name.clone(), role: role.clone(), owned: owned.clone() });
                n.last_role = Some((role, owned));
            }
            n.last = Some(s);
        }
    }

    fn table(&self, t: f64) -> String {
        let mut out = format!(
            "shoal testnet `{}`: {:.0} s\n{:<7} {:<11} {:<14} {:>7} {:>9} {:>8} {:<6}\n",
            self.scenario.name, t, "node", "role", "owned", "step", "samples/s", "acc", "alive"
        );
        for n in &self.nodes {
            let s = n.last.as_ref();
            let get = |k: &str| s.and_then(|s| s.get(k));
            let owned = get("owned_shards")
                .and_then(|o| o.as_array())
                .map(|a| a.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(","))
                .unwrap_or_default();
            let acc = get("last_accuracy")
                .and_then(serde_json::Value::as_f64)
                .map_or("-".to_string(), |a| format!("{:.2}%", a * 100.0));
            let alive = if n.alive() { "yes".to_string() } else { n.exit.clone().unwrap_or_else(|| "no".into()) };
            out.push_str(&format!(
                "{:<7} {:<11} {:<14} {:>7} {:>9.1} {:>8} {:<6}\n",
                n.name,
                get("role").and_then(|r| r.as_str()).unwrap_or("-"),
                if owned.is_empty() { "-".into() } else { owned },
                get("step").and_then(serde_json::Value::as_u64).unwrap_or(0),
                get("samples_per_sec").and_then(serde_json::Value::as_f64).unwrap_or(0.0),
                acc,
                alive
            ));
        }
        out
    }

    fn kill_all(&mut self) {
        self.kill_all_as("killed at the time limit");
    }

    /// Kill every node still running; `why` becomes their exit.
    fn kill_all_as(&mut self, why: &str) {
        self.launcher.kill_all();
        for n in self.nodes.iter_mut() {
            if let Some(mut c) = n.child.take() {
                let _ = c.kill();
                let _ = c.wait();
                n.exit.get_or_insert_with(|| why.into());
            }
        }
    }

    /// Start the initial nodes, in order: node 0 first, the others bootstrap from it.
    #[allow(clippy::print_stdout)] // The launcher's own terminal output.
    fn start_all(&mut self) -> anyhow::Result<()> {
        let scenario = self.scenario;
        println!(
            "testnet `{}`: {} nodes, {} events, logs in {}",
            scenario.name,
            scenario.nodes,
            scenario.events.len(),
            self.opts.report_dir.join("logs").display()
        );
        for i in 0..scenario.nodes {
            self.spawn(i)?;
            println!("started node{i}: {}", self.node(i)?.p2p_addr().unwrap_or_default());
        }
        Ok(())
    }

    /// Every initial node has trained a step: the timeline's zero.
    fn training_started(&self) -> bool {
        (0..self.scenario.nodes).all(|i| {
            self.node(i)
                .ok()
                .and_then(|n| n.last.as_ref())
                .and_then(|s| s.get("step"))
                .and_then(|s| s.as_u64())
                .unwrap_or(0)
                >= 1
        })
    }

    /// Every initial node has exited cleanly (its status 0): it trained to
    /// the end, whether or not a poll saw its steps.
    fn trained_between_polls(&self) -> bool {
        (0..self.scenario.nodes).all(|i| self.node(i).ok().is_some_and(|n| n.exit.as_deref() == Some("exited")))
    }

    /// Poll the nodes, apply the timeline and draw the table every
    /// [`POLL`] until every node has exited, the time limit, or told to stop.
    #[allow(clippy::print_stdout)] // The launcher's own terminal output.
    fn run_timeline(&mut self, live: bool) -> (Progress, End) {
        let mut p = Progress::new();
        loop {
            let t = self.secs();
            self.poll(t, &mut p.samples, &mut p.roles);
            if t - p.last_resources >= RESOURCE_EVERY_SECS {
                p.last_resources = t;
                self.sample_resources(t, &mut p.resources);
            }
            if p.t0.is_none() {
                if self.training_started() {
                    p.t0 = Some(t);
                    println!("training started at {t:.1} s; the timeline starts now");
                } else if self.trained_between_polls() {
                    // A short run on a fast host: every node trained to the
                    // end and exited cleanly between two polls. The timeline
                    // starts now, and its events find no training left.
                    p.t0 = Some(t);
                    println!("every node trained and exited before a poll saw a step; the timeline starts now");
                } else if self.nodes.iter().any(|n| !n.alive() && n.exit.as_deref() != Some("exited")) {
                    // A node died before training started: report that now
                    // rather than wait out the time limit. (One that exited
                    // cleanly trained to the end: the others follow.)
                    println!("a node exited before training started; stopping");
                    self.kill_all();
                    return (p, End::Done);
                }
            }
            if let Some(t0) = p.t0 {
                self.apply_due_events(t, t0, &mut p);
                self.heal_due_partitions(t, t0, &mut p);
            }
            if live {
                print!("\x1b[H\x1b[2J{}", self.table(t));
                let _ = std::io::stdout().flush();
            } else if t - p.last_print >= 5.0 {
                print!("{}", self.table(t));
                p.last_print = t;
            }
            // Before the end check: Ctrl-C in a terminal reaches the nodes too,
            // and they may all have left by now.
            if told_to_stop(self.opts) {
                println!("told to stop: stopping every node");
                self.kill_all_as("killed: the testnet was stopped");
                return (p, End::Stopped);
            }
            let events_done = p.next_event >= self.scenario.events.len() && p.heals.is_empty();
            if self.nodes.iter().all(|n| !n.alive()) {
                if events_done {
                    return (p, End::Done);
                }
                if self.steps_never_come(&mut p) {
                    println!("training ended before the next event's step: stopping");
                    return (p, End::Done);
                }
            }
            if t > self.scenario.time_limit.as_secs_f64() {
                println!("time limit of {} s reached: stopping every node", self.scenario.time_limit.as_secs());
                self.kill_all();
                return (p, End::TimedOut);
            }
            // The poll interval of the live table and the timeline.
            let live = self.nodes.iter().filter(|n| n.alive()).count() as u32;
            std::thread::sleep(POLL.max(POLL_PER_NODE * live));
        }
    }

    /// Apply every event due at `t` (the timeline started at `t0`), or
    /// once a live node has reached its step. An event that finds no
    /// training left to act on is recorded as missed: the run then fails.
    #[allow(clippy::print_stdout)] // The launcher's own terminal output.
    fn apply_due_events(&mut self, t: f64, t0: f64, p: &mut Progress) {
        let events = &self.scenario.events;
        while let Some(ev) = events.get(p.next_event) {
            let due = match ev.at {
                At::Secs(s) => t - t0 >= s,
                At::Step(n) => self.cluster_step() >= n,
                At::After(s) => t - p.last_event.unwrap_or(t0) >= s,
            };
            if !due {
                break;
            }
            p.next_event += 1;
            // The time the event is applied, not the poll's: the checks
            // measure from it (kill grace, view agreement).
            let now = self.secs();
            p.last_event = Some(now);
            let missed = self.no_training_for(&ev.action);
            let outcome = match &missed {
                Some(why) => Err(anyhow::anyhow!("missed: {why}")),
                None => self.apply(&ev.action, &mut p.heals),
            };
            let what = match &outcome {
                Ok(m) => m.clone(),
                Err(e) => format!("failed: {e:#}"),
            };
            println!("[{:>6.1} s] {ev}: {what}", now - t0);
            if let Some(why) = missed {
                p.missed.push(format!("{ev}: {why}"));
            }
            p.faults.push(FaultRecord {
                secs: now,
                at_secs: now - t0,
                at_step: match ev.at {
                    At::Step(n) => Some(n),
                    At::Secs(_) | At::After(_) => None,
                },
                line: ev.line,
                action: ev.action.to_string(),
                outcome: what,
                membership: ev.action.changes_membership(),
                failure: ev.action.is_failure(),
                steps_per_sec_before: None,
                steps_per_sec_after: None,
            });
        }
    }

    /// With every node gone, an event placed by step can never fire:
    /// record it and every event after it as missed. False when the next
    /// event is placed by time (a `start_all` may follow a `stop_all`).
    fn steps_never_come(&self, p: &mut Progress) -> bool {
        let rest = &self.scenario.events[p.next_event.min(self.scenario.events.len())..];
        if !rest.first().is_some_and(|e| matches!(e.at, At::Step(_))) {
            return false;
        }
        let reached = p.samples.iter().map(|s| s.step).max().unwrap_or(0);
        for ev in rest {
            p.missed.push(format!("{ev}: never ran, every node had stopped (the furthest reached step {reached})"));
        }
        p.next_event = self.scenario.events.len();
        true
    }

    /// The furthest training step any live node has reported: what
    /// `at_step` events wait for.
    fn cluster_step(&self) -> u64 {
        self.nodes
            .iter()
            .filter(|n| n.alive())
            .filter_map(|n| n.last.as_ref()?.get("step")?.as_u64())
            .max()
            .unwrap_or(0)
    }

    /// Why `action` would find no training left to act on, if it would: the
    /// node it targets has finished (or is gone), or, for the rest, no live
    /// node is still training. A `start_all` is judged at the end, by
    /// whether its nodes resumed ([`crate::checks::missed_resumes`]).
    fn no_training_for(&self, action: &Action) -> Option<String> {
        let target = match action {
            Action::Slow { node, .. } | Action::Kill { node } | Action::Freeze { node } | Action::Leave { node } => {
                Some(*node)
            }
            Action::StartAll => return None,
            _ => None,
        };
        match target {
            Some(i) => {
                let n = self.node(i).ok()?;
                (!still_training(n)).then(|| format!("node{i} has no training left ({})", training_state(n)))
            }
            None => (!self.nodes.iter().any(still_training))
                .then(|| "every node has finished training: the fault came too late".to_string()),
        }
    }

    /// Heal every partition whose time is up at `t`.
    #[allow(clippy::print_stdout)] // The launcher's own terminal output.
    fn heal_due_partitions(&mut self, t: f64, t0: f64, p: &mut Progress) {
        let due: Vec<Vec<Vec<usize>>> = p.heals.iter().filter(|h| h.0 <= t).map(|h| h.1.clone()).collect();
        p.heals.retain(|h| h.0 > t);
        for groups in due {
            let now = self.secs();
            let what = match self.set_partition(&groups, false) {
                Ok(()) => "healed".to_string(),
                Err(e) => format!("heal failed: {e:#}"),
            };
            println!("[{:>6.1} s] partition {groups:?}: {what}", now - t0);
            p.faults.push(FaultRecord {
                secs: now,
                at_secs: now - t0,
                at_step: None,
                line: 0,
                action: format!("heal {groups:?}"),
                outcome: what,
                membership: false,
                failure: false,
                steps_per_sec_before: None,
                steps_per_sec_after: None,
            });
        }
    }

    /// How each node ended, for the report.
    fn outcomes(&self) -> Vec<NodeOutcome> {
        self.nodes
            .iter()
            .map(|n| NodeOutcome {
                name: n.name.clone(),
                peer_id: n.peer_id.clone().unwrap_or_default(),
                exit: n.exit.clone().unwrap_or_else(|| "unknown".into()),
                killed: n.exit.as_deref() == Some("killed"),
                final_accuracy: n.finished.and_then(|f| f.accuracy),
                final_bits_per_byte: n.finished.and_then(|f| f.bits_per_byte),
                steps: n.finished.map(|f| f.steps),
                left: n.finished.is_some_and(|f| f.left),
                resumed_at_step: n.last.as_ref().and_then(|s| s.get("resumed_at_step")).and_then(|v| v.as_u64()),
                model: Some(format!("models/{}.safetensors", n.name))
                    .filter(|m| self.opts.report_dir.join(m).is_file()),
                arch: self.scenario.node_spec(n.index).arch.to_string(),
                profile: self.scenario.node_spec(n.index).profile,
                bytes_out: n.last_num("bytes_out").map(|b| b as u64),
                bytes_in: n.last_num("bytes_in").map(|b| b as u64),
                utilization: n
                    .last_num("compute_secs")
                    .zip(n.last_num("step_secs"))
                    .and_then(|(c, s)| (s > 0.0).then(|| (c / s).min(1.0))),
                link_mbps: self.scenario.node_spec(n.index).link_mbps,
            })
            .collect()
    }

    /// Write the report of the run that ended as `end`; an error if it did
    /// not run to its end or a node failed.
    #[allow(clippy::print_stdout)] // The launcher's own terminal output.
    fn report(&mut self, p: Progress, end: End) -> anyhow::Result<Summary> {
        let (scenario, opts) = (self.scenario, self.opts);
        for n in self.nodes.iter_mut() {
            n.drain_lines();
        }
        print!("{}", self.table(self.secs()));
        let (t, timed_out, outcomes) = (self.secs(), end == End::TimedOut, self.outcomes());
        let mut missed = p.missed;
        let summary = Summary::build(scenario, p.t0, t, timed_out, outcomes, p.roles, p.faults, p.samples)
            .with_resources(p.resources);
        summary.write(&opts.report_dir)?;
        println!("report: {}", opts.report_dir.display());
        for n in &summary.nodes {
            println!(
                "  {}: {} {}{}{}",
                n.name,
                n.exit,
                match (n.final_accuracy, n.final_bits_per_byte) {
                    (Some(a), _) => format!("test accuracy {:.2}%", a * 100.0),
                    (None, Some(b)) => format!("test bits/byte {b:.3}"),
                    (None, None) => String::new(),
                },
                n.resumed_at_step.map_or(String::new(), |s| format!(", resumed from checkpoints at step {s}")),
                traffic(n)
            );
        }
        match end {
            End::TimedOut => bail!("the testnet hit its time limit of {} s", scenario.time_limit.as_secs()),
            End::Stopped => bail!("the testnet was stopped before it finished; the report holds what ran"),
            End::Done => {}
        }
        let failed: Vec<&str> =
            summary.nodes.iter().filter(|n| n.exit.starts_with("failed")).map(|n| n.name.as_str()).collect();
        if !failed.is_empty() {
            bail!("node(s) failed: {}; see {}", failed.join(", "), opts.report_dir.join("logs").display());
        }
        missed.extend(checks::missed_resumes(scenario, &summary));
        if !missed.is_empty() {
            bail!(
                "the scenario's faults did not land: {}. Place the events earlier (at_step follows training on \
                 any build) or give the run more steps",
                missed.join("; ")
            );
        }
        Ok(summary)
    }
}

impl Drop for Testnet<'_> {
    fn drop(&mut self) {
        // Never leave node processes behind, whatever happened (the
        // launcher's own drop then removes what the backend made).
        self.kill_all();
    }
}

/// What a run has recorded for its report, and where its timeline stands.
struct Progress {
    samples: Vec<Sample>,
    resources: Vec<ResourceSample>,
    roles: Vec<RoleRecord>,
    faults: Vec<FaultRecord>,
    /// Partitions to heal: (when, in seconds since the start; the groups).
    heals: Vec<(f64, Vec<Vec<usize>>)>,
    /// The first event not applied yet.
    next_event: usize,
    /// Events that found no training left to act on: the run fails.
    missed: Vec<String>,
    /// When the last event ran (seconds since the start).
    last_event: Option<f64>,
    /// When every initial node had trained a step: the timeline's zero.
    t0: Option<f64>,
    last_resources: f64,
    last_print: f64,
}

impl Progress {
    fn new() -> Self {
        Progress {
            samples: Vec::new(),
            resources: Vec::new(),
            roles: Vec::new(),
            faults: Vec::new(),
            heals: Vec::new(),
            next_event: 0,
            missed: Vec::new(),
            last_event: None,
            t0: None,
            last_resources: f64::NEG_INFINITY,
            last_print: f64::NEG_INFINITY,
        }
    }
}

/// How a run's timeline ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// Every node exited, or one did before training started.
    Done,
    /// At the scenario's time limit.
    TimedOut,
    /// Told to stop ([`RunOptions::stop`]).
    Stopped,
}

/// How a backend starts, stops and inspects nodes: one implementation per
/// [`Backend`], chosen once per run by [`launcher_for`]. What all backends
/// share (config files, stdout, the control endpoint, the timeline) is
/// [`Testnet`]'s.
trait Launcher {
    /// Node `i`'s checkpoint folder as the node sees it (made if needed).
    fn checkpoint_dir(&self, i: usize) -> anyhow::Result<String>;
    /// The report's `models` folder as the nodes see it (made if needed):
    /// each node's model file goes there, and a Llama's Hugging Face
    /// directory.
    fn models_dir(&self) -> anyhow::Result<String>;
    /// The command that runs node `i`; its stdout and stderr are the node's.
    fn command(&mut self, i: usize, args: &NodeArgs) -> anyhow::Result<Command>;
    /// Whether `node`, started with `args`, is ready: it printed its
    /// addresses, now the ones the launcher and peers reach it by.
    fn ready(&mut self, node: &mut NodeProc, args: &NodeArgs) -> anyhow::Result<bool>;
    /// The relay's address on the far network of a relay scenario, for the
    /// far nodes (`None` until the relay is ready, or without one).
    fn relay_far_addr(&self) -> Option<String>;
    /// Stop node `i` (child process `pid`) without closing anything.
    fn freeze(&self, i: usize, pid: u32) -> anyhow::Result<()>;
    /// Kill what runs node `i` (`frozen`: it was frozen) beyond its child
    /// process, which the caller kills next.
    fn kill(&self, i: usize, frozen: bool) -> anyhow::Result<()>;
    /// The same for every node, before their child processes are killed;
    /// best effort.
    fn kill_all(&self);
    /// Resident memory now and at its peak, and open file descriptors, of
    /// the node whose child process is `pid`, where the backend can read them.
    fn resources(&self, pid: u32) -> Option<(u64, u64, u64)>;
}

/// A node's bytes, utilization and link for the run's last lines (empty
/// without a `/status`).
fn traffic(n: &NodeOutcome) -> String {
    let (Some(out), Some(r#in)) = (n.bytes_out, n.bytes_in) else { return String::new() };
    format!(
        ", {:.1} MB out, {:.1} MB in{}{}",
        out as f64 / 1e6,
        r#in as f64 / 1e6,
        n.utilization.map_or(String::new(), |u| format!(", utilization {u:.2}")),
        n.link_mbps.map_or(String::new(), |m| format!(", {m} Mbit/s link"))
    )
}

/// The launcher of `opts.backend`, with whatever it needs made (networks).
fn launcher_for(scenario: &Scenario, opts: &RunOptions) -> anyhow::Result<Box<dyn Launcher>> {
    Ok(match &opts.backend {
        Backend::Processes => Box::new(ProcessLauncher::new(scenario, opts)?),
        Backend::Docker { image } => Box::new(DockerLauncher::new(scenario, opts, image)?),
    })
}

/// `shoal node` processes on loopback; a node with `arch = "aarch64"` runs
/// the aarch64 binary under user-mode emulation. With `network = "netns"`,
/// each node runs in a network namespace of its own on a bridge, its
/// `link_mbps` kept by the kernel ([`Netns`]).
struct ProcessLauncher {
    report_dir: PathBuf,
    shoal_bin: PathBuf,
    aarch64_bin: Option<PathBuf>,
    /// `network = "netns"`: the bridge and the nodes' namespaces.
    netns: Option<Netns>,
}

impl ProcessLauncher {
    fn new(scenario: &Scenario, opts: &RunOptions) -> anyhow::Result<Self> {
        if scenario.discovery == Discovery::Mdns {
            bail!(
                "scenario {}: discovery = \"mdns\" needs --backend docker (loopback carries no multicast)",
                scenario.name
            );
        }
        if scenario.discovery == Discovery::Relay {
            bail!(
                "scenario {}: discovery = \"relay\" needs --backend docker (every process reaches every other on \
                 loopback, so nothing would need the relay)",
                scenario.name
            );
        }
        let netns = match scenario.network {
            Network::Loopback => None,
            Network::Netns if scenario.has_arch(Arch::Aarch64) => bail!(
                "scenario {}: network = \"netns\" runs native nodes only (an aarch64 node runs under qemu)",
                scenario.name
            ),
            Network::Netns => Some(Netns::new().with_context(|| format!("scenario {}", scenario.name))?),
        };
        Ok(ProcessLauncher {
            report_dir: opts.report_dir.clone(),
            shoal_bin: opts.shoal_bin.clone(),
            aarch64_bin: opts.aarch64_bin.clone(),
            netns,
        })
    }

    /// The program for a node of `arch`: the launcher's `shoal`, or the
    /// aarch64 one under qemu.
    fn program(&self, name: &str, arch: Arch) -> anyhow::Result<Command> {
        match arch {
            Arch::Native => Ok(Command::new(&self.shoal_bin)),
            Arch::Aarch64 => {
                let bin = self.aarch64_bin.as_ref().with_context(|| {
                    format!(
                        "{name} has arch = \"aarch64\": pass --aarch64-bin (or SHOAL_AARCH64_BIN) with the binary \
                         scripts/build-aarch64.sh builds"
                    )
                })?;
                qemu_aarch64_command(bin)
            }
        }
    }
}

impl Launcher for ProcessLauncher {
    fn checkpoint_dir(&self, i: usize) -> anyhow::Result<String> {
        let d = self.report_dir.join("checkpoints").join(format!("node{i}"));
        std::fs::create_dir_all(&d)?;
        Ok(std::fs::canonicalize(&d).unwrap_or(d).display().to_string())
    }

    fn models_dir(&self) -> anyhow::Result<String> {
        let d = self.report_dir.join("models");
        std::fs::create_dir_all(&d)?;
        Ok(std::fs::canonicalize(&d).unwrap_or(d).display().to_string())
    }

    fn command(&mut self, i: usize, args: &NodeArgs) -> anyhow::Result<Command> {
        let name = &args.name;
        let (mut cmd, host) = match self.netns.as_mut() {
            Some(n) => {
                n.ensure(i, args.link_mbps).with_context(|| format!("{name}'s namespace"))?;
                (n.command(i, &self.shoal_bin), n.address(i)?)
            }
            None => (self.program(name, args.arch)?, "127.0.0.1".to_string()),
        };
        cmd.arg("node")
            .arg("--config")
            .arg(&args.config)
            .args(["--name", name, "--listen", &format!("/ip4/{host}/tcp/0"), "--http", &format!("{host}:0")])
            .arg("--control")
            .args(args.mdns_flag())
            .arg("--identity")
            .arg(self.report_dir.join("keys").join(format!("{name}.key")))
            .arg("--output")
            .arg(Path::new(&self.models_dir()?).join(format!("{name}.safetensors")))
            .args(&args.peers)
            .env("RUST_LOG", &args.log_filter)
            .env("NO_COLOR", "1");
        Ok(cmd)
    }

    fn ready(&mut self, node: &mut NodeProc, _args: &NodeArgs) -> anyhow::Result<bool> {
        Ok(node.http.is_some() && node.p2p_addr().is_some())
    }

    fn relay_far_addr(&self) -> Option<String> {
        // Loopback has no far network (relay scenarios need docker).
        None
    }

    fn freeze(&self, _i: usize, pid: u32) -> anyhow::Result<()> {
        // SIGSTOP through kill(1): the workspace forbids unsafe code.
        let out = Command::new("kill").args(["-STOP", &pid.to_string()]).output()?;
        anyhow::ensure!(out.status.success(), "kill -STOP {pid}: {}", String::from_utf8_lossy(&out.stderr).trim());
        Ok(())
    }

    fn kill(&self, _i: usize, _frozen: bool) -> anyhow::Result<()> {
        // The child is the node: killing it is all (a stopped process dies of SIGKILL too).
        Ok(())
    }

    fn kill_all(&self) {}

    fn resources(&self, pid: u32) -> Option<(u64, u64, u64)> {
        proc_resources(pid)
    }
}

/// One container per node from `image`, on a network of its own (and a far
/// one for a relay scenario); the child process of a node is its `docker
/// run` client. The networks and containers go when the launcher is dropped.
struct DockerLauncher {
    image: String,
    report_dir: PathBuf,
    /// `shoal-<scenario>-<launcher pid>`: the network's name, and the start
    /// of every container's.
    prefix: String,
    /// The nodes' network.
    net: String,
    /// A relay scenario's second network, which only the relay node shares
    /// with the far nodes.
    far_net: Option<String>,
    /// The relay node's address on the far network.
    relay_far_addr: Option<String>,
    /// Every container made (a restart reuses its node's).
    containers: Vec<String>,
    /// The scenario sets `[node_config.checkpoint]`: mount the report's folder.
    checkpoints: bool,
}

impl DockerLauncher {
    /// Check the engine and the image, and make the networks.
    fn new(scenario: &Scenario, opts: &RunOptions, image: &str) -> anyhow::Result<Self> {
        docker(&["info"]).context("the docker backend needs a docker engine (`docker info` failed)")?;
        docker(&["image", "inspect", image])
            .with_context(|| format!("no image {image}: build it with testnet/docker/build-image.sh"))?;
        let prefix = format!("shoal-{}-{}", scenario.name, std::process::id());
        // `--internal`: no route out of the network. Docker enforces it
        // by dropping every packet addressed outside the subnet, mDNS's
        // multicast group (224.0.0.251) too, so an mDNS testnet gets a
        // plain bridge network; its nodes still dial only each other.
        let create: &[&str] = match scenario.discovery {
            Discovery::Bootstrap | Discovery::Relay => &["network", "create", "--internal"],
            Discovery::Mdns => &["network", "create"],
        };
        docker(&[create, &[prefix.as_str()]].concat()).context("creating the docker network")?;
        // Made here so that its drop removes the network whatever happens next.
        let mut launcher = DockerLauncher {
            image: image.to_string(),
            report_dir: opts.report_dir.clone(),
            net: prefix.clone(),
            prefix,
            far_net: None,
            relay_far_addr: None,
            containers: Vec::new(),
            checkpoints: scenario.node_config.contains_key("checkpoint"),
        };
        if scenario.discovery == Discovery::Relay {
            // Two internal networks: no route between them, nor out.
            let far = format!("{}-far", launcher.net);
            docker(&["network", "create", "--internal", &far]).context("creating the far docker network")?;
            launcher.far_net = Some(far);
        }
        Ok(launcher)
    }

    fn container_name(&self, i: usize) -> String {
        format!("{}-node{i}", self.prefix)
    }

    /// Attach the relay node's container to the far network too (it listens
    /// on every interface) and note its address there for the far nodes.
    fn join_far_network(&mut self, container: &str, relay: &NodeProc) -> anyhow::Result<()> {
        let far = self.far_net.clone().context("a relay scenario without its far network")?;
        docker(&["network", "connect", &far, container]).context("attaching the relay to the far network")?;
        let ip = container_ip(container, &far).context("the relay got no address on the far network")?;
        let peer = relay.peer_id.clone().context("the relay printed no peer id")?;
        self.relay_far_addr = Some(format!("/ip4/{ip}/tcp/{DOCKER_P2P_PORT}/p2p/{peer}"));
        Ok(())
    }
}

impl Launcher for DockerLauncher {
    fn checkpoint_dir(&self, i: usize) -> anyhow::Result<String> {
        Ok(format!("/checkpoints/node{i}"))
    }

    fn models_dir(&self) -> anyhow::Result<String> {
        Ok("/models".into())
    }

    fn command(&mut self, i: usize, args: &NodeArgs) -> anyhow::Result<Command> {
        if args.arch != Arch::Native {
            bail!("node{i} has arch = \"{}\": emulated nodes run on the process backend only", args.arch);
        }
        let (name, container) = (&args.name, self.container_name(i));
        let net = if args.far { self.far_net.clone() } else { Some(self.net.clone()) };
        let net = net.context("no docker network")?;
        // A restart reuses the container: same identity, new incarnation.
        let _ = docker(&["rm", "-f", &container]);
        let abs = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
        let volume = |dir: &str, at: &str| format!("{}:{at}", abs(&self.report_dir.join(dir)).display());
        let mut cmd = Command::new("docker");
        cmd.args(["run", "--name", &container, "--network", &net, "--user", "0:0"])
            .args(["-v", &volume("configs", "/configs:ro")])
            .args(["-v", &volume("keys", "/keys")])
            .args(["-v", &volume("models", "/models")]);
        if self.checkpoints {
            std::fs::create_dir_all(self.report_dir.join("checkpoints"))?;
            cmd.args(["-v", &volume("checkpoints", "/checkpoints")]);
        }
        cmd.args(["-e", &format!("RUST_LOG={}", args.log_filter), "-e", "NO_COLOR=1", &self.image, "node"])
            .args(["--config", &format!("/configs/{name}.toml"), "--name", name])
            .args(["--listen", &format!("/ip4/0.0.0.0/tcp/{DOCKER_P2P_PORT}")])
            .args(["--http", &format!("0.0.0.0:{DOCKER_HTTP_PORT}"), "--control"])
            .args(args.mdns_flag())
            .args(["--identity", &format!("/keys/{name}.key")])
            .args(["--output", &format!("{}/{name}.safetensors", self.models_dir()?)])
            .args(&args.peers);
        if !self.containers.contains(&container) {
            self.containers.push(container);
        }
        Ok(cmd)
    }

    fn ready(&mut self, node: &mut NodeProc, args: &NodeArgs) -> anyhow::Result<bool> {
        if node.http.is_none() || node.peer_id.is_none() {
            return Ok(false);
        }
        // Inside a container the node reports 0.0.0.0 and loopback: peers
        // and the launcher use the container's address.
        let container = self.container_name(node.index);
        let net = if args.far { self.far_net.clone() } else { Some(self.net.clone()) };
        let Some(ip) = net.and_then(|net| container_ip(&container, &net)) else { return Ok(false) };
        node.listen = Some(format!("/ip4/{ip}/tcp/{DOCKER_P2P_PORT}"));
        node.http = Some(SocketAddr::new(ip, DOCKER_HTTP_PORT));
        if args.relay_server {
            self.join_far_network(&container, node)?;
        }
        Ok(true)
    }

    fn relay_far_addr(&self) -> Option<String> {
        self.relay_far_addr.clone()
    }

    fn freeze(&self, i: usize, _pid: u32) -> anyhow::Result<()> {
        docker(&["pause", &self.container_name(i)]).with_context(|| format!("docker pause node{i}"))?;
        Ok(())
    }

    fn kill(&self, i: usize, frozen: bool) -> anyhow::Result<()> {
        let name = self.container_name(i);
        if frozen {
            // A paused container is killed once it runs again.
            let _ = docker(&["unpause", &name]);
        }
        docker(&["kill", &name]).with_context(|| format!("docker kill node{i}"))?;
        Ok(())
    }

    fn kill_all(&self) {
        for c in &self.containers {
            let _ = docker(&["kill", c]);
        }
    }

    fn resources(&self, _pid: u32) -> Option<(u64, u64, u64)> {
        // The child is the `docker run` client, not the node.
        None
    }
}

impl Drop for DockerLauncher {
    fn drop(&mut self) {
        for c in &self.containers {
            let _ = docker(&["rm", "-f", c]);
        }
        for net in std::iter::once(&self.net).chain(&self.far_net) {
            let _ = docker(&["network", "rm", net]);
        }
    }
}

/// Run a scenario to the end and write the report. With `[checks]`, also
/// run it without its events if the accuracy check needs that, judge the
/// run, and add the verdict to `summary.json`. Returns the summary; an
/// error if the testnet could not run, hit its time limit, or failed a check.
#[allow(clippy::print_stdout)] // The launcher's own terminal output.
pub fn run(opts: &RunOptions) -> anyhow::Result<Summary> {
    let scenario = Scenario::from_file(&opts.scenario)?;
    let mut summary = run_scenario(&scenario, opts)?;
    if scenario.checks.is_empty() {
        return Ok(summary);
    }
    let fault_free = match scenario.checks.needs_fault_free_run() {
        false => None,
        true if told_to_stop(opts) => bail!("the testnet was stopped before its fault-free run"),
        true => {
            let base = scenario.without_events();
            let base_opts = RunOptions { report_dir: opts.report_dir.join("fault-free"), ..opts.clone() };
            println!(
                "\nthe same testnet without its {} events, for the accuracy check (report in {})",
                scenario.events.len(),
                base_opts.report_dir.display()
            );
            Some(run_scenario(&base, &base_opts)?)
        }
    };
    let report = checks::judge(&scenario.checks, &summary, fault_free.as_ref());
    print!("\n{}", checks::describe(&report, &summary));
    let passed = report.passed();
    summary.checks = Some(report);
    summary.write_json(&opts.report_dir)?;
    if !passed {
        bail!("the scenario's checks failed; see checks in {}", opts.report_dir.join("summary.json").display());
    }
    Ok(summary)
}

/// Run one scenario (already parsed) to the end and write its report.
fn run_scenario(scenario: &Scenario, opts: &RunOptions) -> anyhow::Result<Summary> {
    std::fs::create_dir_all(&opts.report_dir)
        .with_context(|| format!("creating the report directory {}", opts.report_dir.display()))?;
    let live = opts.live.unwrap_or_else(|| std::io::stdout().is_terminal());
    // Made before any node starts, so that its drop stops them whatever happens next.
    let mut testnet =
        Testnet { scenario, opts, launcher: launcher_for(scenario, opts)?, nodes: Vec::new(), begun: Instant::now() };
    testnet.start_all()?;
    let (progress, end) = testnet.run_timeline(live);
    testnet.report(progress, end)
}

/// [`RunOptions::stop`] is set.
fn told_to_stop(opts: &RunOptions) -> bool {
    opts.stop.as_ref().is_some_and(|s| s.load(Ordering::SeqCst))
}

/// Debian's aarch64 glibc for cross builds (`libc6-arm64-cross`), which
/// qemu needs to run a dynamically linked aarch64 `shoal`.
pub const AARCH64_SYSROOT: &str = "/usr/aarch64-linux-gnu";

/// A command that runs the aarch64 binary `bin` under qemu, with
/// `QEMU_LD_PREFIX` pointing at [`AARCH64_SYSROOT`] (where the emulated
/// binary's dynamic loader and glibc are) unless it is already set.
pub fn qemu_aarch64_command(bin: &Path) -> anyhow::Result<Command> {
    let mut cmd = Command::new(qemu_aarch64()?);
    cmd.arg(bin);
    if std::env::var_os("QEMU_LD_PREFIX").is_none() && Path::new(AARCH64_SYSROOT).is_dir() {
        cmd.env("QEMU_LD_PREFIX", AARCH64_SYSROOT);
    }
    Ok(cmd)
}

/// The user-mode emulator for aarch64 binaries: Debian's `qemu-user-static`
/// installs `qemu-aarch64-static`, `qemu-user` installs `qemu-aarch64`.
fn qemu_aarch64() -> anyhow::Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    for name in ["qemu-aarch64-static", "qemu-aarch64"] {
        if let Some(found) = std::env::split_paths(&path).map(|d| d.join(name)).find(|p| p.is_file()) {
            return Ok(found);
        }
    }
    bail!("an aarch64 node needs qemu-aarch64-static or qemu-aarch64 on PATH (apt-get install qemu-user-static)")
}

/// Run a docker command; its stderr becomes the error.
fn docker(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("docker").args(args).stdin(Stdio::null()).output().context("running docker")?;
    if !out.status.success() {
        bail!("docker {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The container's address on network `net`, once it has one.
fn container_ip(container: &str, net: &str) -> Option<std::net::IpAddr> {
    let format = format!("{{{{(index .NetworkSettings.Networks \"{net}\").IPAddress}}}}");
    docker(&["inspect", "-f", &format, container]).ok()?.parse().ok()
}

/// Default report directory: `testnet-reports/<scenario>-<unix time>`.
pub fn default_report_dir(scenario: &Path) -> PathBuf {
    let stem = scenario.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "scenario".into());
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    PathBuf::from("testnet-reports").join(format!("{stem}-{secs}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_config_table_merges_key_by_key() -> Result<(), toml::de::Error> {
        let mut base: toml::Table = toml::from_str("[training]\nsteps = 10\nlr = 0.1\n[cluster]\nmode = \"pull\"\n")?;
        let over: toml::Table = toml::from_str("[training]\nlr = 0.5\n[network]\nquic = false\n")?;
        crate::layers::merge_tables(&mut base, over);
        let want: toml::Table =
            toml::from_str("[training]\nsteps = 10\nlr = 0.5\n[cluster]\nmode = \"pull\"\n[network]\nquic = false\n")?;
        assert_eq!(base, want);
        Ok(())
    }

    #[test]
    fn node_stdout_lines_are_understood() {
        assert!(matches!(parse_line("peer id 12D3KooW"), Some(Line::PeerId(p)) if p == "12D3KooW"));
        assert!(matches!(parse_line("status on http://127.0.0.1:4000/"), Some(Line::Http(a)) if a.port() == 4000));
        let f = parse_line("node1: finished 300 steps, test accuracy 96.38%, owned shards [1, 2]");
        assert!(matches!(
            f,
            Some(Line::Finished(Finished { steps: 300, left: false, accuracy: Some(a), bits_per_byte: None }))
                if (a - 0.9638).abs() < 1e-9
        ));
        let f = parse_line("node2: finished 300 steps, test bits/byte 3.215, owned shards [0]");
        assert!(matches!(
            f,
            Some(Line::Finished(Finished { steps: 300, accuracy: None, bits_per_byte: Some(b), .. }))
                if (b - 3.215).abs() < 1e-9
        ));
        let f = parse_line("node3: left after 60 steps, test accuracy 95.00%");
        assert!(matches!(f, Some(Line::Finished(Finished { steps: 60, left: true, .. }))));
        assert!(parse_line("2026 INFO something").is_none());
    }
}
