//! Frame layout, with no I/O (the async codec in `codec` and the fuzz
//! targets both use these functions).
//!
//! A frame on `/shoal/shard/12.0.0` is a fixed 20-byte prefix, a postcard
//! message header, and the tensor bodies:
//!
//! ```text
//! offset size field
//!  0     2    magic        b"SH"
//!  2     2    version      u16 LE, the sender's wire version: must be ours (`WIRE_VERSION`)
//!  4     1    kind         1 = request, 2 = response
//!  5     3    reserved     must be zero
//!  8     4    header_len   u32 LE, bytes of postcard header
//! 12     8    body_len     u64 LE, bytes of tensor bodies
//! 20     header_len        postcard(ShardRequest | ShardResponse)
//! ..     body_len          tensor bodies, concatenated in HasPayloads order
//! ```
//!
//! Gossip messages are `b"SG"`, version u16 LE, postcard(GossipMessage),
//! then the signer's ed25519 public key (32 bytes) and its signature
//! (64 bytes) over `b"shoal-gossip:"` and every byte before the key.
//!
//! A prefix of another version is refused before anything after it is read:
//! multistream-select has already refused a peer of another version (the
//! version is in the protocol names), so this is defence in depth.

use std::fmt;

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;

use libp2p::identity::{ed25519, Keypair, PublicKey};
use libp2p::PeerId;

use crate::config::Limits;
use crate::error::{ProtocolError, Result};
use crate::messages::{GossipMessage, HasPayloads, ShardRequest, ShardResponse, WIRE_VERSION};
pub use crate::wire::{GOSSIP_MAGIC, GOSSIP_PREFIX_LEN, PREFIX_LEN, SHARD_MAGIC};

/// Direction of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// Request frame.
    Request = 1,
    /// Response frame.
    Response = 2,
}

/// The fixed 20-byte prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FramePrefix {
    /// Wire version of the sender; [`FramePrefix::parse`] refuses any but
    /// [`WIRE_VERSION`].
    pub version: u16,
    /// Request or response.
    pub kind: FrameKind,
    /// Postcard header length.
    pub header_len: u32,
    /// Total tensor body length.
    pub body_len: u64,
}

impl FramePrefix {
    /// Serializes the prefix.
    pub fn to_bytes(&self) -> [u8; PREFIX_LEN] {
        let mut b = [0u8; PREFIX_LEN];
        b[0..2].copy_from_slice(&SHARD_MAGIC);
        b[2..4].copy_from_slice(&self.version.to_le_bytes());
        b[4] = self.kind as u8;
        b[8..12].copy_from_slice(&self.header_len.to_le_bytes());
        b[12..20].copy_from_slice(&self.body_len.to_le_bytes());
        b
    }

    /// Parses a prefix, checking magic, version, kind and reserved bytes.
    pub fn parse(b: &[u8; PREFIX_LEN]) -> Result<FramePrefix> {
        if b[0..2] != SHARD_MAGIC {
            return Err(ProtocolError::BadMagic { found: [b[0], b[1]], expected: SHARD_MAGIC });
        }
        let version = u16::from_le_bytes([b[2], b[3]]);
        check_version(version)?;
        let kind = match b[4] {
            1 => FrameKind::Request,
            2 => FrameKind::Response,
            _ => return Err(ProtocolError::BadPrefix("kind must be 1 (request) or 2 (response)")),
        };
        if b[5..8] != [0, 0, 0] {
            return Err(ProtocolError::BadPrefix("reserved bytes must be zero"));
        }
        let header_len = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
        let body_len = u64::from_le_bytes([b[12], b[13], b[14], b[15], b[16], b[17], b[18], b[19]]);
        Ok(FramePrefix { version, kind, header_len, body_len })
    }

    /// Total frame length, saturating.
    pub fn total_len(&self) -> u64 {
        (PREFIX_LEN as u64).saturating_add(u64::from(self.header_len)).saturating_add(self.body_len)
    }

    /// Checks kind and sizes. Runs before anything is allocated.
    pub fn check(&self, kind: FrameKind, max_frame: u64, max_header: u32) -> Result<()> {
        if self.kind != kind {
            return Err(ProtocolError::BadPrefix(match kind {
                FrameKind::Request => "expected a request frame",
                FrameKind::Response => "expected a response frame",
            }));
        }
        if self.header_len > max_header {
            return Err(ProtocolError::TooLarge {
                what: "message header",
                len: u64::from(self.header_len),
                max: u64::from(max_header),
            });
        }
        if self.total_len() > max_frame {
            return Err(ProtocolError::TooLarge { what: "frame", len: self.total_len(), max: max_frame });
        }
        Ok(())
    }
}

/// An encoded frame: prefix + header in one buffer, then the tensor bodies
/// (shared, not copied, with the payloads they came from).
#[derive(Debug, Clone)]
pub struct EncodedFrame {
    /// Prefix and postcard header.
    pub head: Vec<u8>,
    /// Tensor bodies in order.
    pub bodies: Vec<Bytes>,
}

impl EncodedFrame {
    /// Total length in bytes.
    pub fn len(&self) -> u64 {
        self.head.len() as u64 + self.bodies.iter().map(|b| b.len() as u64).sum::<u64>()
    }

    /// Always false: a frame has at least its prefix.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The frame as one contiguous buffer (tests, fuzzing).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.len() as usize);
        v.extend_from_slice(&self.head);
        for b in &self.bodies {
            v.extend_from_slice(b);
        }
        v
    }
}

/// Refuses a frame or gossip message of any wire version but ours.
fn check_version(theirs: u16) -> Result<()> {
    if theirs != WIRE_VERSION {
        return Err(ProtocolError::VersionMismatch { ours: WIRE_VERSION, theirs });
    }
    Ok(())
}

/// Encodes a message into a frame, refusing frames over `max_frame`.
pub fn encode_message<M: Serialize + HasPayloads>(
    msg: &M,
    kind: FrameKind,
    max_frame: u64,
    max_header: u32,
) -> Result<EncodedFrame> {
    let mut head = vec![0u8; PREFIX_LEN];
    head = postcard::to_extend(msg, head).map_err(|e| ProtocolError::Encode(e.to_string()))?;
    let header_len = head.len() - PREFIX_LEN;
    let header_len = u32::try_from(header_len).ok().filter(|&l| l <= max_header).ok_or(ProtocolError::TooLarge {
        what: "message header",
        len: header_len as u64,
        max: u64::from(max_header),
    })?;
    let bodies: Vec<Bytes> = msg.payloads().into_iter().map(|p| p.data().clone()).collect();
    let body_len = bodies.iter().map(|b| b.len() as u64).sum();
    let prefix = FramePrefix { version: WIRE_VERSION, kind, header_len, body_len };
    if prefix.total_len() > max_frame {
        return Err(ProtocolError::TooLarge { what: "frame", len: prefix.total_len(), max: max_frame });
    }
    head[..PREFIX_LEN].copy_from_slice(&prefix.to_bytes());
    Ok(EncodedFrame { head, bodies })
}

/// Decodes a postcard header and re-attaches tensor bodies sliced (without
/// copying) out of `body`.
pub fn decode_message<M: DeserializeOwned + HasPayloads>(header: &[u8], body: Bytes, max_elements: u64) -> Result<M> {
    let (mut msg, rest): (M, &[u8]) = postcard::take_from_bytes(header)?;
    if !rest.is_empty() {
        return Err(ProtocolError::Decode(format!("{} trailing bytes after the message header", rest.len())));
    }
    attach_bodies(&mut msg, body, max_elements)?;
    Ok(msg)
}

fn attach_bodies<M: HasPayloads>(msg: &mut M, mut body: Bytes, max_elements: u64) -> Result<()> {
    let mut payloads = msg.payloads_mut();
    let mut declared: u64 = 0;
    for p in payloads.iter() {
        // Header checks (dtype, shape, sizes) before trusting byte_len.
        p.meta().check(max_elements)?;
        declared = declared
            .checked_add(p.meta().byte_len)
            .ok_or(ProtocolError::BodyMismatch { declared: u64::MAX, body: body.len() as u64 })?;
    }
    if declared != body.len() as u64 {
        return Err(ProtocolError::BodyMismatch { declared, body: body.len() as u64 });
    }
    for p in payloads.iter_mut() {
        // Fits: the sum of byte_len equals body.len(), which is a usize.
        let part = body.split_to(p.meta().byte_len as usize);
        p.attach(part);
    }
    Ok(())
}

fn decode_frame<M: DeserializeOwned + HasPayloads>(
    frame: Bytes,
    kind: FrameKind,
    max_frame: u64,
    limits: &Limits,
) -> Result<M> {
    let prefix_bytes: &[u8; PREFIX_LEN] = frame
        .get(..PREFIX_LEN)
        .and_then(|s| s.try_into().ok())
        .ok_or(ProtocolError::BadPrefix("frame shorter than its 20-byte prefix"))?;
    let prefix = FramePrefix::parse(prefix_bytes)?;
    prefix.check(kind, max_frame, limits.max_header_bytes)?;
    if prefix.total_len() != frame.len() as u64 {
        return Err(ProtocolError::BodyMismatch { declared: prefix.total_len(), body: frame.len() as u64 });
    }
    let header_end = PREFIX_LEN + prefix.header_len as usize;
    let body = frame.slice(header_end..);
    decode_message(&frame[PREFIX_LEN..header_end], body, limits.max_tensor_elements)
}

/// Decodes a complete request frame held in memory.
pub fn decode_request_frame(frame: Bytes, limits: &Limits) -> Result<ShardRequest> {
    decode_frame(frame, FrameKind::Request, limits.max_request_bytes, limits)
}

/// Decodes a complete response frame held in memory.
pub fn decode_response_frame(frame: Bytes, limits: &Limits) -> Result<ShardResponse> {
    decode_frame(frame, FrameKind::Response, limits.max_response_bytes, limits)
}

/// Encodes a request frame.
pub fn encode_request(req: &ShardRequest, limits: &Limits) -> Result<EncodedFrame> {
    encode_message(req, FrameKind::Request, limits.max_request_bytes, limits.max_header_bytes)
}

/// Encodes a response frame.
pub fn encode_response(resp: &ShardResponse, limits: &Limits) -> Result<EncodedFrame> {
    encode_message(resp, FrameKind::Response, limits.max_response_bytes, limits.max_header_bytes)
}

/// Bytes of a gossip message's signature trailer: the signer's ed25519
/// public key (32), then its signature (64).
pub const GOSSIP_SIGNATURE_LEN: usize = 32 + 64;

/// What a gossip signature covers, before the message's bytes: it keeps a
/// Shoal gossip signature from being taken for any other use of the key
/// (gossipsub's own signatures, for one, begin `libp2p-pubsub:`).
const GOSSIP_SIGNING_CONTEXT: &[u8] = b"shoal-gossip:";

/// The bytes a gossip signature covers: the context, then the message's
/// prefix and postcard body.
fn gossip_signed_bytes(unsigned: &[u8]) -> Vec<u8> {
    let mut signed = Vec::with_capacity(GOSSIP_SIGNING_CONTEXT.len() + unsigned.len());
    signed.extend_from_slice(GOSSIP_SIGNING_CONTEXT);
    signed.extend_from_slice(unsigned);
    signed
}

/// Signs this node's gossip with its identity key.
///
/// Gossip is signed by Shoal, not by gossipsub: gossipsub checks its own
/// signature in its codec, on every copy a node receives (one from each
/// mesh peer), before its duplicate cache drops the copies. Shoal's
/// signature is checked by [`decode_gossip`], which the node calls only
/// on the first copy gossipsub delivers. In a 64-node swarm the per-copy
/// checks were about a quarter of a node's CPU.
#[derive(Clone)]
pub struct GossipSigner {
    key: ed25519::Keypair,
}

impl fmt::Debug for GossipSigner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GossipSigner").field("peer", &self.peer()).finish_non_exhaustive()
    }
}

impl GossipSigner {
    /// The node's identity key, which must be ed25519 (Shoal's only kind:
    /// the key's bytes are in its peer id, so a receiver needs nothing
    /// else to check a signature).
    pub fn new(keypair: &Keypair) -> Result<GossipSigner> {
        let key = keypair
            .clone()
            .try_into_ed25519()
            .map_err(|e| ProtocolError::Config(format!("gossip signing needs an ed25519 identity key: {e}")))?;
        Ok(GossipSigner { key })
    }

    /// The signer's peer id.
    pub fn peer(&self) -> PeerId {
        PublicKey::from(self.key.public()).to_peer_id()
    }

    /// Appends the signature trailer (this key, then its signature) to a
    /// gossip message's prefix and body. [`encode_gossip`] seals what it
    /// encodes; the fuzz test seals mutated bytes, as a peer could sign
    /// anything with its own key.
    pub fn seal(&self, mut unsigned: Vec<u8>) -> Vec<u8> {
        let signature = self.key.sign(&gossip_signed_bytes(&unsigned));
        unsigned.extend_from_slice(&self.key.public().to_bytes());
        unsigned.extend_from_slice(&signature);
        unsigned
    }
}

/// A gossip message and the peer whose signature it carries.
#[derive(Debug, Clone, PartialEq)]
pub struct SignedGossip {
    /// The message.
    pub message: GossipMessage,
    /// The peer that signed it (checked: the signature is valid for this
    /// peer's key).
    pub signer: PeerId,
}

/// Encodes and signs a gossip message, refusing a prefix and body over
/// `limits.max_gossip_bytes` (the signature's fixed
/// [`GOSSIP_SIGNATURE_LEN`] bytes come on top).
pub fn encode_gossip(msg: &GossipMessage, signer: &GossipSigner, limits: &Limits) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(&GOSSIP_MAGIC);
    out.extend_from_slice(&WIRE_VERSION.to_le_bytes());
    let out = postcard::to_extend(msg, out).map_err(|e| ProtocolError::Encode(e.to_string()))?;
    if out.len() > limits.max_gossip_bytes as usize {
        return Err(ProtocolError::TooLarge {
            what: "gossip message",
            len: out.len() as u64,
            max: u64::from(limits.max_gossip_bytes),
        });
    }
    Ok(signer.seal(out))
}

/// Decodes a gossip message and checks its signature: the prefix and the
/// body first (cheap refusals), the signature last.
pub fn decode_gossip(data: &[u8], limits: &Limits) -> Result<SignedGossip> {
    let unsigned = data.len().saturating_sub(GOSSIP_SIGNATURE_LEN);
    if unsigned > limits.max_gossip_bytes as usize {
        return Err(ProtocolError::TooLarge {
            what: "gossip message",
            len: unsigned as u64,
            max: u64::from(limits.max_gossip_bytes),
        });
    }
    let Some((head, rest)) = data.split_at_checked(GOSSIP_PREFIX_LEN) else {
        return Err(ProtocolError::BadPrefix("gossip message shorter than its 4-byte prefix"));
    };
    if head[0..2] != GOSSIP_MAGIC {
        return Err(ProtocolError::BadMagic { found: [head[0], head[1]], expected: GOSSIP_MAGIC });
    }
    check_version(u16::from_le_bytes([head[2], head[3]]))?;
    let Some(body_len) = rest.len().checked_sub(GOSSIP_SIGNATURE_LEN) else {
        return Err(ProtocolError::BadPrefix("gossip message shorter than its 96-byte signature"));
    };
    let (body, trailer) = rest.split_at(body_len);
    let message = match postcard::take_from_bytes::<GossipMessage>(body)? {
        (msg, []) => msg,
        (_, trailing) => {
            return Err(ProtocolError::Decode(format!("{} trailing bytes after gossip message", trailing.len())))
        }
    };
    let (key, signature) = trailer.split_at(32);
    let key = ed25519::PublicKey::try_from_bytes(key)
        .map_err(|e| ProtocolError::InvalidField { field: "gossip signer", reason: e.to_string() })?;
    let signed = key.verify(&gossip_signed_bytes(&data[..GOSSIP_PREFIX_LEN + body_len]), signature);
    let signer = PublicKey::from(key).to_peer_id();
    if !signed {
        return Err(ProtocolError::BadSignature { signer: Box::new(signer) });
    }
    Ok(SignedGossip { message, signer })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gossip names its signer, and a message whose bytes, key or signature
    /// were changed after signing is refused: a forger cannot put another
    /// peer's key on its message, nor change a signed one.
    #[test]
    fn gossip_is_signed_and_a_changed_message_is_refused() {
        let limits = Limits::default();
        let key = Keypair::generate_ed25519();
        let signer = GossipSigner::new(&key).expect("ed25519");
        let peer = key.public().to_peer_id();
        let msg = GossipMessage::Announce(crate::messages::Announcement::Leaving {
            run: crate::messages::RunId::default(),
            peer,
            incarnation: 3,
        });
        let bytes = encode_gossip(&msg, &signer, &limits).expect("encodes");
        let back = decode_gossip(&bytes, &limits).expect("decodes");
        assert_eq!(back, SignedGossip { message: msg.clone(), signer: peer });
        assert_eq!(signer.peer(), peer);
        let body_end = bytes.len() - GOSSIP_SIGNATURE_LEN;

        // The body changed after signing (incarnation 3 -> 4, the last
        // byte of the body): the same length, still a valid message.
        let mut changed = bytes.clone();
        changed[body_end - 1] = 4;
        let r = decode_gossip(&changed, &limits);
        assert!(matches!(&r, Err(ProtocolError::BadSignature { signer }) if **signer == peer), "{r:?}");

        // Another peer's key in place of the signer's, the signature kept.
        let other = Keypair::generate_ed25519();
        let mut forged = bytes.clone();
        let other_key = other.clone().try_into_ed25519().expect("ed25519").public().to_bytes();
        forged[body_end..body_end + 32].copy_from_slice(&other_key);
        let r = decode_gossip(&forged, &limits);
        let other_peer = other.public().to_peer_id();
        assert!(matches!(&r, Err(ProtocolError::BadSignature { signer }) if **signer == other_peer), "{r:?}");

        // A flipped bit in the signature.
        let mut flipped = bytes.clone();
        *flipped.last_mut().expect("not empty") ^= 1;
        assert!(matches!(decode_gossip(&flipped, &limits), Err(ProtocolError::BadSignature { .. })));

        // Cut short: no room for the trailer, or the trailer cut.
        assert!(matches!(decode_gossip(&bytes[..GOSSIP_PREFIX_LEN + 10], &limits), Err(ProtocolError::BadPrefix(_))));
        assert!(decode_gossip(&bytes[..bytes.len() - 1], &limits).is_err());

        // The same message signed by another key decodes, naming that key:
        // whether the signer may send it is the validator's question.
        let resigned = GossipSigner::new(&other).expect("ed25519").seal(bytes[..body_end].to_vec());
        assert_eq!(decode_gossip(&resigned, &limits).expect("decodes").signer, other_peer);
    }

    /// A peer can nest answers only as deep as the wire allows: a header of
    /// batches inside batches is refused, not decoded by recursion until
    /// the stack runs out.
    #[test]
    fn deeply_nested_answers_are_refused_without_exhausting_the_stack() {
        let mut header = Vec::new();
        for _ in 0..200_000 {
            header.extend_from_slice(&[11, 1]);
        }
        header.extend_from_slice(&[10, 0]);
        let r = decode_message::<ShardResponse>(&header, Bytes::new(), 1 << 20);
        assert!(matches!(r, Err(ProtocolError::Decode(_))), "{r:?}");
        // Timed requests inside Timed requests.
        let header = vec![8u8; 200_000];
        let r = decode_message::<ShardRequest>(&header, Bytes::new(), 1 << 20);
        assert!(matches!(r, Err(ProtocolError::Decode(_))), "{r:?}");

        // As deep as the wire allows decodes, and the depth count is back
        // at zero afterwards (also after a refusal): the same message
        // decodes again on this thread.
        let accepted = ShardResponse::Accepted(crate::messages::Accepted { shard: 2, version: 5, staleness: 1 });
        let timed =
            ShardResponse::Timed { service_us: 7, answer: Box::new(ShardResponse::ExchangedMany(vec![accepted])) };
        let header = postcard::to_allocvec(&timed).expect("encodes");
        for _ in 0..2 {
            let back = decode_message::<ShardResponse>(&header, Bytes::new(), 1 << 20).expect("decodes");
            assert_eq!(back, timed);
        }
        let deeper =
            ShardResponse::Timed { service_us: 7, answer: Box::new(ShardResponse::ExchangedMany(vec![timed])) };
        let header = postcard::to_allocvec(&deeper).expect("encodes");
        let r = decode_message::<ShardResponse>(&header, Bytes::new(), 1 << 20);
        assert!(matches!(r, Err(ProtocolError::Decode(_))), "{r:?}");
    }
}
