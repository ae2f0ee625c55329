//! Fault injection, adjustable while the node runs (testnets set it through
//! the HTTP control endpoint). Zero and 1.0 in production.
//!
//! - `serve_delay`: every push and pull this node answers as a shard owner
//!   is held back this long (a slow aggregator);
//! - `slowdown`: every training step's gradient computation is stretched to
//!   this many times its measured length (a slow machine).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Shared fault settings.
#[derive(Debug, Default)]
pub struct Faults {
    serve_delay_ms: AtomicU64,
    /// Slowdown factor in thousandths (1000 = none).
    slowdown_milli: AtomicU64,
}

/// Largest slowdown factor accepted.
pub const MAX_SLOWDOWN: f64 = 1000.0;

impl Faults {
    pub fn new(serve_delay_ms: u64, slowdown: f64) -> Result<Self, String> {
        let f = Self { serve_delay_ms: AtomicU64::new(serve_delay_ms), slowdown_milli: AtomicU64::new(1000) };
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
}
