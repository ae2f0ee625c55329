//! The trainer actor: candle on its own OS thread.
//!
//! Tensor work never runs on a tokio worker thread. The thread owns the model
//! and this node's data; async code talks to it through a cloneable
//! [`TrainerHandle`] holding a bounded sender, and gets replies on oneshots.
//! The thread ends when every handle has been dropped.

use std::sync::Arc;
use std::thread::JoinHandle;

use anyhow::Context;
use candle_core::Device;
use shoal_models::{Dataset, Evaluation, Model, ModelConfig, TrainableModel};
use tokio::sync::{mpsc, oneshot};
use tracing::debug;

/// Gradients of one batch.
#[derive(Debug, Clone)]
pub struct Gradients {
    pub loss: f32,
    pub samples: usize,
    pub grads: Vec<f32>,
}

enum TrainerCommand {
    Gradients { indices: Vec<usize>, reply: oneshot::Sender<anyhow::Result<Gradients>> },
    SetParams { params: Arc<Vec<f32>>, reply: oneshot::Sender<anyhow::Result<()>> },
    Evaluate { reply: oneshot::Sender<anyhow::Result<Evaluation>> },
}

/// Cloneable handle to the trainer thread.
#[derive(Debug, Clone)]
pub struct TrainerHandle {
    sender: mpsc::Sender<TrainerCommand>,
}

struct TrainerActor {
    model: Model,
    train: Dataset,
    test: Dataset,
    receiver: mpsc::Receiver<TrainerCommand>,
}

impl TrainerHandle {
    /// Build the model (deterministic from `seed`) on `device` and start the thread.
    /// Returns the handle, the thread, and the initial flat parameters.
    pub fn spawn(
        config: ModelConfig,
        seed: u64,
        device: Device,
        train: Dataset,
        test: Dataset,
        capacity: usize,
        name: &str,
    ) -> anyhow::Result<(Self, JoinHandle<()>, Vec<f32>)> {
        let model = Model::new(config, seed, &device)?;
        let initial = model.parameters()?;
        let (sender, receiver) = mpsc::channel(capacity.max(1));
        let actor = TrainerActor { model, train, test, receiver };
        let thread = std::thread::Builder::new()
            .name(format!("trainer-{name}"))
            .spawn(move || actor.run())
            .context("spawning the trainer thread")?;
        Ok((Self { sender }, thread, initial))
    }

    async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<anyhow::Result<T>>) -> TrainerCommand,
    ) -> anyhow::Result<T> {
        let (tx, rx) = oneshot::channel();
        self.sender.send(make(tx)).await.map_err(|_| anyhow::anyhow!("trainer thread has stopped"))?;
        rx.await.map_err(|_| anyhow::anyhow!("trainer thread dropped the request"))?
    }

    /// Forward and backward on the given samples of this node's training set.
    pub async fn gradients(&self, indices: Vec<usize>) -> anyhow::Result<Gradients> {
        self.call(|reply| TrainerCommand::Gradients { indices, reply }).await
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

impl TrainerActor {
    fn run(mut self) {
        while let Some(cmd) = self.receiver.blocking_recv() {
            match cmd {
                TrainerCommand::Gradients { indices, reply } => {
                    let _ = reply.send(self.gradients(&indices));
                }
                TrainerCommand::SetParams { params, reply } => {
                    let _ = reply.send(self.model.set_parameters(&params).map_err(Into::into));
                }
                TrainerCommand::Evaluate { reply } => {
                    let _ = reply.send(self.model.evaluate(&self.test, 512).map_err(Into::into));
                }
            }
        }
        debug!("trainer thread stopping: all handles dropped");
    }

    fn gradients(&self, indices: &[usize]) -> anyhow::Result<Gradients> {
        let (x, y) = self.train.batch(indices, self.model.device())?;
        let out = self.model.gradients(&x, &y)?;
        if !out.loss.is_finite() {
            anyhow::bail!("loss became {}; lower the learning rate", out.loss);
        }
        Ok(Gradients { loss: out.loss, samples: out.samples, grads: out.grads })
    }
}
