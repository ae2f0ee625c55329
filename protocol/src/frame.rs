//! Frame layout, with no I/O (the async codec in `codec` and the fuzz
//! targets both use these functions).
//!
//! A frame on `/shoal/shard/10.0.0` is a fixed 20-byte prefix, a postcard
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
//! Gossip messages are `b"SG"`, version u16 LE, then postcard(GossipMessage).
//!
//! A prefix of another version is refused before anything after it is read:
//! multistream-select has already refused a peer of another version (the
//! version is in the protocol names), so this is defence in depth.

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;

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

/// Encodes a gossip message, refusing anything over `limits.max_gossip_bytes`.
pub fn encode_gossip(msg: &GossipMessage, limits: &Limits) -> Result<Vec<u8>> {
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
    Ok(out)
}

/// Decodes a gossip message.
pub fn decode_gossip(data: &[u8], limits: &Limits) -> Result<GossipMessage> {
    if data.len() > limits.max_gossip_bytes as usize {
        return Err(ProtocolError::TooLarge {
            what: "gossip message",
            len: data.len() as u64,
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
    match postcard::take_from_bytes::<GossipMessage>(rest)? {
        (msg, []) => Ok(msg),
        (_, trailing) => Err(ProtocolError::Decode(format!("{} trailing bytes after gossip message", trailing.len()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
