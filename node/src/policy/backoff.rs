//! Capped exponential back-off with jitter: the one rule every retry loop
//! of the node follows (a failed request to a peer, a shard whose owner
//! moved, a handoff to a busy owner, a donor that did not answer).
//!
//! Each delay is drawn uniformly from the upper half of the current base
//! ("equal jitter"): nodes that failed at the same moment (an owner that
//! left, a restart) do not retry in lock step, and no delay is shorter than
//! half the base, so the back-off still backs off. The base doubles after
//! each delay, up to the cap.

use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// The back-off state of one retry loop.
#[derive(Debug, Clone)]
pub struct Backoff {
    first: Duration,
    base: Duration,
    cap: Duration,
    rng: SmallRng,
}

impl Backoff {
    /// A back-off whose first delay is at most `first`, doubling up to
    /// `cap`, with jitter from a fresh random seed.
    pub fn new(first: Duration, cap: Duration) -> Self {
        Self::seeded(first, cap, rand::random())
    }

    /// The same with a given seed (deterministic; for tests).
    pub fn seeded(first: Duration, cap: Duration, seed: u64) -> Self {
        let first = first.min(cap);
        Self { first, base: first, cap, rng: SmallRng::seed_from_u64(seed) }
    }

    /// The next delay, in `[base / 2, base]`; the base then doubles up to
    /// the cap.
    pub fn next_delay(&mut self) -> Duration {
        let base = self.base;
        self.base = (base * 2).min(self.cap);
        let half = base / 2;
        let spread = (base - half).as_nanos() as u64;
        half + Duration::from_nanos(self.rng.random_range(0..=spread))
    }

    /// The next delay if waiting it still leaves time before a deadline
    /// `left` away; `None` (and no change) once the loop should give up.
    pub fn next_within(&mut self, left: Duration) -> Option<Duration> {
        self.fits(left).then(|| self.next_delay())
    }

    /// Whether the next delay still fits before a deadline `left` away: a
    /// loop that retries some attempts without waiting gives up once it
    /// does not.
    pub fn fits(&self, left: Duration) -> bool {
        self.base < left
    }

    /// Back to the first delay (after a success, or new information such
    /// as a hint naming the shard's new owner).
    pub fn reset(&mut self) {
        self.base = self.first;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn delays_double_up_to_the_cap_within_the_upper_half_of_each_base() {
        let mut b = Backoff::seeded(ms(20), ms(500), 7);
        let bases = [20, 40, 80, 160, 320, 500, 500, 500];
        for base in bases {
            let d = b.next_delay();
            assert!(d >= ms(base) / 2 && d <= ms(base), "delay {d:?} outside [{}, {base}] ms", base / 2);
        }
    }

    #[test]
    fn jitter_spreads_nodes_that_failed_together() {
        // Ten loops started at the same moment draw different delays.
        let firsts: std::collections::BTreeSet<Duration> =
            (0..10).map(|seed| Backoff::seeded(ms(100), ms(1000), seed).next_delay()).collect();
        assert!(firsts.len() >= 8, "only {} distinct first delays out of 10", firsts.len());
        // And one seed gives the same sequence (the rule is deterministic).
        let a: Vec<_> = (0..5).scan(Backoff::seeded(ms(10), ms(80), 3), |b, _| Some(b.next_delay())).collect();
        let c: Vec<_> = (0..5).scan(Backoff::seeded(ms(10), ms(80), 3), |b, _| Some(b.next_delay())).collect();
        assert_eq!(a, c);
    }

    #[test]
    fn a_deadline_closer_than_the_base_stops_the_loop_and_reset_starts_over() {
        let mut b = Backoff::seeded(ms(20), ms(1000), 1);
        assert!(b.next_within(ms(100)).is_some()); // base 20 < 100
        assert!(b.next_within(ms(100)).is_some()); // base 40 < 100
        assert!(b.next_within(ms(100)).is_some()); // base 80 < 100
        assert_eq!(b.next_within(ms(100)), None, "base 160 does not fit in 100 ms");
        assert_eq!(b.next_within(ms(100)), None, "giving up changes nothing");
        assert!(!b.fits(ms(160)) && b.fits(ms(161)), "the base is 160 ms now");
        b.reset();
        let d = b.next_delay();
        assert!(d <= ms(20) && d >= ms(10), "after reset the first delay is back to 20 ms: {d:?}");
        // A first delay above the cap is the cap.
        assert!(Backoff::seeded(ms(900), ms(100), 0).next_delay() <= ms(100));
    }
}
