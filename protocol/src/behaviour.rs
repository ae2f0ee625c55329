//! The composed libp2p behaviour and the swarm builder.
//!
//! The node's network actor owns the [`Swarm<ShoalBehaviour>`] returned by
//! [`build_swarm`] and is the only task that polls it. Fields are named after
//! their protocol; `admission` and `connection_limits` come first so that a
//! refused peer is dropped before any other behaviour sets up state for it.

use std::collections::{HashSet, VecDeque};
use std::convert::Infallible;
use std::fmt;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use libp2p::core::muxing::StreamMuxerBox;
use libp2p::core::transport::{Boxed, OptionalTransport};
use libp2p::core::upgrade::Version;
use libp2p::core::{Endpoint, Transport};
use libp2p::gossipsub::{self, IdentTopic, MessageAuthenticity, MessageId, ValidationMode};
use libp2p::identity::Keypair;
use libp2p::pnet::PnetConfig;
use libp2p::request_response::{self, OutboundRequestId, ProtocolSupport};
use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::swarm::{
    dummy, CloseConnection, ConnectionDenied, ConnectionId, FromSwarm, NetworkBehaviour, THandler, THandlerInEvent,
    THandlerOutEvent, ToSwarm,
};
use libp2p::{
    autonat, connection_limits, dcutr, dns, identify, kad, mdns, noise, ping, quic, relay, tcp, yamux, Multiaddr,
    PeerId, StreamProtocol, Swarm,
};

use crate::codec::{ShardCodec, SHARD_PROTOCOL};
use crate::config::{is_quic_addr, ProtocolConfig};
use crate::error::{ProtocolError, Result};
use crate::frame;
use crate::messages::{GossipMessage, RunId, ShardRequest};
pub use crate::wire::IDENTIFY_PROTOCOL_VERSION;
use crate::wire::{identify_wire_version, KAD_PROTOCOL_NAME, WIRE_VERSION};

/// Kademlia protocol id (`/shoal/kad/<version>.0.0`).
pub const KAD_PROTOCOL: StreamProtocol = StreamProtocol::new(KAD_PROTOCOL_NAME);

/// The gossip topic of a run: `/shoal/<run-id>/membership/<wire version>`.
/// Nodes of another version subscribe to another topic, so they do not
/// hear each other at all rather than rejecting each other's messages.
pub fn membership_topic(run: &RunId) -> IdentTopic {
    IdentTopic::new(format!("/shoal/{run}/membership/{WIRE_VERSION}"))
}

/// Checks the protocol version a peer reported through identify (the
/// earliest point where a peer's version is known) against ours. A peer of
/// another version cannot exchange a frame with this node (multistream-select
/// refuses its shard protocol), so the node should say so, naming both
/// versions, instead of leaving only failed requests to explain it.
pub fn check_peer_version(protocol_version: &str) -> Result<()> {
    match identify_wire_version(protocol_version) {
        Some(theirs) if theirs == WIRE_VERSION => Ok(()),
        Some(theirs) => Err(ProtocolError::VersionMismatch { ours: WIRE_VERSION, theirs }),
        None => Err(ProtocolError::InvalidField {
            field: "protocol_version",
            reason: format!(
                "{protocol_version:?} is not a Shoal wire version; this node speaks {IDENTIFY_PROTOCOL_VERSION:?}"
            ),
        }),
    }
}

/// Gossipsub message id: xxh3-128 over the topic and the data. A stable
/// content hash, so the same heartbeat relayed by different peers is
/// recognised as one message (heartbeats carry a sequence number, so
/// distinct heartbeats never collide).
pub fn content_message_id(msg: &gossipsub::Message) -> MessageId {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(msg.topic.as_str().as_bytes());
    h.update(&[0]);
    h.update(&msg.data);
    MessageId::new(&h.digest128().to_be_bytes())
}

// ---------------------------------------------------------------------------
// Admission control
// ---------------------------------------------------------------------------

/// Why a connection was refused.
#[derive(Debug)]
pub struct NotAdmitted {
    peer: PeerId,
    reason: &'static str,
}

impl fmt::Display for NotAdmitted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "peer {} refused: {}", self.peer, self.reason)
    }
}

impl std::error::Error for NotAdmitted {}

/// Bound on queued close requests (one per blocked peer; a flood of
/// `block` calls collapses into closing all connections of those peers).
const MAX_PENDING_CLOSES: usize = 1024;

/// Allowlist / blocklist enforcement. Connections are refused right after
/// the transport handshake (when the peer id is authenticated), and every
/// refusal is logged at `warn`.
#[derive(Debug, Default)]
pub struct Admission {
    allow: Option<HashSet<PeerId>>,
    blocked: HashSet<PeerId>,
    close: VecDeque<PeerId>,
    waker: Option<Waker>,
}

impl Admission {
    /// `allow = None` admits everyone not blocked.
    pub fn new(allow: Option<HashSet<PeerId>>) -> Admission {
        Admission { allow, ..Admission::default() }
    }

    /// Whether `peer` may connect.
    pub fn is_admitted(&self, peer: &PeerId) -> bool {
        !self.blocked.contains(peer) && self.allow.as_ref().is_none_or(|a| a.contains(peer))
    }

    /// Adds a peer to the allowlist (no-op without an allowlist).
    pub fn allow(&mut self, peer: PeerId) {
        if let Some(a) = self.allow.as_mut() {
            a.insert(peer);
        }
    }

    /// Blocks a peer (for example one with a mismatched config): refuses new
    /// connections and closes existing ones.
    pub fn block(&mut self, peer: PeerId) {
        if self.blocked.insert(peer) && self.close.len() < MAX_PENDING_CLOSES {
            self.close.push_back(peer);
            if let Some(w) = self.waker.take() {
                w.wake();
            }
        }
    }

    /// Lifts a block.
    pub fn unblock(&mut self, peer: &PeerId) {
        self.blocked.remove(peer);
    }

    fn enforce(&self, peer: PeerId, remote: &Multiaddr, direction: &'static str) -> Result<(), ConnectionDenied> {
        if self.is_admitted(&peer) {
            return Ok(());
        }
        let reason = if self.blocked.contains(&peer) { "blocked" } else { "not in the allowlist" };
        tracing::warn!(%peer, %remote, direction, reason, "admission: disconnecting unknown peer");
        Err(ConnectionDenied::new(NotAdmitted { peer, reason }))
    }
}

impl NetworkBehaviour for Admission {
    type ConnectionHandler = dummy::ConnectionHandler;
    type ToSwarm = Infallible;

    fn handle_established_inbound_connection(
        &mut self,
        _: ConnectionId,
        peer: PeerId,
        _local: &Multiaddr,
        remote: &Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        self.enforce(peer, remote, "inbound")?;
        Ok(dummy::ConnectionHandler)
    }

    fn handle_established_outbound_connection(
        &mut self,
        _: ConnectionId,
        peer: PeerId,
        remote: &Multiaddr,
        _: Endpoint,
        _: libp2p::core::transport::PortUse,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        self.enforce(peer, remote, "outbound")?;
        Ok(dummy::ConnectionHandler)
    }

    fn on_swarm_event(&mut self, _: FromSwarm) {}

    fn on_connection_handler_event(&mut self, _: PeerId, _: ConnectionId, event: THandlerOutEvent<Self>) {
        match event {}
    }

    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<ToSwarm<Self::ToSwarm, THandlerInEvent<Self>>> {
        if let Some(peer) = self.close.pop_front() {
            tracing::warn!(%peer, "admission: closing connections of blocked peer");
            return Poll::Ready(ToSwarm::CloseConnection { peer_id: peer, connection: CloseConnection::All });
        }
        self.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

// ---------------------------------------------------------------------------
// The composed behaviour
// ---------------------------------------------------------------------------

/// Everything Shoal speaks. Build it with [`build_swarm`].
#[derive(NetworkBehaviour)]
pub struct ShoalBehaviour {
    /// Allowlist / blocklist.
    pub admission: Admission,
    /// Connection count bounds.
    pub connection_limits: connection_limits::Behaviour,
    /// Membership gossip (heartbeats, announcements; never tensors).
    pub gossipsub: gossipsub::Behaviour,
    /// [`SHARD_PROTOCOL`].
    pub shard: request_response::Behaviour<ShardCodec>,
    /// Identify (listen addresses, protocols, agent).
    pub identify: identify::Behaviour,
    /// Liveness and RTT.
    pub ping: ping::Behaviour,
    /// LAN discovery.
    pub mdns: Toggle<mdns::tokio::Behaviour>,
    /// Bootstrap-peer discovery.
    pub kademlia: Toggle<kad::Behaviour<kad::store::MemoryStore>>,
    /// Reachability through relays (NAT).
    pub relay_client: Toggle<relay::client::Behaviour>,
    /// Hole punching over relayed connections.
    pub dcutr: Toggle<dcutr::Behaviour>,
    /// Circuit relay v2 server, for peers that cannot reach each other.
    pub relay_server: Toggle<relay::Behaviour>,
    /// Reachability probing.
    pub autonat: Toggle<autonat::Behaviour>,
}

impl fmt::Debug for ShoalBehaviour {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShoalBehaviour")
            .field("admission", &self.admission)
            .field("mdns", &self.mdns.is_enabled())
            .field("kademlia", &self.kademlia.is_enabled())
            .field("relay_client", &self.relay_client.is_enabled())
            .field("relay_server", &self.relay_server.is_enabled())
            .finish_non_exhaustive()
    }
}

impl ShoalBehaviour {
    /// Sends a request on [`SHARD_PROTOCOL`].
    pub fn send_request(&mut self, peer: &PeerId, req: ShardRequest) -> OutboundRequestId {
        self.shard.send_request(peer, req)
    }

    /// Encodes (checking the gossip size limit), signs and publishes on the
    /// run's membership topic.
    pub fn publish(
        &mut self,
        topic: &IdentTopic,
        msg: &GossipMessage,
        signer: &frame::GossipSigner,
        limits: &crate::config::Limits,
    ) -> Result<MessageId> {
        let data = frame::encode_gossip(msg, signer, limits)?;
        self.gossipsub.publish(topic.clone(), data).map_err(|e| match e {
            gossipsub::PublishError::NoPeersSubscribedToTopic => ProtocolError::NoGossipPeers,
            other => ProtocolError::Publish(other.to_string()),
        })
    }

    /// Tells gossipsub whether a received message passed validation; only
    /// accepted messages are forwarded (the behaviour runs with
    /// `validate_messages()`).
    pub fn report_gossip(&mut self, id: &MessageId, source: &PeerId, accepted: bool) {
        let verdict =
            if accepted { gossipsub::MessageAcceptance::Accept } else { gossipsub::MessageAcceptance::Reject };
        self.gossipsub.report_message_validation_result(id, source, verdict);
    }
}

fn gossipsub_config(cfg: &ProtocolConfig) -> Result<gossipsub::Config> {
    gossipsub::ConfigBuilder::default()
        .heartbeat_interval(Duration::from_millis(cfg.gossip.heartbeat_ms))
        // Gossipsub's envelope carries no source, sequence number or
        // signature: Shoal signs the message itself (frame::encode_gossip),
        // and the node checks that signature once per message, after
        // gossipsub's duplicate cache, where gossipsub would check its own
        // on every copy. The signer is authenticated, so validation can
        // compare it to `Heartbeat::peer`.
        .validation_mode(ValidationMode::Anonymous)
        // Nothing is forwarded until the node has validated it.
        .validate_messages()
        .message_id_fn(content_message_id)
        // Deliberate: heartbeats are <= 8 KiB; see Limits::gossip_transmit_bytes.
        .max_transmit_size(cfg.limits.gossip_transmit_bytes as usize)
        .duplicate_cache_time(Duration::from_millis(cfg.gossip.duplicate_cache_ms))
        .build()
        .map_err(|e| ProtocolError::Config(format!("gossipsub: {e}")))
}

fn build_behaviour(
    cfg: &ProtocolConfig,
    keypair: &Keypair,
    relay_client: Option<relay::client::Behaviour>,
) -> Result<ShoalBehaviour> {
    let peer_id = keypair.public().to_peer_id();
    let limits = &cfg.limits;

    let admission =
        Admission::new(cfg.admission.allowlist.as_ref().map(|list| list.iter().copied().collect::<HashSet<_>>()));
    let connection_limits = connection_limits::Behaviour::new(
        connection_limits::ConnectionLimits::default()
            .with_max_established(Some(limits.max_established))
            .with_max_established_per_peer(Some(limits.max_established_per_peer))
            .with_max_pending_incoming(Some(limits.max_pending_incoming)),
    );

    let mut gossipsub = gossipsub::Behaviour::new(MessageAuthenticity::Anonymous, gossipsub_config(cfg)?)
        .map_err(|e| ProtocolError::Config(format!("gossipsub: {e}")))?;
    gossipsub
        .subscribe(&membership_topic(&cfg.run_id))
        .map_err(|e| ProtocolError::Config(format!("gossipsub subscribe: {e}")))?;

    let shard = request_response::Behaviour::with_codec(
        ShardCodec::new(cfg.limits.clone(), cfg.timeouts.clone()),
        [(SHARD_PROTOCOL, ProtocolSupport::Full)],
        request_response::Config::default()
            // Outer bound only; the codec enforces size-scaled deadlines.
            .with_request_timeout(cfg.timeouts.whole_exchange(limits))
            .with_max_concurrent_streams(limits.max_concurrent_streams as usize),
    );

    let identify = identify::Behaviour::new(
        identify::Config::new(IDENTIFY_PROTOCOL_VERSION.to_owned(), keypair.public())
            .with_agent_version(format!("shoal/{}", env!("CARGO_PKG_VERSION")))
            // A relayed listen address appears once the reservation is
            // taken, after the first identify exchange: tell peers.
            .with_push_listen_addr_updates(cfg.discovery.relay_client),
    );
    let ping = ping::Behaviour::new(ping::Config::new());

    let mdns = if cfg.discovery.mdns && cfg.mdns_held_off().is_none() {
        Some(
            mdns::tokio::Behaviour::new(mdns::Config::default(), peer_id)
                .map_err(|e| ProtocolError::Transport(format!("mdns: {e}")))?,
        )
    } else {
        None
    };
    let kademlia = cfg.discovery.kademlia.then(|| {
        let mut kad =
            kad::Behaviour::with_config(peer_id, kad::store::MemoryStore::new(peer_id), kad::Config::new(KAD_PROTOCOL));
        // Server mode: without confirmed external addresses (LAN, loopback,
        // docker) kad would stay a client and bootstrap peers could not be
        // queried.
        kad.set_mode(Some(kad::Mode::Server));
        kad
    });
    let dcutr = cfg.discovery.dcutr.then(|| dcutr::Behaviour::new(peer_id));
    let relay_server = cfg.discovery.relay_server.then(|| relay::Behaviour::new(peer_id, relay_server_config(limits)));
    let autonat = cfg.discovery.autonat.then(|| autonat::Behaviour::new(peer_id, autonat::Config::default()));

    Ok(ShoalBehaviour {
        admission,
        connection_limits,
        gossipsub,
        shard,
        identify,
        ping,
        mdns: mdns.into(),
        kademlia: kademlia.into(),
        relay_client: relay_client.into(),
        dcutr: dcutr.into(),
        relay_server: relay_server.into(),
        autonat: autonat.into(),
    })
}

/// A circuit is closed after this long (the client dials a new one).
pub const RELAY_CIRCUIT_SECS: u64 = 24 * 3600;

/// The relay server's bounds. libp2p's defaults suit a public relay that
/// only brokers hole punching (128 KiB and 2 minutes per circuit); this one
/// carries its run's pushes and pulls, so a circuit has no byte bound and
/// lasts a day. Reservations and circuits are bounded by the connection
/// limits; the per-peer and per-IP rate limiters stay libp2p's.
fn relay_server_config(limits: &crate::config::Limits) -> relay::Config {
    let established = limits.max_established as usize;
    relay::Config {
        max_reservations: established,
        max_reservations_per_peer: 4,
        max_circuits: established,
        max_circuits_per_peer: (limits.max_established_per_peer as usize).max(4),
        max_circuit_duration: Duration::from_secs(RELAY_CIRCUIT_SECS),
        max_circuit_bytes: 0,
        ..relay::Config::default()
    }
}

fn transport_err(what: &str) -> impl FnOnce(noise::Error) -> ProtocolError + '_ {
    move |e| ProtocolError::Transport(format!("{what}: {e}"))
}

/// TCP (+ optional pnet) + noise + yamux, optional QUIC, optional relay, under DNS.
fn build_transport(
    cfg: &ProtocolConfig,
    keypair: &Keypair,
    relay_transport: Option<relay::client::Transport>,
) -> Result<Boxed<(PeerId, StreamMuxerBox)>> {
    let handshake = Duration::from_millis(cfg.timeouts.handshake_ms);
    let psk = cfg.admission.pre_shared_key()?;

    let tcp_base = tcp::tokio::Transport::new(tcp::Config::default().nodelay(true));
    // Exactly one of the two is `Some`; `or_transport` falls through a `None`.
    // pnet runs first: without the key, the noise handshake that follows reads
    // garbage and fails, so nothing else is ever reached.
    let (with_pnet, plain) = match psk {
        Some(psk) => (
            OptionalTransport::some(tcp_base.and_then(move |socket, _| PnetConfig::new(psk).handshake(socket))),
            OptionalTransport::none(),
        ),
        None => (OptionalTransport::none(), OptionalTransport::some(tcp_base)),
    };
    let tcp_maybe_pnet = with_pnet.or_transport(plain);
    let tcp = tcp_maybe_pnet
        .upgrade(Version::V1Lazy)
        .authenticate(noise::Config::new(keypair).map_err(transport_err("noise"))?)
        .multiplex(yamux::Config::default())
        .timeout(handshake)
        .map(|(peer, muxer), _| (peer, StreamMuxerBox::new(muxer)));

    let quic = if cfg.quic {
        let mut qc = quic::Config::new(keypair);
        qc.handshake_timeout = handshake;
        OptionalTransport::some(
            quic::tokio::Transport::new(qc).map(|(peer, muxer), _| (peer, StreamMuxerBox::new(muxer))),
        )
    } else {
        OptionalTransport::none()
    };

    let direct = tcp.or_transport(quic).map(|either, _| either.into_inner());
    let direct = dns::tokio::Transport::system(direct)
        .map_err(|e| ProtocolError::Transport(format!("dns resolver from system config: {e}")))?;

    let relayed = match relay_transport {
        Some(rt) => OptionalTransport::some(
            rt.upgrade(Version::V1Lazy)
                .authenticate(noise::Config::new(keypair).map_err(transport_err("noise"))?)
                .multiplex(yamux::Config::default())
                .timeout(handshake)
                .map(|(peer, muxer), _| (peer, StreamMuxerBox::new(muxer))),
        ),
        None => OptionalTransport::none(),
    };
    // The relay transport first: it turns down a direct address at once
    // (`MultiaddrNotSupported`), so the next is tried. The DNS transport
    // takes every address and fails later, so after it nothing would be.
    Ok(relayed.or_transport(direct).map(|either, _| either.into_inner()).boxed())
}

/// Builds the swarm: validates `cfg`, sets up the transports and behaviours,
/// and starts listening on `cfg.listen`. The address picks the transport
/// (`/tcp/` or `/udp/../quic-v1`). Must run inside a tokio runtime; each
/// connection's task is a detached tokio task.
pub fn build_swarm(cfg: &ProtocolConfig, keypair: Keypair) -> Result<Swarm<ShoalBehaviour>> {
    build_swarm_on(cfg, keypair, libp2p::swarm::Config::with_tokio_executor())
}

/// [`build_swarm`], with each connection's task spawned by `executor` (a
/// node's own task set, so that its connections end with it).
pub fn build_swarm_with(
    cfg: &ProtocolConfig,
    keypair: Keypair,
    executor: impl libp2p::swarm::Executor + Send + 'static,
) -> Result<Swarm<ShoalBehaviour>> {
    build_swarm_on(cfg, keypair, libp2p::swarm::Config::with_executor(executor))
}

fn build_swarm_on(
    cfg: &ProtocolConfig,
    keypair: Keypair,
    swarm_cfg: libp2p::swarm::Config,
) -> Result<Swarm<ShoalBehaviour>> {
    cfg.validate()?;
    let peer_id = keypair.public().to_peer_id();
    let (relay_transport, relay_behaviour) = if cfg.discovery.relay_client {
        let (t, b) = relay::client::new(peer_id);
        (Some(t), Some(b))
    } else {
        (None, None)
    };
    let transport = build_transport(cfg, &keypair, relay_transport)?;
    let behaviour = build_behaviour(cfg, &keypair, relay_behaviour)?;
    let swarm_cfg = swarm_cfg.with_idle_connection_timeout(Duration::from_millis(cfg.timeouts.idle_connection_ms));
    let mut swarm = Swarm::new(transport, behaviour, peer_id, swarm_cfg);
    for addr in &cfg.listen {
        if is_quic_addr(addr) && !cfg.quic {
            return Err(ProtocolError::Config(format!("{addr} needs quic = true")));
        }
        swarm.listen_on(addr.clone()).map_err(|e| ProtocolError::Transport(format!("listen on {addr}: {e}")))?;
    }
    for relay in &cfg.discovery.relays {
        if relay.iter().any(|p| p == libp2p::multiaddr::Protocol::P2p(peer_id)) {
            return Err(ProtocolError::Config(format!("relay {relay} is this node itself")));
        }
        // Dials the relay and asks it for a reservation; once accepted, the
        // circuit address is a listen address like any other.
        let circuit = relay.clone().with(libp2p::multiaddr::Protocol::P2pCircuit);
        swarm
            .listen_on(circuit.clone())
            .map_err(|e| ProtocolError::Transport(format!("reservation on relay {circuit}: {e}")))?;
    }
    tracing::info!(peer = %peer_id, run = %cfg.run_id, listen = ?cfg.listen, "swarm built");
    Ok(swarm)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn psk_with_quic_is_rejected() {
        let mut cfg = ProtocolConfig::default();
        cfg.admission.psk = Some(crate::config::Admission::psk_hex(&[7u8; 32]));
        let err = cfg.validate().unwrap_err();
        assert!(err.to_string().contains("pnet cannot protect QUIC"), "{err}");
        cfg.quic = false;
        cfg.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
        cfg.validate().unwrap();
    }

    #[test]
    fn topic_name_follows_the_run() {
        let t = membership_topic(&RunId::new("exp-1").unwrap());
        assert_eq!(t.to_string(), format!("/shoal/exp-1/membership/{WIRE_VERSION}"));
    }

    #[test]
    fn a_peer_of_another_version_is_named_with_both_versions() {
        check_peer_version(IDENTIFY_PROTOCOL_VERSION).unwrap();
        let theirs = WIRE_VERSION + 1;
        let err = check_peer_version(&format!("/shoal/{theirs}.0.0")).unwrap_err();
        assert!(matches!(err, ProtocolError::VersionMismatch { ours: WIRE_VERSION, theirs: t } if t == theirs));
        let both = format!("version {theirs}, this node speaks version {WIRE_VERSION}");
        assert!(err.to_string().contains(&both), "{err}");
        let err = check_peer_version("/ipfs/0.1.0").unwrap_err();
        assert!(
            matches!(&err, ProtocolError::InvalidField { field: "protocol_version", reason }
                if reason.contains("/ipfs/0.1.0") && reason.contains(IDENTIFY_PROTOCOL_VERSION)),
            "{err}"
        );
    }

    #[tokio::test]
    async fn every_optional_behaviour_builds() {
        // mDNS stays off: it would multicast on the LAN.
        let mut cfg = ProtocolConfig::local(RunId::new("opt").unwrap());
        cfg.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap(), "/ip4/127.0.0.1/udp/0/quic-v1".parse().unwrap()];
        cfg.discovery = crate::config::Discovery {
            mdns: false,
            kademlia: true,
            relay_client: true,
            dcutr: true,
            autonat: true,
            relay_server: true,
            relays: Vec::new(),
        };
        let swarm = build_swarm(&cfg, Keypair::generate_ed25519()).unwrap();
        let b = swarm.behaviour();
        assert!(
            b.kademlia.is_enabled()
                && b.relay_client.is_enabled()
                && b.dcutr.is_enabled()
                && b.autonat.is_enabled()
                && b.relay_server.is_enabled()
        );
        assert!(!b.mdns.is_enabled());
    }

    #[tokio::test]
    async fn mdns_on_in_the_config_stays_off_on_a_loopback_only_node() {
        let mut cfg = ProtocolConfig::local(RunId::new("lo").unwrap());
        cfg.discovery.mdns = true;
        let swarm = build_swarm(&cfg, Keypair::generate_ed25519()).unwrap();
        assert!(!swarm.behaviour().mdns.is_enabled(), "{:?}", cfg.listen);
        assert!(cfg.mdns_held_off().is_some_and(|m| m.contains("loopback only")));
    }

    #[tokio::test]
    async fn invalid_configs_are_refused_before_building() {
        let mut cfg = ProtocolConfig::local(RunId::new("bad").unwrap());
        cfg.discovery.dcutr = true;
        assert!(matches!(build_swarm(&cfg, Keypair::generate_ed25519()), Err(ProtocolError::Config(_))));
        let mut cfg = ProtocolConfig::local(RunId::new("bad").unwrap());
        cfg.quic = false;
        cfg.listen = vec!["/ip4/127.0.0.1/udp/0/quic-v1".parse().unwrap()];
        assert!(matches!(build_swarm(&cfg, Keypair::generate_ed25519()), Err(ProtocolError::Config(_))));
        let mut cfg = ProtocolConfig::local(RunId::new("bad").unwrap());
        cfg.limits.max_inflight_read_bytes = 1;
        assert!(matches!(build_swarm(&cfg, Keypair::generate_ed25519()), Err(ProtocolError::Config(_))));
        // Relays: the client must be on, and each address names the relay
        // directly (not through another circuit).
        let relay = Keypair::generate_ed25519().public().to_peer_id();
        let direct: Multiaddr = format!("/ip4/10.0.0.1/tcp/7000/p2p/{relay}").parse().unwrap();
        let mut cfg = ProtocolConfig::local(RunId::new("bad").unwrap());
        cfg.discovery.relays = vec![direct.clone()];
        let err = cfg.validate().unwrap_err();
        assert!(err.to_string().contains("needs discovery.relay_client"), "{err}");
        cfg.discovery.relay_client = true;
        for bad in ["/ip4/10.0.0.1/tcp/7000".to_string(), format!("{direct}/p2p-circuit")] {
            cfg.discovery.relays = vec![bad.parse().unwrap()];
            let err = cfg.validate().unwrap_err();
            assert!(err.to_string().contains("must be a direct address ending in /p2p/"), "{bad}: {err}");
        }
        let me = Keypair::generate_ed25519();
        cfg.discovery.relays =
            vec![format!("/ip4/127.0.0.1/tcp/7000/p2p/{}", me.public().to_peer_id()).parse().unwrap()];
        match build_swarm(&cfg, me) {
            Err(ProtocolError::Config(m)) => assert!(m.contains("is this node itself"), "{m}"),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("a node took itself as its relay"),
        }
    }

    #[test]
    fn config_reads_from_json_with_defaults() {
        // The node embeds ProtocolConfig in its TOML config; every field defaults.
        let cfg: ProtocolConfig =
            serde_json::from_str(r#"{"run_id":"exp-2","limits":{"max_request_bytes":1048576}}"#).unwrap();
        assert_eq!(cfg.run_id.as_str(), "exp-2");
        assert_eq!(cfg.limits.max_request_bytes, 1 << 20);
        assert_eq!(cfg.limits.max_response_bytes, crate::config::Limits::default().max_response_bytes);
        // serde_json's error has no variants to match: its message names what was wrong.
        let err = serde_json::from_str::<ProtocolConfig>(r#"{"run_id":"bad id"}"#).unwrap_err();
        assert!(err.to_string().contains(r#"invalid run id "bad id""#), "{err}");
        let err = serde_json::from_str::<ProtocolConfig>(r#"{"typo":1}"#).unwrap_err();
        assert!(err.to_string().contains("unknown field `typo`"), "{err}");
    }

    #[test]
    fn admission_rules() {
        let a = PeerId::random();
        let b = PeerId::random();
        let mut adm = Admission::new(Some([a].into_iter().collect()));
        assert!(adm.is_admitted(&a));
        assert!(!adm.is_admitted(&b));
        adm.block(a);
        assert!(!adm.is_admitted(&a));
        let open = Admission::new(None);
        assert!(open.is_admitted(&b));
    }
}
