//! The checkpoint writer: writes shard checkpoints on its own OS thread, so
//! that disk work never runs on a tokio worker or stalls a training step.
//! Each write is atomic and prunes the shard's older files
//! ([`ShardDir::write`]); a failed write is logged with the file's name and
//! counted in status, and training goes on.

use std::time::Instant;

use anyhow::Context;
use shoal_models::ShardDir;
use tokio::sync::mpsc;
use tracing::{debug, warn};

use crate::handles::checkpoint::{CheckpointCommand, CheckpointHandle};
use crate::handles::status::{StatusEvent, StatusHandle};

/// Start the writer on `dir`, queueing at most `capacity` shards (room for
/// every shard and a replica of each at one aligned version, so that none
/// of those is ever dropped). It stops when every handle has been dropped.
pub fn spawn(dir: ShardDir, capacity: usize, status: StatusHandle, name: &str) -> anyhow::Result<CheckpointHandle> {
    let (sender, mut receiver) = mpsc::channel(capacity.max(1));
    std::thread::Builder::new()
        .name(format!("checkpoint-{name}"))
        .spawn(move || {
            while let Some(cmd) = receiver.blocking_recv() {
                match cmd {
                    CheckpointCommand::Write(ckpt) => {
                        let started = Instant::now();
                        match dir.write(&ckpt) {
                            Ok(path) => {
                                let secs = started.elapsed().as_secs_f64();
                                debug!(path = %path.display(), secs, "checkpoint written");
                                status.record(StatusEvent::CheckpointWritten {
                                    shard: ckpt.shard,
                                    version: ckpt.version,
                                    secs,
                                });
                            }
                            Err(e) => {
                                warn!(shard = ckpt.shard, version = ckpt.version, error = %e, "checkpoint not written");
                                status.record(StatusEvent::CheckpointFailed);
                            }
                        }
                    }
                    CheckpointCommand::Flush(done) => {
                        let _ = done.send(());
                    }
                }
            }
        })
        .context("spawning the checkpoint writer")?;
    Ok(CheckpointHandle::new(sender))
}
