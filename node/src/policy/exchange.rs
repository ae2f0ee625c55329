//! One shard's exchange within a step, as a pure state machine: push this
//! worker's gradient to the shard's owner and pull the shard's next
//! version, following the shard wherever the placement moves it.
//!
//! [`ShardExchange::next`] says what to do next ([`ExchangeAction`]); the
//! caller does the I/O (a push, a pull, a wait for the placement to
//! change) and feeds the answer back ([`ShardExchange::on_push`],
//! [`ShardExchange::on_pull`]). The clock comes in as the time left before
//! the exchange's deadline, and the placement as a function the machine
//! calls when it needs the shard's current owner, so every path (retries,
//! hints, moved owners, lost answers, dropped gradients, the deadline) is
//! tested here without a runtime.
//!
//! Under BSP a gradient counts once the round it joined is applied, so if
//! the owner changes before our pull is answered, the gradient is pushed
//! again to the new owner: it either joins the round there (the old
//! owner's unfinished round was not handed over) or is refused as `Stale`
//! because the round was applied before the move. Under the other policies
//! a push is applied on arrival and never sent twice.

use std::fmt::Display;
use std::time::Duration;

use tracing::{debug, warn};

use crate::policy::backoff::Backoff;
use crate::policy::sync::SyncPolicy;

/// One shard's exchange for a step: the version pulled and its values.
#[derive(Debug)]
pub struct Exchanged<V> {
    pub version: u64,
    pub params: V,
    /// The push missed its round and was dropped (`sync.backup_workers`, a
    /// worker's first exchange).
    pub dropped: bool,
}

/// What the exchange does next.
#[derive(Debug)]
pub enum ExchangeAction<P, V> {
    /// Push the gradient to `owner` with `base` as its base version (as a
    /// `PushPull` where the caller's config and the owner allow it; the
    /// first push may have gone in a batch already).
    Push { owner: P, base: u64 },
    /// Pull the shard from `owner` at `min_version` or later. `after_push`:
    /// the push just answered was taken (or settled), and this pull follows
    /// it at once (the caller records the push's latency).
    Pull { owner: P, min_version: u64, after_push: bool },
    /// Wait for the placement to change, at most this long, then ask again:
    /// a retry goes as soon as the shard may have moved.
    WaitForChange(Duration),
    /// The shard's next version is in.
    Done(Exchanged<V>),
    /// The exchange failed; the step fails with this message.
    GiveUp(String),
}

/// An owner's answer to a push, as the exchange reads it.
#[derive(Debug)]
pub enum PushAnswer<P, V> {
    /// A `PushPull` accepted and served: the shard's next version.
    Served { version: u64, params: V },
    /// Taken: the shard reached `version` with it (pull the next).
    Accepted { version: u64 },
    /// The round this push was for has been applied.
    Stale { current_version: u64 },
    /// The owner does not count this node as a worker.
    UnknownWorker,
    /// Not the owner; `hint` may name the one that is.
    NotOwner { hint: Option<P> },
    /// The owner waits for the shard's handoff, or is busy.
    Pending,
    /// Refused for good: the step fails.
    Invalid(String),
    /// The request failed (transport, a bad answer): retried.
    Failed(String),
}

/// An owner's answer to a pull, as the exchange reads it.
#[derive(Debug)]
pub enum PullAnswer<P, V> {
    State { version: u64, params: V },
    NotReady { current_version: u64 },
    NotOwner { hint: Option<P> },
    Failed(String),
}

impl<P: Display, V> PushAnswer<P, V> {
    /// The answer without its values, for a log line.
    pub fn describe(&self) -> String {
        match self {
            Self::Served { version, .. } => format!("served version {version}"),
            Self::Accepted { version } => format!("accepted at version {version}"),
            Self::Stale { current_version } => format!("stale (current version {current_version})"),
            Self::UnknownWorker => "unknown worker".into(),
            Self::NotOwner { hint: Some(h) } => format!("not the owner (try {h})"),
            Self::NotOwner { hint: None } => "not the owner".into(),
            Self::Pending => "pending".into(),
            Self::Invalid(m) => format!("invalid: {m}"),
            Self::Failed(e) => format!("failed: {e}"),
        }
    }
}

impl<P: Display, V> PullAnswer<P, V> {
    /// The answer without its values, for a log line.
    pub fn describe(&self) -> String {
        match self {
            Self::State { version, .. } => format!("version {version}"),
            Self::NotReady { current_version } => format!("not ready (at version {current_version})"),
            Self::NotOwner { hint: Some(h) } => format!("not the owner (try {h})"),
            Self::NotOwner { hint: None } => "not the owner".into(),
            Self::Failed(e) => format!("failed: {e}"),
        }
    }
}

/// Where the machine is between two actions.
#[derive(Debug)]
enum Phase<P, V> {
    /// Ask the hint or the placement whom to try next.
    Route,
    /// Wait for the placement to change, then route.
    Wait,
    /// Pull from the owner that just took the push.
    PullFrom(P),
    /// The owner does not count this node as a worker (yet): push to it
    /// again after a wait, for a while, before giving the gradient up.
    Unknown(P),
    /// The shard's next version is in, to be handed out.
    Done(Exchanged<V>),
    /// The exchange failed for good, to be reported.
    Fail(String),
    /// `Done` or `Fail` was handed out.
    Over,
}

/// The state of one shard's exchange. `P` names a peer, `V` holds a
/// shard's values (passed through untouched).
#[derive(Debug)]
pub struct ShardExchange<P, V> {
    shard: u32,
    /// The version the gradient was computed on.
    base: u64,
    policy: SyncPolicy,
    /// BSP: a push that missed its round is dropped, not given to the
    /// round in progress (backup workers; a worker's first exchange).
    drop_stale: bool,
    /// The request timeout, for the message when it runs out.
    timeout: Duration,
    phase: Phase<P, V>,
    /// The owner the first push went to in a batch (taken by that push).
    first: Option<P>,
    /// The owner holding (BSP) or having applied (others) our gradient.
    holder: Option<P>,
    /// The version the next pull asks for.
    min_version: u64,
    /// The owner a `NotOwner` answer named, tried next.
    hint: Option<P>,
    /// Some owner has taken this gradient (it may be applied already).
    ever_taken: bool,
    /// A push failed with no answer: it may have been taken all the same
    /// (its answer was lost), so a later `Stale` is not proof that the
    /// gradient missed its round.
    maybe_taken: bool,
    /// Backup workers: the gradient missed its round and was dropped.
    dropped: bool,
    /// The base the next push names (a BSP push that missed its round
    /// joins the round in progress).
    push_base: u64,
    /// The time left before the deadline when the pushes answered
    /// `UnknownWorker` stop being retried (set at the first such answer).
    unknown_until: Option<Duration>,
    backoff: Backoff,
    /// The last failure, for the message at the deadline.
    last: String,
}

impl<P: Copy + Eq + Display, V> ShardExchange<P, V> {
    /// The exchange of `shard`'s gradient computed on version `base`, with
    /// `timeout` to run (the caller's deadline). `drop_stale`: a push that
    /// missed its round is dropped and the current version pulled (see
    /// [`ShardExchange::on_push`]). `first`: the owner the first push went
    /// to in a batch, if it did. `backoff`: the waits for a placement
    /// change between retries.
    pub fn new(
        shard: u32,
        base: u64,
        policy: SyncPolicy,
        drop_stale: bool,
        timeout: Duration,
        first: Option<P>,
        backoff: Backoff,
    ) -> Self {
        Self {
            shard,
            base,
            policy,
            drop_stale,
            timeout,
            phase: Phase::Route,
            first,
            holder: None,
            min_version: policy.pull_after_push(base),
            hint: None,
            ever_taken: false,
            maybe_taken: false,
            dropped: false,
            push_base: base,
            unknown_until: None,
            backoff,
            last: String::from("no attempt"),
        }
    }

    fn bsp(&self) -> bool {
        self.policy == SyncPolicy::Bsp
    }

    /// The next action, `left` before the deadline. `placement` returns the
    /// shard's owner in the current placement (and marks that placement
    /// seen, so that a later wait is for a newer one); it is called only
    /// when the next attempt is routed by the placement, and for the
    /// batched first push (whose retry then waits for a newer placement
    /// than the one the batch was formed on).
    pub fn next(&mut self, left: Duration, placement: impl FnOnce() -> Option<P>) -> ExchangeAction<P, V> {
        match std::mem::replace(&mut self.phase, Phase::Route) {
            Phase::Wait => return ExchangeAction::WaitForChange(self.backoff.next_delay()),
            Phase::PullFrom(owner) => {
                return ExchangeAction::Pull { owner, min_version: self.min_version, after_push: true }
            }
            Phase::Unknown(owner) => {
                // A quarter of the exchange's time: an owner counts a new
                // worker once its view holds it, a heartbeat or two later.
                let until = *self.unknown_until.get_or_insert(left.saturating_sub(self.timeout / 4));
                if left > until {
                    // Then pushed to the same owner again (one that no
                    // longer owns the shard names the one that does).
                    self.hint = Some(owner);
                    return ExchangeAction::WaitForChange(self.backoff.next_delay());
                }
                warn!(shard = self.shard, %owner, "the owner does not count this node as a worker; gradient dropped");
                self.took(owner, 0);
                return self.next(left, placement);
            }
            Phase::Done(x) => {
                self.phase = Phase::Over;
                return ExchangeAction::Done(x);
            }
            Phase::Fail(m) => {
                self.phase = Phase::Over;
                return ExchangeAction::GiveUp(m);
            }
            Phase::Over => {
                self.phase = Phase::Over;
                return ExchangeAction::GiveUp(format!("shard {}: the exchange is over", self.shard));
            }
            Phase::Route => {}
        }
        if left.is_zero() {
            return ExchangeAction::GiveUp(format!(
                "shard {}: no owner pushed and pulled within {} ms; last: {} (see cluster.request_timeout_ms)",
                self.shard,
                self.timeout.as_millis(),
                self.last
            ));
        }
        let owner = if let Some(first) = self.first {
            // Read only to mark this placement seen.
            let _ = placement();
            first
        } else if let Some(hint) = self.hint.take() {
            hint
        } else {
            match placement() {
                Some(owner) => owner,
                None => return ExchangeAction::GiveUp("no placement yet".into()),
            }
        };
        // A dropped gradient is not pushed again, even to a new owner.
        let need_push = !self.dropped && if self.bsp() { self.holder != Some(owner) } else { self.holder.is_none() };
        if need_push {
            self.first = None;
            ExchangeAction::Push { owner, base: self.push_base }
        } else {
            ExchangeAction::Pull { owner, min_version: self.min_version, after_push: false }
        }
    }

    /// `owner` answered the push (or it failed).
    pub fn on_push(&mut self, owner: P, answer: PushAnswer<P, V>) {
        let (shard, base) = (self.shard, self.base);
        match answer {
            PushAnswer::Served { version, params } => {
                // One exchange did both: the gradient counts and this is its version.
                self.phase = Phase::Done(Exchanged { version, params, dropped: false });
            }
            PushAnswer::Accepted { version } => {
                self.took(owner, self.policy.pull_after_push(version));
            }
            PushAnswer::Stale { current_version } if !self.ever_taken && !self.maybe_taken && self.drop_stale => {
                // Backup workers: the round was applied without this
                // gradient, as it may be. It is dropped; this worker pulls
                // the current version and skips ahead to the round in
                // progress. No round waits for it.
                // A worker's first exchange (a joiner, a resumed node): its
                // model came from a copy that can be a round old on some
                // shards and current on others. Given to the round in
                // progress, the gradient put it a round ahead of the others
                // on those shards and in step on the rest, and two such
                // joiners waited on each other in a cycle that only the
                // round timeout broke (the schedule explorer's finding 4).
                // Dropped, the worker pulls the current version: its next
                // step is in the round in progress on every shard.
                debug!(shard, base, current_version, "push missed its round; dropped");
                self.dropped = true;
                self.took(owner, current_version);
            }
            PushAnswer::Stale { current_version } if self.bsp() && !self.ever_taken && !self.maybe_taken => {
                // BSP: the round we computed for was applied without us (a
                // fault put this worker a round behind), and no owner ever
                // took this gradient. Give it to the round in progress
                // instead: skipping a round on one shard while in step on
                // the others would leave this worker a round apart on
                // different shards, and rounds that wait on each other in a
                // cycle. (Dropped here instead, one run of the 4-node
                // partition testnet forced every round after the heal.)
                debug!(shard, base, current_version, "push missed its round; joining the current one");
                self.push_base = current_version;
            }
            PushAnswer::Stale { current_version } => {
                // BSP: a re-pushed gradient whose round was applied (and
                // handed over) before the move: it counted already. Or a
                // push whose answer was lost: it may have closed its round,
                // and joining the next one would count it twice and put
                // this worker a round ahead on this shard, where rounds on
                // two shards can wait on each other in a cycle (the schedule
                // explorer's finding 1). Pulling loses at most this one
                // gradient, never the round.
                debug!(shard, base, current_version, "push was stale; pulling the current version");
                self.holder = Some(owner);
                self.min_version = current_version;
                self.phase = Phase::PullFrom(owner);
            }
            PushAnswer::UnknownWorker => {
                // A worker new to the run pushes before the owner's view
                // holds it: dropping that gradient would leave the owner
                // waiting, in the round it now counts this worker in, for
                // a push that never comes (a round forced at its timeout).
                self.last = format!("{owner} does not count this node as a worker");
                self.phase = Phase::Unknown(owner);
            }
            PushAnswer::NotOwner { hint } => {
                self.last = format!("{owner} does not own it");
                self.follow_hint(owner, hint);
            }
            PushAnswer::Pending => {
                self.last = format!("{owner} is waiting for the shard's handoff");
                self.phase = Phase::Wait;
            }
            PushAnswer::Invalid(m) => {
                self.phase = Phase::Fail(format!("shard {shard}: owner {owner} refused the push: {m}"));
            }
            PushAnswer::Failed(e) => {
                self.last = format!("push to {owner}: {e}");
                self.maybe_taken = true;
                self.phase = Phase::Wait;
            }
        }
    }

    /// `owner` answered the pull (or it failed).
    pub fn on_pull(&mut self, owner: P, answer: PullAnswer<P, V>) {
        match answer {
            PullAnswer::State { version, params } => {
                self.phase = Phase::Done(Exchanged { version, params, dropped: self.dropped });
            }
            PullAnswer::NotReady { current_version } => {
                // Asked again at once: the owner held the pull as long as it could.
                self.last = format!("{owner} still at version {current_version}, waiting for {}", self.min_version);
            }
            PullAnswer::NotOwner { hint } => {
                self.last = format!("{owner} no longer owns it");
                if self.bsp() && self.holder == Some(owner) {
                    self.holder = None; // push again to whoever owns it now
                }
                self.follow_hint(owner, hint);
            }
            PullAnswer::Failed(e) => {
                self.last = format!("pull from {owner}: {e}");
                self.phase = Phase::Wait;
            }
        }
    }

    /// `owner` took the gradient (or settled it): pull `min_version` from
    /// it next.
    fn took(&mut self, owner: P, min_version: u64) {
        self.holder = Some(owner);
        self.ever_taken = true;
        self.min_version = min_version;
        self.phase = Phase::PullFrom(owner);
    }

    /// `owner` does not own the shard: try next the owner it `named`, if
    /// another, or else wait for the placement to change.
    fn follow_hint(&mut self, owner: P, named: Option<P>) {
        self.hint = named.filter(|h| *h != owner);
        if self.hint.is_none() {
            self.phase = Phase::Wait;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Machine = ShardExchange<u8, &'static str>;
    type Action = ExchangeAction<u8, &'static str>;

    const SECOND: Duration = Duration::from_secs(1);

    fn machine(policy: SyncPolicy, drop_stale: bool, first: Option<u8>) -> Machine {
        let backoff = Backoff::seeded(Duration::from_millis(10), Duration::from_millis(500), 1);
        ShardExchange::new(7, 5, policy, drop_stale, SECOND, first, backoff)
    }

    /// The next action with the placement naming `owner`.
    fn next(m: &mut Machine, owner: u8) -> Action {
        m.next(SECOND, || Some(owner))
    }

    fn is_push(a: &Action, to: u8, with_base: u64) -> bool {
        matches!(a, ExchangeAction::Push { owner, base } if (*owner, *base) == (to, with_base))
    }

    fn is_pull(a: &Action, from: u8, at: u64, after: bool) -> bool {
        matches!(a, ExchangeAction::Pull { owner, min_version, after_push }
            if (*owner, *min_version, *after_push) == (from, at, after))
    }

    fn done(a: Action) -> Option<Exchanged<&'static str>> {
        match a {
            ExchangeAction::Done(x) => Some(x),
            _ => None,
        }
    }

    #[test]
    fn a_push_then_a_pull_of_the_next_round() {
        let mut m = machine(SyncPolicy::Bsp, false, None);
        assert!(is_push(&next(&mut m, 1), 1, 5));
        m.on_push(1, PushAnswer::Accepted { version: 5 });
        // BSP pulls the version after the round the push joined.
        assert!(is_pull(&next(&mut m, 1), 1, 6, true));
        m.on_pull(1, PullAnswer::State { version: 6, params: "v6" });
        let x = done(next(&mut m, 1)).expect("done");
        assert_eq!((x.version, x.params, x.dropped), (6, "v6", false));
        assert!(matches!(next(&mut m, 1), ExchangeAction::GiveUp(_)), "nothing after done");
    }

    #[test]
    fn a_served_push_pull_is_done_in_one_round_trip() {
        let mut m = machine(SyncPolicy::Bsp, false, None);
        assert!(is_push(&next(&mut m, 2), 2, 5));
        m.on_push(2, PushAnswer::Served { version: 6, params: "v6" });
        let x = done(next(&mut m, 2)).expect("done");
        assert_eq!((x.version, x.params, x.dropped), (6, "v6", false));
    }

    #[test]
    fn a_failed_push_waits_for_the_placement_and_retries_its_owner() {
        let mut m = machine(SyncPolicy::Asp, false, None);
        assert!(is_push(&next(&mut m, 1), 1, 5));
        m.on_push(1, PushAnswer::Failed("connection reset".into()));
        let mut waits = Vec::new();
        for _ in 0..3 {
            match next(&mut m, 1) {
                ExchangeAction::WaitForChange(d) => waits.push(d),
                other => panic!("expected a wait, got {other:?}"),
            }
            // Nobody took the gradient: it is pushed again, not pulled.
            assert!(is_push(&next(&mut m, 1), 1, 5));
            m.on_push(1, PushAnswer::Pending);
        }
        // The waits back off: at most 10, 20, 40 ms.
        for (d, cap) in waits.iter().zip([10, 20, 40]) {
            assert!(*d <= Duration::from_millis(cap) && *d >= Duration::from_millis(cap / 2), "{d:?}");
        }
    }

    #[test]
    fn a_hint_is_followed_at_once_and_no_hint_waits_for_the_placement() {
        let mut m = machine(SyncPolicy::Asp, false, None);
        assert!(is_push(&next(&mut m, 1), 1, 5));
        m.on_push(1, PushAnswer::NotOwner { hint: Some(2) });
        // The hint goes first: the placement is not read.
        let a = m.next(SECOND, || panic!("the placement is not read when a hint names the owner"));
        assert!(is_push(&a, 2, 5));
        // A hint naming the refusing owner itself is no hint.
        m.on_push(2, PushAnswer::NotOwner { hint: Some(2) });
        assert!(matches!(next(&mut m, 3), ExchangeAction::WaitForChange(_)));
        assert!(is_push(&next(&mut m, 3), 3, 5));
        m.on_push(3, PushAnswer::NotOwner { hint: None });
        assert!(matches!(next(&mut m, 3), ExchangeAction::WaitForChange(_)));
    }

    #[test]
    fn a_lost_pull_after_the_push_was_taken_pulls_again_and_never_pushes_twice() {
        // ASP applies a push on arrival: after it was taken, any later
        // attempt pulls, from whoever owns the shard now.
        let mut m = machine(SyncPolicy::Asp, false, None);
        assert!(is_push(&next(&mut m, 1), 1, 5));
        // A `PushPull` answered without a state: accepted, pull separately.
        m.on_push(1, PushAnswer::Accepted { version: 9 });
        assert!(is_pull(&next(&mut m, 1), 1, 0, true));
        m.on_pull(1, PullAnswer::Failed("timed out".into()));
        assert!(matches!(next(&mut m, 2), ExchangeAction::WaitForChange(_)));
        assert!(is_pull(&next(&mut m, 2), 2, 0, false), "the owner moved: pull from the new one, no push");
        m.on_pull(2, PullAnswer::NotOwner { hint: Some(3) });
        assert!(is_pull(&next(&mut m, 2), 3, 0, false));
        m.on_pull(3, PullAnswer::NotReady { current_version: 9 });
        // Not ready: asked again at once (the owner held the pull).
        assert!(is_pull(&next(&mut m, 3), 3, 0, false));
        m.on_pull(3, PullAnswer::State { version: 10, params: "v10" });
        assert_eq!(done(next(&mut m, 3)).map(|x| x.version), Some(10));
    }

    #[test]
    fn bsp_pushes_again_to_a_new_owner_and_a_stale_answer_then_means_it_counted() {
        let mut m = machine(SyncPolicy::Bsp, false, None);
        assert!(is_push(&next(&mut m, 1), 1, 5));
        m.on_push(1, PushAnswer::Accepted { version: 5 });
        assert!(is_pull(&next(&mut m, 1), 1, 6, true));
        // A lost pull from the holder: pulled again, not pushed.
        m.on_pull(1, PullAnswer::Failed("reset".into()));
        assert!(matches!(next(&mut m, 1), ExchangeAction::WaitForChange(_)));
        assert!(is_pull(&next(&mut m, 1), 1, 6, false));
        // The shard moved while the round was open: the round may not have
        // been handed over, so the gradient goes to the new owner.
        m.on_pull(1, PullAnswer::NotOwner { hint: Some(2) });
        assert!(is_push(&next(&mut m, 2), 2, 5));
        // The round was applied before the move: it counted already.
        m.on_push(2, PushAnswer::Stale { current_version: 6 });
        assert!(is_pull(&next(&mut m, 2), 2, 6, true));
        m.on_pull(2, PullAnswer::State { version: 6, params: "v6" });
        let x = done(next(&mut m, 2)).expect("done");
        assert_eq!((x.version, x.dropped), (6, false));
    }

    #[test]
    fn a_bsp_push_that_missed_its_round_joins_the_current_one() {
        let mut m = machine(SyncPolicy::Bsp, false, None);
        assert!(is_push(&next(&mut m, 1), 1, 5));
        m.on_push(1, PushAnswer::Stale { current_version: 8 });
        // No wait: pushed again at once with the current round as its base.
        assert!(is_push(&next(&mut m, 1), 1, 8));
        m.on_push(1, PushAnswer::Accepted { version: 8 });
        assert!(is_pull(&next(&mut m, 1), 1, 9, true));
    }

    /// With `drop_stale` (backup workers, a worker's first exchange), a
    /// push that missed its round is dropped and the current version pulled.
    #[test]
    fn a_late_push_with_drop_stale_is_dropped_and_never_pushed_again() {
        let mut m = machine(SyncPolicy::Bsp, true, None);
        assert!(is_push(&next(&mut m, 1), 1, 5));
        m.on_push(1, PushAnswer::Stale { current_version: 8 });
        assert!(is_pull(&next(&mut m, 1), 1, 8, true), "pull the current version, skip ahead");
        // Even when the shard moves, a dropped gradient is not pushed.
        m.on_pull(1, PullAnswer::NotOwner { hint: Some(2) });
        assert!(is_pull(&next(&mut m, 2), 2, 8, false));
        m.on_pull(2, PullAnswer::State { version: 8, params: "v8" });
        let x = done(next(&mut m, 2)).expect("done");
        assert_eq!((x.version, x.params, x.dropped), (8, "v8", true));
    }

    #[test]
    fn an_unknown_worker_pushes_again_for_a_quarter_of_its_time_then_pulls_whatever_is_current() {
        let mut m = machine(SyncPolicy::Bsp, false, None);
        assert!(is_push(&next(&mut m, 1), 1, 5));
        m.on_push(1, PushAnswer::UnknownWorker);
        // The owner's view may not hold this node yet: wait, push again
        // to the same owner, and this time it counts.
        assert!(matches!(m.next(SECOND, || Some(1)), ExchangeAction::WaitForChange(_)));
        assert!(is_push(&m.next(SECOND, || Some(1)), 1, 5));
        m.on_push(1, PushAnswer::Accepted { version: 5 });
        assert!(is_pull(&next(&mut m, 1), 1, 6, true));

        // An owner that never counts it: after a quarter of the exchange's
        // time (250 ms of 1 s here), the gradient is given up.
        let mut m = machine(SyncPolicy::Bsp, false, None);
        assert!(is_push(&next(&mut m, 1), 1, 5));
        m.on_push(1, PushAnswer::UnknownWorker);
        assert!(matches!(m.next(SECOND, || Some(1)), ExchangeAction::WaitForChange(_)));
        assert!(is_push(&m.next(Duration::from_millis(900), || Some(1)), 1, 5));
        m.on_push(1, PushAnswer::UnknownWorker);
        assert!(matches!(m.next(Duration::from_millis(800), || Some(1)), ExchangeAction::WaitForChange(_)));
        assert!(is_push(&m.next(Duration::from_millis(760), || Some(1)), 1, 5));
        m.on_push(1, PushAnswer::UnknownWorker);
        assert!(is_pull(&m.next(Duration::from_millis(750), || Some(1)), 1, 0, true));
        m.on_pull(1, PullAnswer::State { version: 9, params: "v9" });
        assert_eq!(done(next(&mut m, 1)).map(|x| x.version), Some(9));
    }

    #[test]
    fn the_deadline_gives_up_naming_the_last_failure() {
        let mut m = machine(SyncPolicy::Bsp, false, None);
        assert!(is_push(&next(&mut m, 1), 1, 5));
        m.on_push(1, PushAnswer::Failed("connection reset".into()));
        // The wait comes first; the deadline is checked before the next attempt.
        assert!(matches!(m.next(Duration::ZERO, || Some(1)), ExchangeAction::WaitForChange(_)));
        match m.next(Duration::ZERO, || Some(1)) {
            ExchangeAction::GiveUp(msg) => {
                assert!(msg.contains("shard 7") && msg.contains("1000 ms"), "{msg}");
                assert!(msg.contains("last: push to 1: connection reset"), "{msg}");
            }
            other => panic!("expected to give up, got {other:?}"),
        }
        // Before any attempt the message says so.
        let mut fresh = machine(SyncPolicy::Bsp, false, None);
        let a = fresh.next(Duration::ZERO, || Some(1));
        assert!(matches!(&a, ExchangeAction::GiveUp(msg) if msg.contains("last: no attempt")), "{a:?}");
    }

    #[test]
    fn a_refused_push_and_a_missing_placement_fail_the_exchange() {
        let mut m = machine(SyncPolicy::Ssp { staleness: 2 }, false, None);
        assert!(is_push(&next(&mut m, 1), 1, 5));
        m.on_push(1, PushAnswer::Invalid("bad length".into()));
        let a = next(&mut m, 1);
        assert!(matches!(&a, ExchangeAction::GiveUp(msg) if msg.contains("refused the push: bad length")), "{a:?}");
        let mut m = machine(SyncPolicy::Bsp, false, None);
        let a = m.next(SECOND, || None);
        assert!(matches!(&a, ExchangeAction::GiveUp(msg) if msg == "no placement yet"), "{a:?}");
    }

    #[test]
    fn a_batched_first_push_goes_to_the_batchs_owner_and_retries_by_the_placement() {
        let mut m = machine(SyncPolicy::Bsp, false, Some(4));
        let mut read = 0;
        // The placement is read (marked seen) but the batch's owner is used.
        let a = m.next(SECOND, || {
            read += 1;
            Some(1)
        });
        assert!(is_push(&a, 4, 5));
        assert_eq!(read, 1);
        m.on_push(4, PushAnswer::Failed("batch failed".into()));
        assert!(matches!(next(&mut m, 1), ExchangeAction::WaitForChange(_)));
        assert!(is_push(&next(&mut m, 1), 1, 5), "the retry goes alone, to the placement's owner");
    }
}
