//! The checkpoint writer's handle: shard states go in, written to disk on a
//! thread of the writer's own, off every actor's and the step loop's path.
//! The writer is [`crate::actors::checkpoint`].

use shoal_models::ShardCheckpoint;
use tokio::sync::{mpsc, oneshot};

/// The checkpoint writer's mailbox.
pub(crate) enum CheckpointCommand {
    Write(Box<ShardCheckpoint>),
    /// Answered once every write sent before it is done.
    Flush(oneshot::Sender<()>),
}

/// Cloneable handle to the checkpoint writer.
#[derive(Debug, Clone)]
pub struct CheckpointHandle {
    sender: mpsc::Sender<CheckpointCommand>,
}

impl CheckpointHandle {
    pub(crate) fn new(sender: mpsc::Sender<CheckpointCommand>) -> Self {
        Self { sender }
    }

    /// Queue a write without waiting. `false` when the writer is behind
    /// (its queue is full) or gone: the caller tries again at its next
    /// checkpoint.
    pub fn try_write(&self, ckpt: ShardCheckpoint) -> bool {
        self.sender.try_send(CheckpointCommand::Write(Box::new(ckpt))).is_ok()
    }

    /// Queue a write, waiting for room (final writes at the end of a run).
    pub async fn write(&self, ckpt: ShardCheckpoint) {
        let _ = self.sender.send(CheckpointCommand::Write(Box::new(ckpt))).await;
    }

    /// Wait until every write queued so far is on disk.
    pub async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        if self.sender.send(CheckpointCommand::Flush(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }
}
