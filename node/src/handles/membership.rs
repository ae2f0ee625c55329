//! The membership actor's handle: this node's own heartbeat fields go in,
//! the gossiped view comes out, both on `watch` channels so that other tasks
//! wait on changes rather than poll. The actor is
//! [`crate::actors::membership`].

use std::time::Duration;

use shoal_protocol::libp2p::PeerId;
use shoal_protocol::{Heartbeat, Role};
use tokio::sync::watch;

use crate::policy::view::{RosterStatus, SelfState, View};

/// What the network actor tells membership.
#[derive(Debug, Clone)]
pub enum Heard {
    /// A validated heartbeat.
    Heartbeat(Box<Heartbeat>),
    /// The last connection to this peer closed. Once this node has said
    /// `finished`, the peer has stopped: it is not waited for (its own
    /// `finished` may have been lost with its connections).
    Disconnected(PeerId),
}

/// What the rest of the node sees.
#[derive(Debug, Clone)]
pub struct ViewSnapshot {
    pub view: View,
    pub now_ms: u64,
    pub roster: RosterStatus,
}

/// Handle to the membership actor.
#[derive(Debug, Clone)]
pub struct MembershipHandle {
    self_state: watch::Sender<SelfState>,
    view: watch::Receiver<ViewSnapshot>,
}

impl MembershipHandle {
    pub(crate) fn new(self_state: watch::Sender<SelfState>, view: watch::Receiver<ViewSnapshot>) -> Self {
        Self { self_state, view }
    }

    pub fn set_self(&self, f: impl FnOnce(&mut SelfState)) {
        self.self_state.send_modify(f);
    }

    /// This node's own heartbeat fields, as they change.
    pub fn subscribe_self(&self) -> watch::Receiver<SelfState> {
        self.self_state.subscribe()
    }

    pub fn subscribe(&self) -> watch::Receiver<ViewSnapshot> {
        self.view.clone()
    }

    pub fn snapshot(&self) -> ViewSnapshot {
        self.view.borrow().clone()
    }

    /// Wait until every live peer other than `me` (roster members and
    /// joiners past their join) reports `step` or more, or is leaving, at
    /// most `limit`. True if they all did; false when the limit ran out.
    /// Peers silent for `failure_timeout_ms` are not waited for.
    pub async fn wait_until_peers_reach(
        &self,
        me: PeerId,
        step: u64,
        failure_timeout_ms: u64,
        limit: Duration,
    ) -> bool {
        self.wait_for_peers(me, failure_timeout_ms, limit, |h| h.step >= step).await
    }

    /// As [`MembershipHandle::wait_until_peers_reach`], until every live
    /// peer says `finished` (the end of a run's second half,
    /// docs/protocol.md, §6.3).
    pub async fn wait_until_peers_finish(&self, me: PeerId, failure_timeout_ms: u64, limit: Duration) -> bool {
        self.wait_for_peers(me, failure_timeout_ms, limit, |h| h.finished).await
    }

    /// As [`MembershipHandle::wait_until_peers_reach`], for the model
    /// version peers report having published.
    pub async fn wait_until_peers_publish(
        &self,
        me: PeerId,
        version: u64,
        failure_timeout_ms: u64,
        limit: Duration,
    ) -> bool {
        self.wait_for_peers(me, failure_timeout_ms, limit, |h| h.model_version >= version).await
    }

    async fn wait_for_peers(
        &self,
        me: PeerId,
        failure_timeout_ms: u64,
        limit: Duration,
        done: impl Fn(&Heartbeat) -> bool,
    ) -> bool {
        let mut rx = self.subscribe();
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let all = {
                let snap = rx.borrow_and_update();
                snap.view
                    .live(snap.now_ms, failure_timeout_ms)
                    .iter()
                    .filter(|p| p.heartbeat.peer != me && p.heartbeat.role != Role::Joining)
                    .all(|p| done(&p.heartbeat) || p.heartbeat.role == Role::Leaving)
            };
            if all {
                return true;
            }
            if !matches!(tokio::time::timeout_at(deadline, rx.changed()).await, Ok(Ok(()))) {
                return false;
            }
        }
    }
}
