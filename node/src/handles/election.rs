//! The election's handle: the placement it publishes on a `watch` channel.
//! The actor is [`crate::actors::election`]; the placement itself is
//! computed by the pure [`crate::policy::placement::elect`].

use std::sync::Arc;

use tokio::sync::watch;

use crate::policy::placement::Placement;

/// Handle to the election actor: the placement it publishes.
#[derive(Debug, Clone)]
pub struct ElectionHandle {
    placement: watch::Receiver<Option<Arc<Placement>>>,
}

impl ElectionHandle {
    /// The channel the placement is published on, before the actor starts
    /// (the worker and the aggregator subscribe at build time).
    pub fn channel() -> (watch::Sender<Option<Arc<Placement>>>, Self) {
        let (tx, rx) = watch::channel(None);
        (tx, Self { placement: rx })
    }

    pub fn subscribe(&self) -> watch::Receiver<Option<Arc<Placement>>> {
        self.placement.clone()
    }

    pub fn current(&self) -> Option<Arc<Placement>> {
        self.placement.borrow().clone()
    }
}
