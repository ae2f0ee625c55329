//! Fault injection, adjustable while the node runs (testnets set it through
//! the HTTP control endpoint). Zero and 1.0 in production.
//!
//! - `serve_delay`: every push and pull this node answers as a shard owner
//!   is held back this long (a slow aggregator);
//! - `slowdown`: every training step's gradient computation is stretched to
//!   this many times its measured length (a slow machine);
//! - `serve_mbps`: the shard states this node sends as an owner leave over
//!   one link of this many Mbit/s, each queued behind the previous one (an
//!   owner on a slow uplink: its serving time grows with its load);
//! - `link`: this node's own link to its peers (`faults.link_mbps`,
//!   `faults.link_latency_ms`), in both directions: what it sends (pushes,
//!   and the answers it serves) leaves over an uplink of that rate, queued,
//!   and arrives one latency later; what it receives (pulled parameters,
//!   pushed gradients) comes in over a downlink of the same rate. An edge
//!   board on a home link, for tests and benchmarks;
//! - [`Byzantine`] (`faults.byzantine`, read by the worker): this node's
//!   pushed gradients are scaled, sign-flipped or random (a bad peer, for
//!   the robust-aggregation tests).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What a Byzantine worker does to each gradient before it pushes it.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Byzantine {
    /// Honest.
    #[default]
    None,
    /// Multiply by this factor.
    Scale(f32),
    /// Negate.
    SignFlip,
    /// Replace with random values of the same L2 norm.
    Random,
}

impl Byzantine {
    /// Corrupts the gradient of `step` in place (deterministic per step).
    pub fn corrupt(&self, step: u64, grads: &mut [f32]) {
        match *self {
            Byzantine::None => {}
            Byzantine::Scale(f) => grads.iter_mut().for_each(|g| *g *= f),
            Byzantine::SignFlip => grads.iter_mut().for_each(|g| *g = -*g),
            Byzantine::Random => {
                use rand::{Rng, SeedableRng};
                let norm = crate::policy::robust::norm(grads);
                let mut rng = rand::rngs::StdRng::seed_from_u64(step ^ 0xb12a_47e5);
                grads.iter_mut().for_each(|g| *g = rng.random_range(-1.0f32..1.0));
                let scale = norm / crate::policy::robust::norm(grads).max(f32::MIN_POSITIVE);
                grads.iter_mut().for_each(|g| *g *= scale);
            }
        }
    }
}

impl std::str::FromStr for Byzantine {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "none" => Ok(Byzantine::None),
            "sign_flip" => Ok(Byzantine::SignFlip),
            "random" => Ok(Byzantine::Random),
            other => match other.strip_prefix("scale:").map(|f| f.trim().parse::<f32>()) {
                Some(Ok(f)) if f.is_finite() => Ok(Byzantine::Scale(f)),
                _ => Err(format!("fault_byzantine `{other}`: use none, scale:F, sign_flip or random")),
            },
        }
    }
}

impl std::fmt::Display for Byzantine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Byzantine::None => write!(f, "none"),
            Byzantine::Scale(x) => write!(f, "scale:{x}"),
            Byzantine::SignFlip => write!(f, "sign_flip"),
            Byzantine::Random => write!(f, "random"),
        }
    }
}

impl From<Byzantine> for String {
    fn from(b: Byzantine) -> String {
        b.to_string()
    }
}

impl TryFrom<String> for Byzantine {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

/// One emulated link direction: a rate, and when it is next free (what is
/// sent queues behind what was sent before).
#[derive(Debug, Default)]
struct Link {
    /// kbit/s; 0 = none.
    kbps: AtomicU64,
    free: Mutex<Option<Instant>>,
}

impl Link {
    fn set_mbps(&self, mbps: f64, what: &str) -> Result<(), String> {
        if !(0.0..=1e9).contains(&mbps) {
            return Err(format!("{what} {mbps} must be a number from 0 (off) to 1e9"));
        }
        if mbps > 0.0 && mbps < 0.001 {
            return Err(format!("{what} {mbps} is below the smallest emulated link (0.001)"));
        }
        self.kbps.store((mbps * 1000.0).round() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn mbps(&self) -> f64 {
        self.kbps.load(Ordering::Relaxed) as f64 / 1000.0
    }

    /// How long `bytes` sent now take to get through, queued behind what was
    /// sent before; zero without a rate.
    fn delay(&self, bytes: u64) -> Duration {
        let kbps = self.kbps.load(Ordering::Relaxed);
        if kbps == 0 {
            return Duration::ZERO;
        }
        let now = Instant::now();
        let Ok(mut free) = self.free.lock() else { return Duration::ZERO };
        let start = free.filter(|t| *t > now).unwrap_or(now);
        let end = start + Duration::from_secs_f64(bytes as f64 * 8.0 / (kbps as f64 * 1000.0));
        *free = Some(end);
        end - now
    }
}

/// Shared fault settings.
#[derive(Debug, Default)]
pub struct Faults {
    serve_delay_ms: AtomicU64,
    /// Slowdown factor in thousandths (1000 = none).
    slowdown_milli: AtomicU64,
    /// The owner's emulated uplink for the shard states it serves
    /// (`fault_serve_mbps`).
    serve: Link,
    /// This node's emulated link (`link_mbps`): up, down, and the one-way
    /// latency in microseconds.
    up: Link,
    down: Link,
    latency_us: AtomicU64,
    /// The slowdown's waits so far.
    slow: Mutex<SlowLedger>,
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
        let milli = (factor * 1000.0).round() as u64;
        if self.slowdown_milli.swap(milli, Ordering::Relaxed) != milli {
            // Oversleeping under the old factor is not owed to the new one.
            if let Ok(mut l) = self.slow.lock() {
                *l = SlowLedger::default();
            }
        }
        Ok(())
    }

    /// `mbps` must be finite and non-negative; 0 turns the emulated link off.
    pub fn set_serve_mbps(&self, mbps: f64) -> Result<(), String> {
        self.serve.set_mbps(mbps, "serve_mbps")
    }

    /// The emulated serving uplink in Mbit/s (0: none).
    pub fn serve_mbps(&self) -> f64 {
        self.serve.mbps()
    }

    /// How long `bytes` of shard state served now wait for the emulated
    /// serving uplink (queued behind what was served before); zero without one.
    pub fn link_delay(&self, bytes: u64) -> Duration {
        self.serve.delay(bytes)
    }

    /// This node's link: `mbps` each way (0: none) and a one-way latency.
    pub fn set_link(&self, mbps: f64, latency_ms: f64) -> Result<(), String> {
        self.up.set_mbps(mbps, "link_mbps")?;
        self.down.set_mbps(mbps, "link_mbps")?;
        if !(0.0..=60_000.0).contains(&latency_ms) {
            return Err(format!("link_latency_ms {latency_ms} must be a number from 0 to 60000"));
        }
        self.latency_us.store((latency_ms * 1000.0).round() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// How long a message of `bytes` that this node sends now takes to reach
    /// its peer over this node's link: the uplink's queue and rate, then the
    /// latency. Zero without a link.
    pub fn send_delay(&self, bytes: u64) -> Duration {
        self.up.delay(bytes) + Duration::from_micros(self.latency_us.load(Ordering::Relaxed))
    }

    /// How long a message of `bytes` that reached this node now takes to
    /// come in over its downlink. Zero without a link.
    pub fn receive_delay(&self, bytes: u64) -> Duration {
        self.down.delay(bytes)
    }

    /// What answering a push of `bytes` costs here beyond the work: the
    /// serve delay, the gradient coming in over the downlink, and the
    /// (empty) answer going out over the uplink. Probes meet the same.
    pub fn push_answer_delay(&self, bytes: u64) -> Duration {
        self.serve_delay() + self.receive_delay(bytes) + self.send_delay(0)
    }

    /// Wait out the slowdown of a gradient computation that took
    /// `compute`, so that it takes `slowdown` times as long (nothing
    /// without a slowdown). A timer wakes up to a tick late, and several
    /// milliseconds late on a loaded host: without [`SlowLedger`]'s carry a
    /// step of 0.5 ms slowed 4x took 5x to 10x as long.
    pub async fn stretch_compute(&self, compute: Duration) {
        let factor = self.slowdown();
        if factor <= 1.0 {
            return;
        }
        let owed = Duration::try_from_secs_f64(compute.as_secs_f64() * (factor - 1.0)).unwrap_or(Duration::MAX);
        let asked = self.slow.lock().map_or(owed, |l| l.wait(owed));
        let started = Instant::now();
        hold(asked).await;
        let took = started.elapsed();
        if let Ok(mut l) = self.slow.lock() {
            l.paid(owed, took);
        }
    }
}

/// The slowdown's account: each wait is what the step owes plus what the
/// earlier waits fell short of theirs, less what they overslept, so that
/// over a run the emulated machine is `slowdown` times slower, not more.
#[derive(Debug, Default)]
struct SlowLedger {
    /// Owed (positive) or overslept (negative), ns.
    carry_ns: i64,
}

impl SlowLedger {
    /// How long to wait for a step that owes `owed`.
    fn wait(&self, owed: Duration) -> Duration {
        Duration::from_nanos(u64::try_from(nanos(owed).saturating_add(self.carry_ns)).unwrap_or(0))
    }

    /// A step that owed `owed` waited `took`. The credit is bounded by
    /// [`MAX_SLOW_CREDIT`], so that one long stall does not leave the
    /// machine at full speed for many steps.
    fn paid(&mut self, owed: Duration, took: Duration) {
        self.carry_ns =
            self.carry_ns.saturating_add(nanos(owed)).saturating_sub(nanos(took)).max(-nanos(MAX_SLOW_CREDIT));
    }
}

/// `d` in nanoseconds, saturating.
fn nanos(d: Duration) -> i64 {
    i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)
}

/// The most oversleeping the slowdown carries to later steps.
pub const MAX_SLOW_CREDIT: Duration = Duration::from_millis(100);

/// Wait out an injected or emulated delay (none when it is zero, the
/// production case): the network actor's held responses and the worker's
/// emulated link both go through here.
pub async fn hold(delay: Duration) {
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_emulated_link_queues_each_direction_and_adds_its_latency() {
        let f = Faults::default();
        assert_eq!(f.send_delay(1_000_000) + f.receive_delay(1_000_000), Duration::ZERO, "off by default");
        assert!(f.set_link(-1.0, 0.0).is_err() && f.set_link(8.0, -1.0).is_err() && f.set_link(8.0, f64::NAN).is_err());
        assert!(f.set_link(8.0, 20.0).is_ok()); // 1 MB/s each way, 20 ms
        let up = f.send_delay(100_000); // 100 ms on the wire, then 20 ms
        assert!(up > Duration::from_millis(110) && up <= Duration::from_millis(120), "{up:?}");
        let queued = f.send_delay(100_000); // behind the first
        assert!(queued > Duration::from_millis(210), "{queued:?}");
        // The downlink is its own queue.
        let down = f.receive_delay(100_000);
        assert!(down > Duration::from_millis(90) && down <= Duration::from_millis(100), "{down:?}");
        assert_eq!(f.link_delay(100_000), Duration::ZERO, "the serving link is separate");
    }

    #[test]
    fn byzantine_gradients_are_what_they_say() {
        for s in ["none", "scale:100", "sign_flip", "random"] {
            assert_eq!(s.parse::<Byzantine>().map(|b| b.to_string()), Ok(s.to_string()));
        }
        assert!("scale:x".parse::<Byzantine>().is_err() && "evil".parse::<Byzantine>().is_err());
        let honest = vec![3.0f32, -4.0, 0.0, 12.0];
        let after = |b: Byzantine| {
            let mut g = honest.clone();
            b.corrupt(7, &mut g);
            g
        };
        assert_eq!(after(Byzantine::None), honest);
        assert_eq!(after(Byzantine::Scale(100.0)), vec![300.0, -400.0, 0.0, 1200.0]);
        assert_eq!(after(Byzantine::SignFlip), vec![-3.0, 4.0, -0.0, -12.0]);
        let r = after(Byzantine::Random);
        let norm = crate::policy::robust::norm;
        assert!((norm(&r) - 13.0).abs() < 1e-4, "the honest norm: {r:?}");
        assert_ne!(r, honest);
        assert_eq!(r, after(Byzantine::Random), "deterministic per step");
    }

    #[test]
    fn the_slowdown_pays_back_what_its_waits_overslept() {
        let ms = Duration::from_millis;
        let mut l = SlowLedger::default();
        assert_eq!(l.wait(ms(3)), ms(3));
        // The timer woke 2 ms late: the next wait is 2 ms shorter.
        l.paid(ms(3), ms(5));
        assert_eq!(l.wait(ms(3)), ms(1));
        l.paid(ms(3), ms(1));
        assert_eq!(l.wait(ms(3)), ms(3), "square again");
        // Overslept by more than a step owes: no wait, and the rest of the
        // credit goes on to the next step.
        l.paid(ms(1), ms(6));
        assert_eq!(l.wait(ms(1)), Duration::ZERO);
        l.paid(ms(1), Duration::ZERO);
        assert_eq!(l.wait(ms(3)), Duration::ZERO, "4 ms of credit left");
        l.paid(ms(3), Duration::ZERO);
        assert_eq!(l.wait(ms(3)), ms(2), "the last 1 ms of it");
        l.paid(ms(3), ms(2));
        assert_eq!(l.wait(ms(3)), ms(3), "square again");
        // Fell short (woken early): owed on top of the next.
        l.paid(ms(3), ms(2));
        assert_eq!(l.wait(ms(3)), ms(4));
        // One long stall gives at most MAX_SLOW_CREDIT of credit.
        let mut l = SlowLedger::default();
        l.paid(ms(1), Duration::from_secs(10));
        assert_eq!(l.wait(MAX_SLOW_CREDIT + ms(1)), ms(1));
    }

    #[tokio::test]
    async fn slowdown_stretches_compute_and_bad_factors_are_refused() {
        let f = Faults::new(0, 5.0).unwrap_or_default();
        let started = Instant::now();
        f.stretch_compute(Duration::from_millis(10)).await;
        assert!(started.elapsed() >= Duration::from_millis(40), "{:?}", started.elapsed());
        assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
        for off in [Faults::default(), Faults::new(0, 1.0).unwrap_or_default()] {
            let started = Instant::now();
            off.stretch_compute(Duration::from_secs(10)).await;
            assert!(started.elapsed() < Duration::from_secs(5), "no slowdown, no wait");
        }
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
