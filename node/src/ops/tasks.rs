//! Every task a node spawns, owned in one place: a [`TaskTracker`] that
//! counts them and a [`CancellationToken`] that stops them.
//!
//! A node's actors, their helper tasks, its HTTP server and its libp2p
//! connection tasks are all spawned through one [`NodeTasks`]. When the
//! node's run ends (it finished, left, failed, or its task was aborted),
//! [`NodeTasks::shutdown`] stops them and waits until each has ended, so
//! nothing of the node is left running and its ports are closed (the
//! swarm, owned by the network actor, is dropped with it).
//!
//! The actors still stop on their own when their handles are gone; the
//! token is what ends the ones kept alive by a cycle of handles (the
//! network actor holds the aggregator's, which holds the network's).

use std::future::Future;
use std::pin::Pin;

use tokio_util::sync::{CancellationToken, DropGuard, WaitForCancellationFutureOwned};
use tokio_util::task::TaskTracker;

/// The tasks of one node, and the switch that stops them. Cheap to clone:
/// every clone spawns into and stops the same set.
#[derive(Debug, Clone, Default)]
pub struct NodeTasks {
    tracker: TaskTracker,
    stop: CancellationToken,
}

impl NodeTasks {
    pub fn new() -> Self {
        Self::default()
    }

    /// Spawn a task that runs until it ends or the node stops, whichever
    /// comes first. On a stop it is dropped at its next `.await`, as an
    /// aborted task would be: use it for tasks whose state dies with the
    /// node (actors, retries, transfers).
    pub fn spawn<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let stop = self.stop.clone();
        self.tracker.spawn(async move {
            tokio::select! {
                biased;
                _ = stop.cancelled() => {}
                _ = task => {}
            }
        });
    }

    /// Spawn a task that watches [`NodeTasks::stopping`] itself and winds
    /// down on its own, in bounded time (the HTTP server's graceful
    /// shutdown). The node's shutdown waits for it.
    pub fn spawn_graceful<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.tracker.spawn(task);
    }

    /// Resolves once the node is stopping.
    pub fn stopping(&self) -> WaitForCancellationFutureOwned {
        self.stop.clone().cancelled_owned()
    }

    /// Whether the node has been told to stop.
    pub fn is_stopping(&self) -> bool {
        self.stop.is_cancelled()
    }

    /// Stops the node's tasks when dropped: the node task holds it, so that
    /// aborting that task (a kill) stops everything it started.
    pub fn stop_on_drop(&self) -> DropGuard {
        self.stop.clone().drop_guard()
    }

    /// Tasks not yet ended.
    pub fn len(&self) -> usize {
        self.tracker.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tracker.is_empty()
    }

    /// Stop every task, and wait until each has ended. Tasks spawned after
    /// this are stopped at once (they see the token cancelled).
    pub async fn shutdown(&self) {
        self.stop.cancel();
        self.tracker.close();
        self.tracker.wait().await;
    }
}

/// libp2p spawns a task per connection through this: they are the node's
/// tasks too, and end with it.
impl shoal_protocol::libp2p::swarm::Executor for NodeTasks {
    fn exec(&self, future: Pin<Box<dyn Future<Output = ()> + Send>>) {
        self.spawn(future);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A task that never ends on its own ends on shutdown, and shutdown
    /// returns only once it has; a task that ended on its own is not waited for.
    #[tokio::test]
    async fn shutdown_ends_every_task_and_waits_for_them() {
        let tasks = NodeTasks::new();
        let (_keep, rx) = tokio::sync::oneshot::channel::<()>();
        tasks.spawn(async move {
            let _ = rx.await;
        });
        tasks.spawn(async {});
        let stopping = tasks.stopping();
        let graceful = tasks.clone();
        tasks.spawn_graceful(async move { graceful.stopping().await });
        tokio::task::yield_now().await;
        assert_eq!(tasks.len(), 2, "the task that ended on its own is gone");
        tokio::time::timeout(std::time::Duration::from_secs(5), tasks.shutdown())
            .await
            .expect("shutdown waits only for tasks that stop");
        assert!(tasks.is_empty() && tasks.is_stopping());
        stopping.await;
        // Spawned after the stop: ended at once.
        tasks.spawn(std::future::pending());
        tasks.shutdown().await;
        assert!(tasks.is_empty());
    }

    #[tokio::test]
    async fn dropping_the_guard_stops_the_tasks() {
        let tasks = NodeTasks::new();
        tasks.spawn(std::future::pending());
        drop(tasks.stop_on_drop());
        assert!(tasks.is_stopping());
        tasks.shutdown().await;
        assert!(tasks.is_empty());
    }
}
