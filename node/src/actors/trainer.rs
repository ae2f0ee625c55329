//! The trainer actor: candle on its own OS thread.
//!
//! Tensor work never runs on a tokio worker thread. The thread owns the model
//! and this node's data; async code talks to it through a cloneable
//! [`TrainerHandle`] holding a bounded sender, and gets replies on oneshots.
//! The thread ends when every handle has been dropped. The loop runs inside
//! a rayon pool of its own (`training.threads` threads), which candle's
//! matrix products and loops then use (see [`crate::ops::threads`]).

use std::thread::JoinHandle;

use anyhow::Context;
use shoal_models::data::OpenedData;
use shoal_models::{Dataset, Model, TrainableModel};
use tokio::sync::mpsc;
use tracing::debug;

use crate::handles::trainer::{Gradients, TrainerCommand, TrainerHandle};

struct TrainerActor {
    model: Model,
    /// The data set, until its training samples are loaded.
    data: OpenedData,
    /// This node's training samples (none before `LoadTrain`).
    train: Option<Dataset>,
    receiver: mpsc::Receiver<TrainerCommand>,
    /// The tensor work runs on the CPU, on one thread (the loop's, in a
    /// pool of one), so that thread's CPU time is the work's.
    alone: bool,
    /// Seconds spent loading posted parameters since the last gradients.
    load_secs: f64,
}

/// Start the thread that trains `model` (built deterministically from the
/// run's seed, see [`Model::new`]). Returns the handle, the thread, and the
/// initial flat parameters.
pub fn spawn(
    model: Model,
    data: OpenedData,
    capacity: usize,
    threads: usize,
    name: &str,
) -> anyhow::Result<(TrainerHandle, JoinHandle<()>, Vec<f32>)> {
    let device = model.device().clone();
    let initial = model.parameters()?;
    let (sender, receiver) = mpsc::channel(capacity.max(1));
    let pool = crate::ops::threads::compute_pool(threads, name)?;
    // On a GPU the thread's CPU time is kernel launches and however the
    // driver waits, not the work.
    let alone = pool.current_num_threads() == 1 && device.is_cpu();
    let actor = TrainerActor { model, data, train: None, receiver, alone, load_secs: 0.0 };
    let thread = std::thread::Builder::new()
        .name(format!("trainer-{name}"))
        .spawn(move || pool.install(move || actor.run()))
        .context("spawning the trainer thread")?;
    Ok((TrainerHandle::new(sender), thread, initial))
}

impl TrainerActor {
    fn run(mut self) {
        while let Some(cmd) = self.receiver.blocking_recv() {
            match cmd {
                TrainerCommand::Gradients { indices, factored, cpu_time, reply } => {
                    let g = self.gradients(&indices, factored, cpu_time);
                    let load_secs = std::mem::take(&mut self.load_secs);
                    let _ = reply.send(g.map(|g| Gradients { load_secs, ..g }));
                }
                TrainerCommand::SetParams { params, reply } => {
                    let started = std::time::Instant::now();
                    let loaded = self.model.set_parameters(&params).map_err(Into::into);
                    self.load_secs += started.elapsed().as_secs_f64();
                    let _ = reply.send(loaded);
                }
                TrainerCommand::Evaluate { reply } => {
                    let _ = reply.send(self.model.evaluate(&self.data.test, 512).map_err(Into::into));
                }
                TrainerCommand::Recycle { grads } => self.model.recycle_gradients(grads),
                TrainerCommand::LoadTrain { rows, reply } => {
                    let loaded = self.data.take_train(&rows).map_err(anyhow::Error::from).map(|train| {
                        let bytes = train.memory_bytes();
                        self.train = Some(train);
                        bytes
                    });
                    let _ = reply.send(loaded);
                }
            }
        }
        debug!("trainer thread stopping: all handles dropped");
    }

    fn gradients(&self, indices: &[usize], factored: bool, cpu_time: bool) -> anyhow::Result<Gradients> {
        let cpu_start = (cpu_time && self.alone).then(crate::ops::threads::thread_cpu_time).flatten();
        let train = self.train.as_ref().context("the training samples are not loaded yet")?;
        let (x, y) = train.batch(indices, self.model.device())?;
        let out = if factored { self.model.gradients_factored(&x, &y)? } else { self.model.gradients(&x, &y)? };
        if !out.loss.is_finite() {
            anyhow::bail!("loss became {}; lower the learning rate", out.loss);
        }
        let cpu_time = cpu_start.and_then(|start| Some(crate::ops::threads::thread_cpu_time()?.saturating_sub(start)));
        Ok(Gradients {
            loss: out.loss,
            samples: out.samples,
            grads: out.grads,
            factors: out.factors,
            cpu_time,
            load_secs: 0.0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[tokio::test]
    async fn gradients_carry_the_threads_cpu_time_only_when_asked_and_one_thread_did_the_work() -> anyhow::Result<()> {
        let cfg = crate::config::NodeConfig::default();
        for threads in [1, 2] {
            let data = shoal_models::data::open(&shoal_models::data::DatasetKind::Digits, None)?;
            let model = cfg.model_config(&data.test);
            let rows: Vec<usize> = (0..data.train_len).collect();
            let (trainer, _thread, _) = spawn(Model::new(model, 7, &Device::Cpu)?, data, 4, threads, "t")?;
            trainer.load_train(rows).await?;
            let unasked = trainer.gradients((0..64).collect(), false, false).await?;
            assert_eq!(unasked.cpu_time, None, "{threads} threads, not asked");
            let asked = trainer.gradients((0..64).collect(), false, true).await?;
            assert_eq!(asked.samples, 64);
            if threads > 1 {
                assert_eq!(asked.cpu_time, None, "two threads: one thread's clock is not the work's");
            } else if crate::ops::threads::thread_cpu_time().is_some() {
                assert!(asked.cpu_time.is_some_and(|t| !t.is_zero()), "{:?}", asked.cpu_time);
            }
        }
        Ok(())
    }

    #[tokio::test]
    async fn a_recycled_gradient_buffer_takes_the_next_steps_gradients() -> anyhow::Result<()> {
        let cfg = crate::config::NodeConfig::default();
        let data = shoal_models::data::open(&shoal_models::data::DatasetKind::Digits, None)?;
        let model = cfg.model_config(&data.test);
        let rows: Vec<usize> = (0..data.train_len).collect();
        let (trainer, _thread, _) = spawn(Model::new(model, 7, &Device::Cpu)?, data, 4, 1, "r")?;
        trainer.load_train(rows).await?;
        let first = trainer.gradients((0..32).collect(), false, false).await?;
        let again = trainer.gradients((0..32).collect(), false, false).await?;
        let at = first.grads.as_ptr();
        trainer.recycle(first.grads);
        let next = trainer.gradients((0..32).collect(), false, false).await?;
        assert_eq!(next.grads.as_ptr(), at, "the recycled buffer took the gradients");
        assert_eq!(next.grads, again.grads, "the same batch, the same gradients");
        Ok(())
    }
}
