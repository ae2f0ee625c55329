//! Shoal's wire protocol: everything that crosses the network.
//!
//! - [`messages`]: versioned request, response and gossip types.
//! - [`payload`]: tensor payloads (f32, f16, bf16, int8 blocks, top-k) with
//!   checksums and accuracy contracts.
//! - [`frame`] and [`codec`]: the byte layout of `/shoal/shard/12.0.0` frames
//!   and the request-response codec with size limits and size-scaled
//!   deadlines.
//! - [`wire`]: the one wire version, the protocol names that carry it, and
//!   the frame prefix layout. A peer of another version is refused.
//! - [`validate`]: checks a receiver runs on anything a peer sends.
//! - [`behaviour`]: the composed libp2p `NetworkBehaviour` and
//!   [`build_swarm`].
//! - [`config`]: limits, timeouts, discovery and admission settings.
//! - [`bench`]: the wire benchmark behind `shoal bench wire`.
//!
//! There are no actors here: the node's network actor owns the swarm.
//! The byte-level specification is `docs/protocol.md`.

pub mod behaviour;
pub mod bench;
pub mod codec;
pub mod config;
pub mod error;
pub mod error_code;
pub mod frame;
pub mod messages;
pub mod payload;
pub mod sparse;
pub mod validate;
pub mod wire;

pub use behaviour::{
    build_swarm, build_swarm_with, check_peer_version, membership_topic, ShoalBehaviour, ShoalBehaviourEvent,
};
pub use codec::{ShardCodec, SHARD_PROTOCOL};
pub use config::{Admission, Discovery, Gossip, Limits, ProtocolConfig, Timeouts};
pub use error::ProtocolError;
pub use messages::*;
pub use payload::{Dtype, Encoding, FactorBlock, Payload, TensorMeta, Verified};
pub use validate::{
    validate_gossip, validate_heartbeat, validate_request, validate_request_fields, validate_response,
    validate_response_fields, ValidationContext,
};

/// Re-export so the node uses exactly our libp2p.
pub use libp2p;
/// A node's identity on the wire, for code that needs only the id (the
/// node's pure policy) and none of libp2p.
pub use libp2p::PeerId;
