//! Two swarms on real loopback sockets exchange a 100 MB shard, byte for
//! byte, in both directions: a 100 MB `PushGrad` request, answered by a
//! `ShardState` carrying the same 100 MB back. Once over TCP+noise+yamux,
//! once over QUIC.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use futures::StreamExt;
use shoal_protocol::libp2p::request_response;
use shoal_protocol::libp2p::swarm::SwarmEvent;
use shoal_protocol::*;

const SHARD_BYTES: usize = 100_000_000;

async fn exchange_100mb(listen: &str) {
    let cfg = config(listen);
    let mut server = swarm(&cfg);
    let server_id = *server.local_peer_id();
    let addr = tokio::time::timeout(WAIT, listen_addr(&mut server)).await.unwrap();

    let ctx = ValidationContext::new(run(), 8, cfg.limits.clone(), &cfg.timeouts);
    // The server validates the push (checksum, NaN scan, run, shard, sender)
    // and echoes the received payload back as the shard state.
    let server_task = tokio::spawn(async move {
        loop {
            if let SwarmEvent::Behaviour(ShoalBehaviourEvent::Shard(request_response::Event::Message {
                peer,
                message: request_response::Message::Request { request, channel, .. },
                ..
            })) = server.select_next_some().await
            {
                let reply = match validate_request(&request, &peer, &ctx) {
                    Err(e) => ShardResponse::error(&e),
                    Ok(()) => match request {
                        ShardRequest::PushGrad(p) => ShardResponse::ShardState(ShardState {
                            run: p.run,
                            shard: p.shard,
                            version: p.base_version + 1,
                            epoch: p.epoch,
                            params: p.grad,
                            delta: None,
                        }),
                        other => ShardResponse::error(&ProtocolError::InvalidField {
                            field: "request",
                            reason: format!("unexpected {}", other.kind()),
                        }),
                    },
                };
                server.behaviour_mut().shard.send_response(channel, reply).unwrap();
            }
        }
    });

    let mut client = swarm(&config(""));
    let values: Vec<f32> = (0..SHARD_BYTES / 4).map(|i| (i as f32).sin()).collect();
    let grad = Payload::encode(&values, Encoding::F32).unwrap();
    let push = ShardRequest::PushGrad(PushGrad {
        run: run(),
        shard: 5,
        epoch: 2,
        base_version: 41,
        worker: *client.local_peer_id(),
        incarnation: 1,
        step: 41,
        samples: 64,
        grad: grad.clone(),
    });
    let outcome = tokio::time::timeout(WAIT, request(&mut client, server_id, addr, push)).await.unwrap();
    server_task.abort();

    let Outcome::Response(ShardResponse::ShardState(state)) = outcome else {
        panic!("expected ShardState, got {outcome:?}");
    };
    assert_eq!(state.version, 42);
    assert_eq!(state.params.byte_len() as usize, SHARD_BYTES);
    assert!(state.params.data() == grad.data(), "shard bytes differ after the round trip");
    let back = state.params.decode().unwrap();
    assert!(back.iter().zip(&values).all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_noise_yamux_moves_a_100mb_shard_byte_identical() {
    exchange_100mb("/ip4/127.0.0.1/tcp/0").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_moves_a_100mb_shard_byte_identical() {
    exchange_100mb("/ip4/127.0.0.1/udp/0/quic-v1").await;
}
