//! A node's time series for `GET /history`, pure: a bounded ring of points
//! that thins itself as it fills, so that it spans the whole run at an even
//! spacing, a bounded list of events (role changes, shard moves, joins,
//! leaves, forced rounds), and a bounded list of the placements this node
//! computed: which peer owned each shard from when, across the cluster.
//!
//! Thinning: the series keeps one step in every `stride`. When it holds
//! `capacity` points it drops every other one and doubles `stride`, so a run
//! of any length ends with between `capacity / 2` and `capacity` points,
//! evenly spread from its first step to its last.

use serde::Serialize;

/// One sample of the node's counters.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Point {
    /// Seconds since the node started.
    pub t: f64,
    pub step: u64,
    /// The training loss of this step.
    pub loss: f32,
    /// The latest validation figures (none before the first evaluation).
    pub accuracy: Option<f32>,
    pub bits_per_byte: Option<f32>,
    pub perplexity: Option<f64>,
    /// Samples trained since the start (the throughput between two points
    /// is their difference over the time between them).
    pub samples: u64,
    /// Samples per second since the first step.
    pub samples_per_sec: f64,
    /// Bytes sent and received since the start.
    pub bytes_out: u64,
    pub bytes_in: u64,
    pub owned_shards: Vec<u32>,
    /// `worker`, `aggregator`, `joining`, ... as in `/status`.
    pub role: &'static str,
}

/// Something that happened, with when.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Event {
    pub t: f64,
    pub step: u64,
    /// `role`, `shard_in`, `shard_out`, `demoted`, `promoted`, `joined`,
    /// `left`, `forced_round`, `resumed`, `aggregators`.
    pub kind: &'static str,
    /// What it changed to, in words (`aggregator [0, 3]`, `4 aggregators`).
    pub detail: String,
}

/// Who owned each shard from `t` on, as this node's placement said.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Ownership {
    pub t: f64,
    pub step: u64,
    /// `owners[shard]`: an index into [`History::peers`].
    pub owners: Vec<u32>,
}

/// The ring, the event list and the ownership timeline.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct History {
    /// Most points kept.
    pub capacity: usize,
    /// One step kept in this many.
    pub stride: u64,
    pub points: Vec<Point>,
    /// The first `max_events` events, then the latest (the oldest after
    /// the first half are dropped).
    pub events: Vec<Event>,
    pub max_events: usize,
    /// Events dropped to stay within `max_events`.
    pub events_dropped: u64,
    /// Every placement whose owners differ from the one before, kept like
    /// the events (the first half of `max_events`, then the latest).
    pub ownership: Vec<Ownership>,
    /// The peers named by `ownership`, in the order they first owned a
    /// shard.
    pub peers: Vec<String>,
    /// Placements dropped to stay within `max_events`.
    pub ownership_dropped: u64,
    /// Steps offered to `record` (kept or not).
    #[serde(skip)]
    offered: u64,
}

impl History {
    /// `capacity` points (at least 2) and `max_events` events (at least 2).
    pub fn new(capacity: usize, max_events: usize) -> Self {
        Self {
            capacity: capacity.max(2),
            stride: 1,
            points: Vec::new(),
            events: Vec::new(),
            max_events: max_events.max(2),
            events_dropped: 0,
            ownership: Vec::new(),
            peers: Vec::new(),
            ownership_dropped: 0,
            offered: 0,
        }
    }

    /// A step finished: kept if it falls on the stride (only then is
    /// `point` called). When the ring is full, every other point goes and
    /// the stride doubles.
    pub fn record(&mut self, point: impl FnOnce() -> Point) {
        let n = self.offered;
        self.offered += 1;
        if !n.is_multiple_of(self.stride) {
            return;
        }
        if self.points.len() >= self.capacity {
            // Keep the points at even positions: offered indices that are
            // multiples of twice the stride.
            let mut i = 0;
            self.points.retain(|_| {
                i += 1;
                (i - 1) % 2 == 0
            });
            self.stride *= 2;
            if !n.is_multiple_of(self.stride) {
                return;
            }
        }
        self.points.push(point());
    }

    /// Something happened. Past `max_events`, the first half is kept (how
    /// the run began) and the oldest of the rest go.
    pub fn event(&mut self, event: Event) {
        self.events_dropped += bounded_push(&mut self.events, event, self.max_events);
    }

    /// A placement with `owners[shard]`: kept when they differ from the
    /// last one kept (an epoch that moved nothing is not a change).
    pub fn owners(&mut self, t: f64, step: u64, owners: &[String]) {
        let indices: Vec<u32> = owners.iter().map(|o| self.peer_index(o)).collect();
        if self.ownership.last().is_some_and(|last| last.owners == indices) {
            return;
        }
        let mark = Ownership { t, step, owners: indices };
        self.ownership_dropped += bounded_push(&mut self.ownership, mark, self.max_events);
    }

    fn peer_index(&mut self, peer: &str) -> u32 {
        match self.peers.iter().position(|p| p == peer) {
            Some(i) => i as u32,
            None => {
                self.peers.push(peer.to_owned());
                (self.peers.len() - 1) as u32
            }
        }
    }
}

/// Pushes `item`; when `list` holds `max` already, the oldest after the
/// first half goes first. Returns how many were dropped (0 or 1).
fn bounded_push<T>(list: &mut Vec<T>, item: T, max: usize) -> u64 {
    let dropped = if list.len() >= max {
        list.remove(max / 2);
        1
    } else {
        0
    };
    list.push(item);
    dropped
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(step: u64) -> Point {
        Point {
            t: step as f64 * 0.1,
            step,
            loss: 1.0,
            accuracy: None,
            bits_per_byte: None,
            perplexity: None,
            samples: 0,
            samples_per_sec: 0.0,
            bytes_out: 0,
            bytes_in: 0,
            owned_shards: Vec::new(),
            role: "worker",
        }
    }

    #[test]
    fn a_long_run_is_thinned_evenly_from_its_first_step_to_near_its_last() {
        let mut h = History::new(100, 10);
        for step in 0..10_000 {
            h.record(|| point(step));
            assert!(h.points.len() <= 100, "{} points at step {step}", h.points.len());
        }
        // 10 000 steps into at most 100 points: a stride of 128.
        assert_eq!(h.stride, 128);
        let steps: Vec<u64> = h.points.iter().map(|p| p.step).collect();
        assert_eq!(steps[0], 0);
        assert!(steps.windows(2).all(|w| w[1] - w[0] == h.stride), "uneven: {steps:?}");
        assert!(h.points.len() >= 50, "{} points", h.points.len());
        assert!(*steps.last().unwrap_or(&0) >= 10_000 - h.stride, "the last point is at {steps:?}");
    }

    #[test]
    fn a_short_run_keeps_every_step() {
        let mut h = History::new(100, 10);
        for step in 0..100 {
            h.record(|| point(step));
        }
        assert_eq!(h.points.len(), 100);
        assert_eq!(h.stride, 1);
    }

    #[test]
    fn events_keep_the_beginning_and_the_latest() {
        let mut h = History::new(10, 4);
        for step in 0..10 {
            h.event(Event { t: 0.0, step, kind: "role", detail: String::new() });
        }
        let steps: Vec<u64> = h.events.iter().map(|e| e.step).collect();
        assert_eq!(steps, [0, 1, 8, 9]);
        assert_eq!(h.events_dropped, 6);
    }

    #[test]
    fn ownership_keeps_each_change_once_with_its_peers_named_once() {
        let mut h = History::new(10, 4);
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        h.owners(0.0, 0, &names(&["a", "b", "a"]));
        h.owners(1.0, 5, &names(&["a", "b", "a"])); // a new epoch, nothing moved
        h.owners(2.0, 9, &names(&["c", "b", "c"]));
        assert_eq!(h.peers, ["a", "b", "c"]);
        let marks: Vec<(u64, Vec<u32>)> = h.ownership.iter().map(|o| (o.step, o.owners.clone())).collect();
        assert_eq!(marks, [(0, vec![0, 1, 0]), (9, vec![2, 1, 2])]);
        // Bounded like the events: the first half, then the latest.
        for step in 10..20 {
            let who = if step % 2 == 0 { "a" } else { "b" };
            h.owners(step as f64, step, &names(&[who, who, who]));
        }
        let steps: Vec<u64> = h.ownership.iter().map(|o| o.step).collect();
        assert_eq!(steps, [0, 9, 18, 19]);
        assert_eq!(h.ownership_dropped, 8);
        assert_eq!(h.peers, ["a", "b", "c"], "a peer is named once however often it owns");
    }
}
