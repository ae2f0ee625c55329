//! `NodeConfig`: one TOML file, every field overridable by a flag.
//!
//! Every limit and timeout lives here (or in the embedded
//! [`ProtocolConfig`], the `[network]` table) with a documented default.
//! See `docs/operations.md` and `testnet/node.example.toml`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use shoal_models::{ArchKind, DatasetKind, DeviceKind, GptSize, ModelConfig, OptimizerConfig, OptimizerKind};
use shoal_protocol::libp2p::Multiaddr;
use shoal_protocol::{ProtocolConfig, RunId};

pub use crate::policy::schedule::LrDecay;
use crate::policy::schedule::LrSchedule;
use crate::policy::sync::SyncPolicy;

/// How a cluster shares what it learns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Parameter-server style: push gradients to shard owners, pull shards.
    #[default]
    Pull,
    /// No owners: train locally and average with random peers every k steps.
    Gossip,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "pull" => Ok(Mode::Pull),
            "gossip" => Ok(Mode::Gossip),
            o => Err(format!("unknown mode `{o}`: expected pull or gossip")),
        }
    }
}

/// How many nodes own shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(into = "AggregatorsRepr", try_from = "AggregatorsRepr")]
pub enum Aggregators {
    /// Explore the number (PSLD): start from `cluster.start_aggregators`,
    /// add an owner while communication dominates step time, remove an idle
    /// one, keep a change only if step time improves.
    #[default]
    Auto,
    /// Every capable node owns shards.
    All,
    /// At most this many (at least 1).
    Fixed(u16),
}

#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum AggregatorsRepr {
    Count(i64),
    Word(String),
}

impl From<Aggregators> for AggregatorsRepr {
    fn from(a: Aggregators) -> Self {
        match a {
            Aggregators::Auto => AggregatorsRepr::Word("auto".into()),
            Aggregators::All => AggregatorsRepr::Word("all".into()),
            Aggregators::Fixed(n) => AggregatorsRepr::Count(n as i64),
        }
    }
}

impl TryFrom<AggregatorsRepr> for Aggregators {
    type Error = String;
    fn try_from(r: AggregatorsRepr) -> Result<Self, String> {
        match r {
            AggregatorsRepr::Count(n) => n.to_string().parse(),
            AggregatorsRepr::Word(w) => w.parse(),
        }
    }
}

impl std::str::FromStr for Aggregators {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Aggregators::Auto),
            "all" => Ok(Aggregators::All),
            n => match n.parse::<u16>() {
                Ok(k) if k >= 1 => Ok(Aggregators::Fixed(k)),
                _ => Err(format!("aggregators `{n}`: expected auto, all or a count from 1 to {}", u16::MAX)),
            },
        }
    }
}

impl std::fmt::Display for Aggregators {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Aggregators::Auto => write!(f, "auto"),
            Aggregators::All => write!(f, "all"),
            Aggregators::Fixed(n) => write!(f, "{n}"),
        }
    }
}

/// What to train.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainingConfig {
    /// `mlp`, `cnn` or `gpt` (a transformer language model; needs a
    /// `text:PATH` data set). Default `mlp`.
    pub model: ArchKind,
    /// MLP hidden widths. Default `[256, 128]`.
    pub mlp_hidden: Option<Vec<usize>>,
    /// GPT size: `{ layers, heads, width }`. Default 4 layers, 4 heads,
    /// width 128 (its context is the text data set's).
    pub gpt: Option<GptSize>,
    /// `digits` (embedded), `fashion-mnist`, or `text:PATH` / `text@N:PATH`
    /// (a UTF-8 file, in windows of 64 or N bytes). Default `digits`.
    pub dataset: DatasetKind,
    /// Where to look for Fashion-MNIST. Default: ./data, then /usr/share/datasets.
    pub data_dir: Option<PathBuf>,
    /// Samples per step on this node (nodes may differ). Default 32.
    pub batch_size: usize,
    /// `sgd` or `adamw`. Default `sgd` (momentum 0.9, Nesterov).
    pub optimizer: OptimizerKind,
    /// Learning rate. Default: 0.05 for sgd, 2e-3 for adamw.
    pub lr: Option<f64>,
    /// SGD momentum (Nesterov while above 0), from 0 to below 1. Default
    /// 0.9. Only with `optimizer = "sgd"`.
    pub momentum: Option<f64>,
    /// `none` or `cosine` (from `lr` down to `lr / 100` over `steps`; in
    /// pull mode the shard owners follow it by the shard's version). Default `none`.
    pub lr_decay: LrDecay,
    /// Seed of weight init and data order; must match across the run. Default 42.
    pub seed: u64,
    /// Training steps each worker takes. Default 300.
    pub steps: u64,
    /// Evaluate on the test set every this many steps (0: only at the end). Default 0.
    pub eval_every: u64,
    /// `cpu`, `cuda[:N]` or `metal[:N]`. Default `cpu`.
    pub device: DeviceKind,
    /// Threads for this node's tensor work. Default: the host's cores
    /// divided by the nodes that this process or testnet starts on it.
    pub threads: Option<usize>,
}

impl Default for TrainingConfig {
    fn default() -> Self {
        Self {
            model: ArchKind::Mlp,
            mlp_hidden: None,
            gpt: None,
            dataset: DatasetKind::Digits,
            data_dir: None,
            batch_size: 32,
            optimizer: OptimizerKind::Sgd,
            lr: None,
            momentum: None,
            lr_decay: LrDecay::None,
            seed: 42,
            steps: 300,
            eval_every: 0,
            device: DeviceKind::Cpu,
            threads: None,
        }
    }
}

impl TrainingConfig {
    pub fn optimizer_config(&self) -> OptimizerConfig {
        let cfg = OptimizerConfig::new(
            self.optimizer,
            self.lr.unwrap_or_else(|| OptimizerConfig::default_lr(self.optimizer)),
        );
        match (cfg, self.momentum) {
            (OptimizerConfig::Sgd { lr, weight_decay, .. }, Some(m)) => {
                OptimizerConfig::Sgd { lr, momentum: m, nesterov: m > 0.0, weight_decay }
            }
            (cfg, _) => cfg,
        }
    }

    /// The learning-rate schedule of the run.
    pub fn lr_schedule(&self) -> LrSchedule {
        LrSchedule { base: self.optimizer_config().lr(), decay: self.lr_decay, steps: self.steps }
    }
}

/// How the cluster forms and synchronises.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// `pull` (shard owners) or `gossip`. Default `pull`.
    pub mode: Mode,
    /// `bsp`, `ssp:N`, `dssp:LO-HI` or `asp`. Default `bsp`.
    pub sync: SyncPolicy,
    /// Training starts once this many nodes (this one included) agree on the
    /// roster. Default 1.
    pub min_peers: usize,
    /// Number of shards the model is cut into. Default 8.
    pub shards: u32,
    /// Whether this node may own shards. Default true.
    pub can_aggregate: bool,
    /// The memory this node offers for owning shards, bytes, gossiped in
    /// its heartbeats (`capabilities.memory_bytes`). The election gives an
    /// owner no more shards than fit in it (`policy::placement`). 0 (the
    /// default): what the machine (or its container's cgroup) had left
    /// when the node started.
    pub memory_bytes: u64,
    /// Multiaddrs (with `/p2p/<peer id>`) to dial at start.
    pub bootstrap: Vec<Multiaddr>,
    /// Heartbeat period. Default 300 ms.
    pub heartbeat_ms: u64,
    /// A peer silent this long is considered failed. Default 5000 ms.
    pub failure_timeout_ms: u64,
    /// Give up (non-zero exit) if the roster has not formed by then. Default 60000 ms.
    pub start_timeout_ms: u64,
    /// How long to keep dialling the bootstrap peers (each failed dial is
    /// retried with backoff; one that answers is enough). Default 10000 ms.
    pub dial_timeout_ms: u64,
    /// Gossip mode: average with a random peer every this many steps. Default 5.
    pub gossip_every: u64,
    /// Total deadline of one push or pull, retries included; past it the node
    /// fails with an error naming the shard and owner. Default 30000 ms.
    pub request_timeout_ms: u64,
    /// After finishing, keep serving shards until every roster peer has
    /// finished or this long has passed. Default 60000 ms.
    pub linger_ms: u64,
    /// Capacity of every actor's command channel. Default 256.
    pub channel_capacity: usize,
    /// Elastic roles: demote slow shard owners and move their shards.
    /// `false` keeps the assignment fixed except for failures. Default true.
    pub elastic: bool,
    /// Demote an owner whose median service time is this many times the
    /// cluster's norm. Default 3.0.
    pub demote_ratio: f64,
    /// A demoted owner may own shards again once within this ratio of the
    /// norm (hysteresis). Default 1.5.
    pub restore_ratio: f64,
    /// ... and is also slower than the norm by at least this many ms per
    /// push (a floor against scheduling noise on fast links). Default 5.
    pub straggler_min_excess_ms: f64,
    /// How many nodes own shards: `"auto"` (explore, as in PSLD), `"all"`
    /// (every capable node) or a count. Default `"auto"`.
    pub aggregators: Aggregators,
    /// With `aggregators = "auto"`: how many to start from; 0 starts from
    /// every capable node. Default 0.
    pub start_aggregators: u16,
    /// With `aggregators = "auto"`: steps per measurement window (the first
    /// decision comes after a quarter of one); a change of the number of
    /// aggregators is judged one settled window later. Default 60.
    pub explore_window_steps: u64,
    /// With `aggregators = "auto"`: an aggregator is removed (in a trial)
    /// when the median share of step time spent exchanging shards is at
    /// most this, from 0 up to (not including) 0.5, the share at which one
    /// is added. Default 0.05.
    pub explore_idle_share: f64,
    /// Workers forget an owner's service time after this many steps without
    /// pushing to it, so a demoted owner gets another try. Default 100.
    pub service_forget_steps: u64,
    /// Send each remote owner one `PushPull` per shard and step (the push
    /// and its pull in one exchange); `false` sends a `PushGrad` and a
    /// `PullShard`. Default true.
    pub push_pull: bool,
    /// With `push_pull`: send each remote owner of two or more shards one
    /// `PushPullMany` per step carrying all of them, instead of one
    /// `PushPull` per shard. Default true.
    pub push_pull_many: bool,
    /// Copies of each shard: 2 keeps a replica on the next rendezvous choice;
    /// 1 keeps none. Default 2.
    pub replicas: u32,
    /// Send the replica every this many versions: the most versions a
    /// single failure can lose. Default 4.
    pub replica_every: u64,
    /// How long a new owner waits for a live old owner's transfer before it
    /// restores the shard from a replica. Default 5000 ms.
    pub handoff_timeout_ms: u64,
    /// BSP: a round that has waited this long for its last gradients is
    /// applied with the ones it has; the missing workers catch up. Must be
    /// below `request_timeout_ms`. Default 10000 ms.
    pub round_timeout_ms: u64,
    /// Fault injection for tests and benchmarks: answer every push and pull
    /// this node serves as an owner this many ms late. Default 0.
    pub fault_delay_ms: u64,
    /// Fault injection: stretch every gradient computation to this many
    /// times its length (a slow machine). Default 1.0 (none).
    pub slowdown: f64,
    /// Fault injection: send the shard states this node serves as an owner
    /// over an emulated link of this many Mbit/s, one after another (a slow
    /// uplink). Default 0 (none).
    pub fault_serve_mbps: f64,
    /// Link emulation for tests and benchmarks: this node's link to its
    /// peers runs at this many Mbit/s in each direction (pushes and served
    /// answers queue on the way out, pulled and pushed tensors on the way
    /// in). Default 0 (none).
    pub link_mbps: f64,
    /// Link emulation: one-way latency added to every message this node
    /// sends, in ms. Default 0.
    pub link_latency_ms: f64,
    /// How a shard owner combines a BSP round's gradients: `mean`,
    /// `trimmed_mean:F`, `median` or `centered_clip:TAU` (see
    /// `policy::robust`). The robust rules need `sync = "bsp"`. Default
    /// `mean`.
    pub aggregation: crate::policy::robust::Aggregation,
    /// Owners reject a gradient whose L2 norm exceeds this many times the
    /// median norm of its round (BSP) or of the last 16 accepted pushes
    /// (SSP, DSSP, ASP; after the shard's first 64 pushes). 0 turns the check
    /// off. Default: 50 under BSP and off under the other policies: single
    /// honest batch gradients late in training exceeded 20x the median of
    /// their round or window, and a tighter K dropped them.
    pub norm_check: Option<f32>,
    /// Each worker pushes the moving average of its gradients,
    /// `m = b * m + (1 - b) * g`, instead of the raw gradient: with `b` near
    /// 0.9 the honest pushes vary far less, so the robust rules tell them
    /// from a bad peer's (Karimireddy, He and Jaggi, 2021). Pull mode only;
    /// pair it with `training.momentum = 0` and a learning rate about
    /// `1 / (1 - b)` times larger. Default 0 (raw gradients).
    pub worker_momentum: f32,
    /// Fault injection for robustness tests: this node's pushed gradients
    /// are `none` (honest), `scale:F` (multiplied by F), `sign_flip`
    /// (negated) or `random` (random values with the honest norm).
    /// Default `none`.
    pub fault_byzantine: crate::ops::faults::Byzantine,
    /// What this node sends: `push = "none" | "bf16" | "int8" |
    /// "topk:FRACTION"` for its gradients (the lossy ones with error
    /// feedback), `pull = "none" | "bf16"` for the parameters it pulls.
    /// Each node chooses its own; owners accept any. Pull mode only.
    /// Default `none` for both.
    pub compression: crate::policy::compress::CompressionConfig,
    /// Overlap communication with compute: a worker computes step t+1's
    /// gradients on the parameters it has while step t's pushes and pulls
    /// are on the wire, so a step costs about max(compute, communication)
    /// instead of their sum. Each worker is then one step staler, and the
    /// owners' clock bound is one lower to keep the policy's bound on the
    /// parameters a worker computes on (`SyncPolicy::pipelined`). Needs
    /// `ssp:N` with N >= 1, `dssp:LO-HI` with LO >= 1, or `asp`: under BSP
    /// the next forward pass needs every shard's new version. Default false.
    pub overlap: bool,
    /// A slow worker under BSP trains on a smaller batch, sized so that its
    /// step computes in about the time the other workers' steps take (their
    /// step time less communication, from heartbeats), instead of holding
    /// every round back; owners weigh its gradient by its samples. Only a
    /// worker at least 2x slower than the others shrinks, to at least a
    /// sixteenth of `training.batch_size` (`policy::fit`). Needs
    /// `mode = "pull"`, `sync = "bsp"` and `local_steps = 1`. Default false.
    pub fit_batch: bool,
    /// With `fit_batch`: the workers that keep their full batch take on the
    /// samples the fitted ones shed, spread evenly (each from the rest of
    /// its own partition's epoch, at most twice its batch), so a round still
    /// holds the configured global batch (`policy::fit::rebalanced`).
    /// Workers gossip the share of their batch they trained on
    /// (`Pace::batch_permille`). Default true; false: the fitted worker's
    /// shortfall is simply lost from each round.
    pub fit_rebalance: bool,
    /// Backup workers (Chen et al., "Revisiting distributed synchronous
    /// SGD"): a BSP round is applied as soon as all but this many of its
    /// workers have pushed, so the slowest `backup_workers` never hold a
    /// round back. A push that arrives after its round was applied is
    /// dropped (its samples are counted in `/status` as `dropped_samples`),
    /// and that worker skips ahead to the round in progress. Needs
    /// `mode = "pull"`, `sync = "bsp"` and `local_steps = 1`; a round always
    /// waits for at least one push. Default 0: every round waits for every
    /// worker.
    pub backup_workers: u32,
    /// DiLoCo: each worker takes this many local steps with its own
    /// optimizer (`training.optimizer`, AdamW in DiLoCo) before it pushes
    /// the pseudo-gradient (its parameters at the start of the H steps
    /// minus its parameters now); the owners apply it with an outer
    /// Nesterov SGD (`outer_lr`, `outer_momentum`). 1: every step pushes
    /// its gradient (no local steps). Needs `mode = "pull"` and
    /// `sync = "bsp"`. Default 1.
    pub local_steps: u64,
    /// With `local_steps` > 1: the owners' outer learning rate. Default 0.7
    /// (DiLoCo's).
    pub outer_lr: f64,
    /// With `local_steps` > 1: the owners' outer Nesterov momentum. Default
    /// 0.9 (DiLoCo's).
    pub outer_momentum: f64,
}

impl ClusterConfig {
    /// The fault injections and the emulated link this config sets, or what
    /// is wrong with them (named by key).
    pub fn faults(&self) -> Result<crate::ops::faults::Faults, String> {
        let f = crate::ops::faults::Faults::new(self.fault_delay_ms, self.slowdown)?;
        f.set_serve_mbps(self.fault_serve_mbps)?;
        f.set_link(self.link_mbps, self.link_latency_ms)?;
        Ok(f)
    }

    /// The straggler detector's thresholds for a model of `params` values
    /// in `shards` shards: the floor `straggler_min_excess_ms` is per push,
    /// reports are per MiB of the mean shard, and gossiped compute rates by
    /// the time they add to a step. Static roles judge nobody slow
    /// (only failures move shards).
    pub fn health_policy(&self, params: usize, shards: usize) -> crate::policy::health::HealthPolicy {
        use crate::policy::health::HealthPolicy;
        if !self.elastic {
            return HealthPolicy {
                demote_ratio: f64::INFINITY,
                restore_ratio: f64::INFINITY,
                min_excess_micros_per_mib: f64::INFINITY,
                min_excess_micros_per_step: f64::INFINITY,
            };
        }
        let shard_mib = (params as f64 * 4.0 / shards.max(1) as f64) / (1024.0 * 1024.0);
        HealthPolicy {
            demote_ratio: self.demote_ratio,
            restore_ratio: self.restore_ratio,
            min_excess_micros_per_mib: self.straggler_min_excess_ms * 1e3 / shard_mib.max(f64::MIN_POSITIVE),
            min_excess_micros_per_step: self.straggler_min_excess_ms * 1e3,
        }
    }

    /// The norm check's factor K in force (0: off): `norm_check`, or 50
    /// under BSP and off under the other policies.
    pub fn norm_check_factor(&self) -> f32 {
        self.norm_check.unwrap_or(if self.sync == SyncPolicy::Bsp { 50.0 } else { 0.0 })
    }

    /// Owners apply BSP rounds: pull mode under `sync = "bsp"`.
    pub fn bsp_rounds(&self) -> bool {
        self.mode == Mode::Pull && self.sync == SyncPolicy::Bsp
    }

    /// BSP rounds of one step each (no local steps): every worker takes
    /// each step together, and a shard's version counts the steps taken.
    pub fn lockstep(&self) -> bool {
        self.bsp_rounds() && self.local_steps <= 1
    }

    /// What a setting that needs [`Self::lockstep`] says it needs, with what
    /// this config has instead.
    fn lockstep_needs(&self) -> String {
        format!(
            "mode = \"pull\", sync = \"bsp\" and local_steps = 1 (this config has {:?}, sync {}, local_steps {})",
            self.mode, self.sync, self.local_steps
        )
    }
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            mode: Mode::Pull,
            sync: SyncPolicy::Bsp,
            min_peers: 1,
            shards: 8,
            can_aggregate: true,
            memory_bytes: 0,
            bootstrap: Vec::new(),
            heartbeat_ms: 300,
            failure_timeout_ms: 5_000,
            start_timeout_ms: 60_000,
            dial_timeout_ms: 10_000,
            gossip_every: 5,
            request_timeout_ms: 30_000,
            linger_ms: 60_000,
            channel_capacity: 256,
            elastic: true,
            demote_ratio: 3.0,
            restore_ratio: 1.5,
            straggler_min_excess_ms: 5.0,
            aggregators: Aggregators::Auto,
            start_aggregators: 0,
            explore_window_steps: 60,
            explore_idle_share: crate::policy::explore::ExplorePolicy::default().idle_share,
            service_forget_steps: 100,
            replicas: 2,
            push_pull: true,
            push_pull_many: true,
            replica_every: 4,
            handoff_timeout_ms: 5_000,
            round_timeout_ms: 10_000,
            fault_delay_ms: 0,
            slowdown: 1.0,
            fault_serve_mbps: 0.0,
            link_mbps: 0.0,
            link_latency_ms: 0.0,
            aggregation: crate::policy::robust::Aggregation::Mean,
            norm_check: None,
            worker_momentum: 0.0,
            fault_byzantine: crate::ops::faults::Byzantine::None,
            compression: Default::default(),
            overlap: false,
            fit_batch: false,
            fit_rebalance: true,
            backup_workers: 0,
            local_steps: 1,
            outer_lr: 0.7,
            outer_momentum: 0.9,
        }
    }
}

/// A preset of settings for a kind of machine. It sits under the config
/// file: what the file sets wins, and flags win over both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Profile {
    /// A small board: no shard ownership and bounded buffers
    /// ([`EDGE_PROFILE`]).
    Edge,
}

impl Profile {
    /// The preset, as the TOML it stands for.
    pub fn toml(self) -> &'static str {
        match self {
            Profile::Edge => EDGE_PROFILE,
        }
    }
}

/// `profile = "edge"`: what a node on a small board holds is bounded. It
/// trains and exchanges like any worker, but owns no shard, so it keeps no
/// optimizer state, replicas or checkpoints of others; every frame it reads
/// or sends is at most 16 MiB and at most 32 MiB of frames are read at once;
/// queues between actors are short. The shard size must fit the frames: the
/// built-in models (the Fashion-MNIST MLP is under 1 MB) fit many times
/// over. See `docs/operations.md`, "Edge devices".
pub const EDGE_PROFILE: &str = r#"
[cluster]
can_aggregate = false
channel_capacity = 16

[network.limits]
max_request_bytes = 16777216
max_response_bytes = 16777216
max_inflight_read_bytes = 33554432
max_concurrent_streams = 8
max_established = 32
max_pending_incoming = 8
"#;

/// The whole node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeConfig {
    /// A preset under this file's settings (`edge`). Default none.
    pub profile: Option<Profile>,
    /// Name of the run; nodes of different runs ignore each other. Default `default`.
    pub run_id: String,
    /// A node name for logs and status (default: the last 6 characters of the peer id).
    pub name: Option<String>,
    /// Ed25519 identity: a file holding a 32-byte secret (created if missing).
    /// Default: a fresh identity per start.
    pub identity: Option<PathBuf>,
    pub training: TrainingConfig,
    pub cluster: ClusterConfig,
    /// Transports, limits, timeouts, discovery and admission (see `docs/protocol.md`).
    /// Its `run_id` is ignored: the top-level `run_id` is used.
    pub network: ProtocolConfig,
    /// The status page, `/status`, `/metrics` and the control endpoint.
    pub http: HttpConfig,
    /// Shard checkpoints while training, for resuming after a full stop.
    pub checkpoint: CheckpointConfig,
    /// Write the trained model here when the node finishes or leaves: one
    /// safetensors file under the model's own layer names (see
    /// `docs/operations.md`). Default: none.
    pub output: Option<PathBuf>,
}

/// Shard checkpoints (see `docs/operations.md`, "Checkpoints, model files
/// and resume").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// This node's checkpoint folder; none: no checkpoints. Default none.
    pub dir: Option<PathBuf>,
    /// Write an owned shard at every version that is a multiple of this.
    /// Default 50.
    pub every_steps: u64,
    /// Also write an owned shard that changed when this many seconds passed
    /// since its last write (0: never). Default 300.
    pub every_secs: u64,
    /// Files kept per shard (the newest). Default 2.
    pub keep: usize,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self { dir: None, every_steps: 50, every_secs: 300, keep: 2 }
    }
}

/// The node's HTTP endpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpConfig {
    /// `host:port` to serve on, or `off`. Default `127.0.0.1:0` (loopback,
    /// a free port; the address is printed at start).
    pub listen: String,
    /// Serve `POST /control/...` (fault injection, connection blocks, leave).
    /// For testnets only: anyone who can reach the port can use it. Default false.
    pub control: bool,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self { listen: "127.0.0.1:0".into(), control: false }
    }
}

impl HttpConfig {
    /// The address to bind, `None` when turned off.
    pub fn addr(&self) -> anyhow::Result<Option<std::net::SocketAddr>> {
        let l = self.listen.trim();
        if l.eq_ignore_ascii_case("off") || l.is_empty() {
            return Ok(None);
        }
        l.parse()
            .map(Some)
            .map_err(|_| anyhow::anyhow!("http.listen `{l}` is not host:port (for example 127.0.0.1:9464) or `off`"))
    }
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            profile: None,
            run_id: "default".into(),
            name: None,
            identity: None,
            training: TrainingConfig::default(),
            cluster: ClusterConfig::default(),
            network: ProtocolConfig::default(),
            http: HttpConfig::default(),
            output: None,
            checkpoint: CheckpointConfig::default(),
        }
    }
}

impl NodeConfig {
    /// Read a TOML file; unknown keys are errors that name the key.
    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        Self::load(Some(path), None)
    }

    /// The config file (or the defaults) with a profile under it: `profile`
    /// (a flag) or the file's own `profile` key. The file's settings win
    /// over the profile's.
    pub fn load(path: Option<&Path>, profile: Option<Profile>) -> anyhow::Result<Self> {
        let (text, name) = match path {
            Some(p) => (
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
                p.display().to_string(),
            ),
            None => (String::new(), "the defaults".to_string()),
        };
        Self::from_toml(&text, profile).with_context(|| format!("parsing {name}"))
    }

    /// Parse a config's TOML text with a profile under it (see [`Self::load`]).
    pub fn from_toml(text: &str, profile: Option<Profile>) -> anyhow::Result<Self> {
        // Parsed on its own first, so that errors point at the file's lines.
        let mine: NodeConfig = toml::from_str(text)?;
        let Some(profile) = profile.or(mine.profile) else { return Ok(mine) };
        let mut merged: toml::Table = toml::from_str(profile.toml()).context("the built-in profile")?;
        shoal_testnet::layers::merge_tables(&mut merged, toml::from_str(text)?);
        merged.insert("profile".into(), toml::Value::try_from(profile)?);
        Ok(merged.try_into()?)
    }

    /// The policy shard owners enforce: the run's, or with
    /// `cluster.overlap` the pipelined one (a clock bound one lower).
    pub fn owner_policy(&self) -> SyncPolicy {
        if self.cluster.overlap {
            self.cluster.sync.pipelined().unwrap_or(self.cluster.sync)
        } else {
            self.cluster.sync
        }
    }

    /// DiLoCo's outer optimizer: Nesterov SGD at `cluster.outer_lr` and
    /// `cluster.outer_momentum`.
    pub fn outer_optimizer(&self) -> OptimizerConfig {
        OptimizerConfig::Sgd {
            lr: self.cluster.outer_lr,
            momentum: self.cluster.outer_momentum,
            nesterov: true,
            weight_decay: 0.0,
        }
    }

    /// The optimizer shard owners run: the training optimizer, or with
    /// local steps the outer optimizer (the workers run the training one).
    pub fn owner_optimizer(&self) -> OptimizerConfig {
        if self.cluster.local_steps > 1 {
            self.outer_optimizer()
        } else {
            self.training.optimizer_config()
        }
    }

    /// The owners' learning-rate schedule (by shard version): the run's, or
    /// with local steps the outer rate, constant.
    pub fn owner_schedule(&self) -> LrSchedule {
        if self.cluster.local_steps > 1 {
            LrSchedule { base: self.cluster.outer_lr, decay: LrDecay::None, steps: self.training.steps }
        } else {
            self.training.lr_schedule()
        }
    }

    /// Check everything that can be checked before touching the network,
    /// one concern after another (the first error found is the one
    /// reported).
    pub fn validate(&self) -> anyhow::Result<()> {
        RunId::new(self.run_id.clone()).map_err(|e| anyhow::anyhow!("run_id: {e}"))?;
        self.validate_training()?;
        self.validate_checkpoint()?;
        self.validate_membership()?;
        self.validate_roles()?;
        self.validate_rounds()?;
        self.validate_local_steps()?;
        self.validate_compression()?;
        self.validate_gradients()?;
        self.validate_node_local()
    }

    /// The model, data set, optimizer and length of training.
    fn validate_training(&self) -> anyhow::Result<()> {
        let t = &self.training;
        if t.batch_size == 0 {
            bail!("training.batch_size must be at least 1");
        }
        if t.steps == 0 {
            bail!("training.steps must be at least 1");
        }
        t.optimizer_config().validate()?;
        t.model.check_dataset(&t.dataset).map_err(|e| anyhow::anyhow!("training.model and training.dataset: {e}"))?;
        if let (ArchKind::Gpt, DatasetKind::Text { context, .. }) = (t.model, &t.dataset) {
            t.gpt.unwrap_or_default().validate(*context).map_err(|e| anyhow::anyhow!("training.gpt: {e}"))?;
        }
        if t.threads == Some(0) {
            bail!("training.threads must be at least 1 (leave it out for the node's share of the host's cores)");
        }
        Ok(())
    }

    /// Shard checkpoints: how often, how many, and that there are shards
    /// to checkpoint that an offer can name.
    fn validate_checkpoint(&self) -> anyhow::Result<()> {
        if self.checkpoint.every_steps == 0 {
            bail!("checkpoint.every_steps must be at least 1");
        }
        if self.checkpoint.keep == 0 {
            bail!("checkpoint.keep must be at least 1");
        }
        if self.checkpoint.dir.is_some() && self.cluster.mode != Mode::Pull {
            bail!("checkpoint.dir needs cluster.mode = \"pull\": in gossip mode no node owns shards to checkpoint");
        }
        if self.checkpoint.dir.is_some() && self.cluster.shards as usize > shoal_protocol::MAX_OFFER_BITSET_BYTES * 8 {
            bail!(
                "checkpoint.dir works with at most {} shards (cluster.shards is {})",
                shoal_protocol::MAX_OFFER_BITSET_BYTES * 8,
                self.cluster.shards
            );
        }
        Ok(())
    }

    /// How the cluster forms and notices failures: roster size, shards,
    /// heartbeats and the timeouts built on them.
    fn validate_membership(&self) -> anyhow::Result<()> {
        let c = &self.cluster;
        if c.min_peers == 0 {
            bail!("cluster.min_peers must be at least 1");
        }
        if c.shards == 0 {
            bail!("cluster.shards must be at least 1");
        }
        for (name, v) in [
            ("cluster.heartbeat_ms", c.heartbeat_ms),
            ("cluster.failure_timeout_ms", c.failure_timeout_ms),
            ("cluster.start_timeout_ms", c.start_timeout_ms),
            ("cluster.request_timeout_ms", c.request_timeout_ms),
            ("cluster.dial_timeout_ms", c.dial_timeout_ms),
        ] {
            if v == 0 {
                bail!("{name} must be positive");
            }
        }
        if c.failure_timeout_ms <= 2 * c.heartbeat_ms {
            bail!(
                "cluster.failure_timeout_ms ({}) must exceed two heartbeats ({} ms each)",
                c.failure_timeout_ms,
                c.heartbeat_ms
            );
        }
        if c.mode == Mode::Gossip && c.gossip_every == 0 {
            bail!("cluster.gossip_every must be at least 1 in gossip mode");
        }
        Ok(())
    }

    /// Who owns shards: demotion and restoration, the exploration of the
    /// number of aggregators, replicas and handoffs.
    fn validate_roles(&self) -> anyhow::Result<()> {
        let c = &self.cluster;
        if !(c.demote_ratio.is_finite() && c.restore_ratio.is_finite() && 1.0 < c.restore_ratio)
            || c.restore_ratio > c.demote_ratio
        {
            bail!(
                "cluster.restore_ratio ({}) must be above 1 and at most cluster.demote_ratio ({})",
                c.restore_ratio,
                c.demote_ratio
            );
        }
        if !(c.straggler_min_excess_ms.is_finite() && c.straggler_min_excess_ms >= 0.0) {
            bail!("cluster.straggler_min_excess_ms must be a non-negative number");
        }
        let dominate = crate::policy::explore::ExplorePolicy::default().dominate_share;
        if !(0.0..dominate).contains(&c.explore_idle_share) {
            bail!(
                "cluster.explore_idle_share must be at least 0 and below {dominate} (the share at which an aggregator \
                 is added), got {}",
                c.explore_idle_share
            );
        }
        if c.explore_window_steps == 0 {
            bail!("cluster.explore_window_steps must be at least 1");
        }
        if c.start_aggregators > 0 && c.aggregators != Aggregators::Auto {
            bail!(
                "cluster.start_aggregators applies only with cluster.aggregators = \"auto\" (it is {})",
                c.aggregators
            );
        }
        if !(1..=2).contains(&c.replicas) {
            bail!("cluster.replicas must be 1 (no replica) or 2 (one backup), got {}", c.replicas);
        }
        if c.replicas == 2 && c.replica_every == 0 {
            bail!("cluster.replica_every must be at least 1 when cluster.replicas = 2");
        }
        if c.round_timeout_ms == 0 || c.round_timeout_ms >= c.request_timeout_ms {
            bail!(
                "cluster.round_timeout_ms ({}) must be positive and below cluster.request_timeout_ms ({})",
                c.round_timeout_ms,
                c.request_timeout_ms
            );
        }
        if c.handoff_timeout_ms == 0 {
            bail!("cluster.handoff_timeout_ms must be positive");
        }
        Ok(())
    }

    /// What each exchange of a step may do, and the sync policy and rounds
    /// each needs: robust aggregation, worker momentum, overlap, fitted
    /// batches and backup workers.
    fn validate_rounds(&self) -> anyhow::Result<()> {
        let c = &self.cluster;
        if c.aggregation.is_robust() && !c.bsp_rounds() {
            bail!(
                "cluster.aggregation = \"{}\" combines the gradients of a BSP round: it needs mode = \"pull\" and \
                 sync = \"bsp\" (this config has {:?} and {}). With other policies, use \"mean\" and the norm check.",
                c.aggregation,
                c.mode,
                c.sync
            );
        }
        if !(0.0..1.0).contains(&c.worker_momentum) || (c.worker_momentum > 0.0 && c.mode != Mode::Pull) {
            bail!(
                "cluster.worker_momentum must be from 0 to below 1, and only in pull mode (got {})",
                c.worker_momentum
            );
        }
        if c.overlap && (c.mode != Mode::Pull || c.local_steps > 1 || c.sync.pipelined().is_none()) {
            bail!(
                "cluster.overlap computes the next step while this one's exchange is on the wire, one step staler: \
                 it needs mode = \"pull\", no local steps, and sync = \"ssp:N\" with N >= 1, \"dssp:LO-HI\" with \
                 LO >= 1, or \"asp\" (this config has {:?}, local_steps {}, sync {}; under bsp the next forward \
                 pass needs every shard's new version)",
                c.mode,
                c.local_steps,
                c.sync
            );
        }
        if c.fit_batch && !c.lockstep() {
            bail!(
                "cluster.fit_batch sizes a slow worker's batch to the pace of BSP rounds: it needs {}",
                c.lockstep_needs()
            );
        }
        if c.backup_workers > 0 && !c.lockstep() {
            bail!(
                "cluster.backup_workers closes a BSP round without its slowest workers: it needs {}",
                c.lockstep_needs()
            );
        }
        Ok(())
    }

    /// DiLoCo: local steps, pushed as a pseudo-gradient that owners apply
    /// with the outer optimizer.
    fn validate_local_steps(&self) -> anyhow::Result<()> {
        let c = &self.cluster;
        if c.local_steps == 0 {
            bail!("cluster.local_steps must be at least 1 (1: no local steps)");
        }
        if c.local_steps > 1 {
            if !c.bsp_rounds() {
                bail!(
                    "cluster.local_steps = {} (DiLoCo) pushes a pseudo-gradient to owners that apply it in BSP \
                     rounds: it needs mode = \"pull\" and sync = \"bsp\" (this config has {:?} and {})",
                    c.local_steps,
                    c.mode,
                    c.sync
                );
            }
            if c.worker_momentum > 0.0 {
                bail!("cluster.worker_momentum applies to gradients pushed every step: leave it 0 with cluster.local_steps > 1");
            }
            self.outer_optimizer().validate()?;
            if !(c.outer_lr.is_finite() && c.outer_lr > 0.0) {
                bail!("cluster.outer_lr must be a positive number (got {})", c.outer_lr);
            }
        }
        Ok(())
    }

    /// What the pushes and pulls are compressed to.
    fn validate_compression(&self) -> anyhow::Result<()> {
        let c = &self.cluster;
        let compressed = c.compression != crate::policy::compress::CompressionConfig::default();
        if compressed && c.mode != Mode::Pull {
            bail!(
                "cluster.compression (push = \"{}\", pull = \"{}\") applies to pushes and pulls: it needs \
                 mode = \"pull\" (gossip mode exchanges whole f32 models)",
                c.compression.push,
                c.compression.pull
            );
        }
        if c.compression.push == crate::policy::compress::PushCompression::Sfb
            && (c.worker_momentum > 0.0
                || c.local_steps > 1
                || c.fault_byzantine != crate::ops::faults::Byzantine::None)
        {
            bail!(
                "cluster.compression.push = \"sfb\" sends each step's own gradient as the factors of its batch: \
                 it cannot carry worker momentum, DiLoCo's pseudo-gradients or a byzantine fault's altered \
                 gradient (this config has worker_momentum {}, local_steps {})",
                c.worker_momentum,
                c.local_steps
            );
        }
        Ok(())
    }

    /// How updates are shaped and screened: SGD's momentum and the owners'
    /// gradient norm check.
    fn validate_gradients(&self) -> anyhow::Result<()> {
        if let Some(m) = self.training.momentum {
            if !(0.0..1.0).contains(&m) || self.training.optimizer != OptimizerKind::Sgd {
                bail!("training.momentum must be from 0 to below 1, with optimizer = \"sgd\" (got {m})");
            }
        }
        let k = self.cluster.norm_check_factor();
        if !(k.is_finite() && (k == 0.0 || k >= 1.0)) {
            bail!("cluster.norm_check must be 0 (off) or a factor of at least 1, got {k}");
        }
        Ok(())
    }

    /// This node's own settings: fault injection, its HTTP endpoint, its
    /// channels and the peers it dials.
    fn validate_node_local(&self) -> anyhow::Result<()> {
        let c = &self.cluster;
        c.faults().map_err(|e| anyhow::anyhow!("cluster.{e}"))?;
        self.http.addr()?;
        if c.channel_capacity == 0 {
            bail!("cluster.channel_capacity must be at least 1");
        }
        for addr in &c.bootstrap {
            if !addr.iter().any(|p| matches!(p, shoal_protocol::libp2p::multiaddr::Protocol::P2p(_))) {
                bail!("bootstrap address {addr} has no /p2p/<peer id> part");
            }
        }
        Ok(())
    }

    /// The model everybody in the run must share.
    pub fn model_config(&self, data: &shoal_models::Dataset) -> ModelConfig {
        let mut m = ModelConfig::for_dataset(self.training.model, data);
        if let (Some(hidden), shoal_models::Arch::Mlp { .. }) = (&self.training.mlp_hidden, &m.arch) {
            m.arch = shoal_models::Arch::Mlp { hidden: hidden.clone() };
        }
        match self.training.gpt {
            Some(size) => m.with_gpt_size(size),
            None => m,
        }
    }
}

/// What every peer of a run must agree on. Its hash goes in every
/// heartbeat, and a peer whose hash differs is left out of the view (logged
/// once as mismatched). Everything else in [`NodeConfig`] is the node's
/// own: batch size, device, threads, addresses, identity, timeouts,
/// whether it may own shards, compression, fault injection and where its
/// files go. `docs/operations.md`, "What peers must agree on", lists the
/// fields; a test holds the list to this struct.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunAgreement {
    pub run_id: String,
    /// The model's shape (from `training.model`, `mlp_hidden`, `gpt` and
    /// the data set's shape).
    pub model: ModelConfig,
    /// `training.dataset`, a text named by its file name only: peers may
    /// keep it in different folders.
    pub dataset: String,
    pub seed: u64,
    pub steps: u64,
    /// The optimizer as it runs: `training.optimizer`, `lr` (or its
    /// default) and `momentum`.
    pub optimizer: OptimizerConfig,
    pub lr_decay: LrDecay,
    pub shards: u32,
    pub mode: Mode,
    pub sync: SyncPolicy,
    pub elastic: bool,
    pub demote_ratio: f64,
    pub restore_ratio: f64,
    pub straggler_min_excess_ms: f64,
    pub replicas: u32,
    pub aggregators: Aggregators,
    pub start_aggregators: u16,
    pub explore_window_steps: u64,
    pub explore_idle_share: f64,
    pub aggregation: crate::policy::robust::Aggregation,
    /// The norm check's factor in force: `cluster.norm_check`, or its
    /// default under the sync policy (a config that leaves it out agrees
    /// with one that writes the default).
    pub norm_check: f32,
    pub worker_momentum: f32,
    pub local_steps: u64,
    pub outer_lr: f64,
    pub outer_momentum: f64,
    pub overlap: bool,
}

impl RunAgreement {
    /// What `config` makes its node agree to, for the model it built.
    pub fn of(config: &NodeConfig, model: &ModelConfig) -> Self {
        let (t, c) = (&config.training, &config.cluster);
        Self {
            run_id: config.run_id.clone(),
            model: model.clone(),
            dataset: agreed_dataset(&t.dataset),
            seed: t.seed,
            steps: t.steps,
            optimizer: t.optimizer_config(),
            lr_decay: t.lr_decay,
            shards: c.shards,
            mode: c.mode,
            sync: c.sync,
            elastic: c.elastic,
            demote_ratio: c.demote_ratio,
            restore_ratio: c.restore_ratio,
            straggler_min_excess_ms: c.straggler_min_excess_ms,
            replicas: c.replicas,
            aggregators: c.aggregators,
            start_aggregators: c.start_aggregators,
            explore_window_steps: c.explore_window_steps,
            explore_idle_share: c.explore_idle_share,
            aggregation: c.aggregation,
            norm_check: c.norm_check_factor(),
            worker_momentum: c.worker_momentum,
            local_steps: c.local_steps,
            outer_lr: c.outer_lr,
            outer_momentum: c.outer_momentum,
            overlap: c.overlap,
        }
    }

    /// The hash peers compare: [`canonical_hash`] of this struct as a JSON
    /// value.
    pub fn hash(&self) -> anyhow::Result<u64> {
        let value = serde_json::to_value(self).context("serialising what peers must agree on")?;
        Ok(canonical_hash(&value))
    }
}

/// A data set as peers compare it: a text by its window and file name.
fn agreed_dataset(dataset: &DatasetKind) -> String {
    match dataset {
        DatasetKind::Text { path, context } => {
            format!("text@{context}:{}", path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default())
        }
        other => other.to_string(),
    }
}

/// The stable hash of a JSON value's canonical bytes: compact, with every
/// object's keys sorted, so that equal values hash alike on every peer
/// whatever order their keys were written in.
pub fn canonical_hash(value: &serde_json::Value) -> u64 {
    let mut bytes = Vec::new();
    canonical_json(value, &mut bytes);
    shoal_models::rng::stable_hash64(&bytes)
}

/// Append `value` to `out` as compact JSON with sorted object keys.
fn canonical_json(value: &serde_json::Value, out: &mut Vec<u8>) {
    use serde_json::Value;
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (key, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(Value::String(key.clone()).to_string().as_bytes());
                out.push(b':');
                canonical_json(v, out);
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                canonical_json(v, out);
            }
            out.push(b']');
        }
        scalar => out.extend_from_slice(scalar.to_string().as_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_edge_profile_sits_under_the_file_and_the_file_wins() -> anyhow::Result<()> {
        // From the file's own key.
        let c = NodeConfig::from_toml(
            "profile = \"edge\"\nrun_id = \"r\"\n[network.limits]\nmax_request_bytes = 8388608\n",
            None,
        )?;
        assert_eq!(c.profile, Some(Profile::Edge));
        assert!(!c.cluster.can_aggregate);
        assert_eq!(c.cluster.channel_capacity, 16);
        assert_eq!(c.network.limits.max_request_bytes, 8 << 20, "the file's value wins");
        assert_eq!(c.network.limits.max_response_bytes, 16 << 20, "the profile's value where the file is silent");
        assert_eq!(c.network.limits.max_inflight_read_bytes, 32 << 20);
        assert_eq!(c.run_id, "r");
        assert!(c.validate().is_ok(), "{:?}", c.validate());
        // From a flag, with no file: the profile over the defaults.
        let c = NodeConfig::from_toml("", Some(Profile::Edge))?;
        assert!(!c.cluster.can_aggregate);
        assert_eq!(c.training, TrainingConfig::default());
        assert!(c.validate().is_ok(), "{:?}", c.validate());
        // The file may still make an edge node an owner.
        let c = NodeConfig::from_toml("[cluster]\ncan_aggregate = true\n", Some(Profile::Edge))?;
        assert!(c.cluster.can_aggregate);
        // No profile: the defaults.
        assert_eq!(NodeConfig::from_toml("", None)?, NodeConfig::default());
        // An unknown profile is an error that names it.
        let e = NodeConfig::from_toml("profile = \"tiny\"\n", None).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("tiny") && e.contains("edge"), "{e}");
        // A mistake in the file is reported as before, with the profile on too.
        let e = NodeConfig::from_toml("[cluster]\ncan_agregate = true\n", Some(Profile::Edge))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("can_agregate"), "{e}");
        Ok(())
    }

    #[test]
    fn a_language_model_needs_text_and_text_needs_a_language_model() {
        let mut c = NodeConfig::default();
        c.training.model = ArchKind::Gpt;
        let e = c.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("trains on text:PATH"), "{e}");
        c.training.dataset = "text@32:corpus.txt".parse().unwrap_or_default();
        assert!(c.validate().is_ok(), "{:?}", c.validate());
        c.training.gpt = Some(GptSize { layers: 2, heads: 3, width: 64 });
        let e = c.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("training.gpt") && e.contains("multiple"), "{e}");
        c.training.model = ArchKind::Mlp;
        let e = c.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("needs model gpt"), "{e}");
        // The TOML form.
        let toml_text = "run_id = \"r\"\n[training]\nmodel = \"gpt\"\ndataset = \"text@32:c.txt\"\ngpt = { layers = 2, heads = 4, width = 64 }\n";
        let parsed: Result<NodeConfig, _> = toml::from_str(toml_text);
        assert!(parsed.as_ref().is_ok_and(|p| p.validate().is_ok()), "{parsed:?}");
    }

    #[test]
    fn sufficient_factors_need_the_batchs_own_gradient() {
        let mut c = NodeConfig::default();
        c.cluster.compression.push = crate::policy::compress::PushCompression::Sfb;
        assert!(c.validate().is_ok(), "{:?}", c.validate());
        c.cluster.worker_momentum = 0.9;
        let e = c.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("sfb") && e.contains("worker_momentum 0.9"), "{e}");
        c.cluster.worker_momentum = 0.0;
        c.cluster.mode = Mode::Gossip;
        let e = c.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("mode = \"pull\""), "{e}");
    }

    #[test]
    fn backup_workers_need_bsp_rounds() {
        let mut c = NodeConfig::default();
        c.cluster.backup_workers = 1;
        assert!(c.validate().is_ok(), "{:?}", c.validate());
        c.cluster.sync = SyncPolicy::Ssp { staleness: 2 };
        let e = c.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("backup_workers") && e.contains("sync ssp:2"), "{e}");
        c.cluster.sync = SyncPolicy::Bsp;
        c.cluster.local_steps = 4;
        let e = c.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("backup_workers") && e.contains("local_steps 4"), "{e}");
    }

    /// A model for the agreement tests (the digits MLP's shape).
    fn digits_model() -> ModelConfig {
        let shape = shoal_models::ImageShape { channels: 1, height: 8, width: 8 };
        ModelConfig::new(ArchKind::Mlp, shape, 10)
    }

    /// A config that sets most agreed fields away from their defaults, so
    /// that more of the struct's leaves are exercised.
    fn unusual_config() -> NodeConfig {
        let mut c = NodeConfig { run_id: "unusual".into(), ..NodeConfig::default() };
        c.training.dataset = "text@32:corpus.txt".parse().unwrap_or_default();
        c.training.optimizer = OptimizerKind::Adamw;
        c.training.lr_decay = LrDecay::Cosine;
        c.cluster.sync = SyncPolicy::Ssp { staleness: 2 };
        c.cluster.aggregators = Aggregators::Fixed(3);
        c.cluster.norm_check = Some(20.0);
        c.cluster.overlap = true;
        c
    }

    /// Every JSON pointer to a leaf of `value`: a scalar, or an empty array
    /// or object.
    fn leaves(value: &serde_json::Value, at: String, out: &mut Vec<String>) {
        use serde_json::Value;
        match value {
            Value::Object(map) if !map.is_empty() => {
                for (k, v) in map {
                    leaves(v, format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")), out);
                }
            }
            Value::Array(items) if !items.is_empty() => {
                for (i, v) in items.iter().enumerate() {
                    leaves(v, format!("{at}/{i}"), out);
                }
            }
            _ => out.push(at),
        }
    }

    /// `leaf` changed to a different value of its kind (or, for null, to
    /// some value).
    fn perturb(leaf: &serde_json::Value) -> serde_json::Value {
        use serde_json::{json, Value};
        match leaf {
            Value::Null => json!(true),
            Value::Bool(b) => json!(!b),
            Value::String(s) => json!(format!("{s}~")),
            Value::Number(n) => match (n.as_u64(), n.as_i64(), n.as_f64()) {
                (Some(u), _, _) => json!(u.checked_add(1).unwrap_or(u64::MAX - 1)),
                (_, Some(i), _) => json!(i.checked_add(1).unwrap_or(i64::MAX - 1)),
                (_, _, Some(f)) if f != 0.0 => json!(f * 2.0),
                _ => json!(1.0),
            },
            Value::Array(_) => json!([0]),
            Value::Object(_) => json!({ "x": 0 }),
        }
    }

    #[test]
    fn changing_any_agreed_field_changes_the_hash() -> anyhow::Result<()> {
        let text_shape = shoal_models::ImageShape { channels: 1, height: 1, width: 33 };
        for (config, model) in [
            (NodeConfig::default(), digits_model()),
            (unusual_config(), ModelConfig::new(ArchKind::Gpt, text_shape, 256)),
        ] {
            let base = serde_json::to_value(RunAgreement::of(&config, &model))?;
            let base_hash = canonical_hash(&base);
            let mut paths = Vec::new();
            leaves(&base, String::new(), &mut paths);
            let fields = base.as_object().map(|m| m.len()).unwrap_or(0);
            assert!(paths.len() >= fields && fields >= 26, "{} leaves in {fields} fields", paths.len());
            for path in paths {
                let mut changed = base.clone();
                let leaf = changed.pointer_mut(&path).ok_or_else(|| anyhow::anyhow!("no leaf at {path}"))?;
                *leaf = perturb(leaf);
                assert_ne!(changed, base, "{path}: the perturbation changed nothing");
                assert_ne!(canonical_hash(&changed), base_hash, "changing {path} left the hash as it was");
            }
        }
        Ok(())
    }

    #[test]
    fn the_agreement_hash_is_the_canonical_hash_of_its_json_value() -> anyhow::Result<()> {
        for config in [NodeConfig::default(), unusual_config()] {
            let agreed = RunAgreement::of(&config, &digits_model());
            assert_eq!(agreed.hash()?, canonical_hash(&serde_json::to_value(&agreed)?));
        }
        // The canonical bytes: compact, object keys sorted at every depth.
        let value = serde_json::json!({ "b": 1, "a": [true, null, { "z": "x\"y", "c": 0.5 }] });
        let mut bytes = Vec::new();
        canonical_json(&value, &mut bytes);
        assert_eq!(String::from_utf8(bytes)?, r#"{"a":[true,null,{"c":0.5,"z":"x\"y"}],"b":1}"#);
        let want = br#"{"a":[true,null,{"c":0.5,"z":"x\"y"}],"b":1}"#;
        assert_eq!(canonical_hash(&value), shoal_models::rng::stable_hash64(want));
        Ok(())
    }

    #[test]
    fn node_local_settings_leave_the_hash_alone() -> anyhow::Result<()> {
        let model = digits_model();
        let base = RunAgreement::of(&NodeConfig::default(), &model).hash()?;
        type Set = fn(&mut NodeConfig);
        let local: [(&str, Set); 24] = [
            ("name", |c| c.name = Some("n1".into())),
            ("identity", |c| c.identity = Some("id.key".into())),
            ("profile", |c| c.profile = Some(Profile::Edge)),
            ("output", |c| c.output = Some("model.safetensors".into())),
            ("http.listen", |c| c.http.listen = "127.0.0.1:9464".into()),
            ("http.control", |c| c.http.control = true),
            ("checkpoint.dir", |c| c.checkpoint.dir = Some("ckpt".into())),
            ("checkpoint.every_steps", |c| c.checkpoint.every_steps = 7),
            ("network.listen", |c| c.network.listen = Vec::new()),
            ("network.limits", |c| c.network.limits.max_request_bytes /= 2),
            ("training.batch_size", |c| c.training.batch_size = 64),
            ("training.threads", |c| c.training.threads = Some(3)),
            ("training.device", |c| c.training.device = DeviceKind::Cuda(0)),
            ("training.data_dir", |c| c.training.data_dir = Some("/data".into())),
            ("training.eval_every", |c| c.training.eval_every = 10),
            ("cluster.can_aggregate", |c| c.cluster.can_aggregate = false),
            ("cluster.memory_bytes", |c| c.cluster.memory_bytes = 1 << 30),
            ("cluster.min_peers", |c| c.cluster.min_peers = 4),
            ("cluster.heartbeat_ms", |c| c.cluster.heartbeat_ms = 200),
            ("cluster.request_timeout_ms", |c| c.cluster.request_timeout_ms = 9_000),
            ("cluster.channel_capacity", |c| c.cluster.channel_capacity = 16),
            ("cluster.fault_delay_ms", |c| c.cluster.fault_delay_ms = 50),
            ("cluster.link_mbps", |c| c.cluster.link_mbps = 100.0),
            ("cluster.compression", |c| c.cluster.compression.push = crate::policy::compress::PushCompression::Bf16),
        ];
        for (name, set) in local {
            let mut config = NodeConfig::default();
            set(&mut config);
            assert_ne!(config, NodeConfig::default(), "{name}: the setting was not changed");
            assert_eq!(RunAgreement::of(&config, &model).hash()?, base, "{name} is node-local but changed the hash");
        }
        Ok(())
    }

    #[test]
    fn derived_agreed_fields_keep_their_meaning() -> anyhow::Result<()> {
        let model = digits_model();
        let hash = |set: &dyn Fn(&mut NodeConfig)| {
            let mut c = NodeConfig::default();
            set(&mut c);
            RunAgreement::of(&c, &model).hash()
        };
        let text = |s: &str| s.parse::<DatasetKind>().unwrap_or_default();
        // A text is named by its file name: its folder is the node's own.
        let here = hash(&|c| c.training.dataset = text("text@32:/home/a/corpus.txt"))?;
        assert_eq!(here, hash(&|c| c.training.dataset = text("text@32:/srv/b/corpus.txt"))?);
        assert_ne!(here, hash(&|c| c.training.dataset = text("text@64:/home/a/corpus.txt"))?);
        assert_ne!(here, hash(&|c| c.training.dataset = text("text@32:/home/a/other.txt"))?);
        // The norm check agreed is the factor in force: BSP's default of 50
        // written out is the same agreement.
        assert_eq!(hash(&|_| {})?, hash(&|c| c.cluster.norm_check = Some(50.0))?);
        assert_ne!(hash(&|_| {})?, hash(&|c| c.cluster.norm_check = Some(0.0))?);
        // The learning rate agreed is the one the optimizer runs.
        assert_eq!(hash(&|_| {})?, hash(&|c| c.training.lr = Some(OptimizerConfig::default_lr(OptimizerKind::Sgd)))?);
        // The idle share is a field like any other.
        assert_ne!(hash(&|_| {})?, hash(&|c| c.cluster.explore_idle_share = 0.1)?);
        Ok(())
    }

    #[test]
    fn the_docs_list_exactly_the_agreed_fields() -> anyhow::Result<()> {
        let docs = include_str!("../../docs/operations.md");
        let heading = "## What peers must agree on";
        let section = docs.split_once(heading).map(|(_, rest)| rest).unwrap_or_default();
        let section = section.split("\n#").next().unwrap_or_default();
        let listed: Vec<&str> = section
            .lines()
            .filter_map(|l| l.strip_prefix("- `"))
            .filter_map(|l| l.split_once('`').map(|(name, _)| name))
            .collect();
        assert!(!listed.is_empty(), "docs/operations.md has no list under `{heading}`");
        let agreed = serde_json::to_value(RunAgreement::of(&NodeConfig::default(), &digits_model()))?;
        let fields: std::collections::BTreeSet<&str> =
            agreed.as_object().map(|m| m.keys().map(String::as_str).collect()).unwrap_or_default();
        let documented: std::collections::BTreeSet<&str> = listed.iter().copied().collect();
        assert_eq!(documented.len(), listed.len(), "a field is listed twice: {listed:?}");
        assert_eq!(documented, fields, "docs/operations.md, `{heading}`, lists other fields than RunAgreement has");
        Ok(())
    }

    #[test]
    fn example_config_parses_and_validates() {
        let text = include_str!("../../testnet/node.example.toml");
        let cfg: Result<NodeConfig, _> = toml::from_str(text);
        assert!(cfg.is_ok(), "{cfg:?}");
        assert!(cfg.map(|c| c.validate().is_ok()).unwrap_or(false));
    }

    #[test]
    fn unknown_keys_and_bad_values_are_named() {
        let e =
            toml::from_str::<NodeConfig>("[training]\nbatch = 3\n").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("batch"), "{e}");
        let e = toml::from_str::<NodeConfig>("[cluster]\nsync = \"raft\"\n")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("raft"), "{e}");
        for (text, want) in [
            ("auto", Some(Aggregators::Auto)),
            ("\"all\"", Some(Aggregators::All)),
            ("3", Some(Aggregators::Fixed(3))),
            ("0", None),
            ("-2", None),
            ("\"many\"", None),
        ] {
            let text = if text == "auto" { "\"auto\"" } else { text };
            let got = toml::from_str::<NodeConfig>(&format!("[cluster]\naggregators = {text}\n"));
            assert_eq!(got.as_ref().ok().map(|c| c.cluster.aggregators), want, "{text}: {got:?}");
        }
        let e = toml::from_str::<NodeConfig>("[cluster]\naggregators = 0\n").err().map(|e| e.to_string());
        assert!(e.unwrap_or_default().contains("expected auto, all or a count"));
        let mut c = NodeConfig::default();
        c.cluster.failure_timeout_ms = 100;
        assert!(c.validate().is_err());
        let c = NodeConfig { run_id: String::new(), ..NodeConfig::default() };
        assert!(c.validate().is_err());
    }
}
