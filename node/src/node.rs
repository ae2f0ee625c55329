//! One Shoal node, in five phases: build the actors ([`start`]), then, on
//! the node task, enter the run (roster, join or resume), elect, train, and
//! finish (linger until its peers are done, and report).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use futures::StreamExt;
use shoal_models::{
    data, Evaluation, Model, ModelConfig, ModelFile, ModelMeta, ShardCheckpoint, ShardDir, ShardOf, ShardPlan,
    TrainableModel,
};
use shoal_protocol::frame::GossipSigner;
use shoal_protocol::libp2p::identity::Keypair;
use shoal_protocol::libp2p::{Multiaddr, PeerId};
use shoal_protocol::{build_swarm_with, Capabilities, Device, ProtocolConfig, Role, RunId, ValidationContext};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::actors::aggregator::{self, AggregatorConfig, CheckpointPolicy};
use crate::actors::election::{self, ElectionConfig};
use crate::actors::join::{donor_count, fetch_model, join_point, owners_cover, start_step, JoinPoint};
use crate::actors::membership::{self, MembershipConfig};
use crate::actors::net::{self, NetworkParts};
use crate::actors::worker::{Ran, Routing, Worker};
use crate::actors::{status, trainer};
use crate::config::{Aggregators, ClusterConfig, Mode, NodeConfig, RunAgreement};
use crate::handles::aggregator::{AggregatorHandle, ShardStats};
use crate::handles::election::ElectionHandle;
use crate::handles::handoff::ShardState;
use crate::handles::leave::LeaveSwitch;
use crate::handles::membership::{Heard, MembershipHandle};
use crate::handles::net::{ModelSnapshot, NetworkHandle, Routes};
use crate::handles::status::{RoleView, StatusEvent, StatusHandle, StatusSnapshot};
use crate::handles::trainer::TrainerHandle;
use crate::ops::logging::short;
use crate::ops::tasks::NodeTasks;
use crate::policy::backoff::Backoff;
use crate::policy::explore::ExplorePolicy;
use crate::policy::health::ServiceTracker;
use crate::policy::placement::{owner_shard_bytes, ElectPolicy, Own, Placement};
use crate::policy::resume::{offers_of, resume_point, ResumePoint};
use crate::policy::sync::SyncPolicy;
use crate::policy::view::{Roster, RosterStatus, SelfState, ShardNews};

/// What a finished node reports.
#[derive(Debug, Clone)]
pub struct NodeReport {
    pub peer_id: PeerId,
    pub name: String,
    pub accuracy: f32,
    pub loss: f32,
    /// Language models: the final validation loss in bits per byte.
    pub bits_per_byte: Option<f32>,
    pub steps: u64,
    /// Left cleanly before the last step (`steps` is where it stopped).
    pub left: bool,
    /// Final flat parameters.
    pub params: Vec<f32>,
    /// The shards this node owned when its training ended (none after it
    /// left), as its placement had them.
    pub owned_shards: Vec<u32>,
    /// At the end: the shards its aggregator holds.
    pub shard_stats: Vec<ShardStats>,
    pub roster: Vec<PeerId>,
    pub status: Option<StatusSnapshot>,
    /// At the end: each suspect in this node's view, with the peers that
    /// name it (this node included); see [`crate::policy::view::View::suspected_by`].
    pub suspected_by: BTreeMap<PeerId, Vec<PeerId>>,
    /// At the end: the capabilities each peer in this node's view last
    /// gossiped (memory left at its start, measured compute and exchange
    /// rates).
    pub peer_capabilities: BTreeMap<PeerId, Capabilities>,
    /// The model the run trains (its config rebuilds the layer shapes).
    pub model: ModelConfig,
    /// It stopped once every live peer had said `finished` or had
    /// disconnected (docs/protocol.md §6.3); false when it waited out the
    /// failure timeout for one, or left before the end.
    pub peers_finished: bool,
}

impl NodeReport {
    /// `test accuracy 93.45%`, or `test bits/byte 2.104` for a language
    /// model (its test split is the text's validation part).
    pub fn headline(&self) -> String {
        let eval =
            Evaluation { loss: self.loss, accuracy: self.accuracy, samples: 0, bits_per_byte: self.bits_per_byte };
        format!("test {}", eval.headline())
    }

    /// This node's final model as a model file, with where it came from.
    pub fn model_file(&self, config: &NodeConfig) -> ModelFile {
        ModelFile {
            model: self.model.clone(),
            params: self.params.clone(),
            meta: ModelMeta {
                run_id: config.run_id.clone(),
                step: self.steps,
                seed: config.training.seed,
                dataset: config.training.dataset.to_string(),
                accuracy: Some(self.accuracy),
                loss: Some(self.loss),
            },
        }
    }

    /// Write this node's final model (a Llama) as a Hugging Face directory
    /// at `dir`, off the async runtime's threads.
    pub async fn write_hf(&self, config: &NodeConfig, dir: &std::path::Path) -> anyhow::Result<()> {
        let file = self.model_file(config);
        let at = dir.to_path_buf();
        let (kind, tokenizer) = (config.training.dataset.clone(), config.training.tokenizer.clone());
        tokio::task::spawn_blocking(move || {
            let tokenizer = shoal_models::data::dataset_tokenizer(&kind, tokenizer.as_deref())?;
            shoal_models::hf::write_dir(&file, &at, tokenizer.as_ref())
        })
        .await
        .context("model writer panicked")?
        .with_context(|| format!("writing the Hugging Face directory {}", dir.display()))
    }

    /// Write this node's final model to `path` (atomically), off the async
    /// runtime's threads.
    pub async fn write_model(&self, config: &NodeConfig, path: &std::path::Path) -> anyhow::Result<()> {
        let file = self.model_file(config);
        let at = path.to_path_buf();
        tokio::task::spawn_blocking(move || file.save(&at))
            .await
            .context("model writer panicked")?
            .with_context(|| format!("writing the model to {}", path.display()))
    }
}

/// A started node.
#[derive(Debug)]
pub struct RunningNode {
    pub peer_id: PeerId,
    pub name: String,
    pub listen: Vec<Multiaddr>,
    pub net: NetworkHandle,
    pub status: StatusHandle,
    /// This node's own heartbeat fields (step, role, shards) as they change.
    pub progress: watch::Receiver<SelfState>,
    /// The shard placement this node currently follows.
    pub placement: ElectionHandle,
    pub task: JoinHandle<anyhow::Result<NodeReport>>,
    /// Where the HTTP endpoint listens (`None`: turned off).
    pub http: Option<std::net::SocketAddr>,
    /// Fault injection, live (what `/control/fault` sets).
    pub faults: Arc<crate::ops::faults::Faults>,
    leave: LeaveSwitch,
    /// Every task the node spawned but its own.
    tasks: NodeTasks,
}

impl RunningNode {
    /// Ask the node to leave cleanly: it finishes the step in hand, hands
    /// every shard it owns to its new owner, and then its task ends.
    pub fn leave(&self) {
        self.leave.leave();
    }

    /// The same switch, to keep after the node's fields are moved out.
    pub fn leave_switch(&self) -> LeaveSwitch {
        self.leave.clone()
    }
    /// Crash the node: stop its training task and every task it spawned,
    /// closing every connection and port at once, with no handoff (tests
    /// and testnets use this as a kill). Returns once all have ended.
    pub async fn kill(self) {
        self.task.abort();
        // Resolves once the node task is dropped (its guard stops the rest).
        let _ = self.task.await;
        self.tasks.shutdown().await;
    }

    /// Tasks of this node still running, its own task not counted: none
    /// once its task has ended.
    pub fn tasks_alive(&self) -> usize {
        self.tasks.len()
    }
}

/// Load an identity file (32-byte ed25519 secret), creating it if missing.
pub fn load_identity(path: Option<&std::path::Path>) -> anyhow::Result<Keypair> {
    let Some(path) = path else { return Ok(Keypair::generate_ed25519()) };
    if path.exists() {
        let mut bytes = std::fs::read(path).with_context(|| format!("reading identity {}", path.display()))?;
        if bytes.len() != 32 {
            bail!("identity {} must hold exactly 32 bytes, has {}", path.display(), bytes.len());
        }
        Keypair::ed25519_from_bytes(&mut bytes)
            .with_context(|| format!("identity {} is not an ed25519 key", path.display()))
    } else {
        let kp = shoal_protocol::libp2p::identity::ed25519::Keypair::generate();
        std::fs::write(path, kp.secret().as_ref()).with_context(|| format!("writing identity {}", path.display()))?;
        Ok(Keypair::from(kp))
    }
}

/// Dial every bootstrap peer at once, each retried with backoff until
/// `within` has passed: a peer still starting refuses the connection, and two
/// nodes dialling each other at the same moment from their listening ports
/// can meet in one TCP connection where both run the initiator's handshake,
/// which fails (`Handshake failed: input error`). Returns once one answers
/// (the others are found through it); an error naming each failure when
/// none does.
async fn dial_bootstrap(net: &NetworkHandle, peers: &[Multiaddr], within: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    let dial = |addr: Multiaddr| async move {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        loop {
            let why = match tokio::time::timeout_at(deadline, net.dial(addr.clone())).await {
                Ok(Ok(peer)) => return Ok(peer),
                Ok(Err(e)) => e.to_string(),
                Err(_) => format!("did not answer within {} ms", within.as_millis()),
            };
            let Some(delay) = backoff.next_within(deadline.saturating_duration_since(Instant::now())) else {
                return Err(format!("bootstrap peer {addr} is unreachable: {why}"));
            };
            warn!(%addr, error = %why, retry_in_ms = delay.as_millis() as u64, "bootstrap dial failed; retrying");
            // Backoff before the next attempt against a peer outside this process.
            tokio::time::sleep(delay).await;
        }
    };
    let mut dials: futures::stream::FuturesUnordered<_> = peers.iter().cloned().map(dial).collect();
    let mut failures = Vec::new();
    while let Some(result) = dials.next().await {
        match result {
            // The rest are dropped: the run's other nodes are found through this one.
            Ok(_) => {
                for f in &failures {
                    warn!("{f}; starting with a bootstrap peer that answered");
                }
                return Ok(());
            }
            Err(e) => failures.push(e),
        }
    }
    bail!("no bootstrap peer answered: {}", failures.join("; "))
}

/// Start a node: build its actors (start listening, dial the bootstrap
/// peers) and spawn the node task, which enters the run, elects, trains and
/// finishes ([`Node::drive`]). Errors in config, data or bootstrap come back
/// here; later ones end the task. However the node ends (it finishes,
/// leaves, fails, or its task is aborted) every task it spawned ends too,
/// and the node task returns only once they have: its ports are closed.
pub async fn start(mut config: NodeConfig, keypair: Keypair) -> anyhow::Result<RunningNode> {
    config.validate()?;
    // The memory this node offers for owning shards, resolved once: its
    // heartbeats gossip it and its own election reads it (they must agree).
    if config.cluster.memory_bytes == 0 {
        config.cluster.memory_bytes = crate::ops::memory::available_bytes().unwrap_or(0);
    }
    let tasks = NodeTasks::new();
    let built = build(config, keypair, &tasks).await;
    let Built { node, listen, http, leave } = match built {
        Ok(b) => b,
        Err(e) => {
            tasks.shutdown().await;
            return Err(e);
        }
    };
    let (peer_id, name, net) = (node.worker.me, node.name.clone(), node.worker.net.clone());
    let (status, faults) = (node.worker.status.clone(), node.worker.faults.clone());
    let progress = node.worker.membership.subscribe_self();
    let placement_view = node.election.clone();
    let status_for_task = status.clone();
    let owned = tasks.clone();
    // Not one of `tasks`: it waits for them.
    let task = tokio::spawn(async move {
        let _stop_on_abort = owned.stop_on_drop();
        let out = node.drive().await;
        if let Err(e) = &out {
            warn!(error = %format!("{e:#}"), "node failed");
        }
        let out = match out {
            Ok(report) => Ok(NodeReport { status: status_for_task.snapshot().await, ..report }),
            Err(e) => Err(e),
        };
        owned.shutdown().await;
        out
    });
    Ok(RunningNode {
        peer_id,
        name,
        listen,
        net,
        status,
        progress,
        placement: placement_view,
        task,
        leave,
        http,
        faults,
        tasks,
    })
}

/// A node whose actors are built and wired: what its task needs to enter
/// the run, elect, train and finish.
struct Node {
    config: NodeConfig,
    name: String,
    worker: Worker,
    /// Where the network actor sends inbound pushes, pulls and handoffs.
    routes: watch::Sender<Routes>,
    aggregator: AggregatorHandle,
    election: ElectionHandle,
    /// The election's output, until the election actor takes it (in gossip
    /// mode it stays here, unused, for the node's life).
    placement: Option<watch::Sender<Option<Arc<Placement>>>>,
    /// The parameters the trainer built from the seed.
    initial: Vec<f32>,
    model: ModelConfig,
    /// The checkpoint folder as found at start, until the run's resume
    /// point is decided.
    on_disk: Option<(OnDisk, ShardDir)>,
}

/// What [`build`] hands back: the node for its task, and what the
/// [`RunningNode`] keeps.
struct Built {
    node: Node,
    listen: Vec<Multiaddr>,
    http: Option<std::net::SocketAddr>,
    leave: LeaveSwitch,
}

/// The trainer thread, the model it holds and the shard plan cut over it.
struct Training {
    trainer: TrainerHandle,
    initial: Vec<f32>,
    model: ModelConfig,
    plan: ShardPlan,
    train_len: usize,
}

/// The network actor and the channels the other actors share with it.
struct Network {
    net: NetworkHandle,
    /// The `[network]` table under this run's id.
    proto: ProtocolConfig,
    faults: Arc<crate::ops::faults::Faults>,
    /// Validated heartbeats and closed connections, for membership.
    heard: mpsc::Receiver<Heard>,
    routes: watch::Sender<Routes>,
    snapshot: watch::Sender<ModelSnapshot>,
}

/// Who this node is in the run: its peer id, and when this start of it
/// began (a restart with the same identity is a new incarnation).
struct Identity {
    run: RunId,
    me: PeerId,
    incarnation: u64,
}

/// The first phase, build the actors: the trainer thread, the network
/// (listening, and connected to a bootstrap peer), status, the checkpoint
/// writer, membership (gossiping the hash of what this node agrees to), the
/// aggregator and the HTTP endpoint, wired through one [`Worker`].
async fn build(config: NodeConfig, keypair: Keypair, tasks: &NodeTasks) -> anyhow::Result<Built> {
    let run = RunId::new(config.run_id.clone()).map_err(|e| anyhow::anyhow!("run_id: {e}"))?;
    let c = &config.cluster;
    let me = keypair.public().to_peer_id();
    let name = config.name.clone().unwrap_or_else(|| short(&me));
    let training = open_trainer(&config, &name).await?;
    let agreed = RunAgreement::of(&config, &training.model).hash()?;
    let Network { net, proto, faults, heard, routes, snapshot } =
        spawn_network(&config, &run, &training, keypair, tasks)?;
    let status = status::spawn(name.clone(), me.to_string(), config.training.steps, c.channel_capacity, tasks);
    let disk = open_checkpoints(&config, &training.model, training.plan.len() as u32, &status, &name).await?;
    let incarnation =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
    let id = Identity { run, me, incarnation };
    let membership = spawn_membership(&config, &id, agreed, disk.as_ref(), &net, heard, tasks);
    let listen = connect(c, &proto, &net).await?;
    let (placement, election) = ElectionHandle::channel();
    let aggregator = aggregator::spawn(
        aggregator_config(&config, &id, &training.plan, &proto, disk.as_ref()),
        status.clone(),
        net.clone(),
        aggregator::Inputs {
            placement: election.subscribe(),
            snapshot: snapshot.subscribe(),
            heard: shard_news(&membership, training.plan.len(), tasks),
        },
        tasks,
    );
    gossip_suspects(&aggregator, &membership, tasks);
    info!(peer = %me, %name, ?listen, "node started");

    let (leave_tx, leave_rx) = watch::channel(false);
    let Training { trainer, initial, model, plan, train_len } = training;
    let worker = Worker {
        me,
        incarnation,
        config: config.clone(),
        run: id.run,
        net: net.clone(),
        aggregator: aggregator.clone(),
        trainer,
        status: status.clone(),
        plan,
        train_len,
        snapshot,
        membership: membership.clone(),
        placement: election.subscribe(),
        service: Arc::new(std::sync::Mutex::new(ServiceTracker::default())),
        leave: leave_rx,
        faults: faults.clone(),
        link: Default::default(),
        tasks: tasks.clone(),
    };
    let leave = LeaveSwitch::new(leave_tx);
    let http = serve_http(&config, &worker, &leave, &listen).await?;
    let on_disk = disk.map(|d| (d.found, d.dir));
    let placement = Some(placement);
    let node = Node { config, name, worker, routes, aggregator, election, placement, initial, model, on_disk };
    Ok(Built { node, listen, http, leave })
}

/// Open the data set, start the trainer thread on the run's model (built
/// from the seed), and cut that model into the run's shards.
async fn open_trainer(config: &NodeConfig, name: &str) -> anyhow::Result<Training> {
    let t = &config.training;
    let device = t.device.open()?;
    let data = {
        let (kind, dir, tokenizer) = (t.dataset.clone(), t.data_dir.clone(), t.tokenizer.clone());
        tokio::task::spawn_blocking(move || {
            let tokenizer = data::dataset_tokenizer(&kind, tokenizer.as_deref())?;
            data::open_with(&kind, dir.as_deref(), tokenizer.as_ref())
        })
        .await
        .context("data loader panicked")?
        .with_context(|| format!("loading data set {}", t.dataset))?
    };
    let model = config.model_config(&data.test);
    let train_len = data.train_len;
    let mut net = Model::new(model.clone(), t.seed, &device)?;
    net.set_precision(t.dtype);
    let (trainer, _thread, initial) =
        trainer::spawn(net, data, config.cluster.channel_capacity, crate::ops::threads::resolve(t.threads, 1), name)?;
    let plan = ShardPlan::new(initial.len(), config.cluster.shards as usize)?;
    check_shard_fits(&plan, &t.optimizer_config(), &config.network.limits)?;
    Ok(Training { trainer, initial, model, plan, train_len })
}

/// Build the swarm and spawn the network actor that polls it; warn when
/// faults are injected or the node accepts any peer.
fn spawn_network(
    config: &NodeConfig,
    run: &RunId,
    training: &Training,
    keypair: Keypair,
    tasks: &NodeTasks,
) -> anyhow::Result<Network> {
    let c = &config.cluster;
    let plan = &training.plan;
    let mut proto = config.network.clone();
    proto.run_id = run.clone();
    let signer = GossipSigner::new(&keypair)?;
    let swarm = build_swarm_with(&proto, keypair, tasks.clone())?;
    let ctx = ValidationContext::new(run.clone(), plan.len() as u32, proto.limits.clone(), &proto.timeouts)
        .with_shard_numel(plan.shards().iter().map(|s| s.len() as u64).collect());
    let faults = Arc::new(config.faults.faults().map_err(|e| anyhow::anyhow!("faults.{e}"))?);
    let (heard_tx, heard) = mpsc::channel(c.channel_capacity);
    let (routes, routes_rx) = watch::channel(Routes { aggregator: None, epoch: 0 });
    let (snapshot, snap_rx) = watch::channel(ModelSnapshot { version: 0, params: Arc::new(training.initial.clone()) });
    let net = net::spawn(
        swarm,
        NetworkParts {
            config: proto.clone(),
            ctx,
            shard_ranges: plan.shards().iter().map(|s| s.range()).collect(),
            heard: heard_tx,
            routes: routes_rx,
            snapshot: snap_rx,
            capacity: c.channel_capacity,
            optimizer: config.owner_optimizer(),
            faults: faults.clone(),
            signer,
        },
        tasks,
    );
    let f = &config.faults;
    if f.delay_ms > 0 || f.slowdown > 1.0 || f.serve_mbps > 0.0 {
        warn!(serve_delay_ms = f.delay_ms, slowdown = f.slowdown, serve_mbps = f.serve_mbps, "fault injection is on");
    }
    if let Some(why) = proto.mdns_held_off() {
        info!("{why}");
    }
    let open = proto.open_listeners();
    if !open.is_empty() {
        warn!(
            listen = ?open,
            "this node accepts any peer: it listens beyond loopback with neither network.admission.psk nor \
             network.admission.allowlist (docs/operations.md#admission-control says how to close it)"
        );
    }
    Ok(Network { net, proto, faults, heard, routes, snapshot })
}

/// Spawn the membership actor: it gossips this node's heartbeat (with the
/// hash of what it agrees to, its capabilities and checkpoint offers) and
/// keeps the view of its peers.
fn spawn_membership(
    config: &NodeConfig,
    id: &Identity,
    agreed: u64,
    disk: Option<&Disk>,
    net: &NetworkHandle,
    heard: mpsc::Receiver<Heard>,
    tasks: &NodeTasks,
) -> MembershipHandle {
    let c = &config.cluster;
    let membership = membership::spawn(
        MembershipConfig {
            run: id.run.clone(),
            me: id.me,
            incarnation: id.incarnation,
            config_hash: agreed,
            capabilities: Capabilities {
                device: device_class(config.training.device),
                // At start; the rates are the worker's measurements
                // (SelfState), filled in as it trains.
                memory_bytes: c.memory_bytes,
                compute_samples_per_sec: 0.0,
                net_bytes_per_sec: 0.0,
                can_aggregate: c.can_aggregate,
            },
            min_peers: c.min_peers,
            heartbeat: Duration::from_millis(c.heartbeat_ms),
            failure_timeout: Duration::from_millis(c.failure_timeout_ms),
            checkpoints: disk.map(|d| d.offers.clone()).unwrap_or_default(),
        },
        net.clone(),
        heard,
        tasks,
    );
    // Gossip the configured number of aggregators from the first heartbeat on.
    let initial_aggregators = match config.roles.aggregators {
        Aggregators::Auto => config.roles.start_aggregators,
        Aggregators::All => 0,
        Aggregators::Fixed(k) => k,
    };
    membership.set_self(|s| s.pace.aggregators = initial_aggregators);
    membership
}

/// Wait for the first listen address (none without listeners), then dial
/// the bootstrap peers and bootstrap Kademlia through them.
async fn connect(c: &ClusterConfig, proto: &ProtocolConfig, net: &NetworkHandle) -> anyhow::Result<Vec<Multiaddr>> {
    let listen = if proto.listen.is_empty() {
        Vec::new()
    } else {
        tokio::time::timeout(Duration::from_millis(c.dial_timeout_ms), net.listen_addrs())
            .await
            .context("no listen address came up")??
    };
    if !c.bootstrap.is_empty() {
        dial_bootstrap(net, &c.bootstrap, Duration::from_millis(c.dial_timeout_ms)).await?;
        net.kad_bootstrap().await?;
    }
    Ok(listen)
}

/// How this node's aggregator serves the shards it comes to own.
fn aggregator_config(
    config: &NodeConfig,
    id: &Identity,
    plan: &ShardPlan,
    proto: &ProtocolConfig,
    disk: Option<&Disk>,
) -> AggregatorConfig {
    let (c, r) = (&config.cluster, &config.roles);
    AggregatorConfig {
        me: id.me,
        incarnation: id.incarnation,
        run: id.run.clone(),
        policy: config.owner_policy(),
        optimizer: config.owner_optimizer(),
        schedule: config.owner_schedule(),
        robust: crate::policy::robust::Robust {
            aggregation: config.aggregation.rule,
            norm_check: config.norm_check_factor(),
            norm_floor: config.aggregation.norm_floor,
            min_agreement: config.aggregation.min_agreement,
        },
        ranges: plan.shards().iter().map(|s| s.range()).collect(),
        max_wait: proto.timeouts.response_wait(),
        replica_every: if r.replicas >= 2 { r.replica_every } else { 0 },
        handoff_timeout: Duration::from_millis(r.handoff_timeout_ms),
        transfer_retry: Duration::from_millis(c.heartbeat_ms),
        round_timeout_ms: config.sync.round_timeout_ms,
        backup_workers: config.sync.backup_workers as usize,
        delta: config.delta_pulls(),
        capacity: c.channel_capacity,
        checkpoint: disk.map(|d| d.policy.clone()),
    }
}

/// The owner's suspects, and the shards whose transfer it keeps or sends,
/// go into this node's heartbeat. The tasks end with the aggregator.
fn gossip_suspects(aggregator: &AggregatorHandle, membership: &MembershipHandle, tasks: &NodeTasks) {
    let mut suspects = aggregator.suspects();
    let gossiped = membership.clone();
    tasks.spawn(async move {
        while suspects.changed().await.is_ok() {
            let now = suspects.borrow_and_update().clone();
            gossiped.set_self(|s| s.suspects = now);
        }
    });
    let mut handing = aggregator.handing();
    let gossiped = membership.clone();
    tasks.spawn(async move {
        while handing.changed().await.is_ok() {
            let now = handing.borrow_and_update().clone();
            gossiped.set_self(|s| {
                s.handing = now;
                s.announce += 1;
            });
        }
    });
}

/// What the heartbeats say of each shard, for the aggregator
/// ([`crate::policy::view::ShardNews`]): the newest version a live worker
/// holds (this node's own or a peer's), which a restored owner takes up
/// ([`crate::policy::sync::ShardCore::take_up`]), and the peers that say
/// they own or hand over each shard, whose transfer a new owner waits for.
/// The newest versions are recomputed when the view changes (at least once a
/// heartbeat period) and as the own worker's versions change: a restored
/// owner takes up its own worker's newest version at once. (The schedule
/// explorer lets a node read its own versions at any later point, which
/// covers this.) The claimants come from the view alone: recomputed only
/// when it changes, not at each shard exchange.
fn shard_news(membership: &MembershipHandle, shards: usize, tasks: &NodeTasks) -> watch::Receiver<ShardNews> {
    let (tx, rx) = watch::channel(ShardNews { newest: vec![0; shards], claimants: vec![Vec::new(); shards] });
    let (mut view, mut me) = (membership.subscribe(), membership.subscribe_self());
    tasks.spawn(async move {
        loop {
            let view_changed = tokio::select! {
                r = view.changed() => if r.is_err() { break } else { true },
                r = me.changed() => if r.is_err() { break } else { false },
                () = tx.closed() => break,
            };
            let snap = view.borrow_and_update();
            let newest = snap.view.newest_shard_versions(&me.borrow_and_update().shard_versions, shards);
            let claimants = view_changed.then(|| snap.view.shard_claimants(shards));
            drop(snap);
            tx.send_if_modified(|v| {
                let mut changed = std::mem::replace(&mut v.newest, newest) != v.newest;
                if let Some(c) = claimants {
                    changed |= std::mem::replace(&mut v.claimants, c) != v.claimants;
                }
                changed
            });
        }
    });
    rx
}

/// Serve the HTTP endpoint, unless `http.listen` turns it off.
async fn serve_http(
    config: &NodeConfig,
    worker: &Worker,
    leave: &LeaveSwitch,
    listen: &[Multiaddr],
) -> anyhow::Result<Option<std::net::SocketAddr>> {
    let Some(addr) = config.http.addr()? else { return Ok(None) };
    let state = crate::ops::http::HttpState {
        status: worker.status.clone(),
        membership: worker.membership.clone(),
        net: worker.net.clone(),
        faults: worker.faults.clone(),
        leave: leave.clone(),
        listen: listen.to_vec(),
        control: config.http.control,
        failure_timeout_ms: config.cluster.failure_timeout_ms,
        tasks: worker.tasks.clone(),
    };
    Ok(Some(crate::ops::http::serve(addr, state).await?))
}

/// Where this node enters the run, as the second phase decides it.
struct Entry {
    /// The roster training started with (a joiner: the run's nodes and it).
    roster: Roster,
    routing: Routing,
    /// The parameters to start from: the seed's, or a joiner's fetched ones.
    params: Vec<f32>,
    /// Where the run resumes from checkpoints (`None`: a fresh start, or a join).
    resumed: Option<ResumePoint>,
}

impl Node {
    /// The node task, after the actors are built: enter the run, elect,
    /// train, finish.
    async fn drive(mut self) -> anyhow::Result<NodeReport> {
        let Entry { roster, routing, params, resumed } = self.enter().await?;
        self.elect(&roster).await?;
        let ran = self.train(routing, params, resumed.as_ref()).await?;
        self.finish(&roster, ran).await
    }

    /// Enter the run: wait until the roster is agreed, then start with it
    /// (resuming from the members' checkpoints when they hold some), or,
    /// when the run started without this node, join it mid-run.
    async fn enter(&mut self) -> anyhow::Result<Entry> {
        let c = &self.config.cluster;
        let start_timeout = Duration::from_millis(c.start_timeout_ms);
        let begin = wait_for_start(
            &self.worker.membership,
            c.min_peers,
            start_timeout,
            &self.config.run_id,
            c.failure_timeout_ms,
            Duration::from_millis(c.heartbeat_ms),
            // Gossip mode has no owners: a joiner has none to wait for
            // (it once waited a whole failure timeout for them, and a
            // short run finished meanwhile).
            if c.mode == crate::config::Mode::Gossip { 0 } else { c.shards },
        )
        .await?;
        match begin {
            Start::Roster(roster) => self.start_with(roster).await,
            Start::Join(jp) => {
                let deadline = Instant::now() + start_timeout;
                let (roster, routing, params) =
                    join_run(&self.config, &self.worker, &self.routes, &self.aggregator, jp, &self.name, deadline)
                        .await?;
                Ok(Entry { roster, routing, params, resumed: None })
            }
        }
    }

    /// The roster is agreed: freeze it as the run's epoch, serve the
    /// shards' traffic from now on, and decide whether the run resumes.
    async fn start_with(&mut self, roster: Roster) -> anyhow::Result<Entry> {
        let epoch = roster.hash();
        self.worker.membership.set_self(|s| {
            s.frozen_epoch = Some(epoch);
            s.role = Role::Worker;
            s.announce += 1;
        });
        self.routes.send_replace(Routes { aggregator: Some(self.aggregator.clone()), epoch });
        let rank = roster.rank_of(&self.worker.me).context("this node is not in its own roster")?;
        let routing = Routing {
            roster: roster.clone(),
            partition: Some((rank, roster.members.len())),
            start_step: 0,
            versions: vec![0; self.worker.plan.len()],
        };
        info!(name = %self.name, epoch, members = roster.members.len(), "roster agreed; training starts");
        // Every member decides, with a checkpoint folder or not: the
        // members' offers alone fix the resume point. What was read from
        // the folder is handed over (or dropped) here, not kept all run.
        let resumed = resume_from(&self.config, &self.worker, &self.aggregator, &roster, self.on_disk.take()).await?;
        Ok(Entry { roster, routing, params: std::mem::take(&mut self.initial), resumed })
    }

    /// Elect: in pull mode, start the election actor and wait for its first
    /// placement (who owns which shard); gossip mode has no owners.
    async fn elect(&mut self, roster: &Roster) -> anyhow::Result<()> {
        let (c, r, worker) = (&self.config.cluster, &self.config.roles, &self.worker);
        if c.mode == Mode::Pull {
            if !roster.members.iter().any(|m| m.1) {
                bail!("no node in the roster may aggregate (set cluster.can_aggregate = true on at least one)");
            }
            let placement = self.placement.take().context("the election was started twice")?;
            let health = r.health_policy(worker.plan.total_len(), worker.plan.len());
            election::start(
                placement,
                ElectionConfig {
                    shards: worker.plan.len() as u32,
                    policy: ElectPolicy {
                        health,
                        owner_shard_bytes: owner_shard_bytes(
                            worker.plan.shards().iter().map(|s| s.len() as u64).max().unwrap_or(0),
                            self.config.training.optimizer_config().slot_names().len() as u64,
                        ),
                    },
                    explore: (r.elastic && r.aggregators == Aggregators::Auto).then(|| {
                        let policy = ExplorePolicy {
                            window_steps: r.explore_window_steps,
                            idle_share: r.explore_idle_share,
                            ..ExplorePolicy::default()
                        };
                        (policy, (r.start_aggregators > 0).then_some(r.start_aggregators as usize))
                    }),
                    own: Own {
                        can_aggregate: c.can_aggregate,
                        memory_bytes: c.memory_bytes,
                        device: device_class(self.config.training.device),
                    },
                    total_steps: self.config.training.steps,
                    failure_timeout_ms: c.failure_timeout_ms,
                    name: self.name.clone(),
                },
                worker.membership.clone(),
                worker.status.clone(),
                &worker.tasks,
            );
            let mut rx = self.election.subscribe();
            tokio::time::timeout(Duration::from_millis(c.start_timeout_ms), rx.wait_for(Option::is_some))
                .await
                .context("no shard placement could be computed")?
                .map_err(|_| anyhow::anyhow!("the election stopped"))?;
        } else {
            worker.status.record(StatusEvent::Role { role: RoleView::Worker, owned: Vec::new() });
        }
        worker.status.record(StatusEvent::Peers(roster.members.len()));
        Ok(())
    }

    /// Train: a resumed run first takes its model from the shards' owners;
    /// then the step loop runs to the last step, or until the node leaves.
    async fn train(
        &self,
        mut routing: Routing,
        params: Vec<f32>,
        resumed: Option<&ResumePoint>,
    ) -> anyhow::Result<Ran> {
        let params = match resumed {
            Some(rp) => self.fetch_resumed(rp, &mut routing).await?,
            None => params,
        };
        self.worker.run(&routing, params).await
    }

    /// Fetch the model at the resume point from the elected owners, and
    /// start from its step.
    async fn fetch_resumed(&self, rp: &ResumePoint, routing: &mut Routing) -> anyhow::Result<Vec<f32>> {
        let worker = &self.worker;
        let within = Duration::from_millis(self.config.cluster.start_timeout_ms);
        let (fetched, versions) =
            worker.fetch_model(&rp.versions, within).await.context("resuming: fetching the model")?;
        // The first resumed step computes on the resumed model, and
        // peers (StateSync) and owners (a shard taken over from the
        // worker copy) see it from now on.
        let shared = Arc::new(fetched.clone());
        worker.trainer.set_params(shared.clone()).await?;
        worker.snapshot.send_replace(ModelSnapshot { version: rp.step, params: shared });
        self.aggregator.resume_done().await?;
        routing.start_step = rp.step;
        routing.versions = versions;
        worker.status.record(StatusEvent::Resumed { step: rp.step });
        worker.membership.set_self(|s| {
            s.step = rp.step;
            s.announce += 1;
        });
        info!(name = %self.name, step = rp.step, "resumed from checkpoints");
        Ok(fetched)
    }

    /// Finish: checkpoint what this node owns, leave cleanly or announce
    /// the last step, evaluate and write the model, then linger while the
    /// peers may still need this node, and report.
    async fn finish(&self, roster: &Roster, ran: Ran) -> anyhow::Result<NodeReport> {
        let (config, worker, name, me) = (&self.config, &self.worker, self.name.as_str(), self.worker.me);
        // The final state of every shard this node still owns goes to disk.
        self.aggregator.flush_checkpoints().await;
        // The shards this node owns when its training ends, taken before it
        // announces its last step: no peer stops lingering before that, so
        // every peer is still in the view. Taken later, a peer that had
        // stopped in the meantime is gone from the view, this node's
        // placement moves its shards, and nodes report placements computed
        // from different views (two owners of one shard).
        let owned_ids = if ran.left {
            leave_run(config, worker, &self.aggregator, &self.election, ran.steps, name).await;
            self.election.current().map(|p| p.owned_by(&me)).unwrap_or_default()
        } else {
            let owned = self.election.current().map(|p| p.owned_by(&me)).unwrap_or_default();
            worker.membership.set_self(|s| {
                s.step = ran.steps;
                s.announce += 1;
            });
            owned
        };
        let eval = worker.trainer.evaluate().await?;
        worker.status.record(StatusEvent::Evaluated(eval));
        worker.status.record(StatusEvent::Role { role: RoleView::Done, owned: owned_ids.clone() });
        let report = NodeReport {
            peer_id: me,
            name: name.to_string(),
            accuracy: eval.accuracy,
            loss: eval.loss,
            bits_per_byte: eval.bits_per_byte,
            steps: ran.steps,
            left: ran.left,
            params: ran.params,
            owned_shards: owned_ids,
            shard_stats: Vec::new(),
            roster: roster.peers(),
            status: None,
            suspected_by: BTreeMap::new(),
            peer_capabilities: BTreeMap::new(),
            model: self.model.clone(),
            peers_finished: false,
        };
        // Written before lingering: a node stopped while it waits for its peers
        // keeps its model.
        if let Some(path) = &config.output {
            // A failed write must not stop the node before it serves its peers
            // and hands its shards over; it is reported loudly instead.
            match report.write_model(config, path).await {
                Ok(()) => info!(%name, path = %path.display(), "model written"),
                Err(e) => warn!(%name, error = %format!("{e:#}"), "the trained model was NOT written"),
            }
        }
        if let Some(dir) = &config.output_hf {
            match report.write_hf(config, dir).await {
                Ok(()) => info!(%name, dir = %dir.display(), "Hugging Face model written"),
                Err(e) => warn!(%name, error = %format!("{e:#}"), "the Hugging Face model was NOT written"),
            }
        }
        if ran.left {
            info!(%name, accuracy = eval.accuracy, loss = eval.loss, bits_per_byte = eval.bits_per_byte, step = ran.steps, "left the run");
        } else {
            info!(%name, accuracy = eval.accuracy, loss = eval.loss, bits_per_byte = eval.bits_per_byte, "training finished; serving until peers finish");
            // Keep serving: the peers may still need the shards this node owns.
            let c = &config.cluster;
            let limit = Duration::from_millis(c.linger_ms);
            if !worker.membership.wait_until_peers_reach(me, ran.steps, c.failure_timeout_ms, limit).await {
                warn!("stopped lingering: not every peer reported completion in time");
            }
        }
        // Every push has arrived and no peer has stopped yet: what the
        // report says of the shards and the view is read now.
        let mine = self.aggregator.suspects().borrow().clone();
        let view = worker.membership.snapshot().view;
        let report = NodeReport {
            shard_stats: self.aggregator.stats().await,
            suspected_by: view.suspected_by(&mine),
            peer_capabilities: view.peers.iter().map(|(id, p)| (*id, p.heartbeat.capabilities.clone())).collect(),
            ..report
        };
        let peers_finished = !ran.left && self.say_finished().await;
        Ok(NodeReport { peers_finished, ..report })
    }

    /// The second half of lingering (docs/protocol.md, §6.3): say
    /// `finished` and serve until every live peer says it too. A peer says
    /// it once it has seen this node's last step, so this node does not
    /// stop while its last heartbeat may still be on its way.
    /// Returns whether every peer did (rather than the failure timeout
    /// passing).
    async fn say_finished(&self) -> bool {
        let (config, worker) = (&self.config, &self.worker);
        worker.membership.set_self(|s| {
            s.finished = true;
            s.announce += 1;
        });
        let timeout = config.cluster.failure_timeout_ms;
        let limit = Duration::from_millis(timeout);
        let all = worker.membership.wait_until_peers_finish(worker.me, timeout, limit).await;
        if !all {
            debug!(node = %self.name, "stopped: not every peer said it had finished within the failure timeout");
        }
        all
    }
}

/// A handoff carries a shard with its optimizer state as f32: it must fit
/// in one request. A large model needs enough shards (say so before
/// training starts rather than failing at the first handoff).
fn check_shard_fits(
    plan: &ShardPlan,
    opt: &shoal_models::OptimizerConfig,
    limits: &shoal_protocol::config::Limits,
) -> anyhow::Result<()> {
    let largest = plan.shards().iter().map(|s| s.len() as u64).max().unwrap_or(0);
    let copies = 1 + opt.slot_names().len() as u64;
    let bytes = largest * 4 * copies;
    let message = limits.max_request_bytes.min(limits.max_response_bytes);
    // Headers and framing: a margin of 1 MiB.
    let room = message.saturating_sub(1 << 20);
    if bytes > room {
        let total = plan.total_len() as u64;
        bail!(
            "cluster.shards = {}: a shard of {largest} parameters with its optimizer state is {bytes} bytes, over the {message} bytes a message may carry (network.limits); use at least {} shards for this {total}-parameter model",
            plan.len(),
            total.div_ceil((room / (4 * copies)).max(1))
        );
    }
    Ok(())
}

/// How this node enters the run.
enum Start {
    /// It is a member of the roster the run starts with.
    Roster(Roster),
    /// The run started without it: join mid-run.
    Join(JoinPoint),
}

/// Join a run that has started: fetch the model from several peers, then
/// announce this node ready under the run's epoch. Returns the roster (the
/// run's nodes plus this one), where to start, and the fetched parameters.
async fn join_run(
    config: &NodeConfig,
    worker: &Worker,
    routes: &watch::Sender<Routes>,
    aggregator: &AggregatorHandle,
    jp: JoinPoint,
    name: &str,
    deadline: Instant,
) -> anyhow::Result<(Roster, Routing, Vec<f32>)> {
    let steps = config.training.steps;
    if jp.step >= steps {
        bail!("run `{}` has already finished (its nodes reached step {}); nothing to join", config.run_id, jp.step);
    }
    worker.status.record(StatusEvent::Role { role: RoleView::Joining, owned: Vec::new() });
    info!(%name, step = jp.step, donors = jp.donors.len(), "the run has started: joining it");
    let fetched = fetch_model(&worker.net, &worker.run, &worker.plan, &jp.donors, deadline)
        .await
        .context("joining mid-run: fetching the current model")?;
    let version = fetched.versions.iter().copied().min().unwrap_or(0);
    // BSP pull: versions count rounds, one per step, so the step the run
    // is at now follows from them (elsewhere they count pushes or outer
    // rounds: the join point's step).
    let start = if config.lockstep() { start_step(&jp, &fetched.versions) } else { jp.step };
    if start >= steps {
        bail!(
            "run `{}` finished while this node fetched its model (it is at step {start}); nothing to join",
            config.run_id
        );
    }
    let params = Arc::new(fetched.params.clone());
    worker.trainer.set_params(params.clone()).await?;
    worker.snapshot.send_replace(ModelSnapshot { version, params });
    routes.send_replace(Routes { aggregator: Some(aggregator.clone()), epoch: jp.epoch });
    let donors = donor_count(&fetched.served_by);
    worker.status.record(StatusEvent::Joined { step: start, donors });
    worker.status.record(StatusEvent::Version(version));
    // Taking the run's epoch as ours is what tells every peer we are ready.
    worker.membership.set_self(|s| {
        s.frozen_epoch = Some(jp.epoch);
        s.role = Role::Worker;
        s.step = start;
        s.model_version = version;
        s.announce += 1;
    });
    info!(%name, step = start, version, donors, shards = worker.plan.len(), "model fetched; contributing from now on");
    let routing = Routing { roster: jp.roster.clone(), partition: None, start_step: start, versions: fetched.versions };
    Ok((jp.roster, routing, fetched.params))
}

/// Leave cleanly: announce `Leaving` (owners stop waiting for this node and
/// every election, this node's included, moves its shards away), then wait
/// until every shard it owned has been handed over and acknowledged.
async fn leave_run(
    config: &NodeConfig,
    worker: &Worker,
    aggregator: &AggregatorHandle,
    election: &ElectionHandle,
    step: u64,
    name: &str,
) {
    let owned = election.current().map(|p| p.owned_by(&worker.me)).unwrap_or_default();
    info!(%name, step, owned = ?owned, "leaving cleanly: handing off shards");
    worker.status.record(StatusEvent::Role { role: RoleView::Leaving, owned });
    worker.membership.set_self(|s| {
        s.leaving = true;
        s.step = step;
        s.announce += 1;
    });
    // A transfer is retried within handoff_timeout; allow the election a
    // few heartbeats on top to move the shards in the first place.
    let limit = Duration::from_millis(config.roles.handoff_timeout_ms * 2 + config.cluster.heartbeat_ms * 4);
    let mut held = aggregator.held();
    let drained = matches!(tokio::time::timeout(limit, held.wait_for(|h| h.is_empty())).await, Ok(Ok(_)));
    match drained {
        true => info!(%name, "every shard handed off"),
        false => {
            let h = *held.borrow();
            warn!(%name, shards = h.shards, transfers = h.transfers, kept = h.kept,
                  "left before every shard was handed off (no other node may own them, or transfers failed)");
        }
    }
    worker.status.record(StatusEvent::Left { step });
}

/// Wait (on view changes, not a timer) until the roster is agreed, or
/// until it is clear that the run started without this node. A joiner
/// first waits (at most a failure timeout) until owners of all
/// `owned_shards` are heard; 0 when the run has no owners.
async fn wait_for_start(
    membership: &MembershipHandle,
    min_peers: usize,
    timeout: Duration,
    run: &str,
    failure_timeout_ms: u64,
    heartbeat: Duration,
    owned_shards: u32,
) -> anyhow::Result<Start> {
    let mut rx = membership.subscribe();
    let deadline = Instant::now() + timeout;
    loop {
        let snap = rx.borrow_and_update().clone();
        // Joining first: a member restarted with its old identity proposes
        // the run's own roster and would otherwise see it "agreed".
        if join_point(&snap.view, snap.now_ms, failure_timeout_ms).is_some() {
            // The run started without us. Every peer heartbeats once per
            // period: gather heartbeats for two periods so that the whole
            // run, not the first peer heard, is known and donates.
            let gather = Instant::now() + heartbeat * 2;
            while tokio::time::timeout_at(gather, rx.changed()).await.is_ok_and(|r| r.is_ok()) {}
            // Bootstrapped from one peer, we hear the others only once
            // gossip meshes us in (its heartbeat, a second by default): keep
            // listening, at most a failure timeout, until the owners heard
            // cover every shard, so that the whole run donates.
            let cover_by = Instant::now() + Duration::from_millis(failure_timeout_ms);
            let jp = loop {
                let snap = rx.borrow_and_update().clone();
                let jp = join_point(&snap.view, snap.now_ms, failure_timeout_ms);
                let covered = jp.as_ref().is_some_and(|jp| {
                    owners_cover(&snap.view, snap.now_ms, failure_timeout_ms, jp.epoch, owned_shards)
                });
                // Past `cover_by` (or with membership gone) nothing changed
                // since this snapshot: its join point is the current one.
                if covered || !tokio::time::timeout_at(cover_by, rx.changed()).await.is_ok_and(|r| r.is_ok()) {
                    break jp;
                }
            };
            if let Some(jp) = jp {
                return Ok(Start::Join(jp));
            }
            continue;
        }
        if let RosterStatus::Agreed(r) = snap.roster {
            return Ok(Start::Roster(r));
        }
        match tokio::time::timeout_at(deadline, rx.changed()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => bail!("membership stopped before the roster formed"),
            Err(_) => {
                let mismatched: Vec<String> = snap.view.mismatched.keys().map(short).collect();
                let live = snap.view.peers.len() + 1;
                let mut msg = format!(
                    "no agreed roster of {min_peers} nodes for run `{run}` within {} ms: {live} node(s) with our config seen",
                    timeout.as_millis()
                );
                if !mismatched.is_empty() {
                    msg.push_str(&format!(
                        "; {} peer(s) run a different model/training config and were ignored: {}",
                        mismatched.len(),
                        mismatched.join(", ")
                    ));
                }
                let other: Vec<String> =
                    snap.view.other_version.iter().map(|(p, v)| format!("{} (version {v})", short(p))).collect();
                if !other.is_empty() {
                    msg.push_str(&format!(
                        "; {} peer(s) speak another wire version than this node's {} and were ignored: {}",
                        other.len(),
                        shoal_protocol::WIRE_VERSION,
                        other.join(", ")
                    ));
                }
                bail!(msg);
            }
        }
    }
}

/// Every readable checkpoint in a node's folder, per shard, newest first.
type OnDisk = BTreeMap<u32, Vec<ShardCheckpoint>>;

/// A node's checkpoint folder as found at start, and how it writes more.
struct Disk {
    /// What it holds, gossiped for the resume point.
    offers: Vec<shoal_protocol::CheckpointOffer>,
    /// Every readable checkpoint per shard, newest first.
    found: OnDisk,
    dir: ShardDir,
    policy: CheckpointPolicy,
}

/// Read the checkpoint folder (unreadable files are named in a warning and
/// skipped; older ones of the same shard still count) and start the writer.
/// `None` when checkpoints are off.
async fn open_checkpoints(
    config: &NodeConfig,
    model: &ModelConfig,
    shards: u32,
    status: &StatusHandle,
    name: &str,
) -> anyhow::Result<Option<Disk>> {
    let k = &config.checkpoint;
    let Some(dir) = k.dir.clone() else { return Ok(None) };
    let of = ShardOf { run_id: config.run_id.clone(), model: model.clone(), shards };
    let shard_dir = ShardDir::new(dir.clone(), of, k.keep);
    let scanning = shard_dir.clone();
    let scan = tokio::task::spawn_blocking(move || scanning.scan())
        .await
        .context("checkpoint scan panicked")?
        .with_context(|| format!("reading the checkpoint folder {}", dir.display()))?;
    for skipped in &scan.skipped {
        warn!(%name, "skipping an unusable checkpoint: {skipped}");
    }
    let held: Vec<(u32, u64, u64)> = scan.shards.values().flatten().map(|c| (c.shard, c.version, c.step)).collect();
    if !held.is_empty() {
        info!(%name, dir = %dir.display(), files = held.len(), "found shard checkpoints");
    }
    let writer = crate::actors::checkpoint::spawn(shard_dir.clone(), 2 * shards as usize + 4, status.clone(), name)?;
    Ok(Some(Disk {
        offers: offers_of(&held, shoal_protocol::MAX_CHECKPOINT_OFFERS),
        found: scan.shards,
        dir: shard_dir,
        policy: CheckpointPolicy {
            writer,
            every_steps: k.every_steps,
            every: (k.every_secs > 0).then(|| Duration::from_secs(k.every_secs)),
        },
    }))
}

/// The roster is agreed: from every member's checkpoint offers, decide
/// where the run resumes (the same on every member), hand this node's
/// checkpoints at those versions to its aggregator, and set the worker
/// copy's version so that owners wait for checkpointed shards rather than
/// start them afresh. `None`: no member holds a checkpoint, a fresh start.
async fn resume_from(
    config: &NodeConfig,
    worker: &Worker,
    aggregator: &AggregatorHandle,
    roster: &Roster,
    on_disk: Option<(OnDisk, ShardDir)>,
) -> anyhow::Result<Option<ResumePoint>> {
    if config.cluster.mode != Mode::Pull {
        return Ok(None);
    }
    let snap = worker.membership.snapshot();
    let mine = worker.membership.subscribe_self().borrow().checkpoints.clone();
    let mut offers = mine;
    for peer in roster.peers().iter().filter(|p| **p != worker.me) {
        match snap.view.peers.get(peer) {
            Some(p) => offers.extend(p.heartbeat.checkpoints.iter().cloned()),
            None => warn!(%peer, "a roster member left the view before its checkpoint offers were read"),
        }
    }
    let shards = worker.plan.len() as u32;
    let Some(rp) = resume_point(&offers, shards, config.sync.policy == SyncPolicy::Bsp)? else { return Ok(None) };
    if rp.step >= config.training.steps {
        bail!(
            "the checkpoints are at step {}, and training.steps is {}: this run is finished \
             (raise training.steps to train on, or start a new run)",
            rp.step,
            config.training.steps
        );
    }
    let (found, dir) = on_disk.unzip();
    let states: Vec<ShardState> = found
        .unwrap_or_default()
        .into_iter()
        .filter_map(|(shard, list)| {
            let want = *rp.versions.get(shard as usize)?;
            let c = list.into_iter().find(|c| c.version == want)?;
            Some(ShardState { shard, version: c.version, params: c.params, optimizer: c.optimizer, catch_up_room: 0 })
        })
        .collect();
    info!(step = rp.step, versions = ?rp.versions, mine = states.len(), "resuming the run from checkpoints");
    // Checkpoints newer than the resume point belong to the timeline given
    // up here: drop them, so that the next full stop cannot take them for
    // newer state.
    if let Some(dir) = dir {
        let versions = rp.versions.clone();
        let dropped = tokio::task::spawn_blocking(move || dir.discard_newer(&versions))
            .await
            .context("checkpoint clean-up panicked")??;
        if dropped > 0 {
            info!(dropped, "deleted checkpoints newer than the resume point");
        }
    }
    aggregator.resume(states).await?;
    worker.snapshot.send_modify(|s| s.version = rp.step);
    Ok(Some(rp))
}

/// The device class a node gossips in its capabilities.
fn device_class(kind: shoal_models::DeviceKind) -> Device {
    match kind {
        shoal_models::DeviceKind::Cpu => Device::Cpu,
        shoal_models::DeviceKind::Cuda(_) => Device::Cuda,
        shoal_models::DeviceKind::Metal(_) => Device::Metal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_models::{OptimizerConfig, OptimizerKind};

    /// A 100M-parameter model trains with the default 8 shards and limits
    /// (50 MB shards, 150 MB with AdamW's state); on one shard it is refused
    /// with the number of shards it needs (1.2 GB over 256 MiB messages: 5).
    #[test]
    fn a_hundred_million_parameters_fit_in_eight_shards_but_not_one() -> anyhow::Result<()> {
        let limits = shoal_protocol::Limits::default();
        let adamw = OptimizerConfig::new(OptimizerKind::Adamw, 1e-3);
        assert!(check_shard_fits(&ShardPlan::new(100_000_000, 8)?, &adamw, &limits).is_ok());
        let e = check_shard_fits(&ShardPlan::new(100_000_000, 1)?, &adamw, &limits)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("use at least 5 shards"), "{e}");
        Ok(())
    }
}
