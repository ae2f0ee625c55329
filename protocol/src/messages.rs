//! Message types. Everything here is encoded with postcard (see
//! `docs/protocol.md` for the byte-level rules); tensors inside messages are
//! [`Payload`]s whose bodies travel after the postcard header.
//!
//! Postcard is not self-describing, so the field order of every struct and
//! the variant order of every enum *is* the wire format: any change to them
//! (a new variant included) moves [`WIRE_VERSION`], and peers of different
//! versions refuse each other.

use std::fmt;

use libp2p::PeerId;
use serde::{Deserialize, Serialize};

use crate::error::ProtocolError;
pub use crate::error_code::ErrorCode;
use crate::payload::{Encoding, Payload};
pub use crate::wire::WIRE_VERSION;

/// How deep requests and answers may nest in one message: a `Timed`
/// answer holding an `ExchangedMany` of answers is two levels. Deeper
/// headers are refused while decoding, so a peer's bytes cannot make the
/// decoder recurse until the stack runs out.
pub const MAX_NESTING: u8 = 2;

/// Decoding of the fields that hold other requests or answers, with a
/// count of how deep the decoder is (see [`MAX_NESTING`]). Decoding is
/// synchronous, so a per-thread count is exact.
mod nesting {
    use std::cell::Cell;

    use serde::{Deserialize, Deserializer};

    thread_local! {
        static DEPTH: Cell<u8> = const { Cell::new(0) };
    }

    /// One level entered; left when dropped (also on an error).
    struct Level;

    impl Drop for Level {
        fn drop(&mut self) {
            DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
        }
    }

    fn enter<E: serde::de::Error>() -> Result<Level, E> {
        DEPTH.with(|d| {
            if d.get() >= super::MAX_NESTING {
                return Err(E::custom(format!("requests or answers nested more than {} deep", super::MAX_NESTING)));
            }
            d.set(d.get() + 1);
            Ok(Level)
        })
    }

    /// `deserialize_with` for a field that holds requests or answers.
    pub fn nested<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<T, D::Error> {
        let _level = enter::<D::Error>()?;
        T::deserialize(d)
    }
}

/// Most `PushPull`s in one `PushPullMany` (as many as a heartbeat may list
/// as owned by one node).
pub const MAX_BATCH_SHARDS: usize = MAX_OWNED_SHARDS;

/// Most elements of a `Probe`'s padding (16 MiB of f32).
pub const MAX_PROBE_ELEMENTS: u64 = 4 << 20;

/// Shard index into the model's `ParamLayout`.
pub type ShardId = u32;
/// Version of a shard (bumped by its owner on every optimizer step).
pub type Version = u64;
/// Assignment epoch (derived from the election's inputs).
pub type Epoch = u64;

/// Most shards a manifest may list.
pub const MAX_MANIFEST_SHARDS: usize = 4096;
/// Most shards a heartbeat may list as owned, or give versions of (keeps
/// heartbeats under 8 KiB).
pub const MAX_OWNED_SHARDS: usize = 256;
/// Most service-time observations in one heartbeat.
pub const MAX_SERVICE_OBSERVATIONS: usize = 32;
/// Most optimizer state slots in a handoff (AdamW has two).
pub const MAX_OPTIMIZER_SLOTS: usize = 4;
/// Longest short name (optimizer kind, slot name).
pub const MAX_NAME_LEN: usize = 32;
/// Longest error message.
pub const MAX_ERROR_MESSAGE_LEN: usize = 1024;

/// A run id: 1 to 64 characters from `[A-Za-z0-9._-]`, so it can sit in a
/// gossip topic and a log line unescaped. Validated on construction and on
/// deserialization.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct RunId(String);

impl RunId {
    /// Validates and wraps a run id.
    pub fn new(s: impl Into<String>) -> Result<RunId, ProtocolError> {
        let s = s.into();
        let ok = !s.is_empty()
            && s.len() <= 64
            && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if ok {
            Ok(RunId(s))
        } else {
            Err(ProtocolError::InvalidRunId(s))
        }
    }

    /// The id as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for RunId {
    fn default() -> Self {
        RunId("default".to_owned())
    }
}

impl fmt::Display for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for RunId {
    type Error = ProtocolError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        RunId::new(s)
    }
}

impl From<RunId> for String {
    fn from(r: RunId) -> String {
        r.0
    }
}

impl std::str::FromStr for RunId {
    type Err = ProtocolError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RunId::new(s)
    }
}

// ---------------------------------------------------------------------------
// Requests on /shoal/shard/13.0.0
// ---------------------------------------------------------------------------

/// A worker's gradient contribution for one shard.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PushGrad {
    /// Run id.
    pub run: RunId,
    /// Shard the gradient belongs to.
    pub shard: ShardId,
    /// The assignment epoch the worker used to pick this owner.
    pub epoch: Epoch,
    /// Shard version the gradient was computed against (staleness is
    /// `owner_version - base_version`).
    pub base_version: Version,
    /// The worker; must equal the authenticated sender.
    pub worker: PeerId,
    /// The worker's incarnation (fences contributions from a previous life).
    pub incarnation: u64,
    /// The worker's local step.
    pub step: u64,
    /// Samples behind the gradient (aggregation weight); at least 1.
    pub samples: u32,
    /// The gradient slice.
    pub grad: Payload,
}

/// Fetch a shard from its owner.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PullShard {
    /// Run id.
    pub run: RunId,
    /// Shard wanted.
    pub shard: ShardId,
    /// Oldest acceptable version. The owner may hold the request up to
    /// `max_wait_ms` for this version to appear, then answers `NotReady`.
    pub min_version: Version,
    /// How long the owner may hold the request, in ms (capped by the
    /// owner's `timeouts.response_wait_ms`).
    pub max_wait_ms: u32,
    /// Encoding the puller would like. Owners always honour `F32`; they may
    /// ignore others and answer in F32.
    pub encoding: Encoding,
    /// The version of this shard the puller holds exactly (bit for bit as
    /// the owner had it), if any: an owner that kept the update from it to
    /// the version it serves may answer with that update instead of the
    /// shard ([`ShardState::delta`]).
    pub have: Option<Version>,
}

/// Push a gradient and get the shard's next state in the same exchange:
/// one request per shard and step instead of a `PushGrad`
/// and a `PullShard`. The owner takes the gradient as it would a
/// `PushGrad`; if it is accepted, the owner holds the answer until the
/// version the worker needs exists (BSP: the one after the round the
/// gradient joined; other policies: when the staleness bound lets the
/// worker through), at most `max_wait_ms`, and answers `Exchanged`.
/// A gradient that is not accepted gets the answer a `PushGrad` would.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PushPull {
    /// The push.
    pub push: PushGrad,
    /// How long the owner may hold the answer, in ms (capped by the owner's
    /// `timeouts.response_wait_ms`).
    pub max_wait_ms: u32,
    /// Encoding wanted for the state (as `PullShard::encoding`).
    pub encoding: Encoding,
    /// As `PullShard::have`.
    pub have: Option<Version>,
}

/// Why a shard's state is being sent to another node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum HandoffKind {
    /// Ownership moves: the receiver becomes the owner for `epoch`.
    Transfer,
    /// A backup copy for the next rendezvous choice; ownership stays.
    Replica,
}

/// One named optimizer state tensor (e.g. AdamW's `m` and `v`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerSlot {
    /// Slot name, at most 32 bytes.
    pub name: String,
    /// The state, same element order as the shard's parameters.
    pub tensor: Payload,
}

/// Optimizer state of one shard.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerState {
    /// Optimizer name ("sgd", "adamw", ...), at most 32 bytes.
    pub kind: String,
    /// Optimizer step count (bias correction).
    pub step: u64,
    /// State tensors, at most 4.
    pub slots: Vec<OptimizerSlot>,
}

/// Moves (or replicates) a shard with its optimizer state and version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Handoff {
    /// Run id.
    pub run: RunId,
    /// The shard.
    pub shard: ShardId,
    /// How many times this transfer has been forwarded: 0 from the shard's
    /// previous owner, one more at each node that passes it on because its
    /// view names another owner. A receiver keeps a transfer that has been
    /// forwarded often (views disagree) instead of passing it on again, so
    /// a transfer cannot bounce between two nodes until their views agree.
    /// Replicas carry 0. Handoffs are fenced by
    /// `version`, not by epoch: the placement epoch is a hash of the
    /// election's inputs, not an ordered number. A transfer that meets an
    /// installed copy of the same or a higher version is `Fenced`.
    pub hops: u64,
    /// Transfer or replica.
    pub kind: HandoffKind,
    /// The previous owner; must equal the authenticated sender.
    pub from: PeerId,
    /// The previous owner's incarnation.
    pub from_incarnation: u64,
    /// Shard version of `params`.
    pub version: Version,
    /// Parameters (F32 so no precision is lost in a move).
    pub params: Payload,
    /// Optimizer state.
    pub optimizer: OptimizerState,
    /// A transfer of a BSP shard restored from an older copy that has not
    /// closed a round since: how far a worker's newer base may still move
    /// its numbering (the sender's catch-up room); 0 for a settled shard
    /// and for replicas. The receiver takes it up to its own configured
    /// room, so that the shard keeps catching up to the workers' versions
    /// after it moves.
    pub catch_up_room: u64,
}

/// A joiner fetches one shard of the current model from any peer that holds
/// a copy (workers hold the whole model), so state sync spreads over many
/// donors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StateSync {
    /// Run id.
    pub run: RunId,
    /// Shard wanted.
    pub shard: ShardId,
    /// Oldest acceptable version (a donor with an older copy answers
    /// `NotReady`).
    pub min_version: Version,
}

/// Ask a peer for its view of the model: shard count, versions, owners.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ManifestRequest {
    /// Run id.
    pub run: RunId,
}

/// Time a demoted owner's service without giving it a shard. Workers send
/// one now and then to each owner the placement keeps out
/// as a straggler, with padding the size of their typical push, so that the
/// verdict about it rests on fresh measurements: it stays out while it is
/// slow and comes back once it is not, instead of being handed shards again
/// whenever the old reports about it age out. The owner answers `Probed`
/// after the delays a push would meet there.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Probe {
    /// Run id.
    pub run: RunId,
    /// Bytes to carry, as a push would (f32 zeros; at most
    /// [`MAX_PROBE_ELEMENTS`]).
    pub padding: Payload,
}

/// A request on `/shoal/shard/12.0.0`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ShardRequest {
    /// Variant 0.
    PushGrad(PushGrad),
    /// Variant 1.
    PullShard(PullShard),
    /// Variant 2.
    Handoff(Handoff),
    /// Variant 3.
    StateSync(StateSync),
    /// Variant 4.
    Manifest(ManifestRequest),
    /// Variant 5.
    PushPull(PushPull),
    /// Variant 6.
    Probe(Probe),
    /// Variant 7: several shards of one owner in one
    /// exchange. Each `PushPull` is served exactly as if it had come alone;
    /// the answer is an `ExchangedMany` with each one's answer, in order.
    /// One request instead of one per shard: at small shard sizes the cost
    /// per request (a stream, its negotiation, a frame each way), not the
    /// bytes, bounds a step. At most [`MAX_BATCH_SHARDS`], each shard at
    /// most once, all of one run.
    PushPullMany(Vec<PushPull>),
    /// Variant 8: serve the request inside as if it had
    /// come alone, and say how long this node took: the answer is
    /// [`ShardResponse::Timed`] around the request's own answer. Only
    /// around the requests whose service the straggler detector times
    /// (`PushGrad`, `PushPull`, `PushPullMany`, `Probe`); never around
    /// another `Timed`.
    Timed(#[serde(deserialize_with = "nesting::nested")] Box<ShardRequest>),
    /// Never on the wire: the codec hands this to the node when a frame was
    /// well formed (within limits) but its header or tensors could not be
    /// understood (a bad tensor header, an unknown variant). The node answers it
    /// with `ShardResponse::Error` (see [`ShardRequest::Undecodable`]'s
    /// `code`), so the sender learns why instead of seeing a reset stream.
    #[serde(skip)]
    Undecodable {
        /// What to answer with.
        code: ErrorCode,
        /// Why decoding failed.
        reason: String,
    },
}

impl ShardRequest {
    /// Run id of the request, if it has one.
    pub fn run(&self) -> Option<&RunId> {
        match self {
            ShardRequest::PushGrad(m) => Some(&m.run),
            ShardRequest::PullShard(m) => Some(&m.run),
            ShardRequest::Handoff(m) => Some(&m.run),
            ShardRequest::StateSync(m) => Some(&m.run),
            ShardRequest::Manifest(m) => Some(&m.run),
            ShardRequest::PushPull(m) => Some(&m.push.run),
            ShardRequest::Probe(m) => Some(&m.run),
            ShardRequest::PushPullMany(v) => v.first().map(|m| &m.push.run),
            ShardRequest::Timed(r) => r.run(),
            ShardRequest::Undecodable { .. } => None,
        }
    }

    /// Shard the request is about, if any.
    pub fn shard(&self) -> Option<ShardId> {
        match self {
            ShardRequest::PushGrad(m) => Some(m.shard),
            ShardRequest::PullShard(m) => Some(m.shard),
            ShardRequest::Handoff(m) => Some(m.shard),
            ShardRequest::StateSync(m) => Some(m.shard),
            ShardRequest::PushPull(m) => Some(m.push.shard),
            ShardRequest::Timed(r) => r.shard(),
            ShardRequest::Manifest(_)
            | ShardRequest::Probe(_)
            | ShardRequest::PushPullMany(_)
            | ShardRequest::Undecodable { .. } => None,
        }
    }

    /// Short name for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            ShardRequest::PushGrad(_) => "push_grad",
            ShardRequest::PullShard(_) => "pull_shard",
            ShardRequest::Handoff(_) => "handoff",
            ShardRequest::StateSync(_) => "state_sync",
            ShardRequest::Manifest(_) => "manifest",
            ShardRequest::PushPull(_) => "push_pull",
            ShardRequest::Probe(_) => "probe",
            ShardRequest::PushPullMany(_) => "push_pull_many",
            ShardRequest::Timed(_) => "timed",
            ShardRequest::Undecodable { .. } => "undecodable",
        }
    }

    /// The [`ShardResponse::Error`] a node should send back for an
    /// `Undecodable` request (or `None` for a real request).
    pub fn undecodable_reply(&self) -> Option<ShardResponse> {
        match self {
            ShardRequest::Undecodable { code, reason, .. } => {
                Some(ShardResponse::Error(WireError::new(*code, reason.clone())))
            }
            _ => None,
        }
    }
}

// ---------------------------------------------------------------------------
// Responses
// ---------------------------------------------------------------------------

/// A pushed gradient was accepted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Accepted {
    /// The shard.
    pub shard: ShardId,
    /// Owner's current version when the push arrived.
    pub version: Version,
    /// Staleness the owner recorded for this contribution
    /// (`version - base_version`).
    pub staleness: u64,
}

/// A shard's state (answer to `PullShard` and `StateSync`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardState {
    /// Run id.
    pub run: RunId,
    /// The shard.
    pub shard: ShardId,
    /// Version of `params`.
    pub version: Version,
    /// Epoch under which the sender holds it.
    pub epoch: Epoch,
    /// Parameters, or with `delta` the update to add to them.
    pub params: Payload,
    /// `None`: `params` are the shard. Else `params` decode to the update
    /// from version `delta.base` to `version`: the puller adds it to the
    /// copy it holds of `base` (the `have` it sent) with
    /// [`crate::Payload::add_scaled_into`] at weight 1, and the sum hashes
    /// to `delta.hash` ([`crate::payload::params_hash`]).
    pub delta: Option<DeltaOf>,
}

/// What a delta answer to a pull is relative to ([`ShardState::delta`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeltaOf {
    /// The version the update applies to.
    pub base: Version,
    /// [`crate::payload::params_hash`] of the shard after the update.
    pub hash: u64,
}

/// Answer to a `PushPull` whose gradient was accepted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Exchanged {
    /// As the `Accepted` answer to a `PushGrad`.
    pub accepted: Accepted,
    /// How long the owner held the answer after taking the gradient,
    /// waiting for the new version, in ms. The worker subtracts it from the
    /// round trip to time the owner's service (the straggler detector).
    pub held_ms: u32,
    /// The shard's state, or `None` when the version the worker needs did
    /// not come within `max_wait_ms`: the gradient counts, and the worker
    /// pulls the state with `PullShard`.
    pub state: Option<ShardState>,
}

impl Exchanged {
    /// Bytes of shard state the answer carries (0 without a state).
    pub fn state_bytes(&self) -> u64 {
        self.state.as_ref().map_or(0, |s| s.params.byte_len())
    }
}

/// One shard in a manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardSummary {
    /// The shard.
    pub shard: ShardId,
    /// Newest version the answering peer holds.
    pub version: Version,
    /// Elements in the shard.
    pub numel: u64,
    /// Owner in the answering peer's view.
    pub owner: Option<PeerId>,
}

/// A peer's view of the model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Run id.
    pub run: RunId,
    /// Hash of the model config and layout; joiners refuse a mismatch.
    pub config_hash: u64,
    /// The answering peer's assignment epoch.
    pub epoch: Epoch,
    /// The answering peer's training step.
    pub step: u64,
    /// Shards, at most 4096.
    pub shards: Vec<ShardSummary>,
}

/// An error answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireError {
    /// Machine-readable code.
    pub code: ErrorCode,
    /// Human-readable detail, at most 1024 bytes.
    pub message: String,
}

impl WireError {
    /// Builds an error, truncating the message to the wire limit.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> WireError {
        let mut message = message.into();
        if message.len() > MAX_ERROR_MESSAGE_LEN {
            let mut cut = MAX_ERROR_MESSAGE_LEN;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
        }
        WireError { code, message }
    }
}

impl From<&ProtocolError> for WireError {
    fn from(e: &ProtocolError) -> Self {
        WireError::new(e.code(), e.to_string())
    }
}

/// A response on `/shoal/shard/12.0.0`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ShardResponse {
    /// Variant 0: the push was accepted.
    Accepted(Accepted),
    /// Variant 1: the push is too stale under the owner's sync policy; pull
    /// and recompute.
    Stale {
        /// The shard.
        shard: ShardId,
        /// Owner's current version.
        current_version: Version,
        /// Largest staleness the owner accepts right now.
        max_staleness: u64,
    },
    /// Variant 2: the responder does not own the shard in its view.
    NotOwner {
        /// The shard.
        shard: ShardId,
        /// The responder's assignment epoch (if higher than the sender's, the
        /// sender's view is out of date).
        epoch: Epoch,
        /// Who the responder believes owns it.
        hint: Option<PeerId>,
    },
    /// Variant 3: the requested version does not exist yet.
    NotReady {
        /// The shard.
        shard: ShardId,
        /// Newest version the responder holds.
        current_version: Version,
    },
    /// Variant 4: a write from an older epoch or incarnation was refused.
    Fenced {
        /// The shard.
        shard: ShardId,
        /// The responder's epoch.
        epoch: Epoch,
    },
    /// Variant 5: shard parameters.
    ShardState(ShardState),
    /// Variant 6: a handoff was stored.
    HandoffAck {
        /// The shard.
        shard: ShardId,
        /// Version stored.
        version: Version,
    },
    /// Variant 7: the responder's manifest.
    Manifest(Manifest),
    /// Variant 8: an error.
    Error(WireError),
    /// Variant 9: a `PushPull` was accepted.
    Exchanged(Exchanged),
    /// Variant 10: the answer to a `Probe`.
    Probed {
        /// Padding bytes the responder received.
        bytes: u64,
    },
    /// Variant 11: the answers to a `PushPullMany`, one per
    /// `PushPull` and in its order, each what that `PushPull` alone would
    /// have got (never another `ExchangedMany`).
    ExchangedMany(#[serde(deserialize_with = "nesting::nested")] Vec<ShardResponse>),
    /// Variant 12: the answer to a `ShardRequest::Timed`.
    Timed {
        /// How long the responder took to serve the request, in µs: from
        /// taking it off the connection to having the answer ready to
        /// send, less any time it held a pull's answer for the round
        /// (`Exchanged::held_ms`, the slowest worker's time, not its own).
        /// Its queues, its CPU and its configured serving delays count;
        /// the requester's own waits and the network do not.
        service_us: u32,
        /// The request's own answer (never another `Timed`).
        #[serde(deserialize_with = "nesting::nested")]
        answer: Box<ShardResponse>,
    },
}

impl ShardResponse {
    /// Bytes of shard state an `Exchanged` answer carries (0 for any other
    /// answer): what link emulation and the byte counters charge.
    pub fn state_bytes(&self) -> u64 {
        match self {
            ShardResponse::Exchanged(x) => x.state_bytes(),
            ShardResponse::Timed { answer, .. } => answer.state_bytes(),
            _ => 0,
        }
    }

    /// Short name for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            ShardResponse::Accepted(_) => "accepted",
            ShardResponse::Stale { .. } => "stale",
            ShardResponse::NotOwner { .. } => "not_owner",
            ShardResponse::NotReady { .. } => "not_ready",
            ShardResponse::Fenced { .. } => "fenced",
            ShardResponse::ShardState(_) => "shard_state",
            ShardResponse::HandoffAck { .. } => "handoff_ack",
            ShardResponse::Manifest(_) => "manifest",
            ShardResponse::Error(_) => "error",
            ShardResponse::Exchanged(_) => "exchanged",
            ShardResponse::Probed { .. } => "probed",
            ShardResponse::ExchangedMany(_) => "exchanged_many",
            ShardResponse::Timed { .. } => "timed",
        }
    }

    /// Builds an error response from a validation failure.
    pub fn error(e: &ProtocolError) -> ShardResponse {
        ShardResponse::Error(WireError::from(e))
    }
}

// ---------------------------------------------------------------------------
// Gossip (topic /shoal/<run-id>/membership)
// ---------------------------------------------------------------------------

/// Compute device class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Device {
    /// CPU.
    Cpu,
    /// NVIDIA CUDA.
    Cuda,
    /// Apple Metal.
    Metal,
    /// Anything else.
    Other,
}

/// What a node can do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Capabilities {
    /// Device used for training.
    pub device: Device,
    /// Memory available to Shoal, bytes.
    pub memory_bytes: u64,
    /// Measured training throughput, samples/s.
    pub compute_samples_per_sec: f32,
    /// Measured network throughput, bytes/s.
    pub net_bytes_per_sec: f32,
    /// Whether the node may be elected aggregator.
    pub can_aggregate: bool,
}

/// A node's current role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Role {
    /// Trains and pushes gradients.
    Worker,
    /// Trains and owns shards.
    Aggregator,
    /// Syncing state before contributing.
    Joining,
    /// Handing off before leaving.
    Leaving,
}

/// A worker's measurement of one shard owner's service time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServiceObservation {
    /// The owner measured.
    pub owner: PeerId,
    /// Median of recent push + pull service time, microseconds per MiB.
    pub micros_per_mib: f32,
    /// Measurements behind the median.
    pub samples: u32,
}

/// The version of each shard a worker holds, as each shard's exchange
/// ended: what its owner answered. Shard `i` is at `base + leads[i]`: one
/// byte a shard, since a worker's shards are rarely more than a round or
/// two apart. A shard further ahead than 255 versions is sent as
/// `base + 255`: the claim is that the worker holds at least that.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardVersions {
    /// The oldest version the worker holds of any shard.
    pub base: Version,
    /// Per shard, how far its version is past `base`; empty, or one entry
    /// per shard of the run.
    pub leads: Vec<u8>,
}

impl ShardVersions {
    /// `versions[i]`: shard `i`'s. Empty past [`MAX_OWNED_SHARDS`] shards
    /// (a heartbeat stays under its size limit).
    pub fn of(versions: &[Version]) -> Self {
        if versions.len() > MAX_OWNED_SHARDS {
            return Self::default();
        }
        let base = versions.iter().copied().min().unwrap_or(0);
        let leads = versions.iter().map(|v| (v - base).min(u64::from(u8::MAX)) as u8).collect();
        Self { base, leads }
    }

    /// Shard `shard`'s version, if sent.
    pub fn get(&self, shard: ShardId) -> Option<Version> {
        self.leads.get(shard as usize).map(|&l| self.base.saturating_add(u64::from(l)))
    }
}

/// A node's recent pace, gossiped so that every node can judge whether
/// aggregation dominates step time (the exploration of the number of
/// aggregators, see the node crate's `explore` module).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pace {
    /// Recent wall time of one training step (moving average), µs; 0 before the first step.
    pub step_micros: u32,
    /// The part of it spent exchanging shards with their owners (push, wait, pull), µs.
    pub comm_micros: u32,
    /// Number of aggregators the sender proposes; 0: every capable node.
    pub aggregators: u16,
    /// The sender's capacity level as a shard owner in its own latest
    /// placement: its rendezvous weight is 2^level, -2..=2; 0 when it owns
    /// nothing. Elections keep it until the measurements leave its band
    /// (hysteresis from gossiped state, as for stragglers).
    pub capacity_level: i8,
    /// The share of its step's own batch the sender trained on in its last
    /// step, in thousandths (`sync.fit_batch`): 1000 all
    /// of it, below 1000 a slow worker's fitted batch, above 1000 a worker
    /// that takes on the samples the fitted ones shed; 0 before its first
    /// step. At most [`MAX_BATCH_PERMILLE`].
    pub batch_permille: u16,
}

/// Most a worker's batch may grow, in thousandths of its own (twice it).
pub const MAX_BATCH_PERMILLE: u16 = 2000;

/// Most checkpoint offers a heartbeat may carry.
pub const MAX_CHECKPOINT_OFFERS: usize = 8;

/// Most suspects a heartbeat may name.
pub const MAX_SUSPECTS: usize = 16;
/// Most bytes of one offer's shard bitset (256 shards).
pub const MAX_OFFER_BITSET_BYTES: usize = 32;

/// Shard checkpoints the sender holds on disk at one version, offered for
/// resuming a run after a full stop. Nodes that form a
/// roster agree on the resume point from their members' offers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointOffer {
    /// The shards' version.
    pub version: u64,
    /// The training step all workers had reached when the oldest of these
    /// checkpoints was written (equal to `version` under BSP).
    pub step: u64,
    /// Bit `i` (byte `i / 8`, bit `i % 8`) set: shard `i` is held at
    /// `version`. At most [`MAX_OFFER_BITSET_BYTES`] bytes.
    pub shards: Vec<u8>,
}

impl CheckpointOffer {
    /// The shards held, in order.
    pub fn shard_ids(&self) -> Vec<u32> {
        (0..self.shards.len() * 8).filter(|&i| self.shards[i / 8] & (1 << (i % 8)) != 0).map(|i| i as u32).collect()
    }

    /// An offer of `shards` at `version`; shards past the bitset's reach
    /// (256) are left out.
    pub fn new(version: u64, step: u64, shards: impl IntoIterator<Item = u32>) -> Self {
        let mut bits = Vec::new();
        for s in shards.into_iter().map(|s| s as usize).filter(|&s| s < MAX_OFFER_BITSET_BYTES * 8) {
            if bits.len() <= s / 8 {
                bits.resize(s / 8 + 1, 0);
            }
            bits[s / 8] |= 1 << (s % 8);
        }
        Self { version, step, shards: bits }
    }
}

/// Periodic membership heartbeat; encodes to at most 8 KiB.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// Run id.
    pub run: RunId,
    /// Sender; must equal the gossip message's signer (frame::decode_gossip).
    pub peer: PeerId,
    /// Changes each time the process starts (e.g. start time in ms), so a
    /// restarted node is told apart from its previous life.
    pub incarnation: u64,
    /// Increases with each heartbeat of one incarnation (also makes each
    /// heartbeat's content hash, hence message id, unique).
    pub seq: u64,
    /// Assignment epoch the sender currently uses.
    pub epoch: Epoch,
    /// Hash of the model config and layout.
    pub config_hash: u64,
    /// The wire version the sender speaks ([`WIRE_VERSION`]). The gossip
    /// topic already keeps peers of other versions apart; a node also
    /// refuses a heartbeat whose version is not its own. (The name is older
    /// than the one-version rule.)
    pub protocol_version: u16,
    /// Capabilities.
    pub capabilities: Capabilities,
    /// Current role.
    pub role: Role,
    /// Shards the sender owns, at most 256.
    pub owned_shards: Vec<ShardId>,
    /// Training step.
    pub step: u64,
    /// Model version the sender trains on.
    pub model_version: Version,
    /// The version of each shard the sender's worker holds (empty before
    /// its first exchange, when it does not train, or past
    /// [`MAX_OWNED_SHARDS`] shards). An owner restored from an older copy
    /// takes up the newest version a live worker holds (the loss bound in
    /// `docs/architecture.md`).
    pub shard_versions: ShardVersions,
    /// Service times of owners the sender pushes to, at most 32.
    pub service: Vec<ServiceObservation>,
    /// The sender's pace and its proposed number of aggregators.
    pub pace: Pace,
    /// Shard checkpoints on the sender's disk, at most
    /// [`MAX_CHECKPOINT_OFFERS`] versions.
    pub checkpoints: Vec<CheckpointOffer>,
    /// Workers whose gradients the sender, as a shard owner, rejected
    /// round after round, at most [`MAX_SUSPECTS`]. A
    /// claim of the sender's, reported in every node's view; nothing acts
    /// on it.
    pub suspects: Vec<PeerId>,
    /// The sender has finished training and has seen every live peer
    /// finish too: the run is over for it, and it stops once every live
    /// peer says the same (the second half of the end-of-run handshake,
    /// see `docs/protocol.md`, §6.3). A node that stopped at
    /// the first half could stop before its last step's heartbeat reached
    /// a peer, which then waited out the failure timeout for it and moved
    /// its shards.
    pub finished: bool,
}

/// Small events worth telling everyone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Announcement {
    /// A shard reached a new version.
    ShardVersion {
        /// Run id.
        run: RunId,
        /// The shard.
        shard: ShardId,
        /// New version.
        version: Version,
        /// Epoch of the owner.
        epoch: Epoch,
        /// Owner (the sender).
        owner: PeerId,
    },
    /// The sender is leaving cleanly (after handing off).
    Leaving {
        /// Run id.
        run: RunId,
        /// The sender.
        peer: PeerId,
        /// Its incarnation.
        incarnation: u64,
    },
    /// A checkpoint was written.
    Checkpoint {
        /// Run id.
        run: RunId,
        /// Step.
        step: u64,
        /// Model version.
        version: Version,
        /// xxh3-64 of the checkpoint's parameter bytes.
        params_hash: u64,
    },
}

impl Announcement {
    /// Run id.
    pub fn run(&self) -> &RunId {
        match self {
            Announcement::ShardVersion { run, .. }
            | Announcement::Leaving { run, .. }
            | Announcement::Checkpoint { run, .. } => run,
        }
    }
}

/// Everything published on the membership topic.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum GossipMessage {
    /// Variant 0.
    Heartbeat(Heartbeat),
    /// Variant 1.
    Announce(Announcement),
}

impl GossipMessage {
    /// Run id.
    pub fn run(&self) -> &RunId {
        match self {
            GossipMessage::Heartbeat(h) => &h.run,
            GossipMessage::Announce(a) => a.run(),
        }
    }
}

// ---------------------------------------------------------------------------
// Tensor enumeration: the codec carries tensor bodies outside postcard, in
// the order these functions list them.
// ---------------------------------------------------------------------------

/// A message whose tensors travel in the frame body.
pub trait HasPayloads {
    /// Tensors in wire order.
    fn payloads(&self) -> Vec<&Payload>;
    /// Tensors in wire order, mutable (to attach received bodies).
    fn payloads_mut(&mut self) -> Vec<&mut Payload>;
}

impl HasPayloads for ShardRequest {
    fn payloads(&self) -> Vec<&Payload> {
        match self {
            ShardRequest::PushGrad(m) => vec![&m.grad],
            ShardRequest::PushPull(m) => vec![&m.push.grad],
            ShardRequest::PushPullMany(v) => v.iter().map(|m| &m.push.grad).collect(),
            ShardRequest::Probe(m) => vec![&m.padding],
            ShardRequest::Timed(r) => r.payloads(),
            ShardRequest::Handoff(m) => {
                let mut v = vec![&m.params];
                v.extend(m.optimizer.slots.iter().map(|s| &s.tensor));
                v
            }
            ShardRequest::PullShard(_)
            | ShardRequest::StateSync(_)
            | ShardRequest::Manifest(_)
            | ShardRequest::Undecodable { .. } => Vec::new(),
        }
    }

    fn payloads_mut(&mut self) -> Vec<&mut Payload> {
        match self {
            ShardRequest::PushGrad(m) => vec![&mut m.grad],
            ShardRequest::PushPull(m) => vec![&mut m.push.grad],
            ShardRequest::PushPullMany(v) => v.iter_mut().map(|m| &mut m.push.grad).collect(),
            ShardRequest::Probe(m) => vec![&mut m.padding],
            ShardRequest::Timed(r) => r.payloads_mut(),
            ShardRequest::Handoff(m) => {
                let mut v = vec![&mut m.params];
                v.extend(m.optimizer.slots.iter_mut().map(|s| &mut s.tensor));
                v
            }
            ShardRequest::PullShard(_)
            | ShardRequest::StateSync(_)
            | ShardRequest::Manifest(_)
            | ShardRequest::Undecodable { .. } => Vec::new(),
        }
    }
}

impl HasPayloads for ShardResponse {
    fn payloads(&self) -> Vec<&Payload> {
        match self {
            ShardResponse::ShardState(s) => vec![&s.params],
            ShardResponse::Exchanged(Exchanged { state: Some(s), .. }) => vec![&s.params],
            ShardResponse::ExchangedMany(v) => v.iter().flat_map(|r| r.payloads()).collect(),
            ShardResponse::Timed { answer, .. } => answer.payloads(),
            _ => Vec::new(),
        }
    }

    fn payloads_mut(&mut self) -> Vec<&mut Payload> {
        match self {
            ShardResponse::ShardState(s) => vec![&mut s.params],
            ShardResponse::Exchanged(Exchanged { state: Some(s), .. }) => vec![&mut s.params],
            ShardResponse::ExchangedMany(v) => v.iter_mut().flat_map(|r| r.payloads_mut()).collect(),
            ShardResponse::Timed { answer, .. } => answer.payloads_mut(),
            _ => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_versions_round_trip_and_report_at_least_what_is_held() {
        let v = ShardVersions::of(&[7, 9, 7, 8]);
        assert_eq!((v.base, v.leads.as_slice()), (7, &[0u8, 2, 0, 1][..]));
        assert_eq!((0..5).map(|s| v.get(s)).collect::<Vec<_>>(), vec![Some(7), Some(9), Some(7), Some(8), None]);
        // Further ahead than a byte: the claim is at least base + 255.
        let far = ShardVersions::of(&[10, 10_000]);
        assert_eq!((far.get(0), far.get(1)), (Some(10), Some(265)));
        assert!(ShardVersions::of(&[]).leads.is_empty());
        assert!(ShardVersions::of(&vec![1; MAX_OWNED_SHARDS + 1]).leads.is_empty(), "past the cap: not sent");
        assert_eq!(ShardVersions::of(&vec![1; MAX_OWNED_SHARDS]).leads.len(), MAX_OWNED_SHARDS);
    }
}
