//! Shard ownership as a pure function of the view.
//!
//! `assign(view, shards, policy)` has no clock, no RNG and no I/O: every node
//! that holds the same view computes the same owners, so no coordinator or
//! consensus round is needed. Ownership uses weighted rendezvous hashing
//! (highest random weight): shard `s` goes to the candidate with the largest
//! `-weight / ln(u(peer, s))`, where `u` is a stable hash mapped into (0, 1),
//! with bounded loads: a candidate holds at most `ceil(S * weight / total)`
//! shards and a shard whose favourite is full goes to its next choice. Plain
//! rendezvous gives shares proportional to weight only on average (with 8
//! shards over 4 equal nodes one node often got 4 or more); the bound makes
//! the shares exact, and a change of view still moves few shards.

use shoal_models::rng::{stable_hash64, StableHasher};

/// A node as the assignment sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate<K> {
    pub peer: K,
    /// Relative capacity (1.0 = nominal). Zero or negative excludes the peer.
    pub weight: f64,
}

/// Knobs of the election.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AssignPolicy {
    /// At most this many aggregators (0: no limit). The heaviest candidates
    /// are kept, ties broken by the peer's hash.
    pub max_aggregators: usize,
}

/// Who owns each shard, under which epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment<K> {
    /// Derived from the inputs: equal views give equal epochs.
    pub epoch: u64,
    /// `owners[shard]`.
    pub owners: Vec<K>,
}

impl<K: Clone + PartialEq> Assignment<K> {
    pub fn owner(&self, shard: u32) -> Option<&K> {
        self.owners.get(shard as usize)
    }

    /// Shards owned by `peer`.
    pub fn owned_by(&self, peer: &K) -> Vec<u32> {
        self.owners.iter().enumerate().filter(|(_, o)| *o == peer).map(|(i, _)| i as u32).collect()
    }

    /// The distinct owners, in shard order of first appearance.
    pub fn aggregators(&self) -> Vec<K> {
        let mut out: Vec<K> = Vec::new();
        for o in &self.owners {
            if !out.contains(o) {
                out.push(o.clone());
            }
        }
        out
    }
}

/// Map a 64-bit hash into (0, 1), never 0 or 1 (so `ln` is finite and < 0).
fn unit(h: u64) -> f64 {
    ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// Compute the assignment. Returns `None` when no candidate can own shards.
pub fn assign<K: AsRef<[u8]> + Clone + PartialEq>(
    candidates: &[Candidate<K>],
    num_shards: u32,
    policy: AssignPolicy,
) -> Option<Assignment<K>> {
    // Each candidate's hash is computed once (the sort would hash on every
    // comparison).
    let mut eligible: Vec<(u64, &Candidate<K>)> = candidates
        .iter()
        .filter(|c| c.weight > 0.0 && c.weight.is_finite())
        .map(|c| (stable_hash64(c.peer.as_ref()), c))
        .collect();
    // Canonical order, independent of how the view was collected.
    eligible.sort_by(|(ha, a), (hb, b)| {
        b.weight.total_cmp(&a.weight).then_with(|| ha.cmp(hb)).then_with(|| a.peer.as_ref().cmp(b.peer.as_ref()))
    });
    eligible.dedup_by(|(_, a), (_, b)| a.peer == b.peer);
    if policy.max_aggregators > 0 {
        eligible.truncate(policy.max_aggregators);
    }
    let eligible: Vec<&Candidate<K>> = eligible.into_iter().map(|(_, c)| c).collect();
    if eligible.is_empty() {
        return None;
    }
    let total: f64 = eligible.iter().map(|c| c.weight).sum();
    let caps: Vec<usize> =
        eligible.iter().map(|c| ((num_shards as f64) * c.weight / total).ceil().max(1.0) as usize).collect();
    // A candidate's score for shard `s` hashes its id followed by `s`: the
    // id's part is hashed once.
    let prefixes: Vec<StableHasher> = eligible.iter().map(|c| StableHasher::new().update(c.peer.as_ref())).collect();
    let mut load = vec![0usize; eligible.len()];
    let mut owners: Vec<K> = Vec::with_capacity(num_shards as usize);
    for s in 0..num_shards {
        // The highest score among candidates with room; ties (astronomically
        // unlikely) go to the earlier candidate in canonical order.
        let mut best: Option<(f64, usize)> = None;
        for (i, c) in eligible.iter().enumerate() {
            if load[i] >= caps[i] {
                continue;
            }
            let score = -c.weight / unit(prefixes[i].update(&s.to_le_bytes()).finish()).ln();
            if best.is_none_or(|(b, _)| score.total_cmp(&b).is_gt()) {
                best = Some((score, i));
            }
        }
        // The caps add up to at least num_shards, so some candidate has room.
        let (_, i) = best?;
        load[i] += 1;
        owners.push(eligible[i].peer.clone());
    }
    // The hash of the shard count, then each candidate's id and weight, in
    // order, fed piece by piece (the same hash as of their concatenation).
    let mut digest = StableHasher::new().update(&num_shards.to_le_bytes());
    for c in &eligible {
        digest = digest.update(c.peer.as_ref()).update(&c.weight.to_bits().to_le_bytes());
    }
    Some(Assignment { epoch: digest.finish(), owners })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cands(n: usize) -> Vec<Candidate<Vec<u8>>> {
        (0..n).map(|i| Candidate { peer: format!("peer-{i}").into_bytes(), weight: 1.0 }).collect()
    }

    #[test]
    fn same_view_same_assignment_in_any_order() {
        let a = assign(&cands(5), 64, AssignPolicy::default());
        let mut rev = cands(5);
        rev.reverse();
        let b = assign(&rev, 64, AssignPolicy::default());
        assert!(a.is_some());
        assert_eq!(a, b);
    }

    #[test]
    fn removing_a_peer_moves_few_other_shards() {
        let Some(before) = assign(&cands(5), 256, AssignPolicy::default()) else { panic!() };
        let gone = b"peer-2".to_vec();
        let rest: Vec<_> = cands(5).into_iter().filter(|c| c.peer != gone).collect();
        let Some(after) = assign(&rest, 256, AssignPolicy::default()) else { panic!() };
        assert_ne!(before.epoch, after.epoch);
        let orphaned = before.owned_by(&gone).len();
        let needless = (0..256).filter(|&s| before.owners[s] != gone && before.owners[s] != after.owners[s]).count();
        // Bounded loads may shift a few shards to make room; far fewer than a rehash (~80%).
        assert!(needless <= orphaned / 2, "{needless} shards moved needlessly ({orphaned} orphaned)");
        assert!(after.owned_by(&gone).is_empty());
    }

    #[test]
    fn equal_weights_give_balanced_loads() {
        for (nodes, shards) in [(4usize, 8u32), (3, 8), (5, 64), (4, 7)] {
            let Some(a) = assign(&cands(nodes), shards, AssignPolicy::default()) else { panic!() };
            let cap = (shards as usize).div_ceil(nodes);
            for c in cands(nodes) {
                let n = a.owned_by(&c.peer).len();
                assert!(n <= cap, "{nodes} nodes, {shards} shards: {n} over the cap {cap}");
                if (shards as usize).is_multiple_of(nodes) {
                    assert_eq!(n, cap, "{nodes} nodes, {shards} shards: uneven split");
                }
            }
            assert_eq!(a.owners.len(), shards as usize);
        }
    }

    #[test]
    fn shares_follow_weights() {
        let mut c = cands(2);
        c[0].weight = 3.0;
        let Some(a) = assign(&c, 4000, AssignPolicy::default()) else { panic!() };
        let heavy = a.owned_by(&c[0].peer).len() as f64 / 4000.0;
        assert!((0.70..0.80).contains(&heavy), "share {heavy}");
        c[1].weight = 0.0;
        let Some(a) = assign(&c, 10, AssignPolicy::default()) else { panic!() };
        assert_eq!(a.aggregators(), vec![c[0].peer.clone()]);
        assert!(assign(&[] as &[Candidate<Vec<u8>>], 10, AssignPolicy::default()).is_none());
    }

    #[test]
    fn max_aggregators_caps_the_set() {
        let Some(a) = assign(&cands(6), 100, AssignPolicy { max_aggregators: 2 }) else { panic!() };
        assert_eq!(a.aggregators().len(), 2);
    }

    /// The assignment as first written: every score hashed in full, every
    /// shard's candidates sorted. `assign` must give the same owners, or
    /// nodes of two versions would disagree on the placement.
    fn reference(candidates: &[Candidate<Vec<u8>>], num_shards: u32, max: usize) -> Option<Vec<Vec<u8>>> {
        let mut eligible: Vec<&Candidate<Vec<u8>>> =
            candidates.iter().filter(|c| c.weight > 0.0 && c.weight.is_finite()).collect();
        eligible.sort_by(|a, b| {
            b.weight
                .total_cmp(&a.weight)
                .then_with(|| stable_hash64(&a.peer).cmp(&stable_hash64(&b.peer)))
                .then_with(|| a.peer.cmp(&b.peer))
        });
        eligible.dedup_by(|a, b| a.peer == b.peer);
        if max > 0 {
            eligible.truncate(max);
        }
        let total: f64 = eligible.iter().map(|c| c.weight).sum();
        let caps: Vec<usize> =
            eligible.iter().map(|c| ((num_shards as f64) * c.weight / total).ceil().max(1.0) as usize).collect();
        let mut load = vec![0usize; eligible.len()];
        let mut owners = Vec::new();
        for s in 0..num_shards {
            let mut ranked: Vec<(f64, usize)> = eligible
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    let mut key = c.peer.clone();
                    key.extend_from_slice(&s.to_le_bytes());
                    (-c.weight / unit(stable_hash64(&key)).ln(), i)
                })
                .collect();
            ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            let &(_, i) = ranked.iter().find(|&&(_, i)| load[i] < caps[i])?;
            load[i] += 1;
            owners.push(eligible[i].peer.clone());
        }
        Some(owners)
    }

    #[test]
    fn the_assignment_matches_the_reference_on_random_views() {
        let mut rng = shoal_models::rng::DetRng::new(42);
        for _ in 0..300 {
            let n = 1 + rng.below(40) as usize;
            let mut c: Vec<Candidate<Vec<u8>>> = (0..n)
                .map(|_| Candidate {
                    peer: format!("peer-{}", rng.below(60)).into_bytes(),
                    weight: [0.0, 0.5, 1.0, 1.0, 2.0, 4.0][rng.below(6) as usize],
                })
                .collect();
            rng.shuffle(&mut c);
            let shards = 1 + rng.below(64) as u32;
            let max = rng.below(4) as usize;
            let got = assign(&c, shards, AssignPolicy { max_aggregators: max }).map(|a| a.owners);
            assert_eq!(got, reference(&c, shards, max), "{n} candidates, {shards} shards, at most {max}");
        }
    }
}
