//! Eight swarms in one process see each other's heartbeats through
//! gossipsub. They are connected in a ring (each dials the next), so most
//! heartbeats reach their receivers only by being validated and forwarded
//! by intermediate nodes.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use common::*;
use futures::StreamExt;
use shoal_protocol::libp2p::gossipsub;
use shoal_protocol::libp2p::identity::Keypair;
use shoal_protocol::libp2p::swarm::SwarmEvent;
use shoal_protocol::libp2p::PeerId;
use shoal_protocol::*;
use tokio::sync::mpsc;

const NODES: usize = 8;

fn heartbeat(peer: PeerId, seq: u64) -> GossipMessage {
    GossipMessage::Heartbeat(Heartbeat {
        run: run(),
        peer,
        incarnation: 1,
        seq,
        epoch: 0,
        config_hash: 0xfeed,
        protocol_version: WIRE_VERSION,
        capabilities: Capabilities {
            device: Device::Cpu,
            memory_bytes: 1 << 30,
            compute_samples_per_sec: 1000.0,
            net_bytes_per_sec: 1e8,
            can_aggregate: true,
        },
        role: Role::Worker,
        owned_shards: vec![],
        step: seq,
        model_version: 0,
        shard_versions: ShardVersions::default(),
        service: vec![],
        pace: Pace::default(),
        checkpoints: vec![],
        suspects: vec![],
        finished: false,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_swarms_see_each_others_heartbeats() {
    let cfg = config("/ip4/127.0.0.1/tcp/0");
    let mut swarms = Vec::new();
    let mut addrs = Vec::new();
    for _ in 0..NODES {
        let key = Keypair::generate_ed25519();
        let signer = frame::GossipSigner::new(&key).unwrap();
        let mut s = build_swarm(&cfg, key).unwrap();
        addrs.push(tokio::time::timeout(WAIT, listen_addr(&mut s)).await.unwrap());
        swarms.push((s, signer));
    }
    let ids: Vec<PeerId> = swarms.iter().map(|(s, _)| *s.local_peer_id()).collect();
    for (i, (s, _)) in swarms.iter_mut().enumerate() {
        s.dial(addrs[(i + 1) % NODES].clone()).unwrap();
    }

    // Each node reports (receiver, sender) for every valid heartbeat it gets.
    let (tx, mut rx) = mpsc::channel::<(PeerId, PeerId)>(4096);
    let mut tasks = Vec::new();
    for (mut s, signer) in swarms {
        let tx = tx.clone();
        let cfg = cfg.clone();
        tasks.push(tokio::spawn(async move {
            let me = *s.local_peer_id();
            let topic = membership_topic(&cfg.run_id);
            let ctx = ValidationContext::new(cfg.run_id.clone(), 16, cfg.limits.clone(), &cfg.timeouts);
            // Publish on an interval until the test ends: gossipsub needs
            // subscriptions exchanged and a mesh before delivery.
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            let mut seq = 0;
            loop {
                tokio::select! {
                    _ = tick.tick() => {
                        seq += 1;
                        // Fails with InsufficientPeers until subscriptions are known.
                        let _ = s.behaviour_mut().publish(&topic, &heartbeat(me, seq), &signer, &cfg.limits);
                    }
                    ev = s.select_next_some() => {
                        if let SwarmEvent::Behaviour(ShoalBehaviourEvent::Gossipsub(gossipsub::Event::Message {
                            propagation_source, message_id, message,
                        })) = ev {
                            // Gossipsub's envelope is anonymous: the signer is Shoal's.
                            assert_eq!(message.source, None);
                            let verdict = frame::decode_gossip(&message.data, &cfg.limits).and_then(|m| {
                                validate_gossip(&m.message, Some(&m.signer), &ctx).map(|()| m.message)
                            });
                            s.behaviour_mut().report_gossip(&message_id, &propagation_source, verdict.is_ok());
                            if let Ok(GossipMessage::Heartbeat(hb)) = verdict {
                                let _ = tx.try_send((me, hb.peer));
                            }
                        }
                    }
                }
            }
        }));
    }
    drop(tx);

    let mut seen: HashMap<PeerId, HashSet<PeerId>> = HashMap::new();
    let all_seen = async {
        while let Some((receiver, sender)) = rx.recv().await {
            assert_ne!(receiver, sender, "a node received its own heartbeat");
            seen.entry(receiver).or_default().insert(sender);
            if ids.iter().all(|id| seen.get(id).is_some_and(|s| s.len() == NODES - 1)) {
                return;
            }
        }
    };
    let done = tokio::time::timeout(WAIT, all_seen).await;
    for t in &tasks {
        t.abort();
    }
    let counts: Vec<usize> = ids.iter().map(|id| seen.get(id).map_or(0, |s| s.len())).collect();
    assert!(done.is_ok(), "not every node heard from all {} others: {counts:?}", NODES - 1);
}
