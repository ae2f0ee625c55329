//! The scenario format: one TOML file describes a testnet, and the same file
//! drives the process backend (and documents the docker-compose one).
//!
//! ```toml
//! nodes = 4                 # nodes started at once (indices 0..3)
//! time_limit_secs = 600     # the whole testnet is stopped after this
//! discovery = "bootstrap"   # or "mdns": no bootstrap addresses (docker backend)
//!                           # or "relay": see [relay] (docker backend)
//! network = "loopback"      # or "netns": each node in a network namespace,
//!                           # on a bridge, its link_mbps kept by tc tbf
//!                           # (process backend, root; see crate::netns)
//!
//! [node_config]             # a node config (see testnet/node.example.toml)
//! training = { steps = 1200, eval_every = 100 }
//! cluster = { heartbeat_ms = 100, failure_timeout_ms = 1500 }
//!
//! [[node]]                  # per-node overrides
//! index = 3
//! batch_size = 16
//! slowdown = 2.0            # compute takes twice as long
//! can_aggregate = true
//! serve_delay_ms = 0        # delay on every push/pull it answers as an owner
//! profile = "edge"          # a config preset (`shoal node --profile`)
//! arch = "aarch64"          # run the aarch64 binary under qemu (process backend)
//! config = { compression = { push = "int8" } }  # merged over node_config
//! max_peak_rss_mib = 64     # check: the node's peak resident memory
//! link_mbps = 20            # network = "netns": the node's link, each way
//!
//! [relay]                   # with discovery = "relay" only
//! node = 0                  # serves as the relay, on both networks (node 0 only)
//! far = [3]                 # on a second network that only the relay reaches
//!
//! [[event]]                 # seconds after training starts on every node,
//! at_secs = 10              # or at_step = N: once a live node reaches step N,
//!                           # or after_secs = 2: after the event before it ran
//! action = "slow"           # slow | kill | freeze | restart | partition | add | leave
//! node = 3
//! serve_delay_ms = 25       # and/or slowdown = 5.0
//!
//! [[event]]
//! at_secs = 30
//! action = "partition"
//! groups = [[0, 1], [2, 3]]
//! duration_secs = 20
//!
//! [checks]                  # optional: what the finished run must show
//! warmup_secs = 60          # (see `crate::checks`)
//! max_rss_growth = 0.10
//! no_forced_rounds = true
//! accuracy_within_points = 0.5   # also runs the scenario without events
//! max_accuracy_drop_points = 0.5 # the same, one-sided: at most 0.5 points below
//! min_accuracy = 0.9        # every survivor's final test accuracy
//! max_node_peak_rss_mib = 200    # every node process's peak resident memory
//! kill_grace_secs = 30      # rounds forced this soon after a kill are excused
//! views_agree_within_secs = 60   # views agree on the members after each churn event
//! ```
//!
//! An event that finds no training left to act on (its node, or every
//! node, has finished) fails the run, and so does a `start_all` whose nodes
//! do not resume from their checkpoints: a fault that missed is not a pass.
//! Events placed by `at_step` follow training, not the clock, so a scenario
//! behaves the same on a debug and a release build. Once any event uses
//! `at_step` or `after_secs`, the events run in file order, each once the one
//! before it has.
//!
//! Errors name the line: `scenario.toml:14: event: node 7 does not exist
//! (nodes 0..3 at that time)`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

/// The node config tables a scenario may set under `[node_config]`.
const NODE_CONFIG_TABLES: &[&str] = &[
    "training",
    "cluster",
    "sync",
    "roles",
    "aggregation",
    "compression",
    "local_steps",
    "gossip",
    "faults",
    "network",
    "http",
    "checkpoint",
];

/// A scenario error, with the 1-based line it points at (0: the whole file).
#[derive(Debug, Clone, PartialEq)]
pub struct ScenarioError {
    pub file: String,
    pub line: usize,
    pub message: String,
}

impl fmt::Display for ScenarioError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}: {}", self.file, self.message)
        } else {
            write!(f, "{}:{}: {}", self.file, self.line, self.message)
        }
    }
}

impl std::error::Error for ScenarioError {}

/// Per-node differences from `node_config`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeSpec {
    pub batch_size: Option<u64>,
    pub slowdown: Option<f64>,
    pub can_aggregate: Option<bool>,
    pub serve_delay_ms: Option<u64>,
    /// A config preset: the node's `profile` (`edge`).
    pub profile: Option<String>,
    /// Config tables merged over `node_config` for this node only
    /// (`[node.config]`, same layout as the node's config file).
    pub config: toml::Table,
    pub arch: Arch,
    /// With `network = "netns"`: the node's link rate each way, in Mbit/s,
    /// kept by the kernel (none: unshaped).
    pub link_mbps: Option<f64>,
}

/// Where the process backend's nodes talk.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Network {
    /// Every node on the host's loopback.
    #[default]
    Loopback,
    /// Each node in a network namespace of its own, on a bridge, its
    /// `link_mbps` kept by `tc tbf` (needs root; [`crate::netns`]).
    Netns,
}

/// The architecture a node's `shoal` binary is built for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Arch {
    /// The launcher's own `shoal` binary, run directly.
    #[default]
    Native,
    /// An aarch64 Linux build (`scripts/build-aarch64.sh`), run under
    /// user-mode emulation (`qemu-aarch64`) on the process backend.
    Aarch64,
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Arch::Native => std::env::consts::ARCH,
            Arch::Aarch64 => "aarch64",
        })
    }
}

/// How the nodes of a testnet find each other.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Discovery {
    /// Each node is started with the address of a live one (`--bootstrap`),
    /// and mDNS is off.
    #[default]
    Bootstrap,
    /// No addresses: mDNS on the nodes' network. Loopback carries no
    /// multicast, so this needs the docker backend.
    Mdns,
    /// Two docker networks, joined only by a relay node ([`Scenario::relay`]):
    /// the far nodes reach the others, and are reached, through it.
    Relay,
}

/// The relayed topology of a `discovery = "relay"` scenario.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelaySpec {
    /// The node that serves as the relay (`--relay-server`): node 0, on
    /// both networks, started before every other node reserves on it.
    pub node: usize,
    /// Nodes on the far network, which only the relay node shares.
    pub far: Vec<usize>,
}

/// The profiles a node accepts (`shoal node --profile`).
pub const PROFILES: &[&str] = &["edge"];

/// What happens at an event.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Set fault injection on a node.
    Slow { node: usize, serve_delay_ms: Option<u64>, slowdown: Option<f64> },
    /// Kill the node's process (SIGKILL: no handoff).
    Kill { node: usize },
    /// Stop the node's process without closing anything (SIGSTOP; `docker
    /// pause` on docker): its peers' connections stay open and get no reset,
    /// which is how a `docker kill`ed or powered-off machine looks to them.
    /// Only `kill` may follow.
    Freeze { node: usize },
    /// Start a killed node again (same identity; it joins the run).
    Restart { node: usize },
    /// Cut the groups off from each other for `duration`.
    Partition { groups: Vec<Vec<usize>>, duration: Duration },
    /// Start one more node (the next index); it joins the run.
    Add,
    /// Ask a node to leave cleanly.
    Leave { node: usize },
    /// Kill every live node at once (a power cut); needs
    /// `[node_config.checkpoint]` so that the run can resume.
    StopAll,
    /// Start every stopped node again (same identity and checkpoint
    /// folder): the run resumes from the checkpoints.
    StartAll,
}

impl Action {
    /// Whether it changes who is in the run: a kill, freeze, restart, add,
    /// leave, or a stop or start of every node.
    pub fn changes_membership(&self) -> bool {
        !matches!(self, Action::Slow { .. } | Action::Partition { .. })
    }

    /// Whether nodes go without a goodbye: a kill, a freeze, a stop of every node.
    pub fn is_failure(&self) -> bool {
        matches!(self, Action::Kill { .. } | Action::Freeze { .. } | Action::StopAll)
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Slow { node, serve_delay_ms, slowdown } => {
                write!(f, "slow node{node}")?;
                if let Some(d) = serve_delay_ms {
                    write!(f, " serve delay {d} ms")?;
                }
                if let Some(s) = slowdown {
                    write!(f, " slowdown {s}x")?;
                }
                Ok(())
            }
            Action::Kill { node } => write!(f, "kill node{node}"),
            Action::Freeze { node } => write!(f, "freeze node{node}"),
            Action::Restart { node } => write!(f, "restart node{node}"),
            Action::Partition { groups, duration } => {
                write!(f, "partition {groups:?} for {} s", duration.as_secs_f64())
            }
            Action::Add => write!(f, "add a node"),
            Action::Leave { node } => write!(f, "node{node} leaves"),
            Action::StopAll => write!(f, "stop all"),
            Action::StartAll => write!(f, "start all"),
        }
    }
}

/// When an event fires.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum At {
    /// Seconds after training started on every initial node.
    Secs(f64),
    /// Once a live node has reached this training step.
    Step(u64),
    /// Seconds after the event before it ran.
    After(f64),
}

impl fmt::Display for At {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            At::Secs(s) => write!(f, "at {s:.1} s"),
            At::Step(n) => write!(f, "at step {n}"),
            At::After(s) => write!(f, "{s:.1} s after the event before"),
        }
    }
}

/// One event of the timeline.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub at: At,
    /// Line in the scenario file.
    pub line: usize,
    pub action: Action,
}

impl fmt::Display for Event {
    /// `kill node1 (line 7, at step 300)`: how the launcher names an event.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (line {}, {})", self.action, self.line, self.at)
    }
}

/// A validated scenario.
#[derive(Debug, Clone, PartialEq)]
pub struct Scenario {
    pub name: String,
    pub nodes: usize,
    pub run_id: String,
    /// How nodes find each other.
    pub discovery: Discovery,
    /// With [`Discovery::Relay`]: which node relays and which are far.
    pub relay: Option<RelaySpec>,
    /// Where the nodes talk (process backend).
    pub network: Network,
    pub time_limit: Duration,
    /// Passed to every node as its config file (then overridden per node).
    pub node_config: toml::Table,
    /// Overrides by node index (also for nodes added later).
    pub overrides: Vec<(usize, NodeSpec)>,
    /// In the order they run: by time (stable: equal times keep file
    /// order), or in file order once any event is placed by step.
    pub events: Vec<Event>,
    /// What the finished run must show (`[checks]`; empty: nothing).
    pub checks: Checks,
}

/// The `[checks]` table of a scenario: what a soak asserts about the
/// finished run (judged by `crate::checks::judge`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Checks {
    /// Seconds at the start of each node process's life whose memory is not
    /// judged (model, data and pools are allocated then).
    pub warmup_secs: f64,
    /// Largest allowed growth of a node process's RSS after warm-up, as a
    /// fraction of its RSS when warm-up ended.
    pub max_rss_growth: Option<f64>,
    /// Fail when any node closed a BSP round at `round_timeout_ms`.
    pub no_forced_rounds: bool,
    /// Run the scenario again without events; fail when the survivors' mean
    /// final accuracy differs from that run's by more than this many points.
    pub accuracy_within_points: Option<f64>,
    /// Run the scenario again without events; fail when the survivors' mean
    /// final accuracy is more than this many points below that run's. For
    /// runs whose events may help as well as hurt (a mixed testnet under
    /// ASP ended 0.34 to 0.73 points above its all-native twin).
    pub max_accuracy_drop_points: Option<f64>,
    /// Largest allowed peak resident memory (`VmHWM`), in bytes, by node
    /// name (from `max_peak_rss_mib` of a `[[node]]` table).
    pub max_peak_rss: BTreeMap<String, u64>,
    /// Largest allowed peak resident memory of every node process, joiners
    /// included, in bytes (`max_node_peak_rss_mib`).
    pub max_node_peak_rss: Option<u64>,
    /// Rounds forced within this many seconds after a kill (or a freeze)
    /// are counted, not failed: owners wait out the failure timeout for a
    /// worker that died mid-round.
    pub kill_grace_secs: f64,
    /// Every survivor's final test accuracy (0 to 1) at least this.
    pub min_accuracy: Option<f64>,
    /// After each kill, restart, add or leave, every live node's placement
    /// holds the same members, every live node, within this many seconds
    /// (changes that overlap settle together).
    pub views_agree_within_secs: Option<f64>,
}

impl Checks {
    pub fn is_empty(&self) -> bool {
        self.max_rss_growth.is_none()
            && !self.no_forced_rounds
            && self.accuracy_within_points.is_none()
            && self.max_accuracy_drop_points.is_none()
            && self.max_peak_rss.is_empty()
            && self.max_node_peak_rss.is_none()
            && self.min_accuracy.is_none()
            && self.views_agree_within_secs.is_none()
    }

    /// Whether judging needs the same scenario run again without events.
    pub fn needs_fault_free_run(&self) -> bool {
        self.accuracy_within_points.is_some() || self.max_accuracy_drop_points.is_some()
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawScenario {
    nodes: Spanned<i64>,
    run_id: Option<String>,
    discovery: Option<Spanned<String>>,
    network: Option<Spanned<String>>,
    relay: Option<Spanned<RawRelay>>,
    time_limit_secs: Option<Spanned<f64>>,
    #[serde(default)]
    node_config: toml::Table,
    #[serde(default)]
    node: Vec<Spanned<RawNode>>,
    #[serde(default)]
    event: Vec<Spanned<RawEvent>>,
    checks: Option<Spanned<RawChecks>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRelay {
    node: Spanned<i64>,
    far: Spanned<Vec<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawChecks {
    warmup_secs: Option<Spanned<f64>>,
    max_rss_growth: Option<Spanned<f64>>,
    #[serde(default)]
    no_forced_rounds: bool,
    accuracy_within_points: Option<Spanned<f64>>,
    max_accuracy_drop_points: Option<Spanned<f64>>,
    max_node_peak_rss_mib: Option<Spanned<f64>>,
    kill_grace_secs: Option<Spanned<f64>>,
    min_accuracy: Option<Spanned<f64>>,
    views_agree_within_secs: Option<Spanned<f64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNode {
    index: Spanned<i64>,
    batch_size: Option<Spanned<i64>>,
    slowdown: Option<Spanned<f64>>,
    can_aggregate: Option<bool>,
    serve_delay_ms: Option<Spanned<i64>>,
    profile: Option<Spanned<String>>,
    #[serde(default)]
    config: toml::Table,
    arch: Option<Spanned<String>>,
    max_peak_rss_mib: Option<Spanned<f64>>,
    link_mbps: Option<Spanned<f64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEvent {
    at_secs: Option<Spanned<f64>>,
    at_step: Option<Spanned<i64>>,
    after_secs: Option<Spanned<f64>>,
    action: Spanned<String>,
    node: Option<Spanned<i64>>,
    serve_delay_ms: Option<Spanned<i64>>,
    slowdown: Option<Spanned<f64>>,
    groups: Option<Spanned<Vec<Vec<i64>>>>,
    duration_secs: Option<Spanned<f64>>,
}

/// Default bound on a whole testnet.
pub const DEFAULT_TIME_LIMIT_SECS: f64 = 900.0;
/// Longest time limit or partition a scenario may ask for (a week).
pub const MAX_SECS: f64 = 7.0 * 86_400.0;

/// A duration in seconds that `Duration::from_secs_f64` takes and a testnet can use.
fn in_range(secs: f64) -> bool {
    secs.is_finite() && secs > 0.0 && secs <= MAX_SECS
}

impl Scenario {
    pub fn from_file(path: &Path) -> Result<Self, ScenarioError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ScenarioError {
            file: file.clone(),
            line: 0,
            message: format!("cannot read it: {e}"),
        })?;
        let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "scenario".into());
        Self::parse(&text, &file, &name)
    }

    /// Parse and validate `text` (`file` names it in errors).
    pub fn parse(text: &str, file: &str, name: &str) -> Result<Self, ScenarioError> {
        let src = Source { text, file };
        let raw: RawScenario = toml::from_str(text).map_err(|e| ScenarioError {
            file: file.to_string(),
            line: e.span().map(|s| src.line_of(s)).unwrap_or(0),
            message: e.message().to_string(),
        })?;
        let nodes = src.node_count(&raw.nodes)?;
        let time_limit = src.time_limit(raw.time_limit_secs.as_ref())?;
        src.node_config_keys(&raw.node_config)?;
        // Events first: `add` events create the indices overrides may name.
        let mut events = raw.event.iter().map(|ev| src.event(ev)).collect::<Result<Vec<_>, _>>()?;
        src.order(&mut events)?;
        let count = src.replay(&events, nodes, raw.node_config.contains_key("checkpoint"))?;
        src.no_checkpoint_dir(&raw.node_config)?;
        let (overrides, peak_limits) = src.overrides(&raw.node, count)?;
        let mut checks = src.checks(raw.checks.as_ref(), time_limit)?;
        checks.max_peak_rss = peak_limits;
        let discovery = src.discovery(raw.discovery.as_ref())?;
        let relay = src.relay(&raw, discovery, nodes)?;
        let network = src.network(&raw, discovery)?;
        Ok(Scenario {
            name: name.to_string(),
            nodes,
            run_id: raw.run_id.unwrap_or_else(|| format!("testnet-{name}")),
            discovery,
            relay,
            network,
            time_limit: Duration::from_secs_f64(time_limit),
            node_config: raw.node_config,
            overrides,
            events: events.into_iter().map(|e| Event { at: e.at, line: e.line, action: e.action }).collect(),
            checks,
        })
    }

    /// The same testnet with no events and every node native: the
    /// fault-free run a soak (or a mixed-architecture run) compares its
    /// accuracy with (named `<name>-fault-free`, same run id and nodes).
    pub fn without_events(&self) -> Scenario {
        Scenario {
            name: format!("{}-fault-free", self.name),
            events: Vec::new(),
            checks: Checks::default(),
            overrides: self
                .overrides
                .iter()
                .map(|(i, spec)| (*i, NodeSpec { arch: Arch::Native, ..spec.clone() }))
                .collect(),
            ..self.clone()
        }
    }

    /// Whether node `i` sits on the far network of a relay scenario.
    pub fn is_far(&self, i: usize) -> bool {
        self.relay.as_ref().is_some_and(|r| r.far.contains(&i))
    }

    /// Whether any node runs an emulated architecture.
    pub fn has_arch(&self, arch: Arch) -> bool {
        self.overrides.iter().any(|(_, s)| s.arch == arch)
    }

    pub fn node_spec(&self, index: usize) -> NodeSpec {
        self.overrides.iter().find(|(i, _)| *i == index).map(|(_, s)| s.clone()).unwrap_or_default()
    }
}

/// A byte range of the scenario text, as `toml::Spanned` gives it.
type Span = std::ops::Range<usize>;

/// Largest peak resident memory in bytes, by node name ([`Checks::max_peak_rss`]).
type PeakLimits = BTreeMap<String, u64>;

/// An event as parsed, with the span its errors point at.
struct Timed {
    at: At,
    line: usize,
    span: Span,
    action: Action,
}

/// The text being parsed: turns spans into errors that name their line.
/// Each method validates one part of the scenario format.
struct Source<'a> {
    text: &'a str,
    file: &'a str,
}

impl Source<'_> {
    /// The 1-based line `span` starts on.
    fn line_of(&self, span: Span) -> usize {
        self.text[..span.start.min(self.text.len())].matches('\n').count() + 1
    }

    fn err(&self, span: Span, message: String) -> ScenarioError {
        ScenarioError { file: self.file.to_string(), line: self.line_of(span), message }
    }

    /// An error on the first line that starts with `key` (0: none does), for
    /// what the raw TOML table keeps no span of.
    fn err_at_key(&self, key: &str, message: String) -> ScenarioError {
        let line = self.text.lines().position(|l| l.trim_start().starts_with(key)).map_or(0, |i| i + 1);
        ScenarioError { file: self.file.to_string(), line, message }
    }

    /// `nodes`: 1 to 64.
    fn node_count(&self, nodes: &Spanned<i64>) -> Result<usize, ScenarioError> {
        let n = *nodes.get_ref();
        if !(1..=64).contains(&n) {
            return Err(self.err(nodes.span(), format!("nodes = {n}: a testnet has 1 to 64 nodes")));
        }
        Ok(n as usize)
    }

    /// `time_limit_secs`, in seconds.
    fn time_limit(&self, t: Option<&Spanned<f64>>) -> Result<f64, ScenarioError> {
        match t {
            None => Ok(DEFAULT_TIME_LIMIT_SECS),
            Some(t) if in_range(*t.get_ref()) => Ok(*t.get_ref()),
            Some(t) => Err(self
                .err(t.span(), format!("time_limit_secs = {} must be positive and at most {MAX_SECS}", t.get_ref()))),
        }
    }

    /// `[node_config]` holds only the tables a testnet lets a scenario set.
    fn node_config_keys(&self, node_config: &toml::Table) -> Result<(), ScenarioError> {
        for key in node_config.keys() {
            if !NODE_CONFIG_TABLES.contains(&key.as_str()) {
                return Err(self.err_at_key(
                    key,
                    format!(
                        "node_config.{key}: only the tables {} may be set here (run_id, name and identity are \
                         set by the testnet)",
                        NODE_CONFIG_TABLES.join(", ")
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The testnet gives each node its own checkpoint folder.
    fn no_checkpoint_dir(&self, node_config: &toml::Table) -> Result<(), ScenarioError> {
        match node_config.get("checkpoint").and_then(|c| c.get("dir")) {
            None => Ok(()),
            Some(dir) => Err(self.err_at_key(
                "dir",
                format!("node_config.checkpoint.dir = {dir}: the testnet gives each node its own folder in the report"),
            )),
        }
    }

    /// One `[[event]]` table, on its own (the timeline is checked by [`Source::replay`]).
    fn event(&self, ev: &Spanned<RawEvent>) -> Result<Timed, ScenarioError> {
        let span = ev.span();
        let e = ev.get_ref();
        let at = self.at(e, span.clone())?;
        let node = |what: &str| -> Result<usize, ScenarioError> {
            match &e.node {
                None => Err(self.err(span.clone(), format!("`{what}` needs `node = <index>`"))),
                Some(n) if *n.get_ref() < 0 => Err(self.err(n.span(), format!("node {} is negative", n.get_ref()))),
                Some(n) => Ok(*n.get_ref() as usize),
            }
        };
        let action = match e.action.get_ref().as_str() {
            "slow" => {
                let serve_delay_ms = self.non_negative(e.serve_delay_ms.as_ref(), "serve_delay_ms")?;
                let slowdown = self.slowdown(e.slowdown.as_ref())?;
                if serve_delay_ms.is_none() && slowdown.is_none() {
                    return Err(self.err(span, "`slow` needs serve_delay_ms and/or slowdown".into()));
                }
                Action::Slow { node: node("slow")?, serve_delay_ms, slowdown }
            }
            "kill" => Action::Kill { node: node("kill")? },
            "freeze" => Action::Freeze { node: node("freeze")? },
            "restart" => Action::Restart { node: node("restart")? },
            "leave" => Action::Leave { node: node("leave")? },
            "add" => Action::Add,
            "stop_all" => Action::StopAll,
            "start_all" => Action::StartAll,
            "partition" => self.partition(e, span.clone())?,
            other => {
                return Err(self.err(
                    e.action.span(),
                    format!(
                        "unknown action `{other}`: slow, kill, freeze, restart, partition, add, leave, stop_all or \
                         start_all"
                    ),
                ))
            }
        };
        Ok(Timed { at, line: self.line_of(span.clone()), span, action })
    }

    /// An event's `at_secs`, `at_step` or `after_secs`: exactly one, not negative.
    fn at(&self, e: &RawEvent, span: Span) -> Result<At, ScenarioError> {
        let secs = |s: &Spanned<f64>, key: &str| {
            let at = *s.get_ref();
            if !at.is_finite() || at < 0.0 {
                return Err(self.err(s.span(), format!("{key} = {at}: an event time cannot be negative")));
            }
            Ok(at)
        };
        match (&e.at_secs, &e.at_step, &e.after_secs) {
            (Some(s), None, None) => Ok(At::Secs(secs(s, "at_secs")?)),
            (None, None, Some(s)) => Ok(At::After(secs(s, "after_secs")?)),
            (None, Some(n), None) if *n.get_ref() < 0 => {
                Err(self.err(n.span(), format!("at_step = {}: a step cannot be negative", n.get_ref())))
            }
            (None, Some(n), None) => Ok(At::Step(*n.get_ref() as u64)),
            (None, None, None) => {
                Err(self
                    .err(span, "an event needs at_secs = <seconds>, at_step = <step> or after_secs = <seconds>".into()))
            }
            _ => Err(self.err(span, "an event has one of at_secs, at_step and after_secs, not two".into())),
        }
    }

    /// Put the events in the order they run. By time when every event is
    /// placed by time; in file order once any is placed by step or after
    /// another (a step and a time cannot be compared before the run), and
    /// then the steps and the times must each already be in order.
    fn order(&self, events: &mut [Timed]) -> Result<(), ScenarioError> {
        if events.iter().all(|e| matches!(e.at, At::Secs(_))) {
            events.sort_by(|a, b| match (a.at, b.at) {
                (At::Secs(x), At::Secs(y)) => x.total_cmp(&y),
                _ => std::cmp::Ordering::Equal,
            });
            return Ok(());
        }
        let (mut secs, mut step) = (None::<f64>, None::<u64>);
        for e in events.iter() {
            let backwards = match e.at {
                At::Secs(s) => secs.replace(s).is_some_and(|before| s < before),
                At::Step(n) => step.replace(n).is_some_and(|before| n < before),
                At::After(_) => false,
            };
            if backwards {
                return Err(self.err(
                    e.span.clone(),
                    format!(
                        "{}: once an event is placed by at_step or after_secs, events run in file order; list \
                         them in order",
                        e.at
                    ),
                ));
            }
        }
        Ok(())
    }

    /// A `partition` event's groups and duration; `span` is its table's.
    fn partition(&self, e: &RawEvent, span: Span) -> Result<Action, ScenarioError> {
        let Some(g) = &e.groups else {
            return Err(self.err(span, "`partition` needs groups = [[..], [..]]".into()));
        };
        // A negative index becomes usize::MAX, refused with its own message by the replay.
        let groups: Vec<Vec<usize>> = g
            .get_ref()
            .iter()
            .map(|grp| grp.iter().map(|&i| if i < 0 { usize::MAX } else { i as usize }).collect())
            .collect();
        let duration = match &e.duration_secs {
            Some(d) if in_range(*d.get_ref()) => *d.get_ref(),
            Some(d) => {
                return Err(self
                    .err(d.span(), format!("duration_secs = {} must be positive and at most {MAX_SECS}", d.get_ref())))
            }
            None => return Err(self.err(span, "`partition` needs duration_secs".into())),
        };
        if groups.len() < 2 || groups.iter().any(Vec::is_empty) {
            return Err(self.err(g.span(), "a partition needs at least two non-empty groups".into()));
        }
        Ok(Action::Partition { groups, duration: Duration::from_secs_f64(duration) })
    }

    /// Replay the timeline (in order) to check every index against the nodes
    /// that exist at that moment, and restarts against kills. Returns how
    /// many nodes there are once every `add` has run.
    fn replay(&self, events: &[Timed], nodes: usize, checkpoints: bool) -> Result<usize, ScenarioError> {
        let mut life = Lives { count: nodes, dead: BTreeSet::new(), frozen: BTreeSet::new(), checkpoints };
        for e in events {
            life.apply(&e.action).map_err(|message| self.err(e.span.clone(), message))?;
        }
        let still_frozen = |e: &&Timed| matches!(e.action, Action::Freeze { node } if life.frozen.contains(&node));
        if let Some(e) = events.iter().rev().find(still_frozen) {
            return Err(self.err(
                e.span.clone(),
                "a frozen node never finishes: kill it later in the timeline (a stopped process cannot exit)".into(),
            ));
        }
        Ok(life.count)
    }

    /// `serve_delay_ms` or the like: absent, or not negative.
    fn non_negative(&self, v: Option<&Spanned<i64>>, key: &str) -> Result<Option<u64>, ScenarioError> {
        match v {
            None => Ok(None),
            Some(x) if *x.get_ref() < 0 => Err(self.err(x.span(), format!("{key} = {} is negative", x.get_ref()))),
            Some(x) => Ok(Some(*x.get_ref() as u64)),
        }
    }

    /// `slowdown`: absent, or from 1 to 1000.
    fn slowdown(&self, v: Option<&Spanned<f64>>) -> Result<Option<f64>, ScenarioError> {
        match v {
            None => Ok(None),
            Some(s) if s.get_ref().is_finite() && (1.0..=1000.0).contains(s.get_ref()) => Ok(Some(*s.get_ref())),
            Some(s) => Err(self.err(s.span(), format!("slowdown = {} must be between 1 and 1000", s.get_ref()))),
        }
    }

    /// The `[[node]]` tables, for indices below `count` (initial and added
    /// nodes): the overrides by index, and each `max_peak_rss_mib` in bytes
    /// by node name.
    fn overrides(
        &self,
        raw: &[Spanned<RawNode>],
        count: usize,
    ) -> Result<(Vec<(usize, NodeSpec)>, PeakLimits), ScenarioError> {
        let mut overrides: Vec<(usize, NodeSpec)> = Vec::new();
        let mut peak_limits = PeakLimits::new();
        for n in raw {
            let r = n.get_ref();
            let idx = *r.index.get_ref();
            if idx < 0 || idx as usize >= count {
                return Err(self.err(
                    r.index.span(),
                    format!("node index {idx} does not exist (nodes 0..{} including added ones)", count - 1),
                ));
            }
            if overrides.iter().any(|(i, _)| *i == idx as usize) {
                return Err(self.err(r.index.span(), format!("node {idx} has two [[node]] tables")));
            }
            let spec = self.node_spec(r)?;
            if let Some(m) = &r.max_peak_rss_mib {
                if !(m.get_ref().is_finite() && *m.get_ref() > 0.0) {
                    return Err(self.err(m.span(), format!("max_peak_rss_mib = {} must be positive", m.get_ref())));
                }
                peak_limits.insert(format!("node{idx}"), (*m.get_ref() * 1024.0 * 1024.0) as u64);
            }
            overrides.push((idx as usize, spec));
        }
        Ok((overrides, peak_limits))
    }

    /// One `[[node]]` table's settings (its index is checked by the caller).
    fn node_spec(&self, r: &RawNode) -> Result<NodeSpec, ScenarioError> {
        let batch_size = match &r.batch_size {
            None => None,
            Some(b) if *b.get_ref() >= 1 => Some(*b.get_ref() as u64),
            Some(b) => return Err(self.err(b.span(), format!("batch_size = {} must be at least 1", b.get_ref()))),
        };
        let serve_delay_ms = self.non_negative(r.serve_delay_ms.as_ref(), "serve_delay_ms")?;
        let slowdown = self.slowdown(r.slowdown.as_ref())?;
        let profile = match &r.profile {
            None => None,
            Some(p) if PROFILES.contains(&p.get_ref().as_str()) => Some(p.get_ref().clone()),
            Some(p) => {
                return Err(
                    self.err(p.span(), format!("profile = \"{}\" is not one of: {}", p.get_ref(), PROFILES.join(", ")))
                )
            }
        };
        let arch = match r.arch.as_ref().map(|a| (a, a.get_ref().as_str())) {
            None | Some((_, "native")) => Arch::Native,
            Some((_, "aarch64" | "arm64")) => Arch::Aarch64,
            Some((a, other)) => {
                return Err(self.err(a.span(), format!("arch = \"{other}\" is not one of: native, aarch64")))
            }
        };
        let link_mbps = match &r.link_mbps {
            None => None,
            Some(m) if m.get_ref().is_finite() && (0.01..=100_000.0).contains(m.get_ref()) => Some(*m.get_ref()),
            Some(m) => {
                return Err(self.err(m.span(), format!("link_mbps = {} must be from 0.01 to 100000", m.get_ref())))
            }
        };
        Ok(NodeSpec {
            batch_size,
            slowdown,
            can_aggregate: r.can_aggregate,
            serve_delay_ms,
            profile,
            config: r.config.clone(),
            arch,
            link_mbps,
        })
    }

    /// `network`: loopback (the default) or netns, which shapes each
    /// node's `link_mbps` and needs bootstrap discovery; `link_mbps`
    /// needs netns.
    fn network(&self, raw: &RawScenario, discovery: Discovery) -> Result<Network, ScenarioError> {
        let network = match raw.network.as_ref().map(|n| (n, n.get_ref().as_str())) {
            None | Some((_, "loopback")) => Network::Loopback,
            Some((n, "netns")) if discovery != Discovery::Bootstrap => {
                return Err(self.err(n.span(), "network = \"netns\" needs discovery = \"bootstrap\"".into()))
            }
            Some((_, "netns")) => Network::Netns,
            Some((n, other)) => {
                return Err(self.err(n.span(), format!("network = \"{other}\" is not one of: loopback, netns")))
            }
        };
        if network == Network::Loopback {
            if let Some(m) = raw.node.iter().find_map(|n| n.get_ref().link_mbps.as_ref()) {
                return Err(self.err(
                    m.span(),
                    "link_mbps needs network = \"netns\" (loopback has no link to shape; faults.link_mbps \
                     emulates one inside each node)"
                        .into(),
                ));
            }
        }
        Ok(network)
    }

    /// The `[checks]` table (without the per-node peaks, which `[[node]]` sets).
    fn checks(&self, raw: Option<&Spanned<RawChecks>>, time_limit: f64) -> Result<Checks, ScenarioError> {
        let Some(c) = raw else { return Ok(Checks::default()) };
        let c = c.get_ref();
        let positive = |v: &Option<Spanned<f64>>, key: &str, max: f64| match v {
            None => Ok(None),
            Some(x) if x.get_ref().is_finite() && *x.get_ref() >= 0.0 && *x.get_ref() <= max => Ok(Some(*x.get_ref())),
            Some(x) => Err(self.err(x.span(), format!("checks.{key} = {} must be from 0 to {max}", x.get_ref()))),
        };
        let checks = Checks {
            warmup_secs: positive(&c.warmup_secs, "warmup_secs", MAX_SECS)?.unwrap_or(0.0),
            max_rss_growth: positive(&c.max_rss_growth, "max_rss_growth", 100.0)?,
            no_forced_rounds: c.no_forced_rounds,
            accuracy_within_points: positive(&c.accuracy_within_points, "accuracy_within_points", 100.0)?,
            max_accuracy_drop_points: positive(&c.max_accuracy_drop_points, "max_accuracy_drop_points", 100.0)?,
            max_peak_rss: BTreeMap::new(),
            max_node_peak_rss: positive(&c.max_node_peak_rss_mib, "max_node_peak_rss_mib", 1e6)?
                .map(|m| (m * (1u64 << 20) as f64) as u64),
            kill_grace_secs: positive(&c.kill_grace_secs, "kill_grace_secs", MAX_SECS)?.unwrap_or(0.0),
            min_accuracy: positive(&c.min_accuracy, "min_accuracy", 1.0)?,
            views_agree_within_secs: positive(&c.views_agree_within_secs, "views_agree_within_secs", MAX_SECS)?,
        };
        if checks.warmup_secs >= time_limit {
            return Err(self.err(
                c.warmup_secs.as_ref().map_or(0..0, |w| w.span()),
                format!(
                    "checks.warmup_secs = {} leaves nothing of the {time_limit} s time limit to judge",
                    checks.warmup_secs
                ),
            ));
        }
        Ok(checks)
    }

    /// `discovery`: bootstrap (the default), mdns or relay.
    fn discovery(&self, raw: Option<&Spanned<String>>) -> Result<Discovery, ScenarioError> {
        match raw.map(|d| (d, d.get_ref().as_str())) {
            None | Some((_, "bootstrap")) => Ok(Discovery::Bootstrap),
            Some((_, "mdns")) => Ok(Discovery::Mdns),
            Some((_, "relay")) => Ok(Discovery::Relay),
            Some((d, other)) => {
                Err(self.err(d.span(), format!("discovery = \"{other}\" is not one of: bootstrap, mdns, relay")))
            }
        }
    }

    /// The `[relay]` table, which `discovery = "relay"` needs and nothing else takes.
    fn relay(&self, raw: &RawScenario, discovery: Discovery, nodes: usize) -> Result<Option<RelaySpec>, ScenarioError> {
        let r = match (&raw.relay, discovery) {
            (None, Discovery::Relay) => {
                let span = raw.discovery.as_ref().map_or(0..0, |d| d.span());
                return Err(self.err(span, "discovery = \"relay\" needs a [relay] table (node, far)".into()));
            }
            (Some(r), d) if d != Discovery::Relay => {
                return Err(self.err(r.span(), "[relay] needs discovery = \"relay\"".into()));
            }
            (None, _) => return Ok(None),
            (Some(r), _) => r.get_ref(),
        };
        let node = *r.node.get_ref();
        if node != 0 {
            return Err(self.err(
                r.node.span(),
                format!(
                    "relay.node = {node}: the relay must be node 0, started first (every other node takes \
                     a reservation on it as it starts)"
                ),
            ));
        }
        let mut far = Vec::new();
        for &f in r.far.get_ref() {
            if !(0..nodes as i64).contains(&f) || f == node || far.contains(&(f as usize)) {
                return Err(self.err(
                    r.far.span(),
                    format!("relay.far: {f} is not a node other than the relay (nodes 0..{}), once", nodes - 1),
                ));
            }
            far.push(f as usize);
        }
        if far.is_empty() {
            return Err(self.err(r.far.span(), "relay.far names no node: nothing would be relayed".into()));
        }
        if let Some(e) = raw.event.first() {
            return Err(self.err(e.span(), "a relay scenario takes no events (its topology is fixed)".into()));
        }
        Ok(Some(RelaySpec { node: node as usize, far }))
    }
}

/// Which nodes exist, are dead and are frozen at one moment of a timeline.
struct Lives {
    count: usize,
    dead: BTreeSet<usize>,
    frozen: BTreeSet<usize>,
    /// `[node_config.checkpoint]` is set: a full stop can resume.
    checkpoints: bool,
}

impl Lives {
    /// Check `action` against this moment, then apply it; the error is its message.
    fn apply(&mut self, action: &Action) -> Result<(), String> {
        match action {
            Action::Slow { node, .. } | Action::Leave { node } | Action::Freeze { node } => {
                self.exists(*node)?;
                if self.dead.contains(node) {
                    return Err(format!("node {node} is dead at that time"));
                }
                if self.frozen.contains(node) {
                    return Err(format!("node {node} is frozen: only `kill` may follow"));
                }
                if let Action::Freeze { node } = action {
                    self.frozen.insert(*node);
                }
            }
            Action::Kill { node } => {
                self.exists(*node)?;
                self.frozen.remove(node);
                if !self.dead.insert(*node) {
                    return Err(format!("node {node} is already dead"));
                }
            }
            Action::Restart { node } => {
                self.exists(*node)?;
                if !self.dead.remove(node) {
                    return Err(format!("node {node} is not dead: kill it before a restart"));
                }
            }
            Action::Partition { groups, .. } => {
                let mut seen = BTreeSet::new();
                for &n in groups.iter().flatten() {
                    if n == usize::MAX {
                        return Err("a partition group holds a negative index".into());
                    }
                    self.exists(n)?;
                    if !seen.insert(n) {
                        return Err(format!("node {n} is in two partition groups"));
                    }
                }
            }
            Action::Add => self.count += 1,
            Action::StopAll => self.stop_all()?,
            Action::StartAll => {
                if self.dead.is_empty() {
                    return Err("`start_all`: no node is stopped at that time".into());
                }
                self.dead.clear();
            }
        }
        Ok(())
    }

    fn stop_all(&mut self) -> Result<(), String> {
        if !self.checkpoints {
            return Err("`stop_all` needs a [node_config.checkpoint] table (for example every_steps = 50): \
                        without checkpoints the run cannot resume"
                .into());
        }
        if (0..self.count).all(|n| self.dead.contains(&n)) {
            return Err("`stop_all`: every node is already stopped".into());
        }
        self.dead.extend(0..self.count);
        self.frozen.clear();
        Ok(())
    }

    fn exists(&self, n: usize) -> Result<(), String> {
        if n >= self.count {
            return Err(format!("node {n} does not exist (nodes 0..{} at that time)", self.count.saturating_sub(1)));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"nodes = 4
time_limit_secs = 300

[node_config]
training = { steps = 100 }

[[node]]
index = 3
batch_size = 16
slowdown = 2.0

[[event]]
at_secs = 30
action = "kill"
node = 2

[[event]]
at_secs = 10
action = "slow"
node = 3
serve_delay_ms = 25

[[event]]
at_secs = 45
action = "restart"
node = 2

[[event]]
at_secs = 50
action = "partition"
groups = [[0, 1], [2, 3]]
duration_secs = 20

[[event]]
at_secs = 60
action = "add"
"#;

    fn parse(text: &str) -> Result<Scenario, ScenarioError> {
        Scenario::parse(text, "s.toml", "s")
    }

    #[test]
    fn a_relay_topology_parses() -> Result<(), ScenarioError> {
        let s = parse("nodes = 4\ndiscovery = \"relay\"\n\n[relay]\nnode = 0\nfar = [3, 2]\n")?;
        assert_eq!(s.discovery, Discovery::Relay);
        assert_eq!(s.relay, Some(RelaySpec { node: 0, far: vec![3, 2] }));
        assert!(s.is_far(2) && s.is_far(3) && !s.is_far(0) && !s.is_far(1));
        assert_eq!(parse("nodes = 2\n")?.relay, None);
        let with_event =
            "nodes = 4\ndiscovery = \"relay\"\n[relay]\nnode = 0\nfar = [3]\n\n[[event]]\nat_secs = 5\naction = \"kill\"\nnode = 3\n";
        match parse(with_event) {
            Err(e) => assert!(e.message.contains("takes no events") && e.line == 7, "{e}"),
            Ok(_) => panic!("a relay scenario with an event parsed"),
        }
        Ok(())
    }

    #[test]
    fn edge_arm_and_mdns_nodes_parse_and_mistakes_name_their_line() -> Result<(), ScenarioError> {
        let text = "nodes = 4\ndiscovery = \"mdns\"\n\n[[node]]\nindex = 3\nprofile = \"edge\"\narch = \"aarch64\"\nmax_peak_rss_mib = 64\n\n[node.config.cluster]\nheartbeat_ms = 50\n";
        let s = parse(text)?;
        assert_eq!(s.discovery, Discovery::Mdns);
        let spec = s.node_spec(3);
        assert_eq!(spec.profile.as_deref(), Some("edge"));
        assert_eq!(spec.config["cluster"]["heartbeat_ms"].as_integer(), Some(50));
        assert_eq!(spec.arch, Arch::Aarch64);
        assert!(s.has_arch(Arch::Aarch64));
        assert_eq!(s.checks.max_peak_rss.get("node3"), Some(&(64 << 20)));
        assert!(!s.checks.is_empty());
        // The all-native baseline keeps the profile and drops the emulation.
        let base = s.without_events();
        assert_eq!(base.node_spec(3).arch, Arch::Native);
        assert_eq!(base.node_spec(3).profile.as_deref(), Some("edge"));
        assert_eq!(parse("nodes = 2\n")?.discovery, Discovery::Bootstrap);
        for (bad, line, says) in [
            ("nodes = 4\n[[node]]\nindex = 1\nprofile = \"tiny\"\n", 4, "not one of: edge"),
            ("nodes = 4\n[[node]]\nindex = 1\narch = \"riscv\"\n", 4, "native, aarch64"),
            ("nodes = 4\n[[node]]\nindex = 1\nmax_peak_rss_mib = 0\n", 4, "must be positive"),
            ("nodes = 4\ndiscovery = \"dht\"\n", 2, "bootstrap, mdns, relay"),
            ("nodes = 4\ndiscovery = \"relay\"\n", 2, "needs a [relay] table"),
            ("nodes = 4\n[relay]\nnode = 0\nfar = [3]\n", 2, "needs discovery = \"relay\""),
            ("nodes = 4\ndiscovery = \"relay\"\n[relay]\nnode = 2\nfar = [3]\n", 4, "must be node 0"),
            ("nodes = 4\ndiscovery = \"relay\"\n[relay]\nnode = 0\nfar = [4]\n", 5, "is not a node"),
            ("nodes = 4\ndiscovery = \"relay\"\n[relay]\nnode = 0\nfar = [0]\n", 5, "other than the relay"),
            ("nodes = 4\ndiscovery = \"relay\"\n[relay]\nnode = 0\nfar = []\n", 5, "names no node"),
        ] {
            let e = parse(bad).err().unwrap_or_else(|| panic!("accepted: {bad}"));
            assert_eq!(e.line, line, "{e}");
            assert!(e.message.contains(says), "{e}");
        }
        Ok(())
    }

    #[test]
    fn a_full_scenario_parses_in_time_order() {
        let s = match parse(GOOD) {
            Ok(s) => s,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(s.nodes, 4);
        assert_eq!(s.time_limit, Duration::from_secs(300));
        let times: Vec<At> = s.events.iter().map(|e| e.at).collect();
        assert_eq!(times, [10.0, 30.0, 45.0, 50.0, 60.0].map(At::Secs));
        assert_eq!(s.events[0].action, Action::Slow { node: 3, serve_delay_ms: Some(25), slowdown: None });
        assert_eq!(s.events[0].line, 17, "the slow event's table starts on line 17");
        assert_eq!(s.node_spec(3).batch_size, Some(16));
        assert_eq!(s.node_spec(1), NodeSpec::default());
        assert_eq!(s.run_id, "testnet-s");
    }

    #[test]
    fn errors_point_at_the_line() {
        let bad_node = GOOD.replace("node = 2\n\n[[event]]\nat_secs = 10", "node = 7\n\n[[event]]\nat_secs = 10");
        let e = parse(&bad_node).err().map(|e| e.to_string());
        assert_eq!(e.as_deref(), Some("s.toml:12: node 7 does not exist (nodes 0..3 at that time)"));
        let negative = GOOD.replace("at_secs = 45", "at_secs = -5");
        let e = parse(&negative).err().map(|e| (e.line, e.message));
        assert_eq!(e, Some((24, "at_secs = -5: an event time cannot be negative".into())));
        let e = parse(&GOOD.replace("action = \"add\"", "action = \"explode\"")).err().map(|e| e.line);
        assert_eq!(e, Some(36));
        let e = parse(&GOOD.replace("batch_size = 16", "batch_size = 0")).err().map(|e| e.line);
        assert_eq!(e, Some(9));
        let e = parse("nodes = 4\n[[event]]\nat_secs = 1\naction = \"kill\"\nnode = 1\nbogus = 3\n").err();
        assert!(e.as_ref().is_some_and(|e| e.message.contains("bogus")), "{e:?}");
        let e = parse("nodes = 4\n[[event]]\nat_secs = 1\naction = \"restart\"\nnode = 1\n").err().map(|e| e.line);
        assert_eq!(e, Some(2), "a restart needs a kill first");
        let e = parse("nodes = 0\n").err().map(|e| e.line);
        assert_eq!(e, Some(1));
        let e = parse("nodes = 2\ntime_limit_secs = 1e20\n").err().map(|e| e.line);
        assert_eq!(e, Some(2), "a huge time is refused, not a panic");
        // Added nodes exist after their `add`.
        assert!(parse("nodes = 2\n[[event]]\nat_secs = 1\naction = \"add\"\n[[event]]\nat_secs = 2\naction = \"kill\"\nnode = 2\n").is_ok());
        assert!(parse("nodes = 2\n[[event]]\nat_secs = 1\naction = \"kill\"\nnode = 2\n").is_err());
    }

    #[test]
    fn a_frozen_node_can_only_be_killed_and_must_be() {
        let ev = |at: u32, action: &str| format!("[[event]]\nat_secs = {at}\naction = \"{action}\"\nnode = 1\n");
        let ok = format!("nodes = 3\n{}{}", ev(5, "freeze"), ev(9, "kill"));
        let s = parse(&ok).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.events[0].action, Action::Freeze { node: 1 });
        let e = parse(&format!("nodes = 3\n{}", ev(5, "freeze"))).err().map(|e| (e.line, e.message));
        assert!(e.as_ref().is_some_and(|(l, m)| *l == 2 && m.contains("never finishes")), "{e:?}");
        let e = parse(&format!("nodes = 3\n{}{}{}", ev(5, "freeze"), ev(6, "leave"), ev(9, "kill"))).err();
        assert!(e.as_ref().is_some_and(|e| e.line == 6 && e.message.contains("only `kill`")), "{e:?}");
    }

    #[test]
    fn checks_parse_and_bad_values_point_at_their_line() {
        let text = "nodes = 2\ntime_limit_secs = 300\n[checks]\nwarmup_secs = 60\nmax_rss_growth = 0.1\n\
                    no_forced_rounds = true\naccuracy_within_points = 0.5\nmax_accuracy_drop_points = 0.25\n\
                    min_accuracy = 0.9\nmax_node_peak_rss_mib = 2\nkill_grace_secs = 30\nviews_agree_within_secs = 60\n";
        let s = parse(text).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            s.checks,
            Checks {
                warmup_secs: 60.0,
                max_rss_growth: Some(0.1),
                no_forced_rounds: true,
                accuracy_within_points: Some(0.5),
                max_accuracy_drop_points: Some(0.25),
                max_peak_rss: BTreeMap::new(),
                max_node_peak_rss: Some(2 << 20),
                kill_grace_secs: 30.0,
                min_accuracy: Some(0.9),
                views_agree_within_secs: Some(60.0),
            }
        );
        let base = s.without_events();
        assert!(base.events.is_empty() && base.checks.is_empty());
        assert_eq!(base.name, "s-fault-free");
        assert_eq!(base.run_id, s.run_id);
        assert!(parse("nodes = 2\n").map(|s| s.checks.is_empty()).unwrap_or(false));
        let e = parse(&text.replace("0.1", "-0.1")).err().map(|e| (e.line, e.message));
        assert_eq!(e, Some((5, "checks.max_rss_growth = -0.1 must be from 0 to 100".into())));
        let e = parse(&text.replace("warmup_secs = 60", "warmup_secs = 300")).err().map(|e| e.line);
        assert_eq!(e, Some(4), "a warm-up as long as the run is refused");
        let e = parse(&text.replace("no_forced_rounds", "no_forced_round")).err();
        assert!(e.as_ref().is_some_and(|e| e.message.contains("no_forced_round")), "{e:?}");
        let e = parse(&text.replace("min_accuracy = 0.9", "min_accuracy = 90")).err().map(|e| (e.line, e.message));
        assert_eq!(e, Some((9, "checks.min_accuracy = 90 must be from 0 to 1".into())));
    }

    #[test]
    fn a_full_stop_needs_checkpoints_and_a_stopped_cluster_to_start() {
        let stop = "[[event]]\nat_secs = 5\naction = \"stop_all\"\n";
        let start = "[[event]]\nat_secs = 8\naction = \"start_all\"\n";
        let ok = format!("nodes = 3\n[node_config.checkpoint]\nevery_steps = 20\n{stop}{start}");
        let s = parse(&ok).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            s.events.iter().map(|e| e.action.clone()).collect::<Vec<_>>(),
            vec![Action::StopAll, Action::StartAll]
        );
        let e = parse(&format!("nodes = 3\n{stop}")).err().map(|e| (e.line, e.message));
        assert!(e.as_ref().is_some_and(|(l, m)| *l == 2 && m.contains("[node_config.checkpoint]")), "{e:?}");
        let e = parse(&format!("nodes = 3\n[node_config.checkpoint]\nevery_steps = 20\n{start}")).err();
        assert!(e.as_ref().is_some_and(|e| e.message.contains("no node is stopped")), "{e:?}");
        let e = parse("nodes = 3\n[node_config.checkpoint]\ndir = \"/tmp/x\"\n").err().map(|e| (e.line, e.message));
        assert!(e.as_ref().is_some_and(|(l, m)| *l == 3 && m.contains("its own folder")), "{e:?}");
    }

    #[test]
    fn events_placed_by_step_run_in_file_order_and_each_kind_must_be_in_order() {
        let ev = |at: &str, action: &str| format!("[[event]]\n{at}\naction = \"{action}\"\n");
        let head = "nodes = 3\n[node_config.checkpoint]\nevery_steps = 20\n";
        let text = format!("{head}{}{}", ev("at_step = 300", "stop_all"), ev("after_secs = 2", "start_all"));
        let s = parse(&text).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.events.iter().map(|e| e.at).collect::<Vec<_>>(), vec![At::Step(300), At::After(2.0)]);
        assert_eq!(s.events[0].action, Action::StopAll, "file order, not time order");
        // Without a step event the timeline is sorted by time, as before.
        let by_time = format!("{head}{}{}", ev("at_secs = 9", "stop_all"), ev("at_secs = 2", "start_all"));
        let e = parse(&by_time).err();
        assert!(e.is_some_and(|e| e.message.contains("no node is stopped")), "sorted: the 2 s start runs first");
        let backwards = format!(
            "{head}{}{}{}",
            ev("at_step = 300", "stop_all"),
            ev("at_secs = 1", "start_all"),
            ev("at_step = 100", "stop_all")
        );
        let e = parse(&backwards).err().map(|e| (e.line, e.message));
        assert!(
            e.as_ref().is_some_and(|(l, m)| *l == 10 && m.contains("at step 100") && m.contains("file order")),
            "{e:?}"
        );
        for (at, msg) in [
            ("at_step = -1", "a step cannot be negative"),
            ("at_step = 5\nat_secs = 1", "not two"),
            ("after_secs = -2", "after_secs = -2: an event time cannot be negative"),
            ("slowdown = 2.0", "needs at_secs = <seconds>, at_step = <step> or after_secs = <seconds>"),
        ] {
            let e = parse(&format!("nodes = 3\n[[event]]\n{at}\naction = \"kill\"\nnode = 2\n")).err();
            assert!(e.as_ref().is_some_and(|e| e.message.contains(msg)), "{at}: {e:?}");
        }
    }

    #[test]
    fn shaped_links_need_namespaces_and_a_sane_rate() {
        let s = parse("nodes = 2\nnetwork = \"netns\"\n[[node]]\nindex = 1\nlink_mbps = 20\n")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.network, Network::Netns);
        assert_eq!((s.node_spec(0).link_mbps, s.node_spec(1).link_mbps), (None, Some(20.0)));
        assert_eq!(parse("nodes = 2\n").map(|s| s.network).ok(), Some(Network::Loopback));
        for (text, line, msg) in [
            ("nodes = 2\n[[node]]\nindex = 1\nlink_mbps = 20\n", 4, "needs network = \"netns\""),
            ("nodes = 2\nnetwork = \"netns\"\n[[node]]\nindex = 1\nlink_mbps = 0\n", 5, "from 0.01"),
            ("nodes = 2\nnetwork = \"wifi\"\n", 2, "not one of: loopback, netns"),
            ("nodes = 2\ndiscovery = \"mdns\"\nnetwork = \"netns\"\n", 3, "needs discovery = \"bootstrap\""),
        ] {
            let e = parse(text).err().map(|e| (e.line, e.message));
            assert!(e.as_ref().is_some_and(|(l, m)| *l == line && m.contains(msg)), "{text}: {e:?}");
        }
    }
}
