//! Fuzzing at scale: a million or more random and mutated frames through
//! every decoder and validator, with allocation accounting.
//!
//! `#[ignore]`d in the README's test command; `.ci/run` runs it:
//!
//! ```text
//! cargo test -p shoal-protocol --test fuzz -- --ignored --nocapture
//! ```
//!
//! - The corpus is valid frames of every request, response and gossip
//!   variant, built by the property tests' strategies.
//! - Each fuzzed frame is either random bytes or a corpus frame with 1 to 8
//!   mutations (bit flips, byte sets, boundary integers written over length
//!   fields, insertions, deletions, truncation, duplication, splicing).
//! - Each frame goes through the request, response and gossip decoders, the
//!   prefix parser and the async codec (both directions). Whatever decodes is
//!   validated against a context that matches its run and shard (so
//!   validation reaches the tensor checks), and every payload is decoded.
//! - The global allocator is capped while frames are processed: live bytes
//!   may grow by at most four times the largest frame or tensor the limits
//!   allow, or the allocation fails and the run aborts.
//!
//! `SHOAL_FUZZ_FRAMES` (default 1 000 000) and `SHOAL_FUZZ_SEED` override
//! the count and the seed; the seed is printed so a failure can be replayed.
//! The cargo-fuzz target `protocol/fuzz` covers the same decoders with
//! coverage guidance.
#![allow(clippy::unwrap_used)]

use std::alloc::System;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use bytes::Bytes;
use cap::Cap;
use futures::io::Cursor;
use proptest::prelude::Rng;
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use shoal_protocol::frame::{
    self, FramePrefix, GossipSigner, SignedGossip, GOSSIP_MAGIC, GOSSIP_SIGNATURE_LEN, PREFIX_LEN,
};
use shoal_protocol::libp2p::identity::Keypair;
use shoal_protocol::libp2p::request_response::Codec;
use shoal_protocol::libp2p::PeerId;
use shoal_protocol::messages::HasPayloads;
use shoal_protocol::*;

mod strategies;

// ---------------------------------------------------------------------------
// Allocation accounting
// ---------------------------------------------------------------------------

/// The system allocator with a cap: while frames are fuzzed, the cap is the
/// live bytes before the run plus a few frames' worth of the configured
/// limits, so an allocation a peer's length field could inflate beyond them
/// fails the run ("memory allocation of N bytes failed").
#[global_allocator]
static ALLOCATOR: Cap<System> = Cap::new(System, usize::MAX);

// ---------------------------------------------------------------------------
// Frames and mutations
// ---------------------------------------------------------------------------

/// Limits small enough that an allocation driven by a peer's length field
/// stands out: 1 MiB frames, 256 Ki-element tensors (1 MiB of f32).
fn fuzz_limits() -> Limits {
    Limits {
        max_request_bytes: 1 << 20,
        max_response_bytes: 1 << 20,
        max_header_bytes: 64 << 10,
        max_tensor_elements: 256 << 10,
        max_inflight_read_bytes: 4 << 20,
        ..Limits::default()
    }
}

fn below(rng: &mut TestRng, n: usize) -> usize {
    if n == 0 {
        0
    } else {
        (rng.next_u64() % n as u64) as usize
    }
}

fn random_bytes(rng: &mut TestRng, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rng.fill_bytes(&mut v);
    v
}

/// Integers at the edges of what length and count fields hold.
const BOUNDARY: [u64; 10] = [0, 1, 2, 0x7f, 0x80, 0xff, 0xffff, 0x7fff_ffff, 0xffff_ffff, u64::MAX];

/// Applies one random mutation. `other` is another corpus frame to splice.
fn mutate(rng: &mut TestRng, f: &mut Vec<u8>, other: &[u8]) {
    // A fifth of positioned mutations hit the prefix, where the lengths are.
    let pos = |rng: &mut TestRng, len: usize| {
        if len > PREFIX_LEN && below(rng, 5) == 0 {
            below(rng, PREFIX_LEN)
        } else {
            below(rng, len.max(1))
        }
    };
    match below(rng, 9) {
        0 if !f.is_empty() => {
            let i = pos(rng, f.len());
            f[i] ^= 1 << below(rng, 8);
        }
        1 if !f.is_empty() => {
            let i = pos(rng, f.len());
            f[i] = random_bytes(rng, 1)[0];
        }
        2 => {
            // A boundary integer, little-endian, 1 to 8 bytes wide.
            let v = BOUNDARY[below(rng, BOUNDARY.len())].to_le_bytes();
            let w = 1 + below(rng, 8);
            let i = pos(rng, f.len());
            for (k, b) in v.iter().take(w).enumerate() {
                if let Some(slot) = f.get_mut(i + k) {
                    *slot = *b;
                }
            }
        }
        3 => {
            let i = below(rng, f.len() + 1);
            let n = 1 + below(rng, 16);
            let bytes = random_bytes(rng, n);
            f.splice(i..i, bytes);
        }
        4 if !f.is_empty() => {
            let i = below(rng, f.len());
            let n = 1 + below(rng, (f.len() - i).min(32));
            f.drain(i..i + n);
        }
        5 => {
            let keep = below(rng, f.len() + 1);
            f.truncate(keep);
        }
        6 if !f.is_empty() => {
            let i = below(rng, f.len());
            let n = 1 + below(rng, (f.len() - i).min(64));
            let chunk = f[i..i + n].to_vec();
            let at = below(rng, f.len() + 1);
            f.splice(at..at, chunk);
        }
        7 if !other.is_empty() => {
            // The head of this frame, the tail of another.
            let cut = below(rng, f.len() + 1);
            let from = below(rng, other.len());
            f.truncate(cut);
            f.extend_from_slice(&other[from..]);
        }
        _ => {
            let n = 1 + below(rng, 8);
            let bytes = random_bytes(rng, n);
            f.extend_from_slice(&bytes);
        }
    }
}

/// Valid frames of every message variant, labelled `kind/variant`.
fn corpus(
    runner: &mut TestRunner,
    limits: &Limits,
    signer: &GossipSigner,
    per_strategy: usize,
) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for _ in 0..per_strategy {
        let req = strategies::request().new_tree(runner).unwrap().current();
        out.push((format!("request/{}", req.kind()), frame::encode_request(&req, limits).unwrap().to_vec()));
        let resp = strategies::response().new_tree(runner).unwrap().current();
        out.push((format!("response/{}", resp.kind()), frame::encode_response(&resp, limits).unwrap().to_vec()));
        let msg = strategies::gossip().new_tree(runner).unwrap().current();
        let kind = match &msg {
            GossipMessage::Heartbeat(_) => "heartbeat".to_string(),
            GossipMessage::Announce(a) => {
                format!("announce_{}", format!("{a:?}").split([' ', '{', '(']).next().unwrap_or("?").to_lowercase())
            }
        };
        out.push((format!("gossip/{kind}"), frame::encode_gossip(&msg, signer, limits).unwrap()));
    }
    out
}

// ---------------------------------------------------------------------------
// The decoders under test
// ---------------------------------------------------------------------------

/// Outcomes by decoder and result (`ok` or the error's kind).
#[derive(Default)]
struct Tally {
    counts: BTreeMap<(&'static str, &'static str), u64>,
}

impl Tally {
    fn add<T>(&mut self, stage: &'static str, r: &std::result::Result<T, ProtocolError>) {
        let outcome = match r {
            Ok(_) => "ok",
            Err(e) => e.kind(),
        };
        *self.counts.entry((stage, outcome)).or_default() += 1;
    }

    fn get(&self, stage: &str, outcome: &str) -> u64 {
        self.counts.get(&(stage, outcome)).copied().unwrap_or(0)
    }

    fn stage_total(&self, stage: &str) -> u64 {
        self.counts.iter().filter(|((s, _), _)| *s == stage).map(|(_, n)| n).sum()
    }
}

/// A context that matches the message's run and shard, so validation gets
/// past those checks to the fields and tensors behind them.
fn matching(base: &ValidationContext, run: Option<&RunId>, shard: Option<u32>) -> ValidationContext {
    let mut ctx = base.clone();
    if let Some(run) = run {
        ctx.run = run.clone();
    }
    if let Some(s) = shard {
        ctx.num_shards = s.saturating_add(1);
    }
    ctx
}

fn response_run_shard(resp: &ShardResponse) -> (Option<&RunId>, Option<u32>) {
    match resp {
        ShardResponse::ShardState(s) => (Some(&s.run), Some(s.shard)),
        ShardResponse::Exchanged(e) => (e.state.as_ref().map(|s| &s.run), Some(e.accepted.shard)),
        ShardResponse::Manifest(m) => (Some(&m.run), m.shards.iter().map(|s| s.shard).max()),
        ShardResponse::Accepted(a) => (None, Some(a.shard)),
        ShardResponse::Stale { shard, .. }
        | ShardResponse::NotOwner { shard, .. }
        | ShardResponse::NotReady { shard, .. }
        | ShardResponse::Fenced { shard, .. }
        | ShardResponse::HandoffAck { shard, .. } => (None, Some(*shard)),
        ShardResponse::Error(_) | ShardResponse::Probed { .. } => (None, None),
        // Its answers' runs and shards: the first one's run, the largest shard.
        ShardResponse::ExchangedMany(v) => {
            let parts: Vec<_> = v.iter().map(response_run_shard).collect();
            (parts.iter().find_map(|p| p.0), parts.iter().filter_map(|p| p.1).max())
        }
        ShardResponse::Timed { answer, .. } => response_run_shard(answer),
    }
}

/// The request's shard, or a batch's largest.
fn request_shard(req: &ShardRequest) -> Option<u32> {
    match req {
        ShardRequest::PushPullMany(v) => v.iter().map(|m| m.push.shard).max(),
        ShardRequest::Timed(inner) => request_shard(inner),
        _ => req.shard(),
    }
}

fn claimed_sender(req: &ShardRequest) -> Option<PeerId> {
    match req {
        ShardRequest::Timed(inner) => claimed_sender(inner),
        ShardRequest::PushGrad(m) => Some(m.worker),
        ShardRequest::PushPull(m) => Some(m.push.worker),
        ShardRequest::PushPullMany(v) => v.first().map(|m| m.push.worker),
        ShardRequest::Handoff(m) => Some(m.from),
        _ => None,
    }
}

fn payloads(t: &mut Tally, stage: &'static str, ps: Vec<&Payload>) {
    for p in ps {
        t.add(stage, &p.decode());
    }
}

/// Every decoder and validator on one frame.
fn run_frame(
    data: &[u8],
    base: &ValidationContext,
    codec: &mut ShardCodec,
    stranger: &PeerId,
    signer: &GossipSigner,
    t: &mut Tally,
) {
    let limits = &base.limits;
    if let Ok(p) = <[u8; PREFIX_LEN]>::try_from(data.get(..PREFIX_LEN).unwrap_or(&[])) {
        t.add("prefix", &FramePrefix::parse(&p));
    }

    let req = frame::decode_request_frame(Bytes::copy_from_slice(data), limits);
    t.add("request", &req);
    if let Ok(req) = req {
        let ctx = matching(base, req.run(), request_shard(&req));
        let sender = claimed_sender(&req).unwrap_or(*stranger);
        t.add("validate_request", &validate_request(&req, &sender, &ctx));
        // The same request from a peer that is not who it claims to be.
        t.add("validate_request_stranger", &validate_request(&req, stranger, &ctx));
        payloads(t, "request_payload", req.payloads());
    }

    let resp = frame::decode_response_frame(Bytes::copy_from_slice(data), limits);
    t.add("response", &resp);
    if let Ok(resp) = resp {
        let (run, shard) = response_run_shard(&resp);
        let ctx = matching(base, run, shard);
        t.add("validate_response", &validate_response(&resp, &ctx));
        payloads(t, "response_payload", resp.payloads());
    }

    // A mutated gossip message fails its signature; sealed again (as a
    // peer could sign anything with its own key), it reaches the decoder
    // and the validator.
    t.add("gossip", &frame::decode_gossip(data, limits));
    let resealed = data.starts_with(&GOSSIP_MAGIC).then(|| {
        frame::decode_gossip(&signer.seal(data[..data.len().saturating_sub(GOSSIP_SIGNATURE_LEN)].to_vec()), limits)
    });
    if let Some(msg) = &resealed {
        t.add("gossip_resealed", msg);
    }
    if let Some(Ok(SignedGossip { message: msg, .. })) = resealed {
        // Validated as if signed by the sender it claims.
        let ctx = matching(base, Some(msg.run()), None);
        let source = match &msg {
            GossipMessage::Heartbeat(h) => h.peer,
            GossipMessage::Announce(_) => *stranger,
        };
        t.add("validate_gossip", &validate_gossip(&msg, Some(&source), &ctx));
    }

    // The async codec, as a stream hands it bytes. A request it can frame but
    // not understand comes back as `Undecodable`, so count that apart.
    let read = futures::executor::block_on(codec.read_request(&SHARD_PROTOCOL, &mut Cursor::new(data)));
    let outcome = match &read {
        Ok(ShardRequest::Undecodable { .. }) => "undecodable",
        Ok(_) => "ok",
        Err(_) => "error",
    };
    *t.counts.entry(("codec_request", outcome)).or_default() += 1;
    let read = futures::executor::block_on(codec.read_response(&SHARD_PROTOCOL, &mut Cursor::new(data)));
    *t.counts.entry(("codec_response", if read.is_ok() { "ok" } else { "error" })).or_default() += 1;
}

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v.parse().unwrap_or_else(|_| panic!("{name}={v:?} is not a whole number")),
        Err(_) => default,
    }
}

#[test]
#[ignore = "a million frames: .ci/run runs it"]
fn a_million_random_and_mutated_frames_never_panic_or_overallocate() {
    let frames = env_u64("SHOAL_FUZZ_FRAMES", 1_000_000);
    let seed = env_u64("SHOAL_FUZZ_SEED", 0x540a1);
    let mut seed_bytes = [0u8; 32];
    seed_bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes);
    let mut runner = TestRunner::new_with_rng(Config::default(), TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes));

    let limits = fuzz_limits();
    // A fixed key, so that a seed replays the same bytes.
    let signer = GossipSigner::new(&Keypair::ed25519_from_bytes(seed_bytes).unwrap()).unwrap();
    let corpus = corpus(&mut runner, &limits, &signer, 400);
    let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
    for (k, _) in &corpus {
        *kinds.entry(k.as_str()).or_default() += 1;
    }
    // Every variant that can be sent is in the corpus.
    let expected = [
        "request/push_grad",
        "request/pull_shard",
        "request/handoff",
        "request/state_sync",
        "request/manifest",
        "request/push_pull",
        "request/probe",
        "request/push_pull_many",
        "request/timed",
        "response/accepted",
        "response/stale",
        "response/not_owner",
        "response/not_ready",
        "response/fenced",
        "response/shard_state",
        "response/handoff_ack",
        "response/manifest",
        "response/error",
        "response/exchanged",
        "response/probed",
        "response/exchanged_many",
        "response/timed",
        "gossip/heartbeat",
        "gossip/announce_shardversion",
        "gossip/announce_leaving",
        "gossip/announce_checkpoint",
    ];
    for k in expected {
        assert!(kinds.contains_key(k), "corpus lacks {k}: {kinds:?}");
    }
    assert_eq!(kinds.len(), expected.len(), "a variant the test does not list: {kinds:?}");

    let ctx = ValidationContext::new(RunId::default(), 16, limits.clone(), &Timeouts::default());
    let mut codec = ShardCodec::new(limits.clone(), Timeouts::default());
    let stranger = PeerId::random();
    let mut tally = Tally::default();
    let mut panicked: Vec<Vec<u8>> = Vec::new();
    let (mut random, mut mutated, mut largest_frame) = (0u64, 0u64, 0usize);
    // Panics are caught per frame and reported at the end, with the frame.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));

    // No allocation beyond the configured limits: the most a peer can make
    // us allocate is one frame or one decoded tensor, a few at a time.
    let limit = limits.max_request_bytes.max(limits.max_response_bytes).max(limits.max_tensor_elements * 4) as usize;
    eprintln!("fuzz: seed {seed:#x}, {frames} frames, corpus of {} valid frames", corpus.len());
    let start = Instant::now();
    let baseline = ALLOCATOR.allocated();
    let cap = baseline + 4 * limit;
    ALLOCATOR.set_limit(cap).unwrap();
    for i in 0..frames {
        let data = if below(&mut rng, 10) == 0 {
            random += 1;
            let len = below(&mut rng, 600);
            random_bytes(&mut rng, len)
        } else {
            mutated += 1;
            let mut f = corpus[below(&mut rng, corpus.len())].1.clone();
            let other = &corpus[below(&mut rng, corpus.len())].1;
            // 1 to 8 mutations, fewer more often (1: half the frames), so
            // many frames still get past the framing to the validators.
            let n = 1 + (rng.next_u32() | 0x80).trailing_zeros().min(7);
            for _ in 0..n {
                mutate(&mut rng, &mut f, other);
            }
            f
        };
        largest_frame = largest_frame.max(data.len());
        let r = catch_unwind(AssertUnwindSafe(|| run_frame(&data, &ctx, &mut codec, &stranger, &signer, &mut tally)));
        if r.is_err() && panicked.len() < 5 {
            panicked.push(data);
        }
        if (i + 1) % 250_000 == 0 {
            eprintln!("fuzz: {} frames, {:.1} s", i + 1, start.elapsed().as_secs_f64());
        }
    }
    ALLOCATOR.set_limit(usize::MAX).unwrap();
    std::panic::set_hook(hook);
    let elapsed = start.elapsed();

    eprintln!(
        "fuzz: {frames} frames ({random} random, {mutated} mutated, largest {largest_frame} B) in {:.1} s, {:.0} frames/s",
        elapsed.as_secs_f64(),
        frames as f64 / elapsed.as_secs_f64()
    );
    eprintln!(
        "fuzz: live memory capped at {} KiB over the {} KiB before the run; the process peak was {} KiB",
        (cap - baseline) >> 10,
        baseline >> 10,
        ALLOCATOR.max_allocated() >> 10
    );
    eprintln!("fuzz: outcomes by stage (ok, or rejected by error kind):");
    for ((stage, outcome), n) in &tally.counts {
        eprintln!("  {stage:<26} {outcome:<20} {n:>9}");
    }

    for f in &panicked {
        eprintln!("fuzz: frame that panicked (hex): {}", f.iter().map(|b| format!("{b:02x}")).collect::<String>());
    }
    assert!(panicked.is_empty(), "{} frame(s) panicked a decoder or validator; see the hex above", panicked.len());
    assert!(random + mutated >= frames && frames > 0);
    // Every frame reached every decoder.
    for stage in ["request", "response", "gossip", "codec_request", "codec_response"] {
        assert_eq!(tally.stage_total(stage), frames, "{stage}");
    }
    // Mutated frames got past the framing into the validators and the
    // tensor decoders, and some were rejected there: the run tested more
    // than the length checks.
    for stage in ["validate_request", "validate_response", "validate_gossip", "request_payload", "response_payload"] {
        let total = tally.stage_total(stage);
        assert!(total >= frames / 1000, "only {total} of {frames} frames reached {stage}");
        assert!(tally.get(stage, "ok") < total, "{stage} rejected nothing");
    }
    assert!(tally.get("validate_request_stranger", "sender_mismatch") > 0, "a forged sender was never caught");
    assert!(tally.get("gossip", "bad_signature") > 0, "a mutated gossip message was never caught by its signature");
    assert!(tally.get("gossip", "ok") < tally.get("gossip_resealed", "ok"), "resealing let no more gossip through");
    assert!(tally.get("request_payload", "checksum_mismatch") > 0, "a corrupted tensor body was never caught");
    assert_eq!(codec.in_flight_read_bytes(), 0, "the codec's read budget leaked");
}
