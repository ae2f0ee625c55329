//! Helpers for multi-swarm tests: every wait is on a swarm event, bounded by
//! the caller's `tokio::time::timeout`.
#![allow(dead_code, clippy::unwrap_used)]

use std::time::Duration;

use futures::StreamExt;
use shoal_protocol::libp2p::identity::Keypair;
use shoal_protocol::libp2p::multiaddr::Protocol;
use shoal_protocol::libp2p::request_response::{self, OutboundFailure};
use shoal_protocol::libp2p::swarm::SwarmEvent;
use shoal_protocol::libp2p::{Multiaddr, PeerId, Swarm};
use shoal_protocol::{
    build_swarm, Discovery, ProtocolConfig, RunId, ShardRequest, ShardResponse, ShoalBehaviour, ShoalBehaviourEvent,
};

/// Upper bound for any single wait in these tests.
pub const WAIT: Duration = Duration::from_secs(60);

pub fn run() -> RunId {
    RunId::new("test-run").unwrap()
}

/// Loopback config on `listen` (empty string = no listener), discovery off.
pub fn config(listen: &str) -> ProtocolConfig {
    let mut cfg = ProtocolConfig::local(run());
    cfg.listen = if listen.is_empty() { vec![] } else { vec![listen.parse().unwrap()] };
    cfg.discovery = Discovery { mdns: false, kademlia: false, ..Discovery::default() };
    cfg
}

pub fn swarm(cfg: &ProtocolConfig) -> Swarm<ShoalBehaviour> {
    build_swarm(cfg, Keypair::generate_ed25519()).unwrap()
}

/// Drives `swarm` until it reports a listen address; returns it with `/p2p/<id>`.
pub async fn listen_addr(swarm: &mut Swarm<ShoalBehaviour>) -> Multiaddr {
    let id = *swarm.local_peer_id();
    loop {
        if let SwarmEvent::NewListenAddr { address, .. } = swarm.select_next_some().await {
            return address.with(Protocol::P2p(id));
        }
    }
}

/// Outcome of one request as seen by the requester.
#[derive(Debug)]
pub enum Outcome {
    Response(ShardResponse),
    Failed(OutboundFailure),
}

/// Sends `req` to `peer` at `addr` and drives `swarm` until it succeeds or fails.
pub async fn request(swarm: &mut Swarm<ShoalBehaviour>, peer: PeerId, addr: Multiaddr, req: ShardRequest) -> Outcome {
    let id = swarm.behaviour_mut().shard.send_request_with_addresses(&peer, req, vec![addr]);
    loop {
        match swarm.select_next_some().await {
            SwarmEvent::Behaviour(ShoalBehaviourEvent::Shard(request_response::Event::Message {
                message: request_response::Message::Response { request_id, response },
                ..
            })) if request_id == id => return Outcome::Response(response),
            SwarmEvent::Behaviour(ShoalBehaviourEvent::Shard(request_response::Event::OutboundFailure {
                request_id,
                error,
                ..
            })) if request_id == id => return Outcome::Failed(error),
            _ => {}
        }
    }
}
