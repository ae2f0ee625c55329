//! The aggregator's handle and messages: pushes and pulls from the local
//! worker and (forwarded by the network actor, without waiting) from peers,
//! and handoffs of shards between owners. The actor is
//! [`crate::actors::aggregator`].

use std::sync::Arc;
use std::time::Duration;

use shoal_protocol::libp2p::PeerId;
use shoal_protocol::HandoffKind;
use tokio::sync::{mpsc, oneshot, watch};

use crate::handles::handoff::ShardState;
use crate::policy::contribution::Contribution;
use crate::policy::delta::ShardDelta;

/// Answer to a push.
#[derive(Debug, Clone, PartialEq)]
pub enum PushReply {
    Accepted {
        version: u64,
        staleness: u64,
    },
    Stale {
        current_version: u64,
        max_staleness: u64,
    },
    NotOwner {
        epoch: u64,
        hint: Option<PeerId>,
    },
    /// The shard is assigned here but its state has not arrived: retry.
    Pending,
    /// The pusher is not a worker of this shard (the owner's view lost it).
    UnknownWorker,
    Invalid(String),
}

/// Answer to a pull.
#[derive(Debug, Clone, PartialEq)]
pub enum PullReply {
    State {
        version: u64,
        params: Arc<Vec<f32>>,
    },
    /// The update from the version the puller said it holds (`have`) to
    /// `delta.version` (delta pulls, `local_steps.delta`).
    Delta(Arc<ShardDelta>),
    NotReady {
        current_version: u64,
    },
    NotOwner {
        epoch: u64,
        hint: Option<PeerId>,
    },
}

/// Answer to a handoff.
#[derive(Debug, Clone, PartialEq)]
pub enum HandoffReply {
    Ack {
        version: u64,
    },
    /// A copy at least as new is already installed here.
    Fenced {
        epoch: u64,
    },
    Invalid(String),
}

/// What this node holds as an owner: a node leaving cleanly waits for
/// all of it to reach zero before it stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Held {
    /// Shards served here.
    pub shards: usize,
    /// Shards assigned here whose transfer is awaited.
    pub pending: usize,
    /// Transfers sent and not yet acknowledged.
    pub transfers: usize,
    /// Transfers kept here to pass on: one that came while the views
    /// disagreed, or one that could not be delivered. Each may be the
    /// newest copy of its shard.
    pub kept: usize,
}

impl Held {
    pub fn is_empty(&self) -> bool {
        self.shards == 0 && self.pending == 0 && self.transfers == 0 && self.kept == 0
    }
}

/// Per-shard counters for tests and status.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardStats {
    pub shard: u32,
    pub version: u64,
    pub max_staleness: u64,
    /// The median gradient norm of the last BSP round (or of the window of
    /// accepted pushes) when the norm check is on: the scale to pick
    /// `centered_clip:TAU` from.
    pub median_norm: Option<f32>,
}

/// The aggregator's mailbox. `TransferDone`, `TransferFailed`, `ReplicaDone`
/// and `CheckpointQueued` are the actor's own spawned tasks reporting back.
/// A pull parked right after an accepted push (a `PushPull` from a peer):
/// it waits for the version that the push needs.
pub(crate) struct ThenPull {
    pub wait: Duration,
    /// The version the puller holds exactly, for a delta answer.
    pub have: Option<u64>,
    pub reply: oneshot::Sender<PullReply>,
}

pub(crate) enum AggCommand {
    Push {
        worker: PeerId,
        shard: u32,
        base_version: u64,
        samples: u32,
        grad: Contribution,
        reply: oneshot::Sender<PushReply>,
        /// Dropped unanswered unless the push is accepted.
        then_pull: Option<ThenPull>,
    },
    Pull {
        worker: PeerId,
        shard: u32,
        min_version: u64,
        wait: Duration,
        /// The version the puller holds exactly, for a delta answer.
        have: Option<u64>,
        reply: oneshot::Sender<PullReply>,
    },
    Handoff {
        from: PeerId,
        kind: HandoffKind,
        /// Times the transfer was forwarded before it came here.
        hops: u64,
        state: ShardState,
        reply: oneshot::Sender<HandoffReply>,
    },
    /// A spawned transfer was acknowledged.
    TransferDone {
        /// The shard it carried.
        shard: u32,
    },
    /// A spawned transfer could not be delivered: keep it, to pass on.
    TransferFailed {
        /// The peer it could not reach.
        to: PeerId,
        /// Times it had been forwarded when it was sent.
        hops: u64,
        state: ShardState,
    },
    ReplicaDone {
        shard: u32,
    },
    Stats {
        reply: oneshot::Sender<Vec<ShardStats>>,
    },
    /// Resuming after a full stop: shard states from this node's checkpoint
    /// folder at the agreed versions, and the step workers resume at.
    Resume {
        states: Vec<ShardState>,
        reply: oneshot::Sender<()>,
    },
    /// An aligned checkpoint of `shard` entered the writer's queue.
    CheckpointQueued {
        shard: u32,
    },
    /// The worker copy holds the resumed model: shards may be started from
    /// it again.
    ResumeDone,
    /// Checkpoint every owned shard that changed since its last write, and
    /// answer once they are on disk.
    FlushCheckpoints {
        reply: oneshot::Sender<()>,
    },
}

/// Cloneable handle to the aggregator.
#[derive(Debug, Clone)]
pub struct AggregatorHandle {
    sender: mpsc::Sender<AggCommand>,
    held: watch::Receiver<Held>,
    suspects: watch::Receiver<Vec<PeerId>>,
    handing: watch::Receiver<Vec<u32>>,
}

/// Returned by [`AggregatorHandle::try_push`] / `try_pull` when the actor is
/// saturated or gone; the caller answers the peer with an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Busy;

impl AggregatorHandle {
    pub(crate) fn new(
        sender: mpsc::Sender<AggCommand>,
        held: watch::Receiver<Held>,
        suspects: watch::Receiver<Vec<PeerId>>,
        handing: watch::Receiver<Vec<u32>>,
    ) -> Self {
        Self { sender, held, suspects, handing }
    }

    /// What this node holds as an owner, as it changes.
    pub fn held(&self) -> watch::Receiver<Held> {
        self.held.clone()
    }

    /// The workers this owner marked as suspects since it started (at most
    /// `MAX_SUSPECTS`, in the order they turned suspect), as they change.
    pub fn suspects(&self) -> watch::Receiver<Vec<PeerId>> {
        self.suspects.clone()
    }

    /// The shards whose transfer this node keeps or sends, sorted, as they
    /// change: its heartbeat names them among the shards it owns, so that a
    /// new owner whose view skipped a move waits for the transfer rather
    /// than restoring an older copy (the schedule explorer's finding 6).
    pub fn handing(&self) -> watch::Receiver<Vec<u32>> {
        self.handing.clone()
    }

    async fn ask<T>(&self, cmd: impl FnOnce(oneshot::Sender<T>) -> AggCommand) -> anyhow::Result<T> {
        let (reply, rx) = oneshot::channel();
        self.sender.send(cmd(reply)).await.map_err(|_| anyhow::anyhow!("aggregator has stopped"))?;
        rx.await.map_err(|_| anyhow::anyhow!("aggregator dropped a request"))
    }

    pub async fn push(
        &self,
        worker: PeerId,
        shard: u32,
        base_version: u64,
        samples: u32,
        grad: impl Into<Contribution>,
    ) -> anyhow::Result<PushReply> {
        let grad = grad.into();
        self.ask(|reply| AggCommand::Push { worker, shard, base_version, samples, grad, reply, then_pull: None }).await
    }

    pub async fn pull(
        &self,
        worker: PeerId,
        shard: u32,
        min_version: u64,
        wait: Duration,
    ) -> anyhow::Result<PullReply> {
        self.ask(|reply| AggCommand::Pull { worker, shard, min_version, wait, have: None, reply }).await
    }

    fn try_ask<T>(&self, cmd: impl FnOnce(oneshot::Sender<T>) -> AggCommand) -> Result<oneshot::Receiver<T>, Busy> {
        let (reply, rx) = oneshot::channel();
        self.sender.try_send(cmd(reply)).map_err(|_| Busy)?;
        Ok(rx)
    }

    /// Non-blocking forms for the network actor.
    pub fn try_push(
        &self,
        worker: PeerId,
        shard: u32,
        base_version: u64,
        samples: u32,
        grad: Contribution,
    ) -> Result<oneshot::Receiver<PushReply>, Busy> {
        self.try_ask(|reply| AggCommand::Push { worker, shard, base_version, samples, grad, reply, then_pull: None })
    }

    /// A push and, if it is accepted, a pull of the version it needs (BSP:
    /// the one after its round; other policies: what the staleness bound
    /// lets through), held at most `wait`. The pull's receiver fails when
    /// the push was not accepted.
    pub fn try_push_pull(
        &self,
        worker: PeerId,
        push: (u32, u64, u32, Contribution),
        wait: Duration,
        have: Option<u64>,
    ) -> Result<(oneshot::Receiver<PushReply>, oneshot::Receiver<PullReply>), Busy> {
        let (shard, base_version, samples, grad) = push;
        let (pull_reply, pulled) = oneshot::channel();
        let then_pull = Some(ThenPull { wait, have, reply: pull_reply });
        let pushed =
            self.try_ask(|reply| AggCommand::Push { worker, shard, base_version, samples, grad, reply, then_pull })?;
        Ok((pushed, pulled))
    }

    /// A pull from a peer; `have`: the version it holds exactly, for a
    /// delta answer.
    pub fn try_pull(
        &self,
        worker: PeerId,
        shard: u32,
        (min_version, have): (u64, Option<u64>),
        wait: Duration,
    ) -> Result<oneshot::Receiver<PullReply>, Busy> {
        self.try_ask(|reply| AggCommand::Pull { worker, shard, min_version, wait, have, reply })
    }

    pub fn try_handoff(
        &self,
        from: PeerId,
        kind: HandoffKind,
        hops: u64,
        state: ShardState,
    ) -> Result<oneshot::Receiver<HandoffReply>, Busy> {
        self.try_ask(|reply| AggCommand::Handoff { from, kind, hops, state, reply })
    }

    /// Resume from checkpoints: install or pass on `states` when the first
    /// placement comes (call before the election starts).
    pub async fn resume(&self, states: Vec<ShardState>) -> anyhow::Result<()> {
        self.ask(|reply| AggCommand::Resume { states, reply }).await
    }

    /// The worker copy now holds the resumed model.
    pub async fn resume_done(&self) -> anyhow::Result<()> {
        self.sender.send(AggCommand::ResumeDone).await.map_err(|_| anyhow::anyhow!("aggregator has stopped"))
    }

    /// Write every owned shard that changed since its last checkpoint and
    /// wait for the writes (the end of a run). Nothing without checkpoints.
    pub async fn flush_checkpoints(&self) {
        let _ = self.ask(|reply| AggCommand::FlushCheckpoints { reply }).await;
    }

    pub async fn stats(&self) -> Vec<ShardStats> {
        self.ask(|reply| AggCommand::Stats { reply }).await.unwrap_or_default()
    }
}
