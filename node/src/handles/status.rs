//! The status actor's handle and messages: counters about this node, for
//! progress bars, reports and tests. Updates are fire-and-forget
//! (`try_send`): a full channel drops an update rather than slowing a
//! training step. The actor is [`crate::actors::status`].

use std::collections::BTreeMap;

use serde::Serialize;
use shoal_protocol::libp2p::PeerId;
use tokio::sync::{mpsc, oneshot};

use crate::policy::history::History;

/// A node's role as shown to people.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum RoleView {
    #[default]
    Starting,
    Worker,
    Aggregator,
    /// Fetching the current model from peers before contributing.
    Joining,
    /// Handing its shards off before it stops.
    Leaving,
    Done,
}

impl RoleView {
    /// The role as `/status` writes it (its serde name).
    pub fn name(self) -> &'static str {
        match self {
            RoleView::Starting => "starting",
            RoleView::Worker => "worker",
            RoleView::Aggregator => "aggregator",
            RoleView::Joining => "joining",
            RoleView::Leaving => "leaving",
            RoleView::Done => "done",
        }
    }
}

/// The `/history` document: this node, its points and its events.
#[derive(Debug, Clone, Serialize)]
pub struct HistoryDoc {
    pub name: String,
    pub peer_id: String,
    #[serde(flatten)]
    pub history: History,
}

/// A point-in-time copy of the counters.
#[derive(Debug, Clone, Serialize, Default)]
pub struct StatusSnapshot {
    pub name: String,
    pub peer_id: String,
    pub role: RoleView,
    pub owned_shards: Vec<u32>,
    pub step: u64,
    pub total_steps: u64,
    pub model_version: u64,
    pub samples: u64,
    pub samples_per_sec: f64,
    pub last_loss: Option<f32>,
    pub last_accuracy: Option<f32>,
    /// Language models: the last validation loss in bits per byte.
    #[serde(default)]
    pub last_bits_per_byte: Option<f32>,
    /// Language models: the last validation perplexity (`exp` of the mean
    /// loss per token).
    #[serde(default)]
    pub last_perplexity: Option<f64>,
    pub bytes_out: u64,
    pub bytes_in: u64,
    /// Bytes of the exchanges with remote owners that were timed for the
    /// link rate, and their time: round trips less the time owners held
    /// answers for the round, exchanges in parallel adding theirs (the
    /// gossiped `capabilities.net_bytes_per_sec` is a moving average of
    /// the per-step ratio).
    #[serde(default)]
    pub link_bytes: u64,
    #[serde(default)]
    pub link_secs: f64,
    pub push_latency_ms: Option<f64>,
    pub pull_latency_ms: Option<f64>,
    /// Seconds of step time spent computing gradients vs. communicating
    /// (with `sync.overlap` the two run at once, so their sum exceeds
    /// `step_secs`).
    pub compute_secs: f64,
    pub comm_secs: f64,
    /// The part of `comm_secs` after the last shard arrived: copying the
    /// new parameters out for the snapshot and handing them to the
    /// trainer, which loads them into the model first thing in the next
    /// step's gradient call (counted in `compute_secs` since 2026-12-06).
    pub apply_secs: f64,
    /// Seconds from the start of each step to its end, summed (evaluations
    /// excluded).
    pub step_secs: f64,
    pub known_peers: usize,
    /// Largest staleness this node's shards accepted.
    pub max_staleness: u64,
    /// Gossip mode: relative parameter distance `||mine - theirs|| / ||mine||`
    /// to the peer copies averaged in, at the first and the latest exchange.
    pub gossip_first_distance: Option<f32>,
    pub gossip_last_distance: Option<f32>,
    /// `(step, seconds since the first step, test accuracy)` at each evaluation (at most 1000 kept).
    pub accuracy_history: Vec<(u64, f64, f32)>,
    /// Every role change: when (seconds since the node started), at which
    /// step, to which role and shards (at most 1000 kept).
    pub role_changes: Vec<RoleChange>,
    /// Shards handed to a new owner / taken over from an old one.
    pub handoffs_out: u64,
    pub handoffs_in: u64,
    /// Shards taken over from a replica / from a worker copy (no optimizer state).
    pub restored_from_replica: u64,
    pub restored_from_worker_copy: u64,
    /// Largest drop of a shard's version seen by this worker (an owner
    /// restored from an older replica).
    pub max_version_regression: u64,
    /// Pushes this node's shards accepted, per worker (peer id).
    pub pushes_accepted: BTreeMap<String, u64>,
    /// Gradients this node's shards rejected (norm check), per worker peer id.
    pub rejected_contributions: BTreeMap<String, u64>,
    /// Workers whose gradients this node rejected several times in a row
    /// (`policy::sync::SUSPECT_AFTER`), since it started.
    pub suspects: Vec<String>,
    /// Joined mid-run: the step it started at and how many peers it fetched
    /// the model from.
    pub joined_at_step: Option<u64>,
    pub join_donors: usize,
    /// Left cleanly after this step.
    pub left_at_step: Option<u64>,
    /// BSP rounds this node's shards closed at the round timeout, without
    /// every worker's gradient.
    pub rounds_forced: u64,
    /// Delta pulls whose update did not lead to the owner's shard (its
    /// base or its hash): each was followed by a pull of the whole shard.
    pub delta_mismatches: u64,
    /// Optimizer steps this node's shards took, and their passes over
    /// the shard in all (`ShardCore::take_work`): the mean is the owner's
    /// memory traffic per round, in shards.
    pub owner_steps: u64,
    pub owner_passes: f64,
    /// Aggregators in this node's current placement.
    pub aggregators: usize,
    /// The current placement's epoch (a hash of everything it was computed
    /// from, in hex), the hash of the live members it counts (in hex: equal
    /// on two nodes exactly when their views hold the same members) and
    /// their number. `None` before the first placement.
    pub placement_epoch: Option<String>,
    pub placement_members: Option<String>,
    pub placement_live: usize,
    /// Exploration of the number of aggregators: every trial, keep and
    /// revert this node decided (at most 1000 kept).
    pub exploration: Vec<ExploreRecord>,
    /// Shard checkpoints written and failed, and how long the last write
    /// took (seconds).
    pub checkpoints_written: u64,
    pub checkpoint_failures: u64,
    pub last_checkpoint_secs: Option<f64>,
    /// Newest version written per shard (by shard id).
    pub checkpoint_versions: BTreeMap<u32, u64>,
    /// Resumed from checkpoints after a full stop: the step the run went on from.
    pub resumed_at_step: Option<u64>,
    /// This node's push and pull encodings (`compression`; empty
    /// before training starts).
    pub compress_push: String,
    pub compress_pull: String,
    /// Memory held by error feedback's residuals (a lossy push encoding).
    pub residual_bytes: u64,
    /// Steps whose next gradients were computed while their exchange was in
    /// flight (`sync.overlap`).
    pub overlapped_steps: u64,
    /// Steps trained on a batch fitted below the step's own batch
    /// (`sync.fit_batch`), the samples they held, and the samples they
    /// skipped.
    pub fitted_steps: u64,
    pub fitted_samples: u64,
    pub shed_samples: u64,
    /// Steps trained on a batch grown to take on what fitted workers shed
    /// (`sync.fit_rebalance`), and the samples added.
    pub grown_steps: u64,
    pub grown_samples: u64,
    /// Backup workers (`sync.backup_workers`): samples whose gradients
    /// missed their round and were dropped (a step counts in the share of
    /// the model whose pushes were dropped), and the steps skipped to catch
    /// up with the round in progress.
    pub dropped_samples: f64,
    pub skipped_steps: u64,
    /// `PushPullMany` requests this worker sent (`cluster.push_pull_many`)
    /// and the shards they carried.
    pub batched_requests: u64,
    pub batched_shards: u64,
    /// This process's resident memory now and its peak since it started
    /// (Linux's `VmRSS` and `VmHWM`; none on other systems).
    pub rss_bytes: Option<u64>,
    pub peak_rss_bytes: Option<u64>,
}

/// One decision of this node's explorer (see [`crate::policy::explore`]).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ExploreRecord {
    pub secs: f64,
    /// The cluster's step when it was decided.
    pub step: u64,
    /// `try`, `keep` or `revert`.
    pub action: &'static str,
    /// Aggregators before and after: for `try` the trial's start and target,
    /// for `keep` the same pair, for `revert` the target given up and the k returned to.
    pub from: usize,
    pub to: usize,
    /// Median step time before the trial and (for keep and revert) with it, ms.
    pub before_ms: f64,
    pub after_ms: Option<f64>,
}

/// One role change of a node.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RoleChange {
    pub secs: f64,
    pub step: u64,
    pub role: RoleView,
    pub owned: Vec<u32>,
}

/// Something that happened.
#[derive(Debug, Clone)]
pub enum StatusEvent {
    Role {
        role: RoleView,
        owned: Vec<u32>,
    },
    Step {
        step: u64,
        samples: usize,
        loss: f32,
        compute_secs: f64,
        comm_secs: f64,
        apply_secs: f64,
        step_secs: f64,
    },
    Version(u64),
    Bytes {
        out: u64,
        r#in: u64,
    },
    /// One exchange timed for the link rate.
    Link {
        bytes: u64,
        secs: f64,
    },
    PushLatency(f64),
    PullLatency(f64),
    /// A test-set (validation) evaluation.
    Evaluated(shoal_models::Evaluation),
    Peers(usize),
    Staleness(u64),
    GossipDistance(f32),
    HandoffOut,
    HandoffIn,
    Restored {
        from_replica: bool,
    },
    VersionRegression(u64),
    /// A delta pull's update did not match this worker's copy.
    DeltaMismatch,
    /// A shard of this node's took `steps` steps, making `passes` passes
    /// over the shard for them.
    OwnerWork {
        steps: u64,
        passes: f64,
    },
    PushAccepted(PeerId),
    /// An owner's norm check dropped a gradient of `peer`; `suspect` once it
    /// has happened several times in a row.
    Rejected {
        peer: PeerId,
        suspect: bool,
    },
    Joined {
        step: u64,
        donors: usize,
    },
    Left {
        step: u64,
    },
    RoundForced,
    /// A new placement: its epoch, its aggregators and its live members.
    Placement {
        epoch: u64,
        aggregators: usize,
        members: u64,
        live: usize,
    },
    /// A placement whose owners changed: `owners[shard]`.
    Owners(Vec<PeerId>),
    Explore {
        step: u64,
        decision: crate::policy::explore::Decision,
    },
    CheckpointWritten {
        shard: u32,
        version: u64,
        secs: f64,
    },
    CheckpointFailed,
    Resumed {
        step: u64,
    },
    Compression {
        push: String,
        pull: String,
    },
    ResidualBytes(u64),
    /// A step whose next gradients were computed while its exchange was in
    /// flight (`sync.overlap`).
    Overlapped,
    /// A step trained on `samples` instead of its own batch of `nominal`
    /// (`sync.fit_batch`: fewer, fitted; or more, grown).
    FittedBatch {
        samples: usize,
        nominal: usize,
    },
    /// A step's pushes missed their rounds on some shards and were dropped
    /// (`sync.backup_workers`): its samples in the share of the model
    /// they covered.
    DroppedPushes {
        samples: f64,
    },
    /// Steps skipped to reach the round in progress after a dropped push.
    SkippedSteps(u64),
    /// One `PushPullMany` carried this many shards.
    Batched(u64),
}

/// The status actor's mailbox.
pub(crate) enum StatusCommand {
    Event(StatusEvent),
    Snapshot(oneshot::Sender<StatusSnapshot>),
    History(oneshot::Sender<HistoryDoc>),
}

/// Cloneable handle to the status actor.
#[derive(Debug, Clone)]
pub struct StatusHandle {
    sender: mpsc::Sender<StatusCommand>,
}

impl StatusHandle {
    pub(crate) fn new(sender: mpsc::Sender<StatusCommand>) -> Self {
        Self { sender }
    }

    /// Record an event; dropped if the actor is behind.
    pub fn record(&self, event: StatusEvent) {
        let _ = self.sender.try_send(StatusCommand::Event(event));
    }

    pub async fn snapshot(&self) -> Option<StatusSnapshot> {
        let (tx, rx) = oneshot::channel();
        self.sender.send(StatusCommand::Snapshot(tx)).await.ok()?;
        rx.await.ok()
    }

    /// The time series and events since the node started (`GET /history`).
    pub async fn history(&self) -> Option<HistoryDoc> {
        let (tx, rx) = oneshot::channel();
        self.sender.send(StatusCommand::History(tx)).await.ok()?;
        rx.await.ok()
    }
}

#[cfg(test)]
mod tests {
    use super::RoleView;

    #[test]
    fn a_role_name_is_its_serde_name() {
        use RoleView::*;
        for r in [Starting, Worker, Aggregator, Joining, Leaving, Done] {
            assert_eq!(
                serde_json::to_value(r).ok().and_then(|v| v.as_str().map(str::to_string)).as_deref(),
                Some(r.name())
            );
        }
    }
}
