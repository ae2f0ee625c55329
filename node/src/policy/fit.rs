//! A slow worker under BSP (`sync.fit_batch`): every round waits for the
//! slowest worker's gradient, so one machine computing 4x slower holds the
//! whole cluster at a quarter of its speed. Instead, the slow worker trains
//! on a smaller batch, sized so that its step computes in about the time
//! the other workers' steps take. Owners average a round's gradients
//! weighted by samples, so the smaller batch counts for what it holds.
//!
//! [`BatchFit`] keeps the worker's own compute time per sample (the median
//! of its last [`FIT_WINDOW`] steps, at whatever batch each used) and picks the batch
//! for the next step from the others' compute time per step (from their
//! heartbeats: step time less communication time). The iteration
//! `b <- b x target / time(b)` settles where `time(b)` meets the target even
//! when part of a step's cost does not scale with the batch. Pure: no clock,
//! no runtime.
//!
//! The fit is a *fraction* of each step's own batch, not a count: the
//! others' compute time is a moving average over their steps, which is the
//! time of their *mean* batch, while the steps themselves differ (a
//! partition of 359 samples in batches of 256 gives 256, 103, 256, …). A
//! fixed count sized to the mean held every short round back (the others
//! computed 103 samples while the slow worker computed a count sized for
//! 180) and left the long rounds' slack unused. The fraction assumes that
//! compute time is proportional to the batch; with a large fixed cost per
//! step, short rounds still wait a little and long ones keep some slack (a
//! fit of `a + b x batch` would place each round exactly; not built).
//! Across the mean batch the iteration still settles where the time meets
//! the target.
//!
//! The target is the *slowest* of the other workers that are not slow
//! themselves (within [`SLOW_FACTOR`] of their lower median), not their
//! median: a fitted worker computes in about the target's time, so with the
//! median as the target one fitted worker that came out a little fast
//! lowered it for everybody, healthy workers shrank to meet it, and batches
//! spiralled down (seen on 4 nodes on 2 cores, where steps compute in 2 ms
//! with 1 ms of jitter).

/// The worker's compute time per sample is the median of its last this
/// many steps. A median, not a moving average: one step held up 10x by the
/// scheduler pulled an average (weight 0.2) to 2.8x and shrank a healthy
/// worker's next batch (CI, 4 nodes on 2 cores: 2 of 300 steps), while a
/// median moves only when most of the window is slow.
pub const FIT_WINDOW: usize = 9;

/// Before the window is full, a worker already fits once this many steps
/// are counted, on the *fastest* of them: every one must be slow, so a
/// healthy worker shrinks early only after this many stalled steps in a
/// row, while a slow one stops holding rounds back 6 steps sooner (with a
/// 4x slower worker each of those steps costs three rounds' time).
pub const EARLY_STEPS: usize = 3;

/// A worker keeps its full batch unless it is this many times slower than
/// the target: noise between equal machines must not shrink batches (on 4
/// nodes sharing 2 cores, 1.5x was crossed for a few steps now and then).
pub const FIT_MARGIN: f64 = 2.0;

/// Other workers slower than this many times their lower median are slow
/// themselves and are not a target.
pub const SLOW_FACTOR: f64 = 2.0;

/// The smallest batch a fitted worker trains on, as a fraction of the full
/// one (a worker 16x slower than the others still contributes something).
pub const MIN_FRACTION: f64 = 1.0 / 16.0;

/// The first steps a worker times are not counted: they pay for
/// allocations and cold caches (in the TCP test the first step took 10x the
/// others, and every healthy worker fitted its first 25 steps to it).
pub const WARMUP_STEPS: u32 = 5;

/// The most a worker that keeps its full batch grows it to take on the
/// samples the fitted workers shed (`sync.fit_rebalance`), as a multiple
/// of its own batch: with most of a cluster slow, the few fast workers
/// would otherwise train on many times their batch and set a pace the slow
/// ones fit themselves down to.
pub const MAX_GROWTH: f64 = shoal_protocol::MAX_BATCH_PERMILLE as f64 / 1000.0;

/// How many samples a worker that keeps its full batch (`nominal`) trains
/// on when the other workers' last steps trained on `others_permille`
/// thousandths of theirs (`sync.fit_rebalance`): the samples the fitted
/// workers (below 1000) shed, spread evenly over the workers that are not
/// fitted (this one, the others at 1000 or above, and those not measured
/// yet, at 0), so that a round holds the configured global batch. The
/// owners weigh each gradient by its samples, so a round's update is that
/// of the configured global batch, as with no slow worker; without this a
/// 4x slower worker fitted to a quarter leaves a round 19% short of its
/// samples (see the module's notes). Ranks' batches differ by at most a
/// sample within a step, so shares of each worker's own batch add up.
pub fn rebalanced(nominal: usize, others_permille: &[u16]) -> usize {
    let shed: f64 = others_permille.iter().filter(|&&p| p > 0 && p < 1000).map(|&p| f64::from(1000 - p) / 1000.0).sum();
    if shed == 0.0 {
        return nominal;
    }
    let full = 1 + others_permille.iter().filter(|&&p| p == 0 || p >= 1000).count();
    let growth = (1.0 + shed / full as f64).min(MAX_GROWTH);
    (nominal as f64 * growth).round() as usize
}

/// The share of `nominal` that `trained` is, in thousandths, as gossiped in
/// `Pace::batch_permille` (at least 1, at most the protocol's maximum).
pub fn permille(trained: usize, nominal: usize) -> u16 {
    let p = (trained as f64 * 1000.0 / nominal.max(1) as f64).round();
    p.clamp(1.0, f64::from(shoal_protocol::MAX_BATCH_PERMILLE)) as u16
}

/// A worker's batch fitted to the cluster's pace.
#[derive(Debug, Clone)]
pub struct BatchFit {
    /// The mean of the steps' own (unfitted) batch sizes so far; the
    /// configured batch size before the first step.
    nominal_mean: f64,
    nominal_steps: u64,
    /// The last [`FIT_WINDOW`] steps' compute time per sample (µs), oldest
    /// first.
    recent: std::collections::VecDeque<f64>,
    seen: u32,
}

impl BatchFit {
    /// `full`: the configured batch size (at least 1).
    pub fn new(full: usize) -> Self {
        Self {
            nominal_mean: full.max(1) as f64,
            nominal_steps: 0,
            recent: std::collections::VecDeque::with_capacity(FIT_WINDOW),
            seen: 0,
        }
    }

    /// One step computed `samples` samples in `micros` (the first
    /// [`WARMUP_STEPS`] are not counted).
    pub fn observe(&mut self, samples: usize, micros: f64) {
        if samples == 0 || !micros.is_finite() || micros <= 0.0 {
            return;
        }
        if self.seen < WARMUP_STEPS {
            self.seen += 1;
            return;
        }
        if self.recent.len() == FIT_WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(micros / samples as f64);
    }

    /// The median of the last [`FIT_WINDOW`] per-sample times; before that
    /// many steps are counted, the fastest of at least [`EARLY_STEPS`]; `None`
    /// before (a window of one stalled step would be all stall).
    fn micros_per_sample(&self) -> Option<f64> {
        if self.recent.len() < EARLY_STEPS {
            return None;
        }
        let mut v: Vec<f64> = self.recent.iter().copied().collect();
        v.sort_by(f64::total_cmp);
        if v.len() < FIT_WINDOW {
            return v.first().copied();
        }
        v.get(v.len() / 2).copied()
    }

    /// How many of the next step's `nominal` samples to train on, given the
    /// other workers' compute time per step (µs, their moving averages: the
    /// time of their mean batch). All of them while nothing is measured, or
    /// while this worker's mean batch would take at most [`FIT_MARGIN`]
    /// times the target; otherwise the fraction of `nominal` that the
    /// target's time holds at this worker's speed (see the module's notes).
    pub fn batch(&mut self, others_micros: &[f64], nominal: usize) -> usize {
        let nominal = nominal.max(1);
        self.nominal_steps += 1;
        self.nominal_mean += (nominal as f64 - self.nominal_mean) / self.nominal_steps as f64;
        let Some(per_sample) = self.micros_per_sample() else { return nominal };
        let mut v: Vec<f64> = others_micros.iter().copied().filter(|x| x.is_finite() && *x > 0.0).collect();
        if v.is_empty() {
            return nominal;
        }
        v.sort_by(f64::total_cmp);
        let median = v[(v.len() - 1) / 2];
        let target = v.iter().copied().filter(|x| *x <= SLOW_FACTOR * median).fold(median, f64::max);
        let mean_time = per_sample * self.nominal_mean;
        if mean_time <= FIT_MARGIN * target {
            return nominal;
        }
        let min = ((nominal as f64 * MIN_FRACTION).ceil() as usize).max(1);
        ((nominal as f64 * target / mean_time).round() as usize).clamp(min, nominal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Past warm-up, whose (huge) times must not count.
    fn warmed(full: usize) -> BatchFit {
        let mut f = BatchFit::new(full);
        for _ in 0..WARMUP_STEPS {
            f.observe(full, 1e12);
        }
        f
    }

    /// A full window of steps of `samples` in `micros`.
    fn observe_window(f: &mut BatchFit, samples: usize, micros: f64) {
        for _ in 0..FIT_WINDOW {
            f.observe(samples, micros);
        }
    }

    #[test]
    fn equal_workers_keep_their_batch() {
        let mut f = warmed(32);
        assert_eq!(f.batch(&[1000.0], 32), 32, "nothing measured yet");
        for _ in 0..EARLY_STEPS - 1 {
            f.observe(32, 4000.0);
        }
        assert_eq!(f.batch(&[1000.0], 32), 32, "too few steps counted");
        observe_window(&mut f, 32, 1100.0);
        assert_eq!(f.batch(&[], 32), 32, "no peer measured");
        assert_eq!(f.batch(&[1000.0, 900.0, 1200.0], 32), 32, "1.1x the others: noise");
        observe_window(&mut f, 32, 1400.0);
        assert_eq!(f.batch(&[1000.0, 900.0], 32), 32, "1.4x the slowest of them: noise");
    }

    #[test]
    fn before_the_window_is_full_every_counted_step_must_be_slow() {
        // Two stalled steps and a normal one: the fastest is normal.
        let mut f = warmed(32);
        f.observe(32, 10_000.0);
        f.observe(32, 1000.0);
        f.observe(32, 10_000.0);
        assert_eq!(f.batch(&[1000.0, 1000.0], 32), 32);
        f.observe(32, 10_000.0);
        assert_eq!(f.batch(&[1000.0, 1000.0], 32), 32, "still one normal step among them");
        // A worker slow from the start fits after EARLY_STEPS counted steps,
        // on its fastest one.
        let mut slow = warmed(32);
        slow.observe(32, 4000.0);
        slow.observe(32, 4400.0);
        assert_eq!(slow.batch(&[1000.0, 1000.0], 32), 32);
        slow.observe(32, 4200.0);
        assert_eq!(slow.batch(&[1000.0, 1000.0], 32), 8, "a quarter, from its fastest step");
    }

    #[test]
    fn a_few_stalled_steps_do_not_shrink_a_healthy_worker() {
        // Steps of 1,000 µs with every third held up 10x by the scheduler
        // (three in any window of nine): the median stays at 1,000.
        let mut f = warmed(32);
        for i in 0..60 {
            let stalled = i % 3 == 0;
            f.observe(32, if stalled { 10_000.0 } else { 1000.0 });
            assert_eq!(f.batch(&[1000.0, 1000.0, 4000.0], 32), 32, "step {i}");
        }
        // Once most of the window is slow, it is slow.
        for _ in 0..FIT_WINDOW / 2 + 1 {
            f.observe(32, 4000.0);
        }
        assert_eq!(f.batch(&[1000.0, 1000.0], 32), 8);
    }

    #[test]
    fn a_fitted_worker_that_came_out_fast_does_not_shrink_the_others() {
        // node0 at its natural 1,000 µs; node1 too; node2 fitted, 700 µs this
        // time; node3 slow (4,000) and not yet fitted.
        let mut f = warmed(32);
        observe_window(&mut f, 32, 1000.0);
        assert_eq!(f.batch(&[1000.0, 700.0, 4000.0], 32), 32, "the target is node1's 1,000, not 700");
        assert_eq!(f.batch(&[700.0, 650.0, 4000.0], 32), 32, "1000 / 700 < 2");
        // Two slow workers: each takes the healthy ones as its target.
        let mut slow = warmed(32);
        observe_window(&mut slow, 32, 4000.0);
        assert_eq!(slow.batch(&[1000.0, 1000.0, 4000.0], 32), 8);
    }

    #[test]
    fn a_4x_slower_worker_fits_its_batch_to_the_others_and_settles() {
        // Compute time = 200 µs fixed + 400 µs per sample here, 4x the
        // others' (50 + 100 per sample) at batch 32: others take 3,250 µs.
        let time = |b: usize| 200.0 + 400.0 * b as f64;
        let target = 50.0 + 100.0 * 32.0;
        let mut f = warmed(32);
        let mut b = 32;
        for _ in 0..40 {
            f.observe(b, time(b));
            b = f.batch(&[target, target, 4.0 * target], 32);
        }
        assert!((7..=8).contains(&b), "settles near (3250 - 200) / 400 = 7.6: {b}");
        assert!(time(b) <= target * FIT_MARGIN, "{} µs against {target}", time(b));
        // The slowdown ends: back to the full batch.
        for _ in 0..40 {
            f.observe(b, 50.0 + 100.0 * b as f64);
            b = f.batch(&[target, target, target], 32);
        }
        assert_eq!(b, 32);
    }

    #[test]
    fn the_fit_follows_each_steps_own_batch() {
        // A partition of 359 in batches of 256: steps alternate 256 and 103.
        // The others (1x) report the moving average of their step times,
        // the time of their mean batch (179.5); this worker is 4x slower.
        let others = |n: f64| 100.0 * n;
        let target = others(179.5);
        let time = |n: usize| 400.0 * n as f64;
        let mut f = warmed(256);
        let mut fitted = Vec::new();
        for step in 0..60 {
            let nominal = if step % 2 == 0 { 256 } else { 103 };
            let b = f.batch(&[target, target, 4.0 * target], nominal);
            f.observe(b, time(b));
            if step >= 40 {
                fitted.push((nominal, b));
                // Each round's own slowest other worker: this one is not it
                // by more than a sample's time.
                assert!(time(b) <= others(nominal as f64) + 400.0, "step {step}: {b} of {nominal}");
            }
        }
        let long: Vec<usize> = fitted.iter().filter(|(n, _)| *n == 256).map(|(_, b)| *b).collect();
        let short: Vec<usize> = fitted.iter().filter(|(n, _)| *n == 103).map(|(_, b)| *b).collect();
        assert!(long.iter().all(|&b| (63..=64).contains(&b)), "a quarter of 256: {long:?}");
        assert!(short.iter().all(|&b| (25..=26).contains(&b)), "a quarter of 103: {short:?}");
    }

    #[test]
    fn full_workers_take_on_what_fitted_workers_shed() {
        // Nothing fitted (or nothing measured yet): the batch as it is.
        assert_eq!(rebalanced(180, &[]), 180);
        assert_eq!(rebalanced(180, &[1000, 0, 1000]), 180);
        // One of four at a quarter: the other three share 0.75 of a batch.
        assert_eq!(rebalanced(180, &[1000, 1000, 250]), 225);
        // The others' grown batches (above 1000) count as full workers.
        assert_eq!(rebalanced(180, &[1250, 1250, 250]), 225);
        // The round holds the global batch: 3 x 225 + 45 = 4 x 180.
        assert_eq!(3 * 225 + 45, 4 * 180);
        // Two of four slow: the other two take a half each of what they shed.
        assert_eq!(rebalanced(100, &[1000, 500, 500]), 150);
        // Most of the cluster slow: at most twice the batch.
        assert_eq!(rebalanced(100, &[100, 100, 100]), 200);
        assert_eq!(permille(45, 180), 250);
        assert_eq!(permille(225, 180), 1250);
        assert_eq!(permille(0, 180), 1, "a step that trained is never 0 (not measured)");
        assert_eq!(permille(10_000, 1), shoal_protocol::MAX_BATCH_PERMILLE);
    }

    #[test]
    fn a_slow_worker_and_the_full_ones_settle_where_their_steps_match() {
        // Four workers, one 4x slower. Compute time per sample: 100 µs,
        // 400 µs for the slow one; the full workers grow by what it sheds,
        // and it fits to their (grown) time. The fixed point is where the
        // slow one trains on 4/13 of its batch and the others on 1 + 3/13
        // of theirs: equal times, and the round holds 4 batches.
        let nominal = 180;
        let mut slow = warmed(nominal);
        let (mut b_slow, mut b_full) = (nominal, nominal);
        for _ in 0..60 {
            slow.observe(b_slow, 400.0 * b_slow as f64);
            let p = permille(b_slow, nominal);
            let grown = permille(b_full, nominal);
            b_full = rebalanced(nominal, &[grown, grown, p]);
            let full_time = 100.0 * b_full as f64;
            b_slow = slow.batch(&[full_time, full_time, full_time], nominal);
        }
        assert!((55..=56).contains(&b_slow), "4/13 of 180 is 55.4: {b_slow}");
        assert!((221..=222).contains(&b_full), "16/13 of 180 is 221.5: {b_full}");
        let round = 3 * b_full + b_slow;
        assert!(round.abs_diff(4 * nominal) <= 3, "the round holds the global batch: {round}");
        assert!(
            (400.0 * b_slow as f64) <= 100.0 * b_full as f64 + 400.0,
            "the slow worker does not hold the round back"
        );
    }

    #[test]
    fn a_very_slow_worker_keeps_a_sixteenth() {
        let mut f = warmed(32);
        observe_window(&mut f, 32, 1e9);
        assert_eq!(f.batch(&[100.0], 32), 2);
        let mut one = warmed(1);
        observe_window(&mut one, 1, 1e9);
        assert_eq!(one.batch(&[100.0], 1), 1);
        // Bad measurements are ignored.
        let mut g = warmed(8);
        for _ in 0..FIT_WINDOW {
            g.observe(0, 5.0);
            g.observe(8, f64::NAN);
        }
        assert_eq!(g.batch(&[1.0], 8), 8);
    }
}
