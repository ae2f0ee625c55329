//! The request-response codec for [`SHARD_PROTOCOL`] (`/shoal/shard/12.0.0`).
//!
//! Framing lives in [`crate::frame`]; this module only moves frames over a
//! stream with size checks before allocation and size-scaled deadlines:
//! every read or write of `n` bytes must finish within
//! `timeouts.base + n / timeouts.min_throughput` (the first byte of a
//! response may take up to `timeouts.response_wait`, so owners can hold a
//! pull until the version exists).

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::future::Either;
use futures::prelude::*;
use libp2p::request_response;
use libp2p::StreamProtocol;

use crate::config::{Limits, Timeouts};
use crate::error::ProtocolError;
use crate::frame::{self, EncodedFrame, FrameKind, FramePrefix, PREFIX_LEN};
use crate::messages::{ShardRequest, ShardResponse};
use crate::wire::SHARD_PROTOCOL_NAME;

/// Protocol id of the shard request-response protocol. It carries the wire
/// version (`/shoal/shard/<version>.0.0`), so multistream-select refuses a
/// peer of another version before any frame: the requester sees
/// `OutboundFailure::UnsupportedProtocols`.
pub const SHARD_PROTOCOL: StreamProtocol = StreamProtocol::new(SHARD_PROTOCOL_NAME);

/// Codec for [`ShardRequest`] / [`ShardResponse`].
///
/// Clones share one read budget: the bytes of all frames being read at once,
/// across every connection of the swarm, stay under
/// `limits.max_inflight_read_bytes`, so peers that announce large frames and
/// then trickle them cannot pin unbounded memory.
#[derive(Debug, Clone)]
pub struct ShardCodec {
    limits: Limits,
    timeouts: Timeouts,
    in_flight: Arc<AtomicU64>,
}

impl Default for ShardCodec {
    fn default() -> Self {
        ShardCodec::new(Limits::default(), Timeouts::default())
    }
}

impl ShardCodec {
    /// A codec enforcing these limits and deadlines.
    pub fn new(limits: Limits, timeouts: Timeouts) -> ShardCodec {
        ShardCodec { limits, timeouts, in_flight: Arc::new(AtomicU64::new(0)) }
    }

    /// Bytes currently reserved by frames being read.
    pub fn in_flight_read_bytes(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    fn reserve(&self, n: u64) -> Result<Reservation, ProtocolError> {
        let max = self.limits.max_inflight_read_bytes;
        let mut cur = self.in_flight.load(Ordering::Relaxed);
        loop {
            let next = cur.saturating_add(n);
            if next > max {
                return Err(ProtocolError::Busy { wanted: n, in_flight: cur, max });
            }
            match self.in_flight.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return Ok(Reservation { counter: self.in_flight.clone(), n }),
                Err(actual) => cur = actual,
            }
        }
    }
}

/// Releases its bytes from the read budget when dropped.
struct Reservation {
    counter: Arc<AtomicU64>,
    n: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.counter.fetch_sub(self.n, Ordering::AcqRel);
    }
}

/// Runs `fut`, failing with `TimedOut` after `after`.
///
/// Inside a tokio runtime (every swarm of a node) the deadline is one of
/// tokio's own timers, kept by the runtime's driver. Elsewhere (another
/// executor, `block_on` in tests) it is a `futures_timer::Delay`, which
/// wakes a process-wide timer thread: with 3 deadlines per frame on each
/// side, that thread cost about 3% of a 4-node demo's CPU, and a context
/// switch per registration. A tokio runtime that polls a swarm must have
/// its timer enabled (`enable_all`, as every runtime of the node has).
async fn with_deadline<T>(
    after: Duration,
    what: &'static str,
    fut: impl Future<Output = io::Result<T>>,
) -> io::Result<T> {
    let timed_out = || -> io::Error { ProtocolError::Timeout { what, after }.into() };
    if tokio::runtime::Handle::try_current().is_ok() {
        return tokio::time::timeout(after, fut).await.unwrap_or_else(|_| Err(timed_out()));
    }
    let fut = std::pin::pin!(fut);
    match future::select(fut, futures_timer::Delay::new(after)).await {
        Either::Left((res, _)) => res,
        Either::Right(_) => Err(timed_out()),
    }
}

/// A frame read off the stream: header bytes, body bytes.
struct RawFrame {
    header: Vec<u8>,
    body: Bytes,
}

async fn read_frame<T: AsyncRead + Unpin + Send>(
    codec: &ShardCodec,
    io: &mut T,
    kind: FrameKind,
    max_frame: u64,
    first_byte_wait: Duration,
) -> io::Result<RawFrame> {
    let (limits, timeouts) = (&codec.limits, &codec.timeouts);
    let mut prefix = [0u8; PREFIX_LEN];
    with_deadline(first_byte_wait, "reading frame prefix", io.read_exact(&mut prefix)).await?;
    let prefix = FramePrefix::parse(&prefix).inspect_err(|e| {
        // Multistream-select refuses a peer of another version before this,
        // so a frame of another version comes from a peer that negotiated a
        // name it does not speak. At debug: such a peer could send one on
        // every stream, and the refused stream's error reaches the node.
        if let ProtocolError::VersionMismatch { ours, theirs } = e {
            tracing::debug!(ours, theirs, "refusing a frame of another wire version");
        }
    })?;
    // Cheap checks before allocating anything the peer asked for: the frame
    // limit, then the shared budget of bytes being read right now.
    prefix.check(kind, max_frame, limits.max_header_bytes)?;
    let rest = prefix.total_len() - PREFIX_LEN as u64;
    let _reservation = codec.reserve(rest).inspect_err(|e| tracing::warn!(error = %e, "refusing frame"))?;
    let (header, body) = with_deadline(timeouts.for_bytes(rest), "reading frame", async {
        let mut header = vec![0u8; prefix.header_len as usize];
        io.read_exact(&mut header).await?;
        // Within max_frame, which the operator sized to fit in memory.
        let mut body = vec![0u8; prefix.body_len as usize];
        io.read_exact(&mut body).await?;
        Ok((header, body))
    })
    .await?;
    Ok(RawFrame { header, body: Bytes::from(body) })
}

async fn write_frame<T: AsyncWrite + Unpin + Send>(
    io: &mut T,
    frame: EncodedFrame,
    timeouts: &Timeouts,
) -> io::Result<()> {
    with_deadline(timeouts.for_bytes(frame.len()), "writing frame", async {
        io.write_all(&frame.head).await?;
        // Bodies go out straight from the payloads' buffers: no concatenation.
        for body in &frame.bodies {
            io.write_all(body).await?;
        }
        io.flush().await
    })
    .await
}

impl ShardCodec {
    async fn read_request_inner<T: AsyncRead + Unpin + Send>(&self, io: &mut T) -> io::Result<ShardRequest> {
        let raw = read_frame(self, io, FrameKind::Request, self.limits.max_request_bytes, self.timeouts.base()).await?;
        // The frame was well formed, of our version and within limits: from
        // here on, problems become an `Undecodable` request that the node
        // answers with an error, so the sender learns why.
        Ok(match frame::decode_message::<ShardRequest>(&raw.header, raw.body, self.limits.max_tensor_elements) {
            Ok(req) => req,
            Err(e) => {
                tracing::debug!(error = %e, "undecodable shard request");
                ShardRequest::Undecodable { code: e.code(), reason: e.to_string() }
            }
        })
    }

    async fn read_response_inner<T: AsyncRead + Unpin + Send>(&self, io: &mut T) -> io::Result<ShardResponse> {
        let raw =
            read_frame(self, io, FrameKind::Response, self.limits.max_response_bytes, self.timeouts.response_wait())
                .await?;
        frame::decode_message::<ShardResponse>(&raw.header, raw.body, self.limits.max_tensor_elements).map_err(|e| {
            tracing::debug!(error = %e, "undecodable shard response");
            io::Error::from(e)
        })
    }
}

impl request_response::Codec for ShardCodec {
    type Protocol = StreamProtocol;
    type Request = ShardRequest;
    type Response = ShardResponse;

    fn read_request<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
    ) -> impl Future<Output = io::Result<ShardRequest>> + Send
    where
        T: AsyncRead + Unpin + Send,
    {
        let this = self.clone();
        async move { this.read_request_inner(io).await }
    }

    fn read_response<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
    ) -> impl Future<Output = io::Result<ShardResponse>> + Send
    where
        T: AsyncRead + Unpin + Send,
    {
        let this = self.clone();
        async move { this.read_response_inner(io).await }
    }

    fn write_request<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        req: ShardRequest,
    ) -> impl Future<Output = io::Result<()>> + Send
    where
        T: AsyncWrite + Unpin + Send,
    {
        let this = self.clone();
        async move {
            let frame = frame::encode_request(&req, &this.limits)?;
            write_frame(io, frame, &this.timeouts).await
        }
    }

    fn write_response<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        resp: ShardResponse,
    ) -> impl Future<Output = io::Result<()>> + Send
    where
        T: AsyncWrite + Unpin + Send,
    {
        let this = self.clone();
        async move {
            let frame = frame::encode_response(&resp, &this.limits)?;
            write_frame(io, frame, &this.timeouts).await
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::messages::*;
    use crate::payload::{Encoding, Payload};
    use futures::io::Cursor;
    use libp2p::request_response::Codec;

    fn push(n: usize) -> ShardRequest {
        let values: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
        ShardRequest::PushGrad(PushGrad {
            run: RunId::new("r1").unwrap(),
            shard: 3,
            epoch: 7,
            base_version: 9,
            worker: libp2p::PeerId::random(),
            incarnation: 1,
            step: 11,
            samples: 32,
            grad: Payload::encode(&values, Encoding::F32).unwrap(),
        })
    }

    fn block_on<F: Future>(f: F) -> F::Output {
        futures::executor::block_on(f)
    }

    #[test]
    fn request_round_trips_through_a_stream() {
        let mut codec = ShardCodec::default();
        let req = push(1000);
        let mut buf = Cursor::new(Vec::new());
        block_on(codec.write_request(&SHARD_PROTOCOL, &mut buf, req.clone())).unwrap();
        let mut rd = Cursor::new(buf.into_inner());
        let back = block_on(codec.read_request(&SHARD_PROTOCOL, &mut rd)).unwrap();
        assert_eq!(back, req);
    }

    #[test]
    fn oversized_length_is_refused_before_allocating() {
        let limits = Limits { max_request_bytes: 4096, ..Limits::default() };
        let mut codec = ShardCodec::new(limits, Timeouts::default());
        // A prefix announcing a 1 TiB body and nothing after it: if the codec
        // allocated first it would abort; it must fail on the check instead.
        let prefix = FramePrefix { version: WIRE_VERSION, kind: FrameKind::Request, header_len: 10, body_len: 1 << 40 };
        let mut rd = Cursor::new(prefix.to_bytes().to_vec());
        let err = block_on(codec.read_request(&SHARD_PROTOCOL, &mut rd)).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("exceeds the limit"), "{err}");
    }

    #[test]
    fn sender_refuses_frames_over_its_limit() {
        let limits = Limits { max_request_bytes: 2048, ..Limits::default() };
        let mut codec = ShardCodec::new(limits, Timeouts::default());
        let mut buf = Cursor::new(Vec::new());
        let err = block_on(codec.write_request(&SHARD_PROTOCOL, &mut buf, push(1000))).unwrap_err();
        assert!(err.to_string().contains("exceeds the limit"), "{err}");
        assert!(buf.into_inner().is_empty(), "nothing may be written");
    }

    /// A frame of any other wire version, older or newer, is refused at its
    /// prefix with an error that names both versions, even when the message
    /// behind it would decode.
    #[test]
    fn a_frame_of_another_version_is_refused_naming_both_versions() {
        let mut writer = ShardCodec::default();
        let mut buf = Cursor::new(Vec::new());
        block_on(writer.write_request(&SHARD_PROTOCOL, &mut buf, push(10))).unwrap();
        let frame = buf.into_inner();
        let mut codec = ShardCodec::default();
        // Positive control: our own version is read.
        block_on(codec.read_request(&SHARD_PROTOCOL, &mut Cursor::new(frame.clone()))).unwrap();
        for theirs in [WIRE_VERSION + 1, WIRE_VERSION - 1, u16::MAX] {
            let mut bytes = frame.clone();
            bytes[2..4].copy_from_slice(&theirs.to_le_bytes());
            let err = block_on(codec.read_request(&SHARD_PROTOCOL, &mut Cursor::new(bytes.clone()))).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidData);
            let inner = err.get_ref().and_then(|e| e.downcast_ref::<ProtocolError>());
            assert!(
                matches!(inner, Some(&ProtocolError::VersionMismatch { ours: WIRE_VERSION, theirs: t }) if t == theirs),
                "{err:?}"
            );
            let text = err.to_string();
            assert!(text.contains(&format!("version {theirs}")) && text.contains(&format!("version {WIRE_VERSION}")));
            // The in-memory decoder refuses it the same way.
            let decoded = frame::decode_request_frame(Bytes::from(bytes), &Limits::default());
            assert!(matches!(
                decoded,
                Err(ProtocolError::VersionMismatch { ours: WIRE_VERSION, theirs: t }) if t == theirs
            ));
        }
    }

    /// A well-formed frame of our version whose header names no known
    /// request is handed to the node as `Undecodable`, to answer with an
    /// error instead of a reset stream.
    #[test]
    fn unknown_message_of_our_version_becomes_undecodable() {
        let mut codec = ShardCodec::default();
        let header = [99u8, 0, 0];
        let prefix = FramePrefix { version: WIRE_VERSION, kind: FrameKind::Request, header_len: 3, body_len: 0 };
        let mut bytes = prefix.to_bytes().to_vec();
        bytes.extend_from_slice(&header);
        let req = block_on(codec.read_request(&SHARD_PROTOCOL, &mut Cursor::new(bytes))).unwrap();
        match req.undecodable_reply() {
            Some(ShardResponse::Error(WireError { code: ErrorCode::InvalidRequest, .. })) => {}
            other => panic!("expected InvalidRequest, got {other:?}"),
        }
    }

    #[test]
    fn read_budget_is_shared_and_released() {
        let limits = Limits { max_inflight_read_bytes: 10_000, ..Limits::default() };
        let codec = ShardCodec::new(limits, Timeouts::default());
        let clone = codec.clone();
        let a = codec.reserve(6_000).unwrap();
        assert!(matches!(clone.reserve(6_000), Err(ProtocolError::Busy { in_flight: 6_000, .. })));
        drop(a);
        assert_eq!(clone.in_flight_read_bytes(), 0);
        let _b = clone.reserve(6_000).unwrap();
        // A full frame read also returns its reservation.
        let mut writer = ShardCodec::default();
        let mut buf = Cursor::new(Vec::new());
        block_on(writer.write_request(&SHARD_PROTOCOL, &mut buf, push(100))).unwrap();
        let mut reader = ShardCodec::default();
        block_on(reader.read_request(&SHARD_PROTOCOL, &mut Cursor::new(buf.into_inner()))).unwrap();
        assert_eq!(reader.in_flight_read_bytes(), 0);
    }

    #[test]
    fn truncated_body_is_an_error() {
        let mut codec = ShardCodec::default();
        let mut buf = Cursor::new(Vec::new());
        block_on(codec.write_request(&SHARD_PROTOCOL, &mut buf, push(100))).unwrap();
        let mut bytes = buf.into_inner();
        bytes.truncate(bytes.len() - 1);
        let err = block_on(codec.read_request(&SHARD_PROTOCOL, &mut Cursor::new(bytes))).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }

    /// A reader that never yields data.
    struct Never;
    impl AsyncRead for Never {
        fn poll_read(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            _: &mut [u8],
        ) -> std::task::Poll<io::Result<usize>> {
            std::task::Poll::Pending
        }
    }

    #[test]
    fn stalled_peer_hits_the_deadline() {
        // A reader that never yields data: the prefix deadline (base) fires.
        let timeouts = Timeouts { base_ms: 50, ..Timeouts::default() };
        let mut codec = ShardCodec::new(Limits::default(), timeouts);
        let err = block_on(codec.read_request(&SHARD_PROTOCOL, &mut Never)).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    }

    /// The same deadline inside a tokio runtime, where it is tokio's timer.
    #[tokio::test]
    async fn stalled_peer_hits_the_deadline_on_tokio() {
        let timeouts = Timeouts { base_ms: 50, ..Timeouts::default() };
        let mut codec = ShardCodec::new(Limits::default(), timeouts);
        let err = codec.read_request(&SHARD_PROTOCOL, &mut Never).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    }

    #[test]
    fn deadline_scales_with_size() {
        let t = Timeouts { base_ms: 10_000, min_throughput_bytes_per_sec: 1 << 20, ..Timeouts::default() };
        assert_eq!(t.for_bytes(0), Duration::from_secs(10));
        assert_eq!(t.for_bytes(100 << 20), Duration::from_secs(110));
        // The outer request-response timeout covers the largest exchange.
        let l = Limits::default();
        assert!(t.whole_exchange(&l) >= t.for_bytes(l.max_request_bytes) + t.for_bytes(l.max_response_bytes));
    }
}
