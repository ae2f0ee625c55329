//! `NodeConfig`: one TOML file, a table per concern.
//!
//! Every limit and timeout lives here (or in the embedded
//! [`ProtocolConfig`], the `[network]` table). The `Default` impls are the
//! one source of the defaults: `shoal node --print-config` prints them,
//! and tests hold `docs/operations.md` and `testnet/node.example.toml` to
//! them. The flags of `shoal node` each set one key (`cmd::node::FLAGS`);
//! keys that moved to their own tables are refused by name
//! ([`MOVED_KEYS`]).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use shoal_models::data::TokenIndex;
use shoal_models::tokenizer::Tokenizer;
use shoal_models::{
    ArchKind, DatasetKind, DeviceKind, LlamaSize, ModelConfig, OptimizerConfig, OptimizerKind, Precision,
};
use shoal_protocol::libp2p::Multiaddr;
use shoal_protocol::{ProtocolConfig, RunId};

use crate::policy::compress::{PullCompression, PushCompression};
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
    /// `mlp`, `cnn` or `llama` (a transformer language model; it needs a
    /// `text:PATH` or `tokens:DIR` data set).
    pub model: ArchKind,
    /// MLP hidden widths; none: `[256, 128]`.
    pub mlp_hidden: Option<Vec<usize>>,
    /// Llama size (the `[training.llama]` table: `layers`, `heads`,
    /// `kv_heads`, `width`, `ff`, `tie`, `rope_theta`, `norm_eps`); none:
    /// `LlamaSize::default()` (its context is the text data set's).
    pub llama: Option<LlamaSize>,
    /// `digits` (embedded), `fashion-mnist`, `text:PATH` / `text@N:PATH`
    /// (a UTF-8 file, in windows of 64 or N bytes or tokens), or
    /// `tokens:DIR` / `tokens@N:DIR` (a token directory from `shoal data
    /// tokenize`).
    pub dataset: DatasetKind,
    /// Where to look for Fashion-MNIST; none: ./data, then /usr/share/datasets.
    pub data_dir: Option<PathBuf>,
    /// A Hugging Face `tokenizer.json` that cuts a `text:PATH` into tokens;
    /// none: bytes. A token directory brings its own.
    pub tokenizer: Option<PathBuf>,
    /// Samples per step on this node (nodes may differ).
    pub batch_size: usize,
    /// `sgd` (momentum 0.9, Nesterov) or `adamw`.
    pub optimizer: OptimizerKind,
    /// Learning rate; none: `OptimizerConfig::default_lr` of the optimizer.
    pub lr: Option<f64>,
    /// SGD momentum (Nesterov while above 0), from 0 to below 1; none: the
    /// optimizer's own. Only with `optimizer = "sgd"`.
    pub momentum: Option<f64>,
    /// `none` or `cosine` (from `lr` down to `lr / 100` over `steps`; in
    /// pull mode the shard owners follow it by the shard's version).
    pub lr_decay: LrDecay,
    /// Steps of linear warm-up from 0 to `lr` before `lr_decay` (0: none).
    pub warmup_steps: u64,
    /// The optimizer's weight decay; none: its default (0 for SGD, 1e-4
    /// for AdamW, decoupled).
    pub weight_decay: Option<f64>,
    /// Seed of weight init and data order; must match across the run.
    pub seed: u64,
    /// Training steps each worker takes.
    pub steps: u64,
    /// Evaluate on the test set every this many steps (0: only at the end).
    pub eval_every: u64,
    /// `cpu`, `cuda[:N]` or `metal[:N]`.
    pub device: DeviceKind,
    /// The dtype of the matrix products: `f32`, or `bf16` (bf16 products,
    /// f32 weights, gradients and optimizer state). A per-node choice: a
    /// GPU node may compute in bf16 beside CPU nodes in f32.
    pub dtype: Precision,
    /// Threads for this node's tensor work; none: the host's cores
    /// divided by the nodes that this process or testnet starts on it.
    pub threads: Option<usize>,
}

impl Default for TrainingConfig {
    fn default() -> Self {
        Self {
            model: ArchKind::Mlp,
            mlp_hidden: None,
            llama: None,
            dataset: DatasetKind::Digits,
            data_dir: None,
            tokenizer: None,
            batch_size: 32,
            optimizer: OptimizerKind::Sgd,
            lr: None,
            momentum: None,
            lr_decay: LrDecay::None,
            warmup_steps: 0,
            weight_decay: None,
            seed: 42,
            steps: 300,
            eval_every: 0,
            device: DeviceKind::Cpu,
            dtype: Precision::F32,
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
        let cfg = match (cfg, self.momentum) {
            (OptimizerConfig::Sgd { lr, weight_decay, .. }, Some(m)) => {
                OptimizerConfig::Sgd { lr, momentum: m, nesterov: m > 0.0, weight_decay }
            }
            (cfg, _) => cfg,
        };
        match self.weight_decay {
            Some(wd) => cfg.with_weight_decay(wd),
            None => cfg,
        }
    }

    /// The learning-rate schedule of the run.
    pub fn lr_schedule(&self) -> LrSchedule {
        LrSchedule {
            base: self.optimizer_config().lr(),
            decay: self.lr_decay,
            steps: self.steps,
            warmup: self.warmup_steps,
        }
    }
}

/// How the cluster forms, notices failures and talks: the roster, the
/// shards, heartbeats and the timeouts built on them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// `pull` (shard owners) or `gossip` (no owners; see the `[gossip]`
    /// table).
    pub mode: Mode,
    /// Training starts once this many nodes (this one included) agree on the
    /// roster.
    pub min_peers: usize,
    /// Number of shards the model is cut into.
    pub shards: u32,
    /// Whether this node may own shards.
    pub can_aggregate: bool,
    /// The memory this node offers for owning shards, bytes, gossiped in
    /// its heartbeats (`capabilities.memory_bytes`). The election gives an
    /// owner no more shards than fit in it (`policy::placement`). 0: what
    /// the machine (or its container's cgroup) had left when the node
    /// started.
    pub memory_bytes: u64,
    /// Multiaddrs (with `/p2p/<peer id>`) to dial at start.
    pub bootstrap: Vec<Multiaddr>,
    /// Heartbeat period, ms.
    pub heartbeat_ms: u64,
    /// A peer silent this long (ms) is considered failed.
    pub failure_timeout_ms: u64,
    /// Give up (non-zero exit) if the roster has not formed by then (ms).
    pub start_timeout_ms: u64,
    /// How long (ms) to keep dialling the bootstrap peers (each failed dial
    /// is retried with backoff; one that answers is enough).
    pub dial_timeout_ms: u64,
    /// Total deadline (ms) of one push or pull, retries included; past it
    /// the node fails with an error naming the shard and owner.
    pub request_timeout_ms: u64,
    /// After finishing, keep serving shards until every roster peer has
    /// finished or this long (ms) has passed.
    pub linger_ms: u64,
    /// Capacity of every actor's command channel.
    pub channel_capacity: usize,
    /// Send each remote owner one `PushPull` per shard and step (the push
    /// and its pull in one exchange); `false` sends a `PushGrad` and a
    /// `PullShard`.
    pub push_pull: bool,
    /// With `push_pull`: send each remote owner of two or more shards one
    /// `PushPullMany` per step carrying all of them, instead of one
    /// `PushPull` per shard.
    pub push_pull_many: bool,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            mode: Mode::Pull,
            min_peers: 1,
            shards: 8,
            can_aggregate: true,
            memory_bytes: 0,
            bootstrap: Vec::new(),
            heartbeat_ms: 300,
            failure_timeout_ms: 5_000,
            start_timeout_ms: 60_000,
            dial_timeout_ms: 10_000,
            request_timeout_ms: 30_000,
            linger_ms: 60_000,
            channel_capacity: 256,
            push_pull: true,
            push_pull_many: true,
        }
    }
}

/// How the workers' steps line up: the sync policy and what a BSP round
/// may do about its slow workers (the `[sync]` table).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SyncConfig {
    /// `bsp`, `ssp:N`, `dssp:LO-HI` or `asp`.
    pub policy: SyncPolicy,
    /// Overlap communication with compute: a worker computes step t+1's
    /// gradients on the parameters it has while step t's pushes and pulls
    /// are on the wire, so a step costs about max(compute, communication)
    /// instead of their sum. Each worker is then one step staler, and the
    /// owners' clock bound is one lower to keep the policy's bound on the
    /// parameters a worker computes on (`SyncPolicy::pipelined`). Needs
    /// `ssp:N` with N >= 1, `dssp:LO-HI` with LO >= 1, or `asp`: under BSP
    /// the next forward pass needs every shard's new version.
    pub overlap: bool,
    /// BSP: a round that has waited this long (ms) for its last gradients
    /// is applied with the ones it has; the missing workers catch up. Must
    /// be below `cluster.request_timeout_ms`.
    pub round_timeout_ms: u64,
    /// Backup workers (Chen et al., "Revisiting distributed synchronous
    /// SGD"): a BSP round is applied as soon as all but this many of its
    /// workers have pushed, so the slowest `backup_workers` never hold a
    /// round back. A push that arrives after its round was applied is
    /// dropped (its samples are counted in `/status` as `dropped_samples`),
    /// and that worker skips ahead to the round in progress. Needs lockstep
    /// rounds (pull mode, BSP, no `[local_steps]`); a round always waits
    /// for at least one push. 0: every round waits for every worker.
    pub backup_workers: u32,
    /// A slow worker under BSP trains on a smaller batch, sized so that its
    /// step computes in about the time the other workers' steps take (their
    /// step time less communication, from heartbeats), instead of holding
    /// every round back; owners weigh its gradient by its samples. Only a
    /// worker at least 2x slower than the others shrinks, to at least a
    /// sixteenth of `training.batch_size` (`policy::fit`). Needs lockstep
    /// rounds (pull mode, BSP, no `[local_steps]`).
    pub fit_batch: bool,
    /// With `fit_batch`: the workers that keep their full batch take on the
    /// samples the fitted ones shed, spread evenly (each from the rest of
    /// its own partition's epoch, at most twice its batch), so a round still
    /// holds the configured global batch (`policy::fit::rebalanced`).
    /// Workers gossip the share of their batch they trained on
    /// (`Pace::batch_permille`). false: the fitted worker's shortfall is
    /// simply lost from each round.
    pub fit_rebalance: bool,
}

impl Default for SyncConfig {
    fn default() -> Self {
        Self {
            policy: SyncPolicy::Bsp,
            overlap: false,
            round_timeout_ms: 10_000,
            backup_workers: 0,
            fit_batch: false,
            fit_rebalance: true,
        }
    }
}

/// Elastic roles: who owns shards, how slow owners are told apart, how many
/// owners there are, and how shards are kept safe while they move (the
/// `[roles]` table).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RolesConfig {
    /// Demote slow shard owners and move their shards. `false` keeps the
    /// assignment fixed except for failures.
    pub elastic: bool,
    /// Demote an owner whose median service time is this many times the
    /// cluster's norm.
    pub demote_ratio: f64,
    /// A demoted owner may own shards again once within this ratio of the
    /// norm (hysteresis).
    pub restore_ratio: f64,
    /// ... and is also slower than the norm by at least this many ms per
    /// push (a floor against scheduling noise on fast links).
    pub straggler_min_excess_ms: f64,
    /// How many nodes own shards: `"auto"` (explore, as in PSLD), `"all"`
    /// (every capable node) or a count.
    pub aggregators: Aggregators,
    /// With `aggregators = "auto"`: how many to start from; 0 starts from
    /// every capable node.
    pub start_aggregators: u16,
    /// With `aggregators = "auto"`: steps per measurement window (the first
    /// decision comes after a quarter of one); a change of the number of
    /// aggregators is judged one settled window later.
    pub explore_window_steps: u64,
    /// With `aggregators = "auto"`: an aggregator is removed (in a trial)
    /// when the median share of step time spent exchanging shards is at
    /// most this, from 0 up to (not including) 0.5, the share at which one
    /// is added.
    pub explore_idle_share: f64,
    /// Workers forget an owner's service time after this many steps without
    /// pushing to it, so a demoted owner gets another try.
    pub service_forget_steps: u64,
    /// Copies of each shard: 2 keeps a replica on the next rendezvous choice;
    /// 1 keeps none.
    pub replicas: u32,
    /// Send the replica every this many versions: the most versions a
    /// single failure can lose.
    pub replica_every: u64,
    /// How long (ms) a new owner waits for a live old owner's transfer
    /// before it restores the shard from a replica.
    pub handoff_timeout_ms: u64,
}

impl Default for RolesConfig {
    fn default() -> Self {
        Self {
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
            replica_every: 4,
            handoff_timeout_ms: 5_000,
        }
    }
}

impl RolesConfig {
    /// The straggler detector's thresholds for a model of `params` values
    /// in `shards` shards: the floor `straggler_min_excess_ms` is per push,
    /// reports are per MiB of the mean shard, and gossiped compute rates by
    /// the time they add to a step. Static roles judge nobody slow
    /// (only failures move shards).
    pub fn health_policy(&self, params: usize, shards: usize) -> crate::policy::health::HealthPolicy {
        use crate::policy::health::HealthPolicy;
        if !self.elastic {
            return HealthPolicy::inert();
        }
        let shard_mib = (params as f64 * 4.0 / shards.max(1) as f64) / (1024.0 * 1024.0);
        HealthPolicy {
            demote_ratio: self.demote_ratio,
            restore_ratio: self.restore_ratio,
            min_excess_micros_per_mib: self.straggler_min_excess_ms * 1e3 / shard_mib.max(f64::MIN_POSITIVE),
            min_excess_micros_per_step: self.straggler_min_excess_ms * 1e3,
        }
    }
}

/// How shard owners combine and screen what workers push, and what the
/// workers push (the `[aggregation]` table; docs/operations.md#bad-peers).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AggregationConfig {
    /// How a shard owner combines a BSP round's gradients: `mean`,
    /// `trimmed_mean:F`, `median` or `centered_clip:TAU` (see
    /// `policy::robust`). The robust rules need `sync.policy = "bsp"`.
    pub rule: crate::policy::robust::Aggregation,
    /// Owners reject a gradient whose L2 norm exceeds this many times the
    /// median norm of its round (BSP) or of the last 16 accepted pushes
    /// (SSP, DSSP, ASP; after the shard's first 64 pushes). 0 turns the check
    /// off. Left out: 50 under BSP and off under the other policies: single
    /// honest batch gradients late in training exceeded 20x the median of
    /// their round or window, and a tighter K dropped them.
    pub norm_check: Option<f32>,
    /// The norm floor: owners also reject a gradient whose L2 norm is below
    /// the same median divided by this, as a free-rider's push of zeros or
    /// of a shrunken copy. 0 (the default) turns it off: an honest gradient
    /// is zero on a shard that no sample of its batch touched (rows of an
    /// embedding), so turn it on where every shard gets a gradient from
    /// every batch. 0 or at least 1.
    pub norm_floor: f32,
    /// Each worker pushes the moving average of its gradients,
    /// `m = b * m + (1 - b) * g`, instead of the raw gradient: with `b` near
    /// 0.9 the honest pushes vary far less, so the robust rules tell them
    /// from a bad peer's (Karimireddy, He and Jaggi, 2021). Pull mode only;
    /// pair it with `training.momentum = 0` and a learning rate about
    /// `1 / (1 - b)` times larger. 0: raw gradients.
    pub worker_momentum: f32,
    /// The contribution check (BSP): owners score each worker's gradients
    /// by their cosine with the round's aggregate, as a moving average
    /// (weight 0.1 a round, from the 10th round on), and leave a worker
    /// whose score is below this out of the rounds until it rises again (at
    /// most a third of a round, the lowest first). From -1 to below 1; left
    /// out: off. Experimental: it does not yet tell honest from flipped
    /// pushes late in training (docs/benchmarks.md).
    pub min_agreement: Option<f32>,
}

impl Default for AggregationConfig {
    fn default() -> Self {
        Self {
            rule: crate::policy::robust::Aggregation::Mean,
            norm_check: None,
            norm_floor: 0.0,
            worker_momentum: 0.0,
            min_agreement: None,
        }
    }
}

/// DiLoCo (the `[local_steps]` table; without it every step pushes its
/// gradient): each worker takes `steps` local steps with its own optimizer
/// (`training.optimizer`, AdamW in DiLoCo) before it pushes the
/// pseudo-gradient (its parameters at the start of the round minus its
/// parameters now); the owners apply it with an outer Nesterov SGD. Needs
/// pull mode and `sync.policy = "bsp"`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalStepsConfig {
    /// Local steps per round (H), at least 2.
    pub steps: u64,
    /// The owners' outer learning rate (DiLoCo's is 0.7).
    #[serde(default = "LocalStepsConfig::default_outer_lr")]
    pub outer_lr: f64,
    /// The owners' outer Nesterov momentum (DiLoCo's is 0.9).
    #[serde(default = "LocalStepsConfig::default_outer_momentum")]
    pub outer_momentum: f64,
    /// Delta pulls: `"none"` (workers pull every shard whole each round)
    /// or a lossy encoding (`"int8"`, `"bf16"`, `"topk:F"`,
    /// `"sparseloco:F"`) in which owners send each round's update instead,
    /// with error feedback. Every worker's copy stays bit for bit the
    /// owners' (a hash checks it; a mismatch pulls the shard whole).
    #[serde(default)]
    pub delta: PushCompression,
}

impl LocalStepsConfig {
    /// Local steps per round as the `--local-steps H` flag gives them: none
    /// for H <= 1 (every step pushes its gradient), else H steps with
    /// DiLoCo's outer optimizer.
    pub fn per_round(steps: u64) -> Option<Self> {
        (steps > 1).then(|| Self::every(steps))
    }

    /// `steps` local steps per round with DiLoCo's outer optimizer.
    pub fn every(steps: u64) -> Self {
        Self {
            steps,
            outer_lr: Self::default_outer_lr(),
            outer_momentum: Self::default_outer_momentum(),
            delta: PushCompression::None,
        }
    }

    fn default_outer_lr() -> f64 {
        0.7
    }

    fn default_outer_momentum() -> f64 {
        0.9
    }
}

/// Gossip mode's own settings (the `[gossip]` table, only with
/// `cluster.mode = "gossip"`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GossipConfig {
    /// Average with a random peer every this many steps.
    pub every: u64,
}

impl Default for GossipConfig {
    fn default() -> Self {
        Self { every: 5 }
    }
}

/// Fault injection and link emulation, for tests and benchmarks (the
/// `[faults]` table). None of it is on unless set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultsConfig {
    /// Answer every push and pull this node serves as an owner this many ms
    /// late.
    pub delay_ms: u64,
    /// Stretch every gradient computation to this many times its length (a
    /// slow machine). 1.0: none.
    pub slowdown: f64,
    /// Send the shard states this node serves as an owner over an emulated
    /// link of this many Mbit/s, one after another (a slow uplink). 0: none.
    pub serve_mbps: f64,
    /// This node's pushed gradients are `none` (honest), `scale:F`
    /// (multiplied by F), `sign_flip` (negated) or `random` (random values
    /// with the honest norm).
    pub byzantine: crate::ops::faults::Byzantine,
    /// Link emulation: this node's link to its peers runs at this many
    /// Mbit/s in each direction (pushes and served answers queue on the way
    /// out, pulled and pushed tensors on the way in). 0: none.
    pub link_mbps: f64,
    /// Link emulation: one-way latency added to every message this node
    /// sends, in ms.
    pub link_latency_ms: f64,
}

impl Default for FaultsConfig {
    fn default() -> Self {
        Self {
            delay_ms: 0,
            slowdown: 1.0,
            serve_mbps: 0.0,
            byzantine: crate::ops::faults::Byzantine::None,
            link_mbps: 0.0,
            link_latency_ms: 0.0,
        }
    }
}

impl FaultsConfig {
    /// The fault injections and the emulated link this table sets, or what
    /// is wrong with them (named by key).
    pub fn faults(&self) -> Result<crate::ops::faults::Faults, String> {
        let f = crate::ops::faults::Faults::new(self.delay_ms, self.slowdown)?;
        f.set_serve_mbps(self.serve_mbps)?;
        f.set_link(self.link_mbps, self.link_latency_ms)?;
        Ok(f)
    }
}

/// A preset of settings for a kind of machine. It sits under the config
/// file: what the file sets wins, and flags win over both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Profile {
    /// A small board: no shard ownership, bounded frames and queues.
    // What it sets: `EDGE_PROFILE`.
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
    /// A preset under this file's settings (`edge`).
    pub profile: Option<Profile>,
    /// Name of the run; nodes of different runs ignore each other.
    pub run_id: String,
    /// A node name for logs and status (default: the last 6 characters of the peer id).
    pub name: Option<String>,
    /// Ed25519 identity: a file holding a 32-byte secret (created if missing).
    /// None: a fresh identity per start.
    pub identity: Option<PathBuf>,
    pub training: TrainingConfig,
    pub cluster: ClusterConfig,
    /// The sync policy and what BSP rounds do about slow workers.
    pub sync: SyncConfig,
    /// Elastic roles: demotion, the number of owners, replicas, handoffs.
    pub roles: RolesConfig,
    /// How owners combine and screen pushes (robust aggregation).
    pub aggregation: AggregationConfig,
    /// What this node sends: `push = "none" | "bf16" | "int8" |
    /// "topk:FRACTION" | "sfb"` for its gradients (the lossy ones with
    /// error feedback), `pull = "none" | "bf16"` for the parameters it
    /// pulls. Each node chooses its own; owners accept any. Pull mode only.
    pub compression: crate::policy::compress::CompressionConfig,
    /// DiLoCo's local steps; none: every step pushes its gradient.
    pub local_steps: Option<LocalStepsConfig>,
    /// Gossip mode's settings; only with `cluster.mode = "gossip"`.
    pub gossip: Option<GossipConfig>,
    /// Fault injection and link emulation (testnets and benchmarks).
    pub faults: FaultsConfig,
    /// Transports, limits, timeouts, discovery and admission (see `docs/protocol.md`).
    /// Its `run_id` is ignored: the top-level `run_id` is used.
    pub network: ProtocolConfig,
    /// The status page, `/status`, `/metrics` and the control endpoint.
    pub http: HttpConfig,
    /// Shard checkpoints while training, for resuming after a full stop.
    pub checkpoint: CheckpointConfig,
    /// Write the trained model here when the node finishes or leaves: one
    /// safetensors file under the model's own layer names (see
    /// `docs/operations.md`).
    pub output: Option<PathBuf>,
    /// A Llama: also write the trained model here as a Hugging Face
    /// directory (`config.json`, `model.safetensors` ...) when the node
    /// finishes or leaves.
    pub output_hf: Option<PathBuf>,
}

/// Shard checkpoints (see `docs/operations.md`, "Checkpoints, model files
/// and resume").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// This node's checkpoint folder; none: no checkpoints.
    pub dir: Option<PathBuf>,
    /// Write an owned shard at every version that is a multiple of this.
    pub every_steps: u64,
    /// Also write an owned shard that changed when this many seconds passed
    /// since its last write (0: never).
    pub every_secs: u64,
    /// Files kept per shard (the newest).
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
    /// `host:port` to serve on, or `off`; port 0 is a free port (the
    /// address is printed at start).
    pub listen: String,
    /// Serve `POST /control/...` (fault injection, connection blocks, leave).
    /// For testnets only: anyone who can reach the port can use it.
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
            sync: SyncConfig::default(),
            roles: RolesConfig::default(),
            aggregation: AggregationConfig::default(),
            compression: Default::default(),
            local_steps: None,
            gossip: None,
            faults: FaultsConfig::default(),
            network: ProtocolConfig::default(),
            http: HttpConfig::default(),
            output: None,
            output_hf: None,
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
        refuse_moved_keys(&toml::from_str::<toml::Table>(text)?)?;
        // Parsed on its own first, so that errors point at the file's lines.
        let mine: NodeConfig = toml::from_str(text)?;
        let Some(profile) = profile.or(mine.profile) else { return Ok(mine) };
        let mut merged: toml::Table = toml::from_str(profile.toml()).context("the built-in profile")?;
        shoal_testnet::layers::merge_tables(&mut merged, toml::from_str(text)?);
        merged.insert("profile".into(), toml::Value::try_from(profile)?);
        Ok(merged.try_into()?)
    }

    /// The policy shard owners enforce: the run's, or with `sync.overlap`
    /// the pipelined one (a clock bound one lower).
    pub fn owner_policy(&self) -> SyncPolicy {
        let policy = self.sync.policy;
        if self.sync.overlap {
            policy.pipelined().unwrap_or(policy)
        } else {
            policy
        }
    }

    /// Delta pulls: how owners send each round's update (`local_steps.delta`),
    /// or `None` when workers pull whole shards.
    pub fn delta_pulls(&self) -> Option<PushCompression> {
        self.local_steps.map(|l| l.delta).filter(|d| *d != PushCompression::None)
    }

    /// Local steps per round: `local_steps.steps`, or 1 (every step pushes
    /// its gradient) without a `[local_steps]` table.
    pub fn steps_per_round(&self) -> u64 {
        self.local_steps.map_or(1, |l| l.steps)
    }

    /// Gossip mode's settings in force: the `[gossip]` table or its defaults.
    pub fn gossip(&self) -> GossipConfig {
        self.gossip.unwrap_or_default()
    }

    /// The norm check's factor K in force (0: off): `aggregation.norm_check`,
    /// or 50 under BSP and off under the other policies.
    pub fn norm_check_factor(&self) -> f32 {
        self.aggregation.norm_check.unwrap_or(if self.sync.policy == SyncPolicy::Bsp { 50.0 } else { 0.0 })
    }

    /// Owners apply BSP rounds: pull mode under `sync.policy = "bsp"`.
    pub fn bsp_rounds(&self) -> bool {
        self.cluster.mode == Mode::Pull && self.sync.policy == SyncPolicy::Bsp
    }

    /// BSP rounds of one step each (no local steps): every worker takes
    /// each step together, and a shard's version counts the steps taken.
    pub fn lockstep(&self) -> bool {
        self.bsp_rounds() && self.local_steps.is_none()
    }

    /// What a setting that needs [`Self::lockstep`] says it needs, with what
    /// this config has instead.
    fn lockstep_needs(&self) -> String {
        format!(
            "cluster.mode = \"pull\", sync.policy = \"bsp\" and no [local_steps] table (this config has {:?}, \
             sync {}, local_steps {})",
            self.cluster.mode,
            self.sync.policy,
            self.steps_per_round()
        )
    }

    /// DiLoCo's outer optimizer: Nesterov SGD at `local_steps.outer_lr` and
    /// `local_steps.outer_momentum`, or none without local steps.
    pub fn outer_optimizer(&self) -> Option<OptimizerConfig> {
        self.local_steps.map(|l| OptimizerConfig::Sgd {
            lr: l.outer_lr,
            momentum: l.outer_momentum,
            nesterov: true,
            weight_decay: 0.0,
        })
    }

    /// The optimizer shard owners run: the training optimizer, or with
    /// local steps the outer optimizer (the workers run the training one).
    pub fn owner_optimizer(&self) -> OptimizerConfig {
        self.outer_optimizer().unwrap_or_else(|| self.training.optimizer_config())
    }

    /// The owners' learning-rate schedule (by shard version): the run's, or
    /// with local steps the outer rate, constant.
    pub fn owner_schedule(&self) -> LrSchedule {
        match self.local_steps {
            Some(l) => LrSchedule { base: l.outer_lr, decay: LrDecay::None, steps: self.training.steps, warmup: 0 },
            None => self.training.lr_schedule(),
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
        t.optimizer_config().validate().context("training.lr, momentum and weight_decay")?;
        if t.warmup_steps > t.steps {
            bail!("training.warmup_steps ({}) is longer than the run (training.steps = {})", t.warmup_steps, t.steps);
        }
        t.model.check_dataset(&t.dataset).map_err(|e| anyhow::anyhow!("training.model and training.dataset: {e}"))?;
        if let (ArchKind::Llama, Some(context)) = (t.model, t.dataset.context()) {
            t.llama.unwrap_or_default().validate(context).map_err(|e| anyhow::anyhow!("training.llama: {e}"))?;
        }
        if t.tokenizer.is_some() && !t.dataset.is_language() {
            bail!("training.tokenizer cuts text into tokens, but training.dataset is {}", t.dataset);
        }
        if self.output_hf.is_some() && t.model != ArchKind::Llama {
            bail!(
                "output_hf writes a Hugging Face LlamaForCausalLM: it needs training.model = \"llama\", not {}",
                t.model
            );
        }
        if t.llama.is_some() && t.model != ArchKind::Llama {
            bail!("[training.llama] sizes a llama, but training.model is {}", t.model);
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
        match (c.mode, self.gossip) {
            (Mode::Pull, Some(_)) => {
                bail!("the [gossip] table applies only with cluster.mode = \"gossip\" (this config has pull mode)")
            }
            (Mode::Gossip, _) if self.gossip().every == 0 => bail!("gossip.every must be at least 1"),
            _ => {}
        }
        Ok(())
    }

    /// Who owns shards: demotion and restoration, the exploration of the
    /// number of aggregators, replicas and handoffs.
    fn validate_roles(&self) -> anyhow::Result<()> {
        let r = &self.roles;
        if !(r.demote_ratio.is_finite() && r.restore_ratio.is_finite() && 1.0 < r.restore_ratio)
            || r.restore_ratio > r.demote_ratio
        {
            bail!(
                "roles.restore_ratio ({}) must be above 1 and at most roles.demote_ratio ({})",
                r.restore_ratio,
                r.demote_ratio
            );
        }
        if !(r.straggler_min_excess_ms.is_finite() && r.straggler_min_excess_ms >= 0.0) {
            bail!("roles.straggler_min_excess_ms must be a non-negative number");
        }
        let dominate = crate::policy::explore::ExplorePolicy::default().dominate_share;
        if !(0.0..dominate).contains(&r.explore_idle_share) {
            bail!(
                "roles.explore_idle_share must be at least 0 and below {dominate} (the share at which an aggregator \
                 is added), got {}",
                r.explore_idle_share
            );
        }
        if r.explore_window_steps == 0 {
            bail!("roles.explore_window_steps must be at least 1");
        }
        if r.start_aggregators > 0 && r.aggregators != Aggregators::Auto {
            bail!("roles.start_aggregators applies only with roles.aggregators = \"auto\" (it is {})", r.aggregators);
        }
        if !(1..=2).contains(&r.replicas) {
            bail!("roles.replicas must be 1 (no replica) or 2 (one backup), got {}", r.replicas);
        }
        if r.replicas == 2 && r.replica_every == 0 {
            bail!("roles.replica_every must be at least 1 when roles.replicas = 2");
        }
        if r.handoff_timeout_ms == 0 {
            bail!("roles.handoff_timeout_ms must be positive");
        }
        Ok(())
    }

    /// What each exchange of a step may do, and the sync policy and rounds
    /// each needs: the round timeout, robust aggregation, worker momentum,
    /// overlap, fitted batches and backup workers.
    fn validate_rounds(&self) -> anyhow::Result<()> {
        let (s, a) = (&self.sync, &self.aggregation);
        if s.round_timeout_ms == 0 || s.round_timeout_ms >= self.cluster.request_timeout_ms {
            bail!(
                "sync.round_timeout_ms ({}) must be positive and below cluster.request_timeout_ms ({})",
                s.round_timeout_ms,
                self.cluster.request_timeout_ms
            );
        }
        if a.rule.is_robust() && !self.bsp_rounds() {
            bail!(
                "aggregation.rule = \"{}\" combines the gradients of a BSP round: it needs cluster.mode = \"pull\" \
                 and sync.policy = \"bsp\" (this config has {:?} and {}). With other policies, use \"mean\" and \
                 the norm check.",
                a.rule,
                self.cluster.mode,
                s.policy
            );
        }
        if let Some(m) = a.min_agreement {
            if !(-1.0..1.0).contains(&m) || !self.bsp_rounds() {
                bail!(
                    "aggregation.min_agreement ({m}) must be from -1 to below 1, and needs cluster.mode = \"pull\" \
                     and sync.policy = \"bsp\": it scores each worker's gradients against its round's aggregate"
                );
            }
        }
        if !(0.0..1.0).contains(&a.worker_momentum) || (a.worker_momentum > 0.0 && self.cluster.mode != Mode::Pull) {
            bail!(
                "aggregation.worker_momentum must be from 0 to below 1, and only in pull mode (got {})",
                a.worker_momentum
            );
        }
        if s.overlap
            && (self.cluster.mode != Mode::Pull || self.local_steps.is_some() || s.policy.pipelined().is_none())
        {
            bail!(
                "sync.overlap computes the next step while this one's exchange is on the wire, one step staler: \
                 it needs cluster.mode = \"pull\", no local steps, and sync.policy = \"ssp:N\" with N >= 1, \
                 \"dssp:LO-HI\" with LO >= 1, or \"asp\" (this config has {:?}, local_steps {}, sync {}; under \
                 bsp the next forward pass needs every shard's new version)",
                self.cluster.mode,
                self.steps_per_round(),
                s.policy
            );
        }
        if s.fit_batch && !self.lockstep() {
            bail!(
                "sync.fit_batch sizes a slow worker's batch to the pace of BSP rounds: it needs {}",
                self.lockstep_needs()
            );
        }
        if s.backup_workers > 0 && !self.lockstep() {
            bail!(
                "sync.backup_workers closes a BSP round without its slowest workers: it needs {}",
                self.lockstep_needs()
            );
        }
        Ok(())
    }

    /// DiLoCo: local steps, pushed as a pseudo-gradient that owners apply
    /// with the outer optimizer.
    fn validate_local_steps(&self) -> anyhow::Result<()> {
        let (Some(l), Some(outer)) = (self.local_steps, self.outer_optimizer()) else { return Ok(()) };
        if l.steps < 2 {
            bail!("local_steps.steps must be at least 2 (got {}); leave the [local_steps] table out for none", l.steps);
        }
        if !self.bsp_rounds() {
            bail!(
                "local_steps.steps = {} (DiLoCo) pushes a pseudo-gradient to owners that apply it in BSP \
                 rounds: it needs cluster.mode = \"pull\" and sync.policy = \"bsp\" (this config has {:?} and {})",
                l.steps,
                self.cluster.mode,
                self.sync.policy
            );
        }
        if self.aggregation.worker_momentum > 0.0 {
            bail!(
                "aggregation.worker_momentum applies to gradients pushed every step: leave it 0 with a \
                 [local_steps] table"
            );
        }
        outer.validate()?;
        if !(l.outer_lr.is_finite() && l.outer_lr > 0.0) {
            bail!("local_steps.outer_lr must be a positive number (got {})", l.outer_lr);
        }
        if l.delta == PushCompression::Sfb {
            bail!(
                "local_steps.delta = \"sfb\" is a gradient encoding: use none, bf16, int8, topk:FRACTION or \
                 sparseloco:FRACTION"
            );
        }
        if l.delta != PushCompression::None && self.compression.pull != PullCompression::None {
            bail!(
                "local_steps.delta = \"{}\" keeps every worker's copy exact, and compression.pull = \"{}\" \
                 would round the whole shards it pulls: leave compression.pull at none (the rounds' updates \
                 are what is compressed)",
                l.delta,
                self.compression.pull
            );
        }
        Ok(())
    }

    /// What the pushes and pulls are compressed to.
    fn validate_compression(&self) -> anyhow::Result<()> {
        let c = &self.compression;
        let compressed = *c != crate::policy::compress::CompressionConfig::default();
        if compressed && self.cluster.mode != Mode::Pull {
            bail!(
                "compression (push = \"{}\", pull = \"{}\") applies to pushes and pulls: it needs \
                 cluster.mode = \"pull\" (gossip mode exchanges whole f32 models)",
                c.push,
                c.pull
            );
        }
        if c.push == crate::policy::compress::PushCompression::Sfb
            && (self.aggregation.worker_momentum > 0.0
                || self.local_steps.is_some()
                || self.faults.byzantine != crate::ops::faults::Byzantine::None)
        {
            bail!(
                "compression.push = \"sfb\" sends each step's own gradient as the factors of its batch: \
                 it cannot carry worker momentum, DiLoCo's pseudo-gradients or a byzantine fault's altered \
                 gradient (this config has worker_momentum {}, local_steps {})",
                self.aggregation.worker_momentum,
                self.steps_per_round()
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
        for (key, v) in [
            ("aggregation.norm_check", self.norm_check_factor()),
            ("aggregation.norm_floor", self.aggregation.norm_floor),
        ] {
            if !(v.is_finite() && (v == 0.0 || v >= 1.0)) {
                bail!("{key} must be 0 (off) or a factor of at least 1, got {v}");
            }
        }
        Ok(())
    }

    /// This node's own settings: fault injection, its HTTP endpoint, its
    /// channels and the peers it dials.
    fn validate_node_local(&self) -> anyhow::Result<()> {
        let c = &self.cluster;
        self.faults.faults().map_err(|e| anyhow::anyhow!("faults.{e}"))?;
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
        match self.training.llama {
            Some(size) => m.with_llama_size(size),
            None => m,
        }
    }
}

/// The keys that moved when the config was split by concern: each old
/// path with its new one. A file that still writes an old key is refused
/// with a message naming the new place (never read silently as a default);
/// `docs/operations.md`, "Config keys that moved", lists this table, and a
/// test holds the two together.
pub const MOVED_KEYS: &[(&str, &str)] = &[
    ("training.gpt", "training.llama"),
    ("cluster.sync", "sync.policy"),
    ("cluster.overlap", "sync.overlap"),
    ("cluster.round_timeout_ms", "sync.round_timeout_ms"),
    ("cluster.backup_workers", "sync.backup_workers"),
    ("cluster.fit_batch", "sync.fit_batch"),
    ("cluster.fit_rebalance", "sync.fit_rebalance"),
    ("cluster.gossip_every", "gossip.every"),
    ("cluster.elastic", "roles.elastic"),
    ("cluster.demote_ratio", "roles.demote_ratio"),
    ("cluster.restore_ratio", "roles.restore_ratio"),
    ("cluster.straggler_min_excess_ms", "roles.straggler_min_excess_ms"),
    ("cluster.aggregators", "roles.aggregators"),
    ("cluster.start_aggregators", "roles.start_aggregators"),
    ("cluster.explore_window_steps", "roles.explore_window_steps"),
    ("cluster.explore_idle_share", "roles.explore_idle_share"),
    ("cluster.service_forget_steps", "roles.service_forget_steps"),
    ("cluster.replicas", "roles.replicas"),
    ("cluster.replica_every", "roles.replica_every"),
    ("cluster.handoff_timeout_ms", "roles.handoff_timeout_ms"),
    ("cluster.aggregation", "aggregation.rule"),
    ("cluster.norm_check", "aggregation.norm_check"),
    ("cluster.worker_momentum", "aggregation.worker_momentum"),
    ("cluster.compression", "compression"),
    ("cluster.local_steps", "local_steps.steps"),
    ("cluster.outer_lr", "local_steps.outer_lr"),
    ("cluster.outer_momentum", "local_steps.outer_momentum"),
    ("cluster.fault_delay_ms", "faults.delay_ms"),
    ("cluster.slowdown", "faults.slowdown"),
    ("cluster.fault_serve_mbps", "faults.serve_mbps"),
    ("cluster.fault_byzantine", "faults.byzantine"),
    ("cluster.link_mbps", "faults.link_mbps"),
    ("cluster.link_latency_ms", "faults.link_latency_ms"),
];

/// Refuse a config whose TOML still writes a key of [`MOVED_KEYS`], naming
/// every such key and where it went.
fn refuse_moved_keys(table: &toml::Table) -> anyhow::Result<()> {
    let moved: Vec<String> = MOVED_KEYS
        .iter()
        .filter(|(old, _)| has_key(table, old))
        .map(|(old, new)| format!("`{old}` is now `{new}`"))
        .collect();
    if !moved.is_empty() {
        bail!(
            "this config writes keys that have moved to their own tables: {} (see docs/operations.md, \
             \"Config keys that moved\")",
            moved.join(", ")
        );
    }
    Ok(())
}

/// Whether `table` holds the dotted `path` (`cluster.sync`).
fn has_key(table: &toml::Table, path: &str) -> bool {
    let mut parts = path.split('.');
    let first = parts.next().and_then(|k| table.get(k));
    parts.try_fold(first, |at, key| Some(at?.as_table()?.get(key))).flatten().is_some()
}

/// A factor that is off at 0, left out of [`RunAgreement`]'s hash then.
fn is_off(x: &f32) -> bool {
    *x == 0.0
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
    /// The model's shape (from `training.model`, `mlp_hidden`, `llama` and
    /// the data set's shape).
    pub model: ModelConfig,
    /// `training.dataset` and `training.tokenizer`: a text by its file
    /// name and its tokenizer's hash, a token directory by its content hash
    /// (peers may keep them in different folders).
    pub dataset: String,
    pub seed: u64,
    pub steps: u64,
    /// The optimizer as it runs: `training.optimizer`, `lr` (or its
    /// default) and `momentum`.
    pub optimizer: OptimizerConfig,
    pub lr_decay: LrDecay,
    /// `training.warmup_steps`.
    pub warmup_steps: u64,
    pub shards: u32,
    pub mode: Mode,
    pub sync: SyncPolicy,
    /// The `[roles]` keys that decide who owns what.
    pub roles: AgreedRoles,
    pub aggregation: crate::policy::robust::Aggregation,
    /// The norm check's factor in force: `cluster.norm_check`, or its
    /// default under the sync policy (a config that leaves it out agrees
    /// with one that writes the default).
    pub norm_check: f32,
    /// `aggregation.norm_floor`; left out of the hash when off, so a config
    /// without it agrees with nodes that predate it.
    #[serde(skip_serializing_if = "is_off")]
    pub norm_floor: f32,
    pub worker_momentum: f32,
    /// `aggregation.min_agreement`; left out of the hash when off, so a
    /// config without it agrees with nodes that predate it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_agreement: Option<f32>,
    /// DiLoCo's rounds: `local_steps.steps`, `outer_lr` and
    /// `outer_momentum`, or none.
    pub local_steps: Option<LocalStepsConfig>,
    pub overlap: bool,
    /// `sync.round_timeout_ms`: every owner forces its BSP rounds after it,
    /// so owners with different timeouts apply a late worker's gradient on
    /// some shards and not on others. Left out at its default (as are the
    /// two below), so a config that keeps it agrees with nodes that
    /// predate it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub round_timeout_ms: Option<u64>,
    /// `sync.backup_workers`: every owner closes a BSP round this many
    /// pushes short.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backup_workers: Option<u32>,
    /// `gossip.every` in gossip mode: when nodes average their models.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gossip_every: Option<u64>,
}

/// The `[roles]` settings every peer must share: they decide the
/// placement, which every node computes alone from the same view.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AgreedRoles {
    pub elastic: bool,
    pub demote_ratio: f64,
    pub restore_ratio: f64,
    pub straggler_min_excess_ms: f64,
    pub replicas: u32,
    pub aggregators: Aggregators,
    pub start_aggregators: u16,
    pub explore_window_steps: u64,
    pub explore_idle_share: f64,
}

impl RunAgreement {
    /// What `config` makes its node agree to, for the model it built.
    pub fn of(config: &NodeConfig, model: &ModelConfig) -> Self {
        let (t, r) = (&config.training, &config.roles);
        Self {
            run_id: config.run_id.clone(),
            model: model.clone(),
            dataset: agreed_dataset(t),
            seed: t.seed,
            steps: t.steps,
            optimizer: t.optimizer_config(),
            lr_decay: t.lr_decay,
            warmup_steps: t.warmup_steps,
            shards: config.cluster.shards,
            mode: config.cluster.mode,
            sync: config.sync.policy,
            roles: AgreedRoles {
                elastic: r.elastic,
                demote_ratio: r.demote_ratio,
                restore_ratio: r.restore_ratio,
                straggler_min_excess_ms: r.straggler_min_excess_ms,
                replicas: r.replicas,
                aggregators: r.aggregators,
                start_aggregators: r.start_aggregators,
                explore_window_steps: r.explore_window_steps,
                explore_idle_share: r.explore_idle_share,
            },
            aggregation: config.aggregation.rule,
            norm_check: config.norm_check_factor(),
            norm_floor: config.aggregation.norm_floor,
            worker_momentum: config.aggregation.worker_momentum,
            min_agreement: config.aggregation.min_agreement,
            local_steps: config.local_steps,
            overlap: config.sync.overlap,
            round_timeout_ms: Some(config.sync.round_timeout_ms)
                .filter(|&ms| ms != SyncConfig::default().round_timeout_ms),
            backup_workers: Some(config.sync.backup_workers).filter(|&b| b != 0),
            gossip_every: config
                .gossip
                .filter(|_| config.cluster.mode == Mode::Gossip)
                .map(|g| g.every)
                .filter(|&e| e != GossipConfig::default().every),
        }
    }

    /// The hash peers compare: [`canonical_hash`] of this struct as a JSON
    /// value.
    pub fn hash(&self) -> anyhow::Result<u64> {
        let value = serde_json::to_value(self).context("serialising what peers must agree on")?;
        Ok(canonical_hash(&value))
    }
}

/// A data set as peers compare it: a text by its window, its file name and
/// its tokenizer's hash; a token directory by its window and content hash
/// (peers may keep either in different folders).
fn agreed_dataset(t: &TrainingConfig) -> String {
    let name = |p: &Path| p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    match &t.dataset {
        DatasetKind::Text { path, context } => {
            let text = format!("text@{context}:{}", name(path));
            match &t.tokenizer {
                // A tokenizer that cannot be read stops the node when it
                // loads the data; until then it stands by its name.
                Some(p) => match Tokenizer::from_file(p) {
                    Ok(tk) => format!("{text} tokenizer {:016x}", tk.hash()),
                    Err(_) => format!("{text} tokenizer {}", name(p)),
                },
                None => text,
            }
        }
        DatasetKind::Tokens { dir, context } => match TokenIndex::read(dir) {
            Ok(index) => format!("tokens@{context}:{}", index.content_hash),
            Err(_) => format!("tokens@{context}:{}", name(dir)),
        },
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

/// The defaults with every optional table and key written out (local
/// steps, gossip, the norm check, admission, the Llama's size), so that
/// its TOML names every key the config has (tests of the docs and of moved
/// keys).
#[cfg(test)]
pub(crate) fn with_every_table() -> NodeConfig {
    let mut full = NodeConfig {
        local_steps: Some(LocalStepsConfig::every(4)),
        gossip: Some(GossipConfig::default()),
        ..NodeConfig::default()
    };
    full.aggregation.norm_check = Some(50.0);
    full.aggregation.min_agreement = Some(0.0);
    full.network.admission.psk = Some("0".repeat(64));
    full.network.admission.allowlist = Some(Vec::new());
    full.training.llama = Some(LlamaSize::default());
    full
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
        c.training.model = ArchKind::Llama;
        let e = c.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("trains on text:PATH"), "{e}");
        c.training.dataset = "text@32:corpus.txt".parse().unwrap_or_default();
        assert!(c.validate().is_ok(), "{:?}", c.validate());
        c.training.model = ArchKind::Mlp;
        let e = c.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("needs a language model"), "{e}");
        // A Llama on the same text, sized by its table; the table is
        // checked, and refused with another model.
        c.training.model = ArchKind::Llama;
        assert!(c.validate().is_ok(), "{:?}", c.validate());
        c.training.llama = Some(LlamaSize { kv_heads: 3, ..LlamaSize::default() });
        let e = c.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("training.llama") && e.contains("kv_heads"), "{e}");
        c.training.llama = Some(LlamaSize::default());
        c.training.model = ArchKind::Mlp;
        c.training.dataset = DatasetKind::Digits;
        let e = c.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("[training.llama] sizes a llama"), "{e}");
        c.training.llama = None;
        c.output_hf = Some("hf".into());
        let e = c.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("output_hf") && e.contains("llama"), "{e}");
        c.output_hf = None;
        // The TOML form.
        let toml_text = "run_id = \"r\"\n[training]\nmodel = \"llama\"\ndataset = \"text@32:c.txt\"\n\
                         llama = { layers = 2, heads = 4, kv_heads = 2, width = 64, ff = 96 }\n";
        let parsed: Result<NodeConfig, _> = toml::from_str(toml_text);
        assert!(parsed.as_ref().is_ok_and(|p| p.validate().is_ok()), "{parsed:?}");
    }

    #[test]
    fn sufficient_factors_need_the_batchs_own_gradient() {
        let mut c = NodeConfig::default();
        c.compression.push = crate::policy::compress::PushCompression::Sfb;
        assert!(c.validate().is_ok(), "{:?}", c.validate());
        c.aggregation.worker_momentum = 0.9;
        let e = c.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("sfb") && e.contains("worker_momentum 0.9"), "{e}");
        c.aggregation.worker_momentum = 0.0;
        c.cluster.mode = Mode::Gossip;
        let e = c.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("mode = \"pull\""), "{e}");
    }

    #[test]
    fn backup_workers_need_bsp_rounds() {
        let mut c = NodeConfig::default();
        c.sync.backup_workers = 1;
        assert!(c.validate().is_ok(), "{:?}", c.validate());
        c.sync.policy = SyncPolicy::Ssp { staleness: 2 };
        let e = c.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("backup_workers") && e.contains("sync ssp:2"), "{e}");
        c.sync.policy = SyncPolicy::Bsp;
        c.local_steps = Some(LocalStepsConfig::every(4));
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
        c.sync.policy = SyncPolicy::Ssp { staleness: 2 };
        c.roles.aggregators = Aggregators::Fixed(3);
        c.aggregation.norm_check = Some(20.0);
        c.aggregation.min_agreement = Some(0.2);
        c.sync.overlap = true;
        c.local_steps = Some(LocalStepsConfig::every(4));
        c.sync.round_timeout_ms = 4_000;
        c.sync.backup_workers = 1;
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
            (unusual_config(), ModelConfig::new(ArchKind::Llama, text_shape, 256)),
        ] {
            let base = serde_json::to_value(RunAgreement::of(&config, &model))?;
            let base_hash = canonical_hash(&base);
            let mut paths = Vec::new();
            leaves(&base, String::new(), &mut paths);
            let fields = base.as_object().map(|m| m.len()).unwrap_or(0);
            assert!(paths.len() >= 24 && paths.len() >= fields, "{} leaves in {fields} fields", paths.len());
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
            ("faults.delay_ms", |c| c.faults.delay_ms = 50),
            ("faults.link_mbps", |c| c.faults.link_mbps = 100.0),
            ("compression", |c| c.compression.push = crate::policy::compress::PushCompression::Bf16),
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
        // A token directory is named by its content, wherever it is; a text
        // cut by a tokenizer by that tokenizer's hash.
        let dir = tempfile::tempdir()?;
        let corpus = dir.path().join("corpus.txt");
        std::fs::write(&corpus, shoal_models::data::SAMPLE_TEXT)?;
        let tk = Tokenizer::train_bpe(std::slice::from_ref(&corpus), 300)?;
        let tk_path = dir.path().join("tokenizer.json");
        tk.save(&tk_path)?;
        let (a, b, c) = (dir.path().join("a"), dir.path().join("b"), dir.path().join("c"));
        shoal_models::data::tokenize_files(&tk, std::slice::from_ref(&corpus), &a, |_, _, _| ())?;
        shoal_models::data::tokenize_files(&tk, std::slice::from_ref(&corpus), &b, |_, _, _| ())?;
        shoal_models::data::tokenize_files(&tk, &[corpus.clone(), corpus.clone()], &c, |_, _, _| ())?;
        let tokens = |d: &Path| hash(&|c| c.training.dataset = DatasetKind::Tokens { dir: d.into(), context: 32 });
        assert_eq!(tokens(&a)?, tokens(&b)?);
        assert_ne!(tokens(&a)?, tokens(&c)?);
        let with_tokenizer = hash(&|c| {
            c.training.dataset = text("text@32:/home/a/corpus.txt");
            c.training.tokenizer = Some(tk_path.clone());
        })?;
        assert_ne!(here, with_tokenizer);
        // The norm check agreed is the factor in force: BSP's default of 50
        // written out is the same agreement.
        assert_eq!(hash(&|_| {})?, hash(&|c| c.aggregation.norm_check = Some(50.0))?);
        assert_ne!(hash(&|_| {})?, hash(&|c| c.aggregation.norm_check = Some(0.0))?);
        assert_ne!(hash(&|_| {})?, hash(&|c| c.aggregation.norm_floor = 10.0)?);
        // The learning rate agreed is the one the optimizer runs.
        assert_eq!(hash(&|_| {})?, hash(&|c| c.training.lr = Some(OptimizerConfig::default_lr(OptimizerKind::Sgd)))?);
        // The idle share is a field like any other.
        assert_ne!(hash(&|_| {})?, hash(&|c| c.roles.explore_idle_share = 0.1)?);
        // How rounds close and when gossip averages: agreed once they leave
        // their defaults (written out, a default is the same agreement).
        let base = hash(&|_| {})?;
        assert_eq!(base, hash(&|c| c.sync.round_timeout_ms = SyncConfig::default().round_timeout_ms)?);
        assert_ne!(base, hash(&|c| c.sync.round_timeout_ms = 4_000)?);
        assert_ne!(base, hash(&|c| c.sync.backup_workers = 1)?);
        let gossip = |every: Option<u64>| {
            hash(&|c| {
                c.cluster.mode = Mode::Gossip;
                c.gossip = every.map(|every| GossipConfig { every });
            })
        };
        assert_eq!(gossip(None)?, gossip(Some(GossipConfig::default().every))?);
        assert_ne!(gossip(None)?, gossip(Some(10))?);
        Ok(())
    }

    #[test]
    fn warmup_and_weight_decay_reach_the_schedule_and_the_optimizer() -> anyhow::Result<()> {
        let mut c = NodeConfig::default();
        c.training.warmup_steps = 10;
        c.training.weight_decay = Some(0.01);
        c.validate()?;
        let schedule = c.training.lr_schedule();
        let lr = c.training.optimizer_config().lr();
        assert!(schedule.lr_at(0) < 0.2 * lr && (schedule.lr_at(10) - lr).abs() < 1e-12, "{schedule:?}");
        assert!(
            matches!(c.training.optimizer_config(), OptimizerConfig::Sgd { weight_decay, .. } if weight_decay == 0.01)
        );
        c.training.optimizer = OptimizerKind::Adamw;
        assert!(
            matches!(c.training.optimizer_config(), OptimizerConfig::Adamw { weight_decay, .. } if weight_decay == 0.01)
        );
        let digits = digits_model();
        let base = RunAgreement::of(&NodeConfig::default(), &digits).hash()?;
        assert_ne!(RunAgreement::of(&c, &digits).hash()?, base, "warm-up and weight decay are agreed");
        for (set, want) in [
            (
                NodeConfig {
                    training: TrainingConfig { warmup_steps: 301, ..Default::default() },
                    ..Default::default()
                },
                "warmup_steps",
            ),
            (
                NodeConfig {
                    training: TrainingConfig { weight_decay: Some(-1.0), ..Default::default() },
                    ..Default::default()
                },
                "weight_decay",
            ),
        ] {
            let e = set.validate().err().map(|e| format!("{e:#}")).unwrap_or_default();
            assert!(e.contains(want), "{want}: {e}");
        }
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
        // With every optional field set, so that each is listed.
        let mut config = NodeConfig::default();
        config.aggregation.min_agreement = Some(0.0);
        config.aggregation.norm_floor = 10.0;
        config.sync.round_timeout_ms = 4_000;
        config.sync.backup_workers = 1;
        config.cluster.mode = Mode::Gossip;
        config.gossip = Some(GossipConfig { every: 10 });
        let agreed = serde_json::to_value(RunAgreement::of(&config, &digits_model()))?;
        // Each field by its name, and the agreed roles each as `roles.KEY`.
        let keys =
            |v: &serde_json::Value| v.as_object().map(|m| m.keys().cloned().collect::<Vec<_>>()).unwrap_or_default();
        let roles: Vec<String> = keys(&agreed["roles"]).into_iter().map(|k| format!("roles.{k}")).collect();
        assert!(roles.len() >= 9, "agreed roles: {roles:?}");
        let names: Vec<String> = keys(&agreed).into_iter().filter(|k| k != "roles").chain(roles).collect();
        let fields: std::collections::BTreeSet<&str> = names.iter().map(String::as_str).collect();
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
        let e = toml::from_str::<NodeConfig>("[sync]\npolicy = \"raft\"\n")
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
            let got = toml::from_str::<NodeConfig>(&format!("[roles]\naggregators = {text}\n"));
            assert_eq!(got.as_ref().ok().map(|c| c.roles.aggregators), want, "{text}: {got:?}");
        }
        let e = toml::from_str::<NodeConfig>("[roles]\naggregators = 0\n").err().map(|e| e.to_string());
        assert!(e.unwrap_or_default().contains("expected auto, all or a count"));
        let mut c = NodeConfig::default();
        c.cluster.failure_timeout_ms = 100;
        assert!(c.validate().is_err());
        let c = NodeConfig { run_id: String::new(), ..NodeConfig::default() };
        assert!(c.validate().is_err());
    }

    #[test]
    fn an_old_key_is_refused_with_its_new_place() {
        for (old, new) in MOVED_KEYS {
            let (table, key) = old.split_once('.').unwrap_or(("", old));
            // A value of the old key's kind does not matter: it is refused
            // before it is read.
            let text = format!("[{table}]\n{key} = 1\n");
            let e = NodeConfig::from_toml(&text, None).err().map(|e| format!("{e:#}")).unwrap_or_default();
            assert!(e.contains(&format!("`{old}` is now `{new}`")), "{old}: {e}");
            assert!(e.contains("Config keys that moved"), "{old}: {e}");
        }
        // Every old key written at once is named at once.
        let e = NodeConfig::from_toml("[cluster]\nsync = \"asp\"\nslowdown = 2.0\nlocal_steps = 4\n", None)
            .err()
            .map(|e| format!("{e:#}"))
            .unwrap_or_default();
        for want in [
            "`cluster.sync` is now `sync.policy`",
            "`cluster.slowdown` is now `faults.slowdown`",
            "`cluster.local_steps` is now `local_steps.steps`",
        ] {
            assert!(e.contains(want), "{e}");
        }
        // The new places parse, and each lands where its name says.
        let c = NodeConfig::from_toml(
            "[sync]\npolicy = \"asp\"\n[faults]\nslowdown = 2.0\n[local_steps]\nsteps = 4\n[roles]\nreplicas = 1\n",
            None,
        );
        let c = c.unwrap_or_default();
        assert_eq!(c.sync.policy, SyncPolicy::Asp);
        assert_eq!(c.faults.slowdown, 2.0);
        assert_eq!(c.local_steps, Some(LocalStepsConfig::every(4)));
        assert_eq!(c.roles.replicas, 1);
    }

    #[test]
    fn every_new_place_of_a_moved_key_exists_and_no_old_place_does() -> anyhow::Result<()> {
        // The new paths, in the full config: optional tables written out.
        let full = toml::Table::try_from(with_every_table())?;
        for (old, new) in MOVED_KEYS {
            assert!(has_key(&full, new), "{new} (the new place of {old}) is not a key of the config");
            assert!(!has_key(&full, old), "{old} moved but is still a key of the config");
        }
        Ok(())
    }

    #[test]
    fn the_docs_list_exactly_the_moved_keys() {
        let docs = include_str!("../../docs/operations.md");
        let heading = "## Config keys that moved";
        let section = docs.split_once(heading).map(|(_, rest)| rest).unwrap_or_default();
        let section = section.split("\n#").next().unwrap_or_default();
        let rows: Vec<(String, String)> = section
            .lines()
            .filter_map(|l| {
                let cells: Vec<&str> = l.split('|').map(str::trim).collect();
                match cells.as_slice() {
                    ["", old, new, ""] if old.starts_with('`') => {
                        Some((old.trim_matches('`').to_string(), new.trim_matches('`').to_string()))
                    }
                    _ => None,
                }
            })
            .collect();
        let want: Vec<(String, String)> = MOVED_KEYS.iter().map(|(o, n)| (o.to_string(), n.to_string())).collect();
        assert_eq!(rows, want, "docs/operations.md, `{heading}`, differs from MOVED_KEYS");
    }

    #[test]
    fn the_example_config_shows_the_defaults() -> anyhow::Result<()> {
        let mut example = NodeConfig::from_toml(include_str!("../../testnet/node.example.toml"), None)?;
        // The keys whose comments say they are not the default.
        let defaults = NodeConfig::default();
        assert_eq!(example.run_id, "example");
        assert_eq!(example.cluster.min_peers, 4);
        example.run_id = defaults.run_id.clone();
        example.cluster.min_peers = defaults.cluster.min_peers;
        example.network.listen = defaults.network.listen.clone();
        assert_eq!(example, defaults);
        Ok(())
    }

    #[test]
    fn the_contribution_check_needs_bsp_rounds_and_a_cosine_bound() {
        let mut c = NodeConfig::default();
        c.aggregation.min_agreement = Some(0.0);
        assert!(c.validate().is_ok(), "{:?}", c.validate());
        for m in [1.0, -1.5, f32::NAN] {
            c.aggregation.min_agreement = Some(m);
            let e = c.validate().err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains("aggregation.min_agreement"), "{m}: {e}");
        }
        c.aggregation.min_agreement = Some(0.1);
        c.sync.policy = SyncPolicy::Asp;
        let e = c.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("aggregation.min_agreement") && e.contains("bsp"), "{e}");
    }

    #[test]
    fn the_norm_floor_is_off_or_a_factor_of_at_least_one() {
        let mut c = NodeConfig::default();
        for ok in [0.0, 1.0, 10.0] {
            c.aggregation.norm_floor = ok;
            assert!(c.validate().is_ok(), "{ok}: {:?}", c.validate());
        }
        for bad in [0.5, -1.0, f32::NAN, f32::INFINITY] {
            c.aggregation.norm_floor = bad;
            let e = c.validate().err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains("aggregation.norm_floor"), "{bad}: {e}");
        }
    }

    #[test]
    fn local_steps_need_two_steps_and_bsp_rounds() {
        let mut c = NodeConfig { local_steps: Some(LocalStepsConfig::every(1)), ..NodeConfig::default() };
        let e = c.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("local_steps.steps must be at least 2"), "{e}");
        c.local_steps = LocalStepsConfig::per_round(20);
        assert!(c.validate().is_ok(), "{:?}", c.validate());
        assert_eq!((c.steps_per_round(), c.owner_optimizer().lr()), (20, 0.7));
        c.sync.policy = SyncPolicy::Asp;
        let e = c.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("needs cluster.mode = \"pull\" and sync.policy = \"bsp\""), "{e}");
        assert_eq!(LocalStepsConfig::per_round(1), None);
        // A [gossip] table in pull mode is refused, not ignored.
        let c = NodeConfig { gossip: Some(GossipConfig { every: 3 }), ..NodeConfig::default() };
        let e = c.validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("[gossip] table applies only"), "{e}");
    }

    #[test]
    fn no_config_table_has_more_than_twenty_keys() -> anyhow::Result<()> {
        let full = NodeConfig {
            local_steps: Some(LocalStepsConfig::every(4)),
            gossip: Some(GossipConfig::default()),
            ..NodeConfig::default()
        };
        fn check(path: &str, table: &toml::Table) {
            assert!(table.len() <= 20, "{path} has {} keys", table.len());
            for (key, value) in table {
                if let toml::Value::Table(t) = value {
                    check(&format!("{path}.{key}"), t);
                }
            }
        }
        check("the top level", &toml::Table::try_from(&full)?);
        Ok(())
    }

    #[test]
    fn the_docs_defaults_are_the_code_defaults() -> anyhow::Result<()> {
        let docs = include_str!("../../docs/operations.md");
        let section = docs.split_once("### The config file").map(|(_, r)| r).unwrap_or_default();
        let section = section.split("\n### ").next().unwrap_or_default();
        // The optional tables written out with their defaults.
        let mut full = NodeConfig {
            local_steps: Some(LocalStepsConfig::every(2)),
            gossip: Some(GossipConfig::default()),
            ..NodeConfig::default()
        };
        full.training.llama = Some(LlamaSize::default());
        let full = toml::Table::try_from(&full)?;
        let number = |v: &toml::Value| v.as_float().or(v.as_integer().map(|i| i as f64));
        let (mut table, mut checked) = (String::new(), 0);
        for line in section.lines() {
            if line.starts_with("**Top level**") {
                table.clear();
            } else if let Some(rest) = line.strip_prefix("**`[") {
                table = rest.split(']').next().unwrap_or_default().to_string();
            }
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let (Some(key), Some(default)) = (cells.get(1).and_then(|k| k.strip_prefix('`')), cells.get(2)) else {
                continue;
            };
            let key = key.trim_end_matches('`');
            if table == "network" || key.starts_with('[') {
                continue; // described by its own section of protocol.md
            }
            // A dotted table name (`training.llama`) is a table in a table.
            let at = table.split('.').filter(|k| !k.is_empty()).try_fold(&full, |t, k| t.get(k)?.as_table());
            let value = at.and_then(|t| t.get(key));
            if *default == "none" {
                assert!(value.is_none(), "[{table}] {key}: the docs say none, the code has {value:?}");
                checked += 1;
                continue;
            }
            // A default the docs describe in words is not compared.
            let Ok(doc) = toml::from_str::<toml::Table>(&format!("v = {}", default.trim_matches('`'))) else {
                continue;
            };
            let (Some(doc), Some(value)) = (doc.get("v"), value) else { continue };
            let same = match (number(doc), number(value)) {
                (Some(a), Some(b)) => a == b,
                _ => doc == value,
            };
            assert!(same, "[{table}] {key}: the docs say {doc}, the code has {value}");
            checked += 1;
        }
        assert!(checked >= 60, "only {checked} documented defaults were compared");
        Ok(())
    }
}
