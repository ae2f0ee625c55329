//! Joining a run that has already started.
//!
//! A node that starts late sees peers whose heartbeats say they are training
//! (`Worker` or `Aggregator`) under a frozen roster it is not part of. It then
//! does not wait for a roster: [`join_point`] (pure) reads from its view the
//! run's epoch, the step the run has reached, and the peers that can donate
//! the model; [`fetch_model`] fetches the current model shard by shard, each
//! shard from a different donor first, so that no single peer carries the
//! whole transfer; and the node announces itself ready by taking the run's
//! epoch as its own. From then on every election counts it: owners wait for
//! its gradients and it may be given shards, which move to it by handoff.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{bail, Context};
use futures::future::try_join_all;
use shoal_models::ShardPlan;
use shoal_protocol::libp2p::PeerId;
use shoal_protocol::{Role, RunId, ShardRequest, ShardResponse, StateSync};
use tokio::time::Instant;
use tracing::debug;

use crate::handles::net::NetworkHandle;
use crate::policy::backoff::Backoff;
use crate::policy::view::{Roster, View};

/// Where a late node joins the run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JoinPoint {
    /// The frozen roster hash the run's nodes announce.
    pub epoch: u64,
    /// The furthest step any of them has reached: the joiner starts there
    /// at the earliest (see [`start_step`]).
    pub step: u64,
    /// How far that peer's model version runs ahead of its step count
    /// (BSP rounds closed while a membership change was settling): what
    /// maps a fetched version back to the step the run is at.
    pub lead: u64,
    /// Peers to fetch the model from (training under `epoch`, not leaving).
    pub donors: Vec<PeerId>,
    /// The run's live nodes plus this one (for gossip partners).
    pub roster: Roster,
}

/// Has the run started without this node? `None` while no peer trains, or
/// while no peer has finished a step and every training peer's roster is
/// the one this node proposes (it is a member merely late to see the
/// agreement; under BSP the others cannot finish a step without it).
pub fn join_point(view: &View, now_ms: u64, timeout_ms: u64) -> Option<JoinPoint> {
    let started: Vec<_> = view
        .live(now_ms, timeout_ms)
        .into_iter()
        .filter(|p| matches!(p.heartbeat.role, Role::Worker | Role::Aggregator | Role::Leaving))
        .collect();
    let mine = view.proposal(now_ms, timeout_ms).hash();
    // Once a peer has finished a step, a node that has not started is late
    // for the roster: a new node, or a member restarted with its old identity
    // (whose proposal can equal the run's epoch). It joins.
    let progressed = started.iter().any(|p| p.heartbeat.step > 0);
    if started.is_empty() || (!progressed && started.iter().all(|p| p.heartbeat.epoch == mine)) {
        return None;
    }
    // The epoch most training peers announce (ties: the smaller hash, so
    // the choice does not depend on map order).
    let mut counts: BTreeMap<u64, usize> = BTreeMap::new();
    for p in &started {
        *counts.entry(p.heartbeat.epoch).or_default() += 1;
    }
    let (&epoch, _) = counts.iter().max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))?;
    let run: Vec<_> = started.into_iter().filter(|p| p.heartbeat.epoch == epoch).collect();
    let furthest = run.iter().max_by_key(|p| p.heartbeat.step)?;
    let step = furthest.heartbeat.step;
    let lead = furthest.heartbeat.model_version.saturating_sub(step);
    let donors: Vec<PeerId> =
        run.iter().filter(|p| p.heartbeat.role != Role::Leaving).map(|p| p.heartbeat.peer).collect();
    let mut members: Vec<(PeerId, bool)> =
        run.iter().map(|p| (p.heartbeat.peer, p.heartbeat.capabilities.can_aggregate)).collect();
    members.push((view.me, view.my_can_aggregate));
    Some(JoinPoint { epoch, step, lead, donors, roster: Roster::new(members) })
}

/// BSP: the step a joiner starts at, so that its step count lines up with
/// the rounds the run is in. The run moved on while the model was fetched:
/// a joiner starting at the join point's step would push its first
/// gradient into a later round than the others' same step, and end the
/// run with rounds of its own after they finished (each one a full SGD
/// step on a single worker's batch, which cost up to 6 points of accuracy
/// in the model it ended with). The newest fetched version, less the
/// run's lead, is the step the round in progress belongs to; never earlier
/// than the join point.
pub fn start_step(point: &JoinPoint, fetched_versions: &[u64]) -> u64 {
    let newest = fetched_versions.iter().copied().max().unwrap_or(0);
    newest.saturating_sub(point.lead).max(point.step)
}

/// Do the training peers of `epoch` heard so far own all `shards` shards
/// between them? Every shard has an owner in a running run, so until they
/// do, some of the run is still unheard: a joiner bootstrapped from one
/// peer hears the others only once gossip has meshed it in, and would
/// otherwise take that one peer for the whole run and its only donor.
pub fn owners_cover(view: &View, now_ms: u64, timeout_ms: u64, epoch: u64, shards: u32) -> bool {
    let owned: std::collections::BTreeSet<u32> = view
        .live(now_ms, timeout_ms)
        .into_iter()
        .filter(|p| p.heartbeat.epoch == epoch && p.heartbeat.role != Role::Joining)
        .flat_map(|p| p.heartbeat.owned_shards.iter().copied())
        .collect();
    (0..shards).all(|s| owned.contains(&s))
}

/// The model as fetched from the donors.
#[derive(Debug, Clone)]
pub struct FetchedModel {
    pub params: Vec<f32>,
    /// Version of each shard's copy.
    pub versions: Vec<u64>,
    /// Which donor served which shards.
    pub served_by: BTreeMap<PeerId, Vec<u32>>,
}

/// Fetch every shard of the current model, concurrently. Shard `i` asks
/// donor `i mod n` first and moves on to the next donor when one fails or
/// has no model yet, until `deadline`.
pub async fn fetch_model(
    net: &NetworkHandle,
    run: &RunId,
    plan: &ShardPlan,
    donors: &[PeerId],
    deadline: Instant,
) -> anyhow::Result<FetchedModel> {
    if donors.is_empty() {
        bail!("no peer to fetch the model from");
    }
    let fetches = plan.shards().iter().map(|shard| {
        let id = shard.id;
        let len = shard.len();
        async move {
            let mut last = String::from("no donor answered");
            let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_secs(1));
            for attempt in 0.. {
                let donor = donors[(id as usize + attempt) % donors.len()];
                let req = ShardRequest::StateSync(StateSync { run: run.clone(), shard: id, min_version: 0 });
                match net.request(donor, req).await {
                    Ok(ShardResponse::ShardState(s)) => {
                        let values = s.params.decode().with_context(|| format!("shard {id} from {donor}"))?;
                        if values.len() == len {
                            return Ok::<_, anyhow::Error>((id, donor, s.version, values));
                        }
                        last = format!("{donor} sent {} values, expected {len}", values.len());
                    }
                    Ok(other) => last = format!("{donor} answered {}", other.kind()),
                    Err(e) => last = format!("{e}"),
                }
                debug!(shard = id, %donor, reason = %last, "state sync attempt failed");
                let left = deadline.saturating_duration_since(Instant::now());
                if !backoff.fits(left) {
                    break;
                }
                // Every donor was tried once: back off before the next round.
                if (attempt + 1) % donors.len() == 0 {
                    tokio::time::sleep(backoff.next_delay()).await;
                }
            }
            bail!("shard {id}: could not fetch it from any of {} donors: {last}", donors.len())
        }
    });
    let got = try_join_all(fetches).await?;
    let mut params = vec![0.0f32; plan.total_len()];
    let mut versions = vec![0u64; plan.len()];
    let mut served_by: BTreeMap<PeerId, Vec<u32>> = BTreeMap::new();
    for (id, donor, version, values) in got {
        let range = plan.shards()[id as usize].range();
        params[range].copy_from_slice(&values);
        versions[id as usize] = version;
        served_by.entry(donor).or_default().push(id);
    }
    Ok(FetchedModel { params, versions, served_by })
}

/// Distinct donors that served at least one shard.
pub fn donor_count(served_by: &BTreeMap<PeerId, Vec<u32>>) -> usize {
    served_by.keys().collect::<BTreeSet<_>>().len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_protocol::{Capabilities, Device, Heartbeat, WIRE_VERSION};

    fn hb(peer: PeerId, role: Role, epoch: u64, step: u64) -> Heartbeat {
        Heartbeat {
            run: RunId::new("t").unwrap_or_default(),
            peer,
            incarnation: 1,
            seq: 1,
            epoch,
            config_hash: 7,
            protocol_version: WIRE_VERSION,
            capabilities: Capabilities {
                device: Device::Cpu,
                memory_bytes: 0,
                compute_samples_per_sec: 0.0,
                net_bytes_per_sec: 0.0,
                can_aggregate: true,
            },
            role,
            owned_shards: vec![],
            step,
            model_version: step,
            shard_versions: Default::default(),
            service: vec![],
            pace: Default::default(),
            checkpoints: vec![],
            suspects: vec![],
            finished: false,
        }
    }

    #[test]
    fn a_late_node_joins_a_started_run_but_a_late_member_does_not() {
        let me = PeerId::random();
        let (a, b) = (PeerId::random(), PeerId::random());
        // Nobody trains yet: form a roster as usual.
        let mut v = View::new(me, true, 7);
        v.observe(hb(a, Role::Joining, 1, 0), 0);
        assert_eq!(join_point(&v, 0, 1000), None);
        // A member of the agreed roster sees a peer that started first: the
        // peer's epoch is the roster this node proposes too, so no join.
        let mine = v.proposal(0, 1000).hash();
        v.observe(hb(a, Role::Worker, mine, 0), 0);
        assert_eq!(join_point(&v, 0, 1000), None);
        // Once that peer has trained a step, the same node is a restarted
        // member and joins, even though its proposal is the run's epoch.
        v.observe(Heartbeat { seq: 2, ..hb(a, Role::Worker, mine, 3) }, 1);
        assert_eq!(join_point(&v, 1, 1000).map(|j| (j.epoch, j.step)), Some((mine, 3)));

        // A run of a and b under another roster, at steps 40 and 42.
        let mut late = View::new(me, false, 7);
        late.observe(hb(a, Role::Aggregator, 99, 40), 0);
        late.observe(hb(b, Role::Worker, 99, 42), 0);
        let Some(j) = join_point(&late, 0, 1000) else { panic!("no join point") };
        assert_eq!((j.epoch, j.step), (99, 42));
        assert_eq!(j.donors.len(), 2);
        assert_eq!(j.roster.members.len(), 3);
        assert_eq!(j.roster.rank_of(&me).map(|_| ()), Some(()));
        // A leaving peer is no donor.
        late.observe(Heartbeat { seq: 2, ..hb(b, Role::Leaving, 99, 43) }, 1);
        let Some(j) = join_point(&late, 1, 1000) else { panic!("no join point") };
        assert_eq!(j.donors, vec![a]);
    }

    /// The run's models are 3 versions ahead of its steps; while the model
    /// was fetched the run moved from step 42 to 45 (version 48): the
    /// joiner starts at step 45, never before the join point.
    #[test]
    fn a_joiner_starts_at_the_step_of_the_round_in_progress() {
        let me = PeerId::random();
        let (a, b) = (PeerId::random(), PeerId::random());
        let mut v = View::new(me, false, 7);
        v.observe(Heartbeat { model_version: 43, ..hb(a, Role::Aggregator, 99, 40) }, 0);
        v.observe(Heartbeat { model_version: 45, ..hb(b, Role::Worker, 99, 42) }, 0);
        let Some(j) = join_point(&v, 0, 1000) else { panic!("no join point") };
        assert_eq!((j.step, j.lead), (42, 3));
        assert_eq!(start_step(&j, &[47, 48, 48]), 45);
        // Nothing newer than the join point (or versions that count
        // something other than steps): the join point's step.
        assert_eq!(start_step(&j, &[44, 45]), 42);
        assert_eq!(start_step(&j, &[]), 42);
    }

    /// One peer heard of a run of owners a and b: the shards it owns do not
    /// cover the model, so the joiner keeps listening before it picks donors.
    #[test]
    fn a_joiner_waits_until_the_owners_heard_cover_every_shard() {
        let me = PeerId::random();
        let (a, b) = (PeerId::random(), PeerId::random());
        let mut v = View::new(me, true, 7);
        v.observe(Heartbeat { owned_shards: vec![0, 1], ..hb(a, Role::Aggregator, 99, 40) }, 0);
        assert!(join_point(&v, 0, 1000).is_some(), "the run has started");
        assert!(!owners_cover(&v, 0, 1000, 99, 4), "shards 2 and 3 have no owner heard yet");
        v.observe(Heartbeat { owned_shards: vec![2, 3], ..hb(b, Role::Aggregator, 99, 40) }, 0);
        assert!(owners_cover(&v, 0, 1000, 99, 4));
        assert!(!owners_cover(&v, 0, 1000, 98, 4), "owners of another epoch do not count");
        assert_eq!(join_point(&v, 0, 1000).map(|j| j.donors.len()), Some(2));
    }
}
