//! Validation of everything a peer sends. The codec already enforces frame
//! sizes and structural consistency (tensor lengths add up); these functions
//! check meaning: run id, shard range, sender identity, counts, and tensor
//! contents (checksum, NaN/Inf). None of them panics on any input.

use libp2p::PeerId;

use crate::config::{Limits, Timeouts};
use crate::error::{ProtocolError, Result};
use crate::messages::*;
use crate::payload::{Dtype, Payload};

/// What a receiver knows about its run.
#[derive(Debug, Clone)]
pub struct ValidationContext {
    /// This node's run id.
    pub run: RunId,
    /// Shards in the model layout.
    pub num_shards: u32,
    /// Elements of each shard (index = shard id); empty if not known yet
    /// (a joiner before it has the manifest), which skips the check.
    pub shard_numel: Vec<u64>,
    /// Size limits.
    pub limits: Limits,
    /// Longest `PullShard::max_wait_ms` honoured (`timeouts.response_wait_ms`).
    pub max_wait_ms: u64,
}

impl ValidationContext {
    /// A context for `run` with `num_shards` shards of unknown sizes.
    pub fn new(run: RunId, num_shards: u32, limits: Limits, timeouts: &Timeouts) -> Self {
        ValidationContext { run, num_shards, shard_numel: Vec::new(), limits, max_wait_ms: timeouts.response_wait_ms }
    }

    /// Also check each shard's element count.
    pub fn with_shard_numel(mut self, numel: Vec<u64>) -> Self {
        self.shard_numel = numel;
        self
    }

    fn check_run(&self, run: &RunId) -> Result<()> {
        if run != &self.run {
            return Err(ProtocolError::RunMismatch { expected: self.run.to_string(), found: run.to_string() });
        }
        Ok(())
    }

    fn check_shard(&self, shard: ShardId) -> Result<()> {
        if shard >= self.num_shards {
            return Err(ProtocolError::ShardOutOfRange { shard, num_shards: self.num_shards });
        }
        Ok(())
    }

    /// Header checks, expected size, then (with `bodies`) checksum and
    /// finiteness.
    fn check_payload(&self, p: &Payload, shard: ShardId, dense_only: bool, bodies: Bodies) -> Result<()> {
        let dtype = p.meta().check(self.limits.max_tensor_elements)?;
        if dense_only && dtype != Dtype::F32 {
            return Err(ProtocolError::InvalidTensor(format!(
                "shard state must be f32 so no precision is lost, got {}",
                dtype.name()
            )));
        }
        if let Some(&expected) = self.shard_numel.get(shard as usize) {
            if p.numel() != expected {
                return Err(ProtocolError::InvalidTensor(format!(
                    "shard {shard} has {expected} elements, payload has {}",
                    p.numel()
                )));
            }
        }
        match bodies {
            Bodies::Verify => p.verify(),
            Bodies::LeaveToDecode => Ok(()),
        }
    }
}

/// Whether validation reads the tensor bodies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bodies {
    /// Checksum and finiteness, one pass over each body.
    Verify,
    /// Headers only: the caller decodes every tensor with
    /// [`Payload::decode`] or [`Payload::decode_into`], which run the same
    /// checks as they copy.
    LeaveToDecode,
}

fn check_sender(claimed: &PeerId, actual: &PeerId) -> Result<()> {
    if claimed != actual {
        return Err(ProtocolError::SenderMismatch { claimed: Box::new(*claimed), actual: Box::new(*actual) });
    }
    Ok(())
}

fn check_count(field: &'static str, len: usize, max: usize) -> Result<()> {
    if len > max {
        return Err(ProtocolError::InvalidField { field, reason: format!("{len} entries, at most {max} allowed") });
    }
    Ok(())
}

fn check_name(field: &'static str, name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(ProtocolError::InvalidField { field, reason: format!("must be 1 to {MAX_NAME_LEN} bytes") });
    }
    Ok(())
}

fn check_measure(field: &'static str, index: usize, v: f32) -> Result<()> {
    if !v.is_finite() {
        return Err(ProtocolError::NonFinite { index: index as u64, value: v });
    }
    if v < 0.0 {
        return Err(ProtocolError::InvalidField { field, reason: format!("negative value {v}") });
    }
    Ok(())
}

fn check_push(m: &crate::messages::PushGrad, sender: &PeerId, ctx: &ValidationContext, bodies: Bodies) -> Result<()> {
    ctx.check_run(&m.run)?;
    ctx.check_shard(m.shard)?;
    check_sender(&m.worker, sender)?;
    if m.samples == 0 {
        return Err(ProtocolError::InvalidField { field: "samples", reason: "must be at least 1".into() });
    }
    ctx.check_payload(&m.grad, m.shard, false, bodies)
}

/// A pull's wait and encoding (`PullShard`, `PushPull`).
fn check_pull_wait(max_wait_ms: u32, encoding: crate::payload::Encoding, ctx: &ValidationContext) -> Result<()> {
    if u64::from(max_wait_ms) > ctx.max_wait_ms {
        return Err(ProtocolError::InvalidField {
            field: "max_wait_ms",
            reason: format!("{max_wait_ms} exceeds this node's response wait of {} ms", ctx.max_wait_ms),
        });
    }
    match encoding {
        crate::payload::Encoding::Int8 { block } if block == 0 || block > crate::payload::MAX_INT8_BLOCK => {
            Err(ProtocolError::InvalidField { field: "encoding", reason: format!("int8 block {block}") })
        }
        crate::payload::Encoding::Sparse2 { chunk, .. } => crate::sparse::check_chunk(chunk)
            .map_err(|e| ProtocolError::InvalidField { field: "encoding", reason: e.to_string() }),
        _ => Ok(()),
    }
}

/// Validates a request received from the authenticated peer `sender`.
/// Tensor contents are verified too (checksum, NaN/Inf), which is one pass
/// over each body.
pub fn validate_request(req: &ShardRequest, sender: &PeerId, ctx: &ValidationContext) -> Result<()> {
    check_request(req, sender, ctx, Bodies::Verify)
}

/// [`validate_request`] without the pass over the tensor bodies, for a
/// receiver that decodes every tensor of the request next
/// ([`Payload::decode`] and [`Payload::decode_into`] check the checksum
/// and finiteness as they copy), so each body is read once.
pub fn validate_request_fields(req: &ShardRequest, sender: &PeerId, ctx: &ValidationContext) -> Result<()> {
    check_request(req, sender, ctx, Bodies::LeaveToDecode)
}

fn check_request(req: &ShardRequest, sender: &PeerId, ctx: &ValidationContext, bodies: Bodies) -> Result<()> {
    match req {
        ShardRequest::PushGrad(m) => check_push(m, sender, ctx, bodies),
        ShardRequest::PullShard(m) => {
            ctx.check_run(&m.run)?;
            ctx.check_shard(m.shard)?;
            check_pull_wait(m.max_wait_ms, m.encoding, ctx)
        }
        ShardRequest::PushPull(m) => {
            check_push(&m.push, sender, ctx, bodies)?;
            check_pull_wait(m.max_wait_ms, m.encoding, ctx)
        }
        ShardRequest::PushPullMany(v) => {
            if v.is_empty() {
                return Err(ProtocolError::InvalidField { field: "push_pulls", reason: "empty".into() });
            }
            check_count("push_pulls", v.len(), MAX_BATCH_SHARDS)?;
            let mut seen = std::collections::BTreeSet::new();
            for m in v {
                if !seen.insert(m.push.shard) {
                    return Err(ProtocolError::InvalidField {
                        field: "push_pulls",
                        reason: format!("shard {} twice", m.push.shard),
                    });
                }
                check_push(&m.push, sender, ctx, bodies)?;
                check_pull_wait(m.max_wait_ms, m.encoding, ctx)?;
            }
            Ok(())
        }
        ShardRequest::Handoff(m) => {
            ctx.check_run(&m.run)?;
            ctx.check_shard(m.shard)?;
            check_sender(&m.from, sender)?;
            check_name("optimizer.kind", &m.optimizer.kind)?;
            check_count("optimizer.slots", m.optimizer.slots.len(), MAX_OPTIMIZER_SLOTS)?;
            ctx.check_payload(&m.params, m.shard, true, bodies)?;
            for slot in &m.optimizer.slots {
                check_name("optimizer.slots.name", &slot.name)?;
                ctx.check_payload(&slot.tensor, m.shard, true, bodies)?;
            }
            Ok(())
        }
        ShardRequest::StateSync(m) => {
            ctx.check_run(&m.run)?;
            ctx.check_shard(m.shard)
        }
        ShardRequest::Manifest(m) => ctx.check_run(&m.run),
        ShardRequest::Probe(m) => {
            ctx.check_run(&m.run)?;
            let dtype = m.padding.meta().check(ctx.limits.max_tensor_elements)?;
            if dtype != Dtype::F32 || m.padding.numel() > MAX_PROBE_ELEMENTS {
                return Err(ProtocolError::InvalidTensor(format!(
                    "probe padding must be at most {MAX_PROBE_ELEMENTS} f32 elements, got {} of {}",
                    m.padding.numel(),
                    dtype.name()
                )));
            }
            match bodies {
                Bodies::Verify => m.padding.verify(),
                Bodies::LeaveToDecode => Ok(()),
            }
        }
        ShardRequest::Timed(inner) => match **inner {
            ShardRequest::PushGrad(_)
            | ShardRequest::PushPull(_)
            | ShardRequest::PushPullMany(_)
            | ShardRequest::Probe(_) => check_request(inner, sender, ctx, bodies),
            ref other => Err(ProtocolError::InvalidField {
                field: "timed",
                reason: format!("{} is not a request that is timed", other.kind()),
            }),
        },
        ShardRequest::Undecodable { code, reason, .. } => {
            Err(ProtocolError::Undecodable { code: *code, reason: reason.clone() })
        }
    }
}

fn check_state(s: &crate::messages::ShardState, ctx: &ValidationContext, bodies: Bodies) -> Result<()> {
    ctx.check_run(&s.run)?;
    ctx.check_shard(s.shard)?;
    if let Some(d) = &s.delta {
        if d.base >= s.version {
            return Err(ProtocolError::InvalidField {
                field: "delta.base",
                reason: format!("an update to version {} from version {} (it must be older)", s.version, d.base),
            });
        }
    }
    // Pulls may ask for a compressed encoding, so any dtype is fine.
    ctx.check_payload(&s.params, s.shard, false, bodies)
}

/// Validates a response. Shard states must be f32 and pass checksum and
/// finiteness checks.
pub fn validate_response(resp: &ShardResponse, ctx: &ValidationContext) -> Result<()> {
    check_response(resp, ctx, Bodies::Verify)
}

/// [`validate_response`] without the pass over the tensor bodies, for a
/// requester that decodes the state next ([`Payload::decode`] checks the
/// checksum and finiteness as it copies), so each body is read once.
pub fn validate_response_fields(resp: &ShardResponse, ctx: &ValidationContext) -> Result<()> {
    check_response(resp, ctx, Bodies::LeaveToDecode)
}

fn check_response(resp: &ShardResponse, ctx: &ValidationContext, bodies: Bodies) -> Result<()> {
    match resp {
        ShardResponse::Accepted(a) => ctx.check_shard(a.shard),
        ShardResponse::Stale { shard, .. }
        | ShardResponse::NotOwner { shard, .. }
        | ShardResponse::NotReady { shard, .. }
        | ShardResponse::Fenced { shard, .. }
        | ShardResponse::HandoffAck { shard, .. } => ctx.check_shard(*shard),
        ShardResponse::ShardState(s) => check_state(s, ctx, bodies),
        ShardResponse::Exchanged(e) => {
            ctx.check_shard(e.accepted.shard)?;
            match &e.state {
                Some(s) if s.shard != e.accepted.shard => Err(ProtocolError::InvalidField {
                    field: "state.shard",
                    reason: format!("state of shard {} for a push to shard {}", s.shard, e.accepted.shard),
                }),
                Some(s) => check_state(s, ctx, bodies),
                None => Ok(()),
            }
        }
        ShardResponse::Manifest(m) => {
            ctx.check_run(&m.run)?;
            check_count("shards", m.shards.len(), MAX_MANIFEST_SHARDS)?;
            for s in &m.shards {
                ctx.check_shard(s.shard)?;
            }
            Ok(())
        }
        ShardResponse::Probed { .. } => Ok(()),
        ShardResponse::ExchangedMany(v) => {
            check_count("answers", v.len(), MAX_BATCH_SHARDS)?;
            for r in v {
                match r {
                    ShardResponse::ExchangedMany(_) => {
                        return Err(ProtocolError::InvalidField { field: "answers", reason: "nested batch".into() })
                    }
                    // A batch's answers are each what a PushPull alone gets.
                    ShardResponse::Timed { .. } => {
                        return Err(ProtocolError::InvalidField {
                            field: "answers",
                            reason: "timed answer in a batch".into(),
                        })
                    }
                    _ => {}
                }
                check_response(r, ctx, bodies)?;
            }
            Ok(())
        }
        ShardResponse::Timed { answer, .. } => {
            if let ShardResponse::Timed { .. } = **answer {
                return Err(ProtocolError::InvalidField { field: "answer", reason: "nested timed answer".into() });
            }
            check_response(answer, ctx, bodies)
        }
        ShardResponse::Error(e) => {
            if e.message.len() > MAX_ERROR_MESSAGE_LEN {
                return Err(ProtocolError::InvalidField {
                    field: "message",
                    reason: format!("longer than {MAX_ERROR_MESSAGE_LEN} bytes"),
                });
            }
            Ok(())
        }
    }
}

/// Validates a heartbeat whose gossip message was signed by `source`.
pub fn validate_heartbeat(hb: &Heartbeat, source: Option<&PeerId>, ctx: &ValidationContext) -> Result<()> {
    ctx.check_run(&hb.run)?;
    match source {
        Some(src) => check_sender(&hb.peer, src)?,
        None => {
            return Err(ProtocolError::InvalidField { field: "source", reason: "heartbeats must be signed".into() })
        }
    }
    check_count("owned_shards", hb.owned_shards.len(), MAX_OWNED_SHARDS)?;
    for &s in &hb.owned_shards {
        ctx.check_shard(s)?;
    }
    let leads = hb.shard_versions.leads.len();
    if leads != 0 && leads != ctx.num_shards as usize {
        return Err(ProtocolError::InvalidField {
            field: "shard_versions",
            reason: format!("{leads} versions for {} shards", ctx.num_shards),
        });
    }
    check_count("service", hb.service.len(), MAX_SERVICE_OBSERVATIONS)?;
    for (i, obs) in hb.service.iter().enumerate() {
        check_measure("service.micros_per_mib", i, obs.micros_per_mib)?;
    }
    check_measure("capabilities.compute_samples_per_sec", 0, hb.capabilities.compute_samples_per_sec)?;
    check_measure("capabilities.net_bytes_per_sec", 1, hb.capabilities.net_bytes_per_sec)?;
    if !(-2..=2).contains(&hb.pace.capacity_level) {
        return Err(ProtocolError::InvalidField {
            field: "pace.capacity_level",
            reason: format!("{} is outside -2..=2", hb.pace.capacity_level),
        });
    }
    if hb.pace.batch_permille > MAX_BATCH_PERMILLE {
        return Err(ProtocolError::InvalidField {
            field: "pace.batch_permille",
            reason: format!("{} is above {MAX_BATCH_PERMILLE}", hb.pace.batch_permille),
        });
    }
    check_count("checkpoints", hb.checkpoints.len(), MAX_CHECKPOINT_OFFERS)?;
    check_count("suspects", hb.suspects.len(), MAX_SUSPECTS)?;
    for offer in &hb.checkpoints {
        check_count("checkpoints.shards", offer.shards.len(), MAX_OFFER_BITSET_BYTES)?;
        for s in offer.shard_ids() {
            ctx.check_shard(s)?;
        }
    }
    if hb.pace.comm_micros > hb.pace.step_micros {
        return Err(ProtocolError::InvalidField {
            field: "pace.comm_micros",
            reason: format!("{} µs of communication in a {} µs step", hb.pace.comm_micros, hb.pace.step_micros),
        });
    }
    Ok(())
}

/// Validates any gossip message signed by `source`.
pub fn validate_gossip(msg: &GossipMessage, source: Option<&PeerId>, ctx: &ValidationContext) -> Result<()> {
    match msg {
        GossipMessage::Heartbeat(hb) => validate_heartbeat(hb, source, ctx),
        GossipMessage::Announce(a) => {
            ctx.check_run(a.run())?;
            let Some(src) = source else {
                return Err(ProtocolError::InvalidField {
                    field: "source",
                    reason: "announcements must be signed".into(),
                });
            };
            match a {
                Announcement::ShardVersion { shard, owner, .. } => {
                    ctx.check_shard(*shard)?;
                    check_sender(owner, src)
                }
                Announcement::Leaving { peer, .. } => check_sender(peer, src),
                Announcement::Checkpoint { .. } => Ok(()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::payload::Encoding;

    fn ctx() -> ValidationContext {
        ValidationContext::new(RunId::new("run-a").unwrap(), 4, Limits::default(), &Timeouts::default())
            .with_shard_numel(vec![3, 3, 3, 3])
    }

    fn push(worker: PeerId, values: &[f32]) -> PushGrad {
        PushGrad {
            run: RunId::new("run-a").unwrap(),
            shard: 1,
            epoch: 0,
            base_version: 0,
            worker,
            incarnation: 0,
            step: 0,
            samples: 8,
            grad: Payload::encode(values, Encoding::F32).unwrap(),
        }
    }

    /// The node validates fields only and leaves the body to the decode
    /// that copies it, so a body is read once; a corrupt body is still
    /// refused, by that decode.
    #[test]
    fn fields_only_validation_leaves_the_body_to_the_decode() {
        let me = PeerId::random();
        let mut m = push(me, &[1.0, 2.0, 3.0]);
        let mut body = m.grad.data().to_vec();
        body[0] ^= 0x40;
        m.grad.attach(bytes::Bytes::from(body));
        let req = ShardRequest::PushGrad(m.clone());
        assert!(matches!(validate_request(&req, &me, &ctx()), Err(ProtocolError::ChecksumMismatch { .. })));
        validate_request_fields(&req, &me, &ctx()).unwrap();
        assert!(matches!(m.grad.decode(), Err(ProtocolError::ChecksumMismatch { .. })));
        // The fields are still checked.
        let stranger = PeerId::random();
        assert!(matches!(validate_request_fields(&req, &stranger, &ctx()), Err(ProtocolError::SenderMismatch { .. })));
    }

    /// Responses get the same split: fields here, the body in the decode.
    #[test]
    fn response_fields_are_checked_and_the_body_left_to_the_decode() {
        let state = |shard: u32, values: &[f32]| crate::messages::ShardState {
            run: RunId::new("run-a").unwrap(),
            shard,
            version: 3,
            epoch: 0,
            params: Payload::encode(values, Encoding::F32).unwrap(),
            delta: None,
        };
        let good = ShardResponse::ShardState(state(1, &[1.0, 2.0, 3.0]));
        validate_response_fields(&good, &ctx()).unwrap();
        // A shard past the model's, a wrong size or another run is refused.
        let far = ShardResponse::ShardState(state(9, &[1.0, 2.0, 3.0]));
        assert!(matches!(
            validate_response_fields(&far, &ctx()),
            Err(ProtocolError::ShardOutOfRange { shard: 9, num_shards: 4 })
        ));
        let short = ShardResponse::ShardState(state(1, &[1.0, 2.0]));
        assert!(matches!(validate_response_fields(&short, &ctx()), Err(ProtocolError::InvalidTensor(_))));
        let mut other = state(1, &[1.0, 2.0, 3.0]);
        other.run = RunId::new("run-b").unwrap();
        assert!(matches!(
            validate_response_fields(&ShardResponse::ShardState(other), &ctx()),
            Err(ProtocolError::RunMismatch { found, .. }) if found == "run-b"
        ));
        // A delta from version 3 or later cannot lead to version 3.
        let mut delta = state(1, &[1.0, 2.0, 3.0]);
        delta.delta = Some(crate::messages::DeltaOf { base: 2, hash: 7 });
        validate_response_fields(&ShardResponse::ShardState(delta.clone()), &ctx()).unwrap();
        delta.delta = Some(crate::messages::DeltaOf { base: 3, hash: 7 });
        assert!(matches!(
            validate_response_fields(&ShardResponse::ShardState(delta), &ctx()),
            Err(ProtocolError::InvalidField { field: "delta.base", .. })
        ));
        let late = ShardResponse::NotReady { shard: 4, current_version: 0 };
        assert!(matches!(
            validate_response_fields(&late, &ctx()),
            Err(ProtocolError::ShardOutOfRange { shard: 4, .. })
        ));
        // A corrupt body passes the fields and is caught by the decode.
        let mut bad = state(1, &[1.0, 2.0, 3.0]);
        let mut body = bad.params.data().to_vec();
        body[0] ^= 0x40;
        bad.params.attach(bytes::Bytes::from(body));
        let resp = ShardResponse::ShardState(bad.clone());
        assert!(matches!(validate_response(&resp, &ctx()), Err(ProtocolError::ChecksumMismatch { .. })));
        validate_response_fields(&resp, &ctx()).unwrap();
        assert!(matches!(bad.params.decode(), Err(ProtocolError::ChecksumMismatch { .. })));
    }

    #[test]
    fn a_batch_is_checked_as_each_of_its_push_pulls_and_as_a_whole() {
        let me = PeerId::random();
        let one = |shard: u32, values: &[f32]| PushPull {
            push: PushGrad { shard, ..push(me, values) },
            max_wait_ms: 100,
            encoding: Encoding::F32,
            have: None,
        };
        let good = ShardRequest::PushPullMany(vec![one(0, &[1.0; 3]), one(2, &[2.0; 3])]);
        validate_request(&good, &me, &ctx()).unwrap();
        // Empty, a shard twice, one bad entry, or more than the most.
        let refused = |v: Vec<PushPull>| validate_request(&ShardRequest::PushPullMany(v), &me, &ctx());
        // The batch's own checks name the field and say what was wrong.
        let batch_refused = |v: Vec<PushPull>, why: &str| {
            let r = refused(v);
            matches!(r, Err(ProtocolError::InvalidField { field: "push_pulls", reason }) if reason.contains(why))
        };
        assert!(batch_refused(Vec::new(), "empty"));
        assert!(batch_refused(vec![one(2, &[1.0; 3]), one(2, &[2.0; 3])], "shard 2 twice"));
        assert!(matches!(
            refused(vec![one(0, &[1.0; 3]), one(1, &[2.0; 2])]),
            Err(ProtocolError::InvalidTensor(reason)) if reason.contains("shard 1")
        ));
        assert!(matches!(
            refused(vec![one(0, &[1.0; 3]), one(9, &[2.0; 3])]),
            Err(ProtocolError::ShardOutOfRange { shard: 9, .. })
        ));
        assert!(batch_refused((0..=MAX_BATCH_SHARDS as u32).map(|i| one(i % 4, &[1.0; 3])).collect(), "at most"));
        // Another sender's gradients are refused, as in a PushPull.
        assert!(matches!(
            validate_request(&good, &PeerId::random(), &ctx()),
            Err(ProtocolError::SenderMismatch { .. })
        ));

        let answers = |v: Vec<ShardResponse>| validate_response(&ShardResponse::ExchangedMany(v), &ctx());
        let accepted = |shard| ShardResponse::Accepted(Accepted { shard, version: 1, staleness: 0 });
        answers(vec![accepted(0), accepted(1)]).unwrap();
        assert!(matches!(
            answers(vec![accepted(0), accepted(7)]),
            Err(ProtocolError::ShardOutOfRange { shard: 7, .. })
        ));
        assert!(matches!(
            answers(vec![ShardResponse::ExchangedMany(vec![accepted(0)])]),
            Err(ProtocolError::InvalidField { field: "answers", reason }) if reason == "nested batch"
        ));
    }

    #[test]
    fn a_timed_request_is_checked_as_the_one_inside_and_wraps_only_what_is_timed() {
        let me = PeerId::random();
        let timed = |r: ShardRequest| ShardRequest::Timed(Box::new(r));
        let good = ShardRequest::PushPull(PushPull {
            push: push(me, &[1.0; 3]),
            max_wait_ms: 100,
            encoding: Encoding::F32,
            have: None,
        });
        validate_request(&timed(good.clone()), &me, &ctx()).unwrap();
        validate_request(&timed(ShardRequest::PushGrad(push(me, &[1.0; 3]))), &me, &ctx()).unwrap();
        // The inner request's own checks apply (another sender's gradient).
        assert!(matches!(
            validate_request(&timed(good.clone()), &PeerId::random(), &ctx()),
            Err(ProtocolError::SenderMismatch { .. })
        ));
        // Not around a request the detector does not time, nor another Timed.
        let pull = ShardRequest::PullShard(PullShard {
            run: RunId::new("run-a").unwrap(),
            shard: 1,
            min_version: 0,
            max_wait_ms: 0,
            encoding: Encoding::F32,
            have: None,
        });
        assert!(matches!(
            validate_request(&timed(pull), &me, &ctx()),
            Err(ProtocolError::InvalidField { field: "timed", reason }) if reason.starts_with("pull_shard")
        ));
        assert!(matches!(
            validate_request(&timed(timed(good)), &me, &ctx()),
            Err(ProtocolError::InvalidField { field: "timed", reason }) if reason.starts_with("timed")
        ));

        let accepted = ShardResponse::Accepted(Accepted { shard: 1, version: 1, staleness: 0 });
        let answer = |a: ShardResponse| ShardResponse::Timed { service_us: 250, answer: Box::new(a) };
        validate_response(&answer(accepted.clone()), &ctx()).unwrap();
        validate_response(&answer(ShardResponse::ExchangedMany(vec![accepted.clone()])), &ctx()).unwrap();
        let in_batch = ShardResponse::ExchangedMany(vec![answer(accepted.clone())]);
        assert!(matches!(
            validate_response(&in_batch, &ctx()),
            Err(ProtocolError::InvalidField { field: "answers", reason }) if reason.contains("timed")
        ));
        assert!(matches!(
            validate_response(&answer(answer(accepted)), &ctx()),
            Err(ProtocolError::InvalidField { field: "answer", .. })
        ));
        let far = ShardResponse::Accepted(Accepted { shard: 9, version: 1, staleness: 0 });
        assert!(matches!(
            validate_response(&answer(far), &ctx()),
            Err(ProtocolError::ShardOutOfRange { shard: 9, .. })
        ));
    }

    #[test]
    fn accepts_a_good_push() {
        let me = PeerId::random();
        validate_request(&ShardRequest::PushGrad(push(me, &[1.0, 2.0, 3.0])), &me, &ctx()).unwrap();
    }

    #[test]
    fn rejects_wrong_run_shard_sender_and_size() {
        let me = PeerId::random();
        let mut m = push(me, &[1.0, 2.0, 3.0]);
        m.run = RunId::new("run-b").unwrap();
        assert!(matches!(
            validate_request(&ShardRequest::PushGrad(m), &me, &ctx()),
            Err(ProtocolError::RunMismatch { .. })
        ));
        let mut m = push(me, &[1.0, 2.0, 3.0]);
        m.shard = 4;
        assert!(matches!(
            validate_request(&ShardRequest::PushGrad(m), &me, &ctx()),
            Err(ProtocolError::ShardOutOfRange { shard: 4, num_shards: 4 })
        ));
        let m = push(PeerId::random(), &[1.0, 2.0, 3.0]);
        assert!(matches!(
            validate_request(&ShardRequest::PushGrad(m), &me, &ctx()),
            Err(ProtocolError::SenderMismatch { .. })
        ));
        let m = push(me, &[1.0, 2.0]);
        assert!(matches!(
            validate_request(&ShardRequest::PushGrad(m), &me, &ctx()),
            Err(ProtocolError::InvalidTensor(_))
        ));
        let mut m = push(me, &[1.0, 2.0, 3.0]);
        m.samples = 0;
        assert!(matches!(
            validate_request(&ShardRequest::PushGrad(m), &me, &ctx()),
            Err(ProtocolError::InvalidField { field: "samples", .. })
        ));
    }

    #[test]
    fn rejects_nan_in_payload() {
        let me = PeerId::random();
        let mut body = Vec::new();
        for v in [1.0f32, f32::INFINITY, 3.0] {
            body.extend_from_slice(&v.to_le_bytes());
        }
        let meta = crate::payload::TensorMeta {
            dtype: 0,
            block: 0,
            shape: vec![3],
            numel: 3,
            nnz: 3,
            byte_len: 12,
            checksum: crate::payload::checksum(&body),
        };
        let mut m = push(me, &[0.0; 3]);
        m.grad = Payload::from_parts(meta, body.into(), 10).unwrap();
        let err = validate_request(&ShardRequest::PushGrad(m), &me, &ctx()).unwrap_err();
        assert!(matches!(err, ProtocolError::NonFinite { index: 1, .. }), "{err}");
        assert_eq!(err.code(), ErrorCode::NonFinite);
    }

    #[test]
    fn heartbeat_must_be_signed_by_its_peer() {
        let me = PeerId::random();
        let hb = Heartbeat {
            run: RunId::new("run-a").unwrap(),
            peer: me,
            incarnation: 1,
            seq: 1,
            epoch: 0,
            config_hash: 0,
            protocol_version: WIRE_VERSION,
            capabilities: Capabilities {
                device: Device::Cpu,
                memory_bytes: 1,
                compute_samples_per_sec: 1.0,
                net_bytes_per_sec: 1.0,
                can_aggregate: true,
            },
            role: Role::Worker,
            owned_shards: vec![0, 3],
            step: 0,
            model_version: 0,
            shard_versions: ShardVersions::of(&[5, 6, 5, 5]),
            service: vec![],
            pace: Pace {
                step_micros: 1000,
                comm_micros: 400,
                aggregators: 2,
                capacity_level: -1,
                batch_permille: 1000,
            },
            checkpoints: vec![],
            suspects: vec![PeerId::random()],
            finished: true,
        };
        validate_heartbeat(&hb, Some(&me), &ctx()).unwrap();
        assert!(matches!(
            validate_heartbeat(&hb, Some(&PeerId::random()), &ctx()),
            Err(ProtocolError::SenderMismatch { .. })
        ));
        assert!(matches!(
            validate_heartbeat(&hb, None, &ctx()),
            Err(ProtocolError::InvalidField { field: "source", .. })
        ));
        let mut bad = hb.clone();
        bad.owned_shards.push(9);
        assert!(matches!(validate_heartbeat(&bad, Some(&me), &ctx()), Err(ProtocolError::ShardOutOfRange { .. })));
        let mut bad = hb.clone();
        bad.pace.comm_micros = 1001;
        assert!(matches!(
            validate_heartbeat(&bad, Some(&me), &ctx()),
            Err(ProtocolError::InvalidField { field: "pace.comm_micros", .. })
        ));
        let mut bad = hb.clone();
        bad.pace.capacity_level = 3;
        assert!(matches!(
            validate_heartbeat(&bad, Some(&me), &ctx()),
            Err(ProtocolError::InvalidField { field: "pace.capacity_level", .. })
        ));
        let mut bad = hb.clone();
        bad.pace.batch_permille = MAX_BATCH_PERMILLE + 1;
        assert!(matches!(
            validate_heartbeat(&bad, Some(&me), &ctx()),
            Err(ProtocolError::InvalidField { field: "pace.batch_permille", .. })
        ));
        let mut ok = hb.clone();
        ok.checkpoints = vec![CheckpointOffer::new(40, 40, [0, 2])];
        assert!(validate_heartbeat(&ok, Some(&me), &ctx()).is_ok());
        assert_eq!(ok.checkpoints[0].shard_ids(), vec![0, 2]);
        let mut bad = hb.clone();
        bad.checkpoints = vec![CheckpointOffer::new(40, 40, [9])];
        assert!(matches!(validate_heartbeat(&bad, Some(&me), &ctx()), Err(ProtocolError::ShardOutOfRange { .. })));
        let mut bad = hb.clone();
        bad.checkpoints = vec![CheckpointOffer::default(); MAX_CHECKPOINT_OFFERS + 1];
        assert!(matches!(
            validate_heartbeat(&bad, Some(&me), &ctx()),
            Err(ProtocolError::InvalidField { field: "checkpoints", .. })
        ));
        let mut bad = hb.clone();
        bad.shard_versions.leads.pop();
        assert!(matches!(
            validate_heartbeat(&bad, Some(&me), &ctx()),
            Err(ProtocolError::InvalidField { field: "shard_versions", .. })
        ));
        let mut ok = hb.clone();
        ok.shard_versions = ShardVersions::default();
        assert!(validate_heartbeat(&ok, Some(&me), &ctx()).is_ok(), "no versions: a node that does not train");
        let mut bad = hb.clone();
        bad.suspects = vec![PeerId::random(); MAX_SUSPECTS + 1];
        assert!(matches!(
            validate_heartbeat(&bad, Some(&me), &ctx()),
            Err(ProtocolError::InvalidField { field: "suspects", .. })
        ));
        let mut bad = hb;
        bad.capabilities.net_bytes_per_sec = f32::NAN;
        assert!(matches!(validate_heartbeat(&bad, Some(&me), &ctx()), Err(ProtocolError::NonFinite { .. })));
    }
}
