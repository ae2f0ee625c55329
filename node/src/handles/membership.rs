//! The membership actor's handle: this node's own heartbeat fields go in,
//! the gossiped view comes out, both on `watch` channels so that other tasks
//! wait on changes rather than poll. The actor is
//! [`crate::actors::membership`].

use tokio::sync::watch;

use crate::policy::view::{RosterStatus, SelfState, View};

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
}
