//! Delta pulls (issue 46): in local-steps mode an owner sends each round's
//! outer update, compressed, in place of the shard, and every worker adds
//! it to the copy it holds.
//!
//! The worker's copy stays bit for bit the owner's because the owner never
//! keeps an update it did not send: once the outer optimizer has moved the
//! shard, [`DeltaLog::record`] compresses the move (plus what earlier
//! rounds' compression left out, error feedback on the owner's side), puts
//! the shard back where it was and adds the encoded update to it with
//! [`Payload::add_scaled_into`] at weight 1, the one addition the workers
//! run too (a sparse update touches only its kept entries on both sides,
//! so even a `-0.0` stays as it was). What the encoding
//! dropped waits in the residual for the next round. A reply carries
//! [`shoal_protocol::payload::params_hash`] of the result, so a worker that
//! added the update to anything else finds out and pulls the whole shard.

use std::sync::Arc;

use shoal_protocol::payload::params_hash;
use shoal_protocol::Payload;

use crate::policy::compress::{ErrorFeedback, PushCompression};

/// One round's update of a shard: from `base` to `version`, as sent.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardDelta {
    pub base: u64,
    pub version: u64,
    /// The update, encoded.
    pub payload: Payload,
    /// [`params_hash`] of the shard at `version`.
    pub hash: u64,
}

/// An owner's side of delta pulls for one shard: the encoding, the
/// residual, and the last round's update.
#[derive(Debug)]
pub struct DeltaLog {
    compression: PushCompression,
    feedback: ErrorFeedback,
    last: Option<Arc<ShardDelta>>,
}

impl DeltaLog {
    /// Updates sent as `compression` encodes them (a lossy encoding; `none`
    /// sends them in f32, exact and as large as the shard).
    pub fn new(compression: PushCompression) -> Self {
        Self { compression, feedback: ErrorFeedback::new(1), last: None }
    }

    /// The shard moved from `before` to `params`, reaching `version`: make
    /// `params` `before` plus the update as it will be sent, and keep that
    /// update for the pulls of `version - 1`. If the update cannot be
    /// encoded (a value that is not finite), the move stands as it is and
    /// no update is kept: pullers get the whole shard. Returns the
    /// elements its loops visited (see [`crate::policy::sync::ShardCore::take_work`]).
    pub fn record(&mut self, before: &[f32], params: &mut [f32], version: u64) -> u64 {
        self.last = None;
        let len = params.len() as u64;
        let update: Vec<f32> = params.iter().zip(before).map(|(p, b)| p - b).collect();
        let Ok(sent) = self.feedback.compress(0, &update, self.compression.encoding(update.len())) else {
            return 4 * len;
        };
        params.copy_from_slice(before);
        if sent.payload.add_scaled_into(params, 1.0).is_err() {
            // Not for a payload just encoded from finite values; were it
            // so, the move stands and pullers take the whole shard.
            for ((p, b), u) in params.iter_mut().zip(before).zip(&update) {
                *p = b + u;
            }
            return 8 * len;
        }
        let stored = sent.payload.stored();
        self.last = Some(Arc::new(ShardDelta {
            base: version.saturating_sub(1),
            version,
            payload: sent.payload,
            hash: params_hash(params),
        }));
        // The update; the residual's sum, encoding, decoding (a sparse one
        // zeroed, then its entries) and difference; the copy back, the
        // addition (its entries) and the hash.
        7 * len + 2 * stored
    }

    /// The update to send a puller that holds version `have` exactly, when
    /// the shard is at `version`: only the one round's update from `have`.
    pub fn from(&self, have: u64, version: u64) -> Option<Arc<ShardDelta>> {
        self.last.as_ref().filter(|d| d.base == have && d.version == version).cloned()
    }

    /// What compression has left out so far (the residual's values).
    pub fn owed(&self) -> &[f32] {
        self.feedback.residual(0)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn moved(before: &[f32], seed: u32) -> Vec<f32> {
        before.iter().enumerate().map(|(i, b)| b + ((i as u32 * 7 + seed) as f32 * 0.61).sin() * 0.01).collect()
    }

    /// A worker that adds each round's decoded update to its copy ends each
    /// round with the owner's bits, for every lossy encoding, and the
    /// owner's shard plus what it still owes is where its optimizer went.
    #[test]
    fn a_worker_adding_the_updates_holds_the_owners_bits_and_nothing_is_lost() {
        for compression in ["int8", "sparseloco:0.02", "topk:0.05", "bf16", "none"] {
            let compression: PushCompression = compression.parse().unwrap();
            let start: Vec<f32> = (0..5000).map(|i| (i as f32 * 0.013).cos()).collect();
            let mut owner = start.clone();
            let mut worker = start.clone();
            let mut optimizer_path = start.clone();
            let mut log = DeltaLog::new(compression);
            for version in 1..=6u64 {
                let before = owner.clone();
                // The optimizer's move: the same step on the owner's shard
                // and on a copy that is never compressed.
                let target = moved(&before, version as u32);
                for ((p, t), b) in optimizer_path.iter_mut().zip(&target).zip(&before) {
                    *p += t - b;
                }
                owner.copy_from_slice(&target);
                log.record(&before, &mut owner, version);
                assert!(log.from(version, version).is_none(), "no update from the version it leads to");
                let d = log.from(version - 1, version).unwrap();
                assert_eq!((d.base, d.version), (version - 1, version));
                d.payload.add_scaled_into(&mut worker, 1.0).unwrap();
                assert_eq!(params_hash(&worker), d.hash, "{compression} round {version}");
                assert!(worker.iter().zip(&owner).all(|(w, o)| w.to_bits() == o.to_bits()));
            }
            // Shard plus residual is the optimizer's path, to f32 rounding.
            let err = owner
                .iter()
                .zip(log.owed())
                .zip(&optimizer_path)
                .map(|((o, r), p)| (o + r - p).abs())
                .fold(0.0f32, f32::max);
            assert!(err < 1e-5, "{compression}: {err}");
            if compression.is_lossy() {
                assert!(log.owed().iter().any(|r| *r != 0.0), "{compression} owes something");
            }
        }
    }

    /// A sparse update is far smaller than the shard.
    #[test]
    fn a_sparse_update_is_a_small_fraction_of_the_shard() {
        let before: Vec<f32> = vec![0.5; 8192];
        let mut params = moved(&before, 3);
        let mut log = DeltaLog::new("sparseloco:0.015".parse().unwrap());
        log.record(&before, &mut params, 4);
        let d = log.from(3, 4).unwrap();
        let f32_bytes = (before.len() * 4) as u64;
        assert!(d.payload.byte_len() * 50 < f32_bytes, "{} of {f32_bytes}", d.payload.byte_len());
    }

    /// An update that cannot be encoded leaves the optimizer's move in
    /// place and serves nothing: pullers take the whole shard.
    #[test]
    fn an_update_that_cannot_be_encoded_is_not_served() {
        let before = vec![1.0f32; 16];
        let mut params = before.clone();
        params[3] = f32::NAN;
        let mut log = DeltaLog::new(PushCompression::Int8);
        log.record(&before, &mut params, 1);
        assert!(log.from(0, 1).is_none());
        assert!(params[3].is_nan());
    }
}
