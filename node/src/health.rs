//! Straggler detection from gossiped service times.
//!
//! Every worker times each push it sends to a remote shard owner (the
//! owner's service time, per MiB) and keeps an exponential moving average per
//! owner ([`ServiceTracker`]). Heartbeats carry those averages. Each node
//! then judges every owner from the *lower median* of the reports about it
//! ([`medians`]), so one lying or confused reporter cannot demote a healthy
//! node: more than half of the reporters must agree it is slow.
//!
//! [`stragglers`] compares each owner's median with the lower median over all
//! owners (the cluster's norm), with hysteresis: an owner is demoted when it
//! is `demote_ratio` times slower than the norm, and a demoted owner comes
//! back only once it is within `restore_ratio` of the norm, or once the
//! reports about it have aged out (nobody pushes to a demoted owner, so its
//! reporters forget it after `forget_steps` steps and it gets another try).
//! Everything here is pure: the same reports give the same verdicts on every node.

use std::collections::{BTreeMap, BTreeSet};

use shoal_protocol::libp2p::PeerId;
use shoal_protocol::{ServiceObservation, MAX_SERVICE_OBSERVATIONS};

/// Thresholds of the straggler detector.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HealthPolicy {
    /// Demote an owner whose service time is this many times the norm.
    pub demote_ratio: f64,
    /// A demoted owner stays out until it is within this ratio of the norm.
    pub restore_ratio: f64,
    /// ... and only if it is also slower than the norm by at least this many
    /// µs per MiB: on a fast LAN or loopback, where a push takes well under a
    /// millisecond, scheduling noise alone reaches 3x and must not move shards.
    pub min_excess_micros_per_mib: f64,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        Self { demote_ratio: 3.0, restore_ratio: 1.5, min_excess_micros_per_mib: 0.0 }
    }
}

/// The lower median: the smaller middle element, so a tie between honest and
/// lying halves goes to the smaller (healthier) value.
fn lower_median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[(v.len() - 1) / 2])
}

/// A report counts once it averages this many pushes: one slow first push
/// (connection set-up, a scheduling hiccup) must not demote anybody.
pub const MIN_SAMPLES: u32 = 3;

/// Median service time (µs per MiB) of each owner over the reports about it.
/// Self-reports, reports of fewer than [`MIN_SAMPLES`] pushes, and
/// non-finite or non-positive values are ignored.
pub fn medians<'a>(reports: impl IntoIterator<Item = (PeerId, &'a [ServiceObservation])>) -> BTreeMap<PeerId, f64> {
    let mut by_owner: BTreeMap<PeerId, Vec<f64>> = BTreeMap::new();
    for (reporter, obs) in reports {
        for o in obs {
            let v = o.micros_per_mib as f64;
            if o.owner != reporter && o.samples >= MIN_SAMPLES && v.is_finite() && v > 0.0 {
                by_owner.entry(o.owner).or_default().push(v);
            }
        }
    }
    by_owner.into_iter().filter_map(|(owner, v)| Some((owner, lower_median(v)?))).collect()
}

/// Owners judged too slow. `serving(peer)` says whether the peer currently
/// serves shards (from its own heartbeat); it selects which threshold applies.
pub fn stragglers(
    medians: &BTreeMap<PeerId, f64>,
    serving: impl Fn(&PeerId) -> bool,
    policy: HealthPolicy,
) -> BTreeSet<PeerId> {
    let Some(norm) = lower_median(medians.values().copied().collect()) else { return BTreeSet::new() };
    if norm <= 0.0 {
        return BTreeSet::new();
    }
    medians
        .iter()
        .filter(|(peer, &m)| {
            let ratio = m / norm;
            m - norm >= policy.min_excess_micros_per_mib
                && (ratio >= policy.demote_ratio || (ratio >= policy.restore_ratio && !serving(peer)))
        })
        .map(|(p, _)| *p)
        .collect()
}

#[derive(Debug, Clone, Copy)]
struct Tracked {
    micros_per_mib: f64,
    samples: u32,
    last_step: u64,
}

/// A worker's measurements of the owners it pushes to.
#[derive(Debug, Clone, Default)]
pub struct ServiceTracker {
    owners: BTreeMap<PeerId, Tracked>,
}

impl ServiceTracker {
    /// Record one push of `bytes` to `owner` that took `micros` to be answered.
    pub fn observe(&mut self, owner: PeerId, bytes: u64, micros: f64, step: u64) {
        if bytes == 0 || !micros.is_finite() || micros < 0.0 {
            return;
        }
        let per_mib = micros * (1024.0 * 1024.0) / bytes as f64;
        let t = self.owners.entry(owner).or_insert(Tracked { micros_per_mib: per_mib, samples: 0, last_step: step });
        t.micros_per_mib = if t.samples == 0 { per_mib } else { 0.7 * t.micros_per_mib + 0.3 * per_mib };
        t.samples = t.samples.saturating_add(1);
        t.last_step = step;
    }

    /// The summary for a heartbeat: owners measured within the last
    /// `forget_steps` steps, at most the protocol's limit, freshest first.
    pub fn report(&mut self, step: u64, forget_steps: u64) -> Vec<ServiceObservation> {
        self.owners.retain(|_, t| step.saturating_sub(t.last_step) <= forget_steps);
        let mut out: Vec<(u64, ServiceObservation)> = self
            .owners
            .iter()
            .map(|(owner, t)| {
                (
                    t.last_step,
                    ServiceObservation {
                        owner: *owner,
                        micros_per_mib: t.micros_per_mib.min(f32::MAX as f64) as f32,
                        samples: t.samples,
                    },
                )
            })
            .collect();
        out.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.owner.cmp(&b.1.owner)));
        out.into_iter().take(MAX_SERVICE_OBSERVATIONS).map(|(_, o)| o).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obs(owner: PeerId, v: f32) -> ServiceObservation {
        ServiceObservation { owner, micros_per_mib: v, samples: 10 }
    }

    #[test]
    fn one_liar_cannot_demote_a_healthy_owner() {
        let owners: Vec<PeerId> = (0..4).map(|_| PeerId::random()).collect();
        let reporters: Vec<PeerId> = (0..3).map(|_| PeerId::random()).collect();
        let honest: Vec<ServiceObservation> = owners.iter().map(|&o| obs(o, 100.0)).collect();
        let mut lying = honest.clone();
        lying[0].micros_per_mib = 1e6;
        let reports =
            vec![(reporters[0], honest.as_slice()), (reporters[1], honest.as_slice()), (reporters[2], &lying)];
        let m = medians(reports.clone());
        assert_eq!(m[&owners[0]], 100.0);
        assert!(stragglers(&m, |_| true, HealthPolicy::default()).is_empty());
        // Even with only two reporters, one of them lying, the lower median holds.
        let m = medians(reports[1..].to_vec());
        assert!(stragglers(&m, |_| true, HealthPolicy::default()).is_empty());
    }

    #[test]
    fn a_slow_owner_is_demoted_when_most_reporters_see_it() {
        let owners: Vec<PeerId> = (0..2).map(|_| PeerId::random()).collect();
        let r: Vec<PeerId> = (0..3).map(|_| PeerId::random()).collect();
        let seen = vec![obs(owners[0], 100.0), obs(owners[1], 500.0)];
        let m = medians(r.iter().map(|&p| (p, seen.as_slice())));
        let s = stragglers(&m, |_| true, HealthPolicy::default());
        assert_eq!(s.into_iter().collect::<Vec<_>>(), vec![owners[1]], "5x the norm of 2 owners");
    }

    #[test]
    fn hysteresis_keeps_a_demoted_owner_out_until_it_recovers() {
        let owners: Vec<PeerId> = (0..3).map(|_| PeerId::random()).collect();
        let r = PeerId::random();
        let p = HealthPolicy::default();
        let at = |v: f32| {
            let seen = vec![obs(owners[0], 100.0), obs(owners[1], 100.0), obs(owners[2], v)];
            medians([(r, seen.as_slice())])
        };
        // 5x the norm, but by less than the absolute floor: noise, not a straggler.
        let floor = HealthPolicy { min_excess_micros_per_mib: 1000.0, ..p };
        assert!(stragglers(&at(500.0), |_| true, floor).is_empty());
        assert!(stragglers(&at(1500.0), |_| true, floor).contains(&owners[2]));
        // 2x the norm: a serving owner stays, a demoted one stays out.
        assert!(stragglers(&at(200.0), |_| true, p).is_empty());
        assert!(stragglers(&at(200.0), |_| false, p).contains(&owners[2]));
        // Back within 1.5x: restored. Past 3x: demoted whatever it does now.
        assert!(stragglers(&at(140.0), |_| false, p).is_empty());
        assert!(stragglers(&at(310.0), |_| true, p).contains(&owners[2]));
        // Self-reports are ignored.
        let own = vec![obs(r, 1e9)];
        assert!(medians([(r, own.as_slice())]).is_empty());
        // So are reports of too few pushes.
        let early = vec![ServiceObservation { owner: owners[0], micros_per_mib: 1e9, samples: MIN_SAMPLES - 1 }];
        assert!(medians([(r, early.as_slice())]).is_empty());
    }

    #[test]
    fn tracker_averages_and_forgets() {
        let o = PeerId::random();
        let mut t = ServiceTracker::default();
        t.observe(o, 1024 * 1024, 100.0, 1);
        t.observe(o, 1024 * 1024, 200.0, 2);
        let r = t.report(2, 10);
        assert_eq!(r.len(), 1);
        assert!((r[0].micros_per_mib - 130.0).abs() < 1e-3, "{}", r[0].micros_per_mib);
        assert_eq!(r[0].samples, 2);
        assert!(t.report(13, 10).is_empty(), "not pushed to for 11 steps: forgotten");
    }
}
