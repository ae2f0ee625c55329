//! The aggregator actor: serves the shards this node owns, and moves them
//! when the placement changes.
//!
//! It wraps one [`ShardCore`] per owned shard (the policy logic is there,
//! pure) and adds what needs a clock and channels: pulls that must wait are
//! parked with a deadline and answered as soon as a push makes them ready,
//! or with `NotReady` when the deadline passes. Requests arrive from the
//! local worker (through this handle) and from peers (the network actor
//! forwards them with `try_send`, so the network never blocks on us).
//!
//! Ownership follows the [`Placement`] published by the election:
//! - a shard this node loses is removed first (from then on it answers
//!   `NotOwner` with a hint: the fence) and then sent, with its optimizer
//!   state and version, to the new owner (`Handoff::Transfer`);
//! - a shard it gains is installed from that transfer; if the old owner is
//!   dead (not live in the placement) or silent past `handoff_timeout`, from
//!   the freshest replica this node holds, or else from its own worker copy
//!   of the model with a fresh optimizer state. A dead old owner is not
//!   waited for, unless this node's own transfer of the shard is still on
//!   the wire (to a leaver that stopped before this view heard it leave):
//!   that send comes back undelivered with the newest copy; or unless a
//!   live peer's heartbeat names the shard among those it owns, keeps or
//!   sends (the shard moved on in a placement this view skipped): that
//!   peer hands it over;
//! - every `replica_every` versions an owned shard is copied to its backup
//!   (`Handoff::Replica`), the node that takes it over if this one dies.
//!
//! A transfer that meets a copy with the same or a higher version is refused
//! (`Fenced`): after a partition heals, the copy with the higher version
//! wins, and on a tie the one already installed stays, unless that one was
//! restored from an older copy and has not closed a round since: its
//! number may have been taken up from the workers over older parameters,
//! and the transfer is the real state at that number
//! ([`ShardCore::yields_to`]); it takes the round the restored core held.
//!
//! A transfer for a shard this node's view gives to another node is passed
//! on to that node, unless it has been forwarded [`MAX_TRANSFER_HOPS`] times
//! already: then the views disagree, and this node keeps it. Its next
//! placement installs it here or passes it on; without one, it is passed on
//! again to the owner this node's view names every
//! [`AggregatorConfig::transfer_retry`], so a node whose view is already
//! right does not strand the shard while the other view catches up. Two
//! nodes that each think the other owns a shard so hand it back and forth
//! at most that many times at once, then once per retry interval.
//!
//! A transfer that cannot be delivered (its receiver stopped or died) is
//! kept the same way, as a transfer and not a replica: it may be the newest
//! copy of its shard, and the next owner must get it rather than restore
//! from an older one. A node that leaves waits until it has no kept
//! transfer either ([`Held::kept`]).

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;
use shoal_models::{Optimizer, OptimizerConfig, ShardCheckpoint};
use shoal_protocol::libp2p::PeerId;
use shoal_protocol::{ErrorCode, HandoffKind, RunId, ShardRequest, ShardResponse};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::handles::aggregator::{
    AggCommand, AggregatorHandle, HandoffReply, Held, PullReply, PushReply, ShardStats, ThenPull,
};
use crate::handles::checkpoint::CheckpointHandle;
use crate::handles::handoff::{to_wire, ShardState};
use crate::handles::net::{ModelSnapshot, NetworkHandle};
use crate::handles::status::{StatusEvent, StatusHandle};
use crate::ops::logging::short;
use crate::ops::tasks::NodeTasks;
use crate::policy::backoff::Backoff;
use crate::policy::compress::PushCompression;
use crate::policy::contribution::Contribution;
use crate::policy::placement::Placement;
use crate::policy::robust::Robust;
use crate::policy::schedule::LrSchedule;
use crate::policy::sync::{PushOutcome, ShardCore, SyncPolicy, SUSPECT_AFTER};
use crate::policy::view::ShardNews;

/// How many times a transfer may be forwarded (see the module doc). A shard
/// that moves on while its transfer is on the wire takes one hop per move;
/// four moves within one transfer's flight are already far apart in time.
pub const MAX_TRANSFER_HOPS: u64 = 4;

/// What the aggregator needs besides its channels.
#[derive(Debug, Clone)]
pub struct AggregatorConfig {
    pub me: PeerId,
    pub incarnation: u64,
    pub run: RunId,
    pub policy: SyncPolicy,
    pub optimizer: OptimizerConfig,
    /// The learning rate by step, which owned shards follow by version.
    pub schedule: LrSchedule,
    /// The aggregation rule and the norm check.
    pub robust: Robust,
    /// Element range of each shard in the flat model.
    pub ranges: Vec<Range<usize>>,
    /// Longest a pull may be parked.
    pub max_wait: Duration,
    /// Send a replica to the backup every this many versions (0: never).
    pub replica_every: u64,
    /// BSP: longest a round waits for its last gradients (ms).
    pub round_timeout_ms: u64,
    /// BSP: a round is applied once all but this many workers pushed
    /// (`sync.backup_workers`).
    pub backup_workers: usize,
    /// Delta pulls (`local_steps.delta`): how each round's update is sent.
    pub delta: Option<PushCompression>,
    /// How long a new owner waits for a live old owner's transfer.
    pub handoff_timeout: Duration,
    /// How often a transfer kept at the hop limit is passed on again to the
    /// owner this node's view names (one heartbeat: views converge in a few).
    pub transfer_retry: Duration,
    pub capacity: usize,
    /// Shard checkpoints, when on.
    pub checkpoint: Option<CheckpointPolicy>,
}

/// When owners write shard checkpoints.
#[derive(Debug, Clone)]
pub struct CheckpointPolicy {
    pub writer: CheckpointHandle,
    /// Every version that is a multiple of this.
    pub every_steps: u64,
    /// And a changed shard when this long passed since its last write.
    pub every: Option<Duration>,
}

struct ParkedPull {
    worker: PeerId,
    shard: u32,
    min_version: u64,
    /// The version the puller holds exactly, for a delta answer.
    have: Option<u64>,
    deadline: Instant,
    reply: oneshot::Sender<PullReply>,
}

/// A copy of a shard kept here but not served: a replica, or a transfer
/// to pass on or install (one that arrived before this node's own view made
/// it the owner, one kept at the hop limit, or one that could not be
/// delivered).
struct Stored {
    state: ShardState,
    transfer: bool,
    /// A transfer's hop count when it came (0 for a replica).
    hops: u64,
    /// A transfer kept at the hop limit, or undelivered: when to pass it
    /// on again.
    retry_at: Option<Instant>,
}

/// What the aggregator watches.
#[derive(Debug)]
pub struct Inputs {
    /// The election's placements.
    pub placement: watch::Receiver<Option<Arc<Placement>>>,
    /// The worker's model copy (a shard taken over with no other copy).
    pub snapshot: watch::Receiver<ModelSnapshot>,
    /// What the heartbeats say of each shard: the newest version a live
    /// worker holds (a restored core takes it up), and who says it owns or
    /// hands it over (a new owner whose old owner is gone waits for them).
    pub heard: watch::Receiver<ShardNews>,
}

/// Start the aggregator actor. It stops when every handle has been dropped.
pub fn spawn(
    cfg: AggregatorConfig,
    status: StatusHandle,
    net: NetworkHandle,
    inputs: Inputs,
    tasks: &NodeTasks,
) -> AggregatorHandle {
    let Inputs { placement, snapshot, heard } = inputs;
    let (sender, receiver) = mpsc::channel(cfg.capacity.max(1));
    let (held_tx, held) = watch::channel(Held::default());
    let (suspects_tx, suspects) = watch::channel(Vec::new());
    let (handing_tx, handing) = watch::channel(Vec::new());
    let actor = AggregatorActor {
        tasks: tasks.clone(),
        held: held_tx,
        suspects: suspects_tx,
        handing: handing_tx,
        sending: BTreeMap::new(),
        me_tx: sender.downgrade(),
        receiver,
        cores: BTreeMap::new(),
        pending: BTreeMap::new(),
        stored: BTreeMap::new(),
        placement_rx: placement,
        placement: None,
        heard,
        parked: Vec::new(),
        replicating: BTreeSet::new(),
        replicated: BTreeMap::new(),
        status,
        net,
        snapshot,
        started: Instant::now(),
        written: BTreeMap::new(),
        resume: None,
        resuming: false,
        queueing: BTreeSet::new(),
        cfg,
    };
    tasks.spawn(actor.run());
    AggregatorHandle::new(sender, held, suspects, handing)
}

struct AggregatorActor {
    /// The node's tasks: the actor, its checkpoint queueing and its handoffs.
    tasks: NodeTasks,
    cfg: AggregatorConfig,
    /// For spawned transfers and replicas to report back; weak, so the
    /// actor still stops when every handle is dropped.
    me_tx: mpsc::WeakSender<AggCommand>,
    receiver: mpsc::Receiver<AggCommand>,
    cores: BTreeMap<u32, ShardCore<PeerId>>,
    /// Shards assigned here whose state is awaited, with the deadline after
    /// which this node restores them itself.
    pending: BTreeMap<u32, Instant>,
    stored: BTreeMap<u32, Stored>,
    placement_rx: watch::Receiver<Option<Arc<Placement>>>,
    placement: Option<Arc<Placement>>,
    /// What the heartbeats say of each shard ([`Inputs::heard`]).
    heard: watch::Receiver<ShardNews>,
    parked: Vec<ParkedPull>,
    replicating: BTreeSet<u32>,
    /// Version last replicated, per shard.
    replicated: BTreeMap<u32, u64>,
    status: StatusHandle,
    net: NetworkHandle,
    snapshot: watch::Receiver<ModelSnapshot>,
    started: Instant,
    held: watch::Sender<Held>,
    /// Workers marked as suspects since start, for this node's heartbeat.
    suspects: watch::Sender<Vec<PeerId>>,
    /// The shards whose transfer this node keeps or sends, for its heartbeat.
    handing: watch::Sender<Vec<u32>>,
    /// Transfers in flight, per shard.
    sending: BTreeMap<u32, usize>,
    /// Per shard: the version last checkpointed, and when.
    written: BTreeMap<u32, (u64, Instant)>,
    /// Checkpointed states to install or pass on at the first placement.
    resume: Option<Vec<ShardState>>,
    /// Resuming, until every worker copy holds the resumed model: no shard
    /// is ever started from the worker copy meanwhile.
    resuming: bool,
    /// Shards whose aligned checkpoint waits for room in the writer's queue:
    /// at most one copy per shard waits.
    queueing: BTreeSet<u32>,
}

impl AggregatorActor {
    fn publish_held(&self) {
        let now = Held {
            shards: self.cores.len(),
            pending: self.pending.len(),
            transfers: self.sending.values().sum(),
            kept: self.stored.values().filter(|s| s.transfer).count(),
        };
        self.held.send_if_modified(|h| std::mem::replace(h, now) != now);
        let handing: BTreeSet<u32> = self
            .sending
            .keys()
            .copied()
            .chain(self.stored.iter().filter(|(_, s)| s.transfer).map(|(s, _)| *s))
            .collect();
        self.handing.send_if_modified(|h| {
            let changed = !h.iter().eq(handing.iter());
            if changed {
                *h = handing.into_iter().collect();
            }
            changed
        });
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn epoch(&self) -> u64 {
        self.placement.as_ref().map(|p| p.epoch).unwrap_or(0)
    }

    fn hint(&self, shard: u32) -> Option<PeerId> {
        self.placement.as_ref().and_then(|p| p.owner(shard)).filter(|o| *o != self.cfg.me)
    }

    async fn run(mut self) {
        // In gossip mode no election runs and the placement sender is dropped
        // at once: keep serving (stats, refusals) rather than stop.
        let mut placements_open = true;
        let mut holds_open = true;
        loop {
            let rounds = self
                .cores
                .values()
                .filter_map(|c| c.round_deadline_ms(self.cfg.round_timeout_ms))
                .min()
                .map(|ms| self.started + Duration::from_millis(ms));
            let retries = self.stored.values().filter_map(|s| s.retry_at);
            let next_deadline = self
                .parked
                .iter()
                .map(|p| p.deadline)
                .chain(self.pending.values().copied())
                .chain(rounds)
                .chain(retries)
                .min();
            tokio::select! {
                cmd = self.receiver.recv() => match cmd {
                    Some(cmd) => self.handle(cmd),
                    None => break,
                },
                r = self.placement_rx.changed(), if placements_open => {
                    if r.is_err() {
                        placements_open = false;
                        continue;
                    }
                    let p = self.placement_rx.borrow_and_update().clone();
                    if let Some(p) = p {
                        self.place(p);
                    }
                }
                r = self.heard.changed(), if holds_open => {
                    if r.is_err() {
                        holds_open = false;
                        continue;
                    }
                    let shards: Vec<u32> = self.cores.keys().copied().collect();
                    let mut moved = false;
                    for shard in shards {
                        moved |= self.take_up_held(shard);
                    }
                    if moved {
                        self.release_ready();
                    }
                }
                _ = sleep_until_opt(next_deadline) => self.expire(),
            }
            self.publish_held();
        }
        debug!("aggregator stopping: all handles dropped");
    }

    /// Handles one command of the mailbox.
    fn handle(&mut self, cmd: AggCommand) {
        match cmd {
            AggCommand::Push { worker, shard, base_version, samples, grad, reply, then_pull } => {
                let applied = self.apply_push(worker, shard, base_version, samples, grad);
                self.answer_push(worker, shard, applied, reply, then_pull);
            }
            AggCommand::Pull { worker, shard, min_version, wait, have, reply } => {
                if !self.cores.contains_key(&shard) && !self.pending.contains_key(&shard) {
                    let _ = reply.send(PullReply::NotOwner { epoch: self.epoch(), hint: self.hint(shard) });
                    return;
                }
                self.park(worker, shard, (min_version, have), wait, reply);
                self.release_ready();
            }
            AggCommand::Handoff { from, kind, hops, state, reply } => {
                let r = self.receive(from, kind, hops, state);
                let _ = reply.send(r);
                self.release_ready();
            }
            AggCommand::TransferDone { shard } => self.sent(shard),
            AggCommand::TransferFailed { to, hops, state } => self.transfer_failed(to, hops, state),
            AggCommand::ReplicaDone { shard } => {
                self.replicating.remove(&shard);
            }
            AggCommand::Resume { states, reply } => {
                info!(shards = states.len(), "resuming from checkpoints");
                self.resume = Some(states);
                self.resuming = true;
                let _ = reply.send(());
            }
            AggCommand::CheckpointQueued { shard } => {
                self.queueing.remove(&shard);
            }
            AggCommand::ResumeDone => {
                // Every worker copy now holds the resumed model.
                self.resuming = false;
            }
            AggCommand::FlushCheckpoints { reply } => self.flush_checkpoints(reply),
            AggCommand::Stats { reply } => {
                let _ = reply.send(self.stats());
            }
        }
    }

    /// Applies a worker's gradient for `shard` to the shard's core, with
    /// what an accepted push records. `None` when the shard is not held
    /// here; else the reply and whether the shard's version moved.
    fn apply_push(
        &mut self,
        worker: PeerId,
        shard: u32,
        base_version: u64,
        samples: u32,
        grad: Contribution,
    ) -> Option<(PushReply, bool)> {
        let now = self.now_ms();
        let core = self.cores.get_mut(&shard)?;
        let before = core.version();
        let skipped = core.skipped();
        let out = match core.push(&worker, base_version, samples, grad, now) {
            PushOutcome::Accepted { version, staleness } => {
                self.status.record(StatusEvent::Staleness(staleness));
                self.status.record(StatusEvent::PushAccepted(worker));
                PushReply::Accepted { version, staleness }
            }
            PushOutcome::Stale { current_version } => {
                PushReply::Stale { current_version, max_staleness: core.policy().max_bound().unwrap_or(u64::MAX) }
            }
            PushOutcome::UnknownWorker => PushReply::UnknownWorker,
            PushOutcome::BadLength { expected, got } => {
                PushReply::Invalid(format!("gradient for shard {shard} has {got} values, expected {expected}"))
            }
        };
        let bumped = core.version() != before;
        if core.skipped() > skipped {
            info!(shard, from = before, to = core.version(), %worker,
                  "restored shard: numbering moved to the workers' (rounds its lost owner applied)");
        }
        report_core(&self.status, &self.suspects, shard, core);
        Some((out, bumped))
    }

    /// Answers a push given what [`Self::apply_push`] made of it: a shard
    /// not held here is refused (pending: try again; else not the owner).
    /// Otherwise the pull riding on an accepted push is parked, the reply
    /// sent, a shard whose version moved replicated and checkpointed, and
    /// the pulls now ready released.
    fn answer_push(
        &mut self,
        worker: PeerId,
        shard: u32,
        applied: Option<(PushReply, bool)>,
        reply: oneshot::Sender<PushReply>,
        then_pull: Option<ThenPull>,
    ) {
        let Some((out, bumped)) = applied else {
            let r = if self.pending.contains_key(&shard) {
                PushReply::Pending
            } else {
                PushReply::NotOwner { epoch: self.epoch(), hint: self.hint(shard) }
            };
            let _ = reply.send(r);
            return;
        };
        if let (PushReply::Accepted { version, .. }, Some(then)) = (&out, then_pull) {
            self.park(worker, shard, (self.cfg.policy.pull_after_push(*version), then.have), then.wait, then.reply);
        }
        let _ = reply.send(out);
        if bumped {
            self.maybe_replicate(shard);
            self.maybe_checkpoint(shard);
        }
        self.release_ready();
    }

    /// A spawned transfer could not be delivered: keep the state as a
    /// replica.
    /// A transfer that could not be delivered may be the newest copy of
    /// its shard (say, forwarded back to a leaver that has stopped since):
    /// kept as a transfer, not a replica. The next placement passes it on
    /// or installs it here, and the retry timer passes it on to the owner
    /// this node's view then names, so that a new owner never restores
    /// from an older copy while this one waits here. A node leaving waits
    /// for it too ([`Held::kept`]). Where the view changed while the send
    /// was failing and names another owner than `to` (or this node), the
    /// copy goes on at once: that placement has already been taken up, so
    /// none would come to pass it on, and the retry timer may be long.
    fn transfer_failed(&mut self, to: PeerId, hops: u64, state: ShardState) {
        let (shard, version) = (state.shard, state.version);
        self.sent(shard);
        warn!(shard, version, "transfer undelivered; keeping it to pass on to the shard's owner");
        self.store(state, true, hops);
        let now = Instant::now();
        let moved = self.placement.as_ref().and_then(|p| p.owner(shard)).is_some_and(|o| o != to);
        if let Some(st) = self.stored.get_mut(&shard).filter(|st| st.state.version == version) {
            st.retry_at = Some(if moved { now } else { now + self.cfg.transfer_retry });
        }
        if moved {
            self.retry_kept_transfers(now);
        }
    }

    /// A transfer of `shard` sent from here was answered or given up.
    fn sent(&mut self, shard: u32) {
        if let Some(n) = self.sending.get_mut(&shard) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.sending.remove(&shard);
            }
        }
    }

    /// Checkpoints every owned shard that changed since its last write and
    /// answers `reply` once they are on disk (at once without a writer).
    fn flush_checkpoints(&mut self, reply: oneshot::Sender<()>) {
        let owned: Vec<u32> = self.cores.keys().copied().collect();
        let due: Vec<ShardCheckpoint> =
            owned.into_iter().filter_map(|s| self.checkpoint_of(s, true)).map(|c| c.0).collect();
        match self.cfg.checkpoint.as_ref().map(|c| c.writer.clone()) {
            Some(w) => {
                // One task, in order: the flush answers after these writes.
                self.tasks.spawn(async move {
                    for c in due {
                        w.write(c).await;
                    }
                    w.flush().await;
                    let _ = reply.send(());
                });
            }
            None => {
                let _ = reply.send(());
            }
        }
    }

    /// The version, staleness and gradient norm of every owned shard.
    fn stats(&self) -> Vec<ShardStats> {
        self.cores
            .iter()
            .map(|(&shard, c)| ShardStats {
                shard,
                version: c.version(),
                max_staleness: c.max_staleness(),
                median_norm: c.median_norm(),
            })
            .collect()
    }

    /// Keep a copy unless a newer one is already kept. A transfer at the
    /// hop limit is passed on again after [`AggregatorConfig::transfer_retry`].
    /// A replica of the same version as a kept transfer does not replace it:
    /// an owner's last replica and its transfer race on the wire, and a
    /// transfer turned into a replica would make this node, once its
    /// placement names it, wait out the handoff timeout for a transfer it
    /// already has and then count a restore from a replica.
    fn store(&mut self, state: ShardState, transfer: bool, hops: u64) {
        let newer = self.stored.get(&state.shard).is_none_or(|s| {
            state.version > s.state.version || (state.version == s.state.version && (transfer || !s.transfer))
        });
        if newer {
            let retry_at = (transfer && hops >= MAX_TRANSFER_HOPS).then(|| Instant::now() + self.cfg.transfer_retry);
            self.stored.insert(state.shard, Stored { state, transfer, hops, retry_at });
        }
    }

    fn receive(&mut self, from: PeerId, kind: HandoffKind, hops: u64, state: ShardState) -> HandoffReply {
        let Some(range) = self.cfg.ranges.get(state.shard as usize) else {
            return HandoffReply::Invalid(format!("no shard {}", state.shard));
        };
        if state.params.len() != range.len() || state.optimizer.slots.iter().any(|(_, v)| v.len() != range.len()) {
            return HandoffReply::Invalid(format!("shard {} state does not have {} values", state.shard, range.len()));
        }
        let shard = state.shard;
        match kind {
            HandoffKind::Replica => {
                debug!(shard, version = state.version, %from, "replica stored");
                self.checkpoint_replica(&state);
                let version = state.version;
                self.store(state, false, 0);
                HandoffReply::Ack { version }
            }
            HandoffKind::Transfer => {
                if let Some(core) = self.cores.get(&shard) {
                    // On the version number, as every owner compares: a
                    // restored copy's number counts the rounds its workers
                    // had seen, which the loss bound covers (see
                    // `ShardCore::catch_up`). A restored core that has not
                    // closed a round yields to a copy of its own number
                    // too: that copy holds the rounds the number stands for.
                    if !core.yields_to(state.version) {
                        info!(shard, mine = core.version(), theirs = state.version, %from, "transfer fenced: ours is as new");
                        return HandoffReply::Fenced { epoch: self.epoch() };
                    }
                    info!(shard, mine = core.version(), theirs = state.version, %from, "the copy handed over replaces ours");
                    let version = state.version;
                    let old = self.cores.remove(&shard);
                    self.install(state);
                    if let (Some(mut old), Some(new)) = (old, self.cores.get_mut(&shard)) {
                        old.hand_round_to(new);
                    }
                    return HandoffReply::Ack { version };
                }
                let version = state.version;
                self.status.record(StatusEvent::HandoffIn);
                let owner = self.placement.as_ref().and_then(|p| p.owner(shard));
                if self.pending.remove(&shard).is_some() {
                    info!(shard, version, %from, "shard handed over");
                    self.install(state);
                } else if let Some(to) = owner.filter(|o| *o != self.cfg.me) {
                    if hops < MAX_TRANSFER_HOPS {
                        // The shard moved on while it was on the wire (possibly
                        // back to the sender, which now waits for it): pass it along.
                        info!(shard, version, hops, to = %short(&to), "forwarding a transfer to the current owner");
                        self.spawn_send(to, HandoffKind::Transfer, hops + 1, state);
                    } else {
                        // Forwarded back and forth: the views disagree. Keep it
                        // until this node's next placement decides where it
                        // goes, or the retry interval passes.
                        warn!(shard, version, hops, owner = %short(&to),
                              "transfer forwarded too often; keeping it until the views agree");
                        self.store(state, true, hops);
                    }
                } else if owner == Some(self.cfg.me) {
                    // Our placement already names us, yet nothing here waits
                    // for the shard: its takeover found no copy to restore
                    // from (a first placement with no model copy yet). No
                    // later placement would install a kept copy: take it now.
                    info!(shard, version, %from, "shard handed over after a takeover with no copy");
                    self.install(state);
                } else {
                    // Our view has not made us the owner yet: keep it until it does.
                    self.store(state, true, hops);
                }
                HandoffReply::Ack { version }
            }
        }
    }

    fn install(&mut self, state: ShardState) {
        let workers = self.placement.as_ref().map(|p| p.workers.clone()).unwrap_or_default();
        let optimizer = match Optimizer::from_state(state.optimizer) {
            Ok(o) => o,
            Err(e) => {
                warn!(shard = state.shard, error = %e, "optimizer state unusable; starting it afresh");
                match Optimizer::new(self.cfg.optimizer, state.params.len()) {
                    Ok(o) => o,
                    Err(e) => {
                        warn!(shard = state.shard, error = %e, "cannot build an optimizer; shard not installed");
                        return;
                    }
                }
            }
        };
        self.replicated.insert(state.shard, state.version);
        let mut core = ShardCore::new(state.params, optimizer, state.version, self.cfg.policy, workers)
            .with_schedule(self.cfg.schedule)
            .with_robust(self.cfg.robust)
            .with_backup_workers(self.cfg.backup_workers)
            .with_delta(self.cfg.delta);
        if state.catch_up_room > 0 {
            // A restored shard handed over before it settled: it goes on
            // catching up here, within this node's own room.
            core.mark_restored(state.catch_up_room.min(self.restore_room()));
        }
        self.cores.insert(state.shard, core);
    }

    /// Take a shard over without a transfer: from a stored copy, or else
    /// from this node's worker copy of the model.
    fn restore(&mut self, shard: u32) {
        self.pending.remove(&shard);
        if let Some(s) = self.stored.remove(&shard) {
            info!(shard, version = s.state.version, transfer = s.transfer, "taking the shard over from a stored copy");
            if !s.transfer {
                // A transfer that arrived early was counted as a handoff in.
                self.status.record(StatusEvent::Restored { from_replica: true });
            }
            let from_replica = !s.transfer;
            self.install(s.state);
            if from_replica {
                self.restored(shard);
            }
            return;
        }
        if self.resuming {
            // The worker copy is not the resumed model yet: wait for the
            // shard's checkpoint instead (`expire` re-arms the wait).
            warn!(shard, "resuming: no checkpoint of the shard here yet; waiting for it");
            self.pending.insert(shard, Instant::now() + self.cfg.handoff_timeout);
            return;
        }
        let Some(range) = self.cfg.ranges.get(shard as usize).cloned() else { return };
        let snap = self.snapshot.borrow().clone();
        if snap.params.len() < range.end {
            warn!(shard, "no model copy to take the shard over from");
            return;
        }
        let optimizer = match Optimizer::new(self.cfg.optimizer, range.len()) {
            Ok(o) => o.into_state(),
            Err(e) => {
                warn!(shard, error = %e, "cannot build an optimizer");
                return;
            }
        };
        if snap.version > 0 {
            warn!(
                shard,
                version = snap.version,
                "no replica: taking the shard over from the worker copy, optimizer state afresh"
            );
            self.status.record(StatusEvent::Restored { from_replica: false });
        }
        let params = snap.params[range].to_vec();
        self.install(ShardState { shard, version: snap.version, params, optimizer, catch_up_room: 0 });
        self.restored(shard);
    }

    /// The shard was just installed from a copy that may be older than the
    /// workers' models (a replica, or this node's worker copy): until its
    /// first full BSP round, its numbering may take up the workers' newer
    /// one (`ShardCore::mark_restored`). The room covers what one failure can
    /// lose: `replica_every` versions and those applied while a replica was
    /// on the wire, with slack.
    fn restored(&mut self, shard: u32) {
        let room = self.restore_room();
        if let Some(core) = self.cores.get_mut(&shard) {
            core.mark_restored(room);
        }
        self.take_up_held(shard);
    }

    /// How far a restored shard's numbering may move (see [`Self::restored`]).
    fn restore_room(&self) -> u64 {
        self.cfg.replica_every.saturating_mul(4).saturating_add(16)
    }

    /// A restored core takes up the newest version of `shard` a live worker
    /// holds, within its room ([`ShardCore::take_up`]): the owner that was
    /// lost applied every round before it. The workers that got its newest
    /// versions of different shards may each be waiting for another shard,
    /// and then no push of theirs carries the newer base (the schedule
    /// explorer's finding 3). A no-op on a core handed over live. Returns
    /// whether the numbering moved.
    fn take_up_held(&mut self, shard: u32) -> bool {
        let Some(&held) = self.heard.borrow().newest.get(shard as usize) else { return false };
        let Some(core) = self.cores.get_mut(&shard) else { return false };
        let before = core.version();
        if !core.take_up(held) {
            return false;
        }
        info!(shard, from = before, to = held, "restored shard: taking up the version a live worker holds");
        report_core(&self.status, &self.suspects, shard, core);
        self.maybe_replicate(shard);
        self.maybe_checkpoint(shard);
        true
    }

    /// Apply a new placement: hand off what we lost, take what we gained.
    fn place(&mut self, new: Arc<Placement>) {
        let old = self.placement.replace(new.clone());
        let me = self.cfg.me;
        // Resuming: keep the checkpointed shards this node owns (installed
        // below, as an early transfer would be) and send the others to
        // their owners, who wait for them.
        for state in self.resume.take().unwrap_or_default() {
            match new.owner(state.shard) {
                Some(o) if o == me => self.store(state, true, 0),
                Some(o) => {
                    info!(shard = state.shard, version = state.version, to = %short(&o), "passing a checkpointed shard to its owner");
                    self.spawn_send(o, HandoffKind::Transfer, 0, state);
                }
                None => {}
            }
        }
        for (&shard, core) in self.cores.iter_mut() {
            // An empty worker set is ignored there.
            core.set_workers(new.workers.iter().copied());
            report_core(&self.status, &self.suspects, shard, core);
        }
        let lost: Vec<u32> = self.cores.keys().copied().filter(|&s| new.owner(s) != Some(me)).collect();
        for shard in lost {
            let Some(core) = self.cores.remove(&shard) else { continue };
            let Some(to) = new.owner(shard) else { continue };
            let (params, optimizer, version) = core.export();
            // A restored core not yet settled keeps catching up where it goes.
            let catch_up_room = core.restore_room();
            info!(shard, version, to = %short(&to), "handing the shard over");
            self.status.record(StatusEvent::HandoffOut);
            let state = ShardState { shard, version, params, optimizer, catch_up_room };
            self.spawn_send(to, HandoffKind::Transfer, 0, state);
        }
        // An early transfer kept until a placement came, where that placement
        // makes another node the owner: pass it on (as `receive` does when
        // the placement is already known), or it would go stale here while
        // that owner waits for it and falls back to an older replica. A
        // transfer kept for having hopped too often is passed on too: a new
        // placement is the only thing that stops it here, and its receiver
        // keeps it rather than forwarding it again.
        let moved_on: Vec<u32> = self
            .stored
            .iter()
            .filter(|(s, st)| st.transfer && new.owner(**s).is_some_and(|o| o != me))
            .map(|(s, _)| *s)
            .collect();
        for shard in moved_on {
            if let Some(to) = new.owner(shard) {
                self.pass_on_stored(shard, to);
            }
        }
        // A new backup gets a replica now rather than after the next few
        // versions: it is who takes the shard over if this node dies.
        let rebacked: Vec<u32> =
            self.cores.keys().copied().filter(|&s| old.as_ref().and_then(|o| o.backup(s)) != new.backup(s)).collect();
        for shard in rebacked {
            self.replicated.insert(shard, 0);
            self.replicating.remove(&shard);
            self.maybe_replicate_now(shard);
        }
        self.pending.retain(|s, _| new.owner(*s) == Some(me));
        self.take_gained(&new, old.as_deref());
        self.release_ready();
    }

    /// The shards `new` gives this node that it neither serves nor awaits:
    /// installed from a kept transfer or restored, or awaited from the node
    /// that hands them over (see the module doc).
    fn take_gained(&mut self, new: &Placement, old: Option<&Placement>) {
        let me = self.cfg.me;
        let deadline = Instant::now() + self.cfg.handoff_timeout;
        let starting = self.snapshot.borrow().version == 0;
        for shard in new.owned_by(&me) {
            if self.cores.contains_key(&shard) || self.pending.contains_key(&shard) {
                continue;
            }
            let previous = old.and_then(|o| o.owner(shard));
            match previous {
                _ if self.stored.get(&shard).is_some_and(|s| s.transfer) => self.restore(shard),
                // Training starts: every node holds the same initial model.
                None if starting => self.restore(shard),
                // A node that joined mid-run: the current owner hands it over.
                None => {
                    debug!(shard, "joined mid-run: waiting for the shard's transfer");
                    self.pending.insert(shard, deadline);
                }
                // This node's own send of the shard may still be under way
                // (a transfer forwarded to an owner that has stopped since,
                // as a leaver does at once): it carries a newer copy than
                // any stored here, and comes back if undelivered.
                Some(p) if p == me || !new.is_live(&p) => {
                    if self.sending.contains_key(&shard) {
                        debug!(shard, "waiting for this node's own transfer of the shard to be answered");
                        self.pending.insert(shard, deadline);
                    } else if let Some(c) = self.claimant(shard, new) {
                        // The shard moved on in a view this node skipped (a
                        // leave it never heard): the node that holds it now
                        // hands it over.
                        info!(shard, from = %short(&c), "the old owner is gone; waiting for the node that says it holds the shard");
                        self.pending.insert(shard, deadline);
                    } else {
                        self.restore(shard);
                    }
                }
                Some(p) => {
                    debug!(shard, from = %p, "waiting for the shard's transfer");
                    self.pending.insert(shard, deadline);
                }
            }
        }
    }

    /// A live peer other than this node whose heartbeat says it owns
    /// `shard` or keeps or sends its transfer ([`ShardNews::claimants`]).
    fn claimant(&self, shard: u32, placement: &Placement) -> Option<PeerId> {
        let heard = self.heard.borrow();
        let claimants = heard.claimants.get(shard as usize)?;
        claimants.iter().copied().find(|c| *c != self.cfg.me && placement.is_live(c))
    }

    /// Write an owned shard's checkpoint when its version is a multiple of
    /// `every_steps`, when `every_secs` passed since its last write, or
    /// (`now`) whenever it changed since. The copy is made here; the writer
    /// thread does the disk work. The backup gets a replica of the same
    /// version, which it checkpoints too, so each shard is on two disks.
    fn maybe_checkpoint(&mut self, shard: u32) {
        if self.queueing.contains(&shard) {
            // The previous aligned copy still waits: the writer is a whole
            // interval behind. Try again at the next version.
            warn!(shard, "checkpoint writer is a whole interval behind; this checkpoint waits for the next version");
            return;
        }
        let Some((ckpt, aligned)) = self.checkpoint_of(shard, false) else { return };
        let Some(writer) = self.cfg.checkpoint.as_ref().map(|p| p.writer.clone()) else { return };
        if aligned {
            // Resume points are aligned versions: not dropped while the
            // writer keeps up. The task waits for room in the writer's queue
            // and reports back, so at most one copy per shard waits.
            let version = ckpt.version;
            self.queueing.insert(shard);
            let back = self.me_tx.clone();
            self.tasks.spawn(async move {
                writer.write(ckpt).await;
                if let Some(tx) = back.upgrade() {
                    let _ = tx.send(AggCommand::CheckpointQueued { shard }).await;
                }
            });
            // The backup checkpoints a replica of the same version, unless
            // it was just sent one.
            if self.replicated.get(&shard) != Some(&version) {
                self.maybe_replicate_now(shard);
            }
        } else if !writer.try_write(ckpt) {
            debug!(shard, "checkpoint writer is behind; skipping this timed checkpoint");
            self.written.remove(&shard);
        }
    }

    /// Decide whether `shard` is due (see [`Self::maybe_checkpoint`];
    /// `now`: whenever it changed since its last write) and, if so, copy it.
    /// Returns the copy and whether its version is aligned to `every_steps`.
    fn checkpoint_of(&mut self, shard: u32, now: bool) -> Option<(ShardCheckpoint, bool)> {
        let policy = self.cfg.checkpoint.as_ref()?;
        let core = self.cores.get(&shard)?;
        let version = core.version();
        let last = self.written.get(&shard).copied();
        if last.is_some_and(|(v, _)| v >= version) {
            return None;
        }
        let aligned = version.is_multiple_of(policy.every_steps);
        let late = policy.every.is_some_and(|every| last.is_some_and(|(_, at)| at.elapsed() >= every));
        if !(now || aligned || late) {
            if last.is_none() {
                // The clock for `every_secs` starts when the shard arrives.
                self.written.insert(shard, (0, Instant::now()));
            }
            return None;
        }
        let range = self.cfg.ranges.get(shard as usize).cloned()?;
        // Where workers resume from this checkpoint: under BSP the version
        // is the round, hence the step. The other policies apply one push
        // per version, so the version over the number of workers is the
        // workers' mean step (the slowest is at most the staleness bound
        // behind); versions survive handoffs, worker clocks do not.
        let step = match core.policy() {
            SyncPolicy::Bsp => version,
            _ => version / core.worker_count().max(1) as u64,
        };
        let (params, optimizer, _) = core.export();
        self.written.insert(shard, (version, Instant::now()));
        Some((ShardCheckpoint { shard, range, version, step, params, optimizer }, aligned))
    }

    /// A replica at a checkpoint version (BSP: where workers resume is the
    /// version itself) is checkpointed by the backup too.
    fn checkpoint_replica(&mut self, state: &ShardState) {
        let Some(policy) = self.cfg.checkpoint.as_ref() else { return };
        if self.cfg.policy != SyncPolicy::Bsp || !state.version.is_multiple_of(policy.every_steps) {
            return;
        }
        let Some(range) = self.cfg.ranges.get(state.shard as usize).cloned() else { return };
        let ckpt = ShardCheckpoint {
            shard: state.shard,
            range,
            version: state.version,
            step: state.version,
            params: state.params.clone(),
            optimizer: state.optimizer.clone(),
        };
        if !policy.writer.try_write(ckpt) {
            debug!(shard = state.shard, version = state.version, "checkpoint writer is behind; replica not written");
        }
    }

    fn maybe_replicate(&mut self, shard: u32) {
        if self.cfg.replica_every == 0 || self.replicating.contains(&shard) {
            return;
        }
        let Some(core) = self.cores.get(&shard) else { return };
        let last = self.replicated.get(&shard).copied().unwrap_or(0);
        // `last` can come from a peer's handoff: no overflow on a huge version.
        if core.version().saturating_sub(last) < self.cfg.replica_every {
            return;
        }
        self.maybe_replicate_now(shard);
    }

    /// Send the shard's current state to its backup (if replication is on).
    fn maybe_replicate_now(&mut self, shard: u32) {
        if self.cfg.replica_every == 0 {
            return;
        }
        let Some(backup) = self.placement.as_ref().and_then(|p| p.backup(shard)) else { return };
        let Some(core) = self.cores.get(&shard) else { return };
        let (params, optimizer, version) = core.export();
        self.replicated.insert(shard, version);
        self.replicating.insert(shard);
        let state = ShardState { shard, version, params, optimizer, catch_up_room: 0 };
        self.spawn_send(backup, HandoffKind::Replica, 0, state);
    }

    /// Deliver a transfer or replica from a task of its own (the actor keeps
    /// serving). `hops`: see [`shoal_protocol::Handoff::hops`].
    fn spawn_send(&mut self, to: PeerId, kind: HandoffKind, hops: u64, state: ShardState) {
        if kind == HandoffKind::Transfer {
            *self.sending.entry(state.shard).or_default() += 1;
        }
        let net = self.net.clone();
        let back = self.me_tx.clone();
        let (run, me, incarnation) = (self.cfg.run.clone(), self.cfg.me, self.cfg.incarnation);
        let deadline = Instant::now() + self.cfg.handoff_timeout;
        self.tasks.spawn(async move {
            let shard = state.shard;
            let result = send_handoff(&net, to, &run, me, incarnation, (kind, hops), &state, deadline).await;
            let msg = match (kind, result) {
                (HandoffKind::Replica, r) => {
                    if let Err(e) = r {
                        debug!(shard, %to, error = %format!("{e:#}"), "replica not delivered");
                    }
                    AggCommand::ReplicaDone { shard }
                }
                (HandoffKind::Transfer, Ok(())) => AggCommand::TransferDone { shard },
                (HandoffKind::Transfer, Err(e)) => {
                    warn!(shard, %to, error = %format!("{e:#}"), "transfer failed");
                    AggCommand::TransferFailed { to, hops, state }
                }
            };
            if let Some(tx) = back.upgrade() {
                let _ = tx.send(msg).await;
            }
        });
    }

    /// Hold a pull until the shard's version and the policy let it through,
    /// at most `wait` (capped by `max_wait`); `release_ready` answers it.
    /// `have`: the version the puller holds exactly, for a delta answer.
    fn park(
        &mut self,
        worker: PeerId,
        shard: u32,
        (min_version, have): (u64, Option<u64>),
        wait: Duration,
        reply: oneshot::Sender<PullReply>,
    ) {
        let deadline = Instant::now() + wait.min(self.cfg.max_wait);
        self.parked.push(ParkedPull { worker, shard, min_version, have, deadline, reply });
    }

    /// Answer every parked pull whose condition now holds.
    fn release_ready(&mut self) {
        let now = self.now_ms();
        // Every worker pulls the same new version: copy each shard once per pass.
        let mut copies: BTreeMap<u32, Arc<Vec<f32>>> = BTreeMap::new();
        let mut i = 0;
        while i < self.parked.len() {
            let p = &self.parked[i];
            let ready = match self.cores.get(&p.shard) {
                // Its gradient went with a round this core replaced: a
                // `NotOwner` from its holder makes the worker push again.
                Some(c) if c.lost_push(&p.worker, p.min_version) => None,
                Some(c) => Some(c.pull_ready(&p.worker, p.min_version, now)),
                None if self.pending.contains_key(&p.shard) => Some(false),
                None => None,
            };
            match ready {
                Some(false) => i += 1,
                Some(true) => {
                    let p = self.parked.swap_remove(i);
                    if let Some(c) = self.cores.get(&p.shard) {
                        // A puller holding the version before this one gets its update.
                        if let Some(d) = p.have.and_then(|h| c.delta_from(h)) {
                            let _ = p.reply.send(PullReply::Delta(d));
                            continue;
                        }
                        let params = copies.entry(p.shard).or_insert_with(|| Arc::new(c.params().to_vec())).clone();
                        let _ = p.reply.send(PullReply::State { version: c.version(), params });
                    }
                }
                None => {
                    let p = self.parked.swap_remove(i);
                    let hint = self.hint(p.shard);
                    let _ = p.reply.send(PullReply::NotOwner { epoch: self.epoch(), hint });
                }
            }
        }
    }

    fn expire(&mut self) {
        let now_ms = self.now_ms();
        let mut closed = Vec::new();
        for (&shard, core) in self.cores.iter_mut() {
            if let Some(missing) = core.close_overdue_round(now_ms, self.cfg.round_timeout_ms) {
                warn!(
                    shard,
                    version = core.version(),
                    missing = missing.len(),
                    workers = ?missing.iter().map(short).collect::<Vec<_>>(),
                    timeout_ms = self.cfg.round_timeout_ms,
                    "BSP round closed without every worker's gradient"
                );
                self.status.record(StatusEvent::RoundForced);
                report_core(&self.status, &self.suspects, shard, core);
                closed.push(shard);
            }
        }
        for shard in closed {
            self.maybe_replicate(shard);
            self.maybe_checkpoint(shard);
        }
        let now = Instant::now();
        let overdue: Vec<u32> = self.pending.iter().filter(|(_, d)| **d <= now).map(|(s, _)| *s).collect();
        for shard in overdue {
            if !self.resuming {
                warn!(shard, "the old owner did not hand the shard over in time; restoring it here");
            }
            // While resuming, `restore` keeps waiting for a checkpoint.
            self.restore(shard);
        }
        self.retry_kept_transfers(now);
        let mut i = 0;
        while i < self.parked.len() {
            if self.parked[i].deadline <= now {
                let p = self.parked.swap_remove(i);
                let current_version = self.cores.get(&p.shard).map(|c| c.version()).unwrap_or(0);
                let _ = p.reply.send(PullReply::NotReady { current_version });
            } else {
                i += 1;
            }
        }
        self.release_ready();
    }
}

impl AggregatorActor {
    /// Send the transfer kept for `shard` on to `to`, one hop more.
    fn pass_on_stored(&mut self, shard: u32, to: PeerId) {
        let Some(st) = self.stored.remove(&shard) else { return };
        info!(shard, version = st.state.version, hops = st.hops, to = %short(&to), "passing a kept transfer on to the shard's owner");
        self.spawn_send(to, HandoffKind::Transfer, st.hops.saturating_add(1), st.state);
    }

    /// Pass each transfer kept at the hop limit whose retry time has come to
    /// the owner this node's view names now (if that is another node).
    fn retry_kept_transfers(&mut self, now: Instant) {
        let me = self.cfg.me;
        let due: Vec<u32> =
            self.stored.iter().filter(|(_, st)| st.retry_at.is_some_and(|t| t <= now)).map(|(&s, _)| s).collect();
        for shard in due {
            match self.placement.as_ref().and_then(|p| p.owner(shard)) {
                Some(to) if to != me => self.pass_on_stored(shard, to),
                // This node's view names it and it serves no copy: this is the copy.
                Some(_) if !self.cores.contains_key(&shard) => {
                    let Some(st) = self.stored.remove(&shard) else { continue };
                    info!(shard, version = st.state.version, "installing a kept transfer");
                    self.pending.remove(&shard);
                    self.install(st.state);
                }
                // Served here already: a newer copy replaces ours (as
                // `receive` does); an older one is no more than a replica.
                Some(_) => self.settle_kept_transfer(shard),
                // No placement yet: the first one decides.
                None => {
                    if let Some(st) = self.stored.get_mut(&shard) {
                        st.retry_at = None;
                    }
                }
            }
        }
    }
}

impl AggregatorActor {
    /// A transfer kept for `shard`, which this node serves: installed in
    /// place of the served copy when newer, else kept as a replica.
    fn settle_kept_transfer(&mut self, shard: u32) {
        let served = self.cores.get(&shard).map_or(u64::MAX, |c| c.version());
        match self.stored.remove(&shard) {
            Some(st) if st.state.version > served => {
                info!(shard, mine = served, theirs = st.state.version, "a kept transfer newer than ours replaces it");
                self.install(st.state);
            }
            Some(mut st) => {
                st.transfer = false;
                st.retry_at = None;
                self.stored.insert(shard, st);
            }
            None => {}
        }
    }
}

/// Send a handoff to `to`, retrying transport failures and `Busy` until
/// `deadline`. `Fenced` (the receiver holds a copy at least as new) counts
/// as delivered: there is nothing more to move.
#[allow(clippy::too_many_arguments)]
async fn send_handoff(
    net: &NetworkHandle,
    to: PeerId,
    run: &RunId,
    me: PeerId,
    incarnation: u64,
    (kind, hops): (HandoffKind, u64),
    state: &ShardState,
    deadline: Instant,
) -> anyhow::Result<()> {
    let req = ShardRequest::Handoff(to_wire(run, me, incarnation, kind, hops, state)?);
    let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_millis(500));
    loop {
        let err = match net.request(to, req.clone()).await {
            Ok(ShardResponse::HandoffAck { .. }) | Ok(ShardResponse::Fenced { .. }) => return Ok(()),
            Ok(ShardResponse::Error(e)) if e.code == ErrorCode::Busy => format!("busy: {}", e.message),
            Ok(other) => bail!("{to} answered a handoff with {}", other.kind()),
            Err(e) => e.to_string(),
        };
        let Some(delay) = backoff.next_within(deadline.saturating_duration_since(Instant::now())) else {
            bail!("handoff of shard {} to {to} kept failing: {err}", state.shard);
        };
        // Back-off between retries of a failed request, not synchronisation.
        tokio::time::sleep(delay).await;
    }
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// Reports what a core has to report after a push, a view change or a
/// closed round: the contributions the norm, repeat and contribution
/// checks dropped on `shard`, each
/// to the status counters, with a warning when a worker becomes a suspect,
/// which then joins the suspects this node gossips (the first
/// `MAX_SUSPECTS`); and the steps it took with their passes over the shard.
fn report_core(status: &StatusHandle, suspects: &watch::Sender<Vec<PeerId>>, shard: u32, core: &mut ShardCore<PeerId>) {
    for r in core.take_rejections() {
        if let Some(agreement) = r.agreement {
            if r.streak == SUSPECT_AFTER {
                warn!(shard, worker = %short(&r.worker), agreement, streak = r.streak,
                      "suspect worker: its gradients disagree with the rounds' aggregates, round after round");
            } else {
                debug!(shard, worker = %short(&r.worker), agreement, "gradient left out by the contribution check");
            }
        } else if r.repeat && r.streak == SUSPECT_AFTER {
            warn!(shard, worker = %short(&r.worker), norm = r.norm, streak = r.streak,
                  "suspect worker: its gradients repeat its earlier pushes bit for bit (replayed), round after round");
        } else if r.repeat {
            debug!(shard, worker = %short(&r.worker), norm = r.norm, "gradient rejected: it repeats an earlier push");
        } else if r.streak == SUSPECT_AFTER {
            warn!(shard, worker = %short(&r.worker), norm = r.norm, median = r.median, streak = r.streak,
                  "suspect worker: its gradients were rejected by the norm check, round after round");
        } else {
            debug!(shard, worker = %short(&r.worker), norm = r.norm, median = r.median, "gradient rejected by the norm check");
        }
        if r.suspect() {
            suspects.send_if_modified(|s| {
                let new = !s.contains(&r.worker) && s.len() < shoal_protocol::MAX_SUSPECTS;
                if new {
                    s.push(r.worker);
                }
                new
            });
        }
        status.record(StatusEvent::Rejected { peer: r.worker, suspect: r.suspect() });
    }
    let (steps, passes) = core.take_work();
    if steps > 0 {
        status.record(StatusEvent::OwnerWork { steps, passes });
    }
}

/// The actor with a fake network: handoffs between the aggregators of a
/// test go through a router task that logs each one. No sockets; the
/// multi-node runs over TCP are in `tests/`.
#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use shoal_models::OptimizerKind;
    use shoal_protocol::ShardResponse;

    use super::*;
    use crate::handles::handoff::from_wire;
    use crate::handles::net::{NetCommand, NetError};
    use crate::policy::robust::Robust;
    use crate::policy::schedule::LrDecay;

    const SHARD_LEN: usize = 8;

    fn optimizer() -> OptimizerConfig {
        OptimizerConfig::new(OptimizerKind::Sgd, 0.1)
    }

    fn state(version: u64) -> ShardState {
        let optimizer = Optimizer::new(optimizer(), SHARD_LEN).map(Optimizer::into_state).expect("an SGD state");
        ShardState { shard: 0, version, params: vec![version as f32; SHARD_LEN], optimizer, catch_up_room: 0 }
    }

    /// One shard, owned by `owner`; `live` are the members.
    fn placement(owner: PeerId, live: &[PeerId]) -> Arc<Placement> {
        let mut live = live.to_vec();
        live.sort_by_key(|p| p.to_bytes());
        Arc::new(Placement {
            epoch: shoal_models::rng::stable_hash64(&owner.to_bytes()),
            owners: vec![owner],
            backups: vec![None],
            live: live.clone(),
            workers: live,
            stragglers: Vec::new(),
            limit: None,
            eligible: 1,
            short_of_memory: Vec::new(),
            levels: Vec::new(),
        })
    }

    /// A handoff the router carried: (from, to, hops, version).
    type Carried = (PeerId, PeerId, u64, u64);
    type Log = mpsc::Receiver<Carried>;

    struct Node {
        me: PeerId,
        agg: AggregatorHandle,
        placement: watch::Sender<Option<Arc<Placement>>>,
        /// What the heartbeats say of shard 0: the newest version the
        /// workers hold and who claims it.
        heard: watch::Sender<ShardNews>,
    }

    /// Start one aggregator per peer (the workers' model copy is empty, so a
    /// shard can only be installed from a transfer or a stored copy), and a
    /// router that delivers each one's handoffs to the others and logs each
    /// once its receiver has answered. Handoffs to a peer outside the test
    /// are acknowledged and only logged.
    fn start(peers: &[PeerId]) -> (Vec<Node>, Log) {
        start_with(peers, Duration::from_secs(60))
    }

    /// [`start`], with `transfer_retry` for every aggregator.
    fn start_with(peers: &[PeerId], transfer_retry: Duration) -> (Vec<Node>, Log) {
        start_among(peers, &[], transfer_retry, Duration::from_secs(30))
    }

    /// [`start_with`], where a handoff to a peer in `gone` fails as to a
    /// stopped node, and a transfer is retried for `handoff_timeout`.
    fn start_among(
        peers: &[PeerId],
        gone: &[PeerId],
        transfer_retry: Duration,
        handoff_timeout: Duration,
    ) -> (Vec<Node>, Log) {
        // Bounded by the test: at most a few handoffs are ever logged.
        let (log_tx, log) = mpsc::channel(1024);
        let mut nodes = Vec::new();
        let mut inboxes = Vec::new();
        for &me in peers {
            let (net_tx, net_rx) = mpsc::channel(64);
            let (placement, placement_rx) = watch::channel(None);
            let (_snapshot_tx, snapshot) = watch::channel(ModelSnapshot::default());
            let (heard, heard_rx) = watch::channel(ShardNews::default());
            let cfg = AggregatorConfig {
                me,
                incarnation: 1,
                run: RunId::new("t").expect("valid run id"),
                policy: SyncPolicy::Bsp,
                optimizer: optimizer(),
                schedule: LrSchedule { base: 0.1, decay: LrDecay::None, steps: 100, warmup: 0 },
                robust: Robust::default(),
                backup_workers: 0,
                delta: None,
                ranges: std::iter::once(0..SHARD_LEN).collect(),
                max_wait: Duration::from_secs(5),
                replica_every: 0,
                round_timeout_ms: 10_000,
                handoff_timeout,
                transfer_retry,
                capacity: 64,
                checkpoint: None,
            };
            let tasks = NodeTasks::new();
            let status = crate::actors::status::spawn("t".into(), me.to_string(), 100, 64, &tasks);
            let net = NetworkHandle::new(net_tx, me, Default::default());
            let agg = spawn(cfg, status, net, Inputs { placement: placement_rx, snapshot, heard: heard_rx }, &tasks);
            nodes.push(Node { me, agg, placement, heard });
            inboxes.push((me, net_rx));
        }
        let handles: HashMap<PeerId, AggregatorHandle> = nodes.iter().map(|n| (n.me, n.agg.clone())).collect();
        for (me, mut inbox) in inboxes {
            let (handles, log_tx, gone) = (handles.clone(), log_tx.clone(), gone.to_vec());
            tokio::spawn(async move {
                while let Some(cmd) = inbox.recv().await {
                    let NetCommand::Request { peer, req: ShardRequest::Handoff(h), reply } = cmd else { continue };
                    if gone.contains(&peer) {
                        let _ = reply.send(Err(NetError::Request { peer, reason: "connection refused".into() }));
                        continue;
                    }
                    let resp = match handles.get(&peer) {
                        None => ShardResponse::HandoffAck { shard: h.shard, version: h.version },
                        Some(to) => {
                            let state = from_wire(&h, optimizer()).expect("decodable handoff");
                            let rx = to.try_handoff(me, h.kind, h.hops, state).expect("aggregator has room");
                            match rx.await.expect("aggregator answers") {
                                HandoffReply::Ack { version } => ShardResponse::HandoffAck { shard: h.shard, version },
                                HandoffReply::Fenced { epoch } => ShardResponse::Fenced { shard: h.shard, epoch },
                                HandoffReply::Invalid(m) => panic!("handoff refused: {m}"),
                            }
                        }
                    };
                    let _ = log_tx.try_send((me, peer, h.hops, h.version));
                    let _ = reply.send(Ok(resp));
                }
            });
        }
        (nodes, log)
    }

    async fn next(log: &mut Log) -> Carried {
        tokio::time::timeout(Duration::from_secs(10), log.recv())
            .await
            .expect("a handoff within 10 s")
            .expect("router running")
    }

    async fn hand(node: &Node, from: PeerId, hops: u64, s: ShardState) {
        let rx = node.agg.try_handoff(from, HandoffKind::Transfer, hops, s).expect("aggregator has room");
        let r = rx.await.expect("aggregator answers");
        assert!(matches!(r, HandoffReply::Ack { .. }), "transfer acknowledged, got {r:?}");
    }

    /// Wait until `node`'s actor has taken up the placement of `epoch`, in
    /// which it does not own shard 0: its refusals of `worker`'s pulls
    /// carry the epoch. Each try is a round trip to the actor.
    async fn taken_up(node: &Node, worker: PeerId, epoch: u64) {
        let seen = async {
            loop {
                let r = node.agg.pull(worker, 0, 1, Duration::ZERO).await.expect("aggregator answers");
                if matches!(r, PullReply::NotOwner { epoch: e, .. } if e == epoch) {
                    break;
                }
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), seen).await.expect("the placement taken up within 10 s");
    }

    /// `node`'s view names `leaver` the owner, among `live`; `leaver` hands
    /// it version 5, which it forwards back. Returns once that send is
    /// under way.
    async fn forwarding_back(node: &Node, leaver: PeerId, live: &[PeerId]) {
        let first = placement(leaver, live);
        node.placement.send_replace(Some(first.clone()));
        taken_up(node, node.me, first.epoch).await;
        hand(node, leaver, 0, state(5)).await;
        let mut held = node.agg.held();
        tokio::time::timeout(Duration::from_secs(10), held.wait_for(|h| h.transfers == 1))
            .await
            .expect("the forward to the leaver under way within 10 s")
            .expect("aggregator running");
    }

    /// Waits until `node` has taken up a placement naming `owner` the
    /// owner of shard 0 (a pull is answered `NotOwner` with that hint), so
    /// that the next placement is not taken up in its place.
    async fn names_the_owner(node: &Node, owner: PeerId) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let pulled = node.agg.pull(owner, 0, 0, Duration::from_millis(1)).await.expect("aggregator answers");
            if matches!(pulled, PullReply::NotOwner { hint: Some(h), .. } if h == owner) {
                return;
            }
            assert!(Instant::now() < deadline, "the placement taken up within 10 s");
            tokio::task::yield_now().await;
        }
    }

    /// Wait until `node` serves a shard, and return its version.
    async fn installed(node: &Node) -> u64 {
        let mut held = node.agg.held();
        tokio::time::timeout(Duration::from_secs(10), held.wait_for(|h| h.shards == 1))
            .await
            .expect("the shard installed within 10 s")
            .expect("aggregator running");
        node.agg.stats().await.first().map(|s| s.version).expect("one shard served")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replica_arriving_after_a_kept_transfer_of_the_same_version_leaves_it_a_transfer() {
        // The owner's last replica and its transfer race on the wire. Had
        // the replica replaced the kept transfer, `b`'s placement (the old
        // owner still live) would wait out the handoff timeout (30 s here)
        // for a transfer it already had, then count a restore from a replica.
        let (b, old) = (PeerId::random(), PeerId::random());
        let (nodes, _log) = start(&[b]);
        // Before any placement: kept.
        hand(&nodes[0], old, 0, state(5)).await;
        let rx = nodes[0].agg.try_handoff(old, HandoffKind::Replica, 0, state(5)).expect("aggregator has room");
        assert!(matches!(rx.await.expect("aggregator answers"), HandoffReply::Ack { version: 5 }));
        // A round trip: the actor has published what it holds since.
        assert!(nodes[0].agg.stats().await.is_empty(), "nothing served yet");
        assert_eq!(nodes[0].agg.held().borrow().kept, 1, "still kept as a transfer");
        nodes[0].placement.send_replace(Some(placement(b, &[b, old])));
        assert_eq!(installed(&nodes[0]).await, 5, "installed as the handed-over shard, without a wait");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_owner_whose_view_loses_the_leaver_waits_for_its_own_forward_rather_than_an_older_replica() {
        // The CI failure of 2026-12-07 (`a_node_leaves_cleanly_...`): the
        // leaver handed its shard to `b` and stopped some 25 ms after announcing
        // its leave, before `b`'s view heard of it. `b`, still naming the
        // leaver, forwarded the transfer back to it, and that send kept
        // failing for the handoff timeout. Meanwhile the failure timeout
        // dropped the leaver from `b`'s view: `b` became the owner and,
        // the old owner not live, restored from its replica, older than
        // the copy its own send still carried.
        let (b, leaver) = (PeerId::random(), PeerId::random());
        let (nodes, _log) = start_among(&[b], &[leaver], Duration::from_secs(60), Duration::from_secs(2));
        let rx = nodes[0].agg.try_handoff(leaver, HandoffKind::Replica, 0, state(4)).expect("aggregator has room");
        assert!(matches!(rx.await.expect("aggregator answers"), HandoffReply::Ack { version: 4 }));
        forwarding_back(&nodes[0], leaver, &[b, leaver]).await;
        nodes[0].placement.send_replace(Some(placement(b, &[b])));
        assert_eq!(installed(&nodes[0]).await, 5, "the copy its send carried, not the replica");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_restored_owner_takes_up_the_version_a_live_workers_heartbeat_names() {
        // Finding 3 of the schedule explorer: the owner died after it had
        // applied round 5 and answered `w0` with version 6, not yet `w2`.
        // `b` restores from its replica at version 4; `w2` re-pushes its
        // step-5 gradient (catch-up opens round 5 with it) and waits for 6.
        // `w0` will not push to this shard until its other shard's round,
        // waiting for `w2`, closes: only its heartbeat says it holds 6.
        let (b, dead, w0, w2) = (PeerId::random(), PeerId::random(), PeerId::random(), PeerId::random());
        let (nodes, _log) = start(&[b]);
        let node = &nodes[0];
        let rx = node.agg.try_handoff(dead, HandoffKind::Replica, 0, state(4)).expect("aggregator has room");
        assert!(matches!(rx.await.expect("aggregator answers"), HandoffReply::Ack { version: 4 }));
        node.placement.send_replace(Some(placement(b, &[b, w0, w2])));
        assert_eq!(installed(node).await, 4, "restored from the replica");
        let pushed = node.agg.push(w2, 0, 5, 1, vec![1.0; SHARD_LEN]).await.expect("aggregator answers");
        assert!(matches!(pushed, PushReply::Accepted { version: 5, .. }), "{pushed:?}");
        let waiting = node.agg.pull(w2, 0, 6, Duration::from_secs(30));
        let heartbeat = async {
            // The pull is parked before the heartbeat's versions come.
            let r = node.agg.pull(w0, 0, 5, Duration::ZERO).await.expect("aggregator answers");
            assert!(matches!(r, PullReply::State { version: 5, .. }), "{r:?}");
            node.heard.send_replace(ShardNews { newest: vec![6], claimants: vec![Vec::new()] });
        };
        let (r, ()) = tokio::time::timeout(Duration::from_secs(10), futures::future::join(waiting, heartbeat))
            .await
            .expect("w2's pull answered within 10 s, not at the round timeout");
        let r = r.expect("aggregator answers");
        let PullReply::State { version, params } = r else { panic!("w2's pull: {r:?}") };
        // Round 5 applied with the one gradient it held, numbered 6.
        let mut round = Optimizer::new(optimizer(), SHARD_LEN).expect("an SGD optimizer");
        let mut expected = state(4).params;
        round.step(&mut expected, &[1.0; SHARD_LEN]).expect("a step");
        assert_eq!((version, params.as_slice()), (6, expected.as_slice()));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_transfer_to_an_owner_whose_takeover_found_no_copy_is_installed() {
        // The CI failure of 2026-11-26: `b` saw only the placement that made
        // it the owner (watch updates coalesce), found no model copy to take
        // the shard over from, and then kept `a`'s transfer for a placement
        // that would never come.
        let (a, b) = (PeerId::random(), PeerId::random());
        let (nodes, _log) = start(&[b]);
        let p = placement(b, &[a, b]);
        nodes[0].placement.send_replace(Some(p.clone()));
        taken_up(&nodes[0], a, p.epoch).await;
        hand(&nodes[0], a, 0, state(3)).await;
        assert_eq!(installed(&nodes[0]).await, 3);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_transfer_forwarded_to_a_stopped_leaver_is_kept_and_reaches_the_next_owner() {
        // Finding 2 of issue 47: `a`'s view still names the leaver, which
        // handed the shard to `a` and has stopped since. `a` forwards the
        // newest copy back to it; the send fails. Kept as a replica, the copy
        // was never passed on, and `c` took the shard over from an older one.
        let (a, leaver, c) = (PeerId::random(), PeerId::random(), PeerId::random());
        let (nodes, mut log) = start_among(&[a, c], &[leaver], Duration::from_secs(60), Duration::from_millis(200));
        nodes[0].placement.send_replace(Some(placement(leaver, &[a, leaver, c])));
        // `c`'s view: the owner, with the leaver gone and nothing to restore
        // from (the worker copy is empty): only a transfer installs it.
        nodes[1].placement.send_replace(Some(placement(c, &[a, c])));
        hand(&nodes[0], leaver, 0, state(5)).await;
        let mut held = nodes[0].agg.held();
        tokio::time::timeout(Duration::from_secs(10), held.wait_for(|h| h.kept == 1 && h.transfers == 0))
            .await
            .expect("the undelivered transfer kept within 10 s")
            .expect("aggregator running");
        assert!(!held.borrow().is_empty(), "a node leaving waits for a kept transfer");
        // `a`'s view catches up: the copy goes to `c`, which serves it.
        nodes[0].placement.send_replace(Some(placement(c, &[a, c])));
        assert_eq!(next(&mut log).await, (a, c, 2, 5), "passed on, one hop more");
        assert_eq!(installed(&nodes[1]).await, 5, "the newest copy is served");
        tokio::time::timeout(Duration::from_secs(10), held.wait_for(Held::is_empty))
            .await
            .expect("nothing kept once it is passed on")
            .expect("aggregator running");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_transfer_failing_while_the_view_moves_on_goes_to_the_new_owner_at_once() {
        // The interleaving behind a failure of the test above under load
        // (2026-12-06): `a`'s view moves on to `c` while its transfer to the
        // stopped leaver is still being retried, so that placement finds
        // nothing kept to pass on. When the send fails, the copy must go to
        // `c` then, not after the retry timer (60 s here).
        let (a, leaver, c) = (PeerId::random(), PeerId::random(), PeerId::random());
        let (nodes, mut log) = start_among(&[a, c], &[leaver], Duration::from_secs(60), Duration::from_secs(3));
        nodes[1].placement.send_replace(Some(placement(c, &[a, c])));
        forwarding_back(&nodes[0], leaver, &[a, leaver, c]).await;
        let moved = placement(c, &[a, c]);
        nodes[0].placement.send_replace(Some(moved.clone()));
        taken_up(&nodes[0], a, moved.epoch).await;
        assert_eq!(next(&mut log).await, (a, c, 2, 5), "passed on once the send failed, one hop more");
        assert_eq!(installed(&nodes[1]).await, 5, "the newest copy is served");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_kept_transfer_older_than_the_served_copy_is_a_replica() {
        // `a` forwards a transfer of version 5 to `gone`; while that send is
        // still retried (a 2 s handoff timeout), `a` becomes the owner and is
        // handed version 8. Then the send fails: the copy kept is older
        // than the one served, so it neither replaces it nor holds up a leave.
        let (a, gone) = (PeerId::random(), PeerId::random());
        let (nodes, _log) = start_among(&[a], &[gone], Duration::from_millis(50), Duration::from_secs(2));
        nodes[0].placement.send_replace(Some(placement(gone, &[a, gone])));
        hand(&nodes[0], PeerId::random(), 0, state(5)).await;
        let mut held = nodes[0].agg.held();
        tokio::time::timeout(Duration::from_secs(10), held.wait_for(|h| h.transfers == 1))
            .await
            .expect("forwarded within 10 s")
            .expect("aggregator running");
        nodes[0].placement.send_replace(Some(placement(a, &[a])));
        hand(&nodes[0], gone, 0, state(8)).await;
        tokio::time::timeout(Duration::from_secs(10), held.wait_for(|h| h.transfers == 0))
            .await
            .expect("the forward given up within 10 s")
            .expect("aggregator running");
        tokio::time::timeout(Duration::from_secs(10), held.wait_for(|h| h.shards == 1 && h.kept == 0))
            .await
            .expect("the stale copy settled within 10 s")
            .expect("aggregator running");
        assert_eq!(nodes[0].agg.stats().await.first().map(|s| s.version), Some(8), "the newer copy stays");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_transfer_kept_before_the_first_placement_goes_to_the_owner_it_names() {
        let (me, owner) = (PeerId::random(), PeerId::random());
        let (nodes, mut log) = start(&[me]);
        // It arrives before this node has any placement: kept.
        hand(&nodes[0], PeerId::random(), 0, state(7)).await;
        nodes[0].placement.send_replace(Some(placement(owner, &[me, owner])));
        assert_eq!(next(&mut log).await, (me, owner, 1, 7), "the kept transfer is passed on, one hop more");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_transfer_between_two_disagreeing_views_stops_after_the_hop_limit() {
        let (a, b) = (PeerId::random(), PeerId::random());
        let (nodes, mut log) = start(&[a, b]);
        // Each view names the other as the shard's owner.
        nodes[0].placement.send_replace(Some(placement(b, &[a, b])));
        nodes[1].placement.send_replace(Some(placement(a, &[a, b])));
        hand(&nodes[0], PeerId::random(), 0, state(9)).await;
        let mut hops = Vec::new();
        for _ in 0..MAX_TRANSFER_HOPS {
            let (from, to, h, version) = next(&mut log).await;
            assert_eq!(version, 9);
            assert_ne!(from, to);
            hops.push(h);
        }
        hops.sort_unstable();
        assert_eq!(hops, (1..=MAX_TRANSFER_HOPS).collect::<Vec<_>>());
        // `a` answered the last hop, so it has kept the transfer (or sent it
        // on). Its next view makes it the owner, with `b` gone: it installs
        // what it kept. Had it sent the transfer on, it would have no copy
        // (the worker copy is empty) and serve nothing.
        nodes[0].placement.send_replace(Some(placement(a, &[a])));
        assert_eq!(installed(&nodes[0]).await, 9, "the kept transfer is served");
        // And nothing moved after the limit.
        let mut extra = Vec::new();
        while let Ok(c) = log.try_recv() {
            extra.push(c);
        }
        assert!(extra.is_empty(), "no handoff after the hop limit: {extra:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_transfer_kept_at_the_hop_limit_reaches_the_owner_once_the_other_view_agrees() {
        // The elastic-explore failure: the views disagree, the transfer stops
        // at `a` after the hop limit, and then only `b`'s view changes (to
        // agree with `a`'s). `a` gets no new placement; its retry must still
        // deliver the shard to `b`, which waits for it, rather than keep a
        // copy that goes stale while `b` falls back to an older one.
        let (a, b) = (PeerId::random(), PeerId::random());
        let (nodes, mut log) = start_with(&[a, b], Duration::from_millis(100));
        nodes[0].placement.send_replace(Some(placement(b, &[a, b])));
        nodes[1].placement.send_replace(Some(placement(a, &[a, b])));
        hand(&nodes[0], PeerId::random(), 0, state(9)).await;
        for _ in 0..MAX_TRANSFER_HOPS {
            next(&mut log).await;
        }
        nodes[1].placement.send_replace(Some(placement(b, &[a, b])));
        assert_eq!(installed(&nodes[1]).await, 9, "the owner serves the transfer's version");
        assert_eq!(nodes[0].agg.stats().await.len(), 0, "the other node serves nothing");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pull_for_a_round_that_lost_the_workers_push_is_sent_back_to_push_again() {
        let (a, b) = (PeerId::random(), PeerId::random());
        let (nodes, _log) = start(&[a, b]);
        // `a` owns the shard at version 3; both nodes are workers.
        hand(&nodes[0], PeerId::random(), 0, state(3)).await;
        for n in &nodes {
            n.placement.send_replace(Some(placement(a, &[a, b])));
        }
        assert_eq!(installed(&nodes[0]).await, 3);
        // Worker `a`'s gradient joins round 3, which waits for `b`'s.
        let pushed = nodes[0].agg.push(a, 0, 3, 32, vec![0.5; SHARD_LEN]).await.expect("aggregator answers");
        assert!(matches!(pushed, PushReply::Accepted { .. }), "push accepted, got {pushed:?}");
        // The shard moves to `b` before the round is applied: the transfer
        // carries version 3, not the round's gradients.
        for n in nodes.iter().rev() {
            n.placement.send_replace(Some(placement(b, &[a, b])));
        }
        assert_eq!(installed(&nodes[1]).await, 3);
        // Worker `a` pulls version 4 from the new owner. Its gradient is not
        // in that round, so nothing but the round timeout would answer the
        // pull: it is told to push again (`NotOwner`) at once.
        let pull = nodes[1].agg.pull(a, 0, 4, Duration::from_secs(5)).await.expect("aggregator answers");
        assert!(matches!(pull, PullReply::NotOwner { .. }), "the worker is sent back to push, got {pull:?}");
        // Pushed again, the gradient joins the round there.
        let pushed = nodes[1].agg.push(a, 0, 3, 32, vec![0.5; SHARD_LEN]).await.expect("aggregator answers");
        assert!(matches!(pushed, PushReply::Accepted { .. }), "push accepted, got {pushed:?}");
    }

    /// A shard restored from a replica older than the workers' copies takes
    /// up their numbering (issue 16's restore stall). Until it closes a
    /// round, the shard's real state at that number replaces it, with the
    /// pushes its round holds (the schedule explorer's finding 6); once it
    /// has closed one, a copy of its own number is fenced.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_restored_copy_takes_up_the_workers_numbering_and_yields_to_the_real_state_at_it() {
        let (old, b, w) = (PeerId::random(), PeerId::random(), PeerId::random());
        let (nodes, _log) = start(&[b]);
        let rx = nodes[0].agg.try_handoff(old, HandoffKind::Replica, 0, state(5)).expect("aggregator has room");
        assert!(matches!(rx.await.expect("aggregator answers"), HandoffReply::Ack { version: 5 }));
        nodes[0].placement.send_replace(Some(placement(old, &[old, b, w])));
        // `old` is gone from the view: `b` restores the shard from its replica.
        nodes[0].placement.send_replace(Some(placement(b, &[b, w])));
        assert_eq!(installed(&nodes[0]).await, 5);
        // Worker `w` had pulled version 8 from `old`: the numbering moves to 8.
        let pushed = nodes[0].agg.push(w, 0, 8, 32, vec![0.5; SHARD_LEN]).await.expect("aggregator answers");
        assert!(matches!(pushed, PushReply::Accepted { version: 8, .. }), "got {pushed:?}");
        // The real state at 8 (a transfer that was on its way) replaces the
        // replica's parameters numbered 8.
        hand(&nodes[0], old, 0, state(8)).await;
        let pulled = nodes[0].agg.pull(b, 0, 0, Duration::from_secs(5)).await.expect("aggregator answers");
        let PullReply::State { version, params } = pulled else { panic!("a state, got {pulled:?}") };
        assert_eq!((version, params.as_slice()), (8, &[8.0f32; SHARD_LEN][..]), "the real state replaced it");
        // `w`'s push moved with the round: `b`'s closes it.
        let pushed = nodes[0].agg.push(b, 0, 8, 32, vec![0.5; SHARD_LEN]).await.expect("aggregator answers");
        assert!(matches!(pushed, PushReply::Accepted { version: 8, .. }), "got {pushed:?}");
        let pulled = nodes[0].agg.pull(b, 0, 9, Duration::from_secs(5)).await.expect("aggregator answers");
        let PullReply::State { version, params } = pulled else { panic!("round 8 closed, got {pulled:?}") };
        assert_eq!(version, 9);
        assert!(params.iter().all(|&x| x < 8.0), "both gradients applied to the real state: {params:?}");
        // A round closed: a copy of its own number is fenced now.
        let at_9 = nodes[0].agg.try_handoff(old, HandoffKind::Transfer, 0, state(9)).expect("aggregator has room");
        assert!(matches!(at_9.await.expect("aggregator answers"), HandoffReply::Fenced { .. }));
    }

    /// The explorer's finding 7: a shard restored at `old` and handed over
    /// before its first full round keeps catching up at `b`. Worker `w`
    /// holds version 5 from the owner that crashed; its push against 5
    /// moves the numbering there rather than joining round 3, where it
    /// would count as round 3's gradient and, pushed again for round 5
    /// once the worker is told to, twice.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_restored_shard_handed_over_before_it_settled_keeps_catching_up() {
        let (old, b, w, x) = (PeerId::random(), PeerId::random(), PeerId::random(), PeerId::random());
        for (room, expected) in [(8, 5), (0, 3)] {
            let (nodes, _log) = start(&[b]);
            nodes[0].placement.send_replace(Some(placement(old, &[old, b, w, x])));
            names_the_owner(&nodes[0], old).await;
            nodes[0].placement.send_replace(Some(placement(b, &[old, b, w, x])));
            // `b` awaits `old`'s transfer.
            tokio::time::timeout(Duration::from_secs(10), nodes[0].agg.held().wait_for(|h| h.pending == 1))
                .await
                .expect("the shard awaited within 10 s")
                .expect("aggregator running");
            hand(&nodes[0], old, 0, ShardState { catch_up_room: room, ..state(3) }).await;
            assert_eq!(installed(&nodes[0]).await, 3);
            let pushed = nodes[0].agg.push(w, 0, 5, 32, vec![0.5; SHARD_LEN]).await.expect("aggregator answers");
            assert!(
                matches!(pushed, PushReply::Accepted { version, .. } if version == expected),
                "room {room}: the push is in round {expected}, got {pushed:?}"
            );
        }
    }

    /// The explorer's finding 6: `b`'s view never heard `old` leave, so it
    /// goes from `old` owning the shard to owning it itself with `old` gone,
    /// while the placement it skipped gave the shard to `c`, which holds it
    /// now and hands it over. `c`'s heartbeat names the shard: `b` waits for
    /// its transfer rather than restoring its older replica (which would
    /// have thrown away the rounds `c` applied).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_owner_whose_view_skipped_a_move_waits_for_the_node_whose_heartbeat_names_the_shard() {
        let (old, b, c, w) = (PeerId::random(), PeerId::random(), PeerId::random(), PeerId::random());
        let (nodes, _log) = start(&[b]);
        let rx = nodes[0].agg.try_handoff(old, HandoffKind::Replica, 0, state(5)).expect("aggregator has room");
        assert!(matches!(rx.await.expect("aggregator answers"), HandoffReply::Ack { version: 5 }));
        nodes[0].heard.send_replace(ShardNews { newest: vec![7], claimants: vec![vec![c]] });
        nodes[0].placement.send_replace(Some(placement(old, &[old, b, c, w])));
        names_the_owner(&nodes[0], old).await;
        nodes[0].placement.send_replace(Some(placement(b, &[b, c, w])));
        // `b` waits: a worker's pull is parked, not answered from the replica.
        let held = nodes[0].agg.held();
        tokio::time::timeout(Duration::from_secs(10), held.clone().wait_for(|h| h.pending == 1))
            .await
            .expect("the shard awaited within 10 s")
            .expect("aggregator running");
        assert_eq!(held.borrow().shards, 0, "not restored from the replica");
        hand(&nodes[0], c, 0, state(7)).await;
        assert_eq!(installed(&nodes[0]).await, 7, "the transfer of the node that held it");
    }
}
