//! Straggler detection from gossiped service times.
//!
//! Every worker times each push it sends to a remote shard owner (the
//! owner's service time, per MiB) and keeps an exponential moving average per
//! owner ([`ServiceTracker`]). The service time is the one the owner
//! reports in its answer (`ShardResponse::Timed`: its own queues, CPU and
//! serving delays, not the worker's waits or the network); an answer that
//! reports none is timed by the round trip less the path's latency
//! ([`less_path`]). Heartbeats carry those averages. Each node
//! then judges every owner from the *lower median* of the reports about it
//! ([`medians`]), so one lying or confused reporter cannot demote a healthy
//! node: more than half of the reporters must agree it is slow.
//!
//! [`stragglers`] compares each owner's median with the lower median over all
//! owners (the cluster's norm), with hysteresis: an owner is demoted when it
//! is `demote_ratio` times slower than the norm, and a demoted owner comes
//! back only once it is within `restore_ratio` of the norm. Nobody pushes
//! to a demoted owner, so workers *probe* it (see [`ServiceTracker`]) to keep
//! the reports about it fresh; only if the probes fail (a peer of an older
//! wire revision) do its reports age out after `forget_steps` steps and it
//! gets another try with shards.
//! Everything here is pure: the same reports give the same verdicts on every node.

use std::collections::{BTreeMap, BTreeSet};

use shoal_protocol::{Device, PeerId, ServiceObservation, MAX_SERVICE_OBSERVATIONS};

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
    /// The same floor per step, for gossiped compute rates
    /// ([`capability_levels`]): `straggler_min_excess_ms`.
    pub min_excess_micros_per_step: f64,
}

impl HealthPolicy {
    /// The policy under which no measurement can move a shard (elastic
    /// roles off, `RolesConfig::health_policy`): no owner is ever a
    /// straggler, every capacity level stays 0 and gossiped rates cap
    /// nothing.
    pub fn inert() -> HealthPolicy {
        HealthPolicy {
            demote_ratio: f64::INFINITY,
            restore_ratio: f64::INFINITY,
            min_excess_micros_per_mib: f64::INFINITY,
            min_excess_micros_per_step: f64::INFINITY,
        }
    }

    /// Whether this is [`HealthPolicy::inert`].
    pub fn is_inert(&self) -> bool {
        *self == HealthPolicy::inert()
    }
}

impl Default for HealthPolicy {
    fn default() -> Self {
        Self { demote_ratio: 3.0, restore_ratio: 1.5, min_excess_micros_per_mib: 0.0, min_excess_micros_per_step: 0.0 }
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

/// The owners that `reporter`'s report alone would demote: the same rule as
/// [`stragglers`], with that one report's owners as the norm, and the same
/// hysteresis: an owner in `before` (this set as last computed) stays in it
/// until it is within `restore_ratio` of the norm, so an owner hovering at
/// `demote_ratio` does not flip the set on every check. A worker publishes
/// its report at once, not at its next heartbeat, when this set changes
/// (see `Worker::after_exchange`): a verdict needs more than half of the
/// reports about an owner, and waiting a heartbeat for each was most of the
/// time a slow owner kept its shards.
pub fn would_demote(
    reporter: PeerId,
    report: &[ServiceObservation],
    before: &BTreeSet<PeerId>,
    policy: HealthPolicy,
) -> BTreeSet<PeerId> {
    stragglers(&medians([(reporter, report)]), |p| !before.contains(p), policy)
}

/// Most and least capacity level: weights 4 and 0.25 relative to the norm.
pub const MAX_LEVEL: i8 = 2;
pub const MIN_LEVEL: i8 = -2;

/// How far (in powers of two) an owner's speed must pass the edge of its
/// current level's band before its level moves: 2^0.25, about 1.19x.
pub const LEVEL_HYSTERESIS: f64 = 0.25;

/// Capacity levels ignore differences from the norm smaller than this many
/// times the straggler floor (`min_excess_micros_per_mib`): moving shards
/// between healthy owners is an optimisation and needs a clear signal.
pub const LEVEL_FLOOR_FACTOR: f64 = 2.0;

/// The capacity weight of a level: 2^level.
pub fn weight_of(level: i8) -> f64 {
    f64::from(level.clamp(MIN_LEVEL, MAX_LEVEL)).exp2()
}

/// Capacity level of each measured owner for the weighted rendezvous: its
/// weight is [`weight_of`] the level, the owner's speed relative to the norm
/// rounded towards 1 to a power of two. Within 2x of the norm (or within
/// [`LEVEL_FLOOR_FACTOR`] times the noise floor `min_excess_micros_per_mib`
/// of it) the level is 0 (weight 1);
/// an owner 2 to 4 times faster gets 1 (weight 2), 4 or more times faster 2;
/// one 2 to 4 times slower gets -1 (past `demote_ratio` it is a straggler and
/// gets nothing).
///
/// Hysteresis, as for stragglers, comes from gossiped state so that every
/// node decides the same: `prior(owner)` is the level the owner holds in its
/// own latest placement (from its heartbeat). An owner keeps its prior level
/// until its speed leaves that level's band by [`LEVEL_HYSTERESIS`]. Without
/// it, measurement noise around a band edge moved shards back and forth
/// every heartbeat, and each move itself slowed the pushes that measure the
/// owners. Unmeasured owners are not in the map (weight 1).
pub fn capacity_levels(
    medians: &BTreeMap<PeerId, f64>,
    prior: impl Fn(&PeerId) -> i8,
    policy: HealthPolicy,
) -> BTreeMap<PeerId, i8> {
    let Some(norm) = lower_median(medians.values().copied().collect()) else { return BTreeMap::new() };
    if !(norm > 0.0 && norm.is_finite()) {
        return BTreeMap::new();
    }
    medians
        .iter()
        .map(|(peer, &m)| {
            let raw =
                if (m - norm).abs() < LEVEL_FLOOR_FACTOR * policy.min_excess_micros_per_mib || m.is_nan() || m <= 0.0 {
                    0.0
                } else {
                    (norm / m).log2()
                };
            (*peer, level_with_hysteresis(raw, prior(peer).clamp(MIN_LEVEL, MAX_LEVEL)))
        })
        .collect()
}

/// What a member says it can do, from its heartbeat: its device class and
/// measured rates (`capabilities`; 0: not measured yet), and its compute
/// time per step (`pace`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Capacity {
    pub device: Device,
    /// The trainer's samples per second of compute time.
    pub compute_samples_per_sec: f32,
    /// Bytes per second of its exchanges with remote owners.
    pub net_bytes_per_sec: f32,
    /// Its recent compute time per step, µs (step less communication).
    pub compute_micros: f32,
}

impl Default for Capacity {
    fn default() -> Self {
        Self { device: Device::Cpu, compute_samples_per_sec: 0.0, net_bytes_per_sec: 0.0, compute_micros: 0.0 }
    }
}

/// Capacity levels from gossiped capabilities: a cap on each member's
/// weight in the rendezvous, never a raise. From level 0, a member whose
/// compute rate or link rate is under 1/2^1.25 (about 0.42) of the norm's
/// weighs as an owner at level -1 (weight 0.5), and one at a quarter or
/// less as -2 (weight 0.25), measured as an owner or not. The norm of each
/// rate is the upper median of the members that report it (the faster
/// middle one: with two members, the slower is judged against the
/// faster); compute rates are compared only between members of the same
/// device class, since a GPU's samples per second say nothing of the CPU
/// that sums its shards.
///
/// The hysteresis is that of [`capacity_levels`], with the same `prior`
/// (the level the member holds in its own latest placement: the lower of
/// its service and capability levels), so a rate hovering at a band edge
/// does not move shards. So is the noise floor: a link rate counts only
/// once the time it adds per MiB passes [`LEVEL_FLOOR_FACTOR`] times
/// `min_excess_micros_per_mib` (on loopback a round trip is mostly
/// scheduling), and a compute rate once the time it adds to the member's
/// own step (its gossiped compute time less what the norm's rate would
/// take) passes that factor times `min_excess_micros_per_step` (a step of
/// a small model takes a millisecond or two, and the rates of healthy
/// nodes sharing two cores were seen 2x apart). Members with no reported
/// rate are not in the map; nor is anyone under static roles (an infinite
/// floor: only failures move shards).
///
/// Why: service times only measure owners. Before a node has owned a
/// shard, the election knew nothing of it, and exploring upwards from one
/// owner picked the next one by hash: an edge board on a slow uplink was
/// as likely as a server. And an owner's reported service time leaves out
/// its link, so a slow uplink did not lower its share.
pub fn capability_levels(
    caps: &BTreeMap<PeerId, Capacity>,
    prior: impl Fn(&PeerId) -> i8,
    policy: HealthPolicy,
) -> BTreeMap<PeerId, i8> {
    const MICROS_PER_MIB_AT_ONE_BYTE_PER_SEC: f64 = 1024.0 * 1024.0 * 1e6;
    let mut out = BTreeMap::new();
    if !(policy.min_excess_micros_per_mib.is_finite() && policy.min_excess_micros_per_step.is_finite()) {
        return out;
    }
    let reported = |r: f32| f64::from(r).is_finite() && r > 0.0;
    // The faster middle value of the reported rates among `rates`.
    let upper_median = |rates: &mut dyn Iterator<Item = f32>| {
        let mut v: Vec<f64> = rates.filter(|r| reported(*r)).map(f64::from).collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    };
    // Each norm once: the compute rate's per device class, the link's.
    let mut devices: Vec<Device> = Vec::new();
    for c in caps.values() {
        if !devices.contains(&c.device) {
            devices.push(c.device);
        }
    }
    let compute_norms: Vec<(Device, Option<f64>)> = devices
        .iter()
        .map(|&d| {
            let mut same = caps.values().filter(|c| c.device == d).map(|c| c.compute_samples_per_sec);
            (d, upper_median(&mut same))
        })
        .collect();
    let link_norm = upper_median(&mut caps.values().map(|c| c.net_bytes_per_sec));
    let floor = LEVEL_FLOOR_FACTOR;
    for (peer, c) in caps {
        let mut raws = Vec::with_capacity(2);
        let compute = f64::from(c.compute_samples_per_sec);
        if reported(c.compute_samples_per_sec) {
            if let Some(norm) = compute_norms.iter().find(|(d, _)| *d == c.device).and_then(|(_, n)| *n) {
                // The time its step would lose at the norm's rate.
                let excess = f64::from(c.compute_micros).max(0.0) * (1.0 - compute / norm);
                if excess >= floor * policy.min_excess_micros_per_step {
                    raws.push((compute / norm).log2());
                }
            }
        }
        let link = f64::from(c.net_bytes_per_sec);
        if reported(c.net_bytes_per_sec) {
            if let Some(norm) = link_norm {
                let excess = MICROS_PER_MIB_AT_ONE_BYTE_PER_SEC * (1.0 / link - 1.0 / norm);
                if excess >= floor * policy.min_excess_micros_per_mib {
                    raws.push((link / norm).log2());
                }
            }
        }
        let Some(raw) = raws.into_iter().reduce(f64::min) else { continue };
        let level = level_with_hysteresis(raw.min(0.0), prior(peer).clamp(MIN_LEVEL, MAX_LEVEL)).min(0);
        if level < 0 {
            out.insert(*peer, level);
        }
    }
    out
}

/// The level for a speed of `2^raw` times the norm, given the current level.
fn level_with_hysteresis(raw: f64, current: i8) -> i8 {
    // The band of raw speeds that truncates to each level.
    let band = |l: i8| -> (f64, f64) {
        let l = f64::from(l);
        match l {
            l if l > 0.0 => (l, l + 1.0),
            l if l < 0.0 => (l - 1.0, l),
            _ => (-1.0, 1.0),
        }
    };
    let (mut lo, mut hi) = band(current);
    if current == MAX_LEVEL {
        hi = f64::INFINITY;
    }
    if current == MIN_LEVEL {
        lo = f64::NEG_INFINITY;
    }
    if raw > lo - LEVEL_HYSTERESIS && raw < hi + LEVEL_HYSTERESIS {
        return current;
    }
    (raw.trunc().clamp(f64::from(MIN_LEVEL), f64::from(MAX_LEVEL))) as i8
}

/// Ping round trips kept per peer by [`PathLatency`]: with libp2p's ping
/// every 15 s, the floor covers the last two minutes.
pub const PATH_RTT_WINDOW: usize = 8;

/// The network's own round trip to each connected peer: the least of its
/// last [`PATH_RTT_WINDOW`] ping round trips (delays only ever add to a
/// ping, so the least is the path's latency and the rest is queueing).
///
/// A worker subtracts it from a push's round trip before timing the owner
/// ([`less_path`]). Without that, a request's fixed cost on a WAN link (a
/// round trip of tens of ms) counted per MiB against the owner: an owner
/// holding one of a worker's shards paid it for one shard, owners batched
/// with `PushPullMany` for several, so on a slow path the single-shard
/// owner could look several times slower per MiB while serving as fast.
#[derive(Debug, Clone, Default)]
pub struct PathLatency {
    peers: BTreeMap<PeerId, std::collections::VecDeque<f64>>,
}

impl PathLatency {
    /// One ping round trip to `peer`, in µs (non-finite or negative ones are ignored).
    pub fn record(&mut self, peer: PeerId, micros: f64) {
        if !(micros.is_finite() && micros >= 0.0) {
            return;
        }
        let w = self.peers.entry(peer).or_default();
        if w.len() >= PATH_RTT_WINDOW {
            w.pop_front();
        }
        w.push_back(micros);
    }

    /// The path's round trip to `peer` in µs, `None` before its first ping.
    pub fn floor(&self, peer: &PeerId) -> Option<f64> {
        self.peers.get(peer)?.iter().copied().reduce(f64::min)
    }

    /// `peer`'s last connection closed: its path may differ next time.
    pub fn forget(&mut self, peer: &PeerId) {
        self.peers.remove(peer);
    }
}

/// Requests in a row that time out on one connection, with no answer
/// between them, before [`StalledConnections`] calls it stalled. A stream
/// that does not even open in time (libp2p gives it 10 s) while nothing
/// else to the peer is in flight stalls the connection at once.
pub const STALLED_AFTER_TIMEOUTS: u32 = 2;

/// Connections on which requests stopped getting through: each
/// connection's timed-out requests since its last answer.
///
/// One overloaded connection can stall while the same peer's others carry
/// traffic: in the 64-process swarm on a slow 2-core host, a worker's
/// pushes to one owner each hit libp2p's 10 s limit on opening a stream,
/// one after another for a whole minute, while the owner took the other
/// 61 workers' pushes (docs/operations.md, swarm64). Every retry went down
/// the same connection. Once a stream fails to open on it, or
/// [`STALLED_AFTER_TIMEOUTS`] requests in a row time out on it, the
/// network actor closes it, and the next request dials a fresh one. At
/// once for a stream that did not open: waiting for a second one put the
/// new connection 20 s or more after the stall began, and a BSP round
/// waiting for that worker's push was closed by its 30 s timeout first
/// (swarm64 on 1.1 cores). Generic over the connection's id, so that it
/// stays free of libp2p.
#[derive(Debug, Clone)]
pub struct StalledConnections<C> {
    timeouts: std::collections::HashMap<C, u32>,
}

impl<C> Default for StalledConnections<C> {
    fn default() -> Self {
        Self { timeouts: std::collections::HashMap::new() }
    }
}

impl<C: std::hash::Hash + Eq + Copy> StalledConnections<C> {
    /// A request on `conn` timed out: `at_once` when its stream did not
    /// open and nothing else was in flight to the peer, which could have
    /// held it up. True when `conn` is now stalled (the caller closes it);
    /// its count starts again.
    pub fn timed_out(&mut self, conn: C, at_once: bool) -> bool {
        if at_once {
            self.timeouts.remove(&conn);
            return true;
        }
        let n = self.timeouts.entry(conn).or_default();
        *n += 1;
        if *n < STALLED_AFTER_TIMEOUTS {
            return false;
        }
        self.timeouts.remove(&conn);
        true
    }

    /// An answer came on `conn`: it carries traffic.
    pub fn answered(&mut self, conn: C) {
        self.timeouts.remove(&conn);
    }

    /// `conn` closed.
    pub fn forget(&mut self, conn: C) {
        self.timeouts.remove(&conn);
    }

    /// Connections with a timed-out request and no answer since.
    #[cfg(test)]
    fn suspect(&self) -> usize {
        self.timeouts.len()
    }
}

/// An owner's service time from a request's round trip in µs (less any time
/// the owner reported holding the answer): the round trip less the path's
/// own latency ([`PathLatency::floor`]), never below zero.
pub fn less_path(round_trip_micros: f64, path_micros: Option<f64>) -> f64 {
    (round_trip_micros - path_micros.unwrap_or(0.0)).max(0.0)
}

/// Weight of the newest push in a worker's moving average of an owner's
/// service time. 0.1 averages over about ten pushes: on a loaded machine
/// single pushes wait tens of milliseconds for a CPU, and a faster average
/// (0.3 before) let that noise demote healthy owners and flip capacity
/// levels, and every flip moved shards. A 5x slowdown still crosses the 3x
/// demotion ratio within about seven pushes.
pub const SERVICE_ALPHA: f64 = 0.1;

#[derive(Debug, Clone, Copy)]
struct Tracked {
    micros_per_mib: f64,
    samples: u32,
    last_step: u64,
    /// Consecutive samples under the average by [`RECOVERY_FACTOR`], and
    /// their sum.
    fast_run: u32,
    fast_sum: f64,
}

/// A sample this many times under an owner's average is "fast". Delays
/// only ever add to a measurement (a starved CPU, a queue), so fast samples
/// are not noise: [`MIN_SAMPLES`] of them in a row mean the owner's speed
/// changed (its slowdown ended), and its average restarts from them instead
/// of decaying there over dozens of samples at [`SERVICE_ALPHA`].
pub const RECOVERY_FACTOR: f64 = 2.0;

/// Largest padding a probe carries: above a MiB the fixed cost of a
/// request is lost in the per-MiB figure anyway.
pub const MAX_PROBE_BYTES: u64 = 1 << 20;

/// A worker's measurements of the owners it pushes to.
///
/// Nobody pushes to an owner the placement keeps out as a straggler, so
/// without more its reports would age out after `forget_steps` and it
/// would get shards back only to be demoted again (the flapping of elastic
/// round 1). Workers therefore *probe* such owners: a request padded to the
/// size of their typical push, timed like a push ([`ServiceTracker::begin_probe`],
/// [`ServiceTracker::end_probe`]). The reports about a demoted owner stay
/// fresh: it stays out while it is slow and comes back once its probes are
/// fast again.
#[derive(Debug, Clone, Default)]
pub struct ServiceTracker {
    owners: BTreeMap<PeerId, Tracked>,
    /// Moving average of the bytes of this worker's pushes (the probe size).
    typical_bytes: f64,
    /// Owners with a probe on the wire.
    probing: BTreeSet<PeerId>,
}

impl ServiceTracker {
    /// The padding of a probe: this worker's typical push, at most
    /// [`MAX_PROBE_BYTES`]; `None` before its first timed push.
    pub fn probe_bytes(&self) -> Option<u64> {
        (self.typical_bytes >= 1.0).then(|| (self.typical_bytes as u64).min(MAX_PROBE_BYTES))
    }

    /// Whether to probe `owner` now: not while a probe to it is on the wire.
    /// Marks it as probed; [`ServiceTracker::end_probe`] ends that.
    pub fn begin_probe(&mut self, owner: PeerId) -> bool {
        self.probing.insert(owner)
    }

    /// The probe to `owner` came back: `Some((bytes, micros))` if it was
    /// answered (and is timed as a push of that size at `step`), `None` if
    /// it failed (not measured).
    pub fn end_probe(&mut self, owner: PeerId, answered: Option<(u64, f64)>, step: u64) {
        self.probing.remove(&owner);
        if let Some((bytes, micros)) = answered {
            self.time(owner, bytes, micros, step);
        }
    }

    /// Record one push of `bytes` to `owner` that took `micros` to be answered.
    pub fn observe(&mut self, owner: PeerId, bytes: u64, micros: f64, step: u64) {
        if bytes > 0 {
            let b = bytes as f64;
            self.typical_bytes = if self.typical_bytes < 1.0 {
                b
            } else {
                self.typical_bytes + SERVICE_ALPHA * (b - self.typical_bytes)
            };
        }
        self.time(owner, bytes, micros, step);
    }

    fn time(&mut self, owner: PeerId, bytes: u64, micros: f64, step: u64) {
        if bytes == 0 || !micros.is_finite() || micros < 0.0 {
            return;
        }
        let per_mib = micros * (1024.0 * 1024.0) / bytes as f64;
        let t = self.owners.entry(owner).or_insert(Tracked {
            micros_per_mib: per_mib,
            samples: 0,
            last_step: step,
            fast_run: 0,
            fast_sum: 0.0,
        });
        if t.samples > 0 && per_mib * RECOVERY_FACTOR <= t.micros_per_mib {
            t.fast_run += 1;
            t.fast_sum += per_mib;
        } else {
            t.fast_run = 0;
            t.fast_sum = 0.0;
        }
        t.micros_per_mib = if t.samples == 0 {
            per_mib
        } else if t.fast_run >= MIN_SAMPLES {
            let mean = t.fast_sum / f64::from(t.fast_run);
            t.fast_run = 0;
            t.fast_sum = 0.0;
            mean
        } else {
            t.micros_per_mib + SERVICE_ALPHA * (per_mib - t.micros_per_mib)
        };
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
    fn capability_levels_only_lower_a_weight_with_hysteresis_and_per_device_norms() {
        let peers: Vec<PeerId> = (0..4).map(|_| PeerId::random()).collect();
        let caps = |rates: [(f32, f32); 4]| -> BTreeMap<PeerId, Capacity> {
            peers
                .iter()
                .zip(rates)
                .map(|(p, (c, n))| {
                    // Each step computes 8 ms at the norm's rate.
                    let compute_micros = 8000.0 * 1000.0 / c;
                    (
                        *p,
                        Capacity {
                            device: Device::Cpu,
                            compute_samples_per_sec: c,
                            net_bytes_per_sec: n,
                            compute_micros,
                        },
                    )
                })
                .collect()
        };
        let at = |l: i8| move |_: &PeerId| l;
        // Links of 100 MB/s (10 ms per MiB) against a floor of 2 x 1 ms per MiB.
        let policy = HealthPolicy { min_excess_micros_per_mib: 1000.0, ..HealthPolicy::default() };
        let capability_levels = |c: &BTreeMap<PeerId, Capacity>, prior| capability_levels(c, prior, policy);
        let healthy = (1000.0, 1e8);
        // Equal rates, or one node 4x faster: nobody is capped (never raised).
        assert!(capability_levels(&caps([healthy; 4]), at(0)).is_empty());
        assert!(capability_levels(&caps([healthy, healthy, healthy, (4000.0, 4e8)]), at(0)).is_empty());
        // A quarter of the norm's compute: -2; 0.4x its link: -1; 0.45x of
        // either from level 0: inside the hysteresis, still 0.
        let l = capability_levels(&caps([healthy, healthy, healthy, (250.0, 1e8)]), at(0));
        assert_eq!(l, BTreeMap::from([(peers[3], -2)]));
        let l = capability_levels(&caps([healthy, healthy, healthy, (1000.0, 4e7)]), at(0));
        assert_eq!(l, BTreeMap::from([(peers[3], -1)]));
        assert!(capability_levels(&caps([healthy, healthy, healthy, (450.0, 4.5e7)]), at(0)).is_empty());
        // Held at -1, it stays there at 0.55x and comes back at 0.7x.
        let l = capability_levels(&caps([healthy, healthy, healthy, (550.0, 1e8)]), at(-1));
        assert_eq!(l, BTreeMap::from([(peers[3], -1)]));
        assert!(capability_levels(&caps([healthy, healthy, healthy, (700.0, 1e8)]), at(-1)).is_empty());
        // Not measured yet (0), or nonsense: not judged, and not in the norm.
        assert!(capability_levels(&caps([healthy, healthy, (0.0, 0.0), (f32::NAN, -1.0)]), at(0)).is_empty());
        // Two members: the slower is judged against the faster.
        let two: BTreeMap<PeerId, Capacity> = caps([healthy, (250.0, 1e8), healthy, healthy])
            .into_iter()
            .filter(|(p, _)| peers[..2].contains(p))
            .collect();
        assert_eq!(capability_levels(&two, at(0)), BTreeMap::from([(peers[1], -2)]));
        // Compute is compared within a device class: three CUDA boxes do not
        // make the CPU node slow, and it does not make them fast.
        let mut mixed = caps([(100_000.0, 1e8), (100_000.0, 1e8), (100_000.0, 1e8), healthy]);
        for p in &peers[..3] {
            if let Some(c) = mixed.get_mut(p) {
                c.device = Device::Cuda;
            }
        }
        assert!(capability_levels(&mixed, at(0)).is_empty());
        // A link 0.4x the norm's adds 15 ms per MiB: judged against a floor
        // of 2 x 1 ms, not against one of 2 x 10 ms (loopback noise); and
        // static roles judge nobody.
        let slow_link = caps([healthy, healthy, healthy, (1000.0, 4e7)]);
        let floor = |m: f64| HealthPolicy { min_excess_micros_per_mib: m, ..HealthPolicy::default() };
        assert_eq!(super::capability_levels(&slow_link, at(0), floor(1000.0)).len(), 1);
        assert!(super::capability_levels(&slow_link, at(0), floor(10_000.0)).is_empty());
        let starved = caps([healthy, healthy, healthy, (250.0, 1e8)]);
        assert!(super::capability_levels(&starved, at(0), floor(f64::INFINITY)).is_empty());
        // Compute: at a quarter of the norm's rate, a step of 32 ms would
        // take 8 at the norm's: 24 ms more, judged against a floor of
        // 2 x 10 ms per step, not 2 x 15 ms.
        let per_step = |m: f64| HealthPolicy { min_excess_micros_per_step: m, ..HealthPolicy::default() };
        assert_eq!(super::capability_levels(&starved, at(0), per_step(10_000.0)).len(), 1);
        assert!(super::capability_levels(&starved, at(0), per_step(15_000.0)).is_empty());
    }

    #[test]
    fn one_report_alone_names_the_owners_it_would_demote() {
        let me = PeerId::random();
        let owners: Vec<PeerId> = (0..4).map(|_| PeerId::random()).collect();
        let policy = HealthPolicy { min_excess_micros_per_mib: 50.0, ..HealthPolicy::default() };
        let none = BTreeSet::new();
        let mut report: Vec<ServiceObservation> = owners.iter().map(|&o| obs(o, 100.0)).collect();
        assert!(would_demote(me, &report, &none, policy).is_empty());
        report[2].micros_per_mib = 250.0;
        assert!(would_demote(me, &report, &none, policy).is_empty(), "2.5x: under the demote ratio");
        report[2].micros_per_mib = 400.0;
        let slow = would_demote(me, &report, &none, policy);
        assert_eq!(slow, BTreeSet::from([owners[2]]));
        // Hysteresis: once in the set, back under 3x is not enough; under
        // the restore ratio (1.5x) is.
        report[2].micros_per_mib = 250.0;
        assert_eq!(would_demote(me, &report, &slow, policy), slow, "2.5x: still out");
        report[2].micros_per_mib = 140.0;
        assert!(would_demote(me, &report, &slow, policy).is_empty(), "1.4x: back");
        report[2].micros_per_mib = 400.0;
        // Too few pushes yet, or this node's own entry: not judged.
        report[2].samples = MIN_SAMPLES - 1;
        assert!(would_demote(me, &report, &none, policy).is_empty());
        report[2].samples = MIN_SAMPLES;
        report[2].owner = me;
        assert!(would_demote(me, &report, &none, policy).is_empty());
        // Under the noise floor: 4x of 10 µs is not slow.
        let tiny: Vec<ServiceObservation> =
            owners.iter().zip([10.0, 10.0, 40.0, 10.0]).map(|(&o, v)| obs(o, v)).collect();
        assert!(would_demote(me, &tiny, &none, policy).is_empty());
    }

    #[test]
    fn the_path_latency_is_the_least_recent_ping_and_comes_off_the_service_time() {
        let (a, b) = (PeerId::random(), PeerId::random());
        let mut paths = PathLatency::default();
        assert_eq!(paths.floor(&a), None);
        assert_eq!(less_path(3_000.0, paths.floor(&a)), 3_000.0, "no ping yet: the whole round trip");
        for rtt in [40_000.0, 30_000.0, 55_000.0, f64::NAN, -1.0] {
            paths.record(a, rtt);
        }
        assert_eq!(paths.floor(&a), Some(30_000.0), "the least, NaN and negative ignored");
        assert_eq!(paths.floor(&b), None, "per peer");
        // The 30 ms ping leaves the window after PATH_RTT_WINDOW newer ones.
        for _ in 0..PATH_RTT_WINDOW {
            paths.record(a, 45_000.0);
        }
        assert_eq!(paths.floor(&a), Some(45_000.0));
        assert_eq!(less_path(47_000.0, paths.floor(&a)), 2_000.0);
        assert_eq!(less_path(44_000.0, paths.floor(&a)), 0.0, "never below zero");
        paths.forget(&a);
        assert_eq!(paths.floor(&a), None);
    }

    #[test]
    fn a_single_shard_owner_on_a_slow_path_is_not_taken_for_a_straggler() {
        // A worker 40 ms from every owner. Owners 0-2 each hold 4 of its
        // 1 MiB shards (one PushPullMany each), owner 3 holds one; every
        // owner serves at 2 ms per MiB.
        let owners: Vec<PeerId> = (0..4).map(|_| PeerId::random()).collect();
        let me = PeerId::random();
        let policy = HealthPolicy { min_excess_micros_per_mib: 5_000.0, ..HealthPolicy::default() };
        let mut paths = PathLatency::default();
        let (mut raw, mut net) = (ServiceTracker::default(), ServiceTracker::default());
        for step in 0..10 {
            for (i, &o) in owners.iter().enumerate() {
                paths.record(o, 40_000.0);
                let mib: u64 = if i == 3 { 1 } else { 4 };
                let round_trip = 40_000.0 + 2_000.0 * mib as f64;
                raw.observe(o, mib << 20, round_trip, step);
                net.observe(o, mib << 20, less_path(round_trip, paths.floor(&o)), step);
            }
        }
        let none = BTreeSet::new();
        assert_eq!(
            would_demote(me, &raw.report(10, 100), &none, policy),
            BTreeSet::from([owners[3]]),
            "timed on the whole round trip, the single-shard owner looks 3.5x slower per MiB"
        );
        assert!(would_demote(me, &net.report(10, 100), &none, policy).is_empty());
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
    fn capacity_levels_follow_speed_in_powers_of_two_with_a_dead_zone_and_hysteresis() {
        let owners: Vec<PeerId> = (0..6).map(|_| PeerId::random()).collect();
        let r = PeerId::random();
        let speeds = [100.0, 100.0, 100.0, 190.0, 250.0, 30.0];
        let seen: Vec<ServiceObservation> = owners.iter().zip(speeds).map(|(&o, v)| obs(o, v)).collect();
        let m = medians([(r, seen.as_slice())]);
        let levels = |prior: &dyn Fn(&PeerId) -> i8, policy| {
            let l = capacity_levels(&m, prior, policy);
            owners.iter().map(|o| l[o]).collect::<Vec<i8>>()
        };
        // 1.9x slower is noise; 2.5x slower gets half; 3.3x faster gets double.
        assert_eq!(levels(&|_| 0, HealthPolicy::default()), vec![0, 0, 0, 0, -1, 1]);
        assert_eq!(weight_of(-1), 0.5);
        assert_eq!(weight_of(1), 2.0);
        // Hysteresis: a level is kept until the speed leaves its band by 2^0.25.
        // 1.9x slower stays at -1 (the band ends at 2x, the margin at 1.68x);
        // 2.5x slower and 3.3x faster also keep a level they already hold.
        let held = |p: &PeerId| {
            if *p == owners[3] || *p == owners[4] {
                -1
            } else if *p == owners[5] {
                1
            } else {
                0
            }
        };
        assert_eq!(levels(&held, HealthPolicy::default()), vec![0, 0, 0, -1, -1, 1]);
        // Owners at the norm drop a stale level at once.
        let stale = |p: &PeerId| if *p == owners[0] { 2 } else { 0 };
        assert_eq!(levels(&stale, HealthPolicy::default())[0], 0);
        assert_eq!(level_with_hysteresis(1.1, 0), 0, "2.1x faster is inside the margin of level 0");
        assert_eq!(level_with_hysteresis(1.3, 0), 1);
        assert_eq!(level_with_hysteresis(0.8, 1), 1, "1.74x faster keeps level 1");
        assert_eq!(level_with_hysteresis(0.7, 1), 0);
        assert_eq!(level_with_hysteresis(9.0, 2), 2);
        assert_eq!(level_with_hysteresis(-9.0, 0), MIN_LEVEL);
        // Under the absolute floor every owner weighs the same.
        let floor = HealthPolicy { min_excess_micros_per_mib: 500.0, ..HealthPolicy::default() };
        assert!(levels(&|_| 0, floor).iter().all(|&x| x == 0));
        assert!(capacity_levels(&BTreeMap::new(), |_| 0, HealthPolicy::default()).is_empty());
    }

    #[test]
    fn tracker_averages_and_forgets() {
        let o = PeerId::random();
        let mut t = ServiceTracker::default();
        t.observe(o, 1024 * 1024, 100.0, 1);
        t.observe(o, 1024 * 1024, 200.0, 2);
        let r = t.report(2, 10);
        assert_eq!(r.len(), 1);
        assert!((r[0].micros_per_mib - 110.0).abs() < 1e-3, "{}", r[0].micros_per_mib);
        assert_eq!(r[0].samples, 2);
        assert!(t.report(13, 10).is_empty(), "not pushed to for 11 steps: forgotten");
    }

    #[test]
    fn probes_keep_a_demoted_owner_measured_one_at_a_time() {
        let slow = PeerId::random();
        let mut t = ServiceTracker::default();
        assert_eq!(t.probe_bytes(), None, "no push timed yet: nothing to size a probe by");
        t.observe(slow, 4096, 100.0, 1);
        t.observe(slow, 8192, 100.0, 2);
        assert_eq!(t.probe_bytes(), Some(4505), "the pushes' moving average (4096 + 0.1 x 4096)");
        t.observe(slow, 64 << 20, 1e6, 3);
        assert_eq!(t.probe_bytes(), Some(MAX_PROBE_BYTES), "capped");
        // One probe at a time per owner.
        assert!(t.begin_probe(slow));
        assert!(!t.begin_probe(slow));
        // Steps later, with no push: the probe's answer keeps the report.
        t.end_probe(slow, Some((1 << 20, 50_000.0)), 20);
        let r = t.report(25, 10);
        assert_eq!(r.len(), 1, "probed at step 20: still reported at 25");
        assert_eq!(r[0].samples, 4);
        // A failed probe measures nothing but frees the slot.
        assert!(t.begin_probe(slow));
        t.end_probe(slow, None, 40);
        assert!(t.report(40, 10).is_empty(), "last measured at 20: forgotten by 40");
        assert!(t.begin_probe(slow));
    }

    #[test]
    fn an_owner_whose_slowdown_ends_is_measured_fast_after_three_fast_samples() {
        let o = PeerId::random();
        let mut t = ServiceTracker::default();
        let mib = 1024 * 1024;
        for step in 0..20 {
            t.observe(o, mib, 50_000.0, step);
        }
        // One fast sample, then a slow one: noise, the average barely moves.
        t.observe(o, mib, 100.0, 20);
        t.observe(o, mib, 50_000.0, 21);
        let avg = t.report(21, 100)[0].micros_per_mib;
        assert!(avg > 40_000.0, "{avg}");
        // Three fast samples in a row: the slowdown ended.
        for (i, v) in [100.0, 120.0, 110.0].into_iter().enumerate() {
            t.observe(o, mib, v, 22 + i as u64);
        }
        let avg = t.report(24, 100)[0].micros_per_mib;
        assert!((avg - 110.0).abs() < 1e-3, "restarted from the fast samples: {avg}");
        // A slowdown still takes the slow path up (about seven pushes to 3x).
        for step in 25..32 {
            t.observe(o, mib, 550.0, step);
        }
        let avg = t.report(31, 100)[0].micros_per_mib;
        assert!(avg > 300.0 && avg < 550.0, "{avg}");
    }

    #[test]
    fn a_connection_is_stalled_after_timeouts_in_a_row_and_an_answer_clears_it() {
        let mut s = StalledConnections::default();
        // One whole-exchange timeout is not a stall; an answer between two clears it.
        assert!(!s.timed_out(1u64, false));
        s.answered(1);
        assert!(!s.timed_out(1, false));
        assert_eq!(s.suspect(), 1);
        // Another connection's timeouts count on their own.
        assert!(!s.timed_out(2, false));
        assert!(s.timed_out(1, false), "two in a row on connection 1");
        // Closed: its count starts again (a reused id is a new connection).
        assert_eq!(s.suspect(), 1);
        assert!(!s.timed_out(1, false));
        s.forget(1);
        s.forget(2);
        assert_eq!(s.suspect(), 0);
        assert!(!s.timed_out(2, false));
        assert!(s.timed_out(2, false));
        // A stream that did not open stalls its connection at once.
        assert!(s.timed_out(3, true));
        assert!(!s.timed_out(4, false));
        assert!(s.timed_out(4, true));
        assert_eq!(s.suspect(), 0);
    }
}
