//! The network actor's handle and messages: requests to peers, gossip,
//! dials, and the routes inbound requests take. The actor, the only task
//! that polls the libp2p swarm, is [`crate::actors::net`].

use std::sync::Arc;

use shoal_protocol::libp2p::{Multiaddr, PeerId};
use shoal_protocol::{GossipMessage, ShardRequest, ShardResponse};
use tokio::sync::{mpsc, oneshot};

use crate::handles::aggregator::AggregatorHandle;
use crate::policy::health::PathLatency;

/// A copy of this node's current model, served to peers that sync state
/// (`StateSync`) or gossip-average with us.
#[derive(Debug, Clone, Default)]
pub struct ModelSnapshot {
    pub version: u64,
    pub params: Arc<Vec<f32>>,
}

/// Why an outbound request failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum NetError {
    #[error("request to {peer} failed: {reason}")]
    Request { peer: PeerId, reason: String },
    #[error("dial {addr} failed: {reason}")]
    Dial { addr: Multiaddr, reason: String },
    #[error("network actor has stopped")]
    Stopped,
}

/// The network actor's mailbox.
pub(crate) enum NetCommand {
    Request {
        peer: PeerId,
        req: ShardRequest,
        reply: oneshot::Sender<Result<ShardResponse, NetError>>,
    },
    Publish {
        msg: GossipMessage,
    },
    Dial {
        addr: Multiaddr,
        reply: oneshot::Sender<Result<PeerId, NetError>>,
    },
    ListenAddrs {
        reply: oneshot::Sender<Vec<Multiaddr>>,
    },
    Block(PeerId),
    Unblock(PeerId),
    /// Close every connection with a peer that failed, and send it no
    /// request until it connects or is heard from again (it may dial us).
    Disconnect(PeerId),
    KadBootstrap,
    /// Drop the swarm now: every connection closes, as when the process dies.
    Shutdown,
}

/// Where inbound shard requests go; set once training starts.
#[derive(Debug, Clone)]
pub struct Routes {
    pub aggregator: Option<AggregatorHandle>,
    pub epoch: u64,
}

/// Cloneable handle to the network actor.
#[derive(Debug, Clone)]
pub struct NetworkHandle {
    sender: mpsc::Sender<NetCommand>,
    local_peer: PeerId,
    /// The ping round trips the network actor records.
    paths: Arc<std::sync::Mutex<PathLatency>>,
}

impl NetworkHandle {
    pub(crate) fn new(
        sender: mpsc::Sender<NetCommand>,
        local_peer: PeerId,
        paths: Arc<std::sync::Mutex<PathLatency>>,
    ) -> Self {
        Self { sender, local_peer, paths }
    }

    /// The path's round trip to `peer` in µs (the least recent ping; see
    /// [`PathLatency`]), `None` before the first ping on a connection.
    pub fn path_rtt_micros(&self, peer: &PeerId) -> Option<f64> {
        self.paths.lock().ok()?.floor(peer)
    }

    pub fn local_peer(&self) -> PeerId {
        self.local_peer
    }

    pub async fn request(&self, peer: PeerId, req: ShardRequest) -> Result<ShardResponse, NetError> {
        let (reply, rx) = oneshot::channel();
        self.sender.send(NetCommand::Request { peer, req, reply }).await.map_err(|_| NetError::Stopped)?;
        rx.await.map_err(|_| NetError::Stopped)?
    }

    pub async fn publish(&self, msg: GossipMessage) -> Result<(), NetError> {
        self.sender.send(NetCommand::Publish { msg }).await.map_err(|_| NetError::Stopped)
    }

    /// Dial and wait until the connection is up (or failed).
    pub async fn dial(&self, addr: Multiaddr) -> Result<PeerId, NetError> {
        let (reply, rx) = oneshot::channel();
        self.sender.send(NetCommand::Dial { addr, reply }).await.map_err(|_| NetError::Stopped)?;
        rx.await.map_err(|_| NetError::Stopped)?
    }

    /// The addresses we listen on, with `/p2p/<id>`. Waits for at least one.
    pub async fn listen_addrs(&self) -> Result<Vec<Multiaddr>, NetError> {
        let (reply, rx) = oneshot::channel();
        self.sender.send(NetCommand::ListenAddrs { reply }).await.map_err(|_| NetError::Stopped)?;
        rx.await.map_err(|_| NetError::Stopped)
    }

    /// Refuse (and drop) connections with a peer: fault injection for
    /// partitions, and the hook for banning misbehaving peers.
    pub async fn block(&self, peer: PeerId) -> Result<(), NetError> {
        self.sender.send(NetCommand::Block(peer)).await.map_err(|_| NetError::Stopped)
    }

    /// Close every connection with a peer that the failure detector declared
    /// dead, so that requests in flight to it fail now rather than at their
    /// timeouts, and fail new requests to it at once rather than dial it,
    /// until it connects or its heartbeat comes back. A machine that dies without a TCP reset (`docker kill`, a
    /// power cut, a frozen process) leaves connections that look open.
    /// Does not wait: with the network's queue full, the close is skipped
    /// (the requests then end at their own timeouts).
    pub fn disconnect(&self, peer: PeerId) {
        if self.sender.try_send(NetCommand::Disconnect(peer)).is_err() {
            tracing::debug!(%peer, "network queue full or stopped: not closing the dead peer's connections");
        }
    }

    /// Stop the network actor, dropping the swarm and all its connections.
    pub async fn shutdown(&self) {
        let _ = self.sender.send(NetCommand::Shutdown).await;
    }

    /// Ask Kademlia (if on) to look up the network from the peers we know,
    /// so that peers we never dialled become reachable by id.
    pub async fn kad_bootstrap(&self) -> Result<(), NetError> {
        self.sender.send(NetCommand::KadBootstrap).await.map_err(|_| NetError::Stopped)
    }

    pub async fn unblock(&self, peer: PeerId) -> Result<(), NetError> {
        self.sender.send(NetCommand::Unblock(peer)).await.map_err(|_| NetError::Stopped)
    }
}
