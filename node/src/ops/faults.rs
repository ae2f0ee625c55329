//! Fault injection, adjustable while the node runs (testnets set it through
//! the HTTP control endpoint). Zero and 1.0 in production.
//!
//! - `serve_delay`: every push and pull this node answers as a shard owner
//!   is held back this long (a slow aggregator);
//! - `slowdown`: every training step's gradient computation is stretched to
//!   this many times its measured length (a slow machine);
//! - `serve_mbps`: the shard states this node sends as an owner leave over
//!   one link of this many Mbit/s, each queued behind the previous one (an
//!   owner on a slow uplink: its serving time grows with its load).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Shared fault settings.
#[derive(Debug, Default)]
pub struct Faults {
    serve_delay_ms: AtomicU64,
    /// Slowdown factor in thousandths (1000 = none).
    slowdown_milli: AtomicU64,
    /// Emulated uplink in kbit/s (0 = none), and when it is next free.
    serve_kbps: AtomicU64,
    link_free: Mutex<Option<Instant>>,
}

/// Largest slowdown factor accepted.
pub const MAX_SLOWDOWN: f64 = 1000.0;

impl Faults {
    pub fn new(serve_delay_ms: u64, slowdown: f64) -> Result<Self, String> {
        let f = Self {
            serve_delay_ms: AtomicU64::new(serve_delay_ms),
            slowdown_milli: AtomicU64::new(1000),
            ..Default::default()
        };
        f.set_slowdown(slowdown)?;
        Ok(f)
    }

    pub fn serve_delay(&self) -> Duration {
        Duration::from_millis(self.serve_delay_ms.load(Ordering::Relaxed))
    }

    pub fn set_serve_delay_ms(&self, ms: u64) {
        self.serve_delay_ms.store(ms, Ordering::Relaxed);
    }

    pub fn slowdown(&self) -> f64 {
        self.slowdown_milli.load(Ordering::Relaxed) as f64 / 1000.0
    }

    /// `factor` must be in `1.0..=1000.0`.
    pub fn set_slowdown(&self, factor: f64) -> Result<(), String> {
        if !(1.0..=MAX_SLOWDOWN).contains(&factor) {
            return Err(format!("slowdown {factor} must be between 1 and {MAX_SLOWDOWN}"));
        }
        self.slowdown_milli.store((factor * 1000.0).round() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// `mbps` must be finite and non-negative; 0 turns the emulated link off.
    pub fn set_serve_mbps(&self, mbps: f64) -> Result<(), String> {
        if !(0.0..=1e9).contains(&mbps) {
            return Err(format!("fault_serve_mbps {mbps} must be a number from 0 (off) to 1e9"));
        }
        if mbps > 0.0 && mbps < 0.001 {
            return Err(format!("fault_serve_mbps {mbps} is below the smallest emulated link (0.001)"));
        }
        self.serve_kbps.store((mbps * 1000.0).round() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// The emulated uplink in Mbit/s (0: none).
    pub fn serve_mbps(&self) -> f64 {
        self.serve_kbps.load(Ordering::Relaxed) as f64 / 1000.0
    }

    /// How long `bytes` sent now wait for the emulated link (queued behind
    /// what was sent before); zero without one.
    pub fn link_delay(&self, bytes: u64) -> Duration {
        let kbps = self.serve_kbps.load(Ordering::Relaxed);
        if kbps == 0 {
            return Duration::ZERO;
        }
        let now = Instant::now();
        let Ok(mut free) = self.link_free.lock() else { return Duration::ZERO };
        let start = free.filter(|t| *t > now).unwrap_or(now);
        let end = start + Duration::from_secs_f64(bytes as f64 * 8.0 / (kbps as f64 * 1000.0));
        *free = Some(end);
        end - now
    }

    /// Extra time to add to a step whose gradients took `compute`.
    pub fn extra_compute(&self, compute: Duration) -> Duration {
        compute.mul_f64(self.slowdown() - 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slowdown_stretches_compute_and_bad_factors_are_refused() {
        let f = Faults::new(0, 5.0).unwrap_or_default();
        assert_eq!(f.extra_compute(Duration::from_millis(10)), Duration::from_millis(40));
        assert!(f.set_slowdown(0.5).is_err());
        assert!(f.set_slowdown(f64::NAN).is_err());
        assert!(Faults::new(0, 2000.0).is_err());
        f.set_serve_delay_ms(25);
        assert_eq!(f.serve_delay(), Duration::from_millis(25));
    }

    #[test]
    fn the_emulated_link_queues_sends_behind_each_other() {
        let f = Faults::default();
        assert_eq!(f.link_delay(1_000_000), Duration::ZERO, "off by default");
        assert!(f.set_serve_mbps(-1.0).is_err() && f.set_serve_mbps(f64::INFINITY).is_err());
        assert!(f.set_serve_mbps(8.0).is_ok()); // 1 MB/s
        let first = f.link_delay(100_000); // 100 ms on the wire
        let second = f.link_delay(100_000); // queued behind the first
        assert!(first <= Duration::from_millis(100) && first > Duration::from_millis(90), "{first:?}");
        assert!(second > Duration::from_millis(190) && second <= Duration::from_millis(200), "{second:?}");
    }
}
