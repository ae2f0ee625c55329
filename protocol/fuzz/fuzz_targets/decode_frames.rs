//! Feeds arbitrary bytes to every decoder: whole request/response frames,
//! gossip messages, the async codec, and (when a frame decodes) validation
//! and tensor decoding. Any panic is a bug.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use shoal_protocol::libp2p::request_response::Codec;
use shoal_protocol::messages::HasPayloads;
use shoal_protocol::{
    frame, Limits, RunId, ShardCodec, Timeouts, ValidationContext, SHARD_PROTOCOL,
};

fuzz_target!(|data: &[u8]| {
    let limits = Limits::default();
    let ctx = ValidationContext::new(RunId::default(), 16, limits.clone(), &Timeouts::default());
    let peer = shoal_protocol::libp2p::PeerId::random();
    if let Ok(req) = frame::decode_request_frame(Bytes::copy_from_slice(data), &limits) {
        let _ = shoal_protocol::validate_request(&req, &peer, &ctx);
        for p in req.payloads() {
            let _ = p.decode();
        }
    }
    if let Ok(resp) = frame::decode_response_frame(Bytes::copy_from_slice(data), &limits) {
        let _ = shoal_protocol::validate_response(&resp, &ctx);
        for p in resp.payloads() {
            let _ = p.decode();
        }
    }
    if let Ok(signed) = frame::decode_gossip(data, &limits) {
        let _ = shoal_protocol::validate_gossip(&signed.message, Some(&signed.signer), &ctx);
    }
    let mut codec = ShardCodec::default();
    let mut cursor = futures::io::Cursor::new(data.to_vec());
    let _ = futures::executor::block_on(codec.read_request(&SHARD_PROTOCOL, &mut cursor));
});
