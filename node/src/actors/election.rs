//! The election actor: recomputes the shard placement whenever the view
//! changes (with the pure [`elect`]), publishes it, tells membership and
//! status about this node's new role, and feeds this node's explorer of the
//! number of aggregators ([`Explorer`]), gossiping its proposal.

use std::sync::Arc;

use shoal_protocol::libp2p::PeerId;
use shoal_protocol::Role;
use tokio::sync::watch;
use tracing::{info, warn};

use shoal_models::rng::stable_hash64;

use crate::handles::membership::{MembershipHandle, ViewSnapshot};
use crate::handles::status::{RoleView, StatusEvent, StatusHandle};
use crate::ops::logging::short;
use crate::policy::explore::{Decision, ExplorePolicy, Explorer};
use crate::policy::placement::{
    elect, inputs_from_view, observation, without_unused_measures, ElectPolicy, Own, Placement,
};
use crate::policy::view::SelfState;

/// Settings of the election actor.
#[derive(Debug, Clone)]
pub struct ElectionConfig {
    pub shards: u32,
    pub policy: ElectPolicy,
    /// Explore the number of aggregators from this start (`None`: every
    /// capable node); `None` here: no exploration.
    pub explore: Option<(ExplorePolicy, Option<usize>)>,
    /// This node's configured capabilities (as its heartbeats carry them).
    pub own: Own,
    pub total_steps: u64,
    pub failure_timeout_ms: u64,
    pub name: String,
}

/// Start electing (once the roster is agreed). Stops when the membership
/// actor stops or every receiver is gone.
pub fn start(
    out: watch::Sender<Option<Arc<Placement>>>,
    cfg: ElectionConfig,
    membership: MembershipHandle,
    status: StatusHandle,
    tasks: &crate::ops::tasks::NodeTasks,
) {
    tasks.spawn(run(out, cfg, membership, status));
}

async fn run(
    out: watch::Sender<Option<Arc<Placement>>>,
    cfg: ElectionConfig,
    membership: MembershipHandle,
    status: StatusHandle,
) {
    let mut view = membership.subscribe();
    let mut me = membership.subscribe_self();
    let my_id = membership.snapshot().view.me;
    // The view and this node's heartbeat fields change every step (step
    // counters, model versions); the election's inputs rarely do.
    let mut last_inputs = None;
    let mut explorer = cfg.explore.map(|(policy, start)| Explorer::new(policy, start));
    loop {
        let (inputs, over) = {
            let snap = view.borrow_and_update();
            let mine = me.borrow_and_update();
            let mut inputs =
                inputs_from_view(&snap.view, &mine, cfg.own, cfg.total_steps, snap.now_ms, cfg.failure_timeout_ms);
            without_unused_measures(&mut inputs.0, &mut inputs.1, cfg.policy);
            (inputs, mine.finished)
        };
        // The run is over for this node (it said `finished`: every peer has
        // its last step): the placement stays as it is. A peer that stops
        // now has finished, not failed, and moving or restoring its shards
        // would be work for nothing.
        if over {
            tokio::select! {
                r = view.changed() => if r.is_err() { break },
                r = me.changed() => if r.is_err() { break },
                _ = out.closed() => break,
            }
            continue;
        }
        let unchanged = last_inputs.as_ref() == Some(&inputs);
        let (members, service) = last_inputs.insert(inputs);
        match (!unchanged).then(|| elect(members, service, cfg.shards, cfg.policy)).flatten() {
            Some(p) => {
                let changed = out.borrow().as_ref().map(|old| old.epoch) != Some(p.epoch);
                if changed {
                    let old = out.borrow().clone();
                    announce(&cfg.name, &my_id, old.as_deref(), &p, &membership, &status);
                    out.send_replace(Some(Arc::new(p)));
                }
            }
            None if !unchanged => warn!("no live node may own shards; keeping the last placement"),
            None => {}
        }
        // Clone first: the watch guard must not be held while exploring.
        let current = out.borrow().clone();
        if let (Some(ex), Some(p)) = (explorer.as_mut(), current) {
            explore(ex, &p, &cfg, &view, &me, &membership, &status);
        }
        tokio::select! {
            r = view.changed() => if r.is_err() { break },
            r = me.changed() => if r.is_err() { break },
            _ = out.closed() => break,
        }
    }
}

/// Feed this node's explorer and gossip its proposal.
fn explore(
    ex: &mut Explorer,
    placement: &Placement,
    cfg: &ElectionConfig,
    view: &watch::Receiver<ViewSnapshot>,
    me: &watch::Receiver<SelfState>,
    membership: &MembershipHandle,
    status: &StatusHandle,
) {
    let o = {
        let snap = view.borrow();
        observation(&snap.view, &me.borrow(), placement, cfg.total_steps, snap.now_ms, cfg.failure_timeout_ms)
    };
    let Some(o) = o else { return };
    if let Some(d) = ex.observe(&o, placement.limit) {
        match d {
            Decision::Try { from, to, baseline_micros } => info!(
                node = cfg.name,
                step = o.step,
                from,
                to,
                comm_share = o.comm_share,
                step_ms = baseline_micros / 1e3,
                "trying another number of aggregators"
            ),
            Decision::Keep { from, k, before_micros, after_micros } => info!(
                node = cfg.name,
                step = o.step,
                from,
                k,
                before_ms = before_micros / 1e3,
                after_ms = after_micros / 1e3,
                "keeping the number of aggregators: steps got faster"
            ),
            Decision::Revert { tried, k, before_micros, after_micros, backoff_windows } => info!(
                node = cfg.name,
                step = o.step,
                tried,
                k,
                before_ms = before_micros / 1e3,
                after_ms = after_micros / 1e3,
                backoff_windows,
                "going back to the previous number of aggregators: steps did not get faster"
            ),
        }
        status.record(StatusEvent::Explore { step: o.step, decision: d });
    }
    let proposal = ex.proposal();
    if me.borrow().pace.aggregators != proposal {
        membership.set_self(|s| s.pace.aggregators = proposal);
    }
}

/// Log a new placement, and tell membership and status about this node's new role.
fn announce(
    name: &str,
    me: &PeerId,
    old: Option<&Placement>,
    new: &Placement,
    membership: &MembershipHandle,
    status: &StatusHandle,
) {
    let owned = new.owned_by(me);
    let before = old.map(|o| o.owned_by(me));
    let members: Vec<u8> = new.live.iter().flat_map(|p| p.to_bytes()).collect();
    status.record(StatusEvent::Placement {
        epoch: new.epoch,
        aggregators: new.aggregators(),
        members: stable_hash64(&members),
        live: new.live.len(),
    });
    let moved = old.is_none_or(|o| o.owners != new.owners);
    if moved {
        status.record(StatusEvent::Owners(new.owners.clone()));
    }
    if moved || old.is_some_and(|o| o.stragglers != new.stragglers || o.levels != new.levels) {
        info!(
            node = name,
            epoch = new.epoch,
            owners = ?new.owners.iter().map(short).collect::<Vec<_>>(),
            stragglers = ?new.stragglers.iter().map(short).collect::<Vec<_>>(),
            // Capacity levels other than 0 (service times, capped by the
            // gossiped rates): weight 2^level.
            levels = ?new.levels.iter().filter(|(_, l)| *l != 0).map(|(p, l)| (short(p), *l)).collect::<Vec<_>>(),
            short_of_memory = ?new.short_of_memory.iter().map(short).collect::<Vec<_>>(),
            limit = ?new.limit,
            "placement"
        );
    }
    let short_now = new.short_of_memory.contains(me);
    if short_now && old.is_none_or(|o| !o.short_of_memory.contains(me)) {
        warn!(
            node = name,
            "this node's memory (cluster.memory_bytes) does not hold its share of the shards: it owns none and trains"
        );
    }
    let level = new.level_of(me);
    if old.is_none_or(|o| o.level_of(me) != level) {
        membership.set_self(|s| {
            s.pace.capacity_level = level;
            s.announce += 1;
        });
    }
    if before.as_ref() != Some(&owned) {
        let role = if owned.is_empty() { Role::Worker } else { Role::Aggregator };
        membership.set_self(|s| {
            if !s.leaving {
                s.role = role;
            }
            s.owned_shards = owned.clone();
            s.announce += 1;
        });
        status.record(StatusEvent::Role {
            role: if owned.is_empty() { RoleView::Worker } else { RoleView::Aggregator },
            owned,
        });
    }
}
