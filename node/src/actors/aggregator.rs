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
//!   of the model with a fresh optimizer state;
//! - every `replica_every` versions an owned shard is copied to its backup
//!   (`Handoff::Replica`), the node that takes it over if this one dies.
//!
//! A transfer that meets a copy with the same or a higher version is refused
//! (`Fenced`): after a partition heals, the copy with the higher version
//! wins, and on a tie the one already installed stays.

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

use crate::handles::aggregator::{AggCommand, AggregatorHandle, HandoffReply, Held, PullReply, PushReply, ShardStats};
use crate::handles::checkpoint::CheckpointHandle;
use crate::handles::handoff::{to_wire, ShardState};
use crate::handles::net::{ModelSnapshot, NetworkHandle};
use crate::handles::status::{StatusEvent, StatusHandle};
use crate::ops::logging::short;
use crate::policy::placement::Placement;
use crate::policy::robust::Robust;
use crate::policy::schedule::LrSchedule;
use crate::policy::sync::{PushOutcome, ShardCore, SyncPolicy, SUSPECT_AFTER};

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
    /// How long a new owner waits for a live old owner's transfer.
    pub handoff_timeout: Duration,
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
    deadline: Instant,
    reply: oneshot::Sender<PullReply>,
}

/// A copy of a shard kept here but not served: a replica, or a transfer
/// that arrived before this node's own view made it the owner.
struct Stored {
    state: ShardState,
    transfer: bool,
}

/// Start the aggregator actor. It stops when every handle has been dropped.
pub fn spawn(
    cfg: AggregatorConfig,
    status: StatusHandle,
    net: NetworkHandle,
    placement: watch::Receiver<Option<Arc<Placement>>>,
    snapshot: watch::Receiver<ModelSnapshot>,
) -> AggregatorHandle {
    let (sender, receiver) = mpsc::channel(cfg.capacity.max(1));
    let (held_tx, held) = watch::channel(Held::default());
    let actor = AggregatorActor {
        held: held_tx,
        transfers: 0,
        me_tx: sender.downgrade(),
        receiver,
        cores: BTreeMap::new(),
        pending: BTreeMap::new(),
        stored: BTreeMap::new(),
        placement_rx: placement,
        placement: None,
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
    tokio::spawn(actor.run());
    AggregatorHandle::new(sender, held)
}

struct AggregatorActor {
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
    parked: Vec<ParkedPull>,
    replicating: BTreeSet<u32>,
    /// Version last replicated, per shard.
    replicated: BTreeMap<u32, u64>,
    status: StatusHandle,
    net: NetworkHandle,
    snapshot: watch::Receiver<ModelSnapshot>,
    started: Instant,
    held: watch::Sender<Held>,
    /// Transfers in flight.
    transfers: usize,
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
        let now = Held { shards: self.cores.len(), pending: self.pending.len(), transfers: self.transfers };
        self.held.send_if_modified(|h| std::mem::replace(h, now) != now);
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
        loop {
            let rounds = self
                .cores
                .values()
                .filter_map(|c| c.round_deadline_ms(self.cfg.round_timeout_ms))
                .min()
                .map(|ms| self.started + Duration::from_millis(ms));
            let next_deadline =
                self.parked.iter().map(|p| p.deadline).chain(self.pending.values().copied()).chain(rounds).min();
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
                _ = sleep_until_opt(next_deadline) => self.expire(),
            }
            self.publish_held();
        }
        debug!("aggregator stopping: all handles dropped");
    }

    fn handle(&mut self, cmd: AggCommand) {
        match cmd {
            AggCommand::Push { worker, shard, base_version, samples, grad, reply, then_pull } => {
                let now = self.now_ms();
                let Some(core) = self.cores.get_mut(&shard) else {
                    let r = if self.pending.contains_key(&shard) {
                        PushReply::Pending
                    } else {
                        PushReply::NotOwner { epoch: self.epoch(), hint: self.hint(shard) }
                    };
                    let _ = reply.send(r);
                    return;
                };
                let before = core.version();
                let out = match core.push(&worker, base_version, samples, grad, now) {
                    PushOutcome::Accepted { version, staleness } => {
                        self.status.record(StatusEvent::Staleness(staleness));
                        self.status.record(StatusEvent::PushAccepted(worker));
                        PushReply::Accepted { version, staleness }
                    }
                    PushOutcome::Stale { current_version } => PushReply::Stale {
                        current_version,
                        max_staleness: core.policy().max_bound().unwrap_or(u64::MAX),
                    },
                    PushOutcome::UnknownWorker => PushReply::UnknownWorker,
                    PushOutcome::BadLength { expected, got } => {
                        PushReply::Invalid(format!("gradient for shard {shard} has {got} values, expected {expected}"))
                    }
                };
                let bumped = core.version() != before;
                report_rejections(&self.status, shard, core);
                if let (PushReply::Accepted { version, .. }, Some(then)) = (&out, then_pull) {
                    self.park(worker, shard, self.cfg.policy.pull_after_push(*version), then.wait, then.reply);
                }
                let _ = reply.send(out);
                if bumped {
                    self.maybe_replicate(shard);
                    self.maybe_checkpoint(shard);
                }
                self.release_ready();
            }
            AggCommand::Pull { worker, shard, min_version, wait, reply } => {
                if !self.cores.contains_key(&shard) && !self.pending.contains_key(&shard) {
                    let _ = reply.send(PullReply::NotOwner { epoch: self.epoch(), hint: self.hint(shard) });
                    return;
                }
                self.park(worker, shard, min_version, wait, reply);
                self.release_ready();
            }
            AggCommand::Handoff { from, kind, state, reply } => {
                let r = self.receive(from, kind, state);
                let _ = reply.send(r);
                self.release_ready();
            }
            AggCommand::TransferDone => {
                self.transfers = self.transfers.saturating_sub(1);
            }
            AggCommand::TransferFailed(state) => {
                self.transfers = self.transfers.saturating_sub(1);
                warn!(shard = state.shard, version = state.version, "transfer undelivered; keeping it as a replica");
                self.store(state, false);
            }
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
            AggCommand::FlushCheckpoints { reply } => {
                let owned: Vec<u32> = self.cores.keys().copied().collect();
                let due: Vec<ShardCheckpoint> =
                    owned.into_iter().filter_map(|s| self.checkpoint_of(s, true)).map(|c| c.0).collect();
                match self.cfg.checkpoint.as_ref().map(|c| c.writer.clone()) {
                    Some(w) => {
                        // One task, in order: the flush answers after these writes.
                        tokio::spawn(async move {
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
            AggCommand::Stats { reply } => {
                let stats = self
                    .cores
                    .iter()
                    .map(|(&shard, c)| ShardStats {
                        shard,
                        version: c.version(),
                        max_staleness: c.max_staleness(),
                        median_norm: c.median_norm(),
                    })
                    .collect();
                let _ = reply.send(stats);
            }
        }
    }

    /// Keep a copy unless a newer one is already kept.
    fn store(&mut self, state: ShardState, transfer: bool) {
        let newer = self.stored.get(&state.shard).is_none_or(|s| state.version >= s.state.version);
        if newer {
            self.stored.insert(state.shard, Stored { state, transfer });
        }
    }

    fn receive(&mut self, from: PeerId, kind: HandoffKind, state: ShardState) -> HandoffReply {
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
                self.store(state, false);
                HandoffReply::Ack { version }
            }
            HandoffKind::Transfer => {
                if let Some(core) = self.cores.get(&shard) {
                    if core.version() >= state.version {
                        info!(shard, mine = core.version(), theirs = state.version, %from, "transfer fenced: ours is as new");
                        return HandoffReply::Fenced { epoch: self.epoch() };
                    }
                    info!(shard, mine = core.version(), theirs = state.version, %from, "newer copy replaces ours");
                    let version = state.version;
                    self.install(state);
                    return HandoffReply::Ack { version };
                }
                let version = state.version;
                self.status.record(StatusEvent::HandoffIn);
                let owner = self.placement.as_ref().and_then(|p| p.owner(shard));
                if self.pending.remove(&shard).is_some() {
                    info!(shard, version, %from, "shard handed over");
                    self.install(state);
                } else if let Some(to) = owner.filter(|o| *o != self.cfg.me) {
                    // The shard moved on while it was on the wire (possibly back
                    // to the sender, which now waits for it): pass it along.
                    info!(shard, version, to = %short(&to), "forwarding a transfer to the current owner");
                    self.spawn_send(to, HandoffKind::Transfer, state);
                } else {
                    // Our view has not made us the owner yet: keep it until it does.
                    self.store(state, true);
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
        self.cores.insert(
            state.shard,
            ShardCore::new(state.params, optimizer, state.version, self.cfg.policy, workers)
                .with_schedule(self.cfg.schedule)
                .with_robust(self.cfg.robust),
        );
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
            self.install(s.state);
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
        self.install(ShardState { shard, version: snap.version, params: snap.params[range].to_vec(), optimizer });
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
                Some(o) if o == me => self.store(state, true),
                Some(o) => {
                    info!(shard = state.shard, version = state.version, to = %short(&o), "passing a checkpointed shard to its owner");
                    self.spawn_send(o, HandoffKind::Transfer, state);
                }
                None => {}
            }
        }
        for (&shard, core) in self.cores.iter_mut() {
            // An empty worker set is ignored there.
            core.set_workers(new.workers.iter().copied());
            report_rejections(&self.status, shard, core);
        }
        let lost: Vec<u32> = self.cores.keys().copied().filter(|&s| new.owner(s) != Some(me)).collect();
        for shard in lost {
            let Some(core) = self.cores.remove(&shard) else { continue };
            let Some(to) = new.owner(shard) else { continue };
            let (params, optimizer, version) = core.export();
            info!(shard, version, to = %short(&to), "handing the shard over");
            self.status.record(StatusEvent::HandoffOut);
            self.spawn_send(to, HandoffKind::Transfer, ShardState { shard, version, params, optimizer });
        }
        // An early transfer kept until a placement came, where that placement
        // makes another node the owner: pass it on (as `receive` does when
        // the placement is already known), or it would go stale here while
        // that owner waits for it and falls back to an older replica.
        let moved_on: Vec<u32> = self
            .stored
            .iter()
            .filter(|(s, st)| st.transfer && new.owner(**s).is_some_and(|o| o != me))
            .map(|(s, _)| *s)
            .collect();
        for shard in moved_on {
            if let (Some(st), Some(to)) = (self.stored.remove(&shard), new.owner(shard)) {
                info!(shard, version = st.state.version, to = %short(&to), "forwarding a stored transfer to the shard's owner");
                self.spawn_send(to, HandoffKind::Transfer, st.state);
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
        let deadline = Instant::now() + self.cfg.handoff_timeout;
        let starting = self.snapshot.borrow().version == 0;
        for shard in new.owned_by(&me) {
            if self.cores.contains_key(&shard) || self.pending.contains_key(&shard) {
                continue;
            }
            let previous = old.as_ref().and_then(|o| o.owner(shard));
            match previous {
                _ if self.stored.get(&shard).is_some_and(|s| s.transfer) => self.restore(shard),
                // Training starts: every node holds the same initial model.
                None if starting => self.restore(shard),
                // A node that joined mid-run: the current owner hands it over.
                None => {
                    debug!(shard, "joined mid-run: waiting for the shard's transfer");
                    self.pending.insert(shard, deadline);
                }
                Some(p) if p == me || !new.is_live(&p) => self.restore(shard),
                Some(p) => {
                    debug!(shard, from = %p, "waiting for the shard's transfer");
                    self.pending.insert(shard, deadline);
                }
            }
        }
        self.release_ready();
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
            tokio::spawn(async move {
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
        self.spawn_send(backup, HandoffKind::Replica, ShardState { shard, version, params, optimizer });
    }

    /// Deliver a transfer or replica from a task of its own (the actor keeps serving).
    fn spawn_send(&mut self, to: PeerId, kind: HandoffKind, state: ShardState) {
        if kind == HandoffKind::Transfer {
            self.transfers += 1;
        }
        let net = self.net.clone();
        let back = self.me_tx.clone();
        let (run, me, incarnation) = (self.cfg.run.clone(), self.cfg.me, self.cfg.incarnation);
        let deadline = Instant::now() + self.cfg.handoff_timeout;
        tokio::spawn(async move {
            let shard = state.shard;
            let result = send_handoff(&net, to, &run, me, incarnation, kind, &state, deadline).await;
            let msg = match (kind, result) {
                (HandoffKind::Replica, r) => {
                    if let Err(e) = r {
                        debug!(shard, %to, error = %format!("{e:#}"), "replica not delivered");
                    }
                    AggCommand::ReplicaDone { shard }
                }
                (HandoffKind::Transfer, Ok(())) => AggCommand::TransferDone,
                (HandoffKind::Transfer, Err(e)) => {
                    warn!(shard, %to, error = %format!("{e:#}"), "transfer failed");
                    AggCommand::TransferFailed(state)
                }
            };
            if let Some(tx) = back.upgrade() {
                let _ = tx.send(msg).await;
            }
        });
    }

    /// Hold a pull until the shard's version and the policy let it through,
    /// at most `wait` (capped by `max_wait`); `release_ready` answers it.
    fn park(
        &mut self,
        worker: PeerId,
        shard: u32,
        min_version: u64,
        wait: Duration,
        reply: oneshot::Sender<PullReply>,
    ) {
        let deadline = Instant::now() + wait.min(self.cfg.max_wait);
        self.parked.push(ParkedPull { worker, shard, min_version, deadline, reply });
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
                    missing,
                    timeout_ms = self.cfg.round_timeout_ms,
                    "BSP round closed without every worker's gradient"
                );
                self.status.record(StatusEvent::RoundForced);
                report_rejections(&self.status, shard, core);
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
    kind: HandoffKind,
    state: &ShardState,
    deadline: Instant,
) -> anyhow::Result<()> {
    let req = ShardRequest::Handoff(to_wire(run, me, incarnation, kind, state)?);
    let mut backoff = Duration::from_millis(20);
    loop {
        let err = match net.request(to, req.clone()).await {
            Ok(ShardResponse::HandoffAck { .. }) | Ok(ShardResponse::Fenced { .. }) => return Ok(()),
            Ok(ShardResponse::Error(e)) if e.code == ErrorCode::Busy => format!("busy: {}", e.message),
            Ok(other) => bail!("{to} answered a handoff with {}", other.kind()),
            Err(e) => e.to_string(),
        };
        if Instant::now() + backoff >= deadline {
            bail!("handoff of shard {} to {to} kept failing: {err}", state.shard);
        }
        // Back-off between retries of a failed request, not synchronisation.
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// Reports the contributions the norm check dropped on `shard`: each to
/// the status counters, and a warning when a worker becomes a suspect.
fn report_rejections(status: &StatusHandle, shard: u32, core: &mut ShardCore<PeerId>) {
    for r in core.take_rejections() {
        if r.streak == SUSPECT_AFTER {
            warn!(shard, worker = %short(&r.worker), norm = r.norm, median = r.median, streak = r.streak,
                  "suspect worker: its gradients were rejected by the norm check, round after round");
        } else {
            debug!(shard, worker = %short(&r.worker), norm = r.norm, median = r.median, "gradient rejected by the norm check");
        }
        status.record(StatusEvent::Rejected { peer: r.worker, suspect: r.suspect() });
    }
}
