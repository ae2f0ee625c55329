//! The switch that asks a running node to leave cleanly (the HTTP control
//! endpoint, Ctrl-C and tests flip it; the node's driver watches it).

use std::sync::Arc;

use tokio::sync::watch;

/// Asks a node to leave cleanly; cloneable, so it can outlive borrowing the node.
#[derive(Debug, Clone)]
pub struct LeaveSwitch(Arc<watch::Sender<bool>>);

impl LeaveSwitch {
    /// The switch over the sender the node's driver watches.
    pub(crate) fn new(sender: watch::Sender<bool>) -> Self {
        Self(Arc::new(sender))
    }

    pub fn leave(&self) {
        self.0.send_replace(true);
    }
}
