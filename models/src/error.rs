//! The one error type of `shoal-models`.

use std::path::PathBuf;

/// Everything that can go wrong in the candle side of Shoal.
///
/// Input from files (datasets, checkpoints) and from callers (configs, flat
/// buffers) is checked and reported through this type; nothing here panics
/// on bad input.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),

    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{path}: {reason}")]
    BadFile { path: PathBuf, reason: String },

    #[error("dataset {name} not found: {hint}")]
    DatasetMissing { name: String, hint: String },

    #[error("invalid model config: {0}")]
    Config(String),

    #[error("device {requested} is not available: {reason}")]
    Device { requested: String, reason: String },

    #[error("flat buffer has {got} values, layout expects {expected}")]
    FlatLength { expected: usize, got: usize },

    #[error("invalid shard plan: {0}")]
    ShardPlan(String),

    #[error("checkpoint {path}: {reason}")]
    Checkpoint { path: PathBuf, reason: String },

    #[error("optimizer: {0}")]
    Optimizer(String),

    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, ModelError>;

impl ModelError {
    pub(crate) fn bad_file(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        ModelError::BadFile { path: path.into(), reason: reason.into() }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io { path: path.into(), source }
    }
}
