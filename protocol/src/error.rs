//! The crate's one error type.

use std::time::Duration;

use libp2p::PeerId;

use crate::error_code::ErrorCode;

/// Everything that can go wrong on Shoal's wire.
///
/// Errors caused by a peer's input (sizes, checksums, shapes, run ids...) are
/// typed so the node can answer with the matching [`ErrorCode`] (see
/// [`ProtocolError::code`]) and count misbehaviour per peer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// A frame announces more bytes than the configured limit allows.
    #[error("{what} of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// Which size was too large ("request frame", "message header"...).
        what: &'static str,
        /// The announced size.
        len: u64,
        /// The configured limit.
        max: u64,
    },
    /// The first bytes of a frame are not Shoal's magic.
    #[error("bad frame magic {found:02x?}; expected {expected:02x?}")]
    BadMagic {
        /// The bytes found.
        found: [u8; 2],
        /// The magic expected for this kind of frame.
        expected: [u8; 2],
    },
    /// The peer speaks another wire version. There is one version at a
    /// time: a peer of another one, older or newer, is refused.
    #[error("the peer speaks wire version {theirs}, this node speaks version {ours}: peers must speak the same one")]
    VersionMismatch {
        /// The version this build speaks ([`crate::wire::WIRE_VERSION`]).
        ours: u16,
        /// The version the peer sent or announced.
        theirs: u16,
    },
    /// A request arrived where a response was expected, or vice versa, or a
    /// reserved byte was not zero.
    #[error("malformed frame prefix: {0}")]
    BadPrefix(&'static str),
    /// The message header is not valid postcard for the expected type.
    #[error("message header does not decode: {0}")]
    Decode(String),
    /// A message could not be encoded (for example a string that is too long).
    #[error("message does not encode: {0}")]
    Encode(String),
    /// The tensors' declared byte lengths do not add up to the frame body.
    #[error("tensors declare {declared} body bytes but the frame carries {body}")]
    BodyMismatch {
        /// Sum of `byte_len` over the message's tensors.
        declared: u64,
        /// Body bytes in the frame.
        body: u64,
    },
    /// The dtype tag is not one this build knows.
    #[error("unknown dtype tag {0}")]
    UnknownDtype(u8),
    /// The product of the shape does not equal the element count.
    #[error("shape {shape:?} does not describe {numel} elements")]
    ShapeMismatch {
        /// The declared shape.
        shape: Vec<u64>,
        /// The declared element count.
        numel: u64,
    },
    /// The tensor body has the wrong length for its header.
    #[error("tensor body is {actual} bytes but its header implies {expected}")]
    SizeMismatch {
        /// Bytes implied by dtype, element count and block size.
        expected: u64,
        /// Bytes actually present.
        actual: u64,
    },
    /// The tensor body does not hash to the checksum in its header.
    #[error("checksum mismatch: header says {expected:#018x}, body hashes to {actual:#018x}")]
    ChecksumMismatch {
        /// Checksum carried in the header.
        expected: u64,
        /// Checksum of the received bytes.
        actual: u64,
    },
    /// A NaN or an infinity in a tensor or a measurement.
    #[error("non-finite value {value} at element {index}")]
    NonFinite {
        /// Element index (or field index for measurements).
        index: u64,
        /// The offending value.
        value: f32,
    },
    /// A finite f32 that the target encoding cannot represent (f16 overflow).
    #[error("value {value} at element {index} is out of range for {dtype}")]
    OutOfRange {
        /// Element index.
        index: u64,
        /// The value.
        value: f32,
        /// Encoding name.
        dtype: &'static str,
    },
    /// A tensor header that is internally inconsistent (block size, sparse
    /// indices, rank...).
    #[error("invalid tensor: {0}")]
    InvalidTensor(String),
    /// The message belongs to another run.
    #[error("run id mismatch: this node runs {expected:?}, the message is for {found:?}")]
    RunMismatch {
        /// Our run id.
        expected: String,
        /// The run id in the message.
        found: String,
    },
    /// A run id that is empty, too long or uses characters outside `[A-Za-z0-9._-]`.
    #[error("invalid run id {0:?}: use 1 to 64 characters from [A-Za-z0-9._-]")]
    InvalidRunId(String),
    /// A shard id outside `0..num_shards`.
    #[error("shard {shard} out of range: the run has {num_shards} shards")]
    ShardOutOfRange {
        /// The shard id in the message.
        shard: u32,
        /// Shards in the run.
        num_shards: u32,
    },
    /// A field that claims to be the sender is not the authenticated peer.
    #[error("message claims to come from {claimed} but the connection is authenticated as {actual}")]
    SenderMismatch {
        /// Peer id written in the message (boxed: keeps the error small).
        claimed: Box<PeerId>,
        /// Peer id authenticated by the transport.
        actual: Box<PeerId>,
    },
    /// A gossip message whose signature is not valid for the key it names
    /// (a forged or corrupted message).
    #[error("gossip message signed by {signer}: the signature does not match the message")]
    BadSignature {
        /// The peer whose key the message names (boxed: keeps the error small).
        signer: Box<PeerId>,
    },
    /// A field with an invalid value (count over a limit, empty, negative...).
    #[error("invalid field {field}: {reason}")]
    InvalidField {
        /// Field name.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A request the codec could read but not understand; see
    /// [`crate::messages::ShardRequest::Undecodable`].
    #[error("undecodable request: {reason}")]
    Undecodable {
        /// The code to answer with.
        code: ErrorCode,
        /// Why.
        reason: String,
    },
    /// Gossip could not be published because no peer subscribes to the
    /// topic yet (normal right after start-up; retry on the next tick).
    #[error("no peer subscribes to the gossip topic yet")]
    NoGossipPeers,
    /// Gossip could not be published for another reason.
    #[error("gossip publish failed: {0}")]
    Publish(String),
    /// Too many bytes are being read from peers at once.
    #[error("read budget exhausted: {wanted} bytes wanted, {in_flight} of {max} already in flight")]
    Busy {
        /// Bytes this frame needs.
        wanted: u64,
        /// Bytes reserved by frames being read.
        in_flight: u64,
        /// The budget.
        max: u64,
    },
    /// Invalid configuration (rejected before anything is started).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// Building a transport or behaviour failed.
    #[error("transport setup failed: {0}")]
    Transport(String),
    /// A read or write did not finish within its size-scaled deadline.
    #[error("{what} did not finish within {after:?}")]
    Timeout {
        /// The operation.
        what: &'static str,
        /// The deadline that passed.
        after: Duration,
    },
    /// I/O error from the stream or the OS.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl ProtocolError {
    /// A short, stable name for the kind of error (the variant), for counting
    /// rejections by kind in logs, metrics and the fuzz report.
    pub fn kind(&self) -> &'static str {
        match self {
            ProtocolError::TooLarge { .. } => "too_large",
            ProtocolError::BadMagic { .. } => "bad_magic",
            ProtocolError::VersionMismatch { .. } => "version_mismatch",
            ProtocolError::BadPrefix(_) => "bad_prefix",
            ProtocolError::Decode(_) => "decode",
            ProtocolError::Encode(_) => "encode",
            ProtocolError::BodyMismatch { .. } => "body_mismatch",
            ProtocolError::UnknownDtype(_) => "unknown_dtype",
            ProtocolError::ShapeMismatch { .. } => "shape_mismatch",
            ProtocolError::SizeMismatch { .. } => "size_mismatch",
            ProtocolError::ChecksumMismatch { .. } => "checksum_mismatch",
            ProtocolError::NonFinite { .. } => "non_finite",
            ProtocolError::OutOfRange { .. } => "out_of_range",
            ProtocolError::InvalidTensor(_) => "invalid_tensor",
            ProtocolError::RunMismatch { .. } => "run_mismatch",
            ProtocolError::InvalidRunId(_) => "invalid_run_id",
            ProtocolError::ShardOutOfRange { .. } => "shard_out_of_range",
            ProtocolError::SenderMismatch { .. } => "sender_mismatch",
            ProtocolError::BadSignature { .. } => "bad_signature",
            ProtocolError::InvalidField { .. } => "invalid_field",
            ProtocolError::Undecodable { .. } => "undecodable",
            ProtocolError::NoGossipPeers => "no_gossip_peers",
            ProtocolError::Publish(_) => "publish",
            ProtocolError::Busy { .. } => "busy",
            ProtocolError::Config(_) => "config",
            ProtocolError::Transport(_) => "transport",
            ProtocolError::Timeout { .. } => "timeout",
            ProtocolError::Io(_) => "io",
        }
    }

    /// The wire error code a node should answer with when this error was
    /// caused by a request.
    pub fn code(&self) -> ErrorCode {
        match self {
            ProtocolError::TooLarge { .. } => ErrorCode::TooLarge,
            ProtocolError::VersionMismatch { .. } => ErrorCode::UnsupportedVersion,
            ProtocolError::RunMismatch { .. } => ErrorCode::RunMismatch,
            ProtocolError::ShardOutOfRange { .. } => ErrorCode::ShardOutOfRange,
            ProtocolError::ChecksumMismatch { .. } => ErrorCode::ChecksumMismatch,
            ProtocolError::NonFinite { .. } => ErrorCode::NonFinite,
            ProtocolError::UnknownDtype(_) => ErrorCode::UnsupportedEncoding,
            ProtocolError::Undecodable { code, .. } => *code,
            ProtocolError::Busy { .. } => ErrorCode::Busy,
            ProtocolError::Timeout { .. } | ProtocolError::Io(_) => ErrorCode::Internal,
            ProtocolError::Config(_)
            | ProtocolError::Transport(_)
            | ProtocolError::NoGossipPeers
            | ProtocolError::Publish(_) => ErrorCode::Internal,
            _ => ErrorCode::InvalidRequest,
        }
    }
}

impl From<ProtocolError> for std::io::Error {
    fn from(e: ProtocolError) -> Self {
        match e {
            ProtocolError::Io(io) => io,
            ProtocolError::Timeout { .. } => std::io::Error::new(std::io::ErrorKind::TimedOut, e),
            other => std::io::Error::new(std::io::ErrorKind::InvalidData, other),
        }
    }
}

impl From<postcard::Error> for ProtocolError {
    fn from(e: postcard::Error) -> Self {
        ProtocolError::Decode(e.to_string())
    }
}

/// Shorthand used throughout the crate.
pub type Result<T, E = ProtocolError> = std::result::Result<T, E>;
