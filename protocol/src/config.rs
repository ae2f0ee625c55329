//! Protocol configuration: limits, timeouts, discovery toggles and admission
//! control. Every field has a documented default; the node embeds
//! [`ProtocolConfig`] in its `NodeConfig` (TOML), so all fields deserialize
//! with `#[serde(default)]`.

use std::time::Duration;

use libp2p::{pnet::PreSharedKey, Multiaddr, PeerId};
use serde::{Deserialize, Serialize};

use crate::error::{ProtocolError, Result};
use crate::messages::RunId;
use crate::wire::PREFIX_LEN;

const MIB: u64 = 1024 * 1024;

/// Size limits. Every length a peer announces is checked against these
/// before anything is allocated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Largest request frame (prefix + header + tensor bodies) accepted or
    /// sent. Default 256 MiB: a 100 MB shard plus its optimizer state fits,
    /// a runaway length prefix does not exhaust memory.
    pub max_request_bytes: u64,
    /// Largest response frame. Default 256 MiB (a `ShardState` or `Handoff`
    /// of a 100 MB shard).
    pub max_response_bytes: u64,
    /// Largest postcard message header inside a frame. Default 1 MiB; real
    /// headers are under 1 KiB except manifests of many shards.
    pub max_header_bytes: u32,
    /// Most elements in one tensor. Default 64 Mi elements (256 MiB of f32).
    pub max_tensor_elements: u64,
    /// Largest serialized gossip message (heartbeat or announcement, its
    /// prefix and body; the 96-byte signature comes on top) accepted or
    /// published. Default 8 KiB: heartbeats are designed to fit (the
    /// largest legal one, with 256 shards' versions, is under 4.3 KiB).
    pub max_gossip_bytes: u32,
    /// Gossipsub `max_transmit_size`: the gossip payload (signature
    /// included) plus the protobuf envelope. Default 16 KiB, so a full
    /// heartbeat is never dropped while a peer cannot push megabyte messages
    /// through the membership topic.
    pub gossip_transmit_bytes: u32,
    /// Bytes of request/response frames being read at once, over all
    /// connections. Default 1 GiB; lower it on small edge devices. Must be at
    /// least the largest frame.
    pub max_inflight_read_bytes: u64,
    /// Concurrent request-response streams per connection. Default 32.
    pub max_concurrent_streams: u32,
    /// Established connections accepted in total. Default 256.
    pub max_established: u32,
    /// Established connections per peer (TCP and QUIC may both be up).
    /// Default 4.
    pub max_established_per_peer: u32,
    /// Connections still in their handshake. Default 64.
    pub max_pending_incoming: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_request_bytes: 256 * MIB,
            max_response_bytes: 256 * MIB,
            max_header_bytes: MIB as u32,
            max_tensor_elements: 64 * MIB,
            max_gossip_bytes: 8192,
            gossip_transmit_bytes: 16 * 1024,
            max_inflight_read_bytes: 1024 * MIB,
            max_concurrent_streams: 32,
            max_established: 256,
            max_established_per_peer: 4,
            max_pending_incoming: 64,
        }
    }
}

/// Timeouts. Transfers get a deadline that grows with their size,
/// `base + bytes / min_throughput`, so a fixed 10 s timeout never cuts off a
/// 100 MB shard on a slow link while a stalled small request still fails fast.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Timeouts {
    /// Fixed part of every read/write deadline, in ms. Default 10 000.
    pub base_ms: u64,
    /// Slowest throughput still considered alive, in bytes/s. Default 1 MiB/s
    /// (edge devices on poor links): a 100 MB frame gets 10 s + 95 s.
    pub min_throughput_bytes_per_sec: u64,
    /// How long a requester waits for the first byte of a response, in ms.
    /// This covers an owner holding a `PullShard` until the version exists.
    /// Default 60 000. Owners must answer (`NotReady` at worst) before this.
    pub response_wait_ms: u64,
    /// Transport handshake (TCP + pnet + noise + yamux, or QUIC) deadline, in
    /// ms. Default 20 000.
    pub handshake_ms: u64,
    /// Idle connection timeout, in ms: a connection with no open streams is
    /// closed after this. Default 60 000. (libp2p's own default closes idle
    /// connections at once, which would drop peers between training steps.)
    pub idle_connection_ms: u64,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            base_ms: 10_000,
            min_throughput_bytes_per_sec: MIB,
            response_wait_ms: 60_000,
            handshake_ms: 20_000,
            idle_connection_ms: 60_000,
        }
    }
}

impl Timeouts {
    /// Deadline for moving `bytes` bytes: `base + bytes / min_throughput`.
    pub fn for_bytes(&self, bytes: u64) -> Duration {
        let per_sec = self.min_throughput_bytes_per_sec.max(1);
        let extra_ms = bytes.saturating_mul(1000) / per_sec;
        Duration::from_millis(self.base_ms.saturating_add(extra_ms))
    }

    /// The outer bound that request-response enforces on a whole exchange:
    /// writing the largest request, waiting for the answer, and reading the
    /// largest response. The codec enforces tighter, size-scaled deadlines
    /// inside it.
    pub fn whole_exchange(&self, limits: &Limits) -> Duration {
        self.for_bytes(limits.max_request_bytes)
            + Duration::from_millis(self.response_wait_ms)
            + self.for_bytes(limits.max_response_bytes)
    }

    /// The first-byte wait for responses.
    pub fn response_wait(&self) -> Duration {
        Duration::from_millis(self.response_wait_ms)
    }

    /// The base deadline.
    pub fn base(&self) -> Duration {
        Duration::from_millis(self.base_ms)
    }
}

/// Admission control: who may connect at all.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Admission {
    /// Pre-shared network key (libp2p pnet) as 64 hex characters, or the
    /// full `/key/swarm/psk/1.0.0/` file contents. When set, TCP connections
    /// are encrypted with it before noise, peers without it cannot even
    /// complete a handshake, and QUIC is disabled (pnet cannot wrap QUIC).
    /// Default: none.
    pub psk: Option<String>,
    /// When set, only these peers may hold a connection; any other peer is
    /// disconnected right after the handshake and the refusal is logged.
    /// Default: none (everyone who passes pnet).
    pub allowlist: Option<Vec<PeerId>>,
}

impl Admission {
    /// Parses [`Admission::psk`].
    pub fn pre_shared_key(&self) -> Result<Option<PreSharedKey>> {
        let Some(text) = self.psk.as_deref() else {
            return Ok(None);
        };
        let text = text.trim();
        let file_form = if text.starts_with("/key/swarm/psk/1.0.0/") {
            text.to_owned()
        } else {
            format!("/key/swarm/psk/1.0.0/\n/base16/\n{text}")
        };
        file_form.parse::<PreSharedKey>().map(Some).map_err(|e| ProtocolError::Config(format!("admission.psk: {e}")))
    }

    /// Hex form of a 32-byte key, suitable for [`Admission::psk`].
    pub fn psk_hex(key: &[u8; 32]) -> String {
        key.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// Which discovery and NAT-traversal behaviours run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Discovery {
    /// mDNS on the LAN. Default on; turn off in tests and on networks where
    /// multicast is unwelcome.
    pub mdns: bool,
    /// Kademlia (protocol `/shoal/kad/12.0.0`, server mode) so bootstrap peers
    /// lead to the rest of the cluster. Default on.
    pub kademlia: bool,
    /// Relay client, so a node behind NAT can be reached through a relay.
    /// Default off.
    pub relay_client: bool,
    /// DCUtR hole punching (useful only with `relay_client`). Default off.
    pub dcutr: bool,
    /// AutoNAT (v1) reachability probing. Default off.
    pub autonat: bool,
    /// Relay server (circuit relay v2): peers that cannot reach each other
    /// directly, each reaching this node, connect through it. Circuits are
    /// bounded in number and length (a day) but not in bytes: this relay
    /// serves its own run, whose shards are megabytes. Default off.
    pub relay_server: bool,
    /// Relays to take a reservation on (`/ip4/../tcp/../p2p/<relay id>`),
    /// so peers that cannot dial this node reach it through one; requests
    /// to a peer also try each relay. Needs `relay_client`. Default none.
    pub relays: Vec<Multiaddr>,
}

impl Default for Discovery {
    fn default() -> Self {
        Discovery {
            mdns: true,
            kademlia: true,
            relay_client: false,
            dcutr: false,
            autonat: false,
            relay_server: false,
            relays: Vec::new(),
        }
    }
}

/// Gossipsub tuning.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Gossip {
    /// Gossipsub heartbeat (mesh maintenance) interval, in ms. Default 1000.
    pub heartbeat_ms: u64,
    /// How long a message id is remembered for de-duplication, in ms.
    /// Default 60 000.
    pub duplicate_cache_ms: u64,
}

impl Default for Gossip {
    fn default() -> Self {
        Gossip { heartbeat_ms: 1000, duplicate_cache_ms: 60_000 }
    }
}

/// Everything [`crate::behaviour::build_swarm`] needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProtocolConfig {
    /// The run this node belongs to; names the gossip topic and is checked in
    /// every message. Default `"default"`.
    pub run_id: RunId,
    /// Listen addresses. The address selects the transport:
    /// `/ip4/0.0.0.0/tcp/7000` is TCP + noise + yamux,
    /// `/ip4/0.0.0.0/udp/7000/quic-v1` is QUIC. Default: both, on port 0 of
    /// all interfaces.
    pub listen: Vec<Multiaddr>,
    /// Size limits.
    pub limits: Limits,
    /// Deadlines.
    pub timeouts: Timeouts,
    /// Admission control.
    pub admission: Admission,
    /// Discovery behaviours.
    pub discovery: Discovery,
    /// Gossipsub tuning.
    pub gossip: Gossip,
    /// Enable the QUIC transport. Default on (must be off with a pnet key).
    pub quic: bool,
}

impl Default for ProtocolConfig {
    fn default() -> Self {
        let listen =
            ["/ip4/0.0.0.0/tcp/0", "/ip4/0.0.0.0/udp/0/quic-v1"].iter().filter_map(|a| a.parse().ok()).collect();
        ProtocolConfig {
            run_id: RunId::default(),
            listen,
            limits: Limits::default(),
            timeouts: Timeouts::default(),
            admission: Admission::default(),
            discovery: Discovery::default(),
            gossip: Gossip::default(),
            quic: true,
        }
    }
}

impl ProtocolConfig {
    /// A config for tests and demos on one machine: listen on loopback TCP
    /// only, mDNS off, fast gossip heartbeats.
    pub fn local(run_id: RunId) -> Self {
        let listen = "/ip4/127.0.0.1/tcp/0".parse().into_iter().collect();
        ProtocolConfig {
            run_id,
            listen,
            discovery: Discovery { mdns: false, ..Discovery::default() },
            gossip: Gossip { heartbeat_ms: 100, ..Gossip::default() },
            ..ProtocolConfig::default()
        }
    }

    /// Rejects configurations that cannot work, before any socket is opened.
    pub fn validate(&self) -> Result<()> {
        let l = &self.limits;
        let bad = |m: String| Err(ProtocolError::Config(m));
        if l.max_request_bytes < PREFIX_LEN as u64 + 1024 || l.max_response_bytes < PREFIX_LEN as u64 + 1024 {
            return bad("limits.max_request_bytes and max_response_bytes must be at least 1 KiB".into());
        }
        if l.max_inflight_read_bytes < l.max_request_bytes.max(l.max_response_bytes) {
            return bad("limits.max_inflight_read_bytes must be at least the largest frame".into());
        }
        if l.max_header_bytes < 1024 {
            return bad("limits.max_header_bytes must be at least 1024".into());
        }
        if l.max_gossip_bytes < 1024 || l.gossip_transmit_bytes < l.max_gossip_bytes + 512 {
            return bad("limits.max_gossip_bytes must be >= 1024 and gossip_transmit_bytes >= max_gossip_bytes + 512 \
                 (room for the signature and the gossipsub envelope)"
                .into());
        }
        if l.max_concurrent_streams == 0 || l.max_established == 0 || l.max_established_per_peer == 0 {
            return bad("limits: stream and connection counts must be positive".into());
        }
        if self.timeouts.min_throughput_bytes_per_sec == 0 {
            return bad("timeouts.min_throughput_bytes_per_sec must be positive".into());
        }
        if self.gossip.heartbeat_ms == 0 {
            return bad("gossip.heartbeat_ms must be positive".into());
        }
        let psk = self.admission.pre_shared_key()?;
        let quic_listen = self.listen.iter().any(is_quic_addr);
        if psk.is_some() && (self.quic || quic_listen) {
            return bad("admission.psk is set but QUIC is enabled: pnet cannot protect QUIC, so a peer without \
                 the key could connect over it. Set quic = false and listen on TCP only."
                .into());
        }
        if !self.quic && quic_listen {
            return bad("a /quic-v1 listen address is configured but quic = false".into());
        }
        if self.discovery.dcutr && !self.discovery.relay_client {
            return bad("discovery.dcutr needs discovery.relay_client".into());
        }
        if !self.discovery.relays.is_empty() && !self.discovery.relay_client {
            return bad("discovery.relays needs discovery.relay_client".into());
        }
        for relay in &self.discovery.relays {
            if is_circuit_addr(relay) || !matches!(relay.iter().last(), Some(libp2p::multiaddr::Protocol::P2p(_))) {
                return bad(format!(
                    "relay address {relay} must be a direct address ending in /p2p/<relay's peer id> \
                     (no /p2p-circuit)"
                ));
            }
        }
        Ok(())
    }
}

impl ProtocolConfig {
    /// Listen addresses that other machines can reach while neither
    /// `admission.psk` nor `admission.allowlist` restricts who may connect:
    /// on these, the node accepts any peer that speaks the protocol. Empty
    /// when admission is restricted or every address is loopback.
    pub fn open_listeners(&self) -> Vec<&Multiaddr> {
        if self.admission.psk.is_some() || self.admission.allowlist.is_some() {
            return Vec::new();
        }
        self.listen.iter().filter(|a| !is_local_only(a)).collect()
    }

    /// Why mDNS stays off although `discovery.mdns` is on, if it does.
    /// libp2p's mDNS queries and answers on every interface the host has,
    /// and cannot be held to one, so it runs only where the node listens
    /// on every interface anyway: a wildcard address (`0.0.0.0` or `::`).
    /// A node bound to loopback, or to one address, never multicasts on
    /// another interface (and loopback carries no multicast at all).
    pub fn mdns_held_off(&self) -> Option<String> {
        use libp2p::multiaddr::Protocol;
        if !self.discovery.mdns {
            return None;
        }
        let wildcard = |a: &Multiaddr| match a.iter().next() {
            Some(Protocol::Ip4(ip)) => ip.is_unspecified(),
            Some(Protocol::Ip6(ip)) => ip.is_unspecified(),
            _ => false,
        };
        if self.listen.iter().any(wildcard) {
            return None;
        }
        let listen: Vec<String> = self.listen.iter().map(ToString::to_string).collect();
        let why = if self.listen.iter().all(is_local_only) {
            "the node listens on loopback only, which carries no multicast"
        } else {
            "mDNS would multicast on every interface, not only where the node listens"
        };
        Some(format!(
            "mDNS is off: {why} ({}); listen on 0.0.0.0 for mDNS, or give --bootstrap",
            if listen.is_empty() { "no listen address".to_string() } else { listen.join(", ") }
        ))
    }
}

/// True when only this machine can reach `addr`: a loopback IP, or the
/// in-memory transport of tests.
pub fn is_local_only(addr: &Multiaddr) -> bool {
    use libp2p::multiaddr::Protocol;
    match addr.iter().next() {
        Some(Protocol::Ip4(ip)) => ip.is_loopback(),
        Some(Protocol::Ip6(ip)) => ip.is_loopback(),
        Some(Protocol::Memory(_)) => true,
        _ => false,
    }
}

/// True when `addr` goes through a relay (`/p2p-circuit`).
pub fn is_circuit_addr(addr: &Multiaddr) -> bool {
    addr.iter().any(|p| matches!(p, libp2p::multiaddr::Protocol::P2pCircuit))
}

/// True when `addr` selects the QUIC transport.
pub fn is_quic_addr(addr: &Multiaddr) -> bool {
    addr.iter().any(|p| matches!(p, libp2p::multiaddr::Protocol::QuicV1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_listen(addrs: &[&str]) -> ProtocolConfig {
        let listen = addrs.iter().filter_map(|a| a.parse().ok()).collect();
        ProtocolConfig { listen, ..ProtocolConfig::default() }
    }

    #[test]
    fn mdns_runs_only_where_the_node_listens_on_every_interface() {
        let off = |addrs: &[&str]| with_listen(addrs).mdns_held_off();
        assert_eq!(off(&["/ip4/0.0.0.0/tcp/7000"]), None);
        assert_eq!(off(&["/ip4/127.0.0.1/tcp/7000", "/ip6/::/udp/7000/quic-v1"]), None);
        let loopback = off(&["/ip4/127.0.0.1/tcp/7000", "/ip6/::1/tcp/7000"]);
        assert!(loopback.as_deref().is_some_and(|m| m.contains("loopback only")), "{loopback:?}");
        let one = off(&["/ip4/10.77.0.2/tcp/7000"]);
        assert!(one.as_deref().is_some_and(|m| m.contains("not only where") && m.contains("10.77.0.2")), "{one:?}");
        // Off by config: nothing is held off.
        let mut cfg = with_listen(&["/ip4/127.0.0.1/tcp/7000"]);
        cfg.discovery.mdns = false;
        assert_eq!(cfg.mdns_held_off(), None);
    }

    #[test]
    fn listeners_beyond_loopback_without_psk_or_allowlist_are_open() {
        let open = |c: &ProtocolConfig| c.open_listeners().iter().map(|a| a.to_string()).collect::<Vec<_>>();
        let cfg = with_listen(&["/ip4/127.0.0.1/tcp/7000", "/ip6/::1/tcp/7000", "/memory/5"]);
        assert!(open(&cfg).is_empty(), "loopback and memory are local");
        let mut cfg = with_listen(&["/ip4/127.0.0.1/tcp/7000", "/ip4/0.0.0.0/tcp/7000", "/dns4/node.example/tcp/1"]);
        assert_eq!(open(&cfg), ["/ip4/0.0.0.0/tcp/7000", "/dns4/node.example/tcp/1"]);
        assert_eq!(open(&ProtocolConfig::default()).len(), 2, "the default listens on every interface, openly");
        cfg.admission.psk = Some(Admission::psk_hex(&[1; 32]));
        assert!(open(&cfg).is_empty(), "a PSK closes it");
        cfg.admission = Admission { psk: None, allowlist: Some(vec![PeerId::random()]) };
        assert!(open(&cfg).is_empty(), "an allowlist closes it");
    }
}
