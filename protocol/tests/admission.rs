//! Admission control: a peer outside the allowlist, or with the wrong pnet
//! key, cannot get a request served. Each case has a positive control (an
//! admitted peer is served) so the test can fail.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::*;
use futures::StreamExt;
use shoal_protocol::libp2p::identity::Keypair;
use shoal_protocol::libp2p::request_response;
use shoal_protocol::libp2p::swarm::SwarmEvent;
use shoal_protocol::libp2p::{Multiaddr, PeerId};
use shoal_protocol::*;

fn manifest_req() -> ShardRequest {
    ShardRequest::Manifest(ManifestRequest { run: run() })
}

/// Starts a server that answers every request with an empty manifest and
/// counts the requests its handler saw.
async fn serve(cfg: ProtocolConfig) -> (PeerId, Multiaddr, Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
    let mut server = build_swarm(&cfg, Keypair::generate_ed25519()).unwrap();
    let id = *server.local_peer_id();
    let addr = tokio::time::timeout(WAIT, listen_addr(&mut server)).await.unwrap();
    let seen = Arc::new(AtomicUsize::new(0));
    let seen2 = seen.clone();
    let task = tokio::spawn(async move {
        loop {
            if let SwarmEvent::Behaviour(ShoalBehaviourEvent::Shard(request_response::Event::Message {
                message: request_response::Message::Request { channel, .. },
                ..
            })) = server.select_next_some().await
            {
                seen2.fetch_add(1, Ordering::SeqCst);
                let reply =
                    ShardResponse::Manifest(Manifest { run: run(), config_hash: 0, epoch: 0, step: 0, shards: vec![] });
                let _ = server.behaviour_mut().shard.send_response(channel, reply);
            }
        }
    });
    (id, addr, seen, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_outside_allowlist_is_not_served() {
    let friend_key = Keypair::generate_ed25519();
    let friend_id = friend_key.public().to_peer_id();
    let mut server_cfg = config("/ip4/127.0.0.1/tcp/0");
    server_cfg.admission.allowlist = Some(vec![friend_id]);
    let (server_id, addr, seen, task) = serve(server_cfg).await;

    // Stranger: refused after the handshake, request never reaches the handler.
    let mut stranger = swarm(&config(""));
    let outcome =
        tokio::time::timeout(WAIT, request(&mut stranger, server_id, addr.clone(), manifest_req())).await.unwrap();
    assert!(matches!(outcome, Outcome::Failed(_)), "stranger was served: {outcome:?}");
    assert_eq!(seen.load(Ordering::SeqCst), 0, "server handler saw the stranger's request");

    // Positive control: the allowlisted peer is served.
    let mut friend = build_swarm(&config(""), friend_key).unwrap();
    let outcome = tokio::time::timeout(WAIT, request(&mut friend, server_id, addr, manifest_req())).await.unwrap();
    assert!(matches!(outcome, Outcome::Response(ShardResponse::Manifest(_))), "friend not served: {outcome:?}");
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    task.abort();
}

fn pnet_config(listen: &str, key: u8) -> ProtocolConfig {
    let mut cfg = config(listen);
    cfg.quic = false;
    cfg.admission.psk = Some(Admission::psk_hex(&[key; 32]));
    // A wrong key turns the handshake into garbage that usually just stalls
    // until the handshake deadline; keep that short here.
    cfg.timeouts.handshake_ms = 2000;
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_with_wrong_pnet_key_is_not_served() {
    let (server_id, addr, seen, task) = serve(pnet_config("/ip4/127.0.0.1/tcp/0", 1)).await;

    let mut wrong = swarm(&pnet_config("", 2));
    let outcome =
        tokio::time::timeout(WAIT, request(&mut wrong, server_id, addr.clone(), manifest_req())).await.unwrap();
    assert!(matches!(outcome, Outcome::Failed(_)), "wrong key was served: {outcome:?}");

    let mut none = swarm(&config(""));
    let outcome =
        tokio::time::timeout(WAIT, request(&mut none, server_id, addr.clone(), manifest_req())).await.unwrap();
    assert!(matches!(outcome, Outcome::Failed(_)), "peer without pnet was served: {outcome:?}");
    assert_eq!(seen.load(Ordering::SeqCst), 0);

    // Positive control: the right key is served.
    let mut right = swarm(&pnet_config("", 1));
    let outcome = tokio::time::timeout(WAIT, request(&mut right, server_id, addr, manifest_req())).await.unwrap();
    assert!(matches!(outcome, Outcome::Response(ShardResponse::Manifest(_))), "right key not served: {outcome:?}");
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    task.abort();
}
