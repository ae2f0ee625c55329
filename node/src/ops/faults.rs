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
//!   pushed gradients are scaled, sign-flipped, random, zero (a free-rider),
//!   stale by a number of steps, or its first gradient replayed (a bad
//!   peer, for the robust-aggregation tests and `shoal bench robust`).

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
    /// Push zeros: a free-rider that contributes nothing.
    Zeros,
    /// Push the gradient this node computed this many steps before (zeros
    /// until it has one): honest work, delivered late.
    Stale(u32),
    /// Push the first gradient this node computed, again at every step.
    Replay,
    /// A free-rider that computes nothing useful and pushes a copy of the
    /// last update the owners applied (recovered from the pulled model).
    Copy,
    /// Coordinated ("a little is enough", Baruch et al., 2019): every bad
    /// peer pushes the same vector, the last applied update less this many
    /// times its per-coordinate spread (the moving deviation of the applied
    /// updates from step to step). All of it comes from the model every
    /// worker pulls, so the bad peers agree without talking.
    Alie(f32),
}

/// The gradients a [`Byzantine`] node kept for the attacks that push old
/// ones (`stale:K`, `replay`).
#[derive(Debug, Default)]
pub struct AttackMemory {
    past: std::collections::VecDeque<Vec<f32>>,
    first: Option<Vec<f32>>,
    /// `copy` and `alie`: the model last pulled, the update the owners
    /// applied to reach it (per unit of learning rate), and the moving mean
    /// square of that update's change from step to step.
    model: Option<Vec<f32>>,
    update: Option<Vec<f32>>,
    spread: Vec<f32>,
}

/// The weight of each new step in `alie`'s moving spread.
const SPREAD_WEIGHT: f32 = 0.1;

impl AttackMemory {
    /// A model pulled after a round applied at learning rate `lr`.
    fn observe(&mut self, params: &[f32], lr: f32) {
        if let Some(prev) = self.model.as_ref().filter(|p| p.len() == params.len() && lr > 0.0) {
            let update: Vec<f32> = prev.iter().zip(params).map(|(a, b)| (a - b) / lr).collect();
            if let Some(last) = self.update.as_ref().filter(|u| u.len() == update.len()) {
                if self.spread.len() != update.len() {
                    self.spread = vec![0.0; update.len()];
                }
                for ((s, u), l) in self.spread.iter_mut().zip(&update).zip(last) {
                    *s = (1.0 - SPREAD_WEIGHT) * *s + SPREAD_WEIGHT * (u - l) * (u - l);
                }
            }
            self.update = Some(update);
        }
        match self.model.as_mut() {
            Some(m) if m.len() == params.len() => m.copy_from_slice(params),
            _ => self.model = Some(params.to_vec()),
        }
    }
}

impl Byzantine {
    /// Builds its pushes from the models it pulls (`copy`, `alie`): the
    /// worker hands each one to [`Faults::observe_model`].
    pub fn watches_model(&self) -> bool {
        matches!(self, Byzantine::Copy | Byzantine::Alie(_))
    }

    /// Corrupts the gradient of `step` in place (deterministic per step);
    /// `memory` keeps what the attacks on old gradients need.
    pub fn corrupt(&self, step: u64, grads: &mut [f32], memory: &mut AttackMemory) {
        match *self {
            Byzantine::None => {}
            Byzantine::Zeros => grads.fill(0.0),
            Byzantine::Stale(k) => {
                memory.past.push_back(grads.to_vec());
                if memory.past.len() > k as usize {
                    let old = memory.past.pop_front().unwrap_or_default();
                    grads.copy_from_slice(&old);
                } else {
                    grads.fill(0.0);
                }
            }
            Byzantine::Replay => {
                let first = memory.first.get_or_insert_with(|| grads.to_vec());
                grads.copy_from_slice(first);
            }
            Byzantine::Copy => match memory.update.as_ref().filter(|u| u.len() == grads.len()) {
                Some(u) => grads.copy_from_slice(u),
                None => grads.fill(0.0),
            },
            Byzantine::Alie(z) => match memory.update.as_ref().filter(|u| u.len() == grads.len()) {
                Some(u) => {
                    let spread = memory.spread.iter().chain(std::iter::repeat(&0.0));
                    grads.iter_mut().zip(u).zip(spread).for_each(|((g, u), s)| *g = u - z * s.sqrt());
                }
                None => grads.fill(0.0),
            },
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
            "zeros" => Ok(Byzantine::Zeros),
            "replay" => Ok(Byzantine::Replay),
            "copy" => Ok(Byzantine::Copy),
            other => {
                let usage = || {
                    format!(
                        "fault_byzantine `{other}`: use none, scale:F, sign_flip, random, zeros, stale:K (K from 1 to \
                         {MAX_STALE}), replay, copy or alie:Z"
                    )
                };
                if let Some(z) = other.strip_prefix("alie:") {
                    return match z.trim().parse::<f32>() {
                        Ok(z) if z.is_finite() => Ok(Byzantine::Alie(z)),
                        _ => Err(usage()),
                    };
                }
                if let Some(k) = other.strip_prefix("stale:") {
                    return match k.trim().parse::<u32>() {
                        Ok(k) if (1..=MAX_STALE).contains(&k) => Ok(Byzantine::Stale(k)),
                        _ => Err(usage()),
                    };
                }
                match other.strip_prefix("scale:").map(|f| f.trim().parse::<f32>()) {
                    Some(Ok(f)) if f.is_finite() => Ok(Byzantine::Scale(f)),
                    _ => Err(usage()),
                }
            }
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
            Byzantine::Zeros => write!(f, "zeros"),
            Byzantine::Stale(k) => write!(f, "stale:{k}"),
            Byzantine::Replay => write!(f, "replay"),
            Byzantine::Copy => write!(f, "copy"),
            Byzantine::Alie(z) => write!(f, "alie:{z}"),
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

/// The most steps a `stale:K` attacker holds its gradients back (it keeps
/// K of them).
pub const MAX_STALE: u32 = 1000;

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
    /// What a Byzantine worker keeps of its old gradients.
    attack: Mutex<AttackMemory>,
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

    /// A model this node pulled, after a round the owners applied at
    /// learning rate `lr`: what `copy` and `alie` build their pushes from.
    pub fn observe_model(&self, byzantine: Byzantine, params: &[f32], lr: f32) {
        if byzantine.watches_model() {
            let mut memory = self.attack.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            memory.observe(params, lr);
        }
    }

    /// This node's gradient of `step` as `byzantine` pushes it (in place).
    pub fn corrupt(&self, byzantine: Byzantine, step: u64, grads: &mut [f32]) {
        if byzantine != Byzantine::None {
            let mut memory = self.attack.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            byzantine.corrupt(step, grads, &mut memory);
        }
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
    fn the_attacks_on_old_gradients_push_what_they_kept() {
        let grad = |step: u64| vec![step as f32 + 1.0; 3];
        let mut memory = AttackMemory::default();
        let pushed: Vec<f32> = (0..4)
            .map(|step| {
                let mut g = grad(step);
                Byzantine::Stale(2).corrupt(step, &mut g, &mut memory);
                g[0]
            })
            .collect();
        assert_eq!(pushed, [0.0, 0.0, 1.0, 2.0], "zeros, then the gradient of 2 steps before");
        let mut memory = AttackMemory::default();
        for step in 0..3 {
            let mut g = grad(step);
            Byzantine::Replay.corrupt(step, &mut g, &mut memory);
            assert_eq!(g, grad(0), "the first gradient at step {step}");
        }
        let mut g = grad(5);
        Byzantine::Zeros.corrupt(5, &mut g, &mut AttackMemory::default());
        assert_eq!(g, [0.0; 3]);
    }

    #[test]
    fn copy_and_alie_push_the_applied_update_from_the_pulled_models() {
        let mut memory = AttackMemory::default();
        let push = |b: Byzantine, memory: &mut AttackMemory| {
            let mut g = vec![9.0f32; 2];
            b.corrupt(0, &mut g, memory);
            g
        };
        assert_eq!(push(Byzantine::Copy, &mut memory), [0.0, 0.0], "no update seen yet: zeros");
        // Rounds applied at rate 0.5: updates (2, 4), then (4, 4).
        memory.observe(&[10.0, 10.0], 0.5);
        memory.observe(&[9.0, 8.0], 0.5);
        assert_eq!(push(Byzantine::Copy, &mut memory), [2.0, 4.0]);
        memory.observe(&[7.0, 6.0], 0.5);
        assert_eq!(push(Byzantine::Copy, &mut memory), [4.0, 4.0]);
        // The spread: 0.1 of the squared change (2, 0).
        let g = push(Byzantine::Alie(1.0), &mut memory);
        assert!((g[0] - (4.0 - 0.4f32.sqrt())).abs() < 1e-6 && g[1] == 4.0, "{g:?}");
    }

    #[test]
    fn a_bad_attack_is_refused_naming_every_kind() {
        for bad in ["stale:0", "stale:x", "stale:1001", "scale:nan", "alie:inf", "alie", "evil"] {
            let e = bad.parse::<Byzantine>().expect_err(bad);
            assert!(e.contains("stale:K"), "{e}");
        }
    }

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
        for s in ["none", "scale:100", "sign_flip", "random", "zeros", "stale:3", "replay", "copy", "alie:1.5"] {
            assert_eq!(s.parse::<Byzantine>().map(|b| b.to_string()), Ok(s.to_string()));
        }
        assert!("scale:x".parse::<Byzantine>().is_err() && "evil".parse::<Byzantine>().is_err());
        let honest = vec![3.0f32, -4.0, 0.0, 12.0];
        let after = |b: Byzantine| {
            let mut g = honest.clone();
            b.corrupt(7, &mut g, &mut AttackMemory::default());
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
