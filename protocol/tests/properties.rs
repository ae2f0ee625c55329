//! Property tests with no sockets: every message and payload encoding
//! round-trips through its frame, and arbitrary or corrupted bytes fed to
//! every decoder give an error, never a panic.
#![allow(clippy::unwrap_used)]

use bytes::Bytes;
use futures::io::Cursor;
use proptest::prelude::*;
use shoal_protocol::frame::{self, FramePrefix, PREFIX_LEN};
use shoal_protocol::libp2p::identity::Keypair;
use shoal_protocol::libp2p::request_response::Codec;
use shoal_protocol::libp2p::PeerId;
use shoal_protocol::*;

mod strategies;
use strategies::*;

fn limits() -> Limits {
    Limits::default()
}

fn signer() -> frame::GossipSigner {
    frame::GossipSigner::new(&Keypair::generate_ed25519()).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn requests_round_trip(req in request()) {
        let bytes = frame::encode_request(&req, &limits()).unwrap().to_vec();
        let back = frame::decode_request_frame(Bytes::from(bytes), &limits()).unwrap();
        prop_assert_eq!(back, req);
    }

    #[test]
    fn responses_round_trip(resp in response()) {
        let bytes = frame::encode_response(&resp, &limits()).unwrap().to_vec();
        let back = frame::decode_response_frame(Bytes::from(bytes), &limits()).unwrap();
        prop_assert_eq!(back, resp);
    }

    #[test]
    fn gossip_round_trips(msg in gossip()) {
        let signer = signer();
        let bytes = frame::encode_gossip(&msg, &signer, &limits()).unwrap();
        prop_assert!(bytes.len() <= limits().max_gossip_bytes as usize + frame::GOSSIP_SIGNATURE_LEN);
        let back = frame::decode_gossip(&bytes, &limits()).unwrap();
        prop_assert_eq!(back.message, msg);
        prop_assert_eq!(back.signer, signer.peer());
    }

    #[test]
    fn requests_round_trip_through_the_codec(req in request()) {
        let mut codec = ShardCodec::default();
        let mut buf = Cursor::new(Vec::new());
        futures::executor::block_on(codec.write_request(&SHARD_PROTOCOL, &mut buf, req.clone())).unwrap();
        let back = futures::executor::block_on(codec.read_request(&SHARD_PROTOCOL, &mut Cursor::new(buf.into_inner()))).unwrap();
        prop_assert_eq!(back, req);
    }

    #[test]
    fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..600)) {
        let l = limits();
        let _ = frame::decode_request_frame(Bytes::from(data.clone()), &l);
        let _ = frame::decode_response_frame(Bytes::from(data.clone()), &l);
        let _ = frame::decode_gossip(&data, &l);
        if let Ok(p) = <[u8; PREFIX_LEN]>::try_from(data.get(..PREFIX_LEN).unwrap_or(&[])) {
            let _ = FramePrefix::parse(&p);
        }
        let mut codec = ShardCodec::default();
        let _ = futures::executor::block_on(codec.read_request(&SHARD_PROTOCOL, &mut Cursor::new(data.clone())));
        let _ = futures::executor::block_on(codec.read_response(&SHARD_PROTOCOL, &mut Cursor::new(data)));
    }

    #[test]
    fn arbitrary_headers_behind_a_valid_prefix_never_panic(
        header in proptest::collection::vec(any::<u8>(), 0..300),
        body in proptest::collection::vec(any::<u8>(), 0..300),
    ) {
        // A well-formed prefix (of our version: any other is refused at the
        // prefix) gets the garbage past the framing checks and into postcard
        // and the tensor re-attachment.
        let l = limits();
        for kind in [frame::FrameKind::Request, frame::FrameKind::Response] {
            let (header_len, body_len) = (header.len() as u32, body.len() as u64);
            let prefix = FramePrefix { version: WIRE_VERSION, kind, header_len, body_len };
            let mut bytes = prefix.to_bytes().to_vec();
            bytes.extend_from_slice(&header);
            bytes.extend_from_slice(&body);
            let _ = frame::decode_request_frame(Bytes::from(bytes.clone()), &l);
            if let Ok(resp) = frame::decode_response_frame(Bytes::from(bytes.clone()), &l) {
                let ctx = ValidationContext::new(RunId::default(), 4, l.clone(), &Timeouts::default());
                let _ = validate_response(&resp, &ctx);
                for p in shoal_protocol::messages::HasPayloads::payloads(&resp) {
                    let _ = p.decode();
                }
            }
            let mut codec = ShardCodec::default();
            let _ = futures::executor::block_on(codec.read_request(&SHARD_PROTOCOL, &mut Cursor::new(bytes)));
        }
    }

    #[test]
    fn corrupted_frames_never_panic(req in request(), flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8), cut in any::<prop::sample::Index>()) {
        let l = limits();
        let mut bytes = frame::encode_request(&req, &l).unwrap().to_vec();
        for (i, x) in flips {
            let i = i.index(bytes.len());
            bytes[i] ^= x;
        }
        if let Ok(back) = frame::decode_request_frame(Bytes::from(bytes.clone()), &l) {
            let ctx = ValidationContext::new(RunId::default(), 4, l.clone(), &Timeouts::default());
            let _ = validate_request(&back, &PeerId::random(), &ctx);
            for p in shoal_protocol::messages::HasPayloads::payloads(&back) {
                let _ = p.decode();
            }
        }
        bytes.truncate(cut.index(bytes.len() + 1));
        let _ = frame::decode_request_frame(Bytes::from(bytes), &l);
    }
}

#[test]
fn largest_heartbeat_fits_in_the_gossip_limit() {
    let peer = || Keypair::generate_ed25519().public().to_peer_id();
    let hb = Heartbeat {
        run: RunId::new("r".repeat(64)).unwrap(),
        peer: peer(),
        incarnation: u64::MAX,
        seq: u64::MAX,
        epoch: u64::MAX,
        config_hash: u64::MAX,
        protocol_version: u16::MAX,
        capabilities: Capabilities {
            device: Device::Other,
            memory_bytes: u64::MAX,
            compute_samples_per_sec: f32::MAX,
            net_bytes_per_sec: f32::MAX,
            can_aggregate: true,
        },
        role: Role::Aggregator,
        owned_shards: vec![u32::MAX; MAX_OWNED_SHARDS],
        step: u64::MAX,
        model_version: u64::MAX,
        shard_versions: ShardVersions { base: u64::MAX, leads: vec![u8::MAX; MAX_OWNED_SHARDS] },
        service: (0..MAX_SERVICE_OBSERVATIONS)
            .map(|_| ServiceObservation { owner: peer(), micros_per_mib: f32::MAX, samples: u32::MAX })
            .collect(),
        pace: Pace {
            step_micros: u32::MAX,
            comm_micros: u32::MAX,
            aggregators: u16::MAX,
            capacity_level: i8::MIN,
            batch_permille: u16::MAX,
        },
        checkpoints: (0..MAX_CHECKPOINT_OFFERS)
            .map(|_| CheckpointOffer { version: u64::MAX, step: u64::MAX, shards: vec![0xff; MAX_OFFER_BITSET_BYTES] })
            .collect(),
        suspects: (0..MAX_SUSPECTS).map(|_| peer()).collect(),
        finished: true,
    };
    // The signature's 96 bytes come on top of the limit.
    let bytes = frame::encode_gossip(&GossipMessage::Heartbeat(hb), &signer(), &limits()).unwrap();
    let max = limits().max_gossip_bytes as usize;
    assert!(bytes.len() <= max + frame::GOSSIP_SIGNATURE_LEN, "maximal heartbeat is {} bytes", bytes.len());
    // Far from the limit: a heartbeat of a later wire version has room.
    assert!(bytes.len() < 4500 + frame::GOSSIP_SIGNATURE_LEN, "maximal heartbeat is {} bytes", bytes.len());
}

#[test]
fn unknown_error_codes_from_newer_peers_decode_as_unknown() {
    // Error variant 8, code variant 200 (not known), empty message.
    let resp = ShardResponse::Error(WireError::new(ErrorCode::Busy, ""));
    let mut bytes = frame::encode_response(&resp, &limits()).unwrap().to_vec();
    // Header is [8 (Error), code, 0 (empty string)]; replace the code with a
    // two-byte varint 200.
    assert_eq!(&bytes[PREFIX_LEN..], &[8, 9, 0]);
    bytes.truncate(PREFIX_LEN);
    bytes.extend_from_slice(&[8, 0xC8, 0x01, 0]);
    bytes[8] = 4; // header_len
    let back = frame::decode_response_frame(Bytes::from(bytes), &limits()).unwrap();
    assert_eq!(back, ShardResponse::Error(WireError { code: ErrorCode::Unknown, message: String::new() }));
}

#[test]
fn undecodable_is_never_sent() {
    let req = ShardRequest::Undecodable { code: ErrorCode::InvalidRequest, reason: "x".into() };
    assert!(matches!(frame::encode_request(&req, &limits()), Err(ProtocolError::Encode(_))));
}

#[test]
fn wrong_kind_and_magic_are_rejected() {
    let resp = ShardResponse::HandoffAck { shard: 1, version: 2 };
    let bytes = frame::encode_response(&resp, &limits()).unwrap().to_vec();
    assert!(matches!(
        frame::decode_request_frame(Bytes::from(bytes.clone()), &limits()),
        Err(ProtocolError::BadPrefix(_))
    ));
    let mut bad = bytes;
    bad[0] = b'X';
    assert!(matches!(frame::decode_response_frame(Bytes::from(bad), &limits()), Err(ProtocolError::BadMagic { .. })));
}

/// Gossip carries the wire version too: a message of another version is
/// refused at its prefix, naming both versions.
#[test]
fn gossip_of_another_version_is_refused() {
    let leaving = Announcement::Leaving { run: RunId::default(), peer: PeerId::random(), incarnation: 3 };
    let msg = GossipMessage::Announce(leaving);
    let bytes = frame::encode_gossip(&msg, &signer(), &limits()).unwrap();
    assert_eq!(frame::decode_gossip(&bytes, &limits()).unwrap().message, msg, "our version decodes");
    for theirs in [WIRE_VERSION - 1, WIRE_VERSION + 1] {
        let mut other = bytes.clone();
        other[2..4].copy_from_slice(&theirs.to_le_bytes());
        let err = frame::decode_gossip(&other, &limits()).unwrap_err();
        assert!(matches!(err, ProtocolError::VersionMismatch { ours: WIRE_VERSION, theirs: t } if t == theirs));
    }
}

#[test]
fn documented_example_frame_is_stable() {
    // The example in docs/protocol.md: a StateSync request.
    let req = ShardRequest::StateSync(StateSync { run: RunId::new("demo").unwrap(), shard: 3, min_version: 300 });
    let bytes = frame::encode_request(&req, &limits()).unwrap().to_vec();
    let expected: Vec<u8> = vec![
        0x53, 0x48, 0x0d, 0x00, 0x01, 0x00, 0x00, 0x00, // magic "SH", version 13, kind 1, reserved
        0x09, 0x00, 0x00, 0x00, // header_len 9
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // body_len 0
        0x03, // ShardRequest variant 3 = StateSync
        0x04, b'd', b'e', b'm', b'o', // run: len 4 + "demo"
        0x03, // shard 3
        0xac, 0x02, // min_version 300 as varint
    ];
    assert_eq!(bytes, expected);
}

#[test]
fn decoded_frames_share_the_received_buffer() {
    // One copy only: the payload body of a decoded frame points into the
    // frame buffer the codec received; decoding then copies into f32 once.
    let values: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    let req = ShardRequest::PushGrad(PushGrad {
        run: RunId::default(),
        shard: 0,
        epoch: 0,
        base_version: 0,
        worker: PeerId::random(),
        incarnation: 0,
        step: 0,
        samples: 1,
        grad: Payload::encode(&values, Encoding::F32).unwrap(),
    });
    let frame_bytes = Bytes::from(frame::encode_request(&req, &limits()).unwrap().to_vec());
    let range = frame_bytes.as_ptr() as usize..frame_bytes.as_ptr() as usize + frame_bytes.len();
    let ShardRequest::PushGrad(back) = frame::decode_request_frame(frame_bytes.clone(), &limits()).unwrap() else {
        panic!("wrong variant");
    };
    let body = back.grad.data();
    assert!(range.contains(&(body.as_ptr() as usize)), "payload body was copied out of the frame");
    assert_eq!(back.grad.decode().unwrap(), values);
}
