//! The trainer's handle and messages; the thread itself is
//! [`crate::actors::trainer`].

use std::sync::Arc;

use shoal_models::{Evaluation, LayerFactors};
use tokio::sync::{mpsc, oneshot};

/// Gradients of one batch.
#[derive(Debug, Clone)]
pub struct Gradients {
    pub loss: f32,
    pub samples: usize,
    pub grads: Vec<f32>,
    /// The fully connected layers' weight gradients as their sufficient
    /// factors, when asked for (`compression.push = "sfb"`).
    pub factors: Vec<LayerFactors>,
    /// The CPU time the trainer's thread spent on them, when asked for,
    /// the OS reports it, and the work ran on that one thread (the CPU
    /// device with one compute thread); `None` otherwise.
    pub cpu_time: Option<std::time::Duration>,
    /// Seconds the trainer spent loading parameters posted since the last
    /// gradients ([`TrainerHandle::post_params`]): part of the call's wall
    /// time, not of the gradients' compute.
    pub load_secs: f64,
}

/// The trainer thread's mailbox.
pub(crate) enum TrainerCommand {
    Gradients { indices: Vec<usize>, factored: bool, cpu_time: bool, reply: oneshot::Sender<anyhow::Result<Gradients>> },
    SetParams { params: Arc<Vec<f32>>, reply: oneshot::Sender<anyhow::Result<()>> },
    Evaluate { reply: oneshot::Sender<anyhow::Result<Evaluation>> },
    LoadTrain { rows: Vec<usize>, reply: oneshot::Sender<anyhow::Result<usize>> },
    Recycle { grads: Vec<f32> },
}

/// Parameters handed to the trainer with [`TrainerHandle::post_params`].
#[must_use = "the parameters may have failed to load"]
#[derive(Debug)]
pub struct PostedParams(oneshot::Receiver<anyhow::Result<()>>);

impl PostedParams {
    /// Whether they loaded. Once a command sent after them was answered,
    /// this does not wait.
    pub async fn loaded(self) -> anyhow::Result<()> {
        self.0.await.map_err(|_| anyhow::anyhow!("trainer thread dropped the parameters"))?
    }
}

/// Cloneable handle to the trainer thread.
#[derive(Debug, Clone)]
pub struct TrainerHandle {
    sender: mpsc::Sender<TrainerCommand>,
}

impl TrainerHandle {
    pub(crate) fn new(sender: mpsc::Sender<TrainerCommand>) -> Self {
        Self { sender }
    }

    async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<anyhow::Result<T>>) -> TrainerCommand,
    ) -> anyhow::Result<T> {
        let (tx, rx) = oneshot::channel();
        self.sender.send(make(tx)).await.map_err(|_| anyhow::anyhow!("trainer thread has stopped"))?;
        rx.await.map_err(|_| anyhow::anyhow!("trainer thread dropped the request"))?
    }

    /// Read the training samples `rows` (ascending, no repeats) of the data
    /// set, the only ones this node will train on: afterwards, index `k` of
    /// [`Self::gradients`] is sample `rows[k]`. Once per node. Returns the
    /// bytes they take in memory.
    pub async fn load_train(&self, rows: Vec<usize>) -> anyhow::Result<usize> {
        self.call(|reply| TrainerCommand::LoadTrain { rows, reply }).await
    }

    /// Forward and backward on the given samples of this node's training
    /// set (positions in what [`Self::load_train`] loaded). `factored`:
    /// give the fully connected layers' factors too. `cpu_time`: measure
    /// the trainer thread's CPU time for them ([`Gradients::cpu_time`]).
    pub async fn gradients(&self, indices: Vec<usize>, factored: bool, cpu_time: bool) -> anyhow::Result<Gradients> {
        self.call(|reply| TrainerCommand::Gradients { indices, factored, cpu_time, reply }).await
    }

    /// Hand back a step's gradients once they are pushed: the next step's
    /// are written into the same buffer (`Model::recycle_gradients`).
    /// Never waits: when the mailbox is full the buffer is dropped.
    pub fn recycle(&self, grads: Vec<f32>) {
        let _ = self.sender.try_send(TrainerCommand::Recycle { grads });
    }

    /// [`Self::set_params`] without waiting for the trainer: the
    /// parameters are loaded before any command sent after them (the
    /// trainer answers in order), so a step's loading and the next step's
    /// gradients are one hand-over to the trainer thread, not two. The
    /// outcome is in the [`PostedParams`].
    pub async fn post_params(&self, params: Arc<Vec<f32>>) -> anyhow::Result<PostedParams> {
        let (reply, rx) = oneshot::channel();
        self.sender
            .send(TrainerCommand::SetParams { params, reply })
            .await
            .map_err(|_| anyhow::anyhow!("trainer thread has stopped"))?;
        Ok(PostedParams(rx))
    }

    /// Load new parameters (flat, `ParamLayout` order) into the model.
    pub async fn set_params(&self, params: Arc<Vec<f32>>) -> anyhow::Result<()> {
        self.call(|reply| TrainerCommand::SetParams { params, reply }).await
    }

    /// Loss and accuracy on the test set.
    pub async fn evaluate(&self) -> anyhow::Result<Evaluation> {
        self.call(|reply| TrainerCommand::Evaluate { reply }).await
    }
}
