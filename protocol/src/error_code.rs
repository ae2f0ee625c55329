//! The machine-readable code of an error answer. A leaf: both the crate's
//! error type (which maps each error to its code) and the messages (whose
//! `WireError` carries one) use it, so it imports neither.

use serde::{Deserialize, Serialize};

/// Machine-readable error codes. An index past the last code decodes as
/// [`ErrorCode::Unknown`]: the answer is still read as an error, whatever
/// the code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ErrorCode {
    /// The request was malformed or failed validation.
    InvalidRequest,
    /// The peer speaks another wire version.
    UnsupportedVersion,
    /// The request is for another run.
    RunMismatch,
    /// Model config hash differs.
    ConfigMismatch,
    /// Shard id out of range.
    ShardOutOfRange,
    /// A payload's checksum did not match.
    ChecksumMismatch,
    /// A payload contained NaN or infinity.
    NonFinite,
    /// The requested or received encoding is not supported.
    UnsupportedEncoding,
    /// A size limit was exceeded.
    TooLarge,
    /// The node is overloaded; retry later.
    Busy,
    /// Anything else on the responder's side.
    Internal,
    /// An index this build does not know.
    #[serde(other)]
    Unknown,
}
