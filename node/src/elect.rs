//! The election: who owns which shard, recomputed by every node from its own
//! gossiped view. There is no coordinator and no consensus round.
//!
//! [`elect`] is pure (no clock, no RNG, no I/O): the members of the view and
//! the median service times in go, a [`Placement`] comes out. Stragglers (see
//! [`crate::health`]) are excluded, the rest share the shards by weighted
//! rendezvous with bounded loads ([`crate::assign`]), and each shard gets a
//! backup: the owner it would have if its owner vanished, which is where the
//! owner sends replicas and, by the same rendezvous, who takes over when the
//! owner dies. The placement's epoch is a hash of everything it was computed
//! from, so equal views give equal epochs and any difference shows.
//!
//! The [`ElectionHandle`] actor recomputes the placement whenever the view
//! or this node's own measurements change and publishes it on a `watch`
//! channel; the worker routes by it and the aggregator moves shards by it.

use std::collections::BTreeMap;
use std::sync::Arc;

use shoal_models::rng::stable_hash64;
use shoal_protocol::libp2p::PeerId;
use shoal_protocol::Role;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::assign::{assign, AssignPolicy, Candidate};
use crate::health::{medians, stragglers, HealthPolicy};
use crate::membership::{MembershipHandle, SelfState, View};
use crate::status::{RoleView, StatusEvent, StatusHandle};

/// A live member of the view, as the election sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Member {
    pub peer: PeerId,
    /// Its config allows it to own shards.
    pub can_aggregate: bool,
    /// It owns shards now (its own heartbeat says so): selects the hysteresis threshold.
    pub serving: bool,
    /// Still training: owners wait for its gradients.
    pub active: bool,
    /// Leaving cleanly: hands its shards off and owns nothing new.
    pub leaving: bool,
}

/// Knobs of the election.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ElectPolicy {
    pub health: HealthPolicy,
    /// At most this many aggregators (0: no limit).
    pub max_aggregators: usize,
}

/// Who owns, backs up and trains what, under one epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub epoch: u64,
    /// `owners[shard]`.
    pub owners: Vec<PeerId>,
    /// `backups[shard]`: receives replicas; `None` with a single eligible owner.
    pub backups: Vec<Option<PeerId>>,
    /// Every live member, sorted.
    pub live: Vec<PeerId>,
    /// Members still training (the workers owners wait for), sorted.
    pub workers: Vec<PeerId>,
    /// Owners excluded as too slow, sorted.
    pub stragglers: Vec<PeerId>,
}

impl Placement {
    pub fn owner(&self, shard: u32) -> Option<PeerId> {
        self.owners.get(shard as usize).copied()
    }

    pub fn backup(&self, shard: u32) -> Option<PeerId> {
        self.backups.get(shard as usize).copied().flatten()
    }

    pub fn owned_by(&self, peer: &PeerId) -> Vec<u32> {
        self.owners.iter().enumerate().filter(|(_, o)| *o == peer).map(|(i, _)| i as u32).collect()
    }

    pub fn is_live(&self, peer: &PeerId) -> bool {
        self.live.binary_search_by_key(&peer.to_bytes(), |p| p.to_bytes()).is_ok()
    }
}

fn sorted(mut v: Vec<PeerId>) -> Vec<PeerId> {
    v.sort_by_key(|p| p.to_bytes());
    v.dedup();
    v
}

fn owners_of(candidates: &[Candidate<Vec<u8>>], shards: u32, max: usize) -> Option<(u64, Vec<PeerId>)> {
    let a = assign(candidates, shards, AssignPolicy { max_aggregators: max })?;
    let owners = a.owners.iter().map(|b| PeerId::from_bytes(b).ok()).collect::<Option<Vec<_>>>()?;
    Some((a.epoch, owners))
}

/// Compute the placement. `None` when no live member may own shards.
pub fn elect(
    members: &[Member],
    service: &BTreeMap<PeerId, f64>,
    shards: u32,
    policy: ElectPolicy,
) -> Option<Placement> {
    let mut members: Vec<&Member> = members.iter().collect();
    members.sort_by_key(|m| m.peer.to_bytes());
    members.dedup_by_key(|m| m.peer);
    let capable: Vec<&Member> = members.iter().copied().filter(|m| m.can_aggregate && !m.leaving).collect();
    let capable_service: BTreeMap<PeerId, f64> =
        service.iter().filter(|(p, _)| capable.iter().any(|m| m.peer == **p)).map(|(p, v)| (*p, *v)).collect();
    let serving = |p: &PeerId| members.iter().any(|m| m.peer == *p && m.serving);
    let mut slow = stragglers(&capable_service, serving, policy.health);
    let mut eligible: Vec<&Member> = capable.iter().copied().filter(|m| !slow.contains(&m.peer)).collect();
    if eligible.is_empty() {
        // Every capable node is slow: a slow owner beats an unowned shard.
        eligible = capable.clone();
        slow.clear();
    }
    let candidates: Vec<Candidate<Vec<u8>>> =
        eligible.iter().map(|m| Candidate { peer: m.peer.to_bytes(), weight: 1.0 }).collect();
    let (assign_epoch, owners) = owners_of(&candidates, shards, policy.max_aggregators)?;
    let mut backups: Vec<Option<PeerId>> = vec![None; shards as usize];
    let mut distinct = owners.clone();
    distinct.sort_by_key(|p| p.to_bytes());
    distinct.dedup();
    for o in &distinct {
        let without: Vec<Candidate<Vec<u8>>> = candidates.iter().filter(|c| c.peer != o.to_bytes()).cloned().collect();
        if let Some((_, next)) = owners_of(&without, shards, policy.max_aggregators) {
            for (s, owner) in owners.iter().enumerate() {
                if owner == o {
                    backups[s] = Some(next[s]);
                }
            }
        }
    }
    let live = sorted(members.iter().map(|m| m.peer).collect());
    let workers = sorted(members.iter().filter(|m| m.active).map(|m| m.peer).collect());
    let stragglers = sorted(slow.into_iter().collect());
    let mut digest = assign_epoch.to_le_bytes().to_vec();
    for (tag, set) in [(1u8, &live), (2, &workers), (3, &stragglers)] {
        digest.push(tag);
        for p in set {
            digest.extend_from_slice(&p.to_bytes());
        }
    }
    Some(Placement { epoch: stable_hash64(&digest), owners, backups, live, workers, stragglers })
}

/// The election's inputs from this node's view: live peers that take part
/// in the run plus itself, and
/// the median service time of every owner over all reports (its own included).
pub fn inputs_from_view(
    view: &View,
    me: &SelfState,
    my_can_aggregate: bool,
    total_steps: u64,
    now_ms: u64,
    timeout_ms: u64,
) -> (Vec<Member>, BTreeMap<PeerId, f64>) {
    // A peer still joining (fetching the model) takes no part until it
    // announces itself ready. Only at the very start of a run (this node has
    // not finished a step) may a peer that still says `Joining` but already
    // proposes the agreed roster count: it is a member a heartbeat late. Later
    // such a peer is a member restarted with the same identity, now joining.
    let starting = me.step == 0;
    let live: Vec<_> = view
        .live(now_ms, timeout_ms)
        .into_iter()
        .filter(|p| p.heartbeat.role != Role::Joining || (starting && me.frozen_epoch == Some(p.heartbeat.epoch)))
        .collect();
    let mut members: Vec<Member> = live
        .iter()
        .map(|p| {
            let hb = &p.heartbeat;
            Member {
                peer: hb.peer,
                can_aggregate: hb.capabilities.can_aggregate,
                serving: hb.role == Role::Aggregator,
                active: hb.step < total_steps && hb.role != Role::Leaving,
                leaving: hb.role == Role::Leaving,
            }
        })
        .collect();
    members.push(Member {
        peer: view.me,
        can_aggregate: my_can_aggregate,
        serving: me.role == Role::Aggregator,
        active: me.step < total_steps && !me.leaving,
        leaving: me.leaving,
    });
    let reports = live
        .iter()
        .map(|p| (p.heartbeat.peer, p.heartbeat.service.as_slice()))
        .chain([(view.me, me.service.as_slice())]);
    (members, medians(reports))
}

/// Settings of the election actor.
#[derive(Debug, Clone)]
pub struct ElectionConfig {
    pub shards: u32,
    pub policy: ElectPolicy,
    pub can_aggregate: bool,
    pub total_steps: u64,
    pub failure_timeout_ms: u64,
    pub name: String,
}

/// The election actor: publishes the current placement.
#[derive(Debug, Clone)]
pub struct ElectionHandle {
    placement: watch::Receiver<Option<Arc<Placement>>>,
}

impl ElectionHandle {
    /// The channel the placement is published on, before the actor starts
    /// (the worker and the aggregator subscribe at build time).
    pub fn channel() -> (watch::Sender<Option<Arc<Placement>>>, Self) {
        let (tx, rx) = watch::channel(None);
        (tx, Self { placement: rx })
    }

    pub fn subscribe(&self) -> watch::Receiver<Option<Arc<Placement>>> {
        self.placement.clone()
    }

    pub fn current(&self) -> Option<Arc<Placement>> {
        self.placement.borrow().clone()
    }

    /// Start electing (once the roster is agreed). Stops when the membership
    /// actor stops or every receiver is gone.
    pub fn start(
        out: watch::Sender<Option<Arc<Placement>>>,
        cfg: ElectionConfig,
        membership: MembershipHandle,
        status: StatusHandle,
    ) {
        tokio::spawn(run(out, cfg, membership, status));
    }
}

async fn run(
    out: watch::Sender<Option<Arc<Placement>>>,
    cfg: ElectionConfig,
    membership: MembershipHandle,
    status: StatusHandle,
) {
    let mut view = membership.subscribe();
    let mut me = membership.subscribe_self();
    let my_id = membership.snapshot().view.me;
    // The view and this node's heartbeat fields change every step (step
    // counters, model versions); the election's inputs rarely do.
    let mut last_inputs = None;
    loop {
        let inputs = {
            let snap = view.borrow_and_update();
            let mine = me.borrow_and_update();
            inputs_from_view(&snap.view, &mine, cfg.can_aggregate, cfg.total_steps, snap.now_ms, cfg.failure_timeout_ms)
        };
        let unchanged = last_inputs.as_ref() == Some(&inputs);
        let (members, service) = last_inputs.insert(inputs);
        match (!unchanged).then(|| elect(members, service, cfg.shards, cfg.policy)).flatten() {
            Some(p) => {
                let changed = out.borrow().as_ref().map(|old| old.epoch) != Some(p.epoch);
                if changed {
                    let old = out.borrow().clone();
                    announce(&cfg.name, &my_id, old.as_deref(), &p, &membership, &status);
                    out.send_replace(Some(Arc::new(p)));
                }
            }
            None if !unchanged => warn!("no live node may own shards; keeping the last placement"),
            None => {}
        }
        tokio::select! {
            r = view.changed() => if r.is_err() { break },
            r = me.changed() => if r.is_err() { break },
            _ = out.closed() => break,
        }
    }
}

/// Log a new placement, and tell membership and status about this node's new role.
fn announce(
    name: &str,
    me: &PeerId,
    old: Option<&Placement>,
    new: &Placement,
    membership: &MembershipHandle,
    status: &StatusHandle,
) {
    let owned = new.owned_by(me);
    let before = old.map(|o| o.owned_by(me));
    if old.is_none_or(|o| o.owners != new.owners || o.stragglers != new.stragglers) {
        info!(
            node = name,
            epoch = new.epoch,
            owners = ?new.owners.iter().map(crate::node::short).collect::<Vec<_>>(),
            stragglers = ?new.stragglers.iter().map(crate::node::short).collect::<Vec<_>>(),
            "placement"
        );
    }
    if before.as_ref() != Some(&owned) {
        let role = if owned.is_empty() { Role::Worker } else { Role::Aggregator };
        membership.set_self(|s| {
            if !s.leaving {
                s.role = role;
            }
            s.owned_shards = owned.clone();
            s.announce += 1;
        });
        status.record(StatusEvent::Role {
            role: if owned.is_empty() { RoleView::Worker } else { RoleView::Aggregator },
            owned,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(n: usize) -> Vec<Member> {
        (0..n)
            .map(|_| Member {
                peer: PeerId::random(),
                can_aggregate: true,
                serving: true,
                active: true,
                leaving: false,
            })
            .collect()
    }

    #[test]
    fn same_inputs_same_placement_in_any_order() {
        let m = members(5);
        let mut rev = m.clone();
        rev.reverse();
        let a = elect(&m, &BTreeMap::new(), 16, ElectPolicy::default());
        assert!(a.is_some());
        assert_eq!(a, elect(&rev, &BTreeMap::new(), 16, ElectPolicy::default()));
    }

    #[test]
    fn a_straggler_loses_its_shards_and_backups_are_the_next_choice() {
        let m = members(4);
        let Some(before) = elect(&m, &BTreeMap::new(), 8, ElectPolicy::default()) else { panic!("no placement") };
        let slow = before.owners[0];
        let service: BTreeMap<PeerId, f64> =
            m.iter().map(|x| (x.peer, if x.peer == slow { 500.0 } else { 100.0 })).collect();
        let Some(after) = elect(&m, &service, 8, ElectPolicy::default()) else { panic!("no placement") };
        assert_ne!(before.epoch, after.epoch);
        assert!(after.owned_by(&slow).is_empty());
        assert_eq!(after.stragglers, vec![slow]);
        assert_eq!(after.workers.len(), 4, "a demoted owner still trains");
        for s in 0..8u32 {
            assert_ne!(before.backup(s), before.owner(s), "a backup is another node");
        }
        // The backup of each of the straggler's shards is who owns it once it is gone.
        let rest: Vec<Member> = m.iter().filter(|x| x.peer != slow).cloned().collect();
        let Some(gone) = elect(&rest, &BTreeMap::new(), 8, ElectPolicy::default()) else { panic!("no placement") };
        for s in before.owned_by(&slow) {
            assert_eq!(before.backup(s), gone.owner(s), "shard {s}");
        }
    }

    #[test]
    fn leaving_and_incapable_nodes_own_nothing_and_all_slow_means_no_exclusion() {
        let mut m = members(3);
        m[0].leaving = true;
        m[1].can_aggregate = false;
        let Some(p) = elect(&m, &BTreeMap::new(), 4, ElectPolicy::default()) else { panic!("no placement") };
        assert!(p.owners.iter().all(|o| *o == m[2].peer));
        assert_eq!(p.backups, vec![None; 4], "a single owner has no backup");
        let only_one_slow: BTreeMap<PeerId, f64> = [(m[2].peer, 1000.0)].into();
        let Some(q) = elect(&m, &only_one_slow, 4, ElectPolicy::default()) else { panic!("no placement") };
        assert!(q.stragglers.is_empty());
        m[2].can_aggregate = false;
        assert!(elect(&m, &BTreeMap::new(), 4, ElectPolicy::default()).is_none());
    }
}
