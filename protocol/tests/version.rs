//! One wire version: a peer that speaks another one is refused before any
//! frame (multistream-select finds no shared shard protocol), and identify,
//! the earliest point where its version is known, names both versions.
//! Two swarms on loopback TCP; a peer of our version is the positive control.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use futures::StreamExt;
use shoal_protocol::libp2p::request_response::{self, OutboundFailure, ProtocolSupport};
use shoal_protocol::libp2p::swarm::{NetworkBehaviour, SwarmEvent};
use shoal_protocol::libp2p::{identify, noise, tcp, yamux, PeerId, StreamProtocol, Swarm, SwarmBuilder};
use shoal_protocol::*;
use tokio::sync::mpsc;

/// What a peer of another wire version runs: the shard protocol and
/// identify, under that version's names.
#[derive(NetworkBehaviour)]
#[behaviour(prelude = "shoal_protocol::libp2p::swarm::derive_prelude")]
struct OtherVersion {
    identify: identify::Behaviour,
    shard: request_response::Behaviour<ShardCodec>,
}

fn other_version_swarm(theirs: u16) -> Swarm<OtherVersion> {
    let shard_protocol = StreamProtocol::try_from_owned(format!("/shoal/shard/{theirs}.0.0")).unwrap();
    SwarmBuilder::with_new_identity()
        .with_tokio()
        .with_tcp(tcp::Config::default(), noise::Config::new, yamux::Config::default)
        .unwrap()
        .with_behaviour(|key| OtherVersion {
            identify: identify::Behaviour::new(identify::Config::new(format!("/shoal/{theirs}.0.0"), key.public())),
            shard: request_response::Behaviour::with_codec(
                ShardCodec::default(),
                [(shard_protocol, ProtocolSupport::Full)],
                request_response::Config::default(),
            ),
        })
        .unwrap()
        // The connection must outlive the failed request, for identify.
        .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(60)))
        .build()
}

fn manifest_req() -> ShardRequest {
    ShardRequest::Manifest(ManifestRequest { run: run() })
}

/// What the server saw: each peer's identify verdict, and each request.
#[derive(Debug)]
enum Seen {
    Identified(PeerId, Result<(), ProtocolError>),
    Request(PeerId),
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_of_another_version_is_refused_and_named() {
    let mut server = swarm(&config("/ip4/127.0.0.1/tcp/0"));
    let server_id = *server.local_peer_id();
    let addr = tokio::time::timeout(WAIT, listen_addr(&mut server)).await.unwrap();
    let (seen_tx, mut seen) = mpsc::channel(16);
    let task = tokio::spawn(async move {
        loop {
            let event = match server.select_next_some().await {
                SwarmEvent::Behaviour(ShoalBehaviourEvent::Identify(identify::Event::Received {
                    peer_id,
                    info,
                    ..
                })) => Seen::Identified(peer_id, check_peer_version(&info.protocol_version)),
                SwarmEvent::Behaviour(ShoalBehaviourEvent::Shard(request_response::Event::Message {
                    peer,
                    message: request_response::Message::Request { channel, .. },
                    ..
                })) => {
                    let reply = ShardResponse::Manifest(Manifest {
                        run: run(),
                        config_hash: 0,
                        epoch: 0,
                        step: 0,
                        shards: vec![],
                    });
                    let _ = server.behaviour_mut().shard.send_response(channel, reply);
                    Seen::Request(peer)
                }
                _ => continue,
            };
            if seen_tx.send(event).await.is_err() {
                return;
            }
        }
    });

    // A peer of the next version: its shard protocol is not ours, so the
    // request fails in the negotiation and never reaches the handler.
    let theirs = WIRE_VERSION + 1;
    let mut other = other_version_swarm(theirs);
    let other_id = *other.local_peer_id();
    let id = other.behaviour_mut().shard.send_request_with_addresses(&server_id, manifest_req(), vec![addr.clone()]);
    let failure = tokio::time::timeout(WAIT, async {
        loop {
            if let SwarmEvent::Behaviour(OtherVersionEvent::Shard(request_response::Event::OutboundFailure {
                request_id,
                error,
                ..
            })) = other.select_next_some().await
            {
                if request_id == id {
                    return error;
                }
            }
        }
    })
    .await
    .unwrap();
    assert!(matches!(failure, OutboundFailure::UnsupportedProtocols), "{failure:?}");

    // Identify tells the server which version the peer speaks; the verdict
    // names both. The other swarm is polled meanwhile, to answer identify.
    let verdict = tokio::time::timeout(WAIT, async {
        loop {
            tokio::select! {
                _ = other.select_next_some() => {}
                seen = seen.recv() => match seen.unwrap() {
                    Seen::Identified(peer, verdict) if peer == other_id => return verdict,
                    Seen::Request(peer) => panic!("the handler saw a request from {peer}"),
                    Seen::Identified(..) => {}
                },
            }
        }
    })
    .await
    .unwrap();
    let err = verdict.unwrap_err();
    assert!(matches!(err, ProtocolError::VersionMismatch { ours: WIRE_VERSION, theirs: t } if t == theirs), "{err}");
    let text = err.to_string();
    assert!(text.contains(&format!("version {theirs}")) && text.contains(&format!("version {WIRE_VERSION}")), "{text}");

    // Positive control: a peer of our version passes identify and is served.
    let mut same = swarm(&config(""));
    let same_id = *same.local_peer_id();
    let outcome = tokio::time::timeout(WAIT, request(&mut same, server_id, addr, manifest_req())).await.unwrap();
    assert!(matches!(outcome, Outcome::Response(ShardResponse::Manifest(_))), "{outcome:?}");
    let (mut identified, mut served) = (false, false);
    tokio::time::timeout(WAIT, async {
        while !(identified && served) {
            tokio::select! {
                _ = same.select_next_some() => {}
                seen = seen.recv() => match seen.unwrap() {
                    Seen::Identified(peer, verdict) if peer == same_id => {
                        verdict.unwrap();
                        identified = true;
                    }
                    Seen::Request(peer) => {
                        assert_eq!(peer, same_id, "only the peer of our version is served");
                        served = true;
                    }
                    Seen::Identified(..) => {}
                },
            }
        }
    })
    .await
    .unwrap();
    task.abort();
}
