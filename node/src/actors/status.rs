//! The status actor: keeps the counters that [`StatusHandle`] reports.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use shoal_protocol::libp2p::PeerId;
use tokio::sync::mpsc;

use crate::handles::status::{
    ExploreRecord, HistoryDoc, RoleChange, RoleView, StatusCommand, StatusEvent, StatusHandle, StatusSnapshot,
};
use crate::policy::explore::Decision;
use crate::policy::history::{Event, History, Point};

/// Points `GET /history` keeps (thinned evenly as the run grows), and events.
pub const HISTORY_POINTS: usize = 2000;
pub const HISTORY_EVENTS: usize = 1000;

/// Start the status actor. It stops when every handle has been dropped.
pub fn spawn(
    name: String,
    peer_id: String,
    total_steps: u64,
    capacity: usize,
    tasks: &crate::ops::tasks::NodeTasks,
) -> StatusHandle {
    let (sender, receiver) = mpsc::channel(capacity.max(1));
    let snap = StatusSnapshot { name, peer_id, total_steps, ..Default::default() };
    tasks.spawn(
        StatusActor {
            snap,
            receiver,
            started: None,
            born: Instant::now(),
            pushes: BTreeMap::new(),
            rejected: BTreeMap::new(),
            suspects: BTreeSet::new(),
            history: History::new(HISTORY_POINTS, HISTORY_EVENTS),
        }
        .run(),
    );
    StatusHandle::new(sender)
}

struct StatusActor {
    snap: StatusSnapshot,
    receiver: mpsc::Receiver<StatusCommand>,
    started: Option<Instant>,
    born: Instant,
    pushes: BTreeMap<PeerId, u64>,
    rejected: BTreeMap<PeerId, u64>,
    suspects: BTreeSet<PeerId>,
    history: History,
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
                    self.snap.rejected_contributions = self.rejected.iter().map(|(p, n)| (p.to_string(), *n)).collect();
                    self.snap.suspects = self.suspects.iter().map(ToString::to_string).collect();
                    let memory = crate::ops::memory::current();
                    self.snap.rss_bytes = memory.map(|m| m.rss_bytes);
                    self.snap.peak_rss_bytes = memory.map(|m| m.peak_rss_bytes);
                    let _ = reply.send(self.snap.clone());
                }
                StatusCommand::History(reply) => {
                    let (name, peer_id) = (self.snap.name.clone(), self.snap.peer_id.clone());
                    let _ = reply.send(HistoryDoc { name, peer_id, history: self.history.clone() });
                }
                StatusCommand::Event(e) => self.apply(e),
            }
        }
    }

    /// Folds one event into the snapshot (or, for the counters kept by
    /// peer, into those).
    fn apply(&mut self, e: StatusEvent) {
        let s = &mut self.snap;
        match e {
            StatusEvent::Role { role, owned } => self.on_role(role, owned),
            StatusEvent::HandoffOut => {
                s.handoffs_out += 1;
                self.mark("shard_out", "a shard handed to its new owner".into());
            }
            StatusEvent::HandoffIn => {
                s.handoffs_in += 1;
                self.mark("shard_in", "a shard taken over from its old owner".into());
            }
            StatusEvent::Restored { from_replica: true } => s.restored_from_replica += 1,
            StatusEvent::Restored { from_replica: false } => s.restored_from_worker_copy += 1,
            StatusEvent::VersionRegression(v) => s.max_version_regression = s.max_version_regression.max(v),
            // Counted by peer id; named as text only when a snapshot is taken.
            StatusEvent::PushAccepted(w) => *self.pushes.entry(w).or_default() += 1,
            StatusEvent::Rejected { peer, suspect } => self.on_rejected(peer, suspect),
            StatusEvent::Joined { step, donors } => {
                s.joined_at_step = Some(step);
                s.join_donors = donors;
                s.step = step;
                self.mark("joined", format!("joined at step {step}, the model from {donors} peers"));
            }
            StatusEvent::Left { step } => {
                s.left_at_step = Some(step);
                self.mark("left", format!("left after step {step}"));
            }
            StatusEvent::DeltaMismatch => s.delta_mismatches += 1,
            StatusEvent::OwnerWork { steps, passes } => {
                s.owner_steps += steps;
                s.owner_passes += passes;
            }
            StatusEvent::RoundForced => {
                s.rounds_forced += 1;
                self.mark("forced_round", "a BSP round closed at its timeout".into());
            }
            StatusEvent::CheckpointWritten { shard, version, secs } => self.on_checkpoint_written(shard, version, secs),
            StatusEvent::CheckpointFailed => s.checkpoint_failures += 1,
            StatusEvent::Resumed { step } => {
                s.resumed_at_step = Some(step);
                s.step = step;
                self.mark("resumed", format!("resumed from checkpoints at step {step}"));
            }
            StatusEvent::Placement { epoch, aggregators, members, live } => {
                self.on_placement(epoch, aggregators, members, live);
            }
            StatusEvent::Owners(owners) => {
                let owners: Vec<String> = owners.iter().map(ToString::to_string).collect();
                self.history.owners(self.born.elapsed().as_secs_f64(), s.step, &owners);
            }
            StatusEvent::Compression { push, pull } => {
                s.compress_push = push;
                s.compress_pull = pull;
            }
            StatusEvent::ResidualBytes(b) => s.residual_bytes = b,
            StatusEvent::Overlapped => s.overlapped_steps += 1,
            StatusEvent::FittedBatch { samples, nominal } => self.on_fitted_batch(samples, nominal),
            StatusEvent::DroppedPushes { samples } => s.dropped_samples += samples,
            StatusEvent::Batched(shards) => {
                s.batched_requests += 1;
                s.batched_shards += shards;
            }
            StatusEvent::SkippedSteps(n) => {
                // The step the worker goes on from.
                s.skipped_steps += n;
                s.step += n;
            }
            StatusEvent::Explore { step, decision } => self.on_explore(step, decision),
            StatusEvent::Step { step, samples, loss, compute_secs, comm_secs, apply_secs, step_secs } => {
                s.compute_secs += compute_secs;
                s.comm_secs += comm_secs;
                s.apply_secs += apply_secs;
                s.step_secs += step_secs;
                self.on_step(step, samples, loss);
            }
            StatusEvent::Version(v) => s.model_version = v,
            StatusEvent::Bytes { out, r#in } => {
                s.bytes_out += out;
                s.bytes_in += r#in;
            }
            StatusEvent::Link { bytes, secs } => {
                s.link_bytes += bytes;
                s.link_secs += secs;
            }
            StatusEvent::PushLatency(ms) => s.push_latency_ms = ema(s.push_latency_ms, ms),
            StatusEvent::PullLatency(ms) => s.pull_latency_ms = ema(s.pull_latency_ms, ms),
            StatusEvent::Evaluated(e) => self.on_evaluated(e),
            StatusEvent::Peers(n) => s.known_peers = n,
            StatusEvent::Staleness(st) => s.max_staleness = s.max_staleness.max(st),
            StatusEvent::GossipDistance(d) => {
                s.gossip_first_distance.get_or_insert(d);
                s.gossip_last_distance = Some(d);
            }
        }
    }

    /// A new role or set of owned shards: recorded as a change (the first
    /// 1000 changes) when either differs.
    fn on_role(&mut self, role: RoleView, owned: Vec<u32>) {
        let s = &mut self.snap;
        let changed = s.role != role || s.owned_shards != owned;
        if changed && s.role_changes.len() < 1000 {
            s.role_changes.push(RoleChange {
                secs: self.born.elapsed().as_secs_f64(),
                step: s.step,
                role,
                owned: owned.clone(),
            });
        }
        let kind = match (s.role, role) {
            (RoleView::Aggregator, RoleView::Worker) => "demoted",
            (RoleView::Worker, RoleView::Aggregator) => "promoted",
            (from, to) if from == to => "shards",
            _ => "role",
        };
        s.role = role;
        s.owned_shards = owned;
        if changed {
            let detail = format!("{} {:?}", role.name(), s.owned_shards);
            self.mark(kind, detail);
        }
    }

    /// An event for `/history`, at the current step.
    fn mark(&mut self, kind: &'static str, detail: String) {
        let (t, step) = (self.born.elapsed().as_secs_f64(), self.snap.step);
        self.history.event(Event { t, step, kind, detail });
    }

    /// A contribution from `peer` rejected; `suspect`: the peer is now
    /// suspected of sending bad updates.
    fn on_rejected(&mut self, peer: PeerId, suspect: bool) {
        *self.rejected.entry(peer).or_default() += 1;
        if suspect {
            self.suspects.insert(peer);
        }
    }

    /// A shard's checkpoint written: counted, its time kept, and the
    /// shard's highest version written raised.
    fn on_checkpoint_written(&mut self, shard: u32, version: u64, secs: f64) {
        let s = &mut self.snap;
        s.checkpoints_written += 1;
        s.last_checkpoint_secs = Some(secs);
        let v = s.checkpoint_versions.entry(shard).or_default();
        *v = (*v).max(version);
    }

    /// A new placement: its epoch, members and aggregators.
    fn on_placement(&mut self, epoch: u64, k: usize, members: u64, live: usize) {
        let s = &mut self.snap;
        s.placement_epoch = Some(format!("{epoch:016x}"));
        s.placement_members = Some(format!("{members:016x}"));
        s.placement_live = live;
        if s.aggregators != k {
            s.aggregators = k;
            self.mark("aggregators", format!("{k} aggregators"));
        }
    }

    /// A step trained on `samples` where the nominal batch is `nominal`:
    /// counted as shed (fitted to memory) or grown samples.
    fn on_fitted_batch(&mut self, samples: usize, nominal: usize) {
        let s = &mut self.snap;
        let (n, of) = (samples as u64, nominal as u64);
        if n < of {
            s.fitted_steps += 1;
            s.fitted_samples += n;
            s.shed_samples += of - n;
        } else if n > of {
            s.grown_steps += 1;
            s.grown_samples += n - of;
        }
    }

    /// An exploration decision at `step`, recorded (the first 1000) with
    /// its step times in milliseconds.
    fn on_explore(&mut self, step: u64, decision: Decision) {
        let (action, from, to, before, after) = match decision {
            Decision::Try { from, to, baseline_micros } => ("try", from, to, baseline_micros, None),
            Decision::Keep { from, k, before_micros, after_micros } => {
                ("keep", from, k, before_micros, Some(after_micros))
            }
            Decision::Revert { tried, k, before_micros, after_micros, .. } => {
                ("revert", tried, k, before_micros, Some(after_micros))
            }
        };
        let s = &mut self.snap;
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

    /// A step finished (its times already added): the step, the samples,
    /// the loss, and the samples per second since the first step.
    fn on_step(&mut self, step: u64, samples: usize, loss: f32) {
        let started = *self.started.get_or_insert_with(Instant::now);
        let s = &mut self.snap;
        s.step = step;
        s.samples += samples as u64;
        s.last_loss = Some(loss);
        let secs = started.elapsed().as_secs_f64();
        if secs > 0.0 {
            s.samples_per_sec = s.samples as f64 / secs;
        }
        let born = self.born;
        self.history.record(|| Point {
            t: born.elapsed().as_secs_f64(),
            step,
            loss,
            accuracy: s.last_accuracy,
            bits_per_byte: s.last_bits_per_byte,
            perplexity: s.last_perplexity,
            samples: s.samples,
            samples_per_sec: s.samples_per_sec,
            bytes_out: s.bytes_out,
            bytes_in: s.bytes_in,
            owned_shards: s.owned_shards.clone(),
            role: s.role.name(),
        });
    }

    /// An evaluation: the latest accuracy, bits per byte and perplexity, and the
    /// accuracy's history (the first 1000) by step and seconds since the
    /// first step.
    fn on_evaluated(&mut self, e: shoal_models::Evaluation) {
        let s = &mut self.snap;
        let a = e.accuracy;
        s.last_accuracy = Some(a);
        s.last_bits_per_byte = e.bits_per_byte;
        s.last_perplexity = e.bits_per_byte.map(|_| f64::from(e.loss).exp());
        let secs = self.started.map(|t| t.elapsed().as_secs_f64()).unwrap_or(0.0);
        if s.accuracy_history.len() < 1000 {
            s.accuracy_history.push((s.step, secs, a));
        }
    }
}
