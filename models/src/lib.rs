//! `shoal-models`: the candle side of Shoal.
//!
//! - [`model`]: model configs, an MLP and a LeNet-style CNN, and the
//!   [`TrainableModel`] trait the node drives.
//! - [`hf`]: Hugging Face model directories (`LlamaForCausalLM`).
//! - [`llama`]: a Llama-architecture transformer (`Arch::Llama`) under
//!   Hugging Face's tensor names, over bytes or a tokenizer's tokens.
//! - [`lm`]: what language models share (windows into tokens and targets,
//!   sampling).
//! - [`layout`]: [`ParamLayout`] (parameters as one flat vector) and
//!   [`ShardPlan`] (that vector cut into shards).
//! - [`optim`]: SGD (momentum, Nesterov) and AdamW over flat slices, with
//!   their state exposed so shard owners can hold and hand it off.
//! - [`precision`]: f32 or bf16 matrix products (`--dtype`), f32 master
//!   weights and optimizer state.
//! - [`resident`]: the same optimizers as tensor ops on the model's device,
//!   for single-node training on a GPU.
//! - [`checkpoint`]: safetensors checkpoints with metadata (resumable
//!   training state).
//! - [`modelfile`]: the trained model as one safetensors file under its
//!   layers' own names, for people and other software.
//! - [`shardfile`]: shard checkpoints that owners write while a cluster
//!   trains, for resuming after a full stop.
//! - [`data`]: embedded UCI digits, Fashion-MNIST IDX files, UTF-8 text as
//!   byte or token windows, token directories read by position, splits,
//!   partitions and seeded batching.
//! - [`tokenizer`]: Hugging Face `tokenizer.json` files, and a byte-level
//!   BPE trained from local text.
//! - [`train`]: the single-node training loop.
//!
//! Nothing here talks to the network, and nothing here panics on bad input.

pub mod checkpoint;
mod cpu_step;
pub mod data;
pub mod device;
pub mod error;
pub mod files;
pub mod grads;
pub mod hf;
pub mod kernels;
pub mod layout;
pub mod llama;
pub mod lm;
pub mod model;
pub mod modelfile;
pub mod optim;
pub mod precision;
pub mod resident;
pub mod rng;
pub mod shardfile;
pub mod tokenizer;
pub mod train;

pub use checkpoint::Checkpoint;
pub use data::{Dataset, DatasetKind, ImageShape, Partition, Split};
pub use device::DeviceKind;
pub use error::{ModelError, Result};
pub use layout::{ParamEntry, ParamLayout, Shard, ShardPlan};
pub use llama::LlamaSize;
pub use model::{Arch, ArchKind, Evaluation, GradOutput, LayerFactors, Model, ModelConfig, TrainableModel};
pub use modelfile::{ModelFile, ModelMeta, MODEL_FORMAT};
pub use optim::{Optimizer, OptimizerConfig, OptimizerKind, OptimizerState};
pub use precision::Precision;
pub use shardfile::{Scan, ShardCheckpoint, ShardDir, ShardOf, SHARD_FORMAT};
pub use train::{BatchProgress, EpochStats, LocalTrainer, LrAt, StepOptions};
