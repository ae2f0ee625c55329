//! A deterministic schedule explorer over the pure BSP round state (issue
//! 47, item 1): the real [`ShardCore`] owners and [`ShardExchange`]
//! workers, wired together as the aggregator and worker actors wire them,
//! and driven by a seeded scheduler through thousands of interleavings.
//!
//! # The model
//!
//! A world of W nodes (2 to 5), each a worker, some also owners, and S
//! shards (1 to 3) under BSP. Each shard is served by one [`ShardCore`] at
//! the node the placement names; each worker runs one [`ShardExchange`] per
//! shard and step, keeps the version and values it pulled per shard (its
//! model, also the copy an owner takes a shard over from), and starts its
//! next step when every shard's exchange is done. What the actors do around
//! the two pure machines is mirrored here:
//! - owners (`actors::aggregator`): a push is applied and answered, or
//!   refused (`NotOwner` with the owner's placement as the hint, `Pending`
//!   while a handoff is awaited); a pull is parked and released when
//!   `pull_ready` holds, or answered `NotOwner` when `lost_push` holds or
//!   the shard left; a `PushPull` parks the pull riding on an accepted push
//!   and answers `Served` or, when that pull ends another way, `Accepted`; a
//!   `PushPullMany` batch answers all at once if any push was refused, else
//!   when every parked pull is answered. A new placement runs `place`:
//!   `set_workers`, the export and `Transfer` of each shard lost, kept
//!   transfers passed on, and each shard gained restored (from a kept copy,
//!   or when the previous owner is this node or gone, from a replica or the
//!   worker copy, with `mark_restored`) or awaited. A transfer is installed,
//!   fenced, replaces an older core, or is forwarded (at most four hops,
//!   then kept and passed on again by a retry timer), as `receive` does.
//! - workers (`actors::worker`): the exchange's actions become messages,
//!   answers are fed back with `on_push` and `on_pull`; the first push of
//!   the shards of one remote owner goes in one batch (when the run uses
//!   batches); a worker asked to leave stops after the step in hand.
//! - heartbeats: a worker's heartbeat names the version of each shard it
//!   holds (set as each exchange ends); a node hears it at a time the
//!   scheduler picks, and a restored core there takes up the newest
//!   version a live worker holds, as `take_up_held` does.
//! - the election: placements are global and numbered, and each node takes
//!   up the newest one at a time the scheduler picks (views lag). A worker
//!   that leaves (`leave_run`) announces it: the next placement drops it from
//!   the workers, gives its shards to other nodes and may move one more
//!   shard; the node applies it at once, serves until its shards are handed
//!   off, then exits, and the placement without it in `live` may move one
//!   more shard. A worker that ran its last step is no worker any more.
//!
//! Every message sits in one in-flight set until the scheduler delivers
//! it, in any order. The seeded scheduler picks each next event: deliver a
//! message, let a worker take its exchange's next action, let a node take
//! up the newest placement, let a node hear a worker's heartbeat whose
//! versions changed, fire a timer (a parked pull's wait, a kept
//! transfer's retry, a handoff that will not come), and, in runs with
//! faults, at a few random points: lose a message, time a request out while
//! it stays on the wire (its late answer is then ignored), crash a node (its
//! worker and shards are gone, its unsent answers may be lost, and each
//! shard it owned is restored elsewhere from a replica up to three versions
//! old), hand a shard to another owner, or ask a worker to leave. The clock
//! is the event count; time only orders events.
//!
//! # What is checked
//!
//! - Liveness: the run ends with every worker done. A state where nothing
//!   but parked pulls' waits can fire, and firing them (three times over)
//!   changes nothing, is a round that only the round timeout
//!   (`close_overdue_round`) would close: "no progress possible". So is a
//!   run that goes 5,000 events without a version moving, a push taken or
//!   an exchange done (a livelock). Faults do not excuse either: no fault
//!   modelled here should need the round timeout.
//! - Exactly once: a gradient is a vector holding `step + 1` at the
//!   worker's index, so the mean a round applies (plain SGD, rate 1) tells
//!   which workers' gradients of which steps it held. Each core keeps the
//!   lineage of rounds its parameters reflect; a gradient applied twice in
//!   one lineage fails the run. When a worker's exchange ends, its gradient
//!   must be in the lineage of the state it pulled (unless a fault threw
//!   that lineage away), and at the end in the final core's. A core,
//!   transfer or kept transfer thrown away while it holds rounds nothing
//!   else holds (fenced, replaced, undeliverable) fails a run without a
//!   crash or a handoff timeout racing its transfer; with one, those
//!   gradients are lost to the fault (the loss bound of `replica_every`),
//!   and so is what a restore from an older copy lacks of every round any
//!   core of the shard applied. An owner that answers a live worker `UnknownWorker` (the gradient is
//!   dropped) fails the run.
//! - Versions: a worker's version of a shard never goes back, except when
//!   it pulls from a core restored from an older copy since its last pull,
//!   and then by at most the restore room (16, as `restored` gives with no
//!   replicas). An owner never installs a handed-over copy older than the
//!   newest version that lineage reached; a restore may start older (that is
//!   what `mark_restored` and catch-up are for), and then numbers anew.
//!
//! Not covered: the other sync policies, backup workers, overlap, the
//! checkpoints and resume, replicas sent as a run goes (a crash stores one
//! up to three versions old at the new owner), partitions (two live views
//! that disagree for long), gossip mode, and the real election
//! (owners are drawn at random). Joiners are modelled simply: a joiner
//! comes into the placement, starts once every node has taken that
//! placement up (the real worker retries an `UnknownWorker` answer for a
//! while), from a training worker's copy, versions and step, and is then a
//! worker like the others. Request deadlines are infinite: the
//! exchange never gives up, so a run that is stuck stays stuck.
//!
//! # Findings (issue 47)
//!
//! A failed run is sorted ([`Kind`]): what the findings below explain, and
//! the rest, which fails every test. Each finding has a test that pins it
//! (it fails once the protocol is fixed, and the other tests then allow
//! that kind no more).
//! 1. (Fixed.) A taken push whose answer is lost (a timeout, a dropped
//!    connection, an owner's crash) is retried; its round has been applied,
//!    so it is refused as `Stale`, and the exchange, which never saw it
//!    taken, gave it to the round in progress: the gradient counted twice
//!    and the worker was a round ahead on that shard. Two such workers on
//!    two shards waited for each other: only the round timeout ended it.
//!    Now a push that failed with no answer may have been taken, and a
//!    `Stale` after it means pull, not rejoin (`ShardExchange::maybe_taken`).
//! 2. (Fixed.) A leaver stops once its transfers are acknowledged, but an
//!    owner whose view lags forwards the transfer back to it: the copy then
//!    bounced off the stopped node (its sender kept it as a replica) or died
//!    with it (kept at the hop limit, which `Held` did not count), and the
//!    new owner restored from an older copy: applied rounds were lost. Now
//!    an undelivered transfer is kept as a transfer and passed on to the
//!    owner the sender's view names (`transfer_failed`), and a leaver waits
//!    for its kept transfers too (`Held::kept`).
//! 3. (Fixed.) With catch-up, issue 16's cycle still formed when no
//!    surviving worker that would push again got the crashed owner's
//!    newest version of every shard: nobody pushed against the newer
//!    numbering. Seed 517 of 3,000: the owner of both shards crashed after
//!    answering w0 with v6 of shard 0 and w2 with v6 of shard 1; shard 0's
//!    restored round 5 held w2's re-push and waited for w0, which waited
//!    for shard 1's round 5, which waited for w2. Now each worker's
//!    heartbeat carries the version of each shard it holds
//!    (`Heartbeat::shard_versions`, set as each exchange ends), and a
//!    restored core takes up the newest a live worker holds
//!    (`ShardCore::take_up`): round 5 is applied with what it has and both
//!    pulls are answered. Off (`Setup::heartbeat_versions`), the same
//!    seeds find it again.
//! 4. (Fixed.) A push refused as `Stale` that no owner ever took is given
//!    to the round in progress, and so was a worker's first. A joiner's
//!    copy can be a round old on some shards and current on others (a
//!    donor serves its model as of its last pull): rejoining put it a round
//!    ahead of the others on those shards and in step on the rest, and two
//!    joiners a round apart on different shards waited on each other until
//!    the round timeout. So did the joiners of the 64-process swarm whose
//!    first pushes were `Stale`. Now a worker's first exchange drops such a
//!    gradient and pulls the current version (as backup workers always
//!    did): its next step is in the round in progress on every shard.
//!    Later exchanges still rejoin (after a partition heals that is what
//!    keeps workers in step; partitions are not modelled here). A refusal
//!    whose answer is lost drops the gradient the same way (the retry
//!    cannot tell it from a push its round took, finding 1).
//! 5. (Fixed.) A leaver stops as soon as its transfers are answered, and
//!    its last gossip can die with it (the CI failure of 2026-12-07). A
//!    node that never heard it leave forwards the transfer back to it, as
//!    finding 2, and the send fails only after the handoff timeout; the
//!    failure timeout drops the leaver from that node's view first, and
//!    the placement then makes the node the owner with the old owner gone:
//!    it restored from an older copy while the newest one was still in its
//!    own send, and the rounds only that copy held were lost. Now an owner
//!    waits for its own transfer of the shard still on the wire (the
//!    aggregator's `sending`), which installs it when it comes back. The
//!    leave setups let the leave go unheard (`Faults::unheard_leave`).
//! 6. (Fixed.) A node whose view never heard a leave goes from a placement
//!    naming the leaver the owner straight to one naming itself, the
//!    leaver gone: it restored an older copy at once, while the placement
//!    it skipped had given the shard to a third node, which applied rounds
//!    and then handed it over (or kept the leaver's bounced transfer to
//!    pass on). The copy was fenced, or the restore itself threw rounds
//!    away. Now a heartbeat's `owned_shards` also names the shards whose
//!    transfer the node keeps or sends, and a new owner whose old owner is
//!    gone waits for a live node that names the shard
//!    (`Setup::claims_awaited`); and a restored core that has not closed a
//!    round yields to a copy of its own number, handing it its round
//!    (`ShardCore::yields_to`, `Setup::restored_yields`). The model drops a
//!    stopped node from the view only once every node has heard each live
//!    one since the stop, as the failure timeout's several heartbeat
//!    periods give (`World::claims_heard_since`). Without both rules, seed
//!    9,306 of 30,000 finds it.
//! 7. (Fixed.) Found once a node may read its own worker's versions at a
//!    later heartbeat, as it reads its peers' (the node reads them as each
//!    exchange ends; the model covers that and later): a restored core
//!    handed over before its first
//!    full round arrived settled, so a push against the newer version the
//!    crashed owner had given its worker joined the round in progress
//!    instead of moving the numbering, and the gradient counted twice. Now
//!    a transfer carries the restored core's catch-up room
//!    (`Handoff::catch_up_room`, `Setup::room_travels`). Without it, seed
//!    15,116 of 30,000 finds it.
//!
//! # Replaying a seed
//!
//! A failing run prints its seed, its setup and the tail of its trace.
//! `SHOAL_EXPLORE_SEED=N cargo test -p shoal-node --lib policy::explorer`
//! runs only seed N in every explorer test and prints its whole trace.
//! `SHOAL_EXPLORE_SEEDS=N` runs the first N seeds of each test instead of
//! its budget, and `SHOAL_EXPLORE_SURVEY=1` runs them all and prints the
//! failures by kind with the shortest run of each (add `-- --nocapture`).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::{self, Write as _};
use std::ops::Range;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use shoal_models::{Optimizer, OptimizerConfig, OptimizerState};

use crate::policy::backoff::Backoff;
use crate::policy::exchange::{ExchangeAction, Exchanged, PullAnswer, PushAnswer, ShardExchange};
use crate::policy::sync::{PushOutcome, ShardCore, SyncPolicy};

/// A node: a worker, and an owner of the shards the placement gives it.
type Node = usize;
/// A gradient: the worker that computed it and its step.
type Grad = (Node, u64);

/// The room `mark_restored` gets (`restored` with `replica_every = 0`).
const ROOM: u64 = 16;
/// A replica lags its owner by at most this many versions.
const REPLICA_LAG: usize = 3;
/// `aggregator::MAX_TRANSFER_HOPS`.
const MAX_HOPS: u64 = 4;
/// The exchange's deadline: never reached in the model.
const NO_DEADLINE: Duration = Duration::from_secs(3600);
/// Rounds of expired pulls without progress before a run is stuck.
const STALLS: u32 = 3;
/// Events without progress before a run is a livelock.
const IDLE_EVENTS: usize = 5_000;
/// Trace lines printed with a failure.
const TRACE_TAIL: usize = 80;
/// A parameter change smaller than this is none.
const EPS: f32 = 1e-3;
/// The variable naming one seed to replay.
const SEED_VAR: &str = "SHOAL_EXPLORE_SEED";
/// The variable that makes a test run all its seeds and sort the failures
/// by kind, with the shortest run of each (`SHOAL_EXPLORE_SURVEY=1`).
const SURVEY_VAR: &str = "SHOAL_EXPLORE_SURVEY";
/// The variable that sets how many seeds each test runs (a longer search).
const SEEDS_VAR: &str = "SHOAL_EXPLORE_SEEDS";

macro_rules! note {
    ($world:expr, $($arg:tt)*) => {
        if $world.verbose {
            let line = format!($($arg)*);
            let at = $world.events;
            $world.trace.push(format!("{at:>5} {line}"));
        }
    };
}

/// The rounds a shard's parameters reflect, oldest first.
#[derive(Clone, Default)]
struct Lineage {
    rounds: Vec<Vec<Grad>>,
    all: BTreeSet<Grad>,
}

impl Lineage {
    /// Adds a round; returns the gradients already applied in this lineage.
    fn apply(&mut self, round: Vec<Grad>) -> Vec<Grad> {
        let twice = round.iter().copied().filter(|g| !self.all.insert(*g)).collect();
        self.rounds.push(round);
        twice
    }
}

impl fmt::Debug for Lineage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.rounds)
    }
}

/// A shard's state as it travels: a transfer, a replica, a kept copy.
#[derive(Clone)]
struct Snapshot {
    version: u64,
    params: Vec<f32>,
    optimizer: OptimizerState,
    lineage: Lineage,
    /// The restore that started this lineage (0: none).
    epoch: u32,
    /// A restored core not yet settled: its catch-up room, which its
    /// transfer carries (`Handoff::catch_up_room`); 0 otherwise.
    room: u64,
}

impl fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v{} epoch {} ({} rounds)", self.version, self.epoch, self.lineage.rounds.len())
    }
}

/// The values a pull brings: the parameters, with the lineage they reflect.
#[derive(Clone)]
struct Pulled {
    params: Vec<f32>,
    lineage: Lineage,
    epoch: u32,
}

impl fmt::Debug for Pulled {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "epoch {} ({} rounds)", self.epoch, self.lineage.rounds.len())
    }
}

/// A shard served at a node.
#[derive(Debug)]
struct Held {
    core: ShardCore<Node>,
    lineage: Lineage,
    /// The last few states, newest last: where a replica comes from.
    history: Vec<Snapshot>,
    epoch: u32,
}

impl Held {
    fn snapshot(&self) -> Snapshot {
        let (params, optimizer, version) = self.core.export();
        let room = self.core.restore_room();
        Snapshot { version, params, optimizer, lineage: self.lineage.clone(), epoch: self.epoch, room }
    }

    fn pulled(&self) -> Pulled {
        Pulled { params: self.core.params().to_vec(), lineage: self.lineage.clone(), epoch: self.epoch }
    }

    fn remember(&mut self) {
        let s = self.snapshot();
        self.history.push(s);
        let extra = self.history.len().saturating_sub(REPLICA_LAG + 1);
        self.history.drain(..extra);
    }

    /// Runs `f` on the core and reads the rounds it applied off the
    /// parameters into the lineage. `pushed`: the gradient a push carried.
    /// Returns `f`'s result and the gradients applied a second time.
    fn observe<T>(
        &mut self,
        pushed: Option<(Grad, &[f32])>,
        f: impl FnOnce(&mut ShardCore<Node>) -> T,
    ) -> Result<(T, Vec<Grad>), String> {
        let params = self.core.params().to_vec();
        let (version, skipped) = (self.core.version(), self.core.skipped());
        let out = f(&mut self.core);
        let moved = self.core.version().checked_sub(version).ok_or("the core's version went back")?;
        let jumped = self.core.skipped() - skipped;
        let steps = moved.checked_sub(jumped).ok_or("more versions skipped than moved")?;
        let mut delta: Vec<f32> = params.iter().zip(self.core.params()).map(|(b, a)| b - a).collect();
        let mut twice = Vec::new();
        match (steps, pushed) {
            (0, _) if delta.iter().any(|d| d.abs() > EPS) => return Err("parameters moved without a step".into()),
            (0, _) => {}
            (1, _) => twice = self.lineage.apply(decode(&delta)?),
            (2, Some((g, grad))) => {
                // Catch-up applied the round it held; this push alone then
                // made a quorum (a round of one).
                delta.iter_mut().zip(grad).for_each(|(d, x)| *d -= x);
                twice = self.lineage.apply(decode(&delta)?);
                twice.extend(self.lineage.apply(vec![g]));
            }
            (n, _) => return Err(format!("{n} rounds applied in one call")),
        }
        if moved > 0 {
            self.remember();
        }
        Ok((out, twice))
    }
}

/// The gradients a round's mean update is made of: each present worker's
/// entry is `(step + 1) / n`.
fn decode(delta: &[f32]) -> Result<Vec<Grad>, String> {
    let present: Vec<usize> = (0..delta.len()).filter(|&w| delta[w].abs() > EPS).collect();
    let n = present.len() as f32;
    present
        .into_iter()
        .map(|w| {
            let x = delta[w] * n;
            let k = x.round();
            if k < 1.0 || (x - k).abs() > 0.05 {
                Err(format!("the update {delta:?} is no mean of whole gradients"))
            } else {
                Ok((w, k as u64 - 1))
            }
        })
        .collect()
}

/// Worker `w`'s gradient of step `k`: `k + 1` at index `w`.
fn gradient((w, k): Grad, len: usize) -> Vec<f32> {
    let mut g = vec![0.0; len];
    g[w] = (k + 1) as f32;
    g
}

fn sgd(len: usize) -> Result<Optimizer, String> {
    let cfg = OptimizerConfig::Sgd { lr: 1.0, momentum: 0.0, nesterov: false, weight_decay: 0.0 };
    Optimizer::new(cfg, len).map_err(|e| e.to_string())
}

#[derive(Debug)]
enum Body {
    Push { shard: usize, base: u64, grad: Grad, then_pull: bool },
    Pull { shard: usize, min: u64 },
    Batch { items: Vec<(usize, u64)>, grad: Grad },
    PushAnswer { shard: usize, answer: PushAnswer<Node, Pulled> },
    PullAnswer { shard: usize, answer: PullAnswer<Node, Pulled> },
    BatchAnswer { answers: Vec<(usize, PushAnswer<Node, Pulled>)> },
    Transfer { shard: usize, snap: Snapshot, history: Vec<Snapshot>, hops: u64 },
}

/// A message on the wire. `re`: the request it is, or answers.
#[derive(Debug)]
struct Msg {
    re: u64,
    from: Node,
    to: Node,
    body: Body,
}

/// Who sent a request, to whom, and its id.
#[derive(Debug, Clone, Copy)]
struct Head {
    from: Node,
    to: Node,
    re: u64,
}

/// How a parked pull is answered.
#[derive(Debug)]
enum Waiter {
    Pull,
    /// The pull riding on an accepted `PushPull`.
    ThenPull {
        accepted: u64,
    },
    /// The same, for entry `index` of a batch.
    Batch {
        index: usize,
        accepted: u64,
    },
}

#[derive(Debug)]
struct Parked {
    worker: Node,
    shard: usize,
    min: u64,
    re: u64,
    waiter: Waiter,
}

/// What a parked pull gets.
enum Verdict {
    State(u64, Pulled),
    NotReady(u64),
    NotOwner(Option<Node>),
}

#[derive(Debug)]
struct BatchWait {
    worker: Node,
    answers: Vec<Option<(usize, PushAnswer<Node, Pulled>)>>,
}

/// A copy kept but not served: a replica, or an early or hopped transfer.
#[derive(Debug)]
struct Stored {
    snap: Snapshot,
    history: Vec<Snapshot>,
    transfer: bool,
    hops: u64,
    /// Kept at the hop limit: passed on again by the retry timer.
    retry: bool,
}

/// A node's aggregator.
#[derive(Debug, Default)]
struct Agg {
    cores: BTreeMap<usize, Held>,
    pending: BTreeSet<usize>,
    stored: BTreeMap<usize, Stored>,
    parked: Vec<Parked>,
    batches: BTreeMap<u64, BatchWait>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// A node that joins the run later: not in the placement yet, or in it
    /// and waiting for every node to take up that placement (an owner
    /// answers a push from a worker its view does not hold `UnknownWorker`,
    /// which the real worker retries for a quarter of its time).
    Joining,
    Training,
    Left,
    Finished,
    Dead,
}

/// One shard's exchange of the step in hand.
#[derive(Debug)]
struct Slot {
    machine: ShardExchange<Node, Pulled>,
    /// The request whose answer it waits for.
    waiting: Option<u64>,
    done: Option<Exchanged<Pulled>>,
    /// An owner answered `UnknownWorker`: the gradient was dropped.
    unknown: bool,
}

#[derive(Debug)]
struct WorkerState {
    phase: Phase,
    /// A joiner: the placement it came into.
    joined_in: Option<usize>,
    /// An exchange of this worker has completed.
    exchanged: bool,
    step: u64,
    leave: bool,
    slots: Vec<Slot>,
    versions: Vec<u64>,
    pulled: Vec<Pulled>,
}

#[derive(Debug)]
struct NodeState {
    alive: bool,
    /// The placement it has taken up.
    seen: usize,
    agg: Agg,
    worker: WorkerState,
}

#[derive(Debug, Clone)]
struct Placement {
    owners: Vec<Node>,
    workers: BTreeSet<Node>,
    live: BTreeSet<Node>,
    leaving: BTreeSet<Node>,
}

impl Placement {
    /// The nodes that may own shards.
    fn eligible(&self) -> Vec<Node> {
        self.live.iter().copied().filter(|n| !self.leaving.contains(n)).collect()
    }
}

/// The faults a run may inject, and how many.
#[derive(Debug, Clone, Copy, Default)]
struct Faults {
    loss: bool,
    crash: bool,
    moves: bool,
    leave: bool,
    /// A new owner's handoff timeout may race a transfer still on its way.
    slow_handoff: bool,
    /// A leaver that stops may lose the answers it has not delivered yet
    /// (those it sent as it handed its shards off).
    abrupt_exit: bool,
    /// A leaver's announcement may reach some node only after the failure
    /// timeout has dropped the stopped leaver from that node's view (it
    /// stops as soon as its transfers are answered, and its last gossip can
    /// die with it): that node goes from a placement naming the leaver an
    /// owner straight to one without it.
    unheard_leave: bool,
    count: u32,
}

#[derive(Debug, Clone, Copy)]
struct Setup {
    workers: usize,
    /// Nodes that join while the run trains (after the `workers`).
    joiners: usize,
    shards: usize,
    steps: u64,
    push_pull: bool,
    batch: bool,
    catch_up: bool,
    /// A worker's first exchange gives a push that missed its round to the
    /// round in progress, as every exchange does (before finding 4).
    rejoin: bool,
    /// A new owner whose old owner is gone restores the shard even while
    /// its own transfer of it is on the wire (before finding 5).
    restore_beside_own_send: bool,
    /// Every shard starts at one owner (the shape of issue 16).
    colocated: bool,
    /// Heartbeats carry the versions each worker holds, and a restored
    /// core takes up the newest a live worker holds (finding 3's fix);
    /// off, as before it.
    heartbeat_versions: bool,
    /// A restored core that has applied no full round yields to a copy
    /// handed over at its own version (finding 6's fix); off, it fences it.
    restored_yields: bool,
    /// A new owner whose old owner is gone waits for a live node whose
    /// heartbeat says it owns the shard (finding 6's fix); off, it restores.
    claims_awaited: bool,
    /// A restored core handed over before it settled keeps its catch-up
    /// room at its new owner (finding 7's fix); off, it arrives settled.
    room_travels: bool,
    faults: Faults,
}

type MakeSetup = fn(&mut StdRng) -> Setup;

#[derive(Debug, Clone, Copy, Default)]
struct Stats {
    events: usize,
    faults: u32,
    crashes: u32,
    leaves: u32,
    moves: u32,
    restores: u32,
    fenced: u32,
    catch_ups: u32,
    /// Gradients applied a second time after their push's answer was lost.
    twice: u32,
    /// Pushes refused as `Stale` although the round they were for was
    /// applied with them, after an answer was lost (finding 1's first step).
    rejoins: u32,
    /// Transfers that met a stopped node and were kept by their sender to
    /// pass on (finding 2's first step).
    bounced: u32,
    joins: u32,
    /// Gradients dropped after a lost answer to a `Stale` refusal.
    refused_dropped: u32,
    /// Gradients refused as `Stale`, never taken, and dropped (finding 4).
    stale_dropped: u32,
    /// Shards a new owner awaited from its own transfer still on the wire
    /// instead of restoring them, the old owner gone (finding 5).
    own_awaited: u32,
    /// Restored cores that took up a version a live worker's heartbeat
    /// named (finding 3's fix).
    taken_up: u32,
    /// Restored cores replaced by a copy handed over at their own version
    /// (finding 6's fix).
    yielded: u32,
    /// Shards a new owner awaited from a live node whose heartbeat said it
    /// owned them, the old owner gone (finding 6's fix).
    claim_awaited: u32,
}

impl Setup {
    /// Every node, joiners too: the length of the parameters (one entry
    /// per node, see [`gradient`]).
    fn nodes(&self) -> usize {
        self.workers + self.joiners
    }
}

impl Stats {
    fn add(&mut self, o: &Stats) {
        self.events += o.events;
        self.faults += o.faults;
        self.crashes += o.crashes;
        self.leaves += o.leaves;
        self.moves += o.moves;
        self.restores += o.restores;
        self.fenced += o.fenced;
        self.catch_ups += o.catch_ups;
        self.twice += o.twice;
        self.rejoins += o.rejoins;
        self.bounced += o.bounced;
        self.joins += o.joins;
        self.refused_dropped += o.refused_dropped;
        self.stale_dropped += o.stale_dropped;
        self.own_awaited += o.own_awaited;
        self.taken_up += o.taken_up;
        self.yielded += o.yielded;
        self.claim_awaited += o.claim_awaited;
    }
}

#[derive(Debug, Clone, Copy)]
enum Event {
    Deliver(usize),
    Act(Node, usize),
    Catch(Node),
    Retry(Node, usize),
    HandoffTimeout(Node, usize),
    Exit(Node),
    Forget(Node),
    Expire(Node, usize),
    /// A joiner comes into the placement.
    Join(Node),
    /// A joiner every node counts fetches the model and starts training.
    Start(Node),
    /// Node `.0` hears worker `.1`'s heartbeat: the versions it holds.
    Hear(Node, Node),
}

#[derive(Debug, Clone, Copy)]
enum Fault {
    Lose(usize),
    TimeOut(usize),
    Crash(Node),
    Move(usize),
    Leave(Node),
}

enum Answer {
    Push(PushAnswer<Node, Pulled>),
    Pull(PullAnswer<Node, Pulled>),
}

struct World {
    setup: Setup,
    seed: u64,
    rng: StdRng,
    verbose: bool,
    trace: Vec<String>,
    placements: Vec<Placement>,
    nodes: Vec<NodeState>,
    flight: Vec<Msg>,
    next_id: u64,
    events: usize,
    fault_at: Vec<usize>,
    /// A fault that may lose applied rounds happened (a crash, a handoff
    /// timeout racing its transfer).
    lossy: bool,
    /// Gradients of rounds a fault threw away, per shard.
    discarded: BTreeSet<(usize, Grad)>,
    /// Gradients workers pulled the round of, per shard.
    counted: BTreeSet<(usize, Grad)>,
    /// Pushes (shard, gradient) of which an attempt failed at the worker:
    /// taken or not, the worker cannot tell.
    blind: BTreeSet<(usize, Grad)>,
    /// Pushes (shard, gradient) refused as `Stale` while no core had
    /// applied them.
    refused: BTreeSet<(usize, Grad)>,
    /// The newest version per shard and lineage epoch.
    high: BTreeMap<(usize, u32), u64>,
    /// The last restore epoch per shard.
    epochs: Vec<u32>,
    /// Every gradient any core of the shard applied.
    applied: Vec<BTreeSet<Grad>>,
    /// The placement each leaving node announced itself in.
    left_at: BTreeMap<Node, usize>,
    /// A transfer met a node that had stopped, or a node stopped with a
    /// kept transfer (finding 2 may follow), or a node restored a shard
    /// while its own transfer of it was on the wire (finding 5's rule).
    stranded: bool,
    /// The newest version per worker and shard its exchanges got.
    received: Vec<Vec<u64>>,
    /// Per worker, the version of each shard its heartbeat names now (the
    /// real `SelfState::shard_versions`: set as each exchange ends).
    hold: Vec<Vec<u64>>,
    /// `heard[n][w]`: worker `w`'s versions in the last heartbeat of it
    /// that node `n` heard.
    heard: Vec<Vec<Vec<u64>>>,
    /// `claims[n][w]`: the shards worker `w`'s last heartbeat that node `n`
    /// heard says its node owns (`Heartbeat::owned_shards`, its placement's).
    claims: Vec<Vec<BTreeSet<usize>>>,
    /// `heard_at[n][w]`: when node `n` last heard worker `w` (an event count).
    heard_at: Vec<Vec<usize>>,
    /// When each stopped node stopped (an event count).
    stopped_at: BTreeMap<Node, usize>,
    /// The version of each shard a crashed node held.
    lost_versions: BTreeMap<usize, u64>,
    progressed: bool,
    idle: usize,
    stalls: u32,
    stats: Stats,
}

impl World {
    fn new(seed: u64, make: MakeSetup, verbose: bool) -> Result<Self, String> {
        let mut rng = StdRng::seed_from_u64(seed);
        let setup = make(&mut rng);
        let (nw, ns, total) = (setup.workers, setup.shards, setup.workers + setup.joiners);
        let one = rng.random_range(0..nw);
        let owners: Vec<Node> = (0..ns).map(|_| if setup.colocated { one } else { rng.random_range(0..nw) }).collect();
        let all: BTreeSet<Node> = (0..nw).collect();
        let first = Placement { owners: owners.clone(), workers: all.clone(), live: all, leaving: BTreeSet::new() };
        let span = 10 * nw * ns * setup.steps as usize;
        let mut fault_at: Vec<usize> = (0..setup.faults.count).map(|_| rng.random_range(0..span)).collect();
        fault_at.sort_unstable();
        let blank = Pulled { params: vec![0.0; total], lineage: Lineage::default(), epoch: 0 };
        let nodes = (0..total)
            .map(|n| NodeState {
                alive: true,
                seen: 0,
                agg: Agg::default(),
                worker: WorkerState {
                    phase: if n < nw { Phase::Training } else { Phase::Joining },
                    joined_in: None,
                    exchanged: false,
                    step: 0,
                    leave: false,
                    slots: Vec::new(),
                    versions: vec![0; ns],
                    pulled: vec![blank.clone(); ns],
                },
            })
            .collect();
        let mut world = World {
            setup,
            seed,
            rng,
            verbose,
            trace: Vec::new(),
            placements: vec![first],
            nodes,
            flight: Vec::new(),
            next_id: 0,
            events: 0,
            fault_at,
            lossy: false,
            discarded: BTreeSet::new(),
            counted: BTreeSet::new(),
            blind: BTreeSet::new(),
            refused: BTreeSet::new(),
            high: BTreeMap::new(),
            epochs: vec![0; ns],
            applied: vec![BTreeSet::new(); ns],
            left_at: BTreeMap::new(),
            stranded: false,
            received: vec![vec![0; ns]; total],
            hold: vec![vec![0; ns]; total],
            heard: vec![vec![vec![0; ns]; total]; total],
            claims: vec![vec![BTreeSet::new(); total]; total],
            heard_at: vec![vec![0; total]; total],
            stopped_at: BTreeMap::new(),
            lost_versions: BTreeMap::new(),
            progressed: false,
            idle: 0,
            stalls: 0,
            stats: Stats::default(),
        };
        note!(world, "setup {setup:?}, owners {owners:?}");
        for (s, &o) in owners.iter().enumerate() {
            let optimizer = sgd(total)?.state().clone();
            let snap = Snapshot {
                version: 0,
                params: vec![0.0; total],
                optimizer,
                lineage: Lineage::default(),
                epoch: 0,
                room: 0,
            };
            world.install(o, s, snap, Vec::new(), false)?;
        }
        for w in 0..nw {
            world.start_step(w);
        }
        Ok(world)
    }

    /// Runs to the end: every worker done, or a failed check.
    fn run(&mut self) -> Result<(), String> {
        loop {
            // A joiner that has not come in by the time every worker is
            // done never will (a node joins a run that trains).
            if self.nodes.iter().all(|n| !n.alive || n.worker.phase != Phase::Training) && !self.joining() {
                self.stats.events = self.events;
                return self.final_check();
            }
            if self.fault_at.first().is_some_and(|&t| t <= self.events) {
                self.fault_at.remove(0);
                self.inject_fault()?;
            }
            let (active, parked) = self.enabled();
            if active.is_empty() {
                self.stall(parked)?;
                continue;
            }
            let total: u32 = active.iter().map(|e| e.1).sum::<u32>() + u32::from(parked > 0);
            let mut r = self.rng.random_range(0..total);
            let mut event = None;
            for &(e, weight) in &active {
                if r < weight {
                    event = Some(e);
                    break;
                }
                r -= weight;
            }
            let event = match event {
                Some(e) => e,
                None => self.random_expiry(),
            };
            self.events += 1;
            self.progressed = false;
            self.apply(event)?;
            if self.progressed {
                self.idle = 0;
                self.stalls = 0;
            } else {
                self.idle += 1;
                if self.idle > IDLE_EVENTS {
                    return Err(format!("livelock: {IDLE_EVENTS} events without progress\n{}", self.dump()));
                }
            }
        }
    }

    /// The events that can happen now, with weights, and how many pulls
    /// are parked (their waits are timers, fired rarely).
    fn enabled(&self) -> (Vec<(Event, u32)>, usize) {
        let mut ev: Vec<(Event, u32)> = (0..self.flight.len()).map(|i| (Event::Deliver(i), 4)).collect();
        let latest = self.placements.len() - 1;
        let mut parked = 0;
        for (n, node) in self.nodes.iter().enumerate().filter(|(_, x)| x.alive) {
            if node.worker.phase == Phase::Training {
                for (s, slot) in node.worker.slots.iter().enumerate() {
                    if slot.waiting.is_none() && slot.done.is_none() {
                        ev.push((Event::Act(n, s), 3));
                    }
                }
            }
            if node.seen < latest {
                ev.push((Event::Catch(n), 2));
            }
            for (&s, st) in &node.agg.stored {
                if st.retry {
                    ev.push((Event::Retry(n, s), 1));
                }
            }
            for &s in &node.agg.pending {
                if self.setup.faults.slow_handoff || !self.handoff_coming(n, s) {
                    ev.push((Event::HandoffTimeout(n, s), 1));
                }
            }
            if node.worker.phase == Phase::Left && self.drained(n) {
                ev.push((Event::Exit(n), 1));
            }
            parked += node.agg.parked.len();
            if node.worker.phase == Phase::Joining {
                match node.worker.joined_in {
                    None if self.training() => {
                        ev.push((Event::Join(n), 1));
                    }
                    Some(at) if self.nodes.iter().all(|x| !x.alive || x.seen >= at) => {
                        ev.push((Event::Start(n), 2));
                    }
                    _ => {}
                }
            }
        }
        // Heartbeats with news: a worker's versions changed since `n` last
        // heard it.
        // What each node's heartbeat would claim now (once, not per pair).
        let owns: Vec<BTreeSet<usize>> = (0..self.nodes.len()).map(|w| self.owns(w)).collect();
        if self.setup.heartbeat_versions {
            for (n, node) in self.nodes.iter().enumerate().filter(|(_, x)| x.alive) {
                let live = &self.placements[node.seen].live;
                // Its own worker's too: the node reads them at its next
                // heartbeat, as it reads the others'.
                for w in
                    live.iter().copied().filter(|&w| w != n).chain(std::iter::once(n)).filter(|&w| self.nodes[w].alive)
                {
                    if self.heard[n][w] != self.hold[w] || self.claims[n][w] != owns[w] {
                        ev.push((Event::Hear(n, w), 1));
                    }
                }
            }
        }
        // A stopped node leaves the view a failure timeout later, when every
        // node has long heard that it was leaving (unless its announcement
        // may go unheard).
        for (&n, &at) in &self.left_at {
            let heard = self.setup.faults.unheard_leave || self.nodes.iter().all(|x| !x.alive || x.seen >= at);
            if !self.nodes[n].alive
                && self.placements[latest].live.contains(&n)
                && heard
                && self.claims_heard_since(n, &owns)
            {
                ev.push((Event::Forget(n), 1));
            }
        }
        (ev, parked)
    }

    /// The failure timeout spans several heartbeat periods: a node drops a
    /// stopped peer only after it has heard every live worker's heartbeat
    /// sent since that peer stopped (or already knows what it would say),
    /// unless that heartbeat is lost for good, which gossip's repeats every
    /// period rule out here. Its claims of shards (`owned_shards`) are then
    /// those of after the stop.
    /// `owns`: each node's claims now ([`Self::owns`]).
    fn claims_heard_since(&self, stopped: Node, owns: &[BTreeSet<usize>]) -> bool {
        let Some(&at) = self.stopped_at.get(&stopped) else { return true };
        let alive: Vec<Node> = (0..self.nodes.len()).filter(|&n| self.nodes[n].alive).collect();
        alive
            .iter()
            .all(|&n| alive.iter().all(|&w| w == n || self.heard_at[n][w] >= at || self.claims[n][w] == owns[w]))
    }

    /// A transfer of `shard` is on its way to `n` or will be sent: on the
    /// wire, kept somewhere, or served by a node yet to hand it over.
    fn handoff_coming(&self, n: Node, shard: usize) -> bool {
        self.flight.iter().any(|m| matches!(m.body, Body::Transfer { shard: s, .. } if s == shard))
            || self.nodes.iter().enumerate().any(|(i, x)| {
                i != n
                    && x.alive
                    && (x.agg.cores.contains_key(&shard) || x.agg.stored.get(&shard).is_some_and(|s| s.transfer))
            })
    }

    /// A leaving node holds nothing more (`Held::is_empty`).
    fn drained(&self, n: Node) -> bool {
        let agg = &self.nodes[n].agg;
        agg.cores.is_empty()
            && agg.pending.is_empty()
            && !agg.stored.values().any(|st| st.transfer)
            && self.sending(n).next().is_none()
    }

    /// The shards of `n`'s transfers on the wire (the aggregator's `sending`).
    fn sending(&self, n: Node) -> impl Iterator<Item = usize> + '_ {
        self.flight.iter().filter_map(move |m| match m.body {
            Body::Transfer { shard, .. } if m.from == n => Some(shard),
            _ => None,
        })
    }

    fn random_expiry(&mut self) -> Event {
        let all: Vec<(Node, usize)> = self
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, x)| x.alive)
            .flat_map(|(n, x)| (0..x.agg.parked.len()).map(move |i| (n, i)))
            .collect();
        let (n, i) = all[self.rng.random_range(0..all.len())];
        Event::Expire(n, i)
    }

    /// Nothing can happen but parked pulls' waits: fire them all, and fail
    /// if that has not helped [`STALLS`] times over.
    fn stall(&mut self, parked: usize) -> Result<(), String> {
        self.stalls += 1;
        if parked == 0 || self.stalls > STALLS {
            return Err(format!(
                "no progress possible: every worker waiting and nothing in flight; only the round timeout \
                 would close a round\n{}",
                self.dump()
            ));
        }
        note!(self, "stalled: every parked pull waits out its time");
        for n in 0..self.nodes.len() {
            while !self.nodes[n].agg.parked.is_empty() {
                self.expire(n, 0);
            }
        }
        Ok(())
    }

    fn apply(&mut self, event: Event) -> Result<(), String> {
        match event {
            Event::Deliver(i) => self.deliver(i),
            Event::Act(w, s) => self.act(w, s),
            Event::Catch(n) => self.place(n),
            Event::Retry(n, s) => self.retry_kept(n, s),
            Event::HandoffTimeout(n, s) => {
                if self.handoff_coming(n, s) {
                    // The transfer is still on its way: the timeout races it.
                    self.lossy = true;
                }
                note!(self, "n{n} shard {s}: handoff timeout, restoring");
                self.restore(n, s)?;
                self.release_ready(n)
            }
            Event::Exit(n) => {
                note!(self, "n{n} stops");
                self.stopped_at.insert(n, self.events);
                if self.nodes[n].agg.stored.values().any(|st| st.transfer) {
                    // `Held` does not count a kept transfer: it dies here.
                    note!(self, "  n{n} stops with a kept transfer");
                    self.stranded = true;
                }
                let node = &mut self.nodes[n];
                node.alive = false;
                node.agg = Agg::default();
                if self.setup.faults.abrupt_exit {
                    self.lose_answers_of(n);
                }
                Ok(())
            }
            Event::Forget(n) => self.forget(n),
            Event::Expire(n, i) => {
                self.expire(n, i);
                Ok(())
            }
            Event::Join(n) => self.join(n),
            Event::Start(n) => self.start_joiner(n),
            Event::Hear(n, w) => {
                note!(self, "n{n} hears w{w}'s heartbeat: versions {:?}", self.hold[w]);
                self.heard[n][w] = self.hold[w].clone();
                self.claims[n][w] = self.owns(w);
                self.heard_at[n][w] = self.events;
                let shards: Vec<usize> = self.nodes[n].agg.cores.keys().copied().collect();
                for s in shards {
                    self.take_up(n, s)?;
                }
                self.release_ready(n)
            }
        }
    }

    fn view(&self, n: Node) -> &Placement {
        &self.placements[self.nodes[n].seen]
    }

    /// The shards `w`'s heartbeat says its node owns (`owned_shards`): those
    /// its placement gives it, and those it keeps or sends a transfer of.
    fn owns(&self, w: Node) -> BTreeSet<usize> {
        let view = self.view(w);
        let kept = self.nodes[w].agg.stored.iter().filter(|(_, st)| st.transfer).map(|(s, _)| *s);
        (0..self.setup.shards).filter(|&s| view.owners[s] == w).chain(kept).chain(self.sending(w)).collect()
    }

    /// `NotOwner`'s hint: the owner in `n`'s placement, if another.
    fn hint(&self, n: Node, shard: usize) -> Option<Node> {
        Some(self.view(n).owners[shard]).filter(|o| *o != n)
    }

    fn send(&mut self, from: Node, to: Node, body: Body) -> u64 {
        self.next_id += 1;
        let re = self.next_id;
        self.flight.push(Msg { re, from, to, body });
        re
    }

    fn reply(&mut self, head: Head, body: Body) {
        self.flight.push(Msg { re: head.re, from: head.to, to: head.from, body });
    }

    /// Publishes the next placement; `origin` takes it up at once.
    fn reelect(
        &mut self,
        origin: Option<Node>,
        change: impl FnOnce(&mut Placement, &mut StdRng),
    ) -> Result<(), String> {
        let mut p = self.placements[self.placements.len() - 1].clone();
        change(&mut p, &mut self.rng);
        note!(self, "placement P{}: {p:?}", self.placements.len());
        self.placements.push(p);
        match origin {
            Some(n) => self.place(n),
            None => Ok(()),
        }
    }

    /// Records gradients a fault threw away; outside a lossy fault, throwing
    /// away an applied round is a lost update.
    fn discard(&mut self, shard: usize, loser: &Lineage, winner: &Lineage, why: &str) -> Result<(), String> {
        let lost: Vec<Grad> = loser.all.difference(&winner.all).copied().collect();
        if lost.is_empty() {
            return Ok(());
        }
        if !self.lossy {
            return Err(format!("shard {shard}: {why} threw away the applied gradients {lost:?} (lost update)"));
        }
        note!(self, "shard {shard}: {why} loses {lost:?}");
        self.discarded.extend(lost.into_iter().map(|g| (shard, g)));
        Ok(())
    }

    /// The whole state, for a failure.
    fn dump(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "placement P{}: {:?}", self.placements.len() - 1, self.placements.last());
        for (n, node) in self.nodes.iter().enumerate() {
            let w = &node.worker;
            let _ = writeln!(
                out,
                "n{n}: alive {}, seen P{}, {:?} at step {}, versions {:?}",
                node.alive, node.seen, w.phase, w.step, w.versions
            );
            for (s, h) in &node.agg.cores {
                let _ = writeln!(out, "  serves shard {s} (epoch {}): {:?}", h.epoch, h.core);
            }
            for p in &node.agg.parked {
                let _ = writeln!(out, "  parked: w{} shard {} for v{} ({:?})", p.worker, p.shard, p.min, p.waiter);
            }
            let _ = writeln!(out, "  pending {:?}, kept {:?}", node.agg.pending, node.agg.stored.keys());
            for (s, slot) in w.slots.iter().enumerate() {
                let state = match (&slot.waiting, &slot.done) {
                    (Some(re), _) => format!("waits for #{re}"),
                    (None, Some(x)) => format!("done at v{}", x.version),
                    (None, None) => "idle".into(),
                };
                let _ = writeln!(out, "  shard {s}: {state}; {:?}", slot.machine);
            }
        }
        out
    }
}

/// Workers.
impl World {
    fn start_step(&mut self, w: Node) {
        let k = self.nodes[w].worker.step;
        let owners = self.view(w).owners.clone();
        let mut batches: BTreeMap<Node, Vec<usize>> = BTreeMap::new();
        if self.setup.push_pull && self.setup.batch {
            for (s, &o) in owners.iter().enumerate().filter(|(_, o)| **o != w) {
                batches.entry(o).or_default().push(s);
            }
            batches.retain(|_, shards| shards.len() >= 2);
        }
        let versions = self.nodes[w].worker.versions.clone();
        // As `Worker::exchange_all`: a worker's first exchange drops a push
        // that missed its round (finding 4).
        let (seed, drop_stale) = (self.seed, !self.nodes[w].worker.exchanged && !self.setup.rejoin);
        let slots = (0..self.setup.shards)
            .map(|s| {
                let first = batches.iter().find(|(_, v)| v.contains(&s)).map(|(o, _)| *o);
                let ms = Duration::from_millis;
                let backoff = Backoff::seeded(ms(10), ms(500), seed ^ (w * 131 + s) as u64);
                let machine =
                    ShardExchange::new(s as u32, versions[s], SyncPolicy::Bsp, drop_stale, NO_DEADLINE, first, backoff);
                Slot { machine, waiting: None, done: None, unknown: false }
            })
            .collect();
        self.nodes[w].worker.slots = slots;
        note!(self, "w{w} starts step {k} on versions {versions:?}");
        for (owner, shards) in batches {
            let items = shards.iter().map(|&s| (s, versions[s])).collect();
            let re = self.send(w, owner, Body::Batch { items, grad: (w, k) });
            for s in shards {
                let slot = &mut self.nodes[w].worker.slots[s];
                // The machine's first push is the one that went in the batch.
                let _ = slot.machine.next(NO_DEADLINE, || Some(owner));
                slot.waiting = Some(re);
            }
        }
    }

    /// Worker `w` takes shard `s`'s exchange's next action.
    fn act(&mut self, w: Node, s: usize) -> Result<(), String> {
        let owner = self.view(w).owners[s];
        let k = self.nodes[w].worker.step;
        let action = self.nodes[w].worker.slots[s].machine.next(NO_DEADLINE, || Some(owner));
        let sent = match action {
            ExchangeAction::Push { owner, base } => {
                let then_pull = self.setup.push_pull && owner != w;
                note!(self, "w{w} shard {s}: push step {k} on v{base} to n{owner}");
                Some(self.send(w, owner, Body::Push { shard: s, base, grad: (w, k), then_pull }))
            }
            ExchangeAction::Pull { owner, min_version, .. } => {
                note!(self, "w{w} shard {s}: pull v{min_version} from n{owner}");
                Some(self.send(w, owner, Body::Pull { shard: s, min: min_version }))
            }
            ExchangeAction::WaitForChange(_) => {
                note!(self, "w{w} shard {s}: waits for the placement");
                None
            }
            ExchangeAction::Done(x) => {
                note!(self, "w{w} shard {s}: done at v{}", x.version);
                self.received[w][s] = self.received[w][s].max(x.version);
                self.hold[w][s] = x.version;
                self.nodes[w].worker.slots[s].done = Some(x);
                self.progressed = true;
                return self.finish_step(w);
            }
            ExchangeAction::GiveUp(m) => return Err(format!("w{w} shard {s} gave up: {m}")),
        };
        self.nodes[w].worker.slots[s].waiting = sent;
        Ok(())
    }

    /// Worker `w`'s step ends once every shard is in: check what it pulled,
    /// then the next step, or stop (last step, leaving).
    fn finish_step(&mut self, w: Node) -> Result<(), String> {
        if self.nodes[w].worker.slots.iter().any(|s| s.done.is_none()) {
            return Ok(());
        }
        let k = self.nodes[w].worker.step;
        let slots = std::mem::take(&mut self.nodes[w].worker.slots);
        for (s, slot) in slots.into_iter().enumerate() {
            if let Some(x) = slot.done {
                self.check_pulled(w, s, k, slot.unknown, x)?;
            }
        }
        let worker = &mut self.nodes[w].worker;
        worker.step += 1;
        worker.exchanged = true;
        if worker.step >= self.setup.steps {
            // Its heartbeat reaches the last step: owners wait for it no more.
            worker.phase = Phase::Finished;
            note!(self, "w{w} finished");
            return self.reelect(Some(w), |p, _| {
                p.workers.remove(&w);
            });
        }
        if worker.leave {
            worker.phase = Phase::Left;
            return self.leave_run(w);
        }
        self.start_step(w);
        Ok(())
    }

    /// A joiner not yet started, or not yet in the placement while some
    /// worker still trains.
    fn joining(&self) -> bool {
        let training = self.training();
        self.nodes
            .iter()
            .any(|x| x.alive && x.worker.phase == Phase::Joining && (x.worker.joined_in.is_some() || training))
    }

    /// Some live worker still trains.
    fn training(&self) -> bool {
        self.nodes.iter().any(|x| x.alive && x.worker.phase == Phase::Training)
    }

    /// Joiner `n` comes into the view: the next placement counts it as a
    /// worker and may move shards to it; each owner awaits it from the
    /// moment it takes that placement up (`ShardCore::set_workers`).
    fn join(&mut self, n: Node) -> Result<(), String> {
        self.stats.joins += 1;
        note!(self, "n{n} joins");
        let churn = self.churn();
        self.reelect(None, |p, rng| {
            p.workers.insert(n);
            p.live.insert(n);
            let eligible = p.eligible();
            for o in p.owners.iter_mut() {
                if rng.random_bool(churn / 2.0) {
                    *o = eligible[rng.random_range(0..eligible.len())];
                }
            }
        })?;
        self.nodes[n].worker.joined_in = Some(self.placements.len() - 1);
        Ok(())
    }

    /// Every node counts joiner `n`: it takes a donor's model (a training
    /// worker's last pulled copy, its versions and its step, as
    /// `join::start_step` maps them) and starts its first step. With no
    /// worker training any more, the run is over before it starts.
    fn start_joiner(&mut self, n: Node) -> Result<(), String> {
        let donors: Vec<Node> = (0..self.nodes.len())
            .filter(|&d| d != n && self.nodes[d].alive && self.nodes[d].worker.phase == Phase::Training)
            .collect();
        let Some(&d) = donors.get(self.rng.random_range(0..donors.len().max(1))) else {
            note!(self, "n{n}: the run ended before it started");
            self.nodes[n].worker.phase = Phase::Finished;
            return self.reelect(Some(n), |p, _| {
                p.workers.remove(&n);
            });
        };
        let (versions, pulled, step) = {
            let w = &self.nodes[d].worker;
            (w.versions.clone(), w.pulled.clone(), w.step)
        };
        note!(self, "n{n} starts from n{d}'s model at step {step}, versions {versions:?}");
        self.progressed = true;
        self.received[n] = versions.clone();
        let worker = &mut self.nodes[n].worker;
        (worker.versions, worker.pulled, worker.step, worker.phase) = (versions, pulled, step, Phase::Training);
        self.start_step(n);
        Ok(())
    }

    /// What worker `w` pulled for shard `s` after pushing step `k`.
    fn check_pulled(&mut self, w: Node, s: usize, k: u64, unknown: bool, x: Exchanged<Pulled>) -> Result<(), String> {
        let worker = &self.nodes[w].worker;
        let (before, epoch) = (worker.versions[s], worker.pulled[s].epoch);
        if x.version < before && (x.params.epoch == epoch || before - x.version > ROOM) {
            return Err(format!("w{w} shard {s}: version went back from v{before} to v{} (epoch {epoch})", x.version));
        }
        if unknown {
            return Err(format!("w{w} shard {s}: an owner did not count it as a worker; step {k} was dropped"));
        }
        let key = (s, (w, k));
        if x.params.lineage.all.contains(&(w, k)) {
            self.counted.insert(key);
        } else if x.dropped {
            // Refused as `Stale` by every owner it went to, and never taken:
            // dropped, and the worker pulled the version then current
            // (finding 4).
            if self.applied[s].contains(&(w, k)) {
                return Err(format!("w{w} shard {s}: step {k} was dropped as stale, yet an owner applied it"));
            }
            self.stats.stale_dropped += 1;
        } else if self.refused.contains(&key) && self.blind.contains(&key) && !self.applied[s].contains(&(w, k)) {
            // A push refused as `Stale` (its model was a round old: a
            // joiner's fetched copy), the answer lost. The retry, refused
            // again, cannot tell that from a push its round took, so the
            // worker pulls and the gradient is dropped, as in finding 4.
            self.stats.refused_dropped += 1;
            note!(self, "  (w{w} shard {s}: step {k} refused as stale, the answer lost: dropped)");
        } else if !self.discarded.contains(&key) {
            return Err(format!(
                "w{w} shard {s}: step {k}'s gradient is not in v{} it pulled (lost update): {:?}",
                x.version, x.params.lineage
            ));
        }
        let worker = &mut self.nodes[w].worker;
        worker.versions[s] = x.version;
        worker.pulled[s] = x.params;
        Ok(())
    }

    /// `leave_run`: the node announces `Leaving`; its own election takes
    /// it out of the workers and gives its shards away at once. The agreed
    /// number of owners (the lower median of every member's proposal, the
    /// leaver's included) may change too: then other shards move as well.
    fn leave_run(&mut self, w: Node) -> Result<(), String> {
        self.stats.leaves += 1;
        note!(self, "w{w} leaves");
        let churn = self.churn();
        self.reelect(Some(w), |p, rng| {
            p.workers.remove(&w);
            p.leaving.insert(w);
            let eligible = p.eligible();
            if eligible.is_empty() {
                return;
            }
            for o in p.owners.iter_mut() {
                if *o == w || rng.random_bool(churn) {
                    *o = eligible[rng.random_range(0..eligible.len())];
                }
            }
        })?;
        self.left_at.insert(w, self.placements.len() - 1);
        Ok(())
    }

    /// A left node that stopped drops out of the view; without its
    /// proposal the agreed number of owners may change again, and shards
    /// move (some back where they were).
    fn forget(&mut self, n: Node) -> Result<(), String> {
        note!(self, "n{n} leaves the view");
        let churn = self.churn();
        self.reelect(None, |p, rng| {
            p.live.remove(&n);
            let eligible = p.eligible();
            for o in p.owners.iter_mut().filter(|_| !eligible.is_empty()) {
                if rng.random_bool(churn) {
                    *o = eligible[rng.random_range(0..eligible.len())];
                }
            }
        })
    }

    /// How likely each shard is to move at a leave: none, few or many.
    fn churn(&mut self) -> f64 {
        [0.0, 0.25, 0.6][self.rng.random_range(0..3)]
    }

    /// An answer reaches worker `w`: fed to its exchange if it waits for it.
    fn answer_worker(&mut self, head: Head, shard: usize, answer: Answer) {
        let node = &mut self.nodes[head.to];
        if !node.alive || node.worker.phase != Phase::Training {
            return;
        }
        let Some(slot) = node.worker.slots.get_mut(shard) else { return };
        if slot.waiting != Some(head.re) {
            note!(self, "  (w{} shard {shard}: answer to #{} no longer awaited)", head.to, head.re);
            return;
        }
        slot.waiting = None;
        let step = node.worker.step;
        match answer {
            Answer::Push(a) => {
                slot.unknown |= matches!(a, PushAnswer::UnknownWorker);
                if matches!(a, PushAnswer::Failed(_)) {
                    self.blind.insert((shard, (head.to, step)));
                }
                slot.machine.on_push(head.from, a);
            }
            Answer::Pull(a) => slot.machine.on_pull(head.from, a),
        }
    }
}

/// Owners.
impl World {
    fn deliver(&mut self, i: usize) -> Result<(), String> {
        let m = self.flight.swap_remove(i);
        note!(self, "#{} n{} -> n{}: {:?}", m.re, m.from, m.to, m.body);
        let head = Head { from: m.from, to: m.to, re: m.re };
        if !self.nodes[m.to].alive {
            return self.bounce(head, m.body);
        }
        match m.body {
            Body::Push { shard, base, grad, then_pull } => self.agg_push(head, shard, base, grad, then_pull),
            Body::Pull { shard, min } => self.agg_pull(head, shard, min),
            Body::Batch { items, grad } => self.agg_batch(head, items, grad),
            Body::PushAnswer { shard, answer } => {
                self.answer_worker(head, shard, Answer::Push(answer));
                Ok(())
            }
            Body::PullAnswer { shard, answer } => {
                self.answer_worker(head, shard, Answer::Pull(answer));
                Ok(())
            }
            Body::BatchAnswer { answers } => {
                for (s, a) in answers {
                    self.answer_worker(head, s, Answer::Push(a));
                }
                Ok(())
            }
            Body::Transfer { shard, snap, history, hops } => self.receive(head.to, shard, snap, history, hops),
        }
    }

    /// A message to a node that is gone: a request fails at its sender, an
    /// undeliverable transfer is kept by its sender as a transfer, to pass
    /// on (`transfer_failed`).
    fn bounce(&mut self, head: Head, body: Body) -> Result<(), String> {
        let back = Head { from: head.to, to: head.from, re: head.re };
        let failed = || String::from("the peer is gone");
        match body {
            Body::Push { shard, .. } => self.answer_worker(back, shard, Answer::Push(PushAnswer::Failed(failed()))),
            Body::Pull { shard, .. } => self.answer_worker(back, shard, Answer::Pull(PullAnswer::Failed(failed()))),
            Body::Batch { items, .. } => {
                for (s, _) in items {
                    self.answer_worker(back, s, Answer::Push(PushAnswer::Failed(failed())));
                }
            }
            Body::Transfer { shard, snap, history, hops } => {
                self.stranded = true;
                if self.lossy {
                    // The newest copy of the shard died with the crash too.
                    let v = self.lost_versions.entry(shard).or_insert(0);
                    *v = (*v).max(snap.version);
                    // Kept as a replica, which a restore may or may not use.
                    self.discard(shard, &snap.lineage, &Lineage::default(), "a transfer to a node that is gone")?;
                }
                if self.nodes[head.from].alive {
                    self.stats.bounced += 1;
                    let kept = Stored { snap, history, transfer: true, hops, retry: true };
                    self.store(head.from, shard, kept)?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Applies a push to `n`'s core of `shard`: its outcome, or the refusal
    /// when the shard is not served here.
    #[allow(clippy::type_complexity)]
    fn push_into(
        &mut self,
        n: Node,
        w: Node,
        shard: usize,
        base: u64,
        grad: Grad,
    ) -> Result<Result<PushOutcome, PushAnswer<Node, Pulled>>, String> {
        let Some(held) = self.nodes[n].agg.cores.get(&shard) else {
            return Ok(Err(if self.nodes[n].agg.pending.contains(&shard) {
                PushAnswer::Pending
            } else {
                PushAnswer::NotOwner { hint: self.hint(n, shard) }
            }));
        };
        let clock = held.core.clock(&w);
        let skipped = held.core.skipped();
        let g = gradient(grad, self.setup.nodes());
        let pushed = g.clone();
        let now = self.events as u64;
        let out = self.core_op(n, shard, Some((grad, &pushed)), |c| c.push(&w, base, 1, g, now))?;
        if let Some(held) = self.nodes[n].agg.cores.get(&shard) {
            self.progressed |= held.core.clock(&w) != clock;
            if held.core.skipped() > skipped {
                self.stats.catch_ups += 1;
            }
            // Applied by this core or one it replaced, the answer lost.
            let counted = self.applied[shard].contains(&grad) && self.blind.contains(&(shard, grad));
            if counted && matches!(out, Some(PushOutcome::Stale { .. })) {
                self.stats.rejoins += 1;
                note!(self, "  (n{n} shard {shard}: {grad:?} counted already, its answer lost: refused as stale)");
            }
            if !self.applied[shard].contains(&grad) && matches!(out, Some(PushOutcome::Stale { .. })) {
                self.refused.insert((shard, grad));
            }
        }
        note!(self, "  n{n} shard {shard}: push of {grad:?} on v{base} -> {out:?}");
        out.map(Ok).ok_or_else(|| format!("n{n} shard {shard}: the core went away"))
    }

    /// Runs `f` on `n`'s core of `shard` with the lineage kept up to date.
    fn core_op<T>(
        &mut self,
        n: Node,
        shard: usize,
        pushed: Option<(Grad, &[f32])>,
        f: impl FnOnce(&mut ShardCore<Node>) -> T,
    ) -> Result<Option<T>, String> {
        let Some(held) = self.nodes[n].agg.cores.get_mut(&shard) else { return Ok(None) };
        let before = held.core.version();
        let (out, twice) = held.observe(pushed, f).map_err(|e| format!("n{n} shard {shard}: {e}"))?;
        let (after, epoch) = (held.core.version(), held.epoch);
        for g in twice {
            if !self.blind.contains(&(shard, g)) {
                let rounds = &self.nodes[n].agg.cores.get(&shard).map(|h| h.lineage.clone()).unwrap_or_default();
                return Err(format!("n{n} shard {shard}: gradient {g:?} applied twice: {rounds:?}"));
            }
            // Known (see the module doc): a retried push whose answer was lost.
            self.stats.twice += 1;
            note!(self, "  n{n} shard {shard}: {g:?} applied a second time (its push's answer was lost)");
        }
        if after != before {
            self.progressed = true;
            if let Some(held) = self.nodes[n].agg.cores.get(&shard) {
                self.applied[shard].extend(held.lineage.all.iter().copied());
            }
            note!(self, "  n{n} shard {shard}: v{before} -> v{after}");
            let high = self.high.entry((shard, epoch)).or_insert(0);
            *high = (*high).max(after);
        }
        Ok(Some(out))
    }

    fn agg_push(&mut self, head: Head, shard: usize, base: u64, grad: Grad, then_pull: bool) -> Result<(), String> {
        let (n, w) = (head.to, head.from);
        match self.push_into(n, w, shard, base, grad)? {
            Ok(PushOutcome::Accepted { version, .. }) if then_pull => {
                let min = SyncPolicy::Bsp.pull_after_push(version);
                let waiter = Waiter::ThenPull { accepted: version };
                self.nodes[n].agg.parked.push(Parked { worker: w, shard, min, re: head.re, waiter });
            }
            Ok(out) => self.reply(head, Body::PushAnswer { shard, answer: outcome_answer(out) }),
            Err(refusal) => self.reply(head, Body::PushAnswer { shard, answer: refusal }),
        }
        self.release_ready(n)
    }

    fn agg_pull(&mut self, head: Head, shard: usize, min: u64) -> Result<(), String> {
        let n = head.to;
        let agg = &self.nodes[n].agg;
        if !agg.cores.contains_key(&shard) && !agg.pending.contains(&shard) {
            let hint = self.hint(n, shard);
            self.reply(head, Body::PullAnswer { shard, answer: PullAnswer::NotOwner { hint } });
            return Ok(());
        }
        self.nodes[n].agg.parked.push(Parked { worker: head.from, shard, min, re: head.re, waiter: Waiter::Pull });
        self.release_ready(n)
    }

    /// A `PushPullMany`: every push first; a refusal answers all at once.
    fn agg_batch(&mut self, head: Head, items: Vec<(usize, u64)>, grad: Grad) -> Result<(), String> {
        let (n, w) = (head.to, head.from);
        let mut taken = Vec::with_capacity(items.len());
        for &(shard, base) in &items {
            taken.push(match self.push_into(n, w, shard, base, grad)? {
                Ok(PushOutcome::Accepted { version, .. }) => Ok(version),
                Ok(out) => Err(outcome_answer(out)),
                Err(refusal) => Err(refusal),
            });
        }
        if taken.iter().any(Result::is_err) {
            let answers = items
                .iter()
                .zip(taken)
                .map(|(&(s, _), t)| (s, t.map_or_else(|refusal| refusal, |version| PushAnswer::Accepted { version })))
                .collect::<Vec<_>>();
            self.reply(head, Body::BatchAnswer { answers });
        } else {
            let answers = (0..items.len()).map(|_| None).collect();
            self.nodes[n].agg.batches.insert(head.re, BatchWait { worker: w, answers });
            for (index, (&(shard, _), t)) in items.iter().zip(taken).enumerate() {
                let accepted = t.unwrap_or_default();
                let min = SyncPolicy::Bsp.pull_after_push(accepted);
                let waiter = Waiter::Batch { index, accepted };
                self.nodes[n].agg.parked.push(Parked { worker: w, shard, min, re: head.re, waiter });
            }
        }
        self.release_ready(n)
    }

    /// Answers every parked pull whose condition holds (`release_ready`).
    fn release_ready(&mut self, n: Node) -> Result<(), String> {
        let mut i = 0;
        while i < self.nodes[n].agg.parked.len() {
            let agg = &self.nodes[n].agg;
            let p = &agg.parked[i];
            let verdict = match agg.cores.get(&p.shard) {
                Some(h) if h.core.lost_push(&p.worker, p.min) => Some(Verdict::NotOwner(self.hint(n, p.shard))),
                Some(h) if h.core.pull_ready(&p.worker, p.min, self.events as u64) => {
                    Some(Verdict::State(h.core.version(), h.pulled()))
                }
                Some(_) => None,
                None if agg.pending.contains(&p.shard) => None,
                None => Some(Verdict::NotOwner(self.hint(n, p.shard))),
            };
            match verdict {
                None => i += 1,
                Some(v) => {
                    let p = self.nodes[n].agg.parked.swap_remove(i);
                    self.resolve(n, p, v);
                }
            }
        }
        Ok(())
    }

    /// A parked pull's wait ran out.
    fn expire(&mut self, n: Node, i: usize) {
        let p = self.nodes[n].agg.parked.swap_remove(i);
        let current = self.nodes[n].agg.cores.get(&p.shard).map_or(0, |h| h.core.version());
        note!(self, "n{n}: the pull of w{} for shard {} (v{}) waited out its time", p.worker, p.shard, p.min);
        self.resolve(n, p, Verdict::NotReady(current));
    }

    fn resolve(&mut self, n: Node, p: Parked, v: Verdict) {
        let head = Head { from: p.worker, to: n, re: p.re };
        let shard = p.shard;
        match p.waiter {
            Waiter::Pull => {
                let answer = match v {
                    Verdict::State(version, params) => PullAnswer::State { version, params },
                    Verdict::NotReady(current_version) => PullAnswer::NotReady { current_version },
                    Verdict::NotOwner(hint) => PullAnswer::NotOwner { hint },
                };
                self.reply(head, Body::PullAnswer { shard, answer });
            }
            Waiter::ThenPull { accepted } => {
                self.reply(head, Body::PushAnswer { shard, answer: served(v, accepted) });
            }
            Waiter::Batch { index, accepted } => {
                let agg = &mut self.nodes[n].agg;
                let Some(b) = agg.batches.get_mut(&p.re) else { return };
                b.answers[index] = Some((shard, served(v, accepted)));
                if b.answers.iter().all(Option::is_some) {
                    if let Some(b) = agg.batches.remove(&p.re) {
                        let answers = b.answers.into_iter().flatten().collect();
                        self.reply(head, Body::BatchAnswer { answers });
                    }
                }
            }
        }
    }
}

/// Placements and handoffs.
impl World {
    /// Node `n` takes up the newest placement (`place`).
    fn place(&mut self, n: Node) -> Result<(), String> {
        let latest = self.placements.len() - 1;
        let old = self.placements[self.nodes[n].seen].clone();
        self.nodes[n].seen = latest;
        let new = self.placements[latest].clone();
        note!(self, "n{n} takes up P{latest}");
        let shards: Vec<usize> = self.nodes[n].agg.cores.keys().copied().collect();
        for &s in &shards {
            self.core_op(n, s, None, |c| c.set_workers(new.workers.iter().copied()))?;
        }
        for s in shards.into_iter().filter(|&s| new.owners[s] != n) {
            if let Some(held) = self.nodes[n].agg.cores.remove(&s) {
                let snap = held.snapshot();
                note!(self, "n{n} hands shard {s} at v{} to n{}", snap.version, new.owners[s]);
                self.send(n, new.owners[s], Body::Transfer { shard: s, snap, history: held.history, hops: 0 });
            }
        }
        let moved_on: Vec<usize> = self.nodes[n]
            .agg
            .stored
            .iter()
            .filter(|(s, st)| st.transfer && new.owners[**s] != n)
            .map(|(s, _)| *s)
            .collect();
        for s in moved_on {
            self.pass_on_stored(n, s, new.owners[s]);
        }
        self.nodes[n].agg.pending.retain(|s| new.owners[*s] == n);
        for s in 0..self.setup.shards {
            let agg = &self.nodes[n].agg;
            if new.owners[s] != n || agg.cores.contains_key(&s) || agg.pending.contains(&s) {
                continue;
            }
            let previous = old.owners[s];
            let kept = agg.stored.get(&s).is_some_and(|st| st.transfer);
            // Its own transfer of the shard still on the wire (`sending`):
            // wait for it to arrive or come back rather than restore.
            let sending = self.sending(n).any(|shard| shard == s);
            let gone = previous == n || !new.live.contains(&previous);
            // Another live node's heartbeat says it owns the shard: the
            // placement moved it there in a view this node skipped (a leave
            // it never heard), and that node hands it over now.
            let claimed = self.setup.claims_awaited
                && new.live.iter().any(|&w| w != n && self.nodes[w].alive && self.claims[n][w].contains(&s));
            if kept || (gone && !claimed && (!sending || self.setup.restore_beside_own_send)) {
                self.stranded |= gone && sending;
                self.restore(n, s)?;
            } else {
                if gone && sending {
                    self.stats.own_awaited += 1;
                } else if gone {
                    self.stats.claim_awaited += 1;
                }
                self.nodes[n].agg.pending.insert(s);
            }
        }
        self.release_ready(n)
    }

    /// Take a shard over without a transfer (`restore`): from a kept copy,
    /// or from this node's worker copy with a fresh optimizer state.
    fn restore(&mut self, n: Node, shard: usize) -> Result<(), String> {
        self.nodes[n].agg.pending.remove(&shard);
        if let Some(st) = self.nodes[n].agg.stored.remove(&shard) {
            note!(self, "n{n} shard {shard}: from a kept copy {:?} (transfer: {})", st.snap, st.transfer);
            return self.install(n, shard, st.snap, st.history, !st.transfer);
        }
        let worker = &self.nodes[n].worker;
        let version = worker.versions.iter().copied().min().unwrap_or(0);
        let pulled = worker.pulled[shard].clone();
        let optimizer = sgd(self.setup.nodes())?.state().clone();
        let (lineage, epoch) = (pulled.lineage, pulled.epoch);
        let snap = Snapshot { version, params: pulled.params, optimizer, lineage, epoch, room: 0 };
        note!(self, "n{n} shard {shard}: from the worker copy at v{version}");
        self.install(n, shard, snap, Vec::new(), true)
    }

    /// Serve `snap` at `n` (`install`), marked restored (`restored`) when
    /// it may be older than the workers' models.
    fn install(
        &mut self,
        n: Node,
        shard: usize,
        snap: Snapshot,
        mut history: Vec<Snapshot>,
        restored: bool,
    ) -> Result<(), String> {
        let workers = self.view(n).workers.clone();
        let optimizer = Optimizer::from_state(snap.optimizer.clone()).map_err(|e| e.to_string())?;
        let mut core = ShardCore::new(snap.params.clone(), optimizer, snap.version, SyncPolicy::Bsp, workers);
        if !self.setup.catch_up {
            core = core.without_catch_up();
        }
        let mut epoch = snap.epoch;
        if !restored && snap.room > 0 && self.setup.room_travels {
            // Handed over before it settled: it goes on catching up here.
            core.mark_restored(snap.room.min(ROOM));
        }
        if restored {
            core.mark_restored(ROOM);
            self.epochs[shard] += 1;
            epoch = self.epochs[shard];
            self.stats.restores += 1;
            // What any core applied and this copy lacks is lost.
            let applied = Lineage { rounds: Vec::new(), all: self.applied[shard].clone() };
            self.discard(shard, &applied, &snap.lineage, "a restore from an older copy")?;
        } else if let Some(&high) = self.high.get(&(shard, epoch)) {
            if snap.version < high {
                return Err(format!(
                    "n{n} installs shard {shard} at v{}, older than v{high} (owner version went back)",
                    snap.version
                ));
            }
        }
        let high = self.high.entry((shard, epoch)).or_insert(0);
        *high = (*high).max(snap.version);
        history.push(snap.clone());
        let extra = history.len().saturating_sub(REPLICA_LAG + 1);
        history.drain(..extra);
        note!(self, "n{n} serves shard {shard} from v{} (epoch {epoch}, restored: {restored})", snap.version);
        self.nodes[n].agg.cores.insert(shard, Held { core, lineage: snap.lineage, history, epoch });
        self.progressed = true;
        if restored {
            self.take_up(n, shard)?;
        }
        Ok(())
    }

    /// `n`'s core of `shard`, if restored, takes up the newest version a
    /// live worker holds: its own worker's, or one its heartbeats named
    /// (`ShardCore::take_up`, the aggregator's `take_up_held`).
    fn take_up(&mut self, n: Node, shard: usize) -> Result<(), String> {
        if !self.setup.heartbeat_versions {
            return Ok(());
        }
        let live = &self.view(n).live;
        let newest = live
            .iter()
            .filter(|&&w| w != n)
            .map(|&w| self.heard[n][w][shard])
            .chain(std::iter::once(self.heard[n][n][shard]))
            .max()
            .unwrap_or(0);
        if self.core_op(n, shard, None, |c| c.take_up(newest))? == Some(true) {
            self.stats.taken_up += 1;
            note!(self, "  n{n} shard {shard}: took up v{newest}, which a live worker holds");
        }
        Ok(())
    }

    /// A transfer reaches `n` (`receive`).
    fn receive(
        &mut self,
        n: Node,
        shard: usize,
        snap: Snapshot,
        history: Vec<Snapshot>,
        hops: u64,
    ) -> Result<(), String> {
        if let Some(held) = self.nodes[n].agg.cores.get(&shard) {
            let yields = if self.setup.restored_yields {
                held.core.yields_to(snap.version)
            } else {
                snap.version > held.core.version()
            };
            if !yields {
                note!(self, "  n{n} shard {shard}: fenced, ours is v{}", held.core.version());
                self.stats.fenced += 1;
                let ours = held.lineage.clone();
                return self.discard(shard, &snap.lineage, &ours, "a fenced transfer");
            }
            let old = self.nodes[n].agg.cores.remove(&shard);
            if let Some(old) = &old {
                if old.core.version() == snap.version {
                    self.stats.yielded += 1;
                    note!(self, "  n{n} shard {shard}: our restored v{} yields to the copy handed over", snap.version);
                }
                self.discard(shard, &old.lineage, &snap.lineage, "a newer transfer replacing a core")?;
            }
            self.install(n, shard, snap, history, false)?;
            if let (Some(mut old), Some(new)) = (old, self.nodes[n].agg.cores.get_mut(&shard)) {
                old.core.hand_round_to(&mut new.core);
            }
            return self.release_ready(n);
        }
        let owner = self.view(n).owners[shard];
        if self.nodes[n].agg.pending.remove(&shard) || owner == n {
            self.install(n, shard, snap, history, false)?;
        } else if hops < MAX_HOPS {
            note!(self, "  n{n} forwards shard {shard} to n{owner}");
            self.send(n, owner, Body::Transfer { shard, snap, history, hops: hops + 1 });
        } else {
            note!(self, "  n{n} keeps shard {shard} at the hop limit");
            self.store(n, shard, Stored { snap, history, transfer: true, hops, retry: true })?;
        }
        self.release_ready(n)
    }

    /// Keep a copy unless a newer one is kept (`store`).
    fn store(&mut self, n: Node, shard: usize, st: Stored) -> Result<(), String> {
        let agg = &mut self.nodes[n].agg;
        let (keep, lost) = match agg.stored.remove(&shard) {
            Some(old) if st.snap.version < old.snap.version => (old, st),
            Some(old) => (st, old),
            None => {
                agg.stored.insert(shard, st);
                return Ok(());
            }
        };
        let winner = keep.snap.lineage.clone();
        agg.stored.insert(shard, keep);
        if lost.transfer {
            self.discard(shard, &lost.snap.lineage, &winner, "a kept transfer replaced")?;
        }
        Ok(())
    }

    fn pass_on_stored(&mut self, n: Node, shard: usize, to: Node) {
        if let Some(st) = self.nodes[n].agg.stored.remove(&shard) {
            note!(self, "n{n} passes kept shard {shard} on to n{to}");
            self.send(n, to, Body::Transfer { shard, snap: st.snap, history: st.history, hops: st.hops + 1 });
        }
    }

    /// The retry timer of a transfer kept at the hop limit (`retry_kept_transfers`).
    fn retry_kept(&mut self, n: Node, shard: usize) -> Result<(), String> {
        let owner = self.view(n).owners[shard];
        if owner != n {
            self.pass_on_stored(n, shard, owner);
        } else if !self.nodes[n].agg.cores.contains_key(&shard) {
            if let Some(st) = self.nodes[n].agg.stored.remove(&shard) {
                self.nodes[n].agg.pending.remove(&shard);
                self.install(n, shard, st.snap, st.history, false)?;
            }
        } else {
            self.settle_kept(n, shard)?;
        }
        self.release_ready(n)
    }

    /// A transfer kept for a shard `n` serves (`settle_kept_transfer`):
    /// installed in place of the served copy when newer, else a replica.
    fn settle_kept(&mut self, n: Node, shard: usize) -> Result<(), String> {
        let served = self.nodes[n].agg.cores.get(&shard).map_or(u64::MAX, |h| h.core.version());
        let Some(mut st) = self.nodes[n].agg.stored.remove(&shard) else { return Ok(()) };
        if st.snap.version > served {
            note!(self, "  n{n} shard {shard}: a kept transfer v{} replaces ours v{served}", st.snap.version);
            if let Some(old) = self.nodes[n].agg.cores.remove(&shard) {
                self.discard(shard, &old.lineage, &st.snap.lineage, "a kept transfer replacing a core")?;
            }
            return self.install(n, shard, st.snap, st.history, false);
        }
        st.transfer = false;
        st.retry = false;
        self.nodes[n].agg.stored.insert(shard, st);
        Ok(())
    }
}

/// Faults.
impl World {
    fn inject_fault(&mut self) -> Result<(), String> {
        let f = self.setup.faults;
        let latest = self.placements[self.placements.len() - 1].clone();
        let training: Vec<Node> = (0..self.nodes.len())
            .filter(|&n| {
                self.nodes[n].alive && self.nodes[n].worker.phase == Phase::Training && !self.nodes[n].worker.leave
            })
            .collect();
        let remote: Vec<usize> = (0..self.flight.len())
            .filter(|&i| {
                self.flight[i].from != self.flight[i].to && !matches!(self.flight[i].body, Body::Transfer { .. })
            })
            .collect();
        let requests: Vec<usize> = remote.iter().copied().filter(|&i| self.flight[i].body.is_request()).collect();
        let mut options = Vec::new();
        if f.loss && !remote.is_empty() {
            options.push(Fault::Lose(remote[self.rng.random_range(0..remote.len())]));
        }
        if f.loss && !requests.is_empty() {
            options.push(Fault::TimeOut(requests[self.rng.random_range(0..requests.len())]));
        }
        if f.crash && self.stats.crashes == 0 && training.len() >= 3 {
            // Owners more likely than the others.
            let weights: Vec<usize> =
                training.iter().map(|n| 1 + 2 * latest.owners.iter().filter(|o| *o == n).count()).collect();
            let mut r = self.rng.random_range(0..weights.iter().sum::<usize>());
            let pick = weights
                .iter()
                .position(|w| {
                    r < *w || {
                        r -= *w;
                        false
                    }
                })
                .unwrap_or(0);
            options.push(Fault::Crash(training[pick]));
        }
        if f.moves && latest.eligible().len() >= 2 {
            options.push(Fault::Move(self.rng.random_range(0..self.setup.shards)));
        }
        if f.leave && training.len() >= 3 {
            options.push(Fault::Leave(training[self.rng.random_range(0..training.len())]));
        }
        if options.is_empty() {
            return Ok(());
        }
        let fault = options[self.rng.random_range(0..options.len())];
        self.stats.faults += 1;
        note!(self, "FAULT {fault:?}");
        self.progressed = true;
        match fault {
            Fault::Lose(i) => {
                let m = self.flight.swap_remove(i);
                self.fail_request(&m);
                Ok(())
            }
            Fault::TimeOut(i) => {
                // The request stays on the wire; its answer will be ignored.
                let m = &self.flight[i];
                let (head, shards) = (Head { from: m.to, to: m.from, re: m.re }, m.body.shards());
                let push = !matches!(m.body, Body::Pull { .. });
                self.fail(head, shards, push);
                Ok(())
            }
            Fault::Crash(n) => self.crash(n),
            Fault::Move(s) => self.move_shard(s),
            Fault::Leave(w) => {
                self.nodes[w].worker.leave = true;
                Ok(())
            }
        }
    }

    /// Each answer `n` sent that is still on the wire is lost or not.
    fn lose_answers_of(&mut self, n: Node) {
        let mut i = 0;
        while i < self.flight.len() {
            let m = &self.flight[i];
            let answer = m.from == n && !m.body.is_request() && !matches!(m.body, Body::Transfer { .. });
            if answer && self.rng.random_bool(0.5) {
                let m = self.flight.swap_remove(i);
                note!(self, "  lost with n{n}: #{} {:?}", m.re, m.body);
                self.fail_request(&m);
            } else {
                i += 1;
            }
        }
    }

    /// A lost message: the worker whose request or answer it was sees a
    /// failed request.
    fn fail_request(&mut self, m: &Msg) {
        let (worker, owner) = if m.body.is_request() { (m.from, m.to) } else { (m.to, m.from) };
        let push = !matches!(m.body, Body::Pull { .. } | Body::PullAnswer { .. });
        self.fail(Head { from: owner, to: worker, re: m.re }, m.body.shards(), push);
    }

    fn fail(&mut self, head: Head, shards: Vec<usize>, push: bool) {
        for s in shards {
            let why = String::from("request failed");
            let answer =
                if push { Answer::Push(PushAnswer::Failed(why)) } else { Answer::Pull(PullAnswer::Failed(why)) };
            self.answer_worker(head, s, answer);
        }
    }

    /// Node `n` dies: its worker and shards are gone, the requests waiting
    /// there fail, each answer it had not sent yet is lost or not, and each
    /// shard it owned goes to another node, which holds a replica.
    fn crash(&mut self, n: Node) -> Result<(), String> {
        self.lossy = true;
        self.stats.crashes += 1;
        let node = &mut self.nodes[n];
        node.alive = false;
        node.worker.phase = Phase::Dead;
        let agg = std::mem::take(&mut node.agg);
        for p in agg.parked.iter().filter(|p| !matches!(p.waiter, Waiter::Batch { .. })) {
            let head = Head { from: n, to: p.worker, re: p.re };
            self.fail(head, vec![p.shard], matches!(p.waiter, Waiter::ThenPull { .. }));
        }
        // A batch fails as a whole, answered entries and all.
        for (re, b) in agg.batches {
            let shards = b.answers.iter().flatten().map(|a| a.0).collect::<Vec<_>>();
            let waiting = agg.parked.iter().filter(|p| p.re == re).map(|p| p.shard);
            self.fail(Head { from: n, to: b.worker, re }, shards.into_iter().chain(waiting).collect(), true);
        }
        self.lose_answers_of(n);
        self.reelect(None, |p, rng| {
            p.live.remove(&n);
            p.workers.remove(&n);
            let eligible = p.eligible();
            if eligible.is_empty() {
                return;
            }
            for o in p.owners.iter_mut().filter(|o| **o == n) {
                *o = eligible[rng.random_range(0..eligible.len())];
            }
        })?;
        let owners = self.placements[self.placements.len() - 1].owners.clone();
        for (s, held) in agg.cores {
            self.lost_versions.insert(s, held.core.version());
            let i = self.rng.random_range(0..held.history.len());
            let snap = held.history[i].clone();
            let history = held.history[..=i].to_vec();
            self.discard(s, &held.lineage, &snap.lineage, "a crash")?;
            note!(self, "  n{} keeps a replica of shard {s}: {snap:?}", owners[s]);
            self.store(owners[s], s, Stored { snap, history, transfer: false, hops: 0, retry: false })?;
        }
        Ok(())
    }

    /// Shard `s` moves to another owner (a demotion, a new owner count);
    /// the old owner may take the placement up first.
    fn move_shard(&mut self, s: usize) -> Result<(), String> {
        self.stats.moves += 1;
        let latest = &self.placements[self.placements.len() - 1];
        let from = latest.owners[s];
        let to: Vec<Node> = latest.eligible().into_iter().filter(|&o| o != from).collect();
        if to.is_empty() {
            return Ok(());
        }
        let to = to[self.rng.random_range(0..to.len())];
        let first = (self.rng.random_bool(0.5) && self.nodes[from].alive).then_some(from);
        self.reelect(first, |p, _| p.owners[s] = to)
    }
}

impl Body {
    fn is_request(&self) -> bool {
        matches!(self, Body::Push { .. } | Body::Pull { .. } | Body::Batch { .. })
    }

    /// The shards a request or answer is about.
    fn shards(&self) -> Vec<usize> {
        match self {
            Body::Push { shard, .. }
            | Body::Pull { shard, .. }
            | Body::PushAnswer { shard, .. }
            | Body::PullAnswer { shard, .. }
            | Body::Transfer { shard, .. } => vec![*shard],
            Body::Batch { items, .. } => items.iter().map(|i| i.0).collect(),
            Body::BatchAnswer { answers } => answers.iter().map(|a| a.0).collect(),
        }
    }
}

/// Checks at the end.
impl World {
    /// Every gradient a worker pulled the round of is in its shard's final
    /// lineage, unless a fault threw it away. The final copy is the newest
    /// one served, kept or still on its way to its owner (the run ends when
    /// the workers do), where a copy handed over replaces a restored core of
    /// its own number that has not settled (`ShardCore::yields_to`).
    fn final_check(&self) -> Result<(), String> {
        for s in 0..self.setup.shards {
            let alive = self.nodes.iter().filter(|x| x.alive);
            let served = alive.clone().filter_map(|x| x.agg.cores.get(&s)).map(|h| {
                let settled = !self.setup.restored_yields || h.core.restore_room() == 0;
                (h.core.version(), settled, &h.lineage)
            });
            let kept = alive.filter_map(|x| x.agg.stored.get(&s)).filter(|st| st.transfer).map(|st| &st.snap);
            let on_the_wire = self.flight.iter().filter_map(|m| match &m.body {
                Body::Transfer { shard, snap, .. } if *shard == s && self.nodes[m.to].alive => Some(snap),
                _ => None,
            });
            let handed = kept.chain(on_the_wire).map(|snap| (snap.version, true, &snap.lineage));
            let Some(last) = served.chain(handed).max_by_key(|(version, settled, _)| (*version, *settled)) else {
                continue;
            };
            let lineage = last.2;
            let missing: Vec<Grad> = self
                .counted
                .iter()
                .filter(|(shard, g)| *shard == s && !lineage.all.contains(g) && !self.discarded.contains(&(s, *g)))
                .map(|(_, g)| *g)
                .collect();
            if !missing.is_empty() {
                return Err(format!(
                    "shard {s}: counted gradients {missing:?} are not in the final lineage (lost update)"
                ));
            }
        }
        Ok(())
    }
}

fn outcome_answer(out: PushOutcome) -> PushAnswer<Node, Pulled> {
    match out {
        PushOutcome::Accepted { version, .. } => PushAnswer::Accepted { version },
        PushOutcome::Stale { current_version } => PushAnswer::Stale { current_version },
        PushOutcome::UnknownWorker => PushAnswer::UnknownWorker,
        PushOutcome::BadLength { expected, got } => PushAnswer::Invalid(format!("{got} values, expected {expected}")),
    }
}

/// A `PushPull`'s answer once its parked pull ends.
fn served(v: Verdict, accepted: u64) -> PushAnswer<Node, Pulled> {
    match v {
        Verdict::State(version, params) => PushAnswer::Served { version, params },
        Verdict::NotReady(_) | Verdict::NotOwner(_) => PushAnswer::Accepted { version: accepted },
    }
}

/// What a failed check is, as far as the findings of issue 47 explain it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    /// Nothing known explains it.
    Unexplained,
    /// Finding 1: a deadlock (or livelock) in a run where a taken push's
    /// answer was lost and its retry, refused as `Stale`, joined the next
    /// round (the gradient counted twice, the worker a round ahead there).
    LostAnswerCycle,
    /// Finding 3: a deadlock of restored rounds (the cycle of issue 16)
    /// after a crash where no surviving worker got the crashed owner's
    /// newest version of every shard it held: nobody can push against the
    /// newer numbering, so catch-up never comes. Fixed by the versions in
    /// heartbeats; found again without them.
    UncoveredRestore,
    /// Finding 2: applied rounds lost in a run where a leaver stopped while
    /// the newest copy of a shard it handed off was on its way back to it
    /// (forwarded by an owner whose view lagged): the copy bounced and its
    /// sender kept it as a replica, or the leaver stopped holding it as a
    /// kept transfer; the shard's owner then restores from an older copy.
    /// And finding 5: an owner restored from an older copy while its own
    /// transfer of the shard, the newest copy, was on the wire.
    StrandedTransfer,
}

#[derive(Debug, Clone)]
struct Failure {
    kind: Kind,
    message: String,
}

impl World {
    /// Some worker still training received the crashed owner's newest
    /// version of every shard it held (and so will push against the newer
    /// numbering: catch-up comes).
    fn covered(&self) -> bool {
        (0..self.nodes.len()).any(|w| {
            let training = self.nodes[w].alive && self.nodes[w].worker.phase == Phase::Training;
            training && self.lost_versions.iter().all(|(&s, &v)| self.received[w][s] >= v)
        })
    }

    fn classify(&self, message: String) -> Failure {
        let stuck = message.starts_with("no progress possible") || message.starts_with("livelock");
        let kind = if stuck && (self.stats.twice > 0 || self.stats.rejoins > 0) {
            Kind::LostAnswerCycle
        } else if stuck && !self.lost_versions.is_empty() && !self.covered() {
            Kind::UncoveredRestore
        } else if message.contains("(lost update)") && self.stranded && !self.lossy {
            Kind::StrandedTransfer
        } else {
            Kind::Unexplained
        };
        Failure { kind, message }
    }
}

/// One run: its setup, how it ended, its counts and (traced) its events.
struct Outcome {
    seed: u64,
    setup: Option<Setup>,
    result: Result<(), Failure>,
    stats: Stats,
    trace: Vec<String>,
}

fn run_seed(seed: u64, make: MakeSetup, verbose: bool) -> Outcome {
    match World::new(seed, make, verbose) {
        Ok(mut world) => {
            let result = world.run().map_err(|e| world.classify(e));
            world.stats.events = world.events;
            Outcome { seed, setup: Some(world.setup), result, stats: world.stats, trace: world.trace }
        }
        Err(e) => {
            let failure = Failure { kind: Kind::Unexplained, message: e };
            Outcome { seed, setup: None, result: Err(failure), stats: Stats::default(), trace: Vec::new() }
        }
    }
}

/// What a batch of seeds gave.
#[derive(Default)]
struct Explored {
    runs: u64,
    /// Failed runs by kind: how many, the first one, and the seed and
    /// length of the shortest.
    failures: BTreeMap<Kind, (u64, Outcome, (u64, usize))>,
    stats: Stats,
}

impl Explored {
    fn first(&self, kind: Kind) -> Option<&Outcome> {
        self.failures.get(&kind).map(|f| &f.1)
    }
}

fn env_u64(var: &str) -> Option<u64> {
    std::env::var(var).ok().and_then(|v| v.trim().parse::<u64>().ok())
}

/// Runs `seeds` (or the first [`SEEDS_VAR`] of them, or only the one
/// [`SEED_VAR`] names, traced) up to the first failure of a kind in
/// `stop_at`; with [`SURVEY_VAR`], all of them, and prints the failures by
/// kind with the shortest run of each.
fn explore(name: &str, seeds: Range<u64>, make: MakeSetup, stop_at: &[Kind]) -> Explored {
    let replay = env_u64(SEED_VAR);
    let survey = std::env::var(SURVEY_VAR).is_ok_and(|v| v == "1");
    let seeds = match (replay, env_u64(SEEDS_VAR)) {
        (Some(n), _) => n..n + 1,
        (None, Some(count)) => seeds.start..seeds.start + count,
        (None, None) => seeds,
    };
    let mut ex = Explored::default();
    for seed in seeds {
        let out = run_seed(seed, make, replay.is_some());
        ex.runs += 1;
        ex.stats.add(&out.stats);
        if replay.is_some() {
            eprintln!("{name}: seed {seed}, setup {:?}\n{}", out.setup, out.trace.join("\n"));
            eprintln!("{name}: seed {seed}: {:?}", out.result);
        }
        let Err(failure) = &out.result else { continue };
        let (kind, shortest) = (failure.kind, (seed, out.stats.events));
        let entry = ex.failures.entry(kind).or_insert((0, out, shortest));
        entry.0 += 1;
        if shortest.1 < entry.2 .1 {
            entry.2 = shortest;
        }
        if stop_at.contains(&kind) && !survey {
            break;
        }
    }
    let kinds: Vec<String> = ex.failures.iter().map(|(k, f)| format!("{k:?} x{}", f.0)).collect();
    eprintln!("{name}: {} runs, failures {kinds:?}; totals {:?}", ex.runs, ex.stats);
    if survey {
        for (kind, (count, first, (seed, events))) in &ex.failures {
            let line = first.result.as_ref().err().map_or("", |f| f.message.lines().next().unwrap_or(""));
            eprintln!("{name}: {count} x {kind:?} (e.g. `{line}`); shortest: seed {seed}, {events} events");
        }
    }
    ex
}

/// A failure, with the tail of its trace (the seed run again, traced).
fn report(name: &str, out: &Outcome, make: MakeSetup) -> String {
    let traced = run_seed(out.seed, make, true);
    let from = traced.trace.len().saturating_sub(TRACE_TAIL);
    let (kind, message) = out.result.as_ref().err().map_or((None, ""), |f| (Some(f.kind), f.message.as_str()));
    format!(
        "{name}: seed {} failed ({kind:?}; {SEED_VAR}={} replays it)\nsetup {:?}\n{message}\n\
         trace tail ({} events in all):\n{}",
        out.seed,
        out.seed,
        out.setup,
        traced.stats.events,
        traced.trace[from..].join("\n")
    )
}

/// Fails with the first run whose failure is of a kind not in `allowed`.
fn assert_only(name: &str, ex: &Explored, make: MakeSetup, allowed: &[Kind]) {
    if let Some((_, (_, first, _))) = ex.failures.iter().find(|(k, _)| !allowed.contains(k)) {
        panic!("{}", report(name, first, make));
    }
}

const ALL: [Kind; 4] = [Kind::Unexplained, Kind::LostAnswerCycle, Kind::UncoveredRestore, Kind::StrandedTransfer];

fn base(rng: &mut StdRng) -> Setup {
    Setup {
        workers: rng.random_range(2..=5),
        joiners: 0,
        shards: rng.random_range(1..=3),
        steps: rng.random_range(3..=6),
        push_pull: rng.random_bool(0.7),
        batch: rng.random_bool(0.5),
        catch_up: true,
        rejoin: false,
        restore_beside_own_send: false,
        colocated: false,
        heartbeat_versions: true,
        restored_yields: true,
        claims_awaited: true,
        room_travels: true,
        faults: Faults::default(),
    }
}

fn no_faults(rng: &mut StdRng) -> Setup {
    base(rng)
}

fn losses_and_moves(rng: &mut StdRng) -> Setup {
    let mut s = base(rng);
    s.faults = Faults { loss: true, moves: true, count: rng.random_range(1..=4), ..Faults::default() };
    s
}

fn crashes(rng: &mut StdRng) -> Setup {
    let mut s = base(rng);
    s.workers = rng.random_range(3..=5);
    let (loss, moves, slow_handoff) = (rng.random_bool(0.3), rng.random_bool(0.3), rng.random_bool(0.3));
    s.faults = Faults { crash: true, loss, moves, slow_handoff, count: rng.random_range(1..=3), ..Faults::default() };
    s
}

/// The shape of issue 16: four workers, two shards, one crash.
fn restore_cycle(rng: &mut StdRng) -> Setup {
    let mut s = base(rng);
    (s.workers, s.shards, s.steps, s.colocated) = (4, 2, 6, true);
    s.faults = Faults { crash: true, count: 1, ..Faults::default() };
    s
}

fn restore_cycle_without_catch_up(rng: &mut StdRng) -> Setup {
    Setup { catch_up: false, ..restore_cycle(rng) }
}

/// Clean leaves, with the placement's churn around them; in half the
/// runs the leaver's last answers may not reach the workers.
fn leaves(rng: &mut StdRng) -> Setup {
    let mut s = base(rng);
    s.workers = rng.random_range(3..=5);
    let (moves, abrupt_exit, unheard_leave) = (rng.random_bool(0.3), rng.random_bool(0.5), rng.random_bool(0.5));
    s.faults =
        Faults { leave: true, moves, abrupt_exit, unheard_leave, count: rng.random_range(1..=2), ..Faults::default() };
    s
}

#[test]
fn without_faults_every_round_closes_and_counts_each_gradient_once() {
    let name = "no faults";
    let ex = explore(name, 0..3000, no_faults, &ALL);
    assert_only(name, &ex, no_faults, &[]);
    assert!(ex.stats.events > 300_000, "the runs did something: {:?}", ex.stats);
}

#[test]
fn lost_messages_and_moved_shards_break_nothing() {
    let name = "losses and moves";
    let ex = explore(name, 0..2000, losses_and_moves, &ALL);
    assert_only(name, &ex, losses_and_moves, &[]);
    assert!(ex.stats.faults > 2000 && ex.stats.moves > 1000, "{:?}", ex.stats);
}

#[test]
fn owners_restored_from_older_replicas_break_nothing() {
    let name = "crashes";
    let ex = explore(name, 0..2000, crashes, &ALL);
    assert_only(name, &ex, crashes, &[]);
    assert!(ex.stats.crashes > 1000 && ex.stats.catch_ups > 10 && ex.stats.taken_up > 300, "{:?}", ex.stats);
}

/// The seeds of the two catch-up tests.
const RESTORE_SEEDS: Range<u64> = 0..3000;

fn crashes_without_room_in_transfers(rng: &mut StdRng) -> Setup {
    Setup { room_travels: false, ..crashes(rng) }
}

/// Finding 7, found again: a restored core handed over before its first
/// full round arrives settled, so a push against the newer version the
/// crashed owner gave its worker joins the round in progress instead of
/// moving the numbering, and the gradient is counted twice.
#[test]
fn without_the_room_in_transfers_the_explorer_finds_finding_seven() {
    let make = crashes_without_room_in_transfers;
    find_again("finding 7", FINDING_SEVEN_SEEDS, make, &[Kind::Unexplained], |_, message| {
        message.contains("applied twice")
    });
}

/// The seeds that look for finding 7 (the runs stop at the first failure).
const FINDING_SEVEN_SEEDS: Range<u64> = 0..30_000;

/// Issue 16's cycle, found again: with catch-up off, a crash of the owner
/// of both shards leaves the two restored rounds each waiting for a worker
/// the other's round holds, while a surviving worker holds the newest
/// version of both (so catch-up would have moved the numbering) and no
/// answer to a taken push was lost.
#[test]
fn without_catch_up_the_explorer_finds_the_restore_cycle() {
    let name = "restore cycle without catch-up";
    find_again(name, RESTORE_SEEDS, restore_cycle_without_catch_up, &[Kind::Unexplained], |found, message| {
        // Two restored shards, no answer lost.
        message.starts_with("no progress possible")
            && (found.stats.twice, found.stats.rejoins) == (0, 0)
            && message.matches("(epoch 1)").count() == 2
    });
}

/// Runs `seeds` of `make` until one fails as one of `kinds` (a finding
/// found again with its fix switched off), checks that run's outcome and
/// message with `check`, and prints its report.
fn find_again(name: &str, seeds: Range<u64>, make: MakeSetup, kinds: &[Kind], check: impl Fn(&Outcome, &str) -> bool) {
    let ex = explore(name, seeds, make, kinds);
    let Some(found) = kinds.iter().find_map(|&k| ex.first(k)) else { panic!("{name}: not found in {} seeds", ex.runs) };
    let text = report(name, found, make);
    let message = found.result.as_ref().err().map_or("", |f| f.message.as_str());
    assert!(check(found, message), "{text}");
    eprintln!("found after {} seeds\n{text}", ex.runs);
}

/// The same seeds with catch-up on: that cycle never, nor finding 3
/// (restored cores take up the versions the workers' heartbeats name).
#[test]
fn with_catch_up_the_same_seeds_never_find_it() {
    let name = "restore cycle with catch-up";
    let ex = explore(name, RESTORE_SEEDS, restore_cycle, &ALL);
    assert_only(name, &ex, restore_cycle, &[]);
    assert!(ex.stats.crashes > 1000 && ex.stats.catch_ups > 20 && ex.stats.taken_up > 1000, "{:?}", ex.stats);
}

/// Item 5: no round that only the round timeout would close after a
/// clean leave, with or without the placement moving other shards and the
/// leaver's last answers arriving, and no broken check.
#[test]
fn a_worker_that_leaves_leaves_no_round_to_the_timeout() {
    let name = "leaves";
    let ex = explore(name, 0..3000, leaves, &ALL);
    assert_only(name, &ex, leaves, &[]);
    assert!(ex.stats.leaves > 1500 && ex.stats.moves > 200, "{:?}", ex.stats);
}

/// Finding 1, fixed: a push whose answer was lost and whose retry is
/// refused as `Stale` is not given to the next round (it may have closed
/// its own), so it never counts twice and no worker runs a round ahead.
/// The situation itself still comes up (`rejoins`); before the fix, 19 of
/// these 2,000 seeds deadlocked (first at seed 66, shortest seed 367).
#[test]
fn finding_one_fixed_a_lost_answer_to_a_taken_push_never_counts_twice() {
    let name = "finding 1";
    let ex = explore(name, 0..2000, losses_and_moves, &ALL);
    assert_only(name, &ex, losses_and_moves, &[]);
    assert!(ex.stats.rejoins > 0, "no lost answer to a taken push came up: {:?}", ex.stats);
    assert_eq!(ex.stats.twice, 0, "{:?}", ex.stats);
}

/// Finding 2, fixed: the newest copy of a shard a leaver handed off, on
/// its way back to the leaver when it stops, is kept by its sender and
/// passed on, and a leaver stops only once it keeps no transfer: no update
/// is lost. The situation itself still comes up (`bounced`); before the
/// fix, 8 of these 5,000 seeds lost applied rounds (first at seed 310, shortest seed 4757).
#[test]
fn finding_two_fixed_a_leaver_that_stops_strands_no_transfer() {
    let name = "finding 2";
    let ex = explore(name, 0..5000, leaves, &ALL);
    assert_only(name, &ex, leaves, &[]);
    assert!(ex.stats.bounced > 0, "no transfer met a stopped node: {:?}", ex.stats);
    // Finding 5's situation comes up too, and loses nothing.
    assert!(ex.stats.own_awaited > 0, "no owner awaited its own transfer: {:?}", ex.stats);
}

fn leaves_restoring_beside_own_send(rng: &mut StdRng) -> Setup {
    Setup { restore_beside_own_send: true, ..leaves(rng) }
}

/// Finding 5, found again: with a restore while the node's own transfer of
/// the shard is on the wire, the seeds of finding 2 lose applied rounds.
#[test]
fn restoring_beside_its_own_send_the_explorer_finds_finding_five() {
    let name = "leaves, restoring beside the own send";
    find_again(name, 0..10_000, leaves_restoring_beside_own_send, &[Kind::StrandedTransfer], |_, message| {
        message.contains("a restore from an older copy")
    });
}

fn restore_cycle_without_heartbeat_versions(rng: &mut StdRng) -> Setup {
    Setup { heartbeat_versions: false, ..restore_cycle(rng) }
}

/// Finding 3, found again: with catch-up on but no versions in the
/// heartbeats, restored rounds still wait in a cycle when no surviving
/// worker got the newest version of every shard (and so none pushes
/// against the newer numbering).
#[test]
fn without_versions_in_heartbeats_the_explorer_finds_finding_three() {
    let make = restore_cycle_without_heartbeat_versions;
    find_again("finding 3", RESTORE_SEEDS, make, &[Kind::UncoveredRestore], |_, message| {
        message.starts_with("no progress possible")
    });
}

fn leaves_without_claims(rng: &mut StdRng) -> Setup {
    Setup { claims_awaited: false, restored_yields: false, ..leaves(rng) }
}

/// Finding 6, found again: without the claims in the heartbeats and with
/// a restored core fencing the real state of its own number, a new owner
/// whose view skipped a leave restores an older copy while the node that
/// holds the shard hands it over, and applied rounds are lost.
#[test]
fn without_claims_in_heartbeats_the_explorer_finds_finding_six() {
    let kinds = [Kind::Unexplained, Kind::StrandedTransfer];
    find_again("finding 6", FINDING_SIX_SEEDS, leaves_without_claims, &kinds, |_, message| {
        message.ends_with("(lost update)")
    });
}

/// The seeds that look for finding 6 (the runs stop at the first failure).
const FINDING_SIX_SEEDS: Range<u64> = 0..30_000;

/// Nodes that join while the run trains: one or two, into two to four
/// workers, with lost messages, moved shards or a leave in some runs.
fn joins(rng: &mut StdRng) -> Setup {
    let mut s = base(rng);
    s.workers = rng.random_range(2..=4);
    s.joiners = rng.random_range(1..=2);
    s.steps = rng.random_range(4..=8);
    let (loss, moves, leave) = (rng.random_bool(0.3), rng.random_bool(0.3), rng.random_bool(0.2));
    let count = if loss || moves || leave { rng.random_range(1..=3) } else { 0 };
    s.faults = Faults { loss, moves, leave, count, ..Faults::default() };
    s
}

/// Nodes join while the run trains, with losses, moves and leaves
/// around them: a joiner comes into the placement (shards may move to it),
/// every owner counts it, it starts from a training worker's model, and
/// from then on it is a worker like the others. No round is left to the
/// timeout, no gradient is lost or counted twice, no version goes back.
/// Joiners' copies a round old come up (`stale_dropped`).
#[test]
fn joiners_break_nothing() {
    let name = "joins";
    let ex = explore(name, JOIN_SEEDS, joins, &ALL);
    assert_only(name, &ex, joins, &[]);
    assert!(ex.stats.joins > 3000 && ex.stats.stale_dropped > 100, "{:?}", ex.stats);
}

/// The seeds of the joiner tests.
const JOIN_SEEDS: Range<u64> = 0..3000;

/// The seeds that look for finding 4 (found at seed 3,998: the runs stop
/// at the first failure).
const REJOIN_SEEDS: Range<u64> = 0..10_000;

fn joins_rejoining(rng: &mut StdRng) -> Setup {
    Setup { rejoin: true, ..joins(rng) }
}

/// Finding 4, found again: with a stale push given to the round in
/// progress, the same seeds leave rounds that only the timeout closes.
#[test]
fn rejoining_the_round_in_progress_the_explorer_finds_finding_four() {
    find_again("joins, rejoining", REJOIN_SEEDS, joins_rejoining, &[Kind::Unexplained], |_, message| {
        message.starts_with("no progress possible")
    });
}
