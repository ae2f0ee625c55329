//! The membership actor: publishes this node's heartbeat every
//! `heartbeat_ms`, feeds received heartbeats into the pure [`View`], runs the
//! failure detector, and publishes a [`ViewSnapshot`] whenever the view
//! changes.

use std::time::Duration;

use shoal_protocol::libp2p::PeerId;
use shoal_protocol::{
    Capabilities, CheckpointOffer, GossipMessage, Heartbeat, Pace, Role, RunId, ShardVersions, WIRE_VERSION,
};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::handles::membership::{Heard, MembershipHandle, ViewSnapshot};
use crate::handles::net::NetworkHandle;
use crate::policy::view::{RosterStatus, SelfState, View};

/// Membership settings.
#[derive(Debug, Clone)]
pub struct MembershipConfig {
    pub run: RunId,
    pub me: PeerId,
    pub incarnation: u64,
    pub config_hash: u64,
    pub capabilities: Capabilities,
    pub min_peers: usize,
    pub heartbeat: Duration,
    pub failure_timeout: Duration,
    /// What this node's checkpoint folder holds, gossiped from the first
    /// heartbeat on (the roster agrees on a resume point from them).
    pub checkpoints: Vec<CheckpointOffer>,
}

/// Start the actor. It stops when every handle has been dropped or the
/// network actor has gone.
/// `inbound` carries validated heartbeats and closed connections from the
/// network actor.
pub fn spawn(
    cfg: MembershipConfig,
    net: NetworkHandle,
    inbound: mpsc::Receiver<Heard>,
    tasks: &crate::ops::tasks::NodeTasks,
) -> MembershipHandle {
    let initial_self = SelfState {
        role: Role::Joining,
        owned_shards: Vec::new(),
        step: 0,
        model_version: 0,
        shard_versions: Vec::new(),
        frozen_epoch: None,
        announce: 0,
        service: Vec::new(),
        leaving: false,
        handing: Vec::new(),
        pace: Pace::default(),
        compute_samples_per_sec: 0.0,
        net_bytes_per_sec: 0.0,
        checkpoints: cfg.checkpoints.clone(),
        suspects: Vec::new(),
        finished: false,
    };
    let (self_tx, self_rx) = watch::channel(initial_self);
    let view = View::new(cfg.me, cfg.capabilities.can_aggregate, cfg.config_hash);
    let (view_tx, view_rx) =
        watch::channel(ViewSnapshot { roster: RosterStatus::Waiting { live: 1 }, view: view.clone(), now_ms: 0 });
    let actor = MembershipActor {
        cfg,
        net,
        view,
        inbound,
        self_state: self_rx,
        out: view_tx,
        started: Instant::now(),
        seq: 0,
        announced: 0,
    };
    tasks.spawn(actor.run());
    MembershipHandle::new(self_tx, view_rx)
}

struct MembershipActor {
    cfg: MembershipConfig,
    net: NetworkHandle,
    view: View,
    inbound: mpsc::Receiver<Heard>,
    self_state: watch::Receiver<SelfState>,
    out: watch::Sender<ViewSnapshot>,
    started: Instant,
    seq: u64,
    announced: u64,
}

impl MembershipActor {
    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    async fn run(mut self) {
        let mut tick = tokio::time::interval(self.cfg.heartbeat);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let timeout = self.cfg.failure_timeout.as_millis() as u64;
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    let now = self.now_ms();
                    let dead = self.view.expire(now, timeout);
                    if !dead.is_empty() {
                        // Once this node said `finished`, a silent peer has
                        // most likely finished too (docs/protocol.md §6.3).
                        if self.self_state.borrow().finished {
                            debug!(?dead, "peers went silent after the run");
                        } else {
                            warn!(?dead, "peers failed (no heartbeat within the failure timeout)");
                        }
                    }
                    // A peer that died without a reset keeps its connections
                    // open: close them, so requests waiting on it fail now
                    // and follow the shard to its next owner.
                    for peer in dead {
                        self.net.disconnect(peer);
                    }
                    if self.publish().await.is_err() {
                        break;
                    }
                    self.emit();
                }
                // Every MembershipHandle dropped: the node is gone.
                r = self.self_state.changed() => {
                    if r.is_err() {
                        break;
                    }
                    // Mark the value seen, or `changed()` would fire forever.
                    let announce = self.self_state.borrow_and_update().announce;
                    if announce != self.announced {
                        self.announced = announce;
                        if self.publish().await.is_err() {
                            break;
                        }
                    }
                }
                heard = self.inbound.recv() => match heard {
                    Some(Heard::Heartbeat(hb)) => {
                        let now = self.now_ms();
                        if self.view.observe(*hb, now) {
                            self.emit();
                        }
                    }
                    // After the run (docs/protocol.md §6.3): the last node
                    // to finish stops once it has heard everyone's
                    // `finished`, and its own may go down with its
                    // connections. Its peers would wait a failure timeout
                    // for it; the closed connection says it has stopped.
                    Some(Heard::Disconnected(peer)) => {
                        if self.self_state.borrow().finished && self.view.forget(&peer) {
                            debug!(%peer, "peer disconnected after the run: not waiting for it");
                            self.emit();
                        }
                    }
                    None => break,
                },
            }
        }
        debug!("membership stopping");
    }

    fn emit(&mut self) {
        let now = self.now_ms();
        let timeout = self.cfg.failure_timeout.as_millis() as u64;
        let roster = self.view.roster_status(self.cfg.min_peers, now, timeout);
        self.out.send_replace(ViewSnapshot { view: self.view.clone(), now_ms: now, roster });
    }

    async fn publish(&mut self) -> Result<(), ()> {
        self.seq += 1;
        let me = self.self_state.borrow().clone();
        let now = self.now_ms();
        let timeout = self.cfg.failure_timeout.as_millis() as u64;
        let epoch = me.frozen_epoch.unwrap_or_else(|| self.view.proposal(now, timeout).hash());
        let hb = Heartbeat {
            run: self.cfg.run.clone(),
            peer: self.cfg.me,
            incarnation: self.cfg.incarnation,
            seq: self.seq,
            epoch,
            config_hash: self.cfg.config_hash,
            protocol_version: WIRE_VERSION,
            // The configured capabilities, with the worker's measurements.
            capabilities: Capabilities {
                compute_samples_per_sec: me.compute_samples_per_sec,
                net_bytes_per_sec: me.net_bytes_per_sec,
                ..self.cfg.capabilities.clone()
            },
            role: if me.leaving { Role::Leaving } else { me.role },
            owned_shards: owned_or_handed(&me.owned_shards, &me.handing),
            step: me.step,
            model_version: me.model_version,
            shard_versions: ShardVersions::of(&me.shard_versions),
            service: me.service.iter().take(shoal_protocol::MAX_SERVICE_OBSERVATIONS).cloned().collect(),
            pace: me.pace,
            checkpoints: me.checkpoints.iter().take(shoal_protocol::MAX_CHECKPOINT_OFFERS).cloned().collect(),
            suspects: me.suspects.iter().take(shoal_protocol::MAX_SUSPECTS).copied().collect(),
            finished: me.finished,
        };
        self.net.publish(GossipMessage::Heartbeat(hb)).await.map_err(|_| ())
    }
}

/// The heartbeat's `owned_shards`: the placement's shards of this node and
/// those whose transfer its aggregator keeps or sends, sorted, at most
/// `MAX_OWNED_SHARDS`.
fn owned_or_handed(owned: &[u32], handing: &[u32]) -> Vec<u32> {
    let all: std::collections::BTreeSet<u32> = owned.iter().chain(handing).copied().collect();
    all.into_iter().take(shoal_protocol::MAX_OWNED_SHARDS).collect()
}
