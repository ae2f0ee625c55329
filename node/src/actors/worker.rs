//! The worker: the life of one training step, in parameter-server mode.
//!
//! 1. compute gradients on this node's next batch (trainer thread);
//! 2. cut them into shards with the `ShardPlan`;
//! 3. push each shard to its owner (concurrently; the local owner directly);
//! 4. pull every shard's new version (BSP: `base + 1`; other policies: what
//!    the owner's staleness gate lets through);
//! 5. load the new parameters into the model and publish a snapshot.
//!
//! Gossip mode replaces 3-4 with a local optimizer step and, every k steps,
//! averaging each shard with a random peer's copy.
//!
//! With a `[local_steps]` table of H steps (DiLoCo) a pull-mode worker takes local
//! optimizer steps and runs 2-5 every H steps only, pushing the
//! pseudo-gradient (its parameters at the round's start minus now).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use futures::future::try_join_all;
use futures::FutureExt;
use shoal_models::data::shuffled_batches;
use shoal_models::{LayerFactors, Optimizer, Partition, ShardPlan};
use shoal_protocol::libp2p::PeerId;
use shoal_protocol::payload::params_hash;
use shoal_protocol::{
    Encoding, Payload, Probe, PullShard, PushGrad, PushPull, Role, RunId, ShardRequest, ShardResponse, StateSync,
    MAX_BATCH_SHARDS,
};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::config::{Mode, NodeConfig};
use crate::handles::aggregator::{AggregatorHandle, PullReply, PushReply};
use crate::handles::membership::{MembershipHandle, ViewSnapshot};
use crate::handles::net::{ModelSnapshot, NetError, NetworkHandle};
use crate::handles::status::{StatusEvent, StatusHandle};
use crate::handles::trainer::{Gradients, PostedParams, TrainerHandle};
use crate::ops::faults::hold;
use crate::ops::logging::short;
use crate::policy::backoff::Backoff;
use crate::policy::compress::{factored_push, ErrorFeedback, PushCompression};
use crate::policy::contribution::Contribution;
use crate::policy::delta::ShardDelta;
use crate::policy::exchange::{self, ExchangeAction, PullAnswer, PushAnswer, ShardExchange};
use crate::policy::explore::PaceMeter;
use crate::policy::fit::{permille, rebalanced, BatchFit};
use crate::policy::health::{self, would_demote, HealthPolicy, ServiceTracker};
use crate::policy::placement::Placement;
use crate::policy::sync::SyncPolicy;
use crate::policy::view::Roster;

/// The batch a worker of rank `rank` among `world` trains on at `step`:
/// its rank-strided partition of the training set, reshuffled each epoch.
/// Public so that tests can rebuild the concatenated batch of all workers.
pub fn batch_for_step(
    train_len: usize,
    rank: usize,
    world: usize,
    batch_size: usize,
    seed: u64,
    step: u64,
) -> anyhow::Result<Vec<usize>> {
    WorkerBatches::new(train_len, rank, world, batch_size, seed)?.for_step(step)
}

/// A worker's batches, computed once per epoch rather than once per step:
/// the partition is fixed for the run and the shuffle changes only with the epoch.
#[derive(Debug)]
pub struct WorkerBatches {
    part: Vec<usize>,
    batch_size: usize,
    seed: u64,
    epoch: Option<u64>,
    batches: Vec<Vec<usize>>,
}

impl WorkerBatches {
    pub fn new(train_len: usize, rank: usize, world: usize, batch_size: usize, seed: u64) -> anyhow::Result<Self> {
        let part = Partition::Rank { rank, world }.indices(train_len)?;
        if part.is_empty() {
            bail!("rank {rank} of {world} gets no training samples out of {train_len}");
        }
        if batch_size == 0 {
            bail!("batch size must be at least 1");
        }
        Ok(Self { part, batch_size, seed, epoch: None, batches: Vec::new() })
    }

    pub fn for_step(&mut self, step: u64) -> anyhow::Result<Vec<usize>> {
        self.batch_of(step).cloned()
    }

    /// How many samples the batch of `step` holds (the last of an epoch
    /// holds what is left of the partition).
    pub fn len_for_step(&mut self, step: u64) -> anyhow::Result<usize> {
        self.batch_of(step).map(Vec::len)
    }

    fn batch_of(&mut self, step: u64) -> anyhow::Result<&Vec<usize>> {
        let per_epoch = self.part.len().div_ceil(self.batch_size) as u64;
        let epoch = step / per_epoch;
        if self.epoch != Some(epoch) {
            self.batches = shuffled_batches(&self.part, self.batch_size, self.seed, epoch)?;
            self.epoch = Some(epoch);
        }
        self.batches.get((step % per_epoch) as usize).context("batch index out of range")
    }

    /// Grow `out`, the batch of `step` as positions in [`Self::rows`]
    /// ([`Self::local_for_step`]), to `n` samples (`sync.fit_rebalance`)
    /// with the first samples of the epoch's following batches, wrapping to
    /// its first: all distinct, and at most the whole partition.
    pub fn grow_local(&mut self, step: u64, out: &mut Vec<usize>, n: usize) -> anyhow::Result<()> {
        let per_epoch = self.part.len().div_ceil(self.batch_size) as u64;
        let first = step / per_epoch * per_epoch;
        for k in 1..per_epoch {
            if out.len() >= n {
                break;
            }
            let more = self.local_for_step(first + (step - first + k) % per_epoch)?;
            let want = n - out.len();
            out.extend(more.into_iter().take(want));
        }
        Ok(())
    }

    /// The samples of the partition, ascending: what the trainer loads.
    pub fn rows(&self) -> &[usize] {
        &self.part
    }

    /// The batch of `step` as positions in [`Self::rows`] (the trainer holds
    /// only those samples, in that order).
    pub fn local_for_step(&mut self, step: u64) -> anyhow::Result<Vec<usize>> {
        let global = self.for_step(step)?;
        global
            .iter()
            .map(|g| self.part.binary_search(g).map_err(|_| anyhow::anyhow!("sample {g} is not in this partition")))
            .collect()
    }
}

/// Everything the step loop talks to.
pub struct Worker {
    pub me: PeerId,
    pub incarnation: u64,
    pub config: NodeConfig,
    pub run: RunId,
    pub net: NetworkHandle,
    pub aggregator: AggregatorHandle,
    pub trainer: TrainerHandle,
    pub status: StatusHandle,
    pub plan: ShardPlan,
    pub train_len: usize,
    pub snapshot: watch::Sender<ModelSnapshot>,
    pub membership: MembershipHandle,
    pub placement: watch::Receiver<Option<Arc<Placement>>>,
    /// Service times of the owners this worker pushes to (and probes).
    pub service: Arc<std::sync::Mutex<ServiceTracker>>,
    /// Set when the node is asked to leave: the worker stops after the step in hand.
    pub leave: watch::Receiver<bool>,
    /// Fault injection (a slowdown stretches each gradient computation).
    pub faults: Arc<crate::ops::faults::Faults>,
    /// This step's exchanges with remote owners: the link rate in this
    /// node's capabilities.
    pub link: LinkMeter,
    /// The node's tasks (probes are spawned here).
    pub tasks: crate::ops::tasks::NodeTasks,
}

/// Bytes moved in exchanges with remote owners, and the time those
/// exchanges took: each round trip less the time the owner held its answer
/// for the round (the slowest worker's time, not this node's link). The
/// rate is per exchange: exchanges with several owners at once add their
/// times, so the figure is what one exchange moves per second, comparable
/// between nodes whatever their number of owners.
#[derive(Debug, Default)]
pub struct LinkMeter {
    bytes: std::sync::atomic::AtomicU64,
    micros: std::sync::atomic::AtomicU64,
}

impl LinkMeter {
    fn add(&self, bytes: u64, took: Duration) {
        use std::sync::atomic::Ordering::Relaxed;
        self.bytes.fetch_add(bytes, Relaxed);
        self.micros.fetch_add(u64::try_from(took.as_micros()).unwrap_or(u64::MAX), Relaxed);
    }

    /// Bytes and seconds since the last call.
    fn take(&self) -> (u64, f64) {
        use std::sync::atomic::Ordering::Relaxed;
        (self.bytes.swap(0, Relaxed), self.micros.swap(0, Relaxed) as f64 / 1e6)
    }
}

/// One shard's gradient as this step pushes it: the values an owner gets
/// (the raw slice, or what the lossy payload decodes to) and the payload
/// encoded once with error feedback (`None`: f32, encoded per push).
#[derive(Debug)]
struct Outgoing<'a> {
    values: std::borrow::Cow<'a, [f32]>,
    payload: Option<Payload>,
    /// Delta pulls: the version of the shard this worker holds exactly,
    /// sent with each pull so that the owner may answer with the update.
    have: Option<u64>,
}

/// Backup workers: how many times [`Worker::align_versions`] pulls the
/// shards behind before it gives up.
const ALIGN_PASSES: usize = 8;

/// Gossip mode: the most `gossip.every` periods a peer's copy may be
/// behind this node's and still be averaged in. Without a bound, a node 32x
/// slower than three others dragged their average back to its early models
/// (94.15% on digits where they reached 96.94-97.49%; 100x: 87.74%).
pub const GOSSIP_MAX_BEHIND: u64 = 2;

/// One shard's exchange for a step: the version pulled and its values.
type Exchanged = exchange::Exchanged<Values>;

/// What came of a push: the owner's answer, or (a `PushPull` that was
/// accepted and served) the shard's next version.
#[derive(Debug)]
enum Pushed {
    Reply(PushReply),
    State { version: u64, params: Values },
}

/// A shard's values as an exchange got them: decoded already (the local
/// owner's state, a separate pull's), or a remote owner's `Exchanged`
/// payload as it came off the wire, checked on arrival ([`exchanged`]) and
/// decoded straight into the flat parameters once every shard of the step
/// is in. No shard-sized vector is allocated and filled for the second
/// case, and the values are not copied twice.
#[derive(Debug)]
enum Values {
    Decoded(Arc<Vec<f32>>),
    Wire {
        payload: shoal_protocol::Verified,
        from: PeerId,
    },
    /// Delta pulls: the update from `base` to the version, checked on
    /// arrival ([`received_delta`]), added to the worker's copy.
    Delta(Arc<ShardDelta>),
}

impl Values {
    fn len(&self) -> u64 {
        match self {
            Values::Decoded(v) => v.len() as u64,
            Values::Wire { payload, .. } => payload.numel(),
            Values::Delta(d) => d.payload.numel(),
        }
    }

    /// Write the values into `out` (as long as they are), which holds
    /// version `held` of the shard: a whole shard replaces it, an update
    /// is added to it. `false`: an update that is not from `held` or whose
    /// sum is not the owner's (its hash), with `out` left in any state. On
    /// an error `out` may be partly written.
    fn write_into(&self, out: &mut [f32], held: u64) -> anyhow::Result<bool> {
        match self {
            Values::Decoded(v) => out.copy_from_slice(v),
            Values::Wire { payload, from } => {
                payload.decode_into(out).with_context(|| format!("the state {from} sent"))?;
            }
            Values::Delta(d) => {
                if d.base != held {
                    return Ok(false);
                }
                // The owner's own addition (`DeltaLog::record`).
                d.payload.add_scaled_into(out, 1.0).context("an update")?;
                return Ok(params_hash(out) == d.hash);
            }
        }
        Ok(true)
    }
}

/// What a shard's first push attempt became when it went in a
/// `PushPullMany` to `owner` (see [`Worker::push_pull_many`]).
type BatchOutcome = anyhow::Result<Pushed>;

/// A shard's first attempt, made for it by a `PushPullMany` to `owner`.
#[derive(Debug)]
struct FirstAttempt {
    owner: PeerId,
    outcome: tokio::sync::oneshot::Receiver<BatchOutcome>,
}

/// Where this worker starts and which data it trains on.
#[derive(Debug)]
pub struct Routing {
    /// The roster training started with (a joiner: the run's live nodes
    /// when it joined). Gossip partners come from it.
    pub roster: Roster,
    /// This node's slice of the training set: `rank` of `world` in the
    /// start roster. `None` for a node that joined mid-run: it has no slice
    /// of its own and samples the whole set with a shuffle of its own.
    pub partition: Option<(usize, usize)>,
    /// First step to run (0, or the step the run had reached at a join).
    pub start_step: u64,
    /// Version of each shard of the initial parameters.
    pub versions: Vec<u64>,
}

/// How a worker's run ended.
#[derive(Debug)]
pub struct Ran {
    pub params: Vec<f32>,
    /// Steps run up to (`total_steps`, or less when it left early).
    pub steps: u64,
    /// Stopped early because the node was asked to leave.
    pub left: bool,
}

/// What a step does once it has its gradients: the worker's mode, with
/// the state that mode carries from step to step.
#[derive(Debug)]
enum StepMode {
    /// Push the gradients to the shards' owners and pull every shard's new
    /// version ([`Worker::pull_exchange`]).
    Pull,
    /// A local optimizer step, and every `gossip.every` steps an
    /// average with random peers ([`Worker::gossip_step`]).
    Gossip { opt: Optimizer },
    /// DiLoCo (a `[local_steps]` table, pull mode): local optimizer
    /// steps, and every `local_steps` steps an exchange of the
    /// pseudo-gradient ([`Worker::local_step`]).
    LocalSteps(LocalRound),
}

impl StepMode {
    fn new(config: &NodeConfig, params: &[f32]) -> anyhow::Result<Self> {
        let local_steps = config.steps_per_round();
        let optimizer = || Optimizer::new(config.training.optimizer_config(), params.len());
        Ok(match config.cluster.mode {
            Mode::Pull if local_steps <= 1 => StepMode::Pull,
            Mode::Pull => StepMode::LocalSteps(LocalRound {
                opt: optimizer()?,
                start: params.to_vec(),
                samples: 0,
                every: local_steps,
            }),
            Mode::Gossip => StepMode::Gossip { opt: optimizer()? },
        })
    }
}

/// DiLoCo's round of local steps.
#[derive(Debug)]
struct LocalRound {
    /// The inner optimizer.
    opt: Optimizer,
    /// The parameters at the start of this round.
    start: Vec<f32>,
    /// The samples trained on since.
    samples: u64,
    /// The steps of a round (`local_steps.steps`).
    every: u64,
}

/// The state the step loop carries from step to step, whatever the mode.
#[derive(Debug)]
struct StepLoop {
    params: Vec<f32>,
    /// Each shard's version as last pulled.
    versions: Vec<u64>,
    batches: WorkerBatches,
    /// Error feedback of the lossy push encodings (`compression`).
    feedback: ErrorFeedback,
    /// Worker momentum: the average pushed instead of each gradient.
    momentum: Option<Vec<f32>>,
    /// Overlap (`sync.overlap`): the next step's gradients, computed while
    /// this step's exchange was in flight, and how long they took.
    prefetched: Option<(Gradients, f64)>,
    /// A slow worker's batch fitted to the others' pace (`sync.fit_batch`).
    fit: Option<BatchFit>,
    /// The others' heartbeats, for `fit`.
    view: watch::Receiver<ViewSnapshot>,
    report: ReportClock,
    pace: PaceMeter,
    /// The snapshot a step replaced: its buffer takes the next step's copy.
    spare: Option<Arc<Vec<f32>>>,
    /// The parameters the last step handed to the trainer, loaded there
    /// before the next step's gradients ([`Worker::publish`]).
    posted: Option<PostedParams>,
    /// An exchange with the owners has completed: the model is the run's
    /// own, not a copy fetched or resumed (see [`Worker::exchange_all`]).
    exchanged: bool,
}

/// A step's own figures, reported once its model is loaded
/// ([`Worker::report_step`]).
#[derive(Debug)]
struct StepFigures {
    step: u64,
    samples: usize,
    loss: f32,
    /// Seconds the gradients took.
    compute: f64,
    /// The share of its batch the step trained on (fit_batch), in ‰.
    share: Option<u16>,
    version: u64,
    started: Instant,
}

/// When this worker last published its service report, the owners that
/// report alone would demote, and the thresholds it is judged by (see
/// `Worker::after_exchange`).
#[derive(Debug)]
struct ReportClock {
    at: Option<Instant>,
    demoting: std::collections::BTreeSet<PeerId>,
    health: HealthPolicy,
}

/// Wait for the placement to change, at most the next delay of `backoff`:
/// retries of a failed pull go as soon as the shard may have moved.
async fn wait_for_change(placement: &mut watch::Receiver<Option<Arc<Placement>>>, backoff: &mut Backoff) {
    let _ = tokio::time::timeout(backoff.next_delay(), placement.changed()).await;
}

/// The back-off of the waits for a placement change between retries of a
/// shard's exchange or pull: 10 ms doubling to 500 ms.
fn placement_backoff() -> Backoff {
    Backoff::new(Duration::from_millis(10), Duration::from_millis(500))
}

/// Whom to ask for `shard` next: the owner a refusal named, else the one
/// the current placement names.
fn next_owner(
    shard: u32,
    hint: &mut Option<PeerId>,
    placement: &mut watch::Receiver<Option<Arc<Placement>>>,
) -> anyhow::Result<PeerId> {
    match hint.take() {
        Some(h) => Ok(h),
        None => placement.borrow_and_update().clone().and_then(|p| p.owner(shard)).context("no placement yet"),
    }
}

/// `owner`'s service time in µs for the straggler detector, pushes and
/// probes alike: the time the owner `reported` in its `Timed` answer
/// (capped by the round trip), or, for an answer that came back outside a
/// `Timed` (an error the owner's network layer gave before serving it),
/// the `round_trip` (less any hold it reported) less the path's own
/// latency, the least recent ping to it ([`health::PathLatency`]).
fn service_micros(net: &NetworkHandle, owner: PeerId, round_trip: Duration, reported: Option<Duration>) -> f64 {
    match reported {
        // At most the round trip: a report longer than that is impossible.
        Some(service) => service.min(round_trip).as_secs_f64() * 1e6,
        None => health::less_path(round_trip.as_secs_f64() * 1e6, net.path_rtt_micros(&owner)),
    }
}

/// Send a request whose service the straggler detector times, inside a
/// `Timed` so that the answer says how long the owner itself took to serve
/// it: this worker's own waits for the CPU and the network do not count
/// against the owner. Returns the request's answer and that service time;
/// `None` for an answer that came back outside a `Timed` (an error given
/// before the request was served), which is returned as it is.
async fn timed_request(
    net: &NetworkHandle,
    owner: PeerId,
    req: ShardRequest,
) -> Result<(ShardResponse, Option<Duration>), crate::handles::net::NetError> {
    Ok(match net.request(owner, ShardRequest::Timed(Box::new(req))).await? {
        ShardResponse::Timed { service_us, answer } => (*answer, Some(Duration::from_micros(service_us.into()))),
        other => (other, None),
    })
}

/// A push's outcome as the exchange machine reads it.
fn push_answer(pushed: anyhow::Result<Pushed>) -> PushAnswer<PeerId, Values> {
    match pushed {
        Ok(Pushed::State { version, params }) => PushAnswer::Served { version, params },
        Ok(Pushed::Reply(PushReply::Accepted { version, .. })) => PushAnswer::Accepted { version },
        Ok(Pushed::Reply(PushReply::Stale { current_version, .. })) => PushAnswer::Stale { current_version },
        Ok(Pushed::Reply(PushReply::UnknownWorker)) => PushAnswer::UnknownWorker,
        Ok(Pushed::Reply(PushReply::NotOwner { hint, .. })) => PushAnswer::NotOwner { hint },
        Ok(Pushed::Reply(PushReply::Pending)) => PushAnswer::Pending,
        Ok(Pushed::Reply(PushReply::Invalid(m))) => PushAnswer::Invalid(m),
        Err(e) => PushAnswer::Failed(format!("{e:#}")),
    }
}

/// What an owner's `Exchanged` answer means to the push's exchange: the
/// shard's next state, or (without one) an accepted gradient to pull for.
/// The state's payload is checked here, on arrival (checksum, every value
/// finite; nothing is allocated), so that a bad one fails this attempt and
/// the exchange tries again, as for any failed request; it is decoded
/// later, into the model's flat parameters ([`Values::write_into`]).
fn exchanged(x: shoal_protocol::Exchanged, from: PeerId) -> anyhow::Result<Pushed> {
    Ok(match x.state {
        Some(s) if s.delta.is_some() => {
            let version = s.version;
            Pushed::State { version, params: Values::Delta(received_delta(s, from)?) }
        }
        Some(s) => {
            let payload = s
                .params
                .verified()
                .with_context(|| format!("the state of shard {} that {from} sent", x.accepted.shard))?;
            Pushed::State { version: s.version, params: Values::Wire { payload, from } }
        }
        None => Pushed::Reply(PushReply::Accepted { version: x.accepted.version, staleness: x.accepted.staleness }),
    })
}

/// A shard state that carries a round's update (delta pulls), as the
/// worker keeps it: checked on arrival (checksum, finiteness), so a bad one
/// fails this attempt. The caller has seen `s.delta` set.
fn received_delta(s: shoal_protocol::ShardState, from: PeerId) -> anyhow::Result<Arc<ShardDelta>> {
    let d = s.delta.context("a whole shard where an update was expected")?;
    s.params.verify().with_context(|| format!("the update of shard {} that {from} sent", s.shard))?;
    Ok(Arc::new(ShardDelta { base: d.base, version: s.version, payload: s.params, hash: d.hash }))
}

/// Whether the parameters the last step handed to the trainer loaded (an
/// error stops the run, as a failed load always did).
async fn loaded(run: &mut StepLoop) -> anyhow::Result<()> {
    match run.posted.take() {
        Some(p) => p.loaded().await.context("loading the parameters into the trainer"),
        None => Ok(()),
    }
}

/// `params` copied into `spare`'s buffer when nothing else holds it any
/// more (the snapshot a step replaced, once the trainer has loaded it), or
/// else into a fresh one: one model-sized allocation less per step, and no
/// fresh pages to fault in.
fn copy_into(spare: Option<Arc<Vec<f32>>>, params: &[f32]) -> Vec<f32> {
    match spare.and_then(|a| Arc::try_unwrap(a).ok()) {
        Some(mut buf) => {
            buf.clear();
            buf.extend_from_slice(params);
            buf
        }
        None => params.to_vec(),
    }
}

/// `owner` does not own the shard: try next the owner it `named`, if
/// another, or else wait for the placement to change.
async fn follow_hint(
    owner: PeerId,
    named: Option<PeerId>,
    hint: &mut Option<PeerId>,
    placement: &mut watch::Receiver<Option<Arc<Placement>>>,
    backoff: &mut Backoff,
) {
    *hint = named.filter(|h| *h != owner);
    if hint.is_none() {
        wait_for_change(placement, backoff).await;
    }
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").field("me", &self.me).finish_non_exhaustive()
    }
}

impl Worker {
    /// BSP with backup workers (`sync.backup_workers`): rounds close
    /// without the slowest, late pushes are dropped, workers skip ahead.
    fn backup_mode(&self) -> bool {
        self.config.sync.backup_workers > 0 && self.policy() == SyncPolicy::Bsp
    }

    fn policy(&self) -> SyncPolicy {
        self.config.sync.policy
    }

    fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.config.cluster.request_timeout_ms)
    }

    /// Run all steps. Returns the final flat parameters.
    pub async fn run(&self, routing: &Routing, params: Vec<f32>) -> anyhow::Result<Ran> {
        let steps = self.config.training.steps;
        let (mut mode, mut run) = self.start(routing, params).await?;
        let mut step = routing.start_step;
        while step < steps {
            if *self.leave.borrow() {
                info!(step, "leaving: no further steps");
                loaded(&mut run).await?;
                return Ok(Ran { params: run.params, steps: step, left: true });
            }
            step = self.step(routing, &mut mode, &mut run, step).await?;
        }
        loaded(&mut run).await?;
        if matches!(mode, StepMode::Gossip { .. }) {
            self.gossip_consensus(routing, steps, &mut run.params).await?;
            self.membership.set_self(|me| me.step = steps);
        }
        Ok(Ran { params: run.params, steps, left: false })
    }

    /// Before the first step: this worker's batches and their samples
    /// loaded, its [`StepMode`], and the state the steps carry.
    async fn start(&self, routing: &Routing, params: Vec<f32>) -> anyhow::Result<(StepMode, StepLoop)> {
        let t = &self.config.training;
        let batches = match routing.partition {
            Some((rank, world)) => WorkerBatches::new(self.train_len, rank, world, t.batch_size, t.seed)?,
            None => {
                let seed = t.seed ^ shoal_models::rng::stable_hash64(&self.me.to_bytes());
                WorkerBatches::new(self.train_len, 0, 1, t.batch_size, seed)?
            }
        };
        // Only this partition's samples are read into memory.
        let loaded = self.trainer.load_train(batches.rows().to_vec()).await.context("loading the training samples")?;
        info!(samples = batches.rows().len(), of = self.train_len, bytes = loaded, "training samples loaded");
        let versions = routing.versions.clone();
        if versions.len() != self.plan.len() {
            bail!("{} shard versions for {} shards", versions.len(), self.plan.len());
        }
        let mode = StepMode::new(&self.config, &params)?;
        info!(partition = ?routing.partition, from = routing.start_step, steps = t.steps,
              mode = ?self.config.cluster.mode, sync = %self.policy(), "training");
        let report = ReportClock {
            at: None,
            demoting: Default::default(),
            health: self.config.roles.health_policy(self.plan.total_len(), self.plan.len()),
        };
        let compression = self.config.compression;
        self.status.record(StatusEvent::Compression {
            push: compression.push.to_string(),
            pull: compression.pull.to_string(),
        });
        let run = StepLoop {
            params,
            versions,
            batches,
            feedback: ErrorFeedback::new(self.plan.len()),
            momentum: (self.config.aggregation.worker_momentum > 0.0).then(Vec::new),
            prefetched: None,
            fit: self.config.sync.fit_batch.then(|| BatchFit::new(t.batch_size)),
            view: self.membership.subscribe(),
            report,
            pace: Default::default(),
            spare: None,
            posted: None,
            exchanged: false,
        };
        Ok((mode, run))
    }

    /// One step: its gradients, the exchange its mode makes, the new model
    /// loaded and published, and the step reported. Returns the next step
    /// to run.
    async fn step(&self, routing: &Routing, mode: &mut StepMode, run: &mut StepLoop, step: u64) -> anyhow::Result<u64> {
        let started = Instant::now();
        let (g, compute, share) = self.gradients(run, step).await?;
        let comm_started = Instant::now();
        let (version, exchange_secs) = match mode {
            StepMode::Pull => self.pull_exchange(run, &g, step).await?,
            StepMode::Gossip { opt } => (self.gossip_step(routing, run, opt, &g, step).await?, None),
            StepMode::LocalSteps(local) => (self.local_step(run, local, &g, step).await?, None),
        };
        let figures = StepFigures { step, samples: g.samples, loss: g.loss, compute, share, version, started };
        // The gradients are pushed (or applied): their buffer takes the
        // next step's.
        self.trainer.recycle(g.grads);
        // Loading the parameters, done by the trainer before these
        // gradients, counts here, with handing over the new ones.
        let apply = self.publish(run, version).await? + g.load_secs;
        // Fault injection: the bad peers that push what they see applied
        // (nothing on an honest node's step).
        let byzantine = self.config.faults.byzantine;
        if byzantine.watches_model() {
            let lr = self.config.training.lr_schedule().lr_at(step) as f32;
            self.faults.observe_model(byzantine, &run.params, lr);
        }
        // With overlap: the exchange's own time (the step also waited for
        // the next step's compute, if that took longer).
        let comm = match exchange_secs {
            Some(x) => x + apply,
            None => comm_started.elapsed().as_secs_f64() + g.load_secs,
        };
        self.report_step(&mut run.pace, &figures, comm, apply);
        let t = &self.config.training;
        if t.eval_every > 0 && (step + 1).is_multiple_of(t.eval_every) && step + 1 < t.steps {
            loaded(run).await?;
            let e = self.trainer.evaluate().await?;
            self.status.record(StatusEvent::Evaluated(e));
            debug!(step = step + 1, accuracy = e.accuracy, bits_per_byte = e.bits_per_byte, "evaluated");
        }
        Ok(self.next_step(step, version))
    }

    /// This step's gradients, with the seconds they took: those computed
    /// beside the last step's exchange (`sync.overlap`), or computed now
    /// on a batch fitted to the others' pace (`sync.fit_batch`; then also
    /// the share of its nominal batch the step trained on).
    async fn gradients(&self, run: &mut StepLoop, step: u64) -> anyhow::Result<(Gradients, f64, Option<u16>)> {
        if let Some((g, secs)) = run.prefetched.take() {
            loaded(run).await?;
            return Ok((g, secs, None));
        }
        let size = match run.fit.as_mut() {
            Some(fit) => Some(self.fit_batch(fit, &mut run.batches, &run.view, step)?),
            None => None,
        };
        let (g, secs) = self.compute(step, &mut run.batches, &mut run.momentum, size.map(|(n, _)| n)).await?;
        // Answered before those gradients: no wait.
        loaded(run).await?;
        let mut share = None;
        if let (Some(fit), Some((_, nominal))) = (run.fit.as_mut(), size) {
            fit.observe(g.samples, secs * 1e6);
            share = Some(permille(g.samples, nominal));
        }
        Ok((g, secs, share))
    }

    /// A slow worker's batch fitted to the others' pace (`sync.fit_batch`),
    /// or, with `sync.fit_rebalance`, a fast one's grown to take up what
    /// the others left. Returns the samples to train on and the nominal
    /// batch size.
    fn fit_batch(
        &self,
        fit: &mut BatchFit,
        batches: &mut WorkerBatches,
        view: &watch::Receiver<ViewSnapshot>,
        step: u64,
    ) -> anyhow::Result<(usize, usize)> {
        let nominal = batches.len_for_step(step)?;
        let others = self.others_paces(view, self.config.training.steps);
        let times: Vec<f64> = others.iter().map(|p| f64::from(p.step_micros.saturating_sub(p.comm_micros))).collect();
        let fitted = fit.batch(&times, nominal);
        let size = if fitted < nominal || !self.config.sync.fit_rebalance {
            fitted
        } else {
            let shares: Vec<u16> = others.iter().map(|p| p.batch_permille).collect();
            rebalanced(nominal, &shares)
        };
        Ok((size, nominal))
    }

    /// [`StepMode::Pull`]: push the gradients and pull every shard's new
    /// version. Returns the model version and, with overlap, the exchange's
    /// own seconds.
    async fn pull_exchange(&self, run: &mut StepLoop, g: &Gradients, step: u64) -> anyhow::Result<(u64, Option<f64>)> {
        let steps = self.config.training.steps;
        let pushed = (g.samples as u32, &g.grads[..], &g.factors[..]);
        let exchange =
            self.exchange_all(step, &mut run.exchanged, &mut run.versions, pushed, &mut run.params, &mut run.feedback);
        let (version, secs) = if self.config.sync.overlap && step + 1 < steps {
            // Step t+1's gradients, on the parameters of step t-1, while
            // step t's pushes and pulls are on the wire. The owners' clock
            // bound is one lower to pay for it (`SyncPolicy::pipelined`).
            let next = self.compute(step + 1, &mut run.batches, &mut run.momentum, None);
            let timed = async {
                let t0 = Instant::now();
                let v = exchange.await;
                (v, t0.elapsed().as_secs_f64())
            };
            let ((v, secs), next) = tokio::join!(timed, next);
            run.prefetched = Some(next?);
            self.status.record(StatusEvent::Overlapped);
            (v?, Some(secs))
        } else {
            (exchange.await?, None)
        };
        self.after_exchange(step, &run.feedback, &mut run.report);
        Ok((version, secs))
    }

    /// [`StepMode::Gossip`]: a local optimizer step, and every
    /// `gossip.every` steps an average with random peers. Returns
    /// the model version (the step count).
    async fn gossip_step(
        &self,
        routing: &Routing,
        run: &mut StepLoop,
        opt: &mut Optimizer,
        g: &Gradients,
        step: u64,
    ) -> anyhow::Result<u64> {
        opt.set_lr(self.config.training.lr_schedule().lr_at(step))?;
        opt.step(&mut run.params, &g.grads)?;
        if (step + 1).is_multiple_of(self.config.gossip().every) {
            self.gossip_average(routing, step, &mut run.params).await?;
        }
        Ok(step + 1)
    }

    /// [`StepMode::LocalSteps`] (DiLoCo): a local step, and every
    /// `local_steps` steps (and at the last) the pseudo-gradient start - now
    /// goes to the owners, whose outer optimizer applies the round; the new
    /// parameters start the next round. Returns the model version.
    async fn local_step(
        &self,
        run: &mut StepLoop,
        local: &mut LocalRound,
        g: &Gradients,
        step: u64,
    ) -> anyhow::Result<u64> {
        let steps = self.config.training.steps;
        local.opt.set_lr(self.config.training.lr_schedule().lr_at(step))?;
        local.opt.step(&mut run.params, &g.grads)?;
        local.samples += g.samples as u64;
        if !((step + 1).is_multiple_of(local.every) || step + 1 == steps) {
            return Ok(run.versions.iter().copied().min().unwrap_or(0));
        }
        let pseudo: Vec<f32> = local.start.iter().zip(&run.params).map(|(s, p)| s - p).collect();
        if self.config.delta_pulls().is_some() {
            // The copy the owners' updates are added to: the round's start,
            // the model as last pulled.
            run.params.copy_from_slice(&local.start);
        }
        let n = u32::try_from(local.samples).unwrap_or(u32::MAX);
        let pushed = (n, &pseudo[..], &[][..]);
        let version = self
            .exchange_all(step, &mut run.exchanged, &mut run.versions, pushed, &mut run.params, &mut run.feedback)
            .await?;
        self.after_exchange(step, &run.feedback, &mut run.report);
        local.start.copy_from_slice(&run.params);
        local.samples = 0;
        Ok(version)
    }

    /// Hand the step's parameters to the trainer and publish a copy on
    /// the snapshot watch (into the buffer of the snapshot it replaces).
    /// The trainer loads them before the next step's gradients, in the
    /// same hand-over to its thread; whether they loaded is checked when
    /// those gradients come back ([`loaded`]). Returns the seconds it
    /// took here.
    async fn publish(&self, run: &mut StepLoop, version: u64) -> anyhow::Result<f64> {
        let set_started = Instant::now();
        loaded(run).await?;
        let params = Arc::new(copy_into(run.spare.take(), &run.params));
        run.posted = Some(self.trainer.post_params(params.clone()).await?);
        run.spare = Some(self.snapshot.send_replace(ModelSnapshot { version, params }).params);
        Ok(set_started.elapsed().as_secs_f64())
    }

    /// A step's figures to status, and its step, version, pace and rates to
    /// membership for the next heartbeat.
    fn report_step(&self, pace: &mut PaceMeter, f: &StepFigures, comm: f64, apply: f64) {
        let steps = self.config.training.steps;
        self.status.record(StatusEvent::Step {
            step: f.step + 1,
            samples: f.samples,
            loss: f.loss,
            compute_secs: f.compute,
            comm_secs: comm,
            apply_secs: apply,
            step_secs: f.started.elapsed().as_secs_f64(),
        });
        self.status.record(StatusEvent::Version(f.version));
        let p = pace.observe(f.started.elapsed().as_secs_f64(), comm);
        let (link_bytes, link_secs) = self.link.take();
        let (compute_rate, net_rate) = pace.rates(f.samples, f.compute, link_bytes, link_secs);
        // Gossip mode: the last step is reported once the final models are
        // averaged (`gossip_consensus`), so that peers linger until every
        // node has fetched the copies it averages.
        let last_gossip = self.config.cluster.mode == Mode::Gossip && f.step + 1 == steps;
        self.membership.set_self(|me| {
            if !last_gossip {
                me.step = f.step + 1;
            }
            me.model_version = f.version;
            me.pace.step_micros = p.step_micros;
            me.pace.comm_micros = p.comm_micros;
            me.compute_samples_per_sec = compute_rate;
            me.net_bytes_per_sec = net_rate;
            if let Some(s) = f.share {
                me.pace.batch_permille = s;
            }
        });
    }

    /// The step after `step`, whose exchange reached model `version`. Under
    /// BSP the version after a round is the next step. A worker whose push
    /// was dropped (`sync.backup_workers`) pulled the rounds applied
    /// without it, and trains for the round in progress.
    fn next_step(&self, step: u64, version: u64) -> u64 {
        if !(self.backup_mode() && version > step + 1) {
            return step + 1;
        }
        let next = version.min(self.config.training.steps);
        self.status.record(StatusEvent::SkippedSteps(next - step - 1));
        self.membership.set_self(|me| me.step = next);
        next
    }

    /// Gossip mode, after the last step: average with every peer's final
    /// model, so that the run ends on (nearly) one model. Random pairwise
    /// averages leave the final models a random distance apart, and a node
    /// that finished early averaged last with a peer's model of some steps
    /// before. This round waits until the live peers report that they
    /// published their last step's model (the heartbeat's model version;
    /// they report the step itself after this round, so that lingering
    /// keeps every node serving until all have averaged; at most the
    /// request timeout), then averages
    /// each shard over this node's copy and every peer's copy it gets. A
    /// peer that has done this round already serves its average: the mean,
    /// or close to it. Peers the failure detector gave up on, and any that
    /// do not answer in time, are left out.
    async fn gossip_consensus(&self, routing: &Routing, steps: u64, params: &mut [f32]) -> anyhow::Result<()> {
        let limit = self.request_timeout();
        let failure_timeout = self.config.cluster.failure_timeout_ms;
        if !self.membership.wait_until_peers_publish(self.me, steps, failure_timeout, limit).await {
            warn!("gossip: not every peer published its last step's model in time; averaging with those that did");
        }
        // Roster members alive, staying and with their final model out: any
        // other would hold the round up to the deadline for nothing.
        let live: std::collections::HashSet<PeerId> = {
            let snap = self.membership.snapshot();
            snap.view
                .live(snap.now_ms, failure_timeout)
                .iter()
                .filter(|p| p.heartbeat.role != Role::Leaving && p.heartbeat.model_version >= steps)
                .map(|p| p.heartbeat.peer)
                .collect()
        };
        let others: Vec<PeerId> =
            routing.roster.peers().into_iter().filter(|p| *p != self.me && live.contains(p)).collect();
        let deadline = Instant::now() + limit;
        let copies = futures::future::join_all(others.iter().map(|&peer| {
            futures::future::join_all(self.plan.shards().iter().map(move |shard| {
                let req =
                    ShardRequest::StateSync(StateSync { run: self.run.clone(), shard: shard.id, min_version: steps });
                async move {
                    match self.request_with_retry(peer, req, deadline).await {
                        Ok(ShardResponse::ShardState(s)) => s.params.decode().ok().filter(|v| v.len() == shard.len()),
                        Ok(_) | Err(_) => None,
                    }
                }
            }))
        }))
        .await;
        let mut averaged = 0usize;
        for (i, shard) in self.plan.shards().iter().enumerate() {
            let got: Vec<&Vec<f32>> = copies.iter().filter_map(|c| c.get(i)?.as_ref()).collect();
            if got.is_empty() {
                continue;
            }
            averaged += 1;
            let n = (got.len() + 1) as f32;
            for (j, p) in params[shard.range()].iter_mut().enumerate() {
                *p = (*p + got.iter().map(|v| v[j]).sum::<f32>()) / n;
            }
        }
        info!(shards = averaged, of = self.plan.len(), peers = others.len(), "gossip: final models averaged");
        let params = Arc::new(params.to_vec());
        self.trainer.set_params(params.clone()).await?;
        self.snapshot.send_replace(ModelSnapshot { version: steps, params });
        Ok(())
    }

    /// One step's gradients on the model the trainer holds now: the batch,
    /// forward and backward, worker momentum, and the fault injections.
    /// Returns them with the seconds they took.
    /// `size`: train on this many samples instead of the step's batch:
    /// fewer (a fitted batch; the rest of the batch is skipped this epoch)
    /// or more (a grown one, [`WorkerBatches::grow_local`]).
    async fn compute(
        &self,
        step: u64,
        batches: &mut WorkerBatches,
        momentum: &mut Option<Vec<f32>>,
        size: Option<usize>,
    ) -> anyhow::Result<(Gradients, f64)> {
        let mut indices = batches.local_for_step(step)?;
        let nominal = indices.len();
        match size {
            Some(n) if n < nominal => indices.truncate(n.max(1)),
            Some(n) if n > nominal => batches.grow_local(step, &mut indices, n)?,
            _ => {}
        }
        if indices.len() != nominal {
            self.status.record(StatusEvent::FittedBatch { samples: indices.len(), nominal });
        }
        let started = Instant::now();
        let factored = self.config.compression.push == PushCompression::Sfb;
        let slow = self.faults.slowdown() > 1.0;
        let mut g =
            self.trainer.gradients(indices, factored, slow).await.with_context(|| format!("step {step}: gradients"))?;
        if let Some(m) = momentum.as_mut() {
            // Push the moving average of the gradients (worker momentum).
            let b = self.config.aggregation.worker_momentum;
            if m.is_empty() {
                m.extend_from_slice(&g.grads);
            } else {
                m.iter_mut().zip(&g.grads).for_each(|(m, x)| *m = b * *m + (1.0 - b) * x);
            }
            g.grads.copy_from_slice(m);
        }
        // Fault injection: this node plays a bad peer (none by default).
        self.faults.corrupt(self.config.faults.byzantine, step, &mut g.grads);
        if slow {
            // Fault injection: this node plays a slower machine. What is
            // stretched is the trainer thread's CPU time where it is known,
            // not the time it waited for a core that other nodes on this
            // host held (a slower machine of its own would not wait for
            // them); else the wall time.
            let wall = started.elapsed().saturating_sub(Duration::from_secs_f64(g.load_secs));
            self.faults.stretch_compute(g.cpu_time.unwrap_or(wall)).await;
        }
        // The parameters the trainer loaded first are the last step's load.
        let secs = (started.elapsed().as_secs_f64() - g.load_secs).max(0.0);
        Ok((g, secs))
    }

    /// The other training workers' paces, from their heartbeats (those
    /// that have stepped and are not done): their compute time per step is
    /// step time less communication.
    fn others_paces(&self, view: &watch::Receiver<ViewSnapshot>, steps: u64) -> Vec<shoal_protocol::Pace> {
        let v = view.borrow();
        let timeout = self.config.cluster.failure_timeout_ms;
        v.view
            .live(v.now_ms, timeout)
            .into_iter()
            .map(|p| &p.heartbeat)
            .filter(|hb| {
                hb.peer != self.me
                    && matches!(hb.role, Role::Worker | Role::Aggregator)
                    && hb.step < steps
                    && hb.pace.step_micros > 0
            })
            .map(|hb| hb.pace)
            .collect()
    }

    /// After an exchange of every shard: the residuals' memory to status,
    /// and (elastic roles) this worker's view of its owners' service times
    /// to membership, at most once per heartbeat: peers read the report
    /// once per heartbeat, and each refresh wakes this node's election.
    ///
    /// Sooner (at most four times a heartbeat) when the owners this report
    /// alone would demote change ([`would_demote`]), and then published at
    /// once, not at the next heartbeat: a slow owner keeps its shards until
    /// most reports about it say so.
    fn after_exchange(&self, step: u64, feedback: &ErrorFeedback, last: &mut ReportClock) {
        if self.config.compression.push.is_lossy() {
            self.status.record(StatusEvent::ResidualBytes(feedback.bytes()));
        }
        if !self.config.roles.elastic {
            return;
        }
        let heartbeat = Duration::from_millis(self.config.cluster.heartbeat_ms);
        let since = last.at.map(|t| t.elapsed());
        let due = since.is_none_or(|e| e >= heartbeat);
        if !due && since.is_some_and(|e| e < heartbeat / 4) {
            return;
        }
        let forget = self.config.roles.service_forget_steps;
        let report = self.service.lock().map(|mut t| t.report(step, forget)).unwrap_or_default();
        let demoting = would_demote(self.me, &report, &last.demoting, last.health);
        let urgent = demoting != last.demoting;
        if !due && !urgent {
            return;
        }
        if urgent {
            debug!(step, owners = ?demoting.iter().map(short).collect::<Vec<_>>(), "service report: publishing at once");
        }
        (last.at, last.demoting) = (Some(Instant::now()), demoting);
        self.membership.set_self(|me| {
            me.service = report;
            if urgent {
                me.announce += 1;
            }
        });
        self.probe_stragglers(step);
    }

    /// Probe each owner the placement keeps out as a straggler (at most one
    /// probe on the wire per owner), so the reports about it stay fresh
    /// while nobody pushes to it. The probe runs beside training; its answer
    /// is timed as a push of its size would be.
    fn probe_stragglers(&self, step: u64) {
        let Some(placement) = self.placement.borrow().clone() else { return };
        let mut stragglers = placement.stragglers.iter().filter(|p| **p != self.me).peekable();
        if stragglers.peek().is_none() {
            return;
        }
        let Some(bytes) = self.service.lock().ok().and_then(|t| t.probe_bytes()) else { return };
        // One padding for every probe of this heartbeat.
        let padding = match Payload::encode(&vec![0.0f32; (bytes / 4) as usize], Encoding::F32) {
            Ok(p) => p,
            Err(e) => return warn!(error = %e, "cannot build a probe"),
        };
        let sent_bytes = padding.byte_len();
        for &owner in stragglers {
            if !self.service.lock().is_ok_and(|mut t| t.begin_probe(owner)) {
                continue;
            }
            let req = ShardRequest::Probe(Probe { run: self.run.clone(), padding: padding.clone() });
            let (net, service, faults) = (self.net.clone(), self.service.clone(), self.faults.clone());
            self.tasks.spawn(async move {
                let sent = Instant::now();
                hold(faults.send_delay(sent_bytes)).await;
                let answered = match timed_request(&net, owner, req).await {
                    Ok((ShardResponse::Probed { .. }, reported)) => {
                        Some((sent_bytes, service_micros(&net, owner, sent.elapsed(), reported)))
                    }
                    Ok((other, _)) => {
                        debug!(%owner, answer = other.kind(), "probe not answered");
                        None
                    }
                    Err(e) => {
                        debug!(%owner, error = %e, "probe failed");
                        None
                    }
                };
                if let Ok(mut t) = service.lock() {
                    t.end_probe(owner, answered, step);
                }
            });
        }
    }

    /// Resuming after a full stop: pull every shard at its resume version
    /// from its owner (who installed it from a checkpoint, its own or a
    /// peer's), following the placement, until `within` passes. Returns the
    /// full model and the version each shard was fetched at.
    pub async fn fetch_model(&self, versions: &[u64], within: Duration) -> anyhow::Result<(Vec<f32>, Vec<u64>)> {
        let deadline = Instant::now() + within;
        let fetches = self.plan.shards().iter().map(|shard| async move {
            let id = shard.id;
            let want = versions.get(id as usize).copied().unwrap_or(0);
            let mut placement = self.placement.clone();
            let mut backoff = placement_backoff();
            let mut last = String::from("no attempt");
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    bail!("shard {id}: not fetched at version {want} within {} ms; last: {last}", within.as_millis());
                }
                let owner = placement.borrow_and_update().clone().and_then(|p| p.owner(id));
                let Some(owner) = owner else {
                    last = "no placement yet".into();
                    wait_for_change(&mut placement, &mut backoff).await;
                    continue;
                };
                match self.pull_from(owner, id, want, left, None).await {
                    Ok(PullReply::State { version, params }) if params.len() == shard.len() => {
                        return Ok::<_, anyhow::Error>((version, params))
                    }
                    Ok(PullReply::State { params, .. }) => {
                        bail!("shard {id}: owner sent {} values, expected {}", params.len(), shard.len())
                    }
                    Ok(PullReply::Delta(_)) => {
                        last = format!("{owner} sent an update where the whole shard was asked for");
                        wait_for_change(&mut placement, &mut backoff).await;
                    }
                    Ok(PullReply::NotReady { current_version }) => {
                        last = format!("{owner} at version {current_version}");
                    }
                    Ok(PullReply::NotOwner { .. }) => {
                        last = format!("{owner} does not own it");
                        wait_for_change(&mut placement, &mut backoff).await;
                    }
                    Err(e) => {
                        last = format!("pull from {owner}: {e:#}");
                        wait_for_change(&mut placement, &mut backoff).await;
                    }
                }
            }
        });
        let mut params = vec![0.0; self.plan.total_len()];
        let mut fetched = vec![0; self.plan.len()];
        for (shard, (version, values)) in self.plan.shards().iter().zip(try_join_all(fetches).await?) {
            params[shard.range()].copy_from_slice(&values);
            fetched[shard.id as usize] = version;
        }
        Ok((params, fetched))
    }

    /// Exchange every shard (push the gradient, pull the new version)
    /// concurrently. Returns the smallest shard version (the model version).
    /// With a lossy push encoding, each shard's gradient is encoded once,
    /// with its error feedback, before any push: every attempt sends the
    /// same payload, and a local owner gets what it decodes to. With
    /// `sfb`, each shard's payload carries the fully connected layers'
    /// factors where they are smaller, and a local owner gets the exact
    /// gradient. `pushed`: the samples, the gradient, and its factors.
    ///
    /// `exchanged_before`: an exchange has completed before (set here once
    /// this one has). Without one, this is the worker's first since it
    /// started: its model came from donors or a checkpoint, and can be a
    /// round old on some shards and current on others, so a push that
    /// missed its round is dropped and the current version pulled (as
    /// always with backup workers), not given to the round in progress
    /// (`ShardExchange`): that put it a round ahead on those shards and in
    /// step on the rest, and two joiners that way waited on each other
    /// until the round timeout (the schedule explorer's finding 4).
    async fn exchange_all(
        &self,
        step: u64,
        exchanged_before: &mut bool,
        versions: &mut [u64],
        pushed: (u32, &[f32], &[LayerFactors]),
        params: &mut [f32],
        feedback: &mut ErrorFeedback,
    ) -> anyhow::Result<u64> {
        let (samples, grads, factors) = pushed;
        let outgoing = self.outgoing(step, versions, grads, factors, feedback)?;
        let drop_stale = self.backup_mode() || !*exchanged_before;
        let (batches, mut firsts) = self.batches();
        let batched = batches.into_iter().map(|(owner, idx, outcomes)| {
            let shards = self.plan.shards();
            let items =
                idx.iter().map(|&i| (shards[i].id, versions[shards[i].id as usize], &outgoing[i])).collect::<Vec<_>>();
            self.push_pull_many(owner, step, samples, items, outcomes)
        });
        let exchanges = self.plan.shards().iter().zip(&outgoing).zip(firsts.iter_mut()).map(|((shard, out), first)| {
            let id = shard.id;
            self.exchange(id, step, versions[id as usize], samples, out, drop_stale, first.take()).inspect(move |r| {
                if let Ok(e) = r {
                    self.hold(id, e.version);
                }
            })
        });
        // Together: a batched shard's exchange waits for its batch's answer,
        // and the owners answer only once every worker's pushes (this one's
        // to its own shards too) are in. A failed exchange ends the step at
        // once (the batches still on the wire are dropped).
        let batched = async {
            futures::future::join_all(batched).await;
            Ok::<(), anyhow::Error>(())
        };
        let ((), mut results) = futures::try_join!(batched, try_join_all(exchanges))?;
        if self.backup_mode() {
            self.align_versions(&mut results).await?;
        }
        let mut dropped_len = 0usize;
        for (shard, Exchanged { mut version, params: values, dropped }) in self.plan.shards().iter().zip(results) {
            if dropped {
                dropped_len += shard.len();
            }
            if values.len() != shard.len() as u64 {
                bail!("shard {}: owner sent {} values, expected {}", shard.id, values.len(), shard.len());
            }
            let before = versions[shard.id as usize];
            let fits = values
                .write_into(&mut params[shard.range()], before)
                .with_context(|| format!("step {step}: shard {}", shard.id))?;
            if !fits {
                // An update that does not lead to the owner's bits from
                // this copy: the whole shard, exact, replaces it.
                self.status.record(StatusEvent::DeltaMismatch);
                warn!(
                    shard = shard.id,
                    version,
                    held = before,
                    "a delta pull did not match the owner's shard; pulling it whole"
                );
                let (v, whole) = self.pull_at_least(shard.id, version).await?;
                if whole.len() != shard.len() {
                    bail!("shard {}: owner sent {} values, expected {}", shard.id, whole.len(), shard.len());
                }
                params[shard.range()].copy_from_slice(&whole);
                version = v;
            }
            if version < before {
                self.status.record(StatusEvent::VersionRegression(before - version));
            }
            versions[shard.id as usize] = version;
        }
        if dropped_len > 0 {
            // The step's samples, in the share of the model whose pushes were dropped.
            let share = dropped_len as f64 / self.plan.total_len().max(1) as f64;
            self.status.record(StatusEvent::DroppedPushes { samples: f64::from(samples) * share });
        }
        *exchanged_before = true;
        self.membership.set_self(|me| me.shard_versions = versions.to_vec());
        Ok(versions.iter().copied().min().unwrap_or(0))
    }

    /// Each shard's part of the step's gradient as it goes out: whole,
    /// factored (SFB) or compressed with error feedback, and with delta
    /// pulls the version this worker holds.
    fn outgoing<'a>(
        &self,
        step: u64,
        versions: &[u64],
        grads: &'a [f32],
        factors: &[LayerFactors],
        feedback: &mut ErrorFeedback,
    ) -> anyhow::Result<Vec<Outgoing<'a>>> {
        let parts = self.plan.split(grads)?;
        let push = self.config.compression.push;
        let delta = self.config.delta_pulls().is_some();
        self.plan
            .shards()
            .iter()
            .zip(parts)
            .map(|(shard, slice)| {
                let have = delta.then(|| versions[shard.id as usize]);
                if push == PushCompression::Sfb && !factors.is_empty() {
                    let p = factored_push(shard.range(), slice, factors)
                        .with_context(|| format!("step {step}: factoring shard {}", shard.id))?;
                    return Ok(Outgoing { values: std::borrow::Cow::Borrowed(slice), payload: Some(p), have });
                }
                if !push.is_lossy() {
                    return Ok(Outgoing { values: std::borrow::Cow::Borrowed(slice), payload: None, have });
                }
                let c = feedback
                    .compress(shard.id as usize, slice, push.encoding(slice.len()))
                    .with_context(|| format!("step {step}: encoding shard {} as {push}", shard.id))?;
                Ok(Outgoing { values: std::borrow::Cow::Owned(c.values), payload: Some(c.payload), have })
            })
            .collect()
    }

    /// `shard`'s exchange of this step ended at `version`: this node's
    /// heartbeat says so from its next beat on, before the step's other
    /// shards are in. An owner restored from an older copy takes up the
    /// newest version a live worker holds; the worker that got the lost
    /// owner's last round of one shard may be waiting for another shard,
    /// and pushes nothing that would tell it (the schedule explorer's
    /// finding 3).
    fn hold(&self, shard: u32, version: u64) {
        let shards = self.plan.len();
        self.membership.set_self(|me| {
            me.shard_versions.resize(shards, 0);
            if let Some(v) = me.shard_versions.get_mut(shard as usize) {
                *v = version;
            }
        });
    }

    /// Backup workers: rounds close without the slowest workers, so the
    /// versions a step pulled can differ by a round from shard to shard (a
    /// dropped push pulled the version then current; a round can close
    /// again before a late pull is answered). The shards behind are pulled
    /// again at the newest version until all agree, so the next step trains
    /// on one round's model and pushes to one round everywhere. Pushes a
    /// round apart would, at the end of the run, open rounds past its last.
    async fn align_versions(&self, results: &mut [Exchanged]) -> anyhow::Result<()> {
        // Each pass can find a newer round only if one closed meanwhile;
        // rounds close at the workers' pace, so a few passes settle it.
        for _ in 0..ALIGN_PASSES {
            let top = results.iter().map(|r| r.version).max().unwrap_or(0);
            if results.iter().all(|r| r.version == top) {
                return Ok(());
            }
            let behind: Vec<usize> = (0..results.len()).filter(|&i| results[i].version < top).collect();
            let shards = self.plan.shards();
            let pulled = try_join_all(behind.iter().map(|&i| self.pull_at_least(shards[i].id, top))).await?;
            for (i, (version, params)) in behind.into_iter().zip(pulled) {
                results[i].version = version;
                results[i].params = Values::Decoded(params);
            }
        }
        let versions: Vec<u64> = results.iter().map(|r| r.version).collect();
        bail!("shard versions {versions:?} still differ after {ALIGN_PASSES} pulls at the newest (backup workers)")
    }

    /// Pull `shard` at `min_version` or later from whoever owns it.
    async fn pull_at_least(&self, shard: u32, min_version: u64) -> anyhow::Result<(u64, Arc<Vec<f32>>)> {
        let deadline = Instant::now() + self.request_timeout();
        let mut placement = self.placement.clone();
        let mut backoff = placement_backoff();
        let mut hint: Option<PeerId> = None;
        let mut last = String::from("no attempt");
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!("shard {shard}: no owner served version {min_version} within the request timeout; last: {last}");
            }
            let owner = next_owner(shard, &mut hint, &mut placement)?;
            match self.pull_from(owner, shard, min_version, left, None).await {
                Ok(PullReply::State { version, params }) => return Ok((version, params)),
                Ok(PullReply::Delta(_)) => last = format!("{owner} sent an update where the whole shard was asked for"),
                Ok(PullReply::NotReady { current_version }) => {
                    last = format!("{owner} still at version {current_version}");
                }
                Ok(PullReply::NotOwner { hint: h, .. }) => {
                    last = format!("{owner} no longer owns it");
                    follow_hint(owner, h, &mut hint, &mut placement, &mut backoff).await;
                }
                Err(e) => {
                    last = format!("pull from {owner}: {e:#}");
                    wait_for_change(&mut placement, &mut backoff).await;
                }
            }
        }
    }

    /// Push one shard's gradient to its owner and pull the shard's next
    /// version, following the shard wherever the placement moves it: the
    /// I/O of the pure [`ShardExchange`] machine, which decides each next
    /// action (and documents why a BSP gradient may be pushed twice).
    /// `drop_stale`: see [`Worker::exchange_all`].
    #[allow(clippy::too_many_arguments)]
    async fn exchange(
        &self,
        shard: u32,
        step: u64,
        base: u64,
        samples: u32,
        grad: &Outgoing<'_>,
        drop_stale: bool,
        mut first: Option<FirstAttempt>,
    ) -> anyhow::Result<Exchanged> {
        let started = Instant::now();
        let timeout = self.request_timeout();
        let deadline = started + timeout;
        let mut placement = self.placement.clone();
        let batched = first.as_ref().map(|f| f.owner);
        let mut machine =
            ShardExchange::new(shard, base, self.policy(), drop_stale, timeout, batched, placement_backoff());
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let action = machine.next(left, || placement.borrow_and_update().clone().and_then(|p| p.owner(shard)));
            match action {
                ExchangeAction::Push { owner, base } => {
                    let answer = match first.take() {
                        // The machine's first push is the one that went in the batch.
                        Some(f) => match f.outcome.await {
                            Ok(outcome) => outcome,
                            // The batch went away unanswered: push alone.
                            Err(_) => self.push_alone(owner, shard, base, step, samples, grad, left).await,
                        },
                        None => self.push_alone(owner, shard, base, step, samples, grad, left).await,
                    };
                    let answer = push_answer(answer);
                    if !matches!(answer, PushAnswer::Served { .. } | PushAnswer::Accepted { .. }) {
                        debug!(shard, step, base, %owner, answer = %answer.describe(), "push answered");
                    }
                    machine.on_push(owner, answer);
                }
                ExchangeAction::Pull { owner, min_version, after_push } => {
                    if after_push {
                        self.status.record(StatusEvent::PushLatency(started.elapsed().as_secs_f64() * 1e3));
                    }
                    let left = deadline.saturating_duration_since(Instant::now());
                    let answer = match self.pull_from(owner, shard, min_version, left, grad.have).await {
                        Ok(PullReply::State { version, params }) => {
                            PullAnswer::State { version, params: Values::Decoded(params) }
                        }
                        Ok(PullReply::Delta(d)) => PullAnswer::State { version: d.version, params: Values::Delta(d) },
                        Ok(PullReply::NotReady { current_version }) => PullAnswer::NotReady { current_version },
                        Ok(PullReply::NotOwner { hint, .. }) => PullAnswer::NotOwner { hint },
                        Err(e) => PullAnswer::Failed(format!("{e:#}")),
                    };
                    if !matches!(answer, PullAnswer::State { .. }) {
                        debug!(shard, step, min_version, %owner, answer = %answer.describe(), "pull answered");
                    }
                    machine.on_pull(owner, answer);
                }
                ExchangeAction::WaitForChange(at_most) => {
                    let _ = tokio::time::timeout(at_most, placement.changed()).await;
                }
                ExchangeAction::Done(x) => {
                    self.status.record(StatusEvent::PullLatency(started.elapsed().as_secs_f64() * 1e3));
                    return Ok(x);
                }
                ExchangeAction::GiveUp(why) => bail!("{why}"),
            }
        }
    }

    /// One push attempt of a shard on its own: a `PushPull` to a remote
    /// owner (`cluster.push_pull`), else a `PushGrad` or the local push.
    #[allow(clippy::too_many_arguments)]
    async fn push_alone(
        &self,
        owner: PeerId,
        shard: u32,
        base: u64,
        step: u64,
        samples: u32,
        grad: &Outgoing<'_>,
        left: Duration,
    ) -> anyhow::Result<Pushed> {
        if self.config.cluster.push_pull && owner != self.me {
            self.push_pull_to(owner, shard, base, step, samples, grad, left).await
        } else {
            self.push_to(owner, shard, base, step, samples, grad).await.map(Pushed::Reply)
        }
    }

    /// One push attempt, to the local aggregator or over the network. Remote
    /// answers are timed for the straggler detector.
    async fn push_to(
        &self,
        owner: PeerId,
        shard: u32,
        base: u64,
        step: u64,
        samples: u32,
        grad: &Outgoing<'_>,
    ) -> anyhow::Result<PushReply> {
        if owner == self.me {
            // A sparse push goes as its kept entries, as it would arrive.
            let contribution = match &grad.payload {
                Some(p) if p.stored() < p.numel() => Contribution::decode(p)?,
                _ => grad.values.to_vec().into(),
            };
            return self.aggregator.push(self.me, shard, base, samples, contribution).await;
        }
        let push = self.push_grad(shard, base, step, samples, grad)?;
        let bytes = push.grad.byte_len();
        let req = ShardRequest::PushGrad(push);
        let sent = Instant::now();
        hold(self.faults.send_delay(bytes)).await;
        let (resp, reported) = timed_request(&self.net, owner, req).await?;
        let reply = self.push_reply(owner, shard, resp)?;
        if matches!(reply, PushReply::NotOwner { .. } | PushReply::Pending) {
            // Not served: nothing to time.
            return Ok(reply);
        }
        self.moved(bytes, 0);
        let round_trip = sent.elapsed();
        self.timed_link(bytes, round_trip);
        self.time_service(owner, bytes, round_trip, reported, step);
        Ok(reply)
    }

    /// The wire form of this worker's gradient for one shard: the payload
    /// encoded with its error feedback, or f32.
    fn push_grad(
        &self,
        shard: u32,
        base: u64,
        step: u64,
        samples: u32,
        grad: &Outgoing<'_>,
    ) -> anyhow::Result<PushGrad> {
        let payload = match &grad.payload {
            Some(p) => p.clone(),
            None => Payload::encode(&grad.values, Encoding::F32)?,
        };
        Ok(PushGrad {
            run: self.run.clone(),
            shard,
            epoch: 0,
            base_version: base,
            worker: self.me,
            incarnation: self.incarnation,
            step,
            samples: samples.max(1),
            grad: payload,
        })
    }

    /// What a remote owner's answer to a push means.
    fn push_reply(&self, owner: PeerId, shard: u32, resp: ShardResponse) -> anyhow::Result<PushReply> {
        Ok(match resp {
            ShardResponse::Accepted(a) => PushReply::Accepted { version: a.version, staleness: a.staleness },
            ShardResponse::Stale { current_version, max_staleness, .. } => {
                PushReply::Stale { current_version, max_staleness }
            }
            ShardResponse::NotOwner { epoch, hint, .. } => PushReply::NotOwner { epoch, hint },
            ShardResponse::Fenced { .. } => PushReply::UnknownWorker,
            ShardResponse::Error(e) if e.code == shoal_protocol::ErrorCode::Busy => PushReply::Pending,
            ShardResponse::Error(e) => bail!("{owner} refused a push: {:?}: {}", e.code, e.message),
            other => bail!("shard {shard}: owner {owner} answered a push with {}", other.kind()),
        })
    }

    /// One push to a remote owner that brings back the shard's next version
    /// in the same exchange (`PushPull`). An owner that did not have that
    /// version within the wait (or lost the shard after taking the
    /// gradient) answers that the gradient was accepted, and the caller
    /// pulls as after a plain push.
    #[allow(clippy::too_many_arguments)]
    async fn push_pull_to(
        &self,
        owner: PeerId,
        shard: u32,
        base: u64,
        step: u64,
        samples: u32,
        grad: &Outgoing<'_>,
        left: Duration,
    ) -> anyhow::Result<Pushed> {
        let push = self.push_grad(shard, base, step, samples, grad)?;
        let bytes = push.grad.byte_len();
        let req = ShardRequest::PushPull(PushPull {
            push,
            max_wait_ms: self.max_wait_ms(left),
            encoding: self.pull_encoding(),
            have: grad.have,
        });
        let sent = Instant::now();
        hold(self.faults.send_delay(bytes)).await;
        let (resp, reported) = timed_request(&self.net, owner, req).await?;
        let mut received = 0;
        let (reply, held_ms) = match resp {
            ShardResponse::Exchanged(x) => {
                let held = x.held_ms;
                received = x.state_bytes();
                if received > 0 {
                    hold(self.faults.receive_delay(received)).await;
                    self.moved(0, received);
                }
                (exchanged(x, owner)?, held)
            }
            other => match self.push_reply(owner, shard, other)? {
                // Not served: nothing to time (as after a plain push).
                r @ (PushReply::NotOwner { .. } | PushReply::Pending) => return Ok(Pushed::Reply(r)),
                r => (Pushed::Reply(r), 0),
            },
        };
        self.moved(bytes, 0);
        // The round trip less the time the owner held the answer for the
        // round (which is the slowest worker's, not its own).
        let round_trip = sent.elapsed().saturating_sub(Duration::from_millis(held_ms.into()));
        if matches!(reply, Pushed::State { .. }) {
            // (Otherwise the caller records the push as after a plain one.)
            self.status.record(StatusEvent::PushLatency(round_trip.as_secs_f64() * 1e3));
        }
        self.timed_link(bytes + received, round_trip);
        self.time_service(owner, bytes, round_trip, reported, step);
        Ok(reply)
    }

    /// The remote owners of two or more of this worker's shards in the
    /// current placement, each with the shards (indices into the plan) to
    /// send it in one `PushPullMany`, and each shard's [`FirstAttempt`]
    /// (`None` for the shards pushed alone).
    #[allow(clippy::type_complexity)]
    fn batches(
        &self,
    ) -> (Vec<(PeerId, Vec<usize>, Vec<tokio::sync::oneshot::Sender<BatchOutcome>>)>, Vec<Option<FirstAttempt>>) {
        let shards = self.plan.shards();
        let mut firsts: Vec<Option<FirstAttempt>> = shards.iter().map(|_| None).collect();
        let c = &self.config.cluster;
        let Some(placement) = self.placement.borrow().clone() else { return (Vec::new(), firsts) };
        if !(c.push_pull && c.push_pull_many) {
            return (Vec::new(), firsts);
        }
        let mut by_owner: std::collections::BTreeMap<PeerId, Vec<usize>> = Default::default();
        for (i, shard) in shards.iter().enumerate() {
            if let Some(owner) = placement.owner(shard.id) {
                if owner != self.me {
                    by_owner.entry(owner).or_default().push(i);
                }
            }
        }
        // Each batch and its answer must fit in one message: at most
        // `MAX_BATCH_SHARDS` shards, and f32 bytes (the most a push or a
        // pull of a shard carries) under the smaller message limit, less 1
        // MiB for headers. An answer too large to send would come back as
        // a failed request after the owner had taken every gradient in it.
        let limits = &self.config.network.limits;
        let room = limits.max_request_bytes.min(limits.max_response_bytes).saturating_sub(1 << 20);
        let mut batches = Vec::new();
        for (owner, idx) in by_owner {
            let mut chunk: Vec<usize> = Vec::new();
            let mut bytes = 0u64;
            let mut chunks = Vec::new();
            for i in idx {
                let b = shards[i].len() as u64 * 4;
                if !chunk.is_empty() && (chunk.len() >= MAX_BATCH_SHARDS || bytes + b > room) {
                    chunks.push(std::mem::take(&mut chunk));
                    bytes = 0;
                }
                chunk.push(i);
                bytes += b;
            }
            chunks.push(chunk);
            for chunk in chunks.into_iter().filter(|c| c.len() >= 2) {
                let mut outcomes = Vec::with_capacity(chunk.len());
                for &i in &chunk {
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    firsts[i] = Some(FirstAttempt { owner, outcome: rx });
                    outcomes.push(tx);
                }
                batches.push((owner, chunk, outcomes));
            }
        }
        (batches, firsts)
    }

    /// The first push of several shards to one remote owner, in one
    /// `PushPullMany`: `items` are each shard's id, base version and
    /// gradient. Each shard's outcome goes to its exchange (`outcomes`, in
    /// the same order), which goes on from there as after a `PushPull` of
    /// its own. A failed request fails each shard's attempt (each retries
    /// alone).
    async fn push_pull_many(
        &self,
        owner: PeerId,
        step: u64,
        samples: u32,
        items: Vec<(u32, u64, &Outgoing<'_>)>,
        outcomes: Vec<tokio::sync::oneshot::Sender<BatchOutcome>>,
    ) {
        let answers = match self.push_pull_many_request(owner, step, samples, &items).await {
            Ok(answers) => answers,
            Err(e) => {
                let e = format!("{e:#}");
                items.iter().map(|_| Err(anyhow::anyhow!("{e}"))).collect()
            }
        };
        for (tx, outcome) in outcomes.into_iter().zip(answers) {
            // An exchange that has ended (its step failed) no longer listens.
            let _ = tx.send(outcome);
        }
    }

    async fn push_pull_many_request(
        &self,
        owner: PeerId,
        step: u64,
        samples: u32,
        items: &[(u32, u64, &Outgoing<'_>)],
    ) -> anyhow::Result<Vec<BatchOutcome>> {
        let mut pushes = Vec::with_capacity(items.len());
        for &(shard, base, grad) in items {
            pushes.push((self.push_grad(shard, base, step, samples, grad)?, grad.have));
        }
        let sizes: Vec<u64> = pushes.iter().map(|(p, _)| p.grad.byte_len()).collect();
        let bytes: u64 = sizes.iter().sum();
        let max_wait_ms = self.max_wait_ms(self.request_timeout());
        let encoding = self.pull_encoding();
        let req = ShardRequest::PushPullMany(
            pushes.into_iter().map(|(push, have)| PushPull { push, max_wait_ms, encoding, have }).collect(),
        );
        let sent = Instant::now();
        hold(self.faults.send_delay(bytes)).await;
        self.status.record(StatusEvent::Batched(items.len() as u64));
        let (answer, reported) = timed_request(&self.net, owner, req).await?;
        let answers = match answer {
            ShardResponse::ExchangedMany(v) if v.len() == items.len() => v,
            ShardResponse::ExchangedMany(v) => {
                bail!("{owner} answered {} of the {} shards of a batch", v.len(), items.len())
            }
            ShardResponse::Error(e) => bail!("{owner} refused a batch: {:?}: {}", e.code, e.message),
            other => bail!("{owner} answered a batch with {}", other.kind()),
        };
        let received: u64 = answers.iter().map(ShardResponse::state_bytes).sum();
        hold(self.faults.receive_delay(received)).await;
        let mut held_ms = 0u32;
        let mut served_bytes = 0u64;
        let mut any_state = false;
        let mut out = Vec::with_capacity(items.len());
        for ((&(shard, _, _), size), answer) in items.iter().zip(sizes).zip(answers) {
            let outcome = match answer {
                ShardResponse::Exchanged(x) if x.accepted.shard != shard => {
                    Err(anyhow::anyhow!("{owner} answered shard {} for shard {shard}", x.accepted.shard))
                }
                ShardResponse::Exchanged(x) => {
                    held_ms = held_ms.max(x.held_ms);
                    served_bytes += size;
                    any_state |= x.state.is_some();
                    exchanged(x, owner)
                }
                other => self.push_reply(owner, shard, other).map(Pushed::Reply),
            };
            out.push(outcome);
        }
        self.moved(bytes, received);
        // As for one `PushPull`: the round trip less the longest time the
        // owner held an answer for its round.
        let round_trip = sent.elapsed().saturating_sub(Duration::from_millis(held_ms.into()));
        if any_state {
            self.status.record(StatusEvent::PushLatency(round_trip.as_secs_f64() * 1e3));
        }
        if served_bytes > 0 {
            self.timed_link(bytes + received, round_trip);
            self.time_service(owner, served_bytes, round_trip, reported, step);
        }
        Ok(out)
    }

    /// Record `owner`'s service of `bytes` for the straggler detector (see
    /// [`service_micros`]; the path's latency comes off so that a request's
    /// fixed cost on a slow path is not counted per MiB against the owner).
    fn time_service(&self, owner: PeerId, bytes: u64, round_trip: Duration, reported: Option<Duration>, step: u64) {
        let micros = service_micros(&self.net, owner, round_trip, reported);
        if let Ok(mut t) = self.service.lock() {
            t.observe(owner, bytes, micros, step);
        }
    }

    /// One exchange with a remote owner for the link rate: counted in this
    /// step's rate and in /status.
    fn timed_link(&self, bytes: u64, took: Duration) {
        self.link.add(bytes, took);
        self.status.record(StatusEvent::Link { bytes, secs: took.as_secs_f64() });
    }

    /// Shard bytes sent (`out`) and received (`r#in`): counted in /status.
    fn moved(&self, out: u64, r#in: u64) {
        self.status.record(StatusEvent::Bytes { out, r#in });
    }

    /// The encoding this worker asks its pulls in (`compression.pull`).
    fn pull_encoding(&self) -> Encoding {
        self.config.compression.pull.encoding()
    }

    /// How long an owner may hold a pull: what is left of the deadline,
    /// capped by the owners' `response_wait_ms` (they refuse longer waits).
    fn max_wait_ms(&self, left: Duration) -> u32 {
        left.as_millis().min(self.config.network.timeouts.response_wait_ms as u128).min(u32::MAX as u128) as u32
    }

    /// One pull attempt; the owner may hold it up to `left` (capped by its
    /// `response_wait_ms`).
    async fn pull_from(
        &self,
        owner: PeerId,
        shard: u32,
        min_version: u64,
        left: Duration,
        have: Option<u64>,
    ) -> anyhow::Result<PullReply> {
        if owner == self.me {
            // The local owner's shard is shared, not sent: no update needed.
            return self.aggregator.pull(self.me, shard, min_version, left).await;
        }
        let req = ShardRequest::PullShard(PullShard {
            run: self.run.clone(),
            shard,
            min_version,
            // Owners refuse waits longer than their response_wait_ms.
            max_wait_ms: self.max_wait_ms(left),
            encoding: self.pull_encoding(),
            have,
        });
        hold(self.faults.send_delay(0)).await;
        Ok(match self.net.request(owner, req).await? {
            ShardResponse::ShardState(s) => {
                hold(self.faults.receive_delay(s.params.byte_len())).await;
                self.moved(0, s.params.byte_len());
                if s.delta.is_some() {
                    PullReply::Delta(received_delta(s, owner)?)
                } else {
                    PullReply::State { version: s.version, params: Arc::new(s.params.decode()?) }
                }
            }
            ShardResponse::NotReady { current_version, .. } => PullReply::NotReady { current_version },
            ShardResponse::NotOwner { epoch, hint, .. } => PullReply::NotOwner { epoch, hint },
            ShardResponse::Error(e) if e.code == shoal_protocol::ErrorCode::Busy => {
                bail!("{owner} is busy: {}", e.message)
            }
            ShardResponse::Error(e) => bail!("{owner} refused a pull: {:?}: {}", e.code, e.message),
            other => bail!("shard {shard}: owner {owner} answered a pull with {}", other.kind()),
        })
    }

    /// Send a request, retrying transport failures and `Busy` with capped
    /// exponential back-off (20 ms doubling to 1 s, with jitter) until
    /// `deadline`.
    async fn request_with_retry(
        &self,
        peer: PeerId,
        req: ShardRequest,
        deadline: Instant,
    ) -> anyhow::Result<ShardResponse> {
        let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_secs(1));
        loop {
            let last_err = match self.net.request(peer, req.clone()).await {
                Ok(ShardResponse::Error(e)) if e.code == shoal_protocol::ErrorCode::Busy => {
                    format!("busy: {}", e.message)
                }
                Ok(ShardResponse::Error(e)) => bail!("{peer} refused {}: {:?}: {}", req.kind(), e.code, e.message),
                Ok(resp) => return Ok(resp),
                Err(NetError::Stopped) => bail!("network actor stopped"),
                Err(e) => e.to_string(),
            };
            let Some(delay) = backoff.next_within(deadline.saturating_duration_since(Instant::now())) else {
                bail!("{} to {peer} kept failing until the deadline: {last_err}", req.kind());
            };
            debug!(%peer, error = %last_err, "retrying");
            // Back-off between retries of a failed request, not synchronisation.
            tokio::time::sleep(delay).await;
        }
    }

    /// Gossip mode: average each shard with one randomly chosen peer's copy.
    async fn gossip_average(&self, routing: &Routing, step: u64, params: &mut [f32]) -> anyhow::Result<()> {
        use rand::seq::IndexedRandom;
        let others: Vec<PeerId> = routing.roster.peers().into_iter().filter(|p| *p != self.me).collect();
        if others.is_empty() {
            return Ok(());
        }
        let picks: Vec<PeerId> = {
            let mut rng = rand::rng();
            (0..self.plan.len()).filter_map(|_| others.choose(&mut rng).copied()).collect()
        };
        let deadline = Instant::now() + self.request_timeout();
        // A copy more than GOSSIP_MAX_BEHIND periods behind this node's
        // (a peer that started late or computes far slower) is not
        // averaged in: the peer answers NotReady and this round skips it.
        // The lagging peer still averages with this node's copy, which is
        // ahead, and so catches up.
        let min_version = (step + 1).saturating_sub(GOSSIP_MAX_BEHIND * self.config.gossip().every);
        let fetches = self.plan.shards().iter().zip(&picks).map(|(shard, &peer)| {
            let req = ShardRequest::StateSync(StateSync { run: self.run.clone(), shard: shard.id, min_version });
            async move {
                match self.request_with_retry(peer, req, deadline).await? {
                    ShardResponse::ShardState(s) => Ok::<_, anyhow::Error>(Some(s.params.decode()?)),
                    // The peer has not published a model yet, or its copy
                    // is too far behind: skip this round.
                    ShardResponse::NotReady { .. } => Ok(None),
                    other => bail!("gossip with {peer}: unexpected {}", other.kind()),
                }
            }
        });
        let copies = try_join_all(fetches).await?;
        let (mut diff2, mut norm2) = (0.0f64, 0.0f64);
        for (shard, copy) in self.plan.shards().iter().zip(&copies) {
            let Some(copy) = copy else { continue };
            for (p, q) in params[shard.range()].iter().zip(copy) {
                diff2 += ((p - q) as f64).powi(2);
                norm2 += (*p as f64).powi(2);
            }
        }
        if norm2 > 0.0 {
            self.status.record(StatusEvent::GossipDistance((diff2 / norm2).sqrt() as f32));
        }
        for (shard, copy) in self.plan.shards().iter().zip(copies) {
            let Some(copy) = copy else { continue };
            if copy.len() != shard.len() {
                bail!("gossip: shard {} has {} values, expected {}", shard.id, copy.len(), shard.len());
            }
            for (p, q) in params[shard.range()].iter_mut().zip(&copy) {
                *p = 0.5 * (*p + q);
            }
        }
        debug!(step, "gossip averaged");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_batches_match_a_fresh_computation_across_epochs() -> anyhow::Result<()> {
        // 100 samples, rank 1 of 3 -> 33 samples, batch 8 -> 5 batches per epoch.
        let mut cached = WorkerBatches::new(100, 1, 3, 8, 7)?;
        let mut seen = Vec::new();
        for step in 0..12 {
            let b = cached.for_step(step)?;
            assert_eq!(b, batch_for_step(100, 1, 3, 8, 7, step)?, "step {step}");
            assert!(b.iter().all(|i| i % 3 == 1), "rank 1 takes i % 3 == 1");
            // The trainer holds only the partition: the batch as positions
            // in it names the same samples.
            let local = cached.local_for_step(step)?;
            assert_eq!(local.iter().map(|&k| cached.rows()[k]).collect::<Vec<_>>(), b, "step {step}");
            assert!(local.iter().all(|&k| k < 34));
            seen.push(b);
        }
        assert_ne!(seen[0], seen[5], "the next epoch is reshuffled");
        assert!(WorkerBatches::new(2, 2, 3, 8, 7).is_err(), "an empty partition is an error");
        Ok(())
    }

    /// Shard 3's round 7 taken, its version 8 sent back as `params` (the
    /// update from `delta`'s base, if any).
    fn round_7_answer(params: Payload, delta: Option<shoal_protocol::DeltaOf>) -> shoal_protocol::Exchanged {
        shoal_protocol::Exchanged {
            accepted: shoal_protocol::Accepted { shard: 3, version: 7, staleness: 0 },
            state: Some(shoal_protocol::ShardState {
                run: RunId::default(),
                shard: 3,
                version: 8,
                epoch: 0,
                params,
                delta,
            }),
            held_ms: 0,
        }
    }

    #[test]
    fn wire_values_land_in_their_range_and_bad_ones_fail_on_arrival() -> anyhow::Result<()> {
        let from = PeerId::random();
        let values: Vec<f32> = (0..300).map(|i| i as f32 * 0.25 - 7.0).collect();
        let answer = |params| round_7_answer(params, None);
        for encoding in [Encoding::F32, Encoding::Bf16] {
            let payload = Payload::encode(&values, encoding)?;
            let expect = payload.decode()?;
            let Pushed::State { version, params } = exchanged(answer(payload), from)? else { panic!("no state") };
            assert_eq!((version, params.len()), (8, 300));
            let mut flat = vec![-1.0f32; 500];
            assert!(params.write_into(&mut flat[100..400], 7)?);
            assert_eq!(&flat[100..400], &expect[..], "{encoding:?}");
            assert!(flat[..100].iter().chain(&flat[400..]).all(|&x| x == -1.0), "{encoding:?}: outside its range");
        }
        // A body that does not match its checksum fails on arrival.
        let good = Payload::encode(&values, Encoding::F32)?;
        let mut body = good.data().to_vec();
        body[17] ^= 0x40;
        let bad = Payload::from_parts(good.meta().clone(), body.into(), u64::MAX)?;
        let err = exchanged(answer(bad), from).err().map(|e| format!("{e:#}")).unwrap_or_default();
        assert!(err.contains("shard 3") && err.contains("checksum"), "{err}");
        Ok(())
    }

    /// A delta answer is added to the copy of its base; from another
    /// version, or to a copy that is not the owner's, it does not fit.
    #[test]
    fn a_delta_is_added_to_its_base_and_checked_by_its_hash() -> anyhow::Result<()> {
        let from = PeerId::random();
        let base: Vec<f32> = (0..300).map(|i| (i as f32 * 0.1).sin()).collect();
        let update: Vec<f32> = (0..300).map(|i| if i % 7 == 0 { 0.03 } else { 0.0 }).collect();
        let mut owner = base.clone();
        Payload::encode(&update, Encoding::F32)?.add_scaled_into(&mut owner, 1.0)?;
        let answer = |hash| {
            let update = Payload::encode(&update, Encoding::F32).expect("finite");
            round_7_answer(update, Some(shoal_protocol::DeltaOf { base: 7, hash }))
        };
        let Pushed::State { version, params } = exchanged(answer(params_hash(&owner)), from)? else {
            panic!("no state")
        };
        assert_eq!(version, 8);
        let mut copy = base.clone();
        assert!(params.write_into(&mut copy, 7)?, "the owner's bits from version 7");
        assert_eq!(copy, owner);
        assert!(!params.write_into(&mut base.clone(), 6)?, "not from version 6");
        let mut off = base.clone();
        off[5] += 1e-3;
        assert!(!params.write_into(&mut off, 7)?, "a copy that is not the owner's");
        let Pushed::State { params, .. } = exchanged(answer(1), from)? else { panic!("no state") };
        assert!(!params.write_into(&mut base.clone(), 7)?, "a hash the sum does not have");
        Ok(())
    }

    #[test]
    fn a_spare_buffer_is_reused_only_when_no_one_else_holds_it() {
        let params = vec![1.0f32, 2.0, 3.0];
        let spare = Arc::new(vec![9.0f32; 8]);
        let at = spare.as_ptr();
        let reused = copy_into(Some(spare), &params);
        assert_eq!(reused, params);
        assert_eq!(reused.as_ptr(), at, "the spare's buffer took the copy");
        let shared = Arc::new(vec![9.0f32; 8]);
        let reader = shared.clone();
        let fresh = copy_into(Some(shared), &params);
        assert_eq!(fresh, params);
        assert_ne!(fresh.as_ptr(), reader.as_ptr(), "a buffer someone still reads is left alone");
        assert_eq!(*reader, vec![9.0f32; 8]);
        assert_eq!(copy_into(None, &params), params);
    }

    #[test]
    fn a_grown_batch_takes_distinct_samples_from_the_epochs_next_batches() -> anyhow::Result<()> {
        // 33 samples in batches of up to 8: 5 batches per epoch.
        let mut b = WorkerBatches::new(100, 1, 3, 8, 7)?;
        let grown_to = |b: &mut WorkerBatches, step: u64, n: usize| -> anyhow::Result<Vec<usize>> {
            let mut out = b.local_for_step(step)?;
            b.grow_local(step, &mut out, n)?;
            Ok(out)
        };
        // The last batch of epoch 0 (step 4) grown to 12: then the epoch's
        // first batches (wrapping), not epoch 1's.
        let grown = grown_to(&mut b, 4, 12)?;
        let mut want = b.local_for_step(4)?;
        want.extend(b.local_for_step(0)?);
        want.extend(b.local_for_step(1)?);
        want.truncate(12);
        assert_eq!(grown, want);
        // Steps 5..10 are epoch 1: step 6 grown to 20 goes on with steps
        // 7, 8, 9 and then 5, in that order.
        let grown = grown_to(&mut b, 6, 20)?;
        let mut want = b.local_for_step(6)?;
        for s in [7, 8, 9, 5] {
            want.extend(b.local_for_step(s)?);
        }
        want.truncate(20);
        assert_eq!(grown, want);
        // No sample twice: at most the whole partition.
        let all = grown_to(&mut b, 2, 100)?;
        let mut sorted = all.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!((all.len(), sorted.len()), (33, 33));
        // Not grown: the batch itself.
        assert_eq!(grown_to(&mut b, 3, 8)?, b.local_for_step(3)?);
        Ok(())
    }
}
