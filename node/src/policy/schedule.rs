//! The learning-rate schedule: which rate the optimizer uses at each step.
//!
//! In pull mode the shard owners run the optimizer, so they follow the
//! schedule by the shard's version (see `sync::ShardCore`); in gossip mode
//! each worker follows it by its own step.

use serde::{Deserialize, Serialize};

/// How the learning rate changes over a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrDecay {
    /// Constant learning rate.
    #[default]
    None,
    /// Cosine from `lr` down to `lr / 100` over the run's steps.
    Cosine,
}

impl LrDecay {
    /// The rate for `step` of `steps`, from the base rate `lr`.
    pub fn lr_at(self, lr: f64, step: u64, steps: u64) -> f64 {
        match self {
            LrDecay::None => lr,
            LrDecay::Cosine => {
                let floor = lr / 100.0;
                let t = step as f64 / steps.max(1) as f64;
                floor + 0.5 * (lr - floor) * (1.0 + (std::f64::consts::PI * t.min(1.0)).cos())
            }
        }
    }
}

impl std::str::FromStr for LrDecay {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(LrDecay::None),
            "cosine" => Ok(LrDecay::Cosine),
            o => Err(format!("unknown lr decay `{o}`: expected none or cosine")),
        }
    }
}

impl std::fmt::Display for LrDecay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LrDecay::None => "none",
            LrDecay::Cosine => "cosine",
        })
    }
}

/// A run's schedule: the base rate, a linear warm-up, how it decays, and
/// over how many steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    pub base: f64,
    pub decay: LrDecay,
    pub steps: u64,
    /// Steps of linear warm-up, from `base / warmup` up to `base`; the decay
    /// runs over the steps after it.
    pub warmup: u64,
}

impl LrSchedule {
    /// The rate at `step`.
    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.base * (step + 1) as f64 / self.warmup as f64;
        }
        self.decay.lr_at(self.base, step - self.warmup, self.steps.saturating_sub(self.warmup))
    }

    /// Whether the rate ever changes (a constant schedule need not be applied).
    pub fn varies(&self) -> bool {
        self.decay != LrDecay::None || self.warmup > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cosine_goes_from_the_base_rate_to_a_hundredth() {
        let s = LrSchedule { base: 0.2, decay: LrDecay::Cosine, steps: 100, warmup: 0 };
        assert!((s.lr_at(0) - 0.2).abs() < 1e-12);
        assert!((s.lr_at(50) - (0.002 + 0.5 * 0.198)).abs() < 1e-12, "half way: the mean of both ends");
        assert!((s.lr_at(100) - 0.002).abs() < 1e-12);
        assert!((s.lr_at(1000) - 0.002).abs() < 1e-12, "past the end it stays at the floor");
        assert!((1..=100).all(|t| s.lr_at(t) < s.lr_at(t - 1)), "strictly decreasing");
        let c = LrSchedule { decay: LrDecay::None, ..s };
        assert!(!c.varies() && c.lr_at(77) == 0.2);
        assert_eq!("cosine".parse::<LrDecay>().map(|d| d.to_string()), Ok("cosine".to_string()));
        assert!("linear".parse::<LrDecay>().is_err());
    }

    #[test]
    fn warm_up_climbs_linearly_then_the_decay_runs_over_the_rest() {
        let s = LrSchedule { base: 0.1, decay: LrDecay::Cosine, steps: 110, warmup: 10 };
        assert!(s.varies());
        assert!((s.lr_at(0) - 0.01).abs() < 1e-12 && (s.lr_at(4) - 0.05).abs() < 1e-12);
        assert!((s.lr_at(9) - 0.1).abs() < 1e-12, "the last warm-up step reaches the base rate");
        assert!((s.lr_at(10) - 0.1).abs() < 1e-12, "the decay starts at the base rate");
        assert!((s.lr_at(60) - (0.001 + 0.5 * 0.099)).abs() < 1e-12, "half way through the decay");
        assert!((s.lr_at(110) - 0.001).abs() < 1e-12);
        let flat = LrSchedule { decay: LrDecay::None, ..s };
        assert!(flat.varies() && flat.lr_at(5) < flat.lr_at(50) && flat.lr_at(50) == 0.1);
    }
}
