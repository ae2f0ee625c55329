//! The wire benchmark (`cargo bench -p shoal-protocol --bench wire`, and
//! later `shoal bench wire`). Every figure is a ratio to a baseline measured
//! in the same run: shard transfers against raw tokio TCP loopback, payload
//! encode/decode against a plain memcpy of the same f32 bytes.

use std::fmt;
use std::time::{Duration, Instant};

use futures::StreamExt;
use libp2p::identity::Keypair;
use libp2p::multiaddr::Protocol;
use libp2p::request_response;
use libp2p::swarm::SwarmEvent;
use libp2p::{Multiaddr, PeerId, Swarm};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::behaviour::{build_swarm, ShoalBehaviour, ShoalBehaviourEvent};
use crate::config::{Discovery, ProtocolConfig};
use crate::error::{ProtocolError, Result};
use crate::messages::{PullShard, RunId, ShardRequest, ShardResponse, ShardState};
use crate::payload::{Encoding, Payload, DEFAULT_INT8_BLOCK};

/// What to measure.
#[derive(Debug, Clone)]
pub struct WireBenchOptions {
    /// Bytes of the shard moved over the network (f32 payload). Default 100 MB.
    pub shard_bytes: usize,
    /// Timed rounds per measurement (after one warm-up); the best is
    /// reported. Default 3.
    pub rounds: usize,
    /// Elements in the encode/decode benchmark. Default 8 Mi (32 MiB of f32).
    pub codec_elements: usize,
    /// Also measure QUIC. Default true.
    pub quic: bool,
    /// Also measure payload codecs. Default true.
    pub codecs: bool,
}

impl Default for WireBenchOptions {
    fn default() -> Self {
        WireBenchOptions { shard_bytes: 100_000_000, rounds: 3, codec_elements: 8 << 20, quic: true, codecs: true }
    }
}

/// One transfer measurement.
#[derive(Debug, Clone)]
pub struct TransferResult {
    /// Transport name.
    pub name: &'static str,
    /// Best wall time of one transfer.
    pub best: Duration,
    /// Payload MB/s (10^6 bytes) at the best time.
    pub mb_per_s: f64,
    /// `mb_per_s` over raw TCP's.
    pub ratio_to_raw_tcp: f64,
}

/// One payload encoding measurement.
#[derive(Debug, Clone)]
pub struct CodecResult {
    /// Encoding name.
    pub encoding: String,
    /// Wire bytes per input element (4.0 for f32).
    pub bytes_per_element: f64,
    /// Input f32 MB/s when encoding.
    pub encode_mb_per_s: f64,
    /// Output f32 MB/s when decoding (including checksum verification).
    pub decode_mb_per_s: f64,
    /// Encode throughput over memcpy into a fresh allocation (encoders
    /// allocate their output too).
    pub encode_ratio_to_memcpy: f64,
    /// Decode throughput over memcpy into a preallocated buffer (decoding
    /// uses `decode_into` a preallocated buffer).
    pub decode_ratio_to_memcpy: f64,
}

/// The two memcpy baselines.
#[derive(Debug, Clone, Copy)]
pub struct Memcpy {
    /// Copy into an existing buffer, MB/s.
    pub preallocated_mb_per_s: f64,
    /// `to_vec()`: allocate and copy, MB/s.
    pub fresh_alloc_mb_per_s: f64,
}

/// The whole report.
#[derive(Debug, Clone)]
pub struct WireReport {
    /// Options used.
    pub options: WireBenchOptions,
    /// Raw tokio TCP loopback (the baseline, ratio 1.0).
    pub raw_tcp: TransferResult,
    /// `/shoal/shard/12.0.0` over TCP + noise + yamux.
    pub tcp_noise_yamux: TransferResult,
    /// `/shoal/shard/12.0.0` over QUIC.
    pub quic: Option<TransferResult>,
    /// memcpy baselines for `codec_elements` f32.
    pub memcpy: Memcpy,
    /// One row per encoding.
    pub codecs: Vec<CodecResult>,
}

impl fmt::Display for WireReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "shard transfer: {} bytes, best of {} rounds", self.options.shard_bytes, self.options.rounds)?;
        writeln!(f, "{:<28} {:>10} {:>10} {:>12}", "transport", "time ms", "MB/s", "x raw TCP")?;
        for t in [Some(&self.raw_tcp), Some(&self.tcp_noise_yamux), self.quic.as_ref()].into_iter().flatten() {
            writeln!(
                f,
                "{:<28} {:>10.1} {:>10.0} {:>12.3}",
                t.name,
                t.best.as_secs_f64() * 1e3,
                t.mb_per_s,
                t.ratio_to_raw_tcp
            )?;
        }
        writeln!(f)?;
        writeln!(
            f,
            "payload codecs: {} f32 elements; memcpy {:.0} MB/s into a preallocated buffer (decode baseline), \
             {:.0} MB/s into a fresh allocation (encode baseline)",
            self.options.codec_elements, self.memcpy.preallocated_mb_per_s, self.memcpy.fresh_alloc_mb_per_s
        )?;
        writeln!(
            f,
            "{:<16} {:>10} {:>12} {:>10} {:>12} {:>10}",
            "encoding", "bytes/elem", "encode MB/s", "x memcpy", "decode MB/s", "x memcpy"
        )?;
        for c in &self.codecs {
            writeln!(
                f,
                "{:<16} {:>10.3} {:>12.0} {:>10.3} {:>12.0} {:>10.3}",
                c.encoding,
                c.bytes_per_element,
                c.encode_mb_per_s,
                c.encode_ratio_to_memcpy,
                c.decode_mb_per_s,
                c.decode_ratio_to_memcpy
            )?;
        }
        Ok(())
    }
}

fn mb_per_s(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / 1e6 / t.as_secs_f64().max(1e-9)
}

/// Times `f` once to warm up, then `rounds` times; returns the best time.
fn best_of(rounds: usize, mut f: impl FnMut() -> Result<()>) -> Result<Duration> {
    f()?;
    let mut best = Duration::MAX;
    for _ in 0..rounds.max(1) {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed());
    }
    Ok(best)
}

/// Runs the whole benchmark. Needs a multi-threaded tokio runtime.
pub async fn run_wire_bench(options: WireBenchOptions) -> Result<WireReport> {
    let raw_best = raw_tcp_transfer(options.shard_bytes, options.rounds).await?;
    let raw_mbps = mb_per_s(options.shard_bytes, raw_best);
    let raw_tcp = TransferResult { name: "raw tokio TCP", best: raw_best, mb_per_s: raw_mbps, ratio_to_raw_tcp: 1.0 };

    let result = |name, best: Duration| {
        let mbps = mb_per_s(options.shard_bytes, best);
        TransferResult { name, best, mb_per_s: mbps, ratio_to_raw_tcp: mbps / raw_mbps }
    };
    let tcp_best = swarm_transfer("/ip4/127.0.0.1/tcp/0", options.shard_bytes, options.rounds).await?;
    let tcp_noise_yamux = result("TCP+noise+yamux (shard rr)", tcp_best);
    let quic = if options.quic {
        let best = swarm_transfer("/ip4/127.0.0.1/udp/0/quic-v1", options.shard_bytes, options.rounds).await?;
        Some(result("QUIC (shard rr)", best))
    } else {
        None
    };

    let (memcpy, codecs) = if options.codecs {
        codec_bench(options.codec_elements, options.rounds)?
    } else {
        (Memcpy { preallocated_mb_per_s: 0.0, fresh_alloc_mb_per_s: 0.0 }, Vec::new())
    };
    Ok(WireReport { options, raw_tcp, tcp_noise_yamux, quic, memcpy, codecs })
}

/// Best time of `rounds` (after a warm-up) to move `bytes` over one raw tokio
/// TCP loopback connection and get a 1-byte ack: the physical baseline.
pub async fn raw_tcp_transfer(bytes: usize, rounds: usize) -> Result<Duration> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let rounds = rounds.max(1);
    let server = tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await?;
        sock.set_nodelay(true)?;
        let mut buf = vec![0u8; bytes];
        for _ in 0..=rounds {
            sock.read_exact(&mut buf).await?;
            sock.write_all(&[1]).await?;
        }
        Ok::<_, std::io::Error>(())
    });
    let mut sock = tokio::net::TcpStream::connect(addr).await?;
    sock.set_nodelay(true)?;
    let data = vec![0x5au8; bytes];
    let mut ack = [0u8; 1];
    let mut best = Duration::MAX;
    // Round 0 is the warm-up.
    for round in 0..=rounds {
        let t = Instant::now();
        sock.write_all(&data).await?;
        sock.read_exact(&mut ack).await?;
        if round > 0 {
            best = best.min(t.elapsed());
        }
    }
    server.await.map_err(|e| ProtocolError::Transport(format!("raw TCP server task: {e}")))??;
    Ok(best)
}

fn bench_config(listen: &str) -> Result<ProtocolConfig> {
    let run = RunId::new("bench")?;
    let mut cfg = ProtocolConfig::local(run);
    cfg.listen = vec![listen.parse().map_err(|e| ProtocolError::Config(format!("{listen}: {e}")))?];
    cfg.discovery = Discovery { mdns: false, kademlia: false, ..Discovery::default() };
    Ok(cfg)
}

/// Waits for the first listen address of a fresh swarm.
async fn first_listen_addr(swarm: &mut Swarm<ShoalBehaviour>) -> Result<Multiaddr> {
    let wait = async {
        loop {
            if let SwarmEvent::NewListenAddr { address, .. } = swarm.select_next_some().await {
                return address;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), wait)
        .await
        .map_err(|_| ProtocolError::Transport("no listen address within 10 s".into()))
}

async fn swarm_transfer(listen: &str, bytes: usize, rounds: usize) -> Result<Duration> {
    let cfg = bench_config(listen)?;
    let elements = bytes / 4;
    let values: Vec<f32> = (0..elements).map(|i| (i % 1000) as f32 * 1e-3).collect();
    let state = ShardState {
        run: cfg.run_id.clone(),
        shard: 0,
        version: 1,
        epoch: 0,
        params: Payload::encode(&values, Encoding::F32)?,
        delta: None,
    };
    drop(values);

    let mut server = build_swarm(&cfg, Keypair::generate_ed25519())?;
    let server_id = *server.local_peer_id();
    let addr = first_listen_addr(&mut server).await?.with(Protocol::P2p(server_id));
    let server_task = tokio::spawn(async move {
        loop {
            if let SwarmEvent::Behaviour(ShoalBehaviourEvent::Shard(request_response::Event::Message {
                message: request_response::Message::Request { channel, .. },
                ..
            })) = server.select_next_some().await
            {
                let reply = ShardResponse::ShardState(state.clone());
                if server.behaviour_mut().shard.send_response(channel, reply).is_err() {
                    tracing::warn!("bench: response channel closed");
                }
            }
        }
    });

    let mut client_cfg = cfg.clone();
    client_cfg.listen.clear();
    let mut client = build_swarm(&client_cfg, Keypair::generate_ed25519())?;
    let run = cfg.run_id.clone();
    let outcome = async {
        client.dial(addr).map_err(|e| ProtocolError::Transport(format!("dial: {e}")))?;
        wait_connected(&mut client, server_id).await?;
        let mut best = Duration::MAX;
        for round in 0..=rounds.max(1) {
            let req = ShardRequest::PullShard(PullShard {
                run: run.clone(),
                shard: 0,
                min_version: 0,
                max_wait_ms: 0,
                encoding: Encoding::F32,
                have: None,
            });
            let t = Instant::now();
            let resp = request(&mut client, server_id, req).await?;
            let elapsed = t.elapsed();
            match resp {
                ShardResponse::ShardState(s) if s.params.byte_len() as usize == elements * 4 => {}
                other => return Err(ProtocolError::Transport(format!("bench: unexpected response {}", other.kind()))),
            }
            if round > 0 {
                best = best.min(elapsed);
            }
        }
        Ok(best)
    };
    let res = tokio::time::timeout(Duration::from_secs(300), outcome)
        .await
        .unwrap_or_else(|_| Err(ProtocolError::Transport("bench transfer timed out after 300 s".into())));
    server_task.abort();
    res
}

async fn wait_connected(swarm: &mut Swarm<ShoalBehaviour>, peer: PeerId) -> Result<()> {
    loop {
        match swarm.select_next_some().await {
            SwarmEvent::ConnectionEstablished { peer_id, .. } if peer_id == peer => return Ok(()),
            SwarmEvent::OutgoingConnectionError { error, .. } => {
                return Err(ProtocolError::Transport(format!("dial failed: {error}")))
            }
            _ => {}
        }
    }
}

/// Sends one request and drives the swarm until its answer arrives.
async fn request(swarm: &mut Swarm<ShoalBehaviour>, peer: PeerId, req: ShardRequest) -> Result<ShardResponse> {
    let id = swarm.behaviour_mut().send_request(&peer, req);
    loop {
        match swarm.select_next_some().await {
            SwarmEvent::Behaviour(ShoalBehaviourEvent::Shard(request_response::Event::Message {
                message: request_response::Message::Response { request_id, response },
                ..
            })) if request_id == id => return Ok(response),
            SwarmEvent::Behaviour(ShoalBehaviourEvent::Shard(request_response::Event::OutboundFailure {
                request_id,
                error,
                ..
            })) if request_id == id => return Err(ProtocolError::Transport(format!("request failed: {error}"))),
            _ => {}
        }
    }
}

fn codec_bench(elements: usize, rounds: usize) -> Result<(Memcpy, Vec<CodecResult>)> {
    // Gradient-like data: smooth with sign changes, all finite, within f16.
    let values: Vec<f32> = (0..elements).map(|i| ((i as f32) * 0.001).sin() * 3.0).collect();
    let bytes = elements * 4;
    let src = vec![0x11u8; bytes];
    let mut dst = vec![0u8; bytes];
    let memcpy = best_of(rounds, || {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&dst);
        Ok(())
    })?;
    // Encoders allocate their output (fresh pages, faulted in by the
    // kernel), so their baseline is a copy into a fresh allocation too.
    let memcpy_alloc = best_of(rounds, || {
        let copy = std::hint::black_box(&src).to_vec();
        std::hint::black_box(&copy);
        Ok(())
    })?;
    drop((src, dst));
    let memcpy_mbps = mb_per_s(bytes, memcpy);
    let memcpy_alloc_mbps = mb_per_s(bytes, memcpy_alloc);

    let encodings = [
        ("f32", Encoding::F32),
        ("f16", Encoding::F16),
        ("bf16", Encoding::Bf16),
        ("int8/256", Encoding::Int8 { block: DEFAULT_INT8_BLOCK }),
        ("top-k 1%", Encoding::TopK { k: (elements / 100) as u64 }),
    ];
    let mut out = vec![0.0f32; elements];
    let mut rows = Vec::new();
    for (name, enc) in encodings {
        let mut payload = None;
        let enc_t = best_of(rounds, || {
            payload = Some(Payload::encode(std::hint::black_box(&values), enc)?);
            Ok(())
        })?;
        let payload = payload.ok_or_else(|| ProtocolError::Encode("bench: no payload".into()))?;
        let dec_t = best_of(rounds, || payload.decode_into(std::hint::black_box(&mut out)))?;
        let (e, d) = (mb_per_s(bytes, enc_t), mb_per_s(bytes, dec_t));
        rows.push(CodecResult {
            encoding: name.to_owned(),
            bytes_per_element: payload.byte_len() as f64 / elements as f64,
            encode_mb_per_s: e,
            decode_mb_per_s: d,
            encode_ratio_to_memcpy: e / memcpy_alloc_mbps,
            decode_ratio_to_memcpy: d / memcpy_mbps,
        });
    }
    Ok((Memcpy { preallocated_mb_per_s: memcpy_mbps, fresh_alloc_mb_per_s: memcpy_alloc_mbps }, rows))
}
