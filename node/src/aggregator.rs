//! The aggregator actor: serves the shards this node owns.
//!
//! It wraps one [`ShardCore`] per owned shard (the policy logic is there,
//! pure) and adds what needs a clock and channels: pulls that must wait are
//! parked with a deadline and answered as soon as a push makes them ready,
//! or with `NotReady` when the deadline passes. Requests arrive from the
//! local worker (through this handle) and from peers (the network actor
//! forwards them with `try_send`, so the network never blocks on us).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use shoal_models::Optimizer;
use shoal_protocol::libp2p::PeerId;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tracing::{debug, info};

use crate::status::{StatusEvent, StatusHandle};
use crate::sync::{PushOutcome, ShardCore, SyncPolicy};

/// Answer to a push.
#[derive(Debug, Clone, PartialEq)]
pub enum PushReply {
    Accepted { version: u64, staleness: u64 },
    Stale { current_version: u64, max_staleness: u64 },
    NotOwner { epoch: u64 },
    Invalid(String),
}

/// Answer to a pull.
#[derive(Debug, Clone, PartialEq)]
pub enum PullReply {
    State { version: u64, params: Arc<Vec<f32>> },
    NotReady { current_version: u64 },
    NotOwner { epoch: u64 },
}

/// Everything one owned shard starts from.
#[derive(Debug)]
pub struct OwnedShard {
    pub shard: u32,
    pub params: Vec<f32>,
    pub optimizer: Optimizer,
    pub version: u64,
}

/// Per-shard counters for tests and status.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardStats {
    pub shard: u32,
    pub version: u64,
    pub max_staleness: u64,
}

enum AggCommand {
    Own {
        epoch: u64,
        policy: SyncPolicy,
        roster: Vec<PeerId>,
        shards: Vec<OwnedShard>,
    },
    Push {
        worker: PeerId,
        shard: u32,
        base_version: u64,
        samples: u32,
        grad: Vec<f32>,
        reply: oneshot::Sender<PushReply>,
    },
    Pull {
        worker: PeerId,
        shard: u32,
        min_version: u64,
        wait: Duration,
        reply: oneshot::Sender<PullReply>,
    },
    Stats {
        reply: oneshot::Sender<Vec<ShardStats>>,
    },
}

struct ParkedPull {
    worker: PeerId,
    shard: u32,
    min_version: u64,
    deadline: Instant,
    reply: oneshot::Sender<PullReply>,
}

/// Cloneable handle to the aggregator.
#[derive(Debug, Clone)]
pub struct AggregatorHandle {
    sender: mpsc::Sender<AggCommand>,
}

/// Returned by [`AggregatorHandle::try_push`] / `try_pull` when the actor is
/// saturated or gone; the caller answers the peer with an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Busy;

impl AggregatorHandle {
    pub fn spawn(status: StatusHandle, max_wait: Duration, capacity: usize) -> Self {
        let (sender, receiver) = mpsc::channel(capacity.max(1));
        let actor = AggregatorActor {
            receiver,
            shards: BTreeMap::new(),
            parked: Vec::new(),
            epoch: 0,
            status,
            max_wait,
            started: Instant::now(),
        };
        tokio::spawn(actor.run());
        Self { sender }
    }

    /// Take ownership of shards for a roster and policy.
    pub async fn own(
        &self,
        epoch: u64,
        policy: SyncPolicy,
        roster: Vec<PeerId>,
        shards: Vec<OwnedShard>,
    ) -> anyhow::Result<()> {
        self.sender
            .send(AggCommand::Own { epoch, policy, roster, shards })
            .await
            .map_err(|_| anyhow::anyhow!("aggregator has stopped"))
    }

    pub async fn push(
        &self,
        worker: PeerId,
        shard: u32,
        base_version: u64,
        samples: u32,
        grad: Vec<f32>,
    ) -> anyhow::Result<PushReply> {
        let (reply, rx) = oneshot::channel();
        self.sender
            .send(AggCommand::Push { worker, shard, base_version, samples, grad, reply })
            .await
            .map_err(|_| anyhow::anyhow!("aggregator has stopped"))?;
        rx.await.map_err(|_| anyhow::anyhow!("aggregator dropped a push"))
    }

    pub async fn pull(
        &self,
        worker: PeerId,
        shard: u32,
        min_version: u64,
        wait: Duration,
    ) -> anyhow::Result<PullReply> {
        let (reply, rx) = oneshot::channel();
        self.sender
            .send(AggCommand::Pull { worker, shard, min_version, wait, reply })
            .await
            .map_err(|_| anyhow::anyhow!("aggregator has stopped"))?;
        rx.await.map_err(|_| anyhow::anyhow!("aggregator dropped a pull"))
    }

    /// Non-blocking forms for the network actor.
    pub fn try_push(
        &self,
        worker: PeerId,
        shard: u32,
        base_version: u64,
        samples: u32,
        grad: Vec<f32>,
    ) -> Result<oneshot::Receiver<PushReply>, Busy> {
        let (reply, rx) = oneshot::channel();
        self.sender
            .try_send(AggCommand::Push { worker, shard, base_version, samples, grad, reply })
            .map_err(|_| Busy)?;
        Ok(rx)
    }

    pub fn try_pull(
        &self,
        worker: PeerId,
        shard: u32,
        min_version: u64,
        wait: Duration,
    ) -> Result<oneshot::Receiver<PullReply>, Busy> {
        let (reply, rx) = oneshot::channel();
        self.sender.try_send(AggCommand::Pull { worker, shard, min_version, wait, reply }).map_err(|_| Busy)?;
        Ok(rx)
    }

    pub async fn stats(&self) -> Vec<ShardStats> {
        let (reply, rx) = oneshot::channel();
        if self.sender.send(AggCommand::Stats { reply }).await.is_err() {
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }
}

struct AggregatorActor {
    receiver: mpsc::Receiver<AggCommand>,
    shards: BTreeMap<u32, ShardCore<PeerId>>,
    parked: Vec<ParkedPull>,
    epoch: u64,
    status: StatusHandle,
    max_wait: Duration,
    started: Instant,
}

impl AggregatorActor {
    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    async fn run(mut self) {
        loop {
            let next_deadline = self.parked.iter().map(|p| p.deadline).min();
            tokio::select! {
                cmd = self.receiver.recv() => match cmd {
                    Some(cmd) => self.handle(cmd),
                    None => break,
                },
                _ = sleep_until_opt(next_deadline) => self.expire(),
            }
        }
        debug!("aggregator stopping: all handles dropped");
    }

    fn handle(&mut self, cmd: AggCommand) {
        match cmd {
            AggCommand::Own { epoch, policy, roster, shards } => {
                info!(epoch, %policy, shards = ?shards.iter().map(|s| s.shard).collect::<Vec<_>>(), "owning shards");
                self.epoch = epoch;
                self.shards = shards
                    .into_iter()
                    .map(|s| {
                        (s.shard, ShardCore::new(s.params, s.optimizer, s.version, policy, roster.iter().copied()))
                    })
                    .collect();
            }
            AggCommand::Push { worker, shard, base_version, samples, grad, reply } => {
                let now = self.now_ms();
                let Some(core) = self.shards.get_mut(&shard) else {
                    let _ = reply.send(PushReply::NotOwner { epoch: self.epoch });
                    return;
                };
                let out = match core.push(&worker, base_version, samples, grad, now) {
                    PushOutcome::Accepted { version, staleness } => {
                        self.status.record(StatusEvent::Staleness(staleness));
                        PushReply::Accepted { version, staleness }
                    }
                    PushOutcome::Stale { current_version } => PushReply::Stale {
                        current_version,
                        max_staleness: core.policy().max_bound().unwrap_or(u64::MAX),
                    },
                    PushOutcome::UnknownWorker => PushReply::Invalid(format!("{worker} is not in the roster")),
                    PushOutcome::BadLength { expected, got } => {
                        PushReply::Invalid(format!("gradient for shard {shard} has {got} values, expected {expected}"))
                    }
                };
                let _ = reply.send(out);
                self.release_ready();
            }
            AggCommand::Pull { worker, shard, min_version, wait, reply } => {
                if !self.shards.contains_key(&shard) {
                    let _ = reply.send(PullReply::NotOwner { epoch: self.epoch });
                    return;
                }
                let deadline = Instant::now() + wait.min(self.max_wait);
                self.parked.push(ParkedPull { worker, shard, min_version, deadline, reply });
                self.release_ready();
            }
            AggCommand::Stats { reply } => {
                let stats = self
                    .shards
                    .iter()
                    .map(|(&shard, c)| ShardStats { shard, version: c.version(), max_staleness: c.max_staleness() })
                    .collect();
                let _ = reply.send(stats);
            }
        }
    }

    /// Answer every parked pull whose condition now holds.
    fn release_ready(&mut self) {
        let now = self.now_ms();
        // Every worker pulls the same new version: copy each shard once per pass.
        let mut copies: BTreeMap<u32, Arc<Vec<f32>>> = BTreeMap::new();
        let mut i = 0;
        while i < self.parked.len() {
            let p = &self.parked[i];
            let ready = self.shards.get(&p.shard).map(|c| c.pull_ready(&p.worker, p.min_version, now));
            match ready {
                Some(false) => i += 1,
                Some(true) => {
                    let p = self.parked.swap_remove(i);
                    if let Some(c) = self.shards.get(&p.shard) {
                        let params = copies.entry(p.shard).or_insert_with(|| Arc::new(c.params().to_vec())).clone();
                        let _ = p.reply.send(PullReply::State { version: c.version(), params });
                    }
                }
                None => {
                    let p = self.parked.swap_remove(i);
                    let _ = p.reply.send(PullReply::NotOwner { epoch: self.epoch });
                }
            }
        }
    }

    fn expire(&mut self) {
        let now = Instant::now();
        let mut i = 0;
        while i < self.parked.len() {
            if self.parked[i].deadline <= now {
                let p = self.parked.swap_remove(i);
                let current_version = self.shards.get(&p.shard).map(|c| c.version()).unwrap_or(0);
                let _ = p.reply.send(PullReply::NotReady { current_version });
            } else {
                i += 1;
            }
        }
    }
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
