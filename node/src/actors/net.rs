//! The network actor: the only task that polls the libp2p `Swarm`.
//!
//! It `select!`s over swarm events and [`NetCommand`]s. Outbound requests
//! keep their `oneshot` reply in a map keyed by request id. Inbound requests
//! are validated, then handed to the aggregator with `try_send` (this edge
//! would otherwise close a cycle of bounded channels: the network never
//! waits on another actor), and the eventual answers come back as futures
//! that this actor polls and sends on the right `ResponseChannel`.
//! Gossip heartbeats are validated and forwarded to membership the same way.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::FuturesUnordered;
use futures::StreamExt;
use shoal_protocol::config::{is_circuit_addr, is_local_only};
use shoal_protocol::frame::GossipSigner;
use shoal_protocol::libp2p::multiaddr::Protocol;
use shoal_protocol::libp2p::request_response::{self, OutboundRequestId, ResponseChannel};
use shoal_protocol::libp2p::swarm::dial_opts::DialOpts;
use shoal_protocol::libp2p::swarm::{ConnectionId, SwarmEvent};
use shoal_protocol::libp2p::{dcutr, gossipsub, identify, kad, mdns, ping, relay, Multiaddr, PeerId, Swarm};
use shoal_protocol::{
    frame, membership_topic, validate_gossip, validate_request_fields, validate_response_fields, Accepted, DeltaOf,
    Encoding, ErrorCode, Exchanged, GossipMessage, Handoff, Payload, ProtocolConfig, PullShard, PushPull, RunId,
    ShardRequest, ShardResponse, ShardState, ShoalBehaviour, ShoalBehaviourEvent, StateSync, ValidationContext,
    WireError,
};
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{debug, info, warn};

use shoal_models::OptimizerConfig;

use crate::handles::aggregator::{HandoffReply, PullReply, PushReply};
use crate::handles::handoff::from_wire;
use crate::handles::membership::Heard;
use crate::handles::net::{ModelSnapshot, NetCommand, NetError, NetworkHandle, Routes};
use crate::ops::faults::hold;
use crate::policy::contribution::Contribution;
use crate::policy::delta::ShardDelta;
use crate::policy::health::{PathLatency, StalledConnections, STALLED_AFTER_TIMEOUTS};

/// Everything the network actor needs besides the swarm.
#[derive(Debug)]
pub struct NetworkParts {
    pub config: ProtocolConfig,
    pub ctx: ValidationContext,
    /// Element range of each shard in the flat model.
    pub shard_ranges: Vec<std::ops::Range<usize>>,
    /// Validated heartbeats and closed connections, for membership.
    pub heard: mpsc::Sender<Heard>,
    pub routes: watch::Receiver<Routes>,
    pub snapshot: watch::Receiver<ModelSnapshot>,
    pub capacity: usize,
    /// This run's optimizer (to decode handed-off optimizer state).
    pub optimizer: OptimizerConfig,
    /// Fault injection: answer every push and pull this node serves as an
    /// owner this much later (`faults.delay_ms`). Zero in production.
    pub faults: std::sync::Arc<crate::ops::faults::Faults>,
    /// Signs this node's gossip with its identity key.
    pub signer: GossipSigner,
}

/// An outbound request in flight.
struct InFlight {
    /// Its caller's reply.
    reply: oneshot::Sender<Result<ShardResponse, NetError>>,
    peer: PeerId,
    sent: Instant,
}

/// Callers waiting for a dial to a peer: the address tried and the reply.
type DialWaiters = Vec<(Multiaddr, oneshot::Sender<Result<PeerId, NetError>>)>;

type PendingResponse = Pin<Box<dyn Future<Output = (ResponseChannel<ShardResponse>, ShardResponse)> + Send>>;

/// Start the actor on an already built swarm.
/// The actor is one of the node's `tasks`: on the node's stop it is dropped,
/// and with it the swarm, its listeners and its connections.
pub fn spawn(swarm: Swarm<ShoalBehaviour>, parts: NetworkParts, tasks: &crate::ops::tasks::NodeTasks) -> NetworkHandle {
    let local_peer = *swarm.local_peer_id();
    let (sender, receiver) = mpsc::channel(parts.capacity.max(1));
    let paths = Arc::new(std::sync::Mutex::new(PathLatency::default()));
    let actor = NetworkActor {
        paths: paths.clone(),
        topic: membership_topic(&parts.config.run_id),
        swarm,
        receiver,
        parts,
        outbound: HashMap::new(),
        stalls: StalledConnections::default(),
        dials: HashMap::new(),
        failed: FailedPeers::default(),
        responses: FuturesUnordered::new(),
        kad_bootstrapped: false,
        encoded: Arc::default(),
    };
    tasks.spawn(actor.run());
    NetworkHandle::new(sender, local_peer, paths)
}

struct NetworkActor {
    swarm: Swarm<ShoalBehaviour>,
    receiver: mpsc::Receiver<NetCommand>,
    parts: NetworkParts,
    topic: gossipsub::IdentTopic,
    outbound: HashMap<OutboundRequestId, InFlight>,
    /// Connections whose requests time out in a row: closed once stalled,
    /// so that the next request dials a fresh one.
    stalls: StalledConnections<ConnectionId>,
    dials: HashMap<PeerId, DialWaiters>,
    /// Peers the failure detector declared dead. A request to one that is
    /// not connected fails at once instead of dialling it: a frozen or
    /// unplugged machine's listening socket may still take the TCP
    /// connection, and the handshake then hangs for the whole handshake
    /// timeout (20 s), holding up the worker whose request it was (and
    /// every BSP round waiting for that worker). Cleared when the peer
    /// connects again, is dialled on purpose, or its heartbeat comes back.
    /// At most [`MAX_FAILED`], the oldest forgotten first.
    failed: FailedPeers,
    responses: FuturesUnordered<PendingResponse>,
    /// A Kademlia bootstrap query has been started (it needs a peer with a
    /// known address, which the first identify exchange gives).
    kad_bootstrapped: bool,
    /// Each connected peer's ping round trip, read by the worker to time
    /// owners' service without the path's latency.
    paths: Arc<std::sync::Mutex<PathLatency>>,
    /// The shard states this owner last encoded, shared by every pull of
    /// the same round.
    encoded: Arc<EncodedStates>,
}

/// Shard states encoded for pulls still being answered. Every worker's
/// pull of a BSP round is answered from the same parameters (one `Arc`
/// that the aggregator hands to all of them at once), so they are encoded
/// once and the payload (a shared buffer) is cloned for the others, not
/// encoded once per worker. An entry is reused only for the very `Arc` it
/// was made from, held weakly: once every answer that holds that `Arc` has
/// been built, the entry is dead and is dropped at the next insertion, so
/// the encoded bytes live no longer than the pulls they serve. Only the
/// dense encodings a worker pulls in (f32, f16, bf16) are cached; a pull
/// asking for another is encoded on its own, so a peer cannot grow the
/// table by cycling through encodings.
#[derive(Debug, Default)]
struct EncodedStates {
    entries: std::sync::Mutex<HashMap<(u32, Encoding), EncodedEntry>>,
}

type EncodedEntry = (std::sync::Weak<Vec<f32>>, Arc<tokio::sync::OnceCell<Payload>>);

impl EncodedStates {
    /// `params` (shard `shard`'s state) in `encoding`: encoded here the
    /// first time, the same payload afterwards. Concurrent callers for the
    /// same state wait for the one encoding it.
    async fn get(
        &self,
        shard: u32,
        params: &Arc<Vec<f32>>,
        encoding: Encoding,
    ) -> Result<Payload, shoal_protocol::ProtocolError> {
        if !matches!(encoding, Encoding::F32 | Encoding::F16 | Encoding::Bf16) {
            return Payload::encode(params, encoding);
        }
        let cell = {
            let mut entries = self.entries.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            match entries.get(&(shard, encoding)) {
                Some((made_from, cell)) if std::ptr::eq(made_from.as_ptr(), Arc::as_ptr(params)) => cell.clone(),
                _ => {
                    // States no answer holds any more (a past round's, a
                    // shard that moved away) go before a new one comes in.
                    entries.retain(|_, (made_from, _)| made_from.strong_count() > 0);
                    let cell = Arc::new(tokio::sync::OnceCell::new());
                    entries.insert((shard, encoding), (Arc::downgrade(params), cell.clone()));
                    cell
                }
            }
        };
        cell.get_or_try_init(|| async { Payload::encode(params, encoding) }).await.cloned()
    }
}

/// Failed peers remembered. Past this, the one marked longest ago is
/// forgotten (requests to it dial it as before).
const MAX_FAILED: usize = 1024;

/// The peers marked failed, at most [`MAX_FAILED`], forgetting the oldest
/// mark first (a long run with churn marks more peers than that, and the
/// ones that matter are the recent ones).
#[derive(Debug, Default)]
struct FailedPeers {
    set: HashSet<PeerId>,
    /// Marking order, oldest first; holds exactly the peers in `set`.
    order: std::collections::VecDeque<PeerId>,
}

impl FailedPeers {
    fn contains(&self, peer: &PeerId) -> bool {
        self.set.contains(peer)
    }

    fn insert(&mut self, peer: PeerId) {
        if self.set.contains(&peer) {
            // Marked again: it becomes the newest.
            self.order.retain(|p| *p != peer);
        } else if self.set.len() >= MAX_FAILED {
            if let Some(oldest) = self.order.pop_front() {
                self.set.remove(&oldest);
            }
        }
        self.set.insert(peer);
        self.order.push_back(peer);
    }

    fn remove(&mut self, peer: &PeerId) {
        if self.set.remove(peer) {
            self.order.retain(|p| p != peer);
        }
    }
}

fn wire_error(code: ErrorCode, msg: impl Into<String>) -> ShardResponse {
    ShardResponse::Error(WireError::new(code, msg))
}

impl NetworkActor {
    async fn run(mut self) {
        let mut listen_waiters: Vec<oneshot::Sender<Vec<Multiaddr>>> = Vec::new();
        loop {
            tokio::select! {
                cmd = self.receiver.recv() => match cmd {
                    Some(NetCommand::ListenAddrs { reply }) => {
                        // Listeners report their addresses asynchronously: wait for the first.
                        if self.listen_addrs().is_empty() && !self.parts.config.listen.is_empty() {
                            listen_waiters.push(reply);
                        } else {
                            let _ = reply.send(self.listen_addrs());
                        }
                    }
                    Some(NetCommand::Shutdown) => {
                        info!("network shutting down: closing every connection");
                        break;
                    }
                    Some(cmd) => self.command(cmd),
                    None => break,
                },
                event = self.swarm.select_next_some() => {
                    if matches!(event, SwarmEvent::NewListenAddr { .. }) {
                        let addrs = self.listen_addrs();
                        for w in listen_waiters.drain(..) {
                            let _ = w.send(addrs.clone());
                        }
                    }
                    self.event(event);
                }
                Some((channel, response)) = self.responses.next(), if !self.responses.is_empty() => {
                    if self.swarm.behaviour_mut().shard.send_response(channel, response).is_err() {
                        debug!("peer went away before its response");
                    }
                }
            }
        }
        debug!("network actor stopping: all handles dropped");
    }

    fn listen_addrs(&self) -> Vec<Multiaddr> {
        let me = *self.swarm.local_peer_id();
        self.swarm.listeners().map(|a| a.clone().with(Protocol::P2p(me))).collect()
    }

    fn command(&mut self, cmd: NetCommand) {
        match cmd {
            NetCommand::Request { peer, req, reply } => {
                if self.failed.contains(&peer) && !self.swarm.is_connected(&peer) {
                    let reason = "the peer failed (no heartbeat within the failure timeout); not dialling it".into();
                    let _ = reply.send(Err(NetError::Request { peer, reason }));
                    return;
                }
                let id = self.swarm.behaviour_mut().send_request(&peer, req);
                self.outbound.insert(id, InFlight { reply, peer, sent: Instant::now() });
            }
            NetCommand::Publish { msg } => {
                let limits = self.parts.config.limits.clone();
                if let Err(e) = self.swarm.behaviour_mut().publish(&self.topic, &msg, &self.parts.signer, &limits) {
                    // Normal before the mesh forms; the next heartbeat retries.
                    debug!(error = %e, "gossip publish");
                }
            }
            NetCommand::Dial { addr, reply } => {
                // The last /p2p/ names the target (earlier ones name relays).
                let Some(peer) = addr
                    .iter()
                    .filter_map(|p| match p {
                        Protocol::P2p(id) => Some(id),
                        _ => None,
                    })
                    .last()
                else {
                    let _ = reply.send(Err(NetError::Dial { addr, reason: "no /p2p/<peer id> in the address".into() }));
                    return;
                };
                self.failed.remove(&peer);
                if self.swarm.is_connected(&peer) {
                    let _ = reply.send(Ok(peer));
                    return;
                }
                if let Err(e) = self.swarm.dial(addr.clone()) {
                    let _ = reply.send(Err(NetError::Dial { addr, reason: e.to_string() }));
                    return;
                }
                self.dials.entry(peer).or_default().push((addr, reply));
            }
            NetCommand::ListenAddrs { reply } => {
                let _ = reply.send(self.listen_addrs());
            }
            NetCommand::Block(peer) => {
                self.swarm.behaviour_mut().admission.block(peer);
            }
            NetCommand::Shutdown => {}
            NetCommand::Disconnect(peer) => {
                self.failed.insert(peer);
                if self.swarm.disconnect_peer_id(peer).is_ok() {
                    info!(%peer, "closed the connections of a failed peer");
                }
            }
            NetCommand::Unblock(peer) => {
                self.swarm.behaviour_mut().admission.unblock(&peer);
            }
            NetCommand::KadBootstrap => {
                if let Some(kad) = self.swarm.behaviour_mut().kademlia.as_mut() {
                    match kad.bootstrap() {
                        Ok(_) => self.kad_bootstrapped = true,
                        Err(e) => debug!(error = %e, "kademlia bootstrap"),
                    }
                }
            }
        }
    }

    /// The last connection to `peer` closed: its path measurements go, and
    /// membership hears of it (after the run, it means the peer stopped).
    fn disconnected(&mut self, peer: PeerId) {
        if let Ok(mut paths) = self.paths.lock() {
            paths.forget(&peer);
        }
        // Rare, unlike heartbeats; if membership is behind, the failure
        // timeout stands in for it.
        if self.parts.heard.try_send(Heard::Disconnected(peer)).is_err() {
            debug!(%peer, "membership is behind: a closed connection not passed on");
        }
    }

    fn event(&mut self, event: SwarmEvent<ShoalBehaviourEvent>) {
        match event {
            SwarmEvent::NewListenAddr { address, .. } => {
                info!(%address, "listening");
                // A relay hands its addresses out with each reservation (and
                // serves only once it has one): its own reachable listen
                // addresses are what it has.
                if self.parts.config.discovery.relay_server && !is_local_only(&address) && !is_circuit_addr(&address) {
                    self.swarm.add_external_address(address);
                }
            }
            SwarmEvent::ExpiredListenAddr { address, .. } if self.parts.config.discovery.relay_server => {
                self.swarm.remove_external_address(&address);
            }
            SwarmEvent::ConnectionEstablished { peer_id, endpoint, .. } => {
                if endpoint.is_relayed() {
                    info!(peer = %peer_id, addr = %endpoint.get_remote_address(), "connected through a relay");
                } else {
                    debug!(peer = %peer_id, addr = %endpoint.get_remote_address(), "connected");
                }
                self.failed.remove(&peer_id);
                for (_, reply) in self.dials.remove(&peer_id).unwrap_or_default() {
                    let _ = reply.send(Ok(peer_id));
                }
            }
            SwarmEvent::OutgoingConnectionError { peer_id: Some(peer), error, .. } => {
                for (addr, reply) in self.dials.remove(&peer).unwrap_or_default() {
                    let _ = reply.send(Err(NetError::Dial { addr, reason: error.to_string() }));
                }
            }
            SwarmEvent::ConnectionClosed { peer_id, connection_id, num_established, .. } => {
                self.stalls.forget(connection_id);
                if num_established == 0 {
                    self.disconnected(peer_id);
                }
            }
            SwarmEvent::Behaviour(ShoalBehaviourEvent::Ping(ping::Event { peer, result: Ok(rtt), .. })) => {
                if let Ok(mut paths) = self.paths.lock() {
                    paths.record(peer, rtt.as_secs_f64() * 1e6);
                }
            }
            SwarmEvent::Behaviour(ShoalBehaviourEvent::Shard(ev)) => self.shard_event(ev),
            SwarmEvent::Behaviour(ShoalBehaviourEvent::Gossipsub(gossipsub::Event::Message {
                propagation_source,
                message_id,
                message,
            })) => self.gossip(propagation_source, message_id, message),
            SwarmEvent::Behaviour(ShoalBehaviourEvent::Kademlia(kad::Event::OutboundQueryProgressed {
                result: kad::QueryResult::GetClosestPeers(Ok(found)),
                ..
            })) => self.found_by_kademlia(found.peers),
            SwarmEvent::Behaviour(ShoalBehaviourEvent::Mdns(mdns::Event::Discovered(found))) => {
                self.found_by_mdns(found)
            }
            SwarmEvent::Behaviour(ShoalBehaviourEvent::RelayClient(ev)) => relay_client_event(ev),
            SwarmEvent::Behaviour(ShoalBehaviourEvent::RelayServer(ev)) => relay_server_event(ev),
            SwarmEvent::Behaviour(ShoalBehaviourEvent::Dcutr(dcutr::Event { remote_peer_id, result })) => {
                match result {
                    Ok(_) => info!(peer = %remote_peer_id, "hole punched: a direct connection beside the relayed one"),
                    Err(e) => {
                        info!(peer = %remote_peer_id, error = %e, "no hole punched: the connection stays relayed")
                    }
                }
            }
            SwarmEvent::Behaviour(ShoalBehaviourEvent::Identify(identify::Event::Received {
                peer_id, info, ..
            })) => {
                // A peer of another wire version cannot exchange a frame with
                // this node (multistream-select refuses our protocol names):
                // say so, naming both versions, and do not route to it.
                if let Err(e) = shoal_protocol::check_peer_version(&info.protocol_version) {
                    warn!(peer = %peer_id, error = %e, "peer cannot train with this node");
                    return;
                }
                // Teach Kademlia (if on) where the peer listens, so requests to
                // peers we only know by id can be dialled.
                if let Some(kad) = self.swarm.behaviour_mut().kademlia.as_mut() {
                    for addr in info.listen_addrs {
                        kad.add_address(&peer_id, addr);
                    }
                    // The bootstrap asked for at start finds no peer when it
                    // runs before the first identify: start it now, so that a
                    // node that dialled one peer learns where the others are
                    // (a joiner fetches the model from all of them).
                    if !self.kad_bootstrapped {
                        self.kad_bootstrapped = kad.bootstrap().is_ok();
                    }
                }
            }
            _ => {}
        }
    }

    /// LAN discovery: remember each address and connect, so gossip
    /// reaches the peer.
    fn found_by_mdns(&mut self, found: Vec<(PeerId, Multiaddr)>) {
        for (peer, addr) in found {
            self.swarm.add_peer_address(peer, addr.clone());
            if !self.swarm.is_connected(&peer) {
                info!(%peer, %addr, "found by mDNS, dialling");
                // From a new port, not the listening one: two nodes
                // that find each other at once both dial, and with
                // both dials bound to their listening ports the two
                // are one TCP connection (a simultaneous open) that
                // each side takes as its own dial; the handshake
                // fails on both and mDNS never names the peer
                // again. (A CI run's two nodes never formed their
                // roster; 1 run in 6 here, with the file's other
                // test beside it.) A LAN needs no reused port for
                // hole punching.
                let opts = DialOpts::peer_id(peer).addresses(vec![addr.clone()]).allocate_new_port().build();
                if let Err(e) = self.swarm.dial(opts) {
                    debug!(%peer, %addr, error = %e, "mdns dial");
                }
            }
        }
    }

    /// The peers a Kademlia lookup found (one this node asked for when it
    /// could not dial a peer): their addresses go to the swarm, for the
    /// next dial.
    fn found_by_kademlia(&mut self, peers: Vec<kad::PeerInfo>) {
        for info in peers {
            for addr in info.addrs {
                self.swarm.add_peer_address(info.peer_id, addr);
            }
        }
    }

    fn shard_event(&mut self, ev: request_response::Event<ShardRequest, ShardResponse>) {
        match ev {
            request_response::Event::Message { peer, message, connection_id } => match message {
                request_response::Message::Request { request, channel, .. } => self.inbound(peer, request, channel),
                request_response::Message::Response { request_id, response } => {
                    self.stalls.answered(connection_id);
                    if let Some(InFlight { reply, .. }) = self.outbound.remove(&request_id) {
                        // Fields here; a shard state's body is checked by the
                        // decode that copies it out, as for requests.
                        let checked = validate_response_fields(&response, &self.parts.ctx).map_err(|e| {
                            warn!(%peer, kind = response.kind(), error = %e, "invalid response");
                            NetError::Request { peer, reason: format!("invalid response: {e}") }
                        });
                        let _ = reply.send(checked.map(|()| response));
                    }
                }
            },
            request_response::Event::OutboundFailure { peer, request_id, error, connection_id } => {
                // A peer this node knows by id (from gossip) but cannot
                // dial: it may have reached the bootstrap peer after this
                // node's one Kademlia bootstrap. Look it up, so that the
                // caller's retry finds an address.
                if matches!(error, request_response::OutboundFailure::DialFailure) && !self.failed.contains(&peer) {
                    if let Some(kad) = self.swarm.behaviour_mut().kademlia.as_mut() {
                        debug!(%peer, "no address to dial: asking Kademlia for it");
                        kad.get_closest_peers(peer);
                    }
                }
                let sent = self.outbound.remove(&request_id);
                let reason = match (&error, &sent) {
                    (request_response::OutboundFailure::Timeout, Some(f)) => self.timed_out(f, connection_id),
                    _ => error.to_string(),
                };
                if let Some(InFlight { reply, .. }) = sent {
                    let _ = reply.send(Err(NetError::Request { peer, reason }));
                }
            }
            request_response::Event::InboundFailure { peer, error, .. } => {
                debug!(%peer, %error, "inbound request failed");
            }
            _ => {}
        }
    }

    /// A request on `connection` timed out: the connection is closed if
    /// it stalled ([`StalledConnections`]). Returns the caller's error text.
    /// libp2p says "waiting for a response" for both of its limits, opening
    /// the stream (10 s) and the whole exchange (`timeouts`); the time
    /// waited tells them apart.
    fn timed_out(&mut self, request: &InFlight, connection: ConnectionId) -> String {
        let whole = self.parts.config.timeouts.whole_exchange(&self.parts.config.limits);
        let waited = request.sent.elapsed();
        let opening = waited < whole / 2;
        // A stream can also wait to open behind a large transfer to the
        // same peer on a slow link: with another request to the peer in
        // flight, the connection may be busy rather than stalled, and a
        // failed opening counts as a timeout instead of closing the
        // connection (and that transfer) at once.
        let at_once = opening && !self.outbound.values().any(|f| f.peer == request.peer);
        if self.stalls.timed_out(connection, at_once) {
            let why = if at_once {
                "a stream did not open".to_string()
            } else {
                format!("{STALLED_AFTER_TIMEOUTS} requests in a row timed out")
            };
            warn!(peer = %request.peer, "{why} on one connection to the peer: closing it, so that the next \
                                         request dials a fresh one");
            self.swarm.close_connection(connection);
        }
        let secs = waited.as_secs_f64();
        if opening {
            format!("no answer: the stream did not open within libp2p's 10 s (waited {secs:.1} s)")
        } else {
            format!("no answer within the whole exchange's {} s (waited {secs:.1} s)", whole.as_secs())
        }
    }

    fn respond_now(&mut self, channel: ResponseChannel<ShardResponse>, resp: ShardResponse) {
        if self.swarm.behaviour_mut().shard.send_response(channel, resp).is_err() {
            debug!("peer went away before its response");
        }
    }

    /// Answers one inbound request: at once when it cannot be decoded or
    /// is invalid, else by its kind (answers that wait on the aggregator
    /// go into `responses`, so that nothing blocks this loop).
    fn inbound(&mut self, peer: PeerId, req: ShardRequest, channel: ResponseChannel<ShardResponse>) {
        if let Some(resp) = req.undecodable_reply() {
            return self.respond_now(channel, resp);
        }
        // Fields and tensor headers here; each tensor body is checked
        // (checksum, finiteness) once, by the decode that copies it out.
        if let Err(e) = validate_request_fields(&req, &peer, &self.parts.ctx) {
            warn!(%peer, kind = req.kind(), error = %e, "invalid request");
            return self.respond_now(channel, ShardResponse::error(&e));
        }
        let routes = self.parts.routes.borrow().clone();
        let run = self.parts.config.run_id.clone();
        match req {
            ShardRequest::PushGrad(_)
            | ShardRequest::PushPull(_)
            | ShardRequest::PushPullMany(_)
            | ShardRequest::Probe(_) => {
                let answer = self.timed_answer(peer, &routes, &run, req);
                self.responses.push(Box::pin(async move { (channel, answer.await) }));
            }
            ShardRequest::Timed(inner) => self.serve_timed(peer, &routes, &run, *inner, channel),
            ShardRequest::PullShard(p) => self.serve_pull(peer, &routes, run, p, channel),
            ShardRequest::StateSync(s) => {
                let resp = self.state_sync(routes.epoch, run, &s);
                self.respond_now(channel, resp);
            }
            ShardRequest::Handoff(h) => self.serve_handoff(peer, &routes, h, channel),
            other => {
                let kind = other.kind();
                self.respond_now(
                    channel,
                    wire_error(ErrorCode::InvalidRequest, format!("{kind} is not served by this node yet")),
                );
            }
        }
    }

    /// A `Timed` request: its inner request's answer, with the time this
    /// node took to serve it.
    fn serve_timed(
        &mut self,
        peer: PeerId,
        routes: &Routes,
        run: &RunId,
        inner: ShardRequest,
        channel: ResponseChannel<ShardResponse>,
    ) {
        // From taking the request off the connection to having its
        // answer ready: this node's queues, CPU and serving delays,
        // not the requester's or the network's.
        let since = Instant::now();
        let answer = self.timed_answer(peer, routes, run, inner);
        self.responses.push(Box::pin(async move {
            let answer = answer.await;
            let held = Duration::from_millis(answer_held_ms(&answer).into());
            let service_us = since.elapsed().saturating_sub(held).as_micros().min(u32::MAX as u128) as u32;
            (channel, ShardResponse::Timed { service_us, answer: Box::new(answer) })
        }));
    }

    /// A pull of one shard: parked at the aggregator until the version
    /// asked for exists (or the wait ends), then answered with the state
    /// after this node's serving and link delays.
    fn serve_pull(
        &mut self,
        peer: PeerId,
        routes: &Routes,
        run: RunId,
        p: PullShard,
        channel: ResponseChannel<ShardResponse>,
    ) {
        let Some(agg) = &routes.aggregator else {
            // Peers can agree on the roster a moment before we do: ask them to retry.
            return self.respond_now(channel, wire_error(ErrorCode::Busy, "training has not started on this node yet"));
        };
        let shard = p.shard;
        let encoding = p.encoding;
        let wait = Duration::from_millis(p.max_wait_ms as u64);
        let epoch = routes.epoch;
        let delay = self.parts.faults.serve_delay();
        let faults = self.parts.faults.clone();
        let encoded = self.encoded.clone();
        match agg.try_pull(peer, shard, (p.min_version, p.have), wait) {
            Err(_) => self.respond_now(channel, wire_error(ErrorCode::Busy, "aggregator busy")),
            Ok(rx) => self.responses.push(Box::pin(async move {
                let resp = pull_response(rx.await, &encoded, run, (shard, epoch), encoding).await;
                let sent = match &resp {
                    ShardResponse::ShardState(s) => s.params.byte_len(),
                    _ => 0,
                };
                hold(delay + faults.link_delay(sent) + faults.send_delay(sent)).await;
                (channel, resp)
            })),
        }
    }

    /// The answer to a `StateSync`: the shard of this node's worker copy,
    /// in f32, once it has reached the version asked for.
    fn state_sync(&self, epoch: u64, run: RunId, s: &StateSync) -> ShardResponse {
        let snap = self.parts.snapshot.borrow().clone();
        let range = self.parts.shard_ranges.get(s.shard as usize).cloned();
        match range {
            Some(_) if snap.version < s.min_version || snap.params.is_empty() => {
                ShardResponse::NotReady { shard: s.shard, current_version: snap.version }
            }
            Some(r) if r.end <= snap.params.len() => match Payload::encode(&snap.params[r], Encoding::F32) {
                Ok(params) => ShardResponse::ShardState(ShardState {
                    run,
                    shard: s.shard,
                    version: snap.version,
                    epoch,
                    params,
                    delta: None,
                }),
                Err(e) => ShardResponse::error(&e),
            },
            _ => wire_error(ErrorCode::ShardOutOfRange, format!("no shard {}", s.shard)),
        }
    }

    /// A shard's state handed to this node (a transfer or a replica),
    /// decoded and passed to the aggregator; only from the peer it names
    /// as its sender.
    fn serve_handoff(&mut self, peer: PeerId, routes: &Routes, h: Handoff, channel: ResponseChannel<ShardResponse>) {
        let Some(agg) = &routes.aggregator else {
            return self.respond_now(channel, wire_error(ErrorCode::Busy, "training has not started on this node yet"));
        };
        if h.from != peer {
            let refused = wire_error(ErrorCode::InvalidRequest, "handoff `from` is not the sender");
            return self.respond_now(channel, refused);
        }
        let state = match from_wire(&h, self.parts.optimizer) {
            Ok(s) => s,
            Err(e) => return self.respond_now(channel, wire_error(ErrorCode::InvalidRequest, format!("{e:#}"))),
        };
        let shard = h.shard;
        match agg.try_handoff(peer, h.kind, h.hops, state) {
            Err(_) => self.respond_now(channel, wire_error(ErrorCode::Busy, "aggregator busy")),
            Ok(rx) => self.responses.push(Box::pin(async move {
                let resp = match rx.await {
                    Ok(HandoffReply::Ack { version }) => ShardResponse::HandoffAck { shard, version },
                    Ok(HandoffReply::Fenced { epoch }) => ShardResponse::Fenced { shard, epoch },
                    Ok(HandoffReply::Invalid(m)) => wire_error(ErrorCode::InvalidRequest, m),
                    Err(_) => wire_error(ErrorCode::Internal, "aggregator stopped"),
                };
                (channel, resp)
            })),
        }
    }

    /// The answer to a request whose service the straggler detector times
    /// (`PushGrad`, `PushPull`, `PushPullMany`, `Probe`; alone or inside a
    /// `Timed`), ready once the serving delays of link emulation have
    /// passed.
    fn timed_answer(&self, peer: PeerId, routes: &Routes, run: &RunId, req: ShardRequest) -> Half<ShardResponse> {
        let now = |resp: ShardResponse| -> Half<ShardResponse> { Box::pin(std::future::ready(resp)) };
        match req {
            ShardRequest::PushGrad(p) => {
                let Some(agg) = &routes.aggregator else {
                    // Peers can agree on the roster a moment before we do: ask them to retry.
                    return now(wire_error(ErrorCode::Busy, "training has not started on this node yet"));
                };
                let grad = match Contribution::decode(&p.grad) {
                    Ok(g) => g,
                    Err(e) => return now(ShardResponse::error(&e)),
                };
                let shard = p.shard;
                // Link emulation: the gradient came in over this node's
                // downlink, and the answer leaves over its uplink.
                let delay = self.parts.faults.push_answer_delay(p.grad.byte_len());
                match agg.try_push(peer, shard, p.base_version, p.samples, grad) {
                    Err(_) => now(wire_error(ErrorCode::Busy, "aggregator busy")),
                    Ok(rx) => Box::pin(async move {
                        let resp = match rx.await {
                            Ok(r) => push_response(shard, r),
                            Err(_) => wire_error(ErrorCode::Internal, "aggregator stopped"),
                        };
                        hold(delay).await;
                        resp
                    }),
                }
            }
            ShardRequest::PushPull(p) => {
                let faults = self.parts.faults.clone();
                let delay = faults.serve_delay() + faults.receive_delay(p.push.grad.byte_len());
                let taken = serve_push_pull(peer, routes, run, &self.encoded, p);
                Box::pin(async move {
                    let resp = push_pull_answer(taken).await;
                    let sent = resp.state_bytes();
                    hold(delay + faults.link_delay(sent) + faults.send_delay(sent)).await;
                    resp
                })
            }
            ShardRequest::PushPullMany(batch) => {
                // The answer must fit in one message too: refused before any
                // gradient is taken (a sender retries each shard alone).
                let answer_bytes: u64 = batch.iter().map(|p| p.push.grad.numel().saturating_mul(4)).sum();
                let room = self.parts.config.limits.max_response_bytes.saturating_sub(1 << 20);
                if answer_bytes > room {
                    return now(wire_error(
                        ErrorCode::TooLarge,
                        format!("the answer would carry {answer_bytes} bytes of shards, over {room}"),
                    ));
                }
                // Each push taken as if it had come alone; the link carries
                // their bytes together.
                let faults = self.parts.faults.clone();
                let received: u64 = batch.iter().map(|p| p.push.grad.byte_len()).sum();
                let delay = faults.serve_delay() + faults.receive_delay(received);
                let taken: Vec<_> =
                    batch.into_iter().map(|p| serve_push_pull(peer, routes, run, &self.encoded, p)).collect();
                Box::pin(async move {
                    let answers = push_pull_many_answers(taken).await;
                    let sent = answers.iter().map(ShardResponse::state_bytes).sum();
                    hold(delay + faults.link_delay(sent) + faults.send_delay(sent)).await;
                    ShardResponse::ExchangedMany(answers)
                })
            }
            ShardRequest::Probe(p) => {
                // Checksum and finiteness, as a push's decode would check them.
                if let Err(e) = p.padding.verify() {
                    return now(ShardResponse::error(&e));
                }
                let bytes = p.padding.byte_len();
                // The delays a push of this size meets here (a slow owner,
                // an emulated link), so the probe times what a push would.
                let delay = self.parts.faults.push_answer_delay(bytes);
                Box::pin(async move {
                    hold(delay).await;
                    ShardResponse::Probed { bytes }
                })
            }
            other => now(wire_error(ErrorCode::InvalidRequest, format!("{} is not timed", other.kind()))),
        }
    }

    fn gossip(&mut self, source: PeerId, id: gossipsub::MessageId, message: gossipsub::Message) {
        // The first copy only: gossipsub's duplicate cache drops the
        // others before they get here, so each message's signature is
        // checked once.
        let decoded = frame::decode_gossip(&message.data, &self.parts.config.limits)
            .and_then(|m| validate_gossip(&m.message, Some(&m.signer), &self.parts.ctx).map(|()| m.message));
        match decoded {
            Ok(GossipMessage::Heartbeat(hb)) => {
                self.swarm.behaviour_mut().report_gossip(&id, &source, true);
                // Heard from again (a healed partition, a thawed process,
                // relayed by another peer): requests may dial it again.
                self.failed.remove(&hb.peer);
                self.route_through_relays(hb.peer);
                // Heartbeats are periodic: if membership is behind, drop this one.
                let _ = self.parts.heard.try_send(Heard::Heartbeat(Box::new(hb)));
            }
            Ok(_) => self.swarm.behaviour_mut().report_gossip(&id, &source, true),
            Err(e) => {
                warn!(peer = %source, error = %e, "rejecting gossip message");
                self.swarm.behaviour_mut().report_gossip(&id, &source, false);
            }
        }
    }
}

impl NetworkActor {
    /// Gives a peer this node is not connected to an address through each
    /// configured relay (`<relay>/p2p-circuit/p2p/<peer>`), so that a
    /// request to a peer it cannot dial directly goes through a relay. The
    /// swarm dials every address it knows for a peer at once and keeps the
    /// first connection, so a direct route still wins where there is one. A
    /// circuit to a peer with no reservation (yet) on that relay fails at
    /// the relay at once, and a failed dial drops the address from the
    /// swarm's cache: hence again on each heartbeat while not connected.
    fn route_through_relays(&mut self, peer: PeerId) {
        let relays = &self.parts.config.discovery.relays;
        if relays.is_empty() || self.swarm.is_connected(&peer) {
            return;
        }
        for relay in relays.clone() {
            if relay.iter().any(|p| p == Protocol::P2p(peer)) {
                continue; // The relay itself.
            }
            let route = relay.with(Protocol::P2pCircuit).with(Protocol::P2p(peer));
            self.swarm.add_peer_address(peer, route);
        }
    }
}

fn relay_client_event(ev: relay::client::Event) {
    match ev {
        relay::client::Event::ReservationReqAccepted { relay_peer_id, renewal: false, .. } => {
            info!(relay = %relay_peer_id, "reservation accepted: peers can reach this node through the relay");
        }
        relay::client::Event::ReservationReqAccepted { .. } => {}
        relay::client::Event::OutboundCircuitEstablished { relay_peer_id, .. } => {
            debug!(relay = %relay_peer_id, "circuit to a peer opened through the relay");
        }
        relay::client::Event::InboundCircuitEstablished { src_peer_id, .. } => {
            debug!(peer = %src_peer_id, "circuit from a peer accepted through a relay");
        }
    }
}

fn relay_server_event(ev: relay::Event) {
    match ev {
        relay::Event::ReservationReqAccepted { src_peer_id, renewed: false } => {
            info!(peer = %src_peer_id, "relay: reservation accepted");
        }
        relay::Event::CircuitReqAccepted { src_peer_id, dst_peer_id } => {
            info!(src = %src_peer_id, dst = %dst_peer_id, "relay: circuit opened");
        }
        relay::Event::CircuitClosed { src_peer_id, dst_peer_id, error } => {
            debug!(src = %src_peer_id, dst = %dst_peer_id, error = ?error, "relay: circuit closed");
        }
        relay::Event::ReservationReqDenied { src_peer_id, status } => {
            warn!(peer = %src_peer_id, ?status, "relay: reservation denied");
        }
        // NO_RESERVATION is routine: peers try every relay for a peer.
        relay::Event::CircuitReqDenied { src_peer_id, dst_peer_id, status } => {
            debug!(src = %src_peer_id, dst = %dst_peer_id, ?status, "relay: circuit denied");
        }
        other => debug!(event = ?other, "relay"),
    }
}

/// A `PushPull` in two halves: the push's outcome, then (if the gradient
/// was accepted) the state the owner parked the pull for.
type Half<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// What became of a `PushPull`'s push: accepted, with the pull to await
/// for its answer; or the final answer (a refusal, an error).
enum Taken {
    Accepted { accepted: Accepted, since: Instant, answer: Half<ShardResponse> },
    Answered(ShardResponse),
}

/// Serve one `PushPull` (alone or in a `PushPullMany`): the push's outcome
/// comes first (at once for a refusal). Link emulation is the caller's.
fn serve_push_pull(
    peer: PeerId,
    routes: &Routes,
    run: &RunId,
    encoded: &Arc<EncodedStates>,
    p: PushPull,
) -> Half<Taken> {
    let now = |resp: ShardResponse| -> Half<Taken> { Box::pin(std::future::ready(Taken::Answered(resp))) };
    let Some(agg) = &routes.aggregator else {
        // Peers can agree on the roster a moment before we do: ask them to retry.
        return now(wire_error(ErrorCode::Busy, "training has not started on this node yet"));
    };
    let grad = match Contribution::decode(&p.push.grad) {
        Ok(g) => g,
        Err(e) => return now(ShardResponse::error(&e)),
    };
    let shard = p.push.shard;
    let encoding = p.encoding;
    let wait = Duration::from_millis(p.max_wait_ms as u64);
    let epoch = routes.epoch;
    let run = run.clone();
    let encoded = encoded.clone();
    let push = (shard, p.push.base_version, p.push.samples, grad);
    let Ok((pushed, pulled)) = agg.try_push_pull(peer, push, wait, p.have) else {
        return now(wire_error(ErrorCode::Busy, "aggregator busy"));
    };
    Box::pin(async move {
        match pushed.await {
            Ok(PushReply::Accepted { version, staleness }) => {
                let since = Instant::now();
                let accepted = Accepted { shard, version, staleness };
                let held = accepted.clone();
                let answer = Box::pin(async move {
                    let accepted = held;
                    let pulled = pulled.await;
                    // Held until the version came, not while encoding it
                    // (the owner's own work, part of its service time).
                    let held_ms = held_ms(since);
                    match pulled {
                        Ok(PullReply::State { version, params }) => {
                            match shard_state(&encoded, run, (shard, version, epoch), &params, encoding).await {
                                Ok(s) => ShardResponse::Exchanged(Exchanged { accepted, held_ms, state: Some(s) }),
                                Err(e) => ShardResponse::error(&e),
                            }
                        }
                        Ok(PullReply::Delta(d)) => {
                            let state = Some(delta_state(run, (shard, epoch), &d));
                            ShardResponse::Exchanged(Exchanged { accepted, held_ms, state })
                        }
                        // The gradient counts; the worker pulls
                        // (NotOwner: the shard moved after it was taken).
                        Ok(PullReply::NotReady { .. } | PullReply::NotOwner { .. }) => {
                            ShardResponse::Exchanged(Exchanged { accepted, held_ms, state: None })
                        }
                        Err(_) => wire_error(ErrorCode::Internal, "aggregator stopped"),
                    }
                });
                Taken::Accepted { accepted, since, answer }
            }
            Ok(r) => Taken::Answered(push_response(shard, r)),
            Err(_) => Taken::Answered(wire_error(ErrorCode::Internal, "aggregator stopped")),
        }
    })
}

/// The answer to one `PushPull`: its push's outcome, then its state.
async fn push_pull_answer(taken: Half<Taken>) -> ShardResponse {
    match taken.await {
        Taken::Accepted { answer, .. } => answer.await,
        Taken::Answered(resp) => resp,
    }
}

/// The answers to a `PushPullMany`. Every push's outcome comes first. If
/// any entry was refused, all are answered at once, the accepted ones as
/// `Exchanged` without a state (their gradients count; the worker pulls
/// them): a refusal (a shard that moved, a stale round) must reach the
/// worker without waiting for the other shards' rounds, which may be
/// waiting on this very worker's re-push elsewhere. The same holds once
/// every push was taken: the first shard whose pull ends without a state
/// (it was handed over after its push was taken, or its wait ran out)
/// ends the batch, and the shards still waiting for their rounds are
/// answered without a state too. Holding the moved shard's answer for
/// them left the worker unable to push that shard to its new owner, whose
/// round waited for it while the rounds here waited for workers stuck on
/// that new owner's round: a cycle that only the round timeout broke (a
/// join in a 4-node testnet, 2026-12-06).
async fn push_pull_many_answers(taken: Vec<Half<Taken>>) -> Vec<ShardResponse> {
    let taken = futures::future::join_all(taken).await;
    let refused = !taken.iter().all(|t| matches!(t, Taken::Accepted { .. }));
    let mut out: Vec<Option<ShardResponse>> = (0..taken.len()).map(|_| None).collect();
    let mut held = Vec::new();
    let mut waiting = FuturesUnordered::new();
    for (i, t) in taken.into_iter().enumerate() {
        match t {
            Taken::Accepted { accepted, since, answer } if !refused => {
                held.push((i, accepted, since));
                waiting.push(async move { (i, answer.await) });
            }
            Taken::Accepted { accepted, since, .. } => held.push((i, accepted, since)),
            Taken::Answered(resp) => out[i] = Some(resp),
        }
    }
    while let Some((i, resp)) = waiting.next().await {
        let served = matches!(&resp, ShardResponse::Exchanged(x) if x.state.is_some());
        out[i] = Some(resp);
        if !served {
            break;
        }
    }
    for (i, accepted, since) in held {
        if out[i].is_none() {
            out[i] = Some(ShardResponse::Exchanged(Exchanged { accepted, held_ms: held_ms(since), state: None }));
        }
    }
    out.into_iter().map(|r| r.unwrap_or_else(|| wire_error(ErrorCode::Internal, "no answer"))).collect()
}

/// The wire answer to a push.
fn push_response(shard: u32, r: PushReply) -> ShardResponse {
    match r {
        PushReply::Accepted { version, staleness } => ShardResponse::Accepted(Accepted { shard, version, staleness }),
        PushReply::Stale { current_version, max_staleness } => {
            ShardResponse::Stale { shard, current_version, max_staleness }
        }
        PushReply::NotOwner { epoch, hint } => ShardResponse::NotOwner { shard, epoch, hint },
        PushReply::Pending => wire_error(ErrorCode::Busy, format!("shard {shard} is being handed over")),
        // The owner's view lost the worker: its write is fenced off.
        PushReply::UnknownWorker => ShardResponse::Fenced { shard, epoch: 0 },
        PushReply::Invalid(m) => wire_error(ErrorCode::InvalidRequest, m),
    }
}

/// A shard's parameters as sent to a puller, in the encoding it asked for
/// (the owner's copy stays f32), encoded once per state (`encoded`).
/// The answer to a pull from the aggregator's reply to it: the shard's
/// state (encoded once for every pull of the round), not ready yet, or not
/// owned here.
async fn pull_response(
    reply: Result<PullReply, oneshot::error::RecvError>,
    encoded: &EncodedStates,
    run: RunId,
    (shard, epoch): (u32, u64),
    encoding: Encoding,
) -> ShardResponse {
    match reply {
        Ok(PullReply::State { version, params }) => {
            match shard_state(encoded, run, (shard, version, epoch), &params, encoding).await {
                Ok(s) => ShardResponse::ShardState(s),
                Err(e) => ShardResponse::error(&e),
            }
        }
        Ok(PullReply::Delta(d)) => ShardResponse::ShardState(delta_state(run, (shard, epoch), &d)),
        Ok(PullReply::NotReady { current_version }) => ShardResponse::NotReady { shard, current_version },
        Ok(PullReply::NotOwner { epoch, hint }) => ShardResponse::NotOwner { shard, epoch, hint },
        Err(_) => wire_error(ErrorCode::Internal, "aggregator stopped"),
    }
}

/// A round's update as the answer to a pull (delta pulls): encoded once,
/// when the owner took the round.
fn delta_state(run: RunId, (shard, epoch): (u32, u64), d: &ShardDelta) -> ShardState {
    ShardState {
        run,
        shard,
        version: d.version,
        epoch,
        params: d.payload.clone(),
        delta: Some(DeltaOf { base: d.base, hash: d.hash }),
    }
}

async fn shard_state(
    encoded: &EncodedStates,
    run: RunId,
    (shard, version, epoch): (u32, u64, u64),
    params: &Arc<Vec<f32>>,
    encoding: Encoding,
) -> Result<ShardState, shoal_protocol::ProtocolError> {
    Ok(ShardState { run, shard, version, epoch, params: encoded.get(shard, params, encoding).await?, delta: None })
}

/// The longest time an answer (or a batch's answers) was held for its
/// round, in ms: not part of the owner's service.
fn answer_held_ms(answer: &ShardResponse) -> u32 {
    match answer {
        ShardResponse::Exchanged(x) => x.held_ms,
        ShardResponse::ExchangedMany(v) => v.iter().map(answer_held_ms).max().unwrap_or(0),
        _ => 0,
    }
}

/// Milliseconds since `since`, for `Exchanged::held_ms`.
fn held_ms(since: Instant) -> u32 {
    since.elapsed().as_millis().min(u32::MAX as u128) as u32
}

#[cfg(test)]
mod tests {
    use std::io::ErrorKind;
    use std::net::TcpListener;
    use std::sync::Arc;

    use shoal_protocol::libp2p::identity::Keypair;
    use shoal_protocol::{build_swarm, Encoding, ProtocolConfig, PullShard, RunId, ShardRequest, ValidationContext};

    use super::*;
    use crate::handles::net::{ModelSnapshot, Routes};

    #[tokio::test]
    async fn a_round_s_pulls_share_one_encoding_and_past_states_are_let_go() {
        let cache = EncodedStates::default();
        let round = Arc::new(vec![1.0f32, 2.0, 3.0]);
        let a = cache.get(0, &round, Encoding::F32).await.expect("encodes");
        let b = cache.get(0, &round.clone(), Encoding::F32).await.expect("encodes");
        assert_eq!(a.decode().expect("decodes"), *round);
        assert_eq!(a.data().as_ptr(), b.data().as_ptr(), "the second pull gets the first one's buffer");
        // Another encoding of the same state is its own entry.
        let half = cache.get(0, &round, Encoding::Bf16).await.expect("encodes");
        assert_eq!(half.decode().expect("decodes"), *round);
        // The next round's parameters (a new Arc) are encoded afresh, even
        // with the same values; the old round's entries go once no one
        // holds its parameters.
        drop(round);
        let next = Arc::new(vec![4.0f32, 5.0, 6.0]);
        let c = cache.get(0, &next, Encoding::F32).await.expect("encodes");
        assert_eq!(c.decode().expect("decodes"), *next);
        assert_eq!(
            cache.entries.lock().expect("not poisoned").len(),
            1,
            "the past round's f32 and bf16 entries are gone"
        );
        // Encodings no worker pulls in are not kept.
        let int8 = cache.get(1, &next, Encoding::Int8 { block: 2 }).await.expect("encodes");
        assert_eq!(int8.numel(), 3);
        assert_eq!(cache.entries.lock().expect("not poisoned").len(), 1);
    }

    /// A refusal in a batch, or a shard handed over after its push was
    /// taken, is answered without waiting for the other shards' rounds: the
    /// accepted entries go back without a state (their gradients count, the
    /// worker pulls them).
    #[tokio::test]
    async fn a_refusal_or_a_moved_shard_in_a_batch_is_answered_without_waiting_for_the_rounds() {
        let accepted = Accepted { shard: 0, version: 7, staleness: 0 };
        let never: Half<ShardResponse> = Box::pin(futures::future::pending());
        let waiting: Half<Taken> = Box::pin(std::future::ready(Taken::Accepted {
            accepted: accepted.clone(),
            since: Instant::now(),
            answer: never,
        }));
        let moved = ShardResponse::NotOwner { shard: 1, epoch: 3, hint: None };
        let refused: Half<Taken> = Box::pin(std::future::ready(Taken::Answered(moved.clone())));
        let answers = push_pull_many_answers(vec![waiting, refused]).await;
        assert_eq!(answers.len(), 2);
        assert!(
            matches!(&answers[0], ShardResponse::Exchanged(Exchanged { accepted: a, state: None, .. }) if *a == accepted),
            "{:?}",
            answers[0]
        );
        assert_eq!(answers[1], moved);

        // All accepted: each answer is its state, in order.
        let state = |shard: u32| -> Half<Taken> {
            let accepted = Accepted { shard, version: 1, staleness: 0 };
            let resp = ShardResponse::Exchanged(Exchanged { accepted: accepted.clone(), held_ms: 0, state: None });
            Box::pin(std::future::ready(Taken::Accepted {
                accepted,
                since: Instant::now(),
                answer: Box::pin(std::future::ready(resp)),
            }))
        };
        let answers = push_pull_many_answers(vec![state(4), state(2)]).await;
        let shards: Vec<u32> = answers
            .iter()
            .filter_map(|a| match a {
                ShardResponse::Exchanged(x) => Some(x.accepted.shard),
                _ => None,
            })
            .collect();
        assert_eq!(shards, vec![4, 2]);

        // All accepted, one shard then handed over (its pull ends without
        // a state) while the other's round waits: the batch is answered at
        // once, the waiting shard without a state.
        let held: Half<Taken> = Box::pin(std::future::ready(Taken::Accepted {
            accepted: accepted.clone(),
            since: Instant::now(),
            answer: Box::pin(futures::future::pending()),
        }));
        let answers = tokio::time::timeout(Duration::from_secs(5), push_pull_many_answers(vec![held, state(1)]))
            .await
            .expect("not held for the waiting round");
        assert!(
            matches!(&answers[0], ShardResponse::Exchanged(Exchanged { accepted: a, state: None, .. }) if *a == accepted),
            "{:?}",
            answers[0]
        );
        assert!(matches!(&answers[1], ShardResponse::Exchanged(x) if x.accepted.shard == 1), "{:?}", answers[1]);
    }

    #[test]
    fn the_failed_set_forgets_the_oldest_mark_first() {
        let peers: Vec<PeerId> =
            (0..MAX_FAILED + 2).map(|_| Keypair::generate_ed25519().public().to_peer_id()).collect();
        let mut failed = FailedPeers::default();
        for p in &peers[..MAX_FAILED] {
            failed.insert(*p);
        }
        // Marked again, the first becomes the newest; the second is then the oldest.
        failed.insert(peers[0]);
        failed.insert(peers[MAX_FAILED]);
        assert!(failed.contains(&peers[0]) && !failed.contains(&peers[1]) && failed.contains(&peers[MAX_FAILED]));
        // A cleared mark frees its place: nothing else is forgotten.
        failed.remove(&peers[2]);
        failed.insert(peers[MAX_FAILED + 1]);
        assert!(failed.contains(&peers[3]) && !failed.contains(&peers[2]));
        assert_eq!((failed.set.len(), failed.order.len()), (MAX_FAILED, MAX_FAILED));
    }

    /// Connections the listener has been given since the last call.
    fn accepted(listener: &TcpListener) -> usize {
        let mut n = 0;
        loop {
            match listener.accept() {
                Ok(_) => n += 1,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return n,
                Err(e) => panic!("accept: {e}"),
            }
        }
    }

    /// A peer that takes TCP connections and never answers the handshake,
    /// as a frozen process's (or a `docker kill`ed machine's) listening
    /// socket does. Once the failure detector marks it, a request to it
    /// fails at once without a connection; before, each request dialled it
    /// and hung for the handshake timeout (20 s by default), and the
    /// worker's BSP rounds waited with it (issue 16's freeze runs). Dialled
    /// on purpose, requests to it go out again. (A heartbeat clears the mark
    /// too; that needs gossip, and the testnet runs cover it.)
    #[tokio::test]
    async fn requests_do_not_dial_a_peer_declared_dead() -> anyhow::Result<()> {
        let frozen = TcpListener::bind("127.0.0.1:0")?;
        frozen.set_nonblocking(true)?;
        let port = frozen.local_addr()?.port();
        let addr: Multiaddr = format!("/ip4/127.0.0.1/tcp/{port}").parse()?;
        let peer = Keypair::generate_ed25519().public().to_peer_id();
        let run = RunId::new("failed-peer".to_string())?;
        let mut cfg = ProtocolConfig { run_id: run.clone(), listen: Vec::new(), quic: false, ..Default::default() };
        cfg.discovery.mdns = false;
        // Short, so that the dials this test expects to hang end soon.
        cfg.timeouts.handshake_ms = 300;
        let key = Keypair::generate_ed25519();
        let signer = GossipSigner::new(&key)?;
        let mut swarm = build_swarm(&cfg, key)?;
        swarm.add_peer_address(peer, addr);
        let net = spawn_test_actor(swarm, signer, cfg, &run);
        let pull = || {
            ShardRequest::PullShard(PullShard {
                run: run.clone(),
                shard: 0,
                min_version: 0,
                max_wait_ms: 0,
                encoding: Encoding::F32,
                have: None,
            })
        };
        // Not marked: the request dials the peer, which takes the TCP
        // connection and then says nothing until the handshake times out.
        let e = net.request(peer, pull()).await.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(!e.is_empty() && !e.contains("not dialling"), "{e}");
        assert!(accepted(&frozen) >= 1, "the first request dialled the peer: {e}");
        // Declared dead: requests fail at once, and nothing dials it.
        net.disconnect(peer);
        for _ in 0..3 {
            let e = net.request(peer, pull()).await.err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains("the peer failed") && e.contains("not dialling"), "{e}");
        }
        assert_eq!(accepted(&frozen), 0, "a failed peer was dialled");
        // An explicit dial clears the mark: requests go to libp2p again
        // (which dropped the address after the failed dial and says so).
        let _ = net.dial(format!("/ip4/127.0.0.1/tcp/{port}/p2p/{peer}").parse()?).await;
        assert!(accepted(&frozen) >= 1, "the explicit dial reached the peer");
        let e = net.request(peer, pull()).await.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(!e.is_empty() && !e.contains("not dialling"), "{e}");
        Ok(())
    }

    /// A `Timed` request is answered with the request's own answer and the
    /// responder's service time, which holds its serving delay but not the
    /// requester's waits; requests that are not timed, and a `Timed` inside
    /// a `Timed`, are refused.
    #[tokio::test]
    async fn a_timed_request_is_answered_with_the_responders_own_service_time() -> anyhow::Result<()> {
        let run = RunId::new("timed".to_string())?;
        let slow_faults = Arc::new(crate::ops::faults::Faults::new(60, 1.0).map_err(anyhow::Error::msg)?);
        let (a, fast, slow) = (loopback_actor(&run)?, loopback_actor(&run)?, loopback_actor_with(&run, slow_faults)?);
        for peer in [&fast, &slow] {
            let addr =
                peer.listen_addrs().await?.into_iter().next().ok_or_else(|| anyhow::anyhow!("listens nowhere"))?;
            a.dial(addr).await?;
        }
        let probe = || -> anyhow::Result<ShardRequest> {
            Ok(ShardRequest::Probe(shoal_protocol::Probe {
                run: run.clone(),
                padding: Payload::encode(&[0.0f32; 256], Encoding::F32)?,
            }))
        };
        let timed = |r: ShardRequest| ShardRequest::Timed(Box::new(r));
        let service = |resp: ShardResponse| -> anyhow::Result<Duration> {
            match resp {
                ShardResponse::Timed { service_us, answer }
                    if matches!(*answer, ShardResponse::Probed { bytes: 1024 }) =>
                {
                    Ok(Duration::from_micros(service_us.into()))
                }
                other => anyhow::bail!("not a timed probe answer: {other:?}"),
            }
        };
        let sent = Instant::now();
        let slow_service = service(a.request(slow.local_peer(), timed(probe()?)).await?)?;
        let round_trip = sent.elapsed();
        assert!(slow_service >= Duration::from_millis(60), "the serving delay counts: {slow_service:?}");
        assert!(slow_service <= round_trip, "{slow_service:?} within the round trip {round_trip:?}");
        let fast_service = service(a.request(fast.local_peer(), timed(probe()?)).await?)?;
        assert!(fast_service < Duration::from_millis(60), "a healthy responder: {fast_service:?}");
        // Alone, the same request gets its plain answer.
        assert!(matches!(a.request(fast.local_peer(), probe()?).await?, ShardResponse::Probed { bytes: 1024 }));
        // Only what the detector times may be wrapped, once.
        let pull = ShardRequest::PullShard(PullShard {
            run: run.clone(),
            shard: 0,
            min_version: 0,
            max_wait_ms: 0,
            encoding: Encoding::F32,
            have: None,
        });
        for refused in [timed(pull), timed(timed(probe()?))] {
            let answer = a.request(fast.local_peer(), refused).await?;
            assert!(matches!(&answer, ShardResponse::Error(e) if e.code == ErrorCode::InvalidRequest), "{answer:?}");
        }
        Ok(())
    }

    /// A network actor on loopback TCP with no routes (it only pings, dials
    /// and answers errors).
    fn loopback_actor(run: &RunId) -> anyhow::Result<NetworkHandle> {
        loopback_actor_with(run, Arc::new(crate::ops::faults::Faults::default()))
    }

    /// [`loopback_actor`] with these injected faults.
    fn loopback_actor_with(run: &RunId, faults: Arc<crate::ops::faults::Faults>) -> anyhow::Result<NetworkHandle> {
        let mut cfg = ProtocolConfig {
            run_id: run.clone(),
            listen: vec!["/ip4/127.0.0.1/tcp/0".parse()?],
            quic: false,
            ..Default::default()
        };
        cfg.discovery.mdns = false;
        let key = Keypair::generate_ed25519();
        let signer = GossipSigner::new(&key)?;
        Ok(spawn_test_actor_with(build_swarm(&cfg, key)?, signer, cfg, run, faults))
    }

    /// A network actor over `swarm` (signing its gossip with `signer`, the
    /// swarm's key) with no routes.
    fn spawn_test_actor(
        swarm: Swarm<ShoalBehaviour>,
        signer: GossipSigner,
        cfg: ProtocolConfig,
        run: &RunId,
    ) -> NetworkHandle {
        spawn_test_actor_with(swarm, signer, cfg, run, Arc::new(crate::ops::faults::Faults::default()))
    }

    /// [`spawn_test_actor`] with these injected faults.
    fn spawn_test_actor_with(
        swarm: Swarm<ShoalBehaviour>,
        signer: GossipSigner,
        cfg: ProtocolConfig,
        run: &RunId,
        faults: Arc<crate::ops::faults::Faults>,
    ) -> NetworkHandle {
        let (heard, _hb) = mpsc::channel(4);
        let (_routes_tx, routes) = watch::channel(Routes { aggregator: None, epoch: 0 });
        let (_snap_tx, snapshot) = watch::channel(ModelSnapshot { version: 0, params: Arc::new(Vec::new()) });
        let ctx = ValidationContext::new(run.clone(), 1, cfg.limits.clone(), &cfg.timeouts);
        spawn(
            swarm,
            NetworkParts {
                config: cfg,
                ctx,
                shard_ranges: std::iter::once(0..1).collect(),
                heard,
                routes,
                snapshot,
                capacity: 16,
                optimizer: shoal_models::OptimizerConfig::new(shoal_models::OptimizerKind::Sgd, 0.1),
                faults,
                signer,
            },
            &crate::ops::tasks::NodeTasks::new(),
        )
    }

    /// Polls `f` every 10 ms until it holds, for at most 10 s.
    async fn until(what: &str, mut f: impl FnMut() -> bool) -> anyhow::Result<()> {
        tokio::time::timeout(Duration::from_secs(10), async {
            while !f() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .map_err(|_| anyhow::anyhow!("not within 10 s: {what}"))
    }

    #[tokio::test]
    async fn the_path_round_trip_is_measured_by_ping_and_forgotten_with_the_connection() -> anyhow::Result<()> {
        let run = RunId::new("path-rtt".to_string())?;
        let (a, b) = (loopback_actor(&run)?, loopback_actor(&run)?);
        let b_addr = b.listen_addrs().await?.into_iter().next().ok_or_else(|| anyhow::anyhow!("b listens nowhere"))?;
        assert_eq!(a.path_rtt_micros(&b.local_peer()), None, "no ping before a connection");
        assert_eq!(a.dial(b_addr).await?, b.local_peer());
        // libp2p pings a new connection at once, then every 15 s.
        until("a ping round trip to b", || a.path_rtt_micros(&b.local_peer()).is_some()).await?;
        let rtt = a.path_rtt_micros(&b.local_peer()).unwrap_or(f64::NAN);
        assert!(rtt > 0.0 && rtt < 1e6, "loopback round trip {rtt} µs");
        // b goes away: a's last connection to it closes and its path is forgotten.
        b.shutdown().await;
        until("b's path forgotten", || a.path_rtt_micros(&b.local_peer()).is_none()).await?;
        Ok(())
    }
}
