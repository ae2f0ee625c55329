//! The wire's fixed numbers: its one version, the protocol names that
//! carry it, and the layout of the frame prefixes. A leaf module: the
//! framing, the codec, the config checks and the behaviour all read these,
//! and it imports nothing of the crate.
//!
//! There is one version of the wire at a time, and peers must speak the
//! same one: nothing here lets two versions interoperate. The version is
//! part of every name a peer negotiates (the shard and Kademlia protocol
//! ids, identify's protocol version, the gossip topic), so multistream-select
//! refuses a peer of another version before any frame is sent; the frame
//! and gossip prefixes carry it too, and a prefix of another version is
//! refused.

/// The wire version as a literal, so that the names below spell it with
/// `concat!` and cannot drift from [`WIRE_VERSION`].
macro_rules! wire_version {
    () => {
        13
    };
}

/// The version of the wire this build speaks (13 since `Handoff::catch_up_room`; 12 since `Heartbeat::shard_versions`; 11 since gossip is signed by Shoal, after the message, not by gossipsub; 10: delta pulls: `PullShard::have`, `PushPull::have`, `ShardState::delta`; 9: the `Sparse2` encoding; 8: `Heartbeat::finished`; 7: builds before the
/// one-version rule put 1 in their protocol names and 1 to 6 in their
/// frames, so no earlier build can be taken for this one): in every frame and gossip
/// prefix, in `Heartbeat::protocol_version`, and in the protocol names below.
/// Any change to the bytes on the wire moves it, and a peer of another
/// version is refused.
pub const WIRE_VERSION: u16 = wire_version!();

/// Protocol id of the shard request-response protocol.
pub const SHARD_PROTOCOL_NAME: &str = concat!("/shoal/shard/", wire_version!(), ".0.0");
/// Kademlia protocol id: our own, so Shoal nodes never join the public IPFS
/// DHT, nor a DHT of Shoal peers of another version.
pub const KAD_PROTOCOL_NAME: &str = concat!("/shoal/kad/", wire_version!(), ".0.0");
/// The protocol version this node reports through identify.
pub const IDENTIFY_PROTOCOL_VERSION: &str = concat!("/shoal/", wire_version!(), ".0.0");

/// The wire version in a protocol version string that identify reports
/// (`/shoal/<version>.0.0`), or `None` when it is not Shoal's.
pub fn identify_wire_version(protocol_version: &str) -> Option<u16> {
    protocol_version.strip_prefix("/shoal/")?.strip_suffix(".0.0")?.parse().ok()
}

/// Bytes in the fixed prefix of a request or response frame.
pub const PREFIX_LEN: usize = 20;
/// Magic of request-response frames.
pub const SHARD_MAGIC: [u8; 2] = *b"SH";
/// Magic of gossip messages.
pub const GOSSIP_MAGIC: [u8; 2] = *b"SG";
/// Bytes before the postcard body of a gossip message.
pub const GOSSIP_PREFIX_LEN: usize = 4;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_carries_the_wire_version() {
        let v = WIRE_VERSION;
        assert_eq!(SHARD_PROTOCOL_NAME, format!("/shoal/shard/{v}.0.0"));
        assert_eq!(KAD_PROTOCOL_NAME, format!("/shoal/kad/{v}.0.0"));
        assert_eq!(IDENTIFY_PROTOCOL_VERSION, format!("/shoal/{v}.0.0"));
        assert_eq!(identify_wire_version(IDENTIFY_PROTOCOL_VERSION), Some(v));
        assert_eq!(identify_wire_version("/shoal/7.0.0"), Some(7));
        for other in ["/ipfs/0.1.0", "/shoal/", "/shoal/x.0.0", "/shoal/1.2.0", "/shoal/70000.0.0", ""] {
            assert_eq!(identify_wire_version(other), None, "{other:?}");
        }
    }
}
