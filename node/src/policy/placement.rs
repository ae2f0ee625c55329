//! The election: who owns which shard, recomputed by every node from its own
//! gossiped view. There is no coordinator and no consensus round.
//!
//! [`elect`] is pure (no clock, no RNG, no I/O): the members of the view and
//! the median service times in go, a [`Placement`] comes out. Stragglers (see
//! [`crate::policy::health`]) are excluded; the rest, weighted by measured capacity
//! ([`crate::policy::health::capacity_levels`]), capped by their gossiped
//! compute and link rates ([`crate::policy::health::capability_levels`]: the
//! heaviest are kept when k is limited, so exploring upwards adds the best
//! equipped nodes first) and limited to the number of
//! aggregators the members agree on ([`crate::policy::explore::agreed_limit`]),
//! share the shards by weighted
//! rendezvous with bounded loads ([`crate::policy::assign`]), and each shard gets a
//! backup: the owner it would have if its owner vanished, which is where the
//! owner sends replicas and, by the same rendezvous, who takes over when the
//! owner dies. The placement's epoch is a hash of everything it was computed
//! from, so equal views give equal epochs and any difference shows.
//!
//! Memory: every node gossips the memory it offers for owning shards
//! (`capabilities.memory_bytes`: `cluster.memory_bytes`, or what it had
//! left when it started). An owner given more shards than that
//! holds at [`ElectPolicy::owner_shard_bytes`] each is dropped from the
//! candidates and the shards are placed again, until every owner's share
//! fits (or none would be left: a short owner beats an unowned shard). An
//! edge board is thus not made the owner of a model it cannot hold.
//!
//! The election actor ([`crate::actors::election`]) recomputes the placement
//! whenever the view or this node's own measurements change and publishes
//! it; the worker routes by it and the aggregator moves shards by it.

use std::collections::{BTreeMap, BTreeSet};

use shoal_models::rng::stable_hash64;
use shoal_protocol::{Device, Pace, PeerId, Role};

use crate::policy::assign::{assign, AssignPolicy, Candidate};
use crate::policy::explore::{agreed_limit, lower_median, Observation};
use crate::policy::health::{
    capability_levels, capacity_levels, medians, stragglers, weight_of, Capacity, HealthPolicy,
};
use crate::policy::view::{SelfState, View};

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
    /// The number of aggregators it proposes (0: every capable node).
    pub aggregators: u16,
    /// Its capacity level in its own latest placement (hysteresis state of
    /// [`crate::policy::health::capacity_levels`]).
    pub capacity_level: i8,
    /// The memory it offers for owning shards, bytes (0: not reported, no
    /// limit).
    pub memory_bytes: u64,
    /// Its device and measured rates: a cap on its weight
    /// ([`crate::policy::health::capability_levels`]).
    pub capacity: Capacity,
}

/// A member's [`Capacity`] from its heartbeat's fields, each value rounded
/// to a sixteenth of a power of two (4.4%): the rates are moving averages
/// that change every step, and the election runs again whenever its inputs
/// change (on every heartbeat, unrounded). The levels' hysteresis (a
/// quarter of a power of two) spans four steps of the rounding; with one
/// step as wide as the hysteresis, a ratio of rates rounded onto the edge
/// of a band, and a node capped at level -2 went to -1 and back within 12
/// steps (`capabilities.rs`).
fn capacity(device: Device, compute_samples_per_sec: f32, net_bytes_per_sec: f32, pace: Pace) -> Capacity {
    let round = |v: f32| {
        if v.is_finite() && v > 0.0 {
            ((v.log2() * 16.0).round() / 16.0).exp2()
        } else {
            0.0
        }
    };
    let compute_micros = pace.step_micros.saturating_sub(pace.comm_micros) as f32;
    Capacity {
        device,
        compute_samples_per_sec: round(compute_samples_per_sec),
        net_bytes_per_sec: round(net_bytes_per_sec),
        compute_micros: round(compute_micros),
    }
}

/// Knobs of the election.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ElectPolicy {
    pub health: HealthPolicy,
    /// The memory an owner needs per shard it owns, bytes (0: no check):
    /// see [`owner_shard_bytes`].
    pub owner_shard_bytes: u64,
}

/// The memory an owner needs per shard of `shard_len` parameters whose
/// optimizer keeps `slots` more vectors: the shard's state, a replica's
/// worth for the shards it backs up (about as many as it owns), and the
/// round's sum of gradients, all f32.
pub fn owner_shard_bytes(shard_len: u64, slots: u64) -> u64 {
    shard_len.saturating_mul(4).saturating_mul(2 * (1 + slots) + 1)
}

/// Who owns, backs up and trains what, under one epoch.
#[derive(Debug, Clone, PartialEq)]
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
    /// The agreed number of aggregators (`None`: every eligible node).
    pub limit: Option<usize>,
    /// Members that could own shards (capable, not leaving, not straggling,
    /// with the memory for their share).
    pub eligible: usize,
    /// Capable members left out because their share of the shards would
    /// not fit in their memory, sorted.
    pub short_of_memory: Vec<PeerId>,
    /// Capacity level of each eligible member, sorted by peer: its weight
    /// in the rendezvous is 2^level (all 0 without measurements).
    pub levels: Vec<(PeerId, i8)>,
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

    /// Number of distinct owners.
    pub fn aggregators(&self) -> usize {
        sorted(self.owners.clone()).len()
    }

    /// `peer`'s capacity level (0 if it is not eligible).
    pub fn level_of(&self, peer: &PeerId) -> i8 {
        self.levels.iter().find(|(p, _)| p == peer).map_or(0, |(_, l)| *l)
    }
}

fn sorted(mut v: Vec<PeerId>) -> Vec<PeerId> {
    v.sort_by_key(|p| p.to_bytes());
    v.dedup();
    v
}

fn owners_of<K: AsRef<[u8]> + Clone + PartialEq>(
    candidates: &[Candidate<K>],
    shards: u32,
    max: usize,
) -> Option<(u64, Vec<PeerId>)> {
    let a = assign(candidates, shards, AssignPolicy { max_aggregators: max })?;
    let owners = a.owners.iter().map(|b| PeerId::from_bytes(b.as_ref()).ok()).collect::<Option<Vec<_>>>()?;
    Some((a.epoch, owners))
}

/// One placement of the shards: the rendezvous' epoch, `owners[shard]`,
/// and the candidates it was computed among.
struct Assigned {
    epoch: u64,
    owners: Vec<PeerId>,
    candidates: Vec<Candidate<Vec<u8>>>,
}

/// Compute the placement. `None` when no live member may own shards.
pub fn elect(
    members: &[Member],
    service: &BTreeMap<PeerId, f64>,
    shards: u32,
    policy: ElectPolicy,
) -> Option<Placement> {
    let mut members: Vec<&Member> = members.iter().collect();
    // A peer's bytes are built once each, not at every comparison.
    members.sort_by_cached_key(|m| m.peer.to_bytes());
    members.dedup_by_key(|m| m.peer);
    let capable: Vec<&Member> = members.iter().copied().filter(|m| m.can_aggregate && !m.leaving).collect();
    let capable_service: BTreeMap<PeerId, f64> =
        service.iter().filter(|(p, _)| capable.iter().any(|m| m.peer == **p)).map(|(p, v)| (*p, *v)).collect();
    let (eligible, slow) = eligible(&members, &capable, &capable_service, policy.health);
    let levels = levels(&members, &eligible, &capable_service, policy.health);
    let weight = |p: &PeerId| levels.iter().find(|(q, _)| q == p).map_or(1.0, |(_, l)| weight_of(*l));
    let candidates: Vec<Candidate<Vec<u8>>> =
        eligible.iter().map(|m| Candidate { peer: m.peer.to_bytes(), weight: weight(&m.peer) }).collect();
    let limit = agreed_limit(members.iter().map(|m| m.aggregators));
    let max = limit.unwrap_or(0);
    let (epoch, owners) = owners_of(&candidates, shards, max)?;
    let first = Assigned { epoch, owners, candidates };
    let (assigned, short_of_memory) = fit_memory(first, &members, shards, max, policy.owner_shard_bytes);
    let backups = backups_of(&assigned, shards, max);
    let live = sorted(members.iter().map(|m| m.peer).collect());
    let workers = sorted(members.iter().filter(|m| m.active).map(|m| m.peer).collect());
    let stragglers = sorted(slow.into_iter().collect());
    let epoch = epoch_of(assigned.epoch, [&live, &workers, &stragglers, &short_of_memory], max);
    let Assigned { owners, candidates, .. } = assigned;
    Some(Placement {
        epoch,
        owners,
        backups,
        live,
        workers,
        stragglers,
        limit,
        eligible: candidates.len(),
        short_of_memory,
        levels: levels
            .into_iter()
            .filter(|(p, _)| {
                let bytes = p.to_bytes();
                candidates.iter().any(|c| c.peer == bytes)
            })
            .collect(),
    })
}

/// The capable members that may own shards (the stragglers among them
/// left out), and the stragglers. When every capable member is slow, all
/// of them and no straggler: a slow owner beats an unowned shard.
fn eligible<'a>(
    members: &[&Member],
    capable: &[&'a Member],
    capable_service: &BTreeMap<PeerId, f64>,
    health: HealthPolicy,
) -> (Vec<&'a Member>, BTreeSet<PeerId>) {
    let serving = |p: &PeerId| members.iter().any(|m| m.peer == *p && m.serving);
    let mut slow = stragglers(capable_service, serving, health);
    let mut eligible: Vec<&Member> = capable.iter().copied().filter(|m| !slow.contains(&m.peer)).collect();
    if eligible.is_empty() {
        // Every capable node is slow: a slow owner beats an unowned shard.
        eligible = capable.to_vec();
        slow.clear();
    }
    (eligible, slow)
}

/// The capacity level of each eligible member: its level from service
/// times, lowered to the cap of its gossiped rates.
fn levels(
    members: &[&Member],
    eligible: &[&Member],
    capable_service: &BTreeMap<PeerId, f64>,
    health: HealthPolicy,
) -> Vec<(PeerId, i8)> {
    let prior = |p: &PeerId| members.iter().find(|m| m.peer == *p).map_or(0, |m| m.capacity_level);
    let measured = capacity_levels(capable_service, prior, health);
    let caps: BTreeMap<PeerId, Capacity> = members.iter().map(|m| (m.peer, m.capacity)).collect();
    let capped = capability_levels(&caps, prior, health);
    eligible
        .iter()
        .map(|m| {
            // A cap lowers the service-time level; no cap leaves it, a
            // faster owner's positive level included.
            let level = measured.get(&m.peer).copied().unwrap_or(0);
            (m.peer, capped.get(&m.peer).map_or(level, |&cap| level.min(cap)))
        })
        .collect()
}

/// Drops every owner whose share of the shards would not fit in the memory
/// it offers and places the shards again, until every owner's share fits
/// (or dropping them would leave no candidate, or no placement). Returns
/// the last placement and the owners dropped, sorted.
fn fit_memory(
    mut a: Assigned,
    members: &[&Member],
    shards: u32,
    max: usize,
    owner_shard_bytes: u64,
) -> (Assigned, Vec<PeerId>) {
    let mut short_of_memory = Vec::new();
    if owner_shard_bytes > 0 {
        let memory = |p: &PeerId| members.iter().find(|m| m.peer == *p).map_or(0, |m| m.memory_bytes);
        loop {
            let over: Vec<PeerId> = sorted(a.owners.clone())
                .into_iter()
                .filter(|o| {
                    let held = a.owners.iter().filter(|x| *x == o).count() as u64;
                    memory(o) > 0 && held.saturating_mul(owner_shard_bytes) > memory(o)
                })
                .collect();
            if over.is_empty() || over.len() >= a.candidates.len() {
                break;
            }
            let keep: Vec<Candidate<Vec<u8>>> =
                a.candidates.iter().filter(|c| !over.iter().any(|o| o.to_bytes() == c.peer)).cloned().collect();
            let Some((epoch, placed)) = owners_of(&keep, shards, max) else { break };
            a = Assigned { epoch, owners: placed, candidates: keep };
            short_of_memory.extend(over);
        }
    }
    (a, sorted(short_of_memory))
}

/// `backups[shard]`: the owner the shard would have, by the same
/// rendezvous, if its owner vanished; `None` with a single candidate.
fn backups_of(a: &Assigned, shards: u32, max: usize) -> Vec<Option<PeerId>> {
    let mut backups: Vec<Option<PeerId>> = vec![None; shards as usize];
    for o in &sorted(a.owners.clone()) {
        let o_bytes = o.to_bytes();
        // Borrowed ids: one placement per owner, so no copy of each.
        let without: Vec<Candidate<&[u8]>> = a
            .candidates
            .iter()
            .filter(|c| c.peer != o_bytes)
            .map(|c| Candidate { peer: c.peer.as_slice(), weight: c.weight })
            .collect();
        if let Some((_, next)) = owners_of(&without, shards, max) {
            for (s, owner) in a.owners.iter().enumerate() {
                if owner == o {
                    backups[s] = Some(next[s]);
                }
            }
        }
    }
    backups
}

/// The placement's epoch: a hash of the rendezvous' epoch, the live
/// members, the workers, the stragglers, the owners short of memory and
/// the limit, so that equal views give equal epochs and any difference shows.
fn epoch_of(assign_epoch: u64, sets: [&Vec<PeerId>; 4], max: usize) -> u64 {
    let mut digest = assign_epoch.to_le_bytes().to_vec();
    for (tag, set) in (1u8..).zip(sets) {
        digest.push(tag);
        for p in set {
            digest.extend_from_slice(&p.to_bytes());
        }
    }
    digest.extend_from_slice(&(max as u64).to_le_bytes());
    stable_hash64(&digest)
}

/// This node's configured capabilities, as the election needs them (its
/// measured rates are in [`SelfState`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Own {
    pub can_aggregate: bool,
    /// The memory it offers for owning shards, bytes (0 unknown).
    pub memory_bytes: u64,
    pub device: Device,
}

/// The election's inputs from this node's view: live peers that take part
/// in the run plus itself, and
/// the median service time of every owner over all reports (its own included).
/// The election's inputs without what cannot move a shard under `policy`.
/// Under an inert health policy (elastic roles off) the owners' service
/// times and the members' measured rates cannot change the placement, but
/// they change at nearly every heartbeat, and the election runs again
/// whenever its inputs change: in a 64-node swarm that was about a tenth of
/// every node's CPU. Left out, the election runs when the membership does.
pub fn without_unused_measures(members: &mut [Member], service: &mut BTreeMap<PeerId, f64>, policy: ElectPolicy) {
    if !policy.health.is_inert() {
        return;
    }
    service.clear();
    for m in members {
        m.capacity = Capacity { device: m.capacity.device, ..Capacity::default() };
    }
}

pub fn inputs_from_view(
    view: &View,
    me: &SelfState,
    own: Own,
    total_steps: u64,
    now_ms: u64,
    timeout_ms: u64,
) -> (Vec<Member>, BTreeMap<PeerId, f64>) {
    // A peer still joining (fetching the model) takes no part until it
    // announces itself ready. Only at the very start of a run (this node has
    // not finished a step, or its model has not moved from version 0: no
    // round has been applied) may a peer that still says `Joining` but
    // already proposes the agreed roster count: it is a member a heartbeat
    // late. Later such a peer is a member restarted with the same identity,
    // now joining. (With local steps a node is 10 steps in within
    // milliseconds; judged by its step alone, a member whose `Worker`
    // heartbeat had not arrived yet left the placement and came back, and
    // shards moved twice at the start of a 64-node run.)
    let starting = me.step == 0 || me.model_version == 0;
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
                aggregators: hb.pace.aggregators,
                capacity_level: hb.pace.capacity_level,
                memory_bytes: hb.capabilities.memory_bytes,
                capacity: capacity(
                    hb.capabilities.device,
                    hb.capabilities.compute_samples_per_sec,
                    hb.capabilities.net_bytes_per_sec,
                    hb.pace,
                ),
            }
        })
        .collect();
    members.push(Member {
        peer: view.me,
        can_aggregate: own.can_aggregate,
        serving: me.role == Role::Aggregator,
        active: me.step < total_steps && !me.leaving,
        leaving: me.leaving,
        aggregators: me.pace.aggregators,
        capacity_level: me.pace.capacity_level,
        memory_bytes: own.memory_bytes,
        capacity: capacity(own.device, me.compute_samples_per_sec, me.net_bytes_per_sec, me.pace),
    });
    let reports = live
        .iter()
        .map(|p| (p.heartbeat.peer, p.heartbeat.service.as_slice()))
        .chain([(view.me, me.service.as_slice())]);
    (members, medians(reports))
}

/// What this node's explorer sees: the cluster's step and pace over the
/// members still training (this node included), and the current placement.
/// `None` before anyone has timed a step.
pub fn observation(
    view: &View,
    me: &SelfState,
    placement: &Placement,
    total_steps: u64,
    now_ms: u64,
    timeout_ms: u64,
) -> Option<Observation> {
    let training = |role: Role, step: u64| role != Role::Joining && role != Role::Leaving && step < total_steps;
    let mut paces: Vec<(u64, shoal_protocol::Pace)> = view
        .live(now_ms, timeout_ms)
        .into_iter()
        .filter(|p| training(p.heartbeat.role, p.heartbeat.step))
        .map(|p| (p.heartbeat.step, p.heartbeat.pace))
        .collect();
    if !me.leaving && me.step < total_steps {
        paces.push((me.step, me.pace));
    }
    let step = lower_median(paces.iter().map(|p| p.0).collect())?;
    let timed: Vec<_> = paces.iter().map(|p| p.1).filter(|p| p.step_micros > 0).collect();
    let step_micros = lower_median(timed.iter().map(|p| p.step_micros as f64).collect())?;
    let comm_share = lower_median(timed.iter().map(|p| p.comm_micros as f64 / p.step_micros as f64).collect())?;
    Some(Observation {
        step,
        aggregators: placement.aggregators(),
        candidates: placement.eligible,
        step_micros,
        comm_share: comm_share.clamp(0.0, 1.0),
    })
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
                aggregators: 0,
                capacity_level: 0,
                memory_bytes: 0,
                capacity: Capacity::default(),
            })
            .collect()
    }

    /// Under an inert health policy (elastic roles off) service times and
    /// measured rates do not change the placement, so the election may
    /// leave them out of its inputs; under the default policy they do.
    #[test]
    fn under_an_inert_policy_measures_do_not_change_the_placement() {
        let inert = ElectPolicy { health: HealthPolicy::inert(), owner_shard_bytes: 0 };
        assert!(inert.health.is_inert() && !HealthPolicy::default().is_inert());
        let mut m = members(12);
        for (i, x) in m.iter_mut().enumerate() {
            let f = (i + 1) as f32;
            x.serving = i % 3 != 0;
            x.capacity = Capacity {
                device: if i % 4 == 0 { Device::Cuda } else { Device::Cpu },
                compute_samples_per_sec: 100.0 * f * f,
                net_bytes_per_sec: 1e6 / f,
                compute_micros: 1e3 * f,
            };
        }
        // Owners 1x to 64x the fastest one's service time.
        let service: BTreeMap<PeerId, f64> =
            m.iter().enumerate().map(|(i, x)| (x.peer, 100.0 * f64::from(1u32 << (i % 7)))).collect();
        let (mut bare, mut no_service) = (m.clone(), service.clone());
        without_unused_measures(&mut bare, &mut no_service, inert);
        assert!(no_service.is_empty());
        let with = elect(&m, &service, 16, inert);
        assert!(with.is_some());
        assert_eq!(with, elect(&bare, &no_service, 16, inert));
        // Under the default policy the same measures move shards, and the
        // inputs are left as they are.
        let elastic = ElectPolicy::default();
        assert_ne!(elect(&m, &service, 16, elastic), elect(&bare, &no_service, 16, elastic));
        let (mut kept, mut kept_service) = (m.clone(), service.clone());
        without_unused_measures(&mut kept, &mut kept_service, elastic);
        assert_eq!((kept, kept_service), (m, service));
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
    fn a_slower_owner_gets_a_smaller_share_and_the_agreed_limit_caps_the_owners() {
        let mut m = members(4);
        let service: BTreeMap<PeerId, f64> =
            m.iter().enumerate().map(|(i, x)| (x.peer, if i == 3 { 250.0 } else { 100.0 })).collect();
        let Some(p) = elect(&m, &service, 64, ElectPolicy::default()) else { panic!("no placement") };
        assert!(p.stragglers.is_empty(), "2.5x is below the demotion ratio");
        // Weights 1, 1, 1, 0.5: caps ceil(64/3.5) = 19 and ceil(32/3.5) = 10, so the
        // slow owner has 64 - 3 * 19 = 7 to 10 shards and each other one at least 64 - 10 - 2 * 19 = 16.
        let slow = p.owned_by(&m[3].peer).len();
        assert!((7..=10).contains(&slow), "the half-weight owner has {slow} of 64 shards");
        for x in &m[..3] {
            assert!(p.owned_by(&x.peer).len() >= 16, "{:?}", p.levels);
        }
        assert_eq!(p.level_of(&m[3].peer), -1, "{:?}", p.levels);
        // Gossiped hysteresis: an owner that already holds level -1 keeps it
        // at 1.9x slower; one still at level 0 does not get it.
        let near: BTreeMap<PeerId, f64> =
            service.iter().map(|(p, v)| (*p, if *p == m[3].peer { 190.0 } else { *v })).collect();
        let Some(p0) = elect(&m, &near, 64, ElectPolicy::default()) else { panic!("no placement") };
        assert_eq!(p0.level_of(&m[3].peer), 0);
        m[3].capacity_level = -1;
        let Some(p1) = elect(&m, &near, 64, ElectPolicy::default()) else { panic!("no placement") };
        assert_eq!(p1.level_of(&m[3].peer), -1);
        assert_ne!(p0.owners, p1.owners);
        m[3].capacity_level = 0;
        // Two of four propose 2 aggregators, the others every node: the lower median is 2.
        m[0].aggregators = 2;
        m[1].aggregators = 2;
        let Some(q) = elect(&m, &service, 64, ElectPolicy::default()) else { panic!("no placement") };
        assert_eq!((q.limit, q.aggregators(), q.eligible), (Some(2), 2, 4));
        assert!(q.owned_by(&m[3].peer).is_empty(), "the lightest candidate is dropped first");
        m[1].aggregators = 0;
        let Some(r) = elect(&m, &service, 64, ElectPolicy::default()) else { panic!("no placement") };
        assert_eq!((r.limit, r.aggregators()), (None, 4), "one proposal alone does not cap k");
        assert_ne!(q.epoch, r.epoch);
    }

    #[test]
    fn gossiped_rates_cap_a_weak_nodes_weight_and_exploring_from_one_owner_skips_it() {
        // Steps of 64 samples: 16 ms of compute at 4000 samples/s.
        let cpu = |compute: f32, net: f32| Capacity {
            device: Device::Cpu,
            compute_samples_per_sec: compute,
            net_bytes_per_sec: net,
            compute_micros: 64e6 / compute,
        };
        let mut m = members(4);
        for x in &mut m {
            x.capacity = cpu(4000.0, 50e6);
        }
        // node 3: an edge board, computing at a quarter of the others' rate.
        m[3].capacity = cpu(1000.0, 50e6);
        let Some(p) = elect(&m, &BTreeMap::new(), 64, ElectPolicy::default()) else { panic!("no placement") };
        assert_eq!(p.level_of(&m[3].peer), -2, "{:?}", p.levels);
        // Weights 1, 1, 1, 0.25: its cap is ceil(64 * 0.25 / 3.25) = 5.
        let weak = p.owned_by(&m[3].peer).len();
        assert!((1..=5).contains(&weak), "the quarter-weight node owns {weak} of 64 shards");
        // Measured service as fast as the rest does not lift the cap.
        let service: BTreeMap<PeerId, f64> = m.iter().map(|x| (x.peer, 100.0)).collect();
        let Some(q) = elect(&m, &service, 64, ElectPolicy::default()) else { panic!("no placement") };
        assert_eq!(q.level_of(&m[3].peer), -2);
        // An owner measured 2.5x faster keeps its raised level (weight 2)
        // beside the capped node: caps only ever lower a level.
        let faster: BTreeMap<PeerId, f64> =
            m.iter().enumerate().map(|(i, x)| (x.peer, if i == 0 { 40.0 } else { 100.0 })).collect();
        let Some(f) = elect(&m, &faster, 64, ElectPolicy::default()) else { panic!("no placement") };
        assert_eq!((f.level_of(&m[0].peer), f.level_of(&m[3].peer)), (1, -2), "{:?}", f.levels);
        // A slow link alone (a fifth of the others' rate) caps it too; a node
        // that has not measured anything yet is not judged.
        m[3].capacity = cpu(4000.0, 10e6);
        let Some(r) = elect(&m, &BTreeMap::new(), 64, ElectPolicy::default()) else { panic!("no placement") };
        assert_eq!(r.level_of(&m[3].peer), -2);
        m[3].capacity = cpu(0.0, 0.0);
        let Some(r0) = elect(&m, &BTreeMap::new(), 64, ElectPolicy::default()) else { panic!("no placement") };
        assert_eq!(r0.level_of(&m[3].peer), 0);
        // Exploring from one owner: whichever node the hash favours, the
        // weak one is never picked while a healthy one is spare, for one or
        // three owners.
        for limit in [1u16, 3] {
            for trial in 0..16 {
                let mut m = members(4);
                for x in &mut m {
                    x.capacity = cpu(4000.0, 50e6);
                    x.aggregators = limit;
                }
                let weak = trial % 4;
                m[weak].capacity = cpu(1000.0, 50e6);
                let Some(p) = elect(&m, &BTreeMap::new(), 8, ElectPolicy::default()) else { panic!("no placement") };
                assert!(p.owned_by(&m[weak].peer).is_empty(), "limit {limit}: the weak node owns shards");
                assert_eq!(p.aggregators(), usize::from(limit));
            }
        }
        // A GPU box's samples/s are compared with other GPUs only: among
        // three CPU nodes it is not the norm that makes them look slow.
        let mut m = members(4);
        for x in &mut m[..3] {
            x.capacity = cpu(4000.0, 50e6);
        }
        m[3].capacity = Capacity {
            device: Device::Cuda,
            compute_samples_per_sec: 400_000.0,
            net_bytes_per_sec: 50e6,
            compute_micros: 160.0,
        };
        let Some(g) = elect(&m, &BTreeMap::new(), 64, ElectPolicy::default()) else { panic!("no placement") };
        assert!(g.levels.iter().all(|(_, l)| *l == 0), "{:?}", g.levels);
    }

    #[test]
    fn an_owner_gets_no_more_shards_than_its_memory_holds() {
        // 16 shards of 1 MB owner state each over 4 nodes: about 4 each.
        let policy = ElectPolicy { owner_shard_bytes: 1_000_000, ..ElectPolicy::default() };
        let mut m = members(4);
        let Some(free) = elect(&m, &BTreeMap::new(), 16, policy) else { panic!("no placement") };
        assert!(free.short_of_memory.is_empty(), "0 is not reported: no limit");
        assert_eq!(free.aggregators(), 4);
        // An edge board with room for 2 shards, and the others for 8: the
        // board is left out, and every owner's share fits.
        m[3].memory_bytes = 2_500_000;
        for x in &mut m[..3] {
            x.memory_bytes = 8_000_000;
        }
        let Some(p) = elect(&m, &BTreeMap::new(), 16, policy) else { panic!("no placement") };
        assert_eq!(p.short_of_memory, vec![m[3].peer]);
        assert!(p.owned_by(&m[3].peer).is_empty());
        assert_eq!(p.eligible, 3);
        for x in &m[..3] {
            let held = p.owned_by(&x.peer).len() as u64;
            assert!(held * 1_000_000 <= x.memory_bytes, "{held} shards in {} bytes", x.memory_bytes);
        }
        assert!(p.backups.iter().all(|b| b.is_some_and(|b| b != m[3].peer)), "nor does it back up shards");
        assert_ne!(p.epoch, free.epoch);
        let mut rev = m.clone();
        rev.reverse();
        assert_eq!(elect(&rev, &BTreeMap::new(), 16, policy), Some(p), "the same on every node");
        // Leaving one out gives the others more: the loop drops each owner
        // whose grown share no longer fits, and stops short of dropping all.
        for x in &mut m {
            x.memory_bytes = 4_000_000;
        }
        let Some(tight) = elect(&m, &BTreeMap::new(), 16, policy) else { panic!("no placement") };
        assert!(tight.owners.len() == 16 && tight.aggregators() >= 1);
        for x in &m {
            let held = tight.owned_by(&x.peer).len() as u64;
            let short = tight.short_of_memory.contains(&x.peer);
            assert!(short || held > 0, "a node with room owns shards");
        }
        // Nobody has room even for one shard: a short owner beats an
        // unowned shard.
        for x in &mut m {
            x.memory_bytes = 1;
        }
        let Some(none_fit) = elect(&m, &BTreeMap::new(), 16, policy) else { panic!("no placement") };
        assert_eq!(none_fit.owners.len(), 16);
        assert!(none_fit.aggregators() >= 1);
        // Without a per-shard figure there is no check.
        let Some(unchecked) = elect(&m, &BTreeMap::new(), 16, ElectPolicy::default()) else { panic!("no placement") };
        assert!(unchecked.short_of_memory.is_empty() && unchecked.aggregators() == 4);
        assert_eq!(owner_shard_bytes(1000, 1), 1000 * 4 * 5, "state, replica and the round's sum (SGD momentum)");
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
