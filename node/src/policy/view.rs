//! The gossiped view of the cluster, pure: heartbeats and the current time
//! go in, the set of live peers and the roster proposal come out. The
//! membership actor ([`crate::actors::membership`]) feeds it.
//!
//! Roster agreement without consensus: while a node waits to start, its
//! heartbeat's `epoch` is the hash of the roster it proposes (all live peers
//! with the same config). Training starts when at least `min_peers` are live
//! and every one of them proposes the same roster hash. Views that stop
//! changing converge, so all nodes start with the same roster.

use std::collections::BTreeMap;

use shoal_models::rng::stable_hash64;
use shoal_protocol::{CheckpointOffer, Heartbeat, Pace, PeerId, Role, ServiceObservation, WIRE_VERSION};
use tracing::warn;

/// The agreed set of nodes of a run, sorted by peer id bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roster {
    pub members: Vec<(PeerId, bool)>,
}

impl Roster {
    pub fn new(mut members: Vec<(PeerId, bool)>) -> Self {
        members.sort_by_key(|a| a.0.to_bytes());
        members.dedup_by(|a, b| a.0 == b.0);
        Self { members }
    }

    pub fn peers(&self) -> Vec<PeerId> {
        self.members.iter().map(|m| m.0).collect()
    }

    pub fn aggregators(&self) -> Vec<PeerId> {
        self.members.iter().filter(|m| m.1).map(|m| m.0).collect()
    }

    pub fn hash(&self) -> u64 {
        let mut bytes = Vec::new();
        for (p, agg) in &self.members {
            bytes.extend_from_slice(&p.to_bytes());
            bytes.push(u8::from(*agg));
        }
        stable_hash64(&bytes)
    }

    pub fn rank_of(&self, peer: &PeerId) -> Option<usize> {
        self.members.iter().position(|m| m.0 == *peer)
    }
}

/// What this node knows of one peer.
#[derive(Debug, Clone)]
pub struct PeerState {
    pub heartbeat: Heartbeat,
    pub last_seen_ms: u64,
}

/// Roster formation progress.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RosterStatus {
    /// Fewer than `min_peers` live nodes with our config.
    Waiting { live: usize },
    /// Enough nodes, but not all propose this roster yet.
    Proposed(Roster),
    /// Every member proposes this roster.
    Agreed(Roster),
}

/// Most peers with this node's config that the view holds at once. A new
/// peer beyond it is ignored until others expire, so a flood of fresh
/// identities cannot grow the view without bound.
pub const MAX_PEERS: usize = 4096;

/// Most peers with another config, and most peers of another wire version,
/// that the view remembers (they are only named in the error when no roster
/// forms).
pub const MAX_MISMATCHED: usize = 64;

/// The pure view.
#[derive(Debug, Clone)]
pub struct View {
    pub me: PeerId,
    pub my_can_aggregate: bool,
    pub config_hash: u64,
    pub peers: BTreeMap<PeerId, PeerState>,
    /// Peers seen with another config: peer -> their config hash (at most
    /// [`MAX_MISMATCHED`]).
    pub mismatched: BTreeMap<PeerId, u64>,
    /// Peers seen speaking another wire version: peer -> their version (at
    /// most [`MAX_MISMATCHED`]). The wire has one version, so they cannot
    /// exchange shards with this node.
    pub other_version: BTreeMap<PeerId, u16>,
    /// Heartbeats of new peers ignored because the view was full.
    pub refused: u64,
}

impl View {
    pub fn new(me: PeerId, my_can_aggregate: bool, config_hash: u64) -> Self {
        Self {
            me,
            my_can_aggregate,
            config_hash,
            peers: BTreeMap::new(),
            mismatched: BTreeMap::new(),
            other_version: BTreeMap::new(),
            refused: 0,
        }
    }

    /// Take in a heartbeat. Returns whether the view changed in a way that
    /// matters (a new peer, a new proposal, a new step).
    pub fn observe(&mut self, hb: Heartbeat, now_ms: u64) -> bool {
        if hb.peer == self.me {
            return false;
        }
        if hb.protocol_version != WIRE_VERSION {
            if self.other_version.len() >= MAX_MISMATCHED && !self.other_version.contains_key(&hb.peer) {
                self.refused += 1;
                return false;
            }
            let new = self.other_version.insert(hb.peer, hb.protocol_version).is_none();
            if new {
                warn!(peer = %hb.peer, theirs = hb.protocol_version, ours = WIRE_VERSION,
                      "peer speaks wire version {}, this node speaks version {WIRE_VERSION}; ignoring it",
                      hb.protocol_version);
            }
            return new;
        }
        if hb.config_hash != self.config_hash {
            if self.mismatched.len() >= MAX_MISMATCHED && !self.mismatched.contains_key(&hb.peer) {
                self.refused += 1;
                return false;
            }
            let new = self.mismatched.insert(hb.peer, hb.config_hash).is_none();
            if new {
                warn!(peer = %hb.peer, theirs = hb.config_hash, ours = self.config_hash,
                      "peer runs a different model/training config; ignoring it");
            }
            return new;
        }
        let full = self.peers.len() >= MAX_PEERS;
        match self.peers.get_mut(&hb.peer) {
            Some(s) if hb.incarnation < s.heartbeat.incarnation => false,
            Some(s) if hb.incarnation == s.heartbeat.incarnation && hb.seq <= s.heartbeat.seq => false,
            Some(s) => {
                let changed = s.heartbeat.epoch != hb.epoch
                    || s.heartbeat.step != hb.step
                    || s.heartbeat.role != hb.role
                    || s.heartbeat.owned_shards != hb.owned_shards
                    || s.heartbeat.service != hb.service
                    || s.heartbeat.finished != hb.finished
                    || s.heartbeat.incarnation != hb.incarnation;
                s.heartbeat = hb;
                s.last_seen_ms = now_ms;
                changed
            }
            None if full => {
                if self.refused == 0 {
                    warn!(max = MAX_PEERS, "the view is full: new peers are ignored until others expire");
                }
                self.refused += 1;
                false
            }
            None => {
                self.peers.insert(hb.peer, PeerState { heartbeat: hb, last_seen_ms: now_ms });
                true
            }
        }
    }

    /// Peers heard from within `timeout_ms` (not including this node).
    pub fn live(&self, now_ms: u64, timeout_ms: u64) -> Vec<&PeerState> {
        self.peers.values().filter(|p| now_ms.saturating_sub(p.last_seen_ms) <= timeout_ms).collect()
    }

    /// Per shard (of `shards`), the newest version that this node's worker
    /// (`mine`, by shard) or a peer in the view says it holds
    /// (`Heartbeat::shard_versions`); 0 where none says. Peers silent past
    /// the failure timeout have left the view ([`View::expire`]).
    pub fn newest_shard_versions(&self, mine: &[u64], shards: usize) -> Vec<u64> {
        let mut newest: Vec<u64> = (0..shards).map(|s| mine.get(s).copied().unwrap_or(0)).collect();
        for p in self.peers.values() {
            for (s, n) in newest.iter_mut().enumerate() {
                if let Some(v) = p.heartbeat.shard_versions.get(s as u32) {
                    *n = (*n).max(v);
                }
            }
        }
        newest
    }

    /// Per shard (of `shards`), the peers whose last heartbeat names it
    /// among the shards they own (`Heartbeat::owned_shards`: their
    /// placement's, and those whose transfer they keep or send), sorted.
    pub fn shard_claimants(&self, shards: usize) -> Vec<Vec<PeerId>> {
        let mut claimants = vec![Vec::new(); shards];
        for (peer, p) in &self.peers {
            for &s in &p.heartbeat.owned_shards {
                if let Some(c) = claimants.get_mut(s as usize) {
                    c.push(*peer);
                }
            }
        }
        claimants
    }

    /// Drop one peer (it stopped); whether it was in the view.
    pub fn forget(&mut self, peer: &PeerId) -> bool {
        self.peers.remove(peer).is_some()
    }

    /// Drop peers silent for longer than `timeout_ms`; returns them.
    pub fn expire(&mut self, now_ms: u64, timeout_ms: u64) -> Vec<PeerId> {
        let dead: Vec<PeerId> = self
            .peers
            .iter()
            .filter(|(_, p)| now_ms.saturating_sub(p.last_seen_ms) > timeout_ms)
            .map(|(id, _)| *id)
            .collect();
        for id in &dead {
            self.peers.remove(id);
        }
        dead
    }

    /// Who names whom a suspect: each suspect with the peers whose latest
    /// heartbeat names it, and this node (`me`) if `mine` (its own
    /// aggregator's suspects) names it. Peers leave the view when they go
    /// silent, and their claims with them.
    pub fn suspected_by(&self, mine: &[PeerId]) -> BTreeMap<PeerId, Vec<PeerId>> {
        let mut by: BTreeMap<PeerId, Vec<PeerId>> = BTreeMap::new();
        let claims = self.peers.values().map(|p| (p.heartbeat.peer, &p.heartbeat.suspects[..]));
        for (reporter, suspects) in std::iter::once((self.me, mine)).chain(claims) {
            for s in suspects {
                let reporters = by.entry(*s).or_default();
                if !reporters.contains(&reporter) {
                    reporters.push(reporter);
                }
            }
        }
        by
    }

    /// The roster this node would propose now.
    pub fn proposal(&self, now_ms: u64, timeout_ms: u64) -> Roster {
        let mut members: Vec<(PeerId, bool)> = self
            .live(now_ms, timeout_ms)
            .iter()
            .map(|p| (p.heartbeat.peer, p.heartbeat.capabilities.can_aggregate))
            .collect();
        members.push((self.me, self.my_can_aggregate));
        Roster::new(members)
    }

    pub fn roster_status(&self, min_peers: usize, now_ms: u64, timeout_ms: u64) -> RosterStatus {
        let roster = self.proposal(now_ms, timeout_ms);
        if roster.members.len() < min_peers {
            return RosterStatus::Waiting { live: roster.members.len() };
        }
        let h = roster.hash();
        let all_agree = roster
            .members
            .iter()
            .filter(|m| m.0 != self.me)
            .all(|m| self.peers.get(&m.0).is_some_and(|p| p.heartbeat.epoch == h));
        if all_agree {
            RosterStatus::Agreed(roster)
        } else {
            RosterStatus::Proposed(roster)
        }
    }
}

/// What the view's heartbeats say of each shard, for the aggregator.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShardNews {
    /// Per shard, the newest version a live worker holds (0 where none
    /// says): a restored core takes it up.
    pub newest: Vec<u64>,
    /// Per shard, the peers that say they own it or hand it over: a new
    /// owner whose old owner is gone waits for their transfer.
    pub claimants: Vec<Vec<PeerId>>,
}

/// This node's fields in its own heartbeat, set by the worker.
#[derive(Debug, Clone, PartialEq)]
pub struct SelfState {
    pub role: Role,
    pub owned_shards: Vec<u32>,
    pub step: u64,
    pub model_version: u64,
    /// The version of each shard this node's worker holds, by shard (set
    /// by the worker as each shard's exchange ends; empty before the first).
    pub shard_versions: Vec<u64>,
    /// Once training has started: the frozen roster's hash.
    pub frozen_epoch: Option<u64>,
    /// Bump to publish a heartbeat now instead of at the next tick (roster
    /// frozen, training finished): peers learn of it without waiting a period.
    pub announce: u64,
    /// This node's measurements of the owners it pushes to.
    pub service: Vec<ServiceObservation>,
    /// Leaving cleanly: the heartbeat says `Leaving` so owners stop waiting
    /// for this node and the election moves its shards away.
    pub leaving: bool,
    /// The shards whose transfer this node's aggregator keeps or sends:
    /// the heartbeat names them among the owned shards.
    pub handing: Vec<u32>,
    /// Recent step and communication time (set by the worker) and the number
    /// of aggregators this node proposes (set by the election).
    pub pace: Pace,
    /// Measured compute rate, samples/s (set by the worker; 0 before its
    /// first step): the heartbeat's `capabilities.compute_samples_per_sec`.
    pub compute_samples_per_sec: f32,
    /// Measured exchange rate, bytes/s (set by the worker; 0 before its
    /// first exchange): the heartbeat's `capabilities.net_bytes_per_sec`.
    pub net_bytes_per_sec: f32,
    /// The shard checkpoints in this node's folder when it started.
    pub checkpoints: Vec<CheckpointOffer>,
    /// Workers this node's aggregator marked as suspects (at most
    /// `MAX_SUSPECTS`), set by the node from the aggregator.
    pub suspects: Vec<PeerId>,
    /// Finished training and seen every live peer finish: the heartbeat's
    /// `finished`, the second half of the end of a run (docs/protocol.md, §6.3).
    pub finished: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_protocol::{Capabilities, Device, RunId, ShardVersions, WIRE_VERSION};

    fn hb(peer: PeerId, seq: u64, epoch: u64) -> Heartbeat {
        Heartbeat {
            run: RunId::new("t").unwrap_or_default(),
            peer,
            incarnation: 1,
            seq,
            epoch,
            config_hash: 7,
            protocol_version: WIRE_VERSION,
            capabilities: Capabilities {
                device: Device::Cpu,
                memory_bytes: 0,
                compute_samples_per_sec: 0.0,
                net_bytes_per_sec: 0.0,
                can_aggregate: true,
            },
            role: Role::Joining,
            owned_shards: vec![],
            step: 0,
            model_version: 0,
            shard_versions: Default::default(),
            service: vec![],
            pace: Default::default(),
            checkpoints: vec![],
            suspects: vec![],
            finished: false,
        }
    }

    #[test]
    fn the_newest_shard_versions_are_the_largest_a_worker_in_the_view_holds() {
        let (me, a, b, quiet) = (PeerId::random(), PeerId::random(), PeerId::random(), PeerId::random());
        let mut v = View::new(me, true, 7);
        assert_eq!(v.newest_shard_versions(&[], 2), vec![0, 0]);
        let mut from_a = hb(a, 1, 0);
        from_a.shard_versions = ShardVersions::of(&[6, 5]);
        let mut from_b = hb(b, 1, 0);
        from_b.shard_versions = ShardVersions::of(&[5, 6]);
        assert!(v.observe(from_a, 0) && v.observe(from_b.clone(), 0) && v.observe(hb(quiet, 1, 0), 0));
        assert_eq!(v.newest_shard_versions(&[4, 4], 2), vec![6, 6]);
        assert_eq!(v.newest_shard_versions(&[7, 4], 2), vec![7, 6], "this node's own worker counts");
        // A newer heartbeat's versions are kept. (They change every step:
        // not a change that runs the election again; the membership
        // actor publishes the view every heartbeat period anyway.)
        from_b.seq = 2;
        from_b.shard_versions = ShardVersions::of(&[6, 7]);
        assert!(!v.observe(from_b, 0));
        // A peer that left the view says nothing any more.
        assert!(v.forget(&a));
        assert_eq!(v.newest_shard_versions(&[], 2), vec![6, 7]);
    }

    #[test]
    fn a_shards_claimants_are_the_peers_whose_heartbeat_names_it() {
        let (me, a, b) = (PeerId::random(), PeerId::random(), PeerId::random());
        let mut v = View::new(me, true, 7);
        let mut from_a = hb(a, 1, 0);
        from_a.owned_shards = vec![0, 2];
        let mut from_b = hb(b, 1, 0);
        from_b.owned_shards = vec![2, 9];
        assert!(v.observe(from_a, 0) && v.observe(from_b, 0));
        let mut both = vec![a, b];
        both.sort();
        assert_eq!(v.newest_shard_versions(&[3], 3), vec![3, 0, 0]);
        assert_eq!(v.shard_claimants(3), vec![vec![a], vec![], both], "shard 9 is past the layout: ignored");
        assert!(v.forget(&a));
        assert_eq!(v.shard_claimants(3), vec![vec![], vec![], vec![b]]);
    }

    #[test]
    fn suspects_are_listed_with_every_peer_that_names_them() {
        let (me, a, b, bad, other) =
            (PeerId::random(), PeerId::random(), PeerId::random(), PeerId::random(), PeerId::random());
        let mut v = View::new(me, true, 7);
        let mut from_a = hb(a, 1, 0);
        from_a.suspects = vec![bad];
        let mut from_b = hb(b, 1, 0);
        from_b.suspects = vec![bad, other];
        v.observe(from_a, 0);
        v.observe(from_b, 0);
        let by = v.suspected_by(&[bad]);
        let mut named_bad = by[&bad].clone();
        named_bad.sort();
        let mut want = vec![me, a, b];
        want.sort();
        assert_eq!(named_bad, want, "this node and both peers name it");
        assert_eq!(by[&other], vec![b]);
        assert_eq!(by.len(), 2);
        // A newer heartbeat that names nobody withdraws the claim; a peer
        // that goes silent leaves the view and takes its claims along.
        v.observe(hb(b, 2, 0), 10);
        assert!(!v.suspected_by(&[]).contains_key(&other));
        v.expire(5000, 1000);
        assert!(v.suspected_by(&[]).is_empty());
    }

    #[test]
    fn roster_agrees_only_when_everyone_proposes_it() {
        let ids: Vec<PeerId> = (0..3).map(|_| PeerId::random()).collect();
        let mut views: Vec<View> = ids.iter().map(|&me| View::new(me, true, 7)).collect();
        // Round 1: everyone hears everyone's initial (empty) proposal.
        for v in views.iter_mut() {
            for &p in &ids {
                v.observe(hb(p, 1, 0), 0);
            }
        }
        assert!(matches!(views[0].roster_status(3, 0, 1000), RosterStatus::Proposed(_)));
        assert!(matches!(views[0].roster_status(4, 0, 1000), RosterStatus::Waiting { live: 3 }));
        // Round 2: each now proposes the full roster.
        let proposals: Vec<u64> = views.iter().map(|v| v.proposal(0, 1000).hash()).collect();
        assert!(proposals.windows(2).all(|w| w[0] == w[1]), "same view, same proposal");
        for v in views.iter_mut() {
            for (i, &p) in ids.iter().enumerate() {
                v.observe(hb(p, 2, proposals[i]), 10);
            }
        }
        for v in &views {
            assert!(matches!(v.roster_status(3, 10, 1000), RosterStatus::Agreed(ref r) if r.members.len() == 3));
        }
    }

    #[test]
    fn mismatched_config_and_old_heartbeats_are_ignored() {
        let me = PeerId::random();
        let other = PeerId::random();
        let mut v = View::new(me, true, 7);
        let mut bad = hb(other, 1, 0);
        bad.config_hash = 8;
        assert!(v.observe(bad, 0));
        assert!(v.peers.is_empty());
        assert_eq!(v.mismatched.get(&other), Some(&8));
        assert!(v.observe(hb(other, 5, 0), 0));
        assert!(!v.observe(hb(other, 4, 0), 1), "an older heartbeat changes nothing");
        assert_eq!(v.expire(10_000, 1000), vec![other]);
    }

    /// A heartbeat of another wire version, older or newer, is refused and
    /// counted as a config mismatch is; the view remembers a bounded number
    /// of such peers.
    #[test]
    fn heartbeats_of_another_wire_version_are_refused() {
        let me = PeerId::random();
        let mut v = View::new(me, true, 7);
        for theirs in [WIRE_VERSION - 1, WIRE_VERSION + 1] {
            let other = PeerId::random();
            let mut hb_other = hb(other, 1, 0);
            hb_other.protocol_version = theirs;
            assert!(v.observe(hb_other.clone(), 0), "a new peer of another version is news");
            hb_other.seq = 2;
            assert!(!v.observe(hb_other, 1), "and only once");
            assert!(!v.peers.contains_key(&other));
            assert_eq!(v.other_version.get(&other), Some(&theirs));
        }
        assert!(v.mismatched.is_empty(), "not counted as another config");
        // Positive control: our version joins the view.
        let same = PeerId::random();
        assert!(v.observe(hb(same, 1, 0), 2));
        assert!(v.peers.contains_key(&same) && !v.other_version.contains_key(&same));
        // Bounded like the config mismatches.
        for _ in 0..MAX_MISMATCHED + 3 {
            let mut other = hb(PeerId::random(), 1, 0);
            other.protocol_version = WIRE_VERSION + 1;
            v.observe(other, 3);
        }
        assert_eq!((v.other_version.len(), v.refused), (MAX_MISMATCHED, 5));
    }

    /// A flood of fresh identities fills the view to its bound and no
    /// further; once they expire, new peers are admitted again.
    #[test]
    fn the_view_is_bounded() {
        let mut v = View::new(PeerId::random(), true, 7);
        for _ in 0..MAX_PEERS + 10 {
            v.observe(hb(PeerId::random(), 1, 0), 0);
        }
        assert_eq!((v.peers.len(), v.refused), (MAX_PEERS, 10));
        for _ in 0..MAX_MISMATCHED + 5 {
            let mut other = hb(PeerId::random(), 1, 0);
            other.config_hash = 8;
            v.observe(other, 0);
        }
        assert_eq!((v.mismatched.len(), v.refused), (MAX_MISMATCHED, 15));
        assert_eq!(v.expire(10_000, 1000).len(), MAX_PEERS);
        let late = PeerId::random();
        assert!(v.observe(hb(late, 1, 0), 10_000));
        assert!(v.peers.contains_key(&late));
    }
}
