//! Exploration of the number of aggregators k, as in PSLD.
//!
//! Exploitation (who owns what) is the election's job; this module decides
//! how many owners there should be. Every node runs the same [`Explorer`] on
//! the same gossiped measurements ([`Pace`] in every heartbeat: recent step
//! time and the part of it spent exchanging shards) and gossips the k it
//! proposes. The election uses the lower median of the proposals of the live
//! members ([`agreed_limit`]), so a node that decided a moment late, or a
//! confused one, does not change k alone.
//!
//! The rules, evaluated once per window of `window_steps` steps of the
//! cluster (the lower median of the members' step counters, so every node
//! evaluates at the same step boundaries), and only once k has held for a
//! whole window (the moving averages then describe the current k). The
//! first evaluation comes sooner, after a quarter window
//! ([`Explorer::first_window_steps`]), if k has not moved since the start:
//! at the starting k every step a poor start costs is a step at the wrong k,
//! and a trial still judges the change a whole settled window later:
//! - **add** aggregators when communication dominates step time
//!   (median share at least `dominate_share`) and a capable node is spare:
//!   at once, as many as bring k to [`predicted_k`] (where communication,
//!   falling as 1/k, would take as long as computation), and at least one at
//!   first, then twice as many after each kept addition (1, 2, 4, …, capped
//!   at the spare candidates); after a failed addition of more than one,
//!   half as many (bisection) before any back-off, and no more predictions;
//! - **remove** one when aggregation is idle (median share at most
//!   `idle_share`) and more than one owns shards;
//! - each change is a **trial**: one settled window later an added
//!   aggregator is kept only if the median step time improved by at least
//!   `min_gain`, and a removed one only if it did not get slower by more
//!   than `min_gain` (an idle owner freed at no cost in speed is the gain);
//!   otherwise k goes back and that direction is not tried again for a
//!   back-off that doubles with each failed trial (up to
//!   `max_backoff_windows` windows).
//!
//! [`Explorer::observe`] has no clock, no RNG and no I/O: its time is the
//! cluster's step counter.

use shoal_protocol::Pace;

/// Knobs of the exploration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExplorePolicy {
    /// Steps per measurement window.
    pub window_steps: u64,
    /// Communication share of step time at or above which an aggregator is added.
    pub dominate_share: f64,
    /// Communication share at or below which an aggregator is removed.
    pub idle_share: f64,
    /// A trial is kept only if it cuts step time by at least this fraction.
    pub min_gain: f64,
    /// Longest back-off after failed trials, in windows.
    pub max_backoff_windows: u64,
}

impl Default for ExplorePolicy {
    fn default() -> Self {
        Self { window_steps: 60, dominate_share: 0.5, idle_share: 0.05, min_gain: 0.1, max_backoff_windows: 32 }
    }
}

/// What the cluster looks like at one observation (all from the gossiped view).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Observation {
    /// The cluster's step: lower median of the active members' step counters.
    pub step: u64,
    /// Aggregators in the current placement.
    pub aggregators: usize,
    /// Members that may own shards now (capable, not leaving, not straggling).
    pub candidates: usize,
    /// Median recent step time of the active members, µs.
    pub step_micros: f64,
    /// Median share of step time spent exchanging shards, in `0..=1`.
    pub comm_share: f64,
}

/// A decision worth logging.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Decision {
    /// Start a trial: propose `to` aggregators instead of `from`.
    Try { from: usize, to: usize, baseline_micros: f64 },
    /// The trial from `from` to `k` improved step time: keep `k`.
    Keep { from: usize, k: usize, before_micros: f64, after_micros: f64 },
    /// The trial of `tried` did not improve step time: back to `k`.
    Revert { tried: usize, k: usize, before_micros: f64, after_micros: f64, backoff_windows: u64 },
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Trial {
    from: usize,
    to: usize,
    /// The proposal before the trial, restored if it fails.
    prior: Option<usize>,
    baseline_micros: f64,
    started: u64,
}

impl Trial {
    /// Whether a placement with `k` distinct owners is this trial's change:
    /// the weighted rendezvous may leave a candidate with no shard (8 shards
    /// among a limit of 4 owners can land on 3), so any k past `from`
    /// towards `to` is the change taken up. (Before, only `to` itself
    /// counted, and a 1 -> 4 trial that placed 3 owners was cancelled.)
    fn taken_up(&self, k: usize) -> bool {
        if self.to > self.from {
            k > self.from && k <= self.to
        } else {
            k < self.from && k >= self.to
        }
    }
}

/// One node's explorer. Its proposal is gossiped in [`Pace::aggregators`].
#[derive(Debug, Clone)]
pub struct Explorer {
    policy: ExplorePolicy,
    /// The k this node proposes; `None`: every candidate.
    proposal: Option<usize>,
    trial: Option<Trial>,
    /// Step at which the placement last changed its number of aggregators.
    changed_at: u64,
    last_k: Option<usize>,
    /// Last window evaluated.
    window: u64,
    /// Whether the first evaluation has been made.
    opened: bool,
    /// Whether k has moved since the first observation (then the first
    /// evaluation waits for a whole window at the new k).
    moved: bool,
    next_add: u64,
    /// How many aggregators the next addition adds (doubles after a kept
    /// addition, halves after a failed one).
    add_step: usize,
    /// During a bisection: the smallest k an addition failed at.
    add_ceiling: Option<usize>,
    /// An addition failed: from then on additions follow doubling and
    /// bisection only, not the prediction (which, with communication still
    /// the larger share near the best k, would keep jumping past it).
    add_failed: bool,
    next_remove: u64,
    add_backoff: u64,
    remove_backoff: u64,
}

impl Explorer {
    /// Start proposing `start` aggregators (`None`: every capable node).
    pub fn new(policy: ExplorePolicy, start: Option<usize>) -> Self {
        Self {
            policy: ExplorePolicy { window_steps: policy.window_steps.max(1), ..policy },
            proposal: start.map(|k| k.max(1)),
            trial: None,
            changed_at: 0,
            last_k: None,
            window: 0,
            opened: false,
            moved: false,
            next_add: 0,
            add_step: 1,
            add_ceiling: None,
            add_failed: false,
            next_remove: 0,
            add_backoff: 1,
            remove_backoff: 1,
        }
    }

    /// Steps before the first evaluation: a quarter of a window (at least
    /// one). The pace averages then cover enough steps to show whether
    /// communication dominates (they average the first steps equally, see
    /// [`PaceMeter`]).
    pub fn first_window_steps(&self) -> u64 {
        (self.policy.window_steps / 4).max(1)
    }

    /// The proposal for the heartbeat: 0 means every capable node.
    pub fn proposal(&self) -> u16 {
        self.proposal.map_or(0, |k| k.clamp(1, u16::MAX as usize) as u16)
    }

    /// Feed one observation; `agreed` is the limit the election currently
    /// uses (the median of all proposals). Returns a decision when one is made.
    pub fn observe(&mut self, o: &Observation, agreed: Option<usize>) -> Option<Decision> {
        self.track_k(o);
        if !self.evaluation_due(o) {
            return None;
        }
        self.opened = true;
        self.window = o.step / self.policy.window_steps;
        match self.trial {
            Some(t) => self.judge(t, o),
            // No trial: follow the cluster's agreed k, then consider a change.
            None => {
                self.proposal = agreed;
                self.start_trial(o)
            }
        }
    }

    /// Notes when the placement's number of aggregators moves, and cancels
    /// a trial that something other than the trial moved.
    fn track_k(&mut self, o: &Observation) {
        if self.last_k == Some(o.aggregators) {
            return;
        }
        if self.last_k.is_some() {
            self.changed_at = o.step;
            self.moved = true;
        }
        self.last_k = Some(o.aggregators);
        if let Some(t) = self.trial {
            if !t.taken_up(o.aggregators) && o.aggregators != t.from {
                // Something else moved k (a failure, a straggler): the
                // trial no longer measures what it meant to.
                self.trial = None;
                self.proposal = t.prior;
            }
        }
    }

    /// Whether this observation is an evaluation point: the first one after
    /// a quarter window at an unmoved start, else the first of a new window
    /// once k has held for a whole window; never without a step time.
    fn evaluation_due(&self, o: &Observation) -> bool {
        let w = self.policy.window_steps;
        let due = if !self.opened && !self.moved {
            o.step >= self.first_window_steps()
        } else {
            o.step / w > self.window && o.step >= self.changed_at.saturating_add(w)
        };
        // Written as the negation so that a NaN step time passes, as before.
        if !due || o.step_micros <= 0.0 {
            return false;
        }
        true
    }

    /// Judges the running trial `t` at an evaluation point: waits while the
    /// others have not taken it up, else keeps or reverts it on the step
    /// time.
    ///
    /// While it waits, k is still `from`, so the latest step time is the
    /// baseline the change will be judged against. Every two windows the
    /// waiting trial is renewed if its reason still holds here (the share
    /// that started it), else dropped. (It used to be dropped after two
    /// windows whatever the share: near the threshold the nodes saw it at
    /// different windows, each tried alone, and each dropped its trial as
    /// the next one started, so the lower median never moved; a CI run
    /// tried 4 -> 3 at steps 63, 120 and 160, one node at a time.)
    fn judge(&mut self, t: Trial, o: &Observation) -> Option<Decision> {
        if !t.taken_up(o.aggregators) {
            let renew = o.step >= t.started.saturating_add(2 * self.policy.window_steps);
            if renew && !self.reason_holds(&t, o) {
                self.trial = None;
                self.proposal = t.prior;
            } else {
                let started = if renew { o.step } else { t.started };
                self.trial = Some(Trial { baseline_micros: o.step_micros, started, ..t });
            }
            return None;
        }
        self.trial = None;
        let adding = t.to > t.from;
        let bar = if adding { 1.0 - self.policy.min_gain } else { 1.0 + self.policy.min_gain };
        if o.step_micros <= t.baseline_micros * bar {
            Some(self.keep(t, o))
        } else {
            Some(self.revert(t, o))
        }
    }

    /// Whether what started trial `t` still holds at `o`: communication
    /// still dominates (an addition), or aggregation is still idle (a
    /// removal).
    fn reason_holds(&self, t: &Trial, o: &Observation) -> bool {
        if t.to > t.from {
            self.addition_target(o).is_some()
        } else {
            self.removal_target(o).is_some()
        }
    }

    /// A trial that paid: reset that direction's back-off and, after an
    /// addition, size the next one (gallop, or go on bisecting).
    fn keep(&mut self, t: Trial, o: &Observation) -> Decision {
        if t.to > t.from {
            self.add_backoff = 1;
            match self.add_ceiling {
                // Galloping: twice as many next time.
                None => self.add_step = (t.to - t.from).saturating_mul(2),
                // Bisecting: half the interval left below the failed k.
                Some(c) if c > t.to + 1 => self.add_step = (c - t.to) / 2,
                // The next k up is the one that failed: done; that
                // direction rests as after a failed trial.
                Some(_) => {
                    self.add_ceiling = None;
                    self.add_step = 1;
                    self.next_add = o.step.saturating_add(self.add_backoff * self.policy.window_steps);
                }
            }
        } else {
            self.remove_backoff = 1;
        }
        Decision::Keep { from: t.from, k: t.to, before_micros: t.baseline_micros, after_micros: o.step_micros }
    }

    /// A trial that did not pay: back to the prior proposal; an addition of
    /// more than one is bisected at the next window with no back-off, any
    /// other change rests its direction for a back-off.
    fn revert(&mut self, t: Trial, o: &Observation) -> Decision {
        let adding = t.to > t.from;
        self.proposal = t.prior;
        if adding {
            self.add_failed = true;
        }
        let backoff_windows = if adding && t.to - t.from > 1 {
            // Too far at once: bisect (half as many, from where it was)
            // at the next window, with no back-off.
            self.add_step = (t.to - t.from) / 2;
            self.add_ceiling = Some(t.to);
            0
        } else {
            if adding {
                self.add_step = 1;
                self.add_ceiling = None;
            }
            self.back_off(adding, o.step)
        };
        Decision::Revert {
            tried: t.to,
            k: t.from,
            before_micros: t.baseline_micros,
            after_micros: o.step_micros,
            backoff_windows,
        }
    }

    /// Rests one direction (adding or removing) from `step` on for its
    /// current back-off, doubles that back-off up to the cap, and returns
    /// the windows rested. (Counted in the cluster's windows, with no
    /// jitter, so that every node rests the same windows: not a retry
    /// loop's `policy::backoff::Backoff`.)
    fn back_off(&mut self, adding: bool, step: u64) -> u64 {
        let max = self.policy.max_backoff_windows.max(1);
        let backoff = if adding { &mut self.add_backoff } else { &mut self.remove_backoff };
        let windows = *backoff;
        *backoff = (*backoff * 2).min(max);
        let until = step.saturating_add(windows * self.policy.window_steps);
        if adding {
            self.next_add = until;
        } else {
            self.next_remove = until;
        }
        windows
    }

    /// With no trial running: starts one if communication dominates (add)
    /// or aggregation is idle (remove) and that direction is not resting.
    fn start_trial(&mut self, o: &Observation) -> Option<Decision> {
        let k = o.aggregators;
        let to = self.addition_target(o).or_else(|| self.removal_target(o))?;
        self.trial = Some(Trial { from: k, to, prior: self.proposal, baseline_micros: o.step_micros, started: o.step });
        self.proposal = Some(to);
        Some(Decision::Try { from: k, to, baseline_micros: o.step_micros })
    }

    /// The k to try when communication dominates, a candidate is spare and
    /// additions are not resting: the current addition step (or, outside a
    /// bisection and before any failed addition, the predicted k if that
    /// is further), below a bisection's ceiling and within the candidates.
    fn addition_target(&self, o: &Observation) -> Option<usize> {
        let k = o.aggregators;
        if !(o.comm_share >= self.policy.dominate_share && k < o.candidates && o.step >= self.next_add) {
            return None;
        }
        let cap = self.add_ceiling.map_or(o.candidates, |c| c.saturating_sub(1)).min(o.candidates);
        // Outside a bisection, jump at least to the k whose share of
        // communication, if it falls as 1/k, matches the computation.
        let step = if self.add_ceiling.is_none() && !self.add_failed {
            self.add_step.max(predicted_k(k, o.comm_share).saturating_sub(k))
        } else {
            self.add_step
        };
        Some(k.saturating_add(step.max(1)).min(cap.max(k + 1)))
    }

    /// The k to try when aggregation is idle, more than one owns shards and
    /// removals are not resting: one fewer.
    fn removal_target(&self, o: &Observation) -> Option<usize> {
        let k = o.aggregators;
        (o.comm_share <= self.policy.idle_share && k > 1 && o.step >= self.next_remove).then(|| k - 1)
    }
}

/// The number of aggregators at which communication, if it falls as 1/k
/// with more owners, takes as long as the computation: `k x share / (1 -
/// share)`, rounded up (a share over 0.95 counts as 0.95).
pub fn predicted_k(k: usize, comm_share: f64) -> usize {
    let s = if comm_share.is_finite() { comm_share.clamp(0.0, 0.95) } else { 0.0 };
    ((k as f64) * s / (1.0 - s)).ceil() as usize
}

/// The limit the election uses: the lower median of the members' proposals
/// (0 counts as "every capable node", the largest). `None`: no limit.
pub fn agreed_limit(proposals: impl IntoIterator<Item = u16>) -> Option<usize> {
    let mut v: Vec<usize> = proposals.into_iter().map(|p| if p == 0 { usize::MAX } else { p as usize }).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    let m = v[(v.len() - 1) / 2];
    (m != usize::MAX).then_some(m)
}

/// A worker's moving averages of its step time and communication time, and
/// of its measured capabilities as its heartbeat's `Capabilities` carries
/// them: its compute rate (samples per second of gradient computation) and
/// its link rate (bytes per second of its exchanges with remote owners,
/// the owners' holds for the round left out: `worker::LinkMeter`).
///
/// The first step (connection set-up, the first pull, cold caches) stands
/// alone until the second replaces it; from then on the averages weigh the
/// newest value by `1/n` over the first `1/ALPHA` values (a plain mean of
/// steps 2 to n), then by `ALPHA`. A fixed weight from the first value on
/// would leave the first step at 39% of the average after 10 steps, and
/// the explorer's first decision (after a quarter window) would judge its
/// trial against that.
#[derive(Debug, Clone, Copy, Default)]
pub struct PaceMeter {
    step: Mean,
    comm: Mean,
    compute_rate: Mean,
    net_rate: Mean,
}

/// A moving average that starts as a plain mean: the `n`-th value weighs
/// `1/n`, at least [`Mean::ALPHA`] (so from the tenth value on, `ALPHA`).
#[derive(Debug, Clone, Copy, Default)]
struct Mean {
    value: f64,
    n: u64,
    /// [`Mean::push_after_first`] has dropped the first value.
    dropped_first: bool,
}

impl Mean {
    /// Weight of the newest value once warmed up.
    const ALPHA: f64 = 0.1;

    /// As [`Mean::push`], but the first value stands alone until the
    /// second replaces it (the first step: connection set-up, cold caches).
    fn push_after_first(&mut self, v: f64) {
        if self.n == 1 && !self.dropped_first {
            *self = Self { dropped_first: true, ..Self::default() };
        }
        self.push(v);
    }

    fn push(&mut self, v: f64) {
        self.n += 1;
        self.value += (1.0 / self.n as f64).max(Self::ALPHA) * (v - self.value);
    }

    /// The average as an `f32` field of a heartbeat; 0 (not measured)
    /// before `min` values.
    fn as_f32(&self, min: u64) -> f32 {
        if self.n < min.max(1) {
            0.0
        } else {
            self.value.min(f64::from(f32::MAX)) as f32
        }
    }
}

impl PaceMeter {
    /// Record one step; returns the step and communication times to gossip
    /// (the other fields of the returned pace are left 0).
    pub fn observe(&mut self, step_secs: f64, comm_secs: f64) -> Pace {
        let (s, c) = (step_secs.max(0.0) * 1e6, comm_secs.clamp(0.0, step_secs.max(0.0)) * 1e6);
        // The first step stands alone until the second replaces it.
        self.step.push_after_first(s);
        self.comm.push_after_first(c);
        let step_micros = self.step.value.min(u32::MAX as f64) as u32;
        Pace {
            step_micros,
            comm_micros: (self.comm.value.min(u32::MAX as f64) as u32).min(step_micros),
            ..Pace::default()
        }
    }

    /// The same step's rates: `samples` computed in `compute_secs`, `bytes`
    /// moved in `comm_secs`. Returns samples/s and bytes/s, 0 for what is
    /// not measured on [`RATE_MIN_STEPS`] steps after the first yet (the
    /// election judges the rates, and one step says little; the first, with
    /// its connection set-up, is dropped, as for the step time); a
    /// step with nothing to measure (no samples, no bytes, no time) leaves
    /// that average as it was.
    pub fn rates(&mut self, samples: usize, compute_secs: f64, bytes: u64, comm_secs: f64) -> (f32, f32) {
        if samples > 0 && compute_secs.is_finite() && compute_secs > 0.0 {
            self.compute_rate.push_after_first(samples as f64 / compute_secs);
        }
        if bytes > 0 && comm_secs.is_finite() && comm_secs > 0.0 {
            self.net_rate.push_after_first(bytes as f64 / comm_secs);
        }
        (self.compute_rate.as_f32(RATE_MIN_STEPS), self.net_rate.as_f32(RATE_MIN_STEPS))
    }
}

/// Steps a rate must be measured on before it is gossiped.
pub const RATE_MIN_STEPS: u64 = 3;

/// The median of a list (lower median for an even count); `None` if empty.
pub fn lower_median<T: Copy + PartialOrd>(mut v: Vec<T>) -> Option<T> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    Some(v[(v.len() - 1) / 2])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obs(step: u64, k: usize, micros: f64, share: f64) -> Observation {
        Observation { step, aggregators: k, candidates: 4, step_micros: micros, comm_share: share }
    }

    fn policy() -> ExplorePolicy {
        ExplorePolicy { window_steps: 10, ..ExplorePolicy::default() }
    }

    #[test]
    fn adds_an_aggregator_when_communication_dominates_and_keeps_it_if_faster() {
        let mut e = Explorer::new(policy(), Some(1));
        assert_eq!(e.proposal(), 1);
        // The first evaluation comes after a quarter window (2 steps of 10).
        assert_eq!(e.first_window_steps(), 2);
        assert_eq!(e.observe(&obs(1, 1, 1000.0, 0.55), Some(1)), None);
        assert_eq!(
            e.observe(&obs(2, 1, 1000.0, 0.55), Some(1)),
            Some(Decision::Try { from: 1, to: 2, baseline_micros: 1000.0 })
        );
        assert_eq!(e.proposal(), 2);
        // The cluster takes it up at step 4; judged a whole window later.
        assert_eq!(e.observe(&obs(4, 2, 900.0, 0.6), Some(2)), None);
        assert_eq!(e.observe(&obs(12, 2, 700.0, 0.6), Some(2)), None, "settling");
        assert_eq!(
            e.observe(&obs(14, 2, 700.0, 0.6), Some(2)),
            Some(Decision::Keep { from: 1, k: 2, before_micros: 1000.0, after_micros: 700.0 })
        );
        assert_eq!(e.proposal(), 2);
        // Still dominated: the next window tries twice as many more (4).
        assert_eq!(
            e.observe(&obs(30, 2, 700.0, 0.6), Some(2)),
            Some(Decision::Try { from: 2, to: 4, baseline_micros: 700.0 })
        );
    }

    #[test]
    fn a_trial_that_does_not_help_is_reverted_and_backs_off() {
        let mut e = Explorer::new(policy(), Some(2));
        assert!(matches!(e.observe(&obs(10, 2, 1000.0, 0.55), Some(2)), Some(Decision::Try { to: 3, .. })));
        e.observe(&obs(11, 3, 990.0, 0.9), Some(3));
        assert_eq!(
            e.observe(&obs(21, 3, 950.0, 0.9), Some(3)),
            Some(Decision::Revert { tried: 3, k: 2, before_micros: 1000.0, after_micros: 950.0, backoff_windows: 1 })
        );
        assert_eq!(e.proposal(), 2);
        e.observe(&obs(23, 2, 1000.0, 0.9), Some(2));
        // Back-off: no new trial before step 31, and the next failure doubles it.
        assert_eq!(e.observe(&obs(33, 2, 1000.0, 0.9), Some(2)).map(|d| matches!(d, Decision::Try { .. })), Some(true));
        e.observe(&obs(34, 3, 1000.0, 0.9), Some(3));
        assert!(matches!(
            e.observe(&obs(44, 3, 1000.0, 0.9), Some(3)),
            Some(Decision::Revert { backoff_windows: 2, .. })
        ));
        e.observe(&obs(45, 2, 1000.0, 0.9), Some(2));
        assert_eq!(e.observe(&obs(55, 2, 1000.0, 0.9), Some(2)), None, "backing off until step 64");
        assert!(matches!(e.observe(&obs(65, 2, 1000.0, 0.9), Some(2)), Some(Decision::Try { to: 3, .. })));
    }

    #[test]
    fn removes_an_idle_aggregator_and_never_goes_below_one_or_above_the_candidates() {
        let mut e = Explorer::new(policy(), None);
        assert_eq!(e.proposal(), 0, "every capable node");
        assert!(matches!(e.observe(&obs(10, 4, 1000.0, 0.01), None), Some(Decision::Try { from: 4, to: 3, .. })));
        assert_eq!(e.proposal(), 3);
        let mut one = Explorer::new(policy(), Some(1));
        assert_eq!(one.observe(&obs(10, 1, 1000.0, 0.01), Some(1)), None);
        let mut full = Explorer::new(policy(), None);
        assert_eq!(full.observe(&obs(10, 4, 1000.0, 0.99), None), None, "no spare candidate");
    }

    #[test]
    fn additions_double_while_they_pay_and_bisect_after_one_that_does_not() {
        let obs8 = |step, k, micros| Observation {
            step,
            aggregators: k,
            candidates: 8,
            step_micros: micros,
            comm_share: 0.55,
        };
        let mut e = Explorer::new(policy(), Some(1));
        let mut k = 1;
        let mut micros = 1000.0;
        let mut tried = Vec::new();
        // Steps get faster up to 5 owners, slower past them.
        let speed = |k: usize| if k <= 5 { 1000.0 / k as f64 } else { 200.0 + 50.0 * (k - 5) as f64 };
        for window in 1..=17u64 {
            let step = window * 10;
            match e.observe(&obs8(step, k, micros), Some(k)) {
                Some(Decision::Try { to, .. }) => {
                    tried.push(to);
                    k = to;
                    micros = speed(k);
                    // The cluster takes the change up at once.
                    e.observe(&obs8(step + 1, k, micros), Some(k));
                }
                Some(Decision::Revert { k: back, .. }) => {
                    k = back;
                    micros = speed(k);
                    e.observe(&obs8(step + 1, k, micros), Some(k));
                }
                _ => {}
            }
        }
        // 1 -> 2 -> 4 -> 8 (slower: back to 4) -> 6 (slower: back) -> 5, kept.
        assert_eq!(tried, vec![2, 4, 8, 6, 5], "{tried:?}");
        assert_eq!(k, 5);
    }

    #[test]
    fn a_dominant_share_predicts_the_first_jump() {
        assert_eq!(predicted_k(1, 0.85), 6, "1 x 0.85 / 0.15 = 5.7");
        assert_eq!(predicted_k(2, 0.5), 2);
        assert_eq!(predicted_k(1, 1.0), 19, "capped at a share of 0.95");
        assert_eq!(predicted_k(3, f64::NAN), 0);
        // From one owner at a share of 0.85, the first trial takes every
        // candidate (4) at once.
        let mut e = Explorer::new(policy(), Some(1));
        assert!(matches!(e.observe(&obs(10, 1, 1000.0, 0.85), Some(1)), Some(Decision::Try { from: 1, to: 4, .. })));
    }

    #[test]
    fn a_trial_that_places_fewer_owners_than_its_limit_still_counts() {
        let mut e = Explorer::new(policy(), Some(1));
        assert!(matches!(e.observe(&obs(10, 1, 1000.0, 0.85), Some(1)), Some(Decision::Try { from: 1, to: 4, .. })));
        // The limit is 4 but the rendezvous placed 3 owners.
        e.observe(&obs(11, 3, 400.0, 0.6), Some(4));
        assert!(matches!(e.observe(&obs(21, 3, 400.0, 0.6), Some(4)), Some(Decision::Keep { from: 1, k: 4, .. })));
    }

    #[test]
    fn a_removal_is_kept_unless_steps_get_slower_by_more_than_the_margin() {
        let mut e = Explorer::new(policy(), None);
        assert!(matches!(e.observe(&obs(10, 4, 1000.0, 0.01), None), Some(Decision::Try { from: 4, to: 3, .. })));
        e.observe(&obs(11, 3, 1050.0, 0.01), Some(3));
        assert_eq!(
            e.observe(&obs(21, 3, 1080.0, 0.01), Some(3)),
            Some(Decision::Keep { from: 4, k: 3, before_micros: 1000.0, after_micros: 1080.0 }),
            "8% slower is within the 10% margin: the idle owner stays freed"
        );
        assert!(matches!(e.observe(&obs(31, 3, 1080.0, 0.01), Some(3)), Some(Decision::Try { from: 3, to: 2, .. })));
        e.observe(&obs(32, 2, 1300.0, 0.01), Some(2));
        assert!(matches!(e.observe(&obs(42, 2, 1300.0, 0.01), Some(2)), Some(Decision::Revert { tried: 2, k: 3, .. })));
    }

    #[test]
    fn a_trial_the_others_have_not_taken_up_waits_while_its_reason_holds() {
        // 4 -> 3 tried at step 10; the others still propose 4.
        let mut e = Explorer::new(policy(), None);
        assert!(matches!(e.observe(&obs(10, 4, 1000.0, 0.01), None), Some(Decision::Try { from: 4, to: 3, .. })));
        assert_eq!(e.observe(&obs(20, 4, 1100.0, 0.01), None), None, "waiting");
        assert_eq!(e.observe(&obs(30, 4, 1100.0, 0.02), None), None, "two windows, still idle: renewed");
        assert_eq!(e.proposal(), 3, "still proposed: a node that sees it later joins it, not replaces it");
        // Taken up at step 31; judged against the step time just before
        // (1100 us, not the 1000 of step 10, which would revert it).
        e.observe(&obs(31, 3, 1150.0, 0.01), Some(3));
        assert_eq!(
            e.observe(&obs(41, 3, 1150.0, 0.01), Some(3)),
            Some(Decision::Keep { from: 4, k: 3, before_micros: 1100.0, after_micros: 1150.0 })
        );
        // Not idle any more after two windows: dropped, back to the prior proposal.
        let mut f = Explorer::new(policy(), None);
        assert!(matches!(f.observe(&obs(10, 4, 1000.0, 0.01), None), Some(Decision::Try { to: 3, .. })));
        assert_eq!(f.observe(&obs(30, 4, 1000.0, 0.3), None), None);
        assert_eq!(f.proposal(), 0, "dropped: every capable node again");
        // With no trial, the next idle window tries again.
        assert!(matches!(f.observe(&obs(40, 4, 1000.0, 0.01), None), Some(Decision::Try { to: 3, .. })));
    }

    #[test]
    fn an_outside_change_cancels_a_trial_and_the_agreed_k_is_followed() {
        let mut e = Explorer::new(policy(), Some(2));
        assert!(matches!(e.observe(&obs(10, 2, 1000.0, 0.55), Some(2)), Some(Decision::Try { to: 3, .. })));
        // A node failed: 1 aggregator left, not the trial's 3.
        e.observe(&obs(11, 1, 1000.0, 0.9), Some(2));
        assert_eq!(e.proposal(), 2);
        // With no trial running, the node adopts whatever the cluster agreed.
        let mut f = Explorer::new(policy(), None);
        f.observe(&obs(1, 3, 1000.0, 0.3), Some(3));
        assert_eq!(f.proposal(), 0, "only when an evaluation is due (here the first, at step 2)");
        f.observe(&obs(2, 3, 1000.0, 0.3), Some(3));
        assert_eq!(f.proposal(), 3);
    }

    #[test]
    fn only_an_unmoved_start_is_judged_early() {
        // k moved before the first quarter window ended (a node joined):
        // the first evaluation waits for a whole window at the new k.
        let mut e = Explorer::new(policy(), Some(1));
        assert_eq!(e.observe(&obs(1, 1, 1000.0, 0.85), Some(1)), None);
        assert_eq!(e.observe(&obs(2, 2, 1000.0, 0.85), Some(1)), None, "k changed at step 2");
        assert_eq!(e.observe(&obs(11, 2, 1000.0, 0.85), Some(1)), None, "not a whole window at k = 2");
        assert!(matches!(e.observe(&obs(12, 2, 1000.0, 0.85), Some(1)), Some(Decision::Try { from: 2, .. })));
        // After the first evaluation, the next one is at the next window
        // boundary. (The agreed k of 2 differs from the proposal of 1, so
        // that the evaluation shows: the node adopts it.)
        let mut f = Explorer::new(policy(), Some(1));
        assert_eq!(f.observe(&obs(3, 1, 1000.0, 0.2), Some(2)), None, "evaluated: nothing to change");
        assert_eq!(f.proposal(), 2, "the early evaluation followed the agreed k");
        assert_eq!(f.observe(&obs(9, 1, 1000.0, 0.85), Some(1)), None, "same window");
        assert_eq!(f.proposal(), 2, "no evaluation within the window");
        assert!(matches!(f.observe(&obs(10, 1, 1000.0, 0.85), Some(1)), Some(Decision::Try { from: 1, to: 4, .. })));
        // A k that moved at step 0 (before any evaluation) counts as moved.
        let mut g = Explorer::new(policy(), Some(1));
        assert_eq!(g.observe(&obs(0, 1, 1000.0, 0.85), Some(1)), None);
        assert_eq!(g.observe(&obs(0, 2, 1000.0, 0.85), Some(1)), None);
        assert_eq!(g.observe(&obs(5, 2, 1000.0, 0.85), Some(1)), None, "not a whole window at k = 2");
    }

    #[test]
    fn the_agreed_limit_is_the_lower_median_of_proposals() {
        assert_eq!(agreed_limit([]), None);
        assert_eq!(agreed_limit([0, 0, 0]), None);
        assert_eq!(agreed_limit([2, 3, 3, 3]), Some(3));
        assert_eq!(agreed_limit([2, 2, 3, 3]), Some(2), "lower median");
        assert_eq!(agreed_limit([1, 0, 0]), None, "one node cannot cap k alone");
        assert_eq!(agreed_limit([2, 2, 0]), Some(2));
    }

    #[test]
    fn pace_meter_averages() {
        let mut m = PaceMeter::default();
        let p = m.observe(0.100, 0.090);
        assert_eq!((p.step_micros, p.comm_micros), (100_000, 90_000), "the first step alone");
        let p = m.observe(0.010, 0.030);
        assert_eq!(
            (p.step_micros, p.comm_micros),
            (10_000, 10_000),
            "replaced by the second; comm clamped to the step"
        );
        // Steps 2 to 11: a plain mean (10 to 28 ms, mean 19 ms).
        for i in 1..10 {
            m.observe(0.010 + 0.002 * f64::from(i), 0.004);
        }
        let near = |got: u32, want: u32| got.abs_diff(want) <= 1;
        let p = m.observe(0.0, 0.0);
        assert!(near(p.step_micros, 17_100), "the 11th value weighs 0.1: 19 + 0.1 x (0 - 19) ms: {p:?}");
        let p = m.observe(0.0271, 0.0);
        assert!(near(p.step_micros, 18_100), "17.1 + 0.1 x (27.1 - 17.1) ms: {p:?}");
    }

    #[test]
    fn pace_meter_averages_the_rates_it_measured() {
        let mut m = PaceMeter::default();
        assert_eq!(m.rates(0, 0.0, 0, 0.0), (0.0, 0.0), "nothing measured");
        assert_eq!(m.rates(64, 0.001, 0, 0.0), (0.0, 0.0), "the first step: dropped at the second");
        assert_eq!(m.rates(64, 0.032, 0, 0.0), (0.0, 0.0), "one step after it: not reported yet");
        assert_eq!(m.rates(64, 0.032, 0, 0.0), (0.0, 0.0), "two: not reported yet");
        let (c, n) = m.rates(64, 0.008, 1_000_000, 0.5);
        assert!((c - 4000.0).abs() < 1e-3, "the mean of 2000, 2000 and 8000: {c}");
        assert_eq!(n, 0.0, "one exchange: not reported yet");
        for _ in 0..3 {
            m.rates(64, 0.008, 1_000_000, 0.5);
        }
        let (c, n) = m.rates(64, 0.008, 1_000_000, 0.5);
        assert!((c - 44_000.0 / 7.0).abs() < 1e-2, "the mean of 2000, 2000 and five 8000: {c}");
        assert_eq!(n, 2_000_000.0);
        assert_eq!(m.rates(32, f64::NAN, 10, 0.0), (c, n), "bad times leave the averages");
    }
}
