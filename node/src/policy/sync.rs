//! Sync policies and the pure core of a shard owner.
//!
//! [`ShardCore`] holds one shard's parameters, optimizer state and version,
//! accepts gradient pushes and decides when a worker's pull may be answered.
//! It has no clock, no I/O and no channels: time comes in as an argument
//! (milliseconds), so the same inputs always give the same outputs and the
//! policy can be simulated with many workers in a unit test.
//!
//! Clocks: a worker's clock is the number of its pushes this shard accepted.
//! A worker that has pushed step `c` pulls before computing step `c + 1`; the
//! pull is held until `clock(w) - min_clock <= bound(w)`:
//! - BSP: all pushes of one round are averaged (weighted by samples) into
//!   ONE optimizer step, so N workers equal one node on the concatenated
//!   batch; a pull waits for the version after its round (no clock bound),
//!   and a round open longer than the round timeout is applied with what
//!   it has.
//! - SSP(s): bound `s`; each push is applied on arrival as its own step.
//! - DSSP([lo, hi]): bound `lo + r`, where `r <= hi - lo` is predicted from the
//!   measured iteration times so that the fast worker syncs just as the
//!   slowest one arrives (Zhao et al., DSSP).
//! - ASP: no bound.
//!
//! The staleness recorded for a push is the pusher's clock lead over the
//! slowest worker when the push arrives; owners keep the largest one seen.
//!
//! Robustness ([`crate::policy::robust`]): a BSP round is combined with the
//! owner's rule (mean, trimmed mean, median or centered clipping) after the
//! norm check has dropped its outliers; the other policies run the norm
//! check against a sliding window of accepted pushes. A rejected push is
//! acknowledged like any other (its clock moves, so a bad worker cannot
//! stall the others) and dropped, and the owner reports it (see
//! [`ShardCore::take_rejections`]).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use shoal_models::{Optimizer, OptimizerState};

use crate::policy::compress::PushCompression;
use crate::policy::contribution::Contribution;
use crate::policy::delta::{DeltaLog, ShardDelta};
use crate::policy::robust::{self, Aggregation, Agreement, NormWindow, Robust};
use crate::policy::schedule::LrSchedule;

/// Rejections in a row after which a worker is reported as a suspect.
pub const SUSPECT_AFTER: u32 = 3;

/// A contribution the norm check or the contribution check dropped.
#[derive(Debug, Clone, PartialEq)]
pub struct Rejection<K> {
    pub worker: K,
    /// The gradient's L2 norm.
    pub norm: f32,
    /// The median norm it was compared with (of the round or the window;
    /// 0 with the norm check off).
    pub median: f32,
    /// Left out by the contribution check: the worker's moving agreement
    /// with the rounds' aggregates. `None`: dropped by the norm check.
    pub agreement: Option<f32>,
    /// This worker's rejections in a row, this one included.
    pub streak: u32,
    /// Dropped as a repeat: its norm equals, bit for bit, the norm of one
    /// of this worker's last [`REPEAT_MEMORY`] pushes (a replayed gradient).
    pub repeat: bool,
}

/// Pushes per worker whose norms the repeat check remembers.
pub const REPEAT_MEMORY: usize = 16;

impl<K> Rejection<K> {
    /// Rejected [`SUSPECT_AFTER`] times in a row or more.
    pub fn suspect(&self) -> bool {
        self.streak >= SUSPECT_AFTER
    }
}

/// How far workers may drift apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum SyncPolicy {
    Bsp,
    Ssp { staleness: u64 },
    Dssp { lo: u64, hi: u64 },
    Asp,
}

impl SyncPolicy {
    /// The largest clock lead this policy can ever allow (`None`: unbounded).
    pub fn max_bound(&self) -> Option<u64> {
        match *self {
            SyncPolicy::Bsp => Some(0),
            SyncPolicy::Ssp { staleness } => Some(staleness),
            SyncPolicy::Dssp { hi, .. } => Some(hi),
            SyncPolicy::Asp => None,
        }
    }

    /// The owners' policy when every worker computes one step ahead of its
    /// exchanges (`sync.overlap`): the same policy with its clock bound
    /// one lower. A pipelined worker computes step t+1 on the parameters it
    /// pulled after step t-1, one step staler than without overlap; the
    /// tighter gate on that pull keeps the parameters it computes on within
    /// the configured bound. `None` where there is no step to give:
    /// BSP (the next forward pass needs the round's new version), `ssp:0`
    /// and `dssp` with `lo = 0`.
    pub fn pipelined(&self) -> Option<SyncPolicy> {
        match *self {
            SyncPolicy::Ssp { staleness } if staleness >= 1 => Some(SyncPolicy::Ssp { staleness: staleness - 1 }),
            SyncPolicy::Dssp { lo, hi } if lo >= 1 => Some(SyncPolicy::Dssp { lo: lo - 1, hi: hi - 1 }),
            SyncPolicy::Asp => Some(SyncPolicy::Asp),
            _ => None,
        }
    }

    /// The oldest version a worker may pull after its push was accepted at
    /// `accepted` (the owner's version then). BSP: the version after the
    /// round the push joined. The other policies gate pulls on clocks, not
    /// versions: 0.
    pub fn pull_after_push(&self, accepted: u64) -> u64 {
        match self {
            SyncPolicy::Bsp => accepted.saturating_add(1),
            _ => 0,
        }
    }
}

impl FromStr for SyncPolicy {
    type Err = String;
    /// `bsp`, `ssp:2`, `dssp:1-4`, `asp`.
    fn from_str(s: &str) -> Result<Self, String> {
        let lower = s.trim().to_ascii_lowercase();
        let (name, arg) = lower.split_once(':').map_or((lower.as_str(), None), |(n, a)| (n, Some(a)));
        let num =
            |a: &str| a.trim().parse::<u64>().map_err(|_| format!("`{a}` is not a whole number in sync policy `{s}`"));
        match (name, arg) {
            ("bsp", None) => Ok(SyncPolicy::Bsp),
            ("asp", None) => Ok(SyncPolicy::Asp),
            ("ssp", Some(a)) => Ok(SyncPolicy::Ssp { staleness: num(a)? }),
            ("dssp", Some(a)) => {
                let (lo, hi) =
                    a.split_once('-').ok_or_else(|| format!("dssp needs a range like dssp:1-4, got `{s}`"))?;
                let (lo, hi) = (num(lo)?, num(hi)?);
                if lo > hi {
                    return Err(format!("dssp range {lo}-{hi} is reversed"));
                }
                Ok(SyncPolicy::Dssp { lo, hi })
            }
            _ => Err(format!("unknown sync policy `{s}`: expected bsp, ssp:N, dssp:LO-HI or asp")),
        }
    }
}

impl fmt::Display for SyncPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SyncPolicy::Bsp => write!(f, "bsp"),
            SyncPolicy::Ssp { staleness } => write!(f, "ssp:{staleness}"),
            SyncPolicy::Dssp { lo, hi } => write!(f, "dssp:{lo}-{hi}"),
            SyncPolicy::Asp => write!(f, "asp"),
        }
    }
}

impl From<SyncPolicy> for String {
    fn from(p: SyncPolicy) -> String {
        p.to_string()
    }
}

impl TryFrom<String> for SyncPolicy {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

/// What happened to a push.
#[derive(Debug, Clone, PartialEq)]
pub enum PushOutcome {
    /// Taken; `staleness` is the pusher's lead over the slowest worker.
    Accepted { version: u64, staleness: u64 },
    /// BSP only: computed against an old version; the worker must pull.
    Stale { current_version: u64 },
    /// The pusher is not in the roster.
    UnknownWorker,
    /// Gradient length differs from the shard.
    BadLength { expected: usize, got: usize },
}

#[derive(Debug, Clone, Default)]
struct WorkerClock {
    clock: u64,
    last_push_ms: Option<u64>,
    /// Exponential moving average of the time between pushes.
    iter_ms: Option<f64>,
    /// Samples behind the worker's latest push.
    last_samples: Option<u32>,
}

/// One shard as its owner holds it.
#[derive(Debug)]
pub struct ShardCore<K: Ord + Clone + fmt::Debug> {
    params: Vec<f32>,
    optimizer: Optimizer,
    version: u64,
    policy: SyncPolicy,
    workers: BTreeMap<K, WorkerClock>,
    /// BSP round in progress: (samples, gradient) per worker.
    round: BTreeMap<K, (u32, Contribution)>,
    /// When the BSP round in progress got its first gradient (ms).
    round_opened_ms: Option<u64>,
    max_staleness: u64,
    /// The learning rate by step; `None` keeps the optimizer's own rate.
    schedule: Option<LrSchedule>,
    robust: Robust,
    /// Accepted push norms (SSP, DSSP, ASP).
    window: NormWindow,
    /// Rejections in a row, per worker.
    streaks: BTreeMap<K, u32>,
    /// The bits of each worker's last [`REPEAT_MEMORY`] nonzero push norms
    /// (norm check on): the repeat check.
    recent_norms: BTreeMap<K, std::collections::VecDeque<u32>>,
    /// Each worker's moving agreement with the rounds' aggregates (BSP,
    /// contribution check on).
    agreement: BTreeMap<K, Agreement>,
    /// Rejections not yet taken by the owner.
    rejections: Vec<Rejection<K>>,
    /// The last round's median gradient norm (BSP, norm check on).
    round_median_norm: Option<f32>,
    /// BSP, restored from an older copy: how far a worker's newer base may
    /// still move the numbering ([`ShardCore::mark_restored`]); 0 once a full
    /// round has been applied, and always for a core that was handed over.
    catch_up_room: u64,
    /// BSP: restored from an older copy and no full round applied since
    /// ([`ShardCore::yields_to`]).
    provisional: bool,
    /// Versions taken up by catch-up without an optimizer step.
    skipped: u64,
    /// BSP: a round is applied once all but this many workers pushed.
    backup: usize,
    /// Catch-up is skipped ([`ShardCore::without_catch_up`]): set only by
    /// the schedule explorer's test, to show the cycle catch-up prevents.
    catch_up_disabled: bool,
    /// Delta pulls ([`ShardCore::with_delta`]): each step's update as sent.
    delta: Option<DeltaLog>,
    /// Elements visited since [`ShardCore::take_work`] last took them.
    work: Work,
}

/// What a core's rounds cost in passes over its shard: every element each
/// loop over the shard, a push or the update visits (a sparse push's kept
/// entries only), counted where the loop runs.
#[derive(Debug, Clone, Copy, Default)]
struct Work {
    /// Elements visited in the round in progress.
    open: u64,
    /// Steps taken, and the elements visited for them.
    steps: u64,
    visited: u64,
}

impl<K: Ord + Clone + fmt::Debug> ShardCore<K> {
    pub fn new(
        params: Vec<f32>,
        optimizer: Optimizer,
        version: u64,
        policy: SyncPolicy,
        roster: impl IntoIterator<Item = K>,
    ) -> Self {
        Self {
            params,
            optimizer,
            version,
            policy,
            workers: roster.into_iter().map(|k| (k, WorkerClock::default())).collect(),
            round: BTreeMap::new(),
            round_opened_ms: None,
            max_staleness: 0,
            schedule: None,
            robust: Robust {
                aggregation: robust::Aggregation::Mean,
                norm_check: 0.0,
                norm_floor: 0.0,
                min_agreement: None,
            },
            window: NormWindow::default(),
            streaks: BTreeMap::new(),
            recent_norms: BTreeMap::new(),
            agreement: BTreeMap::new(),
            rejections: Vec::new(),
            round_median_norm: None,
            catch_up_room: 0,
            provisional: false,
            skipped: 0,
            backup: 0,
            catch_up_disabled: false,
            delta: None,
            work: Work::default(),
        }
    }

    /// Delta pulls (`local_steps.delta`): every step's update is sent as
    /// `compression` encodes it, and the shard moves by exactly that
    /// ([`DeltaLog::record`]); [`ShardCore::delta_from`] serves it.
    pub fn with_delta(mut self, compression: Option<PushCompression>) -> Self {
        self.delta = compression.map(DeltaLog::new);
        self
    }

    /// The update from version `have` to the current one, if this core
    /// made it (one step, taken here since the core was built).
    pub fn delta_from(&self, have: u64) -> Option<Arc<ShardDelta>> {
        self.delta.as_ref()?.from(have, self.version)
    }

    /// BSP with backup workers (Chen et al. 2016): a round is applied once
    /// all but `backup` of the workers have pushed, and always waits for at
    /// least one. A push for a round applied without it is `Stale`.
    pub fn with_backup_workers(mut self, backup: usize) -> Self {
        self.backup = backup;
        self
    }

    /// BSP: how many pushes close a round.
    fn quorum(&self) -> usize {
        self.workers.len().saturating_sub(self.backup).max(1)
    }

    /// BSP: the round in progress holds a push of every worker (all but
    /// `backup` of them).
    fn round_complete(&self) -> bool {
        !self.round.is_empty() && self.round.len() >= self.quorum()
    }

    /// This core was restored from a copy that may be older than the
    /// workers' models (a replica, a stored transfer, the worker copy):
    /// until its first full BSP round, a push against a version up to
    /// `room` ahead moves the numbering there ([`ShardCore::push`]). The
    /// room bounds what one bad worker's made-up base can do, and only a
    /// restored core, not one handed over live or one that met another
    /// lineage after a partition, takes up a worker's numbering.
    pub fn mark_restored(&mut self, room: u64) {
        self.catch_up_room = room;
        self.provisional = true;
    }

    /// BSP: a copy of this shard handed over live at `version` replaces this
    /// one rather than being fenced. This core was restored from an older
    /// copy and has applied no full round since: its number may have been
    /// taken up from the workers ([`ShardCore::take_up`]) over parameters
    /// that lack the rounds it stands for, while the handed-over copy has
    /// them. That copy was still on its way when this node restored the
    /// shard: a leaver's transfer passed on by a third node, or an owner
    /// this node's view never named (the schedule explorer's finding 6).
    /// A newer copy replaces any core; an older one never does.
    pub fn yields_to(&self, version: u64) -> bool {
        version > self.version || (version == self.version && self.policy == SyncPolicy::Bsp && self.provisional)
    }

    /// The catch-up room of a restored BSP core that has not closed a round
    /// (it travels with the core's transfer, `Handoff::catch_up_room`); 0
    /// for a settled core (a full round zeroes the room as it settles it).
    pub fn restore_room(&self) -> u64 {
        self.catch_up_room
    }

    /// BSP: the round in progress moves into `other`, the copy of the same
    /// version replacing this core ([`ShardCore::yields_to`]): its pushes
    /// were made against that number, and their workers wait for the next.
    /// A copy of another version takes nothing: pushes against an older
    /// number are `Stale` there.
    pub fn hand_round_to(&mut self, other: &mut Self) {
        if other.version == self.version && other.round.is_empty() {
            other.round = std::mem::take(&mut self.round);
            other.round_opened_ms = self.round_opened_ms.take();
        }
    }

    /// Test only: never catch up (`catch_up` is skipped and a
    /// newer base joins the round in progress, as before issue 16), so the
    /// schedule explorer can show the restore cycle it finds without it.
    #[cfg(test)]
    pub(crate) fn without_catch_up(mut self) -> Self {
        self.catch_up_disabled = true;
        self
    }

    /// Combine rounds with `robust.aggregation` after the norm check (BSP),
    /// or run the norm check on each push (the other policies). Without
    /// this, the core takes the plain mean and checks nothing.
    pub fn with_robust(mut self, robust: Robust) -> Self {
        self.robust = robust;
        self
    }

    /// The median gradient norm of the last round (BSP) or of the window of
    /// accepted pushes (the other policies); `None` with the norm check off
    /// or before the first gradient.
    pub fn median_norm(&self) -> Option<f32> {
        match self.policy {
            SyncPolicy::Bsp => self.round_median_norm,
            _ => Some(self.window.median()).filter(|m| *m > 0.0),
        }
    }

    /// The contributions rejected since the last call.
    pub fn take_rejections(&mut self) -> Vec<Rejection<K>> {
        std::mem::take(&mut self.rejections)
    }

    /// Records whether `worker`'s contribution passed; `agreement`: left
    /// out by the contribution check, with this moving agreement.
    fn judge(&mut self, worker: &K, passed: bool, norm: f32, median: f32, agreement: Option<f32>, repeat: bool) {
        if passed {
            self.streaks.remove(worker);
            return;
        }
        let streak = self.streaks.entry(worker.clone()).or_default();
        *streak += 1;
        let streak = *streak;
        self.rejections.push(Rejection { worker: worker.clone(), norm, median, agreement, streak, repeat });
    }

    /// Whether `norm` repeats, bit for bit, the norm of one of `worker`'s
    /// last [`REPEAT_MEMORY`] pushes; remembers it. An honest worker's
    /// gradients differ from step to step (another batch, another model),
    /// and so do their norms; a replayed gradient has its first push's
    /// norm every time. Zero (a shard no sample touched) is never a repeat.
    fn repeats(&mut self, worker: &K, norm: f32) -> bool {
        if norm == 0.0 {
            return false;
        }
        let seen = self.recent_norms.entry(worker.clone()).or_default();
        let repeat = seen.contains(&norm.to_bits());
        if seen.len() == REPEAT_MEMORY {
            seen.pop_front();
        }
        seen.push_back(norm.to_bits());
        repeat
    }

    /// Follow `schedule`: before each optimizer step the rate is set for the
    /// step this version stands for (BSP: the version, one per round; the
    /// other policies apply every push, so the version over the number of
    /// workers). It follows versions, not time, so a shard handed over or
    /// restored from a checkpoint continues the schedule where it was.
    pub fn with_schedule(mut self, schedule: LrSchedule) -> Self {
        self.schedule = schedule.varies().then_some(schedule);
        self
    }

    /// The step the next optimizer step stands for, in the schedule.
    pub fn schedule_step(&self) -> u64 {
        match self.policy {
            SyncPolicy::Bsp => self.version,
            _ => self.version / self.workers.len().max(1) as u64,
        }
    }

    /// One optimizer step at the scheduled rate; the version moves on when it is taken.
    fn step(&mut self, grad: &[f32]) {
        if let Some(s) = self.schedule {
            // The schedule's rates are finite and positive (the floor is
            // base / 100), so this cannot be refused.
            let _ = self.optimizer.set_lr(s.lr_at(self.schedule_step()));
        }
        let len = self.params.len() as u64;
        let before = self.delta.as_ref().map(|_| self.params.clone());
        // The clone, then the optimizer's one fused loop.
        self.work.open += len * u64::from(before.is_some()) + len;
        if self.optimizer.step(&mut self.params, grad).is_ok() {
            self.version += 1;
            if let (Some(log), Some(before)) = (self.delta.as_mut(), before) {
                self.work.open += log.record(&before, &mut self.params, self.version);
            }
        }
        self.work.steps += 1;
        self.work.visited += std::mem::take(&mut self.work.open);
    }

    /// The steps taken since the last call, and their passes over the
    /// shard in all: every loop the owner ran for them (taking each push
    /// in, norms, combining, the optimizer, the delta's encoding), each
    /// element it visited counted once, over the shard's length.
    pub fn take_work(&mut self) -> (u64, f64) {
        let Work { steps, visited, .. } = self.work;
        self.work.steps = 0;
        self.work.visited = 0;
        (steps, visited as f64 / self.params.len().max(1) as f64)
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    pub fn params(&self) -> &[f32] {
        &self.params
    }

    pub fn optimizer_state(&self) -> &OptimizerState {
        self.optimizer.state()
    }

    pub fn policy(&self) -> SyncPolicy {
        self.policy
    }

    /// Largest staleness accepted so far.
    pub fn max_staleness(&self) -> u64 {
        self.max_staleness
    }

    pub fn clock(&self, worker: &K) -> Option<u64> {
        self.workers.get(worker).map(|w| w.clock)
    }

    /// How many workers push to this shard.
    pub fn worker_count(&self) -> usize {
        self.workers.len()
    }

    fn min_clock(&self) -> u64 {
        self.workers.values().map(|w| w.clock).min().unwrap_or(0)
    }

    /// Accept a gradient from `worker`, computed against `base_version`.
    /// The gradient is taken by value: BSP keeps it for the round and the
    /// asynchronous policies scale it in place, so no copy is made.
    pub fn push(
        &mut self,
        worker: &K,
        base_version: u64,
        samples: u32,
        grad: impl Into<Contribution>,
        now_ms: u64,
    ) -> PushOutcome {
        let mut grad = grad.into();
        if grad.len() != self.params.len() {
            return PushOutcome::BadLength { expected: self.params.len(), got: grad.len() };
        }
        // Taken in: the decode on arrival.
        self.work.open += grad.stored() as u64;
        let min_before = self.min_clock();
        let Some(w) = self.workers.get(worker) else { return PushOutcome::UnknownWorker };
        let lead = w.clock.saturating_sub(min_before);
        if self.policy == SyncPolicy::Bsp {
            self.take_up(base_version);
            // An older base missed a round.
            if base_version < self.version {
                return PushOutcome::Stale { current_version: self.version };
            }
            if self.round.contains_key(worker) {
                // A retry of a push we already hold: idempotent.
                return PushOutcome::Accepted { version: self.version, staleness: lead };
            }
            if self.round.is_empty() {
                self.round_opened_ms = Some(now_ms);
            }
            self.round.insert(worker.clone(), (samples.max(1), std::mem::take(&mut grad)));
        }
        if let Some(w) = self.workers.get_mut(worker) {
            w.clock += 1;
            if let Some(last) = w.last_push_ms {
                let dt = now_ms.saturating_sub(last) as f64;
                w.iter_ms = Some(w.iter_ms.map_or(dt, |m| 0.7 * m + 0.3 * dt));
            }
            w.last_push_ms = Some(now_ms);
            w.last_samples = Some(samples.max(1));
        }
        self.max_staleness = self.max_staleness.max(lead);
        let version = self.version;
        match self.policy {
            SyncPolicy::Bsp => {
                if self.round_complete() {
                    self.apply_round();
                    // A quorum of the workers (all of them without backup
                    // workers) pushed here: the numbering is settled.
                    self.catch_up_room = 0;
                    self.provisional = false;
                }
            }
            _ => {
                // Asynchronous policies: every push is its own optimizer step,
                // weighted by its share of one round's samples (n_i / sum of
                // every worker's latest n), so one push from each worker adds
                // up to BSP's sample-weighted mean. Lengths were checked above,
                // so the step cannot fail on size.
                let (k, floor) = (self.robust.norm_check, self.robust.norm_floor);
                let checks = self.robust.checks_norms();
                let len = self.params.len() as u64;
                // Densified if sparse, the norm, the weighting.
                self.work.open += len * (u64::from(grad.stored() < grad.len()) + u64::from(checks) + 1);
                let mut grad = grad.into_dense();
                if checks {
                    let n = robust::norm(&grad);
                    let repeat = self.repeats(worker, n);
                    let (passed, median) =
                        if repeat { (false, self.window.median()) } else { self.window.admit(n, k, floor) };
                    self.judge(worker, passed, n, median, None, repeat);
                    if !passed {
                        return PushOutcome::Accepted { version, staleness: lead };
                    }
                }
                let total: u64 = self.workers.values().map(|w| w.last_samples.unwrap_or(samples.max(1)) as u64).sum();
                let weight = samples.max(1) as f32 / total.max(1) as f32;
                grad.iter_mut().for_each(|g| *g *= weight);
                self.step(&grad);
            }
        }
        PushOutcome::Accepted { version, staleness: lead }
    }

    /// BSP: a worker pushed against `version`, newer than this core's. This
    /// owner was restored from a replica older than the workers' copies
    /// (the loss bound of `replica_every`): every round before `version`
    /// was applied by the owner that was lost, since the worker pulled its
    /// result. Numbering jumps to `version`, so that the round in progress
    /// is the one every worker's next push is for. Without the jump a
    /// restored round held pushes of two different steps: workers whose
    /// last answer from the lost owner was missing re-pushed their old step
    /// while the others pushed the next one, and two restored shards could
    /// each wait for a worker held by the other's round, a cycle only the
    /// round timeout broke. A round held here is applied first: those
    /// gradients are for rounds the lost owner applied, and the workers
    /// that pushed them are waiting for a version past it. The parameters
    /// stay the replica's.
    fn catch_up(&mut self, version: u64) {
        if !self.round.is_empty() {
            self.apply_round();
        }
        let jump = version.saturating_sub(self.version);
        self.catch_up_room = self.catch_up_room.saturating_sub(jump);
        self.skipped += jump;
        self.version += jump;
    }

    /// BSP, restored from an older copy: a worker holds `version` of this
    /// shard (it pushed against it, or its heartbeat says so), so the owner
    /// that was lost applied every round before it. Takes the numbering up
    /// to it ([`ShardCore::catch_up`]) within the restore's room. A push is
    /// not always coming: when the workers that got the lost owner's newest
    /// versions of different shards wait on each other's shards, no push
    /// carries the newer base, and each restored round waits for a worker
    /// the other holds (the schedule explorer's finding 3): the aggregator
    /// then calls this with the newest version a live worker's heartbeat
    /// names. Returns whether the numbering moved.
    pub fn take_up(&mut self, version: u64) -> bool {
        let ahead = version > self.version && version - self.version <= self.catch_up_room;
        if self.policy != SyncPolicy::Bsp || self.catch_up_disabled || !ahead {
            return false;
        }
        self.catch_up(version);
        true
    }

    /// Versions taken up by catch-up without an optimizer step: how far
    /// the number runs ahead of the parameters' own steps (logged by the
    /// aggregator). Transfers are fenced on [`ShardCore::version`], as
    /// every owner compares them; a copy's skip does not travel with it.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// Replace the set of workers (the live members of the view). Workers
    /// that left are dropped, with any gradient they put into the BSP round;
    /// new ones start at the slowest clock so they are not counted as far
    /// behind. A BSP round that now has every remaining worker is applied.
    pub fn set_workers(&mut self, live: impl IntoIterator<Item = K>) {
        let live: std::collections::BTreeSet<K> = live.into_iter().collect();
        if live.is_empty() {
            return;
        }
        let min = self.min_clock();
        self.workers.retain(|k, _| live.contains(k));
        self.round.retain(|k, _| live.contains(k));
        self.streaks.retain(|k, _| live.contains(k));
        self.recent_norms.retain(|k, _| live.contains(k));
        if self.round.is_empty() {
            self.round_opened_ms = None;
        }
        for k in live {
            self.workers.entry(k).or_insert_with(|| WorkerClock { clock: min, ..WorkerClock::default() });
        }
        if self.policy == SyncPolicy::Bsp && self.round_complete() {
            self.apply_round();
            self.catch_up_room = 0;
            self.provisional = false;
        }
    }

    /// BSP: when the round in progress must be closed, given the round
    /// timeout (`None`: no round open).
    pub fn round_deadline_ms(&self, timeout_ms: u64) -> Option<u64> {
        self.round_opened_ms.map(|t| t.saturating_add(timeout_ms))
    }

    /// BSP: apply the round in progress with the gradients it has if it has
    /// been open `timeout_ms` or longer. Returns the workers it went
    /// without. The missing workers' pushes are then `Stale`: they pull the
    /// new version and join the next round. This bounds how long a round can
    /// wait for a worker that will not push into it (after a partition heals,
    /// workers can be a round apart on different shards and wait on each
    /// other in a cycle).
    pub fn close_overdue_round(&mut self, now_ms: u64, timeout_ms: u64) -> Option<Vec<K>> {
        let opened = self.round_opened_ms?;
        if self.policy != SyncPolicy::Bsp || self.round.is_empty() || now_ms.saturating_sub(opened) < timeout_ms {
            return None;
        }
        let missing = self.workers.keys().filter(|w| !self.round.contains_key(*w)).cloned().collect();
        self.apply_round();
        Some(missing)
    }

    /// The workers this shard waits for.
    pub fn workers(&self) -> impl Iterator<Item = &K> {
        self.workers.keys()
    }

    /// Everything a new owner needs: parameters, optimizer state, version.
    /// A BSP round in progress is not included: its workers push again to
    /// the new owner (see `worker::exchange`).
    pub fn export(&self) -> (Vec<f32>, OptimizerState, u64) {
        (self.params.clone(), self.optimizer.state().clone(), self.version)
    }

    /// Drop the round's norm outliers and the workers the contribution
    /// check leaves out, combine the rest with the aggregation rule (the
    /// mean: weighted by samples, in worker order, so every owner sums in
    /// the same order), score every gradient against the result (the
    /// contribution check) and take one step.
    fn apply_round(&mut self) {
        let round = std::mem::take(&mut self.round);
        self.round_opened_ms = None;
        let checks = self.robust.checks_norms();
        let norms: Vec<f32> = if checks { round.values().map(|(_, g)| g.norm()).collect() } else { Vec::new() };
        let stored: u64 = round.values().map(|(_, g)| g.stored() as u64).sum();
        self.work.open += stored * u64::from(checks);
        let mut outliers = robust::norm_outliers(&norms, self.robust.norm_check, self.robust.norm_floor);
        // Empty with the norm check off: no norms to compare.
        let repeats: Vec<usize> =
            round.keys().zip(&norms).enumerate().filter(|(_, (w, n))| self.repeats(w, **n)).map(|(i, _)| i).collect();
        outliers.extend(repeats.iter().copied());
        let median = (!norms.is_empty()).then(|| robust::median(&mut norms.clone()));
        if median.is_some() {
            self.round_median_norm = median;
        }
        let min_agreement = self.robust.min_agreement;
        // Left out on the agreement of the rounds before this one: at most
        // a third of the round, the lowest scores first, so that honest
        // workers who score low late in training never hand the round to
        // the ones who disagree on purpose.
        let mut excluded: Vec<Option<f32>> = round
            .keys()
            .map(|w| {
                let a = min_agreement.and_then(|m| self.agreement.get(w).filter(|a| a.below(m)));
                a.map(Agreement::score)
            })
            .collect();
        robust::keep_lowest(&mut excluded, round.len() / 3);
        if median.is_some() || min_agreement.is_some() {
            for (i, (w, (_, g))) in round.iter().enumerate() {
                let norm = norms.get(i).copied().unwrap_or_else(|| g.norm());
                let passed = !outliers.contains(&i) && excluded[i].is_none();
                self.judge(w, passed, norm, median.unwrap_or(0.0), excluded[i], repeats.contains(&i));
            }
        }
        let kept: Vec<(&Contribution, f32)> = round
            .values()
            .enumerate()
            .filter(|(i, _)| !outliers.contains(i) && excluded[*i].is_none())
            .map(|(_, (n, g))| (g, *n as f32))
            .collect();
        let len = self.params.len();
        let mut update = vec![0.0f32; len];
        self.work.open += len as u64;
        if !kept.is_empty() {
            self.work.open += combine(self.robust.aggregation, &kept, &mut update);
            if min_agreement.is_some() {
                // Every worker's, those left out included: one that comes
                // to agree again is let back in.
                for (w, (_, g)) in &round {
                    self.agreement.entry(w.clone()).or_default().observe(robust::agreement(&g.dense(), &update));
                }
                self.work.open += 3 * (len * round.len()) as u64;
            }
        }
        self.step(&update);
    }

    /// May `worker`, whose clock is `clock` on its side, be answered now?
    /// BSP also needs the round it pushed into to be applied.
    pub fn pull_ready(&self, worker: &K, min_version: u64, now_ms: u64) -> bool {
        if self.version < min_version {
            return false;
        }
        if self.policy == SyncPolicy::Bsp {
            // The version is the round: a worker asks for the version after
            // the round it pushed into, and that is all it must wait for.
            // Gating on clocks as well would make a worker that missed a
            // round hold up every other worker's pull until it catches up.
            return true;
        }
        let Some(w) = self.workers.get(worker) else {
            // Not a worker of ours (a reader, a joiner): serve what we have.
            return true;
        };
        let lead = w.clock.saturating_sub(self.min_clock());
        match self.bound_for(worker, now_ms) {
            None => true,
            Some(b) => lead <= b,
        }
    }

    /// BSP: a pull from `worker` for a version past this round, while the
    /// round does not hold the worker's gradient. Nothing would ever answer
    /// it but the round timeout: the gradient went into a core that this one
    /// replaced (the shard moved away and came back, its round left behind,
    /// while the worker's pull was on the wire). The worker must push again.
    pub fn lost_push(&self, worker: &K, min_version: u64) -> bool {
        self.policy == SyncPolicy::Bsp
            && min_version > self.version
            && self.workers.contains_key(worker)
            && !self.round.contains_key(worker)
    }

    /// The clock lead `worker` is allowed right now.
    pub fn bound_for(&self, worker: &K, now_ms: u64) -> Option<u64> {
        match self.policy {
            SyncPolicy::Bsp => Some(0),
            SyncPolicy::Ssp { staleness } => Some(staleness),
            SyncPolicy::Asp => None,
            SyncPolicy::Dssp { lo, hi } => Some(lo + self.dssp_extra(worker, hi - lo, now_ms)),
        }
    }

    /// DSSP's `r`: how many extra steps the fast worker can take before the
    /// slowest worker's next push is expected, capped at `max_r`. Without
    /// timing data yet, allow nothing extra.
    fn dssp_extra(&self, worker: &K, max_r: u64, now_ms: u64) -> u64 {
        let Some(me) = self.workers.get(worker).and_then(|w| w.iter_ms) else { return 0 };
        let min = self.min_clock();
        // The slowest worker's expected arrival: last push + its iteration time.
        let wait = self
            .workers
            .values()
            .filter(|w| w.clock == min)
            .filter_map(|w| Some(w.last_push_ms? as f64 + w.iter_ms? - now_ms as f64))
            .fold(f64::NEG_INFINITY, f64::max);
        if !wait.is_finite() || wait <= 0.0 || me <= 0.0 {
            return if wait.is_finite() { 0 } else { max_r };
        }
        ((wait / me).floor() as u64).min(max_r)
    }
}

/// Combines a round's kept gradients into `update` (zeros) with `rule`,
/// and returns the elements visited. The mean adds each push as it is held,
/// weighted by its samples, in worker order, so a sparse push costs its
/// kept entries and every owner sums in the same order; the rules that
/// sort coordinates read every push dense.
fn combine(rule: Aggregation, kept: &[(&Contribution, f32)], update: &mut [f32]) -> u64 {
    if rule == Aggregation::Mean {
        // As robust::combine's mean: the same weights, the same additions.
        let total: f64 = kept.iter().map(|(_, w)| f64::from(*w)).sum();
        for (g, w) in kept {
            g.add_scaled_into(update, (f64::from(*w) / total) as f32);
        }
        return kept.iter().map(|(g, _)| g.stored() as u64).sum();
    }
    let dense: Vec<_> = kept.iter().map(|(g, w)| (g.dense(), *w)).collect();
    let grads: Vec<(&[f32], f32)> = dense.iter().map(|(g, w)| (g.as_ref(), *w)).collect();
    robust::combine(rule, &grads, update);
    let densified = kept.iter().filter(|(g, _)| g.stored() < g.len()).count();
    (robust::passes(rule, kept.len()) + densified as u64) * update.len() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_models::{OptimizerConfig, OptimizerKind};

    fn sgd() -> Optimizer {
        sgd_of(2)
    }

    /// Plain SGD at rate 1 over `len` parameters.
    fn sgd_of(len: usize) -> Optimizer {
        let cfg = OptimizerConfig::Sgd { lr: 1.0, momentum: 0.0, nesterov: false, weight_decay: 0.0 };
        match Optimizer::new(cfg, len) {
            Ok(o) => o,
            Err(e) => panic!("{e}"),
        }
    }

    /// A shard that moves away and back within one round comes back as a
    /// new core without the round: a worker whose gradient was in the old
    /// round and whose pull reaches the new core is told to push again,
    /// instead of waiting for the round timeout.
    #[test]
    fn a_pull_for_a_round_that_lost_the_gradient_asks_for_it_again() {
        let ids = ["a", "b"];
        let mut core = ShardCore::new(vec![0.0, 0.0], sgd(), 5, SyncPolicy::Bsp, ids);
        assert!(matches!(core.push(&"a", 5, 1, vec![1.0, 1.0], 0), PushOutcome::Accepted { version: 5, .. }));
        assert!(!core.lost_push(&"a", 6), "a's gradient is in the round");
        assert!(!core.lost_push(&"b", 5), "b asks for a version that exists");
        let (params, state, version) = core.export();
        let optimizer = Optimizer::from_state(state).unwrap_or_else(|e| panic!("{e}"));
        let mut back = ShardCore::new(params, optimizer, version, SyncPolicy::Bsp, ids);
        assert!(back.lost_push(&"a", 6), "the new core's round does not hold a's gradient");
        assert!(!back.lost_push(&"z", 6), "not a worker of this shard");
        // a pushes again, the round completes, and the pull is answered.
        assert!(matches!(back.push(&"a", 5, 1, vec![1.0, 1.0], 0), PushOutcome::Accepted { .. }));
        assert!(!back.lost_push(&"a", 6));
        assert!(matches!(back.push(&"b", 5, 1, vec![3.0, 3.0], 0), PushOutcome::Accepted { .. }));
        assert_eq!(back.version(), 6);
        assert!(back.pull_ready(&"a", 6, 0));
        // Only BSP has rounds to lose.
        let ssp = ShardCore::new(vec![0.0, 0.0], sgd(), 5, SyncPolicy::Ssp { staleness: 1 }, ids);
        assert!(!ssp.lost_push(&"a", 6));
    }

    /// One worker's exchange with one shard, as `worker::exchange` runs it
    /// under BSP: push (again to a new owner), then pull the version after
    /// the round. `taken`: some owner has accepted this gradient.
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Exchange {
        Push { base: u64, taken: bool },
        Pull { base: u64, min: u64, taken: bool },
        Done(u64),
    }

    /// Workers `ws` exchange with the BSP cores in `cores`, visiting them in
    /// `order`, until each holds version `until` of every shard; the rules
    /// are those of `worker::exchange`. Returns the final versions, or the
    /// state in which nothing could move (rounds that only the round
    /// timeout would close).
    fn run_bsp(
        cores: &mut [ShardCore<usize>],
        ws: &mut [Vec<Exchange>],
        order: &[usize],
        until: u64,
    ) -> Result<Vec<u64>, String> {
        loop {
            let mut moved = false;
            for &w in order {
                for (s, core) in cores.iter_mut().enumerate() {
                    let next = match ws[w][s] {
                        Exchange::Push { base, taken } => match core.push(&w, base, 1, vec![0.5], 0) {
                            PushOutcome::Accepted { version, .. } => {
                                Exchange::Pull { base, min: version + 1, taken: true }
                            }
                            PushOutcome::Stale { current_version } if !taken => {
                                Exchange::Push { base: current_version, taken }
                            }
                            PushOutcome::Stale { current_version } => {
                                Exchange::Pull { base, min: current_version, taken }
                            }
                            other => return Err(format!("worker {w} shard {s}: {other:?}")),
                        },
                        Exchange::Pull { base, min, taken } if core.lost_push(&w, min) => {
                            Exchange::Push { base, taken }
                        }
                        Exchange::Pull { min, .. } if core.pull_ready(&w, min, 0) => Exchange::Done(core.version()),
                        e => e,
                    };
                    moved |= next != ws[w][s];
                    ws[w][s] = next;
                }
                let done: Option<Vec<u64>> =
                    ws[w].iter().map(|e| if let Exchange::Done(v) = e { Some(*v) } else { None }).collect();
                if let Some(versions) = done.filter(|v| v.iter().any(|&v| v < until)) {
                    // The next step: its gradient, pushed against what it holds.
                    ws[w] = versions.iter().map(|&v| Exchange::Push { base: v, taken: false }).collect();
                    moved = true;
                }
            }
            let finished = |w: &Vec<Exchange>| w.iter().all(|e| matches!(e, Exchange::Done(v) if *v >= until));
            if ws.iter().all(finished) {
                return Ok(cores.iter().map(|c| c.version()).collect());
            }
            if !moved {
                return Err(format!(
                    "stuck: versions {:?}, workers {ws:?}",
                    cores.iter().map(|c| c.version()).collect::<Vec<_>>()
                ));
            }
        }
    }

    /// The frozen-owner case (issue 16): an owner held shards 0 and 1 and
    /// was lost after applying round 419 -> 420 on both, with some answers
    /// still unsent. Worker 0 got both and pushed step 421; worker 1 got
    /// shard 0 and waits for shard 1; worker 2 the other way round. The new
    /// owners restore both from replicas at 416. Before the fix, shard 0's
    /// round waited for worker 1's next push, which waited for shard 1's
    /// round, which waited for worker 2's next push, which waited for shard
    /// 0's round: only the 10 s round timeout broke the cycle. In every
    /// order of arrival, all three now reach version 423 without it.
    #[test]
    fn owners_restored_from_an_older_replica_do_not_leave_rounds_waiting_in_a_cycle() {
        let orders = [[0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]];
        for order in orders {
            let mut cores: Vec<ShardCore<usize>> = (0..2)
                .map(|_| {
                    let mut core = ShardCore::new(vec![0.0], sgd_of(1), 416, SyncPolicy::Bsp, 0..3);
                    core.mark_restored(16);
                    core
                })
                .collect();
            let again = |base| Exchange::Push { base, taken: true };
            let mut ws = vec![
                vec![Exchange::Push { base: 420, taken: false }, Exchange::Push { base: 420, taken: false }],
                vec![Exchange::Done(420), again(419)],
                vec![again(419), Exchange::Done(420)],
            ];
            let versions = run_bsp(&mut cores, &mut ws, &order, 423).unwrap_or_else(|e| panic!("order {order:?}: {e}"));
            // Numbering follows the workers' copies, and both shards agree.
            assert_eq!(versions, vec![423, 423], "order {order:?}");
        }
    }

    /// A restored core takes up a worker's newer numbering, within its
    /// room and only until its first full round; the parameters stay the
    /// replica's, and `skipped` counts the versions taken up without a step.
    #[test]
    fn a_restored_core_takes_up_the_workers_numbering_within_its_room() {
        let mut core = ShardCore::new(vec![0.0, 0.0], sgd(), 10, SyncPolicy::Bsp, ["a", "b"]);
        core.mark_restored(8);
        // A made-up base beyond the room (a bad worker) moves nothing.
        assert!(matches!(core.push(&"a", 1_000_000, 1, vec![4.0, 0.0], 0), PushOutcome::Accepted { version: 10, .. }));
        assert_eq!(core.version(), 10);
        // b pushes against 13, three rounds the lost owner applied: a's
        // held gradient is applied as the round it was for, then the
        // numbering moves to 13 and b opens round 13.
        assert!(matches!(core.push(&"b", 13, 1, vec![2.0, 2.0], 0), PushOutcome::Accepted { version: 13, .. }));
        assert_eq!(core.params(), &[-4.0, 0.0]);
        assert_eq!((core.version(), core.skipped()), (13, 2));
        // a's push for the round it already joined (base 10) is stale now.
        assert_eq!(core.push(&"a", 10, 1, vec![4.0, 0.0], 0), PushOutcome::Stale { current_version: 13 });
        assert!(core.pull_ready(&"a", 11, 0), "a's wait for the round after its gradient is over");
        assert!(matches!(core.push(&"a", 13, 1, vec![0.0, 2.0], 0), PushOutcome::Accepted { version: 13, .. }));
        assert_eq!((core.version(), core.params()), (14, &[-5.0f32, -2.0][..]));
        // A full round settled the numbering: a newer base joins the round.
        assert!(matches!(core.push(&"a", 16, 1, vec![0.0, 0.0], 0), PushOutcome::Accepted { version: 14, .. }));
        assert_eq!((core.version(), core.skipped()), (14, 2));
    }

    /// Finding 3: a live worker holds a version of the shard newer than a
    /// restored core's, and no push will carry it. Its heartbeat takes the
    /// numbering there, the round held is applied first and the parked
    /// pulls of its workers become ready; beyond the room, after a full
    /// round, or on a core handed over live, nothing moves.
    #[test]
    fn a_restored_core_takes_up_a_version_a_live_worker_holds() {
        let mut core = ShardCore::new(vec![0.0, 0.0], sgd(), 4, SyncPolicy::Bsp, ["a", "b"]);
        assert!(!core.take_up(6), "a core handed over live keeps its numbering");
        core.mark_restored(8);
        assert!(!core.take_up(4) && !core.take_up(3), "not newer: nothing to take up");
        assert!(!core.take_up(100), "beyond the room (a made-up claim)");
        // b re-pushes the step-5 gradient the lost owner applied (its
        // answer died with it): catch-up opens round 5 with it.
        assert!(matches!(core.push(&"b", 5, 1, vec![0.0, 2.0], 0), PushOutcome::Accepted { version: 5, .. }));
        assert!(!core.pull_ready(&"b", 6, 0), "round 5 waits for a, which already holds 6");
        assert!(core.take_up(6));
        assert_eq!((core.version(), core.skipped(), core.params()), (6, 1, &[0.0f32, -2.0][..]));
        assert!(core.pull_ready(&"b", 6, 0), "b's pull is answered at 6");
        // The next round is full: the numbering is settled.
        assert!(matches!(core.push(&"a", 6, 1, vec![2.0, 0.0], 0), PushOutcome::Accepted { version: 6, .. }));
        assert!(matches!(core.push(&"b", 6, 1, vec![0.0, 2.0], 0), PushOutcome::Accepted { version: 6, .. }));
        assert_eq!(core.version(), 7);
        assert!(!core.take_up(9), "after a full round");
        let mut other = ShardCore::new(vec![0.0], sgd(), 4, SyncPolicy::Asp, ["a"]);
        other.mark_restored(8);
        assert!(!other.take_up(6), "BSP only: the other policies number pushes, not rounds");
    }

    /// Finding 6: a restored core that has not closed a round yields to a
    /// copy of its own number (the real state, handed over) and hands it
    /// the round it holds; a newer copy always replaces a core, an older
    /// one never does, and a core handed over live or past its first full
    /// round fences a copy of its own number.
    #[test]
    fn a_restored_core_yields_to_a_copy_of_its_own_version_with_its_round() {
        let live = ShardCore::new(vec![0.0, 0.0], sgd(), 4, SyncPolicy::Bsp, ["a", "b"]);
        assert!(live.yields_to(5) && !live.yields_to(4) && !live.yields_to(3), "handed over live: newer only");
        let mut restored = ShardCore::new(vec![0.0, 0.0], sgd(), 4, SyncPolicy::Bsp, ["a", "b"]);
        restored.mark_restored(8);
        assert!(restored.take_up(6));
        assert!(matches!(restored.push(&"a", 6, 1, vec![2.0, 0.0], 0), PushOutcome::Accepted { version: 6, .. }));
        assert!(restored.yields_to(6) && !restored.yields_to(5), "its own number, not an older one");
        // The real state at 6 takes a's push; b's then closes round 6 there.
        let mut real = ShardCore::new(vec![1.0, 1.0], sgd(), 6, SyncPolicy::Bsp, ["a", "b"]);
        restored.hand_round_to(&mut real);
        assert!(matches!(real.push(&"b", 6, 1, vec![0.0, 2.0], 0), PushOutcome::Accepted { version: 6, .. }));
        assert_eq!(
            (real.version(), real.params()),
            (7, &[0.0f32, 0.0][..]),
            "both gradients applied to the real state"
        );
        // A full round settles a restored core: it fences its own number.
        let mut settled = ShardCore::new(vec![0.0, 0.0], sgd(), 4, SyncPolicy::Bsp, ["a", "b"]);
        settled.mark_restored(8);
        assert!(matches!(settled.push(&"a", 4, 1, vec![2.0, 0.0], 0), PushOutcome::Accepted { .. }));
        assert!(matches!(settled.push(&"b", 4, 1, vec![0.0, 2.0], 0), PushOutcome::Accepted { .. }));
        assert_eq!(settled.version(), 5);
        assert!(!settled.yields_to(5) && settled.yields_to(6), "settled: its own number is fenced");
        let mut asp = ShardCore::new(vec![0.0], sgd(), 4, SyncPolicy::Asp, ["a"]);
        asp.mark_restored(8);
        assert!(!asp.yields_to(4), "BSP only");
    }

    #[test]
    fn parses_policies() {
        assert_eq!("bsp".parse(), Ok(SyncPolicy::Bsp));
        assert_eq!("SSP:2".parse(), Ok(SyncPolicy::Ssp { staleness: 2 }));
        assert_eq!("dssp:1-4".parse(), Ok(SyncPolicy::Dssp { lo: 1, hi: 4 }));
        assert_eq!("asp".parse(), Ok(SyncPolicy::Asp));
        assert!("dssp:4-1".parse::<SyncPolicy>().is_err());
        assert!("ssp".parse::<SyncPolicy>().is_err());
        assert!("raft".parse::<SyncPolicy>().is_err());
        for p in ["bsp", "ssp:3", "dssp:1-4", "asp"] {
            assert_eq!(p.parse::<SyncPolicy>().map(|p| p.to_string()), Ok(p.to_string()));
        }
    }

    /// Three honest workers and one pushing 1000x their gradient: the
    /// norm check drops it from each round, the median-free mean of the
    /// rest is applied, and the third rejection in a row makes it a suspect.
    #[test]
    fn bsp_drops_a_far_gradient_from_the_round_and_reports_the_worker() {
        let robust =
            Robust { aggregation: robust::Aggregation::Mean, norm_check: 10.0, norm_floor: 0.0, min_agreement: None };
        let ids = ["a", "b", "c", "d"];
        let mut core = ShardCore::new(vec![0.0, 0.0], sgd(), 0, SyncPolicy::Bsp, ids).with_robust(robust);
        let honest = [[1.0, 2.0], [3.0, 2.0], [2.0, 2.0]];
        for round in 0..3u64 {
            // The honest gradients move from worker to worker, so that none
            // repeats its own (which the repeat check would drop).
            let r = round as usize;
            let pushes = [("a", honest[r % 3]), ("b", honest[(r + 1) % 3]), ("c", honest[(r + 2) % 3])];
            for (w, g) in pushes.into_iter().chain([("d", [-2000.0, 2000.0])]) {
                assert!(matches!(core.push(&w, round, 1, g.to_vec(), 0), PushOutcome::Accepted { .. }));
            }
            assert_eq!(core.version(), round + 1);
            // lr 1: each round subtracts the honest mean (2, 2).
            let v = -2.0 * (round + 1) as f32;
            assert_eq!(core.params(), &[v, v]);
            let r = core.take_rejections();
            assert_eq!(r.len(), 1, "{r:?}");
            assert_eq!((r[0].worker, r[0].streak, r[0].suspect()), ("d", round as u32 + 1, round == 2));
            assert!(r[0].norm > 2000.0 && r[0].median < 4.0, "{r:?}");
        }
        // An honest round resets the streak.
        for w in ids {
            core.push(&w, 3, 1, vec![1.0, 1.0], 0);
        }
        assert!(core.take_rejections().is_empty());
        assert_eq!(core.params(), &[-7.0, -7.0]);
    }

    /// Four honest workers and one pushing its gradient flipped and tripled,
    /// under the plain mean: the mean still points the honest way, and the
    /// flipped gradient away from it, every round. From the warm-up's end
    /// the contribution check leaves it out (each round then applies the
    /// honest mean), reports it and, three rounds on, names it a suspect;
    /// once it pushes honest gradients again its moving agreement rises and
    /// it is let back in.
    #[test]
    fn bsp_leaves_out_a_worker_that_disagrees_and_lets_it_back_once_it_agrees() {
        let robust = Robust {
            aggregation: robust::Aggregation::Mean,
            norm_check: 0.0,
            norm_floor: 0.0,
            min_agreement: Some(0.0),
        };
        let ids = ["a", "b", "c", "d", "e"];
        let mut core = ShardCore::new(vec![0.0, 0.0], sgd(), 0, SyncPolicy::Bsp, ids).with_robust(robust);
        let honest = |w: &str, round: u64| {
            let wobble = if w.as_bytes()[0].is_multiple_of(2) { 0.5 } else { -0.5 };
            vec![1.0 + wobble, 2.0 + (round % 3) as f32 * 0.1]
        };
        let mut left_out = Vec::new();
        for round in 0..30u64 {
            let before = core.params().to_vec();
            for w in ids {
                let mut g = honest(w, round);
                if w == "e" && round < 20 {
                    g.iter_mut().for_each(|x| *x *= -3.0);
                }
                core.push(&w, round, 1, g, 0);
            }
            let r = core.take_rejections();
            assert!(r.iter().all(|r| r.worker == "e" && r.agreement.is_some_and(|a| a < 0.0)), "round {round}: {r:?}");
            if let Some(r) = r.first() {
                left_out.push(round);
                assert_eq!(r.suspect(), r.streak >= SUSPECT_AFTER);
                // Without `e`: the honest mean, lr 1.
                let step: Vec<f32> = before.iter().zip(core.params()).map(|(b, a)| b - a).collect();
                let mean_y = 2.0 + (round % 3) as f32 * 0.1;
                assert!((step[0] - 1.0).abs() < 1e-5 && (step[1] - mean_y).abs() < 1e-5, "round {round}: {step:?}");
            }
        }
        // The mean with `e` flipped still points the honest way (its pull is
        // 3x one gradient against 4), so `e` scores negative from round 0:
        // left out from the 10th round (the warm-up) while it attacks, and
        // let back in a few honest rounds after it stops.
        assert_eq!(left_out.first(), Some(&(robust::AGREEMENT_WARMUP as u64)), "{left_out:?}");
        assert!(left_out.contains(&19), "left out to the end of its attack: {left_out:?}");
        let last = *left_out.last().unwrap_or(&0);
        assert!((20..29).contains(&last), "let back in once it agrees again: {left_out:?}");
    }

    /// A worker that replays one gradient every round (`replay`): its norm
    /// repeats bit for bit, so from its second push on the repeat check
    /// drops it and the round applies the others' mean; the third drop in
    /// a row names it a suspect. Honest gradients, different every round,
    /// are never dropped, and neither is a zero gradient (a shard no sample
    /// touched), however often it comes.
    #[test]
    fn a_replayed_gradient_is_dropped_from_its_second_push_on() {
        let robust =
            Robust { aggregation: robust::Aggregation::Mean, norm_check: 10.0, norm_floor: 0.0, min_agreement: None };
        let mut core =
            ShardCore::new(vec![0.0, 0.0], sgd(), 0, SyncPolicy::Bsp, ["a", "b", "c", "z"]).with_robust(robust);
        for round in 0..5u64 {
            let x = round as f32;
            let before = core.params().to_vec();
            core.push(&"a", round, 1, vec![1.0 + x, 2.0], 0);
            core.push(&"b", round, 1, vec![2.0, 1.0 + x], 0);
            core.push(&"z", round, 1, vec![0.0, 0.0], 0);
            core.push(&"c", round, 1, vec![5.0, 5.0], 0);
            let r = core.take_rejections();
            let step: Vec<f32> = before.iter().zip(core.params()).map(|(b, a)| b - a).collect();
            if round == 0 {
                assert!(r.is_empty(), "{r:?}");
                assert_eq!(step, [2.0, 2.0], "lr 1: the mean of all four");
                continue;
            }
            assert_eq!(r.len(), 1, "round {round}: {r:?}");
            assert!(r[0].repeat && r[0].worker == "c", "{r:?}");
            assert_eq!((r[0].streak, r[0].suspect()), (round as u32, round >= SUSPECT_AFTER as u64));
            let m = (3.0 + x) / 3.0;
            assert!(step.iter().all(|s| (s - m).abs() < 1e-6), "round {round}: {step:?}, not the mean of a, b and z");
        }
        // Under ASP each push is checked on arrival the same way.
        let mut core = ShardCore::new(vec![0.0], sgd_of(1), 0, SyncPolicy::Asp, ["a"])
            .with_robust(Robust { norm_check: 10.0, ..robust });
        core.push(&"a", 0, 1, vec![3.0], 0);
        core.push(&"a", 1, 1, vec![3.0], 0);
        let r = core.take_rejections();
        assert_eq!((r.len(), r[0].repeat, core.version()), (1, true, 1), "{r:?}");
    }

    #[test]
    fn bsp_rounds_combine_with_the_robust_rule() {
        let rule = robust::Aggregation::Median;
        let mut core = ShardCore::new(vec![0.0], sgd_of(1), 0, SyncPolicy::Bsp, ["a", "b", "c"]).with_robust(Robust {
            aggregation: rule,
            norm_check: 0.0,
            norm_floor: 0.0,
            min_agreement: None,
        });
        for (w, g) in [("a", 1.0f32), ("b", 2.0), ("c", -9.0)] {
            core.push(&w, 0, 1, vec![g], 0);
        }
        assert_eq!(core.params(), &[-1.0], "the median of 1, 2, -9 is 1");
        assert!(core.take_rejections().is_empty(), "K = 0: no norm check");
    }

    /// A free-rider pushing zeros: with the norm floor its gradient is
    /// rejected and the round is the mean of the other two, a full step;
    /// without it the zeros shrink the step by a third.
    #[test]
    fn the_norm_floor_leaves_a_push_of_zeros_out_of_the_round() {
        for (floor, want) in [(10.0f32, -2.0f32), (0.0, -4.0 / 3.0)] {
            let robust = Robust {
                aggregation: robust::Aggregation::Mean,
                norm_check: 0.0,
                norm_floor: floor,
                min_agreement: None,
            };
            let mut core =
                ShardCore::new(vec![0.0], sgd_of(1), 0, SyncPolicy::Bsp, ["a", "b", "free"]).with_robust(robust);
            for (w, g) in [("a", 1.5f32), ("b", 2.5), ("free", 0.0)] {
                core.push(&w, 0, 1, vec![g], 0);
            }
            assert!((core.params()[0] - want).abs() < 1e-6, "floor {floor}: {:?}", core.params());
            let r = core.take_rejections();
            let rejected: Vec<&str> = r.iter().map(|r| r.worker).collect();
            assert_eq!(rejected, if floor > 0.0 { vec!["free"] } else { vec![] }, "floor {floor}");
        }
    }

    #[test]
    fn asp_checks_each_push_against_the_window_and_still_counts_its_clock() {
        let robust =
            Robust { aggregation: robust::Aggregation::Mean, norm_check: 10.0, norm_floor: 0.0, min_agreement: None };
        let mut core = ShardCore::new(vec![0.0], sgd_of(1), 0, SyncPolicy::Asp, ["a", "b"]).with_robust(robust);
        for i in 0..robust::WARMUP {
            // Not the same gradient twice: the repeat check would drop it.
            core.push(&"a", i, 1, vec![1.0 + i as f32 / 64.0], 0);
        }
        let v = core.version();
        assert_eq!(core.push(&"b", v, 1, vec![500.0], 0), PushOutcome::Accepted { version: v, staleness: 0 });
        assert_eq!(core.version(), v, "the far push was not applied");
        assert_eq!(core.clock(&"b"), Some(1), "but its clock moved, so it cannot stall the bound");
        let r = core.take_rejections();
        assert_eq!((r.len(), r[0].worker), (1, "b"));
        core.push(&"b", v, 1, vec![1.0], 0);
        assert_eq!(core.version(), v + 1);
    }

    #[test]
    fn bsp_averages_by_samples_in_one_step() {
        let mut core = ShardCore::new(vec![0.0, 0.0], sgd(), 0, SyncPolicy::Bsp, ["a", "b"]);
        assert_eq!(core.push(&"a", 0, 1, vec![4.0, 0.0], 0), PushOutcome::Accepted { version: 0, staleness: 0 });
        assert!(!core.pull_ready(&"a", 1, 0), "round not complete");
        assert_eq!(core.version(), 0);
        // b has 3 samples: mean = (1*4 + 3*0)/4 = 1 and (1*0 + 3*8)/4 = 6.
        assert!(matches!(core.push(&"b", 0, 3, vec![0.0, 8.0], 0), PushOutcome::Accepted { .. }));
        assert_eq!(core.version(), 1);
        assert_eq!(core.params(), &[-1.0, -6.0]);
        assert!(core.pull_ready(&"a", 1, 0) && core.pull_ready(&"b", 1, 0));
        // A push against an old version is refused.
        assert_eq!(core.push(&"a", 0, 1, vec![1.0, 1.0], 0), PushOutcome::Stale { current_version: 1 });
        // One against a newer version joins the round in progress: this
        // core was not restored, so it keeps its own numbering.
        assert!(matches!(core.push(&"a", 3, 1, vec![0.0, 0.0], 0), PushOutcome::Accepted { version: 1, .. }));
        assert_eq!(core.push(&"z", 1, 1, vec![1.0, 1.0], 0), PushOutcome::UnknownWorker);
        assert_eq!(core.push(&"a", 1, 1, vec![1.0], 0), PushOutcome::BadLength { expected: 2, got: 1 });
    }

    /// Sparse pushes are added as they are held: a round of them costs the
    /// owner a bounded number of passes over the shard however many
    /// workers push, where dense pushes cost one more pass each, and the
    /// shard ends on the same bits as when every push is densified first.
    #[test]
    fn owners_add_sparse_pushes_in_a_bounded_number_of_passes_to_the_densified_bits() {
        use shoal_protocol::{Encoding, Payload};
        let len = 50_000;
        let encoding = PushCompression::SparseLoCo { fraction: 0.015 }.encoding(len);
        let mut passes = Vec::new();
        for n in [2usize, 8] {
            let workers: Vec<usize> = (0..n).collect();
            let sparse_of = |w: usize| {
                let mut rng = shoal_models::rng::DetRng::new(w as u64 + 1);
                let g: Vec<f32> = (0..len).map(|_| rng.uniform(-1.0, 1.0)).collect();
                Payload::encode(&g, encoding).expect("encodes")
            };
            // The norm check on: every push's norm is taken.
            let core = || {
                ShardCore::new(vec![0.5; len], sgd_of(len), 0, SyncPolicy::Bsp, workers.clone())
                    .with_robust(Robust::default())
            };
            let (mut held, mut densified) = (core(), core());
            for &w in &workers {
                let payload = sparse_of(w);
                let c = Contribution::decode(&payload).expect("decodes");
                assert!(matches!(c, Contribution::Sparse { .. }));
                assert!(matches!(held.push(&w, 0, 1 + w as u32, c, 0), PushOutcome::Accepted { .. }));
                let dense = payload.decode().expect("decodes");
                assert!(matches!(densified.push(&w, 0, 1 + w as u32, dense, 0), PushOutcome::Accepted { .. }));
            }
            assert_eq!((held.version(), densified.version()), (1, 1));
            assert!(held.params().iter().zip(densified.params()).all(|(a, b)| a.to_bits() == b.to_bits()));
            let (steps, sparse) = held.take_work();
            let (_, dense) = densified.take_work();
            assert_eq!(steps, 1);
            // The update zeroed and the optimizer's loop, plus each push's
            // kept entries (1.5%) taken in, normed and added.
            assert!((2.0..2.0 + 3.0 * 0.02 * n as f64).contains(&sparse), "{n} sparse pushes: {sparse} passes");
            // Each dense push taken in, normed and added.
            assert!(dense >= 2.0 + 3.0 * n as f64, "{n} dense pushes: {dense} passes");
            assert_eq!(held.take_work(), (0, 0.0), "taken");
            passes.push(sparse);
        }
        assert!(passes[1] - passes[0] < 0.5, "6 more sparse pushes cost {} passes", passes[1] - passes[0]);
        // The rules that sort coordinates read every push dense.
        let mut median = ShardCore::new(vec![0.0; 4], sgd_of(4), 0, SyncPolicy::Bsp, [0, 1, 2])
            .with_robust(Robust { aggregation: Aggregation::Median, ..Robust::default() });
        for w in 0..3 {
            let p = Payload::encode(&[w as f32, 0.0, 1.0, 0.0], Encoding::TopK { k: 2 }).expect("encodes");
            median.push(&w, 0, 1, Contribution::decode(&p).expect("decodes"), 0);
        }
        assert_eq!(median.params(), &[-1.0, 0.0, -1.0, 0.0]);
        let (_, p) = median.take_work();
        assert!(p >= 2.0 + 3.0 + 4.0, "densified 3 times, then the median: {p}");
    }

    /// A seeded simulation: workers of very different speeds push and pull
    /// under SSP(s) and DSSP; the recorded lead never exceeds the bound, and
    /// fast workers are never let run further than the bound allows.
    #[test]
    fn pipelined_policies_give_one_step_of_their_bound_to_the_overlap() {
        assert_eq!(SyncPolicy::Ssp { staleness: 2 }.pipelined(), Some(SyncPolicy::Ssp { staleness: 1 }));
        assert_eq!(SyncPolicy::Dssp { lo: 1, hi: 4 }.pipelined(), Some(SyncPolicy::Dssp { lo: 0, hi: 3 }));
        assert_eq!(SyncPolicy::Asp.pipelined(), Some(SyncPolicy::Asp));
        for none in [SyncPolicy::Bsp, SyncPolicy::Ssp { staleness: 0 }, SyncPolicy::Dssp { lo: 0, hi: 3 }] {
            assert_eq!(none.pipelined(), None, "{none}");
        }
        // The bound a pipelined worker's parameters get: the owners' bound
        // plus its one step of pipeline, never more than the policy's.
        for p in [SyncPolicy::Ssp { staleness: 1 }, SyncPolicy::Ssp { staleness: 3 }, SyncPolicy::Dssp { lo: 2, hi: 5 }]
        {
            let owners = p.pipelined().and_then(|q| q.max_bound()).unwrap_or(u64::MAX);
            assert_eq!(Some(owners + 1), p.max_bound(), "{p}");
        }
    }

    #[test]
    fn ssp_and_dssp_bound_the_lead_in_simulation() {
        for policy in [SyncPolicy::Ssp { staleness: 2 }, SyncPolicy::Dssp { lo: 1, hi: 4 }, SyncPolicy::Bsp] {
            let speeds = [1u64, 1, 3, 7]; // ms per step
            let ids = [0usize, 1, 2, 3];
            let mut core = ShardCore::new(vec![0.0, 0.0], sgd(), 0, policy, ids);
            let mut next_free = [0u64; 4];
            let mut waiting = [false; 4];
            let bound = policy.max_bound().unwrap_or(u64::MAX);
            for now in 0..2000u64 {
                for w in ids {
                    if waiting[w] {
                        let min_version = if policy == SyncPolicy::Bsp { core.clock(&w).unwrap_or(0) } else { 0 };
                        if core.pull_ready(&w, min_version, now) {
                            waiting[w] = false;
                            next_free[w] = now + speeds[w];
                        }
                    } else if now >= next_free[w] {
                        let base = core.version();
                        let out = core.push(&w, base, 1, vec![0.001, 0.001], now);
                        assert!(matches!(out, PushOutcome::Accepted { .. }), "{policy}: {out:?}");
                        waiting[w] = true;
                    }
                }
                let clocks: Vec<u64> = ids.iter().filter_map(|w| core.clock(w)).collect();
                let spread = clocks.iter().max().unwrap_or(&0) - clocks.iter().min().unwrap_or(&0);
                assert!(spread <= bound + 1, "{policy}: clocks {clocks:?}");
            }
            assert!(core.max_staleness() <= bound, "{policy}: staleness {}", core.max_staleness());
            let slowest = core.clock(&3).unwrap_or(0);
            assert!(slowest > 200, "{policy}: the slow worker must progress ({slowest})");
            if policy != SyncPolicy::Bsp {
                // Bounded staleness lets the fast workers get ahead of BSP's lockstep.
                assert!(core.max_staleness() >= 1, "{policy}: nobody ran ahead");
            }
        }
    }

    #[test]
    fn bsp_round_completes_when_a_worker_leaves_and_takes_joiners() {
        let mut core = ShardCore::new(vec![0.0, 0.0], sgd(), 0, SyncPolicy::Bsp, ["a", "b", "c"]);
        assert!(matches!(core.push(&"a", 0, 1, vec![2.0, 2.0], 0), PushOutcome::Accepted { .. }));
        assert!(matches!(core.push(&"b", 0, 1, vec![4.0, 4.0], 0), PushOutcome::Accepted { .. }));
        assert_eq!(core.version(), 0, "waiting for c");
        // c fails: the round of a and b is complete.
        core.set_workers(["a", "b"]);
        assert_eq!(core.version(), 1);
        assert_eq!(core.params(), &[-3.0, -3.0]);
        // d joins at the slowest clock and is waited for from the next round on.
        core.set_workers(["a", "b", "d"]);
        assert_eq!(core.clock(&"d"), core.clock(&"a"));
        assert!(matches!(core.push(&"a", 1, 1, vec![0.0, 0.0], 0), PushOutcome::Accepted { .. }));
        assert!(matches!(core.push(&"b", 1, 1, vec![0.0, 0.0], 0), PushOutcome::Accepted { .. }));
        assert_eq!(core.version(), 1, "waiting for d");
        assert!(matches!(core.push(&"d", 1, 1, vec![0.0, 0.0], 0), PushOutcome::Accepted { .. }));
        assert_eq!(core.version(), 2);
        let (params, state, version) = core.export();
        assert_eq!((params.as_slice(), version, state.step), (core.params(), 2, 2));
    }

    #[test]
    fn an_overdue_bsp_round_is_closed_without_the_missing_worker() {
        let mut core = ShardCore::new(vec![0.0, 0.0], sgd(), 0, SyncPolicy::Bsp, ["a", "b", "c"]);
        assert_eq!(core.round_deadline_ms(100), None, "no round open");
        assert!(matches!(core.push(&"a", 0, 1, vec![2.0, 2.0], 10), PushOutcome::Accepted { .. }));
        assert!(matches!(core.push(&"b", 0, 1, vec![4.0, 4.0], 50), PushOutcome::Accepted { .. }));
        assert_eq!(core.round_deadline_ms(100), Some(110), "from the first gradient");
        assert_eq!(core.close_overdue_round(109, 100), None, "not yet");
        assert_eq!(core.version(), 0);
        assert_eq!(core.close_overdue_round(110, 100), Some(vec!["c"]), "closed without c");
        assert_eq!(core.version(), 1);
        assert_eq!(core.params(), &[-3.0, -3.0], "the mean of what it had");
        assert_eq!(core.round_deadline_ms(100), None);
        // c's late push for round 0 is stale; it pulls version 1 and joins
        // round 1. a and b are not held back by c missing a round.
        assert!(core.pull_ready(&"a", 1, 110));
        assert_eq!(core.push(&"c", 0, 1, vec![9.0, 9.0], 120), PushOutcome::Stale { current_version: 1 });
        assert!(core.pull_ready(&"c", 1, 120));
        assert!(matches!(core.push(&"c", 1, 1, vec![0.0, 0.0], 130), PushOutcome::Accepted { .. }));
        assert_eq!(core.close_overdue_round(10_000, 100), Some(vec!["a", "b"]), "round 1 has only c so far");
    }

    #[test]
    fn bsp_with_a_backup_worker_applies_each_round_without_the_slowest() {
        let mut core =
            ShardCore::new(vec![0.0, 0.0], sgd(), 0, SyncPolicy::Bsp, ["a", "b", "c"]).with_backup_workers(1);
        assert!(matches!(core.push(&"a", 0, 1, vec![2.0, 2.0], 0), PushOutcome::Accepted { .. }));
        assert_eq!(core.version(), 0, "one push of three: the quorum is two");
        assert!(matches!(core.push(&"b", 0, 1, vec![4.0, 4.0], 1), PushOutcome::Accepted { .. }));
        assert_eq!(core.version(), 1, "applied without c");
        assert_eq!(core.params(), &[-3.0, -3.0], "the mean of the two");
        // c's push for round 0 is dropped: it pulls version 1 and pushes
        // into round 1, which it closes with a.
        assert_eq!(core.push(&"c", 0, 1, vec![9.0, 9.0], 2), PushOutcome::Stale { current_version: 1 });
        assert!(core.pull_ready(&"c", 1, 2));
        assert!(matches!(core.push(&"c", 1, 1, vec![0.0, 0.0], 3), PushOutcome::Accepted { .. }));
        assert!(matches!(core.push(&"a", 1, 1, vec![2.0, 2.0], 4), PushOutcome::Accepted { .. }));
        assert_eq!(core.version(), 2);
        assert_eq!(core.params(), &[-4.0, -4.0]);
        // Never fewer than one push, whatever the setting.
        let mut alone = ShardCore::new(vec![0.0, 0.0], sgd(), 0, SyncPolicy::Bsp, ["a", "b"]).with_backup_workers(5);
        assert_eq!(alone.version(), 0);
        assert!(matches!(alone.push(&"b", 0, 1, vec![1.0, 1.0], 0), PushOutcome::Accepted { .. }));
        assert_eq!(alone.version(), 1);
        // A worker that leaves can complete a round down to the quorum.
        let mut core =
            ShardCore::new(vec![0.0, 0.0], sgd(), 0, SyncPolicy::Bsp, ["a", "b", "c", "d"]).with_backup_workers(1);
        assert!(matches!(core.push(&"a", 0, 1, vec![1.0, 1.0], 0), PushOutcome::Accepted { .. }));
        assert!(matches!(core.push(&"b", 0, 1, vec![1.0, 1.0], 0), PushOutcome::Accepted { .. }));
        assert_eq!(core.version(), 0);
        core.set_workers(["a", "b", "c"]);
        assert_eq!(core.version(), 1, "two of three is the quorum now");
    }

    #[test]
    fn owners_follow_the_schedule_by_version() {
        use crate::policy::schedule::{LrDecay, LrSchedule};
        // Plain SGD, lr from the schedule: each step moves the parameter by
        // exactly the scheduled rate times the mean gradient (1.0).
        let schedule = LrSchedule { base: 1.0, decay: LrDecay::Cosine, steps: 4, warmup: 0 };
        let mut core = ShardCore::new(vec![0.0], sgd_of(1), 0, SyncPolicy::Bsp, ["a", "b"]).with_schedule(schedule);
        let mut expected = 0.0f64;
        for round in 0..4u64 {
            assert_eq!(core.schedule_step(), round);
            for w in ["a", "b"] {
                assert!(matches!(core.push(&w, round, 1, vec![1.0], 0), PushOutcome::Accepted { .. }));
            }
            expected -= schedule.lr_at(round);
            assert!(
                (core.params()[0] as f64 - expected).abs() < 1e-6,
                "round {round}: {} vs {expected}",
                core.params()[0]
            );
        }
        assert!(expected > -3.0, "the rate decayed: four full-rate steps would reach -4");
        // A shard restored at version 2 (a handoff, a checkpoint) goes on at step 2.
        let mut moved = ShardCore::new(vec![0.0], sgd_of(1), 2, SyncPolicy::Bsp, ["a"]).with_schedule(schedule);
        assert!(matches!(moved.push(&"a", 2, 1, vec![1.0], 0), PushOutcome::Accepted { .. }));
        assert!((moved.params()[0] as f64 + schedule.lr_at(2)).abs() < 1e-6);
        // Asynchronous policies: every push is a step; the schedule's step is
        // the version over the workers (one push of each is one round).
        let mut asp = ShardCore::new(vec![0.0], sgd_of(1), 0, SyncPolicy::Asp, ["a", "b"]).with_schedule(schedule);
        let mut expected = 0.0f64;
        for push in 0..6u64 {
            assert_eq!(asp.schedule_step(), push / 2);
            let w = if push % 2 == 0 { "a" } else { "b" };
            assert!(matches!(asp.push(&w, 0, 1, vec![1.0], push), PushOutcome::Accepted { .. }));
            expected -= schedule.lr_at(push / 2) * 0.5;
            assert!((asp.params()[0] as f64 - expected).abs() < 1e-6, "push {push}");
        }
    }

    #[test]
    fn asp_never_blocks() {
        let mut core = ShardCore::new(vec![0.0, 0.0], sgd(), 0, SyncPolicy::Asp, ["a", "b"]);
        for i in 0..10 {
            assert!(matches!(core.push(&"a", 0, 1, vec![1.0, 1.0], i), PushOutcome::Accepted { .. }));
            assert!(core.pull_ready(&"a", 0, i));
        }
        assert_eq!(core.version(), 10);
        assert_eq!(core.max_staleness(), 9);
        // Each push is weighted by its share of a round: a's 1 sample out of
        // a (1) + b (not yet seen, assumed 1) = 1/2, with lr 1: 10 * 0.5 = 5.
        assert_eq!(core.params(), &[-5.0, -5.0]);
        let _ = OptimizerKind::Sgd;
    }
}
