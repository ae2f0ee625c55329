//! Strategies that build every wire message with arbitrary fields: the
//! property tests round-trip them and the fuzz run mutates their frames.
#![allow(dead_code, clippy::unwrap_used)]

use proptest::prelude::*;
use shoal_protocol::libp2p::identity::Keypair;
use shoal_protocol::libp2p::PeerId;
use shoal_protocol::*;

pub fn run_id() -> impl Strategy<Value = RunId> {
    "[A-Za-z0-9._-]{1,20}".prop_map(|s| RunId::new(s).unwrap())
}

pub fn peer() -> impl Strategy<Value = PeerId> {
    any::<[u8; 32]>().prop_map(|mut b| Keypair::ed25519_from_bytes(&mut b).unwrap().public().to_peer_id())
}

pub fn encoding() -> impl Strategy<Value = Encoding> {
    prop_oneof![
        Just(Encoding::F32),
        Just(Encoding::F16),
        Just(Encoding::Bf16),
        (1u32..64).prop_map(|block| Encoding::Int8 { block }),
        (0u64..40).prop_map(|k| Encoding::TopK { k }),
        (1u32..80, 0u32..12).prop_map(|(chunk, k)| Encoding::Sparse2 { chunk, k }),
    ]
}

pub fn payload() -> impl Strategy<Value = Payload> {
    prop_oneof![
        4 => (proptest::collection::vec(-1000.0f32..1000.0, 0..200), encoding())
            .prop_map(|(v, e)| Payload::encode(&v, e).unwrap()),
        1 => factored_payload(),
    ]
}

/// A factors payload: entries, one `rows x cols` block of one term, more
/// entries.
pub fn factored_payload() -> impl Strategy<Value = Payload> {
    (
        proptest::collection::vec(-1000.0f32..1000.0, 0..60),
        3usize..9,
        3usize..9,
        proptest::collection::vec(-30.0f32..30.0, 16),
        proptest::collection::vec(-1000.0f32..1000.0, 0..20),
    )
        .prop_map(|(head, rows, cols, f, tail)| {
            let left: Vec<f32> = (0..rows).map(|i| f[i % 16]).collect();
            let right: Vec<f32> = (0..cols).map(|i| f[(i + 7) % 16]).collect();
            let start = head.len();
            let mut values = head;
            values.resize(start + rows * cols, 0.0);
            values.extend(tail);
            let block = FactorBlock { start, rows, cols, left: &left, right: &right };
            Payload::encode_factored(&values, &[block]).unwrap()
        })
}

pub fn f32_payload() -> impl Strategy<Value = Payload> {
    proptest::collection::vec(-1000.0f32..1000.0, 0..200).prop_map(|v| Payload::encode(&v, Encoding::F32).unwrap())
}

pub fn push_grad() -> impl Strategy<Value = PushGrad> {
    (run_id(), any::<u32>(), any::<u64>(), any::<u64>(), peer(), any::<u64>(), any::<u64>(), any::<u32>(), payload())
        .prop_map(|(run, shard, epoch, base_version, worker, incarnation, step, samples, grad)| PushGrad {
            run,
            shard,
            epoch,
            base_version,
            worker,
            incarnation,
            step,
            samples,
            grad,
        })
}

pub fn request() -> impl Strategy<Value = ShardRequest> {
    let push = push_grad().prop_map(ShardRequest::PushGrad);
    let pull = (run_id(), any::<u32>(), any::<u64>(), any::<u32>(), encoding(), proptest::option::of(any::<u64>()))
        .prop_map(|(run, shard, min_version, max_wait_ms, encoding, have)| {
            ShardRequest::PullShard(PullShard { run, shard, min_version, max_wait_ms, encoding, have })
        });
    let slot = ("[a-z]{1,8}", f32_payload()).prop_map(|(name, tensor)| OptimizerSlot { name, tensor });
    let handoff = (
        run_id(),
        any::<u32>(),
        any::<u64>(),
        prop_oneof![Just(HandoffKind::Transfer), Just(HandoffKind::Replica)],
        peer(),
        any::<u64>(),
        any::<u64>(),
        f32_payload(),
        ("[a-z]{1,8}", any::<u64>(), proptest::collection::vec(slot, 0..3), any::<u64>()),
    )
        .prop_map(|(run, shard, hops, kind, from, from_incarnation, version, params, (k, step, slots, room))| {
            ShardRequest::Handoff(Handoff {
                run,
                shard,
                hops,
                kind,
                from,
                from_incarnation,
                version,
                params,
                optimizer: OptimizerState { kind: k, step, slots },
                catch_up_room: room,
            })
        });
    let sync = (run_id(), any::<u32>(), any::<u64>())
        .prop_map(|(run, shard, min_version)| ShardRequest::StateSync(StateSync { run, shard, min_version }));
    let manifest = run_id().prop_map(|run| ShardRequest::Manifest(ManifestRequest { run }));
    let push_pull = (push_grad(), any::<u32>(), encoding(), proptest::option::of(any::<u64>())).prop_map(
        |(push, max_wait_ms, encoding, have)| ShardRequest::PushPull(PushPull { push, max_wait_ms, encoding, have }),
    );
    let probe = (run_id(), f32_payload()).prop_map(|(run, padding)| ShardRequest::Probe(Probe { run, padding }));
    let many =
        proptest::collection::vec((push_grad(), any::<u32>(), encoding(), proptest::option::of(any::<u64>())), 0..4)
            .prop_map(|v| {
                ShardRequest::PushPullMany(
                    v.into_iter()
                        .map(|(push, max_wait_ms, encoding, have)| PushPull { push, max_wait_ms, encoding, have })
                        .collect(),
                )
            });
    let untimed = prop_oneof![push, pull, handoff, sync, manifest, push_pull, probe, many];
    prop_oneof![
        4 => untimed.clone(),
        1 => untimed.prop_map(|r| ShardRequest::Timed(Box::new(r))),
    ]
}

/// A shard state's delta marker: none (a whole shard) or an update's base and hash.
fn delta_of() -> impl Strategy<Value = Option<DeltaOf>> {
    proptest::option::of((any::<u64>(), any::<u64>()).prop_map(|(base, hash)| DeltaOf { base, hash }))
}

pub fn response() -> impl Strategy<Value = ShardResponse> {
    let untimed = prop_oneof![
        4 => single_response(),
        1 => proptest::collection::vec(single_response(), 0..4).prop_map(ShardResponse::ExchangedMany),
    ];
    prop_oneof![
        4 => untimed.clone(),
        1 => (any::<u32>(), untimed)
            .prop_map(|(service_us, answer)| ShardResponse::Timed { service_us, answer: Box::new(answer) }),
    ]
}

fn single_response() -> impl Strategy<Value = ShardResponse> {
    let code = prop_oneof![
        Just(ErrorCode::InvalidRequest),
        Just(ErrorCode::UnsupportedVersion),
        Just(ErrorCode::RunMismatch),
        Just(ErrorCode::NonFinite),
        Just(ErrorCode::Busy),
        Just(ErrorCode::Internal),
    ];
    let summary = (any::<u32>(), any::<u64>(), any::<u64>(), proptest::option::of(peer()))
        .prop_map(|(shard, version, numel, owner)| ShardSummary { shard, version, numel, owner });
    prop_oneof![
        (any::<u32>(), any::<u64>(), any::<u64>()).prop_map(|(shard, version, staleness)| {
            ShardResponse::Accepted(Accepted { shard, version, staleness })
        }),
        (any::<u32>(), any::<u64>(), any::<u64>()).prop_map(|(shard, current_version, max_staleness)| {
            ShardResponse::Stale { shard, current_version, max_staleness }
        }),
        (any::<u32>(), any::<u64>(), proptest::option::of(peer()))
            .prop_map(|(shard, epoch, hint)| ShardResponse::NotOwner { shard, epoch, hint }),
        (any::<u32>(), any::<u64>())
            .prop_map(|(shard, current_version)| ShardResponse::NotReady { shard, current_version }),
        (any::<u32>(), any::<u64>()).prop_map(|(shard, epoch)| ShardResponse::Fenced { shard, epoch }),
        (run_id(), any::<u32>(), any::<u64>(), any::<u64>(), payload(), delta_of()).prop_map(
            |(run, shard, version, epoch, params, delta)| {
                ShardResponse::ShardState(ShardState { run, shard, version, epoch, params, delta })
            }
        ),
        (any::<u32>(), any::<u64>()).prop_map(|(shard, version)| ShardResponse::HandoffAck { shard, version }),
        (run_id(), any::<u64>(), any::<u64>(), any::<u64>(), proptest::collection::vec(summary, 0..5)).prop_map(
            |(run, config_hash, epoch, step, shards)| {
                ShardResponse::Manifest(Manifest { run, config_hash, epoch, step, shards })
            }
        ),
        (code, ".{0,40}").prop_map(|(code, m)| ShardResponse::Error(WireError::new(code, m))),
        (
            (any::<u32>(), any::<u64>(), any::<u64>(), any::<u32>()),
            proptest::option::of((run_id(), any::<u64>(), any::<u64>(), payload(), delta_of()))
        )
            .prop_map(|((shard, version, staleness, held_ms), state)| {
                ShardResponse::Exchanged(Exchanged {
                    accepted: Accepted { shard, version, staleness },
                    held_ms,
                    state: state.map(|(run, v, epoch, params, delta)| ShardState {
                        run,
                        shard,
                        version: v,
                        epoch,
                        params,
                        delta,
                    }),
                })
            }),
        any::<u64>().prop_map(|bytes| ShardResponse::Probed { bytes }),
    ]
}

pub fn gossip() -> impl Strategy<Value = GossipMessage> {
    let obs = (peer(), 0.0f32..1e9, any::<u32>()).prop_map(|(owner, micros_per_mib, samples)| ServiceObservation {
        owner,
        micros_per_mib,
        samples,
    });
    let hb = (
        (run_id(), peer(), any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>(), any::<u16>()),
        (
            prop_oneof![Just(Device::Cpu), Just(Device::Cuda), Just(Device::Metal), Just(Device::Other)],
            any::<u64>(),
            0.0f32..1e9,
            0.0f32..1e12,
            any::<bool>(),
        ),
        prop_oneof![Just(Role::Worker), Just(Role::Aggregator), Just(Role::Joining), Just(Role::Leaving)],
        proptest::collection::vec(any::<u32>(), 0..20),
        any::<u64>(),
        any::<u64>(),
        proptest::collection::vec(obs, 0..5),
        (any::<u32>(), any::<u32>(), any::<u16>(), any::<i8>(), any::<u16>()).prop_map(
            |(step_micros, comm_micros, aggregators, capacity_level, batch_permille)| Pace {
                step_micros,
                comm_micros,
                aggregators,
                capacity_level,
                batch_permille,
            },
        ),
    )
        .prop_map(
            |(
                (run, peer, incarnation, seq, epoch, config_hash, protocol_version),
                caps,
                role,
                owned_shards,
                step,
                model_version,
                service,
                pace,
            )| {
                GossipMessage::Heartbeat(Heartbeat {
                    run,
                    peer,
                    incarnation,
                    seq,
                    epoch,
                    config_hash,
                    protocol_version,
                    capabilities: Capabilities {
                        device: caps.0,
                        memory_bytes: caps.1,
                        compute_samples_per_sec: caps.2,
                        net_bytes_per_sec: caps.3,
                        can_aggregate: caps.4,
                    },
                    role,
                    owned_shards,
                    step,
                    model_version,
                    shard_versions: ShardVersions::of(&[model_version, model_version.saturating_add(1)]),
                    service: service.clone(),
                    pace,
                    checkpoints: vec![CheckpointOffer::new(model_version, step, [0, 3])],
                    suspects: service.iter().map(|o| o.owner).collect(),
                    finished: step % 2 == 1,
                })
            },
        );
    let ann = prop_oneof![
        (run_id(), any::<u32>(), any::<u64>(), any::<u64>(), peer()).prop_map(|(run, shard, version, epoch, owner)| {
            Announcement::ShardVersion { run, shard, version, epoch, owner }
        }),
        (run_id(), peer(), any::<u64>())
            .prop_map(|(run, peer, incarnation)| { Announcement::Leaving { run, peer, incarnation } }),
        (run_id(), any::<u64>(), any::<u64>(), any::<u64>())
            .prop_map(|(run, step, version, params_hash)| Announcement::Checkpoint { run, step, version, params_hash }),
    ]
    .prop_map(GossipMessage::Announce);
    prop_oneof![hb, ann]
}
