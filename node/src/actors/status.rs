//! The status actor: counters about this node, for progress bars, reports
//! and tests. Updates are fire-and-forget (`try_send`): a full channel drops
//! an update rather than slowing a training step.

use std::collections::BTreeMap;
use std::time::Instant;

use serde::Serialize;
use shoal_protocol::libp2p::PeerId;
use tokio::sync::{mpsc, oneshot};

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
    pub bytes_out: u64,
    pub bytes_in: u64,
    pub push_latency_ms: Option<f64>,
    pub pull_latency_ms: Option<f64>,
    /// Seconds of step time spent computing gradients vs. communicating.
    pub compute_secs: f64,
    pub comm_secs: f64,
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
    /// Joined mid-run: the step it started at and how many peers it fetched
    /// the model from.
    pub joined_at_step: Option<u64>,
    pub join_donors: usize,
    /// Left cleanly after this step.
    pub left_at_step: Option<u64>,
    /// BSP rounds this node's shards closed at the round timeout, without
    /// every worker's gradient.
    pub rounds_forced: u64,
    /// Aggregators in this node's current placement.
    pub aggregators: usize,
    /// Exploration of the number of aggregators: every trial, keep and
    /// revert this node decided (at most 1000 kept).
    pub exploration: Vec<ExploreRecord>,
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
    Role { role: RoleView, owned: Vec<u32> },
    Step { step: u64, samples: usize, loss: f32, compute_secs: f64, comm_secs: f64 },
    Version(u64),
    Bytes { out: u64, r#in: u64 },
    PushLatency(f64),
    PullLatency(f64),
    Accuracy(f32),
    Peers(usize),
    Staleness(u64),
    GossipDistance(f32),
    HandoffOut,
    HandoffIn,
    Restored { from_replica: bool },
    VersionRegression(u64),
    PushAccepted(PeerId),
    Joined { step: u64, donors: usize },
    Left { step: u64 },
    RoundForced,
    Aggregators(usize),
    Explore { step: u64, decision: crate::policy::explore::Decision },
}

enum StatusCommand {
    Event(StatusEvent),
    Snapshot(oneshot::Sender<StatusSnapshot>),
}

/// Cloneable handle to the status actor.
#[derive(Debug, Clone)]
pub struct StatusHandle {
    sender: mpsc::Sender<StatusCommand>,
}

impl StatusHandle {
    pub fn spawn(name: String, peer_id: String, total_steps: u64, capacity: usize) -> Self {
        let (sender, receiver) = mpsc::channel(capacity.max(1));
        let snap = StatusSnapshot { name, peer_id, total_steps, ..Default::default() };
        tokio::spawn(
            StatusActor { snap, receiver, started: None, born: Instant::now(), pushes: BTreeMap::new() }.run(),
        );
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
}

struct StatusActor {
    snap: StatusSnapshot,
    receiver: mpsc::Receiver<StatusCommand>,
    started: Option<Instant>,
    born: Instant,
    pushes: BTreeMap<PeerId, u64>,
}

fn ema(old: Option<f64>, new: f64) -> Option<f64> {
    Some(old.map_or(new, |o| 0.8 * o + 0.2 * new))
}

impl StatusActor {
    async fn run(mut self) {
        while let Some(cmd) = self.receiver.recv().await {
            match cmd {
                StatusCommand::Snapshot(reply) => {
                    self.snap.pushes_accepted = self.pushes.iter().map(|(p, n)| (p.to_string(), *n)).collect();
                    let _ = reply.send(self.snap.clone());
                }
                StatusCommand::Event(e) => self.apply(e),
            }
        }
    }

    fn apply(&mut self, e: StatusEvent) {
        let s = &mut self.snap;
        match e {
            StatusEvent::Role { role, owned } => {
                if (s.role != role || s.owned_shards != owned) && s.role_changes.len() < 1000 {
                    s.role_changes.push(RoleChange {
                        secs: self.born.elapsed().as_secs_f64(),
                        step: s.step,
                        role,
                        owned: owned.clone(),
                    });
                }
                s.role = role;
                s.owned_shards = owned;
            }
            StatusEvent::HandoffOut => s.handoffs_out += 1,
            StatusEvent::HandoffIn => s.handoffs_in += 1,
            StatusEvent::Restored { from_replica: true } => s.restored_from_replica += 1,
            StatusEvent::Restored { from_replica: false } => s.restored_from_worker_copy += 1,
            StatusEvent::VersionRegression(v) => s.max_version_regression = s.max_version_regression.max(v),
            // Counted by peer id; named as text only when a snapshot is taken.
            StatusEvent::PushAccepted(w) => *self.pushes.entry(w).or_default() += 1,
            StatusEvent::Joined { step, donors } => {
                s.joined_at_step = Some(step);
                s.join_donors = donors;
                s.step = step;
            }
            StatusEvent::Left { step } => s.left_at_step = Some(step),
            StatusEvent::RoundForced => s.rounds_forced += 1,
            StatusEvent::Aggregators(k) => s.aggregators = k,
            StatusEvent::Explore { step, decision } => {
                use crate::policy::explore::Decision;
                let (action, from, to, before, after) = match decision {
                    Decision::Try { from, to, baseline_micros } => ("try", from, to, baseline_micros, None),
                    Decision::Keep { from, k, before_micros, after_micros } => {
                        ("keep", from, k, before_micros, Some(after_micros))
                    }
                    Decision::Revert { tried, k, before_micros, after_micros, .. } => {
                        ("revert", tried, k, before_micros, Some(after_micros))
                    }
                };
                if s.exploration.len() < 1000 {
                    s.exploration.push(ExploreRecord {
                        secs: self.born.elapsed().as_secs_f64(),
                        step,
                        action,
                        from,
                        to,
                        before_ms: before / 1e3,
                        after_ms: after.map(|a| a / 1e3),
                    });
                }
            }
            StatusEvent::Step { step, samples, loss, compute_secs, comm_secs } => {
                let started = *self.started.get_or_insert_with(Instant::now);
                s.step = step;
                s.samples += samples as u64;
                s.last_loss = Some(loss);
                s.compute_secs += compute_secs;
                s.comm_secs += comm_secs;
                let secs = started.elapsed().as_secs_f64();
                if secs > 0.0 {
                    s.samples_per_sec = s.samples as f64 / secs;
                }
            }
            StatusEvent::Version(v) => s.model_version = v,
            StatusEvent::Bytes { out, r#in } => {
                s.bytes_out += out;
                s.bytes_in += r#in;
            }
            StatusEvent::PushLatency(ms) => s.push_latency_ms = ema(s.push_latency_ms, ms),
            StatusEvent::PullLatency(ms) => s.pull_latency_ms = ema(s.pull_latency_ms, ms),
            StatusEvent::Accuracy(a) => {
                s.last_accuracy = Some(a);
                let secs = self.started.map(|t| t.elapsed().as_secs_f64()).unwrap_or(0.0);
                if s.accuracy_history.len() < 1000 {
                    s.accuracy_history.push((s.step, secs, a));
                }
            }
            StatusEvent::Peers(n) => s.known_peers = n,
            StatusEvent::Staleness(st) => s.max_staleness = s.max_staleness.max(st),
            StatusEvent::GossipDistance(d) => {
                s.gossip_first_distance.get_or_insert(d);
                s.gossip_last_distance = Some(d);
            }
        }
    }
}
